//! `kvpn diagnose source TARGET:PORT`: where the client's source address survives
//! or changes on the way to a backend (seed 003's three-point check).
//!
//! One fresh connection (TCP, or one UDP datagram with `--udp`) from this laptop
//! through the tunnel, observed at three points:
//! 1. after decapsulation in the manager, and 2. at the manager pod's egress
//!    interface — both by the manager's `TraceSource` RPC (through a port-forward
//!    to its gRPC port), armed before the connection opens;
//! 3. by the backend, which reports the peer it saw: the lab's `kvpn-lab-server`
//!    answers `GET /peer` (TCP) and the datagram `KVPN-PEER?` (UDP); other
//!    backends leave this point unknown.
//!
//! [`explain`] (pure) says where the source changed and why — the manager's policy
//! (snat: a proxy), something downstream of the pod (the node's masquerade,
//! kube-proxy), or a refusal or loss instead of an answer. I/O: the kube client,
//! the gRPC stream, the probe's sockets.

use std::io::{Read as _, Write as _};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs as _, UdpSocket};
use std::time::Duration;

use anyhow::{Context as _, Result, anyhow, bail};
use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::{Api, ListParams};
use kvpn_proto::dataplane::Session;
use kvpn_proto::manager::manager_client::ManagerClient;
use kvpn_proto::manager::{TraceSourceEvent, TraceSourceRequest};
use serde::Serialize;

use kvpn_proto::userd::UserSession;

use crate::install::objects;
use crate::kubeconfig::{KubeFlags, UserEnv};

/// Bound of the probe's connect and of each read.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);
/// How long the manager watches (the probe's timeout plus slack).
const TRACE_MS: u32 = 5000;

/// What the probe connection got.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// An answer came (TCP connected; UDP datagram answered).
    Answered,
    /// TCP RST (connection refused) or ICMP port unreachable.
    Refused,
    /// ICMP destination unreachable other than port: `code` 13 is
    /// "communication administratively prohibited" (RFC 1812 5.2.7.1); TCP cannot
    /// tell the code (`None`).
    Unreachable { code: Option<u8> },
    /// No answer within the probe's timeout.
    Lost,
    /// Another local error.
    Error { message: String },
}

/// In the user's words, lowercase like the verdicts (the table's outcome row).
impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Answered => f.write_str("answered"),
            Outcome::Refused => f.write_str("refused (TCP RST or ICMP port unreachable)"),
            Outcome::Unreachable { code: Some(13) } => {
                f.write_str("unreachable (ICMP administratively prohibited)")
            }
            Outcome::Unreachable { code: Some(c) } => {
                write!(f, "unreachable (ICMP destination unreachable code {c})")
            }
            Outcome::Unreachable { code: None } => f.write_str("unreachable"),
            Outcome::Lost => write!(f, "lost (no answer within {} s)", PROBE_TIMEOUT.as_secs()),
            Outcome::Error { message } => write!(f, "error: {message}"),
        }
    }
}

/// The three-point report.
#[derive(Debug, Clone, Serialize)]
pub struct SourceReport {
    pub protocol: &'static str,
    pub target: SocketAddr,
    /// The manager's `--source-policy`.
    pub policy: String,
    /// The probe socket's own address on the laptop.
    pub laptop_source: Option<SocketAddr>,
    pub decapsulated_source: Option<SocketAddr>,
    pub egress_source: Option<SocketAddr>,
    pub egress_interface: String,
    /// What the backend reported; `None` when it cannot (not a lab backend) or
    /// no answer came.
    pub backend_source: Option<SocketAddr>,
    /// The traced manager pod's own addresses (`status.podIPs`).
    pub manager_pod_ips: Vec<IpAddr>,
    pub outcome: Outcome,
    /// Where the source changed ("manager", "downstream", "none", "unknown") or the
    /// flow ended ("refused", "unreachable", "dropped-in-manager-pod", "lost").
    pub verdict: String,
    /// One sentence on why.
    pub explanation: String,
    /// What could not be observed, from the manager.
    pub note: String,
}

fn ip(a: Option<SocketAddr>) -> Option<IpAddr> {
    a.map(|a| a.ip())
}

/// For a refusal or an ICMP error under a policy that replaces the client's source:
/// the rule saw the manager pod's address, not the laptop's, so it cannot single out
/// one laptop — and under ebpf-snat the answer was translated back by the TC program
/// (an ICMP error by the header it quotes). Empty when the source was not replaced.
fn translated_denial(r: &SourceReport) -> String {
    let (Some(d), Some(e)) = (r.decapsulated_source, r.egress_source) else {
        return String::new();
    };
    if d.ip() == e.ip() {
        return String::new();
    }
    let back = if r.policy == "ebpf-snat" {
        "; ebpf-snat's TC program translated the answer back to the laptop (an ICMP error by the \
         header it quotes)"
    } else {
        ""
    };
    format!(
        ". The rule matched {}, the manager pod's address under policy {} (not the laptop's {}): \
         it denies every laptop behind this manager; use --source-policy preserve to deny one{back}",
        e.ip(),
        r.policy,
        d.ip()
    )
}

/// For an answer under a policy that replaces the client's source: which
/// address the backend saw (no claim about rules). Empty when not replaced.
fn replaced_source(r: &SourceReport) -> String {
    match (r.decapsulated_source, r.egress_source) {
        (Some(d), Some(e)) if d.ip() != e.ip() => format!(
            "; the backend saw the manager pod's address {} (policy {}), not the laptop's {}",
            e.ip(),
            r.policy,
            d.ip()
        ),
        _ => String::new(),
    }
}

/// Where the source changed and why (see the module docs). Pure.
pub fn explain(r: &SourceReport) -> (String, String) {
    let decap = ip(r.decapsulated_source);
    let egress = ip(r.egress_source);
    let backend = ip(r.backend_source);
    let show = |a: Option<SocketAddr>| a.map_or("-".to_owned(), |a| a.to_string());
    match &r.outcome {
        Outcome::Refused => {
            // What was seen is a reset (TCP) or port unreachable (UDP): what a
            // closed port answers. Policies deny by dropping or with ICMP
            // admin-prohibited (the Unreachable arm); no policy was seen here.
            let answer = if r.protocol == "udp" {
                "ICMP port unreachable"
            } else {
                "a TCP RST"
            };
            return (
                "refused".into(),
                format!(
                    "{} answered with {answer} for source {} — nothing listens on port {} there \
                     (a closed port); no policy was seen (a rule rejecting with a reset would look \
                     the same). The path works, this is not a missing route{}",
                    r.target.ip(),
                    show(r.egress_source.or(r.decapsulated_source)),
                    r.target.port(),
                    replaced_source(r)
                ),
            );
        }
        Outcome::Unreachable { code: None } if r.decapsulated_source.is_none() => {
            return (
                "unreachable".into(),
                format!(
                    "no route to {} (from the laptop, or an ICMP host unreachable), and the manager saw \
                     no packet of this flow: the laptop's route or the data channel",
                    r.target
                ),
            );
        }
        Outcome::Unreachable { code } => {
            let what = match code {
                Some(13) => "ICMP administratively prohibited: a policy rule rejected it".to_owned(),
                Some(c) => format!("ICMP destination unreachable code {c}"),
                None => "ICMP destination unreachable (admin-prohibited by a policy rule, or no route; TCP does not tell which)".to_owned(),
            };
            return (
                "unreachable".into(),
                format!(
                    "{what}, for source {}{}",
                    show(r.egress_source.or(r.decapsulated_source)),
                    translated_denial(r)
                ),
            );
        }
        // Only preserve sends the client's address out of the pod, the one an
        // anti-spoofing rule drops; under snat or ebpf-snat nothing leaving
        // means nothing to send to.
        Outcome::Lost
            if r.policy == "preserve"
                && r.decapsulated_source.is_some()
                && r.egress_source.is_none()
                && r.note.is_empty() =>
        {
            return (
                "dropped-in-manager-pod".into(),
                format!(
                    "the manager decapsulated {} but nothing left the pod's {}: dropped inside the manager pod \
                     (an anti-spoofing rule that lets only the pod IP out, as some CNIs do — case rt-07 — \
                     or IP forwarding off; with such a CNI use --source-policy snat), or no host has {} \
                     (an unused address: nothing answered the pod's neighbour lookup)",
                    show(r.decapsulated_source),
                    r.egress_interface,
                    r.target.ip()
                ),
            );
        }
        Outcome::Lost
            if r.decapsulated_source.is_some()
                && r.egress_source.is_none()
                && r.note.is_empty() =>
        {
            return (
                "lost".into(),
                format!(
                    "no host answered: the manager decapsulated {} but nothing towards {} left the pod's {} \
                     (policy {}) — an unused address (nothing answered the pod's neighbour lookup) or a rule \
                     in the pod dropping it silently",
                    show(r.decapsulated_source),
                    r.target,
                    r.egress_interface,
                    r.policy
                ),
            );
        }
        Outcome::Lost if r.egress_source.is_some() && r.policy == "preserve" => {
            return (
                "lost".into(),
                format!(
                    "left the manager pod as {} and no answer came back: no host has {} (an unused address), \
                     a firewall drops it silently, or the reply to that address has no way back to the manager \
                     (the nodes' route for the tunnel pool via the stable gateway, the pool kept out of the \
                     masquerade, rp_filter loose)",
                    show(r.egress_source),
                    r.target.ip()
                ),
            );
        }
        Outcome::Lost if r.egress_source.is_some() => {
            return (
                "lost".into(),
                format!(
                    "no host answered: the flow left the manager pod as {} (policy {}, whose replies find their \
                     way back) and nothing came back — no host has {} (an unused address) or a firewall drops \
                     it silently",
                    show(r.egress_source),
                    r.policy,
                    r.target.ip()
                ),
            );
        }
        Outcome::Lost if r.decapsulated_source.is_some() => {
            return (
                "lost".into(),
                format!(
                    "no answer: the manager decapsulated {} and its pod's {} egress was not observed ({})",
                    show(r.decapsulated_source),
                    r.egress_interface,
                    r.note
                ),
            );
        }
        Outcome::Lost => {
            return (
                "lost".into(),
                "no answer, and the manager saw no packet of this flow: the laptop's route or the data channel".into(),
            );
        }
        Outcome::Error { message } => return ("unknown".into(), message.clone()),
        Outcome::Answered => {}
    }
    if let (Some(d), Some(e)) = (decap, egress)
        && d != e
    {
        let how = if r.policy == "ebpf-snat" {
            format!(
                "kvpn's TC program on the pod's {} egress rewrote the source to the pod IP \
                 (a forwarder that translates, with its own connection table)",
                r.egress_interface
            )
        } else {
            "the manager terminates the flow and its kernel dials from the pod IP (a proxy)"
                .to_owned()
        };
        return (
            "manager".into(),
            format!(
                "changed inside the manager pod ({d} → {e}): policy {} — {how}; use --source-policy \
                 preserve if the backend needs the client's address",
                r.policy
            ),
        );
    }
    // The egress was not observed (a manager without NET_RAW: snat's install
    // grants no capability), yet the backend saw the manager pod's own address:
    // only the pod sends from it, so under a policy that replaces the source the
    // change happened inside the manager pod.
    if let (Some(d), None, Some(b)) = (decap, egress, backend)
        && d != b
        && (r.policy == "snat" || r.policy == "ebpf-snat")
        && r.manager_pod_ips.contains(&b)
    {
        return (
            "manager".into(),
            format!(
                "changed inside the manager pod ({d} → {b}): the backend saw the manager pod's own \
                 address, which only the pod sends from — policy {}; the pod's egress itself was not \
                 observed ({}); use --source-policy preserve if the backend needs the client's address",
                r.policy,
                if r.note.is_empty() {
                    "no outgoing packet matched"
                } else {
                    r.note.as_str()
                },
            ),
        );
    }
    if let (Some(d), None, Some(b)) = (decap, egress, backend)
        && d != b
    {
        return (
            "changed".into(),
            format!(
                "changed between the manager's decapsulation and the backend ({d} → {b}); the manager pod's \
                 egress was not observed ({}), so kvpn cannot tell whether the manager (policy {}) or the node did it",
                if r.note.is_empty() {
                    "no outgoing packet matched"
                } else {
                    r.note.as_str()
                },
                r.policy
            ),
        );
    }
    let before = egress.or(decap);
    match (before, backend) {
        (Some(b), Some(s)) if b != s => (
            "downstream".into(),
            format!(
                "changed after the manager pod ({b} → {s}): a masquerade or SNAT rule on the node \
                 (the CNI's masquerade, kube-proxy) rewrote it — keep the tunnel pool out of it"
            ),
        ),
        (Some(b), Some(_)) => (
            "none".into(),
            format!(
                "unchanged: the backend sees {b}, the source the manager decapsulated (policy {})",
                r.policy
            ),
        ),
        _ => (
            "unknown".into(),
            "the backend did not report its peer (only the lab's kvpn-lab-server does)".into(),
        ),
    }
}

/// The probe: one fresh connection to `target`; (laptop source, backend's view,
/// outcome). Blocking.
fn probe(target: SocketAddr, udp: bool) -> (Option<SocketAddr>, Option<SocketAddr>, Outcome) {
    if udp {
        return probe_udp(target);
    }
    let mut s = match TcpStream::connect_timeout(&target, PROBE_TIMEOUT) {
        Ok(s) => s,
        Err(e) => return (None, None, io_outcome(&e, None)),
    };
    let local = s.local_addr().ok();
    let _ = s.set_read_timeout(Some(PROBE_TIMEOUT));
    let _ = s.write_all(b"GET /peer HTTP/1.1\r\nHost: kvpn-diagnose\r\nConnection: close\r\n\r\n");
    let mut out = String::new();
    let _ = s.take(64 * 1024).read_to_string(&mut out);
    let backend = out
        .split_once("\r\n\r\n")
        .and_then(|(_, body)| body.trim().parse().ok());
    (local, backend, Outcome::Answered)
}

fn io_outcome(e: &std::io::Error, code: Option<u8>) -> Outcome {
    match e.raw_os_error() {
        Some(libc::ECONNREFUSED) => Outcome::Refused,
        Some(libc::EHOSTUNREACH) | Some(libc::ENETUNREACH) | Some(libc::EACCES) => {
            Outcome::Unreachable { code }
        }
        Some(libc::EAGAIN) | Some(libc::ETIMEDOUT) => Outcome::Lost,
        _ if e.kind() == std::io::ErrorKind::TimedOut
            || e.kind() == std::io::ErrorKind::WouldBlock =>
        {
            Outcome::Lost
        }
        _ => Outcome::Error {
            message: e.to_string(),
        },
    }
}

/// The ICMP code of the socket's last queued error (IP_RECVERR, ip(7)).
fn icmp_code(fd: i32) -> Option<u8> {
    let mut data = [0u8; 64];
    let mut control = [0u8; 256];
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    };
    // SAFETY: msghdr is plain old data; zero is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len();
    // SAFETY: msg points to live buffers of the given sizes.
    let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT) };
    if n < 0 {
        return None;
    }
    // SAFETY: walking the control messages the kernel wrote into `control`.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !cmsg.is_null() {
        // SAFETY: cmsg is non-null and inside `control`.
        let c = unsafe { &*cmsg };
        if c.cmsg_level == libc::SOL_IP && c.cmsg_type == libc::IP_RECVERR {
            // SAFETY: IP_RECVERR data is a sock_extended_err (linux/errqueue.h).
            let ee = unsafe { &*(libc::CMSG_DATA(cmsg) as *const libc::sock_extended_err) };
            if ee.ee_origin == libc::SO_EE_ORIGIN_ICMP {
                return Some(ee.ee_code);
            }
        }
        // SAFETY: as above.
        cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
    }
    None
}

/// What the UDP probe sends: to port 53 a DNS query (the root's NS), which any
/// DNS server answers (trial F8: a nameserver ignored the lab's peer question
/// and the cluster DNS was reported lost); elsewhere the lab servers' question
/// for the peer address they saw.
fn udp_probe_payload(port: u16) -> Vec<u8> {
    use hickory_proto::op::{Message, Query};
    use hickory_proto::rr::{Name, RecordType};
    if port == 53 {
        let mut m = Message::query();
        m.metadata.id = 0x6b76;
        m.add_query(Query::query(Name::root(), RecordType::NS));
        if let Ok(bytes) = m.to_vec() {
            return bytes;
        }
    }
    b"KVPN-PEER?".to_vec()
}

fn probe_udp(target: SocketAddr) -> (Option<SocketAddr>, Option<SocketAddr>, Outcome) {
    use std::os::fd::AsRawFd as _;
    let bind: SocketAddr = if target.is_ipv4() {
        "0.0.0.0:0".parse().unwrap_or(target)
    } else {
        "[::]:0".parse().unwrap_or(target)
    };
    let s = match UdpSocket::bind(bind).and_then(|s| s.connect(target).map(|()| s)) {
        Ok(s) => s,
        Err(e) => return (None, None, io_outcome(&e, None)),
    };
    let on: libc::c_int = 1;
    // SAFETY: a live int of the given size.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_IP,
            libc::IP_RECVERR,
            std::ptr::addr_of!(on).cast(),
            std::mem::size_of::<libc::c_int>() as u32,
        )
    };
    let local = s.local_addr().ok();
    let _ = s.set_read_timeout(Some(PROBE_TIMEOUT));
    if let Err(e) = s.send(&udp_probe_payload(target.port())) {
        return (local, None, io_outcome(&e, None));
    }
    let mut buf = [0u8; 256];
    match s.recv(&mut buf) {
        Ok(n) => {
            let backend = std::str::from_utf8(buf.get(..n).unwrap_or_default())
                .ok()
                .and_then(|t| t.trim().parse().ok());
            (local, backend, Outcome::Answered)
        }
        Err(e) => {
            let code = icmp_code(s.as_raw_fd());
            let outcome = match (io_outcome(&e, code), code) {
                // Port unreachable (3) is a refusal; others keep their code.
                (Outcome::Refused, _) | (_, Some(3)) => Outcome::Refused,
                (o, _) => o,
            };
            (local, None, outcome)
        }
    }
}

/// A ready manager pod's name and addresses (`status.podIPs`).
async fn manager_pod(client: &kube::Client, namespace: &str) -> Result<(String, Vec<IpAddr>)> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pods = api
        .list(&ListParams::default().labels(&objects::selector()))
        .await
        .with_context(|| format!("cannot list the traffic manager's pods in {namespace}"))?;
    pods.items
        .iter()
        .find(|p| {
            p.metadata.deletion_timestamp.is_none()
                && p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
        .and_then(|p| {
            let ips = p
                .status
                .as_ref()
                .and_then(|s| s.pod_ips.as_ref())
                .map(|ips| ips.iter().filter_map(|i| i.ip.parse().ok()).collect())
                .unwrap_or_default();
            Some((p.metadata.name.clone()?, ips))
        })
        .ok_or_else(|| {
            anyhow!("no ready traffic manager pod in {namespace} — `kvpn connect` installs it")
        })
}

/// Which cluster to ask about a trace through the user daemon's `session`:
/// `flags` with `--kubeconfig` win as they are; without it, the session's
/// kubeconfig files (put in `KUBECONFIG` of `env`, so a list merges as at
/// connect) and, unless `--context` is given, the session's context. Without a
/// session (a `--manager` session, an older user daemon) `flags` and `env` as
/// they are. Pure.
pub fn session_kube(
    mut flags: KubeFlags,
    env: UserEnv,
    session: Option<&UserSession>,
) -> (KubeFlags, UserEnv) {
    let Some(session) = session.filter(|_| flags.kubeconfig.is_none()) else {
        return (flags, env);
    };
    let env = match session.kubeconfig.as_slice() {
        [] => return (flags, env),
        [one] => {
            flags.kubeconfig = Some(one.into());
            env
        }
        // A path holding ':' cannot be listed in KUBECONFIG: the flags as given.
        many => match std::env::join_paths(many) {
            Ok(list) => env.with_var("KUBECONFIG", list),
            Err(_) => return (flags, env),
        },
    };
    if flags.context.is_none() {
        flags.context = session
            .origin
            .as_ref()
            .map(|o| o.context.clone())
            .filter(|c| !c.is_empty());
    }
    (flags, env)
}

/// Resolves `target` (`ip:port` or `name:port`) on this laptop (split DNS
/// resolves Service names while connected).
pub fn resolve(target: &str) -> Result<SocketAddr> {
    if let Ok(a) = target.parse::<SocketAddr>() {
        return Ok(a);
    }
    target
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve {target} (expected HOST:PORT)"))?
        .find(SocketAddr::is_ipv4)
        .ok_or_else(|| anyhow!("{target} has no IPv4 address"))
}

/// How long `diagnose source NAME:PORT` waits for the name: the laptop's
/// resolver retries a silent nameserver for about 18 s (3 tries × 5 s and
/// more); a cluster DNS that has not answered in 5 s is not going to.
pub const RESOLVE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The error of a name that did not resolve while kvpn is connected
/// (`sessions` non-empty): which cluster DNS was asked through which session,
/// what a silence means, and what to run instead. `why` is the resolver's
/// error, or `None` when it did not answer within [`RESOLVE_WAIT`]. Pure.
pub fn unresolved_message(target: &str, sessions: &[Session], why: Option<&str>) -> String {
    let dns: Vec<String> = sessions
        .iter()
        .filter_map(|s| s.dns.as_ref())
        .flat_map(|d| d.servers.iter().cloned())
        .collect();
    let policy = sessions
        .iter()
        .filter_map(|s| s.origin.as_ref())
        .map(|o| o.source_policy.as_str())
        .find(|p| !p.is_empty())
        .unwrap_or("");
    let what = match why {
        Some(e) => format!("no address (the resolver said: {e})"),
        None => format!("no answer within {} s", RESOLVE_WAIT.as_secs()),
    };
    let asked = if dns.is_empty() {
        "the cluster DNS".to_owned()
    } else {
        format!("the cluster DNS {}", dns.join(", "))
    };
    let dns_probe = dns
        .first()
        .map(|d| {
            let d = if d.contains(':') {
                d.clone()
            } else {
                format!("{d}:53")
            };
            format!("`kvpn diagnose source {d} --udp` traces the DNS flow itself; ")
        })
        .unwrap_or_default();
    let route_hint = if policy == "preserve" {
        " Under source policy preserve the replies need the nodes' route for the tunnel \
         pool back to the manager: a missing return route looks exactly like this."
    } else {
        ""
    };
    format!(
        "cannot resolve {target}: kvpn is connected, but asking {asked} through the session \
         gave {what}.{route_hint} Fix: {dns_probe}or give the target as IP:PORT (e.g. the \
         Service's ClusterIP from `kubectl get svc`)"
    )
}

/// Refuses a trace without a session: `sessions` are the root daemon's.
pub fn require_session(sessions: &[Session]) -> Result<()> {
    if sessions.is_empty() {
        bail!(
            "not connected: no kvpn session is up, and diagnose traces a connection through the \
             tunnel — run `kvpn connect` first"
        );
    }
    Ok(())
}

/// This process's cgroup v2 path (`/proc/self/cgroup`'s `0::` line), e.g.
/// `/kvpn-run-1a2b3c`.
fn own_cgroup() -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(str::to_owned)
}

/// Whether `session` routes this process's connections: every laptop-wide
/// session does; a `kvpn run` session only when this process is in its cgroup
/// (`own`: this process's cgroup v2 path; the session's `run_cgroup` is the
/// folder under the cgroup2 mount).
fn carries_this_process(session: &Session, own: Option<&str>) -> bool {
    if session.run_cgroup.is_empty() {
        return true;
    }
    own.is_some_and(|own| {
        let own = own.trim_end_matches('/');
        !own.is_empty() && own != "/" && session.run_cgroup.trim_end_matches('/').ends_with(own)
    })
}

/// Refuses a trace no session would carry: one of `sessions` (the root
/// daemon's) must route `ip` through its TUN device.
pub fn require_route(sessions: &[Session], ip: IpAddr) -> Result<()> {
    require_session(sessions)?;
    // A `kvpn run` session routes only its command's processes: diagnose can
    // trace through one only from inside it (`kvpn run … -- kvpn diagnose …`).
    let own = own_cgroup();
    let (laptop, runs): (Vec<Session>, Vec<Session>) = sessions
        .iter()
        .cloned()
        .partition(|s| carries_this_process(s, own.as_deref()));
    if crate::connect::session_routing(&laptop, &IpNet::from(ip)).is_none()
        && let Some((run, _)) = crate::connect::session_routing(&runs, &IpNet::from(ip))
    {
        bail!(
            "{ip} is routed only by the `kvpn run` session {}, which carries only its own \
             command's processes; diagnose runs outside it, so no trace would pass the tunnel — \
             run it inside that session's scope (`kvpn run … -- kvpn diagnose source …` with the same \
             cluster flags) or connect the laptop (`kvpn connect`)",
            run.id
        );
    }
    if crate::connect::session_routing(&laptop, &IpNet::from(ip)).is_none() {
        bail!(
            "{ip} is outside every kvpn session's routes (`kvpn status` lists them), so no trace \
             would pass the tunnel — give a pod, Service or --cidr address of the connected cluster"
        );
    }
    Ok(())
}

/// The error for a target that is a Service's ClusterIP on a port the Service
/// does not have (`None` when it has the port, or the address is no ClusterIP).
fn service_port_mismatch(services: &[Service], target: SocketAddr, udp: bool) -> Option<String> {
    let proto = if udp { "UDP" } else { "TCP" };
    let ip = target.ip().to_string();
    let svc = services.iter().find(|s| {
        s.spec.as_ref().is_some_and(|spec| {
            spec.cluster_ip.as_deref() == Some(ip.as_str())
                || spec.cluster_ips.iter().flatten().any(|c| *c == ip)
        })
    })?;
    let ports = svc
        .spec
        .as_ref()
        .and_then(|spec| spec.ports.clone())
        .unwrap_or_default();
    let proto_of = |p: &k8s_openapi::api::core::v1::ServicePort| {
        p.protocol.clone().unwrap_or_else(|| "TCP".to_owned())
    };
    if ports
        .iter()
        .any(|p| p.port == i32::from(target.port()) && proto_of(p) == proto)
    {
        return None;
    }
    let name = format!(
        "{}/{}",
        svc.metadata.namespace.as_deref().unwrap_or("?"),
        svc.metadata.name.as_deref().unwrap_or("?")
    );
    let has: Vec<String> = ports
        .iter()
        .map(|p| format!("{}/{}", p.port, proto_of(p)))
        .collect();
    Some(format!(
        "{target} is the ClusterIP of Service {name}, which has no port {}/{proto} (its ports: \
         {}) — a ClusterIP answers only on its Service's ports: trace one of those",
        target.port(),
        if has.is_empty() {
            "none".to_owned()
        } else {
            has.join(", ")
        }
    ))
}

/// Runs the three-point check (see the module docs) if one of `sessions` (the
/// root daemon's) routes `target` ([`resolve`]d).
pub async fn source(
    client: &kube::Client,
    namespace: &str,
    target: SocketAddr,
    udp: bool,
    sessions: &[Session],
) -> Result<SourceReport> {
    let IpAddr::V4(dst) = target.ip() else {
        bail!("{target}: only IPv4 destinations can be traced");
    };
    require_route(sessions, target.ip())?;
    // A ClusterIP answers only on its Service's ports: a trace to another port
    // would blame "an unused address" (#30 F6). Best effort: a user who may not
    // list Services gets the trace.
    let services: Api<Service> = Api::all(client.clone());
    if let Ok(list) = services.list(&ListParams::default()).await
        && let Some(why) = service_port_mismatch(&list.items, target, udp)
    {
        bail!(why);
    }
    let (pod, manager_pod_ips) = manager_pod(client, namespace).await?;
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let (pf, channel) = crate::lease::grpc_channel(&api, &pod, objects::GRPC_PORT).await?;
    let mut stream = ManagerClient::new(channel)
        .trace_source(TraceSourceRequest {
            protocol: if udp { "udp" } else { "tcp" }.into(),
            destination_ip: dst.to_string(),
            destination_port: u32::from(target.port()),
            timeout_ms: TRACE_MS,
        })
        .await
        .map_err(|s| anyhow!("{}: {}", s.code(), s.message()))
        .with_context(|| {
            format!("the traffic manager pod {pod} cannot trace (is it older than this kvpn?)")
        })?
        .into_inner();
    let next = |m: Result<Option<TraceSourceEvent>, tonic::Status>| {
        m.map_err(|s| anyhow!("{}: {}", s.code(), s.message()))
            .and_then(|m| m.ok_or_else(|| anyhow!("the manager ended the trace early")))
    };
    let armed = next(stream.message().await)?;
    if !armed.armed {
        bail!("the manager's first trace message was not 'armed'");
    }
    let (laptop_source, backend_source, outcome) =
        tokio::task::spawn_blocking(move || probe(target, udp))
            .await
            .context("probe task failed")?;
    let last = next(stream.message().await)?;
    pf.abort();
    let parse = |s: &str| s.parse::<SocketAddr>().ok();
    let mut report = SourceReport {
        protocol: if udp { "udp" } else { "tcp" },
        target,
        policy: last.policy,
        laptop_source,
        decapsulated_source: parse(&last.decapsulated_source),
        egress_source: parse(&last.egress_source),
        egress_interface: last.egress_interface,
        backend_source,
        manager_pod_ips,
        outcome,
        verdict: String::new(),
        explanation: String::new(),
        note: last.note,
    };
    let (verdict, explanation) = explain(&report);
    report.verdict = verdict;
    report.explanation = explanation;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    fn report(decap: &str, egress: &str, backend: &str, outcome: Outcome) -> SourceReport {
        let p = |s: &str| s.parse().ok();
        SourceReport {
            protocol: "tcp",
            target: "10.96.0.100:80".parse().expect("addr"),
            policy: "snat".into(),
            laptop_source: p(decap),
            decapsulated_source: p(decap),
            egress_source: p(egress),
            egress_interface: "eth0".into(),
            backend_source: p(backend),
            manager_pod_ips: vec!["10.244.1.5".parse().expect("ip")],
            outcome,
            verdict: String::new(),
            explanation: String::new(),
            note: String::new(),
        }
    }

    /// A manager without NET_RAW (snat's restricted install on a real node) cannot
    /// capture its egress; the backend seeing the manager pod's own address still
    /// places the change in the manager, and any other address leaves it open.
    #[test]
    fn an_unobserved_egress_with_the_pod_ip_at_the_backend_is_the_manager() {
        let mut r = report("100.96.0.2:5000", "", "10.244.1.5:40000", Outcome::Answered);
        r.note = "no capture at the pod's egress eth0: Operation not permitted (os error 1) \
                  (needs NET_RAW in the manager pod)"
            .into();
        let (verdict, why) = explain(&r);
        assert_eq!(verdict, "manager", "{why}");
        assert!(why.contains("NET_RAW"), "{why}");
        r.policy = "ebpf-snat".into();
        assert_eq!(explain(&r).0, "manager");
        // Another address (the node's masquerade): kvpn cannot tell who did it.
        r.policy = "snat".into();
        r.backend_source = "172.30.0.12:40000".parse().ok();
        assert_eq!(explain(&r).0, "changed");
        // preserve never replaces the source in the manager.
        r.policy = "preserve".into();
        r.backend_source = "10.244.1.5:40000".parse().ok();
        assert_eq!(explain(&r).0, "changed");
    }

    #[test]
    fn verdicts_name_the_place_of_change() {
        let v = |r: &SourceReport| explain(r).0;
        assert_eq!(
            v(&report(
                "100.96.0.2:5000",
                "10.244.1.5:40000",
                "10.244.1.5:40000",
                Outcome::Answered
            )),
            "manager"
        );
        assert_eq!(
            v(&report(
                "100.96.0.2:5000",
                "100.96.0.2:5000",
                "100.96.0.2:5000",
                Outcome::Answered
            )),
            "none"
        );
        assert_eq!(
            v(&report(
                "100.96.0.2:5000",
                "100.96.0.2:5000",
                "10.244.1.1:6000",
                Outcome::Answered
            )),
            "downstream"
        );
        let mut preserve = report("100.96.0.2:5000", "", "", Outcome::Lost);
        preserve.policy = "preserve".into();
        assert_eq!(v(&preserve), "dropped-in-manager-pod");
        assert_eq!(
            v(&report(
                "100.96.0.2:5000",
                "100.96.0.2:5000",
                "",
                Outcome::Lost
            )),
            "lost"
        );
        assert_eq!(
            v(&report(
                "100.96.0.2:5000",
                "100.96.0.2:5000",
                "",
                Outcome::Refused
            )),
            "refused"
        );
        let mut ebpf = report(
            "100.96.0.2:5000",
            "10.244.1.5:61000",
            "10.244.1.5:61000",
            Outcome::Answered,
        );
        ebpf.policy = "ebpf-snat".into();
        let (verdict, why) = explain(&ebpf);
        assert_eq!(verdict, "manager");
        assert!(
            why.contains("ebpf-snat") && why.contains("TC program on the pod's eth0"),
            "{why}"
        );
        assert_eq!(
            why.matches("ebpf-snat").count(),
            1,
            "policy said twice: {why}"
        );
        let e = explain(&report("", "", "", Outcome::Unreachable { code: Some(13) })).1;
        assert!(e.contains("administratively prohibited"), "{e}");
        assert!(!e.contains("manager pod's address"), "{e}");
        assert_eq!(
            v(&report(
                "100.96.0.2:5000",
                "100.96.0.2:5000",
                "",
                Outcome::Answered
            )),
            "unknown"
        );
    }

    /// [preserve] issue 9: under ebpf-snat a backend rule denying the pod IP comes
    /// back as an ICMP error the TC program translated; diagnose says the denial is a
    /// rule's, that it matched the pod IP (so every laptop behind the manager), and
    /// how the answer came back. Under preserve it names only the tunnel IP.
    #[test]
    fn denials_under_ebpf_snat_name_the_pod_ip_the_rule_matched() {
        // Only ICMP admin-prohibited is a rule's answer; a reset is a closed
        // port's (a_plain_closed_port_is_a_reset_from_the_backend_not_a_policy).
        #[expect(
            clippy::single_element_loop,
            reason = "one denial kind today; the loop keeps room for others"
        )]
        for (outcome, verdict) in [(Outcome::Unreachable { code: Some(13) }, "unreachable")] {
            let mut r = report("100.96.0.2:5000", "10.244.1.5:61000", "", outcome);
            r.policy = "ebpf-snat".into();
            let (v, why) = explain(&r);
            assert_eq!(v, verdict, "{why}");
            assert!(
                why.contains("rule matched 10.244.1.5")
                    && why.contains("not the laptop's 100.96.0.2")
                    && why.contains("translated the answer back"),
                "{why}"
            );
            r.policy = "preserve".into();
            r.egress_source = r.decapsulated_source;
            let (v, why) = explain(&r);
            assert_eq!(v, verdict, "{why}");
            assert!(
                why.contains("100.96.0.2") && !why.contains("manager pod's address"),
                "{why}"
            );
        }
    }

    /// A name that does not resolve while connected (the cluster DNS silent,
    /// e.g. a missing return route under preserve): the error names the DNS,
    /// the cause and the fix, never "is kvpn connected?".
    #[test]
    fn an_unresolved_name_while_connected_names_the_dns_and_the_fix() {
        let session = Session {
            dns: Some(kvpn_proto::dataplane::ClusterDns {
                servers: vec!["10.96.0.10".into()],
                ..Default::default()
            }),
            origin: Some(kvpn_proto::dataplane::Origin {
                source_policy: "preserve".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let m = unresolved_message("web.default:80", &[session], None);
        assert!(m.contains("no answer within 5 s"), "{m}");
        assert!(m.contains("cluster DNS 10.96.0.10"), "{m}");
        assert!(m.contains("missing return route"), "{m}");
        assert!(
            m.contains("kvpn diagnose source 10.96.0.10:53 --udp"),
            "{m}"
        );
        assert!(!m.contains("is kvpn connected"), "{m}");
        // In words, without the runs of spaces a line continuation left (trial F9).
        assert!(!m.contains("  "), "{m}");
        let m = unresolved_message("nosuch.default:80", &[], Some("Temporary failure"));
        assert!(
            m.contains("gave no address (the resolver said: Temporary failure)"),
            "{m}"
        );
        assert!(!m.contains("  "), "{m}");
    }

    /// A plain closed port: what was seen is a reset from the backend, and no
    /// policy is blamed (on main: "The rule matched … denies every laptop").
    #[test]
    fn a_plain_closed_port_is_a_reset_from_the_backend_not_a_policy() {
        let mut r = report("100.96.0.2:5000", "10.244.1.5:61000", "", Outcome::Refused);
        r.policy = "snat".into();
        let (v, why) = explain(&r);
        assert_eq!(v, "refused", "{why}");
        assert!(
            why.contains("a TCP RST") && why.contains("closed port"),
            "{why}"
        );
        assert!(why.contains("no policy was seen"), "{why}");
        assert!(
            !why.contains("rule matched") && !why.contains("denies every laptop"),
            "{why}"
        );
        assert!(why.contains("manager pod's address 10.244.1.5"), "{why}");
        r.protocol = "udp";
        let (_, why) = explain(&r);
        assert!(why.contains("ICMP port unreachable"), "{why}");
    }

    /// An unused pod IP under snat or ebpf-snat (nothing left the pod's egress,
    /// nothing answered): "lost", no host answered — not rt-07's drop, and never
    /// the advice to use the policy in use. Only preserve, whose packets an
    /// anti-spoofing rule drops, names rt-07.
    #[test]
    fn a_lost_flow_blames_rt07_only_under_preserve() {
        for policy in ["snat", "ebpf-snat"] {
            for egress in ["", "10.244.1.5:40000"] {
                let mut r = report("100.96.0.2:5000", egress, "", Outcome::Lost);
                r.target = "10.244.1.250:80".parse().expect("addr");
                r.policy = policy.into();
                let (verdict, why) = explain(&r);
                assert_eq!(verdict, "lost", "{policy} egress {egress:?}: {why}");
                assert!(why.contains("no host answered"), "{policy}: {why}");
                assert!(why.contains("10.244.1.250"), "{policy}: {why}");
                assert!(
                    !why.contains("rt-07") && !why.contains("--source-policy"),
                    "{policy}: {why}"
                );
            }
        }
        let mut r = report("100.96.0.2:5000", "", "", Outcome::Lost);
        r.policy = "preserve".into();
        let (verdict, why) = explain(&r);
        assert_eq!(verdict, "dropped-in-manager-pod");
        assert!(
            why.contains("rt-07") && why.contains("--source-policy snat"),
            "{why}"
        );
        assert!(why.contains("unused address"), "{why}");
    }

    /// The UDP probe to a DNS port is a DNS query a nameserver answers.
    #[test]
    fn the_udp_probe_to_port_53_is_a_dns_query() {
        let q = hickory_proto::op::Message::from_vec(&udp_probe_payload(53)).expect("DNS message");
        assert_eq!(q.queries.len(), 1);
        assert_eq!(udp_probe_payload(5353), b"KVPN-PEER?".to_vec());
    }

    /// #30 F6: a ClusterIP on a port its Service lacks is named as such.
    #[test]
    fn a_clusterip_port_the_service_lacks_is_named() {
        use k8s_openapi::api::core::v1::{ServicePort, ServiceSpec};
        let svc = Service {
            metadata: kube::api::ObjectMeta {
                name: Some("web".into()),
                namespace: Some("default".into()),
                ..Default::default()
            },
            spec: Some(ServiceSpec {
                cluster_ip: Some("10.96.0.20".into()),
                ports: Some(vec![ServicePort {
                    port: 80,
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        };
        let at = |a: &str| a.parse::<SocketAddr>().expect("addr");
        let err = service_port_mismatch(std::slice::from_ref(&svc), at("10.96.0.20:81"), false)
            .expect("port 81 is not the Service's");
        assert!(
            err.contains("Service default/web")
                && err.contains("no port 81/TCP")
                && err.contains("80/TCP"),
            "{err}"
        );
        assert!(
            service_port_mismatch(std::slice::from_ref(&svc), at("10.96.0.20:80"), true)
                .is_some_and(|e| e.contains("no port 80/UDP")),
            "UDP 80 is not the Service's TCP 80"
        );
        assert_eq!(
            service_port_mismatch(std::slice::from_ref(&svc), at("10.96.0.20:80"), false),
            None
        );
        assert_eq!(
            service_port_mismatch(&[svc], at("10.244.1.5:81"), false),
            None,
            "a pod IP is no ClusterIP"
        );
    }

    /// The outcome in words, lowercase like the verdicts; never a Debug value.
    #[test]
    fn outcomes_read_as_lowercase_words() {
        for (o, want) in [
            (Outcome::Answered, "answered"),
            (Outcome::Lost, "lost (no answer within 3 s)"),
            (Outcome::Unreachable { code: None }, "unreachable"),
            (
                Outcome::Unreachable { code: Some(13) },
                "unreachable (ICMP administratively prohibited)",
            ),
        ] {
            assert_eq!(o.to_string(), want);
        }
    }

    /// Without a session diagnose fails at once, saying to connect; an address
    /// no session routes is named; one inside a session's routes passes.
    #[test]
    fn tracing_needs_a_session_routing_the_target() {
        let e = require_route(&[], "10.244.1.250".parse().expect("ip"))
            .expect_err("no session")
            .to_string();
        assert!(
            e.starts_with("not connected") && e.contains("kvpn connect"),
            "{e}"
        );
        let sessions = [Session {
            id: "s1".into(),
            routes: vec![kvpn_proto::dataplane::Route {
                cidr: "10.244.0.0/16".into(),
                ..Default::default()
            }],
            ..Default::default()
        }];
        require_route(&sessions, "10.244.1.250".parse().expect("ip")).expect("routed");
        // A run session carries only the processes in its cgroup.
        let run = Session {
            run_cgroup: "/sys/fs/cgroup/unified/kvpn-run-r1".into(),
            ..sessions[0].clone()
        };
        assert!(carries_this_process(&run, Some("/kvpn-run-r1")));
        assert!(!carries_this_process(
            &run,
            Some("/user.slice/session-1.scope")
        ));
        assert!(!carries_this_process(&run, Some("/")));
        assert!(!carries_this_process(&run, None));
        assert!(carries_this_process(&sessions[0], None));
        let only_run = [Session {
            id: "r1".into(),
            ..run.clone()
        }];
        if !own_cgroup().is_some_and(|c| c.ends_with("kvpn-run-r1")) {
            let e = require_route(&only_run, "10.244.1.250".parse().expect("ip"))
                .expect_err("a run session does not carry diagnose")
                .to_string();
            assert!(
                e.contains("`kvpn run` session r1") && e.contains("-- kvpn diagnose source"),
                "{e}"
            );
        }
        let e = require_route(&sessions, "192.168.7.1".parse().expect("ip"))
            .expect_err("not routed")
            .to_string();
        assert!(e.contains("192.168.7.1") && e.contains("outside"), "{e}");
    }

    fn user_session(files: &[&str], context: &str) -> UserSession {
        UserSession {
            id: "s1".into(),
            kubeconfig: files.iter().map(|f| (*f).to_owned()).collect(),
            origin: Some(kvpn_proto::dataplane::Origin {
                context: context.into(),
                manager_namespace: "kvpn-system".into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn laptop_env() -> UserEnv {
        UserEnv::from_parts(
            [
                ("HOME".into(), "/home/elsewhere".into()),
                ("KUBECONFIG".into(), "/home/elsewhere/other.yaml".into()),
            ],
            "/work".into(),
            1000,
        )
    }

    /// Run after `kvpn connect --kubeconfig X --context C`, diagnose without
    /// flags asks X with C, whatever HOME and KUBECONFIG say now.
    #[test]
    fn diagnose_uses_the_sessions_kubeconfig_and_context() {
        let s = user_session(&["/lab/user.kubeconfig"], "user@lab");
        let (flags, env) = session_kube(KubeFlags::default(), laptop_env(), Some(&s));
        assert_eq!(flags.kubeconfig, Some("/lab/user.kubeconfig".into()));
        assert_eq!(flags.context.as_deref(), Some("user@lab"));
        assert_eq!(env, laptop_env(), "one file goes in as --kubeconfig");

        // A KUBECONFIG list at connect is merged again as a list.
        let s = user_session(&["/a.yaml", "/b.yaml"], "b@lab");
        let (flags, env) = session_kube(KubeFlags::default(), laptop_env(), Some(&s));
        assert_eq!(flags.kubeconfig, None);
        assert_eq!(flags.context.as_deref(), Some("b@lab"));
        assert_eq!(env.var("KUBECONFIG"), Some(OsStr::new("/a.yaml:/b.yaml")));
    }

    /// Explicit flags win: `--kubeconfig` keeps everything as given; `--context`
    /// alone picks a context of the session's files.
    #[test]
    fn diagnose_flags_win_over_the_session() {
        let s = user_session(&["/lab/user.kubeconfig"], "user@lab");
        let given = KubeFlags {
            kubeconfig: Some("/mine.yaml".into()),
            ..KubeFlags::default()
        };
        let (flags, env) = session_kube(given.clone(), laptop_env(), Some(&s));
        assert_eq!(flags, given);
        assert_eq!(env, laptop_env());

        let given = KubeFlags {
            context: Some("admin@lab".into()),
            ..KubeFlags::default()
        };
        let (flags, _) = session_kube(given, laptop_env(), Some(&s));
        assert_eq!(flags.kubeconfig, Some("/lab/user.kubeconfig".into()));
        assert_eq!(flags.context.as_deref(), Some("admin@lab"));

        // No user-daemon session (a --manager session) or none known: as given.
        for s in [None, Some(&user_session(&[], "user@lab"))] {
            let (flags, env) = session_kube(KubeFlags::default(), laptop_env(), s);
            assert_eq!(flags, KubeFlags::default());
            assert_eq!(env, laptop_env());
        }
    }
}
