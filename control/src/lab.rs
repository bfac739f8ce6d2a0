//! `kvpn lab …`: runs the lab's own program, `kvpn-lab`. The lab (a Kubernetes
//! cluster in network namespaces, with kubelet, kube-proxy and DNS stand-ins) is
//! lab-only code in the kvpn-lab crate; `kvpn` does not link it (issue #24), so it
//! looks for `kvpn-lab` next to itself, then in PATH, and replaces itself with it:
//! exit codes and signals are the lab's own.

use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Result, anyhow};

use crate::cli::LabArgs;

/// The lab's program.
const LAB_PROGRAM: &str = "kvpn-lab";

/// Run `kvpn-lab ARGS…` in place of this process.
pub fn run(args: LabArgs) -> Result<()> {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join(LAB_PROGRAM)));
    let program =
        find(beside.as_deref(), std::env::var_os("PATH").as_deref()).ok_or_else(|| {
            anyhow!(
                "`kvpn lab` runs the program {LAB_PROGRAM}, found neither next to kvpn ({}) nor in \
             PATH; it is lab-only and ships with kvpn's source tree: build it with `./x build` \
             (or `cargo build -p kvpn-lab --bin kvpn-lab`) and put it next to kvpn",
                beside
                    .as_deref()
                    .map_or_else(|| "unknown".into(), |p| p.display().to_string())
            )
        })?;
    let err = Command::new(&program).args(&args.args).exec();
    Err(anyhow!("cannot run {}: {err}", program.display()))
}

/// `kvpn-lab` beside kvpn, else the first in `path_var`.
fn find(beside: Option<&Path>, path_var: Option<&std::ffi::OsStr>) -> Option<PathBuf> {
    if let Some(p) = beside.filter(|p| p.is_file()) {
        return Some(p.to_owned());
    }
    std::env::split_paths(path_var.unwrap_or_default())
        .map(|dir| dir.join(LAB_PROGRAM))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The program beside kvpn wins over PATH; without either, nothing is found.
    #[test]
    fn kvpn_lab_is_found_beside_kvpn_first_then_in_path() {
        let root = std::env::temp_dir().join(format!("kvpn-labfind-{}", std::process::id()));
        let (beside_dir, path_dir) = (root.join("bin"), root.join("path"));
        std::fs::create_dir_all(&beside_dir).expect("mkdir");
        std::fs::create_dir_all(&path_dir).expect("mkdir");
        let in_path = path_dir.join(LAB_PROGRAM);
        std::fs::write(&in_path, "").expect("write");
        let beside = beside_dir.join(LAB_PROGRAM);
        let path_var = std::env::join_paths([&path_dir]).expect("PATH");

        assert_eq!(find(Some(&beside), Some(&path_var)), Some(in_path.clone()));
        std::fs::write(&beside, "").expect("write");
        assert_eq!(find(Some(&beside), Some(&path_var)), Some(beside.clone()));
        assert_eq!(find(None, None), None);
        assert_eq!(find(Some(&root.join("nope")), None), None);
        std::fs::remove_dir_all(&root).expect("cleanup");
    }
}
