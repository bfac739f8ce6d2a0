//! `kvpn-ebpf`: the one wrapper around kvpn's eBPF object. It loads the TC programs
//! built from `dataplane-ebpf` (embedded at build time by `build.rs`), attaches them and
//! owns their maps; nothing else in kvpn touches the raw maps, whose layout lives in
//! `dataplane-common`. Two processes use it: the laptop's root daemon
//! (`kvpn-dataplane`, which re-exports it as `kvpn_dataplane::ebpf`) for the
//! [`Classifier`] (TUN egress) with its anti-spoofing check (TUN ingress) and for
//! steering ([`steer`]), and the traffic manager (`kvpn-manager`) for [`snat`]
//! (`--source-policy ebpf-snat`). It depends on no kvpn crate but `dataplane-common`,
//! so the manager links no laptop code.
//!
//! I/O: the `bpf(2)` syscall (load, map updates, BPF_PROG_TEST_RUN) and, for attaching,
//! a TCX link on kernels >= 6.6 or a netlink clsact filter on older ones. Attaching
//! resolves the interface name in the calling thread's network namespace.
//!
//! Direction: the classifier (egress) sees outbound packets (laptop -> cluster), the
//! ones the laptop's kernel routes into the TUN device; the anti-spoofing check
//! (ingress) sees inbound packets (cluster -> laptop), the ones the pump writes into
//! the TUN device, and drops those whose source no route entry covers. Both look up
//! the same route tries.
//!
//! Steering (`--steer ebpf`, [`steer`]): the same object's `kvpn_steer` goes on the TC
//! egress of laptop devices whose routes win over kvpn's; it looks destinations up in
//! the same IPv4 trie and redirects cluster-bound packets into the TUN device, and the
//! ingress check translates their replies back. TCX only, owned here like the TUN
//! links, so dropping the wrapper (or the daemon dying) detaches it.

pub mod run_scope;
pub mod snat;
pub mod steer;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap as BpfHashMap, LpmTrie, MapData, MapError, PerCpuArray, lpm_trie::Key},
    programs::{
        ProgramError, SchedClassifier, TcAttachType, TestRun as _, TestRunOptions,
        tc::{self, SchedClassifierLink, TcError},
    },
    sys::SyscallError,
    util::KernelVersion,
};
use ipnet::IpNet;
use kvpn_dataplane_common::{
    self as common, CounterValue, Ipv4Prefix, Ipv6Prefix, L2_HDR_LEN_ETHERNET, L2_HDR_LEN_TUN,
    RouteEntry,
};

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

impl RouteKind {
    /// All kinds, in counter-slot order.
    pub const ALL: [RouteKind; 3] = [RouteKind::Pod, RouteKind::Service, RouteKind::Extra];

    const fn to_raw(self) -> u8 {
        match self {
            RouteKind::Pod => common::ROUTE_KIND_POD,
            RouteKind::Service => common::ROUTE_KIND_SERVICE,
            RouteKind::Extra => common::ROUTE_KIND_EXTRA,
        }
    }

    const fn from_raw(raw: u8) -> Option<Self> {
        match raw {
            common::ROUTE_KIND_POD => Some(RouteKind::Pod),
            common::ROUTE_KIND_SERVICE => Some(RouteKind::Service),
            common::ROUTE_KIND_EXTRA => Some(RouteKind::Extra),
            _ => None,
        }
    }

    const fn counter_slot(self) -> u32 {
        match self {
            RouteKind::Pod => common::COUNTER_POD,
            RouteKind::Service => common::COUNTER_SERVICE,
            RouteKind::Extra => common::COUNTER_EXTRA,
        }
    }
}

/// Packet and byte counters (summed over CPUs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counter {
    /// Packets.
    pub packets: u64,
    /// Bytes (IP packet length).
    pub bytes: u64,
}

/// Counters of the ingress anti-spoofing check (packets from the tunnel).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IngressStats {
    /// Packets whose source a route entry covers: passed to the laptop.
    pub passed: Counter,
    /// Packets whose source no route entry covers: dropped.
    pub foreign_source: Counter,
    /// Packets that are not parseable IPv4/IPv6: dropped.
    pub malformed: Counter,
}

/// Counters of the TC classifier (egress) and the anti-spoofing check (ingress).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Per route kind: packets the classifier passed (every kind, in [`RouteKind::ALL`]
    /// order, zeros included).
    pub per_kind: Vec<(RouteKind, Counter)>,
    /// Packets dropped because their destination matched no route.
    pub unrouted: Counter,
    /// Packets dropped because they were not parseable IPv4/IPv6 (truncated header,
    /// bad version or IHL).
    pub malformed: Counter,
    /// The ingress check's counters.
    pub ingress: IngressStats,
    /// Steering's counters (all zero unless `--steer ebpf` attached it).
    pub steer: steer::SteerStats,
}

impl Stats {
    /// The counter of one route kind (zero if absent).
    pub fn kind(&self, kind: RouteKind) -> Counter {
        self.per_kind
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, c)| *c)
            .unwrap_or_default()
    }
}

/// A TC verdict of the classifier, as returned by BPF_PROG_TEST_RUN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcAction {
    /// `TC_ACT_OK` (= TCX_PASS): the packet continues into the TUN device.
    Pass,
    /// `TC_ACT_SHOT` (= TCX_DROP): the packet is dropped.
    Drop,
    /// `TC_ACT_REDIRECT` (= TCX_REDIRECT): the packet goes where `bpf_redirect` said
    /// (the steering program; BPF_PROG_TEST_RUN returns the code without sending).
    Redirect,
    /// Any other return code (the program never returns one).
    Other(i32),
}

impl TcAction {
    fn from_return_value(value: u32) -> Self {
        // The kernel hands the program's i32 return value back as u32; reinterpret it.
        match value as i32 {
            0 => TcAction::Pass,
            2 => TcAction::Drop,
            7 => TcAction::Redirect,
            other => TcAction::Other(other),
        }
    }
}

/// Errors of the eBPF wrapper.
#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    /// The binary was built with `AYA_BUILD_SKIP=1`, so it embeds no eBPF object.
    #[error(
        "eBPF programs not built: kvpn-ebpf was compiled with AYA_BUILD_SKIP=1 — \
         rebuild without it (needs bpf-linker and nightly rust-src: run scripts/setup.sh)"
    )]
    NotBuilt,
    /// The kernel (or aya) refused the object: verifier, BTF, map creation, permissions.
    #[error("cannot load the eBPF classifier (are you root, with BPF enabled in the kernel?)")]
    Load(#[source] aya::EbpfError),
    /// The embedded object lacks a program or map this wrapper expects.
    #[error("eBPF object has no {what} named {name} (object and loader out of sync)")]
    Missing {
        /// "program" or "map".
        what: &'static str,
        /// Its name.
        name: &'static str,
    },
    /// Loading or test-running the program failed.
    #[error("eBPF program {name}: {action} failed")]
    Program {
        /// Program name.
        name: &'static str,
        /// What was attempted.
        action: &'static str,
        /// The cause.
        #[source]
        source: ProgramError,
    },
    /// Attaching to the TUN device failed.
    #[error(
        "cannot attach the eBPF {} to {ifname}: is the device in this thread's network \
         namespace?",
        attach_what(.ingress)
    )]
    Attach {
        /// The anti-spoofing check (TC ingress), else the classifier (TC egress).
        ingress: bool,
        /// Interface name.
        ifname: String,
        /// The cause.
        #[source]
        source: ProgramError,
    },
    /// Adding the clsact qdisc (kernels < 6.6) failed.
    #[error("cannot add the clsact qdisc to {ifname}")]
    Qdisc {
        /// Interface name.
        ifname: String,
        /// The cause.
        #[source]
        source: TcError,
    },
    /// A map operation failed.
    #[error("eBPF map {map}: {action} failed")]
    Map {
        /// Map name.
        map: &'static str,
        /// What was attempted, with the key.
        action: String,
        /// The cause.
        #[source]
        source: MapError,
    },
    /// Steering needs TCX links (kernel >= 6.6), which die with the daemon.
    #[error(
        "cannot steer {ifname} with eBPF: needs a kernel >= 6.6 (TCX links, which leave \
         the device when kvpn-dataplane exits); use --steer routes"
    )]
    SteerNeedsTcx {
        /// Interface name.
        ifname: String,
    },
    /// `remove_route` on a CIDR that has no entry.
    #[error("no eBPF route entry for {cidr}")]
    RouteNotFound {
        /// The CIDR (host bits cleared).
        cidr: IpNet,
    },
    /// A route entry kvpn never writes (unknown kind, impossible prefix length).
    #[error("eBPF map {map} holds a corrupt route entry: {detail}")]
    CorruptRoute {
        /// Map name.
        map: &'static str,
        /// What is wrong, with the key.
        detail: String,
    },
}

/// The TC classifier attached to a TUN device's egress (laptop -> cluster direction)
/// and the anti-spoofing check attached to its ingress (cluster -> laptop).
///
/// Dropping it detaches the programs (the links are owned here) and frees the maps.
pub struct Classifier {
    // Fields drop in declaration order: detach first, then maps, then the programs.
    /// Steering program links, one per laptop device (`--steer ebpf`).
    steer_links: Vec<SteerLink>,
    link: Option<SchedClassifierLink>,
    ingress_link: Option<SchedClassifierLink>,
    routes_v4: LpmTrie<MapData, Ipv4Prefix, RouteEntry>,
    routes_v6: LpmTrie<MapData, Ipv6Prefix, RouteEntry>,
    counters: PerCpuArray<MapData, CounterValue>,
    route_counters: PerCpuArray<MapData, CounterValue>,
    ingress_counters: PerCpuArray<MapData, CounterValue>,
    steer_config: Array<MapData, common::SteerConfig>,
    steer_devices: BpfHashMap<MapData, u32, u32>,
    steer_conntrack: BpfHashMap<MapData, common::SteerKey, [u8; 4]>,
    steer_counters: PerCpuArray<MapData, CounterValue>,
    /// Per-route counter slot of each entry (truncated CIDR); `NO_ROUTE_SLOT` for
    /// entries past the `MAX_ROUTE_COUNTERS` that have a slot.
    slots: std::collections::HashMap<IpNet, u16>,
    /// Slots not in use, lowest last.
    free_slots: Vec<u16>,
    ebpf: Ebpf,
    ifname: Option<String>,
    l2_hdr_len: u32,
}

/// The steering program's link on one laptop device; dropping it detaches.
struct SteerLink {
    ifname: String,
    /// The device's ifindex when attached: a device deleted and created again
    /// under the same name has another one, and no program.
    ifindex: u32,
    _link: SchedClassifierLink,
}

impl std::fmt::Debug for Classifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Classifier")
            .field("ifname", &self.ifname)
            .field("l2_hdr_len", &self.l2_hdr_len)
            .finish_non_exhaustive()
    }
}

fn ebpf_object() -> &'static [u8] {
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/kvpn-dataplane-ebpf"))
}

impl Classifier {
    /// Load the programs and maps and attach the classifier to `ifname`'s TC egress and
    /// the anti-spoofing check to its TC ingress (TCX). Must be called from a thread in
    /// the network namespace of `ifname`. With no route entries yet the ingress check
    /// drops every packet from the tunnel: insert the routes before traffic flows.
    pub fn attach(ifname: &str) -> Result<Self, EbpfError> {
        let mut classifier = Self::load(L2_HDR_LEN_TUN)?;
        let tcx = KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0));
        if !tcx {
            // Legacy attachment goes through a clsact qdisc; the TUN device is ours, and
            // one that already has clsact is fine.
            match tc::qdisc_add_clsact(ifname) {
                Ok(()) | Err(TcError::AlreadyAttached) => {}
                Err(source) => {
                    return Err(EbpfError::Qdisc {
                        ifname: ifname.to_owned(),
                        source,
                    });
                }
            }
        }
        let link =
            classifier.attach_one(common::PROGRAM_TUN_EGRESS, ifname, TcAttachType::Egress)?;
        classifier.link = Some(link);
        let link =
            classifier.attach_one(common::PROGRAM_TUN_INGRESS, ifname, TcAttachType::Ingress)?;
        classifier.ingress_link = Some(link);
        classifier.ifname = Some(ifname.to_owned());
        tracing::debug!(
            ifname,
            tcx,
            "eBPF classifier attached to TC egress, anti-spoofing check to TC ingress"
        );
        Ok(classifier)
    }

    fn attach_one(
        &mut self,
        name: &'static str,
        ifname: &str,
        hook: TcAttachType,
    ) -> Result<SchedClassifierLink, EbpfError> {
        let program = program_mut(&mut self.ebpf, name)?;
        let link_id = program
            .attach(ifname, hook)
            .map_err(|source| EbpfError::Attach {
                ingress: matches!(hook, TcAttachType::Ingress),
                ifname: ifname.to_owned(),
                source,
            })?;
        program
            .take_link(link_id)
            .map_err(|source| EbpfError::Program {
                name,
                action: "take link",
                source,
            })
    }

    /// Load the classifier without attaching it, configured for Ethernet framing (L2
    /// header of 14 bytes), the way BPF_PROG_TEST_RUN hands packets to TC programs. For
    /// [`Self::test_run`] with Ethernet frames.
    ///
    /// Since Linux 6.x the kernel refuses (EINVAL) test frames whose ethertype is
    /// IPv4/IPv6 but whose IP header is cut short; test those with
    /// [`Self::load_for_test_l3`].
    pub fn load_for_test() -> Result<Self, EbpfError> {
        Self::load(L2_HDR_LEN_ETHERNET)
    }

    /// Load the classifier without attaching it, configured exactly as on the TUN
    /// device (no L2 header): [`Self::test_run`] then takes a bare IP packet. The kernel
    /// still reads the packet's first 14 bytes as an Ethernet header (the program does
    /// not), so the packet must be at least 14 bytes long, and if its bytes 12–13 happen
    /// to read 0x0800 or 0x86DD the kernel also wants an IP header behind byte 14.
    pub fn load_for_test_l3() -> Result<Self, EbpfError> {
        Self::load(L2_HDR_LEN_TUN)
    }

    fn load(l2_hdr_len: u32) -> Result<Self, EbpfError> {
        let object = ebpf_object();
        if object.is_empty() {
            return Err(EbpfError::NotBuilt);
        }
        let mut ebpf = EbpfLoader::new()
            .override_global(common::GLOBAL_L2_HDR_LEN, &l2_hdr_len, true)
            .load(object)
            .map_err(EbpfError::Load)?;
        for name in [common::PROGRAM_TUN_EGRESS, common::PROGRAM_TUN_INGRESS] {
            program_mut(&mut ebpf, name)?
                .load()
                .map_err(|source| EbpfError::Program {
                    name,
                    action: "load",
                    source,
                })?;
        }
        let routes_v4: LpmTrie<_, _, _> = open_map(&mut ebpf, common::MAP_ROUTES_V4)?;
        let routes_v6: LpmTrie<_, _, _> = open_map(&mut ebpf, common::MAP_ROUTES_V6)?;
        let counters: PerCpuArray<_, _> = open_map(&mut ebpf, common::MAP_COUNTERS)?;
        let route_counters: PerCpuArray<_, _> = open_map(&mut ebpf, common::MAP_ROUTE_COUNTERS)?;
        let ingress_counters: PerCpuArray<_, _> =
            open_map(&mut ebpf, common::MAP_INGRESS_COUNTERS)?;
        let steer_config: Array<_, _> = open_map(&mut ebpf, common::MAP_STEER_CONFIG)?;
        let steer_devices: BpfHashMap<_, _, _> = open_map(&mut ebpf, common::MAP_STEER_DEVICES)?;
        let steer_conntrack: BpfHashMap<_, _, _> =
            open_map(&mut ebpf, common::MAP_STEER_CONNTRACK)?;
        let steer_counters: PerCpuArray<_, _> = open_map(&mut ebpf, common::MAP_STEER_COUNTERS)?;
        // MAX_ROUTE_COUNTERS is below NO_ROUTE_SLOT (a dataplane-common test checks it).
        let max_slot =
            u16::try_from(common::MAX_ROUTE_COUNTERS.saturating_sub(1)).unwrap_or(u16::MAX);
        Ok(Self {
            steer_links: Vec::new(),
            link: None,
            ingress_link: None,
            routes_v4,
            routes_v6,
            counters,
            route_counters,
            ingress_counters,
            steer_config,
            steer_devices,
            steer_conntrack,
            steer_counters,
            slots: std::collections::HashMap::new(),
            free_slots: (0..=max_slot).rev().collect(),
            ebpf,
            ifname: None,
            l2_hdr_len,
        })
    }

    /// Put fwmark `mark` on every packet the ingress check passes (0: none): a `kvpn
    /// run` session's TUN device, whose replies must be looked up (strict
    /// rp_filter with `src_valid_mark`) in the run's own routing table.
    pub fn set_ingress_mark(&mut self, mark: u32) -> Result<(), EbpfError> {
        let name = common::MAP_INGRESS_MARK;
        let map = self
            .ebpf
            .map_mut(name)
            .ok_or(EbpfError::Missing { what: "map", name })?;
        let mut array: Array<&mut MapData, u32> =
            Array::try_from(map).map_err(|source| map_error(name, "open", source))?;
        array
            .set(0, mark, 0)
            .map_err(|source| map_error(name, format!("set {mark:#x}"), source))
    }

    /// The interface the classifier is attached to (`None` for [`Self::load_for_test`]).
    pub fn ifname(&self) -> Option<&str> {
        self.ifname.as_deref()
    }

    /// Add (or replace) a route entry `cidr -> kind`. Host bits of `cidr` are ignored.
    /// A new entry gets a per-route counter slot starting at zero while one of the
    /// `MAX_ROUTE_COUNTERS` is free (else it is classified and counted per kind only);
    /// replacing an entry keeps its slot and counts. The entry also admits packets
    /// from `cidr` at the ingress check.
    pub fn insert_route(&mut self, cidr: IpNet, kind: RouteKind) -> Result<(), EbpfError> {
        let cidr = cidr.trunc();
        let (slot, fresh) = match self.slots.get(&cidr) {
            Some(&slot) => (slot, false),
            None => (self.free_slots.pop().unwrap_or(common::NO_ROUTE_SLOT), true),
        };
        let owned_slot = fresh && slot != common::NO_ROUTE_SLOT;
        if owned_slot && let Err(e) = self.zero_slot(slot) {
            self.free_slots.push(slot);
            return Err(e);
        }
        let entry = RouteEntry::with_slot(kind.to_raw(), slot);
        let result = match cidr {
            IpNet::V4(net) => self
                .routes_v4
                .insert(&v4_key(net.network(), net.prefix_len()), entry, 0)
                .map_err(|source| {
                    map_error(common::MAP_ROUTES_V4, format!("insert {net}"), source)
                }),
            IpNet::V6(net) => self
                .routes_v6
                .insert(&v6_key(net.network(), net.prefix_len()), entry, 0)
                .map_err(|source| {
                    map_error(common::MAP_ROUTES_V6, format!("insert {net}"), source)
                }),
        };
        match result {
            Ok(()) => {
                self.slots.insert(cidr, slot);
                Ok(())
            }
            Err(e) => {
                if owned_slot {
                    self.free_slots.push(slot);
                }
                Err(e)
            }
        }
    }

    fn zero_slot(&mut self, slot: u16) -> Result<(), EbpfError> {
        let cpus = aya::util::nr_cpus().map_err(|(_, e)| EbpfError::Map {
            map: common::MAP_ROUTE_COUNTERS,
            action: format!("count possible CPUs to zero slot {slot}"),
            source: MapError::IoError(e),
        })?;
        let zeros = aya::maps::PerCpuValues::try_from(vec![CounterValue::default(); cpus])
            .map_err(|e| EbpfError::Map {
                map: common::MAP_ROUTE_COUNTERS,
                action: format!("zero slot {slot}"),
                source: MapError::IoError(e),
            })?;
        self.route_counters
            .set(u32::from(slot), zeros, 0)
            .map_err(|source| {
                map_error(
                    common::MAP_ROUTE_COUNTERS,
                    format!("zero slot {slot}"),
                    source,
                )
            })
    }

    /// Counters of each route entry (packets the classifier passed because this
    /// entry was the longest match), with its kind, sorted by CIDR. Entries without
    /// a counter slot of their own (past `MAX_ROUTE_COUNTERS`) are left out.
    pub fn route_stats(&self) -> Result<Vec<(IpNet, RouteKind, Counter)>, EbpfError> {
        let kinds: std::collections::HashMap<IpNet, RouteKind> =
            self.routes()?.into_iter().collect();
        let mut out = Vec::with_capacity(self.slots.len());
        for (cidr, slot) in &self.slots {
            let Some(kind) = kinds.get(cidr) else {
                continue;
            };
            if *slot == common::NO_ROUTE_SLOT {
                continue;
            }
            let values = self
                .route_counters
                .get(&u32::from(*slot), 0)
                .map_err(|source| {
                    map_error(
                        common::MAP_ROUTE_COUNTERS,
                        format!("read slot {slot} ({cidr})"),
                        source,
                    )
                })?;
            let counter = values.iter().fold(Counter::default(), |sum, cpu| Counter {
                packets: sum.packets.wrapping_add(cpu.packets),
                bytes: sum.bytes.wrapping_add(cpu.bytes),
            });
            out.push((*cidr, *kind, counter));
        }
        out.sort_by_key(|(cidr, _, _)| *cidr);
        Ok(out)
    }

    /// Remove a route entry (exact CIDR; host bits ignored). A CIDR without an entry is
    /// [`EbpfError::RouteNotFound`].
    pub fn remove_route(&mut self, cidr: IpNet) -> Result<(), EbpfError> {
        let cidr = cidr.trunc();
        let (map, result) = match cidr {
            IpNet::V4(net) => (
                common::MAP_ROUTES_V4,
                self.routes_v4
                    .remove(&v4_key(net.network(), net.prefix_len())),
            ),
            IpNet::V6(net) => (
                common::MAP_ROUTES_V6,
                self.routes_v6
                    .remove(&v6_key(net.network(), net.prefix_len())),
            ),
        };
        match result {
            Ok(()) => {
                if let Some(slot) = self.slots.remove(&cidr)
                    && slot != common::NO_ROUTE_SLOT
                {
                    self.free_slots.push(slot);
                }
                Ok(())
            }
            Err(MapError::SyscallError(SyscallError { io_error, .. }))
                if io_error.raw_os_error() == Some(libc::ENOENT) =>
            {
                Err(EbpfError::RouteNotFound { cidr })
            }
            Err(source) => Err(map_error(map, format!("remove {cidr}"), source)),
        }
    }

    /// All route entries, IPv4 first, in the tries' iteration order.
    pub fn routes(&self) -> Result<Vec<(IpNet, RouteKind)>, EbpfError> {
        let mut routes = Vec::new();
        trie_routes(common::MAP_ROUTES_V4, &self.routes_v4, &mut routes, |k| {
            Ipv4Addr::from(k.addr).into()
        })?;
        trie_routes(common::MAP_ROUTES_V6, &self.routes_v6, &mut routes, |k| {
            Ipv6Addr::from(k.addr).into()
        })?;
        Ok(routes)
    }

    /// Read the counters.
    pub fn stats(&self) -> Result<Stats, EbpfError> {
        let per_kind = RouteKind::ALL
            .iter()
            .map(|&kind| Ok((kind, self.counter(kind.counter_slot())?)))
            .collect::<Result<Vec<_>, EbpfError>>()?;
        let ingress = |slot| sum_slot(&self.ingress_counters, common::MAP_INGRESS_COUNTERS, slot);
        Ok(Stats {
            per_kind,
            unrouted: self.counter(common::COUNTER_UNROUTED)?,
            malformed: self.counter(common::COUNTER_MALFORMED)?,
            ingress: IngressStats {
                passed: ingress(common::INGRESS_PASSED)?,
                foreign_source: ingress(common::INGRESS_FOREIGN_SOURCE)?,
                malformed: ingress(common::INGRESS_MALFORMED)?,
            },
            steer: self.steer_stats()?,
        })
    }

    fn counter(&self, slot: u32) -> Result<Counter, EbpfError> {
        sum_slot(&self.counters, common::MAP_COUNTERS, slot)
    }

    /// Number of route entries (both families) and how many of them have a
    /// per-route counter slot.
    pub fn entry_count(&self) -> (usize, usize) {
        let with_slot = self
            .slots
            .values()
            .filter(|s| **s != common::NO_ROUTE_SLOT)
            .count();
        (self.slots.len(), with_slot)
    }

    /// Look a destination up as the program would (longest-prefix match in the kernel).
    pub fn lookup(&self, dst: IpAddr) -> Result<Option<RouteKind>, EbpfError> {
        let (map, entry) = match dst {
            IpAddr::V4(addr) => (
                common::MAP_ROUTES_V4,
                self.routes_v4.get(&v4_key(addr, 32), 0),
            ),
            IpAddr::V6(addr) => (
                common::MAP_ROUTES_V6,
                self.routes_v6.get(&v6_key(addr, 128), 0),
            ),
        };
        match entry {
            Ok(entry) => Ok(Some(route_kind(map, IpNet::from(dst), entry)?)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(source) => Err(map_error(map, format!("lookup {dst}"), source)),
        }
    }

    /// Run the classifier (egress) once on `frame` with BPF_PROG_TEST_RUN and return its
    /// verdict. `frame` is an Ethernet frame for [`Self::load_for_test`], a bare IP
    /// packet (at least 14 bytes) for [`Self::load_for_test_l3`] and attached
    /// classifiers. Routes and counters are the live maps: the run is counted like a
    /// real packet.
    pub fn test_run(&self, frame: &[u8]) -> Result<TcAction, EbpfError> {
        self.test_run_program(common::PROGRAM_TUN_EGRESS, frame, 1)
            .map(|(action, _)| action)
    }

    /// Run the anti-spoofing check (ingress) once on `frame`, as [`Self::test_run`].
    pub fn test_run_ingress(&self, frame: &[u8]) -> Result<TcAction, EbpfError> {
        self.test_run_program(common::PROGRAM_TUN_INGRESS, frame, 1)
            .map(|(action, _)| action)
    }

    /// Run program `name` (`PROGRAM_TUN_EGRESS` or `PROGRAM_TUN_INGRESS`) `repeat`
    /// times on `frame` in the kernel and return the last verdict and the kernel's
    /// mean run time per packet (BPF_PROG_TEST_RUN's `duration`), for benchmarks.
    /// Every run is counted like a real packet.
    pub fn test_run_program(
        &self,
        name: &'static str,
        frame: &[u8],
        repeat: u32,
    ) -> Result<(TcAction, std::time::Duration), EbpfError> {
        let program = classifier_ref(&self.ebpf, name)?;
        let result = program
            .test_run(TestRunOptions {
                data_in: Some(frame),
                repeat,
                ..TestRunOptions::new()
            })
            .map_err(|source| EbpfError::Program {
                name,
                action: "BPF_PROG_TEST_RUN",
                source,
            })?;
        Ok((
            TcAction::from_return_value(result.return_value),
            result.duration,
        ))
    }

    /// Kernel ids of kvpn's TUN programs attached (TCX egress: the classifier; TCX
    /// ingress: the anti-spoofing check) to `ifname` in the calling thread's network
    /// namespace. Program ids are global and never reused while the program lives, so
    /// tests use them to prove a program is gone.
    pub fn attached_program_ids(ifname: &str) -> Result<Vec<u32>, EbpfError> {
        let mut ids = Vec::new();
        for (hook, name) in [
            (TcAttachType::Egress, common::PROGRAM_TUN_EGRESS),
            (TcAttachType::Ingress, common::PROGRAM_TUN_INGRESS),
        ] {
            let (_revision, programs) =
                SchedClassifier::query_tcx(ifname, hook).map_err(|source| EbpfError::Program {
                    name,
                    action: match hook {
                        TcAttachType::Ingress => "query TCX ingress",
                        _ => "query TCX egress",
                    },
                    source,
                })?;
            ids.extend(
                programs
                    .iter()
                    .filter(|p| p.name_as_str() == Some(name))
                    .map(|p| p.id()),
            );
        }
        Ok(ids)
    }

    /// Whether any of kvpn's TUN programs is attached (TCX egress or ingress) to
    /// `ifname`, in the calling thread's network namespace. For tests and leak checks
    /// after teardown.
    pub fn is_attached_to(ifname: &str) -> Result<bool, EbpfError> {
        Ok(!Self::attached_program_ids(ifname)?.is_empty())
    }
}

/// Runs program `name` of `ebpf` once on `frame` with BPF_PROG_TEST_RUN and returns
/// its verdict and the frame as the program left it.
pub(crate) fn test_run_out(
    ebpf: &Ebpf,
    name: &'static str,
    frame: &[u8],
) -> Result<(TcAction, Vec<u8>), EbpfError> {
    let program = classifier_ref(ebpf, name)?;
    let mut out = vec![0u8; frame.len() + 64];
    let result = program
        .test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            ..TestRunOptions::new()
        })
        .map_err(|source| EbpfError::Program {
            name,
            action: "BPF_PROG_TEST_RUN",
            source,
        })?;
    out.truncate(result.data_size_out as usize);
    Ok((TcAction::from_return_value(result.return_value), out))
}

fn program_mut<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut SchedClassifier, EbpfError> {
    program_of(ebpf, name)
}

/// Program `name` of `ebpf` as its type `P` (TC classifier, cgroup program, …).
pub(crate) fn program_of<'a, P>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut P, EbpfError>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or(EbpfError::Missing {
            what: "program",
            name,
        })?
        .try_into()
        .map_err(|source| EbpfError::Program {
            name,
            action: "type check",
            source,
        })
}

/// Program `name` of `ebpf` as a TC classifier, read-only (test runs).
fn classifier_ref<'a>(
    ebpf: &'a Ebpf,
    name: &'static str,
) -> Result<&'a SchedClassifier, EbpfError> {
    ebpf.program(name)
        .ok_or(EbpfError::Missing {
            what: "program",
            name,
        })?
        .try_into()
        .map_err(|source| EbpfError::Program {
            name,
            action: "type check",
            source,
        })
}

fn attach_what(ingress: &bool) -> String {
    if *ingress {
        format!(
            "anti-spoofing check {} (TC ingress)",
            common::PROGRAM_TUN_INGRESS
        )
    } else {
        format!("classifier {} (TC egress)", common::PROGRAM_TUN_EGRESS)
    }
}

fn sum_slot(
    map: &PerCpuArray<MapData, CounterValue>,
    name: &'static str,
    slot: u32,
) -> Result<Counter, EbpfError> {
    let values = map
        .get(&slot, 0)
        .map_err(|source| map_error(name, format!("read slot {slot}"), source))?;
    Ok(values.iter().fold(Counter::default(), |sum, cpu| Counter {
        packets: sum.packets.wrapping_add(cpu.packets),
        bytes: sum.bytes.wrapping_add(cpu.bytes),
    }))
}

/// Takes the map `name` out of the loaded object and opens it as its typed aya map.
fn open_map<M>(ebpf: &mut Ebpf, name: &'static str) -> Result<M, EbpfError>
where
    M: TryFrom<aya::maps::Map, Error = MapError>,
{
    let map = ebpf
        .take_map(name)
        .ok_or(EbpfError::Missing { what: "map", name })?;
    M::try_from(map).map_err(|source| map_error(name, "open", source))
}

fn map_error(map: &'static str, action: impl Into<String>, source: MapError) -> EbpfError {
    EbpfError::Map {
        map,
        action: action.into(),
        source,
    }
}

/// Appends one route trie's entries to `routes`; `addr` reads a key's address.
fn trie_routes<K: aya::Pod>(
    map: &'static str,
    trie: &LpmTrie<MapData, K, RouteEntry>,
    routes: &mut Vec<(IpNet, RouteKind)>,
    addr: impl Fn(K) -> IpAddr,
) -> Result<(), EbpfError> {
    for item in trie.iter() {
        let (key, entry) = item.map_err(|source| map_error(map, "iterate", source))?;
        let addr = addr(key.data());
        let cidr = u8::try_from(key.prefix_len())
            .ok()
            .and_then(|len| IpNet::new(addr, len).ok())
            .ok_or_else(|| EbpfError::CorruptRoute {
                map,
                detail: format!("prefix length {} for {addr}", key.prefix_len()),
            })?;
        routes.push((cidr, route_kind(map, cidr, entry)?));
    }
    Ok(())
}

fn route_kind(map: &'static str, cidr: IpNet, entry: RouteEntry) -> Result<RouteKind, EbpfError> {
    RouteKind::from_raw(entry.kind).ok_or_else(|| EbpfError::CorruptRoute {
        map,
        detail: format!("unknown kind {} for {cidr}", entry.kind),
    })
}

fn v4_key(addr: Ipv4Addr, prefix_len: u8) -> Key<Ipv4Prefix> {
    Key::new(
        u32::from(prefix_len),
        Ipv4Prefix {
            addr: addr.octets(),
        },
    )
}

fn v6_key(addr: Ipv6Addr, prefix_len: u8) -> Key<Ipv6Prefix> {
    Key::new(
        u32::from(prefix_len),
        Ipv6Prefix {
            addr: addr.octets(),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_kinds_round_trip_through_the_map_encoding() {
        for kind in RouteKind::ALL {
            assert_eq!(RouteKind::from_raw(kind.to_raw()), Some(kind));
            assert_eq!(
                common::counter_slot(kind.to_raw()),
                Some(kind.counter_slot())
            );
        }
        assert_eq!(RouteKind::from_raw(0), None);
    }

    #[test]
    fn tc_return_codes_map_to_actions() {
        assert_eq!(TcAction::from_return_value(0), TcAction::Pass);
        assert_eq!(TcAction::from_return_value(2), TcAction::Drop);
        assert_eq!(TcAction::from_return_value(7), TcAction::Redirect);
        assert_eq!(TcAction::from_return_value(u32::MAX), TcAction::Other(-1));
    }

    #[test]
    fn stats_kind_finds_the_counter() {
        let stats = Stats {
            per_kind: vec![(
                RouteKind::Service,
                Counter {
                    packets: 3,
                    bytes: 180,
                },
            )],
            ..Stats::default()
        };
        assert_eq!(stats.kind(RouteKind::Service).bytes, 180);
        assert_eq!(stats.kind(RouteKind::Pod), Counter::default());
    }
}
