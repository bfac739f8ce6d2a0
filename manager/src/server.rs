//! The data-channel listener: accepts laptops' connections on :10801 and runs
//! one session task per connection, over TLS 1.3 when the manager has a serving
//! certificate (the Kubernetes install always gives it one), else plain TCP
//! (the static lab and `kvpn connect --manager`). Sessions take any
//! `AsyncRead + AsyncWrite`, so TLS only wraps the stream here.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvpn_proto::channel;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tracing::{Instrument, debug, info, warn};

use crate::metrics::HelloRefusal;
use crate::session::{SessionConfig, run_session};
use crate::window;

/// TCP keepalive on data channels: probes after this much silence, so a
/// vanished laptop's session ends even if no heartbeat deadline is armed.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);

fn tune(stream: &TcpStream) {
    if let Err(e) = stream.set_nodelay(true) {
        debug!(error = %e, "cannot set TCP_NODELAY on data channel");
    }
    if let Err(e) = channel::set_notsent_lowat(stream, channel::NOTSENT_LOWAT) {
        debug!(error = %e, "cannot set TCP_NOTSENT_LOWAT on data channel");
    }
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(Duration::from_secs(10));
    if let Err(e) = socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive) {
        debug!(error = %e, "cannot enable TCP keepalive on data channel");
    }
}

/// The session config for a connection from `peer`: with
/// [`SessionConfig::auto_tcp_window`], its TCP flows' window follows the
/// connection's round trip ([`window::flow_window`]; `tcp_window` is the most).
fn with_flow_window(
    config: &Arc<SessionConfig>,
    stream: &TcpStream,
    peer: SocketAddr,
) -> Arc<SessionConfig> {
    if !config.auto_tcp_window {
        return config.clone();
    }
    let rtt = window::connection_rtt(stream).unwrap_or_else(|e| {
        debug!(error = %e, "cannot read TCP_INFO of data channel");
        None
    });
    let tcp_window = window::flow_window(peer.ip(), rtt, config.tcp_window);
    debug!(?rtt, tcp_window, "flow window of data channel");
    if tcp_window == config.tcp_window {
        return config.clone();
    }
    Arc::new(SessionConfig {
        tcp_window,
        ..SessionConfig::clone(config)
    })
}

/// Accept sessions on `listener` forever. With `tls`, every connection must
/// complete a TLS handshake (within the hello timeout) before its session starts.
pub async fn serve(
    listener: TcpListener,
    config: Arc<SessionConfig>,
    tls: Option<Arc<rustls::ServerConfig>>,
) {
    let acceptor = tls.map(TlsAcceptor::from);
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
        let config = with_flow_window(&config, &stream, peer);
        let acceptor = acceptor.clone();
        let security = if acceptor.is_some() { "tls" } else { "plain" };
        let span = tracing::info_span!("conn", %peer, security);
        tokio::spawn(
            async move {
                // Debug, not info: the readiness probe connects every few seconds.
                debug!("data channel connected");
                // run_session logs how the session ended.
                match acceptor {
                    None => {
                        let _ = run_session(stream, &config).await;
                    }
                    Some(acceptor) => {
                        if let Some(tls) = accept_tls(&acceptor, stream, peer, &config).await {
                            let _ = run_session(tls, &config).await;
                        }
                    }
                }
            }
            .instrument(span),
        );
    }
}

/// Run the server side of the TLS handshake; `None` (logged) when it fails.
/// A connection closed before the handshake (the readiness probe, a port scan)
/// is logged at debug only; other failures (wrong CA on the laptop, a plain-TCP
/// client, a timeout) at info, as they point at a misconfigured laptop, not at
/// the manager.
async fn accept_tls(
    acceptor: &TlsAcceptor,
    stream: TcpStream,
    peer: SocketAddr,
    config: &SessionConfig,
) -> Option<tokio_rustls::server::TlsStream<TcpStream>> {
    match tokio::time::timeout(config.hello_timeout, acceptor.accept(stream)).await {
        Ok(Ok(tls)) => {
            debug!("TLS handshake done");
            Some(tls)
        }
        Ok(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => {
            debug!(%peer, "connection closed before completing the TLS handshake (probe?)");
            None
        }
        Ok(Err(e)) => {
            config.counters.refuse_hello(HelloRefusal::Tls);
            info!(%peer, error = %e, "TLS handshake failed; is the laptop using the CA from Secret kvpn-manager-tls?");
            None
        }
        Err(_) => {
            config.counters.refuse_hello(HelloRefusal::Tls);
            info!(%peer, timeout = ?config.hello_timeout, "no TLS handshake in time; connection dropped");
            None
        }
    }
}
