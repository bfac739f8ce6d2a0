//! `kvpn-lab-addons`: hosts the lab's kube-proxy stand-in and cluster DNS in a process
//! of their own, for a persistent lab (`kvpn lab up`) whose building process exits.
//! Lab-only. Runs until SIGTERM or SIGINT, then removes what it added: the proxy's
//! nftables table, the `kube-system/kube-dns` Service and the DNS pod's netns.
//!
//! It lives in the host netns (the apiserver listens on a host loopback address); only
//! the DNS server's sockets live in the DNS pod's netns, so a lab teardown that stops
//! the processes inside the lab's netns does not find it: stop it by its pid first.
//!
//! The DNS pod IP defaults to 10.244.1.253, the top of the node's pod range, because
//! another process (the kubelet stand-in) allocates pod IPs from the bottom and this
//! process cannot see its allocations.

use std::net::Ipv4Addr;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use kvpn_lab::k8s::dns::{ClusterDns, ClusterDnsOptions};
use kvpn_lab::k8s::kube_proxy::{KubeProxy, KubeProxyConfig};
use kvpn_lab::lab::lab_node_ports;
use kvpn_lab::topology::Node;
use kvpn_lab::{NODE, NODE_POD_CIDR, NODE_UPLINK_IP};

#[derive(Debug, Parser)]
#[command(about = "kvpn lab: kube-proxy stand-in and cluster DNS for a lab node")]
struct Args {
    /// Admin kubeconfig of the lab's control plane.
    #[arg(long)]
    kubeconfig: PathBuf,
    /// The lab's 5-hex-digit id (netns `kvpn-<id>-node`).
    #[arg(long)]
    lab_id: String,
    /// nftables table of the proxy in the node netns.
    #[arg(long, default_value = kvpn_lab::k8s::kube_proxy::DEFAULT_TABLE)]
    table: String,
    /// Node address for NodePort Services.
    #[arg(long, default_value_t = NODE_UPLINK_IP)]
    node_ip: Ipv4Addr,
    /// Also render the static lab's manager forward (172.31.255.1:10801 → manager pod).
    #[arg(long)]
    manager_node_port: bool,
    /// IP of the DNS pod.
    #[arg(long, default_value_t = Ipv4Addr::new(10, 244, 1, 253))]
    dns_pod_ip: Ipv4Addr,
    /// Run only the proxy.
    #[arg(long)]
    no_dns: bool,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                // hickory logs every query at INFO.
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,hickory_server=warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    kvpn_lab::require_root()?;
    let node = Node::existing(&args.lab_id, NODE, NODE_POD_CIDR);
    anyhow::ensure!(
        node.netns().exists(),
        "lab {} has no node netns {} — is the lab up?",
        args.lab_id,
        node.netns().name()
    );
    let mut config = KubeProxyConfig::new(&args.kubeconfig, node.netns().clone())
        .table(&args.table)
        .node_ip(args.node_ip);
    if args.manager_node_port {
        config = config.static_node_ports(lab_node_ports());
    }
    let proxy = KubeProxy::start(config).context("starting the kube-proxy stand-in")?;
    let dns = if args.no_dns {
        None
    } else {
        let options = ClusterDnsOptions {
            pod_ip: Some(args.dns_pod_ip),
            ..ClusterDnsOptions::default()
        };
        Some(
            ClusterDns::deploy(&node, &args.kubeconfig, options)
                .context("deploying the cluster DNS")?,
        )
    };
    tracing::info!(lab = %args.lab_id, table = %args.table, dns = !args.no_dns, "lab add-ons running");

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    runtime.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
        let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        anyhow::Ok(())
    })?;

    tracing::info!("stopping lab add-ons");
    if let Some(dns) = dns {
        dns.stop(&node).context("stopping the cluster DNS")?;
    }
    proxy.stop().context("stopping the kube-proxy stand-in")?;
    Ok(())
}
