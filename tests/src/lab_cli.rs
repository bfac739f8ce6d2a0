//! A persistent lab brought up through the CLI (`kvpn lab up`), as a user does: its
//! state goes to a folder of the test's own (`KVPN_LAB_STATE_DIR`), so it cannot
//! meet another test's lab of the same name; kvpn gets no runtime folder or
//! kubeconfig of the caller's. Drop: `kvpn lab down` for every lab name used (again:
//! a failed test must not leave a lab up), then the folder.

use std::path::PathBuf;
use std::process::{Command, Output};

use crate::text;

pub struct LabRun {
    pub dir: PathBuf,
    pub kvpn: PathBuf,
    /// Seconds each `kvpn` call may take.
    timeout_s: u32,
    /// Lab names to bring down on drop (the default one always).
    names: std::cell::RefCell<Vec<String>>,
}

impl LabRun {
    /// A fresh folder `<tmp>/kvpn-<tag>-<pid>`; each `kvpn` call bounded at `timeout_s`.
    pub fn new(tag: &str, timeout_s: u32) -> Self {
        let dir = std::env::temp_dir().join(format!("kvpn-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["lab-state", "xdg-state", "kvpn-state"] {
            std::fs::create_dir_all(dir.join(sub))
                .unwrap_or_else(|e| panic!("create {}: {e}", dir.join(sub).display()));
        }
        let kvpn = kvpn_lab::bin_path("kvpn").unwrap_or_else(|e| panic!("kvpn binary: {e:#}"));
        LabRun {
            dir,
            kvpn,
            timeout_s,
            names: std::cell::RefCell::new(vec![kvpn_lab::DEFAULT_LAB_NAME.to_owned()]),
        }
    }

    /// Also bring the lab `name` down on drop.
    pub fn track(&self, name: &str) {
        let mut names = self.names.borrow_mut();
        if !names.iter().any(|n| n == name) {
            names.push(name.to_owned());
        }
    }

    /// `kvpn <args>` with the test's lab state folder.
    pub fn kvpn(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new("timeout");
        cmd.arg(self.timeout_s.to_string())
            .arg(&self.kvpn)
            .args(args)
            .env("KVPN_LAB_STATE_DIR", self.dir.join("lab-state"))
            .env("XDG_STATE_HOME", self.dir.join("xdg-state"))
            .env("KVPN_STATE_DIR", self.dir.join("kvpn-state"))
            .env_remove("KVPN_RUNTIME_DIR")
            .env_remove("KUBECONFIG")
            .env_remove("KVPN_RESOLV_CONF")
            .env_remove("KVPN_HOSTS");
        cmd.output().unwrap_or_else(|e| panic!("run {cmd:?}: {e}"))
    }

    /// [`Self::kvpn`], which must succeed; its stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.kvpn(args);
        assert!(
            out.status.success(),
            "kvpn {args:?} failed ({}):\n{}\n{}",
            out.status,
            text(&out.stdout),
            text(&out.stderr)
        );
        text(&out.stdout)
    }

    /// The lab state folder.
    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("lab-state")
    }

    /// The runtime folder `kvpn lab exec [--name NAME] laptop` gives kvpn.
    pub fn laptop_runtime(&self, name: &str) -> PathBuf {
        self.state_dir().join(format!("{name}-laptop-runtime"))
    }
}

impl Drop for LabRun {
    fn drop(&mut self) {
        for name in self.names.borrow().iter() {
            let down = self.kvpn(&["lab", "down", "--name", name]);
            if !down.status.success() {
                eprintln!(
                    "kvpn lab down --name {name}: {}{}",
                    text(&down.stdout),
                    text(&down.stderr)
                );
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
