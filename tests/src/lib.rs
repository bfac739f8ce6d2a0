//! Fixtures for kvpn's end-to-end tests: a lab instance (network namespaces,
//! real servers, the real traffic manager) plus the real `kvpn` CLI and root
//! daemon running in its laptop netns. Every fixture has its own lab id and
//! runtime folder, so tests run in parallel, and tears everything down on drop,
//! also when the test fails. [`kube_lab::KubeFixture`] does the same on the
//! Kubernetes lab (real API server; `kvpn connect --kubeconfig`).
//! [`soak`] is the bounded soak that `./x soak` (binary `kvpn-soak`) and
//! tests/tests/soak.rs run on it.

pub mod containerd;
pub mod dns_lab;
pub mod krb5_lab;
pub mod kube_lab;
pub mod lab_cli;
pub mod real_node;
pub mod resolved_lab;
pub mod soak;
pub mod ssh_lab;
pub mod ssh_term_lab;

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

use kvpn_lab::{LAPTOP, Lab, LabOptions, ManagerProcess};

/// `kvpn-bench` for a test run of seconds: one 1-second round of each metric,
/// `--force` (tests run beside other tests' load), 10 Mbit/s of 64-byte UDP
/// (enough to check the UDP metric works; the 100 Mbit/s default floods the
/// tunnel, a figure for the full bench only), output under `out_dir`. The
/// caller adds row selections such as `--plain-only`.
pub fn short_bench(out_dir: &std::path::Path) -> Command {
    let bench = kvpn_lab::bin_path("kvpn-bench").unwrap_or_else(|e| panic!("kvpn-bench: {e:#}"));
    let mut cmd = Command::new(bench);
    cmd.args([
        "--rounds",
        "1",
        "--seconds",
        "1",
        "--force",
        "--udp-rate",
        "10M",
        "--out-dir",
    ])
    .arg(out_dir);
    cmd
}

/// The laptop-side connect arguments for the lab's cluster.
pub fn lab_connect_args() -> Vec<String> {
    vec![
        "--manager".into(),
        kvpn_lab::MANAGER_ADDR_FROM_LAPTOP.to_string(),
        "--pod-cidr".into(),
        kvpn_lab::POD_CIDR.to_string(),
        "--service-cidr".into(),
        kvpn_lab::SERVICE_CIDR.to_string(),
    ]
}

/// A lab plus kvpn on its laptop.
pub struct Fixture {
    /// The lab instance.
    pub lab: Lab,
    runtime_dir: PathBuf,
    kvpn: PathBuf,
}

impl Fixture {
    /// A fresh lab (real manager and backends), not connected yet.
    pub fn new() -> Self {
        Self::with_options(LabOptions::default())
    }

    /// A fresh lab whose manager runs with `args` added to its command line
    /// (e.g. `--max-flows-per-client 8`), not connected yet.
    pub fn with_manager_args(args: &[&str]) -> Self {
        let options = LabOptions::default().manager(ManagerProcess::Kvpn {
            extra_args: args.iter().map(|a| (*a).to_owned()).collect(),
        });
        Self::with_options(options)
    }

    /// A fresh lab built with `options` (e.g. a manager run by another program),
    /// not connected yet.
    pub fn with_lab_options(options: LabOptions) -> Self {
        Self::with_options(options)
    }

    fn with_options(options: LabOptions) -> Self {
        let lab = Lab::up(options).unwrap_or_else(|e| panic!("lab up: {e:#}"));
        let runtime_dir = lab.dir().join("runtime");
        let kvpn = kvpn_lab::bin_path("kvpn").unwrap_or_else(|e| panic!("kvpn binary: {e:#}"));
        Fixture {
            lab,
            runtime_dir,
            kvpn,
        }
    }

    /// A fresh lab with `kvpn connect` done.
    pub fn connected() -> Self {
        let f = Self::new();
        f.connect();
        f
    }

    /// Runs `kvpn <args>` in the laptop netns with this fixture's runtime folder.
    pub fn kvpn(&self, args: &[&str]) -> Output {
        let mut cmd = self
            .lab
            .command_in(LAPTOP, &self.kvpn.to_string_lossy())
            .unwrap_or_else(|e| panic!("laptop netns: {e:#}"));
        cmd.args(args).env("KVPN_RUNTIME_DIR", &self.runtime_dir);
        cmd.output()
            .unwrap_or_else(|e| panic!("run kvpn {args:?}: {e}"))
    }

    /// `kvpn connect` to the lab's manager; panics with kvpn's output on failure.
    pub fn connect(&self) {
        self.connect_with(&[]);
    }

    /// [`Fixture::connect`] with `extra` flags (e.g. `--workers 2`).
    pub fn connect_with(&self, extra: &[&str]) {
        let args = lab_connect_args();
        let mut all: Vec<&str> = vec!["connect"];
        all.extend(args.iter().map(String::as_str));
        all.extend_from_slice(extra);
        let out = self.kvpn(&all);
        assert!(
            out.status.success(),
            "kvpn connect failed:\n{}\n{}\ndaemon log:\n{}",
            text(&out.stdout),
            text(&out.stderr),
            self.daemon_log()
        );
    }

    /// `kvpn disconnect --all`; panics on failure.
    pub fn disconnect(&self) {
        let out = self.kvpn(&["disconnect", "--all"]);
        assert!(
            out.status.success(),
            "kvpn disconnect failed:\n{}\n{}",
            text(&out.stdout),
            text(&out.stderr)
        );
    }

    /// `kvpn status -o json`, parsed.
    pub fn status_json(&self) -> serde_json::Value {
        let out = self.kvpn(&["status", "-o", "json"]);
        assert!(
            out.status.success(),
            "kvpn status failed:\n{}",
            text(&out.stderr)
        );
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("status JSON: {e}: {}", text(&out.stdout)))
    }

    /// Runs `script` with bash in the laptop netns, in its own process group
    /// (killed on drop), stdout and stderr piped.
    pub fn spawn_in_laptop(&self, script: &str) -> Spawned {
        spawn_in_laptop(&self.lab, script)
    }

    /// Runs a command in the laptop netns.
    pub fn laptop(&self, args: &[&str]) -> Output {
        self.lab
            .exec_in(LAPTOP, args)
            .unwrap_or_else(|e| panic!("laptop {args:?}: {e:#}"))
    }

    /// Runs `f` on a thread inside the laptop netns (for sockets opened by the test).
    pub fn in_laptop<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        self.lab
            .run_in(LAPTOP, f)
            .unwrap_or_else(|e| panic!("laptop netns: {e:#}"))
    }

    /// The laptop's `KVPN_RUNTIME_DIR` (root daemon socket, pid file, logs).
    pub fn runtime_dir(&self) -> &std::path::Path {
        &self.runtime_dir
    }

    /// The root daemon's log (for failure messages).
    pub fn daemon_log(&self) -> String {
        std::fs::read_to_string(self.runtime_dir.join("dataplane.log")).unwrap_or_default()
    }

    /// The lab manager's metric `kvpn_manager_<name>` (a name may carry
    /// labels, e.g. `packets_dropped_total{reason="gso"}`), read with
    /// `GET /metrics` on `127.0.0.1:port` in the manager pod's netns (the
    /// manager runs with `--metrics-listen 127.0.0.1:<port>`).
    pub fn manager_metric(&self, port: u16, name: &str) -> u64 {
        let text = self
            .lab
            .run_in(kvpn_lab::MANAGER_POD, || http_get_metrics(port))
            .unwrap_or_else(|e| panic!("manager pod netns: {e:#}"));
        let full = format!("kvpn_manager_{name}");
        prometheus_samples(&text)
            .find_map(|(n, v)| (n == full).then_some(v))
            .unwrap_or_else(|| panic!("{full} missing in the manager's metrics:\n{text}"))
    }

    /// The manager pod's log (for failure messages).
    pub fn manager_log(&self) -> String {
        self.lab
            .processes()
            .iter()
            .find(|p| p.name.contains("manager"))
            .and_then(|p| std::fs::read_to_string(&p.log).ok())
            .unwrap_or_default()
    }
}

impl Default for Fixture {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        // Stop the root daemon (it tears its sessions down on SIGTERM), then the lab.
        let _ = self.kvpn(&["quit"]);
        std::thread::sleep(Duration::from_millis(50));
        if let Err(e) = self.lab.down() {
            eprintln!("lab down: {e:#}");
        }
    }
}

/// `GET /metrics` on `127.0.0.1:port` of the calling thread's netns; the
/// whole HTTP answer, which must be `200`.
pub fn http_get_metrics(port: u16) -> String {
    use std::io::{Read as _, Write as _};
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("metrics {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap_or_else(|e| panic!("metrics read timeout: {e}"));
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: kvpn-manager\r\nConnection: close\r\n\r\n")
        .unwrap_or_else(|e| panic!("metrics request to {addr}: {e}"));
    let mut text = String::new();
    s.read_to_string(&mut text)
        .unwrap_or_else(|e| panic!("metrics response from {addr}: {e}"));
    assert!(text.starts_with("HTTP/1.1 200"), "metrics answer: {text}");
    text
}

/// The samples of a Prometheus text exposition (after the HTTP head, if
/// any), as (`name{labels}`, value); comments and non-integer values skipped.
pub fn prometheus_samples(text: &str) -> impl Iterator<Item = (&str, u64)> {
    let body = text.split_once("\r\n\r\n").map_or(text, |(_, b)| b);
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.rsplit_once(' '))
        .filter_map(|(name, value)| Some((name, value.trim().parse().ok()?)))
}

/// Runs `script` with bash in the laptop netns of `lab`, in its own process
/// group (killed on drop), stdout and stderr piped.
pub fn spawn_in_laptop(lab: &Lab, script: &str) -> Spawned {
    use std::os::unix::process::CommandExt as _;
    let mut cmd = lab
        .command_in(LAPTOP, "bash")
        .unwrap_or_else(|e| panic!("laptop netns: {e:#}"));
    cmd.args(["-c", script])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .process_group(0);
    Spawned(Some(cmd.spawn().expect("spawn bash")))
}

/// A command of the test running in its own process group, killed (the whole
/// group) on drop unless waited for.
pub struct Spawned(pub Option<std::process::Child>);

impl Drop for Spawned {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            // The group: bash and the curl it started.
            let pgid = child.id() as i32;
            // SAFETY: kill(2) with a process group id we created; no memory involved.
            unsafe {
                libc::kill(-pgid, libc::SIGKILL);
            }
            let _ = child.wait();
        }
    }
}

/// The lab's manager process stopped (SIGSTOP) until drop (SIGCONT), also
/// when the test fails.
pub struct Paused(i32);

impl Paused {
    pub fn manager(f: &Fixture) -> Self {
        let p = f
            .lab
            .processes()
            .into_iter()
            .find(|p| p.name.contains("manager") && p.alive)
            .expect("the lab's manager process");
        let comm = std::fs::read_to_string(format!("/proc/{}/comm", p.pid)).unwrap_or_default();
        assert!(comm.starts_with("kvpn-manager"), "{p:?}: {comm}");
        let pid = p.pid as i32;
        // SAFETY: kill(2) on the lab's own manager process; no memory involved.
        unsafe {
            libc::kill(pid, libc::SIGSTOP);
        }
        Paused(pid)
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        // SAFETY: as above.
        unsafe {
            libc::kill(self.0, libc::SIGCONT);
        }
    }
}

/// Lossy UTF-8 of command output.
pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs `cmd` and returns its output.
pub fn output(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| panic!("run {cmd:?}: {e}"))
}

/// A user daemon (`kvpn daemon`) a test started in the fixture's laptop netns,
/// logging to `user-test.log` in the runtime folder: continued (SIGCONT) and
/// killed on drop, also when the test fails, so no stopped process is left.
pub struct UserDaemon {
    child: std::process::Child,
}

impl UserDaemon {
    /// Starts it and waits (10 s at most) until its socket exists.
    pub fn start(f: &Fixture) -> Self {
        let kvpn = kvpn_lab::bin_path("kvpn").unwrap_or_else(|e| panic!("kvpn binary: {e:#}"));
        std::fs::create_dir_all(f.runtime_dir()).expect("runtime dir");
        let log = std::fs::File::create(f.runtime_dir().join("user-test.log")).expect("log file");
        let mut cmd = f
            .lab
            .command_in(LAPTOP, &kvpn.to_string_lossy())
            .unwrap_or_else(|e| panic!("laptop netns: {e:#}"));
        cmd.arg("--runtime-dir")
            .arg(f.runtime_dir())
            .arg("daemon")
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        let d = UserDaemon {
            child: cmd.spawn().expect("start kvpn daemon"),
        };
        // As root, the user daemon's socket is in the root runtime folder.
        let socket = f.runtime_dir().join("user.sock");
        let t0 = std::time::Instant::now();
        while !socket.exists() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "no user daemon socket {}",
                socket.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        d
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `sig` to it.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on the pid of a child this process spawned and has not
        // reaped; no memory involved.
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
    }
}

impl Drop for UserDaemon {
    fn drop(&mut self) {
        self.signal(libc::SIGCONT);
        self.signal(libc::SIGKILL);
        let _ = self.child.wait();
    }
}
