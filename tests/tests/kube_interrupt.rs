//! End-to-end: Ctrl-C during `kvpn connect --kubeconfig` (docs/root-daemon.md: "A Connect is
//! all or nothing"), on the Kubernetes lab. `kvpn connect` runs as a child and
//! gets SIGINT at delays from 50 to 400 ms; afterwards nothing of the attempt is
//! left: no loopback listener in the user daemon, no TUN device, no kvpn route,
//! resolv.conf as before, no session in `kvpn status` (tester finding: every
//! interrupt left a listener that `disconnect --all` did not remove, or a
//! `failed` root daemon session with a false reason while its TUN and DNS
//! stayed). A connect that finished before the signal is disconnected as usual,
//! and a last `kvpn connect` works.

use std::time::{Duration, Instant};

use kvpn_tests::kube_lab::KubeFixture;
use kvpn_tests::text;

/// What this fixture's connect attempts may leave: listeners of the user
/// daemon, TUN devices, kvpn routes (proto 107), sessions in status, and
/// whether resolv.conf differs from `resolv_before`.
fn leftovers(f: &KubeFixture, resolv_before: &str) -> Vec<String> {
    let mut left = Vec::new();
    let listeners = f.session_listeners();
    if !listeners.is_empty() {
        left.push(format!("user daemon listeners {listeners:?}"));
    }
    let tuns = f.tun_devices();
    if !tuns.is_empty() {
        left.push(format!("TUN devices {tuns:?}"));
    }
    let routes: Vec<String> = f
        .laptop_routes()
        .into_iter()
        .filter(|r| r.contains("proto 107"))
        .collect();
    if !routes.is_empty() {
        left.push(format!("kvpn routes {routes:?}"));
    }
    let sessions = f.sessions();
    if !sessions.is_empty() {
        left.push(format!("sessions {sessions:#?}"));
    }
    let resolv = std::fs::read_to_string(f.laptop_resolv_conf()).unwrap_or_default();
    if resolv != resolv_before {
        left.push(format!("resolv.conf changed: {resolv:?}"));
    }
    left
}

/// Polls (every 100 ms, up to 15 s: a StartSession the user daemon finishes
/// after its caller went away is rolled back then) until nothing is left.
fn wait_clean(f: &KubeFixture, resolv_before: &str, what: &str) {
    let t0 = Instant::now();
    loop {
        let left = leftovers(f, resolv_before);
        if left.is_empty() {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "{what}: left behind after 15 s: {left:#?}\n{}",
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn ctrl_c_during_connect_leaves_nothing_behind() {
    let f = KubeFixture::new();
    let kubeconfig = f.user_kubeconfig();
    let resolv_before = std::fs::read_to_string(f.laptop_resolv_conf()).unwrap_or_default();
    // A first connect installs the manager and starts both daemons: the
    // interrupted ones below are as quick as the tester's (about 0.2 s).
    let t0 = Instant::now();
    f.connect_restricted();
    let full = t0.elapsed();
    f.kvpn_ok(&["disconnect", "--all"]);
    wait_clean(&f, &resolv_before, "after the first disconnect");
    // A connect with the manager installed, for the range of delays.
    let t0 = Instant::now();
    f.connect_restricted();
    let warm = t0.elapsed();
    f.kvpn_ok(&["disconnect", "--all"]);
    wait_clean(&f, &resolv_before, "after the second disconnect");
    eprintln!("connect took {full:?} (installing the manager), then {warm:?}");

    let mut interrupted = 0;
    let mut finished = 0;
    for delay_ms in (50..=400).step_by(25) {
        let child = f
            .kvpn_command(&["connect", "--kubeconfig", &kubeconfig])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn kvpn connect: {e}"));
        std::thread::sleep(Duration::from_millis(delay_ms));
        let pid = i32::try_from(child.id()).expect("pid");
        // SAFETY: kill(2) on the child this test started; it has not been waited
        // for, so the pid is still this child's.
        unsafe { libc::kill(pid, libc::SIGINT) };
        let out = child
            .wait_with_output()
            .unwrap_or_else(|e| panic!("wait kvpn connect: {e}"));
        let stderr = text(&out.stderr);
        match out.status.code() {
            Some(0) => {
                // Finished before the signal: a whole session, removed as usual.
                finished += 1;
                f.kvpn_ok(&["disconnect", "--all"]);
            }
            // 130: its own SIGINT exit; no code: killed by SIGINT before it
            // watched for it.
            Some(130) | None => interrupted += 1,
            Some(code) => panic!(
                "connect interrupted after {delay_ms} ms exited {code}: {stderr}\n{}",
                f.diagnostics()
            ),
        }
        eprintln!(
            "SIGINT after {delay_ms} ms: {:?}; {}",
            out.status.code(),
            stderr.lines().last().unwrap_or_default()
        );
        wait_clean(
            &f,
            &resolv_before,
            &format!("connect interrupted after {delay_ms} ms ({:?})", out.status),
        );
    }
    eprintln!("{interrupted} interrupted, {finished} finished before the signal");
    assert!(
        interrupted > 0,
        "no connect was interrupted (each took under 50 ms?)"
    );

    // A following connect works, and its session is the only one.
    f.connect_restricted();
    f.wait_state("connected", Duration::from_secs(15));
    assert_eq!(
        f.session_listeners().len(),
        1,
        "{:?}",
        f.session_listeners()
    );
    f.kvpn_ok(&["disconnect", "--all"]);
    wait_clean(&f, &resolv_before, "after the last disconnect");
}
