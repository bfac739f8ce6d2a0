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
use kvpn_proto::dataplane::{RouteKind, Session};
use kvpn_proto::userd::UserSession;

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

/// `kvpn diagnose source`'s report.
pub fn diagnose_source(r: &crate::diagnose::SourceReport, format: OutputFormat) -> Result<()> {
    match format {
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(r)?),
        OutputFormat::Yaml => print!("{}", serde_yaml_ng::to_string(r)?),
        OutputFormat::Table => print!("{}", diagnose_source_table(r)),
    }
    Ok(())
}

/// `kvpn diagnose source`'s table: the values in one column, the outcome in
/// words.
fn diagnose_source_table(r: &crate::diagnose::SourceReport) -> String {
    let show = |a: Option<std::net::SocketAddr>| a.map_or("-".to_owned(), |a| a.to_string());
    let mut out = format!(
        "{} to {} (traffic manager source policy {})\n",
        r.protocol, r.target, r.policy
    );
    for (label, value) in [
        ("laptop socket".to_owned(), show(r.laptop_source)),
        (
            "after decapsulation".to_owned(),
            show(r.decapsulated_source),
        ),
        (
            format!("manager pod egress ({})", r.egress_interface),
            show(r.egress_source),
        ),
        ("backend saw".to_owned(), show(r.backend_source)),
        ("outcome".to_owned(), r.outcome.to_string()),
    ] {
        out.push_str(&format!("  {label:<25} {value}\n"));
    }
    out.push_str(&format!("{}: {}\n", r.verdict, r.explanation));
    if !r.note.is_empty() {
        out.push_str(&format!("note: {}\n", r.note));
    }
    out
}

/// A warning, on stderr.
pub fn warn(msg: &str) {
    eprintln!("kvpn: warning: {msg}");
}

/// An error, on stderr.
pub fn error(msg: &str) {
    eprintln!("kvpn: error: {msg}");
}

/// An error and its causes as one line, each cause said once: `outer: cause:
/// cause`, like anyhow's `{:#}`, but a cause whose text the line already holds
/// is left out. Most errors here (and kube-rs's) print their source inside
/// their own message *and* return it from `source()`, so `{:#}` said an
/// unreadable client key's "Permission denied" five times. kube-rs also quotes
/// paths as `'"/path"'` (`'{:?}'` of a `PathBuf`): shown as `"/path"`.
///
/// A cause that starts with the words of the context above it replaces that
/// context: "connect failed" over "connect failed at step …" reads once.
pub fn error_chain(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let text = cause.to_string().replace("'\"", "\"").replace("\"'", "\"");
        if text.is_empty() || parts.iter().any(|p| p.contains(&text)) {
            continue;
        }
        match parts.last_mut() {
            Some(last) if text.starts_with(last.as_str()) => *last = text,
            _ => parts.push(text),
        }
    }
    parts.join(": ")
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
        OutputFormat::Json => println!("{{\"root_daemon\":{{\"running\":false}},\"sessions\":[]}}"),
        OutputFormat::Yaml => println!("root_daemon:\n  running: false\nsessions: []"),
        OutputFormat::Table => println!(
            "Not connected (no root daemon answers on {})",
            crate::daemon::socket_path(runtime_dir).display()
        ),
    }
    warn_dns_left_changed(runtime_dir);
}

/// The warning about a resolv.conf a killed root daemon left pointing at its
/// forwarder, if it did.
pub fn warn_dns_left_changed(runtime_dir: &Path) {
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

/// One row of `kvpn status`: a session as the root daemon and the user daemon
/// see it, with the state both halves together are in.
#[derive(Debug, Clone, PartialEq)]
pub struct StatusRow {
    /// The root daemon's session (TUN device, routes, counters); for a session
    /// only the user daemon knows (`lost`), one built from its record with zero
    /// counters. `state` and `reason` are the merged ones.
    pub session: Session,
    /// The namespace short names resolve in (empty when unknown: direct sessions).
    pub namespace: String,
    /// The user daemon's half; `None` for direct sessions and for port-forward
    /// sessions whose user half is gone.
    pub user: Option<UserSession>,
}

/// `state` of a session whose user-side half is gone for good.
pub const STATE_LOST: &str = "lost";

/// Merge the root daemon's sessions with the user daemon's halves (pure; the
/// order is the root daemon's, then user-only sessions by id).
pub fn merge_sessions(root: Vec<Session>, user: Vec<UserSession>) -> Vec<StatusRow> {
    let mut rows: Vec<StatusRow> = root
        .into_iter()
        .map(|mut s| {
            let u = user.iter().find(|u| u.id == s.id).cloned();
            let port_forward = s
                .origin
                .as_ref()
                .is_some_and(|o| o.transport == crate::connect::TRANSPORT_PORT_FORWARD);
            match &u {
                None if port_forward => {
                    s.state = "failed".into();
                    s.reason = "its port-forward (user daemon half) is gone — run `kvpn connect` \
                                again to replace the session, or `kvpn disconnect` it"
                        .into();
                }
                Some(u) if u.state == STATE_LOST => {
                    s.state = STATE_LOST.into();
                    s.reason = u.reason.clone();
                }
                Some(u)
                    if u.state == crate::userd::server::STATE_RESTORING
                        && s.state != "connected" =>
                {
                    s.reason = format!(
                        "the user daemon restarted and is bringing the port-forward back{}",
                        if s.reason.is_empty() {
                            String::new()
                        } else {
                            format!(" ({})", s.reason)
                        }
                    );
                }
                // The root daemon sees only the symptom of a broken SSH path (the
                // listener ends the TLS handshake): the path's own error first.
                Some(u) if !u.transport_error.is_empty() && s.state != "connected" => {
                    s.reason = if s.reason.is_empty() {
                        u.transport_error.clone()
                    } else {
                        format!("{} (data channel: {})", u.transport_error, s.reason)
                    };
                }
                _ => {}
            }
            StatusRow {
                namespace: u.as_ref().map(|u| u.namespace.clone()).unwrap_or_default(),
                session: s,
                user: u,
            }
        })
        .collect();
    let mut user_only: Vec<&UserSession> = user
        .iter()
        .filter(|u| !rows.iter().any(|r| r.session.id == u.id))
        .collect();
    user_only.sort_by(|a, b| a.id.cmp(&b.id));
    for u in user_only {
        let socks = u.socks.clone().unwrap_or_default();
        let (state, reason) = if u.state == STATE_LOST {
            (STATE_LOST.to_owned(), u.reason.clone())
        } else if u.socks.is_some() {
            // SOCKS sessions have no root daemon half: their own state.
            (socks.state.clone(), socks.reason.clone())
        } else {
            (
                "failed".to_owned(),
                "the root daemon does not have this session".to_owned(),
            )
        };
        rows.push(StatusRow {
            session: Session {
                id: u.id.clone(),
                manager: u.data_addr.clone(),
                tunnel_ip: u.tunnel_ip.clone(),
                tun_name: u.tun_name.clone(),
                state,
                reason,
                origin: u.origin.clone(),
                uptime_ms: u.uptime_ms,
                data_channel: if u.socks.is_some() {
                    "tls".to_owned()
                } else {
                    String::new()
                },
                tx_packets: socks.tx_packets,
                tx_bytes: socks.tx_bytes,
                rx_packets: socks.rx_packets,
                rx_bytes: socks.rx_bytes,
                ..Session::default()
            },
            namespace: u.namespace.clone(),
            user: Some(u.clone()),
        });
    }
    rows
}

fn session_json(row: &StatusRow) -> serde_json::Value {
    let s = &row.session;
    let origin = s.origin.clone().unwrap_or_default();
    serde_json::json!({
        "id": s.id,
        "namespace": text_or_null(&row.namespace),
        "user_daemon": row.user.as_ref().map(|u| serde_json::json!({
            "state": u.state,
            "reason": text_or_null(&u.reason),
            "data_addr": u.data_addr,
            "uptime_ms": u.uptime_ms,
            "restores": u.restores,
        })),
        "socks": row.user.as_ref().and_then(|u| u.socks.as_ref()).map(|x| serde_json::json!({
            "listen": x.listen,
            "open_flows": x.open_flows,
            "dns_servers": x.dns_servers,
        })),
        "transport": text_or_null(&origin.transport),
        "data_path": text_or_null(&origin.data_path),
        "source_policy": text_or_null(&origin.source_policy),
        "cluster": text_or_null(&origin.cluster),
        "server": text_or_null(&origin.server),
        "context": text_or_null(&origin.context),
        "manager_namespace": text_or_null(&origin.manager_namespace),
        "manager": s.manager,
        "tunnel_ip": s.tunnel_ip,
        "tunnel_ip_v6": text_or_null(&s.tunnel_ip_v6),
        "tun_name": s.tun_name,
        "mtu": s.mtu,
        "data_channel": text_or_null(&s.data_channel),
        "workers": s.workers.max(1),
        "workers_connected": s.workers_connected,
        "resumes": s.resumes,
        "resumes_lost": s.resumes_lost,
        "tcp_flows_reset": s.tcp_flows_reset,
        "held_packets": s.held_packets,
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
        "tx": {
            "packets": s.tx_packets,
            "bytes": s.tx_bytes,
            "gso_frames": s.tx_gso_frames,
            "gso_segmented": s.tx_gso_segmented,
            "offload_dropped": s.tx_offload_dropped,
        },
        "rx": {"packets": s.rx_packets, "bytes": s.rx_bytes, "gso_frames": s.rx_gso_frames},
        "ebpf": {
            "per_kind": s.ebpf.iter().map(|k| serde_json::json!({"kind": kind_name(k.kind), "packets": k.packets, "bytes": k.bytes})).collect::<Vec<_>>(),
            "unrouted": {"packets": s.ebpf_unrouted_packets, "bytes": s.ebpf_unrouted_bytes},
            "ingress": s.ebpf_ingress.as_ref().map(|i| {
                let c = |c: &Option<kvpn_proto::dataplane::Counter>| {
                    let c = c.unwrap_or_default();
                    serde_json::json!({"packets": c.packets, "bytes": c.bytes})
                };
                serde_json::json!({
                    "passed": c(&i.passed),
                    "foreign_source": c(&i.foreign_source),
                    "malformed": c(&i.malformed),
                })
            }),
            "steer": s.ebpf_steer.as_ref().map(|t| {
                let c = |c: &Option<kvpn_proto::dataplane::Counter>| {
                    let c = c.unwrap_or_default();
                    serde_json::json!({"packets": c.packets, "bytes": c.bytes})
                };
                serde_json::json!({
                    "devices": t.devices,
                    "steered": c(&t.steered),
                    "reverse_translated": c(&t.reverse_translated),
                    "no_conntrack": c(&t.no_conntrack),
                    "failed": c(&t.failed),
                })
            }),
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
            "transports_lost": l.transports_lost,
        })),
        "manager_stats": s.manager_stats.as_ref().map(|m| serde_json::json!({
            "flows": m.flows,
            "flow_cap": m.flow_cap,
            "refused_cap": m.refused_cap,
            "rate_limited": m.rate_limited,
            "icmp_rate_limited": m.icmp_rate_limited,
            "echoes_dropped": m.echoes_dropped,
            "gso_frames": m.gso_frames,
            "gso_segments": m.gso_segments,
            "drops": m.drops.iter().map(|d| serde_json::json!({"reason": d.reason, "packets": d.packets})).collect::<Vec<_>>(),
            "age_ms": m.age_ms,
        })),
    })
}

/// The table's line for the manager's counters of a session, when a limit bit
/// or the manager dropped something (nothing to say otherwise).
fn manager_stats_line(m: &kvpn_proto::dataplane::ManagerStats) -> Option<String> {
    let dropped: u64 = m.drops.iter().map(|d| d.packets).sum();
    if m.refused_cap == 0
        && m.rate_limited == 0
        && m.icmp_rate_limited == 0
        && dropped == 0
        && m.echoes_dropped == 0
    {
        return None;
    }
    let cap = if m.refused_cap > 0 {
        format!(
            "flow cap reached: {} new flows refused ({} of {} flows open)",
            m.refused_cap, m.flows, m.flow_cap
        )
    } else {
        format!("{} of {} flows open", m.flows, m.flow_cap)
    };
    let mut line = format!(
        "manager: {cap}; {} new flows rate-limited, {} ICMP errors rate-limited",
        m.rate_limited, m.icmp_rate_limited
    );
    if dropped > 0 {
        let reasons: Vec<String> = m
            .drops
            .iter()
            .map(|d| format!("{} {}", d.packets, d.reason))
            .collect();
        line.push_str(&format!(
            "; dropped {dropped} packets ({})",
            reasons.join(", ")
        ));
    }
    if m.echoes_dropped > 0 {
        line.push_str(&format!("; {} heartbeat echoes dropped", m.echoes_dropped));
    }
    Some(line)
}

fn uptime(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{}s", s / 60, s % 60),
        _ => format!("{}h{}m", s / 3600, (s % 3600) / 60),
    }
}

/// The root daemon as `kvpn status` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RootDaemon {
    /// Whether one answered.
    pub running: bool,
    /// Calls it refused because of the caller's uid (SO_PEERCRED), since it
    /// started; `None` when it does not run.
    pub refused_peers: Option<u64>,
}

/// The status document of `-o json` / `-o yaml` (schema: docs/status.md).
pub fn status_document(rows: &[StatusRow], root: RootDaemon) -> serde_json::Value {
    let mut root_daemon = serde_json::json!({"running": root.running});
    if let Some(n) = root.refused_peers {
        root_daemon["refused_peers"] = n.into();
    }
    serde_json::json!({
        "root_daemon": root_daemon,
        "sessions": rows.iter().map(session_json).collect::<Vec<_>>(),
    })
}

/// The table's line about refused callers of the root socket, when there were any.
fn refused_peers_line(root: RootDaemon) {
    if let Some(n) = root.refused_peers.filter(|&n| n > 0) {
        println!(
            "The root daemon refused {n} call(s) from uids it does not accept (its socket admits \
             root and the uid it was started for) — `kvpn logs` names them"
        );
    }
}

/// `kvpn status` output.
pub fn status(rows: &[StatusRow], root: RootDaemon, format: OutputFormat) -> Result<()> {
    match format {
        OutputFormat::Json => {
            println!(
                "{}",
                serde_json::to_string_pretty(&status_document(rows, root))?
            );
        }
        OutputFormat::Yaml => {
            let text = serde_yaml_ng::to_string(&status_document(rows, root))?;
            println!("{}", text.trim_end());
        }
        OutputFormat::Table => {
            if rows.is_empty() {
                println!("Not connected (the root daemon runs, with no session)");
                refused_peers_line(root);
                return Ok(());
            }
            let dash = |t: &str| {
                if t.is_empty() {
                    "-".to_owned()
                } else {
                    t.to_owned()
                }
            };
            let mut table: Vec<[String; 11]> = vec![
                [
                    "ID",
                    "CLUSTER",
                    "CONTEXT",
                    "NAMESPACE",
                    "TRANSPORT",
                    "TUNNEL IP",
                    "TUN",
                    "STATE",
                    "UPTIME",
                    "TX PKTS/B",
                    "RX PKTS/B",
                ]
                .map(str::to_owned),
            ];
            for r in rows {
                let s = &r.session;
                let o = s.origin.clone().unwrap_or_default();
                table.push([
                    s.id.clone(),
                    dash(&o.cluster),
                    dash(&o.context),
                    dash(&r.namespace),
                    dash(&o.transport),
                    if s.tunnel_ip_v6.is_empty() {
                        dash(&s.tunnel_ip)
                    } else {
                        format!("{},{}", s.tunnel_ip, s.tunnel_ip_v6)
                    },
                    dash(&s.tun_name),
                    s.state.clone(),
                    uptime(s.uptime_ms),
                    format!("{}/{}", s.tx_packets, s.tx_bytes),
                    format!("{}/{}", s.rx_packets, s.rx_bytes),
                ]);
            }
            let widths: Vec<usize> = (0..11)
                .map(|c| {
                    table
                        .iter()
                        .map(|r| r[c].chars().count())
                        .max()
                        .unwrap_or(0)
                })
                .collect();
            let line = |cells: &[String; 11]| {
                cells
                    .iter()
                    .zip(&widths)
                    .map(|(c, w)| format!("{c:<w$}"))
                    .collect::<Vec<_>>()
                    .join("  ")
                    .trim_end()
                    .to_owned()
            };
            println!("{}", line(&table[0]));
            for (r, cells) in rows.iter().zip(&table[1..]) {
                println!("{}", line(cells));
                let s = &r.session;
                if !s.manager.is_empty() {
                    println!("    data channel to {}", s.manager);
                }
                if let Some(x) = r.user.as_ref().and_then(|u| u.socks.as_ref()) {
                    println!(
                        "    SOCKS5 proxy on {}, no TUN device; {} open flows; names resolve through the cluster DNS {}",
                        x.listen,
                        x.open_flows,
                        if x.dns_servers.is_empty() {
                            "(none: IP addresses only)".to_owned()
                        } else {
                            x.dns_servers.join(",")
                        }
                    );
                }
                if !s.reason.is_empty() {
                    println!("    reason: {}", s.reason);
                }
                if let Some(u) = &r.user
                    && u.restores > 0
                {
                    println!(
                        "    port-forward brought back {} time(s) by a restarted user daemon",
                        u.restores
                    );
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
                if let Some(line) = s.manager_stats.as_ref().and_then(manager_stats_line) {
                    println!("    {line}");
                }
                match &s.origin {
                    Some(o) if !o.cluster.is_empty() => {
                        println!(
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
                        );
                        if !o.source_policy.is_empty() {
                            println!(
                                "    source policy {} (backends see {})",
                                o.source_policy,
                                match o.source_policy.as_str() {
                                    "preserve" => "this laptop's tunnel IP",
                                    "ebpf-snat" => {
                                        "the traffic manager pod's IP, rewritten in its kernel"
                                    }
                                    _ => "the traffic manager pod's IP",
                                }
                            );
                        }
                    }
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
                if s.workers > 1 {
                    println!(
                        "    workers {} ({} connected): a TUN queue and a data connection each",
                        s.workers, s.workers_connected
                    );
                }
                if s.resumes > 0 || s.resumes_lost > 0 {
                    println!(
                        "    re-dials: {} resumed their flows, {} lost them (manager restarted or its grace period over)",
                        s.resumes, s.resumes_lost
                    );
                }
                if s.tcp_flows_reset > 0 {
                    println!(
                        "    TCP flows reset on the laptop after a re-dial that could not resume: {}",
                        s.tcp_flows_reset
                    );
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
                for l in ebpf_lines(s) {
                    println!("{l}");
                }
            }
            refused_peers_line(root);
        }
    }
    Ok(())
}

/// The eBPF counter lines of a session in the table; none for a session
/// without a TUN device (SOCKS), which has no classifier.
fn ebpf_lines(s: &Session) -> Vec<String> {
    if s.tun_name.is_empty() {
        return Vec::new();
    }
    let mut lines: Vec<String> = s
        .ebpf
        .iter()
        .map(|k| {
            format!(
                "    eBPF {:<8} {:>10} packets {:>14} bytes",
                kind_name(k.kind),
                k.packets,
                k.bytes
            )
        })
        .collect();
    lines.push(format!(
        "    eBPF unrouted (dropped) {} packets {} bytes",
        s.ebpf_unrouted_packets, s.ebpf_unrouted_bytes
    ));
    if let Some(i) = &s.ebpf_ingress {
        let c = |c: &Option<kvpn_proto::dataplane::Counter>| c.unwrap_or_default();
        let (passed, foreign, malformed) = (c(&i.passed), c(&i.foreign_source), c(&i.malformed));
        lines.push(format!(
            "    eBPF from tunnel: passed {} packets, dropped {} packets from \
             non-cluster sources, {} malformed",
            passed.packets, foreign.packets, malformed.packets
        ));
    }
    if let Some(t) = &s.ebpf_steer {
        let c = |c: &Option<kvpn_proto::dataplane::Counter>| c.unwrap_or_default().packets;
        lines.push(format!(
            "    eBPF steering on {}: steered {} packets, {} replies translated back, \
             {} left to the laptop's route (no conntrack), {} failed",
            t.devices.join(", "),
            c(&t.steered),
            c(&t.reverse_translated),
            c(&t.no_conntrack),
            c(&t.failed)
        ));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpn_proto::dataplane::Origin;

    #[test]
    fn manager_stats_line_only_when_a_limit_bit() {
        let mut m = kvpn_proto::dataplane::ManagerStats {
            flows: 3,
            flow_cap: 8,
            ..Default::default()
        };
        assert_eq!(manager_stats_line(&m), None, "nothing to say");
        m.refused_cap = 5;
        m.flows = 8;
        m.drops.push(kvpn_proto::dataplane::ManagerDrop {
            reason: "too_many_flows".into(),
            packets: 5,
        });
        assert_eq!(
            manager_stats_line(&m).as_deref(),
            Some(
                "manager: flow cap reached: 5 new flows refused (8 of 8 flows open); \
                 0 new flows rate-limited, 0 ICMP errors rate-limited; \
                 dropped 5 packets (5 too_many_flows)"
            )
        );
    }

    /// Every row of `kvpn diagnose source`'s table starts its value in one
    /// column (the egress row was one out), and the outcome is in words, not
    /// a Debug value.
    #[test]
    fn diagnose_table_aligns_values_and_words_the_outcome() {
        use crate::diagnose::{Outcome, SourceReport};
        let a = |s: &str| s.parse().ok();
        let r = SourceReport {
            protocol: "tcp",
            target: "10.244.1.250:80".parse().expect("addr"),
            policy: "snat".into(),
            laptop_source: a("100.96.0.2:40000"),
            decapsulated_source: a("100.96.0.2:40000"),
            egress_source: None,
            egress_interface: "eth0".into(),
            backend_source: None,
            outcome: Outcome::Unreachable { code: None },
            verdict: "unreachable".into(),
            explanation: "why".into(),
            note: String::new(),
        };
        let table = diagnose_source_table(&r);
        let rows: Vec<&str> = table.lines().filter(|l| l.starts_with("  ")).collect();
        assert_eq!(rows.len(), 5, "{table}");
        let columns: Vec<usize> = rows
            .iter()
            .map(|l| l.trim_end().rfind(' ').expect("a value") + 1)
            .collect();
        assert!(
            columns.iter().all(|&c| c == columns[0]),
            "{columns:?}\n{table}"
        );
        assert!(table.contains("  manager pod egress (eth0) -\n"), "{table}");
        assert!(
            table.contains("  outcome                   unreachable\n"),
            "{table}"
        );
        assert!(
            !table.contains("Unreachable") && !table.contains("code"),
            "{table}"
        );
    }

    /// An unreadable `client-key` file: kube-rs's error nests four levels deep,
    /// each repeating the one below; the line says the cause once, the path in
    /// plain double quotes.
    #[test]
    fn unreadable_client_key_is_said_once() {
        use kube::config::{KubeconfigError, LoadDataError};
        let io = std::io::Error::from_raw_os_error(libc::EACCES);
        let kube_err = kube::Error::InferKubeconfig(KubeconfigError::LoadClientKey(
            LoadDataError::ReadFile(io, "/home/u/.kube/u.key".into()),
        ));
        let err = crate::kubeconfig::Error::Client {
            context: "lab".into(),
            server: "https://10.0.0.1:6443".into(),
            source: kube_err,
        };
        let e = anyhow::Error::new(err).context("cannot reach the API server");
        let line = error_chain(&e);
        assert_eq!(line.matches("Permission denied").count(), 1, "{line}");
        assert_eq!(
            line.matches("failed to load client key").count(),
            1,
            "{line}"
        );
        assert!(line.contains("\"/home/u/.kube/u.key\""), "{line}");
        assert!(!line.contains("'\"") && !line.contains("\"'"), "{line}");
        assert!(
            line.starts_with("cannot reach the API server: building the client"),
            "{line}"
        );
        // The plain `{:#}` repeated it: the test would notice a regression to it.
        assert!(format!("{e:#}").matches("Permission denied").count() > 1);
    }

    #[test]
    fn a_context_repeated_by_its_cause_reads_once() {
        let e = anyhow::anyhow!("connect failed at step \"create TUN device\": EBUSY")
            .context("connect failed");
        assert_eq!(
            error_chain(&e),
            "connect failed at step \"create TUN device\": EBUSY"
        );
        let e = anyhow::anyhow!("no route to host").context("cannot reach 10.0.0.1");
        assert_eq!(error_chain(&e), "cannot reach 10.0.0.1: no route to host");
    }

    /// SOCKS sessions have no TUN device and no eBPF classifier: no eBPF lines.
    #[test]
    fn socks_sessions_show_no_ebpf_lines() {
        let tun = Session {
            id: "t".into(),
            tun_name: "kvpn0".into(),
            ..Default::default()
        };
        assert!(ebpf_lines(&tun).iter().any(|l| l.contains("eBPF unrouted")));
        let socks = Session {
            id: "s".into(),
            ..Default::default()
        };
        assert!(ebpf_lines(&socks).is_empty(), "{:?}", ebpf_lines(&socks));
    }

    fn root(id: &str, transport: &str, state: &str) -> Session {
        Session {
            id: id.into(),
            state: state.into(),
            origin: Some(Origin {
                transport: transport.into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn user(id: &str, state: &str, reason: &str) -> UserSession {
        UserSession {
            id: id.into(),
            state: state.into(),
            reason: reason.into(),
            namespace: "dev".into(),
            tun_name: "kvpn9".into(),
            ..Default::default()
        }
    }

    /// During an SSH outage the reason is the SSH path's error (hop, cause,
    /// fix), the root daemon's symptom after it; once connected, no stale error.
    #[test]
    fn an_ssh_transport_error_is_the_reason_of_a_session_that_is_down() {
        let ssh_error = "cannot reach SSH host root@10.99.0.2:2222: Connection refused (os error 111) \
                         — check the address and that sshd runs there";
        let mut u = user("s1", crate::userd::server::STATE_RUNNING, "");
        u.transport_error = ssh_error.into();
        let mut down = root("s1", "port-forward", "reconnecting");
        down.reason = "TLS handshake with the manager failed: unexpected EOF".into();
        let rows = merge_sessions(vec![down], vec![u.clone()]);
        assert_eq!(
            rows[0].session.reason,
            format!(
                "{ssh_error} (data channel: TLS handshake with the manager failed: unexpected EOF)"
            )
        );
        let rows = merge_sessions(vec![root("s1", "port-forward", "connected")], vec![u]);
        assert_eq!(rows[0].session.reason, "");
    }

    #[test]
    fn both_halves_merge_and_a_missing_or_lost_half_is_said() {
        let rows = merge_sessions(
            vec![
                root("a", "port-forward", "connected"),
                root("b", "port-forward", "reconnecting"),
                root("c", "direct", "connected"),
                root("d", "port-forward", "reconnecting"),
            ],
            vec![
                user("a", "running", ""),
                user("d", "restoring", ""),
                user("z", "lost", "the root daemon no longer has this session"),
            ],
        );
        let view: Vec<(&str, &str, &str)> = rows
            .iter()
            .map(|r| {
                (
                    r.session.id.as_str(),
                    r.session.state.as_str(),
                    r.namespace.as_str(),
                )
            })
            .collect();
        assert_eq!(
            view,
            [
                ("a", "connected", "dev"),
                ("b", "failed", ""),
                ("c", "connected", ""),
                ("d", "reconnecting", "dev"),
                ("z", "lost", "dev"),
            ]
        );
        assert!(rows[1].session.reason.contains("kvpn connect"), "{rows:?}");
        assert!(rows[2].user.is_none() && rows[2].session.reason.is_empty());
        assert!(
            rows[3]
                .session
                .reason
                .contains("bringing the port-forward back")
        );
        assert_eq!(rows[4].session.tun_name, "kvpn9");
        assert!(rows[4].session.reason.contains("no longer has"));
        let doc = status_document(
            &rows,
            RootDaemon {
                running: true,
                refused_peers: Some(2),
            },
        );
        assert_eq!(doc["root_daemon"]["refused_peers"], 2);
        assert_eq!(doc["sessions"][4]["user_daemon"]["state"], "lost");
        assert_eq!(doc["sessions"][2]["user_daemon"], serde_json::Value::Null);
        assert_eq!(doc["root_daemon"]["running"], true);
    }

    #[test]
    fn a_socks_session_has_its_own_state_and_counters_without_a_root_half() {
        let socks = |id: &str, state: &str| UserSession {
            socks: Some(kvpn_proto::userd::SocksState {
                listen: "127.0.0.1:1080".into(),
                state: "connected".into(),
                open_flows: 3,
                rx_bytes: 700,
                ..Default::default()
            }),
            tun_name: String::new(),
            ..user(id, state, "")
        };
        let rows = merge_sessions(
            Vec::new(),
            vec![socks("socks-1", "running"), socks("socks-2", "lost")],
        );
        assert_eq!(rows[0].session.state, "connected");
        assert_eq!(rows[0].session.rx_bytes, 700);
        assert_eq!(rows[1].session.state, "lost");
        let doc = status_document(
            &rows,
            RootDaemon {
                running: false,
                refused_peers: None,
            },
        );
        assert!(doc["root_daemon"].get("refused_peers").is_none());
        assert_eq!(doc["sessions"][0]["socks"]["listen"], "127.0.0.1:1080");
        assert_eq!(doc["sessions"][0]["socks"]["open_flows"], 3);
        assert_eq!(doc["sessions"][0]["tun_name"], "");
        let plain = status_document(
            &merge_sessions(Vec::new(), vec![user("x", "lost", "")]),
            RootDaemon {
                running: true,
                refused_peers: Some(0),
            },
        );
        assert_eq!(plain["sessions"][0]["socks"], serde_json::Value::Null);
    }
}
