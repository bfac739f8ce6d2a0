//! End-to-end route cases rt-04, rt-06 and rt-08 (../shared/cases/routes.md,
//! issue [dns-fidelity] item 4) on the static lab: real kvpn CLI, root daemon,
//! TUN device, eBPF classifier and traffic manager in the lab's netns.
//!
//! - rt-04: the network (.0) and broadcast (.255) addresses of a routed /24 are
//!   ordinary pod addresses: the laptop's local table gets no entry for them and
//!   TCP to pods holding them works.
//! - rt-06: strict reverse-path filtering (`rp_filter=1` on all, default and every
//!   interface of the laptop, the TUN device included) drops no reply coming back
//!   through the TUN device, and the manager connection keeps working.
//! - rt-08: on a laptop with IPv6 disabled, connect succeeds IPv4-only with exactly
//!   one warning, and traffic works.
//!
//! rt-06 and rt-08 run again on the Kubernetes lab ([`KubeFixture`]): there the
//! manager connection is a port-forward through the kube API, and the root daemon
//! also runs the cluster DNS forwarder.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::time::Duration;

use kvpn_lab::protocol::PageInfo;
use kvpn_lab::{
    BACKEND_1_IP, BACKEND_1_POD, ECHO_PORT, ECHO_SERVICE_PORT, HTTP_PORT, NODE, NODE_BRIDGE_IP,
    UDP_ECHO_CLUSTER_IP, WEB_CLUSTER_IP,
};
use kvpn_tests::dns_lab::getent;
use kvpn_tests::kube_lab::KubeFixture;
use kvpn_tests::{Fixture, lab_connect_args, text};

/// GET `url` from the laptop; panics with the logs if it fails.
fn page(f: &Fixture, url: &str) -> PageInfo {
    let out = f.laptop(&["curl", "-sS", "--max-time", "5", url]);
    assert!(
        out.status.success(),
        "curl {url} failed: {}\ndaemon log:\n{}\nmanager log:\n{}",
        text(&out.stderr),
        f.daemon_log(),
        f.manager_log()
    );
    PageInfo::parse(&text(&out.stdout))
        .unwrap_or_else(|| panic!("not a lab page from {url}: {:?}", text(&out.stdout)))
}

/// One TCP echo round trip of `n` bytes from the laptop to `addr`.
fn tcp_echo(f: &Fixture, addr: SocketAddr, n: usize) -> Vec<u8> {
    let sent: Vec<u8> = (0..n).map(|i| (i % 241) as u8).collect();
    let data = sent.clone();
    let got = f.in_laptop(move || {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        s.write_all(&data).expect("write");
        let mut got = vec![0u8; data.len()];
        s.read_exact(&mut got)
            .unwrap_or_else(|e| panic!("echo from {addr}: {e}"));
        got
    });
    assert_eq!(got.len(), sent.len(), "echo length from {addr}");
    assert!(got == sent, "echoed bytes from {addr} differ");
    got
}

/// `kvpn connect` with `args`; panics with kvpn's output on failure. Returns
/// stdout and stderr.
fn connect_with(f: &Fixture, args: &[String]) -> (String, String) {
    let mut all: Vec<&str> = vec!["connect"];
    all.extend(args.iter().map(String::as_str));
    let out = f.kvpn(&all);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(
        out.status.success(),
        "kvpn {all:?} failed:\n{stdout}\n{stderr}\ndaemon log:\n{}",
        f.daemon_log()
    );
    (stdout, stderr)
}

fn tun_name(f: &Fixture) -> String {
    f.status_json()["sessions"][0]["tun_name"]
        .as_str()
        .expect("a session with a TUN device")
        .to_string()
}

// --- rt-04 ------------------------------------------------------------------------

/// The edge range of rt-04: routed on its own, its .0 and .255 are pods.
const EDGE_RANGE: &str = "10.244.3.0/24";
const EDGE_NETWORK_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 3, 0);
const EDGE_BROADCAST_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 3, 255);
const EDGE_POD: &str = "edge";

/// Adds pod `edge` to the lab holding 10.244.3.0 and 10.244.3.255 (each a /32 on
/// its `eth0`, so not even the pod itself sees a broadcast address), reached from
/// the node through veth `kv<id>e0` with a device route for 10.244.3.0/24 (like a
/// CNI's per-node route), running `kvpn-lab-server`. The lab removes all of it
/// (netns `kvpn-<id>-edge`, the veth with the node netns, the server) on down.
fn add_edge_pod(f: &Fixture) {
    let lab = &f.lab;
    let netns = kvpn_lab::Netns::create(&format!("kvpn-{}-{EDGE_POD}", lab.id()))
        .unwrap_or_else(|e| panic!("edge pod netns: {e:#}"));
    let host_veth = format!("kv{}e0", lab.id());
    lab.node_netns()
        .ip_batch(&[
            format!(
                "link add {host_veth} type veth peer name eth0 netns {}",
                netns.name()
            ),
            format!("link set {host_veth} up"),
            format!("route add {EDGE_RANGE} dev {host_veth}"),
        ])
        .unwrap_or_else(|e| panic!("edge pod veth in the node: {e:#}"));
    netns
        .ip_batch(&[
            "link set lo up".to_owned(),
            format!("addr add {EDGE_NETWORK_IP}/32 dev eth0"),
            format!("addr add {EDGE_BROADCAST_IP}/32 dev eth0"),
            "link set eth0 up".to_owned(),
            // The bridge address answers ARP on the veth too (arp_ignore=0).
            format!("route add {NODE_BRIDGE_IP}/32 dev eth0"),
            format!("route add default via {NODE_BRIDGE_IP} dev eth0"),
        ])
        .unwrap_or_else(|e| panic!("edge pod addresses: {e:#}"));
    let server = kvpn_lab::bin_path("kvpn-lab-server")
        .unwrap_or_else(|e| panic!("kvpn-lab-server binary: {e:#}"));
    let mut cmd = std::process::Command::new(server);
    cmd.args(["--name", EDGE_POD])
        .env("POD_NAME", EDGE_POD)
        .env("POD_IP", EDGE_NETWORK_IP.to_string());
    lab.spawn_in(EDGE_POD, EDGE_POD, &cmd)
        .unwrap_or_else(|e| panic!("kvpn-lab-server in the edge pod: {e:#}"));
    for ip in [EDGE_NETWORK_IP, EDGE_BROADCAST_IP] {
        for port in [HTTP_PORT, ECHO_PORT] {
            // From the node: the lab side of the path works before kvpn is involved.
            lab.wait_tcp(NODE, SocketAddr::from((ip, port)), Duration::from_secs(10))
                .unwrap_or_else(|e| panic!("edge pod server from the node: {e:#}"));
        }
    }
}

#[test]
fn rt_04_network_and_broadcast_addresses_are_pods() {
    let f = Fixture::new();
    add_edge_pod(&f);
    // The node's own range and the edge range as two pod CIDRs (the lab's default
    // 10.244.0.0/16 would cover the /24, which is then not installed on its own).
    let args: Vec<String> = [
        "--manager",
        &kvpn_lab::MANAGER_ADDR_FROM_LAPTOP.to_string(),
        "--pod-cidr",
        &kvpn_lab::NODE_POD_CIDR.to_string(),
        "--pod-cidr",
        EDGE_RANGE,
        "--service-cidr",
        &kvpn_lab::SERVICE_CIDR.to_string(),
    ]
    .map(str::to_owned)
    .into();
    connect_with(&f, &args);
    let tun = tun_name(&f);

    // The /24 is routed on its own through the TUN device.
    let routes = text(
        &f.laptop(&["ip", "route", "show", "exact", EDGE_RANGE])
            .stdout,
    );
    assert!(
        routes.contains(&format!("dev {tun}")),
        "{EDGE_RANGE} not routed through {tun}: {routes:?}"
    );
    // No local-table entry (local or broadcast) for its .0 or .255: the laptop's
    // tunnel address is a host address, so the kernel derives no broadcast routes.
    let local = text(&f.laptop(&["ip", "route", "show", "table", "local"]).stdout);
    for ip in [EDGE_NETWORK_IP, EDGE_BROADCAST_IP] {
        let hit: Vec<&str> = local
            .lines()
            .filter(|l| l.split_whitespace().nth(1) == Some(ip.to_string().as_str()))
            .collect();
        assert!(hit.is_empty(), "local table has {hit:?} for {ip}:\n{local}");
        let get = text(&f.laptop(&["ip", "route", "get", &ip.to_string()]).stdout);
        assert!(
            get.starts_with(&format!("{ip} dev {tun}")),
            "{ip} must be a unicast route through {tun}: {get:?}"
        );
    }

    for ip in [EDGE_NETWORK_IP, EDGE_BROADCAST_IP] {
        let p = page(&f, &format!("http://{ip}:{HTTP_PORT}/"));
        assert_eq!(p.pod, EDGE_POD, "answered by {p:?}");
        assert_eq!(
            p.pod_ip,
            std::net::IpAddr::V4(ip),
            "the pod saw the connection to {ip}"
        );
        tcp_echo(&f, SocketAddr::from((ip, ECHO_PORT)), 100_000);
    }
    // The ordinary pod range still works next to it.
    assert_eq!(
        page(&f, &format!("http://{BACKEND_1_IP}:{HTTP_PORT}/")).pod,
        BACKEND_1_POD
    );
}

// --- rt-06 ------------------------------------------------------------------------

/// The interfaces of the laptop netns, as `/proc/sys/net/ipv4/conf` lists them
/// (with `all` and `default`).
fn ipv4_conf_entries(f: &Fixture) -> Vec<String> {
    f.in_laptop(|| {
        std::fs::read_dir("/proc/sys/net/ipv4/conf")
            .expect("read /proc/sys/net/ipv4/conf")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    })
}

fn set_rp_filter(f: &Fixture, entry: &str, value: &str) {
    f.lab
        .laptop_netns()
        .set_sysctls(&[(&format!("net.ipv4.conf.{entry}.rp_filter"), value)])
        .unwrap_or_else(|e| panic!("rp_filter on {entry}: {e:#}"));
}

fn rp_filter(f: &Fixture, entry: &str) -> String {
    f.lab
        .laptop_netns()
        .sysctl(&format!("net.ipv4.conf.{entry}.rp_filter"))
        .unwrap_or_else(|e| panic!("read rp_filter of {entry}: {e:#}"))
}

/// The laptop kernel's count of packets dropped by reverse-path filtering
/// (`TcpExt: IPReversePathFilter` in /proc/net/netstat, LINUX_MIB_IPRPFILTER).
fn rp_filter_drops(f: &Fixture) -> u64 {
    let netstat = f.in_laptop(|| {
        std::fs::read_to_string("/proc/net/netstat").expect("read /proc/net/netstat")
    });
    netstat_counter(&netstat, "IPReversePathFilter")
}

/// Counter `name` of the `TcpExt:` rows of /proc/net/netstat (a names line, then
/// a values line).
fn netstat_counter(netstat: &str, name: &str) -> u64 {
    let lines: Vec<&str> = netstat.lines().collect();
    for pair in lines.chunks(2) {
        let [names, values] = pair else { continue };
        if !names.starts_with("TcpExt:") {
            continue;
        }
        for (n, v) in names.split_whitespace().zip(values.split_whitespace()) {
            if n == name {
                return v.parse().unwrap_or_else(|e| panic!("{n}={v}: {e}"));
            }
        }
    }
    panic!("no TcpExt {name} in /proc/net/netstat:\n{netstat}");
}

/// HTTP to a pod and a ClusterIP, TCP echo, UDP echo through a ClusterIP, ping, and
/// a refused closed port: replies of every kind come back through the TUN device.
fn all_kinds_of_replies(f: &Fixture) {
    assert_eq!(
        page(f, &format!("http://{BACKEND_1_IP}:{HTTP_PORT}/")).pod,
        BACKEND_1_POD
    );
    let via_service = page(f, &format!("http://{WEB_CLUSTER_IP}/"));
    assert!(
        via_service.pod.starts_with("backend-"),
        "answered by {via_service:?}"
    );
    tcp_echo(f, SocketAddr::from((BACKEND_1_IP, ECHO_PORT)), 200_000);
    let udp = f.in_laptop(|| {
        let sock = UdpSocket::bind("0.0.0.0:0").expect("bind");
        sock.set_read_timeout(Some(Duration::from_secs(3)))
            .expect("timeout");
        let target = SocketAddr::from((UDP_ECHO_CLUSTER_IP, ECHO_SERVICE_PORT));
        sock.send_to(b"rt-06 strict rp_filter", target)
            .expect("send");
        let mut buf = [0u8; 256];
        sock.recv_from(&mut buf)
            .map(|(n, from)| (buf[..n].to_vec(), from))
            .map_err(|e| e.to_string())
    });
    let (data, from) = udp.unwrap_or_else(|e| panic!("no UDP echo through the ClusterIP: {e}"));
    assert_eq!(data, b"rt-06 strict rp_filter");
    assert_eq!(
        from,
        SocketAddr::from((UDP_ECHO_CLUSTER_IP, ECHO_SERVICE_PORT))
    );
    let ping = f.laptop(&[
        "ping",
        "-c",
        "3",
        "-i",
        "0.2",
        "-W",
        "2",
        &BACKEND_1_IP.to_string(),
    ]);
    assert!(
        text(&ping.stdout).contains("3 received"),
        "ping to a pod: {}",
        text(&ping.stdout)
    );
    let refused = f.in_laptop(|| {
        TcpStream::connect_timeout(&SocketAddr::from((BACKEND_1_IP, 9)), Duration::from_secs(5))
            .err()
            .map(|e| e.kind())
    });
    assert_eq!(
        refused,
        Some(std::io::ErrorKind::ConnectionRefused),
        "the RST of a closed pod port must come back"
    );
}

#[test]
fn rt_06_strict_rp_filter() {
    let f = Fixture::new();
    // Strict mode everywhere before connect: all, default (so the TUN device is
    // born strict) and each existing interface.
    for entry in ipv4_conf_entries(&f) {
        set_rp_filter(&f, &entry, "1");
    }
    f.connect();
    let tun = tun_name(&f);
    let id = f.status_json()["sessions"][0]["id"].clone();

    // kernel: effective rp_filter = max(conf/all, conf/<dev>). Whatever kvpn chose
    // for its TUN device, the manager's uplink keeps strict mode.
    assert_eq!(rp_filter(&f, "all"), "1");
    assert_eq!(rp_filter(&f, &f.lab.uplink().laptop_if), "1");
    let drops0 = rp_filter_drops(&f);
    all_kinds_of_replies(&f);

    // Then strict on the TUN device itself too, as a `net.ipv4.conf.*.rp_filter = 1`
    // rule of systemd-sysctl applies it to every new link after kvpn set it up.
    for entry in ipv4_conf_entries(&f) {
        set_rp_filter(&f, &entry, "1");
    }
    for entry in ipv4_conf_entries(&f) {
        assert_eq!(rp_filter(&f, &entry), "1", "rp_filter of {entry}");
    }
    assert!(
        ipv4_conf_entries(&f).contains(&tun),
        "{tun} among the laptop's interfaces"
    );
    all_kinds_of_replies(&f);
    let drops = rp_filter_drops(&f) - drops0;
    assert_eq!(
        drops,
        0,
        "the laptop dropped {drops} packets by reverse-path filtering\ndaemon log:\n{}",
        f.daemon_log()
    );

    // The manager connection over the strict uplink: heartbeats keep being echoed
    // (3 s without an echo would mean a reconnect) and the session is the same.
    let echoed = |s: &serde_json::Value| {
        s["sessions"][0]["liveness"]["heartbeats_echoed"]
            .as_u64()
            .unwrap_or_else(|| panic!("heartbeats_echoed in {s}"))
    };
    let before = echoed(&f.status_json());
    std::thread::sleep(Duration::from_secs(4));
    let after = f.status_json();
    assert_eq!(after["sessions"][0]["state"], "connected", "{after}");
    assert_eq!(after["sessions"][0]["id"], id, "same session: {after}");
    assert!(
        echoed(&after) >= before + 2,
        "heartbeat echoes {before} -> {} over 4 s: {after}",
        echoed(&after)
    );
    assert_eq!(rp_filter_drops(&f) - drops0, 0, "reverse-path drops");
}

// --- rt-08 ------------------------------------------------------------------------

const POD_CIDR_V6: &str = "fd00:10:244::/56";

fn lines_about_ipv6(out: &str) -> Vec<&str> {
    out.lines()
        .filter(|l| l.to_ascii_lowercase().contains("ipv6"))
        .collect()
}

fn warnings(out: &str) -> Vec<&str> {
    out.lines()
        .filter(|l| l.to_ascii_lowercase().contains("warn"))
        .collect()
}

#[test]
fn rt_08_ipv6_disabled() {
    let f = Fixture::new();
    let laptop = f.lab.laptop_netns();
    laptop
        .set_sysctls(&[
            ("net.ipv6.conf.all.disable_ipv6", "1"),
            ("net.ipv6.conf.default.disable_ipv6", "1"),
        ])
        .unwrap_or_else(|e| panic!("disable IPv6 on the laptop: {e:#}"));

    // A dual-stack cluster: its IPv6 pod range cannot be routed here.
    let mut args = lab_connect_args();
    args.extend(["--pod-cidr".to_owned(), POD_CIDR_V6.to_owned()]);
    let (stdout, stderr) = connect_with(&f, &args);
    let all = format!("{stdout}{stderr}");
    let about = lines_about_ipv6(&all);
    assert_eq!(about.len(), 1, "one line about IPv6:\n{all}");
    assert!(
        about[0].starts_with("kvpn: warning:") && about[0].contains(POD_CIDR_V6),
        "the IPv6 line is a warning naming {POD_CIDR_V6}: {:?}",
        about[0]
    );
    assert_eq!(warnings(&all).len(), 1, "a single warning:\n{all}");

    let status = f.status_json();
    let routes = status["sessions"][0]["routes"].to_string();
    assert!(
        routes.contains("10.244.0.0/16") && !routes.contains("fd00"),
        "IPv4-only routes: {routes}"
    );
    let tun = tun_name(&f);
    let v6 = text(&f.laptop(&["ip", "-6", "addr", "show", "dev", &tun]).stdout);
    assert!(v6.trim().is_empty(), "IPv6 on {tun}: {v6}");
    all_kinds_of_replies(&f);

    // An IPv4-only cluster: still exactly one warning, and nothing else changes.
    f.disconnect();
    let (stdout, stderr) = connect_with(&f, &lab_connect_args());
    let all = format!("{stdout}{stderr}");
    assert_eq!(lines_about_ipv6(&all).len(), 1, "{all}");
    assert_eq!(warnings(&all).len(), 1, "a single warning:\n{all}");
    let p = page(&f, &format!("http://{BACKEND_1_IP}:{HTTP_PORT}/"));
    assert_eq!(p.pod, BACKEND_1_POD);
}

// --- the same on the Kubernetes lab: kube API, port-forward, cluster DNS ------------

fn kube_web() -> SocketAddr {
    SocketAddr::from((WEB_CLUSTER_IP, kvpn_lab::WEB_SERVICE_PORT))
}

/// The web Service's name resolves on the laptop to its ClusterIP (cluster DNS
/// through the root daemon's forwarder and the tunnel).
fn kube_dns_works(f: &KubeFixture) {
    assert_eq!(
        getent(f, "web.default.svc.cluster.local").as_deref(),
        Some(WEB_CLUSTER_IP.to_string().as_str()),
        "cluster DNS on the laptop\n{}",
        f.diagnostics()
    );
}

fn kube_laptop_entries(f: &KubeFixture) -> Vec<String> {
    f.lab()
        .netns_lab()
        .laptop_netns()
        .run(|| {
            std::fs::read_dir("/proc/sys/net/ipv4/conf")
                .expect("read /proc/sys/net/ipv4/conf")
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
        })
        .unwrap_or_else(|e| panic!("laptop netns: {e:#}"))
}

fn kube_strict_everywhere(f: &KubeFixture) {
    let laptop = f.lab().netns_lab().laptop_netns();
    for entry in kube_laptop_entries(f) {
        laptop
            .set_sysctls(&[(&format!("net.ipv4.conf.{entry}.rp_filter"), "1")])
            .unwrap_or_else(|e| panic!("rp_filter on {entry}: {e:#}"));
    }
}

fn kube_rp_filter_drops(f: &KubeFixture) -> u64 {
    let netstat = f
        .lab()
        .netns_lab()
        .laptop_netns()
        .run(|| std::fs::read_to_string("/proc/net/netstat").expect("read /proc/net/netstat"))
        .unwrap_or_else(|e| panic!("laptop netns: {e:#}"));
    netstat_counter(&netstat, "IPReversePathFilter")
}

#[test]
fn rt_06_strict_rp_filter_kube_api_port_forward_and_dns() {
    let f = KubeFixture::new();
    kube_strict_everywhere(&f);
    f.connect_restricted();
    // Strict on the TUN device too (see rt_06_strict_rp_filter).
    kube_strict_everywhere(&f);
    let drops0 = kube_rp_filter_drops(&f);
    let page = f.page(kube_web());
    assert!(page.pod.starts_with("web-"), "answered by {page:?}");
    kube_dns_works(&f);
    // The data channel runs through the kube API (port-forward): its heartbeats
    // keep being echoed, so the API traffic over the strict uplink works.
    let echoed = |s: &serde_json::Value| {
        s["liveness"]["heartbeats_echoed"]
            .as_u64()
            .unwrap_or_else(|| panic!("heartbeats_echoed in {s}"))
    };
    let before = echoed(&f.session());
    std::thread::sleep(Duration::from_secs(4));
    let after = f.session();
    assert_eq!(after["state"], "connected", "{after}");
    assert!(
        echoed(&after) >= before + 2,
        "heartbeat echoes {before} -> {}: {after}",
        echoed(&after)
    );
    // A second connect asks the kube API again (it finds the session and is done).
    f.connect_restricted();
    assert_eq!(f.sessions().len(), 1);
    assert_eq!(
        kube_rp_filter_drops(&f) - drops0,
        0,
        "reverse-path drops\n{}",
        f.diagnostics()
    );
}

#[test]
fn rt_08_ipv6_disabled_kube_connect() {
    let f = KubeFixture::new();
    f.disable_laptop_ipv6();
    let kubeconfig = f.user_kubeconfig();
    let out = f.kvpn(&["connect", "--kubeconfig", &kubeconfig]);
    let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(
        out.status.success(),
        "connect with IPv6 disabled failed:\n{all}\n{}",
        f.diagnostics()
    );
    let about = lines_about_ipv6(&all);
    assert_eq!(about.len(), 1, "one line about IPv6:\n{all}");
    assert!(about[0].starts_with("kvpn: warning:"), "{:?}", about[0]);
    assert_eq!(warnings(&all).len(), 1, "a single warning:\n{all}");
    let page = f.page(kube_web());
    assert!(page.pod.starts_with("web-"), "answered by {page:?}");
    kube_dns_works(&f);
}
