//! Starting and stopping one lab instance's control plane: certificates and
//! kubeconfigs written into the instance folder, then etcd, kube-apiserver and
//! kube-controller-manager spawned there in that order, each waited for with a
//! bound, and the restricted user's RBAC applied.
//!
//! Instance folder layout (`config.dir`):
//!
//! | path | what |
//! |---|---|
//! | `pki/` | `ca.crt/.key`, `apiserver.crt/.key`, `apiserver-kubelet-client.crt/.key`, `sa.key/.pub`, one `.crt/.key` per kubeconfig user |
//! | `admin.kubeconfig` | user `kvpn-lab-admin` in group `system:masters` |
//! | `kvpn-user.kubeconfig` | the restricted user (see [`super::rbac`]), namespace `kvpn-system` |
//! | `controller-manager.kubeconfig` | `system:kube-controller-manager` |
//! | `etcd-data/` | etcd's data dir |
//! | `etcd.log`, `kube-apiserver.log`, `kube-controller-manager.log` | process output |
//! | `control-plane.json` | address, ports and processes (pid + start time), for [`ControlPlane::stop_dir`] |
//!
//! Choices (and why):
//! - etcd speaks plain HTTP on the instance's own loopback address: only the
//!   apiserver talks to it, nothing leaves the host.
//! - Admission plugins: the apiserver's defaults, none disabled. The
//!   ServiceAccount plugin needs the token controller, so start-up waits until
//!   `default/default` has its token before returning.
//! - kube-controller-manager runs only deployment, replicaset, endpoint,
//!   endpointslice, serviceaccount, serviceaccount-token, namespace,
//!   garbagecollector, podgc and root-ca-cert-publisher (no cloud, node IPAM or
//!   node lifecycle controllers: the lab's kubelet stand-in owns nodes), with
//!   per-controller service-account credentials as in kubeadm, and serves no
//!   port (`--secure-port=0 --port=0`).
//! - The apiserver verifies kubelets' serving certificates against the lab CA
//!   (`--kubelet-certificate-authority`); the kubelet stand-in gets its serving
//!   certificate from [`ControlPlane::ca`].

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{Api, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde::{Deserialize, Serialize};

use super::kubeconfig::{self, KubeconfigSpec};
use super::pki::{self, CertSpec, CertificateAuthority};
use super::process::{self, Managed, ProcessRecord, Spawner};
use super::{
    Error, KUBERNETES_SERVICE_IP, KVPN_NAMESPACE, RESTRICTED_USER, SERVICE_CIDR, k8s_bin_dir, rbac,
};

const STATE_FILE: &str = "control-plane.json";
const ADMIN_USER: &str = "kvpn-lab-admin";
/// Kubernetes 1.20's dual-stack switch (alpha): Services get `ipFamilyPolicy`
/// and a second ClusterIP from the second service range.
const DUAL_STACK_GATE: &str = "--feature-gates=IPv6DualStack=true";

const CONTROLLERS: &str = "deployment,replicaset,endpoint,endpointslice,serviceaccount,\
serviceaccount-token,namespace,garbagecollector,podgc,root-ca-cert-publisher";
/// With real nodes: the node lifecycle controller (Ready/NotReady, the `not-ready`
/// taint), the TTL controller (node annotations the kubelet reads), and the
/// DaemonSet and StatefulSet controllers every cluster runs (kvpn's node agent
/// of `preserve` is a DaemonSet; `kvpn attach` targets both kinds).
const REAL_NODE_CONTROLLERS: &str = "nodelifecycle,ttl,daemonset,statefulset";
const BUILD_HINT: &str = "run scripts/build-kubernetes.sh (as root) to build and cache it";
const ETCD_HINT: &str = "install Debian's etcd-server (scripts/setup.sh does)";

/// How to start one control plane.
#[derive(Debug, Clone)]
pub struct ControlPlaneConfig {
    /// The instance folder (created; a previous stopped instance's files in it are replaced).
    pub dir: PathBuf,
    /// Unique instance name, e.g. `kvpn-lab-<id>`: CA name, cluster name, etcd member name.
    pub name: String,
    /// Loopback address every process listens on; None picks a random `127.x.y.z`.
    pub listen_ip: Option<Ipv4Addr>,
    /// The `kubernetes` Service's endpoint address (may not be loopback).
    pub advertise_ip: Ipv4Addr,
    /// `--service-cluster-ip-range`.
    pub service_cidr: String,
    /// The `kubernetes` Service's ClusterIP (the service CIDR's first address), named
    /// in the apiserver's serving certificate.
    pub kubernetes_service_ip: Ipv4Addr,
    /// Directory with kube-apiserver and kube-controller-manager.
    pub bin_dir: PathBuf,
    pub etcd: PathBuf,
    /// Bound for each start-up step (etcd healthy, apiserver ready, controllers working).
    pub step_timeout: Duration,
    /// How long a process gets between SIGTERM and SIGKILL.
    pub stop_grace: Duration,
    /// True: the processes die with this process (tests). False: they outlive it
    /// (`kvpn lab up`) and are stopped with [`ControlPlane::stop_dir`].
    pub tie_to_process: bool,
    /// More kube-apiserver flags, after the built-in ones (e.g. the lab's
    /// `--service-node-port-range`).
    pub apiserver_extra_args: Vec<String>,
    /// Dual stack: `--feature-gates=IPv6DualStack=true` on kube-apiserver and
    /// kube-controller-manager (alpha, off by default, in 1.20), for a
    /// `service_cidr` of two ranges ("<IPv4>,<IPv6>").
    pub dual_stack: bool,
    /// Real nodes ([`super::node`]): also run kube-scheduler and the node lifecycle
    /// controller (which lifts the `not-ready` taint the apiserver puts on new
    /// Nodes), and send the apiserver's cluster traffic (kubelets, pod proxy)
    /// through the HTTP CONNECT proxy on this unix socket (`--egress-selector-config-file`).
    pub real_nodes: Option<RealNodesControl>,
}

/// The control plane's part for real nodes (see [`ControlPlaneConfig::real_nodes`]).
#[derive(Debug, Clone)]
pub struct RealNodesControl {
    /// The unix socket of the lab's egress proxy ([`super::node::egress`]).
    pub egress_uds: PathBuf,
}

impl ControlPlaneConfig {
    /// Defaults: random loopback address, advertise `172.31.255.1` (the lab node's
    /// uplink address), service CIDR `10.96.0.0/12`, binaries from [`k8s_bin_dir`]
    /// and `/usr/bin/etcd`, 120 s per start-up step, 10 s stop grace, tied.
    pub fn new(dir: impl Into<PathBuf>, name: impl Into<String>) -> Self {
        ControlPlaneConfig {
            dir: dir.into(),
            name: name.into(),
            listen_ip: None,
            advertise_ip: Ipv4Addr::new(172, 31, 255, 1),
            service_cidr: SERVICE_CIDR.to_owned(),
            kubernetes_service_ip: KUBERNETES_SERVICE_IP,
            bin_dir: k8s_bin_dir(),
            etcd: PathBuf::from("/usr/bin/etcd"),
            step_timeout: Duration::from_secs(120),
            stop_grace: Duration::from_secs(10),
            tie_to_process: true,
            apiserver_extra_args: Vec::new(),
            dual_stack: false,
            real_nodes: None,
        }
    }
}

/// The ports the instance listens on (all on [`ControlPlane::listen_ip`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ports {
    pub etcd_client: u16,
    pub etcd_peer: u16,
    pub apiserver: u16,
}

#[derive(Debug, Serialize, Deserialize)]
struct State {
    name: String,
    listen_ip: Ipv4Addr,
    ports: Ports,
    processes: Vec<ProcessRecord>,
}

/// A running control plane. Dropping it stops it (unless detached).
#[derive(Debug)]
pub struct ControlPlane {
    config: ControlPlaneConfig,
    listen_ip: Ipv4Addr,
    ports: Ports,
    processes: Vec<Managed>,
    // Declared after `processes`: dropped after them, but stop() runs first anyway.
    spawner: Option<Spawner>,
    done: bool,
}

fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    // /dev/urandom always exists on Linux; on the impossible failure fall back to
    // the clock, which only makes collisions likelier, never wrong.
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_err()
    {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos() ^ std::process::id())
            .unwrap_or_else(|_| std::process::id());
        return nanos;
    }
    u32::from_le_bytes(b)
}

/// A random address in 127.100.0.1 – 127.199.255.254.
fn random_loopback() -> Ipv4Addr {
    let r = random_u32();
    // Each cast takes a value already reduced below 256.
    Ipv4Addr::new(
        127,
        100 + (r % 100) as u8,
        ((r >> 8) & 0xff) as u8,
        1 + ((r >> 16) % 254) as u8,
    )
}

/// `preferred` if free on `ip`, else a random free port in 20000–31999 (below the
/// kernel's ephemeral range, so outgoing connections never take it meanwhile).
fn pick_port(ip: Ipv4Addr, preferred: u16, taken: &[u16]) -> Result<u16, Error> {
    let free = |p: u16| !taken.contains(&p) && TcpListener::bind((ip, p)).is_ok();
    if free(preferred) {
        return Ok(preferred);
    }
    const TRIES: u32 = 64;
    for _ in 0..TRIES {
        // 20000 + (x % 12000) < 32000 fits u16.
        let p = 20000 + (random_u32() % 12000) as u16;
        if free(p) {
            return Ok(p);
        }
    }
    Err(Error::NoFreePort {
        ip: IpAddr::V4(ip),
        tries: TRIES,
    })
}

fn write_file(path: &Path, contents: &str, secret: bool) -> Result<(), Error> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::File::options()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(path)
        .map_err(Error::io(format!("writing {}", path.display())))?;
    f.write_all(contents.as_bytes())
        .map_err(Error::io(format!("writing {}", path.display())))
}

fn require_binary(name: &'static str, path: &Path, hint: &'static str) -> Result<(), Error> {
    if path.is_file() {
        Ok(())
    } else {
        Err(Error::MissingBinary {
            name,
            path: path.to_owned(),
            hint,
        })
    }
}

/// A kube client for a kubeconfig file.
pub async fn client_from_kubeconfig(path: &Path) -> Result<kube::Client, Error> {
    let kc = Kubeconfig::read_from(path).map_err(|e| Error::Kubeconfig {
        path: path.to_owned(),
        message: e.to_string(),
    })?;
    let cfg = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .map_err(|e| Error::Kubeconfig {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
    kube::Client::try_from(cfg).map_err(Error::kube(format!("client for {}", path.display())))
}

/// etcd's `/health` over plain HTTP/1.0.
fn etcd_healthy(addr: SocketAddr) -> Result<(), String> {
    let mut s =
        TcpStream::connect_timeout(&addr, Duration::from_secs(1)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(2)))
        .map_err(|e| e.to_string())?;
    s.write_all(b"GET /health HTTP/1.0\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).map_err(|e| e.to_string())?;
    if resp.contains("\"health\":\"true\"") {
        Ok(())
    } else {
        Err(format!(
            "/health answered: {}",
            resp.lines().last().unwrap_or("")
        ))
    }
}

impl ControlPlane {
    /// Starts etcd, kube-apiserver and kube-controller-manager and returns once
    /// the apiserver's `/readyz` is ok, the token controller has issued the
    /// `default` service account's token and the restricted user's RBAC is in
    /// force. On error everything started so far is stopped again.
    pub async fn start(config: ControlPlaneConfig) -> Result<Self, Error> {
        let apiserver_bin = config.bin_dir.join("kube-apiserver");
        let kcm_bin = config.bin_dir.join("kube-controller-manager");
        require_binary("kube-apiserver", &apiserver_bin, BUILD_HINT)?;
        require_binary("kube-controller-manager", &kcm_bin, BUILD_HINT)?;
        require_binary("etcd", &config.etcd, ETCD_HINT)?;

        let dir = &config.dir;
        std::fs::create_dir_all(dir).map_err(Error::io(format!("creating {}", dir.display())))?;
        if let Some(state) = read_state(dir)?
            && state.processes.iter().any(process::is_alive)
        {
            return Err(Error::State {
                path: dir.join(STATE_FILE),
                message: "a control plane from this folder is still running; stop it first".into(),
            });
        }
        for stale in [
            "etcd-data",
            "pki",
            "etcd.log",
            "kube-apiserver.log",
            "kube-controller-manager.log",
            "kube-scheduler.log",
        ] {
            let p = dir.join(stale);
            let r = if p.is_dir() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
            if let Err(e) = r
                && e.kind() != std::io::ErrorKind::NotFound
            {
                return Err(Error::io(format!("removing {}", p.display()))(e));
            }
        }

        let listen_ip = config.listen_ip.unwrap_or_else(random_loopback);
        let etcd_client = pick_port(listen_ip, 2379, &[])?;
        let etcd_peer = pick_port(listen_ip, 2380, &[etcd_client])?;
        let apiserver = pick_port(listen_ip, 6443, &[etcd_client, etcd_peer])?;
        let ports = Ports {
            etcd_client,
            etcd_peer,
            apiserver,
        };
        let spawner = if config.tie_to_process {
            Some(Spawner::new()?)
        } else {
            None
        };
        let mut cp = ControlPlane {
            config,
            listen_ip,
            ports,
            processes: Vec::new(),
            spawner,
            done: false,
        };
        // From here on, an early return drops `cp`, which stops what started.
        cp.write_pki_and_kubeconfigs()?;
        cp.start_etcd().await?;
        cp.start_apiserver(&apiserver_bin).await?;
        let admin = cp.admin_client().await?;
        cp.start_controller_manager(&kcm_bin, &admin).await?;
        if cp.config.real_nodes.is_some() {
            let bin = cp.config.bin_dir.join("kube-scheduler");
            require_binary("kube-scheduler", &bin, BUILD_HINT)?;
            cp.start_scheduler(&bin).await?;
        }
        cp.apply_rbac(&admin).await?;
        tracing::info!(
            name = %cp.config.name,
            server = %cp.server_url(),
            dir = %cp.config.dir.display(),
            "lab control plane ready"
        );
        Ok(cp)
    }

    fn pki(&self, file: &str) -> PathBuf {
        self.config.dir.join("pki").join(file)
    }

    fn ca_name(&self) -> String {
        format!("{} CA", self.config.name)
    }

    fn write_pki_and_kubeconfigs(&self) -> Result<(), Error> {
        let pki_dir = self.config.dir.join("pki");
        std::fs::create_dir_all(&pki_dir)
            .map_err(Error::io(format!("creating {}", pki_dir.display())))?;
        let ca = CertificateAuthority::generate(&self.ca_name())?;
        write_file(&self.pki("ca.crt"), ca.cert_pem(), false)?;
        write_file(&self.pki("ca.key"), &ca.key_pem(), true)?;

        let mut sans = vec![
            self.listen_ip.to_string(),
            "127.0.0.1".to_owned(),
            self.config.kubernetes_service_ip.to_string(),
            self.config.advertise_ip.to_string(),
            "localhost".to_owned(),
        ];
        sans.extend(
            [
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ]
            .map(str::to_owned),
        );
        let issued = [
            (
                "apiserver",
                ca.issue(&CertSpec::server("kube-apiserver", &sans))?,
            ),
            (
                "apiserver-kubelet-client",
                ca.issue(&CertSpec::client(
                    "kube-apiserver-kubelet-client",
                    &["system:masters"],
                ))?,
            ),
            (
                ADMIN_USER,
                ca.issue(&CertSpec::client(ADMIN_USER, &["system:masters"]))?,
            ),
            (
                "controller-manager",
                ca.issue(&CertSpec::client("system:kube-controller-manager", &[]))?,
            ),
            (
                RESTRICTED_USER,
                ca.issue(&CertSpec::client(RESTRICTED_USER, &[]))?,
            ),
            (
                "scheduler",
                ca.issue(&CertSpec::client("system:kube-scheduler", &[]))?,
            ),
        ];
        for (name, cert) in &issued {
            write_file(&self.pki(&format!("{name}.crt")), &cert.cert_pem, false)?;
            write_file(&self.pki(&format!("{name}.key")), &cert.key_pem, true)?;
        }
        let (sa_key, sa_pub) = pki::service_account_key_pair()?;
        write_file(&self.pki("sa.key"), &sa_key, true)?;
        write_file(&self.pki("sa.pub"), &sa_pub, false)?;

        let server = self.server_url();
        let ca_file = self.pki("ca.crt");
        for (file, cert_name, user, namespace) in [
            ("admin.kubeconfig", ADMIN_USER, ADMIN_USER, None),
            (
                "kvpn-user.kubeconfig",
                RESTRICTED_USER,
                RESTRICTED_USER,
                Some(KVPN_NAMESPACE),
            ),
            (
                "controller-manager.kubeconfig",
                "controller-manager",
                "system:kube-controller-manager",
                None,
            ),
            (
                "scheduler.kubeconfig",
                "scheduler",
                "system:kube-scheduler",
                None,
            ),
        ] {
            let text = kubeconfig::render(&KubeconfigSpec {
                cluster: &self.config.name,
                server: &server,
                ca_file: &ca_file,
                user,
                client_cert_file: &self.pki(&format!("{cert_name}.crt")),
                client_key_file: &self.pki(&format!("{cert_name}.key")),
                namespace,
            });
            // Holds paths to keys, not keys: still only for root.
            write_file(&self.config.dir.join(file), &text, true)?;
        }
        Ok(())
    }

    fn spawn(
        &mut self,
        name: &'static str,
        program: &Path,
        args: Vec<String>,
    ) -> Result<usize, Error> {
        let log = self.config.dir.join(format!("{name}.log"));
        tracing::debug!(name, program = %program.display(), ?args, "starting");
        let m = Managed::spawn(name, program, &args, &log, self.spawner.as_ref())?;
        self.processes.push(m);
        self.write_state()?;
        Ok(self.processes.len() - 1)
    }

    /// Err(Exited) with the log tail if process `idx` has ended.
    fn check_running(&mut self, idx: usize) -> Result<(), Error> {
        let p = &mut self.processes[idx];
        if let Some(status) = p.exited() {
            let name = static_name(&p.record.name);
            return Err(Error::Exited {
                name,
                status,
                log: p.record.log.clone(),
                log_tail: process::log_tail(&p.record.log, 40),
            });
        }
        Ok(())
    }

    fn not_ready(&self, idx: usize, after: Duration, last_error: String) -> Error {
        let p = &self.processes[idx];
        Error::NotReady {
            name: static_name(&p.record.name),
            after,
            last_error,
            log: p.record.log.clone(),
            log_tail: process::log_tail(&p.record.log, 40),
        }
    }

    async fn start_etcd(&mut self) -> Result<(), Error> {
        let ip = self.listen_ip;
        let Ports {
            etcd_client,
            etcd_peer,
            ..
        } = self.ports;
        let client_url = format!("http://{ip}:{etcd_client}");
        let peer_url = format!("http://{ip}:{etcd_peer}");
        let data = self.config.dir.join("etcd-data");
        let args = vec![
            format!("--name={}", self.config.name),
            format!("--data-dir={}", data.display()),
            format!("--listen-client-urls={client_url}"),
            format!("--advertise-client-urls={client_url}"),
            format!("--listen-peer-urls={peer_url}"),
            format!("--initial-advertise-peer-urls={peer_url}"),
            format!("--initial-cluster={}={peer_url}", self.config.name),
            "--initial-cluster-state=new".into(),
            format!("--initial-cluster-token={}", self.config.name),
            "--logger=zap".into(),
            "--log-outputs=stderr".into(),
        ];
        let etcd = self.config.etcd.clone();
        let idx = self.spawn("etcd", &etcd, args)?;
        let addr = SocketAddr::from((ip, etcd_client));
        let t0 = Instant::now();
        loop {
            self.check_running(idx)?;
            // Blocking, but bounded by 1 s connect + 2 s read.
            let r = tokio::task::spawn_blocking(move || etcd_healthy(addr))
                .await
                .unwrap_or_else(|e| Err(format!("health check task: {e}")));
            match r {
                Ok(()) => break,
                Err(e) if t0.elapsed() >= self.config.step_timeout => {
                    return Err(self.not_ready(idx, t0.elapsed(), e));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        tracing::debug!(elapsed = ?t0.elapsed(), "etcd healthy");
        Ok(())
    }

    async fn start_apiserver(&mut self, bin: &Path) -> Result<(), Error> {
        let ip = self.listen_ip;
        let p = |f: &str| self.pki(f).display().to_string();
        let mut args = vec![
            format!("--bind-address={ip}"),
            format!("--secure-port={}", self.ports.apiserver),
            format!("--advertise-address={}", self.config.advertise_ip),
            format!("--etcd-servers=http://{ip}:{}", self.ports.etcd_client),
            format!("--tls-cert-file={}", p("apiserver.crt")),
            format!("--tls-private-key-file={}", p("apiserver.key")),
            format!("--client-ca-file={}", p("ca.crt")),
            "--authorization-mode=Node,RBAC".into(),
            format!("--service-cluster-ip-range={}", self.config.service_cidr),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            format!("--service-account-signing-key-file={}", p("sa.key")),
            format!("--service-account-key-file={}", p("sa.pub")),
            format!(
                "--kubelet-client-certificate={}",
                p("apiserver-kubelet-client.crt")
            ),
            format!("--kubelet-client-key={}", p("apiserver-kubelet-client.key")),
            format!("--kubelet-certificate-authority={}", p("ca.crt")),
            "--kubelet-preferred-address-types=InternalIP".into(),
            "--allow-privileged=true".into(),
            "--profiling=false".into(),
            "--insecure-port=0".into(),
            // Only used if a cert were missing; keeps the apiserver out of /var/run.
            format!("--cert-dir={}", p("apiserver-generated")),
            "--v=1".into(),
        ];
        if self.config.dual_stack {
            args.push(DUAL_STACK_GATE.into());
        }
        if let Some(real) = &self.config.real_nodes {
            let file = self.config.dir.join("egress-selector.json");
            write_file(
                &file,
                &super::node::render::egress_selector_config(&real.egress_uds),
                false,
            )?;
            args.push(format!("--egress-selector-config-file={}", file.display()));
        }
        args.extend(self.config.apiserver_extra_args.iter().cloned());
        let idx = self.spawn("kube-apiserver", bin, args)?;
        let admin = self.admin_client().await?;
        let t0 = Instant::now();
        loop {
            self.check_running(idx)?;
            let req = ::http::Request::get("/readyz")
                .body(Vec::new())
                .map_err(|e| Error::State {
                    path: self.config.dir.clone(),
                    message: format!("building GET /readyz: {e}"),
                })?;
            let last_error =
                match tokio::time::timeout(Duration::from_secs(5), admin.request_text(req)).await {
                    Ok(Ok(body)) if body.trim() == "ok" => break,
                    Ok(Ok(body)) => format!("/readyz answered {body:?}"),
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => "GET /readyz timed out after 5 s".to_owned(),
                };
            if t0.elapsed() >= self.config.step_timeout {
                return Err(self.not_ready(idx, t0.elapsed(), last_error));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        tracing::debug!(elapsed = ?t0.elapsed(), "kube-apiserver ready");
        Ok(())
    }

    async fn start_controller_manager(
        &mut self,
        bin: &Path,
        admin: &kube::Client,
    ) -> Result<(), Error> {
        let p = |f: &str| self.pki(f).display().to_string();
        let controllers = if self.config.real_nodes.is_some() {
            format!("{CONTROLLERS},{REAL_NODE_CONTROLLERS}")
        } else {
            CONTROLLERS.to_owned()
        };
        let mut args = vec![
            format!(
                "--kubeconfig={}",
                self.config
                    .dir
                    .join("controller-manager.kubeconfig")
                    .display()
            ),
            "--leader-elect=false".into(),
            format!("--controllers={controllers}"),
            "--use-service-account-credentials=true".into(),
            format!("--service-account-private-key-file={}", p("sa.key")),
            format!("--root-ca-file={}", p("ca.crt")),
            format!("--cluster-name={}", self.config.name),
            "--secure-port=0".into(),
            "--port=0".into(),
            "--v=1".into(),
        ];
        if self.config.dual_stack {
            // The EndpointSlice controller then writes one slice per family.
            args.push(DUAL_STACK_GATE.into());
        }
        let idx = self.spawn("kube-controller-manager", bin, args)?;
        // Working controllers: the serviceaccount controller made `default`, the
        // token controller gave it a token (pods need both to be admitted).
        let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), "default");
        let t0 = Instant::now();
        loop {
            self.check_running(idx)?;
            let last_error = match sas.get_opt("default").await {
                Ok(Some(sa)) if sa.secrets.as_ref().is_some_and(|s| !s.is_empty()) => break,
                Ok(Some(_)) => "service account default/default has no token yet".to_owned(),
                Ok(None) => "service account default/default not created yet".to_owned(),
                Err(e) => e.to_string(),
            };
            if t0.elapsed() >= self.config.step_timeout {
                return Err(self.not_ready(idx, t0.elapsed(), last_error));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        tracing::debug!(elapsed = ?t0.elapsed(), "kube-controller-manager working");
        Ok(())
    }

    /// kube-scheduler without leader election and without serving ports. It has no
    /// readiness signal of its own: it counts as started when it is still running
    /// after its first second (placing a pod is the real check).
    async fn start_scheduler(&mut self, bin: &Path) -> Result<(), Error> {
        let kubeconfig = self.config.dir.join("scheduler.kubeconfig");
        let args = vec![
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--authentication-kubeconfig={}", kubeconfig.display()),
            format!("--authorization-kubeconfig={}", kubeconfig.display()),
            "--leader-elect=false".into(),
            "--port=0".into(),
            "--secure-port=0".into(),
            "--v=1".into(),
        ];
        let idx = self.spawn("kube-scheduler", bin, args)?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        self.check_running(idx)?;
        Ok(())
    }

    async fn apply_rbac(&mut self, admin: &kube::Client) -> Result<(), Error> {
        rbac::apply(admin).await?;
        // The RBAC authorizer works from a cache: wait until it grants the user.
        let user = self.user_client().await?;
        let reviews: Api<SelfSubjectAccessReview> = Api::all(user);
        let review = SelfSubjectAccessReview {
            spec: SelfSubjectAccessReviewSpec {
                resource_attributes: Some(ResourceAttributes {
                    namespace: Some(KVPN_NAMESPACE.into()),
                    verb: Some("create".into()),
                    resource: Some("deployments".into()),
                    group: Some("apps".into()),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let t0 = Instant::now();
        loop {
            let last_error = match reviews.create(&PostParams::default(), &review).await {
                Ok(r) if r.status.as_ref().is_some_and(|s| s.allowed) => break,
                Ok(_) => "not allowed yet".to_owned(),
                Err(e) => e.to_string(),
            };
            if t0.elapsed() >= self.config.step_timeout {
                return Err(Error::State {
                    path: self.config.dir.clone(),
                    message: format!(
                        "{RESTRICTED_USER} still may not create deployments in {KVPN_NAMESPACE} after {:?}: {last_error}",
                        t0.elapsed()
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }

    fn write_state(&self) -> Result<(), Error> {
        let state = State {
            name: self.config.name.clone(),
            listen_ip: self.listen_ip,
            ports: self.ports,
            processes: self.processes.iter().map(|m| m.record.clone()).collect(),
        };
        let path = self.config.dir.join(STATE_FILE);
        let text = serde_json::to_string_pretty(&state).map_err(|e| Error::State {
            path: path.clone(),
            message: e.to_string(),
        })?;
        write_file(&path, &text, false)
    }

    /// The loopback address every process listens on.
    pub fn listen_ip(&self) -> Ipv4Addr {
        self.listen_ip
    }

    pub fn ports(&self) -> Ports {
        self.ports
    }

    /// Every listening address of this instance.
    pub fn listen_addrs(&self) -> Vec<SocketAddr> {
        let ip = self.listen_ip;
        [
            self.ports.etcd_client,
            self.ports.etcd_peer,
            self.ports.apiserver,
        ]
        .iter()
        .map(|p| SocketAddr::from((ip, *p)))
        .collect()
    }

    /// `https://<listen ip>:<apiserver port>`
    pub fn server_url(&self) -> String {
        format!("https://{}:{}", self.listen_ip, self.ports.apiserver)
    }

    pub fn dir(&self) -> &Path {
        &self.config.dir
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// Kubeconfig of `kvpn-lab-admin` (group `system:masters`).
    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.config.dir.join("admin.kubeconfig")
    }

    /// Kubeconfig of the restricted user `kvpn-user` (see [`super::rbac`]).
    pub fn user_kubeconfig(&self) -> PathBuf {
        self.config.dir.join("kvpn-user.kubeconfig")
    }

    /// The lab CA's certificate file (trust anchor for the apiserver and kubelets).
    pub fn ca_file(&self) -> PathBuf {
        self.pki("ca.crt")
    }

    pub async fn admin_client(&self) -> Result<kube::Client, Error> {
        client_from_kubeconfig(&self.admin_kubeconfig()).await
    }

    pub async fn user_client(&self) -> Result<kube::Client, Error> {
        client_from_kubeconfig(&self.user_kubeconfig()).await
    }

    /// The lab CA, to issue more certificates (e.g. the kubelet stand-in's serving
    /// certificate, which the apiserver verifies).
    pub fn ca(&self) -> Result<CertificateAuthority, Error> {
        let read = |f: &str| {
            let path = self.pki(f);
            std::fs::read_to_string(&path).map_err(Error::io(format!("reading {}", path.display())))
        };
        Ok(CertificateAuthority::load(
            &self.ca_name(),
            &read("ca.crt")?,
            &read("ca.key")?,
        )?)
    }

    /// The processes (etcd, kube-apiserver, kube-controller-manager) as recorded.
    pub fn processes(&self) -> Vec<ProcessRecord> {
        self.processes.iter().map(|m| m.record.clone()).collect()
    }

    /// The log file of `name` (`etcd`, `kube-apiserver`, `kube-controller-manager`).
    pub fn log_path(&self, name: &str) -> PathBuf {
        self.config.dir.join(format!("{name}.log"))
    }

    fn stop_inner(&mut self) -> Result<(), Error> {
        self.done = true;
        let grace = self.config.stop_grace;
        let mut first_err = None;
        // Reverse start order: controllers, then the apiserver, then etcd.
        for m in self.processes.iter_mut().rev() {
            if let Err(e) = m.stop(grace) {
                tracing::error!(error = %e, "stopping the lab control plane");
                first_err.get_or_insert(e);
            }
        }
        drop(self.spawner.take());
        if let Some(e) = first_err {
            return Err(e);
        }
        let state = self.config.dir.join(STATE_FILE);
        match std::fs::remove_file(&state) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(Error::io(format!("removing {}", state.display()))(e))
            }
            _ => Ok(()),
        }
    }

    /// Stops every process (SIGTERM, SIGKILL after `stop_grace`) and waits until
    /// each is gone. Blocks for at most `stop_grace + 5 s` per process. The
    /// instance folder (logs, certificates) stays.
    pub fn stop(mut self) -> Result<(), Error> {
        self.stop_inner()
    }

    /// Leaves the processes running and returns the instance folder, for
    /// [`ControlPlane::stop_dir`] later. Only for untied control planes
    /// (`tie_to_process = false`); tied ones are stopped and an error returned.
    pub fn detach(mut self) -> Result<PathBuf, Error> {
        if self.spawner.is_some() {
            self.stop_inner()?;
            return Err(Error::State {
                path: self.config.dir.clone(),
                message:
                    "detach needs tie_to_process = false (tied processes die with this process)"
                        .into(),
            });
        }
        self.done = true;
        Ok(self.config.dir.clone())
    }

    /// Stops the control plane recorded in `dir` (started by another process,
    /// e.g. `kvpn lab up`). Returns false when nothing was recorded there.
    pub fn stop_dir(dir: &Path, grace: Duration) -> Result<bool, Error> {
        let Some(state) = read_state(dir)? else {
            return Ok(false);
        };
        for record in state.processes.into_iter().rev() {
            Managed::from_record(record).stop(grace)?;
        }
        let path = dir.join(STATE_FILE);
        std::fs::remove_file(&path).map_err(Error::io(format!("removing {}", path.display())))?;
        Ok(true)
    }
}

fn read_state(dir: &Path) -> Result<Option<State>, Error> {
    let path = dir.join(STATE_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(format!("reading {}", path.display()))(e)),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::State {
            path,
            message: e.to_string(),
        })
}

/// The process names used here, as `&'static str` for error values.
fn static_name(name: &str) -> &'static str {
    match name {
        "etcd" => "etcd",
        "kube-apiserver" => "kube-apiserver",
        "kube-controller-manager" => "kube-controller-manager",
        "kube-scheduler" => "kube-scheduler",
        _ => "a control-plane process",
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if !self.done
            && let Err(e) = self.stop_inner()
        {
            tracing::error!(error = %e, dir = %self.config.dir.display(), "stopping the lab control plane on drop");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_loopback_stays_in_its_range() {
        for _ in 0..1000 {
            let o = random_loopback().octets();
            assert_eq!(o[0], 127);
            assert!((100..200).contains(&o[1]), "{o:?}");
            assert!((1..255).contains(&o[3]), "{o:?}");
        }
    }

    #[test]
    fn pick_port_avoids_a_taken_port() {
        let ip = random_loopback();
        let held = TcpListener::bind((ip, 0)).expect("bind");
        let busy = held.local_addr().expect("addr").port();
        let p = pick_port(ip, busy, &[]).expect("port");
        assert_ne!(p, busy);
        assert!((20000..32000).contains(&p));
        let q = pick_port(ip, p, &[p]).expect("port");
        assert_ne!(q, p);
    }
}
