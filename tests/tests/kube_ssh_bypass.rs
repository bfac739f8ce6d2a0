//! The SSH data-plane bypass ([ssh] item 4) end to end on the Kubernetes lab, with
//! the real OpenSSH sshd and a laptop that cannot reach the API server but through
//! SSH:
//! - sshd in the lab's node netns (a cluster node: kube-proxy's rules reach every
//!   ClusterIP) → `kvpn status -o json` says `ssh-direct via … to <manager
//!   ClusterIP>:10801`, and sshd itself holds the TCP connection to that ClusterIP;
//! - sshd on a bastion that reaches only the API server → `port-forward via ssh …`.
//!
//! On both: curl to the web ClusterIP works; killing the SSH connection (the sshd
//! child serving it, by pid) and black-holing it (nftables drop in the laptop netns)
//! make the session reconnect, redial SSH and carry traffic again within bounds;
//! `kvpn uninstall` works through the jump host. On the ssh-direct path also: the
//! SSH connection has TCP_NODELAY (also after the redial) and 1-byte round trips
//! through the tunnel do not stall on delayed ACKs.
//!
//! Needs the workspace binaries (`cargo build --bins`, then `KVPN_BIN_DIR`), the
//! Kubernetes binaries of `scripts/build-kubernetes.sh` and openssh-server/-client.

use std::net::{IpAddr, SocketAddr};
use std::process::Output;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use kvpn_tests::kube_lab::{KubeFixture, web};
use kvpn_tests::ssh_lab::{PASSWORD, SshLab, ok};
use kvpn_tests::text;

/// Traffic must flow again within this long after the SSH connection was killed:
/// the agent's channels close with it, the root daemon redials at once and the
/// agent opens a new SSH connection (a handshake and a login, tens of ms here).
const KILL_RECOVERY: Duration = Duration::from_secs(10);

/// Status must say reconnecting within this long after the SSH path went silent:
/// 3 s without a heartbeat echo, plus one 1 s heartbeat interval (tr-10), plus
/// slack for a loaded machine.
const RECONNECTING_WITHIN: Duration = Duration::from_secs(6);

/// How long the SSH path stays black-holed: longer than the session agent's SSH
/// keepalive takes to give the connection up (2 s × 3 unanswered, see
/// `kvpn_control::ssh::bypass::SESSION_KEEPALIVE`), so recovery needs a new SSH
/// connection.
const HOLE: Duration = Duration::from_secs(12);

/// Traffic must flow again within this long after the hole healed: the agent's SSH
/// redial may sit in a SYN retransmission (1 s, 3 s, 7 s apart) when the hole heals.
const HEAL_RECOVERY: Duration = Duration::from_secs(30);

/// 1-byte request/response round trips through the tunnel in
/// [`small_round_trips`].
const ROUND_TRIPS: usize = 200;

/// A round trip this slow is a stall, not a slow machine: Linux delays an ACK by
/// at least 40 ms, and a small SSH packet held back by Nagle's algorithm waits for
/// just that ACK (the round trips here take about a millisecond).
const STALL: Duration = Duration::from_millis(35);

/// The most stalled round trips [`small_round_trips`] accepts: a Nagle/delayed-ACK
/// defect stalls a large share of them; a few may stall on a busy machine.
const MAX_STALLS: usize = ROUND_TRIPS / 20;

/// The user daemon's TCP connections to `ssh_addr` (its SSH path's first hop)
/// and whether each has TCP_NODELAY, read from the socket itself (`ss` does not
/// show the option): the file descriptor is duplicated out of the daemon with
/// `pidfd_getfd` (the test runs as root) and asked with `getsockopt`.
fn ssh_sockets_nodelay(fx: &KubeFixture, ssh_addr: &str) -> Vec<(String, bool)> {
    let mut found = Vec::new();
    for pid in fx.user_daemon_pids() {
        let out = fx.laptop(&["ss", "-Htnp", "state", "established"]);
        for line in text(&out.stdout).lines() {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // -H with a state filter: Recv-Q Send-Q Local Peer Process.
            if cols.get(3) != Some(&ssh_addr) || !line.contains(&format!("pid={pid},")) {
                continue;
            }
            let fd = line
                .split(&format!("pid={pid},fd="))
                .nth(1)
                .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
                .and_then(|n| n.parse::<i32>().ok())
                .unwrap_or_else(|| panic!("no fd in the ss line {line:?}"));
            found.push((line.to_owned(), socket_nodelay(pid, fd)));
        }
    }
    found
}

/// TCP_NODELAY of file descriptor `fd` of process `pid`.
fn socket_nodelay(pid: u32, fd: i32) -> bool {
    // SAFETY: plain syscalls on integers; every descriptor opened here is closed here.
    unsafe {
        let pidfd = libc::syscall(libc::SYS_pidfd_open, pid as libc::c_int, 0) as libc::c_int;
        assert!(
            pidfd >= 0,
            "pidfd_open({pid}): {}",
            std::io::Error::last_os_error()
        );
        let own = libc::syscall(libc::SYS_pidfd_getfd, pidfd, fd, 0) as libc::c_int;
        let err = std::io::Error::last_os_error();
        libc::close(pidfd);
        assert!(own >= 0, "pidfd_getfd({pid}, {fd}): {err}");
        let mut on: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        let r = libc::getsockopt(
            own,
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            (&raw mut on).cast(),
            &raw mut len,
        );
        let err = std::io::Error::last_os_error();
        libc::close(own);
        assert_eq!(r, 0, "getsockopt(TCP_NODELAY) on fd {fd} of {pid}: {err}");
        on != 0
    }
}

/// The user daemon's SSH connection to the first hop has TCP_NODELAY: without it
/// a small SSH packet written while another is unacknowledged waits for sshd's
/// delayed ACK (the ssh-direct path's idle ping took 16 ms, its connection setup
/// ~40 ms, before it was set).
fn assert_ssh_nodelay(fx: &KubeFixture, lab: &SshLab) {
    let addr = lab.bastions[0].ssh_addr();
    let sockets = ssh_sockets_nodelay(fx, &addr);
    assert!(
        !sockets.is_empty(),
        "the user daemon holds no TCP connection to {addr}\n{}",
        fx.diagnostics()
    );
    for (line, nodelay) in &sockets {
        assert!(nodelay, "no TCP_NODELAY on the SSH connection {line}");
    }
}

/// [`ROUND_TRIPS`] 1-byte requests to the echo Service through the tunnel, one at
/// a time, each answered before the next: at most [`MAX_STALLS`] take [`STALL`]
/// or longer. Returns the slowest.
fn small_round_trips(fx: &KubeFixture) -> Duration {
    use std::io::{Read, Write};
    let echo = SocketAddr::from((
        fx.lab().addressing().echo_cluster_ip(),
        kvpn_lab::ECHO_SERVICE_PORT,
    ));
    let times = fx
        .lab()
        .netns_lab()
        .run_in(
            kvpn_lab::LAPTOP,
            move || -> std::io::Result<Vec<Duration>> {
                let mut s = std::net::TcpStream::connect_timeout(&echo, Duration::from_secs(5))?;
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(Duration::from_secs(5)))?;
                let mut times = Vec::with_capacity(ROUND_TRIPS);
                let mut b = [0u8; 1];
                for i in 0..ROUND_TRIPS {
                    let t0 = Instant::now();
                    s.write_all(&[i as u8])?;
                    s.read_exact(&mut b)?;
                    times.push(t0.elapsed());
                    if b[0] != i as u8 {
                        return Err(std::io::Error::other(format!("echo of {i} was {}", b[0])));
                    }
                }
                Ok(times)
            },
        )
        .unwrap_or_else(|e| panic!("laptop netns: {e:#}"))
        .unwrap_or_else(|e| panic!("round trips to {echo}: {e}\n{}", fx.diagnostics()));
    let mut sorted = times.clone();
    sorted.sort();
    let stalls = times.iter().filter(|t| **t >= STALL).count();
    eprintln!(
        "ssh-direct: {ROUND_TRIPS} 1-byte round trips to {echo}: p50 {:?}, max {:?}, {stalls} ≥ {STALL:?}",
        sorted[ROUND_TRIPS / 2],
        sorted[ROUND_TRIPS - 1]
    );
    assert!(
        stalls <= MAX_STALLS,
        "{stalls} of {ROUND_TRIPS} round trips took ≥ {STALL:?} (delayed-ACK stalls): {times:?}"
    );
    sorted[ROUND_TRIPS - 1]
}

/// The SSH flags for the first bastion, password login.
fn ssh_flags(lab: &SshLab) -> Vec<String> {
    let kh = lab.known_hosts_all().to_string_lossy().into_owned();
    [
        "--ssh-addr",
        &lab.bastions[0].ssh_addr(),
        "--ssh-username",
        "root",
        "--ssh-password",
        PASSWORD,
        "--ssh-known-hosts",
        &kh,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

/// `kvpn <cmd> --kubeconfig <user's> <ssh flags>` through the lab's HOME.
fn kvpn_ssh(fx: &KubeFixture, lab: &SshLab, cmd: &str) -> Output {
    let kubeconfig = fx.user_kubeconfig();
    let flags = ssh_flags(lab);
    let mut args = vec![cmd, "--kubeconfig", kubeconfig.as_str()];
    args.extend(flags.iter().map(String::as_str));
    lab.kvpn(fx, &args, None)
}

/// The manager Service's ClusterIP (admin client).
fn manager_cluster_ip(fx: &KubeFixture) -> IpAddr {
    let api: kube::Api<Service> = kube::Api::namespaced(fx.admin(), "kvpn-system");
    let svc = fx
        .block_on(api.get("kvpn-manager"))
        .unwrap_or_else(|e| panic!("get Service kvpn-manager: {e}"));
    svc.spec
        .and_then(|s| s.cluster_ip)
        .and_then(|ip| ip.parse().ok())
        .unwrap_or_else(|| panic!("Service kvpn-manager has no ClusterIP"))
}

/// `curl` to the web ClusterIP from the laptop netns: the lab page's pod name.
fn curl_web(fx: &KubeFixture) -> String {
    let url = format!("http://{}/", web());
    let out = fx.laptop(&["curl", "-sS", "-m", "5", &url]);
    assert!(
        out.status.success(),
        "curl {url}: {}{}\n{}",
        text(&out.stdout),
        text(&out.stderr),
        fx.diagnostics()
    );
    let body = text(&out.stdout);
    assert!(body.contains("pod"), "not a lab page from {url}: {body}");
    body
}

/// The user daemon's log (it hosts the sessions' SSH and port-forward sides), whole.
fn agent_logs(fx: &KubeFixture) -> String {
    std::fs::read_to_string(fx.runtime_dir().join("user.log"))
        .unwrap_or_else(|e| panic!("user daemon log: {e}"))
}

/// How many times the root daemon's log says a data channel was lost.
fn transports_lost(fx: &KubeFixture) -> usize {
    std::fs::read_to_string(fx.runtime_dir().join("dataplane.log"))
        .unwrap_or_default()
        .matches("transport lost")
        .count()
}

/// Kill the SSH connection, then black-hole it: both times the session
/// reconnects, SSH is redialled and traffic comes back within the bounds.
fn ssh_loss_and_recovery(fx: &KubeFixture, lab: &SshLab, direct: Option<SocketAddr>) {
    let b = &lab.bastions[0];
    let path = fx.session()["data_path"]
        .as_str()
        .unwrap_or_default()
        .to_owned();

    // 1. Kill the sshd child serving the agent's SSH connection.
    let before = b.connection_pids();
    assert!(
        !before.is_empty(),
        "no SSH connection of the agent:\n{}",
        b.log()
    );
    let lost_before = transports_lost(fx);
    for pid in &before {
        // SAFETY: kill by pid a child process of the sshd this test started.
        unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
    }
    let killed = Instant::now();
    let (took, page) = fx.wait_http(web(), killed, KILL_RECOVERY);
    eprintln!(
        "{path}: traffic again {:.2} s after the SSH connection was killed (bound {} s)",
        took.as_secs_f64(),
        KILL_RECOVERY.as_secs()
    );
    assert!(!page.pod.is_empty());
    let after = b.connection_pids();
    assert!(
        !after.is_empty() && after.iter().all(|p| !before.contains(p)),
        "a new SSH connection must replace the killed one: before {before:?}, after {after:?}"
    );
    if direct.is_some() {
        // The data channel died with the SSH connection: the root daemon noticed
        // (reconnecting) and redialled. A port-forward data channel may survive a
        // killed SSH connection only if no traffic crossed it; here it is killed too.
        assert!(
            transports_lost(fx) > lost_before,
            "the root daemon never lost its data channel:\n{}",
            fx.diagnostics()
        );
    }
    fx.wait_state("connected", Duration::from_secs(15));
    if let Some(target) = direct {
        let conns = b.connections_to(target);
        assert!(
            conns.iter().any(|l| l.contains("sshd")),
            "after the redial sshd must again hold the connection to {target}: {conns:?}"
        );
    }

    // 2. Black-hole it: silence, no RST.
    let before = b.connection_pids();
    let mut hole = lab.black_hole_ssh();
    let opened = Instant::now();
    let detected = fx.wait_state("reconnecting", Duration::from_secs(20));
    eprintln!(
        "{path}: status reconnecting {:.2} s after the SSH path was black-holed (bound {} s)",
        detected.as_secs_f64(),
        RECONNECTING_WITHIN.as_secs()
    );
    assert!(
        detected <= RECONNECTING_WITHIN,
        "reconnecting after {detected:?}, bound {RECONNECTING_WITHIN:?}"
    );
    let r = fx.http_get(web(), Duration::from_secs(2));
    assert!(r.is_err(), "traffic through a black-holed SSH path: {r:?}");
    std::thread::sleep(HOLE.saturating_sub(opened.elapsed()));
    hole.heal();
    let healed = Instant::now();
    let (took, page) = fx.wait_http(web(), healed, HEAL_RECOVERY);
    eprintln!(
        "{path}: traffic again {:.2} s after a {} s SSH black hole healed (bound {} s)",
        took.as_secs_f64(),
        HOLE.as_secs(),
        HEAL_RECOVERY.as_secs()
    );
    assert!(!page.pod.is_empty());
    fx.wait_state("connected", Duration::from_secs(15));
    let after = b.connection_pids();
    assert!(
        after.iter().any(|p| !before.contains(p)),
        "the agent must have redialled SSH after the black hole: before {before:?}, after {after:?}\n{}",
        fx.diagnostics()
    );
    assert_eq!(
        fx.session()["data_path"].as_str().unwrap_or_default(),
        path,
        "the data path does not change on reconnect"
    );
}

#[test]
fn sshd_on_a_node_reaches_the_manager_clusterip_so_the_data_channel_bypasses_the_api_server() {
    let mut fx = KubeFixture::new();
    let lab = SshLab::on_node(&mut fx);
    assert!(
        !lab.laptop_reaches_api_directly(&fx),
        "the laptop must not reach the API server except through SSH"
    );
    let out = ok(
        kvpn_ssh(&fx, &lab, "connect"),
        "connect through the node's sshd",
        &fx,
        &lab,
    );
    assert!(out.contains("through ssh-direct"), "{out}");

    let cluster_ip = manager_cluster_ip(&fx);
    let target = SocketAddr::new(cluster_ip, 10801);
    let session = fx.session();
    let b = &lab.bastions[0];
    assert_eq!(
        session["data_path"].as_str().unwrap_or_default(),
        format!("ssh-direct via root@{} to {target}", b.ssh_addr()),
        "{session:#}"
    );
    assert_eq!(session["transport"], "port-forward", "{session:#}");
    let table = ok(lab.kvpn(&fx, &["status"], None), "status", &fx, &lab);
    assert!(
        table.contains(&format!("through ssh-direct via root@{}", b.ssh_addr())),
        "{table}"
    );

    let body = curl_web(&fx);
    eprintln!("ssh-direct: curl {} -> {}", web(), body.trim());
    // A second connect finds the session and names its data path.
    let again = ok(
        kvpn_ssh(&fx, &lab, "connect"),
        "second connect through the node's sshd",
        &fx,
        &lab,
    );
    assert!(
        again.contains("Already connected") && again.contains("through ssh-direct via"),
        "{again}"
    );
    // The data channel is sshd's own TCP connection to the manager's ClusterIP.
    let conns = b.connections_to(target);
    assert!(
        conns.iter().any(|l| l.contains("sshd")),
        "sshd holds no connection to the manager's ClusterIP {target}: {conns:?}\n{}",
        b.log()
    );

    assert_ssh_nodelay(&fx, &lab);
    small_round_trips(&fx);

    ssh_loss_and_recovery(&fx, &lab, Some(target));
    curl_web(&fx);
    // The redialled SSH connection is set up the same way.
    assert_ssh_nodelay(&fx, &lab);
    // No data connection ever took a port-forward through the API server.
    let logs = agent_logs(&fx);
    assert!(
        logs.contains("offering the manager's data port (ssh-direct)"),
        "{logs}"
    );
    assert!(!logs.contains("port-forward open"), "{logs}");

    // Uninstall through the jump host: the session first, then the manager.
    let out = ok(
        kvpn_ssh(&fx, &lab, "uninstall"),
        "uninstall through the node's sshd",
        &fx,
        &lab,
    );
    assert!(out.contains("Removed"), "{out}");
    assert!(fx.sessions().is_empty(), "{:#?}", fx.sessions());
    let t0 = Instant::now();
    while !fx.manager_pods().is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "manager pods still there after uninstall: {:?}",
            fx.manager_pods().len()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_bastion_that_cannot_reach_clusterips_falls_back_to_port_forward() {
    let mut fx = KubeFixture::new();
    let lab = SshLab::new(&mut fx, 1);
    let t0 = Instant::now();
    let out = ok(
        kvpn_ssh(&fx, &lab, "connect"),
        "connect through a bastion",
        &fx,
        &lab,
    );
    eprintln!(
        "connect with a failed bypass probe took {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    assert!(out.contains("through port-forward"), "{out}");
    let session = fx.session();
    let b = &lab.bastions[0];
    assert_eq!(
        session["data_path"].as_str().unwrap_or_default(),
        format!("port-forward via ssh root@{}", b.ssh_addr()),
        "{session:#}"
    );
    let table = ok(lab.kvpn(&fx, &["status"], None), "status", &fx, &lab);
    assert!(
        table.contains(&format!(
            "through port-forward via ssh root@{}",
            b.ssh_addr()
        )),
        "{table}"
    );
    let body = curl_web(&fx);
    eprintln!("port-forward via ssh: curl {} -> {}", web(), body.trim());
    // The bastion holds no connection to the manager's ClusterIP.
    let target = SocketAddr::new(manager_cluster_ip(&fx), 10801);
    assert!(b.connections_to(target).is_empty());

    ssh_loss_and_recovery(&fx, &lab, None);
    curl_web(&fx);
    let logs = agent_logs(&fx);
    assert!(logs.contains("port-forward open"), "{logs}");
    // The session keeps probing ssh-direct (the bastion may reach the cluster
    // later) but never carried a data connection over it.
    assert!(!logs.contains("ssh-direct data channel closed"), "{logs}");
    let s = fx.session();
    assert!(
        s["data_path_reason"]
            .as_str()
            .is_some_and(|r| r.contains("probing it again every")),
        "{s:#}"
    );
}
