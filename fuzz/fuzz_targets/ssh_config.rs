//! Fuzz SSH config parsing and jump-host resolution.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvpn_control::fuzzing::ssh_config(data);
});
