//! Fuzz known_hosts parsing and host key checks.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvpn_control::fuzzing::known_hosts(data);
});
