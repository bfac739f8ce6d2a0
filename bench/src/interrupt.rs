//! Stopping the bench on SIGINT, SIGTERM or SIGHUP with everything it made torn
//! down: the labs (netns, /etc/netns entries, lab folders, servers and whatever
//! else runs in their netns, such as kvpn's daemons and socat's forks), the kvpn
//! sessions (`kvpn quit`) and the tools it is running.
//!
//! The signal only sets a flag ([`received`]); a thread of its own watches for
//! the signals (tokio's signal streams, already in the bench's dependencies; the
//! handler itself only wakes that thread, so nothing here runs in a signal
//! handler). The bench's steps look at the flag: [`check`] between steps,
//! [`sleep`] in waits, and [`output`] / [`wait`] while a tool runs, which kill
//! that tool (its own child, not yet reaped, so the pid cannot be another
//! process's) and return [`Interrupted`]. The error unwinds the bench like any
//! failed step, so the labs' own teardown (`Lab::down` and its `Drop`) and the
//! `kvpn quit` after each row run, and `main` exits with 128 + the signal's
//! number. Cleanup commands (`kvpn quit`, stopping lab processes) do not look at
//! the flag: they run after an interrupt too.
//!
//! A terminal's Ctrl-C also reaches the tools the bench runs in its own process
//! group (iperf3, ping, the kvpn CLI); the lab's processes have process groups
//! of their own (kvpn_lab::process) and are stopped by the teardown, never by
//! the terminal.

use std::io::Read;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// The first signal received (its number), 0 while none was.
static RECEIVED: AtomicI32 = AtomicI32::new(0);

/// The signals the bench stops on.
pub const SIGNALS: [i32; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// A step stopped because the bench received `signal`. `lab`: the lab that was
/// up then and has been torn down since (set by the lab's runner after its
/// teardown succeeded, see [`after_teardown`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interrupted {
    pub signal: i32,
    pub lab: Option<String>,
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.lab {
            Some(lab) => write!(f, "interrupted: lab {lab} removed ({})", name(self.signal)),
            None => write!(f, "interrupted ({})", name(self.signal)),
        }
    }
}

impl std::error::Error for Interrupted {}

/// The signal's name for messages.
pub fn name(signal: i32) -> &'static str {
    match signal {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        libc::SIGHUP => "SIGHUP",
        _ => "a signal",
    }
}

/// The exit status of a run stopped by `signal`: 128 + its number, as a shell
/// reports a command killed by it (130 for SIGINT, 143 for SIGTERM, 129 for
/// SIGHUP), so scripts tell an interrupt from a failure.
pub fn exit_code(signal: i32) -> i32 {
    128 + signal
}

/// Starts the thread that watches for [`SIGNALS`]; returns once they are
/// watched (a signal right after this call is caught, not fatal).
pub fn watch() -> Result<()> {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<std::io::Result<()>>();
    std::thread::Builder::new()
        .name("kvpn-bench-signals".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            runtime.block_on(async move {
                use tokio::signal::unix::{SignalKind, signal};
                let mut streams = Vec::new();
                for n in SIGNALS {
                    match signal(SignalKind::from_raw(n)) {
                        Ok(s) => streams.push((n, s)),
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    }
                }
                let _ = ready_tx.send(Ok(()));
                let [(int_n, int), (term_n, term), (hup_n, hup)] = &mut streams[..] else {
                    return;
                };
                loop {
                    let n = tokio::select! {
                        _ = int.recv() => *int_n,
                        _ = term.recv() => *term_n,
                        _ = hup.recv() => *hup_n,
                    };
                    record(n);
                }
            });
        })
        .context("cannot start the thread that watches for SIGINT/SIGTERM/SIGHUP")?;
    ready_rx
        .recv()
        .context("the signal-watching thread ended before it watched")?
        .context("cannot watch for SIGINT/SIGTERM/SIGHUP")
}

/// Records `signal`; the first one counts, later ones only say that the
/// teardown is still running (it must finish: a second Ctrl-C does not abandon
/// the lab).
fn record(signal: i32) {
    match RECEIVED.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst) {
        Ok(_) => eprintln!(
            "kvpn-bench: {}: stopping the run and tearing down what it made",
            name(signal)
        ),
        Err(_) => eprintln!(
            "kvpn-bench: {} again: still tearing down (the lab would be left behind \
             otherwise)",
            name(signal)
        ),
    }
}

/// The signal the bench received, if any.
pub fn received() -> Option<i32> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        n => Some(n),
    }
}

/// `Err(Interrupted)` once a signal arrived.
pub fn check() -> Result<(), Interrupted> {
    match received() {
        Some(signal) => Err(Interrupted { signal, lab: None }),
        None => Ok(()),
    }
}

/// Sleeps `d`, or less if a signal arrives (then `Err`).
pub fn sleep(d: Duration) -> Result<(), Interrupted> {
    let end = Instant::now() + d;
    loop {
        check()?;
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(());
        }
        std::thread::sleep(left.min(POLL_MAX));
    }
}

/// The longest a wait goes without looking at the flag. 10 ms: a tool's exit is
/// seen at most this late, which is also the error it adds to a timed step such
/// as `kvpn connect`'s wall time (reported in 1/100 s).
const POLL_MAX: Duration = Duration::from_millis(10);

/// Runs `cmd` to completion like [`Command::output`] (stdin from /dev/null,
/// stdout and stderr captured), unless a signal arrives first: then the tool is
/// killed and the result is [`Interrupted`].
pub fn output(cmd: &mut Command) -> Result<Output> {
    check()?;
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {cmd:?}"))?;
    wait(child)
}

/// Waits for `child` and collects what it wrote to piped stdout/stderr (like
/// [`Child::wait_with_output`]); if a signal arrives first, kills it (SIGKILL to
/// this process's own unreaped child) and returns [`Interrupted`].
pub fn wait(child: Child) -> Result<Output> {
    match wait_unless(child, || received().is_some())? {
        Some(output) => Ok(output),
        None => Err(check()
            .err()
            .map_or_else(|| anyhow::anyhow!("interrupted"), anyhow::Error::new)),
    }
}

/// Reads a child's pipe to its end on a thread of its own (so a chatty tool
/// never blocks on a full pipe while the caller polls).
fn drain<R: Read + Send + 'static>(pipe: Option<R>) -> Option<JoinHandle<Vec<u8>>> {
    pipe.map(|mut p| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = p.read_to_end(&mut buf);
            buf
        })
    })
}

/// [`wait`] with the flag as `stop`: the output, or `None` after killing the
/// child because `stop()` turned true. Polls with a backoff from 1 ms to
/// [`POLL_MAX`]: a short tool is seen at once, a long one costs 100 wake-ups
/// a second.
fn wait_unless(mut child: Child, stop: impl Fn() -> bool) -> Result<Option<Output>> {
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let mut pause = Duration::from_millis(1);
    let status = loop {
        if let Some(status) = child.try_wait().context("waiting for a tool")? {
            break Some(status);
        }
        if stop() {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(POLL_MAX);
    };
    let join = |t: Option<JoinHandle<Vec<u8>>>| {
        t.map(|t| t.join().unwrap_or_default()).unwrap_or_default()
    };
    let (stdout, stderr) = (join(stdout), join(stderr));
    Ok(status.map(|status| Output {
        status,
        stdout,
        stderr,
    }))
}

/// The end of a lab's run: `result` as it was, unless a signal arrived, then
/// [`Interrupted`] naming `lab`, which the caller has torn down by now (the
/// step's own error, a tool killed by the signal, is a consequence, not news).
pub fn after_teardown<T>(result: Result<T>, lab: &str) -> Result<T> {
    match (result, received()) {
        (Err(_), Some(signal)) => Err(anyhow::Error::new(Interrupted {
            signal,
            lab: Some(lab.to_owned()),
        })),
        (r, _) => r,
    }
}

/// The interruption behind `e`, if it is one.
pub fn of(e: &anyhow::Error) -> Option<&Interrupted> {
    e.downcast_ref::<Interrupted>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_are_the_shells() {
        assert_eq!(exit_code(libc::SIGINT), 130);
        assert_eq!(exit_code(libc::SIGTERM), 143);
        assert_eq!(exit_code(libc::SIGHUP), 129);
    }

    #[test]
    fn the_message_names_the_removed_lab() {
        let e = Interrupted {
            signal: libc::SIGINT,
            lab: Some("kvpn-1a2b3".into()),
        };
        assert_eq!(
            e.to_string(),
            "interrupted: lab kvpn-1a2b3 removed (SIGINT)"
        );
        let e = anyhow::Error::new(e.clone()).context("plain lab");
        assert_eq!(
            of(&e),
            Some(&Interrupted {
                signal: libc::SIGINT,
                lab: Some("kvpn-1a2b3".into())
            })
        );
        let none = Interrupted {
            signal: libc::SIGTERM,
            lab: None,
        };
        assert_eq!(none.to_string(), "interrupted (SIGTERM)");
    }

    #[test]
    fn output_runs_a_tool_while_no_signal_came() {
        // The flag is process-wide: this test binary never sets it.
        let out = output(Command::new("sh").args(["-c", "echo out; echo err >&2; exit 3"]))
            .expect("sh runs");
        assert_eq!(out.status.code(), Some(3));
        assert_eq!(out.stdout, b"out\n");
        assert_eq!(out.stderr, b"err\n");
        assert!(sleep(Duration::from_millis(5)).is_ok());
    }

    #[test]
    fn a_stop_kills_the_running_tool_at_once() {
        let child = Command::new("sleep")
            .arg("30")
            .stdout(Stdio::piped())
            .spawn()
            .expect("sleep runs");
        let pid = child.id();
        let t0 = Instant::now();
        let stop_at = t0 + Duration::from_millis(100);
        let out = wait_unless(child, || Instant::now() >= stop_at).expect("wait");
        assert!(out.is_none(), "the stop was not seen: {out:?}");
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "the tool was not killed at once: {:?}",
            t0.elapsed()
        );
        // Killed and reaped: its pid is gone (or, at worst, another process's).
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        assert!(!stat.contains("(sleep)"), "sleep {pid} still runs: {stat}");
    }
}
