//! kvpn's eBPF programs (the `kvpn-dataplane-ebpf` binary, built for `bpfel-unknown-none`
//! by `ebpf/build.rs` through aya-build) and their pure, host-testable parts.
//!
//! The library holds the packet parser the TC classifier runs, written against the
//! [`parse::PacketBytes`] trait so it runs unchanged on a byte slice in unit tests and
//! on `bpf_skb_load_bytes` in the kernel. It does no I/O. The library target also lets
//! the loader crate (`kvpn-ebpf`) list this crate as a build dependency, which aya-build needs.
#![cfg_attr(not(test), no_std)]

pub mod parse;
