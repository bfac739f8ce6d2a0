//! Fuzz one session's smoltcp engine with a sequence of packets from the laptop.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvpn_manager::fuzzing::engine_ingest(data);
});
