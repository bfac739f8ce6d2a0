//! The data-channel listener: accepts laptops' connections on :10801 and runs
//! one session task per connection. Plain TCP for now; TLS wraps the stream
//! here later (sessions take any `AsyncRead + AsyncWrite`).

use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tracing::{Instrument, debug, info, warn};

use crate::session::{SessionConfig, run_session};

/// TCP keepalive on data channels: probes after this much silence, so a
/// vanished laptop's session ends even if no heartbeat deadline is armed.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);

fn tune(stream: &TcpStream) {
    if let Err(e) = stream.set_nodelay(true) {
        debug!(error = %e, "cannot set TCP_NODELAY on data channel");
    }
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(Duration::from_secs(10));
    if let Err(e) = socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive) {
        debug!(error = %e, "cannot enable TCP keepalive on data channel");
    }
}

/// Accept sessions on `listener` forever.
pub async fn serve(listener: TcpListener, config: Arc<SessionConfig>) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        tune(&stream);
        let config = config.clone();
        let span = tracing::info_span!("conn", %peer);
        tokio::spawn(
            async move {
                info!("data channel connected");
                // run_session logs how the session ended.
                let _ = run_session(stream, &config).await;
            }
            .instrument(span),
        );
    }
}
