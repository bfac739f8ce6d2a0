//! End-to-end: SIGINT or SIGTERM to a running `kvpn-bench --plain-only` stops it
//! with everything it made removed: no netns, /etc/netns entry, lab folder or
//! nftables table with the lab's id, and none of the processes that ran for it
//! (the lab's servers, socat and its forks, kvpn's daemons and manager, the bench's
//! iperf3/ping/kvpn tools) alive; it exits 128 + the signal's number and says
//! which lab it removed. Tester finding: Ctrl-C or `timeout` left the whole lab
//! behind (5 netns, the lab servers, the manager, `iperf3 -s`, socat reparented
//! to pid 1, /tmp/kvpn-lab-<id>, /etc/netns/kvpn-<id>-laptop).
//!
//! The signal goes to the bench's pid alone (as `kill` or systemd send it), not to
//! a terminal's process group: the bench itself must stop the tools it runs.
//! SIGINT comes while kvpn direct is measured (a kvpn session and its daemons
//! up), SIGTERM during the raw-veth baseline.
//!
//! Needs `kvpn-bench` and the workspace binaries in `KVPN_BIN_DIR`, iperf3 and
//! socat (scripts/setup.sh).

use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::MetadataExt as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpn_lab::Netns;

/// `(state, ppid, start time in ticks)` from `/proc/<pid>/stat`.
fn proc_stat(pid: u32) -> Option<(char, u32, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // comm may hold spaces and parens: count fields from the last `)`.
    let mut fields = text[text.rfind(')')? + 1..].split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    // starttime is field 22; after state (3) and ppid (4), skip fields 5..=21.
    let start = fields.nth(17)?.parse().ok()?;
    Some((state, ppid, start))
}

fn all_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn comm(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// A process seen while the bench ran: pid, start time (so a reused pid is not
/// taken for it) and command name.
#[derive(Debug)]
struct Seen {
    pid: u32,
    start: u64,
    comm: String,
}

impl Seen {
    fn alive(&self) -> bool {
        proc_stat(self.pid).is_some_and(|(state, _, start)| start == self.start && state != 'Z')
    }
}

/// A running `kvpn-bench`: its output lines as they come, and everything it
/// printed. Dropping it kills a bench still running (by pid) and removes what is
/// left of its lab (only when the test failed: the bench's own teardown is what
/// the test checks).
struct Bench {
    child: Child,
    lines: Receiver<String>,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
    lab_id: Option<String>,
    out_dir: PathBuf,
}

impl Bench {
    fn start(name: &str) -> Bench {
        let out_dir = std::env::temp_dir().join(format!(
            "kvpn-bench-interrupt-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&out_dir);
        let mut child = kvpn_tests::short_bench(&out_dir)
            .arg("--plain-only")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("run kvpn-bench: {e}"));
        let (line_tx, lines) = channel();
        let stdout = Arc::new(Mutex::new(String::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let out_pipe = child.stdout.take().expect("piped stdout");
        let all = Arc::clone(&stdout);
        std::thread::spawn(move || {
            for line in BufReader::new(out_pipe).lines().map_while(Result::ok) {
                all.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push_str(&format!("{line}\n"));
                let _ = line_tx.send(line);
            }
        });
        let mut err_pipe = child.stderr.take().expect("piped stderr");
        let all = Arc::clone(&stderr);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err_pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                all.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Bench {
            child,
            lines,
            stdout,
            stderr,
            lab_id: None,
            out_dir,
        }
    }

    fn output(&self) -> String {
        let get = |s: &Arc<Mutex<String>>| {
            s.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone()
        };
        format!(
            "stdout:\n{}\nstderr:\n{}",
            get(&self.stdout),
            get(&self.stderr)
        )
    }

    /// The first output line for which `pick` gives something, within `timeout`.
    fn wait_line<T>(&self, timeout: Duration, what: &str, pick: impl Fn(&str) -> Option<T>) -> T {
        let end = Instant::now() + timeout;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(t) = pick(&line) {
                        return t;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    panic!("no {what} within {timeout:?}:\n{}", self.output())
                }
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("kvpn-bench ended before {what}:\n{}", self.output())
                }
            }
        }
    }

    /// The id of the lab the bench runs: the `<id>` of the `kvpn-<id>-*` netns its
    /// children (the lab's servers) run in.
    fn lab_id(&self) -> String {
        let me = self.child.id();
        let inode = |path: String| std::fs::metadata(path).ok().map(|m| m.ino());
        let children: Vec<u64> = all_pids()
            .into_iter()
            .filter(|&p| proc_stat(p).is_some_and(|(_, ppid, _)| ppid == me))
            .filter_map(|p| inode(format!("/proc/{p}/ns/net")))
            .collect();
        let mut ids: Vec<String> = kvpn_lab::list_kvpn_netns()
            .unwrap_or_else(|e| panic!("list netns: {e}"))
            .into_iter()
            .filter(|n| inode(format!("/run/netns/{n}")).is_some_and(|i| children.contains(&i)))
            .filter_map(|n| Some(n.strip_prefix("kvpn-")?.split_once('-')?.0.to_owned()))
            .collect();
        ids.sort();
        ids.dedup();
        match &ids[..] {
            [id] => id.clone(),
            _ => panic!(
                "the bench's children run in the netns of labs {ids:?}, not of one lab:\n{}",
                self.output()
            ),
        }
    }

    /// The processes of the run now: every process in the lab's netns (servers,
    /// socat forks, kvpn's daemons, the manager) and every descendant of the bench
    /// (its tools, wherever they run).
    fn processes(&self, id: &str) -> Vec<Seen> {
        let mut pids: Vec<u32> = kvpn_lab::lab_netns(id)
            .unwrap_or_else(|e| panic!("netns of lab {id}: {e}"))
            .iter()
            .flat_map(|n| Netns::from_name(n).pids())
            .collect();
        let stats: Vec<(u32, u32)> = all_pids()
            .into_iter()
            .filter_map(|p| Some((p, proc_stat(p)?.1)))
            .collect();
        let mut tree = vec![self.child.id()];
        while let Some(parent) = tree.pop() {
            for &(pid, ppid) in &stats {
                if ppid == parent && !pids.contains(&pid) {
                    pids.push(pid);
                    tree.push(pid);
                }
            }
        }
        pids.into_iter()
            .filter_map(|pid| {
                let (_, _, start) = proc_stat(pid)?;
                Some(Seen {
                    pid,
                    start,
                    comm: comm(pid),
                })
            })
            .collect()
    }

    /// Sends `signal` to the bench's pid and waits (up to 60 s) for its exit code.
    fn signal_and_wait(&mut self, signal: i32) -> Option<i32> {
        let pid = i32::try_from(self.child.id()).expect("pid");
        // SAFETY: kill(2) on the child this test started and has not reaped yet,
        // so the pid is still the bench's.
        unsafe { libc::kill(pid, signal) };
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return status.code(),
                Ok(None) if Instant::now() < end => std::thread::sleep(Duration::from_millis(50)),
                Ok(None) => panic!(
                    "kvpn-bench still runs 60 s after signal {signal}:\n{}",
                    self.output()
                ),
                Err(e) => panic!("wait for kvpn-bench: {e}"),
            }
        }
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.out_dir);
        // A failed test: remove what the bench left of its lab (its netns, the
        // processes in them, /etc/netns, the folder), never anything else.
        let Some(id) = &self.lab_id else {
            return;
        };
        for name in kvpn_lab::lab_netns(id).unwrap_or_default() {
            let netns = Netns::from_name(&name);
            for pid in netns.pids() {
                if let Ok(pid) = i32::try_from(pid) {
                    // SAFETY: kill(2) on a process inside this test's lab netns.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
            std::thread::sleep(Duration::from_millis(200));
            let _ = netns.delete();
        }
        let _ = std::fs::remove_dir_all(std::env::temp_dir().join(format!("kvpn-lab-{id}")));
        let _ = std::fs::remove_file(
            kvpn_lab::state_dir()
                .join("owners")
                .join(format!("{id}.json")),
        );
    }
}

/// What is left with the lab's id: netns, /etc/netns entries, the lab folder,
/// host nftables tables, and processes of `seen` still alive.
fn leftovers(id: &str, seen: &[Seen]) -> Vec<String> {
    let mut left: Vec<String> = kvpn_lab::lab_netns(id)
        .unwrap_or_default()
        .into_iter()
        .map(|n| format!("netns {n}"))
        .collect();
    let prefix = format!("kvpn-{id}-");
    if let Ok(entries) = std::fs::read_dir("/etc/netns") {
        left.extend(
            entries
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.starts_with(&prefix))
                .map(|n| format!("/etc/netns/{n}")),
        );
    }
    let dir = std::env::temp_dir().join(format!("kvpn-lab-{id}"));
    if dir.exists() {
        left.push(format!("folder {}", dir.display()));
    }
    let tables = Command::new("nft")
        .args(["list", "tables"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    left.extend(
        tables
            .lines()
            .filter(|t| t.contains(id))
            .map(|t| format!("nftables {t}")),
    );
    left.extend(
        seen.iter()
            .filter(|p| p.alive())
            .map(|p| format!("process {} (pid {})", p.comm, p.pid)),
    );
    left
}

/// Starts the bench, waits for the output line `when`, finds its lab and
/// collects the run's processes, sends `signal` and checks the exit and that
/// nothing of the run is left.
/// `expect`: programs that must be among the run's processes when the signal
/// comes (so the test covers them).
fn interrupted_bench_leaves_nothing(name: &str, signal: i32, when: &str, expect: &[&str]) {
    let mut bench = Bench::start(name);
    bench.wait_line(Duration::from_secs(300), when, |l| {
        l.starts_with(when).then_some(())
    });
    let id = bench.lab_id();
    bench.lab_id = Some(id.clone());
    // Into the measurement: tools running, the session's traffic flowing.
    std::thread::sleep(Duration::from_millis(700));
    let seen = bench.processes(&id);
    for program in ["kvpn-lab-server", "kvpn-manager", "socat", "iperf3"]
        .iter()
        .chain(expect)
    {
        assert!(
            seen.iter().any(|p| p.comm == *program),
            "no {program} among the run's processes before the signal: {seen:?}"
        );
    }
    let code = bench.signal_and_wait(signal);
    let output = bench.output();
    assert_eq!(
        code,
        Some(128 + signal),
        "kvpn-bench did not exit 128 + {signal} after the signal (None: killed by it, \
         without its teardown):\n{output}"
    );
    assert!(
        output.contains(&format!("interrupted: lab kvpn-{id} removed")),
        "no `interrupted: lab kvpn-{id} removed` line:\n{output}"
    );
    assert!(
        !bench.out_dir.join("kvpn-bench.json").exists(),
        "an interrupted run wrote a report"
    );
    let left = leftovers(&id, &seen);
    assert!(
        left.is_empty(),
        "left behind after {name}: {left:#?}\n{output}"
    );
}

#[test]
fn sigint_during_kvpn_direct_removes_the_lab_and_its_processes() {
    if kvpn_lab::require_root().is_err() {
        panic!("bench_interrupt needs root (network namespaces)");
    }
    interrupted_bench_leaves_nothing(
        "sigint",
        libc::SIGINT,
        "==> measuring kvpn-direct",
        // kvpn's root daemon, started by `kvpn connect` in the laptop netns.
        &["kvpn-dataplane"],
    );
}

#[test]
fn sigterm_during_the_baseline_removes_the_lab_and_its_processes() {
    if kvpn_lab::require_root().is_err() {
        panic!("bench_interrupt needs root (network namespaces)");
    }
    interrupted_bench_leaves_nothing("sigterm", libc::SIGTERM, "==> measuring raw-veth", &[]);
}
