//! The eBPF object `kvpn-dataplane-ebpf`: kvpn's kernel-side programs, built for
//! `bpfel-unknown-none` by `ebpf/build.rs` (aya-build) and embedded in the loader
//! crate `kvpn-ebpf`, so in the `kvpn-dataplane` and `kvpn-manager` binaries. Built for the host (e.g. by `cargo clippy --workspace`) it
//! is an empty program, so host builds of the whole workspace keep working.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

#[cfg(target_arch = "bpf")]
mod csum;
#[cfg(target_arch = "bpf")]
mod maps;
#[cfg(target_arch = "bpf")]
mod run_scope;
#[cfg(target_arch = "bpf")]
mod snat;
#[cfg(target_arch = "bpf")]
mod steer;
#[cfg(target_arch = "bpf")]
mod tun_egress;
#[cfg(target_arch = "bpf")]
mod tun_ingress;

#[cfg(not(target_arch = "bpf"))]
fn main() {}

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any program that could reach a panic (there is no unwinding
    // in BPF), so this is never executed; it only satisfies `no_std`.
    loop {}
}

/// The kernel reads the program's license from this section; kvpn uses no GPL-only
/// helpers, so the project's own license is declared.
#[cfg(target_arch = "bpf")]
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 11] = *b"Apache-2.0\0";
