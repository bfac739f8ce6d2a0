//! Fuzz the laptop DNS forwarder's query decoding, classification and local answers.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvpn_dataplane::fuzzing::dns_query(data);
});
