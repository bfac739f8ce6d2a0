//! Everything `kvpn` prints for the user. The only module allowed to write to stdout.
#![allow(clippy::print_stdout, reason = "this module is the CLI's output")]

use std::io::Write as _;

/// `println!` that ignores a closed stdout (`kvpn status | head`) instead of panicking.
macro_rules! println {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

use std::path::Path;

use anyhow::Result;
use kvpn_proto::dataplane::{RouteKind, StatusResponse};

use crate::cli::OutputFormat;

/// A step of a long operation is starting.
pub fn step(msg: &str) {
    println!("• {msg}…");
}

/// A step finished.
pub fn done(msg: &str) {
    println!("✓ {msg}");
}

/// A detail line under a step.
pub fn detail(msg: &str) {
    println!("    {msg}");
}

/// A block of text as it is (e.g. the lab's description).
pub fn info_block(text: &str) {
    println!("{}", text.trim_end());
}

/// A warning, on stderr.
pub fn warn(msg: &str) {
    eprintln!("kvpn: warning: {msg}");
}

/// An error, on stderr.
pub fn error(msg: &str) {
    eprintln!("kvpn: error: {msg}");
}

/// Human name of a route kind.
pub fn kind_name(kind: i32) -> &'static str {
    match RouteKind::try_from(kind) {
        Ok(RouteKind::Pod) => "pod",
        Ok(RouteKind::Service) => "service",
        Ok(RouteKind::Extra) => "extra",
        _ => "unknown",
    }
}

/// `kvpn status` when no root daemon runs.
pub fn not_running(runtime_dir: &Path, format: OutputFormat) {
    match format {
        OutputFormat::Json => println!("{{\"sessions\":[]}}"),
        OutputFormat::Table => println!(
            "Not connected (no root daemon answers on {})",
            crate::daemon::socket_path(runtime_dir).display()
        ),
    }
    if crate::daemon::dns_left_changed(runtime_dir) {
        warn(
            "the root daemon died and left this machine's resolv.conf pointing at its DNS \
             forwarder, so name lookups fail — run `kvpn quit` (or `kvpn disconnect`) to \
             restore it",
        );
    }
}

/// `null` for an empty string (an origin field that does not apply).
fn text_or_null(s: &str) -> serde_json::Value {
    if s.is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::Value::String(s.to_owned())
    }
}

fn session_json(s: &kvpn_proto::dataplane::Session) -> serde_json::Value {
    let origin = s.origin.clone().unwrap_or_default();
    serde_json::json!({
        "id": s.id,
        "transport": text_or_null(&origin.transport),
        "data_path": text_or_null(&origin.data_path),
        "cluster": text_or_null(&origin.cluster),
        "server": text_or_null(&origin.server),
        "context": text_or_null(&origin.context),
        "manager_namespace": text_or_null(&origin.manager_namespace),
        "manager": s.manager,
        "tunnel_ip": s.tunnel_ip,
        "tun_name": s.tun_name,
        "mtu": s.mtu,
        "data_channel": text_or_null(&s.data_channel),
        "state": s.state,
        "reason": s.reason,
        "uptime_ms": s.uptime_ms,
        "routes": s.routes.iter().map(|r| serde_json::json!({"cidr": r.cidr, "kind": kind_name(r.kind), "watched": r.watched})).collect::<Vec<_>>(),
        "route_source": s.route_source.as_ref().map(|r| serde_json::json!({
            "mode": r.mode,
            "reason": text_or_null(&r.reason),
            "pod_cidr_source": text_or_null(&r.pod_cidr_source),
            "pod_cidrs": r.pod_cidrs,
        })),
        "dns": s.dns.as_ref().map(|d| serde_json::json!({
            "servers": d.servers,
            "domain": d.domain,
            "search": d.search,
        })),
        "dns_counters": s.dns_counters.as_ref().map(|c| serde_json::json!({
            "udp_queries": c.udp_queries,
            "tcp_queries": c.tcp_queries,
            "cluster": c.cluster,
            "expanded": c.expanded,
            "upstream": c.upstream,
            "nxdomain": c.nxdomain,
            "empty_aaaa": c.empty_aaaa,
            "truncated": c.truncated,
            "dropped": c.dropped,
            "servfail": c.servfail,
            "malformed": c.malformed,
            "unreachable": c.unreachable,
        })),
        "services": s.services.iter().map(|v| serde_json::json!({
            "namespace": v.namespace,
            "name": v.name,
            "cluster_ips": v.cluster_ips,
            "ports": v.ports,
        })).collect::<Vec<_>>(),
        "conflicts": s.conflicts.iter().map(|c| serde_json::json!({
            "cidr": c.cidr,
            "kind": kind_name(c.kind),
            "laptop_cidr": c.laptop_cidr,
            "laptop_dev": c.laptop_dev,
            "laptop_proto": c.laptop_proto,
            "laptop_table": c.laptop_table,
            "message": c.message,
            "handling": c.handling,
            "pinned": c.pinned,
        })).collect::<Vec<_>>(),
        "tx": {"packets": s.tx_packets, "bytes": s.tx_bytes},
        "rx": {"packets": s.rx_packets, "bytes": s.rx_bytes},
        "ebpf": {
            "per_kind": s.ebpf.iter().map(|k| serde_json::json!({"kind": kind_name(k.kind), "packets": k.packets, "bytes": k.bytes})).collect::<Vec<_>>(),
            "unrouted": {"packets": s.ebpf_unrouted_packets, "bytes": s.ebpf_unrouted_bytes},
        },
        "liveness": s.liveness.as_ref().map(|l| serde_json::json!({
            "heartbeat_interval_ms": l.heartbeat_interval_ms,
            "window_ms": l.window_ms,
            "heartbeats_sent": l.heartbeats_sent,
            "heartbeats_echoed": l.heartbeats_echoed,
            "last_rtt_us": l.last_rtt_us,
            "refused_packets": l.refused_packets,
            "unreachable_sent": l.unreachable_sent,
            "unreachable_rate_limited": l.unreachable_rate_limited,
        })),
    })
}

fn uptime(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{}s", s / 60, s % 60),
        _ => format!("{}h{}m", s / 3600, (s % 3600) / 60),
    }
}

/// `kvpn status` output.
pub fn status(resp: &StatusResponse, format: OutputFormat) -> Result<()> {
    match format {
        OutputFormat::Json => {
            let v = serde_json::json!({"sessions": resp.sessions.iter().map(session_json).collect::<Vec<_>>()});
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
        OutputFormat::Table => {
            if resp.sessions.is_empty() {
                println!("Not connected (the root daemon runs, with no session)");
                return Ok(());
            }
            println!(
                "{:<12} {:<22} {:<14} {:<8} {:<13} {:>8} {:>12} {:>12}",
                "ID", "MANAGER", "TUNNEL IP", "TUN", "STATE", "UPTIME", "TX PKTS/B", "RX PKTS/B"
            );
            for s in &resp.sessions {
                println!(
                    "{:<12} {:<22} {:<14} {:<8} {:<13} {:>8} {:>12} {:>12}",
                    s.id,
                    s.manager,
                    s.tunnel_ip,
                    s.tun_name,
                    s.state,
                    uptime(s.uptime_ms),
                    format!("{}/{}", s.tx_packets, s.tx_bytes),
                    format!("{}/{}", s.rx_packets, s.rx_bytes),
                );
                if !s.reason.is_empty() {
                    println!("    reason: {}", s.reason);
                }
                if let Some(l) = &s.liveness {
                    println!(
                        "    heartbeat every {} ms, reconnecting after {} ms without an echo; \
                         while reconnecting {} packets refused ({} ICMP unreachable sent, {} rate-limited)",
                        l.heartbeat_interval_ms,
                        l.window_ms,
                        l.refused_packets,
                        l.unreachable_sent,
                        l.unreachable_rate_limited
                    );
                }
                match &s.origin {
                    Some(o) if !o.cluster.is_empty() => println!(
                        "    cluster {} (context {}, {}) through {}, traffic manager in {}",
                        o.cluster,
                        o.context,
                        o.server,
                        if o.data_path.is_empty() {
                            &o.transport
                        } else {
                            &o.data_path
                        },
                        o.manager_namespace
                    ),
                    Some(o) if !o.transport.is_empty() => {
                        println!("    transport {}", o.transport);
                    }
                    _ => {}
                }
                match s.data_channel.as_str() {
                    "tls" => {
                        println!("    data channel tls (TLS 1.3, manager certificate verified)")
                    }
                    "plain" => println!("    data channel plain (unencrypted TCP)"),
                    _ => {}
                }
                match &s.route_source {
                    Some(r) if r.reason.is_empty() => println!(
                        "    routes from {} ({} Services; pod CIDRs from {})",
                        r.mode,
                        s.services.len(),
                        r.pod_cidr_source
                    ),
                    Some(r) => println!("    routes from {}: {}", r.mode, r.reason),
                    None => {}
                }
                if let Some(d) = &s.dns {
                    println!(
                        "    cluster DNS {} domain {} search {}",
                        if d.servers.is_empty() {
                            "(no kube-dns Service)".to_owned()
                        } else {
                            d.servers.join(",")
                        },
                        d.domain,
                        d.search.join(" ")
                    );
                }
                if let Some(c) = &s.dns_counters {
                    println!(
                        "    DNS forwarder {} queries ({} UDP, {} TCP): {} cluster, {} expanded, {} upstream, {} NXDOMAIN, {} empty AAAA, {} truncated, {} dropped, {} SERVFAIL ({} while the session was down)",
                        c.udp_queries + c.tcp_queries,
                        c.udp_queries,
                        c.tcp_queries,
                        c.cluster,
                        c.expanded,
                        c.upstream,
                        c.nxdomain,
                        c.empty_aaaa,
                        c.truncated,
                        c.dropped,
                        c.servfail,
                        c.unreachable
                    );
                }
                for r in &s.routes {
                    println!(
                        "    route {:<20} {}{}",
                        r.cidr,
                        kind_name(r.kind),
                        if r.watched { " (watched)" } else { "" }
                    );
                }
                for c in &s.conflicts {
                    println!(
                        "    conflict {} [{}{}]",
                        c.message,
                        c.handling,
                        if c.pinned.is_empty() {
                            String::new()
                        } else {
                            format!(", pinned {}", c.pinned.join(" "))
                        }
                    );
                }
                for k in &s.ebpf {
                    println!(
                        "    eBPF {:<8} {:>10} packets {:>14} bytes",
                        kind_name(k.kind),
                        k.packets,
                        k.bytes
                    );
                }
                println!(
                    "    eBPF unrouted (dropped) {} packets {} bytes",
                    s.ebpf_unrouted_packets, s.ebpf_unrouted_bytes
                );
            }
        }
    }
    Ok(())
}
