//! End-to-end: eBPF steering for the route-conflict override (case rt-05, issue 8
//! [fastpath] item 3), in the static lab (netns, real TUN, eBPF, root daemon and
//! traffic manager; no Kubernetes).
//!
//! The laptop netns gets another "VPN": a veth device of its own (ARP off, so the
//! kernel transmits at once, as through a VPN's L3 device) with a policy rule
//! `to <pod CIDR> lookup 100 pref 100` and a table-100 route through it, so the
//! kernel never looks at kvpn's main-table routes for pod IPs. With
//! `--allow-route-conflict` alone a pod is unreachable (packets leave through the
//! veth); with `--steer ebpf` the steering program on the veth's TC egress takes
//! them to the TUN device: curl and ping to a pod work, the counters rise, and after
//! disconnect the program is gone from the veth while its rule and route stay.

use kvpn_lab::{BACKEND_1_IP, HTTP_PORT, POD_CIDR};
use kvpn_tests::{Fixture, text};

fn laptop_ok(f: &Fixture, args: &[&str]) -> String {
    let out = f.laptop(args);
    assert!(
        out.status.success(),
        "laptop {args:?}: {}",
        text(&out.stderr)
    );
    text(&out.stdout)
}

fn connect(f: &Fixture, extra: &[&str]) {
    let mut args: Vec<String> = vec!["connect".into()];
    args.extend(kvpn_tests::lab_connect_args());
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = f.kvpn(&args);
    assert!(
        out.status.success(),
        "connect {extra:?}: {}\ndaemon log:\n{}",
        text(&out.stderr),
        f.daemon_log()
    );
}

fn steer_counter(status: &serde_json::Value, name: &str) -> u64 {
    status["sessions"][0]["ebpf"]["steer"][name]["packets"]
        .as_u64()
        .unwrap_or_else(|| panic!("no ebpf.steer.{name}.packets: {status}"))
}

/// Kernel ids of the steering programs on `dev`'s TCX egress (a TCX query in the
/// laptop netns; the installed bpftool predates TCX listings).
fn steer_programs(f: &Fixture, dev: &str) -> Vec<u32> {
    let dev = dev.to_owned();
    f.in_laptop(move || kvpn_dataplane::ebpf::Classifier::steer_program_ids(&dev))
        .unwrap_or_else(|e| panic!("TCX query: {e:?}"))
}

#[test]
fn rt_05_ebpf_steering_wins_over_another_vpns_policy_route() {
    let f = Fixture::new();
    // Lives in the lab's laptop netns (rule and table route too): removed with it.
    let vpn = format!("kvpn-{}-ovpn", f.lab.id());
    let peer = format!("kvpn-{}-ovpq", f.lab.id());
    laptop_ok(
        &f,
        &[
            "ip", "link", "add", &vpn, "type", "veth", "peer", "name", &peer,
        ],
    );
    laptop_ok(&f, &["ip", "addr", "add", "192.168.213.2/24", "dev", &vpn]);
    // Without ARP the neighbour is NUD_NOARP: packets reach the TC egress hook at
    // once instead of waiting for an ARP reply nobody sends.
    laptop_ok(&f, &["ip", "link", "set", &vpn, "arp", "off"]);
    for dev in [&vpn, &peer] {
        laptop_ok(&f, &["ip", "link", "set", dev, "up"]);
    }
    let pods = POD_CIDR.to_string();
    laptop_ok(
        &f,
        &["ip", "route", "add", &pods, "dev", &vpn, "table", "100"],
    );
    laptop_ok(
        &f,
        &[
            "ip", "rule", "add", "to", &pods, "lookup", "100", "pref", "100",
        ],
    );
    let rules_before = laptop_ok(&f, &["ip", "rule", "show"]);
    let table_before = laptop_ok(&f, &["ip", "route", "show", "table", "100"]);
    let url = format!("http://{BACKEND_1_IP}:{HTTP_PORT}/");
    let pod = BACKEND_1_IP.to_string();

    // Routes only: kvpn's pod route is in main, the rule sends pods to the veth.
    connect(&f, &["--allow-route-conflict"]);
    let route = laptop_ok(&f, &["ip", "route", "get", &pod]);
    assert!(route.contains(&format!("dev {vpn}")), "{route}");
    let out = f.laptop(&["curl", "-sS", "--max-time", "3", &url]);
    assert!(
        !out.status.success(),
        "without steering a pod must not be reachable: {}",
        text(&out.stdout)
    );
    let status = f.status_json();
    assert!(
        status["sessions"][0]["ebpf"]["steer"].is_null(),
        "no steering without --steer ebpf: {status}"
    );
    // Status tells the truth: routes cannot win over table 100 (tester finding:
    // it said "steered").
    let handled: Vec<&str> = status["sessions"][0]["conflicts"]
        .as_array()
        .map(|c| {
            c.iter()
                .filter(|c| c["laptop_dev"] == vpn.as_str() && c["laptop_table"] == "100")
                .filter_map(|c| c["handling"].as_str())
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(handled, vec!["unhandled"], "{status}");
    f.disconnect();

    // eBPF steering on the veth.
    connect(&f, &["--allow-route-conflict", "--steer", "ebpf"]);
    let progs = steer_programs(&f, &vpn);
    assert_eq!(progs.len(), 1, "{progs:?}\ndaemon log:\n{}", f.daemon_log());
    let out = f.laptop(&["curl", "-sS", "--max-time", "5", &url]);
    assert!(
        out.status.success(),
        "curl {url} through steering: {}\ndaemon log:\n{}",
        text(&out.stderr),
        f.daemon_log()
    );
    // A 4 MB upload and download: many full-size (and, leaving the veth, TSO/GSO
    // and CHECKSUM_PARTIAL) segments through the rewrite, both ways.
    let body = f.lab.dir().join("steer-upload");
    std::fs::write(&body, vec![7u8; 4 << 20]).expect("upload file");
    let out = f.laptop(&[
        "curl",
        "-sS",
        "--max-time",
        "20",
        "-X",
        "GET",
        "--data-binary",
        &format!("@{}", body.display()),
        "-o",
        "/dev/null",
        "-w",
        "%{http_code} %{size_download}",
        &format!("http://{BACKEND_1_IP}:{HTTP_PORT}/big?bytes={}", 4 << 20),
    ]);
    assert_eq!(
        text(&out.stdout),
        format!("200 {}", 4 << 20),
        "big exchange through steering: {}",
        text(&out.stderr)
    );
    let out = f.laptop(&["ping", "-c", "2", "-W", "2", &pod]);
    assert!(
        out.status.success(),
        "ping {pod} through steering: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let status = f.status_json();
    let session = &status["sessions"][0];
    assert_eq!(
        session["ebpf"]["steer"]["devices"],
        serde_json::json!([vpn]),
        "{status}"
    );
    // Two curls and 2 echo requests; a GSO super-packet counts once, with all its
    // bytes (the 4 MB upload: about 900 packets in the lab).
    let steered = steer_counter(&status, "steered");
    let reversed = steer_counter(&status, "reverse_translated");
    assert!(steered >= 6, "steered {steered}: {status}");
    let steered_bytes = status["sessions"][0]["ebpf"]["steer"]["steered"]["bytes"]
        .as_u64()
        .unwrap_or_default();
    assert!(
        steered_bytes > 4 << 20,
        "steered {steered_bytes} bytes: {status}"
    );
    assert!(reversed >= 4, "reverse translated {reversed}: {status}");
    assert_eq!(steer_counter(&status, "failed"), 0, "{status}");
    let handled: Vec<&str> = session["conflicts"]
        .as_array()
        .map(|c| {
            c.iter()
                .filter(|c| c["laptop_dev"] == vpn.as_str())
                .filter_map(|c| c["handling"].as_str())
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(handled, vec!["steered (ebpf)"], "{status}");
    eprintln!("steered {steered} packets, translated back {reversed}");

    // Disconnect: the program leaves the veth; the other VPN's rule and route stay.
    f.disconnect();
    let progs = steer_programs(&f, &vpn);
    assert!(progs.is_empty(), "steering left on {vpn}: {progs:?}");
    assert_eq!(laptop_ok(&f, &["ip", "rule", "show"]), rules_before);
    assert_eq!(
        laptop_ok(&f, &["ip", "route", "show", "table", "100"]),
        table_before
    );

    // SIGKILL of the root daemon: the TCX link dies with its file descriptor.
    connect(&f, &["--allow-route-conflict", "--steer", "ebpf"]);
    assert_eq!(steer_programs(&f, &vpn).len(), 1);
    let pid_file = f.runtime_dir().join("dataplane.pid");
    let pid: i32 = std::fs::read_to_string(&pid_file)
        .unwrap_or_else(|e| panic!("{}: {e}", pid_file.display()))
        .trim()
        .parse()
        .expect("pid");
    // SAFETY: kill(2) on the daemon this fixture started (its pid file).
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let t0 = std::time::Instant::now();
    while std::path::Path::new(&format!("/proc/{pid}/status")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap_or_default()
            .contains("State:\tZ")
    {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(5),
            "daemon {pid} lives"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let t0 = std::time::Instant::now();
    while !steer_programs(&f, &vpn).is_empty() {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(5),
            "steering outlived the SIGKILLed daemon on {vpn}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(laptop_ok(&f, &["ip", "rule", "show"]), rules_before);
}
