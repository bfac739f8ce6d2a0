//! The steering watch (`--steer ebpf`, case rt-05): while a session runs, keeps
//! eBPF steering on exactly the laptop devices that carry a conflicting route now.
//!
//! Connect finds the devices once ([`crate::conflicts::steer_targets`]). Another VPN
//! on the laptop reconnects, though: its device (wg0, tun0) is deleted and created
//! again under the same name with a new ifindex and no TC program, or its route
//! moves to another device. Without this watch cluster traffic would silently go
//! into the other VPN again while Status still named the old device.
//!
//! Pure core: [`diff`] (what to detach and attach, and why). I/O shell: [`spawn`],
//! a task that listens to rtnetlink's link and IPv4 route notifications
//! (RTNLGRP_LINK, RTNLGRP_IPV4_ROUTE, the groups of `ip monitor link route`) on a
//! socket of its own, and after each burst re-reads the laptop's routes, applies the
//! connect rules ([`crate::conflicts::find`], [`crate::conflicts::steer_plan`]) and
//! changes the classifier's steering links. The kernel deletes a device's IPv4
//! routes without RTM_DELROUTE notifications (`fib_disable_ip`), so link
//! notifications are what tells a device went away. A notification socket whose
//! buffer overflowed (ENOBUFS, an overrun message) costs nothing more than a
//! re-read; if the socket itself fails the watch falls back to re-reading every
//! [`FALLBACK_RECHECK`]. A monitor rather than a periodic re-check because the
//! reaction must come within the few seconds a reconnecting VPN takes, and a
//! re-read per second on an idle laptop would be waste: with the monitor a burst
//! costs one route dump, and a storm (a container runtime creating networks) at
//! most one per [`SETTLE`].
//!
//! A failure (a link type steering cannot handle, an IPv6 conflict, the kernel
//! refusing the attachment) is logged and kept for Status; the session goes on, and
//! the next notification tries again.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt as _;
use ipnet::IpNet;
use rtnetlink::MulticastGroup;
use rtnetlink::packet_core::NetlinkPayload;
use rtnetlink::packet_route::RouteNetlinkMessage;
use tokio::task::JoinHandle;
use tracing::Instrument as _;

use crate::conflicts;
use crate::ebpf::RouteKind;
use crate::netlink::{Netlink, RTPROT_KVPN};
use crate::watched::{ClassifierSlot, Watched};

/// How long the watch lets a burst of notifications settle before re-reading the
/// routes: `ip link add` + `ip addr add` + `ip route add` of a reconnecting VPN come
/// within milliseconds, and one route dump then covers them all.
pub const SETTLE: Duration = Duration::from_millis(50);

/// Re-read interval once the notification socket has failed (never in normal
/// operation): a route dump is a few hundred microseconds on a laptop.
pub const FALLBACK_RECHECK: Duration = Duration::from_secs(2);

/// Why a device is attached or detached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Why {
    /// A conflicting route (outside main/local) now goes through it.
    NewConflict,
    /// A device of that name was steered with another ifindex: deleted and created
    /// again (its TC programs went with the old one).
    Recreated {
        /// The ifindex steered before.
        old: u32,
        /// The ifindex now.
        new: u32,
    },
    /// No conflicting route goes through it any more (the route moved or went).
    NoConflict,
    /// The device was deleted (its routes and TC programs went with it).
    Deleted,
}

impl std::fmt::Display for Why {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Why::NewConflict => f.write_str("a conflicting route goes through it"),
            Why::Recreated { old, new } => write!(
                f,
                "deleted and created again (ifindex {old} -> {new}), its TC programs gone"
            ),
            Why::NoConflict => f.write_str("no conflicting route goes through it any more"),
            Why::Deleted => f.write_str("the device was deleted"),
        }
    }
}

/// One change of the steered devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Release the link on `ifindex`.
    Detach {
        /// Device name when it was attached.
        dev: String,
        /// Its ifindex then.
        ifindex: u32,
        /// Why.
        why: Why,
    },
    /// Attach to `dev` (`ifindex`).
    Attach {
        /// Device name.
        dev: String,
        /// Its ifindex.
        ifindex: u32,
        /// Why.
        why: Why,
    },
}

/// The changes that take the `steered` devices to the `wanted` ones, all as
/// (name, ifindex): detaches first (a re-created device's old link goes before its
/// new one comes), then attaches, each in input order. A device is the same only
/// with the same name and ifindex. `deleted`: the steered ifindexes that no longer
/// exist. `departed`: devices detached earlier because they were deleted, so that
/// one created again under the same name (the other VPN's reconnect usually comes
/// as a deletion, then a creation) is named as such.
pub fn diff(
    steered: &[(String, u32)],
    deleted: &[u32],
    departed: &BTreeMap<String, u32>,
    wanted: &[(String, u32)],
) -> Vec<Change> {
    let mut out = Vec::new();
    for (dev, ifindex) in steered {
        if wanted.iter().any(|(d, i)| d == dev && i == ifindex) {
            continue;
        }
        let why = match wanted.iter().find(|(d, _)| d == dev) {
            Some((_, new)) => Why::Recreated {
                old: *ifindex,
                new: *new,
            },
            None if deleted.contains(ifindex) => Why::Deleted,
            None => Why::NoConflict,
        };
        out.push(Change::Detach {
            dev: dev.clone(),
            ifindex: *ifindex,
            why,
        });
    }
    for (dev, ifindex) in wanted {
        if steered.iter().any(|(d, i)| d == dev && i == ifindex) {
            continue;
        }
        let old = steered
            .iter()
            .find(|(d, _)| d == dev)
            .map(|(_, i)| *i)
            .or_else(|| departed.get(dev).copied())
            .filter(|old| old != ifindex);
        let why = match old {
            Some(old) => Why::Recreated { old, new: *ifindex },
            None => Why::NewConflict,
        };
        out.push(Change::Attach {
            dev: dev.clone(),
            ifindex: *ifindex,
            why,
        });
    }
    out
}

/// What the watch reports to Status.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SteerState {
    /// Attachments the watch made after connect (new or re-created devices).
    pub reattachments: u64,
    /// Conflicts steering cannot handle now, by device (or range), with why.
    pub errors: BTreeMap<String, String>,
    /// Devices detached because they were deleted, with their old ifindex (for
    /// the log line when they come back; at most [`MAX_DEPARTED`]).
    pub departed: BTreeMap<String, u32>,
}

/// Deleted devices remembered for naming their re-creation: a laptop has a few
/// VPNs, not thousands.
pub const MAX_DEPARTED: usize = 64;

/// What the watch needs of its session.
pub struct Inputs {
    /// The daemon's rtnetlink handle (route dumps, link types).
    pub netlink: Netlink,
    /// The session's classifier, which owns the steering links.
    pub classifier: ClassifierSlot,
    /// The session's watched routes (ranges added after connect).
    pub watched: Arc<Mutex<Watched>>,
    /// The Connect ranges.
    pub connect: Vec<(IpNet, RouteKind)>,
    /// The session's TUN device: the redirect target, and its routes are no conflict.
    pub tun_ifindex: u32,
    /// The new source of steered packets.
    pub tunnel_ip: Ipv4Addr,
}

/// A running watch; dropping it stops it.
#[derive(Debug)]
pub struct SteerWatch {
    state: Arc<Mutex<SteerState>>,
    task: Option<JoinHandle<()>>,
}

impl SteerWatch {
    /// What it reports now.
    pub fn state(&self) -> SteerState {
        lock(&self.state).clone()
    }

    /// Stop the task and wait for it (so that it touches the classifier no more).
    pub async fn stop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for SteerWatch {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Open the notification socket (in the calling thread's network namespace, the
/// laptop's) and start the watch on the current runtime, in the current span.
pub fn spawn(inputs: Inputs) -> std::io::Result<SteerWatch> {
    let (connection, _handle, messages) =
        rtnetlink::new_multicast_connection(&[MulticastGroup::Link, MulticastGroup::Ipv4Route])?;
    let state = Arc::new(Mutex::new(SteerState::default()));
    let task = tokio::spawn(run(connection, messages, inputs, state.clone()).in_current_span());
    Ok(SteerWatch {
        state,
        task: Some(task),
    })
}

async fn run<M>(
    connection: impl std::future::Future<Output = ()>,
    mut messages: futures::channel::mpsc::UnboundedReceiver<(
        rtnetlink::packet_core::NetlinkMessage<RouteNetlinkMessage>,
        M,
    )>,
    inputs: Inputs,
    state: Arc<Mutex<SteerState>>,
) {
    let mut connection = std::pin::pin!(connection);
    let mut monitoring = true;
    let mut warned = false;
    // A change between connect's route read and this socket's bind would be missed:
    // re-read once at the start.
    resync(&inputs, &state).await;
    loop {
        let relevant = tokio::select! {
            () = &mut connection, if monitoring => {
                monitoring = false;
                true
            }
            message = messages.next(), if monitoring => match message {
                Some((message, _)) => relevant(&message.payload),
                None => {
                    monitoring = false;
                    true
                }
            },
            () = tokio::time::sleep(FALLBACK_RECHECK), if !monitoring => true,
        };
        if !relevant {
            continue;
        }
        if !monitoring && !warned {
            warned = true;
            tracing::warn!(
                every_ms = FALLBACK_RECHECK.as_millis(),
                "rtnetlink notification socket closed: steering re-checks the laptop's routes periodically"
            );
        }
        tokio::time::sleep(SETTLE).await;
        while messages.try_recv().is_ok() {}
        resync(&inputs, &state).await;
    }
}

/// Link and IPv4 route changes, and an overrun (notifications lost: re-read).
/// kvpn's own route changes count too: a watched route added through the TUN
/// device brings a new range that may conflict.
fn relevant(payload: &NetlinkPayload<RouteNetlinkMessage>) -> bool {
    match payload {
        NetlinkPayload::InnerMessage(m) => matches!(
            m,
            RouteNetlinkMessage::NewLink(_)
                | RouteNetlinkMessage::DelLink(_)
                | RouteNetlinkMessage::NewRoute(_)
                | RouteNetlinkMessage::DelRoute(_)
        ),
        NetlinkPayload::Overrun(_) => true,
        _ => false,
    }
}

/// Re-read the laptop's routes and make the steered devices the connect rules' ones.
async fn resync(inputs: &Inputs, state: &Mutex<SteerState>) {
    let laptop = match inputs.netlink.laptop_routes().await {
        Ok(routes) => routes,
        Err(e) => {
            tracing::warn!(error = %e, "steering: cannot read the laptop's routes; keeping the steered devices");
            return;
        }
    };
    let ranges: Vec<(IpNet, RouteKind)> = {
        let watched = lock(&inputs.watched);
        inputs
            .connect
            .iter()
            .copied()
            .chain(watched.routes.iter().map(|(n, k)| (*n, *k)))
            .chain(watched.not_installed.iter().map(|(n, k)| (*n, *k)))
            .collect()
    };
    let found = conflicts::find(&ranges, &laptop, RTPROT_KVPN, Some(inputs.tun_ifindex));
    let plan = conflicts::steer_plan(&found);
    let mut errors: BTreeMap<String, String> = plan
        .errors
        .iter()
        .map(|e| {
            (
                e.split(':').next().unwrap_or_default().to_owned(),
                e.clone(),
            )
        })
        .collect();
    // Link types first (netlink, no lock held), then the classifier under its lock.
    let mut wanted = Vec::new();
    for (dev, ifindex) in &plan.devices {
        match inputs.netlink.l2_hdr_len(*ifindex).await {
            Ok(Some(l2)) => wanted.push((dev.clone(), *ifindex, l2)),
            Ok(None) => {
                errors.insert(
                    dev.clone(),
                    format!(
                        "cannot steer {dev} (ifindex {ifindex}): gone, or a link type other \
                         than Ethernet, TUN/WireGuard, PPP or raw IP"
                    ),
                );
            }
            Err(e) => {
                errors.insert(dev.clone(), format!("cannot steer {dev}: {e}"));
            }
        }
    }
    // Only this task and teardown (which stops it first) change the steered
    // devices, so the list read here holds until the changes below.
    let steered = match lock(&inputs.classifier).as_ref() {
        Some(classifier) => classifier.steered_devices(),
        None => return,
    };
    let mut deleted = Vec::new();
    for (_, ifindex) in &steered {
        if let Ok(false) = inputs.netlink.link_exists(*ifindex).await {
            deleted.push(*ifindex);
        }
    }
    let mut departed = lock(state).departed.clone();
    let targets: Vec<(String, u32)> = wanted.iter().map(|(d, i, _)| (d.clone(), *i)).collect();
    let changes = diff(&steered, &deleted, &departed, &targets);
    let mut attached = 0u64;
    {
        let mut slot = lock(&inputs.classifier);
        let Some(classifier) = slot.as_mut() else {
            return;
        };
        for change in changes {
            match change {
                Change::Detach { dev, ifindex, why } => match classifier.unsteer(ifindex) {
                    Ok(()) => {
                        tracing::info!(dev, ifindex, %why, "eBPF steering detached");
                        if why == Why::Deleted && departed.len() < MAX_DEPARTED {
                            departed.insert(dev, ifindex);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(dev, ifindex, %why, error = %e, "cannot detach eBPF steering");
                        errors.insert(dev.clone(), format!("cannot detach from {dev}: {e}"));
                    }
                },
                Change::Attach { dev, ifindex, why } => {
                    let Some((_, _, l2)) = wanted.iter().find(|(_, i, _)| *i == ifindex) else {
                        continue;
                    };
                    match classifier.steer(&dev, ifindex, *l2, inputs.tunnel_ip, inputs.tun_ifindex)
                    {
                        Ok(()) => {
                            attached += 1;
                            tracing::info!(dev, ifindex, %why, "eBPF steering attached");
                            departed.remove(&dev);
                        }
                        Err(e) => {
                            let message = format!(
                                "cannot steer {dev} (ifindex {ifindex}): {}",
                                crate::session::error_chain(&*e)
                            );
                            tracing::warn!(dev, ifindex, %why, error = %message, "eBPF steering not attached");
                            errors.insert(dev.clone(), message);
                        }
                    }
                }
            }
        }
    }
    let mut st = lock(state);
    st.reattachments += attached;
    st.departed = departed;
    if st.errors != errors {
        for (dev, message) in &errors {
            if st.errors.get(dev) != Some(message) {
                tracing::warn!(dev, error = %message, "steering cannot handle a route conflict");
            }
        }
        st.errors = errors;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn devs(list: &[(&str, u32)]) -> Vec<(String, u32)> {
        list.iter().map(|(d, i)| ((*d).to_owned(), *i)).collect()
    }

    #[test]
    fn rt_05_a_recreated_device_is_detached_then_attached_with_its_new_ifindex() {
        let none = BTreeMap::new();
        let got = diff(
            &devs(&[("wg0", 7), ("tun0", 9)]),
            &[7],
            &none,
            &devs(&[("tun0", 9), ("wg0", 12)]),
        );
        assert_eq!(
            got,
            vec![
                Change::Detach {
                    dev: "wg0".into(),
                    ifindex: 7,
                    why: Why::Recreated { old: 7, new: 12 },
                },
                Change::Attach {
                    dev: "wg0".into(),
                    ifindex: 12,
                    why: Why::Recreated { old: 7, new: 12 },
                },
            ]
        );
        // Deletion and creation seen apart: first the old link goes ...
        assert_eq!(
            diff(&devs(&[("wg0", 7)]), &[7], &none, &[]),
            vec![Change::Detach {
                dev: "wg0".into(),
                ifindex: 7,
                why: Why::Deleted,
            }]
        );
        // ... then the new device comes, named as the same one again.
        let departed = BTreeMap::from([("wg0".to_owned(), 7)]);
        assert_eq!(
            diff(&[], &[], &departed, &devs(&[("wg0", 12)])),
            vec![Change::Attach {
                dev: "wg0".into(),
                ifindex: 12,
                why: Why::Recreated { old: 7, new: 12 },
            }]
        );
    }

    #[test]
    fn rt_05_a_moved_route_moves_steering_and_a_gone_one_detaches() {
        let none = BTreeMap::new();
        // The conflicting route moved from wg0 to tun0.
        assert_eq!(
            diff(&devs(&[("wg0", 7)]), &[], &none, &devs(&[("tun0", 9)])),
            vec![
                Change::Detach {
                    dev: "wg0".into(),
                    ifindex: 7,
                    why: Why::NoConflict,
                },
                Change::Attach {
                    dev: "tun0".into(),
                    ifindex: 9,
                    why: Why::NewConflict,
                },
            ]
        );
        assert_eq!(
            diff(&devs(&[("wg0", 7)]), &[], &none, &[]),
            vec![Change::Detach {
                dev: "wg0".into(),
                ifindex: 7,
                why: Why::NoConflict,
            }]
        );
        assert!(diff(&devs(&[("wg0", 7)]), &[], &none, &devs(&[("wg0", 7)])).is_empty());
        assert!(diff(&[], &[], &none, &[]).is_empty());
    }

    #[test]
    fn reasons_read_as_log_lines() {
        assert_eq!(
            Why::Recreated { old: 7, new: 12 }.to_string(),
            "deleted and created again (ifindex 7 -> 12), its TC programs gone"
        );
    }
}
