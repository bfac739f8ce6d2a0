//! `kvpn-bench`: brings up a lab, measures the raw path (laptop routed straight
//! to the pod over veth) and the kvpn path in the same run, prints a table of
//! absolute figures and ratios, and writes JSON under the target folder.
#![allow(clippy::print_stdout, reason = "the bench reports on stdout")]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use kvpn_bench::{PathResult, iperf3_receiver_gbps, ping_avg_ms};
use kvpn_lab::{BACKEND_1_IP, BACKEND_1_POD, ECHO_PORT, LAPTOP, Lab, LabOptions};

#[derive(Parser)]
#[command(about = "kvpn benchmarks against a raw veth baseline measured in the same run")]
struct Args {
    /// Seconds per iperf3 run.
    #[arg(long, default_value_t = 5)]
    seconds: u32,
    /// Where to write the JSON report (default: <target>/bench/kvpn-bench.json).
    #[arg(long)]
    json: Option<PathBuf>,
}

const IPERF_PORT: u16 = 5201;

fn laptop_output(lab: &Lab, args: &[&str]) -> Result<String> {
    let out = lab.exec_in(LAPTOP, args)?;
    if !out.status.success() {
        bail!(
            "{args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// 1-byte ping-pong on one TCP connection to the echo server, for `dur`.
fn request_response(addr: SocketAddr, dur: Duration) -> Result<f64> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).context("rr connect")?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let start = Instant::now();
    let mut n = 0u64;
    let mut b = [0u8; 1];
    while start.elapsed() < dur {
        s.write_all(b"x")?;
        s.read_exact(&mut b)?;
        n += 1;
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

fn measure(lab: &Lab, path: &str, seconds: u32) -> Result<PathResult> {
    println!("==> measuring {path}");
    let target = BACKEND_1_IP.to_string();
    let secs = seconds.to_string();
    let port = IPERF_PORT.to_string();
    let one = laptop_output(
        lab,
        &["iperf3", "-c", &target, "-p", &port, "-t", &secs, "-J"],
    )?;
    let four = laptop_output(
        lab,
        &[
            "iperf3", "-c", &target, "-p", &port, "-t", &secs, "-P", "4", "-J",
        ],
    )?;
    let ping = laptop_output(lab, &["ping", "-c", "50", "-i", "0.02", "-q", &target])?;
    let addr = SocketAddr::from((BACKEND_1_IP, ECHO_PORT));
    let rr = lab.run_in(LAPTOP, move || {
        request_response(addr, Duration::from_secs(3))
    })??;
    let r = PathResult {
        path: path.to_string(),
        tcp_1_gbps: iperf3_receiver_gbps(&one).map_err(anyhow::Error::msg)?,
        tcp_4_gbps: iperf3_receiver_gbps(&four).map_err(anyhow::Error::msg)?,
        ping_avg_ms: ping_avg_ms(&ping).map_err(anyhow::Error::msg)?,
        rr_per_sec: rr,
    };
    println!("    {r:?}");
    Ok(r)
}

fn kvpn(lab: &Lab, runtime: &std::path::Path, args: &[&str]) -> Result<()> {
    let bin = kvpn_lab::bin_path("kvpn")?;
    let out = lab
        .command_in(LAPTOP, &bin.to_string_lossy())?
        .args(args)
        .env("KVPN_RUNTIME_DIR", runtime)
        .output()?;
    if !out.status.success() {
        bail!("kvpn {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    kvpn_lab::require_root()?;
    println!("==> bringing up the lab");
    let mut lab = Lab::up(LabOptions::default()).context("lab up")?;
    let mut iperf = Command::new("iperf3");
    iperf.args(["-s", "-p", &IPERF_PORT.to_string()]);
    lab.spawn_in(BACKEND_1_POD, "iperf3", &iperf)?;
    lab.wait_tcp(
        BACKEND_1_POD,
        SocketAddr::from((BACKEND_1_IP, IPERF_PORT)),
        Duration::from_secs(5),
    )?;

    lab.add_laptop_direct_routes()?;
    let raw = measure(&lab, "raw-veth", args.seconds);
    lab.remove_laptop_direct_routes()?;
    let raw = raw?;

    let runtime = lab.dir().join("runtime");
    let mut connect: Vec<String> = vec!["connect".into()];
    connect.extend([
        "--manager".into(),
        kvpn_lab::MANAGER_ADDR_FROM_LAPTOP.to_string(),
        "--pod-cidr".into(),
        kvpn_lab::POD_CIDR.to_string(),
        "--service-cidr".into(),
        kvpn_lab::SERVICE_CIDR.to_string(),
    ]);
    kvpn(
        &lab,
        &runtime,
        &connect.iter().map(String::as_str).collect::<Vec<_>>(),
    )?;
    let via = measure(&lab, "kvpn", args.seconds);
    let _ = kvpn(&lab, &runtime, &["quit"]);
    lab.down()?;
    let via = via?;

    println!();
    println!(
        "{:<28} {:>12} {:>12} {:>8}",
        "metric", "raw veth", "kvpn", "ratio"
    );
    let rows = [
        (
            "TCP 1 stream (Gbit/s)",
            raw.tcp_1_gbps,
            via.tcp_1_gbps,
            via.tcp_1_gbps / raw.tcp_1_gbps,
        ),
        (
            "TCP 4 streams (Gbit/s)",
            raw.tcp_4_gbps,
            via.tcp_4_gbps,
            via.tcp_4_gbps / raw.tcp_4_gbps,
        ),
        (
            "ping RTT avg (ms)",
            raw.ping_avg_ms,
            via.ping_avg_ms,
            via.ping_avg_ms / raw.ping_avg_ms,
        ),
        (
            "TCP req/resp (1/s)",
            raw.rr_per_sec,
            via.rr_per_sec,
            via.rr_per_sec / raw.rr_per_sec,
        ),
    ];
    for (name, a, b, r) in rows {
        println!("{name:<28} {a:>12.3} {b:>12.3} {r:>7.3}x");
    }
    let json_path = args.json.unwrap_or_else(|| {
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("target"));
        target.join("bench").join("kvpn-bench.json")
    });
    if let Some(dir) = json_path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let report = serde_json::json!({
        "raw_veth": raw,
        "kvpn": via,
        "ratios": {
            "tcp_1": via.tcp_1_gbps / raw.tcp_1_gbps,
            "tcp_4": via.tcp_4_gbps / raw.tcp_4_gbps,
            "ping_rtt": via.ping_avg_ms / raw.ping_avg_ms,
            "rr": via.rr_per_sec / raw.rr_per_sec,
        }
    });
    std::fs::write(&json_path, serde_json::to_string_pretty(&report)?)?;
    println!("\nJSON report: {}", json_path.display());
    Ok(())
}
