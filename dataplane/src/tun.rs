//! TUN device creation (tun-rs). I/O: `/dev/net/tun` and the SIOC* ioctls tun-rs
//! issues, in the calling thread's network namespace.
//!
//! The device is layer 3 without packet information, non-blocking (tokio),
//! with the requested MTU, created down. It is not persistent: closing its
//! last descriptor removes it with its addresses and routes.
//!
//! Offloads: the device is opened with `IFF_VNET_HDR`, a 10-byte
//! `virtio_net_hdr` (`TUNSETVNETHDRSZ`) and `TUNSETOFFLOAD TUN_F_CSUM |
//! TUN_F_TSO4 | TUN_F_TSO6` (drivers/net/tun.c). Every read starts with a
//! [`VnetHdr`] (parsed by [`VnetHdr::parse`]) followed by the packet, which may
//! be a TCP *super-packet* of up to 64 KiB that the kernel did not segment, or
//! a packet whose L4 checksum is partial ([`Offload`]); every write must start
//! with a header too ([`VNET_HDR_NONE`]: no offload, the kernel checks the
//! checksums as without `IFF_VNET_HDR`). No UDP segmentation offload
//! (`TUN_F_USO4/6`): UDP arrives as single datagrams.
//!
//! Queues: one (a plain single-queue device, as before workers existed) or,
//! for `--workers N` with N > 1, N queues of one IFF_MULTI_QUEUE device: the
//! first open creates it, each further open of the same name with the same
//! flags attaches another queue (`tun_set_iff` → `tun_attach`,
//! drivers/net/tun.c; TUNSETQUEUE is not needed). The kernel picks the queue a
//! packet from the laptop's stack is read on in `tun_select_queue` →
//! `tun_automq_select_queue`: a flow's symmetric hash, and once userspace wrote
//! a packet of that flow on queue *i* (`tun_flow_update` in `tun_get_user`),
//! queue *i*; so a flow stays on one queue and thus one worker. TUNSETOFFLOAD
//! is device-wide; it is set again after the extra queues are attached (each
//! attach re-applies tun-rs's defaults).

use std::io;
use std::os::fd::AsRawFd;

use kvpn_proto::frame::GsoHeader;
use kvpn_proto::gso::{self, GsoKind};
use tun_rs::{AsyncDevice, DeviceBuilder};

/// Default TUN MTU in bytes, the same as the manager's stack MTU
/// ([`kvpn_proto::frame::DEFAULT_TUN_MTU`], which says why 9000).
pub const DEFAULT_MTU: u16 = kvpn_proto::frame::DEFAULT_TUN_MTU;

/// Smallest MTU accepted (bytes): the IPv6 minimum link MTU (RFC 8200 §5;
/// [`kvpn_proto::frame::MIN_TUN_MTU`]).
pub const MIN_MTU: u16 = kvpn_proto::frame::MIN_TUN_MTU;

/// Largest MTU accepted (bytes): a packet must fit one frame.
pub const MAX_MTU: u16 = kvpn_proto::frame::MAX_PAYLOAD_LEN as u16;

/// Name pattern for devices the daemon names itself: the kernel replaces `%d`
/// with the first free number (kvpn0, kvpn1, ...), without a race between
/// looking and creating (`dev_alloc_name`, net/core/dev.c).
pub const NAME_PATTERN: &str = "kvpn%d";

/// Bytes of the `virtio_net_hdr` before every packet read from or written to
/// the TUN device (`struct virtio_net_hdr`, include/uapi/linux/virtio_net.h;
/// set with `TUNSETVNETHDRSZ`).
pub const VNET_HDR_LEN: usize = 10;

/// The header written before every packet the pump writes to the TUN device:
/// no checksum offload, not a super-packet (`VIRTIO_NET_HDR_GSO_NONE`).
pub const VNET_HDR_NONE: [u8; VNET_HDR_LEN] = [0; VNET_HDR_LEN];

/// Largest TUN read with offloads, bytes: the header, a 40-byte IPv6 header
/// and the largest IPv6 payload length (an IPv4 super-packet is at most 65535
/// bytes in all: its total length is 16 bits too). The kernel's TSO super-packets
/// stay under 64 KiB (`GSO_LEGACY_MAX_SIZE`; BIG TCP is off on a TUN device).
pub const MAX_READ: usize = VNET_HDR_LEN + 40 + 65535;

/// The `virtio_net_hdr` of one TUN read (include/uapi/linux/virtio_net.h).
/// Fields are in the host's byte order (legacy virtio without
/// `TUNSETVNETLE`/`TUNSETVNETBE`: the kernel writes them with `cpu_to_virtio16`
/// on the native endianness; drivers/net/tun.c, `tun_put_user`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VnetHdr {
    /// `VIRTIO_NET_HDR_F_*` bits ([`gso::F_NEEDS_CSUM`]).
    pub flags: u8,
    /// `VIRTIO_NET_HDR_GSO_*` kind ([`gso::GSO_TCPV4`], ...; bit 7 ECN).
    pub gso_type: u8,
    /// Linear header bytes as the kernel reports them (`skb_headlen`);
    /// informational.
    pub hdr_len: u16,
    /// Payload bytes per segment of a super-packet (the MSS).
    pub gso_size: u16,
    /// Offset of the L4 header in the packet, bytes (with NEEDS_CSUM).
    pub csum_start: u16,
    /// Offset of the L4 checksum field from `csum_start`, bytes.
    pub csum_offset: u16,
}

/// What a TUN read needs before it can go to the manager.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offload {
    /// A finished packet.
    None,
    /// One packet whose L4 checksum is partial: complete it with
    /// [`gso::complete_checksum`] at these offsets (bytes).
    Checksum {
        /// `csum_start`.
        start: usize,
        /// `csum_offset`.
        offset: usize,
    },
    /// A TCP super-packet to cut into `gso_size`-byte segments.
    Tcp {
        /// IPv4 or IPv6.
        kind: GsoKind,
        /// Payload bytes per segment.
        gso_size: usize,
    },
}

/// Why a TUN read's `virtio_net_hdr` is unusable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum VnetError {
    /// The read is shorter than the header.
    #[error("TUN read of {0} bytes is shorter than its {VNET_HDR_LEN}-byte virtio_net_hdr")]
    Truncated(usize),
    /// A `gso_type` this pump does not handle (UDP_L4 and others are not
    /// enabled with TUNSETOFFLOAD, so the kernel should not send them).
    #[error("TUN read with unsupported gso_type {0}")]
    UnsupportedGso(u8),
    /// A super-packet with `gso_size` 0.
    #[error("TUN super-packet with gso_size 0")]
    ZeroGsoSize,
}

impl VnetHdr {
    /// Parse the header at the start of a TUN read; returns it, what the
    /// packet after it needs, and the packet. Never panics.
    pub fn parse(read: &[u8]) -> Result<(Self, Offload, &[u8]), VnetError> {
        let (h, packet) = read
            .split_first_chunk::<VNET_HDR_LEN>()
            .ok_or(VnetError::Truncated(read.len()))?;
        let ne = |i: usize| u16::from_ne_bytes([h[i], h[i + 1]]);
        let hdr = Self {
            flags: h[0],
            gso_type: h[1],
            hdr_len: ne(2),
            gso_size: ne(4),
            csum_start: ne(6),
            csum_offset: ne(8),
        };
        let offload = match GsoKind::from_gso_type(hdr.gso_type) {
            Some(kind) => {
                if hdr.gso_size == 0 {
                    return Err(VnetError::ZeroGsoSize);
                }
                Offload::Tcp {
                    kind,
                    gso_size: usize::from(hdr.gso_size),
                }
            }
            None if hdr.gso_type == gso::GSO_NONE => {
                if hdr.flags & gso::F_NEEDS_CSUM != 0 {
                    Offload::Checksum {
                        start: usize::from(hdr.csum_start),
                        offset: usize::from(hdr.csum_offset),
                    }
                } else {
                    Offload::None
                }
            }
            None => return Err(VnetError::UnsupportedGso(hdr.gso_type)),
        };
        Ok((hdr, offload, packet))
    }

    /// The fields of a GSO frame from the manager ([`GsoHeader`], big-endian
    /// on the wire) for a TUN write.
    pub fn from_frame_header(h: GsoHeader) -> Self {
        Self {
            flags: h.flags,
            gso_type: h.gso_type,
            hdr_len: h.hdr_len,
            gso_size: h.gso_size,
            csum_start: h.csum_start,
            csum_offset: h.csum_offset,
        }
    }

    /// The header bytes for a TUN write, fields in the host's byte order
    /// (`tun_get_user` reads them with `virtio16_to_cpu`, legacy native
    /// endianness, as [`VnetHdr::parse`] explains).
    pub fn encode(&self) -> [u8; VNET_HDR_LEN] {
        let mut out = [0u8; VNET_HDR_LEN];
        out[0] = self.flags;
        out[1] = self.gso_type;
        for (i, v) in [
            self.hdr_len,
            self.gso_size,
            self.csum_start,
            self.csum_offset,
        ]
        .into_iter()
        .enumerate()
        {
            out[2 + 2 * i..4 + 2 * i].copy_from_slice(&v.to_ne_bytes());
        }
        out
    }

    /// The same fields for a GSO frame to the manager.
    pub fn to_frame_header(self) -> GsoHeader {
        GsoHeader {
            flags: self.flags,
            gso_type: self.gso_type,
            hdr_len: self.hdr_len,
            gso_size: self.gso_size,
            csum_start: self.csum_start,
            csum_offset: self.csum_offset,
        }
    }
}

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
        // IFF_VNET_HDR; tun-rs also enables TUN_F_USO4/6 where the kernel has
        // them, which set_offloads takes back.
        .offload(true)
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
    // After the extra queues: the header size and offloads are the device's
    // (`tun_struct`), and tun-rs re-applies its own defaults on each attach.
    set_offloads(&device).map_err(create_err)?;
    tracing::debug!(%name, ifindex, mtu, queues, "TUN device created");
    Ok(Tun {
        device,
        extra_queues,
        name,
        ifindex,
    })
}

/// Whether interface `ifindex` is gone from the calling thread's network
/// namespace (`if_indextoname(3)` fails with ENXIO or ENODEV). Called only
/// after a TUN read or write failed: when the device is deleted from outside
/// (`ip link del kvpn0`), the kernel detaches every queue
/// (`tun_detach_all`, drivers/net/tun.c) and each read and write on a queue's
/// descriptor fails with EBADFD from then on, which by itself does not say
/// why. Interface indexes are not reused at once (`dev_index_reserve`
/// allocates upwards), so a new device of the same name is not taken for it.
pub fn device_gone(ifindex: u32) -> bool {
    let mut name: [libc::c_char; libc::IF_NAMESIZE] = [0; libc::IF_NAMESIZE];
    // SAFETY: `name` has the IF_NAMESIZE bytes if_indextoname(3) may write,
    // and outlives the call.
    let found = unsafe { libc::if_indextoname(ifindex, name.as_mut_ptr()) };
    if !found.is_null() {
        return false;
    }
    matches!(
        io::Error::last_os_error().raw_os_error(),
        Some(libc::ENXIO) | Some(libc::ENODEV)
    )
}

/// `TUNSETVNETHDRSZ` [`VNET_HDR_LEN`] and `TUNSETOFFLOAD TUN_F_CSUM |
/// TUN_F_TSO4 | TUN_F_TSO6` on an `IFF_VNET_HDR` device (drivers/net/tun.c,
/// `__tun_chr_ioctl`, `set_offload`): TCP super-packets and partial checksums,
/// no UDP segmentation offload.
fn set_offloads(device: &AsyncDevice) -> io::Result<()> {
    let fd = device.as_raw_fd();
    let size: libc::c_int = VNET_HDR_LEN as libc::c_int;
    // SAFETY: `fd` is the live TUN descriptor `device` owns; TUNSETVNETHDRSZ
    // reads one c_int through the pointer, which outlives the call.
    if unsafe { libc::ioctl(fd, libc::TUNSETVNETHDRSZ, &size as *const libc::c_int) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let offloads = libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6;
    // SAFETY: as above; TUNSETOFFLOAD takes its flags by value.
    if unsafe { libc::ioctl(fd, libc::TUNSETOFFLOAD, libc::c_ulong::from(offloads)) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
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

    fn read(hdr: [u8; VNET_HDR_LEN], packet: &[u8]) -> Vec<u8> {
        let mut r = hdr.to_vec();
        r.extend_from_slice(packet);
        r
    }

    #[test]
    fn vnet_headers_parse_into_typed_offloads() {
        let ne = |v: u16| v.to_ne_bytes();
        let [a, b] = ne(1448);
        let [c, d] = ne(20);
        let [e, f] = ne(16);
        // TCPv4 super-packet with ECN, NEEDS_CSUM.
        let tso = read([1, 0x81, 66, 0, a, b, c, d, e, f], &[0x45]);
        let (hdr, offload, packet) = VnetHdr::parse(&tso).expect("valid");
        assert_eq!(
            offload,
            Offload::Tcp {
                kind: GsoKind::TcpV4,
                gso_size: 1448
            }
        );
        assert_eq!(packet, &[0x45]);
        assert_eq!(hdr.csum_start, 20);
        let frame = hdr.to_frame_header();
        assert_eq!(
            (frame.gso_type, frame.gso_size, frame.csum_offset),
            (0x81, 1448, 16)
        );
        // A single packet with a partial checksum; a finished one.
        let (_, offload, _) =
            VnetHdr::parse(&read([1, 0, 0, 0, 0, 0, c, d, e, f], &[])).expect("valid");
        assert_eq!(
            offload,
            Offload::Checksum {
                start: 20,
                offset: 16
            }
        );
        let (_, offload, _) = VnetHdr::parse(&VNET_HDR_NONE).expect("valid");
        assert_eq!(offload, Offload::None);
        // TCPv6.
        let (_, offload, _) =
            VnetHdr::parse(&read([1, 4, 0, 0, a, b, 0, 0, 0, 0], &[])).expect("valid");
        assert!(matches!(
            offload,
            Offload::Tcp {
                kind: GsoKind::TcpV6,
                ..
            }
        ));
        // Errors: short, UDP_L4 (not enabled), gso_size 0.
        assert_eq!(VnetHdr::parse(&[0; 9]), Err(VnetError::Truncated(9)));
        assert_eq!(
            VnetHdr::parse(&read([0, 5, 0, 0, a, b, 0, 0, 0, 0], &[])),
            Err(VnetError::UnsupportedGso(5))
        );
        assert_eq!(
            VnetHdr::parse(&read([1, 1, 0, 0, 0, 0, 0, 0, 0, 0], &[])),
            Err(VnetError::ZeroGsoSize)
        );
    }

    proptest::proptest! {
        #[test]
        fn vnet_parse_never_panics(buf in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64)) {
            if let Ok((_, _, packet)) = VnetHdr::parse(&buf) {
                proptest::prop_assert_eq!(packet.len() + VNET_HDR_LEN, buf.len());
            }
        }
    }

    #[test]
    fn only_a_missing_interface_is_gone() {
        // The loopback device exists in every network namespace.
        let lo = std::ffi::CString::new("lo").expect("no NUL");
        // SAFETY: a valid NUL-terminated name.
        let lo = unsafe { libc::if_nametoindex(lo.as_ptr()) };
        assert_ne!(lo, 0, "no lo");
        assert!(!device_gone(lo));
        assert!(device_gone(u32::MAX - 7), "no such interface index");
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
