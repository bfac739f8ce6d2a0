//! SOCKS5 mode: `kvpn connect --socks [--socks-listen 127.0.0.1:1080]` puts a
//! SOCKS5 server on the laptop instead of a TUN device. No root daemon, no
//! routes, no root: the unprivileged user daemon (`kvpn daemon`) owns a laptop-side
//! TCP/IP stack ([`stack`], smoltcp) with the leased tunnel IP and carries its
//! packets over the same data channel a TUN session uses ([`channel`]: TLS
//! over the API-server port-forward, hello with the lease token, heartbeats).
//! SOCKS CONNECT becomes a TCP flow on that stack, UDP ASSOCIATE a UDP flow,
//! and domain names are resolved by the cluster DNS the way a pod of the
//! connected namespace resolves them ([`dns`]); see [`server`].
//!
//! This module: the session task ([`start`] → [`SocksTask`]) the session
//! process hosts, its status record (a JSON file in the user daemon's private folder,
//! rewritten twice a second, read by the user daemon for `kvpn status`), and the CLI side of
//! connect, status and disconnect for SOCKS sessions.
//!
//! I/O: the status file; the rest lives in the submodules.

pub mod channel;
pub mod cli;
pub mod dns;
pub mod server;
pub mod stack;

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow};
use kvpn_dataplane::liveness::{HEARTBEAT_INTERVAL, Liveness};
use kvpn_dataplane::tls::TlsClient;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use self::dns::{ClusterDnsConfig, Resolver};
use self::stack::Stack;

/// `Origin.transport` / the `transport` column of a SOCKS session.
pub const TRANSPORT_SOCKS: &str = "socks";

/// The default SOCKS listen address, 127.0.0.1:1080.
pub const DEFAULT_LISTEN: SocketAddr =
    SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 1080);

/// The address a client on this machine dials for a SOCKS server listening on
/// `listen`: a wildcard (0.0.0.0, ::) is no address to dial, so its loopback
/// address of the same family, on the same port.
pub fn dial_address(listen: SocketAddr) -> SocketAddr {
    match listen.ip() {
        IpAddr::V4(v4) if v4.is_unspecified() => {
            SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), listen.port())
        }
        IpAddr::V6(v6) if v6.is_unspecified() => {
            SocketAddr::new(std::net::Ipv6Addr::LOCALHOST.into(), listen.port())
        }
        _ => listen,
    }
}

/// The `curl` line `kvpn connect --socks` prints for a server on `listen`.
pub fn curl_hint(listen: SocketAddr) -> String {
    format!(
        "try: curl --socks5-hostname {} http://<service>.<namespace>/ (names resolve through the cluster DNS)",
        dial_address(listen)
    )
}

/// The warning of a connect that found its SOCKS session running and was
/// asked for another listen address (`None`: nothing asked, or the same).
/// The session keeps its address: moving it would cut the flows open on it.
pub fn listen_not_applied(
    asked: Option<SocketAddr>,
    session_id: &str,
    session_listen: &str,
) -> Option<String> {
    let asked = asked?;
    if session_listen.parse::<SocketAddr>().ok() == Some(asked) {
        return None;
    }
    Some(format!(
        "--socks-listen {asked} not applied: session {session_id} already listens on \
         {session_listen} — `kvpn disconnect {session_id}`, then connect again with it"
    ))
}

/// The warning for a SOCKS server listening where other machines can reach
/// it (`--socks-allow-remote`): `None` on a loopback address.
pub fn remote_warning(listen: &str) -> Option<String> {
    let addr: SocketAddr = listen.parse().ok()?;
    if addr.ip().is_loopback() {
        return None;
    }
    Some(format!(
        "the SOCKS5 proxy on {addr} has no authentication and is reachable from other \
         machines: anyone who can reach it can open connections into the cluster through \
         this session — listen on 127.0.0.1 (`--socks-listen 127.0.0.1:{}`) unless that is \
         what you want",
        addr.port()
    ))
}

/// Which cluster a SOCKS session leads to (shown by `kvpn status`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SocksOrigin {
    /// Kubeconfig cluster name.
    pub cluster: String,
    /// API server URL.
    pub server: String,
    /// Kubeconfig context.
    pub context: String,
    /// Namespace of the traffic manager.
    pub manager_namespace: String,
}

/// Everything the session process needs to run a SOCKS session.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SocksConfig {
    /// Session id (`socks-` and 6 hex digits).
    pub id: String,
    /// Where the SOCKS server listens.
    pub listen: SocketAddr,
    /// The leased tunnel IP.
    pub tunnel_ip: IpAddr,
    /// The lease's session token (hello frame).
    pub session_token: String,
    /// CA of Secret `kvpn-manager-tls` (PEM) and the name the manager's
    /// certificate must carry; both empty = plain TCP.
    pub tls_ca_pem: String,
    /// See `tls_ca_pem`.
    pub tls_server_name: String,
    /// The cluster DNS.
    pub dns: ClusterDnsConfig,
    /// Which cluster.
    pub origin: SocksOrigin,
    /// Where to keep the status record.
    pub status_file: PathBuf,
}

/// The status record of a SOCKS session (`kvpn status`, JSON file).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SocksStatus {
    /// Session id.
    pub id: String,
    /// Always [`TRANSPORT_SOCKS`].
    pub transport: String,
    /// The SOCKS listen address.
    pub socks_listen: String,
    /// Tunnel IP.
    pub tunnel_ip: String,
    /// Which cluster.
    pub origin: SocksOrigin,
    /// "connecting", "connected", "reconnecting", or "failed" (session process gone).
    pub state: String,
    /// Why it is not connected.
    pub reason: String,
    /// Milliseconds since the session started.
    pub uptime_ms: u64,
    /// Packets/bytes to the manager.
    pub tx_packets: u64,
    /// Bytes to the manager.
    pub tx_bytes: u64,
    /// Packets from the manager.
    pub rx_packets: u64,
    /// Bytes from the manager.
    pub rx_bytes: u64,
    /// Sockets open on the laptop-side stack (TCP and UDP flows, DNS queries).
    pub open_flows: u64,
    /// The cluster DNS servers SOCKS names are resolved with.
    pub dns_servers: Vec<String>,
    /// The laptop-side stack's MTU, bytes.
    #[serde(default)]
    pub mtu: u32,
    /// Heartbeat interval, ms.
    #[serde(default)]
    pub heartbeat_interval_ms: u32,
    /// Without an echo for this long the data channel counts as dead, ms.
    #[serde(default)]
    pub liveness_window_ms: u32,
    /// Heartbeats sent.
    #[serde(default)]
    pub heartbeats_sent: u64,
    /// Heartbeat echoes received.
    #[serde(default)]
    pub heartbeats_echoed: u64,
    /// Round-trip time of the latest echo, µs (0 = none yet).
    #[serde(default)]
    pub last_rtt_us: u64,
    /// Data connections that ended after they had been up.
    #[serde(default)]
    pub transports_lost: u64,
    /// Re-dials answered with "resumed".
    #[serde(default)]
    pub resumes: u64,
    /// Re-dials answered with "new" (the manager had lost the flows).
    #[serde(default)]
    pub resumes_lost: u64,
    /// TCP flows reset on the laptop after a "new".
    #[serde(default)]
    pub tcp_flows_reset: u64,
    /// The session process's pid.
    pub pid: u32,
    /// When this record was written, Unix ms.
    pub written_unix_ms: u64,
}

/// A running SOCKS session; [`SocksTask::stop`] ends it.
#[derive(Debug)]
pub struct SocksTask {
    stop_tx: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    status_file: PathBuf,
}

impl SocksTask {
    /// Stop the server, the data channel and the status record.
    pub async fn stop(self) {
        let _ = self.stop_tx.send(true);
        for t in &self.tasks {
            t.abort();
        }
        for t in self.tasks {
            let _ = t.await;
        }
        let _ = std::fs::remove_file(&self.status_file);
    }
}

/// Start a SOCKS session whose data channel dials `data_target` (the session
/// user daemon's loopback listener, `host:port`). Binds the SOCKS listener before it
/// returns, so a taken port is an error here.
pub async fn start(config: SocksConfig, data_target: String) -> Result<SocksTask> {
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|e| listen_error(config.listen, &e))?;
    let tls = TlsClient::from_request(&config.tls_ca_pem, &config.tls_server_name)
        .context("the traffic manager's TLS settings are unusable")?;
    let now = Instant::now();
    let stack = Stack::new(config.tunnel_ip, rand::random(), now);
    let liveness = Arc::new(Mutex::new(Liveness::new(HEARTBEAT_INTERVAL)));
    let stats = Arc::new(channel::ChannelStats::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    let channel = tokio::spawn(channel::run(
        stack.clone(),
        channel::ChannelConfig {
            target: data_target,
            tls,
            tunnel_ip: config.tunnel_ip,
            token: config.session_token.as_bytes().to_vec(),
            heartbeat_interval: HEARTBEAT_INTERVAL,
        },
        liveness.clone(),
        stats.clone(),
        stop_rx,
    ));
    let server = server::Server {
        stack: stack.clone(),
        resolver: Resolver::new(stack.clone(), config.dns.clone()),
    };
    tracing::info!(listen = %config.listen, tunnel_ip = %config.tunnel_ip, "SOCKS5 server listening");
    let serve = tokio::spawn(server.serve(listener));
    let status_file = config.status_file.clone();
    let status = tokio::spawn(async move {
        loop {
            let record = snapshot(&config, &stack, &liveness, &stats, now);
            if let Err(e) = write_status(&config.status_file, &record) {
                tracing::warn!(error = %e, "cannot write the SOCKS session's status record");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
    Ok(SocksTask {
        stop_tx,
        tasks: vec![channel, serve, status],
        status_file,
    })
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

fn snapshot(
    config: &SocksConfig,
    stack: &Stack,
    liveness: &Mutex<Liveness>,
    stats: &channel::ChannelStats,
    started: Instant,
) -> SocksStatus {
    let now = Instant::now();
    let (state, reason, interval, window, rtt) = {
        let l = liveness.lock().unwrap_or_else(PoisonError::into_inner);
        let (state, reason) = l.state(now);
        (state, reason, l.interval(), l.window(), l.last_rtt())
    };
    let ms = |d: Duration| u32::try_from(d.as_millis()).unwrap_or(u32::MAX);
    let get = channel::ChannelStats::get;
    let c = stack.counters();
    SocksStatus {
        id: config.id.clone(),
        transport: TRANSPORT_SOCKS.to_owned(),
        socks_listen: config.listen.to_string(),
        tunnel_ip: config.tunnel_ip.to_string(),
        origin: config.origin.clone(),
        state: state.as_str().to_owned(),
        reason: reason.unwrap_or_default(),
        uptime_ms: u64::try_from(now.duration_since(started).as_millis()).unwrap_or(u64::MAX),
        tx_packets: c.tx_packets,
        tx_bytes: c.tx_bytes,
        rx_packets: c.rx_packets,
        rx_bytes: c.rx_bytes,
        open_flows: stack.open_flows() as u64,
        dns_servers: config.dns.servers.iter().map(|s| s.to_string()).collect(),
        mtu: u32::try_from(stack::MTU).unwrap_or(u32::MAX),
        heartbeat_interval_ms: ms(interval),
        liveness_window_ms: ms(window),
        heartbeats_sent: get(&stats.heartbeats_sent),
        heartbeats_echoed: get(&stats.heartbeats_echoed),
        last_rtt_us: rtt.map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX)),
        transports_lost: get(&stats.transports_lost),
        resumes: get(&stats.resumes),
        resumes_lost: get(&stats.resumes_lost),
        tcp_flows_reset: get(&stats.tcp_flows_reset),
        pid: std::process::id(),
        written_unix_ms: unix_ms(),
    }
}

fn write_status(path: &Path, record: &SocksStatus) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(record)?)
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))
}

/// The status record file of session `id` in the user daemon's folder.
pub fn status_path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.socks.json"))
}

/// How SOCKS session ids start (root daemon session ids never do).
pub const ID_PREFIX: &str = "socks-";

/// A new session id.
pub fn new_id() -> String {
    format!("{ID_PREFIX}{:06x}", rand::random::<u32>() & 0xff_ffff)
}

/// Parse `--socks-listen`.
pub fn parse_listen(text: &str) -> Result<SocketAddr> {
    text.parse().map_err(|_| {
        anyhow!("--socks-listen {text:?} is not HOST:PORT with an IP address, e.g. 127.0.0.1:1080")
    })
}

/// Whether the SOCKS listener could bind `addr` now: binds it and lets it go,
/// so `kvpn connect --socks` fails before it touches the cluster. The error is
/// [`listen_error`]'s.
pub fn check_listen(addr: SocketAddr) -> std::result::Result<(), std::io::Error> {
    std::net::TcpListener::bind(addr).map(drop)
}

/// The user-facing error for a SOCKS listener that cannot bind `addr`: the
/// address, the cause in words and the fix.
pub fn listen_error(addr: SocketAddr, cause: &std::io::Error) -> anyhow::Error {
    let (why, fix) = match cause.raw_os_error() {
        Some(libc::EADDRNOTAVAIL) => (
            format!("{} is not an address of this machine", addr.ip()),
            format!(
                "give one of its addresses, e.g. --socks-listen 127.0.0.1:{}",
                addr.port()
            ),
        ),
        Some(libc::EADDRINUSE) => (
            "the port is in use by another program".to_owned(),
            format!(
                "pick a free port with --socks-listen, or stop the program using it \
                 (`ss -ltnp 'sport = :{}'` names it)",
                addr.port()
            ),
        ),
        Some(libc::EACCES) => (
            "ports below 1024 need privileges".to_owned(),
            "pick a port of 1024 or above with --socks-listen, e.g. 127.0.0.1:1080".to_owned(),
        ),
        _ => (
            "the address cannot be bound".to_owned(),
            "pick another address with --socks-listen, e.g. 127.0.0.1:1080".to_owned(),
        ),
    };
    anyhow!("cannot listen for SOCKS5 on {addr}: {why} ({cause}) — {fix}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--socks-listen 192.0.2.1:1080` (an address this machine does not have):
    /// refused by the early check with the address, the cause and the fix — no
    /// "another proxy" guess.
    #[test]
    fn socks_listen_on_a_foreign_address_names_it() {
        let addr: SocketAddr = "192.0.2.1:1080".parse().expect("test address");
        let e = check_listen(addr).expect_err("192.0.2.1 is no address of this machine");
        let msg = listen_error(addr, &e).to_string();
        assert!(msg.contains("192.0.2.1:1080"), "{msg}");
        assert!(msg.contains("not an address of this machine"), "{msg}");
        assert!(msg.contains("--socks-listen 127.0.0.1:1080"), "{msg}");
        assert!(!msg.contains("another proxy"), "{msg}");
    }

    /// The printed curl line dials loopback when the server listens on a
    /// wildcard address (on main: `curl --socks5-hostname 0.0.0.0:1081`).
    #[test]
    fn curl_hint_dials_loopback_for_a_wildcard_listen() {
        for (listen, dial) in [
            ("0.0.0.0:1081", "127.0.0.1:1081"),
            ("[::]:1080", "[::1]:1080"),
            ("127.0.0.1:1080", "127.0.0.1:1080"),
            ("192.0.2.7:1080", "192.0.2.7:1080"),
            ("[fd00::1]:1080", "[fd00::1]:1080"),
        ] {
            let listen: SocketAddr = listen.parse().expect("test address");
            let hint = curl_hint(listen);
            assert!(
                hint.contains(&format!("curl --socks5-hostname {dial} ")),
                "{listen}: {hint}"
            );
        }
    }

    /// A connect that found its SOCKS session on another address says the
    /// asked one was not applied and how to get it (on main: only "nothing to
    /// do"); the same address, or none asked, is no warning.
    #[test]
    fn another_listen_address_for_a_running_session_is_named() {
        let asked: SocketAddr = "127.0.0.1:1081".parse().expect("test address");
        let w =
            listen_not_applied(Some(asked), "socks-abc123", "127.0.0.1:1080").expect("a warning");
        assert_eq!(
            w,
            "--socks-listen 127.0.0.1:1081 not applied: session socks-abc123 already listens \
             on 127.0.0.1:1080 — `kvpn disconnect socks-abc123`, then connect again with it"
        );
        assert_eq!(listen_not_applied(None, "s", "127.0.0.1:1080"), None);
        let same: SocketAddr = "127.0.0.1:1080".parse().expect("test address");
        assert_eq!(listen_not_applied(Some(same), "s", "127.0.0.1:1080"), None);
    }

    #[test]
    fn socks_listen_on_a_port_in_use_says_so() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let addr = taken.local_addr().expect("local address");
        let e = check_listen(addr).expect_err("the port is taken");
        assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse);
        let msg = listen_error(addr, &e).to_string();
        assert!(msg.contains(&addr.to_string()), "{msg}");
        assert!(msg.contains("in use by another program"), "{msg}");
        assert!(msg.contains(&format!("sport = :{}", addr.port())), "{msg}");
        drop(taken);
        check_listen(addr).expect("free again");
    }
}
