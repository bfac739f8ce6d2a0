//! Fuzz the laptop's handling of LeaseResponse and RoutesUpdate messages.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvpn_control::fuzzing::manager_messages(data);
});
