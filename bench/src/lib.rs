//! kvpn's benchmark harness: measures the kvpn path and a raw-veth baseline in
//! the same run, on the lab, and reports ratios. Parsing of the tools' output
//! (iperf3 JSON, ping summary) is pure and lives here; the runs are in main.rs.

use serde::Serialize;

/// One path's measurements.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PathResult {
    /// Which path: "raw-veth", "kvpn-direct" or "kvpn-port-forward".
    pub path: String,
    /// iperf3 TCP, one stream, receiver side, Gbit/s.
    pub tcp_1_gbps: f64,
    /// iperf3 TCP, four parallel streams, receiver side, Gbit/s.
    pub tcp_4_gbps: f64,
    /// ping round-trip time, average, milliseconds.
    pub ping_avg_ms: f64,
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
}
