//! Bench smoke: the real `kvpn-bench` harness, 1 s per measurement, brings up
//! both labs and produces every row — raw veth, kvpn direct, port-forward, kvpn over
//! SSH (the harness itself refuses a data path other than ssh-direct) and sshuttle
//! — with the table and the JSON report. It checks that the harness works, never the
//! numbers (figures on a shared machine are not a test).
//!
//! Needs the workspace binaries (`cargo build --bins`, then `KVPN_BIN_DIR`), the
//! Kubernetes binaries of `scripts/build-kubernetes.sh`, openssh-server/-client,
//! sshuttle and iptables (scripts/setup.sh).

use std::process::Command;

use kvpn_tests::text;

const PATHS: [(&str, &str); 5] = [
    ("raw_veth", "raw-veth"),
    ("kvpn_direct", "kvpn-direct"),
    ("kvpn_port_forward", "kvpn-port-forward"),
    ("kvpn_ssh", "kvpn-ssh"),
    ("sshuttle", "sshuttle"),
];

fn positive(v: &serde_json::Value, what: &str) -> f64 {
    let x = v
        .as_f64()
        .unwrap_or_else(|| panic!("{what} is not a number: {v}"));
    assert!(
        x.is_finite() && x > 0.0,
        "{what} = {x}, not a positive figure"
    );
    x
}

#[test]
fn bench_harness_produces_every_row() {
    let bench = kvpn_lab::bin_path("kvpn-bench").unwrap_or_else(|e| panic!("kvpn-bench: {e:#}"));
    let json_path =
        std::env::temp_dir().join(format!("kvpn-bench-smoke-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&json_path);
    let out = Command::new(&bench)
        .args(["--seconds", "1", "--json"])
        .arg(&json_path)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", bench.display()));
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "kvpn-bench failed ({}):\n{stdout}\n{}",
        out.status,
        text(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&json_path)
            .unwrap_or_else(|e| panic!("JSON report {}: {e}", json_path.display())),
    )
    .unwrap_or_else(|e| panic!("JSON report: {e}"));
    let _ = std::fs::remove_file(&json_path);

    for (key, name) in PATHS {
        let row = &report[key];
        assert_eq!(row["path"], name, "report[{key}]: {row}");
        for metric in ["tcp_1_gbps", "tcp_4_gbps", "rr_per_sec"] {
            positive(&row[metric], &format!("{key}.{metric}"));
        }
        // sshuttle carries TCP only: no ping figure, shown as n/a.
        if key == "sshuttle" {
            assert!(row["ping_avg_ms"].is_null(), "sshuttle ping: {row}");
        } else {
            positive(&row["ping_avg_ms"], &format!("{key}.ping_avg_ms"));
        }
        if key != "raw_veth" {
            positive(&report["ratios"][key]["tcp_1"], &format!("ratio {key}"));
        }
        // One table row per path, raw veth's own ratio 1.00x.
        let line = stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no table row for {name}:\n{stdout}"));
        if key == "raw_veth" {
            assert!(line.contains("(1.00x)"), "{line}");
        }
        if key == "sshuttle" {
            assert!(line.contains("n/a"), "{line}");
        }
    }
    let versus = &report["ratios"]["kvpn_ssh_over_sshuttle"];
    positive(&versus["tcp_1"], "kvpn-ssh / sshuttle tcp_1");
    assert!(versus["ping_rtt"].is_null(), "{versus}");
    assert!(
        stdout.contains("kvpn-ssh / sshuttle"),
        "no kvpn-ssh / sshuttle row:\n{stdout}"
    );
    assert!(
        stdout.contains("data path: [\"ssh-direct via root@"),
        "the kvpn-ssh row did not report its ssh-direct data path:\n{stdout}"
    );
}
