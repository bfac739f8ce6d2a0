//! [`Lab`]: one cluster-in-a-box instance with the static topology of the shared brief
//! (laptop, node, pods `manager`, `backend-1`, `backend-2`, ClusterIPs `web`, `echo`,
//! `udp-echo`, the manager's NodePort-like forward), its processes and its lifecycle.
//!
//! Lifecycle: [`Lab::up`] builds everything under a fresh id; [`Lab::down`] (or drop)
//! stops the processes, deletes every `kvpn-<id>-*` netns (which deletes their veths,
//! the bridge and the nftables table), the state file and, unless asked to keep it,
//! the lab folder. A persistent lab ([`LabOptions::persist_as`], what `kvpn lab up`
//! uses) is recorded in `$KVPN_LAB_STATE_DIR/<name>.json` (default `/run/kvpn-lab`, a
//! tmpfs, so a reboot forgets it together with the netns); [`Lab::detach`] leaves it
//! running when this process exits, and [`down_named`] in another process tears it
//! down.
//!
//! I/O: everything in [`crate::netns`], [`crate::process`], [`crate::nft::apply`], the
//! lab folder and the state file.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use crate::netns::{Netns, lab_netns};
use crate::nft::{self, NodePort, Protocol, Service};
use crate::process::{Process, ProcessRecord, log_tail};
use crate::topology::{Addressing, Node, Pod, Uplink, netns_name};
use crate::{
    BACKEND_1_IP, BACKEND_1_POD, BACKEND_2_IP, BACKEND_2_POD, ECHO_CLUSTER_IP, ECHO_PORT,
    ECHO_SERVICE_PORT, HTTP_PORT, LAPTOP, LAPTOP_UPLINK_IP, LabError, MANAGER_POD, MANAGER_POD_IP,
    MANAGER_PORT, NFT_TABLE, NODE, NODE_POD_CIDR, NODE_UPLINK_IP, Result, UDP_ECHO_CLUSTER_IP,
    UPLINK_PREFIX_LEN, WEB_CLUSTER_IP, WEB_SERVICE_PORT, bin_path,
};

/// Name of the persistent lab that `kvpn lab up` / `kvpn lab down` manage when no name
/// is given.
pub const DEFAULT_LAB_NAME: &str = "kvpn-lab";

/// Version of the state file layout; a file with another version is refused.
const STATE_VERSION: u32 = 1;

/// How long teardown waits after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(3);

/// What runs in the manager pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ManagerProcess {
    /// Nothing: the pod exists, port 10801 is closed.
    None,
    /// `kvpn-manager --listen 0.0.0.0:10801 <extra_args>`, found with [`bin_path`].
    Kvpn { extra_args: Vec<String> },
    /// Any program that listens on TCP :10801 (tests without the real manager).
    Command { program: PathBuf, args: Vec<String> },
}

/// Options of [`Lab::up`]. `LabOptions::default()` starts the real manager, both
/// backends, logs to `$TMPDIR/kvpn-lab-<id>` removed on down, and is not persistent.
#[derive(Debug, Clone)]
pub struct LabOptions {
    pub manager: ManagerProcess,
    /// Start `kvpn-lab-server` in the backend pods.
    pub backends: bool,
    /// Parent of the lab folder `kvpn-lab-<id>` (logs, scratch files). Default: the
    /// system temp dir.
    pub dir_root: Option<PathBuf>,
    /// Keep the lab folder on down. It is kept anyway when the lab is dropped during a
    /// panic, so a failing test leaves its logs.
    pub keep_dir: bool,
    /// Record the lab under this name for [`Lab::attach`] / [`down_named`]; `up` fails
    /// with [`LabError::AlreadyUp`] while a lab of that name is up.
    pub persist_as: Option<String>,
    /// How long each pod process may take to answer on its port.
    pub ready_timeout: Duration,
    /// Extra environment for every pod process (on top of this process's environment
    /// and `POD_NAME`, `POD_IP`).
    pub pod_env: Vec<(String, String)>,
    /// The static pods (`manager`, `backend-1`, `backend-2`), ClusterIPs and the
    /// manager's NodePort-like forward. False: only the laptop, the node, its bridge and
    /// the uplink — what the Kubernetes lab ([`crate::k8s::cluster`]) builds on, whose
    /// kubelet and kube-proxy stand-ins create pods and rules from the API.
    pub static_workloads: bool,
    /// The address plan (pod range of the node, uplink). The static workloads need
    /// the default plan.
    pub addressing: Addressing,
    /// Put this lab's uplink into an existing laptop netns (another lab's) instead of
    /// a laptop netns of its own: one laptop on two clusters. The lab then owns only
    /// its uplink veth there (`kv<id>lp`), removed on down; the netns stays.
    pub laptop: Option<Netns>,
}

impl Default for LabOptions {
    fn default() -> Self {
        LabOptions {
            manager: ManagerProcess::Kvpn {
                extra_args: Vec::new(),
            },
            backends: true,
            dir_root: None,
            keep_dir: false,
            persist_as: None,
            ready_timeout: Duration::from_secs(10),
            pod_env: Vec::new(),
            static_workloads: true,
            addressing: Addressing::default(),
            laptop: None,
        }
    }
}

impl LabOptions {
    /// Leave the manager pod empty.
    pub fn without_manager(mut self) -> Self {
        self.manager = ManagerProcess::None;
        self
    }

    pub fn manager(mut self, manager: ManagerProcess) -> Self {
        self.manager = manager;
        self
    }

    pub fn persist_as(mut self, name: &str) -> Self {
        self.persist_as = Some(name.to_owned());
        self
    }

    pub fn dir_root(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dir_root = Some(dir.into());
        self
    }

    pub fn keep_dir(mut self, keep: bool) -> Self {
        self.keep_dir = keep;
        self
    }

    /// Only the topology (laptop, node, bridge, uplink): no static pods, ClusterIPs or
    /// NodePort (see [`LabOptions::static_workloads`]).
    pub fn topology_only(mut self) -> Self {
        self.static_workloads = false;
        self.manager = ManagerProcess::None;
        self.backends = false;
        self
    }

    pub fn pod_env(mut self, key: &str, value: &str) -> Self {
        self.pod_env.push((key.to_owned(), value.to_owned()));
        self
    }

    /// See [`LabOptions::addressing`].
    pub fn addressing(mut self, addressing: Addressing) -> Self {
        self.addressing = addressing;
        self
    }

    /// See [`LabOptions::laptop`]: the uplink goes into `laptop`, an existing netns.
    pub fn attach_laptop(mut self, laptop: Netns) -> Self {
        self.laptop = Some(laptop);
        self
    }
}

/// A laptop netns added to a lab with [`Lab::add_laptop`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtraLaptop {
    /// The role (`kvpn-<id>-<role>` is the netns name).
    pub role: String,
    pub netns: Netns,
    pub uplink: Uplink,
}

/// A process of the lab, as [`Lab::processes`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessInfo {
    pub name: String,
    pub netns: String,
    pub pid: u32,
    pub log: PathBuf,
    pub cmdline: String,
    pub alive: bool,
}

/// One lab instance. Dropping a lab made by [`Lab::up`] tears it down (see
/// [`Lab::down`]); a lab from [`Lab::attach`] or after [`Lab::detach`] is left running.
#[derive(Debug)]
pub struct Lab {
    name: String,
    id: String,
    dir: PathBuf,
    laptop: Netns,
    node: Node,
    uplink: Uplink,
    pods: Vec<Pod>,
    services: Vec<Service>,
    node_ports: Vec<NodePort>,
    processes: Mutex<Vec<Process>>,
    persist_as: Option<String>,
    keep_dir: bool,
    manager_desc: String,
    /// What [`Lab::restart_manager`] starts again: the options the manager pod's
    /// process was started with (`None` for an attached lab or one without a manager).
    manager_options: Option<LabOptions>,
    static_workloads: bool,
    addressing: Addressing,
    /// False when the laptop netns is another lab's ([`LabOptions::laptop`]).
    own_laptop: bool,
    extra_laptops: Vec<ExtraLaptop>,
    teardown_on_drop: bool,
    down: bool,
}

/// The persistent lab's record.
#[derive(Debug, Serialize, Deserialize)]
struct LabState {
    version: u32,
    name: String,
    id: String,
    dir: PathBuf,
    keep_dir: bool,
    pods: Vec<(String, Ipv4Addr)>,
    processes: Vec<ProcessRecord>,
    manager: String,
    /// Absent in files of older versions, which always had the static workloads.
    #[serde(default = "yes")]
    static_workloads: bool,
    /// Absent in older files, which always had the default plan.
    #[serde(default)]
    addressing: Addressing,
    /// The netns of another lab this lab's uplink lives in, if any.
    #[serde(default)]
    foreign_laptop: Option<String>,
}

fn yes() -> bool {
    true
}

/// The ClusterIPs of the static lab, balanced over both backends.
pub fn lab_services() -> Vec<Service> {
    let backends = vec![BACKEND_1_IP, BACKEND_2_IP];
    vec![
        Service {
            name: "web".into(),
            cluster_ip: WEB_CLUSTER_IP,
            port: WEB_SERVICE_PORT,
            protocol: Protocol::Tcp,
            target_port: HTTP_PORT,
            endpoints: backends.clone(),
        },
        Service {
            name: "echo".into(),
            cluster_ip: ECHO_CLUSTER_IP,
            port: ECHO_SERVICE_PORT,
            protocol: Protocol::Tcp,
            target_port: ECHO_PORT,
            endpoints: backends.clone(),
        },
        Service {
            name: "udp-echo".into(),
            cluster_ip: UDP_ECHO_CLUSTER_IP,
            port: ECHO_SERVICE_PORT,
            protocol: Protocol::Udp,
            target_port: ECHO_PORT,
            endpoints: backends,
        },
    ]
}

/// The manager's NodePort-like forward from the node's uplink address.
pub fn lab_node_ports() -> Vec<NodePort> {
    vec![NodePort {
        name: "manager".into(),
        node_ip: NODE_UPLINK_IP,
        port: MANAGER_PORT,
        protocol: Protocol::Tcp,
        pod_ip: MANAGER_POD_IP,
        target_port: MANAGER_PORT,
    }]
}

/// Directory of persistent lab state files: `$KVPN_LAB_STATE_DIR`, default
/// `/run/kvpn-lab`.
pub fn state_dir() -> PathBuf {
    std::env::var_os("KVPN_LAB_STATE_DIR")
        .map_or_else(|| PathBuf::from("/run/kvpn-lab"), PathBuf::from)
}

/// State file of the persistent lab `name`.
pub fn state_path(name: &str) -> PathBuf {
    state_dir().join(format!("{name}.json"))
}

/// Tears down the persistent lab `name` (from any process). `Ok(false)` if no lab of
/// that name is recorded.
pub fn down_named(name: &str) -> Result<bool> {
    match Lab::attach(name) {
        Ok(mut lab) => lab.down().map(|()| true),
        Err(LabError::NotUp { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

/// The laptop netns's `/etc/resolv.conf` until a test writes its own: a nameserver
/// on the laptop's loopback (none runs there unless a test starts one).
pub const LAPTOP_RESOLV_CONF: &str = "# kvpn lab laptop: ip netns exec binds /etc/netns/<laptop netns>/resolv.conf here\nnameserver 127.0.0.1\n";

/// The file name, in `/etc/netns/<laptop netns>/`, of the laptop netns's own hosts
/// file: `ip netns exec` binds it over /etc/hosts, and `kvpn lab exec laptop` names it
/// in `KVPN_HOSTS`, so `kvpn connect --hosts` in the lab edits it, never this
/// machine's /etc/hosts.
pub const LAPTOP_HOSTS_FILE: &str = "hosts";

/// What a lab laptop's hosts file starts as: this machine's /etc/hosts (read, never
/// written), so names it resolves (localhost, the machine's own name) resolve in the
/// laptop netns as before; a localhost-only file when it cannot be read.
pub fn laptop_hosts_content() -> Vec<u8> {
    std::fs::read("/etc/hosts").unwrap_or_else(|_| {
        b"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n".to_vec()
    })
}

/// Writes the laptop netns's own hosts file ([`LAPTOP_HOSTS_FILE`]) unless it has one
/// and `overwrite` is false (a laptop another lab made keeps its file, and any kvpn
/// block in it).
pub fn write_laptop_hosts(laptop: &Netns, overwrite: bool) -> Result<()> {
    if overwrite || !laptop.etc_dir().join(LAPTOP_HOSTS_FILE).exists() {
        laptop.write_etc_file(LAPTOP_HOSTS_FILE, &laptop_hosts_content())?;
    }
    Ok(())
}

impl Lab {
    /// Builds a lab: netns, bridge, pods, uplink, nftables, processes; waits until each
    /// started process answers on its port (bounded by `ready_timeout`). On any error
    /// everything built so far is torn down before returning.
    pub fn up(options: LabOptions) -> Result<Lab> {
        crate::require_root()?;
        let started = Instant::now();
        if let Some(name) = &options.persist_as {
            validate_lab_name(name)?;
            match Lab::attach(name) {
                Ok(mut old) if old.node.netns().exists() => {
                    old.teardown_on_drop = false;
                    return Err(LabError::AlreadyUp {
                        name: name.clone(),
                        path: state_path(name),
                    });
                }
                // A record without its netns (e.g. a crashed `up`): clean what is left.
                Ok(mut stale) => stale.down()?,
                Err(LabError::NotUp { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        let addressing = options.addressing;
        addressing.validate()?;
        if options.static_workloads && addressing != Addressing::default() {
            return Err(LabError::Invalid {
                what: "lab options",
                value: format!("{addressing:?}"),
                why: "the static workloads use the default addressing; use the Kubernetes lab for another plan",
            });
        }
        if let Some(foreign) = &options.laptop {
            check_foreign_laptop(foreign, &addressing)?;
        }
        // The id is claimed with the first netns of the lab: its laptop, or its node
        // when the laptop is another lab's.
        let claim_role = if options.laptop.is_some() {
            NODE
        } else {
            LAPTOP
        };
        let (id, claimed) = claim_id(claim_role)?;
        let own_laptop = options.laptop.is_none();
        let laptop = options.laptop.clone().unwrap_or(claimed);
        let dir = options
            .dir_root
            .clone()
            .unwrap_or_else(std::env::temp_dir)
            .join(format!("kvpn-lab-{id}"));
        let node = Node::existing(&id, NODE, addressing.node_pod_cidr)
            .with_ipv6(addressing.ipv6.map(|v6| v6.node_pod_cidr));
        let uplink = node.uplink(
            addressing.laptop_uplink_ip(),
            addressing.node_uplink_ip(),
            UPLINK_PREFIX_LEN,
        );
        // From here on the lab tears itself down on error (drop).
        let mut lab = Lab {
            name: options
                .persist_as
                .clone()
                .unwrap_or_else(|| format!("kvpn-{id}")),
            id: id.clone(),
            dir,
            laptop,
            node,
            uplink,
            pods: Vec::new(),
            services: if options.static_workloads {
                lab_services()
            } else {
                Vec::new()
            },
            node_ports: if options.static_workloads {
                lab_node_ports()
            } else {
                Vec::new()
            },
            processes: Mutex::new(Vec::new()),
            persist_as: options.persist_as.clone(),
            keep_dir: options.keep_dir,
            manager_desc: String::new(),
            manager_options: None,
            static_workloads: options.static_workloads,
            addressing,
            own_laptop,
            extra_laptops: Vec::new(),
            teardown_on_drop: true,
            down: false,
        };
        write_owner(&lab.id, &lab.dir)?;
        lab.build(&options)?;
        if lab.persist_as.is_some() {
            lab.write_state()?;
        }
        tracing::info!(id = %lab.id, name = %lab.name, elapsed_ms = started.elapsed().as_millis(), "lab up");
        Ok(lab)
    }

    fn build(&mut self, options: &LabOptions) -> Result<()> {
        std::fs::create_dir_all(&self.dir).map_err(|source| LabError::Io {
            what: format!("cannot create lab folder {}", self.dir.display()),
            source,
        })?;
        let node = Node::existing(&self.id, NODE, self.addressing.node_pod_cidr)
            .with_ipv6(self.addressing.ipv6.map(|v6| v6.node_pod_cidr));
        self.node = if self.own_laptop {
            node.create_netns()?
        } else {
            // The node netns is the id's claim (see `up`).
            node.plumb_existing_netns()?
        };
        self.uplink = self.node.connect_laptop(
            &self.laptop,
            self.addressing.node_uplink_ip(),
            self.addressing.laptop_uplink_ip(),
            UPLINK_PREFIX_LEN,
        )?;
        // Like a real node (whose default route covers it), the node reaches the
        // service CIDR: its own connections to ClusterIPs — a node's sshd dialling
        // the manager Service for the SSH data-plane bypass — need a route before
        // the kube-proxy-like DNAT in the output hook rewrites them.
        self.node.netns().ip(&[
            "route",
            "add",
            &self.addressing.service_cidr.to_string(),
            "dev",
            self.node.bridge(),
        ])?;
        // The laptop's own resolv.conf: programs in the laptop netns run through `ip
        // netns exec`, which binds it over /etc/resolv.conf, so nothing kvpn does to
        // the laptop's DNS can reach this machine's real /etc/resolv.conf.
        self.laptop
            .write_etc_file("resolv.conf", LAPTOP_RESOLV_CONF.as_bytes())?;
        // Likewise its own hosts file, for `kvpn connect --hosts` (`kvpn lab exec
        // laptop` points KVPN_HOSTS at it too).
        write_laptop_hosts(&self.laptop, self.own_laptop)?;
        if !options.static_workloads {
            self.manager_desc = "no static pods (Kubernetes lab: see the kubelet stand-in)".into();
            return Ok(());
        }
        for (name, ip) in [
            (MANAGER_POD, MANAGER_POD_IP),
            (BACKEND_1_POD, BACKEND_1_IP),
            (BACKEND_2_POD, BACKEND_2_IP),
        ] {
            let pod = self.node.add_pod(name, ip)?;
            self.pods.push(pod);
        }
        nft::apply(
            self.node.netns(),
            &nft::render_ruleset(NFT_TABLE, &self.services, &self.node_ports),
        )?;

        let mut waits: Vec<(String, Vec<SocketAddrV4>)> = Vec::new();
        if options.backends {
            let server = bin_path("kvpn-lab-server")?;
            for (pod, ip) in [(BACKEND_1_POD, BACKEND_1_IP), (BACKEND_2_POD, BACKEND_2_IP)] {
                let mut cmd = Command::new(&server);
                cmd.args(["--name", pod]);
                self.spawn_pod_process(pod, ip, cmd, options)?;
                waits.push((
                    pod.to_owned(),
                    vec![
                        SocketAddrV4::new(ip, HTTP_PORT),
                        SocketAddrV4::new(ip, ECHO_PORT),
                    ],
                ));
            }
        }
        let manager_cmd = self.manager_command(options)?;
        self.manager_desc = match &manager_cmd {
            Some(cmd) => crate::netns::describe(cmd),
            None => "nothing (LabOptions: no manager)".to_owned(),
        };
        if let Some(cmd) = manager_cmd {
            self.spawn_pod_process(MANAGER_POD, MANAGER_POD_IP, cmd, options)?;
            self.manager_options = Some(options.clone());
            waits.push((
                MANAGER_POD.to_owned(),
                vec![SocketAddrV4::new(MANAGER_POD_IP, MANAGER_PORT)],
            ));
        }
        for (name, addrs) in waits {
            for addr in addrs {
                self.wait_process_ready(&name, addr, options.ready_timeout)?;
            }
        }
        Ok(())
    }

    /// The manager pod's command per [`LabOptions::manager`] (`None`: nothing runs).
    fn manager_command(&self, options: &LabOptions) -> Result<Option<Command>> {
        Ok(match &options.manager {
            ManagerProcess::None => None,
            ManagerProcess::Kvpn { extra_args } => {
                let mut cmd = Command::new(bin_path("kvpn-manager")?);
                cmd.args(["--listen", &format!("0.0.0.0:{MANAGER_PORT}")])
                    .args(extra_args);
                Some(cmd)
            }
            ManagerProcess::Command { program, args } => {
                let mut cmd = Command::new(program);
                cmd.args(args);
                Some(cmd)
            }
        })
    }

    /// Stops the manager pod's process (SIGTERM, SIGKILL after 3 s) and starts it again
    /// with the same command and environment, waiting until it listens; returns the new
    /// pid. Every session on the old process is gone; the memory figures of a fresh
    /// manager are its own (the bench restarts it each round). Fails for a lab without
    /// a manager process of its own ([`LabOptions::without_manager`], an attached lab).
    pub fn restart_manager(&self) -> Result<u32> {
        let Some(options) = &self.manager_options else {
            return Err(LabError::Invalid {
                what: "manager restart",
                value: self.name.clone(),
                why: "this lab handle started no manager process (no manager, or attached)",
            });
        };
        let old = {
            let mut processes = self.lock_processes();
            let index = processes.iter().position(|p| p.name() == MANAGER_POD);
            index.map(|i| processes.remove(i))
        };
        if let Some(mut process) = old {
            process.terminate(STOP_GRACE);
        }
        let cmd = self
            .manager_command(options)?
            .expect("manager_options is set only when a manager command exists");
        let pid = self.spawn_pod_process(MANAGER_POD, MANAGER_POD_IP, cmd, options)?;
        self.wait_process_ready(
            MANAGER_POD,
            SocketAddrV4::new(MANAGER_POD_IP, MANAGER_PORT),
            options.ready_timeout,
        )?;
        Ok(pid)
    }

    fn spawn_pod_process(
        &self,
        pod: &str,
        ip: Ipv4Addr,
        mut cmd: Command,
        options: &LabOptions,
    ) -> Result<u32> {
        cmd.env("POD_NAME", pod).env("POD_IP", ip.to_string());
        for (k, v) in &options.pod_env {
            cmd.env(k, v);
        }
        self.spawn_in(pod, pod, &cmd)
    }

    /// Waits until `addr` accepts a TCP connection from the node netns, failing early
    /// if the lab process `name` exits.
    fn wait_process_ready(&self, name: &str, addr: SocketAddrV4, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let attempt = Duration::from_millis(200);
            let connected = self
                .node
                .netns()
                .run(move || TcpStream::connect_timeout(&SocketAddr::V4(addr), attempt).is_ok())?;
            if connected {
                return Ok(());
            }
            {
                let mut processes = self.lock_processes();
                if let Some(p) = processes.iter_mut().find(|p| p.name() == name)
                    && let Some(status) = p.try_exit_status()
                {
                    return Err(LabError::Exited {
                        name: name.to_owned(),
                        pid: p.pid(),
                        status,
                        log: tail_for_error(p.log()),
                    });
                }
            }
            if Instant::now() >= deadline {
                let log = self
                    .lock_processes()
                    .iter()
                    .find(|p| p.name() == name)
                    .map(|p| tail_for_error(p.log()))
                    .unwrap_or_default();
                return Err(LabError::NotReady {
                    what: format!("{name} on {addr}"),
                    timeout_ms: timeout.as_millis(),
                    log,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A handle to the persistent lab `name` recorded by another (or this) process.
    /// Dropping it leaves the lab running; call [`Lab::down`] to tear it down.
    pub fn attach(name: &str) -> Result<Lab> {
        validate_lab_name(name)?;
        let path = state_path(name);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(LabError::NotUp {
                    name: name.to_owned(),
                    path,
                });
            }
            Err(source) => {
                return Err(LabError::Io {
                    what: format!("cannot read {}", path.display()),
                    source,
                });
            }
        };
        let state: LabState = serde_json::from_str(&text).map_err(|source| LabError::State {
            path: path.clone(),
            source,
        })?;
        if state.version != STATE_VERSION || !is_lab_id(&state.id) {
            return Err(LabError::Invalid {
                what: "lab state file",
                value: path.display().to_string(),
                why: "written by another kvpn version or corrupted; remove it and the kvpn-* netns by hand",
            });
        }
        let addressing = state.addressing;
        let node = Node::existing(&state.id, NODE, addressing.node_pod_cidr)
            .with_ipv6(addressing.ipv6.map(|v6| v6.node_pod_cidr));
        let pods = state
            .pods
            .iter()
            .map(|(n, ip)| node.adopt_pod(n, *ip))
            .collect();
        let uplink = node.uplink(
            addressing.laptop_uplink_ip(),
            addressing.node_uplink_ip(),
            UPLINK_PREFIX_LEN,
        );
        Ok(Lab {
            name: state.name,
            laptop: Netns::from_name(
                &state
                    .foreign_laptop
                    .clone()
                    .unwrap_or_else(|| netns_name(&state.id, LAPTOP)),
            ),
            addressing,
            own_laptop: state.foreign_laptop.is_none(),
            extra_laptops: Vec::new(),
            id: state.id,
            dir: state.dir,
            node,
            uplink,
            pods,
            services: if state.static_workloads {
                lab_services()
            } else {
                Vec::new()
            },
            node_ports: if state.static_workloads {
                lab_node_ports()
            } else {
                Vec::new()
            },
            static_workloads: state.static_workloads,
            processes: Mutex::new(
                state
                    .processes
                    .into_iter()
                    .map(Process::from_record)
                    .collect(),
            ),
            persist_as: Some(name.to_owned()),
            keep_dir: state.keep_dir,
            manager_desc: state.manager,
            manager_options: None,
            teardown_on_drop: false,
            down: false,
        })
    }

    /// Leaves a persistent lab running after this handle (and this process) goes away;
    /// returns its state file. Fails for a lab without [`LabOptions::persist_as`], which
    /// nothing could tear down later.
    pub fn detach(mut self) -> Result<PathBuf> {
        if self.persist_as.is_none() {
            return Err(LabError::NotPersistent {
                name: self.name.clone(),
            });
        }
        self.write_state()?;
        self.teardown_on_drop = false;
        // From now on the state file owns the lab, not this process.
        let _ = std::fs::remove_file(owner_path(&self.id));
        Ok(state_path(&self.name))
    }

    /// Tears the lab down: stops its processes (SIGTERM, then SIGKILL after 3 s) and any
    /// other process left inside its netns, deletes the pods' veths and every
    /// `kvpn-<id>-*` netns (with the bridge, the uplink and the nftables table), the
    /// state file, and the lab folder unless kept. Idempotent. Fails with
    /// [`LabError::Leftovers`] if a netns or process survived.
    pub fn down(&mut self) -> Result<()> {
        if self.down {
            return Ok(());
        }
        let started = Instant::now();
        let mut first_error = None;

        // 1. Our processes, all signalled at once, then bounded waits.
        {
            let mut processes = self.lock_processes();
            for p in processes.iter_mut() {
                if p.is_alive() {
                    signal(p.pid(), Signal::SIGTERM);
                }
            }
            wait_until(STOP_GRACE, || processes.iter_mut().all(|p| !p.is_alive()));
            for p in processes.iter_mut() {
                // Reaps our children; SIGKILLs what ignored SIGTERM.
                p.terminate(Duration::ZERO);
            }
        }
        // 2. Anything else still running inside the lab's netns (test helpers, children
        //    of pod processes, kubelet stand-in pods).
        let netns: Vec<Netns> = match lab_netns(&self.id) {
            Ok(names) => names.iter().map(|n| Netns::from_name(n)).collect(),
            Err(e) => {
                first_error.get_or_insert(e);
                Vec::new()
            }
        };
        let strays: Vec<u32> = netns.iter().flat_map(Netns::pids).collect();
        if !strays.is_empty() {
            tracing::info!(id = %self.id, ?strays, "stopping processes left in the lab's netns");
            for &pid in &strays {
                signal(pid, Signal::SIGTERM);
            }
            wait_until(STOP_GRACE, || netns.iter().all(|n| n.pids().is_empty()));
            for n in &netns {
                for pid in n.pids() {
                    signal(pid, Signal::SIGKILL);
                }
            }
            wait_until(Duration::from_secs(2), || {
                netns.iter().all(|n| n.pids().is_empty())
            });
        }
        // 3. The uplink in another lab's laptop netns (that netns stays), pods (veth
        //    first, see Node::remove_pod), then every lab netns.
        if !self.own_laptop
            && let Err(e) = self.node.remove_uplink(&self.uplink)
        {
            first_error.get_or_insert(e);
        }
        for pod in &self.pods {
            if let Err(e) = self.node.remove_pod(pod) {
                first_error.get_or_insert(e);
            }
        }
        for n in &netns {
            if let Err(e) = n.delete() {
                first_error.get_or_insert(e);
            }
        }
        // 4. State file, owner record and folder.
        if let Some(name) = &self.persist_as {
            let _ = std::fs::remove_file(state_path(name));
        }
        let _ = std::fs::remove_file(owner_path(&self.id));
        let keep = self.keep_dir || std::thread::panicking();
        if keep {
            tracing::info!(dir = %self.dir.display(), "lab folder kept");
        } else if let Err(source) = std::fs::remove_dir_all(&self.dir)
            && source.kind() != std::io::ErrorKind::NotFound
        {
            first_error.get_or_insert(LabError::Io {
                what: format!("cannot remove lab folder {}", self.dir.display()),
                source,
            });
        }
        self.down = true;
        // 5. Verify.
        let mut leftovers: Vec<String> = lab_netns(&self.id).unwrap_or_default();
        if !self.own_laptop && self.laptop.exists() {
            let link = self
                .laptop
                .ip(&["link", "show", "dev", &self.uplink.laptop_if]);
            if link.is_ok() {
                leftovers.push(format!(
                    "uplink {} in {}",
                    self.uplink.laptop_if,
                    self.laptop.name()
                ));
            }
        }
        leftovers.extend(self.lock_processes().iter_mut().filter_map(|p| {
            p.is_alive()
                .then(|| format!("process {} (pid {})", p.name(), p.pid()))
        }));
        tracing::info!(id = %self.id, elapsed_ms = started.elapsed().as_millis(), "lab down");
        if !leftovers.is_empty() {
            return Err(LabError::Leftovers {
                id: self.id.clone(),
                leftovers: leftovers.join(", "),
            });
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    // --- where things are ---------------------------------------------------------

    /// The lab's 5-hex-digit id (the `<id>` in `kvpn-<id>-*`).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The persistent name, or `kvpn-<id>`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The lab folder (logs of pod processes, scratch space for tests).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The laptop netns (another lab's, with [`LabOptions::laptop`]).
    pub fn laptop_netns(&self) -> &Netns {
        &self.laptop
    }

    /// The address plan.
    pub fn addressing(&self) -> &Addressing {
        &self.addressing
    }

    /// Laptops added with [`Lab::add_laptop`].
    pub fn extra_laptops(&self) -> &[ExtraLaptop] {
        &self.extra_laptops
    }

    /// Adds a laptop netns `kvpn-<id>-<role>` with its own uplink: the next free /30
    /// after the lab's uplink ([`Addressing::extra_laptop_uplink`]), veth `kv<id>u<n>`
    /// ↔ `kv<id>l<n>`, and one host route to the node's main uplink address (API relay,
    /// NodePorts), so the same laptop kubeconfigs work there. Like the first laptop it
    /// has no route to the pod or service CIDR. Removed with the lab.
    pub fn add_laptop(&mut self, role: &str) -> Result<ExtraLaptop> {
        let valid = role.starts_with(LAPTOP)
            && role != LAPTOP
            && role.len() <= 20
            && role
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !valid || self.extra_laptops.iter().any(|l| l.role == role) {
            return Err(LabError::Invalid {
                what: "laptop role",
                value: role.to_owned(),
                why: "use `laptop` followed by up to 14 of a-z, 0-9, `-` (e.g. laptop2), once per lab",
            });
        }
        let n = u8::try_from(self.extra_laptops.len() + 1).map_err(|_| LabError::Invalid {
            what: "laptop role",
            value: role.to_owned(),
            why: "too many extra laptops",
        })?;
        if n > 9 {
            return Err(LabError::Invalid {
                what: "laptop role",
                value: role.to_owned(),
                why: "at most 9 extra laptops per lab (interface names kv<id>u<n>)",
            });
        }
        let netns = Netns::create(&netns_name(&self.id, role))?;
        // Its own resolv.conf, like the first laptop's: kvpn's DNS setup there must
        // never reach this machine's /etc/resolv.conf.
        if let Err(e) = netns
            .write_etc_file("resolv.conf", LAPTOP_RESOLV_CONF.as_bytes())
            .and_then(|_| write_laptop_hosts(&netns, true))
        {
            let _ = netns.delete();
            return Err(e);
        }
        let net = self.addressing.extra_laptop_uplink(n);
        let uplink =
            match self
                .node
                .connect_extra_laptop(&netns, n, net, self.addressing.node_uplink_ip())
            {
                Ok(u) => u,
                Err(e) => {
                    let _ = netns.delete();
                    return Err(e);
                }
            };
        let laptop = ExtraLaptop {
            role: role.to_owned(),
            netns,
            uplink,
        };
        tracing::info!(id = %self.id, role, net = %net, "extra laptop added");
        self.extra_laptops.push(laptop.clone());
        Ok(laptop)
    }

    pub fn node(&self) -> &Node {
        &self.node
    }

    pub fn node_netns(&self) -> &Netns {
        self.node.netns()
    }

    pub fn uplink(&self) -> &Uplink {
        &self.uplink
    }

    pub fn pods(&self) -> &[Pod] {
        &self.pods
    }

    pub fn pod(&self, name: &str) -> Option<&Pod> {
        self.pods.iter().find(|p| p.name == name)
    }

    pub fn services(&self) -> &[Service] {
        &self.services
    }

    pub fn node_ports(&self) -> &[NodePort] {
        &self.node_ports
    }

    /// Whether the static pods, ClusterIPs and NodePort exist
    /// ([`LabOptions::static_workloads`]).
    pub fn has_static_workloads(&self) -> bool {
        self.static_workloads
    }

    /// Where the laptop reaches the manager (`172.31.255.1:10801`).
    pub fn manager_addr_from_laptop(&self) -> SocketAddr {
        SocketAddr::V4(crate::MANAGER_ADDR_FROM_LAPTOP)
    }

    /// The netns of `role`: `"laptop"`, `"node"`, a pod name, or any other existing
    /// `kvpn-<id>-<role>` netns (pods added later with [`Node::add_pod`], e.g. by the
    /// kubelet stand-in).
    pub fn netns(&self, role: &str) -> Result<Netns> {
        match role {
            LAPTOP => Ok(self.laptop.clone()),
            NODE => Ok(self.node.netns().clone()),
            pod => match self.pod(pod) {
                Some(p) => Ok(p.netns.clone()),
                None => {
                    let netns = Netns::from_name(&netns_name(&self.id, role));
                    if !role.contains('/') && netns.exists() {
                        Ok(netns)
                    } else {
                        Err(LabError::UnknownRole {
                            name: self.name.clone(),
                            role: role.to_owned(),
                        })
                    }
                }
            },
        }
    }

    // --- running things -----------------------------------------------------------

    /// A command that runs `program` inside the netns of `role` (not started).
    pub fn command_in(&self, role: &str, program: &str) -> Result<Command> {
        Ok(self.netns(role)?.command(program))
    }

    /// Runs `args` inside the netns of `role` to completion; returns its output whatever
    /// the exit status.
    pub fn exec_in(&self, role: &str, args: &[&str]) -> Result<Output> {
        self.netns(role)?.exec(args)
    }

    /// Runs `f` on a thread inside the netns of `role` (e.g. to open sockets there).
    pub fn run_in<T: Send>(&self, role: &str, f: impl FnOnce() -> T + Send) -> Result<T> {
        self.netns(role)?.run(f)
    }

    /// Starts `cmd` (program, args, env, cwd) in the background inside the netns of
    /// `role`, logging to `<lab folder>/<name>.log`. The lab stops it on down. Returns
    /// its pid.
    pub fn spawn_in(&self, role: &str, name: &str, cmd: &Command) -> Result<u32> {
        if name.is_empty() || name.contains('/') {
            return Err(LabError::Invalid {
                what: "process name",
                value: name.to_owned(),
                why: "empty or contains `/`",
            });
        }
        let netns = self.netns(role)?;
        let log = self.dir.join(format!("{name}.log"));
        let process = Process::spawn(&netns, name, cmd, &log)?;
        let pid = process.pid();
        self.lock_processes().push(process);
        if self.persist_as.is_some() && !self.teardown_on_drop {
            // An attached persistent lab: keep the record complete for `down_named`.
            self.write_state()?;
        }
        Ok(pid)
    }

    /// Stops the lab process `pid` (SIGTERM, SIGKILL after `grace`) and forgets it.
    /// Returns its exit status if this process started it.
    pub fn stop_process(&self, pid: u32, grace: Duration) -> Result<Option<ExitStatus>> {
        let mut processes = self.lock_processes();
        let Some(index) = processes.iter().position(|p| p.pid() == pid) else {
            return Err(LabError::Invalid {
                what: "lab process pid",
                value: pid.to_string(),
                why: "not started by this lab",
            });
        };
        let mut process = processes.remove(index);
        drop(processes);
        Ok(process.terminate(grace))
    }

    /// The lab's processes (started by `up` or [`Lab::spawn_in`]).
    pub fn processes(&self) -> Vec<ProcessInfo> {
        self.lock_processes()
            .iter_mut()
            .map(|p| {
                let alive = p.is_alive();
                let r = p.record();
                ProcessInfo {
                    name: r.name.clone(),
                    netns: r.netns.clone(),
                    pid: r.pid,
                    log: r.log.clone(),
                    cmdline: r.cmdline.clone(),
                    alive,
                }
            })
            .collect()
    }

    /// Waits until `addr` accepts TCP connections from the netns of `role`.
    pub fn wait_tcp(&self, role: &str, addr: SocketAddr, timeout: Duration) -> Result<()> {
        let netns = self.netns(role)?;
        let deadline = Instant::now() + timeout;
        loop {
            let step = Duration::from_millis(200);
            if netns.run(move || TcpStream::connect_timeout(&addr, step).is_ok())? {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(LabError::NotReady {
                    what: format!("{addr} from {}", netns.name()),
                    timeout_ms: timeout.as_millis(),
                    log: String::new(),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until a TCP socket listens on `port` in `role`'s netns, read from the
    /// socket table (`ss -ltn`) without connecting: for servers such as iperf3 that
    /// take a probe connection for a client and answer the next real one with
    /// "the server is busy running a test".
    pub fn wait_listening(&self, role: &str, port: u16, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let filter = format!("sport = :{port}");
        loop {
            let out = self.exec_in(role, &["ss", "-Hltn", &filter])?;
            if out.status.success() && !out.stdout.trim_ascii().is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(LabError::NotReady {
                    what: format!("a TCP listener on port {port} in {role}"),
                    timeout_ms: timeout.as_millis(),
                    log: String::from_utf8_lossy(&out.stderr).into_owned(),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// For the bench's raw-path baseline only: routes the pod and service CIDRs from the
    /// laptop straight to the node over the uplink, which the lab otherwise never does
    /// (the laptop must reach the cluster only through kvpn). Undo with
    /// [`Lab::remove_laptop_direct_routes`].
    pub fn add_laptop_direct_routes(&self) -> Result<()> {
        let (pod, svc, via) = (
            self.addressing.pod_cidr,
            self.addressing.service_cidr,
            self.addressing.node_uplink_ip(),
        );
        self.laptop.ip_batch(&[
            format!("route add {pod} via {via}"),
            format!("route add {svc} via {via}"),
        ])
    }

    /// Removes the routes of [`Lab::add_laptop_direct_routes`]; missing ones are fine.
    pub fn remove_laptop_direct_routes(&self) -> Result<()> {
        let via = self.addressing.node_uplink_ip().to_string();
        for cidr in [self.addressing.pod_cidr, self.addressing.service_cidr] {
            let _ = self
                .laptop
                .ip(&["route", "del", &cidr.to_string(), "via", &via]);
        }
        Ok(())
    }

    /// What runs where, for people (`kvpn lab up` prints it).
    pub fn info(&self) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "kvpn lab `{}` (id {}), folder {}",
            self.name,
            self.id,
            self.dir.display()
        );
        let _ = writeln!(
            s,
            "  laptop   netns {:<24} {}/{} on {} — no route to the pod or service CIDR",
            self.laptop.name(),
            self.uplink.laptop_ip,
            self.uplink.prefix_len,
            self.uplink.laptop_if
        );
        let _ = writeln!(
            s,
            "  node     netns {:<24} bridge {} {}/{} (also routes the service CIDR {}), uplink {} {}/{}",
            self.node.netns().name(),
            self.node.bridge(),
            self.node.gateway(),
            self.node.pod_cidr().prefix_len(),
            self.addressing.service_cidr,
            self.uplink.node_if,
            self.uplink.node_ip,
            self.uplink.prefix_len
        );
        if !self.static_workloads {
            return s;
        }
        let _ = writeln!(
            s,
            "  pods (pod CIDR {}, this node {}):",
            self.addressing.pod_cidr,
            self.node.pod_cidr()
        );
        let mut processes = self.lock_processes();
        for pod in &self.pods {
            let running: Vec<String> = processes
                .iter_mut()
                .filter(|p| p.record().netns == pod.netns.name())
                .map(|p| {
                    let state = if p.is_alive() { "" } else { " (exited)" };
                    format!(
                        "{} [pid {}{state}]",
                        short_cmd(&p.record().cmdline),
                        p.pid()
                    )
                })
                .collect();
            let running = if running.is_empty() {
                "nothing running".to_owned()
            } else {
                running.join("; ")
            };
            let _ = writeln!(
                s,
                "    {:<10} {:<13} netns {:<24} {}",
                pod.name,
                pod.ip,
                pod.netns.name(),
                running
            );
        }
        let _ = writeln!(
            s,
            "  services (service CIDR {}; nftables table ip {NFT_TABLE} in the node netns):",
            self.addressing.service_cidr
        );
        for svc in &self.services {
            let eps: Vec<String> = svc
                .endpoints
                .iter()
                .map(|e| format!("{e}:{}", svc.target_port))
                .collect();
            let _ = writeln!(
                s,
                "    {:<10} {}:{}/{} -> {}",
                svc.name,
                svc.cluster_ip,
                svc.port,
                svc.protocol.as_str(),
                eps.join(", ")
            );
        }
        for np in &self.node_ports {
            let _ = writeln!(
                s,
                "  from the laptop: {} at {}:{} (NodePort-like DNAT to {}:{})",
                np.name, np.node_ip, np.port, np.pod_ip, np.target_port
            );
        }
        let _ = writeln!(s, "  manager pod runs: {}", self.manager_desc);
        let _ = writeln!(
            s,
            "  try: ip netns exec {} curl -s http://{WEB_CLUSTER_IP}/",
            netns_name(&self.id, MANAGER_POD)
        );
        s
    }

    fn write_state(&self) -> Result<()> {
        let Some(name) = &self.persist_as else {
            return Ok(());
        };
        let state = LabState {
            version: STATE_VERSION,
            name: name.clone(),
            id: self.id.clone(),
            dir: self.dir.clone(),
            keep_dir: self.keep_dir,
            pods: self.pods.iter().map(|p| (p.name.clone(), p.ip)).collect(),
            processes: self
                .lock_processes()
                .iter()
                .map(|p| p.record().clone())
                .collect(),
            manager: self.manager_desc.clone(),
            static_workloads: self.static_workloads,
            addressing: self.addressing,
            foreign_laptop: (!self.own_laptop).then(|| self.laptop.name().to_owned()),
        };
        let path = state_path(name);
        let io = |what: String| move |source| LabError::Io { what, source };
        std::fs::create_dir_all(state_dir())
            .map_err(io(format!("cannot create {}", state_dir().display())))?;
        let text = serde_json::to_string_pretty(&state).map_err(|source| LabError::State {
            path: path.clone(),
            source,
        })?;
        // Write then rename, so a reader never sees half a file.
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, text).map_err(io(format!("cannot write {}", tmp.display())))?;
        std::fs::rename(&tmp, &path).map_err(io(format!("cannot write {}", path.display())))
    }

    fn lock_processes(&self) -> MutexGuard<'_, Vec<Process>> {
        // A panic while holding the lock leaves a plain Vec; it stays usable.
        self.processes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if !self.teardown_on_drop || self.down {
            return;
        }
        if let Err(e) = self.down() {
            tracing::error!(id = %self.id, error = %e, "lab teardown failed");
            eprintln!("kvpn-lab: teardown of lab {} failed: {e}", self.id);
        }
        if std::thread::panicking() {
            eprintln!(
                "kvpn-lab: lab {} torn down after a panic; logs kept in {}",
                self.id,
                self.dir.display()
            );
        }
    }
}

/// Who built a non-persistent lab: lets [`reap_orphaned_labs`] tell a lab whose test
/// process was killed (no drop, no teardown) from one that is still in use.
#[derive(Debug, Serialize, Deserialize)]
struct OwnerRecord {
    pid: u32,
    start_ticks: u64,
    dir: PathBuf,
}

fn owner_path(id: &str) -> PathBuf {
    state_dir().join("owners").join(format!("{id}.json"))
}

fn write_owner(id: &str, dir: &Path) -> Result<()> {
    let pid = std::process::id();
    let record = OwnerRecord {
        pid,
        start_ticks: crate::process::proc_stat(pid).map_or(0, |s| s.start_ticks),
        dir: dir.to_owned(),
    };
    let path = owner_path(id);
    let io = |what: String| move |source| LabError::Io { what, source };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .map_err(io(format!("cannot create {}", parent.display())))?;
    }
    let text = serde_json::to_string(&record).map_err(|source| LabError::State {
        path: path.clone(),
        source,
    })?;
    std::fs::write(&path, text).map_err(io(format!("cannot write {}", path.display())))
}

/// Tears down labs whose builder died without tearing them down (a test process killed
/// with SIGKILL, a crashed `kvpn lab up`): every `kvpn-<id>-*` netns whose id has an
/// owner record naming a dead process, or a persistent state file whose node netns is
/// gone. Labs in use, persistent labs that are up, and netns of other kvpn components
/// (no owner record) are left alone. Returns the ids it tore down.
pub fn reap_orphaned_labs() -> Result<Vec<String>> {
    crate::require_root()?;
    let mut reaped = Vec::new();
    let mut first_error = None;
    // Persistent labs with a state file but no node netns (half-built or half-removed).
    if let Ok(entries) = std::fs::read_dir(state_dir()) {
        for entry in entries.flatten() {
            let file = entry.file_name().to_string_lossy().into_owned();
            let Some(name) = file.strip_suffix(".json") else {
                continue;
            };
            if let Ok(mut lab) = Lab::attach(name)
                && !lab.node.netns().exists()
            {
                let id = lab.id.clone();
                match lab.down() {
                    Ok(()) => reaped.push(id),
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
        }
    }
    // Non-persistent labs whose owner process is gone.
    let ids: std::collections::BTreeSet<String> = crate::netns::list_kvpn_netns()?
        .iter()
        .filter_map(|n| {
            let id = n.strip_prefix("kvpn-")?.get(..5)?;
            (is_lab_id(id) && n.as_bytes().get(10) == Some(&b'-')).then(|| id.to_owned())
        })
        .collect();
    for id in ids {
        let Ok(text) = std::fs::read_to_string(owner_path(&id)) else {
            continue;
        };
        let Ok(owner) = serde_json::from_str::<OwnerRecord>(&text) else {
            continue;
        };
        let owner_alive = crate::process::proc_stat(owner.pid)
            .is_some_and(|s| s.start_ticks == owner.start_ticks && s.state != 'Z');
        if owner_alive {
            continue;
        }
        tracing::info!(%id, owner = owner.pid, "tearing down an orphaned lab");
        let node = Node::existing(&id, NODE, NODE_POD_CIDR);
        let uplink = node.uplink(LAPTOP_UPLINK_IP, NODE_UPLINK_IP, UPLINK_PREFIX_LEN);
        let mut lab = Lab {
            name: format!("kvpn-{id}"),
            laptop: Netns::from_name(&netns_name(&id, LAPTOP)),
            id: id.clone(),
            dir: owner.dir,
            node,
            uplink,
            pods: Vec::new(),
            services: Vec::new(),
            node_ports: Vec::new(),
            processes: Mutex::new(Vec::new()),
            persist_as: None,
            keep_dir: false,
            manager_desc: String::new(),
            manager_options: None,
            static_workloads: false,
            addressing: Addressing::default(),
            own_laptop: true,
            extra_laptops: Vec::new(),
            teardown_on_drop: false,
            down: false,
        };
        match lab.down() {
            Ok(()) => reaped.push(id),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(reaped),
    }
}

/// Checks that `laptop` (another lab's laptop netns) exists and holds no address in
/// `addressing`'s uplink, pod or service CIDR, which would make this lab's uplink
/// ambiguous there.
fn check_foreign_laptop(laptop: &Netns, addressing: &Addressing) -> Result<()> {
    if !laptop.exists() {
        return Err(LabError::Invalid {
            what: "laptop netns",
            value: laptop.name().to_owned(),
            why: "does not exist (bring the first lab up before attaching a second one to its laptop)",
        });
    }
    let out = laptop.exec(&["ip", "-4", "-o", "addr", "show"])?;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(addr) = line
            .split_whitespace()
            .skip_while(|w| *w != "inet")
            .nth(1)
            .and_then(|a| a.split('/').next())
            .and_then(|a| a.parse::<Ipv4Addr>().ok())
        else {
            continue;
        };
        if addressing.uplink.contains(&addr)
            || addressing.pod_cidr.contains(&addr)
            || addressing.service_cidr.contains(&addr)
        {
            return Err(LabError::Invalid {
                what: "laptop netns",
                value: format!("{} (has {addr})", laptop.name()),
                why: "already holds an address of this lab's uplink, pod or service CIDR: give the second lab another addressing (Addressing::second)",
            });
        }
    }
    Ok(())
}

/// Picks a fresh id and claims it by creating its netns of `role` (`ip netns add` fails
/// if another lab raced us to the same id).
fn claim_id(role: &str) -> Result<(String, Netns)> {
    const TRIES: u32 = 32;
    for _ in 0..TRIES {
        let id = random_id()?;
        if !lab_netns(&id)?.is_empty() {
            continue;
        }
        match Netns::create(&netns_name(&id, role)) {
            Ok(netns) => return Ok((id, netns)),
            Err(LabError::CommandFailed { stderr, .. }) if stderr.contains("exists") => continue,
            Err(e) => return Err(e),
        }
    }
    Err(LabError::NoFreeId { tries: TRIES })
}

fn random_id() -> Result<String> {
    let mut bytes = [0u8; 4];
    let mut f = std::fs::File::open("/dev/urandom").map_err(|source| LabError::Io {
        what: "cannot open /dev/urandom".into(),
        source,
    })?;
    std::io::Read::read_exact(&mut f, &mut bytes).map_err(|source| LabError::Io {
        what: "cannot read /dev/urandom".into(),
        source,
    })?;
    Ok(format!("{:05x}", u32::from_le_bytes(bytes) & 0xF_FFFF))
}

fn is_lab_id(id: &str) -> bool {
    id.len() == 5
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

pub(crate) fn validate_lab_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        && !name.starts_with('-');
    if ok {
        Ok(())
    } else {
        Err(LabError::Invalid {
            what: "lab name",
            value: name.to_owned(),
            why: "use 1-64 of A-Z, a-z, 0-9, `-`, `_`",
        })
    }
}

fn signal(pid: u32, signal: Signal) {
    if let Ok(pid) = i32::try_from(pid) {
        // ESRCH (already gone) is fine.
        let _ = kill(Pid::from_raw(pid), signal);
    }
}

fn wait_until(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn tail_for_error(log: &Path) -> String {
    let tail = log_tail(log, 2000);
    if tail.trim().is_empty() {
        format!(" (log {} is empty)", log.display())
    } else {
        format!("; log {}:\n{}", log.display(), tail.trim_end())
    }
}

/// `kvpn-lab-server --name x` without the binary's directory.
fn short_cmd(cmdline: &str) -> String {
    let mut parts = cmdline.splitn(2, ' ');
    let program = parts.next().unwrap_or_default();
    let program = program.rsplit('/').next().unwrap_or(program);
    match parts.next() {
        Some(rest) => format!("{program} {rest}"),
        None => program.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_names() {
        let id = random_id().expect("urandom");
        assert!(is_lab_id(&id), "{id}");
        assert!(!is_lab_id("abcdg"));
        assert!(!is_lab_id("abcd"));
        assert!(validate_lab_name(DEFAULT_LAB_NAME).is_ok());
        assert!(validate_lab_name("../etc").is_err());
        assert!(validate_lab_name("").is_err());
    }

    #[test]
    fn short_cmd_drops_the_directory() {
        assert_eq!(
            short_cmd("/x/target/debug/kvpn-lab-server --name b"),
            "kvpn-lab-server --name b"
        );
        assert_eq!(short_cmd("socat"), "socat");
    }

    #[test]
    fn static_services_balance_over_both_backends() {
        for svc in lab_services() {
            assert_eq!(
                svc.endpoints,
                vec![BACKEND_1_IP, BACKEND_2_IP],
                "{}",
                svc.name
            );
            assert!(
                crate::SERVICE_CIDR.contains(&svc.cluster_ip),
                "{}",
                svc.name
            );
        }
    }
}
