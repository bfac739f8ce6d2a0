//! The stand-in's pod loop: a watcher on all pods (list-then-watch) that binds
//! unscheduled pods to the node and runs one worker task per pod bound to it. A worker
//! owns the pod's sandbox (netns + IP), volumes, container processes, probes, status
//! reports and events, and tears everything down on deletion or shutdown.
//!
//! Pure parts live in [`super::status`] (container state machine, phase, conditions),
//! [`super::spec`] (env, volumes, DNS) and [`IpAllocator`]; this file is the tokio
//! shell around them.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use ipnet::Ipv4Net;
use k8s_openapi::api::core::v1::{ConfigMap, Container, Event, Pod, Probe, Secret};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher;
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::images::{Entrypoint, EntrypointError, entrypoint};
use super::runner::{self, Launch, MountRequest, RealFs};
use super::server::PodEntry;
use super::spec::{self, ConfigError, PodPlace, Sources, VolumeContent};
use super::status::{
    Conditions, ContainerMachine, PodFacts, ProbeCounter, RestartPolicy, Wake, k8s_time,
    pod_status, update_conditions,
};
use super::{Ctx, now};
use crate::topology::Pod as Sandbox;

/// Hands out pod IPs from the node's pod range round-robin (like the host-local IPAM
/// plugin), so a deleted pod's IP is not reused at once.
#[derive(Debug, Clone)]
pub(crate) struct IpAllocator {
    hosts: Vec<Ipv4Addr>,
    used: BTreeSet<Ipv4Addr>,
    next: usize,
}

impl IpAllocator {
    pub(crate) fn new(cidr: Ipv4Net, gateway: Ipv4Addr) -> IpAllocator {
        IpAllocator {
            hosts: cidr.hosts().filter(|ip| *ip != gateway).collect(),
            used: BTreeSet::new(),
            next: 0,
        }
    }

    pub(crate) fn reserve(&mut self, ip: Ipv4Addr) {
        self.used.insert(ip);
    }

    pub(crate) fn release(&mut self, ip: Ipv4Addr) {
        self.used.remove(&ip);
    }

    pub(crate) fn allocate(&mut self) -> Option<Ipv4Addr> {
        let n = self.hosts.len();
        for k in 0..n {
            let i = (self.next + k) % n;
            let ip = self.hosts[i];
            if !self.used.contains(&ip) {
                self.used.insert(ip);
                self.next = (i + 1) % n;
                return Some(ip);
            }
        }
        None
    }
}

/// How long a pod may take to die when the stand-in itself stops.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);
/// Retry interval for a pod whose sandbox, volumes or config are not ready.
const SETUP_RETRY: Duration = Duration::from_secs(2);
/// The kubelet's default `terminationGracePeriodSeconds`.
const DEFAULT_GRACE_SECONDS: i64 = 30;
/// Where the ServiceAccount admission plugin mounts the token.
const SERVICE_ACCOUNT_MOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

struct Worker {
    tx: watch::Sender<Option<Arc<Pod>>>,
    handle: JoinHandle<()>,
}

fn uid_of(pod: &Pod) -> String {
    pod.metadata.uid.clone().unwrap_or_default()
}

/// Watches pods, binds unscheduled ones, and runs a worker per pod of this node until
/// shutdown; then waits for the workers' teardown.
pub(crate) async fn dispatch(ctx: Arc<Ctx>) {
    let api: Api<Pod> = Api::all(ctx.client.clone());
    let stream = watcher(api, watcher::Config::default()).default_backoff();
    let mut stream = std::pin::pin!(stream);
    let mut workers: HashMap<String, Worker> = HashMap::new();
    let mut binding: HashSet<String> = HashSet::new();
    let (bound_tx, mut bound_rx) = mpsc::unbounded_channel::<String>();
    let mut listed: Option<HashSet<String>> = None;
    let mut shutdown = ctx.shutdown.clone();
    loop {
        tokio::select! {
            _ = super::wait_true(&mut shutdown) => break,
            Some(uid) = bound_rx.recv() => { binding.remove(&uid); }
            ev = stream.next() => match ev {
                Some(Ok(watcher::Event::Init)) => listed = Some(HashSet::new()),
                Some(Ok(watcher::Event::InitApply(pod))) => {
                    if let Some(l) = listed.as_mut() {
                        l.insert(uid_of(&pod));
                    }
                    on_pod(&ctx, pod, &mut workers, &mut binding, &bound_tx);
                }
                Some(Ok(watcher::Event::InitDone)) => {
                    if let Some(l) = listed.take() {
                        for (uid, w) in &workers {
                            if !l.contains(uid) {
                                w.tx.send_replace(None);
                            }
                        }
                    }
                }
                Some(Ok(watcher::Event::Apply(pod))) => on_pod(&ctx, pod, &mut workers, &mut binding, &bound_tx),
                Some(Ok(watcher::Event::Delete(pod))) => {
                    if let Some(w) = workers.get(&uid_of(&pod)) {
                        w.tx.send_replace(None);
                    }
                }
                Some(Err(e)) => tracing::warn!(error = %e, "pod watch failed; retrying"),
                None => break,
            },
        }
        workers.retain(|_, w| !w.handle.is_finished());
    }
    // Workers see the shutdown flag themselves; give them their teardown time.
    for (_, w) in workers {
        let _ = tokio::time::timeout(SHUTDOWN_GRACE + Duration::from_secs(10), w.handle).await;
    }
}

fn on_pod(
    ctx: &Arc<Ctx>,
    pod: Pod,
    workers: &mut HashMap<String, Worker>,
    binding: &mut HashSet<String>,
    bound_tx: &mpsc::UnboundedSender<String>,
) {
    let uid = uid_of(&pod);
    let Some(spec) = &pod.spec else { return };
    let terminating = pod.metadata.deletion_timestamp.is_some();
    match spec.node_name.as_deref() {
        None | Some("") => {
            let ours = matches!(
                spec.scheduler_name.as_deref(),
                None | Some("default-scheduler")
            );
            if terminating || !ours || binding.contains(&uid) {
                return;
            }
            if let Some(sel) = &spec.node_selector
                && let Some((k, v)) = sel
                    .iter()
                    .find(|(k, v)| !ctx.node_labels.iter().any(|(lk, lv)| lk == *k && lv == *v))
            {
                tracing::debug!(pod = ?pod.metadata.name, key = %k, value = %v, "nodeSelector does not match this node; not binding");
                return;
            }
            binding.insert(uid.clone());
            let ctx = ctx.clone();
            let bound_tx = bound_tx.clone();
            tokio::spawn(async move {
                bind(&ctx, &pod).await;
                let _ = bound_tx.send(uid);
            });
        }
        Some(n) if n == ctx.node_name => {
            if let Some(w) = workers.get(&uid) {
                w.tx.send_replace(Some(Arc::new(pod)));
            } else if terminating {
                // Bound here but not running (e.g. from before a restart): finish it.
                let ctx = ctx.clone();
                tokio::spawn(async move { delete_now(&ctx, &pod).await });
            } else if !matches!(
                pod.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Succeeded" | "Failed")
            ) {
                let (tx, rx) = watch::channel(Some(Arc::new(pod)));
                let handle = tokio::spawn(run_worker(ctx.clone(), rx));
                workers.insert(uid, Worker { tx, handle });
            }
        }
        Some(_) => {}
    }
}

/// Binds `pod` to this node, retrying transient failures (not conflicts: the pod is
/// bound already, nor a missing pod) with back-off while the stand-in runs.
async fn bind(ctx: &Arc<Ctx>, pod: &Pod) {
    let ns = pod.metadata.namespace.clone().unwrap_or_default();
    let name = pod.metadata.name.clone().unwrap_or_default();
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let body = json!({
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": name, "namespace": ns, "uid": uid_of(pod)},
        "target": {"apiVersion": "v1", "kind": "Node", "name": ctx.node_name},
    });
    let mut delay = Duration::from_millis(200);
    loop {
        match api
            .create_subresource::<_, Value>("binding", &name, &PostParams::default(), &body)
            .await
        {
            Ok(_) => {
                tracing::debug!(pod = %name, namespace = %ns, node = %ctx.node_name, "bound");
                post_event(
                    ctx,
                    &PodRef::of(pod),
                    None,
                    "Normal",
                    "Scheduled",
                    format!("Successfully assigned {ns}/{name} to {}", ctx.node_name),
                    "default-scheduler",
                );
                return;
            }
            // Conflict: already bound (another event got there first); 404: gone.
            Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => return,
            Err(e) => {
                tracing::warn!(pod = %name, namespace = %ns, error = %e, ?delay, "binding failed; retrying");
            }
        }
        let mut shutdown = ctx.shutdown.clone();
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = super::wait_true(&mut shutdown) => return,
        }
        delay = (delay * 2).min(Duration::from_secs(10));
    }
}

async fn delete_now(ctx: &Arc<Ctx>, pod: &Pod) {
    let r = PodRef::of(pod);
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &r.namespace);
    let dp = DeleteParams {
        grace_period_seconds: Some(0),
        preconditions: Some(Preconditions {
            uid: Some(r.uid.clone()),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match api.delete(&r.name, &dp).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
        Err(e) => {
            tracing::warn!(pod = %r.name, namespace = %r.namespace, error = %e, "final pod delete failed")
        }
    }
}

/// Namespace, name and UID of a pod.
#[derive(Debug, Clone)]
struct PodRef {
    namespace: String,
    name: String,
    uid: String,
}

impl PodRef {
    fn of(pod: &Pod) -> PodRef {
        PodRef {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            uid: uid_of(pod),
        }
    }
}

/// Posts a core/v1 Event about the pod (fire and forget), as the kubelet does.
fn post_event(
    ctx: &Arc<Ctx>,
    pod: &PodRef,
    container: Option<&str>,
    kind: &str,
    reason: &str,
    message: String,
    component: &str,
) {
    let t = k8s_time(now());
    let mut involved = json!({
        "apiVersion": "v1", "kind": "Pod",
        "namespace": pod.namespace, "name": pod.name, "uid": pod.uid,
    });
    if let Some(c) = container {
        involved["fieldPath"] = json!(format!("spec.containers{{{c}}}"));
    }
    let ev = json!({
        "metadata": {"generateName": format!("{}.", pod.name), "namespace": pod.namespace},
        "involvedObject": involved,
        "reason": reason,
        "message": message,
        "type": kind,
        "source": {"component": component, "host": ctx.node_name},
        "firstTimestamp": t,
        "lastTimestamp": t,
        "count": 1,
        "reportingComponent": component,
        "reportingInstance": ctx.node_name,
    });
    let Ok(ev) = serde_json::from_value::<Event>(ev) else {
        return;
    };
    let api: Api<Event> = Api::namespaced(ctx.client.clone(), &pod.namespace);
    tokio::spawn(async move {
        if let Err(e) = api.create(&PostParams::default(), &ev).await {
            tracing::debug!(error = %e, "posting an event failed");
        }
    });
}

/// Why a worker stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// deletionTimestamp set: kill within the grace period, then delete the object.
    Deleted,
    /// The object is gone: kill quickly.
    Gone,
    /// The stand-in stops.
    Shutdown,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ProbeKind {
    Readiness,
    Liveness,
}

struct ExitEvent {
    idx: usize,
    generation: u64,
    status: ExitStatus,
}

struct ProbeEvent {
    idx: usize,
    generation: u64,
    kind: ProbeKind,
    ok: bool,
    message: String,
}

struct Proc {
    pid: u32,
    started: Instant,
    probes: Vec<JoinHandle<()>>,
    exited: watch::Receiver<bool>,
}

struct Slot {
    spec: Container,
    machine: ContainerMachine,
    proc: Option<Proc>,
    wake: Option<(Instant, Wake)>,
    generation: u64,
    runs: u32,
    readiness: Option<ProbeCounter>,
    liveness: Option<ProbeCounter>,
}

struct PodWorker {
    ctx: Arc<Ctx>,
    pod: Arc<Pod>,
    r: PodRef,
    role: String,
    sandbox: Option<Sandbox>,
    pod_dir: PathBuf,
    start_time: k8s_openapi::jiff::Timestamp,
    slots: Vec<Slot>,
    conds: Conditions,
    policy: RestartPolicy,
    volumes: Vec<(String, VolumeContent)>,
    last_sent: Option<Value>,
    publish_retry: Option<Instant>,
    exit_tx: mpsc::UnboundedSender<ExitEvent>,
    exit_rx: mpsc::UnboundedReceiver<ExitEvent>,
    probe_tx: mpsc::UnboundedSender<ProbeEvent>,
    probe_rx: mpsc::UnboundedReceiver<ProbeEvent>,
}

async fn run_worker(ctx: Arc<Ctx>, mut pod_rx: watch::Receiver<Option<Arc<Pod>>>) {
    let Some(pod) = pod_rx.borrow().clone() else {
        return;
    };
    let mut w = PodWorker::new(ctx, pod);
    tracing::info!(pod = %w.r.name, namespace = %w.r.namespace, "pod worker started");
    let stop = match w.setup(&mut pod_rx).await {
        Some(stop) => stop,
        None => w.main_loop(&mut pod_rx).await,
    };
    w.teardown(stop).await;
    tracing::info!(pod = %w.r.name, namespace = %w.r.namespace, ?stop, "pod worker done");
}

fn stop_of(update: &Option<Arc<Pod>>) -> Option<Stop> {
    match update {
        None => Some(Stop::Gone),
        Some(p) if p.metadata.deletion_timestamp.is_some() => Some(Stop::Deleted),
        Some(_) => None,
    }
}

impl PodWorker {
    fn new(ctx: Arc<Ctx>, pod: Arc<Pod>) -> PodWorker {
        let r = PodRef::of(&pod);
        let role = spec::netns_role(&r.name, &r.uid);
        let pod_dir = pod_dir(&ctx.dir, &r.namespace, &r.name, &r.uid);
        let pod_ref = format!("{}_{}({})", r.name, r.namespace, r.uid);
        let spec = pod.spec.clone().unwrap_or_default();
        let slots = spec
            .containers
            .iter()
            .map(|c| Slot {
                spec: c.clone(),
                machine: ContainerMachine::new(
                    &c.name,
                    c.image.as_deref().unwrap_or(""),
                    &pod_ref,
                    ctx.config.backoff,
                ),
                proc: None,
                wake: None,
                generation: 0,
                runs: 0,
                readiness: None,
                liveness: None,
            })
            .collect();
        let (exit_tx, exit_rx) = mpsc::unbounded_channel();
        let (probe_tx, probe_rx) = mpsc::unbounded_channel();
        PodWorker {
            policy: RestartPolicy::parse(spec.restart_policy.as_deref()),
            ctx,
            pod,
            r,
            role,
            sandbox: None,
            pod_dir,
            start_time: now(),
            slots,
            conds: Conditions::default(),
            volumes: Vec::new(),
            last_sent: None,
            publish_retry: None,
            exit_tx,
            exit_rx,
            probe_tx,
            probe_rx,
        }
    }

    fn event(&self, container: Option<&str>, kind: &str, reason: &str, message: String) {
        post_event(
            &self.ctx, &self.r, container, kind, reason, message, "kubelet",
        );
    }

    fn pod_ip(&self) -> Option<Ipv4Addr> {
        self.sandbox.as_ref().map(|s| s.ip)
    }

    /// Waits `d`, returning early with a stop reason.
    async fn pause(
        &mut self,
        d: Duration,
        pod_rx: &mut watch::Receiver<Option<Arc<Pod>>>,
    ) -> Option<Stop> {
        let mut shutdown = self.ctx.shutdown.clone();
        let deadline = Instant::now() + d;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => return None,
                _ = super::wait_true(&mut shutdown) => return Some(Stop::Shutdown),
                r = pod_rx.changed() => {
                    if r.is_err() {
                        return Some(Stop::Shutdown);
                    }
                    let update = pod_rx.borrow_and_update().clone();
                    if let Some(stop) = stop_of(&update) {
                        return Some(stop);
                    }
                    if let Some(p) = update {
                        self.pod = p;
                    }
                }
            }
        }
    }

    /// Sandbox (netns, IP), pod files and volumes; retried until they work or the pod
    /// goes away.
    async fn setup(&mut self, pod_rx: &mut watch::Receiver<Option<Arc<Pod>>>) -> Option<Stop> {
        if let Some(stop) = stop_of(&pod_rx.borrow().clone()) {
            return Some(stop);
        }
        for sub in ["volumes", "logs", "stage"] {
            if let Err(e) = std::fs::create_dir_all(self.pod_dir.join(sub)) {
                tracing::warn!(dir = %self.pod_dir.display(), error = %e, "cannot create the pod folder");
            }
        }
        loop {
            if self.sandbox.is_none() {
                match self.create_sandbox().await {
                    Ok(()) => {}
                    Err(msg) => {
                        for s in &mut self.slots {
                            s.machine.wait_for_config("ContainerCreating", &msg);
                        }
                        self.event(None, "Warning", "FailedCreatePodSandBox", msg);
                        self.publish().await;
                        if let Some(stop) = self.pause(SETUP_RETRY, pod_rx).await {
                            return Some(stop);
                        }
                        continue;
                    }
                }
            }
            match self.prepare_volumes().await {
                Ok(()) => break,
                Err(ConfigError(msg)) => {
                    for s in &mut self.slots {
                        s.machine.wait_for_config("ContainerCreating", &msg);
                    }
                    self.event(None, "Warning", "FailedMount", msg);
                    self.publish().await;
                    if let Some(stop) = self.pause(SETUP_RETRY, pod_rx).await {
                        return Some(stop);
                    }
                }
            }
        }
        let at = Instant::now();
        for s in &mut self.slots {
            s.wake = Some((at, Wake::Start));
        }
        if self
            .pod
            .spec
            .as_ref()
            .is_some_and(|s| s.init_containers.as_ref().is_some_and(|i| !i.is_empty()))
        {
            self.event(
                None,
                "Warning",
                "InitContainersIgnored",
                "the kvpn lab kubelet stand-in does not run init containers; starting the containers".into(),
            );
        }
        None
    }

    async fn create_sandbox(&mut self) -> Result<(), String> {
        let ip = {
            let mut ips = self
                .ctx
                .ips
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            ips.allocate()
        }
        .ok_or_else(|| {
            format!(
                "no free IP address in the node's podCIDR {}",
                self.ctx.node.pod_cidr()
            )
        })?;
        let ctx = self.ctx.clone();
        let role = self.role.clone();
        let result = tokio::task::spawn_blocking(move || {
            let stale = crate::Netns::from_name(&crate::topology::netns_name(&ctx.lab_id, &role));
            // A leftover of an earlier run of this pod (the stand-in was killed).
            if stale.exists() {
                let _ = stale.delete();
            }
            ctx.node.add_pod(&role, ip)
        })
        .await;
        match result {
            Ok(Ok(sandbox)) => {
                tracing::debug!(pod = %self.r.name, %ip, netns = sandbox.netns.name(), "sandbox ready");
                record_sandbox(&self.ctx.dir, &sandbox);
                self.ctx.directory.insert(
                    &self.r.namespace,
                    &self.r.name,
                    PodEntry {
                        uid: self.r.uid.clone(),
                        netns: sandbox.netns.name().to_owned(),
                        logs: HashMap::new(),
                    },
                );
                self.sandbox = Some(sandbox);
                let hostname = spec::hostname(&self.pod);
                let _ = std::fs::write(self.pod_dir.join("hosts"), spec::hosts_file(&hostname, ip));
                if let Some(text) =
                    spec::resolv_conf(&self.pod, self.ctx.config.cluster_dns.as_ref())
                {
                    let _ = std::fs::write(self.pod_dir.join("resolv.conf"), text);
                }
                Ok(())
            }
            Ok(Err(e)) => {
                self.release_ip(ip);
                Err(format!("Failed to create pod sandbox: {e}"))
            }
            Err(e) => {
                self.release_ip(ip);
                Err(format!("Failed to create pod sandbox: {e}"))
            }
        }
    }

    fn release_ip(&self, ip: Ipv4Addr) {
        self.ctx
            .ips
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .release(ip);
    }

    fn place(&self) -> PodPlace {
        PodPlace {
            pod_ip: self.pod_ip().unwrap_or(Ipv4Addr::UNSPECIFIED),
            host_ip: self.ctx.host_ip,
            node_name: self.ctx.node_name.clone(),
        }
    }

    async fn fetch_sources(&self) -> Sources {
        let refs = spec::references(&self.pod);
        let mut sources = Sources::default();
        let secrets: Api<Secret> = Api::namespaced(self.ctx.client.clone(), &self.r.namespace);
        for name in refs.secrets {
            match secrets.get_opt(&name).await {
                Ok(Some(s)) => {
                    let data = s
                        .data
                        .unwrap_or_default()
                        .into_iter()
                        .map(|(k, v)| (k, v.0))
                        .collect();
                    sources.secrets.insert(name, data);
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(secret = %name, error = %e, "reading a secret failed"),
            }
        }
        let cms: Api<ConfigMap> = Api::namespaced(self.ctx.client.clone(), &self.r.namespace);
        for name in refs.config_maps {
            match cms.get_opt(&name).await {
                Ok(Some(m)) => {
                    let mut data: std::collections::BTreeMap<String, Vec<u8>> = m
                        .data
                        .unwrap_or_default()
                        .into_iter()
                        .map(|(k, v)| (k, v.into_bytes()))
                        .collect();
                    for (k, v) in m.binary_data.unwrap_or_default() {
                        data.insert(k, v.0);
                    }
                    sources.config_maps.insert(name, data);
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(configmap = %name, error = %e, "reading a configmap failed")
                }
            }
        }
        sources
    }

    /// Writes the volume files under `<pod folder>/volumes/<name>/`.
    async fn prepare_volumes(&mut self) -> Result<(), ConfigError> {
        let sources = self.fetch_sources().await;
        let volumes = spec::volume_contents(&self.pod, &self.place(), &sources)?;
        for (name, content) in &volumes {
            let VolumeContent::Files(files) = content else {
                continue;
            };
            let dir = self.pod_dir.join("volumes").join(name);
            let io = |e: std::io::Error| {
                ConfigError(format!(
                    "MountVolume.SetUp failed for volume \"{name}\": {e}"
                ))
            };
            std::fs::create_dir_all(&dir).map_err(io)?;
            for f in files {
                if !spec::safe_relative_path(&f.path) {
                    return Err(ConfigError(format!(
                        "MountVolume.SetUp failed for volume \"{name}\": invalid path {:?}",
                        f.path
                    )));
                }
                let path = dir.join(&f.path);
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent).map_err(io)?;
                }
                std::fs::write(&path, &f.contents).map_err(io)?;
                use std::os::unix::fs::PermissionsExt as _;
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(f.mode))
                    .map_err(io)?;
            }
        }
        self.volumes = volumes;
        Ok(())
    }

    async fn main_loop(&mut self, pod_rx: &mut watch::Receiver<Option<Arc<Pod>>>) -> Stop {
        let mut shutdown = self.ctx.shutdown.clone();
        loop {
            self.publish().await;
            let wake = self.next_wake();
            tokio::select! {
                r = pod_rx.changed() => {
                    if r.is_err() {
                        return Stop::Shutdown;
                    }
                    let update = pod_rx.borrow_and_update().clone();
                    if let Some(stop) = stop_of(&update) {
                        return stop;
                    }
                    if let Some(p) = update {
                        self.pod = p;
                    }
                }
                Some(e) = self.exit_rx.recv() => self.on_exit(e),
                Some(p) = self.probe_rx.recv() => self.on_probe(p),
                _ = tokio::time::sleep_until(wake) => self.on_timers().await,
                _ = super::wait_true(&mut shutdown) => return Stop::Shutdown,
            }
        }
    }

    fn next_wake(&self) -> Instant {
        self.slots
            .iter()
            .filter_map(|s| s.wake.map(|(t, _)| t))
            .chain(self.publish_retry)
            .min()
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(3600))
    }

    async fn on_timers(&mut self) {
        let at = Instant::now();
        if self.publish_retry.is_some_and(|t| t <= at) {
            self.publish_retry = None;
            self.last_sent = None;
        }
        for idx in 0..self.slots.len() {
            let Some((t, wake)) = self.slots[idx].wake else {
                continue;
            };
            if t > at {
                continue;
            }
            self.slots[idx].wake = None;
            match wake {
                Wake::Start => self.start_container(idx).await,
                Wake::ShowPullBackOff => {
                    let slot = &mut self.slots[idx];
                    let (d, next) = slot.machine.pull_backoff();
                    slot.wake = Some((Instant::now() + d, next));
                    let (name, image) = (slot.spec.name.clone(), slot.machine.image.clone());
                    self.event(
                        Some(&name),
                        "Normal",
                        "BackOff",
                        format!("Back-off pulling image \"{image}\""),
                    );
                    self.event(
                        Some(&name),
                        "Warning",
                        "Failed",
                        "Error: ImagePullBackOff".into(),
                    );
                }
            }
        }
    }

    fn base_env(&self) -> Vec<(String, String)> {
        let svc = self
            .ctx
            .config
            .kubernetes_service_ip
            .unwrap_or(crate::k8s::KUBERNETES_SERVICE_IP);
        let mut env: Vec<(String, String)> = vec![
            (
                "PATH".into(),
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
            ),
            ("HOSTNAME".into(), spec::hostname(&self.pod)),
            ("HOME".into(), "/root".into()),
            ("KUBERNETES_SERVICE_HOST".into(), svc.to_string()),
            ("KUBERNETES_SERVICE_PORT".into(), "443".into()),
            ("KUBERNETES_SERVICE_PORT_HTTPS".into(), "443".into()),
            ("KUBERNETES_PORT".into(), format!("tcp://{svc}:443")),
            ("KUBERNETES_PORT_443_TCP".into(), format!("tcp://{svc}:443")),
            ("KUBERNETES_PORT_443_TCP_PROTO".into(), "tcp".into()),
            ("KUBERNETES_PORT_443_TCP_PORT".into(), "443".into()),
            ("KUBERNETES_PORT_443_TCP_ADDR".into(), svc.to_string()),
        ];
        env.extend(self.ctx.config.pod_env.iter().cloned());
        env
    }

    /// The mounts of container `c`: its volumeMounts, plus the pod's resolv.conf and
    /// hosts files.
    fn mount_requests(&self, c: &Container) -> Result<Vec<MountRequest>, String> {
        let mut out = Vec::new();
        for vm in c.volume_mounts.iter().flatten() {
            let Some((_, content)) = self.volumes.iter().find(|(n, _)| *n == vm.name) else {
                return Err(format!("volume \"{}\" not found in the pod spec", vm.name));
            };
            let base = match content {
                VolumeContent::Files(_) => self.pod_dir.join("volumes").join(&vm.name),
                VolumeContent::HostPath(p) => p.clone(),
                VolumeContent::Unsupported(what) => {
                    tracing::warn!(pod = %self.r.name, volume = %vm.name, what = %what, "volume type not supported by the lab kubelet stand-in; not mounted");
                    continue;
                }
            };
            let source = match vm.sub_path.as_deref().filter(|s| !s.is_empty()) {
                Some(sub) if spec::safe_relative_path(sub) => base.join(sub),
                Some(sub) => return Err(format!("invalid subPath {sub:?}")),
                None => base,
            };
            out.push(MountRequest {
                // A hostPath of type CharDevice or Socket binds like a file.
                source_is_file: source.exists() && !source.is_dir(),
                source,
                target: PathBuf::from(&vm.mount_path),
                read_only: vm.read_only.unwrap_or(false),
                optional: vm.mount_path == SERVICE_ACCOUNT_MOUNT,
                what: format!("volume \"{}\"", vm.name),
            });
        }
        for (file, target) in [("resolv.conf", "/etc/resolv.conf"), ("hosts", "/etc/hosts")] {
            let source = self.pod_dir.join(file);
            if source.is_file() {
                out.push(MountRequest {
                    source,
                    target: PathBuf::from(target),
                    source_is_file: true,
                    read_only: false,
                    optional: true,
                    what: file.to_owned(),
                });
            }
        }
        Ok(out)
    }

    fn pull_message(&self, image: &str, why: &str) -> String {
        format!(
            "rpc error: code = NotFound desc = failed to pull and unpack image \"{image}\": {why}"
        )
    }

    async fn start_container(&mut self, idx: usize) {
        let Some(sandbox) = self.sandbox.clone() else {
            return;
        };
        let c = self.slots[idx].spec.clone();
        let name = c.name.clone();
        let image = c.image.clone().unwrap_or_default();
        let retry =
            |slot: &mut Slot, d: Duration| slot.wake = Some((Instant::now() + d, Wake::Start));
        let sources = self.fetch_sources().await;
        let env =
            match spec::container_env(&self.pod, &c, &self.place(), &sources, &self.base_env()) {
                Ok(e) => e,
                Err(ConfigError(m)) => {
                    self.slots[idx]
                        .machine
                        .wait_for_config("CreateContainerConfigError", &m);
                    retry(&mut self.slots[idx], SETUP_RETRY);
                    self.event(Some(&name), "Warning", "Failed", format!("Error: {m}"));
                    return;
                }
            };
        let (command, args) = spec::expand_command(&c, &env);
        let images = &self.ctx.config.images;
        let pull_failed = |w: &mut PodWorker, why: String| {
            let msg = w.pull_message(&image, &why);
            let slot = &mut w.slots[idx];
            let (d, next) = slot.machine.image_missing(&msg);
            slot.wake = Some((Instant::now() + d, next));
            w.event(
                Some(&name),
                "Normal",
                "Pulling",
                format!("Pulling image \"{image}\""),
            );
            w.event(
                Some(&name),
                "Warning",
                "Failed",
                format!("Failed to pull image \"{image}\": {msg}"),
            );
            w.event(
                Some(&name),
                "Warning",
                "Failed",
                "Error: ErrImagePull".into(),
            );
        };
        let (program, args) = match entrypoint(images, &image, &command, &args) {
            Ok(Entrypoint::WorkspaceBinary { name: bin, args }) => match crate::bin_path(&bin) {
                Ok(p) => (p, args),
                Err(e) => {
                    let why = format!(
                        "the kvpn lab maps this image to the workspace binary {bin}, which is not built: {e}"
                    );
                    pull_failed(self, why);
                    return;
                }
            },
            Ok(Entrypoint::Program { program, args }) => (PathBuf::from(program), args),
            Err(EntrypointError::UnknownImage) => {
                let why = format!(
                    "the kvpn lab kubelet stand-in has no local program for this image (known images: {})",
                    images.describe()
                );
                pull_failed(self, why);
                return;
            }
            Err(EntrypointError::NoCommand) => {
                let m = "no command specified";
                self.slots[idx]
                    .machine
                    .wait_for_config("CreateContainerError", m);
                retry(&mut self.slots[idx], SETUP_RETRY);
                self.event(Some(&name), "Warning", "Failed", format!("Error: {m}"));
                return;
            }
        };
        let groups = match self
            .mount_requests(&c)
            .and_then(|reqs| runner::plan_mounts(&reqs, &self.pod_dir.join("stage"), &RealFs))
        {
            Ok(g) => g,
            Err(m) => {
                self.slots[idx]
                    .machine
                    .wait_for_config("CreateContainerError", &m);
                retry(&mut self.slots[idx], SETUP_RETRY);
                self.event(Some(&name), "Warning", "Failed", format!("Error: {m}"));
                return;
            }
        };
        let run = self.slots[idx].runs;
        self.slots[idx].runs += 1;
        let log = self.pod_dir.join("logs").join(format!("{name}-{run}.log"));
        let launch = Launch {
            program: program.clone(),
            args,
            env,
            working_dir: c
                .working_dir
                .as_deref()
                .filter(|d| !d.is_empty())
                .map(PathBuf::from),
            netns: sandbox.netns.path(),
            hostname: spec::hostname(&self.pod),
            mounts: groups,
            log: log.clone(),
        };
        self.ctx
            .directory
            .add_log(&self.r.namespace, &self.r.name, &name, log.clone());
        match runner::launch(launch).await {
            Ok(running) => {
                let slot = &mut self.slots[idx];
                slot.machine
                    .started(now(), running.pid, &program.display().to_string());
                slot.generation += 1;
                let generation = slot.generation;
                let (exited_tx, exited_rx) = watch::channel(false);
                let exit_tx = self.exit_tx.clone();
                tokio::spawn(async move {
                    let status = running.exit_rx.await.unwrap_or_else(|_| {
                        std::os::unix::process::ExitStatusExt::from_raw(255 << 8)
                    });
                    let _ = exited_tx.send(true);
                    let _ = exit_tx.send(ExitEvent {
                        idx,
                        generation,
                        status,
                    });
                });
                slot.proc = Some(Proc {
                    pid: running.pid,
                    started: Instant::now(),
                    probes: Vec::new(),
                    exited: exited_rx,
                });
                tracing::debug!(pod = %self.r.name, container = %name, pid = running.pid, "container started");
                self.event(
                    Some(&name),
                    "Normal",
                    "Pulled",
                    format!("Container image \"{image}\" already present on machine"),
                );
                self.event(
                    Some(&name),
                    "Normal",
                    "Created",
                    format!("Created container {name}"),
                );
                self.event(
                    Some(&name),
                    "Normal",
                    "Started",
                    format!("Started container {name}"),
                );
                self.start_probes(idx, running.pid, &sandbox);
            }
            Err(e) => {
                let tail = crate::process::log_tail(&log, 2000);
                let setup_line = tail
                    .lines()
                    .rev()
                    .find(|l| {
                        l.starts_with("kvpn lab kubelet stand-in:")
                            && !l.contains("(optional, skipped)")
                    })
                    .map(str::to_owned);
                let msg = match setup_line {
                    Some(line) => format!("failed to create containerd task: {line}"),
                    None if e.kind() == std::io::ErrorKind::NotFound && program.is_relative() => {
                        format!(
                            "failed to create containerd task: failed to create shim task: OCI runtime create failed: runc create failed: unable to start container process: exec: \"{}\": executable file not found in $PATH: unknown",
                            program.display()
                        )
                    }
                    None if e.kind() == std::io::ErrorKind::NotFound => format!(
                        "failed to create containerd task: failed to create shim task: OCI runtime create failed: runc create failed: unable to start container process: exec: \"{0}\": stat {0}: no such file or directory: unknown",
                        program.display()
                    ),
                    None => format!("failed to create containerd task: {e}"),
                };
                let policy = self.policy;
                let slot = &mut self.slots[idx];
                if let Some((d, w)) = slot.machine.start_failed(now(), &msg, policy) {
                    slot.wake = Some((Instant::now() + d, w));
                }
                self.event(Some(&name), "Warning", "Failed", format!("Error: {msg}"));
            }
        }
    }

    fn start_probes(&mut self, idx: usize, pid: u32, sandbox: &Sandbox) {
        let slot = &mut self.slots[idx];
        let generation = slot.generation;
        let mut handles = Vec::new();
        slot.readiness = None;
        slot.liveness = None;
        for (kind, probe) in [
            (ProbeKind::Readiness, slot.spec.readiness_probe.clone()),
            (ProbeKind::Liveness, slot.spec.liveness_probe.clone()),
        ] {
            let Some(probe) = probe else { continue };
            let counter = ProbeCounter::new(
                kind == ProbeKind::Liveness,
                probe
                    .success_threshold
                    .and_then(|v| u32::try_from(v).ok())
                    .unwrap_or(1),
                probe
                    .failure_threshold
                    .and_then(|v| u32::try_from(v).ok())
                    .unwrap_or(3),
            );
            match kind {
                ProbeKind::Readiness => slot.readiness = Some(counter),
                ProbeKind::Liveness => slot.liveness = Some(counter),
            }
            let job = ProbeJob {
                action: probe_action(&probe, &slot.spec, sandbox.ip, pid),
                initial_delay: secs(probe.initial_delay_seconds, 0),
                period: secs(probe.period_seconds, 10),
                timeout: secs(probe.timeout_seconds, 1),
                node_netns: self.ctx.node.netns().name().to_owned(),
            };
            let tx = self.probe_tx.clone();
            handles.push(tokio::spawn(probe_loop(job, idx, generation, kind, tx)));
        }
        if slot.readiness.is_none() {
            slot.machine.set_ready(true);
        }
        if let Some(p) = slot.proc.as_mut() {
            p.probes = handles;
        }
    }

    fn on_probe(&mut self, p: ProbeEvent) {
        let slot = &mut self.slots[p.idx];
        if p.generation != slot.generation || slot.proc.is_none() {
            return;
        }
        let name = slot.spec.name.clone();
        match p.kind {
            ProbeKind::Readiness => {
                if let Some(c) = slot.readiness.as_mut()
                    && let Some(ready) = c.record(p.ok)
                {
                    slot.machine.set_ready(ready);
                    if !ready {
                        self.event(
                            Some(&name),
                            "Warning",
                            "Unhealthy",
                            format!("Readiness probe failed: {}", p.message),
                        );
                    }
                }
            }
            ProbeKind::Liveness => {
                if let Some(c) = slot.liveness.as_mut()
                    && c.record(p.ok) == Some(false)
                    && let Some(proc) = &slot.proc
                {
                    let (pid, exited) = (proc.pid, proc.exited.clone());
                    let grace = self.grace();
                    self.event(
                        Some(&name),
                        "Warning",
                        "Unhealthy",
                        format!("Liveness probe failed: {}", p.message),
                    );
                    self.event(
                        Some(&name),
                        "Normal",
                        "Killing",
                        format!("Container {name} failed liveness probe, will be restarted"),
                    );
                    tokio::spawn(kill_with_grace(pid, exited, grace));
                }
            }
        }
    }

    fn on_exit(&mut self, e: ExitEvent) {
        let policy = self.policy;
        let slot = &mut self.slots[e.idx];
        if e.generation != slot.generation {
            return;
        }
        let Some(proc) = slot.proc.take() else { return };
        for h in proc.probes {
            h.abort();
        }
        use std::os::unix::process::ExitStatusExt as _;
        let ran_for = proc.started.elapsed();
        let next = slot
            .machine
            .exited(now(), e.status.code(), e.status.signal(), ran_for, policy);
        let name = slot.spec.name.clone();
        tracing::debug!(pod = %self.r.name, container = %name, status = %e.status, ?next, "container exited");
        if let Some((d, w)) = next {
            slot.wake = Some((Instant::now() + d, w));
            if !d.is_zero() {
                self.event(
                    Some(&name),
                    "Warning",
                    "BackOff",
                    "Back-off restarting failed container".into(),
                );
            }
        }
    }

    /// The pod's termination grace period, capped by the configuration.
    fn grace(&self) -> Duration {
        let seconds = self
            .pod
            .metadata
            .deletion_grace_period_seconds
            .or_else(|| {
                self.pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.termination_grace_period_seconds)
            })
            .unwrap_or(DEFAULT_GRACE_SECONDS);
        Duration::from_secs(u64::try_from(seconds).unwrap_or(0)).min(self.ctx.config.max_grace)
    }

    async fn publish(&mut self) {
        let facts = PodFacts {
            host_ip: self.ctx.host_ip.to_string(),
            pod_ip: self.pod_ip().map(|ip| ip.to_string()),
            pod_ip_v6: self
                .sandbox
                .as_ref()
                .and_then(|s| s.ip_v6)
                .map(|ip| ip.to_string()),
            start_time: self.start_time,
            policy: self.policy,
        };
        let machines: Vec<ContainerMachine> =
            self.slots.iter().map(|s| s.machine.clone()).collect();
        update_conditions(&mut self.conds, &machines, now());
        let status = pod_status(&facts, &machines, &self.conds);
        if self.last_sent.as_ref() == Some(&status) {
            return;
        }
        let api: Api<Pod> = Api::namespaced(self.ctx.client.clone(), &self.r.namespace);
        let patch = Patch::Merge(json!({"status": status}));
        match api
            .patch_status(&self.r.name, &PatchParams::default(), &patch)
            .await
        {
            Ok(_) => {
                self.last_sent = Some(status);
                self.publish_retry = None;
            }
            Err(kube::Error::Api(s)) if s.code == 404 => self.last_sent = Some(status),
            Err(e) => {
                tracing::warn!(pod = %self.r.name, error = %e, "pod status update failed; retrying");
                self.publish_retry = Some(Instant::now() + Duration::from_secs(1));
            }
        }
    }

    async fn teardown(&mut self, stop: Stop) {
        let grace = match stop {
            Stop::Deleted => self.grace(),
            Stop::Gone => self.grace().min(Duration::from_secs(2)),
            Stop::Shutdown => self.grace().min(SHUTDOWN_GRACE),
        };
        for s in &mut self.slots {
            s.wake = None;
            if let Some(p) = &s.proc {
                for h in &p.probes {
                    h.abort();
                }
                if stop == Stop::Deleted {
                    post_event(
                        &self.ctx,
                        &self.r,
                        Some(&s.spec.name),
                        "Normal",
                        "Killing",
                        format!("Stopping container {}", s.spec.name),
                        "kubelet",
                    );
                }
                runner::signal_group(p.pid, Signal::SIGTERM);
            }
        }
        let deadline = Instant::now() + grace;
        self.wait_exits(deadline).await;
        for s in &self.slots {
            if let Some(p) = &s.proc {
                tracing::info!(pod = %self.r.name, container = %s.spec.name, pid = p.pid, "no exit after SIGTERM; SIGKILL");
                runner::signal_group(p.pid, Signal::SIGKILL);
            }
        }
        self.wait_exits(Instant::now() + Duration::from_secs(3))
            .await;
        if let Some(sandbox) = self.sandbox.take() {
            // Anything else left in the pod's netns was started by its containers.
            for pid in sandbox.netns.pids() {
                if let Ok(pid) = i32::try_from(pid) {
                    let _ =
                        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
                }
            }
            self.ctx
                .directory
                .remove(&self.r.namespace, &self.r.name, &self.r.uid);
            let ctx = self.ctx.clone();
            let ip = sandbox.ip;
            let removed = tokio::task::spawn_blocking(move || {
                // The killed processes may need a moment to leave the netns.
                for _ in 0..100 {
                    if sandbox.netns.pids().is_empty() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                ctx.node.remove_pod(&sandbox)
            })
            .await;
            match removed {
                Ok(Ok(())) => forget_sandbox(&self.ctx.dir, &self.role),
                Ok(Err(e)) => {
                    tracing::warn!(pod = %self.r.name, error = %e, "removing the pod netns failed")
                }
                Err(e) => {
                    tracing::warn!(pod = %self.r.name, error = %e, "removing the pod netns failed")
                }
            }
            self.release_ip(ip);
        }
        for sub in ["volumes", "stage"] {
            let _ = std::fs::remove_dir_all(self.pod_dir.join(sub));
        }
        if stop == Stop::Deleted {
            delete_now(&self.ctx, &self.pod).await;
        }
    }

    async fn wait_exits(&mut self, deadline: Instant) {
        while self.slots.iter().any(|s| s.proc.is_some()) {
            match tokio::time::timeout_at(deadline, self.exit_rx.recv()).await {
                Ok(Some(e)) => {
                    let slot = &mut self.slots[e.idx];
                    if e.generation == slot.generation {
                        slot.proc = None;
                    }
                }
                Ok(None) | Err(_) => return,
            }
        }
    }
}

/// SIGTERM to the group, SIGKILL if it has not exited after `grace`.
async fn kill_with_grace(pid: u32, mut exited: watch::Receiver<bool>, grace: Duration) {
    if *exited.borrow() {
        return;
    }
    runner::signal_group(pid, Signal::SIGTERM);
    if tokio::time::timeout(grace, super::wait_true(&mut exited))
        .await
        .is_err()
    {
        runner::signal_group(pid, Signal::SIGKILL);
    }
}

fn secs(v: Option<i32>, default: u64) -> Duration {
    Duration::from_secs(v.and_then(|v| u64::try_from(v).ok()).unwrap_or(default))
}

/// What a probe does.
#[derive(Debug, Clone)]
enum ProbeAction {
    Tcp(SocketAddr),
    Http {
        addr: SocketAddr,
        host: String,
        path: String,
        headers: Vec<(String, String)>,
    },
    Exec {
        pid: u32,
        command: Vec<String>,
    },
    Invalid(String),
}

struct ProbeJob {
    action: ProbeAction,
    initial_delay: Duration,
    period: Duration,
    timeout: Duration,
    node_netns: String,
}

fn probe_action(probe: &Probe, c: &Container, pod_ip: Ipv4Addr, pid: u32) -> ProbeAction {
    let host_ip =
        |h: Option<&String>| -> Ipv4Addr { h.and_then(|h| h.parse().ok()).unwrap_or(pod_ip) };
    if let Some(t) = &probe.tcp_socket {
        return match spec::resolve_port(&t.port, c) {
            Some(p) => ProbeAction::Tcp(SocketAddr::from((host_ip(t.host.as_ref()), p))),
            None => ProbeAction::Invalid(format!("unknown port {:?}", t.port)),
        };
    }
    if let Some(h) = &probe.http_get {
        let Some(port) = spec::resolve_port(&h.port, c) else {
            return ProbeAction::Invalid(format!("unknown port {:?}", h.port));
        };
        let ip = host_ip(h.host.as_ref());
        if h.scheme.as_deref() == Some("HTTPS") {
            // The stand-in does not speak TLS to pods; a TCP connect stands in.
            return ProbeAction::Tcp(SocketAddr::from((ip, port)));
        }
        let path = h.path.clone().unwrap_or_else(|| "/".to_owned());
        return ProbeAction::Http {
            addr: SocketAddr::from((ip, port)),
            host: format!("{ip}:{port}"),
            path: if path.starts_with('/') {
                path
            } else {
                format!("/{path}")
            },
            headers: h
                .http_headers
                .iter()
                .flatten()
                .map(|x| (x.name.clone(), x.value.clone()))
                .collect(),
        };
    }
    if let Some(e) = &probe.exec {
        return ProbeAction::Exec {
            pid,
            command: e.command.clone().unwrap_or_default(),
        };
    }
    ProbeAction::Invalid("probe has no handler".into())
}

async fn probe_loop(
    job: ProbeJob,
    idx: usize,
    generation: u64,
    kind: ProbeKind,
    tx: mpsc::UnboundedSender<ProbeEvent>,
) {
    tokio::time::sleep(job.initial_delay).await;
    loop {
        let (ok, message) = match tokio::time::timeout(job.timeout, run_probe(&job)).await {
            Ok(r) => r,
            Err(_) => (false, format!("timeout after {}s", job.timeout.as_secs())),
        };
        if tx
            .send(ProbeEvent {
                idx,
                generation,
                kind,
                ok,
                message,
            })
            .is_err()
        {
            return;
        }
        tokio::time::sleep(job.period).await;
    }
}

async fn run_probe(job: &ProbeJob) -> (bool, String) {
    match &job.action {
        ProbeAction::Tcp(addr) => {
            match super::portforward::connect_in_netns(&job.node_netns, *addr).await {
                Ok(_) => (true, String::new()),
                Err(e) => (false, format!("dial tcp {addr}: connect: {e}")),
            }
        }
        ProbeAction::Http {
            addr,
            host,
            path,
            headers,
        } => {
            let mut s = match super::portforward::connect_in_netns(&job.node_netns, *addr).await {
                Ok(s) => s,
                Err(e) => {
                    return (
                        false,
                        format!("Get \"http://{host}{path}\": dial tcp {addr}: connect: {e}"),
                    );
                }
            };
            let mut req = format!(
                "GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: kube-probe/1.20\r\nAccept: */*\r\nConnection: close\r\n"
            );
            for (k, v) in headers {
                req.push_str(&format!("{k}: {v}\r\n"));
            }
            req.push_str("\r\n");
            if let Err(e) = s.write_all(req.as_bytes()).await {
                return (false, e.to_string());
            }
            let mut buf = Vec::new();
            let mut chunk = [0u8; 1024];
            while !buf.windows(2).any(|w| w == b"\r\n") && buf.len() < 4096 {
                match s.read(&mut chunk).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
            let line = String::from_utf8_lossy(&buf);
            let code = line
                .split_whitespace()
                .nth(1)
                .and_then(|c| c.parse::<u16>().ok());
            match code {
                Some(c) if (200..400).contains(&c) => (true, String::new()),
                Some(c) => (false, format!("HTTP probe failed with statuscode: {c}")),
                None => (false, "malformed HTTP response".into()),
            }
        }
        ProbeAction::Exec { pid, command } => {
            let mut cmd = tokio::process::Command::new("nsenter");
            cmd.arg("-t")
                .arg(pid.to_string())
                .args(["-n", "-m", "-u", "--"])
                .args(command)
                .stdin(std::process::Stdio::null())
                .kill_on_drop(true);
            match cmd.output().await {
                Ok(o) if o.status.success() => (true, String::new()),
                Ok(o) => (
                    false,
                    format!(
                        "command {command:?} exited with {}: {}",
                        o.status,
                        String::from_utf8_lossy(&o.stdout).trim()
                    ),
                ),
                Err(e) => (false, format!("cannot run nsenter: {e}")),
            }
        }
        ProbeAction::Invalid(why) => (false, why.clone()),
    }
}

/// Folder of sandbox records: one file per pod netns the stand-in created (name = netns
/// role, content = pod IP), removed with the netns. A stand-in that was killed leaves
/// its records, and the next start removes those netns before handing out IPs.
const SANDBOXES: &str = "sandboxes";

fn record_sandbox(root: &Path, sandbox: &Sandbox) {
    let dir = root.join(SANDBOXES);
    let r = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join(&sandbox.name), sandbox.ip.to_string()));
    if let Err(e) = r {
        tracing::warn!(netns = sandbox.netns.name(), error = %e, "cannot record the sandbox");
    }
}

fn forget_sandbox(root: &Path, role: &str) {
    let _ = std::fs::remove_file(root.join(SANDBOXES).join(role));
}

/// Removes the netns recorded by an earlier run of the stand-in in `root` (blocking:
/// `ip` commands). Processes still inside are killed first; they were started by that
/// run's pods.
pub(crate) fn remove_stale_sandboxes(root: &Path, node: &crate::Node) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(root.join(SANDBOXES)) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let role = e.file_name().to_string_lossy().into_owned();
        let ip = std::fs::read_to_string(e.path())
            .ok()
            .and_then(|s| s.trim().parse::<Ipv4Addr>().ok());
        let Some(ip) = ip else {
            let _ = std::fs::remove_file(e.path());
            continue;
        };
        let sandbox = node.adopt_pod(&role, ip);
        for pid in sandbox.netns.pids() {
            if let Ok(pid) = i32::try_from(pid) {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
        match node.remove_pod(&sandbox) {
            Ok(()) => {
                let _ = std::fs::remove_file(e.path());
                removed.push(sandbox.netns.name().to_owned());
            }
            Err(err) => {
                tracing::warn!(netns = sandbox.netns.name(), error = %err, "cannot remove a stale pod netns")
            }
        }
    }
    removed
}

/// The folder of a pod's files under the stand-in's folder.
pub(crate) fn pod_dir(root: &Path, namespace: &str, name: &str, uid: &str) -> PathBuf {
    root.join("pods").join(format!("{namespace}_{name}_{uid}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ips_round_robin_skip_used_and_gateway() {
        let cidr: Ipv4Net = "10.244.1.0/29".parse().expect("cidr");
        let gw = Ipv4Addr::new(10, 244, 1, 1);
        let mut a = IpAllocator::new(cidr, gw);
        a.reserve(Ipv4Addr::new(10, 244, 1, 3));
        let got: Vec<_> = (0..4).map(|_| a.allocate().expect("free")).collect();
        assert_eq!(
            got,
            ["10.244.1.2", "10.244.1.4", "10.244.1.5", "10.244.1.6"]
                .map(|s| s.parse::<Ipv4Addr>().expect("ip"))
        );
        assert_eq!(a.allocate(), None, "range full");
        a.release(Ipv4Addr::new(10, 244, 1, 4));
        assert_eq!(a.allocate(), Some(Ipv4Addr::new(10, 244, 1, 4)));
        a.release(Ipv4Addr::new(10, 244, 1, 2));
        a.release(Ipv4Addr::new(10, 244, 1, 6));
        // Next after the last handed out (.4), not the lowest free.
        assert_eq!(a.allocate(), Some(Ipv4Addr::new(10, 244, 1, 6)));
        assert_eq!(
            pod_dir(Path::new("/k"), "ns", "p", "u"),
            PathBuf::from("/k/pods/ns_p_u")
        );
    }
}
