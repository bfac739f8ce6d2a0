//! The laptop's terminal side of `kvpn ssh`: raw mode on the local tty (restored
//! by a guard on every way out: normal exit, error, panic unwinding, and the
//! SIGTERM/SIGHUP/SIGINT/SIGQUIT that `kvpn ssh` turns into an orderly exit), the
//! window size for the pty request and on SIGWINCH (a `window-change` request),
//! and the relay of one SSH `session` channel: stdin to the channel, channel data
//! to stdout, extended data (stderr) to stderr, until the remote side reports its
//! exit status or signal and closes.
//!
//! Pure parts: [`signal_number`] and [`Ending::exit_code`]. I/O: the tty (termios,
//! TIOCGWINSZ), stdin (a blocking reader thread: the tty is shared with the parent
//! shell, so it is never switched to non-blocking), stdout/stderr, signals.

use std::io::Read as _;
use std::os::fd::{AsFd as _, BorrowedFd};

use nix::sys::termios::{self, SetArg, Termios};
use russh::client::Msg;
use russh::{Channel, ChannelMsg, Sig};
use tokio::io::AsyncWriteExt as _;
use tokio::signal::unix::{SignalKind, signal};
use tracing::debug;

/// The local tty in raw mode; dropping it puts the saved settings back.
pub struct RawMode {
    saved: Termios,
}

impl RawMode {
    /// Switches stdin's tty to raw mode (no echo, no line editing, no signals from
    /// keys, no output processing: the remote pty does all that). `None` when stdin
    /// is not a tty.
    pub fn enter() -> Option<Self> {
        let stdin = std::io::stdin();
        let fd = stdin.as_fd();
        let saved = termios::tcgetattr(fd).ok()?;
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        if let Err(e) = termios::tcsetattr(fd, SetArg::TCSADRAIN, &raw) {
            debug!("cannot switch the terminal to raw mode: {e}");
            return None;
        }
        Some(RawMode { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let stdin = std::io::stdin();
        let _ = termios::tcsetattr(stdin.as_fd(), SetArg::TCSADRAIN, &self.saved);
    }
}

/// Whether stdin is a terminal.
pub fn stdin_is_tty() -> bool {
    std::io::IsTerminal::is_terminal(&std::io::stdin())
}

/// The window size of the tty on `fd`: (columns, rows, width px, height px).
fn window_size_of(fd: BorrowedFd<'_>) -> Option<(u32, u32, u32, u32)> {
    use std::os::fd::AsRawFd as _;
    let mut ws = libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes one `struct winsize` to the pointer, which points at
    // a live, correctly typed local; the fd is borrowed for the call.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCGWINSZ, &mut ws) };
    (rc == 0 && ws.ws_col > 0 && ws.ws_row > 0).then_some((
        u32::from(ws.ws_col),
        u32::from(ws.ws_row),
        u32::from(ws.ws_xpixel),
        u32::from(ws.ws_ypixel),
    ))
}

/// The window size of the local terminal (stdin, else stdout), or 80x24.
pub fn window_size() -> (u32, u32, u32, u32) {
    window_size_of(std::io::stdin().as_fd())
        .or_else(|| window_size_of(std::io::stdout().as_fd()))
        .unwrap_or((80, 24, 0, 0))
}

/// The Linux number of an SSH signal name (RFC 4254 §6.10 names, without "SIG").
pub fn signal_number(sig: &Sig) -> Option<i32> {
    Some(match sig {
        Sig::ABRT => libc::SIGABRT,
        Sig::ALRM => libc::SIGALRM,
        Sig::FPE => libc::SIGFPE,
        Sig::HUP => libc::SIGHUP,
        Sig::ILL => libc::SIGILL,
        Sig::INT => libc::SIGINT,
        Sig::KILL => libc::SIGKILL,
        Sig::PIPE => libc::SIGPIPE,
        Sig::QUIT => libc::SIGQUIT,
        Sig::SEGV => libc::SIGSEGV,
        Sig::TERM => libc::SIGTERM,
        Sig::USR1 => libc::SIGUSR1,
        Sig::Custom(name) => match name.trim_start_matches("SIG") {
            "USR2" => libc::SIGUSR2,
            "BUS" => libc::SIGBUS,
            "TRAP" => libc::SIGTRAP,
            "SYS" => libc::SIGSYS,
            "XCPU" => libc::SIGXCPU,
            "XFSZ" => libc::SIGXFSZ,
            "VTALRM" => libc::SIGVTALRM,
            "PROF" => libc::SIGPROF,
            "STOP" => libc::SIGSTOP,
            "TSTP" => libc::SIGTSTP,
            "TTIN" => libc::SIGTTIN,
            "TTOU" => libc::SIGTTOU,
            "CONT" => libc::SIGCONT,
            "CHLD" => libc::SIGCHLD,
            "WINCH" => libc::SIGWINCH,
            "URG" => libc::SIGURG,
            "IO" | "POLL" => libc::SIGIO,
            "PWR" => libc::SIGPWR,
            _ => return None,
        },
    })
}

/// How a remote session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// The remote command exited with this status.
    Status(u32),
    /// The remote command was killed by a signal (its number, when known).
    Signal { name: String, number: Option<i32> },
    /// The channel closed without an exit status (connection lost, server quirk).
    NoStatus,
    /// `kvpn ssh` itself got this signal and stopped the session.
    Local(i32),
}

impl Ending {
    /// The exit code of `kvpn ssh`: the remote status (low 8 bits, as a shell sees
    /// it), 128+n for a signal, 255 when no status came (like OpenSSH's ssh).
    pub fn exit_code(&self) -> i32 {
        match self {
            Ending::Status(s) => (s & 0xff) as i32,
            Ending::Signal {
                number: Some(n), ..
            } => 128 + n,
            Ending::Signal { number: None, .. } | Ending::NoStatus => 255,
            Ending::Local(n) => 128 + n,
        }
    }
}

/// A channel request whose reply (`want_reply`) is outstanding, in sending order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// pty-req: a refusal is a warning, the session goes on without a pty.
    Pty,
    /// shell or exec: a refusal ends the session.
    Start,
}

/// Why the relay stopped early.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("the SSH server refused to start the shell or command")]
    Refused,
    #[error("SSH channel: {0}")]
    Ssh(#[from] russh::Error),
}

/// Relays `channel` (a shell or command already requested, with replies `pending`)
/// until it closes. `pty`: the session has a remote pty (window changes are sent
/// on SIGWINCH). The caller holds [`RawMode`] when stdin is a tty.
pub async fn relay(
    channel: Channel<Msg>,
    pty: bool,
    mut pending: std::collections::VecDeque<Request>,
) -> Result<Ending, RelayError> {
    let (mut read_half, write_half) = channel.split();
    let mut stdin_rx = Some(spawn_stdin_reader());
    let mut winch = signal(SignalKind::window_change()).ok();
    let mut term = signal(SignalKind::terminate()).ok();
    let mut hup = signal(SignalKind::hangup()).ok();
    let mut int = signal(SignalKind::interrupt()).ok();
    let mut quit = signal(SignalKind::quit()).ok();
    let mut stdout = tokio::io::stdout();
    let mut stderr = tokio::io::stderr();
    let mut ending: Option<Ending> = None;
    let mut last_size = pty.then(window_size);
    loop {
        tokio::select! {
            msg = read_half.wait() => {
                let Some(msg) = msg else { break };
                match msg {
                    ChannelMsg::Data { data } => {
                        // A closed stdout (`kvpn ssh … | head`) just stops the output.
                        let _ = stdout.write_all(&data).await;
                        let _ = stdout.flush().await;
                    }
                    ChannelMsg::ExtendedData { data, .. } => {
                        let _ = stderr.write_all(&data).await;
                        let _ = stderr.flush().await;
                    }
                    ChannelMsg::ExitStatus { exit_status } => {
                        ending = Some(Ending::Status(exit_status));
                    }
                    ChannelMsg::ExitSignal { signal_name, .. } => {
                        let number = signal_number(&signal_name);
                        ending = Some(Ending::Signal { name: format!("{signal_name:?}"), number });
                    }
                    ChannelMsg::Success => { pending.pop_front(); }
                    ChannelMsg::Failure => match pending.pop_front() {
                        Some(Request::Pty) => {
                            tracing::warn!("the SSH server refused the pty request; continuing without one");
                        }
                        _ => return Err(RelayError::Refused),
                    },
                    ChannelMsg::Eof => debug!("remote sent EOF"),
                    ChannelMsg::Close => break,
                    other => debug!("channel message ignored: {other:?}"),
                }
            }
            input = recv_opt(&mut stdin_rx) => match input {
                Some(bytes) => write_half.data(&bytes[..]).await?,
                None => {
                    // Local stdin closed: tell the remote side (a command reading
                    // stdin sees EOF); keep reading its output.
                    stdin_rx = None;
                    write_half.eof().await?;
                }
            },
            Some(()) = recv_signal(&mut winch) => {
                let size = window_size();
                if pty && last_size != Some(size) {
                    last_size = Some(size);
                    debug!(cols = size.0, rows = size.1, "window changed");
                    write_half.window_change(size.0, size.1, size.2, size.3).await?;
                }
            }
            Some(()) = recv_signal(&mut term) => return Ok(Ending::Local(libc::SIGTERM)),
            Some(()) = recv_signal(&mut hup) => return Ok(Ending::Local(libc::SIGHUP)),
            Some(()) = recv_signal(&mut int) => return Ok(Ending::Local(libc::SIGINT)),
            Some(()) = recv_signal(&mut quit) => return Ok(Ending::Local(libc::SIGQUIT)),
        }
    }
    let _ = stdout.flush().await;
    Ok(ending.unwrap_or(Ending::NoStatus))
}

async fn recv_opt(rx: &mut Option<tokio::sync::mpsc::Receiver<Vec<u8>>>) -> Option<Vec<u8>> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

async fn recv_signal(s: &mut Option<tokio::signal::unix::Signal>) -> Option<()> {
    match s {
        Some(s) => s.recv().await,
        None => std::future::pending().await,
    }
}

/// Reads stdin on a plain thread (blocking reads on the tty, which stays in
/// blocking mode for the other processes sharing it) and hands chunks over; the
/// channel closes at EOF. The thread is left blocked in `read` when the session
/// ends first; the process exits right after.
fn spawn_stdin_reader() -> tokio::sync::mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Vec<u8>>(16);
    let spawned = std::thread::Builder::new()
        .name("kvpn-ssh-stdin".into())
        .spawn(move || {
            let mut stdin = std::io::stdin().lock();
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) => return,
                    Ok(n) => {
                        if tx.blocking_send(buf[..n].to_vec()).is_err() {
                            return;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => return,
                }
            }
        });
    if let Err(e) = spawned {
        // Without the thread the sender is gone: the remote side sees EOF.
        debug!("cannot start the stdin reader: {e}");
    }
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_shell() {
        assert_eq!(Ending::Status(0).exit_code(), 0);
        assert_eq!(Ending::Status(7).exit_code(), 7);
        assert_eq!(Ending::Status(256 + 3).exit_code(), 3);
        let term = Ending::Signal {
            name: "TERM".into(),
            number: signal_number(&Sig::TERM),
        };
        assert_eq!(term.exit_code(), 143);
        let usr2 = Ending::Signal {
            name: "USR2".into(),
            number: signal_number(&Sig::Custom("USR2".into())),
        };
        assert_eq!(usr2.exit_code(), 128 + 12);
        let odd = Ending::Signal {
            name: "WEIRD".into(),
            number: signal_number(&Sig::Custom("WEIRD".into())),
        };
        assert_eq!(odd.exit_code(), 255);
        assert_eq!(Ending::NoStatus.exit_code(), 255);
        assert_eq!(Ending::Local(libc::SIGHUP).exit_code(), 129);
    }

    #[test]
    fn signal_names_map_to_linux_numbers() {
        assert_eq!(signal_number(&Sig::KILL), Some(9));
        assert_eq!(signal_number(&Sig::INT), Some(2));
        assert_eq!(signal_number(&Sig::Custom("SIGBUS".into())), Some(7));
        assert_eq!(signal_number(&Sig::Custom("".into())), None);
    }
}
