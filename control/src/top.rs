//! `kvpn top`: live per-route and per-Service packet and byte rates of every
//! session, from the eBPF classifier's per-entry counters (the root daemon's `Top`
//! RPC). The counters are outbound (laptop → cluster): packets the laptop sent
//! into each route.
//!
//! The rate computation and the rendering are pure ([`rates`], [`table`],
//! [`json`]); [`run`] samples the root daemon over its Unix socket and prints
//! through [`crate::output`].
//!
//! Route rows count everything the route carries, its ClusterIP entries
//! included; Service rows (a ClusterIP the route watch reported, with its
//! Services' names) count their own address only.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use kvpn_proto::dataplane::{TopRequest, TopResponse};
use serde::Serialize;

use crate::cli::{OutputFormat, TopArgs};

/// One row of `kvpn top`: a route or a ClusterIP of one session.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    /// Session id.
    pub session: String,
    /// The session's TUN device.
    pub tun: String,
    /// The entry's CIDR.
    pub cidr: String,
    /// "pod", "service" or "extra".
    pub kind: &'static str,
    /// "connect", "watch" or "service" (a ClusterIP entry).
    pub source: String,
    /// For ClusterIP entries: the Services ("namespace/name").
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub services: Vec<String>,
    /// For ClusterIP entries: the route that covers it.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub parent: String,
    /// Packets since the entry was created (route rows: with their ClusterIPs).
    pub packets: u64,
    /// Bytes (IP packet length), likewise.
    pub bytes: u64,
    /// Packets per second over the sampling interval.
    pub packets_per_sec: f64,
    /// Bytes per second over the sampling interval.
    pub bytes_per_sec: f64,
}

/// Per (session, CIDR): packets and bytes, route entries summed with their
/// ClusterIP entries.
fn totals(resp: &TopResponse) -> HashMap<(String, String), (u64, u64)> {
    let mut out = HashMap::new();
    for s in &resp.sessions {
        for e in &s.entries {
            let own = out.entry((s.id.clone(), e.cidr.clone())).or_insert((0, 0));
            own.0 += e.packets;
            own.1 += e.bytes;
            if !e.parent.is_empty() {
                let parent = out
                    .entry((s.id.clone(), e.parent.clone()))
                    .or_insert((0, 0));
                parent.0 += e.packets;
                parent.1 += e.bytes;
            }
        }
    }
    out
}

/// The rows of `now`, with rates against the earlier sample `before` (entries new
/// since then count from zero; a counter that went back, an entry recreated,
/// counts as zero).
pub fn rates(before: &TopResponse, now: &TopResponse) -> Vec<Row> {
    let seconds = now.sampled_at_us.saturating_sub(before.sampled_at_us) as f64 / 1e6;
    let old = totals(before);
    let new = totals(now);
    let mut rows = Vec::new();
    for s in &now.sessions {
        for e in &s.entries {
            let key = (s.id.clone(), e.cidr.clone());
            let (packets, bytes) = new.get(&key).copied().unwrap_or_default();
            let (p0, b0) = old.get(&key).copied().unwrap_or_default();
            let rate = |now: u64, then: u64| {
                if seconds > 0.0 {
                    now.saturating_sub(then) as f64 / seconds
                } else {
                    0.0
                }
            };
            rows.push(Row {
                session: s.id.clone(),
                tun: s.tun_name.clone(),
                cidr: e.cidr.clone(),
                kind: crate::output::kind_name(e.kind),
                source: e.source.clone(),
                services: e.services.clone(),
                parent: e.parent.clone(),
                packets,
                bytes,
                packets_per_sec: rate(packets, p0),
                bytes_per_sec: rate(bytes, b0),
            });
        }
    }
    rows
}

/// A rate in bits per second for people: `12.3 Mbit/s`.
pub fn human_bits(bytes_per_sec: f64) -> String {
    let bits = bytes_per_sec * 8.0;
    let units = [("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)];
    for (unit, scale) in units {
        if bits >= scale {
            return format!("{:.1} {unit}", bits / scale);
        }
    }
    format!("{bits:.0} bit/s")
}

/// The table for people: routes, each followed by its ClusterIP rows.
pub fn table(rows: &[Row], interval: Duration) -> String {
    let mut out = format!(
        "kvpn top — outbound (laptop → cluster) per route and Service, rates over {:.1} s\n",
        interval.as_secs_f64()
    );
    if rows.is_empty() {
        out.push_str("no sessions\n");
        return out;
    }
    out.push_str(&format!(
        "{:<14} {:<10} {:<20} {:<8} {:>12} {:>10} {:>12} {:>12}  {}\n",
        "SESSION", "TUN", "ROUTE", "KIND", "RATE", "PKT/S", "PACKETS", "BYTES", "SERVICES"
    ));
    let line = |r: &Row, cidr: String| {
        format!(
            "{:<14} {:<10} {:<20} {:<8} {:>12} {:>10.0} {:>12} {:>12}  {}\n",
            r.session,
            r.tun,
            cidr,
            r.kind,
            human_bits(r.bytes_per_sec),
            r.packets_per_sec,
            r.packets,
            r.bytes,
            r.services.join(", ")
        )
    };
    for r in rows.iter().filter(|r| r.parent.is_empty()) {
        out.push_str(&line(r, r.cidr.clone()));
        for c in rows
            .iter()
            .filter(|c| c.session == r.session && c.parent == r.cidr)
        {
            out.push_str(&line(c, format!("└ {}", c.cidr)));
        }
    }
    out
}

/// The JSON document of one refresh: `{"interval_ms": N, "rows": [...]}`.
pub fn json(rows: &[Row], interval: Duration) -> serde_json::Value {
    serde_json::json!({
        "interval_ms": u64::try_from(interval.as_millis()).unwrap_or(u64::MAX),
        "rows": rows,
    })
}

async fn sample(
    client: &mut kvpn_proto::dataplane::dataplane_client::DataplaneClient<
        crate::daemon_channel::DaemonChannel,
    >,
) -> Result<TopResponse> {
    Ok(client
        .top(TopRequest {})
        .await
        .map_err(crate::daemon::status_to_error)
        .context("cannot read the eBPF counters from the root daemon")?
        .into_inner())
}

/// `kvpn top`: sample every `--interval`, print rates; with `--once`, one
/// refresh (two samples one interval apart) and exit.
pub async fn run(runtime_dir: &Path, args: TopArgs) -> Result<()> {
    // In 0.1..=3600 s: checked by the `--interval` value parser (cli.rs).
    let interval = args.interval;
    let Some(mut client) = crate::daemon::connect_existing(runtime_dir).await? else {
        bail!(
            "no root daemon answers on {} — nothing to show; `kvpn connect` first",
            crate::daemon::socket_path(runtime_dir).display()
        );
    };
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let mut before = sample(&mut client).await?;
    loop {
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
        let now = sample(&mut client).await?;
        let rows = rates(&before, &now);
        match args.output {
            OutputFormat::Json => crate::output::info_block(&json(&rows, interval).to_string()),
            // One YAML document per sample.
            OutputFormat::Yaml => crate::output::info_block(&format!(
                "---\n{}",
                serde_yaml_ng::to_string(&json(&rows, interval))?
            )),
            OutputFormat::Table => {
                // Redraw in place on a terminal; append otherwise (a pipe, a log).
                let clear = if terminal && !args.once {
                    "\x1b[H\x1b[2J"
                } else {
                    ""
                };
                crate::output::info_block(&format!("{clear}{}", table(&rows, interval)));
            }
        }
        if args.once {
            return Ok(());
        }
        before = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpn_proto::dataplane::{RouteKind, TopEntry, TopSession};

    fn entry(cidr: &str, kind: RouteKind, parent: &str, packets: u64, bytes: u64) -> TopEntry {
        TopEntry {
            cidr: cidr.into(),
            kind: kind as i32,
            source: if parent.is_empty() {
                "connect"
            } else {
                "service"
            }
            .into(),
            services: if parent.is_empty() {
                vec![]
            } else {
                vec!["default/web".into()]
            },
            parent: parent.into(),
            packets,
            bytes,
        }
    }

    fn resp(at_us: u64, entries: Vec<TopEntry>) -> TopResponse {
        TopResponse {
            sampled_at_us: at_us,
            sessions: vec![TopSession {
                id: "s1".into(),
                tun_name: "kvpn0".into(),
                entries,
                ..Default::default()
            }],
        }
    }

    #[test]
    fn route_rates_include_their_cluster_ips() {
        let before = resp(
            1_000_000,
            vec![
                entry("10.96.0.0/12", RouteKind::Service, "", 10, 1_000),
                entry("10.96.0.100/32", RouteKind::Service, "10.96.0.0/12", 5, 500),
            ],
        );
        let now = resp(
            3_000_000,
            vec![
                entry("10.96.0.0/12", RouteKind::Service, "", 30, 3_000),
                entry(
                    "10.96.0.100/32",
                    RouteKind::Service,
                    "10.96.0.0/12",
                    25,
                    40_500,
                ),
            ],
        );
        let rows = rates(&before, &now);
        assert_eq!(rows.len(), 2);
        // Route: (30 + 25) - (10 + 5) = 40 packets in 2 s; (3000 + 40500) - 1500 bytes.
        assert_eq!(rows[0].packets, 55);
        assert!((rows[0].packets_per_sec - 20.0).abs() < 1e-9);
        assert!((rows[0].bytes_per_sec - 21_000.0).abs() < 1e-9);
        // ClusterIP: 20 packets, 40000 bytes in 2 s.
        assert!((rows[1].packets_per_sec - 10.0).abs() < 1e-9);
        assert!((rows[1].bytes_per_sec - 20_000.0).abs() < 1e-9);
        assert_eq!(rows[1].services, vec!["default/web".to_owned()]);
        let text = table(&rows, Duration::from_secs(2));
        assert!(text.contains("└ 10.96.0.100/32"), "{text}");
        assert!(text.contains("168.0 kbit/s"), "{text}");
    }

    #[test]
    fn new_and_reset_entries_do_not_go_negative() {
        let before = resp(
            0,
            vec![entry("10.244.0.0/16", RouteKind::Pod, "", 100, 100)],
        );
        let now = resp(
            1_000_000,
            vec![
                entry("10.244.0.0/16", RouteKind::Pod, "", 3, 3),
                entry("10.1.0.0/16", RouteKind::Extra, "", 7, 70),
            ],
        );
        let rows = rates(&before, &now);
        assert_eq!(rows[0].packets_per_sec, 0.0);
        assert!((rows[1].bytes_per_sec - 70.0).abs() < 1e-9);
        let same_instant = rates(&now, &now);
        assert!(same_instant.iter().all(|r| r.packets_per_sec == 0.0));
    }

    #[test]
    fn human_bits_picks_a_unit() {
        assert_eq!(human_bits(0.0), "0 bit/s");
        assert_eq!(human_bits(125.0), "1.0 kbit/s");
        assert_eq!(human_bits(1.5e9 / 8.0), "1.5 Gbit/s");
    }
}
