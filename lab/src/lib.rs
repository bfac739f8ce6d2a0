//! kvpn's test lab: a Kubernetes-like cluster in network namespaces on one machine
//! (lab-only code; nothing here ships to users' clusters).
//!
//! What it owns:
//! - [`Lab`]: one lab instance — a `laptop` netns, a `node` netns with a bridge for the
//!   node's pod range, one netns per pod, the laptop↔node uplink veth, the nftables
//!   table that implements ClusterIPs and the manager's NodePort-like DNAT, and the
//!   processes that run in the pods. Brought up with [`Lab::up`], torn down by
//!   [`Lab::down`] or on drop; a persistent lab (`kvpn lab up`) is recorded in a state
//!   file and torn down later from another process with [`down_named`].
//! - [`topology`]: the reusable building blocks ([`Node::add_pod`], the uplink), used by
//!   the static pods of [`Lab`] and by the kubelet stand-in of the Kubernetes lab.
//! - [`nft`]: a pure renderer of kube-proxy-like nftables rules from services.
//! - [`payload`] and [`protocol`]: pure helpers shared by the lab's test server
//!   (`kvpn-lab-server`) and the tests that check its answers.
//! - [`packets`]: hand-made IP/UDP packets and a non-blocking drain for the eBPF
//!   tests (pure).
//!
//! Where the I/O lives: [`netns`] (`ip netns`, `ip -n`, setns on a scratch thread,
//! `/proc/sys` writes), [`process`] (spawn, signal, `/proc/<pid>`), [`nft::apply`]
//! (`nft -f -` inside the node netns), and the state file of a persistent lab
//! (`$KVPN_LAB_STATE_DIR`, default `/run/kvpn-lab`).
//!
//! Safety rules the code follows: every netns is named `kvpn-<id>-<role>` with a fresh
//! 5-hex-digit id, every interface `kv<id>..`, all of them live inside the lab's own
//! netns (nothing is added to the machine's root netns), and teardown only signals
//! processes the lab started or that run inside the lab's own netns.

pub mod cli;
pub mod flood;
pub mod k8s;
pub mod lab;
pub mod netns;
pub mod nft;
pub mod packets;
pub mod payload;
pub mod process;
pub mod protocol;
pub mod topology;

use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::PathBuf;

use ipnet::Ipv4Net;

pub use lab::{
    DEFAULT_LAB_NAME, ExtraLaptop, LAPTOP_HOSTS_FILE, Lab, LabOptions, ManagerProcess, ProcessInfo,
    down_named, laptop_hosts_content, reap_orphaned_labs, state_dir, state_path,
    write_laptop_hosts,
};
pub use netns::{Netns, lab_manager_pid, lab_netns, lab_pids, list_kvpn_netns, run_in_netns};
pub use nft::{NodePort, Protocol, Service};
pub use process::Process;
pub use topology::{Addressing, Node, Pod, Uplink};

/// Everything that can go wrong while building, using or tearing down a lab.
/// `kvpn lab <sub>` for the lab `name`: with `--name` unless it is the default lab.
pub fn lab_cmd(sub: &str, name: &str) -> String {
    if name == DEFAULT_LAB_NAME {
        format!("kvpn lab {sub}")
    } else {
        format!("kvpn lab {sub} --name {name}")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LabError {
    #[error(
        "the kvpn lab needs root to create network namespaces (running as uid {uid}) — rerun with sudo"
    )]
    NotRoot { uid: u32 },
    #[error("cannot run `{cmd}`: {source} — install iproute2 and nftables (scripts/setup.sh)")]
    Spawn {
        cmd: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{cmd}` failed ({status}): {stderr}")]
    CommandFailed {
        cmd: String,
        status: std::process::ExitStatus,
        stderr: String,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "binary `{name}` not found (looked in {searched}) — build it with `cargo build --workspace` or point KVPN_BIN_DIR at the directory that holds it"
    )]
    BinaryNotFound { name: String, searched: String },
    #[error("cannot enter network namespace {netns}: {source}")]
    Setns {
        netns: String,
        #[source]
        source: nix::Error,
    },
    #[error("{what} did not answer within {timeout_ms} ms{log}")]
    NotReady {
        what: String,
        timeout_ms: u128,
        /// Tail of the process log, prefixed with a newline, or empty.
        log: String,
    },
    #[error("process `{name}` (pid {pid}) exited with {status} before it was ready{log}")]
    Exited {
        name: String,
        pid: u32,
        status: std::process::ExitStatus,
        /// Tail of the process log, prefixed with a newline, or empty.
        log: String,
    },
    #[error("invalid {what} `{value}`: {why}")]
    Invalid {
        what: &'static str,
        value: String,
        why: &'static str,
    },
    #[error(
        "lab `{name}` has no network namespace for role `{role}` (roles: laptop, node, or a pod name)"
    )]
    UnknownRole { name: String, role: String },
    #[error(
        "lab `{name}` is already up (state file {path}) — bring it down first with `{}`, or give the new one another name (`kvpn lab up --name …`)",
        lab_cmd("down", name)
    )]
    AlreadyUp { name: String, path: PathBuf },
    #[error("no lab named `{name}` is up (no state file {path})")]
    NotUp { name: String, path: PathBuf },
    #[error(
        "lab state file {path} is unreadable: {source} — remove it and the `kvpn-*` netns by hand"
    )]
    State {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "lab `{name}` is not persistent — pass LabOptions::persist_as to keep it up after this process"
    )]
    NotPersistent { name: String },
    #[error("no free lab id after {tries} tries (is /run/netns full of kvpn-* namespaces?)")]
    NoFreeId { tries: u32 },
    #[error("teardown of lab {id} left {leftovers}")]
    Leftovers { id: String, leftovers: String },
}

pub type Result<T, E = LabError> = std::result::Result<T, E>;

// --- Addresses of the lab topology (see the shared brief, "Lab topology") ----------

/// The cluster's pod CIDR.
pub const POD_CIDR: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(10, 244, 0, 0), 16);
/// The node's share of the pod CIDR, on the node's bridge.
pub const NODE_POD_CIDR: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(10, 244, 1, 0), 24);
/// The bridge's address in the node netns: every pod's default gateway.
pub const NODE_BRIDGE_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 1);
/// The cluster's service CIDR (ClusterIPs).
pub const SERVICE_CIDR: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(10, 96, 0, 0), 12);

/// Pod names of the static lab.
pub const MANAGER_POD: &str = "manager";
pub const BACKEND_1_POD: &str = "backend-1";
pub const BACKEND_2_POD: &str = "backend-2";
/// Role names of the two non-pod netns (see [`Lab::netns`]).
pub const LAPTOP: &str = "laptop";
pub const NODE: &str = "node";

pub const MANAGER_POD_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 10);
pub const BACKEND_1_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 11);
pub const BACKEND_2_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 12);
/// An address inside the node's pod range that no pod holds (case tr-03: ping fails).
pub const UNUSED_POD_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 99);

/// The traffic manager's data port in its pod.
pub const MANAGER_PORT: u16 = 10801;
/// `kvpn-lab-server` ports in the backend pods.
pub const HTTP_PORT: u16 = 8080;
/// TCP and UDP echo port of `kvpn-lab-server`.
pub const ECHO_PORT: u16 = 7007;

/// ClusterIP `web`: TCP :80 → backends :8080.
pub const WEB_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 100);
pub const WEB_SERVICE_PORT: u16 = 80;
/// ClusterIP `echo`: TCP :7 → backends :7007.
pub const ECHO_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 101);
/// ClusterIP `udp-echo`: UDP :7 → backends :7007.
pub const UDP_ECHO_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 102);
/// Port of the `echo` and `udp-echo` services.
pub const ECHO_SERVICE_PORT: u16 = 7;

/// Uplink veth: the node's side (the laptop's only way into the cluster).
pub const NODE_UPLINK_IP: Ipv4Addr = Ipv4Addr::new(172, 31, 255, 1);
/// Uplink veth: the laptop's side.
pub const LAPTOP_UPLINK_IP: Ipv4Addr = Ipv4Addr::new(172, 31, 255, 2);
pub const UPLINK_PREFIX_LEN: u8 = 30;
/// Where the laptop reaches the manager: the node's NodePort-like DNAT to
/// `MANAGER_POD_IP:MANAGER_PORT`.
pub const MANAGER_ADDR_FROM_LAPTOP: SocketAddrV4 = SocketAddrV4::new(NODE_UPLINK_IP, MANAGER_PORT);

/// Name of the nftables table (in the node netns) that holds ClusterIPs and NodePorts.
pub const NFT_TABLE: &str = "kvpn_lab";

/// Where a lab binary lives: `$KVPN_BIN_DIR/<name>` if `KVPN_BIN_DIR` is set, else the
/// directory of the current executable, else its parent (test binaries run from
/// `target/<profile>/deps`, the binaries sit in `target/<profile>`).
///
/// Errors with [`LabError::BinaryNotFound`] naming every place it looked.
pub fn bin_path(name: &str) -> Result<PathBuf> {
    let mut candidates = Vec::new();
    if let Some(dir) = std::env::var_os("KVPN_BIN_DIR") {
        candidates.push(PathBuf::from(dir).join(name));
    } else if let Ok(exe) = std::env::current_exe()
        && let Some(dir) = exe.parent()
    {
        candidates.push(dir.join(name));
        if let Some(parent) = dir.parent() {
            candidates.push(parent.join(name));
        }
    }
    for c in &candidates {
        if c.is_file() {
            return Ok(c.clone());
        }
    }
    Err(LabError::BinaryNotFound {
        name: name.to_owned(),
        searched: if candidates.is_empty() {
            "nowhere: KVPN_BIN_DIR unset and the current executable's path is unknown".to_owned()
        } else {
            candidates
                .iter()
                .map(|c| c.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        },
    })
}

/// Fails with [`LabError::NotRoot`] unless the process runs as root.
pub fn require_root() -> Result<()> {
    let uid = nix::unistd::geteuid().as_raw();
    if uid == 0 {
        Ok(())
    } else {
        Err(LabError::NotRoot { uid })
    }
}
