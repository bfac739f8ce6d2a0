//! A root daemon that is stopped (SIGSTOP) is not a dead one. While it is
//! stopped `kvpn status` answers within a bound and names it (pid, "stopped",
//! `kill -CONT`), the user daemon keeps its sessions (`degraded`, listener
//! and port-forward left as they are) and, once continued, the session is
//! `connected` again by itself and carries traffic. A root daemon that really
//! dies (SIGKILL) still loses the session, with the reason.
//!
//! The stop lasts 8 s: longer than the keep-alive bound (2 s + 4 s) after
//! which a call to it fails.

use std::net::SocketAddr;
use std::path::Path;

use std::time::{Duration, Instant};

use kvpn_lab::{BACKEND_1_IP, BACKEND_1_POD, HTTP_PORT, LAPTOP, WEB_SERVICE_PORT};
use kvpn_tests::kube_lab::KubeFixture;
use kvpn_tests::{Fixture, UserDaemon, text};
use serde_json::Value;

/// Longer than the keep-alive's 6 s.
const STOP_FOR: Duration = Duration::from_secs(8);

/// A root daemon this test stopped: continued on drop, also when the test
/// fails, so no stopped process is left behind. Declared after the fixture,
/// it is dropped before it (the fixture's `kvpn quit` needs a running daemon).
struct Stopped {
    pid: i32,
}

impl Stopped {
    fn stop(pid: i32) -> Self {
        // SAFETY: kill(2) on the pid the fixture's own root daemon wrote.
        let rc = unsafe { libc::kill(pid, libc::SIGSTOP) };
        assert_eq!(rc, 0, "SIGSTOP {pid}: {}", std::io::Error::last_os_error());
        // The kernel stops it asynchronously: wait for /proc to say so.
        let t0 = Instant::now();
        while proc_state(pid) != Some('T') {
            assert!(t0.elapsed() < Duration::from_secs(5), "{pid} not stopped");
            std::thread::sleep(Duration::from_millis(10));
        }
        Stopped { pid }
    }

    fn resume(&self) {
        // SAFETY: as in `stop`.
        unsafe { libc::kill(self.pid, libc::SIGCONT) };
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        self.resume();
    }
}

fn proc_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}

/// The root daemon's pid, from the pid file it writes in its runtime folder.
fn root_pid(runtime_dir: &Path) -> i32 {
    std::fs::read_to_string(runtime_dir.join("dataplane.pid"))
        .ok()
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("no root daemon pid file in {}", runtime_dir.display()))
}

/// `kvpn ARGS` in the laptop netns of `lab`, cut off after 60 s (`timeout`
/// exits 124 then) so a regression fails instead of hanging the suite.
fn kvpn_bounded(
    lab: &kvpn_lab::Lab,
    runtime_dir: &Path,
    env: &[(&str, &Path)],
    args: &[&str],
) -> (std::process::Output, Duration) {
    let kvpn = kvpn_lab::bin_path("kvpn").unwrap_or_else(|e| panic!("kvpn binary: {e:#}"));
    let mut cmd = lab
        .command_in(LAPTOP, "timeout")
        .unwrap_or_else(|e| panic!("laptop netns: {e:#}"));
    cmd.arg("60")
        .arg(kvpn)
        .args(args)
        .env("KVPN_RUNTIME_DIR", runtime_dir);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let started = Instant::now();
    let out = cmd.output().expect("run kvpn");
    (out, started.elapsed())
}

/// A new `kvpn connect` while the root daemon `pid` is stopped fails at once,
/// before reading any kubeconfig (this one does not exist: on main the connect
/// went on and failed on it, or with a kubeconfig timed out after 6 s), naming
/// the pid and `sudo kill -CONT PID`.
fn connect_refuses_the_stopped_root_daemon(lab: &kvpn_lab::Lab, runtime_dir: &Path, pid: i32) {
    let (out, took) = kvpn_bounded(
        lab,
        runtime_dir,
        &[],
        &[
            "connect",
            "--kubeconfig",
            "/nonexistent/kvpn-test-kubeconfig",
        ],
    );
    let stderr = text(&out.stderr);
    eprintln!("kvpn connect (root daemon stopped) took {took:?}: {stderr}");
    assert!(!out.status.success(), "connect succeeded: {stderr}");
    assert!(
        stderr.contains(&format!("pid {pid}"))
            && stderr.contains(&format!("sudo kill -CONT {pid}")),
        "connect does not name the stopped root daemon and the fix: {stderr}"
    );
    assert!(
        !stderr.contains("kvpn-test-kubeconfig"),
        "connect read the kubeconfig before checking the root daemon: {stderr}"
    );
    assert!(took < Duration::from_secs(20), "connect took {took:?}");
}

/// `kvpn status` and `kvpn status -o json` while the root daemon `pid` is
/// stopped: both succeed within the bound, name it and the fix, and do not
/// call it dead or the laptop not connected. Returns the JSON document.
fn status_names_the_stopped_root_daemon(
    lab: &kvpn_lab::Lab,
    runtime_dir: &Path,
    env: &[(&str, &Path)],
    pid: i32,
) -> Value {
    let fix = format!("kill -CONT {pid}");
    let (out, took) = kvpn_bounded(lab, runtime_dir, env, &["status"]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    eprintln!("kvpn status (root daemon stopped) took {took:?}:\n{stdout}{stderr}");
    assert!(out.status.success(), "kvpn status failed: {stdout}{stderr}");
    assert!(took < Duration::from_secs(20), "kvpn status took {took:?}");
    assert!(
        stdout.contains(&format!("pid {pid}"))
            && stdout.contains("stopped")
            && stdout.contains(&fix),
        "kvpn status does not name the stopped root daemon: {stdout}{stderr}"
    );
    assert!(
        !stdout.contains("Not connected") && !stderr.contains("died"),
        "a stopped root daemon is not a dead one: {stdout}{stderr}"
    );
    let (out, took) = kvpn_bounded(lab, runtime_dir, env, &["status", "-o", "json"]);
    assert!(
        out.status.success(),
        "kvpn status -o json failed: {}",
        text(&out.stderr)
    );
    assert!(
        took < Duration::from_secs(20),
        "status -o json took {took:?}"
    );
    let doc: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("status JSON: {e}: {}", text(&out.stdout)));
    let na = &doc["root_daemon"]["not_answering"];
    assert_eq!(na["pid"], pid, "{doc:#}");
    assert_eq!(na["stopped"], true, "{doc:#}");
    assert!(
        na["reason"].as_str().is_some_and(|r| r.contains(&fix)),
        "{doc:#}"
    );
    doc
}

/// Lines of the root daemon's log that start a re-dial, and that say one
/// failed; the re-dial lines after the first `skip` are printed (why it re-dialled).
fn redial_lines(log: &Path, skip: usize) -> (usize, usize) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let redials: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("transport lost, re-dialling"))
        .collect();
    for l in redials.iter().skip(skip) {
        eprintln!("root daemon: {l}");
    }
    (redials.len(), text.matches("re-dial failed").count())
}

/// A session listed from the user daemon's record alone (`degraded`,
/// `lost`): its uptime and counters are unknown, so `null` in the JSON (on
/// main: zeros and the user half's uptime, as if measured); so are its routes,
/// Services and conflicts (`[]` would read as "none" though the routes are
/// there); the user half's own uptime is under `user_daemon`.
fn assert_unknown_counters(s: &Value) {
    for key in [
        "uptime_ms",
        "tx",
        "rx",
        "resumes",
        "tcp_flows_reset",
        "ebpf",
        "routes",
        "services",
        "conflicts",
    ] {
        assert!(s[key].is_null(), "{key} is not null: {s:#}");
    }
    assert!(s["user_daemon"]["uptime_ms"].is_u64(), "{s:#}");
}

fn curl_backend(f: &Fixture) -> std::process::Output {
    let url = format!("http://{BACKEND_1_IP}:{HTTP_PORT}/");
    f.laptop(&["curl", "-sS", "--max-time", "5", &url])
}

/// Plain lab, direct session: during the stop `kvpn status` answers at once,
/// without and with a user daemon in between; after SIGCONT the session is
/// `connected` again and curl reaches a pod through the tunnel.
#[test]
fn a_stopped_root_daemon_is_named_and_its_session_comes_back() {
    let f = Fixture::connected();
    let out = curl_backend(&f);
    assert!(out.status.success(), "curl: {}", text(&out.stderr));
    let pid = root_pid(f.runtime_dir());
    let root_log = f.runtime_dir().join("dataplane.log");
    let (redials, _) = redial_lines(&root_log, usize::MAX);

    let stopped_at = Instant::now();
    let stopped = Stopped::stop(pid);
    // No user daemon: the CLI asks the root daemon itself.
    status_names_the_stopped_root_daemon(&f.lab, f.runtime_dir(), &[], pid);
    // A user daemon in between, started while the root daemon is stopped.
    let _user = UserDaemon::start(&f);
    status_names_the_stopped_root_daemon(&f.lab, f.runtime_dir(), &[], pid);
    // Disconnect cannot work now: it says why and the fix, without waiting
    // for the keep-alive, and leaves the session as it is.
    let (out, took) = kvpn_bounded(&f.lab, f.runtime_dir(), &[], &["disconnect", "--all"]);
    let stderr = text(&out.stderr);
    eprintln!("kvpn disconnect (root daemon stopped) took {took:?}: {stderr}");
    assert!(!out.status.success(), "disconnect succeeded: {stderr}");
    assert!(
        stderr.contains(&format!("kill -CONT {pid}")),
        "disconnect does not name the fix: {stderr}"
    );
    assert!(took < Duration::from_secs(20), "disconnect took {took:?}");
    connect_refuses_the_stopped_root_daemon(&f.lab, f.runtime_dir(), pid);
    std::thread::sleep(STOP_FOR.saturating_sub(stopped_at.elapsed()));
    status_names_the_stopped_root_daemon(&f.lab, f.runtime_dir(), &[], pid);

    stopped.resume();
    let resumed = Instant::now();
    let doc = loop {
        let (out, _) = kvpn_bounded(&f.lab, f.runtime_dir(), &[], &["status", "-o", "json"]);
        let doc: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if doc["sessions"][0]["state"] == "connected" {
            break doc;
        }
        assert!(
            resumed.elapsed() < Duration::from_secs(10),
            "not connected 10 s after SIGCONT: {}{}\n{}",
            text(&out.stdout),
            text(&out.stderr),
            f.daemon_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!(
        "connected {:?} after SIGCONT (stopped for {:?})",
        resumed.elapsed(),
        resumed - stopped_at
    );
    assert_eq!(doc["root_daemon"]["running"], true, "{doc:#}");
    assert!(doc["root_daemon"].get("not_answering").is_none(), "{doc:#}");
    let out = curl_backend(&f);
    assert!(
        out.status.success(),
        "curl through the tunnel after SIGCONT: {}\n{}",
        text(&out.stderr),
        f.daemon_log()
    );
    let page = kvpn_lab::protocol::PageInfo::parse(&text(&out.stdout))
        .unwrap_or_else(|| panic!("not a lab page: {:?}", text(&out.stdout)));
    assert_eq!(page.pod, BACKEND_1_POD);
    let (redials_after, _) = redial_lines(&root_log, redials);
    eprintln!(
        "root daemon re-dials during stop + recovery: {}",
        redials_after - redials
    );
    // The connection was never broken (the manager waits 60 s for a silent
    // laptop): the pump's watchdog takes its own late tick for a stall and lets
    // the reader drain the waiting echoes instead of re-dialling.
    assert_eq!(
        redials_after,
        redials,
        "the root daemon re-dialled after SIGCONT although its connection was alive:\n{}",
        std::fs::read_to_string(&root_log).unwrap_or_default()
    );
}

/// Kubernetes lab, port-forward session (the user daemon holds its
/// listener): during the stop the session is `degraded`, never `lost`, and its
/// listener stays; after SIGCONT it is `connected` again and a ClusterIP
/// answers through the tunnel. Then a SIGKILL of the root daemon loses the
/// session as before, with the reason.
#[test]
fn a_stopped_root_daemon_degrades_a_port_forward_session_a_killed_one_loses_it() {
    let f = KubeFixture::new();
    f.connect_restricted();
    f.wait_state("connected", Duration::from_secs(15));
    let web = SocketAddr::from((f.lab().addressing().web_cluster_ip(), WEB_SERVICE_PORT));
    f.page(web);
    let listeners = f.session_listeners();
    assert_eq!(listeners.len(), 1, "{listeners:?}");
    let pid = root_pid(f.runtime_dir());
    // As the fixture runs kvpn: its session records, the laptop netns's files.
    let (state_dir, resolv, hosts) = (
        f.state_dir().to_path_buf(),
        f.laptop_resolv_conf(),
        f.laptop_hosts(),
    );
    let env = [
        ("XDG_STATE_HOME", state_dir.as_path()),
        ("KVPN_RESOLV_CONF", resolv.as_path()),
        ("KVPN_HOSTS", hosts.as_path()),
    ];
    let lab = f.lab().netns_lab();

    let root_log = f.runtime_dir().join("dataplane.log");
    let (redials, failed) = redial_lines(&root_log, usize::MAX);

    let stopped_at = Instant::now();
    let stopped = Stopped::stop(pid);
    std::thread::sleep(STOP_FOR);
    let doc = status_names_the_stopped_root_daemon(lab, f.runtime_dir(), &env, pid);
    let s = &doc["sessions"][0];
    assert_eq!(s["state"], "degraded", "{doc:#}");
    assert_unknown_counters(s);
    assert_eq!(s["user_daemon"]["state"], "degraded", "{doc:#}");
    // The table agrees: unknown, not "no routes".
    let (out, _) = kvpn_bounded(lab, f.runtime_dir(), &env, &["status"]);
    let table = text(&out.stdout);
    assert!(table.contains("routes unknown"), "{table}");
    assert!(!table.contains("    route "), "{table}");
    assert!(
        s["reason"]
            .as_str()
            .is_some_and(|r| r.contains(&format!("kill -CONT {pid}"))),
        "{doc:#}"
    );
    assert_eq!(
        f.session_listeners(),
        listeners,
        "the listener the root daemon dials stays while it is stopped"
    );

    stopped.resume();
    let resumed = Instant::now();
    let took = f.wait_state("connected", Duration::from_secs(10));
    eprintln!(
        "connected {took:?} after SIGCONT (stopped for {:?})",
        resumed - stopped_at
    );
    assert_eq!(f.session()["user_daemon"]["state"], "running");
    let (after, _) = f.wait_http(web, resumed, Duration::from_secs(10));
    eprintln!("ClusterIP answered {after:?} after SIGCONT");
    assert_eq!(f.session_listeners(), listeners);
    let log = std::fs::read_to_string(f.runtime_dir().join("user.log")).unwrap_or_default();
    assert!(!log.contains("session lost"), "user daemon log:\n{log}");
    // Nothing the root daemon dials was closed: no failed re-dial (before the
    // fix it re-dialled the closed listener, refused, for ever).
    std::thread::sleep(Duration::from_secs(2));
    let (redials_after, failed_after) = redial_lines(&root_log, redials);
    eprintln!(
        "root daemon re-dials during stop + recovery: {}, failed: {}",
        redials_after - redials,
        failed_after - failed
    );
    assert_eq!(
        failed_after,
        failed,
        "re-dials failed after SIGCONT:\n{}",
        std::fs::read_to_string(&root_log).unwrap_or_default()
    );
    // And none was needed: the stall is not the transport's silence.
    assert_eq!(
        redials_after,
        redials,
        "the root daemon re-dialled after SIGCONT although its connection was alive:\n{}",
        std::fs::read_to_string(&root_log).unwrap_or_default()
    );
    assert_eq!(f.session()["state"], "connected");

    // A user daemon restarted while the root daemon is stopped waits for it
    // (the session `degraded`, the half `restoring`), then brings it back.
    let stopped = Stopped::stop(pid);
    let user = f.user_daemon_pids();
    assert_eq!(user.len(), 1, "{user:?}");
    // SAFETY: kill(2) on the fixture's user daemon (found by its command line).
    unsafe { libc::kill(user[0] as i32, libc::SIGKILL) };
    let t0 = Instant::now();
    let s = loop {
        let (out, _) = kvpn_bounded(lab, f.runtime_dir(), &env, &["status", "-o", "json"]);
        let doc: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let s = doc["sessions"][0].clone();
        if s["user_daemon"]["state"] == "restoring"
            && s["reason"].as_str().is_some_and(|r| r.contains("waiting"))
        {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "no restoring session while the root daemon is stopped: {}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!("restarted user daemon waits: {:?}", s["reason"]);
    assert_eq!(s["state"], "degraded", "{s:#}");
    assert!(
        s["reason"]
            .as_str()
            .is_some_and(|r| r.contains(&format!("kill -CONT {pid}"))),
        "{s:#}"
    );
    stopped.resume();
    let resumed = Instant::now();
    let took = f.wait_state("connected", Duration::from_secs(15));
    eprintln!("restored and connected {took:?} after SIGCONT");
    assert_eq!(f.session()["user_daemon"]["state"], "running");
    assert_eq!(f.session()["user_daemon"]["restores"], 1);
    f.wait_http(web, resumed, Duration::from_secs(10));
    drop(stopped);

    // Really dead: lost, with the reason, and the listener closed.
    // SAFETY: kill(2) on the fixture's root daemon, continued above.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let t0 = Instant::now();
    let s = loop {
        let s = f.session();
        if s["state"] == "lost" {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "not lost 15 s after SIGKILL: {s:#}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!("lost {:?} after SIGKILL", t0.elapsed());
    assert_unknown_counters(&s);
    let reason = s["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("not running any more") && reason.contains("kvpn connect"),
        "{reason}"
    );
    assert!(
        f.session_listeners().is_empty(),
        "a lost session listens nowhere"
    );
}
