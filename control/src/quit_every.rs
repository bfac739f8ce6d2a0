//! `kvpn quit --every-runtime-dir`: quit kvpn in every root daemon runtime
//! folder used in this network namespace, not only the one given — the
//! daemons running here (found in /proc by their network namespace and
//! `--runtime-dir`) and the folders of the session records made here (found by
//! the namespace they name, [`crate::userd::record::records_made_in`]), whose
//! daemons may be gone. `kvpn lab down` runs it in the lab's laptop, so that
//! sessions started there with a `--runtime-dir` of their own are not left
//! behind with the lab.
//!
//! I/O: /proc (the scan), then [`crate::quit`] per folder.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

use crate::output;
use crate::userd::record;

/// The program names whose processes are kvpn's daemons or CLIs.
const KVPN_PROGRAMS: [&str; 2] = ["kvpn", "kvpn-dataplane"];

/// The root daemon runtime folder a kvpn process's command line `args` names
/// (`--runtime-dir DIR` or `--runtime-dir=DIR`), `None` for any other program
/// or without one (pure).
pub fn runtime_dir_of(args: &[&str]) -> Option<PathBuf> {
    let program = Path::new(args.first()?).file_name()?.to_str()?;
    if !KVPN_PROGRAMS.contains(&program) {
        return None;
    }
    let mut rest = args[1..].iter();
    while let Some(a) = rest.next() {
        if *a == "--" {
            return None;
        }
        if *a == "--runtime-dir" {
            return rest.next().map(PathBuf::from);
        }
        if let Some(d) = a.strip_prefix("--runtime-dir=") {
            return Some(PathBuf::from(d));
        }
    }
    None
}

/// The runtime folders of kvpn processes (other than this one) in network
/// namespace `netns` (`net:[INODE]`).
fn running_in(netns: &str) -> Vec<PathBuf> {
    let me = std::process::id();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut dirs = Vec::new();
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me
            || std::fs::read_link(p.path().join("ns/net"))
                .map(|l| l.display().to_string())
                .ok()
                .as_deref()
                != Some(netns)
        {
            continue;
        }
        let Ok(cmdline) = std::fs::read(p.path().join("cmdline")) else {
            continue;
        };
        let text = String::from_utf8_lossy(&cmdline);
        let args: Vec<&str> = text.split('\0').filter(|a| !a.is_empty()).collect();
        if let Some(d) = runtime_dir_of(&args) {
            dirs.push(d);
        }
    }
    dirs
}

/// Quit kvpn in `runtime_dir` and in every other runtime folder used in this
/// network namespace; an error lists what is left and how to remove it.
pub async fn quit_every(runtime_dir: &Path) -> Result<()> {
    let netns = record::current_netns();
    let state = record::current_state_dir();
    let records = |state: &Option<PathBuf>| {
        state
            .as_deref()
            .map(|s| record::records_made_in(s, &netns))
            .unwrap_or_default()
    };
    let mut dirs = vec![runtime_dir.to_path_buf()];
    let found = running_in(&netns).into_iter().chain(
        records(&state)
            .into_iter()
            .filter(|(_, r)| !r.runtime_dir.is_empty())
            .map(|(_, r)| PathBuf::from(r.runtime_dir)),
    );
    for d in found {
        if !dirs.contains(&d) {
            dirs.push(d);
        }
    }
    let mut failed = Vec::new();
    for d in &dirs {
        if d != runtime_dir {
            output::step(&format!("Quitting kvpn in runtime folder {}", d.display()));
        }
        if let Err(e) = crate::quit(d).await {
            failed.push(format!(
                "{}: {} (retry: `kvpn --runtime-dir {} quit`)",
                d.display(),
                output::error_chain(&e),
                d.display()
            ));
        }
    }
    // A record whose folder could not be quit (or of an older kvpn, naming
    // no folder) stays: name each file.
    let left: Vec<String> = records(&state)
        .into_iter()
        .map(|(p, r)| {
            format!(
                "session record {} (session {}, runtime folder {}): remove it with `rm {}`",
                p.display(),
                r.id,
                if r.runtime_dir.is_empty() {
                    "not recorded"
                } else {
                    &r.runtime_dir
                },
                p.display()
            )
        })
        .collect();
    if failed.is_empty() && left.is_empty() {
        return Ok(());
    }
    bail!(
        "kvpn quit --every-runtime-dir left kvpn sessions of this network namespace: {}",
        failed
            .into_iter()
            .chain(left)
            .collect::<Vec<_>>()
            .join("; ")
    )
}

#[cfg(test)]
mod tests {
    use super::runtime_dir_of;
    use std::path::PathBuf;

    #[test]
    fn the_runtime_folder_comes_from_a_kvpn_command_line_only() {
        assert_eq!(
            runtime_dir_of(&["/usr/bin/kvpn", "--runtime-dir", "/tmp/a", "daemon"]),
            Some(PathBuf::from("/tmp/a"))
        );
        assert_eq!(
            runtime_dir_of(&["kvpn-dataplane", "--runtime-dir=/tmp/b", "--allow-uid", "7"]),
            Some(PathBuf::from("/tmp/b"))
        );
        assert_eq!(runtime_dir_of(&["kvpn", "connect"]), None);
        // Another program, and a kvpn run's command after `--`, are not kvpn's.
        assert_eq!(runtime_dir_of(&["sleep", "--runtime-dir", "/x"]), None);
        assert_eq!(
            runtime_dir_of(&["kvpn", "run", "--", "sh", "--runtime-dir", "/x"]),
            None
        );
        assert_eq!(runtime_dir_of(&[]), None);
    }
}
