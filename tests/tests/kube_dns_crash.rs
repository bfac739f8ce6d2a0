//! After a SIGKILL of the root daemon the laptop's resolv.conf still names the dead
//! daemon's DNS forwarder: `kvpn status` must say so (not just "not connected"),
//! and `kvpn quit` must restore the file byte for byte without the cluster
//! (`kvpn-dataplane --repair`), instead of reporting that all is well.

use std::time::{Duration, Instant};

use kvpn_tests::kube_lab::KubeFixture;

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(") ")
            .is_some_and(|(_, r)| !r.starts_with('Z'))
    })
}

#[test]
fn status_warns_and_quit_restores_resolv_conf_after_the_daemon_was_killed() {
    let f = KubeFixture::new();
    let path = f.laptop_resolv_conf();
    let before = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    f.connect_restricted();
    f.wait_state("connected", Duration::from_secs(15));
    assert_ne!(
        std::fs::read(&path).unwrap_or_default(),
        before,
        "connect names kvpn's forwarder in resolv.conf"
    );

    let pid_file = f.runtime_dir().join("dataplane.pid");
    let pid: i32 = std::fs::read_to_string(&pid_file)
        .ok()
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("no daemon pid in {}", pid_file.display()));
    for p in std::iter::once(pid).chain(f.user_daemon_pids().into_iter().map(|p| p as i32)) {
        // SAFETY: pids of this fixture's root daemon (its pid file) and user daemon.
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    // A killed multi-threaded process shows as a zombie while its other threads
    // still hold its descriptors: wait until the socket refuses connections too.
    let socket = f.runtime_dir().join("dataplane.sock");
    let t0 = Instant::now();
    while alive(pid) || std::os::unix::net::UnixStream::connect(&socket).is_ok() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "daemon {pid} survived SIGKILL"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_ne!(std::fs::read(&path).unwrap_or_default(), before);

    let status = f.kvpn(&["status"]);
    let stderr = String::from_utf8_lossy(&status.stderr);
    assert!(
        stderr.contains("left this machine's resolv.conf pointing at its DNS forwarder")
            && stderr.contains("kvpn quit"),
        "status names the broken DNS and the fix: {stderr}"
    );

    let out = f.kvpn_ok(&["quit"]);
    assert!(out.contains("resolv.conf restored"), "{out}");
    assert!(
        !out.contains("No such process"),
        "no raw shell output: {out}"
    );
    assert_eq!(
        std::fs::read(&path).unwrap_or_default(),
        before,
        "resolv.conf restored byte for byte"
    );
    assert!(!f.runtime_dir().join("resolv.conf.kvpn-backup").exists());
    let status = f.kvpn(&["status"]);
    assert!(
        !String::from_utf8_lossy(&status.stderr).contains("resolv.conf"),
        "nothing left to warn about"
    );
}
