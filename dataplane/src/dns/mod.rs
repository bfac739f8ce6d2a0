//! Split DNS on the laptop (issue dns-fidelity item 1, cases dns-01…dns-09):
//! cluster names go to the cluster DNS through the tunnel, every other name keeps
//! going to the laptop's own resolvers, unchanged.
//!
//! Two ways, chosen when the first session with cluster DNS starts ([`Mode`]):
//! - **systemd-resolved** manages the laptop's DNS (resolv.conf names only its
//!   stub and `resolvectl` answers): per-link DNS on each session's TUN device
//!   ([`resolved`]); resolv.conf is not touched.
//! - otherwise, the **forwarder** ([`forwarder`]) owned by this daemon listens on
//!   [`DEFAULT_LISTEN_IP`]:53 (env `KVPN_DNS_IP`), a loopback address no common
//!   local stub uses (systemd-resolved has 127.0.0.53/54, dnsmasq and unbound
//!   127.0.0.1), and resolv.conf (env `KVPN_RESOLV_CONF`, default
//!   `/etc/resolv.conf`) names it, restored byte for byte afterwards
//!   ([`resolv_conf`]). The forwarder's upstreams are the nameservers of the
//!   resolv.conf as it was before kvpn changed it.
//!
//! One forwarder serves every session of the daemon (most recent session first).
//! While a session is not connected (reconnecting: its transport is down or
//! silent), the forwarder answers the names of its cluster SERVFAIL at once, with
//! an RFC 8914 extended error, instead of sending them into the tunnel (see
//! [`names::while_unreachable`]); each session hands in a [`Reach`] for that.
//! resolv.conf is restored when the last such session ends, and at daemon start
//! when a backup is left over from a daemon that was killed ([`Dns::repair`]).
//!
//! Optional, off by default (`kvpn connect --hosts`): hosts-file entries for the
//! connected namespace's Services, from the route watch's Service list ([`hosts`];
//! file env `KVPN_HOSTS`, default `/etc/hosts`), removed byte for byte when the last
//! such session ends and repaired at daemon start like resolv.conf.
//!
//! Pure cores: [`names`] (where a question goes), [`message`] (answers, sizes),
//! parts of [`resolv_conf`], [`hosts`] and [`resolved`]. I/O: [`forwarder`]
//! (sockets), [`resolv_conf::ResolvConf`] and [`hosts::HostsFile`] (files),
//! [`resolved::run`] (`resolvectl`).

pub mod forwarder;
#[cfg(test)]
mod forwarder_tests;
pub mod guard;
pub mod hosts;
pub mod message;
pub mod names;
pub mod port_holder;
pub mod resolv_conf;
pub mod resolved;

use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV6};
use std::path::{Path, PathBuf};

use tokio::sync::Mutex;

pub use names::ClusterDns;

pub use forwarder::Reach;
use forwarder::{CounterSnapshot, Forwarder};
use hosts::HostsFile;
use kvpn_proto::dataplane::ClusterService;
use resolv_conf::{ResolvConf, Restored};

/// Where the forwarder listens unless `KVPN_DNS_IP` says otherwise.
pub const DEFAULT_LISTEN_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 153));
/// resolv.conf can only name port 53.
pub const DNS_PORT: u16 = 53;

/// How the daemon sets up split DNS (env `KVPN_DNS_MODE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// systemd-resolved where it manages DNS, else the forwarder.
    Auto,
    /// Always the forwarder and resolv.conf.
    Forwarder,
    /// Always systemd-resolved.
    Resolved,
    /// Leave the laptop's DNS alone.
    Off,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "" | "auto" => Ok(Mode::Auto),
            "forwarder" => Ok(Mode::Forwarder),
            "resolved" | "systemd-resolved" => Ok(Mode::Resolved),
            "off" => Ok(Mode::Off),
            other => Err(format!(
                "invalid KVPN_DNS_MODE {other:?} — use auto, forwarder, resolved or off"
            )),
        }
    }
}

/// Where split DNS lives on this laptop.
#[derive(Debug, Clone)]
pub struct DnsSettings {
    /// How.
    pub mode: Mode,
    /// The resolv.conf to manage.
    pub resolv_conf: PathBuf,
    /// The forwarder's address (port [`DNS_PORT`], or 0 in tests).
    pub listen: SocketAddr,
    /// The runtime directory (the resolv.conf backup lives there).
    pub runtime_dir: PathBuf,
    /// The persistent directory for a second copy of the backups (env
    /// `KVPN_STATE_DIR`, default [`resolv_conf::DEFAULT_STATE_DIR`]), so that a
    /// reboot after a killed daemon can still repair.
    pub state_dir: PathBuf,
    /// The hosts file for `kvpn connect --hosts` entries.
    pub hosts: PathBuf,
}

impl DnsSettings {
    /// Defaults, overridden by `KVPN_DNS_MODE`, `KVPN_RESOLV_CONF`, `KVPN_DNS_IP`,
    /// `KVPN_HOSTS` and `KVPN_STATE_DIR`.
    pub fn from_env(runtime_dir: &Path) -> Result<Self, String> {
        let mode = std::env::var("KVPN_DNS_MODE").unwrap_or_default().parse()?;
        let resolv_conf = std::env::var_os("KVPN_RESOLV_CONF")
            .filter(|p| !p.is_empty())
            .map_or_else(|| PathBuf::from(resolv_conf::DEFAULT_PATH), PathBuf::from);
        let ip = match std::env::var("KVPN_DNS_IP") {
            Ok(s) if !s.is_empty() => s.parse().map_err(|_| {
                format!("invalid KVPN_DNS_IP {s:?} — give a local address such as 127.0.0.153")
            })?,
            _ => DEFAULT_LISTEN_IP,
        };
        let hosts = std::env::var_os("KVPN_HOSTS")
            .filter(|p| !p.is_empty())
            .map_or_else(|| PathBuf::from(hosts::DEFAULT_PATH), PathBuf::from);
        let state_dir = std::env::var_os("KVPN_STATE_DIR")
            .filter(|p| !p.is_empty())
            .map_or_else(
                || PathBuf::from(resolv_conf::DEFAULT_STATE_DIR),
                PathBuf::from,
            );
        Ok(DnsSettings {
            mode,
            resolv_conf,
            listen: SocketAddr::new(ip, DNS_PORT),
            runtime_dir: runtime_dir.to_owned(),
            state_dir,
            hosts,
        })
    }
}

/// Errors of split DNS.
#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    /// The forwarder cannot start.
    #[error(transparent)]
    Forwarder(#[from] forwarder::ForwarderError),
    /// resolv.conf cannot be changed or restored.
    #[error(transparent)]
    ResolvConf(#[from] resolv_conf::ResolvConfError),
    /// systemd-resolved refused the link settings.
    #[error("systemd-resolved: {0}")]
    Resolved(String),
}

struct SessionDns {
    id: String,
    tun: String,
    cluster: ClusterDns,
    /// Whether the session is connected (the forwarder fails its cluster's names
    /// at once while it is not).
    reach: Reach,
}

enum Active {
    Forwarder(Forwarder),
    Resolved,
}

/// A session that asked for hosts-file entries (`kvpn connect --hosts`).
struct HostsSession {
    id: String,
    /// The connected namespace (`None` until known: no entries then).
    namespace: Option<String>,
    domain: String,
    services: Vec<ClusterService>,
}

#[derive(Default)]
struct State {
    /// Most recent first.
    sessions: Vec<SessionDns>,
    active: Option<Active>,
    /// Most recent first.
    hosts: Vec<HostsSession>,
    /// Why nameservers of the laptop's resolv.conf are not the forwarder's
    /// upstreams ([`upstreams_with`]), shown with each session's DNS line.
    upstream_warnings: Vec<String>,
    /// The forwarder's upstreams now.
    upstreams: Vec<SocketAddr>,
    /// Rewrites of resolv.conf by something else that kvpn answered
    /// ([`Dns::watch_resolv_conf`]).
    reapplied: ResolvWatch,
    /// What the last poll saw when it was not kvpn's file: acted on when the
    /// next poll sees the same bytes (a writer in the middle of its write is
    /// not raced).
    pending: Option<Vec<u8>>,
}

/// How often [`Dns::watch_resolv_conf`] looks at resolv.conf.
pub const RESOLV_POLL: std::time::Duration = std::time::Duration::from_millis(500);

/// What [`Dns::watch_resolv_conf`] did since the forwarder started.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResolvWatch {
    /// Times something else rewrote resolv.conf and kvpn put its entry back.
    pub count: u64,
    /// When it last did (seconds since the epoch; 0: never).
    pub last_at_unix: u64,
    /// The forwarder's upstreams now.
    pub upstreams: Vec<SocketAddr>,
}

/// Split DNS for the daemon's sessions.
pub struct Dns {
    settings: DnsSettings,
    resolv: ResolvConf,
    hosts: HostsFile,
    state: Mutex<State>,
}

impl std::fmt::Debug for Dns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dns")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

/// The laptop's nameservers from resolv.conf bytes, as forwarder upstreams: port 53,
/// never the forwarder itself; none listed means 127.0.0.1 as for the resolver.
/// Scopes (`fe80::1%eth0`) become interface indexes of this network namespace;
/// nameservers that cannot be used are logged as warnings ([`upstreams_with`]).
pub fn upstreams_from(original: &[u8], forwarder: SocketAddr) -> Vec<SocketAddr> {
    let (list, warnings) = upstreams_with(original, forwarder, interface_index);
    for w in &warnings {
        tracing::warn!("{w}");
    }
    list
}

/// The index of interface `name` in this network namespace.
fn interface_index(name: &str) -> Option<u32> {
    nix::net::if_::if_nametoindex(name).ok().filter(|i| *i != 0)
}

/// [`upstreams_from`] with `index_of` resolving interface names (pure), and
/// one warning per nameserver line that cannot be used (issue 29 item 5: a
/// link-local nameserver lost its `%eth0` scope, and with only such a
/// nameserver every non-cluster name got SERVFAIL without a word):
/// - `fe80::1%eth0` or `fe80::1%2`: the scope becomes the address's scope id
///   (an interface name first, then a number, as glibc reads it);
/// - a scope naming no interface, or a link-local address without a scope
///   (the kernel cannot send to it): skipped, with a warning.
pub fn upstreams_with(
    original: &[u8],
    forwarder: SocketAddr,
    index_of: impl Fn(&str) -> Option<u32>,
) -> (Vec<SocketAddr>, Vec<String>) {
    let mut warnings = Vec::new();
    let mut list: Vec<SocketAddr> = Vec::new();
    for ns in resolv_conf::parse(original).scoped_nameservers {
        let addr = match (ns.ip, ns.scope.as_deref()) {
            (IpAddr::V6(ip), Some(scope)) => match index_of(scope).or_else(|| scope.parse().ok()) {
                Some(index) => SocketAddr::V6(SocketAddrV6::new(ip, DNS_PORT, 0, index)),
                None => {
                    warnings.push(format!(
                            "nameserver {ip}%{scope} in resolv.conf: no interface {scope} in this network namespace — kvpn's DNS forwarder skips it; fix the interface name in resolv.conf"
                        ));
                    continue;
                }
            },
            (IpAddr::V6(ip), None) if ip.is_unicast_link_local() => {
                warnings.push(format!(
                    "nameserver {ip} in resolv.conf: a link-local address without its interface (write {ip}%<interface>, e.g. {ip}%eth0) cannot be reached — kvpn's DNS forwarder skips it"
                ));
                continue;
            }
            (ip, _) => SocketAddr::new(ip, DNS_PORT),
        };
        if addr != forwarder && !list.contains(&addr) {
            list.push(addr);
        }
    }
    if list.is_empty() {
        let localhost = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), DNS_PORT);
        if localhost != forwarder {
            if !warnings.is_empty() {
                warnings.push(format!(
                    "no usable nameserver in resolv.conf: kvpn's DNS forwarder asks {localhost} for names outside the cluster"
                ));
            }
            list.push(localhost);
        }
    }
    (list, warnings)
}

/// The forwarder's view of the sessions: cluster DNS and reachability, most
/// recent first.
fn clusters_of(state: &State) -> Vec<(ClusterDns, Reach)> {
    state
        .sessions
        .iter()
        .map(|s| (s.cluster.clone(), s.reach.clone()))
        .collect()
}

impl Dns {
    /// Split DNS as `settings` say; nothing changes until a session asks.
    pub fn new(settings: DnsSettings) -> Self {
        let resolv = ResolvConf::new(&settings.resolv_conf, &settings.runtime_dir)
            .with_persistent_copy(&settings.state_dir)
            .with_own_nameserver(settings.listen.ip());
        let hosts = HostsFile::new(&settings.hosts, &settings.runtime_dir)
            .with_persistent_copy(&settings.state_dir);
        Dns {
            settings,
            resolv,
            hosts,
            state: Mutex::new(State::default()),
        }
    }

    /// The settings.
    pub fn settings(&self) -> &DnsSettings {
        &self.settings
    }

    /// At daemon start: put back a resolv.conf that a killed daemon left changed.
    pub fn repair(&self) -> Result<Restored, DnsError> {
        Ok(self.resolv.restore()?)
    }

    /// At daemon start: take out hosts-file entries a killed daemon left.
    pub fn repair_hosts(&self) -> Result<Restored, DnsError> {
        Ok(self.hosts.restore()?)
    }

    /// Session `id` wants hosts-file entries for the Services of the namespace its
    /// cluster search list is connected to (`search`, `domain` as in ClusterDns).
    /// Entries appear once [`Dns::set_hosts_services`] reports Services. Returns
    /// a one-line description for the user.
    pub async fn enable_hosts(&self, id: &str, search: &[String], domain: &str) -> String {
        let domain = if domain.trim().is_empty() {
            "cluster.local"
        } else {
            domain.trim().trim_end_matches('.')
        };
        let namespace = hosts::connected_namespace(search, domain);
        let mut state = self.state.lock().await;
        let services = state
            .hosts
            .iter()
            .position(|h| h.id == id)
            .map(|i| state.hosts.remove(i).services)
            .unwrap_or_default();
        let line = match &namespace {
            Some(ns) => format!(
                "hosts file {}: entries for the Services of namespace {ns} (from the route watch)",
                self.hosts.path().display()
            ),
            None => format!(
                "hosts file {}: no entries (the connected namespace is unknown)",
                self.hosts.path().display()
            ),
        };
        state.hosts.insert(
            0,
            HostsSession {
                id: id.to_owned(),
                namespace,
                domain: domain.to_owned(),
                services,
            },
        );
        if let Err(e) = self.write_hosts(&state) {
            tracing::warn!(error = %e, "hosts file not updated");
            return format!("{line}; not written: {e}");
        }
        line
    }

    /// Whether session `id` asked for hosts-file entries.
    pub async fn hosts_enabled(&self, id: &str) -> bool {
        self.state.lock().await.hosts.iter().any(|h| h.id == id)
    }

    /// The namespaces the route watch reported Services in for session `id`:
    /// while the session is down their `svc.ns` spellings stay cluster names
    /// ([`names::while_unreachable`]) instead of going to the laptop's resolvers.
    /// The include and exclude suffixes session `id` was connected with (empty
    /// lists for an unknown session): the user's, which a later update of the
    /// cluster's DNS settings keeps.
    pub async fn suffixes_of(&self, id: &str) -> (Vec<String>, Vec<String>) {
        let state = self.state.lock().await;
        let text = |names: &[hickory_proto::rr::Name]| {
            names
                .iter()
                .map(|n| n.to_ascii().trim_end_matches('.').to_owned())
                .collect::<Vec<_>>()
        };
        state
            .sessions
            .iter()
            .find(|s| s.id == id)
            .map(|s| (text(&s.cluster.include), text(&s.cluster.exclude)))
            .unwrap_or_default()
    }

    pub async fn set_namespaces<'a>(
        &self,
        id: &str,
        namespaces: impl IntoIterator<Item = &'a str>,
    ) {
        let mut state = self.state.lock().await;
        let Some(s) = state.sessions.iter_mut().find(|s| s.id == id) else {
            return;
        };
        let cluster = s.cluster.clone().with_namespaces(namespaces);
        if cluster == s.cluster {
            return;
        }
        s.cluster = cluster;
        if let Some(Active::Forwarder(f)) = &state.active {
            f.set_clusters(clusters_of(&state));
        }
    }

    /// The Services the route watch reports for session `id` (all of them; the
    /// connected namespace's get entries). No-op unless the session asked for
    /// hosts-file entries. Returns the number of entries of this session.
    pub async fn set_hosts_services(
        &self,
        id: &str,
        services: Vec<ClusterService>,
    ) -> Result<usize, DnsError> {
        let mut state = self.state.lock().await;
        let Some(h) = state.hosts.iter_mut().find(|h| h.id == id) else {
            return Ok(0);
        };
        h.services = services;
        let n = h
            .namespace
            .as_deref()
            .map_or(0, |ns| hosts::entries_for(ns, &h.domain, &h.services).len());
        self.write_hosts(&state)?;
        Ok(n)
    }

    /// The hosts file's block for every hosts session, most recent first; a name
    /// an earlier (more recent) session has is not repeated.
    fn write_hosts(&self, state: &State) -> Result<(), DnsError> {
        let mut all: Vec<hosts::HostEntry> = Vec::new();
        let mut seen: std::collections::HashSet<String> = std::collections::HashSet::new();
        for h in &state.hosts {
            let Some(ns) = &h.namespace else { continue };
            let mut mine = hosts::entries_for(ns, &h.domain, &h.services);
            mine.retain(|e| !seen.contains(&e.names[0]));
            all.extend(mine);
            // Short names of this session (all its addresses) are taken now.
            for e in &all {
                seen.insert(e.names[0].clone());
            }
        }
        self.hosts.apply(&all)?;
        Ok(())
    }

    /// The forwarder's counters (`None` without a forwarder).
    pub async fn counters(&self) -> Option<CounterSnapshot> {
        match &self.state.lock().await.active {
            Some(Active::Forwarder(f)) => Some(f.counters()),
            _ => None,
        }
    }

    /// What the resolv.conf watch did, with the forwarder's upstreams (`None`
    /// without a forwarder).
    pub async fn resolv_watch(&self) -> Option<ResolvWatch> {
        let state = self.state.lock().await;
        match &state.active {
            Some(Active::Forwarder(_)) => Some(ResolvWatch {
                upstreams: state.upstreams.clone(),
                ..state.reapplied.clone()
            }),
            _ => None,
        }
    }

    /// Issue 29 item 6: while the forwarder serves, look at resolv.conf every
    /// [`RESOLV_POLL`]; when something else (NetworkManager on a Wi-Fi change,
    /// a DHCP client) rewrote it, and two polls in a row see the same bytes,
    /// take its nameservers as the forwarder's upstreams, record its file as
    /// the one to restore, and write kvpn's entry again
    /// ([`ResolvConf::reapply_if_rewritten`]); logged, and counted in status.
    /// A poll rather than inotify: the path may be a bind mount (containers,
    /// `ip netns exec`) or replaced by rename or by a symlink, which a watch on
    /// the file misses, and the cost is one small read per poll. Ends when the
    /// [`Dns`] is dropped.
    pub async fn watch_resolv_conf(dns: std::sync::Weak<Dns>) {
        loop {
            tokio::time::sleep(RESOLV_POLL).await;
            let Some(dns) = dns.upgrade() else { return };
            dns.check_resolv_conf().await;
        }
    }

    /// One poll of [`Dns::watch_resolv_conf`].
    pub async fn check_resolv_conf(&self) {
        let mut state = self.state.lock().await;
        let Some(Active::Forwarder(f)) = &state.active else {
            state.pending = None;
            return;
        };
        let listen = f.local_addr();
        match self.resolv.is_ours() {
            Ok(true) => {
                state.pending = None;
                return;
            }
            Ok(false) => {}
            Err(e) => {
                tracing::debug!(error = %e, "cannot check resolv.conf");
                return;
            }
        }
        let now = std::fs::read(self.resolv.path()).unwrap_or_default();
        if state.pending.as_ref() != Some(&now) {
            state.pending = Some(now);
            return;
        }
        state.pending = None;
        let search = state
            .sessions
            .first()
            .map(|s| s.cluster.search_text())
            .unwrap_or_default();
        let original = match self.resolv.reapply_if_rewritten(|original| {
            resolv_conf::render(listen.ip(), &search, &resolv_conf::parse(original))
        }) {
            Ok(Some(original)) => original,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(
                    path = %self.resolv.path().display(),
                    error = %e,
                    "resolv.conf was rewritten by something else and kvpn cannot put its \
                     entry back: cluster names do not resolve until `kvpn disconnect` and \
                     `kvpn connect`"
                );
                return;
            }
        };
        let (upstreams, warnings) = upstreams_with(&original, listen, interface_index);
        for w in &warnings {
            tracing::warn!("{w}");
        }
        if let Some(Active::Forwarder(f)) = &state.active {
            f.set_upstreams(upstreams.clone());
        }
        tracing::warn!(
            path = %self.resolv.path().display(),
            upstreams = ?upstreams,
            "resolv.conf was rewritten by something else (NetworkManager, a DHCP client) while \
             kvpn's forwarder served; kvpn's entry is back, the new file's nameservers are the \
             forwarder's upstreams now, and the new file is what disconnect restores"
        );
        state.upstreams = upstreams;
        state.upstream_warnings = warnings;
        state.reapplied.count += 1;
        state.reapplied.last_at_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
    }

    fn original(&self) -> Result<Vec<u8>, DnsError> {
        if let Some(b) = self.resolv.backup()? {
            return Ok(b.original);
        }
        match std::fs::read(self.resolv.path()) {
            Ok(b) => Ok(b),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(source) => Err(resolv_conf::ResolvConfError::Io {
                what: "cannot read",
                path: self.resolv.path().to_owned(),
                source,
            }
            .into()),
        }
    }

    fn write_resolv_conf(&self, state: &State, listen: IpAddr) -> Result<(), DnsError> {
        let search = state
            .sessions
            .first()
            .map(|s| s.cluster.search_text())
            .unwrap_or_default();
        self.resolv.apply(|original| {
            resolv_conf::render(listen, &search, &resolv_conf::parse(original))
        })?;
        Ok(())
    }

    /// Add a session's cluster DNS; the TUN device `tun` carries its traffic and
    /// `reach` says whether its data channel is connected (while it is not, the
    /// forwarder answers the cluster's names SERVFAIL at once instead of sending
    /// them into the tunnel). Returns a one-line description for the user.
    pub async fn add_session(
        &self,
        id: &str,
        tun: &str,
        cluster: ClusterDns,
        reach: Reach,
    ) -> Result<String, DnsError> {
        let mut state = self.state.lock().await;
        if self.settings.mode == Mode::Off {
            return Ok("off (KVPN_DNS_MODE=off): the laptop's DNS is unchanged".to_owned());
        }
        if state.active.is_none() {
            let original = self.original()?;
            let use_resolved = match self.settings.mode {
                Mode::Resolved => true,
                Mode::Forwarder | Mode::Off => false,
                Mode::Auto => {
                    resolved::uses_stub(&resolv_conf::parse(&original))
                        && resolved::available().await
                }
            };
            if use_resolved {
                state.active = Some(Active::Resolved);
            } else {
                let (upstreams, warnings) =
                    upstreams_with(&original, self.settings.listen, interface_index);
                for w in &warnings {
                    tracing::warn!("{w}");
                }
                let forwarder = Forwarder::start(self.settings.listen, upstreams.clone()).await?;
                state.active = Some(Active::Forwarder(forwarder));
                state.upstream_warnings = warnings;
                state.upstreams = upstreams;
                state.reapplied = ResolvWatch::default();
                state.pending = None;
            }
        }
        // A session's settings again (the route watch reports the manager's view):
        // replace its entry, keeping the namespaces the route watch reported.
        let namespaces = state.sessions.iter().find(|s| s.id == id);
        let namespaces = namespaces.map(|s| s.cluster.namespaces.clone());
        let mut cluster = cluster;
        cluster.namespaces = namespaces.unwrap_or_default();
        state.sessions.retain(|s| s.id != id);
        state.sessions.insert(
            0,
            SessionDns {
                id: id.to_owned(),
                tun: tun.to_owned(),
                cluster: cluster.clone(),
                reach,
            },
        );
        let result = match &state.active {
            Some(Active::Resolved) => resolved::run(&resolved::link_commands(tun, &cluster))
                .await
                .map(|()| {
                    format!(
                        "systemd-resolved: {} on {tun} for ~{}, search {}",
                        cluster.servers_text(),
                        cluster.domain_text(),
                        cluster.search_text().join(" ")
                    )
                })
                .map_err(DnsError::Resolved),
            Some(Active::Forwarder(f)) => {
                f.set_clusters(clusters_of(&state));
                let local = f.local_addr();
                self.write_resolv_conf(&state, local.ip()).map(|()| {
                    let mut line = format!(
                        "forwarder on {local} (cluster DNS {}, search {}); {} names it",
                        cluster.servers_text(),
                        cluster.search_text().join(" "),
                        self.resolv.path().display()
                    );
                    for w in &state.upstream_warnings {
                        line.push_str("; warning: ");
                        line.push_str(w);
                    }
                    line
                })
            }
            None => Ok(String::new()),
        };
        if result.is_err() {
            drop(state);
            let _ = self.remove_session(id).await;
        }
        result
    }

    /// Whether `id` is set up with exactly `cluster` already (then a repeated
    /// report of the same settings needs no work).
    pub async fn has_session(&self, id: &str, cluster: &ClusterDns) -> bool {
        let state = self.state.lock().await;
        state
            .sessions
            .iter()
            .any(|s| s.id == id && &s.cluster == cluster)
    }

    /// Remove a session's cluster DNS; the last one restores the laptop's DNS.
    /// Returns what could not be undone.
    pub async fn remove_session(&self, id: &str) -> Vec<String> {
        let mut state = self.state.lock().await;
        let mut leftovers = Vec::new();
        if let Some(pos) = state.hosts.iter().position(|h| h.id == id) {
            state.hosts.remove(pos);
            let result = if state.hosts.is_empty() {
                self.hosts.restore().map(drop).map_err(DnsError::from)
            } else {
                self.write_hosts(&state)
            };
            if let Err(e) = result {
                leftovers.push(format!(
                    "hosts file {} not restored: {e}",
                    self.hosts.path().display()
                ));
            }
        }
        let Some(pos) = state.sessions.iter().position(|s| s.id == id) else {
            return leftovers;
        };
        let gone = state.sessions.remove(pos);
        match &state.active {
            Some(Active::Resolved) => {
                // The link usually goes with the TUN device; revert anyway.
                if let Err(e) = resolved::run(&[resolved::revert_command(&gone.tun)]).await {
                    tracing::debug!(error = %e, "systemd-resolved revert");
                }
            }
            Some(Active::Forwarder(f)) if !state.sessions.is_empty() => {
                f.set_clusters(clusters_of(&state));
                let ip = f.local_addr().ip();
                if let Err(e) = self.write_resolv_conf(&state, ip) {
                    leftovers.push(e.to_string());
                }
            }
            _ => {}
        }
        if state.sessions.is_empty() {
            if let Some(Active::Forwarder(_)) = &state.active
                && let Err(e) = self.resolv.restore()
            {
                leftovers.push(format!(
                    "resolv.conf {} not restored: {e}",
                    self.resolv.path().display()
                ));
            }
            if let Some(Active::Forwarder(f)) = state.active.take() {
                f.stop().await;
            }
            state.active = None;
            state.upstream_warnings.clear();
            state.upstreams.clear();
            state.pending = None;
        }
        leftovers
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstreams_skip_the_forwarder_and_default_to_localhost() {
        let fwd: SocketAddr = "127.0.0.153:53".parse().expect("addr");
        assert_eq!(
            upstreams_from(b"nameserver 127.0.0.153\nnameserver 10.0.0.2\n", fwd),
            vec!["10.0.0.2:53".parse::<SocketAddr>().expect("addr")]
        );
        assert_eq!(
            upstreams_from(b"# nothing\n", fwd),
            vec!["127.0.0.1:53".parse::<SocketAddr>().expect("addr")]
        );
        assert_eq!("off".parse::<Mode>(), Ok(Mode::Off));
        assert!("maybe".parse::<Mode>().is_err());
    }

    /// Issue 29 item 5: `fe80::1%eth0` keeps its scope as the interface's index.
    #[test]
    fn scoped_link_local_nameservers_keep_their_interface() {
        let fwd: SocketAddr = "127.0.0.153:53".parse().expect("addr");
        let index_of = |name: &str| (name == "eth0").then_some(7);
        let v6 = |text: &str, scope: u32| {
            let ip = text.parse().expect("ip");
            SocketAddr::V6(SocketAddrV6::new(ip, 53, 0, scope))
        };
        let (list, warnings) = upstreams_with(b"nameserver fe80::1%eth0\n", fwd, index_of);
        assert_eq!(list, vec![v6("fe80::1", 7)]);
        assert_eq!(list[0].to_string(), "[fe80::1%7]:53");
        assert!(warnings.is_empty(), "{warnings:?}");
        // A numeric scope, a global address without one, IPv4 unchanged.
        let (list, warnings) = upstreams_with(
            b"nameserver fe80::2%3\nnameserver fd00::53\nnameserver 10.0.0.2\n",
            fwd,
            index_of,
        );
        assert_eq!(
            list,
            vec![
                v6("fe80::2", 3),
                v6("fd00::53", 0),
                "10.0.0.2:53".parse().expect("addr")
            ]
        );
        assert!(warnings.is_empty(), "{warnings:?}");
        // Unusable ones are skipped, each with a warning that names it.
        let (list, warnings) = upstreams_with(
            b"nameserver fe80::1%wlan9\nnameserver fe80::5\nnameserver 10.0.0.2\n",
            fwd,
            index_of,
        );
        assert_eq!(
            list,
            vec!["10.0.0.2:53".parse::<SocketAddr>().expect("addr")]
        );
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(
            warnings[0].contains("fe80::1%wlan9") && warnings[0].contains("no interface wlan9")
        );
        assert!(warnings[1].contains("fe80::5") && warnings[1].contains("without its interface"));
        // Only an unusable one: the resolver's default, and a warning saying so.
        let (list, warnings) = upstreams_with(b"nameserver fe80::5\n", fwd, index_of);
        assert_eq!(
            list,
            vec!["127.0.0.1:53".parse::<SocketAddr>().expect("addr")]
        );
        assert!(
            warnings
                .last()
                .is_some_and(|w| w.contains("no usable nameserver"))
        );
        // The real lookup: the loopback interface exists everywhere.
        let (list, warnings) = upstreams_with(b"nameserver fe80::1%lo\n", fwd, interface_index);
        assert!(warnings.is_empty(), "{warnings:?}");
        assert!(
            matches!(list[0], SocketAddr::V6(a) if a.scope_id() > 0),
            "{list:?}"
        );
    }
}
