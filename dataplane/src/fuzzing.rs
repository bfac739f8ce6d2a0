//! Entry points of the cargo-fuzz targets (fuzz/) for the laptop's DNS
//! forwarder ([`crate::dns`]): queries from the laptop's applications, the
//! answers of the cluster DNS and the upstream nameservers, and the cluster
//! DNS settings the traffic manager sends. The forwarder's socket shell is
//! left out; these functions take the same decisions and build the same
//! messages it does, with fixed clusters. The corpus replay test in
//! `kvpn-tests` calls the same functions. Each panics only on a bug.

use std::time::{Duration, Instant};

use hickory_proto::op::{Message, Query, ResponseCode};
use hickory_proto::rr::{Name, RecordType};
use kvpn_proto::fuzzing::chunks;

use crate::dns::message::{self, Reject};
use crate::dns::names::{self, ClusterDns, Plan};

/// The two clusters every DNS target classifies against: the lab's (IPv4
/// only, connected namespace `dev`, reverse zones of its pod and service
/// CIDRs) and a dual-stack one with another domain and the default search
/// list.
fn clusters() -> Vec<ClusterDns> {
    let search = [
        "dev.svc.cluster.local",
        "svc.cluster.local",
        "cluster.local",
    ]
    .map(String::from);
    let mut out = Vec::new();
    if let Ok(c) = ClusterDns::new(&["10.96.0.10".into()], "cluster.local", &search, false) {
        let cidrs = ["10.244.0.0/16", "10.96.0.0/12"]
            .iter()
            .filter_map(|s| s.parse().ok());
        out.push(c.with_reverse(cidrs));
    }
    if let Ok(c) = ClusterDns::new(&["[fd00::a]:53".into()], "k8s.example", &[], true) {
        out.push(c);
    }
    assert_eq!(out.len(), 2, "the fixed cluster DNS settings do not parse");
    out
}

/// Encode as the forwarder does and check the size bound it promises.
fn encode(msg: &Message, limit: Option<usize>) {
    if let Ok((bytes, truncated)) = message::encode_fitting(msg, limit)
        && let Some(limit) = limit
    {
        assert!(
            truncated || bytes.len() <= limit,
            "{} bytes over the UDP limit {limit} without TC",
            bytes.len()
        );
    }
}

/// Every answer the forwarder can build for `query` without asking anyone,
/// and the queries it would send to the cluster DNS for `plan`.
fn local_paths(query: &Message, question: &Query, plan: &Plan) {
    let limit = Some(message::udp_limit(query));
    for rcode in [
        ResponseCode::NoError,
        ResponseCode::NXDomain,
        ResponseCode::ServFail,
    ] {
        encode(&message::local_answer(query, rcode), limit);
    }
    encode(
        &message::servfail_with_ede(query, message::EDE_NO_REACHABLE_AUTHORITY, "unreachable"),
        limit,
    );
    encode(&message::truncated_for(query), limit);
    if let Plan::Search { candidates, .. } = plan {
        for c in candidates {
            let ours = message::cluster_query(query, &c.name, question.query_type());
            let _ = ours.to_vec();
            if let Some(anchor) = &c.anchor {
                let _ = message::existence_query(anchor).to_vec();
            }
        }
    }
}

/// One query from a laptop application (raw bytes, as the forwarder reads
/// them over UDP or TCP): decoded, classified against the clusters (also as
/// while the session is down), and every locally built answer encoded.
pub fn dns_query(data: &[u8]) {
    let _ = message::message_id(data);
    let query = match message::decode_query(data) {
        Ok(q) => q,
        Err(Reject::Drop) => return,
        Err(Reject::Respond(bytes)) => {
            assert!(
                bytes.len() <= 65_535,
                "error answer of {} bytes",
                bytes.len()
            );
            return;
        }
    };
    let Some(question) = query.queries.first().cloned() else {
        return;
    };
    let _ = names::reverse_ip(question.name());
    let clusters = clusters();
    for c in &clusters {
        let plan = names::classify(&question, c);
        local_paths(&query, &question, &plan);
        let down = names::while_unreachable(plan.clone(), c, |_| Some(true));
        let _ = names::while_unreachable(plan, c, |_| None);
        local_paths(&query, &question, &down);
    }
    if let Some((plan, _)) = names::classify_all(&question, clusters.iter()) {
        local_paths(&query, &question, &plan);
    }
}

/// The answer path ([`chunks`] shape): the first chunk is the laptop's query,
/// every further chunk an answer from a DNS server (the cluster DNS to one of
/// our expansion or existence queries, or an upstream nameserver to a relayed
/// query), handled as the forwarder handles each.
pub fn dns_answer(data: &[u8]) {
    let parts = chunks(data);
    let Some((first, answers)) = parts.split_first() else {
        return;
    };
    let Ok(query) = message::decode_query(first) else {
        return;
    };
    let Some(question) = query.queries.first().cloned() else {
        return;
    };
    let limit = message::udp_limit(&query);
    let id = message::message_id(first);
    let clusters = clusters();
    let expanded = match names::classify_all(&question, clusters.iter()) {
        Some((Plan::Search { candidates, .. }, _)) => candidates
            .first()
            .map(|c| c.name.clone())
            .unwrap_or_else(|| question.name().clone()),
        _ => Name::from_ascii("web.dev.svc.cluster.local.").unwrap_or_else(|_| Name::root()),
    };
    let mut anchors = names::ExistenceCache::new(8);
    let now = Instant::now();
    for raw in answers {
        // Relayed unchanged (upstream, or the cluster for its own names) when
        // the id matches; cut to TC when over the client's UDP limit.
        if message::message_id(raw) == id && raw.len() > limit {
            encode(&message::truncated_for(&query), Some(limit));
        }
        // Decoded (answers to our own queries to the cluster DNS).
        let Ok(answer) = Message::from_vec(raw) else {
            continue;
        };
        let _ = message::extended_errors(&answer);
        let ttl = message::cache_ttl(&answer);
        assert!(
            ttl <= Duration::from_secs(u64::from(u32::MAX)),
            "TTL {ttl:?}"
        );
        if let Some(exists) = message::name_exists(answer.metadata.response_code) {
            anchors.insert(&expanded, exists, ttl, now);
            assert_eq!(
                anchors.get(&expanded, now),
                Some(exists),
                "cache lost an answer"
            );
            if exists {
                let reply = message::expanded_answer(&query, &expanded, &answer);
                encode(&reply, Some(limit));
                encode(&reply, None);
            }
        }
        let _ = names::while_unreachable(
            names::classify(&question, &clusters[0]),
            &clusters[0],
            |n| anchors.last_known(n),
        );
    }
}

/// Cluster DNS settings as the traffic manager sends them ([`chunks`] shape:
/// comma-separated servers, the domain, then search domains), validated as
/// the root daemon does, then asked a few fixed questions.
pub fn dns_cluster_config(data: &[u8]) {
    let parts: Vec<String> = chunks(data)
        .into_iter()
        .map(|c| String::from_utf8_lossy(c).into_owned())
        .take(16)
        .collect();
    let Some((servers, rest)) = parts.split_first() else {
        return;
    };
    let servers: Vec<String> = servers.split(',').map(str::to_owned).take(8).collect();
    for s in &servers {
        let _ = names::parse_server(s);
    }
    let (domain, search) = rest
        .split_first()
        .map_or(("", &[][..]), |(d, s)| (d.as_str(), s));
    let Ok(cluster) = ClusterDns::new(&servers, domain, search, true) else {
        return;
    };
    let _ = cluster.search_text();
    let _ = cluster.domain_text();
    for (name, qtype) in [
        ("web", RecordType::A),
        ("web.dev", RecordType::AAAA),
        ("web.dev.svc.cluster.local.", RecordType::A),
        ("example.com.", RecordType::A),
        ("10.0.96.10.in-addr.arpa.", RecordType::PTR),
    ] {
        let Ok(n) = Name::from_ascii(name) else {
            continue;
        };
        let plan = names::classify(&Query::query(n, qtype), &cluster);
        if let Plan::Search { candidates, .. } = plan {
            assert!(
                candidates.len() <= cluster.search.len() + 1,
                "{} candidates from {} search domains",
                candidates.len(),
                cluster.search.len()
            );
        }
    }
}
