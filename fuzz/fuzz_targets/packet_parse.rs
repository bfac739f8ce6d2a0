//! Fuzz the manager's packet classifier and ICMP error builders with one raw packet from the laptop.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvpn_manager::fuzzing::packet_parse(data);
});
