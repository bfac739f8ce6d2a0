//! The local forward to the API server: a loopback listener whose every TCP
//! connection becomes one `direct-tcpip` channel from the last SSH hop to the API
//! server. The SSH path is opened once up front (so a wrong host key or login fails
//! the command at once) and opened again, on the next connection, when it died
//! (sshd restarted, a hop rebooted, keepalives unanswered): the kube client's
//! retries then ride a fresh path.
//!
//! I/O: the loopback listener and the SSH connections ([`super::client`]).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;
use tracing::{info, warn};

use super::SshPlan;
use super::client::{self, ConnectError, SshChain};

/// Pause before a reconnect attempt after a failed one, so a dead jump host is not
/// hammered by the kube client's retries.
const RECONNECT_PAUSE: Duration = Duration::from_millis(500);

struct Shared {
    plan: SshPlan,
    agent_sock: Option<PathBuf>,
    target: (String, u16),
    chain: Mutex<Option<Arc<SshChain>>>,
    reconnects: std::sync::atomic::AtomicU64,
    /// Why the last channel could not be opened (hop, cause, fix), until one is
    /// opened again: what `kvpn status` shows for a session whose data channel
    /// rides this path, instead of the symptom the root daemon sees.
    last_error: std::sync::Mutex<Option<String>>,
}

impl Shared {
    /// The current SSH path, opened again if it died.
    async fn chain(&self) -> Result<Arc<SshChain>, ConnectError> {
        let mut slot = self.chain.lock().await;
        if let Some(c) = slot.as_ref()
            && !c.is_closed()
        {
            return Ok(c.clone());
        }
        if slot.take().is_some() {
            warn!(path = %self.plan.describe(), "the SSH connection died; reconnecting");
        }
        let fresh = match client::connect(&self.plan, self.agent_sock.as_deref()).await {
            Ok(c) => Arc::new(c),
            Err(e) => {
                tokio::time::sleep(RECONNECT_PAUSE).await;
                return Err(e);
            }
        };
        let n = self
            .reconnects
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if n > 0 {
            info!(path = %self.plan.describe(), reconnects = n, "SSH path open again");
        }
        *slot = Some(fresh.clone());
        Ok(fresh)
    }

    /// A `direct-tcpip` channel from the last hop to `host`:`port` over the current
    /// SSH path, opened again if it died.
    async fn open(
        &self,
        host: &str,
        port: u16,
    ) -> Result<russh::ChannelStream<russh::client::Msg>, ConnectError> {
        let opened = self.open_once(host, port).await;
        *self
            .last_error
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            opened.as_ref().err().map(ToString::to_string);
        opened
    }

    async fn open_once(
        &self,
        host: &str,
        port: u16,
    ) -> Result<russh::ChannelStream<russh::client::Msg>, ConnectError> {
        let chain = self.chain().await?;
        match chain.open(host, port).await {
            Ok(s) => Ok(s),
            // The path may have died between the check and the open: once more fresh.
            Err(_) if chain.is_closed() => self.chain().await?.open(host, port).await,
            Err(e) => Err(e),
        }
    }

    fn last_error(&self) -> Option<String> {
        self.last_error
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    async fn forward(&self, mut laptop: TcpStream) -> Result<(u64, u64), String> {
        let (host, port) = &self.target;
        let mut remote = self.open(host, *port).await.map_err(|e| e.to_string())?;
        relay(&mut laptop, &mut remote)
            .await
            .map_err(|e| e.to_string())
    }
}

/// Copy buffer per direction of [`relay`]: at least one SSH data packet (russh's
/// channel writes take up to the server's maximum packet size, 32 KiB for
/// OpenSSH), so every write to the channel is one full packet and every packet read
/// from it one write to the local socket. tokio's default (8 KiB) cut each into
/// four: four messages through russh's session task and four packets (MAC,
/// header) on the wire for one.
pub const RELAY_BUFFER: usize = 64 * 1024;

/// Copies both ways between a local TCP connection and a channel until both ends
/// closed; the bytes moved (local → channel, channel → local).
pub async fn relay(
    local: &mut TcpStream,
    channel: &mut russh::ChannelStream<russh::client::Msg>,
) -> std::io::Result<(u64, u64)> {
    tokio::io::copy_bidirectional_with_sizes(local, channel, RELAY_BUFFER, RELAY_BUFFER).await
}

/// A running local forward through SSH to the API server. Dropping it stops the
/// listener and closes the SSH path.
pub struct SshTunnel {
    local: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl SshTunnel {
    /// Opens the SSH path of `plan` and listens on 127.0.0.1 (a free port) for
    /// connections to forward to `target` (host and port as the last hop resolves
    /// them). `agent_sock` is the user's `SSH_AUTH_SOCK`.
    pub async fn start(
        plan: SshPlan,
        agent_sock: Option<PathBuf>,
        target: (String, u16),
    ) -> Result<Self, ConnectError> {
        let shared = Arc::new(Shared {
            plan,
            agent_sock,
            target,
            chain: Mutex::new(None),
            reconnects: std::sync::atomic::AtomicU64::new(0),
            last_error: std::sync::Mutex::new(None),
        });
        // Fail now, with the real reason, rather than on the first API request.
        let chain = shared.chain().await?;
        // The API server must be reachable from the last hop, too.
        let probe = chain.open(&shared.target.0, shared.target.1).await?;
        drop(probe);
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| ConnectError::Ssh {
                hop: chain.last_hop.clone(),
                cause: format!("cannot listen on 127.0.0.1 for the local forward: {e}"),
            })?;
        let local = listener.local_addr().map_err(|e| ConnectError::Ssh {
            hop: chain.last_hop.clone(),
            cause: e.to_string(),
        })?;
        info!(%local, path = %shared.plan.describe(), target = ?shared.target, "SSH local forward to the API server");
        let task = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(SshTunnel {
            local,
            shared,
            task,
        })
    }

    /// The loopback address that leads to the API server.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// A handle that opens further channels over this tunnel's SSH path (opened
    /// again when it died), for other destinations than the API server: the SSH
    /// data-plane bypass ([`super::bypass`]).
    pub fn dialer(&self) -> SshDialer {
        SshDialer {
            shared: self.shared.clone(),
        }
    }

    /// How many times the SSH path was opened again after it died.
    pub fn reconnects(&self) -> u64 {
        self.shared
            .reconnects
            .load(std::sync::atomic::Ordering::Relaxed)
            .saturating_sub(1)
    }

    /// Stops the listener and closes the SSH path.
    pub async fn close(self) {
        self.task.abort();
        if let Some(c) = self.shared.chain.lock().await.take() {
            c.close().await;
        }
    }
}

impl Drop for SshTunnel {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                warn!("SSH local forward: accept failed: {e}");
                tokio::time::sleep(RECONNECT_PAUSE).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let shared = shared.clone();
        tokio::spawn(async move {
            match shared.forward(stream).await {
                Ok((up, down)) => tracing::debug!(%peer, up, down, "SSH forward closed"),
                Err(e) => warn!(%peer, "SSH forward to the API server: {e}"),
            }
        });
    }
}

/// Opens `direct-tcpip` channels over the SSH path of an [`SshTunnel`], sharing
/// its connections and its reconnect: a dead path is opened again on the next
/// channel. Cheap to clone.
#[derive(Clone)]
pub struct SshDialer {
    shared: Arc<Shared>,
}

impl SshDialer {
    /// A channel from the last hop to `host`:`port`, as a byte stream.
    pub async fn open(
        &self,
        host: &str,
        port: u16,
    ) -> Result<russh::ChannelStream<russh::client::Msg>, ConnectError> {
        self.shared.open(host, port).await
    }

    /// How many times the SSH path was opened (1 after the first): a change
    /// across an attempt means the path died and was re-opened meanwhile.
    pub fn generation(&self) -> u64 {
        self.shared
            .reconnects
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether an SSH path is open and not being re-opened right now (a dial
    /// in progress holds the slot).
    pub fn is_open(&self) -> bool {
        self.shared
            .chain
            .try_lock()
            .is_ok_and(|slot| slot.as_ref().is_some_and(|c| !c.is_closed()))
    }

    /// The last hop (`user@host:port`), the one that dials onwards.
    pub fn last_hop(&self) -> String {
        self.shared
            .plan
            .hops
            .last()
            .map(super::Hop::display)
            .unwrap_or_default()
    }

    /// The whole path, `a -> b -> c`.
    pub fn path(&self) -> String {
        self.shared.plan.describe()
    }

    /// Why the path's last channel (to the API server or onwards) could not be
    /// opened — naming the hop, the cause and the fix — until one opens again;
    /// `None` while it works.
    pub fn last_error(&self) -> Option<String> {
        self.shared.last_error()
    }
}
