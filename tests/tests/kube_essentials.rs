//! Case rt-02 (never route the essentials): a cluster range that covers the
//! laptop's API server, a default gateway and a nameserver leaves each of them
//! on the laptop's own path, the kube API keeps working, and connect and status
//! say which addresses were kept off the tunnel and why (issue 29 item 3: the
//! split was silent).

use kvpn_tests::kube_lab::KubeFixture;
use kvpn_tests::text;

/// The lab's API server (the node's uplink address).
const API_SERVER: &str = "172.31.255.1";
/// A default gateway of the laptop on a link of the test's own.
const GATEWAY: &str = "172.31.9.2";
/// A nameserver of the laptop.
const NAMESERVER: &str = "172.31.7.53";
/// The range routed through the tunnel (`--cidr`), covering all three.
const RANGE: &str = "172.31.0.0/16";

fn laptop_ok(f: &KubeFixture, args: &[&str]) -> String {
    let out = f.laptop(args);
    assert!(
        out.status.success(),
        "laptop {args:?}: {}",
        text(&out.stderr)
    );
    text(&out.stdout)
}

fn route_dev(f: &KubeFixture, ip: &str) -> String {
    laptop_ok(f, &["ip", "route", "get", ip])
        .split_whitespace()
        .skip_while(|w| *w != "dev")
        .nth(1)
        .unwrap_or_default()
        .to_owned()
}

#[test]
fn rt_02_never_route_the_essentials() {
    let f = KubeFixture::new();
    let id = f.lab().netns_lab().id().to_owned();
    let (g, p) = (format!("kv{id}g0"), format!("kv{id}g1"));
    laptop_ok(
        &f,
        &["ip", "link", "add", &g, "type", "veth", "peer", "name", &p],
    );
    for dev in [&g, &p] {
        laptop_ok(&f, &["ip", "link", "set", dev, "up"]);
    }
    laptop_ok(&f, &["ip", "addr", "add", "172.31.9.1/24", "dev", &g]);
    laptop_ok(
        &f,
        &[
            "ip", "route", "add", "default", "via", GATEWAY, "dev", &g, "metric", "900",
        ],
    );
    let resolv = f.laptop_resolv_conf();
    let mut conf = std::fs::read_to_string(&resolv)
        .unwrap_or_else(|e| panic!("read {}: {e}", resolv.display()));
    conf.push_str(&format!("nameserver {NAMESERVER}\n"));
    std::fs::write(&resolv, conf).unwrap_or_else(|e| panic!("write {}: {e}", resolv.display()));
    let before: Vec<String> = [API_SERVER, GATEWAY, NAMESERVER]
        .iter()
        .map(|ip| route_dev(&f, ip))
        .collect();

    let kubeconfig = f.user_kubeconfig();
    let connect = [
        "connect",
        "--kubeconfig",
        &kubeconfig,
        "--namespace",
        "default",
        "--cidr",
        RANGE,
        "--allow-route-conflict",
    ];
    let said = f.kvpn_ok(&connect);
    let session = f.session();
    let tun = session["tun_name"].as_str().unwrap_or_default().to_owned();
    assert!(!tun.is_empty(), "{session:#}");

    // Each essential keeps its route; the rest of the range goes to the cluster.
    for (ip, was) in [API_SERVER, GATEWAY, NAMESERVER].iter().zip(&before) {
        assert_eq!(
            route_dev(&f, ip),
            *was,
            "{ip} moved into the tunnel: {}",
            laptop_ok(&f, &["ip", "route"])
        );
    }
    assert_eq!(route_dev(&f, "172.31.100.1"), tun);
    // The kube API still works: a second connect asks the API server and the
    // user daemon, and finds the session.
    let again = f.kvpn_ok(&connect);
    assert!(again.contains("Already connected"), "{again}");

    // Connect and status name each essential inside the range, with why.
    let table = f.kvpn_ok(&["status"]);
    for (ip, why) in [
        (API_SERVER, "the API server"),
        (GATEWAY, "a default gateway"),
        (NAMESERVER, "a nameserver"),
    ] {
        for (what, out) in [("connect", &said), ("status", &table)] {
            assert!(
                out.lines().any(|l| l.contains("kept off the tunnel")
                    && l.contains(ip)
                    && l.contains(RANGE)
                    && l.contains(why)),
                "{what} does not say {ip} ({why}) is kept off the tunnel:\n{out}"
            );
        }
        let kept = session["kept_out"].as_array().cloned().unwrap_or_default();
        assert!(
            kept.iter().any(|k| k["address"] == ip
                && k["why"] == why
                && k["cidr"] == RANGE
                && k["kind"] == "extra"),
            "-o json kept_out lacks {ip}: {kept:#?}"
        );
    }
}
