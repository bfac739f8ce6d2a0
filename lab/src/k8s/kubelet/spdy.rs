//! The kubelet's SPDY/3.1 port-forward (`POST|GET /portForward/{namespace}/{pod}` with
//! `Upgrade: SPDY/3.1` and `X-Stream-Protocol-Version: portforward.k8s.io`), which is
//! what `kubectl port-forward` speaks: kubectl ≤ 1.29 only this, kubectl ≥ 1.30 after
//! its websocket attempt fails against a 1.20 API server (that attempt carries no
//! `port` parameter, so [`super::server`] refuses it with 400 and kubectl falls back).
//! The API server passes the upgrade through unchanged.
//!
//! Wire format (SPDY draft 3.1, as `k8s.io/apimachinery/pkg/util/httpstream/spdy` and
//! moby/spdystream speak it): every frame has an 8-byte header; control frames start
//! with the control bit, version 3 and a type (SYN_STREAM, SYN_REPLY, RST_STREAM,
//! SETTINGS, PING, GOAWAY, HEADERS, WINDOW_UPDATE), data frames with a 31-bit stream id;
//! then 8 bits of flags (FIN = 1) and a 24-bit length. Header blocks (u32 pair count,
//! then u32-length-prefixed names and values) are zlib-compressed with the SPDY/3
//! dictionary, one continuous zlib stream per direction per connection, each block
//! ending in a sync flush.
//!
//! Port-forward semantics (kubelet `portforward/httpstream.go`): per forwarded
//! connection the client opens two streams with headers `streamtype: error|data`,
//! `port: N` and `requestid: R`; each gets a SYN_REPLY at once, and when both of a
//! request id are there the stand-in dials `127.0.0.1:N` inside the pod's netns and
//! splices the data stream both ways. A dial failure is written as text on the error
//! stream; both streams are then closed (FIN). The client's FIN on the data stream
//! half-closes the pod connection; the pod's EOF ends the data stream with FIN and
//! closes the error stream. A pair not complete within [`PAIR_TIMEOUT`] is dropped.
//!
//! Flow control: the stand-in tracks windows (64 KiB initial, SETTINGS
//! INITIAL_WINDOW_SIZE, WINDOW_UPDATE per stream and, as in 3.1, for the session on
//! stream 0) and sends WINDOW_UPDATEs as the pod consumes the client's bytes. It holds
//! back data for a spent window only once the client has shown it does flow control
//! (sent a WINDOW_UPDATE or the window setting): spdystream, the Go library behind
//! kubectl and the real kubelet, neither sends nor reads WINDOW_UPDATE, so a strict
//! sender would stall after 64 KiB (the real kubelet does not enforce windows either).
//! For the same reason a client that sends beyond its window is not reset.
//!
//! Errors: a malformed frame or header block ends the session with GOAWAY
//! (PROTOCOL_ERROR); a bad stream (even id, id not increasing, missing `port` or
//! `streamtype`) gets RST_STREAM. Nothing here panics on input.
//!
//! Pure parts: [`Frame`] ([`Frame::decode`], [`Frame::encode`]), [`HeaderBlock`],
//! [`HeaderCompressor`] / [`HeaderDecompressor`], [`negotiate`]. I/O: [`serve`] on an
//! upgraded connection (one reader loop, one writer task, one task per forwarded
//! connection).

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::sync::{Notify, mpsc};

use super::portforward::connect_in_netns;

/// The subprotocol served (`X-Stream-Protocol-Version`).
pub const PORT_FORWARD_PROTOCOL: &str = "portforward.k8s.io";
/// The `Upgrade` token.
pub const UPGRADE: &str = "SPDY/3.1";
/// Initial flow-control window of every stream and of the session (bytes).
pub const INITIAL_WINDOW: i64 = 64 * 1024;
/// How long the two streams of one request id may take to arrive (the kubelet's
/// default stream creation timeout).
pub const PAIR_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest control frame accepted (bytes): header blocks of port-forward streams are
/// tens of bytes, so 1 MiB only guards memory.
const MAX_CONTROL: usize = 1 << 20;
/// Largest decompressed header block (bytes).
const MAX_HEADER_BLOCK: usize = 1 << 20;
/// Bytes read from a pod connection per data frame.
const CHUNK: usize = 32 * 1024;
/// Pod bytes queued towards the client, over all streams, before pod reads wait: keeps
/// memory bounded when the client reads slower than pods write (spdystream clients
/// give no window to do that).
const QUEUED_MAX: usize = 1 << 20;
/// Data frames buffered per stream towards the pod before the reader waits.
const STREAM_QUEUE: usize = 64;

const VERSION: u16 = 3;
const FLAG_FIN: u8 = 0x01;
const FLAG_UNIDIRECTIONAL: u8 = 0x02;
const FLAG_CLEAR_SETTINGS: u8 = 0x01;
/// SETTINGS id of the initial window size.
const SETTINGS_INITIAL_WINDOW_SIZE: u32 = 7;

/// The SPDY/3 header compression dictionary (draft 3, section 2.6.10.1): the
/// u32-length-prefixed words below, then [`DICTIONARY_TAIL`] as is.
const DICTIONARY_WORDS: &[&str] = &[
    "options",
    "head",
    "post",
    "put",
    "delete",
    "trace",
    "accept",
    "accept-charset",
    "accept-encoding",
    "accept-language",
    "accept-ranges",
    "age",
    "allow",
    "authorization",
    "cache-control",
    "connection",
    "content-base",
    "content-encoding",
    "content-language",
    "content-length",
    "content-location",
    "content-md5",
    "content-range",
    "content-type",
    "date",
    "etag",
    "expect",
    "expires",
    "from",
    "host",
    "if-match",
    "if-modified-since",
    "if-none-match",
    "if-range",
    "if-unmodified-since",
    "last-modified",
    "location",
    "max-forwards",
    "pragma",
    "proxy-authenticate",
    "proxy-authorization",
    "range",
    "referer",
    "retry-after",
    "server",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "user-agent",
    "vary",
    "via",
    "warning",
    "www-authenticate",
    "method",
    "get",
    "status",
    "200 OK",
    "version",
    "HTTP/1.1",
    "url",
    "public",
    "set-cookie",
    "keep-alive",
    "origin",
];
const DICTIONARY_TAIL: &str = concat!(
    "100101201202205206300302303304305306307402405406407408409410411412413414415416417502504505",
    "203 Non-Authoritative Information",
    "204 No Content",
    "301 Moved Permanently",
    "400 Bad Request",
    "401 Unauthorized",
    "403 Forbidden",
    "404 Not Found",
    "500 Internal Server Error",
    "501 Not Implemented",
    "503 Service Unavailable",
    "Jan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec 00:00:00 ",
    "Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMT",
    "chunked,text/html,image/png,image/jpg,image/gif,application/xml,application/xhtml+xml,",
    "text/plain,text/javascript,publicprivatemax-age=gzip,deflate,sdch",
    "charset=utf-8charset=iso-8859-1,utf-,*,enq=0.",
);

/// The SPDY/3 header dictionary bytes.
pub fn dictionary() -> Vec<u8> {
    let mut d = Vec::with_capacity(1500);
    for w in DICTIONARY_WORDS {
        // Words are a few bytes long.
        d.extend_from_slice(&(w.len() as u32).to_be_bytes());
        d.extend_from_slice(w.as_bytes());
    }
    d.extend_from_slice(DICTIONARY_TAIL.as_bytes());
    d
}

/// Adler-32 (RFC 1950), the zlib dictionary id.
pub fn adler32(data: &[u8]) -> u32 {
    const MOD: u32 = 65521;
    let (mut a, mut b) = (1u32, 0u32);
    // 5552 bytes is the longest run whose sums cannot overflow u32 (RFC 1950 / zlib).
    for chunk in data.chunks(5552) {
        for &x in chunk {
            a += u32::from(x);
            b += a;
        }
        a %= MOD;
        b %= MOD;
    }
    (b << 16) | a
}

/// What went wrong on a SPDY connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpdyError {
    #[error("control frame with SPDY version {0} (only 3 is spoken)")]
    Version(u16),
    #[error("{kind} frame of {len} bytes is malformed: {why}")]
    Malformed {
        kind: &'static str,
        len: usize,
        why: &'static str,
    },
    #[error("control frame of {0} bytes exceeds the {MAX_CONTROL}-byte limit")]
    TooLarge(usize),
    #[error("header block: {0}")]
    HeaderBlock(String),
    #[error("header compression: {0}")]
    Zlib(String),
}

/// RST_STREAM status codes (draft 3, section 2.4.2).
pub mod rst {
    pub const PROTOCOL_ERROR: u32 = 1;
    pub const INVALID_STREAM: u32 = 2;
    pub const REFUSED_STREAM: u32 = 3;
    pub const CANCEL: u32 = 5;
    pub const INTERNAL_ERROR: u32 = 6;
    pub const FLOW_CONTROL_ERROR: u32 = 7;
}

/// GOAWAY status codes.
pub mod goaway {
    pub const OK: u32 = 0;
    pub const PROTOCOL_ERROR: u32 = 1;
}

/// One SPDY/3 frame. Header blocks stay compressed here: their zlib context belongs to
/// the connection ([`HeaderCompressor`], [`HeaderDecompressor`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Data {
        stream_id: u32,
        fin: bool,
        data: Vec<u8>,
    },
    SynStream {
        stream_id: u32,
        associated: u32,
        /// 0 (highest) ..= 7.
        priority: u8,
        fin: bool,
        unidirectional: bool,
        block: Vec<u8>,
    },
    SynReply {
        stream_id: u32,
        fin: bool,
        block: Vec<u8>,
    },
    RstStream {
        stream_id: u32,
        status: u32,
    },
    Settings {
        clear: bool,
        /// (flags, id, value).
        entries: Vec<(u8, u32, u32)>,
    },
    Ping {
        id: u32,
    },
    GoAway {
        last_good: u32,
        status: u32,
    },
    Headers {
        stream_id: u32,
        fin: bool,
        block: Vec<u8>,
    },
    WindowUpdate {
        stream_id: u32,
        delta: u32,
    },
    /// A control frame type this code does not know (to be ignored, per the draft).
    Unknown {
        kind: u16,
    },
}

fn be32(b: &[u8], at: usize) -> Option<u32> {
    b.get(at..at + 4)
        .map(|s| u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
}

const ID_MASK: u32 = 0x7fff_ffff;

impl Frame {
    /// Decodes one frame from the front of `buf`: Ok(None) when more bytes are needed,
    /// else the frame and the bytes it took.
    pub fn decode(buf: &[u8]) -> Result<Option<(Frame, usize)>, SpdyError> {
        if buf.len() < 8 {
            return Ok(None);
        }
        let word = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]);
        let flags = buf[4];
        let len = (usize::from(buf[5]) << 16) | (usize::from(buf[6]) << 8) | usize::from(buf[7]);
        let control = word & 0x8000_0000 != 0;
        if control && len > MAX_CONTROL {
            return Err(SpdyError::TooLarge(len));
        }
        if buf.len() < 8 + len {
            return Ok(None);
        }
        let p = &buf[8..8 + len];
        let fin = flags & FLAG_FIN != 0;
        if !control {
            let frame = Frame::Data {
                stream_id: word & ID_MASK,
                fin,
                data: p.to_vec(),
            };
            return Ok(Some((frame, 8 + len)));
        }
        let version = ((word >> 16) & 0x7fff) as u16;
        if version != VERSION {
            return Err(SpdyError::Version(version));
        }
        let kind = (word & 0xffff) as u16;
        let bad = |kind: &'static str, why: &'static str| SpdyError::Malformed { kind, len, why };
        let frame = match kind {
            1 => {
                if len < 10 {
                    return Err(bad("SYN_STREAM", "shorter than 10 bytes"));
                }
                Frame::SynStream {
                    stream_id: be32(p, 0).unwrap_or(0) & ID_MASK,
                    associated: be32(p, 4).unwrap_or(0) & ID_MASK,
                    priority: p[8] >> 5,
                    fin,
                    unidirectional: flags & FLAG_UNIDIRECTIONAL != 0,
                    block: p[10..].to_vec(),
                }
            }
            2 => {
                if len < 4 {
                    return Err(bad("SYN_REPLY", "shorter than 4 bytes"));
                }
                Frame::SynReply {
                    stream_id: be32(p, 0).unwrap_or(0) & ID_MASK,
                    fin,
                    block: p[4..].to_vec(),
                }
            }
            3 => {
                if len != 8 {
                    return Err(bad("RST_STREAM", "length is not 8"));
                }
                Frame::RstStream {
                    stream_id: be32(p, 0).unwrap_or(0) & ID_MASK,
                    status: be32(p, 4).unwrap_or(0),
                }
            }
            4 => {
                let n = be32(p, 0).ok_or_else(|| bad("SETTINGS", "no entry count"))? as usize;
                if len != 4 + 8 * n {
                    return Err(bad("SETTINGS", "length does not match the entry count"));
                }
                let entries = (0..n)
                    .filter_map(|i| {
                        let flag_id = be32(p, 4 + 8 * i)?;
                        let value = be32(p, 8 + 8 * i)?;
                        Some(((flag_id >> 24) as u8, flag_id & 0x00ff_ffff, value))
                    })
                    .collect();
                Frame::Settings {
                    clear: flags & FLAG_CLEAR_SETTINGS != 0,
                    entries,
                }
            }
            6 => {
                if len != 4 {
                    return Err(bad("PING", "length is not 4"));
                }
                Frame::Ping {
                    id: be32(p, 0).unwrap_or(0),
                }
            }
            7 => {
                if len != 8 {
                    return Err(bad("GOAWAY", "length is not 8"));
                }
                Frame::GoAway {
                    last_good: be32(p, 0).unwrap_or(0) & ID_MASK,
                    status: be32(p, 4).unwrap_or(0),
                }
            }
            8 => {
                if len < 4 {
                    return Err(bad("HEADERS", "shorter than 4 bytes"));
                }
                Frame::Headers {
                    stream_id: be32(p, 0).unwrap_or(0) & ID_MASK,
                    fin,
                    block: p[4..].to_vec(),
                }
            }
            9 => {
                if len != 8 {
                    return Err(bad("WINDOW_UPDATE", "length is not 8"));
                }
                Frame::WindowUpdate {
                    stream_id: be32(p, 0).unwrap_or(0) & ID_MASK,
                    delta: be32(p, 4).unwrap_or(0) & ID_MASK,
                }
            }
            other => Frame::Unknown { kind: other },
        };
        Ok(Some((frame, 8 + len)))
    }

    /// Appends the frame's bytes to `out`. Payloads longer than 2^24 - 1 bytes are not
    /// representable; callers keep data frames at [`CHUNK`] and header blocks small.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let control = |out: &mut Vec<u8>, kind: u16, flags: u8, payload: &[u8]| {
            out.extend_from_slice(&(0x8000 | VERSION).to_be_bytes());
            out.extend_from_slice(&kind.to_be_bytes());
            push_flags_len(out, flags, payload.len());
            out.extend_from_slice(payload);
        };
        let fin_flag = |fin: bool| if fin { FLAG_FIN } else { 0 };
        match self {
            Frame::Data {
                stream_id,
                fin,
                data,
            } => {
                out.extend_from_slice(&(stream_id & ID_MASK).to_be_bytes());
                push_flags_len(out, fin_flag(*fin), data.len());
                out.extend_from_slice(data);
            }
            Frame::SynStream {
                stream_id,
                associated,
                priority,
                fin,
                unidirectional,
                block,
            } => {
                let mut p = Vec::with_capacity(10 + block.len());
                p.extend_from_slice(&(stream_id & ID_MASK).to_be_bytes());
                p.extend_from_slice(&(associated & ID_MASK).to_be_bytes());
                p.push((priority & 7) << 5);
                p.push(0);
                p.extend_from_slice(block);
                let flags = fin_flag(*fin)
                    | if *unidirectional {
                        FLAG_UNIDIRECTIONAL
                    } else {
                        0
                    };
                control(out, 1, flags, &p);
            }
            Frame::SynReply {
                stream_id,
                fin,
                block,
            } => {
                let mut p = (stream_id & ID_MASK).to_be_bytes().to_vec();
                p.extend_from_slice(block);
                control(out, 2, fin_flag(*fin), &p);
            }
            Frame::RstStream { stream_id, status } => {
                let mut p = (stream_id & ID_MASK).to_be_bytes().to_vec();
                p.extend_from_slice(&status.to_be_bytes());
                control(out, 3, 0, &p);
            }
            Frame::Settings { clear, entries } => {
                // A SETTINGS frame holds a handful of entries.
                let mut p = (entries.len() as u32).to_be_bytes().to_vec();
                for (flags, id, value) in entries {
                    p.extend_from_slice(
                        &((u32::from(*flags) << 24) | (id & 0x00ff_ffff)).to_be_bytes(),
                    );
                    p.extend_from_slice(&value.to_be_bytes());
                }
                control(out, 4, if *clear { FLAG_CLEAR_SETTINGS } else { 0 }, &p);
            }
            Frame::Ping { id } => control(out, 6, 0, &id.to_be_bytes()),
            Frame::GoAway { last_good, status } => {
                let mut p = (last_good & ID_MASK).to_be_bytes().to_vec();
                p.extend_from_slice(&status.to_be_bytes());
                control(out, 7, 0, &p);
            }
            Frame::Headers {
                stream_id,
                fin,
                block,
            } => {
                let mut p = (stream_id & ID_MASK).to_be_bytes().to_vec();
                p.extend_from_slice(block);
                control(out, 8, fin_flag(*fin), &p);
            }
            Frame::WindowUpdate { stream_id, delta } => {
                let mut p = (stream_id & ID_MASK).to_be_bytes().to_vec();
                p.extend_from_slice(&(delta & ID_MASK).to_be_bytes());
                control(out, 9, 0, &p);
            }
            Frame::Unknown { kind } => control(out, *kind, 0, &[]),
        }
    }
}

fn push_flags_len(out: &mut Vec<u8>, flags: u8, len: usize) {
    let len = len.min(0x00ff_ffff) as u32;
    out.extend_from_slice(&((u32::from(flags) << 24) | len).to_be_bytes());
}

/// An uncompressed name/value header block (draft 3, section 2.6.10): names are
/// lowercase, a value may hold several values separated by NUL.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderBlock(pub Vec<(String, String)>);

impl HeaderBlock {
    /// The first value of `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.split('\0').next().unwrap_or(""))
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        // Header blocks built here hold a few short strings.
        out.extend_from_slice(&(self.0.len() as u32).to_be_bytes());
        for (k, v) in &self.0 {
            out.extend_from_slice(&(k.len() as u32).to_be_bytes());
            out.extend_from_slice(k.as_bytes());
            out.extend_from_slice(&(v.len() as u32).to_be_bytes());
            out.extend_from_slice(v.as_bytes());
        }
        out
    }

    pub fn decode(raw: &[u8]) -> Result<HeaderBlock, SpdyError> {
        let err = |m: &str| SpdyError::HeaderBlock(m.to_owned());
        let n = be32(raw, 0).ok_or_else(|| err("no pair count"))? as usize;
        // Each pair takes at least 8 bytes: refuse counts the block cannot hold.
        if n > raw.len() / 8 {
            return Err(err("pair count exceeds the block"));
        }
        let mut at = 4usize;
        let mut take = |what: &str| -> Result<String, SpdyError> {
            let len = be32(raw, at).ok_or_else(|| err(what))? as usize;
            let start = at + 4;
            let end = start
                .checked_add(len)
                .filter(|e| *e <= raw.len())
                .ok_or_else(|| err(what))?;
            at = end;
            String::from_utf8(raw[start..end].to_vec()).map_err(|_| err("not UTF-8"))
        };
        let mut pairs = Vec::with_capacity(n);
        for _ in 0..n {
            let name = take("truncated name")?;
            if name.is_empty() {
                return Err(err("empty header name"));
            }
            if name.bytes().any(|b| b.is_ascii_uppercase()) {
                return Err(err("header name not lowercase"));
            }
            let value = take("truncated value")?;
            pairs.push((name, value));
        }
        Ok(HeaderBlock(pairs))
    }
}

/// The sending side's header compression: one raw-deflate context for the
/// connection with the SPDY dictionary preset, behind a zlib header naming it; each
/// block ends in a sync flush so the peer can decode it alone.
pub struct HeaderCompressor {
    z: Compress,
    header_sent: bool,
    dict_id: u32,
}

impl Default for HeaderCompressor {
    fn default() -> Self {
        Self::new()
    }
}

impl HeaderCompressor {
    pub fn new() -> Self {
        let dict = dictionary();
        let mut z = Compress::new(Compression::best(), false);
        // Raw deflate accepts a dictionary before any input; the call cannot fail then.
        let _ = z.set_dictionary(&dict);
        HeaderCompressor {
            z,
            header_sent: false,
            dict_id: adler32(&dict),
        }
    }

    pub fn compress(&mut self, block: &HeaderBlock) -> Result<Vec<u8>, SpdyError> {
        let raw = block.encode();
        let mut out = Vec::with_capacity(raw.len() + 64);
        if !self.header_sent {
            // CMF 0x78 (deflate, 32 KiB window); FLG: level 3 (best), FDICT, check bits.
            out.extend_from_slice(&[0x78, 0xf9]);
            out.extend_from_slice(&self.dict_id.to_be_bytes());
            self.header_sent = true;
        }
        let mut input = &raw[..];
        loop {
            out.reserve(256);
            let before_in = self.z.total_in();
            self.z
                .compress_vec(input, &mut out, FlushCompress::Sync)
                .map_err(|e| SpdyError::Zlib(e.to_string()))?;
            let used = (self.z.total_in() - before_in) as usize;
            input = &input[used..];
            // Done when all input is in and the flush left spare room in `out`.
            if input.is_empty() && out.len() < out.capacity() {
                return Ok(out);
            }
        }
    }
}

/// The receiving side's header decompression, the mirror of [`HeaderCompressor`]:
/// checks the zlib header and dictionary id on the first block, then inflates each
/// block with the connection's context.
pub struct HeaderDecompressor {
    z: Decompress,
    /// Bytes of the zlib header still to skip (2, + 4 with FDICT) — parsed on the
    /// first block.
    header_done: bool,
    dict_id: u32,
}

impl Default for HeaderDecompressor {
    fn default() -> Self {
        Self::new()
    }
}

impl HeaderDecompressor {
    pub fn new() -> Self {
        let dict = dictionary();
        let mut z = Decompress::new(false);
        // Raw inflate takes a dictionary at any time before data; cannot fail here.
        let _ = z.set_dictionary(&dict);
        HeaderDecompressor {
            z,
            header_done: false,
            dict_id: adler32(&dict),
        }
    }

    pub fn decompress(&mut self, compressed: &[u8]) -> Result<HeaderBlock, SpdyError> {
        let zerr = |m: String| SpdyError::Zlib(m);
        let mut input = compressed;
        if !self.header_done {
            let (cmf, flg) = match input {
                [a, b, ..] => (*a, *b),
                _ => return Err(zerr("zlib header missing".into())),
            };
            if cmf & 0x0f != 8 || (u16::from(cmf) * 256 + u16::from(flg)) % 31 != 0 {
                return Err(zerr(format!("bad zlib header {cmf:02x} {flg:02x}")));
            }
            input = &input[2..];
            if flg & 0x20 != 0 {
                let id = be32(input, 0).ok_or_else(|| zerr("dictionary id missing".into()))?;
                if id != self.dict_id {
                    return Err(zerr(format!(
                        "peer compresses with dictionary {id:08x}, not SPDY/3's {:08x}",
                        self.dict_id
                    )));
                }
                input = &input[4..];
            }
            self.header_done = true;
        }
        let mut out = Vec::with_capacity(256);
        loop {
            if out.len() >= MAX_HEADER_BLOCK {
                return Err(SpdyError::HeaderBlock("larger than 1 MiB".into()));
            }
            out.reserve(1024);
            let before_in = self.z.total_in();
            let status = self
                .z
                .decompress_vec(input, &mut out, FlushDecompress::Sync)
                .map_err(|e| zerr(e.to_string()))?;
            let used = (self.z.total_in() - before_in) as usize;
            input = &input[used..];
            if matches!(status, Status::StreamEnd) {
                return Err(zerr("peer ended its header zlib stream".into()));
            }
            if input.is_empty() && out.len() < out.capacity() {
                break;
            }
            if used == 0 && out.len() < out.capacity() {
                return Err(zerr("inflate made no progress".into()));
            }
        }
        HeaderBlock::decode(&out)
    }
}

/// The upgrade decision for a request's `X-Stream-Protocol-Version` values (every
/// header line, each possibly a comma list): Ok(protocol) to answer with, Err(the
/// offered list) when none is served. No header at all is a legacy client: served.
pub fn negotiate<'a>(offered: impl IntoIterator<Item = &'a str>) -> Result<&'static str, String> {
    let offered: Vec<&str> = offered
        .into_iter()
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .collect();
    if offered.is_empty() || offered.contains(&PORT_FORWARD_PROTOCOL) {
        Ok(PORT_FORWARD_PROTOCOL)
    } else {
        Err(offered.join(", "))
    }
}

/// The 101 response of an accepted upgrade.
pub fn upgrade_response(protocol: &str) -> String {
    format!(
        "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: {UPGRADE}\r\nX-Stream-Protocol-Version: {protocol}\r\n\r\n"
    )
}

// ---------------------------------------------------------------------------------
// The I/O shell.

/// A send window shared by the reader loop (WINDOW_UPDATE, SETTINGS) and a sender.
struct SendWindow {
    bytes: std::sync::Mutex<i64>,
    notify: Notify,
}

impl SendWindow {
    fn new(initial: i64) -> Arc<Self> {
        Arc::new(SendWindow {
            bytes: std::sync::Mutex::new(initial),
            notify: Notify::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, i64> {
        // Only integers live under the lock; a poisoned one is still consistent.
        self.bytes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn add(&self, delta: i64) {
        *self.lock() += delta;
        self.notify.notify_waiters();
    }

    fn available(&self) -> i64 {
        *self.lock()
    }

    fn take(&self, n: usize) {
        *self.lock() -= n as i64;
    }
}

/// Frames towards the client, in order. SYN_REPLY header blocks are compressed by
/// the writer, which owns the sending zlib context.
enum Out {
    Frame(Frame),
    /// Pod bytes: `n` bytes of [`Flow::queued`] go back once written.
    PodData(Frame, usize),
    SynReply {
        stream_id: u32,
    },
    /// Write everything queued so far, then close the connection.
    Close,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StreamType {
    Data,
    Error,
}

struct StreamState {
    kind: StreamType,
    request_id: String,
    /// Client bytes towards the pod (data streams, until the client's FIN).
    to_pod: Option<mpsc::Sender<Vec<u8>>>,
    /// Our send window on this stream.
    window: Arc<SendWindow>,
    /// Set once the pair's forwarding task runs.
    paired: bool,
}

#[derive(Default)]
struct Pair {
    port: u16,
    data: Option<u32>,
    error: Option<u32>,
    to_pod_rx: Option<mpsc::Receiver<Vec<u8>>>,
    timer: Option<tokio::task::JoinHandle<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// What the pod-side tasks tell the reader loop.
enum Event {
    PairTimeout(String),
    PairDone(String),
}

/// Connection-wide flow-control state.
struct Flow {
    /// True once the client has shown it does flow control.
    enforced: AtomicBool,
    session: Arc<SendWindow>,
    /// Budget of pod bytes queued for the writer ([`QUEUED_MAX`]).
    queued: Arc<tokio::sync::Semaphore>,
}

/// Serves one upgraded SPDY port-forward connection. `already_read` holds bytes that
/// came after the request head. `netns` is the pod's netns, `what` names the pod in
/// error messages (`<namespace>/<name>, uid <uid>`).
pub async fn serve<S>(io: S, already_read: Vec<u8>, netns: String, what: String)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let dial: Dial = Arc::new(move |port| {
        let netns = netns.clone();
        Box::pin(async move {
            connect_in_netns(&netns, SocketAddr::from((Ipv4Addr::LOCALHOST, port))).await
        })
    });
    serve_with(io, already_read, dial, what).await;
}

/// How a forwarded connection reaches the pod's port (the netns dial in [`serve`]; a
/// plain loopback dial in tests).
type Dial = Arc<
    dyn Fn(
            u16,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = std::io::Result<tokio::net::TcpStream>> + Send>,
        > + Send
        + Sync,
>;

async fn serve_with<S>(io: S, already_read: Vec<u8>, dial: Dial, what: String)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut rd, wr) = tokio::io::split(io);
    let (out_tx, out_rx) = mpsc::unbounded_channel::<Out>();
    let queued = Arc::new(tokio::sync::Semaphore::new(QUEUED_MAX));
    let writer = tokio::spawn(write_loop(wr, out_rx, queued.clone()));
    let (event_tx, mut event_rx) = mpsc::unbounded_channel::<Event>();
    let flow = Arc::new(Flow {
        enforced: AtomicBool::new(false),
        session: SendWindow::new(INITIAL_WINDOW),
        queued,
    });
    let mut conn = Conn {
        dial,
        what,
        out_tx: out_tx.clone(),
        event_tx,
        flow,
        inflate: HeaderDecompressor::new(),
        streams: HashMap::new(),
        pairs: HashMap::new(),
        last_stream: 0,
        initial_window: INITIAL_WINDOW,
        going_away: false,
    };
    let mut buf = already_read;
    let mut chunk = vec![0u8; 64 * 1024];
    'session: loop {
        // Handle every complete frame in the buffer.
        let mut at = 0;
        loop {
            match Frame::decode(&buf[at..]) {
                Ok(Some((frame, used))) => {
                    at += used;
                    if let Err(e) = conn.handle(frame).await {
                        tracing::debug!(error = %e, "SPDY port-forward: protocol error, GOAWAY");
                        conn.go_away(goaway::PROTOCOL_ERROR);
                        break 'session;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::debug!(error = %e, "SPDY port-forward: bad frame, GOAWAY");
                    conn.go_away(goaway::PROTOCOL_ERROR);
                    break 'session;
                }
            }
        }
        buf.drain(..at);
        tokio::select! {
            n = rd.read(&mut chunk) => match n {
                Ok(0) | Err(_) => break,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            },
            Some(ev) = event_rx.recv() => conn.event(ev),
        }
    }
    conn.shutdown();
    let _ = out_tx.send(Out::Close);
    drop(out_tx);
    drop(conn);
    let _ = tokio::time::timeout(Duration::from_secs(5), writer).await;
}

async fn write_loop<W: AsyncWrite + Unpin>(
    mut wr: W,
    mut out_rx: mpsc::UnboundedReceiver<Out>,
    queued: Arc<tokio::sync::Semaphore>,
) {
    let mut deflate = HeaderCompressor::new();
    let mut bytes = Vec::with_capacity(CHUNK + 64);
    while let Some(first) = out_rx.recv().await {
        let mut next = Some(first);
        let mut close = false;
        let mut budget = 0usize;
        // Batch what is queued into one write.
        while let Some(out) = next.take() {
            match out {
                Out::Frame(f) => f.encode(&mut bytes),
                Out::PodData(f, n) => {
                    f.encode(&mut bytes);
                    budget += n;
                }
                Out::SynReply { stream_id } => match deflate.compress(&HeaderBlock::default()) {
                    Ok(block) => Frame::SynReply {
                        stream_id,
                        fin: false,
                        block,
                    }
                    .encode(&mut bytes),
                    Err(e) => {
                        tracing::warn!(error = %e, "SPDY header compression failed");
                        close = true;
                    }
                },
                Out::Close => close = true,
            }
            if bytes.len() < 256 * 1024 {
                next = out_rx.try_recv().ok();
            }
        }
        if wr.write_all(&bytes).await.is_err() || wr.flush().await.is_err() {
            return;
        }
        queued.add_permits(budget);
        bytes.clear();
        if close {
            let _ = wr.shutdown().await;
            return;
        }
    }
    let _ = wr.shutdown().await;
}

struct Conn {
    dial: Dial,
    what: String,
    out_tx: mpsc::UnboundedSender<Out>,
    event_tx: mpsc::UnboundedSender<Event>,
    flow: Arc<Flow>,
    inflate: HeaderDecompressor,
    streams: HashMap<u32, StreamState>,
    pairs: HashMap<String, Pair>,
    last_stream: u32,
    initial_window: i64,
    going_away: bool,
}

impl Conn {
    fn send(&self, f: Frame) {
        let _ = self.out_tx.send(Out::Frame(f));
    }

    fn rst(&self, stream_id: u32, status: u32) {
        self.send(Frame::RstStream { stream_id, status });
    }

    fn go_away(&self, status: u32) {
        self.send(Frame::GoAway {
            last_good: self.last_stream,
            status,
        });
    }

    async fn handle(&mut self, frame: Frame) -> Result<(), SpdyError> {
        match frame {
            Frame::SynStream {
                stream_id,
                fin,
                block,
                ..
            } => {
                // Always inflate: the zlib context must see every block.
                let headers = self.inflate.decompress(&block)?;
                self.syn_stream(stream_id, fin, &headers);
            }
            Frame::SynReply { block, .. } | Frame::Headers { block, .. } => {
                // We open no streams and take no trailers; keep the context in step.
                self.inflate.decompress(&block)?;
            }
            Frame::Data {
                stream_id,
                fin,
                data,
            } => self.data(stream_id, fin, data).await,
            Frame::RstStream { stream_id, status } => {
                tracing::debug!(
                    stream_id,
                    status,
                    "SPDY port-forward: client reset a stream"
                );
                self.reset_pair_of(stream_id);
            }
            Frame::Settings { entries, .. } => {
                for (_, id, value) in entries {
                    if id == SETTINGS_INITIAL_WINDOW_SIZE {
                        let value = i64::from(value & ID_MASK);
                        let delta = value - self.initial_window;
                        self.initial_window = value;
                        for s in self.streams.values() {
                            s.window.add(delta);
                        }
                        self.flow.enforced.store(true, Ordering::Relaxed);
                    }
                }
            }
            Frame::Ping { id } => {
                // Client pings are odd; echo them. Even ids would be our own.
                if !id.is_multiple_of(2) {
                    self.send(Frame::Ping { id });
                }
            }
            Frame::GoAway { .. } => {
                self.going_away = true;
            }
            Frame::WindowUpdate { stream_id, delta } => {
                self.flow.enforced.store(true, Ordering::Relaxed);
                if stream_id == 0 {
                    self.flow.session.add(i64::from(delta));
                } else if let Some(s) = self.streams.get(&stream_id) {
                    s.window.add(i64::from(delta));
                }
            }
            Frame::Unknown { kind } => {
                tracing::debug!(kind, "SPDY port-forward: ignoring an unknown control frame");
            }
        }
        Ok(())
    }

    fn syn_stream(&mut self, stream_id: u32, fin: bool, headers: &HeaderBlock) {
        if self.going_away {
            self.rst(stream_id, rst::REFUSED_STREAM);
            return;
        }
        if stream_id.is_multiple_of(2) || stream_id <= self.last_stream {
            self.rst(stream_id, rst::PROTOCOL_ERROR);
            return;
        }
        self.last_stream = stream_id;
        let kind = match headers.get("streamtype") {
            Some("data") => StreamType::Data,
            Some("error") => StreamType::Error,
            other => {
                tracing::debug!(stream_id, ?other, "SPDY port-forward: bad streamtype");
                self.rst(stream_id, rst::REFUSED_STREAM);
                return;
            }
        };
        let port = match headers.get("port").map(|p| p.trim().parse::<u16>()) {
            Some(Ok(p)) if p > 0 => p,
            other => {
                tracing::debug!(stream_id, ?other, "SPDY port-forward: bad port header");
                self.rst(stream_id, rst::REFUSED_STREAM);
                return;
            }
        };
        // Old clients send no request id: the kubelet pairs by stream ids then (the
        // error stream is opened first, the data stream two ids later).
        let request_id = match headers.get("requestid") {
            Some(r) if !r.is_empty() => r.to_owned(),
            _ => match kind {
                StreamType::Error => stream_id.to_string(),
                StreamType::Data => stream_id.saturating_sub(2).to_string(),
            },
        };
        let _ = self.out_tx.send(Out::SynReply { stream_id });
        let pair = self.pairs.entry(request_id.clone()).or_default();
        let slot = match kind {
            StreamType::Data => &mut pair.data,
            StreamType::Error => &mut pair.error,
        };
        if slot.is_some() {
            // A second stream of the same type for one request: refuse it.
            self.rst(stream_id, rst::PROTOCOL_ERROR);
            return;
        }
        *slot = Some(stream_id);
        pair.port = port;
        let mut to_pod = None;
        if kind == StreamType::Data && !fin {
            let (tx, rx) = mpsc::channel(STREAM_QUEUE);
            to_pod = Some(tx);
            pair.to_pod_rx = Some(rx);
        }
        self.streams.insert(
            stream_id,
            StreamState {
                kind,
                request_id: request_id.clone(),
                to_pod,
                window: SendWindow::new(self.initial_window),
                paired: false,
            },
        );
        tracing::debug!(stream_id, port, %request_id, ?kind, "SPDY port-forward: stream");
        let complete = pair.data.is_some() && pair.error.is_some();
        if complete {
            if let Some(t) = pair.timer.take() {
                t.abort();
            }
            self.start_pair(&request_id);
        } else if pair.timer.is_none() {
            let tx = self.event_tx.clone();
            let id = request_id.clone();
            pair.timer = Some(tokio::spawn(async move {
                tokio::time::sleep(PAIR_TIMEOUT).await;
                let _ = tx.send(Event::PairTimeout(id));
            }));
        }
    }

    fn start_pair(&mut self, request_id: &str) {
        let Some(pair) = self.pairs.get_mut(request_id) else {
            return;
        };
        let (Some(data_id), Some(error_id)) = (pair.data, pair.error) else {
            return;
        };
        let Some(data_window) = self.streams.get_mut(&data_id).map(|s| {
            s.paired = true;
            s.window.clone()
        }) else {
            return;
        };
        if let Some(s) = self.streams.get_mut(&error_id) {
            s.paired = true;
        }
        let job = Forward {
            dial: self.dial.clone(),
            what: self.what.clone(),
            port: pair.port,
            data_id,
            error_id,
            to_pod_rx: pair.to_pod_rx.take(),
            data_window,
            flow: self.flow.clone(),
            out_tx: self.out_tx.clone(),
        };
        let tx = self.event_tx.clone();
        let id = request_id.to_owned();
        pair.task = Some(tokio::spawn(async move {
            job.run().await;
            let _ = tx.send(Event::PairDone(id));
        }));
    }

    async fn data(&mut self, stream_id: u32, fin: bool, data: Vec<u8>) {
        let Some(s) = self.streams.get_mut(&stream_id) else {
            // Late frames of a stream we already closed are dropped quietly when
            // empty; data on a stream never opened is an error for that stream.
            if stream_id > self.last_stream || !data.is_empty() && !fin {
                self.rst(stream_id, rst::INVALID_STREAM);
            }
            return;
        };
        if s.kind == StreamType::Error {
            // The client only ever closes its side of the error stream.
            return;
        }
        if !data.is_empty() {
            match &s.to_pod {
                Some(tx) if s.paired => {
                    // Back-pressure: wait while the pod is slow (as spdystream does).
                    if tx.send(data).await.is_err() {
                        s.to_pod = None;
                    }
                }
                Some(tx) => {
                    if tx.try_send(data).is_err() {
                        // Too much data before the error stream came: refuse.
                        let id = s.request_id.clone();
                        self.rst(stream_id, rst::FLOW_CONTROL_ERROR);
                        self.drop_pair(&id);
                        return;
                    }
                }
                None => {
                    // Data after the client's FIN, or the pod is gone.
                    self.rst(stream_id, rst::INVALID_STREAM);
                    return;
                }
            }
        }
        if fin && let Some(s) = self.streams.get_mut(&stream_id) {
            s.to_pod = None;
        }
    }

    fn reset_pair_of(&mut self, stream_id: u32) {
        if let Some(id) = self.streams.get(&stream_id).map(|s| s.request_id.clone()) {
            self.drop_pair(&id);
        }
    }

    /// Forgets a pair and its streams, stopping its pod connection.
    fn drop_pair(&mut self, request_id: &str) {
        if let Some(p) = self.pairs.remove(request_id) {
            for h in [p.timer, p.task].into_iter().flatten() {
                h.abort();
            }
            for id in [p.data, p.error].into_iter().flatten() {
                self.streams.remove(&id);
            }
        }
    }

    fn event(&mut self, ev: Event) {
        match ev {
            Event::PairTimeout(id) => {
                let Some(p) = self.pairs.get(&id) else { return };
                if p.task.is_some() {
                    return;
                }
                tracing::debug!(request_id = %id, "SPDY port-forward: pair timed out");
                if let Some(error_id) = p.error {
                    self.send(Frame::Data {
                        stream_id: error_id,
                        fin: true,
                        data: format!(
                            "timed out waiting for the data and error streams of request {id}"
                        )
                        .into_bytes(),
                    });
                }
                for sid in [p.data, p.error].into_iter().flatten() {
                    self.rst(sid, rst::CANCEL);
                }
                self.drop_pair(&id);
            }
            Event::PairDone(id) => {
                if let Some(p) = self.pairs.remove(&id) {
                    for sid in [p.data, p.error].into_iter().flatten() {
                        self.streams.remove(&sid);
                    }
                }
            }
        }
    }

    fn shutdown(&mut self) {
        let ids: Vec<String> = self.pairs.keys().cloned().collect();
        for id in ids {
            self.drop_pair(&id);
        }
    }
}

/// One forwarded connection: the pod side of a (data, error) stream pair.
struct Forward {
    dial: Dial,
    what: String,
    port: u16,
    data_id: u32,
    error_id: u32,
    to_pod_rx: Option<mpsc::Receiver<Vec<u8>>>,
    data_window: Arc<SendWindow>,
    flow: Arc<Flow>,
    out_tx: mpsc::UnboundedSender<Out>,
}

impl Forward {
    fn send(&self, f: Frame) -> bool {
        self.out_tx.send(Out::Frame(f)).is_ok()
    }

    fn fin(&self, stream_id: u32) {
        self.send(Frame::Data {
            stream_id,
            fin: true,
            data: Vec::new(),
        });
    }

    async fn run(mut self) {
        let tcp = match (self.dial)(self.port).await {
            Ok(t) => t,
            Err(e) => {
                let reason = match e.kind() {
                    std::io::ErrorKind::ConnectionRefused => "connection refused".to_owned(),
                    _ => e.to_string(),
                };
                let msg = format!(
                    "error forwarding port {} to pod {}: dial tcp4 127.0.0.1:{}: connect: {reason}",
                    self.port, self.what, self.port
                );
                tracing::debug!(%msg, "SPDY port-forward: dial failed");
                self.send(Frame::Data {
                    stream_id: self.error_id,
                    fin: true,
                    data: msg.into_bytes(),
                });
                self.fin(self.data_id);
                return;
            }
        };
        let _ = tcp.set_nodelay(true);
        let (mut pod_rd, mut pod_wr) = tcp.into_split();
        // Client → pod, acknowledging consumed bytes with WINDOW_UPDATEs.
        let upload = {
            let rx = self.to_pod_rx.take();
            let out_tx = self.out_tx.clone();
            let data_id = self.data_id;
            tokio::spawn(async move {
                if let Some(mut rx) = rx {
                    while let Some(bytes) = rx.recv().await {
                        if pod_wr.write_all(&bytes).await.is_err() {
                            return;
                        }
                        // Chunks are at most 2^24 bytes (one data frame).
                        let delta = bytes.len() as u32;
                        for stream_id in [data_id, 0] {
                            let _ =
                                out_tx.send(Out::Frame(Frame::WindowUpdate { stream_id, delta }));
                        }
                    }
                }
                // The client's FIN: half-close towards the pod.
                let _ = pod_wr.shutdown().await;
            })
        };
        // Pod → client within the send windows.
        let mut buf = vec![0u8; CHUNK];
        loop {
            let limit = if self.flow.enforced.load(Ordering::Relaxed) {
                match self.wait_window().await {
                    Some(n) => n,
                    None => break,
                }
            } else {
                CHUNK
            };
            match pod_rd.read(&mut buf[..limit.min(CHUNK)]).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    self.data_window.take(n);
                    self.flow.session.take(n);
                    // n ≤ CHUNK, far below u32::MAX; the semaphore is never closed.
                    if let Ok(permit) = self.flow.queued.acquire_many(n as u32).await {
                        permit.forget();
                    }
                    let frame = Frame::Data {
                        stream_id: self.data_id,
                        fin: false,
                        data: buf[..n].to_vec(),
                    };
                    if self.out_tx.send(Out::PodData(frame, n)).is_err() {
                        upload.abort();
                        return;
                    }
                }
            }
        }
        self.fin(self.data_id);
        self.fin(self.error_id);
        // Let the upload finish what the client already sent, but not forever.
        let _ = tokio::time::timeout(Duration::from_secs(5), upload).await;
    }

    /// Waits until both the stream's and the session's windows are open; returns how
    /// many bytes may be sent.
    async fn wait_window(&self) -> Option<usize> {
        loop {
            let stream_wait = self.data_window.notify.notified();
            let session_wait = self.flow.session.notify.notified();
            let n = self
                .data_window
                .available()
                .min(self.flow.session.available());
            if n > 0 {
                return usize::try_from(n).ok();
            }
            tokio::select! {
                _ = stream_wait => {}
                _ = session_wait => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port_forward_headers(kind: &str, port: u16, request: &str) -> HeaderBlock {
        HeaderBlock(vec![
            ("streamtype".into(), kind.into()),
            ("port".into(), port.to_string()),
            ("requestid".into(), request.into()),
        ])
    }

    #[test]
    fn dictionary_is_spdy3() {
        let d = dictionary();
        // Draft 3's dictionary: 1423 bytes, starting with the length-prefixed
        // "options" and ending with "enq=0.".
        assert_eq!(d.len(), 1423);
        assert_eq!(&d[..11], b"\x00\x00\x00\x07options");
        assert!(d.ends_with(b",*,enq=0."));
    }

    #[test]
    fn adler32_matches_rfc1950_examples() {
        assert_eq!(adler32(b""), 1);
        assert_eq!(adler32(b"Wikipedia"), 0x11e6_0398);
        let big = vec![0xffu8; 100_000];
        // Reference computed the slow way (mod after every byte).
        let (mut a, mut b) = (1u64, 0u64);
        for &x in &big {
            a = (a + u64::from(x)) % 65521;
            b = (b + a) % 65521;
        }
        assert_eq!(adler32(&big), ((b << 16) | a) as u32);
    }

    #[test]
    fn frames_round_trip() {
        let frames = vec![
            Frame::Data {
                stream_id: 5,
                fin: true,
                data: b"hello".to_vec(),
            },
            Frame::Data {
                stream_id: 0x7fff_ffff,
                fin: false,
                data: vec![],
            },
            Frame::SynStream {
                stream_id: 1,
                associated: 0,
                priority: 7,
                fin: false,
                unidirectional: true,
                block: vec![1, 2, 3],
            },
            Frame::SynReply {
                stream_id: 3,
                fin: true,
                block: vec![9],
            },
            Frame::RstStream {
                stream_id: 3,
                status: rst::CANCEL,
            },
            Frame::Settings {
                clear: true,
                entries: vec![(1, SETTINGS_INITIAL_WINDOW_SIZE, 1 << 20), (0, 4, 100)],
            },
            Frame::Ping { id: 7 },
            Frame::GoAway {
                last_good: 9,
                status: goaway::PROTOCOL_ERROR,
            },
            Frame::Headers {
                stream_id: 11,
                fin: false,
                block: vec![],
            },
            Frame::WindowUpdate {
                stream_id: 0,
                delta: 65536,
            },
        ];
        let mut wire = Vec::new();
        for f in &frames {
            f.encode(&mut wire);
        }
        // Fed whole, and byte by byte (needs-more until complete).
        let mut at = 0;
        for f in &frames {
            for cut in 0..8 {
                assert_eq!(Frame::decode(&wire[at..at + cut]), Ok(None));
            }
            let (got, used) = Frame::decode(&wire[at..]).expect("ok").expect("complete");
            assert_eq!(&got, f);
            at += used;
        }
        assert_eq!(at, wire.len());
    }

    #[test]
    fn control_frame_layout_is_the_drafts() {
        let mut wire = Vec::new();
        Frame::Ping { id: 0x0102_0304 }.encode(&mut wire);
        assert_eq!(
            wire,
            [0x80, 0x03, 0x00, 0x06, 0x00, 0x00, 0x00, 0x04, 1, 2, 3, 4]
        );
        wire.clear();
        Frame::Data {
            stream_id: 3,
            fin: true,
            data: b"ab".to_vec(),
        }
        .encode(&mut wire);
        assert_eq!(wire, [0, 0, 0, 3, 0x01, 0, 0, 2, b'a', b'b']);
        // Unknown control types are reported, not refused.
        let unknown = [0x80, 0x03, 0x00, 0x0a, 0, 0, 0, 0];
        assert_eq!(
            Frame::decode(&unknown),
            Ok(Some((Frame::Unknown { kind: 10 }, 8)))
        );
    }

    #[test]
    fn malformed_frames_are_errors() {
        // SPDY/2 control frame.
        assert_eq!(
            Frame::decode(&[0x80, 0x02, 0x00, 0x06, 0, 0, 0, 4, 0, 0, 0, 1]),
            Err(SpdyError::Version(2))
        );
        // PING with a 3-byte payload.
        assert!(Frame::decode(&[0x80, 0x03, 0x00, 0x06, 0, 0, 0, 3, 0, 0, 1]).is_err());
        // SETTINGS claiming 1000 entries in 12 bytes.
        assert!(
            Frame::decode(&[
                0x80, 0x03, 0x00, 0x04, 0, 0, 0, 12, 0, 0, 0x03, 0xe8, 0, 0, 0, 7, 0, 0, 0, 1
            ])
            .is_err()
        );
        // A 16 MiB control frame is refused before it is buffered.
        assert_eq!(
            Frame::decode(&[0x80, 0x03, 0x00, 0x01, 0, 0xff, 0xff, 0xff]),
            Err(SpdyError::TooLarge(0xff_ffff))
        );
    }

    #[test]
    fn header_blocks_round_trip_through_one_zlib_context() {
        let mut tx = HeaderCompressor::new();
        let mut rx = HeaderDecompressor::new();
        let blocks = [
            port_forward_headers("error", 8080, "0"),
            port_forward_headers("data", 8080, "0"),
            HeaderBlock::default(),
            port_forward_headers("data", 7007, "1"),
            HeaderBlock(vec![("x".into(), "a\0b".into())]),
        ];
        let mut sizes = Vec::new();
        for b in &blocks {
            let wire = tx.compress(b).expect("compress");
            sizes.push(wire.len());
            // Each block ends in a sync flush marker.
            assert!(wire.ends_with(&[0, 0, 0xff, 0xff]), "{wire:02x?}");
            assert_eq!(&rx.decompress(&wire).expect("decompress"), b);
        }
        // The first block carries the zlib header and dictionary id.
        let first = HeaderCompressor::new()
            .compress(&blocks[0])
            .expect("compress");
        assert_eq!(&first[..2], &[0x78, 0xf9]);
        assert_eq!(first[2..6], adler32(&dictionary()).to_be_bytes());
        // The shared context makes the repeated block cheaper the second time.
        assert!(sizes[1] < sizes[0], "{sizes:?}");
        assert_eq!(blocks[4].get("x"), Some("a"));
    }

    #[test]
    fn a_constructed_syn_stream_decodes() {
        // What kubectl sends for its first forwarded connection: the error stream,
        // id 1, priority 0, headers compressed with a fresh context.
        let mut tx = HeaderCompressor::new();
        let block = tx
            .compress(&port_forward_headers("error", 8080, "0"))
            .expect("compress");
        let mut wire = vec![0x80, 0x03, 0x00, 0x01, 0x00];
        let len = 10 + block.len();
        wire.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8]);
        wire.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0, 0]);
        wire.extend_from_slice(&block);
        let (frame, used) = Frame::decode(&wire).expect("ok").expect("complete");
        assert_eq!(used, wire.len());
        let Frame::SynStream {
            stream_id,
            associated,
            priority,
            fin,
            block,
            ..
        } = frame
        else {
            panic!("not a SYN_STREAM: {frame:?}");
        };
        assert_eq!((stream_id, associated, priority, fin), (1, 0, 0, false));
        let headers = HeaderDecompressor::new()
            .decompress(&block)
            .expect("inflate");
        assert_eq!(headers.get("streamtype"), Some("error"));
        assert_eq!(headers.get("port"), Some("8080"));
        assert_eq!(headers.get("requestid"), Some("0"));
    }

    #[test]
    fn bad_header_blocks_are_errors() {
        assert!(HeaderBlock::decode(&[]).is_err());
        assert!(HeaderBlock::decode(&[0, 0, 0, 1, 0, 0, 0, 9, b'a']).is_err());
        assert!(HeaderBlock::decode(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0]).is_err());
        let upper = HeaderBlock(vec![("Port".into(), "1".into())]).encode();
        assert!(HeaderBlock::decode(&upper).is_err());
        // A zlib stream with another dictionary is refused by id.
        let mut rx = HeaderDecompressor::new();
        assert!(matches!(
            rx.decompress(&[0x78, 0xf9, 0, 0, 0, 1, 0, 0]),
            Err(SpdyError::Zlib(_))
        ));
        assert!(HeaderDecompressor::new().decompress(&[0x78]).is_err());
        assert!(
            HeaderDecompressor::new()
                .decompress(&[0x12, 0x34, 1, 2])
                .is_err()
        );
    }

    #[test]
    fn random_bytes_never_panic() {
        // xorshift: deterministic noise, plus mutations of valid frames.
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut valid = Vec::new();
        let block = HeaderCompressor::new()
            .compress(&port_forward_headers("data", 80, "3"))
            .expect("compress");
        Frame::SynStream {
            stream_id: 1,
            associated: 0,
            priority: 0,
            fin: false,
            unidirectional: false,
            block,
        }
        .encode(&mut valid);
        for round in 0..20_000 {
            let len = (next() % 64) as usize;
            let mut buf: Vec<u8> = if round % 2 == 0 {
                (0..len).map(|_| next() as u8).collect()
            } else {
                let mut v = valid.clone();
                let i = (next() as usize) % v.len();
                v[i] ^= next() as u8;
                v
            };
            if round % 3 == 0 && buf.len() >= 2 {
                buf[0] = 0x80;
                buf[1] = 0x03;
            }
            if let Ok(Some((
                Frame::SynStream { block, .. }
                | Frame::SynReply { block, .. }
                | Frame::Headers { block, .. },
                _,
            ))) = Frame::decode(&buf)
            {
                let _ = HeaderDecompressor::new().decompress(&block);
            }
            let _ = HeaderBlock::decode(&buf);
        }
    }

    #[test]
    fn protocol_negotiation() {
        assert_eq!(negotiate(["portforward.k8s.io"]), Ok("portforward.k8s.io"));
        assert_eq!(
            negotiate(["v2, portforward.k8s.io"]),
            Ok("portforward.k8s.io")
        );
        assert_eq!(negotiate(std::iter::empty()), Ok("portforward.k8s.io"));
        assert_eq!(
            negotiate(["channel.k8s.io", "v4.channel.k8s.io"]),
            Err("channel.k8s.io, v4.channel.k8s.io".into())
        );
        let r = upgrade_response("portforward.k8s.io");
        assert!(r.starts_with("HTTP/1.1 101 Switching Protocols\r\n"));
        assert!(r.contains("\r\nUpgrade: SPDY/3.1\r\n"));
        assert!(r.contains("\r\nConnection: Upgrade\r\n"));
        assert!(r.ends_with("X-Stream-Protocol-Version: portforward.k8s.io\r\n\r\n"));
    }

    /// A SPDY client end over an in-memory pipe.
    struct Client {
        io: tokio::io::DuplexStream,
        buf: Vec<u8>,
        deflate: HeaderCompressor,
        inflate: HeaderDecompressor,
    }

    impl Client {
        async fn send(&mut self, f: Frame) {
            let mut wire = Vec::new();
            f.encode(&mut wire);
            self.io.write_all(&wire).await.expect("write");
        }

        async fn syn(&mut self, stream_id: u32, kind: &str) {
            let block = self
                .deflate
                .compress(&port_forward_headers(kind, 8080, "0"))
                .expect("compress");
            self.send(Frame::SynStream {
                stream_id,
                associated: 0,
                priority: 0,
                fin: false,
                unidirectional: false,
                block,
            })
            .await;
        }

        /// The next frame, or None after `wait` of silence or at EOF.
        async fn next(&mut self, wait: Duration) -> Option<Frame> {
            loop {
                if let Some((f, used)) = Frame::decode(&self.buf).expect("server frames decode") {
                    self.buf.drain(..used);
                    return Some(f);
                }
                let mut chunk = [0u8; 65536];
                match tokio::time::timeout(wait, self.io.read(&mut chunk)).await {
                    Ok(Ok(n)) if n > 0 => self.buf.extend_from_slice(&chunk[..n]),
                    _ => return None,
                }
            }
        }
    }

    #[tokio::test]
    async fn session_pairs_streams_honours_windows_and_goes_away_on_garbage() {
        const DOWN: usize = 200_000;
        const UP: usize = 100_000;
        let pod = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .expect("bind");
        let pod_addr = pod.local_addr().expect("addr");
        let pod_task = tokio::spawn(async move {
            let (mut c, _) = pod.accept().await.expect("accept");
            let mut up = Vec::new();
            c.read_to_end(&mut up)
                .await
                .expect("read until the client's FIN");
            let down: Vec<u8> = (0..DOWN).map(|i| (i % 251) as u8).collect();
            c.write_all(&down).await.expect("write");
            up.len()
        });
        let dialled = Arc::new(std::sync::Mutex::new(Vec::new()));
        let dial: Dial = {
            let dialled = dialled.clone();
            Arc::new(move |port| {
                dialled.lock().expect("lock").push(port);
                Box::pin(tokio::net::TcpStream::connect(pod_addr))
            })
        };
        let (server_io, client_io) = tokio::io::duplex(1 << 20);
        let server = tokio::spawn(serve_with(server_io, Vec::new(), dial, "ns/p".into()));
        let mut c = Client {
            io: client_io,
            buf: Vec::new(),
            deflate: HeaderCompressor::new(),
            inflate: HeaderDecompressor::new(),
        };
        let short = Duration::from_millis(300);

        c.send(Frame::Ping { id: 1 }).await;
        assert_eq!(c.next(short).await, Some(Frame::Ping { id: 1 }));
        // A flow-control-aware client: announces the (default) window.
        c.send(Frame::Settings {
            clear: false,
            entries: vec![(0, SETTINGS_INITIAL_WINDOW_SIZE, 65536)],
        })
        .await;
        c.syn(1, "error").await;
        c.syn(3, "data").await;
        for part in vec![7u8; UP].chunks(30_000) {
            c.send(Frame::Data {
                stream_id: 3,
                fin: false,
                data: part.to_vec(),
            })
            .await;
        }
        c.send(Frame::Data {
            stream_id: 3,
            fin: true,
            data: vec![],
        })
        .await;

        let (mut replies, mut acked, mut got) = (Vec::new(), 0u64, Vec::new());
        while let Some(f) = c.next(short).await {
            match f {
                Frame::SynReply {
                    stream_id, block, ..
                } => {
                    assert_eq!(
                        c.inflate.decompress(&block).expect("reply headers"),
                        HeaderBlock::default()
                    );
                    replies.push(stream_id);
                }
                Frame::WindowUpdate {
                    stream_id: 3,
                    delta,
                } => acked += u64::from(delta),
                Frame::WindowUpdate { stream_id: 0, .. } => {}
                Frame::Data {
                    stream_id: 3,
                    data,
                    fin,
                } => {
                    assert!(!fin, "not all sent yet");
                    got.extend_from_slice(&data);
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(replies, [1, 3]);
        assert_eq!(acked, UP as u64, "every uploaded byte is acknowledged");
        assert_eq!(got.len(), 65536, "the stand-in stops at the initial window");
        assert_eq!(*dialled.lock().expect("lock"), [8080]);

        c.send(Frame::WindowUpdate {
            stream_id: 3,
            delta: 1 << 20,
        })
        .await;
        c.send(Frame::WindowUpdate {
            stream_id: 0,
            delta: 1 << 20,
        })
        .await;
        let mut fins = Vec::new();
        while let Some(f) = c.next(short).await {
            match f {
                Frame::Data {
                    stream_id: 3,
                    data,
                    fin,
                } => {
                    got.extend_from_slice(&data);
                    if fin {
                        fins.push(3);
                    }
                }
                Frame::Data {
                    stream_id: 1,
                    data,
                    fin: true,
                } => {
                    assert!(
                        data.is_empty(),
                        "no error: {:?}",
                        String::from_utf8_lossy(&data)
                    );
                    fins.push(1);
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(got.len(), DOWN);
        assert!(got.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
        assert_eq!(
            fins,
            [3, 1],
            "data ends with FIN, then the error stream closes"
        );
        assert_eq!(pod_task.await.expect("pod"), UP);

        // A stream without a port is refused; then garbage ends the session.
        let block = c
            .deflate
            .compress(&HeaderBlock(vec![("streamtype".into(), "data".into())]))
            .expect("compress");
        c.send(Frame::SynStream {
            stream_id: 5,
            associated: 0,
            priority: 0,
            fin: false,
            unidirectional: false,
            block,
        })
        .await;
        assert_eq!(
            c.next(short).await,
            Some(Frame::RstStream {
                stream_id: 5,
                status: rst::REFUSED_STREAM
            })
        );
        c.io.write_all(&[0x80, 0x02, 0x00, 0x01, 0, 0, 0, 0])
            .await
            .expect("write");
        assert_eq!(
            c.next(short).await,
            Some(Frame::GoAway {
                last_good: 5,
                status: goaway::PROTOCOL_ERROR
            })
        );
        assert_eq!(c.next(short).await, None, "connection closed after GOAWAY");
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .expect("session ends")
            .expect("no panic");
    }

    #[tokio::test]
    async fn dial_errors_go_to_the_error_stream() {
        let dial: Dial = Arc::new(|_| {
            Box::pin(async { Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)) })
        });
        let (server_io, client_io) = tokio::io::duplex(1 << 16);
        let _server = tokio::spawn(serve_with(
            server_io,
            Vec::new(),
            dial,
            "ns/p, uid u".into(),
        ));
        let mut c = Client {
            io: client_io,
            buf: Vec::new(),
            deflate: HeaderCompressor::new(),
            inflate: HeaderDecompressor::new(),
        };
        c.syn(1, "error").await;
        c.syn(3, "data").await;
        let mut error_text = None;
        let mut data_fin = false;
        while let Some(f) = c.next(Duration::from_millis(300)).await {
            match f {
                Frame::Data {
                    stream_id: 1,
                    data,
                    fin: true,
                } => {
                    error_text = Some(String::from_utf8(data).expect("utf8"));
                }
                Frame::Data {
                    stream_id: 3,
                    fin: true,
                    ..
                } => data_fin = true,
                Frame::SynReply { .. } => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(
            error_text.as_deref(),
            Some(
                "error forwarding port 8080 to pod ns/p, uid u: dial tcp4 127.0.0.1:8080: connect: connection refused"
            )
        );
        assert!(data_fin, "the data stream is closed too");
    }
}
