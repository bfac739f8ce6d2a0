//! Services and Endpoints as the lab's kube-proxy stand-in and cluster DNS see them:
//! a plain [`Snapshot`] model converted from the API objects (pure), and a
//! [`ServiceWatch`] that keeps two reflector stores (core/v1 Services and Endpoints,
//! list-then-watch) current and says when something changed (I/O: the Kubernetes API).
//!
//! Why core/v1 Endpoints and not EndpointSlices: the lab's apiserver is 1.20, which
//! has no `discovery.k8s.io/v1` (TOOLCHAIN.md); Endpoints carry everything both
//! stand-ins need (ready and not-ready addresses, hostnames, named ports).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Endpoints, Service};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client};
use tokio::sync::watch;

use crate::nft::Protocol;

/// The annotation that makes DNS publish not-ready endpoints (DNS spec, "ready").
pub const TOLERATE_UNREADY_ANNOTATION: &str =
    "service.alpha.kubernetes.io/tolerate-unready-endpoints";

/// Transport protocol of a service or endpoint port (`TCP` when unset, as the API
/// defaults it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PortProtocol {
    Tcp,
    Udp,
    Sctp,
}

impl PortProtocol {
    fn parse(s: Option<&str>) -> Option<PortProtocol> {
        match s.unwrap_or("TCP") {
            "TCP" => Some(PortProtocol::Tcp),
            "UDP" => Some(PortProtocol::Udp),
            "SCTP" => Some(PortProtocol::Sctp),
            _ => None,
        }
    }

    /// Lower-case name, as in SRV names (`_tcp`).
    pub fn as_str(self) -> &'static str {
        match self {
            PortProtocol::Tcp => "tcp",
            PortProtocol::Udp => "udp",
            PortProtocol::Sctp => "sctp",
        }
    }

    /// The nftables protocol; SCTP is not proxied by the lab.
    pub fn nft(self) -> Option<Protocol> {
        match self {
            PortProtocol::Tcp => Some(Protocol::Tcp),
            PortProtocol::Udp => Some(Protocol::Udp),
            PortProtocol::Sctp => None,
        }
    }
}

/// Where a service port sends traffic in the pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetPort {
    Number(u16),
    /// A container port name, resolved per endpoint through the Endpoints' ports.
    Named(String),
}

/// One port of a Service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePortInfo {
    /// Empty for the single unnamed port.
    pub name: String,
    pub protocol: PortProtocol,
    pub port: u16,
    pub target_port: TargetPort,
    pub node_port: Option<u16>,
}

/// What a Service's name stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServiceKind {
    /// ClusterIP, NodePort or LoadBalancer: one or two (dual-stack) ClusterIPs.
    ClusterIp(Vec<IpAddr>),
    /// `clusterIP: None`: DNS answers with the endpoints' addresses.
    Headless,
    /// `type: ExternalName`: DNS answers with a CNAME.
    ExternalName(String),
}

/// One Service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceInfo {
    pub namespace: String,
    pub name: String,
    pub kind: ServiceKind,
    /// `spec.type` is `NodePort` or `LoadBalancer` (node ports are allocated).
    pub has_node_ports: bool,
    pub ports: Vec<ServicePortInfo>,
    /// `spec.publishNotReadyAddresses` or the tolerate-unready annotation.
    pub publish_not_ready: bool,
}

/// One address of an Endpoints subset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointAddressInfo {
    pub ip: IpAddr,
    pub hostname: Option<String>,
}

/// One port of an Endpoints subset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointPortInfo {
    /// Empty for an unnamed port; matches the service port of the same name.
    pub name: String,
    pub protocol: PortProtocol,
    pub port: u16,
}

/// One Endpoints subset: addresses sharing the same ports.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SubsetInfo {
    pub ready: Vec<EndpointAddressInfo>,
    pub not_ready: Vec<EndpointAddressInfo>,
    pub ports: Vec<EndpointPortInfo>,
}

/// The Endpoints object of one Service (same namespace and name).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EndpointsInfo {
    pub subsets: Vec<SubsetInfo>,
}

impl EndpointsInfo {
    /// The backends of a service port, as kube-proxy finds them: in every subset, the
    /// endpoint port with the service port's name and protocol gives the target port
    /// (that is how a named `targetPort` is resolved); each ready address of that
    /// subset is a backend. Sorted and deduplicated.
    pub fn backends(&self, port: &ServicePortInfo) -> Vec<(IpAddr, u16)> {
        let mut out: Vec<(IpAddr, u16)> = self
            .subsets
            .iter()
            .filter_map(|subset| {
                let ep_port = subset
                    .ports
                    .iter()
                    .find(|p| p.name == port.name && p.protocol == port.protocol)?;
                Some(subset.ready.iter().map(move |a| (a.ip, ep_port.port)))
            })
            .flatten()
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }
}

/// Key of a namespaced object.
pub type ObjectKey = (String, String);

/// Every Service and Endpoints object of the cluster, converted. Objects that cannot be
/// converted (an unparsable IP, a port out of range) are left out with a warning; the
/// rest of the object stays.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Snapshot {
    pub services: BTreeMap<ObjectKey, ServiceInfo>,
    pub endpoints: BTreeMap<ObjectKey, EndpointsInfo>,
}

impl Snapshot {
    /// Converts API objects (pure).
    pub fn from_objects<'a>(
        services: impl IntoIterator<Item = &'a Service>,
        endpoints: impl IntoIterator<Item = &'a Endpoints>,
    ) -> Snapshot {
        let mut snap = Snapshot::default();
        for svc in services {
            if let Some(info) = service_info(svc) {
                snap.services
                    .insert((info.namespace.clone(), info.name.clone()), info);
            }
        }
        for ep in endpoints {
            let (Some(ns), Some(name)) = (&ep.metadata.namespace, &ep.metadata.name) else {
                continue;
            };
            snap.endpoints
                .insert((ns.clone(), name.clone()), endpoints_info(ep));
        }
        snap
    }

    /// The Endpoints of `svc`, if any.
    pub fn endpoints_of(&self, svc: &ServiceInfo) -> Option<&EndpointsInfo> {
        self.endpoints
            .get(&(svc.namespace.clone(), svc.name.clone()))
    }
}

fn port_u16(value: i32, what: &str, object: &str) -> Option<u16> {
    match u16::try_from(value) {
        Ok(p) if p != 0 => Some(p),
        _ => {
            tracing::warn!(object, value, "{what} out of range; port ignored");
            None
        }
    }
}

fn service_info(svc: &Service) -> Option<ServiceInfo> {
    let namespace = svc.metadata.namespace.clone()?;
    let name = svc.metadata.name.clone()?;
    let object = format!("service {namespace}/{name}");
    let spec = svc.spec.as_ref()?;
    let type_ = spec.type_.as_deref().unwrap_or("ClusterIP");
    let kind = if type_ == "ExternalName" {
        ServiceKind::ExternalName(spec.external_name.clone().unwrap_or_default())
    } else {
        match spec.cluster_ip.as_deref() {
            Some("None") => ServiceKind::Headless,
            None | Some("") => {
                tracing::debug!(%object, "no ClusterIP yet; ignored");
                return None;
            }
            Some(first) => {
                let mut raw: Vec<&str> = vec![first];
                for ip in spec.cluster_ips.iter().flatten() {
                    if !raw.contains(&ip.as_str()) {
                        raw.push(ip);
                    }
                }
                let ips: Vec<IpAddr> = raw
                    .iter()
                    .filter_map(|s| match s.parse() {
                        Ok(ip) => Some(ip),
                        Err(_) => {
                            tracing::warn!(%object, ip = s, "unparsable ClusterIP ignored");
                            None
                        }
                    })
                    .collect();
                if ips.is_empty() {
                    return None;
                }
                ServiceKind::ClusterIp(ips)
            }
        }
    };
    let ports = spec
        .ports
        .iter()
        .flatten()
        .filter_map(|p| {
            let protocol = PortProtocol::parse(p.protocol.as_deref())?;
            let port = port_u16(p.port, "service port", &object)?;
            let target_port = match &p.target_port {
                None => TargetPort::Number(port),
                Some(IntOrString::Int(n)) => {
                    TargetPort::Number(port_u16(*n, "target port", &object)?)
                }
                Some(IntOrString::String(s)) => match s.parse::<u16>() {
                    Ok(n) if n != 0 => TargetPort::Number(n),
                    _ => TargetPort::Named(s.clone()),
                },
            };
            Some(ServicePortInfo {
                name: p.name.clone().unwrap_or_default(),
                protocol,
                port,
                target_port,
                node_port: p.node_port.and_then(|n| port_u16(n, "node port", &object)),
            })
        })
        .collect();
    let tolerate = svc
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(TOLERATE_UNREADY_ANNOTATION))
        .is_some_and(|v| v.eq_ignore_ascii_case("true"));
    Some(ServiceInfo {
        namespace,
        name,
        kind,
        has_node_ports: matches!(type_, "NodePort" | "LoadBalancer"),
        ports,
        publish_not_ready: spec.publish_not_ready_addresses.unwrap_or(false) || tolerate,
    })
}

fn endpoints_info(ep: &Endpoints) -> EndpointsInfo {
    let object = format!(
        "endpoints {}/{}",
        ep.metadata.namespace.as_deref().unwrap_or_default(),
        ep.metadata.name.as_deref().unwrap_or_default()
    );
    let addresses = |list: &Option<Vec<k8s_openapi::api::core::v1::EndpointAddress>>| {
        list.iter()
            .flatten()
            .filter_map(|a| match a.ip.parse() {
                Ok(ip) => Some(EndpointAddressInfo {
                    ip,
                    hostname: a.hostname.clone().filter(|h| !h.is_empty()),
                }),
                Err(_) => {
                    tracing::warn!(%object, ip = a.ip, "unparsable endpoint address ignored");
                    None
                }
            })
            .collect::<Vec<_>>()
    };
    EndpointsInfo {
        subsets: ep
            .subsets
            .iter()
            .flatten()
            .map(|s| SubsetInfo {
                ready: addresses(&s.addresses),
                not_ready: addresses(&s.not_ready_addresses),
                ports: s
                    .ports
                    .iter()
                    .flatten()
                    .filter_map(|p| {
                        Some(EndpointPortInfo {
                            name: p.name.clone().unwrap_or_default(),
                            protocol: PortProtocol::parse(p.protocol.as_deref())?,
                            port: port_u16(p.port, "endpoint port", &object)?,
                        })
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// Live Services and Endpoints of a cluster: two reflector stores fed by
/// list-then-watch tasks on the tokio runtime that called [`ServiceWatch::spawn`], and
/// a change counter. The tasks end when the watch is dropped.
pub struct ServiceWatch {
    services: Store<Service>,
    endpoints: Store<Endpoints>,
    changes_rx: watch::Receiver<u64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for ServiceWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceWatch")
            .field("services", &self.services.len())
            .field("endpoints", &self.endpoints.len())
            .field("changes", &*self.changes_rx.borrow())
            .finish()
    }
}

impl ServiceWatch {
    /// Starts watching all namespaces. Must be called inside a tokio runtime. Watch
    /// errors (the apiserver restarting, a 410 Gone) are retried with kube's default
    /// backoff and logged.
    pub fn spawn(client: Client) -> ServiceWatch {
        let (changes_tx, changes_rx) = watch::channel(0u64);
        let (services, svc_writer) = reflector::store::<Service>();
        let (endpoints, ep_writer) = reflector::store::<Endpoints>();
        let svc_stream = reflector::reflector(
            svc_writer,
            watcher(
                Api::<Service>::all(client.clone()),
                watcher::Config::default(),
            ),
        );
        let ep_stream = reflector::reflector(
            ep_writer,
            watcher(Api::<Endpoints>::all(client), watcher::Config::default()),
        );
        let tasks = vec![
            tokio::spawn(drive(svc_stream, changes_tx.clone(), "services")),
            tokio::spawn(drive(ep_stream, changes_tx, "endpoints")),
        ];
        ServiceWatch {
            services,
            endpoints,
            changes_rx,
            tasks,
        }
    }

    /// Waits until both stores hold the initial list, at most `timeout`. `false` on
    /// timeout.
    pub async fn wait_synced(&self, timeout: Duration) -> bool {
        let both = async {
            self.services.wait_until_ready().await.is_ok()
                && self.endpoints.wait_until_ready().await.is_ok()
        };
        tokio::time::timeout(timeout, both).await.unwrap_or(false)
    }

    /// The current contents of both stores, converted.
    pub fn snapshot(&self) -> Snapshot {
        let services = self.services.state();
        let endpoints = self.endpoints.state();
        Snapshot::from_objects(
            services.iter().map(AsRef::as_ref),
            endpoints.iter().map(AsRef::as_ref),
        )
    }

    /// Waits for the next change, then `debounce` more so a burst (a Service and its
    /// Endpoints created together) becomes one update. `false` once the watch tasks
    /// are gone.
    pub async fn changed(&mut self, debounce: Duration) -> bool {
        if self.changes_rx.changed().await.is_err() {
            return false;
        }
        tokio::time::sleep(debounce).await;
        self.changes_rx.borrow_and_update();
        true
    }
}

impl Drop for ServiceWatch {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

async fn drive<K, S>(stream: S, changes_tx: watch::Sender<u64>, what: &'static str)
where
    S: futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send,
    K: Send,
{
    let stream = stream.default_backoff();
    futures::pin_mut!(stream);
    while let Some(event) = stream.next().await {
        match event {
            // Events of the initial list only fill the store; InitDone publishes it.
            Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
            Ok(watcher::Event::InitDone | watcher::Event::Apply(_) | watcher::Event::Delete(_)) => {
                changes_tx.send_modify(|n| *n += 1);
            }
            Err(e) => tracing::warn!(what, error = %e, "watch failed; retrying"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
        serde_json::from_value(v).expect("valid object")
    }

    #[test]
    fn converts_services_of_every_kind() {
        let services: Vec<Service> = vec![
            obj(serde_json::json!({
                "metadata": {"namespace": "demo", "name": "web"},
                "spec": {"clusterIP": "10.96.1.100", "ports": [
                    {"name": "http", "port": 80, "targetPort": "http"},
                    {"name": "metrics", "port": 9100, "targetPort": 9100, "protocol": "UDP"},
                    {"name": "sctp", "port": 9, "protocol": "SCTP"}
                ]}
            })),
            obj(serde_json::json!({
                "metadata": {"namespace": "demo", "name": "db",
                    "annotations": {TOLERATE_UNREADY_ANNOTATION: "true"}},
                "spec": {"clusterIP": "None", "ports": [{"port": 5432}]}
            })),
            obj(serde_json::json!({
                "metadata": {"namespace": "demo", "name": "ext"},
                "spec": {"type": "ExternalName", "externalName": "example.org"}
            })),
            obj(serde_json::json!({
                "metadata": {"namespace": "demo", "name": "np"},
                "spec": {"type": "NodePort", "clusterIP": "10.96.1.5",
                    "ports": [{"port": 80, "targetPort": "8080", "nodePort": 30080}]}
            })),
            // Not allocated yet: ignored.
            obj(
                serde_json::json!({"metadata": {"namespace": "demo", "name": "pending"}, "spec": {}}),
            ),
        ];
        let snap = Snapshot::from_objects(&services, &[]);
        assert_eq!(snap.services.len(), 4);
        let web = &snap.services[&("demo".into(), "web".into())];
        assert_eq!(
            web.kind,
            ServiceKind::ClusterIp(vec!["10.96.1.100".parse().expect("ip")])
        );
        assert_eq!(web.ports[0].target_port, TargetPort::Named("http".into()));
        assert_eq!(web.ports[0].protocol, PortProtocol::Tcp);
        assert_eq!(web.ports[1].protocol, PortProtocol::Udp);
        assert_eq!(web.ports[2].protocol, PortProtocol::Sctp);
        assert!(!web.has_node_ports);
        let db = &snap.services[&("demo".into(), "db".into())];
        assert_eq!(db.kind, ServiceKind::Headless);
        assert!(db.publish_not_ready);
        assert_eq!(db.ports[0].target_port, TargetPort::Number(5432));
        assert_eq!(
            snap.services[&("demo".into(), "ext".into())].kind,
            ServiceKind::ExternalName("example.org".into())
        );
        let np = &snap.services[&("demo".into(), "np".into())];
        assert!(np.has_node_ports);
        assert_eq!(np.ports[0].node_port, Some(30080));
        // A numeric string is a number, not a port name.
        assert_eq!(np.ports[0].target_port, TargetPort::Number(8080));
    }

    #[test]
    fn backends_resolve_ports_by_name_per_subset() {
        let ep: Endpoints = obj(serde_json::json!({
            "metadata": {"namespace": "demo", "name": "web"},
            "subsets": [
                {"addresses": [{"ip": "10.244.1.11"}], "notReadyAddresses": [{"ip": "10.244.1.13"}],
                 "ports": [{"name": "http", "port": 8080}, {"name": "dns", "port": 53, "protocol": "UDP"}]},
                {"addresses": [{"ip": "10.244.1.12", "hostname": "b"}, {"ip": "bogus"}],
                 "ports": [{"name": "http", "port": 9090}]}
            ]
        }));
        let snap = Snapshot::from_objects(&[], [&ep]);
        let info = &snap.endpoints[&("demo".into(), "web".into())];
        assert_eq!(
            info.subsets[1].ready.len(),
            1,
            "the bogus address is dropped"
        );
        assert_eq!(info.subsets[1].ready[0].hostname.as_deref(), Some("b"));
        let http = ServicePortInfo {
            name: "http".into(),
            protocol: PortProtocol::Tcp,
            port: 80,
            target_port: TargetPort::Named("http".into()),
            node_port: None,
        };
        assert_eq!(
            info.backends(&http),
            vec![
                ("10.244.1.11".parse().expect("ip"), 8080),
                ("10.244.1.12".parse().expect("ip"), 9090)
            ],
            "ready addresses only, each with its subset's port"
        );
        let dns_tcp = ServicePortInfo {
            name: "dns".into(),
            protocol: PortProtocol::Tcp,
            port: 53,
            target_port: TargetPort::Number(53),
            node_port: None,
        };
        assert!(
            info.backends(&dns_tcp).is_empty(),
            "protocol must match too"
        );
    }
}
