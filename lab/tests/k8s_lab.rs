//! The Kubernetes-backed lab end to end ([`kvpn_lab::k8s::K8sLab`]): control plane,
//! API relay, kubelet, kube-proxy and DNS stand-ins, sample workloads — brought up,
//! driven from the laptop and from pods, and torn down without residue.
//!
//! Needs root, the Kubernetes binaries of `scripts/build-kubernetes.sh`, etcd, kubectl
//! and the workspace binaries (`cargo build -p kvpn-lab -p kvpn-manager`).

use std::io::{Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream, UdpSocket};
use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::{Api, ListParams};
use kvpn_lab::Netns;
use kvpn_lab::k8s::cluster::{self, K8sLabState};
use kvpn_lab::k8s::{K8sLab, K8sLabOptions};

fn run(cmd: &mut std::process::Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

fn text(o: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn kubectl(netns: &Netns, kubeconfig: &Path, args: &[&str]) -> Output {
    let mut cmd = netns.command(kvpn_lab::k8s::kubectl_path());
    cmd.arg("--kubeconfig").arg(kubeconfig).args(args);
    cmd.arg("--request-timeout=20s");
    run(&mut cmd)
}

/// One HTTP GET on a fresh connection from inside `netns`; the response text.
fn http_get(netns: &Netns, addr: SocketAddrV4) -> Result<String, String> {
    netns
        .run(move || -> Result<String, String> {
            let mut s = TcpStream::connect_timeout(&SocketAddr::V4(addr), Duration::from_secs(3))
                .map_err(|e| format!("connect {addr}: {e}"))?;
            s.set_read_timeout(Some(Duration::from_secs(5)))
                .map_err(|e| e.to_string())?;
            s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .map_err(|e| e.to_string())?;
            let mut out = String::new();
            s.read_to_string(&mut out).map_err(|e| e.to_string())?;
            Ok(out)
        })
        .expect("enter netns")
}

fn pods_in(client: &kube::Client, ns: &str, label: &str) -> Vec<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let rt = tokio::runtime::Handle::current();
    tokio::task::block_in_place(|| rt.block_on(api.list(&ListParams::default().labels(label))))
        .expect("list pods")
        .items
}

fn pod_ip(p: &Pod) -> Ipv4Addr {
    p.status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .and_then(|ip| ip.parse().ok())
        .unwrap_or_else(|| panic!("pod {:?} has no IPv4 podIP", p.metadata.name))
}

/// The netns of a running pod: the netns on this lab whose only pod process serves
/// `ip` — found through the kubelet's naming, `kvpn-<id>-<name>-<uid[..5]>`.
fn pod_netns(lab: &K8sLab, p: &Pod) -> Netns {
    let name = p.metadata.name.as_deref().expect("name");
    let uid = p.metadata.uid.as_deref().expect("uid");
    let role = kvpn_lab::k8s::kubelet::spec::netns_role(name, uid);
    let netns = lab.netns_lab().netns(&role).unwrap_or_else(|e| {
        panic!(
            "pod {name}: {e}; lab netns: {:?}",
            kvpn_lab::lab_netns(lab.netns_lab().id())
        )
    });
    assert!(netns.exists(), "{}", netns.name());
    netns
}

/// `getent` inside the pod's network and mount namespaces (so its resolv.conf, with
/// the cluster DNS and the search list, is the one used).
fn getent_in_pod(netns: &Netns, args: &[&str]) -> Output {
    let pid = *netns
        .pids()
        .first()
        .unwrap_or_else(|| panic!("no process in {}", netns.name()));
    let mut cmd = std::process::Command::new("nsenter");
    cmd.args(["-t", &pid.to_string(), "-n", "-m", "getent"])
        .args(args);
    run(&mut cmd)
}

fn first_ip(o: &Output) -> Option<Ipv4Addr> {
    String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .next()
        .and_then(|s| s.parse().ok())
}

fn listening_on(ip: Ipv4Addr, netns: &Netns) -> Vec<u16> {
    let o = run(netns.command("ss").args(["-Hltn", "src", &ip.to_string()]));
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| {
            l.split_whitespace()
                .nth(3)?
                .rsplit(':')
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

fn assert_no_residue(id: &str, dir: &Path, apiserver: SocketAddr) {
    let left = kvpn_lab::lab_netns(id).expect("list netns");
    assert!(left.is_empty(), "netns left behind: {left:?}");
    assert!(!dir.exists(), "lab folder {} left behind", dir.display());
    // Nothing listens on the control plane's loopback address any more.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let busy = TcpStream::connect_timeout(&apiserver, Duration::from_millis(300)).is_ok();
        if !busy {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "apiserver {apiserver} still answers"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // No process of the lab: nothing mentions its folder or id on its command line.
    let needle = dir.to_string_lossy().into_owned();
    let netns_needle = format!("kvpn-{id}-");
    for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == std::process::id() {
            continue;
        }
        if let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            assert!(
                !cmd.contains(&needle) && !cmd.contains(&netns_needle),
                "process {pid} of the lab still runs: {cmd}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_lab_end_to_end() {
    let t0 = Instant::now();
    let lab = K8sLab::up(K8sLabOptions::default())
        .await
        .unwrap_or_else(|e| panic!("Kubernetes lab up failed: {e}"));
    let up_time = t0.elapsed();
    eprintln!("Kubernetes lab up in {:.1} s", up_time.as_secs_f64());
    let client = lab.admin_client().await.expect("admin client");
    let netns_lab = lab.netns_lab();
    let laptop = netns_lab.laptop_netns().clone();

    // Sample Deployments: pods Running with pod-CIDR IPs, one netns each.
    let web = pods_in(&client, "default", "app=web");
    let dev_web = pods_in(&client, "dev", "app=web");
    let manager = pods_in(
        &client,
        "kvpn-system",
        "app.kubernetes.io/name=kvpn-manager",
    );
    assert_eq!(web.len(), 2, "default/web pods");
    assert_eq!(dev_web.len(), 1, "dev/web pods");
    assert_eq!(manager.len(), 1, "manager pods");
    for p in web.iter().chain(&dev_web).chain(&manager) {
        let phase = p.status.as_ref().and_then(|s| s.phase.clone());
        assert_eq!(phase.as_deref(), Some("Running"), "{:?}", p.metadata.name);
        assert!(
            kvpn_lab::NODE_POD_CIDR.contains(&pod_ip(p)),
            "{:?} {}",
            p.metadata.name,
            pod_ip(p)
        );
    }

    // kubectl from the laptop netns, through 172.31.255.1:6443.
    let o = kubectl(
        &laptop,
        lab.laptop_admin_kubeconfig(),
        &["get", "pods", "-A", "-o", "wide"],
    );
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    for p in web.iter().chain(&dev_web).chain(&manager) {
        let name = p.metadata.name.as_deref().expect("name");
        assert!(out.contains(name), "{name} missing:\n{out}");
    }
    assert!(out.contains("Running"), "{out}");
    let kubeconfig_text =
        std::fs::read_to_string(lab.laptop_admin_kubeconfig()).expect("laptop kubeconfig");
    assert!(
        kubeconfig_text.contains("https://172.31.255.1:6443"),
        "{kubeconfig_text}"
    );

    // The laptop still reaches neither pods nor ClusterIPs directly.
    let direct = http_get(&laptop, SocketAddrV4::new(pod_ip(&web[0]), 8080));
    assert!(direct.is_err(), "laptop reached a pod directly: {direct:?}");
    let direct = http_get(&laptop, SocketAddrV4::new(kvpn_lab::WEB_CLUSTER_IP, 80));
    assert!(
        direct.is_err(),
        "laptop reached a ClusterIP directly: {direct:?}"
    );
    // ...but the manager through its NodePort.
    let manager_addr = SocketAddr::V4(kvpn_lab::MANAGER_ADDR_FROM_LAPTOP);
    let reach = laptop
        .run(move || TcpStream::connect_timeout(&manager_addr, Duration::from_secs(3)).map(drop))
        .expect("netns");
    assert!(reach.is_ok(), "manager NodePort from the laptop: {reach:?}");

    // A ClusterIP from a pod netns (dev/web → default/web), balanced over both pods.
    let client_netns = pod_netns(&lab, &dev_web[0]);
    let web_names: Vec<String> = web
        .iter()
        .map(|p| p.metadata.name.clone().expect("name"))
        .collect();
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..40 {
        let page = http_get(
            &client_netns,
            SocketAddrV4::new(kvpn_lab::WEB_CLUSTER_IP, 80),
        )
        .expect("ClusterIP web from a pod");
        assert!(page.starts_with("HTTP/1.1 200"), "{page}");
        let from: Vec<&String> = web_names.iter().filter(|n| page.contains(*n)).collect();
        assert_eq!(from.len(), 1, "page names one web pod: {page}");
        seen.insert(from[0].clone());
        if seen.len() == 2 {
            break;
        }
    }
    assert_eq!(seen.len(), 2, "ClusterIP balanced over both pods: {seen:?}");
    // UDP ClusterIP.
    let echoed = client_netns
        .run(|| -> std::io::Result<Vec<u8>> {
            let s = UdpSocket::bind("0.0.0.0:0")?;
            s.set_read_timeout(Some(Duration::from_secs(3)))?;
            s.send_to(b"k8s-lab-udp", (kvpn_lab::UDP_ECHO_CLUSTER_IP, 7))?;
            let mut buf = [0u8; 64];
            let n = s.recv(&mut buf)?;
            Ok(buf[..n].to_vec())
        })
        .expect("netns")
        .expect("UDP echo through the ClusterIP");
    assert_eq!(echoed, b"k8s-lab-udp");
    // The apiserver from a pod through the `kubernetes` Service (10.96.0.1:443).
    let o = run(client_netns
        .command("curl")
        .args(["-sS", "--max-time", "10", "--cacert"])
        .arg(lab.state().control_plane_dir.join("pki/ca.crt"))
        .args([
            "--resolve",
            "kubernetes.default.svc:443:10.96.0.1",
            "https://kubernetes.default.svc/version",
        ]));
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("v1.20.2"),
        "{}",
        text(&o)
    );

    // DNS inside a pod (its own resolv.conf: cluster DNS, search list, ndots:5).
    let services: Api<Service> = Api::namespaced(client.clone(), "dev");
    let dev_web_ip: Ipv4Addr = services
        .get("web")
        .await
        .expect("dev/web")
        .spec
        .and_then(|s| s.cluster_ip)
        .and_then(|ip| ip.parse().ok())
        .expect("dev/web ClusterIP");
    let short = getent_in_pod(&client_netns, &["hosts", "web"]);
    assert_eq!(
        first_ip(&short),
        Some(dev_web_ip),
        "short name in dev: {}",
        text(&short)
    );
    let svc_ns = getent_in_pod(&client_netns, &["hosts", "web.default"]);
    assert_eq!(
        first_ip(&svc_ns),
        Some(kvpn_lab::WEB_CLUSTER_IP),
        "svc.ns: {}",
        text(&svc_ns)
    );
    let fqdn = getent_in_pod(&client_netns, &["hosts", "echo.default.svc.cluster.local"]);
    assert_eq!(
        first_ip(&fqdn),
        Some(kvpn_lab::ECHO_CLUSTER_IP),
        "FQDN: {}",
        text(&fqdn)
    );
    let headless = getent_in_pod(&client_netns, &["ahostsv4", "web-headless.default"]);
    let headless_ips: std::collections::BTreeSet<Ipv4Addr> =
        String::from_utf8_lossy(&headless.stdout)
            .lines()
            .filter_map(|l| l.split_whitespace().next()?.parse().ok())
            .collect();
    let web_ips: std::collections::BTreeSet<Ipv4Addr> = web.iter().map(pod_ip).collect();
    assert_eq!(headless_ips, web_ips, "headless: {}", text(&headless));
    let nx = getent_in_pod(&client_netns, &["hosts", "no-such-service.default"]);
    assert_eq!(nx.status.code(), Some(2), "NXDOMAIN: {}", text(&nx));
    let o = run(client_netns.command("dig").args([
        "+time=3",
        "+tries=1",
        "@10.96.0.10",
        "no-such-service.default.svc.cluster.local",
    ]));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("status: NXDOMAIN"),
        "{}",
        text(&o)
    );

    // The restricted kubeconfig: allowed inside its Role, refused outside it.
    let user = lab.laptop_user_kubeconfig();
    let ok = kubectl(&laptop, user, &["get", "deployments", "-n", "kvpn-system"]);
    assert!(ok.status.success(), "{}", text(&ok));
    let refused = kubectl(&laptop, user, &["get", "secrets", "-n", "default"]);
    assert!(!refused.status.success(), "{}", text(&refused));
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("forbidden"),
        "{}",
        text(&refused)
    );
    let refused = kubectl(
        &laptop,
        user,
        &["delete", "pod", "-n", "default", web_names[0].as_str()],
    );
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("forbidden"),
        "{}",
        text(&refused)
    );

    // Down: nothing left.
    let id = netns_lab.id().to_owned();
    let dir = netns_lab.dir().to_owned();
    let apiserver = lab.state().apiserver;
    drop(client);
    let t1 = Instant::now();
    tokio::task::spawn_blocking(move || lab.down())
        .await
        .expect("join")
        .expect("down");
    eprintln!("Kubernetes lab down in {:.1} s", t1.elapsed().as_secs_f64());
    assert_no_residue(&id, &dir, apiserver);
}

/// The persistent lab as `kvpn lab up/down` uses it: up (agent in the background) →
/// kubectl from the laptop → down → up → down, no residue, in a private state folder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persistent_lab_up_down_up() {
    let state_dir = std::env::temp_dir().join(format!(
        "kvpn-lab-state-{}-{}",
        std::process::id(),
        Instant::now().elapsed().subsec_nanos()
    ));
    // SAFETY of the env change: this test binary's other test does not read
    // KVPN_LAB_STATE_DIR (non-persistent labs only write owner records, which
    // `reap_orphaned_labs` alone reads).
    // Edition 2024 makes set_var unsafe.
    #[allow(
        unsafe_code,
        reason = "set before any lab thread of this test reads it"
    )]
    unsafe {
        std::env::set_var("KVPN_LAB_STATE_DIR", &state_dir);
    }
    let name = "k8s-lab-persist";
    for round in 0..2 {
        let t0 = Instant::now();
        let lab = K8sLab::up(K8sLabOptions::default().persist_as(name))
            .await
            .unwrap_or_else(|e| panic!("round {round}: up failed: {e}"));
        eprintln!(
            "round {round}: persistent Kubernetes lab up in {:.1} s",
            t0.elapsed().as_secs_f64()
        );
        let info = lab.info();
        assert!(info.contains("kvpn-lab-agent (pid"), "{info}");
        let state: K8sLabState = lab.state().clone();
        let (agent_pid, _) = state.agent.expect("agent recorded");
        let id = lab.netns_lab().id().to_owned();
        let dir = lab.netns_lab().dir().to_owned();
        lab.detach().expect("detach");
        // After this handle is gone: still up, driven from the laptop netns.
        assert!(
            Path::new(&format!("/proc/{agent_pid}")).exists(),
            "agent gone after detach"
        );
        let attached = kvpn_lab::Lab::attach(name).expect("attach");
        let o = kubectl(
            attached.laptop_netns(),
            &state.laptop_admin_kubeconfig,
            &["get", "pods", "-A"],
        );
        assert!(o.status.success(), "{}", text(&o));
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            out.contains("kvpn-manager") && out.contains("web-"),
            "{out}"
        );
        assert!(
            listening_on(kvpn_lab::NODE_UPLINK_IP, attached.node_netns()).contains(&6443),
            "relay listens"
        );
        drop(attached);
        let down = tokio::task::spawn_blocking(move || cluster::down_named(name))
            .await
            .expect("join")
            .expect("down");
        assert!(down, "lab was recorded");
        assert!(
            !Path::new(&format!("/proc/{agent_pid}")).exists()
                || std::fs::read_to_string(format!("/proc/{agent_pid}/stat"))
                    .is_ok_and(|s| s.contains(") Z ")),
            "agent still runs after down"
        );
        assert_no_residue(&id, &dir, state.apiserver);
        assert!(
            !kvpn_lab::state_path(name).exists(),
            "state file left behind"
        );
    }
    let _ = std::fs::remove_dir_all(&state_dir);
}

/// The IPv4 addresses (`a.b.c.d/len`) on `dev` in `netns`, or None if there is no such
/// device.
fn addresses_on(netns: &Netns, dev: &str) -> Option<Vec<String>> {
    let o = run(netns
        .command("ip")
        .args(["-4", "-o", "addr", "show", "dev", dev]));
    o.status.success().then(|| {
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter_map(|l| {
                let mut w = l.split_whitespace().skip_while(|w| *w != "inet");
                w.nth(1).map(str::to_owned)
            })
            .collect()
    })
}

/// `env` of the first process in `netns`.
fn environ_of_pod(netns: &Netns) -> String {
    let pid = *netns
        .pids()
        .first()
        .unwrap_or_else(|| panic!("no process in {}", netns.name()));
    std::fs::read(format!("/proc/{pid}/environ"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', "\n"))
        .unwrap_or_default()
}

/// Two clusters on one laptop ([kube-connect] item 7) and two laptops on one cluster
/// (item 8), as the lab provides them: a second Kubernetes lab with
/// `Addressing::second()` whose uplink lives in the first lab's laptop netns, and a
/// second laptop netns on the first lab. Each reaches its API server with its own
/// kubeconfig, neither reaches a pod or ClusterIP directly, the second cluster's
/// objects use its own CIDRs, and taking it down removes only its own link from the
/// shared laptop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_cluster_on_the_same_laptop_and_a_second_laptop() {
    use kvpn_lab::Addressing;
    use kvpn_lab::k8s::workloads::Workloads;
    let no_manager = Workloads {
        manager: false,
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut a = K8sLab::up(K8sLabOptions::default().workloads(no_manager))
        .await
        .unwrap_or_else(|e| panic!("lab A up: {e}"));
    let second = Addressing::second();
    let b = K8sLab::up(
        K8sLabOptions::default()
            .workloads(no_manager)
            .addressing(second)
            .laptop_of(&a),
    )
    .await
    .unwrap_or_else(|e| panic!("lab B up on A's laptop: {e}"));
    eprintln!(
        "two Kubernetes labs up in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    let laptop = a.netns_lab().laptop_netns().clone();
    assert_eq!(b.netns_lab().laptop_netns(), &laptop, "B uses A's laptop");
    assert_eq!(*a.addressing(), Addressing::default());
    assert_eq!(*b.addressing(), second);

    // Both uplinks in the one laptop netns, each its own /30 and name.
    let (ua, ub) = (
        a.netns_lab().uplink().clone(),
        b.netns_lab().uplink().clone(),
    );
    assert_ne!(ua.laptop_if, ub.laptop_if);
    assert_eq!(
        addresses_on(&laptop, &ua.laptop_if),
        Some(vec!["172.31.255.2/30".to_owned()])
    );
    assert_eq!(
        addresses_on(&laptop, &ub.laptop_if),
        Some(vec!["172.31.254.2/30".to_owned()])
    );
    let b_kubeconfig = std::fs::read_to_string(b.laptop_user_kubeconfig()).expect("B kubeconfig");
    assert!(
        b_kubeconfig.contains("https://172.31.254.1:6443"),
        "{b_kubeconfig}"
    );

    // kubectl from the shared laptop reaches each cluster with its own kubeconfig.
    let b_client = b.admin_client().await.expect("B admin client");
    let b_web = pods_in(&b_client, "default", "app=web");
    assert_eq!(b_web.len(), 2, "B's default/web pods");
    for p in &b_web {
        assert!(
            second.node_pod_cidr.contains(&pod_ip(p)),
            "B pod IP {} in {}",
            pod_ip(p),
            second.node_pod_cidr
        );
    }
    let o = kubectl(
        &laptop,
        b.laptop_admin_kubeconfig(),
        &["get", "pods", "-n", "default", "-o", "wide"],
    );
    assert!(o.status.success(), "{}", text(&o));
    for p in &b_web {
        let name = p.metadata.name.as_deref().expect("name");
        assert!(
            String::from_utf8_lossy(&o.stdout).contains(name),
            "{}",
            text(&o)
        );
    }
    let o = kubectl(
        &laptop,
        b.laptop_user_kubeconfig(),
        &["get", "deployments", "-n", "kvpn-system"],
    );
    assert!(o.status.success(), "B restricted: {}", text(&o));
    let o = kubectl(&laptop, a.laptop_admin_kubeconfig(), &["get", "nodes"]);
    assert!(o.status.success(), "A from the shared laptop: {}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains(&format!("kvpn-{}-node", a.netns_lab().id())),
        "{}",
        text(&o)
    );

    // B's Services come from its own service CIDR.
    let services: Api<Service> = Api::namespaced(b_client.clone(), "default");
    let ip_of = |s: Service| s.spec.and_then(|s| s.cluster_ip).unwrap_or_default();
    assert_eq!(
        ip_of(services.get("web").await.expect("web")),
        "10.112.0.100"
    );
    assert_eq!(
        ip_of(services.get("kubernetes").await.expect("kubernetes")),
        "10.112.0.1"
    );
    let dns: Api<Service> = Api::namespaced(b_client.clone(), "kube-system");
    assert_eq!(
        ip_of(dns.get("kube-dns").await.expect("kube-dns")),
        "10.112.0.10"
    );
    let dev_web: Api<Service> = Api::namespaced(b_client.clone(), "dev");
    let dev_ip: Ipv4Addr = ip_of(dev_web.get("web").await.expect("dev/web"))
        .parse()
        .expect("dev/web ClusterIP");
    assert!(second.service_cidr.contains(&dev_ip), "allocated {dev_ip}");

    // Inside B: ClusterIP, DNS and the `kubernetes` Service at B's addresses.
    let b_pod = pod_netns(&b, &b_web[0]);
    let page = http_get(&b_pod, SocketAddrV4::new(second.web_cluster_ip(), 80))
        .expect("B's web ClusterIP from a B pod");
    assert!(page.starts_with("HTTP/1.1 200"), "{page}");
    let fqdn = getent_in_pod(&b_pod, &["hosts", "echo.default.svc.cluster.local"]);
    assert_eq!(
        first_ip(&fqdn),
        Some(second.echo_cluster_ip()),
        "{}",
        text(&fqdn)
    );
    let env = environ_of_pod(&b_pod);
    assert!(
        env.contains("KUBERNETES_SERVICE_HOST=10.112.0.1\n"),
        "pod env: {env}"
    );
    let o = run(b_pod
        .command("curl")
        .args(["-sS", "--max-time", "10", "--cacert"])
        .arg(b.state().control_plane_dir.join("pki/ca.crt"))
        .args([
            "--resolve",
            "kubernetes.default.svc:443:10.112.0.1",
            "https://kubernetes.default.svc/version",
        ]));
    assert!(o.status.success(), "B's kubernetes Service: {}", text(&o));

    // The shared laptop still reaches no pod or ClusterIP of either cluster.
    for target in [
        SocketAddrV4::new(pod_ip(&b_web[0]), 8080),
        SocketAddrV4::new(second.web_cluster_ip(), 80),
        SocketAddrV4::new(kvpn_lab::WEB_CLUSTER_IP, 80),
    ] {
        let direct = http_get(&laptop, target);
        assert!(
            direct.is_err(),
            "laptop reached {target} directly: {direct:?}"
        );
    }

    // A second laptop on A: own /30, the API server at A's address, nothing else.
    let laptop2 = a.add_laptop("laptop2").expect("add laptop2");
    assert_eq!(
        laptop2.netns.name(),
        format!("kvpn-{}-laptop2", a.netns_lab().id())
    );
    assert_eq!(
        addresses_on(&laptop2.netns, &laptop2.uplink.laptop_if),
        Some(vec!["172.31.255.6/30".to_owned()])
    );
    assert!(a.add_laptop("laptop2").is_err(), "the same role twice");
    let o = kubectl(
        &laptop2.netns,
        &laptop2.user_kubeconfig,
        &["get", "deployments", "-n", "kvpn-system"],
    );
    assert!(o.status.success(), "laptop2 → A's API server: {}", text(&o));
    let a_client = a.admin_client().await.expect("A admin client");
    let a_web = pods_in(&a_client, "default", "app=web");
    for target in [
        SocketAddrV4::new(pod_ip(&a_web[0]), 8080),
        SocketAddrV4::new(kvpn_lab::WEB_CLUSTER_IP, 80),
    ] {
        let direct = http_get(&laptop2.netns, target);
        assert!(
            direct.is_err(),
            "laptop2 reached {target} directly: {direct:?}"
        );
    }

    // B down: its netns and its link in the shared laptop go, the laptop stays and
    // still reaches A.
    let (b_id, b_dir, b_api) = (
        b.netns_lab().id().to_owned(),
        b.netns_lab().dir().to_owned(),
        b.state().apiserver,
    );
    drop(b_client);
    tokio::task::spawn_blocking(move || b.down())
        .await
        .expect("join")
        .expect("B down");
    assert_no_residue(&b_id, &b_dir, b_api);
    assert!(laptop.exists(), "A's laptop survives B's down");
    assert_eq!(
        addresses_on(&laptop, &ub.laptop_if),
        None,
        "B's uplink gone"
    );
    assert_eq!(
        addresses_on(&laptop, &ua.laptop_if),
        Some(vec!["172.31.255.2/30".to_owned()]),
        "A's uplink stays"
    );
    let o = kubectl(&laptop, a.laptop_admin_kubeconfig(), &["get", "nodes"]);
    assert!(o.status.success(), "A after B's down: {}", text(&o));

    // A down: laptop2 goes with it.
    let (a_id, a_dir, a_api) = (
        a.netns_lab().id().to_owned(),
        a.netns_lab().dir().to_owned(),
        a.state().apiserver,
    );
    drop(a_client);
    tokio::task::spawn_blocking(move || a.down())
        .await
        .expect("join")
        .expect("A down");
    assert_no_residue(&a_id, &a_dir, a_api);
    assert!(!laptop2.netns.exists(), "laptop2 netns left behind");
}
