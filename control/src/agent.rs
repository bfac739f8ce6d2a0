//! The session agent: the unprivileged, per-session half of a Kubernetes
//! connection, run as tasks of the user daemon ([`crate::userd`]). It holds the kube client (the user's kubeconfig, exec plugins)
//! and offers the traffic manager's data port on a loopback listener, like
//! `kubectl port-forward`: every TCP connection the root daemon makes to it
//! becomes one `pods/portforward` stream through the API server to the
//! *current* ready manager pod. So when the port-forward dies (pod rescheduled,
//! API server restarted), the root daemon's redial gets a fresh one, and the TUN
//! device, addresses and routes stay as they are (cases tr-08, tr-10). With the
//! SSH data-plane bypass (`--ssh-direct`, [`crate::ssh::bypass`]) each connection
//! becomes a `direct-tcpip` channel from the SSH host to the manager's ClusterIP
//! instead.
//!
//! It also runs the session's route watch ([`crate::route_watch`]): the
//! manager's `WatchRoutes` stream, through a port-forward to its gRPC port,
//! turned into `UpdateRoutes` calls on the root daemon.
//!
//! I/O: the loopback listener, the API server (list pods, port-forward; the
//! manager Deployment when no pod is ready, to say why) and the root daemon's
//! socket (route watch).

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::Api;
use kube::api::ListParams;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::kubeconfig::{KubeFlags, UserEnv};
use crate::ssh::direct_path::{Choice, DirectPath};

/// An ssh-direct session's data path, shared by its agent and the user
/// daemon's status.
pub type SharedPath = Arc<Mutex<DirectPath>>;

fn lock_path(p: &SharedPath) -> std::sync::MutexGuard<'_, DirectPath> {
    // Every DirectPath method leaves it consistent: keep what a panicking
    // holder left.
    p.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How often the agent of an ssh-direct session looks whether a probe of
/// ssh-direct is due (a data connection may have switched it to port-forward).
const PATH_CHECK_EVERY: Duration = Duration::from_secs(1);

/// How long a re-dial waits for the manager Service to be read before it uses
/// the ClusterIP it knew (the API server may be the thing that is slow).
const RESOLVE_WAIT: Duration = Duration::from_secs(2);

/// The manager Service's ClusterIP with `port`: `Ok(None)` when the Service is
/// gone or has no ClusterIP; `Err` when it could not be read.
async fn resolve_manager(
    svc: &Api<Service>,
    port: u16,
) -> Result<Option<std::net::SocketAddr>, String> {
    let got = tokio::time::timeout(RESOLVE_WAIT, svc.get_opt(crate::install::objects::MANAGER))
        .await
        .map_err(|_| {
            format!(
                "reading Service {} took over {} s",
                crate::install::objects::MANAGER,
                RESOLVE_WAIT.as_secs()
            )
        })?
        .map_err(|e| {
            format!(
                "cannot read Service {}: {e}",
                crate::install::objects::MANAGER
            )
        })?;
    Ok(got
        .and_then(|s| s.spec)
        .and_then(|s| s.cluster_ip)
        .and_then(|ip| ip.parse::<std::net::IpAddr>().ok())
        .map(|ip| std::net::SocketAddr::new(ip, port)))
}

/// What one data connection of an ssh-direct session needs.
struct DirectWay {
    dialer: crate::ssh::SshDialer,
    path: SharedPath,
    /// The manager Service (re-read on every re-dial).
    svc: Api<Service>,
    /// The manager pods and their data port (port-forward fallback).
    pods: PodChoice,
    pod_port: u16,
    /// Cancelled when ssh-direct works again.
    fallback: CancellationToken,
}

/// One data connection of an ssh-direct session: re-read the Service, try a
/// channel to its ClusterIP for [`crate::ssh::bypass::PROBE_TIMEOUT`], and on
/// failure (or while the session is on port-forward) carry it by port-forward
/// through the same SSH path — until `fallback` is cancelled (ssh-direct works
/// again: the root daemon then re-dials onto it).
async fn direct_or_fallback(way: DirectWay, stream: TcpStream, peer: std::net::SocketAddr) {
    let DirectWay {
        dialer,
        path,
        svc,
        pods,
        pod_port,
        fallback,
    } = way;
    let service_port = lock_path(&path)
        .target()
        .map_or(MANAGER_DATA_PORT, |t| t.port());
    match resolve_manager(&svc, service_port).await {
        Ok(target) => {
            if lock_path(&path).handle_resolved(target, Instant::now()) {
                info!(?target, "the traffic manager's Service has a new ClusterIP");
            }
        }
        Err(e) => warn!("{e}; using the ClusterIP read before"),
    }
    let choice = lock_path(&path).choice();
    if let Choice::Direct(target) = choice {
        // An attempt that fails while the SSH path itself is re-opened (it
        // died: the channel fails on the dying connection, or the open waits
        // out the dial) says nothing about ssh-direct: with the path still
        // down, give up this data connection (no fallback); with the path
        // back, try once more on it before falling back (CI once saw a
        // port-forward opened 36 ms after the path came back, then closed as
        // ssh-direct worked).
        let mut attempts = 0;
        let why = loop {
            attempts += 1;
            let generation = dialer.generation();
            let opened = tokio::time::timeout(
                crate::ssh::bypass::PROBE_TIMEOUT,
                dialer.open(&target.ip().to_string(), target.port()),
            )
            .await;
            let path_reopened = dialer.generation() != generation || !dialer.is_open();
            let why = match opened {
                Ok(Ok(mut remote)) => {
                    set_data_error(&pods.last_error, None);
                    match crate::ssh::bypass::carry(&dialer, target, stream, &mut remote).await {
                        Ok((up, down)) => info!(%peer, up, down, "ssh-direct data channel closed"),
                        Err(e) => warn!(%peer, "data channel: {e}"),
                    }
                    return;
                }
                Ok(Err(e @ crate::ssh::client::ConnectError::Channel { .. })) => {
                    format!("{} could not open a channel to it: {e}", dialer.last_hop())
                }
                Ok(Err(e)) => {
                    // The SSH connection itself failed: port-forward rides the same
                    // one, so no fallback; the root daemon re-dials.
                    warn!(%peer, %target, "data channel: {e}");
                    return;
                }
                Err(_) => format!(
                    "{} opened no channel to it within {} s",
                    dialer.last_hop(),
                    crate::ssh::bypass::PROBE_TIMEOUT.as_secs()
                ),
            };
            if !dialer.is_open() {
                // The SSH path is down or still being re-opened: a port-forward
                // would ride the same path, so it cannot do better. The root
                // daemon re-dials once the path is back.
                warn!(%peer, %target, "data channel: ssh-direct failed ({why}) while the SSH path is being re-opened; not falling back to port-forward");
                return;
            }
            if !path_reopened || attempts >= 2 {
                break why;
            }
            info!(%peer, %target, "ssh-direct attempt failed while the SSH path was re-opened ({why}); trying once more on the fresh path");
        };
        info!(%peer, %target, "ssh-direct failed ({why}); trying port-forward through the same SSH connection");
        // Port-forward through the same SSH connection. The session switches
        // to it only once it opened and ssh-direct still fails then: a silent
        // SSH connection (black-holed, being redialled) times out both, and
        // is no reason to leave ssh-direct.
        let this_conn = fallback.child_token();
        let check = {
            let (dialer, path, svc, this_conn) =
                (dialer.clone(), path.clone(), svc.clone(), this_conn.clone());
            move || {
                tokio::spawn(async move {
                    match probe_direct(dialer, path.clone(), svc).await {
                        Ok(()) => {
                            info!(%target, "ssh-direct works again right after it failed: closing the port-forward data connection, the root daemon re-dials onto ssh-direct");
                            this_conn.cancel();
                        }
                        Err(now_why) => {
                            warn!(%target, "ssh-direct failed ({why}; again: {now_why}): the data channel uses port-forward through the same SSH connection until a probe finds ssh-direct working again");
                            lock_path(&path).handle_direct_failed(why, Instant::now());
                        }
                    }
                });
            }
        };
        tokio::select! {
            r = forward_then(pods, pod_port, stream, check) => {
                if let Err(e) = r {
                    warn!(%peer, "data channel (port-forward after ssh-direct failed): {e:#}");
                }
            }
            () = this_conn.cancelled() => {}
        }
        return;
    }
    tokio::select! {
        r = forward(pods, pod_port, stream) => {
            if let Err(e) = r {
                warn!(%peer, "data channel: {e:#}");
            }
        }
        () = fallback.cancelled() => {
            info!(%peer, "closing the port-forward data connection: ssh-direct works again, the root daemon re-dials onto it");
        }
    }
}

/// A probe of ssh-direct for a session on port-forward: re-read the Service,
/// then open one channel to its ClusterIP.
async fn probe_direct(
    dialer: crate::ssh::SshDialer,
    path: SharedPath,
    svc: Api<Service>,
) -> Result<(), String> {
    let service_port = lock_path(&path)
        .target()
        .map_or(MANAGER_DATA_PORT, |t| t.port());
    if let Ok(target) = resolve_manager(&svc, service_port).await {
        lock_path(&path).handle_resolved(target, Instant::now());
    }
    let target = lock_path(&path)
        .target()
        .ok_or_else(|| "the traffic manager's Service has no ClusterIP".to_owned())?;
    crate::ssh::bypass::probe(&dialer, target, crate::ssh::bypass::PROBE_TIMEOUT)
        .await
        .map(drop)
        .map_err(|e| e.to_string())
}

/// Label selector of the traffic manager's pods.
pub const MANAGER_SELECTOR: &str = "app.kubernetes.io/name=kvpn-manager";

/// The manager's data port (frames, DESIGN.md).
pub const MANAGER_DATA_PORT: u16 = 10801;

/// What the agent needs.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Which cluster, as the user chose it.
    pub flags: KubeFlags,
    /// The SSH path to the API server, when it is behind a jump host (the agent
    /// opens its own SSH connections; passed in [`crate::ssh::PLAN_ENV`]).
    pub ssh: Option<crate::ssh::SshPlan>,
    /// Namespace of the traffic manager.
    pub manager_namespace: String,
    /// Pod port to forward.
    pub port: u16,
    /// The SSH data-plane bypass ([`crate::ssh::bypass`]): the manager Service's
    /// ClusterIP and data port, reached with `direct-tcpip` through the agent's SSH
    /// path instead of a port-forward; `None` = port-forward.
    pub ssh_direct: Option<std::net::SocketAddr>,
    /// With `ssh_direct`: why connect's probe of it failed; the session starts
    /// on port-forward and probes ssh-direct later.
    pub ssh_direct_failed: Option<String>,
    /// The user's environment (kubeconfig lookup, exec plugins, ~/.ssh, ssh-agent):
    /// the CLI's, sent with the session.
    pub env: UserEnv,
    /// Where to listen for the root daemon's data connections: 127.0.0.1:0 for a
    /// new session, the recorded address for a restored one.
    pub listen: std::net::SocketAddr,
    /// The manager's gRPC port (route watch); `None` = no route watch.
    pub grpc_port: Option<u16>,
    /// Addresses the route watch never routes into the tunnel (API server,
    /// nameservers, gateways: what connect kept out).
    pub keep_out: Vec<std::net::IpAddr>,
    /// Ranges the route watch never routes into the tunnel (`--never-proxy`).
    pub never_proxy: Vec<ipnet::IpNet>,
    /// Names resolved through the cluster DNS and routed (`--extra-domain`).
    pub extra_domains: Vec<String>,
    /// The root daemon's runtime folder (the route watch's UpdateRoutes).
    pub runtime_dir: PathBuf,
    /// The manager replica (pod name) connect picked for this session; data
    /// connections go there while it is ready ([`PodChoice`]).
    pub replica: Option<String>,
}

/// Whether a pod is a usable manager: running, Ready, not being deleted.
pub fn pod_is_ready(pod: &Pod) -> bool {
    if pod.metadata.deletion_timestamp.is_some() {
        return false;
    }
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The ready manager pod to use among `pods`: while a rollout runs two, one of
/// this kvpn's version (the one an upgrade just rolled out) before others, then
/// the newest (creation timestamps have one-second resolution, so version first).
pub fn pick_manager_pod(pods: &[Pod]) -> Option<&Pod> {
    let ours = env!("CARGO_PKG_VERSION");
    let version = |p: &Pod| {
        p.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(crate::install::objects::ANNOTATION_VERSION))
            .is_some_and(|v| v == ours)
    };
    pods.iter()
        .filter(|p| pod_is_ready(p))
        .max_by_key(|p| (version(p), p.metadata.creation_timestamp.clone()))
}

/// The name of a ready manager pod ([`pick_manager_pod`]).
pub async fn ready_manager_pod(api: &Api<Pod>) -> Result<String> {
    ready_manager_pod_preferring(api, None).await
}

/// The manager pods a session's data connections go to: its replica while that
/// is ready (connect picked the one with the fewest sessions), else any ready
/// one ([`pick_manager_pod`]): every replica reads the same lease objects, so
/// any of them accepts the session's hello.
#[derive(Clone)]
pub struct PodChoice {
    pub api: Api<Pod>,
    /// The session's replica (its pod name); None: any.
    pub preferred: Option<Arc<str>>,
    /// Why the last data connection found no manager to carry it.
    pub last_error: DataError,
}

/// Why a session's last data connection could not be carried to a manager pod
/// (no ready pod, the port-forward failed), `None` once one opened again: the
/// root daemon sees only its symptom (the TLS handshake through the listener
/// ends), so `kvpn status` and `kvpn connect` show this cause first.
pub type DataError = Arc<Mutex<Option<String>>>;

fn set_data_error(e: &DataError, why: Option<String>) {
    *e.lock().unwrap_or_else(PoisonError::into_inner) = why;
}

/// `preferred` when it is a ready manager pod, else [`pick_manager_pod`]'s.
pub fn pick_preferring<'a>(pods: &'a [Pod], preferred: Option<&str>) -> Option<&'a Pod> {
    preferred
        .and_then(|want| {
            pods.iter()
                .find(|p| p.metadata.name.as_deref() == Some(want) && pod_is_ready(p))
        })
        .or_else(|| pick_manager_pod(pods))
}

async fn ready_manager_pod_preferring(api: &Api<Pod>, preferred: Option<&str>) -> Result<String> {
    let pods = api
        .list(&ListParams::default().labels(MANAGER_SELECTOR))
        .await
        .context("cannot list the traffic manager's pods")?;
    if let Some(name) =
        pick_preferring(&pods.items, preferred).and_then(|p| p.metadata.name.clone())
    {
        return Ok(name);
    }
    // Why none is ready: the Deployment says whether someone scaled it to 0
    // or removed it (one more request, on this failure path only).
    let Some(ns) = api.namespace() else {
        bail!(no_ready_pod_message(None));
    };
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(api.clone().into_client(), ns);
    match deployments.get_opt(crate::install::objects::MANAGER).await {
        Ok(d) => bail!(crate::install::wait::no_ready_pod_reason(ns, d.as_ref())),
        Err(e) => {
            tracing::debug!(error = %e, "cannot read the manager Deployment");
            bail!(no_ready_pod_message(Some(ns)))
        }
    }
}

/// The error of [`ready_manager_pod`] when no manager pod in `namespace` is
/// ready and its Deployment cannot be read, with the `kubectl` line that lists
/// them there (without `-n` kubectl looks in the context's namespace, not the
/// manager's).
pub fn no_ready_pod_message(namespace: Option<&str>) -> String {
    let ns = namespace.map(|n| format!(" -n {n}")).unwrap_or_default();
    let place = namespace.map(|n| format!(" in {n}")).unwrap_or_default();
    format!(
        "no ready traffic manager pod ({MANAGER_SELECTOR}){place} — see \
         `kubectl get pods{ns} -l {MANAGER_SELECTOR}`"
    )
}

/// How long a new data connection waits for a ready manager pod (or a
/// port-forward that opens) before the agent closes it. While the manager pod is
/// replaced (killed, rolled) the root daemon's redial finds no ready pod; holding
/// its connection until the new pod is ready (1–2 s in the lab) makes traffic
/// resume at once instead of after the daemon's next backoff step. Shorter than
/// the daemon's TLS handshake timeout (5 s), which would drop a connection that
/// waits longer. It also bounds each attempt: when the API server is black-holed
/// (tr-10) a list or port-forward request hangs, and the attempt is dropped
/// (closing its API connection) instead of lingering after the daemon gave up.
const POD_WAIT: Duration = Duration::from_secs(4);

/// Pause between pod lists while waiting: two cheap requests a second.
const POD_POLL: Duration = Duration::from_millis(500);

async fn open_port_forward(
    pods: &PodChoice,
    port: u16,
) -> Result<(String, kube::api::Portforwarder, tokio::io::DuplexStream)> {
    let api = &pods.api;
    let pod = ready_manager_pod_preferring(api, pods.preferred.as_deref()).await?;
    let mut pf = api
        .portforward(&pod, &[port])
        .await
        .with_context(|| format!("port-forward to pod {pod} port {port} failed"))?;
    let remote = pf
        .take_stream(port)
        .ok_or_else(|| anyhow!("port-forward to {pod}: no stream for port {port}"))?;
    Ok((pod, pf, remote))
}

async fn forward(api: PodChoice, port: u16, laptop: TcpStream) -> Result<()> {
    forward_then(api, port, laptop, || ()).await
}

/// [`forward`] that calls `opened` once the port-forward is open, before it
/// carries anything.
async fn forward_then(
    api: PodChoice,
    port: u16,
    mut laptop: TcpStream,
    opened: impl FnOnce(),
) -> Result<()> {
    let deadline = tokio::time::Instant::now() + POD_WAIT;
    let mut waited = false;
    let (pod, pf, mut remote) = loop {
        let attempt = tokio::time::timeout_at(deadline, open_port_forward(&api, port)).await;
        let attempt = attempt.unwrap_or_else(|_| {
            Err(anyhow!(
                "no answer from the API server within {} s (list the manager pod, open the port-forward)",
                POD_WAIT.as_secs()
            ))
        });
        match attempt {
            Ok(opened) => {
                set_data_error(&api.last_error, None);
                break opened;
            }
            Err(e) if tokio::time::Instant::now() + POD_POLL < deadline => {
                if !waited {
                    info!(
                        "waiting up to {} s for the traffic manager: {e:#}",
                        POD_WAIT.as_secs()
                    );
                    waited = true;
                }
                tokio::time::sleep(POD_POLL).await;
            }
            Err(e) => {
                set_data_error(&api.last_error, Some(format!("{e:#}")));
                return Err(e);
            }
        }
    };
    info!(%pod, port, "port-forward open");
    opened();
    let result = tokio::io::copy_bidirectional(&mut laptop, &mut remote).await;
    drop(remote);
    pf.abort();
    match result {
        Ok((up, down)) => {
            info!(%pod, up, down, "port-forward closed");
            Ok(())
        }
        Err(e) => Err(anyhow!(e).context(format!("port-forward to {pod} broke"))),
    }
}

/// A session's user-side half, connected to the API server and listening:
/// [`open_session`] made it, [`OpenSession::run`] serves it.
pub struct OpenSession {
    config: AgentConfig,
    conn: crate::kubeconfig::KubeConnection,
    /// The SSH connection to the API server (with a jump host); held for the
    /// session's life.
    _ssh_tunnel: Option<crate::ssh::SshTunnel>,
    listener: TcpListener,
    addr: std::net::SocketAddr,
    /// The SSH data-plane bypass: data connections ride `direct-tcpip` to the
    /// manager Service's ClusterIP through the session's SSH path, or fall back
    /// to port-forward ([`DirectPath`]); `None` = port-forward only.
    ssh_direct: Option<(crate::ssh::tunnel::SshDialer, SharedPath)>,
    /// Why the last data connection reached no manager ([`DataError`]).
    data_error: DataError,
}

impl OpenSession {
    /// Why the session's last data connection reached no manager pod, shared
    /// with the data connections' tasks (status).
    pub fn data_error(&self) -> DataError {
        self.data_error.clone()
    }

    /// The loopback address the root daemon dials for the data channel.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// The session's SSH path (API server, ssh-direct data channel), whose
    /// [`crate::ssh::SshDialer::last_error`] says why the transport
    /// fails; `None` without a jump host.
    pub fn ssh_path(&self) -> Option<crate::ssh::SshDialer> {
        self._ssh_tunnel.as_ref().map(crate::ssh::SshTunnel::dialer)
    }

    /// An ssh-direct session's data path as it is now (status); `None` for
    /// other sessions.
    pub fn data_path(&self) -> Option<SharedPath> {
        self.ssh_direct.as_ref().map(|(_, p)| p.clone())
    }

    /// Serve the session until `cancel` fires: accept the root daemon's data
    /// connections (one port-forward each) and run the route watch.
    pub async fn run(self, cancel: CancellationToken) -> Result<()> {
        let OpenSession {
            config,
            conn,
            _ssh_tunnel,
            listener,
            addr,
            ssh_direct,
            data_error,
        } = self;
        let api: Api<Pod> = Api::namespaced(conn.client.clone(), &config.manager_namespace);
        let choice = PodChoice {
            api: api.clone(),
            preferred: config.replica.as_deref().map(Arc::from),
            last_error: data_error,
        };
        match &ssh_direct {
            Some((dialer, path)) => {
                let target = lock_path(path).target();
                info!(%addr, ?target, via = %dialer.last_hop(), cluster = %conn.description, "offering the manager's data port (ssh-direct)")
            }
            None => {
                info!(%addr, cluster = %conn.description, "offering the manager's data port (port-forward)")
            }
        }
        let route_watch = config.grpc_port.map(|grpc_port| {
            tokio::spawn(crate::route_watch::run(
                conn.client.clone(),
                crate::route_watch::WatchConfig {
                    manager_namespace: config.manager_namespace.clone(),
                    grpc_port,
                    namespace: conn.description.namespace.clone(),
                    keep_out: config.keep_out.clone(),
                    never_proxy: config.never_proxy.clone(),
                    extra_domains: config.extra_domains.clone(),
                    runtime_dir: config.runtime_dir.clone(),
                    data_addr: addr,
                },
            ))
        });
        // Data connections in flight end with the session too.
        let mut forwards = tokio::task::JoinSet::new();
        let svc: Api<Service> = Api::namespaced(conn.client.clone(), &config.manager_namespace);
        // Port-forward data connections of an ssh-direct session (fallback):
        // cancelled when ssh-direct works again.
        let mut fallback = cancel.child_token();
        let (probe_tx, mut probe_rx) = tokio::sync::mpsc::channel::<Result<(), String>>(1);
        loop {
            // A data connection's task may switch the path to port-forward at
            // any time: look at least once a second whether a probe is due.
            let now = Instant::now();
            let next_probe = ssh_direct.as_ref().map(|(_, p)| {
                lock_path(p)
                    .poll_timeout()
                    .map_or(now + PATH_CHECK_EVERY, |t| t.min(now + PATH_CHECK_EVERY))
            });
            tokio::select! {
                () = tokio::time::sleep_until(next_probe.unwrap_or(now).into()), if next_probe.is_some() => {
                    if let Some((dialer, path)) = &ssh_direct {
                        let now = Instant::now();
                        if lock_path(path).poll_timeout().is_none_or(|t| t > now) {
                            continue;
                        }
                        lock_path(path).handle_probe_started(now);
                        let (dialer, path, svc, tx) = (dialer.clone(), path.clone(), svc.clone(), probe_tx.clone());
                        forwards.spawn(async move {
                            let _ = tx.send(probe_direct(dialer, path, svc).await).await;
                        });
                    }
                }
                Some(result) = probe_rx.recv() => {
                    if let Some((_, path)) = &ssh_direct {
                        let failed = result.as_ref().err().cloned();
                        if lock_path(path).handle_probe(result, Instant::now()) {
                            info!(target = ?lock_path(path).target(), "ssh-direct works again: closing the port-forward data connections so the data channel comes back to it");
                            fallback.cancel();
                            fallback = cancel.child_token();
                        } else if let Some(why) = failed {
                            info!("ssh-direct still unavailable: {why}");
                        }
                    }
                }
                accepted = listener.accept() => {
                    let (stream, peer) = match accepted {
                        Ok(a) => a,
                        Err(e) => {
                            // EMFILE and the like: the listener itself stays usable.
                            warn!(%addr, "accept failed: {e}");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    };
                    // The relay writes every frame as soon as it arrives: Nagle
                    // would hold the second of two back-to-back small frames (a
                    // TCP handshake's last ACK, then the request) until the root
                    // daemon's delayed ACK, 40 ms per connection through the tunnel.
                    let _ = stream.set_nodelay(true);
                    if let Some((dialer, path)) = &ssh_direct {
                        let way = DirectWay {
                            dialer: dialer.clone(),
                            path: path.clone(),
                            svc: svc.clone(),
                            pods: choice.clone(),
                            pod_port: config.port,
                            fallback: fallback.clone(),
                        };
                        forwards.spawn(direct_or_fallback(way, stream, peer));
                        continue;
                    }
                    let choice = choice.clone();
                    let port = config.port;
                    forwards.spawn(async move {
                        if let Err(e) = forward(choice, port, stream).await {
                            warn!(%peer, "data channel: {e:#}");
                        }
                    });
                }
                Some(_) = forwards.join_next(), if !forwards.is_empty() => {}
                () = cancel.cancelled() => break,
            }
        }
        if let Some(task) = route_watch {
            task.abort();
        }
        forwards.abort_all();
        info!(%addr, "session stopped");
        Ok(())
    }
}

/// Connect to the API server (through the SSH path, if any) with the session's
/// user environment and listen on `config.listen`: the first half of a session,
/// whose errors the CLI shows. A restarted user daemon passes the address the
/// root daemon already dials.
pub async fn open_session(config: AgentConfig) -> Result<OpenSession> {
    let listener = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let addr = listener.local_addr()?;
    // The session's SSH connection carries it: short keepalives (both data paths).
    let ssh = config.ssh.clone().map(|mut plan| {
        plan.keepalive_ms
            .get_or_insert(crate::ssh::bypass::SESSION_KEEPALIVE.as_millis() as u64);
        plan
    });
    let (conn, ssh_tunnel) =
        crate::ssh::connect_kube(&config.flags, ssh.as_ref(), &config.env).await?;
    let ssh_direct = match (config.ssh_direct, &ssh_tunnel) {
        (Some(target), Some(tunnel)) => {
            let mut path = DirectPath::new(target);
            if let Some(why) = &config.ssh_direct_failed {
                path.handle_direct_failed(why.clone(), Instant::now());
            }
            Some((tunnel.dialer(), Arc::new(Mutex::new(path))))
        }
        (Some(target), None) => {
            bail!("ssh-direct {target} needs an SSH path (--ssh-addr or --ssh-alias)")
        }
        (None, _) => None,
    };
    info!(cluster = %conn.description, ssh = ?config.ssh.as_ref().map(|p| p.describe()), "connected to the API server");
    Ok(OpenSession {
        config,
        conn,
        _ssh_tunnel: ssh_tunnel,
        listener,
        addr,
        ssh_direct,
        data_error: DataError::default(),
    })
}

/// A whole session's user-side half: [`open_session`], then
/// [`OpenSession::run`] until `cancel`.
pub async fn run_session(config: AgentConfig, cancel: CancellationToken) -> Result<()> {
    open_session(config).await?.run(cancel).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, version: &str, created: &str, ready: bool) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": name,
                "creationTimestamp": created,
                "annotations": {"kvpn.dev/version": version},
            },
            "status": {"conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]},
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    fn picked(pods: &[Pod]) -> Option<String> {
        pick_manager_pod(pods).and_then(|p| p.metadata.name.clone())
    }

    #[test]
    fn during_a_rollout_this_versions_pod_wins_even_with_the_same_creation_second() {
        let ours = env!("CARGO_PKG_VERSION");
        let t = "2026-11-30T10:00:00Z";
        let old = pod("old", "0.0.1", t, true);
        let new = pod("new", ours, t, true);
        assert_eq!(picked(&[new.clone(), old.clone()]), Some("new".into()));
        assert_eq!(picked(&[old.clone(), new]), Some("new".into()));
        // Not ready yet: the old one still serves.
        let new_unready = pod("new", ours, "2026-11-30T10:00:05Z", false);
        assert_eq!(picked(&[old, new_unready]), Some("old".into()));
    }

    #[test]
    fn same_version_newest_wins_and_none_ready_is_none() {
        let ours = env!("CARGO_PKG_VERSION");
        let a = pod("a", ours, "2026-11-30T10:00:00Z", true);
        let b = pod("b", ours, "2026-11-30T10:00:09Z", true);
        assert_eq!(picked(&[a.clone(), b]), Some("b".into()));
        let c = pod("c", ours, "2026-11-30T10:00:09Z", false);
        assert_eq!(picked(&[c]), None);
        assert_eq!(picked(&[a]), Some("a".into()));
    }

    /// The "no ready pod" hint lists the pods in the manager's namespace (on main
    /// it had no `-n`, so kubectl looked in the context's namespace and listed
    /// nothing: a tester's finding).
    #[test]
    fn no_ready_pod_hint_names_the_manager_namespace() {
        let msg = no_ready_pod_message(Some("kvpn-test"));
        assert!(
            msg.contains(&format!(
                "`kubectl get pods -n kvpn-test -l {MANAGER_SELECTOR}`"
            )),
            "{msg}"
        );
        assert!(msg.contains("in kvpn-test"), "{msg}");
        let msg = no_ready_pod_message(None);
        assert!(
            msg.contains(&format!("`kubectl get pods -l {MANAGER_SELECTOR}`")),
            "{msg}"
        );
    }
}
