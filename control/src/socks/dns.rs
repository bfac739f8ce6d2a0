//! Name resolution for SOCKS requests with domain-name addresses (what
//! `curl --socks5-hostname` sends): the names are resolved the way a pod of the
//! connected namespace resolves them, by the cluster DNS (the kube-dns
//! ClusterIP) over the tunnel, with the pod's search list and `ndots:5`. So
//! `web`, `web.default` and `web.default.svc.cluster.local` all work, and a
//! name the cluster DNS does not know (or forwards upstream and gets no
//! answer for) fails with SOCKS reply "host unreachable". Names are never
//! resolved by the laptop's own resolver: in SOCKS mode the proxy stands
//! where a pod stands.
//!
//! Pure part: [`candidates`] (search-list expansion). I/O: one UDP socket on
//! the laptop-side [`Stack`] per query.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use hickory_proto::op::{Message, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, RecordType};

use super::stack::Stack;

/// Dots a name needs to be tried as-is before the search list (Kubernetes pods'
/// resolv.conf default).
pub const NDOTS: usize = 5;

/// How long one query waits for its answer before it is sent again; two tries.
const QUERY_TIMEOUT: Duration = Duration::from_secs(2);
const TRIES: usize = 2;

/// The cluster DNS as the session learnt it at connect.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ClusterDnsConfig {
    /// Nameserver IPs (kube-dns ClusterIPs).
    pub servers: Vec<IpAddr>,
    /// Search list, connected namespace first.
    pub search: Vec<String>,
}

/// Why a name did not resolve.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The session has no cluster DNS (no kube-dns Service at connect).
    #[error(
        "cannot resolve {0:?}: this session has no cluster DNS (Service kube-system/kube-dns was missing at connect) — use an IP address"
    )]
    NoServer(String),
    /// Not a valid DNS name.
    #[error("{0:?} is not a valid DNS name")]
    BadName(String),
    /// The cluster DNS says the name does not exist (after the search list).
    #[error("the cluster DNS does not know {name:?} (tried {tried})")]
    NotFound {
        /// As asked.
        name: String,
        /// The names tried, comma-separated.
        tried: String,
    },
    /// No answer from the cluster DNS.
    #[error("no answer from the cluster DNS {server} for {name:?} within {} s", QUERY_TIMEOUT.as_secs() * TRIES as u64)]
    Timeout {
        /// As asked.
        name: String,
        /// The server.
        server: SocketAddr,
    },
    /// The stack could not send the query.
    #[error("cannot ask the cluster DNS for {name:?}: {cause}")]
    Io {
        /// As asked.
        name: String,
        /// What failed.
        cause: std::io::Error,
    },
}

/// The names to ask for, in order, for `name` (resolv.conf(5) semantics):
/// an absolute name (trailing dot) as-is only; a name with at least `ndots`
/// dots as-is first, then with each search domain; else each search domain
/// first, then as-is. All returned names end with a dot.
pub fn candidates(name: &str, search: &[String], ndots: usize) -> Vec<String> {
    if let Some(abs) = name.strip_suffix('.') {
        return vec![format!("{abs}.")];
    }
    let as_is = format!("{name}.");
    let searched = search
        .iter()
        .map(|d| format!("{name}.{}.", d.trim_end_matches('.')));
    if name.matches('.').count() >= ndots {
        std::iter::once(as_is).chain(searched).collect()
    } else {
        searched.chain(std::iter::once(as_is)).collect()
    }
}

/// Resolves names through the cluster DNS over the tunnel.
#[derive(Debug, Clone)]
pub struct Resolver {
    stack: Arc<Stack>,
    config: ClusterDnsConfig,
}

impl Resolver {
    /// A resolver asking `config`'s servers over `stack`.
    pub fn new(stack: Arc<Stack>, config: ClusterDnsConfig) -> Self {
        Self { stack, config }
    }

    /// The IPv4 address of `name` (an IP literal is returned as it is).
    pub async fn resolve(&self, name: &str) -> Result<IpAddr, ResolveError> {
        if let Ok(ip) = name.parse::<IpAddr>() {
            return Ok(ip);
        }
        let Some(server) = self.config.servers.first() else {
            return Err(ResolveError::NoServer(name.to_owned()));
        };
        let server = SocketAddr::new(*server, 53);
        let tried = candidates(name, &self.config.search, NDOTS);
        for candidate in &tried {
            let fqdn =
                Name::from_ascii(candidate).map_err(|_| ResolveError::BadName(name.to_owned()))?;
            if let Some(ip) = self.query_a(server, fqdn, name).await? {
                tracing::debug!(%name, %candidate, %ip, "resolved through the cluster DNS");
                return Ok(ip);
            }
        }
        Err(ResolveError::NotFound {
            name: name.to_owned(),
            tried: tried.join(", "),
        })
    }

    /// One A query; `Ok(None)` = the name has no A record (NXDOMAIN or empty).
    async fn query_a(
        &self,
        server: SocketAddr,
        fqdn: Name,
        asked: &str,
    ) -> Result<Option<IpAddr>, ResolveError> {
        let io = |cause| ResolveError::Io {
            name: asked.to_owned(),
            cause,
        };
        let mut query = Message::query();
        query.metadata.recursion_desired = true;
        query.metadata.id = rand::random();
        query.add_query(Query::query(fqdn, RecordType::A));
        let raw = query
            .to_vec()
            .map_err(|e| io(std::io::Error::other(e.to_string())))?;
        let socket = self.stack.udp_bind().map_err(io)?;
        let mut buf = vec![0u8; 4096];
        for _ in 0..TRIES {
            socket.send_to(&raw, server).await.map_err(io)?;
            let deadline = tokio::time::Instant::now() + QUERY_TIMEOUT;
            loop {
                let got = tokio::time::timeout_at(deadline, socket.recv_from(&mut buf)).await;
                let Ok(got) = got else { break };
                let (n, from) = got.map_err(io)?;
                let Ok(answer) = Message::from_vec(&buf[..n]) else {
                    continue;
                };
                if from != server || answer.metadata.id != query.metadata.id {
                    continue;
                }
                if answer.metadata.response_code != ResponseCode::NoError {
                    return Ok(None);
                }
                return Ok(answer.answers.iter().find_map(|r| match &r.data {
                    RData::A(a) => Some(IpAddr::V4(a.0)),
                    _ => None,
                }));
            }
        }
        Err(ResolveError::Timeout {
            name: asked.to_owned(),
            server,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn search() -> Vec<String> {
        [
            "default.svc.cluster.local",
            "svc.cluster.local",
            "cluster.local",
        ]
        .map(String::from)
        .to_vec()
    }

    #[test]
    fn short_names_try_the_search_list_first() {
        assert_eq!(
            candidates("web.default", &search(), NDOTS),
            [
                "web.default.default.svc.cluster.local.",
                "web.default.svc.cluster.local.",
                "web.default.cluster.local.",
                "web.default.",
            ]
        );
    }

    #[test]
    fn absolute_names_are_asked_as_they_are() {
        assert_eq!(
            candidates("web.default.svc.cluster.local.", &search(), NDOTS),
            ["web.default.svc.cluster.local."]
        );
    }

    #[test]
    fn names_with_ndots_dots_go_as_is_first() {
        let c = candidates("a.b.c.d.e.f", &search(), NDOTS);
        assert_eq!(c[0], "a.b.c.d.e.f.");
        assert_eq!(c.len(), 4);
    }
}
