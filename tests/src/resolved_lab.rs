//! A real systemd-resolved for the laptop netns (case dns-04), without systemd as
//! PID 1 and without touching this machine's DNS: [`ResolvedLaptop`] holds a
//! private mount namespace (a `sleep` started with `unshare --mount
//! --propagation private` inside the laptop netns) in which, from the lab folder,
//! - `/run/dbus` is bound to an empty folder, where this laptop's own system bus
//!   (`dbus-daemon --system`, the distribution's bus policy) listens;
//! - `/run/systemd` is bound to an empty folder, where systemd-resolved keeps its
//!   state and the varlink socket that nss-resolve uses;
//! - `/etc/systemd/resolved.conf` names the laptop's own resolver (the dnsmasq of
//!   [`crate::dns_lab::Upstream`] on 127.0.0.1) and its search domain;
//! - `/etc/resolv.conf` names only the stub 127.0.0.53, as on a resolved host;
//! - `/etc/nsswitch.conf` resolves hosts with `files resolve`.
//!
//! `/lib/systemd/systemd-resolved` runs there directly (no systemctl). Commands
//! ([`ResolvedLaptop::command`]) enter that mount namespace and the laptop netns
//! with `nsenter`, so `kvpn` and the daemons it starts (the root daemon runs
//! `resolvectl`) see the same bus and files.
//!
//! Drop stops resolved, the bus and the holder by pid; the bind mounts exist only
//! in that namespace and go with its last process (kvpn's daemons, which the
//! fixture's drop quits). scripts/setup.sh installs systemd-resolved,
//! libnss-resolve and dbus without enabling them or changing /etc.
//!
//! I/O: processes in the laptop netns and the private mount namespace, files in
//! the lab folder.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use kvpn_lab::LAPTOP;

use crate::dns_lab::first_address;
use crate::kube_lab::{KubeFixture, kvpn_succeeded};
use crate::text;

/// The private `/etc/resolv.conf`: resolved's stub only.
pub const STUB_RESOLV: &[u8] = b"# kvpn dns-04 lab: systemd-resolved manages DNS\nnameserver 127.0.0.53\noptions edns0 trust-ad\nsearch .\n";
/// The laptop's resolved.conf: its own resolver, no multicast name protocols
/// (they would only add noise in a lab netns).
pub const RESOLVED_CONF: &[u8] = b"[Resolve]\nDNS=127.0.0.1\nDomains=corp.test\nLLMNR=no\nMulticastDNS=no\nDNSSEC=no\nDNSOverTLS=opportunistic\nDNSStubListener=yes\n";

/// systemd-resolved and a system bus for the laptop netns, in a private mount
/// namespace.
pub struct ResolvedLaptop<'a> {
    f: &'a KubeFixture,
    holder: u32,
    dbus: Option<u32>,
    resolved: Option<u32>,
    dir: PathBuf,
}

impl<'a> ResolvedLaptop<'a> {
    /// Sets up the mount namespace and starts the bus and resolved; returns once
    /// `resolvectl` reaches resolved. Start the laptop's upstream resolver first.
    pub fn start(f: &'a KubeFixture) -> ResolvedLaptop<'a> {
        let lab = f.lab().netns_lab();
        let dir = lab.dir().join("resolved");
        for sub in ["run-dbus", "run-systemd"] {
            std::fs::create_dir_all(dir.join(sub))
                .unwrap_or_else(|e| panic!("create {}: {e}", dir.join(sub).display()));
        }
        let nsswitch = std::fs::read_to_string("/etc/nsswitch.conf")
            .unwrap_or_else(|e| panic!("read /etc/nsswitch.conf: {e}"));
        let files: [(&str, Vec<u8>); 3] = [
            ("resolv.conf", STUB_RESOLV.to_vec()),
            ("resolved.conf", RESOLVED_CONF.to_vec()),
            ("nsswitch.conf", private_nsswitch(&nsswitch).into_bytes()),
        ];
        for (name, bytes) in &files {
            let path = dir.join(name);
            std::fs::write(&path, bytes)
                .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        }

        let mut hold = Command::new("unshare");
        hold.args(["--mount", "--propagation", "private", "sleep", "infinity"]);
        let holder = lab
            .spawn_in(LAPTOP, "resolved-mount-ns", &hold)
            .unwrap_or_else(|e| panic!("private mount namespace: {e:#}"));
        let mut r = ResolvedLaptop {
            f,
            holder,
            dbus: None,
            resolved: None,
            dir,
        };
        // `ip netns exec` and `unshare` exec in place: the pid is sleep's once
        // the namespace is set up.
        r.wait("the mount namespace holder", Duration::from_secs(5), |_| {
            std::fs::read_to_string(format!("/proc/{holder}/comm"))
                .is_ok_and(|c| c.trim() == "sleep")
        });
        let binds = [
            ("run-dbus", "/run/dbus"),
            ("run-systemd", "/run/systemd"),
            ("resolv.conf", "/etc/resolv.conf"),
            ("resolved.conf", "/etc/systemd/resolved.conf"),
            ("nsswitch.conf", "/etc/nsswitch.conf"),
        ];
        for (from, to) in binds {
            let from = r.dir.join(from);
            let out = r.run(&["mount", "--bind", &from.to_string_lossy(), to]);
            assert!(
                out.status.success(),
                "bind {} over {to} in the private mount namespace: {}",
                from.display(),
                text(&out.stderr)
            );
        }

        let socket = r.dir.join("run-dbus/system_bus_socket");
        r.dbus = Some(r.spawn(
            "laptop-dbus",
            &["dbus-daemon", "--system", "--nofork", "--nopidfile"],
        ));
        r.wait("the laptop's system bus", Duration::from_secs(10), |_| {
            socket.exists()
        });
        r.resolved = Some(r.spawn("laptop-resolved", &["/lib/systemd/systemd-resolved"]));
        r.wait(
            "systemd-resolved on the laptop's bus",
            Duration::from_secs(10),
            |r| r.run(&["resolvectl", "status"]).status.success(),
        );
        r
    }

    /// A command that runs `program` in the laptop netns and the private mount
    /// namespace.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg("-t")
            .arg(self.holder.to_string())
            .args(["-m", "-n", "--"])
            .arg(program);
        cmd
    }

    /// Runs `args` there to completion; its output whatever the exit status.
    pub fn run(&self, args: &[&str]) -> Output {
        let mut cmd = self.command(args[0]);
        cmd.args(&args[1..]).stdin(Stdio::null());
        cmd.output()
            .unwrap_or_else(|e| panic!("nsenter {args:?}: {e}"))
    }

    /// `resolvectl <args>`, which must succeed; its stdout.
    pub fn resolvectl(&self, args: &[&str]) -> String {
        let mut all = vec!["resolvectl"];
        all.extend_from_slice(args);
        let out = self.run(&all);
        assert!(
            out.status.success(),
            "resolvectl {args:?}: {}{}\n{}",
            text(&out.stdout),
            text(&out.stderr),
            self.log()
        );
        text(&out.stdout)
    }

    /// `getent hosts <name>` (nss-resolve): the first address, if it resolved.
    pub fn getent(&self, name: &str) -> Option<String> {
        first_address(&self.run(&["getent", "hosts", name]))
    }

    /// `kvpn <args>` there, with the fixture's runtime and state folders; the
    /// root daemon it starts reads this namespace's /etc/resolv.conf.
    pub fn kvpn(&self, args: &[&str]) -> Output {
        let kvpn = kvpn_lab::bin_path("kvpn").unwrap_or_else(|e| panic!("kvpn binary: {e:#}"));
        let mut cmd = self.command(kvpn);
        cmd.args(args)
            .env("KVPN_RUNTIME_DIR", self.f.runtime_dir())
            .env("KVPN_HOSTS", self.f.laptop_hosts())
            .env("XDG_STATE_HOME", self.f.state_dir())
            .env_remove("KVPN_RESOLV_CONF")
            .env_remove("KVPN_DNS_MODE")
            .env_remove("KUBECONFIG")
            .stdin(Stdio::null());
        cmd.output()
            .unwrap_or_else(|e| panic!("run kvpn {args:?}: {e}"))
    }

    /// `kvpn <args>`, which must succeed; its stdout.
    pub fn kvpn_ok(&self, args: &[&str]) -> String {
        kvpn_succeeded(args, &self.kvpn(args), || {
            format!("{}\n{}", self.f.diagnostics(), self.log())
        })
    }

    /// systemd-resolved's and the bus's logs.
    pub fn log(&self) -> String {
        let lab = self.f.lab().netns_lab().dir();
        ["laptop-resolved", "laptop-dbus"]
            .iter()
            .map(|n| {
                let log = std::fs::read_to_string(lab.join(format!("{n}.log"))).unwrap_or_default();
                format!("--- {n}.log (last lines)\n{}", tail(&log, 30))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The folder with this laptop's resolved files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn spawn(&self, name: &str, args: &[&str]) -> u32 {
        // The lab wraps it in `ip netns exec <laptop>`; nsenter then enters the
        // private mount namespace and execs the program (same pid).
        let mut cmd = Command::new("nsenter");
        cmd.arg("-t")
            .arg(self.holder.to_string())
            .args(["-m", "--"])
            .args(args);
        self.f
            .lab()
            .netns_lab()
            .spawn_in(LAPTOP, name, &cmd)
            .unwrap_or_else(|e| panic!("start {args:?}: {e:#}"))
    }

    fn wait(&self, what: &str, within: Duration, ready: impl Fn(&Self) -> bool) {
        let t0 = Instant::now();
        while !ready(self) {
            assert!(
                t0.elapsed() < within,
                "{what} not ready within {within:?}\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for ResolvedLaptop<'_> {
    fn drop(&mut self) {
        let lab = self.f.lab().netns_lab();
        for pid in [self.resolved.take(), self.dbus.take(), Some(self.holder)]
            .into_iter()
            .flatten()
        {
            if let Err(e) = lab.stop_process(pid, Duration::from_secs(2)) {
                eprintln!("stop {pid}: {e:#}");
            }
        }
    }
}

/// `nsswitch` with its hosts line replaced by `files resolve` (nss-resolve
/// only, no fallback to plain DNS), everything else kept.
pub fn private_nsswitch(nsswitch: &str) -> String {
    let mut out = String::new();
    let mut replaced = false;
    for line in nsswitch.lines() {
        if line.starts_with("hosts:") {
            out.push_str("hosts:          files resolve\n");
            replaced = true;
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    if !replaced {
        out.push_str("hosts:          files resolve\n");
    }
    out
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
