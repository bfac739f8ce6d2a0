//! `kvpn lab up` → `kvpn lab exec laptop -- kubectl get pods -A` → `kvpn lab down` →
//! up → down from the command line, in a private lab state folder, and no residue.
//!
//! Needs root, the Kubernetes binaries (`scripts/build-kubernetes.sh`), and the lab's
//! binaries next to `kvpn` (`cargo build -p kvpn-lab -p kvpn-manager`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn kvpn(state_dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvpn"))
        .args(args)
        .env("KVPN_LAB_STATE_DIR", state_dir)
        .env_remove("KUBECONFIG")
        .output()
        .unwrap_or_else(|e| panic!("cannot run kvpn {args:?}: {e}"))
}

fn text(o: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `kvpn-<id>` from the up output's `(id xxxxx)`.
fn lab_id(up: &str) -> String {
    let start = up.find("(id ").expect("id in the up output") + 4;
    up[start..start + 5].to_owned()
}

#[test]
fn lab_up_exec_down_up_down() {
    let state_dir: PathBuf =
        std::env::temp_dir().join(format!("kvpn-cli-lab-state-{}", std::process::id()));
    for round in 0..2 {
        let up = kvpn(&state_dir, &["lab", "up"]);
        let up_text = text(&up);
        assert!(up.status.success(), "round {round}: {up_text}");
        assert!(
            up_text.contains("laptop-admin.kubeconfig")
                && up_text.contains("laptop-kvpn-user.kubeconfig"),
            "kubeconfig paths printed: {up_text}"
        );
        let id = lab_id(&up_text);

        let again = kvpn(&state_dir, &["lab", "up"]);
        assert!(
            !again.status.success(),
            "a second up must refuse: {}",
            text(&again)
        );

        let pods = kvpn(
            &state_dir,
            &[
                "lab", "exec", "laptop", "--", "kubectl", "get", "pods", "-A",
            ],
        );
        let out = String::from_utf8_lossy(&pods.stdout).into_owned();
        assert!(pods.status.success(), "{}", text(&pods));
        assert!(out.contains("web-") && out.contains("Running"), "{out}");
        // The traffic manager is not pre-installed: `kvpn connect --kubeconfig` installs it.
        assert!(
            !out.contains("kvpn-manager"),
            "lab up must leave the manager to kvpn connect: {out}"
        );
        // A pod by its Kubernetes name: ClusterIP web from inside a dev pod.
        let dev_pod = out
            .lines()
            .find(|l| l.starts_with("dev "))
            .and_then(|l| l.split_whitespace().nth(1))
            .expect("a dev pod")
            .to_owned();
        let curl = kvpn(
            &state_dir,
            &[
                "lab",
                "exec",
                &dev_pod,
                "--",
                "curl",
                "-s",
                "--max-time",
                "5",
                "http://10.96.0.100/",
            ],
        );
        assert!(
            String::from_utf8_lossy(&curl.stdout).contains("kvpn-lab-server"),
            "{}",
            text(&curl)
        );

        let down = kvpn(&state_dir, &["lab", "down"]);
        assert!(down.status.success(), "{}", text(&down));
        let left: Vec<String> = std::fs::read_dir("/run/netns")
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with(&format!("kvpn-{id}-")))
                    .collect()
            })
            .unwrap_or_default();
        assert!(left.is_empty(), "netns left: {left:?}");
        assert!(
            !std::env::temp_dir().join(format!("kvpn-lab-{id}")).exists(),
            "lab folder left"
        );
        let info = kvpn(&state_dir, &["lab", "info"]);
        assert!(!info.status.success(), "info after down: {}", text(&info));
    }
    let _ = std::fs::remove_dir_all(&state_dir);
}
