//! `kvpn ssh`: an interactive shell (or one command) on an SSH host, reached with
//! the same SSH options, ProxyJump chains and known_hosts rules as the jump hosts of
//! `kvpn connect` (the last hop of the chain is the host the shell runs on).
//!
//! Full mode (the default) also joins the laptop and the SSH host with a
//! point-to-point tunnel from 198.19.0.0/16 ([`super::peer`]): the peer agent
//! (`kvpn ssh-peer`) runs on the SSH host through an `exec` channel of the same SSH
//! connection (the host needs kvpn — `--remote-kvpn PATH`, default `kvpn` on its
//! PATH, or `--upload-kvpn` copies this one there — and the login must be root,
//! since it creates a TUN device), and a second one runs on the laptop as a root child process (through `sudo` when `kvpn` is
//! not root). This process only splices the two frame streams; both TUN devices
//! disappear when their agent exits, which happens when the session ends however
//! it ends (the agents exit at EOF on stdin). `--lite` gives only the terminal.
//!
//! The laptop's root daemon is not used: its API creates manager sessions (TLS,
//! cluster routes, eBPF classifier), none of which a two-host tunnel needs, and a
//! child agent that dies with the session leaves nothing behind.
//!
//! I/O: the SSH connection ([`super::client`]), the local peer agent's pipes, the
//! terminal ([`super::terminal`]).

use std::collections::{BTreeSet, VecDeque};
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, anyhow, bail};
use clap::Args;
use kvpn_proto::frame::{self, Kind};
use russh::ChannelMsg;
use russh::client::Msg;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::process::{Child, ChildStdin};
use tracing::{debug, info, warn};

use super::client::{self, SshChain};
use super::peer::{self, DEFAULT_MTU};
use super::terminal::{self, Ending, RawMode, Request};
use super::{SshArgs, SshPlan};
use crate::kubeconfig::UserEnv;

/// How long a peer agent may take to bring its TUN device up and say hello.
const PEER_START_TIMEOUT: Duration = Duration::from_secs(15);
/// How long the session end waits for each peer agent to exit after its stdin
/// closed (it exits at once; the bound covers a stuck host).
const PEER_STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// Address pairs tried when the SSH host already has the first free one (another
/// laptop's session).
const PAIR_ATTEMPTS: u32 = 16;

/// `kvpn ssh` flags.
#[derive(Debug, Args)]
pub struct SshCommandArgs {
    /// Only the terminal: no tunnel between this machine and the SSH host.
    #[arg(long)]
    pub lite: bool,
    /// The kvpn binary on the SSH host, for the tunnel's peer agent (full mode):
    /// a path, or a name looked up on the remote PATH.
    #[arg(long, value_name = "PATH", default_value = "kvpn")]
    pub remote_kvpn: String,
    /// Copy this kvpn binary to the SSH host for the peer agent (into
    /// `${XDG_CACHE_HOME:-~/.cache}/kvpn/` there, named by its SHA-256, so only
    /// the first session of a build copies it) instead of using --remote-kvpn.
    #[arg(long, conflicts_with = "remote_kvpn")]
    pub upload_kvpn: bool,
    /// This machine's tunnel IP (default: the first free pair of 198.19.0.0/16,
    /// .1 here and .2 there in the first /30).
    #[arg(long, value_name = "IP", requires = "remote_tunnel_ip")]
    pub tunnel_ip: Option<Ipv4Addr>,
    /// The SSH host's tunnel IP (with --tunnel-ip).
    #[arg(long, value_name = "IP", requires = "tunnel_ip")]
    pub remote_tunnel_ip: Option<Ipv4Addr>,
    /// MTU in bytes of both TUN devices (1280 to 65534).
    #[arg(long, default_value_t = DEFAULT_MTU, value_parser = crate::cli::parse_tun_mtu)]
    pub mtu: u16,
    /// Ask for a remote pty even for a command or without a local terminal.
    #[arg(short = 't', conflicts_with = "no_tty")]
    pub tty: bool,
    /// Never ask for a remote pty.
    #[arg(short = 'T')]
    pub no_tty: bool,
    /// The command to run instead of a login shell (after `--`; joined with spaces
    /// and run by the remote user's shell, as ssh does).
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<String>,
    /// The SSH host: its --ssh-* flags (the last hop of the chain is the host the
    /// shell runs on).
    #[command(flatten, next_help_heading = "SSH host")]
    pub ssh: SshArgs,
}

/// Runs `kvpn ssh`; returns the exit code (the remote command's).
pub async fn run(args: SshCommandArgs) -> Result<i32> {
    let env = UserEnv::current().context("cannot read this process's environment")?;
    if !args.ssh.hop.is_set() {
        bail!("kvpn ssh needs the host: --ssh-addr HOST[:PORT] or --ssh-alias NAME");
    }
    let plan = super::plan_for(&args.ssh, &env)?
        .ok_or_else(|| anyhow!("kvpn ssh needs --ssh-addr or --ssh-alias"))?;
    let agent_sock = env.var("SSH_AUTH_SOCK").map(PathBuf::from);
    let chain = client::connect(&plan, agent_sock.as_deref())
        .await
        .with_context(|| format!("cannot log in to {}", plan.describe()))?;

    let tunnel = if args.lite {
        None
    } else {
        match Tunnel::start(&chain, &plan, &args, &env).await {
            Ok(t) => Some(t),
            Err(e) => {
                chain.close().await;
                return Err(e);
            }
        }
    };

    let result = shell(&chain, &args).await;
    if let Some(t) = tunnel {
        t.stop().await;
    }
    chain.close().await;
    let ending = result?;
    match &ending {
        Ending::Local(n) => eprintln!("kvpn ssh: stopped by signal {n}; the session is closed"),
        Ending::NoStatus => {
            warn!(host = %chain.last_hop, "the session closed without an exit status")
        }
        Ending::Signal { name, .. } => debug!(signal = %name, "the remote command was killed"),
        Ending::Status(_) => {}
    }
    Ok(ending.exit_code())
}

/// The shell or command on the last hop, relayed until it ends.
async fn shell(chain: &SshChain, args: &SshCommandArgs) -> Result<Ending> {
    let channel = chain.open_session().await?;
    let command = args.command.join(" ");
    let local_tty = terminal::stdin_is_tty();
    let pty = !args.no_tty && (args.tty || (command.is_empty() && local_tty));
    if command.is_empty() && !local_tty && !args.tty && !args.no_tty {
        eprintln!("kvpn ssh: no remote pty: stdin is not a terminal (-t asks for one anyway)");
    }
    let mut pending = VecDeque::new();
    if pty {
        let term = std::env::var("TERM").unwrap_or_else(|_| "xterm-256color".into());
        let (cols, rows, width, height) = terminal::window_size();
        channel
            .request_pty(true, &term, cols, rows, width, height, &[])
            .await
            .context("cannot ask for a remote pty")?;
        pending.push_back(Request::Pty);
    }
    if command.is_empty() {
        channel
            .request_shell(true)
            .await
            .context("cannot ask for a shell")?;
    } else {
        channel
            .exec(true, command)
            .await
            .context("cannot ask to run the command")?;
    }
    pending.push_back(Request::Start);
    // Raw mode only with a remote pty: it echoes and edits lines itself.
    let raw = if pty && local_tty {
        RawMode::enter()
    } else {
        None
    };
    let ending = terminal::relay(channel, pty, pending).await;
    drop(raw);
    ending.with_context(|| format!("session on {}", chain.last_hop))
}

/// The running tunnel of a full-mode session.
struct Tunnel {
    local: Child,
    remote_tx: Arc<russh::ChannelWriteHalf<Msg>>,
    /// Remote → laptop; ends when the remote agent's channel closes.
    inbound: tokio::task::JoinHandle<()>,
    /// Laptop → remote.
    outbound: tokio::task::JoinHandle<()>,
}

/// A peer agent that said hello: its TUN device name and tunnel IP.
#[derive(Debug)]
struct Hello {
    tun: String,
    ip: IpAddr,
}

impl Tunnel {
    async fn start(
        chain: &SshChain,
        plan: &SshPlan,
        args: &SshCommandArgs,
        env: &UserEnv,
    ) -> Result<Tunnel> {
        let host = chain.last_hop.clone();
        let remote_kvpn = if args.upload_kvpn {
            upload_kvpn(chain).await?
        } else {
            args.remote_kvpn.clone()
        };
        let explicit = args.tunnel_ip.zip(args.remote_tunnel_ip);
        let used: BTreeSet<Ipv4Addr> = peer::local_ipv4s();
        let mut next = 0;
        let (laptop_ip, remote_ip, remote_channel, remote_hello, leftover) = loop {
            let (n, laptop_ip, remote_ip) = match explicit {
                Some((l, r)) => (0, l, r),
                None => peer::first_free_pair(next, &used).ok_or_else(|| {
                    anyhow!("no free address pair left in {}", peer::TUNNEL_RANGE)
                })?,
            };
            if explicit.is_some() && used.contains(&laptop_ip) {
                bail!(
                    "--tunnel-ip {laptop_ip} is already on an interface of this machine — pick another"
                );
            }
            match start_remote(chain, &remote_kvpn, remote_ip, laptop_ip, args.mtu).await {
                Ok((ch, hello, leftover)) => break (laptop_ip, remote_ip, ch, hello, leftover),
                Err(PeerFailure {
                    code: Some(peer::EXIT_ADDRESS_IN_USE),
                    ..
                }) if explicit.is_none() && n + 1 < PAIR_ATTEMPTS => {
                    debug!(%remote_ip, "tunnel IP taken on the SSH host; next pair");
                    next = n + 1;
                }
                Err(f) => return Err(f.into_error(&host, &remote_kvpn)),
            }
        };
        let (mut remote_rx, remote_tx) = remote_channel.split();
        let remote_tx = Arc::new(remote_tx);

        let mut local = match start_local(laptop_ip, remote_ip, args.mtu, env).await {
            Ok(c) => c,
            Err(e) => {
                let _ = remote_tx.eof().await;
                let _ = remote_tx.close().await;
                return Err(e);
            }
        };
        let local_hello = match read_hello(local.stdout.as_mut()).await {
            Ok(h) => h,
            Err(why) => {
                let _ = remote_tx.eof().await;
                let _ = remote_tx.close().await;
                let _ = local.start_kill();
                let status = tokio::time::timeout(PEER_STOP_TIMEOUT, local.wait()).await;
                let mut stderr = String::new();
                if let Some(mut e) = local.stderr.take() {
                    let _ = e.read_to_string(&mut stderr).await;
                }
                bail!(
                    "the laptop side of the tunnel did not start ({why}, {}): {} — full mode needs root here \
                     (run kvpn as root or with sudo rights), or use --lite",
                    match status {
                        Ok(Ok(s)) => s.to_string(),
                        _ => "still running".into(),
                    },
                    stderr.trim()
                );
            }
        };
        let local_stdin = local
            .stdin
            .take()
            .ok_or_else(|| anyhow!("the laptop peer agent has no stdin"))?;
        let local_stdout = local
            .stdout
            .take()
            .ok_or_else(|| anyhow!("the laptop peer agent has no stdout"))?;
        if let Some(mut e) = local.stderr.take() {
            // The local agent's later messages, into our log.
            tokio::spawn(async move {
                let mut s = String::new();
                let _ = e.read_to_string(&mut s).await;
                for line in s.lines() {
                    warn!("laptop peer agent: {line}");
                }
            });
        }

        let inbound = tokio::spawn(async move {
            let mut stdin: ChildStdin = local_stdin;
            if !leftover.is_empty() && stdin.write_all(&leftover).await.is_err() {
                return;
            }
            while let Some(msg) = remote_rx.wait().await {
                match msg {
                    ChannelMsg::Data { data } => {
                        if let Err(e) = stdin.write_all(&data).await {
                            if !peer::is_closed(&e) {
                                warn!("tunnel: write to the laptop peer agent: {e}");
                            }
                            return;
                        }
                    }
                    ChannelMsg::ExtendedData { data, .. } => {
                        for line in String::from_utf8_lossy(&data).lines() {
                            warn!("remote peer agent: {line}");
                        }
                    }
                    ChannelMsg::ExitStatus { exit_status } => {
                        debug!(exit_status, "remote peer agent exited");
                    }
                    ChannelMsg::Close => break,
                    _ => {}
                }
            }
            // Dropping stdin stops the laptop agent, which removes its TUN.
        });
        let tx = remote_tx.clone();
        let outbound = tokio::spawn(async move {
            let mut stdout = local_stdout;
            let mut buf = vec![0u8; 256 * 1024];
            loop {
                match stdout.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if tx.data(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                }
            }
            let _ = tx.eof().await;
        });
        let msg = format!(
            "tunnel up: this machine {laptop_ip} ({}) <-> {} {} ({} there)",
            local_hello.tun,
            plan.hops.last().map_or(host.as_str(), |h| h.host.as_str()),
            remote_hello.ip,
            remote_hello.tun
        );
        info!("{msg}");
        eprintln!("kvpn ssh: {msg}");
        debug_assert_eq!(local_hello.ip, IpAddr::V4(laptop_ip));
        Ok(Tunnel {
            local,
            remote_tx,
            inbound,
            outbound,
        })
    }

    /// Closes the tunnel: EOF to the remote agent (it exits and its TUN goes), then
    /// the laptop agent's stdin (likewise), waiting a bounded time for both.
    async fn stop(mut self) {
        let _ = self.remote_tx.eof().await;
        // The inbound task ends when the remote agent's channel closes, and then
        // drops the laptop agent's stdin.
        if tokio::time::timeout(PEER_STOP_TIMEOUT, &mut self.inbound)
            .await
            .is_err()
        {
            warn!(
                "the remote peer agent did not exit within {} s",
                PEER_STOP_TIMEOUT.as_secs()
            );
            self.inbound.abort();
        }
        let _ = self.remote_tx.close().await;
        match tokio::time::timeout(PEER_STOP_TIMEOUT, self.local.wait()).await {
            Ok(_) => {}
            Err(_) => {
                warn!("the laptop peer agent did not exit; killing it");
                let _ = self.local.kill().await;
            }
        }
        self.outbound.abort();
    }
}

/// Why a peer agent did not come up.
struct PeerFailure {
    code: Option<i32>,
    stderr: String,
    why: String,
}

impl PeerFailure {
    fn into_error(self, host: &str, remote_kvpn: &str) -> anyhow::Error {
        let fix = match self.code {
            Some(peer::EXIT_NOT_PERMITTED) => format!(
                "full mode creates a TUN device on {host}, which needs root there: log in as root \
                 (--ssh-username root), or use --lite for only the terminal"
            ),
            Some(127) | Some(126) => format!(
                "install kvpn on {host} (on its PATH) or pass --remote-kvpn PATH, or copy this one there \
                 with --upload-kvpn, or use --lite for only the terminal"
            ),
            _ => "use --lite for only the terminal".into(),
        };
        // The agent's own message when it left one, else what was seen.
        let what = match (self.stderr.trim(), self.code) {
            ("", Some(_)) => peer::describe_exit(self.code).to_owned(),
            ("", None) => self.why,
            (said, _) => said.to_owned(),
        };
        let code = self
            .code
            .map(|c| format!(" (exit {c})"))
            .unwrap_or_default();
        anyhow!(
            "the tunnel's peer agent ({remote_kvpn} ssh-peer) did not start on {host}{code}: {what} — {fix}"
        )
    }
}

/// The remote folder `--upload-kvpn` copies kvpn into (a shell expression).
const UPLOAD_DIR: &str = "\"${XDG_CACHE_HOME:-$HOME/.cache}/kvpn\"";

/// Copies this kvpn binary to the SSH host unless a copy of the same build is
/// there already; returns its path there.
async fn upload_kvpn(chain: &SshChain) -> Result<String> {
    use sha2::Digest as _;
    let exe = std::env::current_exe().context("cannot find this kvpn binary to copy")?;
    let bytes = tokio::fs::read(&exe)
        .await
        .with_context(|| format!("cannot read {}", exe.display()))?;
    let digest = sha2::Sha256::digest(&bytes);
    let name = format!(
        "kvpn-{}",
        digest[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    );
    let host = &chain.last_hop;
    let check = format!(
        "f={UPLOAD_DIR}/{name}; if [ -x \"$f\" ]; then echo \"have $f\"; else echo \"none $f\"; fi"
    );
    let (status, out, err) = exec_capture(chain, &check, None).await?;
    let line = out.lines().next().unwrap_or_default().to_owned();
    if let Some(path) = line.strip_prefix("have ") {
        debug!(%path, "kvpn already on the SSH host");
        return Ok(path.to_owned());
    }
    if status != Some(0) || !line.starts_with("none ") {
        bail!(
            "cannot look for kvpn on {host} (exit {status:?}): {}{}",
            out.trim(),
            err.trim()
        );
    }
    eprintln!(
        "kvpn ssh: copying kvpn ({} MB) to {host}…",
        bytes.len() / 1_000_000
    );
    let store = format!(
        "d={UPLOAD_DIR}; mkdir -p \"$d\" && t=\"$d/{name}.$$\" && cat > \"$t\" && chmod 755 \"$t\" \
         && mv -f \"$t\" \"$d/{name}\" && echo \"$d/{name}\""
    );
    let (status, out, err) = exec_capture(chain, &store, Some(bytes)).await?;
    match (status, out.lines().next()) {
        (Some(0), Some(path)) if !path.is_empty() => Ok(path.to_owned()),
        _ => bail!(
            "cannot copy kvpn to {host} (exit {status:?}): {} — check the disk space and \
             permissions of ~/.cache there, or install kvpn there and pass --remote-kvpn",
            err.trim()
        ),
    }
}

/// Runs `command` on the last hop with `input` as its stdin; returns its exit
/// status, stdout and stderr.
async fn exec_capture(
    chain: &SshChain,
    command: &str,
    input: Option<Vec<u8>>,
) -> Result<(Option<u32>, String, String)> {
    let mut channel = chain.open_session().await?;
    channel.exec(true, command).await?;
    if let Some(bytes) = input {
        channel.data(&bytes[..]).await?;
    }
    channel.eof().await?;
    let (mut out, mut err, mut status) = (Vec::new(), Vec::new(), None);
    while let Some(msg) = channel.wait().await {
        match msg {
            ChannelMsg::Data { data } => out.extend_from_slice(&data),
            ChannelMsg::ExtendedData { data, .. } => err.extend_from_slice(&data),
            ChannelMsg::ExitStatus { exit_status } => status = Some(exit_status),
            ChannelMsg::Failure => bail!("the SSH server refused to run a command"),
            ChannelMsg::Close => break,
            _ => {}
        }
    }
    Ok((
        status,
        String::from_utf8_lossy(&out).into_owned(),
        String::from_utf8_lossy(&err).into_owned(),
    ))
}

/// Starts the peer agent on the SSH host and waits for its hello. Returns the
/// channel, the hello and any bytes that came after it.
async fn start_remote(
    chain: &SshChain,
    remote_kvpn: &str,
    remote_ip: Ipv4Addr,
    laptop_ip: Ipv4Addr,
    mtu: u16,
) -> Result<(russh::Channel<Msg>, Hello, Vec<u8>), PeerFailure> {
    let fail = |why: String| PeerFailure {
        code: None,
        stderr: String::new(),
        why,
    };
    let mut channel = chain
        .open_session()
        .await
        .map_err(|e| fail(e.to_string()))?;
    let binary = shlex::try_quote(remote_kvpn).map_err(|_| {
        fail(format!(
            "--remote-kvpn {remote_kvpn:?} cannot be quoted for a shell"
        ))
    })?;
    let command =
        format!("exec {binary} ssh-peer --tunnel-ip {remote_ip} --peer-ip {laptop_ip} --mtu {mtu}");
    debug!(%command, "starting the remote peer agent");
    channel
        .exec(true, command)
        .await
        .map_err(|e| fail(e.to_string()))?;
    let mut buf = Vec::new();
    let mut stderr = Vec::new();
    let mut code = None;
    let waited = tokio::time::timeout(PEER_START_TIMEOUT, async {
        loop {
            match channel.wait().await {
                Some(ChannelMsg::Data { data }) => {
                    buf.extend_from_slice(&data);
                    match parse_hello(&buf) {
                        Ok(Some((hello, used))) => return Ok((hello, buf[used..].to_vec())),
                        Ok(None) => {}
                        Err(e) => return Err(e),
                    }
                }
                Some(ChannelMsg::ExtendedData { data, .. }) => stderr.extend_from_slice(&data),
                Some(ChannelMsg::ExitStatus { exit_status }) => code = Some(exit_status as i32),
                Some(ChannelMsg::Failure) => return Err("the SSH server refused to run it".into()),
                Some(ChannelMsg::Close) | None => return Err("it exited".to_owned()),
                Some(_) => {}
            }
        }
    })
    .await;
    let stderr = String::from_utf8_lossy(&stderr).into_owned();
    match waited {
        Ok(Ok((hello, leftover))) => Ok((channel, hello, leftover)),
        Ok(Err(why)) => Err(PeerFailure { code, stderr, why }),
        Err(_) => Err(PeerFailure {
            code,
            stderr,
            why: format!("no hello within {} s", PEER_START_TIMEOUT.as_secs()),
        }),
    }
}

/// Starts the laptop's peer agent: this binary's `ssh-peer`, as root (through
/// `sudo` when kvpn is not root; it may ask for a password before the shell
/// starts).
async fn start_local(
    laptop_ip: Ipv4Addr,
    remote_ip: Ipv4Addr,
    mtu: u16,
    env: &UserEnv,
) -> Result<Child> {
    let exe = std::env::current_exe()
        .context("cannot find the kvpn binary to run the laptop peer agent")?;
    let mut cmd = if env.euid == 0 {
        tokio::process::Command::new(&exe)
    } else {
        eprintln!("kvpn ssh: the laptop side of the tunnel needs root; starting it with sudo");
        let mut c = tokio::process::Command::new("sudo");
        if !terminal::stdin_is_tty() {
            c.arg("-n");
        }
        c.arg("--").arg(&exe);
        c
    };
    cmd.arg("ssh-peer")
        .arg("--tunnel-ip")
        .arg(laptop_ip.to_string())
        .arg("--peer-ip")
        .arg(remote_ip.to_string())
        .arg("--mtu")
        .arg(mtu.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd.spawn()
        .with_context(|| format!("cannot start the laptop peer agent ({})", exe.display()))
}

/// Reads the first frame (a hello) from a peer agent's stdout.
async fn read_hello<R: AsyncRead + Unpin>(reader: Option<&mut R>) -> Result<Hello, String> {
    let reader = reader.ok_or("no stdout")?;
    let read = async {
        let mut header = [0u8; frame::HEADER_LEN];
        reader
            .read_exact(&mut header)
            .await
            .map_err(|_| "it exited before its TUN device was up".to_owned())?;
        let mut whole = header.to_vec();
        // A header the decoder refuses (length 0) is read no further: the
        // parse below names what the agent wrote instead of a hello.
        let payload_len = frame::Decoder::default()
            .header(&header)
            .map_or(0, |h| h.payload_len);
        whole.resize(frame::HEADER_LEN + payload_len, 0);
        reader
            .read_exact(&mut whole[frame::HEADER_LEN..])
            .await
            .map_err(|_| "it exited in the middle of its hello".to_owned())?;
        match parse_hello(&whole)? {
            Some((h, _)) => Ok(h),
            None => Err("short hello".to_owned()),
        }
    };
    tokio::time::timeout(PEER_START_TIMEOUT, read)
        .await
        .map_err(|_| format!("no hello within {} s", PEER_START_TIMEOUT.as_secs()))?
}

/// A hello frame at the start of `buf`: the hello and the bytes it took, `None`
/// when more bytes are needed.
fn parse_hello(buf: &[u8]) -> Result<Option<(Hello, usize)>, String> {
    // Tell other output (a login banner, an error page) from frames at once.
    if let Some(&kind) = buf.get(2)
        && kind != Kind::Hello.to_u8()
    {
        return Err(format!(
            "it wrote {:?} instead of a hello frame — is the remote binary kvpn?",
            String::from_utf8_lossy(&buf[..buf.len().min(40)]),
        ));
    }
    match frame::Decoder::default().decode(buf) {
        Ok(Some((f, used))) if f.kind == Kind::Hello => {
            let h = frame::Hello::decode(f.payload).map_err(|e| format!("bad hello: {e}"))?;
            if h.version != frame::PROTOCOL_VERSION {
                return Err(format!(
                    "it speaks frame protocol version {} and this kvpn {} — use the same kvpn version on both ends",
                    h.version,
                    frame::PROTOCOL_VERSION
                ));
            }
            Ok(Some((
                Hello {
                    tun: String::from_utf8_lossy(&h.token).into_owned(),
                    ip: h.tunnel_ip,
                },
                used,
            )))
        }
        Ok(Some((f, _))) => Err(format!("it sent a {:?} frame before its hello", f.kind)),
        Ok(None) => Ok(None),
        Err(e) => Err(format!(
            "it sent no frames ({e}) — is the remote binary kvpn?"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hello_is_parsed_across_partial_reads_and_other_output_is_refused() {
        let hello = frame::Hello {
            version: frame::PROTOCOL_VERSION,
            tunnel_ip: IpAddr::V4(Ipv4Addr::new(198, 19, 0, 2)),
            token: b"kvssh0".to_vec(),
            mtu: None,
            tunnel_ip_v6: None,
            offloads: None,
            shard: None,
            resume_token: None,
        };
        let mut wire = Vec::new();
        frame::encode_into(Kind::Hello, &hello.encode().expect("encode"), &mut wire)
            .expect("frame");
        let n = wire.len();
        wire.extend_from_slice(&[0, 5, 1]);
        assert!(matches!(parse_hello(&wire[..2]), Ok(None)));
        assert!(matches!(parse_hello(&wire[..n - 1]), Ok(None)));
        let (h, used) = parse_hello(&wire).expect("ok").expect("complete");
        assert_eq!(used, n);
        assert_eq!(h.tun, "kvssh0");
        assert_eq!(h.ip, hello.tunnel_ip);
        // A shell banner instead of frames.
        assert!(parse_hello(b"Welcome to Debian\n").is_err());
        let mut old = hello.clone();
        old.version = frame::PROTOCOL_VERSION + 1;
        let mut wire = Vec::new();
        frame::encode_into(Kind::Hello, &old.encode().expect("encode"), &mut wire).expect("frame");
        assert!(parse_hello(&wire).expect_err("version").contains("version"));
    }
}
