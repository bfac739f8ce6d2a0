//! The SSH data-plane bypass (issue [ssh] item 4): when the session reaches the API
//! server through an SSH jump host and that host can reach the traffic manager
//! Service's ClusterIP (it is a cluster node: kube-proxy's rules apply to its own
//! connections), the data channel rides `direct-tcpip` channels from the SSH host
//! to `ClusterIP:10801` instead of `pods/portforward` through the API server. That
//! keeps the API server (and the port-forward "black hole", where the local TCP
//! connection looks alive but carries nothing) out of the data path; a replaced
//! manager pod needs no new pod lookup (the ClusterIP stays, kube-proxy follows).
//!
//! Decided once, at connect, right after the manager is installed ([`choose`]): one
//! channel to the ClusterIP, [`PROBE_TIMEOUT`] to open; success → ssh-direct,
//! anything else → port-forward, with one info line saying why (never an error:
//! a bastion that is not a node is the common case).
//!
//! Not bypassed: the manager's control gRPC (10802: lease, route watch). The
//! manager serves it on the pod's loopback only, in plain HTTP/2 without client
//! authentication, so it is reachable only through `pods/portforward` (which
//! RBAC guards); putting it on the ClusterIP would let any pod lease tunnel IPs and
//! read the route watch. The route watch keeps riding port-forward (through the same
//! SSH path); the data channel does not depend on it (installed routes stay while
//! it reconnects).
//!
//! Who runs what: the probe runs in the CLI over its SSH connection to the API
//! server; the forwards run in the unprivileged session agent, over the agent's own
//! SSH connection (the root daemon only dials the agent's loopback listener and
//! never sees SSH keys). Liveness is the same on both paths: the root daemon's
//! heartbeats find a dead data channel in 3 s and redial the agent; the agent's SSH
//! keepalives ([`SESSION_KEEPALIVE`]) give up a silent SSH connection, and the
//! next channel redials SSH ([`super::tunnel`]).
//!
//! I/O: `direct-tcpip` channels over [`SshDialer`]; the laptop-side TCP stream.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tokio::net::TcpStream;
use tracing::info;

use super::client::ConnectError;
use super::{SshDialer, SshTunnel};

/// How long the SSH host may take to open a channel to the manager's ClusterIP
/// before the probe gives up and the session uses port-forward (KubeVPN's value;
/// a node opens it in milliseconds, a host that cannot route there fails at once
/// or black-holes).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// SSH keepalive interval of the session agent's SSH connection: the connection is
/// given up after [`super::client::KEEPALIVE_MAX`] unanswered ones (the SSH server
/// silent for 6–8 s), and the next data or API connection redials SSH. Shorter
/// than the CLI's (10 s): the agent's connection carries the data channel, and a
/// black-holed jump host should cost seconds, not half a minute. While the data
/// channel runs, the manager's heartbeat echoes (every 1 s) keep the server from
/// looking silent, so no keepalive is sent at all.
pub const SESSION_KEEPALIVE: Duration = Duration::from_secs(2);

/// How long one data connection of the root daemon waits for a channel to the
/// manager (e.g. the ClusterIP has no ready endpoint while the manager pod is
/// replaced) before the agent closes it. Like the port-forward's wait: shorter
/// than the root daemon's TLS handshake timeout (5 s).
pub const OPEN_WAIT: Duration = Duration::from_secs(4);

/// Pause between channel attempts while waiting.
const OPEN_POLL: Duration = Duration::from_millis(500);

/// How a session's data channel reaches the traffic manager.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataPath {
    /// `direct-tcpip` from the last SSH hop (`user@host:port`) to the manager
    /// Service's ClusterIP and data port.
    SshDirect {
        last_hop: String,
        target: SocketAddr,
    },
    /// `pods/portforward` through the API server, which is reached through the SSH
    /// path `ssh` (`a -> b`) when there is one.
    PortForward { ssh: Option<String> },
    /// Port-forward through the SSH path `ssh` because its last hop did not reach
    /// the manager's `target` at connect (`why`): the session probes ssh-direct
    /// again later and moves to it once it works (a bastion whose route to the
    /// cluster appears later, a NetworkPolicy lifted).
    PortForwardProbing {
        ssh: String,
        target: SocketAddr,
        why: String,
    },
}

impl DataPath {
    /// `ssh-direct` or `port-forward`.
    pub fn kind(&self) -> &'static str {
        match self {
            DataPath::SshDirect { .. } => "ssh-direct",
            DataPath::PortForward { .. } | DataPath::PortForwardProbing { .. } => "port-forward",
        }
    }

    /// One line for `kvpn status` (`Origin.data_path`): the kind, then how.
    pub fn describe(&self) -> String {
        match self {
            DataPath::SshDirect { last_hop, target } => {
                format!("ssh-direct via {last_hop} to {target}")
            }
            DataPath::PortForward { ssh: Some(path) }
            | DataPath::PortForwardProbing { ssh: path, .. } => {
                format!("port-forward via ssh {path}")
            }
            DataPath::PortForward { ssh: None } => "port-forward".to_owned(),
        }
    }

    /// The ClusterIP and port the agent forwards to, for ssh-direct.
    pub fn ssh_direct_target(&self) -> Option<SocketAddr> {
        match self {
            DataPath::SshDirect { target, .. } => Some(*target),
            DataPath::PortForward { .. } | DataPath::PortForwardProbing { .. } => None,
        }
    }

    /// `StartSessionRequest`'s `ssh_direct` and `ssh_direct_failed` for this
    /// path: the target (on ssh-direct, or probed again from port-forward) and
    /// why connect's probe failed (empty on ssh-direct or without SSH).
    pub fn request_fields(&self) -> (String, String) {
        let target = self
            .ssh_direct_target()
            .or_else(|| self.ssh_direct_candidate().map(|(t, _)| t))
            .map(|t| t.to_string())
            .unwrap_or_default();
        let failed = self
            .ssh_direct_candidate()
            .map(|(_, why)| why.to_owned())
            .unwrap_or_default();
        (target, failed)
    }

    /// The ClusterIP and port a session on port-forward probes again, and why
    /// connect's probe failed.
    pub fn ssh_direct_candidate(&self) -> Option<(SocketAddr, &str)> {
        match self {
            DataPath::PortForwardProbing { target, why, .. } => Some((*target, why)),
            _ => None,
        }
    }
}

/// Why the probe chose port-forward.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("the traffic manager's Service has no ClusterIP")]
    NoClusterIp,
    #[error("{hop} did not open a channel to {target} within {} s", PROBE_TIMEOUT.as_secs())]
    Timeout { hop: String, target: SocketAddr },
    #[error(transparent)]
    Ssh(#[from] ConnectError),
}

/// Whether the last hop of `dialer` opens a channel to `target` within `within`;
/// the time it took. The channel is closed at once (the manager sees a TCP
/// connection that ends before its TLS handshake).
pub async fn probe(
    dialer: &SshDialer,
    target: SocketAddr,
    within: Duration,
) -> Result<Duration, ProbeError> {
    let t0 = tokio::time::Instant::now();
    let channel =
        tokio::time::timeout(within, dialer.open(&target.ip().to_string(), target.port()))
            .await
            .map_err(|_| ProbeError::Timeout {
                hop: dialer.last_hop(),
                target,
            })??;
    drop(channel);
    Ok(t0.elapsed())
}

/// The data path of a new session: ssh-direct when the session's SSH host reaches
/// the manager Service's `cluster_ip`:`port` ([`probe`]), else port-forward. Never
/// fails; a fallback is logged at info with its reason.
pub async fn choose(tunnel: Option<&SshTunnel>, cluster_ip: Option<IpAddr>, port: u16) -> DataPath {
    let Some(tunnel) = tunnel else {
        return DataPath::PortForward { ssh: None };
    };
    let dialer = tunnel.dialer();
    let fallback = DataPath::PortForward {
        ssh: Some(dialer.path()),
    };
    let target = cluster_ip.map(|ip| SocketAddr::new(ip, port));
    let result = match target {
        Some(target) => probe(&dialer, target, PROBE_TIMEOUT)
            .await
            .map(|took| (target, took)),
        None => Err(ProbeError::NoClusterIp),
    };
    match result {
        Ok((target, took)) => {
            let path = DataPath::SshDirect {
                last_hop: dialer.last_hop(),
                target,
            };
            info!(
                data_path = %path.describe(),
                probe_ms = took.as_millis(),
                "the SSH host reaches the traffic manager's ClusterIP: the data channel bypasses the API server"
            );
            path
        }
        Err(why) => {
            info!(
                data_path = %fallback.describe(),
                "SSH data-plane bypass not available ({why}); the data channel uses port-forward"
            );
            match target {
                // Probed again later by the session (ssh-direct may start to work).
                Some(target) => DataPath::PortForwardProbing {
                    ssh: dialer.path(),
                    target,
                    why: why.to_string(),
                },
                None => fallback,
            }
        }
    }
}

/// Why one data connection could not be carried.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error(
        "no channel from {hop} to the traffic manager at {target} within {} s: {cause}",
        OPEN_WAIT.as_secs()
    )]
    Open {
        hop: String,
        target: SocketAddr,
        cause: String,
    },
    #[error("the channel from {hop} to {target} broke: {cause}")]
    Broken {
        hop: String,
        target: SocketAddr,
        cause: String,
    },
}

/// Carries one data connection of the root daemon (accepted on the agent's
/// loopback listener) to the manager through a fresh `direct-tcpip` channel to
/// `target`; returns the bytes moved up (laptop → manager) and down. Retries the
/// channel for up to [`OPEN_WAIT`] (a manager pod being replaced), redialling SSH
/// when its connection died.
pub async fn forward(
    dialer: &SshDialer,
    target: SocketAddr,
    laptop: TcpStream,
) -> Result<(u64, u64), ForwardError> {
    let deadline = tokio::time::Instant::now() + OPEN_WAIT;
    let host = target.ip().to_string();
    let mut waited = false;
    let mut remote = loop {
        let attempt = tokio::time::timeout_at(deadline, dialer.open(&host, target.port())).await;
        let cause = match attempt {
            Ok(Ok(stream)) => break stream,
            Ok(Err(e)) => e.to_string(),
            Err(_) => "timed out".to_owned(),
        };
        if tokio::time::Instant::now() + OPEN_POLL >= deadline {
            return Err(ForwardError::Open {
                hop: dialer.last_hop(),
                target,
                cause,
            });
        }
        if !waited {
            info!(%target, "waiting up to {} s for a channel to the traffic manager: {cause}", OPEN_WAIT.as_secs());
            waited = true;
        }
        tokio::time::sleep(OPEN_POLL).await;
    };
    carry(dialer, target, laptop, &mut remote).await
}

/// Carries one data connection over an open `direct-tcpip` channel `remote`
/// to `target`; the bytes moved up and down.
pub async fn carry(
    dialer: &SshDialer,
    target: SocketAddr,
    mut laptop: TcpStream,
    remote: &mut russh::ChannelStream<russh::client::Msg>,
) -> Result<(u64, u64), ForwardError> {
    let _ = laptop.set_nodelay(true);
    super::tunnel::relay(&mut laptop, remote)
        .await
        .map_err(|e| ForwardError::Broken {
            hop: dialer.last_hop(),
            target,
            cause: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_paths_read_as_status_shows_them() {
        let direct = DataPath::SshDirect {
            last_hop: "root@172.31.255.1:2222".into(),
            target: "10.96.0.45:10801".parse().expect("addr"),
        };
        assert_eq!(direct.kind(), "ssh-direct");
        assert_eq!(
            direct.describe(),
            "ssh-direct via root@172.31.255.1:2222 to 10.96.0.45:10801"
        );
        assert_eq!(
            direct.ssh_direct_target(),
            Some("10.96.0.45:10801".parse().expect("addr"))
        );
        let pf = DataPath::PortForward {
            ssh: Some("ops@b1:22 -> root@b2:22".into()),
        };
        assert_eq!(pf.kind(), "port-forward");
        assert_eq!(
            pf.describe(),
            "port-forward via ssh ops@b1:22 -> root@b2:22"
        );
        assert_eq!(pf.ssh_direct_target(), None);
        assert_eq!(
            DataPath::PortForward { ssh: None }.describe(),
            "port-forward"
        );
    }
}
