//! The run scope's cgroup programs (`kvpn run`, see `dataplane-ebpf/src/run_scope.rs`):
//! loaded once per run session from the same embedded object as the classifier (so
//! each session has its own config and DNS table) and attached to that run's
//! cgroup v2 folder. Dropping [`RunPrograms`] detaches them (aya owns the links).
//!
//! I/O: `bpf(2)` (load, map update, BPF_LINK_CREATE on the cgroup's fd).

use std::net::SocketAddrV4;
use std::os::fd::AsFd;

use aya::{
    Ebpf, EbpfLoader,
    maps::Array,
    programs::{CgroupAttachMode, CgroupSock, CgroupSockAddr},
};
use kvpn_dataplane_common::{self as common, RunConfig};

use super::{EbpfError, ebpf_object, map_error, open_map, program_of};

/// The four programs of one run, attached to its cgroup.
pub struct RunPrograms {
    _ebpf: Ebpf,
}

impl std::fmt::Debug for RunPrograms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunPrograms").finish_non_exhaustive()
    }
}

impl RunPrograms {
    /// Load the programs with `mark` (set on every socket of the cgroup) and `dns`
    /// (where its port-53 traffic goes), and attach them to `cgroup` (an open
    /// cgroup v2 folder). Attached as BPF links (kernels >= 5.7), which the kernel
    /// always stacks with other programs on the cgroup and which take no attach
    /// flags (`CgroupAttachMode::Single` = flags 0; BPF_F_ALLOW_MULTI gives EINVAL).
    pub fn attach(cgroup: impl AsFd, mark: u32, dns: SocketAddrV4) -> Result<Self, EbpfError> {
        let object = ebpf_object();
        if object.is_empty() {
            return Err(EbpfError::NotBuilt);
        }
        let mut ebpf = EbpfLoader::new().load(object).map_err(EbpfError::Load)?;
        let mut config: Array<_, RunConfig> = open_map(&mut ebpf, common::MAP_RUN_CONFIG)?;
        let value = RunConfig {
            mark,
            dns_ip: dns.ip().octets(),
            dns_port: dns.port().to_be(),
            reserved: 0,
        };
        config
            .set(0, value, 0)
            .map_err(|e| map_error(common::MAP_RUN_CONFIG, "set index 0", e))?;
        let cgroup = cgroup.as_fd();
        {
            let name = common::PROGRAM_RUN_SOCK_CREATE;
            let program: &mut CgroupSock = program_of(&mut ebpf, name)?;
            program.load().map_err(|source| EbpfError::Program {
                name,
                action: "load",
                source,
            })?;
            program
                .attach(cgroup, CgroupAttachMode::Single)
                .map_err(|source| EbpfError::Program {
                    name,
                    action: "attach to the run's cgroup",
                    source,
                })?;
        }
        for name in [
            common::PROGRAM_RUN_CONNECT4,
            common::PROGRAM_RUN_SENDMSG4,
            common::PROGRAM_RUN_RECVMSG4,
        ] {
            let program: &mut CgroupSockAddr = program_of(&mut ebpf, name)?;
            program.load().map_err(|source| EbpfError::Program {
                name,
                action: "load",
                source,
            })?;
            program
                .attach(cgroup, CgroupAttachMode::Single)
                .map_err(|source| EbpfError::Program {
                    name,
                    action: "attach to the run's cgroup",
                    source,
                })?;
        }
        Ok(Self { _ebpf: ebpf })
    }
}
