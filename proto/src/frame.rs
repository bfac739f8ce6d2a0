//! The data-channel frame codec.
//!
//! Wire format (all integers big-endian):
//!
//! ```text
//! +----------------+--------+----------------------+
//! | length: u16    | kind:u8| payload              |
//! +----------------+--------+----------------------+
//!   length = 1 + payload.len()  (counts kind + payload, never 0)
//! ```
//!
//! Kinds: [`Kind::Packet`] (one raw IPv4/IPv6 packet), [`Kind::Hello`] (session
//! start, see [`Hello`]; and, manager → laptop, the answer to a hello that
//! offered offloads, see [`ManagerHello`]), [`Kind::Heartbeat`] (liveness; empty
//! payload or an 8-byte opaque nonce echoed by the manager), [`Kind::Stats`]
//! (manager → laptop: the session's counters, see [`Stats`]), [`Kind::Gso`]
//! (negotiated, a TCP super-packet, see [`GsoHeader`]: laptop → manager with
//! [`OFFLOAD_TCP_GSO`], manager → laptop with [`OFFLOAD_TCP_GRO`]). The decoder is zero-copy, reads
//! no clock and never panics on any input: every malformed frame is a typed
//! [`FrameError`].

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Bytes of the frame header: `u16` length + `u8` kind.
pub const HEADER_LEN: usize = 3;

/// Largest value of the length field (kind + payload), in bytes.
pub const MAX_FRAME_LEN: usize = u16::MAX as usize;

/// Largest payload a frame can carry, in bytes (65534).
pub const MAX_PAYLOAD_LEN: usize = MAX_FRAME_LEN - 1;

/// Version of the data-channel protocol carried in [`Hello`]. Bump it on any
/// change to this module and add a test vector.
///
/// - 1: hello without options.
/// - 2: hello options after the token (the laptop's TUN MTU, [`Hello::mtu`]).
/// - 3: hello option 2, the laptop's second (IPv6) tunnel IP
///   ([`Hello::tunnel_ip_v6`]) for dual-stack sessions; and [`Kind::Stats`]
///   frames from the manager (the session's counters about once a second), sent
///   only to laptops whose hello says 3 or later; older laptops skip unknown
///   kinds anyway.
///
/// Negotiated within version 3 (no bump: an old peer never sends the option
/// and keeps the old behaviour): hello option 4 (offloads the laptop offers),
/// the [`ManagerHello`] answering it, and [`Kind::Gso`] frames after it;
/// hello option 5 (a worker connection's resume token) and the
/// [`Kind::Resume`] frame answering it.
pub const PROTOCOL_VERSION: u16 = 3;

/// First version whose laptops are sent [`Kind::Stats`] frames.
pub const STATS_VERSION: u16 = 3;

/// Oldest version a manager still accepts: a version-1 hello has no options
/// and means a laptop TUN MTU of [`DEFAULT_TUN_MTU`] (that version's fixed default).
pub const MIN_PROTOCOL_VERSION: u16 = 1;

/// The laptop's default TUN MTU and the IP MTU of the manager's stack, in bytes
/// (the root daemon's `DEFAULT_MTU` and the manager's `DEFAULT_MTU` are this
/// value). Every transport is a byte stream, so the MTU bounds only the packet
/// size, and 9000 measured ~3× the throughput of 1500 on the batched TUN path
/// (TOOLCHAIN.md: 7.2 vs 2.3 Gbit/s).
pub const DEFAULT_TUN_MTU: u16 = 9000;

/// Smallest laptop TUN MTU, in bytes: the IPv6 minimum link MTU (RFC 8200 §5).
/// The root daemon refuses a smaller one; the manager fragments to no less.
pub const MIN_TUN_MTU: u16 = 1280;

/// Hello option type: the laptop's TUN MTU, `u16` bytes.
const HELLO_OPT_MTU: u8 = 1;

/// Hello option type: the laptop's IPv6 tunnel IP, 16 bytes (version 3).
const HELLO_OPT_TUNNEL_IP_V6: u8 = 2;

/// Hello option type: offloads, 1 byte of [`OFFLOAD_TCP_GSO`]-style bits. In
/// the laptop's [`Hello`]: what it offers to send; in the [`ManagerHello`]:
/// what the manager accepts.
const HELLO_OPT_OFFLOADS: u8 = 4;

/// Offload bit: [`Kind::Gso`] frames carrying TCPv4/TCPv6 super-packets,
/// laptop → manager.
pub const OFFLOAD_TCP_GSO: u8 = 1;

/// Offload bit: [`Kind::Gso`] frames manager → laptop. The manager merges
/// consecutive TCP segments of one flow ([`crate::gso::Coalescer`], the
/// kernel's GRO rules) and the laptop's pump writes each super-packet to its
/// TUN device (`IFF_VNET_HDR`) with one write. Offered by a laptop whose TUN
/// device has a `virtio_net_hdr`; a laptop that does not offer it gets one
/// [`Kind::Packet`] frame per packet.
pub const OFFLOAD_TCP_GRO: u8 = 2;

/// Largest super-packet in a [`Kind::Gso`] frame, IP bytes.
pub const MAX_GSO_PACKET: usize = MAX_PAYLOAD_LEN - GSO_HEADER_LEN;

/// Bytes of the [`GsoHeader`] at the start of a [`Kind::Gso`] payload.
pub const GSO_HEADER_LEN: usize = 10;
/// Hello option type: the worker shard of this data connection, 4 bytes
/// (`index: u16 | count: u16`), see [`Shard`].
const HELLO_OPT_SHARD: u8 = 3;

/// Hello option type: the worker connection's resume token, 16 bytes
/// ([`Hello::resume_token`]).
const HELLO_OPT_RESUME: u8 = 5;

/// Bytes of a resume token (hello option 5): 128 random bits.
pub const RESUME_TOKEN_LEN: usize = 16;

/// Most workers (data connections) one session may have; the kernel allows 256
/// TUN queues (`MAX_TAP_QUEUES`, include/linux/if_tun.h), a laptop needs few.
pub const MAX_WORKERS: u16 = 16;

/// Hello option 3: which of a session's worker connections this is.
///
/// A laptop with `kvpn connect --workers N` (N > 1) opens N data connections
/// with the same tunnel IP and session token; each hello carries its
/// `index` (0..count) and the `count`. A manager that knows the option keeps
/// (tunnel IP, index) as the connection's identity: a re-dial of worker `i`
/// replaces only worker `i`'s connection, never another worker's. It answers
/// with a [`Kind::Stats`] frame carrying [`stat::WORKERS`] at once, which is
/// how the laptop learns the option was understood (an older manager ignores
/// unknown options and never sends that counter). Without the option (one
/// worker) nothing changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// This connection's worker, `0..count`.
    pub index: u16,
    /// Workers of the session, `1..=MAX_WORKERS`.
    pub count: u16,
}

/// Frame kind (the `u8` after the length).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// One raw IP packet (IPv4 or IPv6, by its version nibble).
    Packet,
    /// Session start: protocol version and the client's tunnel IP.
    Hello,
    /// Liveness probe; the manager echoes it.
    Heartbeat,
    /// Manager → laptop: the session's counters ([`Stats`]), version 3 on.
    Stats,
    /// A [`GsoHeader`] and a TCP super-packet. Laptop → manager only after
    /// the manager accepted [`OFFLOAD_TCP_GSO`] in its [`ManagerHello`];
    /// manager → laptop only to a laptop that offered [`OFFLOAD_TCP_GRO`]
    /// (and the manager accepted it), always `NEEDS_CSUM` at the TCP
    /// checksum ([`encode_coalesced`]).
    Gso,
    /// Manager → laptop, answer to hello option 5 ([`Hello::resume_token`]):
    /// one byte, [`ResumeAnswer`]. Sent early on the stream, only to laptops
    /// that offered a token. Laptop → manager: [`ResumeAnswer::Leaving`]
    /// before a deliberate close (disconnect), so nothing is parked.
    Resume,
    /// A kind this version does not know. Decoded, not rejected, so that a
    /// newer peer's optional frames can be skipped.
    Unknown(u8),
}

impl Kind {
    /// The on-wire byte.
    pub const fn to_u8(self) -> u8 {
        match self {
            Kind::Packet => 1,
            Kind::Hello => 2,
            Kind::Heartbeat => 3,
            Kind::Stats => 4,
            Kind::Gso => 5,
            Kind::Resume => 6,
            Kind::Unknown(b) => b,
        }
    }
}

impl From<u8> for Kind {
    fn from(b: u8) -> Self {
        match b {
            1 => Kind::Packet,
            2 => Kind::Hello,
            3 => Kind::Heartbeat,
            4 => Kind::Stats,
            5 => Kind::Gso,
            6 => Kind::Resume,
            other => Kind::Unknown(other),
        }
    }
}

/// Why bytes are not a valid frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The length field is 0: a frame must at least carry its kind byte.
    #[error("frame length field is 0 (a frame carries at least its kind byte)")]
    ZeroLength,
    /// The frame is larger than the receiver allows.
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    Oversized {
        /// Length field of the frame (kind + payload), bytes.
        len: usize,
        /// The receiver's limit, bytes.
        max: usize,
    },
    /// A payload given to the encoder is larger than the format allows.
    #[error("payload of {len} bytes does not fit a frame (max {MAX_PAYLOAD_LEN})")]
    PayloadTooLarge {
        /// Payload length, bytes.
        len: usize,
    },
    /// The input ended inside a frame (only from [`decode_exact`]).
    #[error("truncated frame: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes the frame needs, header included.
        need: usize,
        /// Bytes available.
        have: usize,
    },
}

/// A decoded frame borrowing its payload from the input buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame<'a> {
    /// The frame's kind.
    pub kind: Kind,
    /// The payload (may be empty).
    pub payload: &'a [u8],
}

impl Frame<'_> {
    /// Bytes this frame occupies on the wire, header included.
    pub fn wire_len(&self) -> usize {
        HEADER_LEN + self.payload.len()
    }
}

/// Decoder settings. `max_len` bounds the length field (kind + payload) the
/// receiver accepts; it defaults to [`MAX_FRAME_LEN`].
#[derive(Debug, Clone, Copy)]
pub struct Decoder {
    max_len: usize,
}

impl Default for Decoder {
    fn default() -> Self {
        Self {
            max_len: MAX_FRAME_LEN,
        }
    }
}

impl Decoder {
    /// A decoder that rejects frames whose length field exceeds `max_len` bytes.
    pub fn with_max_len(max_len: usize) -> Self {
        Self {
            max_len: max_len.clamp(1, MAX_FRAME_LEN),
        }
    }

    /// Decode the first frame of a stream buffer.
    ///
    /// Returns `Ok(None)` when `buf` holds only part of a frame (read more and
    /// call again), `Ok(Some((frame, consumed)))` for a whole frame, and an
    /// error when the header is invalid; the stream cannot be resynchronised
    /// after an error and must be closed.
    pub fn decode<'a>(&self, buf: &'a [u8]) -> Result<Option<(Frame<'a>, usize)>, FrameError> {
        let Some(header) = buf.get(..HEADER_LEN) else {
            // Reject an invalid length as soon as the two length bytes are in.
            if let Some(len_bytes) = buf.get(..2) {
                self.check_len(usize::from(u16::from_be_bytes([
                    len_bytes[0],
                    len_bytes[1],
                ])))?;
            }
            return Ok(None);
        };
        let len = usize::from(u16::from_be_bytes([header[0], header[1]]));
        self.check_len(len)?;
        let total = 2 + len;
        let Some(body) = buf.get(2..total) else {
            return Ok(None);
        };
        let (kind, payload) = match body.split_first() {
            Some((k, p)) => (Kind::from(*k), p),
            None => return Err(FrameError::ZeroLength),
        };
        Ok(Some((Frame { kind, payload }, total)))
    }

    /// Decode a frame header read on its own, for readers that take the header
    /// first and then exactly the payload (never a byte of the next frame): the
    /// payload's length and the frame's kind, with the checks of
    /// [`Decoder::decode`].
    pub fn header(&self, header: &[u8; HEADER_LEN]) -> Result<Header, FrameError> {
        let len = usize::from(u16::from_be_bytes([header[0], header[1]]));
        self.check_len(len)?;
        Ok(Header {
            payload_len: len - 1,
            kind: Kind::from(header[2]),
        })
    }

    fn check_len(&self, len: usize) -> Result<(), FrameError> {
        if len == 0 {
            return Err(FrameError::ZeroLength);
        }
        if len > self.max_len {
            return Err(FrameError::Oversized {
                len,
                max: self.max_len,
            });
        }
        Ok(())
    }
}

/// A frame header decoded by [`Decoder::header`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Bytes of payload that follow the header.
    pub payload_len: usize,
    /// The frame's kind.
    pub kind: Kind,
}

/// Decode `buf` as exactly one frame: a short buffer is [`FrameError::Truncated`].
pub fn decode_exact(buf: &[u8]) -> Result<Frame<'_>, FrameError> {
    match Decoder::default().decode(buf)? {
        Some((frame, used)) if used == buf.len() => Ok(frame),
        Some((_, used)) => Err(FrameError::Oversized {
            len: buf.len().saturating_sub(2),
            max: used - 2,
        }),
        None => Err(FrameError::Truncated {
            need: needed(buf),
            have: buf.len(),
        }),
    }
}

fn needed(buf: &[u8]) -> usize {
    match buf.get(..2) {
        Some(b) => 2 + usize::from(u16::from_be_bytes([b[0], b[1]])),
        None => HEADER_LEN,
    }
}

/// The 3-byte header for a frame of `kind` with `payload_len` bytes of payload.
///
/// Write it followed by the payload (e.g. with one vectored write for a batch).
pub fn encode_header(kind: Kind, payload_len: usize) -> Result<[u8; HEADER_LEN], FrameError> {
    if payload_len > MAX_PAYLOAD_LEN {
        return Err(FrameError::PayloadTooLarge { len: payload_len });
    }
    // Cannot truncate: payload_len + 1 <= MAX_FRAME_LEN == u16::MAX.
    let len = (payload_len + 1) as u16;
    let [a, b] = len.to_be_bytes();
    Ok([a, b, kind.to_u8()])
}

/// Append one whole frame to `out`.
pub fn encode_into(kind: Kind, payload: &[u8], out: &mut Vec<u8>) -> Result<(), FrameError> {
    let header = encode_header(kind, payload.len())?;
    out.reserve(HEADER_LEN + payload.len());
    out.extend_from_slice(&header);
    out.extend_from_slice(payload);
    Ok(())
}

/// Payload of a [`Kind::Hello`] frame, sent by the client first on a data channel.
///
/// ```text
/// version: u16 | family: u8 (4 or 6) | tunnel IP: 4 or 16 bytes | token_len: u8 | token
///   then, from version 2, options: (type: u8 | len: u8 | value: len bytes)*
/// ```
///
/// The token is the session token of the client's lease (empty until leases exist).
/// Options of unknown type are skipped, so a later version can add some without
/// breaking older managers; a version-1 hello has none (trailing bytes are an
/// error there). Option 1: the laptop's TUN MTU (`u16`, bytes). Option 2
/// (version 3): the laptop's IPv6 tunnel IP (16 bytes), the session's second
/// accepted source address when the primary tunnel IP is IPv4 (dual stack).
/// Option 4: offloads the laptop offers (1 byte of bits, [`OFFLOAD_TCP_GSO`], [`OFFLOAD_TCP_GRO`]);
/// a manager that accepts any answers with a [`ManagerHello`].
/// Option 3 (4 bytes, `index: u16 | count: u16`): the worker shard of this
/// connection ([`Shard`]); older managers skip it.
/// Option 5 (16 bytes): the connection's resume token
/// ([`Hello::resume_token`]); a manager that knows it answers with a
/// [`Kind::Resume`] frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Data-channel protocol version ([`PROTOCOL_VERSION`]).
    pub version: u16,
    /// The client's tunnel IP: the only source address the manager accepts
    /// from this session.
    pub tunnel_ip: IpAddr,
    /// Session token of the lease (up to 255 bytes).
    pub token: Vec<u8>,
    /// The laptop's TUN MTU in bytes (option 1; version 2 and later): the manager
    /// fragments the packets it builds for the laptop to this size.
    pub mtu: Option<u16>,
    /// The laptop's IPv6 tunnel IP (option 2; version 3 and later): a
    /// dual-stack session's second accepted source address. A manager older
    /// than version 3 refuses the hello's version, not this option.
    pub tunnel_ip_v6: Option<Ipv6Addr>,
    /// Offloads the laptop offers (option 4; bits like [`OFFLOAD_TCP_GSO`];
    /// `None`: the option is left out). Managers that do not know the option
    /// skip it and never send [`ManagerHello`], so the laptop keeps sending
    /// plain packets.
    pub offloads: Option<u8>,
    /// The worker shard (option 3): set only by laptops with more than one
    /// worker connection. Decoded only when `index < count <= MAX_WORKERS`.
    pub shard: Option<Shard>,
    /// The resume token (option 5): random bits the laptop picks once per
    /// worker per session and offers on every dial of that worker. A manager
    /// that knows the option keeps the engine of a connection that ended
    /// (its TCP sockets and the connections it dialed) parked for a grace
    /// period, and gives it to the next connection of the same tunnel IP and
    /// worker that offers the same token (and lease token), so in-flight TCP
    /// flows survive a re-dial. `None`: today's behaviour (a fresh engine).
    pub resume_token: Option<[u8; RESUME_TOKEN_LEN]>,
}

/// The manager's answer to hello option 5, the payload of a [`Kind::Resume`]
/// frame (one byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResumeAnswer {
    /// 0: a fresh engine; the flows of an earlier connection (if any) are
    /// gone (manager restarted, grace expired, token not known).
    New,
    /// 1: the parked engine of the earlier connection with this token was
    /// re-attached; its flows go on.
    Resumed,
    /// 2, laptop → manager: the laptop closes this connection on purpose
    /// (disconnect); the manager drops the engine at once instead of parking it.
    Leaving,
}

impl ResumeAnswer {
    /// The payload byte.
    pub const fn to_u8(self) -> u8 {
        match self {
            ResumeAnswer::New => 0,
            ResumeAnswer::Resumed => 1,
            ResumeAnswer::Leaving => 2,
        }
    }

    /// Decode a [`Kind::Resume`] payload; `None` when it is not one byte of a
    /// known value. Never panics.
    pub fn decode(payload: &[u8]) -> Option<Self> {
        match payload {
            [0] => Some(ResumeAnswer::New),
            [1] => Some(ResumeAnswer::Resumed),
            [2] => Some(ResumeAnswer::Leaving),
            _ => None,
        }
    }
}

/// Why a hello payload is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HelloError {
    /// The payload ended early.
    #[error("hello truncated: {0} bytes")]
    Truncated(usize),
    /// The address family byte is neither 4 nor 6.
    #[error("hello has unknown address family {0} (expected 4 or 6)")]
    BadFamily(u8),
    /// Bytes follow the token.
    #[error("hello has {0} trailing bytes")]
    Trailing(usize),
    /// The token is longer than 255 bytes (encoder only).
    #[error("hello token of {0} bytes exceeds 255")]
    TokenTooLong(usize),
    /// A known option has the wrong length.
    #[error("hello option {kind} has {len} bytes (expected {want})")]
    BadOption {
        /// The option type.
        kind: u8,
        /// Its length on the wire.
        len: u8,
        /// The length this version expects.
        want: u8,
    },
    /// Options in a version-1 hello (encoder only).
    #[error("hello version {0} cannot carry options (version 2 or later can)")]
    OptionsNeedVersion2(u16),
    /// The shard option's index is not below its count, or the count is 0 or
    /// above [`MAX_WORKERS`].
    #[error("hello shard {index} of {count} workers is invalid (index < count <= {MAX_WORKERS})")]
    BadShard {
        /// The worker index.
        index: u16,
        /// The worker count.
        count: u16,
    },
}

impl Hello {
    /// A hello with the required fields only: no token and none of the options.
    pub fn new(version: u16, tunnel_ip: IpAddr) -> Self {
        Hello {
            version,
            tunnel_ip,
            token: Vec::new(),
            mtu: None,
            tunnel_ip_v6: None,
            offloads: None,
            shard: None,
            resume_token: None,
        }
    }

    /// Encode to a payload.
    pub fn encode(&self) -> Result<Vec<u8>, HelloError> {
        let token_len = u8::try_from(self.token.len())
            .map_err(|_| HelloError::TokenTooLong(self.token.len()))?;
        let mut out = Vec::with_capacity(2 + 1 + 16 + 1 + self.token.len());
        out.extend_from_slice(&self.version.to_be_bytes());
        match self.tunnel_ip {
            IpAddr::V4(a) => {
                out.push(4);
                out.extend_from_slice(&a.octets());
            }
            IpAddr::V6(a) => {
                out.push(6);
                out.extend_from_slice(&a.octets());
            }
        }
        out.push(token_len);
        out.extend_from_slice(&self.token);
        if let Some(mtu) = self.mtu {
            if self.version < 2 {
                return Err(HelloError::OptionsNeedVersion2(self.version));
            }
            out.extend_from_slice(&[HELLO_OPT_MTU, 2]);
            out.extend_from_slice(&mtu.to_be_bytes());
        }
        if let Some(v6) = self.tunnel_ip_v6 {
            if self.version < 2 {
                return Err(HelloError::OptionsNeedVersion2(self.version));
            }
            out.extend_from_slice(&[HELLO_OPT_TUNNEL_IP_V6, 16]);
            out.extend_from_slice(&v6.octets());
        }
        if let Some(offloads) = self.offloads {
            if self.version < 2 {
                return Err(HelloError::OptionsNeedVersion2(self.version));
            }
            out.extend_from_slice(&[HELLO_OPT_OFFLOADS, 1, offloads]);
        }
        if let Some(shard) = self.shard {
            if self.version < 2 {
                return Err(HelloError::OptionsNeedVersion2(self.version));
            }
            shard.check()?;
            out.extend_from_slice(&[HELLO_OPT_SHARD, 4]);
            out.extend_from_slice(&shard.index.to_be_bytes());
            out.extend_from_slice(&shard.count.to_be_bytes());
        }
        if let Some(token) = &self.resume_token {
            if self.version < 2 {
                return Err(HelloError::OptionsNeedVersion2(self.version));
            }
            out.extend_from_slice(&[HELLO_OPT_RESUME, RESUME_TOKEN_LEN as u8]);
            out.extend_from_slice(token);
        }
        Ok(out)
    }

    /// Decode a payload. Never panics.
    pub fn decode(buf: &[u8]) -> Result<Self, HelloError> {
        let trunc = || HelloError::Truncated(buf.len());
        let version = u16::from_be_bytes(
            buf.get(..2)
                .ok_or_else(trunc)?
                .try_into()
                .map_err(|_| trunc())?,
        );
        let family = *buf.get(2).ok_or_else(trunc)?;
        let (tunnel_ip, rest) = match family {
            4 => {
                let b: [u8; 4] = buf
                    .get(3..7)
                    .ok_or_else(trunc)?
                    .try_into()
                    .map_err(|_| trunc())?;
                (IpAddr::V4(Ipv4Addr::from(b)), &buf[7..])
            }
            6 => {
                let b: [u8; 16] = buf
                    .get(3..19)
                    .ok_or_else(trunc)?
                    .try_into()
                    .map_err(|_| trunc())?;
                (IpAddr::V6(Ipv6Addr::from(b)), &buf[19..])
            }
            other => return Err(HelloError::BadFamily(other)),
        };
        let (&token_len, rest) = rest.split_first().ok_or_else(trunc)?;
        let token = rest.get(..usize::from(token_len)).ok_or_else(trunc)?;
        let mut options = &rest[token.len()..];
        if version < 2 && !options.is_empty() {
            return Err(HelloError::Trailing(options.len()));
        }
        let mut mtu = None;
        let mut tunnel_ip_v6 = None;
        let mut offloads = None;
        let mut shard = None;
        let mut resume_token = None;
        while let [kind, len, tail @ ..] = options {
            let value = tail.get(..usize::from(*len)).ok_or_else(trunc)?;
            let bad = |want| HelloError::BadOption {
                kind: *kind,
                len: *len,
                want,
            };
            if *kind == HELLO_OPT_MTU {
                let b: [u8; 2] = value.try_into().map_err(|_| bad(2))?;
                mtu = Some(u16::from_be_bytes(b));
            } else if *kind == HELLO_OPT_TUNNEL_IP_V6 {
                let b: [u8; 16] = value.try_into().map_err(|_| bad(16))?;
                tunnel_ip_v6 = Some(Ipv6Addr::from(b));
            } else if *kind == HELLO_OPT_OFFLOADS {
                let [b]: [u8; 1] = value.try_into().map_err(|_| bad(1))?;
                offloads = Some(b);
            } else if *kind == HELLO_OPT_SHARD {
                let b: [u8; 4] = value.try_into().map_err(|_| bad(4))?;
                let s = Shard {
                    index: u16::from_be_bytes([b[0], b[1]]),
                    count: u16::from_be_bytes([b[2], b[3]]),
                };
                s.check()?;
                shard = Some(s);
            } else if *kind == HELLO_OPT_RESUME {
                let b: [u8; RESUME_TOKEN_LEN] =
                    value.try_into().map_err(|_| bad(RESUME_TOKEN_LEN as u8))?;
                resume_token = Some(b);
            }
            options = &tail[value.len()..];
        }
        if !options.is_empty() {
            return Err(trunc());
        }
        Ok(Self {
            version,
            tunnel_ip,
            token: token.to_vec(),
            mtu,
            tunnel_ip_v6,
            offloads,
            shard,
            resume_token,
        })
    }
}

/// Payload of a [`Kind::Hello`] frame from the manager to the laptop: the
/// manager's answer to a [`Hello`] that offered offloads (option 4). Sent once,
/// first on the stream (after the first [`Kind::Stats`] frame on a worker
/// connection of a sharded session, the answer to option 3 the laptop reads
/// before its pump starts), and only to laptops that offered some, so a laptop
/// that offers none never sees it (older laptops ignore hello frames from the
/// manager anyway: they pass unknown and hello kinds over).
///
/// ```text
/// version: u16 | options: (type: u8 | len: u8 | value: len bytes)*
/// ```
///
/// `version` is the manager's [`PROTOCOL_VERSION`]. Option 4: the offloads the
/// manager accepts (1 byte of bits, a subset of the laptop's offer). Unknown
/// options are skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ManagerHello {
    /// The manager's data-channel protocol version.
    pub version: u16,
    /// Offloads the manager accepts ([`OFFLOAD_TCP_GSO`], [`OFFLOAD_TCP_GRO`] bits).
    pub offloads: u8,
}

impl ManagerHello {
    /// Encode to a payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(5);
        out.extend_from_slice(&self.version.to_be_bytes());
        out.extend_from_slice(&[HELLO_OPT_OFFLOADS, 1, self.offloads]);
        out
    }

    /// Decode a payload. Never panics.
    pub fn decode(buf: &[u8]) -> Result<Self, HelloError> {
        let trunc = || HelloError::Truncated(buf.len());
        let [a, b, rest @ ..] = buf else {
            return Err(trunc());
        };
        let mut options = rest;
        let mut offloads = 0;
        while let [kind, len, tail @ ..] = options {
            let value = tail.get(..usize::from(*len)).ok_or_else(trunc)?;
            if *kind == HELLO_OPT_OFFLOADS {
                let [v]: [u8; 1] = value.try_into().map_err(|_| HelloError::BadOption {
                    kind: *kind,
                    len: *len,
                    want: 1,
                })?;
                offloads = v;
            }
            options = &tail[value.len()..];
        }
        if !options.is_empty() {
            return Err(trunc());
        }
        Ok(Self {
            version: u16::from_be_bytes([*a, *b]),
            offloads,
        })
    }
}

/// The fixed header at the start of a [`Kind::Gso`] payload; the TCP
/// super-packet (IPv4 or IPv6 packet, headers once) follows it.
///
/// The fields of the kernel's `struct virtio_net_hdr`
/// (include/uapi/linux/virtio_net.h) as the laptop's TUN read returned them,
/// in the same order but big-endian (the kernel's are little-endian):
///
/// ```text
/// flags: u8 | gso_type: u8 | hdr_len: u16 | gso_size: u16 | csum_start: u16 | csum_offset: u16
/// ```
///
/// 10 bytes ([`GSO_HEADER_LEN`]). `flags` bit 0 is `VIRTIO_NET_HDR_F_NEEDS_CSUM`;
/// `gso_type` is 1 (TCPv4) or 4 (TCPv6), bit 7 = ECN ([`crate::gso`]);
/// `gso_size` is the MSS (payload bytes per segment). `hdr_len` is informational
/// (the kernel reports its linear-data length there, `skb_headlen`): the
/// receiver finds the header length from the headers themselves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GsoHeader {
    /// `VIRTIO_NET_HDR_F_*` bits.
    pub flags: u8,
    /// `VIRTIO_NET_HDR_GSO_*` kind.
    pub gso_type: u8,
    /// Header bytes as the kernel reported them (informational).
    pub hdr_len: u16,
    /// Payload bytes per segment (the MSS).
    pub gso_size: u16,
    /// Offset of the L4 header (where the checksum sum starts), bytes.
    pub csum_start: u16,
    /// Offset of the checksum field from `csum_start`, bytes.
    pub csum_offset: u16,
}

impl GsoHeader {
    /// The 10 header bytes.
    pub fn encode(&self) -> [u8; GSO_HEADER_LEN] {
        let mut out = [0u8; GSO_HEADER_LEN];
        out[0] = self.flags;
        out[1] = self.gso_type;
        out[2..4].copy_from_slice(&self.hdr_len.to_be_bytes());
        out[4..6].copy_from_slice(&self.gso_size.to_be_bytes());
        out[6..8].copy_from_slice(&self.csum_start.to_be_bytes());
        out[8..10].copy_from_slice(&self.csum_offset.to_be_bytes());
        out
    }

    /// Split a [`Kind::Gso`] payload into its header and the super-packet.
    /// Never panics; `None` when the payload is shorter than the header.
    pub fn split(payload: &[u8]) -> Option<(Self, &[u8])> {
        let (h, packet) = payload.split_first_chunk::<GSO_HEADER_LEN>()?;
        let be = |i: usize| u16::from_be_bytes([h[i], h[i + 1]]);
        Some((
            Self {
                flags: h[0],
                gso_type: h[1],
                hdr_len: be(2),
                gso_size: be(4),
                csum_start: be(6),
                csum_offset: be(8),
            },
            packet,
        ))
    }
}

/// Frame `packets` (the manager's output to one laptop, in order) into
/// `out` for a laptop that accepted [`OFFLOAD_TCP_GRO`]: runs of one TCP
/// flow become one [`Kind::Gso`] frame (flags `NEEDS_CSUM`, `gso_size` the
/// MSS, see [`crate::gso::Coalescer`]), every other packet a
/// [`Kind::Packet`] frame. Returns what was merged and how many packets were
/// left out because they do not fit a frame.
pub fn encode_coalesced<P: AsRef<[u8]>>(
    coalescer: &mut crate::gso::Coalescer,
    packets: &[P],
    out: &mut Vec<u8>,
) -> (crate::gso::Coalesced, usize) {
    let mut too_large = 0;
    let done = coalescer.coalesce(
        packets,
        MAX_GSO_PACKET,
        out,
        HEADER_LEN + GSO_HEADER_LEN,
        |out, packet| {
            if encode_into(Kind::Packet, packet, out).is_err() {
                too_large += 1;
            }
        },
        |head, sp, packet| {
            // Cannot fail: the coalescer keeps packets within MAX_GSO_PACKET.
            let frame = encode_header(Kind::Gso, GSO_HEADER_LEN + packet.len()).unwrap_or_default();
            let gso = GsoHeader {
                flags: crate::gso::F_NEEDS_CSUM,
                gso_type: sp.gso_type,
                hdr_len: sp.hdr_len,
                gso_size: sp.gso_size,
                csum_start: sp.csum_start,
                csum_offset: crate::gso::TCP_CSUM_OFFSET,
            };
            head[..HEADER_LEN].copy_from_slice(&frame);
            head[HEADER_LEN..].copy_from_slice(&gso.encode());
        },
    );
    (done, too_large)
}

impl Shard {
    fn check(self) -> Result<(), HelloError> {
        if self.count == 0 || self.count > MAX_WORKERS || self.index >= self.count {
            return Err(HelloError::BadShard {
                index: self.index,
                count: self.count,
            });
        }
        Ok(())
    }
}

/// Payload of a [`Kind::Stats`] frame: the manager's counters of one session,
/// by name, each a `u64` (since the manager's session began: a re-dial starts
/// a new one).
///
/// ```text
/// (name_len: u8 | name: name_len bytes, ASCII | value: u64)*
/// ```
///
/// Names are self-describing so either side can add counters without a
/// version bump: a receiver keeps what it does not know and shows what it
/// does (see the `stat` constants). Drops are `drop_<reason>`, with the
/// manager's drop reasons (`drop_intake_full`, `drop_too_many_flows`, …).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// (name, value) in the sender's order.
    pub counters: Vec<(String, u64)>,
}

/// Counter names of [`Stats`] both sides know.
pub mod stat {
    /// Live flows of the session (TCP, UDP, ping).
    pub const FLOWS: &str = "flows";
    /// The session's flow cap (`kvpn-manager --max-flows-per-client`).
    pub const FLOW_CAP: &str = "flow_cap";
    /// New flows refused because the session was at its flow cap.
    pub const REFUSED_CAP: &str = "refused_cap";
    /// New flows dropped by the new-flow rate limit.
    pub const RATE_LIMITED: &str = "rate_limited";
    /// ICMP errors not sent because of the ICMP error rate limit.
    pub const ICMP_RATE_LIMITED: &str = "icmp_rate_limited";
    /// Heartbeat echoes dropped because the control queue was full.
    pub const ECHOES_DROPPED: &str = "echoes_dropped";
    /// GSO frames (kind 5) the manager segmented.
    pub const GSO_FRAMES: &str = "gso_frames";
    /// Packets those GSO frames were segmented into.
    pub const GSO_SEGMENTS: &str = "gso_segments";
    /// Prefix of the per-reason packet drop counters.
    pub const DROP_PREFIX: &str = "drop_";
    /// Worker connections of the session as the manager took them from the
    /// hello's shard option ([`super::Shard::count`]); only sent for sharded
    /// sessions, so its presence proves the manager understands option 3.
    pub const WORKERS: &str = "workers";
}

/// Why a stats payload is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StatsError {
    /// The payload ended inside a counter.
    #[error("stats payload truncated at byte {0}")]
    Truncated(usize),
    /// A name is not printable ASCII.
    #[error("stats counter name at byte {0} is not printable ASCII")]
    BadName(usize),
    /// A name is empty or longer than 255 bytes (encoder only).
    #[error("stats counter name {0:?} is empty or longer than 255 bytes")]
    NameLength(String),
    /// The counters do not fit one frame (encoder only).
    #[error("{0} bytes of stats do not fit a frame (max {MAX_PAYLOAD_LEN})")]
    TooLarge(usize),
}

impl Stats {
    /// The counter `name`, if present.
    pub fn get(&self, name: &str) -> Option<u64> {
        self.counters
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| *v)
    }

    /// Encode to a payload.
    pub fn encode(&self) -> Result<Vec<u8>, StatsError> {
        let mut out = Vec::new();
        for (name, value) in &self.counters {
            let len = u8::try_from(name.len())
                .ok()
                .filter(|l| *l > 0)
                .ok_or_else(|| StatsError::NameLength(name.clone()))?;
            out.push(len);
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&value.to_be_bytes());
        }
        if out.len() > MAX_PAYLOAD_LEN {
            return Err(StatsError::TooLarge(out.len()));
        }
        Ok(out)
    }

    /// Decode a payload. Never panics.
    pub fn decode(buf: &[u8]) -> Result<Self, StatsError> {
        let mut counters = Vec::new();
        let mut at = 0;
        while let Some(&len) = buf.get(at) {
            let start = at + 1;
            let end = start + usize::from(len);
            let name = buf.get(start..end).ok_or(StatsError::Truncated(at))?;
            if name.is_empty() || !name.iter().all(|b| b.is_ascii_graphic()) {
                return Err(StatsError::BadName(at));
            }
            let value: [u8; 8] = buf
                .get(end..end + 8)
                .and_then(|v| v.try_into().ok())
                .ok_or(StatsError::Truncated(at))?;
            let name = String::from_utf8_lossy(name).into_owned();
            counters.push((name, u64::from_be_bytes(value)));
            at = end + 8;
        }
        Ok(Self { counters })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn test_vector_v1_packet() {
        let mut out = Vec::new();
        encode_into(Kind::Packet, &[0x45, 0x00], &mut out).expect("encodes");
        assert_eq!(out, [0x00, 0x03, 0x01, 0x45, 0x00]);
    }

    #[test]
    fn test_vector_v1_hello() {
        let hello = Hello {
            version: 1,
            tunnel_ip: IpAddr::V4(Ipv4Addr::new(100, 96, 0, 2)),
            token: b"ab".to_vec(),
            mtu: None,
            tunnel_ip_v6: None,
            offloads: None,
            shard: None,
            resume_token: None,
        };
        let payload = hello.encode().expect("encodes");
        assert_eq!(payload, [0, 1, 4, 100, 96, 0, 2, 2, b'a', b'b']);
        assert_eq!(Hello::decode(&payload), Ok(hello));
    }

    #[test]
    fn test_vector_v2_hello_with_mtu() {
        let hello = Hello {
            version: 2,
            tunnel_ip: IpAddr::V4(Ipv4Addr::new(100, 96, 0, 2)),
            token: b"ab".to_vec(),
            mtu: Some(1400),
            tunnel_ip_v6: None,
            offloads: None,
            shard: None,
            resume_token: None,
        };
        let payload = hello.encode().expect("encodes");
        assert_eq!(
            payload,
            [0, 2, 4, 100, 96, 0, 2, 2, b'a', b'b', 1, 2, 0x05, 0x78]
        );
        assert_eq!(Hello::decode(&payload), Ok(hello));
        // A later version's unknown option is skipped; no options at all is fine.
        let mut later = payload.clone();
        later.extend_from_slice(&[9, 3, 1, 2, 3]);
        assert_eq!(
            Hello::decode(&later).map(|h| h.mtu),
            Ok(Some(1400)),
            "unknown option skipped"
        );
        assert_eq!(
            Hello::decode(&[0, 2, 4, 100, 96, 0, 2, 0]).map(|h| h.mtu),
            Ok(None)
        );
    }

    #[test]
    fn test_vector_v3_stats() {
        let stats = Stats {
            counters: vec![("flows".into(), 3), ("drop_intake_full".into(), 258)],
        };
        let payload = stats.encode().expect("encodes");
        let mut want = vec![5];
        want.extend_from_slice(b"flows");
        want.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 3]);
        want.push(16);
        want.extend_from_slice(b"drop_intake_full");
        want.extend_from_slice(&[0, 0, 0, 0, 0, 0, 1, 2]);
        assert_eq!(payload, want);
        assert_eq!(Stats::decode(&payload), Ok(stats.clone()));
        assert_eq!(stats.get("drop_intake_full"), Some(258));
        assert_eq!(stats.get("nothing"), None);
        let mut out = Vec::new();
        encode_into(Kind::Stats, &payload, &mut out).expect("fits");
        assert_eq!(&out[..3], &[0, 40, 4]);
        // Empty: no counters.
        assert_eq!(Stats::decode(&[]), Ok(Stats::default()));
        // Cut inside a value or a name; a name with a space or none.
        assert_eq!(Stats::decode(&payload[..10]), Err(StatsError::Truncated(0)));
        assert_eq!(Stats::decode(&[3, b'a']), Err(StatsError::Truncated(0)));
        assert_eq!(
            Stats::decode(&[1, b' ', 0, 0, 0, 0, 0, 0, 0, 0]),
            Err(StatsError::BadName(0))
        );
        assert_eq!(Stats::decode(&[0]), Err(StatsError::BadName(0)));
        let empty_name = Stats {
            counters: vec![(String::new(), 1)],
        };
        assert!(matches!(
            empty_name.encode(),
            Err(StatsError::NameLength(_))
        ));
    }

    #[test]
    fn test_vector_resume_option_and_answer() {
        // Hello option 5: 16 bytes of resume token after the token.
        let hello = Hello {
            version: 3,
            tunnel_ip: IpAddr::V4(Ipv4Addr::new(100, 96, 0, 2)),
            token: Vec::new(),
            mtu: None,
            tunnel_ip_v6: None,
            offloads: None,
            shard: None,
            resume_token: Some([7; RESUME_TOKEN_LEN]),
        };
        let enc = hello.encode().expect("encodes");
        let mut want = vec![0, 3, 4, 100, 96, 0, 2, 0, 5, 16];
        want.extend_from_slice(&[7; 16]);
        assert_eq!(enc, want);
        assert_eq!(Hello::decode(&enc), Ok(hello));
        // A short token is an error, never a token the manager would match.
        assert_eq!(
            Hello::decode(&[0, 3, 4, 100, 96, 0, 2, 0, 5, 2, 1, 1]),
            Err(HelloError::BadOption {
                kind: 5,
                len: 2,
                want: 16
            })
        );
        // Kind 6: one byte, 0 = new, 1 = resumed; anything else is not an answer.
        let mut out = Vec::new();
        encode_into(Kind::Resume, &[ResumeAnswer::Resumed.to_u8()], &mut out).expect("fits");
        assert_eq!(out, [0, 2, 6, 1]);
        let frame = decode_exact(&out).expect("one frame");
        assert_eq!(frame.kind, Kind::Resume);
        assert_eq!(
            ResumeAnswer::decode(frame.payload),
            Some(ResumeAnswer::Resumed)
        );
        assert_eq!(ResumeAnswer::decode(&[0]), Some(ResumeAnswer::New));
        assert_eq!(ResumeAnswer::decode(&[2]), Some(ResumeAnswer::Leaving));
        assert_eq!(ResumeAnswer::decode(&[3]), None);
        assert_eq!(ResumeAnswer::decode(&[]), None);
        assert_eq!(ResumeAnswer::decode(&[1, 1]), None);
    }

    #[test]
    fn test_vector_v3_gso_frame_and_offload_hellos() {
        // Kind 5: the 10-byte header (big-endian virtio_net_hdr fields), then
        // the super-packet.
        let header = GsoHeader {
            flags: 1,
            gso_type: 0x81,
            hdr_len: 66,
            gso_size: 8948,
            csum_start: 20,
            csum_offset: 16,
        };
        let mut payload = header.encode().to_vec();
        assert_eq!(payload, [1, 0x81, 0, 66, 0x22, 0xf4, 0, 20, 0, 16]);
        payload.extend_from_slice(&[0x45, 0]);
        let mut out = Vec::new();
        encode_into(Kind::Gso, &payload, &mut out).expect("fits");
        assert_eq!(&out[..3], &[0, 13, 5]);
        let frame = decode_exact(&out).expect("one frame");
        assert_eq!(frame.kind, Kind::Gso);
        assert_eq!(
            GsoHeader::split(frame.payload),
            Some((header, &[0x45, 0][..]))
        );
        assert_eq!(
            GsoHeader::split(&[1, 2, 3]),
            None,
            "shorter than the header"
        );

        // Hello option 4: offloads offered.
        let hello = Hello {
            version: 3,
            tunnel_ip: IpAddr::V4(Ipv4Addr::new(100, 96, 0, 2)),
            token: Vec::new(),
            mtu: Some(9000),
            tunnel_ip_v6: None,
            offloads: Some(OFFLOAD_TCP_GSO),
            shard: None,
            resume_token: None,
        };
        let enc = hello.encode().expect("encodes");
        assert_eq!(enc, [0, 3, 4, 100, 96, 0, 2, 0, 1, 2, 0x23, 0x28, 4, 1, 1]);
        assert_eq!(Hello::decode(&enc), Ok(hello.clone()));
        assert_eq!(
            Hello::decode(&[0, 3, 4, 100, 96, 0, 2, 0, 4, 2, 1, 1]),
            Err(HelloError::BadOption {
                kind: 4,
                len: 2,
                want: 1
            })
        );

        // The manager's answer: version, then option 4 with what it accepts.
        let answer = ManagerHello {
            version: 3,
            offloads: OFFLOAD_TCP_GSO,
        };
        assert_eq!(answer.encode(), [0, 3, 4, 1, 1]);
        assert_eq!(ManagerHello::decode(&answer.encode()), Ok(answer));
        // Bit 2: GSO frames manager -> laptop, offered and accepted.
        let both = Hello {
            offloads: Some(OFFLOAD_TCP_GSO | OFFLOAD_TCP_GRO),
            ..hello.clone()
        };
        let enc = both.encode().expect("encodes");
        assert_eq!(enc[enc.len() - 3..], [4, 1, 3]);
        assert_eq!(Hello::decode(&enc), Ok(both));
        let answer = ManagerHello {
            version: 3,
            offloads: OFFLOAD_TCP_GSO | OFFLOAD_TCP_GRO,
        };
        assert_eq!(answer.encode(), [0, 3, 4, 1, 3]);
        // Unknown options skipped; none at all means no offloads.
        assert_eq!(
            ManagerHello::decode(&[0, 4, 9, 2, 0, 0, 4, 1, 1]),
            Ok(ManagerHello {
                version: 4,
                offloads: 1
            })
        );
        assert_eq!(ManagerHello::decode(&[0, 3]).map(|h| h.offloads), Ok(0));
        assert_eq!(ManagerHello::decode(&[0]), Err(HelloError::Truncated(1)));
        assert_eq!(
            ManagerHello::decode(&[0, 3, 4, 5]),
            Err(HelloError::Truncated(4))
        );
    }

    #[test]
    fn partial_frames_ask_for_more() {
        let mut out = Vec::new();
        encode_into(Kind::Heartbeat, &[1, 2, 3], &mut out).expect("encodes");
        for cut in 0..out.len() {
            assert_eq!(
                Decoder::default().decode(&out[..cut]),
                Ok(None),
                "cut at {cut}"
            );
        }
        let (frame, used) = Decoder::default()
            .decode(&out)
            .expect("valid")
            .expect("whole");
        assert_eq!(used, out.len());
        assert_eq!(frame.kind, Kind::Heartbeat);
        assert_eq!(frame.payload, &[1, 2, 3]);
    }

    #[test]
    fn zero_length_is_rejected() {
        assert_eq!(
            Decoder::default().decode(&[0, 0]),
            Err(FrameError::ZeroLength)
        );
        assert_eq!(
            Decoder::default().decode(&[0, 0, 1]),
            Err(FrameError::ZeroLength)
        );
    }

    /// A header read on its own says what `decode` would: the payload's length
    /// and kind, or the same refusal.
    #[test]
    fn header_alone_decodes_as_the_whole_frame_does() {
        let mut out = Vec::new();
        encode_into(Kind::Packet, &[7; 300], &mut out).expect("encode");
        let header: [u8; HEADER_LEN] = out[..HEADER_LEN].try_into().expect("3 bytes");
        let (frame, used) = Decoder::default()
            .decode(&out)
            .expect("valid")
            .expect("whole");
        assert_eq!(
            Decoder::default().header(&header),
            Ok(Header {
                payload_len: frame.payload.len(),
                kind: frame.kind
            })
        );
        assert_eq!(HEADER_LEN + 300, used);
        assert_eq!(
            Decoder::default().header(&[0, 0, 1]),
            Err(FrameError::ZeroLength)
        );
        assert_eq!(
            Decoder::with_max_len(100).header(&header),
            Err(FrameError::Oversized { len: 301, max: 100 })
        );
    }

    #[test]
    fn oversized_is_rejected_from_the_length_alone() {
        let d = Decoder::with_max_len(1500);
        assert_eq!(
            d.decode(&[0x10, 0x00]),
            Err(FrameError::Oversized {
                len: 4096,
                max: 1500
            })
        );
    }

    #[test]
    fn truncated_exact_decode() {
        assert_eq!(
            decode_exact(&[0, 5, 1, 0]),
            Err(FrameError::Truncated { need: 7, have: 4 })
        );
    }

    #[test]
    fn payload_too_large_for_encoder() {
        assert_eq!(
            encode_header(Kind::Packet, MAX_PAYLOAD_LEN + 1),
            Err(FrameError::PayloadTooLarge {
                len: MAX_PAYLOAD_LEN + 1
            })
        );
        assert!(encode_header(Kind::Packet, MAX_PAYLOAD_LEN).is_ok());
    }

    #[test]
    fn test_vector_v3_hello_with_ipv6_tunnel_ip() {
        let v6 = Ipv6Addr::new(0xfd6b, 0x7670, 0x6e00, 0, 0, 0, 0x6460, 2);
        let hello = Hello {
            version: 3,
            tunnel_ip: IpAddr::V4(Ipv4Addr::new(100, 96, 0, 2)),
            token: b"ab".to_vec(),
            mtu: Some(1400),
            tunnel_ip_v6: Some(v6),
            offloads: None,
            shard: None,
            resume_token: None,
        };
        let payload = hello.encode().expect("encodes");
        let mut want = vec![
            0, 3, 4, 100, 96, 0, 2, 2, b'a', b'b', 1, 2, 0x05, 0x78, 2, 16,
        ];
        want.extend_from_slice(&v6.octets());
        assert_eq!(payload, want);
        assert_eq!(Hello::decode(&payload), Ok(hello));
        // A version-2 reader's loop skips option 2 like any unknown option;
        // a short option 2 is an error.
        let mut short = vec![0, 3, 4, 100, 96, 0, 2, 0, 2, 4];
        short.extend_from_slice(&[0xfd, 0x6b, 0x76, 0x70]);
        assert_eq!(
            Hello::decode(&short),
            Err(HelloError::BadOption {
                kind: 2,
                len: 4,
                want: 16
            })
        );
    }

    #[test]
    fn test_vector_hello_with_shard() {
        let hello = Hello {
            version: 3,
            tunnel_ip: IpAddr::V4(Ipv4Addr::new(100, 96, 0, 2)),
            token: b"ab".to_vec(),
            mtu: Some(1400),
            tunnel_ip_v6: None,
            offloads: None,
            shard: Some(Shard { index: 1, count: 2 }),
            resume_token: None,
        };
        let payload = hello.encode().expect("encodes");
        assert_eq!(
            payload,
            [
                0, 3, 4, 100, 96, 0, 2, 2, b'a', b'b', 1, 2, 0x05, 0x78, 3, 4, 0, 1, 0, 2
            ]
        );
        assert_eq!(Hello::decode(&payload), Ok(hello.clone()));
        // An index not below the count, a count of 0 or above the maximum, a
        // short option: errors, never a shard the manager would trust.
        for (index, count) in [(2u16, 2u16), (0, 0), (0, MAX_WORKERS + 1)] {
            let mut bad = payload[..14].to_vec();
            bad.extend_from_slice(&[3, 4]);
            bad.extend_from_slice(&index.to_be_bytes());
            bad.extend_from_slice(&count.to_be_bytes());
            assert_eq!(
                Hello::decode(&bad),
                Err(HelloError::BadShard { index, count })
            );
        }
        let mut short = payload[..14].to_vec();
        short.extend_from_slice(&[3, 2, 0, 1]);
        assert_eq!(
            Hello::decode(&short),
            Err(HelloError::BadOption {
                kind: 3,
                len: 2,
                want: 4
            })
        );
        let bad = Hello {
            shard: Some(Shard { index: 3, count: 2 }),
            ..hello
        };
        assert_eq!(
            bad.encode(),
            Err(HelloError::BadShard { index: 3, count: 2 })
        );
    }

    #[test]
    fn hello_errors() {
        assert_eq!(Hello::decode(&[]), Err(HelloError::Truncated(0)));
        assert_eq!(Hello::decode(&[0, 1, 5]), Err(HelloError::BadFamily(5)));
        assert_eq!(
            Hello::decode(&[0, 1, 4, 1, 2, 3, 4, 0, 9]),
            Err(HelloError::Trailing(1))
        );
        assert_eq!(
            Hello::decode(&[0, 1, 4, 1, 2, 3, 4, 3, 9]),
            Err(HelloError::Truncated(9))
        );
        // Version 2: a cut option, an MTU option of the wrong size, options in
        // a version-1 hello.
        assert_eq!(
            Hello::decode(&[0, 2, 4, 1, 2, 3, 4, 0, 1, 2, 5]),
            Err(HelloError::Truncated(11))
        );
        assert_eq!(
            Hello::decode(&[0, 2, 4, 1, 2, 3, 4, 0, 7]),
            Err(HelloError::Truncated(9))
        );
        assert_eq!(
            Hello::decode(&[0, 2, 4, 1, 2, 3, 4, 0, 1, 1, 5]),
            Err(HelloError::BadOption {
                kind: 1,
                len: 1,
                want: 2
            })
        );
        let v1 = Hello {
            version: 1,
            tunnel_ip: IpAddr::V4(Ipv4Addr::new(1, 2, 3, 4)),
            token: Vec::new(),
            mtu: Some(1400),
            tunnel_ip_v6: None,
            offloads: None,
            shard: None,
            resume_token: None,
        };
        assert_eq!(v1.encode(), Err(HelloError::OptionsNeedVersion2(1)));
    }

    proptest! {
        #[test]
        fn round_trip(kind in any::<u8>(), payload in proptest::collection::vec(any::<u8>(), 0..4096)) {
            let mut out = Vec::new();
            encode_into(Kind::from(kind), &payload, &mut out).expect("fits");
            let (frame, used) = Decoder::default().decode(&out).expect("valid").expect("whole");
            prop_assert_eq!(used, out.len());
            prop_assert_eq!(frame.kind, Kind::from(kind));
            prop_assert_eq!(frame.payload, &payload[..]);
        }

        #[test]
        fn stream_of_frames_round_trips(frames in proptest::collection::vec((any::<u8>(), proptest::collection::vec(any::<u8>(), 0..300)), 0..20)) {
            let mut out = Vec::new();
            for (k, p) in &frames { encode_into(Kind::from(*k), p, &mut out).expect("fits"); }
            let mut rest = &out[..];
            let mut got = Vec::new();
            while let Some((f, used)) = Decoder::default().decode(rest).expect("valid") {
                got.push((f.kind.to_u8(), f.payload.to_vec()));
                rest = &rest[used..];
            }
            prop_assert!(rest.is_empty());
            prop_assert_eq!(got, frames);
        }

        #[test]
        fn arbitrary_bytes_never_panic(buf in proptest::collection::vec(any::<u8>(), 0..2048), max in 0usize..70000) {
            let d = Decoder::with_max_len(max);
            if let Ok(Some((frame, used))) = d.decode(&buf) {
                prop_assert!(used <= buf.len());
                prop_assert_eq!(frame.wire_len(), used);
            }
            let _ = decode_exact(&buf);
            let _ = Hello::decode(&buf);
            let _ = Stats::decode(&buf);
            let _ = ManagerHello::decode(&buf);
            let _ = ResumeAnswer::decode(&buf);
            let _ = GsoHeader::split(&buf);
        }

        #[test]
        fn stats_round_trip(counters in proptest::collection::vec(("[a-z_]{1,40}", any::<u64>()), 0..40)) {
            let stats = Stats { counters };
            let enc = stats.encode().expect("fits");
            prop_assert_eq!(Stats::decode(&enc), Ok(stats));
        }

        #[test]
        fn hello_round_trip(v4 in any::<[u8; 4]>(), v6 in any::<[u8; 16]>(), six in any::<bool>(), token in proptest::collection::vec(any::<u8>(), 0..255), version in any::<u16>(), mtu in any::<Option<u16>>(), offloads in any::<Option<u8>>(), count in 0u16..20, resume in any::<Option<[u8; 16]>>()) {
            let ip = if six { IpAddr::V6(Ipv6Addr::from(v6)) } else { IpAddr::V4(Ipv4Addr::from(v4)) };
            let mtu = if version >= 2 { mtu } else { None };
            let second = (version >= 2 && !six).then(|| Ipv6Addr::from(v6));
            let offloads = if version >= 2 { offloads } else { None };
            let shard = (version >= 2).then_some(Shard { index: count.saturating_sub(1) / 2, count }).filter(|_| (1..=MAX_WORKERS).contains(&count));
            let resume_token = if version >= 2 { resume } else { None };
            let hello = Hello { version, tunnel_ip: ip, token, mtu, tunnel_ip_v6: second, offloads, shard, resume_token };
            let enc = hello.encode().expect("token fits");
            prop_assert_eq!(Hello::decode(&enc), Ok(hello));
        }
    }
}
