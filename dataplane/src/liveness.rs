//! Session liveness: the heartbeat schedule and the connected / reconnecting
//! state of one session. Pure: inputs carry `now`, nothing here reads a clock,
//! draws randomness or touches a socket (the pump and the session supervisor
//! drive it).
//!
//! The client sends a heartbeat frame every [`HEARTBEAT_INTERVAL`] (1 s) with an
//! 8-byte nonce; the manager echoes it unchanged. The session is *connected*
//! while an echo arrived within [`MISSED_ECHOES_BEFORE_RECONNECT`] intervals
//! ([`LIVENESS_WINDOW`], 3 s) on the current transport, and *reconnecting* (with
//! a reason) otherwise. "Connected" is never claimed before the first echo.
//! A worker whose TUN device is gone is *failed* ([`Liveness::handle_failed`]),
//! for good: the supervisor stops re-dialling it.
//!
//! A black-holed transport (everything silently dropped, no RST, no FIN, case
//! tr-10) therefore shows as reconnecting at most [`LIVENESS_WINDOW`] plus one
//! watchdog tick (a quarter interval) after its last echo, i.e. within one
//! heartbeat interval past the window; from then on the pump answers cluster
//! packets with ICMP unreachable ([`crate::unreachable`]) instead of queueing
//! them into the hole.

use std::time::{Duration, Instant};

/// Time between heartbeats: 1 s. Short, so that a silent transport is noticed
/// within seconds (tr-10); one 11-byte frame a second costs nothing, and the
/// manager's idle timeout (60 s) is far above it.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);

/// Heartbeat intervals without an echo after which the transport counts as dead.
/// Three, so that one delayed echo (a GC pause in the API server, a busy
/// laptop) does not drop a healthy transport.
pub const MISSED_ECHOES_BEFORE_RECONNECT: u32 = 3;

/// Silence after which the session is reconnecting: 3 s.
pub const LIVENESS_WINDOW: Duration =
    Duration::from_secs(HEARTBEAT_INTERVAL.as_secs() * MISSED_ECHOES_BEFORE_RECONNECT as u64);

/// Session state as reported by Status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// First transport up, no heartbeat echo yet.
    Connecting,
    /// An echo arrived recently on the current transport.
    Connected,
    /// The transport is down or silent; the supervisor is re-dialling.
    Reconnecting,
    /// The worker cannot carry traffic again and does not re-dial (its TUN
    /// device was deleted from outside kvpn); the reason says what to run.
    Failed,
}

impl State {
    /// The Status API's word for the state.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Connecting => "connecting",
            State::Connected => "connected",
            State::Reconnecting => "reconnecting",
            State::Failed => "failed",
        }
    }
}

#[derive(Debug, Clone)]
enum Transport {
    /// Up since `since`; echoes count only for nonces sent since `first_nonce`.
    Up {
        since: Instant,
        first_nonce: u64,
        last_echo: Option<Instant>,
    },
    /// Down, with the reason.
    Down { reason: String },
}

/// Liveness of one session across transport reconnects.
#[derive(Debug, Clone)]
pub struct Liveness {
    interval: Duration,
    transport: Transport,
    /// Whether any transport of this session ever got an echo.
    ever_connected: bool,
    /// Whether a transport of this session was up and ended.
    lost_transport: bool,
    /// Why the last transport ended, shown until the next one is connected.
    last_loss: Option<String>,
    next_nonce: u64,
    next_due: Option<Instant>,
    last_sent: Option<(u64, Instant)>,
    last_rtt: Option<Duration>,
    /// The pump watchdog's last tick on the current transport ([`Self::handle_tick`]).
    last_tick: Option<Instant>,
    /// Why the worker failed for good ([`Self::handle_failed`]); final.
    failed: Option<String>,
}

impl Liveness {
    /// A session whose first transport is not up yet.
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            transport: Transport::Down {
                reason: "dialling the traffic manager".to_owned(),
            },
            ever_connected: false,
            lost_transport: false,
            last_loss: None,
            next_nonce: 1,
            next_due: None,
            last_sent: None,
            last_rtt: None,
            last_tick: None,
            failed: None,
        }
    }

    /// The heartbeat interval.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// A transport came up (hello sent): the first heartbeat is due at once.
    pub fn handle_transport_up(&mut self, now: Instant) {
        self.transport = Transport::Up {
            since: now,
            first_nonce: self.next_nonce,
            last_echo: None,
        };
        self.next_due = Some(now);
        self.last_tick = None;
    }

    /// The transport ended for `reason` (what status shows: without the
    /// documentation URLs library errors carry, e.g. rustls's "peer closed
    /// connection without sending TLS close_notify: https://docs.rs/…").
    pub fn handle_transport_down(&mut self, reason: impl Into<String>) {
        let reason = crate::tls::without_urls(&reason.into());
        if matches!(self.transport, Transport::Up { .. }) {
            self.lost_transport = true;
            self.last_loss = Some(reason.clone());
        }
        self.transport = Transport::Down { reason };
        self.next_due = None;
        self.last_tick = None;
    }

    /// The worker stopped for good for `reason` (its TUN device is gone): the
    /// state is [`State::Failed`] from now on, whatever happens later, and no
    /// heartbeat is due.
    pub fn handle_failed(&mut self, reason: impl Into<String>) {
        let reason = reason.into();
        self.handle_transport_down(reason.clone());
        self.failed = Some(reason);
    }

    /// Connecting is only the first attempt; after a transport was lost or an
    /// echo seen, the session is reconnecting until it is connected again.
    fn past_first_transport(&self) -> bool {
        self.ever_connected || self.lost_transport
    }

    /// When the next heartbeat is due (`None` while the transport is down).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.next_due
    }

    /// The heartbeat payload to send now, if one is due.
    pub fn poll_heartbeat(&mut self, now: Instant) -> Option<[u8; 8]> {
        let due = self.next_due?;
        if now < due {
            return None;
        }
        let nonce = self.next_nonce;
        self.next_nonce += 1;
        self.last_sent = Some((nonce, now));
        // Schedule from `now`, not `due`: after a stall, send one, not a burst.
        self.next_due = Some(now + self.interval);
        Some(nonce.to_be_bytes())
    }

    /// A heartbeat frame came back with `payload`. Returns whether it was an echo
    /// of a heartbeat sent on the current transport.
    pub fn handle_echo(&mut self, payload: &[u8], now: Instant) -> bool {
        let Ok(bytes) = <[u8; 8]>::try_from(payload) else {
            return false;
        };
        let nonce = u64::from_be_bytes(bytes);
        let Transport::Up {
            first_nonce,
            last_echo,
            ..
        } = &mut self.transport
        else {
            return false;
        };
        let last = self.last_sent.map_or(0, |(n, _)| n);
        if nonce < *first_nonce || nonce > last {
            return false;
        }
        *last_echo = Some(now);
        self.ever_connected = true;
        if let Some((sent_nonce, sent_at)) = self.last_sent
            && sent_nonce == nonce
        {
            self.last_rtt = Some(now.saturating_duration_since(sent_at));
        }
        true
    }

    /// Frames arrived on the current transport at `now`. Once the transport has
    /// been proven by an echo, any frame from the manager shows it alive: an
    /// echo stuck behind a burst of inbound packets must not count as silence.
    /// Before the first echo this proves nothing ("connected" still needs one).
    pub fn handle_inbound(&mut self, now: Instant) {
        if let Transport::Up {
            last_echo: Some(at),
            ..
        } = &mut self.transport
        {
            *at = now.max(*at);
        }
    }

    /// The process itself did not run for a while (SIGSTOP, a debugger, a starved
    /// CPU): the watchdog saw a tick far later than scheduled at `now`. Silence
    /// measured across the stall says nothing about the transport — the echoes
    /// may be waiting, unread, in the socket — so the transport gets one more
    /// heartbeat interval from `now` to prove itself (a heartbeat goes at once,
    /// the reader drains what arrived) before it counts as dead. Only the silence
    /// reference moves forward, never back.
    pub fn handle_stall(&mut self, now: Instant) {
        let limit = self.silence_limit();
        let Some(grace_start) = now.checked_sub(limit.saturating_sub(self.interval)) else {
            return;
        };
        match &mut self.transport {
            Transport::Up {
                last_echo: Some(at),
                ..
            } => *at = grace_start.max(*at),
            Transport::Up {
                since,
                last_echo: None,
                ..
            } => *since = grace_start.max(*since),
            Transport::Down { .. } => {}
        }
    }

    /// The pump's watchdog ticked at `now` (it ticks every interval/4 while a
    /// transport is up). A tick more than a whole interval after the previous one
    /// means this process did not run in between: [`Self::handle_stall`], and the
    /// stall's length is returned (for the log).
    pub fn handle_tick(&mut self, now: Instant) -> Option<Duration> {
        let gap = self
            .last_tick
            .map(|t| now.saturating_duration_since(t))
            .filter(|gap| *gap > self.interval);
        if gap.is_some() {
            self.handle_stall(now);
        }
        self.last_tick = Some(now);
        gap
    }

    /// Whether the watchdog is overdue at `now`: the process has just woken from a
    /// stall and the watchdog has not run yet. Other tasks (the TUN reader, DNS)
    /// may look first; they must see what the watchdog will decide
    /// ([`Self::handle_stall`]), not the stall's silence.
    fn stalled(&self, now: Instant) -> bool {
        self.last_tick
            .is_some_and(|t| now.saturating_duration_since(t) > self.interval)
    }

    /// The silence reference `at`, moved forward as [`Self::handle_stall`] would
    /// while a stall is not handled yet.
    fn silence_since(&self, at: Instant, now: Instant) -> Instant {
        if !self.stalled(now) {
            return at;
        }
        now.checked_sub(self.silence_limit().saturating_sub(self.interval))
            .map_or(at, |grace| grace.max(at))
    }

    /// Round-trip time of the latest heartbeat that was echoed.
    pub fn last_rtt(&self) -> Option<Duration> {
        self.last_rtt
    }

    fn silence_limit(&self) -> Duration {
        self.interval * MISSED_ECHOES_BEFORE_RECONNECT
    }

    /// The silence after which the session is reconnecting (interval ×
    /// [`MISSED_ECHOES_BEFORE_RECONNECT`]).
    pub fn window(&self) -> Duration {
        self.silence_limit()
    }

    /// Whether the session is reconnecting at `now` (the state [`Self::state`]
    /// reports), without building the reason. While it is, the pump answers
    /// packets toward the cluster with ICMP unreachable.
    pub fn is_reconnecting(&self, now: Instant) -> bool {
        if self.failed.is_some() {
            // Nothing will carry the packets: refuse as while reconnecting.
            return true;
        }
        let limit = self.silence_limit();
        match &self.transport {
            Transport::Down { .. } => self.past_first_transport(),
            Transport::Up {
                since, last_echo, ..
            } => match last_echo {
                Some(at) => now.saturating_duration_since(self.silence_since(*at, now)) > limit,
                None => {
                    now.saturating_duration_since(self.silence_since(*since, now)) > limit
                        || self.past_first_transport()
                }
            },
        }
    }

    /// Whether the current transport has been silent for too long and should be
    /// dropped and re-dialled.
    pub fn transport_dead(&self, now: Instant) -> bool {
        match &self.transport {
            Transport::Up {
                since, last_echo, ..
            } => {
                let at = self.silence_since(last_echo.unwrap_or(*since), now);
                now.saturating_duration_since(at) > self.silence_limit()
            }
            Transport::Down { .. } => false,
        }
    }

    /// The state and, unless connected, why.
    pub fn state(&self, now: Instant) -> (State, Option<String>) {
        if let Some(reason) = &self.failed {
            return (State::Failed, Some(reason.clone()));
        }
        let limit = self.silence_limit();
        match &self.transport {
            Transport::Down { reason } => {
                let state = if self.past_first_transport() {
                    State::Reconnecting
                } else {
                    State::Connecting
                };
                (state, Some(reason.clone()))
            }
            Transport::Up {
                since,
                last_echo: None,
                ..
            } => {
                let waited = now.saturating_duration_since(self.silence_since(*since, now));
                if waited > limit {
                    (
                        State::Reconnecting,
                        Some(format!(
                            "no heartbeat echo from the traffic manager for {} ms",
                            waited.as_millis()
                        )),
                    )
                } else if self.past_first_transport() {
                    (
                        State::Reconnecting,
                        Some(match &self.last_loss {
                            Some(loss) => format!(
                                "{loss}; transport re-established, waiting for the first heartbeat echo"
                            ),
                            None => {
                                "transport re-established, waiting for the first heartbeat echo"
                                    .to_owned()
                            }
                        }),
                    )
                } else {
                    (
                        State::Connecting,
                        Some("waiting for the first heartbeat echo".to_owned()),
                    )
                }
            }
            Transport::Up {
                last_echo: Some(at),
                ..
            } => {
                let silent = now.saturating_duration_since(self.silence_since(*at, now));
                if silent > limit {
                    (
                        State::Reconnecting,
                        Some(format!(
                            "no heartbeat echo from the traffic manager for {} ms",
                            silent.as_millis()
                        )),
                    )
                } else {
                    (State::Connected, None)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const I: Duration = HEARTBEAT_INTERVAL;

    #[test]
    fn failed_is_final_and_refuses() {
        let t0 = Instant::now();
        let mut l = Liveness::new(I);
        l.handle_transport_up(t0);
        let nonce = l.poll_heartbeat(t0).expect("due");
        assert!(l.handle_echo(&nonce, t0));
        l.handle_failed("TUN device kvpn0 was deleted");
        assert_eq!(
            l.state(t0),
            (
                State::Failed,
                Some("TUN device kvpn0 was deleted".to_owned())
            )
        );
        assert!(l.is_reconnecting(t0), "packets are refused");
        assert_eq!(l.poll_timeout(), None, "no heartbeat is due");
        l.handle_transport_down("later loss");
        assert_eq!(l.state(t0 + I).0, State::Failed, "failed is final");
    }

    #[test]
    fn echo_makes_connected() {
        let t0 = Instant::now();
        let mut l = Liveness::new(I);
        assert_eq!(l.state(t0).0, State::Connecting);
        assert_eq!(
            l.poll_heartbeat(t0),
            None,
            "no heartbeat without a transport"
        );
        l.handle_transport_up(t0);
        let nonce = l
            .poll_heartbeat(t0)
            .expect("first heartbeat is due at once");
        assert_eq!(l.poll_heartbeat(t0), None, "only one per interval");
        assert_eq!(l.state(t0).0, State::Connecting);
        assert!(l.handle_echo(&nonce, t0 + Duration::from_millis(3)));
        assert_eq!(
            l.state(t0 + Duration::from_millis(3)),
            (State::Connected, None)
        );
        assert_eq!(l.last_rtt(), Some(Duration::from_millis(3)));
        assert_eq!(l.poll_timeout(), Some(t0 + I));
    }

    #[test]
    fn silence_for_three_intervals_means_reconnecting() {
        let t0 = Instant::now();
        let mut l = Liveness::new(I);
        l.handle_transport_up(t0);
        let nonce = l.poll_heartbeat(t0).expect("due");
        assert!(l.handle_echo(&nonce, t0));
        let mut now = t0;
        for _ in 0..3 {
            now += I;
            assert!(l.poll_heartbeat(now).is_some());
            assert_eq!(l.state(now).0, State::Connected);
            assert!(!l.transport_dead(now));
        }
        now += Duration::from_millis(1);
        let (state, reason) = l.state(now);
        assert_eq!(state, State::Reconnecting);
        assert!(reason.expect("a reason").contains("no heartbeat echo"));
        assert!(l.transport_dead(now));
    }

    #[test]
    fn a_stall_gives_the_transport_one_more_interval() {
        let t0 = Instant::now();
        let i = Duration::from_secs(1);
        let mut l = Liveness::new(i);
        l.handle_transport_up(t0);
        let hb = l.poll_heartbeat(t0).expect("due at once");
        assert!(l.handle_echo(&hb, t0 + Duration::from_millis(1)));
        // The process was stopped for 8 s: without the stall that is silence.
        let woke = t0 + Duration::from_secs(8);
        assert!(l.transport_dead(woke));
        l.handle_stall(woke);
        assert!(!l.transport_dead(woke), "dead at once after a stall");
        assert_eq!(l.state(woke).0, State::Connected);
        assert!(!l.transport_dead(woke + i - Duration::from_millis(1)));
        // No echo within one interval after the stall: dead as before.
        assert!(l.transport_dead(woke + i + Duration::from_millis(1)));
        // The echo waiting in the socket proves it: connected again.
        let mut l2 = l.clone();
        assert!(l2.handle_echo(&hb, woke + Duration::from_millis(5)));
        assert!(!l2.transport_dead(woke + i + Duration::from_millis(1)));
        // A stall never moves the reference back.
        let later = woke + Duration::from_millis(500);
        l2.handle_stall(woke);
        assert!(!l2.transport_dead(later));
        // A transport that never echoed gets the same one interval.
        let mut l3 = Liveness::new(i);
        l3.handle_transport_up(t0);
        l3.handle_stall(woke);
        assert!(!l3.transport_dead(woke));
        assert!(l3.transport_dead(woke + i + Duration::from_millis(1)));
    }

    #[test]
    fn before_the_watchdog_runs_after_a_stall_nobody_sees_silence() {
        let t0 = Instant::now();
        let i = Duration::from_secs(1);
        let mut l = Liveness::new(i);
        l.handle_transport_up(t0);
        assert_eq!(l.handle_tick(t0), None, "the first tick is no stall");
        let hb = l.poll_heartbeat(t0).expect("due at once");
        assert!(l.handle_echo(&hb, t0 + Duration::from_millis(1)));
        for q in 1..8 {
            assert_eq!(l.handle_tick(t0 + i / 4 * q), None, "regular ticks");
        }
        // A real black hole with the watchdog ticking: reconnecting after 3 s.
        let mut hole = l.clone();
        let mut t = t0 + i * 2;
        while t < t0 + Duration::from_millis(3100) {
            t += i / 4;
            assert_eq!(hole.handle_tick(t), None);
        }
        assert!(hole.is_reconnecting(t) && hole.transport_dead(t));
        // Stopped 45 s: the TUN reader looks before the watchdog ticks.
        let woke = t0 + Duration::from_secs(47);
        assert!(!l.is_reconnecting(woke), "TUN reader answered unreachable");
        assert!(!l.transport_dead(woke));
        assert_eq!(l.state(woke).0, State::Connected);
        assert_eq!(
            l.handle_tick(woke + Duration::from_millis(2)),
            Some(Duration::from_millis(47_002) - i * 7 / 4)
        );
        // The same one interval of grace as handle_stall, then silence counts.
        assert!(!l.is_reconnecting(woke + i / 2));
        let mut t = woke + Duration::from_millis(2);
        for _ in 0..4 {
            t += i / 4;
            assert_eq!(l.handle_tick(t), None, "the watchdog ticks again");
        }
        assert!(l.is_reconnecting(t + Duration::from_millis(1)));
        assert!(l.transport_dead(t + Duration::from_millis(1)));
        // A new transport starts without a stale tick.
        l.handle_transport_down("closed");
        l.handle_transport_up(woke + i * 5);
        assert_eq!(l.handle_tick(woke + i * 5), None);
    }

    #[test]
    fn never_echoed_transport_dies_too() {
        let t0 = Instant::now();
        let mut l = Liveness::new(I);
        l.handle_transport_up(t0);
        assert!(!l.transport_dead(t0 + I * 3));
        assert!(l.transport_dead(t0 + I * 3 + Duration::from_millis(1)));
        assert_eq!(l.state(t0 + I * 4).0, State::Reconnecting);
    }

    #[test]
    fn stale_or_foreign_echoes_do_not_count() {
        let t0 = Instant::now();
        let mut l = Liveness::new(I);
        l.handle_transport_up(t0);
        let old = l.poll_heartbeat(t0).expect("due");
        l.handle_transport_down("transport closed by the traffic manager");
        assert!(!l.handle_echo(&old, t0), "no transport");
        l.handle_transport_up(t0 + I);
        assert!(
            !l.handle_echo(&old, t0 + I),
            "echo of the previous transport"
        );
        assert!(!l.handle_echo(&[1, 2, 3], t0 + I), "wrong length");
        assert!(!l.handle_echo(&99u64.to_be_bytes(), t0 + I), "never sent");
        let fresh = l.poll_heartbeat(t0 + I).expect("due");
        assert!(l.handle_echo(&fresh, t0 + I));
    }

    #[test]
    fn a_lost_transport_that_never_echoed_is_reconnecting_not_connecting() {
        let t0 = Instant::now();
        let mut l = Liveness::new(I);
        l.handle_transport_down("connection refused");
        assert_eq!(l.state(t0).0, State::Connecting, "first dial still failing");
        l.handle_transport_up(t0);
        assert_eq!(l.state(t0).0, State::Connecting);
        l.handle_transport_down("no heartbeat echo from the traffic manager for 6001 ms");
        assert_eq!(l.state(t0).0, State::Reconnecting);
        l.handle_transport_up(t0 + I);
        assert_eq!(
            l.state(t0 + I).0,
            State::Reconnecting,
            "stays reconnecting until an echo"
        );
        let n = l.poll_heartbeat(t0 + I).expect("due");
        assert!(l.handle_echo(&n, t0 + I));
        assert_eq!(l.state(t0 + I).0, State::Connected);
    }

    #[test]
    fn down_after_connected_is_reconnecting_with_the_reason() {
        let t0 = Instant::now();
        let mut l = Liveness::new(I);
        l.handle_transport_up(t0);
        let n = l.poll_heartbeat(t0).expect("due");
        l.handle_echo(&n, t0);
        l.handle_transport_down("connection reset by the traffic manager");
        // Status reasons carry no library documentation URLs (trial: rustls's
        // unexpected-EOF text reached `kvpn status`).
        let mut m = l.clone();
        m.handle_transport_down(
            "data channel: peer closed connection without sending TLS close_notify: https://docs.rs/rustls/latest/rustls/manual/_03_howto/index.html#unexpected-eof",
        );
        assert_eq!(
            m.state(t0).1.as_deref(),
            Some("data channel: peer closed connection without sending TLS close_notify")
        );
        assert_eq!(
            l.state(t0),
            (
                State::Reconnecting,
                Some("connection reset by the traffic manager".to_owned())
            )
        );
        assert_eq!(l.poll_timeout(), None);
        l.handle_transport_up(t0 + I);
        assert_eq!(
            l.state(t0 + I).0,
            State::Reconnecting,
            "until the new transport echoes"
        );
    }

    #[test]
    fn is_reconnecting_agrees_with_state_through_a_black_hole() {
        let t0 = Instant::now();
        let mut l = Liveness::new(I);
        let agree = |l: &Liveness, now: Instant| {
            assert_eq!(
                l.is_reconnecting(now),
                l.state(now).0 == State::Reconnecting,
                "{:?}",
                l.state(now)
            );
        };
        agree(&l, t0);
        l.handle_transport_up(t0);
        agree(&l, t0);
        agree(&l, t0 + LIVENESS_WINDOW + Duration::from_millis(1));
        let n = l.poll_heartbeat(t0).expect("due");
        l.handle_echo(&n, t0);
        // The hole opens right after the echo: connected for the whole window,
        // reconnecting one millisecond after it.
        for ms in [0u64, 1000, 2999, 3000, 3001, 4000] {
            agree(&l, t0 + Duration::from_millis(ms));
        }
        assert!(!l.is_reconnecting(t0 + LIVENESS_WINDOW));
        assert!(l.is_reconnecting(t0 + LIVENESS_WINDOW + Duration::from_millis(1)));
        l.handle_transport_down("no heartbeat echo");
        agree(&l, t0 + I * 4);
        assert!(l.is_reconnecting(t0 + I * 4));
        l.handle_transport_up(t0 + I * 5);
        agree(&l, t0 + I * 5);
        assert!(
            l.is_reconnecting(t0 + I * 5),
            "until the new transport echoes"
        );
        let n = l.poll_heartbeat(t0 + I * 5).expect("due");
        l.handle_echo(&n, t0 + I * 5);
        agree(&l, t0 + I * 5);
        assert!(!l.is_reconnecting(t0 + I * 5));
        assert_eq!(LIVENESS_WINDOW, Duration::from_secs(3));
        assert_eq!(l.window(), LIVENESS_WINDOW);
    }
}
