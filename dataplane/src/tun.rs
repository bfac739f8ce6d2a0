//! TUN device creation (tun-rs). I/O: `/dev/net/tun` and the SIOC* ioctls tun-rs
//! issues, in the calling thread's network namespace.
//!
//! The device is layer 3 without packet information (each read is one raw
//! IPv4/IPv6 packet), no IFF_VNET_HDR offloads yet, non-blocking (tokio), with
//! the requested MTU, created down. It is not persistent: closing its last
//! descriptor removes it with its addresses and routes.
//!
//! Queues: one (a plain single-queue device, as before workers existed) or,
//! for `--workers N` with N > 1, N queues of one IFF_MULTI_QUEUE device: the
//! first open creates it, each further open of the same name with the same
//! flags attaches another queue (`tun_set_iff` → `tun_attach`,
//! drivers/net/tun.c; TUNSETQUEUE is not needed). The kernel picks the queue a
//! packet from the laptop's stack is read on in `tun_select_queue` →
//! `tun_automq_select_queue`: a flow's symmetric hash, and once userspace wrote
//! a packet of that flow on queue *i* (`tun_flow_update` in `tun_get_user`),
//! queue *i*; so a flow stays on one queue and thus one worker.

use std::io;

use tun_rs::{AsyncDevice, DeviceBuilder};

/// Default TUN MTU in bytes. Equal to the manager's stack MTU (`kvpn-manager`'s
/// `DEFAULT_MTU`): the transport is a byte stream, so the MTU bounds only the
/// packet size, and 9000 measured ~3× the throughput of 1500 on the batched TUN
/// path (TOOLCHAIN.md: 7.2 vs 2.3 Gbit/s).
pub const DEFAULT_MTU: u16 = 9000;

/// Smallest MTU accepted (bytes): the IPv6 minimum link MTU (RFC 8200 §5).
pub const MIN_MTU: u16 = 1280;

/// Largest MTU accepted (bytes): a packet must fit one frame.
pub const MAX_MTU: u16 = kvpn_proto::frame::MAX_PAYLOAD_LEN as u16;

/// Name pattern for devices the daemon names itself: the kernel replaces `%d`
/// with the first free number (kvpn0, kvpn1, ...), without a race between
/// looking and creating (`dev_alloc_name`, net/core/dev.c).
pub const NAME_PATTERN: &str = "kvpn%d";

/// Why a TUN device could not be created.
#[derive(Debug, thiserror::Error)]
pub enum TunError {
    /// The requested name is not a valid interface name.
    #[error("invalid TUN device name {name:?}: {why}")]
    BadName {
        /// The name.
        name: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The MTU is out of range.
    #[error("invalid TUN MTU {mtu}: must be between {MIN_MTU} and {MAX_MTU} bytes")]
    BadMtu {
        /// The MTU asked for.
        mtu: u32,
    },
    /// The queue count is out of range.
    #[error("invalid TUN queue count {queues}: must be between 1 and {MAX_QUEUES}")]
    BadQueues {
        /// The count asked for.
        queues: u16,
    },
    /// The kernel refused.
    #[error("cannot create TUN device {name}: {source}{hint}")]
    Create {
        /// The requested name or pattern.
        name: String,
        /// The error from the kernel.
        #[source]
        source: io::Error,
        /// A hint about the fix.
        hint: &'static str,
    },
}

/// Most queues a device may have (the kernel's `MAX_TAP_QUEUES` is 256; kvpn
/// caps workers at [`kvpn_proto::frame::MAX_WORKERS`]).
pub const MAX_QUEUES: u16 = kvpn_proto::frame::MAX_WORKERS;

/// A created TUN device.
pub struct Tun {
    /// The non-blocking device (queue 0).
    pub device: AsyncDevice,
    /// Queues 1.. of a multi-queue device (empty for a single-queue one).
    pub extra_queues: Vec<AsyncDevice>,
    /// Its name as the kernel assigned it.
    pub name: String,
    /// Its interface index.
    pub ifindex: u32,
}

impl std::fmt::Debug for Tun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tun")
            .field("name", &self.name)
            .field("ifindex", &self.ifindex)
            .finish_non_exhaustive()
    }
}

/// Check an interface name the way the kernel does (`dev_valid_name`).
pub fn validate_name(name: &str) -> Result<(), TunError> {
    let bad = |why| TunError::BadName {
        name: name.to_owned(),
        why,
    };
    if name.is_empty() {
        return Err(bad("empty"));
    }
    if name.len() > 15 {
        return Err(bad("longer than 15 bytes (IFNAMSIZ)"));
    }
    if name == "." || name == ".." {
        return Err(bad("reserved"));
    }
    if name
        .chars()
        .any(|c| c == '/' || c == ':' || c == '%' || c.is_whitespace())
    {
        return Err(bad("contains '/', ':', '%' or whitespace"));
    }
    Ok(())
}

/// Check an MTU from a request (0 = [`DEFAULT_MTU`]).
pub fn validate_mtu(mtu: u32) -> Result<u16, TunError> {
    if mtu == 0 {
        return Ok(DEFAULT_MTU);
    }
    match u16::try_from(mtu) {
        Ok(m) if (MIN_MTU..=MAX_MTU).contains(&m) => Ok(m),
        _ => Err(TunError::BadMtu { mtu }),
    }
}

/// Create a TUN device named `name` (or the first free `kvpnN`) with MTU `mtu`,
/// left down (the caller brings it up when it is ready for traffic). The caller checks beforehand that an explicit `name` is not taken:
/// TUNSETIFF would otherwise attach to an existing persistent TUN device.
pub fn create(name: Option<&str>, mtu: u16) -> Result<Tun, TunError> {
    create_with_queues(name, mtu, 1)
}

/// [`create`] with `queues` queues (1..=[`MAX_QUEUES`]): 1 is the plain
/// single-queue device; more make an IFF_MULTI_QUEUE device with that many
/// descriptors (see the module docs for how the kernel spreads flows).
pub fn create_with_queues(name: Option<&str>, mtu: u16, queues: u16) -> Result<Tun, TunError> {
    if let Some(name) = name {
        validate_name(name)?;
    }
    let requested = name.unwrap_or(NAME_PATTERN);
    let create_err = |source: io::Error| {
        let hint = match source.raw_os_error() {
            Some(libc::ENOENT) | Some(libc::ENODEV) => {
                " — /dev/net/tun is missing: load the tun module (modprobe tun)"
            }
            Some(libc::EPERM) | Some(libc::EACCES) => {
                " — kvpn-dataplane must run as root (CAP_NET_ADMIN)"
            }
            Some(libc::EBUSY) | Some(libc::EEXIST) | Some(libc::EINVAL) => {
                " — an interface with that name exists and is not a free TUN device: choose another name"
            }
            _ => "",
        };
        TunError::Create {
            name: requested.to_owned(),
            source,
            hint,
        }
    };
    if queues == 0 || queues > MAX_QUEUES {
        return Err(TunError::BadQueues { queues });
    }
    let device = DeviceBuilder::new()
        .name(requested)
        .mtu(mtu)
        .multi_queue(queues > 1)
        // Left down: the session attaches the classifier before bringing it up.
        .enable(false)
        .build_async()
        .map_err(create_err)?;
    let name = device.name().map_err(create_err)?;
    let ifindex = device.if_index().map_err(create_err)?;
    let mut extra_queues = Vec::with_capacity(usize::from(queues) - 1);
    for _ in 1..queues {
        // Another open + TUNSETIFF of the same name and flags: a new queue.
        extra_queues.push(device.try_clone().map_err(create_err)?);
    }
    tracing::debug!(%name, ifindex, mtu, queues, "TUN device created");
    Ok(Tun {
        device,
        extra_queues,
        name,
        ifindex,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_kernel_rules() {
        assert!(validate_name("kvpn0").is_ok());
        assert!(validate_name("kvpn-abcdef0123").is_ok());
        for bad in ["", "a/b", "has space", "kvpn%d", "0123456789abcdef", ".."] {
            assert!(validate_name(bad).is_err(), "{bad:?} must be rejected");
        }
    }

    #[test]
    fn mtu_defaults_and_bounds() {
        assert_eq!(validate_mtu(0).expect("default"), DEFAULT_MTU);
        assert_eq!(validate_mtu(1400).expect("in range"), 1400);
        assert!(validate_mtu(1279).is_err());
        assert!(
            validate_mtu(65535).is_err(),
            "a 65535-byte packet does not fit a frame"
        );
        assert_eq!(validate_mtu(65534).expect("fits a frame"), 65534);
    }
}
