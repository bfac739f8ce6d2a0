//! Userspace side of steering (`kvpn connect --allow-route-conflict --steer ebpf`,
//! case rt-05): the [`Classifier`]'s methods that configure `kvpn_steer`, attach it to
//! a laptop device's TC egress and read its counters. The program shares the object,
//! and so the route tries and the TUN ingress program, with the classifier; it is
//! described in `dataplane-ebpf/src/steer.rs`.
//!
//! Attachment is TCX only (kernel >= 6.6): a TCX link belongs to the daemon's file
//! descriptor, so the program leaves the laptop's device when the [`Classifier`] is
//! dropped (disconnect) and also when the daemon dies (SIGKILL: the kernel closes the
//! descriptor and releases the link), without residue for `sweep` to clean. A legacy
//! clsact filter would outlive the daemon on a device kvpn does not own, so steering
//! refuses older kernels instead.

use std::net::Ipv4Addr;

use aya::{
    maps::MapError,
    programs::{SchedClassifier, TcAttachType},
    util::KernelVersion,
};
use kvpn_dataplane_common::{self as common, SteerConfig, SteerKey};

use super::{Classifier, Counter, EbpfError, TcAction, map_error, program_mut, sum_slot};

/// Counters of steering.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SteerStats {
    /// Packets redirected from a laptop device to the TUN (source rewritten to the
    /// tunnel IP unless it already was).
    pub steered: Counter,
    /// Replies whose destination was rewritten from the tunnel IP back to the
    /// original source on the TUN's ingress.
    pub reversed: Counter,
    /// Cluster-bound packets left to the laptop's route: no connection entry
    /// possible (not TCP, UDP or ICMP echo request; a later fragment; insert failed).
    pub no_conntrack: Counter,
    /// Packets dropped because a rewrite failed half-way.
    pub failed: Counter,
}

impl Classifier {
    /// Steer the cluster-bound IPv4 packets leaving `ifname` (interface `ifindex`,
    /// `l2_hdr_len` bytes of L2 header at its TC egress) into the TUN device
    /// `tun_ifindex`, with `tunnel_ip` as their source. Must be called from a thread in
    /// the network namespace of `ifname`. Calling it for a device already steered
    /// (same name and ifindex) does nothing; a device of the same name with another
    /// ifindex (deleted and created again) is left to [`Self::unsteer`].
    pub fn steer(
        &mut self,
        ifname: &str,
        ifindex: u32,
        l2_hdr_len: u32,
        tunnel_ip: Ipv4Addr,
        tun_ifindex: u32,
    ) -> Result<(), EbpfError> {
        if self
            .steer_links
            .iter()
            .any(|l| l.ifname == ifname && l.ifindex == ifindex)
        {
            return Ok(());
        }
        if !KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0)) {
            return Err(EbpfError::SteerNeedsTcx {
                ifname: ifname.to_owned(),
            });
        }
        self.configure_steer(tunnel_ip, tun_ifindex)?;
        self.add_steer_device(ifindex, l2_hdr_len)?;
        self.load_steer()?;
        let link = self.attach_one(common::PROGRAM_STEER, ifname, TcAttachType::Egress)?;
        self.steer_links.push(super::SteerLink {
            ifname: ifname.to_owned(),
            ifindex,
            _link: link,
        });
        tracing::info!(
            ifname,
            ifindex,
            %tunnel_ip,
            "eBPF steering attached to TC egress: cluster-bound packets go to the TUN"
        );
        Ok(())
    }

    /// Stop steering interface `ifindex`: release its TCX link (a device already
    /// deleted took the program with it; the link's descriptor is closed) and take
    /// it out of the devices the program acts on. An ifindex not steered does
    /// nothing. The connection table stays: replies of flows steered before still
    /// translate back.
    pub fn unsteer(&mut self, ifindex: u32) -> Result<(), EbpfError> {
        let before = self.steer_links.len();
        self.steer_links.retain(|l| l.ifindex != ifindex);
        if before == self.steer_links.len() {
            return Ok(());
        }
        match self.steer_devices.remove(&ifindex) {
            Ok(()) => Ok(()),
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {
                Ok(())
            }
            Err(source) => Err(map_error(
                common::MAP_STEER_DEVICES,
                format!("remove {ifindex}"),
                source,
            )),
        }
    }

    /// The devices steering is attached to, as (name, ifindex), in attach order.
    pub fn steered_devices(&self) -> Vec<(String, u32)> {
        self.steer_links
            .iter()
            .map(|l| (l.ifname.clone(), l.ifindex))
            .collect()
    }

    /// Write the steering config (the redirect target and the new source). Also
    /// switches the TUN ingress program's reverse translation on. For tests with
    /// [`Self::test_run_steer`]; [`Self::steer`] calls it.
    pub fn configure_steer(
        &mut self,
        tunnel_ip: Ipv4Addr,
        tun_ifindex: u32,
    ) -> Result<(), EbpfError> {
        let cfg = SteerConfig {
            tunnel_ip: tunnel_ip.octets(),
            tun_ifindex,
        };
        self.steer_config
            .set(0, cfg, 0)
            .map_err(|source| map_error(common::MAP_STEER_CONFIG, "set 0", source))
    }

    /// Let the steering program act on interface `ifindex`, whose packets carry
    /// `l2_hdr_len` bytes of L2 header. For tests; [`Self::steer`] calls it.
    pub fn add_steer_device(&mut self, ifindex: u32, l2_hdr_len: u32) -> Result<(), EbpfError> {
        self.steer_devices
            .insert(ifindex, l2_hdr_len, 0)
            .map_err(|source| {
                map_error(
                    common::MAP_STEER_DEVICES,
                    format!("insert {ifindex}"),
                    source,
                )
            })
    }

    fn load_steer(&mut self) -> Result<(), EbpfError> {
        let program = program_mut(&mut self.ebpf, common::PROGRAM_STEER)?;
        if program.fd().is_ok() {
            return Ok(());
        }
        program.load().map_err(|source| EbpfError::Program {
            name: common::PROGRAM_STEER,
            action: "load",
            source,
        })
    }

    /// Steering's counters.
    pub fn steer_stats(&self) -> Result<SteerStats, EbpfError> {
        let slot = |slot| sum_slot(&self.steer_counters, common::MAP_STEER_COUNTERS, slot);
        Ok(SteerStats {
            steered: slot(common::STEER_STEERED)?,
            reversed: slot(common::STEER_REVERSED)?,
            no_conntrack: slot(common::STEER_NO_CONNTRACK)?,
            failed: slot(common::STEER_FAILED)?,
        })
    }

    /// The original source the connection table holds for a reply from
    /// `remote:remote_port` (host order) to `local_port` (ICMP echo: `remote_port` 0,
    /// `local_port` the identifier).
    pub fn steer_conntrack(
        &self,
        protocol: u8,
        remote: Ipv4Addr,
        remote_port: u16,
        local_port: u16,
    ) -> Result<Option<Ipv4Addr>, EbpfError> {
        let key = SteerKey {
            protocol,
            reserved: [0; 3],
            remote: remote.octets(),
            remote_port: remote_port.to_be(),
            local_port: local_port.to_be(),
        };
        match self.steer_conntrack.get(&key, 0) {
            Ok(addr) => Ok(Some(Ipv4Addr::from(addr))),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(source) => Err(map_error(
                common::MAP_STEER_CONNTRACK,
                format!("lookup {remote}:{remote_port}"),
                source,
            )),
        }
    }

    /// Run the steering program once on `frame` (BPF_PROG_TEST_RUN; the test run's
    /// device is loopback, so add its ifindex 1 with [`Self::add_steer_device`] first)
    /// and return its verdict and the frame as it left it. The redirect is not
    /// carried out by a test run; the verdict says it was asked for.
    pub fn test_run_steer(&mut self, frame: &[u8]) -> Result<(TcAction, Vec<u8>), EbpfError> {
        self.load_steer()?;
        super::test_run_out(&self.ebpf, common::PROGRAM_STEER, frame)
    }

    /// Run the TUN ingress program once on `frame`, as [`Self::test_run_steer`].
    pub fn test_run_ingress_out(&self, frame: &[u8]) -> Result<(TcAction, Vec<u8>), EbpfError> {
        super::test_run_out(&self.ebpf, common::PROGRAM_TUN_INGRESS, frame)
    }

    /// Kernel ids of the steering programs attached (TCX egress) to `ifname` in the
    /// calling thread's network namespace, for tests and leak checks.
    pub fn steer_program_ids(ifname: &str) -> Result<Vec<u32>, EbpfError> {
        let (_revision, programs) = SchedClassifier::query_tcx(ifname, TcAttachType::Egress)
            .map_err(|source| EbpfError::Program {
                name: common::PROGRAM_STEER,
                action: "query TCX egress",
                source,
            })?;
        Ok(programs
            .iter()
            .filter(|p| p.name_as_str() == Some(common::PROGRAM_STEER))
            .map(|p| p.id())
            .collect())
    }
}
