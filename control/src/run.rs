//! `kvpn run -- CMD`: one command (and its children) reaches a cluster, nothing
//! else on the laptop does (issue 27; docs/run.md).
//!
//! The CLI connects as `kvpn connect` does, asking for a process-scoped session
//! (its own TUN device, routing table, cgroup and DNS forwarder in the root
//! daemon; [`crate::connect::Scope::Run`]), forks the command held on a pipe,
//! asks the user daemon to put it into the session's cgroup (`HoldRun`, which
//! goes to the root daemon's `AdmitToRun`, checked against the caller's uid),
//! then lets it exec. kvpn forwards SIGINT, SIGTERM, SIGHUP and SIGQUIT to it
//! and exits with its status (128 + signal number when a signal ended it). When
//! the command ends, the session is disconnected; when kvpn itself is killed,
//! its `HoldRun` call breaks and the user daemon disconnects the session, and
//! the root daemon kills whatever is left in the cgroup.
//!
//! I/O: fork/exec, a pipe, signals, gRPC to the user daemon.

use std::ffi::{CString, OsString};
use std::os::fd::{AsRawFd as _, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use nix::sys::signal::Signal;
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::{ForkResult, Pid};
use tokio::signal::unix::{SignalKind, signal};

pub use kvpn_exec::{EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND, NotRunnable, find_program};

/// Exit status of `kvpn run` when kvpn itself failed (bad flags, no command,
/// cannot connect, a daemon error) and the command did not run, as `docker
/// run`, `podman run` and `env` use it: a command's own status 1 stays the
/// command's. 126 and 127 keep a shell's meaning (command not executable, not
/// found); anything else is the command's.
pub const EXIT_RUN_FAILED: i32 = 125;

use crate::cli::RunArgs;
use crate::connect::{self, Scope};
use crate::{daemon, liveness, output, userd};

/// The exit status kvpn reports for `status` (pure): the code, or 128 + the
/// signal number, as shells report them.
pub fn exit_code(status: WaitStatus) -> Option<i32> {
    match status {
        WaitStatus::Exited(_, code) => Some(code),
        WaitStatus::Signaled(_, sig, _) => Some(128 + sig as i32),
        _ => None,
    }
}

/// The forked command, waiting on its pipe for the go-ahead.
struct Held {
    pid: Pid,
    go: Option<OwnedFd>,
}

impl Held {
    /// Fork; the child waits for one byte on a pipe, then execs `command`
    /// (`program` resolved already). Everything the child needs is prepared
    /// before the fork: after it, the child only calls read, execv, write and
    /// _exit (async-signal-safe; this process has threads).
    fn fork(program: &Path, command: &[OsString]) -> Result<Held> {
        let program_c = CString::new(program.as_os_str().as_bytes())
            .context("the command's path contains a NUL byte")?;
        let args_c: Vec<CString> = command
            .iter()
            .map(|a| CString::new(a.as_bytes()))
            .collect::<Result<_, _>>()
            .context("an argument of the command contains a NUL byte")?;
        let mut argv: Vec<*const libc::c_char> = args_c.iter().map(|a| a.as_ptr()).collect();
        argv.push(std::ptr::null());
        let failed = format!(
            "kvpn run: cannot execute {}\n",
            program.as_os_str().to_string_lossy()
        );
        let (read_end, write_end) = nix::unistd::pipe().context("cannot create a pipe")?;
        // SAFETY: the child calls only async-signal-safe functions (read, execv,
        // write, _exit) on memory prepared before the fork, then execs or exits.
        match unsafe { nix::unistd::fork() }.context("cannot fork")? {
            ForkResult::Child => {
                let fd = read_end.as_raw_fd();
                let mut byte = 0u8;
                // SAFETY: plain syscalls on a valid fd and valid buffers.
                unsafe {
                    libc::close(write_end.as_raw_fd());
                    let n = libc::read(fd, (&raw mut byte).cast(), 1);
                    if n != 1 {
                        // kvpn gave up (admission failed, or it died): do not run.
                        libc::_exit(EXIT_NOT_EXECUTABLE);
                    }
                    libc::close(fd);
                    libc::execv(program_c.as_ptr(), argv.as_ptr());
                    let errno = *libc::__errno_location();
                    libc::write(2, failed.as_ptr().cast(), failed.len());
                    libc::_exit(if errno == libc::ENOENT {
                        EXIT_NOT_FOUND
                    } else {
                        EXIT_NOT_EXECUTABLE
                    });
                }
            }
            ForkResult::Parent { child } => {
                drop(read_end);
                Ok(Held {
                    pid: child,
                    go: Some(write_end),
                })
            }
        }
    }

    /// Let the command exec.
    fn release(&mut self) -> Result<()> {
        let fd = self.go.take().context("the command was released already")?;
        nix::unistd::write(&fd, &[1]).context("cannot signal the held command")?;
        Ok(())
    }

    /// Stop a command that never ran (closing the pipe makes it exit) and reap it.
    fn abandon(mut self) {
        drop(self.go.take());
        let _ = nix::sys::signal::kill(self.pid, Signal::SIGKILL);
        let _ = waitpid(self.pid, None);
    }
}

/// `kvpn run`: the command's exit status.
pub async fn run(runtime_dir: &Path, args: RunArgs) -> Result<i32> {
    let Some(first) = args.command.first() else {
        bail!(
            "no command given — put it after `--`, e.g. `kvpn run --context staging -- curl \
             http://web.default`"
        );
    };
    let Some(first_str) = first.to_str() else {
        bail!("the command's name {first:?} is not UTF-8 — rename it or use a link");
    };
    let program = match find_program(first_str, std::env::var_os("PATH").as_deref()) {
        Ok(p) => p,
        Err(e) => {
            output::error(&format!("kvpn run: {e} (nothing was connected)"));
            return Ok(e.exit_code());
        }
    };
    if args.connect.manager.is_some() {
        bail!(
            "kvpn run works through the Kubernetes API (--kubeconfig, --context), not with \
             --manager"
        );
    }
    output::progress_to_stderr();
    liveness::check_before_connect(&daemon::pid_path(runtime_dir)).map_err(anyhow::Error::msg)?;
    let Some(session_id) = connect::kube_connect_as(runtime_dir, &args.connect, Scope::Run).await?
    else {
        bail!("internal error: a run session was not created");
    };
    let mut user = userd::connect_or_start(runtime_dir).await?;
    let result = run_in(&mut user, &session_id, &program, &args.command).await;
    let result = match result {
        // Ended from outside: there is nothing left to disconnect.
        Ok((code, true)) => return Ok(code),
        Ok((code, false)) => Ok(code),
        Err(e) => Err(e),
    };
    // The normal end: the session goes with the command, before kvpn exits.
    if let Err(e) = user
        .disconnect(kvpn_proto::userd::DisconnectRequest {
            session_id: session_id.clone(),
        })
        .await
        && e.code() != tonic::Code::NotFound
    {
        output::warn(&format!(
            "cannot disconnect run session {session_id}: {} — `kvpn disconnect {session_id}` ends it",
            e.message()
        ));
    }
    result
}

async fn run_in(
    user: &mut kvpn_proto::userd::user_daemon_client::UserDaemonClient<
        crate::daemon_channel::DaemonChannel,
    >,
    session_id: &str,
    program: &Path,
    command: &[OsString],
) -> Result<(i32, bool)> {
    // Watch the signals before the command exists, so none is lost.
    let mut sigint = signal(SignalKind::interrupt()).context("cannot watch SIGINT")?;
    let mut sigterm = signal(SignalKind::terminate()).context("cannot watch SIGTERM")?;
    let mut sighup = signal(SignalKind::hangup()).context("cannot watch SIGHUP")?;
    let mut sigquit = signal(SignalKind::quit()).context("cannot watch SIGQUIT")?;
    let mut held = Held::fork(program, command)?;
    let pid = u32::try_from(held.pid.as_raw()).unwrap_or_default();
    // The call stays open while the command runs: it holds the session.
    let admitted = user
        .hold_run(kvpn_proto::userd::HoldRunRequest {
            session_id: session_id.to_owned(),
            pid,
        })
        .await;
    let mut hold = match admitted {
        Ok(stream) => stream.into_inner(),
        Err(e) => {
            held.abandon();
            return Err(daemon::status_to_error(e))
                .context("cannot put the command into the run's cgroup");
        }
    };
    match hold.message().await {
        Ok(Some(event)) => {
            tracing::debug!(cgroup = %event.admitted_cgroup, pid, "command admitted")
        }
        Ok(None) => {
            held.abandon();
            bail!("the user daemon ended the run before admitting the command");
        }
        Err(e) => {
            held.abandon();
            return Err(daemon::status_to_error(e))
                .context("cannot put the command into the run's cgroup");
        }
    }
    held.release()?;
    let child = held.pid;
    let mut wait = tokio::task::spawn_blocking(move || {
        loop {
            match waitpid(child, None) {
                Ok(status) => {
                    if let Some(code) = exit_code(status) {
                        return Ok(code);
                    }
                }
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(e),
            }
        }
    });
    // Whether the session ended from outside while the command ran (the user
    // daemon said so, or went away): then kvpn has nothing to disconnect.
    let mut ended_outside = false;
    let mut hold_open = true;
    loop {
        let forward = tokio::select! {
            r = &mut wait => {
                let code = r.context("the wait for the command failed")?
                    .context("cannot wait for the command")?;
                // A command stopped by a signal as its session ended: the why may
                // still be on its way (the root daemon stops the command while
                // the user daemon's disconnect runs).
                if hold_open && !ended_outside && code >= 128
                    && let Ok(m) = tokio::time::timeout(Duration::from_millis(500), hold.message()).await
                {
                    ended_outside = said_ended(m);
                }
                drop(hold);
                return Ok((code, ended_outside));
            }
            m = hold.message(), if hold_open => {
                if matches!(m, Ok(None) | Err(_)) {
                    hold_open = false;
                }
                if !ended_outside {
                    ended_outside = said_ended(m);
                }
                continue;
            }
            _ = sigint.recv() => Signal::SIGINT,
            _ = sigterm.recv() => Signal::SIGTERM,
            _ = sighup.recv() => Signal::SIGHUP,
            _ = sigquit.recv() => Signal::SIGQUIT,
        };
        tracing::debug!(signal = ?forward, pid, "forwarding a signal to the command");
        let _ = nix::sys::signal::kill(child, forward);
    }
}

/// Says on stderr why a run's session ended while its command ran, from one
/// message of the user daemon's hold; whether it ended.
fn said_ended(m: Result<Option<kvpn_proto::userd::HoldRunEvent>, tonic::Status>) -> bool {
    match m {
        Ok(Some(e)) if !e.ended.is_empty() => {
            output::warn(&format!("kvpn run: {}", e.ended));
            true
        }
        Ok(Some(_)) => false,
        Ok(None) | Err(_) => {
            output::warn(
                "kvpn run: the user daemon stopped holding this run (`kvpn quit`, `kvpn lab \
                 down` or a crash; `kvpn logs` shows which): its session ends and the root \
                 daemon stops the command",
            );
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_are_the_status_or_128_plus_the_signal() {
        let pid = Pid::from_raw(1);
        assert_eq!(exit_code(WaitStatus::Exited(pid, 3)), Some(3));
        assert_eq!(
            exit_code(WaitStatus::Signaled(pid, Signal::SIGTERM, false)),
            Some(143)
        );
        assert_eq!(exit_code(WaitStatus::StillAlive), None);
    }
}
