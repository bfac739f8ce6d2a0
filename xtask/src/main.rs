//! `cargo xtask`: kvpn's developer tasks. Thin wrappers over cargo and the
//! scripts in `scripts/`, so the README's commands stay short.
//!
//! - `setup`: idempotent machine set-up (apt packages, nightly rust-src,
//!   bpf-linker, Kubernetes binaries), as root.
//! - `build`: every binary of the workspace (the eBPF object is built by
//!   ebpf/build.rs).
//! - `demo`: build (release, as the bench: the speed a newcomer sees is what
//!   kvpn does; `--debug` for a quicker build that says so), bring the lab up,
//!   connect from the laptop netns, show what works, disconnect, bring the lab
//!   down.
//! - `test`: build, then every test of the workspace (unit, property, corpus
//!   replay, eBPF BPF_PROG_TEST_RUN, end-to-end lab tests).
//! - `bench`: the benchmark harness (release build) against a raw veth baseline.
//! - `fuzz`: a bounded cargo-fuzz run of every target.
//! - `image`: the OCI images (manager, lab server, pause) as reproducible
//!   archives, without Docker (xtask/src/image.rs).
//! - `soak`: the bounded soak on the Kubernetes lab (tests/src/soak.rs):
//!   mixed traffic, faults, then fds, memory, reconnects and residue checked.
#![allow(clippy::print_stdout, reason = "xtask reports progress on stdout")]

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

mod image;

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
    /// Build (release) and the project's images, bring the lab up on two real nodes,
    /// connect, show what works, disconnect, lab down.
    Demo {
        /// Run the debug build instead (builds faster; its throughput and latency are
        /// several times worse than release, and the demo says so).
        #[arg(long)]
        debug: bool,
        /// On the lab's stand-in node (a kubelet and kube-proxy of the lab's own, no
        /// containers; being retired, issue #23) instead of real node software.
        #[arg(long)]
        stand_in_nodes: bool,
        /// The default (the lab on real node software: containerd + runc, kubelet,
        /// kube-proxy); kept so older instructions still work.
        #[arg(long, hide = true, conflicts_with = "stand_in_nodes")]
        real_nodes: bool,
    },
    /// Build, then run every test (unit, property, eBPF, end-to-end on the lab).
    Test {
        /// Arguments for `cargo test`, as given (`./x test -p kvpn-control --lib`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Benchmarks: kvpn against a raw veth baseline in the same run (release build).
    Bench {
        /// kvpn-bench's own flags, as given (`./x bench --rounds 1`; `./x bench -- --help`
        /// lists them).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Build the OCI images (static musl binaries on an empty base, user 65532) as
    /// reproducible OCI archives: the traffic manager, and the lab's server and pause.
    Image {
        /// Where the archives go (default: $KVPN_CACHE/images, /var/cache/kvpn/images).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Use the binaries already built for the images (no cargo build).
        #[arg(long)]
        no_build: bool,
        /// Images to build (manager, lab-server, pause; default: all).
        images: Vec<String>,
    },
    /// Run every cargo-fuzz target (or the named ones) for a bounded time.
    Fuzz {
        /// Seconds per target.
        #[arg(long, default_value_t = 60)]
        seconds: u32,
        /// Afterwards, merge what the fuzzer found into the committed corpora
        /// (only inputs that add coverage).
        #[arg(long)]
        merge: bool,
        /// Targets to run (default: every file in fuzz/fuzz_targets/).
        targets: Vec<String>,
        /// libFuzzer's own flags for every run, after `--` (`./x fuzz dns_query --
        /// -max_len=512`).
        #[arg(last = true)]
        libfuzzer: Vec<String>,
    },
    /// Bounded soak on the lab (root): TCP/UDP/DNS traffic, transport kills, a manager
    /// pod deletion, SIGKILL of each daemon; fails when a bound breaks.
    Soak {
        /// Traffic time in seconds (at least 30).
        #[arg(long, default_value_t = 600)]
        seconds: u64,
        /// Requests per second of each kind (TCP, UDP, DNS).
        #[arg(long, default_value_t = 4.0)]
        rate: f64,
        /// Where to write the JSON report (default: printed after the table).
        #[arg(long)]
        json: Option<PathBuf>,
        /// Any other kvpn-soak flag, as given.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
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

/// Where `image` writes its archives unless told otherwise.
fn default_image_dir() -> PathBuf {
    let cache = std::env::var("KVPN_CACHE").unwrap_or_else(|_| "/var/cache/kvpn".into());
    PathBuf::from(cache).join("images")
}

/// Builds the project's OCI images into [`default_image_dir`] (each printed with its
/// digest and size) and returns that folder.
fn build_images() -> Result<PathBuf> {
    println!("==> building the OCI images");
    let images = default_image_dir();
    for b in image::build(&image::ImageRequest {
        root: root(),
        target_dir: target_dir(),
        out: images.clone(),
        only: Vec::new(),
        no_build: false,
        version: env!("CARGO_PKG_VERSION").to_owned(),
        path: path_with_tools(),
    })? {
        println!(
            "    {}  {}  {:.1} MiB",
            b.name,
            b.digest,
            b.archive_bytes as f64 / 1048576.0
        );
    }
    Ok(images)
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
    // Default members only: the eBPF crate is built by ebpf/build.rs for bpfel.
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
        Task::Demo {
            debug,
            stand_in_nodes,
            real_nodes: _,
        } => {
            // Release by default: a debug build moved the demo's 50 MB download at
            // 146 Mbit/s with pings of several ms (issue 29 item 11), 10-20x below
            // release. CI does not run the demo, so its build time costs CI nothing.
            let bin = build(!debug)?;
            let mut cmd = Command::new("bash");
            cmd.arg("scripts/demo.sh")
                .env("KVPN_BIN_DIR", &bin)
                .env("KVPN_DEMO_BUILD", if debug { "debug" } else { "release" });
            if !stand_in_nodes {
                let images = build_images()?;
                cmd.env("KVPN_IMAGE_DIR", &images)
                    .env("KVPN_DEMO_LAB_UP_ARGS", "--real-nodes");
            }
            run(&mut cmd)
        }
        Task::Test { args } => {
            let bin = build(false)?;
            // The image tests (tests/tests/image.rs) and the real-node labs run the
            // project's images under containerd: build them first.
            let images = build_images()?;
            println!("==> running every test");
            let mut cmd = cargo();
            // Every test binary runs even after one fails, so one failure never
            // hides another; the exit status still says something failed.
            cmd.args(["test", "--no-fail-fast"])
                .env("KVPN_BIN_DIR", &bin)
                .env("KVPN_IMAGE_DIR", &images);
            if !args.is_empty() {
                cmd.args(&args);
            }
            run(&mut cmd)
        }
        Task::Bench { args } => {
            let bin = build(true)?;
            // The Kubernetes lab's rows run on real nodes, from the project's images.
            let images = build_images()?;
            let mut cmd = Command::new(bin.join("kvpn-bench"));
            cmd.env("KVPN_BIN_DIR", &bin)
                .env("KVPN_IMAGE_DIR", &images)
                .args(&args);
            run(&mut cmd)
        }
        Task::Image {
            out,
            no_build,
            images,
        } => {
            let req = image::ImageRequest {
                root: root(),
                target_dir: target_dir(),
                out: out.unwrap_or_else(default_image_dir),
                only: images,
                no_build,
                version: env!("CARGO_PKG_VERSION").to_owned(),
                path: path_with_tools(),
            };
            for b in image::build(&req)? {
                println!(
                    "{}  {}  {:.1} MiB  {}",
                    b.name,
                    b.digest,
                    b.archive_bytes as f64 / (1024.0 * 1024.0),
                    b.archive.display()
                );
            }
            Ok(())
        }
        Task::Fuzz {
            seconds,
            merge,
            targets,
            libfuzzer,
        } => fuzz(seconds, merge, &targets, &libfuzzer),
        Task::Soak {
            seconds,
            rate,
            json,
            args,
        } => {
            // Debug build, like the end-to-end tests: the soak's bounds were
            // measured on it. `--bins` builds the driver (kvpn-soak) too.
            let bin = build(false)?;
            println!("==> soak for {seconds} s");
            let mut cmd = Command::new(bin.join("kvpn-soak"));
            cmd.env("KVPN_BIN_DIR", &bin)
                .args(["--seconds", &seconds.to_string()])
                .args(["--rate", &rate.to_string()]);
            if let Some(json) = json {
                cmd.arg("--json").arg(json);
            }
            run(cmd.args(&args))
        }
    }
}

/// Every cargo-fuzz target: the files in fuzz/fuzz_targets/.
fn fuzz_targets() -> Result<Vec<String>> {
    let dir = root().join("fuzz/fuzz_targets");
    let mut out = Vec::new();
    for entry in
        std::fs::read_dir(&dir).with_context(|| format!("cannot list {}", dir.display()))?
    {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "rs")
            && let Some(stem) = path.file_stem().and_then(|s| s.to_str())
        {
            out.push(stem.to_owned());
        }
    }
    out.sort();
    Ok(out)
}

/// `cargo +nightly fuzz <sub> …` with the flags every call shares: no
/// sanitizer (safe Rust; panics are what we look for, and the build and runs
/// are several times cheaper without ASan), debug assertions on (overflow is
/// a panic), a target dir in the cache outside the checkout, and the eBPF
/// build skipped (the DNS targets only need the dataplane's pure modules).
fn cargo_fuzz(sub: &str) -> Command {
    let cache = std::env::var("KVPN_CACHE").unwrap_or_else(|_| "/var/cache/kvpn".into());
    let mut cmd = Command::new("cargo");
    cmd.args([
        "+nightly",
        "fuzz",
        sub,
        "--sanitizer",
        "none",
        "--debug-assertions",
    ])
    .arg("--target-dir")
    .arg(format!("{cache}/fuzz-target"))
    .env("AYA_BUILD_SKIP", "1")
    .env("CARGO_INCREMENTAL", "0")
    .env("PATH", path_with_tools())
    .current_dir(root().join("fuzz"));
    cmd
}

/// `./x fuzz`: a bounded run of each target, with `libfuzzer`'s flags after
/// kvpn's (libFuzzer takes the last of a repeated flag). New inputs go to a
/// scratch corpus in the cache (the committed one in fuzz/corpus/ is only read,
/// unless `merge`); a crash stops with the input under fuzz/artifacts/<target>/.
fn fuzz(seconds: u32, merge: bool, only: &[String], libfuzzer: &[String]) -> Result<()> {
    if Command::new("cargo")
        .args(["fuzz", "--version"])
        .output()
        .map(|o| !o.status.success())
        .unwrap_or(true)
    {
        println!("==> installing cargo-fuzz");
        run(cargo().args(["install", "cargo-fuzz", "--locked"]))?;
    }
    let all = fuzz_targets()?;
    for t in only {
        if !all.contains(t) {
            bail!("no fuzz target {t:?} — the targets are: {}", all.join(", "));
        }
    }
    let targets: Vec<&String> = all
        .iter()
        .filter(|t| only.is_empty() || only.contains(t))
        .collect();
    println!("==> building {} fuzz targets", targets.len());
    run(&mut cargo_fuzz("build"))?;
    let cache = std::env::var("KVPN_CACHE").unwrap_or_else(|_| "/var/cache/kvpn".into());
    let mut summary = Vec::new();
    for target in targets {
        let scratch = PathBuf::from(&cache).join("fuzz-corpus").join(target);
        std::fs::create_dir_all(&scratch)
            .with_context(|| format!("cannot create {}", scratch.display()))?;
        let committed = root().join("fuzz/corpus").join(target);
        println!("==> fuzzing {target} for {seconds}s");
        let out = cargo_fuzz("run")
            .arg(target)
            .arg(&scratch)
            .arg(&committed)
            .arg("--")
            .arg(format!("-max_total_time={seconds}"))
            .args(["-timeout=10", "-rss_limit_mb=2048", "-print_final_stats=1"])
            .args(libfuzzer)
            .output()
            .with_context(|| format!("cannot run cargo fuzz for {target}"))?;
        let log = String::from_utf8_lossy(&out.stderr);
        let runs = log
            .lines()
            .find_map(|l| l.strip_prefix("stat::number_of_executed_units:"))
            .map(|v| v.trim().to_owned())
            .unwrap_or_else(|| "?".into());
        let cov = log
            .lines()
            .rev()
            .find_map(|l| {
                l.split_once(" cov: ")
                    .map(|(_, r)| r.split_whitespace().next().unwrap_or("?").to_owned())
            })
            .unwrap_or_else(|| "?".into());
        if !out.status.success() {
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            for l in tail.iter().rev() {
                println!("{l}");
            }
            bail!(
                "fuzz target {target} failed ({}): the crashing input is under fuzz/artifacts/{target}/ — \
                 fix it, then copy it to fuzz/artifacts-regressions/{target}/ so `./x test` replays it",
                out.status
            );
        }
        println!("    {target}: {runs} runs, coverage {cov}");
        summary.push(format!("{target}: {runs} runs in {seconds}s, cov {cov}"));
        if merge {
            println!(
                "==> merging new {target} inputs into {}",
                committed.display()
            );
            run(cargo_fuzz("run")
                .arg(target)
                .arg(&committed)
                .arg(&scratch)
                .args(["--", "-merge=1"]))?;
        }
    }
    println!("==> fuzzing done\n{}", summary.join("\n"));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(argv: &[&str]) -> Task {
        let mut full = vec!["cargo xtask"];
        full.extend_from_slice(argv);
        Args::try_parse_from(&full)
            .unwrap_or_else(|e| panic!("{argv:?} refused: {e}"))
            .task
    }

    fn bench_args(argv: &[&str]) -> Vec<String> {
        match task(argv) {
            Task::Bench { args } => args,
            _ => panic!("{argv:?}: not bench"),
        }
    }

    /// `./x bench --rounds 1` (the README's form) hands kvpn-bench its flags as
    /// given; on main clap refused it with "unexpected argument '--rounds'" and
    /// only `./x bench -- --rounds 1` worked, which still does.
    #[test]
    fn bench_passes_its_own_flags_through() {
        assert_eq!(bench_args(&["bench", "--rounds", "1"]), ["--rounds", "1"]);
        assert_eq!(
            bench_args(&["bench", "--rounds", "2", "--workers", "4", "--plain-only"]),
            ["--rounds", "2", "--workers", "4", "--plain-only"]
        );
        assert_eq!(
            bench_args(&["bench", "--", "--rounds", "1"]),
            ["--rounds", "1"]
        );
        assert_eq!(
            bench_args(&["bench", "--busy-fraction", "-0.5"]),
            ["--busy-fraction", "-0.5"]
        );
        assert!(bench_args(&["bench"]).is_empty());
    }

    /// `./x test -p kvpn-control --lib` reaches cargo test as given.
    #[test]
    fn test_passes_cargo_test_flags_through() {
        let Task::Test { args } = task(&["test", "-p", "kvpn-control", "--lib"]) else {
            panic!("not test");
        };
        assert_eq!(args, ["-p", "kvpn-control", "--lib"]);
    }

    /// The soak's flags as the README writes them, in any order; anything else
    /// goes to kvpn-soak as given.
    #[test]
    fn soak_takes_its_flags_and_passes_the_rest_through() {
        let Task::Soak {
            seconds,
            rate,
            json,
            args,
        } = task(&[
            "soak",
            "--seconds",
            "60",
            "--json",
            "/tmp/soak.json",
            "--rate",
            "2.5",
        ])
        else {
            panic!("not soak");
        };
        assert_eq!(
            (seconds, rate, json, args),
            (60, 2.5, Some(PathBuf::from("/tmp/soak.json")), vec![])
        );
        let Task::Soak { seconds, args, .. } = task(&["soak"]) else {
            panic!("not soak");
        };
        assert_eq!((seconds, args), (600, vec![]));
        let Task::Soak { seconds, args, .. } = task(&["soak", "--", "--seconds", "45"]) else {
            panic!("not soak");
        };
        // kvpn-soak takes the last --seconds: the one given after `--`.
        assert_eq!(
            (seconds, args),
            (600, vec!["--seconds".into(), "45".into()])
        );
        assert!(
            Args::try_parse_from(["cargo xtask", "soak", "--seconds", "x"]).is_err(),
            "--seconds x was accepted"
        );
    }

    /// `./x fuzz --seconds 60 --merge dns_query -- -max_len=512`: fuzz's own
    /// flags and targets, and libFuzzer's flags after `--`.
    #[test]
    fn fuzz_takes_its_flags_targets_and_libfuzzer_flags() {
        let Task::Fuzz {
            seconds,
            merge,
            targets,
            libfuzzer,
        } = task(&[
            "fuzz",
            "--seconds",
            "60",
            "--merge",
            "dns_query",
            "frame",
            "--",
            "-max_len=512",
            "-jobs=2",
        ])
        else {
            panic!("not fuzz");
        };
        assert_eq!((seconds, merge), (60, true));
        assert_eq!(targets, ["dns_query", "frame"]);
        assert_eq!(libfuzzer, ["-max_len=512", "-jobs=2"]);
        let Task::Fuzz {
            seconds,
            merge,
            targets,
            libfuzzer,
        } = task(&["fuzz", "dns_query", "--seconds", "5"])
        else {
            panic!("not fuzz");
        };
        assert_eq!((seconds, merge), (5, false));
        assert_eq!(targets, ["dns_query"]);
        assert!(libfuzzer.is_empty());
    }
}
