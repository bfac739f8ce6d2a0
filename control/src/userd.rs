//! The user daemon (`kvpn daemon`): one unprivileged, long-running process per
//! user that hosts every Kubernetes session's user-side half as tokio tasks
//! ([`crate::agent`]: the port-forward listener the root daemon dials, the
//! route watch, the SSH connection to the API server) and persists the
//! sessions ([`record`]) so that a restarted user daemon brings them back.
//!
//! This module is the client side, used by the CLI: where the daemon's files
//! are ([`Paths`]), starting it on demand, its gRPC API over a Unix socket
//! (`proto/userd.proto`). The daemon itself is [`server`].
//!
//! I/O: the Unix socket, spawning the daemon, reading its pid file and log.

pub mod connect_lock;
pub mod record;
pub mod renew;
pub mod server;

use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use kvpn_proto::userd::user_daemon_client::UserDaemonClient;

use crate::daemon;
use crate::daemon_channel::{self, Daemon, DaemonChannel};

/// The root daemon's default runtime folder (`--runtime-dir`, `KVPN_RUNTIME_DIR`).
pub const DEFAULT_ROOT_RUNTIME_DIR: &str = "/run/kvpn";

/// How long the CLI waits for a freshly started user daemon to answer. It binds
/// its socket before it restores sessions, so this is process start-up only.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// How long `kvpn quit` waits for the user daemon to exit after Quit; it has
/// disconnected every session by then and only closes its socket.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// The user daemon's files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Paths {
    /// The folder, mode 0700: `$XDG_RUNTIME_DIR/kvpn` for a normal user (a
    /// subfolder of it per root daemon runtime folder other than the default);
    /// the root daemon's runtime folder for root (tests give each lab its own,
    /// so user daemons of parallel tests stay apart).
    pub dir: PathBuf,
    /// gRPC socket, mode 0600.
    pub socket: PathBuf,
    /// The daemon's log (stdout and stderr).
    pub log: PathBuf,
    /// Its pid.
    pub pid: PathBuf,
    /// Held (flock) by the running daemon: a second one started at the same
    /// moment exits at once.
    pub lock: PathBuf,
}

impl Paths {
    /// The files in `dir`.
    pub fn in_dir(dir: PathBuf) -> Self {
        Paths {
            socket: dir.join("user.sock"),
            log: dir.join("user.log"),
            pid: dir.join("user.pid"),
            lock: dir.join("user.lock"),
            dir,
        }
    }

    /// Where this process's user daemon lives, for the root daemon's runtime
    /// folder `root_runtime_dir` ([`Paths::dir`]).
    pub fn current(root_runtime_dir: &Path) -> Self {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let euid = unsafe { libc::geteuid() };
        let xdg = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from);
        Paths::in_dir(user_dir(root_runtime_dir, euid, xdg.as_deref()))
    }
}

/// The user daemon's folder ([`Paths::dir`]). A normal user's is always their
/// own (the root daemon's runtime folder belongs to root); one per root
/// runtime folder, since a user daemon serves one root daemon.
pub fn user_dir(root_runtime_dir: &Path, euid: u32, xdg_runtime_dir: Option<&Path>) -> PathBuf {
    if euid == 0 {
        return root_runtime_dir.to_path_buf();
    }
    let base = match xdg_runtime_dir.filter(|p| p.is_absolute()) {
        Some(x) => x.join("kvpn"),
        None => std::env::temp_dir().join(format!("kvpn-{euid}")),
    };
    if root_runtime_dir == Path::new(DEFAULT_ROOT_RUNTIME_DIR) {
        base
    } else {
        // A hash, not the path itself: Unix socket paths are limited to 108 bytes.
        base.join(format!(
            "rt-{:016x}",
            fnv1a(root_runtime_dir.as_os_str().as_bytes())
        ))
    }
}

/// 64-bit FNV-1a: a name that stays the same across kvpn builds (std's hasher
/// may change between Rust releases).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A client of a user daemon that answers, or `None`.
pub async fn connect_existing(paths: &Paths) -> Result<Option<UserDaemonClient<DaemonChannel>>> {
    let daemon = Daemon::new(daemon_channel::Kind::User, &paths.socket, &paths.pid);
    match daemon_channel::open(daemon).await {
        Ok(ch) => Ok(Some(UserDaemonClient::new(ch))),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) =>
        {
            Ok(None)
        }
        Err(e) => Err(anyhow!(e).context(format!(
            "cannot talk to the user daemon at {} — `kvpn quit` stops it, `kvpn logs` shows why",
            paths.socket.display()
        ))),
    }
}

/// The session records this process's user daemon would restore.
pub fn store(paths: &Paths) -> Result<record::Store> {
    record::Store::current(&paths.socket).context("cannot find the folder of kvpn's session state")
}

/// A client of the user daemon, starting it first if none answers.
pub async fn connect_or_start(root_runtime_dir: &Path) -> Result<UserDaemonClient<DaemonChannel>> {
    let paths = Paths::current(root_runtime_dir);
    if let Some(c) = connect_existing(&paths).await? {
        return Ok(c);
    }
    let mut child = start(root_runtime_dir, &paths)?;
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Some(c) = connect_existing(&paths).await? {
            return Ok(c);
        }
        // A daemon that lost the start race to another one exits 0 at once;
        // keep waiting for the winner's socket.
        if let Some(status) = child.try_wait()?
            && !status.success()
        {
            bail!(
                "the user daemon exited ({status}) before answering on {}: {}",
                paths.socket.display(),
                tail(&paths.log, 5)
            );
        }
        if Instant::now() > deadline {
            bail!(
                "started the user daemon but it did not answer on {} within {} s — see {}",
                paths.socket.display(),
                START_TIMEOUT.as_secs(),
                paths.log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A client of the user daemon when one runs or one has sessions to bring back
/// (it is started then); `None` when there is none and nothing to restore, so
/// `kvpn status` after `kvpn quit` leaves no daemon behind.
pub async fn connect_if_needed(
    root_runtime_dir: &Path,
) -> Result<Option<UserDaemonClient<DaemonChannel>>> {
    let paths = Paths::current(root_runtime_dir);
    if let Some(c) = connect_existing(&paths).await? {
        return Ok(Some(c));
    }
    if !store(&paths)?.any() {
        return Ok(None);
    }
    connect_or_start(root_runtime_dir).await.map(Some)
}

fn start(root_runtime_dir: &Path, paths: &Paths) -> Result<std::process::Child> {
    create_private_dir(&paths.dir)?;
    let exe = std::env::current_exe().context("cannot find the kvpn executable")?;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&paths.log)
        .with_context(|| format!("cannot open {}", paths.log.display()))?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("--runtime-dir")
        .arg(root_runtime_dir)
        .arg("daemon")
        .stdin(std::process::Stdio::null())
        .stdout(
            log.try_clone()
                .context("cannot duplicate the log file handle")?,
        )
        .stderr(log);
    if std::env::var_os("KVPN_LOG").is_none() {
        cmd.env("KVPN_LOG", "info");
    }
    // Detach from the CLI's process group so the daemon outlives it and its terminal.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    cmd.spawn()
        .context("cannot start the user daemon (kvpn daemon)")
}

/// Create `dir` (and parents); a folder of our own (not the root daemon's) gets
/// mode 0700. An existing folder of a normal user must be theirs (a folder
/// someone else made in /tmp could hold a socket of theirs) and is made 0700.
pub fn create_private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _};
    if !dir.is_dir() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if euid == 0 {
        return Ok(());
    }
    let meta = std::fs::metadata(dir).with_context(|| format!("cannot read {}", dir.display()))?;
    if meta.uid() != euid {
        bail!(
            "the user daemon's folder {} belongs to uid {}, not to you (uid {euid}) — remove \
             it, or set XDG_RUNTIME_DIR to a folder of your own",
            dir.display(),
            meta.uid()
        );
    }
    if meta.permissions().mode() & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("cannot make {} private (mode 0700)", dir.display()))?;
    }
    Ok(())
}

/// Take an exclusive `flock(2)` on `path` (created, mode 0600, if missing) without
/// waiting: the open file, which holds the lock until it is closed (also when the
/// process dies), or `Ok(None)` when another open file holds it.
pub fn try_flock(path: &Path) -> Result<Option<std::fs::File>> {
    use std::os::fd::AsRawFd as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    // SAFETY: flock on a descriptor we own; no memory is involved.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(Some(f));
    }
    let e = std::io::Error::last_os_error();
    if e.kind() == std::io::ErrorKind::WouldBlock {
        Ok(None)
    } else {
        Err(anyhow!(e).context(format!("cannot lock {}", path.display())))
    }
}

/// The pid the running user daemon wrote, if any.
pub fn pid(paths: &Paths) -> Option<i32> {
    std::fs::read_to_string(&paths.pid)
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Stopped session ids and, per id, the laptop TCP sockets through the session
/// that the root daemon destroyed (a session with none is absent).
pub type Stopped = (Vec<String>, std::collections::HashMap<String, u64>);

/// `kvpn quit`'s part: ask a running user daemon to disconnect its sessions
/// and exit, and wait until it did. Returns the stopped session ids, the laptop
/// TCP sockets reset per id (none: absent), and, when a user daemon ran, its pid (`Some(None)` when its pid file was unreadable).
/// Without a running daemon, forgets the sessions it would restore (the root
/// daemon, stopped next, takes their other halves down) and removes the
/// socket and pid file a killed one left.
pub async fn quit(root_runtime_dir: &Path) -> Result<(Stopped, Option<Option<i32>>)> {
    let paths = Paths::current(root_runtime_dir);
    let Some(mut client) = connect_existing(&paths).await? else {
        let store = store(&paths)?;
        if store.any() {
            store
                .clear()
                .with_context(|| format!("cannot remove {}", store.dir().display()))?;
        }
        // A killed user daemon's socket and pid file (nothing answers there).
        if !pid(&paths).is_some_and(daemon::process_alive) {
            for f in [&paths.socket, &paths.pid] {
                match std::fs::remove_file(f) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        return Err(anyhow::Error::new(e).context(format!(
                            "cannot remove the stopped user daemon's {}",
                            f.display()
                        )));
                    }
                    _ => {}
                }
            }
        }
        return Ok((Stopped::default(), None));
    };
    let pid = pid(&paths);
    let answer = client
        .quit(kvpn_proto::userd::QuitRequest {})
        .await
        .map_err(daemon::status_to_error)
        .context("the user daemon refused to quit")?
        .into_inner();
    let stopped = (answer.stopped, answer.tcp_reset);
    let deadline = Instant::now() + STOP_TIMEOUT;
    while pid.is_some_and(daemon::process_alive) || paths.socket.exists() {
        if Instant::now() > deadline {
            bail!(
                "the user daemon{} did not exit within {} s after quit — see {}",
                pid.map(|p| format!(" (pid {p})")).unwrap_or_default(),
                STOP_TIMEOUT.as_secs(),
                paths.log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok((stopped, Some(pid)))
}

/// The last `n` lines of the file at `path`, for an error message.
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The CLI's environment as StartSession carries it.
pub fn env_of(env: &crate::kubeconfig::UserEnv) -> Vec<kvpn_proto::userd::EnvVar> {
    env.vars()
        .map(|(k, v)| kvpn_proto::userd::EnvVar {
            name: k.as_bytes().to_vec(),
            value: v.as_bytes().to_vec(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_dir_is_the_root_runtime_dir_for_root_and_the_users_own_otherwise() {
        let p = Path::new;
        assert_eq!(
            user_dir(p("/run/kvpn"), 0, Some(p("/run/user/0"))),
            p("/run/kvpn")
        );
        assert_eq!(
            user_dir(p("/tmp/lab/kvpn-runtime"), 0, None),
            p("/tmp/lab/kvpn-runtime")
        );
        let a = user_dir(p("/tmp/lab/kvpn-runtime"), 1000, Some(p("/run/user/1000")));
        let b = user_dir(p("/tmp/lab2/kvpn-runtime"), 1000, Some(p("/run/user/1000")));
        assert_eq!(a.parent(), Some(p("/run/user/1000/kvpn")));
        assert!(
            a.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("rt-")),
            "{}",
            a.display()
        );
        assert_ne!(a, b, "one folder per root runtime folder");
        // FNV-1a reference values (draft-eastlake-fnv): "" and "a".
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(
            a,
            p("/run/user/1000/kvpn").join(format!("rt-{:016x}", fnv1a(b"/tmp/lab/kvpn-runtime")))
        );
        assert_eq!(
            user_dir(p("/run/kvpn"), 1000, Some(p("/run/user/1000"))),
            p("/run/user/1000/kvpn")
        );
        assert_eq!(
            user_dir(p("/run/kvpn"), 1000, None),
            std::env::temp_dir().join("kvpn-1000")
        );
    }
}
