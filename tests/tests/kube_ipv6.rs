//! End-to-end tests of dual stack (issue [dns-fidelity] item 4) on a dual-stack
//! Kubernetes lab ([`KubeFixture::dual_stack`]): kube-apiserver 1.20 with
//! `IPv6DualStack` and two service ranges, pods with an IPv4 and an IPv6 address,
//! the sample Services `PreferDualStack` with an IPv6 ClusterIP, and the laptop
//! reaching only the API server (every packet rides the port-forward).
//!
//! After `kvpn connect`, IPv6 pod and service ranges route through the tunnel:
//! curl to the IPv6 ClusterIP and to a pod's IPv6 address, UDP echo and ping over
//! IPv6, AAAA from the cluster DNS, and the backend sees the manager pod's IPv6
//! address (snat). IPv4 keeps working in the same session. rt-08 on the same
//! cluster: a laptop with IPv6 disabled connects IPv4-only with one warning.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kvpn_lab::protocol::PageInfo;
use kvpn_lab::{Addressing, HTTP_PORT, WEB_SERVICE_PORT};
use kvpn_tests::dns_lab::dig;
use kvpn_tests::kube_lab::{KubeFixture, web};
use kvpn_tests::text;

/// The dual-stack lab's address plan (the fixture's).
fn plan() -> Addressing {
    Addressing::default().dual_stack()
}

/// `default/web`'s IPv6 ClusterIP (offset 100 of the IPv6 service CIDR).
fn web_v6() -> Ipv6Addr {
    plan().ipv6_service_ip(100).expect("dual-stack plan")
}

/// `default/udp-echo`'s IPv6 ClusterIP (offset 102).
fn udp_echo_v6() -> Ipv6Addr {
    plan().ipv6_service_ip(102).expect("dual-stack plan")
}

/// A pod's addresses as its status reports them (`podIPs`).
/// A pod's address of one family as its status reports it (`podIPs`).
fn pod_ip_of(p: &Pod, v6: bool) -> IpAddr {
    p.status
        .as_ref()
        .and_then(|s| s.pod_ips.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|i| i.ip.parse::<IpAddr>().ok())
        .find(|ip| ip.is_ipv6() == v6)
        .unwrap_or_else(|| {
            panic!(
                "pod {:?}: no IPv{} podIP: {:?}",
                p.metadata.name,
                if v6 { 6 } else { 4 },
                p.status
            )
        })
}

fn pod_ipv6(p: &Pod) -> Ipv6Addr {
    match pod_ip_of(p, true) {
        IpAddr::V6(a) => a,
        IpAddr::V4(a) => unreachable!("{a} is IPv4"),
    }
}

fn web_pods(f: &KubeFixture) -> Vec<Pod> {
    let api: Api<Pod> = Api::namespaced(f.admin(), "default");
    f.block_on(api.list(&ListParams::default().labels("app=web")))
        .unwrap_or_else(|e| panic!("list web pods: {e}"))
        .items
}

/// `curl` from the laptop; the parsed lab page.
fn curl_page(f: &KubeFixture, args: &[&str], url: &str) -> PageInfo {
    let mut all = vec!["curl", "-sS", "--max-time", "5"];
    all.extend_from_slice(args);
    all.push(url);
    let out = f.laptop(&all);
    assert!(
        out.status.success(),
        "curl {url} failed: {}\n{}",
        text(&out.stderr),
        f.diagnostics()
    );
    PageInfo::parse(&text(&out.stdout))
        .unwrap_or_else(|| panic!("not a lab page from {url}: {:?}", text(&out.stdout)))
}

fn connect(f: &KubeFixture) -> String {
    let kubeconfig = f.user_kubeconfig();
    let out = f.kvpn(&["connect", "--kubeconfig", &kubeconfig]);
    let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(
        out.status.success(),
        "connect failed:\n{all}\n{}",
        f.diagnostics()
    );
    all
}

#[test]
fn dual_stack_ipv6_pods_and_services_route_through_the_tunnel() {
    let f = KubeFixture::dual_stack();
    let out = connect(&f);
    assert!(
        !out.to_ascii_lowercase().contains("warn"),
        "a dual-stack laptop connects without warnings:\n{out}"
    );

    // Status: both tunnel IPs, IPv6 routes for the cluster's IPv6 ranges.
    let s = f.session();
    let v4: Ipv4Addr = s["tunnel_ip"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("tunnel_ip in {s:#}"));
    let v6: Ipv6Addr = s["tunnel_ip_v6"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("tunnel_ip_v6 in {s:#}"));
    assert_eq!(v6, kvpn_proto::tunnel::ipv6_tunnel_ip(v4), "{s:#}");
    let routes = s["routes"].to_string();
    let v6_plan = plan().ipv6.expect("dual-stack plan");
    assert!(
        routes.contains(&v6_plan.node_pod_cidr.to_string())
            || routes.contains(&v6_plan.pod_cidr.to_string()),
        "an IPv6 pod range is routed: {routes}"
    );
    assert!(
        routes.contains(&v6_plan.service_cidr.to_string())
            || routes.contains(&web_v6().to_string()),
        "the IPv6 service range (or the IPv6 ClusterIPs) are routed: {routes}"
    );
    let human = f.kvpn_ok(&["status"]);
    assert!(
        human.contains(&format!("{v4},{v6}")),
        "status table shows both: {human}"
    );
    let tun = s["tun_name"].as_str().unwrap_or_default().to_owned();
    let addrs = text(&f.laptop(&["ip", "-6", "addr", "show", "dev", &tun]).stdout);
    assert!(
        addrs.contains(&v6.to_string()),
        "IPv6 tunnel IP on {tun}: {addrs}"
    );

    let manager = f.wait_manager_pod(Duration::from_secs(60), |_| true);
    let manager_v6 = pod_ipv6(&manager);
    let manager_v4 = pod_ip_of(&manager, false);
    let webs = web_pods(&f);
    let web_v6s: Vec<Ipv6Addr> = webs.iter().map(pod_ipv6).collect();

    // TCP to the IPv6 ClusterIP: a web pod answers at its IPv6 address and sees
    // the manager pod's IPv6 address (snat).
    let url = format!("http://[{}]:{WEB_SERVICE_PORT}/", web_v6());
    let p = curl_page(&f, &["-6"], &url);
    assert!(p.pod.starts_with("web-"), "answered by {p:?}");
    assert!(
        matches!(p.pod_ip, IpAddr::V6(a) if web_v6s.contains(&a)),
        "the ClusterIP leads to a web pod's IPv6 address {web_v6s:?}: {p:?}"
    );
    assert_eq!(
        p.client.ip(),
        IpAddr::V6(manager_v6),
        "snat: the backend sees the manager pod"
    );
    eprintln!("IPv6 ClusterIP {url}: {p:?}; routes {routes}");

    // TCP to a pod's IPv6 address.
    let target = &webs[0];
    let url = format!("http://[{}]:{HTTP_PORT}/", pod_ipv6(target));
    let p = curl_page(&f, &[], &url);
    assert_eq!(
        Some(p.pod.as_str()),
        target.metadata.name.as_deref(),
        "{p:?}"
    );
    assert_eq!(p.pod_ip, IpAddr::V6(pod_ipv6(target)));

    // UDP echo over IPv6 (ClusterIP), the manager pod's IPv6 address as source.
    let peer = f.udp_peer(SocketAddr::from((
        udp_echo_v6(),
        kvpn_lab::ECHO_SERVICE_PORT,
    )));
    assert_eq!(peer.ip(), IpAddr::V6(manager_v6), "UDP over IPv6: {peer}");
    eprintln!(
        "UDP over IPv6 to [{}]: the backend saw {peer}",
        udp_echo_v6()
    );

    // ICMPv6 echo to a pod.
    let ping_target = pod_ipv6(target).to_string();
    let out = f.laptop(&[
        "ping",
        "-6",
        "-c",
        "2",
        "-i",
        "0.2",
        "-W",
        "2",
        &ping_target,
    ]);
    assert!(
        out.status.success(),
        "ping -6 {ping_target}: {}{}\n{}",
        text(&out.stdout),
        text(&out.stderr),
        f.diagnostics()
    );

    // AAAA from the cluster DNS through the tunnel; A still IPv4.
    let d = dig(&f, &["AAAA", "web.default.svc.cluster.local"]);
    assert_eq!(d.typed("AAAA"), vec![web_v6().to_string()], "{}", d.raw);
    eprintln!(
        "dig AAAA web.default.svc.cluster.local: {:?}; {}",
        d.typed("AAAA"),
        text(&out.stdout).lines().last().unwrap_or("")
    );
    let d = dig(&f, &["A", "web.default.svc.cluster.local"]);
    assert_eq!(
        d.a(),
        vec![kvpn_lab::WEB_CLUSTER_IP.to_string()],
        "{}",
        d.raw
    );

    // IPv4 in the same session.
    let p = f.page(web());
    assert!(p.pod.starts_with("web-"), "{p:?}");
    assert_eq!(p.client.ip(), manager_v4, "IPv4 snat: {p:?}");
}

/// rt-08 on a dual-stack cluster: with IPv6 disabled on the laptop, connect is
/// IPv4-only with exactly one warning naming the IPv6 ranges left out; no IPv6
/// tunnel IP, IPv4 works.
#[test]
fn rt_08_dual_stack_cluster_ipv6_disabled_laptop_connects_ipv4_only() {
    let f = KubeFixture::dual_stack();
    f.disable_laptop_ipv6();
    let out = connect(&f);
    let warnings: Vec<&str> = out
        .lines()
        .filter(|l| l.to_ascii_lowercase().contains("warn"))
        .collect();
    assert_eq!(warnings.len(), 1, "a single warning:\n{out}");
    assert!(
        warnings[0].contains("IPv6") && warnings[0].contains("fd00:10:"),
        "the warning names the IPv6 ranges left out: {:?}",
        warnings[0]
    );
    let s = f.session();
    assert!(s["tunnel_ip_v6"].is_null(), "no IPv6 tunnel IP: {s:#}");
    let routes = s["routes"].to_string();
    assert!(!routes.contains("fd00:"), "IPv4-only routes: {routes}");
    let p = f.page(web());
    assert!(p.pod.starts_with("web-"), "{p:?}");
}
