//! The one wrapper around kvpn's eBPF objects (owned by the ebpf work).
//! STUB API — the ebpf helper replaces the bodies; the signatures are the contract
//! the rest of the dataplane codes against.

use std::net::IpAddr;

use ipnet::IpNet;

/// Kind of a cluster route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RouteKind {
    /// A pod CIDR.
    Pod,
    /// The service CIDR (ClusterIPs).
    Service,
    /// An `--extra-cidr`.
    Extra,
}

/// Packet and byte counters (summed over CPUs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counter {
    /// Packets.
    pub packets: u64,
    /// Bytes (IP packet length).
    pub bytes: u64,
}

/// Counters of the TC classifier.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Per route kind: packets the classifier passed.
    pub per_kind: Vec<(RouteKind, Counter)>,
    /// Packets dropped because their destination matched no route.
    pub unrouted: Counter,
}

/// Errors of the eBPF wrapper.
#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    /// Placeholder until the real loader lands.
    #[error("eBPF classifier not built yet")]
    NotBuilt,
}

/// The TC classifier attached to a TUN device's egress (laptop -> cluster direction).
pub struct Classifier {
    _private: (),
}

impl Classifier {
    /// Load the programs and maps and attach the classifier to `ifname` (TC egress, TCX).
    /// Must be called from a thread in the network namespace of `ifname`.
    pub fn attach(_ifname: &str) -> Result<Self, EbpfError> {
        Err(EbpfError::NotBuilt)
    }

    /// Add (or replace) a route entry `cidr -> kind`.
    pub fn insert_route(&mut self, _cidr: IpNet, _kind: RouteKind) -> Result<(), EbpfError> {
        Err(EbpfError::NotBuilt)
    }

    /// Remove a route entry.
    pub fn remove_route(&mut self, _cidr: IpNet) -> Result<(), EbpfError> {
        Err(EbpfError::NotBuilt)
    }

    /// Read the counters.
    pub fn stats(&self) -> Result<Stats, EbpfError> {
        Err(EbpfError::NotBuilt)
    }

    /// Look a destination up as the program would (for tests/diagnostics).
    pub fn lookup(&self, _dst: IpAddr) -> Result<Option<RouteKind>, EbpfError> {
        Err(EbpfError::NotBuilt)
    }
}
// Dropping a Classifier detaches the program (the real implementation owns the link).
