//! Issue 29 item 12: after a SIGKILL of the root daemon alone (an OOM kill, a
//! crash), the laptop's own names resolve again within a few seconds with no
//! kvpn command run: the daemon's DNS guard (`dataplane/src/dns/guard.rs`), a
//! separate process that sees the daemon's pipe close, restores resolv.conf
//! byte for byte, logs it to the daemon's log and leaves a note `kvpn status`
//! shows (table on stderr, `-o json` under `root_daemon.dns_guard`).
//!
//! The laptop's resolver is dnsmasq in the laptop netns ([`Upstream`]); `getent`
//! and `dig` in the laptop netns read the laptop netns's resolv.conf.

use std::time::{Duration, Instant};

use kvpn_tests::dns_lab::*;
use kvpn_tests::kube_lab::KubeFixture;
use kvpn_tests::text;

/// How long after the kill the laptop's own names must resolve again.
const BOUND: Duration = Duration::from_secs(3);

#[test]
fn laptop_names_resolve_again_after_the_root_daemon_is_sigkilled_with_no_kvpn_command() {
    let f = KubeFixture::new();
    let _upstream = Upstream::start(&f);
    let path = write_laptop_resolv(&f, LAPTOP_RESOLV);
    let out = connect_default(&f);
    assert!(out.contains("DNS: forwarder on 127.0.0.153:53"), "{out}");
    wait_cluster_name(&f, "web.default.svc.cluster.local");
    let web = cluster_ip(&f, "default", "web");
    assert_eq!(getent(&f, "web").as_deref(), Some(web.as_str()));
    assert!(
        std::fs::read_to_string(&path)
            .unwrap_or_default()
            .contains(&format!("nameserver {FORWARDER}")),
        "connect names kvpn's forwarder"
    );
    let guard = dns_guard_pid(&f)
        .unwrap_or_else(|| panic!("no DNS guard runs for the root daemon\n{}", f.diagnostics()));

    let pid = kill_root_daemon_only(&f);
    let killed = Instant::now();
    // No kvpn command from here until the laptop's names work again.
    let took = loop {
        let now = std::fs::read(&path).unwrap_or_default();
        if now == LAPTOP_RESOLV && getent(&f, CORP_HOST.0).as_deref() == Some(CORP_HOST.1) {
            break killed.elapsed();
        }
        let last = String::from_utf8_lossy(&now);
        assert!(
            killed.elapsed() < BOUND,
            "{BOUND:?} after SIGKILL of the root daemon {pid} the laptop's names still fail; \
             resolv.conf:\n{last}\nlog:\n{}",
            std::fs::read_to_string(f.runtime_dir().join("dataplane.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    eprintln!("laptop names back {took:?} after the SIGKILL");
    let d = dig(&f, &[PUBLIC_HOST.0]);
    assert_eq!(d.a(), vec![PUBLIC_HOST.1.to_owned()], "{}", d.raw);

    // The guard's work is done: it exits, and says what it did in the log.
    let t0 = Instant::now();
    while std::path::Path::new(&format!("/proc/{guard}/cmdline")).exists()
        && std::fs::read_to_string(format!("/proc/{guard}/cmdline"))
            .is_ok_and(|c| c.contains("--dns-guard"))
    {
        assert!(t0.elapsed() < BOUND, "the DNS guard {guard} did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = std::fs::read_to_string(f.runtime_dir().join("dataplane.log")).unwrap_or_default();
    assert!(
        log.contains(&format!(
            "the root daemon (pid {pid}) died without cleaning up"
        )) && log.contains("DNS guard"),
        "the log says what the guard did:\n{log}"
    );

    // Status says so, in the table and in the JSON document.
    let status = f.kvpn(&["status"]);
    let stderr = text(&status.stderr);
    assert!(
        stderr.contains(&format!("pid {pid}"))
            && stderr.contains("DNS guard")
            && stderr.contains("restored"),
        "status says the guard restored resolv.conf: {stderr}"
    );
    assert!(
        !stderr.contains("kvpn quit"),
        "nothing left for the user to repair: {stderr}"
    );
    let json = f.kvpn(&["status", "-o", "json"]);
    let doc: serde_json::Value = serde_json::from_slice(&json.stdout)
        .unwrap_or_else(|e| panic!("status JSON: {e}: {}", text(&json.stdout)));
    let note = &doc["root_daemon"]["dns_guard"];
    assert_eq!(note["daemon_pid"], pid, "{doc:#}");
    assert_eq!(note["resolv_conf_outcome"], "restored", "{doc:#}");

    // `kvpn quit` has nothing left to restore; the next connect works.
    let out = f.kvpn_ok(&["quit"]);
    assert!(!out.contains("resolv.conf restored"), "{out}");
    assert_eq!(std::fs::read(&path).unwrap_or_default(), LAPTOP_RESOLV);
    connect_default(&f);
    assert_eq!(getent(&f, "web").as_deref(), Some(web.as_str()));
    f.kvpn_ok(&["disconnect", "--all"]);
    assert_eq!(
        std::fs::read(&path).unwrap_or_default(),
        LAPTOP_RESOLV,
        "disconnect restores the file byte for byte"
    );
}
