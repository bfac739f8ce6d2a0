//! Helpers of the split-DNS end-to-end tests (tests/tests/kube_dns*.rs) on the
//! Kubernetes lab: the cluster DNS is the lab's kube-dns behind ClusterIP
//! 10.96.0.10; the laptop's own resolver is a real dnsmasq in the laptop netns on
//! 127.0.0.1 ([`Upstream`]) whose query log proves that cluster names never reach
//! it; `dig` and `getent hosts` run in the laptop netns and read its resolv.conf
//! (`/etc/netns/<laptop>/resolv.conf`, managed by the root daemon).
//!
//! I/O: processes in the laptop netns, the API server through the admin client.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, PostParams};
use kvpn_lab::LAPTOP;

use crate::kube_lab::KubeFixture;
use crate::text;

/// The lab's kube-dns ClusterIP.
pub const CLUSTER_DNS: &str = "10.96.0.10";
/// Where kvpn's DNS forwarder listens.
pub const FORWARDER: &str = "127.0.0.153";
/// What the laptop's own dnsmasq answers.
pub const CORP_HOST: (&str, &str) = ("host.corp.test", "192.0.2.10");
pub const PUBLIC_HOST: (&str, &str) = ("www.example.com", "192.0.2.20");
/// The laptop's resolv.conf before connect: CRLF, a tab, no trailing newline.
pub const LAPTOP_RESOLV: &[u8] =
    b"# laptop's own resolver\r\nnameserver 127.0.0.1\nsearch corp.test\noptions\tedns0 timeout:2";

/// One `dig` answer, parsed from its default output.
#[derive(Debug)]
pub struct Dig {
    pub status: String,
    pub flags: Vec<String>,
    /// (type, data) of each answer record.
    pub answers: Vec<(String, String)>,
    pub query_ms: u64,
    pub raw: String,
}

impl Dig {
    pub fn a(&self) -> Vec<String> {
        self.typed("A")
    }
    pub fn typed(&self, t: &str) -> Vec<String> {
        self.answers
            .iter()
            .filter(|(ty, _)| ty == t)
            .map(|(_, d)| d.clone())
            .collect()
    }
    pub fn tc(&self) -> bool {
        self.flags.iter().any(|f| f == "tc")
    }
}

pub fn parse_dig(out: &str) -> Dig {
    let mut d = Dig {
        status: String::new(),
        flags: Vec::new(),
        answers: Vec::new(),
        query_ms: u64::MAX,
        raw: out.to_owned(),
    };
    let mut in_answer = false;
    for line in out.lines() {
        if let Some(rest) = line.split("status: ").nth(1) {
            d.status = rest.split(',').next().unwrap_or("").to_owned();
        } else if let Some(rest) = line.strip_prefix(";; flags:") {
            d.flags = rest
                .split(';')
                .next()
                .unwrap_or("")
                .split_whitespace()
                .map(str::to_owned)
                .collect();
        } else if let Some(rest) = line.strip_prefix(";; Query time: ") {
            d.query_ms = rest
                .split_whitespace()
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(u64::MAX);
        } else if line.starts_with(";; ANSWER SECTION:") {
            in_answer = true;
        } else if in_answer {
            if line.trim().is_empty() {
                in_answer = false;
            } else {
                let cols: Vec<&str> = line.split_whitespace().collect();
                if cols.len() >= 5 {
                    d.answers.push((cols[3].to_owned(), cols[4..].join(" ")));
                }
            }
        }
    }
    d
}

pub fn dig(f: &KubeFixture, args: &[&str]) -> Dig {
    let mut all = vec!["dig", "+time=2", "+tries=1"];
    all.extend_from_slice(args);
    let out = f.laptop(&all);
    let d = parse_dig(&text(&out.stdout));
    assert!(
        !d.status.is_empty(),
        "dig {args:?} got no answer:\n{}{}\n{}",
        d.raw,
        text(&out.stderr),
        f.diagnostics()
    );
    d
}

pub fn getent(f: &KubeFixture, name: &str) -> Option<String> {
    first_address(&f.laptop(&["getent", "hosts", name]))
}

/// The first address of a successful `getent hosts` run.
pub fn first_address(out: &Output) -> Option<String> {
    out.status.success().then(|| {
        text(&out.stdout)
            .split_whitespace()
            .next()
            .unwrap_or("")
            .to_owned()
    })
}

/// The laptop's own resolver: dnsmasq on 127.0.0.1:53 in the laptop netns,
/// logging every query.
pub struct Upstream {
    pub log: PathBuf,
}

impl Upstream {
    pub fn start(f: &KubeFixture) -> Upstream {
        Self::start_with(f, &[])
    }

    /// [`Upstream::start`] that also answers `records` (name, IPv4 address),
    /// e.g. public-looking names under a top-level domain that is also a
    /// namespace of the cluster (`go.dev`).
    pub fn start_with(f: &KubeFixture, records: &[(&str, &str)]) -> Upstream {
        let lab = f.lab().netns_lab();
        let log = lab.dir().join("laptop-dnsmasq-queries.log");
        let mut cmd = Command::new("dnsmasq");
        cmd.args([
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--no-resolv",
            "--no-hosts",
            "--bind-interfaces",
            "--listen-address=127.0.0.1",
            "--port=53",
            "--user=root",
            "--pid-file=",
            "--log-queries",
            "--local=/corp.test/",
            "--local=/example.com/",
        ])
        .arg(format!("--log-facility={}", log.display()))
        .arg(format!("--host-record={},{}", CORP_HOST.0, CORP_HOST.1))
        .arg(format!("--host-record={},{}", PUBLIC_HOST.0, PUBLIC_HOST.1));
        for (name, ip) in records {
            cmd.arg(format!("--host-record={name},{ip}"));
        }
        lab.spawn_in(LAPTOP, "laptop-dnsmasq", &cmd)
            .unwrap_or_else(|e| {
                panic!(
                    "dnsmasq in the laptop netns: {e:#} (scripts/setup.sh installs dnsmasq-base)"
                )
            });
        let up = Upstream { log };
        let t0 = Instant::now();
        loop {
            let out = f.laptop(&["dig", "+time=1", "+tries=1", "@127.0.0.1", CORP_HOST.0]);
            if parse_dig(&text(&out.stdout)).a() == vec![CORP_HOST.1.to_owned()] {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "laptop dnsmasq not answering: {}",
                std::fs::read_to_string(&up.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        up
    }

    /// Names it was asked, lower case, in order.
    pub fn queries(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let rest = l.split("query[").nth(1)?;
                let name = rest.split("] ").nth(1)?.split_whitespace().next()?;
                Some(name.to_ascii_lowercase())
            })
            .collect()
    }

    /// Panics if a cluster name reached the laptop's resolver.
    pub fn assert_no_cluster_names(&self, f: &KubeFixture, short: &[&str]) {
        let leaked: Vec<String> = self
            .queries()
            .into_iter()
            .filter(|q| {
                q.ends_with("cluster.local")
                    || short.contains(&q.as_str())
                    || short
                        .iter()
                        .any(|s| q.starts_with(&format!("{s}.")) && !q.ends_with("corp.test"))
            })
            .collect();
        assert!(
            leaked.is_empty(),
            "cluster names reached the laptop's upstream: {leaked:?}\n{}",
            f.diagnostics()
        );
    }
}

pub fn service(f: &KubeFixture, ns: &str, body: serde_json::Value) {
    let api: Api<Service> = Api::namespaced(f.admin(), ns);
    let svc: Service = serde_json::from_value(body).unwrap_or_else(|e| panic!("service JSON: {e}"));
    f.block_on(api.create(&PostParams::default(), &svc))
        .unwrap_or_else(|e| panic!("create service in {ns}: {e}"));
}

pub fn cluster_ip(f: &KubeFixture, ns: &str, name: &str) -> String {
    let api: Api<Service> = Api::namespaced(f.admin(), ns);
    let svc = f
        .block_on(api.get(name))
        .unwrap_or_else(|e| panic!("get service {ns}/{name}: {e}"));
    svc.spec
        .and_then(|s| s.cluster_ip)
        .unwrap_or_else(|| panic!("{ns}/{name} has no ClusterIP"))
}

/// Waits until the cluster DNS (through the tunnel) knows `fqdn`.
pub fn wait_cluster_name(f: &KubeFixture, fqdn: &str) {
    let t0 = Instant::now();
    loop {
        let d = dig(f, &[&format!("@{CLUSTER_DNS}"), "+tcp", fqdn]);
        if d.status == "NOERROR" && !d.answers.is_empty() {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "cluster DNS does not know {fqdn}: {}",
            d.raw
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

pub fn write_laptop_resolv(f: &KubeFixture, bytes: &[u8]) -> PathBuf {
    let path = f.laptop_resolv_conf();
    std::fs::write(&path, bytes).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    path
}

/// `kvpn connect` with the restricted user, connected to namespace `default`.
pub fn connect_default(f: &KubeFixture) -> String {
    let kubeconfig = f.user_kubeconfig();
    f.kvpn_ok(&[
        "connect",
        "--kubeconfig",
        &kubeconfig,
        "--namespace",
        "default",
    ])
}

pub fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(u64::MAX)
}

/// Median of dig's query time for `name` over `n` queries, and its answers.
pub fn latency(f: &KubeFixture, name: &str, n: usize) -> (u64, Vec<String>) {
    let mut times = Vec::new();
    let mut a = Vec::new();
    for _ in 0..n {
        let d = dig(f, &[name]);
        times.push(d.query_ms);
        a = d.a();
    }
    (median(times), a)
}

/// SIGKILL to the fixture's root daemon, its DNS guard and the user daemon (by
/// pid: the daemon's and the guard's pid files, the user daemon of its runtime
/// folder); returns once the daemon is gone and its socket refuses
/// connections. Returns the daemon's pid. The guard goes first, so nothing
/// repairs the laptop's DNS: what tests of the fallbacks (`kvpn quit`, the next
/// daemon start) need.
pub fn kill_daemon_and_agents(f: &KubeFixture) -> i32 {
    kill_daemons(f, true, true)
}

/// SIGKILL to the fixture's root daemon and its DNS guard (the user daemon
/// lives on); returns once the daemon is gone and its socket refuses
/// connections, with its pid.
pub fn kill_root_daemon(f: &KubeFixture) -> i32 {
    kill_daemons(f, false, true)
}

/// SIGKILL to the fixture's root daemon alone, as the OOM killer does it: its
/// DNS guard and the user daemon live on. Returns the daemon's pid.
pub fn kill_root_daemon_only(f: &KubeFixture) -> i32 {
    kill_daemons(f, false, false)
}

/// The pid of the root daemon's DNS guard (its pid file), if it runs.
pub fn dns_guard_pid(f: &KubeFixture) -> Option<i32> {
    let pid: i32 = std::fs::read_to_string(f.runtime_dir().join("dns-guard.pid"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|c| c.contains("--dns-guard"))
        .then_some(pid)
}

fn kill_daemons(f: &KubeFixture, user_daemon_too: bool, guard_too: bool) -> i32 {
    if guard_too && let Some(guard) = dns_guard_pid(f) {
        // SAFETY: the pid of this fixture's DNS guard (its pid file, cmdline checked).
        unsafe { libc::kill(guard, libc::SIGKILL) };
        let t0 = Instant::now();
        while std::fs::read_to_string(format!("/proc/{guard}/stat")).is_ok_and(|s| {
            s.rsplit_once(") ")
                .is_some_and(|(_, r)| !r.starts_with('Z'))
        }) {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "DNS guard {guard} survived SIGKILL"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let pid_file = f.runtime_dir().join("dataplane.pid");
    let pid: i32 = std::fs::read_to_string(&pid_file)
        .ok()
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("no daemon pid in {}", pid_file.display()));
    let users = if user_daemon_too {
        f.user_daemon_pids()
    } else {
        Vec::new()
    };
    for p in std::iter::once(pid).chain(users.into_iter().map(|p| p as i32)) {
        // SAFETY: pids of this fixture's root daemon (its pid file) and user daemon.
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    let alive = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            s.rsplit_once(") ")
                .is_some_and(|(_, r)| !r.starts_with('Z'))
        })
    };
    // A killed multi-threaded process shows as a zombie while its other threads
    // still hold its descriptors: wait until the socket refuses connections too.
    let socket = f.runtime_dir().join("dataplane.sock");
    let t0 = Instant::now();
    while alive(pid) || std::os::unix::net::UnixStream::connect(&socket).is_ok() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "daemon {pid} survived SIGKILL"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    pid
}

/// Starts a fresh root daemon in the laptop netns with the fixture's runtime
/// folder, resolv.conf and hosts file (its start repairs what a killed one left);
/// its log is `dataplane-restarted.log` in the lab folder.
pub fn restart_daemon(f: &KubeFixture) {
    let daemon = kvpn_lab::bin_path("kvpn-dataplane").unwrap_or_else(|e| panic!("{e:#}"));
    let mut cmd = Command::new(daemon);
    cmd.env("KVPN_RUNTIME_DIR", f.runtime_dir())
        .env("KVPN_RESOLV_CONF", f.laptop_resolv_conf())
        .env("KVPN_HOSTS", f.laptop_hosts());
    f.lab()
        .netns_lab()
        .spawn_in(LAPTOP, "dataplane-restarted", &cmd)
        .unwrap_or_else(|e| panic!("restart the root daemon: {e:#}"));
}
