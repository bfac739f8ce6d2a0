//! `kvpn connect` through a kubeconfig: install or upgrade the traffic manager,
//! detect the cluster's CIDRs, keep the laptop's essentials out of the tunnel,
//! and hand the session to the user daemon ([`crate::userd`]: port-forward,
//! route watch), which asks the root daemon for the TUN device and routes.
//!
//! Connect is idempotent: each session carries its [`Origin`] (cluster, API
//! server, context, manager namespace, transport) in the root daemon, and a
//! second `kvpn connect` to the same cluster and context finds it there and does
//! nothing ([`match_session`]).

use std::net::{IpAddr, Ipv6Addr};
use std::path::Path;

use anyhow::{Context, Result, bail};
use ipnet::IpNet;
use kvpn_proto::dataplane::{
    ClusterDns, ConnectRequest, DisconnectRequest, Origin, Route, RouteKind, Session,
};

use crate::cidr::{self, DetectOptions};
use crate::cli::ConnectArgs;
use crate::install::{self, InstallOptions, ProgressEvent};
use crate::kubeconfig::{KubeConnection, UserEnv};
use crate::lease;
use crate::{daemon, output, settings, userd};
use kvpn_proto::manager::LeaseResponse;
use kvpn_proto::userd::StartSessionRequest;
use kvpn_proto::userd::user_daemon_client::UserDaemonClient;
use std::os::unix::ffi::OsStrExt as _;

/// Prints install progress the way the rest of the CLI does.
pub(crate) fn print_progress(event: ProgressEvent) {
    match event {
        ProgressEvent::Step(s) => output::step(&s),
        ProgressEvent::Detail(s) => output::detail(&s),
        ProgressEvent::Done(s) => output::done(&s),
        ProgressEvent::Warning(s) => output::warn(&s),
    }
}

/// `Origin.transport` of a session whose data channel rides `pods/portforward`
/// (the root daemon words its errors by it, so both read the one constant).
pub use kvpn_dataplane::session::TRANSPORT_PORT_FORWARD;
/// `Origin.transport` of a session dialling `--manager` directly.
pub const TRANSPORT_DIRECT: &str = "direct";

/// How long connect waits for the traffic manager's first heartbeat echo before
/// it reports the session as set up but not connected yet. The echo normally
/// takes one round trip (milliseconds); through a port-forward whose agent waits
/// for a manager pod, up to a few seconds.
pub const FIRST_ECHO_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Wait until session `id` is connected, i.e. the manager echoed a heartbeat on
/// it ("connected" is never claimed before that). `Ok(None)` once connected;
/// `Ok(Some(session))` with its last state when `within` passed first.
pub async fn wait_first_echo(
    client: &mut kvpn_proto::dataplane::dataplane_client::DataplaneClient<
        crate::daemon_channel::DaemonChannel,
    >,
    id: &str,
    within: std::time::Duration,
) -> Result<Option<Session>> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let sessions =
            daemon::sessions(client, "cannot ask the root daemon for the session's state").await?;
        let Some(session) = sessions.into_iter().find(|s| s.id == id) else {
            bail!(
                "session {id} disappeared from the root daemon right after connect — see its log"
            );
        };
        if session.state == "connected" {
            return Ok(None);
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(Some(session));
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// How long `kvpn connect` waits for the route watch's first report (the
/// traffic manager's snapshot of pod CIDRs and Services, applied by the root
/// daemon). Measured in the lab: 0.1-0.4 s after the first heartbeat echo (a
/// port-forward to the manager's gRPC port, one WatchRoutes call); a manager pod
/// still starting can take a few seconds more.
pub const ROUTE_WATCH_WAIT: std::time::Duration = std::time::Duration::from_secs(15);

/// What the route watch of a session has put in place, as connect reports it.
#[derive(Debug, PartialEq, Eq)]
pub enum RouteWatchReport {
    /// The watch's first snapshot is applied: its routes, the Services and the
    /// host routes pinned past conflicting laptop routes exist.
    Watching { pinned: Vec<String> },
    /// No route watch (refused, an older manager, or broken before its first
    /// snapshot): only the connect-time CIDRs are routed, and why.
    CidrOnly(String),
    /// Nothing reported within the wait.
    NotYet,
}

/// What `session` says of its route watch ([`RouteWatchReport::NotYet`] until
/// the root daemon applied its first report). The root daemon records the route
/// source only after the request's routes and pinned host routes are installed,
/// so a reported source means they exist.
pub fn route_watch_report(session: &Session) -> RouteWatchReport {
    match &session.route_source {
        Some(src) if src.mode == crate::route_watch::MODE_WATCH => RouteWatchReport::Watching {
            pinned: session
                .conflicts
                .iter()
                .flat_map(|c| c.pinned.iter().cloned())
                .collect(),
        },
        Some(src) if !src.mode.is_empty() => RouteWatchReport::CidrOnly(src.reason.clone()),
        _ => RouteWatchReport::NotYet,
    }
}

/// Wait (bounded by `within`) until the route watch of session `id` reported,
/// so that connect returns only when the routes it reports are in place (issue
/// 29 item 1: connect returned 100-170 ms before the pinned ClusterIP host
/// routes existed, and a curl right after it failed). Says what it found.
pub async fn wait_route_watch(
    client: &mut kvpn_proto::dataplane::dataplane_client::DataplaneClient<
        crate::daemon_channel::DaemonChannel,
    >,
    id: &str,
    within: std::time::Duration,
) -> Result<RouteWatchReport> {
    let started = tokio::time::Instant::now();
    let deadline = started + within;
    loop {
        let sessions = daemon::sessions(
            client,
            "cannot ask the root daemon for the session's routes",
        )
        .await?;
        let Some(session) = sessions.into_iter().find(|s| s.id == id) else {
            bail!(
                "session {id} disappeared from the root daemon while connect waited for its \
                 route watch — see `kvpn status` and the root daemon's log"
            );
        };
        let report = route_watch_report(&session);
        match &report {
            RouteWatchReport::Watching { pinned } => {
                tracing::debug!(
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "route watch reported"
                );
                output::done(&format!(
                    "Route watch: {} Service(s), {} pod CIDR(s) of the traffic manager routed",
                    session.services.len(),
                    session
                        .route_source
                        .as_ref()
                        .map_or(0, |s| s.pod_cidrs.len())
                ));
                for p in pinned {
                    output::detail(&format!(
                        "pinned {p} through {} past a conflicting laptop route",
                        session.tun_name
                    ));
                }
                let extra = session
                    .route_source
                    .as_ref()
                    .map(|s| s.extra_domains.clone())
                    .unwrap_or_default();
                for line in extra_domain_lines(&extra, &session.tun_name) {
                    match line {
                        Ok(l) => output::done(&l),
                        Err(l) => output::warn(&l),
                    }
                }
                return Ok(report);
            }
            RouteWatchReport::CidrOnly(why) => {
                output::warn(&format!(
                    "no route watch: only the CIDRs detected at connect are routed ({why}); \
                     ClusterIPs inside conflicting laptop routes and pod CIDRs of new nodes are \
                     not — kvpn asks the traffic manager again on its own, see `kvpn status`"
                ));
                return Ok(report);
            }
            RouteWatchReport::NotYet if tokio::time::Instant::now() >= deadline => {
                output::warn(&format!(
                    "the route watch of session {id} has not reported within {} s: ClusterIPs \
                     inside conflicting laptop routes and pod CIDRs added since detection are \
                     not routed yet — they follow when it does; see `kvpn status` (route source)",
                    within.as_secs()
                ));
                return Ok(report);
            }
            RouteWatchReport::NotYet => {}
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// One line per `--extra-domain` name: `Ok` when its addresses are routed
/// through `tun`, `Err` (a warning: connect goes on) when it has none.
pub fn extra_domain_lines(
    extra: &[kvpn_proto::dataplane::ExtraDomain],
    tun: &str,
) -> Vec<Result<String, String>> {
    extra
        .iter()
        .map(|d| {
            if d.error.is_empty() {
                Ok(format!(
                    "extra domain {} resolved through the cluster DNS: {} routed through {tun}",
                    d.name,
                    d.addresses.join(", ")
                ))
            } else {
                Err(format!(
                    "extra domain {}: {} — nothing routed for it; connect goes on",
                    d.name, d.error
                ))
            }
        })
        .collect()
}

/// Tell the user how the session stands after Connect: "Connected …" only after
/// the first heartbeat echo, else what it is waiting for.
pub async fn report_connected(
    client: &mut kvpn_proto::dataplane::dataplane_client::DataplaneClient<
        crate::daemon_channel::DaemonChannel,
    >,
    id: &str,
    connected_line: &str,
) -> Result<()> {
    match wait_first_echo(client, id, FIRST_ECHO_WAIT).await? {
        None => output::done(connected_line),
        Some(s) => output::warn(&format!(
            "session {id} is set up on TUN device {} but the traffic manager has not answered a \
             heartbeat within {} s (state {}: {}) — kvpn keeps re-dialling on its own; \
             watch `kvpn status`, or `kvpn disconnect {id}` to give up",
            s.tun_name,
            FIRST_ECHO_WAIT.as_secs(),
            s.state,
            s.reason
        )),
    }
    let sessions =
        daemon::sessions(client, "cannot ask the root daemon for the session's state").await?;
    if let Some(s) = sessions.iter().find(|s| s.id == id) {
        for w in unhandled_conflicts(s) {
            output::warn(&w);
        }
    }
    Ok(())
}

/// How long `kvpn connect` still waits for the session setup (StartSession,
/// Connect) after Ctrl-C, to disconnect the session it answers with: the
/// setup takes well under a second as a rule, its dial is bounded at 10 s.
pub const INTERRUPTED_SETUP_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// A session setup call's outcome, with Ctrl-C watched.
pub(crate) enum Setup<T> {
    /// It answered before any Ctrl-C.
    Done(Result<T, tonic::Status>),
    /// Ctrl-C came first: the session it then answered with (to be
    /// disconnected), or `None` when it failed, did not answer within
    /// [`INTERRUPTED_SETUP_WAIT`] or a second Ctrl-C came (the call is
    /// dropped: the daemon rolls back a setup whose caller went away).
    Interrupted(Option<T>),
}

/// Run `setup` until it answers or Ctrl-C. After Ctrl-C it still waits for
/// the answer (bounded), because dropping the call at once raced with the
/// answer: a daemon that had just sent it took it as delivered and kept the
/// session while the CLI said "not connected" (kube_interrupt, direct_interrupt).
pub(crate) async fn setup_or_interrupt<T>(
    setup: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    interrupt: &mut tokio::signal::unix::Signal,
) -> Setup<T> {
    tokio::pin!(setup);
    tokio::select! {
        r = &mut setup => Setup::Done(r.map(tonic::Response::into_inner)),
        _ = interrupt.recv() => {
            output::detail("interrupted: waiting for the session setup to finish, to undo it");
            tokio::select! {
                r = tokio::time::timeout(INTERRUPTED_SETUP_WAIT, &mut setup) => {
                    Setup::Interrupted(r.ok().and_then(Result::ok).map(tonic::Response::into_inner))
                }
                _ = interrupt.recv() => Setup::Interrupted(None),
            }
        }
    }
}

/// Who set the session up when `kvpn connect` got Ctrl-C, and how far.
pub(crate) enum Interrupted<'a> {
    /// Its StartSession (the user daemon) or Connect (the root daemon, a
    /// `--manager` session) had not answered: that daemon rolls back the
    /// setup this process stops waiting for.
    Pending(&'static str),
    /// The user daemon started session `id`.
    User(
        &'a mut kvpn_proto::userd::user_daemon_client::UserDaemonClient<
            crate::daemon_channel::DaemonChannel,
        >,
        &'a str,
    ),
    /// The root daemon connected session `id` (a `--manager` session).
    Root(
        &'a mut kvpn_proto::dataplane::dataplane_client::DataplaneClient<
            crate::daemon_channel::DaemonChannel,
        >,
        &'a str,
    ),
}

/// Ctrl-C during `kvpn connect`: disconnect the session it started, if it has
/// one yet, say so and exit as SIGINT would (130). docs/root-daemon.md: a Connect is all
/// or nothing.
pub(crate) async fn interrupted(started: Interrupted<'_>) -> ! {
    let disconnected = |id: &str, result: Result<(), tonic::Status>| match result {
        Ok(()) => format!("interrupted: session {id} disconnected — not connected"),
        Err(s) => format!(
            "interrupted: session {id} could not be disconnected ({}) — run `kvpn disconnect {id}`",
            s.message()
        ),
    };
    let message = match started {
        Interrupted::Pending(who) => {
            format!("interrupted: the {who} rolls back what it set up — not connected")
        }
        Interrupted::User(user, id) => {
            let result = user
                .disconnect(kvpn_proto::userd::DisconnectRequest {
                    session_id: id.to_owned(),
                })
                .await;
            disconnected(id, result.map(drop))
        }
        Interrupted::Root(root, id) => {
            let result = root
                .disconnect(DisconnectRequest {
                    session_id: id.to_owned(),
                })
                .await;
            disconnected(id, result.map(drop))
        }
    };
    output::error(&message);
    std::process::exit(130)
}

/// A warning for each route conflict of `session` that nothing handles
/// (`--allow-route-conflict` without `--steer ebpf` against a route in a table
/// a policy rule consults before main): those cluster addresses stay unreachable.
pub fn unhandled_conflicts(session: &Session) -> Vec<String> {
    session
        .conflicts
        .iter()
        .filter(|c| c.handling == "unhandled")
        .map(|c| {
            format!(
                "route conflict not handled: the laptop's route {} dev {} in table {} (proto {}) \
                 covers cluster range {} and is consulted before kvpn's routes, so those cluster \
                 addresses stay unreachable — disconnect and connect again with \
                 `--allow-route-conflict --steer ebpf` to steer them past it",
                c.laptop_cidr, c.laptop_dev, c.laptop_table, c.laptop_proto, c.cidr
            )
        })
        .collect()
}

/// How an existing session relates to the cluster a connect asks for.
#[derive(Debug, PartialEq)]
pub enum SessionMatch<'a> {
    /// No session leads to this cluster.
    None,
    /// A session to the same cluster, context and manager namespace: nothing to do.
    Same(&'a Session),
    /// A session to the same API server through another context or manager
    /// namespace: a second one would install the same routes.
    Conflict(&'a Session),
}

/// Whether `have` (a session's origin) leads to the same cluster as the API
/// server URL `server` with [`crate::kubeconfig::cluster_id`] `cluster_id`: the
/// URL alone does not say (two clusters answer at https://127.0.0.1:6443 on
/// many laptops), the CA does.
pub fn same_cluster(have: &Origin, server: &str, cluster_id: &str) -> bool {
    have.server == server && crate::kubeconfig::same_cluster_id(&have.cluster_id, cluster_id)
}

/// Find the session (of `sessions`, from Status) that leads where `wanted` does.
/// The API server URL and the cluster's CA identify the cluster
/// ([`same_cluster`]); sessions without an origin (direct transport) never match.
pub fn match_session<'a>(sessions: &'a [Session], wanted: &Origin) -> SessionMatch<'a> {
    let mut conflict = None;
    for s in sessions {
        let Some(o) = &s.origin else { continue };
        // A `kvpn run` session routes for its own process tree only: it is
        // neither this laptop's connection nor in its way.
        if !s.run_cgroup.is_empty() {
            continue;
        }
        if o.transport != wanted.transport || !same_cluster(o, &wanted.server, &wanted.cluster_id) {
            continue;
        }
        if o.cluster == wanted.cluster
            && o.context == wanted.context
            && o.manager_namespace == wanted.manager_namespace
        {
            return SessionMatch::Same(s);
        }
        conflict.get_or_insert(s);
    }
    conflict.map_or(SessionMatch::None, SessionMatch::Conflict)
}

/// Disconnect every port-forward session of this laptop that runs through the
/// traffic manager in `manager_namespace` of the cluster at API server `server`
/// with [`crate::kubeconfig::cluster_id`] `cluster_id` (before that manager is
/// uninstalled). Returns the stopped session ids.
pub async fn disconnect_sessions_of(
    runtime_dir: &Path,
    server: &str,
    cluster_id: &str,
    manager_namespace: &str,
) -> Result<Vec<String>> {
    let Some(mut client) = daemon::connect_existing(runtime_dir).await? else {
        return Ok(Vec::new());
    };
    let sessions =
        daemon::sessions(&mut client, "cannot ask the root daemon for its sessions").await?;
    let mut user = userd::connect_if_needed(runtime_dir).await?;
    let mut stopped = Vec::new();
    for s in sessions {
        let Some(o) = &s.origin else { continue };
        if o.transport != TRANSPORT_PORT_FORWARD
            || !same_cluster(o, server, cluster_id)
            || o.manager_namespace != manager_namespace
        {
            continue;
        }
        let ids = match &mut user {
            Some(user) => {
                user.disconnect(kvpn_proto::userd::DisconnectRequest {
                    session_id: s.id.clone(),
                })
                .await
                .map_err(daemon::status_to_error)
                .with_context(|| format!("cannot disconnect session {}", s.id))?
                .into_inner()
                .stopped
            }
            None => {
                client
                    .disconnect(DisconnectRequest {
                        session_id: s.id.clone(),
                    })
                    .await
                    .map_err(daemon::status_to_error)
                    .with_context(|| format!("cannot disconnect session {}", s.id))?
                    .into_inner()
                    .stopped
            }
        };
        stopped.extend(ids);
    }
    Ok(stopped)
}

/// The error when a cluster range overlaps the manager's tunnel pool (trial
/// T1: a pod range inside 100.96.0.0/16 was reported as routed, was not, and
/// pod IPs were unreachable without a word). Pure.
pub fn pool_overlap(pool: &IpNet, ranges: &[(&[IpNet], &str)]) -> Option<String> {
    let (net, what) = ranges.iter().find_map(|(nets, what)| {
        nets.iter()
            .find(|n| n.contains(&pool.network()) || pool.contains(&n.network()))
            .map(|n| (*n, *what))
    })?;
    Some(format!(
        "the cluster's {what} range {net} overlaps the traffic manager's tunnel pool {pool} \
         (the laptops' addresses): the two cannot share a route, so addresses in {net} would \
         not be reachable — run the traffic manager with a pool outside every cluster range \
         (its `--tunnel-pool`, e.g. `kubectl -n <manager namespace> edit deployment \
         kvpn-manager` and add `--tunnel-pool 100.64.0.0/16`), or give the cluster's ranges \
         without the overlap"
    ))
}

/// The flags of `args` that only shape a new session (routes, DNS, device), for
/// the warning when the session already exists.
pub fn session_flags_given(args: &ConnectArgs) -> Vec<&'static str> {
    let mut given = Vec::new();
    for (set, flag) in [
        (!args.pod_cidrs.is_empty(), "--pod-cidr"),
        (!args.service_cidrs.is_empty(), "--service-cidr"),
        (!args.extra_cidrs.is_empty(), "--cidr"),
        (args.redetect_cidrs, "--redetect-cidrs"),
        (args.kube.namespace.is_some(), "--namespace"),
        (args.image.is_some(), "--image"),
        (!args.image_pull_secrets.is_empty(), "--image-pull-secret"),
        (args.image_pull_policy.is_some(), "--image-pull-policy"),
        (args.tun_name.is_some(), "--tun-name"),
        (args.mtu.is_some(), "--mtu"),
        (args.workers != 1, "--workers"),
        (args.allow_route_conflict, "--allow-route-conflict"),
        (args.steer() != crate::cli::Steer::Routes, "--steer"),
        (args.hosts, "--hosts"),
        // DNS and routing options (trial T2: silently dropped).
        (!args.never_proxy.is_empty(), "--never-proxy"),
        (!args.extra_domains.is_empty(), "--extra-domain"),
        (!args.include_suffixes.is_empty(), "--include-suffix"),
        (!args.exclude_suffixes.is_empty(), "--exclude-suffix"),
    ] {
        if set {
            given.push(flag);
        }
    }
    given
}

/// The flags of `args` a connect that found its session running did not apply:
/// [`session_flags_given`], and `--source-policy` when it differs from
/// `session_policy`, the running session's (empty when unknown: an older kvpn).
pub fn flags_not_applied(args: &ConnectArgs, session_policy: &str) -> Vec<&'static str> {
    let mut flags = session_flags_given(args);
    if args
        .source_policy
        .is_some_and(|asked| asked.as_str() != session_policy)
    {
        flags.push("--source-policy");
    }
    // Scaling happens in the install step, which a running session skips
    // (`kvpn install --replicas N` scales without a new session).
    if args.replicas.is_some() {
        flags.push("--replicas");
    }
    flags
}

/// The warning for session-shaping `flags` given to a connect that found its
/// session running (`None` without any); one flag is "it", several "they".
pub fn ignored_flags_warning(flags: &[&str]) -> Option<String> {
    let (pronoun, verb) = match flags.len() {
        0 => return None,
        1 => ("it", "shapes"),
        _ => ("they", "shape"),
    };
    Some(format!(
        "{} not applied: {pronoun} {verb} a new session and this one already exists — \
         `kvpn disconnect` the session, then connect again with {}",
        flags.join(", "),
        if flags.len() == 1 { "it" } else { "them" }
    ))
}

/// `status` with the reason of each root session that is not connected led by
/// the user daemon's transport error for it (as `kvpn status` shows it,
/// [`output::transport_reason`]): a manager scaled to 0 is named as such, not
/// as the TLS handshake the root daemon saw end.
fn with_transport_reasons(
    mut status: kvpn_proto::userd::StatusResponse,
) -> kvpn_proto::userd::StatusResponse {
    for s in &mut status.root_sessions {
        if s.state == "connected" {
            continue;
        }
        if let Some(u) = status
            .user_sessions
            .iter()
            .find(|u| u.id == s.id && !u.transport_error.is_empty())
        {
            s.reason = output::transport_reason(&u.transport_error, &s.reason);
        }
    }
    status
}

/// Whether connect is already done: the running session's source policy (empty
/// when unknown) after telling the user so. A session of the same cluster whose
/// user-side half (port-forward, route watch) is gone or lost can never carry
/// traffic again; it is replaced.
async fn already_connected(
    user: &mut UserDaemonClient<crate::daemon_channel::DaemonChannel>,
    wanted: &Origin,
) -> Result<Option<String>> {
    let status = user
        .status(kvpn_proto::userd::StatusRequest {})
        .await
        .map_err(daemon::status_to_error)
        .context("cannot ask the user daemon for its sessions")?
        .into_inner();
    let status = with_transport_reasons(status);
    match match_session(&status.root_sessions, wanted) {
        SessionMatch::None => Ok(None),
        SessionMatch::Conflict(s) => {
            let o = s.origin.clone().unwrap_or_default();
            bail!(
                "already connected to {} through context {} (traffic manager in {}): session {} \
                 on TUN device {} — a second session would route the same CIDRs; run \
                 `kvpn disconnect {}` first",
                o.server,
                o.context,
                o.manager_namespace,
                s.id,
                s.tun_name,
                s.id
            )
        }
        SessionMatch::Same(s)
            if !status.user_sessions.iter().any(|u| {
                u.id == s.id
                    && (u.state == userd::server::STATE_RUNNING
                        || u.state == userd::server::STATE_RESTORING)
            }) =>
        {
            output::warn(&format!(
                "session {} of this cluster lost its port-forward; replacing it",
                s.id
            ));
            user.disconnect(kvpn_proto::userd::DisconnectRequest {
                session_id: s.id.clone(),
            })
            .await
            .map_err(daemon::status_to_error)
            .with_context(|| format!("cannot disconnect the stale session {}", s.id))?;
            Ok(None)
        }
        SessionMatch::Same(s) if s.reason.contains(kvpn_dataplane::tls::CERTIFICATE_MISMATCH) => {
            // Its manager was replaced (uninstall + connect elsewhere): the
            // session's CA and lease are gone with it, only a new connect (new
            // CA, new lease) helps, and that is what the user asked for.
            output::warn(&format!(
                "session {} cannot verify the traffic manager's certificate: the manager was \
                 reinstalled since it connected (new CA in Secret kvpn-manager-tls); replacing it",
                s.id
            ));
            user.disconnect(kvpn_proto::userd::DisconnectRequest {
                session_id: s.id.clone(),
            })
            .await
            .map_err(daemon::status_to_error)
            .with_context(|| format!("cannot disconnect session {}", s.id))?;
            Ok(None)
        }
        SessionMatch::Same(s) if s.state != "connected" => {
            // Not connected: give a session that is re-dialling a moment, then
            // say plainly that it is not connected rather than "nothing to do".
            let id = s.id.clone();
            let deadline = tokio::time::Instant::now() + FIRST_ECHO_WAIT;
            output::step(&format!(
                "Session {id} of this cluster is {} ({}); waiting up to {} s for it to connect",
                s.state,
                s.reason,
                FIRST_ECHO_WAIT.as_secs()
            ));
            loop {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                let status = user
                    .status(kvpn_proto::userd::StatusRequest {})
                    .await
                    .map_err(daemon::status_to_error)
                    .context("cannot ask the user daemon for its sessions")?
                    .into_inner();
                let status = with_transport_reasons(status);
                let Some(now) = status.root_sessions.into_iter().find(|r| r.id == id) else {
                    output::warn(&format!(
                        "session {id} ended while connect waited for it; connecting anew"
                    ));
                    return Ok(None);
                };
                // Connected now (said as for any running session), or found to
                // be through a reinstalled manager (replaced as above).
                if now.state == "connected"
                    || now
                        .reason
                        .contains(kvpn_dataplane::tls::CERTIFICATE_MISMATCH)
                {
                    return Box::pin(already_connected(user, wanted)).await;
                }
                if tokio::time::Instant::now() >= deadline {
                    bail!(
                        "session {id} to {} (context {}) is {}, not connected: {} — kvpn keeps \
                         re-dialling on its own; watch `kvpn status`, or `kvpn disconnect {id}` \
                         and connect again to start over",
                        wanted.cluster,
                        wanted.context,
                        now.state,
                        if now.reason.is_empty() {
                            "no reason given"
                        } else {
                            &now.reason
                        }
                    );
                }
            }
        }
        SessionMatch::Same(s) => {
            let reason = if s.reason.is_empty() {
                String::new()
            } else {
                format!(" ({})", s.reason)
            };
            // The data path the session took (ssh-direct or port-forward), when known.
            let path = s
                .origin
                .as_ref()
                .map(|o| o.data_path.as_str())
                .filter(|p| !p.is_empty())
                .unwrap_or(&wanted.transport);
            output::done(&format!(
                "Already connected to {} (context {}) through {}: session {} on TUN device {}, \
                 state {}{reason} — nothing to do",
                wanted.cluster, wanted.context, path, s.id, s.tun_name, s.state
            ));
            Ok(Some(
                s.origin
                    .as_ref()
                    .map(|o| o.source_policy.clone())
                    .unwrap_or_default(),
            ))
        }
    }
}

fn host_of(server: &str) -> String {
    let rest = server.split_once("://").map_or(server, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split(']').next().unwrap_or(v6).to_string();
    }
    authority
        .rsplit_once(':')
        .map_or(authority, |(h, _)| h)
        .to_string()
}

/// Ranges no cluster route may take, with why: the host's own (loopback, "this
/// network"), link-local (DHCP, cloud metadata, IPv6 neighbour discovery) and
/// multicast/broadcast (RFC 6890 special-purpose registries). A broad `--cidr`
/// such as 0.0.0.0/0 is routed around them.
pub const NEVER_ROUTED: &[(&str, &str)] = &[
    ("0.0.0.0/8", "\"this network\""),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local"),
    ("224.0.0.0/4", "multicast"),
    ("255.255.255.255/32", "broadcast"),
    ("::/128", "unspecified"),
    ("::1/128", "loopback"),
    ("fe80::/10", "link-local"),
    ("ff00::/8", "multicast"),
];

fn never_routed() -> Vec<IpNet> {
    NEVER_ROUTED
        .iter()
        .filter_map(|(c, _)| c.parse().ok())
        .collect()
}

/// The [`NEVER_ROUTED`] ranges that `cidrs` overlap, as "127.0.0.0/8 (loopback)",
/// for a warning.
pub fn never_routed_overlaps(cidrs: &[IpNet]) -> Vec<String> {
    NEVER_ROUTED
        .iter()
        .filter(|(c, _)| {
            c.parse::<IpNet>()
                .is_ok_and(|n| cidrs.iter().any(|x| x.contains(&n) || n.contains(x)))
        })
        .map(|(c, why)| format!("{c} ({why})"))
        .collect()
}

/// Says which [`NEVER_ROUTED`] ranges the user's or the cluster's CIDRs covered.
pub fn warn_never_routed(cidrs: &[IpNet]) {
    let hit = never_routed_overlaps(cidrs);
    if !hit.is_empty() {
        output::warn(&format!(
            "not routing {} through the tunnel: they are this machine's own, whatever \
             the cluster CIDRs say",
            hit.join(", ")
        ));
    }
}

/// [`typed_cidr_holes`] of every CIDR flag of `args`, as warnings.
pub fn warn_typed_cidr_holes(args: &ConnectArgs, keep_out: &[(IpAddr, String)]) {
    for (flag, typed) in [
        ("--pod-cidr", &args.pod_cidrs),
        ("--service-cidr", &args.service_cidrs),
        ("--cidr", &args.extra_cidrs),
    ] {
        for line in typed_cidr_holes(flag, typed, keep_out) {
            output::warn(&line);
        }
    }
}

/// The CIDR flags of `args` with their values, as the user typed them.
pub fn typed_cidrs(args: &ConnectArgs) -> Vec<(&'static str, IpNet)> {
    [
        ("--pod-cidr", &args.pod_cidrs),
        ("--service-cidr", &args.service_cidrs),
        ("--cidr", &args.extra_cidrs),
    ]
    .into_iter()
    .flat_map(|(flag, nets)| nets.iter().map(move |n| (flag, *n)))
    .collect()
}

/// When the root daemon refused routes for overlapping the laptop's (its
/// `message` names each as "<CIDR> overlaps …") and some are pieces of a CIDR the
/// user typed but kvpn split (around the [`NEVER_ROUTED`] ranges and the
/// `keep_out` addresses), which typed CIDR they are parts of and the two ways
/// out (pure). `None` when no refused range is such a piece.
pub fn split_refusal_hint(
    message: &str,
    typed: &[(&str, IpNet)],
    keep_out: &[IpAddr],
) -> Option<String> {
    let never = never_routed();
    let mut hints = Vec::new();
    for (flag, net) in typed {
        let pieces = cidr::exclude(&kvpn_proto::cidr::subtract(&[*net], &never), keep_out);
        if pieces == [*net] {
            continue;
        }
        let refused: Vec<String> = pieces
            .iter()
            .map(ToString::to_string)
            .filter(|p| message.contains(&format!(" {p} overlaps ")))
            .collect();
        if refused.is_empty() {
            continue;
        }
        let (these, are) = if refused.len() == 1 {
            ("range", "is a part")
        } else {
            ("ranges", "are parts")
        };
        hints.push(format!(
            "the refused {these} {} {are} of {flag} {net}, which kvpn routes as {} smaller \
             ranges around the addresses it keeps off the tunnel; {net} covers routes this \
             laptop already has (below) — give narrower {flag} ranges that leave the laptop's \
             own subnets out, or pass --allow-route-conflict to keep the laptop's routes and \
             send the rest of {net} through the tunnel",
            refused.join(", "),
            pieces.len()
        ));
    }
    (!hints.is_empty()).then(|| hints.join("; "))
}

/// `e` (a failed connect) with [`split_refusal_hint`] in front when it applies.
pub fn with_split_refusal_hint(
    e: anyhow::Error,
    args: &ConnectArgs,
    keep_out: &[IpAddr],
) -> anyhow::Error {
    match split_refusal_hint(&format!("{e:#}"), &typed_cidrs(args), keep_out) {
        Some(hint) => e.context(hint),
        None => e,
    }
}

/// For each CIDR the user typed with `flag` ("--cidr", "--pod-cidr", …) that kvpn
/// does not route whole, one line saying what it keeps off the tunnel inside it
/// and why: the [`NEVER_ROUTED`] ranges it overlaps and the `keep_out` addresses
/// (with what each is: "the API server", "a nameserver", …) it contains (pure).
/// A wide CIDR such as 0.0.0.0/0 is installed as many smaller ranges around
/// them; this names the holes, so a route conflict on one of those ranges is
/// not a surprise.
pub fn typed_cidr_holes(flag: &str, typed: &[IpNet], keep_out: &[(IpAddr, String)]) -> Vec<String> {
    let never: Vec<(IpNet, &str)> = NEVER_ROUTED
        .iter()
        .filter_map(|(c, why)| c.parse().ok().map(|n| (n, *why)))
        .collect();
    let never_nets: Vec<IpNet> = never.iter().map(|(n, _)| *n).collect();
    let keep_out_ips: Vec<IpAddr> = keep_out.iter().map(|(ip, _)| *ip).collect();
    let mut out = Vec::new();
    for net in typed {
        let mut holes: Vec<String> = never
            .iter()
            .filter(|(n, _)| n.contains(net) || net.contains(n))
            .map(|(n, why)| format!("{n} ({why})"))
            .collect();
        let mut seen = Vec::new();
        for (ip, _) in keep_out {
            if net.contains(ip) && !never_nets.iter().any(|n| n.contains(ip)) && !seen.contains(ip)
            {
                seen.push(*ip);
                let all: Vec<&str> = keep_out
                    .iter()
                    .filter(|(other, _)| other == ip)
                    .map(|(_, w)| w.as_str())
                    .collect();
                holes.push(format!("{ip} ({})", all.join(", ")));
            }
        }
        if holes.is_empty() {
            continue;
        }
        let pieces = cidr::exclude(
            &kvpn_proto::cidr::subtract(&[*net], &never_nets),
            &keep_out_ips,
        );
        let how = match pieces.len() {
            0 => "is not routed at all".to_owned(),
            1 => format!("is routed as {}", pieces[0]),
            n => format!("is routed as {n} smaller ranges"),
        };
        out.push(format!(
            "{flag} {net} {how}: kvpn keeps {} off the tunnel — the laptop needs them itself",
            holes.join(", ")
        ));
    }
    out
}

/// The routes of a session: each kind's CIDRs normalised, without the
/// [`NEVER_ROUTED`] ranges, and with every address of `keep_out` (API server,
/// nameservers, gateways, the manager) cut out (rt-02).
pub fn cluster_routes(
    pod: &[IpNet],
    service: &[IpNet],
    extra: &[IpNet],
    keep_out: &[IpAddr],
) -> Vec<Route> {
    cluster_routes_avoiding(pod, service, extra, keep_out, &[])
}

/// [`cluster_routes`] that also leaves out the `never_proxy` ranges
/// (`kvpn connect --never-proxy`).
pub fn cluster_routes_avoiding(
    pod: &[IpNet],
    service: &[IpNet],
    extra: &[IpNet],
    keep_out: &[IpAddr],
    never_proxy: &[IpNet],
) -> Vec<Route> {
    let mut never = never_routed();
    never.extend(never_proxy.iter().map(IpNet::trunc));
    [
        (pod, RouteKind::Pod),
        (service, RouteKind::Service),
        (extra, RouteKind::Extra),
    ]
    .into_iter()
    .flat_map(|(cidrs, kind)| {
        cidr::exclude(&kvpn_proto::cidr::subtract(cidrs, &never), keep_out)
            .into_iter()
            .map(move |c| Route {
                cidr: c.to_string(),
                kind: kind as i32,
                watched: false,
            })
    })
    .collect()
}

/// The laptop's addresses (`labelled`: essentials with why) and `never_proxy`
/// ranges that lie inside one of the cluster `ranges` (with their kind name):
/// what connect keeps off the tunnel although a cluster range covers it, for
/// connect's output and status (issue 29 item 3: a pod route split around a
/// nameserver or another VPN's endpoint was never shown). Sorted by address,
/// one entry per address (its first reason).
pub fn kept_out_inside(
    ranges: &[(&[IpNet], &str)],
    labelled: &[(IpAddr, String)],
    never_proxy: &[IpNet],
) -> Vec<kvpn_proto::dataplane::KeptOut> {
    let inside = |net: &IpNet| {
        ranges.iter().find_map(|(nets, kind)| {
            nets.iter()
                .find(|r| r.contains(net) || net.contains(*r))
                .map(|r| (r.trunc(), *kind))
        })
    };
    let mut out: Vec<kvpn_proto::dataplane::KeptOut> = Vec::new();
    for (ip, why) in labelled {
        let host = IpNet::from(*ip);
        if out.iter().any(|k| k.address == ip.to_string()) {
            continue;
        }
        if let Some((cidr, kind)) = inside(&host) {
            out.push(kvpn_proto::dataplane::KeptOut {
                address: ip.to_string(),
                why: why.clone(),
                cidr: cidr.to_string(),
                kind: kind.to_owned(),
            });
        }
    }
    for net in never_proxy {
        let net = net.trunc();
        if let Some((cidr, kind)) = inside(&net) {
            out.push(kvpn_proto::dataplane::KeptOut {
                address: net.to_string(),
                why: "--never-proxy".to_owned(),
                cidr: cidr.to_string(),
                kind: kind.to_owned(),
            });
        }
    }
    out.sort_by(|a, b| {
        let key = |k: &kvpn_proto::dataplane::KeptOut| {
            k.address
                .parse::<IpNet>()
                .ok()
                .or_else(|| k.address.parse::<IpAddr>().ok().map(IpNet::from))
        };
        key(a).cmp(&key(b))
    });
    out
}

/// The cluster DNS `servers` that a `--never-proxy` range covers, as kept-out
/// entries (kind `cluster DNS`, the covering range as CIDR).
pub fn never_proxied_dns(
    servers: &[String],
    never_proxy: &[IpNet],
) -> Vec<kvpn_proto::dataplane::KeptOut> {
    servers
        .iter()
        .filter_map(|s| {
            let ip: IpAddr = s.parse().ok()?;
            let net = never_proxy.iter().find(|n| n.contains(&ip))?;
            Some(kvpn_proto::dataplane::KeptOut {
                address: ip.to_string(),
                why: "the cluster DNS, covered by --never-proxy".to_owned(),
                cidr: net.trunc().to_string(),
                kind: "--never-proxy".to_owned(),
            })
        })
        .collect()
}

/// One line of connect's and status's output for `k`. A `--never-proxy` range
/// that covers a whole cluster range says so (nothing of that range is routed).
pub fn kept_out_line(k: &kvpn_proto::dataplane::KeptOut) -> String {
    let covers = matches!(
        (k.address.parse::<IpNet>(), k.cidr.parse::<IpNet>()),
        (Ok(a), Ok(c)) if a.contains(&c)
    );
    if covers {
        format!(
            "kept off the tunnel: the whole {} CIDR {} (inside {}) — {}",
            k.kind, k.cidr, k.address, k.why
        )
    } else {
        format!(
            "kept off the tunnel: {} inside {} CIDR {} — {}",
            k.address, k.kind, k.cidr, k.why
        )
    }
}

/// Why IPv6 is off in the calling thread's network namespace (case rt-08), or
/// `None` when the TUN device can carry IPv6. Off means: the kernel has no IPv6
/// at all (`ipv6.disable=1` boot flag: no `/proc/sys/net/ipv6`), or
/// `disable_ipv6=1` for all interfaces or for new ones (the TUN device is new,
/// so `default` is what it gets). The kernel then refuses IPv6 routes on the TUN
/// device, so kvpn connects IPv4-only instead of failing.
pub fn laptop_ipv6_off() -> Option<String> {
    let base = Path::new("/proc/sys/net/ipv6");
    if !base.exists() {
        return Some("the kernel has no IPv6 (booted with ipv6.disable=1)".to_owned());
    }
    ["all", "default"].into_iter().find_map(|scope| {
        let path = base.join("conf").join(scope).join("disable_ipv6");
        std::fs::read_to_string(&path)
            .ok()
            .filter(|v| v.trim() == "1")
            .map(|_| format!("net.ipv6.conf.{scope}.disable_ipv6=1"))
    })
}

/// `routes` without their IPv6 ones, and those IPv6 CIDRs (as "fd00::/56 (pod)"),
/// for an IPv4-only session.
pub fn split_ipv6_routes(routes: Vec<Route>) -> (Vec<Route>, Vec<String>) {
    let (v6, v4): (Vec<Route>, Vec<Route>) = routes
        .into_iter()
        .partition(|r| r.cidr.parse::<IpNet>().is_ok_and(|n| n.addr().is_ipv6()));
    let dropped = v6
        .iter()
        .map(|r| format!("{} ({})", r.cidr, output::kind_name(r.kind)))
        .collect();
    (v4, dropped)
}

/// On a laptop with IPv6 off ([`laptop_ipv6_off`]), keep only the IPv4 routes and
/// say so in exactly one warning (rt-08); otherwise `routes` unchanged.
pub fn ipv4_only_if_ipv6_off(routes: Vec<Route>) -> Vec<Route> {
    let Some(why) = laptop_ipv6_off() else {
        return routes;
    };
    let (v4, dropped) = split_ipv6_routes(routes);
    let what = if dropped.is_empty() {
        "(all cluster ranges are IPv4)".to_owned()
    } else {
        format!("and not routing {}", dropped.join(", "))
    };
    output::warn(&format!(
        "IPv6 is disabled on this laptop ({why}): connecting IPv4-only {what} — to reach \
         IPv6 cluster ranges, set net.ipv6.conf.all.disable_ipv6=0 and \
         net.ipv6.conf.default.disable_ipv6=0, then reconnect"
    ));
    v4
}

/// Whether `routes` hold an IPv6 range (the session is then dual-stack).
pub fn has_ipv6_route(routes: &[Route]) -> bool {
    routes
        .iter()
        .any(|r| r.cidr.parse::<IpNet>().is_ok_and(|n| n.addr().is_ipv6()))
}

/// The IPv6 tunnel IP of a dual-stack session: the lease's, when the routes
/// (after [`ipv4_only_if_ipv6_off`]) hold an IPv6 cluster range; `None` for an
/// IPv4-only cluster or laptop, and from a manager that leases no IPv6 tunnel
/// IP (older than data-channel protocol version 3), whose IPv6 ranges then
/// route without a tunnel source the manager accepts.
pub fn dual_stack_tunnel_ip(routes: &[Route], leased: &LeaseResponse) -> Result<Option<Ipv6Addr>> {
    if !has_ipv6_route(routes) {
        return Ok(None);
    }
    if leased.tunnel_ip_v6.is_empty() {
        output::warn(
            "the cluster has IPv6 ranges but the traffic manager leases no IPv6 tunnel IP \
             (it is older than this kvpn): IPv6 cluster addresses will not answer — \
             reconnect after `kvpn connect` upgraded the manager",
        );
        return Ok(None);
    }
    let v6: Ipv6Addr = leased.tunnel_ip_v6.parse().with_context(|| {
        format!(
            "the traffic manager leased an invalid IPv6 tunnel IP {:?}",
            leased.tunnel_ip_v6
        )
    })?;
    Ok(Some(v6))
}

/// The cluster's pod and service CIDRs: the cache of an earlier connect (in the
/// manager's ConfigMap, unless `redetect`), else
/// detected. Detected ones come with the record to cache ([`cache_cidrs`]),
/// written once the manager is installed (its namespace and ConfigMap may not
/// exist yet: ranges are known before the install, so that a route conflict is
/// refused before anything is written to the cluster).
async fn cluster_cidrs(
    client: &kube::Client,
    namespace: &str,
    redetect: bool,
) -> Result<(Vec<IpNet>, Vec<IpNet>, Option<cidr::cache::CachedCidrs>)> {
    if !redetect {
        match cidr::cache::read(client, namespace).await {
            Ok(Some(cached)) => {
                output::step("Using the cluster's CIDRs cached by an earlier connect");
                output::done(&format!(
                    "pod {}, service {} (ConfigMap {namespace}/{}, key {}, detected {} s ago \
                     by kvpn {}; --redetect-cidrs detects them again)",
                    list(&cached.pod),
                    list(&cached.service),
                    install::objects::MANAGER,
                    cidr::cache::CIDRS_KEY,
                    cached.age_s(),
                    cached.kvpn_version,
                ));
                return Ok((cached.pod, cached.service, None));
            }
            Ok(None) => {}
            Err(e) => output::warn(&e.to_string()),
        }
    }
    output::step("Detecting the cluster's pod and service CIDRs");
    let detected = cidr::detect_cidrs(
        client,
        &DetectOptions {
            namespace: namespace.to_owned(),
            ..DetectOptions::default()
        },
    )
    .await
    .context("CIDR detection failed")?;
    for a in &detected.attempts {
        output::detail(&a.to_string());
    }
    let to_cache = (!detected.is_empty())
        .then(|| cidr::cache::CachedCidrs::now(detected.pod.clone(), detected.service.clone()));
    Ok((detected.pod, detected.service, to_cache))
}

/// Cache detected CIDRs in the manager's ConfigMap for the next connect.
async fn cache_cidrs(client: &kube::Client, namespace: &str, cached: &cidr::cache::CachedCidrs) {
    match cidr::cache::write(client, namespace, cached).await {
        Ok(()) => output::detail(&format!(
            "cached in ConfigMap {namespace}/{} for the next connect",
            install::objects::MANAGER
        )),
        Err(e) => output::warn(&format!("{e} (the next connect detects again)")),
    }
}

/// The laptop's routes that overlap the cluster `routes` a new laptop-wide
/// session would install, read before anything is installed or leased (the
/// root daemon checks again when it sets the session up, the same way). A
/// laptop whose routes cannot be read is left to that check.
async fn refuse_route_conflicts(runtime_dir: &Path, routes: &[Route]) -> Result<()> {
    use kvpn_dataplane::{conflicts, netlink, session};
    let ranges: Vec<(IpNet, kvpn_dataplane::ebpf::RouteKind)> = routes
        .iter()
        .filter_map(|r| Some((r.cidr.parse().ok()?, session::kind_from_api(r.kind)?)))
        .collect();
    let read = async {
        netlink::Netlink::new()?
            .laptop_routes()
            .await
            .map_err(std::io::Error::other)
    };
    let laptop = match read.await {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(error = %e, "cannot read the laptop's routes before install; the root daemon checks them");
            return Ok(());
        }
    };
    let found = conflicts::find(&ranges, &laptop, netlink::RTPROT_KVPN, None);
    if found.is_empty() {
        return Ok(());
    }
    let sessions = current_sessions(runtime_dir).await.unwrap_or_default();
    bail!(
        "connect failed at step \"check route conflicts\" (before installing the traffic \
         manager or leasing a tunnel IP): {}",
        route_conflict_refusal(&found, &sessions)
    )
}

/// The refusal of a connect whose cluster ranges overlap `conflicts`: the
/// conflicts through a TUN device of one of `sessions` (this root daemon's)
/// name that session, its cluster and the fixes; the others are said as the
/// root daemon says them ([`kvpn_dataplane::conflicts::refusal`]). Pure.
pub fn route_conflict_refusal(
    conflicts: &[kvpn_dataplane::conflicts::Conflict],
    sessions: &[Session],
) -> String {
    let held_by = |c: &kvpn_dataplane::conflicts::Conflict| {
        sessions
            .iter()
            .find(|s| !s.tun_name.is_empty() && s.tun_name == c.laptop.dev)
    };
    let (ours, rest): (Vec<_>, Vec<_>) = conflicts.iter().partition(|c| held_by(c).is_some());
    let mut parts = Vec::new();
    if !ours.is_empty() {
        let mut lines = Vec::new();
        let mut ids = Vec::new();
        for c in &ours {
            let Some(s) = held_by(c) else { continue };
            let o = s.origin.clone().unwrap_or_default();
            lines.push(format!(
                "{} {} overlaps {} of kvpn session {} (cluster {}, context {}, TUN device {})",
                kvpn_dataplane::conflicts::kind_name(c.kind),
                c.cluster,
                c.laptop.dst,
                s.id,
                if o.cluster.is_empty() {
                    "?"
                } else {
                    &o.cluster
                },
                if o.context.is_empty() {
                    "?"
                } else {
                    &o.context
                },
                s.tun_name
            ));
            if !ids.contains(&s.id) {
                ids.push(s.id.clone());
            }
        }
        let disconnect: Vec<String> = ids
            .iter()
            .map(|i| format!("`kvpn disconnect {i}`"))
            .collect();
        parts.push(format!(
            "{} — another kvpn session routes these addresses laptop-wide; nothing was \
             installed in the cluster and no tunnel IP was leased. Clusters with overlapping \
             ranges cannot both be connected laptop-wide: reach this one with \
             `kvpn run -- COMMAND` (a run has its own routing table), or end the other \
             session first ({}), or pass --allow-route-conflict to keep it and steer only \
             this cluster's known ClusterIPs (/32 routes) through the new session",
            lines.join("; "),
            disconnect.join(", ")
        ));
    }
    if !rest.is_empty() {
        let rest: Vec<_> = rest.into_iter().cloned().collect();
        parts.push(kvpn_dataplane::conflicts::refusal(&rest));
    }
    parts.join("; also: ")
}

fn list(cidrs: &[IpNet]) -> String {
    if cidrs.is_empty() {
        return "none".to_owned();
    }
    cidrs
        .iter()
        .map(IpNet::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Namespace and name of the cluster DNS Service (kube-dns, also CoreDNS's name).
const CLUSTER_DNS_SERVICE: (&str, &str) = ("kube-system", "kube-dns");
/// The cluster domain kvpn assumes (the API does not tell it).
const CLUSTER_DOMAIN: &str = "cluster.local";

/// The cluster DNS for `namespace`: the ClusterIPs of Service kube-system/kube-dns,
/// the cluster domain and the pod search list (namespace first). `Err` says why
/// there is none, for a warning.
/// The warning for a connected namespace (`-n`, or the context's) that does not
/// exist in the cluster: short names resolve in it, so none will. A user who may
/// not read namespaces (kvpn needs no such right) is told when the namespace has
/// no Service, which is what short names would name. `None` when all is well or
/// nothing can be read.
pub(crate) async fn missing_namespace(client: &kube::Client, namespace: &str) -> Option<String> {
    use k8s_openapi::api::core::v1::{Namespace, Service};
    let fix = "check the name with `kubectl get namespaces`, or give another with -n";
    let api: kube::Api<Namespace> = kube::Api::all(client.clone());
    match api.get_opt(namespace).await {
        Ok(Some(_)) => None,
        Ok(None) => Some(format!(
            "namespace {namespace} does not exist in this cluster: short names (web, \
             web.{namespace}) will not resolve in it — {fix}"
        )),
        Err(_) => {
            let services: kube::Api<Service> = kube::Api::namespaced(client.clone(), namespace);
            match services
                .list(&kube::api::ListParams::default().limit(1))
                .await
            {
                Ok(list) if list.items.is_empty() => Some(format!(
                    "namespace {namespace} has no Service (or does not exist; this user \
                     may not read namespaces to tell): short names (web, web.{namespace}) \
                     will not resolve in it — {fix}"
                )),
                _ => None,
            }
        }
    }
}

/// The warnings for `--exclude-suffix` values that cover the cluster's own names
/// (the cluster domain, or a search domain such as `svc.cluster.local`): the
/// exclusion wins, so those names, short spellings included, go to the laptop's
/// nameservers, which do not know them.
fn excluded_cluster_names(dns: &ClusterDns) -> Vec<String> {
    let under = |name: &str, suffix: &str| name == suffix || name.ends_with(&format!(".{suffix}"));
    let mut lines = Vec::new();
    for suffix in &dns.exclude_suffixes {
        if under(&dns.domain, suffix) {
            lines.push(format!(
                "--exclude-suffix {suffix} covers the cluster domain {}: no cluster name \
                 resolves on this laptop, short names (web.default) included; exclude a \
                 narrower suffix (e.g. legacy.{}) or drop the flag",
                dns.domain, dns.domain
            ));
        } else if let Some(search) = dns.search.iter().find(|d| under(d, suffix)) {
            lines.push(format!(
                "--exclude-suffix {suffix} covers the search domain {search}: names there \
                 (short spellings included) go to the laptop's nameservers, not the \
                 cluster's; exclude a narrower suffix or drop the flag"
            ));
        }
    }
    lines
}

pub(crate) async fn cluster_dns(
    client: &kube::Client,
    namespace: &str,
) -> Result<ClusterDns, String> {
    use k8s_openapi::api::core::v1::Service;
    let (ns, name) = CLUSTER_DNS_SERVICE;
    let api: kube::Api<Service> = kube::Api::namespaced(client.clone(), ns);
    let svc = api
        .get(name)
        .await
        .map_err(|e| format!("cannot read Service {ns}/{name}: {e}"))?;
    let spec = svc.spec.unwrap_or_default();
    let mut servers: Vec<String> = spec.cluster_ips.unwrap_or_default();
    if servers.is_empty()
        && let Some(ip) = spec.cluster_ip
    {
        servers.push(ip);
    }
    servers.retain(|ip| ip.parse::<IpAddr>().is_ok());
    if servers.is_empty() {
        return Err(format!("Service {ns}/{name} has no ClusterIP"));
    }
    Ok(ClusterDns {
        servers,
        domain: CLUSTER_DOMAIN.to_owned(),
        search: vec![
            format!("{namespace}.svc.{CLUSTER_DOMAIN}"),
            format!("svc.{CLUSTER_DOMAIN}"),
            CLUSTER_DOMAIN.to_owned(),
        ],
        // Set by connect from its flags.
        include_suffixes: Vec::new(),
        exclude_suffixes: Vec::new(),
    })
}

/// The first session of `sessions` with a route overlapping `cidr` (equal, wider or
/// narrower), with that route.
pub fn session_routing<'a>(sessions: &'a [Session], cidr: &IpNet) -> Option<(&'a Session, IpNet)> {
    sessions.iter().find_map(|s| {
        s.routes.iter().find_map(|r| {
            let net: IpNet = r.cidr.parse().ok()?;
            (net.contains(cidr) || cidr.contains(&net)).then_some((s, net))
        })
    })
}

/// The root daemon's sessions, or none when it is not running.
pub(crate) async fn current_sessions(runtime_dir: &Path) -> Result<Vec<Session>> {
    let Some(mut client) = daemon::connect_existing(runtime_dir).await? else {
        return Ok(Vec::new());
    };
    daemon::sessions(&mut client, "cannot ask the root daemon for its sessions").await
}

/// The data path of a new session: with a jump host, ssh-direct when its last
/// hop reaches the manager's ClusterIP (the SSH data-plane bypass), else
/// port-forward through the SSH path (probing ssh-direct again later); without
/// one, port-forward. Says which.
pub(crate) async fn choose_data_path(
    ssh_tunnel: Option<&crate::ssh::tunnel::SshTunnel>,
    manager: &install::ManagerInfo,
) -> crate::ssh::bypass::DataPath {
    if let Some(t) = ssh_tunnel {
        output::step(&format!(
            "Probing whether {} reaches the traffic manager's ClusterIP",
            t.dialer().last_hop()
        ));
        let path = crate::ssh::bypass::choose(Some(t), manager.cluster_ip, manager.data_port).await;
        match &path {
            crate::ssh::bypass::DataPath::SshDirect { .. } => output::done(&format!(
                "Data channel: {} (bypasses the API server)",
                path.describe()
            )),
            crate::ssh::bypass::DataPath::PortForward { .. } => output::detail(&format!(
                "Data channel: {} (the SSH host does not reach the ClusterIP)",
                path.describe()
            )),
            crate::ssh::bypass::DataPath::PortForwardProbing { why, .. } => {
                output::detail(&format!(
                    "Data channel: {} ({why}; the session tries ssh-direct again every {} s \
                     and moves to it once it works)",
                    path.describe(),
                    crate::ssh::direct_path::REPROBE_EVERY.as_secs()
                ));
            }
        }
        path
    } else {
        crate::ssh::bypass::DataPath::PortForward { ssh: None }
    }
}

/// `kvpn connect` without `--manager`.
/// Install or upgrade the traffic manager as `args` say (namespace, image), with
/// progress: the first step of both modes (TUN and SOCKS5).
pub(crate) async fn ensure_manager(
    conn: &KubeConnection,
    args: &ConnectArgs,
) -> Result<install::ManagerInfo> {
    let mut opts = InstallOptions {
        namespace: args.kube.manager_namespace.clone(),
        ..InstallOptions::default()
    };
    let choice = image_choice(conn, args)?;
    if let Some(image) = &choice.image {
        crate::install::image::validate(&image.value)
            .with_context(|| format!("the manager image from {}", image.origin))?;
        output::detail(&format!(
            "manager image {} (from {})",
            image.value, image.origin
        ));
        opts.image = image.value.clone();
    }
    opts.keep_installed_image = choice.image.is_none();
    opts.keep_installed_pull_secrets = choice.pull_secrets.is_none();
    opts.image_pull_secrets = choice.pull_secrets.map(|c| c.value).unwrap_or_default();
    opts.keep_installed_pull_policy = choice.pull_policy.is_none();
    opts.image_pull_policy = choice.pull_policy.map(|c| c.value);
    opts.source_policy = args.source_policy.unwrap_or_default();
    opts.keep_installed_policy = args.source_policy.is_none();
    opts.replicas = args.replicas;
    if args.no_install {
        if let Some(n) = args.replicas {
            bail!(
                "--replicas {n} cannot scale the traffic manager with --no-install (it writes                  nothing to the cluster) — drop --no-install, or ask whoever installed it to                  scale Deployment kvpn-manager"
            );
        }
        return install::find_manager(&conn.client, &opts, &print_progress)
            .await
            .context("no usable traffic manager (--no-install)");
    }
    install::ensure_manager(&conn.client, &opts, &print_progress)
        .await
        .context("the traffic manager is not ready")
}

/// The manager image and pull settings this connect asks for: flags, then
/// `$KVPN_IMAGE`, then the settings file (per context, then top level); see
/// [`crate::settings`].
fn image_choice(conn: &KubeConnection, args: &ConnectArgs) -> Result<settings::ImageChoice> {
    let file = conn
        .target
        .config_dir
        .as_ref()
        .map(|d| d.join(settings::FILE_NAME));
    let loaded = match &file {
        Some(f) => settings::load(f)?,
        None => settings::Settings::default(),
    };
    let env_image = std::env::var(settings::IMAGE_ENV).ok();
    let flags = settings::ImageFlags {
        image: args.image.as_deref(),
        pull_secrets: &args.image_pull_secrets,
        pull_policy: args.image_pull_policy.as_deref(),
        env_image: env_image.as_deref(),
    };
    Ok(settings::choose(
        &flags,
        &loaded,
        file.as_deref()
            .unwrap_or(std::path::Path::new(settings::FILE_NAME)),
        &conn.description.context,
    ))
}

/// The lease step of both modes: this user's client id for the cluster, `Lease`
/// on the manager pod, the tunnel IP it gave. The caller reports it.
pub(crate) async fn lease_step(
    conn: &KubeConnection,
    args: &ConnectArgs,
    env: &UserEnv,
    manager: &install::ManagerInfo,
) -> Result<(LeaseResponse, IpAddr)> {
    output::step("Leasing a tunnel IP from the traffic manager");
    let client_id = lease::client_id(
        env,
        &conn.target.acting,
        &conn.description.server,
        &conn.description.cluster,
    )?;
    let leased = lease::lease(
        &conn.client,
        &args.kube.manager_namespace,
        &manager.pod_name,
        manager.grpc_port,
        &client_id,
    )
    .await
    .context("cannot lease a tunnel IP")?;
    let tunnel_ip: IpAddr = leased.tunnel_ip.parse().with_context(|| {
        format!(
            "the traffic manager leased an invalid tunnel IP {:?}",
            leased.tunnel_ip
        )
    })?;
    Ok((leased, tunnel_ip))
}

/// Points `manager` at the ready replica with the fewest sessions
/// ([`crate::replica`]) and records it in `origin` (status); says which and why.
/// The lease and the data channel then go to that pod. When the replicas
/// cannot be read, the pod the install waited for stays.
pub(crate) async fn use_least_busy_replica(
    conn: &KubeConnection,
    manager: &mut install::ManagerInfo,
    origin: &mut Origin,
) {
    let picked = crate::replica::pick(
        &conn.client,
        &manager.namespace,
        &manager.version,
        install::objects::METRICS_PORT,
    )
    .await;
    if let Some(choice) = picked {
        manager.pod_name = choice.pod;
        if let Some(ip) = choice.ip {
            manager.pod_ip = ip;
        }
        origin.manager_replica_reason = choice.reason;
    } else {
        origin.manager_replica_reason = "the pod the install waited for".to_owned();
    }
    origin.manager_replica = manager.pod_name.clone();
    output::done(&format!(
        "Traffic manager replica {} of {}: {}",
        manager.pod_name, manager.replicas, origin.manager_replica_reason
    ));
}

/// The manager's version and commit in `origin` (`kvpn version` shows them):
/// its Lease answer, else (a manager older than those fields) its Deployment's
/// `kvpn.dev/version` and no commit.
pub(crate) fn set_manager_build(
    origin: &mut Origin,
    leased: &LeaseResponse,
    manager: &install::ManagerInfo,
) {
    origin.manager_version = if leased.manager_version.is_empty() {
        manager.version.clone()
    } else {
        leased.manager_version.clone()
    };
    origin.manager_commit = leased.manager_commit.clone();
}

/// What every session request carries, whatever the mode: who asks (environment,
/// working directory, euid), how the user daemon reaches the cluster again
/// (kubeconfig, context, namespace, SSH plan) and the manager's data port. The
/// caller fills in the mode's own fields.
pub(crate) fn session_request(
    env: &UserEnv,
    args: &ConnectArgs,
    conn: &KubeConnection,
    plan: Option<&crate::ssh::SshPlan>,
    manager: &install::ManagerInfo,
) -> StartSessionRequest {
    StartSessionRequest {
        env: userd::env_of(env),
        cwd: env.cwd.as_os_str().as_bytes().to_vec(),
        euid: env.euid,
        kubeconfig: args
            .kube
            .kubeconfig
            .as_ref()
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default(),
        context: args.kube.context.clone().unwrap_or_default(),
        namespace: args.kube.namespace.clone().unwrap_or_default(),
        ssh_plan_json: plan.map(|p| p.to_env()).unwrap_or_default(),
        manager_namespace: args.kube.manager_namespace.clone(),
        data_port: u32::from(manager.data_port),
        connected_namespace: conn.description.namespace.clone(),
        ..StartSessionRequest::default()
    }
}

pub async fn kube_connect(runtime_dir: &Path, args: &ConnectArgs) -> Result<()> {
    kube_connect_as(runtime_dir, args, Scope::Laptop)
        .await
        .map(drop)
}

/// Who a session is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The whole laptop (`kvpn connect`): laptop-wide routes and DNS, one
    /// session per cluster.
    Laptop,
    /// One process tree (`kvpn run`): always a new session of its own, no
    /// laptop-wide route or DNS change (ConnectRequest.run_scope).
    Run,
}

/// [`kube_connect`] for `scope`; the new session's id (`None`: an existing
/// session of the same cluster was found, laptop scope only).
pub async fn kube_connect_as(
    runtime_dir: &Path,
    args: &ConnectArgs,
    scope: Scope,
) -> Result<Option<String>> {
    let run = scope == Scope::Run;
    if run && args.socks {
        bail!("kvpn run does not take --socks: a run gets its own TUN device, routes and DNS");
    }
    // SIGINT (Ctrl-C, or `kvpn quit` interrupting this connect) is watched from the
    // start: before the session exists it ends the connect at the step it
    // interrupts (exit 130, not connected); once the session is set up it is
    // undone ([`setup_or_interrupt`], [`interrupted`]). A SIGINT that came
    // before the watch was made was swallowed in CI (kube_connect_race: the
    // connect ran on and said connected; the quit that sent it then
    // disconnected the session).
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .context("cannot watch SIGINT")?;
    let env = UserEnv::current().context("cannot read this process's environment")?;
    // A normal user needs a root daemon that accepts their uid: find or start
    // it (sudo, pkexec) before anything else, so that when neither works the
    // connect fails at once, having touched neither the cluster nor this laptop.
    // SAFETY: geteuid has no preconditions and cannot fail.
    if !args.socks && unsafe { libc::geteuid() } != 0 {
        daemon::connect_or_start(runtime_dir).await?;
    }
    if args.socks {
        // A --socks-listen address this machine cannot bind fails here, before
        // the API server is asked anything. A port in use may be this cluster's
        // running session (connect is idempotent): that one is checked once the
        // sessions are known (socks::cli::connect).
        let listen = args.socks_listen.unwrap_or(crate::socks::DEFAULT_LISTEN);
        match crate::socks::check_listen(listen) {
            Err(e) if e.kind() != std::io::ErrorKind::AddrInUse => {
                return Err(crate::socks::listen_error(listen, &e));
            }
            _ => {}
        }
    }
    let plan = crate::ssh::plan_for(&args.kube.ssh, &env)?;
    match &plan {
        Some(p) => output::step(&format!(
            "Reading kubeconfig and reaching the API server through SSH: {}",
            p.describe()
        )),
        None => output::step("Reading kubeconfig and reaching the API server"),
    }
    // Kept for the whole connect: install, lease, CIDR detection and DNS go through it.
    let (conn, ssh_tunnel) =
        crate::ssh::connect_kube(&args.kube.flags(), plan.as_ref(), &env).await?;
    if let Some(t) = &ssh_tunnel {
        output::done(&format!(
            "SSH forward {} leads to the API server",
            t.local_addr()
        ));
    }
    output::done(&format!("Using {}", conn.description));
    if args.socks {
        return crate::socks::cli::connect(
            runtime_dir,
            args,
            &conn,
            plan.as_ref(),
            ssh_tunnel.as_ref(),
            &env,
        )
        .await
        .map(|()| None);
    }
    let mut origin = Origin {
        transport: TRANSPORT_PORT_FORWARD.to_owned(),
        cluster: conn.description.cluster.clone(),
        server: conn.description.server.clone(),
        context: conn.description.context.clone(),
        manager_namespace: args.kube.manager_namespace.clone(),
        data_path: String::new(),
        source_policy: String::new(),
        manager_version: String::new(),
        manager_commit: String::new(),
        cluster_id: conn.description.cluster_id.clone(),
        kept_out: Vec::new(),
        extra_domains: args.extra_domains.clone(),
        include_suffixes: args.include_suffixes.clone(),
        exclude_suffixes: args.exclude_suffixes.clone(),
        never_proxy: args.never_proxy.iter().map(ToString::to_string).collect(),
        // Filled in once the replica is picked (after the install).
        manager_replica: String::new(),
        manager_replica_reason: String::new(),
        // Filled in with the policy (preserve without its node agent).
        source_policy_note: String::new(),
    };
    let mut user = userd::connect_or_start(runtime_dir).await?;
    // A run never shares a session: a laptop-wide one routes for everybody.
    if !run && let Some(session_policy) = already_connected(&mut user, &origin).await? {
        if let Some(warning) = ignored_flags_warning(&flags_not_applied(args, &session_policy)) {
            output::warn(&warning);
        }
        return Ok(None);
    }

    // The cluster's ranges first (cache, flags, detection: none installs
    // anything), so that a route conflict is refused before the install and
    // the lease.
    let (detected_pod, detected_service, to_cache) = cluster_cidrs(
        &conn.client,
        &args.kube.manager_namespace,
        args.redetect_cidrs,
    )
    .await?;
    let pod: Vec<IpNet> = detected_pod
        .iter()
        .chain(&args.pod_cidrs)
        .copied()
        .collect();
    let service: Vec<IpNet> = detected_service
        .iter()
        .chain(&args.service_cidrs)
        .copied()
        .collect();
    if pod.is_empty() && service.is_empty() && args.extra_cidrs.is_empty() {
        bail!(
            "could not detect any pod or service CIDR of this cluster — give them with \
             --pod-cidr and --service-cidr"
        );
    }
    // Never route the API server, the nameservers or the gateway into the tunnel (rt-02).
    let api_host = host_of(&conn.description.server);
    // With a jump host, the laptop talks to its first hop directly: keep that out too.
    let first_hop: Vec<&str> = plan
        .iter()
        .flat_map(|p| p.hops.first())
        .map(|h| h.host.as_str())
        .collect();
    let essentials = cidr::essentials::gather(&[api_host.as_str()], &first_hop).await;
    for p in &essentials.problems {
        output::warn(p);
    }
    let keep_out: Vec<IpAddr> = essentials.addresses();
    warn_never_routed(&[&detected_pod[..], &detected_service].concat());
    warn_typed_cidr_holes(args, &essentials.labelled());
    let routes = cluster_routes_avoiding(
        &pod,
        &service,
        &args.extra_cidrs,
        &keep_out,
        &args.never_proxy,
    );
    // Say what the laptop keeps for itself inside the cluster ranges.
    origin.kept_out = kept_out_inside(
        &[
            (&pod[..], "pod"),
            (&service[..], "service"),
            (&args.extra_cidrs[..], "extra"),
        ],
        &essentials.labelled(),
        &args.never_proxy,
    );
    if !origin.kept_out.is_empty() {
        output::done(&format!(
            "Kept {} address(es) off the tunnel inside the cluster ranges (the laptop's own \
             and --never-proxy ranges)",
            origin.kept_out.len()
        ));
        for k in &origin.kept_out {
            output::detail(&kept_out_line(k));
        }
    }
    let routes = ipv4_only_if_ipv6_off(routes);
    if !run && !args.allow_route_conflict {
        refuse_route_conflicts(runtime_dir, &routes)
            .await
            .map_err(|e| with_split_refusal_hint(e, args, &keep_out))?;
    }

    let mut manager = tokio::select! {
        m = ensure_manager(&conn, args) => m?,
        _ = interrupt.recv() => interrupted_before_session("installing the traffic manager"),
    };
    if let Some(cached) = &to_cache {
        cache_cidrs(&conn.client, &args.kube.manager_namespace, cached).await;
    }
    use_least_busy_replica(&conn, &mut manager, &mut origin).await;
    origin.source_policy = manager.source_policy.as_str().to_owned();
    if manager.source_policy == crate::install::SourcePolicy::Preserve {
        origin.source_policy_note =
            crate::install::node_agent_note(&conn.client, &args.kube.manager_namespace).await;
        if !origin.source_policy_note.is_empty() {
            output::warn(&origin.source_policy_note);
        }
    }
    match args.source_policy {
        Some(asked) if manager.source_policy != asked => output::warn(&format!(
            "the traffic manager runs with --source-policy {} (a newer kvpn installed it), not {asked}",
            manager.source_policy
        )),
        Some(_) => output::done(&format!(
            "Source policy {} (as asked)",
            manager.source_policy
        )),
        None => output::done(&format!(
            "Source policy {} (the installed manager's; --source-policy changes it)",
            manager.source_policy
        )),
    }
    let data_path = choose_data_path(ssh_tunnel.as_ref(), &manager).await;
    origin.data_path = data_path.describe();

    // The tunnel IP and session token come from the manager (item 4, tr-11): the
    // same client id, kept per user and cluster, gets the same IP back.
    let (leased, tunnel_ip) = tokio::select! {
        l = lease_step(&conn, args, &env, &manager) => l?,
        _ = interrupt.recv() => interrupted_before_session("leasing a tunnel IP"),
    };
    set_manager_build(&mut origin, &leased, &manager);
    let tunnel_pool: IpNet = leased.pool_cidr.parse().with_context(|| {
        format!(
            "the traffic manager sent an invalid tunnel pool {:?}",
            leased.pool_cidr
        )
    })?;
    output::done(&format!(
        "Tunnel IP {tunnel_ip} (pool {tunnel_pool}; kept while connected, then for {} s)",
        leased.expires_in_s
    ));

    if let Some(e) = pool_overlap(
        &tunnel_pool,
        &[
            (&pod[..], "pod"),
            (&service[..], "service"),
            (&args.extra_cidrs[..], "--cidr"),
        ],
    ) {
        bail!(e);
    }

    // Other laptops' tunnel IPs (laptop-to-laptop through the manager). The
    // laptop's own tunnel IP is in the local routing table, which wins, so the
    // pool needs no hole for it. Two clusters whose managers use the same pool
    // (the default) cannot both own it: the session that routes it first keeps
    // it, and this one reaches the cluster but not the laptops behind it.
    // A run's processes reach the cluster, not other laptops.
    let mut routes = routes;
    match session_routing(&current_sessions(runtime_dir).await?, &tunnel_pool) {
        _ if run => {}
        None => routes.push(Route {
            cidr: tunnel_pool.to_string(),
            kind: RouteKind::Extra as i32,
            watched: false,
        }),
        Some((s, net)) => output::warn(&format!(
            "the tunnel pool {tunnel_pool} overlaps {net}, routed through session {} on {}: \
             other laptops of this cluster stay reachable only through that session \
             (run one of the traffic managers with another `kvpn-manager --tunnel-pool`)",
            s.id, s.tun_name
        )),
    }

    let tunnel_ip_v6 = dual_stack_tunnel_ip(&routes, &leased)?;
    if let Some(v6) = tunnel_ip_v6 {
        output::detail(&format!(
            "IPv6 tunnel IP {v6} (the cluster has IPv6 ranges; pool {})",
            leased.pool_cidr_v6
        ));
    }

    if let Some(line) = missing_namespace(&conn.client, &conn.description.namespace).await {
        output::warn(&line);
    }
    let dns = match cluster_dns(&conn.client, &conn.description.namespace).await {
        Ok(mut dns) => {
            // A --never-proxy range over the cluster DNS leaves every cluster name
            // unanswered (SERVFAIL): say so now and keep it in status.
            for k in never_proxied_dns(&dns.servers, &args.never_proxy) {
                output::warn(&format!(
                    "{}: cluster names will not resolve on this laptop (their queries get \
                     SERVFAIL); narrow --never-proxy to leave {} out of it",
                    kept_out_line(&k),
                    k.address
                ));
                origin.kept_out.push(k);
            }
            // --extra-domain names are the cluster DNS's to answer too.
            dns.include_suffixes = args
                .include_suffixes
                .iter()
                .chain(&args.extra_domains)
                .cloned()
                .collect();
            dns.exclude_suffixes = args.exclude_suffixes.clone();
            for line in excluded_cluster_names(&dns) {
                output::warn(&line);
            }
            Some(dns)
        }
        Err(why) => {
            output::warn(&format!(
                "cluster names will not resolve on this laptop: {why}"
            ));
            if !(args.extra_domains.is_empty()
                && args.include_suffixes.is_empty()
                && args.exclude_suffixes.is_empty())
            {
                output::warn(
                    "--extra-domain, --include-suffix and --exclude-suffix have no effect \
                     without the cluster DNS",
                );
            }
            None
        }
    };

    let mut client = daemon::connect_or_start_announced(runtime_dir).await?;
    match data_path.ssh_direct_target() {
        Some(target) => output::step(&format!(
            "Connecting to the traffic manager (tunnel IP {tunnel_ip}) through SSH \
             (ssh-direct to {target})"
        )),
        None => output::step(&format!(
            "Connecting to the traffic manager (tunnel IP {tunnel_ip}) through a port-forward \
             to pod {} port {}",
            manager.pod_name, manager.data_port
        )),
    }
    // Ctrl-C from here on rolls back what was made (docs/root-daemon.md: a Connect is all
    // or nothing): this process waits for StartSession's answer (bounded,
    // [`setup_or_interrupt`]) and disconnects the session; the user daemon
    // undoes a setup whose caller went away before it answered.
    if interrupt_pending(&mut interrupt).await {
        interrupted_before_session("setting up the session");
    }
    let mut start_client = user.clone();
    let ssh_direct = data_path.request_fields();
    let start = start_client.start_session(StartSessionRequest {
        grpc_port: u32::from(manager.grpc_port),
        keep_out: keep_out.iter().map(ToString::to_string).collect(),
        never_proxy: args.never_proxy.iter().map(ToString::to_string).collect(),
        extra_domains: args.extra_domains.clone(),
        ssh_direct: ssh_direct.0,
        ssh_direct_failed: ssh_direct.1,
        connect: Some(ConnectRequest {
            // The user daemon's loopback listener; it fills this in.
            manager: String::new(),
            routes: routes.clone(),
            tunnel_ip: tunnel_ip.to_string(),
            tunnel_ip_v6: tunnel_ip_v6.map(|a| a.to_string()).unwrap_or_default(),
            tun_name: args.tun_name.clone().unwrap_or_default(),
            mtu: args.mtu.unwrap_or(0),
            origin: Some(origin),
            session_token: leased.session_token.clone(),
            // TLS end to end through the port-forward: the root daemon verifies the
            // manager against the CA from Secret kvpn-manager-tls, by its Service name.
            tls_ca_pem: manager.ca_pem.clone(),
            tls_server_name: manager.server_name.clone(),
            dns,
            hosts_file: args.hosts,
            allow_route_conflict: args.allow_route_conflict,
            steer_ebpf: args.steer() == crate::cli::Steer::Ebpf,
            workers: args.workers,
            run_scope: run,
        }),
        socks: None,
        ..session_request(&env, args, &conn, plan.as_ref(), &manager)
    });
    let started = match setup_or_interrupt(start, &mut interrupt).await {
        Setup::Done(r) => r
            .map_err(daemon::status_to_error)
            .map_err(|e| with_split_refusal_hint(e, args, &keep_out))
            .context("connect failed")?,
        Setup::Interrupted(None) => interrupted(Interrupted::Pending("user daemon")).await,
        Setup::Interrupted(Some(started)) => {
            let id = started.connect.map(|c| c.session_id).unwrap_or_default();
            interrupted(Interrupted::User(&mut user, &id)).await
        }
    };
    let resp = started.connect.unwrap_or_default();
    output::done(&format!(
        "The user daemon (pid {}) forwards {} to the traffic manager",
        started.daemon_pid, started.data_addr
    ));
    output::step("Waiting for the traffic manager's first heartbeat echo");
    let connected_line = format!(
        "Connected to {} through {}: session {} on TUN device {} (ifindex {})",
        conn.description.cluster,
        data_path.kind(),
        resp.session_id,
        resp.tun_name,
        resp.tun_ifindex
    );
    tokio::select! {
        r = report_connected(&mut client, &resp.session_id, &connected_line) => r?,
        _ = interrupt.recv() => interrupted(Interrupted::User(&mut user, &resp.session_id)).await,
    }
    // The watched routes and the pinned ClusterIP host routes come from the
    // route watch: connect returns once they are in place.
    tokio::select! {
        r = wait_route_watch(&mut client, &resp.session_id, ROUTE_WATCH_WAIT) => { r?; }
        _ = interrupt.recv() => interrupted(Interrupted::User(&mut user, &resp.session_id)).await,
    }
    for r in &routes {
        output::detail(&format!("route {} ({})", r.cidr, output::kind_name(r.kind)));
    }
    match resp.dns.strip_prefix("not configured: ") {
        Some(why) => output::warn(&format!("cluster DNS not set up on this laptop: {why}")),
        None if !resp.dns.is_empty() => output::detail(&format!("DNS: {}", resp.dns)),
        None => {}
    }
    if interrupt_pending(&mut interrupt).await {
        interrupted(Interrupted::User(&mut user, &resp.session_id)).await
    }
    Ok(Some(resp.session_id))
}

/// Ctrl-C (or `kvpn quit`) before the session was set up: nothing of this laptop
/// was changed yet; say so and exit as SIGINT would (130). What the step made in
/// the cluster stays (an install goes on server-side; `kvpn uninstall` removes it).
pub(crate) fn interrupted_before_session(step: &str) -> ! {
    output::warn(&format!(
        "interrupted while {step} — not connected (nothing on this laptop was changed)"
    ));
    std::process::exit(130)
}

/// Whether a Ctrl-C (or `kvpn quit`'s SIGINT) arrived and was not handled yet:
/// checked as the last step of a connect, which still holds the connect lock. A
/// SIGINT after the route watch was waited for used to be swallowed (the
/// handler is installed, nobody read it): the connect said connected and exited
/// 0, and the `kvpn quit` that sent it then disconnected the session
/// (kube_connect_race, seen under load).
pub(crate) async fn interrupt_pending(interrupt: &mut tokio::signal::unix::Signal) -> bool {
    tokio::select! {
        biased;
        _ = interrupt.recv() => true,
        () = std::future::ready(()) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::{
        SessionMatch, excluded_cluster_names, flags_not_applied, host_of, ignored_flags_warning,
        match_session, pool_overlap, same_cluster, unhandled_conflicts,
    };
    use crate::cli::{Cli, Command, ConnectArgs};
    use clap::Parser as _;
    use ipnet::IpNet;
    use kvpn_proto::dataplane::{Origin, Session};

    /// A SIGINT that arrived after the connect's last wait is seen by its final
    /// check (it was swallowed: the connect exited 0 and `kvpn quit`, which sent
    /// it, disconnected the session), and none is reported when none came.
    #[tokio::test]
    async fn a_pending_interrupt_is_seen_by_the_last_check() {
        let mut interrupt =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
                .expect("watch SIGINT");
        assert!(!super::interrupt_pending(&mut interrupt).await);
        // The handler is tokio's from here on: SIGINT no longer ends the process.
        nix::sys::signal::raise(nix::sys::signal::Signal::SIGINT).expect("raise SIGINT");
        // Delivery to the tokio driver is asynchronous: give it a moment.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut seen = false;
        while !seen && std::time::Instant::now() < deadline {
            seen = super::interrupt_pending(&mut interrupt).await;
            if !seen {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        }
        assert!(seen, "the SIGINT raised before the check was not seen");
        assert!(
            !super::interrupt_pending(&mut interrupt).await,
            "one SIGINT is seen once"
        );
    }

    /// #29 F3: an --exclude-suffix over the cluster domain or a search domain is
    /// said at connect; a narrower one is not.
    #[test]
    fn exclude_suffixes_over_cluster_names_are_warned() {
        let dns = |exclude: &[&str]| kvpn_proto::dataplane::ClusterDns {
            servers: vec!["10.96.0.10".into()],
            domain: "cluster.local".into(),
            search: vec![
                "dev.svc.cluster.local".into(),
                "svc.cluster.local".into(),
                "cluster.local".into(),
            ],
            exclude_suffixes: exclude.iter().map(|s| (*s).to_owned()).collect(),
            ..Default::default()
        };
        for (suffix, says) in [
            ("cluster.local", "covers the cluster domain cluster.local"),
            ("local", "covers the cluster domain cluster.local"),
            (
                "svc.cluster.local",
                "covers the search domain dev.svc.cluster.local",
            ),
        ] {
            let lines = excluded_cluster_names(&dns(&[suffix]));
            assert_eq!(lines.len(), 1, "{suffix}: {lines:?}");
            assert!(lines[0].contains(says), "{suffix}: {}", lines[0]);
        }
        for narrow in ["legacy.cluster.local", "corp.example"] {
            assert_eq!(
                excluded_cluster_names(&dns(&[narrow])),
                Vec::<String>::new()
            );
        }
    }

    fn connect_args(flags: &[&str]) -> ConnectArgs {
        let argv = ["kvpn", "connect"].iter().chain(flags);
        match Cli::try_parse_from(argv)
            .expect("kvpn connect parses")
            .command
        {
            Command::Connect(args) => *args,
            other => panic!("not connect: {other:?}"),
        }
    }

    /// A --never-proxy range over a whole cluster range reads as such (it
    /// covered it: "0.0.0.0/0 inside pod CIDR …" was backwards), and one over
    /// the cluster DNS is named, so connect and status can say names break.
    #[test]
    fn never_proxy_over_a_whole_range_or_the_cluster_dns_is_named() {
        let net = |s: &str| s.parse::<ipnet::IpNet>().expect("cidr");
        let pod = [net("10.244.1.0/24")];
        let kept = super::kept_out_inside(&[(&pod[..], "pod")], &[], &[net("0.0.0.0/0")]);
        assert_eq!(
            super::kept_out_line(&kept[0]),
            "kept off the tunnel: the whole pod CIDR 10.244.1.0/24 (inside 0.0.0.0/0) — --never-proxy"
        );
        let servers = ["10.96.0.10".to_owned(), "fd00::a".to_owned()];
        let dns = super::never_proxied_dns(&servers, &[net("10.96.0.0/12")]);
        assert_eq!(dns.len(), 1, "{dns:?}");
        assert_eq!(
            super::kept_out_line(&dns[0]),
            "kept off the tunnel: 10.96.0.10 inside --never-proxy CIDR 10.96.0.0/12 — the cluster \
             DNS, covered by --never-proxy"
        );
        assert!(super::never_proxied_dns(&servers, &[net("10.96.5.0/24")]).is_empty());
    }

    /// What connect keeps off the tunnel inside the cluster ranges is listed
    /// with its range and reason; addresses outside every range are not (they
    /// need no hole), and --never-proxy ranges are.
    #[test]
    fn kept_out_lists_essentials_and_never_proxy_ranges_inside_cluster_ranges() {
        let net = |s: &str| s.parse::<ipnet::IpNet>().expect("cidr");
        let ip = |s: &str| s.parse::<std::net::IpAddr>().expect("ip");
        let pod = [net("10.244.0.0/16")];
        let svc = [net("10.96.0.0/12")];
        let labelled = vec![
            (ip("10.244.1.250"), "another VPN's endpoint (…)".to_owned()),
            (ip("10.244.1.253"), "a nameserver".to_owned()),
            (ip("10.244.1.253"), "a default gateway".to_owned()),
            (ip("192.168.1.1"), "a default gateway".to_owned()),
        ];
        let kept = super::kept_out_inside(
            &[(&pod[..], "pod"), (&svc[..], "service"), (&[][..], "extra")],
            &labelled,
            &[net("10.96.5.0/24"), net("172.16.0.0/12")],
        );
        let got: Vec<(&str, &str, &str, &str)> = kept
            .iter()
            .map(|k| {
                (
                    k.address.as_str(),
                    k.kind.as_str(),
                    k.cidr.as_str(),
                    k.why.as_str(),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("10.96.5.0/24", "service", "10.96.0.0/12", "--never-proxy"),
                (
                    "10.244.1.250",
                    "pod",
                    "10.244.0.0/16",
                    "another VPN's endpoint (…)"
                ),
                ("10.244.1.253", "pod", "10.244.0.0/16", "a nameserver"),
            ]
        );
        assert_eq!(
            super::kept_out_line(&kept[2]),
            "kept off the tunnel: 10.244.1.253 inside pod CIDR 10.244.0.0/16 — a nameserver"
        );
        // --never-proxy leaves its range out of the routes.
        let routes = super::cluster_routes_avoiding(&pod, &svc, &[], &[], &[net("10.96.5.0/24")]);
        assert!(
            !routes
                .iter()
                .any(|r| net(&r.cidr).contains(&ip("10.96.5.9"))),
            "{routes:?}"
        );
        assert!(
            routes
                .iter()
                .any(|r| net(&r.cidr).contains(&ip("10.96.6.9")))
        );
    }

    /// A repeat connect with another --source-policy than the running session's
    /// names it as not applied (it was silently dropped); the same one is not.
    #[test]
    fn a_different_source_policy_is_named_as_not_applied() {
        let preserve = connect_args(&["--source-policy", "preserve"]);
        assert_eq!(
            flags_not_applied(&preserve, "ebpf-snat"),
            ["--source-policy"]
        );
        assert_eq!(flags_not_applied(&preserve, ""), ["--source-policy"]);
        assert!(flags_not_applied(&preserve, "preserve").is_empty());
        assert!(flags_not_applied(&connect_args(&[]), "snat").is_empty());
        let both = connect_args(&["--hosts", "--source-policy", "snat"]);
        let w = ignored_flags_warning(&flags_not_applied(&both, "preserve")).expect("a warning");
        assert!(
            w.starts_with("--hosts, --source-policy not applied: they shape a new session"),
            "{w}"
        );
    }

    /// `--replicas` on a connect that finds its session running is named as
    /// not applied: the install step (which scales) is skipped then.
    #[test]
    fn replicas_on_a_running_session_are_named_as_not_applied() {
        let three = connect_args(&["--replicas", "3"]);
        assert_eq!(flags_not_applied(&three, "snat"), ["--replicas"]);
    }

    /// A cluster range overlapping the tunnel pool is refused naming both
    /// (trial T1); disjoint ranges pass.
    #[test]
    fn a_cluster_range_inside_the_tunnel_pool_is_refused_naming_both() {
        let net = |s: &str| s.parse::<IpNet>().expect("net");
        let pool = net("100.96.0.0/16");
        let pods = [net("100.96.1.0/24")];
        let services = [net("10.80.0.0/24")];
        let e = pool_overlap(&pool, &[(&pods, "pod"), (&services, "service")]).expect("refused");
        assert!(
            e.contains(
                "pod range 100.96.1.0/24 overlaps the traffic manager's tunnel pool 100.96.0.0/16"
            ) && e.contains("--tunnel-pool"),
            "{e}"
        );
        let wide = [net("100.0.0.0/8")];
        assert!(pool_overlap(&pool, &[(&wide, "--cidr")]).is_some());
        let fine = [net("10.244.0.0/16")];
        assert_eq!(
            pool_overlap(&pool, &[(&fine, "pod"), (&services, "service")]),
            None
        );
    }

    /// DNS and routing options on a running session are named as not applied
    /// (trial T2: `--exclude-suffix`, `--never-proxy` were dropped silently).
    #[test]
    fn dns_and_routing_options_on_a_running_session_are_named_as_not_applied() {
        let args = connect_args(&[
            "--exclude-suffix",
            "example.org",
            "--never-proxy",
            "10.244.1.8/32",
            "--extra-domain",
            "db.internal",
            "--include-suffix",
            "corp.internal",
        ]);
        assert_eq!(
            flags_not_applied(&args, "snat"),
            [
                "--never-proxy",
                "--extra-domain",
                "--include-suffix",
                "--exclude-suffix"
            ]
        );
    }

    /// One ignored flag is "it", several "they"; none, no warning.
    #[test]
    fn ignored_flags_are_named_with_the_right_pronoun() {
        assert_eq!(ignored_flags_warning(&[]), None);
        let one = ignored_flags_warning(&["--hosts"]).expect("a warning");
        assert!(
            one.starts_with("--hosts not applied: it shapes a new session"),
            "{one}"
        );
        assert!(one.ends_with("connect again with it"), "{one}");
        assert!(!one.contains("they"), "{one}");
        let two = ignored_flags_warning(&["--cidr", "--namespace"]).expect("a warning");
        assert!(
            two.starts_with("--cidr, --namespace not applied: they shape a new session"),
            "{two}"
        );
        assert!(two.contains("`kvpn disconnect` the session"), "{two}");
        assert!(two.ends_with("with them"), "{two}");
    }

    fn origin(server: &str, context: &str, ns: &str) -> Origin {
        Origin {
            transport: "port-forward".into(),
            cluster: "lab".into(),
            server: server.into(),
            context: context.into(),
            manager_namespace: ns.into(),
            data_path: String::new(),
            source_policy: String::new(),
            manager_version: String::new(),
            manager_commit: String::new(),
            cluster_id: String::new(),
            ..Default::default()
        }
    }

    fn session(id: &str, origin: Option<Origin>) -> Session {
        Session {
            id: id.into(),
            origin,
            ..Default::default()
        }
    }

    #[test]
    fn same_cluster_context_and_namespace_is_the_same_session() {
        let a = origin("https://172.31.255.1:6443", "user@lab", "kvpn-system");
        let sessions = vec![
            session("direct", None),
            session(
                "other",
                Some(origin("https://10.0.0.1:6443", "user@lab", "kvpn-system")),
            ),
            session("mine", Some(a.clone())),
        ];
        assert_eq!(
            match_session(&sessions, &a),
            SessionMatch::Same(&sessions[2])
        );
        let admin = origin("https://172.31.255.1:6443", "admin@lab", "kvpn-system");
        assert_eq!(
            match_session(&sessions, &admin),
            SessionMatch::Conflict(&sessions[2])
        );
        let other_ns = origin("https://172.31.255.1:6443", "user@lab", "kvpn-2");
        assert_eq!(
            match_session(&sessions, &other_ns),
            SessionMatch::Conflict(&sessions[2])
        );
        let elsewhere = origin("https://192.0.2.1:6443", "user@lab", "kvpn-system");
        assert_eq!(match_session(&sessions, &elsewhere), SessionMatch::None);
        assert_eq!(match_session(&[], &a), SessionMatch::None);
        // A `kvpn run` session of the same cluster is not the laptop's connection
        // (trial F2: connect said "Already connected" and routed nothing).
        let run = vec![Session {
            run_cgroup: "/sys/fs/cgroup/kvpn-run-r".into(),
            ..session("run", Some(a.clone()))
        }];
        assert_eq!(match_session(&run, &a), SessionMatch::None);
        assert_eq!(match_session(&run, &admin), SessionMatch::None);
    }

    #[test]
    fn another_ca_at_the_same_url_is_another_cluster() {
        let url = "https://127.0.0.1:6443";
        let with_ca = |ca: &str| Origin {
            cluster_id: ca.into(),
            ..origin(url, "default", "kvpn-system")
        };
        let (a, b) = (with_ca("ca-sha256:aa"), with_ca("ca-sha256:bb"));
        let sessions = vec![session("a", Some(a.clone()))];
        assert_eq!(match_session(&sessions, &b), SessionMatch::None);
        assert_eq!(
            match_session(&sessions, &a),
            SessionMatch::Same(&sessions[0])
        );
        // Another context of cluster B at the URL is no conflict with A either.
        let b_admin = Origin {
            context: "admin".into(),
            ..b.clone()
        };
        assert_eq!(match_session(&sessions, &b_admin), SessionMatch::None);
        // A session recorded without a CA (older kvpn) still matches by URL.
        let old = vec![session("old", Some(origin(url, "default", "kvpn-system")))];
        assert_eq!(match_session(&old, &b), SessionMatch::Same(&old[0]));
        assert!(same_cluster(&a, url, "ca-sha256:aa"));
        assert!(!same_cluster(&a, url, "ca-sha256:bb"));
        assert!(!same_cluster(&a, "https://127.0.0.2:6443", "ca-sha256:aa"));
    }

    /// T10: a conflict with a route of another session of this root daemon
    /// names that session, its cluster and context, the overlapping ranges and
    /// the three ways out; a conflict with any other laptop route is said as
    /// the root daemon says it.
    #[test]
    fn a_conflict_with_another_session_names_it_the_range_and_the_fixes() {
        use kvpn_dataplane::conflicts::{Conflict, LaptopRoute};
        use kvpn_dataplane::ebpf::RouteKind;
        let route = |dst: &str, dev: &str| LaptopRoute {
            dst: dst.parse().expect("cidr"),
            dev: dev.into(),
            oif: 7,
            protocol: kvpn_dataplane::netlink::RTPROT_KVPN,
            table: kvpn_dataplane::conflicts::TABLE_MAIN,
            kind: 1,
        };
        let conflict = |cluster: &str, kind, laptop| Conflict {
            cluster: cluster.parse().expect("cidr"),
            kind,
            laptop,
            other_kvpn: true,
        };
        let other = Session {
            id: "a1b2c3".into(),
            tun_name: "kvpn0".into(),
            origin: Some(Origin {
                cluster: "lab-a".into(),
                context: "ctx-a".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let found = [
            conflict(
                "10.244.0.0/16",
                RouteKind::Pod,
                route("10.244.0.0/16", "kvpn0"),
            ),
            conflict(
                "10.96.0.0/12",
                RouteKind::Service,
                route("10.96.0.0/12", "kvpn0"),
            ),
        ];
        let msg = super::route_conflict_refusal(&found, std::slice::from_ref(&other));
        for want in [
            "pod CIDR 10.244.0.0/16 overlaps 10.244.0.0/16 of kvpn session a1b2c3 (cluster lab-a, \
             context ctx-a, TUN device kvpn0)",
            "service CIDR 10.96.0.0/12 overlaps 10.96.0.0/12 of kvpn session a1b2c3",
            "nothing was installed in the cluster and no tunnel IP was leased",
            "`kvpn run -- COMMAND`",
            "`kvpn disconnect a1b2c3`",
            "--allow-route-conflict",
        ] {
            assert!(msg.contains(want), "missing {want:?} in: {msg}");
        }
        assert_eq!(msg.matches("kvpn disconnect a1b2c3").count(), 1, "{msg}");
        // A TUN device of no session of this root daemon (another --runtime-dir),
        // and a laptop route that is no kvpn's: the root daemon's words.
        let mut bridge = route("10.100.7.0/24", "br0");
        bridge.protocol = 2;
        let mut foreign = conflict("10.96.0.0/12", RouteKind::Service, bridge);
        foreign.other_kvpn = false;
        let msg = super::route_conflict_refusal(
            &[
                conflict(
                    "10.244.0.0/16",
                    RouteKind::Pod,
                    route("10.244.0.0/16", "kvpn3"),
                ),
                foreign,
            ],
            std::slice::from_ref(&other),
        );
        assert!(
            msg.contains("another kvpn session already routes these addresses through kvpn3")
                && msg.contains("10.100.7.0/24 dev br0")
                && !msg.contains("a1b2c3"),
            "{msg}"
        );
    }

    #[test]
    fn a_pool_routed_by_another_session_is_found() {
        use kvpn_proto::dataplane::Route;
        let with_routes = |id: &str, cidrs: &[&str]| Session {
            id: id.into(),
            routes: cidrs
                .iter()
                .map(|c| Route {
                    cidr: (*c).into(),
                    kind: 0,
                    watched: false,
                })
                .collect(),
            ..Default::default()
        };
        let sessions = vec![
            with_routes("a", &["10.244.0.0/16", "10.96.0.0/12"]),
            with_routes("b", &["10.248.1.0/24", "100.96.0.0/16"]),
        ];
        let pool = "100.96.0.0/16".parse().expect("cidr");
        let (s, net) = super::session_routing(&sessions, &pool).expect("routed by b");
        assert_eq!(
            (s.id.as_str(), net.to_string().as_str()),
            ("b", "100.96.0.0/16")
        );
        let narrower = "100.96.3.0/24".parse().expect("cidr");
        assert_eq!(
            super::session_routing(&sessions, &narrower).map(|(s, _)| s.id.as_str()),
            Some("b")
        );
        let wider = "100.64.0.0/10".parse().expect("cidr");
        assert!(super::session_routing(&sessions, &wider).is_some());
        let other = "100.97.0.0/16".parse().expect("cidr");
        assert!(super::session_routing(&sessions, &other).is_none());
        assert!(super::session_routing(&[], &pool).is_none());
    }

    #[test]
    fn host_of_server_urls() {
        assert_eq!(host_of("https://172.31.255.1:6443"), "172.31.255.1");
        assert_eq!(host_of("https://api.example.com"), "api.example.com");
        assert_eq!(host_of("https://[fd00::1]:6443/prefix"), "fd00::1");
    }

    #[test]
    fn only_an_unhandled_conflict_is_warned_about_naming_route_table_and_fix() {
        let conflict = |handling: &str| kvpn_proto::dataplane::RouteConflict {
            cidr: "10.244.0.0/16".to_owned(),
            laptop_cidr: "10.244.0.0/16".to_owned(),
            laptop_dev: "kvpntest0".to_owned(),
            laptop_table: "100".to_owned(),
            laptop_proto: "static".to_owned(),
            handling: handling.to_owned(),
            ..Default::default()
        };
        let session = Session {
            conflicts: vec![conflict("steered"), conflict("unhandled")],
            ..Default::default()
        };
        let w = unhandled_conflicts(&session);
        assert_eq!(w.len(), 1, "{w:?}");
        for part in [
            "10.244.0.0/16",
            "kvpntest0",
            "table 100",
            "unreachable",
            "--steer ebpf",
        ] {
            assert!(w[0].contains(part), "{part}: {}", w[0]);
        }
    }
}

#[cfg(test)]
mod never_routed_tests {
    use super::{cluster_routes, never_routed_overlaps};
    use ipnet::IpNet;
    use std::net::IpAddr;

    fn nets(s: &[&str]) -> Vec<IpNet> {
        s.iter()
            .map(|c| c.parse().unwrap_or_else(|e| panic!("{c}: {e}")))
            .collect()
    }

    fn routed(routes: &[kvpn_proto::dataplane::Route], ip: &str) -> bool {
        let ip: IpAddr = ip.parse().unwrap_or_else(|e| panic!("{ip}: {e}"));
        routes.iter().any(|r| {
            r.cidr
                .parse::<IpNet>()
                .is_ok_and(|n: IpNet| n.contains(&ip))
        })
    }

    #[test]
    fn a_default_route_as_cidr_keeps_loopback_link_local_and_multicast_off_the_tunnel() {
        let all = nets(&["0.0.0.0/0", "::/0"]);
        let routes = cluster_routes(&[], &[], &all, &[]);
        for off in [
            "127.0.0.1",
            "127.0.0.153",
            "127.0.1.1",
            "169.254.169.254",
            "224.0.0.251",
            "255.255.255.255",
            "0.1.2.3",
            "::1",
            "fe80::1",
            "ff02::fb",
        ] {
            assert!(!routed(&routes, off), "{off} routed: {routes:?}");
        }
        for on in ["10.1.2.3", "1.1.1.1", "100.64.0.1", "2001:db8::1"] {
            assert!(routed(&routes, on), "{on} not routed");
        }
        let hit = never_routed_overlaps(&all);
        assert_eq!(hit.len(), 9, "{hit:?}");
        assert!(hit.contains(&"127.0.0.0/8 (loopback)".to_owned()));
    }

    #[test]
    fn ipv6_routes_are_split_off_and_named_with_their_kind() {
        let routes = cluster_routes(
            &nets(&["10.244.0.0/16", "fd00:10:244::/56"]),
            &nets(&["10.96.0.0/12"]),
            &nets(&["2001:db8::/64"]),
            &[],
        );
        let (v4, dropped) = super::split_ipv6_routes(routes);
        let cidrs: Vec<&str> = v4.iter().map(|r| r.cidr.as_str()).collect();
        assert_eq!(cidrs, ["10.244.0.0/16", "10.96.0.0/12"]);
        assert_eq!(dropped, ["fd00:10:244::/56 (pod)", "2001:db8::/64 (extra)"]);
    }

    #[test]
    fn ordinary_cluster_cidrs_are_untouched_and_not_warned_about() {
        let pod = nets(&["10.244.0.0/16"]);
        let svc = nets(&["10.96.0.0/12"]);
        let routes = cluster_routes(&pod, &svc, &[], &[]);
        let cidrs: Vec<&str> = routes.iter().map(|r| r.cidr.as_str()).collect();
        assert_eq!(cidrs, ["10.244.0.0/16", "10.96.0.0/12"]);
        assert!(never_routed_overlaps(&[pod, svc].concat()).is_empty());
    }

    fn labelled(pairs: &[(&str, &str)]) -> Vec<(IpAddr, String)> {
        pairs
            .iter()
            .map(|(ip, what)| {
                (
                    ip.parse().unwrap_or_else(|e| panic!("{ip}: {e}")),
                    (*what).to_owned(),
                )
            })
            .collect()
    }

    /// `--cidr 0.0.0.0/0` names every hole kvpn cuts into it and why: the
    /// ranges no route may take and the laptop's essentials (on main the user
    /// saw only the sub-ranges a conflict named, none of which they typed).
    #[test]
    fn a_wide_typed_cidr_names_what_kvpn_keeps_off_the_tunnel_and_why() {
        let keep = labelled(&[
            ("172.31.255.1", "the API server"),
            ("192.168.1.1", "a nameserver"),
            ("192.168.1.1", "a default gateway"),
            ("10.9.9.9", "an SSH jump host"),
            ("fd00::53", "a nameserver"),
        ]);
        let lines = super::typed_cidr_holes("--cidr", &nets(&["0.0.0.0/0"]), &keep);
        assert_eq!(lines.len(), 1, "{lines:?}");
        let line = &lines[0];
        assert!(line.starts_with("--cidr 0.0.0.0/0 is routed as "), "{line}");
        for hole in [
            "0.0.0.0/8 (\"this network\")",
            "127.0.0.0/8 (loopback)",
            "169.254.0.0/16 (link-local)",
            "224.0.0.0/4 (multicast)",
            "255.255.255.255/32 (broadcast)",
            "172.31.255.1 (the API server)",
            "192.168.1.1 (a nameserver, a default gateway)",
            "10.9.9.9 (an SSH jump host)",
        ] {
            assert!(line.contains(hole), "no {hole} in {line}");
        }
        assert!(
            !line.contains("fd00::53"),
            "an IPv6 address is no hole in IPv4: {line}"
        );
        assert!(
            line.ends_with("off the tunnel — the laptop needs them itself"),
            "{line}"
        );
        // The count is the number of ranges actually installed.
        let routes = super::cluster_routes(
            &[],
            &[],
            &nets(&["0.0.0.0/0"]),
            &keep.iter().map(|(ip, _)| *ip).collect::<Vec<_>>(),
        );
        assert!(
            line.contains(&format!("is routed as {} smaller ranges", routes.len())),
            "{line} vs {} routes",
            routes.len()
        );
    }

    /// The root daemon's refusal names pieces of a split `--cidr 0.0.0.0/0`; the
    /// hint says whose pieces they are and the two ways out. A refusal of a
    /// range the user typed whole gets no hint (it names the user's own words).
    #[test]
    fn a_refused_piece_of_a_split_typed_cidr_is_traced_back_to_it() {
        let refusal = "connect failed at step \"check route conflicts\": extra CIDR \
             172.31.255.0/32 overlaps 172.31.255.0/30 dev eth0 (proto kernel, table main); \
             extra CIDR 172.31.255.2/31 overlaps 172.31.255.0/30 dev eth0 (proto kernel, table \
             main) — the laptop already routes these addresses elsewhere";
        let all: IpNet = "0.0.0.0/0".parse().expect("cidr");
        let manager: IpAddr = "172.31.255.1".parse().expect("ip");
        let hint =
            super::split_refusal_hint(refusal, &[("--cidr", all)], &[manager]).expect("a hint");
        let pieces = cluster_routes(&[], &[], &[all], &[manager]).len();
        assert_eq!(
            hint,
            format!(
                "the refused ranges 172.31.255.0/32, 172.31.255.2/31 are parts of --cidr \
                 0.0.0.0/0, which kvpn routes as {pieces} smaller ranges around the addresses \
                 it keeps off the tunnel; 0.0.0.0/0 covers routes this laptop already has \
                 (below) — give narrower --cidr ranges that leave the laptop's own subnets \
                 out, or pass --allow-route-conflict to keep the laptop's routes and send the \
                 rest of 0.0.0.0/0 through the tunnel"
            )
        );
        let whole: IpNet = "172.31.255.0/30".parse().expect("cidr");
        assert_eq!(
            super::split_refusal_hint(
                "extra CIDR 172.31.255.0/30 overlaps 172.31.255.0/30 dev eth0",
                &[("--cidr", whole)],
                &[]
            ),
            None
        );
        // Another range's refusal is not blamed on the typed one.
        assert_eq!(
            super::split_refusal_hint(
                "pod CIDR 10.244.0.0/16 overlaps 10.244.0.0/16 dev br0",
                &[("--cidr", all)],
                &[manager]
            ),
            None
        );
    }

    #[test]
    fn typed_cidrs_routed_whole_are_not_mentioned_and_one_inside_a_never_routed_range_is() {
        let keep = labelled(&[("172.31.255.1", "the API server")]);
        assert!(
            super::typed_cidr_holes("--pod-cidr", &nets(&["10.244.0.0/16", "fd00::/64"]), &keep)
                .is_empty()
        );
        assert_eq!(
            super::typed_cidr_holes("--cidr", &nets(&["127.0.0.0/24"]), &keep),
            [
                "--cidr 127.0.0.0/24 is not routed at all: kvpn keeps 127.0.0.0/8 (loopback) off \
              the tunnel — the laptop needs them itself"
            ]
        );
        assert_eq!(
            super::typed_cidr_holes("--service-cidr", &nets(&["172.31.255.0/31"]), &keep),
            [
                "--service-cidr 172.31.255.0/31 is routed as 172.31.255.0/32: kvpn keeps \
              172.31.255.1 (the API server) off the tunnel — the laptop needs them itself"
            ]
        );
    }
}
