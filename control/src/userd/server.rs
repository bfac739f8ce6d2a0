//! The user daemon process (`kvpn daemon`): serves `proto/userd.proto` on its
//! Unix socket, runs each Kubernetes session's user-side half as a task
//! ([`crate::agent::run_session`]'s two halves) and keeps the session records
//! ([`super::record`]).
//!
//! Life of a session here: StartSession opens it (API server, listener), asks
//! the root daemon to Connect, records it, runs it. A restarted daemon (after a
//! crash or SIGKILL) restores each record: when the root daemon still has the
//! session it listens on the same address again (the root daemon's re-dial
//! finds it) and restarts the route watch; otherwise the session is `lost`,
//! with the reason, and its root half and record are removed — never half
//! alive. Status reconciles the same way: a running session the root daemon no
//! longer has becomes `lost`.
//!
//! A root daemon that does not answer is not taken for a dead one: only when
//! its process is gone ([`crate::liveness`]: pid file, /proc, start time) are
//! its sessions `lost`. While it is stopped or hung the sessions stay as they
//! are — listener, port-forwards, route watch — and are `degraded` with the
//! reason (pid, cause, `kill -CONT`); the first Status it answers again makes
//! them `running`. (Marking them lost closed the listener the root daemon
//! dials, so once continued it re-dialled a refused port for ever.)
//!
//! I/O: the Unix socket, the root daemon's socket, session records, the API
//! server (through the session tasks), signals.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow};
use kvpn_proto::dataplane::{self, ConnectRequest};
use kvpn_proto::userd::user_daemon_server::{UserDaemon, UserDaemonServer};
use kvpn_proto::userd::{
    DisconnectRequest, DisconnectResponse, HoldRunEvent, HoldRunRequest, QuitRequest, QuitResponse,
    SocksSession, SocksState, StartSessionRequest, StartSessionResponse, StatusRequest,
    StatusResponse, UserSession,
};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::{debug, info, warn};

use super::Paths;
use super::record::{SessionRecord, Store};
use crate::agent::{self, AgentConfig};
use crate::daemon;
use crate::kubeconfig::{KubeFlags, UserEnv};
use crate::liveness::{self, Identity, Liveness};

/// States of a session's user-side half (`UserSession.state`).
pub const STATE_RUNNING: &str = "running";
pub const STATE_RESTORING: &str = "restoring";
pub const STATE_LOST: &str = "lost";
/// The root daemon's process runs but does not answer (stopped, hung): the
/// session is kept and comes back to `running` when it answers again.
pub const STATE_DEGRADED: &str = "degraded";

/// What Status does to a TUN session's user half, given the root daemon's
/// answer (its sessions) or why there was none.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Change {
    /// Its root half is gone for good.
    Lost(String),
    /// The root daemon does not answer; the session is kept.
    Degraded(String),
    /// The root daemon answers (again) and has the session.
    Running,
}

/// The [`Change`] for session `id` in `state` (`running` or `degraded`); pure.
fn reconcile_change(
    id: &str,
    state: &str,
    root: Result<&[dataplane::Session], Liveness>,
) -> Option<Change> {
    let gone = |why: &str| {
        Some(Change::Lost(format!(
            "{why}, so its TUN device and routes are gone — run `kvpn connect` again"
        )))
    };
    match root {
        Ok(sessions) if sessions.iter().any(|s| s.id == id) => {
            (state != STATE_RUNNING).then_some(Change::Running)
        }
        Ok(_) => gone("the root daemon no longer has this session (it was restarted)"),
        Err(Liveness::Gone) => gone("the root daemon is not running any more"),
        Err(Liveness::NotAnswering { pid, state }) => {
            Some(Change::Degraded(liveness::not_answering_text(pid, state)))
        }
    }
}

struct Entry {
    record: SessionRecord,
    state: &'static str,
    reason: String,
    since: Instant,
    cancel: CancellationToken,
    /// SOCKS sessions: the status record their task rewrites every 500 ms.
    socks_status: Option<PathBuf>,
    /// The session's SSH path, if it has one (its last error for status).
    ssh: Option<crate::ssh::SshDialer>,
    /// ssh-direct sessions: the data path the agent uses now, and why.
    data_path: Option<crate::agent::SharedPath>,
    /// Why the last data connection reached no manager pod (status).
    data_error: Option<crate::agent::DataError>,
}

impl Entry {
    fn stop(&self) {
        self.cancel.cancel();
    }

    fn to_proto(&self) -> UserSession {
        let request = self.record.request().ok();
        let socks = request.as_ref().and_then(|r| r.socks.as_ref()).map(|s| {
            let live = self
                .socks_status
                .as_ref()
                .filter(|_| self.state == STATE_RUNNING)
                .and_then(|p| std::fs::read(p).ok())
                .and_then(|t| serde_json::from_slice::<crate::socks::SocksStatus>(&t).ok());
            match live {
                Some(l) => SocksState {
                    listen: l.socks_listen,
                    state: l.state,
                    reason: l.reason,
                    open_flows: l.open_flows,
                    tx_packets: l.tx_packets,
                    tx_bytes: l.tx_bytes,
                    rx_packets: l.rx_packets,
                    rx_bytes: l.rx_bytes,
                    dns_servers: l.dns_servers,
                    mtu: l.mtu,
                    liveness: Some(kvpn_proto::dataplane::Liveness {
                        heartbeat_interval_ms: l.heartbeat_interval_ms,
                        window_ms: l.liveness_window_ms,
                        heartbeats_sent: l.heartbeats_sent,
                        heartbeats_echoed: l.heartbeats_echoed,
                        last_rtt_us: l.last_rtt_us,
                        transports_lost: l.transports_lost,
                        ..kvpn_proto::dataplane::Liveness::default()
                    }),
                    resumes: l.resumes,
                    resumes_lost: l.resumes_lost,
                    tcp_flows_reset: l.tcp_flows_reset,
                },
                None => SocksState {
                    listen: s.listen.clone(),
                    state: "connecting".to_owned(),
                    dns_servers: s.dns_servers.clone(),
                    ..SocksState::default()
                },
            }
        });
        let kubeconfig = request.as_ref().map(session_kubeconfig).unwrap_or_default();
        let path = match (&self.data_path, &self.ssh) {
            (Some(p), Some(dialer)) if self.state == STATE_RUNNING => p
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .describe(&dialer.last_hop(), &dialer.path()),
            _ => (String::new(), String::new()),
        };
        let origin = request.and_then(|r| r.connect).and_then(|c| c.origin);
        UserSession {
            id: self.record.id.clone(),
            state: self.state.to_owned(),
            reason: self.reason.clone(),
            data_addr: self.record.data_addr.to_string(),
            namespace: self.record.namespace.clone(),
            origin,
            tunnel_ip: self.record.tunnel_ip.clone(),
            tun_name: self.record.tun_name.clone(),
            uptime_ms: u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX),
            restores: self.record.restores,
            socks,
            kubeconfig,
            // The SSH path's error first (a port-forward rides it), else why
            // the last data connection reached no manager pod.
            transport_error: self
                .ssh
                .as_ref()
                .filter(|_| self.state == STATE_RUNNING)
                .and_then(crate::ssh::SshDialer::last_error)
                .or_else(|| {
                    self.data_error
                        .as_ref()
                        .filter(|_| self.state == STATE_RUNNING)
                        .and_then(|e| {
                            e.lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner)
                                .clone()
                        })
                })
                .unwrap_or_default(),
            data_path: path.0,
            data_path_reason: path.1,
        }
    }
}

/// The daemon's state, shared by the gRPC handlers and the session tasks.
pub struct UserDaemonState {
    root_runtime_dir: PathBuf,
    /// Where SOCKS sessions keep their status records (the private user folder).
    socks_dir: PathBuf,
    store: Store,
    sessions: Mutex<BTreeMap<String, Entry>>,
    quit: CancellationToken,
    /// The root daemon process that last answered: a later silence is its
    /// death only if this process is gone ([`liveness::judge`]).
    root_identity: Mutex<Option<Identity>>,
    /// This state itself, for the tasks a handler spawns to outlive its caller
    /// (StartSession: [`UserDaemonState::start_owned`]).
    me: std::sync::Weak<Self>,
    /// The session ids a disconnect is about to end ("" for all), sent before the
    /// root daemon is asked: a `kvpn run` holding one of them hears why before the
    /// root daemon stops its command ([`UserDaemon::hold_run`]).
    ending: tokio::sync::broadcast::Sender<String>,
}

fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn internal(e: anyhow::Error) -> Status {
    Status::failed_precondition(crate::output::error_chain(&e))
}

fn nonempty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_owned())
}

/// The CLI's environment, working folder and euid as its request carried them.
pub(crate) fn request_env(req: &StartSessionRequest) -> UserEnv {
    UserEnv::from_parts(
        req.env.iter().map(|v| {
            (
                OsString::from_vec(v.name.clone()),
                OsString::from_vec(v.value.clone()),
            )
        }),
        PathBuf::from(OsString::from_vec(req.cwd.clone())),
        req.euid,
    )
}

/// The CLI's `--kubeconfig`, `--context`, `--namespace` as its request carried them.
pub(crate) fn request_flags(req: &StartSessionRequest) -> KubeFlags {
    KubeFlags {
        kubeconfig: nonempty(&req.kubeconfig).map(PathBuf::from),
        context: nonempty(&req.context),
        namespace: nonempty(&req.namespace),
    }
}

/// The kubeconfig files a session reads (`UserSession.kubeconfig`): resolved
/// as the session's agent resolves them, in the environment it was started
/// with. Empty when they cannot be told (no home folder, an unknown sudo user).
fn session_kubeconfig(req: &StartSessionRequest) -> Vec<String> {
    let env = request_env(req);
    crate::kubeconfig::ActingUser::detect(&env)
        .and_then(|acting| {
            crate::kubeconfig::kubeconfig_sources(&request_flags(req), &env, &acting)
        })
        .map(|s| {
            s.paths
                .iter()
                .map(|p| p.to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// The session's agent configuration from the CLI's request.
fn agent_config(
    req: &StartSessionRequest,
    root_runtime_dir: &std::path::Path,
    listen: std::net::SocketAddr,
) -> Result<AgentConfig> {
    let env = request_env(req);
    let ssh = if req.ssh_plan_json.is_empty() {
        None
    } else {
        Some(crate::ssh::SshPlan::from_env(&req.ssh_plan_json)?)
    };
    let port = |p: u32, what: &str| {
        u16::try_from(p).map_err(|_| anyhow!("{what} port {p} is not a TCP port"))
    };
    Ok(AgentConfig {
        flags: request_flags(req),
        ssh,
        ssh_direct: nonempty(&req.ssh_direct)
            .map(|t| {
                t.parse()
                    .with_context(|| format!("bad ssh-direct address {t:?}"))
            })
            .transpose()?,
        ssh_direct_failed: nonempty(&req.ssh_direct_failed),
        env,
        listen,
        manager_namespace: req.manager_namespace.clone(),
        port: port(req.data_port, "data")?,
        grpc_port: (req.grpc_port != 0)
            .then(|| port(req.grpc_port, "gRPC"))
            .transpose()?,
        keep_out: req
            .keep_out
            .iter()
            .map(|ip| {
                ip.parse()
                    .with_context(|| format!("bad keep-out address {ip:?}"))
            })
            .collect::<Result<_>>()?,
        never_proxy: req
            .never_proxy
            .iter()
            .map(|c| {
                c.parse()
                    .with_context(|| format!("bad never-proxy range {c:?}"))
            })
            .collect::<Result<_>>()?,
        extra_domains: req.extra_domains.clone(),
        runtime_dir: root_runtime_dir.to_path_buf(),
        replica: req
            .connect
            .as_ref()
            .and_then(|c| c.origin.as_ref())
            .and_then(|o| nonempty(&o.manager_replica)),
    })
}

impl UserDaemonState {
    /// Record a session that just started (a restarted user daemon brings it
    /// back from the record) and list it as running. `tun_name` is empty and
    /// `socks_status` set for SOCKS sessions.
    fn register(
        &self,
        id: &str,
        addr: std::net::SocketAddr,
        tun_name: &str,
        req: &StartSessionRequest,
        cancel: CancellationToken,
        socks_status: Option<PathBuf>,
    ) {
        let record = SessionRecord::new(
            id,
            addr,
            tun_name,
            now_unix_ms(),
            req,
            (&self.root_runtime_dir, &super::record::current_netns()),
        );
        let run = req.connect.as_ref().is_some_and(|c| c.run_scope);
        // A `kvpn run` session lives as long as its command: a restarted user
        // daemon has nothing to bring back.
        if !run && let Err(e) = self.store.save(&record) {
            warn!(session = %id, "cannot record the session ({e}): a restarted user daemon will not bring it back");
        }
        self.sessions().insert(
            id.to_owned(),
            Entry {
                record,
                state: STATE_RUNNING,
                reason: String::new(),
                since: Instant::now(),
                cancel,
                socks_status,
                ssh: None,
                data_path: None,
                data_error: None,
            },
        );
    }

    fn sessions(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Entry>> {
        // A handler that panicked while holding the lock left consistent data
        // (every update is a single insert/remove): keep going.
        self.sessions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Run an opened session as a task until its token is cancelled.
    /// `label`: the session id, or its listener address while it has none yet.
    fn spawn_session(&self, label: &str, open: agent::OpenSession, cancel: CancellationToken) {
        let span = tracing::info_span!("session", id = %label);
        tokio::spawn(tracing::Instrument::instrument(
            async move {
                if let Err(e) = open.run(cancel).await {
                    warn!("session task ended: {e:#}");
                }
            },
            span,
        ));
    }

    /// Mark `id` lost with `reason`: stop its task, forget its record (a lost
    /// session stays listed until `kvpn disconnect` or `kvpn quit`).
    fn mark_lost(&self, id: &str, reason: String) {
        warn!(session = %id, %reason, "session lost");
        if let Err(e) = self.store.remove(id) {
            warn!(session = %id, "cannot remove the session record: {e}");
        }
        if let Some(e) = self.sessions().get_mut(id) {
            e.stop();
            e.state = STATE_LOST;
            e.reason = reason;
            e.since = Instant::now();
        }
    }

    /// The root daemon's sessions, or why it did not answer.
    async fn root_sessions(&self) -> Result<Vec<dataplane::Session>, Liveness> {
        self.root_status().await.map(|s| s.sessions)
    }

    fn root_identity(&self) -> std::sync::MutexGuard<'_, Option<Identity>> {
        // Only ever assigned whole: a poisoned value is still consistent.
        self.root_identity
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The root daemon's Status, or what its process is when it did not
    /// answer: gone, or alive and not answering ([`liveness::probe`]).
    async fn root_status(&self) -> Result<dataplane::StatusResponse, Liveness> {
        let pid_file = daemon::pid_path(&self.root_runtime_dir);
        let known = *self.root_identity();
        // A stopped process answers nothing: say so now, not after the
        // channel's keep-alive gave up (6 s).
        let before = liveness::probe(&pid_file, known);
        if before.stopped() {
            return Err(before);
        }
        let answered = async {
            let mut client = daemon::connect_existing(&self.root_runtime_dir)
                .await
                .ok()
                .flatten()?;
            client
                .status(dataplane::StatusRequest {})
                .await
                .ok()
                .map(tonic::Response::into_inner)
        }
        .await;
        match answered {
            Some(st) => {
                *self.root_identity() = liveness::identity(&pid_file);
                Ok(st)
            }
            None => Err(liveness::probe(&pid_file, known)),
        }
    }

    /// The stopped ids and, per id, the laptop TCP sockets the root daemon
    /// destroyed ([`dataplane::DisconnectResponse::tcp_reset`]).
    async fn root_disconnect(&self, id: &str) -> Result<(Vec<String>, HashMap<String, u64>)> {
        // A stopped root daemon would keep the call waiting for the keep-alive's
        // 6 s and then fail: fail now, with the same cause and fix.
        if let Liveness::NotAnswering { pid, state } = liveness::probe(
            &daemon::pid_path(&self.root_runtime_dir),
            *self.root_identity(),
        ) && matches!(state, 'T' | 't')
        {
            anyhow::bail!(
                "cannot disconnect: {}",
                liveness::not_answering_text(pid, state)
            );
        }
        let Some(mut client) = daemon::connect_existing(&self.root_runtime_dir).await? else {
            return Ok(Default::default());
        };
        match client
            .disconnect(dataplane::DisconnectRequest {
                session_id: id.to_owned(),
            })
            .await
        {
            Ok(r) => {
                let r = r.into_inner();
                Ok((r.stopped, r.tcp_reset))
            }
            Err(s) if s.code() == tonic::Code::NotFound => Ok(Default::default()),
            // Another user's root daemon, refusing this uid: it never held a
            // session of this daemon's, so there is nothing to disconnect there.
            Err(s) if s.code() == tonic::Code::PermissionDenied => {
                warn!(
                    "the root daemon refuses this uid, so it holds none of its sessions: {}",
                    s.message()
                );
                Ok(Default::default())
            }
            Err(s) => Err(daemon::status_to_error(s)).with_context(|| {
                if id.is_empty() {
                    "the root daemon did not disconnect its sessions".to_owned()
                } else {
                    format!("the root daemon did not disconnect session {id}")
                }
            }),
        }
    }

    /// Bring a recorded session back (daemon start).
    async fn restore(self: Arc<Self>, mut record: SessionRecord) {
        let id = record.id.clone();
        if let Ok(req) = record.request()
            && let Some(socks) = req.socks.clone()
        {
            // Its SOCKS listener and userspace stack died with the previous
            // user daemon; no root daemon half: open both again, on the same
            // SOCKS address, with the recorded lease and token.
            self.restore_socks(record, &req, &socks).await;
            return;
        }
        let root = loop {
            match self.root_sessions().await {
                Err(Liveness::Gone) => {
                    self.mark_lost(
                        &id,
                        "the root daemon is not running any more, so the TUN device and routes \
                         are gone — run `kvpn connect` again"
                            .to_owned(),
                    );
                    return;
                }
                // Stopped or hung: its sessions may well be there; wait for it.
                Err(Liveness::NotAnswering { pid, state }) => {
                    let reason = format!(
                        "waiting for the root daemon: {}",
                        liveness::not_answering_text(pid, state)
                    );
                    match self.sessions().get_mut(&id) {
                        Some(e) => e.reason = reason,
                        // Disconnected while waiting.
                        None => return,
                    }
                    // Cheap while it is stopped (/proc only, no call): poll
                    // often, so the session is back soon after `kill -CONT`.
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Ok(r) => break r,
            }
        };
        let Some(root_session) = root.iter().find(|s| s.id == id) else {
            self.mark_lost(
                &id,
                "the root daemon no longer has this session (it was restarted or the session \
                 was disconnected) — run `kvpn connect` again"
                    .to_owned(),
            );
            return;
        };
        if root_session.manager != record.data_addr.to_string() {
            let reason = format!(
                "the root daemon's session dials {} but the record says {} — run `kvpn connect` \
                 again",
                root_session.manager, record.data_addr
            );
            let _ = self.root_disconnect(&id).await;
            self.mark_lost(&id, reason);
            return;
        }
        let opened = async {
            let req = record
                .request()
                .map_err(|e| anyhow!("unreadable record: {e}"))?;
            let config = agent_config(&req, &self.root_runtime_dir, record.data_addr)?;
            agent::open_session(config).await
        }
        .await;
        match opened {
            Ok(open) => {
                record.restores += 1;
                if let Err(e) = self.store.save(&record) {
                    warn!(session = %id, "cannot update the session record: {e}");
                }
                let cancel = {
                    let mut sessions = self.sessions();
                    let Some(e) = sessions.get_mut(&id) else {
                        // Disconnected while restoring.
                        return;
                    };
                    e.record = record;
                    e.state = STATE_RUNNING;
                    e.reason.clear();
                    e.since = Instant::now();
                    e.ssh = open.ssh_path();
                    e.data_path = open.data_path();
                    e.data_error = Some(open.data_error());
                    e.cancel.clone()
                };
                info!(session = %id, addr = %open.addr(), "session restored");
                self.spawn_session(&id, open, cancel);
            }
            Err(e) => {
                let reason = format!(
                    "the restarted user daemon could not bring it back: {} — its TUN device \
                     and routes were removed; run `kvpn connect` again",
                    crate::output::error_chain(&e)
                );
                if let Err(e) = self.root_disconnect(&id).await {
                    warn!(session = %id, "{e:#}");
                }
                self.mark_lost(&id, reason);
            }
        }
    }

    /// [`Self::restore`] of a SOCKS session.
    async fn restore_socks(
        &self,
        mut record: SessionRecord,
        req: &StartSessionRequest,
        socks: &SocksSession,
    ) {
        let id = record.id.clone();
        match self.open_socks(req, socks).await {
            Ok((addr, cancel, status_file)) => {
                record.restores += 1;
                record.data_addr = addr;
                if let Err(e) = self.store.save(&record) {
                    warn!(session = %id, "cannot update the session record: {e}");
                }
                let mut sessions = self.sessions();
                let Some(e) = sessions.get_mut(&id) else {
                    // Disconnected while restoring.
                    cancel.cancel();
                    return;
                };
                e.record = record;
                e.state = STATE_RUNNING;
                e.reason.clear();
                e.since = Instant::now();
                e.cancel = cancel;
                e.socks_status = Some(status_file);
                info!(session = %id, %addr, listen = %socks.listen, "SOCKS session restored");
            }
            Err(e) => self.mark_lost(
                &id,
                format!(
                    "the restarted user daemon could not bring the SOCKS session back: {} — \
                     run `kvpn connect --socks` again",
                    e.message()
                ),
            ),
        }
    }

    /// Status: sessions whose root half is gone become lost; while the root
    /// daemon runs but does not answer they are `degraded` (kept, listener and
    /// all), and `running` again once it answers ([`reconcile_change`]).
    fn reconcile(&self, root: Result<&[dataplane::Session], Liveness>) {
        let changes: Vec<(String, Change)> = self
            .sessions()
            .values()
            .filter(|e| {
                (e.state == STATE_RUNNING || e.state == STATE_DEGRADED) && e.socks_status.is_none()
            })
            .filter_map(|e| {
                reconcile_change(&e.record.id, e.state, root).map(|c| (e.record.id.clone(), c))
            })
            .collect();
        for (id, change) in changes {
            match change {
                Change::Lost(reason) => self.mark_lost(&id, reason),
                Change::Degraded(reason) => {
                    if let Some(e) = self.sessions().get_mut(&id) {
                        if e.state != STATE_DEGRADED {
                            warn!(session = %id, %reason, "session degraded: kept until the root daemon answers or its process is gone");
                        }
                        e.state = STATE_DEGRADED;
                        e.reason = reason;
                    }
                }
                Change::Running => {
                    if let Some(e) = self.sessions().get_mut(&id) {
                        info!(session = %id, "the root daemon answers again: session running");
                        e.state = STATE_RUNNING;
                        e.reason.clear();
                    }
                }
            }
        }
    }

    /// Start a SOCKS session: the session's loopback listener (port-forward or
    /// ssh-direct, as for any session) and, dialling it, the SOCKS5 server with
    /// its userspace stack ([`crate::socks::start`]). No root daemon is involved.
    async fn start_socks(
        &self,
        req: StartSessionRequest,
        socks: SocksSession,
    ) -> Result<StartSessionResponse, Status> {
        let id = socks.id.clone();
        if id.is_empty() || self.sessions().contains_key(&id) {
            return Err(Status::already_exists(format!(
                "SOCKS session id {id:?} is empty or taken"
            )));
        }
        let (addr, cancel, status_file) = self.open_socks(&req, &socks).await?;
        self.register(&id, addr, "", &req, cancel, Some(status_file));
        info!(session = %id, %addr, listen = %socks.listen, "SOCKS session started");
        Ok(StartSessionResponse {
            connect: Some(dataplane::ConnectResponse {
                session_id: id,
                ..Default::default()
            }),
            data_addr: addr.to_string(),
            daemon_pid: std::process::id(),
        })
    }

    /// The running parts of SOCKS session `socks` (new, or brought back by a
    /// restarted user daemon from its record): the loopback listener of its
    /// data channel and the SOCKS5 server on `socks.listen`. Returns the
    /// listener's address, the token that stops both, and the status file.
    async fn open_socks(
        &self,
        req: &StartSessionRequest,
        socks: &SocksSession,
    ) -> Result<(std::net::SocketAddr, CancellationToken, PathBuf), Status> {
        let id = socks.id.clone();
        let origin = req
            .connect
            .as_ref()
            .and_then(|c| c.origin.clone())
            .unwrap_or_default();
        let parse_ip = |t: &str, what: &str| {
            t.parse::<std::net::IpAddr>()
                .map_err(|_| Status::invalid_argument(format!("bad {what} {t:?}")))
        };
        let status_file = crate::socks::status_path(&self.socks_dir, &id);
        let config = crate::socks::SocksConfig {
            id: id.clone(),
            listen: crate::socks::parse_listen(&socks.listen).map_err(internal)?,
            tunnel_ip: parse_ip(&socks.tunnel_ip, "tunnel IP")?,
            session_token: socks.session_token.clone(),
            tls_ca_pem: socks.tls_ca_pem.clone(),
            tls_server_name: socks.tls_server_name.clone(),
            dns: crate::socks::dns::ClusterDnsConfig {
                servers: socks
                    .dns_servers
                    .iter()
                    .map(|t| parse_ip(t, "cluster DNS server"))
                    .collect::<Result<_, _>>()?,
                search: socks.dns_search.clone(),
            },
            origin: crate::socks::SocksOrigin {
                cluster: origin.cluster.clone(),
                server: origin.server.clone(),
                context: origin.context.clone(),
                manager_namespace: origin.manager_namespace.clone(),
            },
            status_file: status_file.clone(),
        };
        let listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
        let mut agent = agent_config(req, &self.root_runtime_dir, listen).map_err(internal)?;
        // No route watch: a SOCKS session has no routes.
        agent.grpc_port = None;
        let open = agent::open_session(agent).await.map_err(internal)?;
        let addr = open.addr();
        let cancel = CancellationToken::new();
        self.spawn_session(&id, open, cancel.clone());
        let task = match crate::socks::start(config, addr.to_string()).await {
            Ok(t) => t,
            Err(e) => {
                cancel.cancel();
                return Err(internal(e));
            }
        };
        let stop = cancel.clone();
        tokio::spawn(async move {
            stop.cancelled().await;
            task.stop().await;
        });
        Ok((addr, cancel, status_file))
    }

    /// StartSession's setup, to completion whether or not its caller waits.
    async fn start_owned(&self, req: StartSessionRequest) -> Result<StartSessionResponse, Status> {
        if let Some(socks) = req.socks.clone() {
            return self.start_socks(req, socks).await;
        }
        let listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
        let config = agent_config(&req, &self.root_runtime_dir, listen).map_err(internal)?;
        let open = agent::open_session(config).await.map_err(internal)?;
        let addr = open.addr();
        let ssh = open.ssh_path();
        let data_path = open.data_path();
        let data_error = open.data_error();
        let mut root = daemon::connect_existing(&self.root_runtime_dir)
            .await
            .map_err(internal)?
            .ok_or_else(|| {
                Status::failed_precondition(
                    "the root daemon is not running any more: it exited after `kvpn connect` \
                     started or found it (killed or crashed; `kvpn logs` shows why) — run \
                     `kvpn connect` again: it starts a new one",
                )
            })?;
        let connect = ConnectRequest {
            manager: addr.to_string(),
            ..req.connect.clone().unwrap_or_default()
        };
        // Serve the listener before Connect: the root daemon dials it (and
        // completes the TLS handshake with the manager) inside Connect.
        let cancel = CancellationToken::new();
        self.spawn_session(&addr.to_string(), open, cancel.clone());
        let resp = match root.connect(connect).await {
            Ok(r) => r.into_inner(),
            Err(s) => {
                cancel.cancel();
                return Err(Status::new(s.code(), s.message()));
            }
        };
        let id = resp.session_id.clone();
        // A lost session of the same cluster is replaced by this one: stop listing it.
        let origin = req.connect.as_ref().and_then(|c| c.origin.clone());
        self.sessions().retain(|old_id, e| {
            let replaced = e.state == STATE_LOST
                && e.record
                    .request()
                    .ok()
                    .and_then(|r| r.connect)
                    .and_then(|c| c.origin)
                    == origin;
            if replaced {
                info!(session = %old_id, replaced_by = %id, "lost session replaced");
            }
            !replaced
        });
        self.register(&id, addr, &resp.tun_name, &req, cancel, None);
        if let Some(e) = self.sessions().get_mut(&id) {
            e.ssh = ssh;
            e.data_path = data_path;
            e.data_error = Some(data_error);
        }
        info!(session = %id, %addr, tun = %resp.tun_name, "session started");
        Ok(StartSessionResponse {
            connect: Some(resp),
            data_addr: addr.to_string(),
            daemon_pid: std::process::id(),
        })
    }

    /// Replace every session whose traffic manager was reinstalled under it
    /// (its reason: the manager's certificate does not verify) with one through
    /// the new manager ([`super::renew`]); until `quit`.
    async fn watch_reinstalls(self: Arc<Self>) {
        let mut tried: HashMap<String, Instant> = HashMap::new();
        loop {
            tokio::select! {
                () = self.quit.cancelled() => return,
                () = tokio::time::sleep(super::renew::CHECK_EVERY) => {}
            }
            // Sessions whose data channel fails the certificate check: SOCKS
            // sessions say so in their own status record; TUN sessions in the
            // root daemon's status (asked only while this daemon has one).
            let (socks_stranded, any_tun) = {
                let sessions = self.sessions();
                let socks: Vec<String> = sessions
                    .iter()
                    .filter(|(_, e)| e.state == STATE_RUNNING)
                    .filter_map(|(id, e)| {
                        let live = std::fs::read(e.socks_status.as_ref()?).ok()?;
                        let live: crate::socks::SocksStatus = serde_json::from_slice(&live).ok()?;
                        live.reason
                            .contains(kvpn_dataplane::tls::CERTIFICATE_MISMATCH)
                            .then(|| id.clone())
                    })
                    .collect();
                let tun = sessions
                    .values()
                    .any(|e| e.state == STATE_RUNNING && e.socks_status.is_none());
                (socks, tun)
            };
            let mut stranded = socks_stranded;
            if any_tun && let Ok(root) = self.root_sessions().await {
                stranded.extend(
                    root.into_iter()
                        .filter(|s| s.reason.contains(kvpn_dataplane::tls::CERTIFICATE_MISMATCH))
                        .map(|s| s.id),
                );
            }
            for id in stranded {
                let req = self
                    .sessions()
                    .get(&id)
                    .filter(|e| e.state == STATE_RUNNING)
                    .and_then(|e| e.record.request().ok());
                let Some(req) = req else { continue };
                if tried
                    .get(&id)
                    .is_some_and(|t| t.elapsed() < super::renew::RETRY_AFTER)
                {
                    continue;
                }
                // A `kvpn connect` (which may replace this very session) or
                // `kvpn quit` running now: look again next round.
                let lock = match super::connect_lock::ConnectLock::try_for_renew(
                    &self.root_runtime_dir,
                ) {
                    Ok(Some(lock)) => lock,
                    Ok(None) => continue,
                    Err(e) => {
                        warn!(session = %id, "cannot take the connect lock to renew the session: {e:#}");
                        continue;
                    }
                };
                tried.insert(id.clone(), Instant::now());
                self.renew(&id, req).await;
                drop(lock);
            }
        }
    }

    /// [`Self::watch_reinstalls`] for session `id`.
    async fn renew(&self, id: &str, req: StartSessionRequest) {
        let renewed = match super::renew::renewed_request(&req).await {
            Ok(Some(r)) => r,
            Ok(None) => {
                debug!(session = %id, "the manager's CA is the session's: not a reinstall");
                return;
            }
            Err(e) => {
                warn!(session = %id, "cannot renew the session through the reinstalled traffic manager: {e:#}");
                return;
            }
        };
        warn!(session = %id, "the traffic manager was reinstalled (new CA in Secret kvpn-manager-tls): replacing the session with a new lease and the new CA");
        if let Err(e) = self.disconnect(id).await {
            warn!(session = %id, "cannot disconnect the session to renew it: {e:#}");
            return;
        }
        match self.start_owned(renewed).await {
            Ok(resp) => info!(
                session = %id,
                replaced_by = %resp.connect.map(|c| c.session_id).unwrap_or_default(),
                "session renewed through the reinstalled traffic manager"
            ),
            Err(s) => {
                warn!(session = %id, "the renewed session did not start: {} — run `kvpn connect` again", s.message())
            }
        }
    }

    /// Stop `id` (empty = all) on both sides; the stopped ids and the TCP
    /// sockets reset per id.
    async fn disconnect(&self, id: &str) -> Result<(Vec<String>, HashMap<String, u64>)> {
        // Nobody listening is fine.
        let _ = self.ending.send(id.to_owned());
        let (mut stopped, tcp_reset) = self.root_disconnect(id).await?;
        let mine: Vec<String> = self
            .sessions()
            .keys()
            .filter(|k| id.is_empty() || k.as_str() == id)
            .cloned()
            .collect();
        for k in mine {
            if let Some(e) = self.sessions().remove(&k) {
                e.stop();
            }
            if let Err(e) = self.store.remove(&k) {
                warn!(session = %k, "cannot remove the session record: {e}");
            }
            if !stopped.contains(&k) {
                stopped.push(k);
            }
        }
        if !id.is_empty() && stopped.is_empty() {
            anyhow::bail!("no session {id} — `kvpn status` lists the sessions");
        }
        Ok((stopped, tcp_reset))
    }
}

#[tonic::async_trait]
impl UserDaemon for UserDaemonState {
    type HoldRunStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<HoldRunEvent, Status>> + Send + 'static>,
    >;

    async fn hold_run(
        &self,
        request: Request<HoldRunRequest>,
    ) -> Result<Response<Self::HoldRunStream>, Status> {
        let req = request.into_inner();
        if !self.sessions().contains_key(&req.session_id) {
            return Err(Status::not_found(format!(
                "no session {} — `kvpn status` lists the sessions",
                req.session_id
            )));
        }
        let this = self
            .me
            .upgrade()
            .ok_or_else(|| Status::unavailable("the user daemon is stopping"))?;
        let id = req.session_id.clone();
        // Whatever happens next, the session ends with this call.
        let (event_tx, event_rx) = tokio::sync::mpsc::channel(1);
        let holder = event_tx.clone();
        tokio::spawn(async move {
            // Until the caller goes away; a session disconnected meanwhile by
            // someone else is said to the caller, whose stream then ends.
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            let mut ending = this.ending.subscribe();
            loop {
                let told = tokio::select! {
                    () = holder.closed() => break,
                    _ = tick.tick() => false,
                    e = ending.recv() => match e {
                        Ok(ended) => ended.is_empty() || ended == id,
                        Err(_) => false,
                    },
                };
                if told || !this.sessions().contains_key(&id) {
                    let ended = format!(
                        "session {id} was disconnected from outside this run (`kvpn \
                         disconnect`, `kvpn quit` or `kvpn lab down`): the command gets \
                         SIGTERM, and SIGKILL {} s later",
                        kvpn_dataplane::run_scope::TERM_GRACE.as_secs()
                    );
                    info!(session = %id, "the run's session ended while held: telling its caller");
                    let _ = holder
                        .send(Ok(HoldRunEvent {
                            admitted_cgroup: String::new(),
                            ended,
                        }))
                        .await;
                    return;
                }
            }
            match this.disconnect(&id).await {
                Ok((stopped, _)) if !stopped.is_empty() => {
                    info!(session = %id, "the run's caller went away: session disconnected");
                }
                Ok(_) => {}
                // Already disconnected by the caller (the normal end).
                Err(e) => debug!(session = %id, "run session already gone: {e:#}"),
            }
        });
        let mut root = daemon::connect_existing(&self.root_runtime_dir)
            .await
            .map_err(internal)?
            .ok_or_else(|| {
                Status::failed_precondition(
                    "the root daemon is not running any more (`kvpn logs` shows why)",
                )
            })?;
        let admitted = root
            .admit_to_run(dataplane::AdmitToRunRequest {
                session_id: req.session_id.clone(),
                pid: req.pid,
            })
            .await
            .map_err(|s| Status::new(s.code(), s.message()))?
            .into_inner();
        let _ = event_tx
            .send(Ok(HoldRunEvent {
                admitted_cgroup: admitted.cgroup,
                ended: String::new(),
            }))
            .await;
        // The holder task keeps the only sender from here: when it says the session
        // ended, the stream ends with it.
        drop(event_tx);
        info!(session = %req.session_id, pid = req.pid, "process admitted to the run; holding the session");
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(event_rx),
        )))
    }

    async fn start_session(
        &self,
        request: Request<StartSessionRequest>,
    ) -> Result<Response<StartSessionResponse>, Status> {
        // tonic drops this handler's future when the caller goes away (a
        // Ctrl-C'd `kvpn connect`): the setup runs as its own task, so no
        // listener, port-forward or root daemon session is left half made,
        // and rolls back what it made when nobody takes the answer.
        let this = self
            .me
            .upgrade()
            .ok_or_else(|| Status::unavailable("the user daemon is stopping"))?;
        let (answer, taken) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let result = this.start_owned(request.into_inner()).await;
            if let Err(Ok(resp)) = answer.send(result) {
                let id = resp.connect.map(|c| c.session_id).unwrap_or_default();
                warn!(session = %id, "the caller went away during StartSession: disconnecting the session it started");
                if id.is_empty() {
                    return;
                }
                match this.disconnect(&id).await {
                    Ok(_) => info!(session = %id, "session rolled back"),
                    Err(e) => warn!(session = %id, "cannot roll the session back: {e:#}"),
                }
            }
        });
        taken
            .await
            .map_err(|_| Status::internal("the session setup task ended without an answer"))?
            .map(Response::new)
    }

    async fn status(
        &self,
        _request: Request<StatusRequest>,
    ) -> Result<Response<StatusResponse>, Status> {
        let root_status = self.root_status().await;
        let refused_peers = root_status.as_ref().map_or(0, |s| s.refused_peers);
        let root = root_status.map(|s| s.sessions);
        self.reconcile(root.as_deref().map_err(|l| *l));
        let user_sessions = self.sessions().values().map(Entry::to_proto).collect();
        // Not running = did not answer; the CLI tells stopped from gone from /proc.
        Ok(Response::new(StatusResponse {
            root_running: root.is_ok(),
            root_sessions: root.unwrap_or_default(),
            user_sessions,
            daemon_pid: std::process::id(),
            root_refused_peers: refused_peers,
            version: kvpn_build_info::VERSION.to_owned(),
            commit: kvpn_build_info::COMMIT.to_owned(),
        }))
    }

    async fn disconnect(
        &self,
        request: Request<DisconnectRequest>,
    ) -> Result<Response<DisconnectResponse>, Status> {
        let id = request.into_inner().session_id;
        let (stopped, tcp_reset) = UserDaemonState::disconnect(self, &id)
            .await
            .map_err(internal)?;
        Ok(Response::new(DisconnectResponse { stopped, tcp_reset }))
    }

    async fn quit(&self, _request: Request<QuitRequest>) -> Result<Response<QuitResponse>, Status> {
        let (stopped, tcp_reset) = UserDaemonState::disconnect(self, "")
            .await
            .map_err(internal)?;
        info!(?stopped, "quit");
        self.quit.cancel();
        Ok(Response::new(QuitResponse { stopped, tcp_reset }))
    }
}

/// Take the daemon's lock; `Ok(None)` when another user daemon holds it.
fn lock(paths: &Paths) -> Result<Option<std::fs::File>> {
    super::try_flock(&paths.lock)
}

/// Bind the socket with mode 0600 (removing one a killed daemon left).
fn bind(paths: &Paths) -> Result<tokio::net::UnixListener> {
    match std::fs::remove_file(&paths.socket) {
        Ok(()) => {
            info!(socket = %paths.socket.display(), "removed the socket a stopped user daemon left")
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(anyhow!(e).context(format!("cannot remove {}", paths.socket.display())));
        }
    }
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
    let bound = tokio::net::UnixListener::bind(&paths.socket);
    nix::sys::stat::umask(old);
    let listener = bound.with_context(|| format!("cannot listen on {}", paths.socket.display()))?;
    std::fs::set_permissions(&paths.socket, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("cannot set the mode of {}", paths.socket.display()))?;
    Ok(listener)
}

/// Run the user daemon until SIGTERM/SIGINT or Quit.
pub async fn run(root_runtime_dir: PathBuf) -> Result<()> {
    let paths = Paths::current(&root_runtime_dir);
    super::create_private_dir(&paths.dir)?;
    let Some(_lock) = lock(&paths)? else {
        info!(socket = %paths.socket.display(), "another user daemon runs; exiting");
        return Ok(());
    };
    let listener = bind(&paths)?;
    std::fs::write(&paths.pid, format!("{}\n", std::process::id()))
        .with_context(|| format!("cannot write {}", paths.pid.display()))?;
    let store = super::store(&paths)?;
    info!(pid = std::process::id(), socket = %paths.socket.display(), state = %store.dir().display(), "user daemon started");
    let state = Arc::new_cyclic(|me| UserDaemonState {
        me: me.clone(),
        root_runtime_dir,
        socks_dir: paths.dir.clone(),
        store,
        sessions: Mutex::new(BTreeMap::new()),
        quit: CancellationToken::new(),
        root_identity: Mutex::new(None),
        ending: tokio::sync::broadcast::channel(16).0,
    });

    let (records, problems) = state.store.load_all();
    for p in problems {
        warn!("unusable session record: {p}");
    }
    for record in records {
        info!(session = %record.id, addr = %record.data_addr, "restoring session");
        state.sessions().insert(
            record.id.clone(),
            Entry {
                record: record.clone(),
                state: STATE_RESTORING,
                reason: String::new(),
                since: Instant::now(),
                cancel: CancellationToken::new(),
                socks_status: None,
                ssh: None,
                data_path: None,
                data_error: None,
            },
        );
        tokio::spawn(state.clone().restore(record));
    }

    tokio::spawn(state.clone().watch_reinstalls());
    let quit = state.quit.clone();
    // Installed before the first request is served, so a SIGTERM right after
    // one stops the daemon through this path, not by the default action.
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| warn!("cannot watch SIGTERM: {e}"))
        .ok();
    let shutdown = async move {
        let Some(mut term) = term else {
            quit.cancelled().await;
            return;
        };
        tokio::select! {
            _ = term.recv() => info!("SIGTERM"),
            _ = tokio::signal::ctrl_c() => info!("SIGINT"),
            () = quit.cancelled() => {}
        }
    };
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    let served = tonic::transport::Server::builder()
        .add_service(UserDaemonServer::from_arc(state.clone()))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    // Stopped by a signal, the sessions stay recorded: the next user daemon
    // brings them back. After Quit there are none.
    for e in state.sessions().values() {
        e.stop();
    }
    // Let the session tasks close their listeners and port-forwards.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let _ = std::fs::remove_file(&paths.socket);
    let _ = std::fs::remove_file(&paths.pid);
    info!("user daemon stopped");
    served.context("the user daemon's gRPC server failed")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root(ids: &[&str]) -> Vec<dataplane::Session> {
        ids.iter()
            .map(|id| dataplane::Session {
                id: (*id).to_owned(),
                ..Default::default()
            })
            .collect()
    }

    #[test]
    fn a_silent_root_daemon_degrades_the_session_only_a_gone_one_loses_it() {
        let stopped = Liveness::NotAnswering {
            pid: 42,
            state: 'T',
        };
        let Some(Change::Degraded(reason)) = reconcile_change("s1", STATE_RUNNING, Err(stopped))
        else {
            panic!("a stopped root daemon degrades the session")
        };
        assert!(
            reason.contains("pid 42") && reason.contains("`sudo kill -CONT 42`"),
            "{reason}"
        );
        // It answers again and has the session: running, nothing re-opened.
        let sessions = root(&["s1"]);
        assert_eq!(
            reconcile_change("s1", STATE_DEGRADED, Ok(&sessions)),
            Some(Change::Running)
        );
        assert_eq!(reconcile_change("s1", STATE_RUNNING, Ok(&sessions)), None);
        // Its process is gone: lost, as before.
        for state in [STATE_RUNNING, STATE_DEGRADED] {
            let Some(Change::Lost(reason)) = reconcile_change("s1", state, Err(Liveness::Gone))
            else {
                panic!("a gone root daemon loses the session")
            };
            assert!(reason.contains("not running any more"), "{reason}");
        }
        // It answers without the session (restarted): lost.
        let other = root(&["s2"]);
        assert!(matches!(
            reconcile_change("s1", STATE_DEGRADED, Ok(&other)),
            Some(Change::Lost(r)) if r.contains("no longer has this session")
        ));
    }
}
