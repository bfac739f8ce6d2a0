//! The objects of the node agent of `--source-policy preserve`
//! (`kvpn-manager node-agent`, docs/source-policy.md): a DaemonSet from the
//! manager's image on every node, host network, CAP_NET_ADMIN only, keeping
//! the route for the tunnel pool to the manager pod; a ServiceAccount with a
//! Role that may only read the manager's pods and lease objects.
//!
//! Its own labels (`app.kubernetes.io/name: kvpn-node-agent`): the manager's
//! Service and the agent's own pod selector must never match its pods.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{DaemonSet, DaemonSetSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, PodSecurityContext, PodSpec, PodTemplateSpec, ResourceRequirements,
    SeccompProfile, SecurityContext, ServiceAccount, Toleration,
};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};

use super::objects::{
    ANNOTATION_VERSION, LABEL_MANAGED_BY, LABEL_NAME, LEASE_GROUP, MANAGED_BY, MANAGER, Spec,
    env_from_field, pull_secrets,
};

/// Name of the DaemonSet, its ServiceAccount, Role and RoleBinding.
pub const NODE_AGENT: &str = "kvpn-node-agent";

/// The tunnel pool the agent routes (the manager's default `--tunnel-pool`).
pub const POOL: &str = "100.96.0.0/16";

/// Label selector of everything this module writes.
pub fn selector() -> String {
    format!("{LABEL_NAME}={NODE_AGENT},{LABEL_MANAGED_BY}={MANAGED_BY}")
}

fn labels() -> BTreeMap<String, String> {
    [
        (LABEL_NAME.to_owned(), NODE_AGENT.to_owned()),
        (LABEL_MANAGED_BY.to_owned(), MANAGED_BY.to_owned()),
    ]
    .into()
}

fn meta(spec: &Spec) -> ObjectMeta {
    ObjectMeta {
        name: Some(NODE_AGENT.to_owned()),
        namespace: Some(spec.namespace.clone()),
        labels: Some(labels()),
        annotations: Some([(ANNOTATION_VERSION.to_owned(), spec.version.clone())].into()),
        ..Default::default()
    }
}

pub fn service_account(spec: &Spec) -> ServiceAccount {
    ServiceAccount {
        metadata: meta(spec),
        ..Default::default()
    }
}

/// Read the manager's pods (where it runs) and lease objects (which replica
/// holds which tunnel IP), in the manager's namespace only.
pub fn role(spec: &Spec) -> Role {
    Role {
        metadata: meta(spec),
        rules: Some(vec![
            PolicyRule {
                api_groups: Some(vec![String::new()]),
                resources: Some(vec!["pods".into()]),
                verbs: vec!["list".into()],
                ..Default::default()
            },
            PolicyRule {
                api_groups: Some(vec![LEASE_GROUP.into()]),
                resources: Some(vec!["leases".into()]),
                verbs: vec!["list".into()],
                ..Default::default()
            },
        ]),
    }
}

pub fn role_binding(spec: &Spec) -> RoleBinding {
    RoleBinding {
        metadata: meta(spec),
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "Role".into(),
            name: NODE_AGENT.into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: NODE_AGENT.into(),
            namespace: Some(spec.namespace.clone()),
            api_group: None,
        }]),
    }
}

/// The DaemonSet: host network (it routes in the node's namespace), uid 0
/// with every capability dropped but NET_ADMIN (rtnetlink route writes), no
/// privilege escalation, read-only root, tolerating every taint (every node
/// may carry a backend).
pub fn daemon_set(spec: &Spec) -> DaemonSet {
    let container = Container {
        name: "node-agent".into(),
        image: Some(spec.image.clone()),
        image_pull_policy: spec.image_pull_policy.clone(),
        args: Some(vec![
            "node-agent".into(),
            "--namespace".into(),
            spec.namespace.clone(),
            "--selector".into(),
            format!("{LABEL_NAME}={MANAGER}"),
            "--pool".into(),
            POOL.into(),
        ]),
        env: Some(vec![env_from_field("NODE_IP", "status.hostIP")]),
        resources: Some(ResourceRequirements {
            requests: Some(
                [
                    ("cpu".to_owned(), Quantity("5m".into())),
                    ("memory".to_owned(), Quantity("16Mi".into())),
                ]
                .into(),
            ),
            limits: Some([("memory".to_owned(), Quantity("64Mi".into()))].into()),
            ..Default::default()
        }),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            privileged: Some(false),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(false),
            run_as_user: Some(0),
            capabilities: Some(Capabilities {
                add: Some(vec!["NET_ADMIN".into()]),
                drop: Some(vec!["ALL".into()]),
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    DaemonSet {
        metadata: meta(spec),
        spec: Some(DaemonSetSpec {
            selector: LabelSelector {
                match_labels: Some([(LABEL_NAME.to_owned(), NODE_AGENT.to_owned())].into()),
                match_expressions: None,
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels()),
                    annotations: Some(
                        [(ANNOTATION_VERSION.to_owned(), spec.version.clone())].into(),
                    ),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    service_account_name: Some(NODE_AGENT.into()),
                    host_network: Some(true),
                    // The agent reaches the API server by the `kubernetes`
                    // Service's environment variables, no cluster DNS needed.
                    dns_policy: Some("ClusterFirstWithHostNet".into()),
                    // SIGTERM removes its routes; that takes milliseconds.
                    termination_grace_period_seconds: Some(10),
                    tolerations: Some(vec![Toleration {
                        operator: Some("Exists".into()),
                        ..Default::default()
                    }]),
                    security_context: Some(PodSecurityContext {
                        seccomp_profile: Some(SeccompProfile {
                            type_: "RuntimeDefault".into(),
                            localhost_profile: None,
                        }),
                        ..Default::default()
                    }),
                    image_pull_secrets: pull_secrets(spec),
                    containers: vec![container],
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::install::objects::SourcePolicy;
    use k8s_openapi::api::core::v1::LocalObjectReference;

    fn spec() -> Spec {
        Spec {
            namespace: "kvpn-system".into(),
            image: "ghcr.io/kvpn/manager:0.1.0".into(),
            version: "0.1.0".into(),
            source_policy: SourcePolicy::Preserve,
            image_pull_secrets: vec!["regcred".into()],
            image_pull_policy: Some("Never".into()),
            replicas: 1,
        }
    }

    #[test]
    fn the_agent_gets_net_admin_only_host_network_and_reads_only_pods_and_leases() {
        let ds = daemon_set(&spec());
        let pod = ds
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.clone())
            .expect("pod spec");
        assert_eq!(pod.host_network, Some(true));
        assert_eq!(pod.host_pid, None);
        assert_eq!(pod.host_ipc, None);
        let c = &pod.containers[0];
        let sc = c.security_context.clone().expect("security context");
        assert_eq!(sc.privileged, Some(false));
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        let caps = sc.capabilities.expect("capabilities");
        assert_eq!(caps.add, Some(vec!["NET_ADMIN".to_owned()]));
        assert_eq!(caps.drop, Some(vec!["ALL".to_owned()]));
        assert_eq!(c.image_pull_policy.as_deref(), Some("Never"));
        assert_eq!(
            pod.image_pull_secrets,
            Some(vec![LocalObjectReference {
                name: "regcred".into()
            }])
        );
        let args = c.args.clone().unwrap_or_default();
        assert_eq!(args[0], "node-agent");
        assert!(
            args.windows(2)
                .any(|w| w[0] == "--selector" && w[1] == "app.kubernetes.io/name=kvpn-manager")
        );
        // The agent's pods never match the manager's selector.
        let pod_labels = ds
            .spec
            .as_ref()
            .and_then(|s| s.template.metadata.clone())
            .and_then(|m| m.labels)
            .unwrap_or_default();
        assert_eq!(
            pod_labels.get(LABEL_NAME).map(String::as_str),
            Some(NODE_AGENT)
        );
        let rules = role(&spec()).rules.unwrap_or_default();
        for r in &rules {
            assert_eq!(r.verbs, vec!["list".to_owned()], "{r:?}");
        }
        let resources: Vec<String> = rules
            .iter()
            .flat_map(|r| r.resources.clone().unwrap_or_default())
            .collect();
        assert_eq!(resources, vec!["pods".to_owned(), "leases".to_owned()]);
    }
}
