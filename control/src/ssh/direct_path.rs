//! Which path an ssh-direct session's next data connection takes, and why: the
//! pure core of the session agent's re-dials (its shell is
//! [`crate::agent::OpenSession::run`]).
//!
//! A session that chose ssh-direct at connect ([`super::bypass::choose`]) keeps
//! three facts up to date: the manager Service's ClusterIP as last read (a
//! recreated Service has a new one; each re-dial re-reads it), whether the SSH
//! host reached it on the last try, and when to try again. A data connection
//! whose channel does not open within [`super::bypass::PROBE_TIMEOUT`] switches
//! the session to port-forward through the same SSH connection (the API server
//! is reached through it anyway); while on port-forward the shell probes the
//! ClusterIP every [`REPROBE_EVERY`] and, once a probe succeeds, switches back
//! and closes the port-forward data connections so the root daemon re-dials
//! onto ssh-direct (its resume token keeps the flows).
//!
//! No I/O, no clock: inputs take `now`.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// How often a session that fell back to port-forward probes ssh-direct
/// again. A probe is one `direct-tcpip` channel open (milliseconds on a node,
/// [`super::bypass::PROBE_TIMEOUT`] at most); every 5 s costs nothing and
/// brings the bypass back within seconds of the path healing.
pub const REPROBE_EVERY: Duration = Duration::from_secs(5);

/// How often it probes once [`REPROBE_FAST`] probes in a row failed: an SSH
/// host that never reaches the cluster (a bastion outside it) is not asked for
/// a channel it refuses every 5 s for the whole session.
pub const REPROBE_SLOW: Duration = Duration::from_secs(30);

/// Failed probes in a row at [`REPROBE_EVERY`] (a minute) before [`REPROBE_SLOW`].
pub const REPROBE_FAST: u32 = 12;

/// What the next data connection does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// A `direct-tcpip` channel from the SSH host to this ClusterIP:port.
    Direct(SocketAddr),
    /// `pods/portforward` through the API server (over the SSH path).
    PortForward,
}

/// The state of one ssh-direct session's data path. Pure.
#[derive(Debug, Clone)]
pub struct DirectPath {
    /// ClusterIP:port of the manager Service, as last read (`None`: the Service
    /// has none, or is gone).
    target: Option<SocketAddr>,
    /// Why the session is on port-forward; `None` while on ssh-direct.
    fallback: Option<String>,
    /// When the next probe of ssh-direct is due (on port-forward only).
    next_probe: Option<Instant>,
    /// Times the session went to port-forward and came back.
    fallbacks: u64,
    recoveries: u64,
    /// Probes that failed since the session went to port-forward.
    failed_probes: u32,
}

impl DirectPath {
    /// A session on ssh-direct to `target` (what connect's probe found).
    pub fn new(target: SocketAddr) -> Self {
        Self {
            target: Some(target),
            fallback: None,
            next_probe: None,
            fallbacks: 0,
            recoveries: 0,
            failed_probes: 0,
        }
    }

    /// The time between probes now: [`REPROBE_EVERY`], [`REPROBE_SLOW`] after
    /// [`REPROBE_FAST`] failures in a row.
    pub fn reprobe_interval(&self) -> Duration {
        if self.failed_probes < REPROBE_FAST {
            REPROBE_EVERY
        } else {
            REPROBE_SLOW
        }
    }

    /// The next data connection's path.
    pub fn choice(&self) -> Choice {
        match (self.fallback.as_ref(), self.target) {
            (None, Some(t)) => Choice::Direct(t),
            _ => Choice::PortForward,
        }
    }

    /// The ClusterIP:port as last read.
    pub fn target(&self) -> Option<SocketAddr> {
        self.target
    }

    /// The Service was read: `target` is its ClusterIP and data port now
    /// (`None`: no ClusterIP). Returns whether it changed.
    pub fn handle_resolved(&mut self, target: Option<SocketAddr>, now: Instant) -> bool {
        let changed = target != self.target;
        self.target = target;
        if target.is_none() && self.fallback.is_none() {
            self.fallback = Some("the traffic manager's Service has no ClusterIP".to_owned());
            self.fallbacks += 1;
            self.failed_probes = 0;
            self.next_probe = Some(now + REPROBE_EVERY);
        }
        changed
    }

    /// A data connection's channel to the ClusterIP did not open: `why`.
    /// The session goes to port-forward and probes again later.
    pub fn handle_direct_failed(&mut self, why: String, now: Instant) {
        if self.fallback.is_none() {
            self.fallbacks += 1;
            self.failed_probes = 0;
        }
        self.fallback = Some(why);
        self.next_probe = Some(now + self.reprobe_interval());
    }

    /// A probe of ssh-direct ended: `Ok` = the channel opened. Returns whether
    /// the session just came back to ssh-direct.
    pub fn handle_probe(&mut self, result: Result<(), String>, now: Instant) -> bool {
        match result {
            Ok(()) if self.target.is_some() => {
                let back = self.fallback.take().is_some();
                self.next_probe = None;
                self.failed_probes = 0;
                if back {
                    self.recoveries += 1;
                }
                back
            }
            Ok(()) => false,
            Err(why) => {
                if self.fallback.is_some() {
                    self.fallback = Some(why);
                    self.failed_probes = self.failed_probes.saturating_add(1);
                    self.next_probe = Some(now + self.reprobe_interval());
                }
                false
            }
        }
    }

    /// When the next probe is due (`None` on ssh-direct).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.fallback.as_ref().and(self.next_probe)
    }

    /// A probe was started at `now`: the next one is due one interval later
    /// (also if this one never reports).
    pub fn handle_probe_started(&mut self, now: Instant) {
        if self.fallback.is_some() {
            self.next_probe = Some(now + self.reprobe_interval());
        }
    }

    /// The path for status (`Origin.data_path`'s words) and why it is the one
    /// it is (empty on ssh-direct): `last_hop` is the SSH host, `ssh_path` the
    /// whole SSH path.
    pub fn describe(&self, last_hop: &str, ssh_path: &str) -> (String, String) {
        match (&self.fallback, self.target) {
            (None, Some(t)) => (format!("ssh-direct via {last_hop} to {t}"), String::new()),
            (fallback, target) => {
                let why = fallback.clone().unwrap_or_default();
                let every = self.reprobe_interval().as_secs();
                let why = match target {
                    Some(t) => {
                        format!("ssh-direct to {t} failed: {why}; probing it again every {every} s")
                    }
                    None => format!("{why}; probing it again every {every} s"),
                };
                (format!("port-forward via ssh {ssh_path}"), why)
            }
        }
    }

    /// Times the session fell back to port-forward, and came back.
    pub fn counts(&self) -> (u64, u64) {
        (self.fallbacks, self.recoveries)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_that_never_reaches_ssh_direct_probes_every_5_s_for_a_minute_then_every_30_s() {
        let t0 = Instant::now();
        let mut p = DirectPath::new(addr("10.96.0.20:10801"));
        p.handle_direct_failed("no route".into(), t0);
        assert_eq!(p.poll_timeout(), Some(t0 + REPROBE_EVERY));
        let mut now = t0;
        for _ in 0..REPROBE_FAST {
            now += REPROBE_EVERY;
            p.handle_probe_started(now);
            assert!(!p.handle_probe(Err("no route".into()), now));
        }
        assert_eq!(p.poll_timeout(), Some(now + REPROBE_SLOW));
        assert!(
            p.describe("h", "h").1.ends_with("every 30 s"),
            "{:?}",
            p.describe("h", "h")
        );
        // Back on ssh-direct, then a new fallback starts fast again.
        assert!(p.handle_probe(Ok(()), now));
        assert_eq!(p.choice(), Choice::Direct(addr("10.96.0.20:10801")));
        p.handle_direct_failed("timeout".into(), now);
        assert_eq!(p.poll_timeout(), Some(now + REPROBE_EVERY));
        assert_eq!(p.counts(), (2, 1));
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn a_failed_channel_falls_back_then_a_probe_brings_ssh_direct_back() {
        let t0 = Instant::now();
        let mut p = DirectPath::new(addr("10.96.0.20:10801"));
        assert_eq!(p.choice(), Choice::Direct(addr("10.96.0.20:10801")));
        assert_eq!(p.poll_timeout(), None, "no probe while on ssh-direct");
        assert_eq!(p.describe("root@node:22", "root@node:22").1, "");

        p.handle_direct_failed("timed out".into(), t0);
        assert_eq!(p.choice(), Choice::PortForward);
        assert_eq!(p.poll_timeout(), Some(t0 + REPROBE_EVERY));
        let (path, why) = p.describe("root@node:22", "root@node:22");
        assert_eq!(path, "port-forward via ssh root@node:22");
        assert!(
            why.contains("ssh-direct to 10.96.0.20:10801 failed: timed out"),
            "{why}"
        );

        // A failed probe keeps port-forward and schedules the next.
        let t1 = t0 + REPROBE_EVERY;
        p.handle_probe_started(t1);
        assert!(!p.handle_probe(Err("still black-holed".into()), t1));
        assert_eq!(p.choice(), Choice::PortForward);
        assert!(p.describe("h", "h").1.contains("still black-holed"));
        assert_eq!(p.poll_timeout(), Some(t1 + REPROBE_EVERY));

        // The Service was recreated: the next probe goes to the new ClusterIP.
        assert!(p.handle_resolved(Some(addr("10.96.0.77:10801")), t1));
        assert!(!p.handle_resolved(Some(addr("10.96.0.77:10801")), t1));
        assert!(p.handle_probe(Ok(()), t1 + REPROBE_EVERY));
        assert_eq!(p.choice(), Choice::Direct(addr("10.96.0.77:10801")));
        assert_eq!(p.poll_timeout(), None);
        assert_eq!(p.counts(), (1, 1));
        // A second success is no second recovery.
        assert!(!p.handle_probe(Ok(()), t1 + REPROBE_EVERY));
    }

    #[test]
    fn a_service_without_clusterip_means_port_forward_with_the_reason() {
        let t0 = Instant::now();
        let mut p = DirectPath::new(addr("10.96.0.20:10801"));
        assert!(p.handle_resolved(None, t0));
        assert_eq!(p.choice(), Choice::PortForward);
        let (_, why) = p.describe("h", "h");
        assert!(why.contains("has no ClusterIP"), "{why}");
        // A probe cannot succeed without a target.
        assert!(!p.handle_probe(Ok(()), t0));
        assert_eq!(p.choice(), Choice::PortForward);
    }
}
