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

/// `kvpn connect` with the lab's arguments and `extra`; its stderr.
fn connect(f: &Fixture, extra: &[&str]) -> String {
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
    text(&out.stderr)
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

/// The other VPN's device, `kvpn-<lab>-ovpn` in the laptop netns (so removed with
/// it): a veth (peer `kvpn-<lab>-ovpq`) with ARP off and its table-100 route to the
/// pod CIDR. Returns the device name and the pod CIDR. Called again after the
/// device was deleted, it creates it again (another ifindex), as a reconnecting
/// VPN does.
fn add_other_vpn(f: &Fixture) -> (String, String) {
    let vpn = format!("kvpn-{}-ovpn", f.lab.id());
    let peer = format!("kvpn-{}-ovpq", f.lab.id());
    laptop_ok(
        f,
        &[
            "ip", "link", "add", &vpn, "type", "veth", "peer", "name", &peer,
        ],
    );
    laptop_ok(f, &["ip", "addr", "add", "192.168.213.2/24", "dev", &vpn]);
    // Without ARP the neighbour is NUD_NOARP: packets reach the TC egress hook at
    // once instead of waiting for an ARP reply nobody sends.
    laptop_ok(f, &["ip", "link", "set", &vpn, "arp", "off"]);
    for dev in [&vpn, &peer] {
        laptop_ok(f, &["ip", "link", "set", dev, "up"]);
    }
    let pods = POD_CIDR.to_string();
    laptop_ok(
        f,
        &["ip", "route", "add", &pods, "dev", &vpn, "table", "100"],
    );
    (vpn, pods)
}

/// The interface index of `dev` in the laptop netns (`ip -o link`: "N: name...").
fn ifindex(f: &Fixture, dev: &str) -> u64 {
    let line = laptop_ok(f, &["ip", "-o", "link", "show", "dev", dev]);
    line.split(':')
        .next()
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no ifindex in {line:?}"))
}

/// `ebpf.steer.attached` of the first session as (device, ifindex).
fn steer_attached(status: &serde_json::Value) -> Vec<(String, u64)> {
    status["sessions"][0]["ebpf"]["steer"]["attached"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|d| {
                    (
                        d["device"].as_str().unwrap_or_default().to_owned(),
                        d["ifindex"].as_u64().unwrap_or_default(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Polls (every 50 ms, up to 5 s) until `done` holds for the status and the
/// steering programs on `dev`; panics with `what`, both and the daemon log.
fn wait_for(f: &Fixture, dev: &str, what: &str, done: impl Fn(&serde_json::Value, &[u32]) -> bool) {
    let t0 = std::time::Instant::now();
    loop {
        let status = f.status_json();
        let progs = steer_programs(f, dev);
        if done(&status, &progs) {
            return;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(5),
            "{what}: steering programs on {dev}: {progs:?}\nstatus: {status}\ndaemon log:\n{}",
            f.daemon_log()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// rt-05 while the session runs: the other VPN reconnects (its device deleted and
/// created again under the same name: new ifindex, no TC program), then drops
/// its conflicting route. The steering watch re-attaches to the new device and
/// leaves the one without a conflicting route; Status says so.
///
/// On main (steering found at connect only) it fails at the re-created device:
/// no steering program ever comes on it, the poll ends after 5 s, and Status
/// still names the device (without ifindex).
#[test]
fn rt_05_steering_follows_a_recreated_device() {
    let f = Fixture::new();
    let (vpn, pods) = add_other_vpn(&f);
    laptop_ok(
        &f,
        &[
            "ip", "rule", "add", "to", &pods, "lookup", "100", "pref", "100",
        ],
    );
    let url = format!("http://{BACKEND_1_IP}:{HTTP_PORT}/");
    let curl = |when: &str| {
        let out = f.laptop(&["curl", "-sS", "--max-time", "5", &url]);
        assert!(
            out.status.success(),
            "curl {url} {when}: {}\ndaemon log:\n{}",
            text(&out.stderr),
            f.daemon_log()
        );
    };

    connect(&f, &["--allow-route-conflict", "--steer", "ebpf"]);
    let first = ifindex(&f, &vpn);
    curl("through steering at connect");
    let status = f.status_json();
    assert_eq!(
        status["sessions"][0]["ebpf"]["steer"]["devices"],
        serde_json::json!([vpn]),
        "{status}"
    );
    assert_eq!(steer_programs(&f, &vpn).len(), 1);

    // The other VPN reconnects: device deleted (its routes and TC programs go
    // with it) and created again with its route.
    laptop_ok(&f, &["ip", "link", "del", &vpn]);
    let (_, _) = add_other_vpn(&f);
    let second = ifindex(&f, &vpn);
    assert_ne!(first, second, "the re-created {vpn} has a new ifindex");
    let recreated = std::time::Instant::now();
    wait_for(
        &f,
        &vpn,
        "steering on the re-created device",
        |status, progs| progs.len() == 1 && steer_attached(status) == vec![(vpn.clone(), second)],
    );
    eprintln!(
        "steering on the re-created device seen {} ms after its route was added",
        recreated.elapsed().as_millis()
    );
    let before = steer_counter(&f.status_json(), "steered");
    // Through kvpn: the veth's peer answers nothing, so a reply proves the TUN.
    curl("after the other VPN re-created its device");
    let status = f.status_json();
    let after = steer_counter(&status, "steered");
    assert!(after > before, "steered {before} -> {after}: {status}");
    // Connect's own attachment is not counted: only the watch's one.
    assert_eq!(
        status["sessions"][0]["ebpf"]["steer"]["reattachments"], 1,
        "{status}"
    );
    assert_eq!(
        status["sessions"][0]["ebpf"]["steer"]["errors"],
        serde_json::json!([]),
        "{status}"
    );
    let table = text(&f.kvpn(&["status"]).stdout);
    assert!(
        table.contains(&format!("eBPF steering on {vpn} (ifindex {second})")),
        "{table}"
    );

    // A conflicting route through a device steering cannot handle (loopback: no
    // Ethernet, TUN, PPP or raw-IP framing) is an error in Status, not the end of
    // the session or of the steering that works.
    let lo_route = "10.244.200.0/24";
    laptop_ok(
        &f,
        &["ip", "route", "add", lo_route, "dev", "lo", "table", "100"],
    );
    wait_for(
        &f,
        &vpn,
        "the loopback conflict shown as an error",
        |status, _| {
            status["sessions"][0]["ebpf"]["steer"]["errors"]
                .as_array()
                .is_some_and(|e| {
                    e.len() == 1
                        && e[0].as_str().is_some_and(|m| {
                            m.contains("cannot steer lo") && m.contains("link type")
                        })
                })
        },
    );
    let status = f.status_json();
    assert_eq!(
        steer_attached(&status),
        vec![(vpn.clone(), second)],
        "{status}"
    );
    assert_eq!(status["sessions"][0]["state"], "connected", "{status}");
    curl("with an unsteerable conflict beside it");
    laptop_ok(
        &f,
        &["ip", "route", "del", lo_route, "dev", "lo", "table", "100"],
    );
    wait_for(
        &f,
        &vpn,
        "the loopback error gone with its route",
        |status, _| status["sessions"][0]["ebpf"]["steer"]["errors"] == serde_json::json!([]),
    );

    // The other VPN drops its route: nothing to steer on its device any more.
    laptop_ok(
        &f,
        &["ip", "route", "del", &pods, "dev", &vpn, "table", "100"],
    );
    wait_for(
        &f,
        &vpn,
        "steering left after the route went",
        |status, progs| {
            progs.is_empty()
                && status["sessions"][0]["ebpf"]["steer"]["devices"] == serde_json::json!([])
        },
    );
    // The rule now finds nothing in table 100: main, and kvpn's route, decide.
    curl("by kvpn's route once the conflict is gone");
    f.disconnect();
    for line in f
        .daemon_log()
        .lines()
        .filter(|l| l.contains("eBPF steering"))
    {
        eprintln!("{line}");
    }
}

#[test]
fn rt_05_ebpf_steering_wins_over_another_vpns_policy_route() {
    let f = Fixture::new();
    // Lives in the lab's laptop netns (rule and table route too): removed with it.
    let (vpn, pods) = add_other_vpn(&f);
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
    let stderr = connect(&f, &["--allow-route-conflict"]);
    // Connect says so itself (tester finding: only `status` showed `[unhandled]`
    // and the daemon logged "steering only cluster-bound traffic").
    let warning = stderr
        .lines()
        .find(|l| l.contains("route conflict not handled"))
        .unwrap_or_else(|| panic!("no unhandled-conflict warning from connect: {stderr}"));
    for want in [
        format!("dev {vpn}"),
        "table 100".to_owned(),
        pods.clone(),
        "unreachable".to_owned(),
        "--steer ebpf".to_owned(),
    ] {
        assert!(warning.contains(&want), "missing {want:?} in: {warning}");
    }
    let log = f.daemon_log();
    assert!(
        log.contains("route conflict allowed but not handled")
            && !log.contains("steering only cluster-bound traffic"),
        "the daemon log says what happens: {log}"
    );
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
