//! Fuzz the data-channel frame decoder and the hello decoder with arbitrary bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvpn_proto::fuzzing::frame_decode(data);
});
