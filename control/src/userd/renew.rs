//! A session whose traffic manager was reinstalled under it (another laptop ran
//! `kvpn uninstall --force` and connected again): the new manager has a new CA
//! in Secret kvpn-manager-tls and none of this laptop's lease, so the root
//! daemon's re-dials fail the certificate check forever. The user daemon, which
//! holds the session's kubeconfig and environment, reads the new CA, leases a
//! tunnel IP from the new manager and hands back the session's StartSession
//! request with both, for the server to replace the session with.
//!
//! I/O: the API server (kubeconfig or SSH path of the session) and the manager's
//! Lease RPC through a port-forward.

use anyhow::{Context as _, Result};
use kvpn_proto::userd::StartSessionRequest;

use crate::install::{self, InstallOptions};
use crate::lease;

/// How often the user daemon looks for sessions whose manager certificate no
/// longer verifies: the root daemon re-dials every 2 s at most, so one look per
/// re-dial.
pub const CHECK_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

/// How long after a failed renewal the next try waits (an API server that is
/// down, a manager not ready yet): a few re-dials, not a hammering.
pub const RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(15);

/// `req` (a running session's StartSession request) renewed against the
/// traffic manager installed now: its CA, certificate name, ports, a new lease
/// (tunnel IP and session token) and, for ssh-direct, its ClusterIP. `None`
/// when the manager's CA is still the one `req` carries (not a reinstall).
pub async fn renewed_request(req: &StartSessionRequest) -> Result<Option<StartSessionRequest>> {
    let env = super::server::request_env(req);
    let flags = super::server::request_flags(req);
    let plan = if req.ssh_plan_json.is_empty() {
        None
    } else {
        Some(crate::ssh::SshPlan::from_env(&req.ssh_plan_json)?)
    };
    let (conn, _tunnel) = crate::ssh::connect_kube(&flags, plan.as_ref(), &env).await?;
    let opts = InstallOptions {
        namespace: req.manager_namespace.clone(),
        ..InstallOptions::default()
    };
    let manager = install::find_manager(&conn.client, &opts, &install::Quiet)
        .await
        .context("no usable traffic manager to renew the session with")?;
    let mut renewed = req.clone();
    // A SOCKS session keeps its CA in its SOCKS settings (its ConnectRequest
    // carries only the tunnel IP and origin).
    let current_ca = match &req.socks {
        Some(socks) => &socks.tls_ca_pem,
        None => match &req.connect {
            Some(c) => &c.tls_ca_pem,
            None => return Ok(None),
        },
    };
    if manager.ca_pem == *current_ca {
        return Ok(None);
    }
    let Some(connect) = renewed.connect.as_mut() else {
        return Ok(None);
    };
    let client_id = lease::client_id(
        &env,
        &conn.target.acting,
        &conn.description.server,
        &conn.description.cluster,
    )?;
    let leased = lease::lease(
        &conn.client,
        &req.manager_namespace,
        &manager.pod_name,
        manager.grpc_port,
        &client_id,
    )
    .await
    .context("cannot lease a tunnel IP from the reinstalled traffic manager")?;
    connect.tls_ca_pem = manager.ca_pem.clone();
    connect.tls_server_name = manager.server_name.clone();
    connect.session_token = leased.session_token.clone();
    connect.tunnel_ip = leased.tunnel_ip.clone();
    if !connect.tunnel_ip_v6.is_empty() {
        connect.tunnel_ip_v6 = leased.tunnel_ip_v6.clone();
    }
    if let Some(origin) = connect.origin.as_mut() {
        crate::connect::set_manager_build(origin, &leased, &manager);
    }
    if let Some(socks) = renewed.socks.as_mut() {
        socks.tls_ca_pem = manager.ca_pem.clone();
        socks.tls_server_name = manager.server_name.clone();
        socks.session_token = leased.session_token.clone();
        socks.tunnel_ip = leased.tunnel_ip.clone();
        // Only the SOCKS settings carry the CA: the ConnectRequest stays as it was.
        connect.tls_ca_pem.clear();
        connect.tls_server_name.clear();
        connect.session_token.clear();
    }
    renewed.data_port = u32::from(manager.data_port);
    renewed.grpc_port = u32::from(manager.grpc_port);
    if !renewed.ssh_direct.is_empty()
        && let Some(ip) = manager.cluster_ip
    {
        renewed.ssh_direct = std::net::SocketAddr::new(ip, manager.data_port).to_string();
    }
    Ok(Some(renewed))
}
