//! What the lab's restricted user `kvpn-user` may do: exactly what kvpn needs, so
//! an RBAC mistake in kvpn shows up in tests as a 403.
//!
//! | scope | API group | resources | verbs |
//! |---|---|---|---|
//! | namespace `kvpn-system` (Role `kvpn-user`) | core | serviceaccounts, secrets, configmaps, services, pods | create, patch, get, list, watch |
//! | namespace `kvpn-system` | rbac.authorization.k8s.io | roles, rolebindings | create, patch, get, list, watch |
//! | namespace `kvpn-system` | apps | deployments | create, patch, get, list, watch |
//! | namespace `kvpn-system` | core | pods/portforward | create, get (SPDY posts, websockets get) |
//! | namespace `kvpn-system` | core | configmaps, secrets | update (see below) |
//! | namespace `kvpn-system` | coordination.k8s.io | leases | list, create, update, delete (see below) |
//! | namespace `kvpn-system` | core, rbac, apps | the kinds above, only names `kvpn-manager`, `kvpn-manager-tls` | delete (`kvpn uninstall`) |
//! | cluster-wide (ClusterRole `kvpn-user-read`) | core | pods, services, endpoints | get, list, watch |
//! | cluster-wide | rbac.authorization.k8s.io | clusterroles, clusterrolebindings, only name `kvpn-manager-kvpn-system` | get, create, patch, delete |
//!
//! Why each addition beyond "create/patch/get/list/watch in `kvpn-system`":
//! - `update` on configmaps and secrets: the manager's own Role grants it `update` on
//!   its ConfigMap and Secret (resourceVersion-checked lease writes), and RBAC lets a
//!   user grant only what the user holds. kvpn itself never updates (it applies).
//! - leases (coordination.k8s.io): the manager keeps one Lease object per tunnel IP
//!   and its Role grants it exactly these verbs, which the user must hold to grant;
//!   `kvpn uninstall` lists and deletes them too (their names are per IP).
//! - `delete` by name: `kvpn uninstall` removes what kvpn created. The names are
//!   kvpn's fixed object names, so the user still cannot delete anything else.
//! - clusterroles/clusterrolebindings by name: the manager's cluster-wide read of
//!   pods, services and endpoints (route and DNS discovery in every namespace) is a
//!   ClusterRole bound to its ServiceAccount. kvpn creates them with server-side
//!   apply (a PATCH, so the apiserver knows the name when it checks `create`);
//!   binding needs no `bind` verb because the user holds the same reads.
//!
//! Not granted (on purpose, for now): update or delete of anything else,
//! namespaces, nodes, anything outside `kvpn-system` except the reads above.
//! Because RBAC prevents escalation, the Roles kvpn itself creates in
//! `kvpn-system` may only hold permissions from this list.
//!
//! [`objects`] builds the objects (pure); [`apply`] writes them with the admin
//! client (server-side apply, so it is idempotent).

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams};

use super::{Error, KVPN_NAMESPACE, RESTRICTED_USER};

/// The Role and ClusterRole names.
pub const ROLE: &str = "kvpn-user";
pub const CLUSTER_ROLE: &str = "kvpn-user-read";

const NAMESPACED_VERBS: &[&str] = &["create", "patch", "get", "list", "watch"];

/// The names of the objects kvpn installs in `kvpn-system` (the control crate's
/// `install::objects::{MANAGER, TLS_SECRET}`; its tests check they agree).
pub const MANAGER_OBJECT_NAMES: &[&str] = &["kvpn-manager", "kvpn-manager-tls"];

/// The manager's ClusterRole and ClusterRoleBinding name for `kvpn-system`
/// (`install::objects::cluster_role_name`).
pub const MANAGER_CLUSTER_ROLE: &str = "kvpn-manager-kvpn-system";

fn named(mut rule: PolicyRule, names: &[&str]) -> PolicyRule {
    rule.resource_names = Some(names.iter().map(|n| (*n).to_owned()).collect());
    rule
}

fn rule(group: &str, resources: &[&str], verbs: &[&str]) -> PolicyRule {
    PolicyRule {
        api_groups: Some(vec![group.to_owned()]),
        resources: Some(resources.iter().map(|r| (*r).to_owned()).collect()),
        verbs: verbs.iter().map(|v| (*v).to_owned()).collect(),
        ..Default::default()
    }
}

fn meta(name: &str, namespace: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        namespace: namespace.map(str::to_owned),
        labels: Some(
            [(
                "app.kubernetes.io/managed-by".to_owned(),
                "kvpn-lab".to_owned(),
            )]
            .into(),
        ),
        ..Default::default()
    }
}

fn user_subject() -> Subject {
    Subject {
        kind: "User".into(),
        api_group: Some("rbac.authorization.k8s.io".into()),
        name: RESTRICTED_USER.into(),
        namespace: None,
    }
}

/// The restricted user's objects.
#[derive(Debug, Clone)]
pub struct Objects {
    pub namespace: Namespace,
    pub role: Role,
    pub role_binding: RoleBinding,
    pub cluster_role: ClusterRole,
    pub cluster_role_binding: ClusterRoleBinding,
}

/// Builds the objects of the table above.
pub fn objects() -> Objects {
    Objects {
        namespace: Namespace {
            metadata: meta(KVPN_NAMESPACE, None),
            ..Default::default()
        },
        role: Role {
            metadata: meta(ROLE, Some(KVPN_NAMESPACE)),
            rules: Some(vec![
                rule(
                    "",
                    &[
                        "serviceaccounts",
                        "secrets",
                        "configmaps",
                        "services",
                        "pods",
                    ],
                    NAMESPACED_VERBS,
                ),
                rule(
                    "rbac.authorization.k8s.io",
                    &["roles", "rolebindings"],
                    NAMESPACED_VERBS,
                ),
                rule("apps", &["deployments"], NAMESPACED_VERBS),
                rule("", &["pods/portforward"], &["create", "get"]),
                rule("", &["configmaps", "secrets"], &["update"]),
                rule(
                    "coordination.k8s.io",
                    &["leases"],
                    &["list", "create", "update", "delete"],
                ),
                named(
                    rule(
                        "",
                        &["serviceaccounts", "secrets", "configmaps", "services"],
                        &["delete"],
                    ),
                    MANAGER_OBJECT_NAMES,
                ),
                named(
                    rule(
                        "rbac.authorization.k8s.io",
                        &["roles", "rolebindings"],
                        &["delete"],
                    ),
                    MANAGER_OBJECT_NAMES,
                ),
                named(
                    rule("apps", &["deployments"], &["delete"]),
                    MANAGER_OBJECT_NAMES,
                ),
            ]),
        },
        role_binding: RoleBinding {
            metadata: meta(ROLE, Some(KVPN_NAMESPACE)),
            role_ref: RoleRef {
                api_group: "rbac.authorization.k8s.io".into(),
                kind: "Role".into(),
                name: ROLE.into(),
            },
            subjects: Some(vec![user_subject()]),
        },
        cluster_role: ClusterRole {
            metadata: meta(CLUSTER_ROLE, None),
            rules: Some(vec![
                rule(
                    "",
                    &["pods", "services", "endpoints"],
                    &["get", "list", "watch"],
                ),
                named(
                    rule(
                        "rbac.authorization.k8s.io",
                        &["clusterroles", "clusterrolebindings"],
                        &["get", "create", "patch", "delete"],
                    ),
                    &[MANAGER_CLUSTER_ROLE],
                ),
            ]),
            aggregation_rule: None,
        },
        cluster_role_binding: ClusterRoleBinding {
            metadata: meta(CLUSTER_ROLE, None),
            role_ref: RoleRef {
                api_group: "rbac.authorization.k8s.io".into(),
                kind: "ClusterRole".into(),
                name: CLUSTER_ROLE.into(),
            },
            subjects: Some(vec![user_subject()]),
        },
    }
}

/// Applies [`objects`] with `admin` (server-side apply, field manager `kvpn-lab`).
pub async fn apply(admin: &kube::Client) -> Result<(), Error> {
    let o = objects();
    let pp = PatchParams::apply("kvpn-lab").force();
    Api::<Namespace>::all(admin.clone())
        .patch(KVPN_NAMESPACE, &pp, &Patch::Apply(&o.namespace))
        .await
        .map_err(Error::kube(format!("applying namespace {KVPN_NAMESPACE}")))?;
    Api::<Role>::namespaced(admin.clone(), KVPN_NAMESPACE)
        .patch(ROLE, &pp, &Patch::Apply(&o.role))
        .await
        .map_err(Error::kube(format!("applying Role {ROLE}")))?;
    Api::<RoleBinding>::namespaced(admin.clone(), KVPN_NAMESPACE)
        .patch(ROLE, &pp, &Patch::Apply(&o.role_binding))
        .await
        .map_err(Error::kube(format!("applying RoleBinding {ROLE}")))?;
    Api::<ClusterRole>::all(admin.clone())
        .patch(CLUSTER_ROLE, &pp, &Patch::Apply(&o.cluster_role))
        .await
        .map_err(Error::kube(format!("applying ClusterRole {CLUSTER_ROLE}")))?;
    Api::<ClusterRoleBinding>::all(admin.clone())
        .patch(CLUSTER_ROLE, &pp, &Patch::Apply(&o.cluster_role_binding))
        .await
        .map_err(Error::kube(format!(
            "applying ClusterRoleBinding {CLUSTER_ROLE}"
        )))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restricted_user_deletes_only_kvpn_objects_and_never_touches_nodes() {
        // Lease objects are the one exception to "delete by name": the manager
        // names them per tunnel IP; the rule covers coordination.k8s.io only.
        let o = objects();
        let rules = o
            .role
            .rules
            .iter()
            .flatten()
            .chain(o.cluster_role.rules.iter().flatten());
        for r in rules {
            assert!(!r.verbs.iter().any(|v| v == "*"), "{r:?}");
            let leases = r.resources.iter().flatten().any(|x| x == "leases");
            if r.verbs.iter().any(|v| v == "delete") && !leases {
                assert!(
                    r.resource_names.as_ref().is_some_and(|n| !n.is_empty()),
                    "delete only by name: {r:?}"
                );
            }
            if r.resources
                .iter()
                .flatten()
                .any(|x| x == "clusterroles" || x == "clusterrolebindings")
            {
                assert_eq!(
                    r.resource_names.as_deref(),
                    Some(&[MANAGER_CLUSTER_ROLE.to_owned()][..]),
                    "{r:?}"
                );
            }
            assert!(
                !r.resources
                    .iter()
                    .flatten()
                    .any(|x| x == "nodes" || x == "*"),
                "{r:?}"
            );
        }
        assert_eq!(
            o.role_binding
                .subjects
                .as_deref()
                .map(|s| s[0].name.as_str()),
            Some(RESTRICTED_USER)
        );
    }
}
