//! Shared helpers of the dataplane's privileged tests: a uniquely named network
//! namespace removed on drop, running code inside it, and a test double of the
//! traffic manager.

#![allow(dead_code, reason = "each test binary uses a different subset")]

pub mod fake_manager;

use std::fs::File;
use std::process::{Command, Output};

/// A network namespace `kvpn-t<hex>` created for one test, deleted on drop.
pub struct TestNetns {
    ns: Ns,
}

/// A handle on a namespace for running things in it (cheap to clone into tasks).
#[derive(Debug, Clone)]
pub struct Ns {
    pub name: String,
}

impl std::ops::Deref for TestNetns {
    type Target = Ns;
    fn deref(&self) -> &Ns {
        &self.ns
    }
}

fn unique_hex() -> String {
    use std::hash::{BuildHasher as _, Hasher as _};
    let mut h = std::hash::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock after 1970")
            .as_nanos(),
    );
    format!("{:08x}", h.finish() as u32)
}

impl TestNetns {
    /// Create the namespace with loopback up.
    pub fn new() -> Self {
        let name = format!("kvpn-t{}", unique_hex());
        run(Command::new("ip").args(["netns", "add", &name]));
        let ns = Self { ns: Ns { name } };
        run(Command::new("ip").args(["-n", &ns.name, "link", "set", "lo", "up"]));
        ns
    }

    /// A handle to move into tasks.
    pub fn handle(&self) -> Ns {
        self.ns.clone()
    }
}

impl Ns {
    /// `ip netns exec <ns> <args>` without blocking the runtime.
    pub async fn exec_async(&self, args: &[&str]) -> Output {
        tokio::process::Command::new("ip")
            .args(["netns", "exec", &self.name])
            .args(args)
            .output()
            .await
            .unwrap_or_else(|e| panic!("cannot run {args:?} in {}: {e}", self.name))
    }

    /// `ip netns exec <ns> <args>`, output captured.
    pub fn exec(&self, args: &[&str]) -> Output {
        Command::new("ip")
            .args(["netns", "exec", &self.name])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {args:?} in {}: {e}", self.name))
    }

    /// Like [`exec`](Self::exec) and require success; returns stdout.
    pub fn exec_ok(&self, args: &[&str]) -> String {
        let out = self.exec(args);
        assert!(
            out.status.success(),
            "{args:?} in {} failed: {}",
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Run `f` on a new thread that entered this namespace first, so that every
    /// socket, TUN device and runtime thread it creates lives in the namespace.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{}", self.name);
        std::thread::spawn(move || {
            let ns = File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
            nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET)
                .unwrap_or_else(|e| panic!("setns {path}: {e}"));
            f()
        })
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    }

    /// Run an async test body on a tokio runtime whose threads all live in this
    /// namespace.
    pub fn block_on<T: Send + 'static, F: std::future::Future<Output = T> + Send + 'static>(
        &self,
        make: impl FnOnce() -> F + Send + 'static,
    ) -> T {
        self.run(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("tokio runtime");
            rt.block_on(make())
        })
    }

    /// Routes of the main table through `dev`, from `ip -j route show`.
    pub fn routes_via(&self, dev: &str) -> Vec<serde_json::Value> {
        let out = self.exec(&["ip", "-j", "route", "show", "table", "main", "dev", dev]);
        if !out.status.success() {
            return Vec::new();
        }
        serde_json::from_slice(&out.stdout).expect("ip -j route prints JSON")
    }

    /// Names of links whose name starts with `kvpn`.
    pub fn kvpn_links(&self) -> Vec<String> {
        let out = self.exec_ok(&["ip", "-j", "link", "show"]);
        let links: Vec<serde_json::Value> =
            serde_json::from_str(&out).expect("ip -j link prints JSON");
        links
            .iter()
            .filter_map(|l| l["ifname"].as_str())
            .filter(|n| n.starts_with("kvpn"))
            .map(str::to_owned)
            .collect()
    }

    /// Routes tagged with kvpn's route protocol (107), any table.
    pub fn kvpn_routes(&self) -> String {
        let v4 = self.exec_ok(&["ip", "route", "show", "table", "all", "proto", "107"]);
        let v6 = self.exec_ok(&["ip", "-6", "route", "show", "table", "all", "proto", "107"]);
        format!("{v4}{v6}")
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.ns.name])
            .status();
    }
}

fn run(cmd: &mut Command) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// These tests need root (network namespaces, TUN devices); CI runs them as root.
pub fn require_root() {
    assert!(
        nix::unistd::Uid::effective().is_root(),
        "this test needs root (network namespaces, TUN devices): run it as root, as CI does"
    );
}
