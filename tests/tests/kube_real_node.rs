//! kvpn on real node software (issue #23): a lab with two real nodes (containerd
//! 1.6 + runc, CNI bridge, kubelet and kube-proxy 1.20.2; `kvpn_lab::k8s::node`)
//! into which the project's images (`cargo xtask image`) are imported: pause as the
//! sandbox, the lab server running the sample workloads, the manager.
//!
//! `kvpn connect` (port-forward transport; source policy snat, and ebpf-snat in a
//! second test) from the laptop netns installs the manager exactly as `kvpn install
//! --dry-run` renders it (image, securityContext; no pull policy named, so the
//! apiserver's IfNotPresent); the kubelet runs it from the imported image under runc
//! as the rendered user with exactly the policy's capabilities; the laptop reaches a
//! pod on the other node over TCP (curl), the `web` ClusterIP (kube-proxy's iptables
//! rules on the manager's node), UDP through the `udp-echo` ClusterIP, and pings a
//! pod; the backends see the manager pod's IP. Then everything goes: kvpn, nodes,
//! netns, cgroups, container processes, and the global sysctls the kubelet changes
//! are back.
//!
//! Cluster DNS on the real nodes: kube_real_node_dns.rs.
//!
//! Needs root, the Kubernetes binaries (kubelet, kube-proxy, kube-scheduler too),
//! Debian's containerd, runc and CNI plugins, and the images of `cargo xtask image`
//! (`./x test` builds them; `KVPN_IMAGE_DIR` names their folder).

use std::net::IpAddr;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kvpn_lab::k8s::node::{self, images};
use kvpn_lab::protocol::PageInfo;
use kvpn_tests::kube_lab::{KubeFixture, MANAGER_NAMESPACE, pod_ip, pod_name, pod_ready, web};
use kvpn_tests::real_node::{container_pids, status_field};

/// The global sysctls a 1.20 kubelet sets at start, read while no lab's kubelets
/// are starting (docs/lab-real-node.md).
fn global_sysctls() -> Vec<(String, String)> {
    node::settled_global_sysctls().unwrap_or_else(|e| panic!("global sysctls: {e}"))
}

/// `curl` from the laptop netns (5 s bound); the lab page it got.
fn curl(f: &KubeFixture, url: &str) -> Result<PageInfo, String> {
    let o = f.laptop(&["curl", "-sS", "--max-time", "5", url]);
    let body = String::from_utf8_lossy(&o.stdout).into_owned();
    if !o.status.success() {
        return Err(format!(
            "curl {url}: {}: {}",
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        ));
    }
    PageInfo::parse(&body).ok_or_else(|| format!("curl {url}: not a lab page: {body:?}"))
}

/// The manager container as `kvpn install --dry-run -o json` renders it.
fn rendered_manager_container(
    f: &KubeFixture,
    kubeconfig: &str,
    policy: &str,
) -> serde_json::Value {
    let out = f.kvpn_ok(&[
        "install",
        "--dry-run",
        "-o",
        "json",
        "--kubeconfig",
        kubeconfig,
        "--source-policy",
        policy,
    ]);
    let list: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("dry-run JSON: {e}: {out}"));
    let deployment = list["items"]
        .as_array()
        .and_then(|items| items.iter().find(|o| o["kind"] == "Deployment"))
        .unwrap_or_else(|| panic!("no Deployment in the dry-run: {out}"));
    deployment["spec"]["template"]["spec"]["containers"][0].clone()
}

#[test]
fn connect_snat_on_two_real_nodes_reaches_a_pod_on_the_other_node_a_cluster_ip_and_ping() {
    connect_on_two_real_nodes("snat", 65532, "0000000000000000");
}

/// ebpf-snat: uid 0 with only BPF (39), NET_ADMIN (12) and NET_RAW (13) effective.
#[test]
fn connect_ebpf_snat_on_two_real_nodes_reaches_a_pod_on_the_other_node_a_cluster_ip_and_ping() {
    connect_on_two_real_nodes("ebpf-snat", 0, "0000008000003000");
}

/// The whole test under source policy `policy`, whose manager runs as `uid` with
/// the effective capabilities `cap_eff` (/proc/<pid>/status hex).
fn connect_on_two_real_nodes(policy: &str, uid: u32, cap_eff: &str) {
    let t0 = Instant::now();
    let sysctls_before = global_sysctls();
    let f = KubeFixture::real_nodes(2);
    let lab_up = t0.elapsed();
    let lab_id = f.lab().netns_lab().id().to_owned();
    let nodes_dir = f.lab().netns_lab().dir().join("nodes");
    assert_eq!(
        global_sysctls(),
        sysctls_before,
        "the kubelet's global sysctls are put back once the nodes are Ready"
    );
    let kubeconfig = f.user_kubeconfig();

    // The install the laptop would render: the project's manager image, pulled only
    // when the node lacks it (it was imported), restricted securityContext.
    let rendered = rendered_manager_container(&f, &kubeconfig, policy);
    let image = images::project_image("manager");
    assert_eq!(rendered["image"], image.as_str(), "{rendered:#}");
    // No policy named: the apiserver's default for a tagged image, IfNotPresent.
    assert!(
        rendered["imagePullPolicy"].is_null() || rendered["imagePullPolicy"] == "IfNotPresent",
        "{rendered:#}"
    );

    let t_connect = Instant::now();
    f.kvpn_ok(&[
        "connect",
        "--kubeconfig",
        &kubeconfig,
        "--source-policy",
        policy,
    ]);
    let connect = t_connect.elapsed();
    let session = f.session();
    assert_eq!(session["source_policy"], policy, "{session:#}");
    assert_eq!(session["transport"], "port-forward", "{session:#}");
    f.wait_state("connected", Duration::from_secs(30));

    // The installed Deployment is the rendered one (image, pull policy, security).
    let api: Api<Deployment> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    let deployment = f
        .block_on(api.get("kvpn-manager"))
        .unwrap_or_else(|e| panic!("get the manager Deployment: {e}"));
    let installed = serde_json::to_value(
        deployment
            .spec
            .and_then(|s| s.template.spec)
            .and_then(|s| s.containers.into_iter().next())
            .unwrap_or_else(|| panic!("manager Deployment without a container")),
    )
    .unwrap_or_else(|e| panic!("container as JSON: {e}"));
    for key in ["image", "securityContext"] {
        assert_eq!(installed[key], rendered[key], "{key}: installed vs dry-run");
    }
    assert_eq!(
        installed["imagePullPolicy"], "IfNotPresent",
        "{installed:#}"
    );
    assert_eq!(installed["securityContext"]["runAsUser"], uid);
    assert_eq!(installed["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(
        installed["securityContext"]["capabilities"]["drop"][0],
        "ALL"
    );

    // The kubelet runs it from the imported image under containerd + runc, as `uid`
    // with exactly the capabilities the policy needs.
    let manager: Pod = f.wait_manager_pod(Duration::from_secs(30), |_| true);
    let status = manager
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .unwrap_or_else(|| panic!("manager pod without a container status: {manager:#?}"));
    assert_eq!(status.image, image, "the manager pod's image");
    let container_id = status
        .container_id
        .as_deref()
        .and_then(|c| c.strip_prefix("containerd://"))
        .unwrap_or_else(|| panic!("not a containerd container: {status:#?}"));
    let pids = container_pids(container_id);
    let manager_pid = pids
        .iter()
        .copied()
        .find(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm"))
                .is_ok_and(|c| c.trim() == "kvpn-manager")
        })
        .unwrap_or_else(|| panic!("no kvpn-manager process in container {container_id}: {pids:?}"));
    assert!(
        status_field(manager_pid, "Uid:").starts_with(&format!("{uid}\t")),
        "manager uid: {}",
        status_field(manager_pid, "Uid:")
    );
    assert_eq!(
        status_field(manager_pid, "CapEff:"),
        cap_eff,
        "the manager's effective capabilities under {policy}"
    );
    let manager_node = manager
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();

    // A sample pod on the other node, by pod IP, over TCP.
    let webs: Vec<Pod> = f
        .pods("default", "app=web")
        .into_iter()
        .filter(pod_ready)
        .collect();
    let other = webs
        .iter()
        .find(|p| {
            p.spec.as_ref().and_then(|s| s.node_name.as_deref()) != Some(manager_node.as_str())
        })
        .unwrap_or_else(|| {
            panic!(
                "no ready web pod off the manager's node {manager_node}: {:?}",
                webs.iter()
                    .map(|p| (
                        pod_name(p),
                        p.spec.as_ref().and_then(|s| s.node_name.clone())
                    ))
                    .collect::<Vec<_>>()
            )
        });
    let IpAddr::V4(other_ip) = pod_ip(other) else {
        panic!("IPv4 pod IP expected: {other:#?}")
    };
    let t_first = Instant::now();
    let page = curl(&f, &format!("http://{other_ip}:{}/", kvpn_lab::HTTP_PORT))
        .unwrap_or_else(|e| panic!("{e}\n{}", f.diagnostics()));
    let first_get = t_first.elapsed();
    assert_eq!(
        page.pod,
        pod_name(other),
        "the pod on the other node answered"
    );
    assert_eq!(page.pod_ip, IpAddr::V4(other_ip));
    // snat: the backend sees the manager pod's IP.
    assert_eq!(
        page.client.ip(),
        pod_ip(&manager),
        "{policy} source: {page:?}"
    );

    // `kvpn diagnose source` at its three points: the laptop's packet arrives from
    // the tunnel IP, leaves the manager pod (observed only with NET_RAW: ebpf-snat)
    // and reaches the backend on the other node with the manager pod's IP: the
    // source changes in the manager.
    let target = format!("{other_ip}:{}", kvpn_lab::HTTP_PORT);
    let t_diagnose = Instant::now();
    let out = f.kvpn_ok(&[
        "diagnose",
        "source",
        &target,
        "-o",
        "json",
        "--kubeconfig",
        &kubeconfig,
    ]);
    let diagnose = t_diagnose.elapsed();
    let d: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("diagnose JSON: {e}: {out}"));
    let addr_ip = |v: &serde_json::Value| {
        v.as_str()
            .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
            .map(|a| a.ip())
    };
    let tunnel: Option<IpAddr> = session["tunnel_ip"].as_str().and_then(|t| t.parse().ok());
    assert_eq!(d["policy"], policy, "{d:#}");
    assert_eq!(addr_ip(&d["decapsulated_source"]), tunnel, "{d:#}");
    if policy == "snat" {
        // The restricted install grants no NET_RAW: no capture at the pod's egress;
        // the backend seeing the pod's own address still places the change.
        assert!(d["egress_source"].is_null(), "{d:#}");
        assert!(
            d["note"].as_str().is_some_and(|n| n.contains("NET_RAW")),
            "{d:#}"
        );
    } else {
        assert_eq!(
            addr_ip(&d["egress_source"]),
            Some(pod_ip(&manager)),
            "{d:#}"
        );
    }
    assert_eq!(
        d["manager_pod_ips"][0]
            .as_str()
            .and_then(|a| a.parse::<IpAddr>().ok()),
        Some(pod_ip(&manager)),
        "{d:#}"
    );
    assert_eq!(
        addr_ip(&d["backend_source"]),
        Some(pod_ip(&manager)),
        "{d:#}"
    );
    assert_eq!(d["verdict"], "manager", "{d:#}");
    assert!(
        diagnose < Duration::from_secs(20),
        "diagnose took {diagnose:?}"
    );

    // The web ClusterIP: kube-proxy's rules in the manager's node netns.
    let svc = web();
    let real = f.lab().real_nodes().expect("a real-node lab");
    let node = real
        .nodes()
        .iter()
        .find(|n| n.name() == manager_node)
        .unwrap_or_else(|| panic!("manager on unknown node {manager_node}"));
    let rules = node
        .exec("iptables", &["-t", "nat", "-S", "KUBE-SERVICES"])
        .unwrap_or_else(|e| panic!("iptables on {manager_node}: {e}"));
    assert!(
        rules.contains(&format!("-d {}/32", svc.ip())),
        "kube-proxy has no rule for {svc} on {manager_node}:\n{rules}"
    );
    let page =
        curl(&f, &format!("http://{svc}/")).unwrap_or_else(|e| panic!("{e}\n{}", f.diagnostics()));
    assert!(
        webs.iter().any(|p| pod_name(p) == page.pod),
        "ClusterIP {svc} answered from {page:?}, not a web pod"
    );

    // UDP through the udp-echo ClusterIP: the backend sees the manager pod's IP.
    let udp_echo =
        std::net::SocketAddr::from((kvpn_lab::UDP_ECHO_CLUSTER_IP, kvpn_lab::ECHO_SERVICE_PORT));
    assert_eq!(
        f.udp_peer(udp_echo).ip(),
        pod_ip(&manager),
        "UDP via {udp_echo}: {policy} source"
    );

    // Ping to the pod on the other node.
    let ping = f.laptop(&[
        "ping",
        "-c",
        "3",
        "-i",
        "0.2",
        "-W",
        "2",
        &other_ip.to_string(),
    ]);
    let out = String::from_utf8_lossy(&ping.stdout);
    assert!(
        ping.status.success() && out.contains(" 0% packet loss"),
        "ping {other_ip}: {}\n{out}{}",
        ping.status,
        String::from_utf8_lossy(&ping.stderr)
    );

    // Disconnect: the session goes.
    let t_disconnect = Instant::now();
    f.kvpn_ok(&["disconnect"]);
    let disconnect = t_disconnect.elapsed();
    assert!(
        f.sessions().is_empty(),
        "sessions after disconnect: {:#?}",
        f.sessions()
    );

    // Everything goes: kvpn quits, the nodes and the lab go down.
    let t_down = Instant::now();
    drop(f);
    let down = t_down.elapsed();
    let left = node::leftovers(&lab_id, &nodes_dir, 2);
    assert!(left.is_empty(), "left behind: {left:#?}");
    let netns = kvpn_lab::lab_netns(&lab_id).unwrap_or_else(|e| panic!("list netns: {e}"));
    assert!(netns.is_empty(), "netns left behind: {netns:?}");
    // A killed container process may stay a zombie for a moment until its new
    // parent reaps it; a live one after 10 s is left behind.
    let t_gone = Instant::now();
    loop {
        let left = container_pids(container_id);
        if left.is_empty() {
            break;
        }
        assert!(
            t_gone.elapsed() < Duration::from_secs(10),
            "manager container processes left behind: {:?}",
            left.iter()
                .map(|p| (
                    *p,
                    std::fs::read_to_string(format!("/proc/{p}/status"))
                        .ok()
                        .and_then(|s| s
                            .lines()
                            .find(|l| l.starts_with("State:"))
                            .map(str::to_owned))
                ))
                .collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        global_sysctls(),
        sysctls_before,
        "kubelet sysctls not restored"
    );
    eprintln!(
        "real nodes: lab up {:.1} s, kvpn connect {:.1} s, first GET {:.0} ms, disconnect {:.1} s, down {:.1} s, total {:.1} s",
        lab_up.as_secs_f64(),
        connect.as_secs_f64(),
        first_get.as_secs_f64() * 1000.0,
        disconnect.as_secs_f64(),
        down.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
}
