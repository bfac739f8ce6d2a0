//! `--source-policy preserve` on real node software (issues #22/#23): the node
//! side of preserve is kvpn's node agent (`kvpn-manager node-agent`, a DaemonSet
//! from the manager's image: host network, CAP_NET_ADMIN only), installed by
//! `kvpn connect --source-policy preserve` exactly as on a user's cluster. On two
//! real nodes (containerd + runc, CNI bridge, kubelet and kube-proxy 1.20.2) it
//! routes the tunnel pool to the manager pod on the manager's node and to the
//! manager's node elsewhere, so a backend on either node sees the laptop's tunnel
//! IP and its replies come back. Switching the policy to snat removes the agent
//! and its routes; so does uninstall.
//!
//! Needs root, the Kubernetes binaries, Debian's containerd, runc and CNI
//! plugins, and the images of `cargo xtask image` (`KVPN_IMAGE_DIR`).

use std::net::IpAddr;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kvpn_lab::protocol::PageInfo;
use kvpn_tests::kube_lab::{KubeFixture, MANAGER_NAMESPACE, pod_ip, pod_name, pod_ready};
use kvpn_tests::real_node::{container_pids, status_field};

/// `GET /` of a lab server from the laptop netns, retried for `within` (the
/// agents set their routes within a resync).
fn page_within(f: &KubeFixture, url: &str, within: Duration) -> PageInfo {
    let t0 = Instant::now();
    loop {
        let o = f.laptop(&["curl", "-sS", "--max-time", "3", url]);
        let body = String::from_utf8_lossy(&o.stdout).into_owned();
        if o.status.success()
            && let Some(p) = PageInfo::parse(&body)
        {
            return p;
        }
        assert!(
            t0.elapsed() < within,
            "curl {url} failed for {within:?}: {}\n{}",
            String::from_utf8_lossy(&o.stderr),
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// The agent's routes (`proto 0x6c`) on each real node.
fn agent_routes(f: &KubeFixture) -> Vec<(String, String)> {
    let real = f.lab().real_nodes().expect("a real-node lab");
    real.nodes()
        .iter()
        .map(|n| {
            let out = n
                .exec("ip", &["-4", "route", "show", "proto", "108"])
                .unwrap_or_else(|e| panic!("ip route on {}: {e}", n.name()));
            (n.name().to_owned(), out.trim().to_owned())
        })
        .collect()
}

#[test]
fn preserve_on_two_real_nodes_through_the_node_agent_keeps_the_tunnel_ip_and_snat_removes_it() {
    let f = KubeFixture::real_nodes(2);
    let kubeconfig = f.admin_kubeconfig_path();
    let out = f.kvpn_ok(&[
        "connect",
        "--kubeconfig",
        &kubeconfig,
        "--source-policy",
        "preserve",
    ]);
    assert!(
        out.contains("Node agent ready on 2 node(s)"),
        "connect waits for the node agent: {out}"
    );
    f.wait_state("connected", Duration::from_secs(30));
    let session = f.session();
    // The agent is ready on every node: nothing to warn about the way back.
    assert!(
        session["source_policy_note"].is_null(),
        "preserve with its node agent ready has no note: {session:#}"
    );
    let tunnel: IpAddr = session["tunnel_ip"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("tunnel ip: {session:#}"));

    // The agent pods: host network, uid 0, exactly CAP_NET_ADMIN (bit 12).
    let api: Api<Pod> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    let agents = f
        .block_on(api.list(
            &kube::api::ListParams::default().labels("app.kubernetes.io/name=kvpn-node-agent"),
        ))
        .unwrap_or_else(|e| panic!("list agent pods: {e}"))
        .items;
    assert_eq!(agents.len(), 2, "one agent per node");
    for a in &agents {
        assert_eq!(a.spec.as_ref().and_then(|s| s.host_network), Some(true));
        let id = a
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|c| c.first())
            .and_then(|c| c.container_id.as_deref())
            .and_then(|c| c.strip_prefix("containerd://"))
            .unwrap_or_else(|| panic!("agent {} has no container", pod_name(a)))
            .to_owned();
        let pid = container_pids(&id)
            .into_iter()
            .find(|p| {
                std::fs::read_to_string(format!("/proc/{p}/comm"))
                    .is_ok_and(|c| c.trim() == "kvpn-manager")
            })
            .unwrap_or_else(|| panic!("no kvpn-manager process in agent {}", pod_name(a)));
        assert!(status_field(pid, "Uid:").starts_with("0\t"));
        assert_eq!(status_field(pid, "CapEff:"), "0000000000001000");
    }

    // Each node has exactly the agent's pool route.
    let manager: Pod = f.wait_manager_pod(Duration::from_secs(30), |_| true);
    let manager_node = manager
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    let t0 = Instant::now();
    loop {
        let routes = agent_routes(&f);
        let ok = routes.iter().all(|(node, r)| {
            r.starts_with("100.96.0.0/16 via ")
                && (node != &manager_node || r.contains(&format!("via {}", pod_ip(&manager))))
        });
        if ok {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "agent routes: {routes:?} (manager {} on {manager_node})",
            pod_ip(&manager)
        );
        std::thread::sleep(Duration::from_millis(300));
    }

    // A backend on each node sees the laptop's tunnel IP.
    let webs: Vec<Pod> = f
        .pods("default", "app=web")
        .into_iter()
        .filter(pod_ready)
        .collect();
    assert_eq!(webs.len(), 2, "two web pods");
    let mut nodes_seen = Vec::new();
    for w in &webs {
        let page = page_within(
            &f,
            &format!("http://{}:{}/", pod_ip(w), kvpn_lab::HTTP_PORT),
            Duration::from_secs(20),
        );
        assert_eq!(page.pod, pod_name(w));
        assert_eq!(
            page.client.ip(),
            tunnel,
            "preserve: {} saw {page:?}",
            pod_name(w)
        );
        nodes_seen.push(w.spec.as_ref().and_then(|s| s.node_name.clone()));
    }
    nodes_seen.sort();
    nodes_seen.dedup();
    assert_eq!(
        nodes_seen.len(),
        2,
        "backends on both nodes: {nodes_seen:?}"
    );
    let d: serde_json::Value = serde_json::from_str(&f.kvpn_ok(&[
        "diagnose",
        "source",
        &format!("{}:{}", pod_ip(&webs[0]), kvpn_lab::HTTP_PORT),
        "-o",
        "json",
        "--kubeconfig",
        &kubeconfig,
    ]))
    .unwrap_or_else(|e| panic!("diagnose JSON: {e}"));
    assert_eq!(d["verdict"], "none", "{d:#}");
    // Through a ClusterIP, kube-proxy (clusterCIDR set) masquerades sources
    // outside the pod CIDR, the tunnel pool included: the backend sees a node's
    // address, and diagnose places the change downstream of the manager.
    let d: serde_json::Value = serde_json::from_str(&f.kvpn_ok(&[
        "diagnose",
        "source",
        &format!("{}", kvpn_tests::kube_lab::web()),
        "-o",
        "json",
        "--kubeconfig",
        &kubeconfig,
    ]))
    .unwrap_or_else(|e| panic!("diagnose JSON: {e}"));
    eprintln!("preserve through the web ClusterIP: {d:#}");
    assert_eq!(d["verdict"], "downstream", "{d:#}");

    // Policy snat: the agent and its routes go.
    f.kvpn_ok(&["disconnect"]);
    f.kvpn_ok(&[
        "connect",
        "--kubeconfig",
        &kubeconfig,
        "--source-policy",
        "snat",
    ]);
    let ds: Api<DaemonSet> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    assert!(
        f.block_on(ds.get_opt("kvpn-node-agent"))
            .unwrap_or_else(|e| panic!("get DaemonSet: {e}"))
            .is_none(),
        "snat removes the node agent"
    );
    let t1 = Instant::now();
    while agent_routes(&f).iter().any(|(_, r)| !r.is_empty()) {
        assert!(
            t1.elapsed() < Duration::from_secs(20),
            "routes left after the agent went: {:?}",
            agent_routes(&f)
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let page = page_within(
        &f,
        &format!("http://{}:{}/", pod_ip(&webs[0]), kvpn_lab::HTTP_PORT),
        Duration::from_secs(20),
    );
    assert_ne!(page.client.ip(), tunnel, "snat: {page:?}");
}
