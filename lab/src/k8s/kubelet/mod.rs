//! The lab's **kubelet stand-in** (lab-only code, never shipped): what a node's kubelet
//! and the scheduler do for the lab's real API server, with local processes in
//! network namespaces instead of containers.
//!
//! What it does:
//! - registers a Node (`kvpn-<id>-node` by default) with `spec.podCIDR` = the lab
//!   node's pod range (10.244.1.0/24), InternalIP and `daemonEndpoints.kubeletEndpoint`
//!   = its HTTPS endpoint, ExternalIP = the node's uplink address, a Ready condition,
//!   and a heartbeat (status and Lease every [`KubeletConfig::heartbeat`]);
//! - binds unscheduled pods to the node through the `binding` subresource (acting as
//!   the scheduler; pods whose `nodeSelector` does not match the node's labels, or with
//!   another `schedulerName`, are left alone, as are pods of other nodes);
//! - for each pod bound to it: a netns `kvpn-<id>-<pod name>-<uid[..5]>` on the node
//!   bridge with the next free IP of the podCIDR ([`crate::Node::add_pod`]), the pod's
//!   Secret/ConfigMap/downward API/emptyDir volumes written under the pod folder and
//!   mounted at their `mountPath`s in a private mount namespace (see [`runner`]), its
//!   `resolv.conf` (with [`KubeletConfig::cluster_dns`]) and `hosts`, and each
//!   container as a local process ([`images`] maps image names to programs); env from
//!   `env`/`envFrom`/`valueFrom` with `$(VAR)` expansion ([`spec`]);
//! - reports status on `pods/status`: Pending → Running, podIP/podIPs, hostIP,
//!   startTime, conditions, container states with exit codes and restart counts,
//!   readiness from `tcpSocket`/`httpGet`/`exec` probes run from the node netns (exec:
//!   inside the container), liveness probes that restart the container; crashes restart
//!   with back-off and show `CrashLoopBackOff` ([`status`]); unknown images show
//!   `ErrImagePull`/`ImagePullBackOff`; it also posts the kubelet's Events (Scheduled,
//!   Pulled, Created, Started, Failed, BackOff, Unhealthy, Killing);
//! - on deletion (deletionTimestamp): SIGTERM to the container's process group, SIGKILL
//!   after the grace period (capped by [`KubeletConfig::max_grace`]), the netns is
//!   removed, and the pod is deleted with grace 0 so it disappears;
//! - serves the kubelet endpoint over TLS ([`server`]): port-forward over websockets
//!   (v4.channel.k8s.io, kube-rs) and SPDY/3.1 (`kubectl port-forward`, [`spdy`]),
//!   dialled to 127.0.0.1:port inside the pod netns, and container logs.
//!
//! Where things run: the stand-in's tasks run on their own tokio runtime on a thread
//! of this process ([`Kubelet::start`]); its HTTPS endpoint listens in the host netns
//! on the control plane's loopback address (the API server runs there, with
//! `--kubelet-preferred-address-types=InternalIP`), so the Node's InternalIP is a
//! `127.x.y.z` address and pods' `hostIP` is that address too. Pods live in netns on
//! the node bridge; each container process dies with the stand-in (`PDEATHSIG`).
//! Files: `<lab folder>/kubelet/pods/<namespace>_<name>_<uid>/` (`volumes/`, `logs/`,
//! `resolv.conf`, `hosts`) and `<dir>/sandboxes/` (one record per pod netns); volumes
//! are removed with the pod, logs are kept.
//!
//! A stand-in that was killed leaves its pods' netns behind (their processes die with
//! it); the next start in the same folder removes them (`<dir>/sandboxes/`), then takes
//! over the Node and restarts the pods bound to it in fresh netns.
//!
//! Not implemented: init containers (ignored, with a Warning event; the containers
//! start anyway), startup probes, `hostNetwork` (such pods get their own netns too),
//! resource limits, image pull secrets and pull policies, exec/attach, Secret updates
//! after start, websocket-tunnelled SPDY port-forward (kubectl ≥ 1.30 tries it first;
//! it carries no `port` parameter, is refused with 400, and kubectl falls back to plain
//! SPDY, which [`spdy`] serves).

pub mod images;
pub mod node;
mod pods;
pub mod portforward;
pub mod runner;
pub mod server;
pub mod spdy;
pub mod spec;
pub mod status;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ipnet::Ipv4Net;
use k8s_openapi::jiff::Timestamp;
use tokio::sync::{oneshot, watch};

pub use images::{ImageKind, ImageMap, ImagePattern};
pub use spec::ClusterDns;
pub use status::Backoff;

use super::ControlPlane;
use super::pki::CertSpec;
use crate::Lab;
use crate::topology::{Node, netns_name};

/// Errors of the kubelet stand-in's start and stop.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Lab(#[from] crate::LabError),
    #[error(transparent)]
    ControlPlane(#[from] super::Error),
    #[error("certificate for the kubelet endpoint: {0}")]
    Cert(#[from] rcgen::Error),
    #[error("kubelet endpoint TLS: {0}")]
    Tls(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("kubelet stand-in: {0}")]
    Start(String),
}

impl Error {
    pub(crate) fn kube(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
        let what = what.into();
        move |source| Error::Kube { what, source }
    }

    fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let what = what.into();
        move |source| Error::Io { what, source }
    }
}

/// Resolves once the flag is true (or its sender is gone).
pub(crate) async fn wait_true(rx: &mut watch::Receiver<bool>) {
    // Map the guard away at once: it must not live across an await (not Send).
    let _ = rx.wait_for(|v| *v).await.map(|_| ());
}

/// The wall clock as a Kubernetes timestamp.
pub(crate) fn now() -> Timestamp {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    // Seconds since 1970 fit i64 and nanoseconds fit i32 for any real clock.
    Timestamp::new(
        i64::try_from(d.as_secs()).unwrap_or(i64::MAX / 2),
        i32::try_from(d.subsec_nanos()).unwrap_or(0),
    )
    .unwrap_or(Timestamp::UNIX_EPOCH)
}

/// Options of [`Kubelet::start`]. `KubeletConfig::default()` suits the lab.
#[derive(Debug, Clone)]
pub struct KubeletConfig {
    /// Node name; default `kvpn-<lab id>-node` (the node netns's name).
    pub node_name: Option<String>,
    /// Address of the HTTPS endpoint in the host netns; default the control plane's
    /// loopback address.
    pub listen_ip: Option<Ipv4Addr>,
    /// Folder for pod files; default `<lab folder>/kubelet`.
    pub dir: Option<PathBuf>,
    pub images: ImageMap,
    pub backoff: Backoff,
    /// Interval of the node status and Lease heartbeat.
    pub heartbeat: Duration,
    /// Upper bound for a pod's termination grace period (the spec's default is 30 s).
    pub max_grace: Duration,
    /// Cluster DNS for `dnsPolicy: ClusterFirst` pods; None keeps the machine's
    /// resolv.conf (which pods cannot reach).
    pub cluster_dns: Option<ClusterDns>,
    /// Extra environment for every container (before the pod's own `env`), e.g.
    /// `RUST_LOG`.
    pub pod_env: Vec<(String, String)>,
    /// Extra node labels.
    pub node_labels: Vec<(String, String)>,
    /// The `kubernetes` Service's ClusterIP for the containers' `KUBERNETES_SERVICE_*`
    /// environment; None: [`crate::k8s::KUBERNETES_SERVICE_IP`].
    pub kubernetes_service_ip: Option<Ipv4Addr>,
}

impl Default for KubeletConfig {
    fn default() -> Self {
        KubeletConfig {
            node_name: None,
            listen_ip: None,
            dir: None,
            images: ImageMap::lab_default(),
            backoff: Backoff::lab_default(),
            heartbeat: Duration::from_secs(10),
            max_grace: Duration::from_secs(10),
            cluster_dns: None,
            pod_env: Vec::new(),
            node_labels: Vec::new(),
            kubernetes_service_ip: None,
        }
    }
}

/// Everything the stand-in needs, without borrowing the [`Lab`] or [`ControlPlane`]
/// (so it can also be assembled by a process that only knows their folders).
#[derive(Debug, Clone)]
pub struct KubeletSetup {
    pub lab_id: String,
    pub pod_cidr: Ipv4Net,
    /// The node's IPv6 pod range (dual-stack labs): pods get an address from it too.
    pub pod_cidr_v6: Option<ipnet::Ipv6Net>,
    /// Pods already on the node bridge (the static lab pods): their IPs are not handed
    /// out.
    pub existing_pods: Vec<(String, Ipv4Addr)>,
    pub node_name: String,
    pub external_ip: Option<Ipv4Addr>,
    pub listen_ip: Ipv4Addr,
    pub dir: PathBuf,
    /// Kubeconfig the stand-in talks to the API server with (needs to bind pods, write
    /// pod and node status, delete pods, create events and leases: the lab's admin).
    pub kubeconfig: PathBuf,
    /// PEM: serving certificate (SAN = `listen_ip`) and key, and the CA that signs the
    /// API server's kubelet-client certificate.
    pub cert_pem: String,
    pub key_pem: String,
    pub client_ca_pem: String,
    pub config: KubeletConfig,
}

impl KubeletSetup {
    /// From a running lab and its control plane: issues the endpoint's certificate
    /// from the lab CA.
    pub fn new(lab: &Lab, cp: &ControlPlane, config: KubeletConfig) -> Result<KubeletSetup, Error> {
        let listen_ip = config.listen_ip.unwrap_or_else(|| cp.listen_ip());
        let node_name = config
            .node_name
            .clone()
            .unwrap_or_else(|| netns_name(lab.id(), crate::NODE));
        let ca = cp.ca()?;
        let cert = ca.issue(&CertSpec::server(
            &format!("system:node:{node_name}"),
            &[listen_ip.to_string(), node_name.clone()],
        ))?;
        let client_ca_pem = std::fs::read_to_string(cp.ca_file())
            .map_err(Error::io(format!("reading {}", cp.ca_file().display())))?;
        Ok(KubeletSetup {
            lab_id: lab.id().to_owned(),
            pod_cidr: lab.node().pod_cidr(),
            pod_cidr_v6: lab.node().pod_cidr_v6(),
            existing_pods: lab.pods().iter().map(|p| (p.name.clone(), p.ip)).collect(),
            node_name,
            external_ip: Some(lab.uplink().node_ip),
            listen_ip,
            dir: config
                .dir
                .clone()
                .unwrap_or_else(|| lab.dir().join("kubelet")),
            kubeconfig: cp.admin_kubeconfig(),
            cert_pem: cert.cert_pem,
            key_pem: cert.key_pem,
            client_ca_pem,
            config,
        })
    }
}

/// A running kubelet stand-in. [`Kubelet::stop`] (or drop) stops its pods, removes
/// their netns and deletes the Node.
#[derive(Debug)]
pub struct Kubelet {
    node_name: String,
    endpoint: SocketAddr,
    lab_id: String,
    dir: PathBuf,
    shutdown_tx: watch::Sender<bool>,
    done_rx: Option<oneshot::Receiver<Result<(), String>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Shared state of the stand-in's tasks.
pub(crate) struct Ctx {
    pub client: kube::Client,
    pub lab_id: String,
    pub node: Node,
    pub node_name: String,
    pub node_labels: Vec<(String, String)>,
    pub host_ip: Ipv4Addr,
    pub dir: PathBuf,
    pub config: KubeletConfig,
    pub ips: std::sync::Mutex<pods::IpAllocator>,
    pub directory: server::PodDirectory,
    pub shutdown: watch::Receiver<bool>,
}

impl Kubelet {
    /// Starts the stand-in for `lab`'s node against `cp` and returns once the Node is
    /// registered and Ready and the endpoint listens. Pods are then bound and started in
    /// the background.
    pub async fn start(
        lab: &Lab,
        cp: &ControlPlane,
        config: KubeletConfig,
    ) -> Result<Kubelet, Error> {
        Kubelet::start_setup(KubeletSetup::new(lab, cp, config)?).await
    }

    /// Starts the stand-in from an explicit [`KubeletSetup`].
    pub async fn start_setup(setup: KubeletSetup) -> Result<Kubelet, Error> {
        crate::require_root()?;
        std::fs::create_dir_all(setup.dir.join("pods"))
            .map_err(Error::io(format!("creating {}", setup.dir.display())))?;
        let listener = std::net::TcpListener::bind((setup.listen_ip, 0)).map_err(Error::io(
            format!("binding the kubelet endpoint on {}", setup.listen_ip),
        ))?;
        listener
            .set_nonblocking(true)
            .map_err(Error::io("kubelet endpoint socket"))?;
        let endpoint = listener
            .local_addr()
            .map_err(Error::io("kubelet endpoint address"))?;
        let acceptor = server::tls_acceptor(&setup.cert_pem, &setup.key_pem, &setup.client_ca_pem)?;
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let (ready_tx, ready_rx) = oneshot::channel::<Result<(), String>>();
        let (done_tx, done_rx) = oneshot::channel::<Result<(), String>>();
        let node_name = setup.node_name.clone();
        let lab_id = setup.lab_id.clone();
        let dir = setup.dir.clone();
        let thread = std::thread::Builder::new()
            .name("kvpn-kubelet".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name("kvpn-kubelet-rt")
                    .enable_all()
                    .build()
                {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = ready_tx.send(Err(format!("tokio runtime: {e}")));
                        return;
                    }
                };
                let result = runtime.block_on(run(
                    setup,
                    listener,
                    acceptor,
                    endpoint,
                    shutdown_rx,
                    ready_tx,
                ));
                let _ = done_tx.send(result);
                // Workers and probes are done; don't wait for stray blocking tasks.
                runtime.shutdown_timeout(Duration::from_secs(2));
            })
            .map_err(Error::io("starting the kubelet thread"))?;
        let mut kubelet = Kubelet {
            node_name,
            endpoint,
            lab_id,
            dir,
            shutdown_tx,
            done_rx: Some(done_rx),
            thread: Some(thread),
        };
        match ready_rx.await {
            Ok(Ok(())) => Ok(kubelet),
            Ok(Err(e)) => {
                kubelet.stop_blocking();
                Err(Error::Start(e))
            }
            Err(_) => {
                kubelet.stop_blocking();
                Err(Error::Start(
                    "the kubelet thread ended during start-up".into(),
                ))
            }
        }
    }

    /// The Node's name.
    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    /// Where the API server reaches the endpoint (InternalIP:port).
    pub fn endpoint(&self) -> SocketAddr {
        self.endpoint
    }

    /// The folder of pod files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The netns a pod runs in (exists while the pod runs on this node).
    pub fn pod_netns(&self, pod: &k8s_openapi::api::core::v1::Pod) -> crate::Netns {
        let role = spec::netns_role(
            pod.metadata.name.as_deref().unwrap_or(""),
            pod.metadata.uid.as_deref().unwrap_or(""),
        );
        crate::Netns::from_name(&netns_name(&self.lab_id, &role))
    }

    /// Stops the pods (SIGTERM, SIGKILL after at most 3 s), removes their netns,
    /// deletes the Node and ends the stand-in's thread.
    pub async fn stop(mut self) -> Result<(), Error> {
        let _ = self.shutdown_tx.send(true);
        let result = match self.done_rx.take() {
            Some(rx) => rx
                .await
                .unwrap_or_else(|_| Err("kubelet thread ended abnormally".into())),
            None => Ok(()),
        };
        if let Some(t) = self.thread.take() {
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
        result.map_err(Error::Start)
    }

    fn stop_blocking(&mut self) {
        let _ = self.shutdown_tx.send(true);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.stop_blocking();
    }
}

async fn run(
    setup: KubeletSetup,
    listener: std::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    endpoint: SocketAddr,
    shutdown: watch::Receiver<bool>,
    ready_tx: oneshot::Sender<Result<(), String>>,
) -> Result<(), String> {
    let started = std::time::Instant::now();
    let client = match super::client_from_kubeconfig(&setup.kubeconfig).await {
        Ok(c) => c,
        Err(e) => {
            let _ = ready_tx.send(Err(e.to_string()));
            return Err(e.to_string());
        }
    };
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            let _ = ready_tx.send(Err(format!("kubelet endpoint listener: {e}")));
            return Err(e.to_string());
        }
    };
    let node =
        Node::existing(&setup.lab_id, crate::NODE, setup.pod_cidr).with_ipv6(setup.pod_cidr_v6);
    for (name, ip) in &setup.existing_pods {
        node.adopt_pod(name, *ip);
    }
    // Netns left by a stand-in that was killed (their processes died with it).
    let node = match tokio::task::spawn_blocking({
        let dir = setup.dir.clone();
        move || {
            let stale = pods::remove_stale_sandboxes(&dir, &node);
            (node, stale)
        }
    })
    .await
    {
        Ok((node, stale)) => {
            if !stale.is_empty() {
                tracing::info!(
                    ?stale,
                    "removed pod netns of an earlier kubelet stand-in run"
                );
            }
            node
        }
        Err(e) => {
            let _ = ready_tx.send(Err(format!("cleaning stale pod netns: {e}")));
            return Err(e.to_string());
        }
    };
    let labels = node::node_labels(&setup.node_name, &setup.config.node_labels);
    let node_spec = node::NodeSpec {
        name: setup.node_name.clone(),
        pod_cidr: setup.pod_cidr.to_string(),
        pod_cidr_v6: setup.pod_cidr_v6.map(|n| n.to_string()),
        endpoint,
        external_ip: setup.external_ip,
        labels: labels.clone(),
    };
    let directory = server::PodDirectory::default();
    let server_task = tokio::spawn(server::serve(
        listener,
        acceptor,
        directory.clone(),
        shutdown.clone(),
    ));
    let node_uid = match node::register(&client, &node_spec).await {
        Ok(uid) => uid,
        Err(e) => {
            server_task.abort();
            let _ = ready_tx.send(Err(e.to_string()));
            return Err(e.to_string());
        }
    };
    let ready_since = now();
    let mut ips = pods::IpAllocator::new(setup.pod_cidr, node.gateway());
    for (_, ip) in &setup.existing_pods {
        ips.reserve(*ip);
    }
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        lab_id: setup.lab_id.clone(),
        node,
        node_name: setup.node_name.clone(),
        node_labels: labels,
        host_ip: setup.listen_ip,
        dir: setup.dir.clone(),
        config: setup.config.clone(),
        ips: std::sync::Mutex::new(ips),
        directory,
        shutdown: shutdown.clone(),
    });
    tracing::info!(node = %setup.node_name, %endpoint, elapsed_ms = started.elapsed().as_millis(), "kubelet stand-in registered its node");
    let _ = ready_tx.send(Ok(()));

    let heartbeat = {
        let client = client.clone();
        let spec = node_spec.clone();
        let every = setup.config.heartbeat;
        let mut shutdown = shutdown.clone();
        tokio::spawn(async move {
            loop {
                node::heartbeat(&client, &spec, &node_uid, ready_since).await;
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = wait_true(&mut shutdown) => return,
                }
            }
        })
    };
    pods::dispatch(ctx.clone()).await;
    heartbeat.abort();
    let _ = server_task.await;
    node::unregister(&client, &setup.node_name)
        .await
        .map_err(|e| e.to_string())?;
    tracing::info!(node = %setup.node_name, "kubelet stand-in stopped");
    Ok(())
}
