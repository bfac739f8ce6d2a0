//! The deterministic pseudo-random bytes `kvpn-lab-server` serves on `GET /big` and
//! writes for `WRITE <n> CLOSE`, and their expected sha256, so a test checks a download
//! without fetching it twice. Pure; no I/O.
//!
//! Byte `i` of the stream is byte `i % 8` (little-endian) of `splitmix64(i / 8)`, a
//! counter-based generator: any offset can be produced directly, so the server can
//! stream in chunks of any size.

use sha2::{Digest as _, Sha256};

/// Size of `GET /big` without `?bytes=`: 50 MiB.
pub const BIG_DEFAULT_BYTES: u64 = 50 * 1024 * 1024;

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
/// Fixed seed: changing it changes every expected hash.
const SEED: u64 = 0x6b76_706e_2d6c_6162; // "kvpn-lab"

fn block(index: u64) -> [u8; 8] {
    // splitmix64 (Steele, Lea, Flood 2014) over the block counter.
    let mut z = SEED.wrapping_add(index.wrapping_add(1).wrapping_mul(GAMMA));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)).to_le_bytes()
}

/// Fills `buf` with the stream's bytes starting at byte `offset`.
pub fn fill(offset: u64, buf: &mut [u8]) {
    let mut pos = offset;
    let mut out = buf;
    // Leading partial block.
    let skip = (pos % 8) as usize;
    if skip != 0 {
        let b = block(pos / 8);
        let n = (8 - skip).min(out.len());
        out[..n].copy_from_slice(&b[skip..skip + n]);
        out = &mut out[n..];
        pos += n as u64;
    }
    let mut chunks = out.chunks_exact_mut(8);
    for chunk in &mut chunks {
        chunk.copy_from_slice(&block(pos / 8));
        pos += 8;
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        let b = block(pos / 8);
        let n = tail.len();
        tail.copy_from_slice(&b[..n]);
    }
}

/// The sha256 of the first `len` bytes of the stream.
pub fn sha256(len: u64) -> [u8; 32] {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut offset = 0u64;
    while offset < len {
        let n = usize::try_from(len - offset)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        fill(offset, &mut buf[..n]);
        hasher.update(&buf[..n]);
        offset += n as u64;
    }
    hasher.finalize().into()
}

/// [`sha256`] as lowercase hex, the way `sha256sum` prints it.
pub fn sha256_hex(len: u64) -> String {
    hex(&sha256(len))
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// sha256 of arbitrary bytes as lowercase hex (for comparing a download).
pub fn sha256_hex_of(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_offset_matches_the_whole_stream() {
        let mut whole = vec![0u8; 1000];
        fill(0, &mut whole);
        for offset in [0usize, 1, 7, 8, 9, 15, 333] {
            for len in [0usize, 1, 3, 8, 13, 64, 600] {
                let mut part = vec![0u8; len];
                fill(offset as u64, &mut part);
                assert_eq!(
                    part,
                    whole[offset..offset + len],
                    "offset {offset} len {len}"
                );
            }
        }
    }

    #[test]
    fn hash_is_of_the_filled_bytes() {
        let mut data = vec![0u8; 200_000];
        fill(0, &mut data);
        assert_eq!(sha256_hex(200_000), sha256_hex_of(&data));
        assert_ne!(sha256_hex(200_000), sha256_hex(199_999));
    }

    #[test]
    fn stream_is_pinned() {
        // Values from an independent implementation (a few lines of Python), pinned so
        // that a change to the generator is a conscious one: it changes every expected
        // hash of a /big download.
        let mut first = [0u8; 8];
        fill(0, &mut first);
        assert_eq!(hex(&first), "9f6d195a37cf1e59");
        assert_eq!(
            sha256_hex(1 << 20),
            "d53d1a1d804822f5cde3612e67fdcb87585a8b161f871e519af3ed51946a07be"
        );
        assert_eq!(
            sha256_hex(1_000_003),
            "7841bcce4256a6f210e37dd9750cfdbca5d161924b1a009d858a517719239c2b"
        );
        assert_eq!(
            sha256_hex(0),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
