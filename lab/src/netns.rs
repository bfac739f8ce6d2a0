//! Named network namespaces (`ip netns`, files under `/run/netns`).
//!
//! I/O: runs `ip` (iproute2) for creation, deletion and link/address/route changes,
//! writes and removes `/etc/netns/<name>/` (files `ip netns exec` binds over `/etc`),
//! enters a netns on a scratch thread with `setns(2)` to open sockets or write
//! `/proc/sys/net/*` inside it, and scans `/proc/<pid>/ns/net` to find the processes
//! living in a netns.

use std::ffi::OsStr;
use std::fs::File;
use std::io::Write as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use nix::sched::CloneFlags;

use crate::{LabError, Result};

/// Directory where `ip netns add` keeps its bind mounts.
pub const NETNS_RUN_DIR: &str = "/run/netns";
/// `ip netns exec <name>` bind-mounts each file of `/etc/netns/<name>/` over the
/// same name in `/etc` for the program it runs (e.g. `resolv.conf`).
pub const NETNS_ETC_DIR: &str = "/etc/netns";
/// Prefix of every netns kvpn creates.
pub const NETNS_PREFIX: &str = "kvpn-";

/// A named network namespace. Plain data: it is deleted by [`Netns::delete`] (the lab's
/// teardown does that for every `kvpn-<id>-*` netns), never implicitly on drop, so a
/// persistent lab can outlive the process that built it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Creates `name` with `ip netns add`; fails if it already exists.
    pub fn create(name: &str) -> Result<Netns> {
        validate_name(name)?;
        run_checked(Command::new("ip").args(["netns", "add", name]))?;
        Ok(Netns {
            name: name.to_owned(),
        })
    }

    /// A handle to an existing (or soon existing) netns, without touching the system.
    pub fn from_name(name: &str) -> Netns {
        Netns {
            name: name.to_owned(),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `/run/netns/<name>`.
    pub fn path(&self) -> PathBuf {
        Path::new(NETNS_RUN_DIR).join(&self.name)
    }

    pub fn exists(&self) -> bool {
        self.path().exists()
    }

    /// `/etc/netns/<name>`: files here replace those of `/etc` for programs started
    /// with [`Netns::command`] (`ip netns exec`).
    pub fn etc_dir(&self) -> PathBuf {
        Path::new(NETNS_ETC_DIR).join(&self.name)
    }

    /// Writes `/etc/netns/<name>/<file>`, which programs started with
    /// [`Netns::command`] see as `/etc/<file>`. Removed by [`Netns::delete`].
    pub fn write_etc_file(&self, file: &str, bytes: &[u8]) -> Result<PathBuf> {
        let dir = self.etc_dir();
        std::fs::create_dir_all(&dir).map_err(|source| LabError::Io {
            what: format!("cannot create {}", dir.display()),
            source,
        })?;
        let path = dir.join(file);
        std::fs::write(&path, bytes).map_err(|source| LabError::Io {
            what: format!("cannot write {}", path.display()),
            source,
        })?;
        Ok(path)
    }

    /// A command that runs `program` inside this netns (`ip netns exec <name> program`).
    /// `ip` execs the program, so the child's pid is the program's pid.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec"]).arg(&self.name).arg(program);
        cmd
    }

    /// Runs `args[0] args[1..]` inside this netns to completion and returns its output
    /// (whatever the exit status; check `output.status`).
    pub fn exec(&self, args: &[&str]) -> Result<Output> {
        let Some((program, rest)) = args.split_first() else {
            return Err(LabError::Invalid {
                what: "command",
                value: String::new(),
                why: "empty argument list",
            });
        };
        let mut cmd = self.command(program);
        cmd.args(rest).stdin(Stdio::null());
        cmd.output().map_err(|source| LabError::Spawn {
            cmd: describe(&cmd),
            source,
        })
    }

    /// `ip -n <name> <args>`; fails on a non-zero exit.
    pub fn ip(&self, args: &[&str]) -> Result<()> {
        let mut cmd = Command::new("ip");
        cmd.arg("-n").arg(&self.name).args(args);
        run_checked(&mut cmd).map(drop)
    }

    /// Runs several `ip` commands (one per line, without the leading `ip`) inside this
    /// netns with one `ip -batch` process; stops at the first failing line.
    pub fn ip_batch(&self, lines: &[String]) -> Result<()> {
        let mut cmd = Command::new("ip");
        cmd.arg("-n").arg(&self.name).args(["-batch", "-"]);
        run_with_stdin(&mut cmd, lines.join("\n").as_bytes())
    }

    /// Runs `f` on a scratch thread that has entered this netns. Sockets created inside
    /// `f` stay in this netns when they are returned and used from other threads.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T> {
        run_in_netns(&self.name, f)
    }

    /// Writes `/proc/sys/<key with dots as slashes>` inside this netns for each pair,
    /// e.g. `("net.ipv4.ip_forward", "1")`.
    pub fn set_sysctls(&self, sysctls: &[(&str, &str)]) -> Result<()> {
        let name = self.name.clone();
        self.run(move || {
            for (key, value) in sysctls {
                let path = Path::new("/proc/sys").join(key.replace('.', "/"));
                std::fs::write(&path, value).map_err(|source| LabError::Io {
                    what: format!("cannot set sysctl {key}={value} in netns {name}"),
                    source,
                })?;
            }
            Ok(())
        })?
    }

    /// Reads one sysctl inside this netns (trimmed).
    pub fn sysctl(&self, key: &str) -> Result<String> {
        let name = self.name.clone();
        self.run(move || {
            let path = Path::new("/proc/sys").join(key.replace('.', "/"));
            std::fs::read_to_string(&path)
                .map(|s| s.trim().to_owned())
                .map_err(|source| LabError::Io {
                    what: format!("cannot read sysctl {key} in netns {name}"),
                    source,
                })
        })?
    }

    /// Pids of the processes whose network namespace is this one (like `ip netns pids`),
    /// never including the calling process.
    pub fn pids(&self) -> Vec<u32> {
        let Ok(meta) = std::fs::metadata(self.path()) else {
            return Vec::new();
        };
        let (dev, ino) = (meta.dev(), meta.ino());
        let me = std::process::id();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter(|&pid| pid != me)
            .filter(|pid| {
                std::fs::metadata(format!("/proc/{pid}/ns/net"))
                    .is_ok_and(|m| m.dev() == dev && m.ino() == ino)
            })
            .collect()
    }

    /// Deletes the netns (`ip netns delete`). Idempotent: a missing netns is fine. The
    /// kernel frees the namespace, and with it its veths, once no process is left in it.
    pub fn delete(&self) -> Result<()> {
        // `ip netns delete` leaves /etc/netns/<name> behind; the name is validated
        // to start with `kvpn-`, so this never reaches another netns's files.
        if self.name.starts_with(NETNS_PREFIX)
            && !self.name.contains('/')
            && let Err(source) = std::fs::remove_dir_all(self.etc_dir())
            && source.kind() != std::io::ErrorKind::NotFound
        {
            return Err(LabError::Io {
                what: format!("cannot remove {}", self.etc_dir().display()),
                source,
            });
        }
        if !self.exists() {
            return Ok(());
        }
        match run_checked(Command::new("ip").args(["netns", "delete", &self.name])) {
            Ok(_) => Ok(()),
            Err(_) if !self.exists() => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// Runs `f` on a scratch thread that has entered the netns `/run/netns/<name>` with
/// `setns(2)`. Only the scratch thread changes namespace; the caller's threads keep
/// theirs.
pub fn run_in_netns<T: Send>(name: &str, f: impl FnOnce() -> T + Send) -> Result<T> {
    let path = Path::new(NETNS_RUN_DIR).join(name);
    let file = File::open(&path).map_err(|source| LabError::Io {
        what: format!("cannot open network namespace {}", path.display()),
        source,
    })?;
    std::thread::scope(|scope| {
        let handle = scope.spawn(move || {
            nix::sched::setns(&file, CloneFlags::CLONE_NEWNET).map_err(|source| {
                LabError::Setns {
                    netns: name.to_owned(),
                    source,
                }
            })?;
            Ok(f())
        });
        match handle.join() {
            Ok(result) => result,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    })
}

/// Names of all network namespaces starting with `kvpn-` (any lab, any process), sorted.
pub fn list_kvpn_netns() -> Result<Vec<String>> {
    let entries = match std::fs::read_dir(NETNS_RUN_DIR) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(LabError::Io {
                what: format!("cannot list {NETNS_RUN_DIR}"),
                source,
            });
        }
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(NETNS_PREFIX))
        .collect();
    names.sort();
    Ok(names)
}

/// Names of the network namespaces of lab `id` (`kvpn-<id>-*`), sorted.
pub fn lab_netns(id: &str) -> Result<Vec<String>> {
    let prefix = format!("{NETNS_PREFIX}{id}-");
    Ok(list_kvpn_netns()?
        .into_iter()
        .filter(|n| n.starts_with(&prefix))
        .collect())
}

/// Pids whose command is `comm` living in one of lab `id`'s network namespaces
/// or, on real nodes, in a container of one of its nodes (cgroup
/// `/kvpn-<id>-n<i>/…`: a pod's netns is pinned inside its node's mount
/// namespace, not in /run/netns). Other labs on the machine run the same programs.
pub fn lab_pids(id: &str, comm: &str) -> Vec<u32> {
    use std::os::unix::fs::MetadataExt as _;
    let node_cgroup = format!("/{NETNS_PREFIX}{id}-n");
    let inodes: Vec<u64> = lab_netns(id)
        .unwrap_or_default()
        .iter()
        .filter_map(|n| std::fs::metadata(format!("/run/netns/{n}")).ok())
        .map(|m| m.ino())
        .collect();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let read = |f: &str| std::fs::read_to_string(format!("/proc/{pid}/{f}"));
            read("comm").is_ok_and(|c| c.trim() == comm)
                && (std::fs::metadata(format!("/proc/{pid}/ns/net"))
                    .is_ok_and(|m| inodes.contains(&m.ino()))
                    || read("cgroup").is_ok_and(|c| c.contains(&node_cgroup)))
        })
        .collect()
}

/// Lab `id`'s traffic manager (`kvpn-manager`, not preserve's node agents, the
/// same program), on the stand-in node or on real nodes ([`lab_pids`]).
pub fn lab_manager_pid(id: &str) -> Option<u32> {
    lab_pids(id, "kvpn-manager").into_iter().find(|pid| {
        !std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
            .is_ok_and(|c| c.split('\0').any(|a| a == "node-agent"))
    })
}

fn validate_name(name: &str) -> Result<()> {
    let ok = name.starts_with(NETNS_PREFIX)
        && name.len() <= 200
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(LabError::Invalid {
            what: "netns name",
            value: name.to_owned(),
            why: "must start with `kvpn-` and hold only a-z, 0-9 and `-` (at most 200 bytes)",
        })
    }
}

/// Human-readable command line for error messages.
pub(crate) fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs `cmd` to completion; a non-zero exit becomes [`LabError::CommandFailed`].
pub(crate) fn run_checked(cmd: &mut Command) -> Result<Output> {
    cmd.stdin(Stdio::null());
    let output = cmd.output().map_err(|source| LabError::Spawn {
        cmd: describe(cmd),
        source,
    })?;
    if output.status.success() {
        Ok(output)
    } else {
        Err(LabError::CommandFailed {
            cmd: describe(cmd),
            status: output.status,
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        })
    }
}

/// Runs `cmd` with `input` on stdin; a non-zero exit becomes [`LabError::CommandFailed`].
pub(crate) fn run_with_stdin(cmd: &mut Command, input: &[u8]) -> Result<()> {
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|source| LabError::Spawn {
        cmd: describe(cmd),
        source,
    })?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(input).map_err(|source| LabError::Io {
            what: format!("cannot write to the stdin of `{}`", describe(cmd)),
            source,
        })?;
    }
    let output = child.wait_with_output().map_err(|source| LabError::Spawn {
        cmd: describe(cmd),
        source,
    })?;
    if output.status.success() {
        Ok(())
    } else {
        Err(LabError::CommandFailed {
            cmd: describe(cmd),
            status: output.status,
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        })
    }
}
