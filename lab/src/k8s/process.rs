//! Local processes of the lab control plane: spawned with their output in a log
//! file, recorded by pid and kernel start time (so a recycled pid is never
//! signalled), stopped with SIGTERM and, after a bound, SIGKILL.
//!
//! Processes started "tied" die with the process that started them
//! (`PR_SET_PDEATHSIG`), so a test binary killed outright leaves no etcd or
//! apiserver behind. The kernel sends that signal when the spawning *thread*
//! exits, so tied processes are spawned from a [`Spawner`] thread that lives as
//! long as the control plane. Untied processes (`kvpn lab up`) outlive the CLI
//! and are stopped later from the recorded pids.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use super::Error;

/// A process as recorded in the instance folder's state file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessRecord {
    pub name: String,
    pub pid: i32,
    /// Field 22 of `/proc/<pid>/stat` (clock ticks since boot): tells this process
    /// from a later one that got the same pid.
    pub start_time: u64,
    pub log: PathBuf,
}

/// The kernel start time of `pid`, or None when no such process exists.
pub fn proc_start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain spaces.
    let after = &stat[stat.rfind(')')? + 1..];
    // Fields after the name start at field 3 (state); start time is field 22.
    after.split_whitespace().nth(22 - 3)?.parse().ok()
}

/// True while the recorded process (same pid, same start time) exists and is not
/// a zombie.
pub fn is_alive(record: &ProcessRecord) -> bool {
    if proc_start_time(record.pid) != Some(record.start_time) {
        return false;
    }
    let state = std::fs::read_to_string(format!("/proc/{}/stat", record.pid))
        .ok()
        .and_then(|s| {
            let after = &s[s.rfind(')')? + 1..];
            after.split_whitespace().next().map(str::to_owned)
        });
    !matches!(state.as_deref(), Some("Z") | Some("X") | None)
}

/// The last `lines` lines of a log file (for error messages).
pub fn log_tail(path: &Path, lines: usize) -> String {
    let Ok(mut f) = File::open(path) else {
        return format!("(no log at {})", path.display());
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(16 * 1024);
    let mut buf = Vec::new();
    if f.seek(SeekFrom::Start(start)).is_err() || f.read_to_end(&mut buf).is_err() {
        return format!("(cannot read {})", path.display());
    }
    let text = String::from_utf8_lossy(&buf);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

/// A thread that spawns tied processes and lives until dropped (see module docs).
#[derive(Debug)]
pub struct Spawner {
    tx: Option<mpsc::Sender<SpawnRequest>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Spawner {
    pub fn new() -> Result<Self, Error> {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        let thread = thread::Builder::new()
            .name("kvpn-lab-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    // The receiver may be gone if the caller gave up; nothing to do then.
                    let _ = reply.send(cmd.spawn());
                }
            })
            .map_err(Error::io("starting the lab's process spawner thread"))?;
        Ok(Spawner {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    fn spawn(&self, cmd: Command) -> std::io::Result<Child> {
        let (reply_tx, reply_rx) = mpsc::channel();
        let gone = || std::io::Error::other("the lab's spawner thread is gone");
        self.tx
            .as_ref()
            .ok_or_else(gone)?
            .send((cmd, reply_tx))
            .map_err(|_| gone())?;
        reply_rx.recv().map_err(|_| gone())?
    }
}

impl Drop for Spawner {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            // The thread only loops over the channel, which is closed now.
            let _ = t.join();
        }
    }
}

/// A process this lab started.
#[derive(Debug)]
pub struct Managed {
    pub record: ProcessRecord,
    /// Present when this process is our child (reaped on stop); absent when the
    /// record was read back from a state file.
    child: Option<Child>,
}

impl Managed {
    /// Spawns `program args…` with stdout and stderr appended to `log`.
    /// `spawner`: Some → tied to this process (see module docs).
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        log: &Path,
        spawner: Option<&Spawner>,
    ) -> Result<Self, Error> {
        Self::spawn_with(name, program, args, log, spawner, |_| {})
    }

    /// [`Managed::spawn`] with `prepare` applied to the command last (e.g. more
    /// `pre_exec` hooks, which run after the tie/untie hook).
    pub fn spawn_with(
        name: &str,
        program: &Path,
        args: &[String],
        log: &Path,
        spawner: Option<&Spawner>,
        prepare: impl FnOnce(&mut Command),
    ) -> Result<Self, Error> {
        let out = File::options()
            .create(true)
            .append(true)
            .open(log)
            .map_err(Error::io(format!("opening {}", log.display())))?;
        let err = out
            .try_clone()
            .map_err(Error::io(format!("opening {}", log.display())))?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err));
        if spawner.is_some() {
            // SAFETY: the closure runs between fork and exec and only calls
            // prctl(2), which is async-signal-safe; it touches no memory of the parent.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        } else {
            // Untied: a session of its own, so closing the terminal that ran
            // `kvpn lab up` (SIGHUP to its process groups) leaves it running.
            // SAFETY: setsid(2) is async-signal-safe and touches no parent memory.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::setsid() < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        prepare(&mut cmd);
        let child = match spawner {
            Some(s) => s.spawn(cmd),
            None => cmd.spawn(),
        }
        .map_err(Error::io(format!(
            "starting {} ({})",
            name,
            program.display()
        )))?;
        let pid = i32::try_from(child.id()).map_err(|_| Error::State {
            path: log.to_owned(),
            message: format!("pid {} of {name} does not fit an i32", child.id()),
        })?;
        // Just forked, so /proc/<pid> exists unless it already died; 0 then (never
        // matches, so such a process counts as gone).
        let start_time = proc_start_time(pid).unwrap_or(0);
        Ok(Managed {
            record: ProcessRecord {
                name: name.to_owned(),
                pid,
                start_time,
                log: log.to_owned(),
            },
            child: Some(child),
        })
    }

    /// A process known only from its record (e.g. started by an earlier `lab up`).
    pub fn from_record(record: ProcessRecord) -> Self {
        Managed {
            record,
            child: None,
        }
    }

    /// Some(exit description) once the process has ended.
    pub fn exited(&mut self) -> Option<String> {
        match &mut self.child {
            Some(c) => match c.try_wait() {
                Ok(Some(status)) => Some(status.to_string()),
                Ok(None) => None,
                Err(e) => Some(format!("wait failed: {e}")),
            },
            None => (!is_alive(&self.record)).then(|| "gone".to_owned()),
        }
    }

    fn wait_gone(&mut self, bound: Duration) -> bool {
        let deadline = Instant::now() + bound;
        loop {
            if self.exited().is_some() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    fn signal(&self, sig: Signal) {
        // Only signal the process we started: same pid *and* same start time.
        if is_alive(&self.record) {
            // ESRCH if it died in between: fine.
            let _ = kill(Pid::from_raw(self.record.pid), sig);
        }
    }

    /// SIGTERM, wait up to `grace`, then SIGKILL and wait up to 5 s more.
    pub fn stop(&mut self, grace: Duration) -> Result<(), Error> {
        if self.exited().is_some() {
            return Ok(());
        }
        tracing::debug!(name = %self.record.name, pid = self.record.pid, "SIGTERM");
        self.signal(Signal::SIGTERM);
        if self.wait_gone(grace) {
            return Ok(());
        }
        tracing::warn!(name = %self.record.name, pid = self.record.pid, ?grace, "still running after SIGTERM; SIGKILL");
        self.signal(Signal::SIGKILL);
        if self.wait_gone(Duration::from_secs(5)) {
            return Ok(());
        }
        Err(Error::Unkillable {
            name: self.record.name.clone(),
            pid: self.record.pid,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_escalates_to_sigkill_for_a_process_ignoring_sigterm() {
        let dir = std::env::temp_dir().join(format!("kvpn-proc-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let log = dir.join("sh.log");
        let spawner = Spawner::new().expect("spawner");
        let mut p = Managed::spawn(
            "stubborn",
            Path::new("/bin/sh"),
            &[
                "-c".into(),
                "trap '' TERM; echo started; exec sleep 30".into(),
            ],
            &log,
            Some(&spawner),
        )
        .expect("spawn");
        // Give the shell time to install its trap.
        thread::sleep(Duration::from_millis(300));
        assert!(is_alive(&p.record));
        let t = Instant::now();
        p.stop(Duration::from_millis(500)).expect("stop");
        assert!(
            t.elapsed() >= Duration::from_millis(500),
            "SIGTERM alone should not have ended it"
        );
        assert!(!is_alive(&p.record));
        assert!(log_tail(&log, 5).contains("started"));
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn start_time_tells_recycled_pids_apart() {
        let me = i32::try_from(std::process::id()).expect("pid");
        let st = proc_start_time(me).expect("own start time");
        let record = ProcessRecord {
            name: "me".into(),
            pid: me,
            start_time: st + 1,
            log: PathBuf::new(),
        };
        assert!(!is_alive(&record));
        assert!(is_alive(&ProcessRecord {
            start_time: st,
            ..record
        }));
    }
}
