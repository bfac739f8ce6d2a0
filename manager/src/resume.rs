//! Resuming a worker connection's engine after a re-dial (hello option 5).
//!
//! A laptop offers a random resume token per worker per session on every dial
//! of that worker. When such a connection ends (the port-forward broke, the
//! socket was killed), its session does not drop its engine (the smoltcp TCP
//! sockets, the kernel connections they dialed to pods, their timers): it
//! parks it here for the grace period (`kvpn-manager --resume-grace-ms`). The
//! next connection of the same tunnel IP and worker whose hello carries the
//! same resume token and the same lease token takes it back, so in-flight TCP
//! is simply retransmitted by both ends instead of reset (or, for a flow that
//! only receives, left hanging).
//!
//! Rules, so a resume never hands flows to another party:
//! - only an exact (tunnel IP, worker, resume token, lease token) match
//!   resumes; the lease token was already checked against the tunnel IP's
//!   lease (leases mode), and TLS identities are bound to leases there;
//! - without leases (nothing checked the hello's tokens), a connection with
//!   another token gets a fresh engine and leaves the parked one alone (it is
//!   not parkable itself while that one waits): an unchecked party must not
//!   reset another's flows;
//! - with leases, the hello's lease token was checked: this connection belongs
//!   to the tunnel IP's current lease, so a slot of its (tunnel IP, worker)
//!   with other credentials belongs to a session that is over (another lease
//!   token: that lease is gone; the same lease token with another resume
//!   token: the laptop started a new session, its old one cannot re-dial
//!   with the old token any more). Such a parked engine is dropped (counted
//!   in `engines_replaced_total`, logged with the reason) and such a live
//!   connection loses its slot (it can no longer park), so a dead session
//!   never shadows the live one for the grace period. The same goes for the
//!   parked engines of the tunnel IP's other workers that hold another lease
//!   token (workers of the same lease keep theirs: their resume tokens are
//!   their own);
//! - a parked engine is dropped (its connections reset) after the grace
//!   period, or when more than `--resume-max-parked` engines are parked (the
//!   oldest first), so parked engines are bounded like sessions are.
//!
//! While parked, nothing polls the engine: packets from pods wait in the
//! kernel side's bounded queues and the pods' socket buffers (the kernel
//! stops reading when they fill), and TCP retransmits whatever is lost.
//!
//! A connection of the same worker and token that arrives while the old one
//! still runs (the manager did not notice the old one die) stops the old one
//! and waits up to [`SUPERSEDE_WAIT`] for it to park.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use kvpn_proto::frame::RESUME_TOKEN_LEN;
use tokio::sync::Notify;
use tracing::{debug, info};

use crate::metrics::ManagerCounters;

/// Default of `--resume-grace-ms`: how long an ended connection's engine waits
/// for the laptop's re-dial (a re-dial takes well under a second; a broken
/// port-forward a few seconds).
pub const DEFAULT_GRACE: Duration = Duration::from_secs(30);

/// Default of `--resume-max-parked`.
pub const DEFAULT_MAX_PARKED: usize = 1024;

/// How long a new connection waits for the still-running connection of the
/// same worker and token to stop and park its engine.
pub const SUPERSEDE_WAIT: Duration = Duration::from_secs(2);

/// A worker connection's identity: tunnel IP and worker index (0 without
/// hello option 3).
pub type Key = (IpAddr, u16);

/// What a connection must present to take a parked engine.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// Hello option 5.
    pub resume_token: [u8; RESUME_TOKEN_LEN],
    /// The hello's lease (session) token.
    pub lease_token: Vec<u8>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Secrets: never logged.
        f.write_str("Credentials(..)")
    }
}

enum Slot<T> {
    Live {
        credentials: Credentials,
        conn: u64,
        stop: Arc<Notify>,
    },
    Parked {
        credentials: Credentials,
        conn: u64,
        since: Instant,
        counters: Arc<ManagerCounters>,
        state: T,
    },
}

/// The parked engines of a manager (state type `T`: the session's engine and
/// kernel side) and the live connections that may park one.
pub struct Resumes<T> {
    grace: Duration,
    max_parked: usize,
    slots: Mutex<HashMap<Key, Slot<T>>>,
    next_conn: AtomicU64,
    /// Woken whenever a slot is parked or removed.
    changed: Notify,
}

impl<T: Send + 'static> std::fmt::Debug for Resumes<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resumes")
            .field("grace", &self.grace)
            .field("max_parked", &self.max_parked)
            .field("parked", &self.parked())
            .finish()
    }
}

/// A live connection's right to park its engine on its slot; dropping it
/// without [`Claim::park`] frees the slot.
pub struct Claim<T: Send + 'static> {
    resumes: Arc<Resumes<T>>,
    key: Key,
    conn: u64,
    stop: Arc<Notify>,
    counters: Arc<ManagerCounters>,
}

impl<T: Send + 'static> std::fmt::Debug for Claim<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claim")
            .field("key", &self.key)
            .field("conn", &self.conn)
            .finish()
    }
}

/// What [`Resumes::attach`] found for a new connection.
pub struct Attached<T: Send + 'static> {
    /// The parked engine state, re-attached (`Some`: resumed).
    pub state: Option<T>,
    /// The right to park on end; `None` when another token holds the slot.
    pub claim: Option<Claim<T>>,
}

impl<T: Send + 'static> Resumes<T> {
    /// A registry that parks for `grace`, at most `max_parked` engines at once
    /// (0 or a zero grace: never park; what [`Resumes::off`] makes).
    pub fn new(grace: Duration, max_parked: usize) -> Arc<Self> {
        Arc::new(Self {
            grace,
            max_parked,
            slots: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            changed: Notify::new(),
        })
    }

    /// A registry that never parks (resuming off).
    pub fn off() -> Arc<Self> {
        Self::new(Duration::ZERO, 0)
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Key, Slot<T>>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Engines parked now.
    pub fn parked(&self) -> usize {
        self.lock()
            .values()
            .filter(|s| matches!(s, Slot::Parked { .. }))
            .count()
    }

    /// The grace period.
    pub fn grace(&self) -> Duration {
        self.grace
    }

    /// A new connection of `key` presenting `credentials`: take the parked
    /// engine when they match, and claim the slot. `lease_checked`: the
    /// lease token was checked against the tunnel IP's lease (leases on), so
    /// slots with other credentials are a finished session's and are
    /// replaced ([module docs](self)). Parks, resumes and expiries are
    /// counted in `counters`.
    pub async fn attach(
        self: &Arc<Self>,
        key: Key,
        credentials: Credentials,
        lease_checked: bool,
        counters: &Arc<ManagerCounters>,
    ) -> Attached<T> {
        if lease_checked {
            self.drop_other_leases(key.0, &credentials.lease_token);
        }
        let deadline = tokio::time::Instant::now() + SUPERSEDE_WAIT;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            // Register before looking, so a park between the look and the
            // wait is not missed.
            changed.as_mut().enable();
            {
                let mut slots = self.lock();
                enum Found {
                    Vacant,
                    Ours,
                    Running,
                    Finished,
                    Other,
                }
                let found = match slots.get(&key) {
                    None => Found::Vacant,
                    Some(Slot::Parked { credentials: c, .. }) if *c == credentials => Found::Ours,
                    Some(Slot::Live {
                        credentials: c,
                        stop,
                        ..
                    }) if *c == credentials => {
                        // The same laptop worker re-dialed before this manager
                        // saw its old connection end: stop that one, and wait
                        // for it to park.
                        stop.notify_one();
                        Found::Running
                    }
                    Some(_) if lease_checked => Found::Finished,
                    Some(_) => Found::Other,
                };
                match found {
                    Found::Vacant => {
                        let claim = self.claim(&mut slots, key, credentials, counters);
                        return Attached {
                            state: None,
                            claim: Some(claim),
                        };
                    }
                    Found::Ours => {
                        let state = match slots.remove(&key) {
                            Some(Slot::Parked {
                                state, counters, ..
                            }) => {
                                counters.engine_unparked(true);
                                Some(state)
                            }
                            _ => None,
                        };
                        let claim = self.claim(&mut slots, key, credentials, counters);
                        return Attached {
                            state,
                            claim: Some(claim),
                        };
                    }
                    Found::Running => {}
                    Found::Finished => {
                        let old = slots.remove(&key);
                        let same_lease = matches!(&old, Some(Slot::Parked { credentials: c, .. }) if c.lease_token == credentials.lease_token);
                        let claim = self.claim(&mut slots, key, credentials, counters);
                        drop(slots);
                        self.changed.notify_waiters();
                        match old {
                            Some(slot @ Slot::Parked { .. }) => {
                                let reason = if same_lease {
                                    "same lease, another resume token: the laptop started a new session"
                                } else {
                                    OTHER_LEASE
                                };
                                replaced(&slot, key, reason);
                            }
                            Some(Slot::Live { .. }) => {
                                info!(tunnel_ip = %key.0, worker = key.1, "a connection of this worker's earlier session still runs: it loses its slot (it will not park) to the lease's new session");
                            }
                            None => {}
                        }
                        return Attached {
                            state: None,
                            claim: Some(claim),
                        };
                    }
                    Found::Other => {
                        debug!(tunnel_ip = %key.0, worker = key.1, "another resume token holds this worker's slot: fresh engine, not parkable");
                        return Attached {
                            state: None,
                            claim: None,
                        };
                    }
                }
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                debug!(tunnel_ip = %key.0, worker = key.1, "the old connection did not park in time: fresh engine");
                return Attached {
                    state: None,
                    claim: None,
                };
            }
        }
    }

    fn claim(
        self: &Arc<Self>,
        slots: &mut HashMap<Key, Slot<T>>,
        key: Key,
        credentials: Credentials,
        counters: &Arc<ManagerCounters>,
    ) -> Claim<T> {
        let conn = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let stop = Arc::new(Notify::new());
        slots.insert(
            key,
            Slot::Live {
                credentials,
                conn,
                stop: stop.clone(),
            },
        );
        Claim {
            resumes: self.clone(),
            key,
            conn,
            stop,
            counters: counters.clone(),
        }
    }

    /// Drop the engines parked for `ip` under another lease token than
    /// `lease_token` (the caller's was checked: theirs is gone).
    fn drop_other_leases(&self, ip: IpAddr, lease_token: &[u8]) {
        let dropped: Vec<(Key, Slot<T>)> = {
            let mut slots = self.lock();
            let keys: Vec<Key> = slots
                .iter()
                .filter(|(k, s)| {
                    k.0 == ip
                        && matches!(s, Slot::Parked { credentials, .. } if credentials.lease_token != lease_token)
                })
                .map(|(k, _)| *k)
                .collect();
            keys.into_iter()
                .filter_map(|k| slots.remove(&k).map(|s| (k, s)))
                .collect()
        };
        for (key, slot) in &dropped {
            replaced(slot, *key, OTHER_LEASE);
        }
        if !dropped.is_empty() {
            self.changed.notify_waiters();
        }
    }

    /// Drop every engine parked for `ip` (its lease went away).
    pub fn drop_ip(&self, ip: IpAddr) {
        let dropped: Vec<Slot<T>> = {
            let mut slots = self.lock();
            let keys: Vec<Key> = slots
                .iter()
                .filter(|(k, s)| k.0 == ip && matches!(s, Slot::Parked { .. }))
                .map(|(k, _)| *k)
                .collect();
            keys.iter().filter_map(|k| slots.remove(k)).collect()
        };
        for slot in &dropped {
            if let Slot::Parked { counters, .. } = slot {
                counters.engine_unparked(false);
            }
        }
        if !dropped.is_empty() {
            self.changed.notify_waiters();
        }
    }
}

const OTHER_LEASE: &str = "another lease token: the old lease is gone";

/// A parked `slot` of `key` was dropped for a newer session: count and log
/// it (`reason`); the engine and its connections drop with the slot.
fn replaced<T>(slot: &Slot<T>, key: Key, reason: &str) {
    if let Slot::Parked { counters, .. } = slot {
        counters.engine_unparked(false);
        counters.engine_replaced();
        info!(tunnel_ip = %key.0, worker = key.1, reason, "parked engine of a finished session dropped: its flows are reset");
    }
}

impl<T: Send + 'static> Claim<T> {
    /// Resolves when a newer connection of the same worker and token asks
    /// this one to stop (and park).
    pub async fn superseded(&self) {
        self.stop.notified().await;
    }

    /// The connection ended: park `state` for the grace period. Returns true
    /// when parked; false when it was dropped (no parking allowed).
    pub fn park(self, state: T) -> bool {
        let resumes = self.resumes.clone();
        if resumes.max_parked == 0 || resumes.grace.is_zero() {
            return false;
        }
        let mut evicted = Vec::new();
        {
            let mut slots = resumes.lock();
            let ours =
                matches!(slots.get(&self.key), Some(Slot::Live { conn, .. }) if *conn == self.conn);
            if !ours {
                return false;
            }
            let Some(Slot::Live { credentials, .. }) = slots.remove(&self.key) else {
                return false;
            };
            // Over the cap: the oldest parked engines go first.
            loop {
                let parked: Vec<(Key, Instant)> = slots
                    .iter()
                    .filter_map(|(k, s)| match s {
                        Slot::Parked { since, .. } => Some((*k, *since)),
                        Slot::Live { .. } => None,
                    })
                    .collect();
                if parked.len() < resumes.max_parked {
                    break;
                }
                let Some(oldest) = parked.iter().min_by_key(|(_, t)| *t).map(|(k, _)| *k) else {
                    break;
                };
                if let Some(s) = slots.remove(&oldest) {
                    evicted.push(s);
                }
            }
            slots.insert(
                self.key,
                Slot::Parked {
                    credentials,
                    conn: self.conn,
                    since: Instant::now(),
                    counters: self.counters.clone(),
                    state,
                },
            );
        }
        for slot in &evicted {
            if let Slot::Parked { counters, .. } = slot {
                counters.engine_unparked(false);
            }
        }
        self.counters.engine_parked();
        resumes.changed.notify_waiters();
        let (key, conn) = (self.key, self.conn);
        info!(tunnel_ip = %key.0, worker = key.1, grace_s = resumes.grace.as_secs_f64(), "connection ended: engine parked for a resume");
        let expiry = resumes.clone();
        tokio::spawn(async move {
            tokio::time::sleep(expiry.grace).await;
            let gone = {
                let mut slots = expiry.lock();
                match slots.get(&key) {
                    Some(Slot::Parked { conn: c, .. }) if *c == conn => slots.remove(&key),
                    _ => None,
                }
            };
            if let Some(Slot::Parked { counters, .. }) = &gone {
                counters.engine_unparked(false);
                expiry.changed.notify_waiters();
                info!(tunnel_ip = %key.0, worker = key.1, "parked engine expired unresumed: its flows are reset");
            }
            // `gone` (the engine and its kernel connections) drops here.
        });
        // The slot is parked now: Drop finds no live slot of ours to free.
        true
    }
}

impl<T: Send + 'static> Drop for Claim<T> {
    fn drop(&mut self) {
        let mut slots = self.resumes.lock();
        if matches!(slots.get(&self.key), Some(Slot::Live { conn, .. }) if *conn == self.conn) {
            slots.remove(&self.key);
            drop(slots);
            self.resumes.changed.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn creds(resume: u8, lease: &[u8]) -> Credentials {
        Credentials {
            resume_token: [resume; RESUME_TOKEN_LEN],
            lease_token: lease.to_vec(),
        }
    }

    fn ip(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(100, 96, 0, last))
    }

    #[tokio::test]
    async fn only_the_same_resume_and_lease_token_resume_and_the_cap_drops_the_oldest() {
        let counters = Arc::new(ManagerCounters::default());
        let r = Resumes::<u32>::new(Duration::from_secs(30), 2);
        // Three connections end; only two may stay parked: the oldest goes.
        for (n, last) in [(1u32, 2u8), (2, 3), (3, 4)] {
            let a = r
                .attach((ip(last), 0), creds(1, b"lease"), false, &counters)
                .await;
            assert!(a.state.is_none());
            assert!(a.claim.expect("vacant slot").park(n));
        }
        assert_eq!(r.parked(), 2);
        let oldest = r
            .attach((ip(2), 0), creds(1, b"lease"), false, &counters)
            .await;
        assert_eq!(oldest.state, None, "evicted over the cap");
        drop(oldest);
        // Another lease token, another worker: nothing, and the parked one stays.
        let other = r
            .attach((ip(3), 0), creds(1, b"other"), false, &counters)
            .await;
        assert!(other.state.is_none() && other.claim.is_none());
        let worker = r
            .attach((ip(3), 1), creds(1, b"lease"), false, &counters)
            .await;
        assert!(worker.state.is_none());
        drop(worker);
        let same = r
            .attach((ip(3), 0), creds(1, b"lease"), false, &counters)
            .await;
        assert_eq!(same.state, Some(2));
        drop(same);
        // A lease that goes takes its parked engines along.
        r.drop_ip(ip(4));
        assert_eq!(r.parked(), 0);
        let text = counters.render_prometheus();
        for line in [
            "kvpn_manager_engines_parked 0\n",
            "kvpn_manager_engines_parked_total 3\n",
            "kvpn_manager_engines_resumed_total 1\n",
            "kvpn_manager_engines_expired_total 2\n",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
    }

    #[tokio::test]
    async fn with_a_checked_lease_a_finished_sessions_slots_give_way() {
        let counters = Arc::new(ManagerCounters::default());
        let r = Resumes::<u32>::new(Duration::from_secs(30), 16);
        // Lease A's session parks workers 0 and 1.
        for worker in [0, 1] {
            let a = r
                .attach((ip(2), worker), creds(1, b"A"), true, &counters)
                .await;
            assert!(a.claim.expect("vacant").park(u32::from(worker)));
        }
        // Lease B holds the IP now: both of A's engines go at B's first
        // connection, and B's worker 0 parks and resumes.
        let b = r.attach((ip(2), 0), creds(2, b"B"), true, &counters).await;
        assert!(b.state.is_none());
        assert_eq!(r.parked(), 0, "lease A's engines were dropped");
        assert!(b.claim.expect("B claims the slot").park(10));
        let again = r.attach((ip(2), 0), creds(2, b"B"), true, &counters).await;
        assert_eq!(again.state, Some(10), "B resumes");
        // B's live connection; B's laptop starts a new session (same lease,
        // new resume token) while the old connection still runs: the new
        // one takes the slot, the old one can no longer park.
        let newer = r.attach((ip(2), 0), creds(3, b"B"), true, &counters).await;
        let newer_claim = newer.claim.expect("the new session claims the slot");
        assert!(
            !again.claim.expect("old claim").park(11),
            "the old session cannot park"
        );
        assert!(newer_claim.park(12));
        // A new session of the same lease replaces a parked engine too.
        let newest = r.attach((ip(2), 0), creds(4, b"B"), true, &counters).await;
        assert!(newest.state.is_none() && newest.claim.is_some());
        assert_eq!(r.parked(), 0);
        let text = counters.render_prometheus();
        for line in [
            "kvpn_manager_engines_replaced_total 3\n",
            "kvpn_manager_engines_expired_total 3\n",
            "kvpn_manager_engines_resumed_total 1\n",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
    }

    #[tokio::test]
    async fn resuming_off_never_parks() {
        let counters = Arc::new(ManagerCounters::default());
        let r = Resumes::<u32>::off();
        let a = r.attach((ip(2), 0), creds(1, b""), false, &counters).await;
        assert!(!a.claim.expect("vacant slot").park(7));
        assert_eq!(r.parked(), 0);
        let again = r.attach((ip(2), 0), creds(1, b""), false, &counters).await;
        assert!(again.state.is_none() && again.claim.is_some());
    }
}
