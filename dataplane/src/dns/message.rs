//! DNS messages the forwarder builds or checks (pure). hickory parses and encodes
//! every message; nothing here reads or writes DNS bytes by hand.
//!
//! Sizes follow RFC 1035 §4.2.1 (512 bytes over UDP without EDNS) and RFC 6891
//! (the requester's EDNS UDP payload size bounds the answer; values below 512 count
//! as 512). An answer that does not fit is cut to header, question and OPT with the
//! TC bit (RFC 2181 §9), and the client asks again over TCP, which carries
//! everything (case dns-08).

use std::time::Duration;

use hickory_proto::ProtoError;
use hickory_proto::op::{
    Edns, Header, Message, MessageType, Metadata, OpCode, Query, ResponseCode,
};
use hickory_proto::rr::rdata::CNAME;
use hickory_proto::rr::rdata::opt::{EdnsCode, EdnsOption};
use hickory_proto::rr::{Name, RData, Record, RecordType};
use hickory_proto::serialize::binary::{BinDecodable as _, BinDecoder};

/// UDP payload size the forwarder advertises in its own OPT records: the DNS Flag
/// Day 2020 value, which avoids IP fragmentation on common paths.
pub const OWN_UDP_PAYLOAD: u16 = 1232;

/// UDP answer size without EDNS (RFC 1035).
pub const CLASSIC_UDP_LIMIT: usize = 512;

/// TTL of the CNAME from a cluster-relative spelling to its expansion, and of
/// negative answers without an SOA: the lab's and CoreDNS's default record TTL.
pub const DEFAULT_TTL: u32 = 5;

/// What to do with bytes that are not an acceptable query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reject {
    /// Say nothing: too short for a header, or a response (answering responses
    /// invites loops).
    Drop,
    /// Send this error answer (FORMERR, NOTIMP).
    Respond(Vec<u8>),
}

fn error_answer(metadata: &Metadata, rcode: ResponseCode, question: Option<&Query>) -> Reject {
    let mut m = Message::error_msg(metadata.id, metadata.op_code, rcode);
    m.metadata.recursion_desired = metadata.recursion_desired;
    m.metadata.recursion_available = true;
    if let Some(q) = question {
        m.add_query(q.clone());
    }
    match m.to_vec() {
        Ok(bytes) => Reject::Respond(bytes),
        Err(_) => Reject::Drop,
    }
}

/// Decode a query from a client. Malformed messages with a readable header get
/// FORMERR; other opcodes than QUERY get NOTIMP; a question count other than one
/// gets FORMERR (RFC 9619).
pub fn decode_query(raw: &[u8]) -> Result<Message, Reject> {
    let header = Header::read(&mut BinDecoder::new(raw)).map_err(|_| Reject::Drop)?;
    if header.metadata.message_type != MessageType::Query {
        return Err(Reject::Drop);
    }
    let message = match Message::from_vec(raw) {
        Ok(m) => m,
        Err(_) => return Err(error_answer(&header.metadata, ResponseCode::FormErr, None)),
    };
    if message.metadata.op_code != OpCode::Query {
        return Err(error_answer(
            &message.metadata,
            ResponseCode::NotImp,
            message.queries.first(),
        ));
    }
    if message.queries.len() != 1 {
        return Err(error_answer(&message.metadata, ResponseCode::FormErr, None));
    }
    Ok(message)
}

/// The id of a DNS message, if it has a header.
pub fn message_id(raw: &[u8]) -> Option<u16> {
    Header::read(&mut BinDecoder::new(raw))
        .ok()
        .map(|h| h.metadata.id)
}

/// The header's response code of a DNS message, if it has a header (the low 4
/// bits only: an EDNS extended rcode is not combined in).
pub fn response_code(raw: &[u8]) -> Option<ResponseCode> {
    Header::read(&mut BinDecoder::new(raw))
        .ok()
        .map(|h| h.metadata.response_code)
}

/// The largest UDP answer this client accepts, bytes.
pub fn udp_limit(query: &Message) -> usize {
    query.edns.as_ref().map_or(CLASSIC_UDP_LIMIT, |e| {
        usize::from(e.max_payload()).max(CLASSIC_UDP_LIMIT)
    })
}

fn own_edns(query: &Message) -> Option<Edns> {
    query.edns.as_ref().map(|client| {
        let mut e = Edns::new();
        e.set_max_payload(OWN_UDP_PAYLOAD);
        e.set_version(0);
        e.set_dnssec_ok(client.flags().dnssec_ok);
        e
    })
}

/// A response to `query` made here: its question, `rcode`, no records; EDNS when
/// the query had it.
pub fn local_answer(query: &Message, rcode: ResponseCode) -> Message {
    let mut m = Message::response(query.metadata.id, query.metadata.op_code);
    m.metadata.recursion_desired = query.metadata.recursion_desired;
    m.metadata.recursion_available = true;
    m.metadata.checking_disabled = query.metadata.checking_disabled;
    m.metadata.response_code = rcode;
    m.add_queries(query.queries.iter().cloned());
    if let Some(e) = own_edns(query) {
        m.set_edns(e);
    }
    m
}

/// EDNS option code of an extended DNS error (RFC 8914 §2).
pub const EDE_OPTION: u16 = 15;

/// Extended DNS error INFO-CODE 22, "No Reachable Authority" (RFC 8914 §4.23):
/// the servers that hold the name cannot be reached.
pub const EDE_NO_REACHABLE_AUTHORITY: u16 = 22;

/// SERVFAIL for `query`, made here without asking anyone: its question, no
/// records, and when the client sent EDNS an OPT record carrying the extended
/// DNS error `info_code` with `text` (RFC 8914: INFO-CODE, then UTF-8 text).
pub fn servfail_with_ede(query: &Message, info_code: u16, text: &str) -> Message {
    let mut m = local_answer(query, ResponseCode::ServFail);
    if let Some(e) = m.edns.as_mut() {
        let mut data = Vec::with_capacity(2 + text.len());
        data.extend_from_slice(&info_code.to_be_bytes());
        data.extend_from_slice(text.as_bytes());
        e.options_mut()
            .insert(EdnsOption::Unknown(EDE_OPTION, data));
    }
    m
}

/// The extended DNS errors in `msg` (RFC 8914): (INFO-CODE, EXTRA-TEXT).
pub fn extended_errors(msg: &Message) -> Vec<(u16, String)> {
    let Some(e) = &msg.edns else {
        return Vec::new();
    };
    e.options()
        .get_all(EdnsCode::from(EDE_OPTION))
        .into_iter()
        .filter_map(|o| match o {
            EdnsOption::Unknown(EDE_OPTION, data) if data.len() >= 2 => Some((
                u16::from_be_bytes([data[0], data[1]]),
                String::from_utf8_lossy(&data[2..]).into_owned(),
            )),
            _ => None,
        })
        .collect()
}

/// The query the forwarder sends to the cluster DNS for `name`/`qtype` on behalf of
/// `client`: a fresh random id, recursion desired, and the client's EDNS UDP size
/// and DO bit (so that the cluster truncates where the client would need it).
pub fn cluster_query(client: &Message, name: &Name, qtype: RecordType) -> Message {
    let mut m = Message::query();
    m.metadata.recursion_desired = true;
    m.metadata.checking_disabled = client.metadata.checking_disabled;
    m.add_query(Query::query(name.clone(), qtype));
    if let Some(c) = &client.edns {
        let mut e = Edns::new();
        e.set_max_payload(c.max_payload());
        e.set_version(0);
        e.set_dnssec_ok(c.flags().dnssec_ok);
        m.set_edns(e);
    }
    m
}

/// A query for whether `name` exists (any rcode but NXDOMAIN means it does).
pub fn existence_query(name: &Name) -> Message {
    let mut m = Message::query();
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(name.clone(), RecordType::A));
    m
}

/// The answer to `query` from the cluster's answer `cluster` for the expansion
/// `expanded` of its question: the original question, a CNAME from the asked
/// name to the expansion when there are answers, then the cluster's records. A
/// negative or empty answer carries no CNAME, so AAAA of an IPv4 Service stays
/// NOERROR with an empty answer section (case dns-02). TC is kept.
pub fn expanded_answer(query: &Message, expanded: &Name, cluster: &Message) -> Message {
    let mut m = local_answer(query, cluster.metadata.response_code);
    m.metadata.truncation = cluster.metadata.truncation;
    if !cluster.answers.is_empty()
        && let Some(q) = query.queries.first()
    {
        let ttl = cluster
            .answers
            .iter()
            .map(|r| r.ttl)
            .min()
            .unwrap_or(DEFAULT_TTL);
        m.add_answer(Record::from_rdata(
            q.name().clone(),
            ttl,
            RData::CNAME(CNAME(expanded.clone())),
        ));
        m.add_answers(cluster.answers.iter().cloned());
    }
    m.add_authorities(cluster.authorities.iter().cloned());
    m.add_additionals(cluster.additionals.iter().cloned());
    m
}

/// Encode `msg` so that it fits `limit` bytes (UDP), or whole (`None`, TCP).
/// Too large: first without the additional section, then header, question and
/// OPT only, with TC.
pub fn encode_fitting(msg: &Message, limit: Option<usize>) -> Result<(Vec<u8>, bool), ProtoError> {
    let whole = msg.to_vec()?;
    let Some(limit) = limit else {
        return Ok((whole, false));
    };
    if whole.len() <= limit {
        return Ok((whole, false));
    }
    if !msg.additionals.is_empty() {
        let mut lean = msg.clone();
        lean.additionals.clear();
        let bytes = lean.to_vec()?;
        if bytes.len() <= limit {
            return Ok((bytes, false));
        }
    }
    Ok((msg.truncate().to_vec()?, true))
}

/// Whether an rcode says the name exists (RFC 8020: only NXDOMAIN denies it;
/// SERVFAIL and REFUSED say nothing, and count as "does not exist here").
pub fn name_exists(rcode: ResponseCode) -> Option<bool> {
    match rcode {
        ResponseCode::NoError => Some(true),
        ResponseCode::NXDomain => Some(false),
        _ => None,
    }
}

/// How long an answer about existence may be cached: the smallest answer TTL, or
/// for negative answers the SOA's MINIMUM (capped by the SOA record's TTL, RFC
/// 2308 §5), else [`DEFAULT_TTL`].
pub fn cache_ttl(msg: &Message) -> Duration {
    let answer = msg.answers.iter().map(|r| r.ttl).min();
    let soa = msg.authorities.iter().find_map(|r| match &r.data {
        RData::SOA(soa) => Some(soa.minimum.min(r.ttl)),
        _ => None,
    });
    Duration::from_secs(u64::from(answer.or(soa).unwrap_or(DEFAULT_TTL)))
}

/// A response to `query` whose only content is the TC bit: what a UDP client gets
/// when a relayed answer exceeds its size.
pub fn truncated_for(query: &Message) -> Message {
    let mut m = local_answer(query, ResponseCode::NoError);
    m.metadata.truncation = true;
    m
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use hickory_proto::rr::rdata::{A, SOA};

    use super::*;

    fn name(s: &str) -> Name {
        Name::from_ascii(s).expect("name")
    }

    fn query(q: &str, t: RecordType, edns: Option<u16>) -> Message {
        let mut m = Message::query();
        m.metadata.id = 777;
        m.metadata.recursion_desired = true;
        m.add_query(Query::query(name(q), t));
        if let Some(size) = edns {
            let mut e = Edns::new();
            e.set_max_payload(size);
            m.set_edns(e);
        }
        m
    }

    fn a(owner: &str, i: u32) -> Record {
        Record::from_rdata(name(owner), 5, RData::A(A(Ipv4Addr::from(0x0a60_0000 + i))))
    }

    #[test]
    fn garbage_is_dropped_or_formerr_never_a_panic() {
        assert_eq!(decode_query(&[]), Err(Reject::Drop));
        assert_eq!(decode_query(&[1, 2, 3]), Err(Reject::Drop));
        // A header claiming one question, and no question.
        let mut raw = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        let Err(Reject::Respond(answer)) = decode_query(&raw) else {
            panic!("FORMERR expected");
        };
        let m = Message::from_vec(&answer).expect("decodes");
        assert_eq!(m.metadata.id, 0x1234);
        assert_eq!(m.metadata.response_code, ResponseCode::FormErr);
        assert_eq!(m.metadata.message_type, MessageType::Response);
        // A response is never answered.
        raw[2] |= 0x80;
        assert_eq!(decode_query(&raw), Err(Reject::Drop));
        // Two questions: FORMERR.
        let mut two = query("a.", RecordType::A, None);
        two.add_query(Query::query(name("b."), RecordType::A));
        let Err(Reject::Respond(answer)) = decode_query(&two.to_vec().expect("encode")) else {
            panic!("FORMERR expected");
        };
        assert_eq!(
            Message::from_vec(&answer)
                .expect("decodes")
                .metadata
                .response_code,
            ResponseCode::FormErr
        );
        // NOTIFY: NOTIMP.
        let mut notify = query("a.", RecordType::SOA, None);
        notify.metadata.op_code = OpCode::Notify;
        let Err(Reject::Respond(answer)) = decode_query(&notify.to_vec().expect("encode")) else {
            panic!("NOTIMP expected");
        };
        assert_eq!(
            Message::from_vec(&answer)
                .expect("decodes")
                .metadata
                .response_code,
            ResponseCode::NotImp
        );
        let ok = query("web.", RecordType::A, Some(4096));
        assert_eq!(
            decode_query(&ok.to_vec().expect("encode")).expect("query"),
            ok
        );
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_decode_without_panicking(raw in proptest::collection::vec(proptest::num::u8::ANY, 0..600)) {
            if let Ok(m) = decode_query(&raw) {
                let _ = encode_fitting(&local_answer(&m, ResponseCode::NXDomain), Some(udp_limit(&m)));
            }
            let _ = message_id(&raw);
        }
    }

    #[test]
    fn udp_limits_follow_edns() {
        assert_eq!(udp_limit(&query("a.", RecordType::A, None)), 512);
        assert_eq!(udp_limit(&query("a.", RecordType::A, Some(1232))), 1232);
        assert_eq!(udp_limit(&query("a.", RecordType::A, Some(100))), 512);
    }

    #[test]
    fn expanded_answers_cname_the_asked_name_and_keep_edns() {
        let q = query("web.", RecordType::A, Some(4096));
        let expanded = name("web.dev.svc.cluster.local.");
        let sent = cluster_query(&q, &expanded, RecordType::A);
        assert_ne!(
            sent.metadata.id, 0,
            "fresh id (random, non-zero here by chance is fine)"
        );
        assert_eq!(sent.queries[0].name(), &expanded);
        assert_eq!(
            sent.edns.as_ref().map(Edns::max_payload),
            Some(4096),
            "client's size"
        );
        let mut cluster = Message::response(sent.metadata.id, OpCode::Query);
        cluster.add_query(sent.queries[0].clone());
        cluster.add_answer(a("web.dev.svc.cluster.local.", 100));
        let m = expanded_answer(&q, &expanded, &cluster);
        assert_eq!(m.metadata.id, 777);
        assert_eq!(m.queries, q.queries, "the question as asked");
        assert_eq!(m.answers.len(), 2);
        assert_eq!(m.answers[0].name, name("web."));
        assert_eq!(m.answers[0].data, RData::CNAME(CNAME(expanded.clone())));
        assert_eq!(m.answers[1], a("web.dev.svc.cluster.local.", 100));
        assert!(m.edns.is_some());
        // NODATA (AAAA of an IPv4 Service): empty answer, no CNAME.
        let mut nodata = Message::response(1, OpCode::Query);
        nodata.add_authority(Record::from_rdata(
            name("cluster.local."),
            5,
            RData::SOA(SOA::new(
                name("ns.dns.cluster.local."),
                name("hostmaster.cluster.local."),
                1,
                7200,
                1800,
                86400,
                5,
            )),
        ));
        let m = expanded_answer(&query("web.", RecordType::AAAA, None), &expanded, &nodata);
        assert_eq!(m.metadata.response_code, ResponseCode::NoError);
        assert!(m.answers.is_empty());
        assert!(m.edns.is_none(), "no EDNS without EDNS");
        assert_eq!(cache_ttl(&nodata), Duration::from_secs(5));
    }

    #[test]
    fn big_answers_truncate_over_udp_and_stay_whole_over_tcp() {
        let q = query("big.", RecordType::A, None);
        let mut cluster = Message::response(1, OpCode::Query);
        for i in 0..300 {
            cluster.add_answer(a("big.dev.svc.cluster.local.", i));
        }
        let m = expanded_answer(&q, &name("big.dev.svc.cluster.local."), &cluster);
        let (bytes, tc) = encode_fitting(&m, Some(udp_limit(&q))).expect("encode");
        assert!(tc);
        assert!(bytes.len() <= 512);
        let back = Message::from_vec(&bytes).expect("decode");
        assert!(back.metadata.truncation);
        assert_eq!(back.queries, q.queries);
        let (bytes, tc) = encode_fitting(&m, None).expect("encode");
        assert!(!tc);
        let back = Message::from_vec(&bytes).expect("decode");
        assert_eq!(back.answers.len(), 301);
        assert!(!back.metadata.truncation);
        // Small answers are not touched.
        let small = local_answer(&q, ResponseCode::NXDomain);
        assert_eq!(
            encode_fitting(&small, Some(512)).expect("encode"),
            (small.to_vec().expect("encode"), false)
        );
        let t = truncated_for(&query("x.", RecordType::A, Some(1232)));
        assert!(t.metadata.truncation && t.answers.is_empty() && t.edns.is_some());
    }

    #[test]
    fn servfail_carries_an_extended_error_only_with_edns() {
        let q = query("web.default.svc.cluster.local.", RecordType::A, Some(1232));
        let m = servfail_with_ede(&q, EDE_NO_REACHABLE_AUTHORITY, "session down");
        let back = Message::from_vec(&m.to_vec().expect("encode")).expect("decode");
        assert_eq!(back.metadata.id, 777);
        assert_eq!(back.metadata.response_code, ResponseCode::ServFail);
        assert_eq!(back.queries, q.queries);
        assert!(back.answers.is_empty());
        assert_eq!(
            extended_errors(&back),
            vec![(22, "session down".to_owned())]
        );
        let plain = query("web.", RecordType::A, None);
        let m = servfail_with_ede(&plain, EDE_NO_REACHABLE_AUTHORITY, "session down");
        let back = Message::from_vec(&m.to_vec().expect("encode")).expect("decode");
        assert_eq!(back.metadata.response_code, ResponseCode::ServFail);
        assert!(back.edns.is_none(), "no OPT without EDNS");
        assert!(extended_errors(&back).is_empty());
    }

    #[test]
    fn existence_from_rcodes() {
        assert_eq!(name_exists(ResponseCode::NoError), Some(true));
        assert_eq!(name_exists(ResponseCode::NXDomain), Some(false));
        assert_eq!(name_exists(ResponseCode::ServFail), None);
        assert_eq!(
            message_id(&[0xab, 0xcd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
            Some(0xabcd)
        );
    }
}
