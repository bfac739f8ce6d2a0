//! Fuzz the manager's lease table with LeaseRequest messages and hellos.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvpn_manager::fuzzing::lease_hello(data);
});
