//! Processes the lab runs inside its netns (pod servers, the manager, test helpers).
//!
//! I/O: spawns `ip netns exec <netns> <program>` with stdout and stderr appended to a
//! log file, signals by pid, and reads `/proc/<pid>/stat` to tell a live process from
//! a zombie or from an unrelated process that reused the pid.

use std::fs::OpenOptions;
use std::io::{Read as _, Seek as _, SeekFrom};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use crate::netns::{Netns, describe};
use crate::{LabError, Result};

/// A process started by the lab. If this process spawned it, the [`Child`] is kept so
/// its exit status can be collected (and the zombie reaped); a process recorded by
/// another process (persistent lab) is known only by pid and start time.
#[derive(Debug)]
pub struct Process {
    record: ProcessRecord,
    child: Option<Child>,
}

/// What identifies a lab process across processes (stored in a persistent lab's state
/// file).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessRecord {
    /// Short name, also the log file's stem (e.g. `backend-1`).
    pub name: String,
    /// Netns it was started in.
    pub netns: String,
    pub pid: u32,
    /// Start time in clock ticks since boot (`/proc/<pid>/stat` field 22); guards
    /// against signalling an unrelated process that reused the pid.
    pub start_ticks: u64,
    pub log: PathBuf,
    /// The command line, for `lab.info()`.
    pub cmdline: String,
}

impl Process {
    /// Starts `cmd` (program, args, env and working directory are taken from it) inside
    /// `netns`, in its own process group (so a terminal's Ctrl-C does not reach it),
    /// with stdin from /dev/null and stdout+stderr appended to `log`.
    pub fn spawn(netns: &Netns, name: &str, cmd: &Command, log: &Path) -> Result<Process> {
        let mut wrapped = netns.command(cmd.get_program());
        wrapped.args(cmd.get_args());
        for (key, value) in cmd.get_envs() {
            match value {
                Some(v) => wrapped.env(key, v),
                None => wrapped.env_remove(key),
            };
        }
        if let Some(dir) = cmd.get_current_dir() {
            wrapped.current_dir(dir);
        }
        let open_log = || {
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .map_err(|source| LabError::Io {
                    what: format!("cannot open log file {}", log.display()),
                    source,
                })
        };
        wrapped
            .stdin(Stdio::null())
            .stdout(open_log()?)
            .stderr(open_log()?)
            .process_group(0);
        let cmdline = describe(cmd);
        let child = wrapped.spawn().map_err(|source| LabError::Spawn {
            cmd: cmdline.clone(),
            source,
        })?;
        let pid = child.id();
        // If the process already died, start_ticks stays 0 and is_alive() reports false.
        let start_ticks = proc_stat(pid).map(|s| s.start_ticks).unwrap_or(0);
        tracing::debug!(name, pid, netns = netns.name(), cmd = %cmdline, "started lab process");
        Ok(Process {
            record: ProcessRecord {
                name: name.to_owned(),
                netns: netns.name().to_owned(),
                pid,
                start_ticks,
                log: log.to_owned(),
                cmdline,
            },
            child: Some(child),
        })
    }

    /// A process known only from its record (started by another process).
    pub fn from_record(record: ProcessRecord) -> Process {
        Process {
            record,
            child: None,
        }
    }

    pub fn record(&self) -> &ProcessRecord {
        &self.record
    }

    pub fn pid(&self) -> u32 {
        self.record.pid
    }

    pub fn name(&self) -> &str {
        &self.record.name
    }

    pub fn log(&self) -> &Path {
        &self.record.log
    }

    /// The exit status if the process has exited (only known for our own children).
    pub fn try_exit_status(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// True while the process runs: its pid exists with the recorded start time and
    /// is not a zombie.
    pub fn is_alive(&mut self) -> bool {
        if self.try_exit_status().is_some() {
            return false;
        }
        match proc_stat(self.record.pid) {
            Some(stat) => stat.start_ticks == self.record.start_ticks && stat.state != 'Z',
            None => false,
        }
    }

    /// Sends SIGTERM, waits up to `grace` for the exit, then SIGKILLs. Returns the exit
    /// status when this process spawned it. Idempotent.
    pub fn terminate(&mut self, grace: Duration) -> Option<ExitStatus> {
        if self.is_alive() {
            self.signal(Signal::SIGTERM);
            let deadline = Instant::now() + grace;
            while self.is_alive() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if self.is_alive() {
                tracing::warn!(name = %self.record.name, pid = self.record.pid, "no exit after SIGTERM; sending SIGKILL");
                self.signal(Signal::SIGKILL);
                let deadline = Instant::now() + Duration::from_secs(2);
                while self.is_alive() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
        self.child.as_mut().and_then(|c| c.wait().ok())
    }

    fn signal(&self, signal: Signal) {
        let Ok(pid) = i32::try_from(self.record.pid) else {
            return;
        };
        // ESRCH (already gone) is fine: the goal is that it does not run.
        let _ = kill(Pid::from_raw(pid), signal);
    }

    /// The last `max_bytes` of the log (lossy UTF-8), for error messages.
    pub fn log_tail(&self, max_bytes: u64) -> String {
        log_tail(&self.record.log, max_bytes)
    }
}

/// The last `max_bytes` of a file (lossy UTF-8), or an empty string.
pub fn log_tail(path: &Path, max_bytes: u64) -> String {
    let Ok(mut file) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(max_bytes)));
    let mut buf = Vec::new();
    let _ = file.read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

/// The fields of `/proc/<pid>/stat` the lab uses.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProcStat {
    pub state: char,
    pub start_ticks: u64,
}

pub(crate) fn proc_stat(pid: u32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_proc_stat(&text)
}

/// Parses `pid (comm) state ppid ... starttime ...`; comm may hold spaces and parens,
/// so fields are counted from the last `)`.
fn parse_proc_stat(text: &str) -> Option<ProcStat> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    // After the state (field 3), starttime is field 22: skip fields 4..=21.
    let start_ticks = fields.nth(18)?.parse().ok()?;
    Some(ProcStat { state, start_ticks })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_stat_with_odd_comm() {
        let line =
            "1234 (a) b (c)) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 200";
        let stat = parse_proc_stat(line).expect("parses");
        assert_eq!(stat.state, 'S');
        assert_eq!(stat.start_ticks, 987654);
    }

    #[test]
    fn reads_own_stat() {
        let stat = proc_stat(std::process::id()).expect("own /proc/self/stat");
        assert!(stat.start_ticks > 0);
        assert_ne!(stat.state, 'Z');
    }
}
