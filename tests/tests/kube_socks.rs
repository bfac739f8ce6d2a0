//! End-to-end tests of SOCKS5 mode (`kvpn connect --socks`, issue [daemons] item
//! 4) on the Kubernetes lab: no TUN device, no root daemon; a SOCKS5 server in the
//! user daemon carries real curl (`--socks5-hostname`, so names resolve
//! through the cluster DNS), a SOCKS5 UDP client (UDP ASSOCIATE to the lab's UDP
//! echo Service and a DNS query to the cluster DNS), and survives bad SOCKS input.
//! A SIGKILLed user daemon's SOCKS session is brought back by the next
//! `kvpn status` (same SOCKS address, traffic flows again, `restores` 1);
//! `kvpn quit` stops a SOCKS session next to a TUN one. The last part downloads
//! the same file through SOCKS and through a TUN session and prints both rates
//! (no timed assertion: bench/ does ratios).
//!
//! Needs the workspace binaries (`KVPN_BIN_DIR`) and the Kubernetes binaries.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpStream, UdpSocket};
use std::path::Path;
use std::time::{Duration, Instant};

use kvpn_lab::k8s::dns::CLUSTER_DNS_IP;
use kvpn_lab::{
    ECHO_SERVICE_PORT, HTTP_PORT, LAPTOP, UDP_ECHO_CLUSTER_IP, WEB_CLUSTER_IP, WEB_SERVICE_PORT,
};
use kvpn_tests::kube_lab::{KubeFixture, pod_ip};
use kvpn_tests::text;

const LISTEN: &str = "127.0.0.1:1080";
const IO_TIMEOUT: Duration = Duration::from_secs(10);

fn listen() -> SocketAddr {
    LISTEN.parse().unwrap_or_else(|e| panic!("{e}"))
}

/// `curl -sS --max-time 20 <args>` in the laptop netns: (success, stdout, stderr).
fn curl(f: &KubeFixture, args: &[&str]) -> (bool, String, String) {
    let mut all = vec!["curl", "-sS", "--max-time", "20"];
    all.extend_from_slice(args);
    let out = f.laptop(&all);
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

/// Running `kvpn-dataplane` processes whose environment names `runtime_dir`.
fn root_daemons_of(runtime_dir: &Path) -> Vec<u32> {
    let needle = format!("KVPN_RUNTIME_DIR={}", runtime_dir.display());
    std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter(|pid| {
                    let exe = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                    let argv0 = exe.split(|b| *b == 0).next().unwrap_or_default();
                    let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
                    argv0.ends_with(b"kvpn-dataplane")
                        && env.split(|b| *b == 0).any(|v| v == needle.as_bytes())
                })
                .collect()
        })
        .unwrap_or_default()
}

/// SOCKS5 greeting (no auth) and one request on a fresh connection; returns the
/// stream and the reply's code and bound address.
fn socks_request(cmd: u8, target: &[u8]) -> (TcpStream, u8, SocketAddr) {
    let mut s = TcpStream::connect_timeout(&listen(), IO_TIMEOUT)
        .unwrap_or_else(|e| panic!("connect to the SOCKS server: {e}"));
    s.set_read_timeout(Some(IO_TIMEOUT))
        .unwrap_or_else(|e| panic!("{e}"));
    s.write_all(&[5, 1, 0]).unwrap_or_else(|e| panic!("{e}"));
    let mut method = [0u8; 2];
    s.read_exact(&mut method)
        .unwrap_or_else(|e| panic!("greeting reply: {e}"));
    assert_eq!(method, [5, 0], "no-auth accepted");
    let mut req = vec![5, cmd, 0];
    req.extend_from_slice(target);
    s.write_all(&req).unwrap_or_else(|e| panic!("{e}"));
    let mut head = [0u8; 4];
    s.read_exact(&mut head)
        .unwrap_or_else(|e| panic!("request reply: {e}"));
    assert_eq!(head[0], 5);
    assert_eq!(head[3], 1, "IPv4 bound address");
    let mut addr = [0u8; 6];
    s.read_exact(&mut addr).unwrap_or_else(|e| panic!("{e}"));
    let bound = SocketAddr::from((
        Ipv4Addr::new(addr[0], addr[1], addr[2], addr[3]),
        u16::from_be_bytes([addr[4], addr[5]]),
    ));
    (s, head[1], bound)
}

fn ipv4_target(ip: Ipv4Addr, port: u16) -> Vec<u8> {
    let mut t = vec![1];
    t.extend_from_slice(&ip.octets());
    t.extend_from_slice(&port.to_be_bytes());
    t
}

fn domain_target(name: &str, port: u16) -> Vec<u8> {
    let mut t = vec![
        3,
        u8::try_from(name.len()).unwrap_or_else(|e| panic!("{e}")),
    ];
    t.extend_from_slice(name.as_bytes());
    t.extend_from_slice(&port.to_be_bytes());
    t
}

/// Send `payload` to `target` (SOCKS5 address bytes) through the UDP relay and
/// return the reply's source address bytes and payload.
fn udp_exchange(relay: SocketAddr, target: &[u8], payload: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
    sock.set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut datagram = vec![0, 0, 0];
    datagram.extend_from_slice(target);
    datagram.extend_from_slice(payload);
    let mut buf = [0u8; 2048];
    for _ in 0..5 {
        sock.send_to(&datagram, relay)
            .unwrap_or_else(|e| panic!("{e}"));
        if let Ok((n, from)) = sock.recv_from(&mut buf) {
            assert_eq!(from, relay, "replies come from the relay");
            let reply = &buf[..n];
            assert_eq!(&reply[..3], [0, 0, 0], "RSV and FRAG");
            assert_eq!(reply[3], 1, "IPv4 source");
            return (reply[4..10].to_vec(), reply[10..].to_vec());
        }
    }
    panic!("no UDP answer through the SOCKS relay {relay} after 5 tries");
}

/// A DNS query for `name` type A, id 0x4b56.
fn dns_query(name: &str) -> Vec<u8> {
    let mut q = vec![0x4b, 0x56, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
    for label in name.trim_end_matches('.').split('.') {
        q.push(u8::try_from(label.len()).unwrap_or_else(|e| panic!("{e}")));
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    q
}

/// Raw bytes to the SOCKS server; whatever it answers before closing.
fn raw_exchange(bytes: &[u8], half_close: bool) -> Vec<u8> {
    let mut s = TcpStream::connect_timeout(&listen(), IO_TIMEOUT)
        .unwrap_or_else(|e| panic!("connect to the SOCKS server: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap_or_else(|e| panic!("{e}"));
    s.write_all(bytes).unwrap_or_else(|e| panic!("{e}"));
    if half_close {
        s.shutdown(Shutdown::Write)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    out
}

/// Downloads `/big?bytes=N` with curl; returns bytes per second. Asserts the size.
fn download(f: &KubeFixture, extra: &[&str], url: &str, bytes: u64) -> f64 {
    let mut args = extra.to_vec();
    args.extend_from_slice(&[
        "-o",
        "/dev/null",
        "-w",
        "%{size_download} %{speed_download}",
        url,
    ]);
    let (ok, out, err) = curl(f, &args);
    assert!(ok, "download {url} {extra:?}: {err}\n{}", f.diagnostics());
    let mut parts = out.split_whitespace();
    let size: u64 = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let speed: f64 = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0.0);
    assert_eq!(size, bytes, "the whole file arrived: {out}");
    speed
}

#[test]
fn socks5_mode_carries_tcp_udp_and_cluster_names_without_tun_or_root_daemon() {
    let f = KubeFixture::new();
    let kubeconfig = f.user_kubeconfig();
    let out = f.kvpn_ok(&[
        "connect",
        "--kubeconfig",
        &kubeconfig,
        "--socks",
        "--socks-listen",
        LISTEN,
    ]);
    assert!(
        out.contains("SOCKS5 proxy on 127.0.0.1:1080"),
        "connect output: {out}"
    );

    // No TUN device, no route into the cluster, no root daemon for this session.
    assert_eq!(f.tun_devices(), Vec::<String>::new(), "no TUN device");
    let routes = f.laptop_routes();
    assert!(
        !routes
            .iter()
            .any(|r| r.starts_with("10.96.") || r.starts_with("10.244.")),
        "no cluster routes: {routes:?}"
    );
    assert!(
        !f.runtime_dir().join("dataplane.sock").exists(),
        "no root daemon socket"
    );
    assert_eq!(root_daemons_of(f.runtime_dir()), Vec::<u32>::new());
    let daemons = f.user_daemon_pids();
    assert_eq!(daemons.len(), 1, "one user daemon: {daemons:?}");
    assert_eq!(f.agent_pids(), Vec::<u32>::new(), "no per-session agent");
    // The SOCKS listener is the user daemon's.
    let listens: Vec<String> = f
        .tcp_sockets_of(daemons[0])
        .into_iter()
        .filter(|s| s.state == "LISTEN")
        .map(|s| s.local)
        .collect();
    assert!(
        listens.iter().any(|l| l == LISTEN),
        "the user daemon listens on {LISTEN}: {listens:?}"
    );

    // Status: one session, mode socks, with the listen address, connected.
    let status = f.status_json();
    assert_eq!(status["root_daemon"]["running"], false, "{status:#}");
    let s = f.session();
    let id = s["id"].as_str().unwrap_or_default().to_owned();
    assert!(id.starts_with("socks-"), "{s:#}");
    assert_eq!(s["transport"], "socks", "{s:#}");
    assert_eq!(s["socks"]["listen"], LISTEN, "{s:#}");
    assert_eq!(s["state"], "connected", "{s:#}");
    assert_eq!(s["tun_name"], "", "{s:#}");
    assert_eq!(s["user_daemon"]["state"], "running", "{s:#}");
    assert_eq!(
        s["socks"]["dns_servers"],
        serde_json::json!([CLUSTER_DNS_IP.to_string()]),
        "{s:#}"
    );
    let table = f.kvpn_ok(&["status"]);
    assert!(
        table.contains("socks") && table.contains(&format!("SOCKS5 proxy on {LISTEN}")),
        "status table: {table}"
    );
    let yaml = f.kvpn_ok(&["status", "-o", "yaml"]);
    assert!(yaml.contains(&format!("listen: {LISTEN}")), "{yaml}");

    // A second connect is a no-op.
    let again = f.kvpn_ok(&["connect", "--kubeconfig", &kubeconfig, "--socks"]);
    assert!(again.contains("Already connected"), "{again}");
    // One asking for another listen address says it was not applied, and how.
    let moved = f.kvpn(&[
        "connect",
        "--kubeconfig",
        &kubeconfig,
        "--socks",
        "--socks-listen",
        "127.0.0.1:1081",
    ]);
    let (out, err) = (text(&moved.stdout), text(&moved.stderr));
    assert!(moved.status.success(), "{out}\n{err}");
    assert!(out.contains("Already connected"), "{out}");
    assert!(
        err.contains("--socks-listen 127.0.0.1:1081 not applied")
            && err.contains(&format!("already listens on {LISTEN}")),
        "{err}"
    );
    assert_eq!(f.user_daemon_pids(), daemons);
    assert_eq!(f.sessions().len(), 1);

    // curl with remote DNS: a service name, resolved by the cluster DNS.
    let (ok, page, err) = curl(&f, &["--socks5-hostname", LISTEN, "http://web.default/"]);
    assert!(ok, "curl web.default: {err}\n{}", f.diagnostics());
    assert!(page.starts_with("kvpn-lab-server"), "the lab page: {page}");
    // The fully qualified name and a ClusterIP.
    let (ok, _, err) = curl(
        &f,
        &[
            "--socks5-hostname",
            LISTEN,
            "http://web.default.svc.cluster.local/",
        ],
    );
    assert!(ok, "curl FQDN: {err}");
    let (ok, _, err) = curl(
        &f,
        &[
            "--socks5",
            LISTEN,
            &format!("http://{WEB_CLUSTER_IP}:{WEB_SERVICE_PORT}/"),
        ],
    );
    assert!(ok, "curl ClusterIP: {err}");
    // A pod IP; the page names the pod that answered.
    let pods = f.pods("default", "app=web");
    let pod = pods.first().unwrap_or_else(|| panic!("no web pod"));
    let ip = pod_ip(pod);
    let (ok, page, err) = curl(
        &f,
        &["--socks5", LISTEN, &format!("http://{ip}:{HTTP_PORT}/")],
    );
    assert!(ok, "curl pod IP {ip}: {err}");
    assert!(page.contains(&ip.to_string()), "page of {ip}: {page}");
    // A name the cluster does not know: a clear failure, not a hang.
    let (ok, _, err) = curl(
        &f,
        &["--socks5-hostname", LISTEN, "http://no-such-svc.default/"],
    );
    assert!(!ok, "an unknown name must fail");
    assert!(
        err.to_lowercase().contains("host unreachable") || err.contains("(4)"),
        "SOCKS reply host unreachable: {err}"
    );

    // UDP ASSOCIATE: the UDP echo Service by ClusterIP and by name, and a DNS
    // query to the cluster DNS.
    f.lab()
        .netns_lab()
        .run_in(LAPTOP, || {
            let (control, code, relay) = socks_request(3, &[1, 0, 0, 0, 0, 0, 0]);
            assert_eq!(code, 0, "UDP ASSOCIATE granted");
            let (from, echoed) = udp_exchange(
                relay,
                &ipv4_target(UDP_ECHO_CLUSTER_IP, ECHO_SERVICE_PORT),
                b"kvpn socks udp",
            );
            assert_eq!(echoed, b"kvpn socks udp");
            assert_eq!(
                from,
                ipv4_target(UDP_ECHO_CLUSTER_IP, ECHO_SERVICE_PORT)[1..]
            );
            let (_, echoed) = udp_exchange(
                relay,
                &domain_target("udp-echo.default", ECHO_SERVICE_PORT),
                b"by name",
            );
            assert_eq!(echoed, b"by name");
            let (from, answer) = udp_exchange(
                relay,
                &ipv4_target(CLUSTER_DNS_IP, 53),
                &dns_query("web.default.svc.cluster.local"),
            );
            assert_eq!(from, ipv4_target(CLUSTER_DNS_IP, 53)[1..]);
            assert_eq!(&answer[..2], [0x4b, 0x56], "DNS id");
            assert_eq!(answer[3] & 0x0f, 0, "NOERROR: {answer:?}");
            assert!(
                answer.ends_with(&WEB_CLUSTER_IP.octets()),
                "A record 10.96.0.100: {answer:?}"
            );
            drop(control);
        })
        .unwrap_or_else(|e| panic!("laptop netns: {e:#}"));

    // Bad SOCKS input: a clear reply each, and the server lives on.
    f.lab()
        .netns_lab()
        .run_in(LAPTOP, || {
            // SOCKS4 CONNECT: a SOCKS4 "request rejected".
            let r = raw_exchange(&[4, 1, 0, 80, 10, 96, 0, 100, 0], false);
            assert_eq!(
                r.get(..2),
                Some(&[0u8, 0x5b][..]),
                "SOCKS4 rejection: {r:?}"
            );
            // Another version: "no acceptable methods".
            assert_eq!(raw_exchange(&[9, 1, 0], false), [5, 0xff]);
            // A truncated greeting.
            assert_eq!(raw_exchange(&[5, 3, 0], true), [5, 0xff]);
            // A greeting without "no authentication".
            assert_eq!(raw_exchange(&[5, 1, 2], false), [5, 0xff]);
            // Good greeting, request with the wrong version: general failure.
            let r = raw_exchange(&[5, 1, 0, 4, 1, 0, 1, 10, 96, 0, 100, 0, 80], false);
            assert_eq!(r.get(..4), Some(&[5u8, 0, 5, 1][..]), "{r:?}");
            // Good greeting, truncated request (a domain cut short), then EOF.
            let r = raw_exchange(&[5, 1, 0, 5, 1, 0, 3, 20, b'w', b'e'], true);
            assert_eq!(r.get(..2), Some(&[5u8, 0][..]), "{r:?}");
            assert_eq!(r.get(2..4), Some(&[5u8, 1][..]), "general failure: {r:?}");
            // An unknown command: "command not supported".
            let r = raw_exchange(&[5, 1, 0, 5, 9, 0, 1, 10, 96, 0, 100, 0, 80], false);
            assert_eq!(r.get(2..4), Some(&[5u8, 7][..]), "{r:?}");
            // BIND: "command not supported".
            let (_s, code, _) = socks_request(2, &ipv4_target(WEB_CLUSTER_IP, 80));
            assert_eq!(code, 7);
            // A closed port of a pod (it answers RST): "connection refused".
            let IpAddr::V4(pod_v4) = ip else {
                panic!("IPv4 pod IP expected: {ip}")
            };
            let (_s, code, _) = socks_request(1, &ipv4_target(pod_v4, 81));
            assert_eq!(code, 5, "connection refused");
        })
        .unwrap_or_else(|e| panic!("laptop netns: {e:#}"));
    let (ok, _, err) = curl(&f, &["--socks5-hostname", LISTEN, "http://web.default/"]);
    assert!(
        ok,
        "the server survives bad input: {err}\n{}",
        f.diagnostics()
    );

    // Throughput: the same download through SOCKS and through a TUN session.
    const BIG: u64 = 200 * 1024 * 1024;
    let url_name = format!("http://web.default/big?bytes={BIG}");
    let socks_rate = download(&f, &["--socks5-hostname", LISTEN], &url_name, BIG);

    // The counters come from a record the session rewrites twice a second:
    // most of the download is in them.
    let s = f.session();
    assert!(
        s["tx"]["bytes"].as_u64().unwrap_or(0) > 0
            && s["rx"]["bytes"].as_u64().unwrap_or(0) > BIG / 2,
        "counters: {s:#}"
    );

    // Disconnect by id: the proxy stops, the user daemon stays, status is empty.
    let out = f.kvpn_ok(&["disconnect", &id]);
    assert!(
        out.contains(&format!("Disconnected SOCKS session {id}")),
        "{out}"
    );
    assert_eq!(f.user_daemon_pids(), daemons);
    let (ok, _, _) = curl(&f, &["--socks5-hostname", LISTEN, "http://web.default/"]);
    assert!(!ok, "no proxy after disconnect");
    assert_eq!(f.sessions(), Vec::<serde_json::Value>::new());

    // A SIGKILLed user daemon: the next status (which starts a new one) brings
    // the SOCKS session back on the same SOCKS address, like a TUN session.
    f.kvpn_ok(&["connect", "--kubeconfig", &kubeconfig, "--socks"]);
    let id = f.session()["id"].as_str().unwrap_or_default().to_owned();
    let killed = f.user_daemon_pids();
    assert!(!killed.is_empty());
    for pid in &killed {
        // SAFETY: kill with a pid found by its command line naming this fixture's folder.
        unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
    }
    let t0 = Instant::now();
    while killed
        .iter()
        .any(|p| Path::new(&format!("/proc/{p}")).exists())
    {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "user daemon survived SIGKILL"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (ok, _, _) = curl(&f, &["--socks5-hostname", LISTEN, "http://web.default/"]);
    assert!(!ok, "no proxy while no user daemon runs");
    let t0 = Instant::now();
    let s = loop {
        let s = f.session();
        assert_eq!(s["id"], id.as_str(), "{s:#}");
        assert_ne!(s["state"], "lost", "{s:#}\n{}", f.diagnostics());
        if s["state"] == "connected" {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "SOCKS session not back: {s:#}\n{}",
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(s["user_daemon"]["restores"], 1, "{s:#}");
    assert_eq!(s["socks"]["listen"], LISTEN, "{s:#}");
    let new_daemons = f.user_daemon_pids();
    assert!(
        new_daemons.len() == 1 && !killed.contains(&new_daemons[0]),
        "a new user daemon: {new_daemons:?} (killed {killed:?})"
    );
    let (ok, out, err) = curl(&f, &["--socks5-hostname", LISTEN, "http://web.default/"]);
    assert!(
        ok,
        "no proxy after the restore: {out}{err}\n{}",
        f.diagnostics()
    );
    f.kvpn_ok(&["disconnect", "--all"]);
    assert_eq!(f.sessions(), Vec::<serde_json::Value>::new());
    assert_eq!(root_daemons_of(f.runtime_dir()), Vec::<u32>::new());

    // SOCKS next to a TUN session; `kvpn quit` stops both.
    f.kvpn_ok(&["connect", "--kubeconfig", &kubeconfig, "--socks"]);
    f.kvpn_ok(&["connect", "--kubeconfig", &kubeconfig]);
    let states: Vec<(String, String)> = f
        .sessions()
        .iter()
        .map(|s| {
            (
                s["transport"].as_str().unwrap_or_default().to_owned(),
                s["state"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    assert_eq!(states.len(), 2, "{states:?}");
    assert!(
        states.contains(&("socks".into(), "connected".into()))
            && states.contains(&("port-forward".into(), "connected".into())),
        "{states:?}"
    );
    let url_ip = format!("http://{WEB_CLUSTER_IP}/big?bytes={BIG}");
    let tun_rate = download(&f, &[], &url_ip, BIG);
    eprintln!(
        "throughput, {} MiB over HTTP through the port-forward: SOCKS5 {:.0} Mbit/s, TUN {:.0} Mbit/s (ratio {:.2})",
        BIG >> 20,
        socks_rate * 8.0 / 1e6,
        tun_rate * 8.0 / 1e6,
        socks_rate / tun_rate
    );
    let (ok, _, err) = curl(&f, &["--socks5-hostname", LISTEN, "http://web.default/"]);
    assert!(ok, "SOCKS next to a TUN session: {err}");
    let out = f.kvpn_ok(&["quit"]);
    assert!(
        out.contains("socks-"),
        "quit names the SOCKS session: {out}"
    );
    let (ok, _, _) = curl(&f, &["--socks5-hostname", LISTEN, "http://web.default/"]);
    assert!(!ok, "no proxy after quit");
    assert_eq!(f.user_daemon_pids(), Vec::<u32>::new());
    assert_eq!(f.tun_devices(), Vec::<String>::new());
}
