//! The bounded soak (issue #10, item 5): mixed TCP, UDP and DNS traffic from the
//! Kubernetes lab's laptop netns through a real `kvpn connect`, while faults are
//! injected at intervals; every request is accounted for, and at the end the
//! daemons' file descriptors, the daemons' and the manager's memory, the
//! reconnects and the residue after disconnect are checked against bounds.
//!
//! Traffic, one worker per kind, each at `rate` requests per second, each
//! request with a deadline:
//! - `tcp`: `curl http://web.default/` (a Service *name*: the laptop's resolver,
//!   then HTTP to the ClusterIP), `--max-time 5`; the process is killed and the
//!   request counted `hung` if it outlives that by [`HUNG_GRACE`];
//! - `udp`: one datagram to the `udp-echo` ClusterIP, its echo awaited for 2 s;
//! - `dns`: an A query for a cluster name (`web.default.svc.cluster.local`, …)
//!   to the first nameserver of the laptop's resolv.conf (re-read for every
//!   query: kvpn's forwarder while connected), 3 s.
//!
//! Every request ends `ok` or failed with a class (`timeout`, `refused`,
//! `unreachable`, `reset`, `dns` (curl could not resolve), `servfail`,
//! `nxdomain`, `http_<code>`, …) or `hung` (outlived its deadline: a bound
//! broken).
//!
//! Faults, in this order (the next one waits until every kind has succeeded
//! again after the previous): SIGKILL of the user daemon (the next `kvpn status`
//! restarts it and it restores the session), SIGKILL of the root daemon
//! (`kvpn connect` again: a new root daemon sweeps and reconnects), deletion of
//! the manager pod (the Deployment makes a new one, the root daemon re-dials).
//! Then a checkpoint (traffic paused, in-flight requests done, 2 s of quiet):
//! fds and RSS of the user daemon, the root daemon and the manager. Then
//! transport kills (`ss -K` of the root daemon's data connection to the user
//! daemon, alternating with the port-forward's connections to the API server)
//! until the end, then the same checkpoint again. Comparing the two checkpoints
//! compares the same processes after the same phase.
//!
//! Failures are allowed only in a fault's outage window: from the fault (minus
//! the longest request deadline, for requests in flight) to the moment every
//! kind succeeded again; each window must close within
//! [`Bounds::recover_within`].
//!
//! I/O: processes and sockets in the laptop netns, the API server through the
//! admin client, `/proc` of the daemons and the manager.

use std::collections::BTreeMap;
use std::io::Read as _;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::path::Path;
use std::process::Stdio;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, RecordType};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams};
use kvpn_lab::{ECHO_SERVICE_PORT, Netns, UDP_ECHO_CLUSTER_IP, WEB_CLUSTER_IP};
use serde_json::{Value, json};

use crate::dns_lab::connect_default;
use crate::kube_lab::{
    KubeFixture, MANAGER_NAMESPACE, Residue, classifier_prog_ids, pod_name, pod_ready, prog_exists,
    residue,
};
use crate::text;

/// A request that outlives its deadline by more than this is `hung`.
/// Fds a daemon may hold beyond the first checkpoint's count without it being a leak.
const DAEMON_FD_SLACK: usize = 2;

pub const HUNG_GRACE: Duration = Duration::from_secs(3);
const TCP_DEADLINE: Duration = Duration::from_secs(5);
const UDP_DEADLINE: Duration = Duration::from_secs(2);
const DNS_DEADLINE: Duration = Duration::from_secs(3);
/// Quiet time before a checkpoint samples fds and memory: DNS forwarder
/// sockets and closing flows settle.
const SETTLE: Duration = Duration::from_secs(2);

/// What the soak checks; a broken one makes the run fail.
#[derive(Debug, Clone)]
pub struct Bounds {
    /// Every fault's outage (fault → every kind succeeded again) ends within this.
    pub recover_within: Duration,
    /// RSS growth of each process between the two checkpoints, bytes.
    pub rss_growth: u64,
    /// More open fds at the end than at the first checkpoint, per daemon.
    pub fd_growth: usize,
    /// Failed requests outside every fault's outage window.
    pub unexpected_failures: usize,
}

impl Default for Bounds {
    fn default() -> Self {
        Bounds {
            recover_within: Duration::from_secs(30),
            rss_growth: 16 * 1024 * 1024,
            fd_growth: 0,
            unexpected_failures: 0,
        }
    }
}

/// How long and how hard.
#[derive(Debug, Clone)]
pub struct Options {
    /// Traffic time (faults that have not finished by then still finish).
    pub duration: Duration,
    /// Requests per second, per kind.
    pub rate: f64,
    pub bounds: Bounds,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            duration: Duration::from_secs(600),
            rate: 4.0,
            bounds: Bounds::default(),
        }
    }
}

/// Traffic kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Tcp,
    Udp,
    Dns,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Tcp, Kind::Udp, Kind::Dns];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Tcp => "tcp",
            Kind::Udp => "udp",
            Kind::Dns => "dns",
        }
    }

    fn deadline(self) -> Duration {
        match self {
            Kind::Tcp => TCP_DEADLINE,
            Kind::Udp => UDP_DEADLINE,
            Kind::Dns => DNS_DEADLINE,
        }
    }
}

/// How a request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    Ok,
    /// Failed with this class of error.
    Failed(String),
    /// Outlived its deadline plus [`HUNG_GRACE`].
    Hung,
}

#[derive(Debug, Clone)]
struct Record {
    kind: Kind,
    /// Since the soak's start.
    start: Duration,
    took: Duration,
    outcome: Outcome,
}

/// Shared between the traffic workers and the fault driver.
struct Traffic {
    t0: Instant,
    stop: AtomicBool,
    pause: AtomicBool,
    /// Requests in flight.
    busy: AtomicUsize,
    started: [AtomicU64; 3],
    records: Mutex<Vec<Record>>,
}

impl Traffic {
    fn records(&self) -> Vec<Record> {
        self.records
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Pauses the workers and waits until no request is in flight.
    fn pause(&self) {
        self.pause.store(true, Ordering::SeqCst);
        let t = Instant::now();
        while self.busy.load(Ordering::SeqCst) > 0 {
            assert!(
                t.elapsed() < TCP_DEADLINE + HUNG_GRACE + Duration::from_secs(2),
                "requests still in flight {:?} after pausing the traffic",
                t.elapsed()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn resume(&self) {
        self.pause.store(false, Ordering::SeqCst);
    }

    /// When (since t0) every kind has had a successful request that started at or
    /// after `since`: the end of the latest of those first successes.
    fn recovered_after(&self, since: Duration) -> Option<Duration> {
        let records = self.records();
        Kind::ALL
            .iter()
            .map(|k| {
                records
                    .iter()
                    .filter(|r| r.kind == *k && r.start >= since && r.outcome == Outcome::Ok)
                    .map(|r| r.start + r.took)
                    .min()
            })
            .try_fold(Duration::ZERO, |acc, t| t.map(|t| acc.max(t)))
    }
}

/// Sets the stop flag when dropped (also when the driver panics), so the
/// workers end and the scope can join them.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

fn worker(tr: &Traffic, kind: Kind, rate: f64, request: impl Fn(u64) -> Outcome) {
    let interval = Duration::from_secs_f64(1.0 / rate.max(0.01));
    let mut next = Instant::now();
    let mut seq = 0u64;
    while !tr.stop.load(Ordering::SeqCst) {
        let now = Instant::now();
        if now < next {
            std::thread::sleep((next - now).min(Duration::from_millis(50)));
            continue;
        }
        // busy before pause is checked: the driver sets pause, then waits for busy == 0.
        tr.busy.fetch_add(1, Ordering::SeqCst);
        if tr.pause.load(Ordering::SeqCst) {
            tr.busy.fetch_sub(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(20));
            next = Instant::now();
            continue;
        }
        tr.started[kind as usize].fetch_add(1, Ordering::SeqCst);
        let start = Instant::now();
        let mut outcome = request(seq);
        let took = start.elapsed();
        if took > kind.deadline() + HUNG_GRACE {
            outcome = Outcome::Hung;
        }
        tr.records
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(Record {
                kind,
                start: start - tr.t0,
                took,
                outcome,
            });
        tr.busy.fetch_sub(1, Ordering::SeqCst);
        seq += 1;
        // Never more than one interval behind: after a slow request the rate
        // stays bounded instead of catching up in a burst.
        let now = Instant::now();
        next = (next + interval).max(now.checked_sub(interval).unwrap_or(now));
    }
}

fn io_class(e: &std::io::Error) -> String {
    use std::io::ErrorKind as K;
    match e.raw_os_error() {
        Some(libc::EHOSTUNREACH | libc::ENETUNREACH) => return "unreachable".into(),
        Some(libc::ECONNREFUSED) => return "refused".into(),
        _ => {}
    }
    match e.kind() {
        K::WouldBlock | K::TimedOut => "timeout".into(),
        K::ConnectionRefused => "refused".into(),
        K::ConnectionReset => "reset".into(),
        _ => format!("io: {e}"),
    }
}

/// `curl http://web.default/` in the laptop netns (its resolv.conf is the
/// laptop's), killed if it outlives its own `--max-time` by [`HUNG_GRACE`].
fn tcp_request(laptop: &Netns) -> Outcome {
    let mut cmd = laptop.command("curl");
    cmd.args([
        "-sS",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "--max-time",
        &TCP_DEADLINE.as_secs().to_string(),
        "http://web.default/",
    ])
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return Outcome::Failed(format!("spawn curl: {e}")),
    };
    let t0 = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if t0.elapsed() > TCP_DEADLINE + HUNG_GRACE => {
                let _ = child.kill();
                let _ = child.wait();
                return Outcome::Hung;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Outcome::Failed(format!("wait curl: {e}")),
        }
    };
    let mut out = String::new();
    let mut err = String::new();
    if let Some(mut o) = child.stdout.take() {
        let _ = o.read_to_string(&mut out);
    }
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    // curl's exit codes (man curl, EXIT CODES).
    match status.code() {
        Some(0) if out.trim() == "200" => Outcome::Ok,
        Some(0) => Outcome::Failed(format!("http_{}", out.trim())),
        Some(6) => Outcome::Failed("dns".into()),
        Some(7) if err.contains("No route") => Outcome::Failed("unreachable".into()),
        Some(7) if err.contains("refused") => Outcome::Failed("refused".into()),
        Some(7) => Outcome::Failed("connect".into()),
        Some(28) => Outcome::Failed("timeout".into()),
        Some(52) => Outcome::Failed("empty_reply".into()),
        Some(56) => Outcome::Failed("reset".into()),
        Some(c) => Outcome::Failed(format!("curl_exit_{c}")),
        None => Outcome::Failed(format!("curl {status}")),
    }
}

/// One datagram to the udp-echo ClusterIP; its echo within [`UDP_DEADLINE`].
/// Runs on a thread inside the laptop netns.
fn udp_request(seq: u64) -> Outcome {
    let target = SocketAddr::from((UDP_ECHO_CLUSTER_IP, ECHO_SERVICE_PORT));
    let run = || -> std::io::Result<Outcome> {
        let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
        s.connect(target)?;
        let payload = format!("kvpn-soak {seq}");
        s.send(payload.as_bytes())?;
        let deadline = Instant::now() + UDP_DEADLINE;
        let mut buf = [0u8; 512];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(Outcome::Failed("timeout".into()));
            }
            s.set_read_timeout(Some(left))?;
            let n = s.recv(&mut buf)?;
            if buf.get(..n) == Some(payload.as_bytes()) {
                return Ok(Outcome::Ok);
            }
        }
    };
    run().unwrap_or_else(|e| Outcome::Failed(io_class(&e)))
}

/// Cluster names the DNS worker asks for, with the address `web` must have.
const DNS_NAMES: [&str; 3] = [
    "web.default.svc.cluster.local.",
    "udp-echo.default.svc.cluster.local.",
    "kube-dns.kube-system.svc.cluster.local.",
];

/// An A query for a cluster name to the laptop's first nameserver (re-read
/// from `resolv_conf` each time). Runs on a thread inside the laptop netns.
fn dns_request(resolv_conf: &Path, seq: u64) -> Outcome {
    let conf = std::fs::read_to_string(resolv_conf).unwrap_or_default();
    let Some(server) = conf.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        (w.next() == Some("nameserver"))
            .then(|| w.next()?.parse::<IpAddr>().ok())
            .flatten()
    }) else {
        return Outcome::Failed("no_nameserver".into());
    };
    let name_text = DNS_NAMES[(seq % DNS_NAMES.len() as u64) as usize];
    let Ok(name) = Name::from_ascii(name_text) else {
        return Outcome::Failed("bad_name".into());
    };
    let mut query = Message::query();
    query.metadata.recursion_desired = true;
    query.metadata.id = (seq & 0xffff) as u16;
    query.add_query(Query::query(name, RecordType::A));
    let Ok(raw) = query.to_vec() else {
        return Outcome::Failed("encode".into());
    };
    let run = || -> std::io::Result<Outcome> {
        let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
        s.connect(SocketAddr::new(server, 53))?;
        s.send(&raw)?;
        let deadline = Instant::now() + DNS_DEADLINE;
        let mut buf = [0u8; 4096];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(Outcome::Failed("timeout".into()));
            }
            s.set_read_timeout(Some(left))?;
            let n = s.recv(&mut buf)?;
            let Ok(answer) = Message::from_vec(buf.get(..n).unwrap_or_default()) else {
                continue;
            };
            if answer.metadata.id != query.metadata.id {
                continue;
            }
            let a: Vec<Ipv4Addr> = answer
                .answers
                .iter()
                .filter_map(|r| match &r.data {
                    RData::A(a) => Some(a.0),
                    _ => None,
                })
                .collect();
            return Ok(match answer.metadata.response_code {
                ResponseCode::NoError if a.is_empty() => Outcome::Failed("no_answer".into()),
                ResponseCode::NoError
                    if name_text.starts_with("web.") && !a.contains(&WEB_CLUSTER_IP) =>
                {
                    Outcome::Failed("wrong_answer".into())
                }
                ResponseCode::NoError => Outcome::Ok,
                ResponseCode::ServFail => Outcome::Failed("servfail".into()),
                ResponseCode::NXDomain => Outcome::Failed("nxdomain".into()),
                other => Outcome::Failed(format!("rcode_{other}")),
            });
        }
    };
    run().unwrap_or_else(|e| Outcome::Failed(io_class(&e)))
}

/// One fault and its outage.
#[derive(Debug, Clone)]
struct Fault {
    what: String,
    /// Since t0.
    at: Duration,
    /// How long the injection itself took (e.g. the `kvpn connect` after a
    /// root daemon SIGKILL), part of the outage.
    inject: Duration,
    /// Since t0: every kind succeeded again (None: not within the bound).
    recovered: Option<Duration>,
}

/// fds and memory of one process at a checkpoint.
#[derive(Debug, Clone)]
struct ProcSample {
    pid: u32,
    rss: u64,
    fds: usize,
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(") ")
            .is_some_and(|(_, r)| !r.starts_with('Z') && !r.starts_with('X'))
    })
}

fn rss_of(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
            let kib: u64 = line
                .trim_start_matches("VmRSS:")
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .ok()?;
            Some(kib * 1024)
        })
        .unwrap_or(0)
}

fn sample(pid: u32) -> ProcSample {
    ProcSample {
        pid,
        rss: rss_of(pid),
        fds: KubeFixture::fd_count(pid),
    }
}

fn root_daemon_pid(f: &KubeFixture) -> u32 {
    let file = f.runtime_dir().join("dataplane.pid");
    std::fs::read_to_string(&file)
        .ok()
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("no root daemon pid in {}", file.display()))
}

fn user_daemon_pid(f: &KubeFixture) -> u32 {
    let pids = f.user_daemon_pids();
    assert_eq!(pids.len(), 1, "one user daemon expected: {pids:?}");
    pids[0]
}

/// The pid of the `kvpn-manager` process in this lab's pod netns (one alone:
/// waits while a deleted pod's process is still exiting).
fn manager_pid(f: &KubeFixture) -> u32 {
    let id = f.lab().netns_lab().id().to_owned();
    let t0 = Instant::now();
    loop {
        let mut found = Vec::new();
        for name in kvpn_lab::lab_netns(&id).unwrap_or_default() {
            for pid in Netns::from_name(&name).pids() {
                let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                if comm.trim() == "kvpn-manager" && alive(pid) {
                    found.push(pid);
                }
            }
        }
        if found.len() == 1 {
            return found[0];
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "expected one kvpn-manager process in lab {id}, found {found:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn sigkill(pid: u32, what: &str) {
    // SAFETY: kill with a pid of this soak's own fixture (pid file or command line
    // naming its runtime folder).
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let t0 = Instant::now();
    while alive(pid) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "{what} {pid} survived SIGKILL"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for exactly one session, `connected`.
fn wait_one_connected(f: &KubeFixture, within: Duration) {
    let t0 = Instant::now();
    loop {
        let sessions = f.sessions();
        if sessions.len() == 1 && sessions[0]["state"] == "connected" {
            return;
        }
        assert!(
            t0.elapsed() < within,
            "not one connected session within {within:?}: {sessions:#?}\n{}",
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The fault driver's view: the fixture, the traffic and the faults so far.
struct Driver<'a> {
    f: &'a KubeFixture,
    tr: &'a Traffic,
    opts: &'a Options,
    faults: Vec<Fault>,
    prog_ids: Vec<u32>,
    reconnects_by_connect: u32,
}

impl Driver<'_> {
    fn now(&self) -> Duration {
        self.tr.t0.elapsed()
    }

    fn sleep_until(&self, at: Duration) {
        let now = self.now();
        if at > now {
            std::thread::sleep(at - now);
        }
    }

    /// Runs `inject` (which does the fault and whatever recovery it takes), then
    /// waits until every kind succeeded again, within the bound.
    fn fault(&mut self, what: &str, inject: impl FnOnce(&KubeFixture)) {
        let at = self.now();
        eprintln!("soak: {:>6.1} s  {what}", at.as_secs_f64());
        inject(self.f);
        let injected = self.now();
        let inject = injected - at;
        let limit = at + self.opts.bounds.recover_within;
        // Only requests started once the injection took effect show recovery:
        // one started earlier may still have been served by what the fault
        // removes (an old manager pod still stopping), before the outage began.
        let recovered = loop {
            if let Some(t) = self.tr.recovered_after(injected) {
                break Some(t);
            }
            if self.now() > limit {
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        if let Some(t) = recovered {
            eprintln!(
                "soak: {:>6.1} s  recovered from {what} in {:.1} s",
                t.as_secs_f64(),
                (t - at).as_secs_f64()
            );
        }
        self.faults.push(Fault {
            what: what.to_owned(),
            at,
            inject,
            recovered,
        });
    }

    /// Traffic paused, quiet, then fds and memory of the user daemon, the root
    /// daemon and the manager.
    fn checkpoint(&mut self) -> BTreeMap<&'static str, ProcSample> {
        self.tr.pause();
        std::thread::sleep(SETTLE);
        wait_one_connected(self.f, Duration::from_secs(10));
        let mut m = BTreeMap::new();
        m.insert("user daemon", sample(user_daemon_pid(self.f)));
        m.insert("root daemon", sample(root_daemon_pid(self.f)));
        m.insert("manager", sample(manager_pid(self.f)));
        for id in classifier_prog_ids(self.f) {
            if !self.prog_ids.contains(&id) {
                self.prog_ids.push(id);
            }
        }
        self.tr.resume();
        m
    }
}

fn kill_user_daemon(f: &KubeFixture) {
    sigkill(user_daemon_pid(f), "user daemon");
    // The next kvpn command starts it again; it restores the session.
    let _ = f.sessions();
    wait_one_connected(f, Duration::from_secs(20));
}

fn kill_root_daemon(f: &KubeFixture) {
    sigkill(root_daemon_pid(f), "root daemon");
    let socket = f.runtime_dir().join("dataplane.sock");
    let t0 = Instant::now();
    while std::os::unix::net::UnixStream::connect(&socket).is_ok() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the killed root daemon's socket still answers"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // `kvpn connect` starts a new root daemon (which sweeps what the killed one
    // left) and replaces the session whose root half is gone.
    connect_default(f);
    for s in f.sessions() {
        if s["state"] != "connected"
            && let Some(id) = s["id"].as_str()
        {
            f.kvpn_ok(&["disconnect", id]);
        }
    }
    wait_one_connected(f, Duration::from_secs(20));
}

/// Deletes the ready manager pod; returns once the old pod object is gone (the
/// kubelet stand-in removes it after its process ended), a replacement is
/// ready, the root daemon re-established its data connection and the session
/// is `connected` with a heartbeat echoed after that: from then on every
/// request goes to the new pod.
fn delete_manager_pod(f: &KubeFixture) {
    let old = f
        .manager_pods()
        .into_iter()
        .find(pod_ready)
        .unwrap_or_else(|| panic!("no ready manager pod"));
    let name = pod_name(&old);
    let log = f.runtime_dir().join("dataplane.log");
    let redials_before = count_in_file(&log, "data connection re-established");
    let pods: Api<Pod> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    f.block_on(pods.delete(&name, &DeleteParams::default()))
        .unwrap_or_else(|e| panic!("delete manager pod {name}: {e}"));
    f.wait_manager_pod(Duration::from_secs(30), |p| pod_name(p) != name);
    let t0 = Instant::now();
    while f.manager_pods().iter().any(|p| pod_name(p) == name) {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "deleted manager pod {name} still listed after 30 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let echoed = |f: &KubeFixture| {
        f.session()["liveness"]["heartbeats_echoed"]
            .as_u64()
            .unwrap_or(0)
    };
    let t0 = Instant::now();
    while count_in_file(&log, "data connection re-established") <= redials_before {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the root daemon did not re-establish its data connection within 30 s of deleting manager pod {name}\n{}",
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    wait_one_connected(f, Duration::from_secs(20));
    let echoed_then = echoed(f);
    let t0 = Instant::now();
    while echoed(f) <= echoed_then {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "no heartbeat echoed within 10 s of the re-dial to the new manager pod"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Kills the established TCP connections to `dst` in the laptop netns.
fn kill_connections(f: &KubeFixture, dst: &str) {
    let out = f.laptop(&["ss", "-K", "-Htn", "state", "established", "dst", dst]);
    assert!(
        out.status.success(),
        "ss -K dst {dst}: {}",
        text(&out.stderr)
    );
}

fn count_in_file(path: &Path, needle: &str) -> usize {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .matches(needle)
        .count()
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

/// Runs the soak on a fresh Kubernetes lab; returns the report (see
/// [`report_table`] for its shape). `report["ok"]` is false, with
/// `report["violations"]` saying why, when a bound was broken. Panics (tearing
/// the lab down) only when the lab or kvpn cannot be brought up at all.
pub fn run(opts: &Options) -> Value {
    let f = KubeFixture::new();
    let before: Residue = residue(&f);
    connect_default(&f);
    wait_one_connected(&f, Duration::from_secs(20));
    let laptop = f.lab().netns_lab().laptop_netns().clone();
    let resolv_conf = f.laptop_resolv_conf();
    let tr = Traffic {
        t0: Instant::now(),
        stop: AtomicBool::new(false),
        pause: AtomicBool::new(false),
        busy: AtomicUsize::new(0),
        started: Default::default(),
        records: Mutex::new(Vec::new()),
    };
    let d = opts.duration;
    let mut driver = Driver {
        f: &f,
        tr: &tr,
        opts,
        faults: Vec::new(),
        prog_ids: Vec::new(),
        reconnects_by_connect: 0,
    };
    let mut violations: Vec<String> = Vec::new();

    let (start_samples, end_samples, end_at, redials, restores) = std::thread::scope(|s| {
        let tr = &tr;
        let laptop = &laptop;
        let resolv_conf = &resolv_conf;
        let traffic = s.spawn(move || {
            laptop.run(|| {
                std::thread::scope(|w| {
                    w.spawn(|| worker(tr, Kind::Tcp, opts.rate, |_| tcp_request(laptop)));
                    w.spawn(|| worker(tr, Kind::Udp, opts.rate, udp_request));
                    w.spawn(|| {
                        worker(tr, Kind::Dns, opts.rate, |seq| {
                            dns_request(resolv_conf, seq)
                        })
                    });
                });
            })
        });
        let stop = StopOnDrop(&tr.stop);
        // Traffic must work before any fault.
        driver.fault("start (connect done, traffic starting)", |_| {});

        driver.sleep_until(d / 10);
        driver.fault("SIGKILL user daemon", kill_user_daemon);
        let restores = f.session()["user_daemon"]["restores"].as_u64().unwrap_or(0);
        driver.sleep_until(d * 2 / 10);
        driver.fault("SIGKILL root daemon, kvpn connect", kill_root_daemon);
        driver.reconnects_by_connect += 1;
        driver.sleep_until(d * 3 / 10);
        driver.fault("delete manager pod", delete_manager_pod);
        driver.sleep_until(d * 4 / 10);
        let start_samples = driver.checkpoint();

        // Transport kills until 90 % of the time, at least two.
        let interval = (d / 20).clamp(Duration::from_secs(10), Duration::from_secs(30));
        let mut next = driver.now() + interval / 2;
        let mut round = 0;
        while round < 2 || next + interval / 2 < d * 9 / 10 {
            driver.sleep_until(next);
            let session = f.session();
            let agent = session["manager"].as_str().unwrap_or_default().to_owned();
            if round % 2 == 0 {
                driver.fault(
                    "transport kill (root daemon → user daemon connection)",
                    |f| kill_connections(f, &agent),
                );
            } else {
                driver.fault(
                    "transport kill (port-forward connections to the API server)",
                    |f| kill_connections(f, &format!("{}:6443", kvpn_lab::NODE_UPLINK_IP)),
                );
            }
            round += 1;
            next = driver.now().max(next) + interval;
        }
        driver.sleep_until(d);
        let end_at = driver.now();
        let end_samples = driver.checkpoint();
        let redials = count_in_file(
            &f.runtime_dir().join("dataplane.log"),
            "data connection re-established",
        );
        drop(stop);
        match traffic.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => violations.push(format!("traffic in the laptop netns: {e:#}")),
            Err(_) => violations.push("a traffic worker panicked".into()),
        }
        (start_samples, end_samples, end_at, redials, restores)
    });
    let duration = tr.t0.elapsed();
    let Driver {
        faults,
        prog_ids,
        reconnects_by_connect,
        ..
    } = driver;

    // Disconnect: nothing of kvpn may stay on the laptop.
    f.kvpn_ok(&["disconnect", "--all"]);
    let t_disc = Instant::now();
    let residue_after = loop {
        let now = residue(&f);
        if now == before || t_disc.elapsed() > Duration::from_secs(10) {
            break now;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let live_progs: Vec<u32> = prog_ids
        .iter()
        .copied()
        .filter(|id| prog_exists(*id))
        .collect();
    let residue_clean = residue_after == before && live_progs.is_empty();
    if residue_after != before {
        violations.push(format!(
            "residue after disconnect:\nbefore {before:#?}\nafter {residue_after:#?}"
        ));
    }
    if !live_progs.is_empty() {
        violations.push(format!(
            "eBPF classifier programs {live_progs:?} outlived the disconnect"
        ));
    }

    // Accounting.
    let records = tr.records();
    let max_deadline = Kind::ALL
        .iter()
        .map(|k| k.deadline())
        .max()
        .unwrap_or_default();
    let in_outage = |r: &Record| {
        faults.iter().any(|fl| {
            r.start + max_deadline + HUNG_GRACE >= fl.at
                && fl.recovered.is_none_or(|rec| r.start <= rec)
        })
    };
    let mut kinds = serde_json::Map::new();
    let mut unexpected = 0usize;
    let mut unexpected_examples = Vec::new();
    for k in Kind::ALL {
        let mine: Vec<&Record> = records.iter().filter(|r| r.kind == k).collect();
        let started = tr.started[k as usize].load(Ordering::SeqCst);
        let ok = mine.iter().filter(|r| r.outcome == Outcome::Ok).count();
        let hung = mine.iter().filter(|r| r.outcome == Outcome::Hung).count();
        let mut failures: BTreeMap<String, u64> = BTreeMap::new();
        for r in &mine {
            if let Outcome::Failed(class) = &r.outcome {
                *failures.entry(class.clone()).or_default() += 1;
                if !in_outage(r) {
                    unexpected += 1;
                    if unexpected_examples.len() < 10 {
                        unexpected_examples.push(format!(
                            "{} at {:.1} s: {class}",
                            k.name(),
                            r.start.as_secs_f64()
                        ));
                    }
                }
            }
        }
        let failed: u64 = failures.values().sum();
        let max_ms = mine.iter().map(|r| r.took.as_millis()).max().unwrap_or(0);
        if started as usize != mine.len() {
            violations.push(format!(
                "{}: {started} requests started, {} accounted for",
                k.name(),
                mine.len()
            ));
        }
        if hung > 0 {
            violations.push(format!("{}: {hung} requests hung", k.name()));
        }
        if ok == 0 {
            violations.push(format!("{}: no request succeeded", k.name()));
        }
        kinds.insert(
            k.name().to_owned(),
            json!({
                "started": started,
                "total": mine.len(),
                "ok": ok,
                "failed": failed,
                "hung": hung,
                "failures": failures,
                "max_ms": max_ms,
            }),
        );
    }
    if unexpected > opts.bounds.unexpected_failures {
        violations.push(format!(
            "{unexpected} failed requests outside every fault's outage window (bound {}): {}",
            opts.bounds.unexpected_failures,
            unexpected_examples.join("; ")
        ));
    }
    let faults_json: Vec<Value> = faults
        .iter()
        .map(|fl| {
            let failed_in = records
                .iter()
                .filter(|r| {
                    matches!(r.outcome, Outcome::Failed(_))
                        && r.start + max_deadline + HUNG_GRACE >= fl.at
                        && fl.recovered.is_none_or(|rec| r.start <= rec)
                })
                .count();
            json!({
                "fault": fl.what,
                "at_s": fl.at.as_secs_f64(),
                "inject_s": fl.inject.as_secs_f64(),
                "recovery_s": fl.recovered.map(|r| (r - fl.at).as_secs_f64()),
                "failed_requests": failed_in,
            })
        })
        .collect();
    for fl in &faults {
        if fl.recovered.is_none() {
            violations.push(format!(
                "no recovery from {} within {:?} (not every kind succeeded again)",
                fl.what, opts.bounds.recover_within
            ));
        }
    }
    let manager_udp_allowance = records
        .iter()
        .filter(|r| {
            r.kind != Kind::Tcp
                && r.start + kvpn_manager::engine::UDP_IDLE_TIMEOUT + SETTLE >= end_at
        })
        .count();
    let mut procs = Vec::new();
    for (name, a) in &start_samples {
        let Some(b) = end_samples.get(name) else {
            continue;
        };
        if a.pid != b.pid {
            violations.push(format!(
                "{name}: pid {} at the first checkpoint, {} at the end (restarted without a fault)",
                a.pid, b.pid
            ));
        }
        if b.rss > a.rss + opts.bounds.rss_growth {
            violations.push(format!(
                "{name}: RSS grew {:.1} MiB → {:.1} MiB (bound +{:.1} MiB)",
                mib(a.rss),
                mib(b.rss),
                mib(opts.bounds.rss_growth)
            ));
        }
        // The manager holds a kernel socket per flow, and a UDP flow (each UDP
        // echo request and each DNS query has its own source port) until
        // UDP_IDLE_TIMEOUT after its last packet: its fds may exceed the first
        // checkpoint's by the UDP requests of that last stretch, and no more.
        // A daemon may hold one or two short-lived fds at either checkpoint (a
        // `kvpn status` connection, a port-forward being re-dialled: seen 17 → 18
        // and 18 → 17); a leak per request would add hundreds.
        let allowance = if *name == "manager" {
            manager_udp_allowance
        } else {
            DAEMON_FD_SLACK
        };
        if b.fds > a.fds + allowance + opts.bounds.fd_growth {
            violations.push(format!(
                "{name}: {} fds at the first checkpoint, {} at the end (bound +{}, of which {allowance} \
                 for UDP flows still inside their idle timeout)",
                a.fds,
                b.fds,
                allowance + opts.bounds.fd_growth
            ));
        }
        procs.push(json!({
            "process": name,
            "pid_start": a.pid,
            "pid_end": b.pid,
            "rss_start_bytes": a.rss,
            "rss_end_bytes": b.rss,
            "fds_start": a.fds,
            "fds_end": b.fds,
            "fds_allowed_end": a.fds + allowance + opts.bounds.fd_growth,
        }));
    }
    let transport_kills = faults
        .iter()
        .filter(|fl| fl.what.starts_with("transport kill"))
        .count();
    json!({
        "ok": violations.is_empty(),
        "violations": violations,
        "duration_s": duration.as_secs_f64(),
        "planned_s": d.as_secs_f64(),
        "rate_per_kind": opts.rate,
        "requests": kinds,
        "faults": faults_json,
        "processes": procs,
        "reconnects": {
            "root_daemon_redials": redials,
            "user_daemon_restores": restores,
            "reconnects_by_connect": reconnects_by_connect,
            "transport_kills": transport_kills,
        },
        "residue_clean": residue_clean,
        "bounds": {
            "recover_within_s": opts.bounds.recover_within.as_secs_f64(),
            "rss_growth_bytes": opts.bounds.rss_growth,
            "fd_growth": opts.bounds.fd_growth,
            "unexpected_failures": opts.bounds.unexpected_failures,
            "hung": 0,
        },
    })
}

/// The report as a human-readable table.
pub fn report_table(r: &Value) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "kvpn soak: {:.0} s (planned {:.0} s), {} requests/s per kind\n\n",
        r["duration_s"].as_f64().unwrap_or(0.0),
        r["planned_s"].as_f64().unwrap_or(0.0),
        r["rate_per_kind"]
    ));
    s.push_str(&format!(
        "{:<5} {:>8} {:>8} {:>8} {:>6} {:>8}  failures by class\n",
        "KIND", "REQUESTS", "OK", "FAILED", "HUNG", "MAX MS"
    ));
    for k in Kind::ALL {
        let v = &r["requests"][k.name()];
        let classes: Vec<String> = v["failures"]
            .as_object()
            .map(|m| m.iter().map(|(c, n)| format!("{c} {n}")).collect())
            .unwrap_or_default();
        s.push_str(&format!(
            "{:<5} {:>8} {:>8} {:>8} {:>6} {:>8}  {}\n",
            k.name(),
            v["total"].to_string(),
            v["ok"].to_string(),
            v["failed"].to_string(),
            v["hung"].to_string(),
            v["max_ms"].to_string(),
            classes.join(", ")
        ));
    }
    s.push_str(&format!(
        "\n{:<62} {:>7} {:>10} {:>7}\n",
        "FAULT", "AT S", "RECOVERY S", "FAILED"
    ));
    for fl in r["faults"].as_array().into_iter().flatten() {
        s.push_str(&format!(
            "{:<62} {:>7.1} {:>10} {:>7}\n",
            fl["fault"].as_str().unwrap_or_default(),
            fl["at_s"].as_f64().unwrap_or(0.0),
            fl["recovery_s"]
                .as_f64()
                .map_or("none".to_owned(), |x| format!("{x:.1}")),
            fl["failed_requests"].to_string()
        ));
    }
    s.push_str(&format!(
        "\n{:<12} {:>8} {:>8} {:>11} {:>11} {:>9} {:>7}\n",
        "PROCESS", "PID", "PID END", "RSS START", "RSS END", "FDS START", "FDS END"
    ));
    for p in r["processes"].as_array().into_iter().flatten() {
        s.push_str(&format!(
            "{:<12} {:>8} {:>8} {:>7.1} MiB {:>7.1} MiB {:>9} {:>7}\n",
            p["process"].as_str().unwrap_or_default(),
            p["pid_start"].to_string(),
            p["pid_end"].to_string(),
            mib(p["rss_start_bytes"].as_u64().unwrap_or(0)),
            mib(p["rss_end_bytes"].as_u64().unwrap_or(0)),
            p["fds_start"].to_string(),
            p["fds_end"].to_string()
        ));
    }
    let rc = &r["reconnects"];
    s.push_str(&format!(
        "\nreconnects: {} root daemon re-dials, {} user daemon restores, {} by kvpn connect ({} transport kills)\n",
        rc["root_daemon_redials"],
        rc["user_daemon_restores"],
        rc["reconnects_by_connect"],
        rc["transport_kills"]
    ));
    s.push_str(&format!(
        "residue after disconnect: {}\n",
        if r["residue_clean"] == true {
            "none"
        } else {
            "FOUND"
        }
    ));
    let violations: Vec<&str> = r["violations"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    if violations.is_empty() {
        s.push_str("result: every bound held\n");
    } else {
        s.push_str("result: BOUNDS BROKEN\n");
        for v in violations {
            s.push_str(&format!("  - {v}\n"));
        }
    }
    s
}
