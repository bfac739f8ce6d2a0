//! The stand-in's Node object: registration (podCIDR, labels, addresses, the kubelet
//! endpoint the API server dials for port-forward and logs, capacity, node info), the
//! Ready heartbeat on `nodes/status` and the node Lease in `kube-node-lease`, and
//! removal on stop. I/O: API calls with the kubelet stand-in's client.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use super::status::k8s_time;
use super::{Error, now};

/// Namespace of node Leases.
const LEASE_NAMESPACE: &str = "kube-node-lease";
/// Lease duration the kubelet uses.
const LEASE_SECONDS: i32 = 40;

/// What the Node says about this stand-in.
#[derive(Debug, Clone)]
pub struct NodeSpec {
    pub name: String,
    pub pod_cidr: String,
    /// The node's IPv6 pod range in a dual-stack lab (`podCIDRs`' second entry).
    pub pod_cidr_v6: Option<String>,
    /// Where the API server reaches the kubelet endpoint (InternalIP + port).
    pub endpoint: SocketAddr,
    /// The node's address towards the laptop (ExternalIP), if any.
    pub external_ip: Option<Ipv4Addr>,
    pub labels: Vec<(String, String)>,
}

/// The labels every node gets, plus `extra`.
pub fn node_labels(name: &str, extra: &[(String, String)]) -> Vec<(String, String)> {
    let mut l = vec![
        ("kubernetes.io/hostname".to_owned(), name.to_owned()),
        ("kubernetes.io/os".to_owned(), "linux".to_owned()),
        ("kubernetes.io/arch".to_owned(), "amd64".to_owned()),
        ("beta.kubernetes.io/os".to_owned(), "linux".to_owned()),
        ("beta.kubernetes.io/arch".to_owned(), "amd64".to_owned()),
        ("node.kubernetes.io/kvpn-lab".to_owned(), "true".to_owned()),
    ];
    l.extend(extra.iter().cloned());
    l
}

fn object(spec: &NodeSpec) -> Value {
    let labels: serde_json::Map<String, Value> = spec
        .labels
        .iter()
        .map(|(k, v)| (k.clone(), json!(v)))
        .collect();
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": spec.name,
            "labels": labels,
            "annotations": {"kvpn.dev/kubelet": "kvpn lab kubelet stand-in (lab-only)"},
        },
        "spec": {
            "podCIDR": spec.pod_cidr,
            "podCIDRs": std::iter::once(&spec.pod_cidr).chain(&spec.pod_cidr_v6).collect::<Vec<_>>(),
        },
    })
}

fn first_line(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.lines().next().unwrap_or("").trim().to_owned())
        .unwrap_or_default()
}

fn status(spec: &NodeSpec, t: Timestamp, since: Timestamp) -> Value {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mem_kib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1).map(str::to_owned))
        })
        .unwrap_or_else(|| "1048576".to_owned());
    let resources = json!({"cpu": cpus.to_string(), "memory": format!("{mem_kib}Ki"), "pods": "110", "ephemeral-storage": "10Gi"});
    let cond = |kind: &str, status: &str, reason: &str, message: &str| {
        json!({
            "type": kind, "status": status, "reason": reason, "message": message,
            "lastHeartbeatTime": k8s_time(t), "lastTransitionTime": k8s_time(since),
        })
    };
    let mut addresses = vec![
        json!({"type": "InternalIP", "address": spec.endpoint.ip().to_string()}),
        json!({"type": "Hostname", "address": spec.name}),
    ];
    if let Some(ip) = spec.external_ip {
        addresses.push(json!({"type": "ExternalIP", "address": ip.to_string()}));
    }
    let uname = nix::sys::utsname::uname().ok();
    let kernel = uname
        .as_ref()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default();
    let os_image = first_line("/etc/debian_version");
    json!({
        "addresses": addresses,
        "daemonEndpoints": {"kubeletEndpoint": {"Port": spec.endpoint.port()}},
        "capacity": resources,
        "allocatable": resources,
        "conditions": [
            cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
            cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            cond("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
            cond("Ready", "True", "KubeletReady", "kvpn lab kubelet stand-in is posting ready status"),
        ],
        "nodeInfo": {
            "architecture": "amd64",
            "bootID": first_line("/proc/sys/kernel/random/boot_id"),
            "containerRuntimeVersion": concat!("kvpn-lab://", env!("CARGO_PKG_VERSION")),
            "kernelVersion": kernel,
            "kubeProxyVersion": "v1.20.2",
            "kubeletVersion": "v1.20.2",
            "machineID": first_line("/etc/machine-id"),
            "operatingSystem": "linux",
            "osImage": if os_image.is_empty() { "Linux".to_owned() } else { format!("Debian GNU/Linux {os_image}") },
            "systemUUID": first_line("/etc/machine-id"),
        },
    })
}

/// Creates (or takes over) the Node, posts a Ready status and clears the `not-ready`
/// taint the TaintNodesByCondition admission plugin puts on new nodes (no node
/// lifecycle controller runs in the lab to do it). Returns the Node's UID.
pub async fn register(client: &kube::Client, spec: &NodeSpec) -> Result<String, Error> {
    let nodes: Api<Node> = Api::all(client.clone());
    let want: Node =
        serde_json::from_value(object(spec)).map_err(|e| Error::Start(e.to_string()))?;
    let existing = nodes
        .get_opt(&spec.name)
        .await
        .map_err(Error::kube(format!("reading node {}", spec.name)))?;
    if let Some(old) = existing {
        let want_cidrs = want.spec.as_ref().and_then(|s| s.pod_cidrs.clone());
        let same_cidr = old.spec.as_ref().and_then(|s| s.pod_cidr.as_deref())
            == Some(spec.pod_cidr.as_str())
            && old.spec.as_ref().and_then(|s| s.pod_cidrs.clone()) == want_cidrs;
        if same_cidr {
            tracing::info!(node = %spec.name, "taking over an existing Node object");
        } else {
            // podCIDR is immutable: replace the node.
            nodes
                .delete(&spec.name, &DeleteParams::default().grace_period(0))
                .await
                .map_err(Error::kube(format!("deleting stale node {}", spec.name)))?;
            wait_gone(&nodes, &spec.name).await?;
        }
    }
    if nodes
        .get_opt(&spec.name)
        .await
        .map_err(Error::kube(format!("reading node {}", spec.name)))?
        .is_none()
    {
        nodes
            .create(&PostParams::default(), &want)
            .await
            .map_err(Error::kube(format!("creating node {}", spec.name)))?;
    }
    let t = now();
    nodes
        .patch_status(
            &spec.name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": status(spec, t, t)})),
        )
        .await
        .map_err(Error::kube(format!("posting status of node {}", spec.name)))?;
    let node = nodes
        .patch(
            &spec.name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"taints": null}})),
        )
        .await
        .map_err(Error::kube(format!(
            "clearing taints of node {}",
            spec.name
        )))?;
    Ok(node.metadata.uid.unwrap_or_default())
}

async fn wait_gone(nodes: &Api<Node>, name: &str) -> Result<(), Error> {
    for _ in 0..100 {
        if nodes
            .get_opt(name)
            .await
            .map_err(Error::kube(format!("reading node {name}")))?
            .is_none()
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(Error::Start(format!(
        "node {name} still exists 10 s after deletion"
    )))
}

/// One heartbeat: the Ready status with a fresh `lastHeartbeatTime`, and the Lease
/// renewed. `since` is when the node became Ready.
pub async fn heartbeat(client: &kube::Client, spec: &NodeSpec, node_uid: &str, since: Timestamp) {
    let nodes: Api<Node> = Api::all(client.clone());
    let t = now();
    if let Err(e) = nodes
        .patch_status(
            &spec.name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": status(spec, t, since)})),
        )
        .await
    {
        tracing::warn!(node = %spec.name, error = %e, "node heartbeat failed");
    }
    let leases: Api<Lease> = Api::namespaced(client.clone(), LEASE_NAMESPACE);
    // MicroTime: RFC 3339 with microseconds.
    let renew = format!(
        "{}.{:06}Z",
        k8s_time(t).trim_end_matches('Z'),
        t.subsec_microsecond()
    );
    let lease = json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": spec.name,
            "namespace": LEASE_NAMESPACE,
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": spec.name, "uid": node_uid}],
        },
        "spec": {"holderIdentity": spec.name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": renew},
    });
    let pp = PatchParams::apply("kvpn-lab-kubelet").force();
    if let Err(e) = leases.patch(&spec.name, &pp, &Patch::Apply(lease)).await {
        tracing::warn!(node = %spec.name, error = %e, "node lease renewal failed");
    }
}

/// Deletes the Node (pods bound to it are then garbage-collected by the controller
/// manager's pod GC).
pub async fn unregister(client: &kube::Client, name: &str) -> Result<(), Error> {
    let nodes: Api<Node> = Api::all(client.clone());
    match nodes.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(Error::kube(format!("deleting node {name}"))(e)),
    }
}
