//! The kube-proxy stand-in and the cluster DNS against a real apiserver (root; each
//! test has its own lab and control plane, so they run in parallel): Services and
//! Endpoints are created through the API (selector-less Services with hand-written
//! Endpoints pointing at the lab's backend pods 10.244.1.11/12, so no kubelet is
//! needed), and traffic comes from the idle `manager` pod netns with curl, raw sockets,
//! dig and getent.
//!
//! Needs the binaries of `scripts/build-kubernetes.sh`, Debian's etcd-server, curl,
//! dig (dnsutils) and nft.

use std::collections::BTreeSet;
use std::io::ErrorKind;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Endpoints, Namespace, Service};
use kube::api::{Api, DeleteParams, PostParams};
use kvpn_lab::k8s::dns::{self, CLUSTER_DNS_IP, ClusterDns, ClusterDnsOptions};
use kvpn_lab::k8s::kube_proxy::{KubeProxy, KubeProxyConfig};
use kvpn_lab::k8s::{ControlPlane, ControlPlaneConfig};
use kvpn_lab::protocol::PageInfo;
use kvpn_lab::{
    BACKEND_1_IP, BACKEND_1_POD, BACKEND_2_IP, BACKEND_2_POD, ECHO_PORT, HTTP_PORT, LAPTOP, Lab,
    LabOptions, MANAGER_POD, NODE_UPLINK_IP, nft,
};

/// The pod the tests send from: its netns exists, nothing runs in it.
const CLIENT: &str = MANAGER_POD;
const NS: &str = "demo";

// ClusterIPs of the tests' Services (the static lab's own table uses 10.96.0.100-102).
const WEB_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 100);
const UDP_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 102);
const EMPTY_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 103);
const NODE_PORT_SVC_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 104);
const LATE_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 105);
const NODE_PORT: u16 = 30080;

fn obj<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
    serde_json::from_value(v).expect("valid object")
}

/// A lab (backends, no manager) plus a control plane whose files live in the lab folder.
/// Field order matters: the control plane stops before the lab goes down.
struct Cluster {
    cp: ControlPlane,
    lab: Lab,
}

async fn cluster() -> Cluster {
    let lab = Lab::up(LabOptions::default().without_manager()).expect("lab up");
    let t0 = Instant::now();
    let cp = ControlPlane::start(ControlPlaneConfig::new(
        lab.dir().join("k8s"),
        format!("kvpn-lab-{}", lab.id()),
    ))
    .await
    .expect("control plane starts (binaries from scripts/build-kubernetes.sh)");
    eprintln!("lab {} control plane ready in {:?}", lab.id(), t0.elapsed());
    let admin = cp.admin_client().await.expect("admin client");
    Api::<Namespace>::all(admin)
        .create(
            &PostParams::default(),
            &obj(serde_json::json!({"metadata": {"name": NS}})),
        )
        .await
        .expect("create namespace");
    Cluster { cp, lab }
}

impl Cluster {
    async fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as kube::Resource>::DynamicType: Default,
    {
        Api::namespaced(self.cp.admin_client().await.expect("admin client"), NS)
    }

    /// A selector-less Service; `spec` is merged into `{"ports": ports}`.
    async fn service(&self, name: &str, spec: serde_json::Value) {
        let svc: Service = obj(serde_json::json!({"metadata": {"name": name}, "spec": spec}));
        self.api::<Service>()
            .await
            .create(&PostParams::default(), &svc)
            .await
            .unwrap_or_else(|e| panic!("create service {name}: {e}"));
    }

    async fn endpoints(&self, name: &str, subsets: serde_json::Value) {
        let ep: Endpoints =
            obj(serde_json::json!({"metadata": {"name": name}, "subsets": subsets}));
        let api = self.api::<Endpoints>().await;
        match api.get_opt(name).await.expect("get endpoints") {
            None => api.create(&PostParams::default(), &ep).await.map(drop),
            Some(old) => {
                let mut ep = ep;
                ep.metadata.resource_version = old.metadata.resource_version;
                api.replace(name, &PostParams::default(), &ep)
                    .await
                    .map(drop)
            }
        }
        .unwrap_or_else(|e| panic!("write endpoints {name}: {e}"));
    }

    /// Deletes the Service and its Endpoints (the endpoints controller may have removed
    /// them already: it deletes the Endpoints of a deleted Service, selector or not).
    async fn delete_service(&self, name: &str) {
        self.api::<Service>()
            .await
            .delete(name, &DeleteParams::default())
            .await
            .expect("delete service");
        match self
            .api::<Endpoints>()
            .await
            .delete(name, &DeleteParams::default())
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => panic!("delete endpoints {name}: {e}"),
        }
    }

    fn proxy(&self) -> KubeProxy {
        let t0 = Instant::now();
        let proxy = KubeProxy::start(
            KubeProxyConfig::new(self.cp.admin_kubeconfig(), self.lab.node_netns().clone())
                .node_ip(NODE_UPLINK_IP),
        )
        .expect("kube-proxy stand-in starts");
        eprintln!("kube-proxy stand-in synced in {:?}", t0.elapsed());
        proxy
    }
}

fn backends(port_name: &str, port: u16, protocol: &str) -> serde_json::Value {
    serde_json::json!([{
        "addresses": [{"ip": BACKEND_1_IP.to_string()}, {"ip": BACKEND_2_IP.to_string()}],
        "ports": [{"name": port_name, "port": port, "protocol": protocol}]
    }])
}

/// One HTTP GET from the client pod; the lab page names the pod that answered.
fn get_page(lab: &Lab, role: &str, url: &str) -> Result<PageInfo, String> {
    let out = lab
        .exec_in(
            role,
            &[
                "curl",
                "-sS",
                "--connect-timeout",
                "2",
                "--max-time",
                "5",
                url,
            ],
        )
        .expect("run curl");
    let body = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        return Err(format!(
            "curl {url} from {role}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    PageInfo::parse(&body).ok_or_else(|| format!("not a lab page from {url}: {body:?}"))
}

/// TCP connect from the client pod: Ok, or the error kind.
fn connect(lab: &Lab, addr: SocketAddr) -> Result<(), ErrorKind> {
    lab.run_in(CLIENT, move || {
        TcpStream::connect_timeout(&addr, Duration::from_millis(500))
            .map(drop)
            .map_err(|e| e.kind())
    })
    .expect("enter client netns")
}

/// Polls `check` every 20 ms until it holds; returns how long that took.
fn within(what: &str, bound: Duration, mut check: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    loop {
        if check() {
            return t0.elapsed();
        }
        assert!(t0.elapsed() < bound, "{what}: not within {bound:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("blocking task")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_proxy_keeps_cluster_ips_and_node_ports_in_sync() {
    let c = cluster().await;
    // web: a named target port, resolved through the Endpoints' port of that name.
    c.service(
        "web",
        serde_json::json!({"clusterIP": WEB_IP.to_string(),
            "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}),
    )
    .await;
    c.endpoints("web", backends("http", HTTP_PORT, "TCP")).await;
    c.service(
        "udp-echo",
        serde_json::json!({"clusterIP": UDP_IP.to_string(),
            "ports": [{"name": "echo", "port": 7, "protocol": "UDP", "targetPort": ECHO_PORT}]}),
    )
    .await;
    c.endpoints("udp-echo", backends("echo", ECHO_PORT, "UDP"))
        .await;
    // No Endpoints at all: rejected.
    c.service(
        "empty",
        serde_json::json!({"clusterIP": EMPTY_IP.to_string(), "ports": [
            {"name": "http", "port": 80},
            {"name": "dns", "port": 53, "protocol": "UDP"}]}),
    )
    .await;
    c.service(
        "web-np",
        serde_json::json!({"type": "NodePort", "clusterIP": NODE_PORT_SVC_IP.to_string(),
            "ports": [{"name": "http", "port": 80, "targetPort": HTTP_PORT, "nodePort": NODE_PORT}]}),
    )
    .await;
    c.endpoints("web-np", backends("http", HTTP_PORT, "TCP"))
        .await;

    let proxy = c.proxy();
    let lab = &c.lab;
    let status = proxy.status();
    assert!(
        status
            .rules
            .iter()
            .any(|r| r.ip == WEB_IP && r.backends.len() == 2),
        "{status:?}"
    );

    // ClusterIP from a pod, balanced over both endpoints.
    let mut seen = BTreeSet::new();
    for _ in 0..24 {
        let page = get_page(lab, CLIENT, &format!("http://{WEB_IP}/")).expect("ClusterIP answers");
        seen.insert(page.pod);
    }
    assert_eq!(
        seen,
        BTreeSet::from([BACKEND_1_POD.to_owned(), BACKEND_2_POD.to_owned()]),
        "24 requests to {WEB_IP}:80 reach both endpoints"
    );

    // UDP ClusterIP.
    let echoed = lab
        .run_in(CLIENT, || {
            let s = UdpSocket::bind("0.0.0.0:0").expect("bind");
            s.set_read_timeout(Some(Duration::from_secs(2)))
                .expect("timeout");
            s.connect((UDP_IP, 7)).expect("connect");
            s.send(b"kvpn udp via ClusterIP").expect("send");
            let mut buf = [0u8; 64];
            let n = s.recv(&mut buf).expect("UDP echo through the ClusterIP");
            buf[..n].to_vec()
        })
        .expect("client netns");
    assert_eq!(echoed, b"kvpn udp via ClusterIP");

    // A Service without endpoints is rejected at once: TCP reset, ICMP port unreachable.
    let t0 = Instant::now();
    assert_eq!(
        connect(lab, SocketAddr::from((EMPTY_IP, 80))),
        Err(ErrorKind::ConnectionRefused)
    );
    let udp_err = lab
        .run_in(CLIENT, || {
            let s = UdpSocket::bind("0.0.0.0:0").expect("bind");
            s.set_read_timeout(Some(Duration::from_secs(2)))
                .expect("timeout");
            s.connect((EMPTY_IP, 53)).expect("connect");
            s.send(b"anyone?").expect("send");
            let mut buf = [0u8; 16];
            s.recv(&mut buf).map_err(|e| e.kind())
        })
        .expect("client netns");
    assert_eq!(udp_err, Err(ErrorKind::ConnectionRefused));
    eprintln!("both rejections took {:?}", t0.elapsed());
    assert!(t0.elapsed() < Duration::from_secs(1));

    // NodePort from the laptop, which has no route to the service CIDR.
    let page = get_page(
        lab,
        LAPTOP,
        &format!("http://{NODE_UPLINK_IP}:{NODE_PORT}/"),
    )
    .expect("NodePort answers from the laptop");
    assert!(
        [BACKEND_1_POD, BACKEND_2_POD].contains(&page.pod.as_str()),
        "{page:?}"
    );

    // A Service created now is reachable within about a second.
    let late = SocketAddr::from((LATE_IP, 7));
    assert!(connect(lab, late).is_err(), "no rule for {late} yet");
    c.service(
        "late",
        serde_json::json!({"clusterIP": LATE_IP.to_string(),
            "ports": [{"name": "echo", "port": 7, "targetPort": ECHO_PORT}]}),
    )
    .await;
    c.endpoints(
        "late",
        serde_json::json!([{"addresses": [{"ip": BACKEND_1_IP.to_string()}],
            "ports": [{"name": "echo", "port": ECHO_PORT}]}]),
    )
    .await;
    let took = blocking({
        let lab_connect = {
            let netns = lab.netns(CLIENT).expect("client netns");
            move || {
                netns
                    .run(move || {
                        TcpStream::connect_timeout(&late, Duration::from_millis(200)).is_ok()
                    })
                    .expect("enter netns")
            }
        };
        move || within("new Service reachable", Duration::from_secs(2), lab_connect)
    })
    .await;
    eprintln!("a new Service became reachable {took:?} after its Endpoints were written");

    // Endpoints change: only backend-1 stays.
    c.endpoints(
        "web",
        serde_json::json!([{"addresses": [{"ip": BACKEND_1_IP.to_string()}],
            "ports": [{"name": "http", "port": HTTP_PORT}]}]),
    )
    .await;
    let took = within("web down to one endpoint", Duration::from_secs(2), || {
        proxy
            .status()
            .rules
            .iter()
            .any(|r| r.ip == WEB_IP && r.backends.len() == 1)
    });
    eprintln!("an Endpoints change was loaded {took:?} after it was written");
    for _ in 0..8 {
        let page = get_page(lab, CLIENT, &format!("http://{WEB_IP}/")).expect("web answers");
        assert_eq!(page.pod, BACKEND_1_POD, "only backend-1 is an endpoint now");
    }

    // Deleting the Service removes its rule.
    c.delete_service("late").await;
    let took = blocking({
        let netns = lab.netns(CLIENT).expect("client netns");
        move || {
            within(
                "deleted Service unreachable",
                Duration::from_secs(2),
                || {
                    netns
                        .run(move || {
                            TcpStream::connect_timeout(&late, Duration::from_millis(200)).is_err()
                        })
                        .expect("enter netns")
                },
            )
        }
    })
    .await;
    eprintln!("a deleted Service became unreachable after {took:?}");
    assert!(!proxy.status().rules.iter().any(|r| r.ip == LATE_IP));

    // Stop removes the table, and with it every ClusterIP of the proxy.
    let table = proxy.table().to_owned();
    assert!(nft::table_exists(lab.node_netns(), &table));
    proxy.stop().expect("stop");
    assert!(!nft::table_exists(lab.node_netns(), &table));
    assert!(get_page(lab, CLIENT, &format!("http://{WEB_IP}/")).is_err());
}

// --- DNS ---------------------------------------------------------------------------

/// What dig printed, parsed from its default output.
#[derive(Debug)]
struct Dig {
    status: String,
    flags: Vec<String>,
    answers: Vec<Rr>,
    authority: Vec<Rr>,
    raw: String,
}

/// One resource record line of dig's output.
#[derive(Debug)]
struct Rr {
    ttl: u32,
    rtype: String,
    data: String,
}

impl Dig {
    fn data(&self, rtype: &str) -> BTreeSet<String> {
        self.answers
            .iter()
            .filter(|r| r.rtype == rtype)
            .map(|r| r.data.clone())
            .collect()
    }
}

fn dig(lab: &Lab, role: &str, args: &[&str]) -> Dig {
    let mut all = vec!["dig", "+tries=1", "+time=2"];
    all.extend_from_slice(args);
    let out = lab.exec_in(role, &all).expect("run dig");
    let raw = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut d = Dig {
        status: String::new(),
        flags: Vec::new(),
        answers: Vec::new(),
        authority: Vec::new(),
        raw: raw.clone(),
    };
    let mut section = "";
    for line in raw.lines() {
        if let Some(rest) = line.split("status: ").nth(1) {
            d.status = rest.split(',').next().unwrap_or_default().to_owned();
        } else if let Some(rest) = line.strip_prefix(";; flags: ") {
            d.flags = rest
                .split(';')
                .next()
                .unwrap_or_default()
                .split_whitespace()
                .map(str::to_owned)
                .collect();
        } else if line.starts_with(";; ANSWER SECTION") {
            section = "answer";
        } else if line.starts_with(";; AUTHORITY SECTION") {
            section = "authority";
        } else if line.trim().is_empty() || line.starts_with(';') {
            section = "";
        } else if !section.is_empty() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() >= 5 {
                let rec = Rr {
                    ttl: f[1].parse().unwrap_or(u32::MAX),
                    rtype: f[3].to_owned(),
                    data: f[4..].join(" "),
                };
                if section == "answer" {
                    d.answers.push(rec);
                } else {
                    d.authority.push(rec);
                }
            }
        }
    }
    d
}

fn ask(lab: &Lab, name: &str, rtype: &str, extra: &[&str]) -> Dig {
    let server = format!("@{CLUSTER_DNS_IP}");
    let mut args = vec![server.as_str(), name, rtype];
    args.extend_from_slice(extra);
    dig(lab, CLIENT, &args)
}

/// Writes `/etc/netns/<netns>/resolv.conf` (bind-mounted over /etc/resolv.conf by `ip
/// netns exec`) and removes the folder on drop.
struct NetnsResolvConf(PathBuf);

impl NetnsResolvConf {
    fn write(netns: &str, contents: &str) -> Self {
        let dir = PathBuf::from("/etc/netns").join(netns);
        std::fs::create_dir_all(&dir).expect("create /etc/netns/<netns>");
        std::fs::write(dir.join("resolv.conf"), contents).expect("write resolv.conf");
        NetnsResolvConf(dir)
    }
}

impl Drop for NetnsResolvConf {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
        // /etc/netns itself only if no other test uses it (remove_dir needs it empty).
        if let Some(parent) = self.0.parent() {
            let _ = std::fs::remove_dir(parent);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_dns_answers_per_the_kubernetes_dns_spec() {
    let c = cluster().await;
    c.service(
        "web",
        serde_json::json!({"clusterIP": WEB_IP.to_string(),
            "ports": [{"name": "http", "port": 80, "targetPort": HTTP_PORT}]}),
    )
    .await;
    c.endpoints("web", backends("http", HTTP_PORT, "TCP")).await;
    c.service(
        "db",
        serde_json::json!({"clusterIP": "None", "ports": [{"name": "pg", "port": 5432}]}),
    )
    .await;
    c.endpoints(
        "db",
        serde_json::json!([{"addresses": [
                {"ip": BACKEND_1_IP.to_string(), "hostname": "db-0"},
                {"ip": BACKEND_2_IP.to_string()}],
            "ports": [{"name": "pg", "port": 5432}]}]),
    )
    .await;
    // dns-08: a headless Service with 300 endpoints (addresses need not answer).
    let big: Vec<serde_json::Value> = (0..300u32)
        .map(|i| serde_json::json!({"ip": format!("10.244.{}.{}", 2 + i / 250, 1 + i % 250)}))
        .collect();
    c.service(
        "big",
        serde_json::json!({"clusterIP": "None", "ports": [{"port": 80}]}),
    )
    .await;
    c.endpoints(
        "big",
        serde_json::json!([{"addresses": big, "ports": [{"port": 80}]}]),
    )
    .await;

    let proxy = c.proxy();
    let t0 = Instant::now();
    let kubeconfig = c.cp.admin_kubeconfig();
    let dns = ClusterDns::deploy(c.lab.node(), &kubeconfig, ClusterDnsOptions::default())
        .expect("cluster DNS deploys");
    eprintln!(
        "cluster DNS serving in {:?} in pod {} ({})",
        t0.elapsed(),
        dns.pod().name,
        dns.pod().ip
    );
    let lab = &c.lab;
    // The kube-dns Service exists and the proxy picks it up.
    let took = within("kube-dns ClusterIP rules", Duration::from_secs(3), || {
        proxy
            .status()
            .rules
            .iter()
            .filter(|r| r.ip == CLUSTER_DNS_IP && r.backends.len() == 1)
            .count()
            == 2
    });
    eprintln!("kube-dns ClusterIP (UDP+TCP) loaded after {took:?}");

    // A of a ClusterIP Service, over UDP and TCP, from a pod through the ClusterIP.
    let name = "web.demo.svc.cluster.local.";
    let t = Instant::now();
    let a = ask(lab, name, "A", &[]);
    eprintln!("one dig A through 10.96.0.10 took {:?}", t.elapsed());
    assert_eq!(a.status, "NOERROR", "{}", a.raw);
    assert!(a.flags.contains(&"aa".to_owned()), "{}", a.raw);
    assert_eq!(
        a.data("A"),
        BTreeSet::from([WEB_IP.to_string()]),
        "{}",
        a.raw
    );
    assert!(
        a.answers.iter().all(|r| r.ttl == dns::DNS_TTL),
        "TTL 5 s: {}",
        a.raw
    );
    let a_tcp = ask(lab, name, "A", &["+tcp"]);
    assert_eq!(
        a_tcp.data("A"),
        BTreeSet::from([WEB_IP.to_string()]),
        "{}",
        a_tcp.raw
    );
    // Every spelling of dns-02 that names the FQDN; case does not matter.
    let upper = ask(lab, "WEB.Demo.SVC.cluster.local", "A", &["+noedns"]);
    assert_eq!(
        upper.data("A"),
        BTreeSet::from([WEB_IP.to_string()]),
        "{}",
        upper.raw
    );

    // AAAA of an IPv4 Service: NOERROR, no answer, SOA in authority.
    let aaaa = ask(lab, name, "AAAA", &[]);
    assert_eq!(aaaa.status, "NOERROR", "{}", aaaa.raw);
    assert!(aaaa.answers.is_empty(), "{}", aaaa.raw);
    assert_eq!(aaaa.authority.len(), 1, "{}", aaaa.raw);
    assert_eq!(aaaa.authority[0].rtype, "SOA", "{}", aaaa.raw);
    assert_eq!(aaaa.authority[0].ttl, dns::DNS_TTL, "{}", aaaa.raw);

    // Headless: one A per endpoint, per-endpoint names, SRV per named port.
    let db = ask(lab, "db.demo.svc.cluster.local", "A", &[]);
    assert_eq!(
        db.data("A"),
        BTreeSet::from([BACKEND_1_IP.to_string(), BACKEND_2_IP.to_string()]),
        "{}",
        db.raw
    );
    let db0 = ask(lab, "db-0.db.demo.svc.cluster.local", "A", &[]);
    assert_eq!(
        db0.data("A"),
        BTreeSet::from([BACKEND_1_IP.to_string()]),
        "{}",
        db0.raw
    );
    let srv = ask(lab, "_pg._tcp.db.demo.svc.cluster.local", "SRV", &[]);
    assert_eq!(
        srv.data("SRV"),
        BTreeSet::from([
            "0 100 5432 db-0.db.demo.svc.cluster.local.".to_owned(),
            "0 100 5432 10-244-1-12.db.demo.svc.cluster.local.".to_owned(),
        ]),
        "{}",
        srv.raw
    );
    let srv = ask(lab, "_http._tcp.web.demo.svc.cluster.local", "SRV", &[]);
    assert_eq!(
        srv.data("SRV"),
        BTreeSet::from(["0 100 80 web.demo.svc.cluster.local.".to_owned()]),
        "{}",
        srv.raw
    );
    let ptr = ask(lab, "100.1.96.10.in-addr.arpa", "PTR", &[]);
    assert_eq!(
        ptr.data("PTR"),
        BTreeSet::from([name.to_owned()]),
        "{}",
        ptr.raw
    );
    let version = ask(lab, "dns-version.cluster.local", "TXT", &[]);
    assert_eq!(
        version.data("TXT"),
        BTreeSet::from(["\"1.0.1\"".to_owned()]),
        "{}",
        version.raw
    );

    // Unknown names: NXDOMAIN with the SOA; outside the zone: REFUSED.
    let t = Instant::now();
    let nx = ask(lab, "nope.demo.svc.cluster.local", "A", &[]);
    eprintln!("NXDOMAIN answered in {:?}", t.elapsed());
    assert_eq!(nx.status, "NXDOMAIN", "{}", nx.raw);
    assert_eq!(
        nx.authority.first().map(|r| r.rtype.as_str()),
        Some("SOA"),
        "{}",
        nx.raw
    );
    let refused = ask(lab, "example.com", "A", &[]);
    assert_eq!(refused.status, "REFUSED", "{}", refused.raw);

    // dns-08: TC over UDP, everything over TCP.
    let udp = ask(lab, "big.demo.svc.cluster.local", "A", &["+ignore"]);
    assert!(udp.flags.contains(&"tc".to_owned()), "{}", udp.raw);
    let tcp = ask(lab, "big.demo.svc.cluster.local", "A", &["+tcp"]);
    assert_eq!(tcp.data("A").len(), 300, "{}", tcp.status);
    // dig retries a truncated UDP answer over TCP by itself.
    let auto = ask(lab, "big.demo.svc.cluster.local", "A", &[]);
    assert_eq!(auto.data("A").len(), 300, "{}", auto.status);

    // The pod's resolv.conf: short names through the search list.
    let netns = lab.netns(CLIENT).expect("client netns");
    let _resolv = NetnsResolvConf::write(netns.name(), &dns::resolv_conf(NS));
    let out = lab
        .exec_in(CLIENT, &["getent", "hosts", "web"])
        .expect("run getent");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "getent hosts web: {stdout}");
    assert!(
        stdout.starts_with(&format!("{WEB_IP} ")) && stdout.contains("web.demo.svc.cluster.local"),
        "{stdout}"
    );
    let out = lab
        .exec_in(CLIENT, &["getent", "hosts", "db.demo"])
        .expect("run getent");
    let ip: Option<IpAddr> = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .and_then(|s| s.parse().ok());
    assert!(
        ip == Some(IpAddr::V4(BACKEND_1_IP)) || ip == Some(IpAddr::V4(BACKEND_2_IP)),
        "getent hosts db.demo: {ip:?}"
    );
    let search = dig(lab, CLIENT, &["+search", "web", "A"]);
    assert_eq!(
        search.data("A"),
        BTreeSet::from([WEB_IP.to_string()]),
        "{}",
        search.raw
    );

    // A Service created now resolves within about a second; deleting it makes it NXDOMAIN.
    c.service(
        "late",
        serde_json::json!({"clusterIP": LATE_IP.to_string(), "ports": [{"port": 7}]}),
    )
    .await;
    let late = "late.demo.svc.cluster.local";
    let took = blocking({
        let netns = netns.clone();
        move || {
            within("new Service resolvable", Duration::from_secs(2), || {
                let out = netns
                    .exec(&[
                        "dig",
                        "+short",
                        "+tries=1",
                        "+time=1",
                        "@10.96.0.10",
                        late,
                        "A",
                    ])
                    .expect("dig");
                String::from_utf8_lossy(&out.stdout).trim() == LATE_IP.to_string()
            })
        }
    })
    .await;
    eprintln!("a new Service resolved {took:?} after it was created");
    c.api::<Service>()
        .await
        .delete("late", &DeleteParams::default())
        .await
        .expect("delete late");
    let took = blocking({
        let netns = netns.clone();
        move || {
            within("deleted Service NXDOMAIN", Duration::from_secs(2), || {
                let out = netns
                    .exec(&["dig", "+tries=1", "+time=1", "@10.96.0.10", late, "A"])
                    .expect("dig");
                String::from_utf8_lossy(&out.stdout).contains("status: NXDOMAIN")
            })
        }
    })
    .await;
    eprintln!("a deleted Service was NXDOMAIN {took:?} after the delete");

    // Stop: the kube-dns Service is removed with the server, the pod netns with stop.
    let dns_pod = dns.pod().netns.clone();
    dns.stop(lab.node()).expect("stop DNS");
    assert!(!dns_pod.exists(), "DNS pod netns removed");
    let svc =
        c.cp.admin_client()
            .await
            .map(|client| Api::<Service>::namespaced(client, "kube-system"))
            .expect("client");
    assert!(
        svc.get_opt("kube-dns").await.expect("get").is_none(),
        "kube-dns Service removed"
    );
    proxy.stop().expect("stop proxy");
}
