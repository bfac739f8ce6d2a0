//! `kvpn attach` / `kvpn detach`: per-workload tunnels (docs/attach.md). Attach
//! adds a tunnel container (the manager's image, `kvpn-manager tunnel`) to a
//! workload's pod template by server-side apply under its own field manager,
//! plus a Secret in the workload's namespace with the manager's CA and the
//! attach key; detach applies an empty body under the same field manager, which
//! removes exactly the fields it owned alone, and deletes the Secret.
//!
//! The objects are rendered by the pure [`render`]; this module is the shell:
//! reads of the workload, the manager's Service, Deployment and TLS Secret, the
//! API server's version, and the applies. I/O: the Kubernetes API only.

pub mod check;
pub mod render;

use anyhow::{Context, Result};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{Pod, Secret, Service};
use kube::Api;
use kube::api::{ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use serde_json::Value;

use crate::install::objects::{MANAGER, TLS_SECRET, server_name};
use render::{GatewaySpec, SidecarShape, TunnelSpec, Via, WorkloadKind, WorkloadRef, WriteMethod};

/// Bad input and states `kvpn attach`/`detach` refuse, each naming the object,
/// the cause and the fix.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error(
        "{workload} not found in namespace {namespace}: no such object — check the name with `kubectl get {kind} -n {namespace}` (or give -n NAMESPACE)"
    )]
    NotFound {
        workload: WorkloadRef,
        namespace: String,
        kind: &'static str,
    },
    #[error(
        "{workload} in namespace {namespace} is already attached: its pod template has a {container} container — run `kvpn detach {workload} -n {namespace}` first to attach it again"
    )]
    AlreadyAttached {
        workload: WorkloadRef,
        namespace: String,
        container: &'static str,
    },
    #[error(
        "{workload} in namespace {namespace} is not attached: its pod template has no {container} container and there is no Secret {secret} — nothing to detach"
    )]
    NotAttached {
        workload: WorkloadRef,
        namespace: String,
        container: &'static str,
        secret: String,
    },
    #[error(
        "no traffic manager in namespace {namespace}: Service kvpn-manager not found — run `kvpn connect` (or `kvpn install`) first"
    )]
    NoManager { namespace: String },
    #[error(
        "the traffic manager in namespace {namespace} is too old for {feature}: its Service kvpn-manager has no port {port} — upgrade it with `kvpn install` (or `kvpn connect`)"
    )]
    ManagerTooOld {
        namespace: String,
        port: u16,
        feature: &'static str,
    },
}

/// The workload's API as dynamic objects.
fn workload_api(client: &kube::Client, kind: WorkloadKind, namespace: &str) -> Api<DynamicObject> {
    let ar = match kind {
        WorkloadKind::Deployment => ApiResource::erase::<Deployment>(&()),
        WorkloadKind::StatefulSet => ApiResource::erase::<StatefulSet>(&()),
        WorkloadKind::DaemonSet => ApiResource::erase::<DaemonSet>(&()),
    };
    Api::namespaced_with(client.clone(), namespace, &ar)
}

/// The workload's `spec.template` as JSON; [`AttachError::NotFound`] when absent.
async fn template(api: &Api<DynamicObject>, w: &WorkloadRef, namespace: &str) -> Result<Value> {
    match api.get_opt(&w.name).await {
        Ok(Some(o)) => Ok(o.data["spec"]["template"].clone()),
        Ok(None) => Err(AttachError::NotFound {
            workload: w.clone(),
            namespace: namespace.to_owned(),
            kind: match w.kind {
                WorkloadKind::Deployment => "deployments",
                WorkloadKind::StatefulSet => "statefulsets",
                WorkloadKind::DaemonSet => "daemonsets",
            },
        }
        .into()),
        Err(e) => {
            Err(anyhow::Error::new(e).context(format!("cannot read {w} in namespace {namespace}")))
        }
    }
}

/// What attach did, for the output.
#[derive(Debug)]
pub struct Attached {
    pub via: Via,
    pub shape: SidecarShape,
    pub method: WriteMethod,
    pub why: String,
    pub secret: String,
    pub image: String,
}

/// Attach `w` in `namespace` to the manager in `manager_namespace`.
pub async fn attach(
    client: &kube::Client,
    w: &WorkloadRef,
    namespace: &str,
    manager_namespace: &str,
    via: Via,
) -> Result<Attached> {
    let api = workload_api(client, w.kind, namespace);
    let tpl = template(&api, w, namespace).await?;
    if let Some(already) = render::attached_via(&tpl) {
        return Err(AttachError::AlreadyAttached {
            workload: w.clone(),
            namespace: namespace.to_owned(),
            container: match already {
                Via::Sidecar => render::CONTAINER,
                Via::Gateway => render::GATEWAY_CONTAINER,
            },
        }
        .into());
    }

    // The manager: its Service (address, attach port), image and TLS material.
    let services: Api<Service> = Api::namespaced(client.clone(), manager_namespace);
    let svc = services
        .get_opt(MANAGER)
        .await
        .with_context(|| format!("cannot read Service {manager_namespace}/{MANAGER}"))?
        .ok_or_else(|| AttachError::NoManager {
            namespace: manager_namespace.to_owned(),
        })?;
    let spec = svc.spec.unwrap_or_default();
    let (needed, feature) = match via {
        Via::Sidecar => (kvpn_proto::attach::ATTACH_PORT, "attach"),
        Via::Gateway => (kvpn_proto::attach::GATEWAY_PORT, "attach --via gateway"),
    };
    let has_port = spec
        .ports
        .as_deref()
        .unwrap_or_default()
        .iter()
        .any(|p| p.port == i32::from(needed));
    if !has_port {
        return Err(AttachError::ManagerTooOld {
            namespace: manager_namespace.to_owned(),
            port: needed,
            feature,
        }
        .into());
    }
    let cluster_ip = spec
        .cluster_ip
        .filter(|ip| !ip.is_empty() && ip != "None")
        .with_context(|| format!("Service {manager_namespace}/{MANAGER} has no ClusterIP — reinstall the manager with `kvpn install`"))?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), manager_namespace);
    let manager = deployments
        .get(MANAGER)
        .await
        .with_context(|| format!("cannot read Deployment {manager_namespace}/{MANAGER}"))?;
    let container = manager
        .spec
        .and_then(|s| s.template.spec)
        .and_then(|s| s.containers.into_iter().next())
        .with_context(|| format!("Deployment {manager_namespace}/{MANAGER} has no container — reinstall it with `kvpn install`"))?;
    let image = container
        .image
        .clone()
        .with_context(|| format!("Deployment {manager_namespace}/{MANAGER} names no image"))?;
    let version = client
        .apiserver_version()
        .await
        .context("cannot read the API server's version")?;
    if via == Via::Gateway {
        let args = container.args.clone().unwrap_or_default();
        let pool = args
            .iter()
            .position(|a| a == "--tunnel-pool")
            .and_then(|i| args.get(i + 1).cloned())
            .unwrap_or_else(|| "100.96.0.0/16".to_owned());
        let gw = GatewaySpec {
            image: image.clone(),
            pull_policy: container.image_pull_policy.clone(),
            manager_host: cluster_ip,
            pool,
        };
        let existing = render::container_names(&tpl, "initContainers");
        let method = WriteMethod::for_server(&version.major, &version.minor);
        let patched = match method {
            WriteMethod::Apply => {
                let pp = PatchParams::apply(render::FIELD_MANAGER);
                let body = render::gateway_body(w, namespace, &existing, &gw);
                api.patch(&w.name, &pp, &Patch::Apply(body)).await
            }
            WriteMethod::StrategicMerge => {
                let pp = PatchParams {
                    field_manager: Some(render::FIELD_MANAGER.to_owned()),
                    ..PatchParams::default()
                };
                let body = render::gateway_patch(&existing, &gw);
                api.patch(&w.name, &pp, &Patch::Strategic(body)).await
            }
        };
        patched.map_err(|e| {
            anyhow::Error::new(e).context(format!(
                "cannot add the {} init container to {w} in namespace {namespace} (field manager {})",
                render::GATEWAY_CONTAINER,
                render::FIELD_MANAGER
            ))
        })?;
        return Ok(Attached {
            via,
            shape: SidecarShape::Classic,
            method,
            why: format!(
                "none: init container {} routes {} to the manager's gateway and exits",
                render::GATEWAY_CONTAINER,
                gw.pool
            ),
            secret: String::new(),
            image,
        });
    }
    let secrets: Api<Secret> = Api::namespaced(client.clone(), manager_namespace);
    let tls = secrets.get(TLS_SECRET).await.with_context(|| {
        format!(
            "cannot read Secret {manager_namespace}/{TLS_SECRET} (the manager's CA and key; attach needs get on it)"
        )
    })?;
    let field = |k: &str| -> Result<Vec<u8>> {
        tls.data
            .as_ref()
            .and_then(|d| d.get(k))
            .map(|b| b.0.clone())
            .with_context(|| format!("Secret {manager_namespace}/{TLS_SECRET} has no {k} — reinstall the manager with `kvpn install`"))
    };
    let ca = String::from_utf8(field("ca.crt")?).context("ca.crt is not text")?;
    let attach_key = kvpn_proto::attach::attach_key(&field("tls.key")?);

    let (shape, why) = SidecarShape::for_server(&version.major, &version.minor);

    let tunnel = TunnelSpec {
        image: image.clone(),
        pull_policy: container.image_pull_policy,
        manager_host: cluster_ip,
        server_name: server_name(manager_namespace),
        secret_name: render::secret_name(w),
    };
    let pp = PatchParams::apply(render::FIELD_MANAGER);
    let secrets_here: Api<Secret> = Api::namespaced(client.clone(), namespace);
    secrets_here
        .patch(
            &tunnel.secret_name,
            &pp,
            &Patch::Apply(render::secret_body(w, namespace, &ca, &attach_key)),
        )
        .await
        .with_context(|| format!("cannot apply Secret {namespace}/{}", tunnel.secret_name))?;
    let list = match shape {
        SidecarShape::Classic => "containers",
        SidecarShape::Native => "initContainers",
    };
    let existing = render::container_names(&tpl, list);
    let method = WriteMethod::for_server(&version.major, &version.minor);
    let patched = match method {
        WriteMethod::Apply => {
            let body = render::attach_body(w, namespace, &existing, &tunnel, shape);
            api.patch(&w.name, &pp, &Patch::Apply(body)).await
        }
        WriteMethod::StrategicMerge => {
            let body = render::attach_patch(&existing, &tunnel, shape);
            let pp = PatchParams {
                field_manager: Some(render::FIELD_MANAGER.to_owned()),
                ..PatchParams::default()
            };
            api.patch(&w.name, &pp, &Patch::Strategic(body)).await
        }
    };
    if let Err(e) = patched {
        // Nothing half-done: the Secret goes again.
        let _ = secrets_here
            .delete(&tunnel.secret_name, &DeleteParams::default())
            .await;
        return Err(anyhow::Error::new(e).context(format!(
            "cannot add the tunnel container to {w} in namespace {namespace} (field manager {})",
            render::FIELD_MANAGER
        )));
    }
    Ok(Attached {
        via,
        shape,
        method,
        why,
        secret: tunnel.secret_name,
        image,
    })
}

/// Detach `w` in `namespace`: the fields attach added go, then its Secret.
pub async fn detach(client: &kube::Client, w: &WorkloadRef, namespace: &str) -> Result<()> {
    let api = workload_api(client, w.kind, namespace);
    let tpl = template(&api, w, namespace).await?;
    let secret = render::secret_name(w);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let has_secret = secrets
        .get_opt(&secret)
        .await
        .with_context(|| format!("cannot read Secret {namespace}/{secret}"))?
        .is_some();
    let attached = render::attached_via(&tpl).is_some();
    if !attached && !has_secret {
        return Err(AttachError::NotAttached {
            workload: w.clone(),
            namespace: namespace.to_owned(),
            container: render::CONTAINER,
            secret,
        }
        .into());
    }
    if attached {
        let version = client
            .apiserver_version()
            .await
            .context("cannot read the API server's version")?;
        let removed = match WriteMethod::for_server(&version.major, &version.minor) {
            WriteMethod::Apply => {
                let pp = PatchParams::apply(render::FIELD_MANAGER);
                api.patch(
                    &w.name,
                    &pp,
                    &Patch::Apply(render::detach_body(w, namespace)),
                )
                .await
            }
            WriteMethod::StrategicMerge => {
                let pp = PatchParams {
                    field_manager: Some(render::FIELD_MANAGER.to_owned()),
                    ..PatchParams::default()
                };
                api.patch(&w.name, &pp, &Patch::Strategic(render::detach_patch(&tpl)))
                    .await
            }
        };
        removed.with_context(|| {
            format!("cannot remove the tunnel container from {w} in namespace {namespace}")
        })?;
        let after = template(&api, w, namespace).await?;
        anyhow::ensure!(
            render::attached_via(&after).is_none(),
            "{w} in namespace {namespace} still has its {} or {} container after detach: another field manager owns it (it was not added by `kvpn attach`) — remove it with `kubectl edit`",
            render::CONTAINER,
            render::GATEWAY_CONTAINER
        );
    }
    if has_secret {
        secrets
            .delete(&secret, &DeleteParams::default())
            .await
            .with_context(|| format!("cannot delete Secret {namespace}/{secret}"))?;
    }
    Ok(())
}

/// One attached replica, as `kvpn attach --list` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Replica {
    pub namespace: String,
    pub pod: String,
    pub phase: String,
    /// From the manager's leases (ConfigMap), by the replica's client id.
    pub tunnel_ip: Option<String>,
}

/// The pods of `namespace` that run the tunnel container, with the tunnel IP
/// leased to each (the replica's client id is derived from the attach key and
/// its pod UID; the leases ConfigMap maps client ids to tunnel IPs).
pub async fn replicas(
    client: &kube::Client,
    namespace: &str,
    manager_namespace: &str,
) -> Result<Vec<Replica>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let list = pods
        .list(&ListParams::default())
        .await
        .with_context(|| format!("cannot list pods in namespace {namespace}"))?;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), manager_namespace);
    let key = secrets
        .get(TLS_SECRET)
        .await
        .ok()
        .and_then(|s| s.data)
        .and_then(|d| {
            d.get("tls.key")
                .map(|b| kvpn_proto::attach::attach_key(&b.0))
        });
    let now_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let leases: std::collections::HashMap<String, String> =
        crate::lease::live_leases(client, manager_namespace, now_s, None)
            .await
            .unwrap_or_default()
            .into_iter()
            .map(|l| (l.client_id, l.ip))
            .collect();
    let mut out = Vec::new();
    for p in list {
        let has = p.spec.as_ref().is_some_and(|s| {
            s.containers.iter().any(|c| c.name == render::CONTAINER)
                || s.init_containers
                    .as_ref()
                    .is_some_and(|l| l.iter().any(|c| c.name == render::CONTAINER))
        });
        if !has {
            continue;
        }
        let uid = p.metadata.uid.clone().unwrap_or_default();
        let tunnel_ip = key.as_ref().and_then(|k| {
            leases
                .get(&kvpn_proto::attach::replica_client_id(k, &uid))
                .cloned()
        });
        out.push(Replica {
            namespace: namespace.to_owned(),
            pod: p.metadata.name.clone().unwrap_or_default(),
            phase: p
                .status
                .and_then(|s| s.phase)
                .unwrap_or_else(|| "Unknown".into()),
            tunnel_ip,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn web() -> WorkloadRef {
        render::parse_workload("deploy/web").expect("parse")
    }

    /// Each refusal names the object, the cause and the fix.
    #[test]
    fn errors_name_the_object_the_cause_and_the_fix() {
        let cases = [
            (
                AttachError::NotFound {
                    workload: web(),
                    namespace: "shop".into(),
                    kind: "deployments",
                },
                [
                    "deployment/web",
                    "not found",
                    "kubectl get deployments -n shop",
                ],
            ),
            (
                AttachError::AlreadyAttached {
                    workload: web(),
                    namespace: "shop".into(),
                    container: render::CONTAINER,
                },
                [
                    "deployment/web",
                    "already attached",
                    "kvpn detach deployment/web -n shop",
                ],
            ),
            (
                AttachError::NotAttached {
                    workload: web(),
                    namespace: "shop".into(),
                    container: render::CONTAINER,
                    secret: "kvpn-attach-deploy-web".into(),
                },
                ["deployment/web", "not attached", "nothing to detach"],
            ),
            (
                AttachError::NoManager {
                    namespace: "kvpn-system".into(),
                },
                ["kvpn-system", "not found", "kvpn connect"],
            ),
            (
                AttachError::ManagerTooOld {
                    namespace: "kvpn-system".into(),
                    port: 10804,
                    feature: "attach",
                },
                ["too old", "10804", "kvpn install"],
            ),
        ];
        for (e, words) in cases {
            let text = e.to_string();
            for w in words {
                assert!(text.contains(w), "{w:?} missing in: {text}");
            }
        }
    }
}
