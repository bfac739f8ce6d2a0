//! A private containerd for tests that run the project's images under a real
//! runtime (containerd 1.6 + runc from Debian), and the project's image archives.
//!
//! containerd writes some paths whatever its flags (/run/containerd/{s,fifo,runc},
//! /opt/containerd; shared/TOOLCHAIN.md): it runs in a private mount namespace
//! (`unshare --mount`) with a folder of the test bound over /run and /opt, so
//! nothing lands on the machine's own paths and parallel tests do not meet. Its root
//! and state are in the same folder, its containers in a containerd namespace named
//! `kvpn-<unique>` (so their cgroups are `/<namespace>/<id>`). Drop kills every task,
//! removes every container, stops containerd by pid, removes the namespace's own
//! cgroup in every hierarchy (runc removes only `/<namespace>/<id>`: the parents
//! were left in all v1 controllers and the unified tree, 243 of them in a day) and
//! removes the folder.
//!
//! Network namespaces are passed as `/proc/<pid>/ns/net` of a process in them (the
//! test's own shell `exec`ing `ctr`), which resolves the same in every mount
//! namespace.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// The project's OCI image archives: `$KVPN_IMAGE_DIR`, else
/// `$KVPN_CACHE/images` (where `cargo xtask image` writes them; `./x test` builds
/// them first).
pub fn image_dir() -> PathBuf {
    kvpn_lab::k8s::node::images::project_image_dir()
}

/// The archive of image `key` (`manager`, `lab-server`, `pause`) at this version;
/// panics with the fix when it was not built.
pub fn image_archive(key: &str) -> PathBuf {
    let path = image_dir().join(format!("kvpn-{key}-{}.oci.tar", env!("CARGO_PKG_VERSION")));
    assert!(
        path.is_file(),
        "{} is missing: build the images with `./x image` (or `cargo xtask image`); `./x test` does it first",
        path.display()
    );
    path
}

/// The image name inside the project's archives.
pub fn image_name(key: &str) -> String {
    kvpn_lab::k8s::node::images::project_image(key)
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A private containerd (see the module docs).
pub struct Containerd {
    dir: PathBuf,
    sock: PathBuf,
    namespace: String,
    child: Option<Child>,
}

impl Containerd {
    /// Starts containerd and waits until it answers (bounded: 15 s).
    pub fn start() -> Self {
        let unique = format!(
            "{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let dir = std::env::temp_dir().join(format!("kvpn-ctrd-{unique}"));
        for sub in ["root", "state", "run", "opt"] {
            std::fs::create_dir_all(dir.join(sub))
                .unwrap_or_else(|e| panic!("create {}: {e}", dir.join(sub).display()));
        }
        let sock = dir.join("containerd.sock");
        let config = format!(
            "version = 2\nroot = \"{root}\"\nstate = \"{state}\"\n\
             disabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n\
             [grpc]\n  address = \"{sock}\"\n",
            root = dir.join("root").display(),
            state = dir.join("state").display(),
            sock = sock.display(),
        );
        std::fs::write(dir.join("config.toml"), config).expect("containerd config");
        let log = std::fs::File::create(dir.join("containerd.log")).expect("containerd log");
        let child = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
            .arg(
                "set -e; mount --bind \"$1/run\" /run; mount --bind \"$1/opt\" /opt; \
                 exec containerd --config \"$1/config.toml\"",
            )
            .arg("sh")
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start containerd (apt package containerd): {e}"));
        let mut c = Containerd {
            dir,
            sock,
            namespace: format!("kvpn-{unique}"),
            child: Some(child),
        };
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if c.sock.exists() && c.ctr(&["version"]).status.success() {
                break;
            }
            if let Some(child) = c.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!("containerd exited ({status}):\n{}", c.log());
            }
            assert!(
                Instant::now() < deadline,
                "containerd did not answer within 15 s:\n{}",
                c.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        c
    }

    /// The argv prefix that runs `ctr` in containerd's mount namespace: ctr makes
    /// the task's stdio fifos under /run/containerd/fifo itself, where containerd
    /// must find them.
    pub fn ctr_prefix(&self) -> Vec<String> {
        let pid = self.child.as_ref().map_or(0, Child::id);
        vec![
            "nsenter".into(),
            format!("--mount=/proc/{pid}/ns/mnt"),
            "ctr".into(),
            "-a".into(),
            self.sock.display().to_string(),
            "-n".into(),
            self.namespace.clone(),
        ]
    }

    /// `ctr -a <sock> -n <namespace> <args>` in containerd's mount namespace (not run).
    pub fn ctr_command(&self, args: &[&str]) -> Command {
        let prefix = self.ctr_prefix();
        let mut cmd = Command::new(&prefix[0]);
        cmd.args(&prefix[1..]).args(args);
        cmd
    }

    /// Runs `ctr … args` to completion.
    pub fn ctr(&self, args: &[&str]) -> Output {
        self.ctr_command(args)
            .output()
            .unwrap_or_else(|e| panic!("run ctr {args:?}: {e}"))
    }

    /// `ctr images import` of an OCI archive; panics with ctr's words on failure.
    pub fn import(&self, archive: &Path) {
        let out = self.ctr(&["images", "import", &archive.to_string_lossy()]);
        assert!(
            out.status.success(),
            "ctr images import {}: {}",
            archive.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The containerd namespace (`ctr -n`).
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// containerd's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default()
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let listed = self.ctr(&["containers", "list", "-q"]);
        for id in String::from_utf8_lossy(&listed.stdout).split_whitespace() {
            let _ = self.ctr(&["tasks", "kill", "-s", "SIGKILL", id]);
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if self.ctr(&["tasks", "delete", "-f", id]).status.success() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = self.ctr(&["containers", "delete", id]);
        }
        let images = self.ctr(&["images", "list", "-q"]);
        for name in String::from_utf8_lossy(&images.stdout).split_whitespace() {
            let _ = self.ctr(&["images", "remove", name]);
        }
        if let Some(mut child) = self.child.take() {
            // SAFETY: kill(2) on the containerd this value started, by pid.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            // The failure's report gets the log's end; nothing stays in /tmp.
            let log = std::fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            eprintln!(
                "--- containerd log (last 40 lines):\n{}",
                lines[lines.len().saturating_sub(40)..].join("\n")
            );
        }
        for left in remove_cgroups_named(&self.namespace) {
            eprintln!("containerd fixture: cgroup left behind: {left}");
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Removes the cgroup `/<name>` (with what is below it, deepest first) in every
/// hierarchy; what could not be removed. Only empty cgroups can go: processes are
/// the fixture's to stop before.
pub fn remove_cgroups_named(name: &str) -> Vec<String> {
    let mut left = Vec::new();
    for root in kvpn_lab::k8s::node::host::cgroup_leftovers(name) {
        let mut dirs = vec![root.clone()];
        let mut i = 0;
        while i < dirs.len() {
            if let Ok(entries) = std::fs::read_dir(&dirs[i]) {
                dirs.extend(
                    entries
                        .flatten()
                        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                        .map(|e| e.path()),
                );
            }
            i += 1;
        }
        for d in dirs.iter().rev() {
            let deadline = Instant::now() + Duration::from_secs(2);
            loop {
                match std::fs::remove_dir(d) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    Err(_) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    Err(e) => {
                        left.push(format!("{}: {e}", d.display()));
                        break;
                    }
                }
            }
        }
    }
    left
}
