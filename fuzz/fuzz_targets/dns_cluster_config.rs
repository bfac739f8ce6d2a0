//! Fuzz the validation of the cluster DNS settings the manager sends.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvpn_dataplane::fuzzing::dns_cluster_config(data);
});
