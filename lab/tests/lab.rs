//! Lab end-to-end tests (root; each test has its own lab instance, so they run in
//! parallel): topology, ClusterIP balancing and hairpin, the laptop's isolation, the
//! lab server's protocols, teardown and the persistent mode.

use std::collections::BTreeSet;
use std::io::{ErrorKind, Read as _, Write as _};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpStream, UdpSocket};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kvpn_lab::protocol::PageInfo;
use kvpn_lab::{
    BACKEND_1_IP, BACKEND_1_POD, BACKEND_2_IP, BACKEND_2_POD, ECHO_CLUSTER_IP, ECHO_SERVICE_PORT,
    LAPTOP, LAPTOP_UPLINK_IP, Lab, LabError, LabOptions, MANAGER_POD, MANAGER_POD_IP,
    ManagerProcess, NODE, NODE_BRIDGE_IP, UDP_ECHO_CLUSTER_IP, WEB_CLUSTER_IP, bin_path,
    down_named, lab_netns, payload, state_path,
};

fn server() -> String {
    bin_path("kvpn-lab-server")
        .expect("kvpn-lab-server is built with the tests")
        .display()
        .to_string()
}

/// A lab whose manager pod runs a lab server on :10801 instead of kvpn-manager (which
/// this crate does not build), so the NodePort path has something to answer.
fn lab_with_stand_in_manager() -> Lab {
    let options = LabOptions::default().manager(ManagerProcess::Command {
        program: server().into(),
        args: ["--name", "manager", "--http-port", "10801"]
            .map(String::from)
            .to_vec(),
    });
    Lab::up(options).expect("lab up")
}

fn lab_without_manager() -> Lab {
    Lab::up(LabOptions::default().without_manager()).expect("lab up")
}

/// `curl` inside `role`; returns (exit code, stdout).
fn curl(lab: &Lab, role: &str, url: &str) -> (i32, String) {
    let out = lab
        .exec_in(
            role,
            &[
                "curl",
                "-sS",
                "--connect-timeout",
                "3",
                "--max-time",
                "10",
                url,
            ],
        )
        .expect("run curl");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

fn page(lab: &Lab, role: &str, url: &str) -> PageInfo {
    let (code, body) = curl(lab, role, url);
    assert_eq!(code, 0, "curl {url} from {role} failed: {body}");
    PageInfo::parse(&body).unwrap_or_else(|| panic!("not a lab page from {url}: {body:?}"))
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit(')')
            .next()
            .is_some_and(|rest| !rest.trim_start().starts_with('Z'))
    })
}

#[test]
fn pod_ips_serve_pages_naming_their_pod() {
    let lab = lab_without_manager();
    for (pod, ip) in [(BACKEND_1_POD, BACKEND_1_IP), (BACKEND_2_POD, BACKEND_2_IP)] {
        let info = page(&lab, MANAGER_POD, &format!("http://{ip}:8080/"));
        assert_eq!(info.pod, pod);
        assert_eq!(info.pod_ip, IpAddr::V4(ip));
        assert_eq!(
            info.client.ip(),
            IpAddr::V4(MANAGER_POD_IP),
            "pod to pod keeps the source"
        );
        let (code, peer) = curl(&lab, MANAGER_POD, &format!("http://{ip}:8080/peer"));
        assert_eq!(code, 0);
        let peer: SocketAddr = peer.trim().parse().expect("/peer answers an address");
        assert_eq!(peer.ip(), IpAddr::V4(MANAGER_POD_IP));
    }
    let (code, _) = curl(
        &lab,
        MANAGER_POD,
        &format!("http://{BACKEND_1_IP}:8080/nothing-here"),
    );
    assert_eq!(code, 0, "curl without -f succeeds on 404");
    let out = lab
        .exec_in(
            MANAGER_POD,
            &[
                "curl",
                "-sS",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                &format!("http://{BACKEND_1_IP}:8080/nothing-here"),
            ],
        )
        .expect("curl");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "404");
    let info = lab.info();
    assert!(info.contains("backend-1  10.244.1.11"), "{info}");
    assert!(
        info.contains("10.96.0.100:80/tcp -> 10.244.1.11:8080, 10.244.1.12:8080"),
        "{info}"
    );
}

#[test]
fn web_cluster_ip_balances_over_both_backends_also_hairpin() {
    let lab = lab_without_manager();
    let url = format!("http://{WEB_CLUSTER_IP}/");
    let mut seen = BTreeSet::new();
    for _ in 0..20 {
        let info = page(&lab, MANAGER_POD, &url);
        let expected_ip = if info.pod == BACKEND_1_POD {
            BACKEND_1_IP
        } else {
            BACKEND_2_IP
        };
        assert_eq!(
            info.pod_ip,
            IpAddr::V4(expected_ip),
            "DNAT reached the pod's own address"
        );
        assert_eq!(
            info.client.ip(),
            IpAddr::V4(MANAGER_POD_IP),
            "no SNAT between pods"
        );
        seen.insert(info.pod);
    }
    assert_eq!(
        seen,
        BTreeSet::from([BACKEND_1_POD.to_owned(), BACKEND_2_POD.to_owned()])
    );

    // Hairpin: backend-1 calling its own ClusterIP; when it lands on itself the node
    // masquerades it (the page shows the bridge address as the client).
    let mut seen = BTreeSet::new();
    for _ in 0..20 {
        let info = page(&lab, BACKEND_1_POD, &url);
        if info.pod == BACKEND_1_POD {
            assert_eq!(
                info.client.ip(),
                IpAddr::V4(NODE_BRIDGE_IP),
                "hairpin is masqueraded"
            );
        } else {
            assert_eq!(info.client.ip(), IpAddr::V4(BACKEND_1_IP));
        }
        seen.insert(info.pod);
    }
    assert_eq!(seen.len(), 2, "hairpin reaches both backends: {seen:?}");
}

#[test]
fn udp_and_tcp_echo_through_cluster_ips() {
    let lab = lab_without_manager();
    lab.run_in(MANAGER_POD, || {
        // UDP: small, bigger than the MTU (fragmented), and the largest datagram.
        let socket = UdpSocket::bind("0.0.0.0:0").expect("bind");
        socket
            .connect((UDP_ECHO_CLUSTER_IP, ECHO_SERVICE_PORT))
            .expect("connect");
        socket
            .set_read_timeout(Some(Duration::from_secs(3)))
            .expect("timeout");
        for size in [1usize, 1400, 4000, 65507] {
            let mut datagram = vec![0u8; size];
            payload::fill(size as u64, &mut datagram);
            socket.send(&datagram).expect("send");
            let mut reply = vec![0u8; 65536];
            let n = socket
                .recv(&mut reply)
                .unwrap_or_else(|e| panic!("no echo of {size} bytes: {e}"));
            assert_eq!(&reply[..n], &datagram[..], "echo of {size} bytes");
        }

        // TCP: echo until EOF.
        let mut stream =
            TcpStream::connect((ECHO_CLUSTER_IP, ECHO_SERVICE_PORT)).expect("connect echo");
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let writer = {
            let mut w = stream.try_clone().expect("clone");
            let data = data.clone();
            std::thread::spawn(move || {
                w.write_all(&data).expect("write");
                w.shutdown(Shutdown::Write).expect("half-close");
            })
        };
        let mut echoed = Vec::new();
        stream.read_to_end(&mut echoed).expect("read echo");
        writer.join().expect("writer");
        assert_eq!(echoed.len(), data.len());
        assert!(echoed == data, "echo is byte-exact");

        // tr-05 support: WRITE n CLOSE with the client half-closed first.
        let mut stream =
            TcpStream::connect((ECHO_CLUSTER_IP, ECHO_SERVICE_PORT)).expect("connect echo");
        stream.write_all(b"WRITE 5000000 CLOSE\n").expect("command");
        stream.shutdown(Shutdown::Write).expect("half-close");
        let started = Instant::now();
        let mut got = Vec::new();
        stream.read_to_end(&mut got).expect("read until EOF");
        assert_eq!(got.len(), 5_000_000);
        assert_eq!(payload::sha256_hex_of(&got), payload::sha256_hex(5_000_000));
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "EOF came promptly"
        );

        // tr-06 support: RESET aborts with a RST.
        let mut stream =
            TcpStream::connect((ECHO_CLUSTER_IP, ECHO_SERVICE_PORT)).expect("connect echo");
        stream.write_all(b"RESET\n").expect("command");
        let mut buf = [0u8; 16];
        let err = stream
            .read(&mut buf)
            .expect_err("RESET must not end in a clean EOF");
        assert_eq!(err.kind(), ErrorKind::ConnectionReset, "{err}");
    })
    .expect("run in the manager pod");
}

#[test]
fn big_download_matches_its_sha256() {
    let lab = lab_without_manager();
    for (query, len) in [
        ("", payload::BIG_DEFAULT_BYTES),
        ("?bytes=1234567", 1_234_567),
    ] {
        let file = lab.dir().join(format!("big{len}"));
        let out = lab
            .exec_in(
                MANAGER_POD,
                &[
                    "curl",
                    "-sS",
                    "--max-time",
                    "60",
                    "-o",
                    &file.display().to_string(),
                    &format!("http://{WEB_CLUSTER_IP}/big{query}"),
                ],
            )
            .expect("curl");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let data = std::fs::read(&file).expect("downloaded file");
        assert_eq!(data.len() as u64, len);
        assert_eq!(payload::sha256_hex_of(&data), payload::sha256_hex(len));
    }
}

#[test]
fn laptop_reaches_only_the_manager_node_port() {
    let lab = lab_with_stand_in_manager();
    let info = page(
        &lab,
        LAPTOP,
        &format!("http://{}/", lab.manager_addr_from_laptop()),
    );
    assert_eq!(info.pod, "manager");
    assert_eq!(info.pod_ip, IpAddr::V4(MANAGER_POD_IP));
    assert_eq!(
        info.client.ip(),
        IpAddr::V4(LAPTOP_UPLINK_IP),
        "the NodePort forward keeps the laptop's address"
    );

    for url in [
        format!("http://{BACKEND_1_IP}:8080/"),
        format!("http://{MANAGER_POD_IP}:10801/"),
        format!("http://{WEB_CLUSTER_IP}/"),
        "http://10.96.0.1/".to_owned(),
    ] {
        let started = Instant::now();
        let (code, _) = curl(&lab, LAPTOP, &url);
        assert_eq!(code, 7, "{url} must fail to connect from the laptop");
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{url} fails fast (no route)"
        );
    }
    let out = lab
        .exec_in(LAPTOP, &["ip", "route", "get", &BACKEND_1_IP.to_string()])
        .expect("ip");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unreachable"),
        "{out:?}"
    );

    // The bench's baseline path: with direct routes the laptop reaches pods and
    // ClusterIPs; removing them restores the isolation.
    lab.add_laptop_direct_routes().expect("add routes");
    assert_eq!(
        page(&lab, LAPTOP, &format!("http://{BACKEND_2_IP}:8080/")).pod,
        BACKEND_2_POD
    );
    assert!(
        page(&lab, LAPTOP, &format!("http://{WEB_CLUSTER_IP}/"))
            .pod
            .starts_with("backend-")
    );
    lab.remove_laptop_direct_routes().expect("remove routes");
    assert_eq!(
        curl(&lab, LAPTOP, &format!("http://{BACKEND_2_IP}:8080/")).0,
        7
    );
}

#[test]
fn sysctls_of_node_and_pods() {
    let lab = lab_without_manager();
    let sysctl = |role: &str, key: &str| {
        let out = lab.exec_in(role, &["sysctl", "-n", key]).expect("sysctl");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(sysctl(NODE, "net.ipv4.ip_forward"), "1");
    assert_eq!(sysctl(NODE, "net.bridge.bridge-nf-call-iptables"), "1");
    for pod in [MANAGER_POD, BACKEND_1_POD, BACKEND_2_POD] {
        assert_eq!(
            sysctl(pod, "net.ipv4.ping_group_range"),
            "0 2147483647",
            "{pod}"
        );
    }
    assert_eq!(
        lab.node_netns()
            .sysctl("net.ipv4.ip_forward")
            .expect("read"),
        "1"
    );
    // The pod's ping works to the gateway and the unused pod IP does not answer.
    let ok = lab
        .exec_in(
            MANAGER_POD,
            &["ping", "-c1", "-W1", &NODE_BRIDGE_IP.to_string()],
        )
        .expect("ping");
    assert!(ok.status.success(), "{ok:?}");
    let bad = lab
        .exec_in(
            MANAGER_POD,
            &["ping", "-c1", "-W1", &kvpn_lab::UNUSED_POD_IP.to_string()],
        )
        .expect("ping");
    assert!(!bad.status.success());
}

#[test]
fn down_leaves_nothing_and_is_idempotent() {
    let mut lab = lab_with_stand_in_manager();
    let id = lab.id().to_owned();
    let names = lab_netns(&id).expect("list");
    assert_eq!(
        names,
        ["backend-1", "backend-2", "laptop", "manager", "node"]
            .map(|r| format!("kvpn-{id}-{r}"))
            .to_vec()
    );
    let pids: Vec<u32> = lab.processes().iter().map(|p| p.pid).collect();
    assert_eq!(pids.len(), 3, "{:?}", lab.processes());
    assert!(pids.iter().all(|&p| alive(p)));
    // A process the lab did not start, left running in a pod's netns.
    let mut stray = lab.command_in(BACKEND_2_POD, "sleep").expect("cmd");
    let mut stray = stray.arg("300").spawn().expect("spawn sleep");
    let dir = lab.dir().to_owned();
    assert!(dir.join("backend-1.log").is_file());

    let started = Instant::now();
    lab.down().expect("down");
    let took = started.elapsed();
    assert!(
        lab_netns(&id).expect("list").is_empty(),
        "netns left: {:?}",
        lab_netns(&id)
    );
    for pid in pids {
        assert!(!alive(pid), "pid {pid} survived");
    }
    let status = stray.wait().expect("wait for the stray sleep");
    assert!(
        !status.success(),
        "stray sleep was stopped by the teardown: {status:?}"
    );
    assert!(!dir.exists(), "lab folder removed");
    assert!(took < Duration::from_secs(5), "down took {took:?}");
    lab.down().expect("second down is a no-op");
}

#[test]
fn two_labs_at_once_do_not_interfere() {
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(lab_without_manager);
        let b = s.spawn(lab_without_manager);
        (a.join().expect("lab a"), b.join().expect("lab b"))
    });
    assert_ne!(a.id(), b.id());
    assert_eq!(
        page(&a, MANAGER_POD, &format!("http://{BACKEND_1_IP}:8080/")).pod,
        BACKEND_1_POD
    );
    assert_eq!(
        page(&b, MANAGER_POD, &format!("http://{BACKEND_1_IP}:8080/")).pod,
        BACKEND_1_POD
    );
    // A listener only in lab a's manager pod is invisible from lab b.
    let pid = a
        .spawn_in(
            MANAGER_POD,
            "extra",
            Command::new(server()).args([
                "--name",
                "only-in-a",
                "--http-port",
                "9000",
                "--echo-port",
                "9001",
            ]),
        )
        .expect("spawn");
    a.wait_tcp(
        NODE,
        SocketAddr::from((MANAGER_POD_IP, 9000)),
        Duration::from_secs(5),
    )
    .expect("ready");
    assert_eq!(
        page(&a, BACKEND_1_POD, &format!("http://{MANAGER_POD_IP}:9000/")).pod,
        "only-in-a"
    );
    assert_eq!(
        curl(&b, BACKEND_1_POD, &format!("http://{MANAGER_POD_IP}:9000/")).0,
        7
    );
    assert!(a.processes().iter().any(|p| p.pid == pid && p.alive));
    let b_id = b.id().to_owned();
    drop(a);
    assert_eq!(
        lab_netns(&b_id).expect("list").len(),
        5,
        "lab b intact after a is gone"
    );
    assert!(
        page(&b, MANAGER_POD, &format!("http://{WEB_CLUSTER_IP}/"))
            .pod
            .starts_with("backend-")
    );
}

#[test]
fn persistent_lab_is_torn_down_by_name() {
    let name = format!("test-{}", std::process::id());
    let lab = Lab::up(LabOptions::default().without_manager().persist_as(&name)).expect("lab up");
    let id = lab.id().to_owned();
    let pids: Vec<u32> = lab.processes().iter().map(|p| p.pid).collect();
    match Lab::up(LabOptions::default().without_manager().persist_as(&name)) {
        Err(LabError::AlreadyUp { .. }) => {}
        other => panic!("a second lab with the same name must be refused: {other:?}"),
    }
    let state = lab.detach().expect("detach");
    assert_eq!(state, state_path(&name));
    let text = std::fs::read_to_string(&state).expect("state file");
    assert!(text.contains(&id), "{text}");
    assert_eq!(
        lab_netns(&id).expect("list").len(),
        5,
        "detached lab keeps running"
    );
    assert!(pids.iter().all(|&p| alive(p)));

    let attached = Lab::attach(&name).expect("attach");
    assert_eq!(attached.id(), id);
    assert!(
        page(&attached, MANAGER_POD, &format!("http://{WEB_CLUSTER_IP}/"))
            .pod
            .starts_with("backend-")
    );
    drop(attached);
    assert_eq!(
        lab_netns(&id).expect("list").len(),
        5,
        "dropping an attached handle keeps the lab"
    );

    assert!(down_named(&name).expect("down by name"));
    assert!(lab_netns(&id).expect("list").is_empty());
    // The pids were our children (same test process): dead means zombie or gone.
    assert!(pids.iter().all(|&p| !alive(p)), "processes stopped");
    assert!(!state.exists(), "state file removed");
    assert!(
        !down_named(&name).expect("second down"),
        "nothing left to tear down"
    );
}

#[test]
fn lab_server_exits_cleanly_on_sigterm() {
    let lab = lab_without_manager();
    let pid = lab
        .spawn_in(
            BACKEND_1_POD,
            "sigterm",
            Command::new(server()).args(["--http-port", "9100", "--echo-port", "9101"]),
        )
        .expect("spawn");
    lab.wait_tcp(
        NODE,
        SocketAddr::from((BACKEND_1_IP, 9100)),
        Duration::from_secs(5),
    )
    .expect("ready");
    let status = lab
        .stop_process(pid, Duration::from_secs(3))
        .expect("stop")
        .expect("our child");
    assert_eq!(status.code(), Some(0), "{status:?}");
}

#[test]
fn failed_up_removes_what_it_built() {
    // The stand-in manager writes the name of its netns (`ip netns identify`) and exits.
    let marker = std::env::temp_dir().join(format!("kvpn-lab-test-{}-marker", std::process::id()));
    let script = format!("ip netns identify > {}; exit 3", marker.display());
    let options = LabOptions::default().manager(ManagerProcess::Command {
        program: "/bin/sh".into(),
        args: vec!["-c".into(), script],
    });
    match Lab::up(options) {
        Err(LabError::Exited { name, status, .. }) => {
            assert_eq!(name, "manager");
            assert_eq!(status.code(), Some(3));
        }
        other => panic!("up must fail when the manager exits: {other:?}"),
    }
    let netns = std::fs::read_to_string(&marker).expect("marker written");
    let _ = std::fs::remove_file(&marker);
    let netns = netns.trim();
    assert!(
        netns.starts_with("kvpn-") && netns.ends_with("-manager"),
        "{netns}"
    );
    assert!(
        !Path::new("/run/netns").join(netns).exists(),
        "{netns} removed after the failed up"
    );
    let id = &netns["kvpn-".len().."kvpn-".len() + 5];
    assert!(lab_netns(id).expect("list").is_empty());
}

#[test]
fn netns_helpers_enter_the_right_namespace() {
    let lab = lab_without_manager();
    // A socket opened inside the laptop netns sees only the uplink.
    let addr = lab
        .run_in(LAPTOP, || {
            let s = UdpSocket::bind("0.0.0.0:0").expect("bind");
            s.connect((kvpn_lab::NODE_UPLINK_IP, 9))
                .expect("route to the node");
            s.local_addr().expect("addr").ip()
        })
        .expect("run in laptop");
    assert_eq!(addr, IpAddr::V4(LAPTOP_UPLINK_IP));
    let unreachable = lab
        .run_in(LAPTOP, || {
            UdpSocket::bind("0.0.0.0:0")
                .expect("bind")
                .connect((Ipv4Addr::new(10, 244, 1, 11), 9))
                .is_err()
        })
        .expect("run in laptop");
    assert!(unreachable, "no route from the laptop to a pod");
    assert!(matches!(
        lab.netns("nope"),
        Err(LabError::UnknownRole { .. })
    ));
    assert_eq!(
        lab.netns(BACKEND_2_POD).expect("pod").name(),
        format!("kvpn-{}-backend-2", lab.id())
    );
}

#[test]
fn orphaned_lab_is_reaped_and_live_ones_are_not() {
    let live = lab_without_manager();
    let orphan = lab_without_manager();
    let id = orphan.id().to_owned();
    let pids: Vec<u32> = orphan.processes().iter().map(|p| p.pid).collect();
    let dir = orphan.dir().to_owned();
    // Pretend the orphan's builder died: its owner record names a finished process.
    let mut gone = Command::new("true").spawn().expect("spawn true");
    let dead_pid = gone.id();
    gone.wait().expect("reap true");
    let owner = kvpn_lab::state_dir()
        .join("owners")
        .join(format!("{id}.json"));
    let text = std::fs::read_to_string(&owner).expect("owner record of a running lab");
    assert!(
        text.contains(&format!("\"pid\":{}", std::process::id())),
        "{text}"
    );
    std::fs::write(
        &owner,
        format!(
            "{{\"pid\":{dead_pid},\"start_ticks\":1,\"dir\":{:?}}}",
            dir.display().to_string()
        ),
    )
    .expect("rewrite owner");
    std::mem::forget(orphan);

    let reaped = kvpn_lab::reap_orphaned_labs().expect("reap");
    assert!(reaped.contains(&id), "{reaped:?}");
    assert!(
        !reaped.iter().any(|r| r == live.id()),
        "a live lab is not an orphan"
    );
    assert!(lab_netns(&id).expect("list").is_empty());
    assert!(pids.iter().all(|&p| !alive(p)));
    assert!(!owner.exists() && !dir.exists());
    assert_eq!(lab_netns(live.id()).expect("list").len(), 5);
    assert_eq!(
        page(&live, MANAGER_POD, &format!("http://{BACKEND_2_IP}:8080/")).pod,
        BACKEND_2_POD
    );
}

#[test]
fn pods_added_later_are_reachable_and_usable_by_role() {
    let lab = lab_without_manager();
    let ip = lab.node().free_pod_ip().expect("a free pod IP");
    assert_eq!(
        ip,
        Ipv4Addr::new(10, 244, 1, 2),
        "lowest free address after the gateway"
    );
    let pod = lab.node().add_pod("late", ip).expect("add pod");
    assert!(
        lab.node()
            .add_pod("late", Ipv4Addr::new(10, 244, 1, 3))
            .is_err(),
        "name taken"
    );
    assert!(lab.node().add_pod("other", ip).is_err(), "IP taken");
    lab.spawn_in(
        "late",
        "late-server",
        Command::new(server()).args(["--name", "late"]),
    )
    .expect("spawn by role");
    lab.wait_tcp(NODE, SocketAddr::from((ip, 8080)), Duration::from_secs(5))
        .expect("ready");
    assert_eq!(
        page(&lab, BACKEND_1_POD, &format!("http://{ip}:8080/")).pod,
        "late"
    );
    // Removing it and adding a pod with the same IP again works at once.
    let pid = lab
        .processes()
        .iter()
        .find(|p| p.name == "late-server")
        .expect("tracked")
        .pid;
    lab.stop_process(pid, Duration::from_secs(3)).expect("stop");
    lab.node().remove_pod(&pod).expect("remove");
    assert!(!pod.netns.exists());
    let again = lab.node().add_pod("late-2", ip).expect("same IP again");
    let out = lab
        .exec_in(BACKEND_1_POD, &["ping", "-c1", "-W2", &ip.to_string()])
        .expect("ping");
    assert!(out.status.success(), "{out:?}");
    assert_eq!(again.host_veth, pod.host_veth);
    let link = lab
        .exec_in("late-2", &["ip", "-br", "link", "show", "eth0"])
        .expect("ip");
    assert!(
        String::from_utf8_lossy(&link.stdout).contains("0a:58:0a:f4:01:02"),
        "{link:?}"
    );
}

#[test]
fn restart_manager_starts_a_new_process_that_serves() {
    let lab = lab_with_stand_in_manager();
    let url = format!("http://{}/", lab.manager_addr_from_laptop());
    assert_eq!(page(&lab, LAPTOP, &url).pod, "manager");
    let manager_pids = |lab: &Lab| -> Vec<u32> {
        lab.processes()
            .iter()
            .filter(|p| p.name == MANAGER_POD && p.alive)
            .map(|p| p.pid)
            .collect()
    };
    let before = manager_pids(&lab);
    assert_eq!(before.len(), 1, "one manager process before: {before:?}");

    let pid = lab.restart_manager().expect("restart the manager");
    assert_ne!(pid, before[0], "a new process");
    assert!(
        !alive(before[0]),
        "the old manager {} still runs",
        before[0]
    );
    assert_eq!(
        manager_pids(&lab),
        vec![pid],
        "exactly the new manager runs"
    );
    // It listens already when restart_manager returns.
    assert_eq!(page(&lab, LAPTOP, &url).pod, "manager");

    let without = lab_without_manager();
    let err = without
        .restart_manager()
        .expect_err("no manager to restart");
    assert!(
        err.to_string().contains("no manager process"),
        "error names the cause: {err}"
    );
}
