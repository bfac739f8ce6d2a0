//! Flood fairness between clients ([hardening] item 3, issue #10), the facts
//! that do not depend on timing: a laptop that floods the traffic manager with
//! (a) TCP SYNs to closed ports or (b) 64-byte UDP datagrams to closed ports
//! is held to its own session's limits (manager/src/limit.rs: most of its
//! flood refused, counted in its `kvpn status`), while a second laptop's
//! transfer through the same manager completes intact during each flood and
//! none of its flows is limited. How much the flood costs the second laptop's
//! throughput is a figure, measured by the bench's `kvpn-fairness` row
//! (`kvpn-bench --fairness-only`, bench/src/fairness.rs), not asserted here.
//!
//! Static lab, real everything: laptop B is the fixture's laptop, laptop A a
//! second laptop netns ([`kvpn_lab::Lab::add_laptop`]) with its own root
//! daemon, TUN device and tunnel IP; both connect over direct TCP to the same
//! `kvpn-manager`. A's flood ([`kvpn_lab::flood`]) is paced at [`FLOOD_PPS`],
//! five times the manager's sustained new-flow allowance.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::Output;
use std::time::Duration;

use kvpn_lab::flood::{Flood, Flooder};
use kvpn_lab::{BACKEND_1_IP, BACKEND_2_IP, ECHO_PORT, Netns};
use kvpn_tests::{Fixture, lab_connect_args, text};

/// A's flood rate, packets/s: 5× the manager's sustained new-flow allowance.
const FLOOD_PPS: u64 = 5 * kvpn_manager::limit::NEW_FLOWS_PER_SEC as u64;
/// The flood runs this long before B's transfer starts (A's burst allowance
/// is spent by then).
const FLOOD_LEAD: Duration = Duration::from_secs(1);
/// How long each flood runs: long enough that most of it comes after A's
/// burst allowances (4096 new flows) are spent.
const FLOOD_FOR: Duration = Duration::from_secs(4);
/// Bytes of each of B's echo transfers through backend-1, repeated while a
/// flood runs.
const TRANSFER: usize = 8 * 1024 * 1024;
/// A's tunnel IP (B has the connect default, 100.96.0.2).
const TUNNEL_IP_A: Ipv4Addr = Ipv4Addr::new(100, 96, 0, 3);

/// Laptop A: its own netns, root daemon and runtime folder. Drop quits its
/// kvpn (root daemon and sessions) before the fixture takes the lab down.
struct LaptopA {
    netns: Netns,
    runtime_dir: PathBuf,
    kvpn: PathBuf,
}

impl LaptopA {
    fn add(f: &mut Fixture) -> Self {
        let added = f
            .lab
            .add_laptop("laptop-a")
            .unwrap_or_else(|e| panic!("add laptop A: {e:#}"));
        LaptopA {
            netns: added.netns,
            runtime_dir: f.lab.dir().join("laptop-a-runtime"),
            kvpn: kvpn_lab::bin_path("kvpn").unwrap_or_else(|e| panic!("kvpn binary: {e:#}")),
        }
    }

    fn kvpn(&self, args: &[&str]) -> Output {
        let mut cmd = self.netns.command(&self.kvpn);
        cmd.args(args)
            .env("KVPN_RUNTIME_DIR", &self.runtime_dir)
            .env("KVPN_RESOLV_CONF", self.netns.etc_dir().join("resolv.conf"))
            .env("KVPN_HOSTS", self.netns.etc_dir().join("hosts"));
        cmd.output()
            .unwrap_or_else(|e| panic!("run kvpn {args:?} on laptop A: {e}"))
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.runtime_dir.join("dataplane.log")).unwrap_or_default()
    }
}

impl Drop for LaptopA {
    fn drop(&mut self) {
        let _ = self.kvpn(&["quit"]);
    }
}

/// `manager_stats` of the first session in `kvpn status -o json` output.
fn manager_stats(out: &Output) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("status JSON: {e}: {}", text(&out.stdout)));
    v["sessions"][0]["manager_stats"].clone()
}

fn count(stats: &serde_json::Value, key: &str) -> u64 {
    stats[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no manager_stats.{key}: {stats}"))
}

/// Echoes [`TRANSFER`] bytes of the lab payload through backend-1's echo
/// server from laptop B; the bytes that come back must equal those sent.
fn echo_transfer(f: &Fixture) -> Result<(), String> {
    f.in_laptop(|| {
        let to = SocketAddr::from((BACKEND_1_IP, ECHO_PORT));
        let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(10))
            .map_err(|e| format!("connect {to}: {e}"))?;
        s.set_read_timeout(Some(Duration::from_secs(20)))
            .map_err(|e| e.to_string())?;
        let mut rd = s.try_clone().map_err(|e| e.to_string())?;
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; TRANSFER];
            rd.read_exact(&mut got).map(|()| got)
        });
        let mut data = vec![0u8; TRANSFER];
        kvpn_lab::payload::fill(0, &mut data);
        s.write_all(&data).map_err(|e| format!("write: {e}"))?;
        let got = reader
            .join()
            .map_err(|_| "reader panicked".to_owned())?
            .map_err(|e| format!("read: {e}"))?;
        if got == data {
            Ok(())
        } else {
            Err("the echoed bytes differ".to_owned())
        }
    })
}

#[test]
fn flood_from_one_client_is_limited_and_another_clients_transfer_completes() {
    let mut f = Fixture::new();
    f.connect();
    let a = LaptopA::add(&mut f);
    let tunnel_a = TUNNEL_IP_A.to_string();
    let mut args = vec!["connect".to_owned()];
    args.extend(lab_connect_args());
    args.extend(["--tunnel-ip".to_owned(), tunnel_a]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = a.kvpn(&args);
    assert!(
        out.status.success(),
        "kvpn connect on laptop A failed:\n{}\n{}\n{}",
        text(&out.stdout),
        text(&out.stderr),
        a.log()
    );
    // Laptop A reaches the cluster before it floods it.
    let probe = a
        .netns
        .exec(&["ping", "-c", "1", "-W", "5", &BACKEND_2_IP.to_string()])
        .unwrap_or_else(|e| panic!("ping from laptop A: {e:#}"));
    assert!(
        probe.status.success(),
        "laptop A cannot reach backend-2 through its session:\n{}\n{}",
        text(&probe.stdout),
        a.log()
    );

    let mut next_packet = 0u64;
    let mut offered = 0u64;
    for (kind, dst) in [(Flood::Syn, BACKEND_1_IP), (Flood::Udp, BACKEND_2_IP)] {
        let flood = Flooder::start(
            a.netns.name(),
            kind,
            TUNNEL_IP_A,
            dst,
            FLOOD_PPS,
            next_packet,
        );
        let started = std::time::Instant::now();
        std::thread::sleep(FLOOD_LEAD);
        let mut transfers = 0;
        let mut transfer = Ok(());
        while transfer.is_ok() && (transfers == 0 || started.elapsed() < FLOOD_FOR) {
            transfer = echo_transfer(&f);
            transfers += 1;
        }
        let sent = flood
            .stop()
            .unwrap_or_else(|e| panic!("{kind:?} flood from laptop A: {e:#}"));
        eprintln!(
            "fairness: {kind:?} flood: laptop A offered {sent} packets; laptop B echoed {transfers} × {TRANSFER} bytes"
        );
        next_packet += sent;
        offered += sent;
        if let Err(e) = transfer {
            panic!(
                "laptop B's {TRANSFER}-byte echo during A's {kind:?} flood failed: {e}\n{}",
                f.manager_log()
            );
        }
        let min = FLOOD_PPS * FLOOD_FOR.as_secs() / 2;
        assert!(
            sent >= min,
            "A's {kind:?} flood offered only {sent} packets (≥ {min} expected)"
        );
    }
    // One stats frame a second: the counters after the last flood.
    std::thread::sleep(Duration::from_millis(1500));
    let stats_a = manager_stats(&a.kvpn(&["status", "-o", "json"]));
    let stats_b = manager_stats(&f.kvpn(&["status", "-o", "json"]));
    eprintln!("fairness: laptop A's manager_stats: {stats_a}");
    eprintln!("fairness: laptop B's manager_stats: {stats_b}");
    let tail = || {
        let log = f.manager_log();
        let lines: Vec<&str> = log.lines().rev().take(30).collect();
        format!("manager log tail:\n{}", lines.join("\n"))
    };
    // Most of A's flood was refused by its session's limits (new-flow rate
    // limit, failed-flow limit, per-kind cap), and counted.
    let limited = count(&stats_a, "rate_limited") + count(&stats_a, "refused_cap");
    assert!(
        count(&stats_a, "rate_limited") > 0 && limited >= offered / 2,
        "the manager's limits refused only {limited} of laptop A's {offered} flood packets: {stats_a}\n{}",
        tail()
    );
    // None of B's flows was limited.
    assert!(
        count(&stats_b, "rate_limited") == 0 && count(&stats_b, "refused_cap") == 0,
        "laptop B's own flows were limited: {stats_b}\n{}",
        tail()
    );
}
