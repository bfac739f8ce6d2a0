//! Command-line flags of `kvpn`.

use std::net::IpAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use ipnet::IpNet;

/// kvpn puts this machine on a Kubernetes cluster's network: after `kvpn connect`,
/// pod IPs, ClusterIPs and service names are reachable over TCP, UDP and ICMP.
#[derive(Debug, Parser)]
#[command(
    name = "kvpn",
    version,
    about = "Put this machine on a Kubernetes cluster's network",
    long_about = "kvpn puts this machine on a Kubernetes cluster's network: after `kvpn connect`, \
pod IPs, ClusterIPs and service names are reachable over TCP, UDP and ICMP, as if it were a pod.\n\n\
Traffic to the cluster's CIDRs is routed into a TUN device, classified by an eBPF program, \
framed by the root daemon (kvpn-dataplane) and carried to the in-cluster traffic manager \
(kvpn-manager), which terminates it in a userspace TCP/IP stack and dials the real destinations.\n\n\
Try it on the built-in lab: `kvpn lab up`, then \
`kvpn lab exec laptop -- kvpn connect --manager 172.31.255.1:10801 --pod-cidr 10.244.0.0/16 --service-cidr 10.96.0.0/12`."
)]
pub struct Cli {
    /// More log output on stderr (-v debug, -vv trace).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,

    /// Folder of the root daemon's socket, pid file and log.
    #[arg(long, env = "KVPN_RUNTIME_DIR", default_value = "/run/kvpn", global = true)]
    pub runtime_dir: PathBuf,

    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Connect to a traffic manager and route cluster CIDRs through a TUN device.
    Connect(ConnectArgs),
    /// Show sessions: state, routes, counters.
    Status(StatusArgs),
    /// Tear a session down (TUN device, routes, eBPF classifier).
    Disconnect(DisconnectArgs),
    /// Stop the root daemon after disconnecting every session.
    Quit,
    /// The built-in lab: a cluster in network namespaces for trying kvpn out.
    #[command(subcommand)]
    Lab(LabCommand),
}

/// `kvpn connect` flags.
#[derive(Debug, Args)]
pub struct ConnectArgs {
    /// Traffic manager data address, host:port (direct TCP transport).
    #[arg(long, value_name = "HOST:PORT")]
    pub manager: String,
    /// A pod CIDR to route through the tunnel (repeatable).
    #[arg(long = "pod-cidr", value_name = "CIDR")]
    pub pod_cidrs: Vec<IpNet>,
    /// The service CIDR (ClusterIPs) to route through the tunnel (repeatable).
    #[arg(long = "service-cidr", value_name = "CIDR")]
    pub service_cidrs: Vec<IpNet>,
    /// Any other CIDR to route through the tunnel (repeatable).
    #[arg(long = "cidr", value_name = "CIDR")]
    pub extra_cidrs: Vec<IpNet>,
    /// This machine's address inside the tunnel.
    #[arg(long, default_value = "100.96.0.2")]
    pub tunnel_ip: IpAddr,
    /// TUN device name (default: the first free kvpnN).
    #[arg(long)]
    pub tun_name: Option<String>,
    /// TUN MTU in bytes (default: the root daemon's, 9000 for byte-stream transports).
    #[arg(long)]
    pub mtu: Option<u32>,
}

/// Output formats.
#[derive(Debug, Clone, Copy, ValueEnum, Default)]
pub enum OutputFormat {
    /// A table for people.
    #[default]
    Table,
    /// JSON for programs.
    Json,
}

/// `kvpn status` flags.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Output format.
    #[arg(short, long, value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
}

/// `kvpn disconnect` flags.
#[derive(Debug, Args)]
pub struct DisconnectArgs {
    /// Session id (see `kvpn status`); without it, every session.
    pub id: Option<String>,
    /// Disconnect every session.
    #[arg(long, conflicts_with = "id")]
    pub all: bool,
}

/// `kvpn lab` subcommands.
#[derive(Debug, Subcommand)]
pub enum LabCommand {
    /// Bring the lab up: laptop and node network namespaces, a Kubernetes control plane
    /// (etcd, kube-apiserver, kube-controller-manager), kubelet/kube-proxy/DNS stand-ins,
    /// the traffic manager and sample workloads; prints the kubeconfig paths.
    Up,
    /// Tear the lab down; nothing of it remains.
    Down,
    /// Show what runs where in the lab.
    Info,
    /// Run a command inside one of the lab's network namespaces (in `laptop`, KUBECONFIG
    /// points at the lab's admin kubeconfig unless already set).
    Exec {
        /// `laptop`, `node`, or a pod name (`kubectl get pods -A`).
        role: String,
        /// The command and its arguments (after `--`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        command: Vec<String>,
    },
}
