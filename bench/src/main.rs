//! `kvpn-bench`: brings up a lab, measures the raw path (laptop routed straight
//! to the pod over veth), the kvpn direct-TCP path and, on the Kubernetes lab, the
//! kvpn port-forward path (through the API server, TLS inside), kvpn over SSH
//! (ssh-direct data path through an sshd on the node) and sshuttle through the same
//! sshd (the peer), in the same run; prints a table of absolute figures and ratios
//! to raw veth (and kvpn over SSH / sshuttle), and writes JSON under the target
//! folder. One round per path (no alternation yet), so figures taken under outside
//! load vary; the load average is recorded with them.
#![allow(clippy::print_stdout, reason = "the bench reports on stdout")]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kvpn_bench::{PathResult, Ratios, iperf3_receiver_gbps, ping_avg_ms};
use kvpn_lab::k8s::kubelet::spec::netns_role;
use kvpn_lab::k8s::workloads::{DEV_NAMESPACE, Workloads};
use kvpn_lab::k8s::{K8sLab, K8sLabOptions};
use kvpn_lab::{BACKEND_1_IP, BACKEND_1_POD, ECHO_PORT, LAPTOP, Lab, LabOptions, NODE_UPLINK_IP};

mod ssh;

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

/// iperf3 from the laptop netns with `streams` parallel streams: the receiver's
/// Gbit/s. An iperf3 server runs one test at a time and may still be closing the
/// previous one when the next client arrives ("the server is busy running a test"):
/// that answer is retried, at most 10 times 300 ms apart; every other error is not.
fn iperf3(lab: &Lab, target: &str, port: &str, secs: &str, streams: &str) -> Result<f64> {
    let args = [
        "iperf3", "-c", target, "-p", port, "-t", secs, "-P", streams, "-J",
    ];
    let mut tries = 0;
    loop {
        tries += 1;
        // iperf3 -J reports a refused test in its JSON (and exits 1): parse either way.
        let out = lab.exec_in(LAPTOP, &args)?;
        let json = String::from_utf8_lossy(&out.stdout);
        match iperf3_receiver_gbps(&json) {
            Ok(gbps) if out.status.success() => return Ok(gbps),
            Err(e) if e.contains("server is busy") && tries < 10 => {
                std::thread::sleep(Duration::from_millis(300));
            }
            Err(e) => bail!(
                "{args:?}: {e}; stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            ),
            Ok(_) => bail!(
                "{args:?} failed: {json}{}",
                String::from_utf8_lossy(&out.stderr)
            ),
        }
    }
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

/// iperf3 1 and 4 streams, ping (unless `icmp` is false: the path carries no ICMP)
/// and request/response from the laptop netns to `target`.
fn measure(
    lab: &Lab,
    path: &str,
    target: Ipv4Addr,
    seconds: u32,
    icmp: bool,
) -> Result<PathResult> {
    println!("==> measuring {path}");
    let ip = target;
    let target = target.to_string();
    let secs = seconds.to_string();
    let port = IPERF_PORT.to_string();
    let one = iperf3(lab, &target, &port, &secs, "1")?;
    let four = iperf3(lab, &target, &port, &secs, "4")?;
    let ping = if icmp {
        let out = laptop_output(lab, &["ping", "-c", "50", "-i", "0.02", "-q", &target])?;
        Some(ping_avg_ms(&out).map_err(anyhow::Error::msg)?)
    } else {
        None
    };
    let addr = SocketAddr::from((ip, ECHO_PORT));
    let rr_for = Duration::from_secs(u64::from(seconds.clamp(1, 3)));
    let rr = lab.run_in(LAPTOP, move || request_response(addr, rr_for))??;
    let r = PathResult {
        path: path.to_string(),
        tcp_1_gbps: one,
        tcp_4_gbps: four,
        ping_avg_ms: ping,
        rr_per_sec: rr,
    };
    println!("    {r:?}");
    Ok(r)
}

fn kvpn(lab: &Lab, runtime: &Path, args: &[&str]) -> Result<String> {
    kvpn_home(lab, runtime, args, None)
}

/// `kvpn <args>` in the laptop netns; `home` replaces HOME (the SSH runs: no
/// ~/.ssh of the machine's user is read). Returns stdout.
fn kvpn_home(lab: &Lab, runtime: &Path, args: &[&str], home: Option<&Path>) -> Result<String> {
    let bin = kvpn_lab::bin_path("kvpn")?;
    let mut cmd = lab.command_in(LAPTOP, &bin.to_string_lossy())?;
    cmd.args(args).env("KVPN_RUNTIME_DIR", runtime);
    if let Some(h) = home {
        cmd.env("HOME", h)
            .env_remove("SSH_AUTH_SOCK")
            .env_remove("KVPN_SSH_CONFIG")
            .env_remove("KVPN_SSH_KNOWN_HOSTS");
    }
    let out = cmd.output()?;
    if !out.status.success() {
        bail!("kvpn {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The sessions' data paths from `kvpn status -o json`.
fn data_paths(lab: &Lab, runtime: &Path) -> Result<Vec<String>> {
    let out = kvpn(lab, runtime, &["status", "-o", "json"])?;
    let v: serde_json::Value =
        serde_json::from_str(&out).with_context(|| format!("kvpn status -o json: {out}"))?;
    Ok(v["sessions"]
        .as_array()
        .map(|s| {
            s.iter()
                .map(|s| s["data_path"].as_str().unwrap_or_default().to_owned())
                .collect()
        })
        .unwrap_or_default())
}

/// The Kubernetes lab's rows: port-forward, kvpn over SSH, sshuttle.
struct KubePaths {
    port_forward: PathResult,
    ssh: PathResult,
    sshuttle: PathResult,
}

/// The Kubernetes lab, all to a web backend pod running iperf3:
/// - `kvpn connect --kubeconfig` (manager installed by kvpn, data channel over
///   `pods/portforward` through the API server, TLS inside);
/// - the same with `--ssh-addr` to an sshd in the node netns: every kube call and
///   the data channel (ssh-direct, checked in `kvpn status`) go through SSH;
/// - sshuttle through the same sshd to the pod CIDR (TCP only).
fn kube_paths(seconds: u32) -> Result<KubePaths> {
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
        lab.wait_listening(&role, IPERF_PORT, Duration::from_secs(5))?;
        let runtime = lab.dir().join("runtime");
        let kubeconfig = k8s.laptop_user_kubeconfig().to_string_lossy().into_owned();
        // quit also after a failed connect: it may have started the daemons.
        let port_forward = kvpn(lab, &runtime, &["connect", "--kubeconfig", &kubeconfig])
            .and_then(|_| measure(lab, "kvpn-port-forward", ip, seconds, true));
        let _ = kvpn(lab, &runtime, &["quit"]);
        let port_forward = port_forward?;

        println!("==> starting sshd in the node netns");
        let service_cidr = k8s.addressing().service_cidr.to_string();
        let sshd = ssh::NodeSshd::start(lab, NODE_UPLINK_IP, &service_cidr)?;
        let ssh_rows = (|| {
            let (key, kh) = (
                sshd.key.to_string_lossy().into_owned(),
                sshd.known_hosts.to_string_lossy().into_owned(),
            );
            let addr = sshd.addr.to_string();
            let connect = [
                "connect",
                "--kubeconfig",
                &kubeconfig,
                "--ssh-addr",
                &addr,
                "--ssh-username",
                "root",
                "--ssh-keyfile",
                &key,
                "--ssh-known-hosts",
                &kh,
            ];
            let ssh = (|| {
                kvpn_home(lab, &runtime, &connect, Some(&sshd.home))?;
                let paths = data_paths(lab, &runtime)?;
                if !paths.iter().any(|p| p.starts_with("ssh-direct")) {
                    bail!(
                        "kvpn over SSH did not choose the ssh-direct data path (status says {paths:?}); \
                         see the agent logs under {}",
                        runtime.display()
                    );
                }
                println!("    data path: {paths:?}");
                measure(lab, "kvpn-ssh", ip, seconds, true)
            })();
            let _ = kvpn(lab, &runtime, &["quit"]);
            let ssh = ssh?;

            println!("==> starting sshuttle in the laptop netns");
            let shuttle = ssh::Sshuttle::start(
                lab,
                &sshd,
                &kvpn_lab::POD_CIDR.to_string(),
                SocketAddr::from((ip, ECHO_PORT)),
            )?;
            let sshuttle = measure(lab, "sshuttle", ip, seconds, false);
            shuttle.stop(lab);
            Ok::<_, anyhow::Error>((ssh, sshuttle?))
        })();
        sshd.stop(lab);
        let (ssh, sshuttle) = ssh_rows?;
        Ok(KubePaths {
            port_forward,
            ssh,
            sshuttle,
        })
    })();
    k8s.down()?;
    result
}

/// `/proc/loadavg`'s 1-minute figure (figures taken under outside load are not
/// representative).
fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn main() -> Result<()> {
    let args = Args::parse();
    kvpn_lab::require_root()?;
    let load_before = load_average();
    println!("==> bringing up the lab");
    let mut lab = Lab::up(LabOptions::default()).context("lab up")?;
    let mut iperf = Command::new("iperf3");
    iperf.args(["-s", "-p", &IPERF_PORT.to_string()]);
    lab.spawn_in(BACKEND_1_POD, "iperf3", &iperf)?;
    lab.wait_listening(BACKEND_1_POD, IPERF_PORT, Duration::from_secs(5))?;

    lab.add_laptop_direct_routes()?;
    let raw = measure(&lab, "raw-veth", BACKEND_1_IP, args.seconds, true);
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
    let via = measure(&lab, "kvpn-direct", BACKEND_1_IP, args.seconds, true);
    let _ = kvpn(&lab, &runtime, &["quit"]);
    lab.down()?;
    let via = via?;
    let kube = kube_paths(args.seconds)?;
    let load_after = load_average();

    println!();
    println!(
        "load average (1 min): {} before, {} after; this machine has {} cores",
        load_before.map_or("?".into(), |l| format!("{l:.2}")),
        load_after.map_or("?".into(), |l| format!("{l:.2}")),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    print!(
        "{}",
        kvpn_bench::table(
            &raw,
            &[&via, &kube.port_forward, &kube.ssh, &kube.sshuttle],
            Some((&kube.ssh, &kube.sshuttle)),
        )
    );
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
        "seconds": args.seconds,
        "rounds": 1,
        "load_average_1m": { "before": load_before, "after": load_after },
        "raw_veth": raw,
        "kvpn_direct": via,
        "kvpn_port_forward": kube.port_forward,
        "kvpn_ssh": kube.ssh,
        "sshuttle": kube.sshuttle,
        "ratios": {
            "kvpn_direct": Ratios::of(&via, &raw),
            "kvpn_port_forward": Ratios::of(&kube.port_forward, &raw),
            "kvpn_ssh": Ratios::of(&kube.ssh, &raw),
            "sshuttle": Ratios::of(&kube.sshuttle, &raw),
            "kvpn_ssh_over_sshuttle": Ratios::of(&kube.ssh, &kube.sshuttle),
        }
    });
    std::fs::write(&json_path, serde_json::to_string_pretty(&report)?)?;
    println!("\nJSON report: {}", json_path.display());
    Ok(())
}
