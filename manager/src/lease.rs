//! Tunnel IP leases: the pure core (no I/O, no clock, no randomness).
//!
//! A lease binds a client id (random, kept by the laptop per user and cluster) to
//! one tunnel IP from the pool and a session token. Rules:
//! - the same client id gets the same tunnel IP (and token) while its lease lives;
//! - two client ids never hold the same IP;
//! - the pool's network address, the manager stack's address (`.1`) and the
//!   broadcast address are never leased;
//! - a lease expires [`LeaseTable::lease_time`] after it was last granted or
//!   renewed; a lease with a live data channel ([`LeaseTable::activate`]) never
//!   expires and is renewed by [`LeaseTable::renew_active`];
//! - a new IP is the lowest free address, so an expired lease's IP is reused
//!   only after it expired.
//!
//! Times are wall-clock seconds since the Unix epoch (`now_s`), because leases
//! are persisted (Lease objects, [`crate::leases`]) and must mean the
//! same after a manager restart. Tokens are drawn by the caller.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};

/// Longest accepted client id, bytes.
pub const MAX_CLIENT_ID: usize = 128;

/// One lease as stored (JSON in its Lease object) and returned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    /// The client's id.
    pub client_id: String,
    /// The leased tunnel IP.
    pub ip: Ipv4Addr,
    /// Session token; the hello for `ip` must carry it.
    pub token: String,
    /// Expiry, seconds since the Unix epoch.
    pub expires_at: u64,
}

/// Why a lease cannot be granted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// The client id is empty, too long or has other characters than
    /// `[A-Za-z0-9._-]`.
    #[error(
        "invalid client id {0:?}: 1..={MAX_CLIENT_ID} characters of A-Z a-z 0-9 . _ - expected"
    )]
    BadClientId(String),
    /// Every address of the pool is leased and none expired.
    #[error(
        "tunnel pool {0} is exhausted: every address is leased (raise --tunnel-pool or lower --lease-time)"
    )]
    PoolExhausted(Ipv4Net),
}

/// Why a data channel's hello is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AttachError {
    /// No (unexpired) lease for the hello's tunnel IP.
    #[error(
        "no lease for tunnel IP {0} (expired, or never leased: the laptop must call Lease first)"
    )]
    NoLease(IpAddr),
    /// A lease exists but the hello's token is not its token.
    #[error("session token does not match the lease of tunnel IP {0} (leased to another client?)")]
    WrongToken(IpAddr),
}

/// The lease table of one manager.
#[derive(Debug, Clone)]
pub struct LeaseTable {
    pool: Ipv4Net,
    lease_time: Duration,
    by_ip: BTreeMap<Ipv4Addr, LeaseRecord>,
    by_client: HashMap<String, Ipv4Addr>,
    /// Live data channels per leased IP (process-local, never persisted).
    active: HashMap<Ipv4Addr, u32>,
    /// Addresses the store holds in a form this table cannot read (a lease
    /// object edited into garbage, a duplicate): never handed out, so whatever
    /// client owns them loses nothing to a new grant.
    blocked: BTreeSet<Ipv4Addr>,
}

fn valid_client_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_CLIENT_ID
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Constant-time comparison (the token is a bearer secret). An empty stored
/// token matches nothing: a lease record without a token (hand-edited
/// lease object) must not let a token-less hello in.
fn same_token(stored: &[u8], presented: &[u8]) -> bool {
    !stored.is_empty()
        && stored.len() == presented.len()
        && stored
            .iter()
            .zip(presented)
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// What logs say instead of a client id: the first 12 hex digits of its
/// SHA-256. The client id is a credential (`Lease` answers the lease's session
/// token to whoever presents it, docs/trust-model.md), and the manager's log
/// is readable by more people than the laptop's 0600 client-id file.
pub fn client_fingerprint(client_id: &str) -> String {
    use sha2::{Digest as _, Sha256};
    Sha256::digest(client_id.as_bytes())
        .iter()
        .take(6)
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl LeaseTable {
    /// An empty table over `pool` (IPv4; a /30 or wider to hold any client).
    pub fn new(pool: Ipv4Net, lease_time: Duration) -> Self {
        Self {
            pool: pool.trunc(),
            lease_time,
            by_ip: BTreeMap::new(),
            by_client: HashMap::new(),
            active: HashMap::new(),
            blocked: BTreeSet::new(),
        }
    }

    /// The pool.
    pub fn pool(&self) -> Ipv4Net {
        self.pool
    }

    /// The manager stack's address: the pool's first host address (`.1`).
    pub fn manager_ip(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.pool.network()).saturating_add(1))
    }

    /// How long a lease lives without a data channel.
    pub fn lease_time(&self) -> Duration {
        self.lease_time
    }

    /// Whether `ip` may be leased: in the pool, not the network, manager or
    /// broadcast address.
    pub fn leasable(&self, ip: Ipv4Addr) -> bool {
        self.pool.contains(&ip)
            && ip != self.pool.network()
            && ip != self.manager_ip()
            && ip != self.pool.broadcast()
    }

    fn expiry(&self, now_s: u64) -> u64 {
        now_s.saturating_add(self.lease_time.as_secs())
    }

    /// Grant (or return the existing) lease of `client_id`. `fresh_token` is
    /// used only for a new lease.
    pub fn lease(
        &mut self,
        client_id: &str,
        fresh_token: &str,
        now_s: u64,
    ) -> Result<LeaseRecord, LeaseError> {
        if !valid_client_id(client_id) {
            return Err(LeaseError::BadClientId(
                client_id.chars().take(160).collect(),
            ));
        }
        self.expire(now_s);
        let expires_at = self.expiry(now_s);
        if let Some(ip) = self.by_client.get(client_id).copied()
            && let Some(rec) = self.by_ip.get_mut(&ip)
        {
            rec.expires_at = rec.expires_at.max(expires_at);
            return Ok(rec.clone());
        }
        let first = u32::from(self.pool.network());
        let last = u32::from(self.pool.broadcast());
        let ip = (first..=last)
            .map(Ipv4Addr::from)
            .find(|ip| {
                self.leasable(*ip) && !self.by_ip.contains_key(ip) && !self.blocked.contains(ip)
            })
            .ok_or(LeaseError::PoolExhausted(self.pool))?;
        let rec = LeaseRecord {
            client_id: client_id.to_owned(),
            ip,
            token: fresh_token.to_owned(),
            expires_at,
        };
        self.insert(rec.clone());
        Ok(rec)
    }

    fn insert(&mut self, rec: LeaseRecord) {
        self.by_client.insert(rec.client_id.clone(), rec.ip);
        self.by_ip.insert(rec.ip, rec);
    }

    /// Check a hello: `token` must be the token of an unexpired lease of `ip`.
    /// Returns the lease's client id.
    pub fn check(&self, ip: IpAddr, token: &[u8], now_s: u64) -> Result<String, AttachError> {
        let rec = match ip {
            IpAddr::V4(v4) => self.by_ip.get(&v4),
            IpAddr::V6(_) => None,
        }
        .filter(|r| r.expires_at > now_s || self.is_active(r.ip))
        .ok_or(AttachError::NoLease(ip))?;
        if same_token(rec.token.as_bytes(), token) {
            Ok(rec.client_id.clone())
        } else {
            Err(AttachError::WrongToken(ip))
        }
    }

    /// Renew the lease of `ip` to `now_s` + lease time (a data channel started
    /// or ended).
    pub fn touch(&mut self, ip: IpAddr, now_s: u64) {
        let expires_at = self.expiry(now_s);
        if let IpAddr::V4(v4) = ip
            && let Some(rec) = self.by_ip.get_mut(&v4)
        {
            rec.expires_at = rec.expires_at.max(expires_at);
        }
    }

    /// A data channel for `ip` started (after [`LeaseTable::check`]).
    pub fn activate(&mut self, ip: IpAddr) {
        if let IpAddr::V4(v4) = ip {
            *self.active.entry(v4).or_default() += 1;
        }
    }

    /// A data channel for `ip` ended.
    pub fn deactivate(&mut self, ip: IpAddr) {
        if let IpAddr::V4(v4) = ip
            && let Some(n) = self.active.get_mut(&v4)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.active.remove(&v4);
            }
        }
    }

    /// Whether a data channel for `ip` is up.
    pub fn is_active(&self, ip: Ipv4Addr) -> bool {
        self.active.contains_key(&ip)
    }

    /// Renew every lease with a live data channel; returns how many.
    pub fn renew_active(&mut self, now_s: u64) -> usize {
        let expires_at = self.expiry(now_s);
        let mut n = 0;
        for ip in self.active.keys() {
            if let Some(rec) = self.by_ip.get_mut(ip) {
                rec.expires_at = rec.expires_at.max(expires_at);
                n += 1;
            }
        }
        n
    }

    /// Remove expired leases without a live data channel; returns them.
    pub fn expire(&mut self, now_s: u64) -> Vec<LeaseRecord> {
        let gone: Vec<Ipv4Addr> = self
            .by_ip
            .values()
            .filter(|r| r.expires_at <= now_s && !self.is_active(r.ip))
            .map(|r| r.ip)
            .collect();
        let mut out = Vec::with_capacity(gone.len());
        for ip in gone {
            if let Some(rec) = self.by_ip.remove(&ip) {
                self.by_client.remove(&rec.client_id);
                out.push(rec);
            }
        }
        out
    }

    /// Seconds until `rec` expires.
    pub fn expires_in(rec: &LeaseRecord, now_s: u64) -> u64 {
        rec.expires_at.saturating_sub(now_s)
    }

    /// All leases, by IP.
    pub fn records(&self) -> Vec<LeaseRecord> {
        self.by_ip.values().cloned().collect()
    }

    /// Replace the leases with `records` (read from the store); live data
    /// channels are kept, blocked addresses cleared. Records outside the pool,
    /// for reserved addresses or repeating an IP or client id are skipped and
    /// returned.
    pub fn replace_records(&mut self, records: Vec<LeaseRecord>) -> Vec<LeaseRecord> {
        self.by_ip.clear();
        self.by_client.clear();
        self.blocked.clear();
        let mut skipped = Vec::new();
        for rec in records {
            if !self.leasable(rec.ip)
                || !valid_client_id(&rec.client_id)
                || self.by_ip.contains_key(&rec.ip)
                || self.by_client.contains_key(&rec.client_id)
            {
                skipped.push(rec);
                continue;
            }
            self.insert(rec);
        }
        skipped
    }

    /// Never hand out `ip` until the next [`LeaseTable::replace_records`]: the
    /// store holds something there that this table could not read.
    pub fn block(&mut self, ip: Ipv4Addr) {
        if !self.by_ip.contains_key(&ip) {
            self.blocked.insert(ip);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    const HOUR: Duration = Duration::from_secs(3600);

    fn table(pool: &str) -> LeaseTable {
        LeaseTable::new(pool.parse().expect("pool"), HOUR)
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().expect("ip")
    }

    #[test]
    fn first_leases_skip_network_and_manager() {
        let mut t = table("100.96.0.0/16");
        assert_eq!(t.manager_ip(), ip("100.96.0.1"));
        let a = t.lease("a", "ta", 1000).expect("a");
        let b = t.lease("b", "tb", 1000).expect("b");
        assert_eq!(a.ip, ip("100.96.0.2"));
        assert_eq!(b.ip, ip("100.96.0.3"));
        assert_eq!(a.expires_at, 1000 + 3600);
        assert_eq!(LeaseTable::expires_in(&a, 1600), 3000);
    }

    #[test]
    fn same_client_same_ip_and_token_and_renewed() {
        let mut t = table("100.96.0.0/16");
        let a = t.lease("a", "ta", 1000).expect("a");
        let again = t.lease("a", "other", 2000).expect("again");
        assert_eq!(again.ip, a.ip);
        assert_eq!(again.token, "ta", "an existing lease keeps its token");
        assert_eq!(again.expires_at, 2000 + 3600);
    }

    #[test]
    fn bad_client_ids_are_refused() {
        let mut t = table("100.96.0.0/16");
        for id in ["", "a b", "ä", &"x".repeat(MAX_CLIENT_ID + 1)] {
            assert!(
                matches!(t.lease(id, "t", 0), Err(LeaseError::BadClientId(_))),
                "{id:?}"
            );
        }
        assert!(t.lease(&"x".repeat(MAX_CLIENT_ID), "t", 0).is_ok());
    }

    #[test]
    fn small_pool_exhausts_then_reuses_expired() {
        // /29: .0 network, .1 manager, .7 broadcast -> .2 ..= .6 leasable.
        let mut t = table("10.1.0.0/29");
        for (i, c) in ["a", "b", "c", "d", "e"].iter().enumerate() {
            let rec = t.lease(c, "t", 0).expect("lease");
            assert_eq!(rec.ip, Ipv4Addr::new(10, 1, 0, 2 + i as u8));
        }
        assert_eq!(
            t.lease("f", "t", 10),
            Err(LeaseError::PoolExhausted(
                "10.1.0.0/29".parse().expect("net")
            ))
        );
        // "c" keeps its data channel up: its lease never expires.
        t.activate(IpAddr::V4(ip("10.1.0.4")));
        // At 3600 every lease is expired except the active one.
        let f = t.lease("f", "tf", 3600).expect("f after expiry");
        assert_eq!(f.ip, ip("10.1.0.2"), "lowest expired IP reused");
        assert_eq!(t.records().len(), 2);
        assert!(t.records().iter().any(|r| r.client_id == "c"));
        // "a" comes back after its lease expired: a new IP (.2 is f's now).
        let a = t.lease("a", "ta2", 3601).expect("a again");
        assert_eq!(a.ip, ip("10.1.0.3"));
        assert_eq!(a.token, "ta2");
    }

    #[test]
    fn check_token_ip_and_expiry() {
        let mut t = table("100.96.0.0/16");
        let a = t.lease("a", "secret-a", 0).expect("a");
        let b = t.lease("b", "secret-b", 0).expect("b");
        let a_ip = IpAddr::V4(a.ip);
        assert_eq!(t.check(a_ip, b"secret-a", 10), Ok("a".to_owned()));
        assert_eq!(
            t.check(a_ip, b"secret-b", 10),
            Err(AttachError::WrongToken(a_ip))
        );
        assert_eq!(t.check(a_ip, b"", 10), Err(AttachError::WrongToken(a_ip)));
        // A stored record without a token never matches, not even an empty token.
        let mut hand_edited = t.records();
        for r in &mut hand_edited {
            r.token.clear();
        }
        let mut u = table("100.96.0.0/16");
        assert!(u.replace_records(hand_edited).is_empty());
        assert_eq!(u.check(a_ip, b"", 10), Err(AttachError::WrongToken(a_ip)));
        assert_eq!(
            client_fingerprint("a"),
            "ca978112ca1b",
            "SHA-256 of \"a\", 6 bytes"
        );
        let free = IpAddr::V4(ip("100.96.0.9"));
        assert_eq!(
            t.check(free, b"secret-a", 10),
            Err(AttachError::NoLease(free))
        );
        let v6: IpAddr = "fd00::2".parse().expect("v6");
        assert_eq!(t.check(v6, b"secret-a", 10), Err(AttachError::NoLease(v6)));
        // Expired: refused even before expire() ran.
        assert_eq!(
            t.check(a_ip, b"secret-a", 3600),
            Err(AttachError::NoLease(a_ip))
        );
        // Active data channel renewed: still valid later.
        let b_ip = IpAddr::V4(b.ip);
        t.activate(b_ip);
        t.touch(b_ip, 3000);
        assert_eq!(t.check(b_ip, b"secret-b", 3600), Ok("b".to_owned()));
        assert_eq!(t.renew_active(6000), 1);
        t.deactivate(b_ip);
        assert_eq!(
            t.records()
                .iter()
                .find(|r| r.client_id == "b")
                .map(|r| r.expires_at),
            Some(9600)
        );
        assert_eq!(t.expire(9599).len(), 1, "only a expired");
        assert_eq!(
            t.expire(9600).len(),
            1,
            "b expires one lease time after the last renewal"
        );
        assert!(t.records().is_empty());
    }

    #[test]
    fn activation_is_counted() {
        let mut t = table("100.96.0.0/16");
        let a = t.lease("a", "t", 0).expect("a");
        let a_ip = IpAddr::V4(a.ip);
        t.activate(a_ip);
        t.activate(a_ip);
        t.deactivate(a_ip);
        assert!(t.is_active(a.ip), "one channel still up");
        t.deactivate(a_ip);
        assert!(!t.is_active(a.ip));
        t.deactivate(a_ip);
        assert!(!t.is_active(a.ip));
    }

    #[test]
    fn replace_records_skips_invalid_and_duplicates() {
        let mut t = table("100.96.0.0/16");
        let rec = |c: &str, i: &str| LeaseRecord {
            client_id: c.into(),
            ip: ip(i),
            token: "t".into(),
            expires_at: 100,
        };
        let skipped = t.replace_records(vec![
            rec("a", "100.96.0.5"),
            rec("b", "100.96.0.5"),
            rec("a", "100.96.0.6"),
            rec("c", "100.96.0.1"),
            rec("d", "100.96.0.0"),
            rec("e", "100.96.255.255"),
            rec("f", "10.0.0.2"),
            rec("g", "100.96.0.7"),
        ]);
        assert_eq!(skipped.len(), 6);
        assert_eq!(t.records().len(), 2);
        // New leases avoid the restored ones.
        assert_eq!(t.lease("a", "x", 0).expect("a").ip, ip("100.96.0.5"));
        assert_eq!(t.lease("h", "x", 0).expect("h").ip, ip("100.96.0.2"));
    }

    #[test]
    fn blocked_addresses_are_never_granted_until_the_next_read() {
        let mut t = table("10.1.0.0/29");
        t.replace_records(Vec::new());
        // .2 and .4 hold objects this table cannot read (garbage).
        t.block(ip("10.1.0.2"));
        t.block(ip("10.1.0.4"));
        let got: Vec<Ipv4Addr> = ["a", "b", "c"]
            .iter()
            .map(|c| t.lease(c, "t", 0).expect("lease").ip)
            .collect();
        assert_eq!(got, [ip("10.1.0.3"), ip("10.1.0.5"), ip("10.1.0.6")]);
        assert_eq!(
            t.lease("d", "t", 0),
            Err(LeaseError::PoolExhausted(
                "10.1.0.0/29".parse().expect("net")
            )),
            "blocked addresses count as taken"
        );
        // Blocking a held address changes nothing; a new read clears the blocks.
        t.block(ip("10.1.0.3"));
        assert_eq!(t.records().len(), 3);
        let kept = t.records();
        t.replace_records(kept);
        assert_eq!(t.lease("d", "t", 0).expect("d").ip, ip("10.1.0.2"));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Lease(u8),
        Activate(u8),
        Deactivate(u8),
        Advance(u16),
        Renew,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u8..24).prop_map(Op::Lease),
            1 => (0u8..24).prop_map(Op::Activate),
            1 => (0u8..24).prop_map(Op::Deactivate),
            2 => (0u16..2000).prop_map(Op::Advance),
            1 => Just(Op::Renew),
        ]
    }

    proptest! {
        /// Any sequence of operations on a small pool: IPs stay unique, leasable
        /// and bijective with client ids; a client that holds an unexpired lease
        /// gets the same IP again; active leases never disappear.
        #[test]
        fn invariants_hold(ops in proptest::collection::vec(op(), 1..200)) {
            let mut t = LeaseTable::new("10.9.0.0/28".parse().expect("pool"), Duration::from_secs(1000));
            let mut now = 0u64;
            let mut held: HashMap<String, Ipv4Addr> = HashMap::new();
            for op in ops {
                match op {
                    Op::Lease(c) => {
                        let id = format!("c{c}");
                        let before = t.records().into_iter().find(|r| r.client_id == id && r.expires_at > now);
                        match t.lease(&id, &format!("tok{c}"), now) {
                            Ok(rec) => {
                                prop_assert!(t.leasable(rec.ip));
                                if let Some(b) = before {
                                    prop_assert_eq!(b.ip, rec.ip, "same client, same IP");
                                    prop_assert_eq!(b.token, rec.token);
                                }
                                prop_assert_eq!(t.check(IpAddr::V4(rec.ip), format!("tok{c}").as_bytes(), now), Ok(id.clone()));
                                held.insert(id, rec.ip);
                            }
                            Err(LeaseError::PoolExhausted(_)) => {
                                prop_assert!(before.is_none());
                                // 13 leasable addresses, all taken.
                                prop_assert_eq!(t.records().len(), 13);
                            }
                            Err(e) => prop_assert!(false, "unexpected {e}"),
                        }
                    }
                    Op::Activate(c) => {
                        if let Some(ip) = held.get(&format!("c{c}")) && t.check(IpAddr::V4(*ip), format!("tok{c}").as_bytes(), now).is_ok() {
                            t.activate(IpAddr::V4(*ip));
                            t.touch(IpAddr::V4(*ip), now);
                        }
                    }
                    Op::Deactivate(c) => {
                        if let Some(ip) = held.get(&format!("c{c}")) && t.is_active(*ip) {
                            t.deactivate(IpAddr::V4(*ip));
                            t.touch(IpAddr::V4(*ip), now);
                        }
                    }
                    Op::Advance(d) => {
                        now += u64::from(d);
                        t.expire(now);
                    }
                    Op::Renew => { t.renew_active(now); }
                }
                let recs = t.records();
                let ips: HashSet<_> = recs.iter().map(|r| r.ip).collect();
                let ids: HashSet<_> = recs.iter().map(|r| r.client_id.clone()).collect();
                prop_assert_eq!(ips.len(), recs.len(), "unique IPs");
                prop_assert_eq!(ids.len(), recs.len(), "unique client ids");
                for ip in t.active.keys() {
                    prop_assert!(ips.contains(ip), "an active lease never disappears");
                }
            }
        }
    }
}
