//! `kvpn-bench`: brings up a lab, measures the raw path (laptop routed straight
//! to the pod over veth), the kvpn direct-TCP path and, on the Kubernetes lab, the
//! kvpn port-forward path (through the API server, TLS inside) in the same run, prints a table of
//! absolute figures and ratios, and writes JSON under the target folder.
#![allow(clippy::print_stdout, reason = "the bench reports on stdout")]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kvpn_bench::{PathResult, iperf3_receiver_gbps, ping_avg_ms};
use kvpn_lab::k8s::kubelet::spec::netns_role;
use kvpn_lab::k8s::workloads::{DEV_NAMESPACE, Workloads};
use kvpn_lab::k8s::{K8sLab, K8sLabOptions};
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

fn measure(lab: &Lab, path: &str, target: Ipv4Addr, seconds: u32) -> Result<PathResult> {
    println!("==> measuring {path}");
    let ip = target;
    let target = target.to_string();
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
    let addr = SocketAddr::from((ip, ECHO_PORT));
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

/// `path`'s figures over the baseline's (RTT: lower is better, so > 1 is slower).
fn ratios(path: &PathResult, raw: &PathResult) -> serde_json::Value {
    serde_json::json!({
        "tcp_1": path.tcp_1_gbps / raw.tcp_1_gbps,
        "tcp_4": path.tcp_4_gbps / raw.tcp_4_gbps,
        "ping_rtt": path.ping_avg_ms / raw.ping_avg_ms,
        "rr": path.rr_per_sec / raw.rr_per_sec,
    })
}

/// The Kubernetes lab: `kvpn connect --kubeconfig` (manager installed by kvpn,
/// data channel over `pods/portforward` through the API server, TLS inside) to a
/// web backend pod running iperf3.
fn port_forward_path(seconds: u32) -> Result<PathResult> {
    println!("==> bringing up the Kubernetes lab");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let options = K8sLabOptions::default().workloads(Workloads {
        manager: false,
        ..Default::default()
    });
    let k8s = rt
        .block_on(K8sLab::up(options))
        .context("Kubernetes lab up")?;
    let result = (|| {
        let admin = rt.block_on(k8s.admin_client())?;
        let pods: Api<Pod> = Api::namespaced(admin, DEV_NAMESPACE);
        let list = rt.block_on(pods.list(&ListParams::default().labels("app=web")))?;
        let (name, uid, ip) = list
            .items
            .iter()
            .find_map(|p| {
                let ip: Ipv4Addr = p.status.as_ref()?.pod_ip.as_ref()?.parse().ok()?;
                Some((p.metadata.name.clone()?, p.metadata.uid.clone()?, ip))
            })
            .context("no web pod with an IP in the Kubernetes lab")?;
        let lab = k8s.netns_lab();
        let role = netns_role(&name, &uid);
        let mut iperf = Command::new("iperf3");
        iperf.args(["-s", "-p", &IPERF_PORT.to_string()]);
        lab.spawn_in(&role, "iperf3-web", &iperf)?;
        lab.wait_tcp(
            &role,
            SocketAddr::from((ip, IPERF_PORT)),
            Duration::from_secs(5),
        )?;
        let runtime = lab.dir().join("runtime");
        let kubeconfig = k8s.laptop_user_kubeconfig().to_string_lossy().into_owned();
        kvpn(lab, &runtime, &["connect", "--kubeconfig", &kubeconfig])?;
        let r = measure(lab, "kvpn-port-forward", ip, seconds);
        let _ = kvpn(lab, &runtime, &["quit"]);
        r
    })();
    k8s.down()?;
    result
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
    let raw = measure(&lab, "raw-veth", BACKEND_1_IP, args.seconds);
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
    let via = measure(&lab, "kvpn-direct", BACKEND_1_IP, args.seconds);
    let _ = kvpn(&lab, &runtime, &["quit"]);
    lab.down()?;
    let via = via?;
    let pf = port_forward_path(args.seconds)?;

    println!();
    println!(
        "{:<24} {:>10} {:>12} {:>7} {:>14} {:>7}",
        "metric", "raw veth", "kvpn direct", "ratio", "port-forward", "ratio"
    );
    let rows = [
        (
            "TCP 1 stream (Gbit/s)",
            raw.tcp_1_gbps,
            via.tcp_1_gbps,
            pf.tcp_1_gbps,
        ),
        (
            "TCP 4 streams (Gbit/s)",
            raw.tcp_4_gbps,
            via.tcp_4_gbps,
            pf.tcp_4_gbps,
        ),
        (
            "ping RTT avg (ms)",
            raw.ping_avg_ms,
            via.ping_avg_ms,
            pf.ping_avg_ms,
        ),
        (
            "TCP req/resp (1/s)",
            raw.rr_per_sec,
            via.rr_per_sec,
            pf.rr_per_sec,
        ),
    ];
    for (name, a, b, c) in rows {
        println!(
            "{name:<24} {a:>10.3} {b:>12.3} {:>6.3}x {c:>14.3} {:>6.3}x",
            b / a,
            c / a
        );
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
        "kvpn_direct": via,
        "kvpn_port_forward": pf,
        "ratios": {
            "kvpn_direct": ratios(&via, &raw),
            "kvpn_port_forward": ratios(&pf, &raw),
        }
    });
    std::fs::write(&json_path, serde_json::to_string_pretty(&report)?)?;
    println!("\nJSON report: {}", json_path.display());
    Ok(())
}
