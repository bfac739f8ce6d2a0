//! The gRPC channel of the CLI (and of the user daemon) to one of kvpn's two
//! daemons over its Unix socket, with a bound on how long a daemon may stay
//! silent.
//!
//! A daemon that is stopped (`SIGSTOP`, a debugger, a frozen cgroup) or hung
//! still has its listening socket: the kernel completes the connect into the
//! backlog and takes the request bytes into the socket buffer, so without a
//! bound every call would wait forever with no output. The bound is an HTTP/2
//! keep-alive: while a call is open, a PING goes out after
//! [`KEEPALIVE_INTERVAL`] without a frame from the daemon, and the connection
//! fails when its PONG does not come within [`KEEPALIVE_TIMEOUT`]. The PONG is
//! answered by the daemon's HTTP/2 connection task, not by the handler, so a
//! call that is slow on purpose (a `kvpn connect` that waits for the traffic
//! manager) is not cut short while the daemon runs; only a process that runs
//! no code at all is. Such a failure (and any other failure of the
//! connection) becomes a [`tonic::Status`] that names the daemon, its pid and
//! socket, why, and the fix ([`Daemon::failed`]).
//!
//! A daemon that was just killed is the other trap. Its listening socket
//! belongs to the process's file table, which the kernel closes only late in
//! `exit(2)` — after its memory, TUN devices and netlink sockets, which can
//! take tens of milliseconds. Until then a connect lands in the dying
//! listener's backlog and is reset when it closes (`ECONNRESET`), so "no
//! daemon here" looked like "cannot talk to the daemon". /proc shows the
//! process as running with SIGKILL pending, then as exiting (`PF_EXITING`),
//! and only at the end as a zombie ([`crate::liveness::dying_from`]). So a
//! daemon counts as running only once it has answered: [`open`] makes one
//! call that any kvpn daemon answers at once ([`answer`]). When the
//! connection is lost instead and the pid file names a process that is gone
//! or dying — or a connect is reset, or answered by a dying process — it
//! waits, up to [`DYING_GRACE`], until the socket refuses (nobody listens:
//! the caller starts a new daemon, as for a missing one). A daemon that dies
//! after that, during a real call, is named as such with the fix
//! ([`Daemon::failed`]: run the command again).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::transport::{Channel, Endpoint};

use crate::kubeconfig::error_chain;

/// Silence from the daemon, while a call is open, after which a keep-alive
/// PING is sent.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);

/// How long the daemon has to answer that PING. Generous: a loaded laptop
/// answers a PING in milliseconds; a stopped process never does.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(4);

/// The longest a stopped daemon keeps a call waiting: no frame for the
/// interval, then no PONG for the timeout (6 s). Also the bound on opening
/// the connection.
pub const ANSWER_TIMEOUT: Duration =
    Duration::from_secs(KEEPALIVE_INTERVAL.as_secs() + KEEPALIVE_TIMEOUT.as_secs());

/// How long [`open`] waits for a dying daemon's socket to close.
pub const DYING_GRACE: Duration = Duration::from_secs(3);

/// Which daemon a channel leads to, for its errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `kvpn-dataplane`, root.
    Root,
    /// `kvpn daemon`, the user's own.
    User,
}

/// A daemon: its kind, socket and pid file.
#[derive(Debug, Clone)]
pub struct Daemon {
    kind: Kind,
    socket: PathBuf,
    pid_file: PathBuf,
}

impl Daemon {
    /// The daemon listening on `socket` that writes its pid to `pid_file`.
    pub fn new(kind: Kind, socket: &Path, pid_file: &Path) -> Self {
        Self {
            kind,
            socket: socket.to_path_buf(),
            pid_file: pid_file.to_path_buf(),
        }
    }

    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Root => "root daemon (kvpn-dataplane)",
            Kind::User => "user daemon (kvpn daemon)",
        }
    }

    fn pid(&self) -> Option<i32> {
        crate::liveness::read_pid(&self.pid_file)
    }

    /// Whether the pid file names a process that is on its way out (a
    /// zombie, in its exit teardown, or with a SIGKILL pending:
    /// [`crate::liveness::dying_from`]) and may still hold the listening
    /// socket while its last threads finish.
    fn dying(&self) -> bool {
        self.pid().is_some_and(crate::liveness::dying)
    }

    /// Whether the daemon's process is gone (no pid file, no such process) or
    /// [`Self::dying`]: a lost connection is its end, not a fault of a
    /// running daemon.
    fn going(&self) -> bool {
        match self.pid() {
            None => true,
            Some(pid) => crate::liveness::proc_stat(pid).is_none() || crate::liveness::dying(pid),
        }
    }

    /// The error of a call whose connection failed: `what` is the transport
    /// error's text (with its causes).
    pub fn failed(&self, what: &str) -> tonic::Status {
        let pid = self.pid();
        let state = pid.and_then(process_state);
        tonic::Status::unavailable(message(self, what, pid, state, self.going()))
    }
}

/// The user-facing text of [`Daemon::failed`]; `state` is the process state
/// letter of `/proc/PID/stat` ('T' = stopped); `gone`: the process is gone
/// or dying ([`Daemon::going`]).
fn message(
    daemon: &Daemon,
    what: &str,
    pid: Option<i32>,
    state: Option<char>,
    gone: bool,
) -> String {
    let name = daemon.name();
    let at = match pid {
        Some(p) => format!("pid {p}, socket {}", daemon.socket.display()),
        None => format!("socket {}", daemon.socket.display()),
    };
    let sudo = if daemon.kind == Kind::Root {
        "sudo "
    } else {
        ""
    };
    let pid_arg = pid.map_or_else(|| "<pid>".to_owned(), |p| p.to_string());
    let again = match daemon.kind {
        Kind::Root => "run `kvpn connect` again: it starts a new root daemon",
        Kind::User => "run the kvpn command again: it starts a new user daemon",
    };
    // hyper's KeepAliveTimedOut is private; its text is the only mark.
    if !what.contains("keep-alive") && gone {
        return format!(
            "the {name} ({at}) exited during the call ({what}): it was killed or crashed — \
             `kvpn logs` shows its last lines; {again}"
        );
    }
    if !what.contains("keep-alive") {
        return format!(
            "lost the connection to the {name} ({at}): {what} — `kvpn logs` shows the daemon's side"
        );
    }
    let cause = process_cause(state);
    let restart = match daemon.kind {
        Kind::Root => "the next `kvpn connect` starts a new one",
        Kind::User => "the next kvpn command starts a new one",
    };
    format!(
        "the {name} ({at}) is not answering: no reply within {} s; {cause} — resume it with \
         `{sudo}kill -CONT {pid_arg}`, or end it with `{sudo}kill -CONT {pid_arg}; {sudo}kill {pid_arg}` \
         (a stopped process takes SIGTERM only once continued; {restart})",
        ANSWER_TIMEOUT.as_secs()
    )
}

/// Why a daemon whose process is in `state` (the letter of `/proc/PID/stat`,
/// `None` when unknown) does not answer.
pub fn process_cause(state: Option<char>) -> String {
    match state {
        Some('T' | 't') => "the process is stopped (SIGSTOP or a debugger)".to_owned(),
        Some(s) => format!("the process (state {s}) is hung or overloaded"),
        None => "the process may be stopped or hung".to_owned(),
    }
}

/// The state letter of process `pid` (`/proc/PID/stat`), if it exists.
fn process_state(pid: i32) -> Option<char> {
    crate::liveness::proc_stat(pid).map(|s| s.state)
}

/// A [`Channel`] whose connection failures are [`Daemon::failed`] statuses.
#[derive(Debug, Clone)]
pub struct DaemonChannel {
    inner: Channel,
    daemon: Arc<Daemon>,
    /// Set when the daemon did not answer [`open`]'s probe within the
    /// keep-alive bound (stopped or hung): every call fails at once with
    /// this message, as it would after waiting that bound again.
    silent: Option<Arc<str>>,
}

/// Open a channel to a daemon that answers. Fails at once with the connect
/// error when nobody listens (NotFound, ConnectionRefused) — also once a
/// dying daemon's socket closed (module docs) — and with another error when
/// the connection to a daemon whose process still runs is lost. A daemon
/// that does not answer within [`ANSWER_TIMEOUT`] (stopped, hung) still gives
/// a channel, whose calls fail at once naming it and the fix.
pub async fn open(daemon: Daemon) -> std::io::Result<DaemonChannel> {
    let deadline = tokio::time::Instant::now() + DYING_GRACE;
    loop {
        // Fails fast when nobody listens; tonic's connector would otherwise retry.
        wait_while_dying(&daemon, deadline).await?;
        let inner = connect(&daemon).await?;
        let silent = match answer(inner.clone()).await {
            // A process with a SIGKILL pending may still answer a last call.
            // (Not `going`: a new daemon answers before its pid file is written.)
            Answer::Answered if daemon.dying() && !past(deadline) => None,
            Answer::Answered => {
                return Ok(DaemonChannel {
                    inner,
                    daemon: Arc::new(daemon),
                    silent: None,
                });
            }
            Answer::Silent(why) => {
                let message = daemon.failed(&why).message().into();
                return Ok(DaemonChannel {
                    inner,
                    daemon: Arc::new(daemon),
                    silent: Some(message),
                });
            }
            Answer::Lost(why) => Some(why),
        };
        if let Some(why) = silent {
            // Lost to a process that runs and still listens: a real failure.
            // Lost to one that is gone or dying: wait for its socket to close.
            let listens = UnixStream::connect(&daemon.socket).await.is_ok();
            if (listens && !daemon.going()) || past(deadline) {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionAborted,
                    daemon.failed(&why).message(),
                ));
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn past(deadline: tokio::time::Instant) -> bool {
    tokio::time::Instant::now() >= deadline
}

/// The gRPC connection to `daemon`'s socket (HTTP/2 over a Unix stream),
/// with the keep-alive bound. Opening it proves nothing: the kernel completes
/// a connect into the backlog of any listener, and HTTP/2's handshake does
/// not wait for the daemon's reply ([`answer`] does).
async fn connect(daemon: &Daemon) -> std::io::Result<Channel> {
    let socket = daemon.socket.clone();
    let opened = tokio::time::timeout(ANSWER_TIMEOUT, async move {
        // The URI is required by tonic but unused: the connector dials the socket.
        let endpoint = Endpoint::try_from("http://kvpn-daemon.invalid")
            .map_err(std::io::Error::other)?
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(false)
            .connect_timeout(ANSWER_TIMEOUT);
        endpoint
            .connect_with_connector(tower::service_fn(move |_| {
                let socket = socket.clone();
                async move {
                    Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?))
                }
            }))
            .await
            .map_err(std::io::Error::other)
    })
    .await;
    match opened {
        Ok(r) => r,
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            daemon
                .failed("keep-alive: the connection did not open")
                .message(),
        )),
    }
}

/// What a daemon did with [`answer`]'s call.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    /// It sent a response: its process runs and serves.
    Answered,
    /// No frame within the keep-alive bound: stopped or hung. The text is
    /// the transport error's.
    Silent(String),
    /// The connection failed (reset, closed): the text is the error's.
    Lost(String),
}

/// The path of [`answer`]'s call: a method no daemon serves, which tonic's
/// router answers with UNIMPLEMENTED from the daemon's own process, without
/// a handler, a session lookup or the root daemon's peer credential check.
const PROBE_PATH: &str = "/kvpn.daemon_channel.v1.Probe/Answer";

/// One call on `channel` that any kvpn daemon answers at once: whether a
/// process serves the socket, or the connection is only in the backlog of a
/// listener whose process is dying (module docs).
async fn answer(mut channel: Channel) -> Answer {
    let request = http::Request::builder()
        .method(http::Method::POST)
        .uri(format!("http://kvpn-daemon.invalid{PROBE_PATH}"))
        .header(http::header::CONTENT_TYPE, "application/grpc")
        .header(http::header::TE, "trailers")
        .body(Body::empty());
    let request = match request {
        Ok(r) => r,
        Err(e) => return Answer::Lost(e.to_string()),
    };
    let call = async {
        tower::ServiceExt::ready(&mut channel).await?;
        tower::Service::call(&mut channel, request).await
    };
    // The keep-alive ends a silent call after ANSWER_TIMEOUT; this only
    // backs it up.
    match tokio::time::timeout(ANSWER_TIMEOUT + Duration::from_secs(2), call).await {
        Ok(Ok(_response)) => Answer::Answered,
        Ok(Err(e)) => {
            let why = error_chain(&e);
            // hyper's KeepAliveTimedOut is private; its text is the only mark.
            if why.contains("keep-alive") {
                Answer::Silent(why)
            } else {
                Answer::Lost(why)
            }
        }
        Err(_) => Answer::Silent("keep-alive: no answer".to_owned()),
    }
}

/// Returns once a connect to `daemon`'s socket is neither reset nor made to a
/// dying process (see the module docs), or with the connect's error (NotFound,
/// ConnectionRefused: nobody listens). After `deadline` it returns `Ok` and
/// [`open`] reports whatever the connection then does.
async fn wait_while_dying(daemon: &Daemon, deadline: tokio::time::Instant) -> std::io::Result<()> {
    loop {
        let settled = match UnixStream::connect(&daemon.socket).await {
            Ok(_) => !daemon.dying(),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => false,
            Err(e) => return Err(e),
        };
        if settled || past(deadline) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

type ResponseFuture =
    Pin<Box<dyn Future<Output = Result<http::Response<Body>, tonic::Status>> + Send>>;

impl tower::Service<http::Request<Body>> for DaemonChannel {
    type Response = http::Response<Body>;
    type Error = tonic::Status;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        tower::Service::poll_ready(&mut self.inner, cx)
            .map_err(|e| self.daemon.failed(&error_chain(&e)))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        // Here, not in poll_ready: tonic turns a poll_ready error into UNKNOWN.
        if let Some(message) = &self.silent {
            let status = tonic::Status::unavailable(message.to_string());
            return Box::pin(async move { Err(status) });
        }
        let call = tower::Service::call(&mut self.inner, request);
        let daemon = self.daemon.clone();
        // One allocation per call: the CLI makes a handful.
        Box::pin(async move { call.await.map_err(|e| daemon.failed(&error_chain(&e))) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user() -> Daemon {
        Daemon::new(
            Kind::User,
            Path::new("/run/user/1000/kvpn/userd.sock"),
            Path::new("/nonexistent/kvpn-userd.pid"),
        )
    }

    #[test]
    fn a_silent_daemon_is_named_with_its_cause_and_fix() {
        let m = message(
            &user(),
            "keep-alive timed out",
            Some(4242),
            Some('T'),
            false,
        );
        assert!(
            m.starts_with("the user daemon (kvpn daemon) (pid 4242"),
            "{m}"
        );
        assert!(m.contains("/run/user/1000/kvpn/userd.sock"), "{m}");
        assert!(m.contains("not answering: no reply within 6 s"), "{m}");
        assert!(m.contains("the process is stopped"), "{m}");
        assert!(m.contains("`kill -CONT 4242`"), "{m}");
        let root = Daemon::new(
            Kind::Root,
            Path::new("/run/kvpn/dataplane.sock"),
            Path::new("/x"),
        );
        let m = message(&root, "keep-alive timed out", Some(7), Some('S'), false);
        assert!(m.contains("root daemon (kvpn-dataplane)"), "{m}");
        assert!(m.contains("`sudo kill -CONT 7`"), "{m}");
        assert!(m.contains("state S"), "{m}");
        let m = message(&root, "connection reset", Some(7), Some('S'), false);
        assert!(
            m.starts_with("lost the connection to the root daemon"),
            "{m}"
        );
        // Its process died during the call: the cause and the fix.
        let m = message(&root, "connection reset", Some(7), None, true);
        assert!(
            m.contains("(pid 7, socket /run/kvpn/dataplane.sock) exited during the call"),
            "{m}"
        );
        assert!(m.contains("killed or crashed"), "{m}");
        assert!(m.contains("run `kvpn connect` again"), "{m}");
    }

    /// Case lc-01's race: the pid file names a process that has exited (a
    /// zombie here: a real child that is not reaped) while its listener still
    /// exists; it closes 300 ms later. `open` waits and reports "nobody
    /// listens" (the caller starts a new daemon) instead of a channel into
    /// the dying backlog or a reset.
    #[tokio::test]
    async fn a_daemon_killed_but_not_yet_closed_is_reported_as_not_listening() {
        let dir = std::env::temp_dir().join(format!("kvpn-test-dying-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let socket = dir.join("dataplane.sock");
        let _ = std::fs::remove_file(&socket);
        let listener = std::os::unix::net::UnixListener::bind(&socket).expect("bind");
        let mut zombie = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let pid = zombie.id();
        let t0 = std::time::Instant::now();
        while crate::liveness::proc_stat(pid as i32).is_some_and(|s| !s.dead()) {
            assert!(t0.elapsed() < Duration::from_secs(5), "true did not exit");
            std::thread::sleep(Duration::from_millis(5));
        }
        let pid_file = dir.join("dataplane.pid");
        std::fs::write(&pid_file, format!("{pid}\n")).expect("pid file");
        let closer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            drop(listener);
        });
        let opened = open(Daemon::new(Kind::Root, &socket, &pid_file)).await;
        closer.join().expect("closer");
        let _ = zombie.wait();
        let _ = std::fs::remove_dir_all(&dir);
        let err = opened.expect_err("a dying daemon is not a channel");
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
    }

    /// The stand-in daemon of
    /// [`a_daemon_sigkilled_but_not_yet_a_zombie_is_not_a_channel`]: run as
    /// a child process of this test binary, it listens on the socket in
    /// `KVPN_TEST_DYING_DAEMON` and never accepts. It holds 1 GiB of touched
    /// memory, which exit(2) frees before it closes the process's files: for
    /// tens of milliseconds after `kill -9` its listener takes connects into
    /// its backlog while /proc shows it running, not a zombie (as the real
    /// daemon's TUN devices and netlink sockets do). Does nothing when run
    /// as a test of its own.
    #[test]
    fn dying_daemon_child() {
        let Some(socket) = std::env::var_os("KVPN_TEST_DYING_DAEMON") else {
            return;
        };
        let socket = PathBuf::from(socket);
        let _listener = std::os::unix::net::UnixListener::bind(&socket).expect("bind");
        let mut memory = vec![0u8; 1 << 30];
        for i in (0..memory.len()).step_by(4096) {
            memory[i] = 1;
        }
        std::hint::black_box(&memory);
        std::fs::write(socket.with_extension("ready"), b"").expect("ready file");
        std::thread::sleep(Duration::from_secs(60));
    }

    /// The tester's race (`kill -9` of the root daemon, then `kvpn connect`
    /// at once): the pid file names a real process that was just SIGKILLed
    /// and is not a zombie yet; its real listener still completes connects
    /// and resets them when it closes. `open` reports "nobody listens" (the
    /// caller starts a new daemon), not a channel into the dying backlog —
    /// on main it returned one, and the first call was reset.
    #[tokio::test]
    async fn a_daemon_sigkilled_but_not_yet_a_zombie_is_not_a_channel() {
        // The window depends on the scheduler: a try whose stand-in did not
        // start, or was a zombie at once, says nothing and is repeated.
        let mut setups = Vec::new();
        for attempt in 0..3 {
            match sigkilled_stand_in_open(attempt).await {
                Ok(opened) => {
                    let err = opened.expect_err("a dying daemon is not a channel");
                    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
                    return;
                }
                Err(setup) => setups.push(setup),
            }
        }
        panic!("no try reached the window: {setups:#?}");
    }

    /// One try of the test above: `Ok` with `open`'s result when the killed
    /// stand-in was still running when `open` began, else why not.
    async fn sigkilled_stand_in_open(
        attempt: u32,
    ) -> Result<std::io::Result<DaemonChannel>, String> {
        let dir = std::env::temp_dir().join(format!(
            "kvpn-test-sigkilled-{}-{attempt}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let socket = dir.join("dataplane.sock");
        let ready = socket.with_extension("ready");
        let exe = std::env::current_exe().expect("test binary");
        let mut child = std::process::Command::new(exe)
            .args([
                "--exact",
                "daemon_channel::tests::dying_daemon_child",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env("KVPN_TEST_DYING_DAEMON", &socket)
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("spawn the stand-in daemon");
        let pid = child.id() as i32;
        let t0 = std::time::Instant::now();
        while !ready.exists() && t0.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let pid_file = dir.join("dataplane.pid");
        std::fs::write(&pid_file, format!("{pid}\n")).expect("pid file");
        // SAFETY: kill(2) on the child this test spawned and has not reaped.
        let rc = unsafe { libc::kill(pid, libc::SIGKILL) };
        let kill_error = std::io::Error::last_os_error();
        let in_window = crate::liveness::proc_stat(pid).is_some_and(|s| !s.dead());
        let started = ready.exists();
        let opened = if started && rc == 0 && in_window {
            Some(open(Daemon::new(Kind::Root, &socket, &pid_file)).await)
        } else {
            None
        };
        let _ = child.kill();
        let exit = child.wait();
        let _ = std::fs::remove_dir_all(&dir);
        opened.ok_or_else(|| {
            format!(
                "stand-in started: {started} (after {:?}); kill: {rc} ({kill_error}); running \
                 after the kill: {in_window}; its exit: {exit:?}",
                t0.elapsed()
            )
        })
    }

    /// A listener that never accepts stands for a stopped daemon: the kernel
    /// completes the connect, nobody reads. A call fails within the bound
    /// with the daemon's name instead of waiting forever.
    #[tokio::test]
    async fn a_call_to_a_daemon_that_never_answers_fails_within_the_bound() {
        use kvpn_proto::userd::user_daemon_client::UserDaemonClient;
        let dir = std::env::temp_dir().join(format!("kvpn-test-chan-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let socket = dir.join("userd.sock");
        let _ = std::fs::remove_file(&socket);
        let _listener = std::os::unix::net::UnixListener::bind(&socket).expect("bind");
        let daemon = Daemon::new(Kind::User, &socket, &dir.join("none.pid"));
        let started = std::time::Instant::now();
        let channel = open(daemon)
            .await
            .expect("the kernel completes the connect");
        let err = UserDaemonClient::new(channel)
            .status(kvpn_proto::userd::StatusRequest {})
            .await
            .expect_err("nobody answers");
        let took = started.elapsed();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(took < ANSWER_TIMEOUT + Duration::from_secs(3), "{took:?}");
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
        assert!(
            err.message().contains("user daemon") && err.message().contains("not answering"),
            "{}",
            err.message()
        );
    }
}
