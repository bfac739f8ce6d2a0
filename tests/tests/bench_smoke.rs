//! Bench smoke: the real `kvpn-bench` harness, one round of 1 s per measurement,
//! brings up both labs and produces every row — flood fairness between two laptops,
//! raw veth (both labs), kvpn direct,
//! kvpn direct with 10,000 extra routes (the harness falls back to 1,000 for old
//! binaries; here that fails the test), socat, and on the Kubernetes lab's two real
//! nodes raw port-forward (`kubectl port-forward`), kvpn port-forward, kvpn over SSH (the harness
//! itself refuses a data path other than ssh-direct) and sshuttle — with every metric
//! each row must carry, the markdown table, the SVG chart, the JSON report and the #8
//! goal lines (`--compare` is unit-tested in kvpn-bench). It checks that the harness
//! works, never the numbers (figures on a shared machine are not a test), and passes
//! `--force`: CI machines are busy, and the load gate is unit-tested in kvpn-bench.
//!
//! Needs the workspace binaries (`cargo build --bins`, then `KVPN_BIN_DIR`), the
//! Kubernetes binaries of `scripts/build-kubernetes.sh`, openssh-server/-client,
//! sshuttle, socat and iptables (scripts/setup.sh).

use kvpn_tests::text;

/// Every row, and the metrics it must have (positive and finite).
const TCP: [&str; 9] = [
    "tcp_1_gbps",
    "tcp_4_gbps",
    "tcp_8_gbps",
    "tcp_1_down_gbps",
    "tcp_4_down_gbps",
    "tcp_8_down_gbps",
    "tcp_4_over_1",
    "rr_per_sec",
    "connects_per_sec",
];
const ICMP_UDP: [&str; 3] = ["idle_rtt_p50_ms", "busy_rtt_p50_ms", "udp64_pps"];
const KVPN: [&str; 4] = [
    "kvpn_cpu_core_s_per_gbit",
    "manager_rss_mib",
    "connect_s",
    "cpu_core_s_per_gbit",
];

fn row<'a>(report: &'a serde_json::Value, path: &str) -> &'a serde_json::Value {
    report["rows"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["path"] == path))
        .unwrap_or_else(|| panic!("no row {path} in the report: {}", report["rows"]))
}

/// The metric's summary: median, min and max finite, min ≤ median ≤ max, one sample
/// (one round); positive unless `zero_ok`.
fn check(report: &serde_json::Value, path: &str, key: &str, zero_ok: bool) -> f64 {
    let m = &row(report, path)["metrics"][key];
    let f = |k: &str| {
        m[k].as_f64()
            .unwrap_or_else(|| panic!("{path}.{key}.{k} is not a number: {m}"))
    };
    let (median, min, max) = (f("median"), f("min"), f("max"));
    assert!(
        median.is_finite() && min <= median && median <= max,
        "{path}.{key}: {m}"
    );
    assert!(
        median > 0.0 || (zero_ok && median == 0.0),
        "{path}.{key} = {median}, not a positive figure"
    );
    assert_eq!(
        m["samples"].as_array().map(Vec::len),
        Some(1),
        "{path}.{key}: {m}"
    );
    median
}

fn absent(report: &serde_json::Value, path: &str, key: &str) {
    assert!(
        row(report, path)["metrics"].get(key).is_none(),
        "{path} has {key}, which its path cannot carry"
    );
}

#[test]
fn bench_harness_produces_every_row_and_metric() {
    let out_dir = std::env::temp_dir().join(format!("kvpn-bench-smoke-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out_dir);
    let out = kvpn_tests::short_bench(&out_dir)
        .output()
        .unwrap_or_else(|e| panic!("run kvpn-bench: {e}"));
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "kvpn-bench failed ({}):\n{stdout}\n{}",
        out.status,
        text(&out.stderr)
    );
    let json_path = out_dir.join("kvpn-bench.json");
    let report: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&json_path)
            .unwrap_or_else(|e| panic!("JSON report {}: {e}", json_path.display())),
    )
    .unwrap_or_else(|e| panic!("JSON report: {e}"));

    for path in ["raw-veth", "raw-veth-k8s"] {
        for key in TCP.iter().chain(&ICMP_UDP).chain(&["cpu_core_s_per_gbit"]) {
            check(&report, path, key, false);
        }
        check(&report, path, "udp64_loss_pct", true);
        absent(&report, path, "tcp_1_vs_raw");
        absent(&report, path, "manager_rss_mib");
    }
    // The classifier row ran with the 10,000 routes, not the fallback.
    assert_eq!(
        check(&report, "kvpn-direct-many-routes", "extra_routes", false),
        10_000.0,
        "the classifier row fell back to fewer routes (notes: {})",
        report["notes"]
    );
    // kvpn direct starts on a fresh manager and opens its idle flows before the
    // bulk runs: both memory figures are the session's own, never 0.
    check(&report, "kvpn-direct", "manager_session_kib", false);
    check(&report, "kvpn-direct", "manager_kib_per_idle_flow", false);
    for path in ["kvpn-direct", "kvpn-port-forward", "kvpn-ssh"] {
        for key in TCP.iter().chain(&ICMP_UDP).chain(&KVPN) {
            check(&report, path, key, false);
        }
        check(&report, path, "udp64_loss_pct", true);
        check(&report, path, "tcp_1_vs_raw", false);
        // RTT added over the baseline may be negative by noise, never missing.
        for key in ["idle_rtt_added_us", "busy_rtt_added_us"] {
            let m = &row(&report, path)["metrics"][key]["median"];
            assert!(m.as_f64().is_some_and(f64::is_finite), "{path}.{key}: {m}");
        }
    }
    // The Kubernetes lab's manager serves every row: growth over it is no
    // session's figure, so it is "not measured", never a 0; the idle flows are.
    for path in ["kvpn-port-forward", "kvpn-ssh"] {
        check(&report, path, "manager_kib_per_idle_flow", true);
        absent(&report, path, "manager_session_kib");
        let unmeasured = &row(&report, path)["not_measured"];
        assert!(
            unmeasured
                .as_array()
                .is_some_and(|k| k.iter().any(|k| k == "manager_session_kib")),
            "{path}: manager_session_kib is not listed as not measured: {unmeasured}"
        );
    }
    // Flood fairness (bench/src/fairness.rs): laptop B alone and under laptop
    // A's SYN and UDP floods, and how much of A's flood its limits refused.
    for key in [
        "fair_alone_gbps",
        "fair_syn_gbps",
        "fair_udp_gbps",
        "fair_syn_vs_alone",
        "fair_udp_vs_alone",
        "flood_limited_pct",
        "fair_alone_manager_core_s_per_gbit",
        "fair_syn_manager_core_s_per_gbit",
        "fair_udp_manager_core_s_per_gbit",
    ] {
        check(&report, "kvpn-fairness", key, false);
    }
    // The port-forward rows next to the transport's own limit (a plain kubectl
    // port-forward to the same pod on the real nodes).
    for key in ["tcp_1_vs_raw_port_forward", "tcp_4_vs_raw_port_forward"] {
        check(&report, "kvpn-port-forward", key, false);
    }
    check(&report, "kvpn-ssh", "tcp_1_vs_sshuttle", false);
    check(&report, "kvpn-port-forward", "tcp_1_vs_sshuttle", false);
    for key in [
        "tcp_1_gbps",
        "connect_s",
        "idle_rtt_p50_ms",
        "tcp_1_vs_1_route",
    ] {
        check(&report, "kvpn-direct-many-routes", key, false);
    }
    // TCP-only peers: every TCP figure, no ICMP, UDP or kvpn figure.
    for path in ["socat", "sshuttle", "raw-port-forward"] {
        for key in TCP.iter().chain(&["cpu_core_s_per_gbit", "tcp_1_vs_raw"]) {
            check(&report, path, key, false);
        }
        for key in ICMP_UDP.iter().chain(&["manager_rss_mib"]) {
            absent(&report, path, key);
        }
    }
    assert_eq!(report["rounds"], 1);
    assert_eq!(report["load"]["max_busy_threshold"], 0.25);
    assert!(
        report["load"]["samples"].as_array().map(Vec::len) == Some(5),
        "one load sample before each lab's round (the plain lab's fairness round too) and \
         after each lab's last: {}",
        report["load"]
    );
    assert!(
        stdout.contains("outside CPU load: at most ")
            && stdout.contains("(threshold --max-busy 25%)"),
        "the load and its threshold are not reported:\n{stdout}"
    );

    // The goals: one line each, met or not (never asserted: not a test of figures).
    let goals = report["goals"].as_array().expect("goals list");
    assert_eq!(goals.len(), 13, "{goals:?}");
    for g in goals {
        assert!(
            g["value"].as_f64().is_some_and(f64::is_finite),
            "goal without a figure: {g}"
        );
        let name = g["name"].as_str().expect("goal name");
        assert!(
            stdout.contains(&format!("goal met: {name}"))
                || stdout.contains(&format!("goal NOT met: {name}")),
            "no goal line for {name}:\n{stdout}"
        );
    }

    // The markdown table has a column per row, the chart a bar group per row.
    let md = std::fs::read_to_string(out_dir.join("bench.md")).expect("bench.md");
    let header = md
        .lines()
        .find(|l| l.starts_with("| metric | unit |"))
        .unwrap_or_else(|| panic!("no table in bench.md:\n{md}"));
    for path in [
        "kvpn-fairness",
        "raw-veth",
        "kvpn-direct",
        "kvpn-direct-many-routes",
        "socat",
        "raw-veth-k8s",
        "raw-port-forward",
        "kvpn-port-forward",
        "kvpn-ssh",
        "sshuttle",
    ] {
        assert!(header.contains(&format!(" {path} |")), "{header}");
    }
    assert!(md.contains("| TCP 8 streams down | Gbit/s |"), "{md}");
    let session_line = md
        .lines()
        .find(|l| l.starts_with("| manager RSS added by the session | KiB |"))
        .unwrap_or_else(|| panic!("no session memory line in bench.md:\n{md}"));
    assert!(session_line.contains(" not measured |"), "{session_line}");
    assert!(
        md.contains("| extra /32 routes installed by the connect | routes |"),
        "{md}"
    );

    assert!(md.contains("goal "), "{md}");
    let svg = std::fs::read_to_string(out_dir.join("bench.svg")).expect("bench.svg");
    assert!(
        svg.starts_with("<svg") && svg.contains(">sshuttle</text>"),
        "{svg}"
    );
    assert!(
        stdout.contains("data path: [\"ssh-direct via root@"),
        "the kvpn-ssh row did not report its ssh-direct data path:\n{stdout}"
    );
    let _ = std::fs::remove_dir_all(&out_dir);
}
