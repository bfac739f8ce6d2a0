//! Cluster DNS on real node software (issue #23): the real-node lab runs the lab's
//! DNS server as a cluster add-on — Deployment `kube-system/kube-dns` from the
//! lab-server image (`kvpn-lab-server dns`), uid 65532 without capabilities on port
//! 5353, behind the Service `kube-system/kube-dns` 10.96.0.10:53 (targetPort 5353),
//! its service account allowed only to list and watch Services and Endpoints; the
//! real kubelets give every pod a resolv.conf naming it (`clusterDNS`,
//! `clusterDomain`).
//!
//! One test, one lab: the DNS pod runs as that user with no effective capability; a
//! pod's kubelet-written resolv.conf names the DNS ClusterIP with the standard search
//! list, and from the pod's netns a service name resolves through that ClusterIP
//! (kube-proxy's DNAT to the DNS pod on either node); then `kvpn connect` from the
//! laptop: kvpn's DNS forwarder answers `web.default`,
//! `web.default.svc.cluster.local` and the short `web` (search list, connected
//! namespace `default`) with the `web` ClusterIP, `curl http://web.default/`
//! reaches a web pod, and no cluster name reaches the laptop's own resolver.
//!
//! Needs root, the Kubernetes binaries (kubelet, kube-proxy, kube-scheduler too),
//! Debian's containerd, runc, CNI plugins, dig, nsenter, dnsmasq, and the images of
//! `cargo xtask image` (`KVPN_IMAGE_DIR`) with a lab-server that has `dns`.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Endpoints, Pod, Service};
use kube::api::Api;
use kvpn_lab::k8s::node;
use kvpn_lab::protocol::PageInfo;
use kvpn_tests::dns_lab::{
    FORWARDER, LAPTOP_RESOLV, Upstream, cluster_ip, connect_default, dig, getent, parse_dig,
    write_laptop_resolv,
};
use kvpn_tests::kube_lab::{KubeFixture, pod_ip, pod_name, pod_ready};
use kvpn_tests::real_node::{container_id, container_pids, container_process, status_field};
use kvpn_tests::text;

/// `dig` run inside the netns of process `pid` (a pod's), answers parsed.
fn dig_in_netns(pid: u32, args: &[&str]) -> kvpn_tests::dns_lab::Dig {
    let out = std::process::Command::new("nsenter")
        .arg(format!("--net=/proc/{pid}/ns/net"))
        .args(["dig", "+time=2", "+tries=2"])
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("nsenter dig: {e}"));
    let d = parse_dig(&text(&out.stdout));
    assert!(
        !d.status.is_empty(),
        "dig {args:?} in the netns of pid {pid} got no answer: {}{}",
        d.raw,
        text(&out.stderr)
    );
    d
}

#[test]
fn cluster_dns_pod_on_real_nodes_serves_pods_and_the_laptop_through_kvpn() {
    let t0 = Instant::now();
    let f = KubeFixture::real_nodes(2);
    let lab_up = t0.elapsed();
    let lab_id = f.lab().netns_lab().id().to_owned();
    let nodes_dir = f.lab().netns_lab().dir().join("nodes");
    let dns_ip = f.lab().addressing().dns_service_ip();
    let web_ip = cluster_ip(&f, "default", "web");

    // The add-on as a cluster runs it: Service at the DNS ClusterIP, port 53 to the
    // pod's unprivileged 5353, Endpoints = the DNS pod.
    let services: Api<Service> = Api::namespaced(f.admin(), "kube-system");
    let svc = f
        .block_on(services.get("kube-dns"))
        .unwrap_or_else(|e| panic!("Service kube-system/kube-dns: {e}"));
    let spec = svc.spec.unwrap_or_default();
    assert_eq!(
        spec.cluster_ip.as_deref(),
        Some(dns_ip.to_string().as_str())
    );
    let ports: Vec<(i32, String, String)> = spec
        .ports
        .unwrap_or_default()
        .into_iter()
        .map(|p| {
            (
                p.port,
                p.protocol.unwrap_or_default(),
                serde_json::to_string(&p.target_port).unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        ports,
        vec![
            (53, "UDP".to_owned(), "5353".to_owned()),
            (53, "TCP".to_owned(), "5353".to_owned())
        ]
    );
    let dns_pods: Vec<Pod> = f
        .pods("kube-system", "k8s-app=kube-dns")
        .into_iter()
        .filter(pod_ready)
        .collect();
    assert_eq!(dns_pods.len(), 1, "one ready kube-dns pod");
    let dns_pod = &dns_pods[0];
    let endpoints: Api<Endpoints> = Api::namespaced(f.admin(), "kube-system");
    let ep = f
        .block_on(endpoints.get("kube-dns"))
        .unwrap_or_else(|e| panic!("Endpoints kube-system/kube-dns: {e}"));
    let ep_ips: Vec<String> = ep
        .subsets
        .unwrap_or_default()
        .into_iter()
        .flat_map(|s| s.addresses.unwrap_or_default())
        .map(|a| a.ip)
        .collect();
    assert_eq!(
        ep_ips,
        vec![pod_ip(dns_pod).to_string()],
        "kube-dns Endpoints"
    );

    // The DNS server runs under runc as uid 65532 with no effective capability.
    let dns_container = container_id(dns_pod);
    let dns_pid = container_process(&dns_container, "kvpn-lab-server");
    assert!(
        status_field(dns_pid, "Uid:").starts_with("65532\t"),
        "DNS server uid: {}",
        status_field(dns_pid, "Uid:")
    );
    assert_eq!(status_field(dns_pid, "CapEff:"), "0000000000000000");

    // A pod resolves through the real kube-dns ClusterIP: the resolv.conf its
    // kubelet wrote names it with the standard search list, and from the pod's netns
    // the names resolve through it, for a pod on each node.
    let webs: Vec<Pod> = f
        .pods("default", "app=web")
        .into_iter()
        .filter(pod_ready)
        .collect();
    assert_eq!(webs.len(), 2, "two ready web pods");
    let mut nodes_seen = Vec::new();
    for web in &webs {
        let pid = container_process(&container_id(web), "kvpn-lab-server");
        let resolv = std::fs::read_to_string(format!("/proc/{pid}/root/etc/resolv.conf"))
            .unwrap_or_else(|e| panic!("resolv.conf of {}: {e}", pod_name(web)));
        let nameservers: Vec<&str> = resolv
            .lines()
            .filter_map(|l| l.strip_prefix("nameserver "))
            .map(str::trim)
            .collect();
        assert_eq!(nameservers, vec![dns_ip.to_string()], "{resolv}");
        let search: Vec<&str> = resolv
            .lines()
            .find_map(|l| l.strip_prefix("search "))
            .map(|s| s.split_whitespace().collect())
            .unwrap_or_default();
        assert_eq!(
            search,
            [
                "default.svc.cluster.local",
                "svc.cluster.local",
                "cluster.local"
            ],
            "{resolv}"
        );
        assert!(resolv.contains("ndots:5"), "{resolv}");
        let server = format!("@{}", nameservers[0]);
        // The short name as the pod's resolver expands it with its first search
        // domain, and the name of the other namespace's Service.
        let expanded = format!("web.{}", search[0]);
        for (name, want) in [
            (expanded.clone(), web_ip.clone()),
            (
                "web.dev.svc.cluster.local".to_owned(),
                cluster_ip(&f, "dev", "web"),
            ),
        ] {
            let d = dig_in_netns(pid, &[&server, &name, "A"]);
            assert_eq!(
                d.status,
                "NOERROR",
                "{} asking {name}: {}",
                pod_name(web),
                d.raw
            );
            assert_eq!(
                d.a(),
                vec![want],
                "{} asking {name}: {}",
                pod_name(web),
                d.raw
            );
        }
        let d = dig_in_netns(
            pid,
            &[&server, "+tcp", "nosuchsvc.default.svc.cluster.local"],
        );
        assert_eq!(d.status, "NXDOMAIN", "{}", d.raw);
        nodes_seen.push(
            web.spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .unwrap_or_default(),
        );
    }
    nodes_seen.sort();
    nodes_seen.dedup();
    assert_eq!(
        nodes_seen.len(),
        2,
        "web pods on both nodes: {nodes_seen:?}"
    );

    // The laptop: its own resolver (dnsmasq) first, then kvpn connect.
    let upstream = Upstream::start(&f);
    write_laptop_resolv(&f, LAPTOP_RESOLV);
    let t_connect = Instant::now();
    let out = connect_default(&f);
    let connect = t_connect.elapsed();
    assert!(
        out.contains(&format!("DNS: forwarder on {FORWARDER}:53")),
        "{out}"
    );
    f.wait_state("connected", Duration::from_secs(30));

    let t_dns = Instant::now();
    for name in ["web.default", "web.default.svc.cluster.local"] {
        let d = dig(&f, &[name, "A"]);
        assert_eq!(
            d.status,
            "NOERROR",
            "{name}: {}\n{}",
            d.raw,
            f.diagnostics()
        );
        assert_eq!(d.a(), vec![web_ip.clone()], "{name}: {}", d.raw);
    }
    let first_names = t_dns.elapsed();
    // The short name through the search list kvpn put first (connected namespace).
    let d = dig(&f, &["+search", "web", "A"]);
    assert_eq!(d.a(), vec![web_ip.clone()], "web (+search): {}", d.raw);
    assert_eq!(getent(&f, "web").as_deref(), Some(web_ip.as_str()));
    let d = dig(&f, &["nosuchsvc.default.svc.cluster.local"]);
    assert_eq!(d.status, "NXDOMAIN", "{}", d.raw);

    // A real HTTP client by name.
    let o = f.laptop(&["curl", "-sS", "--max-time", "5", "http://web.default/"]);
    let body = text(&o.stdout);
    assert!(
        o.status.success(),
        "curl http://web.default/: {}{}\n{}",
        body,
        text(&o.stderr),
        f.diagnostics()
    );
    let page = PageInfo::parse(&body).unwrap_or_else(|| panic!("not a lab page: {body:?}"));
    assert!(
        webs.iter().any(|p| pod_name(p) == page.pod),
        "web.default answered from {page:?}"
    );
    assert!(matches!(page.pod_ip, IpAddr::V4(_)));
    upstream.assert_no_cluster_names(&f, &["web", "web.default", "nosuchsvc"]);

    f.kvpn_ok(&["disconnect"]);
    let t_down = Instant::now();
    drop(f);
    let down = t_down.elapsed();
    let left = node::leftovers(&lab_id, &nodes_dir, 2);
    assert!(left.is_empty(), "left behind: {left:#?}");
    let netns = kvpn_lab::lab_netns(&lab_id).unwrap_or_else(|e| panic!("list netns: {e}"));
    assert!(netns.is_empty(), "netns left behind: {netns:?}");
    let t_gone = Instant::now();
    while !container_pids(&dns_container).is_empty() {
        assert!(
            t_gone.elapsed() < Duration::from_secs(10),
            "DNS container processes left behind: {:?}",
            container_pids(&dns_container)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "real-node DNS: lab up {:.1} s (DNS pod included), kvpn connect {:.1} s, first two names {} ms, down {:.1} s, total {:.1} s",
        lab_up.as_secs_f64(),
        connect.as_secs_f64(),
        first_names.as_millis(),
        down.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
}
