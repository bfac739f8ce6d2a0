//! The lease service's I/O shell around [`LeaseTable`]: the clock, token
//! randomness, and the store.
//!
//! Stores:
//! - **ConfigMap** (in a cluster): the leases are JSON under key [`LEASES_KEY`]
//!   of the manager's ConfigMap. Every change is a read-modify-write: GET the
//!   ConfigMap, load its leases into the table, apply the change, PUT it back
//!   with the resourceVersion that was read. A 409 Conflict (another manager pod
//!   wrote in between, e.g. during a rollout) repeats the round, so two writers
//!   never hand out the same IP. Within one process a mutex serialises rounds.
//! - **Memory**: the table alone (the manager cannot reach the API server, or
//!   tests). A restarted manager forgets every lease.
//!
//! If the API server fails during a data channel's hello or end, the cached
//! table decides (logged); a `Lease` call fails instead (the laptop retries).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::PostParams;
use rand::RngCore;
use tokio::sync::Mutex;
use tracing::{debug, info, warn};

use crate::lease::{AttachError, LeaseError, LeaseRecord, LeaseTable, client_fingerprint};

/// ConfigMap key holding the leases (a JSON array of [`LeaseRecord`]).
pub const LEASES_KEY: &str = "leases.json";

/// Read-modify-write rounds before giving up on conflicts. Only concurrent
/// manager pods conflict (one process serialises itself), so a few suffice.
const MAX_ROUNDS: usize = 8;

/// Why the lease store failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The API server answered with an error or could not be reached.
    #[error("ConfigMap {name}: {source}")]
    Kube {
        /// The ConfigMap.
        name: String,
        /// The client error.
        #[source]
        source: kube::Error,
    },
    /// Other writers kept winning.
    #[error("ConfigMap {0}: still conflicting after {MAX_ROUNDS} read-modify-write rounds")]
    Conflicts(String),
    /// The stored leases are not valid JSON.
    #[error("ConfigMap {name} key {LEASES_KEY} is not a JSON lease list: {source}")]
    Corrupt {
        /// The ConfigMap.
        name: String,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
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
    ConfigMap {
        api: Box<Api<ConfigMap>>,
        name: String,
    },
}

/// The manager's leases, shared by the gRPC service and the data-channel
/// sessions.
pub struct Leases {
    table: Mutex<LeaseTable>,
    store: Store,
}

impl std::fmt::Debug for Leases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let store = match &self.store {
            Store::Memory => "memory".to_owned(),
            Store::ConfigMap { name, .. } => format!("configmap/{name}"),
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

fn parse_records(cm: &ConfigMap, name: &str) -> Result<Vec<LeaseRecord>, StoreError> {
    match cm.data.as_ref().and_then(|d| d.get(LEASES_KEY)) {
        None => Ok(Vec::new()),
        Some(text) if text.trim().is_empty() => Ok(Vec::new()),
        Some(text) => serde_json::from_str(text).map_err(|source| StoreError::Corrupt {
            name: name.to_owned(),
            source,
        }),
    }
}

fn encode_records(records: &[LeaseRecord]) -> String {
    // Cannot fail: plain strings, integers and addresses.
    serde_json::to_string(records).unwrap_or_else(|_| "[]".to_owned())
}

impl Leases {
    /// Leases kept in memory only.
    pub fn in_memory(table: LeaseTable) -> Arc<Self> {
        Arc::new(Self {
            table: Mutex::new(table),
            store: Store::Memory,
        })
    }

    /// Leases stored in ConfigMap `name` through `client`; reads it once to
    /// prove access and load the existing leases.
    pub async fn in_configmap(
        table: LeaseTable,
        client: kube::Client,
        namespace: &str,
        name: &str,
    ) -> Result<Arc<Self>, StoreError> {
        let api: Api<ConfigMap> = Api::namespaced(client, namespace);
        let leases = Arc::new(Self {
            table: Mutex::new(table),
            store: Store::ConfigMap {
                api: Box::new(api),
                name: name.to_owned(),
            },
        });
        leases.update(|_, _| ()).await?;
        Ok(leases)
    }

    /// Whether the leases survive a manager restart.
    pub fn persistent(&self) -> bool {
        matches!(self.store, Store::ConfigMap { .. })
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
        let (api, name) = match &self.store {
            Store::Memory => return Ok(op(&mut table, now_s())),
            Store::ConfigMap { api, name } => (api, name),
        };
        let kube_err = |source| StoreError::Kube {
            name: name.clone(),
            source,
        };
        for round in 0..MAX_ROUNDS {
            let mut cm = api.get(name).await.map_err(kube_err)?;
            let records = parse_records(&cm, name)?;
            let before = encode_records(&records);
            let skipped = table.replace_records(records);
            if skipped > 0 {
                warn!(configmap = %name, skipped, "stored leases outside the pool or duplicated were dropped");
            }
            let out = op(&mut table, now_s());
            let after = encode_records(&table.records());
            if after == before {
                return Ok(out);
            }
            cm.data
                .get_or_insert_with(Default::default)
                .insert(LEASES_KEY.to_owned(), after);
            match api.replace(name, &PostParams::default(), &cm).await {
                Ok(_) => return Ok(out),
                Err(kube::Error::Api(status)) if status.code == 409 => {
                    debug!(configmap = %name, round, "lease write conflicted; reading again");
                }
                Err(e) => return Err(kube_err(e)),
            }
        }
        Err(StoreError::Conflicts(name.clone()))
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
