//! Leases end to end on the Kubernetes lab (tr-11, [kube-connect] item 4): the
//! traffic manager pod stores leases in its ConfigMap (in-cluster API access
//! with its service account), `kvpn connect` gets its tunnel IP from `Lease`,
//! and a reconnecting laptop gets its old IP back.
//!
//! Missing: two laptop netns on one lab pinging each other (the lab has one
//! laptop netns); laptop-to-laptop is covered in process by
//! manager/tests/leases.rs.

use std::net::SocketAddr;
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use kvpn_lab::{WEB_CLUSTER_IP, WEB_SERVICE_PORT};
use kvpn_tests::kube_lab::{KubeFixture, MANAGER_NAMESPACE};

fn web() -> SocketAddr {
    SocketAddr::from((WEB_CLUSTER_IP, WEB_SERVICE_PORT))
}

fn stored_leases(f: &KubeFixture) -> serde_json::Value {
    let api: Api<ConfigMap> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    let cm = f
        .block_on(api.get("kvpn-manager"))
        .unwrap_or_else(|e| panic!("get ConfigMap kvpn-manager: {e}"));
    let text = cm
        .data
        .and_then(|d| d.get("leases.json").cloned())
        .unwrap_or_else(|| panic!("ConfigMap kvpn-manager has no leases.json"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("leases.json: {e}: {text}"))
}

#[test]
fn leased_tunnel_ip_is_stored_in_the_configmap_and_comes_back_on_reconnect() {
    let f = KubeFixture::new();
    let out = f.connect_restricted();
    assert!(out.contains("Leasing a tunnel IP"), "{out}");
    f.wait_state("connected", Duration::from_secs(15));
    let ip = f.session()["tunnel_ip"]
        .as_str()
        .unwrap_or_else(|| panic!("no tunnel IP"))
        .to_owned();
    assert!(ip.starts_with("100.96."), "{ip}");
    assert!(
        f.laptop_routes()
            .iter()
            .any(|r| r.starts_with("100.96.0.0/16")),
        "tunnel pool routed into the TUN: {:?}",
        f.laptop_routes()
    );
    // Traffic flows, so the hello's token was accepted.
    f.wait_http(web(), std::time::Instant::now(), Duration::from_secs(10));

    let leases = stored_leases(&f);
    let mine: Vec<_> = leases
        .as_array()
        .unwrap_or_else(|| panic!("a list: {leases}"))
        .iter()
        .filter(|l| l["ip"] == ip.as_str())
        .collect();
    assert_eq!(mine.len(), 1, "the ConfigMap holds the lease: {leases}");
    let token = mine[0]["token"].as_str().unwrap_or_default().to_owned();
    assert_eq!(token.len(), 64);

    f.kvpn_ok(&["disconnect", "--all"]);
    f.connect_restricted();
    f.wait_state("connected", Duration::from_secs(15));
    assert_eq!(
        f.session()["tunnel_ip"],
        ip.as_str(),
        "same client id, same IP"
    );
    f.wait_http(web(), std::time::Instant::now(), Duration::from_secs(10));
    let again = stored_leases(&f);
    assert_eq!(
        again.as_array().map(Vec::len),
        Some(1),
        "one lease, reused: {again}"
    );
    assert_eq!(
        again[0]["token"],
        token.as_str(),
        "the live lease keeps its token"
    );
}
