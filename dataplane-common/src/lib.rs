#![no_std]
//! Map keys and values shared by the eBPF programs and userspace (owned by the ebpf work).
