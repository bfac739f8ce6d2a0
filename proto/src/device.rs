//! An in-memory smoltcp [`Device`] for either end of the data channel: two
//! packet queues. The owner pushes the peer's packets into `rx` and drains what
//! smoltcp (and the owner itself) sends to the peer from `tx`. Pure: no I/O.
//! The manager's engine uses it with the laptop as the peer; the laptop's SOCKS5
//! stack (no TUN) with the manager as the peer.
//!
//! Checksums are computed on transmit and not verified on receive: packets
//! cross a reliable, integrity-protected byte stream (TLS), and the laptop's TUN
//! may leave checksums to offload.

use std::collections::VecDeque;

use smoltcp::phy::{
    Checksum, ChecksumCapabilities, Device, DeviceCapabilities, Medium, RxToken, TxToken,
};
use smoltcp::time::Instant;

/// Raw IP packets in both directions, as queues.
#[derive(Debug)]
pub struct QueueDevice {
    mtu: usize,
    rx: VecDeque<Vec<u8>>,
    tx: VecDeque<Vec<u8>>,
}

impl QueueDevice {
    /// A device of `mtu` bytes (the IP MTU; Medium::Ip has no link header).
    pub fn new(mtu: usize) -> Self {
        Self {
            mtu,
            rx: VecDeque::new(),
            tx: VecDeque::new(),
        }
    }

    /// Queue a packet for smoltcp to receive on its next poll.
    pub fn push_rx(&mut self, packet: Vec<u8>) {
        self.rx.push_back(packet);
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

/// Receive token: one queued packet.
pub struct QueueRxToken(Vec<u8>);

impl RxToken for QueueRxToken {
    fn consume<R, F>(self, f: F) -> R
    where
        F: FnOnce(&[u8]) -> R,
    {
        f(&self.0)
    }
}

/// Transmit token: appends to the tx queue.
pub struct QueueTxToken<'a>(&'a mut VecDeque<Vec<u8>>);

impl TxToken for QueueTxToken<'_> {
    fn consume<R, F>(self, len: usize, f: F) -> R
    where
        F: FnOnce(&mut [u8]) -> R,
    {
        let mut buf = vec![0u8; len];
        let r = f(&mut buf);
        self.0.push_back(buf);
        r
    }
}

impl Device for QueueDevice {
    type RxToken<'a>
        = QueueRxToken
    where
        Self: 'a;
    type TxToken<'a>
        = QueueTxToken<'a>
    where
        Self: 'a;

    fn receive(&mut self, _timestamp: Instant) -> Option<(Self::RxToken<'_>, Self::TxToken<'_>)> {
        let packet = self.rx.pop_front()?;
        Some((QueueRxToken(packet), QueueTxToken(&mut self.tx)))
    }

    fn transmit(&mut self, _timestamp: Instant) -> Option<Self::TxToken<'_>> {
        Some(QueueTxToken(&mut self.tx))
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
