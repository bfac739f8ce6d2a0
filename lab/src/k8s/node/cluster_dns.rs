//! The cluster DNS add-on of the real-node lab: the lab's DNS server
//! ([`crate::k8s::dns`], `kvpn-lab-server dns`) as a cluster runs CoreDNS — a
//! Deployment `kube-system/kube-dns` from the lab-server image behind the Service
//! `kube-system/kube-dns` at the cluster's DNS ClusterIP, which the kubelets name in
//! every pod's resolv.conf (`clusterDNS`, `clusterDomain`).
//!
//! | object | what |
//! |---|---|
//! | ServiceAccount `kube-system/kube-dns` | the pod's API identity |
//! | ClusterRole + ClusterRoleBinding `kvpn-lab:kube-dns` | `list` and `watch` of Services and Endpoints, nothing else |
//! | Deployment `kube-system/kube-dns` | 1 replica, `kvpn-lab-server dns --listen 0.0.0.0:5353`, uid/gid 65532, no capabilities, read-only root, `dnsPolicy: Default` (it must not ask itself) |
//! | Service `kube-system/kube-dns` | ClusterIP = DNS IP, `dns` 53/UDP and `dns-tcp` 53/TCP → targetPort 5353 |
//!
//! Port 5353 in the pod: a non-root process without NET_BIND_SERVICE cannot bind 53
//! (and 1.20 does not yet count `net.ipv4.ip_unprivileged_port_start` as a safe
//! sysctl), so the Service's targetPort maps the well-known port, and kube-proxy
//! DNATs `<DNS IP>:53` to `<pod IP>:5353`.
//!
//! [`objects`] is pure; [`apply`] and [`wait_serving`] talk to the apiserver and the
//! nodes.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use ipnet::IpNet;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::{Value, json};

use super::{Error, RealNodes};
use crate::k8s::dns::{DNS_SERVICE_NAME, DNS_SERVICE_NAMESPACE};

/// The port the DNS server listens on inside its pod (UDP and TCP).
pub const CONTAINER_PORT: u16 = 5353;
/// Name of the ClusterRole and ClusterRoleBinding.
pub const RBAC_NAME: &str = "kvpn-lab:kube-dns";
/// The uid and gid the DNS container runs as (the images' non-root user).
pub const RUN_AS: i64 = 65532;
/// Label of the DNS pods (the Service's selector), as kubeadm's CoreDNS has it.
const APP_LABEL: &str = "kube-dns";
/// Field manager of the server-side applies.
const FIELD_MANAGER: &str = "kvpn-lab";

/// What the add-on serves.
#[derive(Debug, Clone)]
pub struct ClusterDnsSpec {
    /// The lab-server image (imported into the nodes; pull policy IfNotPresent).
    pub image: String,
    /// The kube-dns ClusterIP (the kubelets' `clusterDNS`).
    pub service_ip: Ipv4Addr,
    /// The cluster domain (the kubelets' `clusterDomain`).
    pub domain: String,
    /// CIDRs whose reverse names the server answers (service and pod CIDRs).
    pub reverse_cidrs: Vec<IpNet>,
}

/// One object of the add-on.
#[derive(Debug, Clone)]
pub enum Object {
    ServiceAccount(Value),
    ClusterRole(Value),
    ClusterRoleBinding(Value),
    Deployment(Value),
    Service(Value),
}

/// The add-on's objects in apply order (identity and rights before the pod).
pub fn objects(spec: &ClusterDnsSpec) -> Vec<Object> {
    let labels = json!({"k8s-app": APP_LABEL, "app.kubernetes.io/managed-by": FIELD_MANAGER});
    let mut args = vec![
        "dns".to_owned(),
        "--listen".to_owned(),
        format!("0.0.0.0:{CONTAINER_PORT}"),
        "--domain".to_owned(),
        spec.domain.clone(),
        "--dns-ip".to_owned(),
        spec.service_ip.to_string(),
    ];
    for cidr in &spec.reverse_cidrs {
        args.push("--reverse-cidr".to_owned());
        args.push(cidr.to_string());
    }
    vec![
        Object::ServiceAccount(json!({
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"namespace": DNS_SERVICE_NAMESPACE, "name": DNS_SERVICE_NAME, "labels": labels},
        })),
        Object::ClusterRole(json!({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": RBAC_NAME, "labels": labels},
            "rules": [{"apiGroups": [""], "resources": ["services", "endpoints"], "verbs": ["list", "watch"]}],
        })),
        Object::ClusterRoleBinding(json!({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": RBAC_NAME, "labels": labels},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": RBAC_NAME},
            "subjects": [{"kind": "ServiceAccount", "namespace": DNS_SERVICE_NAMESPACE, "name": DNS_SERVICE_NAME}],
        })),
        Object::Deployment(json!({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"namespace": DNS_SERVICE_NAMESPACE, "name": DNS_SERVICE_NAME, "labels": labels},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"k8s-app": APP_LABEL}},
                "template": {
                    "metadata": {"labels": {"k8s-app": APP_LABEL}},
                    "spec": {
                        "serviceAccountName": DNS_SERVICE_NAME,
                        // The server needs no name resolution; it must not ask itself.
                        "dnsPolicy": "Default",
                        "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}],
                        "securityContext": {
                            "runAsUser": RUN_AS,
                            "runAsGroup": RUN_AS,
                            "runAsNonRoot": true,
                        },
                        "containers": [{
                            "name": "dns",
                            "image": spec.image,
                            "imagePullPolicy": "IfNotPresent",
                            "args": args,
                            "ports": [
                                {"name": "dns", "containerPort": CONTAINER_PORT, "protocol": "UDP"},
                                {"name": "dns-tcp", "containerPort": CONTAINER_PORT, "protocol": "TCP"},
                            ],
                            // The TCP socket is bound just before the first list of
                            // Services arrives (milliseconds here); until then
                            // queries wait in the socket.
                            "readinessProbe": {"tcpSocket": {"port": CONTAINER_PORT}, "periodSeconds": 1},
                            "securityContext": {
                                "allowPrivilegeEscalation": false,
                                "readOnlyRootFilesystem": true,
                                "capabilities": {"drop": ["ALL"]},
                            },
                        }],
                    },
                },
            },
        })),
        Object::Service(json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "namespace": DNS_SERVICE_NAMESPACE,
                "name": DNS_SERVICE_NAME,
                "labels": {"k8s-app": APP_LABEL, "kubernetes.io/name": "KubeDNS", "app.kubernetes.io/managed-by": FIELD_MANAGER},
            },
            "spec": {
                "clusterIP": spec.service_ip.to_string(),
                "selector": {"k8s-app": APP_LABEL},
                "ports": [
                    {"name": "dns", "port": 53, "targetPort": CONTAINER_PORT, "protocol": "UDP"},
                    {"name": "dns-tcp", "port": 53, "targetPort": CONTAINER_PORT, "protocol": "TCP"},
                ],
            },
        })),
    ]
}

fn kube_err(what: String) -> impl FnOnce(kube::Error) -> Error {
    move |e| Error::from(crate::k8s::Error::kube(what)(e))
}

/// Applies the add-on (server-side apply, forced).
pub async fn apply(client: &kube::Client, spec: &ClusterDnsSpec) -> Result<(), Error> {
    let params = PatchParams::apply(FIELD_MANAGER).force();
    for object in objects(spec) {
        let (kind, v) = match &object {
            Object::ServiceAccount(v) => ("ServiceAccount", v),
            Object::ClusterRole(v) => ("ClusterRole", v),
            Object::ClusterRoleBinding(v) => ("ClusterRoleBinding", v),
            Object::Deployment(v) => ("Deployment", v),
            Object::Service(v) => ("Service", v),
        };
        let name = v["metadata"]["name"].as_str().unwrap_or_default();
        let what = format!("applying the cluster DNS {kind} {name}");
        let ns = DNS_SERVICE_NAMESPACE;
        let patch = Patch::Apply(v);
        match object {
            Object::ServiceAccount(_) => Api::<ServiceAccount>::namespaced(client.clone(), ns)
                .patch(name, &params, &patch)
                .await
                .map(drop),
            Object::ClusterRole(_) => Api::<ClusterRole>::all(client.clone())
                .patch(name, &params, &patch)
                .await
                .map(drop),
            Object::ClusterRoleBinding(_) => Api::<ClusterRoleBinding>::all(client.clone())
                .patch(name, &params, &patch)
                .await
                .map(drop),
            Object::Deployment(_) => Api::<Deployment>::namespaced(client.clone(), ns)
                .patch(name, &params, &patch)
                .await
                .map(drop),
            Object::Service(_) => Api::<Service>::namespaced(client.clone(), ns)
                .patch(name, &params, &patch)
                .await
                .map(drop),
        }
        .map_err(kube_err(what))?;
    }
    Ok(())
}

/// Waits (bounded by `timeout`) until the kube-dns Deployment is ready and every
/// node resolves `kubernetes.default.svc.<domain>` to `kubernetes_ip` through the
/// Service (`dig @<DNS IP>` in the node: kube-proxy's DNAT, the pod, its answer).
pub async fn wait_serving(
    client: &kube::Client,
    nodes: &RealNodes,
    spec: &ClusterDnsSpec,
    kubernetes_ip: Ipv4Addr,
    timeout: Duration,
) -> Result<(), Error> {
    let t0 = Instant::now();
    let api: Api<Deployment> = Api::namespaced(client.clone(), DNS_SERVICE_NAMESPACE);
    let name = format!("kubernetes.default.svc.{}", spec.domain);
    let server = format!("@{}", spec.service_ip);
    let mut pending: Vec<usize> = (0..nodes.nodes().len()).collect();
    let mut last = String::from("the kube-dns Deployment is not ready yet");
    loop {
        let ready = match api.get_opt(DNS_SERVICE_NAME).await {
            Ok(Some(d)) => d
                .status
                .and_then(|s| s.ready_replicas)
                .is_some_and(|r| r >= 1),
            Ok(None) => false,
            Err(e) => {
                last = format!("reading the kube-dns Deployment: {e}");
                false
            }
        };
        if ready {
            let mut still = Vec::new();
            for i in pending {
                let node = &nodes.nodes()[i];
                match node.exec(
                    "dig",
                    &["+short", "+time=1", "+tries=1", &server, &name, "A"],
                ) {
                    Ok(out) if out.trim() == kubernetes_ip.to_string() => {}
                    Ok(out) => {
                        last = format!(
                            "{}: dig {server} {name} answered {:?}, not {kubernetes_ip}",
                            node.name(),
                            out.trim()
                        );
                        still.push(i);
                    }
                    Err(e) => {
                        last = format!("{}: {e}", node.name());
                        still.push(i);
                    }
                }
            }
            pending = still;
            if pending.is_empty() {
                tracing::info!(elapsed_ms = t0.elapsed().as_millis(), "cluster DNS serving");
                return Ok(());
            }
        }
        if t0.elapsed() > timeout {
            return Err(Error::NotReady {
                after: t0.elapsed(),
                message: format!(
                    "cluster DNS (kube-system/kube-dns): {last}; its pods: {} (see `kubectl -n kube-system logs deploy/kube-dns` and the kubelet logs; an image without `kvpn-lab-server dns` exits at once: rebuild it with `cargo xtask image`)",
                    pod_states(client).await
                ),
            });
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// `name: phase, container state (reason: message)` of each DNS pod, for errors.
async fn pod_states(client: &kube::Client) -> String {
    let api: Api<Pod> = Api::namespaced(client.clone(), DNS_SERVICE_NAMESPACE);
    let params = ListParams::default().labels(&format!("k8s-app={APP_LABEL}"));
    let pods = match api.list(&params).await {
        Ok(p) => p.items,
        Err(e) => return format!("cannot list them: {e}"),
    };
    if pods.is_empty() {
        return "none".into();
    }
    pods.iter()
        .map(|p| {
            let status = p.status.as_ref();
            let phase = status
                .and_then(|s| s.phase.clone())
                .unwrap_or_else(|| "unknown".into());
            let container = status
                .and_then(|s| s.container_statuses.as_ref())
                .and_then(|c| c.first())
                .map(|c| {
                    let state = c.state.as_ref();
                    let last = c.last_state.as_ref().and_then(|l| l.terminated.as_ref());
                    let now = state
                        .and_then(|s| s.waiting.as_ref())
                        .map(|w| format!("waiting {}", w.reason.clone().unwrap_or_default()))
                        .unwrap_or_else(|| "running".into());
                    match last {
                        Some(t) => format!(
                            "{now}, restarts {}, last exit {} {}",
                            c.restart_count,
                            t.exit_code,
                            t.message.clone().unwrap_or_default().trim()
                        ),
                        None => now,
                    }
                })
                .unwrap_or_else(|| "no container status".into());
            format!(
                "{}: {phase}, {container}",
                p.metadata.name.clone().unwrap_or_default()
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ClusterDnsSpec {
        ClusterDnsSpec {
            image: "localhost/kvpn/lab-server:0.1.0".into(),
            service_ip: Ipv4Addr::new(10, 96, 0, 10),
            domain: "cluster.local".into(),
            reverse_cidrs: vec![
                "10.96.0.0/12".parse().expect("cidr"),
                "10.244.0.0/16".parse().expect("cidr"),
            ],
        }
    }

    #[test]
    fn the_dns_pod_runs_unprivileged_on_5353_behind_port_53() {
        let objs = objects(&spec());
        let deployment = objs
            .iter()
            .find_map(|o| match o {
                Object::Deployment(v) => Some(v),
                _ => None,
            })
            .expect("a Deployment");
        let pod = &deployment["spec"]["template"]["spec"];
        assert_eq!(pod["serviceAccountName"], DNS_SERVICE_NAME);
        assert_eq!(pod["dnsPolicy"], "Default");
        assert_eq!(pod["securityContext"]["runAsUser"], RUN_AS);
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
        let c = &pod["containers"][0];
        assert_eq!(c["securityContext"]["capabilities"]["drop"], json!(["ALL"]));
        assert!(c["securityContext"]["capabilities"]["add"].is_null());
        assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
        let args: Vec<&str> = c["args"]
            .as_array()
            .expect("args")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(
            args,
            [
                "dns",
                "--listen",
                "0.0.0.0:5353",
                "--domain",
                "cluster.local",
                "--dns-ip",
                "10.96.0.10",
                "--reverse-cidr",
                "10.96.0.0/12",
                "--reverse-cidr",
                "10.244.0.0/16"
            ]
        );
        let service = objs
            .iter()
            .find_map(|o| match o {
                Object::Service(v) => Some(v),
                _ => None,
            })
            .expect("a Service");
        assert_eq!(service["metadata"]["namespace"], "kube-system");
        assert_eq!(service["metadata"]["name"], "kube-dns");
        assert_eq!(service["spec"]["clusterIP"], "10.96.0.10");
        for (port, proto) in service["spec"]["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .zip(["UDP", "TCP"])
        {
            assert_eq!(port["port"], 53);
            assert_eq!(port["targetPort"], 5353);
            assert_eq!(port["protocol"], proto);
        }
        assert_eq!(
            service["spec"]["selector"],
            deployment["spec"]["template"]["metadata"]["labels"]
        );
    }

    #[test]
    fn the_dns_service_account_may_only_list_and_watch_services_and_endpoints() {
        let objs = objects(&spec());
        let role = objs
            .iter()
            .find_map(|o| match o {
                Object::ClusterRole(v) => Some(v),
                _ => None,
            })
            .expect("a ClusterRole");
        assert_eq!(
            role["rules"],
            json!([{"apiGroups": [""], "resources": ["services", "endpoints"], "verbs": ["list", "watch"]}])
        );
        let binding = objs
            .iter()
            .find_map(|o| match o {
                Object::ClusterRoleBinding(v) => Some(v),
                _ => None,
            })
            .expect("a ClusterRoleBinding");
        assert_eq!(binding["roleRef"]["name"], RBAC_NAME);
        assert_eq!(
            binding["subjects"],
            json!([{"kind": "ServiceAccount", "namespace": "kube-system", "name": "kube-dns"}])
        );
        // Every object parses as its kind.
        for o in objs {
            let ok = match o {
                Object::ServiceAccount(v) => serde_json::from_value::<ServiceAccount>(v).is_ok(),
                Object::ClusterRole(v) => serde_json::from_value::<ClusterRole>(v).is_ok(),
                Object::ClusterRoleBinding(v) => {
                    serde_json::from_value::<ClusterRoleBinding>(v).is_ok()
                }
                Object::Deployment(v) => serde_json::from_value::<Deployment>(v).is_ok(),
                Object::Service(v) => serde_json::from_value::<Service>(v).is_ok(),
            };
            assert!(ok);
        }
    }
}
