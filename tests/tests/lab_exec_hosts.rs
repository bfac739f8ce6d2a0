//! End-to-end, the lab workflow of docs/lab.md: `kvpn lab up`, then
//! `kvpn lab exec laptop -- kvpn connect --hosts`. Tester finding: the lab gave the
//! laptop netns only its own resolv.conf, so the root daemon started from there
//! wrote kvpn's hosts-file block into this machine's /etc/hosts. Now `kvpn lab up`
//! writes `/etc/netns/<laptop netns>/hosts` (a copy of /etc/hosts, bound over
//! /etc/hosts by `ip netns exec`), `kvpn lab exec laptop` sets `KVPN_HOSTS` to it,
//! and `kvpn lab down` removes it.
//!
//! This machine's /etc/hosts is never at risk, also with a kvpn that has the bug:
//! every kvpn command that talks to the daemons runs in a mount namespace of its
//! own (`unshare -m`) where a throwaway file is bound over /etc/hosts; the daemons
//! started from there stay in it. The throwaway file stands for /etc/hosts: it
//! must come out of the connect byte for byte and inode for inode as it went in.
//! The lab's persistent state goes to a folder of this test
//! (`KVPN_LAB_STATE_DIR`), so `kvpn lab up` cannot meet another lab of that name.

use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use kvpn_tests::text;

/// Begin marker of kvpn's hosts-file block (dataplane/src/dns/hosts.rs).
const BLOCK: &str = "# >>> kvpn";

/// Stands for this machine's /etc/hosts in the test's mount namespaces.
const THROWAWAY_HOSTS: &str =
    "127.0.0.1\tlocalhost\n::1\tlocalhost\n# lab_exec_hosts: throwaway /etc/hosts\n";

/// A persistent lab of this test's own (`kvpn lab up` with `KVPN_LAB_STATE_DIR`
/// in this test's folder), and kvpn's runtime and state folders beside it. Drop:
/// `kvpn quit` in the laptop, `kvpn lab down`, the folder.
struct LabRun {
    dir: PathBuf,
    kvpn: PathBuf,
}

impl LabRun {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("kvpn-labexec-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["lab-state", "runtime", "xdg-state", "kvpn-state"] {
            std::fs::create_dir_all(dir.join(sub))
                .unwrap_or_else(|e| panic!("create {}: {e}", dir.join(sub).display()));
        }
        std::fs::write(dir.join("throwaway-hosts"), THROWAWAY_HOSTS)
            .unwrap_or_else(|e| panic!("write the throwaway hosts file: {e}"));
        let kvpn = kvpn_lab::bin_path("kvpn").unwrap_or_else(|e| panic!("kvpn binary: {e:#}"));
        LabRun { dir, kvpn }
    }

    fn throwaway_hosts(&self) -> PathBuf {
        self.dir.join("throwaway-hosts")
    }

    /// `kvpn <args>` on this machine, with the test's lab state folder (and no
    /// inherited KVPN_HOSTS or KUBECONFIG), bounded at 180 s.
    fn kvpn(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("timeout");
        cmd.arg("180").arg(&self.kvpn).args(args);
        self.env(&mut cmd);
        cmd
    }

    /// [`LabRun::kvpn`] in a mount namespace of its own where /etc/hosts is the
    /// throwaway file: for everything that may start a daemon or make one write.
    fn sandboxed(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("unshare");
        cmd.args(["-m", "--propagation", "private", "sh", "-c"])
            .arg(r#"mount --bind "$0" /etc/hosts && exec "$@""#)
            .arg(self.throwaway_hosts())
            .arg("timeout")
            .arg("180")
            .arg(&self.kvpn)
            .args(args);
        self.env(&mut cmd);
        cmd
    }

    fn env(&self, cmd: &mut Command) {
        cmd.env("KVPN_LAB_STATE_DIR", self.dir.join("lab-state"))
            .env("KVPN_RUNTIME_DIR", self.dir.join("runtime"))
            .env("XDG_STATE_HOME", self.dir.join("xdg-state"))
            .env("KVPN_STATE_DIR", self.dir.join("kvpn-state"))
            .env_remove("KUBECONFIG")
            .env_remove("KVPN_RESOLV_CONF")
            // An inherited KVPN_HOSTS naming /etc/hosts must not win: `kvpn lab exec
            // laptop` sets its own.
            .env("KVPN_HOSTS", "/etc/hosts");
    }

    fn logs(&self) -> String {
        kvpn_tests::kube_lab::diagnostics_of(&self.dir.join("runtime"))
    }
}

impl Drop for LabRun {
    fn drop(&mut self) {
        let kvpn = self.kvpn.to_string_lossy().into_owned();
        let quit = run(&mut self.sandboxed(&["lab", "exec", "laptop", "--", &kvpn, "quit"]));
        if !quit.status.success() {
            eprintln!("kvpn quit: {}{}", text(&quit.stdout), text(&quit.stderr));
        }
        let down = run(&mut self.kvpn(&["lab", "down"]));
        if !down.status.success() {
            eprintln!(
                "kvpn lab down: {}{}",
                text(&down.stdout),
                text(&down.stderr)
            );
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| panic!("run {cmd:?}: {e}"))
}

fn ok(what: &str, out: &Output, logs: impl FnOnce() -> String) -> String {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr),
        logs()
    );
    text(&out.stdout)
}

/// Bytes and (device, inode) of a file.
fn snapshot(path: &Path) -> (Vec<u8>, (u64, u64)) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let meta = std::fs::metadata(path).unwrap_or_else(|e| panic!("stat {}: {e}", path.display()));
    (bytes, (meta.dev(), meta.ino()))
}

#[test]
fn lab_exec_connect_hosts_writes_the_laptop_netns_hosts_file_not_the_machines() {
    let real_before = snapshot(Path::new("/etc/hosts"));
    let lab = LabRun::new();
    let kvpn = lab.kvpn.to_string_lossy().into_owned();
    let t0 = Instant::now();
    ok(
        "kvpn lab up",
        &run(&mut lab.kvpn(&["lab", "up"])),
        String::new,
    );
    eprintln!("kvpn lab up took {:.1} s", t0.elapsed().as_secs_f64());

    let netns = ok(
        "kvpn lab exec laptop -- ip netns identify",
        &run(&mut lab.kvpn(&["lab", "exec", "laptop", "--", "ip", "netns", "identify"])),
        String::new,
    )
    .trim()
    .to_owned();
    assert!(
        netns.starts_with("kvpn-") && netns.ends_with("-laptop"),
        "{netns:?}"
    );
    let laptop_hosts = Path::new("/etc/netns").join(&netns).join("hosts");
    let throwaway_before = snapshot(&lab.throwaway_hosts());

    // docs/lab.md's workflow, with --hosts.
    let connect = run(&mut lab.sandboxed(&[
        "lab",
        "exec",
        "laptop",
        "--",
        &kvpn,
        "connect",
        "--namespace",
        "default",
        "--hosts",
    ]));
    ok(
        "kvpn lab exec laptop -- kvpn connect --hosts",
        &connect,
        || lab.logs(),
    );
    // kvpn's block shows up in one of the two files (route watch, ~1 s).
    let t0 = Instant::now();
    let has_block =
        |p: &Path| String::from_utf8_lossy(&std::fs::read(p).unwrap_or_default()).contains(BLOCK);
    while !has_block(&laptop_hosts) && !has_block(&lab.throwaway_hosts()) {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no kvpn hosts-file block within 20 s in {} or the throwaway /etc/hosts\n{}",
            laptop_hosts.display(),
            lab.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // What stands for this machine's /etc/hosts is untouched: bytes and inode.
    let throwaway_after = snapshot(&lab.throwaway_hosts());
    assert!(
        throwaway_after == throwaway_before,
        "`kvpn lab exec laptop -- kvpn connect --hosts` edited the /etc/hosts its mount \
         namespace shows (this machine's, without the test's sandbox): {:?} (inode {:?} -> {:?})",
        String::from_utf8_lossy(&throwaway_after.0),
        throwaway_before.1,
        throwaway_after.1
    );
    assert!(
        snapshot(Path::new("/etc/hosts")) == real_before,
        "this machine's /etc/hosts changed"
    );

    // Inside `kvpn lab exec laptop`, KVPN_HOSTS names the laptop's own file (also
    // with KVPN_HOSTS=/etc/hosts inherited), which `kvpn lab up` made from /etc/hosts.
    let env = ok(
        "kvpn lab exec laptop -- printenv KVPN_HOSTS",
        &run(&mut lab.kvpn(&["lab", "exec", "laptop", "--", "printenv", "KVPN_HOSTS"])),
        String::new,
    );
    assert_eq!(
        env.trim(),
        laptop_hosts.to_string_lossy(),
        "KVPN_HOSTS in lab exec"
    );
    // Without a runtime folder of the caller's (or with the default /run/kvpn),
    // kvpn in the laptop gets the lab's own: the default would reach a root
    // daemon of this machine's network namespace.
    let lab_runtime = lab
        .dir
        .join("lab-state")
        .join(format!("{}-laptop-runtime", kvpn_lab::DEFAULT_LAB_NAME));
    for inherited in [None, Some("/run/kvpn")] {
        let mut cmd = lab.kvpn(&[
            "lab",
            "exec",
            "laptop",
            "--",
            "printenv",
            "KVPN_RUNTIME_DIR",
        ]);
        match inherited {
            None => cmd.env_remove("KVPN_RUNTIME_DIR"),
            Some(dir) => cmd.env("KVPN_RUNTIME_DIR", dir),
        };
        let got = ok(
            "kvpn lab exec laptop -- printenv KVPN_RUNTIME_DIR",
            &run(&mut cmd),
            String::new,
        );
        assert_eq!(
            got.trim(),
            lab_runtime.to_string_lossy(),
            "KVPN_RUNTIME_DIR in lab exec with {inherited:?} inherited"
        );
    }
    // A folder the caller chose is kept.
    let got = ok(
        "kvpn lab exec laptop -- printenv KVPN_RUNTIME_DIR",
        &run(&mut lab.kvpn(&[
            "lab",
            "exec",
            "laptop",
            "--",
            "printenv",
            "KVPN_RUNTIME_DIR",
        ])),
        String::new,
    );
    assert_eq!(got.trim(), lab.dir.join("runtime").to_string_lossy());
    let with_block = String::from_utf8_lossy(
        &std::fs::read(&laptop_hosts)
            .unwrap_or_else(|e| panic!("read {}: {e}", laptop_hosts.display())),
    )
    .into_owned();
    assert!(
        with_block.as_bytes().starts_with(&real_before.0),
        "the laptop's hosts file starts as a copy of /etc/hosts: {with_block:?}"
    );
    assert!(
        with_block.contains(" web.default "),
        "Service entries of namespace default: {with_block:?}"
    );
    // Programs in the laptop netns see them as /etc/hosts.
    let getent = run(&mut lab.kvpn(&[
        "lab",
        "exec",
        "laptop",
        "--",
        "getent",
        "-s",
        "files",
        "hosts",
        "web.default",
    ]));
    assert!(
        getent.status.success() && text(&getent.stdout).contains("10.96.0.100"),
        "getent hosts web.default in the laptop: {}{}",
        text(&getent.stdout),
        text(&getent.stderr)
    );

    // Disconnect takes the block out of the laptop's file again.
    ok(
        "kvpn disconnect --all",
        &run(&mut lab.sandboxed(&["lab", "exec", "laptop", "--", &kvpn, "disconnect", "--all"])),
        || lab.logs(),
    );
    let after = std::fs::read(&laptop_hosts).unwrap_or_default();
    assert!(
        after == real_before.0,
        "laptop hosts file after disconnect: {:?}",
        String::from_utf8_lossy(&after)
    );
    assert!(snapshot(&lab.throwaway_hosts()) == throwaway_before);

    // `kvpn lab down` with a live session: the session is disconnected and
    // leaves no record (a later `kvpn status` lists nothing, not a `lost` one).
    ok(
        "kvpn lab exec laptop -- kvpn connect (again)",
        &run(&mut lab.sandboxed(&[
            "lab",
            "exec",
            "laptop",
            "--",
            &kvpn,
            "connect",
            "--namespace",
            "default",
        ])),
        || lab.logs(),
    );
    // `kvpn lab down` removes it with the netns's /etc/netns folder.
    ok(
        "kvpn lab down",
        &run(&mut lab.kvpn(&["lab", "down"])),
        String::new,
    );
    assert!(
        !laptop_hosts.exists() && !Path::new("/etc/netns").join(&netns).exists(),
        "{} left after kvpn lab down",
        laptop_hosts.display()
    );
    let status = run(&mut lab.sandboxed(&["status", "-o", "json"]));
    let said = format!("{}{}", text(&status.stdout), text(&status.stderr));
    let sessions = serde_json::from_str::<serde_json::Value>(&text(&status.stdout))
        .ok()
        .and_then(|d| d["sessions"].as_array().cloned())
        .unwrap_or_default();
    assert!(
        sessions.is_empty() && !said.contains("\"lost\""),
        "kvpn lab down left a session record: {said}"
    );
    assert!(snapshot(Path::new("/etc/hosts")) == real_before);
}
