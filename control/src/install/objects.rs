//! The traffic manager's Kubernetes objects, built as typed values (pure: no I/O).
//!
//! Every object carries the labels [`LABEL_NAME`]`=kvpn-manager` and
//! [`LABEL_MANAGED_BY`]`=kvpn` and the owner annotation [`ANNOTATION_VERSION`] with
//! the kvpn version that wrote it. The pod template additionally carries
//! [`ANNOTATION_TEMPLATE_HASH`], a digest of the rest of the template, so the client
//! can tell pods of the current template from older ones during a rollout without
//! reading ReplicaSets (which a restricted user may not list).
//!
//! Names (all in the manager's namespace unless noted):
//!
//! | kind | name |
//! |---|---|
//! | ServiceAccount, Role, RoleBinding, Service, Deployment, ConfigMap | `kvpn-manager` |
//! | Secret (`kubernetes.io/tls`) | `kvpn-manager-tls` |
//! | ClusterRole, ClusterRoleBinding (cluster-scoped) | `kvpn-manager-<namespace>` |

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMap, Container, ContainerPort, EnvVar, EnvVarSource, HostPathVolumeSource,
    LocalObjectReference, Namespace, ObjectFieldSelector, PodSecurityContext, PodSpec,
    PodTemplateSpec, Probe, ResourceRequirements, SeccompProfile, Secret, SecretVolumeSource,
    SecurityContext, Service, ServiceAccount, ServicePort, ServiceSpec, Sysctl, TCPSocketAction,
    Volume, VolumeMount,
};
use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use sha2::{Digest, Sha256};

/// Name of the ServiceAccount, Role, RoleBinding, Service, Deployment and ConfigMap.
pub const MANAGER: &str = "kvpn-manager";
/// Name of the TLS Secret.
pub const TLS_SECRET: &str = "kvpn-manager-tls";
/// The container's name in the pod.
pub const CONTAINER: &str = "manager";
/// `app.kubernetes.io/name`, value [`MANAGER`].
pub const LABEL_NAME: &str = "app.kubernetes.io/name";
/// `app.kubernetes.io/managed-by`, value [`MANAGED_BY`].
pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
pub const MANAGED_BY: &str = "kvpn";
/// The kvpn version that wrote an object (owner annotation).
pub const ANNOTATION_VERSION: &str = "kvpn.dev/version";
/// Digest of the pod template (without this annotation), on the pod template.
pub const ANNOTATION_TEMPLATE_HASH: &str = "kvpn.dev/template-hash";
/// Digest of the TLS Secret's CA, on the pod template (a new certificate rolls the pod).
pub const ANNOTATION_TLS_FINGERPRINT: &str = "kvpn.dev/tls-fingerprint";
/// Data channel port (framed packets, TLS).
pub const DATA_PORT: u16 = 10801;
/// Control gRPC port (leases, routes, DNS).
pub const GRPC_PORT: u16 = 10802;
/// The manager's attach port (gRPC `Lease` over TLS for attached pods).
pub use kvpn_proto::attach::{ATTACH_PORT, GATEWAY_PORT};
/// Metrics port (`GET /metrics`, pod loopback; docs/trust-model.md).
pub const METRICS_PORT: u16 = 10803;
/// Where the TLS Secret is mounted in the manager container.
pub const TLS_MOUNT: &str = "/etc/kvpn/tls";
/// Field manager of every server-side apply kvpn does.
pub const FIELD_MANAGER: &str = "kvpn";

/// Label selector matching everything kvpn installs for the manager.
pub fn selector() -> String {
    format!("{LABEL_NAME}={MANAGER},{LABEL_MANAGED_BY}={MANAGED_BY}")
}

/// Name of the cluster-scoped ClusterRole and ClusterRoleBinding of the manager in
/// `namespace` (one pair per manager namespace, so two installs never share one).
pub fn cluster_role_name(namespace: &str) -> String {
    format!("{MANAGER}-{namespace}")
}

/// The DNS names the serving certificate covers, shortest first.
pub fn service_dns_names(namespace: &str) -> Vec<String> {
    vec![
        MANAGER.to_owned(),
        format!("{MANAGER}.{namespace}"),
        format!("{MANAGER}.{namespace}.svc"),
        format!("{MANAGER}.{namespace}.svc.cluster.local"),
    ]
}

/// The name a client verifies the manager's certificate against.
pub fn server_name(namespace: &str) -> String {
    format!("{MANAGER}.{namespace}.svc")
}

/// What the objects depend on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spec {
    pub namespace: String,
    pub image: String,
    /// kvpn version written into [`ANNOTATION_VERSION`].
    pub version: String,
    /// The manager's `--source-policy`.
    pub source_policy: SourcePolicy,
    /// `--image-pull-secret` (names of Secrets in the manager namespace).
    pub image_pull_secrets: Vec<String>,
    /// `--image-pull-policy` (`Always`, `IfNotPresent`, `Never`); None leaves the
    /// Kubernetes default (IfNotPresent for a tagged image, Always for `:latest`).
    pub image_pull_policy: Option<String>,
    /// The Deployment's `spec.replicas` (1..=[`MAX_REPLICAS`]).
    pub replicas: i32,
}

/// Most manager replicas `--replicas` accepts. Replicas share one lease store
/// (a LIST of every lease object per grant), so each one adds API server load;
/// 20 replicas of the 500 sessions each is 10 000 laptops, far beyond
/// one cluster's developers. More: scale the Deployment yourself.
pub const MAX_REPLICAS: i32 = 20;

/// The numeric user and group the manager runs as: the image's `USER` (images/
/// Containerfile, `cargo xtask image`), stated again in the pod spec so the
/// "restricted" Pod Security Standard's runAsNonRoot can be checked by the kubelet
/// without reading the image.
pub const MANAGER_UID: i64 = 65532;

/// The uid (and gid) the manager runs as under `policy`: [`MANAGER_UID`] for snat,
/// which needs no capability. `preserve` and `ebpf-snat` need NET_ADMIN (and BPF):
/// Kubernetes adds capabilities to a container's bounding and permitted sets, but
/// a non-root process gets no effective capabilities without ambient ones, which
/// Kubernetes does not set; so those policies run as uid 0 with every other
/// capability dropped (never privileged, no host namespaces). Measured with runc:
/// uid 65532 with `--cap-add CAP_NET_ADMIN` shows `CapEff: 0`.
pub fn manager_uid(policy: SourcePolicy) -> i64 {
    match policy {
        SourcePolicy::Snat => MANAGER_UID,
        SourcePolicy::Preserve | SourcePolicy::EbpfSnat => 0,
    }
}

/// The TUN clone device. Container runtimes give a container a fresh /dev without
/// it (the device cgroup allows it, the node is just not there), so the policies
/// that create a TUN device mount the node's as a hostPath CharDevice: no MKNOD
/// capability, no privileged container.
pub const TUN_DEVICE: &str = "/dev/net/tun";
const TUN_VOLUME: &str = "dev-net-tun";

/// Whether `policy` creates a TUN device in the pod (the pool TUN of preserve and
/// ebpf-snat).
pub fn needs_tun(policy: SourcePolicy) -> bool {
    policy != SourcePolicy::Snat
}

/// `net.ipv4.ping_group_range` for the manager pod: ICMP echo through unprivileged
/// datagram sockets (the manager's ping path) for every group. A namespaced sysctl
/// in the Kubernetes "safe" set since 1.18, so every kubelet allows it; it changes
/// only the pod's own network namespace.
pub const PING_GROUP_RANGE: (&str, &str) = ("net.ipv4.ping_group_range", "0 2147483647");

/// The image pull policies Kubernetes knows.
pub const PULL_POLICIES: [&str; 3] = ["Always", "IfNotPresent", "Never"];

/// Whose address the cluster's backends see (`kvpn-manager --source-policy`; the
/// docs/source-policy.md); defined once, in kvpn-proto.
pub use kvpn_proto::SourcePolicy;

/// The policy a manager container runs with, from its args (`snat` when absent
/// or unknown).
pub fn source_policy_of_args(args: &[String]) -> SourcePolicy {
    let value = args
        .iter()
        .position(|a| a == "--source-policy")
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
        .or_else(|| args.iter().find_map(|a| a.strip_prefix("--source-policy=")));
    value.and_then(|v| v.parse().ok()).unwrap_or_default()
}

fn labels() -> BTreeMap<String, String> {
    [
        (LABEL_NAME.to_owned(), MANAGER.to_owned()),
        (LABEL_MANAGED_BY.to_owned(), MANAGED_BY.to_owned()),
    ]
    .into()
}

fn meta(spec: &Spec, name: &str, namespaced: bool) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        namespace: namespaced.then(|| spec.namespace.clone()),
        labels: Some(labels()),
        annotations: Some([(ANNOTATION_VERSION.to_owned(), spec.version.clone())].into()),
        ..Default::default()
    }
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

fn rule(resources: &[&str], verbs: &[&str], names: Option<&[&str]>) -> PolicyRule {
    rule_in("", resources, verbs, names)
}

fn rule_in(group: &str, resources: &[&str], verbs: &[&str], names: Option<&[&str]>) -> PolicyRule {
    PolicyRule {
        api_groups: Some(vec![group.to_owned()]),
        resources: Some(strings(resources)),
        verbs: strings(verbs),
        resource_names: names.map(strings),
        ..Default::default()
    }
}

/// The namespace, created only when it does not exist yet.
pub fn namespace(spec: &Spec) -> Namespace {
    Namespace {
        metadata: meta(spec, &spec.namespace, false),
        ..Default::default()
    }
}

pub fn service_account(spec: &Spec) -> ServiceAccount {
    ServiceAccount {
        metadata: meta(spec, MANAGER, true),
        ..Default::default()
    }
}

/// The manager's namespaced permissions: watch the workloads it routes to, read
/// and write its own ConfigMap (detected CIDRs, and the leases of older managers
/// it migrates; `update` for resourceVersion-checked writes) and Secret (by name
/// only), and its lease objects (coordination.k8s.io Leases, one per tunnel IP:
/// `list` to read them, `create` to grant, `update` to renew, `delete` to
/// expire; names are per IP, so not by name; no `get`, `watch` or `patch`).
pub fn role(spec: &Spec) -> Role {
    Role {
        metadata: meta(spec, MANAGER, true),
        rules: Some(vec![
            rule(
                &["pods", "services", "endpoints"],
                &["get", "list", "watch"],
                None,
            ),
            rule(
                &["configmaps"],
                &["get", "update", "patch"],
                Some(&[MANAGER]),
            ),
            rule(
                &["secrets"],
                &["get", "update", "patch"],
                Some(&[TLS_SECRET]),
            ),
            rule_in(LEASE_GROUP, &["leases"], &LEASE_VERBS, None),
        ]),
    }
}

/// API group of the manager's lease objects.
pub const LEASE_GROUP: &str = "coordination.k8s.io";

/// What the manager does with its lease objects (see [`role`]).
pub const LEASE_VERBS: [&str; 4] = ["list", "create", "update", "delete"];

fn manager_subject(spec: &Spec) -> Subject {
    Subject {
        kind: "ServiceAccount".into(),
        name: MANAGER.into(),
        namespace: Some(spec.namespace.clone()),
        api_group: None,
    }
}

pub fn role_binding(spec: &Spec) -> RoleBinding {
    RoleBinding {
        metadata: meta(spec, MANAGER, true),
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "Role".into(),
            name: MANAGER.into(),
        },
        subjects: Some(vec![manager_subject(spec)]),
    }
}

/// Cluster-wide reads for the route and DNS watch (pods, services, endpoints in
/// every namespace). Not nodes: RBAC lets a user grant only what it holds, and
/// users who may not read nodes (the lab's restricted user) could not install
/// the role. The manager reads node podCIDRs only where someone granted it
/// separately; otherwise its pod CIDRs come from pod IPs.
pub fn cluster_role(spec: &Spec) -> ClusterRole {
    ClusterRole {
        metadata: meta(spec, &cluster_role_name(&spec.namespace), false),
        rules: Some(vec![rule(
            &["pods", "services", "endpoints"],
            &["get", "list", "watch"],
            None,
        )]),
        aggregation_rule: None,
    }
}

pub fn cluster_role_binding(spec: &Spec) -> ClusterRoleBinding {
    let name = cluster_role_name(&spec.namespace);
    ClusterRoleBinding {
        metadata: meta(spec, &name, false),
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "ClusterRole".into(),
            name,
        },
        subjects: Some(vec![manager_subject(spec)]),
    }
}

/// Empty at install: the manager fills it (leases, detected CIDRs). Server-side
/// apply only ever claims the metadata, so re-applying never wipes the data.
pub fn config_map(spec: &Spec) -> ConfigMap {
    ConfigMap {
        metadata: meta(spec, MANAGER, true),
        ..Default::default()
    }
}

fn service_port(name: &str, port: u16) -> ServicePort {
    ServicePort {
        name: Some(name.to_owned()),
        port: i32::from(port),
        target_port: Some(IntOrString::Int(i32::from(port))),
        protocol: Some("TCP".into()),
        ..Default::default()
    }
}

pub fn service(spec: &Spec) -> Service {
    Service {
        metadata: meta(spec, MANAGER, true),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            selector: Some([(LABEL_NAME.to_owned(), MANAGER.to_owned())].into()),
            ports: Some(vec![
                service_port("data", DATA_PORT),
                service_port("grpc", GRPC_PORT),
                service_port("attach", ATTACH_PORT),
                ServicePort {
                    protocol: Some("UDP".into()),
                    ..service_port("gateway", GATEWAY_PORT)
                },
            ]),
            ..Default::default()
        }),
        status: None,
    }
}

/// The TLS Secret: `tls.crt`/`tls.key` (serving certificate and key, PEM) and
/// `ca.crt` (the CA the client verifies against).
pub fn tls_secret(spec: &Spec, ca_pem: &str, cert_pem: &str, key_pem: &str) -> Secret {
    Secret {
        metadata: meta(spec, TLS_SECRET, true),
        type_: Some("kubernetes.io/tls".into()),
        data: Some(
            [
                ("ca.crt", ca_pem),
                ("tls.crt", cert_pem),
                ("tls.key", key_pem),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), ByteString(v.as_bytes().to_vec())))
            .collect(),
        ),
        ..Default::default()
    }
}

fn env(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: Some(value.to_owned()),
        value_from: None,
    }
}

/// An environment variable from the downward API (`metadata.name`,
/// `status.hostIP`, …).
pub(super) fn env_from_field(name: &str, field_path: &str) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                api_version: Some("v1".into()),
                field_path: field_path.to_owned(),
            }),
            ..Default::default()
        }),
    }
}

/// The pod's `imagePullSecrets` from `--image-pull-secret` (None without any).
pub(super) fn pull_secrets(spec: &Spec) -> Option<Vec<LocalObjectReference>> {
    (!spec.image_pull_secrets.is_empty()).then(|| {
        spec.image_pull_secrets
            .iter()
            .map(|name| LocalObjectReference { name: name.clone() })
            .collect()
    })
}

/// The pod template without [`ANNOTATION_TEMPLATE_HASH`]. `tls_fingerprint` (a digest
/// of the Secret's CA) is an annotation so that a new certificate rolls the pod:
/// kubelets refresh mounted Secrets only after a delay, and the lab's stand-in never.
fn pod_template(spec: &Spec, tls_fingerprint: &str) -> PodTemplateSpec {
    let port = |name: &str, p: u16| ContainerPort {
        name: Some(name.to_owned()),
        container_port: i32::from(p),
        protocol: Some("TCP".into()),
        ..Default::default()
    };
    let container = Container {
        name: CONTAINER.into(),
        image: Some(spec.image.clone()),
        // --leases: tunnel IPs from the manager's Lease RPC (gRPC on the pod's
        // loopback, reached through pods/portforward), hellos need the token.
        args: Some({
            let mut args = vec![
                "--listen".into(),
                format!("0.0.0.0:{DATA_PORT}"),
                "--leases".into(),
                "--grpc-listen".into(),
                format!("127.0.0.1:{GRPC_PORT}"),
                // GET /metrics (refusals of docs/trust-model.md), also loopback only.
                "--metrics-listen".into(),
                format!("127.0.0.1:{METRICS_PORT}"),
                // Lease for attached pods' tunnel containers, through the
                // Service: TLS and the attach key (docs/attach.md).
                "--attach-listen".into(),
                format!("0.0.0.0:{ATTACH_PORT}"),
                // Egress gateway of `kvpn attach --via gateway` (VXLAN over
                // UDP through the Service; docs/tunnel-ownership.md).
                "--gateway-listen".into(),
                format!("0.0.0.0:{GATEWAY_PORT}"),
            ];
            // Only when not the default, so `snat` installs keep their template hash.
            if spec.source_policy != SourcePolicy::Snat {
                args.push("--source-policy".into());
                args.push(spec.source_policy.as_str().into());
            }
            args
        }),
        ports: Some(vec![
            port("data", DATA_PORT),
            port("grpc", GRPC_PORT),
            port("metrics", METRICS_PORT),
            port("attach", ATTACH_PORT),
            ContainerPort {
                protocol: Some("UDP".into()),
                ..port("gateway", GATEWAY_PORT)
            },
        ]),
        env: Some(vec![
            env("KVPN_TLS_CERT", &format!("{TLS_MOUNT}/tls.crt")),
            env("KVPN_TLS_KEY", &format!("{TLS_MOUNT}/tls.key")),
            // The replica's name, written as the holder of the lease objects it writes.
            env_from_field("KVPN_POD_NAME", "metadata.name"),
            env_from_field("KVPN_NAMESPACE", "metadata.namespace"),
        ]),
        volume_mounts: Some({
            let mut mounts = vec![VolumeMount {
                name: "tls".into(),
                mount_path: TLS_MOUNT.into(),
                read_only: Some(true),
                ..Default::default()
            }];
            if needs_tun(spec.source_policy) {
                mounts.push(VolumeMount {
                    name: TUN_VOLUME.into(),
                    mount_path: TUN_DEVICE.into(),
                    ..Default::default()
                });
            }
            mounts
        }),
        readiness_probe: Some(Probe {
            tcp_socket: Some(TCPSocketAction {
                port: IntOrString::Int(i32::from(DATA_PORT)),
                host: None,
            }),
            // A 1 s period makes the pod ready about a second after the manager
            // listens; the probe is a bare TCP connect, cheap for the kubelet.
            period_seconds: Some(1),
            failure_threshold: Some(3),
            ..Default::default()
        }),
        resources: Some(ResourceRequirements {
            requests: Some(
                [
                    ("cpu".to_owned(), Quantity("100m".into())),
                    ("memory".to_owned(), Quantity("64Mi".into())),
                ]
                .into(),
            ),
            ..Default::default()
        }),
        // SNAT mode needs no capability: the manager dials with ordinary sockets and
        // uses unprivileged ICMP echo sockets. Preserve creates a TUN device, routes
        // and an address (NET_ADMIN) and announces the stable gateway by ARP
        // (NET_RAW). ebpf-snat creates the same TUN device and route (NET_ADMIN),
        // loads its TC programs and maps (BPF) and attaches them to eth0
        // (NET_ADMIN); NET_RAW is for `kvpn diagnose source`'s capture of the pod's
        // egress. No PERFMON: the programs pass the verifier without it (measured by
        // kvpn-manager's readonly_proc_sys::each_capability_is_needed). Neither policy
        // writes /proc/sys (read-only under a runtime): the manager turns IPv4
        // forwarding on per interface over rtnetlink. Never privileged.
        image_pull_policy: spec.image_pull_policy.clone(),
        // The "restricted" Pod Security Standard in snat mode (non-root, no privilege
        // escalation, every capability dropped, RuntimeDefault seccomp on the pod);
        // the manager writes nothing to its root filesystem (its TLS material is a
        // read-only Secret mount, its logs go to stderr).
        security_context: Some(SecurityContext {
            privileged: Some(false),
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(spec.source_policy == SourcePolicy::Snat),
            run_as_user: Some(manager_uid(spec.source_policy)),
            run_as_group: Some(manager_uid(spec.source_policy)),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                add: match spec.source_policy {
                    SourcePolicy::Snat => None,
                    SourcePolicy::Preserve => Some(vec!["NET_ADMIN".into(), "NET_RAW".into()]),
                    SourcePolicy::EbpfSnat => {
                        Some(vec!["BPF".into(), "NET_ADMIN".into(), "NET_RAW".into()])
                    }
                },
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(labels()),
            annotations: Some(
                [
                    (ANNOTATION_VERSION.to_owned(), spec.version.clone()),
                    (
                        ANNOTATION_TLS_FINGERPRINT.to_owned(),
                        tls_fingerprint.to_owned(),
                    ),
                ]
                .into(),
            ),
            ..Default::default()
        }),
        spec: Some(PodSpec {
            service_account_name: Some(MANAGER.into()),
            // The manager reads its ConfigMap and watches pods and services.
            automount_service_account_token: Some(true),
            // The manager stops within a second of SIGTERM; a short grace keeps
            // upgrades and uninstall quick.
            termination_grace_period_seconds: Some(10),
            security_context: Some(PodSecurityContext {
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".into(),
                    localhost_profile: None,
                }),
                run_as_non_root: Some(spec.source_policy == SourcePolicy::Snat),
                run_as_user: Some(manager_uid(spec.source_policy)),
                run_as_group: Some(manager_uid(spec.source_policy)),
                // The Secret volume's files get this group, so the non-root manager
                // can read its key (mode 0440).
                fs_group: Some(MANAGER_UID),
                sysctls: Some(vec![Sysctl {
                    name: PING_GROUP_RANGE.0.into(),
                    value: PING_GROUP_RANGE.1.into(),
                }]),
                ..Default::default()
            }),
            image_pull_secrets: pull_secrets(spec),
            containers: vec![container],
            volumes: Some({
                let mut volumes = vec![Volume {
                    name: "tls".into(),
                    secret: Some(SecretVolumeSource {
                        secret_name: Some(TLS_SECRET.into()),
                        default_mode: Some(0o440),
                        ..Default::default()
                    }),
                    ..Default::default()
                }];
                if needs_tun(spec.source_policy) {
                    volumes.push(Volume {
                        name: TUN_VOLUME.into(),
                        host_path: Some(HostPathVolumeSource {
                            path: TUN_DEVICE.into(),
                            type_: Some("CharDevice".into()),
                        }),
                        ..Default::default()
                    });
                }
                volumes
            }),
            ..Default::default()
        }),
    }
}

/// Hex sha256 prefix (16 hex digits) of `bytes`.
pub fn digest(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    d.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// The Deployment, with [`ANNOTATION_TEMPLATE_HASH`] set on its pod template.
/// `ca_pem` is the Secret's CA (see [`pod_template`] for why it matters).
pub fn deployment(spec: &Spec, ca_pem: &str) -> Deployment {
    let mut template = pod_template(spec, &digest(ca_pem.as_bytes()));
    // Serialising k8s-openapi types cannot fail (string keys, no custom serialisers
    // that error); an empty digest would only cost an extra rollout.
    let hash = serde_json::to_vec(&template)
        .map(|b| digest(&b))
        .unwrap_or_default();
    if let Some(annotations) = template
        .metadata
        .as_mut()
        .and_then(|m| m.annotations.as_mut())
    {
        annotations.insert(ANNOTATION_TEMPLATE_HASH.to_owned(), hash);
    }
    Deployment {
        metadata: meta(spec, MANAGER, true),
        spec: Some(DeploymentSpec {
            replicas: Some(spec.replicas),
            selector: LabelSelector {
                match_labels: Some([(LABEL_NAME.to_owned(), MANAGER.to_owned())].into()),
                match_expressions: None,
            },
            template,
            ..Default::default()
        }),
        status: None,
    }
}

/// The template hash of a Deployment (ours or one read from the cluster).
pub fn template_hash(d: &Deployment) -> Option<&str> {
    d.spec
        .as_ref()?
        .template
        .metadata
        .as_ref()?
        .annotations
        .as_ref()?
        .get(ANNOTATION_TEMPLATE_HASH)
        .map(String::as_str)
}

/// The owner annotation's version of an object's metadata.
pub fn version_of(meta: &ObjectMeta) -> Option<&str> {
    meta.annotations
        .as_ref()?
        .get(ANNOTATION_VERSION)
        .map(String::as_str)
}

/// Order of two kvpn versions (`0.1.0`, `v0.2.0-dev`): numeric dot-separated
/// components, a pre-release suffix ignored. None when either does not parse.
pub fn compare_versions(a: &str, b: &str) -> Option<std::cmp::Ordering> {
    fn parse(v: &str) -> Option<Vec<u64>> {
        let v = v.strip_prefix('v').unwrap_or(v);
        let core = v.split(['-', '+']).next()?;
        core.split('.').map(|p| p.parse().ok()).collect()
    }
    let (a, b) = (parse(a)?, parse(b)?);
    Some(a.cmp(&b))
}

#[cfg(test)]
mod tests {
    use std::cmp::Ordering;

    use super::*;

    fn spec() -> Spec {
        Spec {
            namespace: "kvpn-system".into(),
            image: "localhost/kvpn/manager:0.1.0".into(),
            version: "0.1.0".into(),
            source_policy: SourcePolicy::Snat,
            image_pull_secrets: Vec::new(),
            image_pull_policy: None,
            replicas: 1,
        }
    }

    #[test]
    fn each_policy_gets_its_flag_and_only_its_capabilities() {
        for (policy, caps) in [
            (SourcePolicy::Snat, None),
            (SourcePolicy::Preserve, Some(vec!["NET_ADMIN", "NET_RAW"])),
            (
                SourcePolicy::EbpfSnat,
                Some(vec!["BPF", "NET_ADMIN", "NET_RAW"]),
            ),
        ] {
            let d = deployment(
                &Spec {
                    source_policy: policy,
                    ..spec()
                },
                "CA",
            );
            let c = &d.spec.expect("spec").template.spec.expect("pod").containers[0];
            let args = c.args.clone().unwrap_or_default();
            assert_eq!(source_policy_of_args(&args), policy, "{args:?}");
            let added = c
                .security_context
                .as_ref()
                .and_then(|s| s.capabilities.as_ref())
                .and_then(|c| c.add.clone());
            assert_eq!(
                added,
                caps.map(|v| v.into_iter().map(String::from).collect::<Vec<_>>()),
                "{policy}"
            );
        }
    }

    #[test]
    fn versions_compare_numerically() {
        assert_eq!(compare_versions("0.1.0", "0.1.0"), Some(Ordering::Equal));
        assert_eq!(compare_versions("0.9.0", "0.10.0"), Some(Ordering::Less));
        assert_eq!(
            compare_versions("v1.0.0", "0.99.1"),
            Some(Ordering::Greater)
        );
        assert_eq!(
            compare_versions("0.2.0-dev", "0.2.0"),
            Some(Ordering::Equal)
        );
        assert_eq!(compare_versions("latest", "0.2.0"), None);
    }

    #[test]
    fn template_hash_follows_image_version_and_certificate() {
        let base = deployment(&spec(), "CA1");
        let h = template_hash(&base).expect("hash").to_owned();
        assert_eq!(h.len(), 16);
        assert_eq!(template_hash(&deployment(&spec(), "CA1")), Some(h.as_str()));
        let mut other = spec();
        other.image = "registry.example/kvpn/manager:0.1.0".into();
        assert_ne!(template_hash(&deployment(&other, "CA1")), Some(h.as_str()));
        let mut older = spec();
        older.version = "0.0.9".into();
        assert_ne!(template_hash(&deployment(&older, "CA1")), Some(h.as_str()));
        assert_ne!(template_hash(&deployment(&spec(), "CA2")), Some(h.as_str()));
    }

    /// Every control of the "restricted" Pod Security Standard (Kubernetes docs,
    /// pod-security-standards, Restricted) holds for the snat manager, and its ICMP
    /// comes from the safe namespaced sysctl, not from a privilege.
    #[test]
    fn snat_manager_meets_the_restricted_pod_security_standard() {
        let d = deployment(&spec(), "CA");
        let pod = d.spec.expect("spec").template.spec.expect("pod spec");
        assert_eq!(pod.host_network, None);
        assert_eq!(pod.host_pid, None);
        assert_eq!(pod.host_ipc, None);
        let psc = pod.security_context.as_ref().expect("pod security context");
        assert_eq!(psc.run_as_non_root, Some(true));
        assert_eq!(psc.run_as_user, Some(65532));
        assert_eq!(psc.fs_group, Some(65532));
        assert_eq!(
            psc.seccomp_profile.as_ref().map(|p| p.type_.as_str()),
            Some("RuntimeDefault")
        );
        let sysctls = psc.sysctls.as_deref().expect("sysctls");
        assert_eq!(sysctls.len(), 1);
        assert_eq!(sysctls[0].name, "net.ipv4.ping_group_range");
        for v in pod.volumes.as_deref().unwrap_or_default() {
            assert!(v.host_path.is_none(), "no hostPath volumes: {v:?}");
        }
        let c = &pod.containers[0];
        let sc = c
            .security_context
            .as_ref()
            .expect("container security context");
        assert_eq!(sc.privileged, Some(false));
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        assert_eq!(sc.run_as_non_root, Some(true));
        let caps = sc.capabilities.as_ref().expect("capabilities");
        assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_owned()][..]));
        assert_eq!(caps.add, None);
        assert!(c.ports.iter().flatten().all(|p| p.host_port.is_none()));
        assert_eq!(c.image_pull_policy, None);
        assert_eq!(pod.image_pull_secrets, None);
    }

    /// preserve and ebpf-snat: uid 0 (added capabilities are effective only for
    /// root without ambient capabilities) with only their named capabilities,
    /// never privileged, and the node's TUN clone device.
    #[test]
    fn capability_policies_run_as_root_with_named_capabilities_and_the_tun_device() {
        for policy in [SourcePolicy::Preserve, SourcePolicy::EbpfSnat] {
            let mut s = spec();
            s.source_policy = policy;
            let pod = deployment(&s, "CA")
                .spec
                .expect("spec")
                .template
                .spec
                .expect("pod");
            let c = &pod.containers[0];
            let sc = c.security_context.as_ref().expect("security context");
            assert_eq!(sc.run_as_user, Some(0), "{policy:?}");
            assert_eq!(sc.run_as_non_root, Some(false), "{policy:?}");
            assert_eq!(sc.privileged, Some(false), "{policy:?}");
            assert_eq!(sc.allow_privilege_escalation, Some(false), "{policy:?}");
            assert_eq!(sc.read_only_root_filesystem, Some(true), "{policy:?}");
            let tun = pod
                .volumes
                .iter()
                .flatten()
                .find_map(|v| v.host_path.as_ref())
                .expect("hostPath /dev/net/tun");
            assert_eq!(tun.path, "/dev/net/tun");
            assert_eq!(tun.type_.as_deref(), Some("CharDevice"));
            assert!(
                c.volume_mounts
                    .iter()
                    .flatten()
                    .any(|m| m.mount_path == "/dev/net/tun"),
                "{policy:?}"
            );
            assert_eq!(pod.host_network, None);
        }
    }

    #[test]
    fn pull_secrets_and_policy_reach_the_pod_spec() {
        let mut s = spec();
        s.image_pull_secrets = vec!["regcred".into(), "other".into()];
        s.image_pull_policy = Some("Always".into());
        let pod = deployment(&s, "CA")
            .spec
            .expect("spec")
            .template
            .spec
            .expect("pod spec");
        let names: Vec<_> = pod
            .image_pull_secrets
            .iter()
            .flatten()
            .map(|r| r.name.clone())
            .collect();
        assert_eq!(names, ["regcred", "other"]);
        assert_eq!(
            pod.containers[0].image_pull_policy.as_deref(),
            Some("Always")
        );
    }

    #[test]
    fn deployment_is_unprivileged_with_probe_and_requests() {
        let d = deployment(&spec(), "CA");
        let ds = d.spec.expect("spec");
        assert_eq!(ds.replicas, Some(1));
        let pod = ds.template.spec.expect("pod spec");
        let c = &pod.containers[0];
        let sc = c.security_context.as_ref().expect("security context");
        assert_eq!(sc.privileged, Some(false));
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        let caps = sc.capabilities.as_ref().expect("caps");
        assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_owned()][..]));
        assert_eq!(caps.add, None);
        let probe = c
            .readiness_probe
            .as_ref()
            .and_then(|p| p.tcp_socket.as_ref());
        assert_eq!(probe.map(|t| &t.port), Some(&IntOrString::Int(10801)));
        let req = c
            .resources
            .as_ref()
            .and_then(|r| r.requests.as_ref())
            .expect("requests");
        assert_eq!(req.get("cpu").map(|q| q.0.as_str()), Some("100m"));
        assert_eq!(req.get("memory").map(|q| q.0.as_str()), Some("64Mi"));
        assert_eq!(
            c.args.as_deref(),
            Some(
                &[
                    "--listen".to_owned(),
                    "0.0.0.0:10801".to_owned(),
                    "--leases".to_owned(),
                    "--grpc-listen".to_owned(),
                    "127.0.0.1:10802".to_owned(),
                    "--metrics-listen".to_owned(),
                    "127.0.0.1:10803".to_owned(),
                    "--attach-listen".to_owned(),
                    "0.0.0.0:10804".to_owned(),
                    "--gateway-listen".to_owned(),
                    "0.0.0.0:10805".to_owned(),
                ][..]
            )
        );
        // The selector must match the template, or the apiserver refuses it.
        let sel = ds.selector.match_labels.expect("selector");
        let tl = ds.template.metadata.and_then(|m| m.labels).expect("labels");
        assert!(sel.iter().all(|(k, v)| tl.get(k) == Some(v)));
    }

    #[test]
    fn role_grants_own_configmap_and_secret_by_name_only() {
        let r = role(&spec());
        let rules = r.rules.expect("rules");
        for rule in &rules {
            let res = rule.resources.as_deref().unwrap_or_default();
            if res.iter().any(|r| r == "configmaps" || r == "secrets") {
                assert!(
                    rule.resource_names.as_ref().is_some_and(|n| n.len() == 1),
                    "{rule:?}"
                );
            }
            if res == ["leases"] {
                // Exactly the lease verbs, in exactly coordination.k8s.io.
                assert_eq!(
                    rule.api_groups.as_deref(),
                    Some(&[LEASE_GROUP.to_owned()][..])
                );
                assert_eq!(rule.verbs, LEASE_VERBS.map(str::to_owned));
                continue;
            }
            assert!(
                !rule
                    .verbs
                    .iter()
                    .any(|v| v == "*" || v == "delete" || v == "create")
            );
        }
        assert_eq!(
            rules
                .iter()
                .filter(|r| r
                    .resources
                    .as_deref()
                    .is_some_and(|x| x.iter().any(|x| x == "leases")))
                .count(),
            1,
            "one rule names leases"
        );
    }
}
