//! One `kvpn connect` at a time per user daemon: `connect.lock` in the user
//! daemon's folder ([`super::Paths::dir`]), an exclusive `flock(2)` held for the
//! whole connect and holding the holder's pid and command (`1234 connect`).
//!
//! Two connects started together both found no session and both set one up:
//! the second failed in the root daemon with "add route … File exists". Now the
//! second waits, says for whom, then finds the first one's session ("nothing to
//! do"). `kvpn quit` takes the same lock: it interrupts a running connect
//! (SIGINT: a connect is all or nothing on Ctrl-C, it undoes what it set up),
//! waits for it, and keeps the lock while it stops the daemons, so no connect can
//! start a daemon behind its back.
//!
//! Pure: [`parse_holder`], [`Holder::waiting_message`], [`is_connect_cmdline`].
//! I/O: the lock file, `/proc/<pid>/cmdline`, `kill(2)`.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::{Paths, create_private_dir, try_flock};
use crate::output;

/// File name of the lock in the user daemon's folder.
pub const FILE_NAME: &str = "connect.lock";

/// How long a waiter gives the lock's holder to write its pid before it says it
/// waits without one: the holder writes it right after taking the lock.
pub const PID_WAIT: Duration = Duration::from_millis(500);

/// How long `kvpn quit` waits for an interrupted `kvpn connect` to finish. A
/// connect waits up to [`crate::connect::INTERRUPTED_SETUP_WAIT`] (10 s) for its
/// session setup to answer before it undoes it, plus the disconnect.
pub const QUIT_WAIT: Duration = Duration::from_secs(20);

/// How often a waiter tries the lock again.
const POLL: Duration = Duration::from_millis(50);

/// The lock file's command while the user daemon renews a session.
pub const RENEW: &str = "renew";

/// Who took the lock, as its file says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub pid: i32,
    /// `connect`, `quit`, `version` or [`RENEW`].
    pub command: String,
}

impl Holder {
    /// What a `kvpn connect` that waits for this holder prints.
    pub fn waiting_message(holder: Option<&Holder>) -> String {
        match holder {
            Some(h) if h.command == "quit" => {
                format!("Waiting for `kvpn quit` (pid {}) to finish", h.pid)
            }
            Some(h) if h.command == RENEW => format!(
                "Waiting for the user daemon (pid {}) to renew a session whose traffic manager \
                 was reinstalled",
                h.pid
            ),
            Some(h) => format!(
                "Waiting for another `kvpn connect` (pid {}) to finish",
                h.pid
            ),
            None => "Waiting for another `kvpn connect` to finish".to_owned(),
        }
    }
}

/// The holder a lock file's text names: `<pid> <command>` (a bare pid is a
/// connect); `None` for an empty or garbled file.
pub fn parse_holder(text: &str) -> Option<Holder> {
    let mut words = text.split_whitespace();
    let pid: i32 = words.next()?.parse().ok().filter(|p| *p > 0)?;
    let command = words.next().unwrap_or("connect").to_owned();
    Some(Holder { pid, command })
}

/// Whether a `/proc/<pid>/cmdline` is a `kvpn connect`: some argument after the
/// program is `connect`. Guards `kvpn quit`'s SIGINT against a pid the lock file
/// still names after its process ended and the pid was reused.
pub fn is_connect_cmdline(cmdline: &[u8]) -> bool {
    cmdline
        .split(|b| *b == 0)
        .skip(1)
        .any(|arg| arg == b"connect")
}

/// The lock, held until dropped (or the process exits).
#[derive(Debug)]
pub struct ConnectLock {
    file: std::fs::File,
    path: PathBuf,
    /// The folders this connect created for the lock, innermost first: removed
    /// on drop if the lock is still all they hold (the connect failed before a
    /// user daemon started there), so a failed connect leaves no folder behind.
    created_dirs: Vec<PathBuf>,
}

impl ConnectLock {
    /// The lock file of the user daemon that serves `root_runtime_dir`.
    pub fn path(root_runtime_dir: &Path) -> PathBuf {
        Paths::current(root_runtime_dir).dir.join(FILE_NAME)
    }

    /// Take the lock for `kvpn connect`, waiting (without a bound: Ctrl-C stops
    /// the wait) while another connect or a quit holds it, after saying so.
    pub async fn for_connect(root_runtime_dir: &Path) -> Result<ConnectLock> {
        let path = Self::path(root_runtime_dir);
        let created_dirs: Vec<PathBuf> = path
            .ancestors()
            .skip(1)
            .take_while(|d| !d.as_os_str().is_empty() && !d.exists())
            .map(Path::to_path_buf)
            .collect();
        if let Some(dir) = path.parent() {
            create_folder(dir)?;
        }
        if let Some(mut lock) = Self::try_take(&path, "connect")? {
            lock.created_dirs = created_dirs;
            return Ok(lock);
        }
        let holder = holder_pid(&path).await;
        output::step(&Holder::waiting_message(holder.as_ref()));
        loop {
            tokio::time::sleep(POLL).await;
            if let Some(lock) = Self::try_take(&path, "connect")? {
                return Ok(lock);
            }
        }
    }

    /// Take the lock for `kvpn quit`: interrupt each `kvpn connect` that holds it
    /// (SIGINT, once per pid) and wait for the lock up to [`QUIT_WAIT`]. `None`
    /// when the user daemon's folder does not exist (no connect ever ran there).
    pub async fn for_quit(root_runtime_dir: &Path) -> Result<Option<ConnectLock>> {
        let path = Self::path(root_runtime_dir);
        if !path.parent().is_some_and(Path::is_dir) {
            return Ok(None);
        }
        let deadline = Instant::now() + QUIT_WAIT;
        let mut interrupted: Vec<i32> = Vec::new();
        loop {
            if let Some(lock) = Self::try_take(&path, "quit")? {
                return Ok(Some(lock));
            }
            if let Some(h) = holder_pid(&path).await
                && h.command == "connect"
                && !interrupted.contains(&h.pid)
                && std::fs::read(format!("/proc/{}/cmdline", h.pid))
                    .is_ok_and(|c| is_connect_cmdline(&c))
            {
                output::step(&format!(
                    "Interrupting `kvpn connect` (pid {}): it undoes what it set up",
                    h.pid
                ));
                interrupted.push(h.pid);
                if let Err(e) = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(h.pid),
                    nix::sys::signal::Signal::SIGINT,
                ) && e != nix::errno::Errno::ESRCH
                {
                    bail!(
                        "cannot interrupt `kvpn connect` (pid {}): {e} — stop it (Ctrl-C) \
                         and run `kvpn quit` again",
                        h.pid
                    );
                }
            }
            if Instant::now() >= deadline {
                let who = parse_holder(&std::fs::read_to_string(&path).unwrap_or_default())
                    .map(|h| format!("`kvpn {}` (pid {})", h.command, h.pid))
                    .unwrap_or_else(|| "another kvpn command".to_owned());
                bail!(
                    "{who} still holds {} {} s after it was asked to stop — stop it \
                     (Ctrl-C, or `kill` its pid) and run `kvpn quit` again",
                    path.display(),
                    QUIT_WAIT.as_secs()
                );
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Take the lock for a daemon restart (`kvpn version`) when nobody holds it:
    /// `None` while a `kvpn connect` or `kvpn quit` runs, or when the user
    /// daemon's folder does not exist. Never waits.
    pub fn try_for_restart(root_runtime_dir: &Path) -> Result<Option<ConnectLock>> {
        let path = Self::path(root_runtime_dir);
        if !path.parent().is_some_and(Path::is_dir) {
            return Ok(None);
        }
        Self::try_take(&path, "version")
    }

    /// Take the lock for the user daemon's renewal of a session whose manager
    /// was reinstalled ([`super::renew`]), so no `kvpn connect` replaces the
    /// same session meanwhile: `None` while a connect or quit holds it. Never
    /// waits.
    pub fn try_for_renew(root_runtime_dir: &Path) -> Result<Option<ConnectLock>> {
        let path = Self::path(root_runtime_dir);
        if !path.parent().is_some_and(Path::is_dir) {
            return Ok(None);
        }
        Self::try_take(&path, RENEW)
    }

    fn try_take(path: &Path, command: &str) -> Result<Option<ConnectLock>> {
        let Some(mut file) = try_flock(path)? else {
            return Ok(None);
        };
        // The file is ours now: say who holds it, for waiters and `kvpn quit`.
        file.set_len(0)
            .and_then(|()| writeln!(file, "{} {command}", std::process::id()))
            .and_then(|()| file.flush())
            .with_context(|| format!("cannot write {}", path.display()))?;
        Ok(Some(ConnectLock {
            file,
            path: path.to_owned(),
            created_dirs: Vec::new(),
        }))
    }
}

impl Drop for ConnectLock {
    fn drop(&mut self) {
        // Empty before the lock goes (at close), so nobody reads this pid as the
        // next holder's. A process that dies leaves its pid; readers check it runs.
        if let Err(e) = self.file.set_len(0) {
            tracing::debug!(path = %self.path.display(), error = %e, "cannot empty the connect lock");
        }
        if let Some(dir) = self.created_dirs.first() {
            let only_the_lock = std::fs::read_dir(dir).is_ok_and(|entries| {
                entries
                    .flatten()
                    .all(|e| e.file_name() == std::ffi::OsStr::new(FILE_NAME))
            });
            if only_the_lock {
                let _ = std::fs::remove_file(&self.path);
                // remove_dir takes only empty folders: one a daemon uses stays.
                for d in &self.created_dirs {
                    let _ = std::fs::remove_dir(d);
                }
            }
        }
    }
}

/// Create the lock's folder if missing: a normal user's private one as the user
/// daemon makes it; root's is the root daemon's runtime folder, made with the
/// mode the root daemon gives it (0755: normal users reach its socket there).
fn create_folder(dir: &Path) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return create_private_dir(dir);
    }
    if !dir.is_dir() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
    }
    Ok(())
}

/// The lock's holder, once its file names a running process; `None` when none
/// does within [`PID_WAIT`].
async fn holder_pid(path: &Path) -> Option<Holder> {
    let deadline = Instant::now() + PID_WAIT;
    loop {
        if let Some(h) = parse_holder(&std::fs::read_to_string(path).unwrap_or_default())
            && h.pid != i32::try_from(std::process::id()).unwrap_or(0)
            && crate::daemon::process_alive(h.pid)
        {
            return Some(h);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holder_lines_and_messages() {
        let h = parse_holder("1234 connect\n").expect("holder");
        assert_eq!(
            h,
            Holder {
                pid: 1234,
                command: "connect".into()
            }
        );
        assert_eq!(
            Holder::waiting_message(Some(&h)),
            "Waiting for another `kvpn connect` (pid 1234) to finish"
        );
        assert_eq!(
            parse_holder("77").map(|h| h.command),
            Some("connect".into())
        );
        let q = parse_holder("9 quit\n").expect("quit");
        assert_eq!(
            Holder::waiting_message(Some(&q)),
            "Waiting for `kvpn quit` (pid 9) to finish"
        );
        assert_eq!(
            Holder::waiting_message(None),
            "Waiting for another `kvpn connect` to finish"
        );
        let r = parse_holder("42 renew\n").expect("renew");
        assert!(
            Holder::waiting_message(Some(&r))
                .starts_with("Waiting for the user daemon (pid 42) to renew"),
            "{}",
            Holder::waiting_message(Some(&r))
        );
        for garbled in ["", "\n", "x connect", "-5 connect", "0"] {
            assert_eq!(parse_holder(garbled), None, "{garbled:?}");
        }
    }

    #[test]
    fn only_a_connect_cmdline_is_a_connect() {
        assert!(is_connect_cmdline(
            b"/usr/bin/kvpn\0connect\0--kubeconfig\0/k\0"
        ));
        assert!(is_connect_cmdline(b"kvpn\0--runtime-dir\0/r\0connect\0"));
        assert!(!is_connect_cmdline(b"connect\0"));
        assert!(!is_connect_cmdline(b"kvpn\0quit\0"));
        assert!(!is_connect_cmdline(b"vim\0connect.rs\0"));
        assert!(!is_connect_cmdline(b""));
    }

    #[test]
    fn a_second_holder_waits_and_the_file_names_the_first() {
        let dir = std::env::temp_dir().join(format!("kvpn-connect-lock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join(FILE_NAME);
        let first = ConnectLock::try_take(&path, "connect")
            .expect("lock")
            .expect("free");
        assert!(
            ConnectLock::try_take(&path, "connect")
                .expect("lock")
                .is_none()
        );
        assert_eq!(
            parse_holder(&std::fs::read_to_string(&path).expect("read")).map(|h| h.pid),
            i32::try_from(std::process::id()).ok()
        );
        drop(first);
        assert_eq!(std::fs::read_to_string(&path).expect("read"), "");
        assert!(
            ConnectLock::try_take(&path, "quit")
                .expect("lock")
                .is_some()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
