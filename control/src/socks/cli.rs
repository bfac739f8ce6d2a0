//! The CLI side of SOCKS sessions: `kvpn connect --socks` (install or upgrade the
//! traffic manager, lease a tunnel IP, read the cluster DNS, start the session
//! process with the SOCKS task), and the SOCKS part of `kvpn status` and
//! `kvpn disconnect`. No root daemon is asked for anything.
//!
//! I/O: the API server (through [`crate::install`] and [`crate::lease`]), the
//! session process it spawns, the records in the agents folder.

use std::net::IpAddr;
use std::path::Path;

use anyhow::{Context, Result};

use super::dns::ClusterDnsConfig;
use super::{SocksConfig, SocksOrigin, SocksStatus};
use crate::agent::{self, AgentConfig};
use crate::cli::ConnectArgs;
use crate::connect as tun_connect;
use crate::install::{self, InstallOptions};
use crate::kubeconfig::{KubeConnection, UserEnv};
use crate::{lease, output};

/// The SOCKS sessions of this runtime folder, with "failed" for those whose
/// session process is gone.
pub fn sessions(runtime_dir: &Path) -> Vec<SocksStatus> {
    super::sessions(&tun_connect::agents_dir(runtime_dir), |id| {
        tun_connect::agent_of(runtime_dir, id).is_some()
    })
}

/// Stop SOCKS session `id` (its session process and records). `false` when
/// there is no such SOCKS session.
pub async fn disconnect(runtime_dir: &Path, id: &str) -> bool {
    let record = super::status_path(&tun_connect::agents_dir(runtime_dir), id);
    if !record.exists() {
        return false;
    }
    tun_connect::stop_agent(runtime_dir, id).await;
    let _ = std::fs::remove_file(&record);
    true
}

/// `kvpn connect --socks` on an open API-server connection.
pub async fn connect(
    runtime_dir: &Path,
    args: &ConnectArgs,
    conn: &KubeConnection,
    plan: Option<&crate::ssh::SshPlan>,
    env: &UserEnv,
) -> Result<()> {
    let listen = super::parse_listen(
        args.socks_listen
            .as_deref()
            .unwrap_or(super::DEFAULT_LISTEN),
    )?;
    let origin = SocksOrigin {
        cluster: conn.description.cluster.clone(),
        server: conn.description.server.clone(),
        context: conn.description.context.clone(),
        manager_namespace: args.kube.manager_namespace.clone(),
    };
    if let Some(s) = sessions(runtime_dir)
        .into_iter()
        .find(|s| s.origin == origin && s.state != "failed")
    {
        output::done(&format!(
            "Already connected: SOCKS session {} on {} leads to cluster {} (context {}) — nothing to do",
            s.id, s.socks_listen, origin.cluster, origin.context
        ));
        return Ok(());
    }

    let mut opts = InstallOptions {
        namespace: args.kube.manager_namespace.clone(),
        ..InstallOptions::default()
    };
    if let Some(image) = &args.image {
        opts.image = image.clone();
    }
    let manager = install::ensure_manager(&conn.client, &opts, &tun_connect::print_progress)
        .await
        .context("the traffic manager is not ready")?;

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
    output::done(&format!("Tunnel IP {tunnel_ip}"));

    let dns = match tun_connect::cluster_dns(&conn.client, &conn.description.namespace).await {
        Ok(d) => ClusterDnsConfig {
            servers: d.servers.iter().filter_map(|s| s.parse().ok()).collect(),
            search: d.search,
        },
        Err(why) => {
            output::warn(&format!(
                "service names will not resolve through the SOCKS proxy (IP addresses will): {why}"
            ));
            ClusterDnsConfig::default()
        }
    };

    let dir = tun_connect::agents_dir(runtime_dir);
    std::fs::create_dir_all(&dir).with_context(|| {
        format!(
            "cannot create {} — set KVPN_RUNTIME_DIR (or --runtime-dir) to a folder you can write",
            dir.display()
        )
    })?;
    let id = super::new_id();
    let status_file = super::status_path(&dir, &id);
    let log = dir.join(format!("{id}.log"));
    let config = SocksConfig {
        id: id.clone(),
        listen,
        tunnel_ip,
        session_token: leased.session_token.clone(),
        tls_ca_pem: manager.ca_pem.clone(),
        tls_server_name: manager.server_name.clone(),
        dns,
        origin,
        status_file: status_file.clone(),
    };
    output::step(&format!(
        "Starting the session process (port-forward to pod {} port {}, SOCKS5 on {listen})",
        manager.pod_name, manager.data_port
    ));
    let (pid, _addr) = agent::spawn(
        &AgentConfig {
            flags: args.kube.flags(),
            ssh: plan.cloned(),
            manager_namespace: args.kube.manager_namespace.clone(),
            port: manager.data_port,
            state_file: dir.join(format!("{id}.addr")),
            // No route watch: a SOCKS session has no routes and no root daemon.
            grpc_port: None,
            keep_out: Vec::new(),
            runtime_dir: runtime_dir.to_owned(),
            socks: Some(config),
        },
        &log,
    )
    .await?;
    tun_connect::record_agent(runtime_dir, &id, pid)?;
    match super::wait_connected(&status_file, tun_connect::FIRST_ECHO_WAIT).await {
        Ok(_) => output::done(&format!(
            "Connected to {} through port-forward: SOCKS5 proxy on {listen} (session {id}, tunnel IP {tunnel_ip}, pid {pid})",
            conn.description.cluster
        )),
        Err(e) => output::warn(&format!(
            "{e:#} — the session keeps re-dialling on its own; watch `kvpn status`, or `kvpn disconnect {id}` to give up"
        )),
    }
    output::detail(&format!(
        "try: curl --socks5-hostname {listen} http://<service>.<namespace>/ (names resolve through the cluster DNS)"
    ));
    Ok(())
}
