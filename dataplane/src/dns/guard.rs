//! The DNS guard: the laptop's own DNS survives a root daemon that dies without
//! cleaning up (SIGKILL, the OOM killer, a panic that aborts), with nobody
//! typing a command (issue 29 item 12).
//!
//! While connected, resolv.conf names only kvpn's forwarder (127.0.0.153). When
//! the daemon dies, nobody answers there, and every name on the laptop fails
//! until something restores the file. The daemon cannot do it itself (SIGKILL
//! runs no code), so at start it spawns a small helper process, the guard
//! (`kvpn-dataplane --dns-guard`, same binary, as root, in the daemon's network
//! and mount namespace, in its own process group so a Ctrl-C or a signal to the
//! daemon's group does not reach it). The guard holds the read end of a pipe
//! whose only write end is in the daemon: a process's descriptors close when it
//! dies, however it dies, so the guard's blocking read returns end-of-file at
//! the moment the daemon is gone. On a clean exit the daemon first writes one
//! byte ([`Guard::release`]): the guard exits without doing anything, the daemon
//! restored everything itself. On end-of-file without that byte, the guard
//! restores resolv.conf and the hosts file from their backups (exactly what
//! `kvpn-dataplane --repair` and the next daemon start do: [`super::Dns::repair`],
//! byte for byte, keeping somebody else's newer version), writes a note
//! ([`Note`], `dns-guard.json` in the runtime folder) that `kvpn status` shows,
//! logs what it did to the daemon's log, and exits. Measured in the lab: the file
//! is back a few milliseconds after the kill.
//!
//! Why not a fallback nameserver after 127.0.0.153 in resolv.conf: musl's
//! resolver asks every nameserver at once and takes the first answer, NXDOMAIN
//! included, so the laptop's resolver would race the forwarder and cluster
//! names would fail at random (and leak to the LAN's resolver); glibc would also
//! hand every cluster name to the LAN resolver whenever the forwarder is slower
//! than `timeout`. A separate process needs no resolver to cooperate.
//!
//! What the guard cannot cover: SIGKILL of the guard and the daemon together
//! (`kill -9 -<pgid>` of both groups, a reboot): then the next daemon start, or
//! `kvpn quit`/`kvpn disconnect` (which run `--repair`), restore the file, and
//! `kvpn status` warns until then. A stopped (SIGSTOP) daemon keeps its pipe
//! open, so the guard waits: it still may come back.

use std::io::{self, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::{Deserialize, Serialize};

/// The guard's pid file in the runtime folder.
pub const PID_NAME: &str = "dns-guard.pid";
/// The guard's note after it repaired, in the runtime folder.
pub const NOTE_NAME: &str = "dns-guard.json";
/// The byte a cleanly exiting daemon sends: nothing to repair.
const CLEAN_EXIT: u8 = b'Q';

/// What the guard did after the daemon died (`dns-guard.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Note {
    /// The daemon that died.
    pub daemon_pid: u32,
    /// The guard's pid.
    pub guard_pid: u32,
    /// When the guard saw the daemon die (seconds since the epoch).
    pub died_at_unix: u64,
    /// Milliseconds from the daemon's death to resolv.conf restored.
    pub repaired_after_ms: u64,
    /// The resolv.conf path.
    pub resolv_conf: PathBuf,
    /// `restored` (the laptop's original is back), `kept_others` (somebody
    /// else rewrote it meanwhile; theirs stays, without kvpn's line),
    /// `nothing_to_do`, or `failed: <error>`.
    pub resolv_conf_outcome: String,
    /// The same for the hosts file.
    pub hosts_outcome: String,
}

impl Note {
    /// The path of the note in `runtime_dir`.
    pub fn path(runtime_dir: &Path) -> PathBuf {
        runtime_dir.join(NOTE_NAME)
    }

    /// The note in `runtime_dir`, if the guard left one.
    pub fn read(runtime_dir: &Path) -> Option<Note> {
        let bytes = std::fs::read(Self::path(runtime_dir)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// One line for the user (`kvpn status`, the log).
    pub fn describe(&self) -> String {
        let what = match self.resolv_conf_outcome.as_str() {
            "restored" => format!(
                "its DNS guard (pid {}) restored {} {} ms later, so this machine's own names \
                 resolve again",
                self.guard_pid,
                self.resolv_conf.display(),
                self.repaired_after_ms
            ),
            "kept_others" => format!(
                "its DNS guard (pid {}) found {} rewritten by something else and kept that \
                 version, without kvpn's forwarder",
                self.guard_pid,
                self.resolv_conf.display()
            ),
            "nothing_to_do" => format!(
                "{} did not name its forwarder, nothing to restore",
                self.resolv_conf.display()
            ),
            failed => format!(
                "its DNS guard (pid {}) could not restore {} ({failed}) — run `kvpn quit`",
                self.guard_pid,
                self.resolv_conf.display()
            ),
        };
        format!(
            "the root daemon (pid {}) died without cleaning up; {what}; cluster names need \
             `kvpn connect` again",
            self.daemon_pid
        )
    }
}

/// The daemon's side: the pipe's write end, held for the daemon's lifetime.
#[derive(Debug)]
pub struct Guard {
    writer: io::PipeWriter,
    pid: u32,
}

impl Guard {
    /// Spawn `kvpn-dataplane --dns-guard` for `runtime_dir` (the running
    /// binary, through `/proc/self/exe` so a rebuilt or deleted file does not
    /// matter), write its pid file, and remove an old note (a new daemon runs).
    pub fn spawn(runtime_dir: &Path) -> io::Result<Guard> {
        let (reader, writer) = io::pipe()?;
        let mut cmd = Command::new("/proc/self/exe");
        cmd.arg("--runtime-dir")
            .arg(runtime_dir)
            .arg("--dns-guard")
            .stdin(Stdio::from(reader));
        // Its own process group: a Ctrl-C in the daemon's terminal, or a signal
        // to the daemon's group, does not take the guard along.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let mut child = cmd.spawn()?;
        let pid = child.id();
        let _ = std::fs::write(runtime_dir.join(PID_NAME), format!("{pid}\n"));
        let _ = std::fs::remove_file(Note::path(runtime_dir));
        // Reap it if it ends while the daemon runs (it should not: say so).
        std::thread::Builder::new()
            .name("kvpn-dns-guard-wait".into())
            .spawn(move || match child.wait() {
                Ok(status) => tracing::warn!(
                    pid,
                    %status,
                    "the DNS guard exited while the daemon runs: if this daemon dies now, \
                     resolv.conf stays pointed at its forwarder until `kvpn quit` or the next start"
                ),
                Err(e) => tracing::debug!(pid, error = %e, "cannot wait for the DNS guard"),
            })?;
        tracing::info!(
            pid,
            "DNS guard started: it restores resolv.conf if this daemon dies without cleaning up"
        );
        Ok(Guard { writer, pid })
    }

    /// The guard's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// At a clean exit (everything restored): the guard exits without acting.
    pub fn release(mut self, runtime_dir: &Path) {
        if let Err(e) = self.writer.write_all(&[CLEAN_EXIT]) {
            tracing::debug!(error = %e, "cannot tell the DNS guard about the clean exit");
        }
        let _ = std::fs::remove_file(runtime_dir.join(PID_NAME));
    }
}

/// What the guard saw on its pipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The daemon exited cleanly.
    Clean,
    /// The pipe closed without the clean-exit byte: the daemon died.
    Died,
}

/// Block on `pipe` until the daemon exits; pure apart from the read.
pub fn wait_for_daemon(mut pipe: impl io::Read) -> Ended {
    let mut byte = [0u8; 1];
    loop {
        match pipe.read(&mut byte) {
            Ok(0) => return Ended::Died,
            Ok(_) if byte[0] == CLEAN_EXIT => return Ended::Clean,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Ended::Died,
        }
    }
}

/// `kvpn-dataplane --dns-guard`: wait on stdin for the daemon (the parent) to
/// go; if it died, repair its DNS and leave a [`Note`].
pub fn run(runtime_dir: &Path, dns: &super::Dns) {
    let daemon_pid = std::os::unix::process::parent_id();
    let guard_pid = std::process::id();
    let ended = wait_for_daemon(io::stdin().lock());
    let t0 = std::time::Instant::now();
    let pid_file = runtime_dir.join(PID_NAME);
    if ended == Ended::Clean {
        return;
    }
    // A new daemon already serves (it repaired at its start and may have
    // written resolv.conf again): leave it alone.
    let socket = runtime_dir.join(crate::daemon::SOCKET_NAME);
    let own_pid_file_gone = std::fs::read_to_string(runtime_dir.join(crate::daemon::PID_NAME))
        .ok()
        .and_then(|p| p.trim().parse::<u32>().ok())
        .is_some_and(|p| p != daemon_pid);
    if own_pid_file_gone && std::os::unix::net::UnixStream::connect(&socket).is_ok() {
        tracing::info!(
            daemon_pid,
            "the root daemon died, but a new one serves already; the DNS guard leaves DNS to it"
        );
        let _ = std::fs::remove_file(&pid_file);
        return;
    }
    let outcome = |r: Result<super::resolv_conf::Restored, super::DnsError>| match r {
        Ok(super::resolv_conf::Restored::Original) => "restored".to_owned(),
        Ok(super::resolv_conf::Restored::KeptOthers) => "kept_others".to_owned(),
        Ok(super::resolv_conf::Restored::NothingToDo) => "nothing_to_do".to_owned(),
        Err(e) => format!("failed: {e}"),
    };
    let resolv_conf_outcome = outcome(dns.repair());
    let repaired_after_ms = u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX);
    let hosts_outcome = outcome(dns.repair_hosts());
    let _ = std::fs::remove_file(&pid_file);
    if resolv_conf_outcome == "nothing_to_do" && hosts_outcome == "nothing_to_do" {
        tracing::info!(
            daemon_pid,
            "the root daemon died; the DNS guard found nothing of kvpn's in resolv.conf or the hosts file"
        );
        return;
    }
    let note = Note {
        daemon_pid,
        guard_pid,
        died_at_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        repaired_after_ms,
        resolv_conf: dns.settings().resolv_conf.clone(),
        resolv_conf_outcome,
        hosts_outcome,
    };
    if note.resolv_conf_outcome.starts_with("failed") {
        tracing::error!(hosts = %note.hosts_outcome, "{}", note.describe());
    } else {
        tracing::warn!(hosts = %note.hosts_outcome, "{}", note.describe());
    }
    let path = Note::path(runtime_dir);
    if let Ok(bytes) = serde_json::to_vec(&note)
        && let Err(e) = std::fs::write(&path, bytes)
    {
        tracing::warn!(path = %path.display(), error = %e, "cannot write the DNS guard's note");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pipe_tells_a_clean_exit_from_a_death() {
        assert_eq!(wait_for_daemon(&b""[..]), Ended::Died);
        assert_eq!(wait_for_daemon(&b"Q"[..]), Ended::Clean);
        assert_eq!(wait_for_daemon(&b"xQ"[..]), Ended::Clean);
        assert_eq!(wait_for_daemon(&b"xy"[..]), Ended::Died);
        // A real pipe: the write end dropped without the byte is a death.
        let (r, w) = io::pipe().expect("pipe");
        drop(w);
        assert_eq!(wait_for_daemon(r), Ended::Died);
        let (r, mut w) = io::pipe().expect("pipe");
        w.write_all(b"Q").expect("write");
        drop(w);
        assert_eq!(wait_for_daemon(r), Ended::Clean);
    }

    #[test]
    fn the_note_round_trips_and_says_what_happened() {
        let note = Note {
            daemon_pid: 42,
            guard_pid: 43,
            died_at_unix: 1,
            repaired_after_ms: 3,
            resolv_conf: "/etc/resolv.conf".into(),
            resolv_conf_outcome: "restored".into(),
            hosts_outcome: "nothing_to_do".into(),
        };
        let back: Note =
            serde_json::from_slice(&serde_json::to_vec(&note).expect("json")).expect("parse");
        assert_eq!(back, note);
        let text = note.describe();
        assert!(
            text.contains("pid 42") && text.contains("restored /etc/resolv.conf 3 ms later"),
            "{text}"
        );
        let failed = Note {
            resolv_conf_outcome: "failed: read-only file system".into(),
            ..note
        };
        assert!(failed.describe().contains("run `kvpn quit`"));
    }
}
