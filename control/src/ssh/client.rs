//! The SSH client (russh): dial the hops of an [`SshPlan`] one after the other (the
//! first over TCP from the laptop, each next one through a `direct-tcpip` channel of
//! the previous), check every host key against known_hosts ([`super::known_hosts`])
//! and log in.
//!
//! Authentication per hop, in this order: Kerberos when a `--gssapi-*` flag names
//! the hop's credentials ([`super::gssapi`]; they failing to be had fails the
//! connect at once), the `--ssh-password` of that hop, then ssh-agent
//! (`SSH_AUTH_SOCK`) identities, then the hop's key files, and last Kerberos with
//! the default credential cache when it holds tickets. A
//! passphrase-protected key file is used only through the agent (its public half is
//! readable without the passphrase, so the agent's copy is found): kvpn never asks
//! for a passphrase and never waits for input, so without an agent holding it the
//! connect fails at once and says so (case ssh-02).
//!
//! I/O: TCP to the first hop, the ssh-agent socket, key files, the known_hosts file.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use russh::client::{self, Handle};
use russh::keys::agent::AgentIdentity;
use russh::keys::agent::client::AgentClient;
use russh::keys::{PrivateKey, PrivateKeyWithHashAlg, PublicKey, PublicKeyOrCertificate};
use tracing::{debug, info};

use super::known_hosts::{self, KnownHosts, Verdict};
use super::{Hop, SshPlan};

/// How long one hop may take to answer (TCP or channel open, key exchange, login).
pub const HOP_TIMEOUT: Duration = Duration::from_secs(15);

/// SSH keepalive: a `keepalive@openssh.com` request after this much silence from the
/// server, and the connection is closed after [`KEEPALIVE_MAX`] unanswered ones, so
/// a black-holed jump host is noticed within about 30 s (a killed sshd or a reset is
/// noticed at once, by the TCP connection closing).
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// See [`KEEPALIVE_INTERVAL`].
pub const KEEPALIVE_MAX: usize = 3;

/// Why the SSH path could not be opened. Each names the hop, the cause and the fix.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("cannot reach SSH host {hop}: {cause} — check the address and that sshd runs there")]
    Unreachable { hop: String, cause: String },
    #[error("SSH host {hop} did not answer within {} s ({stage})", HOP_TIMEOUT.as_secs())]
    Timeout { hop: String, stage: &'static str },
    #[error(
        "SSH host {hop} is not in {known_hosts}: its {key_type} key is {fingerprint} — \
         verify it, then add it (ssh-keyscan -p {port} {host} >> {known_hosts}) or pass \
         --ssh-accept-new to record it"
    )]
    UnknownHost {
        hop: String,
        host: String,
        port: u16,
        key_type: String,
        fingerprint: String,
        known_hosts: String,
    },
    #[error(
        "HOST KEY OF {hop} HAS CHANGED: it showed an {key_type} key {fingerprint}, but \
         {known_hosts}:{line} lists another {expected} key for it — someone may be \
         intercepting the connection; if the host was really re-keyed, remove line {line} \
         of {known_hosts}"
    )]
    HostKeyChanged {
        hop: String,
        key_type: String,
        fingerprint: String,
        expected: String,
        known_hosts: String,
        line: usize,
    },
    #[error(
        "SSH host {hop} showed an {key_type} key ({fingerprint}) but {known_hosts}:{line} \
         lists only an {listed} key for it — refusing; if the host was re-keyed, fix line \
         {line} of {known_hosts}"
    )]
    HostKeyOtherType {
        hop: String,
        key_type: String,
        fingerprint: String,
        listed: String,
        known_hosts: String,
        line: usize,
    },
    #[error("SSH host {hop} showed a key marked @revoked in {known_hosts}:{line} — refusing")]
    HostKeyRevoked {
        hop: String,
        known_hosts: String,
        line: usize,
    },
    #[error("cannot record the key of {hop} in {known_hosts}: {cause}")]
    RecordKey {
        hop: String,
        known_hosts: String,
        cause: String,
    },
    #[error(
        "key file {path} is protected by a passphrase and no ssh-agent holds it ({agent}) — \
         kvpn never prompts: load it with `ssh-add {path}` and make sure SSH_AUTH_SOCK \
         is set"
    )]
    EncryptedKey { path: PathBuf, agent: String },
    #[error("cannot read key file {path}: {cause} — check --ssh-keyfile / IdentityFile")]
    KeyFile { path: PathBuf, cause: String },
    #[error("SSH login to {hop} failed: tried {tried} — {fix}")]
    AuthFailed {
        hop: String,
        tried: String,
        fix: String,
    },
    #[error("SSH host {hop}: {cause}")]
    Ssh { hop: String, cause: String },
    #[error("Kerberos login to {hop} failed: {cause}")]
    Kerberos { hop: String, cause: String },
    #[error(
        "SSH host {hop} refused to open a channel to {target}: {cause} — can {hop} reach {target}?"
    )]
    Channel {
        hop: String,
        target: String,
        cause: String,
    },
}

/// The russh handler of one hop: checks the host key, remembers why it refused.
struct HostKeyCheck {
    hop: String,
    host: String,
    port: u16,
    known_hosts: PathBuf,
    accept_new: bool,
    refused: Arc<Mutex<Option<ConnectError>>>,
    /// Set once the server showed its host key (the key exchange got that far).
    key_seen: Arc<AtomicBool>,
}

/// The error of a handshake with `hop` that failed with `e`, `key_seen` telling
/// whether the server had shown its host key. A peer that closes the
/// connection, or answers with something other than an SSH version line,
/// before that is most likely no SSH server (a web server, a closed service
/// behind a proxy): say so, with the fix, instead of a bare "Disconnected".
fn handshake_error(hop: &str, e: &russh::Error, key_seen: bool) -> ConnectError {
    let closed_early = !key_seen
        && match e {
            russh::Error::Disconnect | russh::Error::Version => true,
            russh::Error::IO(io) => matches!(
                io.kind(),
                std::io::ErrorKind::UnexpectedEof
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::BrokenPipe
            ),
            _ => false,
        };
    let hint = if closed_early {
        " — the peer closed the connection before the SSH key exchange: is this address \
         an SSH server (sshd)? check the host and port"
    } else {
        ""
    };
    ConnectError::Ssh {
        hop: hop.to_owned(),
        cause: format!("SSH handshake failed: {e}{hint}"),
    }
}

impl HostKeyCheck {
    #[allow(
        clippy::result_large_err,
        reason = "once per hop and connect; the error carries what the user must see"
    )]
    fn decide(&self, key: &PublicKey) -> Result<(), ConnectError> {
        let text = match std::fs::read_to_string(&self.known_hosts) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => {
                return Err(ConnectError::Ssh {
                    hop: self.hop.clone(),
                    cause: format!("cannot read {}: {e}", self.known_hosts.display()),
                });
            }
        };
        let file = KnownHosts::parse(&self.known_hosts, &text);
        let kh = self.known_hosts.display().to_string();
        let key_type = key.algorithm().as_str().to_owned();
        let fingerprint = key.fingerprint(russh::keys::HashAlg::Sha256).to_string();
        match file.check(&self.host, self.port, key) {
            Verdict::Known { line } => {
                debug!(hop = %self.hop, line, "host key known");
                Ok(())
            }
            Verdict::Unknown if self.accept_new => {
                known_hosts::append_line(
                    &self.known_hosts,
                    &known_hosts::entry_line(&self.host, self.port, key),
                )
                .map_err(|e| ConnectError::RecordKey {
                    hop: self.hop.clone(),
                    known_hosts: kh.clone(),
                    cause: e.to_string(),
                })?;
                info!(hop = %self.hop, %fingerprint, "recorded the new host key in {kh} (--ssh-accept-new)");
                Ok(())
            }
            Verdict::Unknown => Err(ConnectError::UnknownHost {
                hop: self.hop.clone(),
                host: self.host.clone(),
                port: self.port,
                key_type,
                fingerprint,
                known_hosts: kh,
            }),
            Verdict::Changed { line, expected } => Err(ConnectError::HostKeyChanged {
                hop: self.hop.clone(),
                key_type,
                fingerprint,
                expected,
                known_hosts: kh,
                line,
            }),
            Verdict::OtherType { line, listed } => Err(ConnectError::HostKeyOtherType {
                hop: self.hop.clone(),
                key_type,
                fingerprint,
                listed,
                known_hosts: kh,
                line,
            }),
            Verdict::Revoked { line } => Err(ConnectError::HostKeyRevoked {
                hop: self.hop.clone(),
                known_hosts: kh,
                line,
            }),
        }
    }
}

impl client::Handler for HostKeyCheck {
    type Error = russh::Error;

    async fn check_server_key(
        &mut self,
        server_public_key: &PublicKeyOrCertificate,
    ) -> Result<bool, Self::Error> {
        self.key_seen.store(true, Ordering::Relaxed);
        let key = match server_public_key {
            PublicKeyOrCertificate::PublicKey { key, .. } => key.clone(),
            // Not asked for (no certificate algorithms are advertised).
            PublicKeyOrCertificate::Certificate(c) => PublicKey::from(c.public_key().clone()),
        };
        match self.decide(&key) {
            Ok(()) => Ok(true),
            Err(e) => {
                if let Ok(mut slot) = self.refused.lock() {
                    *slot = Some(e);
                }
                Ok(false)
            }
        }
    }
}

/// An open SSH path: one session per hop (each carried by the previous one), the
/// last one dials onwards.
pub struct SshChain {
    // Kept alive: each carries the next hop's TCP stream.
    sessions: Vec<Handle<HostKeyCheck>>,
    /// The last hop, for messages.
    pub last_hop: String,
}

impl SshChain {
    /// Whether any SSH connection of the path died.
    pub fn is_closed(&self) -> bool {
        self.sessions.iter().any(Handle::is_closed)
    }

    /// A `direct-tcpip` channel from the last hop to `host`:`port`, as a byte stream.
    pub async fn open(
        &self,
        host: &str,
        port: u16,
    ) -> Result<russh::ChannelStream<client::Msg>, ConnectError> {
        let last = self.sessions.last().ok_or_else(|| ConnectError::Ssh {
            hop: "(none)".into(),
            cause: "the SSH path has no hop".into(),
        })?;
        let channel = tokio::time::timeout(
            HOP_TIMEOUT,
            last.channel_open_direct_tcpip(host, u32::from(port), "127.0.0.1", 0),
        )
        .await
        .map_err(|_| ConnectError::Timeout {
            hop: self.last_hop.clone(),
            stage: "opening a channel",
        })?
        .map_err(|e| ConnectError::Channel {
            hop: self.last_hop.clone(),
            target: format!("{host}:{port}"),
            cause: e.to_string(),
        })?;
        Ok(channel.into_stream())
    }

    /// A `session` channel on the last hop: a shell or a command there (`kvpn ssh`).
    pub async fn open_session(&self) -> Result<russh::Channel<client::Msg>, ConnectError> {
        let last = self.sessions.last().ok_or_else(|| ConnectError::Ssh {
            hop: "(none)".into(),
            cause: "the SSH path has no hop".into(),
        })?;
        tokio::time::timeout(HOP_TIMEOUT, last.channel_open_session())
            .await
            .map_err(|_| ConnectError::Timeout {
                hop: self.last_hop.clone(),
                stage: "opening a session channel",
            })?
            .map_err(|e| ConnectError::Ssh {
                hop: self.last_hop.clone(),
                cause: format!("cannot open a session channel: {e}"),
            })
    }

    /// Says goodbye on every hop, last first.
    pub async fn close(&self) {
        for s in self.sessions.iter().rev() {
            let _ = s
                .disconnect(russh::Disconnect::ByApplication, "", "en")
                .await;
        }
    }
}

/// Read buffer on the first hop's TCP socket. russh reads every SSH packet with two
/// `read_exact` calls (length, then the rest) straight from the stream it is given:
/// unbuffered, that is two syscalls per packet (for a 32 KiB data packet and the
/// small ones alike); through this buffer one read takes many packets.
const SOCKET_READ_BUFFER: usize = 256 * 1024;

/// The first hop's TCP socket, acknowledging at once what it read (TCP_QUICKACK
/// again after every read: Linux clears it by itself).
///
/// OpenSSH's sshd turns Nagle's algorithm off only for sessions with a terminal, so
/// on a connection that carries only `direct-tcpip` channels it holds a small SSH
/// packet (a ping reply, a TCP handshake's frame) back while an earlier one is
/// unacknowledged — and Linux delays that ACK here (up to 40 ms; the next packet
/// the laptop sends ends the wait sooner). Measured: idle ping through ssh-direct
/// at 100/s took 16 ms p50 with only the laptop side's TCP_NODELAY fixed. The ACK
/// costs one setsockopt per read, and a read takes up to [`SOCKET_READ_BUFFER`].
struct QuickAck(tokio::net::TcpStream);

impl QuickAck {
    fn ack_now(&self) {
        use std::os::fd::AsRawFd;
        let on: libc::c_int = 1;
        // SAFETY: setsockopt on a socket this struct owns, with a c_int it outlives.
        // Failure only means the delayed ACK stays; nothing to do about it.
        unsafe {
            libc::setsockopt(
                self.0.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_QUICKACK,
                (&raw const on).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
}

impl tokio::io::AsyncRead for QuickAck {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = std::pin::Pin::new(&mut self.0).poll_read(cx, buf);
        if matches!(r, std::task::Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.ack_now();
        }
        r
    }
}

impl tokio::io::AsyncWrite for QuickAck {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// russh's cipher order with AES-GCM moved first when the CPU has AES and
/// carry-less multiply instructions (ring and OpenSSH's libcrypto then use them):
/// aes256-gcm costs both ends far less CPU per byte than chacha20-poly1305,
/// russh's default first choice — the SSH path's bulk throughput is CPU-bound on
/// the cipher. Without those instructions software AES is slower, and russh's
/// order stands. The server still picks from this list what it supports.
fn cipher_order(aes_hw: bool) -> Vec<russh::cipher::Name> {
    let default = russh::Preferred::default().cipher.into_owned();
    if !aes_hw {
        return default;
    }
    let gcm = [russh::cipher::AES_256_GCM, russh::cipher::AES_128_GCM];
    let mut order: Vec<_> = gcm.to_vec();
    order.extend(default.into_iter().filter(|c| !gcm.contains(c)));
    order
}

/// Whether this CPU has AES-NI and PCLMULQDQ ([`cipher_order`]).
fn aes_hardware() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("aes")
            && std::arch::is_x86_feature_detected!("pclmulqdq")
    }
    #[cfg(target_arch = "aarch64")]
    {
        std::arch::is_aarch64_feature_detected!("aes")
            && std::arch::is_aarch64_feature_detected!("pmull")
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

fn ssh_config(known: &KnownHosts, hop: &Hop, keepalive: Duration) -> Arc<client::Config> {
    let mut preferred = russh::Preferred::default();
    let listed = known.listed_algorithms(&hop.host, hop.port);
    preferred.key = known_hosts::prefer_listed(&preferred.key, &listed).into();
    preferred.cipher = cipher_order(aes_hardware()).into();
    Arc::new(client::Config {
        preferred,
        keepalive_interval: Some(keepalive),
        keepalive_max: KEEPALIVE_MAX,
        // Only applied by russh to sockets it dials itself; `connect` sets it on
        // the socket it hands to russh.
        nodelay: true,
        ..Default::default()
    })
}

/// Opens the whole path of `plan`: every hop dialled, its host key checked and
/// logged in. `agent_sock` is the user's `SSH_AUTH_SOCK`.
pub async fn connect(plan: &SshPlan, agent_sock: Option<&Path>) -> Result<SshChain, ConnectError> {
    let known_text = std::fs::read_to_string(&plan.known_hosts).unwrap_or_default();
    let known = KnownHosts::parse(&plan.known_hosts, &known_text);
    let mut sessions: Vec<Handle<HostKeyCheck>> = Vec::new();
    let mut last_hop = String::new();
    for hop in &plan.hops {
        let name = hop.display();
        let refused = Arc::new(Mutex::new(None));
        let key_seen = Arc::new(AtomicBool::new(false));
        let handler = HostKeyCheck {
            key_seen: key_seen.clone(),
            hop: name.clone(),
            host: hop.host.clone(),
            port: hop.port,
            known_hosts: plan.known_hosts.clone(),
            accept_new: plan.accept_new,
            refused: refused.clone(),
        };
        let config = ssh_config(&known, hop, plan.keepalive_interval());
        let handshake = async {
            match sessions.last() {
                None => {
                    let tcp = tokio::net::TcpStream::connect((hop.host.as_str(), hop.port))
                        .await
                        .map_err(|e| ConnectError::Unreachable {
                            hop: name.clone(),
                            cause: e.to_string(),
                        })?;
                    // Without TCP_NODELAY (russh sets it only in `client::connect`,
                    // not on a stream given to `connect_stream`), a small SSH packet
                    // (a 1-byte request, a TCP handshake's frame) written while an
                    // earlier one is unacknowledged waits for the server's delayed
                    // ACK: tens of ms per round trip.
                    if let Err(e) = tcp.set_nodelay(true) {
                        debug!(hop = %name, "cannot set TCP_NODELAY: {e}");
                    }
                    let tcp =
                        tokio::io::BufReader::with_capacity(SOCKET_READ_BUFFER, QuickAck(tcp));
                    client::connect_stream(config, tcp, handler).await
                }
                Some(prev) => {
                    let channel = prev
                        .channel_open_direct_tcpip(
                            hop.host.clone(),
                            u32::from(hop.port),
                            "127.0.0.1",
                            0,
                        )
                        .await
                        .map_err(|e| ConnectError::Channel {
                            hop: last_hop.clone(),
                            target: format!("{}:{}", hop.host, hop.port),
                            cause: e.to_string(),
                        })?;
                    client::connect_stream(config, channel.into_stream(), handler).await
                }
            }
            .map_err(|e| {
                refused
                    .lock()
                    .ok()
                    .and_then(|mut r| r.take())
                    .unwrap_or_else(|| handshake_error(&name, &e, key_seen.load(Ordering::Relaxed)))
            })
        };
        let mut session = tokio::time::timeout(HOP_TIMEOUT, handshake)
            .await
            .map_err(|_| ConnectError::Timeout {
                hop: name.clone(),
                stage: "connecting and key exchange",
            })??;
        tokio::time::timeout(
            HOP_TIMEOUT,
            authenticate(
                &mut session,
                hop,
                &name,
                agent_sock,
                plan.default_ccache.as_deref(),
            ),
        )
        .await
        .map_err(|_| ConnectError::Timeout {
            hop: name.clone(),
            stage: "login",
        })??;
        info!(hop = %name, "SSH hop up");
        sessions.push(session);
        last_hop = name;
    }
    Ok(SshChain { sessions, last_hop })
}

/// A key file read for login: usable directly, or only through the agent.
enum KeyFile {
    Plain(Box<PrivateKey>),
    Encrypted(PublicKey),
}

#[allow(
    clippy::result_large_err,
    reason = "once per key file and connect; the error carries what the user must see"
)]
fn read_key_file(path: &Path) -> Result<KeyFile, ConnectError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConnectError::KeyFile {
        path: path.to_owned(),
        cause: e.to_string(),
    })?;
    // OpenSSH-format keys keep the public half in clear, also when encrypted.
    if let Ok(key) = PrivateKey::from_openssh(text.as_bytes()) {
        if key.is_encrypted() {
            return Ok(KeyFile::Encrypted(key.public_key().clone()));
        }
        return Ok(KeyFile::Plain(Box::new(key)));
    }
    match russh::keys::decode_secret_key(&text, None) {
        Ok(key) => Ok(KeyFile::Plain(Box::new(key))),
        Err(russh::keys::Error::KeyIsEncrypted) => {
            // A legacy PEM key: its public half is in `<path>.pub`, if anywhere.
            let pub_path = PathBuf::from(format!("{}.pub", path.display()));
            match russh::keys::load_public_key(&pub_path) {
                Ok(public) => Ok(KeyFile::Encrypted(public)),
                Err(_) => Err(ConnectError::EncryptedKey {
                    path: path.to_owned(),
                    agent: format!(
                        "and there is no {} to match it in an agent",
                        pub_path.display()
                    ),
                }),
            }
        }
        Err(e) => Err(ConnectError::KeyFile {
            path: path.to_owned(),
            cause: e.to_string(),
        }),
    }
}

async fn authenticate(
    session: &mut Handle<HostKeyCheck>,
    hop: &Hop,
    name: &str,
    agent_sock: Option<&Path>,
    default_ccache: Option<&str>,
) -> Result<(), ConnectError> {
    let ssh_err = |e: russh::Error| ConnectError::Ssh {
        hop: name.to_owned(),
        cause: e.to_string(),
    };
    let mut tried: Vec<String> = Vec::new();
    if let Some(creds) = &hop.gssapi {
        let acquired = acquire_krb5(Some(creds), None, hop, name).await?;
        tried.push(format!("Kerberos as {}", acquired.principal));
        if kerberos(session, hop, name, &acquired).await? {
            return Ok(());
        }
    }
    if let Some(pw) = &hop.password {
        tried.push("password".into());
        if session
            .authenticate_password(&hop.user, pw)
            .await
            .map_err(ssh_err)?
            .success()
        {
            return Ok(());
        }
    }
    // The agent, when there is one.
    let mut agent = None;
    let mut agent_state = "SSH_AUTH_SOCK is not set".to_owned();
    if let Some(sock) = agent_sock {
        match AgentClient::connect_uds(sock).await {
            Ok(mut a) => match a.request_identities().await {
                Ok(ids) => {
                    agent_state =
                        format!("the agent at {} holds {} keys", sock.display(), ids.len());
                    agent = Some((a, ids));
                }
                Err(e) => agent_state = format!("the agent at {} failed: {e}", sock.display()),
            },
            Err(e) => agent_state = format!("cannot reach the agent at {}: {e}", sock.display()),
        }
    }
    let rsa_hash = session
        .best_supported_rsa_hash()
        .await
        .map_err(ssh_err)?
        .flatten();
    if let Some((a, ids)) = agent.as_mut() {
        for id in ids.iter() {
            let AgentIdentity::PublicKey { key, comment } = id else {
                continue;
            };
            tried.push(format!(
                "agent key {}",
                if comment.is_empty() {
                    key.algorithm().as_str().to_owned()
                } else {
                    comment.clone()
                }
            ));
            match session
                .authenticate_publickey_with(&hop.user, key.clone(), rsa_hash, a)
                .await
            {
                Ok(r) if r.success() => return Ok(()),
                Ok(_) => {}
                Err(e) => debug!(hop = %name, "agent signature failed: {e}"),
            }
        }
    }
    for path in &hop.identity_files {
        let key = match read_key_file(path) {
            Ok(k) => k,
            // A default or config IdentityFile that does not exist is skipped, as ssh does.
            Err(ConnectError::KeyFile { cause, .. }) if !path.exists() => {
                debug!(hop = %name, path = %path.display(), "{cause}");
                continue;
            }
            Err(e) => return Err(e),
        };
        match key {
            KeyFile::Plain(k) => {
                tried.push(format!("key file {}", path.display()));
                let k = PrivateKeyWithHashAlg::new(Arc::new(*k), rsa_hash);
                if session
                    .authenticate_publickey(&hop.user, k)
                    .await
                    .map_err(ssh_err)?
                    .success()
                {
                    return Ok(());
                }
            }
            KeyFile::Encrypted(public) => {
                let held = agent.as_ref().is_some_and(|(_, ids)| {
                    ids.iter().any(|id| matches!(id, AgentIdentity::PublicKey { key, .. } if key.key_data() == public.key_data()))
                });
                if !held {
                    return Err(ConnectError::EncryptedKey {
                        path: path.clone(),
                        agent: agent_state,
                    });
                }
                // Already offered with the agent's keys above, and refused.
                tried.push(format!("key file {} (through the agent)", path.display()));
            }
        }
    }
    // Last, like ssh's GSSAPIAuthentication: the default cache, when it holds tickets.
    if hop.gssapi.is_none() {
        match acquire_krb5(None, default_ccache, hop, name).await {
            Ok(acquired) => {
                tried.push(format!(
                    "Kerberos as {} (default cache)",
                    acquired.principal
                ));
                // The last method: its failure is one more thing tried, not the error.
                match kerberos(session, hop, name, &acquired).await {
                    Ok(true) => return Ok(()),
                    Ok(false) => {}
                    Err(e) => {
                        debug!(hop = %name, "{e}");
                        if let Some(t) = tried.last_mut() {
                            t.push_str(&format!(": {e}"));
                        }
                    }
                }
            }
            Err(e) => debug!(hop = %name, "no Kerberos login: {e}"),
        }
    }
    if tried.is_empty() {
        return Err(ConnectError::AuthFailed {
            hop: name.to_owned(),
            tried: "nothing".into(),
            fix: format!(
                "no password, no usable key file, no agent ({agent_state}) and no Kerberos \
                 tickets: pass --ssh-keyfile, --ssh-password or a --gssapi-* flag, or load \
                 a key into ssh-agent"
            ),
        });
    }
    Err(ConnectError::AuthFailed {
        hop: name.to_owned(),
        tried: tried.join(", "),
        fix: format!(
            "check the user ({}) and the credentials for this host",
            hop.user
        ),
    })
}

/// Kerberos credentials for `hop` (from its flag, or the default cache), off the
/// async threads.
async fn acquire_krb5(
    creds: Option<&super::gssapi::Creds>,
    default_ccache: Option<&str>,
    hop: &Hop,
    name: &str,
) -> Result<super::gssapi::Acquired, ConnectError> {
    let (creds, user) = (creds.cloned(), hop.user.clone());
    let default_ccache = default_ccache.map(str::to_owned);
    tokio::task::spawn_blocking(move || {
        super::gssapi::acquire(creds.as_ref(), default_ccache.as_deref(), &user)
    })
    .await
    .map_err(|e| ConnectError::Kerberos {
        hop: name.to_owned(),
        cause: format!("the credential lookup did not finish: {e}"),
    })?
    .map_err(|e| ConnectError::Kerberos {
        hop: name.to_owned(),
        cause: e.to_string(),
    })
}

/// One `gssapi-with-mic` attempt with `acquired`; `Ok(false)` when the server
/// refuses it (the next method may still work), an error when the Kerberos side
/// fails (service ticket, MIC).
async fn kerberos(
    session: &mut Handle<HostKeyCheck>,
    hop: &Hop,
    name: &str,
    acquired: &super::gssapi::Acquired,
) -> Result<bool, ConnectError> {
    let krb_err = |cause: String| ConnectError::Kerberos {
        hop: name.to_owned(),
        cause: format!("{} as {}: {cause}", hop.host, acquired.principal),
    };
    let mut login = super::gssapi::Login::new(acquired, &hop.host).map_err(krb_err)?;
    let result = session
        .authenticate_gssapi_with_mic(
            &hop.user,
            vec![super::gssapi::KRB5_MECH_DER.to_vec()],
            &mut login,
        )
        .await
        .map_err(|e| krb_err(e.to_string()))?;
    if result.success() {
        return Ok(true);
    }
    match &login.server_error {
        Some(m) => debug!(hop = %name, "the server refused the Kerberos login: {m}"),
        None => debug!(hop = %name, "the server refused the Kerberos login"),
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cipher_order_puts_aes_gcm_first_only_with_aes_hardware() {
        let default = russh::Preferred::default().cipher.into_owned();
        assert_eq!(cipher_order(false), default);
        let fast = cipher_order(true);
        assert_eq!(
            fast[..2],
            [russh::cipher::AES_256_GCM, russh::cipher::AES_128_GCM]
        );
        // Nothing dropped, nothing twice: the others keep russh's order.
        let rest: Vec<_> = default
            .iter()
            .filter(|c| !fast[..2].contains(c))
            .cloned()
            .collect();
        assert_eq!(fast[2..], rest[..]);
        assert!(fast.contains(&russh::cipher::CHACHA20_POLY1305));
    }

    #[test]
    fn host_key_messages_say_an_before_ssh_key_types() {
        let e = ConnectError::HostKeyOtherType {
            hop: "b".into(),
            key_type: "ssh-ed25519".into(),
            fingerprint: "SHA256:x".into(),
            listed: "ecdsa-sha2-nistp256".into(),
            known_hosts: "/t/kh".into(),
            line: 3,
        }
        .to_string();
        assert!(e.contains("showed an ssh-ed25519 key"), "{e}");
        assert!(e.contains("lists only an ecdsa-sha2-nistp256 key"), "{e}");
    }

    /// A plan of one hop to 127.0.0.1:`port`.
    fn loopback_plan(port: u16) -> SshPlan {
        SshPlan {
            hops: vec![Hop {
                label: format!("127.0.0.1:{port}"),
                host: "127.0.0.1".into(),
                port,
                user: "nobody".into(),
                identity_files: Vec::new(),
                password: None,
                gssapi: None,
            }],
            known_hosts: PathBuf::from("/nonexistent/kvpn-test-known_hosts"),
            accept_new: false,
            keepalive_ms: None,
            default_ccache: None,
        }
    }

    /// `kvpn ssh` to a port where no sshd listens (a service that answers
    /// with something else and closes): the error asks whether the address is
    /// an SSH server (on main: only "SSH handshake failed: Disconnected").
    #[tokio::test]
    async fn a_peer_closing_before_the_key_exchange_is_asked_about() {
        for answer in [&b""[..], b"HTTP/1.1 400 Bad Request\r\n\r\n"] {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind 127.0.0.1:0");
            let port = listener.local_addr().expect("local address").port();
            let server = tokio::spawn(async move {
                use tokio::io::AsyncWriteExt as _;
                let (mut s, _) = listener.accept().await.expect("accept");
                let _ = s.write_all(answer).await;
            });
            let e = match connect(&loopback_plan(port), None).await {
                Ok(_) => panic!("a non-SSH peer logged in"),
                Err(e) => e.to_string(),
            };
            server.await.expect("server task");
            assert!(e.contains("SSH handshake failed"), "{e}");
            assert!(
                e.contains("is this address an SSH server (sshd)? check the host and port"),
                "{answer:?}: {e}"
            );
        }
    }

    /// Errors after the server showed its host key, or of other kinds, keep
    /// their own words without the "is this sshd" question.
    #[test]
    fn handshake_errors_after_the_host_key_get_no_sshd_question() {
        let asked = "is this address an SSH server";
        for e in [
            russh::Error::Disconnect,
            russh::Error::Version,
            russh::Error::IO(std::io::ErrorKind::UnexpectedEof.into()),
            russh::Error::IO(std::io::ErrorKind::ConnectionReset.into()),
        ] {
            assert!(
                handshake_error("h", &e, false).to_string().contains(asked),
                "{e}"
            );
            assert!(
                !handshake_error("h", &e, true).to_string().contains(asked),
                "{e}"
            );
        }
        let other = handshake_error("h", &russh::Error::Kex, false).to_string();
        assert!(!other.contains(asked), "{other}");
        assert!(
            other.contains("SSH host h: SSH handshake failed: Key exchange failed"),
            "{other}"
        );
    }
}
