//! Pure state of the kubelet stand-in's containers and the pod status it reports:
//! the container state machine (waiting → running → terminated, restarts with
//! exponential back-off shown as `CrashLoopBackOff`, image "pulls" that fail as
//! `ErrImagePull` / `ImagePullBackOff`), probe thresholds, the pod phase and the
//! `status` JSON sent to the API. No clock and no I/O: wall-clock times are passed in,
//! and the caller schedules the delays this returns.
//!
//! The rules follow the kubelet (pkg/kubelet/kubelet_pods.go `getPhase`,
//! pkg/kubelet/container back-off): the first restart after a crash is immediate, the
//! following ones wait `base`, `2·base`, … up to `max`; a container that ran longer than
//! `reset_after` starts over. The lab's defaults are shorter than the kubelet's 10 s →
//! 5 min so tests see a crash loop within seconds (see [`Backoff::lab_default`]).

use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};

/// Restart and image-pull back-off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub base: Duration,
    pub max: Duration,
    /// A container that ran at least this long restarts without delay again.
    pub reset_after: Duration,
}

impl Backoff {
    /// 1 s, doubling, at most 20 s, reset after 60 s of running (the kubelet uses
    /// 10 s / 300 s / 600 s; shorter here so a crash loop shows up in a test quickly).
    pub fn lab_default() -> Backoff {
        Backoff {
            base: Duration::from_secs(1),
            max: Duration::from_secs(20),
            reset_after: Duration::from_secs(60),
        }
    }

    fn next(&self, current: Option<Duration>) -> Duration {
        match current {
            None => self.base,
            Some(d) => (d * 2).min(self.max),
        }
    }
}

/// A finished run of a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Terminated {
    pub exit_code: i32,
    /// The signal that ended it, if any (exit code is then 128 + signal).
    pub signal: Option<i32>,
    /// `Completed` (exit 0), `Error`, or `StartError` (could not be started).
    pub reason: String,
    pub message: Option<String>,
    pub started_at: Option<Timestamp>,
    pub finished_at: Timestamp,
}

/// The state a container status reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    Waiting {
        reason: String,
        message: Option<String>,
    },
    Running {
        started_at: Timestamp,
    },
    Terminated(Terminated),
}

/// What the shell should do when a delay returned by [`ContainerMachine`] has passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// Try to start the container (again).
    Start,
    /// Show `ImagePullBackOff` (after `ErrImagePull` was shown for a moment).
    ShowPullBackOff,
}

/// How long `ErrImagePull` shows before `ImagePullBackOff` (the kubelet shows it for
/// one sync loop).
pub const ERR_IMAGE_PULL_SHOWN: Duration = Duration::from_secs(1);

/// `restartPolicy` of the pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestartPolicy {
    Always,
    OnFailure,
    Never,
}

impl RestartPolicy {
    pub fn parse(s: Option<&str>) -> RestartPolicy {
        match s {
            Some("Never") => RestartPolicy::Never,
            Some("OnFailure") => RestartPolicy::OnFailure,
            _ => RestartPolicy::Always,
        }
    }
}

/// One container's state machine.
#[derive(Debug, Clone)]
pub struct ContainerMachine {
    pub name: String,
    pub image: String,
    state: State,
    last_terminated: Option<Terminated>,
    restart_count: i32,
    ready: bool,
    has_run: bool,
    crash_backoff: Option<Duration>,
    pull_backoff: Option<Duration>,
    /// `kvpn-lab://<pid>` while running.
    container_id: Option<String>,
    /// `kvpn-lab://<program>` once started.
    image_id: String,
    backoff: Backoff,
    /// "pod_namespace(uid)" for back-off messages.
    pod_ref: String,
}

impl ContainerMachine {
    /// A container that waits in `ContainerCreating`.
    pub fn new(name: &str, image: &str, pod_ref: &str, backoff: Backoff) -> ContainerMachine {
        ContainerMachine {
            name: name.to_owned(),
            image: image.to_owned(),
            state: State::Waiting {
                reason: "ContainerCreating".into(),
                message: None,
            },
            last_terminated: None,
            restart_count: 0,
            ready: false,
            has_run: false,
            crash_backoff: None,
            pull_backoff: None,
            container_id: None,
            image_id: String::new(),
            backoff,
            pod_ref: pod_ref.to_owned(),
        }
    }

    pub fn state(&self) -> &State {
        &self.state
    }

    pub fn last_terminated(&self) -> Option<&Terminated> {
        self.last_terminated.as_ref()
    }

    pub fn restart_count(&self) -> i32 {
        self.restart_count
    }

    pub fn is_running(&self) -> bool {
        matches!(self.state, State::Running { .. })
    }

    pub fn ready(&self) -> bool {
        self.ready && self.is_running()
    }

    pub fn set_ready(&mut self, ready: bool) {
        self.ready = ready;
    }

    /// The pod's volumes or env cannot be set up yet (`ContainerCreating`) or at all
    /// (`CreateContainerConfigError`), with the kubelet's message.
    pub fn wait_for_config(&mut self, reason: &str, message: &str) {
        if !self.is_running() {
            self.state = State::Waiting {
                reason: reason.to_owned(),
                message: Some(message.to_owned()),
            };
        }
    }

    /// The image is not in the image map: show `ErrImagePull` now; returns when to
    /// switch to `ImagePullBackOff`.
    pub fn image_missing(&mut self, message: &str) -> (Duration, Wake) {
        self.state = State::Waiting {
            reason: "ErrImagePull".into(),
            message: Some(message.to_owned()),
        };
        (ERR_IMAGE_PULL_SHOWN, Wake::ShowPullBackOff)
    }

    /// After `ErrImagePull` was shown: `ImagePullBackOff`; returns when to try again.
    pub fn pull_backoff(&mut self) -> (Duration, Wake) {
        let d = self.backoff.next(self.pull_backoff);
        self.pull_backoff = Some(d);
        self.state = State::Waiting {
            reason: "ImagePullBackOff".into(),
            message: Some(format!("Back-off pulling image \"{}\"", self.image)),
        };
        (d, Wake::Start)
    }

    /// The process started (pid for the container ID, program for the image ID).
    pub fn started(&mut self, now: Timestamp, pid: u32, program: &str) {
        if self.has_run {
            self.restart_count += 1;
        }
        self.has_run = true;
        self.pull_backoff = None;
        self.ready = false;
        self.container_id = Some(format!("kvpn-lab://{pid}"));
        self.image_id = format!("kvpn-lab://{program}");
        self.state = State::Running { started_at: now };
    }

    /// The process could not be started (e.g. the command is not on `PATH`): a
    /// `StartError` run with exit code 128, then restarts as after a crash.
    pub fn start_failed(
        &mut self,
        now: Timestamp,
        message: &str,
        policy: RestartPolicy,
    ) -> Option<(Duration, Wake)> {
        if self.has_run {
            self.restart_count += 1;
        }
        self.has_run = true;
        let t = Terminated {
            exit_code: 128,
            signal: None,
            reason: "StartError".into(),
            message: Some(message.to_owned()),
            started_at: None,
            finished_at: now,
        };
        self.finish(t, Duration::ZERO, policy)
    }

    /// The process exited with `code` (or was killed by `signal`) after running for
    /// `ran_for`. Returns when to restart it, or None if the restart policy says not to.
    pub fn exited(
        &mut self,
        now: Timestamp,
        code: Option<i32>,
        signal: Option<i32>,
        ran_for: Duration,
        policy: RestartPolicy,
    ) -> Option<(Duration, Wake)> {
        let started_at = match &self.state {
            State::Running { started_at } => Some(*started_at),
            _ => None,
        };
        let exit_code = code.unwrap_or_else(|| 128 + signal.unwrap_or(0));
        let t = Terminated {
            exit_code,
            signal,
            reason: if exit_code == 0 { "Completed" } else { "Error" }.to_owned(),
            message: None,
            started_at,
            finished_at: now,
        };
        self.finish(t, ran_for, policy)
    }

    fn finish(
        &mut self,
        t: Terminated,
        ran_for: Duration,
        policy: RestartPolicy,
    ) -> Option<(Duration, Wake)> {
        self.ready = false;
        self.container_id = None;
        let restart = match policy {
            RestartPolicy::Always => true,
            RestartPolicy::OnFailure => t.exit_code != 0,
            RestartPolicy::Never => false,
        };
        if !restart {
            self.state = State::Terminated(t);
            return None;
        }
        if ran_for >= self.backoff.reset_after {
            self.crash_backoff = None;
        }
        let delay = self.crash_backoff.unwrap_or(Duration::ZERO);
        self.crash_backoff = Some(self.backoff.next(self.crash_backoff));
        self.state = if delay.is_zero() {
            State::Terminated(t.clone())
        } else {
            State::Waiting {
                reason: "CrashLoopBackOff".into(),
                message: Some(format!(
                    "back-off {} restarting failed container={} pod={}",
                    format_duration(delay),
                    self.name,
                    self.pod_ref
                )),
            }
        };
        self.last_terminated = Some(t);
        Some((delay, Wake::Start))
    }

    /// The container's entry in `status.containerStatuses`.
    pub fn status_json(&self) -> Value {
        let mut v = json!({
            "name": self.name,
            "image": self.image,
            "imageID": self.image_id,
            "ready": self.ready(),
            "restartCount": self.restart_count,
            "started": self.is_running(),
            "state": state_json(&self.state),
            "lastState": self.last_terminated.as_ref().map_or_else(|| json!({}), |t| json!({"terminated": terminated_json(t)})),
        });
        if let Some(id) = &self.container_id {
            v["containerID"] = json!(id);
        }
        v
    }
}

/// `1s`, `20s`, `1m20s` like Go's `time.Duration` String for whole seconds.
fn format_duration(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 60 {
        format!("{}m{}s", s / 60, s % 60)
    } else if s > 0 {
        format!("{s}s")
    } else {
        format!("{}ms", d.as_millis())
    }
}

/// Kubernetes `Time`: RFC 3339, whole seconds.
pub fn k8s_time(t: Timestamp) -> String {
    Timestamp::from_second(t.as_second())
        .map(|t| t.to_string())
        .unwrap_or_else(|_| t.to_string())
}

fn terminated_json(t: &Terminated) -> Value {
    let mut v = json!({
        "exitCode": t.exit_code,
        "reason": t.reason,
        "finishedAt": k8s_time(t.finished_at),
    });
    if let Some(s) = t.signal {
        v["signal"] = json!(s);
    }
    if let Some(m) = &t.message {
        v["message"] = json!(m);
    }
    if let Some(s) = t.started_at {
        v["startedAt"] = json!(k8s_time(s));
    }
    v
}

fn state_json(s: &State) -> Value {
    match s {
        State::Waiting { reason, message } => {
            let mut w = json!({"reason": reason});
            if let Some(m) = message {
                w["message"] = json!(m);
            }
            json!({"waiting": w})
        }
        State::Running { started_at } => json!({"running": {"startedAt": k8s_time(*started_at)}}),
        State::Terminated(t) => json!({"terminated": terminated_json(t)}),
    }
}

/// The pod phase from its containers (the kubelet's `getPhase`).
pub fn phase(containers: &[ContainerMachine], policy: RestartPolicy) -> &'static str {
    let (mut running, mut waiting, mut stopped, mut succeeded) = (0, 0, 0, 0);
    for c in containers {
        match &c.state {
            State::Running { .. } => running += 1,
            State::Terminated(t) => {
                stopped += 1;
                if t.exit_code == 0 {
                    succeeded += 1;
                }
            }
            State::Waiting { .. } => {
                if c.last_terminated.is_some() {
                    stopped += 1;
                } else {
                    waiting += 1;
                }
            }
        }
    }
    if waiting > 0 {
        "Pending"
    } else if running > 0 {
        "Running"
    } else if stopped > 0 {
        match policy {
            RestartPolicy::Always => "Running",
            _ if stopped == succeeded => "Succeeded",
            RestartPolicy::Never => "Failed",
            RestartPolicy::OnFailure => "Running",
        }
    } else {
        "Pending"
    }
}

#[derive(Debug, Clone)]
struct Condition {
    kind: String,
    status: bool,
    reason: Option<String>,
    message: Option<String>,
    since: Timestamp,
}

/// Pod conditions with their last transition times.
#[derive(Debug, Clone, Default)]
pub struct Conditions {
    entries: Vec<Condition>,
}

impl Conditions {
    /// Sets condition `kind`; the transition time changes only when the status does.
    pub fn set(
        &mut self,
        kind: &str,
        status: bool,
        reason: Option<String>,
        message: Option<String>,
        now: Timestamp,
    ) {
        match self.entries.iter_mut().find(|e| e.kind == kind) {
            Some(e) => {
                if e.status != status {
                    e.since = now;
                }
                e.status = status;
                e.reason = reason;
                e.message = message;
            }
            None => self.entries.push(Condition {
                kind: kind.to_owned(),
                status,
                reason,
                message,
                since: now,
            }),
        }
    }

    pub fn json(&self) -> Value {
        Value::Array(
            self.entries
                .iter()
                .map(|c| {
                    let mut v = json!({
                        "type": c.kind,
                        "status": if c.status { "True" } else { "False" },
                        "lastProbeTime": null,
                        "lastTransitionTime": k8s_time(c.since),
                    });
                    if let Some(r) = &c.reason {
                        v["reason"] = json!(r);
                    }
                    if let Some(m) = &c.message {
                        v["message"] = json!(m);
                    }
                    v
                })
                .collect(),
        )
    }
}

/// Updates the pod conditions from the containers: Initialized, ContainersReady,
/// Ready, PodScheduled (the binding set it; repeated so a merge patch keeps it).
pub fn update_conditions(conds: &mut Conditions, containers: &[ContainerMachine], now: Timestamp) {
    let unready: Vec<&str> = containers
        .iter()
        .filter(|c| !c.ready())
        .map(|c| c.name.as_str())
        .collect();
    let ready = unready.is_empty();
    let msg = (!ready).then(|| format!("containers with unready status: [{}]", unready.join(" ")));
    conds.set("Initialized", true, None, None, now);
    conds.set(
        "Ready",
        ready,
        (!ready).then(|| "ContainersNotReady".to_owned()),
        msg.clone(),
        now,
    );
    conds.set(
        "ContainersReady",
        ready,
        (!ready).then(|| "ContainersNotReady".to_owned()),
        msg,
        now,
    );
    conds.set("PodScheduled", true, None, None, now);
}

/// What the pod status is made of besides the containers.
#[derive(Debug, Clone)]
pub struct PodFacts {
    pub host_ip: String,
    pub pod_ip: Option<String>,
    /// The pod's IPv6 address in a dual-stack lab: `podIPs`' second entry.
    pub pod_ip_v6: Option<String>,
    pub start_time: Timestamp,
    pub policy: RestartPolicy,
}

/// The `status` object for a merge patch of `pods/status`.
pub fn pod_status(facts: &PodFacts, containers: &[ContainerMachine], conds: &Conditions) -> Value {
    let mut v = json!({
        "phase": phase(containers, facts.policy),
        "hostIP": facts.host_ip,
        "startTime": k8s_time(facts.start_time),
        "conditions": conds.json(),
        "containerStatuses": containers.iter().map(ContainerMachine::status_json).collect::<Vec<_>>(),
    });
    if let Some(ip) = &facts.pod_ip {
        v["podIP"] = json!(ip);
        let mut ips = vec![json!({"ip": ip})];
        ips.extend(facts.pod_ip_v6.iter().map(|v6| json!({"ip": v6})));
        v["podIPs"] = json!(ips);
    }
    v
}

/// Consecutive-result thresholds of one probe (readiness or liveness).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeCounter {
    result: bool,
    successes: u32,
    failures: u32,
    success_threshold: u32,
    failure_threshold: u32,
}

impl ProbeCounter {
    /// Starts at `initial` (false for readiness, true for liveness).
    pub fn new(initial: bool, success_threshold: u32, failure_threshold: u32) -> ProbeCounter {
        ProbeCounter {
            result: initial,
            successes: 0,
            failures: 0,
            success_threshold: success_threshold.max(1),
            failure_threshold: failure_threshold.max(1),
        }
    }

    pub fn result(&self) -> bool {
        self.result
    }

    /// Records one probe; returns the new result when it flips.
    pub fn record(&mut self, ok: bool) -> Option<bool> {
        if ok {
            self.successes += 1;
            self.failures = 0;
            if !self.result && self.successes >= self.success_threshold {
                self.result = true;
                return Some(true);
            }
        } else {
            self.failures += 1;
            self.successes = 0;
            if self.result && self.failures >= self.failure_threshold {
                self.result = false;
                return Some(false);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + s).expect("time")
    }

    fn machine() -> ContainerMachine {
        ContainerMachine::new("c", "busybox", "p_ns(uid)", Backoff::lab_default())
    }

    #[test]
    fn crash_loop_restarts_now_then_backs_off_doubling() {
        let mut c = machine();
        c.started(t(0), 10, "sh");
        assert_eq!(
            phase(std::slice::from_ref(&c), RestartPolicy::Always),
            "Running"
        );
        let next = c.exited(
            t(1),
            Some(3),
            None,
            Duration::from_secs(1),
            RestartPolicy::Always,
        );
        assert_eq!(
            next,
            Some((Duration::ZERO, Wake::Start)),
            "first restart is immediate"
        );
        assert_eq!(c.last_terminated().map(|t| t.exit_code), Some(3));
        c.started(t(1), 11, "sh");
        assert_eq!(c.restart_count(), 1);
        let next = c.exited(
            t(2),
            Some(3),
            None,
            Duration::from_secs(1),
            RestartPolicy::Always,
        );
        assert_eq!(next, Some((Duration::from_secs(1), Wake::Start)));
        match c.state() {
            State::Waiting { reason, message } => {
                assert_eq!(reason, "CrashLoopBackOff");
                assert_eq!(
                    message.as_deref(),
                    Some("back-off 1s restarting failed container=c pod=p_ns(uid)")
                );
            }
            s => panic!("{s:?}"),
        }
        // A crash-looping Always pod is Running (not Pending) in the kubelet's phase.
        assert_eq!(
            phase(std::slice::from_ref(&c), RestartPolicy::Always),
            "Running"
        );
        c.started(t(3), 12, "sh");
        let next = c.exited(
            t(4),
            None,
            Some(9),
            Duration::from_secs(1),
            RestartPolicy::Always,
        );
        assert_eq!(next, Some((Duration::from_secs(2), Wake::Start)));
        assert_eq!(
            c.last_terminated().map(|t| (t.exit_code, t.signal)),
            Some((137, Some(9)))
        );
        let s = c.status_json();
        assert_eq!(s["restartCount"], 2);
        assert_eq!(s["lastState"]["terminated"]["exitCode"], 137);
        assert_eq!(s["state"]["waiting"]["reason"], "CrashLoopBackOff");
        assert_eq!(s["ready"], false);
        // Back-off is capped and reset after a long run.
        for _ in 0..10 {
            c.started(t(5), 13, "sh");
            c.exited(
                t(6),
                Some(1),
                None,
                Duration::from_secs(1),
                RestartPolicy::Always,
            );
        }
        c.started(t(7), 14, "sh");
        let next = c.exited(
            t(8),
            Some(1),
            None,
            Duration::from_secs(1),
            RestartPolicy::Always,
        );
        assert_eq!(next, Some((Duration::from_secs(20), Wake::Start)));
        c.started(t(9), 15, "sh");
        let next = c.exited(
            t(100),
            Some(1),
            None,
            Duration::from_secs(91),
            RestartPolicy::Always,
        );
        assert_eq!(next, Some((Duration::ZERO, Wake::Start)));
    }

    #[test]
    fn restart_policies_and_phases() {
        let mut c = machine();
        c.started(t(0), 1, "true");
        assert_eq!(
            c.exited(
                t(1),
                Some(0),
                None,
                Duration::ZERO,
                RestartPolicy::OnFailure
            ),
            None
        );
        assert_eq!(
            phase(std::slice::from_ref(&c), RestartPolicy::OnFailure),
            "Succeeded"
        );
        let mut c = machine();
        c.started(t(0), 1, "false");
        assert_eq!(
            c.exited(t(1), Some(1), None, Duration::ZERO, RestartPolicy::Never),
            None
        );
        assert_eq!(
            phase(std::slice::from_ref(&c), RestartPolicy::Never),
            "Failed"
        );
        assert_eq!(c.status_json()["state"]["terminated"]["reason"], "Error");
        let fresh = machine();
        assert_eq!(
            phase(std::slice::from_ref(&fresh), RestartPolicy::Always),
            "Pending"
        );
        assert_eq!(
            fresh.status_json()["state"]["waiting"]["reason"],
            "ContainerCreating"
        );
    }

    #[test]
    fn image_pull_failure_alternates_like_the_kubelet() {
        let mut c = ContainerMachine::new("c", "nosuch:1", "p", Backoff::lab_default());
        assert_eq!(
            c.image_missing("not found"),
            (ERR_IMAGE_PULL_SHOWN, Wake::ShowPullBackOff)
        );
        assert_eq!(
            c.status_json()["state"]["waiting"]["reason"],
            "ErrImagePull"
        );
        assert_eq!(c.pull_backoff(), (Duration::from_secs(1), Wake::Start));
        let s = c.status_json();
        assert_eq!(s["state"]["waiting"]["reason"], "ImagePullBackOff");
        assert_eq!(
            s["state"]["waiting"]["message"],
            "Back-off pulling image \"nosuch:1\""
        );
        c.image_missing("not found");
        assert_eq!(c.pull_backoff().0, Duration::from_secs(2));
        assert_eq!(
            phase(std::slice::from_ref(&c), RestartPolicy::Always),
            "Pending"
        );
    }

    #[test]
    fn conditions_keep_transition_times_and_name_unready_containers() {
        let mut c = machine();
        c.started(t(0), 1, "x");
        let mut conds = Conditions::default();
        update_conditions(&mut conds, std::slice::from_ref(&c), t(0));
        let j = conds.json();
        let ready = j
            .as_array()
            .expect("array")
            .iter()
            .find(|c| c["type"] == "Ready")
            .expect("Ready");
        assert_eq!(ready["status"], "False");
        assert_eq!(ready["message"], "containers with unready status: [c]");
        c.set_ready(true);
        update_conditions(&mut conds, std::slice::from_ref(&c), t(5));
        update_conditions(&mut conds, std::slice::from_ref(&c), t(9));
        let j = conds.json();
        let ready = j
            .as_array()
            .expect("array")
            .iter()
            .find(|c| c["type"] == "Ready")
            .expect("Ready");
        assert_eq!(ready["status"], "True");
        assert_eq!(ready["lastTransitionTime"], k8s_time(t(5)));
        let facts = PodFacts {
            host_ip: "127.0.0.1".into(),
            pod_ip: Some("10.244.1.2".into()),
            pod_ip_v6: None,
            start_time: t(0),
            policy: RestartPolicy::Always,
        };
        let s = pod_status(&facts, std::slice::from_ref(&c), &conds);
        assert_eq!(s["phase"], "Running");
        assert_eq!(s["podIPs"][0]["ip"], "10.244.1.2");
        assert_eq!(s["podIPs"].as_array().map(Vec::len), Some(1));
        let dual = PodFacts {
            pod_ip_v6: Some("fd00:10:244:1::2".into()),
            ..facts
        };
        let s = pod_status(&dual, std::slice::from_ref(&c), &conds);
        assert_eq!(s["podIP"], "10.244.1.2");
        assert_eq!(s["podIPs"][1]["ip"], "fd00:10:244:1::2");
        assert_eq!(s["containerStatuses"][0]["ready"], true);
        assert_eq!(s["containerStatuses"][0]["containerID"], "kvpn-lab://1");
    }

    #[test]
    fn probe_thresholds() {
        let mut p = ProbeCounter::new(false, 2, 3);
        assert_eq!(p.record(true), None);
        assert_eq!(p.record(true), Some(true));
        assert_eq!(p.record(false), None);
        assert_eq!(p.record(false), None);
        assert_eq!(p.record(true), None);
        assert_eq!(p.record(false), None);
        assert_eq!(p.record(false), None);
        assert_eq!(p.record(false), Some(false));
        assert!(!p.result());
    }

    #[test]
    fn times_are_whole_seconds_rfc3339() {
        let ts = Timestamp::from_second(1_700_000_000).expect("t");
        assert_eq!(k8s_time(ts), "2023-11-14T22:13:20Z");
        assert_eq!(format_duration(Duration::from_secs(80)), "1m20s");
    }
}
