//! Pure translation of a pod spec into what the kubelet stand-in runs: environment
//! (`env`, `envFrom`, `valueFrom`, `$(VAR)` expansion), the files of Secret, ConfigMap,
//! downward API and emptyDir volumes, the pod's `resolv.conf` and `hosts`, probe ports
//! and the pod's netns name. No I/O: Secrets and ConfigMaps are fetched by the caller
//! ([`Sources`]) and passed in.
//!
//! Semantics follow the Kubernetes API reference (core/v1 `EnvVar`, `Volume`,
//! `PodDNSConfig`) and the kubelet's `third_party/forked/golang/expansion`.

use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::path::PathBuf;

use k8s_openapi::api::core::v1::{
    ConfigMapVolumeSource, Container, KeyToPath, ObjectFieldSelector, Pod, SecretVolumeSource,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

/// Secrets and ConfigMaps of the pod's namespace that the pod refers to and that exist
/// (a missing one is absent). Secret values are raw bytes.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    pub secrets: HashMap<String, BTreeMap<String, Vec<u8>>>,
    pub config_maps: HashMap<String, BTreeMap<String, Vec<u8>>>,
}

/// Names of the Secrets and ConfigMaps a pod refers to (env, envFrom, volumes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct References {
    pub secrets: Vec<String>,
    pub config_maps: Vec<String>,
}

/// Where the pod is, for `fieldRef`s and files.
#[derive(Debug, Clone)]
pub struct PodPlace {
    pub pod_ip: Ipv4Addr,
    pub host_ip: Ipv4Addr,
    pub node_name: String,
}

/// A pod spec the stand-in cannot run as given: the container waits with reason
/// `CreateContainerConfigError` and this message (the kubelet's wording).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

fn push_unique(v: &mut Vec<String>, s: &str) {
    if !v.iter().any(|x| x == s) {
        v.push(s.to_owned());
    }
}

/// Every Secret and ConfigMap the pod refers to.
pub fn references(pod: &Pod) -> References {
    let mut r = References::default();
    let Some(spec) = &pod.spec else { return r };
    for c in spec
        .init_containers
        .iter()
        .flatten()
        .chain(spec.containers.iter())
    {
        for e in c.env_from.iter().flatten() {
            if let Some(s) = &e.secret_ref {
                push_unique(&mut r.secrets, &s.name);
            }
            if let Some(m) = &e.config_map_ref {
                push_unique(&mut r.config_maps, &m.name);
            }
        }
        for e in c.env.iter().flatten() {
            if let Some(from) = &e.value_from {
                if let Some(s) = &from.secret_key_ref {
                    push_unique(&mut r.secrets, &s.name);
                }
                if let Some(m) = &from.config_map_key_ref {
                    push_unique(&mut r.config_maps, &m.name);
                }
            }
        }
    }
    for v in spec.volumes.iter().flatten() {
        if let Some(s) = v.secret.as_ref().and_then(|s| s.secret_name.as_deref()) {
            push_unique(&mut r.secrets, s);
        }
        if let Some(m) = &v.config_map {
            push_unique(&mut r.config_maps, &m.name);
        }
        for src in v.projected.iter().flat_map(|p| p.sources.iter().flatten()) {
            if let Some(s) = &src.secret {
                push_unique(&mut r.secrets, &s.name);
            }
            if let Some(m) = &src.config_map {
                push_unique(&mut r.config_maps, &m.name);
            }
        }
    }
    r
}

/// `$(VAR)` expansion as the kubelet does it: `$(NAME)` becomes NAME's value when
/// defined and stays as written otherwise, `$$` becomes `$`.
pub fn expand(input: &str, lookup: impl Fn(&str) -> Option<String>) -> String {
    let mut out = String::with_capacity(input.len());
    let mut rest = input;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(inner) = after.strip_prefix('(') {
            match inner.find(')') {
                Some(end) => {
                    let name = &inner[..end];
                    match lookup(name) {
                        Some(v) => out.push_str(&v),
                        None => {
                            out.push_str("$(");
                            out.push_str(name);
                            out.push(')');
                        }
                    }
                    rest = &inner[end + 1..];
                }
                None => {
                    out.push_str("$(");
                    rest = inner;
                }
            }
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// The value of a `fieldRef` (downward API), or a [`ConfigError`] for an unsupported
/// path.
pub fn field_value(
    pod: &Pod,
    place: &PodPlace,
    sel: &ObjectFieldSelector,
) -> Result<String, ConfigError> {
    let meta = &pod.metadata;
    let path = sel.field_path.as_str();
    let bracket = |prefix: &str| -> Option<String> {
        let key = path.strip_prefix(prefix)?.strip_suffix("']")?;
        Some(key.to_owned())
    };
    let v = match path {
        "metadata.name" => meta.name.clone().unwrap_or_default(),
        "metadata.namespace" => meta.namespace.clone().unwrap_or_default(),
        "metadata.uid" => meta.uid.clone().unwrap_or_default(),
        "spec.nodeName" => place.node_name.clone(),
        "spec.serviceAccountName" => pod
            .spec
            .as_ref()
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_default(),
        "status.hostIP" | "status.hostIPs" => place.host_ip.to_string(),
        "status.podIP" | "status.podIPs" => place.pod_ip.to_string(),
        _ => {
            if let Some(k) = bracket("metadata.labels['") {
                meta.labels
                    .as_ref()
                    .and_then(|l| l.get(&k).cloned())
                    .unwrap_or_default()
            } else if let Some(k) = bracket("metadata.annotations['") {
                meta.annotations
                    .as_ref()
                    .and_then(|l| l.get(&k).cloned())
                    .unwrap_or_default()
            } else {
                return Err(ConfigError(format!(
                    "unsupported fieldPath: {path} (kvpn lab kubelet stand-in)"
                )));
            }
        }
    };
    Ok(v)
}

fn valid_env_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

/// The container's environment: `base` (the stand-in's defaults and the Kubernetes
/// service variables), then `envFrom` in order, then `env` in order (later wins), each
/// `env` value `$(VAR)`-expanded against what was defined before it.
pub fn container_env(
    pod: &Pod,
    container: &Container,
    place: &PodPlace,
    sources: &Sources,
    base: &[(String, String)],
) -> Result<Vec<(String, String)>, ConfigError> {
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    let mut env: Vec<(String, String)> = Vec::new();
    let set = |env: &mut Vec<(String, String)>, k: String, v: String| {
        if let Some(slot) = env.iter_mut().find(|(key, _)| *key == k) {
            slot.1 = v;
        } else {
            env.push((k, v));
        }
    };
    for (k, v) in base {
        set(&mut env, k.clone(), v.clone());
    }
    for from in container.env_from.iter().flatten() {
        let prefix = from.prefix.clone().unwrap_or_default();
        let (data, optional, kind, name) = if let Some(s) = &from.secret_ref {
            (
                sources.secrets.get(&s.name),
                s.optional.unwrap_or(false),
                "secret",
                &s.name,
            )
        } else if let Some(m) = &from.config_map_ref {
            (
                sources.config_maps.get(&m.name),
                m.optional.unwrap_or(false),
                "configmap",
                &m.name,
            )
        } else {
            continue;
        };
        match data {
            Some(data) => {
                for (k, v) in data {
                    let key = format!("{prefix}{k}");
                    if valid_env_name(&key) {
                        set(&mut env, key, String::from_utf8_lossy(v).into_owned());
                    }
                }
            }
            None if optional => {}
            None => return Err(ConfigError(format!("{kind} \"{name}\" not found"))),
        }
    }
    for var in container.env.iter().flatten() {
        let value = if let Some(from) = &var.value_from {
            if let Some(f) = &from.field_ref {
                Some(field_value(pod, place, f)?)
            } else if let Some(s) = &from.secret_key_ref {
                key_ref(
                    sources.secrets.get(&s.name),
                    &s.name,
                    &s.key,
                    s.optional,
                    "secret",
                    "Secret",
                    ns,
                )?
            } else if let Some(m) = &from.config_map_key_ref {
                key_ref(
                    sources.config_maps.get(&m.name),
                    &m.name,
                    &m.key,
                    m.optional,
                    "configmap",
                    "ConfigMap",
                    ns,
                )?
            } else if let Some(r) = &from.resource_field_ref {
                let resources = container.resources.as_ref();
                let pick = |m: Option<
                    &BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
                >| {
                    let res = r
                        .resource
                        .split_once('.')
                        .map_or(r.resource.as_str(), |x| x.1);
                    m.and_then(|m| m.get(res)).map(|q| q.0.clone())
                };
                let v = if r.resource.starts_with("limits.") {
                    pick(resources.and_then(|x| x.limits.as_ref()))
                } else {
                    pick(resources.and_then(|x| x.requests.as_ref()))
                };
                Some(v.unwrap_or_default())
            } else {
                None
            }
        } else {
            let defined = env.clone();
            Some(expand(var.value.as_deref().unwrap_or(""), |name| {
                defined
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.clone())
            }))
        };
        if let Some(v) = value {
            set(&mut env, var.name.clone(), v);
        }
    }
    Ok(env)
}

fn key_ref(
    data: Option<&BTreeMap<String, Vec<u8>>>,
    name: &str,
    key: &str,
    optional: Option<bool>,
    lower: &str,
    kind: &str,
    ns: &str,
) -> Result<Option<String>, ConfigError> {
    let optional = optional.unwrap_or(false);
    match data {
        None if optional => Ok(None),
        None => Err(ConfigError(format!("{lower} \"{name}\" not found"))),
        Some(d) => match d.get(key) {
            Some(v) => Ok(Some(String::from_utf8_lossy(v).into_owned())),
            None if optional => Ok(None),
            None => Err(ConfigError(format!(
                "couldn't find key {key} in {kind} {ns}/{name}"
            ))),
        },
    }
}

/// `command` and `args` with `$(VAR)` expanded against the container's final env.
pub fn expand_command(
    container: &Container,
    env: &[(String, String)],
) -> (Vec<String>, Vec<String>) {
    let lookup = |name: &str| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let ex = |v: &Option<Vec<String>>| -> Vec<String> {
        v.iter().flatten().map(|s| expand(s, lookup)).collect()
    };
    (ex(&container.command), ex(&container.args))
}

/// One file of a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeFile {
    /// Relative path inside the volume (may contain `/`).
    pub path: String,
    pub contents: Vec<u8>,
    /// Permission bits.
    pub mode: u32,
}

/// What a volume holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeContent {
    /// Files written into the volume's folder under the pod folder.
    Files(Vec<VolumeFile>),
    /// An existing folder of the machine (hostPath), mounted as is.
    HostPath(PathBuf),
    /// A volume type the stand-in does not implement: mounts of it are skipped with a
    /// warning.
    Unsupported(String),
}

/// Default permission bits of Secret and ConfigMap files (`defaultMode`).
const DEFAULT_MODE: u32 = 0o644;

fn mode_of(m: Option<i32>, default: u32) -> u32 {
    m.and_then(|m| u32::try_from(m).ok())
        .map_or(default, |m| m & 0o7777)
}

fn files_from(
    data: &BTreeMap<String, Vec<u8>>,
    items: Option<&Vec<KeyToPath>>,
    default_mode: u32,
    what: &str,
) -> Result<Vec<VolumeFile>, ConfigError> {
    match items {
        None => Ok(data
            .iter()
            .map(|(k, v)| VolumeFile {
                path: k.clone(),
                contents: v.clone(),
                mode: default_mode,
            })
            .collect()),
        Some(items) => items
            .iter()
            .map(|it| {
                let v = data.get(&it.key).ok_or_else(|| {
                    ConfigError(format!("configured key {} not found in {what}", it.key))
                })?;
                Ok(VolumeFile {
                    path: it.path.clone(),
                    contents: v.clone(),
                    mode: mode_of(it.mode, default_mode),
                })
            })
            .collect(),
    }
}

fn secret_files(s: &SecretVolumeSource, sources: &Sources) -> Result<Vec<VolumeFile>, ConfigError> {
    let name = s.secret_name.clone().unwrap_or_default();
    let mode = mode_of(s.default_mode, DEFAULT_MODE);
    match sources.secrets.get(&name) {
        Some(d) => files_from(d, s.items.as_ref(), mode, &format!("secret {name}")),
        None if s.optional.unwrap_or(false) => Ok(Vec::new()),
        None => Err(ConfigError(format!(
            "MountVolume.SetUp failed: secret \"{name}\" not found"
        ))),
    }
}

fn config_map_files(
    m: &ConfigMapVolumeSource,
    sources: &Sources,
) -> Result<Vec<VolumeFile>, ConfigError> {
    let mode = mode_of(m.default_mode, DEFAULT_MODE);
    match sources.config_maps.get(&m.name) {
        Some(d) => files_from(d, m.items.as_ref(), mode, &format!("configmap {}", m.name)),
        None if m.optional.unwrap_or(false) => Ok(Vec::new()),
        None => Err(ConfigError(format!(
            "MountVolume.SetUp failed: configmap \"{}\" not found",
            m.name
        ))),
    }
}

/// The content of every volume of the pod, by volume name. A missing Secret or
/// ConfigMap that is not optional is a [`ConfigError`] (the pod stays in
/// ContainerCreating until it exists).
pub fn volume_contents(
    pod: &Pod,
    place: &PodPlace,
    sources: &Sources,
) -> Result<Vec<(String, VolumeContent)>, ConfigError> {
    let Some(spec) = &pod.spec else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for v in spec.volumes.iter().flatten() {
        let content = if let Some(s) = &v.secret {
            VolumeContent::Files(secret_files(s, sources)?)
        } else if let Some(m) = &v.config_map {
            VolumeContent::Files(config_map_files(m, sources)?)
        } else if v.empty_dir.is_some() {
            VolumeContent::Files(Vec::new())
        } else if let Some(h) = &v.host_path {
            VolumeContent::HostPath(PathBuf::from(&h.path))
        } else if let Some(d) = &v.downward_api {
            let mode = mode_of(d.default_mode, DEFAULT_MODE);
            let mut files = Vec::new();
            for it in d.items.iter().flatten() {
                if let Some(f) = &it.field_ref {
                    files.push(VolumeFile {
                        path: it.path.clone(),
                        contents: field_value(pod, place, f)?.into_bytes(),
                        mode: mode_of(it.mode, mode),
                    });
                }
            }
            VolumeContent::Files(files)
        } else if let Some(p) = &v.projected {
            let mode = mode_of(p.default_mode, DEFAULT_MODE);
            let mut files = Vec::new();
            let mut unsupported = None;
            for src in p.sources.iter().flatten() {
                if let Some(s) = &src.secret {
                    match sources.secrets.get(&s.name) {
                        Some(d) => files.extend(files_from(
                            d,
                            s.items.as_ref(),
                            mode,
                            &format!("secret {}", s.name),
                        )?),
                        None if s.optional.unwrap_or(false) => {}
                        None => {
                            return Err(ConfigError(format!(
                                "MountVolume.SetUp failed: secret \"{}\" not found",
                                s.name
                            )));
                        }
                    }
                } else if let Some(m) = &src.config_map {
                    match sources.config_maps.get(&m.name) {
                        Some(d) => files.extend(files_from(
                            d,
                            m.items.as_ref(),
                            mode,
                            &format!("configmap {}", m.name),
                        )?),
                        None if m.optional.unwrap_or(false) => {}
                        None => {
                            return Err(ConfigError(format!(
                                "MountVolume.SetUp failed: configmap \"{}\" not found",
                                m.name
                            )));
                        }
                    }
                } else if let Some(d) = &src.downward_api {
                    for it in d.items.iter().flatten() {
                        if let Some(f) = &it.field_ref {
                            files.push(VolumeFile {
                                path: it.path.clone(),
                                contents: field_value(pod, place, f)?.into_bytes(),
                                mode: mode_of(it.mode, mode),
                            });
                        }
                    }
                } else {
                    unsupported = Some("projected serviceAccountToken/clusterTrustBundle");
                }
            }
            match unsupported {
                Some(what) if files.is_empty() => VolumeContent::Unsupported(what.to_owned()),
                _ => VolumeContent::Files(files),
            }
        } else {
            VolumeContent::Unsupported("volume type".to_owned())
        };
        out.push((v.name.clone(), content));
    }
    Ok(out)
}

/// True when a volume file path stays inside its volume (no absolute path, no `..`).
pub fn safe_relative_path(path: &str) -> bool {
    !path.is_empty()
        && !path.starts_with('/')
        && path
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..")
}

/// Cluster DNS settings of the lab (the DNS stand-in's ClusterIP and domain).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterDns {
    pub nameserver: Ipv4Addr,
    /// e.g. `cluster.local`.
    pub domain: String,
}

/// The pod's `/etc/resolv.conf` per its `dnsPolicy`, or None to keep the machine's
/// (`Default`, or `ClusterFirst` when the lab runs no cluster DNS). `ClusterFirst`:
/// the cluster nameserver, search `<ns>.svc.<domain> svc.<domain> <domain>`,
/// `options ndots:5`; `dnsConfig` entries are appended (nameservers, searches) or
/// override (options by name), as the kubelet does.
pub fn resolv_conf(pod: &Pod, dns: Option<&ClusterDns>) -> Option<String> {
    let spec = pod.spec.as_ref()?;
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    let policy = spec.dns_policy.as_deref().unwrap_or("ClusterFirst");
    type DnsOptions = Vec<(String, Option<String>)>;
    let (mut servers, mut searches, mut options): (Vec<String>, Vec<String>, DnsOptions) =
        match (policy, dns) {
            ("ClusterFirst" | "ClusterFirstWithHostNet", Some(d)) => (
                vec![d.nameserver.to_string()],
                vec![
                    format!("{ns}.svc.{}", d.domain),
                    format!("svc.{}", d.domain),
                    d.domain.clone(),
                ],
                vec![("ndots".to_owned(), Some("5".to_owned()))],
            ),
            ("None", _) => (Vec::new(), Vec::new(), Vec::new()),
            _ => return None,
        };
    if let Some(cfg) = &spec.dns_config {
        servers.extend(cfg.nameservers.iter().flatten().cloned());
        searches.extend(cfg.searches.iter().flatten().cloned());
        for o in cfg.options.iter().flatten() {
            let Some(name) = &o.name else { continue };
            options.retain(|(n, _)| n != name);
            options.push((name.clone(), o.value.clone()));
        }
    }
    let mut out = String::from("# written by the kvpn lab kubelet stand-in\n");
    if !searches.is_empty() {
        out.push_str(&format!("search {}\n", searches.join(" ")));
    }
    for s in servers {
        out.push_str(&format!("nameserver {s}\n"));
    }
    if !options.is_empty() {
        let opts: Vec<String> = options
            .into_iter()
            .map(|(n, v)| match v {
                Some(v) => format!("{n}:{v}"),
                None => n,
            })
            .collect();
        out.push_str(&format!("options {}\n", opts.join(" ")));
    }
    Some(out)
}

/// The pod's `/etc/hosts`: localhost and its own IP under its hostname.
pub fn hosts_file(hostname: &str, pod_ip: Ipv4Addr) -> String {
    format!(
        "# Kubernetes-managed hosts file (kvpn lab kubelet stand-in).\n\
         127.0.0.1\tlocalhost\n\
         ::1\tlocalhost ip6-localhost ip6-loopback\n\
         {pod_ip}\t{hostname}\n"
    )
}

/// The pod's hostname: `spec.hostname` or the pod name, cut to 63 bytes.
pub fn hostname(pod: &Pod) -> String {
    let name = pod
        .spec
        .as_ref()
        .and_then(|s| s.hostname.clone())
        .or_else(|| pod.metadata.name.clone())
        .unwrap_or_else(|| "pod".to_owned());
    name.chars().take(63).collect()
}

/// The netns role of a pod (`kvpn-<lab id>-<role>`): the pod name made netns-safe
/// (`.` → `-`, at most 60 bytes) plus the first 5 characters of its UID, so pods of
/// different namespaces or re-created pods with the same name never collide.
pub fn netns_role(pod_name: &str, uid: &str) -> String {
    let name: String = pod_name
        .chars()
        .map(|c| {
            if c.is_ascii_lowercase() || c.is_ascii_digit() {
                c
            } else {
                '-'
            }
        })
        .take(60)
        .collect();
    let uid: String = uid
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .map(|c| c.to_ascii_lowercase())
        .take(5)
        .collect();
    format!("{}-{uid}", name.trim_matches('-'))
}

/// A probe's port: a number, or the name of one of the container's ports.
pub fn resolve_port(port: &IntOrString, container: &Container) -> Option<u16> {
    match port {
        IntOrString::Int(p) => u16::try_from(*p).ok().filter(|p| *p != 0),
        IntOrString::String(name) => {
            if let Ok(p) = name.parse::<u16>() {
                return Some(p);
            }
            container
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some(name.as_str()))
                .and_then(|p| u16::try_from(p.container_port).ok())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).expect("pod json")
    }

    fn place() -> PodPlace {
        PodPlace {
            pod_ip: Ipv4Addr::new(10, 244, 1, 7),
            host_ip: Ipv4Addr::new(127, 0, 0, 1),
            node_name: "kvpn-abcde-node".into(),
        }
    }

    #[test]
    fn expansion_follows_the_kubelet() {
        let l = |n: &str| (n == "A").then(|| "x".to_owned());
        assert_eq!(expand("$(A)-$(B)", l), "x-$(B)");
        assert_eq!(expand("$$(A)", l), "$(A)");
        assert_eq!(expand("a$b $(A", l), "a$b $(A");
        assert_eq!(expand("$(A)$(A)", l), "xx");
        assert_eq!(expand("", l), "");
    }

    #[test]
    fn env_resolves_field_refs_secrets_and_expansion() {
        let p = pod(serde_json::json!({
            "metadata": {"name": "web-1", "namespace": "t", "uid": "u-1", "labels": {"app": "web"}},
            "spec": {"containers": [{
                "name": "c", "image": "busybox",
                "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
                "env": [
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                    {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
                    {"name": "GREETING", "value": "hi $(POD_NAME) at $(POD_IP), $(NOPE)"}
                ],
                "args": ["--name", "$(POD_NAME)"]
            }]}
        }));
        let mut sources = Sources::default();
        sources
            .secrets
            .insert("s".into(), [("token".to_owned(), b"t0k".to_vec())].into());
        sources
            .config_maps
            .insert("cm".into(), [("mode".to_owned(), b"fast".to_vec())].into());
        let c = &p.spec.as_ref().expect("spec").containers[0];
        let env = container_env(&p, c, &place(), &sources, &[("PATH".into(), "/bin".into())])
            .expect("env");
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("PATH"), Some("/bin"));
        assert_eq!(get("CM_mode"), Some("fast"));
        assert_eq!(get("POD_NAME"), Some("web-1"));
        assert_eq!(get("POD_IP"), Some("10.244.1.7"));
        assert_eq!(get("APP"), Some("web"));
        assert_eq!(get("TOKEN"), Some("t0k"));
        assert_eq!(get("GREETING"), Some("hi web-1 at 10.244.1.7, $(NOPE)"));
        let (cmd, args) = expand_command(c, &env);
        assert!(cmd.is_empty());
        assert_eq!(args, vec!["--name".to_owned(), "web-1".to_owned()]);

        // A missing secret is the kubelet's CreateContainerConfigError text.
        let err = container_env(
            &p,
            c,
            &place(),
            &Sources {
                config_maps: sources.config_maps.clone(),
                ..Default::default()
            },
            &[],
        )
        .expect_err("missing secret");
        assert_eq!(err.0, "secret \"s\" not found");
    }

    #[test]
    fn volumes_hold_secret_files_with_items_and_modes() {
        let p = pod(serde_json::json!({
            "metadata": {"name": "m", "namespace": "kvpn-system"},
            "spec": {"containers": [{"name": "c", "image": "x"}], "volumes": [
                {"name": "tls", "secret": {"secretName": "tls", "defaultMode": 0o400}},
                {"name": "one", "secret": {"secretName": "tls", "items": [{"key": "tls.crt", "path": "certs/server.crt"}]}},
                {"name": "cache", "emptyDir": {}},
                {"name": "opt", "configMap": {"name": "absent", "optional": true}},
                {"name": "weird", "persistentVolumeClaim": {"claimName": "x"}}
            ]}
        }));
        let mut sources = Sources::default();
        sources.secrets.insert(
            "tls".into(),
            [
                ("tls.crt".to_owned(), b"CERT".to_vec()),
                ("tls.key".to_owned(), b"KEY".to_vec()),
            ]
            .into(),
        );
        let vols = volume_contents(&p, &place(), &sources).expect("volumes");
        assert_eq!(vols.len(), 5);
        let VolumeContent::Files(tls) = &vols[0].1 else {
            panic!("files")
        };
        assert_eq!(tls.len(), 2);
        assert!(tls.iter().all(|f| f.mode == 0o400));
        let VolumeContent::Files(one) = &vols[1].1 else {
            panic!("files")
        };
        assert_eq!(
            one,
            &vec![VolumeFile {
                path: "certs/server.crt".into(),
                contents: b"CERT".to_vec(),
                mode: 0o644
            }]
        );
        assert_eq!(vols[2].1, VolumeContent::Files(Vec::new()));
        assert_eq!(vols[3].1, VolumeContent::Files(Vec::new()));
        assert!(matches!(vols[4].1, VolumeContent::Unsupported(_)));
        let err = volume_contents(&p, &place(), &Sources::default()).expect_err("missing");
        assert!(err.0.contains("secret \"tls\" not found"), "{}", err.0);
        assert_eq!(
            references(&p),
            References {
                secrets: vec!["tls".into()],
                config_maps: vec!["absent".into()]
            }
        );
    }

    #[test]
    fn resolv_conf_per_dns_policy() {
        let dns = ClusterDns {
            nameserver: Ipv4Addr::new(10, 96, 0, 10),
            domain: "cluster.local".into(),
        };
        let p = pod(
            serde_json::json!({"metadata": {"name": "a", "namespace": "shop"}, "spec": {"containers": []}}),
        );
        let text = resolv_conf(&p, Some(&dns)).expect("ClusterFirst");
        assert!(
            text.contains("search shop.svc.cluster.local svc.cluster.local cluster.local\n"),
            "{text}"
        );
        assert!(text.contains("nameserver 10.96.0.10\n"));
        assert!(text.contains("options ndots:5\n"));
        assert_eq!(resolv_conf(&p, None), None);
        let p = pod(
            serde_json::json!({"metadata": {"name": "a", "namespace": "shop"}, "spec": {"containers": [], "dnsPolicy": "Default"}}),
        );
        assert_eq!(resolv_conf(&p, Some(&dns)), None);
        let p = pod(
            serde_json::json!({"metadata": {"name": "a"}, "spec": {"containers": [], "dnsPolicy": "None",
            "dnsConfig": {"nameservers": ["1.2.3.4"], "options": [{"name": "ndots", "value": "2"}, {"name": "edns0"}]}}}),
        );
        let text = resolv_conf(&p, Some(&dns)).expect("None policy");
        assert!(
            text.contains("nameserver 1.2.3.4\n") && text.contains("options ndots:2 edns0\n"),
            "{text}"
        );
    }

    #[test]
    fn netns_roles_are_safe_and_unique() {
        assert_eq!(
            netns_role("web-7d4b9c-xk2lp", "3f9a1c2e-aaaa"),
            "web-7d4b9c-xk2lp-3f9a1"
        );
        assert_eq!(netns_role("a.b", "ABCDEF"), "a-b-abcde");
        assert!(netns_role(&"x".repeat(200), "12345").len() <= 66);
        assert!(safe_relative_path("certs/a.crt"));
        assert!(!safe_relative_path("../etc/passwd"));
        assert!(!safe_relative_path("/abs"));
    }

    #[test]
    fn probe_ports_by_number_or_name() {
        let c: Container = serde_json::from_value(serde_json::json!({
            "name": "c", "ports": [{"name": "http", "containerPort": 8080}]
        }))
        .expect("container");
        assert_eq!(resolve_port(&IntOrString::Int(7007), &c), Some(7007));
        assert_eq!(
            resolve_port(&IntOrString::String("http".into()), &c),
            Some(8080)
        );
        assert_eq!(resolve_port(&IntOrString::String("nope".into()), &c), None);
        assert_eq!(resolve_port(&IntOrString::Int(0), &c), None);
    }
}
