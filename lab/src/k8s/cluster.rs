//! [`K8sLab`]: the Kubernetes-backed lab (lab-only code) — the one lab `kvpn lab up`
//! brings up. It owns, in start order:
//!
//! 1. a topology-only [`Lab`] (laptop, node, bridge, uplink; no static pods);
//! 2. the [`ControlPlane`] (etcd, kube-apiserver, kube-controller-manager) in the host
//!    netns on a random `127.x.y.z`, folder `<lab folder>/control-plane`;
//! 3. the [`NodeServices`], threads of one process: the API relay
//!    (`172.31.255.1:6443` in the node netns → the apiserver), the kube-proxy stand-in
//!    (nftables table `kvpn_proxy` in the node netns, NodePorts on `172.31.255.1`), the
//!    CNI-like masquerade (table `kvpn_masq`) with the tunnel pool's return route
//!    (`100.96.0.0/16 via 169.254.96.1`, see [`super::source`]), the
//!    cluster DNS (pod `kube-dns`, Service 10.96.0.10) and the kubelet stand-in (Node
//!    `kvpn-<id>-node`, one netns per pod);
//! 4. the sample workloads ([`super::workloads`]), applied through the apiserver, and
//!    a wait until their pods are ready.
//!
//! Two ways to run it:
//! - in-process ([`K8sLab::up`] without `persist_as`; tests): the node services are
//!   threads of the calling process, the control plane dies with it; drop or
//!   [`K8sLab::down`] removes everything.
//! - persistent ([`K8sLabOptions::persist_as`]; `kvpn lab up`): the control plane is
//!   detached, and the node services run in a background process `kvpn-lab-agent`
//!   (own session, log `<lab folder>/agent.log`) so they outlive `kvpn lab up`.
//!   [`down_named`] stops the agent (which removes its pods and rules), then the control
//!   plane, then the lab (every `kvpn-<id>-*` netns, the state file, the folder).
//!
//! Addressing: [`K8sLabOptions::addressing`] picks the address plan (default: the
//! shared brief's; [`Addressing::second`] for a second cluster). With
//! [`K8sLabOptions::laptop_of`] the lab's uplink goes into another lab's laptop netns
//! (one laptop, two clusters: its own /30 and interface names, its own kubeconfigs,
//! removed alone on down); [`K8sLab::add_laptop`] adds another laptop netns to a lab
//! (two laptops, one cluster).
//!
//! Files in the lab folder: `k8s-lab.json` (where the control plane is, the agent's
//! pid), `laptop-admin.kubeconfig` and `laptop-kvpn-user.kubeconfig` (server
//! `https://172.31.255.1:6443`, for the laptop netns), the control plane's folder, and
//! the logs. Nothing is written outside it except the lab's state file.
//!
//! I/O: everything here starts processes, threads, netns or API calls; the pure parts
//! are [`super::workloads::objects`] and the kubeconfig renderer.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::dns::{ClusterDns, ClusterDnsOptions};
use super::kube_proxy::{KubeProxy, KubeProxyConfig};
use super::kubeconfig::{self, KubeconfigSpec};
use super::kubelet::{ClusterDns as KubeletDns, Kubelet, KubeletConfig, KubeletSetup};
use super::node::egress::EgressProxy;
use super::node::{ImageArchive, RealNodes, RealNodesConfig};
use super::relay::{API_PORT, ApiRelay};
use super::workloads::{self, Workloads};
use super::{ControlPlane, ControlPlaneConfig, KVPN_NAMESPACE, RESTRICTED_USER};
use crate::LabError;
use crate::lab::{Lab, LabOptions};
use crate::netns::Netns;
use crate::topology::{Addressing, Uplink};

/// The lab's file describing its Kubernetes parts (in the lab folder).
pub const STATE_FILE: &str = "k8s-lab.json";
/// Laptop kubeconfig of the admin (`system:masters`), in the lab folder.
pub const LAPTOP_ADMIN_KUBECONFIG: &str = "laptop-admin.kubeconfig";
/// Laptop kubeconfig of the restricted user `kvpn-user`, in the lab folder.
pub const LAPTOP_USER_KUBECONFIG: &str = "laptop-kvpn-user.kubeconfig";
/// The agent binary (lab/src/bin/kvpn-lab-agent.rs).
pub const AGENT_BIN: &str = "kvpn-lab-agent";
/// Written by the agent once its node services run.
const AGENT_READY_FILE: &str = "agent.ready";
/// The egress proxy's socket in the lab folder (real nodes: the apiserver's way to
/// the kubelets).
const EGRESS_SOCKET: &str = "egress.sock";
/// Bound for the agent to bring its node services up. The stand-ins take a few
/// seconds; real nodes 20–30 s here, and a second lab waits for the first one's
/// kubelet start lock.
const AGENT_START_TIMEOUT: Duration = Duration::from_secs(180);
/// How long `kvpn lab down` waits for the agent after SIGTERM: real nodes stop each
/// process with a 5 s grace, then their cgroups and namespaces.
const AGENT_STOP_TIMEOUT: Duration = Duration::from_secs(60);
/// The apiserver's NodePort range: wide enough for the manager's NodePort 10801.
const NODE_PORT_RANGE: &str = "10000-32767";
/// Admin user name of the control plane's kubeconfigs.
const ADMIN_USER: &str = "kvpn-lab-admin";

/// Errors of the Kubernetes lab.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Lab(#[from] LabError),
    // Boxed: these carry log tails and paths, and would make every Result large.
    #[error(transparent)]
    ControlPlane(Box<super::Error>),
    #[error(transparent)]
    KubeProxy(Box<super::kube_proxy::Error>),
    #[error(transparent)]
    Dns(Box<super::dns::Error>),
    #[error("kubelet stand-in: {0}")]
    Kubelet(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    RealNode(Box<super::node::Error>),
    #[error("lab {name}: {message}")]
    State { name: String, message: String },
    #[error("kvpn-lab-agent {message}; last lines of {log}:\n{tail}")]
    Agent {
        message: String,
        log: PathBuf,
        tail: String,
    },
}

impl From<super::Error> for Error {
    fn from(e: super::Error) -> Self {
        Error::ControlPlane(Box::new(e))
    }
}

impl From<super::kube_proxy::Error> for Error {
    fn from(e: super::kube_proxy::Error) -> Self {
        Error::KubeProxy(Box::new(e))
    }
}

impl From<super::node::Error> for Error {
    fn from(e: super::node::Error) -> Self {
        Error::RealNode(Box::new(e))
    }
}

impl From<super::node::egress::Error> for Error {
    fn from(e: super::node::egress::Error) -> Self {
        Error::RealNode(Box::new(e.into()))
    }
}

impl From<super::dns::Error> for Error {
    fn from(e: super::dns::Error) -> Self {
        Error::Dns(Box::new(e))
    }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}

/// Options of [`K8sLab::up`].
#[derive(Debug, Clone)]
pub struct K8sLabOptions {
    /// Options of the underlying lab; forced to [`LabOptions::topology_only`].
    pub lab: LabOptions,
    pub workloads: Workloads,
    /// Bound for the sample Deployments to become ready.
    pub ready_timeout: Duration,
    /// Bound for each control-plane start-up step.
    pub control_plane_step_timeout: Duration,
    /// Real node software ([`super::node`]) instead of the kubelet, kube-proxy, CNI
    /// and DNS stand-ins. None (the default): the stand-ins.
    pub real_nodes: Option<RealNodeOptions>,
}

/// How many real nodes and what to load into them (see [`K8sLabOptions::real_nodes`]).
/// Without the lab's manager Deployment (`kvpn connect` installs the manager from its
/// image). Recorded in the lab's state file for the agent of a persistent lab.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RealNodeOptions {
    pub count: usize,
    /// Image archives imported into every node's containerd.
    pub images: Vec<ImageArchive>,
    /// The pod sandbox image (one of `images`).
    pub sandbox_image: String,
    /// The lab server image (one of `images`, e.g. `localhost/kvpn/lab-server:0.1.0`
    /// of `cargo xtask image`): the sample workloads run it, pull policy
    /// IfNotPresent, `default/web`'s replicas on different nodes. None: no samples.
    pub samples_image: Option<String>,
    /// The lab server image (one of `images`) to run the cluster DNS from
    /// ([`super::node::cluster_dns`]: Deployment and Service `kube-system/kube-dns`
    /// at the DNS ClusterIP the kubelets give pods). None: no cluster DNS.
    pub cluster_dns_image: Option<String>,
    /// Bound for every node to be Ready with kube-proxy's rules in place.
    pub ready_timeout: Duration,
}

impl RealNodeOptions {
    /// `count` nodes with the project's images (`cargo xtask image`, in
    /// [`super::node::images::project_image_dir`]) imported into every node: pause as
    /// the sandbox, the lab server for the samples and the cluster DNS, the manager
    /// for `kvpn connect` to install; plus `extra` archives (e.g. the lab's busybox,
    /// for workloads that need a shell). An error naming the missing archive and
    /// how to build it.
    pub fn project(count: usize, extra: Vec<ImageArchive>) -> Result<Self, super::node::Error> {
        use super::node::images;
        let mut all = vec![
            images::project_archive("pause")?,
            images::project_archive("lab-server")?,
            images::project_archive("manager")?,
        ];
        all.extend(extra);
        Ok(RealNodeOptions {
            count,
            images: all,
            sandbox_image: images::project_image("pause"),
            samples_image: Some(images::project_image("lab-server")),
            cluster_dns_image: Some(images::project_image("lab-server")),
            ready_timeout: Duration::from_secs(120),
        })
    }
}

impl Default for K8sLabOptions {
    fn default() -> Self {
        K8sLabOptions {
            lab: LabOptions::default().topology_only(),
            workloads: Workloads::default(),
            ready_timeout: Duration::from_secs(60),
            control_plane_step_timeout: Duration::from_secs(120),
            real_nodes: None,
        }
    }
}

impl K8sLabOptions {
    /// Record the lab under `name` and run its node services in `kvpn-lab-agent`, so it
    /// outlives this process (`kvpn lab up`).
    pub fn persist_as(mut self, name: &str) -> Self {
        self.lab = self.lab.persist_as(name);
        self
    }

    /// Real nodes instead of the stand-ins (see [`RealNodeOptions`]); turns the lab's
    /// manager Deployment off, and the sample workloads too unless
    /// [`RealNodeOptions::samples_image`] names their image.
    pub fn real_nodes(mut self, real: RealNodeOptions) -> Self {
        self.workloads = Workloads {
            samples: real.samples_image.is_some(),
            manager: false,
        };
        self.real_nodes = Some(real);
        self
    }

    pub fn workloads(mut self, workloads: Workloads) -> Self {
        self.workloads = workloads;
        self
    }

    /// The address plan of this cluster (pod CIDR, service CIDR and the ClusterIPs
    /// derived from it, uplink). Default: [`Addressing::default`].
    pub fn addressing(mut self, addressing: Addressing) -> Self {
        self.lab.addressing = addressing;
        self
    }

    /// Put this lab's uplink into `other`'s laptop netns: one laptop on two clusters.
    /// Needs an addressing whose uplink, pod and service CIDRs differ from `other`'s
    /// (e.g. [`Addressing::second`]); checked by `up`.
    pub fn laptop_of(self, other: &K8sLab) -> Self {
        self.attach_laptop(other.netns_lab().laptop_netns().clone())
    }

    /// Put this lab's uplink into the existing netns `laptop` (see
    /// [`LabOptions::laptop`]).
    pub fn attach_laptop(mut self, laptop: Netns) -> Self {
        self.lab.laptop = Some(laptop);
        self
    }
}

/// A laptop netns added to a Kubernetes lab with [`K8sLab::add_laptop`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct K8sLaptop {
    /// Its role in the lab (netns `kvpn-<id>-<role>`).
    pub role: String,
    pub netns: Netns,
    /// Its own uplink (a /30 of its own; a host route to the node's main uplink
    /// address, where the API relay listens).
    pub uplink: Uplink,
    /// Kubeconfigs usable from it (the API server at the node's main uplink address).
    pub admin_kubeconfig: PathBuf,
    pub user_kubeconfig: PathBuf,
}

/// `k8s-lab.json`: what another process needs to find and stop the Kubernetes parts.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct K8sLabState {
    pub control_plane_dir: PathBuf,
    pub cluster_name: String,
    /// The apiserver in the host netns (`127.x.y.z:port`).
    pub apiserver: SocketAddr,
    /// Admin kubeconfig for the host netns.
    pub admin_kubeconfig: PathBuf,
    pub laptop_admin_kubeconfig: PathBuf,
    pub laptop_user_kubeconfig: PathBuf,
    pub workloads_manager: bool,
    /// The agent (persistent labs): pid and start time in clock ticks since boot.
    pub agent: Option<(u32, u64)>,
    /// The address plan (absent in older files: the default one).
    #[serde(default)]
    pub addressing: Addressing,
    /// Real nodes, run by the agent (`kvpn lab up --real-nodes`); None: the stand-ins.
    #[serde(default)]
    pub real_nodes: Option<RealNodeOptions>,
}

impl K8sLabState {
    fn path(lab_dir: &Path) -> PathBuf {
        lab_dir.join(STATE_FILE)
    }

    /// Reads `<lab_dir>/k8s-lab.json`; None if the lab has no Kubernetes parts.
    pub fn read(lab_dir: &Path) -> Result<Option<K8sLabState>, Error> {
        let path = Self::path(lab_dir);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(format!("reading {}", path.display()))(e)),
        };
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| Error::State {
                name: lab_dir.display().to_string(),
                message: format!("{} is unreadable: {e}", path.display()),
            })
    }

    fn write(&self, lab_dir: &Path) -> Result<(), Error> {
        let path = Self::path(lab_dir);
        let text = serde_json::to_string_pretty(self).map_err(|e| Error::State {
            name: lab_dir.display().to_string(),
            message: e.to_string(),
        })?;
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, text).map_err(io(format!("writing {}", tmp.display())))?;
        std::fs::rename(&tmp, &path).map_err(io(format!("writing {}", path.display())))
    }
}

/// The node-side services of the lab, threads of one process: API relay, kube-proxy,
/// cluster DNS and kubelet stand-ins. Dropping stops them (kubelet first, so its pods
/// go before the rules and DNS they use).
#[derive(Debug)]
pub struct NodeServices {
    relay: Option<ApiRelay>,
    proxy: Option<KubeProxy>,
    dns: Option<ClusterDns>,
    kubelet: Option<Kubelet>,
    node: crate::Node,
}

impl NodeServices {
    /// Starts relay, kube-proxy, DNS and kubelet for `lab` against the control plane of
    /// `state`. Blocking (each part waits for its first sync): call it on a blocking
    /// thread of a tokio runtime (`spawn_blocking`). On error whatever started is
    /// stopped again.
    pub fn start(lab: &Lab, state: &K8sLabState) -> Result<NodeServices, Error> {
        let t0 = Instant::now();
        let mut services = NodeServices {
            relay: None,
            proxy: None,
            dns: None,
            kubelet: None,
            // A second handle on the same node: stopping DNS removes its pod's veth and
            // netns, which needs only the names.
            node: crate::Node::existing(lab.id(), crate::NODE, lab.node().pod_cidr()),
        };
        let mut ports = vec![API_PORT];
        ports.push(state.apiserver.port());
        let node_ip = lab.uplink().node_ip;
        services.relay = Some(ApiRelay::start(
            lab.node_netns(),
            node_ip,
            &ports,
            state.apiserver,
        )?);
        services.proxy = Some(KubeProxy::start(
            KubeProxyConfig::new(&state.admin_kubeconfig, lab.node_netns().clone())
                .node_ip(node_ip)
                .ipv6_pods(
                    lab.node()
                        .pod_cidr_v6()
                        .map(|v6| (lab.node().pod_cidr(), v6)),
                ),
        )?);
        let a = &state.addressing;
        // The CNI's masquerade and the node agent's preserve step (module `source`):
        // replies to tunnel IPs go to the manager pod holding the stable gateway.
        let bridge = lab.node().bridge().to_owned();
        super::source::install_masquerade(
            lab.node_netns(),
            &bridge,
            &[a.pod_cidr, a.service_cidr],
        )?;
        super::source::install_pool_return(
            lab.node_netns(),
            &bridge,
            super::source::TUNNEL_POOL,
            super::source::STABLE_GATEWAY,
        )?;
        let mut dns_options = ClusterDnsOptions {
            service_ip: a.dns_service_ip(),
            ..ClusterDnsOptions::default()
        };
        dns_options.zone.dns_ip = std::net::IpAddr::V4(a.dns_service_ip());
        dns_options.zone.reverse_cidrs = vec![
            ipnet::IpNet::V4(a.service_cidr),
            ipnet::IpNet::V4(a.pod_cidr),
        ];
        let dns = ClusterDns::deploy(lab.node(), &state.admin_kubeconfig, dns_options)?;
        let dns_pod = (dns.pod().name.clone(), dns.pod().ip);
        let cluster_dns = KubeletDns {
            nameserver: dns.service_ip(),
            domain: super::dns::CLUSTER_DOMAIN.to_owned(),
        };
        services.dns = Some(dns);
        let setup = kubelet_setup(lab, state, dns_pod, cluster_dns)?;
        // Called on a blocking thread of a tokio runtime (see above).
        let kubelet = tokio::runtime::Handle::current()
            .block_on(Kubelet::start_setup(setup))
            .map_err(|e| Error::Kubelet(e.to_string()))?;
        services.kubelet = Some(kubelet);
        tracing::info!(
            elapsed_ms = t0.elapsed().as_millis(),
            "lab node services up"
        );
        Ok(services)
    }

    /// Stops everything in reverse start order.
    pub fn stop(mut self) -> Result<(), Error> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<(), Error> {
        let mut first = None;
        // Dropping the kubelet stops its pods, removes their netns and the Node.
        drop(self.kubelet.take());
        if let Some(dns) = self.dns.take()
            && let Err(e) = dns.stop(&self.node)
        {
            first.get_or_insert(Error::from(e));
        }
        if let Some(proxy) = self.proxy.take()
            && let Err(e) = proxy.stop()
        {
            first.get_or_insert(Error::from(e));
        }
        if let Some(relay) = self.relay.take() {
            relay.stop();
        }
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for NodeServices {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::warn!(error = %e, "lab node services: teardown failed");
        }
    }
}

/// The kubelet stand-in's setup from the lab and the control plane's folder (the agent
/// has no [`ControlPlane`] handle): serving certificate from the lab CA, the DNS pod's
/// IP kept out of its allocation.
fn kubelet_setup(
    lab: &Lab,
    state: &K8sLabState,
    dns_pod: (String, Ipv4Addr),
    cluster_dns: KubeletDns,
) -> Result<KubeletSetup, Error> {
    let pki = state.control_plane_dir.join("pki");
    let read = |f: &str| {
        let path = pki.join(f);
        std::fs::read_to_string(&path).map_err(io(format!("reading {}", path.display())))
    };
    let ca_pem = read("ca.crt")?;
    let ca = super::CertificateAuthority::load(
        &format!("{} CA", state.cluster_name),
        &ca_pem,
        &read("ca.key")?,
    )
    .map_err(super::Error::from)?;
    let listen_ip = match state.apiserver.ip() {
        std::net::IpAddr::V4(ip) => ip,
        std::net::IpAddr::V6(_) => Ipv4Addr::LOCALHOST,
    };
    let node_name = crate::topology::netns_name(lab.id(), crate::NODE);
    let cert = ca
        .issue(&super::pki::CertSpec::server(
            &format!("system:node:{node_name}"),
            &[listen_ip.to_string(), node_name.clone()],
        ))
        .map_err(super::Error::from)?;
    let mut existing_pods: Vec<(String, Ipv4Addr)> =
        lab.pods().iter().map(|p| (p.name.clone(), p.ip)).collect();
    existing_pods.push(dns_pod);
    let config = KubeletConfig {
        cluster_dns: Some(cluster_dns),
        kubernetes_service_ip: Some(state.addressing.kubernetes_service_ip()),
        ..KubeletConfig::default()
    };
    Ok(KubeletSetup {
        lab_id: lab.id().to_owned(),
        pod_cidr: lab.node().pod_cidr(),
        pod_cidr_v6: lab.node().pod_cidr_v6(),
        existing_pods,
        node_name,
        external_ip: Some(lab.uplink().node_ip),
        listen_ip,
        dir: lab.dir().join("kubelet"),
        kubeconfig: state.admin_kubeconfig.clone(),
        cert_pem: cert.cert_pem,
        key_pem: cert.key_pem,
        client_ca_pem: ca_pem,
        config,
    })
}

/// A Kubernetes-backed lab. Dropping an in-process one tears it down; a persistent one
/// is left running (see [`K8sLab::detach`]).
#[derive(Debug)]
pub struct K8sLab {
    // Field order is drop order: node services or real nodes, control plane, the
    // real nodes' network helpers, then the lab.
    services: Option<NodeServices>,
    real_nodes: Option<RealNodes>,
    control_plane: Option<ControlPlane>,
    real_net: Option<(Option<ApiRelay>, EgressProxy)>,
    lab: Option<Lab>,
    state: K8sLabState,
    persistent: bool,
}

fn uplink_url(node_ip: Ipv4Addr) -> String {
    format!("https://{node_ip}:{API_PORT}")
}

/// Writes the laptop kubeconfigs (server `https://<node uplink IP>:6443`, by default
/// `https://172.31.255.1:6443`) next to the control plane's, with the same CA and
/// client certificates.
fn write_laptop_kubeconfigs(
    lab_dir: &Path,
    cp_dir: &Path,
    cluster: &str,
    node_ip: Ipv4Addr,
) -> Result<(PathBuf, PathBuf), Error> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let pki = cp_dir.join("pki");
    let server = uplink_url(node_ip);
    let mut out = Vec::new();
    for (file, cert, user, namespace) in [
        (LAPTOP_ADMIN_KUBECONFIG, ADMIN_USER, ADMIN_USER, None),
        (
            LAPTOP_USER_KUBECONFIG,
            RESTRICTED_USER,
            RESTRICTED_USER,
            Some(KVPN_NAMESPACE),
        ),
    ] {
        let text = kubeconfig::render(&KubeconfigSpec {
            cluster,
            server: &server,
            ca_file: &pki.join("ca.crt"),
            user,
            client_cert_file: &pki.join(format!("{cert}.crt")),
            client_key_file: &pki.join(format!("{cert}.key")),
            namespace,
        });
        let path = lab_dir.join(file);
        let mut f = std::fs::File::options()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .map_err(io(format!("writing {}", path.display())))?;
        std::io::Write::write_all(&mut f, text.as_bytes())
            .map_err(io(format!("writing {}", path.display())))?;
        out.push(path);
    }
    let user = out.pop().unwrap_or_default();
    let admin = out.pop().unwrap_or_default();
    Ok((admin, user))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, Error> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(Error::Kubelet(format!("blocking task failed: {e}"))))
}

/// The node side of a real-node lab against the control plane of `state`: the API
/// relay in the router netns, the nodes ([`RealNodes::start`]), the cluster DNS
/// add-on and the sample workloads, returned once all are ready. Run in-process by
/// [`K8sLab::up`] and by the agent of a persistent lab (`kvpn lab up --real-nodes`);
/// the egress proxy must already serve `<lab>/egress.sock`. On error whatever
/// started is taken back (dropped).
async fn start_real_nodes(
    lab: &Lab,
    state: &K8sLabState,
    real: &RealNodeOptions,
    samples: bool,
    ready_timeout: Duration,
) -> Result<(ApiRelay, RealNodes), Error> {
    let addressing = state.addressing;
    let node_ip = lab.uplink().node_ip;
    let relay = ApiRelay::start(
        lab.node_netns(),
        node_ip,
        &[API_PORT, state.apiserver.port()],
        state.apiserver,
    )?;
    let nodes_config = RealNodesConfig {
        lab_id: lab.id().to_owned(),
        dir: lab.dir().join("nodes"),
        router: lab.node_netns().clone(),
        node_net: super::node::NODE_NET,
        pod_cidrs: super::node::node_pod_cidrs(addressing.pod_cidr, real.count),
        cluster_cidr: addressing.pod_cidr,
        cluster_dns: addressing.dns_service_ip(),
        apiserver_url: uplink_url(node_ip),
        pki_dir: state.control_plane_dir.join("pki"),
        cluster_name: state.cluster_name.clone(),
        admin_kubeconfig: state.admin_kubeconfig.clone(),
        images: real.images.clone(),
        sandbox_image: real.sandbox_image.clone(),
        bin_dir: super::k8s_bin_dir(),
        ready_timeout: real.ready_timeout,
    };
    let nodes = RealNodes::start(nodes_config).await?;
    // The DNS add-on and the samples are applied first and waited for together:
    // their pods start in parallel.
    let client = super::client_from_kubeconfig(&state.admin_kubeconfig).await?;
    let dns =
        real.cluster_dns_image
            .as_ref()
            .map(|image| super::node::cluster_dns::ClusterDnsSpec {
                image: image.clone(),
                service_ip: addressing.dns_service_ip(),
                domain: super::dns::CLUSTER_DOMAIN.to_owned(),
                reverse_cidrs: vec![
                    ipnet::IpNet::V4(addressing.service_cidr),
                    ipnet::IpNet::V4(addressing.pod_cidr),
                ],
            });
    if let Some(spec) = &dns {
        super::node::cluster_dns::apply(&client, spec).await?;
    }
    let samples = Workloads {
        samples: samples && real.samples_image.is_some(),
        manager: false,
    };
    if let Some(image) = real.samples_image.as_ref().filter(|_| samples.samples) {
        workloads::apply_on_real_nodes(&client, samples, &addressing, image).await?;
    }
    if let Some(spec) = &dns {
        super::node::cluster_dns::wait_serving(
            &client,
            &nodes,
            spec,
            addressing.kubernetes_service_ip(),
            ready_timeout,
        )
        .await?;
    }
    if samples.samples {
        workloads::wait_ready(&client, samples, ready_timeout).await?;
    }
    Ok((relay, nodes))
}

impl K8sLab {
    /// Builds the whole lab (see the module docs) and returns once the sample
    /// Deployments are ready. On error everything built so far is torn down.
    pub async fn up(options: K8sLabOptions) -> Result<K8sLab, Error> {
        let t0 = Instant::now();
        let lab_options = LabOptions {
            static_workloads: false,
            ..options.lab.clone()
        }
        .topology_only();
        let persistent = lab_options.persist_as.is_some();
        let addressing = lab_options.addressing;
        let lab = blocking(move || Lab::up(lab_options).map_err(Error::from)).await?;
        let node_ip = lab.uplink().node_ip;
        let cp_dir = lab.dir().join("control-plane");
        let cluster_name = format!("kvpn-lab-{}", lab.id());
        let mut this = K8sLab {
            services: None,
            real_nodes: None,
            real_net: None,
            control_plane: None,
            state: K8sLabState {
                control_plane_dir: cp_dir.clone(),
                cluster_name: cluster_name.clone(),
                apiserver: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
                admin_kubeconfig: cp_dir.join("admin.kubeconfig"),
                laptop_admin_kubeconfig: PathBuf::new(),
                laptop_user_kubeconfig: PathBuf::new(),
                workloads_manager: options.workloads.manager,
                agent: None,
                addressing,
                real_nodes: None,
            },
            lab: Some(lab),
            persistent,
        };
        // From here on an early return drops `this`, which tears down what exists.
        let mut config = ControlPlaneConfig::new(&cp_dir, &cluster_name);
        config.advertise_ip = node_ip;
        config.service_cidr = addressing.service_cidr.to_string();
        if let Some(v6) = addressing.ipv6 {
            config.service_cidr = format!("{},{}", addressing.service_cidr, v6.service_cidr);
            config.dual_stack = true;
        }
        config.kubernetes_service_ip = addressing.kubernetes_service_ip();
        config.tie_to_process = !persistent;
        config.step_timeout = options.control_plane_step_timeout;
        config
            .apiserver_extra_args
            .push(format!("--service-node-port-range={NODE_PORT_RANGE}"));
        if let Some(real) = &options.real_nodes {
            if addressing.ipv6.is_some() {
                return Err(Error::State {
                    name: cluster_name,
                    message:
                        "real nodes are IPv4-only for now: drop --dual-stack (or --real-nodes)"
                            .into(),
                });
            }
            if options.workloads.manager {
                return Err(Error::State {
                    name: cluster_name,
                    message: "real nodes do not run the lab's manager Deployment (`kvpn connect` installs the manager from its image): use K8sLabOptions::real_nodes, which turns it off".into(),
                });
            }
            if options.workloads.samples && real.samples_image.is_none() {
                return Err(Error::State {
                    name: cluster_name,
                    message: "real nodes run the sample workloads only from an image: set RealNodeOptions::samples_image (the lab server image of `cargo xtask image`, imported with RealNodeOptions::images)".into(),
                });
            }
            if real.count == 0 {
                return Err(Error::State {
                    name: cluster_name,
                    message: "real nodes: count must be at least 1".into(),
                });
            }
            let lab = this.lab()?;
            let egress_uds = lab.dir().join(EGRESS_SOCKET);
            config.real_nodes = Some(super::RealNodesControl {
                egress_uds: egress_uds.clone(),
            });
            // A persistent lab's agent serves the socket (see below).
            if !persistent {
                let egress = EgressProxy::start(&egress_uds, lab.node_netns())?;
                this.real_net = Some((None, egress));
            }
        }
        let cp = ControlPlane::start(config).await?;
        this.state.apiserver = SocketAddr::from((cp.listen_ip(), cp.ports().apiserver));
        this.state.admin_kubeconfig = cp.admin_kubeconfig();
        this.control_plane = Some(cp);
        let lab_dir = this.lab()?.dir().to_owned();
        let (admin, user) = write_laptop_kubeconfigs(&lab_dir, &cp_dir, &cluster_name, node_ip)?;
        this.state.laptop_admin_kubeconfig = admin;
        this.state.laptop_user_kubeconfig = user;
        this.state.write(&lab_dir)?;
        tracing::info!(
            elapsed_ms = t0.elapsed().as_millis(),
            "lab control plane up"
        );

        if let Some(real) = &options.real_nodes {
            if persistent {
                // The agent runs the egress proxy, the API relay and the nodes, so
                // they outlive `kvpn lab up` (the apiserver dials the egress socket
                // only when it reaches a kubelet).
                let name = this.lab()?.name().to_owned();
                this.state.real_nodes = Some(real.clone());
                this.state.write(&lab_dir)?;
                let agent = spawn_agent(&name, &lab_dir).await?;
                this.state.agent = Some(agent);
                this.state.write(&lab_dir)?;
            } else {
                let samples = options.workloads.samples;
                let (relay, nodes) = start_real_nodes(
                    this.lab()?,
                    &this.state,
                    real,
                    samples,
                    options.ready_timeout,
                )
                .await?;
                if let Some((r, _)) = &mut this.real_net {
                    *r = Some(relay);
                }
                this.real_nodes = Some(nodes);
            }
            tracing::info!(
                elapsed_ms = t0.elapsed().as_millis(),
                "Kubernetes lab up (real nodes)"
            );
            return Ok(this);
        }

        if persistent {
            let name = this.lab()?.name().to_owned();
            let agent = spawn_agent(&name, &lab_dir).await?;
            this.state.agent = Some(agent);
            this.state.write(&lab_dir)?;
        } else {
            // Moved into the blocking task and back: Lab is Send, not Sync.
            let lab = this.lab.take();
            let state = this.state.clone();
            let (lab, services) = tokio::task::spawn_blocking(move || {
                let services = match &lab {
                    Some(l) => NodeServices::start(l, &state),
                    None => Err(Error::Kubelet("lab vanished".into())),
                };
                (lab, services)
            })
            .await
            .map_err(|e| Error::Kubelet(format!("start task failed: {e}")))?;
            this.lab = lab;
            this.services = Some(services?);
        }

        let client = this.admin_client().await?;
        workloads::apply(&client, options.workloads, &addressing).await?;
        workloads::wait_ready(&client, options.workloads, options.ready_timeout).await?;
        tracing::info!(elapsed_ms = t0.elapsed().as_millis(), "Kubernetes lab up");
        Ok(this)
    }

    fn lab(&self) -> Result<&Lab, Error> {
        self.lab.as_ref().ok_or_else(|| Error::State {
            name: self.state.cluster_name.clone(),
            message: "already torn down".into(),
        })
    }

    /// The real nodes, when the lab runs them ([`K8sLabOptions::real_nodes`]).
    pub fn real_nodes(&self) -> Option<&RealNodes> {
        self.real_nodes.as_ref()
    }

    /// The underlying netns lab (laptop, node, netns lookup, exec).
    pub fn netns_lab(&self) -> &Lab {
        // Only None during `up` and after `down`, neither of which hands out `&self`.
        self.lab
            .as_ref()
            .unwrap_or_else(|| unreachable!("K8sLab without its Lab"))
    }

    pub fn state(&self) -> &K8sLabState {
        &self.state
    }

    /// The address plan (pod and service CIDRs, ClusterIPs, uplink).
    pub fn addressing(&self) -> &Addressing {
        &self.state.addressing
    }

    /// Adds a second (third, …) laptop netns `kvpn-<id>-<role>` (role `laptop2`, …)
    /// with its own uplink (see [`Lab::add_laptop`]); it reaches the API server at the
    /// same address as the first laptop, so the lab's laptop kubeconfigs work there.
    /// Removed with the lab.
    pub fn add_laptop(&mut self, role: &str) -> Result<K8sLaptop, Error> {
        let name = self.state.cluster_name.clone();
        let lab = self.lab.as_mut().ok_or_else(|| Error::State {
            name,
            message: "already torn down".into(),
        })?;
        let extra = lab.add_laptop(role)?;
        Ok(K8sLaptop {
            role: extra.role,
            netns: extra.netns,
            uplink: extra.uplink,
            admin_kubeconfig: self.state.laptop_admin_kubeconfig.clone(),
            user_kubeconfig: self.state.laptop_user_kubeconfig.clone(),
        })
    }

    /// Kubeconfig of the admin for the laptop netns (`https://<node uplink IP>:6443`).
    pub fn laptop_admin_kubeconfig(&self) -> &Path {
        &self.state.laptop_admin_kubeconfig
    }

    /// Kubeconfig of the restricted user `kvpn-user` for the laptop netns.
    pub fn laptop_user_kubeconfig(&self) -> &Path {
        &self.state.laptop_user_kubeconfig
    }

    /// Admin kubeconfig for the host netns (the apiserver's loopback address).
    pub fn admin_kubeconfig(&self) -> &Path {
        &self.state.admin_kubeconfig
    }

    pub async fn admin_client(&self) -> Result<kube::Client, Error> {
        Ok(super::client_from_kubeconfig(&self.state.admin_kubeconfig).await?)
    }

    /// What runs where, for people (`kvpn lab up` prints it).
    pub fn info(&self) -> String {
        info_text(self.netns_lab(), &self.state)
    }

    /// Leaves a persistent lab running after this process; returns its state file.
    pub fn detach(mut self) -> Result<PathBuf, Error> {
        if !self.persistent {
            return Err(LabError::NotPersistent {
                name: self.state.cluster_name.clone(),
            }
            .into());
        }
        if let Some(cp) = self.control_plane.take() {
            cp.detach()?;
        }
        let lab = self.lab.take().ok_or_else(|| Error::State {
            name: self.state.cluster_name.clone(),
            message: "already torn down".into(),
        })?;
        Ok(lab.detach()?)
    }

    /// Tears everything down: node services (or the agent), control plane, lab.
    pub fn down(mut self) -> Result<(), Error> {
        self.teardown()
    }

    fn teardown(&mut self) -> Result<(), Error> {
        let mut first: Option<Error> = None;
        if let Some(s) = self.services.take()
            && let Err(e) = s.stop()
        {
            first.get_or_insert(e);
        }
        if let Some(n) = self.real_nodes.take()
            && let Err(e) = n.stop()
        {
            first.get_or_insert(e.into());
        }
        if let Some((pid, ticks)) = self.state.agent.take() {
            stop_agent(pid, ticks);
        }
        if let Some(cp) = self.control_plane.take()
            && let Err(e) = cp.stop()
        {
            first.get_or_insert(e.into());
        }
        if let Some((relay, egress)) = self.real_net.take() {
            if let Some(r) = relay {
                r.stop();
            }
            egress.stop();
        }
        if let Some(mut lab) = self.lab.take()
            && let Err(e) = lab.down()
        {
            first.get_or_insert(e.into());
        }
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for K8sLab {
    fn drop(&mut self) {
        if self.lab.is_some()
            && let Err(e) = self.teardown()
        {
            tracing::error!(error = %e, "Kubernetes lab teardown failed");
            eprintln!("kvpn-lab: teardown of the Kubernetes lab failed: {e}");
        }
    }
}

/// What runs where, from the netns lab and its Kubernetes state.
pub fn info_text(lab: &Lab, state: &K8sLabState) -> String {
    use std::fmt::Write as _;
    let mut s = lab.info();
    let a = &state.addressing;
    let node_ip = lab.uplink().node_ip;
    let _ = writeln!(
        s,
        "  control plane (host netns, {}): etcd, kube-apiserver https://{}, kube-controller-manager; folder {}",
        state.cluster_name,
        state.apiserver,
        state.control_plane_dir.display()
    );
    let _ = writeln!(
        s,
        "  apiserver relay: {node_ip}:{API_PORT} in the node netns -> {} (laptop and pods; `kubernetes` Service {}:443)",
        state.apiserver,
        a.kubernetes_service_ip()
    );
    let where_ = match state.agent {
        Some((pid, _)) => format!(
            "in kvpn-lab-agent (pid {pid}, log {})",
            lab.dir().join("agent.log").display()
        ),
        None => "as threads of this process".to_owned(),
    };
    match &state.real_nodes {
        Some(real) => {
            let _ = writeln!(
                s,
                "  real nodes {where_}: {} (netns + mount namespace each; containerd 1.6 + runc, CNI bridge, kubelet and kube-proxy 1.20.2, logs in {}), kube-scheduler; cluster DNS pod kube-system/kube-dns (Service {}:53 -> 5353)",
                (1..=real.count)
                    .map(|i| crate::topology::netns_name(lab.id(), &format!("n{i}")))
                    .collect::<Vec<_>>()
                    .join(", "),
                lab.dir().join("nodes").display(),
                a.dns_service_ip()
            );
        }
        None => {
            let _ = writeln!(
                s,
                "  node services {where_}: kubelet stand-in (pods = kvpn-{}-<pod>-<uid> netns), kube-proxy stand-in (nftables table ip kvpn_proxy in the node netns), cluster DNS (pod kube-dns, Service {})",
                lab.id(),
                a.dns_service_ip()
            );
        }
    }
    let _ = writeln!(
        s,
        "  workloads: default/web (2 pods; Services web {}:80, echo {}:7, udp-echo {}:7/udp, backend :8080+:7007, web-headless), dev/web{}",
        a.web_cluster_ip(),
        a.echo_cluster_ip(),
        a.udp_echo_cluster_ip(),
        if state.workloads_manager {
            format!("; kvpn-system/kvpn-manager (NodePort {node_ip}:10801 from the laptop)")
        } else {
            String::new()
        }
    );
    let _ = writeln!(
        s,
        "  kubeconfigs for the laptop netns: admin {} ; restricted kvpn-user {}",
        state.laptop_admin_kubeconfig.display(),
        state.laptop_user_kubeconfig.display()
    );
    let _ = writeln!(
        s,
        "  host-netns admin kubeconfig: {}",
        state.admin_kubeconfig.display()
    );
    let _ = writeln!(
        s,
        "  try: {} laptop -- kubectl --kubeconfig {} get pods -A -o wide",
        crate::lab_cmd("exec", lab.name()),
        state.laptop_admin_kubeconfig.display()
    );
    s
}

// --- the agent (persistent labs) -----------------------------------------------------

async fn spawn_agent(name: &str, lab_dir: &Path) -> Result<(u32, u64), Error> {
    let bin = crate::bin_path(AGENT_BIN)?;
    let log_path = lab_dir.join("agent.log");
    let ready = lab_dir.join(AGENT_READY_FILE);
    let _ = std::fs::remove_file(&ready);
    let log =
        std::fs::File::create(&log_path).map_err(io(format!("creating {}", log_path.display())))?;
    let log2 = log
        .try_clone()
        .map_err(io(format!("opening {}", log_path.display())))?;
    let mut child = std::process::Command::new(&bin)
        .args(["--lab", name])
        .stdin(std::process::Stdio::null())
        .stdout(log)
        .stderr(log2)
        .spawn()
        .map_err(io(format!("starting {}", bin.display())))?;
    let pid = child.id();
    let agent_error = |message: String| Error::Agent {
        message,
        log: log_path.clone(),
        tail: crate::process::log_tail(&log_path, 3000),
    };
    let t0 = Instant::now();
    let timeout = AGENT_START_TIMEOUT;
    loop {
        if ready.exists() {
            break;
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(agent_error(format!("exited with {status} during start-up")));
        }
        if t0.elapsed() > timeout {
            // SIGTERM first: a real-node agent takes its nodes back on it.
            stop_agent(pid, 0);
            let _ = child.kill();
            let _ = child.wait();
            return Err(agent_error(format!("not ready after {timeout:?}")));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ticks = crate::process::proc_stat(pid).map_or(0, |s| s.start_ticks);
    // The agent outlives us: dropping `child` neither kills nor waits for it.
    drop(child);
    Ok((pid, ticks))
}

/// Marks the agent ready (called by the agent once its node services run).
pub fn mark_agent_ready(lab_dir: &Path) -> Result<(), Error> {
    let path = lab_dir.join(AGENT_READY_FILE);
    std::fs::write(&path, std::process::id().to_string())
        .map_err(io(format!("writing {}", path.display())))
}

/// SIGTERM, up to [`AGENT_STOP_TIMEOUT`] for the agent to remove its pods (or stop
/// its real nodes), then SIGKILL. Only signals the
/// process if it is still the one recorded (same start time).
fn stop_agent(pid: u32, ticks: u64) {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let same = || {
        crate::process::proc_stat(pid)
            .is_some_and(|s| (ticks == 0 || s.start_ticks == ticks) && s.state != 'Z')
    };
    let Ok(raw) = i32::try_from(pid) else { return };
    if !same() {
        return;
    }
    let _ = kill(Pid::from_raw(raw), Signal::SIGTERM);
    let deadline = Instant::now() + AGENT_STOP_TIMEOUT;
    while same() && Instant::now() < deadline {
        // Our child in the in-process case: reap it so it does not stay a zombie.
        let _ = nix::sys::wait::waitpid(
            Pid::from_raw(raw),
            Some(nix::sys::wait::WaitPidFlag::WNOHANG),
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    if same() {
        tracing::warn!(pid, "kvpn-lab-agent ignored SIGTERM; killing it");
        let _ = kill(Pid::from_raw(raw), Signal::SIGKILL);
        let _ = nix::sys::wait::waitpid(Pid::from_raw(raw), None);
    }
}

/// Tears down the persistent lab `name` from any process: the agent, the control
/// plane, then the netns lab. `Ok(false)` if no lab of that name is up.
pub fn down_named(name: &str) -> Result<bool, Error> {
    let mut lab = match Lab::attach(name) {
        Ok(lab) => lab,
        Err(LabError::NotUp { .. }) => return Ok(false),
        Err(e) => return Err(e.into()),
    };
    let mut first: Option<Error> = None;
    match K8sLabState::read(lab.dir()) {
        Ok(Some(state)) => {
            if let Some((pid, ticks)) = state.agent {
                stop_agent(pid, ticks);
            }
            if let Some(real) = &state.real_nodes {
                // The agent stops its nodes on SIGTERM; one killed instead (hung, or
                // SIGKILLed by someone) leaves them: say what, before the lab's
                // folder and netns go.
                let nodes_dir = lab.dir().join("nodes");
                let mut left = super::node::leftovers(lab.id(), &nodes_dir, real.count);
                if !left.is_empty() {
                    tracing::warn!(?left, "the agent left its real nodes; taking them back");
                    for e in super::node::reclaim(lab.id(), &nodes_dir, real.count) {
                        tracing::warn!(error = %e, "reclaiming a real node");
                    }
                    // The node netns go with the lab below.
                    left = super::node::leftovers(lab.id(), &nodes_dir, real.count)
                        .into_iter()
                        .filter(|l| !l.starts_with("netns "))
                        .collect();
                }
                if !left.is_empty() {
                    first.get_or_insert(Error::State {
                        name: name.to_owned(),
                        message: format!(
                            "the agent did not take its real nodes back (see {}): left {} — stop those processes by pid, unmount the mounts, rmdir the cgroups",
                            lab.dir().join("agent.log").display(),
                            left.join("; ")
                        ),
                    });
                }
            }
            if let Err(e) =
                ControlPlane::stop_dir(&state.control_plane_dir, Duration::from_secs(10))
            {
                first.get_or_insert(e.into());
            }
        }
        Ok(None) => {}
        Err(e) => {
            first.get_or_insert(e);
        }
    }
    if let Err(e) = lab.down() {
        first.get_or_insert(e.into());
    }
    match first {
        Some(e) => Err(e),
        None => Ok(true),
    }
}

/// The agent's work (lab/src/bin/kvpn-lab-agent.rs): attach to the persistent lab
/// `name`, start its node services, mark ready, run until `stop` resolves, stop them.
pub async fn run_agent(
    name: &str,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), Error> {
    let lab = Lab::attach(name)?;
    let dir = lab.dir().to_owned();
    let state = K8sLabState::read(&dir)?.ok_or_else(|| Error::State {
        name: name.to_owned(),
        message: format!("no {STATE_FILE} in {}: not a Kubernetes lab", dir.display()),
    })?;
    if let Some(real) = state.real_nodes.clone() {
        return run_real_node_agent(lab, &state, &real, stop).await;
    }
    let (lab, services) = tokio::task::spawn_blocking(move || {
        let services = NodeServices::start(&lab, &state);
        (lab, services)
    })
    .await
    .map_err(|e| Error::Kubelet(format!("start task failed: {e}")))?;
    let services = services?;
    mark_agent_ready(&dir)?;
    tracing::info!(lab = %lab.name(), "kvpn-lab-agent: node services running");
    stop.await;
    tracing::info!(lab = %lab.name(), "kvpn-lab-agent: stopping node services");
    tokio::task::spawn_blocking(move || services.stop())
        .await
        .map_err(|e| Error::Kubelet(format!("stop task failed: {e}")))??;
    let _ = std::fs::remove_file(dir.join(AGENT_READY_FILE));
    Ok(())
}

/// [`run_agent`] of a real-node lab: the egress proxy, then [`start_real_nodes`];
/// on `stop` the nodes go first (their pods, cgroups, mount namespaces, netns), then
/// the relay and the proxy. The control plane is `kvpn lab down`'s to stop, after
/// this.
async fn run_real_node_agent(
    lab: Lab,
    state: &K8sLabState,
    real: &RealNodeOptions,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), Error> {
    let dir = lab.dir().to_owned();
    let egress = EgressProxy::start(&dir.join(EGRESS_SOCKET), lab.node_netns())?;
    let samples = real.samples_image.is_some();
    tokio::pin!(stop);
    // A stop during start-up drops the start, which takes back what it started.
    let (relay, nodes) = tokio::select! {
        r = start_real_nodes(&lab, state, real, samples, real.ready_timeout) => r?,
        () = &mut stop => {
            tracing::info!(lab = %lab.name(), "kvpn-lab-agent: stopped during start-up");
            egress.stop();
            return Ok(());
        }
    };
    mark_agent_ready(&dir)?;
    tracing::info!(lab = %lab.name(), nodes = real.count, "kvpn-lab-agent: real nodes running");
    stop.await;
    tracing::info!(lab = %lab.name(), "kvpn-lab-agent: stopping the real nodes");
    let result = tokio::task::spawn_blocking(move || nodes.stop())
        .await
        .map_err(|e| Error::Kubelet(format!("stop task failed: {e}")))?;
    relay.stop();
    egress.stop();
    let _ = std::fs::remove_file(dir.join(AGENT_READY_FILE));
    Ok(result?)
}
