//! kvpn CLI (and, later, the user daemon).
//!
//! Owns flag parsing ([`cli`]), everything printed for the user ([`output`]) and
//! the client side of the root daemon's gRPC API ([`daemon`]), including
//! starting the root daemon on demand. All I/O is the Unix socket to the root
//! daemon and spawning it.

pub mod agent;
pub mod cidr;
pub mod cli;
pub mod connect;
pub mod daemon;
pub mod install;
pub mod kubeconfig;
pub mod lab;
pub mod lease;
pub mod output;
pub mod route_watch;
pub mod ssh;
pub mod top;

use anyhow::{Context, Result, bail};
use kvpn_proto::dataplane::{ConnectRequest, DisconnectRequest, StatusRequest};

use crate::cli::{Cli, Command, ConnectArgs, DisconnectArgs, StatusArgs};

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
    let runtime_dir = cli.runtime_dir.clone();
    match cli.command {
        Command::Connect(args) => connect(&runtime_dir, args).await,
        Command::Status(args) => status(&runtime_dir, args).await,
        Command::Disconnect(args) => disconnect(&runtime_dir, args).await,
        Command::Top(args) => top::run(&runtime_dir, args).await,
        Command::Quit => quit(&runtime_dir).await,
        Command::Uninstall(args) => uninstall(&runtime_dir, args).await,
        Command::Agent(args) => {
            // The CLI hands the resolved SSH path over in the environment (it may
            // hold passwords, which must not show in the process list).
            let ssh = match std::env::var(ssh::PLAN_ENV) {
                Ok(v) => Some(ssh::SshPlan::from_env(&v)?),
                Err(_) => None,
            };
            agent::run(agent::AgentConfig {
                flags: args.kube.flags(),
                ssh,
                manager_namespace: args.kube.manager_namespace.clone(),
                port: args.port,
                ssh_direct: args.ssh_direct,
                state_file: args.state_file,
                grpc_port: args.grpc_port,
                keep_out: args.keep_out,
                runtime_dir: runtime_dir.clone(),
            })
            .await
        }
        Command::Lab(cmd) => lab::run(cmd).await,
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
    let Some(manager) = args.manager.clone() else {
        return connect::kube_connect(runtime_dir, &args).await;
    };
    validate_tunnel_ip(args.tunnel_ip)?;
    // Never route the manager's own address into the tunnel that leads to it (rt-02):
    // the session could never come up.
    let keep_out: Vec<std::net::IpAddr> = manager_ip(&manager).into_iter().collect();
    connect::warn_never_routed(
        &[&args.pod_cidrs[..], &args.service_cidrs, &args.extra_cidrs].concat(),
    );
    let routes = connect::cluster_routes(
        &args.pod_cidrs,
        &args.service_cidrs,
        &args.extra_cidrs,
        &keep_out,
    );
    let routes = connect::ipv4_only_if_ipv6_off(routes);
    if routes.is_empty() {
        bail!(
            "nothing to route: give at least one of --pod-cidr, --service-cidr or --cidr \
             (e.g. --pod-cidr 10.244.0.0/16 --service-cidr 10.96.0.0/12)"
        );
    }
    validate_manager_addr(&manager)?;
    output::step(&format!(
        "Starting root daemon (socket {})",
        daemon::socket_path(runtime_dir).display()
    ));
    let mut client = daemon::connect_or_start(runtime_dir).await?;
    output::step(&format!(
        "Connecting to traffic manager at {} (tunnel IP {})",
        manager, args.tunnel_ip
    ));
    if args.hosts {
        output::warn(
            "--hosts needs the route watch of a port-forward session; a --manager session writes no hosts-file entries",
        );
    }
    let resp = client
        .connect(ConnectRequest {
            manager: manager.clone(),
            routes: routes.clone(),
            tunnel_ip: args.tunnel_ip.to_string(),
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
        })
        .await
        .map_err(daemon::status_to_error)
        .context("connect failed")?
        .into_inner();
    connect::report_connected(
        &mut client,
        &resp.session_id,
        &format!(
            "Connected: session {} on TUN device {} (ifindex {})",
            resp.session_id, resp.tun_name, resp.tun_ifindex
        ),
    )
    .await?;
    for r in &routes {
        output::detail(&format!("route {} ({})", r.cidr, output::kind_name(r.kind)));
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

fn validate_manager_addr(addr: &str) -> Result<()> {
    let Some((host, port)) = addr.rsplit_once(':') else {
        bail!("--manager {addr:?} has no port: write it as HOST:PORT, e.g. 172.31.255.1:10801");
    };
    if host.is_empty() {
        bail!("--manager {addr:?} has no host: write it as HOST:PORT, e.g. 172.31.255.1:10801");
    }
    port.parse::<u16>()
        .map_err(|_| {
            anyhow::anyhow!("--manager {addr:?}: port {port:?} is not a number from 1 to 65535")
        })
        .and_then(|p| {
            if p == 0 {
                bail!("--manager {addr:?}: port 0 is not a valid port")
            } else {
                Ok(())
            }
        })
}

async fn status(runtime_dir: &std::path::Path, args: StatusArgs) -> Result<()> {
    let Some(mut client) = daemon::connect_existing(runtime_dir).await? else {
        output::not_running(runtime_dir, args.output);
        return Ok(());
    };
    let mut resp = client
        .status(StatusRequest {})
        .await
        .map_err(daemon::status_to_error)
        .context("status failed")?
        .into_inner();
    // The root daemon cannot see the user-side agent: a port-forward session whose
    // agent died can never carry traffic again, so say so instead of "reconnecting".
    for s in &mut resp.sessions {
        let port_forward = s
            .origin
            .as_ref()
            .is_some_and(|o| o.transport == connect::TRANSPORT_PORT_FORWARD);
        if port_forward && connect::agent_of(runtime_dir, &s.id).is_none() {
            s.state = "failed".into();
            s.reason = "its port-forward agent is gone — run `kvpn connect` again to replace \
                        the session, or `kvpn disconnect` it"
                .into();
        }
    }
    output::status(&resp, args.output)
}

async fn disconnect(runtime_dir: &std::path::Path, args: DisconnectArgs) -> Result<()> {
    let Some(mut client) = daemon::connect_existing(runtime_dir).await? else {
        if daemon::repair_leftovers(runtime_dir)? {
            output::done(
                "The root daemon had died with this machine's DNS pointing at it: \
                 resolv.conf restored and kvpn's routes removed",
            );
        }
        output::done("Not connected: the root daemon is not running, nothing to disconnect");
        return Ok(());
    };
    let session_id = if args.all {
        String::new()
    } else {
        args.id.unwrap_or_default()
    };
    let resp = client
        .disconnect(DisconnectRequest { session_id })
        .await
        .map_err(daemon::status_to_error)
        .context("disconnect failed")?
        .into_inner();
    if resp.stopped.is_empty() {
        output::done("No session to disconnect");
    } else {
        for id in resp.stopped {
            connect::stop_agent(runtime_dir, &id).await;
            output::done(&format!(
                "Disconnected session {id}: TUN device, routes and eBPF classifier removed"
            ));
        }
    }
    Ok(())
}

async fn uninstall(runtime_dir: &std::path::Path, args: crate::cli::UninstallArgs) -> Result<()> {
    let env = kubeconfig::UserEnv::current().context("cannot read this process's environment")?;
    let plan = ssh::plan_for(&args.kube.ssh, &env)?;
    if let Some(p) = &plan {
        output::step(&format!(
            "Opening the SSH path to the API server: {}",
            p.describe()
        ));
    }
    let (conn, _tunnel) = ssh::connect_kube(&args.kube.flags(), plan.as_ref(), &env).await?;
    output::done(&format!("Using {}", conn.description));
    // This laptop's sessions through the manager being removed would only hang in
    // "reconnecting": end them first, and say so.
    for id in connect::disconnect_sessions_of(
        runtime_dir,
        &conn.description.server,
        &args.kube.manager_namespace,
    )
    .await?
    {
        output::done(&format!(
            "Disconnected session {id} first: it runs through the traffic manager being removed"
        ));
    }
    let print = |e: install::ProgressEvent| output::info_block(&e.to_string());
    let report = install::uninstall(&conn.client, &args.kube.manager_namespace, &print)
        .await
        .context("uninstall failed")?;
    if report.deleted.is_empty() {
        output::done("Nothing of kvpn's was installed");
    } else {
        output::done(&format!("Removed {} objects", report.deleted.len()));
    }
    Ok(())
}

async fn quit(runtime_dir: &std::path::Path) -> Result<()> {
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
            connect::stop_agent(runtime_dir, &id).await;
            output::done(&format!("Disconnected session {id}"));
        }
    }
    // What a killed root daemon left: resolv.conf pointing at its forwarder, routes.
    if daemon::connect_existing(runtime_dir).await?.is_none()
        && daemon::repair_leftovers(runtime_dir)?
    {
        output::done(
            "The root daemon had died with this machine's DNS pointing at it: resolv.conf \
             restored and kvpn's routes removed",
        );
    }
    // Agents of sessions the root daemon no longer knows (it was killed, say).
    for id in connect::sweep_agents(runtime_dir, &[]).await {
        output::done(&format!(
            "Stopped the leftover port-forward agent of session {id}"
        ));
    }
    daemon::stop(runtime_dir).await
}
