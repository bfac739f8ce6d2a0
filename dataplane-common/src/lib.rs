//! Map keys, values and names shared by kvpn's eBPF programs (`dataplane-ebpf`) and
//! the userspace loader (`ebpf/src/lib.rs`, crate `kvpn-ebpf`).
//!
//! This crate owns the *layout* of every eBPF map: both sides compile against these
//! types, so a layout change happens in one place. It does no I/O. With the `user`
//! feature the types implement `aya::Pod` so userspace can read and write them.
//!
//! Byte order: addresses are stored in network byte order (as they sit in the IP
//! header, so the program copies them without swapping). Counters, prefix lengths and
//! route kinds are plain numbers in host order — they never travel on a wire.
#![cfg_attr(not(test), no_std)]

/// Name of the TC classifier program on the TUN device's egress (laptop → cluster).
pub const PROGRAM_TUN_EGRESS: &str = "kvpn_tun_egress";
/// Name of the TC anti-spoofing program on the TUN device's ingress (cluster →
/// laptop: the packets the pump writes into the TUN device).
pub const PROGRAM_TUN_INGRESS: &str = "kvpn_antispoof";
/// Name of the IPv4 route LPM trie (`Key<Ipv4Prefix>` → [`RouteEntry`]).
pub const MAP_ROUTES_V4: &str = "KVPN_ROUTES_V4";
/// Name of the IPv6 route LPM trie (`Key<Ipv6Prefix>` → [`RouteEntry`]).
pub const MAP_ROUTES_V6: &str = "KVPN_ROUTES_V6";
/// Name of the per-CPU counter array (index: `COUNTER_*` → [`CounterValue`]).
pub const MAP_COUNTERS: &str = "KVPN_COUNTERS";
/// Name of the per-CPU per-route counter array (index: [`RouteEntry::slot`] →
/// [`CounterValue`]), read by `kvpn top`.
pub const MAP_ROUTE_COUNTERS: &str = "KVPN_ROUTE_CNT";
/// Name of the per-CPU counter array of the ingress check (index: `INGRESS_*` →
/// [`CounterValue`]).
pub const MAP_INGRESS_COUNTERS: &str = "KVPN_INGR_CNT";
/// Name of the one-entry array (u32) with the fwmark the ingress check puts on the
/// packets it passes; 0 = none. A `kvpn run` session's TUN device has its run's
/// mark here, so strict reverse-path filtering (with `src_valid_mark`) looks the
/// reply's source up in the run's own routing table.
pub const MAP_INGRESS_MARK: &str = "KVPN_INGR_MARK";
/// Name of the load-time global holding the L2 header length in bytes in front of
/// the IP header: 0 on a TUN device (L3, the skb starts at the IP header), 14 for
/// Ethernet (BPF_PROG_TEST_RUN feeds TC programs an Ethernet frame).
pub const GLOBAL_L2_HDR_LEN: &str = "KVPN_L2_HDR_LEN";

/// L2 header length of a TUN device (IFF_TUN): none.
pub const L2_HDR_LEN_TUN: u32 = 0;
/// L2 header length of an Ethernet frame (dst MAC, src MAC, ethertype).
pub const L2_HDR_LEN_ETHERNET: u32 = 14;

/// Capacity of each route trie. A cluster has a handful of pod CIDRs, one service CIDR
/// and a few `--extra-cidr`s; 16384 leaves room for per-node pod ranges, ClusterIP
/// entries and sites with 10,000 routed prefixes (issue 8). The tries are allocated
/// per element (LPM tries are never preallocated), so unused capacity costs nothing.
pub const MAX_ROUTES: u32 = 16384;

/// Number of per-route counter slots (`kvpn top`). A per-CPU array is preallocated
/// (slots × CPUs × 16 bytes), so it stays small; entries past it are classified and
/// counted per kind like any other, only without a counter of their own
/// ([`NO_ROUTE_SLOT`]).
pub const MAX_ROUTE_COUNTERS: u32 = 1024;

/// [`RouteEntry::slot`] of an entry without a per-route counter slot.
pub const NO_ROUTE_SLOT: u16 = u16::MAX;

/// Route kind: a pod CIDR.
pub const ROUTE_KIND_POD: u8 = 1;
/// Route kind: the service CIDR (ClusterIPs).
pub const ROUTE_KIND_SERVICE: u8 = 2;
/// Route kind: an `--extra-cidr`.
pub const ROUTE_KIND_EXTRA: u8 = 3;

/// Counter slot: packets passed to a pod CIDR.
pub const COUNTER_POD: u32 = 0;
/// Counter slot: packets passed to the service CIDR.
pub const COUNTER_SERVICE: u32 = 1;
/// Counter slot: packets passed to an extra CIDR.
pub const COUNTER_EXTRA: u32 = 2;
/// Counter slot: packets dropped because their destination matched no route.
pub const COUNTER_UNROUTED: u32 = 3;
/// Counter slot: packets dropped because they were not a parseable IPv4/IPv6 packet
/// (truncated header, bad version or IHL, non-IP ethertype) or hit a corrupt route entry.
pub const COUNTER_MALFORMED: u32 = 4;
/// Number of counter slots (the per-CPU array's `max_entries`).
pub const COUNTER_SLOTS: u32 = 5;

/// Ingress counter slot: packets from the tunnel whose source is inside a route
/// entry (a cluster range, the tunnel pool of other laptops): passed.
pub const INGRESS_PASSED: u32 = 0;
/// Ingress counter slot: packets from the tunnel whose source is inside no route
/// entry (spoofed, or from a range this session does not route): dropped.
pub const INGRESS_FOREIGN_SOURCE: u32 = 1;
/// Ingress counter slot: packets from the tunnel that are not parseable IPv4/IPv6:
/// dropped.
pub const INGRESS_MALFORMED: u32 = 2;
/// Number of ingress counter slots.
pub const INGRESS_SLOTS: u32 = 3;

/// Counter slot of a route kind, `None` for a value that is not a route kind.
#[inline(always)]
pub const fn counter_slot(kind: u8) -> Option<u32> {
    match kind {
        ROUTE_KIND_POD => Some(COUNTER_POD),
        ROUTE_KIND_SERVICE => Some(COUNTER_SERVICE),
        ROUTE_KIND_EXTRA => Some(COUNTER_EXTRA),
        _ => None,
    }
}

/// Data part of an IPv4 route trie key: the prefix's address, network byte order.
///
/// The full key is `Key<Ipv4Prefix>` of aya / aya-ebpf (`#[repr(C, packed)]`
/// `{ prefix_len: u32 (host order), data }`), which is the kernel's
/// `struct bpf_lpm_trie_key_u8` (include/uapi/linux/bpf.h).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ipv4Prefix {
    /// Address octets as in the IP header.
    pub addr: [u8; 4],
}

/// Data part of an IPv6 route trie key: the prefix's address, network byte order.
/// See [`Ipv4Prefix`] for the full key.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ipv6Prefix {
    /// Address octets as in the IP header.
    pub addr: [u8; 16],
}

/// Value of both route tries.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteEntry {
    /// One of `ROUTE_KIND_*`.
    pub kind: u8,
    /// Zero. Explicit padding so the value has no uninitialised bytes.
    pub reserved: u8,
    /// Index of this entry's counters in the per-route counter array (host
    /// order; `< MAX_ROUTE_COUNTERS`, else — [`NO_ROUTE_SLOT`] — the entry is
    /// counted per kind only).
    pub slot: u16,
}

impl RouteEntry {
    /// An entry of `kind` (one of `ROUTE_KIND_*`) counted in per-route slot 0.
    pub const fn new(kind: u8) -> Self {
        Self::with_slot(kind, 0)
    }

    /// An entry of `kind` counted in per-route slot `slot`.
    pub const fn with_slot(kind: u8, slot: u16) -> Self {
        Self {
            kind,
            reserved: 0,
            slot,
        }
    }
}

/// Value of the per-CPU counter array: one CPU's share of a slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CounterValue {
    /// Packets.
    pub packets: u64,
    /// Bytes: the IP packet length (skb length minus the L2 header), so a GSO
    /// super-packet counts as one packet with all its bytes.
    pub bytes: u64,
}

// ---- ebpf-snat: the manager pod's source NAT on its egress interface ----

/// Name of the SNAT program on the manager pod's egress interface (TC egress):
/// rewrites the source of laptop packets (tunnel IP → pod IP, port → allocated port).
pub const PROGRAM_SNAT_EGRESS: &str = "kvpn_snat_out";
/// Name of the reverse program on the same interface (TC ingress): rewrites replies
/// (pod IP:allocated port → tunnel IP:original port) before the kernel routes them.
pub const PROGRAM_SNAT_INGRESS: &str = "kvpn_snat_in";
/// Name of the forward connection table (LRU hash, [`SnatKey`] of the laptop's packet →
/// [`SnatForward`]).
pub const MAP_SNAT_FORWARD: &str = "KVPN_SNAT_FWD";
/// Name of the reverse connection table (LRU hash, [`SnatKey`] of the reply →
/// [`SnatReverse`]).
pub const MAP_SNAT_REVERSE: &str = "KVPN_SNAT_REV";
/// Name of the fragment table of the SNAT ingress program (LRU hash, [`SnatFragKey`]
/// of a translated first fragment → the tunnel IP, 4 bytes, network order).
pub const MAP_SNAT_FRAGMENTS: &str = "KVPN_SNAT_FRAG";
/// Name of the one-entry config array (index 0 → [`SnatConfig`]).
pub const MAP_SNAT_CONFIG: &str = "KVPN_SNAT_CFG";
/// Name of the per-CPU counter array of the SNAT programs (`SNAT_*` → [`CounterValue`]).
pub const MAP_SNAT_COUNTERS: &str = "KVPN_SNAT_CNT";

/// Capacity of each SNAT connection table. LRU maps are preallocated
/// (about 100 bytes an entry with the kernel's overhead: ~6.5 MB each); past it the
/// kernel evicts the least recently used flow.
pub const SNAT_MAX_FLOWS: u32 = 65536;
/// Capacity of the SNAT fragment table: fragmented replies in flight at once (each
/// entry lives until evicted; a reply's fragments arrive within microseconds).
pub const SNAT_MAX_FRAGMENTED: u32 = 4096;
/// Ports one new flow tries (from a random start in the range) before it is dropped
/// as `SNAT_PORTS_EXHAUSTED`.
pub const SNAT_PORT_TRIES: u32 = 64;

/// SNAT counter slot: laptop packets whose source was rewritten.
pub const SNAT_TRANSLATED_OUT: u32 = 0;
/// SNAT counter slot: replies whose destination was rewritten back.
pub const SNAT_TRANSLATED_IN: u32 = 1;
/// SNAT counter slot: new flows (a port was allocated).
pub const SNAT_NEW_FLOWS: u32 = 2;
/// SNAT counter slot: new flows dropped because no port was free for their destination.
pub const SNAT_PORTS_EXHAUSTED: u32 = 3;
/// SNAT counter slot: packets from the tunnel pool that cannot be translated (not
/// TCP, UDP or ICMP echo; a truncated header): dropped, so
/// no tunnel IP leaves the pod.
pub const SNAT_UNTRANSLATABLE: u32 = 4;
/// SNAT counter slot: ICMP errors (destination unreachable, time exceeded, parameter
/// problem) about a translated flow, rewritten back to the laptop's tunnel IP and
/// original port (outer destination and the quoted inner header).
pub const SNAT_ICMP_ERRORS_IN: u32 = 5;
/// Number of SNAT counter slots.
pub const SNAT_SLOTS: u32 = 6;

/// [`SnatForward::state`] / [`SnatReverse::state`] bit: a TCP FIN or RST was seen, so
/// the flow expires after the short idle timeout.
pub const SNAT_STATE_CLOSING: u8 = 1;

/// Key of both SNAT tables: a packet's 5-tuple as it sits in the headers (addresses
/// and ports in network byte order). ICMP echo uses the identifier as a port: the
/// request's key has it as `src_port` (and `dst_port` 0), the reply's key as
/// `dst_port` (and `src_port` 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SnatKey {
    /// IP protocol number (1 ICMP, 6 TCP, 17 UDP).
    pub protocol: u8,
    /// Zero.
    pub reserved: [u8; 3],
    pub src: [u8; 4],
    pub dst: [u8; 4],
    /// Network byte order.
    pub src_port: u16,
    /// Network byte order.
    pub dst_port: u16,
}

/// Key of the SNAT fragment table: a fragmented reply to the pod IP as its later
/// fragments name it (RFC 791 §3.2: source, destination, protocol and identification
/// identify a datagram; the destination is always the pod IP).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SnatFragKey {
    /// The reply's source (the backend), network byte order.
    pub src: [u8; 4],
    /// IP identification, network byte order.
    pub id: u16,
    /// IP protocol number.
    pub protocol: u8,
    /// Zero.
    pub reserved: u8,
}

/// Value of the forward table: the port the flow leaves the pod with.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SnatForward {
    /// `bpf_ktime_get_ns` (CLOCK_MONOTONIC) of the last laptop packet.
    pub last_ns: u64,
    /// Allocated port (ICMP: identifier), network byte order.
    pub port: u16,
    /// `SNAT_STATE_*` bits.
    pub state: u8,
    /// Zero.
    pub reserved: [u8; 5],
}

/// Value of the reverse table: where replies go back to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SnatReverse {
    /// `bpf_ktime_get_ns` of the last reply.
    pub last_ns: u64,
    /// The laptop's tunnel IP.
    pub addr: [u8; 4],
    /// The laptop's original port (ICMP: identifier), network byte order.
    pub port: u16,
    /// `SNAT_STATE_*` bits.
    pub state: u8,
    /// Zero.
    pub reserved: u8,
}

/// Value of the config array, written by the manager before it attaches the programs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SnatConfig {
    /// The pod's IP (the new source), network byte order.
    pub pod_ip: [u8; 4],
    /// The tunnel pool's network address; only sources inside it are translated.
    pub pool_addr: [u8; 4],
    /// The pool's netmask.
    pub pool_mask: [u8; 4],
    /// First port of the allocation range, host order.
    pub port_min: u16,
    /// Last port of the allocation range (inclusive), host order.
    pub port_max: u16,
}

// ---- steering: the route-conflict override's TC redirect on the laptop's uplink ----

/// Name of the steering program (TC egress of a laptop device whose route wins over
/// kvpn's, case rt-05): cluster-bound IPv4 packets get the tunnel IP as source and are
/// redirected to the TUN device's egress.
pub const PROGRAM_STEER: &str = "kvpn_steer";
/// Name of the one-entry steering config array (index 0 → [`SteerConfig`]); all
/// zero = steering off (the TUN ingress program then translates nothing back).
pub const MAP_STEER_CONFIG: &str = "KVPN_STEER_CFG";
/// Name of the per-device table of the steering program (ifindex, host order → L2
/// header length in bytes, host order): a device missing from it is not steered.
pub const MAP_STEER_DEVICES: &str = "KVPN_STEER_DEV";
/// Name of the steering connection table (LRU hash, [`SteerKey`] → the packet's
/// original source address, 4 bytes, network order).
pub const MAP_STEER_CONNTRACK: &str = "KVPN_STEER_CT";
/// Name of the per-CPU counter array of steering (`STEER_*` → [`CounterValue`]).
pub const MAP_STEER_COUNTERS: &str = "KVPN_STEER_CNT";

/// Capacity of the steering connection table (preallocated LRU hash; past it the
/// kernel evicts the least recently used flow, whose replies then stay untranslated).
pub const STEER_MAX_FLOWS: u32 = 16384;
/// Capacity of the per-device table.
pub const STEER_MAX_DEVICES: u32 = 64;

/// Steering counter slot: packets redirected from the laptop's device to the TUN.
pub const STEER_STEERED: u32 = 0;
/// Steering counter slot: replies on the TUN ingress whose destination was rewritten
/// from the tunnel IP back to the original source.
pub const STEER_REVERSED: u32 = 1;
/// Steering counter slot: cluster-bound packets left to the laptop's route because
/// they could not get a connection table entry (not TCP, UDP or ICMP echo request; a
/// non-first fragment; the insert failed).
pub const STEER_NO_CONNTRACK: u32 = 2;
/// Steering counter slot: packets dropped because a rewrite helper failed half-way.
pub const STEER_FAILED: u32 = 3;
/// Number of steering counter slots.
pub const STEER_SLOTS: u32 = 4;

/// Value of the steering config array, written by the dataplane daemon before it
/// attaches the steering program.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SteerConfig {
    /// The session's IPv4 tunnel IP (the new source), network byte order.
    pub tunnel_ip: [u8; 4],
    /// Interface index of the session's TUN device (the redirect target), host order.
    pub tun_ifindex: u32,
}

/// Key of the steering connection table, as the reply names it: addresses and ports
/// in network byte order. ICMP echo: `remote_port` 0, `local_port` the identifier.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SteerKey {
    /// IP protocol number (1 ICMP, 6 TCP, 17 UDP).
    pub protocol: u8,
    /// Zero.
    pub reserved: [u8; 3],
    /// The cluster address (the steered packet's destination, the reply's source).
    pub remote: [u8; 4],
    /// The cluster port.
    pub remote_port: u16,
    /// The laptop's port (unchanged by steering), ICMP: the echo identifier.
    pub local_port: u16,
}

/// Name of the run scope's `cgroup/sock_create` program (`kvpn run`): gives every
/// socket a process of the run's cgroup creates the session's fwmark, so policy
/// routing (`ip rule fwmark M lookup T`) sends it to the session's own table.
pub const PROGRAM_RUN_SOCK_CREATE: &str = "kvpn_run_mark";
/// Name of the run scope's `cgroup/connect4` program: TCP and connected UDP to port
/// 53 go to the session's own DNS forwarder instead.
pub const PROGRAM_RUN_CONNECT4: &str = "kvpn_run_connect4";
/// Name of the run scope's `cgroup/sendmsg4` program: unconnected UDP to port 53,
/// the same redirect.
pub const PROGRAM_RUN_SENDMSG4: &str = "kvpn_run_sendmsg4";
/// Name of the run scope's `cgroup/recvmsg4` program: answers from the forwarder
/// show the nameserver the process asked as their source (resolvers such as glibc's
/// drop answers from another address).
pub const PROGRAM_RUN_RECVMSG4: &str = "kvpn_run_recvmsg4";
/// Name of the run scope's one-entry config array (index 0 → [`RunConfig`]).
pub const MAP_RUN_CONFIG: &str = "KVPN_RUN_CFG";
/// Name of the run scope's table of redirected DNS sockets (LRU hash, socket
/// cookie → [`RunDnsOrigin`]: the nameserver the process asked).
pub const MAP_RUN_DNS_ORIGIN: &str = "KVPN_RUN_DNS";
/// Capacity of [`MAP_RUN_DNS_ORIGIN`]: sockets with a DNS redirect alive at once.
pub const RUN_DNS_MAX_SOCKETS: u32 = 4096;
/// The DNS port the run scope redirects, host order.
pub const DNS_PORT: u16 = 53;

/// Value of the run scope's config array, written before the programs are attached.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunConfig {
    /// The session's fwmark (host order), set on every socket of the cgroup.
    pub mark: u32,
    /// The session's DNS forwarder: IPv4 address, network byte order.
    pub dns_ip: [u8; 4],
    /// The forwarder's port, network byte order.
    pub dns_port: u16,
    /// Zero.
    pub reserved: u16,
}

/// The destination a redirected DNS socket of a run asked for (network byte order).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunDnsOrigin {
    pub ip: [u8; 4],
    pub port: u16,
    pub reserved: u16,
}

#[cfg(feature = "user")]
mod user {
    // SAFETY: all four are #[repr(C)], Copy, 'static, made only of integers and byte
    // arrays with no implicit padding (sizes 4, 16, 4 and 16 bytes), so every bit
    // pattern is a valid value and none has uninitialised bytes.
    unsafe impl aya::Pod for super::Ipv4Prefix {}
    // SAFETY: see above.
    unsafe impl aya::Pod for super::Ipv6Prefix {}
    // SAFETY: see above.
    unsafe impl aya::Pod for super::RouteEntry {}
    // SAFETY: see above.
    unsafe impl aya::Pod for super::CounterValue {}
    // SAFETY: #[repr(C)], integers and byte arrays only, 12 and 8 bytes, no padding.
    unsafe impl aya::Pod for super::RunConfig {}
    // SAFETY: see above.
    unsafe impl aya::Pod for super::RunDnsOrigin {}
    // SAFETY: as above; SnatKey (16 bytes), SnatForward (16), SnatReverse (16) and
    // SnatConfig (16) spell out every byte, so none is padding.
    unsafe impl aya::Pod for super::SnatKey {}
    // SAFETY: see above.
    unsafe impl aya::Pod for super::SnatForward {}
    // SAFETY: see above.
    unsafe impl aya::Pod for super::SnatReverse {}
    // SAFETY: see above.
    unsafe impl aya::Pod for super::SnatConfig {}
    // SAFETY: see above; SnatFragKey (8 bytes) spells out every byte.
    unsafe impl aya::Pod for super::SnatFragKey {}
    // SAFETY: see above; SteerConfig (8 bytes) and SteerKey (12 bytes) spell out
    // every byte.
    unsafe impl aya::Pod for super::SteerConfig {}
    // SAFETY: see above.
    unsafe impl aya::Pod for super::SteerKey {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_slots_fit_the_slot_field() {
        assert!(MAX_ROUTE_COUNTERS <= u32::from(NO_ROUTE_SLOT));
        const { assert!(MAX_ROUTE_COUNTERS <= MAX_ROUTES) };
    }

    #[test]
    fn layouts_match_the_kernel_side() {
        assert_eq!(core::mem::size_of::<Ipv4Prefix>(), 4);
        assert_eq!(core::mem::size_of::<Ipv6Prefix>(), 16);
        assert_eq!(core::mem::size_of::<RouteEntry>(), 4);
        assert_eq!(core::mem::size_of::<CounterValue>(), 16);
        assert_eq!(core::mem::align_of::<CounterValue>(), 8);
        assert_eq!(core::mem::size_of::<SnatKey>(), 16);
        assert_eq!(core::mem::size_of::<SnatForward>(), 16);
        assert_eq!(core::mem::size_of::<SnatReverse>(), 16);
        assert_eq!(core::mem::size_of::<SnatConfig>(), 16);
        assert_eq!(core::mem::size_of::<SnatFragKey>(), 8);
        assert_eq!(core::mem::size_of::<SteerConfig>(), 8);
        assert_eq!(core::mem::size_of::<SteerKey>(), 12);
    }

    #[test]
    fn every_route_kind_has_its_own_counter_slot() {
        let slots = [
            counter_slot(ROUTE_KIND_POD),
            counter_slot(ROUTE_KIND_SERVICE),
            counter_slot(ROUTE_KIND_EXTRA),
        ];
        assert_eq!(
            slots,
            [
                Some(COUNTER_POD),
                Some(COUNTER_SERVICE),
                Some(COUNTER_EXTRA)
            ]
        );
        assert_eq!(counter_slot(0), None);
        assert_eq!(counter_slot(4), None);
        for slot in [
            COUNTER_POD,
            COUNTER_SERVICE,
            COUNTER_EXTRA,
            COUNTER_UNROUTED,
            COUNTER_MALFORMED,
        ] {
            assert!(slot < COUNTER_SLOTS);
        }
        for slot in [INGRESS_PASSED, INGRESS_FOREIGN_SOURCE, INGRESS_MALFORMED] {
            assert!(slot < INGRESS_SLOTS);
        }
    }

    #[test]
    fn map_names_fit_the_kernel_limit() {
        // BPF_OBJ_NAME_LEN is 16 including the NUL.
        for name in [
            PROGRAM_TUN_EGRESS,
            PROGRAM_TUN_INGRESS,
            MAP_INGRESS_COUNTERS,
            MAP_INGRESS_MARK,
            MAP_ROUTES_V4,
            MAP_ROUTES_V6,
            MAP_COUNTERS,
            MAP_ROUTE_COUNTERS,
            PROGRAM_SNAT_EGRESS,
            PROGRAM_SNAT_INGRESS,
            MAP_SNAT_FORWARD,
            MAP_SNAT_REVERSE,
            MAP_SNAT_CONFIG,
            MAP_SNAT_COUNTERS,
            MAP_SNAT_FRAGMENTS,
            PROGRAM_STEER,
            MAP_STEER_CONFIG,
            MAP_STEER_DEVICES,
            MAP_STEER_CONNTRACK,
            MAP_STEER_COUNTERS,
        ] {
            assert!(name.len() <= 15, "{name} is longer than 15 bytes");
        }
    }
}
