//! Several clusters and several laptops ([kube-connect] items 7 and 8) end to end on
//! the Kubernetes lab: real kube-apiservers, the real traffic manager installed by
//! `kvpn connect`, every packet through `pods/portforward`.
//!
//! - Two clusters at once: a second lab with other CIDRs ([`Addressing::second`])
//!   has its uplink in the first lab's laptop netns; one root daemon there holds a
//!   session to each (two TUN devices, disjoint routes) and `disconnect <id>` ends
//!   one of them alone.
//! - Laptop to laptop: a second laptop netns on the first cluster, with its own
//!   root daemon and kvpn config folder (its own client id, so its own lease); the
//!   two laptops reach each other's tunnel IPs through the manager with no route
//!   added by hand.
//!
//! Needs the workspace binaries (`cargo build --bins`, then `KVPN_BIN_DIR`) and the
//! Kubernetes binaries of `scripts/build-kubernetes.sh`.

use std::collections::BTreeSet;
use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kvpn_lab::k8s::K8sLab;
use kvpn_lab::{Addressing, HTTP_PORT, WEB_SERVICE_PORT};
use kvpn_tests::kube_lab::{KubeFixture, pod_ip, pod_name};
use kvpn_tests::text;

/// `a.b.c.d/len` as (network, mask); panics on anything else.
fn cidr(s: &str) -> (u32, u32) {
    let (ip, len) = s.split_once('/').unwrap_or((s, "32"));
    let ip: Ipv4Addr = ip.parse().unwrap_or_else(|e| panic!("{s}: {e}"));
    let len: u32 = len.parse().unwrap_or_else(|e| panic!("{s}: {e}"));
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    (u32::from(ip) & mask, mask)
}

fn covers(route: &str, ip: Ipv4Addr) -> bool {
    let (net, mask) = cidr(route);
    u32::from(ip) & mask == net
}

fn overlap(a: &str, b: &str) -> bool {
    let ((na, ma), (nb, mb)) = (cidr(a), cidr(b));
    let m = ma & mb;
    na & m == nb & m
}

/// `default/web` pods of `lab` (admin client in the host netns).
fn web_pods(f: &KubeFixture, lab: &K8sLab) -> Vec<Pod> {
    let client = f
        .block_on(lab.admin_client())
        .unwrap_or_else(|e| panic!("admin client: {e}"));
    let api: Api<Pod> = Api::namespaced(client, "default");
    f.block_on(api.list(&ListParams::default().labels("app=web")))
        .unwrap_or_else(|e| panic!("list web pods: {e}"))
        .items
}

/// The session of `sessions` whose origin cluster is `cluster`.
fn session_of(sessions: &[serde_json::Value], cluster: &str) -> serde_json::Value {
    sessions
        .iter()
        .find(|s| s["cluster"] == cluster)
        .cloned()
        .unwrap_or_else(|| panic!("no session of cluster {cluster}: {sessions:#?}"))
}

fn str_of(v: &serde_json::Value, key: &str) -> String {
    v[key]
        .as_str()
        .unwrap_or_else(|| panic!("no {key} in {v:#}"))
        .to_owned()
}

/// Polls until every session is `connected` (and there are `n` of them).
fn wait_all_connected(f: &KubeFixture, n: usize, within: Duration) {
    let t0 = Instant::now();
    loop {
        let sessions = f.sessions();
        if sessions.len() == n && sessions.iter().all(|s| s["state"] == "connected") {
            return;
        }
        assert!(
            t0.elapsed() < within,
            "not {n} connected sessions within {within:?}: {sessions:#?}\n{}",
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `curl` from the laptop netns; its output (the lab page), which must come.
fn curl(f: &KubeFixture, ip: Ipv4Addr) -> String {
    let url = format!("http://{ip}:{WEB_SERVICE_PORT}/");
    let out = f.laptop(&["curl", "-sS", "--max-time", "5", &url]);
    assert!(
        out.status.success(),
        "curl {url}: {}{}\n{}",
        text(&out.stdout),
        text(&out.stderr),
        f.diagnostics()
    );
    text(&out.stdout)
}

/// Item 7: one laptop, two clusters, two sessions; each cluster's ClusterIP answers
/// with its own backends; disconnecting one leaves the other untouched.
#[test]
fn two_clusters_at_once_from_one_laptop_and_disconnect_one() {
    let mut f = KubeFixture::new();
    let b = f.add_cluster(Addressing::second());
    let a_addr = Addressing::default();
    let b_addr = Addressing::second();
    let a_cluster = f.cluster_name().to_owned();
    let b_cluster = f.cluster(b).state().cluster_name.clone();
    let b_kubeconfig = f
        .cluster(b)
        .laptop_user_kubeconfig()
        .to_string_lossy()
        .into_owned();

    // Before: neither cluster's ClusterIP is reachable from the laptop.
    for ip in [a_addr.web_cluster_ip(), b_addr.web_cluster_ip()] {
        let before = f.http_get(
            SocketAddr::from((ip, WEB_SERVICE_PORT)),
            Duration::from_secs(1),
        );
        assert!(before.is_err(), "{ip} reachable before connect: {before:?}");
    }

    let out_a = f.connect_restricted();
    assert!(out_a.contains("Installing traffic manager"), "{out_a}");
    let out_b = f.kvpn_ok(&["connect", "--kubeconfig", &b_kubeconfig]);
    assert!(
        out_b.contains("Installing traffic manager") && !out_b.contains("Already connected"),
        "the second cluster gets its own manager and session: {out_b}"
    );
    wait_all_connected(&f, 2, Duration::from_secs(20));

    // Status lists both sessions with their clusters, on two TUN devices.
    let sessions = f.sessions();
    let sa = session_of(&sessions, &a_cluster);
    let sb = session_of(&sessions, &b_cluster);
    assert_eq!(sa["server"], "https://172.31.255.1:6443", "{sa:#}");
    assert_eq!(sb["server"], "https://172.31.254.1:6443", "{sb:#}");
    assert_ne!(sa["id"], sb["id"]);
    let (tun_a, tun_b) = (str_of(&sa, "tun_name"), str_of(&sb, "tun_name"));
    assert_eq!((tun_a.as_str(), tun_b.as_str()), ("kvpn0", "kvpn1"));
    let mut tuns = f.tun_devices();
    tuns.sort();
    assert_eq!(tuns, vec!["kvpn0".to_owned(), "kvpn1".to_owned()]);
    let table = f.kvpn_ok(&["status"]);
    assert!(
        table.contains(&format!("cluster {a_cluster}"))
            && table.contains(&format!("cluster {b_cluster}")),
        "status table names both clusters: {table}"
    );

    // The kernel's routes per device: each cluster's ranges on its own TUN, no
    // overlap between the two devices.
    let routes_a = f.tun_state(&tun_a).routes;
    let routes_b = f.tun_state(&tun_b).routes;
    let web_a = web_pods(&f, f.lab());
    let web_b = web_pods(&f, f.cluster(b));
    assert_eq!((web_a.len(), web_b.len()), (2, 2), "web pods of A and B");
    let ip4 = |p: &Pod| match pod_ip(p) {
        std::net::IpAddr::V4(v4) => v4,
        other => panic!("IPv6 pod IP {other}"),
    };
    for (name, routes, own, other) in [
        ("A", &routes_a, (&web_a, a_addr), (&web_b, b_addr)),
        ("B", &routes_b, (&web_b, b_addr), (&web_a, a_addr)),
    ] {
        let mut own_ips: Vec<Ipv4Addr> = own.0.iter().map(ip4).collect();
        own_ips.push(own.1.web_cluster_ip());
        own_ips.push(own.1.dns_service_ip());
        for ip in own_ips {
            assert!(
                routes.iter().any(|r| covers(r, ip)),
                "{name}'s {ip} routed through its TUN: {routes:?}"
            );
        }
        let mut other_ips: Vec<Ipv4Addr> = other.0.iter().map(ip4).collect();
        other_ips.push(other.1.web_cluster_ip());
        for ip in other_ips {
            assert!(
                !routes.iter().any(|r| covers(r, ip)),
                "{name}'s TUN routes the other cluster's {ip}: {routes:?}"
            );
        }
    }
    for ra in &routes_a {
        for rb in &routes_b {
            assert!(!overlap(ra, rb), "{ra} (kvpn0) overlaps {rb} (kvpn1)");
        }
    }
    // Both managers lease from the default pool; the first session routes it.
    assert!(
        routes_a.iter().any(|r| r == "100.96.0.0/16"),
        "{routes_a:?}"
    );
    assert!(
        out_b.contains("100.96.0.0/16"),
        "the second connect says why it leaves the tunnel pool alone: {out_b}"
    );

    // Each ClusterIP answers with its own cluster's backends (curl, then pages
    // until both backends of each were seen).
    let names_a: BTreeSet<String> = web_a.iter().map(pod_name).collect();
    let names_b: BTreeSet<String> = web_b.iter().map(pod_name).collect();
    assert!(names_a.is_disjoint(&names_b), "{names_a:?} {names_b:?}");
    assert!(curl(&f, a_addr.web_cluster_ip()).contains("kvpn-lab-server"));
    assert!(curl(&f, b_addr.web_cluster_ip()).contains("kvpn-lab-server"));
    for (ip, names) in [
        (a_addr.web_cluster_ip(), &names_a),
        (b_addr.web_cluster_ip(), &names_b),
    ] {
        let mut seen = BTreeSet::new();
        for _ in 0..40 {
            let page = f.page(SocketAddr::from((ip, WEB_SERVICE_PORT)));
            assert!(names.contains(&page.pod), "{ip} answered by {page:?}");
            seen.insert(page.pod);
            if seen.len() == names.len() {
                break;
            }
        }
        assert_eq!(&seen, names, "{ip} balanced over its own backends");
    }
    // Pod IPs of B directly.
    for p in &web_b {
        let page = f.page(SocketAddr::new(pod_ip(p), HTTP_PORT));
        assert_eq!(page.pod, pod_name(p));
    }

    // Disconnect B alone.
    let id_b = str_of(&sb, "id");
    f.kvpn_ok(&["disconnect", &id_b]);
    let left = f.sessions();
    assert_eq!(left.len(), 1, "{left:#?}");
    assert_eq!(left[0]["id"], sa["id"], "A's session stays");
    assert_eq!(f.tun_devices(), vec![tun_a.clone()], "kvpn1 gone");
    let laptop_routes = f.laptop_routes();
    for r in &routes_b {
        assert!(
            !laptop_routes
                .iter()
                .any(|l| l.starts_with(&format!("{r} "))),
            "B's route {r} left behind: {laptop_routes:?}"
        );
    }
    assert_eq!(f.tun_state(&tun_a).routes, routes_a, "A's routes untouched");
    let gone = f.http_get(
        SocketAddr::from((b_addr.web_cluster_ip(), WEB_SERVICE_PORT)),
        Duration::from_secs(1),
    );
    assert!(
        gone.is_err(),
        "B still reachable after disconnect: {gone:?}"
    );
    assert!(curl(&f, a_addr.web_cluster_ip()).contains("kvpn-lab-server"));
    let page = f.page(SocketAddr::from((
        a_addr.web_cluster_ip(),
        WEB_SERVICE_PORT,
    )));
    assert!(names_a.contains(&page.pod), "{page:?}");
}

/// Item 8: two laptops on one cluster get distinct leases and reach each other's
/// tunnel IP (ping both ways, TCP) through the manager, with the routes connect
/// installed and nothing added by hand.
#[test]
fn two_laptops_reach_each_others_tunnel_ip() {
    let mut f = KubeFixture::new();
    f.add_laptop("laptop2");
    let routes_before = f.laptop_routes();
    f.connect_restricted();
    f.wait_state("connected", Duration::from_secs(15));
    let l2 = f.laptop_of("laptop2");
    let out2 = l2.connect_restricted();
    assert!(
        !out2.contains("Installing traffic manager"),
        "the second laptop uses the installed manager: {out2}"
    );
    let t0 = Instant::now();
    let s2 = loop {
        let sessions = l2.sessions();
        if let [s] = sessions.as_slice()
            && s["state"] == "connected"
        {
            break s.clone();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "laptop2 not connected: {sessions:#?}\n{}",
            l2.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let s1 = f.session();
    let ip1: Ipv4Addr = str_of(&s1, "tunnel_ip").parse().expect("tunnel IP 1");
    let ip2: Ipv4Addr = str_of(&s2, "tunnel_ip").parse().expect("tunnel IP 2");
    assert_ne!(ip1, ip2, "distinct leases");
    for ip in [ip1, ip2] {
        assert!(covers("100.96.0.0/16", ip), "{ip} from the pool");
    }
    // Only kvpn's own routes were added on laptop 1: the TUN's.
    let added: Vec<String> = f
        .laptop_routes()
        .into_iter()
        .filter(|r| !routes_before.contains(r))
        .collect();
    assert!(
        added.iter().all(|r| r.contains("dev kvpn0")),
        "routes other than the TUN's: {added:?}"
    );
    assert!(
        added.iter().any(|r| r.starts_with("100.96.0.0/16 ")),
        "{added:?}"
    );

    // Ping both ways (bounded retries while the sessions settle).
    let ping = |from: &dyn Fn(&[&str]) -> std::process::Output, to: Ipv4Addr| {
        let to = to.to_string();
        let t0 = Instant::now();
        loop {
            let out = from(&["ping", "-c", "3", "-i", "0.2", "-W", "2", &to]);
            if out.status.success() && text(&out.stdout).contains(" 3 received") {
                return text(&out.stdout);
            }
            assert!(
                t0.elapsed() < Duration::from_secs(15),
                "ping {to}: {}{}\n{}",
                text(&out.stdout),
                text(&out.stderr),
                f.diagnostics()
            );
        }
    };
    let p12 = ping(&|a| f.laptop(a), ip2);
    assert!(p12.contains("3 received"), "{p12}");
    let p21 = ping(&|a| l2.exec(a), ip1);
    assert!(p21.contains("3 received"), "{p21}");

    // TCP from laptop 1 to a listener on laptop 2's tunnel IP.
    let listener = l2
        .run(move || TcpListener::bind((ip2, 0)))
        .unwrap_or_else(|e| panic!("listen on {ip2} in laptop2: {e}"));
    let port = listener.local_addr().expect("local addr").port();
    let server = std::thread::spawn(move || -> std::io::Result<(SocketAddr, String)> {
        let (mut conn, peer) = listener.accept()?;
        conn.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut line = String::new();
        BufReader::new(conn.try_clone()?).read_line(&mut line)?;
        conn.write_all(format!("laptop2 got {}", line).as_bytes())?;
        Ok((peer, line))
    });
    let target = SocketAddr::from((ip2, port));
    let reply = f
        .lab()
        .netns_lab()
        .run_in(kvpn_lab::LAPTOP, move || -> std::io::Result<String> {
            let mut s = TcpStream::connect_timeout(&target, Duration::from_secs(5))?;
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            s.write_all(b"hello from laptop1\n")?;
            let mut line = String::new();
            BufReader::new(s).read_line(&mut line)?;
            Ok(line)
        })
        .unwrap_or_else(|e| panic!("laptop netns: {e:#}"))
        .unwrap_or_else(|e| panic!("TCP to {target}: {e}\n{}", f.diagnostics()));
    assert_eq!(reply, "laptop2 got hello from laptop1\n");
    let (peer, line) = server
        .join()
        .unwrap_or_else(|_| panic!("listener thread panicked"))
        .unwrap_or_else(|e| panic!("listener on {target}: {e}"));
    assert_eq!(line, "hello from laptop1\n");
    assert_eq!(
        peer.ip(),
        std::net::IpAddr::V4(ip1),
        "laptop2 sees laptop1's tunnel IP (no SNAT between laptops)"
    );
}
