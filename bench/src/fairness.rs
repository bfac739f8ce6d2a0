//! The flood-fairness row `kvpn-fairness` (issue #10 item 3: "a client flooding
//! SYNs or UDP to closed ports is rate-limited without hurting a second
//! client's throughput by more than 20%"), in the plain lab.
//!
//! Laptop B is the lab's laptop; laptop A a second laptop netns
//! ([`kvpn_lab::Lab::add_laptop`]) with its own root daemon, TUN device and
//! tunnel IP; both connect over direct TCP to the same `kvpn-manager`. Per
//! round: B's 1-stream iperf3 upload to backend-1 alone, then while A floods
//! TCP SYNs to closed ports of backend-1, then while A floods 64-byte UDP to
//! closed ports of backend-2 ([`kvpn_lab::flood`]), each flood starting
//! [`FLOOD_LEAD`] before B's run so B sees the steady state after A's burst
//! allowance is spent. The ratios are paired within the round; the report's
//! medians over rounds are the figures. A's share of flood packets its
//! session's limits refused comes from A's own `kvpn status` (the manager's
//! stats frames).
//!
//! Throughput on a shared 2-core machine moves with whatever else runs, so the
//! row also reports the manager's CPU per Gbit of B's transfer in each phase
//! (`fair_*_manager_core_s_per_gbit`): what the flood adds to the manager's
//! work is visible there even when the ratios are noise.
//!
//! The flood rate is [`FLOOD_PPS`]: five times the manager's sustained
//! new-flow allowance (`NEW_FLOWS_PER_SEC` = 1000 in manager/src/limit.rs),
//! yet bounded so that A's own side (the sender, A's kernel and pump) does not
//! take the CPU B needs on a 2-core lab machine: at 10× that alone took a fifth
//! of the machine, which measures the machine, not the manager (on a real
//! cluster laptop A is another machine).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kvpn_bench::Sample;
use kvpn_lab::flood::{Flood, Flooder};
use kvpn_lab::{BACKEND_1_IP, BACKEND_2_IP, Lab};

use crate::{Target, iperf3_tcp, kvpn, lab_pids, machine_busy_total, manager_pid, pids_cpu_ticks};

/// The row.
pub const ROW: &str = "kvpn-fairness";
/// Laptop A's netns role.
const LAPTOP_A: &str = "laptop-a";
/// A's tunnel IP (B has the connect default, 100.96.0.2).
const TUNNEL_IP_A: std::net::Ipv4Addr = std::net::Ipv4Addr::new(100, 96, 0, 3);
/// A's flood rate, packets/s (see the module header).
pub const FLOOD_PPS: u64 = 5000;
/// The flood runs this long before B's run starts.
const FLOOD_LEAD: Duration = Duration::from_secs(1);
/// The flood queues drain this long after each run.
const SETTLE: Duration = Duration::from_millis(500);

/// Laptop A of the plain lab: its netns (removed with the lab) and runtime
/// folder. [`LaptopA::quit`] stops its root daemon.
pub struct LaptopA {
    runtime: PathBuf,
    etc: PathBuf,
    next_packet: u64,
}

impl LaptopA {
    /// Adds laptop A's netns to `lab` (once per lab).
    pub fn add(lab: &mut Lab) -> Result<Self> {
        let added = lab.add_laptop(LAPTOP_A).context("add laptop A")?;
        Ok(LaptopA {
            runtime: lab.dir().join("laptop-a-runtime"),
            etc: added.netns.etc_dir(),
            next_packet: 0,
        })
    }

    fn kvpn(&self, lab: &Lab, args: &[&str]) -> Result<String> {
        let bin = kvpn_lab::bin_path("kvpn")?;
        let out = crate::kvpn_cli(
            lab.command_in(LAPTOP_A, &bin.to_string_lossy())?
                .args(args)
                .env("KVPN_RUNTIME_DIR", &self.runtime)
                .env("KVPN_RESOLV_CONF", self.etc.join("resolv.conf"))
                .env("KVPN_HOSTS", self.etc.join("hosts")),
            args,
        )?;
        if !out.status.success() {
            bail!(
                "kvpn {args:?} on laptop A: {}",
                String::from_utf8_lossy(&out.stderr).trim_end()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `rate_limited + refused_cap` of A's session, from A's `kvpn status`.
    fn limited(&self, lab: &Lab) -> Result<u64> {
        let out = self.kvpn(lab, &["status", "-o", "json"])?;
        let v: serde_json::Value = serde_json::from_str(&out)
            .with_context(|| format!("laptop A's kvpn status -o json: {out}"))?;
        let m = &v["sessions"][0]["manager_stats"];
        let n = |k: &str| m[k].as_u64();
        match (n("rate_limited"), n("refused_cap")) {
            (Some(a), Some(b)) => Ok(a + b),
            _ => bail!("laptop A's status has no manager_stats counters: {m}"),
        }
    }

    /// Stops A's root daemon (and its session).
    pub fn quit(&self, lab: &Lab) {
        let _ = self.kvpn(lab, &["quit"]);
    }
}

/// One round of the row: B connected with `connect_b` (then `kvpn quit`), A
/// connected with the same arguments and its own tunnel IP.
pub fn round(
    lab: &Lab,
    a: &mut LaptopA,
    secs: u32,
    clk_tck: f64,
    runtime_b: &Path,
    connect_b: &[&str],
) -> Result<Sample> {
    println!("==> measuring {ROW}");
    let result = (|| {
        kvpn(lab, runtime_b, connect_b)?;
        let mut connect_a = connect_b.to_vec();
        let tunnel_a = TUNNEL_IP_A.to_string();
        connect_a.extend(["--tunnel-ip", &tunnel_a]);
        a.kvpn(lab, &connect_a)?;
        measure(lab, a, secs, clk_tck)
    })();
    let _ = kvpn(lab, runtime_b, &["quit"]);
    a.quit(lab);
    result
}

fn measure(lab: &Lab, a: &mut LaptopA, secs: u32, clk_tck: f64) -> Result<Sample> {
    let to = Target::pod(BACKEND_1_IP, false).iperf;
    let manager: Vec<u32> = manager_pid(lab).into_iter().collect();
    if manager.is_empty() {
        bail!("no kvpn-manager process in the lab");
    }
    // The manager's CPU (core-seconds) per Gbit B moved in `secs`.
    let per_gbit = |ticks: u64, gbps: f64| ticks as f64 / clk_tck / (gbps * f64::from(secs));
    // Where the CPU goes in each phase (printed): manager, each root
    // daemon (pump), this process (A's flood sender), the whole machine.
    let mut who: Vec<(String, u32)> = vec![("manager".into(), manager[0])];
    for pid in lab_pids(lab, "kvpn-dataplane") {
        who.push((format!("pump {pid}"), pid));
    }
    who.push(("bench".into(), std::process::id()));
    let snapshot = || -> (Vec<u64>, u64) {
        let ticks = who.iter().map(|(_, p)| pids_cpu_ticks(&[*p])).collect();
        (ticks, machine_busy_total().map(|(b, _)| b).unwrap_or(0))
    };
    let report = |phase: &str, before: &(Vec<u64>, u64)| {
        let after = snapshot();
        let parts: Vec<String> = who
            .iter()
            .zip(before.0.iter().zip(&after.0))
            .map(|((name, _), (b, a))| format!("{name} {}", a.saturating_sub(*b)))
            .collect();
        println!(
            "    CPU ticks in B's run {phase}: {}, machine {}",
            parts.join(", "),
            after.1.saturating_sub(before.1)
        );
    };
    let mut s = Sample::new();
    let t0 = pids_cpu_ticks(&manager);
    let snap = snapshot();
    let alone = iperf3_tcp(lab, to, secs, 1, false)?;
    report("alone", &snap);
    let ticks = pids_cpu_ticks(&manager).saturating_sub(t0);
    s.insert("fair_alone_gbps".into(), alone);
    s.insert(
        "fair_alone_manager_core_s_per_gbit".into(),
        per_gbit(ticks, alone),
    );
    std::thread::sleep(SETTLE);
    let netns = lab.netns(LAPTOP_A)?.name().to_owned();
    let (mut offered, limited0) = (0u64, a.limited(lab)?);
    for (kind, dst, key) in [
        (Flood::Syn, BACKEND_1_IP, "fair_syn"),
        (Flood::Udp, BACKEND_2_IP, "fair_udp"),
    ] {
        let flood = Flooder::start(&netns, kind, TUNNEL_IP_A, dst, FLOOD_PPS, a.next_packet);
        std::thread::sleep(FLOOD_LEAD);
        let t0 = pids_cpu_ticks(&manager);
        let snap = snapshot();
        let under = iperf3_tcp(lab, to, secs, 1, false);
        report(key, &snap);
        let ticks = pids_cpu_ticks(&manager).saturating_sub(t0);
        let sent = flood.stop()?;
        a.next_packet += sent;
        offered += sent;
        let under = under?;
        s.insert(format!("{key}_gbps"), under);
        s.insert(format!("{key}_vs_alone"), under / alone);
        s.insert(
            format!("{key}_manager_core_s_per_gbit"),
            per_gbit(ticks, under),
        );
        std::thread::sleep(SETTLE);
    }
    // One stats frame a second: wait for the last flood's counters.
    std::thread::sleep(Duration::from_millis(1200));
    let limited = a.limited(lab)?.saturating_sub(limited0);
    s.insert(
        "flood_limited_pct".into(),
        100.0 * limited as f64 / offered.max(1) as f64,
    );
    println!("    {s:?}");
    Ok(s)
}
