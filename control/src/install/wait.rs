//! Waiting for the manager pod (pure core: no I/O, the clock comes in as `now`).
//!
//! The install shell lists the manager's pods (and reads its Deployment) every
//! poll interval and feeds each snapshot to [`ReadyWait::handle_snapshot`], which
//! answers with a [`Verdict`] and queues one progress line per pod whose shown
//! state changed ([`ReadyWait::poll_progress`]), e.g.
//! `Pod kvpn-manager-7d9f-x2: Pending (ContainerCreating)` or
//! `Pod kvpn-manager-7d9f-x2: Waiting: ErrImagePull: <the kubelet's message>`.
//!
//! Only pods of the awaited pod template count (their [`ANNOTATION_TEMPLATE_HASH`]
//! matches), so during an upgrade the old, still-ready pod is not mistaken for the
//! new one.
//!
//! Failing early: a container reason that does not heal by itself
//! ([`FATAL_WAITING_REASONS`]), a container that exited with an error after more
//! than one restart, a Failed pod, or a Deployment that cannot create pods
//! (`ReplicaFailure`) fails the wait once it has persisted for
//! [`WaitConfig::fatal_grace`] (a registry hiccup gets one retry). Otherwise the
//! wait fails after [`WaitConfig::ready_timeout`] with the last state seen.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};

use super::objects::ANNOTATION_TEMPLATE_HASH;

/// Container waiting reasons that do not heal by themselves.
pub const FATAL_WAITING_REASONS: &[&str] = &[
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "CrashLoopBackOff",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
];

/// Bounds of the wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitConfig {
    /// Give up when no pod of the template is ready after this long.
    pub ready_timeout: Duration,
    /// Fail once a fatal reason has persisted this long.
    pub fatal_grace: Duration,
}

impl Default for WaitConfig {
    /// 120 s overall; 10 s of a fatal reason. With the kubelet's image back-off
    /// (ErrImagePull, then ImagePullBackOff), a bad image fails within about 15 s
    /// of the pod's creation.
    fn default() -> Self {
        WaitConfig {
            ready_timeout: Duration::from_secs(120),
            fatal_grace: Duration::from_secs(10),
        }
    }
}

/// A reason a pod (or the Deployment) cannot become ready.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fatal {
    /// The kubelet's reason (`ImagePullBackOff`, `CrashLoopBackOff`, `Failed`, ...).
    pub reason: String,
    /// Its message, possibly with earlier context (the last pull error, the exit code).
    pub message: String,
}

/// [`Fatal::reason`] of a manager Deployment scaled to 0 replicas.
pub const SCALED_TO_ZERO: &str = "ScaledToZero";

/// How to bring back a manager Deployment in `namespace` that someone scaled to
/// 0 replicas (`kubectl scale --replicas=0`). Sessions re-dial on their own
/// once a pod is ready; a new `kvpn connect` (without --no-install) scales it
/// back to 1 itself.
pub fn scale_back_fix(namespace: &str) -> String {
    format!(
        "scale it back with `kubectl scale -n {namespace} deployment/{} --replicas=1`; \
         connected sessions reconnect on their own once its pod is ready",
        crate::install::objects::MANAGER
    )
}

/// Why no manager pod in `namespace` is ready, from the Deployment's
/// `spec.replicas` and `status.readyReplicas` (`None`: no Deployment), with the
/// fix (pure): the words `kvpn status`, `kvpn connect` and the session's data
/// channel use when the manager is gone.
pub fn no_ready_pod_reason(namespace: &str, deployment: Option<&Deployment>) -> String {
    let manager = crate::install::objects::MANAGER;
    let Some(d) = deployment else {
        return format!(
            "no traffic manager in {namespace}: Deployment {manager} is gone (uninstalled?) — \
             `kvpn disconnect`, then `kvpn connect` installs it again"
        );
    };
    let wanted = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
    let ready = d
        .status
        .as_ref()
        .and_then(|s| s.ready_replicas)
        .unwrap_or(0);
    if wanted == 0 {
        return format!(
            "no ready traffic manager pod in {namespace}: Deployment {manager} is scaled to 0 \
             replicas — {}",
            scale_back_fix(namespace)
        );
    }
    format!(
        "no ready traffic manager pod in {namespace}: Deployment {manager} has {ready} of \
         {wanted} replicas ready — see `kubectl get pods -n {namespace} -l {}`",
        crate::agent::MANAGER_SELECTOR
    )
}

/// What one pod shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    pub name: String,
    /// A pod of the awaited template (and not being deleted).
    pub current: bool,
    /// Ready, with its pod IP.
    pub ready_ip: Option<IpAddr>,
    /// Its state in one line, without the pod name.
    pub line: String,
    pub fatal: Option<Fatal>,
}

fn is_fatal_reason(reason: &str) -> bool {
    FATAL_WAITING_REASONS.contains(&reason)
}

fn with_message(head: &str, message: Option<&str>) -> String {
    match message.map(str::trim).filter(|m| !m.is_empty()) {
        Some(m) => format!("{head}: {m}"),
        None => head.to_owned(),
    }
}

/// The last error exit of a container, as "exit code N: reason: message".
fn last_error_exit(c: &ContainerStatus) -> Option<String> {
    let t = c.last_state.as_ref()?.terminated.as_ref()?;
    (t.exit_code != 0).then(|| {
        let head = format!(
            "exit code {}{}",
            t.exit_code,
            t.reason
                .as_deref()
                .map(|r| format!(" ({r})"))
                .unwrap_or_default()
        );
        with_message(&head, t.message.as_deref())
    })
}

/// One container's line and fatal reason, None when it is running and ready.
fn container_view(phase: &str, c: &ContainerStatus) -> Option<(String, Option<Fatal>)> {
    let state = c.state.as_ref();
    let crash_looping = c.restart_count > 1 && last_error_exit(c).is_some();
    if let Some(w) = state.and_then(|s| s.waiting.as_ref()) {
        let reason = w.reason.as_deref().unwrap_or("Waiting");
        if is_fatal_reason(reason) || crash_looping {
            let mut message = w.message.clone().unwrap_or_default();
            if let Some(exit) = last_error_exit(c) {
                message = if message.is_empty() {
                    format!("last {exit}")
                } else {
                    format!("last {exit}; {message}")
                };
            }
            let line = with_message(&format!("Waiting: {reason}"), Some(&message));
            return Some((
                line,
                Some(Fatal {
                    reason: reason.to_owned(),
                    message,
                }),
            ));
        }
        return Some((format!("{phase} ({reason})"), None));
    }
    if let Some(t) = state.and_then(|s| s.terminated.as_ref()) {
        let reason = t.reason.as_deref().unwrap_or("Terminated");
        let line = with_message(
            &format!(
                "Terminated: {reason} (exit code {}, {} restarts)",
                t.exit_code, c.restart_count
            ),
            t.message.as_deref(),
        );
        let fatal = (t.exit_code != 0 && c.restart_count > 1).then(|| Fatal {
            reason: reason.to_owned(),
            message: with_message(&format!("exit code {}", t.exit_code), t.message.as_deref()),
        });
        return Some((line, fatal));
    }
    if c.ready {
        return None;
    }
    if state.and_then(|s| s.running.as_ref()).is_some() {
        // Up again after crashing more than once: still a crash loop until ready.
        let fatal = crash_looping.then(|| Fatal {
            reason: "CrashLoopBackOff".into(),
            message: format!(
                "{} restarts, last {}",
                c.restart_count,
                last_error_exit(c).unwrap_or_default()
            ),
        });
        return Some(("Running, not ready yet".into(), fatal));
    }
    Some((phase.to_owned(), None))
}

/// What `pod` shows; `template_hash` None counts every pod as current.
pub fn view(pod: &Pod, template_hash: Option<&str>) -> PodView {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let deleting = pod.metadata.deletion_timestamp.is_some();
    let hash = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_TEMPLATE_HASH))
        .map(String::as_str);
    let current = !deleting && template_hash.is_none_or(|h| hash == Some(h));
    let status = pod.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("Pending");
    let conditions = status
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default();
    let ready = conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    let ip = status
        .and_then(|s| s.pod_ip.as_deref())
        .and_then(|ip| ip.parse::<IpAddr>().ok());
    let mut v = PodView {
        name,
        current,
        ready_ip: None,
        line: String::new(),
        fatal: None,
    };
    if deleting {
        v.line = "Terminating".into();
        return v;
    }
    if phase == "Failed" {
        let reason = status
            .and_then(|s| s.reason.clone())
            .unwrap_or_else(|| "Failed".into());
        let message = status.and_then(|s| s.message.clone()).unwrap_or_default();
        v.line = with_message(&format!("Failed: {reason}"), Some(&message));
        v.fatal = Some(Fatal { reason, message });
        return v;
    }
    if ready && let Some(ip) = ip {
        v.ready_ip = Some(ip);
        v.line = format!("Running, ready (IP {ip})");
        return v;
    }
    let containers = status
        .and_then(|s| s.container_statuses.as_deref())
        .unwrap_or_default();
    // The first container that is not ready and running tells the story; a fatal
    // one wins over a harmless one.
    let views: Vec<_> = containers
        .iter()
        .filter_map(|c| container_view(phase, c))
        .collect();
    if let Some((line, fatal)) = views
        .iter()
        .find(|(_, f)| f.is_some())
        .or_else(|| views.first())
        .cloned()
    {
        v.line = line;
        v.fatal = fatal;
        return v;
    }
    let scheduled = conditions.iter().find(|c| c.type_ == "PodScheduled");
    let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
    v.line = match (node, scheduled) {
        (None, Some(c)) if c.status == "False" => with_message(
            &format!(
                "{phase} ({})",
                c.reason.as_deref().unwrap_or("Unschedulable")
            ),
            c.message.as_deref(),
        ),
        (None, _) => format!("{phase} (not scheduled to a node yet)"),
        (Some(_), _) if ready => format!("{phase}, ready, no pod IP yet"),
        (Some(_), _) if phase == "Running" => "Running, not ready yet".into(),
        (Some(node), _) => format!("{phase} (on node {node})"),
    };
    v
}

/// The Deployment's `ReplicaFailure` condition, when true.
fn replica_failure(d: &Deployment) -> Option<Fatal> {
    let c = d
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "ReplicaFailure" && c.status == "True")?;
    Some(Fatal {
        reason: c.reason.clone().unwrap_or_else(|| "ReplicaFailure".into()),
        message: c.message.clone().unwrap_or_default(),
    })
}

/// Outcome of one snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Waiting,
    Ready { pod: String, ip: IpAddr },
    Failed(WaitFailure),
}

/// Why the wait failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaitFailure {
    /// A fatal reason persisted for the grace time. `pod` is None for the
    /// Deployment's own failure (it could not create a pod).
    CannotStart { pod: Option<String>, fatal: Fatal },
    /// No ready pod within the bound; `last` is the last state seen.
    NotReady { after: Duration, last: String },
}

/// The wait for one ready manager pod (see the module docs).
#[derive(Debug)]
pub struct ReadyWait {
    template_hash: Option<String>,
    config: WaitConfig,
    started: Instant,
    /// Line last shown per pod.
    shown: BTreeMap<String, String>,
    /// Every "Waiting: …" line shown per pod: the kubelet alternates ErrImagePull and
    /// ImagePullBackOff (or CrashLoopBackOff and Running) every few seconds, and one
    /// line per reason says it all.
    shown_waiting: BTreeMap<String, BTreeSet<String>>,
    /// Since when each pod (or "" for the Deployment) has shown a fatal reason.
    fatal_since: BTreeMap<String, Instant>,
    /// The last ErrImagePull message per pod: ImagePullBackOff's own message only
    /// names the image, the pull error says why.
    pull_error: BTreeMap<String, String>,
    deployment_line: Option<String>,
    progress: VecDeque<String>,
    last_state: String,
}

impl ReadyWait {
    /// Starts waiting at `now` for a ready pod whose template hash is
    /// `template_hash` (None: any pod of the Deployment).
    pub fn new(template_hash: Option<String>, config: WaitConfig, now: Instant) -> Self {
        ReadyWait {
            template_hash,
            config,
            started: now,
            shown: BTreeMap::new(),
            shown_waiting: BTreeMap::new(),
            fatal_since: BTreeMap::new(),
            pull_error: BTreeMap::new(),
            deployment_line: None,
            progress: VecDeque::new(),
            last_state: "no pod created yet".into(),
        }
    }

    /// When the wait gives up at the latest.
    pub fn deadline(&self) -> Instant {
        self.started + self.config.ready_timeout
    }

    /// The next progress line, oldest first.
    pub fn poll_progress(&mut self) -> Option<String> {
        self.progress.pop_front()
    }

    fn fatal_expired(&mut self, key: &str, now: Instant) -> bool {
        let since = *self.fatal_since.entry(key.to_owned()).or_insert(now);
        now.saturating_duration_since(since) >= self.config.fatal_grace
    }

    /// Feeds the pods of the manager (label selector) and the Deployment as read now.
    pub fn handle_snapshot(
        &mut self,
        pods: &[Pod],
        deployment: Option<&Deployment>,
        now: Instant,
    ) -> Verdict {
        let mut views: Vec<PodView> = pods
            .iter()
            .map(|p| view(p, self.template_hash.as_deref()))
            .collect();
        views.sort_by(|a, b| a.name.cmp(&b.name));

        for v in &mut views {
            if let Some(f) = v.fatal.as_mut() {
                if f.reason == "ErrImagePull" && !f.message.is_empty() {
                    self.pull_error.insert(v.name.clone(), f.message.clone());
                } else if f.reason == "ImagePullBackOff"
                    && let Some(pull) = self.pull_error.get(&v.name)
                    && !f.message.contains(pull.as_str())
                {
                    f.message =
                        with_message(&f.message, None) + &format!(" (ErrImagePull: {pull})");
                }
            }
            let line = if v.current || v.line == "Terminating" {
                v.line.clone()
            } else {
                format!("{} (previous template)", v.line)
            };
            if self.shown.get(&v.name) != Some(&line) {
                let repeat = line.starts_with("Waiting: ")
                    && !self
                        .shown_waiting
                        .entry(v.name.clone())
                        .or_default()
                        .insert(line.clone());
                if !repeat {
                    self.progress.push_back(format!("Pod {}: {line}", v.name));
                }
                self.shown.insert(v.name.clone(), line);
            }
        }
        // Pods gone from the list.
        let present: Vec<&str> = views.iter().map(|v| v.name.as_str()).collect();
        let gone: Vec<String> = self
            .shown
            .keys()
            .filter(|k| !present.contains(&k.as_str()))
            .cloned()
            .collect();
        for name in gone {
            self.shown.remove(&name);
            self.shown_waiting.remove(&name);
            self.fatal_since.remove(&name);
            self.progress.push_back(format!("Pod {name}: deleted"));
        }

        let current: Vec<&PodView> = views.iter().filter(|v| v.current).collect();
        if let Some(v) = current.iter().find(|v| v.ready_ip.is_some())
            && let Some(ip) = v.ready_ip
        {
            return Verdict::Ready {
                pod: v.name.clone(),
                ip,
            };
        }

        // Scaled to 0 (`kubectl scale --replicas=0`): no pod will come.
        if deployment.is_some_and(|d| d.spec.as_ref().and_then(|s| s.replicas) == Some(0)) {
            return Verdict::Failed(WaitFailure::CannotStart {
                pod: None,
                fatal: Fatal {
                    reason: SCALED_TO_ZERO.to_owned(),
                    message: "spec.replicas is 0, so no manager pod runs".to_owned(),
                },
            });
        }
        // The Deployment's own failure (it cannot create the pod).
        let dep_fatal = deployment.and_then(replica_failure);
        let dep_line = dep_fatal
            .as_ref()
            .map(|f| with_message(&format!("Deployment: {}", f.reason), Some(&f.message)));
        if dep_line != self.deployment_line {
            if let Some(l) = &dep_line {
                self.progress.push_back(l.clone());
            }
            self.deployment_line = dep_line;
        }

        self.last_state = if current.is_empty() {
            let mut s = String::from("no pod of the current template yet");
            if let Some(l) = &self.deployment_line {
                s = format!("{s}; {l}");
            }
            s
        } else {
            current
                .iter()
                .map(|v| format!("pod {}: {}", v.name, v.line))
                .collect::<Vec<_>>()
                .join("; ")
        };

        for v in &current {
            match &v.fatal {
                Some(f) => {
                    if self.fatal_expired(&v.name, now) {
                        return Verdict::Failed(WaitFailure::CannotStart {
                            pod: Some(v.name.clone()),
                            fatal: f.clone(),
                        });
                    }
                }
                None => {
                    self.fatal_since.remove(&v.name);
                }
            }
        }
        match dep_fatal {
            Some(f) if current.is_empty() => {
                if self.fatal_expired("", now) {
                    return Verdict::Failed(WaitFailure::CannotStart {
                        pod: None,
                        fatal: f,
                    });
                }
            }
            _ => {
                self.fatal_since.remove("");
            }
        }

        let waited = now.saturating_duration_since(self.started);
        if waited >= self.config.ready_timeout {
            return Verdict::Failed(WaitFailure::NotReady {
                after: waited,
                last: self.last_state.clone(),
            });
        }
        Verdict::Waiting
    }
}

/// What the user can do about `fatal` (shown after the reason).
pub fn hint(
    namespace: &str,
    pod: Option<&str>,
    fatal: &Fatal,
    image: &str,
    pull_secrets: &[String],
) -> String {
    if fatal.reason == SCALED_TO_ZERO {
        return scale_back_fix(namespace);
    }
    let Some(pod) = pod else {
        return format!(
            "the Deployment cannot create its pod (quota, admission or RBAC); see \
             `kubectl -n {namespace} describe deployment kvpn-manager`"
        );
    };
    match fatal.reason.as_str() {
        "ErrImagePull" | "ImagePullBackOff" | "InvalidImageName" => {
            super::image::pull_hint(image, namespace, pull_secrets)
        }
        "ErrImageNeverPull" => format!(
            "imagePullPolicy is Never and the pod's node does not have {image}: load it on every node \
             (README: \"Use kvpn with your own cluster\") or connect with --image-pull-policy IfNotPresent"
        ),
        "CreateContainerConfigError" | "CreateContainerError" => format!(
            "its Secret or ConfigMap may be missing; see `kubectl -n {namespace} describe pod {pod}`"
        ),
        "CrashLoopBackOff" | "RunContainerError" | "Error" => {
            format!("the manager crashes; see `kubectl -n {namespace} logs {pod} --previous`")
        }
        _ => format!("see `kubectl -n {namespace} describe pod {pod}`"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const HASH: &str = "0123456789abcdef";

    fn pod(name: &str, hash: &str, status: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "annotations": {ANNOTATION_TEMPLATE_HASH: hash}},
            "spec": {"nodeName": "node-1", "containers": [{"name": "manager"}]},
            "status": status,
        }))
        .expect("pod")
    }

    fn waiting(reason: &str, message: &str) -> serde_json::Value {
        json!({"phase": "Pending", "containerStatuses": [{
            "name": "manager", "image": "x", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"waiting": {"reason": reason, "message": message}}}]})
    }

    fn ready(ip: &str) -> serde_json::Value {
        json!({"phase": "Running", "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": "manager", "image": "x", "imageID": "", "ready": true,
                "restartCount": 0, "state": {"running": {}}}]})
    }

    fn drain(w: &mut ReadyWait) -> Vec<String> {
        std::iter::from_fn(|| w.poll_progress()).collect()
    }

    fn wait(now: Instant) -> ReadyWait {
        ReadyWait::new(Some(HASH.into()), WaitConfig::default(), now)
    }

    #[test]
    fn reports_each_change_once_then_ready() {
        let t0 = Instant::now();
        let mut w = wait(t0);
        let unscheduled: Pod = serde_json::from_value(json!({
            "metadata": {"name": "m-1", "annotations": {ANNOTATION_TEMPLATE_HASH: HASH}},
            "status": {"phase": "Pending"}}))
        .expect("pod");
        assert_eq!(
            w.handle_snapshot(&[unscheduled], None, t0),
            Verdict::Waiting
        );
        let creating = pod("m-1", HASH, waiting("ContainerCreating", ""));
        assert_eq!(
            w.handle_snapshot(std::slice::from_ref(&creating), None, t0),
            Verdict::Waiting
        );
        assert_eq!(w.handle_snapshot(&[creating], None, t0), Verdict::Waiting);
        let v = w.handle_snapshot(&[pod("m-1", HASH, ready("10.244.1.10"))], None, t0);
        assert_eq!(
            v,
            Verdict::Ready {
                pod: "m-1".into(),
                ip: "10.244.1.10".parse().expect("ip")
            }
        );
        assert_eq!(
            drain(&mut w),
            vec![
                "Pod m-1: Pending (not scheduled to a node yet)",
                "Pod m-1: Pending (ContainerCreating)",
                "Pod m-1: Running, ready (IP 10.244.1.10)",
            ]
        );
    }

    #[test]
    fn old_template_pod_does_not_count_even_when_ready() {
        let t0 = Instant::now();
        let mut w = wait(t0);
        let old = pod("m-old", "ffffffffffffffff", ready("10.244.1.10"));
        let new = pod("m-new", HASH, waiting("ContainerCreating", ""));
        assert_eq!(w.handle_snapshot(&[old, new], None, t0), Verdict::Waiting);
        let lines = drain(&mut w);
        assert!(
            lines.contains(
                &"Pod m-old: Running, ready (IP 10.244.1.10) (previous template)".to_owned()
            ),
            "{lines:?}"
        );
    }

    #[test]
    fn image_pull_failure_fails_after_grace_with_the_pull_error() {
        let t0 = Instant::now();
        let mut w = wait(t0);
        let pull = pod(
            "m-1",
            HASH,
            waiting("ErrImagePull", "pull access denied for does-not-exist"),
        );
        assert_eq!(w.handle_snapshot(&[pull], None, t0), Verdict::Waiting);
        let backoff = pod(
            "m-1",
            HASH,
            waiting(
                "ImagePullBackOff",
                "Back-off pulling image \"does-not-exist\"",
            ),
        );
        let t1 = t0 + Duration::from_secs(5);
        assert_eq!(
            w.handle_snapshot(std::slice::from_ref(&backoff), None, t1),
            Verdict::Waiting
        );
        let t2 = t0 + Duration::from_secs(10);
        // The kubelet alternates the two reasons; each is shown once.
        let pull_again = pod(
            "m-1",
            HASH,
            waiting("ErrImagePull", "pull access denied for does-not-exist"),
        );
        let t15 = t0 + Duration::from_secs(7);
        assert_eq!(
            w.handle_snapshot(&[pull_again], None, t15),
            Verdict::Waiting
        );
        let Verdict::Failed(WaitFailure::CannotStart { pod, fatal }) =
            w.handle_snapshot(&[backoff], None, t2)
        else {
            panic!("expected a failure after 10 s of image errors")
        };
        assert_eq!(pod.as_deref(), Some("m-1"));
        assert_eq!(fatal.reason, "ImagePullBackOff");
        assert!(
            fatal.message.contains("pull access denied"),
            "{}",
            fatal.message
        );
        assert_eq!(
            drain(&mut w),
            vec![
                "Pod m-1: Waiting: ErrImagePull: pull access denied for does-not-exist",
                // The line shows the kubelet's own words; the failure adds the pull error.
                "Pod m-1: Waiting: ImagePullBackOff: Back-off pulling image \"does-not-exist\"",
            ]
        );
        let h = hint("ns", Some("m-1"), &fatal, "reg.example/kvpn/manager:9", &[]);
        assert!(
            h.contains("reg.example/kvpn/manager:9") && h.contains("--image-pull-secret"),
            "{h}"
        );
    }

    #[test]
    fn transient_pull_error_that_heals_does_not_fail() {
        let t0 = Instant::now();
        let mut w = wait(t0);
        w.handle_snapshot(
            &[pod("m-1", HASH, waiting("ErrImagePull", "timeout"))],
            None,
            t0,
        );
        let t1 = t0 + Duration::from_secs(8);
        w.handle_snapshot(
            &[pod("m-1", HASH, waiting("ContainerCreating", ""))],
            None,
            t1,
        );
        let t2 = t0 + Duration::from_secs(12);
        assert_eq!(
            w.handle_snapshot(
                &[pod("m-1", HASH, waiting("ContainerCreating", ""))],
                None,
                t2
            ),
            Verdict::Waiting
        );
        // A second error starts a new grace period.
        let t3 = t0 + Duration::from_secs(13);
        assert_eq!(
            w.handle_snapshot(
                &[pod("m-1", HASH, waiting("ErrImagePull", "timeout"))],
                None,
                t3
            ),
            Verdict::Waiting
        );
    }

    #[test]
    fn crash_loop_with_exit_code_fails_even_while_briefly_running() {
        let t0 = Instant::now();
        let mut w = wait(t0);
        let crashed = |state: serde_json::Value| {
            pod(
                "m-1",
                HASH,
                json!({"phase": "Running", "containerStatuses": [{
                "name": "manager", "image": "x", "imageID": "", "ready": false, "restartCount": 3,
                "lastState": {"terminated": {"exitCode": 2, "reason": "Error", "message": "cannot listen"}},
                "state": state}]}),
            )
        };
        let back_off =
            json!({"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s"}});
        assert_eq!(
            w.handle_snapshot(&[crashed(back_off.clone())], None, t0),
            Verdict::Waiting
        );
        let t1 = t0 + Duration::from_secs(6);
        assert_eq!(
            w.handle_snapshot(&[crashed(json!({"running": {}}))], None, t1),
            Verdict::Waiting
        );
        let t2 = t0 + Duration::from_secs(11);
        let Verdict::Failed(WaitFailure::CannotStart { fatal, .. }) =
            w.handle_snapshot(&[crashed(back_off)], None, t2)
        else {
            panic!("expected a crash-loop failure")
        };
        assert_eq!(fatal.reason, "CrashLoopBackOff");
        assert!(
            fatal.message.contains("exit code 2 (Error): cannot listen"),
            "{}",
            fatal.message
        );
        assert!(hint("ns", Some("m-1"), &fatal, "x", &[]).contains("logs m-1 --previous"));
    }

    #[test]
    fn one_restart_is_not_yet_a_crash_loop() {
        let t0 = Instant::now();
        let mut w = wait(t0);
        let p = pod(
            "m-1",
            HASH,
            json!({"phase": "Running", "containerStatuses": [{
            "name": "manager", "image": "x", "imageID": "", "ready": false, "restartCount": 1,
            "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}]}),
        );
        assert_eq!(
            w.handle_snapshot(std::slice::from_ref(&p), None, t0),
            Verdict::Waiting
        );
        assert_eq!(
            w.handle_snapshot(&[p], None, t0 + Duration::from_secs(30)),
            Verdict::Waiting
        );
    }

    #[test]
    fn times_out_with_the_last_state() {
        let t0 = Instant::now();
        let config = WaitConfig {
            ready_timeout: Duration::from_secs(5),
            ..WaitConfig::default()
        };
        let mut w = ReadyWait::new(Some(HASH.into()), config, t0);
        let unscheduled: Pod = serde_json::from_value(json!({
            "metadata": {"name": "m-1", "annotations": {ANNOTATION_TEMPLATE_HASH: HASH}},
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                "reason": "Unschedulable", "message": "0/1 nodes are available"}]}})).expect("pod");
        assert_eq!(
            w.handle_snapshot(std::slice::from_ref(&unscheduled), None, t0),
            Verdict::Waiting
        );
        let v = w.handle_snapshot(&[unscheduled], None, t0 + Duration::from_secs(5));
        assert_eq!(
            v,
            Verdict::Failed(WaitFailure::NotReady {
                after: Duration::from_secs(5),
                last: "pod m-1: Pending (Unschedulable): 0/1 nodes are available".into(),
            })
        );
    }

    #[test]
    fn deployment_replica_failure_fails_when_no_pod_appears() {
        let t0 = Instant::now();
        let mut w = wait(t0);
        let d: Deployment = serde_json::from_value(json!({
            "metadata": {"name": "kvpn-manager"},
            "status": {"conditions": [{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                "message": "pods \"kvpn-manager-x\" is forbidden: exceeded quota"}]}})).expect("deployment");
        assert_eq!(w.handle_snapshot(&[], Some(&d), t0), Verdict::Waiting);
        let Verdict::Failed(WaitFailure::CannotStart { pod: None, fatal }) =
            w.handle_snapshot(&[], Some(&d), t0 + Duration::from_secs(10))
        else {
            panic!("expected the Deployment's failure")
        };
        assert_eq!(fatal.reason, "FailedCreate");
        assert_eq!(
            drain(&mut w),
            vec!["Deployment: FailedCreate: pods \"kvpn-manager-x\" is forbidden: exceeded quota"]
        );
    }

    /// T3: a Deployment scaled to 0 fails the wait at once, saying so with the
    /// fix; the reason of a session without a manager says the same.
    #[test]
    fn a_deployment_scaled_to_zero_fails_at_once_with_the_fix() {
        let t0 = Instant::now();
        let mut w = wait(t0);
        let d = |replicas: i32, ready: i32| -> Deployment {
            serde_json::from_value(json!({
                "metadata": {"name": "kvpn-manager"},
                "spec": {"replicas": replicas, "selector": {}, "template": {}},
                "status": {"readyReplicas": ready}}))
            .expect("deployment")
        };
        let Verdict::Failed(WaitFailure::CannotStart { pod: None, fatal }) =
            w.handle_snapshot(&[], Some(&d(0, 0)), t0)
        else {
            panic!("expected a failure for 0 replicas")
        };
        assert_eq!(fatal.reason, SCALED_TO_ZERO);
        let fix = hint("kvpn-system", None, &fatal, "img", &[]);
        assert!(
            fix.contains("`kubectl scale -n kvpn-system deployment/kvpn-manager --replicas=1`")
                && fix.contains("reconnect on their own"),
            "{fix}"
        );
        let reason = no_ready_pod_reason("kvpn-system", Some(&d(0, 0)));
        assert!(
            reason.contains("Deployment kvpn-manager is scaled to 0 replicas")
                && reason.contains("--replicas=1"),
            "{reason}"
        );
        let reason = no_ready_pod_reason("kvpn-system", Some(&d(2, 0)));
        assert!(reason.contains("has 0 of 2 replicas ready"), "{reason}");
        assert!(no_ready_pod_reason("ns", None).contains("Deployment kvpn-manager is gone"));
        // One replica wanted, none ready yet: waiting, no failure.
        let mut w = wait(t0);
        assert_eq!(w.handle_snapshot(&[], Some(&d(1, 0)), t0), Verdict::Waiting);
    }

    #[test]
    fn failed_pod_and_deleted_pod_are_reported() {
        let t0 = Instant::now();
        let mut w = wait(t0);
        let evicted = pod(
            "m-1",
            HASH,
            json!({"phase": "Failed", "reason": "Evicted", "message": "low on memory"}),
        );
        w.handle_snapshot(&[evicted], None, t0);
        w.handle_snapshot(&[], None, t0 + Duration::from_secs(1));
        assert_eq!(
            drain(&mut w),
            vec![
                "Pod m-1: Failed: Evicted: low on memory",
                "Pod m-1: deleted"
            ]
        );
    }
}
