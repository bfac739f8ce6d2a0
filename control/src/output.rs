//! Everything `kvpn` prints for the user. The only module allowed to write to stdout.
#![allow(clippy::print_stdout, reason = "this module is the CLI's output")]

use std::io::Write as _;

/// `println!` that ignores a closed stdout (`kvpn status | head`) instead of panicking.
macro_rules! println {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// `print!` that ignores a closed stdout, like [`println`].
macro_rules! print {
    ($($arg:tt)*) => {{
        let _ = write!(std::io::stdout(), $($arg)*);
    }};
}

use std::path::Path;

use anyhow::Result;
use kvpn_proto::dataplane::{RouteKind, Session};
use kvpn_proto::userd::UserSession;

use crate::cli::OutputFormat;

/// `kvpn version`'s report.
pub fn version(r: &crate::version::Report, format: OutputFormat) -> Result<()> {
    match format {
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(r)?),
        OutputFormat::Yaml => print!("{}", serde_yaml_ng::to_string(r)?),
        OutputFormat::Table => print!("{}", crate::version::table(r)),
    }
    Ok(())
}

/// Progress lines (step, done, detail) go to stderr instead of stdout: `kvpn
/// run`, whose stdout is its command's.
static PROGRESS_ON_STDERR: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Send progress lines to stderr from now on ([`PROGRESS_ON_STDERR`]).
pub fn progress_to_stderr() {
    PROGRESS_ON_STDERR.store(true, std::sync::atomic::Ordering::Relaxed);
}

fn progress(line: std::fmt::Arguments<'_>) {
    if PROGRESS_ON_STDERR.load(std::sync::atomic::Ordering::Relaxed) {
        eprintln!("{line}");
    } else {
        println!("{line}");
    }
}

/// A step of a long operation is starting.
pub fn step(msg: &str) {
    progress(format_args!("• {msg}…"));
}

/// Kubernetes objects for `kubectl apply -f -` (`kvpn install --dry-run`): YAML
/// documents separated by `---`, or one JSON `v1/List`.
pub fn manifests(objects: &[serde_json::Value], format: crate::cli::ManifestFormat) -> Result<()> {
    match format {
        crate::cli::ManifestFormat::Yaml => {
            for o in objects {
                println!("---");
                print!("{}", serde_yaml_ng::to_string(o)?);
            }
        }
        crate::cli::ManifestFormat::Json => {
            let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": objects});
            println!("{}", serde_json::to_string_pretty(&list)?);
        }
    }
    Ok(())
}

/// A step finished.
pub fn done(msg: &str) {
    progress(format_args!("✓ {msg}"));
}

/// A detail line under a step.
pub fn detail(msg: &str) {
    progress(format_args!("    {msg}"));
}

/// A block of text as it is (e.g. the lab's description).
pub fn info_block(text: &str) {
    println!("{}", text.trim_end());
}

/// `kvpn attach --list`: the attached replicas of a namespace.
pub fn attached_replicas(r: &[crate::attach::Replica], format: OutputFormat) -> Result<()> {
    match format {
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(r)?),
        OutputFormat::Yaml => print!("{}", serde_yaml_ng::to_string(r)?),
        OutputFormat::Table => {
            println!(
                "{:<16} {:<40} {:<10} TUNNEL IP",
                "NAMESPACE", "POD", "PHASE"
            );
            for x in r {
                println!(
                    "{:<16} {:<40} {:<10} {}",
                    x.namespace,
                    x.pod,
                    x.phase,
                    x.tunnel_ip.as_deref().unwrap_or("-")
                );
            }
        }
    }
    Ok(())
}

/// `kvpn attach check leak`'s report.
pub fn attach_leak(r: &crate::attach::check::LeakReport, format: OutputFormat) -> Result<()> {
    match format {
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(r)?),
        OutputFormat::Yaml => print!("{}", serde_yaml_ng::to_string(r)?),
        OutputFormat::Table => {
            let via = match r.via {
                crate::attach::render::Via::Sidecar => "per-workload tunnel (sidecar)",
                crate::attach::render::Via::Gateway => "manager as egress gateway",
            };
            let sources: Vec<String> = r.sources.iter().map(ToString::to_string).collect();
            let rows = [
                (
                    "workload",
                    format!("{} in namespace {}", r.workload, r.namespace),
                ),
                ("attached as", via.to_owned()),
                ("probe pod", r.pod.clone()),
                ("laptop", format!("{} on {}", r.laptop_ip, r.laptop_device)),
                (
                    "sent",
                    format!(
                        "{} datagrams, every 10 ms from the app's first moment",
                        r.sent
                    ),
                ),
                ("through the tunnel", r.through_tunnel.to_string()),
                ("outside the tunnel", r.outside_tunnel.to_string()),
                (
                    "first through",
                    match (r.first_through_seq, r.first_through_after_ms) {
                        (Some(s), Some(ms)) => {
                            format!("#{s}, sent {ms:.1} ms after the app started")
                        }
                        _ => "none".to_owned(),
                    },
                ),
                (
                    "lost before it",
                    r.lost_before_first
                        .map_or("-".to_owned(), |n| n.to_string()),
                ),
                (
                    "sources seen",
                    if sources.is_empty() {
                        "-".to_owned()
                    } else {
                        sources.join(", ")
                    },
                ),
                ("probe", r.probe_log.clone()),
            ];
            for (k, v) in rows {
                println!("{k:<20} {v}");
            }
            let verdict = match (r.outside_tunnel, r.first_through_seq) {
                (0, Some(0)) => {
                    "no leak, no window: the very first datagram came through the tunnel"
                }
                (0, Some(_)) => {
                    "no leak; a window: the first datagrams were lost before the path existed"
                }
                (0, None) => "no leak, but nothing came through either",
                _ => "LEAK: datagrams reached the laptop outside the tunnel",
            };
            println!("{:<20} {verdict}", "verdict");
        }
    }
    Ok(())
}

/// `kvpn attach check sessions`'s report.
pub fn attach_sessions(
    r: &crate::attach::check::SessionsReport,
    format: OutputFormat,
) -> Result<()> {
    match format {
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(r)?),
        OutputFormat::Yaml => print!("{}", serde_yaml_ng::to_string(r)?),
        OutputFormat::Table => {
            println!("{:<44} {:<16} SOURCE SEEN", "POD", "TUNNEL IP");
            for x in &r.rows {
                println!(
                    "{:<44} {:<16} {}",
                    x.pod,
                    x.tunnel_ip.as_deref().unwrap_or("-"),
                    x.source_seen.map_or("-".to_owned(), |s| s.to_string())
                );
            }
            println!(
                "{} replicas: {} sessions ({} distinct tunnel IPs), {} distinct sources seen by the laptop; scaled back to {}",
                r.replicas, r.sessions, r.distinct_tunnel_ips, r.distinct_sources, r.scaled_back_to
            );
        }
    }
    Ok(())
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
    let guard = kvpn_dataplane::dns::guard::Note::read(runtime_dir);
    match format {
        OutputFormat::Json => {
            let mut root = serde_json::json!({"running": false});
            if let Some(note) = &guard {
                root["dns_guard"] = dns_guard_json(note);
            }
            println!(
                "{}",
                serde_json::json!({"root_daemon": root, "sessions": []})
            );
        }
        OutputFormat::Yaml => println!("root_daemon:\n  running: false\nsessions: []"),
        OutputFormat::Table => println!(
            "Not connected (no root daemon answers on {})",
            crate::daemon::socket_path(runtime_dir).display()
        ),
    }
    warn_dns_left_changed(runtime_dir, None);
}

/// The warning about a resolv.conf the root daemon left pointing at its
/// forwarder while it does not answer, if it did: `not_answering` is its pid
/// and /proc state letter when its process still runs (stopped, hung), `None`
/// when it died.
pub fn warn_dns_left_changed(runtime_dir: &Path, not_answering: Option<(i32, char)>) {
    if crate::daemon::dns_left_changed(runtime_dir) {
        warn(&dns_left_changed_text(not_answering));
    } else if not_answering.is_none()
        && let Some(note) = kvpn_dataplane::dns::guard::Note::read(runtime_dir)
    {
        // The DNS guard repaired after the daemon died (issue 29 item 12).
        warn(&note.describe());
    }
}

/// The DNS guard's note in `-o json` (`root_daemon.dns_guard`, docs/status.md).
fn dns_guard_json(note: &kvpn_dataplane::dns::guard::Note) -> serde_json::Value {
    serde_json::json!({
        "daemon_pid": note.daemon_pid,
        "guard_pid": note.guard_pid,
        "died_at_unix": note.died_at_unix,
        "repaired_after_ms": note.repaired_after_ms,
        "resolv_conf": note.resolv_conf,
        "resolv_conf_outcome": note.resolv_conf_outcome,
        "hosts_outcome": note.hosts_outcome,
        "reason": note.describe(),
    })
}

fn dns_left_changed_text(not_answering: Option<(i32, char)>) -> String {
    match not_answering {
        None => "the root daemon died and left this machine's resolv.conf pointing at its DNS \
                 forwarder, so name lookups fail — run `kvpn quit` (or `kvpn disconnect`) to \
                 restore it"
            .to_owned(),
        Some((pid, state)) => format!(
            "this machine's resolv.conf points at the DNS forwarder of the root daemon \
             (pid {pid}), which {} — name lookups fail until it runs again: resume it with \
             `sudo kill -CONT {pid}`",
            if matches!(state, 'T' | 't') {
                "is stopped (SIGSTOP or a debugger)".to_owned()
            } else {
                format!("is not answering (process state {state}: hung or overloaded)")
            }
        ),
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
    /// Whether `session`'s counters and uptime were measured: the root daemon's
    /// half, or a SOCKS session's own. False for a row built from the user
    /// daemon's record alone (`lost`, `degraded`, `failed` without the root
    /// half): its zeros mean "unknown", and the table shows `-` for them.
    pub measured: bool,
}

/// `state` of a session whose user-side half is gone for good.
pub const STATE_LOST: &str = "lost";

/// Merge the root daemon's sessions with the user daemon's halves (pure; the
/// order is the root daemon's, then user-only sessions by id).
/// The reason of a session that is not connected, given the user daemon's
/// `transport_error` (the SSH path's error, or why no manager pod carries the
/// data channel: none ready, the Deployment scaled to 0) and the root daemon's
/// `root_reason`: the root daemon sees only the symptom (the listener ends the
/// TLS handshake), so the cause comes first.
pub fn transport_reason(transport_error: &str, root_reason: &str) -> String {
    if root_reason.is_empty() {
        transport_error.to_owned()
    } else {
        format!("{transport_error} (data channel: {root_reason})")
    }
}

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
                Some(u) if !u.transport_error.is_empty() && s.state != "connected" => {
                    s.reason = transport_reason(&u.transport_error, &s.reason);
                }
                _ => {}
            }
            // An ssh-direct session's data path as the agent uses it now.
            if let (Some(u), Some(o)) = (&u, s.origin.as_mut())
                && !u.data_path.is_empty()
            {
                o.data_path.clone_from(&u.data_path);
            }
            StatusRow {
                namespace: u.as_ref().map(|u| u.namespace.clone()).unwrap_or_default(),
                session: s,
                user: u,
                measured: true,
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
        let (state, reason) =
            if u.state == STATE_LOST || u.state == crate::userd::server::STATE_DEGRADED {
                // Lost, or kept while the root daemon does not answer (its reason
                // names the pid and `kill -CONT`).
                (u.state.clone(), u.reason.clone())
            } else if u.state == crate::userd::server::STATE_RESTORING && !u.reason.is_empty() {
                // A restarted user daemon waits for a root daemon that does not
                // answer (its reason says which and the fix): kept, not failed.
                (
                    crate::userd::server::STATE_DEGRADED.to_owned(),
                    u.reason.clone(),
                )
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
                mtu: socks.mtu,
                liveness: socks.liveness,
                resumes: socks.resumes,
                resumes_lost: socks.resumes_lost,
                tcp_flows_reset: socks.tcp_flows_reset,
                ..Session::default()
            },
            namespace: u.namespace.clone(),
            user: Some(u.clone()),
            // A SOCKS session's counters are read only while it runs.
            measured: u.socks.is_some() && u.state == crate::userd::server::STATE_RUNNING,
        });
    }
    rows
}

fn session_json(row: &StatusRow) -> serde_json::Value {
    let s = &row.session;
    let origin = s.origin.clone().unwrap_or_default();
    // A row built from the user daemon's record alone has no counters,
    // uptime or TUN facts: null, not made-up zeros (the table shows `-`).
    let known = |v: serde_json::Value| {
        if row.measured {
            v
        } else {
            serde_json::Value::Null
        }
    };
    // A SOCKS session has no TUN device and no eBPF programs: no counters of
    // them (null), not zeros that read as "loaded, nothing seen".
    let socks = row.user.as_ref().and_then(|u| u.socks.as_ref());
    let no_ebpf = |v: serde_json::Value| {
        if socks.is_some() {
            serde_json::Value::Null
        } else {
            known(v)
        }
    };
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
        "socks": socks.map(|x| serde_json::json!({
            "listen": x.listen,
            "open_flows": x.open_flows,
            "dns_servers": x.dns_servers,
            "warning": crate::socks::remote_warning(&x.listen),
        })),
        "transport": text_or_null(&origin.transport),
        "data_path": text_or_null(&origin.data_path),
        "data_path_reason": row.user.as_ref().map_or(serde_json::Value::Null, |u| text_or_null(&u.data_path_reason)),
        "source_policy": text_or_null(&origin.source_policy),
        "source_policy_note": text_or_null(&origin.source_policy_note),
        "cluster": text_or_null(&origin.cluster),
        "server": text_or_null(&origin.server),
        "cluster_id": text_or_null(&origin.cluster_id),
        "context": text_or_null(&origin.context),
        "manager_namespace": text_or_null(&origin.manager_namespace),
        "manager_replica": text_or_null(&origin.manager_replica),
        "manager_replica_reason": text_or_null(&origin.manager_replica_reason),
        "manager": s.manager,
        "tunnel_ip": s.tunnel_ip,
        "tunnel_ip_v6": text_or_null(&s.tunnel_ip_v6),
        "tun_name": s.tun_name,
        "mtu": known(serde_json::json!(s.mtu)),
        "data_channel": text_or_null(&s.data_channel),
        "workers": known(serde_json::json!(s.workers.max(1))),
        "workers_connected": known(serde_json::json!(s.workers_connected)),
        "resumes": known(serde_json::json!(s.resumes)),
        "resumes_lost": known(serde_json::json!(s.resumes_lost)),
        "tcp_flows_reset": known(serde_json::json!(s.tcp_flows_reset)),
        "held_packets": known(serde_json::json!(s.held_packets)),
        "stale_tcp_flows_reset": known(serde_json::json!(s.stale_tcp_flows_reset)),
        "routes_repaired": known(serde_json::json!(s.routes_repaired)),
        // `kvpn run` sessions: null for a laptop-wide one.
        "run_cgroup": text_or_null(&s.run_cgroup),
        "run_table": if s.run_table == 0 { serde_json::Value::Null } else { serde_json::json!(s.run_table) },
        "run_mark": if s.run_mark == 0 { serde_json::Value::Null } else { serde_json::json!(s.run_mark) },
        "run_dns": text_or_null(&s.run_dns),
        "state": s.state,
        "reason": s.reason,
        "uptime_ms": known(serde_json::json!(s.uptime_ms)),
        // Unknown (null) for a row from the user daemon's record alone, which
        // holds no routes, Services or conflicts: `[]` would read as "none".
        "routes": known(s.routes.iter().map(|r| serde_json::json!({"cidr": r.cidr, "kind": kind_name(r.kind), "watched": r.watched})).collect()),
        // Laptop addresses inside the cluster ranges kept off the tunnel, with why.
        "kept_out": origin.kept_out.iter().map(|k| serde_json::json!({
            "address": k.address,
            "why": k.why,
            "cidr": k.cidr,
            "kind": k.kind,
        })).collect::<Vec<_>>(),
        // connect's DNS and routing options, and what the cluster DNS said of
        // each --extra-domain (null until the route watch asked).
        "never_proxy": origin.never_proxy,
        "include_suffixes": origin.include_suffixes,
        "exclude_suffixes": origin.exclude_suffixes,
        "extra_domains": origin.extra_domains.iter().map(|name| {
            let got = s.route_source.as_ref().and_then(|r| r.extra_domains.iter().find(|d| d.name == *name));
            serde_json::json!({
                "name": name,
                "addresses": got.map(|d| d.addresses.clone()),
                "error": got.map(|d| text_or_null(&d.error)),
            })
        }).collect::<Vec<_>>(),
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
            "upstreams": c.upstreams,
            "resolv_conf_reapplied": c.resolv_conf_reapplied,
            "resolv_conf_reapplied_at_unix": c.resolv_conf_reapplied_at_unix,
            "cluster_socket_reopened": c.cluster_socket_reopened,
        })),
        "services": known(s.services.iter().map(|v| serde_json::json!({
            "namespace": v.namespace,
            "name": v.name,
            "cluster_ips": v.cluster_ips,
            "ports": v.ports,
        })).collect()),
        "conflicts": known(s.conflicts.iter().map(|c| serde_json::json!({
            "cidr": c.cidr,
            "kind": kind_name(c.kind),
            "laptop_cidr": c.laptop_cidr,
            "laptop_dev": c.laptop_dev,
            "laptop_proto": c.laptop_proto,
            "laptop_table": c.laptop_table,
            "message": c.message,
            "handling": c.handling,
            "pinned": c.pinned,
        })).collect()),
        "tx": known(serde_json::json!({
            "packets": s.tx_packets,
            "bytes": s.tx_bytes,
            "gso_frames": s.tx_gso_frames,
            "gso_segmented": s.tx_gso_segmented,
            "offload_dropped": s.tx_offload_dropped,
        })),
        "rx": known(serde_json::json!({
            "packets": s.rx_packets,
            "bytes": s.rx_bytes,
            "gso_frames": s.rx_gso_frames,
            "gso_segments": s.rx_gso_segments,
        })),
        "ebpf": no_ebpf(serde_json::json!({
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
                    "attached": t.attached.iter().map(|d| serde_json::json!({"device": d.name, "ifindex": d.ifindex})).collect::<Vec<_>>(),
                    "reattachments": t.reattachments,
                    "errors": t.errors,
                    "steered": c(&t.steered),
                    "reverse_translated": c(&t.reverse_translated),
                    "no_conntrack": c(&t.no_conntrack),
                    "failed": c(&t.failed),
                })
            }),
        })),
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
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RootDaemon {
    /// Whether one answered.
    pub running: bool,
    /// When none answered but its process runs (stopped, hung): its pid and
    /// /proc state letter ([`crate::liveness`]).
    pub not_answering: Option<(i32, char)>,
    /// Calls it refused because of the caller's uid (SO_PEERCRED), since it
    /// started; `None` when it does not run.
    pub refused_peers: Option<u64>,
    /// It runs for another uid and refuses this one: its words (the uids and
    /// the fix).
    pub refuses_me: Option<String>,
}

/// The status document of `-o json` / `-o yaml` (schema: docs/status.md).
pub fn status_document(rows: &[StatusRow], root: RootDaemon) -> serde_json::Value {
    let mut root_daemon = serde_json::json!({"running": root.running || root.refuses_me.is_some()});
    if let Some(why) = &root.refuses_me {
        root_daemon["refuses_this_uid"] = why.clone().into();
    }
    if let Some(n) = root.refused_peers {
        root_daemon["refused_peers"] = n.into();
    }
    if let Some((pid, state)) = root.not_answering {
        root_daemon["not_answering"] = serde_json::json!({
            "pid": pid,
            "stopped": matches!(state, 'T' | 't'),
            "reason": crate::liveness::not_answering_text(pid, state),
        });
    }
    serde_json::json!({
        "root_daemon": root_daemon,
        "sessions": rows.iter().map(session_json).collect::<Vec<_>>(),
    })
}

/// The table's line about refused callers of the root socket, when there were any.
fn refused_peers_line(out: &mut String, root: RootDaemon) {
    if let Some(n) = root.refused_peers.filter(|&n| n > 0) {
        out.push_str(&format!(
            "The root daemon refused {n} call(s) from uids it does not accept (its socket admits \
             root and the uid it was started for) — `kvpn logs` names them\n"
        ));
    }
}

/// `kvpn status` output.
pub fn status(
    rows: &[StatusRow],
    root: RootDaemon,
    format: OutputFormat,
    runtime_dir: &Path,
) -> Result<()> {
    let document = || {
        let mut doc = status_document(rows, root.clone());
        // After a death of the root daemon: what its DNS guard did.
        if !root.running
            && let Some(note) = kvpn_dataplane::dns::guard::Note::read(runtime_dir)
        {
            doc["root_daemon"]["dns_guard"] = dns_guard_json(&note);
        }
        doc
    };
    match format {
        OutputFormat::Json => {
            println!("{}", serde_json::to_string_pretty(&document())?);
        }
        OutputFormat::Yaml => {
            let text = serde_yaml_ng::to_string(&document())?;
            println!("{}", text.trim_end());
        }
        OutputFormat::Table => print!("{}", status_table(rows, root)),
    }
    Ok(())
}

/// The `kvpn status` table (pure).
fn status_table(rows: &[StatusRow], root: RootDaemon) -> String {
    let mut out = String::new();
    macro_rules! say {
        ($($arg:tt)*) => {{
            out.push_str(&format!($($arg)*));
            out.push('\n');
        }};
    }
    let not_answering = root
        .not_answering
        .map(|(pid, state)| crate::liveness::not_answering_text(pid, state))
        .map(|t| format!("T{}", t.strip_prefix('t').unwrap_or(&t)));
    if let Some(why) = &root.refuses_me {
        // Sessions of this user's own (SOCKS) may still be listed below: then
        // it is the TUN side that is out of reach, not everything (trial T4).
        if rows.is_empty() {
            say!("Not connected: {why}");
            return out;
        }
        say!("No TUN session for this user: {why}");
    }
    if rows.is_empty() {
        match not_answering {
            // Its `direct` sessions are known only to it.
            Some(t) => say!("{t} (they are listed once it answers)"),
            None => say!("Not connected (the root daemon runs, with no session)"),
        }
        refused_peers_line(&mut out, root);
        return out;
    }
    if let Some(t) = not_answering {
        say!("{t}");
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
            // A `kvpn run` session reaches the cluster for one process tree only:
            // its row must not read like a laptop-wide connect's.
            if s.run_cgroup.is_empty() || o.transport.is_empty() {
                dash(&o.transport)
            } else {
                format!("{}(run)", o.transport)
            },
            if s.tunnel_ip_v6.is_empty() {
                dash(&s.tunnel_ip)
            } else {
                format!("{},{}", s.tunnel_ip, s.tunnel_ip_v6)
            },
            dash(&s.tun_name),
            s.state.clone(),
            measured(r, || uptime(s.uptime_ms)),
            measured(r, || format!("{}/{}", s.tx_packets, s.tx_bytes)),
            measured(r, || format!("{}/{}", rx_segments(s), s.rx_bytes)),
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
    say!("{}", line(&table[0]));
    for (r, cells) in rows.iter().zip(&table[1..]) {
        say!("{}", line(cells));
        let s = &r.session;
        if !s.manager.is_empty() {
            say!("    data channel to {}", s.manager);
        }
        if let Some(x) = r.user.as_ref().and_then(|u| u.socks.as_ref()) {
            say!(
                "    SOCKS5 proxy on {}, no TUN device; {} open flows; names resolve through the cluster DNS {}",
                x.listen,
                x.open_flows,
                if x.dns_servers.is_empty() {
                    "(none: IP addresses only)".to_owned()
                } else {
                    x.dns_servers.join(",")
                }
            );
            if let Some(w) = crate::socks::remote_warning(&x.listen) {
                say!("    warning: {w}");
            }
        }
        if !s.reason.is_empty() {
            say!("    reason: {}", s.reason);
        }
        if let Some(u) = &r.user
            && u.restores > 0
        {
            say!(
                "    port-forward brought back {} time(s) by a restarted user daemon",
                u.restores
            );
        }
        if let Some(l) = &s.liveness {
            say!(
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
            say!("    {line}");
        }
        match &s.origin {
            Some(o) if !o.cluster.is_empty() => {
                // The CA's digest, short: what tells two clusters at one URL apart.
                let ca = o
                    .cluster_id
                    .strip_prefix("ca-sha256:")
                    .map(|hex| format!(", CA sha256 {}", hex.get(..12).unwrap_or(hex)))
                    .unwrap_or_default();
                say!(
                    "    cluster {} (context {}, {}{ca}) through {}, traffic manager in {}",
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
                if let Some(why) = r
                    .user
                    .as_ref()
                    .map(|u| u.data_path_reason.as_str())
                    .filter(|w| !w.is_empty())
                {
                    say!("    data path: {why}");
                }
                if !o.manager_replica.is_empty() {
                    say!(
                        "    manager replica {} ({})",
                        o.manager_replica,
                        o.manager_replica_reason
                    );
                }
                if !o.source_policy.is_empty() {
                    say!(
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
                    if !o.source_policy_note.is_empty() {
                        say!("    warning: {}", o.source_policy_note);
                    }
                }
            }
            Some(o) if !o.transport.is_empty() => {
                say!("    transport {}", o.transport);
            }
            _ => {}
        }
        match s.data_channel.as_str() {
            "tls" => {
                say!("    data channel tls (TLS 1.3, manager certificate verified)")
            }
            "plain" => say!("    data channel plain (unencrypted TCP)"),
            _ => {}
        }
        if s.workers > 1 {
            say!(
                "    workers {} ({} connected): a TUN queue and a data connection each",
                s.workers,
                s.workers_connected
            );
        }
        for line in redial_and_offload_lines(s) {
            say!("    {line}");
        }
        if let Some(o) = &s.origin {
            for k in &o.kept_out {
                say!("    {}", crate::connect::kept_out_line(k));
            }
            if !o.never_proxy.is_empty() {
                say!(
                    "    never proxied (--never-proxy): {}",
                    o.never_proxy.join(" ")
                );
            }
            if !o.include_suffixes.is_empty() {
                say!(
                    "    DNS to the cluster for suffixes (--include-suffix): {}",
                    o.include_suffixes.join(" ")
                );
            }
            if !o.exclude_suffixes.is_empty() {
                say!(
                    "    DNS to the laptop's nameservers for suffixes (--exclude-suffix): {}",
                    o.exclude_suffixes.join(" ")
                );
            }
            let reported = s
                .route_source
                .as_ref()
                .map(|r| r.extra_domains.clone())
                .unwrap_or_default();
            for name in &o.extra_domains {
                match reported.iter().find(|d| d.name == *name) {
                    Some(d) => match crate::connect::extra_domain_lines(
                        std::slice::from_ref(d),
                        &s.tun_name,
                    )
                    .remove(0)
                    {
                        Ok(l) | Err(l) => say!("    {l}"),
                    },
                    None => say!(
                        "    extra domain {name}: not asked yet (the route watch has not reported)"
                    ),
                }
            }
        }
        match &s.route_source {
            Some(r) if r.reason.is_empty() => say!(
                "    routes from {} ({} Services; pod CIDRs from {})",
                r.mode,
                s.services.len(),
                r.pod_cidr_source
            ),
            Some(r) => say!("    routes from {}: {}", r.mode, r.reason),
            None => {}
        }
        if let Some(d) = &s.dns {
            say!(
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
            say!(
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
            if c.cluster_socket_reopened > 0 {
                say!(
                    "    DNS forwarder reopened its socket to the cluster DNS {} time(s): the \
                     routes gave the cluster DNS another source address (a route through the \
                     TUN device added after the first question)",
                    c.cluster_socket_reopened
                );
            }
            if c.resolv_conf_reapplied > 0 {
                say!(
                    "    resolv.conf was rewritten by something else {} time(s) while connected \
                     (NetworkManager, a DHCP client); kvpn put its entry back and forwards other \
                     names to the new nameservers {}",
                    c.resolv_conf_reapplied,
                    c.upstreams.join(" ")
                );
            }
        }
        if !r.measured && r.user.as_ref().is_none_or(|u| u.socks.is_none()) {
            say!("    routes unknown: the root daemon did not report this session");
        }
        for r in &s.routes {
            say!(
                "    route {:<20} {}{}",
                r.cidr,
                kind_name(r.kind),
                if r.watched { " (watched)" } else { "" }
            );
        }
        for c in &s.conflicts {
            say!(
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
        for l in ebpf_lines(s).into_iter().filter(|_| r.measured) {
            say!("{l}");
        }
    }
    refused_peers_line(&mut out, root);
    out
}

/// "1 TCP connection", "N TCP connections".
pub fn tcp_connections(n: u64) -> String {
    if n == 1 {
        "1 TCP connection".to_owned()
    } else {
        format!("{n} TCP connections")
    }
}

/// A table cell of a measured value, `-` when the row's values are unknown
/// ([`StatusRow::measured`]) rather than a made-up zero.
fn measured(r: &StatusRow, cell: impl FnOnce() -> String) -> String {
    if r.measured { cell() } else { "-".to_owned() }
}

/// The packets the laptop's stack got from the tunnel: `rx_packets` counts
/// TUN writes, a GSO super-packet once; this counts its segments instead
/// (the table's RX PKTS).
fn rx_segments(s: &Session) -> u64 {
    s.rx_packets
        .saturating_sub(s.rx_gso_frames)
        .saturating_add(s.rx_gso_segments)
}

/// The table's re-dial line (when a worker re-dialed or held packets), stale
/// connection line (when connect reset some), repaired-routes line (when the
/// route guard re-added any) and offload line (when any GSO frame went either
/// way).
fn redial_and_offload_lines(s: &Session) -> Vec<String> {
    let mut lines = Vec::new();
    if s.resumes > 0 || s.resumes_lost > 0 || s.tcp_flows_reset > 0 || s.held_packets > 0 {
        lines.push(format!(
            "re-dials: {} resumed their flows, {} lost them (manager restarted or its grace period over); \
             {} TCP flows reset on the laptop, {} packets held during re-dials",
            s.resumes, s.resumes_lost, s.tcp_flows_reset, s.held_packets
        ));
    }
    if s.stale_tcp_flows_reset > 0 {
        lines.push(format!(
            "connect reset {} an earlier session left on the laptop (its root daemon died)",
            tcp_connections(s.stale_tcp_flows_reset)
        ));
    }
    if !s.run_cgroup.is_empty() {
        lines.push(format!(
            "kvpn run: only the processes of cgroup {} reach this cluster (routing table {:#x}, \
             fwmark {:#x}, DNS forwarder {})",
            s.run_cgroup, s.run_table, s.run_mark, s.run_dns
        ));
    }
    if s.routes_repaired > 0 {
        lines.push(format!(
            "routes: {} re-added after they were deleted from outside kvpn (`ip route del`)",
            s.routes_repaired
        ));
    }
    if s.tx_gso_frames > 0
        || s.tx_gso_segmented > 0
        || s.tx_offload_dropped > 0
        || s.rx_gso_frames > 0
    {
        lines.push(format!(
            "offloads: tx {} GSO frames, {} super-packets segmented here, {} dropped; \
             rx {} GSO frames ({} segments)",
            s.tx_gso_frames,
            s.tx_gso_segmented,
            s.tx_offload_dropped,
            s.rx_gso_frames,
            s.rx_gso_segments
        ));
    }
    lines
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
        let devices: Vec<String> = if t.attached.is_empty() {
            t.devices.clone()
        } else {
            t.attached
                .iter()
                .map(|d| format!("{} (ifindex {})", d.name, d.ifindex))
                .collect()
        };
        let devices = if devices.is_empty() {
            "no device".to_owned()
        } else {
            devices.join(", ")
        };
        lines.push(format!(
            "    eBPF steering on {devices}: steered {} packets, {} replies translated back, \
             {} left to the laptop's route (no conntrack), {} failed, {} re-attached",
            c(&t.steered),
            c(&t.reverse_translated),
            c(&t.no_conntrack),
            c(&t.failed),
            t.reattachments
        ));
        for e in &t.errors {
            lines.push(format!("    eBPF steering error: {e}"));
        }
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpn_proto::dataplane::Origin;

    /// The re-dial counters and GSO frames show in the table (they were
    /// JSON only, but for tcp_flows_reset), and RX PKTS counts the segments
    /// of a super-packet, not one per TUN write.
    #[test]
    fn table_shows_redial_and_offload_counters_and_counts_rx_segments() {
        let mut s = Session {
            rx_packets: 10,
            ..Default::default()
        };
        assert!(redial_and_offload_lines(&s).is_empty(), "nothing to say");
        assert_eq!(rx_segments(&s), 10);
        // 10 TUN writes: 6 packets and 4 super-packets of 45 segments.
        s.rx_gso_frames = 4;
        s.rx_gso_segments = 180;
        assert_eq!(rx_segments(&s), 186);
        s.held_packets = 3;
        assert_eq!(
            redial_and_offload_lines(&s),
            [
                "re-dials: 0 resumed their flows, 0 lost them (manager restarted or its grace period over); \
                 0 TCP flows reset on the laptop, 3 packets held during re-dials",
                "offloads: tx 0 GSO frames, 0 super-packets segmented here, 0 dropped; \
                 rx 4 GSO frames (180 segments)",
            ]
        );
        let json = session_json(&StatusRow {
            session: s,
            user: None,
            namespace: String::new(),
            measured: true,
        });
        assert_eq!(json["rx"]["gso_segments"], 180);
        let s = Session {
            stale_tcp_flows_reset: 2,
            ..Default::default()
        };
        assert_eq!(
            redial_and_offload_lines(&s),
            [
                "connect reset 2 TCP connections an earlier session left on the laptop (its root daemon died)"
            ]
        );
        let s = Session {
            stale_tcp_flows_reset: 1,
            ..Default::default()
        };
        assert_eq!(
            redial_and_offload_lines(&s),
            [
                "connect reset 1 TCP connection an earlier session left on the laptop (its root daemon died)"
            ]
        );
        let s = Session {
            routes_repaired: 1,
            ..Default::default()
        };
        assert_eq!(
            redial_and_offload_lines(&s),
            ["routes: 1 re-added after they were deleted from outside kvpn (`ip route del`)"]
        );
        let json = session_json(&StatusRow {
            session: s,
            user: None,
            namespace: String::new(),
            measured: true,
        });
        assert_eq!(json["routes_repaired"], 1);
    }

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
            manager_pod_ips: Vec::new(),
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

    /// #30 F10: a `kvpn run` session's row says so in TRANSPORT.
    #[test]
    fn table_marks_run_sessions_in_the_transport_column() {
        let mut run = root("r", "port-forward", "connected");
        run.run_cgroup = "kvpn-run-r".into();
        let rows = merge_sessions(
            vec![root("c", "port-forward", "connected"), run],
            vec![user("c", "running", ""), user("r", "running", "")],
        );
        let table = status_table(&rows, RootDaemon::default());
        let transport = |id: &str| {
            table
                .lines()
                .find(|l| l.starts_with(&format!("{id} ")))
                .and_then(|l| l.split_whitespace().nth(4).map(str::to_owned))
                .unwrap_or_else(|| panic!("no row {id} in\n{table}"))
        };
        assert_eq!(transport("c"), "port-forward", "\n{table}");
        assert_eq!(transport("r"), "port-forward(run)", "\n{table}");
    }

    /// Rows built from the user daemon's record alone (`lost`, `degraded`)
    /// show `-` for uptime and counters and no eBPF lines, instead of the
    /// made-up `0s`, `0/0` and "eBPF unrouted (dropped) 0 packets" (on main);
    /// a row with the root daemon's half keeps its numbers.
    #[test]
    fn table_shows_unknown_counters_and_uptime_as_dashes() {
        let mut live = root("a", "port-forward", "connected");
        live.tun_name = "kvpn0".into();
        live.uptime_ms = 61_000;
        live.tx_packets = 5;
        live.tx_bytes = 500;
        live.rx_packets = 7;
        live.rx_bytes = 700;
        let mut lost = user("z", "lost", "the root daemon no longer has this session");
        lost.uptime_ms = 31;
        let degraded = user("y", crate::userd::server::STATE_DEGRADED, "stopped");
        let rows = merge_sessions(vec![live], vec![user("a", "running", ""), lost, degraded]);
        assert_eq!(
            rows.iter().map(|r| r.measured).collect::<Vec<_>>(),
            [true, false, false]
        );
        let table = status_table(&rows, RootDaemon::default());
        let cells = |id: &str| -> Vec<String> {
            let line = table
                .lines()
                .find(|l| l.starts_with(&format!("{id} ")))
                .unwrap_or_else(|| panic!("no row {id} in\n{table}"));
            line.split_whitespace().map(str::to_owned).collect()
        };
        let tail = |id: &str| cells(id)[cells(id).len() - 3..].to_vec();
        assert_eq!(tail("a"), ["1m1s", "5/500", "7/700"], "\n{table}");
        assert_eq!(cells("a")[4], "port-forward", "\n{table}");
        assert_eq!(tail("z"), ["-", "-", "-"], "\n{table}");
        assert_eq!(tail("y"), ["-", "-", "-"], "\n{table}");
        assert_eq!(
            table.matches("eBPF unrouted").count(),
            1,
            "only the measured row has eBPF lines:\n{table}"
        );
        assert_eq!(
            table.matches("routes unknown").count(),
            2,
            "the unmeasured rows say their routes are unknown, not absent:\n{table}"
        );
        assert!(
            !table.contains("0/0") && !table.contains(" 0s"),
            "\n{table}"
        );
    }

    /// The JSON agrees with the table: a row from the user daemon's record
    /// alone has `null` uptime, counters and TUN facts (on main: zeros and the
    /// user half's uptime as if measured); a measured row keeps its numbers,
    /// and the user half's own uptime stays under `user_daemon`.
    #[test]
    fn json_shows_unknown_counters_and_uptime_as_null() {
        let mut live = root("a", "port-forward", "connected");
        live.uptime_ms = 61_000;
        live.tx_packets = 5;
        live.mtu = 1400;
        let mut lost = user("z", "lost", "the root daemon no longer has this session");
        lost.uptime_ms = 31;
        let degraded = user("y", crate::userd::server::STATE_DEGRADED, "stopped");
        let rows = merge_sessions(vec![live], vec![user("a", "running", ""), lost, degraded]);
        let unknown = [
            "uptime_ms",
            "mtu",
            "workers",
            "workers_connected",
            "resumes",
            "resumes_lost",
            "tcp_flows_reset",
            "held_packets",
            "stale_tcp_flows_reset",
            "routes_repaired",
            "tx",
            "rx",
            "ebpf",
            "liveness",
            "manager_stats",
            "routes",
            "services",
            "conflicts",
        ];
        for r in &rows[1..] {
            let doc = session_json(r);
            for key in unknown {
                assert!(doc[key].is_null(), "{key} of {}: {doc:#}", r.session.id);
            }
        }
        let lost = rows.iter().find(|r| r.session.id == "z").expect("row z");
        let doc = session_json(lost);
        assert_eq!(doc["user_daemon"]["uptime_ms"], 31, "{doc:#}");
        let doc = session_json(&rows[0]);
        assert_eq!(doc["uptime_ms"], 61_000);
        assert_eq!(doc["mtu"], 1400);
        assert_eq!(doc["tx"]["packets"], 5);
        assert_eq!(doc["rx"]["packets"], 0);
        assert_eq!(doc["resumes"], 0);
    }

    /// A stopped root daemon: its sessions are `degraded` with the user
    /// daemon's reason, the document names pid and fix, and the resolv.conf
    /// warning says "stopped", never "died".
    #[test]
    fn a_stopped_root_daemon_is_named_not_declared_dead() {
        let reason = crate::liveness::not_answering_text(4242, 'T');
        let rows = merge_sessions(
            Vec::new(),
            vec![user("s1", crate::userd::server::STATE_DEGRADED, &reason)],
        );
        assert_eq!(rows[0].session.state, "degraded");
        assert_eq!(rows[0].session.reason, reason);
        let doc = status_document(
            &rows,
            RootDaemon {
                refuses_me: None,
                running: false,
                refused_peers: None,
                not_answering: Some((4242, 'T')),
            },
        );
        let na = &doc["root_daemon"]["not_answering"];
        assert_eq!(na["pid"], 4242);
        assert_eq!(na["stopped"], true);
        assert!(
            na["reason"]
                .as_str()
                .is_some_and(|r| r.contains("`sudo kill -CONT 4242`"))
        );
        let stopped = dns_left_changed_text(Some((4242, 'T')));
        assert!(
            stopped.contains("pid 4242")
                && stopped.contains("stopped")
                && stopped.contains("kill -CONT 4242")
                && !stopped.contains("died"),
            "{stopped}"
        );
        // A restarted user daemon waiting for it: degraded too, with its reason.
        let waiting = format!("waiting for the root daemon: {reason}");
        let rows = merge_sessions(
            Vec::new(),
            vec![user("s1", crate::userd::server::STATE_RESTORING, &waiting)],
        );
        assert_eq!(rows[0].session.state, "degraded");
        assert_eq!(rows[0].session.reason, waiting);
        let hung = dns_left_changed_text(Some((4242, 'S')));
        assert!(
            hung.contains("not answering") && !hung.contains("died"),
            "{hung}"
        );
        assert!(dns_left_changed_text(None).contains("died"));
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
                refuses_me: None,
                running: true,
                refused_peers: Some(2),
                not_answering: None,
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
                refuses_me: None,
                running: false,
                refused_peers: None,
                not_answering: None,
            },
        );
        assert!(doc["root_daemon"].get("refused_peers").is_none());
        assert_eq!(doc["sessions"][0]["socks"]["listen"], "127.0.0.1:1080");
        assert_eq!(doc["sessions"][0]["socks"]["open_flows"], 3);
        assert_eq!(doc["sessions"][0]["tun_name"], "");
        let plain = status_document(
            &merge_sessions(Vec::new(), vec![user("x", "lost", "")]),
            RootDaemon {
                refuses_me: None,
                running: true,
                refused_peers: Some(0),
                not_answering: None,
            },
        );
        assert_eq!(plain["sessions"][0]["socks"], serde_json::Value::Null);
        // A refused user with a SOCKS session of its own: the table does not
        // open with "Not connected" above a connected session (trial T4).
        let refused = RootDaemon {
            refuses_me: Some("the root daemon kvpn-dataplane refuses uid 65534".into()),
            running: true,
            refused_peers: None,
            not_answering: None,
        };
        let table = status_table(&rows, refused.clone());
        assert!(
            table.starts_with("No TUN session for this user: the root daemon")
                && !table.contains("Not connected"),
            "{table}"
        );
        assert!(status_table(&[], refused).starts_with("Not connected: the root daemon"));
    }
}
