//! Issue #10 item 5, the CI version of `./x soak`: the real soak driver
//! (`kvpn-soak`, the binary the xtask runs) for 60 seconds on a fresh
//! Kubernetes lab — TCP (curl by Service name), UDP echo and DNS from the
//! laptop netns; SIGKILL of the user daemon and of the root daemon, a manager
//! pod deletion and transport kills — must exit 0 (every bound held), and its
//! JSON report must add up: requests of every kind, each one accounted for
//! (started = ok + failed, none hung), failures only inside fault windows that
//! closed within the bound, daemons' fds not grown, residue none.

use std::process::Command;

use kvpn_tests::text;
use serde_json::Value;

const SECONDS: u64 = 60;

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

#[test]
fn soak_60_seconds_every_request_accounted_and_bounds_hold() {
    let dir = std::env::temp_dir().join(format!("kvpn-soak-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let json_path = dir.join("soak.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvpn-soak"))
        .args(["--seconds", &SECONDS.to_string(), "--json"])
        .arg(&json_path)
        .output()
        .unwrap_or_else(|e| panic!("run kvpn-soak: {e}"));
    let table = text(&out.stdout);
    eprintln!("{table}");
    let report_text = std::fs::read_to_string(&json_path).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "kvpn-soak failed ({}):\n{table}\n{}\n{report_text}",
        out.status,
        text(&out.stderr)
    );
    let r: Value = serde_json::from_str(&report_text)
        .unwrap_or_else(|e| panic!("soak JSON report: {e}: {report_text}"));
    assert_eq!(r["ok"], true, "{r:#}");
    assert_eq!(r["violations"], serde_json::json!([]), "{r:#}");
    assert!(
        r["duration_s"].as_f64().unwrap_or(0.0) >= SECONDS as f64,
        "ran its time: {r:#}"
    );

    // Every request accounted for, of every kind.
    for kind in ["tcp", "udp", "dns"] {
        let k = &r["requests"][kind];
        let (started, total, ok, failed, hung) = (
            n(&k["started"]),
            n(&k["total"]),
            n(&k["ok"]),
            n(&k["failed"]),
            n(&k["hung"]),
        );
        // 4 requests/s for 60 s, less what slow (failing) requests took.
        assert!(ok >= 100, "{kind}: only {ok} requests succeeded: {k:#}");
        assert_eq!(
            started, total,
            "{kind}: every started request has an outcome"
        );
        assert_eq!(total, ok + failed + hung, "{kind}: {k:#}");
        assert_eq!(hung, 0, "{kind}: no request hung");
        let by_class: u64 = k["failures"]
            .as_object()
            .map(|m| m.values().map(n).sum())
            .unwrap_or(0);
        assert_eq!(by_class, failed, "{kind}: every failure has a class: {k:#}");
        assert!(
            n(&k["max_ms"]) <= 8000,
            "{kind}: a request outlived its deadline: {k:#}"
        );
    }

    // The faults happened and each outage ended within the bound.
    let faults = r["faults"].as_array().cloned().unwrap_or_default();
    let names: Vec<&str> = faults.iter().filter_map(|f| f["fault"].as_str()).collect();
    for want in [
        "SIGKILL user daemon",
        "SIGKILL root daemon",
        "delete manager pod",
        "transport kill (root daemon",
        "transport kill (port-forward",
    ] {
        assert!(
            names.iter().any(|n| n.starts_with(want)),
            "fault {want:?} missing: {names:?}"
        );
    }
    let bound = r["bounds"]["recover_within_s"].as_f64().unwrap_or(0.0);
    for f in &faults {
        let rec = f["recovery_s"]
            .as_f64()
            .unwrap_or_else(|| panic!("no recovery: {f:#}"));
        assert!(rec <= bound, "{f:#}");
    }
    let failed_total: u64 = ["tcp", "udp", "dns"]
        .iter()
        .map(|k| n(&r["requests"][*k]["failed"]))
        .sum();
    let failed_in_windows: u64 = faults.iter().map(|f| n(&f["failed_requests"])).sum();
    assert!(
        failed_in_windows >= failed_total,
        "every failure falls in a fault's window: {failed_total} failed, {failed_in_windows} in windows"
    );

    // Reconnects: each transport kill and the pod deletion made the root daemon
    // re-dial; the user daemon restored its session once; one full reconnect.
    let rc = &r["reconnects"];
    assert!(
        // at least one per transport kill, plus the pod deletion
        n(&rc["root_daemon_redials"]) > n(&rc["transport_kills"]),
        "{rc:#}"
    );
    assert_eq!(n(&rc["user_daemon_restores"]), 1, "{rc:#}");
    assert_eq!(n(&rc["reconnects_by_connect"]), 1, "{rc:#}");

    // The same processes at both checkpoints; fds and memory within their bounds.
    let procs = r["processes"].as_array().cloned().unwrap_or_default();
    assert_eq!(procs.len(), 3, "{procs:#?}");
    let growth = n(&r["bounds"]["rss_growth_bytes"]);
    for p in &procs {
        assert_eq!(p["pid_start"], p["pid_end"], "{p:#}");
        assert!(n(&p["rss_start_bytes"]) > 0, "{p:#}");
        assert!(
            n(&p["rss_end_bytes"]) <= n(&p["rss_start_bytes"]) + growth,
            "{p:#}"
        );
        // fds_allowed_end is the bound (tests/src/soak.rs: the manager's loose
        // one; a daemon's start plus DAEMON_FD_SLACK).
        assert!(n(&p["fds_end"]) <= n(&p["fds_allowed_end"]), "{p:#}");
    }
    assert_eq!(r["residue_clean"], true, "{r:#}");
}
