//! Client side of the root daemon (`kvpn-dataplane`): its gRPC API over a Unix
//! socket, and starting it on demand.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use hyper_util::rt::TokioIo;
use kvpn_proto::dataplane::dataplane_client::DataplaneClient;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint};

/// How long to wait for a freshly started root daemon to answer on its socket.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// `$runtime_dir/dataplane.sock`.
pub fn socket_path(runtime_dir: &Path) -> PathBuf {
    runtime_dir.join("dataplane.sock")
}

fn pid_path(runtime_dir: &Path) -> PathBuf {
    runtime_dir.join("dataplane.pid")
}

pub(crate) async fn channel(socket: &Path) -> std::io::Result<Channel> {
    // Fail fast when nobody listens; tonic's connector would otherwise retry.
    UnixStream::connect(socket).await?;
    let socket = socket.to_path_buf();
    // The URI is required by tonic but unused: the connector dials the socket.
    let endpoint =
        Endpoint::try_from("http://kvpn-dataplane.invalid").map_err(std::io::Error::other)?;
    endpoint
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
        }))
        .await
        .map_err(std::io::Error::other)
}

/// The root daemon's sessions (`Status`), with `what` saying why we asked, for
/// the error.
pub async fn sessions(
    client: &mut DataplaneClient<Channel>,
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

/// A client for a root daemon that is already running, or `None` when none answers.
pub async fn connect_existing(runtime_dir: &Path) -> Result<Option<DataplaneClient<Channel>>> {
    let socket = socket_path(runtime_dir);
    match channel(&socket).await {
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
pub async fn connect_or_start(runtime_dir: &Path) -> Result<DataplaneClient<Channel>> {
    if let Some(c) = connect_existing(runtime_dir).await? {
        return Ok(c);
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "the root daemon kvpn-dataplane is not running and starting it needs root \
             (it creates the TUN device, routes and eBPF programs) — run `sudo kvpn connect …`"
        );
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

/// Stop the root daemon (SIGTERM to the pid in its pid file) and wait for its socket to go.
pub async fn stop(runtime_dir: &Path) -> Result<()> {
    let pid_file = pid_path(runtime_dir);
    let pid = match std::fs::read_to_string(&pid_file) {
        Ok(s) => s
            .trim()
            .parse::<i32>()
            .with_context(|| format!("bad pid file {}", pid_file.display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            crate::output::done("The root daemon is not running");
            return Ok(());
        }
        Err(e) => return Err(anyhow!(e).context(format!("cannot read {}", pid_file.display()))),
    };
    // SAFETY: kill(2) with a pid and a signal number has no memory preconditions.
    let sent = unsafe { libc::kill(pid, libc::SIGTERM) } == 0;
    if !sent || !process_alive(pid) {
        crate::output::done(&format!("The root daemon (pid {pid}) was not running"));
        let _ = std::fs::remove_file(&pid_file);
        return Ok(());
    }
    // Wait for the process itself to go: its socket may still exist (refusing
    // connections) while it tears sessions down.
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
    crate::output::done(&format!("Stopped the root daemon (pid {pid})"));
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

/// With no root daemon answering: undo what a killed one left (resolv.conf from
/// its backup, kvpn's routes) by running `kvpn-dataplane --repair`. Returns
/// whether there was something to undo.
pub fn repair_leftovers(runtime_dir: &Path) -> Result<bool> {
    if !dns_left_changed(runtime_dir) {
        return Ok(false);
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "the root daemon died and left this machine's resolv.conf pointing at its DNS \
             forwarder; restoring it needs root — run `sudo kvpn quit`"
        );
    }
    let bin = dataplane_binary();
    let out = std::process::Command::new(&bin)
        .arg("--runtime-dir")
        .arg(runtime_dir)
        .arg("--repair")
        .output()
        .with_context(|| format!("cannot run {} --repair", bin.display()))?;
    if !out.status.success() {
        bail!(
            "{} --repair failed: {}",
            bin.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(true)
}

/// Whether `pid` still runs (a zombie counts as gone: it runs no code).
pub(crate) fn process_alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next())
            .is_some_and(|state| state != 'Z' && state != 'X'),
        Err(_) => false,
    }
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
