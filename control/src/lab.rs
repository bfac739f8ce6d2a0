//! `kvpn lab`: the built-in lab (a Kubernetes cluster in network namespaces) for trying
//! kvpn out. The lab itself lives in the kvpn-lab crate (lab-only code,
//! [`kvpn_lab::k8s::cluster`]); this is its command-line face. The lab is persistent
//! between commands: `up` records it under a name and leaves its control plane and its
//! node agent (`kvpn-lab-agent`) running; `exec`/`info`/`down` find it by that name.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, anyhow};
use kvpn_lab::k8s::cluster::{self, K8sLabState};
use kvpn_lab::k8s::{K8sLab, K8sLabOptions};
use kvpn_lab::{DEFAULT_LAB_NAME, Lab, LabError, Netns};

use crate::cli::LabCommand;
use crate::output;

/// Run a `kvpn lab` subcommand.
pub async fn run(cmd: LabCommand) -> Result<()> {
    match cmd {
        LabCommand::Up { dual_stack } => up(dual_stack).await,
        other => tokio::task::spawn_blocking(move || run_blocking(other))
            .await
            .context("lab task panicked")?,
    }
}

async fn up(dual_stack: bool) -> Result<()> {
    output::step(
        "Bringing the lab up: laptop and node network namespaces, etcd + kube-apiserver + \
         kube-controller-manager, kubelet/kube-proxy/DNS stand-ins, sample workloads \
         (the traffic manager is installed by `kvpn connect`)",
    );
    let started = std::time::Instant::now();
    // No pre-installed traffic manager: `kvpn connect --kubeconfig …` installs it, as
    // on a real cluster.
    let workloads = kvpn_lab::k8s::workloads::Workloads {
        manager: false,
        ..Default::default()
    };
    let addressing = if dual_stack {
        kvpn_lab::Addressing::default().dual_stack()
    } else {
        kvpn_lab::Addressing::default()
    };
    let lab = K8sLab::up(
        K8sLabOptions::default()
            .persist_as(DEFAULT_LAB_NAME)
            .workloads(workloads)
            .addressing(addressing),
    )
    .await
    .context("kvpn lab up failed")?;
    output::info_block(&lab.info());
    let admin = lab.laptop_admin_kubeconfig().to_owned();
    let user = lab.laptop_user_kubeconfig().to_owned();
    let state = tokio::task::spawn_blocking(move || lab.detach())
        .await
        .context("lab task panicked")?
        .context("cannot record the lab's state")?;
    output::done(&format!(
        "Lab {DEFAULT_LAB_NAME} is up in {:.1} s (state {}).\n  \
         kubeconfig (from the laptop netns): {}\n  \
         restricted kubeconfig (user kvpn-user): {}\n  \
         Run commands in it with `kvpn lab exec laptop -- kubectl get pods -A` (KUBECONFIG is set there), \
         remove it with `kvpn lab down`",
        started.elapsed().as_secs_f64(),
        state.display(),
        admin.display(),
        user.display(),
    ));
    Ok(())
}

fn run_blocking(cmd: LabCommand) -> Result<()> {
    match cmd {
        LabCommand::Up { .. } => Err(anyhow!("`kvpn lab up` runs on the async path")),
        LabCommand::Down => {
            if let Ok(lab) = Lab::attach(DEFAULT_LAB_NAME) {
                quit_laptop_sessions(&lab);
            }
            output::step(&format!("Tearing the lab {DEFAULT_LAB_NAME} down"));
            if cluster::down_named(DEFAULT_LAB_NAME).context("kvpn lab down failed")? {
                output::done(
                    "Lab is down: its agent, control plane, pods, network namespaces, nftables rules and folder are gone",
                );
            } else {
                output::done(&format!("No lab named {DEFAULT_LAB_NAME} was up"));
            }
            Ok(())
        }
        LabCommand::Info => {
            let lab = Lab::attach(DEFAULT_LAB_NAME)
                .context("no lab to describe — bring one up with `kvpn lab up`")?;
            match K8sLabState::read(lab.dir()).context("reading the lab's Kubernetes state")? {
                Some(state) => output::info_block(&cluster::info_text(&lab, &state)),
                None => output::info_block(&lab.info()),
            }
            Ok(())
        }
        LabCommand::Exec { role, command } => {
            let lab = Lab::attach(DEFAULT_LAB_NAME)
                .context("no lab to run in — bring one up with `kvpn lab up`")?;
            let (program, args) = command.split_first().ok_or_else(|| {
                anyhow!(
                    "kvpn lab exec {role}: no command given — e.g. `kvpn lab exec laptop -- kubectl get pods -A`"
                )
            })?;
            let netns = find_netns(&lab, &role)?;
            let mut cmd: Command = netns.command(program);
            cmd.args(args);
            if role == kvpn_lab::LAPTOP
                && std::env::var_os("KUBECONFIG").is_none()
                && let Ok(Some(state)) = K8sLabState::read(lab.dir())
            {
                // What a developer's laptop has: a kubeconfig for the cluster.
                cmd.env("KUBECONFIG", &state.laptop_admin_kubeconfig);
            }
            if role == kvpn_lab::LAPTOP {
                // The laptop's own hosts file, which `ip netns exec` binds over
                // /etc/hosts there. A root daemon started from here edits the file
                // KVPN_HOSTS names (`kvpn connect --hosts`); without it, it would be
                // whichever /etc/hosts its mount namespace shows, this machine's when
                // the lab has no file of its own (a lab from an older kvpn: made now,
                // as a copy of /etc/hosts). Always set: an inherited KVPN_HOSTS could
                // name this machine's file.
                kvpn_lab::write_laptop_hosts(&netns, false)
                    .context("cannot write the lab laptop's hosts file")?;
                cmd.env(
                    "KVPN_HOSTS",
                    netns.etc_dir().join(kvpn_lab::LAPTOP_HOSTS_FILE),
                );
            }
            if role == kvpn_lab::LAPTOP {
                // The root daemon's runtime folder is a path, not part of the netns:
                // with the default (/run/kvpn) a `kvpn connect` here would talk to a
                // root daemon of this machine's own network namespace, if one runs,
                // and make its TUN device and routes there. The laptop gets a folder
                // of its own unless the caller chose one (the demo does).
                let inherited = std::env::var_os("KVPN_RUNTIME_DIR").map(PathBuf::from);
                if inherited.as_deref().is_none_or(|d| {
                    d.as_os_str().is_empty()
                        || d == Path::new(crate::userd::DEFAULT_ROOT_RUNTIME_DIR)
                }) {
                    cmd.env("KVPN_RUNTIME_DIR", laptop_runtime_dir(&lab));
                }
            }
            // `ip netns exec` exits 1 when it cannot start the command, like a
            // failing command; a shell's 127 (not found) and 126 (not executable)
            // tell the two apart, so kvpn checks first and exits with those.
            if let Err(e) = find_program(program, std::env::var_os("PATH").as_deref()) {
                output::error(&format!("kvpn lab exec {role}: {e}"));
                std::process::exit(e.exit_code());
            }
            let status = cmd
                .status()
                .with_context(|| format!("cannot run {program:?} in the lab's {role} namespace"))?;
            // Hand the command's own exit code back, like `ip netns exec` does.
            std::process::exit(status.code().unwrap_or(1));
        }
    }
}

/// Why `kvpn lab exec` cannot start a command.
#[derive(Debug, PartialEq, Eq)]
enum NotRunnable {
    /// No such file (a path), or in no folder of PATH (a name).
    NotFound(String),
    /// It exists but is a folder or has no execute permission.
    NotExecutable(PathBuf),
}

impl NotRunnable {
    /// A shell's exit code for it.
    fn exit_code(&self) -> i32 {
        match self {
            NotRunnable::NotFound(_) => 127,
            NotRunnable::NotExecutable(_) => 126,
        }
    }
}

impl std::fmt::Display for NotRunnable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotRunnable::NotFound(p) if p.contains('/') => {
                write!(f, "{p}: no such file — check the path")
            }
            NotRunnable::NotFound(p) => write!(
                f,
                "{p}: command not found — install it, or give its full path (PATH is searched)"
            ),
            NotRunnable::NotExecutable(p) => write!(
                f,
                "{}: permission denied (a folder, or no execute permission) — `chmod +x` it",
                p.display()
            ),
        }
    }
}

/// The file `program` names as a shell finds it: a path (with a `/`) as it is,
/// a name in the folders of `path_var` (an empty entry is the working folder),
/// the first executable file winning.
fn find_program(program: &str, path_var: Option<&std::ffi::OsStr>) -> Result<PathBuf, NotRunnable> {
    use std::os::unix::fs::PermissionsExt as _;
    let executable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        let p = PathBuf::from(program);
        return if executable(&p) {
            Ok(p)
        } else if p.exists() {
            Err(NotRunnable::NotExecutable(p))
        } else {
            Err(NotRunnable::NotFound(program.to_owned()))
        };
    }
    let mut not_executable = None;
    if !program.is_empty() {
        for dir in std::env::split_paths(path_var.unwrap_or_default()) {
            let dir = if dir.as_os_str().is_empty() {
                PathBuf::from(".")
            } else {
                dir
            };
            let p = dir.join(program);
            if executable(&p) {
                return Ok(p);
            }
            if not_executable.is_none() && p.is_file() {
                not_executable = Some(p);
            }
        }
    }
    Err(not_executable.map_or_else(
        || NotRunnable::NotFound(program.to_owned()),
        NotRunnable::NotExecutable,
    ))
}

/// The runtime folder `kvpn lab exec laptop` gives kvpn there when the caller
/// set none: `<lab state folder>/<lab name>-laptop-runtime`.
/// The runtime folder `kvpn lab exec laptop` gives kvpn: the caller's
/// KVPN_RUNTIME_DIR when it chose one (not empty, not the default), else the
/// lab's own.
fn exec_runtime_dir(lab: &Lab) -> PathBuf {
    match std::env::var_os("KVPN_RUNTIME_DIR").map(PathBuf::from) {
        Some(d)
            if !d.as_os_str().is_empty()
                && d != Path::new(crate::userd::DEFAULT_ROOT_RUNTIME_DIR) =>
        {
            d
        }
        _ => laptop_runtime_dir(lab),
    }
}

/// Before the lab goes: `kvpn quit` in its laptop (the runtime folder `kvpn lab
/// exec laptop` uses), so sessions into the lab are disconnected and their
/// records removed instead of lingering as `lost` once the cluster is gone.
fn quit_laptop_sessions(lab: &Lab) {
    let runtime_dir = exec_runtime_dir(lab);
    let user_daemon = crate::userd::Paths::current(&runtime_dir).socket.exists();
    if !user_daemon && !runtime_dir.join("dataplane.sock").exists() {
        return;
    }
    let Ok(exe) = std::env::current_exe() else {
        return;
    };
    let Ok(netns) = lab.netns(kvpn_lab::LAPTOP) else {
        return;
    };
    output::step("Disconnecting the sessions of the lab's laptop (kvpn quit)");
    let mut cmd: Command = netns.command(&exe);
    cmd.arg("quit").env("KVPN_RUNTIME_DIR", &runtime_dir);
    match cmd.output() {
        Ok(out) if out.status.success() => {}
        Ok(out) => output::warn(&format!(
            "kvpn quit in the lab's laptop failed ({}): {} — its session records may stay;              `kvpn disconnect` them with KVPN_RUNTIME_DIR={}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            runtime_dir.display()
        )),
        Err(e) => output::warn(&format!("cannot run kvpn quit in the lab's laptop: {e}")),
    }
}

pub fn laptop_runtime_dir(lab: &Lab) -> PathBuf {
    kvpn_lab::state_dir().join(format!("{}-laptop-runtime", lab.name()))
}

/// The netns of `role`: `laptop`, `node`, a static pod, or a Kubernetes pod by its name
/// (the kubelet stand-in names pod netns `kvpn-<id>-<pod>-<uid[..5]>`).
fn find_netns(lab: &Lab, role: &str) -> Result<Netns> {
    match lab.netns(role) {
        Ok(n) => Ok(n),
        Err(LabError::UnknownRole { .. }) => {
            let prefix = format!("kvpn-{}-{role}-", lab.id());
            let names = kvpn_lab::lab_netns(lab.id()).context("listing the lab's netns")?;
            let matches: Vec<&String> = names
                .iter()
                .filter(|n| {
                    n.strip_prefix(&prefix)
                        .is_some_and(|uid| uid.len() == 5 && !uid.contains('-'))
                })
                .collect();
            match matches.as_slice() {
                [one] => Ok(Netns::from_name(one)),
                _ => Err(anyhow!(
                    "kvpn lab exec: unknown role {role:?} — use laptop, node, or a pod name from \
                     `kvpn lab exec laptop -- kubectl get pods -A` (netns: {})",
                    names.join(", ")
                )),
            }
        }
        Err(e) => Err(e).context("kvpn lab exec"),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    /// `kvpn lab exec laptop -- nosuchcmd` exits 127 and a file without execute
    /// permission 126, as in a shell (`ip netns exec` exits 1 for both, like a
    /// command that ran and failed).
    #[test]
    fn lab_exec_not_found_is_127_not_executable_is_126() {
        let dir = std::env::temp_dir().join(format!("kvpn-lab-exec-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let run = dir.join("run-me");
        std::fs::write(&run, "#!/bin/sh\n").expect("write");
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let plain = dir.join("plain");
        std::fs::write(&plain, "data").expect("write");
        std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let path = std::env::join_paths([Path::new("/nonexistent-kvpn"), &dir]).expect("PATH");
        let path = Some(path.as_os_str());

        assert_eq!(find_program("run-me", path), Ok(run.clone()));
        assert_eq!(
            find_program(run.to_str().expect("utf-8"), None),
            Ok(run.clone())
        );

        let e = find_program("nosuchcmd", path).expect_err("nosuchcmd found");
        assert_eq!(e.exit_code(), 127, "{e}");
        assert!(
            e.to_string().contains("nosuchcmd: command not found"),
            "{e}"
        );
        let e = find_program("/nonexistent-kvpn/x", path).expect_err("found");
        assert_eq!(e.exit_code(), 127, "{e}");
        assert_eq!(find_program("", path).map_err(|e| e.exit_code()), Err(127));

        let e = find_program("plain", path).expect_err("plain ran");
        assert_eq!(e, NotRunnable::NotExecutable(plain.clone()));
        assert_eq!(e.exit_code(), 126);
        let e = find_program(dir.to_str().expect("utf-8"), path).expect_err("folder ran");
        assert_eq!(e.exit_code(), 126, "{e}");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
