//! The laptop side of leases: the client id the traffic manager knows this user
//! by on a cluster, and the `Lease` call that turns it into a tunnel IP and a
//! session token.
//!
//! I/O: one file per cluster under the user's kvpn config folder
//! (`client-ids/<digest of the API server URL and cluster name>`, 32 random hex
//! digits written once, mode 0600), and a short-lived `pods/portforward` to the
//! manager pod's gRPC port (10802, plain HTTP/2 inside the port-forward; the
//! manager listens on the pod's loopback only).

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kvpn_proto::manager::manager_client::ManagerClient;
use kvpn_proto::manager::{LeaseRequest, LeaseResponse};
use rand::RngCore as _;
use sha2::{Digest as _, Sha256};

use crate::kubeconfig::{self, ActingUser, UserEnv};

/// How long the whole Lease exchange (port-forward, HTTP/2, RPC) may take.
const LEASE_TIMEOUT: Duration = Duration::from_secs(20);

/// The file holding the client id for the cluster at `server` named `cluster`.
pub fn client_id_path(config_dir: &Path, server: &str, cluster: &str) -> PathBuf {
    let digest = Sha256::digest(format!("{server}\n{cluster}").as_bytes());
    let name: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    config_dir.join("client-ids").join(name)
}

fn valid_id(id: &str) -> bool {
    (16..=128).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// The client id stored at `path`, created (32 random hex digits) if missing.
/// Two concurrent connects agree: the file is created exclusively and the loser
/// reads the winner's id.
pub fn load_or_create_client_id(path: &Path, owner: Option<(u32, u32)>) -> Result<String> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(dir, Some(uid), Some(gid))
            .with_context(|| format!("cannot hand {} to uid {uid}", dir.display()))?;
    }
    for _ in 0..3 {
        match std::fs::read_to_string(path) {
            Ok(text) if valid_id(text.trim()) => return Ok(text.trim().to_owned()),
            Ok(text) if text.is_empty() => {
                // Another connect is writing it right now.
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            Ok(_) => {
                anyhow::bail!(
                    "{} does not hold a kvpn client id — delete it to get a new one (and a new tunnel IP)",
                    path.display()
                )
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(anyhow!(e).context(format!("cannot read {}", path.display()))),
        }
        let mut bytes = [0u8; 16];
        rand::rng().fill_bytes(&mut bytes);
        let id: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
        {
            Ok(mut f) => {
                f.write_all(format!("{id}\n").as_bytes())
                    .with_context(|| format!("cannot write {}", path.display()))?;
                if let Some((uid, gid)) = owner {
                    std::os::unix::fs::chown(path, Some(uid), Some(gid))
                        .with_context(|| format!("cannot hand {} to uid {uid}", path.display()))?;
                }
                return Ok(id);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(anyhow!(e).context(format!("cannot create {}", path.display()))),
        }
    }
    Err(anyhow!("cannot settle the client id in {}", path.display()))
}

/// This user's client id for a cluster, created on first use.
pub fn client_id(
    env: &UserEnv,
    acting: &ActingUser,
    server: &str,
    cluster: &str,
) -> Result<String> {
    let dir = kubeconfig::ensure_config_dir(env, acting)
        .context("cannot prepare kvpn's config folder for the client id")?;
    let owner = match acting {
        ActingUser::Sudo(a) => Some((a.uid, a.gid)),
        ActingUser::Current { .. } => None,
    };
    load_or_create_client_id(&client_id_path(&dir, server, cluster), owner)
}

/// This user's client id for a cluster when one was ever made (None otherwise);
/// never creates one.
pub fn existing_client_id(
    env: &UserEnv,
    acting: &ActingUser,
    server: &str,
    cluster: &str,
) -> Option<String> {
    let dir = kubeconfig::config_dir(env, acting)?;
    let text = std::fs::read_to_string(client_id_path(&dir, server, cluster)).ok()?;
    let id = text.trim();
    valid_id(id).then(|| id.to_owned())
}

/// Key of the lease list in the ConfigMap of managers before Lease objects
/// (the manager owns the format: `manager/src/leases.rs` `LEASES_KEY`, a JSON
/// list of records; the CLI only reads the three fields below, for `kvpn
/// uninstall`).
pub const LEASES_KEY: &str = "leases.json";

/// A lease of the traffic manager that has not expired: some laptop connected
/// now, or within the manager's lease time.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct LiveLease {
    pub client_id: String,
    /// The leased tunnel IP.
    pub ip: String,
    /// Expiry, seconds since the Unix epoch.
    pub expires_at: u64,
}

impl LiveLease {
    /// `100.96.0.3 (client 1a2b3c4d…, expires in 3540 s)`.
    pub fn describe(&self, now_s: u64) -> String {
        let short: String = self.client_id.chars().take(8).collect();
        format!(
            "{} (client {short}…, expires in {} s)",
            self.ip,
            self.expires_at.saturating_sub(now_s)
        )
    }
}

/// The leases in `text` (the ConfigMap's [`LEASES_KEY`]) that expire after
/// `now_s` and are not `own_client_id`'s, by IP.
pub fn live_leases_of_others(
    text: &str,
    now_s: u64,
    own_client_id: Option<&str>,
) -> Result<Vec<LiveLease>, serde_json::Error> {
    let mut all: Vec<LiveLease> = serde_json::from_str(text)?;
    all.retain(|l| l.expires_at > now_s && Some(l.client_id.as_str()) != own_client_id);
    all.sort_by(|a, b| a.ip.cmp(&b.ip));
    Ok(all)
}

/// Label selector of the manager's lease objects (`coordination.k8s.io/v1`
/// Lease, one per tunnel IP; the manager owns the format:
/// `manager/src/leases.rs` `SELECTOR`).
pub const LEASE_OBJECTS_SELECTOR: &str =
    "app.kubernetes.io/name=kvpn-manager,app.kubernetes.io/component=tunnel-ip-lease";

/// Annotation of a lease object holding its record as JSON (the manager's
/// `RECORD_ANNOTATION`).
pub const LEASE_RECORD_ANNOTATION: &str = "kvpn.dev/lease";

/// The live leases of other clients on the traffic manager in `namespace`:
/// its Lease objects, and the ConfigMap key an older manager kept them in;
/// empty when there is no manager or no lease. An unreadable lease object is
/// skipped (the manager warns about it).
pub async fn live_leases(
    client: &kube::Client,
    namespace: &str,
    now_s: u64,
    own_client_id: Option<&str>,
) -> Result<Vec<LiveLease>> {
    use k8s_openapi::api::coordination::v1::Lease;
    use k8s_openapi::api::core::v1::ConfigMap;
    let name = crate::install::objects::MANAGER;
    let objects: Api<Lease> = Api::namespaced(client.clone(), namespace);
    let listed = objects
        .list(&kube::api::ListParams::default().labels(LEASE_OBJECTS_SELECTOR))
        .await
        .with_context(|| {
            format!("cannot list the lease objects (leases.coordination.k8s.io) in {namespace}")
        })?;
    let mut all: Vec<LiveLease> = listed
        .items
        .iter()
        .filter_map(|o| {
            o.metadata
                .annotations
                .as_ref()?
                .get(LEASE_RECORD_ANNOTATION)
        })
        .filter_map(|text| serde_json::from_str::<LiveLease>(text).ok())
        .collect();
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let cm = api
        .get_opt(name)
        .await
        .with_context(|| format!("cannot read ConfigMap {namespace}/{name} (the leases)"))?;
    if let Some(text) = cm.as_ref().and_then(|c| c.data.as_ref()?.get(LEASES_KEY)) {
        let old: Vec<LiveLease> = serde_json::from_str(text).with_context(|| {
            format!("key {LEASES_KEY} of ConfigMap {namespace}/{name} is not a lease list")
        })?;
        all.extend(old);
    }
    all.retain(|l| l.expires_at > now_s && Some(l.client_id.as_str()) != own_client_id);
    all.sort_by(|a, b| a.ip.cmp(&b.ip));
    all.dedup_by(|a, b| a.ip == b.ip);
    Ok(all)
}

/// One HTTP/2 (gRPC) connection to `pod`'s `port` over one `pods/portforward`
/// stream. Keep the [`kube::api::Portforwarder`] while using the channel; abort
/// it when done. HTTP/2 keepalive pings (every 10 s, 5 s to answer) find a
/// port-forward that died silently.
pub async fn grpc_channel(
    api: &Api<Pod>,
    pod: &str,
    port: u16,
) -> Result<(kube::api::Portforwarder, tonic::transport::Channel)> {
    let mut pf = api
        .portforward(pod, &[port])
        .await
        .with_context(|| format!("port-forward to pod {pod} port {port} failed"))?;
    let stream = pf
        .take_stream(port)
        .ok_or_else(|| anyhow!("port-forward to {pod}: no stream for port {port}"))?;
    // One HTTP/2 connection over the one forwarded stream.
    let slot = Arc::new(Mutex::new(Some(stream)));
    let channel = tonic::transport::Endpoint::from_static("http://kvpn-manager.grpc")
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true)
        .connect_with_connector(tower::service_fn(move |_| {
            let stream = slot.lock().ok().and_then(|mut s| s.take());
            async move {
                stream.map(TokioIo::new).ok_or_else(|| {
                    std::io::Error::other("the port-forward stream was already used")
                })
            }
        }))
        .await
        .with_context(|| format!("cannot open HTTP/2 to pod {pod} port {port}"))?;
    Ok((pf, channel))
}

/// Call `Lease` on the manager pod `pod` (namespace `namespace`) through a
/// port-forward to its gRPC `port`.
pub async fn lease(
    client: &kube::Client,
    namespace: &str,
    pod: &str,
    port: u16,
    client_id: &str,
) -> Result<LeaseResponse> {
    let exchange = async {
        let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
        let (pf, channel) = grpc_channel(&api, pod, port).await?;
        let response = ManagerClient::new(channel)
            .lease(LeaseRequest {
                client_id: client_id.to_owned(),
            })
            .await
            .map_err(|s| anyhow!("{}: {}", s.code(), s.message()))
            .context("the traffic manager refused the lease")?
            .into_inner();
        pf.abort();
        anyhow::Ok(response)
    };
    tokio::time::timeout(LEASE_TIMEOUT, exchange)
        .await
        .map_err(|_| {
            anyhow!(
                "no lease from pod {pod} port {port} within {} s — is the traffic manager running with --leases?",
                LEASE_TIMEOUT.as_secs()
            )
        })?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_leases_leave_out_expired_and_own() {
        let text = r#"[
            {"client_id":"mine0000000000000000","ip":"100.96.0.2","token":"t","expires_at":2000},
            {"client_id":"other111111111111111","ip":"100.96.0.4","token":"t","expires_at":2000},
            {"client_id":"gone2222222222222222","ip":"100.96.0.3","token":"t","expires_at":999},
            {"client_id":"other333333333333333","ip":"100.96.0.1","token":"t","expires_at":1500}
        ]"#;
        let live = live_leases_of_others(text, 1000, Some("mine0000000000000000")).expect("parse");
        let ips: Vec<&str> = live.iter().map(|l| l.ip.as_str()).collect();
        assert_eq!(ips, ["100.96.0.1", "100.96.0.4"]);
        assert_eq!(
            live[1].describe(1000),
            "100.96.0.4 (client other111…, expires in 1000 s)"
        );
        let all = live_leases_of_others(text, 1000, None).expect("parse");
        assert_eq!(all.len(), 3, "without an own id every live lease counts");
        assert!(live_leases_of_others("{", 0, None).is_err());
    }

    #[test]
    fn client_id_is_created_once_and_per_cluster() {
        let dir = std::env::temp_dir().join(format!("kvpn-client-id-{}", std::process::id()));
        let a = client_id_path(&dir, "https://172.31.255.1:6443", "lab");
        let b = client_id_path(&dir, "https://172.31.255.1:6443", "other");
        assert_ne!(a, b);
        let id = load_or_create_client_id(&a, None).expect("created");
        assert_eq!(id.len(), 32);
        assert_eq!(load_or_create_client_id(&a, None).expect("read"), id);
        let other = load_or_create_client_id(&b, None).expect("created");
        assert_ne!(other, id);
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&a).expect("meta").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::write(&a, "not an id!\n").expect("write");
        assert!(load_or_create_client_id(&a, None).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
