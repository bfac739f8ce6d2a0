//! Route guard: puts back a session's kernel routes that were deleted from
//! outside kvpn (`ip route del 10.96.0.0/12 dev kvpn0`, a network manager
//! flushing routes). Without it the session stays `connected` while the
//! laptop's traffic to that range no longer reaches the TUN device.
//!
//! Every [`CHECK_INTERVAL`] the guard dumps the main table's kvpn routes
//! (protocol [`RTPROT_KVPN`]) through the session's TUN device and re-adds
//! each of the session's routes that is missing, exactly as Connect and
//! UpdateRoutes install them ([`Netlink::add_route`]: main table, protocol
//! 107, scope link, the tunnel IP of the route's family as source). Each
//! check runs under the session's route-update lock (the one UpdateRoutes
//! holds), so a route UpdateRoutes is removing is never taken for a missing
//! one; [`RouteGuard::stop`] takes the same lock before it ends the task, and
//! the session stops the guard before teardown deletes its routes.
//!
//! Pure part: [`expected`] and [`missing`]. I/O: rtnetlink ([`Netlink`]) in the
//! daemon's network namespace, one task per session.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ipnet::IpNet;
use tokio::task::JoinHandle;
use tracing::Instrument as _;

use crate::netlink::{KvpnRoute, Netlink, RTPROT_KVPN};
use crate::watched::Watched;

/// Time between two checks of a session's routes: 2 s. A deleted route is
/// back within this (plus one dump and one add, milliseconds); one route dump
/// every 2 s per session costs little next to Status, which dumps all routes
/// on every call.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(2);

/// The kernel routes a session has installed now: its Connect routes (less
/// those a laptop route of the same prefix keeps, [`Watched::not_installed`]),
/// its watched routes and its pinned ClusterIP routes. Sorted, no duplicates.
pub fn expected(connect: &[IpNet], watched: &Watched) -> Vec<IpNet> {
    let all: BTreeSet<IpNet> = connect
        .iter()
        .copied()
        .filter(|n| !watched.not_installed.contains_key(n))
        .chain(watched.routes.keys().copied())
        .chain(watched.pinned.iter().copied())
        .collect();
    all.into_iter().collect()
}

/// The routes of `expected` that `present` (kvpn routes read back from the
/// kernel) lacks through interface `ifindex`.
pub fn missing(expected: &[IpNet], present: &[KvpnRoute], ifindex: u32) -> Vec<IpNet> {
    expected
        .iter()
        .filter(|net| {
            !present
                .iter()
                .any(|r| r.oif == ifindex && r.dst.trunc() == net.trunc())
        })
        .copied()
        .collect()
}

/// What the guard of one session needs (shared handles of the session).
#[derive(Debug)]
pub struct Inputs {
    /// The daemon's rtnetlink connection.
    pub netlink: Netlink,
    /// The session's TUN device.
    pub ifindex: u32,
    /// Its name, for the log.
    pub tun_name: String,
    /// The session's tunnel IPs: preferred sources of its routes.
    pub tunnel_ips: Vec<IpAddr>,
    /// The Connect routes (kernel routes of the route plan).
    pub connect: Vec<IpNet>,
    /// The session's watched routes, not-installed and pinned ranges.
    pub watched: Arc<Mutex<Watched>>,
    /// The session's route-update lock (UpdateRoutes holds it).
    pub update_lock: Arc<tokio::sync::Mutex<()>>,
}

/// A running route guard; dropping it aborts the task.
#[derive(Debug)]
pub struct RouteGuard {
    task: Option<JoinHandle<()>>,
    update_lock: Arc<tokio::sync::Mutex<()>>,
    repaired: Arc<AtomicU64>,
}

impl RouteGuard {
    /// Start checking the session's routes every [`CHECK_INTERVAL`] (the first
    /// check one interval from now: Connect has just installed them).
    pub fn spawn(inputs: Inputs) -> Self {
        let repaired = Arc::new(AtomicU64::new(0));
        let update_lock = inputs.update_lock.clone();
        let task = tokio::spawn(run(inputs, repaired.clone()).in_current_span());
        Self {
            task: Some(task),
            update_lock,
            repaired,
        }
    }

    /// Routes re-added so far.
    pub fn repaired(&self) -> u64 {
        self.repaired.load(Ordering::Relaxed)
    }

    /// End the guard. Waits for a check under way (the route-update lock), so
    /// that nothing is re-added once this returns.
    pub async fn stop(&mut self) {
        let Some(task) = self.task.take() else {
            return;
        };
        let _serial = self.update_lock.lock().await;
        task.abort();
        let _ = task.await;
    }
}

impl Drop for RouteGuard {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

async fn run(inputs: Inputs, repaired: Arc<AtomicU64>) {
    let start = tokio::time::Instant::now() + CHECK_INTERVAL;
    let mut ticks = tokio::time::interval_at(start, CHECK_INTERVAL);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The last failure logged at warn, so that a lasting one (the device is
    // down) is not repeated every 2 s.
    let mut last_error: Option<String> = None;
    loop {
        ticks.tick().await;
        let _serial = inputs.update_lock.lock().await;
        let want = {
            let watched = inputs
                .watched
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            expected(&inputs.connect, &watched)
        };
        let present = match inputs.netlink.kvpn_routes(Some(inputs.ifindex)).await {
            Ok(present) => present,
            Err(e) => {
                let text = e.to_string();
                if last_error.as_deref() != Some(&text) {
                    tracing::warn!(error = %text, "route guard: cannot list the session's routes; checking again in 2 s");
                    last_error = Some(text);
                }
                continue;
            }
        };
        for net in missing(&want, &present, inputs.ifindex) {
            match inputs
                .netlink
                .add_route(inputs.ifindex, net, &inputs.tunnel_ips)
                .await
            {
                Ok(()) => {
                    repaired.fetch_add(1, Ordering::Relaxed);
                    last_error = None;
                    tracing::warn!(
                        cidr = %net,
                        tun = %inputs.tun_name,
                        proto = RTPROT_KVPN,
                        "route of the session was deleted from outside kvpn: re-added"
                    );
                }
                // The device is gone (deleted from outside kvpn): its routes
                // went with it and cannot come back; the session's workers
                // report it (crate::session).
                Err(e) if e.errno == Some(libc::ENODEV) => {
                    tracing::info!(tun = %inputs.tun_name, error = %e, "route guard stops: the TUN device is gone");
                    return;
                }
                Err(e) => {
                    let text = e.to_string();
                    if last_error.as_deref() != Some(&text) {
                        tracing::warn!(cidr = %net, error = %text, "route guard: cannot re-add a route of the session that was deleted from outside kvpn; trying again every 2 s");
                        last_error = Some(text);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ebpf::RouteKind;

    fn net(s: &str) -> IpNet {
        s.parse().expect("CIDR")
    }

    #[test]
    fn expected_routes_are_connect_watched_and_pinned_less_not_installed() {
        let mut watched = Watched::default();
        watched.routes.insert(net("10.245.0.0/16"), RouteKind::Pod);
        watched.pinned.insert(net("192.168.5.7/32"));
        watched
            .not_installed
            .insert(net("10.96.0.0/12"), RouteKind::Service);
        let connect = [net("10.244.0.0/16"), net("10.96.0.0/12")];
        assert_eq!(
            expected(&connect, &watched),
            vec![
                net("10.244.0.0/16"),
                net("10.245.0.0/16"),
                net("192.168.5.7/32")
            ]
        );
    }

    #[test]
    fn only_routes_missing_through_the_device_are_missing() {
        let want = [net("10.244.0.0/16"), net("10.96.0.0/12"), net("fd00::/64")];
        let present = [
            KvpnRoute {
                dst: net("10.244.0.0/16"),
                oif: 7,
            },
            // Another session's device: does not count.
            KvpnRoute {
                dst: net("10.96.0.0/12"),
                oif: 8,
            },
            KvpnRoute {
                dst: net("fd00::/64"),
                oif: 7,
            },
        ];
        assert_eq!(missing(&want, &present, 7), vec![net("10.96.0.0/12")]);
        assert!(missing(&want[..1], &present, 7).is_empty());
        assert_eq!(missing(&want, &[], 7).len(), 3);
    }
}
