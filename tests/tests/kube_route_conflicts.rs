//! End-to-end: route conflicts between the cluster and the laptop (case rt-05,
//! issue [hardening] item 4), in the Kubernetes lab.
//!
//! The laptop netns gets two bridges of its own (each with a veth port, so they
//! have carrier): one owning the lab's whole service CIDR 10.96.0.0/12 (what a
//! docker network on 172.20.0.0/16 does to a cluster with that service CIDR), one
//! owning 10.100.7.0/24 inside it. `kvpn connect` refuses, naming both owners and
//! the override flag, and leaves nothing behind; with `--allow-route-conflict` the
//! web ClusterIP and a pod go through the TUN device while the bridges' own
//! addresses still go to the bridges, the bridges' routes are untouched and
//! `status` lists both conflicts. A route added after connect shows in `status`
//! within 5 s and goes when removed.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvpn_lab::{HTTP_PORT, WEB_CLUSTER_IP, WEB_SERVICE_PORT};
use kvpn_tests::kube_lab::{KubeFixture, pod_ip};
use kvpn_tests::text;

fn laptop_ok(f: &KubeFixture, args: &[&str]) -> String {
    let out = f.laptop(args);
    assert!(
        out.status.success(),
        "laptop {args:?}: {}",
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// The device `ip route get <ip>` picks in the laptop netns.
fn route_dev(f: &KubeFixture, ip: &str) -> String {
    let out = laptop_ok(f, &["ip", "-j", "route", "get", ip]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
    v[0]["dev"].as_str().unwrap_or_default().to_owned()
}

fn conflicts(f: &KubeFixture) -> Vec<serde_json::Value> {
    f.session()["conflicts"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// Polls until `check` holds on the session's conflicts; how long it took.
fn wait_conflicts(
    f: &KubeFixture,
    what: &str,
    within: Duration,
    check: impl Fn(&[serde_json::Value]) -> bool,
) -> Duration {
    let t0 = Instant::now();
    loop {
        let c = conflicts(f);
        if check(&c) {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < within,
            "{what} not within {within:?}: {c:#?}\n{}",
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A bridge `name` in the laptop netns with address `addr` (its prefix route is
/// the laptop's own, proto kernel) and a veth port `<name>p`/`<name>q` for carrier.
fn bridge(f: &KubeFixture, name: &str, addr: &str) {
    let (p, q) = (format!("{name}p"), format!("{name}q"));
    laptop_ok(f, &["ip", "link", "add", name, "type", "bridge"]);
    laptop_ok(
        f,
        &["ip", "link", "add", &p, "type", "veth", "peer", "name", &q],
    );
    laptop_ok(f, &["ip", "link", "set", &p, "master", name]);
    for dev in [name, &p, &q] {
        laptop_ok(f, &["ip", "link", "set", dev, "up"]);
    }
    laptop_ok(f, &["ip", "addr", "add", addr, "dev", name]);
}

#[test]
fn rt_05_route_conflicts_are_refused_or_steered_and_shown_in_status() {
    let f = KubeFixture::new();
    // Links live in the lab's laptop netns, removed with it (also on failure).
    let id = f.lab().netns_lab().id().to_owned();
    let (exact, inner) = (format!("kv{id}ca"), format!("kv{id}cb"));
    bridge(&f, &exact, "10.96.255.1/12");
    bridge(&f, &inner, "10.100.7.1/24");
    let kubeconfig = f.user_kubeconfig();

    // Refused by default, naming both owners and the flag; nothing installed.
    let out = f.kvpn(&["connect", "--kubeconfig", &kubeconfig]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "connect must be refused: {stderr}");
    for want in [
        "check route conflicts",
        &format!(
            "service CIDR 10.96.0.0/12 overlaps 10.96.0.0/12 dev {exact} (proto kernel, table main)"
        ),
        &format!(
            "service CIDR 10.96.0.0/12 overlaps 10.100.7.0/24 dev {inner} (proto kernel, table main)"
        ),
        "--allow-route-conflict",
    ] {
        assert!(stderr.contains(want), "missing {want:?} in: {stderr}");
    }
    assert!(f.tun_devices().is_empty(), "{:?}", f.tun_devices());
    let routes = f.laptop_routes();
    assert!(
        !routes.iter().any(|r| r.contains("proto 107")),
        "no kvpn route after a refusal: {routes:#?}"
    );

    // With the override: only cluster-bound traffic goes to the TUN device.
    f.kvpn_ok(&[
        "connect",
        "--kubeconfig",
        &kubeconfig,
        "--allow-route-conflict",
    ]);
    let tun = f.session()["tun_name"]
        .as_str()
        .expect("tun name")
        .to_owned();
    let web_ip = WEB_CLUSTER_IP.to_string();
    // The ClusterIP is pinned once the route watch has reported the Services.
    let t0 = Instant::now();
    while route_dev(&f, &web_ip) != tun {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{web_ip} not routed through {tun}: {}\n{}",
            laptop_ok(&f, &["ip", "route", "show", "table", "all"]),
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "ClusterIP {web_ip} pinned through {tun} {:?} after connect",
        t0.elapsed()
    );
    let page = f.page(SocketAddr::from((WEB_CLUSTER_IP, WEB_SERVICE_PORT)));
    assert!(page.pod.starts_with("web-"), "{page:?}");
    let backend = pod_ip(&f.pods("default", "app=web")[0]);
    let page = f.page(SocketAddr::new(backend, HTTP_PORT));
    assert!(page.pod.starts_with("web-"), "{page:?}");
    // The bridges' own hosts still go to the bridges; their routes are untouched.
    assert_eq!(route_dev(&f, "10.96.200.9"), exact);
    assert_eq!(route_dev(&f, "10.100.7.9"), inner);
    let theirs = laptop_ok(&f, &["ip", "route", "show", "10.96.0.0/12"]);
    assert!(
        theirs.contains(&format!("dev {exact} proto kernel")),
        "{theirs}"
    );

    let c = conflicts(&f);
    assert_eq!(c.len(), 2, "{c:#?}");
    let by_dev = |dev: &str| {
        c.iter()
            .find(|x| x["laptop_dev"] == dev)
            .unwrap_or_else(|| panic!("no conflict with {dev}: {c:#?}"))
            .clone()
    };
    let e = by_dev(&exact);
    assert_eq!(e["cidr"], "10.96.0.0/12");
    assert_eq!(e["kind"], "service");
    assert_eq!(e["laptop_cidr"], "10.96.0.0/12");
    assert_eq!(e["laptop_proto"], "kernel");
    assert_eq!(e["laptop_table"], "main");
    assert_eq!(e["handling"], "not installed");
    assert!(
        e["pinned"]
            .as_array()
            .is_some_and(|p| p.iter().any(|x| *x == format!("{web_ip}/32"))),
        "{e:#}"
    );
    assert_eq!(by_dev(&inner)["laptop_cidr"], "10.100.7.0/24");
    let table = f.kvpn_ok(&["status"]);
    assert!(
        table.contains(&format!(
            "conflict service CIDR 10.96.0.0/12 overlaps 10.96.0.0/12 dev {exact}"
        )),
        "{table}"
    );

    // A conflicting route that appears after connect: in status within 5 s,
    // gone after it is removed.
    laptop_ok(
        &f,
        &[
            "ip",
            "route",
            "add",
            "10.111.5.0/24",
            "dev",
            "lo",
            "proto",
            "static",
        ],
    );
    let took = wait_conflicts(
        &f,
        "the late route in status",
        Duration::from_secs(5),
        |c| {
            c.iter().any(|x| {
                x["laptop_cidr"] == "10.111.5.0/24"
                    && x["laptop_dev"] == "lo"
                    && x["laptop_proto"] == "static"
            })
        },
    );
    eprintln!("late conflicting route shown after {took:?}");
    laptop_ok(&f, &["ip", "route", "del", "10.111.5.0/24", "dev", "lo"]);
    let took = wait_conflicts(
        &f,
        "the late route gone from status",
        Duration::from_secs(5),
        |c| c.len() == 2 && !c.iter().any(|x| x["laptop_cidr"] == "10.111.5.0/24"),
    );
    eprintln!("removed route gone from status after {took:?}");

    f.kvpn_ok(&["disconnect"]);
    assert!(f.tun_devices().is_empty(), "{:?}", f.tun_devices());
    let theirs = laptop_ok(&f, &["ip", "route", "show", "10.96.0.0/12"]);
    assert!(
        theirs.contains(&format!("dev {exact} proto kernel")),
        "the laptop's route survives disconnect: {theirs}"
    );
}

/// T10: a second cluster with the first one's pod and service CIDRs (two kind
/// clusters, two labs) connected laptop-wide: the route conflict with the first
/// session is found as soon as the ranges are known, before the second cluster
/// gets a traffic manager or the laptop a lease there, and the refusal names the
/// other session, the overlapping ranges and the ways out.
#[test]
fn a_conflict_with_another_session_is_refused_before_install_and_lease() {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::Api;
    use kvpn_lab::Addressing;
    use kvpn_tests::kube_lab::MANAGER_NAMESPACE;

    let mut f = KubeFixture::new();
    let b = f.add_cluster(Addressing::overlapping());
    let kube_b = f
        .cluster(b)
        .laptop_user_kubeconfig()
        .to_string_lossy()
        .into_owned();
    f.connect_restricted();
    let a = f.session();
    let a_id = a["id"].as_str().expect("session id").to_owned();
    let a_tun = a["tun_name"].as_str().expect("tun name").to_owned();
    let addressing = Addressing::default();

    let out = f.kvpn(&["connect", "--kubeconfig", &kube_b]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(
        !out.status.success(),
        "a second laptop-wide session over the same ranges must be refused:\n{stdout}\n{stderr}"
    );
    for want in [
        "check route conflicts".to_owned(),
        "before installing the traffic manager or leasing a tunnel IP".to_owned(),
        // Detection finds the node's pod CIDR (a part of the cluster's).
        format!("pod CIDR {} overlaps ", addressing.node_pod_cidr),
        format!("of kvpn session {a_id} (cluster "),
        format!("service CIDR {} overlaps", addressing.service_cidr),
        format!("TUN device {a_tun}"),
        "`kvpn run -- COMMAND`".to_owned(),
        format!("`kvpn disconnect {a_id}`"),
        "--allow-route-conflict".to_owned(),
    ] {
        assert!(stderr.contains(&want), "missing {want:?} in: {stderr}");
    }
    assert!(
        !stdout.contains("Installing traffic manager") && !stdout.contains("Tunnel IP"),
        "the refused connect installed or leased first:\n{stdout}"
    );
    // Cluster B: no traffic manager and no CIDR cache written (its namespace
    // would hold both); the laptop: still one session, A's.
    let admin_b = f
        .block_on(f.cluster(b).admin_client())
        .unwrap_or_else(|e| panic!("admin client of cluster B: {e}"));
    let deployments: Api<Deployment> = Api::namespaced(admin_b.clone(), MANAGER_NAMESPACE);
    let config_maps: Api<ConfigMap> = Api::namespaced(admin_b, MANAGER_NAMESPACE);
    assert!(
        f.block_on(deployments.get_opt("kvpn-manager"))
            .unwrap_or_else(|e| panic!("get Deployment in B: {e}"))
            .is_none(),
        "the refused connect installed a traffic manager in cluster B"
    );
    assert!(
        f.block_on(config_maps.get_opt("kvpn-manager"))
            .unwrap_or_else(|e| panic!("get ConfigMap in B: {e}"))
            .is_none(),
        "the refused connect wrote kvpn's ConfigMap in cluster B"
    );
    let ids: Vec<String> = f
        .sessions()
        .iter()
        .filter_map(|s| s["id"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(ids, vec![a_id], "sessions after the refusal");
}
