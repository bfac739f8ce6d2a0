//! The tokio shell of route and DNS discovery ([`crate::routes`]): three
//! kube-runtime watches (pods and Services in all namespaces, and nodes when the
//! manager may read them), one task that feeds their events into the
//! [`Discovery`] core and publishes its [`View`] debounced, and the
//! [`RouteWatch`] handle the gRPC service subscribes to.
//!
//! RBAC: the manager's ClusterRole (`kvpn-manager-<namespace>`, installed by
//! `kvpn connect`) grants get/list/watch on pods, services and endpoints. Nodes
//! are not in it (a user may only grant what it holds, and many users may not
//! read nodes): the node watch starts only when a list of nodes succeeds, else
//! pod CIDRs come from pod IPs. A 403 on pods or Services is a [`Failure`]
//! that ends every `WatchRoutes` stream with PERMISSION_DENIED; the watch keeps
//! retrying (kube-runtime's default backoff, 0.8 s doubling to 30 s) and clears
//! the failure on its own once the permission appears.
//!
//! I/O: the API server (list/watch), the tokio clock (debounce).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod, Service};
use kube::api::{Api, ListParams};
use kube::runtime::{WatchStreamExt as _, watcher};
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt as _;
use tracing::{info, warn};

use crate::routes::{
    Discovery, DiscoveryConfig, NodeInfo, PodInfo, PortInfo, ServiceInfo, View, WatchEvent,
};

/// How long the publisher collects changes after the first one before it
/// publishes: a Deployment scaling up or a namespace being deleted touches many
/// objects within ~100 ms, and one delta for them is enough. Short enough that a
/// new Service's route and record reach the laptop well before kube-proxy has
/// programmed its ClusterIP (~0.3 s in the lab).
pub const DEBOUNCE: Duration = Duration::from_millis(150);

/// Why the route watch cannot serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The manager's service account may not `verb` `resource` in all namespaces.
    Forbidden {
        resource: &'static str,
        verb: &'static str,
        message: String,
    },
    /// No API server access at all (the manager does not run in a cluster).
    NoApi(String),
}

impl Failure {
    /// The gRPC status that ends `WatchRoutes` streams.
    pub fn to_status(&self) -> tonic::Status {
        match self {
            Failure::Forbidden {
                resource,
                verb,
                message,
            } => tonic::Status::permission_denied(format!(
                "the traffic manager may not {verb} {resource} in all namespaces ({message}) — \
                 its ClusterRole/ClusterRoleBinding kvpn-manager-<namespace> must grant \
                 get, list and watch on pods and services; `kvpn connect` installs them"
            )),
            Failure::NoApi(why) => tonic::Status::failed_precondition(format!(
                "the traffic manager has no access to the Kubernetes API ({why}), so it cannot \
                 watch routes"
            )),
        }
    }
}

/// What the publisher shares with subscribers.
#[derive(Debug, Clone, Default)]
pub struct Published {
    /// The current view; `None` until every watch listed once.
    pub view: Option<Arc<View>>,
    /// Set while the watch cannot serve (cleared when it recovers).
    pub failure: Option<Failure>,
}

/// Subscribers' handle on the route watch.
#[derive(Debug, Clone)]
pub struct RouteWatch {
    rx: watch::Receiver<Published>,
}

impl RouteWatch {
    /// A route watch that never serves, for a manager without API access.
    pub fn unavailable(reason: String) -> Self {
        let (tx, rx) = watch::channel(Published {
            view: None,
            failure: Some(Failure::NoApi(reason)),
        });
        // Nobody publishes again; keep the sender alive so receivers never see
        // a closed channel (they would treat it as the watch ending).
        std::mem::forget(tx);
        Self { rx }
    }

    /// A new subscriber; its first `borrow` is the current state.
    pub fn subscribe(&self) -> watch::Receiver<Published> {
        self.rx.clone()
    }

    /// Start the watches with `client` (the pod's service account) on the
    /// current runtime.
    pub fn spawn(client: kube::Client, config: DiscoveryConfig) -> Self {
        let (published_tx, rx) = watch::channel(Published::default());
        let (events_tx, events_rx) = mpsc::channel(1024);
        tokio::spawn(drive_nodes(client.clone(), events_tx.clone()));
        tokio::spawn(drive(
            Api::<Pod>::all(client.clone()),
            "pods",
            events_tx.clone(),
            |e| Input::Pod(e.map(|p| pod_info(&p), |p| key(&p.metadata))),
        ));
        tokio::spawn(drive(
            Api::<Service>::all(client),
            "services",
            events_tx,
            |e| Input::Service(e.map(|s| service_info(&s), |s| key(&s.metadata))),
        ));
        tokio::spawn(publish(Discovery::new(config), events_rx, published_tx));
        Self { rx }
    }
}

/// A kube-runtime event, before reduction.
enum RawEvent<K> {
    Apply(K),
    Delete(K),
    Init,
    InitApply(K),
    InitDone,
}

impl<K> RawEvent<K> {
    fn map<T>(
        self,
        reduce: impl Fn(K) -> T,
        key: impl Fn(K) -> crate::routes::Key,
    ) -> WatchEvent<T> {
        match self {
            RawEvent::Apply(k) => WatchEvent::Apply(reduce(k)),
            RawEvent::Delete(k) => WatchEvent::Delete(key(k)),
            RawEvent::Init => WatchEvent::Init,
            RawEvent::InitApply(k) => WatchEvent::InitApply(reduce(k)),
            RawEvent::InitDone => WatchEvent::InitDone,
        }
    }
}

/// What the watch tasks tell the publisher.
enum Input {
    Node(WatchEvent<NodeInfo>),
    NodesUnreadable(String),
    Pod(WatchEvent<PodInfo>),
    Service(WatchEvent<ServiceInfo>),
    Failed(Failure),
    /// A watch of this resource works (again).
    Working(&'static str),
}

fn key(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> crate::routes::Key {
    (
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone().unwrap_or_default(),
    )
}

/// What routing needs of `node`.
pub fn node_info(node: &Node) -> NodeInfo {
    let spec = node.spec.as_ref();
    let mut cidrs: Vec<&String> = spec
        .and_then(|s| s.pod_cidrs.as_ref())
        .map(|v| v.iter().collect())
        .unwrap_or_default();
    if cidrs.is_empty()
        && let Some(c) = spec.and_then(|s| s.pod_cidr.as_ref())
    {
        cidrs.push(c);
    }
    NodeInfo {
        name: node.metadata.name.clone().unwrap_or_default(),
        pod_cidrs: cidrs.iter().filter_map(|c| c.parse().ok()).collect(),
    }
}

/// What routing needs of `pod`: no IPs for hostNetwork pods (theirs are node
/// addresses) and finished pods (their IPs are free for reuse).
pub fn pod_info(pod: &Pod) -> PodInfo {
    let host_network = pod
        .spec
        .as_ref()
        .and_then(|s| s.host_network)
        .unwrap_or(false);
    let status = pod.status.as_ref();
    let finished = matches!(
        status.and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    );
    let mut ips = Vec::new();
    if !host_network
        && !finished
        && let Some(s) = status
    {
        for ip in s.pod_ips.iter().flatten() {
            if let Ok(a) = ip.ip.parse() {
                ips.push(a);
            }
        }
        if ips.is_empty()
            && let Some(a) = s.pod_ip.as_deref().and_then(|ip| ip.parse().ok())
        {
            ips.push(a);
        }
    }
    PodInfo {
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        name: pod.metadata.name.clone().unwrap_or_default(),
        ips,
    }
}

/// What routing and DNS need of `svc`: no ClusterIPs for headless Services
/// ("None") and ExternalName Services.
pub fn service_info(svc: &Service) -> ServiceInfo {
    let spec = svc.spec.as_ref();
    let mut ips: Vec<&String> = spec
        .and_then(|s| s.cluster_ips.as_ref())
        .map(|v| v.iter().collect())
        .unwrap_or_default();
    if ips.is_empty()
        && let Some(ip) = spec.and_then(|s| s.cluster_ip.as_ref())
    {
        ips.push(ip);
    }
    let external_name = spec.and_then(|s| s.type_.as_deref()) == Some("ExternalName");
    let cluster_ips = if external_name {
        Vec::new()
    } else {
        ips.iter().filter_map(|ip| ip.parse().ok()).collect()
    };
    let mut ports: Vec<PortInfo> = spec
        .and_then(|s| s.ports.as_ref())
        .map(|ps| {
            ps.iter()
                .filter_map(|p| {
                    Some(PortInfo {
                        name: p.name.clone().unwrap_or_default(),
                        port: u16::try_from(p.port).ok()?,
                        protocol: p.protocol.clone().unwrap_or_else(|| "TCP".to_owned()),
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    ports.sort();
    ServiceInfo {
        namespace: svc.metadata.namespace.clone().unwrap_or_default(),
        name: svc.metadata.name.clone().unwrap_or_default(),
        cluster_ips,
        ports,
    }
}

fn failure(resource: &'static str, error: &watcher::Error) -> Option<Failure> {
    let (verb, code, message) = match error {
        watcher::Error::InitialListFailed(kube::Error::Api(s)) => ("list", s.code, &s.message),
        watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => ("watch", s.code, &s.message),
        watcher::Error::WatchError(s) => ("watch", s.code, &s.message),
        _ => return None,
    };
    (code == 403).then(|| Failure::Forbidden {
        resource,
        verb,
        message: message.clone(),
    })
}

/// Run one watch until the publisher is gone.
async fn drive<K>(
    api: Api<K>,
    resource: &'static str,
    events_tx: mpsc::Sender<Input>,
    wrap: impl Fn(RawEvent<K>) -> Input + Send + 'static,
) where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let stream = watcher(api, watcher::Config::default()).default_backoff();
    let mut stream = std::pin::pin!(stream);
    let mut failing = false;
    while let Some(item) = stream.next().await {
        let input = match item {
            Ok(event) => {
                if failing {
                    failing = false;
                    info!(resource, "watch works again");
                    if events_tx.send(Input::Working(resource)).await.is_err() {
                        return;
                    }
                }
                wrap(match event {
                    watcher::Event::Apply(k) => RawEvent::Apply(k),
                    watcher::Event::Delete(k) => RawEvent::Delete(k),
                    watcher::Event::Init => RawEvent::Init,
                    watcher::Event::InitApply(k) => RawEvent::InitApply(k),
                    watcher::Event::InitDone => RawEvent::InitDone,
                })
            }
            Err(e) => {
                if !failing {
                    warn!(resource, error = %e, "route watch failed; retrying with backoff");
                }
                failing = true;
                match failure(resource, &e) {
                    Some(f) => Input::Failed(f),
                    None => continue,
                }
            }
        };
        if events_tx.send(input).await.is_err() {
            return;
        }
    }
}

/// Watch nodes if this service account may list them; else say why not.
async fn drive_nodes(client: kube::Client, events_tx: mpsc::Sender<Input>) {
    let api: Api<Node> = Api::all(client);
    match api.list(&ListParams::default().limit(1)).await {
        Ok(_) => {
            info!("nodes are readable: pod CIDRs come from node podCIDRs (and stray pod IPs)");
            drive(api, "nodes", events_tx, |e| {
                Input::Node(e.map(|n| node_info(&n), |n| key(&n.metadata)))
            })
            .await;
        }
        Err(e) => {
            let reason = match &e {
                kube::Error::Api(s) if s.code == 403 => {
                    "the manager's ClusterRole does not grant list on nodes".to_owned()
                }
                other => other.to_string(),
            };
            info!(%reason, "nodes are not readable: pod CIDRs come from pod IPs");
            let _ = events_tx.send(Input::NodesUnreadable(reason)).await;
        }
    }
}

/// Feed events into the core; publish its view at most every [`DEBOUNCE`].
async fn publish(
    mut core: Discovery,
    mut events_rx: mpsc::Receiver<Input>,
    published_tx: watch::Sender<Published>,
) {
    let mut failures: Vec<Failure> = Vec::new();
    let apply = |core: &mut Discovery, input: Input, failures: &mut Vec<Failure>| match input {
        Input::Node(e) => {
            core.handle_node(e);
        }
        Input::NodesUnreadable(reason) => {
            core.handle_nodes_unreadable(reason);
        }
        Input::Pod(e) => {
            core.handle_pod(e);
        }
        Input::Service(e) => {
            core.handle_service(e);
        }
        Input::Failed(f) => {
            if !failures.contains(&f) {
                failures.retain(|old| !same_resource(old, &f));
                failures.push(f);
            }
        }
        Input::Working(resource) => {
            failures
                .retain(|f| !matches!(f, Failure::Forbidden { resource: r, .. } if *r == resource));
        }
    };
    while let Some(first) = events_rx.recv().await {
        apply(&mut core, first, &mut failures);
        let deadline = tokio::time::Instant::now() + DEBOUNCE;
        loop {
            tokio::select! {
                next = events_rx.recv() => match next {
                    Some(input) => apply(&mut core, input, &mut failures),
                    None => break,
                },
                () = tokio::time::sleep_until(deadline) => break,
            }
        }
        let view = core.view();
        let failure = failures.first().cloned();
        published_tx.send_if_modified(|p| {
            let same_view = match (&p.view, &view) {
                (Some(a), Some(b)) => **a == *b,
                (None, None) => true,
                _ => false,
            };
            if same_view && p.failure == failure {
                return false;
            }
            if !same_view {
                p.view = view.map(Arc::new);
            }
            p.failure = failure;
            true
        });
    }
}

fn same_resource(a: &Failure, b: &Failure) -> bool {
    match (a, b) {
        (Failure::Forbidden { resource: x, .. }, Failure::Forbidden { resource: y, .. }) => x == y,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from_json<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
        serde_json::from_value(v).expect("test object")
    }

    #[test]
    fn pods_reduce_to_their_ips_except_host_network_and_finished() {
        let p: Pod = from_json(serde_json::json!({
            "metadata": {"name": "a", "namespace": "default"},
            "spec": {"containers": []},
            "status": {"phase": "Running", "podIP": "10.244.1.11", "podIPs": [{"ip": "10.244.1.11"}, {"ip": "fd00::b"}]}
        }));
        let info = pod_info(&p);
        assert_eq!(info.ips.len(), 2);
        assert_eq!(
            (info.namespace.as_str(), info.name.as_str()),
            ("default", "a")
        );
        let host: Pod = from_json(serde_json::json!({
            "metadata": {"name": "h", "namespace": "kube-system"},
            "spec": {"containers": [], "hostNetwork": true},
            "status": {"phase": "Running", "podIP": "172.31.255.1"}
        }));
        assert!(pod_info(&host).ips.is_empty());
        let done: Pod = from_json(serde_json::json!({
            "metadata": {"name": "j", "namespace": "default"},
            "status": {"phase": "Succeeded", "podIP": "10.244.1.40"}
        }));
        assert!(pod_info(&done).ips.is_empty());
        let old: Pod = from_json(serde_json::json!({
            "metadata": {"name": "o", "namespace": "default"},
            "status": {"phase": "Running", "podIP": "10.244.1.41"}
        }));
        assert_eq!(
            pod_info(&old).ips,
            vec!["10.244.1.41".parse::<std::net::IpAddr>().expect("ip")]
        );
    }

    #[test]
    fn services_reduce_to_cluster_ips_and_ports() {
        let s: Service = from_json(serde_json::json!({
            "metadata": {"name": "web", "namespace": "default"},
            "spec": {"clusterIP": "10.96.0.100", "clusterIPs": ["10.96.0.100"],
                     "ports": [{"name": "http", "port": 80, "protocol": "TCP"}, {"port": 53}]}
        }));
        let info = service_info(&s);
        assert_eq!(
            info.cluster_ips,
            vec!["10.96.0.100".parse::<std::net::IpAddr>().expect("ip")]
        );
        assert_eq!(info.ports.len(), 2);
        assert!(
            info.ports
                .iter()
                .any(|p| p.port == 53 && p.protocol == "TCP" && p.name.is_empty())
        );
        let headless: Service = from_json(serde_json::json!({
            "metadata": {"name": "db", "namespace": "default"},
            "spec": {"clusterIP": "None", "clusterIPs": ["None"]}
        }));
        assert!(service_info(&headless).cluster_ips.is_empty());
        let external: Service = from_json(serde_json::json!({
            "metadata": {"name": "ext", "namespace": "default"},
            "spec": {"type": "ExternalName", "externalName": "example.com"}
        }));
        assert!(service_info(&external).cluster_ips.is_empty());
    }

    #[test]
    fn nodes_reduce_to_pod_cidrs() {
        let n: Node = from_json(serde_json::json!({
            "metadata": {"name": "n1"},
            "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24", "fd00:1::/64"]}
        }));
        assert_eq!(node_info(&n).pod_cidrs.len(), 2);
        let old: Node = from_json(
            serde_json::json!({"metadata": {"name": "n2"}, "spec": {"podCIDR": "10.244.2.0/24"}}),
        );
        assert_eq!(
            node_info(&old).pod_cidrs,
            vec!["10.244.2.0/24".parse::<ipnet::IpNet>().expect("cidr")]
        );
    }

    #[test]
    fn forbidden_names_the_verb_and_resource() {
        let status = kube::core::Status::failure("services is forbidden: User \"system:serviceaccount:kvpn-system:kvpn-manager\" cannot list resource \"services\"", "Forbidden").with_code(403);
        let e = watcher::Error::InitialListFailed(kube::Error::Api(status.boxed()));
        let f = failure("services", &e).expect("a 403 is a failure");
        let s = f.to_status();
        assert_eq!(s.code(), tonic::Code::PermissionDenied);
        assert!(
            s.message().contains("may not list services"),
            "{}",
            s.message()
        );
        let not_found = kube::core::Status::failure("gone", "NotFound").with_code(404);
        assert_eq!(
            failure(
                "pods",
                &watcher::Error::InitialListFailed(kube::Error::Api(not_found.boxed()))
            ),
            None
        );
    }

    #[tokio::test]
    async fn publisher_debounces_and_reports_failures() {
        let (events_tx, events_rx) = mpsc::channel(16);
        let (published_tx, mut rx) = watch::channel(Published::default());
        tokio::spawn(publish(
            Discovery::new(DiscoveryConfig::default()),
            events_rx,
            published_tx,
        ));
        for input in [
            Input::NodesUnreadable("forbidden".into()),
            Input::Pod(WatchEvent::Init),
            Input::Pod(WatchEvent::InitDone),
            Input::Service(WatchEvent::Init),
            Input::Service(WatchEvent::InitDone),
        ] {
            events_tx.send(input).await.expect("publisher runs");
        }
        rx.changed().await.expect("published");
        let p = rx.borrow_and_update().clone();
        assert!(p.view.is_some() && p.failure.is_none());
        // Two changes within the debounce arrive as one publication.
        for name in ["a", "b"] {
            events_tx
                .send(Input::Pod(WatchEvent::Apply(PodInfo {
                    namespace: "default".into(),
                    name: name.into(),
                    ips: vec!["10.244.7.5".parse().expect("ip")],
                })))
                .await
                .expect("publisher runs");
        }
        rx.changed().await.expect("published");
        let v = rx.borrow_and_update().view.clone().expect("view");
        assert_eq!(v.pod_cidrs.len(), 1);
        assert!(
            !rx.has_changed().expect("open"),
            "one publication for both pods"
        );
        events_tx
            .send(Input::Failed(Failure::Forbidden {
                resource: "pods",
                verb: "watch",
                message: "no".into(),
            }))
            .await
            .expect("publisher runs");
        rx.changed().await.expect("published");
        assert!(rx.borrow_and_update().failure.is_some());
        events_tx
            .send(Input::Working("pods"))
            .await
            .expect("publisher runs");
        rx.changed().await.expect("published");
        assert!(rx.borrow_and_update().failure.is_none());
    }
}
