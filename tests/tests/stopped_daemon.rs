//! The CLI's calls to a daemon that stopped answering end with an error that
//! names it: a user daemon stopped with SIGSTOP keeps its listening socket
//! (the kernel completes the connect and takes the request), so without a
//! bound `kvpn disconnect` and `kvpn status` waited forever with no output.

use std::time::{Duration, Instant};

use kvpn_lab::LAPTOP;
use kvpn_tests::{Fixture, UserDaemon, text};

/// `kvpn ARGS` in the laptop netns, cut off by the test after 60 s (`timeout`
/// exits 124 then) so a regression fails instead of hanging the suite.
fn kvpn_bounded(f: &Fixture, kvpn: &str, args: &[&str]) -> (std::process::Output, Duration) {
    let mut cmd = f
        .lab
        .command_in(LAPTOP, "timeout")
        .unwrap_or_else(|e| panic!("laptop netns: {e:#}"));
    cmd.args(["60", kvpn])
        .args(args)
        .env("KVPN_RUNTIME_DIR", f.runtime_dir());
    let started = Instant::now();
    let out = cmd.output().expect("run kvpn");
    (out, started.elapsed())
}

#[test]
fn disconnect_and_status_name_a_stopped_user_daemon() {
    let f = Fixture::new();
    let kvpn = kvpn_lab::bin_path("kvpn").unwrap_or_else(|e| panic!("kvpn binary: {e:#}"));
    let kvpn = kvpn.to_string_lossy().into_owned();
    let daemon = UserDaemon::start(&f);
    let socket = f.runtime_dir().join("user.sock");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (out, _) = kvpn_bounded(&f, &kvpn, &["status"]);
        if socket.exists() && out.status.success() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the user daemon did not answer: {}",
            text(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    daemon.signal(libc::SIGSTOP);
    let pid = daemon.pid().to_string();
    for args in [
        &["disconnect", "--all"][..],
        &["status"],
        &["status", "-o", "json"],
    ] {
        let (out, took) = kvpn_bounded(&f, &kvpn, args);
        let stderr = text(&out.stderr);
        assert_ne!(
            out.status.code(),
            Some(124),
            "kvpn {args:?} still waited after 60 s"
        );
        assert!(!out.status.success(), "kvpn {args:?} succeeded: {stderr}");
        assert!(
            stderr.contains("user daemon")
                && stderr.contains("not answering")
                && stderr.contains("the process is stopped")
                && stderr.contains(&format!("kill -CONT {pid}")),
            "kvpn {args:?}: {stderr}"
        );
        // The bound is 6 s of silence; room for a loaded machine.
        assert!(
            took < Duration::from_secs(20),
            "kvpn {args:?} took {took:?}"
        );
        eprintln!("kvpn {args:?} failed after {took:?}: {}", stderr.trim());
    }

    // Continued, it answers again.
    daemon.signal(libc::SIGCONT);
    let (out, _) = kvpn_bounded(&f, &kvpn, &["status"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let (out, _) = kvpn_bounded(&f, &kvpn, &["disconnect", "--all"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}
