//! Fuzz kubeconfig parsing, merging and context selection.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvpn_control::fuzzing::kubeconfig(data);
});
