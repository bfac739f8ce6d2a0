//! `cargo xtask`: kvpn's developer tasks. Thin wrappers over cargo and the
//! scripts in `scripts/`, so the README's commands stay short.
//!
//! - `setup`: idempotent machine set-up (apt packages, nightly rust-src,
//!   bpf-linker, Kubernetes binaries), as root.
//! - `build`: every binary of the workspace (the eBPF object is built by
//!   dataplane/build.rs).
//! - `demo`: build, bring the lab up, connect from the laptop netns, show what
//!   works, disconnect, bring the lab down.
//! - `test`: build, then every test of the workspace (unit, property, corpus
//!   replay, eBPF BPF_PROG_TEST_RUN, end-to-end lab tests).
//! - `bench`: the benchmark harness (release build) against a raw veth baseline.
//! - `fuzz`: a bounded cargo-fuzz run of every target.
#![allow(clippy::print_stdout, reason = "xtask reports progress on stdout")]

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "kvpn developer tasks")]
struct Args {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Idempotent machine set-up (root): apt packages, rust-src, bpf-linker, Kubernetes binaries.
    Setup,
    /// Build every binary.
    Build {
        /// Release profile.
        #[arg(long)]
        release: bool,
    },
    /// Build, bring the lab up, connect, show what works, disconnect, lab down.
    Demo,
    /// Build, then run every test (unit, property, eBPF, end-to-end on the lab).
    Test {
        /// Extra arguments for `cargo test` (after `--`).
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
    /// Benchmarks: kvpn against a raw veth baseline in the same run (release build).
    Bench {
        /// Extra arguments for the bench binary.
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
    /// Run every cargo-fuzz target for a bounded time.
    Fuzz {
        /// Seconds per target.
        #[arg(long, default_value_t = 60)]
        seconds: u32,
    },
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// The tools folder setup.sh fills (bpf-linker), prepended to PATH.
fn path_with_tools() -> String {
    let cache = std::env::var("KVPN_CACHE").unwrap_or_else(|_| "/var/cache/kvpn".into());
    let old = std::env::var("PATH").unwrap_or_default();
    format!("{cache}/tools/bin:{old}")
}

fn run(cmd: &mut Command) -> Result<()> {
    if cmd.get_current_dir().is_none() {
        cmd.current_dir(root());
    }
    cmd.env("PATH", path_with_tools());
    let shown = format!("{cmd:?}");
    let status = cmd
        .status()
        .with_context(|| format!("cannot run {shown}"))?;
    if !status.success() {
        bail!("{shown} failed with {status}");
    }
    Ok(())
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
}

fn build(release: bool) -> Result<PathBuf> {
    println!(
        "==> building kvpn ({})",
        if release { "release" } else { "debug" }
    );
    let mut cmd = cargo();
    // Default members only: the eBPF crate is built by dataplane/build.rs for bpfel.
    cmd.args(["build", "--bins"]);
    if release {
        cmd.arg("--release");
    }
    run(&mut cmd)?;
    Ok(target_dir().join(if release { "release" } else { "debug" }))
}

fn main() -> Result<()> {
    let args = Args::parse();
    match args.task {
        Task::Setup => run(Command::new("bash").arg("scripts/setup.sh")),
        Task::Build { release } => build(release).map(|_| ()),
        Task::Demo => {
            let bin = build(false)?;
            run(Command::new("bash")
                .arg("scripts/demo.sh")
                .env("KVPN_BIN_DIR", &bin))
        }
        Task::Test { args } => {
            let bin = build(false)?;
            println!("==> running every test");
            let mut cmd = cargo();
            // Every test binary runs even after one fails, so one failure never
            // hides another; the exit status still says something failed.
            cmd.args(["test", "--no-fail-fast"])
                .env("KVPN_BIN_DIR", &bin);
            if !args.is_empty() {
                cmd.args(&args);
            }
            run(&mut cmd)
        }
        Task::Bench { args } => {
            let bin = build(true)?;
            let mut cmd = Command::new(bin.join("kvpn-bench"));
            cmd.env("KVPN_BIN_DIR", &bin).args(&args);
            run(&mut cmd)
        }
        Task::Fuzz { seconds } => {
            if Command::new("cargo")
                .args(["fuzz", "--version"])
                .output()
                .map(|o| !o.status.success())
                .unwrap_or(true)
            {
                println!("==> installing cargo-fuzz");
                run(cargo().args(["install", "cargo-fuzz", "--locked"]))?;
            }
            // One entry per cargo-fuzz target in fuzz/fuzz_targets/.
            const TARGETS: &[&str] = &["frame_decode"];
            for target in TARGETS {
                println!("==> fuzzing {target} for {seconds}s");
                run(Command::new("cargo")
                    .args(["+nightly", "fuzz", "run", target, "--"])
                    .arg(format!("-max_total_time={seconds}"))
                    .current_dir(root().join("fuzz")))?;
            }
            Ok(())
        }
    }
}
