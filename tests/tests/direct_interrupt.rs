//! End-to-end: Ctrl-C during `kvpn connect --manager HOST:PORT` (direct
//! mode, plain lab) is all or nothing, as in kube mode (kube_interrupt.rs):
//! a connect that exits 0 left one complete session that `kvpn status`
//! reports; one that exits 130 (its own SIGINT exit) or dies of SIGINT left
//! nothing: no TUN device, no kvpn route (protocol 107), no session. Tester
//! finding: a SIGINT after the root daemon's Connect returned, while the CLI
//! waited for the first heartbeat echo, left a complete session behind.
//!
//! The delays 25..400 ms cover the start of the root daemon and Connect; the
//! window after Connect is made wide by stopping the lab's manager (SIGSTOP):
//! the data connection opens (the kernel accepts it), Connect returns and
//! the CLI waits for an echo that does not come.

use std::time::{Duration, Instant};

use kvpn_lab::LAPTOP;
use kvpn_tests::{Fixture, Paused, lab_connect_args, text};

/// What a connect attempt may leave: TUN devices, kvpn routes, sessions.
fn leftovers(f: &Fixture) -> Vec<String> {
    let mut left = Vec::new();
    let tuns = text(
        &f.laptop(&["ip", "-o", "link", "show", "type", "tun"])
            .stdout,
    );
    if !tuns.trim().is_empty() {
        left.push(format!("TUN devices {tuns}"));
    }
    let routes = text(&f.laptop(&["ip", "route", "show", "proto", "107"]).stdout);
    if !routes.trim().is_empty() {
        left.push(format!("kvpn routes {routes}"));
    }
    let status = f.kvpn(&["status", "-o", "json"]);
    let doc: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap_or_default();
    if doc["sessions"].as_array().is_some_and(|s| !s.is_empty()) {
        left.push(format!("sessions {:#}", doc["sessions"]));
    }
    left
}

/// Polls (every 100 ms, up to 10 s: a Connect the root daemon finishes after
/// its caller went away is torn down then) until nothing is left.
fn wait_clean(f: &Fixture, what: &str) {
    let t0 = Instant::now();
    loop {
        let left = leftovers(f);
        if left.is_empty() {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{what}: left behind after 10 s: {left:#?}\nroot daemon log:\n{}",
            f.daemon_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn spawn_connect(f: &Fixture) -> std::process::Child {
    let kvpn = kvpn_lab::bin_path("kvpn").unwrap_or_else(|e| panic!("kvpn binary: {e:#}"));
    f.lab
        .command_in(LAPTOP, &kvpn.to_string_lossy())
        .unwrap_or_else(|e| panic!("laptop netns: {e:#}"))
        .arg("connect")
        .args(lab_connect_args())
        .env("KVPN_RUNTIME_DIR", f.runtime_dir())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn kvpn connect: {e}"))
}

/// SIGINT to `child`, then its exit code (`None`: killed by the signal
/// before it watched for it) and stderr.
fn interrupt(child: std::process::Child) -> (Option<i32>, String) {
    let pid = i32::try_from(child.id()).expect("pid");
    // SAFETY: kill(2) on the child this test started; it has not been waited
    // for, so the pid is still this child's.
    unsafe { libc::kill(pid, libc::SIGINT) };
    let out = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("wait kvpn connect: {e}"));
    (out.status.code(), text(&out.stderr))
}

#[test]
fn ctrl_c_during_a_direct_connect_is_all_or_nothing() {
    let f = Fixture::new();
    let (mut interrupted, mut finished) = (0, 0);
    for delay_ms in (25..=400).step_by(25) {
        let child = spawn_connect(&f);
        std::thread::sleep(Duration::from_millis(delay_ms));
        let (code, stderr) = interrupt(child);
        eprintln!(
            "SIGINT after {delay_ms} ms: {code:?}; {}",
            stderr.lines().last().unwrap_or_default()
        );
        match code {
            Some(0) => {
                // Finished before the signal: a whole session that status reports.
                finished += 1;
                let doc = f.status_json();
                let sessions = doc["sessions"].as_array().cloned().unwrap_or_default();
                assert_eq!(sessions.len(), 1, "{doc:#}");
                assert_eq!(sessions[0]["state"], "connected", "{doc:#}");
                f.disconnect();
            }
            Some(130) | None => interrupted += 1,
            Some(other) => panic!(
                "connect interrupted after {delay_ms} ms exited {other}: {stderr}\n{}",
                f.daemon_log()
            ),
        }
        wait_clean(
            &f,
            &format!("connect interrupted after {delay_ms} ms ({code:?})"),
        );
    }
    eprintln!("{interrupted} interrupted, {finished} finished before the signal");

    // After Connect returned, while the CLI waits for the first echo (the
    // manager is stopped): on main the CLI died and the session stayed.
    for _ in 0..3 {
        let paused = Paused::manager(&f);
        let child = spawn_connect(&f);
        let t0 = Instant::now();
        loop {
            let doc = f.status_json();
            if doc["sessions"].as_array().is_some_and(|s| s.len() == 1) {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "Connect did not return with the manager stopped: {doc:#}\n{}",
                f.daemon_log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(100));
        let (code, stderr) = interrupt(child);
        eprintln!("SIGINT after Connect returned: {code:?}; {stderr}");
        drop(paused);
        // Nothing left, and at once: the CLI disconnected before it exited.
        let left = leftovers(&f);
        assert!(
            left.is_empty(),
            "SIGINT after Connect returned left {left:#?}"
        );
        assert_eq!(code, Some(130), "{stderr}");
        assert!(
            stderr.contains("disconnected — not connected"),
            "the CLI does not say it disconnected: {stderr}"
        );
    }

    // A following connect works, and its session is the only one.
    f.connect();
    let doc = f.status_json();
    assert_eq!(doc["sessions"].as_array().map(Vec::len), Some(1), "{doc:#}");
    f.disconnect();
    wait_clean(&f, "after the last disconnect");
}
