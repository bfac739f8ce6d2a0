//! End-to-end: the route and DNS discovery stream (issue [kube-connect] item 6).
//!
//! - After `kvpn connect`, the session's routes come from the traffic manager's
//!   route watch: `status` says "watch" and shows the lab's cluster DNS
//!   (10.96.0.10, cluster.local, the search list of the client's namespace); a
//!   Service created afterwards shows up in the session's Service list; a pod
//!   with an IP outside every CIDR the session routes (a pod on a second Node
//!   with podCIDR 10.244.77.0/24, which connect never saw) gets its pod CIDR
//!   routed through the same TUN device and classified by the eBPF program
//!   without reconnecting, and the route goes when the pod goes; after the
//!   manager pod is replaced, the agent's watch follows the new one.
//! - Without the manager's RBAC for the watch (its ClusterRole exists but grants
//!   nothing), `status` says "cidr-only" with the reason, and the ClusterIPs of
//!   the connect-time service CIDR still work.
//!
//! The second Node has no kubelet: the admin client creates the pod bound to it
//! and writes its status (pod IP) the way a kubelet would. The manager cannot
//! read nodes in the lab (the restricted user may not grant it), so the pod CIDR
//! comes from the pod IP (/24 around it).

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod, Service};
use k8s_openapi::api::rbac::v1::ClusterRole;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kvpn_lab::LAPTOP;
use kvpn_tests::kube_lab::{KVPN_VERSION, KubeFixture, MANAGER_NAMESPACE, pod_name};

/// The pod CIDR of the second Node: outside the lab node's 10.244.1.0/24 that
/// connect detects from pod IPs.
const FAR_POD_CIDR: &str = "10.244.77.0/24";
const FAR_POD_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 77, 5);

/// Polls `check` on the only session every 50 ms until it gives `Some`; panics
/// with the session and diagnostics after `within`.
fn wait_session<T>(
    f: &KubeFixture,
    what: &str,
    within: Duration,
    check: impl Fn(&serde_json::Value) -> Option<T>,
) -> (T, Duration) {
    let t0 = Instant::now();
    loop {
        let s = f.session();
        if let Some(v) = check(&s) {
            return (v, t0.elapsed());
        }
        assert!(
            t0.elapsed() < within,
            "{what} not within {within:?}: {s:#}\n{}",
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn watched_route(s: &serde_json::Value, cidr: &str) -> Option<serde_json::Value> {
    s["routes"]
        .as_array()?
        .iter()
        .find(|r| r["cidr"] == cidr && r["watched"] == true)
        .cloned()
}

fn pod_packets(s: &serde_json::Value) -> u64 {
    s["ebpf"]["per_kind"]
        .as_array()
        .and_then(|a| a.iter().find(|k| k["kind"] == "pod"))
        .and_then(|k| k["packets"].as_u64())
        .unwrap_or(0)
}

#[test]
fn routes_and_dns_follow_the_cluster_without_reconnecting() {
    let f = KubeFixture::new();
    let kubeconfig = f.user_kubeconfig();
    f.kvpn_ok(&["connect", "--kubeconfig", &kubeconfig, "--namespace", "dev"]);
    let before = f.session();
    let id = before["id"].clone();
    let tun = before["tun_name"].as_str().expect("TUN name").to_owned();

    // The watch drives the session, and reports the lab's cluster DNS.
    let (source, took) = wait_session(&f, "route source watch", Duration::from_secs(30), |s| {
        (s["route_source"]["mode"] == "watch" && s["route_source"]["reason"].is_null())
            .then(|| s["route_source"].clone())
    });
    eprintln!("route source watch {took:?} after connect: {source}");
    let s = f.session();
    assert_eq!(strings(&s["dns"]["servers"]), vec!["10.96.0.10"], "{s:#}");
    assert_eq!(s["dns"]["domain"], "cluster.local");
    assert_eq!(
        strings(&s["dns"]["search"]),
        vec![
            "dev.svc.cluster.local",
            "svc.cluster.local",
            "cluster.local"
        ]
    );
    assert!(
        strings(&source["pod_cidrs"]).contains(&"10.244.1.0/24".to_owned()),
        "{source}"
    );
    let services = s["services"].as_array().cloned().unwrap_or_default();
    assert!(
        services.iter().any(|v| v["namespace"] == "kube-system"
            && v["name"] == "kube-dns"
            && strings(&v["cluster_ips"]) == ["10.96.0.10"]),
        "{services:#?}"
    );
    let table = f.kvpn_ok(&["status"]);
    assert!(table.contains("routes from watch"), "{table}");
    assert!(
        table.contains("cluster DNS 10.96.0.10 domain cluster.local search dev.svc.cluster.local svc.cluster.local cluster.local"),
        "{table}"
    );

    // A Service created after connect appears in the session's Service list.
    let svc: Service = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "watched-late", "namespace": "default"},
        "spec": {
            "selector": {"app": "web"},
            "ports": [{"name": "http", "port": 8282, "targetPort": 8080, "protocol": "TCP"}]
        }
    }))
    .expect("service object");
    let services_api: Api<Service> = Api::namespaced(f.admin(), "default");
    let t0 = Instant::now();
    let created = f
        .block_on(services_api.create(&PostParams::default(), &svc))
        .unwrap_or_else(|e| panic!("create Service watched-late: {e}"));
    let cluster_ip = created
        .spec
        .and_then(|s| s.cluster_ip)
        .expect("a ClusterIP");
    let (_, _) = wait_session(
        &f,
        "Service watched-late in status",
        Duration::from_secs(15),
        |s| {
            s["services"].as_array()?.iter().find(|v| {
                v["name"] == "watched-late"
                    && strings(&v["cluster_ips"]) == [cluster_ip.clone()]
                    && strings(&v["ports"]) == ["http:8282/TCP"]
            })?;
            Some(())
        },
    );
    eprintln!(
        "Service watched-late ({cluster_ip}) in status {:?} after creation",
        t0.elapsed()
    );
    let ip: IpAddr = cluster_ip.parse().expect("ClusterIP parses");
    let (took, page) = f.wait_http(
        SocketAddr::new(ip, 8282),
        Instant::now(),
        Duration::from_secs(15),
    );
    assert!(page.pod.starts_with("web-"), "answered by {page:?}");
    eprintln!("  and reachable {took:?} later");

    // A pod on a second Node, outside every CIDR the session routes.
    let node_name = format!("kvpn-watch-{}", f.lab().netns_lab().id());
    let node: Node = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node_name},
        "spec": {"podCIDR": FAR_POD_CIDR, "podCIDRs": [FAR_POD_CIDR]}
    }))
    .expect("node object");
    f.block_on(Api::<Node>::all(f.admin()).create(&PostParams::default(), &node))
        .unwrap_or_else(|e| panic!("create Node {node_name}: {e}"));
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "far-away", "namespace": "default"},
        "spec": {
            "nodeName": node_name,
            "containers": [{"name": "c", "image": "kvpn/lab-server:lab"}]
        }
    }))
    .expect("pod object");
    let pods: Api<Pod> = Api::namespaced(f.admin(), "default");
    f.block_on(pods.create(&PostParams::default(), &pod))
        .unwrap_or_else(|e| panic!("create pod far-away: {e}"));
    assert!(
        !f.tun_state(&tun).routes.contains(&FAR_POD_CIDR.to_owned()),
        "no route before the pod has an IP"
    );
    let t0 = Instant::now();
    f.block_on(pods.patch_status(
        "far-away",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"status": {
            "phase": "Running",
            "podIP": FAR_POD_IP.to_string(),
            "podIPs": [{"ip": FAR_POD_IP.to_string()}],
        }})),
    ))
    .unwrap_or_else(|e| panic!("set the pod IP of far-away: {e}"));
    let (route, took) = wait_session(
        &f,
        "watched route for the far pod",
        Duration::from_secs(15),
        |s| watched_route(s, FAR_POD_CIDR),
    );
    eprintln!(
        "route {FAR_POD_CIDR} added {took:?} after the pod got its IP ({:?} since the patch)",
        t0.elapsed()
    );
    assert_eq!(route["kind"], "pod");
    assert!(
        f.tun_state(&tun).routes.contains(&FAR_POD_CIDR.to_owned()),
        "kernel route through {tun}: {:?}",
        f.tun_state(&tun)
    );
    let ip_route = f.laptop(&["ip", "route", "get", &FAR_POD_IP.to_string()]);
    let ip_route = String::from_utf8_lossy(&ip_route.stdout).into_owned();
    assert!(ip_route.contains(&format!("dev {tun}")), "{ip_route}");

    // The eBPF classifier has the entry: packets to the far pod count as pod
    // traffic (without it they would be dropped as unrouted).
    let pod_before = pod_packets(&f.session());
    f.lab()
        .netns_lab()
        .run_in(LAPTOP, || {
            let sock = UdpSocket::bind("0.0.0.0:0").expect("bind");
            for _ in 0..3 {
                sock.send_to(b"watched", SocketAddr::new(IpAddr::V4(FAR_POD_IP), 7007))
                    .expect("send to the far pod");
            }
        })
        .unwrap_or_else(|e| panic!("laptop netns: {e:#}"));
    let (pod_after, _) = wait_session(&f, "pod packets counted", Duration::from_secs(5), |s| {
        let n = pod_packets(s);
        (n >= pod_before + 3).then_some(n)
    });
    eprintln!("eBPF pod packets {pod_before} -> {pod_after}");

    // The pod goes: so does its route.
    let t0 = Instant::now();
    f.block_on(pods.delete("far-away", &DeleteParams::default().grace_period(0)))
        .unwrap_or_else(|e| panic!("delete pod far-away: {e}"));
    let ((), took) = wait_session(&f, "watched route removed", Duration::from_secs(15), |s| {
        watched_route(s, FAR_POD_CIDR).is_none().then_some(())
    });
    eprintln!(
        "route {FAR_POD_CIDR} removed {took:?} after the pod was deleted ({:?})",
        t0.elapsed()
    );
    assert!(
        !f.tun_state(&tun).routes.contains(&FAR_POD_CIDR.to_owned()),
        "{:?}",
        f.tun_state(&tun)
    );

    // The manager pod is replaced: the agent subscribes to the new one.
    let old = pod_name(&f.wait_manager_pod(Duration::from_secs(5), |_| true));
    let managers: Api<Pod> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    f.block_on(managers.delete(&old, &DeleteParams::default()))
        .unwrap_or_else(|e| panic!("delete manager pod {old}: {e}"));
    let t0 = Instant::now();
    let new = pod_name(&f.wait_manager_pod(Duration::from_secs(60), |p| pod_name(p) != old));
    eprintln!("manager pod {old} replaced by {new} in {:?}", t0.elapsed());
    let again: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "far-again", "namespace": "default"},
        "spec": {
            "nodeName": node_name,
            "containers": [{"name": "c", "image": "kvpn/lab-server:lab"}]
        }
    }))
    .expect("pod object");
    f.block_on(pods.create(&PostParams::default(), &again))
        .unwrap_or_else(|e| panic!("create pod far-again: {e}"));
    f.block_on(pods.patch_status(
        "far-again",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"status": {
            "phase": "Running",
            "podIP": "10.244.78.5",
            "podIPs": [{"ip": "10.244.78.5"}],
        }})),
    ))
    .unwrap_or_else(|e| panic!("set the pod IP of far-again: {e}"));
    let (_, took) = wait_session(
        &f,
        "watched route through the new manager",
        Duration::from_secs(30),
        |s| {
            watched_route(s, "10.244.78.0/24")?;
            (s["route_source"]["mode"] == "watch" && s["route_source"]["reason"].is_null())
                .then_some(())
        },
    );
    eprintln!(
        "route 10.244.78.0/24 added through the new manager pod {took:?} after its IP was set"
    );
    assert!(
        f.tun_state(&tun)
            .routes
            .contains(&"10.244.78.0/24".to_owned()),
        "{:?}",
        f.tun_state(&tun)
    );

    let after = f.session();
    assert_eq!(after["id"], id, "the same session throughout");
    assert_eq!(after["tun_name"], before["tun_name"]);
    assert_eq!(f.sessions().len(), 1);
}

#[test]
fn without_the_watch_rbac_the_session_routes_its_cidrs_only() {
    let f = KubeFixture::new();
    // The manager's ClusterRole, as kvpn would name and annotate it (so connect
    // keeps it), granting nothing: the manager may not list pods or Services
    // in all namespaces.
    let name = format!("kvpn-manager-{MANAGER_NAMESPACE}");
    let role: ClusterRole = serde_json::from_value(serde_json::json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/name": "kvpn-manager", "app.kubernetes.io/managed-by": "kvpn"},
            "annotations": {"kvpn.dev/version": KVPN_VERSION}
        },
        "rules": []
    }))
    .expect("cluster role object");
    f.block_on(Api::<ClusterRole>::all(f.admin()).create(&PostParams::default(), &role))
        .unwrap_or_else(|e| panic!("create ClusterRole {name}: {e}"));

    f.connect_restricted();
    let (source, took) = wait_session(&f, "route source cidr-only", Duration::from_secs(30), |s| {
        (s["route_source"]["mode"] == "cidr-only").then(|| s["route_source"].clone())
    });
    eprintln!("route source {source} {took:?} after connect");
    let reason = source["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("may not list") && (reason.contains("pods") || reason.contains("services")),
        "the reason names the verb and resource: {reason}"
    );
    assert!(reason.contains("ClusterRole"), "and the fix: {reason}");
    let table = f.kvpn_ok(&["status"]);
    assert!(table.contains("routes from cidr-only: "), "{table}");
    let s = f.session();
    assert!(
        s["routes"]
            .as_array()
            .is_some_and(|r| r.iter().all(|r| r["watched"] == false)),
        "{s:#}"
    );
    // The connect-time service CIDR still carries the ClusterIPs.
    let page = f.page(SocketAddr::new(
        IpAddr::V4(Ipv4Addr::new(10, 96, 0, 100)),
        80,
    ));
    assert!(page.pod.starts_with("web-"), "answered by {page:?}");
}
