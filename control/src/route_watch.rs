//! The laptop side of the route and DNS discovery stream (issue [kube-connect]
//! item 6): the session agent subscribes to the traffic manager's `WatchRoutes`
//! and keeps the root daemon's watched routes, route source, cluster DNS
//! settings and Service list of its session up to date (`UpdateRoutes`).
//!
//! [`RouteWatchState`] is the pure core: `RoutesUpdate`s in, `UpdateRoutes`
//! requests out. The routes it asks for are only what the session's Connect
//! routes do not already cover: pod CIDRs of the watch beyond the detected ones
//! (e.g. a new node's podCIDR) and ClusterIPs outside the detected service CIDR
//! (as /32 or /128), with the laptop's essentials (API server, nameservers,
//! gateways) cut out exactly as at connect ([`crate::connect::cluster_routes`],
//! case rt-02).
//!
//! [`run`] is the shell. I/O: a `pods/portforward` to the manager pod's gRPC
//! port (as for `Lease`), the root daemon's Unix socket. When the watch is not
//! allowed (PERMISSION_DENIED: the manager lacks the RBAC for it) or not
//! possible (FAILED_PRECONDITION, UNIMPLEMENTED: an older manager), the session
//! keeps its connect-time CIDRs and the source reads "cidr-only: <reason>"; the
//! agent asks again every [`FALLBACK_RETRY`]. Other failures (the port-forward
//! or the manager pod died) are retried with backoff ([`RECONNECT_BACKOFF`]);
//! the routes already installed stay meanwhile.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use ipnet::IpNet;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kvpn_proto::dataplane::{ClusterDns, ClusterService, Route, RouteSource, UpdateRoutesRequest};
use kvpn_proto::manager::manager_client::ManagerClient;
use kvpn_proto::manager::{RoutesUpdate, ServiceRecord, WatchRoutesRequest};
use tracing::{info, warn};

use crate::{agent, connect, daemon, lease};

/// `RouteSource.mode` while the watch drives the routes.
pub const MODE_WATCH: &str = "watch";
/// `RouteSource.mode` when only the connect-time CIDRs are routed.
pub const MODE_CIDR_ONLY: &str = "cidr-only";

/// First and longest pause before re-subscribing after the stream broke (the
/// port-forward died, the manager pod was replaced). The agent's data channel
/// waits up to 4 s for a new manager pod; the watch follows within a few seconds.
pub const RECONNECT_BACKOFF: (Duration, Duration) =
    (Duration::from_millis(500), Duration::from_secs(10));

/// How often to ask again after the manager refused the watch for good
/// (RBAC, an older manager): one cheap call, in case someone fixed it.
pub const FALLBACK_RETRY: Duration = Duration::from_secs(30);

/// The watch as the laptop knows it, and the watched routes installed.
#[derive(Debug, Clone)]
pub struct RouteWatchState {
    /// The session's Connect routes (never re-added, never removed).
    connect: Vec<IpNet>,
    /// Addresses never routed into the tunnel (rt-02).
    keep_out: Vec<IpAddr>,
    /// Ranges never routed into the tunnel (`--never-proxy`).
    never_proxy: Vec<IpNet>,
    /// `--extra-domain` names and the cluster DNS's last answer for each
    /// (`None` until asked): addresses, or why there are none.
    extra: BTreeMap<String, Option<Result<Vec<IpAddr>, String>>>,
    pod_cidrs: BTreeSet<IpNet>,
    pod_cidr_source: String,
    services: BTreeMap<(String, String), ServiceRecord>,
    dns: Option<ClusterDns>,
    /// The watched routes the root daemon has (as last acknowledged).
    installed: BTreeMap<IpNet, i32>,
    /// The next request must carry the full Service list and the DNS settings
    /// (after a snapshot, or a request the root daemon did not take).
    resync: bool,
    /// Service changes since the last acknowledged request.
    services_upsert: BTreeMap<(String, String), ClusterService>,
    services_remove: BTreeSet<(String, String)>,
    dns_changed: bool,
    /// IPv6 is off on the laptop (rt-08): IPv6 pod CIDRs and ClusterIPs of the
    /// watch are not asked for (the kernel would refuse them on the TUN device).
    ipv4_only: bool,
}

fn service_for_daemon(s: &ServiceRecord) -> ClusterService {
    ClusterService {
        namespace: s.namespace.clone(),
        name: s.name.clone(),
        cluster_ips: s.cluster_ips.clone(),
        ports: s
            .ports
            .iter()
            .map(|p| {
                if p.name.is_empty() {
                    format!("{}/{}", p.port, p.protocol)
                } else {
                    format!("{}:{}/{}", p.name, p.port, p.protocol)
                }
            })
            .collect(),
    }
}

fn dns_for_daemon(d: &kvpn_proto::manager::ClusterDns) -> ClusterDns {
    ClusterDns {
        servers: d.servers.clone(),
        domain: d.domain.clone(),
        search: d.search.clone(),
        // The forwarder's suffixes come with Connect only; this copy is for status.
        include_suffixes: Vec::new(),
        exclude_suffixes: Vec::new(),
    }
}

impl RouteWatchState {
    /// A state for a session whose Connect routes are `connect`.
    pub fn new(connect: Vec<IpNet>, keep_out: Vec<IpAddr>) -> Self {
        Self {
            connect,
            keep_out,
            never_proxy: Vec::new(),
            extra: BTreeMap::new(),
            pod_cidrs: BTreeSet::new(),
            pod_cidr_source: String::new(),
            services: BTreeMap::new(),
            dns: None,
            installed: BTreeMap::new(),
            resync: true,
            services_upsert: BTreeMap::new(),
            services_remove: BTreeSet::new(),
            dns_changed: false,
            ipv4_only: false,
        }
    }

    /// Never route `ranges` (`kvpn connect --never-proxy`).
    pub fn never_proxy(mut self, ranges: Vec<IpNet>) -> Self {
        self.never_proxy = ranges;
        self
    }

    /// Resolve `names` through the cluster DNS and route their answers.
    pub fn extra_domains(mut self, names: &[String]) -> Self {
        self.extra = names
            .iter()
            .map(|n| (n.trim().trim_end_matches('.').to_ascii_lowercase(), None))
            .filter(|(n, _)| !n.is_empty())
            .collect();
        self
    }

    /// The `--extra-domain` names, and the cluster DNS servers to ask
    /// (empty until the watch reported them).
    pub fn extra_to_resolve(&self) -> (Vec<String>, Vec<String>) {
        (
            self.extra.keys().cloned().collect(),
            self.dns
                .as_ref()
                .map(|d| d.servers.clone())
                .unwrap_or_default(),
        )
    }

    /// Take in the cluster DNS's answer for an `--extra-domain` name; whether
    /// it changed what the session should route or report.
    pub fn handle_extra_answer(&mut self, name: &str, answer: Result<Vec<IpAddr>, String>) -> bool {
        let answer = answer.map(|mut ips| {
            ips.retain(|ip| !(self.ipv4_only && ip.is_ipv6()));
            ips.sort_unstable();
            ips.dedup();
            ips
        });
        match self.extra.get_mut(name) {
            Some(slot) if slot.as_ref() != Some(&answer) => {
                *slot = Some(answer);
                true
            }
            _ => false,
        }
    }

    /// Leave IPv6 routes out (a laptop with IPv6 off, rt-08).
    pub fn ipv4_only(mut self, on: bool) -> Self {
        self.ipv4_only = on;
        self
    }

    /// Take in one message of the stream (malformed CIDRs and IPs are skipped
    /// with a warning: the manager's input is the network's).
    pub fn handle_update(&mut self, u: &RoutesUpdate) {
        if u.snapshot {
            self.pod_cidrs.clear();
            self.services.clear();
            self.resync = true;
        }
        for c in &u.pod_cidrs_removed {
            if let Ok(net) = c.parse::<IpNet>() {
                self.pod_cidrs.remove(&net.trunc());
            }
        }
        for c in &u.pod_cidrs_added {
            match c.parse::<IpNet>() {
                Ok(net) => {
                    self.pod_cidrs.insert(net.trunc());
                }
                Err(_) => warn!(cidr = %c, "the traffic manager sent an invalid pod CIDR; ignored"),
            }
        }
        for k in &u.services_removed {
            let key = (k.namespace.clone(), k.name.clone());
            self.services.remove(&key);
            self.services_upsert.remove(&key);
            self.services_remove.insert(key);
        }
        for s in &u.services_upserted {
            let key = (s.namespace.clone(), s.name.clone());
            self.services_remove.remove(&key);
            self.services_upsert
                .insert(key.clone(), service_for_daemon(s));
            self.services.insert(key, s.clone());
        }
        if let Some(d) = &u.dns {
            self.dns = Some(dns_for_daemon(d));
            self.dns_changed = true;
        }
        if !u.pod_cidr_source.is_empty() {
            self.pod_cidr_source = u.pod_cidr_source.clone();
        }
    }

    /// The watched routes the session should have: pod CIDRs and ClusterIPs the
    /// Connect routes do not cover, essentials cut out.
    pub fn desired(&self) -> BTreeMap<IpNet, i32> {
        let pods: Vec<IpNet> = self.pod_cidrs.iter().copied().collect();
        let cluster_ips: Vec<IpNet> = self
            .services
            .values()
            .flat_map(|s| s.cluster_ips.iter())
            .filter_map(|ip| ip.parse::<IpAddr>().ok())
            .map(IpNet::from)
            .collect();
        let pod_needed = kvpn_proto::cidr::subtract(&pods, &self.connect);
        let svc_needed = kvpn_proto::cidr::subtract(&cluster_ips, &self.connect);
        let extra_ips: Vec<IpNet> = self
            .extra
            .values()
            .flat_map(|a| a.iter().flat_map(|r| r.iter().flatten()))
            .map(|ip| IpNet::from(*ip))
            .collect();
        let extra_needed = kvpn_proto::cidr::subtract(&extra_ips, &self.connect);
        let mut out = BTreeMap::new();
        for r in connect::cluster_routes_avoiding(
            &pod_needed,
            &svc_needed,
            &extra_needed,
            &self.keep_out,
            &self.never_proxy,
        ) {
            if let Ok(net) = r.cidr.parse::<IpNet>()
                && !(self.ipv4_only && net.addr().is_ipv6())
            {
                out.entry(net).or_insert(r.kind);
            }
        }
        out
    }

    /// The request that brings the root daemon to this state, with the route
    /// source "watch" (`reason` empty when all is well).
    pub fn request(&self, session_id: &str, reason: &str) -> UpdateRoutesRequest {
        let desired = self.desired();
        let route = |(cidr, kind): (&IpNet, &i32)| Route {
            cidr: cidr.to_string(),
            kind: *kind,
            watched: true,
        };
        let add: Vec<Route> = desired
            .iter()
            .filter(|(c, k)| self.installed.get(*c) != Some(*k))
            .map(route)
            .collect();
        let remove: Vec<Route> = self
            .installed
            .iter()
            .filter(|(c, k)| desired.get(*c) != Some(*k))
            .map(route)
            .collect();
        let (services_upsert, services_remove) = if self.resync {
            (
                self.services.values().map(service_for_daemon).collect(),
                Vec::new(),
            )
        } else {
            (
                self.services_upsert.values().cloned().collect(),
                self.services_remove
                    .iter()
                    .map(|(namespace, name)| ClusterService {
                        namespace: namespace.clone(),
                        name: name.clone(),
                        ..Default::default()
                    })
                    .collect(),
            )
        };
        UpdateRoutesRequest {
            session_id: session_id.to_owned(),
            add,
            remove,
            route_source: Some(RouteSource {
                mode: MODE_WATCH.to_owned(),
                reason: reason.to_owned(),
                pod_cidr_source: self.pod_cidr_source.clone(),
                pod_cidrs: self.pod_cidrs.iter().map(ToString::to_string).collect(),
                extra_domains: self.extra_report(),
            }),
            dns: if self.resync || self.dns_changed {
                self.dns.clone()
            } else {
                None
            },
            services_replace: self.resync,
            services_upsert,
            services_remove,
        }
    }

    /// The `--extra-domain` names as last resolved, for status.
    pub fn extra_report(&self) -> Vec<kvpn_proto::dataplane::ExtraDomain> {
        self.extra
            .iter()
            .map(|(name, answer)| kvpn_proto::dataplane::ExtraDomain {
                name: name.clone(),
                addresses: match answer {
                    Some(Ok(ips)) => ips.iter().map(ToString::to_string).collect(),
                    _ => Vec::new(),
                },
                error: match answer {
                    None => "not asked yet: the cluster DNS is not known yet".to_owned(),
                    Some(Ok(ips)) if ips.is_empty() => {
                        "the cluster DNS has no address for it (NOERROR, no A/AAAA)".to_owned()
                    }
                    Some(Ok(_)) => String::new(),
                    Some(Err(e)) => e.clone(),
                },
            })
            .collect()
    }

    /// The root daemon took `request(..)`: its routes are now the desired ones.
    pub fn acknowledge(&mut self) {
        self.installed = self.desired();
        self.resync = false;
        self.dns_changed = false;
        self.services_upsert.clear();
        self.services_remove.clear();
    }

    /// The root daemon did not take the last request: send everything next time.
    pub fn refused(&mut self) {
        self.resync = true;
    }
}

/// A request that only reports the route source (no route changes).
pub fn source_request(session_id: &str, mode: &str, reason: &str) -> UpdateRoutesRequest {
    UpdateRoutesRequest {
        session_id: session_id.to_owned(),
        route_source: Some(RouteSource {
            mode: mode.to_owned(),
            reason: reason.to_owned(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// How the agent's watch failed.
#[derive(Debug)]
enum WatchEnd {
    /// The manager refused it for good: CIDR-only routing.
    Refused(String),
    /// Something broke on the way; retry with backoff.
    Broken(String),
}

/// What the route watch of one session agent needs.
#[derive(Debug, Clone)]
pub struct WatchConfig {
    pub manager_namespace: String,
    /// The manager's gRPC port (10802).
    pub grpc_port: u16,
    /// The client's namespace (the DNS search list starts with it).
    pub namespace: String,
    /// Addresses never routed into the tunnel.
    pub keep_out: Vec<IpAddr>,
    /// Ranges never routed into the tunnel (`--never-proxy`).
    pub never_proxy: Vec<IpNet>,
    /// Names resolved through the cluster DNS, their answers routed
    /// (`--extra-domain`).
    pub extra_domains: Vec<String>,
    /// The root daemon's runtime folder.
    pub runtime_dir: PathBuf,
    /// The agent's data listener: the session whose manager address this is
    /// belongs to this agent.
    pub data_addr: SocketAddr,
}

/// The session id, Connect routes and whether it is a `kvpn run` session, of the
/// root daemon's session whose manager address is `data_addr`; waits
/// (polling) until the CLI created it.
async fn find_session(cfg: &WatchConfig) -> (String, Vec<IpNet>, bool) {
    let wanted = cfg.data_addr.to_string();
    let mut logged = false;
    loop {
        let found = async {
            let mut client = daemon::connect_existing(&cfg.runtime_dir)
                .await?
                .ok_or_else(|| anyhow!("the root daemon is not running"))?;
            let sessions =
                daemon::sessions(&mut client, "cannot ask the root daemon for its sessions")
                    .await?;
            anyhow::Ok(sessions.into_iter().find(|s| s.manager == wanted))
        }
        .await;
        match found {
            Ok(Some(s)) => {
                let connect: Vec<IpNet> = s
                    .routes
                    .iter()
                    .filter(|r| !r.watched)
                    .filter_map(|r| r.cidr.parse().ok())
                    .collect();
                let run = !s.run_dns.is_empty();
                return (s.id, connect, run);
            }
            Ok(None) => {}
            Err(e) if !logged => {
                info!("waiting for the session of {wanted}: {e:#}");
                logged = true;
            }
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn push(cfg: &WatchConfig, req: UpdateRoutesRequest) -> Result<()> {
    let mut client = daemon::connect_existing(&cfg.runtime_dir)
        .await?
        .ok_or_else(|| anyhow!("the root daemon is not running"))?;
    let resp = client
        .update_routes(req)
        .await
        .map_err(daemon::status_to_error)
        .context("the root daemon refused the route update")?
        .into_inner();
    for c in &resp.added {
        info!(cidr = %c, "watched route added");
    }
    for c in &resp.removed {
        info!(cidr = %c, "watched route removed");
    }
    Ok(())
}

/// One subscription: until the stream ends. Every message goes to the root
/// daemon before the next is read.
async fn watch_once(
    client: &kube::Client,
    cfg: &WatchConfig,
    session_id: &str,
    path: DnsPath<'_>,
    state: &mut RouteWatchState,
    healthy: &mut bool,
) -> WatchEnd {
    let api: Api<Pod> = Api::namespaced(client.clone(), &cfg.manager_namespace);
    let pod = match agent::ready_manager_pod(&api).await {
        Ok(p) => p,
        Err(e) => return WatchEnd::Broken(format!("{e:#}")),
    };
    let (pf, channel) = match lease::grpc_channel(&api, &pod, cfg.grpc_port).await {
        Ok(c) => c,
        Err(e) => return WatchEnd::Broken(format!("{e:#}")),
    };
    let end = async {
        let mut stream = match ManagerClient::new(channel)
            .watch_routes(WatchRoutesRequest {
                namespace: cfg.namespace.clone(),
            })
            .await
        {
            Ok(r) => r.into_inner(),
            Err(s) => return end_of(&s),
        };
        info!(%pod, namespace = %cfg.namespace, "watching routes");
        let mut refresh = tokio::time::interval(EXTRA_DOMAIN_REFRESH);
        refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick is immediate; the first update resolves anyway.
        refresh.tick().await;
        loop {
            let message = tokio::select! {
                m = stream.message() => m,
                _ = refresh.tick(), if !cfg.extra_domains.is_empty() => {
                    if resolve_extra(state, path).await {
                        match push(cfg, state.request(session_id, "")).await {
                            Ok(()) => state.acknowledge(),
                            Err(e) => {
                                warn!("{e:#}");
                                state.refused();
                            }
                        }
                    }
                    continue;
                }
            };
            match message {
                Ok(Some(update)) => {
                    state.handle_update(&update);
                    if update.snapshot || update.dns.is_some() {
                        resolve_extra(state, path).await;
                    }
                    match push(cfg, state.request(session_id, "")).await {
                        Ok(()) => {
                            state.acknowledge();
                            *healthy = true;
                        }
                        Err(e) => {
                            warn!("{e:#}");
                            state.refused();
                        }
                    }
                }
                Ok(None) => {
                    return WatchEnd::Broken("the traffic manager ended the route watch".into());
                }
                Err(s) => return end_of(&s),
            }
        }
    }
    .await;
    pf.abort();
    end
}

/// How often `--extra-domain` names are asked again: their answers can change
/// (a failover, a DNS-balanced service); the lab's cluster DNS gives TTL 5 s,
/// CoreDNS's default is 30 s.
pub const EXTRA_DOMAIN_REFRESH: Duration = Duration::from_secs(30);

/// How long one question to the cluster DNS may take (each of A and AAAA, two
/// tries): through the tunnel a cluster DNS answers in milliseconds.
const EXTRA_DOMAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// How the route watch asks the cluster DNS for `--extra-domain` names.
#[derive(Debug, Clone, Copy)]
enum DnsPath<'a> {
    /// UDP from the user daemon to the cluster DNS (a laptop-wide session: its
    /// routes are the laptop's).
    Direct,
    /// Through the root daemon to the run session's own DNS forwarder, as the
    /// run's processes ask (`RunDnsQuery`): the user daemon is outside the run's
    /// cgroup, so its own sockets have no route to this cluster's DNS and could
    /// reach another cluster's, or the LAN's, at the same address (#27 F4).
    Run {
        runtime_dir: &'a std::path::Path,
        session_id: &'a str,
    },
}

/// Ask the cluster DNS for every `--extra-domain` name; whether anything changed.
async fn resolve_extra(state: &mut RouteWatchState, path: DnsPath<'_>) -> bool {
    let (names, servers) = state.extra_to_resolve();
    if names.is_empty() || servers.is_empty() {
        return false;
    }
    let mut changed = false;
    for name in names {
        let answer = resolve_through(path, &servers, &name).await;
        match &answer {
            Ok(ips) => {
                info!(%name, addresses = ?ips, "extra domain resolved through the cluster DNS")
            }
            Err(e) => warn!(%name, error = %e, "extra domain not resolved"),
        }
        changed |= state.handle_extra_answer(&name, answer);
    }
    changed
}

/// One question to `addr` over UDP from the user daemon, two tries.
async fn ask_direct(addr: SocketAddr, q: &hickory_proto::op::Message) -> std::io::Result<Vec<u8>> {
    let bytes = q.to_vec().map_err(std::io::Error::other)?;
    let bind: SocketAddr = if addr.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let sock = tokio::net::UdpSocket::bind(bind).await?;
    sock.connect(addr).await?;
    let mut buf = vec![0u8; 4096];
    for _ in 0..2 {
        sock.send(&bytes).await?;
        if let Ok(n) = tokio::time::timeout(EXTRA_DOMAIN_TIMEOUT, sock.recv(&mut buf)).await {
            let n = n?;
            if hickory_proto::op::Message::from_vec(&buf[..n])
                .is_ok_and(|m| m.metadata.id == q.metadata.id)
            {
                return Ok(buf[..n].to_vec());
            }
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!(
            "no answer within {} s, twice",
            EXTRA_DOMAIN_TIMEOUT.as_secs()
        ),
    ))
}

/// One question through the root daemon to run session `session_id`'s DNS
/// forwarder ([`DnsPath::Run`]).
async fn ask_in_run(
    runtime_dir: &std::path::Path,
    session_id: &str,
    q: &hickory_proto::op::Message,
) -> std::io::Result<Vec<u8>> {
    let query = q.to_vec().map_err(std::io::Error::other)?;
    let mut client = daemon::connect_existing(runtime_dir)
        .await
        .map_err(|e| std::io::Error::other(format!("{e:#}")))?
        .ok_or_else(|| std::io::Error::other("the root daemon is not running"))?;
    let answer = client
        .run_dns_query(kvpn_proto::dataplane::RunDnsQueryRequest {
            session_id: session_id.to_owned(),
            query,
        })
        .await
        .map_err(|s| std::io::Error::other(s.message().to_owned()))?
        .into_inner()
        .answer;
    Ok(answer)
}

/// The A and AAAA addresses of `name` from the first of `servers` that
/// answers (UDP, port 53 unless given), asked along `path`.
async fn resolve_through(
    path: DnsPath<'_>,
    servers: &[String],
    name: &str,
) -> Result<Vec<IpAddr>, String> {
    use hickory_proto::op::{Message, Query, ResponseCode};
    use hickory_proto::rr::{Name, RData, RecordType};
    let fqdn = Name::from_ascii(format!("{name}.")).map_err(|e| {
        format!("{name:?} is not a domain name ({e}) — give a name such as db.corp.example")
    })?;
    // A run's forwarder picks among the cluster DNS servers itself.
    let servers = match path {
        DnsPath::Direct => servers,
        DnsPath::Run { .. } => &servers[..servers.len().min(1)],
    };
    let mut last = String::from("no cluster DNS server");
    for server in servers {
        let addr: SocketAddr = match server.parse::<SocketAddr>() {
            Ok(a) => a,
            Err(_) => match server.parse::<IpAddr>() {
                Ok(ip) => SocketAddr::new(ip, 53),
                Err(_) => continue,
            },
        };
        let asked = match path {
            DnsPath::Direct => format!("the cluster DNS {addr}"),
            DnsPath::Run { .. } => "the cluster DNS (through the run's DNS forwarder)".to_owned(),
        };
        let mut ips = Vec::new();
        let mut nx = false;
        let mut failed = None;
        for qtype in [RecordType::A, RecordType::AAAA] {
            let mut q = Message::query();
            q.metadata.id = rand::random();
            q.metadata.recursion_desired = true;
            q.add_query(Query::query(fqdn.clone(), qtype));
            let raw = match path {
                DnsPath::Direct => ask_direct(addr, &q).await,
                DnsPath::Run {
                    runtime_dir,
                    session_id,
                } => ask_in_run(runtime_dir, session_id, &q).await,
            };
            let answer = raw.and_then(|raw| {
                Message::from_vec(&raw)
                    .map_err(std::io::Error::other)
                    .and_then(|m| {
                        if m.metadata.id == q.metadata.id {
                            Ok(m)
                        } else {
                            Err(std::io::Error::other("an answer to another question"))
                        }
                    })
            });
            match answer {
                Ok(m) if m.metadata.response_code == ResponseCode::NXDomain => nx = true,
                Ok(m) if m.metadata.response_code == ResponseCode::NoError => {
                    ips.extend(m.answers.iter().filter_map(|r| match &r.data {
                        RData::A(a) => Some(IpAddr::V4(a.0)),
                        RData::AAAA(a) => Some(IpAddr::V6(a.0)),
                        _ => None,
                    }));
                }
                Ok(m) => {
                    failed = Some(format!("{asked} answered {}", m.metadata.response_code));
                }
                Err(e) => failed = Some(format!("{asked}: {e}")),
            }
        }
        if nx {
            return Err(format!(
                "does not exist in {asked} (NXDOMAIN) — check the name; kvpn asks again every {} s",
                EXTRA_DOMAIN_REFRESH.as_secs()
            ));
        }
        if !ips.is_empty() || failed.is_none() {
            return Ok(ips);
        }
        last = failed.unwrap_or_default();
    }
    Err(last)
}

fn end_of(s: &tonic::Status) -> WatchEnd {
    use tonic::Code;
    match s.code() {
        Code::PermissionDenied | Code::FailedPrecondition => WatchEnd::Refused(s.message().to_owned()),
        Code::Unimplemented => WatchEnd::Refused(
            "the traffic manager has no route watch (an older version) — `kvpn connect` upgrades it".to_owned(),
        ),
        _ => WatchEnd::Broken(format!("{}: {}", s.code(), s.message())),
    }
}

/// Run the route watch of one session until the agent stops.
pub async fn run(client: kube::Client, cfg: WatchConfig) {
    let (session_id, connect_routes, run) = find_session(&cfg).await;
    let path = if run {
        DnsPath::Run {
            runtime_dir: &cfg.runtime_dir,
            session_id: &session_id,
        }
    } else {
        DnsPath::Direct
    };
    info!(session = %session_id, routes = connect_routes.len(), "route watch for session");
    let mut state = RouteWatchState::new(connect_routes, cfg.keep_out.clone())
        .ipv4_only(connect::laptop_ipv6_off().is_some())
        .never_proxy(cfg.never_proxy.clone())
        .extra_domains(&cfg.extra_domains);
    let mut backoff = RECONNECT_BACKOFF.0;
    let mut ever_watched = false;
    loop {
        let mut healthy = false;
        let end = watch_once(&client, &cfg, &session_id, path, &mut state, &mut healthy).await;
        if healthy {
            backoff = RECONNECT_BACKOFF.0;
            ever_watched = true;
        }
        let (req, pause) = match &end {
            WatchEnd::Refused(reason) => {
                warn!(%reason, "no route watch: routing the connect-time CIDRs only");
                (
                    source_request(&session_id, MODE_CIDR_ONLY, reason),
                    FALLBACK_RETRY,
                )
            }
            WatchEnd::Broken(reason) => {
                warn!(%reason, retry_in_ms = backoff.as_millis(), "route watch broken; re-subscribing");
                let req = if !ever_watched {
                    // Never watched yet: nothing to keep, say what is happening.
                    source_request(
                        &session_id,
                        MODE_CIDR_ONLY,
                        &format!("route watch not started: {reason}"),
                    )
                } else {
                    source_request(&session_id, MODE_WATCH, &format!("reconnecting: {reason}"))
                };
                let pause = backoff;
                backoff = (backoff * 2).min(RECONNECT_BACKOFF.1);
                (req, pause)
            }
        };
        if let Err(e) = push(&cfg, req).await {
            warn!("{e:#}");
        }
        // The snapshot of the next subscription replaces what the manager sent.
        state.refused();
        tokio::time::sleep(pause).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpn_proto::dataplane::RouteKind;
    use kvpn_proto::manager::{ServiceKey, ServicePort};

    fn nets(s: &[&str]) -> Vec<IpNet> {
        s.iter().map(|c| c.parse().expect("test CIDR")).collect()
    }

    fn svc(ns: &str, name: &str, ip: &str) -> ServiceRecord {
        ServiceRecord {
            namespace: ns.into(),
            name: name.into(),
            cluster_ips: vec![ip.into()],
            ports: vec![ServicePort {
                name: "http".into(),
                port: 80,
                protocol: "TCP".into(),
            }],
        }
    }

    fn cidrs(routes: &[Route]) -> Vec<&str> {
        routes.iter().map(|r| r.cidr.as_str()).collect()
    }

    fn snapshot() -> RoutesUpdate {
        RoutesUpdate {
            snapshot: true,
            pod_cidrs_added: vec!["10.244.1.0/24".into()],
            services_upserted: vec![svc("default", "web", "10.96.0.100")],
            dns: Some(kvpn_proto::manager::ClusterDns {
                servers: vec!["10.96.0.10".into()],
                domain: "cluster.local".into(),
                search: vec![
                    "default.svc.cluster.local".into(),
                    "svc.cluster.local".into(),
                    "cluster.local".into(),
                ],
            }),
            pod_cidr_source: "pod IPs".into(),
            ..Default::default()
        }
    }

    /// `--extra-domain` answers become extra /32 routes (not those a Connect
    /// route covers, not inside --never-proxy), reported with their addresses;
    /// a name without addresses is reported with why; an unchanged answer asks
    /// for no new request.
    #[test]
    fn extra_domain_answers_are_routed_and_reported() {
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
        let mut st = RouteWatchState::new(vec!["10.96.0.0/12".parse().expect("cidr")], vec![])
            .never_proxy(vec!["198.18.9.0/24".parse().expect("cidr")])
            .extra_domains(&["DB.corp.example.".to_owned(), "nosuch.example".to_owned()]);
        // Nothing to ask before the watch gave the cluster DNS.
        assert_eq!(st.extra_to_resolve().1, Vec::<String>::new());
        st.handle_update(&snapshot());
        let (names, servers) = st.extra_to_resolve();
        assert_eq!(names, ["db.corp.example", "nosuch.example"]);
        assert_eq!(servers, ["10.96.0.10"]);
        assert!(st.handle_extra_answer(
            "db.corp.example",
            Ok(vec![
                ip("198.18.5.44"),
                ip("10.96.3.3"),
                ip("198.18.9.9"),
                ip("198.18.5.44")
            ]),
        ));
        assert!(st.handle_extra_answer("nosuch.example", Err("does not exist (NXDOMAIN)".into())));
        // The same answer again changes nothing.
        assert!(!st.handle_extra_answer(
            "db.corp.example",
            Ok(vec![ip("198.18.9.9"), ip("10.96.3.3"), ip("198.18.5.44")])
        ));
        let req = st.request("s1", "");
        let added = cidrs(&req.add);
        assert!(added.contains(&"198.18.5.44/32"), "{added:?}");
        assert!(
            !added.iter().any(|c| c.starts_with("10.96.3.3")),
            "covered by Connect: {added:?}"
        );
        assert!(
            !added.iter().any(|c| c.starts_with("198.18.9.")),
            "--never-proxy: {added:?}"
        );
        let report = req.route_source.expect("source").extra_domains;
        assert_eq!(report.len(), 2);
        assert_eq!(report[0].name, "db.corp.example");
        assert_eq!(
            report[0].addresses,
            ["10.96.3.3", "198.18.5.44", "198.18.9.9"]
        );
        assert_eq!(report[0].error, "");
        assert_eq!(report[1].name, "nosuch.example");
        assert!(report[1].addresses.is_empty());
        assert!(report[1].error.contains("NXDOMAIN"));
        // A later answer without the address removes its route.
        st.acknowledge();
        assert!(st.handle_extra_answer("db.corp.example", Ok(vec![ip("198.18.6.6")])));
        let req = st.request("s1", "");
        assert_eq!(cidrs(&req.add), ["198.18.6.6/32"]);
        assert_eq!(cidrs(&req.remove), ["198.18.5.44/32"]);
    }

    #[test]
    fn an_ipv4_only_laptop_asks_for_no_ipv6_routes() {
        let update = RoutesUpdate {
            snapshot: true,
            pod_cidrs_added: vec!["10.244.7.0/24".into(), "fd00:10:244:7::/64".into()],
            services_upserted: vec![svc("default", "web6", "fd00:10:96::100")],
            ..Default::default()
        };
        let mut dual = RouteWatchState::new(vec![], vec![]);
        dual.handle_update(&update);
        assert_eq!(
            cidrs(&dual.request("s1", "").add),
            ["10.244.7.0/24", "fd00:10:96::100/128", "fd00:10:244:7::/64"]
        );
        let mut v4 = RouteWatchState::new(vec![], vec![]).ipv4_only(true);
        v4.handle_update(&update);
        assert_eq!(cidrs(&v4.request("s1", "").add), ["10.244.7.0/24"]);
    }

    #[test]
    fn only_what_connect_does_not_cover_is_routed() {
        let mut st = RouteWatchState::new(
            nets(&["10.244.1.0/24", "10.96.0.0/12"]),
            vec!["10.244.7.53".parse().expect("ip")],
        );
        st.handle_update(&snapshot());
        let req = st.request("s1", "");
        assert!(req.add.is_empty(), "everything is covered: {:?}", req.add);
        assert!(req.services_replace);
        assert_eq!(req.services_upsert.len(), 1);
        assert_eq!(req.services_upsert[0].ports, vec!["http:80/TCP"]);
        assert_eq!(
            req.dns.as_ref().map(|d| d.servers.clone()),
            Some(vec!["10.96.0.10".to_owned()])
        );
        assert_eq!(
            req.route_source.as_ref().map(|s| s.mode.as_str()),
            Some(MODE_WATCH)
        );
        st.acknowledge();

        // Another node's pods, and a ClusterIP outside the detected service CIDR.
        st.handle_update(&RoutesUpdate {
            pod_cidrs_added: vec!["10.244.7.0/24".into()],
            services_upserted: vec![svc("team", "odd", "192.168.200.5")],
            ..Default::default()
        });
        let req = st.request("s1", "");
        // 10.244.7.53 (a laptop nameserver, say) stays out of the tunnel.
        assert!(!req.add.iter().any(|r| {
            r.cidr
                .parse::<IpNet>()
                .expect("cidr")
                .contains(&"10.244.7.53".parse::<IpAddr>().expect("ip"))
        }));
        assert!(
            req.add
                .iter()
                .any(|r| r.cidr == "10.244.7.0/27" && r.kind == RouteKind::Pod as i32),
            "{:?}",
            cidrs(&req.add)
        );
        assert!(
            req.add
                .iter()
                .any(|r| r.cidr == "192.168.200.5/32" && r.kind == RouteKind::Service as i32)
        );
        assert!(!req.services_replace);
        assert_eq!(req.services_upsert.len(), 1, "only the new Service");
        assert!(req.dns.is_none(), "DNS unchanged");
        st.acknowledge();
        assert!(
            st.request("s1", "").add.is_empty(),
            "nothing new after the ack"
        );

        // The pods and the Service go: their routes go.
        st.handle_update(&RoutesUpdate {
            pod_cidrs_removed: vec!["10.244.7.0/24".into()],
            services_removed: vec![ServiceKey {
                namespace: "team".into(),
                name: "odd".into(),
            }],
            ..Default::default()
        });
        let req = st.request("s1", "");
        assert!(req.add.is_empty());
        assert!(cidrs(&req.remove).contains(&"192.168.200.5/32"));
        assert!(cidrs(&req.remove).contains(&"10.244.7.0/27"));
        assert_eq!(req.services_remove.len(), 1);
        st.acknowledge();
        assert!(st.installed.is_empty());
    }

    #[test]
    fn a_new_snapshot_replaces_everything_and_a_refused_request_resyncs() {
        let mut st = RouteWatchState::new(nets(&["10.96.0.0/12"]), vec![]);
        st.handle_update(&snapshot());
        assert_eq!(cidrs(&st.request("s", "").add), vec!["10.244.1.0/24"]);
        st.acknowledge();
        // A refused delta: the next request carries the full Service list again.
        st.handle_update(&RoutesUpdate {
            services_upserted: vec![svc("default", "late", "10.96.9.9")],
            ..Default::default()
        });
        st.refused();
        let req = st.request("s", "");
        assert!(req.services_replace);
        assert_eq!(req.services_upsert.len(), 2);
        assert!(req.dns.is_some());
        st.acknowledge();
        // After a re-subscription the snapshot no longer has the pod CIDR.
        st.handle_update(&RoutesUpdate {
            snapshot: true,
            ..Default::default()
        });
        let req = st.request("s", "");
        assert_eq!(cidrs(&req.remove), vec!["10.244.1.0/24"]);
        assert!(req.services_replace && req.services_upsert.is_empty());
    }

    #[test]
    fn garbage_from_the_manager_is_skipped() {
        let mut st = RouteWatchState::new(vec![], vec![]);
        st.handle_update(&RoutesUpdate {
            snapshot: true,
            pod_cidrs_added: vec!["not a cidr".into(), "10.244.9.9/24".into()],
            services_upserted: vec![svc("a", "b", "nonsense")],
            ..Default::default()
        });
        assert_eq!(
            st.desired().keys().copied().collect::<Vec<_>>(),
            nets(&["10.244.9.0/24"])
        );
    }
}
