//! End-to-end: a Service created after `kvpn connect` is reachable from the laptop
//! without reconnecting (issue [kube-connect], tests: "a new Service created after
//! connect becomes reachable without reconnecting"). Its ClusterIP comes from the
//! service CIDR that connect detected and routed, so no new route is needed; the
//! same session (id, TUN device, tunnel IP) carries it.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, PostParams};
use kvpn_tests::kube_lab::KubeFixture;

#[test]
fn a_service_created_after_connect_is_reachable_without_reconnecting() {
    let f = KubeFixture::new();
    f.connect_restricted();
    let before = f.session();
    let id = before["id"].as_str().expect("session id").to_string();

    // A new Service over the lab's default/web pods, on a port no other Service uses.
    let svc: Service = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "late-web", "namespace": "default"},
        "spec": {
            "selector": {"app": "web"},
            "ports": [{"name": "http", "port": 8181, "targetPort": 8080, "protocol": "TCP"}]
        }
    }))
    .expect("service object");
    let api: Api<Service> = Api::namespaced(f.admin(), "default");
    let created = f
        .block_on(api.create(&PostParams::default(), &svc))
        .unwrap_or_else(|e| panic!("create Service late-web: {e}"));
    let ip: IpAddr = created
        .spec
        .and_then(|s| s.cluster_ip)
        .expect("a ClusterIP")
        .parse()
        .expect("ClusterIP parses");
    let addr = SocketAddr::new(ip, 8181);

    // kube-proxy (stand-in) programs the new ClusterIP within ~0.3 s; allow slack.
    let (took, page) = f.wait_http(addr, Instant::now(), Duration::from_secs(15));
    assert!(page.pod.starts_with("web-"), "answered by {page:?}");
    eprintln!("new Service {addr} reachable {took:?} after creation");

    let after = f.session();
    assert_eq!(
        after["id"], before["id"],
        "the same session carries the new Service"
    );
    assert_eq!(after["tun_name"], before["tun_name"]);
    assert_eq!(after["tunnel_ip"], before["tunnel_ip"]);
    assert_eq!(
        f.sessions().len(),
        1,
        "no second session was created for {id}"
    );
}
