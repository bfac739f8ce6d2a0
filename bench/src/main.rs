//! `kvpn-bench`: the performance record of issue #8. In one run it brings up the
//! plain lab and then the Kubernetes lab and, round after round (`--rounds`, default
//! 3), measures each lab's raw-veth baseline (the laptop routed straight to the pod)
//! and then every subject of that lab, so baseline and subjects alternate:
//! - plain lab: raw veth, kvpn direct, kvpn direct with 10,000 extra /32 routes
//!   (`kvpn connect --cidr` ×10,000: the routes and the TUN classifier the product
//!   really installs; where the connect refuses that many — the eBPF classifier's
//!   route trie held 1,024 routes until `MAX_ROUTES` became 16,384 — 1,000, and the
//!   report says so in a note and in the row's "extra /32 routes" figure, and the
//!   10,000-route load goal is not measured), a socat TCP relay in the node netns
//!   (Debian socat); then, after those rounds (a flood's leftover flows would
//!   count in the kvpn rows' manager memory), the rounds of flood fairness
//!   between two laptops ([`fairness`]; alone with `--fairness-only`);
//! - Kubernetes lab: raw veth, kvpn over port-forward (through the API server, TLS
//!   inside), kvpn over SSH (ssh-direct through an sshd on the node) and sshuttle
//!   through the same sshd.
//!
//! Per row and round: TCP 1/4/8 streams up and down (iperf3, `-R`), idle ping RTT and
//! ping RTT during a 1-stream iperf3 (p50, and added over the same round's baseline),
//! 1-byte request/response, connection setup rate, UDP 64-byte packets/s and loss,
//! CPU core-seconds per Gbit, and on kvpn rows the manager's RSS per session and per
//! idle TCP flow (the plain lab's kvpn rows each start on a fresh manager, so the
//! memory is that session's, and the idle flows are opened before the bulk runs;
//! the Kubernetes lab's manager serves every row, so the RSS a session adds there
//! is "not measured"). The report — median and min–max per metric — goes to stdout and to
//! `bench.md`, `bench.svg` and `kvpn-bench.json` under `<target>/bench/`, with the #8
//! goals as "goal met / NOT met" lines. The bench refuses to report (exit 2) when
//! the CPU outside the measurements was busy (see [`Args::max_busy`]); `--force`
//! reports anyway, marked so.
#![allow(clippy::print_stdout, reason = "the bench reports on stdout")]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kvpn_bench::{
    LoadVerdict, NOT_MEASURED, Row, Sample, goal_lines, goals, iperf3_receiver_gbps, iperf3_udp,
    markdown_table, own_ratios, p50, pair_ratio, pair_with_baseline, ping_rtts_ms,
    proc_pid_cpu_ticks, proc_stat_busy_total, svg_chart, vm_rss_kib,
};
use kvpn_lab::k8s::workloads::DEV_NAMESPACE;
use kvpn_lab::k8s::{K8sLab, K8sLabOptions, RealNodeOptions};
use kvpn_lab::{
    BACKEND_1_IP, BACKEND_1_POD, ECHO_PORT, LAPTOP, Lab, LabOptions, NODE, NODE_UPLINK_IP,
};

mod fairness;
mod interrupt;
mod port_forward;
mod ssh;

#[derive(Parser)]
#[command(
    about = "kvpn benchmarks against a raw veth baseline measured in the same run",
    after_help = "Exit status: 0 report written; 1 the run failed (the rounds that finished \
                  are reported); 2 a usage error, or the report refused for outside load \
                  (--max-busy); 130, 143, 129 stopped by SIGINT, SIGTERM, SIGHUP (the labs \
                  and everything the bench started are removed first)."
)]
struct Args {
    /// Seconds per iperf3 run (and per ping series), at least 1.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    seconds: u32,
    /// Rounds, at least 1; each round measures the baseline, then every subject.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// The most CPU the machine may spend outside the measurements, as a fraction of
    /// all cores (0 to 1), sampled for 1 s before the first round and after every
    /// round (the labs idle then): above it the figures are not representative and
    /// the bench refuses to report. 0.25 on 2 cores is half a core.
    #[arg(long, default_value_t = 0.25, value_parser = busy_fraction, allow_negative_numbers = true)]
    max_busy: f64,
    /// Report even when the outside CPU load was above --max-busy (marked so).
    #[arg(long)]
    force: bool,
    /// UDP offered rate for the 64-byte test (iperf3 -b; 0 is as fast as iperf3 can).
    #[arg(long, default_value = "100M")]
    udp_rate: String,
    /// Folder of bench.md, bench.svg and kvpn-bench.json (default: <target>/bench).
    #[arg(long)]
    out_dir: Option<PathBuf>,
    /// Where to write the JSON report (default: <out-dir>/kvpn-bench.json).
    #[arg(long)]
    json: Option<PathBuf>,
    /// An earlier JSON report: print old → new medians per row and metric.
    #[arg(long)]
    compare: Option<PathBuf>,
    /// Only the flood-fairness row (plain lab): laptop B's TCP throughput alone
    /// and under laptop A's SYN and UDP floods (docs/benchmarks.md: the kvpn-fairness row).
    #[arg(long)]
    fairness_only: bool,
    /// Also measure kvpn direct with `kvpn connect --workers N` (row
    /// `kvpn-direct-workers-N`, right after `kvpn-direct` in each round); 1 = no
    /// extra row.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=16))]
    workers: u16,
    /// Only the plain lab's rows (raw veth, kvpn direct, socat): no Kubernetes lab.
    #[arg(long)]
    plain_only: bool,
    /// Only the latency figures of the plain lab, for iterating on the data path:
    /// raw veth and kvpn direct (and `--workers N`) with TCP 1 and 4 streams up,
    /// idle and busy ping RTT; no fairness, classifier or socat rows, no
    /// Kubernetes lab.
    #[arg(long)]
    latency_only: bool,
    /// Only the SSH rows of the Kubernetes lab (raw veth, kvpn over SSH, sshuttle):
    /// no plain lab, no port-forward or source-policy rows.
    #[arg(long, conflicts_with_all = ["plain_only", "fairness_only", "latency_only"])]
    ssh_only: bool,
}

/// `--max-busy`: a share of all cores, 0 to 1.
fn busy_fraction(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number; give a share of all cores, 0 to 1"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!(
            "{s} is not a share of all cores: give 0 to 1 (0.25 on 2 cores is half a core)"
        ))
    }
}

/// An error in what the user asked for (not root, an unreadable `--compare`
/// report): exit status 2, like clap's usage errors, not 1 (the run failed).
#[derive(Debug)]
struct UsageError(String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

const IPERF_PORT: u16 = 5201;
/// socat's relay ports on the node's uplink address (to the pod's iperf3 and echo).
const SOCAT_IPERF_PORT: u16 = 15201;
const SOCAT_ECHO_PORT: u16 = 17007;
/// Idle TCP flows opened through kvpn to measure the manager's memory per flow.
const IDLE_FLOWS: usize = 1000;
/// Connections of the setup-rate test: below the manager's new-flow burst (4096 per
/// session, manager/src/limit.rs) together with the idle flows, so the figure is the
/// path's setup cost, not the admission limit.
const SETUP_CONNECTS: u32 = 1000;
/// Extra routes of the classifier row: the #8 figure, then, if kvpn refuses the
/// first, a count that fit even the eBPF classifier's old route trie (1,024 routes
/// with the pod and service CIDRs; `MAX_ROUTES` in dataplane-common).
const EXTRA_ROUTES: [u32; 2] = [10_000, 1_000];
/// The classifier row.
const MANY_ROUTES: &str = "kvpn-direct-many-routes";

/// Where a row's traffic goes from the laptop netns.
#[derive(Clone, Copy)]
struct Target {
    iperf: SocketAddr,
    echo: SocketAddr,
    /// The address to ping; `None` where the path carries no ICMP (socat, sshuttle).
    icmp: Option<Ipv4Addr>,
    /// Whether the path carries UDP.
    udp: bool,
}

impl Target {
    fn pod(ip: Ipv4Addr, icmp_udp: bool) -> Self {
        Target {
            iperf: SocketAddr::from((ip, IPERF_PORT)),
            echo: SocketAddr::from((ip, ECHO_PORT)),
            icmp: icmp_udp.then_some(ip),
            udp: icmp_udp,
        }
    }
}

struct Bench {
    seconds: u32,
    udp_rate: String,
    max_busy: f64,
    /// USER_HZ of /proc/<pid>/stat and /proc/stat.
    clk_tck: f64,
    load: Vec<serde_json::Value>,
    notes: std::cell::RefCell<Vec<String>>,
    /// `--latency-only`: [`Bench::measure`] takes only the latency figures.
    latency_only: bool,
}

/// Runs `args` in the laptop netns to completion, unless the bench is interrupted
/// (then the tool is killed: [`interrupt::output`]).
fn laptop_exec(lab: &Lab, args: &[&str]) -> Result<std::process::Output> {
    let (program, rest) = args.split_first().context("empty command")?;
    interrupt::output(lab.command_in(LAPTOP, program)?.args(rest))
}

fn laptop_output(lab: &Lab, args: &[&str]) -> Result<String> {
    let out = laptop_exec(lab, args)?;
    if !out.status.success() {
        bail!(
            "{args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `iperf3 -J <args>` from the laptop netns; returns its JSON. An iperf3 server runs
/// one test at a time and may still be closing the previous one when the next client
/// arrives: it answers "the server is busy running a test", or, between closing and
/// reopening its listening socket, refuses the connection ("unable to connect to
/// server: Connection refused", seen once through port-forward in CI). Those two
/// answers are retried, at most 10 times 300 ms apart; every other error is not.
fn iperf3_json(
    lab: &Lab,
    args: &[&str],
    parse: impl Fn(&str) -> Result<(), String>,
) -> Result<String> {
    // A path that carries nothing fails the row in 5 s instead of hanging the run
    // (iperf3's control connection otherwise waits out TCP's SYN retries).
    let mut full = vec!["iperf3", "-J", "--connect-timeout", "5000"];
    full.extend_from_slice(args);
    let mut tries = 0;
    loop {
        tries += 1;
        // iperf3 -J reports a refused test in its JSON (and exits 1): parse either way.
        let out = laptop_exec(lab, &full)?;
        let json = String::from_utf8_lossy(&out.stdout).into_owned();
        match parse(&json) {
            Ok(()) if out.status.success() => return Ok(json),
            Err(e) if retryable(&e) && tries < 10 => {
                interrupt::sleep(Duration::from_millis(300))?;
            }
            Err(e) => bail!(
                "{full:?}: {e}; stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            ),
            Ok(()) => bail!(
                "{full:?} failed: {json}{}",
                String::from_utf8_lossy(&out.stderr)
            ),
        }
    }
}

/// An iperf3 error that a server between two tests gives (see [`iperf3_json`]).
fn retryable(error: &str) -> bool {
    error.contains("server is busy")
        || (error.contains("unable to connect to server") && error.contains("Connection refused"))
}

/// TCP throughput (receiver side, Gbit/s) with `streams` streams, up or down (`-R`).
fn iperf3_tcp(lab: &Lab, to: SocketAddr, secs: u32, streams: u32, down: bool) -> Result<f64> {
    let (ip, port, secs, streams) = (
        to.ip().to_string(),
        to.port().to_string(),
        secs.to_string(),
        streams.to_string(),
    );
    let mut args = vec!["-c", &ip, "-p", &port, "-t", &secs, "-P", &streams];
    if down {
        args.push("-R");
    }
    let json = iperf3_json(lab, &args, |j| iperf3_receiver_gbps(j).map(|_| ()))?;
    iperf3_receiver_gbps(&json).map_err(anyhow::Error::msg)
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
        interrupt::check()?;
        s.write_all(b"x")?;
        s.read_exact(&mut b)?;
        n += 1;
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

/// Connection setup rate: sequential connects to the echo server, each proven end to
/// end by one echoed byte and closed with an RST (SO_LINGER 0: no TIME_WAIT to run
/// the laptop out of ports), [`SETUP_CONNECTS`] of them or for `dur`, whichever
/// comes first. Connections per second.
fn connect_rate(addr: SocketAddr, dur: Duration) -> Result<f64> {
    let start = Instant::now();
    let mut n = 0u32;
    let mut b = [0u8; 1];
    while n < SETUP_CONNECTS && start.elapsed() < dur {
        interrupt::check()?;
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(3))
            .with_context(|| format!("connection {n} to {addr}"))?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(3)))?;
        s.write_all(b"x")?;
        s.read_exact(&mut b)
            .with_context(|| format!("echo on connection {n} to {addr}"))?;
        socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO))?;
        n += 1;
    }
    Ok(f64::from(n) / start.elapsed().as_secs_f64())
}

fn read_proc(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

fn machine_busy_total() -> Result<(u64, u64)> {
    read_proc("/proc/stat")
        .as_deref()
        .and_then(proc_stat_busy_total)
        .context("cannot read the cpu line of /proc/stat")
}

fn pids_cpu_ticks(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|p| proc_pid_cpu_ticks(&read_proc(&format!("/proc/{p}/stat"))?))
        .sum()
}

fn rss_kib(pid: u32) -> Option<u64> {
    vm_rss_kib(&read_proc(&format!("/proc/{pid}/status"))?)
}

/// Pids of `comm` in the lab ([`kvpn_lab::lab_pids`]).
fn lab_pids(lab: &Lab, comm: &str) -> Vec<u32> {
    kvpn_lab::lab_pids(lab.id(), comm)
}

/// Restarts the plain lab's manager (same command and environment) and waits until
/// it listens.
fn fresh_manager(lab: &Lab) -> Result<()> {
    let pid = lab
        .restart_manager()
        .context("restart the plain lab's manager for a fresh memory figure")?;
    println!("    fresh kvpn-manager, pid {pid}");
    Ok(())
}

/// The lab's traffic manager ([`kvpn_lab::lab_manager_pid`]).
fn manager_pid(lab: &Lab) -> Option<u32> {
    kvpn_lab::lab_manager_pid(lab.id())
}

/// Opens [`IDLE_FLOWS`] TCP connections through kvpn to the echo server (each proven
/// by one echoed byte; 25 threads, so a path with a long RTT takes no longer than a
/// few RTTs per thread), lets them idle 500 ms and returns the manager's VmRSS
/// growth per flow in KiB.
fn idle_flows_kib(lab: &Lab, echo: SocketAddr, manager: u32) -> Result<f64> {
    const THREADS: usize = 25;
    let before = rss_kib(manager).context("manager VmRSS before the idle flows")?;
    let after = lab.run_in(LAPTOP, move || -> Result<u64> {
        // Threads started here inherit this thread's netns (the laptop's).
        let flows = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..THREADS)
                .map(|w| {
                    scope.spawn(move || -> Result<Vec<TcpStream>> {
                        let mut flows = Vec::new();
                        let mut b = [0u8; 1];
                        for i in (w..IDLE_FLOWS).step_by(THREADS) {
                            interrupt::check()?;
                            let mut s = TcpStream::connect_timeout(&echo, Duration::from_secs(5))
                                .with_context(|| format!("idle flow {i} to {echo}"))?;
                            s.set_read_timeout(Some(Duration::from_secs(5)))?;
                            s.write_all(b"x")?;
                            s.read_exact(&mut b)
                                .with_context(|| format!("echo on idle flow {i} to {echo}"))?;
                            flows.push(s);
                        }
                        Ok(flows)
                    })
                })
                .collect();
            let mut all = Vec::with_capacity(IDLE_FLOWS);
            for w in workers {
                all.extend(
                    w.join()
                        .map_err(|_| anyhow::anyhow!("an idle-flow thread panicked"))??,
                );
            }
            Ok::<_, anyhow::Error>(all)
        })?;
        std::thread::sleep(Duration::from_millis(500));
        let after = rss_kib(manager).context("manager VmRSS with the idle flows")?;
        for s in &flows {
            let _ = socket2::SockRef::from(s).set_linger(Some(Duration::ZERO));
        }
        Ok(after)
    })??;
    Ok(after.saturating_sub(before) as f64 / IDLE_FLOWS as f64)
}

impl Bench {
    /// The share of all cores busy over 1 s (/proc/stat), recorded with `when` and the
    /// 1-minute load average.
    fn sample_load(&mut self, when: &str) -> Result<()> {
        let (b0, t0) = machine_busy_total()?;
        interrupt::sleep(Duration::from_secs(1))?;
        let (b1, t1) = machine_busy_total()?;
        let busy = (b1 - b0) as f64 / (t1 - t0).max(1) as f64;
        let loadavg: Option<f64> =
            read_proc("/proc/loadavg").and_then(|l| l.split_whitespace().next()?.parse().ok());
        let flag = if busy > self.max_busy {
            "  (above --max-busy)"
        } else {
            ""
        };
        println!(
            "    outside CPU load {when}: {:.0}% of all cores busy, load average {}{flag}",
            busy * 100.0,
            loadavg.map_or("?".into(), |l| format!("{l:.2}"))
        );
        self.load.push(serde_json::json!({
            "when": when, "busy_fraction": busy, "load_average_1m": loadavg,
        }));
        Ok(())
    }

    fn max_busy_seen(&self) -> f64 {
        self.load
            .iter()
            .filter_map(|l| l["busy_fraction"].as_f64())
            .fold(0.0, f64::max)
    }

    /// Pings `ip` from the laptop: one every 10 ms for `seconds`; the p50 RTT in ms.
    fn ping_p50(&self, lab: &Lab, ip: Ipv4Addr) -> Result<f64> {
        let count = (100 * self.seconds).to_string();
        let out = laptop_output(
            lab,
            &[
                "ping",
                "-c",
                &count,
                "-i",
                "0.01",
                "-W",
                "1",
                &ip.to_string(),
            ],
        )?;
        p50(&ping_rtts_ms(&out)).with_context(|| format!("no ping replies from {ip}: {out}"))
    }

    /// Ping p50 while one iperf3 stream runs up the same path.
    fn busy_ping_p50(&self, lab: &Lab, t: Target, ip: Ipv4Addr) -> Result<f64> {
        let mut tries = 0;
        loop {
            tries += 1;
            let mut cmd = lab.command_in(LAPTOP, "iperf3")?;
            cmd.args([
                "-J",
                "-c",
                &t.iperf.ip().to_string(),
                "-p",
                &t.iperf.port().to_string(),
            ])
            .args(["-t", &(self.seconds + 1).to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
            interrupt::check()?;
            let child = cmd
                .spawn()
                .context("cannot start iperf3 for the busy RTT")?;
            // After an interrupt the ping fails at once and the wait kills iperf3.
            let rtt = interrupt::sleep(Duration::from_millis(500))
                .map_err(anyhow::Error::new)
                .and_then(|()| self.ping_p50(lab, ip));
            let out = interrupt::wait(child)?;
            let json = String::from_utf8_lossy(&out.stdout);
            match iperf3_receiver_gbps(&json) {
                Ok(_) if out.status.success() => return rtt,
                Err(e) if retryable(&e) && tries < 10 => {
                    interrupt::sleep(Duration::from_millis(300))?;
                }
                Err(e) => bail!("iperf3 under the busy RTT: {e}"),
                Ok(_) => bail!("iperf3 under the busy RTT failed: {json}"),
            }
        }
    }

    /// UDP with 64-byte payloads at `--udp-rate`: packets/s received and loss in %.
    /// Tried twice: iperf3's TCP control connection shares the path with the flood,
    /// and on a path that cannot carry the offered rate it can break (seen through
    /// kvpn direct at 100 Mbit/s for 5 s: "unable to send control message: Broken
    /// pipe").
    fn udp64(&self, lab: &Lab, t: Target, path: &str) -> Result<(f64, f64)> {
        let (ip, port, secs) = (
            t.iperf.ip().to_string(),
            t.iperf.port().to_string(),
            self.seconds.to_string(),
        );
        let args = [
            "-u",
            "-l",
            "64",
            "-b",
            &self.udp_rate,
            "-c",
            &ip,
            "-p",
            &port,
            "-t",
            &secs,
        ];
        let first = iperf3_json(lab, &args, |j| iperf3_udp(j).map(|_| ()));
        let json = match first {
            Ok(j) => j,
            Err(e) => {
                interrupt::check()?;
                self.note(format!("{path}: UDP 64 B failed once, tried again: {e:#}"));
                interrupt::sleep(Duration::from_secs(1))?;
                iperf3_json(lab, &args, |j| iperf3_udp(j).map(|_| ()))?
            }
        };
        iperf3_udp(&json).map_err(anyhow::Error::msg)
    }

    /// Something the report must say (a figure missing, a retry), printed now.
    fn note(&self, what: String) {
        println!("    note: {what}");
        self.notes.borrow_mut().push(what);
    }

    /// One row's figures for one round. `kvpn` holds the pids of kvpn's dataplane and
    /// manager for the kvpn CPU figure (empty on other rows).
    fn measure(&self, lab: &Lab, path: &str, t: Target, kvpn: &[u32]) -> Result<Sample> {
        if self.latency_only {
            return self.measure_latency(lab, path, t, kvpn);
        }
        interrupt::check()?;
        println!("==> measuring {path}");
        let secs = self.seconds;
        let mut s = Sample::new();
        let ((b0, _), k0) = (machine_busy_total()?, pids_cpu_ticks(kvpn));
        let one = iperf3_tcp(lab, t.iperf, secs, 1, false)?;
        let ((b1, _), k1) = (machine_busy_total()?, pids_cpu_ticks(kvpn));
        // Gbit moved: the receiver's rate over the test time (the measured interval
        // adds iperf3's start and end, a few % at 1 s, in the CPU's favour).
        let gbit = one * f64::from(secs);
        s.insert("tcp_1_gbps".into(), one);
        s.insert(
            "cpu_core_s_per_gbit".into(),
            (b1 - b0) as f64 / self.clk_tck / gbit,
        );
        if !kvpn.is_empty() {
            s.insert(
                "kvpn_cpu_core_s_per_gbit".into(),
                (k1 - k0) as f64 / self.clk_tck / gbit,
            );
        }
        for (key, streams, down) in [
            ("tcp_4_gbps", 4, false),
            ("tcp_8_gbps", 8, false),
            ("tcp_1_down_gbps", 1, true),
            ("tcp_4_down_gbps", 4, true),
            ("tcp_8_down_gbps", 8, true),
        ] {
            s.insert(key.into(), iperf3_tcp(lab, t.iperf, secs, streams, down)?);
        }
        if let Some(ip) = t.icmp {
            s.insert("idle_rtt_p50_ms".into(), self.ping_p50(lab, ip)?);
            s.insert("busy_rtt_p50_ms".into(), self.busy_ping_p50(lab, t, ip)?);
        }
        let echo = t.echo;
        let dur = Duration::from_secs(u64::from(secs.clamp(1, 3)));
        s.insert(
            "rr_per_sec".into(),
            lab.run_in(LAPTOP, move || request_response(echo, dur))??,
        );
        s.insert(
            "connects_per_sec".into(),
            lab.run_in(LAPTOP, move || connect_rate(echo, dur))??,
        );
        if t.udp {
            match self.udp64(lab, t, path) {
                Ok((pps, loss)) => {
                    s.insert("udp64_pps".into(), pps);
                    s.insert("udp64_loss_pct".into(), loss);
                }
                // The row's other figures stay; the failure is in the report.
                Err(e) => self.note(format!("{path}: no UDP 64 B figure this round: {e:#}")),
            }
        }
        own_ratios(&mut s);
        println!("    {s:?}");
        Ok(s)
    }

    /// `--latency-only`: TCP 1 and 4 streams up (with the kvpn processes' CPU per
    /// Gbit of each), idle and busy ping RTT.
    fn measure_latency(&self, lab: &Lab, path: &str, t: Target, kvpn: &[u32]) -> Result<Sample> {
        println!("==> measuring {path} (latency only)");
        let mut s = Sample::new();
        for (key, cpu_key, streams) in [
            ("tcp_1_gbps", "kvpn_cpu_core_s_per_gbit", 1),
            ("tcp_4_gbps", "kvpn_cpu_4_core_s_per_gbit", 4),
        ] {
            let k0 = pids_cpu_ticks(kvpn);
            let gbps = iperf3_tcp(lab, t.iperf, self.seconds, streams, false)?;
            let k1 = pids_cpu_ticks(kvpn);
            s.insert(key.into(), gbps);
            if !kvpn.is_empty() {
                s.insert(
                    cpu_key.into(),
                    (k1 - k0) as f64 / self.clk_tck / (gbps * f64::from(self.seconds)),
                );
            }
        }
        if let Some(ip) = t.icmp {
            s.insert("idle_rtt_p50_ms".into(), self.ping_p50(lab, ip)?);
            s.insert("busy_rtt_p50_ms".into(), self.busy_ping_p50(lab, t, ip)?);
        }
        own_ratios(&mut s);
        println!("    {s:?}");
        Ok(s)
    }

    /// The source-policy rows' figures: TCP 1 stream up (with the kvpn processes'
    /// CPU), idle ping RTT, 1-byte request/response and connection setup.
    fn measure_light(&self, lab: &Lab, path: &str, t: Target, kvpn: &[u32]) -> Result<Sample> {
        println!("==> measuring {path}");
        let secs = self.seconds;
        let mut s = Sample::new();
        let k0 = pids_cpu_ticks(kvpn);
        let one = iperf3_tcp(lab, t.iperf, secs, 1, false)?;
        let k1 = pids_cpu_ticks(kvpn);
        s.insert("tcp_1_gbps".into(), one);
        s.insert(
            "kvpn_cpu_core_s_per_gbit".into(),
            (k1 - k0) as f64 / self.clk_tck / (one * f64::from(secs)),
        );
        if let Some(ip) = t.icmp {
            s.insert("idle_rtt_p50_ms".into(), self.ping_p50(lab, ip)?);
        }
        let echo = t.echo;
        let dur = Duration::from_secs(u64::from(secs.clamp(1, 3)));
        s.insert(
            "rr_per_sec".into(),
            lab.run_in(LAPTOP, move || request_response(echo, dur))??,
        );
        s.insert(
            "connects_per_sec".into(),
            lab.run_in(LAPTOP, move || connect_rate(echo, dur))??,
        );
        println!("    {s:?}");
        Ok(s)
    }

    /// A row of the manager with `--source-policy policy` (the connect rolls the
    /// manager's Deployment to it), measured light, then `kvpn quit`.
    fn policy_row(
        &self,
        lab: &Lab,
        path: &str,
        t: Target,
        kubeconfig: &str,
        policy: &str,
    ) -> Result<Sample> {
        let runtime = lab.dir().join("runtime");
        let result = (|| {
            kvpn(
                lab,
                &runtime,
                &[
                    "connect",
                    "--kubeconfig",
                    kubeconfig,
                    "--source-policy",
                    policy,
                ],
            )?;
            std::thread::sleep(Duration::from_millis(300));
            let mut pids = lab_pids(lab, "kvpn-dataplane");
            pids.extend(manager_pid(lab));
            self.measure_light(lab, path, t, &pids)
        })();
        let _ = kvpn(lab, &runtime, &["quit"]);
        result
    }

    /// A kvpn row: `connect` (timed), the manager's RSS with the session, the round's
    /// figures with the kvpn processes' CPU and the idle flows (`flows`), then `kvpn
    /// quit` (also after a failure: the connect may have started the daemons).
    ///
    /// `fresh`: the bench restarted the manager just before ([`fresh_manager`]), so
    /// the RSS the session adds over it is the session's own, and the idle flows
    /// come first, before the bulk runs: after the 8-stream runs the allocator
    /// reuses their freed buffers and the per-flow growth reads low. Without it
    /// the manager kept what earlier sessions left in its allocator: the
    /// session's figure is [`NOT_MEASURED`] (it read 0) and the idle flows come
    /// last, as before. (Opened first, their burst of 1,000 RSTs once overflowed
    /// the laptop's TUN queue, the manager kept the flows whose RST was lost,
    /// and the setup-rate test's connects that reused their ports timed out on
    /// a SYN the stale flow swallowed: fixed in the dataplane's TUN queue and
    /// the manager, tests/tests/syn_reuse.rs.)
    fn kvpn_row(
        &self,
        lab: &Lab,
        path: &str,
        t: Target,
        connect: impl FnOnce() -> Result<()>,
        flows: bool,
        fresh: bool,
    ) -> Result<Sample> {
        let before = manager_pid(lab).and_then(rss_kib);
        let t0 = Instant::now();
        let result = connect().and_then(|()| {
            let connect_s = t0.elapsed().as_secs_f64();
            std::thread::sleep(Duration::from_millis(300));
            let manager = manager_pid(lab).with_context(|| {
                format!("no kvpn-manager process in the lab's netns after connecting for {path}")
            })?;
            let mut pids = lab_pids(lab, "kvpn-dataplane");
            if pids.is_empty() {
                bail!("no kvpn-dataplane process in the lab's netns after connecting for {path}");
            }
            pids.push(manager);
            let with_session = rss_kib(manager).context("manager VmRSS")?;
            let session_kib = match before {
                Some(before) if fresh => with_session.saturating_sub(before) as f64,
                _ => NOT_MEASURED,
            };
            let mut idle_flow_kib = if flows && fresh {
                Some(idle_flows_kib(lab, t.echo, manager)?)
            } else {
                None
            };
            let mut s = self.measure(lab, path, t, &pids)?;
            if flows && !fresh {
                idle_flow_kib = Some(idle_flows_kib(lab, t.echo, manager)?);
            }
            s.insert("connect_s".into(), connect_s);
            s.insert("manager_rss_mib".into(), with_session as f64 / 1024.0);
            s.insert("manager_session_kib".into(), session_kib);
            if let Some(kib) = idle_flow_kib {
                s.insert("manager_kib_per_idle_flow".into(), kib);
            }
            // The memory figures in the run's log too, like the per-row line, so
            // a run that stops later still shows them.
            let memory: Vec<String> = [
                "connect_s",
                "manager_rss_mib",
                "manager_session_kib",
                "manager_kib_per_idle_flow",
            ]
            .iter()
            .filter_map(|k| s.get(*k).map(|v| format!("{k}: {v:.2}")))
            .collect();
            println!("    {path} memory: {}", memory.join(", "));
            Ok(s)
        });
        let runtime = lab.dir().join("runtime");
        let _ = kvpn(lab, &runtime, &["quit"]);
        result
    }
}

fn kvpn(lab: &Lab, runtime: &Path, args: &[&str]) -> Result<String> {
    kvpn_home(lab, runtime, args, None)
}

/// `kvpn <args>` in the laptop netns; `home` replaces HOME (the SSH runs: no
/// ~/.ssh of the machine's user is read). Returns stdout.
fn kvpn_home(lab: &Lab, runtime: &Path, args: &[&str], home: Option<&Path>) -> Result<String> {
    let bin = kvpn_lab::bin_path("kvpn")?;
    let mut cmd = lab.command_in(LAPTOP, &bin.to_string_lossy())?;
    cmd.env("KVPN_RUNTIME_DIR", runtime);
    if let Some(h) = home {
        cmd.env("HOME", h)
            .env_remove("SSH_AUTH_SOCK")
            .env_remove("KVPN_SSH_CONFIG")
            .env_remove("KVPN_SSH_KNOWN_HOSTS");
    }
    let out = kvpn_cli(cmd.args(args), args)?;
    if !out.status.success() {
        let shown: Vec<&str> = args.iter().copied().take(12).collect();
        bail!(
            "kvpn {shown:?}{}: {}",
            if args.len() > 12 { " …" } else { "" },
            String::from_utf8_lossy(&out.stderr).trim_end()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `cmd`, the kvpn CLI with `args`: `kvpn quit` is cleanup and runs after an
/// interrupt too; every other command is killed by one ([`interrupt::output`]).
fn kvpn_cli(cmd: &mut Command, args: &[&str]) -> Result<std::process::Output> {
    if args.first() == Some(&"quit") {
        Ok(cmd.output()?)
    } else {
        interrupt::output(cmd)
    }
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

/// Rows in report order, each with its lab and one sample per round.
type Rows = Vec<(String, &'static str, Vec<Sample>)>;

fn push(rows: &mut Rows, path: &str, lab: &'static str, s: Sample) {
    match rows.iter_mut().find(|r| r.0 == path) {
        Some(r) => r.2.push(s),
        None => rows.push((path.to_owned(), lab, vec![s])),
    }
}

/// The raw baseline: the laptop routed straight to the pod over the uplink veth.
fn raw_row(b: &Bench, lab: &Lab, path: &str, t: Target) -> Result<Sample> {
    lab.add_laptop_direct_routes()?;
    let s = b.measure(lab, path, t, &[]);
    lab.remove_laptop_direct_routes()?;
    s
}

/// How many real nodes the bench's Kubernetes lab has (the web replicas and the
/// manager may land on different ones, as in a cluster).
const REAL_NODES: usize = 2;
/// The laptop's local ports of the raw port-forward (iperf3, echo).
const RAW_PF_IPERF_PORT: u16 = 25201;
const RAW_PF_ECHO_PORT: u16 = 27007;

/// The transport baseline of the port-forward rows: a plain port-forward
/// ([`port_forward::RawPortForward`]) in the laptop netns to the web pod's iperf3 and
/// echo ports, along the way kvpn's data channel takes (API server, kubelet,
/// containerd's streaming server). TCP only: a port-forward carries neither UDP nor
/// ICMP.
fn raw_port_forward_row(b: &Bench, lab: &Lab, kubeconfig: &Path, pod: &str) -> Result<Sample> {
    let mut pf = port_forward::RawPortForward::start(
        lab.laptop_netns(),
        kubeconfig,
        DEV_NAMESPACE,
        pod,
        &[
            (RAW_PF_IPERF_PORT, IPERF_PORT),
            (RAW_PF_ECHO_PORT, ECHO_PORT),
        ],
    )
    .with_context(|| format!("raw port-forward to pod {DEV_NAMESPACE}/{pod}"))?;
    let local = |port| SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let t = Target {
        iperf: local(RAW_PF_IPERF_PORT),
        echo: local(RAW_PF_ECHO_PORT),
        icmp: None,
        udp: false,
    };
    let result = b.measure(lab, "raw-port-forward", t, &[]);
    pf.stop();
    result
}

/// The pid of the process `comm` in `pod`'s first running container (found by the
/// container ID in the processes' cgroups).
fn pod_process(pod: &Pod, comm: &str) -> Option<u32> {
    let id = pod
        .status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .first()?
        .container_id
        .as_deref()?
        .rsplit("://")
        .next()?
        .to_owned();
    let dir = std::fs::read_dir("/proc").ok()?;
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| {
            read_proc(&format!("/proc/{pid}/comm")).is_some_and(|c| c.trim() == comm)
                && read_proc(&format!("/proc/{pid}/cgroup")).is_some_and(|c| c.contains(&id))
        })
}

/// Waits until something listens on TCP `port` in the netns of process `pid`.
fn wait_listening_in_pod(pid: u32, port: u16, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let out = Command::new("nsenter")
            .arg(format!("--net=/proc/{pid}/ns/net"))
            .args(["ss", "-Hltn", &format!("sport = :{port}")])
            .output()?;
        if out.status.success() && !out.stdout.trim_ascii().is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!(
                "nothing listened on TCP {port} in the netns of pid {pid} within {timeout:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A real node's address on the nodes' bridge (its `eth0`).
fn node_eth0_ip(node: &kvpn_lab::k8s::node::RealNode) -> Result<Ipv4Addr> {
    let out = node.exec("ip", &["-4", "-o", "addr", "show", "dev", "eth0"])?;
    out.split_whitespace()
        .skip_while(|w| *w != "inet")
        .nth(1)
        .and_then(|cidr| cidr.split('/').next()?.parse().ok())
        .with_context(|| format!("no IPv4 address on eth0 of node {}: {out}", node.name()))
}

/// The plain lab's rounds: raw veth, kvpn direct, kvpn direct with 10,000 routes,
/// socat.
fn plain_lab(
    b: &mut Bench,
    rounds: u32,
    workers: u16,
    fairness_only: bool,
    rows: &mut Rows,
) -> Result<()> {
    interrupt::check()?;
    println!("==> bringing up the lab");
    let mut lab = Lab::up(LabOptions::default()).context("lab up")?;
    // Its name and folder: what to look for if it is left behind.
    println!("    lab {} up (folder {})", lab.name(), lab.dir().display());
    let pod = Target::pod(BACKEND_1_IP, true);
    let socat = Target {
        iperf: SocketAddr::from((NODE_UPLINK_IP, SOCAT_IPERF_PORT)),
        echo: SocketAddr::from((NODE_UPLINK_IP, SOCAT_ECHO_PORT)),
        icmp: None,
        udp: false,
    };
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
    // The fairness rounds come after the other rows' rounds, with laptop A added
    // only then: A's floods leave flows (and their buffers) in the manager, which
    // would count in the kvpn rows' manager memory figures.
    let mut laptop_a: Option<fairness::LaptopA> = None;
    let result = (|| {
        interrupt::check()?;
        let mut iperf = Command::new("iperf3");
        iperf.args(["-s", "-p", &IPERF_PORT.to_string()]);
        lab.spawn_in(BACKEND_1_POD, "iperf3", &iperf)?;
        lab.wait_listening(BACKEND_1_POD, IPERF_PORT, Duration::from_secs(5))?;
        // socat relays in the node netns, one per pod port, a process per connection.
        for (port, to, name) in [
            (SOCAT_IPERF_PORT, IPERF_PORT, "bench-socat-iperf3"),
            (SOCAT_ECHO_PORT, ECHO_PORT, "bench-socat-echo"),
        ] {
            let mut socat = Command::new("socat");
            socat
                .arg(format!(
                    "TCP-LISTEN:{port},bind={NODE_UPLINK_IP},fork,reuseaddr"
                ))
                .arg(format!("TCP:{BACKEND_1_IP}:{to}"));
            lab.spawn_in(NODE, name, &socat)?;
            lab.wait_listening(NODE, port, Duration::from_secs(5))?;
        }
        for round in 1..=rounds {
            if fairness_only {
                break;
            }
            b.sample_load(&format!("before plain-lab round {round}"))?;
            let raw = raw_row(b, &lab, "raw-veth", pod)?;
            let args: Vec<&str> = connect.iter().map(String::as_str).collect();
            // Each kvpn row of the plain lab starts on a fresh manager, so its memory
            // figures are its own session's, not what the allocator kept from the
            // earlier rows' 8-stream runs and 1,000 idle flows.
            fresh_manager(&lab)?;
            let mut direct = b.kvpn_row(
                &lab,
                "kvpn-direct",
                pod,
                || kvpn(&lab, &runtime, &args).map(|_| ()),
                !b.latency_only,
                true,
            )?;
            pair_with_baseline(&mut direct, &raw);
            let workers_row = format!("kvpn-direct-workers-{workers}");
            let sharded = if workers > 1 {
                let mut sharded_args = args.clone();
                let n = workers.to_string();
                sharded_args.extend(["--workers", n.as_str()]);
                fresh_manager(&lab)?;
                let mut row = b.kvpn_row(
                    &lab,
                    &workers_row,
                    pod,
                    || kvpn(&lab, &runtime, &sharded_args).map(|_| ()),
                    !b.latency_only,
                    true,
                )?;
                pair_with_baseline(&mut row, &raw);
                Some(row)
            } else {
                None
            };
            if b.latency_only {
                push(rows, "raw-veth", "plain", raw);
                push(rows, "kvpn-direct", "plain", direct);
                if let Some(row) = sharded {
                    push(rows, &workers_row, "plain", row);
                }
                continue;
            }
            let mut many = classifier_row(b, &lab, pod, &runtime, &connect)?;
            pair_ratio(&mut many, &direct, "tcp_1_gbps", "tcp_1_vs_1_route");
            pair_with_baseline(&mut many, &raw);
            let mut relay = b.measure(&lab, "socat", socat, &[])?;
            pair_with_baseline(&mut relay, &raw);
            push(rows, "raw-veth", "plain", raw);
            push(rows, "kvpn-direct", "plain", direct);
            if let Some(row) = sharded {
                push(rows, &workers_row, "plain", row);
            }
            push(rows, MANY_ROUTES, "plain", many);
            push(rows, "socat", "plain", relay);
        }
        if !b.latency_only {
            let _ = kvpn(&lab, &runtime, &["quit"]);
            let a = laptop_a.insert(fairness::LaptopA::add(&mut lab)?);
            let args: Vec<&str> = connect.iter().map(String::as_str).collect();
            for round in 1..=rounds {
                b.sample_load(&format!("before fairness round {round}"))?;
                let fair = fairness::round(&lab, a, b.seconds, b.clk_tck, &runtime, &args)?;
                push(rows, fairness::ROW, "plain", fair);
            }
        }
        b.sample_load("after the plain lab's last round")
    })();
    let _ = kvpn(&lab, &runtime, &["quit"]);
    if let Some(a) = laptop_a {
        a.quit(&lab);
    }
    let name = lab.name().to_owned();
    lab.down()
        .with_context(|| format!("tearing down lab {name}"))?;
    interrupt::after_teardown(result, &name)
}

/// kvpn direct with [`EXTRA_ROUTES`] extra /32 routes (the first count kvpn accepts):
/// connect time, TCP 1 stream up and idle RTT (the classifier's cost shows there;
/// the full set of figures is the kvpn-direct row's). The routes are /32s in
/// 10.201.0.0/16, outside every range of the lab, every other address so that no two
/// can be merged into a shorter prefix.
fn classifier_row(
    b: &Bench,
    lab: &Lab,
    t: Target,
    runtime: &Path,
    connect: &[String],
) -> Result<Sample> {
    println!("==> measuring {MANY_ROUTES}");
    let mut last = None;
    for count in EXTRA_ROUTES {
        let mut args = connect.to_vec();
        for i in 0..count {
            args.push("--cidr".into());
            args.push(format!("10.201.{}.{}/32", i / 125, 2 * (i % 125) + 1));
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let t0 = Instant::now();
        let result = kvpn(lab, runtime, &args).and_then(|_| {
            let connect_s = t0.elapsed().as_secs_f64();
            let routes = laptop_output(
                lab,
                &[
                    "ip",
                    "-4",
                    "route",
                    "show",
                    "table",
                    "all",
                    "root",
                    "10.201.0.0/16",
                ],
            )?;
            let n = routes.lines().count();
            if n < count as usize {
                bail!(
                    "kvpn connect with {count} --cidr routes installed only {n} of them in \
                     the laptop netns: {}",
                    routes.lines().take(5).collect::<Vec<_>>().join("; ")
                );
            }
            let mut s = Sample::new();
            s.insert("extra_routes".into(), f64::from(count));
            s.insert("connect_s".into(), connect_s);
            s.insert(
                "tcp_1_gbps".into(),
                iperf3_tcp(lab, t.iperf, b.seconds, 1, false)?,
            );
            if let Some(ip) = t.icmp {
                s.insert("idle_rtt_p50_ms".into(), b.ping_p50(lab, ip)?);
            }
            println!("    {s:?}");
            Ok(s)
        });
        let _ = kvpn(lab, runtime, &["quit"]);
        match result {
            Ok(s) => return Ok(s),
            Err(e) => {
                b.note(format!(
                    "{MANY_ROUTES}: kvpn direct with {count} extra routes failed: {e:#}"
                ));
                last = Some(e);
            }
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("no route count to try")))
}

/// The Kubernetes lab's rounds, on real node software (two nodes: containerd + runc,
/// kubelet and kube-proxy 1.20.2, the project's images; docs/lab-real-node.md), all
/// to a web backend pod with an iperf3 server in its network namespace: raw veth; raw
/// port-forward (`kubectl port-forward` to the same pod through the API server, the
/// real kubelet and containerd's streaming server: the transport's own limit);
/// `kvpn connect --kubeconfig` (manager installed by kvpn from its image, data channel
/// over `pods/portforward` along the same way, TLS inside); the same with `--ssh-addr`
/// to an sshd in a node's netns (every kube call and the data channel, ssh-direct,
/// checked in `kvpn status`, go through SSH); sshuttle through the same sshd to the
/// pod CIDR (TCP only).
/// `ssh_only`: only raw veth, kvpn over SSH and sshuttle.
fn kube_lab(b: &mut Bench, rounds: u32, ssh_only: bool, rows: &mut Rows) -> Result<()> {
    interrupt::check()?;
    println!("==> bringing up the Kubernetes lab (two real nodes)");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let options = K8sLabOptions::default().real_nodes(
        RealNodeOptions::project(REAL_NODES, Vec::new())
            .context("the bench's Kubernetes lab runs on real nodes")?,
    );
    let k8s = rt
        .block_on(K8sLab::up(options))
        .context("Kubernetes lab up")?;
    let name = k8s.netns_lab().name().to_owned();
    println!(
        "    lab {name} up (folder {})",
        k8s.netns_lab().dir().display()
    );
    let result = (|| {
        interrupt::check()?;
        let admin = rt.block_on(k8s.admin_client())?;
        let pods: Api<Pod> = Api::namespaced(admin, DEV_NAMESPACE);
        let list = rt.block_on(pods.list(&ListParams::default().labels("app=web")))?;
        let (pod_name, ip, pid) = list
            .items
            .iter()
            .find_map(|p| {
                let ip: Ipv4Addr = p.status.as_ref()?.pod_ip.as_ref()?.parse().ok()?;
                let pid = pod_process(p, "kvpn-lab-server")?;
                Some((p.metadata.name.clone()?, ip, pid))
            })
            .context("no running web pod with an IP in the Kubernetes lab")?;
        let lab = k8s.netns_lab();
        // The pod's netns is pinned in its node's mount namespace: entered through
        // the container's process. iperf3 is the machine's, as root, in that netns only.
        let pod_net = format!("--net=/proc/{pid}/ns/net");
        let mut iperf = Command::new("nsenter");
        iperf.args([
            pod_net.as_str(),
            "iperf3",
            "-s",
            "-p",
            &IPERF_PORT.to_string(),
        ]);
        lab.spawn_in(NODE, "iperf3-web", &iperf)?;
        wait_listening_in_pod(pid, IPERF_PORT, Duration::from_secs(5))?;
        let runtime = lab.dir().join("runtime");
        let kubeconfig = k8s.laptop_user_kubeconfig().to_string_lossy().into_owned();
        let admin_kubeconfig = k8s.laptop_admin_kubeconfig().to_path_buf();
        // The source-policy rows connect as the cluster's admin: preserve on real
        // nodes needs its node agent (a DaemonSet), which the restricted user may
        // not install (kvpn warns and the tunnel IP has no way back).
        let admin_kubeconfig_s = admin_kubeconfig.to_string_lossy().into_owned();
        // sshd on the first node: a cluster node reaches pod IPs and, through
        // kube-proxy's rules, ClusterIPs (the router netns has no kube-proxy).
        let node = k8s
            .real_nodes()
            .and_then(|r| r.nodes().first())
            .context("the real-node lab has no node")?;
        let node_ip = node_eth0_ip(node)?;
        println!("==> starting sshd on node {} ({node_ip})", node.name());
        let node_role = node
            .netns()
            .name()
            .strip_prefix(&format!("kvpn-{}-", lab.id()))
            .map(str::to_owned)
            .with_context(|| format!("node netns {} is not the lab's", node.netns().name()))?;
        // The laptop reaches that node as an SSH bastion is reached: routed to it
        // through the lab's router (its uplink peer), the node's address only.
        let node_route = format!("{node_ip}/32");
        lab.laptop_netns()
            .ip(&[
                "route",
                "replace",
                &node_route,
                "via",
                &NODE_UPLINK_IP.to_string(),
            ])
            .with_context(|| format!("laptop route to node {} ({node_ip})", node.name()))?;
        let sshd = match ssh::NodeSshd::start(lab, &node_role, node_ip, NODE_UPLINK_IP, None) {
            Ok(sshd) => sshd,
            Err(e) => {
                let _ = lab.laptop_netns().ip(&["route", "del", &node_route]);
                return Err(e);
            }
        };
        let pod = Target::pod(ip, true);
        let rounds_result = (|| {
            let (key, kh) = (
                sshd.key.to_string_lossy().into_owned(),
                sshd.known_hosts.to_string_lossy().into_owned(),
            );
            let addr = sshd.addr.to_string();
            let via_ssh = [
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
            for round in 1..=rounds {
                b.sample_load(&format!("before Kubernetes-lab round {round}"))?;
                let raw = raw_row(b, lab, "raw-veth-k8s", pod)?;
                let mut raw_pf = if ssh_only {
                    None
                } else {
                    let mut s = raw_port_forward_row(b, lab, &admin_kubeconfig, &pod_name)?;
                    pair_with_baseline(&mut s, &raw);
                    Some(s)
                };
                let mut pf = if ssh_only {
                    None
                } else {
                    Some(b.kvpn_row(
                        lab,
                        "kvpn-port-forward",
                        pod,
                        || {
                            // Explicit: a connect without the flag keeps the policy of the
                            // last row's manager.
                            kvpn(
                                lab,
                                &runtime,
                                &[
                                    "connect",
                                    "--kubeconfig",
                                    &kubeconfig,
                                    "--source-policy",
                                    "snat",
                                ],
                            )
                            .map(|_| ())
                        },
                        true,
                        // The Kubernetes lab's manager is a pod that serves
                        // every row in turn (not restarted here).
                        false,
                    )?)
                };
                if let Some(pf) = &mut pf {
                    pair_with_baseline(pf, &raw);
                    if let Some(raw_pf) = &raw_pf {
                        pair_ratio(pf, raw_pf, "tcp_1_gbps", "tcp_1_vs_raw_port_forward");
                        pair_ratio(pf, raw_pf, "tcp_4_gbps", "tcp_4_vs_raw_port_forward");
                    }
                }
                let mut over_ssh = b.kvpn_row(
                    lab,
                    "kvpn-ssh",
                    pod,
                    || {
                        kvpn_home(lab, &runtime, &via_ssh, Some(&sshd.home))?;
                        let paths = data_paths(lab, &runtime)?;
                        if !paths.iter().any(|p| p.starts_with("ssh-direct")) {
                            bail!(
                                "kvpn over SSH did not choose the ssh-direct data path (status \
                                 says {paths:?}); see the agent logs under {}",
                                runtime.display()
                            );
                        }
                        println!("    data path: {paths:?}");
                        Ok(())
                    },
                    true,
                    false,
                )?;
                pair_with_baseline(&mut over_ssh, &raw);
                println!("==> starting sshuttle in the laptop netns");
                let shuttle = ssh::Sshuttle::start(
                    lab,
                    &sshd,
                    &kvpn_lab::POD_CIDR.to_string(),
                    SocketAddr::from((ip, ECHO_PORT)),
                )?;
                let sshuttle = b.measure(lab, "sshuttle", Target::pod(ip, false), &[]);
                shuttle.stop(lab);
                let mut sshuttle = sshuttle?;
                pair_with_baseline(&mut sshuttle, &raw);
                pair_ratio(&mut over_ssh, &sshuttle, "tcp_1_gbps", "tcp_1_vs_sshuttle");
                // The other source policies next to snat (kvpn-port-forward): the
                // same path to the same pod, the manager rolled to each policy.
                let mut policies = Vec::new();
                if let Some(pf) = &mut pf {
                    pair_ratio(pf, &sshuttle, "tcp_1_gbps", "tcp_1_vs_sshuttle");
                    for (path, policy) in [
                        ("kvpn-ebpf-snat", "ebpf-snat"),
                        ("kvpn-preserve", "preserve"),
                    ] {
                        let mut row = b.policy_row(lab, path, pod, &admin_kubeconfig_s, policy)?;
                        pair_with_baseline(&mut row, &raw);
                        pair_ratio(&mut row, pf, "tcp_1_gbps", "tcp_1_vs_snat");
                        policies.push((path, row));
                    }
                }
                push(rows, "raw-veth-k8s", "kubernetes", raw);
                if let Some(raw_pf) = raw_pf.take() {
                    push(rows, "raw-port-forward", "kubernetes", raw_pf);
                }
                if let Some(pf) = pf {
                    push(rows, "kvpn-port-forward", "kubernetes", pf);
                }
                for (path, row) in policies {
                    push(rows, path, "kubernetes", row);
                }
                push(rows, "kvpn-ssh", "kubernetes", over_ssh);
                push(rows, "sshuttle", "kubernetes", sshuttle);
            }
            b.sample_load("after the Kubernetes lab's last round")
        })();
        sshd.stop(lab);
        let _ = lab.laptop_netns().ip(&["route", "del", &node_route]);
        rounds_result
    })();
    k8s.down()
        .with_context(|| format!("tearing down the Kubernetes lab {name}"))?;
    interrupt::after_teardown(result, &name)
}

/// 1,000 idle flows need more descriptors than a default soft limit of 1024 leaves:
/// raise the soft limit to the hard one.
fn raise_nofile_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read/write the struct passed by reference.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            let _ = libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

fn clk_tck() -> f64 {
    // SAFETY: sysconf has no memory effects.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}

/// The commit of the checkout the bench was built from (for comparing reports).
fn git_commit() -> Option<String> {
    let out = Command::new("git")
        .args([
            "-C",
            env!("CARGO_MANIFEST_DIR"),
            "rev-parse",
            "--short",
            "HEAD",
        ])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Errors end in one line, `kvpn-bench: error: …` with the causes (never a
/// backtrace, whatever RUST_BACKTRACE says), and the exit status of
/// [`exit_status`]; an interrupted run says what it removed.
fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let (line, code) = exit_status(&e, interrupt::received());
            eprintln!("kvpn-bench: {line}");
            ExitCode::from(code)
        }
    }
}

/// The line (after `kvpn-bench: `) and exit status of a run that ended in `e`,
/// `signal` the signal it received, if any: 128 + the signal's number for an
/// interrupted run, 2 for a [`UsageError`], 1 for a failed run.
fn exit_status(e: &anyhow::Error, signal: Option<i32>) -> (String, u8) {
    if let Some(signal) = signal {
        let line = match interrupt::of(e) {
            Some(i) => i.to_string(),
            None => format!("interrupted ({}): {e:#}", interrupt::name(signal)),
        };
        // 129..=143 for the signals the bench watches.
        let code = u8::try_from(interrupt::exit_code(signal)).unwrap_or(u8::MAX);
        return (line, code);
    }
    let code = if e.downcast_ref::<UsageError>().is_some() {
        2
    } else {
        1
    };
    (format!("error: {e:#}"), code)
}

fn run(args: &Args) -> Result<()> {
    interrupt::watch()?;
    kvpn_lab::require_root().map_err(|e| UsageError(e.to_string()))?;
    raise_nofile_limit();
    let compare_with = match &args.compare {
        Some(p) => Some(read_report(p).map_err(|e| UsageError(format!("{e:#}")))?),
        None => None,
    };
    let mut b = Bench {
        seconds: args.seconds,
        udp_rate: args.udp_rate.clone(),
        max_busy: args.max_busy,
        clk_tck: clk_tck(),
        load: Vec::new(),
        notes: Default::default(),
        latency_only: args.latency_only,
    };
    let mut raw_rows: Rows = Vec::new();
    let started = Instant::now();
    // A measurement that fails (a tool's error, a reset connection) stops the
    // run, but the rounds that finished are still reported, marked incomplete:
    // a long run is not thrown away for its last minute.
    let mut stopped: Option<anyhow::Error> = if args.ssh_only {
        None
    } else {
        plain_lab(
            &mut b,
            args.rounds,
            args.workers,
            args.fairness_only,
            &mut raw_rows,
        )
        .context("plain lab")
        .err()
    };
    if stopped.is_none() && !args.fairness_only && !args.plain_only && !args.latency_only {
        stopped = kube_lab(&mut b, args.rounds, args.ssh_only, &mut raw_rows)
            .context("Kubernetes lab")
            .err();
    }
    if let Some(signal) = interrupt::received() {
        return Err(stopped.unwrap_or_else(|| interrupt::Interrupted { signal, lab: None }.into()));
    }
    if let Some(e) = &stopped {
        if raw_rows.is_empty() {
            return Err(anyhow::anyhow!("{e:#}"));
        }
        eprintln!("kvpn-bench: the run stopped early ({e:#}); reporting the rounds that finished");
    }
    let incomplete = stopped.as_ref().map(|e| format!("{e:#}"));
    let rows: Vec<Row> = raw_rows
        .iter()
        .map(|(path, lab, samples)| Row::of(path, lab, samples))
        .collect();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let max_seen = b.max_busy_seen();
    let verdict = LoadVerdict::of(max_seen, args.max_busy, args.force);
    let over = verdict != LoadVerdict::Quiet;
    println!();
    println!(
        "outside CPU load: at most {:.0}% of {cores} cores busy between rounds (threshold \
         --max-busy {:.0}%)",
        max_seen * 100.0,
        args.max_busy * 100.0
    );
    if verdict == LoadVerdict::Refuse {
        eprintln!(
            "kvpn-bench: not reporting: the machine was {:.0}% busy outside the measurements \
             (threshold {:.0}% of all cores, --max-busy), so the figures are not \
             representative; run again when the machine is quiet, or pass --force to \
             report them anyway (marked as taken under load)",
            max_seen * 100.0,
            args.max_busy * 100.0
        );
        std::process::exit(2);
    }
    let goal_list = goals(&rows);
    let table = markdown_table(&rows);
    let goal_text = goal_lines(&goal_list);
    let bin = kvpn_lab::bin_path("kvpn")
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    let commit = git_commit();
    let header = format!(
        "# kvpn-bench\n\ncommit {}, binaries {bin}, {} round(s) of {} s per iperf3 run, \
         {cores} cores, {:.0} s in all; outside CPU load at most {:.0}% of all cores \
         (threshold {:.0}%){}.\n\nCells: median (min–max) over the rounds. Up: laptop → \
         pod; down: pod → laptop. \"added\" and the ratios are paired with the same lab's \
         raw-veth row of the same round. Rows without ICMP/UDP (socat, sshuttle) carry \
         TCP only.\n\n",
        commit.as_deref().unwrap_or("?"),
        args.rounds,
        args.seconds,
        started.elapsed().as_secs_f64(),
        max_seen * 100.0,
        args.max_busy * 100.0,
        if over {
            " — ABOVE THE THRESHOLD, reported with --force"
        } else {
            ""
        },
    ) + &incomplete
        .as_ref()
        .map(|e| {
            format!(
                "**INCOMPLETE:** the run stopped early ({e}); each row's medians are over the \
                 rounds that finished (the JSON lists every sample).\n\n"
            )
        })
        .unwrap_or_default();
    let notes = b.notes.borrow().clone();
    let notes_text: String = notes.iter().map(|n| format!("note: {n}\n")).collect();
    println!("{table}");
    print!("{goal_text}{notes_text}");

    let out_dir = args.out_dir.clone().unwrap_or_else(|| {
        std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("target"))
            .join("bench")
    });
    std::fs::create_dir_all(&out_dir)
        .with_context(|| format!("cannot create {}", out_dir.display()))?;
    let md = out_dir.join("bench.md");
    std::fs::write(
        &md,
        format!(
            "{header}{table}\n## #8 goals\n\n```\n{goal_text}{notes_text}```\n\n![TCP throughput](bench.svg)\n"
        ),
    )?;
    let svg = out_dir.join("bench.svg");
    std::fs::write(&svg, svg_chart(&rows))?;
    let json_path = args
        .json
        .clone()
        .unwrap_or_else(|| out_dir.join("kvpn-bench.json"));
    if let Some(dir) = json_path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let report = serde_json::json!({
        "version": 2,
        "commit": commit,
        "binaries": bin,
        "seconds": args.seconds,
        "rounds": args.rounds,
        "udp_rate": args.udp_rate,
        "cores": cores,
        "load": {
            "max_busy_threshold": args.max_busy,
            "max_busy_seen": max_seen,
            "above_threshold": over,
            "forced": over && args.force,
            "samples": b.load,
        },
        "rows": rows,
        "goals": goal_list,
        "notes": notes,
        "incomplete": incomplete,
    });
    std::fs::write(&json_path, serde_json::to_string_pretty(&report)?)?;
    println!(
        "\nreport: {} (chart {}, JSON {})",
        md.display(),
        svg.display(),
        json_path.display()
    );
    if let Some(old) = compare_with {
        println!(
            "\ncompared with {}:",
            args.compare
                .as_deref()
                .map(Path::display)
                .map(|d| d.to_string())
                .unwrap_or_default()
        );
        print!("{}", kvpn_bench::compare(&old, &rows));
    }
    match incomplete {
        Some(e) => Err(anyhow::anyhow!(
            "the run stopped early ({e}); the report above holds the rounds that finished"
        )),
        // A signal after the labs: the report is written, the status still says so.
        None => Ok(interrupt::check()?),
    }
}

/// The rows of the earlier JSON report at `p` (`--compare`).
fn read_report(p: &Path) -> Result<Vec<Row>> {
    let text = std::fs::read_to_string(p)
        .with_context(|| format!("cannot read the report to compare with, {}", p.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a JSON report of kvpn-bench", p.display()))?;
    kvpn_bench::rows_of_report(&v).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;
    use clap::error::ErrorKind;

    use super::{Args, UsageError, exit_status, interrupt, retryable};

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("kvpn-bench").chain(args.iter().copied()))
    }

    /// User help names no source files (`--fairness-only` cited
    /// bench/src/fairness.rs).
    #[test]
    fn help_cites_no_source_files() {
        use clap::CommandFactory as _;
        let help = Args::command().render_long_help().to_string();
        assert!(help.contains("--fairness-only"), "{help}");
        assert!(!help.contains("src/") && !help.contains(".rs"), "{help}");
    }

    #[test]
    fn max_busy_is_a_share_of_all_cores() {
        for ok in ["0", "0.25", "1"] {
            let args = parse(&["--max-busy", ok]).unwrap_or_else(|e| panic!("{ok}: {e}"));
            assert_eq!(args.max_busy, ok.parse::<f64>().expect("number"));
        }
        for bad in ["2", "-0.1", "1.01", "NaN", "half"] {
            let e = parse(&["--max-busy", bad])
                .err()
                .unwrap_or_else(|| panic!("{bad} accepted"));
            assert_eq!(e.kind(), ErrorKind::ValueValidation, "{bad}: {e}");
            // A usage error: clap's status 2, no backtrace.
            assert_eq!(e.exit_code(), 2);
            assert!(e.to_string().contains("0 to 1"), "{bad}: {e}");
        }
    }

    #[test]
    fn zero_rounds_or_seconds_are_usage_errors() {
        for flag in ["--rounds", "--seconds"] {
            let e = parse(&[flag, "0"])
                .err()
                .unwrap_or_else(|| panic!("{flag} 0 accepted"));
            assert_eq!(e.kind(), ErrorKind::ValueValidation, "{flag}: {e}");
            assert_eq!(e.exit_code(), 2);
            assert!(e.to_string().contains(flag), "{e}");
            assert!(parse(&[flag, "1"]).is_ok());
        }
    }

    #[test]
    fn errors_are_one_line_with_their_status() {
        let usage = anyhow::Error::new(UsageError("kvpn-bench must run as root".into()));
        assert_eq!(
            exit_status(&usage, None),
            ("error: kvpn-bench must run as root".into(), 2)
        );
        let failed = anyhow::anyhow!("lab up failed").context("plain lab");
        assert_eq!(
            exit_status(&failed, None),
            ("error: plain lab: lab up failed".into(), 1)
        );
        let removed = anyhow::Error::new(interrupt::Interrupted {
            signal: libc::SIGINT,
            lab: Some("kvpn-1a2b3".into()),
        })
        .context("plain lab");
        assert_eq!(
            exit_status(&removed, Some(libc::SIGINT)),
            ("interrupted: lab kvpn-1a2b3 removed (SIGINT)".into(), 130)
        );
        // A step that failed because of the signal before the flag was read.
        assert_eq!(
            exit_status(&failed, Some(libc::SIGTERM)),
            (
                "interrupted (SIGTERM): plain lab: lab up failed".into(),
                143
            )
        );
    }

    #[test]
    fn only_a_server_between_two_tests_is_retried() {
        assert!(retryable(
            "iperf3: the server is busy running a test. try again later"
        ));
        assert!(retryable(
            "iperf3: unable to connect to server: Connection refused"
        ));
        assert!(!retryable(
            "iperf3: unable to connect to server: No route to host"
        ));
        assert!(!retryable(
            "iperf3: error - control socket has closed unexpectedly"
        ));
    }
}
