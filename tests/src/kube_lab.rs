//! [`KubeFixture`]: the Kubernetes lab ([`K8sLab`]: real kube-apiserver, kubelet,
//! kube-proxy and DNS stand-ins, sample workloads, *no* pre-installed traffic
//! manager) plus the real `kvpn` CLI, user daemon and root daemon running in
//! its laptop netns, which reaches only the API server (172.31.255.1:6443).
//!
//! Each fixture has its own lab id, its own `KVPN_RUNTIME_DIR` (inside the lab
//! folder; the user daemon's socket and log live there too) and its own
//! `XDG_STATE_HOME` (the user daemon's session records), so tests run in
//! parallel. Drop tears everything down, also when the test failed: `kvpn quit`
//! (sessions, user daemon, root daemon), then any user daemon of this runtime
//! folder still running (by pid), then the lab.
//!
//! More than one of each: [`KubeFixture::add_cluster`] brings up a second cluster
//! (its own addressing) whose uplink is in this fixture's laptop netns, so one
//! laptop can connect to both; [`KubeFixture::add_laptop`] adds a second laptop
//! netns on the first cluster ([`Laptop`]: its own root daemon, runtime folder and
//! kvpn config folder, hence its own client id and lease). Drop quits kvpn on
//! every laptop first, then takes the extra clusters down, then the first.
//!
//! I/O: processes in the laptop netns, the API server through the admin client,
//! sockets opened on threads inside the laptop netns.

use std::io::{Read as _, Write as _};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kvpn_lab::k8s::cluster::K8sLaptop;
use kvpn_lab::k8s::workloads::Workloads;
use kvpn_lab::k8s::{K8sLab, K8sLabOptions, RealNodeOptions};
use kvpn_lab::protocol::PageInfo;
use kvpn_lab::{Addressing, LAPTOP, Netns};

use crate::text;

/// Namespace of the traffic manager (kvpn's default `--manager-namespace`).
pub const MANAGER_NAMESPACE: &str = "kvpn-system";
/// Label selector of everything kvpn installs for the manager.
pub const MANAGER_SELECTOR: &str =
    "app.kubernetes.io/name=kvpn-manager,app.kubernetes.io/managed-by=kvpn";
/// The version kvpn writes into `kvpn.dev/version` (the workspace's).
pub const KVPN_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The laptop's kernel view of a TUN device: what must not change across
/// transport reconnects (tr-08).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TunState {
    pub ifindex: u64,
    /// `address/prefix` strings.
    pub addresses: Vec<String>,
    /// `dst` of each route through the device, sorted.
    pub routes: Vec<String>,
}

/// One TCP socket of a process, as `ss` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpSocket {
    /// `LISTEN`, `ESTAB`, `CLOSE-WAIT`, …
    pub state: String,
    pub local: String,
    pub peer: String,
}

/// Another laptop netns on the fixture's first cluster, with kvpn of its own.
pub struct Laptop {
    /// Its netns, uplink and kubeconfigs.
    pub lab: K8sLaptop,
    runtime_dir: PathBuf,
    config_dir: PathBuf,
    state_dir: PathBuf,
    kvpn: PathBuf,
}

impl Laptop {
    /// Its `KVPN_RUNTIME_DIR`.
    pub fn runtime_dir(&self) -> &Path {
        &self.runtime_dir
    }

    /// Its netns.
    pub fn netns(&self) -> &Netns {
        &self.lab.netns
    }

    /// Runs `kvpn <args>` in this laptop's netns with its runtime folder and its
    /// own kvpn config folder (`XDG_CONFIG_HOME`, not under sudo: another machine).
    pub fn kvpn(&self, args: &[&str]) -> Output {
        let mut cmd = self.lab.netns.command(&self.kvpn);
        cmd.args(args)
            .env("KVPN_RUNTIME_DIR", &self.runtime_dir)
            .env(
                "KVPN_RESOLV_CONF",
                self.lab.netns.etc_dir().join("resolv.conf"),
            )
            .env("KVPN_HOSTS", self.lab.netns.etc_dir().join("hosts"))
            .env("XDG_CONFIG_HOME", &self.config_dir)
            .env("XDG_STATE_HOME", &self.state_dir)
            .env_remove("SUDO_USER")
            .env_remove("KUBECONFIG");
        cmd.output()
            .unwrap_or_else(|e| panic!("run kvpn {args:?} on {}: {e}", self.lab.role))
    }

    /// `kvpn <args>`, which must succeed; its stdout.
    pub fn kvpn_ok(&self, args: &[&str]) -> String {
        let out = self.kvpn(args);
        assert!(
            out.status.success(),
            "kvpn {args:?} on {} failed ({}):\n{}\n{}\n{}",
            self.lab.role,
            out.status,
            text(&out.stdout),
            text(&out.stderr),
            diagnostics_of(&self.runtime_dir)
        );
        text(&out.stdout)
    }

    /// `kvpn connect --kubeconfig <restricted user's>`; its stdout.
    pub fn connect_restricted(&self) -> String {
        let kubeconfig = self.lab.user_kubeconfig.to_string_lossy().into_owned();
        self.kvpn_ok(&["connect", "--kubeconfig", &kubeconfig])
    }

    /// The sessions of `kvpn status -o json`.
    pub fn sessions(&self) -> Vec<serde_json::Value> {
        let out = self.kvpn_ok(&["status", "-o", "json"]);
        let v: serde_json::Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("status JSON: {e}: {out}"));
        v["sessions"].as_array().cloned().unwrap_or_default()
    }

    /// Runs a command in this laptop's netns.
    pub fn exec(&self, args: &[&str]) -> Output {
        self.lab
            .netns
            .exec(args)
            .unwrap_or_else(|e| panic!("{} {args:?}: {e:#}", self.lab.role))
    }

    /// Runs `f` on a thread inside this laptop's netns (sockets opened there stay
    /// there).
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        self.lab
            .netns
            .run(f)
            .unwrap_or_else(|e| panic!("{} netns: {e:#}", self.lab.role))
    }

    /// The root daemon's and the user daemon's logs.
    pub fn diagnostics(&self) -> String {
        diagnostics_of(&self.runtime_dir)
    }

    /// `kvpn quit`, then SIGKILL to any user daemon of its runtime folder still running.
    fn quit(&self) {
        let quit = self.kvpn(&["quit"]);
        if !quit.status.success() {
            eprintln!(
                "kvpn quit on {}: {}{}",
                self.lab.role,
                text(&quit.stdout),
                text(&quit.stderr)
            );
        }
        kill_user_daemons_of(&self.runtime_dir);
    }
}

/// A Kubernetes lab plus kvpn on its laptop.
pub struct KubeFixture {
    // Field order: laptops, then the extra clusters (their uplinks live in the first
    // lab's laptop netns), then the first lab, then the runtime their node services
    // were started on. Drop does it explicitly in that order anyway.
    laptops: Vec<Laptop>,
    clusters: Vec<K8sLab>,
    lab: Option<K8sLab>,
    admin: kube::Client,
    rt: tokio::runtime::Runtime,
    runtime_dir: PathBuf,
    state_dir: PathBuf,
    kvpn: PathBuf,
}

impl KubeFixture {
    /// A fresh Kubernetes lab with the sample workloads and without the traffic
    /// manager (`kvpn connect` installs it).
    pub fn new() -> Self {
        Self::with_addressing(Addressing::default())
    }

    /// [`KubeFixture::new`] on a dual-stack lab ([`Addressing::dual_stack`]): IPv6
    /// pod and service ranges, pods with an IPv6 address, the sample ClusterIP
    /// Services `PreferDualStack` with fixed IPv6 ClusterIPs.
    pub fn dual_stack() -> Self {
        Self::with_addressing(Addressing::default().dual_stack())
    }

    /// A lab on real node software ([`kvpn_lab::k8s::node`]): `count` nodes, each
    /// with containerd + runc, CNI, a real kubelet and kube-proxy 1.20.2, and the
    /// project's images (`cargo xtask image`) imported: pause as the sandbox image,
    /// the lab server running the sample workloads (`default/web`'s replicas on
    /// different nodes) and the cluster DNS pod (`kube-system/kube-dns` behind the
    /// DNS ClusterIP), the manager for `kvpn connect` to install. No traffic
    /// manager.
    pub fn real_nodes(count: usize) -> Self {
        Self::real_nodes_with_images(count, Vec::new())
    }

    /// [`KubeFixture::real_nodes`] with `extra` image archives imported into every
    /// node as well (e.g. the lab's busybox, for workloads that need a shell).
    pub fn real_nodes_with_images(
        count: usize,
        extra: Vec<kvpn_lab::k8s::node::ImageArchive>,
    ) -> Self {
        let mut options = K8sLabOptions::default().real_nodes(
            RealNodeOptions::project(count, extra).unwrap_or_else(|e| panic!("real nodes: {e}")),
        );
        // KVPN_LAB_KEEP_DIR keeps the lab folder (node logs, configs) for a post-mortem.
        if std::env::var_os("KVPN_LAB_KEEP_DIR").is_some() {
            options.lab = options.lab.keep_dir(true);
        }
        Self::with_options(options)
    }

    fn with_addressing(addressing: Addressing) -> Self {
        let mut options = K8sLabOptions::default().workloads(Workloads {
            manager: false,
            ..Default::default()
        });
        options.lab = options.lab.addressing(addressing);
        Self::with_options(options)
    }

    fn with_options(options: K8sLabOptions) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("tokio runtime: {e}"));
        let t0 = Instant::now();
        let lab = rt
            .block_on(K8sLab::up(options))
            .unwrap_or_else(|e| panic!("Kubernetes lab up: {e}"));
        eprintln!(
            "Kubernetes lab {} up in {:.1} s",
            lab.netns_lab().id(),
            t0.elapsed().as_secs_f64()
        );
        let admin = rt
            .block_on(lab.admin_client())
            .unwrap_or_else(|e| panic!("admin client: {e}"));
        let runtime_dir = lab.netns_lab().dir().join("kvpn-runtime");
        let state_dir = lab.netns_lab().dir().join("kvpn-state");
        let kvpn = kvpn_lab::bin_path("kvpn").unwrap_or_else(|e| panic!("kvpn binary: {e:#}"));
        KubeFixture {
            laptops: Vec::new(),
            clusters: Vec::new(),
            lab: Some(lab),
            admin,
            rt,
            runtime_dir,
            state_dir,
            kvpn,
        }
    }

    /// The lab.
    pub fn lab(&self) -> &K8sLab {
        // Only None inside drop.
        self.lab
            .as_ref()
            .unwrap_or_else(|| unreachable!("fixture without its lab"))
    }

    /// This fixture's `KVPN_RUNTIME_DIR`.
    pub fn runtime_dir(&self) -> &Path {
        &self.runtime_dir
    }

    /// This fixture's `XDG_STATE_HOME` (the user daemon keeps its session
    /// records under `kvpn/sessions/` there).
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// The laptop netns's resolv.conf (`/etc/netns/<laptop netns>/resolv.conf`,
    /// seen as /etc/resolv.conf by programs in the laptop netns); the root daemon
    /// of this fixture manages it (env `KVPN_RESOLV_CONF`).
    pub fn laptop_resolv_conf(&self) -> PathBuf {
        self.lab()
            .netns_lab()
            .laptop_netns()
            .etc_dir()
            .join("resolv.conf")
    }

    /// The laptop netns's hosts file (`/etc/netns/<laptop netns>/hosts`, which the
    /// lab makes as a copy of /etc/hosts, seen as /etc/hosts by programs started in
    /// the laptop netns); the root
    /// daemon of this fixture writes `kvpn connect --hosts` entries there (env
    /// `KVPN_HOSTS`), never to this machine's /etc/hosts.
    pub fn laptop_hosts(&self) -> PathBuf {
        self.lab()
            .netns_lab()
            .laptop_netns()
            .etc_dir()
            .join("hosts")
    }

    /// Brings up another cluster with `addressing` (which must differ from the first
    /// cluster's: e.g. [`Addressing::second`]), without a traffic manager, whose
    /// uplink is in this fixture's laptop netns; returns its index for
    /// [`KubeFixture::cluster`]. It is taken down before the first one.
    pub fn add_cluster(&mut self, addressing: Addressing) -> usize {
        let t0 = Instant::now();
        let options = K8sLabOptions::default()
            .workloads(Workloads {
                manager: false,
                ..Default::default()
            })
            .addressing(addressing)
            .laptop_of(self.lab());
        let lab = self
            .rt
            .block_on(K8sLab::up(options))
            .unwrap_or_else(|e| panic!("second Kubernetes lab up: {e}"));
        eprintln!(
            "Kubernetes lab {} (on laptop {}) up in {:.1} s",
            lab.netns_lab().id(),
            lab.netns_lab().laptop_netns().name(),
            t0.elapsed().as_secs_f64()
        );
        self.clusters.push(lab);
        self.clusters.len() - 1
    }

    /// The extra cluster `i` of [`KubeFixture::add_cluster`].
    pub fn cluster(&self, i: usize) -> &K8sLab {
        self.clusters
            .get(i)
            .unwrap_or_else(|| panic!("no extra cluster {i}"))
    }

    /// Adds a laptop netns `role` (e.g. `laptop2`) on the first cluster, with its
    /// own uplink, runtime folder and kvpn config folder.
    pub fn add_laptop(&mut self, role: &str) -> &Laptop {
        let lab = self
            .lab
            .as_mut()
            .unwrap_or_else(|| unreachable!("fixture without its lab"));
        let added = lab
            .add_laptop(role)
            .unwrap_or_else(|e| panic!("add laptop {role}: {e}"));
        let base = lab.netns_lab().dir().join(role);
        self.laptops.push(Laptop {
            lab: added,
            runtime_dir: base.join("kvpn-runtime"),
            config_dir: base.join("config"),
            state_dir: base.join("state"),
            kvpn: self.kvpn.clone(),
        });
        self.laptops
            .last()
            .unwrap_or_else(|| unreachable!("just pushed"))
    }

    /// The laptop `role` of [`KubeFixture::add_laptop`].
    pub fn laptop_of(&self, role: &str) -> &Laptop {
        self.laptops
            .iter()
            .find(|l| l.lab.role == role)
            .unwrap_or_else(|| panic!("no laptop {role}"))
    }

    /// The admin kubeconfig for the laptop netns (cluster-admin: for what the
    /// restricted user may not install, such as preserve's node agent).
    pub fn admin_kubeconfig_path(&self) -> String {
        self.lab()
            .laptop_admin_kubeconfig()
            .to_string_lossy()
            .into_owned()
    }

    /// The restricted user's kubeconfig for the laptop netns.
    pub fn user_kubeconfig(&self) -> String {
        self.lab()
            .laptop_user_kubeconfig()
            .to_string_lossy()
            .into_owned()
    }

    /// The lab's cluster name (the kubeconfigs' cluster).
    pub fn cluster_name(&self) -> &str {
        &self.lab().state().cluster_name
    }

    /// Runs `f` to completion on this fixture's runtime.
    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    /// The admin client (host netns, the apiserver's loopback address).
    pub fn admin(&self) -> kube::Client {
        self.admin.clone()
    }

    /// Runs `kvpn <args>` in the laptop netns with this fixture's runtime folder.
    pub fn kvpn(&self, args: &[&str]) -> Output {
        self.kvpn_env(args, &[])
    }

    /// [`KubeFixture::kvpn`] with `env` set on top (e.g. another HOME or KUBECONFIG).
    pub fn kvpn_env(&self, args: &[&str], env: &[(&str, &std::ffi::OsStr)]) -> Output {
        let mut cmd = self.kvpn_command(args);
        cmd.envs(env.iter().copied());
        cmd.output()
            .unwrap_or_else(|e| panic!("run kvpn {args:?}: {e}"))
    }

    /// The command `kvpn <args>` in the laptop netns with this fixture's runtime
    /// folder, not started (`ip netns exec` execs kvpn: the child's pid is kvpn's).
    pub fn kvpn_command(&self, args: &[&str]) -> std::process::Command {
        let mut cmd = self
            .lab()
            .netns_lab()
            .command_in(LAPTOP, &self.kvpn.to_string_lossy())
            .unwrap_or_else(|e| panic!("laptop netns: {e:#}"));
        // The root daemon manages the laptop netns's own resolv.conf and hosts
        // file (what `ip netns exec` shows as /etc/resolv.conf and /etc/hosts
        // there), never this machine's.
        cmd.args(args)
            .env("KVPN_RUNTIME_DIR", &self.runtime_dir)
            .env("KVPN_RESOLV_CONF", self.laptop_resolv_conf())
            .env("KVPN_HOSTS", self.laptop_hosts())
            .env("XDG_STATE_HOME", &self.state_dir)
            // The settings file (config.yaml) and $KVPN_IMAGE of the machine
            // running the tests must not reach the lab's kvpn.
            .env("XDG_CONFIG_HOME", self.config_dir())
            .env_remove("KVPN_IMAGE")
            .env_remove("KUBECONFIG");
        cmd
    }

    /// This fixture's `XDG_CONFIG_HOME` (kvpn's settings file is
    /// `<it>/kvpn/config.yaml`).
    pub fn config_dir(&self) -> PathBuf {
        self.state_dir.with_file_name("kvpn-config")
    }

    /// `kvpn <args>`, which must succeed; its stdout.
    pub fn kvpn_ok(&self, args: &[&str]) -> String {
        kvpn_succeeded(args, &self.kvpn(args), || self.diagnostics())
    }

    /// `kvpn connect --kubeconfig <restricted user's>`, which must succeed; its stdout.
    pub fn connect_restricted(&self) -> String {
        let kubeconfig = self.user_kubeconfig();
        self.kvpn_ok(&["connect", "--kubeconfig", &kubeconfig])
    }

    /// `kvpn status -o json`, parsed.
    pub fn status_json(&self) -> serde_json::Value {
        let out = self.kvpn_ok(&["status", "-o", "json"]);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("status JSON: {e}: {out}"))
    }

    /// The sessions of `kvpn status -o json`.
    pub fn sessions(&self) -> Vec<serde_json::Value> {
        self.status_json()["sessions"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The only session; panics unless there is exactly one.
    pub fn session(&self) -> serde_json::Value {
        let sessions = self.sessions();
        assert_eq!(
            sessions.len(),
            1,
            "exactly one session expected: {sessions:#?}"
        );
        sessions.into_iter().next().unwrap_or_default()
    }

    /// Polls the only session until its state is `state`; returns how long it took.
    pub fn wait_state(&self, state: &str, within: Duration) -> Duration {
        let t0 = Instant::now();
        loop {
            let s = self.session();
            if s["state"] == state {
                return t0.elapsed();
            }
            assert!(
                t0.elapsed() < within,
                "session not {state} within {within:?}: {s:#}\n{}",
                self.diagnostics()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Runs a command in the laptop netns.
    pub fn laptop(&self, args: &[&str]) -> Output {
        self.lab()
            .netns_lab()
            .exec_in(LAPTOP, args)
            .unwrap_or_else(|e| panic!("laptop {args:?}: {e:#}"))
    }

    /// The source address the UDP echo backend at `to` saw (its answer to
    /// `KVPN-PEER?`), sent from the laptop netns over `to`'s address family;
    /// three tries of 2 s.
    pub fn udp_peer(&self, to: SocketAddr) -> SocketAddr {
        let got = self
            .lab()
            .netns_lab()
            .run_in(LAPTOP, move || -> Result<SocketAddr, String> {
                let bind: SocketAddr = if to.is_ipv6() {
                    (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
                } else {
                    (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
                };
                let s = std::net::UdpSocket::bind(bind).map_err(|e| e.to_string())?;
                s.connect(to).map_err(|e| e.to_string())?;
                s.set_read_timeout(Some(Duration::from_secs(2)))
                    .map_err(|e| e.to_string())?;
                let mut last = String::new();
                for _ in 0..3 {
                    s.send(kvpn_lab::protocol::UDP_PEER_QUERY)
                        .map_err(|e| e.to_string())?;
                    let mut buf = [0u8; 128];
                    match s.recv(&mut buf) {
                        Ok(n) => {
                            let t = String::from_utf8_lossy(&buf[..n]).to_string();
                            return t.trim().parse().map_err(|e| format!("{t:?}: {e}"));
                        }
                        Err(e) => last = e.to_string(),
                    }
                }
                Err(last)
            })
            .unwrap_or_else(|e| panic!("laptop netns: {e:#}"));
        got.unwrap_or_else(|e| panic!("UDP peer query to {to}: {e}\n{}", self.diagnostics()))
    }

    /// Turns IPv6 off in the laptop netns (`disable_ipv6=1` for all and new
    /// interfaces), as on a laptop without IPv6 (case rt-08).
    pub fn disable_laptop_ipv6(&self) {
        self.lab()
            .netns_lab()
            .laptop_netns()
            .set_sysctls(&[
                ("net.ipv6.conf.all.disable_ipv6", "1"),
                ("net.ipv6.conf.default.disable_ipv6", "1"),
            ])
            .unwrap_or_else(|e| panic!("disable IPv6 on the laptop: {e:#}"));
    }

    /// One HTTP GET on a fresh connection from the laptop netns, each step bounded
    /// by `timeout`; the parsed lab page.
    pub fn http_get(&self, addr: SocketAddr, timeout: Duration) -> Result<PageInfo, String> {
        self.lab()
            .netns_lab()
            .run_in(LAPTOP, move || -> Result<PageInfo, String> {
                let mut s = TcpStream::connect_timeout(&addr, timeout)
                    .map_err(|e| format!("connect {addr}: {e}"))?;
                s.set_read_timeout(Some(timeout))
                    .map_err(|e| e.to_string())?;
                s.write_all(b"GET / HTTP/1.1\r\nHost: lab\r\nConnection: close\r\n\r\n")
                    .map_err(|e| format!("send to {addr}: {e}"))?;
                let mut out = String::new();
                s.read_to_string(&mut out)
                    .map_err(|e| format!("read from {addr}: {e}"))?;
                let body = out.split_once("\r\n\r\n").map_or(out.as_str(), |(_, b)| b);
                PageInfo::parse(body).ok_or_else(|| format!("not a lab page from {addr}: {out:?}"))
            })
            .unwrap_or_else(|e| panic!("laptop netns: {e:#}"))
    }

    /// The lab page from `addr`; panics with diagnostics on failure.
    pub fn page(&self, addr: SocketAddr) -> PageInfo {
        self.http_get(addr, Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("GET {addr}: {e}\n{}", self.diagnostics()))
    }

    /// Retries GET `addr` (fresh connection, 500 ms bounds per attempt) until it
    /// works; returns how long that took from `since`, or panics after `within`.
    pub fn wait_http(
        &self,
        addr: SocketAddr,
        since: Instant,
        within: Duration,
    ) -> (Duration, PageInfo) {
        let mut last = String::new();
        while since.elapsed() < within {
            match self.http_get(addr, Duration::from_millis(500)) {
                Ok(p) => return (since.elapsed(), p),
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "GET {addr} did not work within {within:?}: {last}\n{}",
            self.diagnostics()
        )
    }

    /// The manager's pods (admin client), any state.
    pub fn manager_pods(&self) -> Vec<Pod> {
        self.pods(MANAGER_NAMESPACE, MANAGER_SELECTOR)
    }

    /// The traffic manager's leases: the records of its Lease objects
    /// (coordination.k8s.io, one per tunnel IP, annotation `kvpn.dev/lease`),
    /// by IP; a record that does not parse is kept as a JSON string.
    pub fn stored_leases(&self) -> Vec<serde_json::Value> {
        use k8s_openapi::api::coordination::v1::Lease;
        let api: Api<Lease> = Api::namespaced(self.admin(), MANAGER_NAMESPACE);
        let lp = ListParams::default().labels(
            "app.kubernetes.io/name=kvpn-manager,app.kubernetes.io/component=tunnel-ip-lease",
        );
        let mut out: Vec<serde_json::Value> = self
            .block_on(api.list(&lp))
            .unwrap_or_else(|e| panic!("list Lease objects in {MANAGER_NAMESPACE}: {e}"))
            .items
            .into_iter()
            .filter_map(|l| l.metadata.annotations?.get("kvpn.dev/lease").cloned())
            .map(|text| serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)))
            .collect();
        out.sort_by_key(|r| r["ip"].as_str().unwrap_or_default().to_owned());
        out
    }

    /// Pods of `namespace` matching `selector` (admin client).
    pub fn pods(&self, namespace: &str, selector: &str) -> Vec<Pod> {
        let api: Api<Pod> = Api::namespaced(self.admin(), namespace);
        self.block_on(api.list(&ListParams::default().labels(selector)))
            .unwrap_or_else(|e| panic!("list pods {namespace} {selector}: {e}"))
            .items
    }

    /// Waits for a ready manager pod (Ready, not being deleted) for which `pred`
    /// holds; returns it.
    pub fn wait_manager_pod(&self, within: Duration, pred: impl Fn(&Pod) -> bool) -> Pod {
        let t0 = Instant::now();
        loop {
            if let Some(p) = self
                .manager_pods()
                .into_iter()
                .find(|p| pod_ready(p) && pred(p))
            {
                return p;
            }
            assert!(
                t0.elapsed() < within,
                "no matching ready manager pod within {within:?}: {:#?}",
                self.manager_pods()
                    .iter()
                    .map(|p| (p.metadata.name.clone(), p.status.clone()))
                    .collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The netns a running pod of this lab runs in, by the name the kubelet stand-in
    /// gives it (`kvpn-<lab id>-<role>`), so `Lab::spawn_in(role)` and the like
    /// work on both kinds of node. On real nodes a pod's netns is pinned inside its
    /// node's mount namespace (the CNI's `/var/run/netns` there): it gets that name
    /// in the host's `/run/netns` too (`ip netns attach` to its container's
    /// process), which the lab's teardown removes with its other netns (the pin
    /// only: the pod keeps its netns).
    pub fn pod_netns(&self, p: &Pod) -> Netns {
        let role = kvpn_lab::k8s::kubelet::spec::netns_role(
            p.metadata.name.as_deref().unwrap_or(""),
            p.metadata.uid.as_deref().unwrap_or(""),
        );
        let name = kvpn_lab::topology::netns_name(self.lab().netns_lab().id(), &role);
        let netns = Netns::from_name(&name);
        if self.lab().real_nodes().is_some() && !netns.exists() {
            let id = crate::real_node::container_id(p);
            let pid = crate::real_node::container_pids(&id)
                .into_iter()
                .next()
                .unwrap_or_else(|| {
                    panic!("no process in container {id} of pod {:?}", p.metadata.name)
                });
            let out = std::process::Command::new("ip")
                .args(["netns", "attach", &name, &pid.to_string()])
                .output()
                .unwrap_or_else(|e| panic!("ip netns attach {name} {pid}: {e}"));
            assert!(
                out.status.success(),
                "ip netns attach {name} {pid}: {}",
                text(&out.stderr)
            );
        }
        netns
    }

    /// The traffic manager's pid (`kvpn-manager`, not the node agents of preserve,
    /// the same program), waiting up to 10 s: on the stand-in node the process in
    /// one of the lab's pod netns, on real nodes the container's process (cgroup
    /// `/kvpn-<lab id>-n<i>/…`).
    pub fn manager_pid(&self) -> u32 {
        let id = self.lab().netns_lab().id().to_owned();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(pid) = kvpn_lab::lab_manager_pid(&id) {
                return pid;
            }
            assert!(
                Instant::now() < deadline,
                "no kvpn-manager process in lab {id} within 10 s"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Pids of the user daemons (`kvpn --runtime-dir <this fixture's> daemon`),
    /// sorted: one at most, whatever the number of sessions.
    pub fn user_daemon_pids(&self) -> Vec<u32> {
        user_daemon_pids_of(&self.runtime_dir)
    }

    /// The loopback listeners (`LISTEN` TCP sockets) of this fixture's user
    /// daemon: one per port-forward session (the address the root daemon dials).
    pub fn session_listeners(&self) -> Vec<String> {
        self.user_daemon_pids()
            .into_iter()
            .flat_map(|pid| self.tcp_sockets_of(pid))
            .filter(|s| s.state == "LISTEN")
            .map(|s| s.local)
            .collect()
    }

    /// Pids of processes running `kvpn agent` of this fixture (the per-session
    /// agents of before the user daemon): none ever.
    pub fn agent_pids(&self) -> Vec<u32> {
        pids_with_args(&self.runtime_dir, "agent")
    }

    /// TCP sockets of `pid` in the laptop netns, any state, as `ss` shows them.
    pub fn tcp_sockets_of(&self, pid: u32) -> Vec<TcpSocket> {
        let out = self.laptop(&["ss", "-Htanp"]);
        let needle = format!("pid={pid},");
        text(&out.stdout)
            .lines()
            .filter(|l| l.contains(&needle))
            .filter_map(|l| {
                // -H without a state filter: State Recv-Q Send-Q Local Peer Process.
                let cols: Vec<&str> = l.split_whitespace().collect();
                Some(TcpSocket {
                    state: (*cols.first()?).to_owned(),
                    local: (*cols.get(3)?).to_owned(),
                    peer: (*cols.get(4)?).to_owned(),
                })
            })
            .collect()
    }

    /// Number of open file descriptors of `pid`.
    pub fn fd_count(pid: u32) -> usize {
        std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
    }

    /// The TUN device `name` as the laptop's kernel sees it.
    pub fn tun_state(&self, name: &str) -> TunState {
        let addr = self.laptop(&["ip", "-j", "addr", "show", "dev", name]);
        assert!(
            addr.status.success(),
            "ip addr show dev {name}: {}",
            text(&addr.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&addr.stdout)
            .unwrap_or_else(|e| panic!("ip -j addr: {e}: {}", text(&addr.stdout)));
        let link = &v[0];
        let addresses = link["addr_info"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter(|i| i["family"] == "inet" || i["scope"] != "link")
                    .map(|i| format!("{}/{}", i["local"].as_str().unwrap_or(""), i["prefixlen"]))
                    .collect()
            })
            .unwrap_or_default();
        let routes = self.laptop(&["ip", "-j", "route", "show", "dev", name]);
        let r: serde_json::Value = serde_json::from_slice(&routes.stdout).unwrap_or_default();
        let mut routes: Vec<String> = r
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|r| r["dst"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        routes.sort();
        TunState {
            ifindex: link["ifindex"].as_u64().unwrap_or(0),
            addresses,
            routes,
        }
    }

    /// TUN devices in the laptop netns (names).
    pub fn tun_devices(&self) -> Vec<String> {
        let out = self.laptop(&["ip", "-j", "link", "show", "type", "tun"]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|l| l["ifname"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The laptop's IPv4 routes (`ip route` lines).
    pub fn laptop_routes(&self) -> Vec<String> {
        text(
            &self
                .laptop(&["ip", "-4", "route", "show", "table", "all"])
                .stdout,
        )
        .lines()
        .filter(|l| !l.starts_with("local ") && !l.starts_with("broadcast "))
        .map(str::to_owned)
        .collect()
    }

    /// The root daemons' and user daemons' logs (of every laptop), for failure
    /// messages.
    pub fn diagnostics(&self) -> String {
        let mut s = diagnostics_of(&self.runtime_dir);
        for l in &self.laptops {
            s.push_str(&l.diagnostics());
        }
        s
    }
}

impl Default for KubeFixture {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for KubeFixture {
    fn drop(&mut self) {
        if self.lab.is_none() {
            return;
        }
        // Sessions, user daemons and root daemons first; they live in the labs' netns.
        for l in &self.laptops {
            l.quit();
        }
        let quit = self.kvpn(&["quit"]);
        if !quit.status.success() {
            eprintln!("kvpn quit: {}{}", text(&quit.stdout), text(&quit.stderr));
        }
        kill_user_daemons_of(&self.runtime_dir);
        // Extra clusters before the first: their uplinks are in its laptop netns.
        let labs: Vec<K8sLab> = self
            .clusters
            .drain(..)
            .rev()
            .chain(self.lab.take())
            .collect();
        for lab in labs {
            let down = self
                .rt
                .block_on(async { tokio::task::spawn_blocking(move || lab.down()).await });
            match down {
                Ok(Ok(())) => {}
                Ok(Err(e)) => eprintln!("Kubernetes lab down: {e}"),
                Err(e) => eprintln!("Kubernetes lab down panicked: {e}"),
            }
        }
    }
}

/// The stdout of `kvpn <args>`, which must have succeeded; otherwise panics with
/// its output and `diagnostics()`.
pub fn kvpn_succeeded(args: &[&str], out: &Output, diagnostics: impl FnOnce() -> String) -> String {
    assert!(
        out.status.success(),
        "kvpn {args:?} failed ({}):\n{}\n{}\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr),
        diagnostics()
    );
    text(&out.stdout)
}

/// Pids of running processes whose command line has the argument `subcommand`
/// and an argument naming `runtime_dir` or a path inside it, sorted.
pub fn pids_with_args(runtime_dir: &Path, subcommand: &str) -> Vec<u32> {
    let dir = runtime_dir.to_string_lossy().into_owned();
    let mut pids: Vec<u32> = std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter(|pid| {
                    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                        return false;
                    };
                    let args: Vec<String> = cmdline
                        .split(|b| *b == 0)
                        .map(|a| String::from_utf8_lossy(a).into_owned())
                        .collect();
                    let running =
                        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                            s.rsplit_once(") ")
                                .and_then(|(_, r)| r.chars().next())
                                .is_some_and(|c| c != 'Z' && c != 'X')
                        });
                    running
                        && args.first().is_some_and(|a| a.ends_with("kvpn"))
                        && args.iter().any(|a| a == subcommand)
                        && args
                            .iter()
                            .any(|a| a == &dir || a.starts_with(&format!("{dir}/")))
                })
                .collect()
        })
        .unwrap_or_default();
    pids.sort_unstable();
    pids
}

/// Pids of the running user daemons (`kvpn --runtime-dir <runtime_dir> daemon`).
pub fn user_daemon_pids_of(runtime_dir: &Path) -> Vec<u32> {
    pids_with_args(runtime_dir, "daemon")
}

/// SIGKILL to every user daemon of `runtime_dir` still running (one that
/// outlived `kvpn quit`, e.g. after a test failed).
fn kill_user_daemons_of(runtime_dir: &Path) {
    for pid in user_daemon_pids_of(runtime_dir) {
        // SAFETY: kill with a pid found by its command line naming our folder.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
}

/// The root daemon's log and the user daemon's log of `runtime_dir`, for
/// failure messages.
/// The lab's web Service (ClusterIP and port), the target most tests reach.
/// Calls `attempt` every `every` until it returns `Ok`, and returns that; after
/// `within`, fails the test naming `what`, the last attempt's error and
/// `diagnostics()` (curl until 200, a daemon until it listens, …).
pub fn retry_until<T>(
    what: &str,
    within: Duration,
    every: Duration,
    mut attempt: impl FnMut() -> Result<T, String>,
    diagnostics: impl FnOnce() -> String,
) -> T {
    let t0 = Instant::now();
    loop {
        let last = match attempt() {
            Ok(v) => return v,
            Err(e) => e,
        };
        if t0.elapsed() >= within {
            panic!("{what} not within {within:?}: {last}\n{}", diagnostics());
        }
        std::thread::sleep(every);
    }
}

pub fn web() -> std::net::SocketAddr {
    std::net::SocketAddr::from((kvpn_lab::WEB_CLUSTER_IP, kvpn_lab::WEB_SERVICE_PORT))
}

pub fn diagnostics_of(runtime_dir: &Path) -> String {
    let mut s = String::new();
    for (what, file, n) in [
        ("root daemon", "dataplane.log", 40),
        ("user daemon", "user.log", 40),
    ] {
        let log = std::fs::read_to_string(runtime_dir.join(file)).unwrap_or_default();
        s.push_str(&format!(
            "--- {what} log {} (last {n} lines):\n",
            runtime_dir.join(file).display()
        ));
        s.push_str(&tail(&log, n));
    }
    s
}

/// Whether a pod is Ready and not being deleted.
pub fn pod_ready(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_none()
        && p.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// A pod's IP.
pub fn pod_ip(p: &Pod) -> IpAddr {
    p.status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .and_then(|ip| ip.parse().ok())
        .unwrap_or_else(|| panic!("pod {:?} has no pod IP", p.metadata.name))
}

/// A pod's name.
pub fn pod_name(p: &Pod) -> String {
    p.metadata.name.clone().unwrap_or_default()
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    let start = lines.len().saturating_sub(n);
    let mut out = lines[start..].join("\n");
    out.push('\n');
    out
}

// ---- residue: what kvpn must leave as it found (daemons_root.rs, soak.rs)

/// Program ids of kvpn's classifier attached (TCX egress) to the TUN devices of the
/// laptop netns. (This bpftool's `net show` does not list TCX links.)
pub fn classifier_prog_ids(f: &KubeFixture) -> Vec<u32> {
    let tuns = f.tun_devices();
    f.lab()
        .netns_lab()
        .run_in(LAPTOP, move || {
            tuns.iter()
                .flat_map(|t| {
                    kvpn_dataplane::ebpf::Classifier::attached_program_ids(t)
                        .unwrap_or_else(|e| panic!("query TCX of {t}: {e}"))
                })
                .collect()
        })
        .unwrap_or_else(|e| panic!("laptop netns: {e:#}"))
}

pub fn prog_exists(id: u32) -> bool {
    std::process::Command::new("bpftool")
        .args(["prog", "show", "id", &id.to_string()])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// kvpn's routes (protocol 107) in the laptop netns, both families.
pub fn kvpn_routes(f: &KubeFixture) -> String {
    let v4 = text(
        &f.laptop(&["ip", "route", "show", "table", "all", "proto", "107"])
            .stdout,
    );
    let v6 = text(
        &f.laptop(&["ip", "-6", "route", "show", "table", "all", "proto", "107"])
            .stdout,
    );
    format!("{v4}{v6}")
}

/// The nftables tables of the laptop netns (`nft list tables`).
pub fn nft_tables(f: &KubeFixture) -> String {
    text(&f.laptop(&["nft", "list", "tables"]).stdout)
}

/// What must be back to "before kvpn" after a sweep or a rollback.
#[derive(Debug, PartialEq, Eq)]
pub struct Residue {
    pub tuns: Vec<String>,
    pub routes: String,
    pub nft: String,
    pub resolv_conf: Vec<u8>,
    pub hosts: Vec<u8>,
    pub bpffs_kvpn: Vec<String>,
}

pub fn residue(f: &KubeFixture) -> Residue {
    Residue {
        tuns: f.tun_devices(),
        routes: kvpn_routes(f),
        nft: nft_tables(f),
        resolv_conf: std::fs::read(f.laptop_resolv_conf()).unwrap_or_default(),
        hosts: std::fs::read(f.laptop_hosts()).unwrap_or_default(),
        bpffs_kvpn: std::fs::read_dir("/sys/fs/bpf")
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.contains("kvpn"))
                    .collect()
            })
            .unwrap_or_default(),
    }
}

/// The lab API server's port on the node's uplink address.
pub const API_SERVER_PORT: u16 = 6443;

/// An nftables table in the laptop netns that drops all traffic between the
/// laptop and the API server (the port-forward's path: a silent black hole, no
/// RST, no FIN; cases tr-10 and the DNS fail-fast test); removed by
/// [`BlackHole::heal`] or on drop.
pub struct BlackHole<'a> {
    f: &'a KubeFixture,
    table: String,
    open: bool,
}

impl<'a> BlackHole<'a> {
    pub fn open(f: &'a KubeFixture) -> Self {
        let table = format!("kvpn_bh_{}", f.lab().netns_lab().id());
        let script = format!(
            "table inet {table} {{\n\
             \tchain output {{ type filter hook output priority -10; policy accept;\n\
             \t\tip daddr {} tcp dport {} counter drop\n\
             \t}}\n\
             \tchain input {{ type filter hook input priority -10; policy accept;\n\
             \t\tip saddr {} tcp sport {} counter drop\n\
             \t}}\n\
             }}\n",
            kvpn_lab::NODE_UPLINK_IP,
            API_SERVER_PORT,
            kvpn_lab::NODE_UPLINK_IP,
            API_SERVER_PORT
        );
        let path = f.lab().netns_lab().dir().join(format!("{table}.nft"));
        std::fs::write(&path, script).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        let out = f.laptop(&["nft", "-f", &path.to_string_lossy()]);
        assert!(out.status.success(), "nft -f: {}", text(&out.stderr));
        BlackHole {
            f,
            table,
            open: true,
        }
    }

    /// Packets the table dropped so far (both directions).
    pub fn dropped(&self) -> u64 {
        let out = self
            .f
            .laptop(&["nft", "list", "table", "inet", &self.table]);
        text(&out.stdout)
            .split("packets ")
            .skip(1)
            .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .sum()
    }

    pub fn heal(&mut self) {
        if self.open {
            let out = self
                .f
                .laptop(&["nft", "delete", "table", "inet", &self.table]);
            assert!(out.status.success(), "nft delete: {}", text(&out.stderr));
            self.open = false;
        }
    }
}

impl Drop for BlackHole<'_> {
    fn drop(&mut self) {
        if self.open {
            let _ = self
                .f
                .laptop(&["nft", "delete", "table", "inet", &self.table]);
        }
    }
}
