//! After a SIGKILL of the root daemon the laptop's resolv.conf still names the dead
//! daemon's DNS forwarder: `kvpn status` must say so (not just "not connected"),
//! and `kvpn quit` must restore the file byte for byte without the cluster
//! (`kvpn-dataplane --repair`), instead of reporting that all is well. So must
//! `kvpn disconnect` (an id or `--all`), which the warning names too.

use std::time::Duration;

use kvpn_tests::dns_lab::{kill_daemon_and_agents, kill_root_daemon};
use kvpn_tests::kube_lab::KubeFixture;

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

    kill_daemon_and_agents(&f);
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
    assert_restored(&f, &path, &before, "quit");
}

/// resolv.conf is `before` byte for byte, kvpn's backup of it is gone and
/// `kvpn status` has nothing left to warn about (`what` restored it).
fn assert_restored(f: &KubeFixture, path: &std::path::Path, before: &[u8], what: &str) {
    assert_eq!(
        std::fs::read(path).unwrap_or_default(),
        before,
        "{what}: resolv.conf restored byte for byte"
    );
    assert!(!f.runtime_dir().join("resolv.conf.kvpn-backup").exists());
    let status = f.kvpn(&["status", "-o", "json"]);
    assert!(
        !String::from_utf8_lossy(&status.stderr).contains("resolv.conf"),
        "{what}: nothing left to warn about"
    );
}

/// Tester finding: with only the root daemon killed, `kvpn disconnect ID`
/// printed "Disconnected session …" and `disconnect --all` nothing, and both
/// left resolv.conf naming the dead forwarder although the status warning
/// recommends them. Both now repair it as quit does, and say so.
#[test]
fn disconnect_restores_resolv_conf_after_the_root_daemon_was_killed() {
    let f = KubeFixture::new();
    let path = f.laptop_resolv_conf();
    let before = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    for how in ["id", "--all"] {
        f.connect_restricted();
        f.wait_state("connected", Duration::from_secs(15));
        let id = f.session()["id"].as_str().unwrap_or_default().to_owned();
        assert_ne!(std::fs::read(&path).unwrap_or_default(), before);
        kill_root_daemon(&f);
        let status = f.kvpn(&["status"]);
        let stderr = String::from_utf8_lossy(&status.stderr);
        assert!(
            stderr.contains("kvpn disconnect"),
            "status recommends disconnect: {stderr}"
        );
        let out = if how == "id" {
            f.kvpn_ok(&["disconnect", &id])
        } else {
            f.kvpn_ok(&["disconnect", "--all"])
        };
        assert!(
            out.contains("resolv.conf restored") && out.contains(&id),
            "disconnect {how} says what it did: {out}"
        );
        assert!(
            !out.contains("TUN device, routes"),
            "no claim of removing what died with the root daemon: {out}"
        );
        assert_restored(&f, &path, &before, &format!("disconnect {how}\n{out}"));
        let status = f.kvpn(&["status", "-o", "json"]);
        let doc: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap_or_default();
        assert_eq!(doc["sessions"], serde_json::json!([]), "{doc:#}");
        assert!(f.tun_devices().is_empty(), "{:?}", f.tun_devices());
    }
}
