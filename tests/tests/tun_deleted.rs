//! End-to-end: the session's TUN device deleted from outside kvpn (`ip link
//! del kvpn0` in the laptop netns while connected, direct mode). Tester
//! finding: the session stayed `reconnecting` for ever and re-dialled the
//! manager every 2 s. Now each worker whose TUN queue fails because the device
//! is gone is `failed`, with a reason naming the device, the cause and the fix
//! (`kvpn disconnect ID`, then `kvpn connect`); its data connection is closed,
//! nothing is re-dialled and the device is not recreated. `kvpn disconnect
//! ID` and a new connect then work, and a ClusterIP answers again.

use std::time::{Duration, Instant};

use kvpn_lab::{MANAGER_ADDR_FROM_LAPTOP, WEB_CLUSTER_IP};
use kvpn_tests::{Fixture, text};

/// `curl` of the lab's web Service by its ClusterIP from the laptop.
fn curl_cluster_ip(f: &Fixture) -> std::process::Output {
    f.laptop(&[
        "curl",
        "-sS",
        "--max-time",
        "5",
        &format!("http://{WEB_CLUSTER_IP}/"),
    ])
}

fn assert_cluster_ip_answers(f: &Fixture, when: &str) {
    let out = curl_cluster_ip(f);
    assert!(
        out.status.success() && !out.stdout.is_empty(),
        "{when}: curl http://{WEB_CLUSTER_IP}/ failed: {}\nroot daemon log:\n{}",
        text(&out.stderr),
        f.daemon_log()
    );
}

/// Root daemon log lines that tell of a re-dial.
fn redial_lines(f: &Fixture) -> Vec<String> {
    f.daemon_log()
        .lines()
        .filter(|l| l.contains("re-dial") || l.contains("re-established"))
        .map(str::to_owned)
        .collect()
}

/// The laptop's established TCP connections to the manager (the root
/// daemon's data connections).
fn data_connections(f: &Fixture) -> Vec<String> {
    let out = f.laptop(&[
        "ss",
        "-tnH",
        "state",
        "established",
        "dst",
        &MANAGER_ADDR_FROM_LAPTOP.to_string(),
    ]);
    text(&out.stdout)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_owned)
        .collect()
}

fn session(f: &Fixture) -> serde_json::Value {
    let doc = f.status_json();
    let sessions = doc["sessions"].as_array().cloned().unwrap_or_default();
    assert_eq!(sessions.len(), 1, "{doc:#}");
    sessions[0].clone()
}

fn wait_connected(f: &Fixture, workers: u64) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = session(f);
        if s["state"] == "connected" && s["workers_connected"] == workers {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "not connected with {workers} workers: {s:#}\n{}",
            f.daemon_log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn tun_deleted(workers: u64) {
    let f = Fixture::new();
    let flags = ["--workers".to_owned(), workers.to_string()];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    f.connect_with(&flags);
    let s = wait_connected(&f, workers);
    let id = s["id"].as_str().expect("session id").to_owned();
    let tun = s["tun_name"].as_str().expect("TUN name").to_owned();
    assert_cluster_ip_answers(&f, "before the TUN device was deleted");
    assert_eq!(data_connections(&f).len() as u64, workers, "one per worker");

    let out = f.laptop(&["ip", "link", "del", &tun]);
    assert!(
        out.status.success(),
        "ip link del {tun}: {}",
        text(&out.stderr)
    );
    let t0 = Instant::now();
    let failed = loop {
        let s = session(&f);
        if s["state"] == "failed" {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "not failed 5 s after `ip link del {tun}`: {s:#}\nroot daemon log:\n{}",
            f.daemon_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!(
        "failed {} ms after the deletion: {}",
        t0.elapsed().as_millis(),
        failed["reason"]
    );
    let reason = failed["reason"].as_str().unwrap_or_default();
    for part in [
        format!("(e.g. `ip link del {tun}`;"),
        format!("TUN device {tun} was deleted"),
        format!("`kvpn disconnect {id}`, then `kvpn connect`"),
    ] {
        assert!(
            reason.contains(&part),
            "{part:?} not in the reason: {reason}"
        );
    }

    // Nothing re-dialled for 5 s, every data connection closed, no device
    // recreated, and the state stays failed.
    std::thread::sleep(Duration::from_millis(500));
    let before = redial_lines(&f);
    std::thread::sleep(Duration::from_secs(5));
    let after = redial_lines(&f);
    assert_eq!(
        after.len(),
        before.len(),
        "re-dialled after the TUN device was deleted:\n{}",
        after.get(before.len()..).unwrap_or_default().join("\n")
    );
    let s = session(&f);
    assert_eq!(s["state"], "failed", "{s:#}");
    assert_eq!(s["workers_connected"], 0, "{s:#}");
    assert!(
        data_connections(&f).is_empty(),
        "data connections still open: {:?}",
        data_connections(&f)
    );
    let link = f.laptop(&["ip", "link", "show", "dev", &tun]);
    assert!(
        !link.status.success(),
        "{tun} was recreated: {}",
        text(&link.stdout)
    );

    // The fix the reason names works.
    let out = f.kvpn(&["disconnect", &id]);
    assert!(
        out.status.success(),
        "kvpn disconnect {id}: {}{}\n{}",
        text(&out.stdout),
        text(&out.stderr),
        f.daemon_log()
    );
    assert!(
        f.status_json()["sessions"]
            .as_array()
            .is_none_or(|s| s.is_empty()),
        "session left after disconnect"
    );
    f.connect_with(&flags);
    wait_connected(&f, workers);
    assert_cluster_ip_answers(&f, "after disconnect and a new connect");
    f.disconnect();
}

#[test]
fn deleted_tun_device_fails_the_session_without_redialling() {
    tun_deleted(1);
}

/// `--workers 2`: both TUN queues go with the device; both workers fail.
#[test]
fn deleted_tun_device_fails_both_workers() {
    tun_deleted(2);
}
