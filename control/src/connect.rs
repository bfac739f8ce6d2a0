//! `kvpn connect` through a kubeconfig: install or upgrade the traffic manager,
//! detect the cluster's CIDRs, keep the laptop's essentials out of the tunnel,
//! start the session agent (port-forward) and hand the session to the root daemon.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use ipnet::IpNet;
use kvpn_proto::dataplane::{ConnectRequest, Route, RouteKind};

use crate::agent::{self, AgentConfig};
use crate::cidr::{self, DetectOptions};
use crate::cli::ConnectArgs;
use crate::install::{self, InstallOptions, ProgressEvent};
use crate::kubeconfig::{self, UserEnv};
use crate::{daemon, output};

/// Prints install progress the way the rest of the CLI does.
fn print_progress(event: ProgressEvent) {
    match event {
        ProgressEvent::Step(s) => output::step(&s),
        ProgressEvent::Detail(s) => output::detail(&s),
        ProgressEvent::Done(s) => output::done(&s),
        ProgressEvent::Warning(s) => output::warn(&s),
    }
}

fn agents_dir(runtime_dir: &Path) -> PathBuf {
    runtime_dir.join("agents")
}

/// Record which agent serves a session, so disconnect can stop it.
fn record_agent(runtime_dir: &Path, session_id: &str, pid: u32) -> Result<()> {
    let dir = agents_dir(runtime_dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    std::fs::write(dir.join(format!("{session_id}.pid")), format!("{pid}\n"))
        .with_context(|| format!("cannot record the agent of session {session_id}"))
}

/// Stop the agent of a session (if it had one).
pub fn stop_agent(runtime_dir: &Path, session_id: &str) {
    let path = agents_dir(runtime_dir).join(format!("{session_id}.pid"));
    if let Ok(text) = std::fs::read_to_string(&path) {
        if let Ok(pid) = text.trim().parse::<i32>() {
            // SAFETY: kill with a pid we started and recorded; no memory is involved.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        let _ = std::fs::remove_file(&path);
    }
}

fn host_of(server: &str) -> String {
    let rest = server.split_once("://").map_or(server, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split(']').next().unwrap_or(v6).to_string();
    }
    authority.rsplit_once(':').map_or(authority, |(h, _)| h).to_string()
}

/// `kvpn connect` without `--manager`.
pub async fn kube_connect(runtime_dir: &Path, args: &ConnectArgs) -> Result<()> {
    let env = UserEnv::current().context("cannot read this process's environment")?;
    output::step("Reading kubeconfig and reaching the API server");
    let conn = kubeconfig::connect(&args.kube.flags(), &env).await?;
    output::done(&format!("Using {}", conn.description));

    let mut opts = InstallOptions {
        namespace: args.kube.manager_namespace.clone(),
        ..InstallOptions::default()
    };
    if let Some(image) = &args.image {
        opts.image = image.clone();
    }
    let manager = install::ensure_manager(&conn.client, &opts, &print_progress)
        .await
        .context("the traffic manager is not ready")?;

    output::step("Detecting the cluster's pod and service CIDRs");
    let detected = cidr::detect_cidrs(
        &conn.client,
        &DetectOptions {
            namespace: args.kube.manager_namespace.clone(),
            ..DetectOptions::default()
        },
    )
    .await
    .context("CIDR detection failed")?;
    for a in &detected.attempts {
        output::detail(&a.to_string());
    }
    let pod: Vec<IpNet> = detected.pod.iter().chain(&args.pod_cidrs).copied().collect();
    let service: Vec<IpNet> = detected.service.iter().chain(&args.service_cidrs).copied().collect();
    if pod.is_empty() && service.is_empty() && args.extra_cidrs.is_empty() {
        bail!(
            "could not detect any pod or service CIDR of this cluster — give them with \
             --pod-cidr and --service-cidr"
        );
    }

    // Never route the API server, the nameservers or the gateway into the tunnel (rt-02).
    let api_host = host_of(&conn.description.server);
    let essentials = cidr::essentials::gather(&[api_host.as_str()], &[]).await;
    for p in &essentials.problems {
        output::warn(p);
    }
    let keep_out: Vec<IpAddr> = essentials.addresses();
    let mut routes = Vec::new();
    for (cidrs, kind) in [
        (pod, RouteKind::Pod),
        (service, RouteKind::Service),
        (args.extra_cidrs.clone(), RouteKind::Extra),
    ] {
        for c in cidr::exclude(&cidrs, &keep_out) {
            routes.push(Route { cidr: c.to_string(), kind: kind as i32 });
        }
    }

    output::step(&format!(
        "Starting the port-forward agent for pod {} port {}",
        manager.pod_name, manager.data_port
    ));
    std::fs::create_dir_all(agents_dir(runtime_dir))
        .with_context(|| format!("cannot create {}", agents_dir(runtime_dir).display()))?;
    let nonce = std::process::id();
    let state_file = agents_dir(runtime_dir).join(format!("agent-{nonce}.addr"));
    let log = agents_dir(runtime_dir).join(format!("agent-{nonce}.log"));
    let (agent_pid, addr) = agent::spawn(
        &AgentConfig {
            flags: args.kube.flags(),
            manager_namespace: args.kube.manager_namespace.clone(),
            port: manager.data_port,
            state_file,
        },
        &log,
    )
    .await?;
    output::done(&format!("Agent (pid {agent_pid}) forwards {addr} to the traffic manager"));

    output::step(&format!("Starting root daemon (socket {})", daemon::socket_path(runtime_dir).display()));
    let mut client = daemon::connect_or_start(runtime_dir).await?;
    output::step(&format!("Connecting to the traffic manager (tunnel IP {})", args.tunnel_ip));
    let resp = client
        .connect(ConnectRequest {
            manager: addr.to_string(),
            routes: routes.clone(),
            tunnel_ip: args.tunnel_ip.to_string(),
            tun_name: args.tun_name.clone().unwrap_or_default(),
            mtu: args.mtu.unwrap_or(0),
        })
        .await
        .map_err(daemon::status_to_error);
    let resp = match resp {
        Ok(r) => r.into_inner(),
        Err(e) => {
            // SAFETY: kill with the pid of the agent we just started.
            unsafe { libc::kill(agent_pid as i32, libc::SIGTERM) };
            return Err(e.context("connect failed"));
        }
    };
    record_agent(runtime_dir, &resp.session_id, agent_pid)?;
    output::done(&format!(
        "Connected to {} through port-forward: session {} on TUN device {} (ifindex {})",
        conn.description.cluster, resp.session_id, resp.tun_name, resp.tun_ifindex
    ));
    for r in &routes {
        output::detail(&format!("route {} ({})", r.cidr, output::kind_name(r.kind)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::host_of;

    #[test]
    fn host_of_server_urls() {
        assert_eq!(host_of("https://172.31.255.1:6443"), "172.31.255.1");
        assert_eq!(host_of("https://api.example.com"), "api.example.com");
        assert_eq!(host_of("https://[fd00::1]:6443/prefix"), "fd00::1");
    }
}
