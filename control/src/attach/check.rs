//! `kvpn attach check leak|sessions`: the seed's two checks of an attached
//! workload (issue #25, docs/tunnel-ownership.md), run from the laptop.
//!
//! The leak check listens on the laptop with one UDP socket on all addresses
//! (with `IP_PKTINFO`, so each datagram's arrival interface is known: the
//! tunnel's TUN device, or anything else — "outside the tunnel").
//!
//! - **leak**: a new pod of the workload (its pod template as attached, the app
//!   containers replaced by `kvpn-manager probe-send` from the manager's image,
//!   not matched by the workload's selector) sends numbered datagrams to the
//!   laptop's tunnel IP from its first moment, every 10 ms for 3 s. The report:
//!   datagrams that arrived outside the tunnel, the first that came through
//!   (its number and its time after the app started), how many were lost
//!   before it. The pod is deleted afterwards, also on failure.
//! - **sessions**: scale the workload to 5 replicas, have each connect to a
//!   TCP listener on the laptop's tunnel IP and name itself (`sh -c '… | nc'`
//!   in its app container: the app image needs `sh` and `nc`), and count what
//!   the laptop side sees: leases (per-workload sessions) and distinct source
//!   addresses; then scale back.
//!
//! I/O: the Kubernetes API, one UDP socket, the machine's interface list.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{
    AttachParams, DeleteParams, ListParams, LogParams, Patch, PatchParams, PostParams,
};
use serde_json::{Value, json};

use super::render::{self, Via, WorkloadKind, WorkloadRef};
use crate::install::objects::MANAGER;

/// Replicas of the sessions check (the seed's "scale to five").
pub const SESSIONS_REPLICAS: i32 = 5;
/// The leak probe's datagrams and their spacing.
const PROBE_COUNT: u32 = 300;
const PROBE_INTERVAL_MS: u64 = 10;
/// The probe pod's container.
const PROBE_CONTAINER: &str = "kvpn-probe";

/// The laptop's end of the tunnel: its tunnel IP and the TUN device carrying it.
#[derive(Debug, Clone)]
pub struct LaptopEnd {
    pub ip: Ipv4Addr,
    pub ifindex: u32,
    pub device: String,
}

/// The address of this machine inside `pool` and its interface.
pub fn laptop_end(pool: ipnet::Ipv4Net) -> Result<LaptopEnd> {
    let addrs = nix::ifaddrs::getifaddrs().context("cannot list this machine's addresses")?;
    for a in addrs {
        let Some(ip) = a
            .address
            .as_ref()
            .and_then(|s| s.as_sockaddr_in())
            .map(|s| s.ip())
        else {
            continue;
        };
        if pool.contains(&ip) {
            let ifindex = nix::net::if_::if_nametoindex(a.interface_name.as_str())
                .with_context(|| format!("cannot read the index of {}", a.interface_name))?;
            return Ok(LaptopEnd {
                ip,
                ifindex,
                device: a.interface_name,
            });
        }
    }
    bail!(
        "no address in the tunnel pool {pool} on this machine: the check needs this laptop's tunnel — run `kvpn connect` first"
    )
}

/// One datagram the listener got.
#[derive(Debug, Clone)]
struct Arrival {
    from: SocketAddr,
    ifindex: u32,
    payload: String,
}

/// A UDP listener on all addresses that records each datagram's interface.
struct Listener {
    port: u16,
    stop: Arc<AtomicBool>,
    got: Arc<Mutex<Vec<Arrival>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Listener {
    fn start() -> Result<Self> {
        let socket = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
            .context("cannot open the check's UDP socket on this laptop")?;
        nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::Ipv4PacketInfo, &true)
            .context("cannot ask for IP_PKTINFO on the check's socket")?;
        socket
            .set_read_timeout(Some(Duration::from_millis(100)))
            .context("cannot set the check socket's timeout")?;
        let port = socket.local_addr()?.port();
        let stop = Arc::new(AtomicBool::new(false));
        let got = Arc::new(Mutex::new(Vec::new()));
        let (s, g) = (stop.clone(), got.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                if let Some(a) = recv_one(&socket)
                    && let Ok(mut v) = g.lock()
                {
                    v.push(a);
                }
            }
        });
        Ok(Self {
            port,
            stop,
            got,
            thread: Some(thread),
        })
    }

    fn arrivals(&self) -> Vec<Arrival> {
        self.got.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn recv_one(socket: &std::net::UdpSocket) -> Option<Arrival> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, SockaddrIn, recvmsg};
    let mut buf = [0u8; 1500];
    let mut cmsg = nix::cmsg_space!(libc::in_pktinfo);
    let (n, from, ifindex) = {
        let mut iov = [std::io::IoSliceMut::new(&mut buf)];
        let msg = recvmsg::<SockaddrIn>(
            socket.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::empty(),
        )
        .ok()?;
        let mut ifindex = 0;
        if let Ok(cmsgs) = msg.cmsgs() {
            for c in cmsgs {
                if let ControlMessageOwned::Ipv4PacketInfo(pi) = c {
                    ifindex = u32::try_from(pi.ipi_ifindex).unwrap_or(0);
                }
            }
        }
        let from = msg
            .address
            .map(|a| SocketAddr::new(IpAddr::V4(a.ip()), a.port()))?;
        (msg.bytes, from, ifindex)
    };
    Some(Arrival {
        from,
        ifindex,
        payload: String::from_utf8_lossy(buf.get(..n).unwrap_or_default()).into_owned(),
    })
}

/// A TCP listener on the laptop's tunnel IP for the sessions check: each
/// connection's peer address and first line.
struct LineListener {
    port: u16,
    stop: Arc<AtomicBool>,
    got: Arc<Mutex<Vec<(SocketAddr, String)>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LineListener {
    fn start(ip: Ipv4Addr) -> Result<Self> {
        let listener = std::net::TcpListener::bind((ip, 0))
            .with_context(|| format!("cannot listen on the laptop's tunnel IP {ip}"))?;
        listener
            .set_nonblocking(true)
            .context("cannot make the check's listener non-blocking")?;
        let port = listener.local_addr()?.port();
        let stop = Arc::new(AtomicBool::new(false));
        let got = Arc::new(Mutex::new(Vec::new()));
        let (s, g) = (stop.clone(), got.clone());
        let thread = std::thread::spawn(move || {
            use std::io::BufRead as _;
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, from)) => {
                        let _ = conn.set_nonblocking(false);
                        let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
                        let mut line = String::new();
                        let _ = std::io::BufReader::new(conn).read_line(&mut line);
                        if let Ok(mut v) = g.lock() {
                            v.push((from, line.trim().to_owned()));
                        }
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        Ok(Self {
            port,
            stop,
            got,
            thread: Some(thread),
        })
    }

    fn lines(&self) -> Vec<(SocketAddr, String)> {
        self.got.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

impl Drop for LineListener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What the check reads of the manager: its image and tunnel pool.
struct ManagerInfo {
    image: String,
    pull_policy: Option<String>,
    pool: ipnet::Ipv4Net,
}

async fn manager_info(client: &kube::Client, manager_namespace: &str) -> Result<ManagerInfo> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), manager_namespace);
    let d = deployments
        .get_opt(MANAGER)
        .await
        .with_context(|| format!("cannot read Deployment {manager_namespace}/{MANAGER}"))?;
    let c = d
        .and_then(|d| d.spec)
        .and_then(|s| s.template.spec)
        .and_then(|s| s.containers.into_iter().next())
        .with_context(|| {
            format!(
                "no traffic manager in namespace {manager_namespace} — run `kvpn connect` first"
            )
        })?;
    let args = c.args.clone().unwrap_or_default();
    let pool = args
        .iter()
        .position(|a| a == "--tunnel-pool")
        .and_then(|i| args.get(i + 1))
        .map_or("100.96.0.0/16", String::as_str)
        .parse()
        .context("the manager's --tunnel-pool is not an IPv4 prefix")?;
    Ok(ManagerInfo {
        image: c
            .image
            .with_context(|| format!("Deployment {manager_namespace}/{MANAGER} names no image"))?,
        pull_policy: c.image_pull_policy,
        pool,
    })
}

/// The workload's object (JSON) and how it is attached; an error naming the
/// fix when it is not.
async fn attached_workload(
    client: &kube::Client,
    w: &WorkloadRef,
    namespace: &str,
) -> Result<(Value, Via)> {
    let api = super::workload_api(client, w.kind, namespace);
    let tpl = super::template(&api, w, namespace).await?;
    let Some(via) = render::attached_via(&tpl) else {
        bail!(
            "{w} in namespace {namespace} is not attached: its pod template has neither {} nor {} — run `kvpn attach {w} -n {namespace}` (or with --via gateway) first",
            render::CONTAINER,
            render::GATEWAY_CONTAINER
        );
    };
    Ok((tpl, via))
}

/// `kvpn attach check leak`'s result.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LeakReport {
    pub workload: String,
    pub namespace: String,
    pub via: Via,
    pub pod: String,
    pub laptop_ip: Ipv4Addr,
    pub laptop_device: String,
    /// Datagrams the probe sent (from its first moment, every 10 ms).
    pub sent: u32,
    /// Datagrams that arrived through the tunnel's device.
    pub through_tunnel: usize,
    /// Datagrams that arrived on any other interface.
    pub outside_tunnel: usize,
    /// The number of the first datagram that came through (0: the very first).
    pub first_through_seq: Option<u32>,
    /// When the probe sent it, ms after the app container started.
    pub first_through_after_ms: Option<f64>,
    /// Datagrams sent before it, none of which arrived.
    pub lost_before_first: Option<u32>,
    /// The sources the laptop saw.
    pub sources: BTreeSet<IpAddr>,
    /// The probe's own line (datagrams the pod's kernel refused, e.g. no route).
    pub probe_log: String,
}

/// The probe pod: the workload's pod template as attached, app containers
/// replaced by the probe, not matched by the workload's selector.
pub fn probe_pod(
    template: &Value,
    w: &WorkloadRef,
    namespace: &str,
    image: &str,
    pull_policy: Option<&str>,
    to: SocketAddr,
) -> Value {
    let mut spec = template["spec"].clone();
    let keep: Vec<Value> = spec["containers"]
        .as_array()
        .map(|l| {
            l.iter()
                .filter(|c| c["name"] == render::CONTAINER)
                .cloned()
                .collect()
        })
        .unwrap_or_default();
    let mut probe = json!({
        "name": PROBE_CONTAINER,
        "image": image,
        "args": [
            "probe-send",
            "--to", to.to_string(),
            "--count", PROBE_COUNT.to_string(),
            "--interval-ms", PROBE_INTERVAL_MS.to_string(),
        ],
        "securityContext": {
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "capabilities": {"drop": ["ALL"]},
        },
    });
    if let Some(p) = pull_policy {
        probe["imagePullPolicy"] = json!(p);
    }
    let mut containers = keep;
    containers.push(probe);
    spec["containers"] = Value::Array(containers);
    spec["restartPolicy"] = json!("Never");
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": format!("kvpn-check-{}-", w.name),
            "namespace": namespace,
            "labels": {
                "app.kubernetes.io/managed-by": "kvpn",
                "kvpn.dev/check": "leak",
            },
        },
        "spec": spec,
    })
}

/// Parse "kvpn-probe SEQ MICROS".
fn probe_fields(payload: &str) -> Option<(u32, u64)> {
    let mut it = payload.trim().split(' ');
    if it.next()? != "kvpn-probe" {
        return None;
    }
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

/// Summarise the arrivals of a leak probe.
fn leak_summary(
    arrivals: &[Arrival],
    tun_ifindex: u32,
) -> (usize, usize, Option<(u32, u64)>, BTreeSet<IpAddr>) {
    let mut through = 0;
    let mut outside = 0;
    let mut first: Option<(u32, u64)> = None;
    let mut sources = BTreeSet::new();
    for a in arrivals {
        let Some((seq, us)) = probe_fields(&a.payload) else {
            continue;
        };
        sources.insert(a.from.ip());
        if a.ifindex == tun_ifindex {
            through += 1;
            if first.is_none_or(|(s, _)| seq < s) {
                first = Some((seq, us));
            }
        } else {
            outside += 1;
        }
    }
    (through, outside, first, sources)
}

/// `kvpn attach check leak`.
pub async fn leak(
    client: &kube::Client,
    w: &WorkloadRef,
    namespace: &str,
    manager_namespace: &str,
) -> Result<LeakReport> {
    let (tpl, via) = attached_workload(client, w, namespace).await?;
    let m = manager_info(client, manager_namespace).await?;
    let laptop = laptop_end(m.pool)?;
    let listener = Listener::start()?;
    let to = SocketAddr::new(IpAddr::V4(laptop.ip), listener.port);
    let body = probe_pod(&tpl, w, namespace, &m.image, m.pull_policy.as_deref(), to);
    let pod: Pod = serde_json::from_value(body).context("the probe pod does not parse")?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let created = pods
        .create(&PostParams::default(), &pod)
        .await
        .with_context(|| format!("cannot create the probe pod for {w} in namespace {namespace}"))?;
    let name = created.metadata.name.clone().unwrap_or_default();
    let result = async {
        let t0 = Instant::now();
        loop {
            let p = pods
                .get(&name)
                .await
                .with_context(|| format!("cannot read the probe pod {namespace}/{name}"))?;
            let done = p
                .status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .and_then(|l| l.iter().find(|c| c.name == PROBE_CONTAINER))
                .and_then(|c| c.state.as_ref())
                .is_some_and(|s| s.terminated.is_some());
            if done {
                break;
            }
            if t0.elapsed() > Duration::from_secs(180) {
                bail!(
                    "the probe pod {namespace}/{name} did not finish within 180 s: see `kubectl describe pod {name} -n {namespace}`"
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        // Stragglers still in flight.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let log = pods
            .logs(
                &name,
                &LogParams {
                    container: Some(PROBE_CONTAINER.into()),
                    ..LogParams::default()
                },
            )
            .await
            .unwrap_or_default();
        Ok(log.trim().to_owned())
    }
    .await;
    let _ = pods.delete(&name, &DeleteParams::default()).await;
    let probe_log = result?;
    let arrivals = listener.arrivals();
    drop(listener);
    let (through, outside, first, sources) = leak_summary(&arrivals, laptop.ifindex);
    Ok(LeakReport {
        workload: w.to_string(),
        namespace: namespace.to_owned(),
        via,
        pod: name,
        laptop_ip: laptop.ip,
        laptop_device: laptop.device,
        sent: PROBE_COUNT,
        through_tunnel: through,
        outside_tunnel: outside,
        first_through_seq: first.map(|f| f.0),
        first_through_after_ms: first.map(|f| f.1 as f64 / 1000.0),
        lost_before_first: first.map(|f| f.0),
        sources,
        probe_log,
    })
}

/// One replica in the sessions check.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SessionRow {
    pub pod: String,
    /// Its own lease (per-workload tunnels), from the manager's leases.
    pub tunnel_ip: Option<String>,
    /// The source the laptop saw for its datagram.
    pub source_seen: Option<IpAddr>,
}

/// `kvpn attach check sessions`'s result.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SessionsReport {
    pub workload: String,
    pub namespace: String,
    pub via: Via,
    pub replicas: usize,
    /// Replicas with their own lease (session) at the manager.
    pub sessions: usize,
    /// Distinct tunnel IPs among them.
    pub distinct_tunnel_ips: usize,
    /// Distinct sources the laptop saw.
    pub distinct_sources: usize,
    pub rows: Vec<SessionRow>,
    /// The replica count it was scaled back to.
    pub scaled_back_to: i32,
}

fn selector(tpl_owner: &Value) -> Result<String> {
    let labels = tpl_owner["spec"]["selector"]["matchLabels"]
        .as_object()
        .context("the workload's selector has no matchLabels")?;
    Ok(labels
        .iter()
        .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
        .collect::<Vec<_>>()
        .join(","))
}

/// `kvpn attach check sessions`.
pub async fn sessions(
    client: &kube::Client,
    w: &WorkloadRef,
    namespace: &str,
    manager_namespace: &str,
) -> Result<SessionsReport> {
    if w.kind == WorkloadKind::DaemonSet {
        bail!(
            "{w} in namespace {namespace} is a daemonset: it has one pod per node and cannot be scaled — run the sessions check on a deployment or statefulset"
        );
    }
    let (tpl, via) = attached_workload(client, w, namespace).await?;
    let m = manager_info(client, manager_namespace).await?;
    let laptop = laptop_end(m.pool)?;
    let api = super::workload_api(client, w.kind, namespace);
    let obj = api
        .get(&w.name)
        .await
        .with_context(|| format!("cannot read {w} in namespace {namespace}"))?;
    let original = obj.data["spec"]["replicas"].as_i64().unwrap_or(1) as i32;
    let sel = selector(&obj.data)?;
    let scale = |n: i32| {
        let api = api.clone();
        let name = w.name.clone();
        async move {
            api.patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"replicas": n}})),
            )
            .await
        }
    };
    let listener = LineListener::start(laptop.ip)?;
    scale(SESSIONS_REPLICAS).await.with_context(|| {
        format!("cannot scale {w} in namespace {namespace} to {SESSIONS_REPLICAS}")
    })?;
    let result = sessions_scaled(
        client,
        &tpl,
        via,
        namespace,
        manager_namespace,
        &sel,
        &laptop,
        &listener,
    )
    .await;
    let back = scale(original).await;
    drop(listener);
    let rows = result?;
    back.with_context(|| {
        format!("cannot scale {w} in namespace {namespace} back to {original} — run `kubectl scale {} {} -n {namespace} --replicas {original}`", w.kind.word(), w.name)
    })?;
    let leased: Vec<&String> = rows.iter().filter_map(|r| r.tunnel_ip.as_ref()).collect();
    let distinct_ips: BTreeSet<&String> = leased.iter().copied().collect();
    let sources: BTreeSet<IpAddr> = rows.iter().filter_map(|r| r.source_seen).collect();
    Ok(SessionsReport {
        workload: w.to_string(),
        namespace: namespace.to_owned(),
        via,
        replicas: rows.len(),
        sessions: leased.len(),
        distinct_tunnel_ips: distinct_ips.len(),
        distinct_sources: sources.len(),
        rows,
        scaled_back_to: original,
    })
}

#[allow(
    clippy::too_many_arguments,
    reason = "the sessions check's state, passed once"
)]
async fn sessions_scaled(
    client: &kube::Client,
    tpl: &Value,
    via: Via,
    namespace: &str,
    manager_namespace: &str,
    sel: &str,
    laptop: &LaptopEnd,
    listener: &LineListener,
) -> Result<Vec<SessionRow>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let attached = |p: &Pod| -> bool {
        p.spec.as_ref().is_some_and(|s| match via {
            Via::Sidecar => {
                s.containers.iter().any(|c| c.name == render::CONTAINER)
                    || s.init_containers
                        .as_ref()
                        .is_some_and(|l| l.iter().any(|c| c.name == render::CONTAINER))
            }
            Via::Gateway => s
                .init_containers
                .as_ref()
                .is_some_and(|l| l.iter().any(|c| c.name == render::GATEWAY_CONTAINER)),
        })
    };
    let ready = |p: &Pod| -> bool {
        p.metadata.deletion_timestamp.is_none()
            && p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
    };
    let t0 = Instant::now();
    let up: Vec<Pod> = loop {
        let list = pods
            .list(&ListParams::default().labels(sel))
            .await
            .with_context(|| format!("cannot list the pods {sel} in namespace {namespace}"))?;
        let live: Vec<Pod> = list
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect();
        if live.len() == SESSIONS_REPLICAS as usize && live.iter().all(|p| attached(p) && ready(p))
        {
            break live;
        }
        if t0.elapsed() > Duration::from_secs(180) {
            bail!(
                "not {SESSIONS_REPLICAS} ready attached replicas ({sel}) in namespace {namespace} within 180 s: see `kubectl get pods -l {sel} -n {namespace}`"
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let app = tpl["spec"]["containers"]
        .as_array()
        .and_then(|l| l.iter().find(|c| c["name"] != render::CONTAINER))
        .and_then(|c| c["name"].as_str())
        .context("the pod template has no app container")?
        .to_owned();
    // Each replica connects once and names itself (up to three tries).
    for p in &up {
        let name = p.metadata.name.clone().unwrap_or_default();
        let script = format!(
            "for i in 1 2 3; do echo kvpn-sessions-{name} | nc -w 3 {} {} && break; sleep 1; done",
            laptop.ip, listener.port
        );
        let proc = pods
            .exec(&name, ["sh", "-c", script.as_str()], &AttachParams::default().container(app.clone()).stderr(false))
            .await
            .with_context(|| {
                format!("cannot run `sh -c … nc` in container {app} of {namespace}/{name}: the sessions check needs sh and nc in the app image")
            })?;
        let _ = proc.join().await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut seen: BTreeMap<String, IpAddr> = BTreeMap::new();
    for (from, line) in listener.lines() {
        if let Some(pod) = line.strip_prefix("kvpn-sessions-") {
            seen.entry(pod.to_owned()).or_insert(from.ip());
        }
    }
    let leases: BTreeMap<String, Option<String>> =
        super::replicas(client, namespace, manager_namespace)
            .await?
            .into_iter()
            .map(|r| (r.pod, r.tunnel_ip))
            .collect();
    Ok(up
        .iter()
        .map(|p| {
            let pod = p.metadata.name.clone().unwrap_or_default();
            SessionRow {
                tunnel_ip: leases.get(&pod).cloned().flatten(),
                source_seen: seen.get(&pod).copied(),
                pod,
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arrival(from: &str, ifindex: u32, payload: &str) -> Arrival {
        Arrival {
            from: from.parse().expect("addr"),
            ifindex,
            payload: payload.into(),
        }
    }

    #[test]
    fn leak_summary_counts_outside_and_finds_the_first_through() {
        let a = [
            arrival("100.96.0.1:4000", 7, "kvpn-probe 3 30500"),
            arrival("100.96.0.1:4000", 7, "kvpn-probe 4 40600"),
            arrival("10.0.0.9:4000", 2, "kvpn-probe 1 10100"),
            arrival("100.96.0.1:4000", 7, "noise"),
        ];
        let (through, outside, first, sources) = leak_summary(&a, 7);
        assert_eq!((through, outside), (2, 1));
        assert_eq!(first, Some((3, 30500)));
        assert_eq!(sources.len(), 2);
    }

    /// The probe pod keeps the attached template's init containers and tunnel
    /// container, replaces the app, never restarts, and is not the workload's.
    #[test]
    fn probe_pod_keeps_the_attachment_and_replaces_the_app() {
        let w = render::parse_workload("deploy/web").expect("parse");
        let tpl = json!({
            "metadata": {"labels": {"app": "web"}},
            "spec": {
                "initContainers": [{"name": render::GATEWAY_CONTAINER}],
                "containers": [{"name": render::CONTAINER}, {"name": "app", "image": "shop/web"}],
            },
        });
        let to: SocketAddr = "100.96.0.9:5555".parse().expect("addr");
        let p = probe_pod(&tpl, &w, "shop", "localhost/kvpn/manager:0.1.0", None, to);
        let spec = &p["spec"];
        assert_eq!(spec["initContainers"][0]["name"], render::GATEWAY_CONTAINER);
        assert_eq!(spec["containers"][0]["name"], render::CONTAINER);
        assert_eq!(spec["containers"][1]["name"], PROBE_CONTAINER);
        assert_eq!(spec["containers"][1]["args"][2], "100.96.0.9:5555");
        assert_eq!(spec["containers"].as_array().map(Vec::len), Some(2));
        assert_eq!(spec["restartPolicy"], "Never");
        assert!(
            p["metadata"]["labels"].get("app").is_none(),
            "not matched by the selector"
        );
        assert_eq!(p["metadata"]["generateName"], "kvpn-check-web-");
    }

    #[test]
    fn probe_fields_parse() {
        assert_eq!(probe_fields("kvpn-probe 12 3456\n"), Some((12, 3456)));
        assert_eq!(probe_fields("kvpn-sessions-x"), None);
    }
}
