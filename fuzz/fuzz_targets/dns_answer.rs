//! Fuzz the laptop DNS forwarder's handling of answers from the cluster DNS and upstream.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvpn_dataplane::fuzzing::dns_answer(data);
});
