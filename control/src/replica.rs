//! Which traffic manager replica a connect uses: the ready one with the fewest
//! sessions. [`choose`] is the pure rule; [`pick`] its shell, which lists the
//! manager's pods and reads each ready pod's `kvpn_manager_sessions_active`
//! gauge from `GET /metrics` on its loopback metrics port through
//! `pods/portforward` (the one permission a developer already has; reading the
//! lease objects' holders would need list on leases, which also shows every
//! client's session token).
//!
//! I/O: the API server (list pods, port-forward), nothing else.

use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tracing::debug;

use crate::agent::{MANAGER_SELECTOR, pod_is_ready};

/// How long one replica's metrics may take (port-forward, request, answer).
/// A replica that does not answer in time counts as busiest, not as an error:
/// the connect goes on with the others. 3 s: a port-forward opens in well under
/// a second in the lab and over a WAN API server.
pub const METRICS_TIMEOUT: Duration = Duration::from_secs(3);

/// One ready replica and its session count (None: unknown, its metrics did not
/// answer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub pod: String,
    pub ip: Option<IpAddr>,
    pub sessions: Option<u64>,
}

/// The replica a connect uses and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    pub pod: String,
    pub ip: Option<IpAddr>,
    /// One line for the output and status: "fewest sessions (0 of 0, 1, 2; 3
    /// replicas ready)".
    pub reason: String,
}

/// The candidate with the fewest sessions; unknown counts go last, ties by pod
/// name (so two laptops that read the same counts spread only by the counts,
/// deterministically). None without candidates.
pub fn choose(candidates: &[Candidate]) -> Option<Choice> {
    let best = candidates
        .iter()
        .min_by(|a, b| {
            let key = |c: &Candidate| (c.sessions.is_none(), c.sessions.unwrap_or(0));
            key(a).cmp(&key(b)).then_with(|| a.pod.cmp(&b.pod))
        })?
        .clone();
    let reason = if candidates.len() == 1 {
        match best.sessions {
            Some(n) => format!("the only ready replica ({n} sessions)"),
            None => "the only ready replica".to_owned(),
        }
    } else {
        let mut counts: Vec<String> = candidates
            .iter()
            .map(|c| c.sessions.map_or("?".to_owned(), |n| n.to_string()))
            .collect();
        counts.sort();
        let mine = best.sessions.map_or("?".to_owned(), |n| n.to_string());
        format!(
            "fewest sessions ({mine} of {}; {} replicas ready)",
            counts.join(", "),
            candidates.len()
        )
    };
    Some(Choice {
        pod: best.pod,
        ip: best.ip,
        reason,
    })
}

/// The value of `kvpn_manager_sessions_active` in a Prometheus text answer
/// (headers before it are skipped).
pub fn sessions_active(metrics: &str) -> Option<u64> {
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix("kvpn_manager_sessions_active"))
        .find_map(|rest| {
            let rest = rest.trim_start_matches(['{', '}']);
            rest.split_whitespace().next()?.parse::<f64>().ok()
        })
        .filter(|v| v.is_finite() && *v >= 0.0)
        .map(|v| v as u64)
}

/// `GET /metrics` of `pod`'s metrics port, bounded by [`METRICS_TIMEOUT`].
async fn metrics_of(api: &Api<Pod>, pod: &str, port: u16) -> Result<String, String> {
    let fetch = async {
        let mut pf = api
            .portforward(pod, &[port])
            .await
            .map_err(|e| format!("port-forward to {pod}:{port}: {e}"))?;
        let mut s = pf
            .take_stream(port)
            .ok_or_else(|| format!("port-forward to {pod}: no stream"))?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: kvpn-manager\r\nConnection: close\r\n\r\n")
            .await
            .map_err(|e| format!("metrics request to {pod}: {e}"))?;
        let mut out = Vec::new();
        s.read_to_end(&mut out)
            .await
            .map_err(|e| format!("metrics answer of {pod}: {e}"))?;
        pf.abort();
        Ok(String::from_utf8_lossy(&out).into_owned())
    };
    tokio::time::timeout(METRICS_TIMEOUT, fetch)
        .await
        .unwrap_or_else(|_| Err(format!("{pod} sent no metrics within {METRICS_TIMEOUT:?}")))
}

/// The ready manager replica with the fewest sessions in `namespace` (only
/// pods of `version` when any is ready: during an upgrade the new ones). None
/// when no pod is ready or the pods cannot be listed (the caller keeps the pod
/// the install waited for).
pub async fn pick(
    client: &kube::Client,
    namespace: &str,
    version: &str,
    metrics_port: u16,
) -> Option<Choice> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pods = match api
        .list(&ListParams::default().labels(MANAGER_SELECTOR))
        .await
    {
        Ok(l) => l.items,
        Err(e) => {
            debug!(error = %e, "cannot list the manager's pods to pick a replica");
            return None;
        }
    };
    let of_version = |p: &Pod| {
        p.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(crate::install::objects::ANNOTATION_VERSION))
            .is_some_and(|v| v == version)
    };
    let ready: Vec<&Pod> = pods.iter().filter(|p| pod_is_ready(p)).collect();
    let ready: Vec<&Pod> = if ready.iter().any(|p| of_version(p)) {
        ready.into_iter().filter(|p| of_version(p)).collect()
    } else {
        ready
    };
    let counts = futures::future::join_all(ready.iter().map(|p| {
        let name = p.metadata.name.clone().unwrap_or_default();
        let api = api.clone();
        async move {
            let sessions = match metrics_of(&api, &name, metrics_port).await {
                Ok(text) => sessions_active(&text),
                Err(e) => {
                    debug!(pod = %name, error = %e, "no session count");
                    None
                }
            };
            (name, sessions)
        }
    }))
    .await;
    let candidates: Vec<Candidate> = ready
        .iter()
        .zip(counts)
        .map(|(p, (pod, sessions))| Candidate {
            pod,
            ip: p
                .status
                .as_ref()
                .and_then(|s| s.pod_ip.as_deref())
                .and_then(|ip| ip.parse().ok()),
            sessions,
        })
        .collect();
    choose(&candidates)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(pod: &str, sessions: Option<u64>) -> Candidate {
        Candidate {
            pod: pod.into(),
            ip: None,
            sessions,
        }
    }

    #[test]
    fn fewest_sessions_wins_unknown_last_ties_by_name() {
        let got =
            choose(&[c("m-c", Some(2)), c("m-b", Some(0)), c("m-a", Some(1))]).expect("a choice");
        assert_eq!(got.pod, "m-b");
        assert_eq!(
            got.reason,
            "fewest sessions (0 of 0, 1, 2; 3 replicas ready)"
        );
        let tie = choose(&[c("m-z", Some(1)), c("m-y", Some(1))]).expect("a choice");
        assert_eq!(tie.pod, "m-y");
        let unknown = choose(&[c("m-a", None), c("m-b", Some(7))]).expect("a choice");
        assert_eq!(unknown.pod, "m-b", "an unknown count is not taken for 0");
        let all_unknown = choose(&[c("m-b", None), c("m-a", None)]).expect("a choice");
        assert_eq!(all_unknown.pod, "m-a");
        assert_eq!(
            choose(&[c("m-a", Some(3))]).map(|c| c.reason),
            Some("the only ready replica (3 sessions)".to_owned())
        );
        assert_eq!(choose(&[]), None);
    }

    #[test]
    fn sessions_gauge_is_read_from_the_metrics_answer() {
        let text = "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n\
            # HELP kvpn_manager_sessions_active sessions running now\n\
            # TYPE kvpn_manager_sessions_active gauge\n\
            kvpn_manager_sessions_accepted_total 9\n\
            kvpn_manager_sessions_active 4\n";
        assert_eq!(sessions_active(text), Some(4));
        assert_eq!(
            sessions_active("kvpn_manager_sessions_active{} 2\n"),
            Some(2)
        );
        assert_eq!(sessions_active("kvpn_manager_sessions_active NaN\n"), None);
        assert_eq!(sessions_active("kvpn_manager_sessions_active -1\n"), None);
        assert_eq!(sessions_active("nothing here"), None);
    }
}
