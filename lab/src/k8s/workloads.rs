//! The lab's sample workloads (lab-only code), applied through the API server with
//! server-side apply (field manager [`FIELD_MANAGER`]), so later features have
//! realistic routes and DNS names to work on. [`objects`] is pure (the objects as
//! JSON); [`apply`] and [`wait_ready`] do the API calls.
//!
//! | namespace | object | what |
//! |---|---|---|
//! | `default` | Deployment `web` | 2 × `kvpn/lab-server` (HTTP :8080, TCP echo :7007, UDP echo :7007), label `app=web` |
//! | `default` | Service `web` | ClusterIP 10.96.0.100, `http` 80/TCP → 8080 (the skeleton's `web`) |
//! | `default` | Service `echo` | ClusterIP 10.96.0.101, `echo` 7/TCP → 7007 |
//! | `default` | Service `udp-echo` | ClusterIP 10.96.0.102, `echo-udp` 7/UDP → 7007 (UDP Service) |
//! | `default` | Service `backend` | multi-port: `http` 8080/TCP and `echo` 7007/TCP |
//! | `default` | Service `web-headless` | headless (`clusterIP: None`): one A record per `web` pod |
//! | `dev` | Deployment `web` | 1 × `kvpn/lab-server`, label `app=web` |
//! | `dev` | Service `web` | ClusterIP from the service CIDR, `http` 80/TCP → 8080: same name as `default/web` (case dns-03) |
//! | `kvpn-system` | Deployment + Service `kvpn-manager` | the traffic manager on :10801, NodePort 10801 on the node's uplink address, so the laptop reaches it at `172.31.255.1:10801` ([`Workloads::manager`]) |
//!
//! The ClusterIPs are those of the default [`Addressing`]; [`objects_for`] takes them
//! from another plan (`.100`, `.101`, `.102` of its service CIDR).

use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Service};
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};

use super::{Error, KVPN_NAMESPACE};
use crate::topology::Addressing;
use crate::{ECHO_PORT, ECHO_SERVICE_PORT, HTTP_PORT, MANAGER_PORT, WEB_SERVICE_PORT};

/// Field manager of the lab's server-side applies.
pub const FIELD_MANAGER: &str = "kvpn-lab";
/// Image of the lab's test server (kubelet stand-in's image map: `kvpn-lab-server`).
pub const LAB_SERVER_IMAGE: &str = "kvpn/lab-server:lab";
/// Image of the traffic manager (kubelet stand-in's image map: `kvpn-manager`).
pub const MANAGER_IMAGE: &str = "kvpn/manager:lab";
/// The second sample namespace.
pub const DEV_NAMESPACE: &str = "dev";
/// Name of the manager's Deployment and Service in [`KVPN_NAMESPACE`].
pub const MANAGER_NAME: &str = "kvpn-manager";
/// Replicas of `default/web`.
pub const WEB_REPLICAS: i32 = 2;

/// Which sample objects to apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workloads {
    /// The sample namespaces, Deployments and Services (table above).
    pub samples: bool,
    /// The traffic manager Deployment + NodePort Service in `kvpn-system`.
    pub manager: bool,
}

impl Default for Workloads {
    fn default() -> Self {
        Workloads {
            samples: true,
            manager: true,
        }
    }
}

/// One object to apply: its kind and the JSON.
#[derive(Debug, Clone)]
pub enum Object {
    Namespace(Value),
    Deployment(Value),
    Service(Value),
}

impl Object {
    /// `kind namespace/name`, for messages.
    pub fn describe(&self) -> String {
        let (kind, v) = match self {
            Object::Namespace(v) => ("Namespace", v),
            Object::Deployment(v) => ("Deployment", v),
            Object::Service(v) => ("Service", v),
        };
        let ns = v["metadata"]["namespace"].as_str().unwrap_or("");
        let name = v["metadata"]["name"].as_str().unwrap_or("");
        if ns.is_empty() {
            format!("{kind} {name}")
        } else {
            format!("{kind} {ns}/{name}")
        }
    }
}

fn lab_server_deployment(namespace: &str, name: &str, replicas: i32) -> Value {
    json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"namespace": namespace, "name": name, "labels": {"app": name}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{
                    "name": "server",
                    "image": LAB_SERVER_IMAGE,
                    "args": ["--name", "$(POD_NAME)"],
                    "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                    "ports": [
                        {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
                        {"name": "echo", "containerPort": ECHO_PORT, "protocol": "TCP"},
                        {"name": "echo-udp", "containerPort": ECHO_PORT, "protocol": "UDP"},
                    ],
                    "readinessProbe": {"tcpSocket": {"port": HTTP_PORT}, "periodSeconds": 1},
                }]},
            },
        },
    })
}

fn service(namespace: &str, name: &str, selector: &str, spec: Value) -> Value {
    let mut spec = spec;
    spec["selector"] = json!({"app": selector});
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"namespace": namespace, "name": name},
        "spec": spec,
    })
}

/// Makes a ClusterIP Service `svc` dual-stack (Kubernetes 1.20 alpha fields):
/// `ipFamilyPolicy: PreferDualStack` with `v6` as its second ClusterIP.
fn dual_stack(svc: &mut Value, v6: std::net::Ipv6Addr) {
    let v4 = svc["spec"]["clusterIP"].clone();
    svc["spec"]["ipFamilyPolicy"] = json!("PreferDualStack");
    svc["spec"]["ipFamilies"] = json!(["IPv4", "IPv6"]);
    svc["spec"]["clusterIPs"] = json!([v4, v6.to_string()]);
}

fn namespace(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
}

/// The objects of `which` with the default addressing, in apply order (namespaces
/// first, Services with fixed ClusterIPs before any Service that gets one allocated).
pub fn objects(which: Workloads) -> Vec<Object> {
    objects_for(which, &Addressing::default())
}

/// [`objects`] with the fixed ClusterIPs of `addressing`.
pub fn objects_for(which: Workloads, addressing: &Addressing) -> Vec<Object> {
    let mut v = Vec::new();
    if which.samples {
        v.push(Object::Namespace(namespace(DEV_NAMESPACE)));
        v.push(Object::Service(service(
            "default",
            "web",
            "web",
            json!({"clusterIP": addressing.web_cluster_ip().to_string(), "ports": [
                {"name": "http", "port": WEB_SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}]}),
        )));
        v.push(Object::Service(service(
            "default",
            "echo",
            "web",
            json!({"clusterIP": addressing.echo_cluster_ip().to_string(), "ports": [
                {"name": "echo", "port": ECHO_SERVICE_PORT, "targetPort": ECHO_PORT, "protocol": "TCP"}]}),
        )));
        v.push(Object::Service(service(
            "default",
            "udp-echo",
            "web",
            json!({"clusterIP": addressing.udp_echo_cluster_ip().to_string(), "ports": [
                {"name": "echo-udp", "port": ECHO_SERVICE_PORT, "targetPort": ECHO_PORT, "protocol": "UDP"}]}),
        )));
        // Dual-stack labs: the three ClusterIP Services get a fixed IPv6
        // ClusterIP too (the same offsets into the IPv6 service CIDR).
        if let Some(first) = v.iter().position(|o| matches!(o, Object::Service(_))) {
            for (object, offset) in v[first..].iter_mut().zip([100u16, 101, 102]) {
                if let (Object::Service(svc), Some(v6)) =
                    (object, addressing.ipv6_service_ip(offset))
                {
                    dual_stack(svc, v6);
                }
            }
        }
        v.push(Object::Service(service(
            "default",
            "backend",
            "web",
            json!({"ports": [
                {"name": "http", "port": HTTP_PORT, "targetPort": HTTP_PORT, "protocol": "TCP"},
                {"name": "echo", "port": ECHO_PORT, "targetPort": ECHO_PORT, "protocol": "TCP"}]}),
        )));
        v.push(Object::Service(service(
            "default",
            "web-headless",
            "web",
            json!({"clusterIP": "None", "ports": [
                {"name": "http", "port": HTTP_PORT, "targetPort": HTTP_PORT, "protocol": "TCP"}]}),
        )));
        v.push(Object::Service(service(
            DEV_NAMESPACE,
            "web",
            "web",
            json!({"ports": [
                {"name": "http", "port": WEB_SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}]}),
        )));
        v.push(Object::Deployment(lab_server_deployment(
            "default",
            "web",
            WEB_REPLICAS,
        )));
        v.push(Object::Deployment(lab_server_deployment(
            DEV_NAMESPACE,
            "web",
            1,
        )));
    }
    if which.manager {
        let labels = json!({"app.kubernetes.io/name": MANAGER_NAME});
        v.push(Object::Namespace(namespace(KVPN_NAMESPACE)));
        v.push(Object::Service(json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"namespace": KVPN_NAMESPACE, "name": MANAGER_NAME, "labels": labels},
            "spec": {
                "type": "NodePort",
                "selector": labels,
                "ports": [{"name": "data", "port": MANAGER_PORT, "targetPort": MANAGER_PORT,
                           "nodePort": MANAGER_PORT, "protocol": "TCP"}],
            },
        })));
        v.push(Object::Deployment(json!({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"namespace": KVPN_NAMESPACE, "name": MANAGER_NAME, "labels": labels},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{
                        "name": "manager",
                        "image": MANAGER_IMAGE,
                        "args": ["--listen", format!("0.0.0.0:{MANAGER_PORT}")],
                        "ports": [{"name": "data", "containerPort": MANAGER_PORT, "protocol": "TCP"}],
                        "readinessProbe": {"tcpSocket": {"port": MANAGER_PORT}, "periodSeconds": 1},
                    }]},
                },
            },
        })));
    }
    v
}

fn params() -> PatchParams {
    PatchParams::apply(FIELD_MANAGER).force()
}

/// [`objects_for`] for real nodes ([`super::node`]): the lab server Deployments run
/// `image` (imported into the nodes, pull policy IfNotPresent) instead of the
/// kubelet stand-in's image name, and `default/web`'s replicas must land on
/// different nodes (required pod anti-affinity on the hostname), so a node always
/// has a `web` pod on another node.
pub fn objects_for_real_nodes(
    which: Workloads,
    addressing: &Addressing,
    image: &str,
) -> Vec<Object> {
    let mut v = objects_for(which, addressing);
    for object in &mut v {
        let Object::Deployment(d) = object else {
            continue;
        };
        if d["spec"]["template"]["spec"]["containers"][0]["image"] != LAB_SERVER_IMAGE {
            continue;
        }
        let spread = d["metadata"]["namespace"] == "default";
        let app = d["metadata"]["name"].clone();
        let pod = &mut d["spec"]["template"]["spec"];
        pod["containers"][0]["image"] = json!(image);
        pod["containers"][0]["imagePullPolicy"] = json!("IfNotPresent");
        if spread {
            pod["affinity"] = json!({"podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [{
                    "labelSelector": {"matchLabels": {"app": app}},
                    "topologyKey": "kubernetes.io/hostname",
                }],
            }});
        }
    }
    v
}

/// Applies the objects of `which` (ClusterIPs of `addressing`) with server-side apply.
pub async fn apply(
    client: &kube::Client,
    which: Workloads,
    addressing: &Addressing,
) -> Result<(), Error> {
    apply_objects(client, objects_for(which, addressing)).await
}

/// [`apply`] of [`objects_for_real_nodes`].
pub async fn apply_on_real_nodes(
    client: &kube::Client,
    which: Workloads,
    addressing: &Addressing,
    image: &str,
) -> Result<(), Error> {
    apply_objects(client, objects_for_real_nodes(which, addressing, image)).await
}

async fn apply_objects(client: &kube::Client, objects: Vec<Object>) -> Result<(), Error> {
    for object in objects {
        let what = format!("applying {}", object.describe());
        match &object {
            Object::Namespace(v) => {
                let name = v["metadata"]["name"].as_str().unwrap_or_default();
                let api: Api<Namespace> = Api::all(client.clone());
                api.patch(name, &params(), &Patch::Apply(v))
                    .await
                    .map_err(Error::kube(what))?;
            }
            Object::Deployment(v) => {
                let ns = v["metadata"]["namespace"].as_str().unwrap_or("default");
                let name = v["metadata"]["name"].as_str().unwrap_or_default();
                let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
                api.patch(name, &params(), &Patch::Apply(v))
                    .await
                    .map_err(Error::kube(what))?;
            }
            Object::Service(v) => {
                let ns = v["metadata"]["namespace"].as_str().unwrap_or("default");
                let name = v["metadata"]["name"].as_str().unwrap_or_default();
                let api: Api<Service> = Api::namespaced(client.clone(), ns);
                api.patch(name, &params(), &Patch::Apply(v))
                    .await
                    .map_err(Error::kube(what))?;
            }
        }
    }
    Ok(())
}

/// Waits until every Deployment of `which` has all its replicas ready (bounded by
/// `timeout`); the error names the Deployments still waiting.
pub async fn wait_ready(
    client: &kube::Client,
    which: Workloads,
    timeout: Duration,
) -> Result<(), Error> {
    let deployments: Vec<(String, String)> = objects(which)
        .iter()
        .filter_map(|o| match o {
            Object::Deployment(v) => Some((
                v["metadata"]["namespace"].as_str()?.to_owned(),
                v["metadata"]["name"].as_str()?.to_owned(),
            )),
            _ => None,
        })
        .collect();
    let t0 = Instant::now();
    loop {
        let mut waiting = Vec::new();
        for (ns, name) in &deployments {
            let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
            let state = match api.get_opt(name).await {
                Ok(Some(d)) => {
                    let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
                    let ready = d
                        .status
                        .as_ref()
                        .and_then(|s| s.ready_replicas)
                        .unwrap_or(0);
                    (ready < want).then(|| format!("{ns}/{name} {ready}/{want} ready"))
                }
                Ok(None) => Some(format!("{ns}/{name} missing")),
                Err(e) => Some(format!("{ns}/{name}: {e}")),
            };
            waiting.extend(state);
        }
        if waiting.is_empty() {
            return Ok(());
        }
        if t0.elapsed() >= timeout {
            return Err(Error::State {
                path: "sample workloads".into(),
                message: format!(
                    "not ready after {:?}: {} (see the kubelet stand-in's log and `kubectl get pods -A`)",
                    t0.elapsed(),
                    waiting.join(", ")
                ),
            });
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_node_samples_run_the_given_image_and_spread_default_web() {
        let image = "localhost/kvpn/lab-server:0.1.0";
        let objs = objects_for_real_nodes(
            Workloads {
                samples: true,
                manager: false,
            },
            &Addressing::default(),
            image,
        );
        let deployments: Vec<&Value> = objs
            .iter()
            .filter_map(|o| match o {
                Object::Deployment(v) => Some(v),
                _ => None,
            })
            .collect();
        assert_eq!(deployments.len(), 2, "default/web and dev/web");
        for d in &deployments {
            let pod = &d["spec"]["template"]["spec"];
            assert_eq!(pod["containers"][0]["image"], json!(image), "{d:#}");
            assert_eq!(
                pod["containers"][0]["imagePullPolicy"],
                json!("IfNotPresent")
            );
            let spread = &pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
                [0];
            if d["metadata"]["namespace"] == "default" {
                assert_eq!(
                    spread["topologyKey"],
                    json!("kubernetes.io/hostname"),
                    "{d:#}"
                );
                assert_eq!(spread["labelSelector"]["matchLabels"]["app"], json!("web"));
            } else {
                assert!(spread.is_null(), "only default/web is spread: {d:#}");
            }
        }
        // The stand-in lab's objects are untouched.
        let stand_in = objects(Workloads::default());
        assert!(stand_in.iter().all(|o| match o {
            Object::Deployment(v) => v["spec"]["template"]["spec"]["affinity"].is_null(),
            _ => true,
        }));
    }

    #[test]
    fn samples_cover_the_required_shapes() {
        let objs = objects(Workloads::default());
        let services: Vec<&Value> = objs
            .iter()
            .filter_map(|o| match o {
                Object::Service(v) => Some(v),
                _ => None,
            })
            .collect();
        assert!(
            services
                .iter()
                .any(|s| s["spec"]["clusterIP"] == json!("None")),
            "headless"
        );
        assert!(
            services
                .iter()
                .any(|s| s["spec"]["ports"].as_array().is_some_and(|p| p.len() >= 2)),
            "multi-port"
        );
        assert!(
            services
                .iter()
                .any(|s| s["spec"]["ports"][0]["protocol"] == json!("UDP")),
            "UDP"
        );
        let webs: Vec<&str> = services
            .iter()
            .filter(|s| s["metadata"]["name"] == json!("web"))
            .filter_map(|s| s["metadata"]["namespace"].as_str())
            .collect();
        assert_eq!(
            webs,
            vec!["default", DEV_NAMESPACE],
            "same name in two namespaces"
        );
        // Namespaces come before anything inside them.
        let first_dev = objs
            .iter()
            .position(|o| o.describe().contains(" dev/"))
            .expect("dev objects");
        assert!(
            objs[..first_dev]
                .iter()
                .any(|o| o.describe() == "Namespace dev")
        );
    }

    #[test]
    fn cluster_ips_follow_the_addressing() {
        let ip_of = |objs: &[Object], name: &str| -> Option<String> {
            objs.iter().find_map(|o| match o {
                Object::Service(v)
                    if v["metadata"]["name"] == json!(name)
                        && v["metadata"]["namespace"] == json!("default") =>
                {
                    v["spec"]["clusterIP"].as_str().map(str::to_owned)
                }
                _ => None,
            })
        };
        let default = objects(Workloads::default());
        assert_eq!(ip_of(&default, "web").as_deref(), Some("10.96.0.100"));
        assert_eq!(ip_of(&default, "echo").as_deref(), Some("10.96.0.101"));
        assert_eq!(ip_of(&default, "udp-echo").as_deref(), Some("10.96.0.102"));
        let second = objects_for(Workloads::default(), &Addressing::second());
        assert_eq!(ip_of(&second, "web").as_deref(), Some("10.112.0.100"));
        assert_eq!(ip_of(&second, "echo").as_deref(), Some("10.112.0.101"));
        assert_eq!(ip_of(&second, "udp-echo").as_deref(), Some("10.112.0.102"));
    }

    #[test]
    fn every_object_parses_as_its_kind() {
        for o in objects(Workloads::default()) {
            match o {
                Object::Namespace(v) => {
                    serde_json::from_value::<Namespace>(v).expect("Namespace");
                }
                Object::Deployment(v) => {
                    serde_json::from_value::<Deployment>(v).expect("Deployment");
                }
                Object::Service(v) => {
                    serde_json::from_value::<Service>(v).expect("Service");
                }
            }
        }
    }
}
