//! Real Kubernetes nodes for the lab (lab-only code): each node is a network
//! namespace plus a private mount namespace running Debian's containerd 1.6 (runc,
//! CNI bridge + host-local + portmap + loopback), a real kubelet and kube-proxy
//! (iptables mode) of Kubernetes 1.20.2, registered with the lab's control plane.
//!
//! Topology (addresses of the default [`RealNodesConfig::node_net`]):
//!
//! ```text
//!  laptop ── uplink ── router netns (the lab's `node` netns: API relay on 172.31.255.1)
//!                        │ bridge kv<id>nb 172.30.0.1/24
//!          ┌─────────────┴─────────────┐
//!   kvpn-<id>-n1 eth0 172.30.0.11   kvpn-<id>-n2 eth0 172.30.0.12
//!   cni bridge kv<id>cni 10.244.2.1  cni bridge kv<id>cni 10.244.3.1
//! ```
//!
//! Each node's default route points at the router, which routes every node's pod CIDR
//! to that node; nodes route each other's pod CIDRs directly over the shared bridge
//! (like a host-gw overlay). The kubelets and kube-proxies reach the apiserver through
//! the lab's API relay on the router's uplink address; the apiserver reaches kubelets
//! through [`egress::EgressProxy`] (its egress selector), which dials from the router.
//!
//! What each node owns and how it is taken back (reverse order on stop, drop or a
//! failed start): kube-proxy, kubelet and containerd processes (by pid, SIGTERM then
//! SIGKILL) → every process left in its cgroup subtree (shims, containers; SIGKILL)
//! and the subtree itself in every hierarchy → its mount namespace (tmpfs, rootfs
//! overlays, pod netns pins, CNI state) → its netns (veth, CNI bridge, iptables
//! chains of kube-proxy, kubelet and the CNI plugins). The global sysctls the kubelet
//! changes are put back once the nodes are Ready and again on stop.
//!
//! I/O everywhere except [`render`] (configuration files) and the address plan
//! ([`NodePlan`]).

pub mod cluster_dns;
pub mod egress;
pub mod host;
pub mod images;
pub mod render;

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ipnet::Ipv4Net;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};

use super::kubeconfig::{self, KubeconfigSpec};
use super::pki::{CertSpec, CertificateAuthority};
use super::process::{Managed, Spawner};
use crate::netns::Netns;
use crate::topology::netns_name;
use host::{GlobalSysctls, KubeletStartLock, MountNs, NodeCgroup, NodeEntry};

/// Errors of the real nodes.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{cmd}` failed ({status}): {stderr}")]
    Command {
        cmd: String,
        status: String,
        stderr: String,
    },
    #[error("{what}: {source} — the lab needs root with CAP_SYS_ADMIN")]
    Mount {
        what: String,
        #[source]
        source: nix::Error,
    },
    #[error("cgroup {path}: {message}")]
    Cgroup { path: PathBuf, message: String },
    #[error("{name} not found at {path} — {hint}")]
    MissingBinary {
        name: String,
        path: PathBuf,
        hint: &'static str,
    },
    #[error("real node {node}: {message}")]
    Node { node: String, message: String },
    #[error(
        "real node {node}: {what} exited during start-up ({status}); last lines of {log}:\n{tail}"
    )]
    Exited {
        node: String,
        what: &'static str,
        status: String,
        log: PathBuf,
        tail: String,
    },
    #[error("real nodes not ready after {after:?}: {message}")]
    NotReady { after: Duration, message: String },
    #[error(transparent)]
    Lab(#[from] crate::LabError),
    #[error(transparent)]
    ControlPlane(Box<super::Error>),
    #[error(transparent)]
    Egress(#[from] egress::Error),
}

impl From<super::Error> for Error {
    fn from(e: super::Error) -> Self {
        Error::ControlPlane(Box::new(e))
    }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}

/// An OCI (or docker) image archive to import into every node's containerd
/// (`ctr -n k8s.io images import`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ImageArchive {
    pub path: PathBuf,
    /// `--base-name`: names the archive's tagged images `<base>:<tag>` when they carry
    /// only a tag (umoci's `org.opencontainers.image.ref.name`).
    pub base_name: Option<String>,
}

/// How to bring up the nodes.
#[derive(Debug, Clone)]
pub struct RealNodesConfig {
    /// The lab's id (`kvpn-<id>-n<i>` netns and node names, `kv<id>…` links).
    pub lab_id: String,
    /// Folder for the nodes' files (configs, certificates, logs): `<dir>/n<i>/`.
    pub dir: PathBuf,
    /// The netns the nodes hang off (the lab's `node` netns, which holds the uplink
    /// and the API relay).
    pub router: Netns,
    /// The nodes' network: the router takes the first host, node `i` the host `10+i`.
    pub node_net: Ipv4Net,
    /// One pod CIDR per node; their count is the number of nodes.
    pub pod_cidrs: Vec<Ipv4Net>,
    /// The whole cluster pod CIDR (kube-proxy's `clusterCIDR`).
    pub cluster_cidr: Ipv4Net,
    /// The cluster DNS Service address (kubelet `clusterDNS`).
    pub cluster_dns: Ipv4Addr,
    /// The apiserver as the nodes reach it (the API relay, `https://172.31.255.1:6443`).
    pub apiserver_url: String,
    /// The control plane's `pki/` (ca.crt, ca.key): the nodes' certificates come from
    /// the same CA.
    pub pki_dir: PathBuf,
    /// The control plane's name (CA common name `<name> CA`, kubeconfig cluster name).
    pub cluster_name: String,
    /// Admin kubeconfig in the host netns (to watch and patch Nodes).
    pub admin_kubeconfig: PathBuf,
    pub images: Vec<ImageArchive>,
    /// The pod sandbox image (must be in one of `images`).
    pub sandbox_image: String,
    /// Folder with kubelet and kube-proxy ([`super::k8s_bin_dir`]).
    pub bin_dir: PathBuf,
    /// Bound for all nodes to become Ready.
    pub ready_timeout: Duration,
}

/// The default node network (see the module docs).
pub const NODE_NET: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(172, 30, 0, 0), 24);

/// One node's place in the address plan (pure).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePlan {
    /// 1-based.
    pub index: usize,
    /// Node name = netns name: `kvpn-<id>-n<index>`.
    pub name: String,
    pub ip: Ipv4Addr,
    pub pod_cidr: Ipv4Net,
}

/// The port of the lab's plain-HTTP registry on the router's node-network address
/// (nothing listens there unless a test starts a registry): every node's containerd
/// pulls `<router>:5000/…` images over HTTP.
pub const LAB_REGISTRY_PORT: u16 = 5000;

/// The router's address on the node network (its first host).
pub fn router_ip(node_net: Ipv4Net) -> Ipv4Addr {
    node_net.hosts().next().unwrap_or(node_net.addr())
}

/// The plan of every node: names, node addresses (`10+i`th host), pod CIDRs.
pub fn plan(lab_id: &str, node_net: Ipv4Net, pod_cidrs: &[Ipv4Net]) -> Vec<NodePlan> {
    let base = u32::from(node_net.network());
    pod_cidrs
        .iter()
        .enumerate()
        .map(|(i, cidr)| {
            let index = i + 1;
            // At most a few nodes: 10 + index stays far inside a /24.
            let ip = Ipv4Addr::from(base + 10 + index as u32);
            NodePlan {
                index,
                name: netns_name(lab_id, &format!("n{index}")),
                ip,
                pod_cidr: *cidr,
            }
        })
        .collect()
}

/// The `count` node pod CIDRs: consecutive /24s of `cluster_cidr` from its third /24
/// on (the first two stay with the lab's router bridge, `10.244.1.0/24` by default).
pub fn node_pod_cidrs(cluster_cidr: Ipv4Net, count: usize) -> Vec<Ipv4Net> {
    cluster_cidr
        .subnets(24)
        .map(|s| s.skip(2).take(count).collect())
        .unwrap_or_default()
}

fn bridge_name(lab_id: &str) -> String {
    format!("kv{lab_id}nb")
}

fn cni_bridge_name(lab_id: &str) -> String {
    format!("kv{lab_id}cni")
}

fn router_link_name(lab_id: &str, index: usize) -> String {
    format!("kv{lab_id}n{index}")
}

/// One running node.
#[derive(Debug)]
pub struct RealNode {
    pub plan: NodePlan,
    netns: Netns,
    dir: PathBuf,
    // Teardown order: processes, cgroup, mount namespace, netns (see `stop`).
    processes: Vec<Managed>,
    entry: Option<NodeEntry>,
    cgroup: Option<NodeCgroup>,
    mntns: Option<MountNs>,
    netns_created: bool,
}

impl RealNode {
    pub fn name(&self) -> &str {
        &self.plan.name
    }

    pub fn netns(&self) -> &Netns {
        &self.netns
    }

    /// The node's folder (configs, certificates, logs `containerd.log`, `kubelet.log`,
    /// `kube-proxy.log`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Runs `program args` inside the node (its netns, mount namespace and cgroup),
    /// e.g. `ctr -n k8s.io containers ls`.
    pub fn exec(&self, program: &str, args: &[&str]) -> Result<String, Error> {
        let entry = self.entry.as_ref().ok_or_else(|| Error::Node {
            node: self.plan.name.clone(),
            message: "already stopped".into(),
        })?;
        host::run_in_node(entry, program, args)
    }

    fn check_running(&mut self) -> Result<(), Error> {
        for p in &mut self.processes {
            if let Some(status) = p.exited() {
                let what = match p.record.name.as_str() {
                    "containerd" => "containerd",
                    "kubelet" => "kubelet",
                    _ => "kube-proxy",
                };
                return Err(Error::Exited {
                    node: self.plan.name.clone(),
                    what,
                    status,
                    log: p.record.log.clone(),
                    tail: super::process::log_tail(&p.record.log, 30),
                });
            }
        }
        Ok(())
    }

    /// Stops everything of this node (see the module docs). Idempotent; returns the
    /// first error but always tries every step.
    fn stop(&mut self) -> Result<(), Error> {
        let mut first: Option<Error> = None;
        for p in self.processes.iter_mut().rev() {
            if let Err(e) = p.stop(Duration::from_secs(5)) {
                first.get_or_insert(e.into());
            }
        }
        self.processes.clear();
        self.entry = None;
        if let Some(mut cg) = self.cgroup.take()
            && let Err(e) = cg.remove()
        {
            first.get_or_insert(e);
        }
        if let Some(mut ns) = self.mntns.take() {
            // Anything still in the mount namespace (a shim outside the cgroup, a
            // CNI plugin caught mid-run) is the node's: kill it before unpinning.
            if let Some(ino) = ns.inode() {
                for pid in host::pids_in_mount_ns(ino) {
                    if let Ok(raw) = i32::try_from(pid) {
                        let _ = nix::sys::signal::kill(
                            nix::unistd::Pid::from_raw(raw),
                            nix::sys::signal::Signal::SIGKILL,
                        );
                    }
                }
            }
            if let Err(e) = ns.remove() {
                first.get_or_insert(e);
            }
        }
        if self.netns_created {
            if let Err(e) = self.netns.delete() {
                first.get_or_insert(e.into());
            }
            self.netns_created = false;
        }
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for RealNode {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::warn!(node = %self.plan.name, error = %e, "real node teardown incomplete");
        }
    }
}

/// The running nodes. Dropping them stops them (like [`RealNodes::stop`]).
#[derive(Debug)]
pub struct RealNodes {
    config: RealNodesConfig,
    nodes: Vec<RealNode>,
    sysctls: Option<GlobalSysctls>,
    /// Held from saving the sysctls until they are back after the kubelets started.
    start_lock: Option<KubeletStartLock>,
    router_bridge: bool,
    // Last: the processes are tied to this thread's life (PR_SET_PDEATHSIG).
    spawner: Option<Spawner>,
    startup: Duration,
}

fn require_binary(name: &str, path: &Path, hint: &'static str) -> Result<(), Error> {
    if path.is_file() {
        Ok(())
    } else {
        Err(Error::MissingBinary {
            name: name.to_owned(),
            path: path.to_owned(),
            hint,
        })
    }
}

const K8S_HINT: &str = "scripts/build-kubernetes.sh builds and caches kubelet and kube-proxy";
const DEBIAN_HINT: &str =
    "install Debian's containerd, runc and containernetworking-plugins (scripts/setup.sh does)";

impl RealNodes {
    /// Brings up every node of `config` and returns once all are Ready (kubelet
    /// registered, CNI configured), their pod CIDRs are set and kube-proxy has
    /// programmed its chains. On error everything started is taken back.
    pub async fn start(config: RealNodesConfig) -> Result<RealNodes, Error> {
        let t0 = Instant::now();
        for (name, path, hint) in [
            ("kubelet", config.bin_dir.join("kubelet"), K8S_HINT),
            ("kube-proxy", config.bin_dir.join("kube-proxy"), K8S_HINT),
            (
                "containerd",
                PathBuf::from("/usr/bin/containerd"),
                DEBIAN_HINT,
            ),
            ("ctr", PathBuf::from("/usr/bin/ctr"), DEBIAN_HINT),
            ("runc", PathBuf::from("/usr/sbin/runc"), DEBIAN_HINT),
            (
                "the CNI bridge plugin",
                Path::new(render::CNI_BIN_DIR).join("bridge"),
                DEBIAN_HINT,
            ),
        ] {
            require_binary(name, &path, hint)?;
        }
        for image in &config.images {
            if !image.path.is_file() {
                return Err(Error::Node {
                    node: "(all)".into(),
                    message: format!(
                        "image archive {} does not exist — build it first (`cargo xtask image`)",
                        image.path.display()
                    ),
                });
            }
        }
        std::fs::create_dir_all(&config.dir)
            .map_err(io(format!("creating {}", config.dir.display())))?;
        let start_lock =
            KubeletStartLock::take(&config.bin_dir.join("kubelet"), config.ready_timeout)?;
        let mut this = RealNodes {
            nodes: Vec::new(),
            sysctls: Some(GlobalSysctls::save()?),
            start_lock: Some(start_lock),
            router_bridge: false,
            spawner: Some(Spawner::new()?),
            startup: Duration::ZERO,
            config,
        };
        // From here on an early return drops `this`, which takes everything back.
        this.plumb_router()?;
        let plans = plan(
            &this.config.lab_id,
            this.config.node_net,
            &this.config.pod_cidrs,
        );
        for p in &plans {
            let node = this.start_node(p.clone(), &plans)?;
            this.nodes.push(node);
        }
        this.wait_ready(t0).await?;
        this.startup = t0.elapsed();
        tracing::info!(
            nodes = this.nodes.len(),
            elapsed_ms = this.startup.as_millis(),
            "real nodes Ready"
        );
        Ok(this)
    }

    /// How long [`RealNodes::start`] took (netns to Ready nodes with kube-proxy rules).
    pub fn startup(&self) -> Duration {
        self.startup
    }

    pub fn nodes(&self) -> &[RealNode] {
        &self.nodes
    }

    fn plumb_router(&mut self) -> Result<(), Error> {
        let c = &self.config;
        let br = bridge_name(&c.lab_id);
        c.router.ip_batch(&[
            format!("link add {br} type bridge"),
            format!(
                "addr add {}/{} dev {br}",
                router_ip(c.node_net),
                c.node_net.prefix_len()
            ),
            format!("link set {br} up"),
        ])?;
        self.router_bridge = true;
        Ok(())
    }

    fn start_node(&self, plan: NodePlan, all: &[NodePlan]) -> Result<RealNode, Error> {
        let t0 = Instant::now();
        let c = &self.config;
        let dir = c.dir.join(format!("n{}", plan.index));
        std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
        let mut node = RealNode {
            netns: Netns::from_name(&plan.name),
            plan,
            dir,
            processes: Vec::new(),
            entry: None,
            cgroup: None,
            mntns: None,
            netns_created: false,
        };
        // An early return drops `node`, which takes back what exists.
        Netns::create(&node.plan.name)?;
        node.netns_created = true;
        self.plumb_node(&node, all)?;
        let files = self.write_files(&node)?;
        let cgroup = NodeCgroup::create(&node.plan.name)?;
        let mntns = MountNs::create(&node.dir.join("ns"), &node.plan.name)?;
        let entry = NodeEntry::open(&node.netns.path(), &mntns, &cgroup)?;
        node.cgroup = Some(cgroup);
        node.mntns = Some(mntns);
        node.entry = Some(entry);
        let t_ns = t0.elapsed();

        self.spawn(
            &mut node,
            "containerd",
            Path::new("/usr/bin/containerd"),
            vec![format!("--config={}", files.containerd.display())],
        )?;
        self.wait_containerd(&mut node)?;
        let t_containerd = t0.elapsed();
        for image in &c.images {
            let path = image.path.to_string_lossy().into_owned();
            let mut args = vec!["-n", "k8s.io", "images", "import"];
            if let Some(base) = &image.base_name {
                args.extend(["--base-name", base.as_str()]);
            }
            args.push(&path);
            node.exec("ctr", &args)?;
        }
        let t_images = t0.elapsed();
        let kubelet = c.bin_dir.join("kubelet");
        let (ip, name) = (node.plan.ip, node.plan.name.clone());
        self.spawn(
            &mut node,
            "kubelet",
            &kubelet,
            vec![
                format!("--config={}", files.kubelet_config.display()),
                format!("--kubeconfig={}", files.kubelet_kubeconfig.display()),
                "--container-runtime=remote".into(),
                format!(
                    "--container-runtime-endpoint=unix://{}",
                    render::CONTAINERD_SOCKET
                ),
                format!("--node-ip={ip}"),
                format!("--hostname-override={name}"),
                "--v=1".into(),
            ],
        )?;
        let proxy = c.bin_dir.join("kube-proxy");
        self.spawn(
            &mut node,
            "kube-proxy",
            &proxy,
            vec![
                format!("--config={}", files.kube_proxy_config.display()),
                "--v=1".into(),
            ],
        )?;
        tracing::info!(
            node = %node.plan.name,
            namespaces_ms = t_ns.as_millis(),
            containerd_ms = t_containerd.as_millis(),
            images_ms = t_images.as_millis(),
            spawned_ms = t0.elapsed().as_millis(),
            "real node started"
        );
        Ok(node)
    }

    /// Node side: lo, eth0 (veth from the router's bridge), default route via the
    /// router, the other nodes' pod CIDRs via their addresses; router side: each pod
    /// CIDR via its node.
    fn plumb_node(&self, node: &RealNode, all: &[NodePlan]) -> Result<(), Error> {
        let c = &self.config;
        let p = &node.plan;
        let link = router_link_name(&c.lab_id, p.index);
        c.router.ip_batch(&[
            format!("link add {link} type veth peer name eth0 netns {}", p.name),
            format!("link set {link} master {} up", bridge_name(&c.lab_id)),
            format!("route add {} via {}", p.pod_cidr, p.ip),
        ])?;
        let mut lines = vec![
            "link set lo up".to_owned(),
            format!("addr add {}/{} dev eth0", p.ip, c.node_net.prefix_len()),
            "link set eth0 up".to_owned(),
            format!("route add default via {}", router_ip(c.node_net)),
        ];
        for other in all.iter().filter(|o| o.index != p.index) {
            lines.push(format!("route add {} via {}", other.pod_cidr, other.ip));
        }
        node.netns.ip_batch(&lines)?;
        node.netns.set_sysctls(&[
            ("net.ipv4.ip_forward", "1"),
            ("net.bridge.bridge-nf-call-iptables", "1"),
        ])?;
        Ok(())
    }

    fn write_files(&self, node: &RealNode) -> Result<NodeFiles, Error> {
        let c = &self.config;
        let p = &node.plan;
        let d = &node.dir;
        let write = |name: &str, text: &str, secret: bool| -> Result<PathBuf, Error> {
            use std::os::unix::fs::OpenOptionsExt as _;
            let path = d.join(name);
            let mut f = std::fs::File::options()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(if secret { 0o600 } else { 0o644 })
                .open(&path)
                .map_err(io(format!("writing {}", path.display())))?;
            std::io::Write::write_all(&mut f, text.as_bytes())
                .map_err(io(format!("writing {}", path.display())))?;
            Ok(path)
        };
        let read = |f: &str| {
            let path = c.pki_dir.join(f);
            std::fs::read_to_string(&path).map_err(io(format!("reading {}", path.display())))
        };
        let ca_pem = read("ca.crt")?;
        let ca = CertificateAuthority::load(
            &format!("{} CA", c.cluster_name),
            &ca_pem,
            &read("ca.key")?,
        )
        .map_err(super::Error::from)?;
        let issue = |spec: &CertSpec| ca.issue(spec).map_err(super::Error::from);
        let serving = issue(&CertSpec::server(
            &p.name,
            &[p.ip.to_string(), p.name.clone()],
        ))?;
        let kubelet_client = issue(&CertSpec::client(
            &format!("system:node:{}", p.name),
            &["system:nodes"],
        ))?;
        let proxy_client = issue(&CertSpec::client("system:kube-proxy", &[]))?;
        let ca_file = write("ca.crt", &ca_pem, false)?;
        let kubelet_crt = write("kubelet.crt", &serving.cert_pem, false)?;
        let kubelet_key = write("kubelet.key", &serving.key_pem, true)?;
        let kc_crt = write("kubelet-client.crt", &kubelet_client.cert_pem, false)?;
        let kc_key = write("kubelet-client.key", &kubelet_client.key_pem, true)?;
        let kp_crt = write("kube-proxy-client.crt", &proxy_client.cert_pem, false)?;
        let kp_key = write("kube-proxy-client.key", &proxy_client.key_pem, true)?;
        let kubeconfig_for = |user: &str, crt: &Path, key: &Path| {
            kubeconfig::render(&KubeconfigSpec {
                cluster: &c.cluster_name,
                server: &c.apiserver_url,
                ca_file: &ca_file,
                user,
                client_cert_file: crt,
                client_key_file: key,
                namespace: None,
            })
        };
        let kubelet_kubeconfig = write(
            "kubelet.kubeconfig",
            &kubeconfig_for(&format!("system:node:{}", p.name), &kc_crt, &kc_key),
            true,
        )?;
        let proxy_kubeconfig = write(
            "kube-proxy.kubeconfig",
            &kubeconfig_for("system:kube-proxy", &kp_crt, &kp_key),
            true,
        )?;
        let cni_dir = d.join("cni");
        std::fs::create_dir_all(&cni_dir).map_err(io(format!("creating {}", cni_dir.display())))?;
        let conflist = cni_dir.join(format!("10-{}.conflist", render::CNI_NETWORK));
        std::fs::write(
            &conflist,
            render::cni_conflist(&cni_bridge_name(&c.lab_id), p.pod_cidr),
        )
        .map_err(io(format!("writing {}", conflist.display())))?;
        let containerd = write(
            "containerd.toml",
            &render::containerd_config(&render::ContainerdSpec {
                cni_conf_dir: &cni_dir,
                sandbox_image: &c.sandbox_image,
                http_registry: Some(&format!("{}:{LAB_REGISTRY_PORT}", router_ip(c.node_net))),
            }),
            false,
        )?;
        let resolv = write("resolv.conf", &render::resolv_conf(c.cluster_dns), false)?;
        let cgroup_root = format!("/{}", p.name);
        let kubelet_config = write(
            "kubelet.json",
            &render::kubelet_config(&render::KubeletSpec {
                node_ip: p.ip,
                cgroup_root: &cgroup_root,
                client_ca_file: &ca_file,
                tls_cert_file: &kubelet_crt,
                tls_key_file: &kubelet_key,
                cluster_dns: c.cluster_dns,
                cluster_domain: super::dns::CLUSTER_DOMAIN,
                resolv_conf: &resolv,
                pod_cidr: p.pod_cidr,
            }),
            false,
        )?;
        let kube_proxy_config = write(
            "kube-proxy.json",
            &render::kube_proxy_config(&render::KubeProxySpec {
                kubeconfig: &proxy_kubeconfig,
                node_name: &p.name,
                node_ip: p.ip,
                cluster_cidr: c.cluster_cidr,
            }),
            false,
        )?;
        Ok(NodeFiles {
            containerd,
            kubelet_config,
            kubelet_kubeconfig,
            kube_proxy_config,
        })
    }

    fn spawn(
        &self,
        node: &mut RealNode,
        name: &str,
        program: &Path,
        args: Vec<String>,
    ) -> Result<(), Error> {
        let log = node.dir.join(format!("{name}.log"));
        let entry = node.entry.as_ref().ok_or_else(|| Error::Node {
            node: node.plan.name.clone(),
            message: "namespaces not set up".into(),
        })?;
        let m = Managed::spawn_with(name, program, &args, &log, self.spawner.as_ref(), |cmd| {
            entry.prepare(cmd)
        })?;
        tracing::debug!(node = %node.plan.name, name, pid = m.record.pid, "spawned");
        node.processes.push(m);
        Ok(())
    }

    fn wait_containerd(&self, node: &mut RealNode) -> Result<(), Error> {
        let t0 = Instant::now();
        loop {
            node.check_running()?;
            match node.exec("ctr", &["version"]) {
                Ok(_) => return Ok(()),
                Err(e) if t0.elapsed() > Duration::from_secs(30) => {
                    return Err(Error::Node {
                        node: node.plan.name.clone(),
                        message: format!("containerd does not answer after 30 s: {e}"),
                    });
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// Waits until every Node is Ready, sets its `spec.podCIDR` (the lab assigns pod
    /// CIDRs, no node-IPAM controller runs), puts the global sysctls back, and waits
    /// for kube-proxy's `KUBE-SERVICES` chain on every node.
    async fn wait_ready(&mut self, t0: Instant) -> Result<(), Error> {
        let client = super::client_from_kubeconfig(&self.config.admin_kubeconfig).await?;
        let api: Api<Node> = Api::all(client);
        let mut pending: Vec<usize> = (0..self.nodes.len()).collect();
        let mut cidr_set = vec![false; self.nodes.len()];
        let timeout = self.config.ready_timeout;
        let mut last = String::from("no Node registered yet");
        while !pending.is_empty() {
            for n in &mut self.nodes {
                n.check_running()?;
            }
            let mut still = Vec::new();
            for &i in &pending {
                let n = &self.nodes[i];
                match api.get_opt(&n.plan.name).await {
                    Ok(Some(obj)) => {
                        if !cidr_set[i]
                            && obj
                                .spec
                                .as_ref()
                                .and_then(|s| s.pod_cidr.as_ref())
                                .is_none()
                        {
                            let cidr = n.plan.pod_cidr.to_string();
                            let patch = serde_json::json!({
                                "spec": { "podCIDR": cidr, "podCIDRs": [cidr] }
                            });
                            api.patch(&n.plan.name, &PatchParams::default(), &Patch::Merge(&patch))
                                .await
                                .map_err(super::Error::kube(format!(
                                    "setting podCIDR of Node {}",
                                    n.plan.name
                                )))?;
                        }
                        cidr_set[i] = true;
                        let ready = obj
                            .status
                            .as_ref()
                            .and_then(|s| s.conditions.as_ref())
                            .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
                            .map(|c| (c.status.clone(), c.message.clone().unwrap_or_default()));
                        match ready {
                            Some((s, _)) if s == "True" => {}
                            Some((s, m)) => {
                                last = format!("Node {} Ready={s}: {m}", n.plan.name);
                                still.push(i);
                            }
                            None => {
                                last = format!("Node {} has no Ready condition yet", n.plan.name);
                                still.push(i);
                            }
                        }
                    }
                    Ok(None) => {
                        last = format!("Node {} not registered yet", n.plan.name);
                        still.push(i);
                    }
                    Err(e) => {
                        last = format!("reading Node {}: {e}", n.plan.name);
                        still.push(i);
                    }
                }
            }
            pending = still;
            if pending.is_empty() {
                break;
            }
            if t0.elapsed() > timeout {
                return Err(self.not_ready(t0, last));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if let Some(s) = &self.sysctls {
            s.restore()?;
        }
        // The kubelets set them once, at start: the next lab may save them now.
        self.start_lock = None;
        // kube-proxy: its first sync writes KUBE-SERVICES into the node's nat table.
        for i in 0..self.nodes.len() {
            loop {
                self.nodes[i].check_running()?;
                let out = self.nodes[i].exec("iptables", &["-t", "nat", "-S", "KUBE-SERVICES"]);
                match out {
                    Ok(text) if text.contains("KUBE-SVC-") => break,
                    Ok(_) => {
                        last = format!(
                            "{}: kube-proxy has no service rules yet",
                            self.nodes[i].plan.name
                        )
                    }
                    Err(e) => last = format!("{}: {e}", self.nodes[i].plan.name),
                }
                if t0.elapsed() > timeout {
                    return Err(self.not_ready(t0, last));
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        Ok(())
    }

    fn not_ready(&self, t0: Instant, last: String) -> Error {
        let mut message = last;
        for n in &self.nodes {
            for p in &n.processes {
                message.push_str(&format!(
                    "\n--- {} {} ({}):\n{}",
                    n.plan.name,
                    p.record.name,
                    p.record.log.display(),
                    super::process::log_tail(&p.record.log, 8)
                ));
            }
        }
        Error::NotReady {
            after: t0.elapsed(),
            message,
        }
    }

    /// Stops every node (reverse order), removes the router's node bridge and puts
    /// the global sysctls back.
    pub fn stop(mut self) -> Result<(), Error> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<(), Error> {
        let mut first: Option<Error> = None;
        while let Some(mut n) = self.nodes.pop() {
            if let Err(e) = n.stop() {
                first.get_or_insert(e);
            }
        }
        if self.router_bridge {
            let c = &self.config;
            let mut lines = vec![format!("link del {}", bridge_name(&c.lab_id))];
            for cidr in &c.pod_cidrs {
                lines.push(format!("route del {cidr}"));
            }
            // The routes went with the veths; the bridge is what is left. A router
            // netns already gone (lab torn down first) is fine too.
            if c.router.exists()
                && let Err(e) = c.router.ip_batch(&lines[..1])
            {
                first.get_or_insert(e.into());
            }
            self.router_bridge = false;
        }
        if let Some(s) = self.sysctls.take()
            && let Err(e) = s.restore()
        {
            first.get_or_insert(e);
        }
        self.start_lock = None;
        drop(self.spawner.take());
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for RealNodes {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::error!(error = %e, "real nodes: teardown incomplete");
        }
    }
}

/// The machine-wide sysctls a kubelet changes at start ([`host::KUBELET_SYSCTLS`]:
/// key, value), read while no lab's kubelets are starting (under the
/// [`KubeletStartLock`] of the lab's kubelet, waiting at most 180 s): the values a
/// test compares before and after a lab. Two labs starting at once could otherwise
/// show each other's kubelet values.
pub fn settled_global_sysctls() -> Result<Vec<(String, String)>, Error> {
    let _lock = KubeletStartLock::take(
        &super::k8s_bin_dir().join("kubelet"),
        Duration::from_secs(180),
    )?;
    host::KUBELET_SYSCTLS
        .iter()
        .map(|k| {
            let path = format!("/proc/sys/{k}");
            std::fs::read_to_string(&path)
                .map(|v| ((*k).to_owned(), v.trim().to_owned()))
                .map_err(io(format!("reading {path}")))
        })
        .collect()
}

struct NodeFiles {
    containerd: PathBuf,
    kubelet_config: PathBuf,
    kubelet_kubeconfig: PathBuf,
    kube_proxy_config: PathBuf,
}

/// Takes back what the nodes of a lab left when their owner died without stopping
/// them (`kvpn lab down` after the agent was killed): every process in each node's
/// cgroup subtree (containers, shims; SIGKILL) and the subtree, every process left
/// in each node's mount namespace, then its pin. The node netns go with the lab's
/// own teardown (every `kvpn-<id>-*` netns). Returns what failed.
pub fn reclaim(lab_id: &str, dir: &Path, count: usize) -> Vec<Error> {
    let mut errors = Vec::new();
    for i in 1..=count {
        let name = netns_name(lab_id, &format!("n{i}"));
        if !host::cgroup_leftovers(&name).is_empty() {
            match NodeCgroup::existing(&name) {
                Ok(mut cg) => {
                    if let Err(e) = cg.remove() {
                        errors.push(e);
                    }
                }
                Err(e) => errors.push(e),
            }
        }
        let ns_dir = dir.join(format!("n{i}")).join("ns");
        if host::mounts_under(&ns_dir).is_empty() {
            continue;
        }
        let mut ns = MountNs::existing(&ns_dir);
        if let Some(ino) = ns.inode() {
            for pid in host::pids_in_mount_ns(ino) {
                if let Ok(raw) = i32::try_from(pid) {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(raw),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
        }
        if let Err(e) = ns.remove() {
            errors.push(e);
        }
    }
    errors
}

/// What a real node could leave behind on the machine, for tests and `lab down`:
/// netns `kvpn-<id>-n*`, cgroups `/kvpn-<id>-n*`, mounts under `dir`, processes whose
/// executable is containerd, a containerd shim, kubelet or kube-proxy and whose
/// command line names `dir`. Empty when clean.
pub fn leftovers(lab_id: &str, dir: &Path, count: usize) -> Vec<String> {
    let mut out = Vec::new();
    for i in 1..=count {
        let name = netns_name(lab_id, &format!("n{i}"));
        if Netns::from_name(&name).exists() {
            out.push(format!("netns {name}"));
        }
        for cg in host::cgroup_leftovers(&name) {
            out.push(format!("cgroup {}", cg.display()));
        }
    }
    for m in host::mounts_under(dir) {
        out.push(format!("mount {}", m.display()));
    }
    let needle = dir.to_string_lossy().into_owned();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for e in entries.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                continue;
            };
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            if cmdline.contains(&needle) {
                out.push(format!("process {pid}: {cmdline}"));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_gives_each_node_its_name_address_and_pod_cidr() {
        let cidrs = node_pod_cidrs("10.244.0.0/16".parse().expect("cidr"), 2);
        assert_eq!(
            cidrs.iter().map(ToString::to_string).collect::<Vec<_>>(),
            ["10.244.2.0/24", "10.244.3.0/24"]
        );
        let p = plan("abcde", NODE_NET, &cidrs);
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].name, "kvpn-abcde-n1");
        assert_eq!(p[0].ip, Ipv4Addr::new(172, 30, 0, 11));
        assert_eq!(p[1].name, "kvpn-abcde-n2");
        assert_eq!(p[1].ip, Ipv4Addr::new(172, 30, 0, 12));
        assert_eq!(p[1].pod_cidr.to_string(), "10.244.3.0/24");
        assert_eq!(router_ip(NODE_NET), Ipv4Addr::new(172, 30, 0, 1));
    }

    #[test]
    fn link_names_fit_the_kernel_limit() {
        for name in [
            bridge_name("abcde"),
            cni_bridge_name("abcde"),
            router_link_name("abcde", 9),
        ] {
            assert!(name.len() <= 15, "{name}");
            assert!(name.starts_with("kv"), "{name}");
        }
    }
}
