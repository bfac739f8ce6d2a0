//! An ssh-direct session whose target moves or becomes unreachable, on the
//! Kubernetes lab with the real OpenSSH sshd on the lab node (a cluster node: it
//! reaches ClusterIPs):
//! - the manager's ClusterIP black-holed from the SSH host (an nftables drop in
//!   the node netns, before kube-proxy's DNAT): the re-dial's channel does not
//!   open within the bounded probe, the data channel falls back to port-forward
//!   through the same SSH connection, traffic flows, and status names the path
//!   and why; once the drop is gone, a probe finds ssh-direct working and the
//!   data channel comes back to it on its own;
//! - the Service recreated with a new ClusterIP: the next re-dial re-reads the
//!   Service and goes ssh-direct to the new ClusterIP.
//!
//! Needs the workspace binaries (`KVPN_BIN_DIR`), the Kubernetes binaries and
//! openssh-server/-client.

use std::net::{IpAddr, SocketAddr};
use std::process::Output;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use kube::api::{DeleteParams, PostParams};
use kvpn_lab::Netns;
use kvpn_tests::kube_lab::{KubeFixture, web};
use kvpn_tests::ssh_lab::{PASSWORD, SshLab, ok};
use kvpn_tests::text;

fn kvpn_ssh(fx: &KubeFixture, lab: &SshLab, cmd: &str) -> Output {
    let kubeconfig = fx.user_kubeconfig();
    let kh = lab.known_hosts_all().to_string_lossy().into_owned();
    let addr = lab.bastions[0].ssh_addr();
    let args = [
        cmd,
        "--kubeconfig",
        kubeconfig.as_str(),
        "--ssh-addr",
        &addr,
        "--ssh-username",
        "root",
        "--ssh-password",
        PASSWORD,
        "--ssh-known-hosts",
        &kh,
    ];
    lab.kvpn(fx, &args, None)
}

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

/// curl to the web ClusterIP through the TUN device, retried for `within`.
fn curl_web_within(fx: &KubeFixture, within: Duration) -> Duration {
    let url = format!("http://{}/", web());
    let t0 = Instant::now();
    loop {
        let out = fx.laptop(&["curl", "-sS", "-m", "3", &url]);
        if out.status.success() && text(&out.stdout).contains("pod") {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < within,
            "curl {url} failed for {within:?}: {}\n{}",
            text(&out.stderr),
            fx.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Polls the only session until its `data_path` starts with `prefix`.
fn wait_data_path(fx: &KubeFixture, prefix: &str, within: Duration) -> serde_json::Value {
    let t0 = Instant::now();
    loop {
        let s = fx.session();
        if s["data_path"]
            .as_str()
            .is_some_and(|p| p.starts_with(prefix))
        {
            return s;
        }
        assert!(
            t0.elapsed() < within,
            "data_path not {prefix}… within {within:?}: {s:#}\n{}",
            fx.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// An nftables table in the node netns dropping the SSH host's packets to
/// `target`, before kube-proxy's DNAT; removed on drop.
struct Blackhole {
    netns: String,
    table: String,
}

impl Blackhole {
    fn new(netns: &str, id: &str, target: SocketAddr) -> Self {
        let table = format!("kvpn_bh_{id}");
        let n = Netns::from_name(netns);
        let run = |args: &[&str]| {
            let out = n
                .exec(args)
                .unwrap_or_else(|e| panic!("{args:?} in {netns}: {e:#}"));
            assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        };
        let bh = Self {
            netns: netns.to_owned(),
            table: table.clone(),
        };
        run(&["nft", "add", "table", "ip", &table]);
        run(&[
            "nft",
            "add chain ip",
            &table,
            "out { type filter hook output priority -200 ; policy accept ; }",
        ]);
        let rule = format!(
            "add rule ip {table} out ip daddr {} tcp dport {} drop",
            target.ip(),
            target.port()
        );
        run(&["nft", &rule]);
        bh
    }
}

impl Drop for Blackhole {
    fn drop(&mut self) {
        let _ = Netns::from_name(&self.netns).exec(&["nft", "delete", "table", "ip", &self.table]);
    }
}

#[test]
fn ssh_direct_falls_back_to_port_forward_comes_back_and_follows_a_new_clusterip() {
    let mut fx = KubeFixture::new();
    let lab = SshLab::on_node(&mut fx);
    let out = ok(kvpn_ssh(&fx, &lab, "connect"), "connect", &fx, &lab);
    assert!(out.contains("through ssh-direct"), "{out}");
    let b = &lab.bastions[0];
    let target = SocketAddr::new(manager_cluster_ip(&fx), 10801);
    let s = fx.session();
    assert_eq!(
        s["data_path"].as_str().unwrap_or_default(),
        format!("ssh-direct via root@{} to {target}", b.ssh_addr()),
        "{s:#}"
    );
    assert_eq!(s["data_path_reason"], serde_json::Value::Null, "{s:#}");
    curl_web_within(&fx, Duration::from_secs(5));

    // The SSH host loses the ClusterIP.
    let node_ns = fx.lab().netns_lab().node().netns().name().to_owned();
    let id = fx.lab().netns_lab().id().to_owned();
    let hole = Blackhole::new(&node_ns, &id, target);
    let t0 = Instant::now();
    let s = wait_data_path(&fx, "port-forward via ssh", Duration::from_secs(30));
    let fell_back = t0.elapsed();
    let why = s["data_path_reason"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        why.contains(&format!("ssh-direct to {target} failed")) && why.contains("probing it again"),
        "status says why: {s:#}"
    );
    let flowing = curl_web_within(&fx, Duration::from_secs(20)) + fell_back;
    let table = ok(lab.kvpn(&fx, &["status"], None), "status", &fx, &lab);
    assert!(
        table.contains("through port-forward via ssh")
            && table.contains("data path: ssh-direct to"),
        "{table}"
    );
    eprintln!(
        "black-holed ClusterIP: port-forward after {fell_back:?}, traffic after {flowing:?}; reason: {why}"
    );

    // The path heals: back to ssh-direct without any command.
    drop(hole);
    let t1 = Instant::now();
    let s = wait_data_path(&fx, "ssh-direct via", Duration::from_secs(30));
    let back = t1.elapsed();
    assert_eq!(s["data_path_reason"], serde_json::Value::Null, "{s:#}");
    curl_web_within(&fx, Duration::from_secs(10));
    let t_conn = Instant::now();
    while !b.connections_to(target).iter().any(|l| l.contains("sshd")) {
        assert!(
            t_conn.elapsed() < Duration::from_secs(10),
            "sshd holds no connection to {target} after the recovery: {:?}",
            b.connections_to(target)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("ssh-direct back {back:?} after the drop was removed");

    // The Service is recreated with a new ClusterIP; the next re-dial follows it.
    let api: kube::Api<Service> = kube::Api::namespaced(fx.admin(), "kvpn-system");
    let mut svc = fx
        .block_on(api.get("kvpn-manager"))
        .unwrap_or_else(|e| panic!("get Service: {e}"));
    fx.block_on(api.delete("kvpn-manager", &DeleteParams::default()))
        .unwrap_or_else(|e| panic!("delete Service: {e}"));
    svc.metadata.resource_version = None;
    svc.metadata.uid = None;
    svc.metadata.creation_timestamp = None;
    svc.metadata.managed_fields = None;
    if let Some(spec) = svc.spec.as_mut() {
        spec.cluster_ip = None;
        spec.cluster_ips = None;
    }
    let t_create = Instant::now();
    loop {
        match fx.block_on(api.create(&PostParams::default(), &svc)) {
            Ok(_) => break,
            Err(e) => assert!(
                t_create.elapsed() < Duration::from_secs(10),
                "recreate Service: {e}"
            ),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let new_target = SocketAddr::new(manager_cluster_ip(&fx), 10801);
    assert_ne!(new_target, target, "a new ClusterIP");
    // Cut the root daemon's data connection to the agent: a re-dial.
    let data_addr = s["user_daemon"]["data_addr"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let killed = fx.laptop(&[
        "ss",
        "-K",
        "-Htn",
        "state",
        "established",
        "dst",
        &data_addr,
    ]);
    assert!(killed.status.success(), "{}", text(&killed.stderr));
    let want = format!("ssh-direct via root@{} to {new_target}", b.ssh_addr());
    let t2 = Instant::now();
    loop {
        let s = fx.session();
        if s["data_path"] == want.as_str() && s["state"] == "connected" {
            break;
        }
        assert!(
            t2.elapsed() < Duration::from_secs(30),
            "not on the new ClusterIP: {s:#}\n{}",
            fx.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    curl_web_within(&fx, Duration::from_secs(10));
    eprintln!(
        "re-dial to the recreated Service's ClusterIP {new_target} after {:?}",
        t2.elapsed()
    );
    ok(
        lab.kvpn(&fx, &["disconnect"], None),
        "disconnect",
        &fx,
        &lab,
    );
    assert!(fx.sessions().is_empty(), "{:#?}", fx.sessions());
}

/// A session whose SSH host did not reach the manager's ClusterIP at connect
/// starts on port-forward through the SSH path, says it will try ssh-direct
/// again, and moves to ssh-direct on its own once the path works (issue #30:
/// before, such a session stayed on port-forward for good).
#[test]
fn a_session_that_connected_on_port_forward_moves_to_ssh_direct_once_the_clusterip_is_reachable() {
    let mut fx = KubeFixture::new();
    let lab = SshLab::on_node(&mut fx);
    // The first connect installs the manager (its Service gets a ClusterIP).
    let out = ok(kvpn_ssh(&fx, &lab, "connect"), "connect", &fx, &lab);
    assert!(out.contains("through ssh-direct"), "{out}");
    let target = SocketAddr::new(manager_cluster_ip(&fx), 10801);
    ok(
        lab.kvpn(&fx, &["disconnect"], None),
        "disconnect",
        &fx,
        &lab,
    );

    // The SSH host cannot reach the ClusterIP while the next connect probes it.
    let node_ns = fx.lab().netns_lab().node().netns().name().to_owned();
    let id = fx.lab().netns_lab().id().to_owned();
    let hole = Blackhole::new(&node_ns, &id, target);
    let out = ok(kvpn_ssh(&fx, &lab, "connect"), "connect", &fx, &lab);
    assert!(
        out.contains("through port-forward") && out.contains("tries ssh-direct again every 5 s"),
        "{out}"
    );
    let s = fx.session();
    let why = s["data_path_reason"].as_str().unwrap_or_default();
    assert!(
        s["data_path"]
            .as_str()
            .is_some_and(|p| p.starts_with("port-forward via ssh"))
            && why.contains(&format!("ssh-direct to {target} failed"))
            && why.contains("probing it again every 5 s"),
        "{s:#}"
    );
    curl_web_within(&fx, Duration::from_secs(10));

    // The path heals: the session moves to ssh-direct without any command.
    drop(hole);
    let t1 = Instant::now();
    let s = wait_data_path(&fx, "ssh-direct via", Duration::from_secs(30));
    let moved = t1.elapsed();
    assert_eq!(s["data_path_reason"], serde_json::Value::Null, "{s:#}");
    curl_web_within(&fx, Duration::from_secs(10));
    let b = &lab.bastions[0];
    let t_conn = Instant::now();
    while !b.connections_to(target).iter().any(|l| l.contains("sshd")) {
        assert!(
            t_conn.elapsed() < Duration::from_secs(10),
            "sshd holds no connection to {target} after the move: {:?}",
            b.connections_to(target)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("port-forward session on ssh-direct {moved:?} after the drop was removed");
}

/// A SOCKS session through an SSH host on a cluster node takes ssh-direct like a
/// TUN session (trial T8: it stayed on port-forward with no reason given), and
/// its traffic flows through the SOCKS proxy.
#[test]
fn a_socks_session_through_a_node_sshd_takes_ssh_direct() {
    let mut fx = KubeFixture::new();
    let lab = SshLab::on_node(&mut fx);
    let kubeconfig = fx.user_kubeconfig();
    let kh = lab.known_hosts_all().to_string_lossy().into_owned();
    let addr = lab.bastions[0].ssh_addr();
    let listen = "127.0.0.1:1085";
    let out = ok(
        lab.kvpn(
            &fx,
            &[
                "connect",
                "--kubeconfig",
                kubeconfig.as_str(),
                "--ssh-addr",
                &addr,
                "--ssh-username",
                "root",
                "--ssh-password",
                PASSWORD,
                "--ssh-known-hosts",
                &kh,
                "--socks",
                "--socks-listen",
                listen,
            ],
            None,
        ),
        "connect --socks through the node's sshd",
        &fx,
        &lab,
    );
    let target = SocketAddr::new(manager_cluster_ip(&fx), 10801);
    assert!(out.contains(&format!("ssh-direct to {target}")), "{out}");
    let s = fx.session();
    assert_eq!(s["transport"], "socks", "{s:#}");
    assert_eq!(
        s["data_path"].as_str().unwrap_or_default(),
        format!("ssh-direct via root@{addr} to {target}"),
        "{s:#}"
    );
    let page = fx.laptop(&[
        "curl",
        "-sS",
        "--max-time",
        "10",
        "--socks5",
        listen,
        &format!("http://{}/", web()),
    ]);
    assert!(
        page.status.success() && text(&page.stdout).contains("pod"),
        "{}",
        text(&page.stderr)
    );
    let b = &lab.bastions[0];
    assert!(
        b.connections_to(target).iter().any(|l| l.contains("sshd")),
        "sshd holds no connection to {target}: {:?}",
        b.connections_to(target)
    );
}
