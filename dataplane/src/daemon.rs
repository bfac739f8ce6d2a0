//! The root daemon: the session registry behind the gRPC API
//! (`kvpn.dataplane.v1.Dataplane`) and the runtime directory it serves from.
//!
//! I/O: the Unix socket `$KVPN_RUNTIME_DIR/dataplane.sock` (root-owned; mode
//! 0600, or 0666 when a non-root uid is allowed), the pid file `dataplane.pid`
//! next to it, and what sessions do ([`crate::session`]).
//!
//! Peer credentials: every call is checked against the caller's `SO_PEERCRED`
//! (taken by tonic when the connection is accepted). Root and the one allowed uid
//! (`--allow-uid`, by default the `SUDO_UID` the daemon was started with) may use
//! the API; anyone else gets PERMISSION_DENIED naming their uid and how to allow
//! it, and is counted ([`Daemon::refused_peers`], Status) and logged. The socket
//! mode only decides who reaches that check: with a non-root uid allowed it is
//! 0666, so that a refused user gets the explanation instead of a bare EACCES.
//!
//! Stale sockets (case lc-01): a socket file nobody answers on is what a killed
//! daemon leaves; it is removed at start. A socket somebody answers on means a
//! daemon is already running, and this one refuses to start.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::net::IpAddr;
use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ipnet::IpNet;
use kvpn_proto::dataplane::dataplane_server::{Dataplane, DataplaneServer};
use kvpn_proto::dataplane::{
    AdmitToRunRequest, AdmitToRunResponse, ConnectRequest, ConnectResponse, DisconnectRequest,
    DisconnectResponse, RunDnsQueryRequest, RunDnsQueryResponse, ShutdownRequest, ShutdownResponse,
    StatusRequest, StatusResponse, TopRequest, TopResponse, UpdateRoutesRequest,
    UpdateRoutesResponse,
};
use tonic::{Request, Response, Status};

use crate::dns::{ClusterDns, Dns};
use crate::netlink::Netlink;
use crate::run_scope::{self, RunScope};
use crate::session::{self, ClassifierAttach, ConnectError, Session, SessionParams};
use crate::tls::TlsClient;
use crate::tun;

/// Default runtime directory (env `KVPN_RUNTIME_DIR`).
pub const DEFAULT_RUNTIME_DIR: &str = "/run/kvpn";
/// Socket file name in the runtime directory.
pub const SOCKET_NAME: &str = "dataplane.sock";
/// Pid file name in the runtime directory.
pub const PID_NAME: &str = "dataplane.pid";
/// Log file name in the runtime directory (the CLI redirects stderr there).
pub const LOG_NAME: &str = "dataplane.log";

/// Errors of the daemon's runtime directory and socket.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The runtime directory cannot be used.
    #[error("runtime directory {path}: {why}")]
    RuntimeDir {
        /// The directory.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// Another daemon answers on the socket.
    #[error("another kvpn-dataplane is already serving on {path}{pid} — use it, or stop it first")]
    AlreadyRunning {
        /// The socket.
        path: PathBuf,
        /// " (pid N)" when the pid file says so.
        pid: String,
    },
    /// File system or socket I/O failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was attempted.
        what: &'static str,
        /// On which path.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> DaemonError + 'a {
    move |source| DaemonError::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

/// The runtime directory: socket, pid file, log.
#[derive(Debug, Clone)]
pub struct RuntimeDir {
    dir: PathBuf,
}

impl RuntimeDir {
    /// Use `dir`, creating it (mode 0755) if needed. Refuses a directory that
    /// others can write to without the sticky bit, where someone else could
    /// swap the socket.
    pub fn prepare(dir: &Path) -> Result<Self, DaemonError> {
        if !dir.exists() {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(dir)
                .map_err(io_err("cannot create runtime directory", dir))?;
        }
        let meta = fs::metadata(dir).map_err(io_err("cannot read runtime directory", dir))?;
        if !meta.is_dir() {
            return Err(DaemonError::RuntimeDir {
                path: dir.to_owned(),
                why: "not a directory".to_owned(),
            });
        }
        let mode = meta.permissions().mode();
        if mode & 0o002 != 0 && mode & 0o1000 == 0 {
            return Err(DaemonError::RuntimeDir {
                path: dir.to_owned(),
                why: format!(
                    "world-writable (mode {:o}) — use a directory only root can write to",
                    mode & 0o7777
                ),
            });
        }
        Ok(Self {
            dir: dir.to_owned(),
        })
    }

    /// Refuse a directory that anyone but this process's user owns or that its
    /// group or others can write to: the check for a daemon started by another
    /// user through sudo or pkexec, who picked `--runtime-dir` and must not be
    /// able to plant the files it trusts at start (resolv.conf backup, TUN
    /// records) or swap its socket and log for symlinks.
    pub fn require_private(&self) -> Result<(), DaemonError> {
        use std::os::unix::fs::MetadataExt as _;
        let meta =
            fs::metadata(&self.dir).map_err(io_err("cannot read runtime directory", &self.dir))?;
        let euid = nix::unistd::Uid::effective().as_raw();
        let mode = meta.permissions().mode() & 0o7777;
        if meta.uid() != euid || mode & 0o022 != 0 {
            return Err(DaemonError::RuntimeDir {
                path: self.dir.clone(),
                why: format!(
                    "owned by uid {} with mode {mode:o}, but a daemon started through sudo or \
                     pkexec needs a folder that only uid {euid} owns and can write to (mode \
                     755 or stricter) — use the default /run/kvpn or such a folder",
                    meta.uid()
                ),
            });
        }
        Ok(())
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The socket path.
    pub fn socket(&self) -> PathBuf {
        self.dir.join(SOCKET_NAME)
    }

    /// The pid file path.
    pub fn pid_file(&self) -> PathBuf {
        self.dir.join(PID_NAME)
    }

    /// Bind the gRPC socket: remove a stale one, refuse if a daemon answers,
    /// create it with mode 0600 and write the pid file.
    pub fn bind(&self) -> Result<tokio::net::UnixListener, DaemonError> {
        self.bind_for(None)
    }

    /// [`Self::bind`] for a daemon that also serves the non-root `allowed_uid`:
    /// the socket is made 0666 afterwards, so that uid (and only it, by the peer
    /// credential check) can call; every other uid is refused with a reason.
    pub fn bind_for(
        &self,
        allowed_uid: Option<u32>,
    ) -> Result<tokio::net::UnixListener, DaemonError> {
        let path = self.socket();
        if fs::symlink_metadata(&path).is_ok() {
            match std::os::unix::net::UnixStream::connect(&path) {
                Ok(_) => {
                    let pid = fs::read_to_string(self.pid_file())
                        .map(|p| format!(" (pid {})", p.trim()))
                        .unwrap_or_default();
                    return Err(DaemonError::AlreadyRunning { path, pid });
                }
                Err(e) => {
                    tracing::info!(path = %path.display(), error = %e, "removing stale socket left by a daemon that did not stop cleanly");
                    fs::remove_file(&path).map_err(io_err("cannot remove stale socket", &path))?;
                }
            }
        }
        // Bind with a umask that leaves the socket 0600 from the first moment,
        // then set the mode explicitly as well.
        let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
        let bound = tokio::net::UnixListener::bind(&path);
        nix::sys::stat::umask(old);
        let listener = bound.map_err(io_err("cannot bind socket", &path))?;
        let mode = match allowed_uid {
            Some(uid) if uid != 0 => 0o666,
            _ => 0o600,
        };
        fs::set_permissions(&path, fs::Permissions::from_mode(mode))
            .map_err(io_err("cannot set mode of socket", &path))?;
        let pid_file = self.pid_file();
        fs::write(&pid_file, format!("{}\n", std::process::id()))
            .map_err(io_err("cannot write pid file", &pid_file))?;
        Ok(listener)
    }

    /// Remove the socket and pid file (at exit).
    pub fn cleanup(&self) {
        for path in [self.socket(), self.pid_file()] {
            if let Err(e) = fs::remove_file(&path)
                && e.kind() != io::ErrorKind::NotFound
            {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove");
            }
        }
    }
}

/// The sessions of this daemon.
pub struct Daemon {
    netlink: Netlink,
    classifiers: Arc<dyn ClassifierAttach>,
    heartbeat_interval: Duration,
    sessions: Mutex<HashMap<String, Session>>,
    /// Split DNS for sessions whose Connect carries cluster DNS (`None`: the
    /// laptop's DNS is never touched, as in tests without it).
    dns: Option<Arc<Dns>>,
    /// The non-root uid allowed to call besides root (`None`: root only).
    allowed_uid: Option<u32>,
    /// Calls refused by the peer credential check.
    refused_peers: AtomicU64,
    /// Set by the Shutdown call: [`Daemon::serve`] stops as on SIGTERM.
    shutdown_requested: tokio::sync::Notify,
    /// The clock of Top's `sampled_at_us`.
    started: std::time::Instant,
    /// Where TUN devices are recorded for the sweep after a crash (`None`:
    /// nothing recorded, as in tests without a runtime directory).
    record: Option<crate::sweep::Record>,
    /// This daemon as [`Daemon::serve`] shares it: Connect runs its setup as
    /// a task of its own through it ([`Daemon::connect_owned`]).
    me: std::sync::OnceLock<std::sync::Weak<Daemon>>,
    /// The cgroup, programs, rule and forwarder of each `kvpn run` session, by
    /// session id.
    runs: Mutex<HashMap<String, RunScope>>,
    /// Run slots taken, also by Connects still setting up.
    run_slots: Mutex<Vec<u16>>,
}

impl std::fmt::Debug for Daemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Daemon").finish_non_exhaustive()
    }
}

fn invalid(msg: impl Into<String>) -> Status {
    Status::invalid_argument(msg.into())
}

/// Parse a Connect request into session parameters.
pub fn params_from_request(
    req: &ConnectRequest,
    heartbeat_interval: Duration,
) -> Result<SessionParams, Status> {
    if req.manager.is_empty() {
        return Err(invalid(
            "manager address is empty — give it as HOST:PORT, e.g. 172.31.255.1:10801",
        ));
    }
    let tunnel_ip: IpAddr = req.tunnel_ip.parse().map_err(|_| {
        invalid(format!(
            "invalid tunnel IP {:?} — give an address such as 100.96.0.2",
            req.tunnel_ip
        ))
    })?;
    let tunnel_ip_v6: Option<std::net::Ipv6Addr> = if req.tunnel_ip_v6.is_empty() {
        None
    } else {
        Some(req.tunnel_ip_v6.parse().map_err(|_| {
            invalid(format!(
                "invalid IPv6 tunnel IP {:?} — give an IPv6 address such as fd6b:7670:6e00::6460:2, or none for an IPv4-only session",
                req.tunnel_ip_v6
            ))
        })?)
    };
    if req.routes.is_empty() {
        return Err(invalid("no routes given — pass at least one cluster CIDR"));
    }
    let mut routes = Vec::with_capacity(req.routes.len());
    for route in &req.routes {
        let cidr: IpNet = route.cidr.parse().map_err(|_| {
            invalid(format!(
                "invalid CIDR {:?} — give it as ADDRESS/PREFIX, e.g. 10.244.0.0/16",
                route.cidr
            ))
        })?;
        let kind = session::kind_from_api(route.kind).ok_or_else(|| {
            invalid(format!(
                "route {} has no kind — set pod, service or extra",
                route.cidr
            ))
        })?;
        routes.push((cidr, kind));
    }
    let tun_name = if req.tun_name.is_empty() {
        None
    } else {
        tun::validate_name(&req.tun_name).map_err(|e| invalid(e.to_string()))?;
        Some(req.tun_name.clone())
    };
    let mtu = tun::validate_mtu(req.mtu).map_err(|e| invalid(e.to_string()))?;
    let tls = TlsClient::from_request(&req.tls_ca_pem, &req.tls_server_name)
        .map_err(|e| invalid(e.to_string()))?;
    let workers = match u16::try_from(req.workers) {
        Ok(0) => 1,
        Ok(n) if n <= kvpn_proto::frame::MAX_WORKERS => n,
        _ => {
            return Err(invalid(format!(
                "invalid worker count {} — give 1 to {} (--workers)",
                req.workers,
                kvpn_proto::frame::MAX_WORKERS
            )));
        }
    };
    Ok(SessionParams {
        manager: req.manager.clone(),
        routes,
        tunnel_ip,
        tunnel_ip_v6,
        tun_name,
        mtu,
        heartbeat_interval,
        tls,
        session_token: req.session_token.as_bytes().to_vec(),
        allow_route_conflict: req.allow_route_conflict,
        steer_ebpf: req.steer_ebpf,
        workers,
        data_peer: session::DataPeer::from_transport(
            req.origin.as_ref().map_or("", |o| o.transport.as_str()),
        ),
        // Set by Connect once the run slot is chosen.
        run_table: None,
        run_mark: None,
    })
}

impl Daemon {
    /// A daemon without sessions. `netlink` must be opened in the laptop's
    /// network namespace.
    pub fn new(
        netlink: Netlink,
        classifiers: Arc<dyn ClassifierAttach>,
        heartbeat_interval: Duration,
    ) -> Self {
        Self {
            netlink,
            classifiers,
            heartbeat_interval,
            sessions: Mutex::new(HashMap::new()),
            dns: None,
            allowed_uid: None,
            refused_peers: AtomicU64::new(0),
            shutdown_requested: tokio::sync::Notify::new(),
            started: std::time::Instant::now(),
            record: None,
            me: std::sync::OnceLock::new(),
            runs: Mutex::new(HashMap::new()),
            run_slots: Mutex::new(Vec::new()),
        }
    }

    /// Also accept calls from `uid` (root is always accepted).
    pub fn with_allowed_uid(mut self, uid: Option<u32>) -> Self {
        self.allowed_uid = uid.filter(|&u| u != 0);
        self
    }

    /// Record the TUN devices of sessions in `record` (the runtime directory),
    /// for [`crate::sweep`] after a crash.
    pub fn with_record(mut self, record: crate::sweep::Record) -> Self {
        self.record = Some(record);
        self
    }

    /// Calls refused because of the caller's uid, since start.
    pub fn refused_peers(&self) -> u64 {
        self.refused_peers.load(Ordering::Relaxed)
    }

    /// The peer credential check of every call: root and the allowed uid pass.
    /// A call without credentials (not over a Unix socket: in-process tests)
    /// is refused too, since nothing vouches for it.
    fn check_peer(&self, request: Request<()>) -> Result<Request<()>, Status> {
        let cred = request
            .extensions()
            .get::<tonic::transport::server::UdsConnectInfo>()
            .and_then(|info| info.peer_cred);
        let Some(cred) = cred else {
            self.refused_peers.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("refused a call without peer credentials");
            return Err(Status::permission_denied(
                "the root daemon could not read the caller's credentials (SO_PEERCRED) — \
                 call it over its Unix socket",
            ));
        };
        let uid = cred.uid();
        if uid == 0 || Some(uid) == self.allowed_uid {
            return Ok(request);
        }
        let n = self.refused_peers.fetch_add(1, Ordering::Relaxed) + 1;
        // The caller's pid, named as the caller's (trial T5: read as the daemon's).
        let pid = cred
            .pid()
            .map_or_else(String::new, |p| format!(" (the calling process, pid {p})"));
        tracing::warn!(
            uid,
            pid = cred.pid(),
            refused = n,
            "refused a call from a uid that is not allowed"
        );
        let (allowed, run_as) = match self.allowed_uid {
            Some(a) => (
                format!("root and uid {a}"),
                format!("as uid {a} or with sudo"),
            ),
            None => ("only root".to_owned(), "with sudo".to_owned()),
        };
        Err(Status::permission_denied(format!(
            "the root daemon kvpn-dataplane refuses uid {uid}{pid}: it accepts {allowed} — \
             run kvpn {run_as}, or restart the root daemon with \
             `kvpn-dataplane --allow-uid {uid}` (started through sudo it allows SUDO_UID)"
        )))
    }

    /// Set up split DNS with `dns` for sessions that ask for it.
    pub fn with_dns(mut self, dns: Arc<Dns>) -> Self {
        // Put kvpn's entry back when something else rewrites resolv.conf.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(Dns::watch_resolv_conf(Arc::downgrade(&dns)));
        }
        self.dns = Some(dns);
        self
    }

    /// Give `session`'s cluster DNS to split DNS; the line for the user. An
    /// error is a privileged step that failed (resolv.conf, the forwarder's
    /// sockets, systemd-resolved): Connect rolls the session back (case lc-03).
    async fn start_dns(&self, session: &Session, req: &ConnectRequest) -> Result<String, String> {
        let mut line = match req.dns.as_ref() {
            Some(api) => {
                self.apply_dns(
                    session.id(),
                    session.tun_name(),
                    session.routes().to_vec(),
                    session.dns_reach(),
                    api,
                )
                .await?
            }
            None => String::new(),
        };
        if req.hosts_file {
            let hosts = match (&self.dns, req.dns.as_ref()) {
                (Some(dns), Some(api)) => {
                    dns.enable_hosts(session.id(), &api.search, &api.domain)
                        .await
                }
                (Some(_), None) => {
                    "hosts file: no entries (the session has no cluster DNS settings)".to_owned()
                }
                (None, _) => {
                    "hosts file: not written (this daemon runs without split DNS)".to_owned()
                }
            };
            if line.is_empty() {
                line = hosts;
            } else if !line.starts_with("not configured: ") {
                line = format!("{line}; {hosts}");
            }
        }
        Ok(line)
    }

    /// Give session `id`'s Services (as the route watch reports them) to split
    /// DNS (their namespaces) and to its hosts-file entries, if it asked for them; `dns` is the session's newest
    /// cluster DNS settings (the connected namespace may come with them).
    async fn update_hosts(
        &self,
        id: &str,
        dns_settings: Option<&kvpn_proto::dataplane::ClusterDns>,
        services: Vec<kvpn_proto::dataplane::ClusterService>,
    ) {
        let Some(dns) = &self.dns else { return };
        dns.set_namespaces(id, services.iter().map(|s| s.namespace.as_str()))
            .await;
        if !dns.hosts_enabled(id).await {
            return;
        }
        if let Some(api) = dns_settings {
            dns.enable_hosts(id, &api.search, &api.domain).await;
        }
        match dns.set_hosts_services(id, services).await {
            Ok(n) => tracing::debug!(session = id, entries = n, "hosts file updated"),
            Err(e) => tracing::warn!(session = id, error = %e, "hosts file not updated"),
        }
    }

    /// Set up (or replace) split DNS of session `id` with `api`; the line for the
    /// user, which starts with "not configured: " when the settings cannot be
    /// used. `routes` tell whether the cluster has IPv6. An error names a
    /// privileged step that failed (resolv.conf, forwarder, systemd-resolved).
    async fn apply_dns(
        &self,
        id: &str,
        tun: &str,
        routes: Vec<(IpNet, crate::ebpf::RouteKind)>,
        reach: crate::dns::Reach,
        api: &kvpn_proto::dataplane::ClusterDns,
    ) -> Result<String, String> {
        if api.servers.is_empty() {
            return Ok(String::new());
        }
        let run = self.runs().contains_key(id);
        let dns = match &self.dns {
            Some(dns) => Some(dns),
            None if run => None,
            None => {
                return Ok("not configured: this daemon runs without split DNS".to_owned());
            }
        };
        // IPv4-only clusters get AAAA answered empty at once (dns-09).
        let ipv6 = routes.iter().any(|(cidr, kind)| {
            matches!(cidr, IpNet::V6(_))
                && matches!(
                    kind,
                    crate::ebpf::RouteKind::Pod | crate::ebpf::RouteKind::Service
                )
        });
        // PTR names of the cluster's pod and service addresses go to the cluster DNS.
        let reverse = routes
            .iter()
            .filter(|(_, kind)| {
                matches!(
                    kind,
                    crate::ebpf::RouteKind::Pod | crate::ebpf::RouteKind::Service
                )
            })
            .map(|(cidr, _)| *cidr);
        let cluster = match ClusterDns::new(&api.servers, &api.domain, &api.search, ipv6)
            .and_then(|c| c.with_suffixes(&api.include_suffixes, &api.exclude_suffixes))
        {
            Ok(c) => c.with_reverse(reverse),
            Err(e) => return Ok(format!("not configured: {e}")),
        };
        if run {
            // A run session's names go to its own forwarder alone.
            let runs = self.runs();
            let Some(scope) = runs.get(id) else {
                return Ok(String::new());
            };
            if let Some(f) = scope.forwarder() {
                f.set_clusters(vec![(cluster, reach)]);
                scope.set_suffixes((api.include_suffixes.clone(), api.exclude_suffixes.clone()));
                return Ok(format!(
                    "forwarder {} for this run's processes only (the laptop's DNS is unchanged)",
                    f.local_addr()
                ));
            }
            return Ok(String::new());
        }
        let Some(dns) = dns else {
            return Ok(String::new());
        };
        if dns.has_session(id, &cluster).await {
            return Ok(String::new());
        }
        dns.add_session(id, tun, cluster, reach).await.map_err(|e| {
            tracing::warn!(session = id, error = %e, "split DNS not set up");
            e.to_string()
        })
    }

    /// Take a session out of split DNS (before its TUN device goes).
    async fn stop_dns(&self, id: &str) -> Vec<String> {
        match &self.dns {
            Some(dns) => dns.remove_session(id).await,
            None => Vec::new(),
        }
    }

    fn runs(&self) -> std::sync::MutexGuard<'_, HashMap<String, RunScope>> {
        self.runs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// End the run sessions whose command has been gone for
    /// [`ABANDONED_RUN_GRACE`] without a disconnect.
    async fn end_abandoned_runs(&self) {
        let ids: Vec<String> = self
            .runs()
            .iter()
            .filter(|(_, scope)| scope.abandoned(ABANDONED_RUN_GRACE))
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            let session = self.sessions().remove(&id);
            let Some(session) = session else { continue };
            tracing::warn!(session = %id, "run session ended: its command and all it started are gone and nobody disconnected it (kvpn run died with its user daemon?)");
            let leftovers = self.stop_session(session).await;
            if !leftovers.is_empty() {
                tracing::warn!(session = %id, ?leftovers, "teardown incomplete");
            }
        }
    }

    fn run_slots(&self) -> std::sync::MutexGuard<'_, Vec<u16>> {
        self.run_slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The laptop's nameservers (the resolv.conf split DNS manages, else
    /// /etc/resolv.conf), as upstreams of a run's forwarder at `forwarder`.
    fn laptop_nameservers(&self, forwarder: std::net::SocketAddr) -> Vec<std::net::SocketAddr> {
        let path = self.dns.as_ref().map_or_else(
            || PathBuf::from(crate::dns::resolv_conf::DEFAULT_PATH),
            |d| d.settings().resolv_conf.clone(),
        );
        let bytes = fs::read(&path).unwrap_or_default();
        crate::dns::upstreams_from(&bytes, forwarder)
    }

    /// Tear a run session's scope down (its processes are killed); what was
    /// left behind.
    async fn stop_run(&self, id: &str) -> Vec<String> {
        let scope = self.runs().remove(id);
        let Some(scope) = scope else {
            return Vec::new();
        };
        let slot = scope.slot;
        let cgroup = scope.cgroup().to_owned();
        let leftovers = scope.teardown(&self.netlink).await;
        self.run_slots().retain(|s| *s != slot);
        if !cgroup.exists()
            && let Some(record) = &self.record
            && let Err(e) = record.remove_run_cgroup(&cgroup)
        {
            tracing::warn!(error = %e, "cannot update the run cgroup record");
        }
        leftovers
    }

    fn sessions(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        // Sessions stay valid even if a Status call panicked mid-read.
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Delete what a killed daemon of this runtime directory left (case lc-02):
    /// its recorded TUN devices and their routes ([`crate::sweep`]), and with
    /// `reset_tcp` the laptop TCP sockets still on its sessions' tunnel IPs
    /// (`--repair`, run by disconnect and quit; a daemon that serves leaves
    /// them to its first Connect, which counts them for the new session). Runs
    /// at start, before serving; without a record there is nothing in scope.
    pub async fn sweep_leftovers(
        &self,
        reset_tcp: bool,
    ) -> Result<crate::sweep::SweepReport, crate::sweep::SweepError> {
        // A killed daemon's run sessions leave their fwmark rules (their TUN
        // devices and the routes through them went with it); one daemon serves a
        // network namespace, so every run rule in it was a daemon of this socket's.
        match self
            .netlink
            .del_mark_rules(
                run_scope::RUN_RULE_PRIORITY,
                run_scope::RUN_MARK_BASE
                    ..run_scope::RUN_MARK_BASE + u32::from(run_scope::MAX_RUN_SESSIONS),
            )
            .await
        {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                rules = n,
                "removed the fwmark rules of an earlier daemon's run sessions"
            ),
            Err(e) => tracing::warn!(error = %e, "cannot sweep run sessions' fwmark rules"),
        }
        match &self.record {
            Some(record) => {
                // The cgroup tree is the machine's: only the folders this runtime
                // directory recorded are an earlier daemon's of ours.
                if record.run_cgroups().is_ok_and(|d| !d.is_empty()) {
                    match run_scope::cgroup_root() {
                        Ok(root) => {
                            let (_, failed) = crate::sweep::sweep_run_cgroups(record, &root).await;
                            for f in failed {
                                tracing::warn!("run cgroup sweep: {f}");
                            }
                        }
                        Err(e) => tracing::warn!("cannot sweep run cgroups: {e}"),
                    }
                }
                crate::sweep::sweep(&self.netlink, record, reset_tcp).await
            }
            None => Ok(crate::sweep::SweepReport::default()),
        }
    }

    fn record_tun(&self, session: &Session) {
        if let Some(record) = &self.record
            && let Err(e) = record.add(session.tun_name(), session.ifindex(), &session.tunnel_ips())
        {
            tracing::warn!(path = %record.path().display(), error = %e, "cannot record the TUN device for the sweep after a crash");
        }
    }

    fn forget_tun(&self, ifindex: u32) {
        if let Some(record) = &self.record
            && let Err(e) = record.remove(ifindex)
        {
            tracing::warn!(path = %record.path().display(), error = %e, "cannot update the TUN record");
        }
    }

    /// Tear a session down (DNS first, then the session) and forget its TUN
    /// device; what was left behind.
    async fn stop_session(&self, session: Session) -> Vec<String> {
        self.stop_session_counted(session).await.0
    }

    /// [`Self::stop_session`], also returning how many laptop TCP sockets
    /// through the session it destroyed.
    async fn stop_session_counted(&self, session: Session) -> (Vec<String>, u64) {
        // A run's processes go first, while their session still carries them.
        let mut leftovers = self.stop_run(session.id()).await;
        leftovers.extend(self.stop_dns(session.id()).await);
        let ifindex = session.ifindex();
        let report = session.teardown(&self.netlink).await;
        if report.leftovers.is_empty() {
            self.forget_tun(ifindex);
        }
        leftovers.extend(report.leftovers);
        (leftovers, report.tcp_reset)
    }

    /// Connect's setup, to completion whether or not its caller waits; `owner`:
    /// the caller's uid (a run's owner).
    async fn connect_owned(
        &self,
        request: &ConnectRequest,
        owner: u32,
    ) -> Result<ConnectResponse, Status> {
        let mut params = params_from_request(request, self.heartbeat_interval)?;
        let slot = if request.run_scope {
            let mut slots = self.run_slots();
            let slot = run_scope::free_slot(&slots).ok_or_else(|| {
                Status::resource_exhausted(format!(
                    "{} `kvpn run` sessions are running already — end one first",
                    run_scope::MAX_RUN_SESSIONS
                ))
            })?;
            slots.push(slot);
            drop(slots);
            let (table, mark, _) = run_scope::slot_params(slot);
            params.run_table = Some(table);
            params.run_mark = Some(mark);
            Some(slot)
        } else {
            None
        };
        let release_slot = |this: &Self| {
            if let Some(slot) = slot {
                this.run_slots().retain(|s| *s != slot);
            }
        };
        let origin = request.origin.clone();
        let id = new_session_id();
        let mut session =
            match Session::start(id.clone(), params, &self.netlink, &*self.classifiers).await {
                Ok(s) => s,
                Err(e) => {
                    release_slot(self);
                    return Err(match &e {
                        ConnectError::Unreachable(_) => Status::unavailable(e.to_string()),
                        ConnectError::Step { .. } => Status::failed_precondition(e.to_string()),
                    });
                }
            };
        session.set_origin(origin);
        self.record_tun(&session);
        if let Some(slot) = slot {
            let (_, _, dns_addr) = run_scope::slot_params(slot);
            let upstreams = self.laptop_nameservers(std::net::SocketAddr::V4(dns_addr));
            match RunScope::setup(&id, slot, owner, &self.netlink, upstreams).await {
                Ok(scope) => {
                    tracing::info!(session = %id, cgroup = %scope.cgroup().display(), table = scope.table, mark = scope.mark, dns = %scope.dns, "run scope set up");
                    if let Some(record) = &self.record
                        && let Err(e) = record.add_run_cgroup(scope.cgroup())
                    {
                        tracing::warn!(error = %e, "cannot record the run's cgroup for the sweep after a crash");
                    }
                    self.runs().insert(id.clone(), scope);
                }
                Err(message) => {
                    release_slot(self);
                    let leftovers = self.stop_session(session).await;
                    let rollback = if leftovers.is_empty() {
                        " (rolled back: TUN device, routes and eBPF classifier removed)".to_owned()
                    } else {
                        format!(" (rollback incomplete: {})", leftovers.join("; "))
                    };
                    let e = ConnectError::Step {
                        step: session::Step::RunScope,
                        message,
                        rollback,
                    };
                    tracing::warn!(error = %e, "connect failed");
                    return Err(Status::failed_precondition(e.to_string()));
                }
            }
        }
        let dns = match self.start_dns(&session, request).await {
            Ok(line) => line,
            Err(message) => {
                // Case lc-03: the session is not half set up; undo TUN, routes
                // and classifier, and name the step.
                let leftovers = self.stop_session(session).await;
                let rollback = if leftovers.is_empty() {
                    " (rolled back: TUN device, routes and eBPF classifier removed)".to_owned()
                } else {
                    format!(" (rollback incomplete: {})", leftovers.join("; "))
                };
                let e = ConnectError::Step {
                    step: session::Step::ConfigureDns,
                    message,
                    rollback,
                };
                tracing::warn!(error = %e, "connect failed");
                return Err(Status::failed_precondition(e.to_string()));
            }
        };
        let response = ConnectResponse {
            session_id: id.clone(),
            tun_name: session.tun_name().to_owned(),
            tun_ifindex: session.ifindex(),
            dns,
        };
        self.sessions().insert(id, session);
        Ok(response)
    }

    /// Tear down every session (SIGINT/SIGTERM). Returns what was left behind.
    pub async fn shutdown(&self) -> Vec<String> {
        let sessions: Vec<Session> = self.sessions().drain().map(|(_, s)| s).collect();
        let mut leftovers = Vec::new();
        for session in sessions {
            leftovers.extend(self.stop_session(session).await);
        }
        run_scope::release_own_mount();
        leftovers
    }

    /// Serve the gRPC API on `listener` until `shutdown` completes or a caller
    /// asks for it (Shutdown), then tear all sessions down.
    pub async fn serve(
        self: Arc<Self>,
        listener: tokio::net::UnixListener,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> Result<(), tonic::transport::Error> {
        let _ = self.me.set(Arc::downgrade(&self));
        let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
        let checker = self.clone();
        let service = tonic::service::interceptor::InterceptedService::new(
            DataplaneServer::from_arc(self.clone()),
            move |request: Request<()>| checker.check_peer(request),
        );
        // A run session whose command is gone while nobody ended the session
        // (kvpn run died with its user daemon): ended here.
        let reaper = Arc::downgrade(&self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                let Some(this) = reaper.upgrade() else { return };
                this.end_abandoned_runs().await;
            }
        });
        let requested = self.clone();
        let shutdown = async move {
            tokio::select! {
                () = shutdown => {}
                () = requested.shutdown_requested.notified() => {
                    tracing::info!("Shutdown requested: tearing down all sessions");
                }
            }
        };
        let result = tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming_shutdown(incoming, shutdown)
            .await;
        let leftovers = self.shutdown().await;
        if !leftovers.is_empty() {
            tracing::error!(?leftovers, "teardown left resources behind");
        }
        result
    }
}

/// How long a run session outlives its command when nobody disconnects it: kvpn
/// run disconnects right after its command ends, well within this.
const ABANDONED_RUN_GRACE: Duration = Duration::from_secs(3);

fn new_session_id() -> String {
    use std::hash::{BuildHasher as _, Hasher as _};
    // RandomState is seeded from the OS's randomness once per process and
    // stepped per instance: unique, unpredictable enough for an id, no new crate.
    let mut hasher = std::hash::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    format!("{:012x}", hasher.finish() >> 16)
}

/// The uid of the process that made `request` (`SO_PEERCRED`, taken by tonic
/// when the Unix socket connection was accepted); `rpc` names the call for the
/// refusal of a call without credentials (not over the socket).
fn caller_uid<T>(request: &Request<T>, rpc: &str) -> Result<u32, Status> {
    request
        .extensions()
        .get::<tonic::transport::server::UdsConnectInfo>()
        .and_then(|info| info.peer_cred)
        .map(|c| c.uid())
        .ok_or_else(|| {
            Status::permission_denied(format!(
                "{rpc} needs the caller's credentials (SO_PEERCRED): call over the Unix socket"
            ))
        })
}

#[tonic::async_trait]
impl Dataplane for Daemon {
    async fn connect(
        &self,
        request: Request<ConnectRequest>,
    ) -> Result<Response<ConnectResponse>, Status> {
        // Root when the call carries no credentials (an in-process caller;
        // every call over the socket has them, `check_peer`).
        let owner = caller_uid(&request, "Connect").unwrap_or(0);
        let req = request.into_inner();
        // tonic drops this future when the caller goes away (a Ctrl-C'd CLI):
        // the setup runs as its own task so that nothing is left half made,
        // and a session nobody took the answer of is torn down.
        let Some(this) = self.me.get().and_then(std::sync::Weak::upgrade) else {
            return self.connect_owned(&req, owner).await.map(Response::new);
        };
        let (answer, taken) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let result = this.connect_owned(&req, owner).await;
            if let Err(Ok(resp)) = answer.send(result) {
                tracing::warn!(session = %resp.session_id, "the caller went away during Connect: tearing the session down");
                let session = this.sessions().remove(&resp.session_id);
                if let Some(session) = session {
                    let leftovers = this.stop_session(session).await;
                    if !leftovers.is_empty() {
                        tracing::warn!(session = %resp.session_id, ?leftovers, "teardown incomplete");
                    }
                }
            }
        });
        taken
            .await
            .map_err(|_| Status::internal("the session setup task ended without an answer"))?
            .map(Response::new)
    }

    async fn disconnect(
        &self,
        request: Request<DisconnectRequest>,
    ) -> Result<Response<DisconnectResponse>, Status> {
        let id = &request.get_ref().session_id;
        let sessions: Vec<Session> = {
            let mut all = self.sessions();
            if id.is_empty() {
                all.drain().map(|(_, s)| s).collect()
            } else {
                match all.remove(id) {
                    Some(s) => vec![s],
                    None => {
                        return Err(Status::not_found(format!(
                            "no session {id} — `kvpn status` lists the sessions"
                        )));
                    }
                }
            }
        };
        let mut stopped = Vec::new();
        let mut leftovers = Vec::new();
        let mut tcp_reset = std::collections::HashMap::new();
        for session in sessions {
            let id = session.id().to_owned();
            let (left, reset) = self.stop_session_counted(session).await;
            leftovers.extend(left);
            if reset > 0 {
                tcp_reset.insert(id.clone(), reset);
            }
            stopped.push(id);
        }
        if !leftovers.is_empty() {
            return Err(Status::internal(format!(
                "disconnected {}, but teardown left resources behind: {}",
                stopped.join(", "),
                leftovers.join("; ")
            )));
        }
        Ok(Response::new(DisconnectResponse { stopped, tcp_reset }))
    }

    async fn status(
        &self,
        _request: Request<StatusRequest>,
    ) -> Result<Response<StatusResponse>, Status> {
        let watch = match &self.dns {
            Some(dns) => dns.resolv_watch().await.unwrap_or_default(),
            None => Default::default(),
        };
        let dns_counters = match &self.dns {
            Some(dns) => dns
                .counters()
                .await
                .map(|c| dns_counters_proto(&c, watch.count, watch.last_at_unix, &watch.upstreams)),
            None => None,
        };
        // Read at every call, so a laptop route added after connect shows at
        // once (rt-05); a dump of the routing tables is cheap next to a CLI call.
        let laptop = match self.netlink.laptop_routes().await {
            Ok(routes) => routes,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the laptop's routes for conflict checks");
                Vec::new()
            }
        };
        let mut sessions: Vec<_> = self
            .sessions()
            .values()
            .map(|s| {
                let mut status = s.status();
                status.conflicts = s.conflict_status(&laptop);
                status
            })
            .collect();
        {
            let runs = self.runs();
            for s in &mut sessions {
                if let Some(scope) = runs.get(&s.id) {
                    s.run_cgroup = scope.cgroup().display().to_string();
                    s.run_table = scope.table;
                    s.run_mark = scope.mark;
                    s.run_dns = scope.dns.to_string();
                    // The laptop's split DNS is not this session's: its own
                    // forwarder's counters are (it has no resolv.conf to watch).
                    s.conflicts.clear();
                    s.dns_counters = scope
                        .forwarder()
                        .map(|f| dns_counters_proto(&f.counters(), 0, 0, &f.upstreams()));
                } else {
                    s.dns_counters = dns_counters.clone();
                }
            }
        }
        sessions.sort_by(|a, b| a.tun_name.cmp(&b.tun_name));
        Ok(Response::new(StatusResponse {
            sessions,
            refused_peers: self.refused_peers(),
            version: kvpn_build_info::VERSION.to_owned(),
            commit: kvpn_build_info::COMMIT.to_owned(),
        }))
    }

    async fn admit_to_run(
        &self,
        request: Request<AdmitToRunRequest>,
    ) -> Result<Response<AdmitToRunResponse>, Status> {
        let caller = caller_uid(&request, "AdmitToRun")?;
        let req = request.into_inner();
        let runs = self.runs();
        let scope = runs.get(&req.session_id).ok_or_else(|| {
            Status::not_found(format!(
                "no run session {} — `kvpn status` lists the sessions; only sessions of \
                 `kvpn run` take processes",
                req.session_id
            ))
        })?;
        run_scope::check_owner(&req.session_id, scope.owner_uid, caller, "AdmitToRun")
            .map_err(Status::permission_denied)?;
        scope
            .admit(req.pid, caller)
            .map_err(Status::permission_denied)?;
        tracing::info!(session = %req.session_id, pid = req.pid, caller_uid = caller, "process admitted to the run");
        Ok(Response::new(AdmitToRunResponse {
            cgroup: scope.cgroup().display().to_string(),
        }))
    }

    async fn run_dns_query(
        &self,
        request: Request<RunDnsQueryRequest>,
    ) -> Result<Response<RunDnsQueryResponse>, Status> {
        let caller = caller_uid(&request, "RunDnsQuery")?;
        let req = request.into_inner();
        if req.query.len() > run_scope::MAX_RUN_DNS_QUERY {
            return Err(Status::invalid_argument(format!(
                "a DNS question of {} bytes: at most {} are asked for a run",
                req.query.len(),
                run_scope::MAX_RUN_DNS_QUERY
            )));
        }
        let found = self
            .runs()
            .get(&req.session_id)
            .map(|scope| (scope.dns, scope.mark, scope.owner_uid));
        let (dns, mark, owner) = found.ok_or_else(|| {
            Status::not_found(format!(
                "no run session {} — `kvpn status` lists the sessions; only sessions of \
                 `kvpn run` have their own DNS forwarder",
                req.session_id
            ))
        })?;
        run_scope::check_owner(&req.session_id, owner, caller, "RunDnsQuery")
            .map_err(Status::permission_denied)?;
        let answer = run_scope::ask_forwarder(dns, mark, &req.query)
            .await
            .map_err(|e| {
                Status::unavailable(format!("the run's DNS forwarder {dns} did not answer: {e}"))
            })?;
        Ok(Response::new(RunDnsQueryResponse { answer }))
    }

    async fn shutdown(
        &self,
        _request: Request<ShutdownRequest>,
    ) -> Result<Response<ShutdownResponse>, Status> {
        // A permit is stored when serve's select is not waiting yet; tonic's
        // graceful shutdown lets this answer go out first.
        self.shutdown_requested.notify_one();
        Ok(Response::new(ShutdownResponse {
            pid: std::process::id(),
        }))
    }

    async fn top(&self, _request: Request<TopRequest>) -> Result<Response<TopResponse>, Status> {
        let mut sessions: Vec<_> = self.sessions().values().map(Session::top).collect();
        sessions.sort_by(|a, b| a.tun_name.cmp(&b.tun_name));
        Ok(Response::new(TopResponse {
            sampled_at_us: u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX),
            sessions,
        }))
    }

    async fn update_routes(
        &self,
        request: Request<UpdateRoutesRequest>,
    ) -> Result<Response<UpdateRoutesResponse>, Status> {
        let req = request.get_ref();
        let (handle, netlink) = self
            .sessions()
            .get(&req.session_id)
            .map(|s| (s.watch_handle(), s.route_netlink(&self.netlink)))
            .ok_or_else(|| {
                Status::not_found(format!(
                    "no session {} — `kvpn status` lists the sessions",
                    req.session_id
                ))
            })?;
        // The manager's view of the cluster DNS (its domain flag, the kube-dns
        // Service) replaces what the CLI guessed at connect.
        if let Some(api) = req.dns.as_ref() {
            // The route watch never sends suffixes: they are connect's (the
            // user's flags) and stay.
            let mut api = api.clone();
            // A run session's are its own forwarder's, not split DNS's (#27 F3:
            // taken from split DNS, they were emptied at the first update).
            let run_suffixes = self.runs().get(&req.session_id).map(RunScope::suffixes);
            if let Some(suffixes) = run_suffixes {
                (api.include_suffixes, api.exclude_suffixes) = suffixes;
            } else if let Some(dns) = &self.dns {
                (api.include_suffixes, api.exclude_suffixes) =
                    dns.suffixes_of(&req.session_id).await;
            }
            let api = &api;
            let found = self
                .sessions()
                .get(&req.session_id)
                .map(|s| (s.tun_name().to_owned(), s.routes().to_vec(), s.dns_reach()));
            if let Some((tun, routes, reach)) = found {
                // The session runs already: a failure here is reported, not fatal.
                let line = self
                    .apply_dns(&req.session_id, &tun, routes, reach, api)
                    .await
                    .unwrap_or_else(|e| format!("not configured: {e}"));
                if !line.is_empty() {
                    tracing::info!(session = %req.session_id, dns = %line, "split DNS updated from the route watch");
                }
            }
        }
        let resp = handle.update(&netlink, req).await.map_err(|e| match e {
            crate::watched::UpdateError::Invalid(m) => Status::invalid_argument(m),
            crate::watched::UpdateError::Apply(m) => {
                Status::internal(format!("session {}: {m}", req.session_id))
            }
        })?;
        if req.services_replace
            || !req.services_upsert.is_empty()
            || !req.services_remove.is_empty()
        {
            let services: Vec<_> = {
                let st = handle.state.lock().unwrap_or_else(PoisonError::into_inner);
                st.services.values().cloned().collect()
            };
            self.update_hosts(&req.session_id, req.dns.as_ref(), services)
                .await;
        }
        Ok(Response::new(resp))
    }
}

/// A forwarder's counters as `kvpn status` shows them, with what the
/// resolv.conf watch did (`reapplied` times, the last at `reapplied_at_unix`,
/// 0: never) and the forwarder's upstreams (pure).
fn dns_counters_proto(
    c: &crate::dns::forwarder::CounterSnapshot,
    reapplied: u64,
    reapplied_at_unix: u64,
    upstreams: &[std::net::SocketAddr],
) -> kvpn_proto::dataplane::DnsCounters {
    kvpn_proto::dataplane::DnsCounters {
        resolv_conf_reapplied: reapplied,
        resolv_conf_reapplied_at_unix: reapplied_at_unix,
        upstreams: upstreams.iter().map(ToString::to_string).collect(),
        udp_queries: c.udp_queries,
        tcp_queries: c.tcp_queries,
        cluster: c.cluster,
        expanded: c.expanded,
        upstream: c.upstream,
        nxdomain: c.local_nxdomain,
        empty_aaaa: c.empty_aaaa,
        truncated: c.truncated,
        dropped: c.dropped,
        servfail: c.servfail,
        malformed: c.malformed,
        unreachable: c.unreachable,
        cluster_socket_reopened: c.cluster_socket_reopened,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh folder under the temp folder with `mode`, removed on drop.
    struct Dir(PathBuf);

    impl Dir {
        fn new(tag: &str, mode: u32) -> Self {
            let path = std::env::temp_dir()
                .join(format!("kvpn-runtime-test-{tag}-{}", std::process::id()));
            fs::create_dir_all(&path).expect("create test folder");
            fs::set_permissions(&path, fs::Permissions::from_mode(mode)).expect("chmod");
            Dir(path)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn a_daemon_started_through_sudo_wants_a_runtime_folder_only_its_user_can_write() {
        let ok = Dir::new("private", 0o755);
        RuntimeDir::prepare(&ok.0)
            .expect("prepare")
            .require_private()
            .expect("0755 of our own uid is private");
        let group = Dir::new("group", 0o775);
        let err = RuntimeDir::prepare(&group.0)
            .expect("prepare")
            .require_private()
            .expect_err("group-writable is refused")
            .to_string();
        assert!(err.contains("mode 775") && err.contains("sudo"), "{err}");
        let sticky = Dir::new("sticky", 0o1777);
        assert!(
            RuntimeDir::prepare(&sticky.0)
                .expect("a sticky world-writable folder passes prepare")
                .require_private()
                .is_err(),
            "but not require_private (others can plant files there)"
        );
        // Owned by someone else: only testable as root, which can chown.
        if nix::unistd::Uid::effective().is_root() {
            let other = Dir::new("other", 0o755);
            std::os::unix::fs::chown(&other.0, Some(65534), Some(65534)).expect("chown");
            let err = RuntimeDir::prepare(&other.0)
                .expect("prepare")
                .require_private()
                .expect_err("another uid's folder is refused")
                .to_string();
            assert!(err.contains("owned by uid 65534"), "{err}");
        }
    }
}
