//! End-to-end: a kvpn route deleted from outside kvpn (`ip route del
//! 10.96.0.0/12 dev kvpn0` in the laptop netns, direct mode). Tester finding:
//! it was never noticed — the session stayed `connected` and curl to a
//! ClusterIP failed. Now the root daemon's route guard re-adds it within about
//! 2 s, identical to what Connect installed (protocol 107, the tunnel IP as
//! source), counts it in `routes_repaired` and logs it; after `kvpn
//! disconnect` nothing is re-added.

use std::time::{Duration, Instant};

use kvpn_lab::{SERVICE_CIDR, WEB_CLUSTER_IP};
use kvpn_tests::{Fixture, text};

/// `ip route show exact CIDR` in the laptop netns (main table), trimmed.
fn route_line(f: &Fixture, cidr: &str) -> String {
    let out = f.laptop(&["ip", "route", "show", "exact", cidr]);
    assert!(out.status.success(), "ip route show: {}", text(&out.stderr));
    text(&out.stdout).trim().to_owned()
}

fn curl_cluster_ip(f: &Fixture) -> std::process::Output {
    f.laptop(&[
        "curl",
        "-sS",
        "--max-time",
        "5",
        &format!("http://{WEB_CLUSTER_IP}/"),
    ])
}

#[test]
fn deleted_cluster_ip_route_is_put_back_as_installed() {
    let f = Fixture::connected();
    let doc = f.status_json();
    let s = &doc["sessions"][0];
    let tun = s["tun_name"].as_str().expect("TUN name").to_owned();
    let cidr = SERVICE_CIDR.to_string();
    let installed = route_line(&f, &cidr);
    assert!(
        installed.contains(&format!("dev {tun}"))
            && installed.contains("proto 107")
            && installed.contains(" src "),
        "the ClusterIP range route as Connect installed it: {installed:?}"
    );
    let out = curl_cluster_ip(&f);
    assert!(out.status.success(), "curl before: {}", text(&out.stderr));

    let out = f.laptop(&["ip", "route", "del", &cidr, "dev", &tun]);
    assert!(out.status.success(), "ip route del: {}", text(&out.stderr));
    assert_eq!(route_line(&f, &cidr), "", "the route is deleted");
    let t0 = Instant::now();
    let back = loop {
        let line = route_line(&f, &cidr);
        if !line.is_empty() {
            break line;
        }
        assert!(
            t0.elapsed() < Duration::from_millis(3500),
            "{cidr} not back {} ms after `ip route del` (session: {:#})\nroot daemon log:\n{}",
            t0.elapsed().as_millis(),
            f.status_json()["sessions"][0],
            f.daemon_log()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    eprintln!("{cidr} back after {} ms: {back}", t0.elapsed().as_millis());
    assert_eq!(back, installed, "re-added differently");

    let out = curl_cluster_ip(&f);
    assert!(
        out.status.success() && !out.stdout.is_empty(),
        "curl after the repair: {}\n{}",
        text(&out.stderr),
        f.daemon_log()
    );
    let doc = f.status_json();
    let s = &doc["sessions"][0];
    assert_eq!(s["routes_repaired"], 1, "{s:#}");
    assert_eq!(s["state"], "connected", "{s:#}");
    let table = text(&f.kvpn(&["status"]).stdout);
    assert!(
        table.contains("routes: 1 re-added after they were deleted from outside kvpn"),
        "{table}"
    );
    assert!(
        f.daemon_log()
            .contains("route of the session was deleted from outside kvpn: re-added"),
        "no warning logged:\n{}",
        f.daemon_log()
    );

    // Disconnect deletes the routes; nothing puts them back.
    f.disconnect();
    std::thread::sleep(Duration::from_secs(5));
    let left = text(&f.laptop(&["ip", "route", "show", "proto", "107"]).stdout);
    assert!(left.trim().is_empty(), "re-added after disconnect: {left}");
    let link = f.laptop(&["ip", "link", "show", "dev", &tun]);
    assert!(!link.status.success(), "{tun} still there");
}
