//! The lease service's I/O shell around [`LeaseTable`]: the clock, token
//! randomness, and the store.
//!
//! Stores:
//! - **Lease objects** (in a cluster): one `coordination.k8s.io/v1` Lease per
//!   leased tunnel IP, named after it ([`object_name`]: `kvpn-lease-100-96-0-2`),
//!   the [`LeaseRecord`] as JSON in annotation [`RECORD_ANNOTATION`]. Every
//!   change is a round: LIST the objects, load them into the table, apply the
//!   change, then write only the objects that changed: a new lease is a
//!   *create* (the name is the IP, so the API server refuses a second object
//!   for one IP with 409 AlreadyExists: two replicas can never hand out the
//!   same IP), a renewal an *update* carrying the resourceVersion that was
//!   read, an expiry a *delete* with a resourceVersion precondition. Any 409
//!   (another replica wrote in between) repeats the round on fresh objects.
//!   Expiry times live in the objects, so renewal and expiry survive replica
//!   restarts; each replica renews only the leases of its own data channels.
//!   An object that does not parse (edited by hand) is skipped with a warning
//!   and its IP is never handed out ([`LeaseTable::block`]); nothing else is
//!   lost. docs/scale.md says why Lease objects and who can read them.
//! - **Memory**: the table alone (the manager cannot reach the API server, or
//!   tests). A restarted manager forgets every lease.
//!
//! Migration: a manager of an older version kept every lease as JSON under key
//! [`LEASES_KEY`] of its ConfigMap. [`Leases::in_objects`] moves those into
//! Lease objects once (create-only: an IP someone holds already is left to its
//! holder) and then removes the key (a resourceVersion-checked update).
//!
//! If the API server fails during a data channel's hello or end, the cached
//! table decides (logged); a `Lease` call fails instead (the laptop retries).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::coordination::v1::{Lease as LeaseObject, LeaseSpec};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{DeleteParams, ListParams, ObjectMeta, PostParams, Preconditions};
use rand::RngCore;
use tokio::sync::Mutex;
use tracing::{debug, info, warn};

use crate::lease::{AttachError, LeaseError, LeaseRecord, LeaseTable, client_fingerprint};

/// ConfigMap key where managers before Lease objects kept the leases (a JSON
/// array of [`LeaseRecord`]); read only to migrate them.
pub const LEASES_KEY: &str = "leases.json";

/// Annotation of a Lease object holding its [`LeaseRecord`] as JSON.
pub const RECORD_ANNOTATION: &str = "kvpn.dev/lease";

/// Label value of `app.kubernetes.io/component` on every lease object; with
/// `app.kubernetes.io/name=kvpn-manager` it selects them ([`SELECTOR`]).
pub const COMPONENT: &str = "tunnel-ip-lease";

/// Label selector of the lease objects.
pub const SELECTOR: &str =
    "app.kubernetes.io/name=kvpn-manager,app.kubernetes.io/component=tunnel-ip-lease";

/// Prefix of a lease object's name; the rest is the tunnel IP with dashes.
pub const NAME_PREFIX: &str = "kvpn-lease-";

/// Rounds before giving up on conflicts. Only concurrent replicas conflict (one
/// process serialises itself), but they conflict as a herd: every replica's
/// next new lease is the same lowest free IP, so of N replicas granting at
/// once one wins each round. 8 rounds without a pause failed one of 20
/// concurrent `Lease` calls over 3 replicas in the lab; with
/// [`conflict_pause`] between rounds and 24 rounds, a replica that keeps
/// losing is rare enough to measure as never (tests/tests/kube_scale.rs).
const MAX_ROUNDS: usize = 24;

/// Pause before round `round` (1-based) after a lost write: random in
/// 0..=min(5 ms × 2^round, 80 ms), so racing replicas fall out of step.
fn conflict_pause(round: usize) -> Duration {
    let cap_ms = (5u64 << round.min(4)).min(80);
    Duration::from_millis(rand::rng().next_u64() % (cap_ms + 1))
}

/// The Lease object name of tunnel IP `ip`: `kvpn-lease-100-96-0-2`.
pub fn object_name(ip: Ipv4Addr) -> String {
    let [a, b, c, d] = ip.octets();
    format!("{NAME_PREFIX}{a}-{b}-{c}-{d}")
}

/// The tunnel IP a lease object's name stands for.
pub fn ip_of_name(name: &str) -> Option<Ipv4Addr> {
    let rest = name.strip_prefix(NAME_PREFIX)?;
    let octets: Vec<u8> = rest
        .split('-')
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    let [a, b, c, d] = <[u8; 4]>::try_from(octets).ok()?;
    let ip = Ipv4Addr::new(a, b, c, d);
    (object_name(ip) == name).then_some(ip)
}

/// Why a lease object cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    /// No annotation [`RECORD_ANNOTATION`].
    #[error("has no annotation {RECORD_ANNOTATION}")]
    Missing,
    /// The annotation is not a lease record.
    #[error("annotation {RECORD_ANNOTATION} is not a lease record: {0}")]
    Json(#[from] serde_json::Error),
    /// The record names another IP than the object's name.
    #[error("annotation {RECORD_ANNOTATION} names tunnel IP {found}, the object's name {named}")]
    OtherIp {
        /// The IP of the name.
        named: Ipv4Addr,
        /// The IP of the record.
        found: Ipv4Addr,
    },
}

/// The record stored in lease object `obj` for tunnel IP `ip`.
pub fn parse_object(ip: Ipv4Addr, obj: &LeaseObject) -> Result<LeaseRecord, ObjectError> {
    let text = obj
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(RECORD_ANNOTATION))
        .ok_or(ObjectError::Missing)?;
    let rec: LeaseRecord = serde_json::from_str(text)?;
    if rec.ip != ip {
        return Err(ObjectError::OtherIp {
            named: ip,
            found: rec.ip,
        });
    }
    Ok(rec)
}

/// The lease object for `rec`, written by replica `holder` (None: unknown) with
/// `lease_time`; `resource_version` for an update.
pub fn lease_object(
    rec: &LeaseRecord,
    holder: Option<&str>,
    lease_time: Duration,
    resource_version: Option<String>,
) -> LeaseObject {
    // Cannot fail: plain strings, integers and an address.
    let json = serde_json::to_string(rec).unwrap_or_default();
    LeaseObject {
        metadata: ObjectMeta {
            name: Some(object_name(rec.ip)),
            labels: Some(
                [
                    (
                        "app.kubernetes.io/name".to_owned(),
                        "kvpn-manager".to_owned(),
                    ),
                    (
                        "app.kubernetes.io/component".to_owned(),
                        COMPONENT.to_owned(),
                    ),
                ]
                .into(),
            ),
            annotations: Some([(RECORD_ANNOTATION.to_owned(), json)].into()),
            resource_version,
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: holder.map(str::to_owned),
            lease_duration_seconds: i32::try_from(lease_time.as_secs()).ok(),
            ..LeaseSpec::default()
        }),
    }
}

/// Why the lease store failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The API server answered with an error or could not be reached.
    #[error("{what}: {source}")]
    Kube {
        /// The object or list ("Lease objects in kvpn-system").
        what: String,
        /// The client error.
        #[source]
        source: kube::Error,
    },
    /// Other writers kept winning.
    #[error("{0}: still conflicting with other replicas after {MAX_ROUNDS} rounds")]
    Conflicts(String),
}

/// Why `Lease` failed.
#[derive(Debug, thiserror::Error)]
pub enum LeaseServiceError {
    /// The request was refused.
    #[error(transparent)]
    Lease(#[from] LeaseError),
    /// The store failed.
    #[error("lease store: {0}")]
    Store(#[from] StoreError),
}

enum Store {
    Memory,
    Objects {
        api: Box<Api<LeaseObject>>,
        namespace: String,
        /// This replica (its pod name), written as the objects' holder.
        replica: Option<String>,
    },
}

/// The manager's leases, shared by the gRPC service and the data-channel
/// sessions.
pub struct Leases {
    table: Mutex<LeaseTable>,
    store: Store,
    /// Unreadable lease objects already warned about, by name and
    /// resourceVersion: every round reads them, one warning each is enough
    /// (again when someone edits the object).
    warned: std::sync::Mutex<BTreeSet<(String, String)>>,
}

impl std::fmt::Debug for Leases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let store = match &self.store {
            Store::Memory => "memory".to_owned(),
            Store::Objects { namespace, .. } => {
                format!("leases.coordination.k8s.io in {namespace}")
            }
        };
        f.debug_struct("Leases").field("store", &store).finish()
    }
}

/// Seconds since the Unix epoch.
pub fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A fresh session token: 32 random bytes as 64 hex digits.
pub fn fresh_token() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

/// One stored object: its resourceVersion and record.
type Stored = HashMap<Ipv4Addr, (Option<String>, LeaseRecord)>;

/// One write of a round.
#[derive(Debug, PartialEq, Eq)]
enum Write {
    Create(LeaseRecord),
    Update(Option<String>, LeaseRecord),
    Delete(Ipv4Addr, Option<String>),
}

/// The writes that turn the stored objects into the table's records `after`:
/// deletions first (an expired IP may be granted again in the same round),
/// then creations and updates. `loaded` are the IPs whose records the table
/// took from `stored` (a record it skipped is not its to delete); `stale` are
/// skipped records that have expired (a duplicate client id after two
/// replicas raced), deleted too.
fn writes(
    stored: &Stored,
    loaded: &BTreeSet<Ipv4Addr>,
    after: &[LeaseRecord],
    stale: &[Ipv4Addr],
) -> Vec<Write> {
    let after: BTreeMap<Ipv4Addr, &LeaseRecord> = after.iter().map(|r| (r.ip, r)).collect();
    let mut out = Vec::new();
    let gone: BTreeSet<Ipv4Addr> = loaded
        .iter()
        .filter(|ip| !after.contains_key(ip))
        .chain(stale)
        .copied()
        .collect();
    for ip in &gone {
        let rv = stored.get(ip).and_then(|(rv, _)| rv.clone());
        out.push(Write::Delete(*ip, rv));
    }
    for (ip, rec) in after {
        match stored.get(&ip) {
            Some((rv, old)) if loaded.contains(&ip) && !gone.contains(&ip) => {
                if old != rec {
                    out.push(Write::Update(rv.clone(), rec.clone()));
                }
            }
            // New, or granted again after its stale object's delete above (a
            // record the table skipped and still blocks cannot be in `after`).
            _ => out.push(Write::Create(rec.clone())),
        }
    }
    out
}

impl Leases {
    /// Leases kept in memory only.
    pub fn in_memory(table: LeaseTable) -> Arc<Self> {
        Arc::new(Self {
            table: Mutex::new(table),
            store: Store::Memory,
            warned: std::sync::Mutex::default(),
        })
    }

    /// Leases stored as Lease objects in `namespace` through `client`, written
    /// by `replica` (this pod's name, shown as the objects' holder). First
    /// migrates the leases an older manager kept in ConfigMap `old_configmap`,
    /// then reads the objects once to prove access and load them.
    pub async fn in_objects(
        table: LeaseTable,
        client: kube::Client,
        namespace: &str,
        replica: Option<String>,
        old_configmap: &str,
    ) -> Result<Arc<Self>, StoreError> {
        let api: Api<LeaseObject> = Api::namespaced(client.clone(), namespace);
        let cms: Api<ConfigMap> = Api::namespaced(client, namespace);
        migrate_configmap(
            &cms,
            &api,
            old_configmap,
            table.lease_time(),
            replica.as_deref(),
        )
        .await;
        let leases = Arc::new(Self {
            table: Mutex::new(table),
            store: Store::Objects {
                api: Box::new(api),
                namespace: namespace.to_owned(),
                replica,
            },
            warned: std::sync::Mutex::default(),
        });
        leases.update(|_, _| ()).await?;
        Ok(leases)
    }

    /// Whether the leases survive a manager restart.
    pub fn persistent(&self) -> bool {
        matches!(self.store, Store::Objects { .. })
    }

    /// The pool, manager address and lease time.
    pub async fn table_snapshot(&self) -> LeaseTable {
        self.table.lock().await.clone()
    }

    /// Run `op` on the table under the store's concurrency control. `op` may run
    /// more than once (conflicts), each time on freshly read leases.
    async fn update<T>(
        &self,
        mut op: impl FnMut(&mut LeaseTable, u64) -> T,
    ) -> Result<T, StoreError> {
        let mut table = self.table.lock().await;
        let (api, namespace, replica) = match &self.store {
            Store::Memory => return Ok(op(&mut table, now_s())),
            Store::Objects {
                api,
                namespace,
                replica,
            } => (api, namespace, replica.as_deref()),
        };
        let list_what = || format!("Lease objects ({SELECTOR}) in {namespace}");
        for round in 0..MAX_ROUNDS {
            let list = api
                .list(&ListParams::default().labels(SELECTOR))
                .await
                .map_err(|source| StoreError::Kube {
                    what: list_what(),
                    source,
                })?;
            let mut stored: Stored = HashMap::new();
            let mut unreadable = Vec::new();
            for obj in &list.items {
                let name = obj.metadata.name.as_deref().unwrap_or_default();
                let Some(ip) = ip_of_name(name) else {
                    // Not named after an IP: can never collide with ours.
                    continue;
                };
                match parse_object(ip, obj) {
                    Ok(rec) => {
                        stored.insert(ip, (obj.metadata.resource_version.clone(), rec));
                    }
                    Err(e) => {
                        let key = (
                            name.to_owned(),
                            obj.metadata.resource_version.clone().unwrap_or_default(),
                        );
                        // A poisoned set only costs a repeated warning.
                        let first = self.warned.lock().map_or(true, |mut w| w.insert(key));
                        if first {
                            warn!(object = %format!("{namespace}/{name}"), reason = %e, "lease object unreadable: skipped, its tunnel IP is not handed out (fix: delete it, `kubectl -n {namespace} delete lease.coordination.k8s.io {name}`, and its client leases again)");
                        } else {
                            debug!(object = %name, "lease object still unreadable");
                        }
                        unreadable.push(ip);
                    }
                }
            }
            let now = now_s();
            let skipped = table.replace_records(stored.values().map(|(_, r)| r.clone()).collect());
            let mut stale = Vec::new();
            for rec in &skipped {
                if rec.expires_at <= now && !table.is_active(rec.ip) {
                    stale.push(rec.ip);
                } else {
                    debug!(tunnel_ip = %rec.ip, "stored lease outside the pool or repeating a client id: not handed out until it expires");
                    table.block(rec.ip);
                }
            }
            for ip in unreadable {
                table.block(ip);
            }
            let loaded: BTreeSet<Ipv4Addr> = table.records().iter().map(|r| r.ip).collect();
            let out = op(&mut table, now);
            let plan = writes(&stored, &loaded, &table.records(), &stale);
            let mut conflicted = false;
            for w in plan {
                let (what, result) = match w {
                    Write::Create(rec) => {
                        let obj = lease_object(&rec, replica, table.lease_time(), None);
                        (
                            object_name(rec.ip),
                            api.create(&PostParams::default(), &obj).await.map(|_| ()),
                        )
                    }
                    Write::Update(rv, rec) => {
                        let obj = lease_object(&rec, replica, table.lease_time(), rv);
                        let name = object_name(rec.ip);
                        let r = api.replace(&name, &PostParams::default(), &obj).await;
                        (name, r.map(|_| ()))
                    }
                    Write::Delete(ip, rv) => {
                        let name = object_name(ip);
                        let dp = DeleteParams {
                            preconditions: Some(Preconditions {
                                resource_version: rv,
                                uid: None,
                            }),
                            ..DeleteParams::default()
                        };
                        let r = api.delete(&name, &dp).await.map(|_| ());
                        let r = match r {
                            Err(e) if is_status(&e, 404) => Ok(()),
                            r => r,
                        };
                        (name, r)
                    }
                };
                match result {
                    Ok(()) => {}
                    // 409: AlreadyExists (another replica took the IP) or a stale
                    // resourceVersion; 404: updated an object deleted meanwhile.
                    Err(e) if is_status(&e, 409) || is_status(&e, 404) => {
                        debug!(object = %what, round, error = %e, "lease write lost to another replica; reading again");
                        conflicted = true;
                        break;
                    }
                    Err(source) => {
                        return Err(StoreError::Kube {
                            what: format!("Lease {namespace}/{what}"),
                            source,
                        });
                    }
                }
            }
            if !conflicted {
                return Ok(out);
            }
            tokio::time::sleep(conflict_pause(round + 1)).await;
        }
        Err(StoreError::Conflicts(list_what()))
    }

    /// Like [`Leases::update`], but when the store fails, `op` runs on the
    /// cached table (logged): a data channel must not fail because the API
    /// server blinked.
    async fn update_or_cached<T>(
        &self,
        what: &str,
        mut op: impl FnMut(&mut LeaseTable, u64) -> T,
    ) -> T {
        match self.update(&mut op).await {
            Ok(out) => out,
            Err(e) => {
                warn!(error = %e, "{what}: lease store unavailable, using the cached leases");
                op(&mut *self.table.lock().await, now_s())
            }
        }
    }

    /// The `Lease` RPC: the lease of `client_id`, new or existing.
    pub async fn lease(&self, client_id: &str) -> Result<(LeaseRecord, u64), LeaseServiceError> {
        let token = fresh_token();
        let rec = self
            .update(|t, now| t.lease(client_id, &token, now).map(|r| (r, now)))
            .await??;
        let (rec, now) = rec;
        info!(client = %client_fingerprint(client_id), tunnel_ip = %rec.ip, expires_in_s = LeaseTable::expires_in(&rec, now), "lease granted");
        let expires_in = LeaseTable::expires_in(&rec, now);
        Ok((rec, expires_in))
    }

    /// A hello arrived: check its token and mark the lease in use (renewed
    /// while the data channel is up). Returns the lease's client id.
    pub async fn attach(&self, ip: IpAddr, token: &[u8]) -> Result<String, AttachError> {
        let out = self
            .update_or_cached("hello", |t, now| {
                let id = t.check(ip, token, now)?;
                t.touch(ip, now);
                Ok(id)
            })
            .await;
        if out.is_ok() {
            self.table.lock().await.activate(ip);
        }
        out
    }

    /// A data channel ended: the lease now expires one lease time from now.
    pub async fn detach(&self, ip: IpAddr) {
        self.table.lock().await.deactivate(ip);
        self.update_or_cached("session end", |t, now| t.touch(ip, now))
            .await;
    }

    /// Renew leases with live data channels and drop expired ones (periodic);
    /// returns the tunnel IPs whose leases expired.
    pub async fn maintain(&self) -> Vec<std::net::Ipv4Addr> {
        let (renewed, expired) = self
            .update_or_cached("lease renewal", |t, now| {
                let renewed = t.renew_active(now);
                (renewed, t.expire(now))
            })
            .await;
        for rec in &expired {
            info!(client = %client_fingerprint(&rec.client_id), tunnel_ip = %rec.ip, "lease expired");
        }
        debug!(renewed, expired = expired.len(), "leases maintained");
        expired.iter().map(|r| r.ip).collect()
    }

    /// How often [`Leases::maintain`] should run for `lease_time`: a quarter of
    /// it (a restarted manager then finds renewed leases valid for at least
    /// three quarters of a lease time), at least every second.
    pub fn maintain_interval(lease_time: Duration) -> Duration {
        (lease_time / 4).max(Duration::from_secs(1))
    }
}

/// Moves the leases an older manager kept in ConfigMap `name` (key
/// [`LEASES_KEY`]) into Lease objects, then removes the key. Create-only: an IP
/// that already has an object keeps it (another replica migrated it, or a newer
/// lease). Failures are logged, never fatal: at worst a laptop leases again.
async fn migrate_configmap(
    cms: &Api<ConfigMap>,
    leases: &Api<LeaseObject>,
    name: &str,
    lease_time: Duration,
    replica: Option<&str>,
) {
    let ns = cms.namespace().unwrap_or_default().to_owned();
    for _ in 0..MAX_ROUNDS {
        let mut cm = match cms.get_opt(name).await {
            Ok(Some(cm)) => cm,
            Ok(None) => return,
            Err(e) => {
                warn!(configmap = %format!("{ns}/{name}"), error = %e, "cannot read the ConfigMap of older managers' leases; not migrating them (laptops lease again)");
                return;
            }
        };
        let Some(text) = cm.data.as_mut().and_then(|d| d.remove(LEASES_KEY)) else {
            return;
        };
        let records: Vec<LeaseRecord> = if text.trim().is_empty() {
            Vec::new()
        } else {
            match serde_json::from_str(&text) {
                Ok(r) => r,
                Err(e) => {
                    warn!(configmap = %format!("{ns}/{name}"), error = %e, "key {LEASES_KEY} is not a lease list: left as it is, not migrated (fix: remove the key)");
                    return;
                }
            }
        };
        let now = now_s();
        let (mut moved, mut kept) = (0usize, 0usize);
        for rec in records.iter().filter(|r| r.expires_at > now) {
            let obj = lease_object(rec, replica, lease_time, None);
            match leases.create(&PostParams::default(), &obj).await {
                Ok(_) => moved += 1,
                Err(e) if is_status(&e, 409) => kept += 1,
                Err(e) => {
                    warn!(object = %object_name(rec.ip), error = %e, "cannot migrate a lease into a Lease object; the key {LEASES_KEY} stays for the next start");
                    return;
                }
            }
        }
        match cms.replace(name, &PostParams::default(), &cm).await {
            Ok(_) => {
                info!(configmap = %format!("{ns}/{name}"), moved, already_there = kept, expired = records.len() - moved - kept, "leases of an older manager moved from key {LEASES_KEY} into Lease objects; key removed");
                return;
            }
            Err(e) if is_status(&e, 409) => continue,
            Err(e) => {
                warn!(configmap = %format!("{ns}/{name}"), error = %e, "leases migrated but key {LEASES_KEY} not removed; the next start tries again");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ip: &str, client: &str, expires_at: u64) -> LeaseRecord {
        LeaseRecord {
            client_id: client.into(),
            ip: ip.parse().expect("ip"),
            token: "t".into(),
            expires_at,
        }
    }

    #[test]
    fn object_names_round_trip_and_refuse_lookalikes() {
        let ip: Ipv4Addr = "100.96.0.2".parse().expect("ip");
        assert_eq!(object_name(ip), "kvpn-lease-100-96-0-2");
        assert_eq!(ip_of_name("kvpn-lease-100-96-0-2"), Some(ip));
        for bad in [
            "kvpn-lease-100-96-0",
            "kvpn-lease-100-96-0-2-1",
            "kvpn-lease-100-96-00-2",
            "kvpn-lease-300-96-0-2",
            "kvpn-manager",
            "kvpn-lease-",
        ] {
            assert_eq!(ip_of_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn objects_round_trip_and_garbage_is_an_error() {
        let r = rec("100.96.0.7", "c1", 99);
        let obj = lease_object(&r, Some("kvpn-manager-x"), Duration::from_secs(3600), None);
        assert_eq!(obj.metadata.name.as_deref(), Some("kvpn-lease-100-96-0-7"));
        let spec = obj.spec.clone().expect("spec");
        assert_eq!(spec.holder_identity.as_deref(), Some("kvpn-manager-x"));
        assert_eq!(spec.lease_duration_seconds, Some(3600));
        assert_eq!(parse_object(r.ip, &obj).expect("parses"), r);
        let other: Ipv4Addr = "100.96.0.8".parse().expect("ip");
        assert!(matches!(
            parse_object(other, &obj),
            Err(ObjectError::OtherIp { .. })
        ));
        let mut garbage = obj.clone();
        garbage
            .metadata
            .annotations
            .as_mut()
            .expect("annotations")
            .insert(RECORD_ANNOTATION.into(), "{not json".into());
        assert!(matches!(
            parse_object(r.ip, &garbage),
            Err(ObjectError::Json(_))
        ));
        garbage.metadata.annotations = None;
        assert!(matches!(
            parse_object(r.ip, &garbage),
            Err(ObjectError::Missing)
        ));
    }

    #[test]
    fn writes_delete_first_then_create_and_update_changed_only() {
        let ip = |s: &str| -> Ipv4Addr { s.parse().expect("ip") };
        let mut stored: Stored = HashMap::new();
        let a = rec("100.96.0.2", "a", 10);
        let b = rec("100.96.0.3", "b", 10);
        let dup = rec("100.96.0.4", "a", 5);
        let young_dup = rec("100.96.0.5", "b", 50);
        for (rv, r) in [("1", &a), ("2", &b), ("3", &dup), ("4", &young_dup)] {
            stored.insert(r.ip, (Some(rv.into()), r.clone()));
        }
        let loaded: BTreeSet<Ipv4Addr> = [a.ip, b.ip].into();
        // a expired and its IP went to c; b renewed; dup (a duplicate of a)
        // expired: stale; young_dup is left alone (blocked, not expired).
        let c = rec("100.96.0.2", "c", 20);
        let b2 = rec("100.96.0.3", "b", 30);
        let plan = writes(&stored, &loaded, &[c.clone(), b2.clone()], &[dup.ip]);
        assert_eq!(
            plan,
            vec![
                Write::Delete(dup.ip, Some("3".into())),
                Write::Update(Some("1".into()), c),
                Write::Update(Some("2".into()), b2),
            ]
        );
        // Nothing changed: nothing written, not even the skipped records.
        assert!(writes(&stored, &loaded, &[a.clone(), b.clone()], &[]).is_empty());
        // A new lease is a create; expired ones deletes with their versions.
        let d = rec("100.96.0.9", "d", 40);
        let plan = writes(&stored, &loaded, std::slice::from_ref(&d), &[]);
        assert_eq!(
            plan,
            vec![
                Write::Delete(ip("100.96.0.2"), Some("1".into())),
                Write::Delete(ip("100.96.0.3"), Some("2".into())),
                Write::Create(d),
            ]
        );
        // A stale duplicate's IP granted again in the same round: delete, create.
        let e = rec("100.96.0.4", "e", 60);
        let plan = writes(&stored, &loaded, &[a, b, e.clone()], &[dup.ip]);
        assert_eq!(
            plan,
            vec![Write::Delete(dup.ip, Some("3".into())), Write::Create(e)]
        );
    }
}
