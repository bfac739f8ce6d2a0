//! Entry points shared by the cargo-fuzz targets (fuzz/) and the corpus replay
//! test, so CI replays exactly what the fuzzers run, on stable, in seconds.

use crate::frame::{Decoder, Hello, Kind, decode_exact};

/// Decode a stream of frames from `data` with a few receiver limits, and every
/// hello payload found; checks the decoder's invariants. Panics only on a bug.
pub fn frame_decode(data: &[u8]) {
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
            rest = &rest[used..];
        }
    }
    let _ = decode_exact(data);
    let _ = Hello::decode(data);
}
