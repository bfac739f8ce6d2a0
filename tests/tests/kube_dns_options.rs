//! The DNS and routing options users of KubeVPN and Telepresence expect (issue 29
//! item 8), end to end in the Kubernetes lab:
//! - `--extra-domain NAME`: resolved through the cluster DNS, its addresses routed
//!   through the TUN device; a name the cluster DNS does not know only warns and
//!   connect goes on;
//! - `--include-suffix S`: the forwarder sends names under S to the cluster DNS
//!   (never to the laptop's resolver);
//! - `--exclude-suffix S`: names under S go to the laptop's resolver, also under
//!   the cluster domain;
//! - `--never-proxy CIDR`: kept off the tunnel inside a cluster range;
//!
//! all of them in connect's output, `kvpn status` and `-o json`.
//!
//! The lab's cluster DNS answers pod names for any address (CoreDNS's "pods
//! insecure"): `198-18-5-44.default.pod.cluster.local` is 198.18.5.44, outside
//! every cluster range, which stands for a name the cluster resolves to an
//! address the laptop would not route (a stub domain's answer).

use kvpn_tests::dns_lab::*;
use kvpn_tests::kube_lab::KubeFixture;
use kvpn_tests::text;

const EXTRA: &str = "198-18-5-44.default.pod.cluster.local";
const EXTRA_IP: &str = "198.18.5.44";
const MISSING: &str = "nosuch.default.svc.cluster.local";
/// Routed nowhere before connect: the laptop has no route for it.
const NEVER: &str = "10.244.1.240/28";
const NEVER_IP: &str = "10.244.1.245";

fn route_get(f: &KubeFixture, ip: &str) -> String {
    text(&f.laptop(&["ip", "route", "get", ip]).stdout)
}

#[test]
fn extra_domain_include_exclude_suffix_and_never_proxy_work_and_are_shown() {
    let f = KubeFixture::new();
    let upstream = Upstream::start(&f);
    write_laptop_resolv(&f, LAPTOP_RESOLV);
    let kubeconfig = f.user_kubeconfig();
    let out = f.kvpn(&[
        "connect",
        "--kubeconfig",
        &kubeconfig,
        "--namespace",
        "default",
        "--extra-domain",
        EXTRA,
        "--extra-domain",
        MISSING,
        "--include-suffix",
        "corp.test",
        "--exclude-suffix",
        ".kube-system.svc.cluster.local",
        "--never-proxy",
        NEVER,
    ]);
    // Warnings go to stderr.
    let said = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(
        out.status.success(),
        "connect failed:\n{said}\n{}",
        f.diagnostics()
    );
    let session = f.session();
    let tun = session["tun_name"].as_str().unwrap_or_default().to_owned();

    // --extra-domain: routed through the tunnel at once, said by connect.
    assert!(
        route_get(&f, EXTRA_IP).contains(&format!("dev {tun}")),
        "{EXTRA_IP} ({EXTRA}) not routed through {tun}: {}\n{said}\n{}",
        route_get(&f, EXTRA_IP),
        f.diagnostics()
    );
    assert!(
        said.contains(&format!(
            "extra domain {EXTRA} resolved through the cluster DNS: {EXTRA_IP} routed through {tun}"
        )),
        "{said}"
    );
    // Traffic to the --extra-domain name: a host at EXTRA_IP outside every
    // cluster range (a second address of one web pod, on its loopback, routed
    // by the node: what a stub domain's server behind the cluster network is)
    // answers curl by name through the tunnel.
    let web = f
        .pods("default", "app=web")
        .into_iter()
        .find(kvpn_tests::kube_lab::pod_ready)
        .unwrap_or_else(|| panic!("no ready web pod"));
    let pod_ip = kvpn_tests::kube_lab::pod_ip(&web).to_string();
    let add = f
        .pod_netns(&web)
        .exec(&["ip", "addr", "add", &format!("{EXTRA_IP}/32"), "dev", "lo"])
        .unwrap_or_else(|e| panic!("address in the web pod: {e:#}"));
    assert!(add.status.success(), "{}", text(&add.stderr));
    let route = f
        .lab()
        .netns_lab()
        .node()
        .netns()
        .exec(&[
            "ip",
            "route",
            "add",
            &format!("{EXTRA_IP}/32"),
            "via",
            &pod_ip,
        ])
        .unwrap_or_else(|e| panic!("route in the node: {e:#}"));
    assert!(route.status.success(), "{}", text(&route.stderr));
    let page = f.laptop(&[
        "curl",
        "-sS",
        "--max-time",
        "10",
        &format!("http://{EXTRA}:{}/", kvpn_lab::HTTP_PORT),
    ]);
    assert!(
        page.status.success()
            && text(&page.stdout)
                .contains(&format!("pod: {}", kvpn_tests::kube_lab::pod_name(&web))),
        "curl to the --extra-domain name {EXTRA}: {} {}\n{}",
        text(&page.stdout),
        text(&page.stderr),
        f.diagnostics()
    );

    // A name the cluster does not know: a warning, connect went on.
    assert!(
        said.lines()
            .any(|l| l.contains(&format!("extra domain {MISSING}")) && l.contains("NXDOMAIN")),
        "{said}"
    );

    // --never-proxy: the range stays off the tunnel, the rest of the pod CIDR not.
    assert!(
        !route_get(&f, NEVER_IP).contains(&format!("dev {tun}")),
        "{NEVER_IP} is inside --never-proxy {NEVER}: {}",
        route_get(&f, NEVER_IP)
    );
    assert!(route_get(&f, "10.244.1.200").contains(&format!("dev {tun}")));
    assert!(
        said.lines().any(|l| l.contains("kept off the tunnel")
            && l.contains(NEVER)
            && l.contains("--never-proxy")),
        "{said}"
    );

    // --include-suffix: host.corp.test goes to the cluster DNS (which refuses
    // names outside its domain), not to the laptop's dnsmasq that knows it.
    let before = upstream.queries().len();
    let d = dig(
        &f,
        &[&format!("@{FORWARDER}"), "+time=3", "+tries=1", CORP_HOST.0],
    );
    assert!(
        !d.a().contains(&CORP_HOST.1.to_owned()),
        "{} answered by the laptop's resolver despite --include-suffix corp.test: {}",
        CORP_HOST.0,
        d.raw
    );
    assert!(
        !upstream.queries()[before..]
            .iter()
            .any(|q| q == CORP_HOST.0),
        "the laptop's resolver was asked {}: {:?}",
        CORP_HOST.0,
        upstream.queries()
    );
    // --exclude-suffix: a cluster name under it goes to the laptop's resolver
    // and gets no cluster answer.
    let kube_dns = "kube-dns.kube-system.svc.cluster.local";
    let d = dig(
        &f,
        &[&format!("@{FORWARDER}"), "+time=3", "+tries=1", kube_dns],
    );
    assert!(
        !d.a().contains(&CLUSTER_DNS.to_owned()),
        "{kube_dns} got the cluster's answer despite --exclude-suffix: {}",
        d.raw
    );
    assert!(
        upstream.queries().iter().any(|q| q == kube_dns),
        "the laptop's resolver was not asked {kube_dns}: {:?}",
        upstream.queries()
    );
    // The rest of cluster DNS as before.
    let web = cluster_ip(&f, "default", "web");
    let d = dig(
        &f,
        &[&format!("@{FORWARDER}"), "web.default.svc.cluster.local"],
    );
    assert_eq!(d.a(), vec![web], "{}", d.raw);

    // status, human …
    let table = f.kvpn_ok(&["status"]);
    for want in [
        format!("extra domain {EXTRA} resolved through the cluster DNS: {EXTRA_IP}"),
        format!("extra domain {MISSING}: does not exist"),
        "(--include-suffix): corp.test".to_owned(),
        "(--exclude-suffix): kube-system.svc.cluster.local".to_owned(),
        format!("(--never-proxy): {NEVER}"),
    ] {
        assert!(table.contains(&want), "status lacks {want:?}:\n{table}");
    }
    // … and -o json.
    assert_eq!(
        session["never_proxy"],
        serde_json::json!([NEVER]),
        "{session:#}"
    );
    assert_eq!(
        session["include_suffixes"],
        serde_json::json!(["corp.test"])
    );
    assert_eq!(
        session["exclude_suffixes"],
        serde_json::json!(["kube-system.svc.cluster.local"])
    );
    let extra = session["extra_domains"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let find = |n: &str| {
        extra
            .iter()
            .find(|e| e["name"] == n)
            .cloned()
            .unwrap_or_else(|| panic!("no extra_domains entry {n}: {extra:#?}"))
    };
    assert_eq!(find(EXTRA)["addresses"], serde_json::json!([EXTRA_IP]));
    assert_eq!(find(EXTRA)["error"], serde_json::Value::Null);
    assert!(
        find(MISSING)["error"]
            .as_str()
            .is_some_and(|e| e.contains("NXDOMAIN")),
        "{extra:#?}"
    );
    let kept = session["kept_out"].as_array().cloned().unwrap_or_default();
    assert!(
        kept.iter()
            .any(|k| k["address"] == NEVER && k["why"] == "--never-proxy"),
        "{kept:#?}"
    );
}
