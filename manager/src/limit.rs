//! Per-client admission limits of the manager, pure (no clock: `now` is passed
//! in): token buckets that bound how fast one laptop may open new flows
//! (TCP dials, UDP and ping sockets), how fast its new flows may fail (dials
//! refused or unreachable: a port scan), and how many ICMP errors the manager
//! writes back to it.
//!
//! Why: every new flow costs the manager a kernel socket, a task and, for a
//! closed port, an answer; a laptop flooding SYNs or UDP to closed ports would
//! otherwise turn its packet rate into socket churn that competes with every
//! other laptop's sessions for the pod's CPU. Beyond the bucket a new flow's
//! first packet is dropped (counted): TCP retransmits its SYN after 1 s, so a
//! legitimate burst larger than the bucket still completes, only later.

use std::time::{Duration, Instant};

/// New flows per second one session may open, sustained. Far above what a
/// developer's tools open (a build fetching dependencies opens tens per
/// second); a port scan or SYN flood is far above it.
pub const NEW_FLOWS_PER_SEC: u32 = 1000;

/// New flows one session may open at once (bucket size): case tr-12 opens
/// 3000 concurrent connections in well under a second, and a browser or test
/// suite starting up opens a few hundred.
pub const NEW_FLOW_BURST: u32 = 4096;

/// TCP dials per second that may *fail* (refused, unreachable or timed out),
/// sustained. Each dial takes a token of this bucket as well as a new-flow
/// token, and a dial that succeeds gives it back, so dials in flight count
/// and only failures spend it: a SYN flood or port scan against closed ports
/// costs the manager at most this many real kernel dials a second once
/// [`FAILED_FLOW_BURST`] is spent, while connections that succeed (a load
/// test, tr-12's 3000 flows) are held only to [`NEW_FLOWS_PER_SEC`].
///
/// Measured (bench `kvpn-fairness` row, debug build, 2-core lab machine):
/// with failed dials held only to the 1000/s of [`NEW_FLOWS_PER_SEC`], laptop
/// A's SYN flood to closed ports (5000 SYNs/s) cut laptop B's upload through
/// the same manager to 0.80–0.83× of its throughput alone: each admitted SYN
/// was a tokio task, a socket, a connect(2) answered by RST and an RST back to
/// the laptop, ~1000 times a second. With this bucket the manager's extra CPU
/// per Gbit of B under that flood fell from +19–26% to +13–16% (three runs
/// each; the throughput ratios themselves were noise on the busy machine). A
/// developer's tools see a refused port a few times a second at most (a
/// client retrying a service that is down).
pub const FAILED_FLOWS_PER_SEC: u32 = 100;

/// Dials in flight or failed at once (bucket size): as large as the new-flow
/// burst, so tr-12's 3000 concurrent dials are all in flight together; a
/// scan's first [`NEW_FLOW_BURST`] ports are answered at once, the rest at
/// [`FAILED_FLOWS_PER_SEC`].
pub const FAILED_FLOW_BURST: u32 = NEW_FLOW_BURST;

/// ICMP errors per second the manager sends one laptop (port/host
/// unreachable, admin prohibited), sustained; Linux's `icmp_ratelimit` allows
/// one per ms per destination as well.
pub const ICMP_ERRORS_PER_SEC: u32 = 1000;

/// ICMP errors sent at once (Linux `icmp_msgs_burst` is 50; a little more so
/// a scan of a few hundred ports is answered at once).
pub const ICMP_ERROR_BURST: u32 = 200;

/// A token bucket: `rate` tokens per second, at most `burst` stored. A rate of
/// 0 disables the limit (every take succeeds).
#[derive(Debug, Clone)]
pub struct TokenBucket {
    rate: u32,
    burst: u32,
    /// Tokens in millitokens, so slow rates refill smoothly.
    milli: u64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket at `now`.
    pub fn new(rate: u32, burst: u32, now: Instant) -> Self {
        Self {
            rate,
            burst,
            milli: u64::from(burst) * 1000,
            last: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.last);
        if elapsed.is_zero() {
            return;
        }
        self.last = now;
        // rate tokens/s = rate millitokens/ms; micros keep small steps exact.
        let add = u64::try_from(elapsed.as_micros())
            .unwrap_or(u64::MAX)
            .saturating_mul(u64::from(self.rate))
            / 1000;
        self.milli = self
            .milli
            .saturating_add(add)
            .min(u64::from(self.burst) * 1000);
    }

    /// Take one token; false when the bucket is empty.
    pub fn take(&mut self, now: Instant) -> bool {
        if self.rate == 0 {
            return true;
        }
        self.refill(now);
        if self.milli >= 1000 {
            self.milli -= 1000;
            true
        } else {
            false
        }
    }

    /// Give back a token taken by [`TokenBucket::take`] (the work it paid
    /// for turned out free), up to the burst.
    pub fn give_back(&mut self) {
        self.milli = (self.milli + 1000).min(u64::from(self.burst) * 1000);
    }

    /// Whether a token is available at `now` (without taking it); always true
    /// with a rate of 0.
    pub fn has_token(&mut self, now: Instant) -> bool {
        if self.rate == 0 {
            return true;
        }
        self.refill(now);
        self.milli >= 1000
    }

    /// Whole tokens available at `now`.
    pub fn available(&mut self, now: Instant) -> u32 {
        self.refill(now);
        u32::try_from(self.milli / 1000).unwrap_or(u32::MAX)
    }

    /// How long until one token is available (zero if one is).
    pub fn wait(&self) -> Duration {
        if self.rate == 0 || self.milli >= 1000 {
            return Duration::ZERO;
        }
        let missing = 1000 - self.milli;
        Duration::from_micros(missing.saturating_mul(1000) / u64::from(self.rate))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_then_rate() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(100, 10, t0);
        for i in 0..10 {
            assert!(b.take(t0), "token {i} of the burst");
        }
        assert!(!b.take(t0), "the burst is spent");
        assert!(b.wait() > Duration::ZERO);
        // 100/s: one token every 10 ms.
        assert!(!b.take(t0 + Duration::from_millis(9)));
        assert!(b.take(t0 + Duration::from_millis(10)));
        assert!(!b.take(t0 + Duration::from_millis(10)));
        // A long pause refills to the burst only.
        assert_eq!(b.available(t0 + Duration::from_secs(60)), 10);
    }

    #[test]
    fn a_token_given_back_is_available_again_up_to_the_burst() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(1, 2, t0);
        assert!(b.take(t0) && b.take(t0));
        assert!(!b.has_token(t0));
        b.give_back();
        assert!(b.has_token(t0) && b.take(t0));
        b.give_back();
        b.give_back();
        b.give_back();
        assert_eq!(b.available(t0), 2, "never above the burst");
    }

    #[test]
    fn zero_rate_means_unlimited() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(0, 0, t0);
        for _ in 0..100_000 {
            assert!(b.take(t0));
        }
    }

    #[test]
    fn time_going_backwards_adds_nothing() {
        let t0 = Instant::now() + Duration::from_secs(10);
        let mut b = TokenBucket::new(1000, 1, t0);
        assert!(b.take(t0));
        assert!(!b.take(t0 - Duration::from_secs(5)));
    }
}
