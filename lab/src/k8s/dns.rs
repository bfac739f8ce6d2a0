//! The lab's cluster DNS (lab-only code): an authoritative DNS server for the cluster
//! domain that answers from the Services and Endpoints of the lab's apiserver, following
//! the Kubernetes DNS-Based Service Discovery specification (schema 1.0.1,
//! github.com/kubernetes/dns, docs/specification.md). hickory parses and encodes every
//! message and runs the UDP and TCP listeners; nothing here reads DNS bytes by hand.
//!
//! Records ([`ClusterRecords::build`], all with TTL [`DNS_TTL`] = 5 s):
//! - `dns-version.<zone>` TXT `"1.0.1"`; the zone apex SOA and NS (`ns.dns.<zone>`, whose
//!   A is the DNS Service's ClusterIP, as CoreDNS does).
//! - ClusterIP Service: `<svc>.<ns>.svc.<zone>` A (AAAA for IPv6 ClusterIPs),
//!   `_<port>._<proto>.<svc>.<ns>.svc.<zone>` SRV `0 100 <port> <svc>.<ns>.svc.<zone>`
//!   per named port, and the PTR of each ClusterIP.
//! - Headless Service: one A per ready endpoint at `<svc>.<ns>.svc.<zone>`; for each
//!   endpoint `<hostname>.<svc>.<ns>.svc.<zone>` A, where the hostname is the endpoint's
//!   `hostname` or else its address with dashes (`10-244-1-11`, CoreDNS's choice); SRV
//!   per named endpoint port and endpoint, target the endpoint's name, port number from
//!   the Endpoints (= the Service port when targetPort equals port, the usual case for
//!   headless Services; kube-dns and CoreDNS do the same); PTR per endpoint. No ready
//!   endpoints: no records, so NXDOMAIN (spec 2.4.1). Not-ready endpoints count when the
//!   Service publishes them (`publishNotReadyAddresses` or the tolerate-unready
//!   annotation).
//! - ExternalName Service: CNAME to the external name (followed when it points inside
//!   the zone; nothing else is resolved, there is no upstream).
//! - Pods (deprecated but required, spec 2.6): `<a>-<b>-<c>-<d>.<ns>.pod.<zone>` A, for
//!   any address (CoreDNS's "pods insecure" mode).
//!
//! Answers ([`ClusterRecords::lookup`], case-insensitive): NOERROR with the records;
//! NOERROR without answers (NODATA) for an existing name without records of the asked
//! type (AAAA of an IPv4 Service) or an empty non-terminal (`<ns>.svc.<zone>`);
//! NXDOMAIN for any other name in the zone; both negative answers carry the zone's SOA
//! in the authority section (negative TTL 5 s). Reverse zones (`in-addr.arpa` names of
//! the service and pod CIDRs, rounded out to whole octets) answer PTR the same way.
//! Names outside the cluster domain and those reverse zones get REFUSED: the lab has no
//! internet and so no upstream to forward to, and REFUSED (rather than NXDOMAIN) tells a
//! resolver at once that this server has no authority there, without denying a name
//! that may exist.
//!
//! Size: over UDP an answer is cut at the client's EDNS buffer size (512 bytes without
//! EDNS) with the TC bit set, and the same question over TCP gets everything (case
//! dns-08: a headless Service with 300 endpoints).
//!
//! How it runs ([`ClusterDns::deploy`]), like a real cluster's DNS: in its own pod netns
//! `kube-dns` on the node bridge, behind a Service `kube-system/kube-dns` with ClusterIP
//! [`CLUSTER_DNS_IP`] (10.96.0.10, ports `dns` 53/UDP and `dns-tcp` 53/TCP) whose
//! Endpoints the server registers itself; the kube-proxy stand-in DNATs the ClusterIP to
//! the pod, so queries from pods, from the node and from kvpn's manager take the path
//! they take in a cluster, and the server sees the client's pod IP. The server itself
//! is a thread of the calling process with a current-thread tokio runtime; only its
//! sockets live in the pod netns.
//!
//! On real nodes ([`super::node::cluster_dns`]) the same server runs inside a real
//! pod instead: `kvpn-lab-server dns` from the lab-server image, with the pod's
//! service account ([`DnsServerConfig::in_cluster`]) and no registration (a
//! selector Service maps port 53 to its port 5353).
//!
//! I/O: the Kubernetes API (watch, the kube-dns Service and Endpoints), the two
//! sockets, and the pod netns via [`crate::topology::Node`]. [`ClusterRecords`] and
//! [`resolv_conf`] are pure.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::iter;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hickory_server::net::runtime::Time;
use hickory_server::proto::op::{
    Edns, Header, HeaderCounts, MessageType, Metadata, OpCode, ResponseCode,
};
use hickory_server::proto::rr::rdata::{A, AAAA, CNAME, NS, PTR, SOA, SRV, TXT};
use hickory_server::proto::rr::{DNSClass, LowerName, Name, RData, Record, RecordType};
use hickory_server::server::{Request, RequestHandler, ResponseHandler, ResponseInfo};
use hickory_server::zone_handler::MessageResponseBuilder;
use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Endpoints, Service};
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use tokio::sync::oneshot;

use super::kube_proxy::services::{EndpointAddressInfo, ServiceKind, ServiceWatch, Snapshot};
use crate::LabError;
use crate::netns::Netns;
use crate::topology::{Node, Pod};

/// The cluster domain.
pub const CLUSTER_DOMAIN: &str = "cluster.local";
/// The kube-dns Service's ClusterIP (what pods' resolv.conf names).
pub const CLUSTER_DNS_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// TTL of every record and of negative answers (seconds), as CoreDNS's default.
pub const DNS_TTL: u32 = 5;
/// The DNS schema version this server implements (`dns-version.<zone>` TXT).
pub const SCHEMA_VERSION: &str = "1.0.1";
/// Namespace and name of the DNS Service.
pub const DNS_SERVICE_NAMESPACE: &str = "kube-system";
pub const DNS_SERVICE_NAME: &str = "kube-dns";
/// Name of the DNS pod on the node (netns `kvpn-<id>-kube-dns`).
pub const DNS_POD_NAME: &str = "kube-dns";
/// Longest chain of CNAMEs followed inside the zone.
const MAX_CNAME_CHAIN: usize = 8;
/// How long an idle TCP client connection is kept.
const TCP_IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// Responses queued per TCP connection.
const TCP_RESPONSE_BUFFER: usize = 32;

/// A pod's `/etc/resolv.conf`, as the kubelet writes it for `dnsPolicy: ClusterFirst`
/// in `namespace`: the cluster DNS, the standard search list and `ndots:5`.
pub fn resolv_conf(namespace: &str) -> String {
    format!(
        "nameserver {CLUSTER_DNS_IP}\nsearch {namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}\noptions ndots:5\n"
    )
}

/// Errors of the cluster DNS.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cluster DNS: {0}")]
    Client(#[from] super::Error),
    #[error("cluster DNS: {what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("cluster DNS: {0}")]
    Lab(#[from] LabError),
    #[error("cluster DNS: cannot bind {addr} in netns {netns}: {source}")]
    Bind {
        addr: SocketAddr,
        netns: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cluster DNS: invalid cluster domain `{domain}`: {why}")]
    Domain { domain: String, why: String },
    #[error("cluster DNS: Services/Endpoints not listed within {after:?} — is the apiserver up?")]
    NotSynced { after: Duration },
    #[error(
        "cluster DNS: no in-cluster API configuration ({0}) — run it in a pod with a service account token, or give it a kubeconfig"
    )]
    InCluster(String),
    #[error("cluster DNS: cannot start its thread: {0}")]
    Thread(std::io::Error),
    #[error("cluster DNS: its thread stopped: {0}")]
    Stopped(String),
}

// --- the pure core: records from a snapshot ---------------------------------------

/// What the zone holds besides the Services.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZoneConfig {
    /// The cluster domain, without trailing dot.
    pub domain: String,
    /// TTL of every record and of negative answers (seconds).
    pub ttl: u32,
    /// CIDRs whose reverse (`in-addr.arpa` / `ip6.arpa`) names this server answers,
    /// rounded out to whole octets (nibbles for IPv6).
    pub reverse_cidrs: Vec<IpNet>,
    /// The DNS Service's ClusterIP, the address of `ns.dns.<zone>`.
    pub dns_ip: IpAddr,
}

impl Default for ZoneConfig {
    /// `cluster.local`, TTL 5 s, reverse zones of the lab's service and pod CIDRs,
    /// nameserver 10.96.0.10.
    fn default() -> Self {
        ZoneConfig {
            domain: CLUSTER_DOMAIN.to_owned(),
            ttl: DNS_TTL,
            reverse_cidrs: vec![IpNet::V4(crate::SERVICE_CIDR), IpNet::V4(crate::POD_CIDR)],
            dns_ip: IpAddr::V4(CLUSTER_DNS_IP),
        }
    }
}

/// The answer to one question.
#[derive(Debug, Clone, PartialEq)]
pub struct Lookup {
    pub rcode: ResponseCode,
    /// AA bit: the name is inside a zone this server is authoritative for.
    pub authoritative: bool,
    pub answers: Vec<Record>,
    /// The zone's SOA on negative answers.
    pub authorities: Vec<Record>,
    /// A/AAAA of SRV targets.
    pub additionals: Vec<Record>,
}

impl Lookup {
    fn refused() -> Lookup {
        Lookup {
            rcode: ResponseCode::Refused,
            authoritative: false,
            answers: Vec::new(),
            authorities: Vec::new(),
            additionals: Vec::new(),
        }
    }
}

#[derive(Debug, Clone)]
struct Zone {
    apex: LowerName,
    soa: Record,
}

/// Every record of the cluster zone and its reverse zones, indexed by owner name.
/// Built from a [`Snapshot`]; immutable (a change builds a new one).
#[derive(Debug, Clone)]
pub struct ClusterRecords {
    domain: Name,
    ttl: u32,
    /// Longest apex first, so the first zone that contains a name is its zone.
    zones: Vec<Zone>,
    nodes: HashMap<LowerName, Vec<Record>>,
    /// Names that exist only because names below them do (RFC 8020: NODATA, not
    /// NXDOMAIN).
    empty_non_terminals: HashSet<LowerName>,
}

fn name_err(domain: &str) -> impl FnOnce(hickory_server::proto::ProtoError) -> Error + '_ {
    move |e| Error::Domain {
        domain: domain.to_owned(),
        why: e.to_string(),
    }
}

/// `label.parent`, or None when `label` is not a valid DNS label (logged).
fn child(parent: &Name, label: &str) -> Option<Name> {
    match parent.prepend_label(label) {
        Ok(n) => Some(n),
        Err(e) => {
            tracing::warn!(label, parent = %parent, error = %e, "not a DNS label; record skipped");
            None
        }
    }
}

/// The reverse-zone apex covering `cidr`, rounded out to whole octets / nibbles.
fn reverse_apex(cidr: IpNet) -> Option<Name> {
    let (labels, suffix): (Vec<String>, &str) = match cidr {
        IpNet::V4(n) => {
            let octets = usize::from(n.prefix_len() / 8);
            (
                n.network().octets()[..octets]
                    .iter()
                    .rev()
                    .map(u8::to_string)
                    .collect(),
                "in-addr.arpa.",
            )
        }
        IpNet::V6(n) => {
            let nibbles = usize::from(n.prefix_len() / 4);
            let all: Vec<String> = n
                .network()
                .octets()
                .iter()
                .flat_map(|b| [b >> 4, b & 0xf])
                .map(|x| format!("{x:x}"))
                .collect();
            (all[..nibbles].iter().rev().cloned().collect(), "ip6.arpa.")
        }
    };
    let mut name = labels.join(".");
    if !name.is_empty() {
        name.push('.');
    }
    name.push_str(suffix);
    Name::from_ascii(name).ok()
}

/// `10-244-1-11` for 10.244.1.11 (`fd00--1` style for IPv6: colons become dashes).
fn dashed(ip: IpAddr) -> String {
    ip.to_string().replace(['.', ':'], "-")
}

fn addr_rdata(ip: IpAddr) -> RData {
    match ip {
        IpAddr::V4(v4) => RData::A(A(v4)),
        IpAddr::V6(v6) => RData::AAAA(AAAA(v6)),
    }
}

impl ClusterRecords {
    /// Builds every record for `snapshot` (pure). `serial` is the SOA serial; bump it
    /// on every rebuild.
    pub fn build(snapshot: &Snapshot, config: &ZoneConfig, serial: u32) -> Result<Self, Error> {
        let domain = Name::from_ascii(format!("{}.", config.domain.trim_end_matches('.')))
            .map_err(name_err(&config.domain))?;
        let ns_name = Name::from_ascii("ns.dns")
            .and_then(|n| n.append_domain(&domain))
            .map_err(name_err(&config.domain))?;
        let hostmaster = Name::from_ascii("hostmaster")
            .and_then(|n| n.append_domain(&domain))
            .map_err(name_err(&config.domain))?;
        let ttl = config.ttl;
        let soa_for = |apex: &Name| {
            Record::from_rdata(
                apex.clone(),
                ttl,
                RData::SOA(SOA::new(
                    ns_name.clone(),
                    hostmaster.clone(),
                    serial,
                    7200,
                    1800,
                    86400,
                    ttl,
                )),
            )
        };
        let mut apexes: Vec<Name> = vec![domain.clone()];
        for cidr in &config.reverse_cidrs {
            if let Some(apex) = reverse_apex(*cidr)
                && !apexes.iter().any(|a| a.zone_of(&apex))
            {
                apexes.retain(|a| !apex.zone_of(a));
                apexes.push(apex);
            }
        }
        apexes.sort_by_key(|a| std::cmp::Reverse(a.num_labels()));
        let zones: Vec<Zone> = apexes
            .iter()
            .map(|apex| Zone {
                apex: LowerName::from(apex),
                soa: soa_for(apex),
            })
            .collect();

        let mut records = ClusterRecords {
            domain: domain.clone(),
            ttl,
            zones,
            nodes: HashMap::new(),
            empty_non_terminals: HashSet::new(),
        };
        for apex in &apexes {
            records.add(soa_for(apex));
            records.add(Record::from_rdata(
                apex.clone(),
                ttl,
                RData::NS(NS(ns_name.clone())),
            ));
        }
        records.add(Record::from_rdata(
            ns_name.clone(),
            ttl,
            addr_rdata(config.dns_ip),
        ));
        if let Some(version) = child(&domain, "dns-version") {
            records.add(Record::from_rdata(
                version,
                ttl,
                RData::TXT(TXT::new(vec![SCHEMA_VERSION.to_owned()])),
            ));
        }
        let svc_zone = child(&domain, "svc");
        let pod_zone = child(&domain, "pod");
        for svc in snapshot.services.values() {
            let Some(base) = svc_zone
                .as_ref()
                .and_then(|z| child(z, &svc.namespace))
                .and_then(|n| child(&n, &svc.name))
            else {
                continue;
            };
            match &svc.kind {
                ServiceKind::ClusterIp(ips) => {
                    for ip in ips {
                        records.add(Record::from_rdata(base.clone(), ttl, addr_rdata(*ip)));
                        records.add_ptr(*ip, &base);
                    }
                    for port in svc.ports.iter().filter(|p| !p.name.is_empty()) {
                        if let Some(owner) = srv_owner(&base, &port.name, port.protocol.as_str()) {
                            records.add(Record::from_rdata(
                                owner,
                                ttl,
                                RData::SRV(SRV::new(0, 100, port.port, base.clone())),
                            ));
                        }
                    }
                }
                ServiceKind::Headless => {
                    let Some(endpoints) = snapshot.endpoints_of(svc) else {
                        continue;
                    };
                    for subset in &endpoints.subsets {
                        let published: Vec<&EndpointAddressInfo> = subset
                            .ready
                            .iter()
                            .chain(subset.not_ready.iter().filter(|_| svc.publish_not_ready))
                            .collect();
                        for addr in published {
                            let hostname = addr.hostname.clone().unwrap_or_else(|| dashed(addr.ip));
                            let Some(host) = child(&base, &hostname) else {
                                continue;
                            };
                            records.add(Record::from_rdata(base.clone(), ttl, addr_rdata(addr.ip)));
                            records.add(Record::from_rdata(host.clone(), ttl, addr_rdata(addr.ip)));
                            records.add_ptr(addr.ip, &host);
                            for port in subset.ports.iter().filter(|p| !p.name.is_empty()) {
                                if let Some(owner) =
                                    srv_owner(&base, &port.name, port.protocol.as_str())
                                {
                                    records.add(Record::from_rdata(
                                        owner,
                                        ttl,
                                        RData::SRV(SRV::new(0, 100, port.port, host.clone())),
                                    ));
                                }
                            }
                        }
                    }
                }
                ServiceKind::ExternalName(target) => {
                    match Name::from_ascii(format!("{}.", target.trim_end_matches('.'))) {
                        Ok(target) if !target.is_root() => records.add(Record::from_rdata(
                            base.clone(),
                            ttl,
                            RData::CNAME(CNAME(target)),
                        )),
                        _ => tracing::warn!(
                            service = %base,
                            target,
                            "ExternalName is not a domain name; no record"
                        ),
                    }
                }
            }
        }
        // `svc.<zone>` and `pod.<zone>` exist even with nothing below them.
        for n in [svc_zone, pod_zone].into_iter().flatten() {
            records.empty_non_terminals.insert(LowerName::from(&n));
        }
        records.index_empty_non_terminals();
        Ok(records)
    }

    /// Adds `record` unless an identical one is there (an address in two subsets).
    fn add(&mut self, record: Record) {
        let rrs = self.nodes.entry(LowerName::from(&record.name)).or_default();
        if !rrs.contains(&record) {
            rrs.push(record);
        }
    }

    fn add_ptr(&mut self, ip: IpAddr, target: &Name) {
        let owner = Name::from(ip);
        if self.zone_of(&LowerName::from(&owner)).is_some() {
            self.add(Record::from_rdata(
                owner,
                self.ttl,
                RData::PTR(PTR(target.clone())),
            ));
        }
    }

    fn index_empty_non_terminals(&mut self) {
        let mut ents = Vec::new();
        for owner in self.nodes.keys() {
            let Some(zone) = self.zone_of(owner) else {
                continue;
            };
            let mut n = owner.base_name();
            while zone.apex.zone_of(&n) && n != zone.apex {
                if !self.nodes.contains_key(&n) {
                    ents.push(n.clone());
                }
                n = n.base_name();
            }
        }
        self.empty_non_terminals.extend(ents);
    }

    fn zone_of(&self, name: &LowerName) -> Option<&Zone> {
        self.zones.iter().find(|z| z.apex.zone_of(name))
    }

    /// The zone's SOA for a negative answer (TTL = the SOA minimum, RFC 2308).
    fn negative(&self, zone: &Zone, rcode: ResponseCode) -> Lookup {
        Lookup {
            rcode,
            authoritative: true,
            answers: Vec::new(),
            authorities: vec![zone.soa.clone()],
            additionals: Vec::new(),
        }
    }

    /// Answers `qname qclass qtype` (pure). Owner names of answers at `qname` keep the
    /// question's spelling (0x20 case randomisation survives).
    pub fn lookup(&self, qname: &Name, qclass: DNSClass, qtype: RecordType) -> Lookup {
        let lower = LowerName::from(qname);
        let Some(zone) = self.zone_of(&lower) else {
            return Lookup::refused();
        };
        if qclass != DNSClass::IN && qclass != DNSClass::ANY {
            return Lookup::refused();
        }
        if let Some(pod) = self.pod_lookup(qname, qtype) {
            return pod.unwrap_or_else(|rcode| self.negative(zone, rcode));
        }
        let Some(rrs) = self.nodes.get(&lower) else {
            let rcode = if self.empty_non_terminals.contains(&lower) {
                ResponseCode::NoError
            } else {
                ResponseCode::NXDomain
            };
            return self.negative(zone, rcode);
        };
        let mut answers: Vec<Record> = Vec::new();
        let cname = rrs.iter().find(|r| r.record_type() == RecordType::CNAME);
        match cname {
            Some(cname) if qtype != RecordType::CNAME && qtype != RecordType::ANY => {
                answers.push(with_owner(cname, qname));
                self.follow_cname(cname, qtype, &mut answers);
            }
            _ => answers.extend(
                rrs.iter()
                    .filter(|r| qtype == RecordType::ANY || r.record_type() == qtype)
                    .map(|r| with_owner(r, qname)),
            ),
        }
        if answers.is_empty() {
            return self.negative(zone, ResponseCode::NoError);
        }
        let additionals = self.srv_additionals(&answers);
        Lookup {
            rcode: ResponseCode::NoError,
            authoritative: true,
            answers,
            authorities: Vec::new(),
            additionals,
        }
    }

    fn follow_cname(&self, first: &Record, qtype: RecordType, answers: &mut Vec<Record>) {
        let mut current = first.clone();
        for _ in 0..MAX_CNAME_CHAIN {
            let RData::CNAME(CNAME(target)) = &current.data else {
                return;
            };
            let Some(rrs) = self.nodes.get(&LowerName::from(target)) else {
                return;
            };
            if let Some(next) = rrs.iter().find(|r| r.record_type() == RecordType::CNAME) {
                answers.push(next.clone());
                current = next.clone();
            } else {
                answers.extend(rrs.iter().filter(|r| r.record_type() == qtype).cloned());
                return;
            }
        }
    }

    fn srv_additionals(&self, answers: &[Record]) -> Vec<Record> {
        let targets: BTreeSet<LowerName> = answers
            .iter()
            .filter_map(|r| match &r.data {
                RData::SRV(srv) => Some(LowerName::from(&srv.target)),
                _ => None,
            })
            .collect();
        targets
            .iter()
            .filter_map(|t| self.nodes.get(t))
            .flatten()
            .filter(|r| matches!(r.record_type(), RecordType::A | RecordType::AAAA))
            .cloned()
            .collect()
    }

    /// `<a>-<b>-<c>-<d>.<ns>.pod.<zone>` (and `<ns>.pod.<zone>`, an empty non-terminal):
    /// None if `qname` is not under `pod.<zone>`; Some(Err(rcode)) for a negative answer.
    fn pod_lookup(&self, qname: &Name, qtype: RecordType) -> Option<Result<Lookup, ResponseCode>> {
        let zone_labels = self.domain.num_labels();
        let labels: Vec<String> = qname
            .iter()
            .map(|l| String::from_utf8_lossy(l).to_ascii_lowercase())
            .collect();
        let depth = labels.len().checked_sub(usize::from(zone_labels))?;
        if depth < 2 || labels[depth - 1] != "pod" {
            return None;
        }
        match depth {
            2 => Some(Err(ResponseCode::NoError)),
            3 => {
                let Ok(ip) = labels[0].replace('-', ".").parse::<Ipv4Addr>() else {
                    return Some(Err(ResponseCode::NXDomain));
                };
                if qtype != RecordType::A && qtype != RecordType::ANY {
                    return Some(Err(ResponseCode::NoError));
                }
                Some(Ok(Lookup {
                    rcode: ResponseCode::NoError,
                    authoritative: true,
                    answers: vec![Record::from_rdata(qname.clone(), self.ttl, RData::A(A(ip)))],
                    authorities: Vec::new(),
                    additionals: Vec::new(),
                }))
            }
            _ => Some(Err(ResponseCode::NXDomain)),
        }
    }
}

fn srv_owner(base: &Name, port: &str, proto: &str) -> Option<Name> {
    let proto_node = child(base, &format!("_{proto}"))?;
    child(&proto_node, &format!("_{}", port.to_ascii_lowercase()))
}

fn with_owner(record: &Record, owner: &Name) -> Record {
    let mut r = record.clone();
    r.name = owner.clone();
    r
}

// --- the hickory request handler --------------------------------------------------

/// The records the server answers from; None until the first list arrived (then every
/// question gets SERVFAIL, so a resolver retries rather than caching NXDOMAIN).
#[derive(Debug, Clone, Default)]
pub struct SharedRecords(Arc<RwLock<Option<Arc<ClusterRecords>>>>);

impl SharedRecords {
    pub fn get(&self) -> Option<Arc<ClusterRecords>> {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub fn set(&self, records: ClusterRecords) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = Some(Arc::new(records));
    }
}

struct Handler {
    records: SharedRecords,
}

fn response_info(metadata: Metadata) -> ResponseInfo {
    ResponseInfo::from(Header {
        metadata,
        counts: HeaderCounts::default(),
    })
}

#[async_trait::async_trait]
impl RequestHandler for Handler {
    async fn handle_request<R: ResponseHandler, T: Time>(
        &self,
        request: &Request,
        mut response_handle: R,
    ) -> ResponseInfo {
        // RFC 6891: answer EDNS with EDNS; the client's buffer size bounds UDP answers.
        let response_edns = request.edns.as_ref().map(|req| {
            let mut e = Edns::new();
            e.set_max_payload(req.max_payload().max(512));
            e.set_version(0);
            e
        });
        let mut metadata = Metadata::response_from_request(&request.metadata);
        let builder = MessageResponseBuilder::new(&request.queries, response_edns.as_ref());
        let lookup = if request.metadata.message_type != MessageType::Query
            || request.metadata.op_code != OpCode::Query
        {
            Err(ResponseCode::NotImp)
        } else {
            match (request.request_info(), self.records.get()) {
                (Err(_), _) => Err(ResponseCode::FormErr),
                (Ok(_), None) => Err(ResponseCode::ServFail),
                (Ok(info), Some(records)) => {
                    let q = info.query.original();
                    Ok(records.lookup(q.name(), q.query_class(), q.query_type()))
                }
            }
        };
        let result = match &lookup {
            Err(rcode) => {
                metadata.response_code = *rcode;
                response_handle
                    .send_response(builder.build(
                        metadata,
                        iter::empty(),
                        iter::empty(),
                        iter::empty(),
                        iter::empty(),
                    ))
                    .await
            }
            Ok(l) => {
                metadata.response_code = l.rcode;
                metadata.authoritative = l.authoritative;
                response_handle
                    .send_response(builder.build(
                        metadata,
                        l.answers.iter(),
                        l.authorities.iter(),
                        iter::empty(),
                        l.additionals.iter(),
                    ))
                    .await
            }
        };
        match result {
            Ok(info) => info,
            Err(e) => {
                tracing::warn!(src = %request.src(), error = %e, "cluster DNS: cannot send answer");
                metadata.response_code = ResponseCode::ServFail;
                response_info(metadata)
            }
        }
    }
}

/// Serves `records` on `udp` and `tcp` until `shutdown` resolves.
async fn serve(
    udp: tokio::net::UdpSocket,
    tcp: tokio::net::TcpListener,
    records: SharedRecords,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let mut server = hickory_server::Server::new(Handler { records });
    server.register_socket(udp);
    server.register_listener(tcp, TCP_IDLE_TIMEOUT, TCP_RESPONSE_BUFFER);
    shutdown.await;
    if let Err(e) = server.shutdown_gracefully().await {
        tracing::warn!(error = %e, "cluster DNS: listener ended with an error");
    }
}

// --- the server shell: thread, watch, sockets -------------------------------------

/// The DNS Service the server registers for itself on start and removes on stop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsServiceRegistration {
    /// ClusterIP of `kube-system/kube-dns`.
    pub cluster_ip: Ipv4Addr,
    /// The Endpoints address: where the server listens.
    pub endpoint: Ipv4Addr,
}

/// How a [`DnsServer`] runs.
#[derive(Debug, Clone)]
pub struct DnsServerConfig {
    /// Kubeconfig with read access to Services and Endpoints (and, with `register`,
    /// write access to them in kube-system). None: the pod's own service account
    /// (in-cluster configuration: `KUBERNETES_SERVICE_HOST` and the mounted token),
    /// as the DNS pod on real nodes runs it.
    pub kubeconfig: Option<PathBuf>,
    /// Netns of the sockets; None: the calling thread's.
    pub netns: Option<Netns>,
    /// UDP and TCP address.
    pub listen: SocketAddrV4,
    pub zone: ZoneConfig,
    pub register: Option<DnsServiceRegistration>,
    /// Wait after a change before rebuilding the records.
    pub debounce: Duration,
    /// Bound for the initial list of Services and Endpoints.
    pub sync_timeout: Duration,
}

impl DnsServerConfig {
    /// `listen` on port 53 of `ip` in `netns`, default zone, no registration, 100 ms
    /// debounce, 30 s sync bound.
    pub fn new(kubeconfig: impl Into<PathBuf>, netns: Option<Netns>, ip: Ipv4Addr) -> Self {
        DnsServerConfig {
            kubeconfig: Some(kubeconfig.into()),
            netns,
            listen: SocketAddrV4::new(ip, 53),
            zone: ZoneConfig::default(),
            register: None,
            debounce: super::kube_proxy::DEFAULT_DEBOUNCE,
            sync_timeout: Duration::from_secs(30),
        }
    }
}

impl DnsServerConfig {
    /// A server inside a pod: `listen` in the pod's netns, the API through the pod's
    /// service account, default zone, no registration (the cluster's kube-dns
    /// Service selects the pod).
    pub fn in_cluster(listen: SocketAddrV4) -> Self {
        DnsServerConfig {
            kubeconfig: None,
            netns: None,
            listen,
            zone: ZoneConfig::default(),
            register: None,
            debounce: super::kube_proxy::DEFAULT_DEBOUNCE,
            sync_timeout: Duration::from_secs(30),
        }
    }
}

/// The API client of the pod's service account.
fn in_cluster_client() -> Result<kube::Client, Error> {
    let config = kube::Config::incluster().map_err(|e| Error::InCluster(e.to_string()))?;
    kube::Client::try_from(config).map_err(|source| Error::Kube {
        what: "building the in-cluster API client".into(),
        source,
    })
}

/// A running DNS server thread. Dropping it stops it like [`DnsServer::stop`].
#[derive(Debug)]
pub struct DnsServer {
    listen: SocketAddrV4,
    records: SharedRecords,
    stop_tx: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl DnsServer {
    /// Binds UDP and TCP `config.listen` inside `config.netns`, starts the server
    /// thread, registers the DNS Service if asked, and returns once the first records
    /// are served (bounded by `sync_timeout`).
    pub fn start(config: DnsServerConfig) -> Result<DnsServer, Error> {
        // Fail early on a bad domain, before any thread or socket exists.
        ClusterRecords::build(&Snapshot::default(), &config.zone, 0)?;
        let listen = config.listen;
        let netns_name = config
            .netns
            .as_ref()
            .map_or_else(|| "(current)".to_owned(), |n| n.name().to_owned());
        let bind = move || -> Result<(std::net::UdpSocket, std::net::TcpListener), Error> {
            let err = |source| Error::Bind {
                addr: SocketAddr::V4(listen),
                netns: netns_name.clone(),
                source,
            };
            let udp = std::net::UdpSocket::bind(listen).map_err(err)?;
            let tcp = std::net::TcpListener::bind(listen).map_err(err)?;
            udp.set_nonblocking(true).map_err(err)?;
            tcp.set_nonblocking(true).map_err(err)?;
            Ok((udp, tcp))
        };
        let (udp, tcp) = match &config.netns {
            Some(netns) => netns.run(bind)??,
            None => bind()?,
        };
        let records = SharedRecords::default();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), Error>>();
        let (stop_tx, stop_rx) = oneshot::channel();
        let thread_records = records.clone();
        let thread = std::thread::Builder::new()
            .name(format!("cluster-dns-{listen}"))
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(Error::Thread(e)));
                        return;
                    }
                };
                runtime.block_on(run(config, udp, tcp, thread_records, ready_tx, stop_rx));
            })
            .map_err(Error::Thread)?;
        let mut server = DnsServer {
            listen,
            records,
            stop_tx: Some(stop_tx),
            thread: Some(thread),
        };
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(server),
            Ok(Err(e)) => {
                server.shutdown();
                Err(e)
            }
            Err(_) => {
                server.shutdown();
                Err(Error::Stopped("exited before serving".into()))
            }
        }
    }

    /// Where it listens (UDP and TCP).
    pub fn listen(&self) -> SocketAddrV4 {
        self.listen
    }

    /// The records served now.
    pub fn records(&self) -> Option<Arc<ClusterRecords>> {
        self.records.get()
    }

    /// Stops the thread (after removing the DNS Service it registered).
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(tx) = self.stop_tx.take() {
            let _ = tx.send(());
        }
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("cluster DNS: server thread panicked");
        }
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

async fn run(
    config: DnsServerConfig,
    udp: std::net::UdpSocket,
    tcp: std::net::TcpListener,
    records: SharedRecords,
    ready_tx: std::sync::mpsc::Sender<Result<(), Error>>,
    stop_rx: oneshot::Receiver<()>,
) {
    let sockets = tokio::net::UdpSocket::from_std(udp)
        .and_then(|u| Ok((u, tokio::net::TcpListener::from_std(tcp)?)));
    let (udp, tcp) = match sockets {
        Ok(s) => s,
        Err(source) => {
            let _ = ready_tx.send(Err(Error::Bind {
                addr: SocketAddr::V4(config.listen),
                netns: "(runtime)".into(),
                source,
            }));
            return;
        }
    };
    let client = match &config.kubeconfig {
        Some(path) => super::client_from_kubeconfig(path)
            .await
            .map_err(Error::from),
        None => in_cluster_client(),
    };
    let client = match client {
        Ok(c) => c,
        Err(e) => {
            let _ = ready_tx.send(Err(e));
            return;
        }
    };
    let mut watch = ServiceWatch::spawn(client.clone());
    if !watch.wait_synced(config.sync_timeout).await {
        let _ = ready_tx.send(Err(Error::NotSynced {
            after: config.sync_timeout,
        }));
        return;
    }
    let mut serial: u32 = 1;
    match ClusterRecords::build(&watch.snapshot(), &config.zone, serial) {
        Ok(r) => records.set(r),
        Err(e) => {
            let _ = ready_tx.send(Err(e));
            return;
        }
    }
    let (shutdown_tx, shutdown_rx) = oneshot::channel::<()>();
    let server = tokio::spawn(serve(udp, tcp, records.clone(), async move {
        let _ = shutdown_rx.await;
    }));
    if let Some(reg) = &config.register
        && let Err(e) = register(&client, reg).await
    {
        let _ = shutdown_tx.send(());
        let _ = server.await;
        let _ = ready_tx.send(Err(e));
        return;
    }
    let _ = ready_tx.send(Ok(()));
    tracing::info!(listen = %config.listen, "cluster DNS serving");
    tokio::pin!(stop_rx);
    loop {
        tokio::select! {
            _ = &mut stop_rx => break,
            alive = watch.changed(config.debounce) => {
                if !alive {
                    tracing::error!("cluster DNS: watch ended; serving the last records");
                    let _ = (&mut stop_rx).await;
                    break;
                }
                serial = serial.wrapping_add(1);
                let started = Instant::now();
                match ClusterRecords::build(&watch.snapshot(), &config.zone, serial) {
                    Ok(r) => {
                        records.set(r);
                        tracing::debug!(serial, elapsed_us = started.elapsed().as_micros(), "cluster DNS: records rebuilt");
                    }
                    Err(e) => tracing::warn!(error = %e, "cluster DNS: rebuild failed; serving the last records"),
                }
            }
        }
    }
    if let Some(reg) = &config.register {
        unregister(&client, reg).await;
    }
    let _ = shutdown_tx.send(());
    let _ = server.await;
}

fn dns_service(reg: &DnsServiceRegistration) -> Result<(Service, Endpoints), Error> {
    let ports = |with_target: bool| {
        serde_json::json!([
            if with_target {
                serde_json::json!({"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 53})
            } else {
                serde_json::json!({"name": "dns", "port": 53, "protocol": "UDP"})
            },
            if with_target {
                serde_json::json!({"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": 53})
            } else {
                serde_json::json!({"name": "dns-tcp", "port": 53, "protocol": "TCP"})
            },
        ])
    };
    let meta = serde_json::json!({
        "name": DNS_SERVICE_NAME,
        "namespace": DNS_SERVICE_NAMESPACE,
        "labels": {"k8s-app": "kube-dns", "kubernetes.io/name": "KubeDNS", "app.kubernetes.io/managed-by": "kvpn-lab"}
    });
    // No selector: the Endpoints are ours to write, pointing at the DNS pod.
    let svc = serde_json::json!({
        "metadata": meta,
        "spec": {"clusterIP": reg.cluster_ip.to_string(), "ports": ports(true)}
    });
    let ep = serde_json::json!({
        "metadata": meta,
        "subsets": [{"addresses": [{"ip": reg.endpoint.to_string()}], "ports": ports(false)}]
    });
    Ok((
        parse_object("Service", svc)?,
        parse_object("Endpoints", ep)?,
    ))
}

fn parse_object<T: serde::de::DeserializeOwned>(
    what: &str,
    v: serde_json::Value,
) -> Result<T, Error> {
    serde_json::from_value(v)
        .map_err(|e| Error::Stopped(format!("building the {what} object: {e}")))
}

/// Creates the object, or replaces the existing one of that name.
async fn create_or_replace<K>(api: &Api<K>, name: &str, mut obj: K) -> Result<(), Error>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.create(&PostParams::default(), &obj).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => {
            let current = api.get(name).await.map_err(|source| Error::Kube {
                what: format!("reading {name}"),
                source,
            })?;
            obj.meta_mut().resource_version = current.meta().resource_version.clone();
            api.replace(name, &PostParams::default(), &obj)
                .await
                .map(drop)
                .map_err(|source| Error::Kube {
                    what: format!("replacing {name}"),
                    source,
                })
        }
        Err(source) => Err(Error::Kube {
            what: format!("creating {name}"),
            source,
        }),
    }
}

async fn register(client: &kube::Client, reg: &DnsServiceRegistration) -> Result<(), Error> {
    let (svc, ep) = dns_service(reg)?;
    let services: Api<Service> = Api::namespaced(client.clone(), DNS_SERVICE_NAMESPACE);
    let endpoints: Api<Endpoints> = Api::namespaced(client.clone(), DNS_SERVICE_NAMESPACE);
    create_or_replace(&services, DNS_SERVICE_NAME, svc).await?;
    create_or_replace(&endpoints, DNS_SERVICE_NAME, ep).await
}

/// Best effort, bounded: on teardown the apiserver may already be gone.
async fn unregister(client: &kube::Client, reg: &DnsServiceRegistration) {
    let services: Api<Service> = Api::namespaced(client.clone(), DNS_SERVICE_NAMESPACE);
    let endpoints: Api<Endpoints> = Api::namespaced(client.clone(), DNS_SERVICE_NAMESPACE);
    let delete = async {
        // Deleting the Service deletes nothing else: its Endpoints are ours.
        let a = services
            .delete(DNS_SERVICE_NAME, &DeleteParams::default())
            .await;
        let b = endpoints
            .delete(DNS_SERVICE_NAME, &DeleteParams::default())
            .await;
        (a.err(), b.err())
    };
    match tokio::time::timeout(Duration::from_secs(3), delete).await {
        Ok((None, None)) => tracing::debug!(ip = %reg.cluster_ip, "cluster DNS: Service removed"),
        Ok((a, b)) => tracing::debug!(?a, ?b, "cluster DNS: Service removal incomplete"),
        Err(_) => tracing::debug!("cluster DNS: apiserver gone; Service left in place"),
    }
}

// --- deployment as a pod behind the kube-dns Service --------------------------------

/// Options of [`ClusterDns::deploy`].
#[derive(Debug, Clone)]
pub struct ClusterDnsOptions {
    /// The DNS pod's IP; None: the node's lowest free pod IP.
    pub pod_ip: Option<Ipv4Addr>,
    /// The kube-dns ClusterIP.
    pub service_ip: Ipv4Addr,
    pub zone: ZoneConfig,
    pub debounce: Duration,
    pub sync_timeout: Duration,
}

impl Default for ClusterDnsOptions {
    fn default() -> Self {
        ClusterDnsOptions {
            pod_ip: None,
            service_ip: CLUSTER_DNS_IP,
            zone: ZoneConfig::default(),
            debounce: super::kube_proxy::DEFAULT_DEBOUNCE,
            sync_timeout: Duration::from_secs(30),
        }
    }
}

/// The cluster DNS deployed like a cluster add-on: pod `kube-dns` on the node, the
/// server listening on its pod IP, the `kube-system/kube-dns` Service (ClusterIP
/// 10.96.0.10) pointing at it. Needs the kube-proxy stand-in for the ClusterIP to work.
/// Dropping it stops the server and removes the Service; the pod netns goes with
/// [`ClusterDns::stop`] or the lab's teardown.
#[derive(Debug)]
pub struct ClusterDns {
    server: Option<DnsServer>,
    pod: Pod,
    service_ip: Ipv4Addr,
}

impl ClusterDns {
    /// Creates the DNS pod on `node`, starts the server in it and registers the
    /// Service; returns once it answers from the first list of Services. On error the
    /// pod is removed again.
    pub fn deploy(
        node: &Node,
        kubeconfig: &Path,
        options: ClusterDnsOptions,
    ) -> Result<ClusterDns, Error> {
        let ip = match options.pod_ip.or_else(|| node.free_pod_ip()) {
            Some(ip) => ip,
            None => {
                return Err(Error::Lab(LabError::Invalid {
                    what: "pod IP",
                    value: node.pod_cidr().to_string(),
                    why: "the node's pod range is full",
                }));
            }
        };
        let pod = node.add_pod(DNS_POD_NAME, ip)?;
        let mut config = DnsServerConfig::new(kubeconfig, Some(pod.netns.clone()), ip);
        config.zone = options.zone;
        config.debounce = options.debounce;
        config.sync_timeout = options.sync_timeout;
        config.register = Some(DnsServiceRegistration {
            cluster_ip: options.service_ip,
            endpoint: ip,
        });
        match DnsServer::start(config) {
            Ok(server) => Ok(ClusterDns {
                server: Some(server),
                pod,
                service_ip: options.service_ip,
            }),
            Err(e) => {
                let _ = node.remove_pod(&pod);
                Err(e)
            }
        }
    }

    /// The DNS pod (its netns holds the server's sockets).
    pub fn pod(&self) -> &Pod {
        &self.pod
    }

    /// The kube-dns ClusterIP.
    pub fn service_ip(&self) -> Ipv4Addr {
        self.service_ip
    }

    /// The server's own address (the pod IP, port 53).
    pub fn pod_addr(&self) -> SocketAddrV4 {
        SocketAddrV4::new(self.pod.ip, 53)
    }

    pub fn records(&self) -> Option<Arc<ClusterRecords>> {
        self.server.as_ref().and_then(DnsServer::records)
    }

    /// Stops the server, removes the Service and the pod from `node`.
    pub fn stop(mut self, node: &Node) -> Result<(), Error> {
        if let Some(server) = self.server.take() {
            server.stop();
        }
        node.remove_pod(&self.pod)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr as _;

    use hickory_server::proto::op::{Message, Query};

    fn obj<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
        serde_json::from_value(v).expect("valid object")
    }

    fn name(s: &str) -> Name {
        Name::from_str(s).expect("name")
    }

    /// web (ClusterIP, named port), db (headless, one hostname, one not-ready address),
    /// big (headless, 300 endpoints), ext (ExternalName into the zone), out
    /// (ExternalName outside), lonely (headless without endpoints).
    fn snapshot() -> Snapshot {
        let big: Vec<serde_json::Value> = (0..300u32)
            .map(|i| serde_json::json!({"ip": format!("10.244.{}.{}", 2 + i / 250, 1 + i % 250)}))
            .collect();
        let services: Vec<Service> = vec![
            obj(
                serde_json::json!({"metadata": {"namespace": "demo", "name": "web"},
                "spec": {"clusterIP": "10.96.1.100", "ports": [
                    {"name": "http", "port": 80, "targetPort": 8080},
                    {"port": 81}]}}),
            ),
            obj(
                serde_json::json!({"metadata": {"namespace": "demo", "name": "db"},
                "spec": {"clusterIP": "None", "ports": [{"name": "pg", "port": 5432}]}}),
            ),
            obj(
                serde_json::json!({"metadata": {"namespace": "demo", "name": "big"},
                "spec": {"clusterIP": "None", "ports": [{"port": 80}]}}),
            ),
            obj(
                serde_json::json!({"metadata": {"namespace": "demo", "name": "ext"},
                "spec": {"type": "ExternalName", "externalName": "web.demo.svc.cluster.local"}}),
            ),
            obj(
                serde_json::json!({"metadata": {"namespace": "demo", "name": "out"},
                "spec": {"type": "ExternalName", "externalName": "example.org."}}),
            ),
            obj(
                serde_json::json!({"metadata": {"namespace": "other", "name": "lonely"},
                "spec": {"clusterIP": "None"}}),
            ),
        ];
        let endpoints: Vec<Endpoints> = vec![
            obj(
                serde_json::json!({"metadata": {"namespace": "demo", "name": "web"},
                "subsets": [{"addresses": [{"ip": "10.244.1.11"}], "ports": [{"name": "http", "port": 8080}]}]}),
            ),
            obj(
                serde_json::json!({"metadata": {"namespace": "demo", "name": "db"},
                "subsets": [{"addresses": [{"ip": "10.244.1.11", "hostname": "db-0"}, {"ip": "10.244.1.12"}],
                             "notReadyAddresses": [{"ip": "10.244.1.13"}],
                             "ports": [{"name": "pg", "port": 5432}]}]}),
            ),
            obj(
                serde_json::json!({"metadata": {"namespace": "demo", "name": "big"},
                "subsets": [{"addresses": big, "ports": [{"port": 80}]}]}),
            ),
            obj(
                serde_json::json!({"metadata": {"namespace": "other", "name": "lonely"},
                "subsets": [{"notReadyAddresses": [{"ip": "10.244.1.20"}]}]}),
            ),
        ];
        Snapshot::from_objects(&services, &endpoints)
    }

    fn records() -> ClusterRecords {
        ClusterRecords::build(&snapshot(), &ZoneConfig::default(), 7).expect("records")
    }

    fn ask(r: &ClusterRecords, q: &str, t: RecordType) -> Lookup {
        r.lookup(&name(q), DNSClass::IN, t)
    }

    fn data(l: &Lookup) -> Vec<String> {
        let mut v: Vec<String> = l.answers.iter().map(|r| r.data.to_string()).collect();
        v.sort();
        v
    }

    fn assert_negative(l: &Lookup, rcode: ResponseCode, apex: &str) {
        assert_eq!(l.rcode, rcode, "{l:?}");
        assert!(l.authoritative);
        assert!(l.answers.is_empty(), "{l:?}");
        assert_eq!(l.authorities.len(), 1, "{l:?}");
        assert_eq!(l.authorities[0].record_type(), RecordType::SOA);
        assert_eq!(l.authorities[0].name, name(apex));
        assert_eq!(l.authorities[0].ttl, DNS_TTL);
    }

    #[test]
    fn cluster_ip_service_a_srv_ptr() {
        let r = records();
        let a = ask(&r, "web.demo.svc.cluster.local.", RecordType::A);
        assert_eq!(a.rcode, ResponseCode::NoError);
        assert!(a.authoritative);
        assert_eq!(data(&a), vec!["10.96.1.100"]);
        assert_eq!(a.answers[0].ttl, 5);
        let srv = ask(
            &r,
            "_http._tcp.web.demo.svc.cluster.local.",
            RecordType::SRV,
        );
        assert_eq!(data(&srv), vec!["0 100 80 web.demo.svc.cluster.local."]);
        assert_eq!(
            data(&Lookup {
                answers: srv.additionals.clone(),
                ..srv.clone()
            }),
            vec!["10.96.1.100"]
        );
        // The unnamed port has no SRV record; `_tcp` exists only as a parent.
        assert_negative(
            &ask(&r, "_81._tcp.web.demo.svc.cluster.local.", RecordType::SRV),
            ResponseCode::NXDomain,
            "cluster.local.",
        );
        assert_negative(
            &ask(&r, "_tcp.web.demo.svc.cluster.local.", RecordType::SRV),
            ResponseCode::NoError,
            "cluster.local.",
        );
        let ptr = ask(&r, "100.1.96.10.in-addr.arpa.", RecordType::PTR);
        assert_eq!(data(&ptr), vec!["web.demo.svc.cluster.local."]);
    }

    #[test]
    fn aaaa_of_an_ipv4_service_is_nodata_with_soa() {
        let r = records();
        assert_negative(
            &ask(&r, "web.demo.svc.cluster.local.", RecordType::AAAA),
            ResponseCode::NoError,
            "cluster.local.",
        );
    }

    #[test]
    fn unknown_names_are_nxdomain_and_parents_are_nodata() {
        let r = records();
        for q in [
            "nope.demo.svc.cluster.local.",
            "web.nope.svc.cluster.local.",
            "x.cluster.local.",
        ] {
            assert_negative(
                &ask(&r, q, RecordType::A),
                ResponseCode::NXDomain,
                "cluster.local.",
            );
        }
        for q in [
            "demo.svc.cluster.local.",
            "svc.cluster.local.",
            "pod.cluster.local.",
        ] {
            assert_negative(
                &ask(&r, q, RecordType::A),
                ResponseCode::NoError,
                "cluster.local.",
            );
        }
        assert_negative(
            &ask(&r, "9.9.96.10.in-addr.arpa.", RecordType::PTR),
            ResponseCode::NXDomain,
            "10.in-addr.arpa.",
        );
        assert_negative(
            &ask(&r, "96.10.in-addr.arpa.", RecordType::PTR),
            ResponseCode::NoError,
            "10.in-addr.arpa.",
        );
    }

    #[test]
    fn outside_the_zone_is_refused() {
        let r = records();
        for q in [
            "example.com.",
            "local.",
            "8.8.8.8.in-addr.arpa.",
            "web.demo.",
        ] {
            let l = ask(&r, q, RecordType::A);
            assert_eq!(l.rcode, ResponseCode::Refused, "{q}");
            assert!(!l.authoritative && l.answers.is_empty() && l.authorities.is_empty());
        }
        let chaos = r.lookup(
            &name("web.demo.svc.cluster.local."),
            DNSClass::CH,
            RecordType::A,
        );
        assert_eq!(chaos.rcode, ResponseCode::Refused);
    }

    #[test]
    fn headless_service_answers_per_ready_endpoint() {
        let r = records();
        let a = ask(&r, "db.demo.svc.cluster.local.", RecordType::A);
        assert_eq!(
            data(&a),
            vec!["10.244.1.11", "10.244.1.12"],
            "not-ready 10.244.1.13 left out"
        );
        assert_eq!(
            data(&ask(&r, "db-0.db.demo.svc.cluster.local.", RecordType::A)),
            vec!["10.244.1.11"]
        );
        assert_eq!(
            data(&ask(
                &r,
                "10-244-1-12.db.demo.svc.cluster.local.",
                RecordType::A
            )),
            vec!["10.244.1.12"]
        );
        let srv = ask(&r, "_pg._tcp.db.demo.svc.cluster.local.", RecordType::SRV);
        assert_eq!(
            data(&srv),
            vec![
                "0 100 5432 10-244-1-12.db.demo.svc.cluster.local.",
                "0 100 5432 db-0.db.demo.svc.cluster.local."
            ]
        );
        assert_eq!(srv.additionals.len(), 2, "{srv:?}");
        assert_eq!(
            data(&ask(&r, "11.1.244.10.in-addr.arpa.", RecordType::PTR)),
            vec!["db-0.db.demo.svc.cluster.local."]
        );
        assert_eq!(
            ask(&r, "big.demo.svc.cluster.local.", RecordType::A)
                .answers
                .len(),
            300
        );
        // No ready endpoints: NXDOMAIN (spec 2.4.1).
        assert_negative(
            &ask(&r, "lonely.other.svc.cluster.local.", RecordType::A),
            ResponseCode::NXDomain,
            "cluster.local.",
        );
    }

    #[test]
    fn external_names_are_cnames_followed_inside_the_zone() {
        let r = records();
        let a = ask(&r, "ext.demo.svc.cluster.local.", RecordType::A);
        assert_eq!(a.rcode, ResponseCode::NoError);
        assert_eq!(
            a.answers
                .iter()
                .map(|x| x.data.to_string())
                .collect::<Vec<_>>(),
            vec!["web.demo.svc.cluster.local.", "10.96.1.100"]
        );
        let out = ask(&r, "out.demo.svc.cluster.local.", RecordType::A);
        assert_eq!(data(&out), vec!["example.org."]);
    }

    #[test]
    fn case_insensitive_and_spelling_kept() {
        let r = records();
        let a = ask(&r, "WeB.DEMO.svc.Cluster.Local.", RecordType::A);
        assert_eq!(data(&a), vec!["10.96.1.100"]);
        assert!(
            a.answers[0]
                .name
                .eq_case(&name("WeB.DEMO.svc.Cluster.Local."))
        );
    }

    #[test]
    fn version_apex_and_pods() {
        let r = records();
        assert_eq!(
            data(&ask(&r, "dns-version.cluster.local.", RecordType::TXT)),
            vec!["1.0.1"]
        );
        let soa = ask(&r, "cluster.local.", RecordType::SOA);
        assert_eq!(soa.answers.len(), 1);
        assert!(
            soa.answers[0].data.to_string().contains(" 7 "),
            "serial 7: {soa:?}"
        );
        assert_eq!(
            data(&ask(&r, "cluster.local.", RecordType::NS)),
            vec!["ns.dns.cluster.local."]
        );
        assert_eq!(
            data(&ask(&r, "ns.dns.cluster.local.", RecordType::A)),
            vec!["10.96.0.10"]
        );
        assert_eq!(
            data(&ask(
                &r,
                "10-244-1-11.demo.pod.cluster.local.",
                RecordType::A
            )),
            vec!["10.244.1.11"]
        );
        assert_negative(
            &ask(&r, "not-an-ip.demo.pod.cluster.local.", RecordType::A),
            ResponseCode::NXDomain,
            "cluster.local.",
        );
        assert_negative(
            &ask(&r, "demo.pod.cluster.local.", RecordType::A),
            ResponseCode::NoError,
            "cluster.local.",
        );
    }

    #[test]
    fn reverse_zones_round_out_to_octets() {
        let cfg = ZoneConfig {
            reverse_cidrs: vec![
                "10.96.0.0/12".parse().expect("cidr"),
                "10.244.0.0/16".parse().expect("cidr"),
                "192.168.7.0/24".parse().expect("cidr"),
            ],
            ..ZoneConfig::default()
        };
        let r = ClusterRecords::build(&Snapshot::default(), &cfg, 1).expect("records");
        let apexes: Vec<String> = r.zones.iter().map(|z| z.apex.to_string()).collect();
        assert_eq!(
            apexes,
            vec![
                "7.168.192.in-addr.arpa.",
                "10.in-addr.arpa.",
                "cluster.local."
            ],
            "10.244/16 is inside 10/8; longest apex first"
        );
        assert_eq!(
            resolv_conf("demo"),
            "nameserver 10.96.0.10\nsearch demo.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5\n"
        );
    }

    // --- the handler over real loopback sockets (no root, no apiserver) -------------

    async fn query(
        server: SocketAddr,
        q: &str,
        t: RecordType,
        tcp: bool,
        edns: Option<u16>,
    ) -> Message {
        let mut msg = Message::query();
        msg.metadata.id = 4242;
        msg.metadata.recursion_desired = true;
        msg.add_query(Query::query(name(q), t));
        if let Some(size) = edns {
            let mut e = Edns::new();
            e.set_max_payload(size);
            msg.set_edns(e);
        }
        let bytes = msg.to_vec().expect("encode query");
        let answer = if tcp {
            use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
            let mut s = tokio::net::TcpStream::connect(server)
                .await
                .expect("tcp connect");
            let len = u16::try_from(bytes.len()).expect("small query");
            s.write_all(&len.to_be_bytes()).await.expect("write");
            s.write_all(&bytes).await.expect("write");
            let mut len = [0u8; 2];
            s.read_exact(&mut len).await.expect("read length");
            let mut buf = vec![0u8; usize::from(u16::from_be_bytes(len))];
            s.read_exact(&mut buf).await.expect("read answer");
            buf
        } else {
            let s = tokio::net::UdpSocket::bind("127.0.0.1:0")
                .await
                .expect("bind");
            s.send_to(&bytes, server).await.expect("send");
            let mut buf = vec![0u8; 65535];
            let (n, _) = tokio::time::timeout(Duration::from_secs(5), s.recv_from(&mut buf))
                .await
                .expect("answer within 5 s")
                .expect("recv");
            buf.truncate(n);
            buf
        };
        let m = Message::from_vec(&answer).expect("decode answer");
        assert_eq!(m.metadata.id, 4242);
        m
    }

    #[tokio::test]
    async fn serves_over_udp_with_truncation_and_whole_over_tcp() {
        let udp = tokio::net::UdpSocket::bind("127.0.0.1:0")
            .await
            .expect("udp");
        let addr = udp.local_addr().expect("addr");
        let tcp = tokio::net::TcpListener::bind(addr)
            .await
            .expect("tcp on the same port");
        let shared = SharedRecords::default();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let server = tokio::spawn(serve(udp, tcp, shared.clone(), async move {
            let _ = stop_rx.await;
        }));
        // Before the first list: SERVFAIL, never a negative answer.
        let m = query(
            addr,
            "web.demo.svc.cluster.local.",
            RecordType::A,
            false,
            None,
        )
        .await;
        assert_eq!(m.metadata.response_code, ResponseCode::ServFail);
        shared.set(records());

        let m = query(
            addr,
            "web.demo.svc.cluster.local.",
            RecordType::A,
            false,
            Some(1232),
        )
        .await;
        assert_eq!(m.metadata.response_code, ResponseCode::NoError);
        assert!(m.metadata.authoritative && !m.metadata.truncation);
        assert_eq!(m.answers.len(), 1);
        assert!(m.edns.is_some(), "EDNS answered with EDNS");

        let m = query(
            addr,
            "nope.demo.svc.cluster.local.",
            RecordType::A,
            false,
            None,
        )
        .await;
        assert_eq!(m.metadata.response_code, ResponseCode::NXDomain);
        assert_eq!(m.authorities.len(), 1);
        assert!(m.edns.is_none());

        let m = query(addr, "example.com.", RecordType::A, false, None).await;
        assert_eq!(m.metadata.response_code, ResponseCode::Refused);

        // dns-08: 300 endpoints do not fit 1232 bytes (nor 512): TC over UDP ...
        for edns in [None, Some(1232)] {
            let m = query(
                addr,
                "big.demo.svc.cluster.local.",
                RecordType::A,
                false,
                edns,
            )
            .await;
            assert!(m.metadata.truncation, "TC with edns {edns:?}");
            assert!(m.answers.len() < 300);
        }
        // ... and all of them over TCP.
        let m = query(
            addr,
            "big.demo.svc.cluster.local.",
            RecordType::A,
            true,
            None,
        )
        .await;
        assert!(!m.metadata.truncation);
        assert_eq!(m.answers.len(), 300);
        let distinct: BTreeSet<String> = m.answers.iter().map(|r| r.data.to_string()).collect();
        assert_eq!(distinct.len(), 300);

        let _ = stop_tx.send(());
        server.await.expect("server task");
    }
}
