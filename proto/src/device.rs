//! An in-memory smoltcp [`Device`] for either end of the data channel: two
//! packet queues. The owner pushes the peer's packets into `rx` and drains what
//! smoltcp (and the owner itself) sends to the peer from `tx`. Pure: no I/O.
//! The manager's engine uses it with the laptop as the peer; the laptop's SOCKS5
//! stack (no TUN) with the manager as the peer.
//!
//! Packet buffers are recycled: [`QueueDevice::push_rx_copy`] and smoltcp's
//! transmit tokens take a buffer from a bounded free list (the receive token gives
//! its buffer back after smoltcp read it; the owner gives transmitted ones back with
//! [`QueueDevice::recycle`]), so a steady flow allocates nothing per packet.
//!
//! Checksums are computed on transmit and not verified on receive: packets
//! cross a reliable, integrity-protected byte stream (TLS), and the laptop's TUN
//! may leave checksums to offload.

use std::collections::VecDeque;

use smoltcp::phy::{
    Checksum, ChecksumCapabilities, Device, DeviceCapabilities, Medium, RxToken, TxToken,
};
use smoltcp::time::Instant;

/// Free buffers kept per direction: a poll's worth of packets (smoltcp's
/// sockets send at most a window per poll), so a busy engine reuses them and an
/// idle one holds at most this many.
pub const POOL_BUFFERS: usize = 256;

/// Buffers larger than this are not kept (a reassembled datagram can be 64 KiB).
const POOL_MAX_CAPACITY: usize = 16 * 1024;

/// Raw IP packets in both directions, as queues.
#[derive(Debug)]
pub struct QueueDevice {
    mtu: usize,
    rx: VecDeque<Vec<u8>>,
    tx: VecDeque<Vec<u8>>,
    /// Free buffers for received packets (given back by the receive token).
    rx_free: Vec<Vec<u8>>,
    /// Free buffers for transmitted packets (given back by [`Self::recycle`]).
    tx_free: Vec<Vec<u8>>,
    /// Buffers allocated because a free list was empty (for tests and metrics).
    allocated: u64,
}

impl QueueDevice {
    /// A device of `mtu` bytes (the IP MTU; Medium::Ip has no link header).
    pub fn new(mtu: usize) -> Self {
        Self {
            mtu,
            rx: VecDeque::new(),
            tx: VecDeque::new(),
            rx_free: Vec::new(),
            tx_free: Vec::new(),
            allocated: 0,
        }
    }

    /// Queue a packet for smoltcp to receive on its next poll.
    pub fn push_rx(&mut self, packet: Vec<u8>) {
        self.rx.push_back(packet);
    }

    /// Queue a copy of `packet` for smoltcp, in a recycled buffer.
    pub fn push_rx_copy(&mut self, packet: &[u8]) {
        let mut buf = take(&mut self.rx_free, &mut self.allocated);
        buf.extend_from_slice(packet);
        self.rx.push_back(buf);
    }

    /// An empty buffer from the receive pool (allocated only when the pool is
    /// empty), to be filled and queued with [`QueueDevice::push_rx`], or given
    /// back with [`QueueDevice::recycle_rx`].
    pub fn take_rx_buffer(&mut self) -> Vec<u8> {
        take(&mut self.rx_free, &mut self.allocated)
    }

    /// Give back a buffer from [`QueueDevice::take_rx_buffer`] that was not queued.
    pub fn recycle_rx(&mut self, buf: Vec<u8>) {
        give_back(&mut self.rx_free, buf);
    }

    /// Give back a buffer [`Self::pop_tx`] or [`Self::drain_tx`] returned, once
    /// its packet is sent on.
    pub fn recycle(&mut self, buf: Vec<u8>) {
        give_back(&mut self.tx_free, buf);
    }

    /// Buffers allocated so far because no free one was there.
    pub fn buffers_allocated(&self) -> u64 {
        self.allocated
    }

    /// Queue a packet built outside smoltcp for the peer.
    pub fn push_tx(&mut self, packet: Vec<u8>) {
        self.tx.push_back(packet);
    }

    /// The oldest packet for the peer.
    pub fn pop_tx(&mut self) -> Option<Vec<u8>> {
        self.tx.pop_front()
    }

    /// Every packet for the peer, oldest first.
    pub fn drain_tx(&mut self) -> std::collections::vec_deque::Drain<'_, Vec<u8>> {
        self.tx.drain(..)
    }

    /// Packets waiting for smoltcp.
    pub fn rx_len(&self) -> usize {
        self.rx.len()
    }
}

/// An empty buffer from `free`, or a new one (counted in `allocated`).
fn take(free: &mut Vec<Vec<u8>>, allocated: &mut u64) -> Vec<u8> {
    match free.pop() {
        Some(mut buf) => {
            buf.clear();
            buf
        }
        None => {
            *allocated += 1;
            Vec::with_capacity(2048)
        }
    }
}

fn give_back(free: &mut Vec<Vec<u8>>, buf: Vec<u8>) {
    if free.len() < POOL_BUFFERS && buf.capacity() <= POOL_MAX_CAPACITY {
        free.push(buf);
    }
}

/// Receive token: one queued packet; its buffer goes back to the free list.
pub struct QueueRxToken<'a> {
    packet: Vec<u8>,
    free: &'a mut Vec<Vec<u8>>,
}

impl RxToken for QueueRxToken<'_> {
    fn consume<R, F>(self, f: F) -> R
    where
        F: FnOnce(&[u8]) -> R,
    {
        let r = f(&self.packet);
        give_back(self.free, self.packet);
        r
    }
}

/// Transmit token: appends to the tx queue, in a recycled buffer.
pub struct QueueTxToken<'a> {
    tx: &'a mut VecDeque<Vec<u8>>,
    free: &'a mut Vec<Vec<u8>>,
    allocated: &'a mut u64,
}

impl TxToken for QueueTxToken<'_> {
    fn consume<R, F>(self, len: usize, f: F) -> R
    where
        F: FnOnce(&mut [u8]) -> R,
    {
        let mut buf = take(self.free, self.allocated);
        buf.resize(len, 0);
        let r = f(&mut buf);
        self.tx.push_back(buf);
        r
    }
}

impl Device for QueueDevice {
    type RxToken<'a>
        = QueueRxToken<'a>
    where
        Self: 'a;
    type TxToken<'a>
        = QueueTxToken<'a>
    where
        Self: 'a;

    fn receive(&mut self, _timestamp: Instant) -> Option<(Self::RxToken<'_>, Self::TxToken<'_>)> {
        let packet = self.rx.pop_front()?;
        Some((
            QueueRxToken {
                packet,
                free: &mut self.rx_free,
            },
            QueueTxToken {
                tx: &mut self.tx,
                free: &mut self.tx_free,
                allocated: &mut self.allocated,
            },
        ))
    }

    fn transmit(&mut self, _timestamp: Instant) -> Option<Self::TxToken<'_>> {
        Some(QueueTxToken {
            tx: &mut self.tx,
            free: &mut self.tx_free,
            allocated: &mut self.allocated,
        })
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ip;
        caps.max_transmission_unit = self.mtu;
        let mut checksum = ChecksumCapabilities::default();
        checksum.ipv4 = Checksum::Tx;
        checksum.tcp = Checksum::Tx;
        checksum.udp = Checksum::Tx;
        checksum.icmpv4 = Checksum::Tx;
        checksum.icmpv6 = Checksum::Tx;
        caps.checksum = checksum;
        caps
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> Instant {
        Instant::from_millis(0)
    }

    #[test]
    fn buffers_are_recycled_in_both_directions() {
        let mut d = QueueDevice::new(1500);
        for round in 0..1000u32 {
            let packet = round.to_be_bytes().repeat(300);
            d.push_rx_copy(&packet);
            let (rx, tx) = d.receive(now()).expect("a queued packet");
            let seen = rx.consume(|p| p.to_vec());
            assert_eq!(seen, packet, "round {round}: the packet as queued");
            tx.consume(1200, |b| b.fill(7));
            let out = d.pop_tx().expect("transmitted");
            assert_eq!(out.len(), 1200);
            assert!(out.iter().all(|&b| b == 7));
            d.recycle(out);
        }
        // One buffer per direction, allocated in the first round, reused since.
        assert_eq!(d.buffers_allocated(), 2);
    }

    #[test]
    fn free_lists_are_bounded() {
        let mut d = QueueDevice::new(1500);
        for _ in 0..(POOL_BUFFERS + 50) {
            d.push_rx_copy(&[1, 2, 3]);
        }
        while let Some((rx, _)) = d.receive(now()) {
            rx.consume(|_| ());
        }
        assert_eq!(d.rx_free.len(), POOL_BUFFERS);
        d.recycle(Vec::with_capacity(POOL_MAX_CAPACITY + 1));
        assert!(d.tx_free.is_empty(), "an oversized buffer is not kept");
    }
}
