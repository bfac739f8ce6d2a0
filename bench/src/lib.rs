//! kvpn's benchmark harness: measures the kvpn paths, a raw-veth baseline and
//! sshuttle as the peer in the same run, on the lab, and reports ratios. Parsing of
//! the tools' output (iperf3 JSON, ping summary), the ratios and the table are pure
//! and live here; the runs are in main.rs (and the SSH peers in ssh.rs).

use serde::Serialize;

/// One path's measurements.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PathResult {
    /// Which path: "raw-veth", "kvpn-direct", "kvpn-port-forward", "kvpn-ssh" or
    /// "sshuttle".
    pub path: String,
    /// iperf3 TCP, one stream, receiver side, Gbit/s.
    pub tcp_1_gbps: f64,
    /// iperf3 TCP, four parallel streams, receiver side, Gbit/s.
    pub tcp_4_gbps: f64,
    /// ping round-trip time, average, milliseconds; `None` where the path carries
    /// no ICMP (sshuttle: TCP only).
    pub ping_avg_ms: Option<f64>,
    /// TCP request/response: 1-byte ping-pong transactions per second on one connection.
    pub rr_per_sec: f64,
}

/// Receiver throughput in Gbit/s from `iperf3 -J` output.
pub fn iperf3_receiver_gbps(json: &str) -> Result<f64, String> {
    let v: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("iperf3 JSON: {e}"))?;
    if let Some(err) = v.get("error").and_then(|e| e.as_str()) {
        return Err(format!("iperf3: {err}"));
    }
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .map(|bps| bps / 1e9)
        .ok_or_else(|| "iperf3 JSON has no end.sum_received.bits_per_second".to_string())
}

/// Average RTT in ms from ping's summary line `rtt min/avg/max/mdev = a/b/c/d ms`.
pub fn ping_avg_ms(output: &str) -> Result<f64, String> {
    let line = output
        .lines()
        .find(|l| l.contains("min/avg/max"))
        .ok_or_else(|| format!("no rtt summary in ping output: {output:?}"))?;
    let values = line.split('=').nth(1).ok_or("malformed rtt line")?;
    values
        .trim()
        .split('/')
        .nth(1)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("malformed rtt values: {values:?}"))
}

/// `a`'s figures over `b`'s, per metric (RTT: lower is better, so > 1 is slower);
/// `None` where either side has no figure.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Ratios {
    pub tcp_1: f64,
    pub tcp_4: f64,
    pub ping_rtt: Option<f64>,
    pub rr: f64,
}

impl Ratios {
    pub fn of(a: &PathResult, b: &PathResult) -> Self {
        Ratios {
            tcp_1: a.tcp_1_gbps / b.tcp_1_gbps,
            tcp_4: a.tcp_4_gbps / b.tcp_4_gbps,
            ping_rtt: a.ping_avg_ms.zip(b.ping_avg_ms).map(|(x, y)| x / y),
            rr: a.rr_per_sec / b.rr_per_sec,
        }
    }
}

fn cell(value: Option<f64>, ratio: Option<f64>, precision: usize) -> String {
    match (value, ratio) {
        (Some(v), Some(r)) => format!("{v:.precision$} ({r:.2}x)"),
        (Some(v), None) => format!("{v:.precision$}"),
        (None, _) => "n/a".to_owned(),
    }
}

/// The report table: one row per path with each figure and its ratio to `raw`
/// (the first row is `raw` itself), then, if given, the row `a / b` of ratios
/// between two paths (kvpn over SSH over sshuttle).
pub fn table(
    raw: &PathResult,
    paths: &[&PathResult],
    versus: Option<(&PathResult, &PathResult)>,
) -> String {
    let mut out = format!(
        "{:<20} {:>20} {:>20} {:>18} {:>20}\n",
        "path", "TCP 1 (Gbit/s)", "TCP 4 (Gbit/s)", "ping avg (ms)", "TCP req/resp (1/s)"
    );
    for p in std::iter::once(raw).chain(paths.iter().copied()) {
        let r = Ratios::of(p, raw);
        out.push_str(&format!(
            "{:<20} {:>20} {:>20} {:>18} {:>20}\n",
            p.path,
            cell(Some(p.tcp_1_gbps), Some(r.tcp_1), 3),
            cell(Some(p.tcp_4_gbps), Some(r.tcp_4), 3),
            cell(p.ping_avg_ms, r.ping_rtt, 3),
            cell(Some(p.rr_per_sec), Some(r.rr), 0),
        ));
    }
    if let Some((a, b)) = versus {
        let r = Ratios::of(a, b);
        let x = |v: Option<f64>| v.map_or_else(|| "n/a".to_owned(), |v| format!("{v:.2}x"));
        out.push_str(&format!(
            "{:<20} {:>20} {:>20} {:>18} {:>20}\n",
            format!("{} / {}", a.path, b.path),
            x(Some(r.tcp_1)),
            x(Some(r.tcp_4)),
            x(r.ping_rtt),
            x(Some(r.rr)),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ping_summary() {
        let out = "--- 10.244.1.11 ping statistics ---\n20 packets transmitted, 20 received, 0% packet loss, time 190ms\nrtt min/avg/max/mdev = 0.041/0.052/0.093/0.011 ms\n";
        assert_eq!(ping_avg_ms(out), Ok(0.052));
        assert!(ping_avg_ms("100% packet loss").is_err());
    }

    #[test]
    fn parses_iperf3_json() {
        let j = r#"{"end":{"sum_received":{"bits_per_second":2.2e10}}}"#;
        assert_eq!(iperf3_receiver_gbps(j), Ok(22.0));
        assert!(iperf3_receiver_gbps(r#"{"error":"unable to connect"}"#).is_err());
    }

    fn path(name: &str, g: f64, ping: Option<f64>) -> PathResult {
        PathResult {
            path: name.into(),
            tcp_1_gbps: g,
            tcp_4_gbps: 2.0 * g,
            ping_avg_ms: ping,
            rr_per_sec: 1000.0 * g,
        }
    }

    #[test]
    fn ratios_and_table_show_n_a_without_ping() {
        let raw = path("raw-veth", 20.0, Some(0.05));
        let ssh = path("kvpn-ssh", 5.0, Some(0.1));
        let shuttle = path("sshuttle", 0.5, None);
        let r = Ratios::of(&ssh, &raw);
        assert_eq!((r.tcp_1, r.ping_rtt), (0.25, Some(2.0)));
        let v = Ratios::of(&ssh, &shuttle);
        assert_eq!((v.tcp_1, v.tcp_4, v.ping_rtt), (10.0, 10.0, None));
        let t = table(&raw, &[&ssh, &shuttle], Some((&ssh, &shuttle)));
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 5, "{t}");
        assert!(lines[1].contains("20.000 (1.00x)"), "{t}");
        assert!(
            lines[2].contains("5.000 (0.25x)") && lines[2].contains("0.100 (2.00x)"),
            "{t}"
        );
        assert!(
            lines[3].starts_with("sshuttle") && lines[3].contains("n/a"),
            "{t}"
        );
        assert!(
            lines[4].starts_with("kvpn-ssh / sshuttle") && lines[4].contains("10.00x"),
            "{t}"
        );
    }
}
