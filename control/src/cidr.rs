//! Cluster CIDR detection for the laptop side, and the addresses that must never be
//! routed into the tunnel (DESIGN.md "Data path", issue [kube-connect] item 5).
//!
//! # Sources, in order
//! [`detect_cidrs`] asks the cluster, with the user's own credentials, and merges
//! whatever each source yields:
//! 1. kube-system component flags: `--service-cluster-ip-range` and
//!    `--cluster-cidr` on the containers of pods in kube-system (the static pods of
//!    kube-apiserver and kube-controller-manager, the kube-proxy DaemonSet), and the
//!    same settings in the kubeadm-config (`podSubnet`, `serviceSubnet`) and
//!    kube-proxy (`clusterCIDR`) ConfigMaps;
//! 2. the service CIDR from the API server itself: networking.k8s.io/v1 ServiceCIDR
//!    objects (Kubernetes ≥ 1.33), and the error trick — a create of a Service with
//!    ClusterIP `0.0.0.0` (then `::`), whose refusal names the range ("The range of
//!    valid IPs is 10.96.0.0/12"); a dry run first, for real only where the dry run
//!    does not check the range (1.20); nothing is stored;
//! 3. node `spec.podCIDRs`;
//! 4. inference from pod IPs (hostNetwork pods excluded: theirs are node addresses)
//!    and ClusterIPs that no source above covers, with [`infer_covering`]: a /24
//!    (IPv6: /64) around each such address, merged only where blocks are adjacent
//!    siblings (case rt-01).
//!
//! A source that fails (RBAC 403, a resource the cluster does not have, a timeout)
//! is recorded as an [`Attempt`] and detection goes on; `status` and progress output
//! show every attempt. Results are [`normalise`]d (case rt-03), and before routes are
//! installed the caller punches the laptop's essentials out of them with [`exclude`]
//! (case rt-02, see [`essentials`]).
//!
//! # I/O
//! [`detect_cidrs`] talks to the API server (reads, and one dry-run create).
//! [`essentials`] reads resolv.conf and dumps routes over rtnetlink. Everything else
//! here is pure.

pub mod cache;
pub mod essentials;
pub mod vpn;

use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Service, ServicePort, ServiceSpec};
use k8s_openapi::api::networking::v1::ServiceCIDR;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, ListParams, PostParams};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

pub use kvpn_proto::cidr::{InferPolicy, exclude, infer_covering, normalise, uncovered};

/// Namespace of the traffic manager, where the dry-run probe Service is "created".
pub const DEFAULT_NAMESPACE: &str = "kvpn-system";

/// Flags of kube-apiserver / kube-controller-manager / kube-proxy that name a range.
const SERVICE_RANGE_FLAG: &str = "--service-cluster-ip-range";
const CLUSTER_CIDR_FLAG: &str = "--cluster-cidr";

/// The words the API server puts before the service CIDR when it refuses a
/// ClusterIP (pkg/registry/core/service/ipallocator: `ErrNotInRange`).
const VALID_RANGE_TEXT: &str = "The range of valid IPs is ";

/// Which cluster range a CIDR belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CidrKind {
    Pod,
    Service,
}

impl fmt::Display for CidrKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CidrKind::Pod => "pod CIDR",
            CidrKind::Service => "service CIDR",
        })
    }
}

/// Where one detected CIDR came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Source {
    pub kind: CidrKind,
    pub origin: Origin,
}

/// The object or observation behind a detected CIDR.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum Origin {
    /// A flag on a container of pod `pod` in kube-system.
    ComponentFlag { pod: String, flag: String },
    /// A setting in a kube-system ConfigMap (`kubeadm-config` / `kube-proxy`).
    ConfigMapKey { config_map: String, key: String },
    /// A networking.k8s.io/v1 ServiceCIDR object.
    ServiceCidrObject { name: String },
    /// The API server's refusal of a Service with ClusterIP `probe_ip`.
    ServiceCreateError { probe_ip: IpAddr },
    /// `spec.podCIDRs` of a node.
    NodePodCidr { node: String },
    /// Inferred around `count` pod IPs no other source covered.
    PodIps { count: usize },
    /// Inferred around `count` ClusterIPs no other source covered.
    ClusterIps { count: usize },
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::ComponentFlag { pod, flag } => write!(f, "{flag} of pod kube-system/{pod}"),
            Origin::ConfigMapKey { config_map, key } => {
                write!(f, "{key} in ConfigMap kube-system/{config_map}")
            }
            Origin::ServiceCidrObject { name } => write!(f, "ServiceCIDR {name}"),
            Origin::ServiceCreateError { probe_ip } => {
                write!(f, "API server's refusal of ClusterIP {probe_ip}")
            }
            Origin::NodePodCidr { node } => write!(f, "podCIDRs of node {node}"),
            Origin::PodIps { count } => write!(f, "inferred from {count} pod IPs"),
            Origin::ClusterIps { count } => write!(f, "inferred from {count} ClusterIPs"),
        }
    }
}

/// One detection step, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Step {
    ComponentPods,
    KubeadmConfig,
    KubeProxyConfig,
    ServiceCidrObjects,
    ServiceCreateError,
    NodePodCidrs,
    PodIps,
    ClusterIps,
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Step::ComponentPods => "component flags (pods in kube-system)",
            Step::KubeadmConfig => "ConfigMap kube-system/kubeadm-config",
            Step::KubeProxyConfig => "ConfigMap kube-system/kube-proxy",
            Step::ServiceCidrObjects => "ServiceCIDR objects",
            Step::ServiceCreateError => "service CIDR from a refused ClusterIP",
            Step::NodePodCidrs => "node podCIDRs",
            Step::PodIps => "pod IPs",
            Step::ClusterIps => "ClusterIPs",
        })
    }
}

/// What one step gave.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", content = "detail", rename_all = "camelCase")]
pub enum Outcome {
    /// These CIDRs (as found, before normalising).
    Found(Vec<IpNet>),
    /// The source answered but named no range; why.
    NothingFound(String),
    /// RBAC refused (HTTP 403); the API server's message.
    Forbidden(String),
    /// The cluster has no such object or resource (HTTP 404).
    NotFound(String),
    /// Anything else: other API errors, transport errors, timeouts.
    Failed(String),
}

/// One step and its outcome, for progress output and `status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attempt {
    pub step: Step,
    pub outcome: Outcome,
}

impl fmt::Display for Attempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.step)?;
        match &self.outcome {
            Outcome::Found(cidrs) => {
                let list: Vec<String> = cidrs.iter().map(IpNet::to_string).collect();
                write!(f, "found {}", list.join(", "))
            }
            Outcome::NothingFound(why) => write!(f, "nothing found ({why})"),
            Outcome::Forbidden(msg) => write!(f, "forbidden ({msg})"),
            Outcome::NotFound(msg) => write!(f, "not found ({msg})"),
            Outcome::Failed(msg) => write!(f, "failed ({msg})"),
        }
    }
}

/// The cluster's ranges as detected.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DetectedCidrs {
    /// Pod CIDRs, [`normalise`]d.
    pub pod: Vec<IpNet>,
    /// Service CIDRs, [`normalise`]d.
    pub service: Vec<IpNet>,
    /// Every CIDR as a source named it (host bits and overlaps included), in
    /// detection order.
    pub sources: Vec<(IpNet, Source)>,
    /// Every step and its outcome, in order.
    pub attempts: Vec<Attempt>,
}

impl DetectedCidrs {
    /// True when no source yielded a pod or service CIDR.
    pub fn is_empty(&self) -> bool {
        self.pod.is_empty() && self.service.is_empty()
    }
}

/// How to detect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DetectOptions {
    /// Namespace for the dry-run probe Service (kvpn's own; the user may create
    /// Services there). `default` is tried if this one does not exist yet.
    pub namespace: String,
    /// Width of inferred prefixes (step 4).
    pub infer: InferPolicy,
    /// ClusterIPs offered to the API server for the error trick; the first refusal
    /// that names a range for a family ends that family's probing. Only unspecified
    /// addresses are ever offered outside a dry run.
    pub probe_ips: Vec<IpAddr>,
}

impl Default for DetectOptions {
    /// Namespace [`DEFAULT_NAMESPACE`]; probes `0.0.0.0` (IPv4) and `::` (IPv6):
    /// no service CIDR can hold the unspecified address, so the API server always
    /// refuses it and names its range, and the probe may safely be offered for real
    /// where a dry run does not check the range (see `service_create_error`).
    fn default() -> Self {
        DetectOptions {
            namespace: DEFAULT_NAMESPACE.to_owned(),
            infer: InferPolicy::default(),
            probe_ips: vec![
                IpAddr::from([0, 0, 0, 0]),
                IpAddr::from([0u16, 0, 0, 0, 0, 0, 0, 0]),
            ],
        }
    }
}

/// Detection as a whole failed.
#[derive(Debug, thiserror::Error)]
pub enum DetectError {
    /// No step got any answer from the API server.
    #[error(
        "cannot detect the cluster's CIDRs: the API server did not answer any request \
         (last error: {last}) — check that the kubeconfig's server is reachable, or give \
         --pod-cidr/--service-cidr"
    )]
    Unreachable {
        last: String,
        attempts: Vec<Attempt>,
    },
}

// ---------------------------------------------------------------------------------
// Pure parsers

/// Ranges named by component flags in a container's command line: `(kind, flag,
/// cidr)` for every `--service-cluster-ip-range` (service) and `--cluster-cidr`
/// (pod), written `--flag=v` or `--flag v`, comma-separated for dual-stack. Each
/// word is split on whitespace too, so `sh -c "kube-proxy --cluster-cidr=…"`
/// counts. Values that are no CIDR are skipped.
pub fn parse_component_flags<'a>(
    words: impl IntoIterator<Item = &'a str>,
) -> Vec<(CidrKind, &'static str, IpNet)> {
    let tokens: Vec<&str> = words.into_iter().flat_map(str::split_whitespace).collect();
    let mut out = Vec::new();
    for (i, token) in tokens.iter().enumerate() {
        for (flag, kind) in [
            (SERVICE_RANGE_FLAG, CidrKind::Service),
            (CLUSTER_CIDR_FLAG, CidrKind::Pod),
        ] {
            let value = match token.strip_prefix(flag) {
                Some(rest) if rest.starts_with('=') => &rest[1..],
                Some("") => match tokens.get(i + 1) {
                    Some(v) => *v,
                    None => continue,
                },
                _ => continue,
            };
            out.extend(parse_cidr_list(value).into_iter().map(|c| (kind, flag, c)));
        }
    }
    out
}

/// `a,b,c` (optionally quoted) → the CIDRs among them.
fn parse_cidr_list(value: &str) -> Vec<IpNet> {
    value
        .trim_matches(|c| c == '"' || c == '\'')
        .split(',')
        .filter_map(|v| {
            v.trim()
                .trim_matches(|c| c == '"' || c == '\'')
                .parse()
                .ok()
        })
        .collect()
}

/// The values of `key` in a YAML-ish config text (kubeadm's ClusterConfiguration,
/// kube-proxy's KubeProxyConfiguration): every line `key: value`, at any indent,
/// value optionally quoted and comma-separated. Deliberately line-based: these
/// settings are scalars on one line, and a line-based reader survives documents a
/// strict schema would reject (other API versions, unknown fields).
pub fn parse_config_values(text: &str, key: &str) -> Vec<IpNet> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.trim_start().strip_prefix(key) else {
            continue;
        };
        let Some(value) = rest.strip_prefix(':') else {
            continue;
        };
        // Drop a trailing YAML comment.
        let value = value.split(" #").next().unwrap_or(value);
        out.extend(parse_cidr_list(value.trim()));
    }
    out
}

/// The CIDRs the API server names in a refusal of a ClusterIP: every
/// "The range of valid IPs is <cidr>" in `message`.
pub fn parse_valid_ranges(message: &str) -> Vec<IpNet> {
    message
        .match_indices(VALID_RANGE_TEXT)
        .filter_map(|(at, text)| {
            let rest = &message[at + text.len()..];
            let token: String = rest
                .chars()
                .take_while(|c| c.is_ascii_hexdigit() || matches!(c, '.' | ':' | '/'))
                .collect();
            token.trim_end_matches('.').parse().ok()
        })
        .collect()
}

/// The IPs of pods with their own network namespace: `status.podIPs` (or the older
/// `status.podIP`) of every pod that is not `hostNetwork` (those carry the node's
/// address, which must not become a pod route).
pub fn routable_pod_ips(pods: &[Pod]) -> Vec<IpAddr> {
    let mut out = Vec::new();
    for pod in pods {
        if pod.spec.as_ref().and_then(|s| s.host_network) == Some(true) {
            continue;
        }
        let Some(status) = &pod.status else { continue };
        let mut ips: Vec<IpAddr> = status
            .pod_ips
            .iter()
            .flatten()
            .filter_map(|p| p.ip.parse().ok())
            .collect();
        if ips.is_empty()
            && let Some(ip) = status.pod_ip.as_deref().and_then(|s| s.parse().ok())
        {
            ips.push(ip);
        }
        out.extend(ips);
    }
    out
}

/// The ClusterIPs of `services` (headless `None` and ExternalName Services have none).
pub fn cluster_ips(services: &[Service]) -> Vec<IpAddr> {
    let mut out = Vec::new();
    for svc in services {
        let Some(spec) = &svc.spec else { continue };
        let mut ips: Vec<IpAddr> = spec
            .cluster_ips
            .iter()
            .flatten()
            .filter_map(|s| s.parse().ok())
            .collect();
        if ips.is_empty()
            && let Some(ip) = spec.cluster_ip.as_deref().and_then(|s| s.parse().ok())
        {
            ips.push(ip);
        }
        out.extend(ips);
    }
    out
}

/// Step 4 for one kind: prefixes around the `ips` that `known` does not cover.
pub fn infer_uncovered(
    kind: CidrKind,
    known: &[IpNet],
    ips: &[IpAddr],
    policy: InferPolicy,
) -> (Vec<(IpNet, Source)>, Outcome) {
    let mut left = uncovered(ips, known);
    left.sort_unstable();
    left.dedup();
    if left.is_empty() {
        let why = if ips.is_empty() {
            "no addresses seen".to_owned()
        } else {
            format!("all {} addresses inside the {kind}s above", ips.len())
        };
        return (Vec::new(), Outcome::NothingFound(why));
    }
    let origin = match kind {
        CidrKind::Pod => Origin::PodIps { count: left.len() },
        CidrKind::Service => Origin::ClusterIps { count: left.len() },
    };
    let inferred = infer_covering(&left, policy);
    let found = inferred
        .iter()
        .map(|c| {
            (
                *c,
                Source {
                    kind,
                    origin: origin.clone(),
                },
            )
        })
        .collect();
    (found, Outcome::Found(inferred))
}

/// The normalised pod and service CIDRs of `sources`.
pub fn split_by_kind(sources: &[(IpNet, Source)]) -> (Vec<IpNet>, Vec<IpNet>) {
    let of = |kind| -> Vec<IpNet> {
        let nets: Vec<IpNet> = sources
            .iter()
            .filter(|(_, s)| s.kind == kind)
            .map(|(n, _)| *n)
            .collect();
        normalise(&nets)
    };
    (of(CidrKind::Pod), of(CidrKind::Service))
}

// ---------------------------------------------------------------------------------
// The I/O shell

/// What a step hands back: CIDRs with their origin, and a note for when there are none.
struct StepFound {
    found: Vec<(IpNet, Source)>,
    note: String,
}

impl StepFound {
    fn none(note: impl Into<String>) -> Self {
        StepFound {
            found: Vec::new(),
            note: note.into(),
        }
    }
}

/// Collects steps' outcomes.
#[derive(Default)]
struct Recorder {
    sources: Vec<(IpNet, Source)>,
    attempts: Vec<Attempt>,
    /// Whether any request got an HTTP answer (success or API error).
    answered: bool,
    last_transport_error: Option<String>,
}

impl Recorder {
    fn record(&mut self, step: Step, result: Result<StepFound, kube::Error>) {
        let outcome = match result {
            Ok(s) => {
                self.answered = true;
                if s.found.is_empty() {
                    Outcome::NothingFound(s.note)
                } else {
                    let cidrs = s.found.iter().map(|(n, _)| *n).collect();
                    self.sources.extend(s.found);
                    Outcome::Found(cidrs)
                }
            }
            Err(e) => self.outcome_of_error(e),
        };
        tracing::debug!(%step, ?outcome, "CIDR detection step");
        self.attempts.push(Attempt { step, outcome });
    }

    fn outcome_of_error(&mut self, e: kube::Error) -> Outcome {
        match e {
            kube::Error::Api(status) => {
                self.answered = true;
                match status.code {
                    403 => Outcome::Forbidden(status.message),
                    404 => Outcome::NotFound(status.message),
                    code => Outcome::Failed(format!("HTTP {code}: {}", status.message)),
                }
            }
            other => {
                let msg = other.to_string();
                self.last_transport_error = Some(msg.clone());
                Outcome::Failed(msg)
            }
        }
    }

    fn known(&self, kind: CidrKind) -> Vec<IpNet> {
        let (pod, service) = split_by_kind(&self.sources);
        match kind {
            CidrKind::Pod => pod,
            CidrKind::Service => service,
        }
    }
}

/// Detect the cluster's pod and service CIDRs with `client` (the user's own
/// credentials), trying every source of the module docs in order and merging.
///
/// A failing source is recorded in [`DetectedCidrs::attempts`], never fatal; the
/// result may be empty. Errors: [`DetectError::Unreachable`] when no request got an
/// answer from the API server at all.
pub async fn detect_cidrs(
    client: &kube::Client,
    opts: &DetectOptions,
) -> Result<DetectedCidrs, DetectError> {
    let mut rec = Recorder::default();

    // 1. kube-system component flags and configuration.
    let result = component_flags(client).await;
    rec.record(Step::ComponentPods, result);
    let result = config_map_values(
        client,
        "kubeadm-config",
        "ClusterConfiguration",
        &[
            ("podSubnet", CidrKind::Pod),
            ("serviceSubnet", CidrKind::Service),
        ],
    )
    .await;
    rec.record(Step::KubeadmConfig, result);
    let result = config_map_values(
        client,
        "kube-proxy",
        "config.conf",
        &[("clusterCIDR", CidrKind::Pod)],
    )
    .await;
    rec.record(Step::KubeProxyConfig, result);

    // 2. The service CIDR from the API server.
    let result = service_cidr_objects(client).await;
    rec.record(Step::ServiceCidrObjects, result);
    let result = service_create_error(client, opts).await;
    rec.record(Step::ServiceCreateError, result);

    // 3. Node podCIDRs.
    let result = node_pod_cidrs(client).await;
    rec.record(Step::NodePodCidrs, result);

    // 4. Inference for addresses nothing above covers.
    for (step, kind) in [
        (Step::PodIps, CidrKind::Pod),
        (Step::ClusterIps, CidrKind::Service),
    ] {
        let ips = match kind {
            CidrKind::Pod => list_all(&Api::<Pod>::all(client.clone()))
                .await
                .map(|pods| routable_pod_ips(&pods)),
            CidrKind::Service => list_all(&Api::<Service>::all(client.clone()))
                .await
                .map(|svcs| cluster_ips(&svcs)),
        };
        match ips {
            Ok(ips) => {
                rec.answered = true;
                let (found, outcome) = infer_uncovered(kind, &rec.known(kind), &ips, opts.infer);
                tracing::debug!(%step, ?outcome, "CIDR detection step");
                rec.sources.extend(found);
                rec.attempts.push(Attempt { step, outcome });
            }
            Err(e) => rec.record(step, Err(e)),
        }
    }

    if !rec.answered {
        return Err(DetectError::Unreachable {
            last: rec.last_transport_error.unwrap_or_default(),
            attempts: rec.attempts,
        });
    }
    let (pod, service) = split_by_kind(&rec.sources);
    tracing::info!(?pod, ?service, "cluster CIDRs detected");
    Ok(DetectedCidrs {
        pod,
        service,
        sources: rec.sources,
        attempts: rec.attempts,
    })
}

/// Every object of `api`, in pages of 500 (large clusters have many pods).
async fn list_all<K>(api: &Api<K>) -> Result<Vec<K>, kube::Error>
where
    K: Clone + DeserializeOwned + fmt::Debug,
{
    let mut out = Vec::new();
    let mut params = ListParams::default().limit(500);
    loop {
        let page = api.list(&params).await?;
        out.extend(page.items);
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => return Ok(out),
        }
    }
}

async fn component_flags(client: &kube::Client) -> Result<StepFound, kube::Error> {
    let pods = list_all(&Api::<Pod>::namespaced(client.clone(), "kube-system")).await?;
    let mut found = Vec::new();
    for pod in &pods {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let Some(spec) = &pod.spec else { continue };
        for c in spec
            .containers
            .iter()
            .chain(spec.init_containers.iter().flatten())
        {
            let words = c.command.iter().flatten().chain(c.args.iter().flatten());
            for (kind, flag, cidr) in parse_component_flags(words.map(String::as_str)) {
                found.push((
                    cidr,
                    Source {
                        kind,
                        origin: Origin::ComponentFlag {
                            pod: name.clone(),
                            flag: flag.to_owned(),
                        },
                    },
                ));
            }
        }
    }
    Ok(StepFound {
        found,
        note: format!(
            "{} pods, none with {SERVICE_RANGE_FLAG} or {CLUSTER_CIDR_FLAG}",
            pods.len()
        ),
    })
}

async fn config_map_values(
    client: &kube::Client,
    name: &str,
    data_key: &str,
    keys: &[(&str, CidrKind)],
) -> Result<StepFound, kube::Error> {
    let cm = Api::<ConfigMap>::namespaced(client.clone(), "kube-system")
        .get(name)
        .await?;
    let Some(text) = cm.data.as_ref().and_then(|d| d.get(data_key)) else {
        return Ok(StepFound::none(format!("no {data_key} in it")));
    };
    let mut found = Vec::new();
    for (key, kind) in keys {
        for cidr in parse_config_values(text, key) {
            found.push((
                cidr,
                Source {
                    kind: *kind,
                    origin: Origin::ConfigMapKey {
                        config_map: name.to_owned(),
                        key: (*key).to_owned(),
                    },
                },
            ));
        }
    }
    let names: Vec<&str> = keys.iter().map(|(k, _)| *k).collect();
    Ok(StepFound {
        found,
        note: format!("no {} in {data_key}", names.join(" or ")),
    })
}

async fn service_cidr_objects(client: &kube::Client) -> Result<StepFound, kube::Error> {
    let objects = list_all(&Api::<ServiceCIDR>::all(client.clone())).await?;
    let mut found = Vec::new();
    for obj in &objects {
        let name = obj.metadata.name.clone().unwrap_or_default();
        for cidr in obj.spec.iter().flat_map(|s| s.cidrs.iter().flatten()) {
            if let Ok(net) = cidr.parse::<IpNet>() {
                found.push((
                    net,
                    Source {
                        kind: CidrKind::Service,
                        origin: Origin::ServiceCidrObject { name: name.clone() },
                    },
                ));
            }
        }
    }
    Ok(StepFound {
        found,
        note: format!("{} objects without CIDRs", objects.len()),
    })
}

/// The Service the error trick offers: ClusterIP `ip`, one port, a generated name.
fn probe_service(ip: IpAddr) -> Service {
    let family = if ip.is_ipv4() { "IPv4" } else { "IPv6" };
    Service {
        metadata: ObjectMeta {
            generate_name: Some("kvpn-cidr-probe-".to_owned()),
            labels: Some(
                [(
                    "app.kubernetes.io/name".to_owned(),
                    "kvpn-cidr-probe".to_owned(),
                )]
                .into(),
            ),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            cluster_ip: Some(ip.to_string()),
            cluster_ips: Some(vec![ip.to_string()]),
            ip_families: Some(vec![family.to_owned()]),
            ports: Some(vec![ServicePort {
                port: 443,
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// What the API server said to one probe Service.
enum ProbeAnswer {
    /// Refused, naming its range(s).
    Ranges(Vec<IpNet>),
    /// Refused for another reason (e.g. an IP family the cluster does not serve).
    Refused(String),
    /// Accepted: with a dry run, the range was not checked; otherwise a Service of
    /// this name now exists.
    Accepted(String),
}

async fn probe(api: &Api<Service>, ip: IpAddr, dry_run: bool) -> Result<ProbeAnswer, kube::Error> {
    let params = PostParams {
        dry_run,
        field_manager: Some("kvpn".to_owned()),
    };
    match api.create(&params, &probe_service(ip)).await {
        Ok(svc) => Ok(ProbeAnswer::Accepted(svc.metadata.name.unwrap_or_default())),
        Err(kube::Error::Api(s)) if s.code == 422 || s.code == 400 => {
            let ranges = parse_valid_ranges(&s.message);
            Ok(if ranges.is_empty() {
                ProbeAnswer::Refused(s.message)
            } else {
                ProbeAnswer::Ranges(ranges)
            })
        }
        Err(e) => Err(e),
    }
}

/// The error trick. Each probe IP is first offered in a dry run, which stores
/// nothing. Kubernetes 1.20 skips the ClusterIP allocation in dry runs and accepts
/// any address (seen in the lab), so when the dry run accepts the *unspecified*
/// address (`0.0.0.0`, `::`) it is offered once more for real: no service CIDR can
/// hold it, so the allocator refuses and nothing is stored. Should it be accepted
/// anyway, the Service is deleted again (or the note says it could not be).
async fn service_create_error(
    client: &kube::Client,
    opts: &DetectOptions,
) -> Result<StepFound, kube::Error> {
    let mut api = Api::<Service>::namespaced(client.clone(), &opts.namespace);
    let mut namespace = opts.namespace.clone();
    let mut found: Vec<(IpNet, Source)> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    let mut last_error: Option<kube::Error> = None;
    for ip in &opts.probe_ips {
        if found
            .iter()
            .any(|(n, _)| n.addr().is_ipv4() == ip.is_ipv4())
        {
            continue; // this family's range is known
        }
        let mut answer = probe(&api, *ip, true).await;
        // kvpn's namespace may not exist before the first install.
        if let Err(kube::Error::Api(s)) = &answer
            && s.code == 404
            && namespace != "default"
        {
            tracing::debug!(%namespace, "namespace missing, probing the service CIDR in default");
            namespace = "default".to_owned();
            api = Api::<Service>::namespaced(client.clone(), &namespace);
            answer = probe(&api, *ip, true).await;
        }
        if matches!(answer, Ok(ProbeAnswer::Accepted(_))) && ip.is_unspecified() {
            tracing::debug!(%ip, "dry run accepted the ClusterIP unchecked, offering it for real");
            answer = probe(&api, *ip, false).await;
            if let Ok(ProbeAnswer::Accepted(name)) = &answer {
                let deleted = api.delete(name, &Default::default()).await;
                notes.push(match deleted {
                    Ok(_) => format!(
                        "ClusterIP {ip} was accepted (Service {namespace}/{name} deleted again)"
                    ),
                    Err(e) => format!(
                        "ClusterIP {ip} was accepted and Service {namespace}/{name} could not be \
                         deleted ({e}): delete it by hand"
                    ),
                });
                continue;
            }
        }
        match answer {
            Ok(ProbeAnswer::Ranges(ranges)) => {
                for net in ranges {
                    if found.iter().any(|(n, _)| *n == net) {
                        continue; // a second family's probe naming the same range
                    }
                    found.push((
                        net,
                        Source {
                            kind: CidrKind::Service,
                            origin: Origin::ServiceCreateError { probe_ip: *ip },
                        },
                    ));
                }
            }
            Ok(ProbeAnswer::Refused(message)) => notes.push(format!("{ip}: {message}")),
            Ok(ProbeAnswer::Accepted(_)) => {
                notes.push(format!("ClusterIP {ip} was accepted by a dry run"));
            }
            Err(e) => last_error = Some(e),
        }
    }
    match last_error {
        // Every probe failed the same way (403, unreachable): report that.
        Some(e) if found.is_empty() && notes.is_empty() => Err(e),
        _ => Ok(StepFound {
            found,
            note: notes.join("; "),
        }),
    }
}

async fn node_pod_cidrs(client: &kube::Client) -> Result<StepFound, kube::Error> {
    let nodes = list_all(&Api::<Node>::all(client.clone())).await?;
    let mut found = Vec::new();
    for node in &nodes {
        let name = node.metadata.name.clone().unwrap_or_default();
        let Some(spec) = &node.spec else { continue };
        let mut cidrs: Vec<&String> = spec.pod_cidrs.iter().flatten().collect();
        if cidrs.is_empty() {
            cidrs.extend(spec.pod_cidr.iter());
        }
        for c in cidrs {
            if let Ok(net) = c.parse::<IpNet>() {
                found.push((
                    net,
                    Source {
                        kind: CidrKind::Pod,
                        origin: Origin::NodePodCidr { node: name.clone() },
                    },
                ));
            }
        }
    }
    Ok(StepFound {
        found,
        note: format!("{} nodes, none with spec.podCIDR", nodes.len()),
    })
}

#[cfg(test)]
mod tests;
