//! The objects `kvpn attach` applies, as pure functions of what it read: the
//! workload reference, which sidecar shape the API server supports, the tunnel
//! container, the server-side-apply bodies of attach and detach, and the attach
//! Secret. No I/O; the shell is `super`.

use std::fmt;

use serde_json::{Value, json};

/// The field manager of every object and field `kvpn attach` applies: `kvpn
/// detach` removes exactly the fields this manager owns alone.
pub const FIELD_MANAGER: &str = "kvpn-attach";
/// The tunnel container's name in the pod template.
pub const CONTAINER: &str = "kvpn-tunnel";
/// The pod volume carrying the attach Secret.
pub const VOLUME: &str = "kvpn-attach";
/// Where the tunnel container mounts it.
pub const SECRET_MOUNT: &str = "/etc/kvpn/attach";
/// The TUN device in the pod.
pub const TUN: &str = "kvpn0";
/// The init container of gateway mode (`kvpn attach --via gateway`).
pub const GATEWAY_CONTAINER: &str = "kvpn-gateway";
/// Its VXLAN device in the pod.
pub const GATEWAY_DEVICE: &str = "kvpn-gw";
/// Seconds the postStart hook / startup probe waits for the tunnel.
pub const WAIT_S: u32 = 60;

/// The workload kinds `kvpn attach` takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkloadKind {
    Deployment,
    StatefulSet,
    DaemonSet,
}

impl WorkloadKind {
    /// The API kind.
    pub fn kind(self) -> &'static str {
        match self {
            WorkloadKind::Deployment => "Deployment",
            WorkloadKind::StatefulSet => "StatefulSet",
            WorkloadKind::DaemonSet => "DaemonSet",
        }
    }

    /// kubectl's short name (also in the attach Secret's name).
    pub fn short(self) -> &'static str {
        match self {
            WorkloadKind::Deployment => "deploy",
            WorkloadKind::StatefulSet => "sts",
            WorkloadKind::DaemonSet => "ds",
        }
    }

    /// The lowercase word for messages ("deployment").
    pub fn word(self) -> &'static str {
        match self {
            WorkloadKind::Deployment => "deployment",
            WorkloadKind::StatefulSet => "statefulset",
            WorkloadKind::DaemonSet => "daemonset",
        }
    }
}

/// `KIND/NAME` as `kvpn attach` takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkloadRef {
    pub kind: WorkloadKind,
    pub name: String,
}

impl fmt::Display for WorkloadRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.kind.word(), self.name)
    }
}

/// Parse `deploy/NAME` (also `deployment`, `deployments`, `sts`, `statefulset`,
/// `ds`, `daemonset`, any case in the kind), as clap's value parser.
pub fn parse_workload(s: &str) -> Result<WorkloadRef, String> {
    let Some((kind, name)) = s.split_once('/') else {
        return Err(format!(
            "{s:?} names no kind: give KIND/NAME, e.g. deploy/web (kinds: deploy, sts, ds)"
        ));
    };
    let kind = match kind.to_ascii_lowercase().as_str() {
        "deploy" | "deployment" | "deployments" => WorkloadKind::Deployment,
        "sts" | "statefulset" | "statefulsets" => WorkloadKind::StatefulSet,
        "ds" | "daemonset" | "daemonsets" => WorkloadKind::DaemonSet,
        other => {
            return Err(format!(
                "{other:?} is not a workload kind kvpn attaches to: use deploy, sts or ds (e.g. deploy/{name})"
            ));
        }
    };
    let valid = !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && !name.starts_with(['-', '.'])
        && !name.ends_with(['-', '.']);
    if !valid {
        return Err(format!(
            "{name:?} is not a Kubernetes object name (lowercase letters, digits, '-' and '.')"
        ));
    }
    Ok(WorkloadRef {
        kind,
        name: name.to_owned(),
    })
}

/// The sidecar shape for an API server version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SidecarShape {
    /// ≥ 1.29: a restartable init container (`restartPolicy: Always`) whose
    /// startup probe passes once the tunnel is up; the app containers start after it.
    Native,
    /// Older servers: the first container, with a postStart hook that blocks until
    /// the tunnel is up (the kubelet starts containers in order and runs each
    /// one's postStart hook before it starts the next).
    Classic,
}

impl SidecarShape {
    /// The shape for server `major.minor` (`minor` as the API server reports it,
    /// possibly with a `+` suffix), and why, for the output.
    pub fn for_server(major: &str, minor: &str) -> (Self, String) {
        let minor_n: Option<u32> = minor.trim_end_matches('+').parse().ok();
        let major_n: Option<u32> = major.parse().ok();
        match (major_n, minor_n) {
            (Some(1), Some(m)) if m >= 29 => (
                SidecarShape::Native,
                format!(
                    "native sidecar (restartable init container with a startup probe): the API server is v{major}.{minor}, and native sidecars exist from 1.29"
                ),
            ),
            (Some(ma), _) if ma > 1 => (
                SidecarShape::Native,
                format!(
                    "native sidecar (restartable init container with a startup probe): the API server is v{major}.{minor}"
                ),
            ),
            _ => (
                SidecarShape::Classic,
                format!(
                    "classic sidecar (first container, postStart hook that waits for the tunnel): the API server is v{major}.{minor}, older than 1.29, which brought native sidecars"
                ),
            ),
        }
    }
}

/// What the tunnel container needs to know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TunnelSpec {
    /// The manager's image (the installed manager Deployment's).
    pub image: String,
    /// The installed manager's pull policy, if it names one.
    pub pull_policy: Option<String>,
    /// The manager Service's ClusterIP.
    pub manager_host: String,
    /// The name the manager's certificate is verified against.
    pub server_name: String,
    /// The attach Secret in the workload's namespace.
    pub secret_name: String,
}

/// The attach Secret's name for `w`.
pub fn secret_name(w: &WorkloadRef) -> String {
    format!("kvpn-attach-{}-{}", w.kind.short(), w.name)
}

/// The tunnel container. Privileges: uid 0 with every capability dropped but
/// NET_ADMIN (the TUN device and its address in the pod's own network
/// namespace) and MKNOD (containerd's CRI gives containers no /dev/net/tun node,
/// though its device cgroup allows c 10:200; the container creates the node);
/// not privileged, no privilege escalation, read-only root filesystem, no host
/// namespace. Not uid 65532: containerd 1.6 sets no ambient capabilities, so a
/// non-root process loses the added ones at exec (docs/attach.md).
pub fn tunnel_container(spec: &TunnelSpec, shape: SidecarShape) -> Value {
    let wait = json!({"exec": {"command": [
        "/kvpn-manager", "tunnel-wait", "--tun", TUN, "--timeout-s", WAIT_S.to_string()
    ]}});
    let mut c = json!({
        "name": CONTAINER,
        "image": spec.image,
        "args": [
            "tunnel",
            "--manager-host", spec.manager_host,
            "--server-name", spec.server_name,
            "--secret-dir", SECRET_MOUNT,
            "--tun", TUN,
        ],
        "env": [{"name": "KVPN_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}],
        "volumeMounts": [{"name": VOLUME, "mountPath": SECRET_MOUNT, "readOnly": true}],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
        "securityContext": {
            "runAsUser": 0,
            "runAsNonRoot": false,
            "privileged": false,
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN", "MKNOD"]},
        },
    });
    if let Some(p) = &spec.pull_policy {
        c["imagePullPolicy"] = json!(p);
    }
    match shape {
        SidecarShape::Classic => {
            // Tunnel-wait's own bound: the hook fails (and the kubelet restarts the
            // container) rather than hang the pod's start forever.
            let wait_hook = wait.clone();
            c["lifecycle"] = json!({"postStart": wait_hook});
        }
        SidecarShape::Native => {
            c["restartPolicy"] = json!("Always");
            let mut once = wait.clone();
            once["exec"]["command"][5] = json!("1");
            c["startupProbe"] = json!({
                "exec": once["exec"],
                "periodSeconds": 1,
                "timeoutSeconds": 2,
                "failureThreshold": WAIT_S,
            });
        }
    }
    c
}

/// The server-side-apply body of `kvpn attach`: the tunnel container first in
/// `containers` (classic) or `initContainers` (native), then the names of the
/// containers already there (names only: the list's keys, so the apply fixes
/// the order without owning anything else of them), and the Secret volume.
pub fn attach_body(
    w: &WorkloadRef,
    namespace: &str,
    existing: &[String],
    spec: &TunnelSpec,
    shape: SidecarShape,
) -> Value {
    let mut list = vec![tunnel_container(spec, shape)];
    list.extend(existing.iter().map(|n| json!({"name": n})));
    let list_key = match shape {
        SidecarShape::Classic => "containers",
        SidecarShape::Native => "initContainers",
    };
    json!({
        "apiVersion": "apps/v1",
        "kind": w.kind.kind(),
        "metadata": {"name": w.name, "namespace": namespace},
        "spec": {"template": {"spec": {
            list_key: list,
            "volumes": [{"name": VOLUME, "secret": {"secretName": spec.secret_name, "defaultMode": 0o400}}],
        }}},
    })
}

/// How attach and detach write the pod template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteMethod {
    /// Server-side apply under [`FIELD_MANAGER`]; detach applies an empty body.
    /// From 1.23: structured-merge-diff 4.2 keeps the order of the applied list,
    /// so the tunnel container lands first.
    Apply,
    /// A strategic merge patch with `$setElementOrder` (field manager
    /// [`FIELD_MANAGER`]); detach deletes the container and the volume by name.
    /// Before 1.23, server-side apply keeps the stored list's order and appends
    /// new items: the tunnel container would come *last*, after the app
    /// containers, and start after them.
    StrategicMerge,
}

impl WriteMethod {
    /// The method for server `major.minor`.
    pub fn for_server(major: &str, minor: &str) -> Self {
        let minor_n: u32 = minor.trim_end_matches('+').parse().unwrap_or(0);
        match major.parse::<u32>() {
            Ok(1) if minor_n >= 23 => WriteMethod::Apply,
            Ok(m) if m > 1 => WriteMethod::Apply,
            _ => WriteMethod::StrategicMerge,
        }
    }
}

/// The strategic-merge-patch body of `kvpn attach` for servers before 1.23: the
/// tunnel container and the volume, with `$setElementOrder` putting the tunnel
/// container first and keeping the others in their order.
pub fn attach_patch(existing: &[String], spec: &TunnelSpec, shape: SidecarShape) -> Value {
    let list_key = match shape {
        SidecarShape::Classic => "containers",
        SidecarShape::Native => "initContainers",
    };
    let mut order = vec![json!({"name": CONTAINER})];
    order.extend(existing.iter().map(|n| json!({"name": n})));
    json!({"spec": {"template": {"spec": {
        format!("$setElementOrder/{list_key}"): order,
        list_key: [tunnel_container(spec, shape)],
        "volumes": [{"name": VOLUME, "secret": {"secretName": spec.secret_name, "defaultMode": 0o400}}],
    }}}})
}

/// How a workload is attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Via {
    /// Each replica its own tunnel (a sidecar, its own lease and session).
    Sidecar,
    /// The manager as egress gateway: one translated source for all replicas.
    Gateway,
}

/// What the gateway's init container needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewaySpec {
    /// The manager's image (it carries `kvpn-manager gateway-route`).
    pub image: String,
    pub pull_policy: Option<String>,
    /// The manager Service's ClusterIP: the VXLAN remote.
    pub manager_host: String,
    /// The developers' tunnel range (the manager's --tunnel-pool).
    pub pool: String,
}

/// The init container of gateway mode: makes the VXLAN device towards the
/// manager Service, the next hop and the pool's route, and exits ("kernel
/// state only"). NET_ADMIN only; the app containers are not touched.
pub fn gateway_container(spec: &GatewaySpec) -> Value {
    let mut c = json!({
        "name": GATEWAY_CONTAINER,
        "image": spec.image,
        "args": [
            "gateway-route",
            "--manager-host", spec.manager_host,
            "--gateway-port", kvpn_proto::attach::GATEWAY_PORT.to_string(),
            "--pool", spec.pool,
            "--device", GATEWAY_DEVICE,
        ],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
        "securityContext": {
            "runAsUser": 0,
            "runAsNonRoot": false,
            "privileged": false,
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN"]},
        },
    });
    if let Some(p) = &spec.pull_policy {
        c["imagePullPolicy"] = json!(p);
    }
    c
}

/// The strategic-merge-patch body of `kvpn attach --via gateway` (servers
/// before 1.23): the init container first, the others in their order.
pub fn gateway_patch(existing_init: &[String], spec: &GatewaySpec) -> Value {
    let mut order = vec![json!({"name": GATEWAY_CONTAINER})];
    order.extend(existing_init.iter().map(|n| json!({"name": n})));
    json!({"spec": {"template": {"spec": {
        "$setElementOrder/initContainers": order,
        "initContainers": [gateway_container(spec)],
    }}}})
}

/// The server-side-apply body of `kvpn attach --via gateway` (≥ 1.23): the
/// init container first, then the existing init containers by name only.
pub fn gateway_body(
    w: &WorkloadRef,
    namespace: &str,
    existing_init: &[String],
    spec: &GatewaySpec,
) -> Value {
    let mut list = vec![gateway_container(spec)];
    list.extend(existing_init.iter().map(|n| json!({"name": n})));
    json!({
        "apiVersion": "apps/v1",
        "kind": w.kind.kind(),
        "metadata": {"name": w.name, "namespace": namespace},
        "spec": {"template": {"spec": {"initContainers": list}}},
    })
}

/// How `template` is attached, if it is.
pub fn attached_via(template: &Value) -> Option<Via> {
    if is_attached(template) {
        Some(Via::Sidecar)
    } else if container_names(template, "initContainers")
        .iter()
        .any(|n| n == GATEWAY_CONTAINER)
    {
        Some(Via::Gateway)
    } else {
        None
    }
}

/// The strategic-merge-patch body of `kvpn detach` for servers before 1.23:
/// delete the tunnel container (from either list), the gateway's init
/// container and the volume by name.
pub fn detach_patch(template: &Value) -> Value {
    let mut spec = serde_json::Map::new();
    for list in ["containers", "initContainers"] {
        let names = container_names(template, list);
        let ours: Vec<Value> = [CONTAINER, GATEWAY_CONTAINER]
            .iter()
            .filter(|c| names.iter().any(|n| n == *c))
            .map(|c| json!({"name": c, "$patch": "delete"}))
            .collect();
        if !ours.is_empty() {
            spec.insert(list.to_owned(), Value::Array(ours));
        }
    }
    let has_volume = template["spec"]["volumes"]
        .as_array()
        .is_some_and(|l| l.iter().any(|v| v["name"] == VOLUME));
    if has_volume {
        spec.insert(
            "volumes".to_owned(),
            json!([{"name": VOLUME, "$patch": "delete"}]),
        );
    }
    json!({"spec": {"template": {"spec": spec}}})
}

/// The server-side-apply body of `kvpn detach`: no fields, so every field only
/// [`FIELD_MANAGER`] owned (the tunnel container, the volume) goes.
pub fn detach_body(w: &WorkloadRef, namespace: &str) -> Value {
    json!({
        "apiVersion": "apps/v1",
        "kind": w.kind.kind(),
        "metadata": {"name": w.name, "namespace": namespace},
    })
}

/// The attach Secret: the manager's CA and the attach key.
pub fn secret_body(w: &WorkloadRef, namespace: &str, ca_pem: &str, attach_key: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": secret_name(w),
            "namespace": namespace,
            "labels": {
                "app.kubernetes.io/managed-by": "kvpn",
                "kvpn.dev/attached-to": format!("{}.{}", w.kind.short(), w.name),
            },
        },
        "type": "Opaque",
        "stringData": {"ca.crt": ca_pem, "attach.key": attach_key},
    })
}

/// Whether a pod template (`spec.template` JSON) has the tunnel container.
pub fn is_attached(template: &Value) -> bool {
    ["containers", "initContainers"].iter().any(|k| {
        template["spec"][k]
            .as_array()
            .is_some_and(|l| l.iter().any(|c| c["name"] == CONTAINER))
    })
}

/// The names of a template's containers (`containers` or `initContainers`).
pub fn container_names(template: &Value, list: &str) -> Vec<String> {
    template["spec"][list]
        .as_array()
        .map(|l| {
            l.iter()
                .filter_map(|c| c["name"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> TunnelSpec {
        TunnelSpec {
            image: "localhost/kvpn/manager:0.1.0".into(),
            pull_policy: Some("IfNotPresent".into()),
            manager_host: "10.96.0.20".into(),
            server_name: "kvpn-manager.kvpn-system.svc".into(),
            secret_name: "kvpn-attach-deploy-web".into(),
        }
    }

    fn web() -> WorkloadRef {
        parse_workload("deploy/web").expect("parse")
    }

    #[test]
    fn parses_the_three_kinds_and_refuses_others() {
        assert_eq!(web().kind, WorkloadKind::Deployment);
        assert_eq!(
            parse_workload("statefulset/db").expect("sts").kind,
            WorkloadKind::StatefulSet
        );
        assert_eq!(
            parse_workload("DS/agent").expect("ds").kind,
            WorkloadKind::DaemonSet
        );
        let e = parse_workload("pod/x").expect_err("pod");
        assert!(e.contains("deploy, sts or ds"), "{e}");
        let e = parse_workload("web").expect_err("no kind");
        assert!(e.contains("KIND/NAME"), "{e}");
        assert!(parse_workload("deploy/Web").is_err());
        assert!(parse_workload("deploy/").is_err());
    }

    #[test]
    fn shape_is_native_from_1_29_and_classic_before() {
        assert_eq!(SidecarShape::for_server("1", "20").0, SidecarShape::Classic);
        assert_eq!(
            SidecarShape::for_server("1", "28+").0,
            SidecarShape::Classic
        );
        assert_eq!(SidecarShape::for_server("1", "29").0, SidecarShape::Native);
        assert_eq!(SidecarShape::for_server("1", "33+").0, SidecarShape::Native);
        let (_, why) = SidecarShape::for_server("1", "20");
        assert!(why.contains("v1.20") && why.contains("1.29"), "{why}");
    }

    #[test]
    fn classic_body_puts_the_tunnel_first_with_a_blocking_post_start_hook() {
        let b = attach_body(
            &web(),
            "apps",
            &["app".into()],
            &spec(),
            SidecarShape::Classic,
        );
        let cs = b["spec"]["template"]["spec"]["containers"]
            .as_array()
            .expect("containers");
        assert_eq!(cs.len(), 2);
        assert_eq!(cs[0]["name"], CONTAINER);
        assert_eq!(
            cs[1],
            json!({"name": "app"}),
            "the app container by name only"
        );
        assert!(b["spec"]["template"]["spec"]["initContainers"].is_null());
        let hook = &cs[0]["lifecycle"]["postStart"]["exec"]["command"];
        assert_eq!(hook[0], "/kvpn-manager");
        assert_eq!(hook[1], "tunnel-wait");
        assert!(cs[0]["restartPolicy"].is_null());
        assert!(cs[0]["startupProbe"].is_null());
        assert_eq!(b["kind"], "Deployment");
        assert_eq!(
            b["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"],
            "kvpn-attach-deploy-web"
        );
    }

    #[test]
    fn native_body_is_a_restartable_init_container_with_a_startup_probe() {
        let b = attach_body(
            &web(),
            "apps",
            &["setup".into()],
            &spec(),
            SidecarShape::Native,
        );
        let tspec = &b["spec"]["template"]["spec"];
        assert!(
            tspec["containers"].is_null(),
            "app containers untouched: {b:#}"
        );
        let init = tspec["initContainers"].as_array().expect("initContainers");
        assert_eq!(init[0]["name"], CONTAINER);
        assert_eq!(init[0]["restartPolicy"], "Always");
        assert_eq!(init[1], json!({"name": "setup"}));
        let probe = &init[0]["startupProbe"];
        assert_eq!(probe["exec"]["command"][1], "tunnel-wait");
        assert_eq!(probe["exec"]["command"][5], "1", "each probe waits 1 s");
        assert_eq!(probe["periodSeconds"], 1);
        assert_eq!(probe["failureThreshold"], WAIT_S);
        assert!(init[0]["lifecycle"].is_null());
    }

    #[test]
    fn tunnel_container_has_net_admin_and_mknod_only_and_no_privilege() {
        for shape in [SidecarShape::Classic, SidecarShape::Native] {
            let c = tunnel_container(&spec(), shape);
            let sc = &c["securityContext"];
            assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
            assert_eq!(sc["capabilities"]["add"], json!(["NET_ADMIN", "MKNOD"]));
            assert_eq!(sc["privileged"], false);
            assert_eq!(sc["allowPrivilegeEscalation"], false);
            assert_eq!(sc["readOnlyRootFilesystem"], true);
            assert_eq!(c["image"], "localhost/kvpn/manager:0.1.0");
            assert_eq!(c["args"][0], "tunnel");
            assert_eq!(
                c["env"][0]["valueFrom"]["fieldRef"]["fieldPath"],
                "metadata.uid"
            );
        }
    }

    #[test]
    fn write_method_is_apply_from_1_23() {
        assert_eq!(
            WriteMethod::for_server("1", "20"),
            WriteMethod::StrategicMerge
        );
        assert_eq!(
            WriteMethod::for_server("1", "22+"),
            WriteMethod::StrategicMerge
        );
        assert_eq!(WriteMethod::for_server("1", "23"), WriteMethod::Apply);
        assert_eq!(WriteMethod::for_server("1", "30"), WriteMethod::Apply);
    }

    #[test]
    fn attach_patch_orders_the_tunnel_first_and_detach_patch_deletes_by_name() {
        let p = attach_patch(
            &["app".into(), "log".into()],
            &spec(),
            SidecarShape::Classic,
        );
        let t = &p["spec"]["template"]["spec"];
        assert_eq!(
            t["$setElementOrder/containers"],
            json!([{"name": CONTAINER}, {"name": "app"}, {"name": "log"}])
        );
        assert_eq!(t["containers"].as_array().map(Vec::len), Some(1));
        assert_eq!(t["containers"][0]["name"], CONTAINER);
        let attached = json!({"spec": {
            "containers": [{"name": CONTAINER}, {"name": "app"}],
            "volumes": [{"name": VOLUME}],
        }});
        let d = detach_patch(&attached);
        assert_eq!(
            d["spec"]["template"]["spec"]["containers"],
            json!([{"name": CONTAINER, "$patch": "delete"}])
        );
        assert_eq!(
            d["spec"]["template"]["spec"]["volumes"],
            json!([{"name": VOLUME, "$patch": "delete"}])
        );
        assert!(d["spec"]["template"]["spec"]["initContainers"].is_null());
    }

    #[test]
    fn detach_body_owns_no_field() {
        let b = detach_body(&web(), "apps");
        assert!(b.get("spec").is_none(), "{b:#}");
        assert_eq!(b["metadata"]["name"], "web");
    }

    #[test]
    fn is_attached_looks_at_both_lists() {
        assert!(!is_attached(
            &json!({"spec": {"containers": [{"name": "app"}]}})
        ));
        assert!(is_attached(
            &json!({"spec": {"containers": [{"name": CONTAINER}]}})
        ));
        assert!(is_attached(
            &json!({"spec": {"initContainers": [{"name": CONTAINER}]}})
        ));
    }

    fn gw() -> GatewaySpec {
        GatewaySpec {
            image: "localhost/kvpn/manager:0.1.0".into(),
            pull_policy: Some("IfNotPresent".into()),
            manager_host: "10.96.0.20".into(),
            pool: "100.96.0.0/16".into(),
        }
    }

    /// The gateway's init container: NET_ADMIN only (no MKNOD: no TUN device),
    /// not privileged, no volume, no probe or hook, and it only routes.
    #[test]
    fn gateway_init_container_has_net_admin_only_and_only_routes() {
        let c = gateway_container(&gw());
        assert_eq!(c["name"], GATEWAY_CONTAINER);
        let sc = &c["securityContext"];
        assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
        assert_eq!(sc["capabilities"]["add"], json!(["NET_ADMIN"]));
        assert_eq!(sc["privileged"], false);
        assert_eq!(sc["allowPrivilegeEscalation"], false);
        assert_eq!(sc["readOnlyRootFilesystem"], true);
        assert_eq!(c["imagePullPolicy"], "IfNotPresent");
        assert_eq!(
            c["args"],
            json!([
                "gateway-route",
                "--manager-host",
                "10.96.0.20",
                "--gateway-port",
                "10805",
                "--pool",
                "100.96.0.0/16",
                "--device",
                GATEWAY_DEVICE
            ])
        );
        for absent in [
            "volumeMounts",
            "lifecycle",
            "startupProbe",
            "restartPolicy",
            "env",
        ] {
            assert!(c.get(absent).is_none(), "{absent} in {c:#}");
        }
    }

    /// Attach puts the init container first and keeps the others' order; the
    /// apply body names the others by name only; detach deletes it by name.
    #[test]
    fn gateway_patch_body_and_detach() {
        let existing = vec!["migrate".to_owned()];
        let p = gateway_patch(&existing, &gw());
        let spec = &p["spec"]["template"]["spec"];
        assert_eq!(
            spec["$setElementOrder/initContainers"],
            json!([{"name": GATEWAY_CONTAINER}, {"name": "migrate"}])
        );
        assert_eq!(spec["initContainers"][0]["name"], GATEWAY_CONTAINER);
        assert!(spec.get("containers").is_none() && spec.get("volumes").is_none());
        let b = gateway_body(&web(), "shop", &existing, &gw());
        assert_eq!(b["kind"], "Deployment");
        assert_eq!(
            b["spec"]["template"]["spec"]["initContainers"][1],
            json!({"name": "migrate"})
        );
        let tpl = json!({"spec": {
            "initContainers": [gateway_container(&gw()), {"name": "migrate"}],
            "containers": [{"name": "app"}],
        }});
        assert_eq!(attached_via(&tpl), Some(Via::Gateway));
        assert_eq!(
            detach_patch(&tpl),
            json!({"spec": {"template": {"spec": {
                "initContainers": [{"name": GATEWAY_CONTAINER, "$patch": "delete"}]
            }}}})
        );
        assert_eq!(
            attached_via(&json!({"spec": {"containers": [{"name": "app"}]}})),
            None
        );
        assert_eq!(
            attached_via(&json!({"spec": {"containers": [{"name": CONTAINER}]}})),
            Some(Via::Sidecar)
        );
    }
}
