//! Fuzz CIDR parsing from component flags, config files and API server messages.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvpn_control::fuzzing::cidr_flags(data);
});
