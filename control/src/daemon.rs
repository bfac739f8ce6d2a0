//! Client side of the root daemon (`kvpn-dataplane`): its gRPC API over a Unix
//! socket, and starting it on demand.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use kvpn_proto::dataplane::dataplane_client::DataplaneClient;

use crate::daemon_channel::{self, Daemon, DaemonChannel};

/// How long to wait for a freshly started root daemon to answer on its socket.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// `$runtime_dir/dataplane.sock`.
pub fn socket_path(runtime_dir: &Path) -> PathBuf {
    runtime_dir.join("dataplane.sock")
}

/// `$runtime_dir/dataplane.pid`: the root daemon's pid.
pub fn pid_path(runtime_dir: &Path) -> PathBuf {
    runtime_dir.join("dataplane.pid")
}

/// A channel to the root daemon on `socket` in `runtime_dir`
/// ([`crate::daemon_channel`]: calls fail, naming it, when it stops answering).
async fn channel(runtime_dir: &Path) -> std::io::Result<DaemonChannel> {
    daemon_channel::open(Daemon::new(
        daemon_channel::Kind::Root,
        &socket_path(runtime_dir),
        &pid_path(runtime_dir),
    ))
    .await
}

/// The root daemon's sessions (`Status`), with `what` saying why we asked, for
/// the error.
pub async fn sessions(
    client: &mut DataplaneClient<DaemonChannel>,
    what: &'static str,
) -> Result<Vec<kvpn_proto::dataplane::Session>> {
    Ok(client
        .status(kvpn_proto::dataplane::StatusRequest {})
        .await
        .map_err(status_to_error)
        .context(what)?
        .into_inner()
        .sessions)
}

/// Why the root daemon running for `runtime_dir` refuses this uid (its own
/// words: the uid it runs for, this uid and the fix), or `None` when none runs,
/// it accepts this uid, or it does not answer. Asks it for Status: a daemon
/// that answers PERMISSION_DENIED refuses every call of this uid.
pub async fn refusal(runtime_dir: &Path) -> Option<String> {
    if nix_uid() == 0 {
        // Root is always accepted.
        return None;
    }
    let mut client = match connect_existing(runtime_dir).await {
        Ok(Some(c)) => c,
        Ok(None) => return None,
        Err(e) => {
            // A socket only root may open (the daemon accepts no other uid).
            let text = format!("{e:#}");
            return text.contains("permission denied").then_some(text);
        }
    };
    match client.status(kvpn_proto::dataplane::StatusRequest {}).await {
        Err(s) if s.code() == tonic::Code::PermissionDenied => Some(s.message().to_owned()),
        _ => None,
    }
}

/// A client for a root daemon that is already running, or `None` when none answers.
pub async fn connect_existing(
    runtime_dir: &Path,
) -> Result<Option<DataplaneClient<DaemonChannel>>> {
    let socket = socket_path(runtime_dir);
    match channel(runtime_dir).await {
        Ok(ch) => Ok(Some(DataplaneClient::new(ch))),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) =>
        {
            Ok(None)
        }
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => Err(anyhow!(
            "cannot talk to the root daemon at {}: permission denied (uid {}) — the socket \
             admits only root and the uid the daemon was started for; run kvpn with sudo, \
             or restart the root daemon with `kvpn-dataplane --allow-uid {}`",
            socket.display(),
            nix_uid(),
            nix_uid()
        )),
        Err(e) => Err(anyhow!(e).context(format!(
            "cannot talk to the root daemon at {}",
            socket.display()
        ))),
    }
}

/// A client for the root daemon, starting `kvpn-dataplane` first if none answers.
/// As root it is started directly; a normal user's kvpn starts it through
/// `sudo -n` or `pkexec` ([`start_elevated`]), allowing that user's uid on its
/// socket, and fails at once with what it tried and the fixes when neither works.
pub async fn connect_or_start(runtime_dir: &Path) -> Result<DataplaneClient<DaemonChannel>> {
    if let Some(c) = connect_existing(runtime_dir).await? {
        return Ok(c);
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return start_elevated(runtime_dir).await;
    }
    start(runtime_dir)?;
    let socket = socket_path(runtime_dir);
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Some(c) = connect_existing(runtime_dir).await? {
            return Ok(c);
        }
        if Instant::now() > deadline {
            bail!(
                "started kvpn-dataplane but it did not answer on {} within {}s — see its log {}",
                socket.display(),
                START_TIMEOUT.as_secs(),
                runtime_dir.join("dataplane.log").display()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// [`connect_or_start`], telling the user which of the two it did: a running
/// root daemon is used ("Using root daemon"), only a missing one is started.
pub async fn connect_or_start_announced(
    runtime_dir: &Path,
) -> Result<DataplaneClient<DaemonChannel>> {
    let running = connect_existing(runtime_dir).await?;
    crate::output::step(&root_daemon_step(
        running.is_some(),
        &socket_path(runtime_dir),
    ));
    match running {
        Some(c) => Ok(c),
        None => connect_or_start(runtime_dir).await,
    }
}

/// The progress line of [`connect_or_start_announced`].
fn root_daemon_step(running: bool, socket: &Path) -> String {
    if running {
        format!(
            "Using the running root daemon (socket {})",
            socket.display()
        )
    } else {
        format!("Starting root daemon (socket {})", socket.display())
    }
}

/// The programs a normal user's kvpn tries, in order, to run the root daemon
/// as root. `sudo -n` never prompts (a rule with NOPASSWD, or a cached
/// password of this session's terminal); pkexec asks polkit, which may ask the
/// user through the desktop's authentication agent.
const ELEVATORS: [Elevator; 2] = [Elevator::Sudo, Elevator::Pkexec];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Elevator {
    Sudo,
    Pkexec,
}

impl Elevator {
    fn program(self) -> &'static str {
        match self {
            Elevator::Sudo => "sudo",
            Elevator::Pkexec => "pkexec",
        }
    }

    /// `program args… bin rest…`.
    fn command(self, program: &Path, bin: &Path, rest: &[std::ffi::OsString]) -> Command {
        let mut cmd = Command::new(program);
        if self == Elevator::Sudo {
            // Non-interactive: fail instead of prompting on a terminal this
            // detached process does not have.
            cmd.args(["-n", "--"]);
        }
        cmd.arg(bin).args(rest);
        cmd
    }
}

/// `name` in `$PATH`: the first executable program, as a shell finds it.
fn find_program(name: &str) -> Option<PathBuf> {
    kvpn_exec::find_program(name, std::env::var_os("PATH").as_deref()).ok()
}

/// The `kvpn-dataplane` binary as an absolute path: sudo rules and pkexec
/// name programs by absolute path.
fn absolute_dataplane_binary() -> PathBuf {
    let bin = dataplane_binary();
    if bin.is_absolute() {
        return bin;
    }
    if bin.components().count() == 1
        && let Some(found) = bin.to_str().and_then(find_program)
    {
        return found;
    }
    std::path::absolute(&bin).unwrap_or(bin)
}

/// This process's real uid and, when it has one, its user name.
fn who() -> (u32, String) {
    let uid = nix_uid();
    let name = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
        .ok()
        .flatten()
        .map_or_else(|| format!("#{uid}"), |u| u.name);
    (uid, name)
}

/// The root daemon started for this normal user through [`ELEVATORS`]: the
/// first one whose daemon answers on the socket wins. Each attempt's failure
/// (not installed, refused, the daemon exited) is kept for the error.
async fn start_elevated(runtime_dir: &Path) -> Result<DataplaneClient<DaemonChannel>> {
    let (uid, user) = who();
    let bin = absolute_dataplane_binary();
    let dir = std::path::absolute(runtime_dir).unwrap_or_else(|_| runtime_dir.to_path_buf());
    let rest: Vec<std::ffi::OsString> = vec![
        "--runtime-dir".into(),
        dir.clone().into(),
        "--allow-uid".into(),
        uid.to_string().into(),
        "--log-to-runtime-dir".into(),
    ];
    let mut tried = Vec::new();
    for elevator in ELEVATORS {
        let Some(program) = find_program(elevator.program()) else {
            tried.push(format!(
                "{}: not installed (not on PATH)",
                elevator.program()
            ));
            continue;
        };
        let mut cmd = elevator.command(&program, &bin, &rest);
        let shown = format!("`{} {}`", elevator.program(), show_args(&cmd));
        match run_detached(&mut cmd, runtime_dir).await {
            Ok(client) => {
                crate::output::done(&format!(
                    "Started the root daemon as root through {} (it accepts uid {uid})",
                    elevator.program()
                ));
                return Ok(client);
            }
            Err(why) => tried.push(format!("{shown}: {why}")),
        }
    }
    bail!(
        "cannot start the root daemon kvpn-dataplane for uid {uid} ({user}): none answers on \
         {socket}, and it must run as root (it creates the TUN device, routes and eBPF \
         programs).\nTried:\n  - {tried}\nFix, one of:\n  - start it once as root for \
         this user: `sudo {bin} --runtime-dir {dir} --allow-uid {uid}`\n  - let {user} start \
         it without a password: a sudoers rule `{user} ALL=(root) NOPASSWD: {bin}` (in a file \
         under /etc/sudoers.d/)\n  - or use `kvpn connect --socks`, which needs no root \
         daemon",
        socket = socket_path(&dir).display(),
        tried = tried.join("\n  - "),
        bin = bin.display(),
        dir = dir.display(),
    )
}

/// The arguments of `cmd`, as a shell would show them.
fn show_args(cmd: &Command) -> String {
    cmd.get_args()
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs `cmd` (sudo or pkexec starting the root daemon) in a session of its
/// own, so the daemon outlives this CLI and its terminal, and waits until the
/// daemon answers on its socket. Errors: the spawn failed, or the command
/// exited first (sudo refused, the daemon failed), with its stderr; or no
/// answer within [`START_TIMEOUT`].
async fn run_detached(
    cmd: &mut Command,
    runtime_dir: &Path,
) -> std::result::Result<DataplaneClient<DaemonChannel>, String> {
    use std::io::{Read as _, Seek as _};
    use std::os::unix::process::CommandExt as _;
    // Its stderr goes to a file unlinked at once: read back if it fails,
    // nothing left behind either way (the daemon itself logs to its runtime folder).
    let err_path = std::env::temp_dir().join(format!(
        "kvpn-start-{}-{}.err",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .subsec_nanos()
    ));
    let mut err = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&err_path)
        .map_err(|e| format!("cannot create {}: {e}", err_path.display()))?;
    let _ = std::fs::remove_file(&err_path);
    let err_child = err
        .try_clone()
        .map_err(|e| format!("cannot duplicate a file handle: {e}"))?;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(err_child);
    // SAFETY: setsid is async-signal-safe and touches no memory of this process.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|e| format!("cannot run it: {e}"))?;
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        match connect_existing(runtime_dir).await {
            Ok(Some(c)) => return Ok(c),
            Ok(None) => {}
            Err(e) => return Err(format!("{e:#}")),
        }
        if let Ok(Some(status)) = child.try_wait() {
            // A daemon started at the same moment by someone else won the
            // socket: use it.
            if let Ok(Some(c)) = connect_existing(runtime_dir).await {
                return Ok(c);
            }
            let mut text = String::new();
            let _ = err.seek(std::io::SeekFrom::Start(0));
            let _ = err.read_to_string(&mut text);
            let text = text.trim();
            let log = runtime_dir.join("dataplane.log");
            // sudo asks for a password before it says whether any rule allows
            // the command at all: say what it means here.
            let hint = if text.contains("a password is required") {
                " (no sudo rule lets this user run it without a password)"
            } else {
                ""
            };
            return Err(if text.is_empty() {
                format!(
                    "exited ({status}) without a word — see the end of {}",
                    log.display()
                )
            } else {
                format!("exited ({status}): {}{hint}", text.replace('\n', " / "))
            });
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the daemon did not answer on {} within {} s — see {}",
                socket_path(runtime_dir).display(),
                START_TIMEOUT.as_secs(),
                runtime_dir.join("dataplane.log").display()
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Path of the `kvpn-dataplane` binary: next to this executable, else `$PATH`.
pub fn dataplane_binary() -> PathBuf {
    if let Ok(dir) = std::env::var("KVPN_BIN_DIR") {
        return PathBuf::from(dir).join("kvpn-dataplane");
    }
    if let Some(p) = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join("kvpn-dataplane")))
        .filter(|p| p.exists())
    {
        return p;
    }
    PathBuf::from("kvpn-dataplane")
}

fn start(runtime_dir: &Path) -> Result<()> {
    std::fs::create_dir_all(runtime_dir)
        .with_context(|| format!("cannot create the runtime folder {}", runtime_dir.display()))?;
    let log_path = runtime_dir.join("dataplane.log");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("cannot open {}", log_path.display()))?;
    let log2 = log
        .try_clone()
        .context("cannot duplicate the log file handle")?;
    let bin = dataplane_binary();
    let mut cmd = std::process::Command::new(&bin);
    cmd.arg("--runtime-dir")
        .arg(runtime_dir)
        .stdin(std::process::Stdio::null())
        .stdout(log)
        .stderr(log2);
    // Detach from the CLI's session so the daemon outlives it and its terminal.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    cmd.spawn().with_context(|| {
        format!(
            "cannot start the root daemon {} — build it (cargo build) or put it on PATH",
            bin.display()
        )
    })?;
    Ok(())
}

/// What [`stop_quietly`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// No root daemon answered, or it had no pid file.
    NotRunning,
    /// Its pid file named a process that was gone.
    WasNotRunning(i32),
    /// It stopped.
    Stopped(i32),
}

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stopped::NotRunning => write!(f, "The root daemon is not running"),
            Stopped::WasNotRunning(pid) => {
                write!(f, "The root daemon (pid {pid}) was not running")
            }
            Stopped::Stopped(pid) => write!(f, "Stopped the root daemon (pid {pid})"),
        }
    }
}

/// Stop the root daemon (SIGTERM to the pid in its pid file; a normal user,
/// who may not signal root's processes, asks it over its socket with Shutdown)
/// and wait for the process to go, saying what happened.
pub async fn stop(runtime_dir: &Path) -> Result<()> {
    let stopped = stop_quietly(runtime_dir).await?;
    crate::output::done(&stopped.to_string());
    Ok(())
}

/// [`stop`] without a word: what happened is the answer.
pub async fn stop_quietly(runtime_dir: &Path) -> Result<Stopped> {
    if nix_uid() != 0 {
        let Some(mut client) = connect_existing(runtime_dir).await? else {
            return Ok(Stopped::NotRunning);
        };
        let pid = client
            .shutdown(kvpn_proto::dataplane::ShutdownRequest {})
            .await
            .map_err(status_to_error)
            .context("the root daemon refused to stop")?
            .into_inner()
            .pid;
        let pid = i32::try_from(pid).context("the root daemon sent an invalid pid")?;
        wait_gone(pid, runtime_dir).await?;
        return Ok(Stopped::Stopped(pid));
    }
    let pid_file = pid_path(runtime_dir);
    let pid = match std::fs::read_to_string(&pid_file) {
        Ok(s) => s
            .trim()
            .parse::<i32>()
            .with_context(|| format!("bad pid file {}", pid_file.display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Stopped::NotRunning),
        Err(e) => return Err(anyhow!(e).context(format!("cannot read {}", pid_file.display()))),
    };
    // SAFETY: kill(2) with a pid and a signal number has no memory preconditions.
    let sent = unsafe { libc::kill(pid, libc::SIGTERM) } == 0;
    if !sent || !process_alive(pid) {
        let _ = std::fs::remove_file(&pid_file);
        return Ok(Stopped::WasNotRunning(pid));
    }
    wait_gone(pid, runtime_dir).await?;
    Ok(Stopped::Stopped(pid))
}

/// Wait for the root daemon `pid` itself to go: its socket may still exist
/// (refusing connections) while it tears sessions down.
async fn wait_gone(pid: i32, runtime_dir: &Path) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while process_alive(pid) {
        if Instant::now() > deadline {
            bail!(
                "the root daemon (pid {pid}) did not stop within 10 s — see {}",
                runtime_dir.join("dataplane.log").display()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// What a killed root daemon leaves that matters to the user: the backup of the
/// resolv.conf it changed (named like the daemon's `BACKUP_NAME`).
const DNS_BACKUP: &str = "resolv.conf.kvpn-backup";

/// Whether a root daemon of `runtime_dir` died with the laptop's DNS still
/// pointing at its forwarder.
pub fn dns_left_changed(runtime_dir: &Path) -> bool {
    runtime_dir.join(DNS_BACKUP).exists()
}

/// What `kvpn-dataplane --repair` undid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repaired {
    /// resolv.conf pointed at the dead daemon's DNS forwarder (now restored).
    pub dns: bool,
    /// Laptop TCP connections on the dead sessions' tunnel IPs, reset.
    pub tcp_reset: u64,
}

/// With no root daemon answering: undo what a killed one left (resolv.conf from
/// its backup, kvpn's routes, TCP connections still on its tunnel IPs) by
/// running `kvpn-dataplane --repair`. `None` when there was nothing to undo.
pub fn repair_leftovers(runtime_dir: &Path) -> Result<Option<Repaired>> {
    let dns = dns_left_changed(runtime_dir);
    if !dns
        && !runtime_dir
            .join(kvpn_dataplane::sweep::RECORD_NAME)
            .exists()
    {
        return Ok(None);
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let bin = if root {
        dataplane_binary()
    } else {
        absolute_dataplane_binary()
    };
    let mut cmd = match (root, find_program("sudo")) {
        (true, _) => Command::new(&bin),
        // The same rule that lets this user start the daemon lets it repair.
        (false, Some(sudo)) => Elevator::Sudo.command(&sudo, &bin, &[]),
        (false, None) => bail!(
            "the root daemon died and left this machine's resolv.conf pointing at its DNS \
             forwarder; restoring it needs root and sudo is not installed — run \
             `{} --runtime-dir {} --repair` as root",
            bin.display(),
            runtime_dir.display()
        ),
    };
    let out = cmd
        .arg("--runtime-dir")
        .arg(std::path::absolute(runtime_dir).unwrap_or_else(|_| runtime_dir.to_path_buf()))
        .arg("--repair")
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run {} --repair", bin.display()))?;
    if !root && !out.status.success() {
        bail!(
            "the root daemon died and left this machine's resolv.conf pointing at its DNS \
             forwarder; restoring it needs root and `sudo -n {} --repair` failed: {} — run \
             `sudo kvpn quit`",
            bin.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    if !out.status.success() {
        bail!(
            "{} --repair failed: {}",
            bin.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    // Its one stdout line: `tcp_reset N`.
    let tcp_reset = String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("tcp_reset ")?.trim().parse().ok())
        .unwrap_or(0);
    Ok(Some(Repaired { dns, tcp_reset }))
}

/// Whether `pid` still runs (a zombie counts as gone: it runs no code).
pub(crate) fn process_alive(pid: i32) -> bool {
    crate::liveness::proc_stat(pid).is_some_and(|s| !s.dead())
}

/// This process's real uid.
fn nix_uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

/// Turn a gRPC status into an error whose text is the daemon's own message
/// (PERMISSION_DENIED from the peer credential check names the uid and the fix).
pub fn status_to_error(s: tonic::Status) -> anyhow::Error {
    anyhow!("{}", s.message())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_running_root_daemon_is_used_not_started() {
        let socket = Path::new("/run/kvpn/dataplane.sock");
        assert_eq!(
            root_daemon_step(true, socket),
            "Using the running root daemon (socket /run/kvpn/dataplane.sock)"
        );
        assert!(root_daemon_step(false, socket).starts_with("Starting root daemon"));
    }
}
