//! Entry points shared by the cargo-fuzz targets (fuzz/) and the corpus replay
//! test, so CI replays exactly what the fuzzers run, on stable, in seconds.

use crate::frame::{Decoder, GsoHeader, Hello, Kind, ManagerHello, Stats, decode_exact};
use crate::gso::{self, GsoKind};

/// Decode a stream of frames from `data` with a few receiver limits, and every
/// hello payload found; checks the decoder's invariants. Panics only on a bug.
pub fn frame_decode(data: &[u8]) {
    let mut segments = Vec::new();
    // The first two bytes pick a receiver limit, so the fuzzer explores it too.
    let max = data.get(..2).map_or(usize::from(u16::MAX), |b| {
        usize::from(u16::from_be_bytes([b[0], b[1]]))
    });
    for decoder in [
        Decoder::default(),
        Decoder::with_max_len(max),
        Decoder::with_max_len(1500),
    ] {
        let mut rest = data;
        while let Ok(Some((frame, used))) = decoder.decode(rest) {
            assert!(
                used > 0 && used <= rest.len(),
                "decoder consumed {used} of {}",
                rest.len()
            );
            assert_eq!(
                frame.wire_len(),
                used,
                "wire_len disagrees with consumed bytes"
            );
            if frame.kind == Kind::Hello
                && let Ok(hello) = Hello::decode(frame.payload)
            {
                let again = hello.encode().expect("a decoded hello re-encodes");
                assert_eq!(again, frame.payload, "hello does not round-trip");
            }
            if frame.kind == Kind::Stats
                && let Ok(stats) = Stats::decode(frame.payload)
            {
                let again = stats.encode().expect("decoded stats re-encode");
                assert_eq!(again, frame.payload, "stats do not round-trip");
            }
            if frame.kind == Kind::Gso
                && let Some((header, packet)) = GsoHeader::split(frame.payload)
            {
                gso_frame(header, packet, &mut segments);
            }
            rest = &rest[used..];
        }
    }
    let _ = ManagerHello::decode(data);
    let _ = decode_exact(data);
    let _ = Hello::decode(data);
    let _ = Stats::decode(data);
}

/// What the manager does with a GSO frame: segment it (or complete its
/// checksum), checking the segments lie inside the output.
fn gso_frame(header: GsoHeader, packet: &[u8], out: &mut Vec<u8>) {
    out.clear();
    match GsoKind::from_gso_type(header.gso_type) {
        Some(kind) => {
            if let Ok(seg) = gso::segment_tcp(packet, kind, usize::from(header.gso_size), out, 0) {
                assert_eq!(out.len(), seg.total_len(), "segments fill the output");
                assert!(
                    seg.spans().all(|r| r.end <= out.len()),
                    "span out of the output"
                );
            }
        }
        None => {
            out.extend_from_slice(packet);
            let _ = gso::complete_checksum(
                out,
                usize::from(header.csum_start),
                usize::from(header.csum_offset),
            );
        }
    }
}

/// Split a fuzz input into several byte strings, each prefixed by a 2-byte
/// big-endian length (a short last chunk takes what is left). Targets that
/// feed a sequence of packets or messages use this shape, so corpus files can
/// be written by hand: `len_be16 bytes len_be16 bytes …`.
pub fn chunks(data: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut rest = data;
    while let Some((len, tail)) = rest.split_first_chunk::<2>() {
        let n = usize::from(u16::from_be_bytes(*len)).min(tail.len());
        out.push(&tail[..n]);
        rest = &tail[n..];
    }
    out
}

/// Encode `parts` in the [`chunks`] shape (for writing seed inputs).
pub fn join_chunks<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> Vec<u8> {
    let mut out = Vec::new();
    for p in parts {
        let p = &p[..p.len().min(usize::from(u16::MAX))];
        // Cannot fail: clamped to u16::MAX just above.
        let len = u16::try_from(p.len()).unwrap_or(u16::MAX);
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(p);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_round_trip_and_clamp_a_short_tail() {
        let parts: [&[u8]; 3] = [b"abc", b"", b"xy"];
        let joined = join_chunks(parts);
        assert_eq!(chunks(&joined), parts.to_vec());
        assert_eq!(chunks(&[0, 5, b'a', b'b']), vec![&b"ab"[..]]);
        assert!(chunks(&[7]).is_empty());
    }
}
