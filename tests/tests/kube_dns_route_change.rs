//! Issue 29 item 1: with a laptop route that conflicts with the service CIDR
//! (`--allow-route-conflict`), the DNS forwarder's socket to the cluster DNS was
//! opened before that address's /32 through the TUN device existed; the socket
//! kept the laptop's LAN source address, the manager dropped every question as a
//! bad source, and cluster DNS stayed dead for the whole session.
//!
//! Made deterministic here: the laptop netns gets a bridge owning the whole
//! service CIDR (the conflict of the report) and a policy rule that sends the
//! cluster DNS address through that bridge, so the forwarder's *first* question
//! opens its socket with the bridge's address as source whatever the timing of
//! kvpn's /32 pin. Then the rule goes (the route through the TUN device is what
//! the routes give now) and cluster names must resolve within a few seconds: the
//! forwarder checks the route's source before each question and reopens a
//! socket whose source changed, counted in `kvpn status`.

use std::time::{Duration, Instant};

use kvpn_tests::dns_lab::*;
use kvpn_tests::kube_lab::KubeFixture;
use kvpn_tests::text;

/// The policy table (the laptop netns is the lab's own: any number is free).
const TABLE: &str = "29001";
const BRIDGE_ADDR: &str = "10.96.255.1";

fn laptop_ok(f: &KubeFixture, args: &[&str]) -> String {
    let out = f.laptop(args);
    assert!(
        out.status.success(),
        "laptop {args:?}: {}",
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// A bridge `name` with `addr` (its prefix route is the laptop's own) and a
/// veth port for carrier, in the lab's laptop netns (removed with it).
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

/// Local addresses of the forwarder's UDP sockets to the cluster DNS.
fn forwarder_sources(f: &KubeFixture) -> Vec<String> {
    let out = laptop_ok(f, &["ss", "-unH", "dst", &format!("{CLUSTER_DNS}:53")]);
    // `… <local ip:port> <peer ip:port> …`: the field before the peer.
    let peer = format!("{CLUSTER_DNS}:53");
    out.lines()
        .filter_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            let at = cols.iter().position(|c| *c == peer)?;
            let local = cols.get(at.checked_sub(1)?)?;
            local.rsplit_once(':').map(|(ip, _)| ip.to_owned())
        })
        .collect()
}

fn ask(f: &KubeFixture, name: &str) -> Dig {
    let out = f.laptop(&["dig", "+time=2", "+tries=1", &format!("@{FORWARDER}"), name]);
    parse_dig(&text(&out.stdout))
}

#[test]
fn cluster_dns_works_after_its_route_moves_to_the_tunnel_once_the_forwarder_asked() {
    let f = KubeFixture::new();
    let id = f.lab().netns_lab().id().to_owned();
    let br = format!("kv{id}dr");
    bridge(&f, &br, &format!("{BRIDGE_ADDR}/12"));
    laptop_ok(
        &f,
        &[
            "ip",
            "route",
            "add",
            &format!("{CLUSTER_DNS}/32"),
            "dev",
            &br,
            "table",
            TABLE,
        ],
    );
    laptop_ok(
        &f,
        &[
            "ip",
            "rule",
            "add",
            "to",
            &format!("{CLUSTER_DNS}/32"),
            "lookup",
            TABLE,
            "pref",
            "50",
        ],
    );
    let kubeconfig = f.user_kubeconfig();
    f.kvpn_ok(&[
        "connect",
        "--kubeconfig",
        &kubeconfig,
        "--namespace",
        "default",
        "--allow-route-conflict",
    ]);
    let tun = f.session()["tun_name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let tunnel_ip = f.session()["tunnel_ip"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(!tunnel_ip.is_empty(), "{:#}", f.session());
    // kvpn pins the cluster DNS's /32 through the TUN device (main table).
    let t0 = Instant::now();
    while !laptop_ok(&f, &["ip", "route", "show", &format!("{CLUSTER_DNS}/32")])
        .contains(&format!("dev {tun}"))
    {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{CLUSTER_DNS}/32 not pinned through {tun}: {}\n{}",
            laptop_ok(&f, &["ip", "route", "show", "table", "all"]),
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // The first question: the rule still sends the cluster DNS to the bridge, so
    // the forwarder's socket gets the bridge's address as source.
    let d = ask(&f, "web.default.svc.cluster.local");
    assert!(d.a().is_empty(), "the bridge does not answer: {}", d.raw);
    assert_eq!(
        forwarder_sources(&f),
        vec![BRIDGE_ADDR.to_owned()],
        "precondition: the forwarder's socket was opened with the bridge's source"
    );

    // The route moves to the tunnel: cluster names resolve again, promptly.
    laptop_ok(&f, &["ip", "rule", "del", "pref", "50"]);
    let web = cluster_ip(&f, "default", "web");
    let t0 = Instant::now();
    loop {
        let d = ask(&f, "web.default.svc.cluster.local");
        if d.a() == vec![web.clone()] {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "cluster DNS still dead {:?} after its route moved to {tun}: {}\nsockets {:?}\n{}",
            t0.elapsed(),
            d.raw,
            forwarder_sources(&f),
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("cluster DNS back {:?} after the route change", t0.elapsed());
    for _ in 0..5 {
        assert_eq!(
            ask(&f, "web.default.svc.cluster.local").a(),
            vec![web.clone()]
        );
    }
    // The old socket stays only for answers to questions sent on it (the
    // forwarder's exchange timeout, 2 s), then only the tunnel IP is a source.
    let t0 = Instant::now();
    loop {
        let sources = forwarder_sources(&f);
        if !sources.is_empty() && sources.iter().all(|s| *s == tunnel_ip) {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "every socket of the forwarder to the cluster DNS has the tunnel IP {tunnel_ip} \
             as source: {sources:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("old socket closed {:?} later", t0.elapsed());
    let c = &f.session()["dns_counters"];
    assert!(
        c["cluster_socket_reopened"].as_u64().unwrap_or(0) >= 1,
        "{c:#}"
    );
    let table = f.kvpn_ok(&["status"]);
    assert!(
        table.contains("reopened its socket to the cluster DNS"),
        "{table}"
    );
}
