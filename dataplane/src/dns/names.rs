//! Which resolver a question belongs to (pure: no I/O, no clock of its own).
//!
//! A question is one of:
//! - a name under the cluster domain (`web.dev.svc.cluster.local`): the cluster DNS
//!   answers it, unchanged;
//! - a cluster-relative spelling (`web`, `web.dev`, `web.dev.svc`,
//!   `_http._tcp.web.dev`): the search list of the connected namespace expands it
//!   (`dev.svc.cluster.local`, `svc.cluster.local`, `cluster.local`, in that order)
//!   and the first expansion that exists in the cluster answers it, as a pod's
//!   resolver would. A single label never goes to the laptop's upstream: none of
//!   the expansions existing means NXDOMAIN (case dns-01). Longer names that expand
//!   to nothing in the cluster (`example.com`, `web.dev` when there is no namespace
//!   `dev`) are the laptop's and go upstream unchanged. One whose anchor exists but
//!   that does not itself ([`Candidate::if_missing`]):
//!   - a `….svc` spelling (`nosuch.dev.svc`: anchor `svc.<domain>`) names the
//!     cluster's Service zone, which no public name ends in: the cluster's
//!     NXDOMAIN stands and nothing goes upstream;
//!   - any other (the `svc.ns` form `nosuch.default`, and `go.dev`, `pkg.go.dev`,
//!     `mycorp.dev` when a namespace is called `dev`, issue 29 item 2): a public
//!     name has the same shape as a Service in a namespace named like its
//!     top-level domain (`dev`, `app`, `io`, `prod`…), so the cluster's NXDOMAIN
//!     falls through to the laptop's upstream, as it does in a pod (whose search
//!     list ends with the absolute name). A public name never loses its answer;
//!     the price is that a missing Service's `svc.ns` name reaches the laptop's
//!     resolver, as it would from a pod;
//! - a reverse name (`100.0.96.10.in-addr.arpa`, `….ip6.arpa`) of an address in the
//!   cluster's pod or service CIDRs ([`ClusterDns::reverse`]): the cluster DNS answers
//!   it, so `dig -x <ClusterIP>` gives the Service's name;
//! - a name under one of the session's include suffixes (`kvpn connect
//!   --include-suffix`, and every `--extra-domain`): the cluster DNS, unchanged
//!   (the cluster's resolver knows names the laptop's does not: stub domains,
//!   ExternalName targets);
//! - everything else: the laptop's upstream nameservers, unchanged (case dns-05).
//!
//! A name under one of the session's exclude suffixes (`--exclude-suffix`) is the
//! laptop's whatever the rules above say: the user's word wins.
//!
//! While a cluster's session is not connected, [`while_unreachable`] turns the
//! questions that would go to that cluster into an immediate SERVFAIL.
//!
//! An expansion `a.b.<search domain>` of a multi-label name can only exist when its
//! ancestor `b.<search domain>` exists (RFC 8020: a name that does not exist has no
//! descendants). The forwarder asks for that ancestor (the *anchor*) first and caches
//! the answer in [`ExistenceCache`], so `www.example.com` costs a cluster round trip
//! for `com.<domain>` once per TTL, not three per query.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use hickory_proto::op::Query;
use hickory_proto::rr::{DNSClass, Name, RecordType};

/// Names with more labels than this are never expanded: `hostname.svc.ns.svc` and
/// `_port._proto.svc.ns` have 4, the longest cluster-relative spellings in use.
pub const MAX_RELATIVE_LABELS: u8 = 4;

/// Bounds on how long an anchor's existence is cached: at least 1 s, so a burst of
/// queries costs one round trip, and at most 30 s, so a namespace created while
/// connected becomes resolvable by its short spelling within half a minute.
pub const ANCHOR_TTL_BOUNDS: (Duration, Duration) =
    (Duration::from_secs(1), Duration::from_secs(30));

/// Why a cluster DNS configuration is unusable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// No cluster DNS server was given.
    #[error(
        "no cluster DNS server given — pass the ClusterIP of the cluster's DNS Service (e.g. kube-system/kube-dns 10.96.0.10)"
    )]
    NoServer,
    /// A server address does not parse.
    #[error(
        "invalid cluster DNS server {0:?} — give an IP address, optionally with :port (e.g. 10.96.0.10 or 10.96.0.10:53)"
    )]
    Server(String),
    /// The cluster domain or a search domain is not a domain name.
    #[error(
        "invalid DNS domain {0:?} — give a domain such as cluster.local or dev.svc.cluster.local"
    )]
    Domain(String),
}

/// The cluster's DNS as a session knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterDns {
    /// The cluster DNS servers (ClusterIP of kube-dns, port 53), reached through the
    /// TUN device's routes.
    pub servers: Vec<SocketAddr>,
    /// The cluster domain, lower case, fully qualified (`cluster.local.`).
    pub domain: Name,
    /// The search list, connected namespace first (`dev.svc.cluster.local.`, …),
    /// lower case, fully qualified.
    pub search: Vec<Name>,
    /// Whether the cluster has IPv6 Service or pod ranges. Without them, AAAA
    /// questions for names under the cluster domain are answered NOERROR/empty at
    /// once (case dns-09).
    pub ipv6: bool,
    /// The cluster's pod and service CIDRs: PTR names of addresses in them go to
    /// the cluster DNS ([`ClusterDns::with_reverse`]; empty: none do).
    pub reverse: Vec<ipnet::IpNet>,
    /// `<ns>.svc.<domain>.` of every namespace the route watch reported Services
    /// in, sorted ([`ClusterDns::with_namespaces`]): they exist by what the
    /// cluster told the session, so [`while_unreachable`] keeps their `svc.ns`
    /// spellings in the cluster during an outage.
    pub namespaces: Vec<Name>,
    /// Suffixes whose names go to the cluster DNS unchanged
    /// ([`ClusterDns::with_suffixes`]), lower case, fully qualified.
    pub include: Vec<Name>,
    /// Suffixes whose names always go to the laptop's upstream (they win over
    /// every other rule), lower case, fully qualified.
    pub exclude: Vec<Name>,
}

fn fqdn(text: &str) -> Result<Name, ConfigError> {
    let trimmed = text.trim().trim_end_matches('.');
    if trimmed.is_empty() {
        return Err(ConfigError::Domain(text.to_owned()));
    }
    let mut name = Name::from_ascii(trimmed)
        .map_err(|_| ConfigError::Domain(text.to_owned()))?
        .to_lowercase();
    name.set_fqdn(true);
    Ok(name)
}

/// Parse `10.96.0.10`, `10.96.0.10:53`, `fd00::a` or `[fd00::a]:53`.
pub fn parse_server(text: &str) -> Result<SocketAddr, ConfigError> {
    let text = text.trim();
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Ok(addr);
    }
    text.parse::<std::net::IpAddr>()
        .map(|ip| SocketAddr::new(ip, 53))
        .map_err(|_| ConfigError::Server(text.to_owned()))
}

impl ClusterDns {
    /// Validate a configuration. An empty search list becomes `svc.<domain>`,
    /// `<domain>` (no namespace is known then).
    pub fn new(
        servers: &[String],
        domain: &str,
        search: &[String],
        ipv6: bool,
    ) -> Result<Self, ConfigError> {
        let servers = servers
            .iter()
            .map(|s| parse_server(s))
            .collect::<Result<Vec<_>, _>>()?;
        if servers.is_empty() {
            return Err(ConfigError::NoServer);
        }
        let domain = fqdn(if domain.trim().is_empty() {
            "cluster.local"
        } else {
            domain
        })?;
        let mut list = Vec::new();
        for s in search {
            let name = fqdn(s)?;
            if !list.contains(&name) {
                list.push(name);
            }
        }
        if list.is_empty() {
            let svc = Name::from_ascii("svc")
                .and_then(|n| n.append_domain(&domain))
                .map_err(|_| ConfigError::Domain(domain.to_string()))?;
            list = vec![svc, domain.clone()];
        }
        Ok(ClusterDns {
            servers,
            domain,
            search: list,
            ipv6,
            reverse: Vec::new(),
            namespaces: Vec::new(),
            include: Vec::new(),
            exclude: Vec::new(),
        })
    }

    /// The same, with reverse names of addresses in `cidrs` (the cluster's pod and
    /// service CIDRs) answered by the cluster DNS.
    pub fn with_reverse(mut self, cidrs: impl IntoIterator<Item = ipnet::IpNet>) -> Self {
        self.reverse = cidrs.into_iter().collect();
        self.reverse.sort();
        self.reverse.dedup();
        self
    }

    /// The same, with names under `include` sent to the cluster DNS unchanged
    /// and names under `exclude` always sent upstream (suffixes such as
    /// `corp.example` or `.corp.example`).
    pub fn with_suffixes(
        mut self,
        include: &[String],
        exclude: &[String],
    ) -> Result<Self, ConfigError> {
        let parse = |list: &[String]| -> Result<Vec<Name>, ConfigError> {
            let mut out: Vec<Name> = list
                .iter()
                .map(|s| fqdn(s.trim().trim_start_matches('.')))
                .collect::<Result<_, _>>()?;
            out.sort();
            out.dedup();
            Ok(out)
        };
        self.include = parse(include)?;
        self.exclude = parse(exclude)?;
        Ok(self)
    }

    /// The same, knowing that `namespaces` exist (the route watch reported
    /// Services in them); names that are not DNS labels are skipped.
    pub fn with_namespaces<'a>(mut self, namespaces: impl IntoIterator<Item = &'a str>) -> Self {
        self.namespaces = namespaces
            .into_iter()
            .filter_map(|ns| {
                Name::from_ascii(ns)
                    .ok()
                    .filter(|n| n.num_labels() == 1)
                    .and_then(|n| n.append_domain(&Name::from_ascii("svc").ok()?).ok())
                    .and_then(|n| n.append_domain(&self.domain).ok())
                    .map(|n| n.to_lowercase())
            })
            .collect();
        self.namespaces.sort();
        self.namespaces.dedup();
        self
    }

    /// Whether `name` exists in the cluster by this configuration alone: the
    /// cluster domain, `svc.<domain>` and the search domains (the connected
    /// namespace's `dev.svc.<domain>` among them) are zones of every cluster
    /// whose DNS gives this search list; `<ns>.svc.<domain>` of the namespaces
    /// the route watch reported exist too.
    pub fn configured(&self, name: &Name) -> bool {
        let name = name.to_lowercase();
        name == self.domain
            || self.search.contains(&name)
            || self.namespaces.binary_search(&name).is_ok()
            || Name::from_ascii("svc")
                .and_then(|svc| svc.append_domain(&self.domain))
                .is_ok_and(|svc| svc == name)
    }

    /// The search list as text, without trailing dots (`dev.svc.cluster.local`, …).
    pub fn search_text(&self) -> Vec<String> {
        self.search
            .iter()
            .map(|n| n.to_ascii().trim_end_matches('.').to_owned())
            .collect()
    }

    /// The cluster DNS servers for messages, comma-separated: `10.96.0.10:53, [fd00::a]:53`.
    pub fn servers_text(&self) -> String {
        self.servers
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The cluster domain as text, without trailing dot.
    pub fn domain_text(&self) -> String {
        self.domain.to_ascii().trim_end_matches('.').to_owned()
    }
}

/// One expansion of a cluster-relative name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The expanded name, as asked of the cluster DNS.
    pub name: Name,
    /// The ancestor that must exist for `name` to exist (`None` for single labels,
    /// where the candidate is asked directly).
    pub anchor: Option<Name>,
    /// What the cluster's NXDOMAIN for `name` means while `anchor` exists:
    /// [`Otherwise::NxDomain`] for `….svc` spellings (anchor `svc.<domain>`) and
    /// single labels, [`Otherwise::Upstream`] for every other spelling (see the
    /// module header: `go.dev` with a namespace `dev`).
    pub if_missing: Otherwise,
}

/// What to do when no expansion exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Otherwise {
    /// Answer NXDOMAIN (single labels: never sent upstream unexpanded).
    NxDomain,
    /// Forward the question unchanged to the laptop's upstream nameservers.
    Upstream,
}

/// What the cluster's NXDOMAIN for an expansion under an existing `anchor` means
/// (pure; see the module header): final only when the anchor is the cluster's
/// Service zone `svc.<domain>` (the asked name ends in `.svc`, which no public
/// name does) or there is no anchor (a single label).
pub fn if_missing(anchor: Option<&Name>, cluster: &ClusterDns) -> Otherwise {
    let Some(anchor) = anchor else {
        return Otherwise::NxDomain;
    };
    let service_zone = Name::from_ascii("svc")
        .and_then(|svc| svc.append_domain(&cluster.domain))
        .is_ok_and(|svc| svc == anchor.to_lowercase());
    if service_zone {
        Otherwise::NxDomain
    } else {
        Otherwise::Upstream
    }
}

/// Where a question goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Under the cluster domain: to the cluster DNS, unchanged.
    Cluster,
    /// AAAA under the cluster domain of an IPv4-only cluster: NOERROR without
    /// answers, at once (case dns-09).
    EmptyAaaa,
    /// A cluster-relative spelling: try the candidates in order.
    Search {
        /// Expansions in search-list order.
        candidates: Vec<Candidate>,
        /// When none exists.
        otherwise: Otherwise,
    },
    /// Not the cluster's: to the laptop's upstream nameservers, unchanged.
    Upstream,
    /// The cluster's, but its session is not connected (reconnecting: the data
    /// channel is down or silent): SERVFAIL at once, nothing sent
    /// ([`while_unreachable`]).
    Unreachable,
}

/// Question types a search-list expansion applies to: those an application asks
/// for by service name. `NS`, `SOA`, `DS`… of a single label are questions about a
/// top-level domain and go upstream.
fn expandable(qtype: RecordType) -> bool {
    matches!(
        qtype,
        RecordType::A
            | RecordType::AAAA
            | RecordType::SRV
            | RecordType::CNAME
            | RecordType::TXT
            | RecordType::ANY
    )
}

/// The address a full reverse name stands for: `d.c.b.a.in-addr.arpa.` (RFC 1035
/// 3.5) or 32 nibbles under `ip6.arpa.` (RFC 3596 2.5); `None` for anything else,
/// also for the shorter zone names (`96.10.in-addr.arpa.`).
pub fn reverse_ip(name: &Name) -> Option<IpAddr> {
    let text = name.to_ascii().to_ascii_lowercase();
    let text = text.trim_end_matches('.');
    if let Some(rest) = text.strip_suffix(".in-addr.arpa") {
        let octets: Vec<u8> = rest
            .split('.')
            .map(|l| {
                // No leading zeros or signs: "010" is not how a reverse name is spelt.
                if l.is_empty() || l.len() > 3 || (l.len() > 1 && l.starts_with('0')) {
                    None
                } else {
                    l.parse().ok()
                }
            })
            .collect::<Option<_>>()?;
        let [d, c, b, a] = octets.as_slice() else {
            return None;
        };
        return Some(IpAddr::V4(Ipv4Addr::new(*a, *b, *c, *d)));
    }
    let rest = text.strip_suffix(".ip6.arpa")?;
    let nibbles: Vec<u8> = rest
        .split('.')
        .map(|l| {
            let mut chars = l.chars();
            match (chars.next(), chars.next()) {
                (Some(c), None) => c.to_digit(16).and_then(|d| u8::try_from(d).ok()),
                _ => None,
            }
        })
        .collect::<Option<_>>()?;
    if nibbles.len() != 32 {
        return None;
    }
    let mut bits: u128 = 0;
    for n in nibbles.iter().rev() {
        bits = (bits << 4) | u128::from(*n);
    }
    Some(IpAddr::V6(Ipv6Addr::from(bits)))
}

/// Classify one question for one cluster.
pub fn classify(query: &Query, cluster: &ClusterDns) -> Plan {
    if query.query_class() != DNSClass::IN {
        return Plan::Upstream;
    }
    let mut name = query.name().to_lowercase();
    name.set_fqdn(true);
    if name.is_root() || name.is_localhost() {
        return Plan::Upstream;
    }
    if cluster.exclude.iter().any(|s| s.zone_of(&name)) {
        return Plan::Upstream;
    }
    if cluster.include.iter().any(|s| s.zone_of(&name)) && !cluster.domain.zone_of(&name) {
        return Plan::Cluster;
    }
    if cluster.domain.zone_of(&name) {
        return if query.query_type() == RecordType::AAAA && !cluster.ipv6 {
            Plan::EmptyAaaa
        } else {
            Plan::Cluster
        };
    }
    if !cluster.reverse.is_empty()
        && let Some(ip) = reverse_ip(&name)
        && cluster.reverse.iter().any(|net| net.contains(&ip))
    {
        return Plan::Cluster;
    }
    let labels = name.num_labels();
    if labels > MAX_RELATIVE_LABELS || !expandable(query.query_type()) {
        return Plan::Upstream;
    }
    // The last label: its expansion under each search domain is the anchor.
    let last = name.trim_to(1);
    let mut candidates = Vec::new();
    let mut excluded = false;
    for domain in &cluster.search {
        // Too long once expanded (255 bytes): that expansion cannot exist.
        let Ok(expanded) = name.clone().append_domain(domain) else {
            continue;
        };
        // The user's exclusion holds for every spelling: `web.default` is not asked
        // as `web.default.svc.cluster.local` when that name is excluded.
        if cluster.exclude.iter().any(|s| s.zone_of(&expanded)) {
            excluded = true;
            continue;
        }
        let anchor = if labels >= 2 {
            match last.clone().append_domain(domain) {
                Ok(a) => Some(a),
                Err(_) => continue,
            }
        } else {
            None
        };
        let if_missing = if_missing(anchor.as_ref(), cluster);
        candidates.push(Candidate {
            name: expanded,
            anchor,
            if_missing,
        });
    }
    if excluded && candidates.is_empty() {
        return Plan::Upstream;
    }
    Plan::Search {
        candidates,
        otherwise: if labels == 1 {
            Otherwise::NxDomain
        } else {
            Otherwise::Upstream
        },
    }
}

/// Classify against several clusters (most recent session first): a name under
/// some cluster's domain belongs to that cluster; otherwise the first cluster that
/// would expand it does.
pub fn classify_all<'a>(
    query: &Query,
    clusters: impl IntoIterator<Item = &'a ClusterDns> + Clone,
) -> Option<(Plan, &'a ClusterDns)> {
    let plans = || {
        clusters
            .clone()
            .into_iter()
            .map(|c| (classify(query, c), c))
    };
    plans()
        .find(|(plan, _)| matches!(plan, Plan::Cluster | Plan::EmptyAaaa))
        .or_else(|| plans().find(|(plan, _)| *plan != Plan::Upstream))
}

/// What `plan` (for a cluster) becomes while that cluster's session is not
/// connected: the tunnel is down or silent, and the root daemon already answers
/// packets toward the cluster with ICMP unreachable, so a question sent to the
/// cluster DNS would only wait out its timeouts (4 s of resends for `dig`, tens
/// of seconds for glibc walking its search list). Instead:
/// - names under the cluster domain, reverse names of cluster addresses and
///   single labels (which can only be cluster names, case dns-01):
///   [`Plan::Unreachable`];
/// - AAAA under the domain of an IPv4-only cluster stays [`Plan::EmptyAaaa`]: it
///   never needed the cluster, and the client's A question fails at once anyway;
/// - a longer cluster-relative spelling (`web.dev`, `www.example.com`) is the
///   cluster's when one of its anchors exists by the session's configuration
///   ([`ClusterDns::configured`]: the search domains, so the connected namespace
///   `dev` and every `….svc` spelling, whose anchor is `svc.<domain>`) or the last
///   answer the cluster gave about it (`last_known`, however old: the cluster
///   cannot be asked now) said it exists; then [`Plan::Unreachable`]: a cluster
///   name never leaks upstream, even when nobody asked for it before the outage.
///   Otherwise it goes to the laptop's upstream as it would if no expansion
///   existed, so the rest of DNS keeps working while the cluster is away (case
///   dns-05);
/// - everything else is unchanged.
pub fn while_unreachable(
    plan: Plan,
    cluster: &ClusterDns,
    last_known: impl Fn(&Name) -> Option<bool>,
) -> Plan {
    match plan {
        Plan::Cluster | Plan::Unreachable => Plan::Unreachable,
        Plan::EmptyAaaa => Plan::EmptyAaaa,
        Plan::Upstream => Plan::Upstream,
        Plan::Search {
            otherwise: Otherwise::NxDomain,
            ..
        } => Plan::Unreachable,
        Plan::Search {
            candidates,
            otherwise: Otherwise::Upstream,
        } => {
            let cluster_name = candidates.iter().any(|c| match &c.anchor {
                Some(anchor) => cluster.configured(anchor) || last_known(anchor) == Some(true),
                None => true,
            });
            if cluster_name {
                Plan::Unreachable
            } else {
                Plan::Upstream
            }
        }
    }
}

/// Whether names exist in the cluster, with expiry. Pure: the caller passes `now`.
/// Bounded: when full, expired entries go, and if that frees nothing, everything.
#[derive(Debug)]
pub struct ExistenceCache {
    entries: HashMap<Name, (bool, Instant)>,
    capacity: usize,
}

impl ExistenceCache {
    /// A cache of at most `capacity` names.
    pub fn new(capacity: usize) -> Self {
        ExistenceCache {
            entries: HashMap::new(),
            capacity: capacity.max(1),
        }
    }

    /// `Some(exists)` while a fresh answer is cached.
    pub fn get(&self, name: &Name, now: Instant) -> Option<bool> {
        self.entries
            .get(&name.to_lowercase())
            .and_then(|(exists, until)| (now < *until).then_some(*exists))
    }

    /// Remember an answer for `ttl`, clamped to [`ANCHOR_TTL_BOUNDS`].
    pub fn insert(&mut self, name: &Name, exists: bool, ttl: Duration, now: Instant) {
        if self.entries.len() >= self.capacity {
            self.entries.retain(|_, (_, until)| now < *until);
            if self.entries.len() >= self.capacity {
                self.entries.clear();
            }
        }
        let ttl = ttl.clamp(ANCHOR_TTL_BOUNDS.0, ANCHOR_TTL_BOUNDS.1);
        self.entries
            .insert(name.to_lowercase(), (exists, now + ttl));
    }

    /// The last answer remembered for `name`, expired or not (`None`: never
    /// asked, or forgotten when the cache filled up). For guesses while the
    /// cluster cannot be asked ([`while_unreachable`]).
    pub fn last_known(&self, name: &Name) -> Option<bool> {
        self.entries
            .get(&name.to_lowercase())
            .map(|(exists, _)| *exists)
    }

    /// Number of entries (fresh or not).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(ns: &str) -> ClusterDns {
        ClusterDns::new(
            &["10.96.0.10".to_owned()],
            "cluster.local",
            &[
                format!("{ns}.svc.cluster.local"),
                "svc.cluster.local".to_owned(),
                "cluster.local".to_owned(),
            ],
            false,
        )
        .expect("valid config")
    }

    fn q(name: &str, t: RecordType) -> Query {
        Query::query(Name::from_ascii(name).expect("name"), t)
    }

    fn names(plan: &Plan) -> Vec<(String, Option<String>)> {
        match plan {
            Plan::Search { candidates, .. } => candidates
                .iter()
                .map(|c| (c.name.to_ascii(), c.anchor.as_ref().map(Name::to_ascii)))
                .collect(),
            other => panic!("not a search plan: {other:?}"),
        }
    }

    #[test]
    fn config_parses_servers_and_defaults_the_search_list() {
        let c = ClusterDns::new(
            &["10.96.0.10".into(), "[fd00::a]:5353".into()],
            "Cluster.Local.",
            &[],
            true,
        )
        .expect("valid");
        assert_eq!(
            c.servers,
            vec![
                "10.96.0.10:53".parse::<SocketAddr>().expect("addr"),
                "[fd00::a]:5353".parse().expect("addr")
            ]
        );
        assert_eq!(c.domain.to_ascii(), "cluster.local.");
        assert_eq!(c.search_text(), vec!["svc.cluster.local", "cluster.local"]);
        assert_eq!(c.servers_text(), "10.96.0.10:53, [fd00::a]:5353");
        assert_eq!(
            ClusterDns::new(&[], "cluster.local", &[], false),
            Err(ConfigError::NoServer)
        );
        assert!(matches!(
            ClusterDns::new(&["dns.example".into()], "cluster.local", &[], false),
            Err(ConfigError::Server(_))
        ));
        assert!(matches!(
            ClusterDns::new(&["10.96.0.10".into()], "a..b", &[], false),
            Err(ConfigError::Domain(_))
        ));
    }

    #[test]
    fn cluster_domain_names_go_to_the_cluster_with_or_without_trailing_dot() {
        let c = cluster("dev");
        for n in [
            "web.dev.svc.cluster.local",
            "web.dev.svc.cluster.local.",
            "WEB.Dev.SVC.Cluster.Local.",
            "cluster.local.",
            "10-244-1-11.dev.pod.cluster.local",
        ] {
            assert_eq!(classify(&q(n, RecordType::A), &c), Plan::Cluster, "{n}");
            assert_eq!(classify(&q(n, RecordType::SRV), &c), Plan::Cluster, "{n}");
        }
    }

    #[test]
    fn aaaa_on_an_ipv4_only_cluster_is_answered_empty() {
        let mut c = cluster("dev");
        let aaaa = q("web.dev.svc.cluster.local.", RecordType::AAAA);
        assert_eq!(classify(&aaaa, &c), Plan::EmptyAaaa);
        c.ipv6 = true;
        assert_eq!(classify(&aaaa, &c), Plan::Cluster);
    }

    #[test]
    fn single_labels_expand_connected_namespace_first_and_never_go_upstream() {
        let c = cluster("dev");
        for n in ["web", "web."] {
            let plan = classify(&q(n, RecordType::A), &c);
            assert_eq!(
                names(&plan),
                vec![
                    ("web.dev.svc.cluster.local.".to_owned(), None),
                    ("web.svc.cluster.local.".to_owned(), None),
                    ("web.cluster.local.".to_owned(), None),
                ]
            );
            assert!(matches!(
                plan,
                Plan::Search {
                    otherwise: Otherwise::NxDomain,
                    ..
                }
            ));
        }
        // AAAA expands as well (the cluster answers NODATA for IPv4 Services).
        assert!(matches!(
            classify(&q("web", RecordType::AAAA), &c),
            Plan::Search { .. }
        ));
    }

    #[test]
    fn multi_label_spellings_expand_with_anchors_and_fall_back_upstream() {
        let c = cluster("dev");
        let plan = classify(&q("web.dev.", RecordType::A), &c);
        assert_eq!(
            names(&plan),
            vec![
                (
                    "web.dev.dev.svc.cluster.local.".to_owned(),
                    Some("dev.dev.svc.cluster.local.".to_owned())
                ),
                (
                    "web.dev.svc.cluster.local.".to_owned(),
                    Some("dev.svc.cluster.local.".to_owned())
                ),
                (
                    "web.dev.cluster.local.".to_owned(),
                    Some("dev.cluster.local.".to_owned())
                ),
            ]
        );
        assert!(matches!(
            plan,
            Plan::Search {
                otherwise: Otherwise::Upstream,
                ..
            }
        ));
        let plan = classify(&q("web.dev.svc", RecordType::A), &c);
        assert_eq!(names(&plan)[2].0, "web.dev.svc.cluster.local.");
        assert_eq!(
            names(&plan)[2].1.as_deref(),
            Some("svc.cluster.local."),
            "anchor of svc.ns.svc is svc.<domain>"
        );
        let plan = classify(&q("_http._tcp.web.dev", RecordType::SRV), &c);
        assert_eq!(names(&plan)[1].0, "_http._tcp.web.dev.svc.cluster.local.");
    }

    /// Issue 29 item 2: with a namespace named like a top-level domain (`dev`),
    /// `go.dev`, `pkg.go.dev` and `mycorp.dev` still ask the cluster first (a
    /// Service `go` in `dev` would answer, as in a pod), but the cluster's
    /// NXDOMAIN for them falls through to the laptop's upstream; only a
    /// `….svc` spelling's NXDOMAIN is final.
    #[test]
    fn the_cluster_nxdomain_of_svc_ns_spellings_falls_through_but_not_of_svc_ones() {
        for connected in ["dev", "default"] {
            let c = cluster(connected);
            for n in [
                "go.dev",
                "mycorp.dev.",
                "pkg.go.dev",
                "_http._tcp.web.dev",
                "web.default",
                "nosuch.default",
            ] {
                let t = if n.starts_with('_') {
                    RecordType::SRV
                } else {
                    RecordType::A
                };
                let Plan::Search {
                    candidates,
                    otherwise,
                } = classify(&q(n, t), &c)
                else {
                    panic!("{n}: not a search plan");
                };
                assert_eq!(otherwise, Otherwise::Upstream, "{n}");
                assert_eq!(candidates.len(), 3, "{n}");
                for cand in &candidates {
                    assert_eq!(
                        cand.if_missing,
                        Otherwise::Upstream,
                        "{n} ({connected}): {} must not end a public name",
                        cand.name
                    );
                }
            }
            // `….svc`: the expansion under `svc.<domain>` is the cluster's own.
            for n in ["nosuch.dev.svc", "pod-1.web.dev.svc"] {
                let Plan::Search { candidates, .. } = classify(&q(n, RecordType::A), &c) else {
                    panic!("{n}: not a search plan");
                };
                let finals: Vec<String> = candidates
                    .iter()
                    .filter(|c| c.if_missing == Otherwise::NxDomain)
                    .map(|c| c.name.to_ascii())
                    .collect();
                assert_eq!(finals, vec![format!("{}.cluster.local.", n)], "{n}");
            }
            // Single labels have no anchor: NXDOMAIN, never upstream.
            let Plan::Search {
                candidates,
                otherwise,
            } = classify(&q("web", RecordType::A), &c)
            else {
                panic!("web: not a search plan");
            };
            assert_eq!(otherwise, Otherwise::NxDomain);
            assert!(
                candidates
                    .iter()
                    .all(|c| c.if_missing == Otherwise::NxDomain)
            );
        }
        // Case does not matter, nor another cluster domain.
        let other =
            ClusterDns::new(&["10.0.0.10".into()], "Corp.Cluster", &[], false).expect("valid");
        let anchor = |s: &str| Name::from_ascii(s).expect("name");
        assert_eq!(
            if_missing(Some(&anchor("SVC.corp.cluster.")), &other),
            Otherwise::NxDomain
        );
        assert_eq!(
            if_missing(Some(&anchor("svc.cluster.local.")), &other),
            Otherwise::Upstream
        );
        assert_eq!(
            if_missing(Some(&anchor("dev.svc.corp.cluster.")), &other),
            Otherwise::Upstream
        );
        assert_eq!(if_missing(None, &other), Otherwise::NxDomain);
    }

    #[test]
    fn ptr_of_cluster_addresses_goes_to_the_cluster() {
        let c = cluster("dev").with_reverse([
            "10.96.0.0/12".parse().expect("cidr"),
            "10.244.0.0/16".parse().expect("cidr"),
            "fd00:10:96::/112".parse().expect("cidr"),
        ]);
        for n in [
            "100.0.96.10.in-addr.arpa.",
            "11.1.244.10.IN-ADDR.ARPA",
            "a.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.6.9.0.0.0.1.0.0.0.0.d.f.ip6.arpa.",
        ] {
            assert_eq!(classify(&q(n, RecordType::PTR), &c), Plan::Cluster, "{n}");
        }
        for n in [
            "1.1.168.192.in-addr.arpa.",
            "96.10.in-addr.arpa.",
            "1.0.0.96.10.in-addr.arpa.",
            "100.0.96.010.in-addr.arpa.",
            "x.0.96.10.in-addr.arpa.",
        ] {
            assert_eq!(classify(&q(n, RecordType::PTR), &c), Plan::Upstream, "{n}");
        }
        assert_eq!(
            reverse_ip(&Name::from_ascii("4.3.2.1.in-addr.arpa.").expect("name")),
            Some("1.2.3.4".parse().expect("ip"))
        );
        // Without the cluster's ranges, reverse names stay the laptop's.
        assert_eq!(
            classify(
                &q("100.0.96.10.in-addr.arpa.", RecordType::PTR),
                &cluster("dev")
            ),
            Plan::Upstream
        );
    }

    #[test]
    fn the_rest_goes_upstream_unchanged() {
        let c = cluster("dev");
        for (n, t) in [
            ("a.b.c.d.example.com.", RecordType::A),
            (".", RecordType::NS),
            ("localhost.", RecordType::A),
            ("com.", RecordType::NS),
            ("com.", RecordType::DS),
            ("example.com.", RecordType::MX),
            ("1.0.96.10.in-addr.arpa.", RecordType::PTR),
        ] {
            assert_eq!(classify(&q(n, t), &c), Plan::Upstream, "{n} {t}");
        }
        let mut chaos = q("version.bind.", RecordType::TXT);
        chaos.set_query_class(DNSClass::CH);
        assert_eq!(classify(&chaos, &c), Plan::Upstream);
    }

    #[test]
    fn several_clusters_most_recent_first() {
        let dev = cluster("dev");
        let other =
            ClusterDns::new(&["10.0.0.10".into()], "other.example", &[], false).expect("valid");
        let (plan, c) =
            classify_all(&q("x.other.example.", RecordType::A), [&dev, &other]).expect("other's");
        assert_eq!(plan, Plan::Cluster);
        assert_eq!(c, &other);
        let (_, c) = classify_all(&q("web", RecordType::A), [&dev, &other]).expect("dev's");
        assert_eq!(c, &dev);
        // A long public name: nobody's.
        assert!(classify_all(&q("a.b.c.d.e.example.", RecordType::A), [&dev, &other]).is_none());
    }

    #[test]
    fn while_the_session_is_down_cluster_names_fail_at_once_and_the_rest_stays_upstream() {
        let c = cluster("default").with_reverse(["10.96.0.0/12".parse().expect("cidr")]);
        let t0 = Instant::now();
        let mut cache = ExistenceCache::new(16);
        let anchor = |s: &str| Name::from_ascii(s).expect("name");
        // What the cluster said before the hole: namespace default exists, no
        // namespace or Service `com`; answers long expired by now.
        for present in ["default.svc.cluster.local.", "svc.cluster.local."] {
            cache.insert(&anchor(present), true, Duration::from_secs(5), t0);
        }
        for absent in [
            "default.default.svc.cluster.local.",
            "default.cluster.local.",
            "com.default.svc.cluster.local.",
            "com.svc.cluster.local.",
            "com.cluster.local.",
        ] {
            cache.insert(&anchor(absent), false, Duration::from_secs(5), t0);
        }
        let later = t0 + Duration::from_secs(3600);
        assert_eq!(
            cache.get(&anchor("default.svc.cluster.local."), later),
            None,
            "expired for normal use"
        );
        let down = |n: &str, t: RecordType| {
            while_unreachable(classify(&q(n, t), &c), &c, |a| cache.last_known(a))
        };
        for (n, t) in [
            ("web.default.svc.cluster.local.", RecordType::A),
            ("web.default.svc.cluster.local", RecordType::SRV),
            ("cluster.local.", RecordType::SOA),
            ("100.0.96.10.in-addr.arpa.", RecordType::PTR),
            // Single labels can only be cluster names.
            ("web", RecordType::A),
            ("nosuchsvc.", RecordType::AAAA),
            // The last known answer says namespace `default` exists.
            ("web.default", RecordType::A),
            ("web.default.svc", RecordType::A),
        ] {
            assert_eq!(down(n, t), Plan::Unreachable, "{n} {t}");
        }
        // Answered without the cluster anyway (dns-09).
        assert_eq!(
            down("web.default.svc.cluster.local.", RecordType::AAAA),
            Plan::EmptyAaaa
        );
        for (n, t) in [
            // Anchors known not to exist, or never asked: the laptop's.
            ("www.example.com.", RecordType::A),
            ("host.corp.test.", RecordType::A),
            ("web.nosuchns.", RecordType::A),
            // Never the cluster's.
            ("a.b.c.d.example.com.", RecordType::A),
            ("1.1.168.192.in-addr.arpa.", RecordType::PTR),
            ("example.com.", RecordType::MX),
        ] {
            assert_eq!(down(n, t), Plan::Upstream, "{n} {t}");
        }
        // Connected: the same questions are planned as before (not Unreachable).
        assert!(matches!(
            classify(&q("web.default", RecordType::A), &c),
            Plan::Search { .. }
        ));
        assert_eq!(
            classify(&q("web.default.svc.cluster.local.", RecordType::A), &c),
            Plan::Cluster
        );
    }

    /// Issue 5 leftover: a cluster name asked for the first time during an
    /// outage (no answer about its namespace was ever cached) still never goes
    /// upstream when the configuration says it is the cluster's: the connected
    /// namespace (`web.dev`) and every `….svc` spelling of any namespace. Other
    /// two-label names of the laptop (`www.example`, `web.nosuchns`) still do.
    #[test]
    fn during_an_outage_connected_namespace_and_svc_spellings_never_leak() {
        let c = cluster("dev");
        let nothing_cached = |_: &Name| None;
        for (n, t) in [
            ("web.dev", RecordType::A),
            ("web.dev.", RecordType::AAAA),
            ("_http._tcp.web.dev", RecordType::SRV),
            ("web.dev.svc", RecordType::A),
            ("web.other.svc", RecordType::A),
            ("web.other.svc.", RecordType::AAAA),
            ("pod-1.web.other.svc", RecordType::A),
            ("other.svc", RecordType::A),
        ] {
            assert_eq!(
                while_unreachable(classify(&q(n, t), &c), &c, nothing_cached),
                Plan::Unreachable,
                "{n} {t} must not go upstream during an outage"
            );
        }
        for n in [
            "www.example",
            "web.nosuchns",
            "host.corp.test",
            "www.example.com",
        ] {
            assert_eq!(
                while_unreachable(classify(&q(n, RecordType::A), &c), &c, nothing_cached),
                Plan::Upstream,
                "{n} is the laptop's"
            );
        }
        // A namespace the route watch reported is the cluster's too.
        let watched = c
            .clone()
            .with_namespaces(["other", "Kube-System", "not.a.label"]);
        for n in ["web.other", "kube-dns.kube-system"] {
            assert_eq!(
                while_unreachable(
                    classify(&q(n, RecordType::A), &watched),
                    &watched,
                    nothing_cached
                ),
                Plan::Unreachable,
                "{n}: its namespace has Services"
            );
        }
        assert_eq!(watched.namespaces.len(), 2, "{:?}", watched.namespaces);
        // Configured zones, case-insensitively; not their children.
        for (n, yes) in [
            ("cluster.local.", true),
            ("SVC.cluster.local.", true),
            ("dev.svc.cluster.local.", true),
            ("other.svc.cluster.local.", false),
            ("com.cluster.local.", false),
        ] {
            assert_eq!(
                c.configured(&Name::from_ascii(n).expect("name")),
                yes,
                "{n}"
            );
        }
    }

    #[test]
    fn existence_cache_expires_clamps_and_stays_bounded() {
        let t0 = Instant::now();
        let mut cache = ExistenceCache::new(2);
        let dev = Name::from_ascii("dev.svc.cluster.local.").expect("name");
        let com = Name::from_ascii("com.svc.cluster.local.").expect("name");
        cache.insert(&dev, true, Duration::from_secs(5), t0);
        cache.insert(&com, false, Duration::from_secs(3600), t0);
        assert_eq!(cache.get(&dev, t0), Some(true));
        assert_eq!(
            cache.get(
                &Name::from_ascii("DEV.svc.cluster.local.").expect("name"),
                t0
            ),
            Some(true),
            "case-insensitive"
        );
        assert_eq!(cache.get(&com, t0 + Duration::from_secs(29)), Some(false));
        assert_eq!(
            cache.get(&com, t0 + Duration::from_secs(31)),
            None,
            "TTL capped at 30 s"
        );
        assert_eq!(cache.get(&dev, t0 + Duration::from_secs(6)), None);
        // Zero TTL still caches for a second.
        let x = Name::from_ascii("x.").expect("name");
        cache.insert(&x, true, Duration::ZERO, t0 + Duration::from_secs(100));
        assert!(cache.len() <= 2);
        assert_eq!(
            cache.get(&x, t0 + Duration::from_millis(100_500)),
            Some(true)
        );
    }

    /// Include suffixes send their names to the cluster DNS unchanged (no
    /// search expansion, no empty-AAAA shortcut); exclude suffixes send names
    /// upstream even under the cluster domain; both match the suffix itself and
    /// every name below it, case-insensitively, with or without a leading dot.
    #[test]
    fn include_and_exclude_suffixes_decide_before_the_other_rules() {
        let c = ClusterDns::new(
            &["10.96.0.10".into()],
            "cluster.local",
            &[
                "dev.svc.cluster.local".into(),
                "svc.cluster.local".into(),
                "cluster.local".into(),
            ],
            false,
        )
        .expect("config")
        .with_suffixes(
            &[".corp.example".into(), "db.internal".into()],
            &["legacy.cluster.local".into(), "public.corp.example".into()],
        )
        .expect("suffixes");
        let q = |name: &str, t: RecordType| {
            classify(&Query::query(Name::from_ascii(name).expect("name"), t), &c)
        };
        assert_eq!(q("corp.example", RecordType::A), Plan::Cluster);
        assert_eq!(q("Api.CORP.example.", RecordType::A), Plan::Cluster);
        assert_eq!(q("api.corp.example", RecordType::AAAA), Plan::Cluster);
        assert_eq!(q("db.internal", RecordType::A), Plan::Cluster);
        assert_eq!(q("x.db.internal", RecordType::A), Plan::Cluster);
        // Not a suffix match: "notcorp.example" is another name.
        assert_ne!(q("notcorp.example", RecordType::A), Plan::Cluster);
        // Exclusion wins, also over the cluster domain and an include suffix.
        assert_eq!(q("a.legacy.cluster.local", RecordType::A), Plan::Upstream);
        assert_eq!(q("www.public.corp.example", RecordType::A), Plan::Upstream);
        // The rest as before.
        assert_eq!(q("web.dev.svc.cluster.local", RecordType::A), Plan::Cluster);
        // Short spellings are not expanded into an excluded name.
        match q("x.legacy", RecordType::A) {
            Plan::Search { candidates, .. } => assert!(
                candidates
                    .iter()
                    .all(|c| !c.name.to_ascii().contains("legacy.cluster.local")),
                "x.legacy expanded into the excluded legacy.cluster.local: {candidates:?}"
            ),
            other => panic!("x.legacy: {other:?}"),
        }
        // With the whole cluster domain excluded, short names go upstream too
        // (case F3 of #29: `web.default` answered while its full name was not).
        let all_out = ClusterDns::new(
            &["10.96.0.10".into()],
            "cluster.local",
            &["dev.svc.cluster.local".into(), "svc.cluster.local".into()],
            false,
        )
        .expect("config")
        .with_suffixes(&[], &["cluster.local".into()])
        .expect("suffixes");
        for name in ["web.dev", "web", "web.dev.svc.cluster.local"] {
            assert_eq!(
                classify(
                    &Query::query(Name::from_ascii(name).expect("name"), RecordType::A),
                    &all_out
                ),
                Plan::Upstream,
                "{name} with cluster.local excluded"
            );
        }
        assert_eq!(q("www.example.com", RecordType::NS), Plan::Upstream);
        assert_eq!(
            ClusterDns::new(&["10.96.0.10".into()], "cluster.local", &[], false)
                .expect("config")
                .with_suffixes(&["bad..name".into()], &[])
                .err(),
            Some(ConfigError::Domain("bad..name".into()))
        );
    }
}
