//! The CLI side of SOCKS sessions: `kvpn connect --socks` (install or upgrade the
//! traffic manager, lease a tunnel IP, read the cluster DNS, ask the user daemon
//! to start the session with its SOCKS task). Status, disconnect, quit and
//! uninstall reach SOCKS sessions through the user daemon like any session. No
//! root daemon is asked for anything, or started.
//!
//! I/O: the API server (through [`crate::install`] and [`crate::lease`]), the
//! user daemon's socket.

use std::path::Path;
use std::time::Duration;

use crate::daemon_channel::DaemonChannel;
use anyhow::{Context, Result, bail};
use kvpn_proto::dataplane::{ConnectRequest, Origin};
use kvpn_proto::userd::user_daemon_client::UserDaemonClient;
use kvpn_proto::userd::{SocksSession, StartSessionRequest, StatusRequest, UserSession};

use crate::cli::ConnectArgs;
use crate::connect as tun_connect;
use crate::kubeconfig::{KubeConnection, UserEnv};
use crate::{daemon, output, userd};

/// The user daemon's SOCKS sessions.
async fn socks_sessions(user: &mut UserDaemonClient<DaemonChannel>) -> Result<Vec<UserSession>> {
    Ok(user
        .status(StatusRequest {})
        .await
        .map_err(daemon::status_to_error)
        .context("status failed")?
        .into_inner()
        .user_sessions
        .into_iter()
        .filter(|u| u.socks.is_some())
        .collect())
}

/// Stop the SOCKS sessions through the traffic manager of the cluster at
/// `server` with `cluster_id` in `manager_namespace` (uninstall); the stopped ids.
pub async fn disconnect_sessions_of(
    runtime_dir: &Path,
    server: &str,
    cluster_id: &str,
    manager_namespace: &str,
) -> Result<Vec<String>> {
    let Some(mut user) = userd::connect_if_needed(runtime_dir).await? else {
        return Ok(Vec::new());
    };
    let mut stopped = Vec::new();
    for s in socks_sessions(&mut user).await? {
        let Some(o) = &s.origin else { continue };
        if !tun_connect::same_cluster(o, server, cluster_id)
            || o.manager_namespace != manager_namespace
        {
            continue;
        }
        stopped.extend(
            user.disconnect(kvpn_proto::userd::DisconnectRequest {
                session_id: s.id.clone(),
            })
            .await
            .map_err(daemon::status_to_error)
            .with_context(|| format!("cannot disconnect session {}", s.id))?
            .into_inner()
            .stopped,
        );
    }
    Ok(stopped)
}

/// Wait (bounded) until SOCKS session `id` says connected; the error names the
/// reason it last gave.
async fn wait_connected(
    user: &mut UserDaemonClient<DaemonChannel>,
    id: &str,
    wait: Duration,
) -> Result<()> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let s = socks_sessions(user)
            .await?
            .into_iter()
            .find(|u| u.id == id)
            .and_then(|u| u.socks);
        let Some(s) = s else {
            bail!("the user daemon no longer lists SOCKS session {id} — see `kvpn logs`");
        };
        if s.state == "connected" {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "the SOCKS session did not connect to the traffic manager within {} s ({}: {})",
                wait.as_secs(),
                s.state,
                s.reason
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether a session's `have` origin is the `wanted` cluster: every field but
/// the manager's build and source policy, which the session recorded at its
/// connect.
fn same_cluster(have: &Origin, wanted: &Origin) -> bool {
    let mut have = have.clone();
    have.source_policy.clone_from(&wanted.source_policy);
    have.manager_version.clone_from(&wanted.manager_version);
    have.manager_commit.clone_from(&wanted.manager_commit);
    have == *wanted
}

/// `kvpn connect --socks` on an open API-server connection.
pub async fn connect(
    runtime_dir: &Path,
    args: &ConnectArgs,
    conn: &KubeConnection,
    plan: Option<&crate::ssh::SshPlan>,
    ssh_tunnel: Option<&crate::ssh::tunnel::SshTunnel>,
    env: &UserEnv,
) -> Result<()> {
    let listen = args.socks_listen.unwrap_or(super::DEFAULT_LISTEN);
    // Until the manager is known: a port-forward through the API server, which
    // is reached through the SSH path when there is one. With an SSH path the
    // data channel may bypass the API server (chosen below, as for a TUN session).
    let data_path = crate::ssh::bypass::DataPath::PortForward {
        ssh: ssh_tunnel.map(|t| t.dialer().path()),
    };
    let origin = Origin {
        transport: super::TRANSPORT_SOCKS.to_owned(),
        cluster: conn.description.cluster.clone(),
        server: conn.description.server.clone(),
        context: conn.description.context.clone(),
        manager_namespace: args.kube.manager_namespace.clone(),
        data_path: data_path.describe(),
        source_policy: String::new(),
        manager_version: String::new(),
        manager_commit: String::new(),
        cluster_id: conn.description.cluster_id.clone(),
        // No routes in SOCKS mode: nothing is kept off a tunnel, no DNS options.
        ..Default::default()
    };
    let mut user = userd::connect_or_start(runtime_dir).await?;
    if let Some(s) = socks_sessions(&mut user).await?.into_iter().find(|s| {
        s.origin.as_ref().is_some_and(|o| same_cluster(o, &origin))
            && s.state != userd::server::STATE_LOST
    }) {
        let session_listen = s.socks.map(|x| x.listen).unwrap_or_default();
        if let Some(w) = super::listen_not_applied(args.socks_listen, &s.id, &session_listen) {
            output::warn(&w);
        }
        output::done(&format!(
            "Already connected: SOCKS session {} on {} leads to cluster {} (context {}) — nothing to do",
            s.id, session_listen, origin.cluster, origin.context
        ));
        return Ok(());
    }

    // Not an existing session's: the listen address must be free before the
    // manager is installed and a tunnel IP leased.
    super::check_listen(listen).map_err(|e| super::listen_error(listen, &e))?;
    let manager = tun_connect::ensure_manager(conn, args).await?;
    let (leased, tunnel_ip) = tun_connect::lease_step(conn, args, env, &manager).await?;
    output::done(&format!("Tunnel IP {tunnel_ip}"));
    let mut origin = origin;
    tun_connect::set_manager_build(&mut origin, &leased, &manager);
    origin.source_policy = manager.source_policy.as_str().to_owned();
    let data_path = if ssh_tunnel.is_some() {
        tun_connect::choose_data_path(ssh_tunnel, &manager).await
    } else {
        data_path
    };
    origin.data_path = data_path.describe();

    if let Some(line) =
        tun_connect::missing_namespace(&conn.client, &conn.description.namespace).await
    {
        output::warn(&line);
    }
    let dns = match tun_connect::cluster_dns(&conn.client, &conn.description.namespace).await {
        Ok(d) => (d.servers, d.search),
        Err(why) => {
            output::warn(&format!(
                "service names will not resolve through the SOCKS proxy (IP addresses will): {why}"
            ));
            (Vec::new(), Vec::new())
        }
    };

    let id = super::new_id();
    match data_path.ssh_direct_target() {
        Some(target) => output::step(&format!(
            "Starting the SOCKS session in the user daemon (ssh-direct to {target}, SOCKS5 on {listen})"
        )),
        None => output::step(&format!(
            "Starting the SOCKS session in the user daemon (port-forward to pod {} port {}, SOCKS5 on {listen})",
            manager.pod_name, manager.data_port
        )),
    }
    let ssh_direct = data_path.request_fields();
    let started = user
        .start_session(StartSessionRequest {
            // The SSH data-plane bypass as for a TUN session: the data channel
            // dials the session's own listener, which takes ssh-direct or
            // port-forward per connection.
            ssh_direct: ssh_direct.0,
            ssh_direct_failed: ssh_direct.1,
            // No route watch (grpc_port 0), no keep-out list: a SOCKS session
            // has no routes and no root daemon.
            // Only which cluster and the tunnel IP (status, uninstall); no Connect.
            connect: Some(ConnectRequest {
                tunnel_ip: tunnel_ip.to_string(),
                origin: Some(origin),
                ..ConnectRequest::default()
            }),
            socks: Some(SocksSession {
                id: id.clone(),
                listen: listen.to_string(),
                tunnel_ip: tunnel_ip.to_string(),
                session_token: leased.session_token.clone(),
                tls_ca_pem: manager.ca_pem.clone(),
                tls_server_name: manager.server_name.clone(),
                dns_servers: dns.0,
                dns_search: dns.1,
            }),
            ..tun_connect::session_request(env, args, conn, plan, &manager)
        })
        .await
        .map_err(daemon::status_to_error)
        .context("connect failed")?
        .into_inner();
    let pid = started.daemon_pid;
    match wait_connected(&mut user, &id, tun_connect::FIRST_ECHO_WAIT).await {
        Ok(()) => output::done(&format!(
            "Connected to {} through {}: SOCKS5 proxy on {listen} (session {id}, tunnel IP {tunnel_ip}, user daemon pid {pid})",
            conn.description.cluster,
            data_path.describe()
        )),
        Err(e) => output::warn(&format!(
            "{e:#} — the session keeps re-dialling on its own; watch `kvpn status`, or `kvpn disconnect {id}` to give up"
        )),
    }
    if let Some(w) = super::remote_warning(&listen.to_string()) {
        output::warn(&w);
    }
    output::detail(&super::curl_hint(listen));
    Ok(())
}
