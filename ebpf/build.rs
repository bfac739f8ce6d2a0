//! Builds the eBPF object (`dataplane-ebpf`, binary `kvpn-dataplane-ebpf`) with aya-build
//! and leaves it in `$OUT_DIR/kvpn-dataplane-ebpf`, where `src/lib.rs` embeds it.
//!
//! aya-build runs `rustup run nightly cargo build --target bpfel-unknown-none
//! -Z build-std=core` (TOOLCHAIN.md), which links with `bpf-linker`. `scripts/setup.sh`
//! installs bpf-linker into `$KVPN_CACHE/tools/bin` (default /var/cache/kvpn/tools/bin);
//! that directory is added to PATH when bpf-linker is not already on it.
//! `AYA_BUILD_SKIP=1` skips the eBPF build: an empty object is written and the loader
//! reports `EbpfError::NotBuilt` at run time.

use std::{
    env,
    ffi::OsString,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, bail};

const EBPF_PACKAGE: &str = "kvpn-dataplane-ebpf";
const EBPF_BINARY: &str = "kvpn-dataplane-ebpf";
const DEFAULT_KVPN_CACHE: &str = "/var/cache/kvpn";

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed=AYA_BUILD_SKIP");
    println!("cargo:rerun-if-env-changed=KVPN_CACHE");
    println!("cargo:rerun-if-changed=build.rs");

    let out_dir = PathBuf::from(env::var_os("OUT_DIR").context("OUT_DIR not set by cargo")?);
    let object = out_dir.join(EBPF_BINARY);

    if skip_requested() {
        // aya-build returns without building; leave an empty object so `include_bytes!`
        // compiles and the loader can say what happened.
        fs::write(&object, b"")
            .with_context(|| format!("cannot write placeholder {}", object.display()))?;
        println!(
            "cargo:warning=AYA_BUILD_SKIP set: kvpn-ebpf is built without the eBPF object \
             (kvpn-dataplane and kvpn-manager cannot load their eBPF programs)"
        );
        return Ok(());
    }

    let linker = ensure_bpf_linker_on_path()?;
    println!("cargo:rerun-if-changed={}", linker.display());

    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR not set")?);
    let ebpf_dir = manifest_dir
        .parent()
        .context("ebpf crate has no parent directory")?
        .join("dataplane-ebpf");
    let ebpf_dir = ebpf_dir
        .to_str()
        .with_context(|| format!("non-UTF-8 path {}", ebpf_dir.display()))?;
    // aya-build only watches the eBPF crate's directory; the shared map layout lives here.
    println!(
        "cargo:rerun-if-changed={}",
        manifest_dir.join("../dataplane-common").display()
    );

    let package = aya_build::Package {
        name: EBPF_PACKAGE,
        root_dir: ebpf_dir,
        ..Default::default()
    };
    // aya-build turns every stderr line of the nested cargo ("Compiling …") into a
    // `cargo:warning`; a quiet nested cargo keeps only real compiler diagnostics,
    // which reach aya-build through cargo's JSON messages.
    // SAFETY: build scripts are single-threaded here; nothing reads the environment
    // concurrently.
    unsafe { env::set_var("CARGO_TERM_QUIET", "true") };
    aya_build::build_ebpf([package], aya_build::Toolchain::default()).with_context(|| {
        format!(
            "building the eBPF crate {EBPF_PACKAGE} failed (nightly + rust-src + bpf-linker needed: \
             run scripts/setup.sh, or set AYA_BUILD_SKIP=1 to build without eBPF)"
        )
    })?;
    if !object.is_file() {
        bail!("aya-build finished but {} is missing", object.display());
    }
    Ok(())
}

fn skip_requested() -> bool {
    env::var("AYA_BUILD_SKIP").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}

/// Finds bpf-linker on PATH, else in the set-up cache (then prepends that directory to
/// this process's PATH, which aya-build's child cargo and rustc inherit).
fn ensure_bpf_linker_on_path() -> anyhow::Result<PathBuf> {
    let path = env::var_os("PATH").unwrap_or_default();
    if let Some(found) = find_in(env::split_paths(&path), "bpf-linker") {
        return Ok(found);
    }
    let cache = env::var_os("KVPN_CACHE").unwrap_or_else(|| OsString::from(DEFAULT_KVPN_CACHE));
    let tools_bin = Path::new(&cache).join("tools").join("bin");
    let Some(found) = find_in([tools_bin.clone()], "bpf-linker") else {
        bail!(
            "bpf-linker not found on PATH nor in {} — run scripts/setup.sh (as root) to build it \
             against the nightly toolchain's LLVM, or set AYA_BUILD_SKIP=1 to build kvpn-ebpf \
             without the eBPF object",
            tools_bin.display()
        );
    };
    let new_path = env::join_paths(std::iter::once(tools_bin).chain(env::split_paths(&path)))
        .context("cannot extend PATH with the bpf-linker directory")?;
    // SAFETY: build scripts are single-threaded here (aya-build has not spawned anything
    // yet), so nothing reads the environment concurrently.
    unsafe { env::set_var("PATH", new_path) };
    Ok(found)
}

fn find_in(dirs: impl IntoIterator<Item = PathBuf>, name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    dirs.into_iter()
        .map(|dir| dir.join(name))
        .find(|candidate| {
            fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}
