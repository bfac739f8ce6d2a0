//! Cluster CIDR detection against the lab's real kube-apiserver 1.20 (service CIDR
//! 10.96.0.0/12), with the admin and the restricted kubeconfig, and the laptop's
//! default gateways read over rtnetlink in a network namespace of the test's own.
//!
//! Needs the binaries of `scripts/build-kubernetes.sh` and Debian's etcd-server; the
//! gateway test needs root (it creates a netns).

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Pod, Service};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kvpn_control::cidr::{
    CidrKind, DetectError, DetectOptions, DetectedCidrs, Origin, Outcome, Source, Step,
    detect_cidrs, essentials, exclude, parse_valid_ranges,
};
use kvpn_lab::k8s::{ControlPlane, ControlPlaneConfig};

fn unique() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .subsec_nanos();
    format!("{:05x}", (t ^ (std::process::id() << 12)) & 0xfffff)
}

fn test_dir(tag: &str, id: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvpn-k8s-{tag}-{id}"));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn from_json<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
    serde_json::from_value(v).expect("valid object")
}

fn net(s: &str) -> IpNet {
    s.parse().expect("test CIDR parses")
}

fn outcome(d: &DetectedCidrs, step: Step) -> &Outcome {
    &d.attempts
        .iter()
        .find(|a| a.step == step)
        .unwrap_or_else(|| panic!("no attempt of step {step}: {:#?}", d.attempts))
        .outcome
}

fn report(d: &DetectedCidrs) -> String {
    d.attempts
        .iter()
        .map(|a| format!("  {a}"))
        .collect::<Vec<_>>()
        .join("\n")
}

async fn create_with_retry<K>(api: &Api<K>, obj: &K) -> K
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    // Right after start-up the serviceaccount controller may not have made a new
    // namespace's `default` account yet; pods are refused until it has.
    let t0 = Instant::now();
    loop {
        match api.create(&PostParams::default(), obj).await {
            Ok(o) => return o,
            Err(e) if t0.elapsed() < Duration::from_secs(30) => {
                eprintln!("create retry: {e}");
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            Err(e) => panic!("create failed: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detects_cidrs_with_admin_and_restricted_kubeconfigs() {
    let id = unique();
    let dir = test_dir("cidr", &id);
    let cp = ControlPlane::start(ControlPlaneConfig::new(&dir, format!("kvpn-lab-{id}")))
        .await
        .expect("control plane starts (binaries from scripts/build-kubernetes.sh)");
    let admin = cp.admin_client().await.expect("admin client");
    let user = cp.user_client().await.expect("user client");

    // --- the cluster: a node with podCIDR 10.244.1.0/24, a pod on it, a hostNetwork pod
    let node_name = format!("kvpn-cidr-node-{id}");
    let node: Node = from_json(serde_json::json!({
        "metadata": {"name": node_name},
        "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"]}
    }));
    Api::<Node>::all(admin.clone())
        .create(&PostParams::default(), &node)
        .await
        .expect("create node");
    let ns = format!("t-{id}");
    Api::<Namespace>::all(admin.clone())
        .create(
            &PostParams::default(),
            &from_json(serde_json::json!({"metadata": {"name": ns}})),
        )
        .await
        .expect("create namespace");
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    for (name, host_network, pod_ip) in [
        ("web", false, "10.244.1.7"),
        ("hostnet", true, "172.31.255.1"),
    ] {
        let pod: Pod = from_json(serde_json::json!({
            "metadata": {"name": name},
            "spec": {"nodeName": node_name, "hostNetwork": host_network,
                     "containers": [{"name": "c", "image": "kvpn-lab-server"}]}
        }));
        create_with_retry(&pods, &pod).await;
        pods.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
                "status": {"phase": "Running", "podIP": pod_ip, "podIPs": [{"ip": pod_ip}]}
            })),
        )
        .await
        .expect("set pod IP");
    }

    // --- admin: service CIDR from the error trick, pod CIDR from the node ------------
    let t0 = Instant::now();
    let d = detect_cidrs(&admin, &DetectOptions::default())
        .await
        .expect("detection with the admin kubeconfig");
    eprintln!("admin detection in {:?}:\n{}", t0.elapsed(), report(&d));
    assert_eq!(d.service, vec![net("10.96.0.0/12")], "{}", report(&d));
    assert_eq!(d.pod, vec![net("10.244.1.0/24")], "{}", report(&d));
    assert!(
        d.sources.contains(&(
            net("10.96.0.0/12"),
            Source {
                kind: CidrKind::Service,
                origin: Origin::ServiceCreateError {
                    probe_ip: IpAddr::from([0, 0, 0, 0])
                }
            }
        )),
        "{:?}",
        d.sources
    );
    assert!(
        d.sources.contains(&(
            net("10.244.1.0/24"),
            Source {
                kind: CidrKind::Pod,
                origin: Origin::NodePodCidr {
                    node: node_name.clone()
                }
            }
        )),
        "{:?}",
        d.sources
    );
    assert_eq!(
        outcome(&d, Step::ServiceCreateError),
        &Outcome::Found(vec![net("10.96.0.0/12")])
    );
    assert_eq!(
        outcome(&d, Step::NodePodCidrs),
        &Outcome::Found(vec![net("10.244.1.0/24")])
    );
    assert!(
        matches!(outcome(&d, Step::ComponentPods), Outcome::NothingFound(_)),
        "{}",
        report(&d)
    );
    // The lab has no kubeadm or kube-proxy ConfigMaps, and 1.20 no ServiceCIDR API.
    assert!(
        matches!(outcome(&d, Step::KubeadmConfig), Outcome::NotFound(_)),
        "{}",
        report(&d)
    );
    assert!(
        matches!(outcome(&d, Step::KubeProxyConfig), Outcome::NotFound(_)),
        "{}",
        report(&d)
    );
    assert!(
        matches!(outcome(&d, Step::ServiceCidrObjects), Outcome::NotFound(_)),
        "{}",
        report(&d)
    );
    // Pod IP and the `kubernetes` ClusterIP are covered: nothing inferred.
    assert!(
        matches!(outcome(&d, Step::PodIps), Outcome::NothingFound(_)),
        "{}",
        report(&d)
    );
    assert!(
        matches!(outcome(&d, Step::ClusterIps), Outcome::NothingFound(_)),
        "{}",
        report(&d)
    );
    // The parser reads this apiserver's own refusal text.
    let refused: Service = from_json(serde_json::json!({
        "metadata": {"name": "refused"},
        "spec": {"clusterIP": "0.0.0.0", "ports": [{"port": 80}]}
    }));
    let err = Api::<Service>::namespaced(admin.clone(), &ns)
        .create(&PostParams::default(), &refused)
        .await
        .expect_err("0.0.0.0 is outside every service CIDR");
    let kube::Error::Api(status) = &err else {
        panic!("expected an API error, got {err}")
    };
    eprintln!("1.20 refusal: {}", status.message);
    assert_eq!(
        parse_valid_ranges(&status.message),
        vec![net("10.96.0.0/12")]
    );

    // --- restricted user: no nodes, no kube-system ConfigMaps; pods, services yes ----
    let d = detect_cidrs(&user, &DetectOptions::default())
        .await
        .expect("detection with the restricted kubeconfig: refusals are not fatal");
    eprintln!("restricted detection:\n{}", report(&d));
    assert_eq!(d.service, vec![net("10.96.0.0/12")], "{}", report(&d));
    assert_eq!(
        outcome(&d, Step::ServiceCreateError),
        &Outcome::Found(vec![net("10.96.0.0/12")])
    );
    assert!(
        matches!(outcome(&d, Step::NodePodCidrs), Outcome::Forbidden(m) if m.contains("nodes")),
        "{}",
        report(&d)
    );
    assert!(
        matches!(outcome(&d, Step::KubeadmConfig), Outcome::Forbidden(_)),
        "{}",
        report(&d)
    );
    assert!(
        matches!(outcome(&d, Step::KubeProxyConfig), Outcome::Forbidden(_)),
        "{}",
        report(&d)
    );
    assert!(
        matches!(outcome(&d, Step::ComponentPods), Outcome::NothingFound(_)),
        "{}",
        report(&d)
    );
    // Without the node, the pod CIDR is inferred from the one routable pod IP; the
    // hostNetwork pod's node address is not a pod route.
    assert_eq!(
        outcome(&d, Step::PodIps),
        &Outcome::Found(vec![net("10.244.1.0/24")])
    );
    assert_eq!(d.pod, vec![net("10.244.1.0/24")], "{}", report(&d));
    assert!(d.sources.contains(&(
        net("10.244.1.0/24"),
        Source {
            kind: CidrKind::Pod,
            origin: Origin::PodIps { count: 1 }
        }
    )));
    assert!(
        !d.pod
            .iter()
            .any(|c| c.contains(&"172.31.255.1".parse::<IpAddr>().expect("ip")))
    );

    // The probes stored nothing, for either user.
    let probes = Api::<Service>::all(admin.clone())
        .list(&ListParams::default().labels("app.kubernetes.io/name=kvpn-cidr-probe"))
        .await
        .expect("list services");
    assert!(
        probes.items.is_empty(),
        "probe Services stored: {:?}",
        probes
            .items
            .iter()
            .map(|s| &s.metadata.name)
            .collect::<Vec<_>>()
    );

    // --- admin: flags of static pods and kubeadm's ConfigMap in kube-system ------------
    let system_pods: Api<Pod> = Api::namespaced(admin.clone(), "kube-system");
    for (name, command) in [
        (
            format!("kube-apiserver-{node_name}"),
            serde_json::json!([
                "kube-apiserver",
                "--secure-port=6443",
                "--service-cluster-ip-range=10.96.0.0/12"
            ]),
        ),
        (
            format!("kube-controller-manager-{node_name}"),
            serde_json::json!([
                "kube-controller-manager",
                "--allocate-node-cidrs=true",
                "--cluster-cidr",
                "10.244.0.0/16"
            ]),
        ),
    ] {
        let pod: Pod = from_json(serde_json::json!({
            "metadata": {"name": name, "labels": {"tier": "control-plane"}},
            "spec": {"nodeName": node_name, "hostNetwork": true,
                     "containers": [{"name": "c", "image": "k8s.gcr.io/kube", "command": command}]}
        }));
        create_with_retry(&system_pods, &pod).await;
    }
    let kubeadm: ConfigMap = from_json(serde_json::json!({
        "metadata": {"name": "kubeadm-config"},
        "data": {"ClusterConfiguration": "apiVersion: kubeadm.k8s.io/v1beta2\nkind: ClusterConfiguration\nnetworking:\n  dnsDomain: cluster.local\n  podSubnet: 10.244.0.0/16\n  serviceSubnet: 10.96.0.0/12\n"}
    }));
    Api::<ConfigMap>::namespaced(admin.clone(), "kube-system")
        .create(&PostParams::default(), &kubeadm)
        .await
        .expect("create kubeadm-config");
    let d = detect_cidrs(&admin, &DetectOptions::default())
        .await
        .expect("detection with flags");
    eprintln!("admin detection with kube-system flags:\n{}", report(&d));
    assert_eq!(d.pod, vec![net("10.244.0.0/16")], "{}", report(&d));
    assert_eq!(d.service, vec![net("10.96.0.0/12")], "{}", report(&d));
    match outcome(&d, Step::ComponentPods) {
        Outcome::Found(found) => {
            let mut found = found.clone();
            found.sort();
            assert_eq!(found, vec![net("10.96.0.0/12"), net("10.244.0.0/16")]);
        }
        other => panic!("component flags: {other:?}"),
    }
    assert!(d.sources.contains(&(
        net("10.244.0.0/16"),
        Source {
            kind: CidrKind::Pod,
            origin: Origin::ComponentFlag {
                pod: format!("kube-controller-manager-{node_name}"),
                flag: "--cluster-cidr".into()
            }
        }
    )));
    assert_eq!(
        outcome(&d, Step::KubeadmConfig),
        &Outcome::Found(vec![net("10.244.0.0/16"), net("10.96.0.0/12")])
    );

    // --- rt-02 on what was detected: the API server's own address stays off the tunnel
    // (the lab's `kubernetes` Service endpoint, 172.31.255.1, and the ClusterIP of the
    // `kubernetes` Service are both essentials here).
    let essentials: [IpAddr; 2] = [cp.listen_ip().into(), "10.96.0.1".parse().expect("ip")];
    let routes = exclude(&[d.pod.clone(), d.service.clone()].concat(), &essentials);
    assert!(
        !routes
            .iter()
            .any(|r| essentials.iter().any(|e| r.contains(e)))
    );
    assert!(
        routes
            .iter()
            .any(|r| r.contains(&"10.96.0.2".parse::<IpAddr>().expect("ip")))
    );

    cp.stop().expect("stop control plane");
    std::fs::remove_dir_all(&dir).expect("remove test dir");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detection_without_an_api_server_is_an_error_naming_the_cause() {
    // Nothing listens on port 1 of this loopback address: every request is refused.
    let config = kube::Config::new("http://127.0.0.1:1".parse().expect("uri"));
    let client = kube::Client::try_from(config).expect("client");
    let err = detect_cidrs(&client, &DetectOptions::default())
        .await
        .expect_err("no API server");
    let DetectError::Unreachable { last, attempts } = &err;
    assert!(err.to_string().contains("did not answer"), "{err}");
    assert!(!last.is_empty());
    assert_eq!(attempts.len(), 8, "{attempts:#?}");
    assert!(
        attempts
            .iter()
            .all(|a| matches!(a.outcome, Outcome::Failed(_))),
        "{attempts:#?}"
    );
}

/// Removes the netns on drop, also when the test fails.
struct NetnsGuard(kvpn_lab::netns::Netns);

impl Drop for NetnsGuard {
    fn drop(&mut self) {
        let _ = self.0.delete();
    }
}

#[test]
fn rt_02_default_gateways_from_rtnetlink_in_a_netns() {
    let name = format!("kvpn-cidr{}-gw", unique());
    let ns = NetnsGuard(kvpn_lab::netns::Netns::create(&name).expect("create netns (needs root)"));
    ns.0.ip_batch(&[
        "link set lo up".to_owned(),
        // No dummy driver on this kernel; a veth pair inside the netns serves as well.
        "link add kvgw0 type veth peer name kvgw1".to_owned(),
        "link set kvgw1 up".to_owned(),
        "link set kvgw0 up".to_owned(),
        "addr add 192.0.2.10/24 dev kvgw0".to_owned(),
        "route add default via 192.0.2.1 dev kvgw0".to_owned(),
        // A second table with a multipath default route (policy routing, VPN clients).
        "route add default table 100 nexthop via 192.0.2.2 dev kvgw0 nexthop via 192.0.2.3 dev kvgw0"
            .to_owned(),
        // Not default routes: not essentials.
        "route add 198.51.100.0/24 via 192.0.2.4 dev kvgw0".to_owned(),
    ])
    .expect("configure netns");
    let gateways =
        ns.0.run(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(essentials::default_gateways())
        })
        .expect("enter netns")
        .expect("dump routes");
    let want: Vec<IpAddr> = ["192.0.2.1", "192.0.2.2", "192.0.2.3"]
        .iter()
        .map(|s| s.parse().expect("ip"))
        .collect();
    assert_eq!(gateways, want);
    // A pod CIDR covering the gateways leaves them on the uplink.
    let routes = exclude(&[net("192.0.2.0/24")], &gateways);
    for g in &gateways {
        assert!(!routes.iter().any(|r| r.contains(g)), "{g} in {routes:?}");
    }
}
