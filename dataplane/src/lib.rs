//! kvpn root daemon library (kvpn-dataplane).
pub mod ebpf;
