//! kvpn CLI and user daemon.
//!
//! Owns flag parsing ([`cli`]), everything printed for the user ([`output`]),
//! the client side of the root daemon's gRPC API ([`daemon`]) and the user
//! daemon ([`userd`]: client and server), including starting both daemons on
//! demand. The CLI's I/O is the two daemons' Unix sockets, spawning them and
//! reading their logs; the Kubernetes and SSH I/O lives in the modules named
//! after them.
//! [`fuzzing`]: entry points of the cargo-fuzz targets and the corpus replay
//! (SSH config, known_hosts, CIDRs, kubeconfig, manager messages).

// The status JSON of a session (output.rs) is one `serde_json::json!` literal
// deeper than the macro's default recursion limit of 128.
#![recursion_limit = "256"]

pub mod agent;
pub mod attach;
pub mod cidr;
pub mod cli;
pub mod connect;
pub mod daemon;
pub mod daemon_channel;
pub mod diagnose;
pub mod fuzzing;
pub mod install;
pub mod kubeconfig;
pub mod lab;
pub mod lease;
pub mod liveness;
pub mod output;
pub mod quit_every;
pub mod replica;
pub mod route_watch;
pub mod run;
pub mod settings;
pub mod socks;
pub mod ssh;
pub mod top;
pub mod userd;
pub mod version;

use anyhow::{Context, Result, bail};
use kvpn_proto::dataplane::{ConnectRequest, DisconnectRequest};

use crate::cli::{Cli, Command, ConnectArgs, DisconnectArgs, LogsArgs, StatusArgs};

/// Set up `tracing` on stderr; `verbose` 0 = warnings, 1 = debug, 2+ = trace.
pub fn init_tracing(verbose: u8) {
    // kube_client logs every failed request at ERROR, also the ones kvpn expects
    // and reports itself (readiness polls, forbidden probes): keep it quiet unless asked.
    let default = match verbose {
        0 => "warn,kube_client=off",
        1 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVPN_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// Run one CLI command.
pub async fn run(cli: Cli) -> Result<()> {
    let runtime_dir = cli.runtime_dir();
    match cli.command {
        Command::Connect(args) => connect(&runtime_dir, *args).await,
        // Ends with the command's exit status, after the session is gone.
        // kvpn's own failures exit 125, told apart from the command's 1.
        Command::Run(args) => {
            let code = match run::run(&runtime_dir, *args).await {
                Ok(code) => code,
                Err(e) => {
                    output::error(&output::error_chain(&e));
                    run::EXIT_RUN_FAILED
                }
            };
            std::process::exit(code)
        }
        Command::Status(args) => status(&runtime_dir, args).await,
        Command::Disconnect(args) => disconnect(&runtime_dir, args).await,
        Command::Top(args) => top::run(&runtime_dir, args).await,
        Command::Quit(args) if args.every_runtime_dir => quit_every::quit_every(&runtime_dir).await,
        Command::Quit(_) => quit(&runtime_dir).await,
        Command::Install(args) => install_command(*args).await,
        Command::Version(args) => version::run(&runtime_dir, args).await,
        Command::Uninstall(args) => uninstall(&runtime_dir, args).await,
        Command::Logs(args) => logs(&runtime_dir, args).await,
        Command::Daemon => userd::server::run(runtime_dir.clone()).await,
        Command::Lab(args) => lab::run(args),
        Command::Attach(args) => attach_command(*args).await,
        Command::Detach(args) => detach_command(args).await,
        Command::Diagnose(crate::cli::DiagnoseCommand::Source(args)) => {
            diagnose_source(&runtime_dir, args).await
        }
        // Both end with the remote side's exit code, after their own cleanup
        // (terminal restored, tunnel closed, SSH disconnected).
        Command::Ssh(args) => {
            let code = ssh::session::run(args).await?;
            std::process::exit(code)
        }
        Command::SshPeer(args) => std::process::exit(ssh::peer::run(args).await),
    }
}

async fn connect(runtime_dir: &std::path::Path, args: ConnectArgs) -> Result<()> {
    // A stopped root daemon keeps its socket: without this check the connect
    // did the kubeconfig, API server and CIDR work, then timed out on its first call.
    if !args.socks {
        liveness::check_before_connect(&daemon::pid_path(runtime_dir))
            .map_err(anyhow::Error::msg)?;
        // Another user's root daemon refuses this uid: say so before the
        // cluster is touched (no manager install, no lease).
        if let Some(why) = daemon::refusal(runtime_dir).await {
            bail!(
                "cannot connect: {why} (nothing was changed in the cluster; `kvpn connect \
                 --socks` needs no root daemon)"
            );
        }
    }
    // One connect at a time per user daemon, held to the end (also by an exit on
    // Ctrl-C: the kernel drops it): two connects started together both found no
    // session, both set one up, and the second failed with "add route … File
    // exists". The second now waits and finds the first one's session.
    let _connect_lock = userd::connect_lock::ConnectLock::for_connect(runtime_dir).await?;
    let Some(manager) = args.manager.clone() else {
        return connect::kube_connect(runtime_dir, &args).await;
    };
    let tunnel_ip = args.tunnel_ip();
    validate_tunnel_ip(tunnel_ip)?;
    // Never route the manager's own address into the tunnel that leads to it (rt-02):
    // the session could never come up.
    let keep_out: Vec<std::net::IpAddr> = manager_ip(&manager).into_iter().collect();
    let labelled: Vec<(std::net::IpAddr, String)> = keep_out
        .iter()
        .map(|ip| (*ip, "the traffic manager".to_owned()))
        .collect();
    connect::warn_typed_cidr_holes(&args, &labelled);
    let routes = connect::cluster_routes_avoiding(
        &args.pod_cidrs,
        &args.service_cidrs,
        &args.extra_cidrs,
        &keep_out,
        &args.never_proxy,
    );
    let routes = connect::ipv4_only_if_ipv6_off(routes);
    if routes.is_empty() {
        bail!(
            "nothing to route: give at least one of --pod-cidr, --service-cidr or --cidr \
             (e.g. --pod-cidr 10.244.0.0/16 --service-cidr 10.96.0.0/12)"
        );
    }
    // Dual stack without a lease: the IPv6 tunnel IP the manager derives from
    // the IPv4 one (kvpn_proto::tunnel), when IPv6 ranges are routed.
    let tunnel_ip_v6 = match tunnel_ip {
        std::net::IpAddr::V4(v4) if connect::has_ipv6_route(&routes) => {
            Some(kvpn_proto::tunnel::ipv6_tunnel_ip(v4))
        }
        _ => None,
    };
    let mut client = daemon::connect_or_start_announced(runtime_dir).await?;
    output::step(&format!(
        "Connecting to traffic manager at {} (tunnel IP {})",
        manager, tunnel_ip
    ));
    if args.hosts {
        output::warn(
            "--hosts needs the route watch of a port-forward session; a --manager session writes no hosts-file entries",
        );
    }
    // Ctrl-C from here on rolls back what was made (docs/root-daemon.md: a Connect is all
    // or nothing), as in kube mode: this process waits for Connect's answer
    // (bounded) and disconnects the session; the root daemon tears down a
    // Connect whose caller went away before it answered.
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .context("cannot watch SIGINT")?;
    let mut connect_client = client.clone();
    let connect = connect_client.connect(ConnectRequest {
        manager: manager.clone(),
        routes: routes.clone(),
        tunnel_ip: tunnel_ip.to_string(),
        tunnel_ip_v6: tunnel_ip_v6.map(|a| a.to_string()).unwrap_or_default(),
        tun_name: args.tun_name.clone().unwrap_or_default(),
        mtu: args.mtu.unwrap_or(0),
        origin: Some(kvpn_proto::dataplane::Origin {
            transport: connect::TRANSPORT_DIRECT.to_owned(),
            ..Default::default()
        }),
        // Direct mode talks to a manager without a certificate (static lab).
        tls_ca_pem: String::new(),
        tls_server_name: String::new(),
        session_token: String::new(),
        // Direct mode knows no Kubernetes API to ask for the cluster DNS.
        dns: None,
        // Without the route watch there are no Services to write.
        hosts_file: false,
        allow_route_conflict: args.allow_route_conflict,
        steer_ebpf: args.steer() == cli::Steer::Ebpf,
        workers: args.workers,
        run_scope: false,
    });
    let resp = match connect::setup_or_interrupt(connect, &mut interrupt).await {
        connect::Setup::Done(r) => r
            .map_err(daemon::status_to_error)
            .map_err(|e| connect::with_split_refusal_hint(e, &args, &keep_out))
            .context("connect failed")?,
        connect::Setup::Interrupted(None) => {
            connect::interrupted(connect::Interrupted::Pending("root daemon")).await
        }
        connect::Setup::Interrupted(Some(resp)) => {
            connect::interrupted(connect::Interrupted::Root(&mut client, &resp.session_id)).await
        }
    };
    let connected_line = format!(
        "Connected: session {} on TUN device {} (ifindex {})",
        resp.session_id, resp.tun_name, resp.tun_ifindex
    );
    tokio::select! {
        r = connect::report_connected(&mut connect_client, &resp.session_id, &connected_line) => r?,
        _ = interrupt.recv() => {
            connect::interrupted(connect::Interrupted::Root(&mut client, &resp.session_id)).await
        }
    }
    for r in &routes {
        output::detail(&format!("route {} ({})", r.cidr, output::kind_name(r.kind)));
    }
    if connect::interrupt_pending(&mut interrupt).await {
        connect::interrupted(connect::Interrupted::Root(&mut client, &resp.session_id)).await
    }
    Ok(())
}

/// The manager's IP when `HOST:PORT` names an address (not a DNS name).
fn manager_ip(addr: &str) -> Option<std::net::IpAddr> {
    addr.parse::<std::net::SocketAddr>().ok().map(|a| a.ip())
}

/// A tunnel IP must be a unicast address the laptop can own on the TUN device.
fn validate_tunnel_ip(ip: std::net::IpAddr) -> Result<()> {
    let bad = ip.is_loopback()
        || ip.is_unspecified()
        || ip.is_multicast()
        || matches!(ip, std::net::IpAddr::V4(v4) if v4.is_broadcast() || v4.is_link_local());
    if bad {
        bail!(
            "--tunnel-ip {ip} is not a usable unicast address (loopback, unspecified, \
             multicast, broadcast and link-local are not) — pick one from the manager's \
             tunnel pool, e.g. 100.96.0.2"
        );
    }
    Ok(())
}

async fn status(runtime_dir: &std::path::Path, args: StatusArgs) -> Result<()> {
    // The user daemon merges its sessions with the root daemon's; after a crash
    // this starts it again, and it brings its sessions back (or reports them lost).
    let (root, rows) = match userd::connect_if_needed(runtime_dir).await? {
        Some(mut user) => {
            let st = user
                .status(kvpn_proto::userd::StatusRequest {})
                .await
                .map_err(daemon::status_to_error)
                .context("status failed")?
                .into_inner();
            // Not answering this uid may be a refusal (another user's root
            // daemon): that daemon is healthy and its DNS is fine.
            let refuses_me = if st.root_running {
                None
            } else {
                daemon::refusal(runtime_dir).await
            };
            (
                output::RootDaemon {
                    running: st.root_running,
                    refused_peers: st.root_running.then_some(st.root_refused_peers),
                    not_answering: (!st.root_running && refuses_me.is_none())
                        .then(|| root_not_answering(runtime_dir))
                        .flatten(),
                    refuses_me,
                },
                output::merge_sessions(st.root_sessions, st.user_sessions),
            )
        }
        None => match root_status_direct(runtime_dir).await? {
            DirectStatus::Answered(root, sessions) => {
                (root, output::merge_sessions(sessions, Vec::new()))
            }
            DirectStatus::Other(root) => (root, Vec::new()),
        },
    };
    let root_running = root.running || root.refuses_me.is_some();
    if !root_running && root.not_answering.is_none() && rows.is_empty() {
        output::not_running(runtime_dir, args.output);
        return Ok(());
    }
    output::status(&rows, root.clone(), args.output, runtime_dir)?;
    if !root_running {
        output::warn_dns_left_changed(runtime_dir, root.not_answering);
    }
    Ok(())
}

/// The root daemon's process when it did not answer: its pid and /proc state
/// when it still runs (stopped, hung), `None` when it is gone.
fn root_not_answering(runtime_dir: &std::path::Path) -> Option<(i32, char)> {
    match liveness::probe(&daemon::pid_path(runtime_dir), None) {
        liveness::Liveness::NotAnswering { pid, state } => Some((pid, state)),
        liveness::Liveness::Gone => None,
    }
}

/// `kvpn status` without a user daemon: the root daemon's own answer.
enum DirectStatus {
    /// It answered, with its sessions.
    Answered(output::RootDaemon, Vec<kvpn_proto::dataplane::Session>),
    /// It did not: gone, or its process runs and does not answer.
    Other(output::RootDaemon),
}

async fn root_status_direct(runtime_dir: &std::path::Path) -> Result<DirectStatus> {
    let silent = |not_answering| {
        DirectStatus::Other(output::RootDaemon {
            running: false,
            refused_peers: None,
            not_answering,
            refuses_me: None,
        })
    };
    if let Some(why) = daemon::refusal(runtime_dir).await {
        return Ok(DirectStatus::Other(output::RootDaemon {
            running: false,
            refused_peers: None,
            not_answering: None,
            refuses_me: Some(why),
        }));
    }
    // A stopped root daemon answers nothing: say so now, not after the
    // channel's keep-alive gave up (6 s).
    let before = root_not_answering(runtime_dir);
    if before.is_some_and(|(_, state)| matches!(state, 'T' | 't')) {
        return Ok(silent(before));
    }
    let Some(mut client) = daemon::connect_existing(runtime_dir).await? else {
        return Ok(silent(root_not_answering(runtime_dir)));
    };
    match client.status(kvpn_proto::dataplane::StatusRequest {}).await {
        Ok(st) => {
            let st = st.into_inner();
            Ok(DirectStatus::Answered(
                output::RootDaemon {
                    running: true,
                    refused_peers: Some(st.refused_peers),
                    not_answering: None,
                    refuses_me: None,
                },
                st.sessions,
            ))
        }
        Err(e) => match root_not_answering(runtime_dir) {
            // Stopped or hung while we asked: its sessions are still there.
            Some(p) => Ok(silent(Some(p))),
            None => Err(daemon::status_to_error(e)).context("status failed"),
        },
    }
}

async fn disconnect(runtime_dir: &std::path::Path, args: DisconnectArgs) -> Result<()> {
    let plain = !args.all && args.id.is_none();
    let session_id = if args.all {
        String::new()
    } else {
        args.id.unwrap_or_default()
    };
    let direct = direct_sessions(runtime_dir).await;
    let mut left_runs = Vec::new();
    let (stopped, tcp_reset) = if let Some(mut user) = userd::connect_if_needed(runtime_dir).await?
    {
        // A plain disconnect ends the connect sessions, not `kvpn run`
        // sessions: those end with their command (or by id, or --all).
        // When the sessions cannot be listed (a daemon in trouble), the plain
        // disconnect stops everything, as it always did.
        let listed = if plain {
            match user.status(kvpn_proto::userd::StatusRequest {}).await {
                Ok(r) => Some(r.into_inner()),
                Err(e) => {
                    tracing::warn!(error = %e.message(), "cannot list the sessions: disconnecting all, run sessions too");
                    None
                }
            }
        } else {
            None
        };
        let plan = if let Some(status) = listed {
            let user_ids: Vec<String> = status.user_sessions.iter().map(|s| s.id.clone()).collect();
            let root: Vec<(String, bool)> = status
                .root_sessions
                .iter()
                .map(|s| (s.id.clone(), !s.run_cgroup.is_empty()))
                .collect();
            left_runs = status
                .root_sessions
                .into_iter()
                .filter(|s| !s.run_cgroup.is_empty())
                .collect();
            plain_disconnect_plan(&user_ids, &root)
        } else {
            None
        };
        match plan {
            None => {
                let r = user
                    .disconnect(kvpn_proto::userd::DisconnectRequest { session_id })
                    .await
                    .map_err(daemon::status_to_error)
                    .context("disconnect failed")?
                    .into_inner();
                (r.stopped, r.tcp_reset)
            }
            Some(ids) => {
                let mut stopped = Vec::new();
                let mut tcp_reset = std::collections::HashMap::new();
                let mut failed = Vec::new();
                for id in ids {
                    match user
                        .disconnect(kvpn_proto::userd::DisconnectRequest {
                            session_id: id.clone(),
                        })
                        .await
                    {
                        Ok(r) => {
                            let r = r.into_inner();
                            stopped.extend(r.stopped);
                            tcp_reset.extend(r.tcp_reset);
                        }
                        // The others still go; the command fails at the end.
                        Err(e) => failed.push(format!("{id}: {}", e.message())),
                    }
                }
                if !failed.is_empty() {
                    for id in &stopped {
                        output::done(&format!("Disconnected session {id}"));
                    }
                    bail!("disconnect failed for {}", failed.join("; "));
                }
                (stopped, tcp_reset)
            }
        }
    } else {
        let Some(mut client) = daemon::connect_existing(runtime_dir).await? else {
            repair_after_dead_root(runtime_dir)?;
            output::done("Not connected: the root daemon is not running, nothing to disconnect");
            return Ok(());
        };
        let r = client
            .disconnect(DisconnectRequest { session_id })
            .await
            .map_err(daemon::status_to_error)
            .context("disconnect failed")?
            .into_inner();
        (r.stopped, r.tcp_reset)
    };
    // A session whose root daemon was killed: the user daemon only stopped its
    // port-forward; resolv.conf and the routes are repaired here, as by quit.
    let root_gone = daemon::connect_existing(runtime_dir).await?.is_none();
    if root_gone {
        repair_after_dead_root(runtime_dir)?;
    }
    if stopped.is_empty() {
        if left_runs.is_empty() {
            output::done("No session to disconnect");
        } else {
            output::done("No connect session to disconnect");
        }
    }
    for id in stopped {
        let reset = tcp_reset_text(tcp_reset.get(&id).copied().unwrap_or(0));
        if id.starts_with(socks::ID_PREFIX) {
            output::done(&format!(
                "Disconnected SOCKS session {id}: proxy, data channel and port-forward stopped"
            ));
        } else if root_gone {
            output::done(&format!(
                "Disconnected session {id}: port-forward stopped (its TUN device went with the \
                 root daemon that died)"
            ));
        } else if direct.contains(&id) {
            output::done(&format!(
                "Disconnected session {id}: TUN device, routes and eBPF classifier removed{reset}"
            ));
        } else {
            output::done(&format!(
                "Disconnected session {id}: TUN device, routes, eBPF classifier and port-forward \
                 removed{reset}"
            ));
        }
    }
    for s in &left_runs {
        output::done(&left_run_line(s));
    }
    Ok(())
}

/// What a plain `kvpn disconnect` (no id, no --all) stops, given the user
/// daemon's session ids and the root daemon's (id, whether a `kvpn run`
/// session): `None` when there is no run session (stop everything, as one
/// call), else every other session's id (pure).
fn plain_disconnect_plan(user_ids: &[String], root: &[(String, bool)]) -> Option<Vec<String>> {
    let runs: Vec<&String> = root
        .iter()
        .filter(|(_, run)| *run)
        .map(|(id, _)| id)
        .collect();
    if runs.is_empty() {
        return None;
    }
    let mut ids: Vec<String> = user_ids
        .iter()
        .chain(root.iter().map(|(id, _)| id))
        .filter(|id| !runs.contains(id))
        .cloned()
        .collect();
    ids.sort();
    ids.dedup();
    Some(ids)
}

/// The line of a plain disconnect about a `kvpn run` session it left running.
fn left_run_line(s: &kvpn_proto::dataplane::Session) -> String {
    let id = &s.id;
    let cluster = s
        .origin
        .as_ref()
        .map(|o| o.context.as_str())
        .filter(|c| !c.is_empty())
        .map(|c| format!(" (context {c})"))
        .unwrap_or_default();
    format!(
        "Left `kvpn run` session {id}{cluster} running: it ends when its command exits; \
         `kvpn disconnect {id}` ends it now (its command gets SIGTERM), `kvpn disconnect --all` \
         ends every session"
    )
}

/// The ids of the root daemon's direct sessions (`--manager`: no
/// port-forward), for the disconnect output; empty when it does not answer
/// within a second.
async fn direct_sessions(runtime_dir: &std::path::Path) -> std::collections::HashSet<String> {
    let ask = async {
        let mut client = daemon::connect_existing(runtime_dir).await.ok()??;
        daemon::sessions(&mut client, "status before disconnect")
            .await
            .ok()
    };
    match tokio::time::timeout(std::time::Duration::from_secs(1), ask).await {
        Ok(Some(sessions)) => sessions
            .into_iter()
            .filter(|s| s.origin.as_ref().is_some_and(|o| o.transport == "direct"))
            .map(|s| s.id)
            .collect(),
        _ => Default::default(),
    }
}

/// The disconnect output's note on `n` laptop TCP connections the root daemon
/// reset through a session (empty for none).
fn tcp_reset_text(n: u64) -> String {
    if n == 0 {
        return String::new();
    }
    format!("; reset {} through the session", output::tcp_connections(n))
}

/// With no root daemon answering: undo what a killed one left
/// ([`daemon::repair_leftovers`]) and say so when there was something.
fn repair_after_dead_root(runtime_dir: &std::path::Path) -> Result<()> {
    let Some(repaired) = daemon::repair_leftovers(runtime_dir)? else {
        return Ok(());
    };
    if repaired.dns {
        output::done(
            "The root daemon had died with this machine's DNS pointing at it: resolv.conf \
             restored and kvpn's routes removed",
        );
    }
    if repaired.tcp_reset > 0 {
        output::done(&format!(
            "Reset {} the dead root daemon's sessions left: their applications get \
             ECONNABORTED now instead of hanging",
            output::tcp_connections(repaired.tcp_reset)
        ));
    }
    Ok(())
}

/// `kvpn logs`: the last lines of both daemons' logs, then (`--follow`) what
/// they append, polled.
async fn logs(runtime_dir: &std::path::Path, args: LogsArgs) -> Result<()> {
    let logs = [
        ("user daemon", userd::Paths::current(runtime_dir).log),
        ("root daemon", runtime_dir.join("dataplane.log")),
    ];
    let mut offsets = [0u64; 2];
    for (i, (what, path)) in logs.iter().enumerate() {
        match std::fs::read(path) {
            Ok(bytes) => {
                offsets[i] = bytes.len() as u64;
                let text = String::from_utf8_lossy(&bytes);
                let lines: Vec<&str> = text.lines().collect();
                let from = if args.lines == 0 {
                    0
                } else {
                    lines.len().saturating_sub(args.lines)
                };
                output::info_block(&format!("==> {what} log {} <==", path.display()));
                if from < lines.len() {
                    output::info_block(&lines[from..].join("\n"));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => output::info_block(&format!(
                "==> {what} log {}: none yet (the daemon has not run) <==",
                path.display()
            )),
            Err(e) => output::warn(&format!("cannot read {}: {e}", path.display())),
        }
    }
    if !args.follow {
        return Ok(());
    }
    loop {
        for (i, (_, path)) in logs.iter().enumerate() {
            let Ok(bytes) = std::fs::read(path) else {
                continue;
            };
            let len = bytes.len() as u64;
            if len < offsets[i] {
                // Truncated or replaced: start over.
                offsets[i] = 0;
            }
            if len > offsets[i] {
                let start = usize::try_from(offsets[i]).unwrap_or(0);
                let new = String::from_utf8_lossy(&bytes[start..]);
                let tag = if i == 0 { "user" } else { "root" };
                for line in new.lines() {
                    output::info_block(&format!("[{tag}] {line}"));
                }
                offsets[i] = len;
            }
        }
        tokio::select! {
            () = tokio::time::sleep(std::time::Duration::from_millis(250)) => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
    }
}

async fn diagnose_source(
    runtime_dir: &std::path::Path,
    args: crate::cli::DiagnoseSourceArgs,
) -> Result<()> {
    // First, so that "not connected" comes at once, before the cluster is asked.
    let sessions = connect::current_sessions(runtime_dir).await?;
    diagnose::require_session(&sessions)?;
    let target_text = args.target.clone();
    // A thread of its own, not spawn_blocking: the runtime waits for blocking
    // tasks when it shuts down, so a resolver retrying a silent nameserver kept
    // the command for 18 s after it had said "no answer within 5 s" (trial T6).
    let (tx, resolving) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let _ = tx.send(diagnose::resolve(&target_text));
    });
    let target = match tokio::time::timeout(diagnose::RESOLVE_WAIT, resolving).await {
        Ok(joined) => match joined.context("resolver thread failed")? {
            Ok(t) => t,
            // An IP:PORT or a malformed target: the resolver's own words.
            Err(e)
                if args.target.parse::<std::net::SocketAddr>().is_ok()
                    || !args.target.contains(':') =>
            {
                return Err(e.context(format!("cannot trace the source towards {}", args.target)));
            }
            Err(e) => bail!(diagnose::unresolved_message(
                &args.target,
                &sessions,
                Some(&format!("{:#}", e.root_cause()))
            )),
        },
        Err(_) => bail!(diagnose::unresolved_message(&args.target, &sessions, None)),
    };
    diagnose::require_route(&sessions, target.ip())?;
    // The cluster of the session that carries the trace, as it was connected
    // (its kubeconfig files and context), unless the flags say otherwise.
    let session = connect::session_routing(&sessions, &ipnet::IpNet::from(target.ip()))
        .map(|(s, _)| s.id.clone());
    let user_session = match (
        &session,
        userd::connect_existing(&userd::Paths::current(runtime_dir)).await?,
    ) {
        (Some(id), Some(mut user)) => user
            .status(kvpn_proto::userd::StatusRequest {})
            .await
            .map_err(daemon::status_to_error)
            .context("cannot ask the user daemon for the session's kubeconfig")?
            .into_inner()
            .user_sessions
            .into_iter()
            .find(|u| &u.id == id),
        _ => None,
    };
    let env = kubeconfig::UserEnv::current().context("cannot read this process's environment")?;
    let (flags, env) = diagnose::session_kube(args.kube.flags(), env, user_session.as_ref());
    let plan = ssh::plan_for(&args.kube.ssh, &env)?;
    let (conn, _tunnel) = ssh::connect_kube(&flags, plan.as_ref(), &env).await?;
    // The session's manager is the one that sees the probe: its namespace
    // unless another one is asked for.
    let manager_namespace = user_session
        .as_ref()
        .and_then(|u| u.origin.as_ref())
        .map(|o| o.manager_namespace.clone())
        .filter(|n| !n.is_empty() && args.kube.manager_namespace == cidr::DEFAULT_NAMESPACE)
        .unwrap_or_else(|| args.kube.manager_namespace.clone());
    let report = diagnose::source(
        &conn.client,
        &manager_namespace,
        target,
        args.udp,
        &sessions,
    )
    .await
    .with_context(|| format!("cannot trace the source towards {}", args.target))?;
    output::diagnose_source(&report, args.output)
}

/// `kvpn install`: with --dry-run, print the objects (no cluster); otherwise
/// install or upgrade the manager as connect's first step does, and stop there.
/// The cluster of `kube`'s flags (through SSH jump hosts if given).
async fn kube_connection(
    kube: &crate::cli::KubeArgs,
) -> Result<(kubeconfig::KubeConnection, Option<ssh::SshTunnel>)> {
    let env = kubeconfig::UserEnv::current().context("cannot read this process's environment")?;
    let plan = ssh::plan_for(&kube.ssh, &env)?;
    ssh::connect_kube(&kube.flags(), plan.as_ref(), &env).await
}

async fn attach_check(check: crate::cli::AttachCheck) -> Result<()> {
    match check {
        crate::cli::AttachCheck::Leak(a) => {
            let (conn, _tunnel) = kube_connection(&a.kube).await?;
            let namespace = conn.description.namespace.clone();
            let r = attach::check::leak(
                &conn.client,
                &a.workload,
                &namespace,
                &a.kube.manager_namespace,
            )
            .await?;
            output::attach_leak(&r, a.output)
        }
        crate::cli::AttachCheck::Sessions(a) => {
            let (conn, _tunnel) = kube_connection(&a.kube).await?;
            let namespace = conn.description.namespace.clone();
            let r = attach::check::sessions(
                &conn.client,
                &a.workload,
                &namespace,
                &a.kube.manager_namespace,
            )
            .await?;
            output::attach_sessions(&r, a.output)
        }
    }
}

async fn attach_command(args: crate::cli::AttachArgs) -> Result<()> {
    if let Some(crate::cli::AttachCommand::Check(check)) = args.command {
        return attach_check(check).await;
    }
    let (conn, _tunnel) = kube_connection(&args.kube).await?;
    let namespace = conn.description.namespace.clone();
    if args.list {
        let replicas =
            attach::replicas(&conn.client, &namespace, &args.kube.manager_namespace).await?;
        return output::attached_replicas(&replicas, args.output);
    }
    let Some(w) = args.workload else {
        anyhow::bail!("name the workload to attach: kvpn attach deploy/NAME");
    };
    let done = attach::attach(
        &conn.client,
        &w,
        &namespace,
        &args.kube.manager_namespace,
        args.via,
    )
    .await?;
    if done.via == attach::render::Via::Gateway {
        output::done(&format!(
            "Attached {w} in namespace {namespace} through the manager's gateway: init container {} ({})",
            attach::render::GATEWAY_CONTAINER,
            done.image
        ));
        output::detail(&format!("Sidecar: {}", done.why));
        output::detail(
            "Laptops see one source for every replica: the manager's tunnel address; remove it with `kvpn detach`",
        );
        return Ok(());
    }
    output::done(&format!(
        "Attached {w} in namespace {namespace}: tunnel container {} ({}), Secret {}",
        attach::render::CONTAINER,
        done.image,
        done.secret
    ));
    output::detail(&format!("Sidecar: {}", done.why));
    output::detail(match done.method {
        attach::render::WriteMethod::Apply => {
            "Written by server-side apply (field manager kvpn-attach)"
        }
        attach::render::WriteMethod::StrategicMerge => {
            "Written by a strategic merge patch with $setElementOrder (field manager kvpn-attach): before 1.23, server-side apply appends new list items, which would put the tunnel container last"
        }
    });
    output::detail(
        "The pods restart with the tunnel; list them with `kvpn attach --list`, remove it with `kvpn detach`",
    );
    Ok(())
}

async fn detach_command(args: crate::cli::DetachArgs) -> Result<()> {
    let (conn, _tunnel) = kube_connection(&args.kube).await?;
    let namespace = conn.description.namespace.clone();
    attach::detach(&conn.client, &args.workload, &namespace).await?;
    output::done(&format!(
        "Detached {} in namespace {namespace}: what kvpn attach added is removed",
        args.workload
    ));
    Ok(())
}

async fn install_command(args: crate::cli::InstallArgs) -> Result<()> {
    let env = kubeconfig::UserEnv::current().context("cannot read this process's environment")?;
    let mut opts = install::InstallOptions {
        namespace: args.manager_namespace.clone(),
        source_policy: args.source_policy.unwrap_or_default(),
        keep_installed_policy: args.source_policy.is_none(),
        replicas: args.replicas,
        ..install::InstallOptions::default()
    };
    let env_image = std::env::var(settings::IMAGE_ENV).ok();
    let flags = settings::ImageFlags {
        image: args.image.as_deref(),
        pull_secrets: &args.image_pull_secrets,
        pull_policy: args.image_pull_policy.as_deref(),
        env_image: env_image.as_deref(),
    };
    let acting = kubeconfig::ActingUser::detect(&env)?;
    let settings_file = kubeconfig::config_dir(&env, &acting).map(|d| d.join(settings::FILE_NAME));
    let loaded = match &settings_file {
        Some(f) => settings::load(f)?,
        None => settings::Settings::default(),
    };
    let apply_choice = |opts: &mut install::InstallOptions, context: &str| -> Result<()> {
        let choice = settings::choose(
            &flags,
            &loaded,
            settings_file
                .as_deref()
                .unwrap_or(std::path::Path::new(settings::FILE_NAME)),
            context,
        );
        if let Some(image) = &choice.image {
            install::image::validate(&image.value)
                .with_context(|| format!("the manager image from {}", image.origin))?;
            opts.image = image.value.clone();
        }
        opts.keep_installed_image = choice.image.is_none();
        opts.keep_installed_pull_secrets = choice.pull_secrets.is_none();
        opts.image_pull_secrets = choice.pull_secrets.map(|c| c.value).unwrap_or_default();
        opts.keep_installed_pull_policy = choice.pull_policy.is_none();
        opts.image_pull_policy = choice.pull_policy.map(|c| c.value);
        Ok(())
    };
    if args.dry_run {
        apply_choice(&mut opts, args.context.as_deref().unwrap_or_default())?;
        let objects = install::manifests(&opts)?;
        return output::manifests(&objects, args.output);
    }
    let kube = args.kube();
    let plan = ssh::plan_for(&kube.ssh, &env)?;
    let (conn, _tunnel) = ssh::connect_kube(&kube.flags(), plan.as_ref(), &env).await?;
    output::done(&format!("Using {}", conn.description));
    apply_choice(&mut opts, &conn.description.context)?;
    let info = install::ensure_manager(&conn.client, &opts, &connect::print_progress)
        .await
        .context("the traffic manager is not ready")?;
    output::done(&format!(
        "Traffic manager v{} ({}) ready in {}: connect with `kvpn connect`",
        info.version, info.image, info.namespace
    ));
    Ok(())
}

async fn uninstall(runtime_dir: &std::path::Path, args: crate::cli::UninstallArgs) -> Result<()> {
    let env = kubeconfig::UserEnv::current().context("cannot read this process's environment")?;
    let kube = args.kube();
    let plan = ssh::plan_for(&kube.ssh, &env)?;
    if let Some(p) = &plan {
        output::step(&format!(
            "Opening the SSH path to the API server: {}",
            p.describe()
        ));
    }
    let (conn, _tunnel) = ssh::connect_kube(&kube.flags(), plan.as_ref(), &env).await?;
    output::done(&format!("Using {}", conn.description));
    // Other laptops connected through this manager lose their sessions for good
    // (a new manager has a new CA and no leases): say who, and ask for --force.
    let own = lease::existing_client_id(
        &env,
        &conn.target.acting,
        &conn.description.server,
        &conn.description.cluster,
    );
    let now_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    match lease::live_leases(&conn.client, &kube.manager_namespace, now_s, own.as_deref()).await {
        Ok(others) if !others.is_empty() => {
            let list: Vec<String> = others.iter().map(|l| l.describe(now_s)).collect();
            let what = format!(
                "{} other client(s) hold live leases on the traffic manager in {} (connected \
                 now, or within the manager's lease time): {} — removing the manager \
                 drops their sessions until a manager is back; each of them then sees the \
                 new manager's certificate and reconnects on its own",
                others.len(),
                kube.manager_namespace,
                list.join(", ")
            );
            if !args.force {
                bail!("{what}. Rerun with --force to remove it anyway");
            }
            output::warn(&format!("{what} (--force given: removing it)"));
        }
        Ok(_) => {}
        Err(e) => output::warn(&format!(
            "cannot tell whether other laptops use this traffic manager: {e:#} — removing it anyway"
        )),
    }
    // This laptop's sessions through the manager being removed would only hang in
    // "reconnecting": end them first, and say so.
    for id in connect::disconnect_sessions_of(
        runtime_dir,
        &conn.description.server,
        &conn.description.cluster_id,
        &kube.manager_namespace,
    )
    .await?
    {
        output::done(&format!(
            "Disconnected session {id} first: it runs through the traffic manager being removed"
        ));
    }
    for id in socks::cli::disconnect_sessions_of(
        runtime_dir,
        &conn.description.server,
        &conn.description.cluster_id,
        &kube.manager_namespace,
    )
    .await?
    {
        output::done(&format!(
            "Disconnected SOCKS session {id} first: it runs through the traffic manager being removed"
        ));
    }
    // install::uninstall ends with the summary ("Removed the traffic manager from
    // NS (N objects)" or "… nothing to remove"), printed as a done line here; the
    // CLI says it once.
    install::uninstall(
        &conn.client,
        &kube.manager_namespace,
        &connect::print_progress,
    )
    .await
    .context("uninstall failed")?;
    Ok(())
}

pub(crate) async fn quit(runtime_dir: &std::path::Path) -> Result<()> {
    // A `kvpn connect` running now would start the daemons again after this
    // stopped them: interrupt it (it undoes its session), wait for it, and keep
    // the lock until both daemons are gone.
    let _connect_lock = userd::connect_lock::ConnectLock::for_quit(runtime_dir).await?;
    // The user daemon first: it disconnects its sessions (both halves) and exits.
    let ((stopped, tcp_reset), user_daemon) = userd::quit(runtime_dir).await?;
    for id in stopped {
        let reset = tcp_reset_text(tcp_reset.get(&id).copied().unwrap_or(0));
        output::done(&format!("Disconnected session {id}{reset}"));
    }
    match user_daemon {
        Some(Some(pid)) => output::done(&format!("Stopped the user daemon (pid {pid})")),
        Some(None) => output::done("Stopped the user daemon"),
        None => {}
    }
    // Another user's root daemon (it refuses this uid) holds nothing of this
    // user's: leave it running.
    if let Some(why) = daemon::refusal(runtime_dir).await {
        output::detail(&format!(
            "Left the root daemon running: it is not this user's ({why})"
        ));
        return Ok(());
    }
    if let Some(mut client) = daemon::connect_existing(runtime_dir).await? {
        let resp = client
            .disconnect(DisconnectRequest {
                session_id: String::new(),
            })
            .await
            .map_err(daemon::status_to_error)
            .context("disconnect before quit failed")?
            .into_inner();
        for id in resp.stopped {
            let reset = tcp_reset_text(resp.tcp_reset.get(&id).copied().unwrap_or(0));
            output::done(&format!("Disconnected session {id}{reset}"));
        }
    }
    // What a killed root daemon left: resolv.conf pointing at its forwarder, routes.
    if daemon::connect_existing(runtime_dir).await?.is_none() {
        repair_after_dead_root(runtime_dir)?;
    }
    daemon::stop(runtime_dir).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plain `kvpn disconnect` stops connect and SOCKS sessions and leaves
    /// `kvpn run` sessions (#27 F11); with no run session it stops all in one call.
    #[test]
    fn plain_disconnect_leaves_run_sessions() {
        let ids = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let root = vec![
            ("conn1".to_owned(), false),
            ("run1".to_owned(), true),
            ("direct1".to_owned(), false),
        ];
        assert_eq!(
            plain_disconnect_plan(&ids(&["conn1", "run1", "socks-1"]), &root),
            Some(ids(&["conn1", "direct1", "socks-1"]))
        );
        assert_eq!(
            plain_disconnect_plan(&ids(&["run1"]), &[("run1".to_owned(), true)]),
            Some(Vec::new())
        );
        assert_eq!(
            plain_disconnect_plan(&ids(&["conn1"]), &[("conn1".to_owned(), false)]),
            None
        );
        let line = left_run_line(&kvpn_proto::dataplane::Session {
            id: "run1".into(),
            ..Default::default()
        });
        assert!(
            line.contains("run1")
                && line.contains("`kvpn disconnect run1`")
                && line.contains("--all"),
            "{line}"
        );
    }
}
