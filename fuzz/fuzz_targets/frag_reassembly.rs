//! Fuzz the manager's IPv4/IPv6 fragment reassembly with a sequence of packets.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvpn_manager::fuzzing::frag_reassembly(data);
});
