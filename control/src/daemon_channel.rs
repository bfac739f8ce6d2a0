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
        std::fs::read_to_string(&self.pid_file)
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// The error of a call whose connection failed: `what` is the transport
    /// error's text (with its causes).
    pub fn failed(&self, what: &str) -> tonic::Status {
        let pid = self.pid();
        let state = pid.and_then(process_state);
        tonic::Status::unavailable(message(self, what, pid, state))
    }
}

/// The user-facing text of [`Daemon::failed`]; `state` is the process state
/// letter of `/proc/PID/stat` ('T' = stopped).
fn message(daemon: &Daemon, what: &str, pid: Option<i32>, state: Option<char>) -> String {
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
    // hyper's KeepAliveTimedOut is private; its text is the only mark.
    if !what.contains("keep-alive") {
        return format!(
            "lost the connection to the {name} ({at}): {what} — `kvpn logs` shows the daemon's side"
        );
    }
    let cause = match state {
        Some('T' | 't') => "the process is stopped (SIGSTOP or a debugger)".to_owned(),
        Some(s) => format!("the process (state {s}) is hung or overloaded"),
        None => "the process may be stopped or hung".to_owned(),
    };
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

/// The state letter of process `pid` (`/proc/PID/stat`), if it exists.
fn process_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}

/// A [`Channel`] whose connection failures are [`Daemon::failed`] statuses.
#[derive(Debug, Clone)]
pub struct DaemonChannel {
    inner: Channel,
    daemon: Arc<Daemon>,
}

/// Open a channel to `daemon`. Fails at once with the connect error when
/// nobody listens (NotFound, ConnectionRefused), and with `TimedOut` when
/// opening it takes longer than [`ANSWER_TIMEOUT`].
pub async fn open(daemon: Daemon) -> std::io::Result<DaemonChannel> {
    let socket = daemon.socket.clone();
    let opened = tokio::time::timeout(ANSWER_TIMEOUT, async move {
        // Fail fast when nobody listens; tonic's connector would otherwise retry.
        UnixStream::connect(&socket).await?;
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
        Ok(Ok(inner)) => Ok(DaemonChannel {
            inner,
            daemon: Arc::new(daemon),
        }),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            daemon
                .failed("keep-alive: the connection did not open")
                .message(),
        )),
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
        let m = message(&user(), "keep-alive timed out", Some(4242), Some('T'));
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
        let m = message(&root, "keep-alive timed out", Some(7), Some('S'));
        assert!(m.contains("root daemon (kvpn-dataplane)"), "{m}");
        assert!(m.contains("`sudo kill -CONT 7`"), "{m}");
        assert!(m.contains("state S"), "{m}");
        let m = message(&root, "connection reset", None, None);
        assert!(
            m.starts_with("lost the connection to the root daemon"),
            "{m}"
        );
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
