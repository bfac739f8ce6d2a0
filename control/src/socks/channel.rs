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
//! Resume, as the TUN path's workers do it: every dial's hello carries the
//! session's resume token (hello option 5, drawn once per session), so the
//! manager re-attaches the engine the lost connection parked and the flows go
//! on. When the manager answers a re-dial with "new" (it restarted, the grace
//! ran out), the flows it carried are gone there: every TCP flow of the stack
//! is reset at once, so SOCKS clients see a reset instead of a stall.
//!
//! I/O: the TCP/TLS stream to the agent; the stack is driven from here.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use kvpn_dataplane::liveness::{LIVENESS_WINDOW, Liveness};
use kvpn_dataplane::session::{DIAL_TIMEOUT, DataStream, dial_manager, hello_frame_for_worker};
use kvpn_dataplane::tls::TlsClient;
use kvpn_proto::frame::{self, Kind, RESUME_TOKEN_LEN, ResumeAnswer};
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

/// Counters of the data channel, as `kvpn status` shows them for a TUN
/// session's workers (same names, same meaning).
#[derive(Debug, Default)]
pub struct ChannelStats {
    /// Heartbeats sent.
    pub heartbeats_sent: AtomicU64,
    /// Heartbeat echoes received.
    pub heartbeats_echoed: AtomicU64,
    /// Data connections that ended after they had been up.
    pub transports_lost: AtomicU64,
    /// Re-dials the manager answered with "resumed": the flows went on.
    pub resumes: AtomicU64,
    /// Re-dials the manager answered with "new": its flows were gone.
    pub resumes_lost: AtomicU64,
    /// TCP flows reset on the laptop because a re-dial could not resume them.
    pub tcp_flows_reset: AtomicU64,
}

impl ChannelStats {
    /// A counter's value.
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }

    fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

/// Keep the data channel up until `stop_rx` turns true.
pub async fn run(
    stack: Arc<Stack>,
    config: ChannelConfig,
    liveness: SharedLiveness,
    stats: Arc<ChannelStats>,
    mut stop_rx: watch::Receiver<bool>,
) {
    // One token for the session's life: every re-dial presents it.
    let resume_token: [u8; RESUME_TOKEN_LEN] = rand::random();
    let hello = match hello_frame_for_worker(
        config.tunnel_ip,
        &config.token,
        None,
        None,
        None,
        None,
        Some(resume_token),
    ) {
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
                    exit = carry(stream, &stack, &liveness, &stats) => exit,
                };
                ChannelStats::add(&stats.transports_lost, 1);
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

async fn carry(
    stream: DataStream,
    stack: &Stack,
    liveness: &SharedLiveness,
    stats: &ChannelStats,
) -> String {
    match stream {
        DataStream::Plain(s) => carry_on(s, stack, liveness, stats).await,
        DataStream::Tls(s) => carry_on(*s, stack, liveness, stats).await,
    }
}

/// The manager's answer to the hello's resume token. On "new" after a
/// re-dial, the flows the manager carried are gone: reset every TCP flow of
/// the stack so SOCKS clients see it at once (not after their own timeout).
fn handle_resume_answer(payload: &[u8], stack: &Stack, stats: &ChannelStats) {
    let redialled = ChannelStats::get(&stats.transports_lost) > 0;
    match ResumeAnswer::decode(payload) {
        Some(ResumeAnswer::Resumed) if redialled => {
            ChannelStats::add(&stats.resumes, 1);
            tracing::info!("the SOCKS session's flows resumed after a re-dial");
        }
        Some(ResumeAnswer::New) if redialled => {
            ChannelStats::add(&stats.resumes_lost, 1);
            let reset = stack.reset_tcp_flows();
            ChannelStats::add(&stats.tcp_flows_reset, reset as u64);
            if reset > 0 {
                tracing::warn!(
                    flows = reset,
                    "the traffic manager lost the SOCKS session's flows (it answered the re-dial with a new session): reset them on the laptop"
                );
            }
        }
        Some(_) => {}
        None => tracing::debug!(len = payload.len(), "resume answer ignored"),
    }
}

/// Move packets between `stream` and the stack until the stream fails or falls
/// silent; returns why it ended.
async fn carry_on<S>(
    stream: S,
    stack: &Stack,
    liveness: &SharedLiveness,
    stats: &ChannelStats,
) -> String
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
                                if lock(liveness).handle_echo(f.payload, Instant::now()) {
                                    ChannelStats::add(&stats.heartbeats_echoed, 1);
                                }
                            }
                            Kind::Resume => handle_resume_answer(f.payload, stack, stats),
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
            if let Some(nonce) = beat {
                match frame::encode_into(Kind::Heartbeat, &nonce, &mut out) {
                    Ok(()) => ChannelStats::add(&stats.heartbeats_sent, 1),
                    Err(e) => tracing::debug!(error = %e, "cannot encode a heartbeat"),
                }
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

#[cfg(test)]
mod tests {
    use super::*;
    use kvpn_dataplane::liveness::State;
    use smoltcp::wire::{IpProtocol, Ipv4Packet};

    /// Read frames from `rd` until one of `kind` arrives; returns its payload.
    async fn next_frame<R: AsyncRead + Unpin>(
        rd: &mut R,
        buf: &mut Vec<u8>,
        kind: Kind,
    ) -> Vec<u8> {
        let decoder = frame::Decoder::default();
        loop {
            if let Some((f, used)) = decoder
                .decode(buf)
                .unwrap_or_else(|e| panic!("bad frame from the client: {e}"))
            {
                let (k, payload) = (f.kind, f.payload.to_vec());
                buf.drain(..used);
                if k == kind {
                    return payload;
                }
                continue;
            }
            let mut chunk = [0u8; 4096];
            let n = tokio::time::timeout(Duration::from_secs(5), rd.read(&mut chunk))
                .await
                .unwrap_or_else(|_| panic!("no {kind:?} frame within 5 s"))
                .unwrap_or_else(|e| panic!("read: {e}"));
            assert!(n > 0, "the client closed before a {kind:?} frame");
            buf.extend_from_slice(&chunk[..n]);
        }
    }

    #[tokio::test]
    async fn heartbeats_are_echoed_into_liveness_and_stack_packets_become_frames() {
        let now = Instant::now();
        let stack = Stack::new(
            "100.96.0.9".parse().unwrap_or_else(|e| panic!("{e}")),
            3,
            now,
        );
        let liveness: SharedLiveness =
            Arc::new(Mutex::new(Liveness::new(Duration::from_millis(200))));
        lock(&liveness).handle_transport_up(now);
        let (client_side, manager_side) = tokio::io::duplex(1 << 20);
        let carried = {
            let stack = stack.clone();
            let liveness = liveness.clone();
            tokio::spawn(async move {
                carry_on(client_side, &stack, &liveness, &ChannelStats::default()).await
            })
        };
        let (mut rd, mut wr) = tokio::io::split(manager_side);
        let mut buf = Vec::new();

        // The first heartbeat is due at once; echoing it makes the session connected.
        let nonce = next_frame(&mut rd, &mut buf, Kind::Heartbeat).await;
        assert_eq!(nonce.len(), 8);
        let mut echo = Vec::new();
        frame::encode_into(Kind::Heartbeat, &nonce, &mut echo).unwrap_or_else(|e| panic!("{e}"));
        wr.write_all(&echo).await.unwrap_or_else(|e| panic!("{e}"));
        let deadline = Instant::now() + Duration::from_secs(5);
        while lock(&liveness).state(Instant::now()).0 != State::Connected {
            assert!(Instant::now() < deadline, "the echo did not count");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }

        // A SOCKS CONNECT's SYN leaves as one Packet frame from the tunnel IP.
        let conn = stack
            .tcp_connect("10.244.1.11:8080".parse().unwrap_or_else(|e| panic!("{e}")))
            .unwrap_or_else(|e| panic!("{e}"));
        let syn = next_frame(&mut rd, &mut buf, Kind::Packet).await;
        let v4 = Ipv4Packet::new_checked(&syn[..]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(v4.src_addr().to_string(), "100.96.0.9");
        assert_eq!(v4.dst_addr().to_string(), "10.244.1.11");
        assert_eq!(v4.next_header(), IpProtocol::Tcp);
        drop(conn);

        // The manager going away ends the transport with a reason.
        drop(rd);
        drop(wr);
        let reason = tokio::time::timeout(Duration::from_secs(5), carried)
            .await
            .unwrap_or_else(|_| panic!("carry_on did not end"))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            reason.contains("closed") || reason.contains("failed"),
            "{reason}"
        );
    }

    #[tokio::test]
    async fn a_silent_manager_ends_the_transport_after_the_liveness_window() {
        let now = Instant::now();
        let stack = Stack::new(
            "100.96.0.9".parse().unwrap_or_else(|e| panic!("{e}")),
            3,
            now,
        );
        // 20 ms heartbeats: the window is 3 intervals.
        let liveness: SharedLiveness =
            Arc::new(Mutex::new(Liveness::new(Duration::from_millis(20))));
        lock(&liveness).handle_transport_up(now);
        let (client_side, _manager_side) = tokio::io::duplex(1 << 20);
        let reason = tokio::time::timeout(
            Duration::from_secs(5),
            carry_on(client_side, &stack, &liveness, &ChannelStats::default()),
        )
        .await
        .unwrap_or_else(|_| panic!("a silent transport was not given up"));
        assert!(reason.contains("no heartbeat echo"), "{reason}");
    }
}
