//! Laptop-to-laptop forwarding: the live sessions by tunnel IP.
//!
//! A packet from one laptop whose destination is another live session's tunnel
//! IP is not terminated in smoltcp: it is framed and queued on that session's
//! writer as it is (the manager is a router between tunnel IPs). The queue is
//! the writer's bounded channel; when it is full the packet is dropped and
//! counted ([`crate::packet::DropReason::PeerQueueFull`]) rather than making one
//! laptop's reader wait on another laptop's writer (two laptops sending to each
//! other would otherwise deadlock). TCP between laptops retransmits.
//!
//! A laptop with several worker connections (hello option 3) registers each
//! under (tunnel IP, worker index): a re-dial of one worker replaces only that
//! worker's entry. Packets for the laptop go to its lowest-index live worker
//! connection, so they keep their order while the set of workers is stable; the
//! laptop's kernel takes a packet on any of its TUN queues.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use tokio::sync::mpsc;

/// One session's frame queue towards its laptop (batches of encoded frames).
pub type FrameSender = mpsc::Sender<Vec<u8>>;

/// One worker connection of a laptop.
#[derive(Debug)]
struct Entry {
    /// Worker index from the hello (0 without option 3).
    worker: u16,
    generation: u64,
    tx: FrameSender,
}

#[derive(Debug, Default)]
struct Inner {
    /// Per tunnel IP, its worker connections sorted by worker index.
    sessions: RwLock<HashMap<IpAddr, Vec<Entry>>>,
    next_generation: AtomicU64,
}

/// The registry of live sessions, shared by all sessions of a manager.
#[derive(Debug, Clone, Default)]
pub struct Peers {
    inner: Arc<Inner>,
}

/// Removes its session from the registry when dropped (unless a newer session
/// with the same tunnel IP replaced it).
#[derive(Debug)]
pub struct PeerRegistration {
    peers: Peers,
    ip: IpAddr,
    worker: u16,
    generation: u64,
}

impl Peers {
    /// Register worker connection `worker` of the session of `ip`; the newest
    /// registration of an (IP, worker) wins (a laptop that redials before the
    /// manager noticed the old channel died), other workers' stay.
    pub fn register(&self, ip: IpAddr, worker: u16, frames_tx: FrameSender) -> PeerRegistration {
        let generation = self.inner.next_generation.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut map) = self.inner.sessions.write() {
            let entries = map.entry(ip).or_default();
            entries.retain(|e| e.worker != worker);
            entries.push(Entry {
                worker,
                generation,
                tx: frames_tx,
            });
            entries.sort_by_key(|e| e.worker);
        }
        PeerRegistration {
            peers: self.clone(),
            ip,
            worker,
            generation,
        }
    }

    /// The frame queue of the live session with tunnel IP `ip` (its
    /// lowest-index worker connection).
    pub fn get(&self, ip: IpAddr) -> Option<FrameSender> {
        self.inner
            .sessions
            .read()
            .ok()
            .and_then(|map| map.get(&ip).and_then(|e| e.first()).map(|e| e.tx.clone()))
    }

    /// Frame `packet` and queue it on the live session of `ip`: `None` when there
    /// is none, `Some(false)` when its queue is full or closing (or the packet does
    /// not fit a frame). The frame is only built once a peer is found, so packets
    /// for the cluster (every packet the engine handles passes here first) cost a
    /// map lookup and no allocation.
    pub fn try_send(&self, ip: IpAddr, packet: &[u8]) -> Option<bool> {
        let map = self.inner.sessions.read().ok()?;
        let tx = &map.get(&ip)?.first()?.tx;
        let mut frame = Vec::with_capacity(kvpn_proto::frame::HEADER_LEN + packet.len());
        if kvpn_proto::frame::encode_into(kvpn_proto::frame::Kind::Packet, packet, &mut frame)
            .is_err()
        {
            return Some(false);
        }
        Some(tx.try_send(frame).is_ok())
    }

    /// Number of live sessions.
    pub fn len(&self) -> usize {
        self.inner.sessions.read().map_or(0, |m| m.len())
    }

    /// Whether no session is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for PeerRegistration {
    fn drop(&mut self) {
        if let Ok(mut map) = self.peers.inner.sessions.write()
            && let Some(entries) = map.get_mut(&self.ip)
        {
            entries.retain(|e| !(e.worker == self.worker && e.generation == self.generation));
            if entries.is_empty() {
                map.remove(&self.ip);
            }
        }
    }
}

/// Source and destination of a raw IPv4/IPv6 packet (header only; `None` when
/// too short or not IP).
pub fn addrs(packet: &[u8]) -> Option<(IpAddr, IpAddr)> {
    match packet.first()? >> 4 {
        4 if packet.len() >= 20 => {
            let src: [u8; 4] = packet.get(12..16)?.try_into().ok()?;
            let dst: [u8; 4] = packet.get(16..20)?.try_into().ok()?;
            Some((IpAddr::from(src), IpAddr::from(dst)))
        }
        6 if packet.len() >= 40 => {
            let src: [u8; 16] = packet.get(8..24)?.try_into().ok()?;
            let dst: [u8; 16] = packet.get(24..40)?.try_into().ok()?;
            Some((IpAddr::from(src), IpAddr::from(dst)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newest_registration_wins_and_old_drop_keeps_it() {
        let peers = Peers::default();
        let ip: IpAddr = "100.96.0.2".parse().expect("ip");
        let (tx1, _rx1) = mpsc::channel(1);
        let (tx2, mut rx2) = mpsc::channel(1);
        let old = peers.register(ip, 0, tx1);
        let new = peers.register(ip, 0, tx2);
        drop(old);
        let tx = peers.get(ip).expect("still registered");
        tx.try_send(vec![1]).expect("queue");
        assert_eq!(rx2.try_recv().expect("newest got it"), vec![1]);
        drop(new);
        assert!(peers.get(ip).is_none());
        assert!(peers.is_empty());
    }

    #[test]
    fn a_worker_connection_never_replaces_another_workers() {
        let peers = Peers::default();
        let ip: IpAddr = "100.96.0.2".parse().expect("ip");
        let (tx0, mut rx0) = mpsc::channel(4);
        let (tx1, mut rx1) = mpsc::channel(4);
        let w0 = peers.register(ip, 0, tx0);
        let w1 = peers.register(ip, 1, tx1);
        assert_eq!(peers.try_send(ip, &[0x45; 20]), Some(true));
        assert!(
            rx0.try_recv().is_ok(),
            "worker 0 carries the laptop's packets"
        );
        assert!(rx1.try_recv().is_err());
        // Worker 0 gone (its connection lost): worker 1 still reaches the laptop.
        drop(w0);
        assert_eq!(peers.try_send(ip, &[0x45; 20]), Some(true));
        assert!(rx1.try_recv().is_ok());
        assert_eq!(peers.len(), 1);
        // Worker 0 re-dialled: it carries them again; worker 1 stays registered.
        let (tx0b, mut rx0b) = mpsc::channel(4);
        let _w0b = peers.register(ip, 0, tx0b);
        assert_eq!(peers.try_send(ip, &[0x45; 20]), Some(true));
        assert!(rx0b.try_recv().is_ok());
        drop(w1);
        assert!(peers.get(ip).is_some(), "worker 1's end leaves worker 0");
    }

    #[test]
    fn addrs_of_v4_v6_and_garbage() {
        let mut v4 = vec![0u8; 20];
        v4[0] = 0x45;
        v4[12..16].copy_from_slice(&[100, 96, 0, 2]);
        v4[16..20].copy_from_slice(&[100, 96, 0, 3]);
        assert_eq!(
            addrs(&v4),
            Some((
                "100.96.0.2".parse().expect("ip"),
                "100.96.0.3".parse().expect("ip")
            ))
        );
        let mut v6 = vec![0u8; 40];
        v6[0] = 0x60;
        v6[23] = 2;
        v6[39] = 3;
        assert_eq!(
            addrs(&v6),
            Some(("::2".parse().expect("ip"), "::3".parse().expect("ip")))
        );
        assert_eq!(addrs(&v4[..19]), None);
        assert_eq!(addrs(&[]), None);
        assert_eq!(addrs(&[0x10; 40]), None);
    }
}
