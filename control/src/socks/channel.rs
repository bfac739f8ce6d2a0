//! The data channel of a SOCKS session: the same one the root daemon keeps for a
//! TUN session. TCP to the session agent's loopback listener (each connection
//! becomes a port-forward to the current manager pod), TLS 1.3 verified against
//! the CA of Secret `kvpn-manager-tls`, a hello frame with the lease's tunnel IP
//! and token, then Packet frames both ways and a heartbeat every second; after
//! [`LIVENESS_WINDOW`] without an echo the transport counts as dead and is
//! re-dialled, while the [`Stack`] (and so every TCP flow's state) lives on.
//!
//! The dial, TLS, hello and liveness pieces are the root daemon's own
//! (`kvpn_dataplane::{session, tls, liveness}`); only the pump differs: packets
//! come from the laptop-side smoltcp stack instead of a TUN device.
//!
//! I/O: the TCP/TLS stream to the agent; the stack is driven from here.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use kvpn_dataplane::liveness::{LIVENESS_WINDOW, Liveness};
use kvpn_dataplane::session::{DIAL_TIMEOUT, DataStream, dial_manager, hello_frame};
use kvpn_dataplane::tls::TlsClient;
use kvpn_proto::frame::{self, Kind};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::sync::watch;

use super::stack::Stack;

/// First and longest pause between re-dials, as the root daemon's supervisor.
const REDIAL_BACKOFF: (Duration, Duration) = (Duration::from_millis(250), Duration::from_secs(2));

/// What the channel needs.
#[derive(Debug, Clone)]
pub struct ChannelConfig {
    /// Where to dial: the session agent's loopback listener, `host:port`.
    pub target: String,
    /// TLS to the manager (CA and name from Secret `kvpn-manager-tls`).
    pub tls: Option<TlsClient>,
    /// The leased tunnel IP.
    pub tunnel_ip: std::net::IpAddr,
    /// The lease's session token.
    pub token: Vec<u8>,
    /// Heartbeat interval.
    pub heartbeat_interval: Duration,
}

/// Liveness shared with whoever reports status.
pub type SharedLiveness = Arc<Mutex<Liveness>>;

/// Keep the data channel up until `stop_rx` turns true.
pub async fn run(
    stack: Arc<Stack>,
    config: ChannelConfig,
    liveness: SharedLiveness,
    mut stop_rx: watch::Receiver<bool>,
) {
    let hello = match hello_frame(config.tunnel_ip, &config.token) {
        Ok(h) => h,
        Err(e) => {
            lock(&liveness).handle_transport_down(format!("cannot encode the hello frame: {e}"));
            return;
        }
    };
    let mut backoff = REDIAL_BACKOFF.0;
    loop {
        let dialled = tokio::select! {
            _ = stop_rx.changed() => return,
            r = dial(&config, &hello) => r,
        };
        let exit = match dialled {
            Ok(stream) => {
                tracing::info!(target = %config.target, security = stream.security(), "data channel to the traffic manager open, hello sent");
                lock(&liveness).handle_transport_up(Instant::now());
                let exit = tokio::select! {
                    _ = stop_rx.changed() => return,
                    exit = carry(stream, &stack, &liveness) => exit,
                };
                let proven = lock(&liveness).last_rtt().is_some();
                if proven {
                    backoff = REDIAL_BACKOFF.0;
                }
                exit
            }
            Err(reason) => reason,
        };
        tracing::warn!(reason = %exit, retry_in_ms = backoff.as_millis(), "data channel lost, re-dialling the traffic manager");
        lock(&liveness).handle_transport_down(exit);
        tokio::select! {
            _ = stop_rx.changed() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(REDIAL_BACKOFF.1);
    }
}

fn lock(l: &SharedLiveness) -> std::sync::MutexGuard<'_, Liveness> {
    l.lock().unwrap_or_else(PoisonError::into_inner)
}

async fn dial(config: &ChannelConfig, hello: &[u8]) -> Result<DataStream, String> {
    let tcp = dial_manager(&config.target, DIAL_TIMEOUT).await?;
    let mut stream = DataStream::secure(tcp, config.tls.as_ref(), &config.target).await?;
    let sent = match &mut stream {
        DataStream::Plain(s) => write_flush(s, hello).await,
        DataStream::Tls(s) => write_flush(s, hello).await,
    };
    sent.map_err(|e| {
        format!(
            "cannot send hello to the traffic manager at {}: {e}",
            config.target
        )
    })?;
    Ok(stream)
}

async fn write_flush<S: AsyncWrite + Unpin>(s: &mut S, data: &[u8]) -> std::io::Result<()> {
    s.write_all(data).await?;
    s.flush().await
}

async fn carry(stream: DataStream, stack: &Stack, liveness: &SharedLiveness) -> String {
    match stream {
        DataStream::Plain(s) => carry_on(s, stack, liveness).await,
        DataStream::Tls(s) => carry_on(*s, stack, liveness).await,
    }
}

/// Move packets between `stream` and the stack until the stream fails or falls
/// silent; returns why it ended.
async fn carry_on<S>(stream: S, stack: &Stack, liveness: &SharedLiveness) -> String
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (mut rd, mut wr) = tokio::io::split(stream);
    let inbound = async {
        let decoder = frame::Decoder::default();
        let mut buf: Vec<u8> = Vec::with_capacity(256 * 1024);
        let mut chunk = vec![0u8; 128 * 1024];
        loop {
            let n = match rd.read(&mut chunk).await {
                Ok(0) => return "the traffic manager closed the data channel".to_owned(),
                Ok(n) => n,
                Err(e) => return format!("reading the data channel failed: {e}"),
            };
            buf.extend_from_slice(&chunk[..n]);
            let mut used = 0;
            loop {
                match decoder.decode(&buf[used..]) {
                    Ok(Some((f, consumed))) => {
                        match f.kind {
                            Kind::Packet => stack.handle_packet(f.payload.to_vec()),
                            Kind::Heartbeat => {
                                lock(liveness).handle_echo(f.payload, Instant::now());
                            }
                            other => tracing::debug!(kind = ?other, "ignoring a frame"),
                        }
                        used += consumed;
                    }
                    Ok(None) => break,
                    Err(e) => return format!("the traffic manager sent a bad frame: {e}"),
                }
            }
            buf.drain(..used);
        }
    };
    let outbound = async {
        let mut out: Vec<u8> = Vec::with_capacity(256 * 1024);
        loop {
            let now = Instant::now();
            let (packets, delay) = stack.poll(now);
            out.clear();
            for p in &packets {
                if let Err(e) = frame::encode_into(Kind::Packet, p, &mut out) {
                    tracing::debug!(error = %e, len = p.len(), "packet too large for a frame, dropped");
                }
            }
            let (beat, dead, next_beat) = {
                let mut l = lock(liveness);
                let beat = l.poll_heartbeat(now);
                (beat, l.transport_dead(now), l.poll_timeout())
            };
            if dead {
                return format!(
                    "no heartbeat echo from the traffic manager for {} s",
                    LIVENESS_WINDOW.as_secs()
                );
            }
            if let Some(nonce) = beat
                && let Err(e) = frame::encode_into(Kind::Heartbeat, &nonce, &mut out)
            {
                tracing::debug!(error = %e, "cannot encode a heartbeat");
            }
            if !out.is_empty()
                && let Err(e) = write_flush(&mut wr, &out).await
            {
                return format!("writing the data channel failed: {e}");
            }
            let mut wake_at = now + Duration::from_secs(1);
            if let Some(d) = delay {
                wake_at = wake_at.min(now + d);
            }
            if let Some(t) = next_beat {
                wake_at = wake_at.min(t);
            }
            tokio::select! {
                () = stack.wake().notified() => {}
                () = tokio::time::sleep_until(wake_at.into()) => {}
            }
        }
    };
    tokio::select! {
        r = inbound => r,
        r = outbound => r,
    }
}
