//! Installing, upgrading and removing the traffic manager in the cluster.
//!
//! [`ensure_manager`] makes sure the manager's objects ([`objects`]) exist at this
//! kvpn's version in the manager namespace and waits for a ready manager pod;
//! [`uninstall`] deletes every object kvpn created and waits until they are gone.
//! Each step is reported through a [`Progress`] sink, like KubeVPN's output
//! (`Creating Deployment kvpn-manager…`, then the pod's phase and container
//! reasons while waiting).
//!
//! Rules (and why):
//! - Writes are server-side apply with field manager `kvpn`, forced: kvpn owns these
//!   objects, and a forced apply takes back fields someone edited by hand.
//! - Each object carries the owner annotation `kvpn.dev/version`. An object is
//!   (re)applied when it is missing or written by an older (or unparsable) version;
//!   one written by this or a newer kvpn is left alone. So a second `connect` with
//!   the same version writes nothing, an older manager is upgraded in place (its
//!   pod template changes, the Deployment rolls), and a newer one is not downgraded.
//! - The Deployment is also re-applied when its pod template differs from ours at
//!   the same version (another `--image`, a new certificate).
//! - The TLS Secret is generated only when missing or no longer valid for the
//!   Service (e.g. a new ClusterIP), so upgrades keep the certificate clients pinned.
//! - The Namespace is created only when it does not exist. A user who may not read
//!   namespaces (403) is assumed to install into an existing one.
//!
//! I/O: the Kubernetes API through the given `kube::Client` only. The decisions
//! about pods live in the pure [`wait`] core, certificate work in [`certs`].

pub mod certs;
pub mod image;
pub mod node_agent;
pub mod objects;
pub mod wait;

use std::fmt::Debug;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::{debug, info};

pub use self::objects::SourcePolicy;
use self::objects::{MANAGER, Spec, TLS_SECRET, compare_versions, version_of};
use self::wait::{ReadyWait, Verdict, WaitConfig, WaitFailure};

/// This kvpn's version: the owner annotation it writes and the manager it installs.
pub const KVPN_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Default of `--manager-namespace`.
pub const DEFAULT_NAMESPACE: &str = "kvpn-system";

/// How often the manager's pods are listed while waiting. Pod status changes come
/// from the kubelet's sync (about 1 s apart); polling at half that shows them
/// promptly at two cheap list requests a second.
const POLL_INTERVAL: Duration = Duration::from_millis(500);

/// Bound for [`uninstall`]'s wait until everything is gone (pods get their grace
/// period, the namespace controller empties a namespace in a few seconds).
pub const UNINSTALL_TIMEOUT: Duration = Duration::from_secs(120);

/// How long an install waits for the node agent's pods (`preserve`): pulling
/// the image on each node plus a start.
const NODE_AGENT_WAIT: Duration = Duration::from_secs(90);

/// How long an install waits for any DaemonSet controller to take up the
/// node agent's DaemonSet (its status's observedGeneration) before it goes on
/// without it: a controller answers within a second.
const NODE_AGENT_UNOBSERVED: Duration = Duration::from_secs(5);

pub use self::image::default_image;

/// What to install where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstallOptions {
    /// `--manager-namespace`.
    pub namespace: String,
    /// `--image`.
    pub image: String,
    /// The version written into `kvpn.dev/version` (this kvpn's, except in tests).
    pub version: String,
    /// Bounds of the wait for a ready pod.
    pub wait: WaitConfig,
    /// `--source-policy` (snat / preserve / ebpf-snat).
    pub source_policy: SourcePolicy,
    /// No `--source-policy` was given: an installed manager keeps the policy it
    /// runs with (`source_policy` applies only to a new install).
    pub keep_installed_policy: bool,
    /// No image was asked for (flag, `KVPN_IMAGE`, settings file): an installed
    /// manager keeps its image ([`image::remembered`]); `image` is for a new install.
    pub keep_installed_image: bool,
    /// `--image-pull-secret` names (Secrets in the manager namespace).
    pub image_pull_secrets: Vec<String>,
    /// None asked: an installed manager keeps its pull secrets.
    pub keep_installed_pull_secrets: bool,
    /// `--image-pull-policy`.
    pub image_pull_policy: Option<String>,
    /// None asked: an installed manager keeps its pull policy.
    pub keep_installed_pull_policy: bool,
    /// `--replicas` (already validated, 1..=[`objects::MAX_REPLICAS`]). None: an
    /// installed manager keeps the replica count its Deployment has now, whoever
    /// set it (kvpn, `kubectl scale`, an autoscaler); a new install gets 1.
    pub replicas: Option<i32>,
}

impl Default for InstallOptions {
    /// Namespace `kvpn-system`, image `ghcr.io/kvpn/manager:<this version>`.
    fn default() -> Self {
        InstallOptions {
            namespace: DEFAULT_NAMESPACE.to_owned(),
            image: default_image(KVPN_VERSION),
            version: KVPN_VERSION.to_owned(),
            wait: WaitConfig::default(),
            source_policy: SourcePolicy::Snat,
            keep_installed_policy: false,
            keep_installed_image: false,
            image_pull_secrets: Vec::new(),
            keep_installed_pull_secrets: false,
            image_pull_policy: None,
            keep_installed_pull_policy: false,
            replicas: None,
        }
    }
}

/// What [`ensure_manager`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// There was no manager Deployment; kvpn created it.
    Installed,
    /// A manager of an older (or unknown) version was upgraded in place.
    Upgraded { from: Option<String> },
    /// Same version, different pod template (image or certificate): re-applied.
    Updated,
    /// The manager was already at this version; nothing was written.
    AlreadyInstalled,
    /// A newer kvpn installed the manager; it was left as it is.
    NewerInstalled { version: String },
}

/// The ready manager a client connects to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManagerInfo {
    pub namespace: String,
    /// The version of the running manager (its Deployment's owner annotation).
    pub version: String,
    pub image: String,
    /// The ready pod (target of the port-forward) and its pod IP.
    pub pod_name: String,
    pub pod_ip: IpAddr,
    /// The Service and its ClusterIP.
    pub service: String,
    pub cluster_ip: Option<IpAddr>,
    pub data_port: u16,
    pub grpc_port: u16,
    /// The running manager's `--source-policy` (from its Deployment).
    pub source_policy: SourcePolicy,
    /// The Deployment's `spec.replicas`.
    pub replicas: i32,
    /// The CA (PEM) that signed the manager's serving certificate.
    pub ca_pem: String,
    /// The DNS name the serving certificate is verified against.
    pub server_name: String,
    pub outcome: Outcome,
}

/// One line of progress for the user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProgressEvent {
    /// A step starts: "Creating Deployment kvpn-manager".
    Step(String),
    /// A detail under the current step: a pod's state while waiting.
    Detail(String),
    /// Something finished: "Traffic manager ready: pod …".
    Done(String),
    /// Something the user should know but that does not stop kvpn.
    Warning(String),
}

impl std::fmt::Display for ProgressEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProgressEvent::Step(s) => write!(f, "{s}…"),
            ProgressEvent::Detail(s) => write!(f, "  {s}"),
            ProgressEvent::Done(s) => write!(f, "{s}"),
            ProgressEvent::Warning(s) => write!(f, "warning: {s}"),
        }
    }
}

/// Where progress goes: the CLI prints it, tests record it.
pub trait Progress: Send + Sync {
    fn report(&self, event: ProgressEvent);
}

impl<F: Fn(ProgressEvent) + Send + Sync> Progress for F {
    fn report(&self, event: ProgressEvent) {
        self(event);
    }
}

/// Progress that is only logged (debug level).
#[derive(Debug, Default, Clone, Copy)]
pub struct Quiet;

impl Progress for Quiet {
    fn report(&self, event: ProgressEvent) {
        debug!(%event, "install progress");
    }
}

/// Progress kept in memory (tests, or a daemon forwarding it later).
#[derive(Debug, Default)]
pub struct Recorder(Mutex<Vec<ProgressEvent>>);

impl Recorder {
    pub fn events(&self) -> Vec<ProgressEvent> {
        self.0.lock().map(|e| e.clone()).unwrap_or_default()
    }

    /// The events as the CLI would print them.
    pub fn lines(&self) -> Vec<String> {
        self.events().iter().map(ToString::to_string).collect()
    }
}

impl Progress for Recorder {
    fn report(&self, event: ProgressEvent) {
        if let Ok(mut e) = self.0.lock() {
            e.push(event);
        }
    }
}

/// Errors of install, upgrade and uninstall.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "not allowed to {verb} {object}: {message} — the kubeconfig's user needs `{verb}` on \
         {resource} to manage the traffic manager; ask a cluster admin for it, or to install \
         the manager once with their credentials"
    )]
    Forbidden {
        verb: &'static str,
        object: String,
        resource: String,
        message: String,
    },
    #[error("cannot {verb} {object}: {source}")]
    Kube {
        verb: &'static str,
        object: String,
        #[source]
        source: kube::Error,
    },
    #[error("generating the traffic manager's TLS certificate: {0}")]
    Cert(#[from] rcgen::Error),
    #[error("traffic manager cannot start: {what}: {reason}: {message} — {hint}")]
    CannotStart {
        /// "pod kvpn-manager-…" or "Deployment kvpn-manager".
        what: String,
        reason: String,
        message: String,
        hint: String,
    },
    #[error("cannot render the manager's objects: {0}")]
    Manifest(String),
    #[error(
        "no traffic manager installed in {namespace} (--no-install): install it with \
         `kvpn install --dry-run -o yaml --manager-namespace {namespace} | kubectl apply -f -` \
         (someone allowed to create its objects), or connect without --no-install"
    )]
    NotInstalled { namespace: String, version: String },
    #[error(
        "the traffic manager in {namespace} is v{installed}, this kvpn needs v{ours} (--no-install writes nothing): \
         apply this kvpn's manifests (`kvpn install --dry-run -o yaml --manager-namespace {namespace} | kubectl apply -f -`), \
         or use the kvpn that matches it"
    )]
    OtherVersion {
        namespace: String,
        installed: String,
        ours: String,
    },
    #[error("traffic manager in {namespace} not ready after {}s: {last}", .after.as_secs())]
    NotReady {
        namespace: String,
        after: Duration,
        last: String,
    },
    #[error("Secret {namespace}/{TLS_SECRET} is unusable: {why}")]
    BadSecret { namespace: String, why: String },
    #[error(
        "Secret {namespace}/{TLS_SECRET} changed under kvpn {rounds} times in a row (last: \
         {last}) — other kvpn clients disagree about the Service; retry, or delete the Secret"
    )]
    SecretRace {
        namespace: String,
        rounds: usize,
        last: String,
    },
    #[error("{object} still exists {}s after deleting it", .after.as_secs())]
    DeleteTimeout { object: String, after: Duration },
    #[error(
        "the node agent of source policy preserve (DaemonSet {namespace}/kvpn-node-agent) has \
         {ready} of {desired} pods ready after {} s — it routes the tunnel pool to the manager \
         on every node; see `kubectl -n {namespace} describe daemonset kvpn-node-agent` and its \
         pods' logs (it needs host network and CAP_NET_ADMIN: a policy forbidding those rules \
         preserve out; use --source-policy snat or ebpf-snat)",
        .after.as_secs()
    )]
    NodeAgentNotReady {
        namespace: String,
        ready: i32,
        desired: i32,
        after: Duration,
    },
}

/// "Deployment kvpn-system/kvpn-manager" or "ClusterRole kvpn-manager-x".
fn object_name<K: k8s_openapi::Resource>(namespace: Option<&str>, name: &str) -> String {
    match namespace {
        Some(ns) => format!("{} {ns}/{name}", K::KIND),
        None => format!("{} {name}", K::KIND),
    }
}

fn api_error<K: k8s_openapi::Resource>(
    verb: &'static str,
    namespace: Option<&str>,
    name: &str,
) -> impl FnOnce(kube::Error) -> Error {
    let object = object_name::<K>(namespace, name);
    move |source| match source {
        kube::Error::Api(s) if s.code == 403 => Error::Forbidden {
            verb,
            object,
            resource: if K::GROUP.is_empty() {
                K::URL_PATH_SEGMENT.to_owned()
            } else {
                format!("{}.{}", K::URL_PATH_SEGMENT, K::GROUP)
            },
            message: s.message,
        },
        source => Error::Kube {
            verb,
            object,
            source,
        },
    }
}

fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

/// A kind kvpn applies: k8s-openapi type usable with `Api`.
trait Kind:
    kube::Resource<DynamicType = ()>
    + k8s_openapi::Resource
    + Clone
    + Debug
    + Serialize
    + DeserializeOwned
    + Send
    + Sync
    + 'static
{
}

impl<K> Kind for K where
    K: kube::Resource<DynamicType = ()>
        + k8s_openapi::Resource
        + Clone
        + Debug
        + Serialize
        + DeserializeOwned
        + Send
        + Sync
        + 'static
{
}

impl Spec {
    /// The objects' parameters as `opts` ask, before an installed manager's
    /// settings are kept.
    fn of(opts: &InstallOptions) -> Spec {
        Spec {
            namespace: opts.namespace.clone(),
            image: opts.image.clone(),
            version: opts.version.clone(),
            source_policy: opts.source_policy,
            image_pull_secrets: opts.image_pull_secrets.clone(),
            image_pull_policy: opts.image_pull_policy.clone(),
            replicas: opts.replicas.unwrap_or(1),
        }
    }
}

/// What happened to one object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Created,
    Updated,
    Kept,
}

/// The install shell: one manager namespace, one client.
struct Installer<'a> {
    client: &'a kube::Client,
    spec: Spec,
    progress: &'a dyn Progress,
    /// What an installed manager keeps ([`InstallOptions`]'s `keep_installed_*`).
    keep: Keep,
}

/// Which settings an installed manager keeps when nobody asked for others.
#[derive(Debug, Clone, Copy, Default)]
struct Keep {
    policy: bool,
    image: bool,
    pull_secrets: bool,
    pull_policy: bool,
    replicas: bool,
}

impl Keep {
    fn of(opts: &InstallOptions) -> Keep {
        Keep {
            policy: opts.keep_installed_policy,
            image: opts.keep_installed_image,
            pull_secrets: opts.keep_installed_pull_secrets,
            pull_policy: opts.keep_installed_pull_policy,
            replicas: opts.replicas.is_none(),
        }
    }
}

impl Installer<'_> {
    fn ns(&self) -> &str {
        &self.spec.namespace
    }

    fn namespaced<K: Kind + kube::Resource<Scope = NamespaceResourceScope>>(&self) -> Api<K> {
        Api::namespaced(self.client.clone(), self.ns())
    }

    /// One server-side apply; a 409 is returned as is (a resourceVersion
    /// precondition in `obj` failed, or another writer created it first).
    async fn apply_once<K: Kind>(
        &self,
        api: &Api<K>,
        namespace: Option<&str>,
        obj: &K,
    ) -> Result<K, Error> {
        let name = obj.meta().name.clone().unwrap_or_default();
        let pp = PatchParams::apply(objects::FIELD_MANAGER).force();
        api.patch(&name, &pp, &Patch::Apply(obj))
            .await
            .map_err(api_error::<K>("patch", namespace, &name))
    }

    /// Server-side apply, retried on 409: when two kvpn clients apply a missing
    /// object at once, the apiserver turns both into creates and the second gets
    /// "already exists" (seen here with 6 parallel installs); applying again is
    /// an ordinary, idempotent update.
    async fn apply<K: Kind>(
        &self,
        api: &Api<K>,
        namespace: Option<&str>,
        obj: &K,
    ) -> Result<K, Error> {
        const ATTEMPTS: u32 = 4;
        let mut attempt = 1;
        loop {
            match self.apply_once(api, namespace, obj).await {
                Err(Error::Kube { source, .. })
                    if attempt < ATTEMPTS && is_status(&source, 409) =>
                {
                    debug!(error = %source, attempt, "apply raced with another writer; applying again");
                    tokio::time::sleep(Duration::from_millis(50 * u64::from(attempt))).await;
                    attempt += 1;
                }
                r => return r,
            }
        }
    }

    /// Applies `desired` when missing or written by an older kvpn (see the module docs).
    async fn ensure<K: Kind>(
        &self,
        api: &Api<K>,
        namespace: Option<&str>,
        desired: &K,
    ) -> Result<(K, Action), Error> {
        let name = desired.meta().name.clone().unwrap_or_default();
        let existing = api
            .get_opt(&name)
            .await
            .map_err(api_error::<K>("get", namespace, &name))?;
        let action = match &existing {
            None => Action::Created,
            Some(e) => {
                match version_of(e.meta()).and_then(|v| compare_versions(v, &self.spec.version)) {
                    Some(std::cmp::Ordering::Less) | None => Action::Updated,
                    Some(_) => Action::Kept,
                }
            }
        };
        match (action, existing) {
            (Action::Kept, Some(e)) => Ok((e, Action::Kept)),
            (action, _) => {
                let verb = if action == Action::Created {
                    "Creating"
                } else {
                    "Updating"
                };
                self.progress
                    .report(ProgressEvent::Step(format!("{verb} {} {name}", K::KIND)));
                Ok((self.apply(api, namespace, desired).await?, action))
            }
        }
    }

    async fn ensure_namespace(&self) -> Result<(), Error> {
        let api: Api<Namespace> = Api::all(self.client.clone());
        match api.get_opt(self.ns()).await {
            Ok(Some(_)) => Ok(()),
            Ok(None) => {
                self.progress.report(ProgressEvent::Step(format!(
                    "Creating Namespace {}",
                    self.ns()
                )));
                self.apply(&api, None, &objects::namespace(&self.spec))
                    .await
                    .map(drop)
            }
            Err(e) if is_status(&e, 403) => {
                debug!(
                    namespace = self.ns(),
                    "may not read namespaces; assuming it exists"
                );
                Ok(())
            }
            Err(e) => Err(api_error::<Namespace>("get", None, self.ns())(e)),
        }
    }

    /// The TLS material: the stored Secret's when it is valid for the Service,
    /// else new (and written).
    ///
    /// Parallel connects must agree on one certificate (each returns the CA it will
    /// trust), so writes are conditional: a new Secret is *created* (not applied;
    /// the loser of a race gets 409 AlreadyExists), and a replacement is applied
    /// with the old resourceVersion as a precondition (409 Conflict). After a lost
    /// race the Secret is read again and checked like any other.
    async fn ensure_secret(&self, cluster_ip: Option<IpAddr>) -> Result<certs::TlsMaterial, Error> {
        /// Rounds of read-check-write; each lost race means another kvpn wrote a
        /// Secret that the next round accepts, so two suffice unless the writers
        /// disagree about the ClusterIP.
        const ROUNDS: usize = 4;
        let api: Api<Secret> = self.namespaced();
        let ns = Some(self.ns());
        let ips: Vec<IpAddr> = cluster_ip.into_iter().collect();
        let mut last_race = None;
        for _ in 0..ROUNDS {
            let existing = api
                .get_opt(TLS_SECRET)
                .await
                .map_err(api_error::<Secret>("get", ns, TLS_SECRET))?;
            let valid = |s: &Secret| {
                certs::from_secret(s).and_then(|m| certs::check(&m, self.ns(), &ips).map(|()| m))
            };
            let replace = match &existing {
                Some(s) => match valid(s) {
                    Ok(m) => return Ok(m),
                    Err(why) => Some((why, s.metadata.resource_version.clone())),
                },
                None => None,
            };
            let m = certs::generate(self.ns(), cluster_ip)?;
            let mut secret = objects::tls_secret(&self.spec, &m.ca_pem, &m.cert_pem, &m.key_pem);
            let written = match replace {
                Some((why, resource_version)) => {
                    self.progress.report(ProgressEvent::Step(format!(
                        "Replacing Secret {TLS_SECRET} ({why})"
                    )));
                    secret.metadata.resource_version = resource_version;
                    self.apply_once(&api, ns, &secret).await
                }
                None => {
                    self.progress
                        .report(ProgressEvent::Step(format!("Creating Secret {TLS_SECRET}")));
                    let pp = PostParams {
                        field_manager: Some(objects::FIELD_MANAGER.to_owned()),
                        ..PostParams::default()
                    };
                    api.create(&pp, &secret)
                        .await
                        .map_err(api_error::<Secret>("create", ns, TLS_SECRET))
                }
            };
            match written {
                // Read back what the apiserver stored, so the client trusts exactly it.
                Ok(w) => {
                    return valid(&w).map_err(|why| Error::BadSecret {
                        namespace: self.ns().to_owned(),
                        why,
                    });
                }
                Err(Error::Kube { source, .. }) if is_status(&source, 409) => {
                    debug!(error = %source, "another kvpn wrote the TLS Secret first; reading it");
                    last_race = Some(source);
                }
                Err(e) => return Err(e),
            }
        }
        Err(Error::SecretRace {
            namespace: self.ns().to_owned(),
            rounds: ROUNDS,
            last: last_race.map(|e| e.to_string()).unwrap_or_default(),
        })
    }

    async fn run(mut self, wait_config: WaitConfig) -> Result<ManagerInfo, Error> {
        let ns = self.ns().to_owned();
        let ours = self.spec.version.clone();
        let deployments: Api<Deployment> = self.namespaced();
        let existing = deployments
            .get_opt(MANAGER)
            .await
            .map_err(api_error::<Deployment>("get", Some(&ns), MANAGER))?;
        if let Some(d) = existing.as_ref() {
            self.keep_installed_settings(d);
        }
        let installed = existing
            .as_ref()
            .map(|d| version_of(&d.metadata).map(str::to_owned));
        let mut outcome = match &installed {
            None => {
                self.progress.report(ProgressEvent::Step(format!(
                    "Installing traffic manager v{ours} into {ns}"
                )));
                Outcome::Installed
            }
            Some(v) => match v.as_deref().and_then(|v| compare_versions(v, &ours)) {
                Some(std::cmp::Ordering::Equal) => Outcome::AlreadyInstalled,
                Some(std::cmp::Ordering::Greater) => Outcome::NewerInstalled {
                    version: v.clone().unwrap_or_default(),
                },
                _ => {
                    self.progress.report(ProgressEvent::Step(format!(
                        "Upgrading traffic manager {} → v{ours} in {ns}",
                        v.as_deref()
                            .map_or("(unknown version)".to_owned(), |v| format!("v{v}"))
                    )));
                    Outcome::Upgraded { from: v.clone() }
                }
            },
        };

        let nsd = Some(ns.as_str());
        self.ensure_namespace().await?;
        self.ensure(
            &self.namespaced(),
            nsd,
            &objects::service_account(&self.spec),
        )
        .await?;
        self.ensure(&self.namespaced(), nsd, &objects::role(&self.spec))
            .await?;
        self.ensure(&self.namespaced(), nsd, &objects::role_binding(&self.spec))
            .await?;
        let cluster_roles: Api<ClusterRole> = Api::all(self.client.clone());
        self.ensure(&cluster_roles, None, &objects::cluster_role(&self.spec))
            .await?;
        let cluster_role_bindings: Api<ClusterRoleBinding> = Api::all(self.client.clone());
        self.ensure(
            &cluster_role_bindings,
            None,
            &objects::cluster_role_binding(&self.spec),
        )
        .await?;
        self.ensure::<ConfigMap>(&self.namespaced(), nsd, &objects::config_map(&self.spec))
            .await?;
        let (service, _) = self
            .ensure::<Service>(&self.namespaced(), nsd, &objects::service(&self.spec))
            .await?;
        let cluster_ip = service
            .spec
            .as_ref()
            .and_then(|s| s.cluster_ip.as_deref())
            .and_then(|ip| ip.parse::<IpAddr>().ok());
        let tls = self.ensure_secret(cluster_ip).await?;

        let desired = objects::deployment(&self.spec, &tls.ca_pem);
        let previous = existing.clone();
        let deployment = match (existing, &outcome) {
            (Some(e), Outcome::NewerInstalled { version }) => {
                self.progress.report(ProgressEvent::Warning(format!(
                    "traffic manager v{version} in {ns} is newer than this kvpn (v{ours}); \
                     leaving it as it is"
                )));
                e
            }
            (Some(e), Outcome::AlreadyInstalled)
                if objects::template_hash(&e) == objects::template_hash(&desired)
                    && deployment_replicas(&e) == self.spec.replicas =>
            {
                self.progress.report(ProgressEvent::Done(format!(
                    "Traffic manager v{ours} already installed in {ns}"
                )));
                e
            }
            (existing, _) => {
                let verb = if existing.is_some() {
                    "Updating"
                } else {
                    "Creating"
                };
                if outcome == Outcome::AlreadyInstalled {
                    outcome = Outcome::Updated;
                }
                self.progress
                    .report(ProgressEvent::Step(format!("{verb} Deployment {MANAGER}")));
                self.apply(&deployments, nsd, &desired).await?
            }
        };
        let template_hash = objects::template_hash(&deployment).map(str::to_owned);
        let (pod_name, pod_ip) = match self.wait_ready(template_hash, wait_config).await {
            Ok(ready) => ready,
            Err(e @ Error::CannotStart { .. }) => {
                self.roll_back(&outcome, previous.as_ref()).await;
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        if !matches!(outcome, Outcome::NewerInstalled { .. }) {
            self.ensure_node_agent().await?;
        }
        let info = manager_info(
            &ns,
            &deployment,
            (pod_name, pod_ip),
            cluster_ip,
            tls.ca_pem,
            outcome,
        );
        info!(namespace = %ns, pod = %info.pod_name, ip = %info.pod_ip, outcome = ?info.outcome, "traffic manager ready");
        Ok(info)
    }

    /// The node agent of `preserve` (docs/source-policy.md): applied and waited
    /// for (every scheduled pod ready) under `preserve`, removed under the other
    /// policies (a policy switched away from `preserve`).
    async fn ensure_node_agent(&self) -> Result<(), Error> {
        let ns = self.ns().to_owned();
        let nsd = Some(ns.as_str());
        let daemon_sets: Api<DaemonSet> = self.namespaced();
        if self.spec.source_policy != SourcePolicy::Preserve {
            let present = match daemon_sets.get_opt(node_agent::NODE_AGENT).await {
                Ok(d) => d.is_some(),
                // A user who may not read DaemonSets never installed one.
                Err(e) if is_status(&e, 403) => false,
                Err(e) => {
                    return Err(api_error::<DaemonSet>("get", nsd, node_agent::NODE_AGENT)(
                        e,
                    ));
                }
            };
            if present {
                let mut report = UninstallReport::default();
                delete_node_agent(
                    self.client,
                    &ns,
                    Instant::now() + UNINSTALL_TIMEOUT,
                    self.progress,
                    &mut report,
                )
                .await?;
            }
            return Ok(());
        }
        if !self.may_apply_daemon_sets().await {
            self.progress.report(ProgressEvent::Warning(format!(
                "this user may not create DaemonSets in {ns}, so kvpn's node agent (which routes \
                 the tunnel pool {} to the manager on every node) is not installed: the nodes \
                 must route it themselves, or someone who may runs `kvpn install \
                 --source-policy preserve` once (docs/source-policy.md)",
                node_agent::POOL
            )));
            return Ok(());
        }
        self.ensure(
            &self.namespaced(),
            nsd,
            &node_agent::service_account(&self.spec),
        )
        .await?;
        self.ensure(&self.namespaced(), nsd, &node_agent::role(&self.spec))
            .await?;
        self.ensure(
            &self.namespaced(),
            nsd,
            &node_agent::role_binding(&self.spec),
        )
        .await?;
        self.ensure(&daemon_sets, nsd, &node_agent::daemon_set(&self.spec))
            .await?;
        self.progress.report(ProgressEvent::Step(format!(
            "Waiting for the node agent (DaemonSet {}) on every node: it routes the tunnel pool \
             {} to the manager",
            node_agent::NODE_AGENT,
            node_agent::POOL
        )));
        let started = Instant::now();
        let deadline = started + NODE_AGENT_WAIT;
        loop {
            let ds = daemon_sets
                .get_opt(node_agent::NODE_AGENT)
                .await
                .map_err(api_error::<DaemonSet>("get", nsd, node_agent::NODE_AGENT))?;
            let status = ds.as_ref().and_then(|d| d.status.clone());
            let generation = ds.as_ref().and_then(|d| d.metadata.generation);
            if let Some(st) = &status {
                let current =
                    st.observed_generation.is_some() && st.observed_generation == generation;
                let updated = st.updated_number_scheduled.unwrap_or(0);
                if current
                    && st.desired_number_scheduled > 0
                    && st.number_ready == st.desired_number_scheduled
                    && updated == st.desired_number_scheduled
                {
                    self.progress.report(ProgressEvent::Done(format!(
                        "Node agent ready on {} node(s)",
                        st.number_ready
                    )));
                    return Ok(());
                }
            }
            // No DaemonSet controller took it up (a cluster that runs none; the
            // stand-in lab): nothing will ever start. Say so and go on — the
            // nodes must then route the pool themselves (docs/source-policy.md).
            if status
                .as_ref()
                .and_then(|s| s.observed_generation)
                .is_none()
                && started.elapsed() >= NODE_AGENT_UNOBSERVED
            {
                self.progress.report(ProgressEvent::Warning(format!(
                    "no DaemonSet controller took up DaemonSet {ns}/{} within {} s: the node \
                     agent does not run, so the nodes must route the tunnel pool {} to the \
                     manager themselves (docs/source-policy.md)",
                    node_agent::NODE_AGENT,
                    NODE_AGENT_UNOBSERVED.as_secs(),
                    node_agent::POOL
                )));
                return Ok(());
            }
            if Instant::now() >= deadline {
                let (ready, desired) =
                    status.map_or((0, 0), |s| (s.number_ready, s.desired_number_scheduled));
                return Err(Error::NodeAgentNotReady {
                    namespace: ns,
                    ready,
                    desired,
                    after: NODE_AGENT_WAIT,
                });
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    /// Whether this user may write DaemonSets in the manager namespace (a
    /// SelfSubjectAccessReview for `create` and `patch`, what server-side apply
    /// sends), as `kubectl auth can-i` asks. An error asking counts as yes: the
    /// apply then says what went wrong.
    async fn may_apply_daemon_sets(&self) -> bool {
        use k8s_openapi::api::authorization::v1::{
            ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
        };
        let api: Api<SelfSubjectAccessReview> = Api::all(self.client.clone());
        for verb in ["create", "patch"] {
            let review = SelfSubjectAccessReview {
                spec: SelfSubjectAccessReviewSpec {
                    resource_attributes: Some(ResourceAttributes {
                        group: Some("apps".into()),
                        resource: Some("daemonsets".into()),
                        verb: Some(verb.into()),
                        namespace: Some(self.ns().to_owned()),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                ..Default::default()
            };
            match api.create(&PostParams::default(), &review).await {
                Ok(r) if r.status.as_ref().is_some_and(|s| !s.allowed) => return false,
                Ok(_) => {}
                Err(e) => {
                    debug!(error = %e, "cannot ask whether this user may write DaemonSets");
                    return true;
                }
            }
        }
        true
    }

    /// Takes the image, pull settings and source policy an installed manager runs
    /// with, for each one nobody asked to change.
    fn keep_installed_settings(&mut self, d: &Deployment) {
        let container = d
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .and_then(|s| s.containers.first());
        if self.keep.policy {
            self.spec.source_policy = deployment_policy(d);
        }
        if self.keep.replicas {
            // Whoever set it (an earlier --replicas, `kubectl scale`, an
            // autoscaler): re-applied as it is, so nobody is scaled back —
            // except from 0, where no manager runs for the connect that asks.
            let installed = deployment_replicas(d);
            self.spec.replicas = if installed == 0 {
                self.progress.report(ProgressEvent::Detail(format!(
                    "Deployment {MANAGER} in {} is scaled to 0 replicas: scaling it back to 1",
                    self.ns()
                )));
                1
            } else {
                installed
            };
        }
        if self.keep.image
            && let Some(installed) = container.and_then(|c| c.image.as_deref())
        {
            self.spec.image =
                image::remembered(installed, version_of(&d.metadata), &self.spec.version);
        }
        if self.keep.pull_policy {
            // The apiserver fills in the default policy: only one that differs from
            // it was asked for (and is kept).
            self.spec.image_pull_policy = container
                .and_then(|c| c.image_pull_policy.clone())
                .filter(|p| *p != image::default_pull_policy(&self.spec.image));
        }
        if self.keep.pull_secrets {
            self.spec.image_pull_secrets = d
                .spec
                .as_ref()
                .and_then(|s| s.template.spec.as_ref())
                .and_then(|s| s.image_pull_secrets.as_ref())
                .map(|refs| refs.iter().map(|r| r.name.clone()).collect())
                .unwrap_or_default();
        }
    }

    /// After a manager pod that cannot start: a new install is removed again, an
    /// updated Deployment gets its previous pod template back (its old pod kept
    /// serving meanwhile: a rolling update replaces it only once the new pod is
    /// ready). Nothing is left half-installed; failures here are reported, not
    /// returned (the caller's error is the cause).
    async fn roll_back(&self, outcome: &Outcome, previous: Option<&Deployment>) {
        let ns = self.ns().to_owned();
        match (outcome, previous) {
            (Outcome::Installed, _) => {
                self.progress.report(ProgressEvent::Step(format!(
                    "Removing the traffic manager objects just created in {ns} (its pod cannot start)"
                )));
                if let Err(e) = uninstall(self.client, &ns, self.progress).await {
                    self.progress.report(ProgressEvent::Warning(format!(
                        "could not remove them: {e} — run `kvpn uninstall`"
                    )));
                }
            }
            (_, Some(old)) => {
                self.progress.report(ProgressEvent::Step(format!(
                    "Restoring the previous Deployment {MANAGER} in {ns} (the new pod cannot start)"
                )));
                let restored = Deployment {
                    metadata: kube::api::ObjectMeta {
                        name: old.metadata.name.clone(),
                        namespace: old.metadata.namespace.clone(),
                        labels: old.metadata.labels.clone(),
                        annotations: old.metadata.annotations.clone().map(|mut a| {
                            a.remove("deployment.kubernetes.io/revision");
                            a.remove("kubectl.kubernetes.io/last-applied-configuration");
                            a
                        }),
                        ..Default::default()
                    },
                    spec: old.spec.clone(),
                    status: None,
                };
                if let Err(e) = self
                    .apply(&self.namespaced::<Deployment>(), Some(&ns), &restored)
                    .await
                {
                    self.progress.report(ProgressEvent::Warning(format!(
                        "could not restore the previous Deployment: {e}"
                    )));
                }
            }
            (_, None) => {}
        }
    }

    /// Polls the manager's pods until one of `template_hash` is ready, reporting
    /// each pod's state changes (see [`wait`]).
    async fn wait_ready(
        &self,
        template_hash: Option<String>,
        config: WaitConfig,
    ) -> Result<(String, IpAddr), Error> {
        let ns = self.ns().to_owned();
        self.progress.report(ProgressEvent::Step(format!(
            "Waiting for the traffic manager pod in {ns} to be ready"
        )));
        let pods: Api<Pod> = self.namespaced();
        let deployments: Api<Deployment> = self.namespaced();
        let lp = ListParams::default().labels(&objects::selector());
        let mut wait = ReadyWait::new(template_hash, config, Instant::now());
        loop {
            let listed = pods.list(&lp).await;
            let items = match listed {
                Ok(l) => l.items,
                Err(e) if is_status(&e, 403) => {
                    return Err(api_error::<Pod>("list", Some(&ns), "(all)")(e));
                }
                Err(e) => {
                    // A passing apiserver or network hiccup: keep waiting within the bound.
                    debug!(error = %e, "listing manager pods failed; retrying");
                    if Instant::now() >= wait.deadline() {
                        return Err(api_error::<Pod>("list", Some(&ns), "(all)")(e));
                    }
                    tokio::time::sleep(POLL_INTERVAL).await;
                    continue;
                }
            };
            let deployment = deployments.get_opt(MANAGER).await.ok().flatten();
            let verdict = wait.handle_snapshot(&items, deployment.as_ref(), Instant::now());
            while let Some(line) = wait.poll_progress() {
                self.progress.report(ProgressEvent::Detail(line));
            }
            match verdict {
                Verdict::Waiting => tokio::time::sleep(POLL_INTERVAL).await,
                Verdict::Ready { pod, ip } => {
                    self.progress.report(ProgressEvent::Done(format!(
                        "Traffic manager ready: pod {pod} (IP {ip}) in {ns}"
                    )));
                    return Ok((pod, ip));
                }
                Verdict::Failed(WaitFailure::CannotStart { pod, fatal }) => {
                    let hint = wait::hint(
                        &ns,
                        pod.as_deref(),
                        &fatal,
                        &self.spec.image,
                        &self.spec.image_pull_secrets,
                    );
                    return Err(Error::CannotStart {
                        what: pod.map_or_else(
                            || format!("Deployment {MANAGER}"),
                            |p| format!("pod {p}"),
                        ),
                        reason: fatal.reason,
                        message: fatal.message,
                        hint,
                    });
                }
                Verdict::Failed(WaitFailure::NotReady { after, last }) => {
                    return Err(Error::NotReady {
                        namespace: ns,
                        after,
                        last,
                    });
                }
            }
        }
    }
}

/// Every object an install applies, in apply order, as `kubectl apply -f -` takes
/// them (`kvpn install --dry-run`). The TLS Secret is generated fresh for the
/// Service's DNS names (the ClusterIP is not known before the Service exists; the
/// client verifies the DNS name).
pub fn manifests(opts: &InstallOptions) -> Result<Vec<serde_json::Value>, Error> {
    let spec = Spec::of(opts);
    let tls = certs::generate(&spec.namespace, None)?;
    let secret = objects::tls_secret(&spec, &tls.ca_pem, &tls.cert_pem, &tls.key_pem);
    let value = |r: Result<serde_json::Value, serde_json::Error>| {
        r.map_err(|e| Error::Manifest(e.to_string()))
    };
    let mut node_agent_objects = Vec::new();
    if spec.source_policy == SourcePolicy::Preserve {
        node_agent_objects.push(value(serde_json::to_value(node_agent::service_account(
            &spec,
        )))?);
        node_agent_objects.push(value(serde_json::to_value(node_agent::role(&spec)))?);
        node_agent_objects.push(value(serde_json::to_value(node_agent::role_binding(
            &spec,
        )))?);
        node_agent_objects.push(value(serde_json::to_value(node_agent::daemon_set(&spec)))?);
    }
    let mut all = vec![
        value(serde_json::to_value(objects::namespace(&spec)))?,
        value(serde_json::to_value(objects::service_account(&spec)))?,
        value(serde_json::to_value(objects::role(&spec)))?,
        value(serde_json::to_value(objects::role_binding(&spec)))?,
        value(serde_json::to_value(objects::cluster_role(&spec)))?,
        value(serde_json::to_value(objects::cluster_role_binding(&spec)))?,
        value(serde_json::to_value(objects::config_map(&spec)))?,
        value(serde_json::to_value(objects::service(&spec)))?,
        value(serde_json::to_value(secret))?,
        value(serde_json::to_value(objects::deployment(
            &spec,
            &tls.ca_pem,
        )))?,
    ];
    all.extend(node_agent_objects);
    Ok(all)
}

/// The ready manager of `deployment`, as a client connects to it.
fn manager_info(
    ns: &str,
    deployment: &Deployment,
    (pod_name, pod_ip): (String, IpAddr),
    cluster_ip: Option<IpAddr>,
    ca_pem: String,
    outcome: Outcome,
) -> ManagerInfo {
    let container = deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|s| s.containers.first());
    ManagerInfo {
        namespace: ns.to_owned(),
        version: version_of(&deployment.metadata)
            .unwrap_or_default()
            .to_owned(),
        image: container.and_then(|c| c.image.clone()).unwrap_or_default(),
        pod_name,
        pod_ip,
        service: MANAGER.to_owned(),
        cluster_ip,
        data_port: objects::DATA_PORT,
        grpc_port: objects::GRPC_PORT,
        source_policy: deployment_policy(deployment),
        replicas: deployment_replicas(deployment),
        ca_pem,
        server_name: objects::server_name(ns),
        outcome,
    }
}

/// `kvpn connect --no-install`: the manager someone installed (from `kvpn install
/// --dry-run -o yaml`, a GitOps tool, a platform team), used as it is. Nothing is
/// written; a missing manager, one of another version, or a missing TLS Secret
/// fails with the fix. Needs only get on Deployments, Services and the Secret
/// and list on pods.
pub async fn find_manager(
    client: &kube::Client,
    opts: &InstallOptions,
    progress: &dyn Progress,
) -> Result<ManagerInfo, Error> {
    let installer = Installer {
        client,
        spec: Spec::of(opts),
        progress,
        keep: Keep::default(),
    };
    let ns = opts.namespace.clone();
    installer.progress.report(ProgressEvent::Step(format!(
        "Looking for the installed traffic manager in {ns} (--no-install)"
    )));
    let deployments: Api<Deployment> = installer.namespaced();
    let deployment = deployments
        .get_opt(MANAGER)
        .await
        .map_err(api_error::<Deployment>("get", Some(&ns), MANAGER))?
        .ok_or_else(|| Error::NotInstalled {
            namespace: ns.clone(),
            version: opts.version.clone(),
        })?;
    let installed = version_of(&deployment.metadata)
        .unwrap_or("(none)")
        .to_owned();
    if compare_versions(&installed, &opts.version) != Some(std::cmp::Ordering::Equal) {
        return Err(Error::OtherVersion {
            namespace: ns,
            installed,
            ours: opts.version.clone(),
        });
    }
    let services: Api<Service> = installer.namespaced();
    let cluster_ip = services
        .get_opt(MANAGER)
        .await
        .map_err(api_error::<Service>("get", Some(&ns), MANAGER))?
        .and_then(|s| s.spec)
        .and_then(|s| s.cluster_ip)
        .and_then(|ip| ip.parse::<IpAddr>().ok());
    let tls = read_tls(client, &ns)
        .await?
        .ok_or_else(|| Error::NotInstalled {
            namespace: ns.clone(),
            version: opts.version.clone(),
        })?;
    let template_hash = objects::template_hash(&deployment).map(str::to_owned);
    let ready = installer.wait_ready(template_hash, opts.wait).await?;
    Ok(manager_info(
        &ns,
        &deployment,
        ready,
        cluster_ip,
        tls.ca_pem,
        Outcome::AlreadyInstalled,
    ))
}

/// The replica count a manager Deployment asks for (1 when absent, the API
/// server's default).
fn deployment_replicas(deployment: &Deployment) -> i32 {
    deployment
        .spec
        .as_ref()
        .and_then(|s| s.replicas)
        .unwrap_or(1)
}

/// The `--source-policy` a manager Deployment's container runs with (`snat` when
/// absent).
fn deployment_policy(deployment: &Deployment) -> SourcePolicy {
    deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|s| s.containers.first())
        .and_then(|c| c.args.as_deref())
        .map(objects::source_policy_of_args)
        .unwrap_or_default()
}

/// Makes sure the traffic manager runs in `opts.namespace` at `opts.version` and
/// returns the ready pod to connect to (see the module docs for what is written
/// when). Fails with [`Error::CannotStart`] (the pod's own reason) within
/// `opts.wait.fatal_grace` of a fatal container state, or with
/// [`Error::NotReady`] after `opts.wait.ready_timeout`.
pub async fn ensure_manager(
    client: &kube::Client,
    opts: &InstallOptions,
    progress: &dyn Progress,
) -> Result<ManagerInfo, Error> {
    let installer = Installer {
        client,
        spec: Spec::of(opts),
        progress,
        keep: Keep::of(opts),
    };
    installer.run(opts.wait).await
}

/// The TLS step of [`ensure_manager`] alone: returns the manager's TLS material
/// from its Secret when that is valid for the Service name and `cluster_ip`, else
/// writes a new one (conditionally, so concurrent callers end with one Secret and
/// all return it). The Service must exist for `cluster_ip` to be known.
pub async fn ensure_tls_secret(
    client: &kube::Client,
    opts: &InstallOptions,
    cluster_ip: Option<IpAddr>,
    progress: &dyn Progress,
) -> Result<certs::TlsMaterial, Error> {
    let installer = Installer {
        client,
        spec: Spec::of(opts),
        progress,
        keep: Keep::default(),
    };
    installer.ensure_secret(cluster_ip).await
}

/// The manager's TLS material as stored in its Secret (None when there is no
/// Secret), e.g. to verify the manager's certificate on a reconnect.
pub async fn read_tls(
    client: &kube::Client,
    namespace: &str,
) -> Result<Option<certs::TlsMaterial>, Error> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let Some(secret) = api.get_opt(TLS_SECRET).await.map_err(api_error::<Secret>(
        "get",
        Some(namespace),
        TLS_SECRET,
    ))?
    else {
        return Ok(None);
    };
    certs::from_secret(&secret)
        .map(Some)
        .map_err(|why| Error::BadSecret {
            namespace: namespace.to_owned(),
            why,
        })
}

/// What [`uninstall`] removed, as "Kind name" strings in deletion order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UninstallReport {
    pub deleted: Vec<String>,
}

/// Deletes `name` and waits (bounded by `deadline`) until it is gone; false when it
/// was already gone.
async fn delete_and_wait<K: Kind>(
    api: &Api<K>,
    namespace: Option<&str>,
    name: &str,
    deadline: Instant,
    progress: &dyn Progress,
) -> Result<bool, Error> {
    delete_and_wait_with(
        api,
        namespace,
        name,
        deadline,
        progress,
        &DeleteParams::background(),
    )
    .await
}

/// [`delete_and_wait`] with `params` (foreground: the object stays until its
/// dependents are gone).
async fn delete_and_wait_with<K: Kind>(
    api: &Api<K>,
    namespace: Option<&str>,
    name: &str,
    deadline: Instant,
    progress: &dyn Progress,
    params: &DeleteParams,
) -> Result<bool, Error> {
    progress.report(ProgressEvent::Step(format!("Deleting {} {name}", K::KIND)));
    match api.delete(name, params).await {
        Ok(_) => {}
        Err(e) if is_status(&e, 404) => return Ok(false),
        Err(e) => return Err(api_error::<K>("delete", namespace, name)(e)),
    }
    loop {
        match api.get_opt(name).await {
            Ok(None) => return Ok(true),
            Ok(Some(_)) => {}
            Err(e) if is_status(&e, 403) => return Err(api_error::<K>("get", namespace, name)(e)),
            Err(e) => debug!(error = %e, "checking a deleted object; retrying"),
        }
        if Instant::now() >= deadline {
            return Err(Error::DeleteTimeout {
                object: object_name::<K>(namespace, name),
                after: UNINSTALL_TIMEOUT,
            });
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// What a `preserve` session must say about the node agent (DaemonSet
/// `kvpn-node-agent` in `namespace`) when it cannot vouch for the way back: one
/// line naming what is missing and the fix, or empty when the agent runs on every
/// node it is scheduled to (or cannot be read: nothing is claimed either way).
pub async fn node_agent_note(client: &kube::Client, namespace: &str) -> String {
    let api: Api<DaemonSet> = Api::namespaced(client.clone(), namespace);
    let fix = format!(
        "backends' replies reach this laptop only if the nodes route the tunnel pool {}          to the manager themselves; someone who may create DaemonSets in {namespace} runs          `kvpn install --source-policy preserve` once (docs/source-policy.md)",
        node_agent::POOL
    );
    match api.get_opt(node_agent::NODE_AGENT).await {
        Ok(None) => format!(
            "kvpn's node agent (DaemonSet {namespace}/{}) is not installed: {fix}",
            node_agent::NODE_AGENT
        ),
        Ok(Some(d)) => {
            let st = d.status.unwrap_or_default();
            if st.desired_number_scheduled > 0 && st.number_ready >= st.desired_number_scheduled {
                String::new()
            } else {
                format!(
                    "kvpn's node agent (DaemonSet {namespace}/{}) is ready on {} of {} nodes: {fix}",
                    node_agent::NODE_AGENT,
                    st.number_ready,
                    st.desired_number_scheduled
                )
            }
        }
        Err(e) if is_status(&e, 403) => format!(
            "kvpn cannot tell whether its node agent (DaemonSet {namespace}/{}) runs: this user \
             may not read DaemonSets in {namespace}; {fix}",
            node_agent::NODE_AGENT
        ),
        Err(e) => {
            debug!(error = %e, "cannot read the node agent's DaemonSet");
            String::new()
        }
    }
}

/// Deletes the node agent's objects (see [`node_agent`]); its DaemonSet in the
/// foreground, so its pods (which remove their routes on SIGTERM) are gone
/// when this returns.
async fn delete_node_agent(
    client: &kube::Client,
    namespace: &str,
    deadline: Instant,
    progress: &dyn Progress,
    report: &mut UninstallReport,
) -> Result<(), Error> {
    let name = node_agent::NODE_AGENT;
    let ns = Some(namespace);
    let daemon_sets: Api<DaemonSet> = Api::namespaced(client.clone(), namespace);
    // Only what exists is deleted: a user who may not read (or delete) the
    // agent's kinds never installed it (`preserve` needs DaemonSets).
    let exists = match daemon_sets.get_opt(name).await {
        Ok(d) => d.is_some(),
        Err(e) if is_status(&e, 403) => false,
        Err(e) => return Err(api_error::<DaemonSet>("get", ns, name)(e)),
    };
    // Foreground: the DaemonSet stays until its pods (which remove their
    // routes on SIGTERM) are gone.
    if exists
        && delete_and_wait_with(
            &daemon_sets,
            ns,
            name,
            deadline,
            progress,
            &DeleteParams::foreground(),
        )
        .await?
    {
        report.deleted.push(format!("DaemonSet {name}"));
    }
    delete_if_present::<RoleBinding>(client, namespace, name, deadline, progress, report).await?;
    delete_if_present::<Role>(client, namespace, name, deadline, progress, report).await?;
    delete_if_present::<ServiceAccount>(client, namespace, name, deadline, progress, report)
        .await?;
    Ok(())
}

/// Deletes `name` of kind `K` when it exists (a 403 on reading it: it is not
/// this user's to delete, and was not made by this user).
async fn delete_if_present<K: Kind + kube::Resource<Scope = NamespaceResourceScope>>(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    deadline: Instant,
    progress: &dyn Progress,
    report: &mut UninstallReport,
) -> Result<(), Error> {
    let api: Api<K> = Api::namespaced(client.clone(), namespace);
    match api.get_opt(name).await {
        Ok(Some(_)) => {
            if delete_and_wait(&api, Some(namespace), name, deadline, progress).await? {
                report.deleted.push(format!("{} {name}", K::KIND));
            }
            Ok(())
        }
        Ok(None) => Ok(()),
        Err(e) if is_status(&e, 403) => Ok(()),
        Err(e) => Err(api_error::<K>("get", Some(namespace), name)(e)),
    }
}

/// Deletes every object of `K` in `namespace` carrying kvpn's labels.
async fn delete_labeled<K: Kind + kube::Resource<Scope = NamespaceResourceScope>>(
    client: &kube::Client,
    namespace: &str,
    deadline: Instant,
    progress: &dyn Progress,
    report: &mut UninstallReport,
) -> Result<(), Error> {
    let api: Api<K> = Api::namespaced(client.clone(), namespace);
    let list = api
        .list(&ListParams::default().labels(&objects::selector()))
        .await
        .map_err(api_error::<K>("list", Some(namespace), "(all)"))?;
    for obj in list.items {
        let name = obj.meta().name.clone().unwrap_or_default();
        if delete_and_wait(&api, Some(namespace), &name, deadline, progress).await? {
            report.deleted.push(format!("{} {name}", K::KIND));
        }
    }
    Ok(())
}

/// Deletes the manager's lease objects (one per tunnel IP, made by the manager,
/// not by the install: their own labels, [`crate::lease::LEASE_OBJECTS_SELECTOR`]).
/// Run after the manager's pods are gone, so none is written again; not waited
/// for one by one (a Lease has no finalizer: gone when the delete answers).
async fn delete_lease_objects(
    client: &kube::Client,
    namespace: &str,
    progress: &dyn Progress,
    report: &mut UninstallReport,
) -> Result<(), Error> {
    use k8s_openapi::api::coordination::v1::Lease;
    let api: Api<Lease> = Api::namespaced(client.clone(), namespace);
    let list = api
        .list(&ListParams::default().labels(crate::lease::LEASE_OBJECTS_SELECTOR))
        .await
        .map_err(api_error::<Lease>("list", Some(namespace), "(all)"))?;
    if !list.items.is_empty() {
        progress.report(ProgressEvent::Step(format!(
            "Deleting {} lease objects (Lease) in {namespace}",
            list.items.len()
        )));
    }
    for obj in list.items {
        let name = obj.metadata.name.clone().unwrap_or_default();
        match api.delete(&name, &DeleteParams::background()).await {
            Ok(_) => report.deleted.push(format!("Lease {name}")),
            Err(e) if is_status(&e, 404) => {}
            Err(e) => return Err(api_error::<Lease>("delete", Some(namespace), &name)(e)),
        }
    }
    Ok(())
}

/// Deletes the cluster-scoped `name` of `K` if kvpn created it (label check).
async fn delete_cluster_scoped<
    K: Kind + kube::Resource<Scope = k8s_openapi::ClusterResourceScope>,
>(
    client: &kube::Client,
    name: &str,
    deadline: Instant,
    progress: &dyn Progress,
    report: &mut UninstallReport,
) -> Result<(), Error> {
    let api: Api<K> = Api::all(client.clone());
    let Some(obj) = api
        .get_opt(name)
        .await
        .map_err(api_error::<K>("get", None, name))?
    else {
        return Ok(());
    };
    let ours = obj
        .meta()
        .labels
        .as_ref()
        .and_then(|l| l.get(objects::LABEL_MANAGED_BY))
        .is_some_and(|v| v == objects::MANAGED_BY);
    if !ours {
        progress.report(ProgressEvent::Warning(format!(
            "{} {name} was not created by kvpn; leaving it",
            K::KIND
        )));
        return Ok(());
    }
    if delete_and_wait(&api, None, name, deadline, progress).await? {
        report.deleted.push(format!("{} {name}", K::KIND));
    }
    Ok(())
}

/// Whether any container of `pod` has run (running or terminated now, or before a
/// restart): one that never did holds nothing to wait for.
fn ever_started(pod: &Pod) -> bool {
    let Some(status) = pod.status.as_ref() else {
        return false;
    };
    status
        .container_statuses
        .iter()
        .flatten()
        .chain(status.init_container_statuses.iter().flatten())
        .any(|c| {
            let ran = |s: Option<&k8s_openapi::api::core::v1::ContainerState>| {
                s.is_some_and(|s| s.running.is_some() || s.terminated.is_some())
            };
            ran(c.state.as_ref()) || ran(c.last_state.as_ref()) || c.restart_count > 0
        })
}

/// Removes the traffic manager from `namespace`: every object kvpn created there
/// (found by its labels), its ClusterRole and ClusterRoleBinding, and the
/// namespace itself when kvpn created it. Waits (bounded by
/// [`UNINSTALL_TIMEOUT`]) until each is gone, including the manager's pods that
/// ever ran (see [`ever_started`]).
/// Idempotent: nothing left is not an error.
pub async fn uninstall(
    client: &kube::Client,
    namespace: &str,
    progress: &dyn Progress,
) -> Result<UninstallReport, Error> {
    let deadline = Instant::now() + UNINSTALL_TIMEOUT;
    let mut report = UninstallReport::default();
    let p = progress;
    let r = &mut report;
    delete_node_agent(client, namespace, deadline, p, r).await?;
    delete_labeled::<Deployment>(client, namespace, deadline, p, r).await?;
    delete_labeled::<Service>(client, namespace, deadline, p, r).await?;
    delete_labeled::<ConfigMap>(client, namespace, deadline, p, r).await?;
    delete_labeled::<Secret>(client, namespace, deadline, p, r).await?;
    delete_labeled::<RoleBinding>(client, namespace, deadline, p, r).await?;
    delete_labeled::<Role>(client, namespace, deadline, p, r).await?;
    delete_labeled::<ServiceAccount>(client, namespace, deadline, p, r).await?;
    let cluster_name = objects::cluster_role_name(namespace);
    delete_cluster_scoped::<ClusterRoleBinding>(client, &cluster_name, deadline, p, r).await?;
    delete_cluster_scoped::<ClusterRole>(client, &cluster_name, deadline, p, r).await?;

    // The Deployment's pods go with it (garbage collector); wait for those that
    // ran. A pod whose manager never started (its image could not be pulled, its
    // container never created) holds no session, flow or lease, and a real
    // kubelet (1.20) removes such a pod only at its next full pod sync, about a
    // minute later: its deletion is requested and not waited for.
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let lp = ListParams::default().labels(&objects::selector());
    let mut shown = Vec::<String>::new();
    loop {
        let items = pods
            .list(&lp)
            .await
            .map_err(api_error::<Pod>("list", Some(namespace), "(all)"))?
            .items;
        let mut running = 0;
        for pod in &items {
            let name = pod.metadata.name.clone().unwrap_or_default();
            let started = ever_started(pod);
            running += usize::from(started);
            if !shown.contains(&name) {
                p.report(ProgressEvent::Detail(if started {
                    format!("Pod {name}: terminating")
                } else {
                    format!("Pod {name}: never started; its deletion is requested, not waited for")
                }));
                shown.push(name);
            }
        }
        if running == 0 {
            break;
        }
        if Instant::now() >= deadline {
            return Err(Error::DeleteTimeout {
                object: format!("pod {namespace}/{}", shown.join(", ")),
                after: UNINSTALL_TIMEOUT,
            });
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }

    delete_lease_objects(client, namespace, p, r).await?;

    // The namespace, only when kvpn created it (and this user may see it).
    let namespaces: Api<Namespace> = Api::all(client.clone());
    match namespaces.get_opt(namespace).await {
        Ok(Some(ns))
            if ns
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(objects::LABEL_MANAGED_BY))
                .is_some_and(|v| v == objects::MANAGED_BY) =>
        {
            if delete_and_wait(&namespaces, None, namespace, deadline, p).await? {
                report.deleted.push(format!("Namespace {namespace}"));
            }
        }
        Ok(_) => {}
        Err(e) if is_status(&e, 403) => {
            debug!(namespace, "may not read namespaces; leaving the namespace");
        }
        Err(e) => return Err(api_error::<Namespace>("get", None, namespace)(e)),
    }

    progress.report(ProgressEvent::Done(if report.deleted.is_empty() {
        format!("No traffic manager objects in {namespace}: nothing to remove")
    } else {
        format!(
            "Removed the traffic manager from {namespace} ({} objects)",
            report.deleted.len()
        )
    }));
    Ok(report)
}

#[cfg(test)]
mod uninstall_tests {
    use super::*;

    fn pod(status: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": { "name": "kvpn-manager-1" },
            "status": status,
        }))
        .expect("pod")
    }

    /// Pods that never ran (image not pulled, not scheduled) are not waited for;
    /// any container that ran, now or before a restart, is.
    #[test]
    fn only_pods_whose_manager_ever_ran_are_waited_for() {
        let waiting = serde_json::json!({ "waiting": { "reason": "ImagePullBackOff" } });
        assert!(!ever_started(&pod(serde_json::json!({}))));
        assert!(!ever_started(&pod(
            serde_json::json!({ "phase": "Pending" })
        )));
        assert!(!ever_started(&pod(serde_json::json!({
            "containerStatuses": [{ "name": "manager", "image": "i", "imageID": "", "ready": false,
                                    "restartCount": 0, "state": waiting }]
        }))));
        assert!(ever_started(&pod(serde_json::json!({
            "containerStatuses": [{ "name": "manager", "image": "i", "imageID": "", "ready": true,
                                    "restartCount": 0, "state": { "running": {} } }]
        }))));
        assert!(ever_started(&pod(serde_json::json!({
            "containerStatuses": [{ "name": "manager", "image": "i", "imageID": "", "ready": false,
                                    "restartCount": 0, "state": { "terminated": { "exitCode": 0 } } }]
        }))));
        assert!(ever_started(&pod(serde_json::json!({
            "containerStatuses": [{ "name": "manager", "image": "i", "imageID": "", "ready": false,
                                    "restartCount": 3, "state": waiting,
                                    "lastState": { "terminated": { "exitCode": 1 } } }]
        }))));
    }
}
