//! Userspace side of `ebpf-snat` (the traffic manager's `--source-policy ebpf-snat`):
//! loads `kvpn_snat_out` / `kvpn_snat_in` from the same eBPF object as the
//! TUN programs, writes their config (pod IP, tunnel pool, port range), attaches them
//! to the pod's egress interface (TC egress and ingress; TCX on kernels >= 6.6), reads
//! their counters and connection tables, and expires idle flows ([`Snat::sweep`]).
//! The programs themselves are described in `dataplane-ebpf/src/snat.rs`.
//!
//! Needs CAP_BPF and CAP_NET_ADMIN (CAP_SYS_ADMIN on kernels before 5.8) in the pod.
//! Attaching resolves the interface name in the calling thread's network namespace.

use std::net::Ipv4Addr;
use std::ops::RangeInclusive;
use std::time::Duration;

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, MapData, MapError, PerCpuArray},
    programs::{TcAttachType, tc},
    util::KernelVersion,
};
use ipnet::Ipv4Net;
use kvpn_dataplane_common::{
    self as common, CounterValue, SNAT_STATE_CLOSING, SnatConfig, SnatForward, SnatKey, SnatReverse,
};

use super::{
    Counter, EbpfError, TcAction, ebpf_object, map_error, open_map, program_mut, sum_slot,
};

/// What the SNAT programs translate to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnatSettings {
    /// The pod's IP: the source backends see.
    pub pod_ip: Ipv4Addr,
    /// The tunnel pool: only sources inside it are translated.
    pub pool: Ipv4Net,
    /// Ports allocated to flows. The default, 61000–65535, lies above Linux's
    /// default ephemeral range (32768–60999), so the pod's own sockets never take
    /// a port a translated flow holds.
    pub ports: RangeInclusive<u16>,
}

/// Default first port of [`SnatSettings::ports`].
pub const DEFAULT_PORT_MIN: u16 = 61000;
/// Default last port of [`SnatSettings::ports`].
pub const DEFAULT_PORT_MAX: u16 = 65535;

/// How long an idle flow keeps its port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnatTimeouts {
    /// An established TCP flow (no FIN or RST seen).
    pub tcp: Duration,
    /// UDP, ICMP echo, and TCP after a FIN or RST.
    pub idle: Duration,
}

impl Default for SnatTimeouts {
    fn default() -> Self {
        Self {
            tcp: Duration::from_secs(7200),
            idle: Duration::from_secs(60),
        }
    }
}

/// Counters (summed over CPUs) and table sizes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SnatStats {
    /// Laptop packets whose source was rewritten.
    pub translated_out: Counter,
    /// Replies rewritten back to a tunnel IP.
    pub translated_in: Counter,
    /// Flows that got a port.
    pub new_flows: Counter,
    /// New flows dropped: no free port for their destination.
    pub ports_exhausted: Counter,
    /// Pool packets dropped as untranslatable (other protocols, truncated headers).
    pub untranslatable: Counter,
    /// ICMP errors about a translated flow, rewritten back to the laptop.
    pub icmp_errors_in: Counter,
    /// Entries of the forward table.
    pub forward_entries: usize,
    /// Entries of the reverse table.
    pub reverse_entries: usize,
}

/// What one [`Snat::sweep`] removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepResult {
    /// Flows (forward entries with their reverse entry) expired.
    pub expired: usize,
    /// Reverse entries without a forward entry (LRU evicted it), expired.
    pub orphans: usize,
}

/// Whether a flow last seen at `last_ns` (CLOCK_MONOTONIC) has expired at `now_ns`.
/// Pure.
pub fn expired(protocol: u8, state: u8, last_ns: u64, now_ns: u64, timeouts: SnatTimeouts) -> bool {
    let timeout = if protocol == libc::IPPROTO_TCP as u8 && state & SNAT_STATE_CLOSING == 0 {
        timeouts.tcp
    } else {
        timeouts.idle
    };
    let idle = Duration::from_nanos(now_ns.saturating_sub(last_ns));
    idle >= timeout
}

/// The reverse key of a forward entry. Pure.
pub fn reverse_key(forward: &SnatKey, value: &SnatForward, pod_ip: Ipv4Addr) -> SnatKey {
    SnatKey {
        protocol: forward.protocol,
        reserved: [0; 3],
        src: forward.dst,
        dst: pod_ip.octets(),
        src_port: forward.dst_port,
        dst_port: value.port,
    }
}

/// The forward key of a reverse entry. Pure.
pub fn forward_key(reverse: &SnatKey, value: &SnatReverse) -> SnatKey {
    SnatKey {
        protocol: reverse.protocol,
        reserved: [0; 3],
        src: value.addr,
        dst: reverse.src,
        src_port: value.port,
        dst_port: reverse.src_port,
    }
}

/// CLOCK_MONOTONIC in nanoseconds: the clock of `bpf_ktime_get_ns`.
pub fn monotonic_ns() -> u64 {
    // SAFETY: timespec is plain old data; clock_gettime writes it.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: a valid clock id and a live out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    u64::try_from(ts.tv_sec)
        .unwrap_or(0)
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::try_from(ts.tv_nsec).unwrap_or(0))
}

/// The loaded (and, after [`Snat::attach`], attached) SNAT programs and their maps.
/// Dropping it detaches the programs.
pub struct Snat {
    ebpf: Ebpf,
    forward: HashMap<MapData, SnatKey, SnatForward>,
    reverse: HashMap<MapData, SnatKey, SnatReverse>,
    counters: PerCpuArray<MapData, CounterValue>,
    links: Vec<tc::SchedClassifierLink>,
    pod_ip: Ipv4Addr,
}

impl std::fmt::Debug for Snat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snat")
            .field("pod_ip", &self.pod_ip)
            .finish_non_exhaustive()
    }
}

impl Snat {
    /// Loads the programs with `settings`, without attaching them (for
    /// BPF_PROG_TEST_RUN, which hands TC programs Ethernet frames as on `eth0`).
    pub fn load(settings: &SnatSettings) -> Result<Self, EbpfError> {
        let object = ebpf_object();
        if object.is_empty() {
            return Err(EbpfError::NotBuilt);
        }
        let mut ebpf = EbpfLoader::new().load(object).map_err(EbpfError::Load)?;
        for name in [common::PROGRAM_SNAT_EGRESS, common::PROGRAM_SNAT_INGRESS] {
            program_mut(&mut ebpf, name)?
                .load()
                .map_err(|source| EbpfError::Program {
                    name,
                    action: "load",
                    source,
                })?;
        }
        let mut config: Array<MapData, SnatConfig> = open_map(&mut ebpf, common::MAP_SNAT_CONFIG)?;
        let value = SnatConfig {
            pod_ip: settings.pod_ip.octets(),
            pool_addr: settings.pool.network().octets(),
            pool_mask: settings.pool.netmask().octets(),
            port_min: *settings.ports.start(),
            port_max: *settings.ports.end(),
        };
        config
            .set(0, value, 0)
            .map_err(|source| map_error(common::MAP_SNAT_CONFIG, "write slot 0", source))?;
        let forward: HashMap<_, _, _> = open_map(&mut ebpf, common::MAP_SNAT_FORWARD)?;
        let reverse: HashMap<_, _, _> = open_map(&mut ebpf, common::MAP_SNAT_REVERSE)?;
        let counters: PerCpuArray<_, _> = open_map(&mut ebpf, common::MAP_SNAT_COUNTERS)?;
        Ok(Self {
            ebpf,
            forward,
            reverse,
            counters,
            links: Vec::new(),
            pod_ip: settings.pod_ip,
        })
    }

    /// Loads the programs and attaches them to `ifname`'s TC egress and ingress.
    pub fn attach(ifname: &str, settings: &SnatSettings) -> Result<Self, EbpfError> {
        let mut snat = Self::load(settings)?;
        let tcx = KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0));
        if !tcx {
            match tc::qdisc_add_clsact(ifname) {
                Ok(()) | Err(tc::TcError::AlreadyAttached) => {}
                Err(source) => {
                    return Err(EbpfError::Qdisc {
                        ifname: ifname.to_owned(),
                        source,
                    });
                }
            }
        }
        for (name, hook) in [
            (common::PROGRAM_SNAT_EGRESS, TcAttachType::Egress),
            (common::PROGRAM_SNAT_INGRESS, TcAttachType::Ingress),
        ] {
            let program = program_mut(&mut snat.ebpf, name)?;
            let id = program
                .attach(ifname, hook)
                .map_err(|source| EbpfError::Program {
                    name,
                    action: "attach (TC on the pod's egress interface)",
                    source,
                })?;
            let link = program.take_link(id).map_err(|source| EbpfError::Program {
                name,
                action: "take link",
                source,
            })?;
            snat.links.push(link);
        }
        tracing::debug!(ifname, tcx, "ebpf-snat attached to TC egress and ingress");
        Ok(snat)
    }

    /// Counters and table sizes.
    pub fn stats(&self) -> Result<SnatStats, EbpfError> {
        let slot = |s| sum_slot(&self.counters, common::MAP_SNAT_COUNTERS, s);
        Ok(SnatStats {
            translated_out: slot(common::SNAT_TRANSLATED_OUT)?,
            translated_in: slot(common::SNAT_TRANSLATED_IN)?,
            new_flows: slot(common::SNAT_NEW_FLOWS)?,
            ports_exhausted: slot(common::SNAT_PORTS_EXHAUSTED)?,
            untranslatable: slot(common::SNAT_UNTRANSLATABLE)?,
            icmp_errors_in: slot(common::SNAT_ICMP_ERRORS_IN)?,
            forward_entries: self.forward.keys().filter(Result::is_ok).count(),
            reverse_entries: self.reverse.keys().filter(Result::is_ok).count(),
        })
    }

    /// Deletes flows idle past their timeout at `now_ns` (CLOCK_MONOTONIC): a forward
    /// entry and its reverse entry go together, judged by the later of their two
    /// stamps and the union of their state bits; reverse entries whose forward entry
    /// is gone (evicted) go once idle.
    pub fn sweep(&mut self, now_ns: u64, timeouts: SnatTimeouts) -> Result<SweepResult, EbpfError> {
        let mut result = SweepResult::default();
        let flows: Vec<(SnatKey, SnatForward)> =
            self.forward.iter().filter_map(Result::ok).collect();
        for (key, fwd) in flows {
            let rkey = reverse_key(&key, &fwd, self.pod_ip);
            let rev = match self.reverse.get(&rkey, 0) {
                Ok(rev) => Some(rev),
                Err(MapError::KeyNotFound) => None,
                Err(source) => {
                    return Err(map_error(common::MAP_SNAT_REVERSE, "lookup", source));
                }
            };
            let last = rev.map_or(fwd.last_ns, |r| r.last_ns.max(fwd.last_ns));
            let state = rev.map_or(fwd.state, |r| r.state | fwd.state);
            if !expired(key.protocol, state, last, now_ns, timeouts) {
                continue;
            }
            // Reverse first: a packet racing the sweep then allocates a new port
            // instead of using a half-deleted pair.
            if rev.is_some() {
                ignore_missing(self.reverse.remove(&rkey))
                    .map_err(|source| map_error(common::MAP_SNAT_REVERSE, "delete", source))?;
            }
            ignore_missing(self.forward.remove(&key))
                .map_err(|source| map_error(common::MAP_SNAT_FORWARD, "delete", source))?;
            result.expired += 1;
        }
        let reverse: Vec<(SnatKey, SnatReverse)> =
            self.reverse.iter().filter_map(Result::ok).collect();
        for (key, rev) in reverse {
            let fkey = forward_key(&key, &rev);
            let has_forward = match self.forward.get(&fkey, 0) {
                Ok(_) => true,
                Err(MapError::KeyNotFound) => false,
                Err(source) => {
                    return Err(map_error(common::MAP_SNAT_FORWARD, "lookup", source));
                }
            };
            if !has_forward && expired(key.protocol, rev.state, rev.last_ns, now_ns, timeouts) {
                ignore_missing(self.reverse.remove(&key))
                    .map_err(|source| map_error(common::MAP_SNAT_REVERSE, "delete", source))?;
                result.orphans += 1;
            }
        }
        Ok(result)
    }

    /// Runs the egress (`ingress == false`) or ingress program once on the Ethernet
    /// `frame` with BPF_PROG_TEST_RUN against the live tables; returns the verdict and
    /// the frame as the program left it.
    pub fn test_run(&self, ingress: bool, frame: &[u8]) -> Result<(TcAction, Vec<u8>), EbpfError> {
        let name = if ingress {
            common::PROGRAM_SNAT_INGRESS
        } else {
            common::PROGRAM_SNAT_EGRESS
        };
        super::test_run_out(&self.ebpf, name, frame)
    }
}

fn ignore_missing(r: Result<(), MapError>) -> Result<(), MapError> {
    match r {
        Err(MapError::KeyNotFound) => Ok(()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TCP: u8 = 6;
    const UDP: u8 = 17;

    #[test]
    fn established_tcp_keeps_its_port_for_the_long_timeout_only() {
        let t = SnatTimeouts {
            tcp: Duration::from_secs(100),
            idle: Duration::from_secs(2),
        };
        let s = 1_000_000_000u64;
        assert!(!expired(TCP, 0, 10 * s, 50 * s, t));
        assert!(expired(TCP, 0, 10 * s, 110 * s, t));
        assert!(expired(TCP, SNAT_STATE_CLOSING, 10 * s, 12 * s, t));
        assert!(!expired(UDP, 0, 10 * s, 11 * s, t));
        assert!(expired(UDP, 0, 10 * s, 12 * s, t));
        // A stamp from the future (another CPU, racing) is not expired.
        assert!(!expired(UDP, 0, 20 * s, 10 * s, t));
    }

    #[test]
    fn forward_and_reverse_keys_round_trip() {
        let fwd_key = SnatKey {
            protocol: TCP,
            reserved: [0; 3],
            src: [100, 96, 0, 2],
            dst: [10, 244, 1, 11],
            src_port: 40000u16.to_be(),
            dst_port: 80u16.to_be(),
        };
        let fwd = SnatForward {
            port: 61001u16.to_be(),
            ..SnatForward::default()
        };
        let pod = Ipv4Addr::new(10, 244, 1, 20);
        let rkey = reverse_key(&fwd_key, &fwd, pod);
        assert_eq!(rkey.src, [10, 244, 1, 11]);
        assert_eq!(rkey.dst, pod.octets());
        assert_eq!(rkey.src_port, 80u16.to_be());
        assert_eq!(rkey.dst_port, 61001u16.to_be());
        let rev = SnatReverse {
            addr: fwd_key.src,
            port: fwd_key.src_port,
            ..SnatReverse::default()
        };
        assert_eq!(forward_key(&rkey, &rev), fwd_key);
    }
}
