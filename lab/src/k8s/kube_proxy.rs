//! The lab's kube-proxy stand-in (lab-only code): watches Services and Endpoints and
//! keeps one nftables table in the node netns with a DNAT rule for every ClusterIP:port
//! (TCP and UDP), balanced over the ready endpoints, plus NodePorts.
//!
//! - [`plan`] is the pure core: a [`Snapshot`] of Services/Endpoints and a
//!   [`KubeProxyConfig`] in, the [`ServiceRule`]s out. Like kube-proxy: a service
//!   port's backends are the ready addresses of each Endpoints subset that has a port
//!   with the service port's name and protocol, at that port's number (this is how a
//!   named `targetPort` resolves); a ClusterIP without ready endpoints is rejected (TCP
//!   reset, ICMP port unreachable); headless and ExternalName services get no rules;
//!   SCTP ports are skipped. IPv6 ClusterIPs (dual-stack labs) get rules in a
//!   `table ip6` of the same name when [`KubeProxyConfig::ipv6_pods`] is set:
//!   1.20's Endpoints hold only a Service's first family (IPv4), so an IPv6
//!   ClusterIP's backends are the same ready pods' IPv6 addresses, taken from the
//!   lab's address plan (pod IPv6 = its IPv4 address's offset in the node's IPv6
//!   range); without it IPv6 ClusterIPs are skipped.
//! - [`KubeProxy`] is the shell: its own thread with a current-thread tokio runtime,
//!   a [`ServiceWatch`], and on every change (debounced by
//!   [`KubeProxyConfig::debounce`], 100 ms by default) a re-render that is loaded with
//!   [`nft::apply`] (one transaction, established flows keep their conntrack entries)
//!   when it differs from what is loaded. Stopping it removes its table.
//!
//! NodePorts, the hook for the manager pass-through: Services of type NodePort get
//! `node_ip:nodePort` rules when [`KubeProxyConfig::node_ip`] is set (the lab node's
//! uplink address 172.31.255.1, the laptop's only way in), and
//! [`KubeProxyConfig::static_node_ports`] carries fixed forwards such as the static lab's
//! `172.31.255.1:10801 → manager pod` ([`crate::lab::lab_node_ports`]). With
//! `table = kvpn_lab` and the static forwards, this proxy can take over the static
//! lab's table; by default it owns its own table `kvpn_proxy` beside it.
//!
//! I/O: the Kubernetes API (watch), `nft` inside the node netns.

pub mod services;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::LabError;
use crate::netns::Netns;
use crate::nft::{self, NodePort, RuleKind, ServiceRule};
use services::ServiceKind;
pub use services::{ServiceWatch, Snapshot};

/// Default nftables table of the proxy in the node netns.
pub const DEFAULT_TABLE: &str = "kvpn_proxy";

/// How long to wait after a change before re-rendering, so a Service and its Endpoints
/// created back to back become one `nft` run (~10 ms each here).
pub const DEFAULT_DEBOUNCE: Duration = Duration::from_millis(100);

/// Errors of the kube-proxy stand-in.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kube-proxy stand-in: {0}")]
    Client(#[from] super::Error),
    #[error("kube-proxy stand-in: loading nftables rules into {netns}: {source}")]
    Nft {
        netns: String,
        #[source]
        source: LabError,
    },
    #[error(
        "kube-proxy stand-in: Services/Endpoints not listed within {after:?} — is the apiserver up?"
    )]
    NotSynced { after: Duration },
    #[error("kube-proxy stand-in: cannot start its thread: {0}")]
    Thread(std::io::Error),
    #[error("kube-proxy stand-in: its thread stopped: {0}")]
    Stopped(String),
}

/// How the proxy runs.
#[derive(Debug, Clone)]
pub struct KubeProxyConfig {
    /// Kubeconfig with read access to Services and Endpoints in all namespaces.
    pub kubeconfig: PathBuf,
    /// The node netns that holds the rules.
    pub node_netns: Netns,
    /// nftables table (family `ip`) the proxy owns and replaces on every change.
    pub table: String,
    /// Address on which Services of type NodePort/LoadBalancer get their node ports;
    /// None: no node ports.
    pub node_ip: Option<Ipv4Addr>,
    /// Fixed forwards rendered into the same table (the manager pass-through).
    pub static_node_ports: Vec<NodePort>,
    /// Dual-stack labs: the node's IPv4 and IPv6 pod ranges, which map a pod's
    /// IPv4 address to its IPv6 one (IPv6 ClusterIPs' backends); None: IPv6
    /// ClusterIPs get no rules.
    pub ipv6_pods: Option<(ipnet::Ipv4Net, ipnet::Ipv6Net)>,
    pub debounce: Duration,
    /// Bound for the initial list of Services and Endpoints.
    pub sync_timeout: Duration,
}

impl KubeProxyConfig {
    /// Defaults: table [`DEFAULT_TABLE`], no node ports, 100 ms debounce, 30 s sync.
    pub fn new(kubeconfig: impl Into<PathBuf>, node_netns: Netns) -> Self {
        KubeProxyConfig {
            kubeconfig: kubeconfig.into(),
            node_netns,
            table: DEFAULT_TABLE.to_owned(),
            node_ip: None,
            static_node_ports: Vec::new(),
            ipv6_pods: None,
            debounce: DEFAULT_DEBOUNCE,
            sync_timeout: Duration::from_secs(30),
        }
    }

    pub fn table(mut self, table: &str) -> Self {
        self.table = table.to_owned();
        self
    }

    pub fn node_ip(mut self, ip: Ipv4Addr) -> Self {
        self.node_ip = Some(ip);
        self
    }

    /// See [`KubeProxyConfig::ipv6_pods`].
    pub fn ipv6_pods(mut self, ranges: Option<(ipnet::Ipv4Net, ipnet::Ipv6Net)>) -> Self {
        self.ipv6_pods = ranges;
        self
    }

    pub fn static_node_ports(mut self, node_ports: Vec<NodePort>) -> Self {
        self.static_node_ports = node_ports;
        self
    }
}

/// The rules for `snapshot` (pure): every ClusterIP port, then every node port (when
/// `node_ip` is set), then `static_node_ports`; sorted by namespace, name and port so
/// the same state always renders the same script.
pub fn plan(
    snapshot: &Snapshot,
    node_ip: Option<Ipv4Addr>,
    static_node_ports: &[NodePort],
) -> Vec<ServiceRule> {
    plan_dual_stack(snapshot, node_ip, static_node_ports, None)
}

/// [`plan`] plus rules for IPv6 ClusterIPs, whose backends are the IPv4
/// backends' pods at their IPv6 addresses (`ipv6_pods`: see
/// [`KubeProxyConfig::ipv6_pods`]).
pub fn plan_dual_stack(
    snapshot: &Snapshot,
    node_ip: Option<Ipv4Addr>,
    static_node_ports: &[NodePort],
    ipv6_pods: Option<(ipnet::Ipv4Net, ipnet::Ipv6Net)>,
) -> Vec<ServiceRule> {
    let mut cluster_ips = Vec::new();
    let mut node_ports = Vec::new();
    for svc in snapshot.services.values() {
        let ServiceKind::ClusterIp(ips) = &svc.kind else {
            continue;
        };
        let endpoints = snapshot.endpoints_of(svc);
        for port in &svc.ports {
            let Some(protocol) = port.protocol.nft() else {
                continue;
            };
            let backends: Vec<SocketAddr> = endpoints
                .map(|e| e.backends(port))
                .unwrap_or_default()
                .into_iter()
                .filter(|(ip, _)| ip.is_ipv4())
                .map(|(ip, p)| SocketAddr::new(ip, p))
                .collect();
            let backends_v6: Vec<SocketAddr> = backends
                .iter()
                .filter_map(|b| match (b.ip(), ipv6_pods) {
                    (IpAddr::V4(v4), Some((net4, net6))) if net4.contains(&v4) => {
                        let v6 = crate::topology::ipv6_at_offset(net4, net6, v4);
                        Some(SocketAddr::new(IpAddr::V6(v6), b.port()))
                    }
                    _ => None,
                })
                .collect();
            let name = if port.name.is_empty() {
                format!("{}/{}", svc.namespace, svc.name)
            } else {
                format!("{}/{}:{}", svc.namespace, svc.name, port.name)
            };
            for ip in ips {
                let backends = match ip {
                    IpAddr::V4(_) => backends.clone(),
                    IpAddr::V6(_) if ipv6_pods.is_some() => backends_v6.clone(),
                    IpAddr::V6(_) => continue,
                };
                cluster_ips.push(ServiceRule {
                    name: name.clone(),
                    kind: RuleKind::ClusterIp,
                    ip: *ip,
                    port: port.port,
                    protocol,
                    backends,
                });
            }
            if let (Some(node_ip), Some(node_port), true) =
                (node_ip, port.node_port, svc.has_node_ports)
            {
                node_ports.push(ServiceRule {
                    name: name.clone(),
                    kind: RuleKind::NodePort,
                    ip: IpAddr::V4(node_ip),
                    port: node_port,
                    protocol,
                    backends: backends.clone(),
                });
            }
        }
    }
    node_ports.extend(static_node_ports.iter().map(ServiceRule::from));
    cluster_ips.extend(node_ports);
    cluster_ips
}

/// What the proxy has loaded, for tests and `kvpn lab` output.
#[derive(Debug, Clone, Default)]
pub struct ProxyStatus {
    /// The rules of the last successful load.
    pub rules: Vec<ServiceRule>,
    /// How many times a changed rule set was loaded.
    pub loads: u64,
    /// When the last load finished.
    pub last_load: Option<Instant>,
    /// The last load error, cleared by the next successful load.
    pub last_error: Option<String>,
}

/// A running kube-proxy stand-in. Dropping it stops it like [`KubeProxy::stop`].
#[derive(Debug)]
pub struct KubeProxy {
    netns: Netns,
    table: String,
    status: Arc<Mutex<ProxyStatus>>,
    stop_tx: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl KubeProxy {
    /// Starts the proxy thread and returns once the initial rules are loaded (bounded by
    /// `sync_timeout`); on error nothing is left running and the table is removed.
    pub fn start(config: KubeProxyConfig) -> Result<KubeProxy, Error> {
        let status = Arc::new(Mutex::new(ProxyStatus::default()));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), Error>>();
        let (stop_tx, stop_rx) = oneshot::channel();
        let netns = config.node_netns.clone();
        let table = config.table.clone();
        let thread_status = status.clone();
        let thread = std::thread::Builder::new()
            .name(format!("kube-proxy-{}", netns.name()))
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(Error::Thread(e)));
                        return;
                    }
                };
                runtime.block_on(run(config, thread_status, ready_tx, stop_rx));
            })
            .map_err(Error::Thread)?;
        let mut proxy = KubeProxy {
            netns,
            table,
            status,
            stop_tx: Some(stop_tx),
            thread: Some(thread),
        };
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(proxy),
            Ok(Err(e)) => {
                let _ = proxy.shutdown();
                Err(e)
            }
            Err(_) => {
                let _ = proxy.shutdown();
                Err(Error::Stopped(
                    "exited before loading its first rules".into(),
                ))
            }
        }
    }

    /// The nftables table the proxy owns.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// What is loaded now.
    pub fn status(&self) -> ProxyStatus {
        self.status
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Stops the thread and deletes the table.
    pub fn stop(mut self) -> Result<(), Error> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<(), Error> {
        if let Some(tx) = self.stop_tx.take() {
            let _ = tx.send(());
        }
        let mut result = Ok(());
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            result = Err(Error::Stopped("its thread panicked".into()));
        }
        // After the join: no load can race the delete.
        nft::delete_table(&self.netns, &self.table).map_err(|source| Error::Nft {
            netns: self.netns.name().to_owned(),
            source,
        })?;
        result
    }
}

impl Drop for KubeProxy {
    fn drop(&mut self) {
        if self.thread.is_some()
            && let Err(e) = self.shutdown()
        {
            tracing::warn!(error = %e, "kube-proxy stand-in: teardown failed");
        }
    }
}

async fn run(
    config: KubeProxyConfig,
    status: Arc<Mutex<ProxyStatus>>,
    ready_tx: std::sync::mpsc::Sender<Result<(), Error>>,
    mut stop_rx: oneshot::Receiver<()>,
) {
    let client = match super::client_from_kubeconfig(&config.kubeconfig).await {
        Ok(c) => c,
        Err(e) => {
            let _ = ready_tx.send(Err(e.into()));
            return;
        }
    };
    let mut watch = ServiceWatch::spawn(client);
    if !watch.wait_synced(config.sync_timeout).await {
        let _ = ready_tx.send(Err(Error::NotSynced {
            after: config.sync_timeout,
        }));
        return;
    }
    let mut loaded: Option<String> = None;
    let first = sync(&config, &watch, &status, &mut loaded).await;
    let failed = first.is_err();
    let _ = ready_tx.send(first);
    if failed {
        return;
    }
    tracing::info!(netns = config.node_netns.name(), table = %config.table, "kube-proxy stand-in running");
    loop {
        tokio::select! {
            _ = &mut stop_rx => break,
            alive = watch.changed(config.debounce) => {
                if !alive {
                    tracing::error!("kube-proxy stand-in: watch ended");
                    break;
                }
                if let Err(e) = sync(&config, &watch, &status, &mut loaded).await {
                    tracing::warn!(error = %e, "kube-proxy stand-in: update failed; retried on the next change");
                    status.lock().unwrap_or_else(PoisonError::into_inner).last_error = Some(e.to_string());
                    // A failed load leaves the previous table in place; force a retry.
                    loaded = None;
                }
            }
        }
    }
}

/// Renders the current snapshot and loads it if it differs from `loaded`.
async fn sync(
    config: &KubeProxyConfig,
    watch: &ServiceWatch,
    status: &Arc<Mutex<ProxyStatus>>,
    loaded: &mut Option<String>,
) -> Result<(), Error> {
    let rules = plan_dual_stack(
        &watch.snapshot(),
        config.node_ip,
        &config.static_node_ports,
        config.ipv6_pods,
    );
    let script = nft::render_rules(&config.table, &rules);
    if loaded.as_deref() == Some(script.as_str()) {
        return Ok(());
    }
    let netns = config.node_netns.clone();
    let started = Instant::now();
    let script_for_nft = script.clone();
    // `nft` is a child process: keep it off the runtime thread's async path.
    tokio::task::spawn_blocking(move || nft::apply(&netns, &script_for_nft))
        .await
        .map_err(|e| Error::Stopped(format!("nft task: {e}")))?
        .map_err(|source| Error::Nft {
            netns: config.node_netns.name().to_owned(),
            source,
        })?;
    tracing::debug!(
        rules = rules.len(),
        elapsed_ms = started.elapsed().as_millis(),
        "kube-proxy stand-in: rules loaded"
    );
    *loaded = Some(script);
    let mut st = status.lock().unwrap_or_else(PoisonError::into_inner);
    st.rules = rules;
    st.loads += 1;
    st.last_load = Some(Instant::now());
    st.last_error = None;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Endpoints, Service};

    fn obj<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
        serde_json::from_value(v).expect("valid object")
    }

    fn snapshot() -> Snapshot {
        let services: Vec<Service> = vec![
            obj(serde_json::json!({
                "metadata": {"namespace": "demo", "name": "web"},
                "spec": {"clusterIP": "10.96.1.100", "type": "NodePort", "ports": [
                    {"name": "http", "port": 80, "targetPort": "http", "nodePort": 30080},
                    {"name": "dns", "port": 53, "protocol": "UDP"},
                    {"name": "sctp", "port": 9, "protocol": "SCTP"}
                ]}
            })),
            obj(serde_json::json!({
                "metadata": {"namespace": "demo", "name": "empty"},
                "spec": {"clusterIP": "10.96.1.103", "ports": [{"port": 80, "nodePort": 30081}]}
            })),
            obj(serde_json::json!({
                "metadata": {"namespace": "demo", "name": "headless"},
                "spec": {"clusterIP": "None", "ports": [{"port": 80}]}
            })),
            obj(serde_json::json!({
                "metadata": {"namespace": "demo", "name": "v6"},
                "spec": {"clusterIP": "fd00::1", "ports": [{"port": 80}]}
            })),
        ];
        let endpoints: Vec<Endpoints> = vec![
            obj(serde_json::json!({
                "metadata": {"namespace": "demo", "name": "web"},
                "subsets": [{
                    "addresses": [{"ip": "10.244.1.12"}, {"ip": "10.244.1.11"}],
                    "notReadyAddresses": [{"ip": "10.244.1.13"}],
                    "ports": [{"name": "http", "port": 8080}, {"name": "dns", "port": 5353, "protocol": "UDP"}]
                }]
            })),
            obj(serde_json::json!({
                "metadata": {"namespace": "demo", "name": "headless"},
                "subsets": [{"addresses": [{"ip": "10.244.1.11"}], "ports": [{"port": 80}]}]
            })),
        ];
        Snapshot::from_objects(&services, &endpoints)
    }

    fn sa(s: &str) -> SocketAddr {
        s.parse().expect("socket address")
    }

    #[test]
    fn ipv6_cluster_ips_balance_over_the_same_pods_ipv6_addresses() {
        let services: Vec<Service> = vec![obj(serde_json::json!({
            "metadata": {"namespace": "demo", "name": "web"},
            "spec": {"clusterIP": "10.96.1.100", "clusterIPs": ["10.96.1.100", "fd00:10:96::64"],
                     "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}
        }))];
        let endpoints: Vec<Endpoints> = vec![obj(serde_json::json!({
            "metadata": {"namespace": "demo", "name": "web"},
            "subsets": [{"addresses": [{"ip": "10.244.1.11"}], "ports": [{"name": "http", "port": 8080}]}]
        }))];
        let snap = Snapshot::from_objects(&services, &endpoints);
        let ranges = (
            "10.244.1.0/24".parse().expect("net"),
            "fd00:10:244:1::/64".parse().expect("net"),
        );
        let rules = plan_dual_stack(&snap, None, &[], Some(ranges));
        let got: Vec<(IpAddr, Vec<SocketAddr>)> =
            rules.iter().map(|r| (r.ip, r.backends.clone())).collect();
        assert_eq!(
            got,
            vec![
                (
                    "10.96.1.100".parse().expect("ip"),
                    vec![sa("10.244.1.11:8080")]
                ),
                (
                    "fd00:10:96::64".parse().expect("ip"),
                    vec![sa("[fd00:10:244:1::b]:8080")]
                ),
            ]
        );
        let script = nft::render_rules("t", &rules);
        assert!(script.contains("table ip t {"), "{script}");
        assert!(
            script.contains("ip6 daddr fd00:10:96::64 tcp dport 80 jump svc-1"),
            "{script}"
        );
        assert!(
            script.contains("meta l4proto tcp dnat to [fd00:10:244:1::b]:8080"),
            "{script}"
        );
        // Without the ranges (IPv4-only labs) IPv6 ClusterIPs get nothing, and
        // the script deletes any IPv6 table.
        let v4_only = nft::render_rules("t", &plan(&snap, None, &[]));
        assert!(!v4_only.contains("ip6 daddr"), "{v4_only}");
        assert!(
            v4_only.ends_with("table ip6 t {}\ndelete table ip6 t\n"),
            "{v4_only}"
        );
    }

    #[test]
    fn plans_cluster_ips_with_named_target_ports_and_rejects() {
        let rules = plan(&snapshot(), None, &[]);
        let summary: Vec<(String, String, Vec<SocketAddr>)> = rules
            .iter()
            .map(|r| {
                (
                    r.name.clone(),
                    format!("{}:{}/{}", r.ip, r.port, r.protocol.as_str()),
                    r.backends.clone(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                ("demo/empty".into(), "10.96.1.103:80/tcp".into(), vec![]),
                (
                    "demo/web:http".into(),
                    "10.96.1.100:80/tcp".into(),
                    vec![sa("10.244.1.11:8080"), sa("10.244.1.12:8080")]
                ),
                (
                    "demo/web:dns".into(),
                    "10.96.1.100:53/udp".into(),
                    vec![sa("10.244.1.11:5353"), sa("10.244.1.12:5353")]
                ),
            ],
            "headless, IPv6 and SCTP get no rules; not-ready addresses are no backends"
        );
        assert!(rules.iter().all(|r| r.kind == RuleKind::ClusterIp));
    }

    #[test]
    fn node_ports_only_with_a_node_ip_and_for_node_port_services() {
        let manager = NodePort {
            name: "manager".into(),
            node_ip: Ipv4Addr::new(172, 31, 255, 1),
            port: 10801,
            protocol: nft::Protocol::Tcp,
            pod_ip: Ipv4Addr::new(10, 244, 1, 10),
            target_port: 10801,
        };
        let rules = plan(
            &snapshot(),
            Some(Ipv4Addr::new(172, 31, 255, 1)),
            std::slice::from_ref(&manager),
        );
        let node_ports: Vec<(u16, Vec<SocketAddr>)> = rules
            .iter()
            .filter(|r| r.kind == RuleKind::NodePort)
            .map(|r| (r.port, r.backends.clone()))
            .collect();
        // `empty` has a nodePort but is type ClusterIP: no node port.
        assert_eq!(
            node_ports,
            vec![
                (30080, vec![sa("10.244.1.11:8080"), sa("10.244.1.12:8080")]),
                (10801, vec![sa("10.244.1.10:10801")]),
            ]
        );
        // Deterministic: the same snapshot renders byte-identical scripts.
        assert_eq!(
            nft::render_rules("t", &rules),
            nft::render_rules(
                "t",
                &plan(
                    &snapshot(),
                    Some(Ipv4Addr::new(172, 31, 255, 1)),
                    &[manager]
                )
            )
        );
    }
}
