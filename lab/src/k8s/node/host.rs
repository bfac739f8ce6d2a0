//! What a real node needs from the machine besides its netns, and how it is taken
//! back: a private mount namespace, a cgroup subtree, spawning into both, and the
//! global sysctls the kubelet changes.
//!
//! - [`MountNs`]: a persistent mount namespace (`unshare --mount=<file>`) in which
//!   `/run`, `/var/lib`, `/var/log` and `/opt` are tmpfs of the node's own. containerd,
//!   the kubelet and CNI write there whatever their flags say (`/run/containerd/{s,
//!   fifo,runc}`, `/opt/containerd`, `/var/lib/kubelet/device-plugins`,
//!   `/var/log/pods`, `/var/log/containers`, `/var/lib/cni`, the pod netns under
//!   `/run/netns`), so two nodes never meet and nothing lands on the machine. The
//!   namespace (and with it every mount a node made: tmpfs, container rootfs overlays,
//!   pod netns pins) is freed when its last process is gone and the file is unmounted.
//! - [`NodeCgroup`]: `/<name>` in every cgroup hierarchy (cgroup v1 hybrid here), with
//!   `cpuset.cpus`/`cpuset.mems` copied in (a v1 cpuset child starts empty and takes
//!   no task). It is the kubelet's `cgroupRoot`; the node's daemons run in
//!   `/<name>/system`, the pods under `/<name>/kubepods`, so killing the subtree stops
//!   every process of the node, containers and shims included.
//! - [`spawn_in_node`]: a command joined to the cgroup, the netns and the mount
//!   namespace between fork and exec, so the child's pid is the program's.
//! - [`GlobalSysctls`]: the machine-wide values the kubelet sets at start
//!   (vm.overcommit_memory, kernel.panic, kernel.panic_on_oops), saved and put back.
//!   [`KubeletStartLock`] serializes that window between labs on one machine, so no
//!   lab saves another's kubelet values as the originals.

use std::fs::File;
use std::io::Write as _;
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::MetadataExt as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::Error;

/// Where the machine's cgroup hierarchies are mounted.
const CGROUP_MOUNT_ROOT: &str = "/sys/fs/cgroup";
/// The folders of a node's mount namespace that get a tmpfs of their own.
pub const PRIVATE_DIRS: [&str; 4] = ["/run", "/var/lib", "/var/log", "/opt"];
/// Created on the private tmpfs before anything starts (the kubelet and containerd
/// create the rest).
const PRIVATE_SUBDIRS: [&str; 7] = [
    "/run/containerd",
    "/run/netns",
    "/var/lib/kubelet",
    "/var/lib/containerd",
    "/var/lib/cni",
    "/var/log/pods",
    "/var/log/containers",
];

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}

fn run(cmd: &mut Command) -> Result<(), Error> {
    let text = format!("{cmd:?}");
    let out = cmd.output().map_err(io(format!("running {text}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Error::Command {
            cmd: text,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

// --- mount namespace ----------------------------------------------------------------

/// A node's persistent mount namespace, pinned by a bind mount of its nsfs file
/// `<dir>/mnt`; `<dir>` itself is a private bind mount (the kernel refuses to pin a
/// mount namespace on a shared mount).
#[derive(Debug)]
pub struct MountNs {
    dir: PathBuf,
    file: PathBuf,
    pinned: bool,
    dir_mounted: bool,
}

impl MountNs {
    /// Creates the namespace; `tag` names its tmpfs mounts (visible in
    /// `/proc/<pid>/mountinfo` of the node's processes).
    pub fn create(dir: &Path, tag: &str) -> Result<MountNs, Error> {
        use nix::mount::{MsFlags, mount};
        std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
        let mut ns = MountNs {
            dir: dir.to_owned(),
            file: dir.join("mnt"),
            pinned: false,
            dir_mounted: false,
        };
        // From here on an early return drops `ns`, which undoes what was done.
        mount(Some(dir), dir, None::<&str>, MsFlags::MS_BIND, None::<&str>).map_err(|e| {
            Error::Mount {
                what: format!("bind-mounting {} onto itself", dir.display()),
                source: e,
            }
        })?;
        ns.dir_mounted = true;
        mount(
            None::<&str>,
            dir,
            None::<&str>,
            MsFlags::MS_PRIVATE,
            None::<&str>,
        )
        .map_err(|e| Error::Mount {
            what: format!("making {} private", dir.display()),
            source: e,
        })?;
        File::create(&ns.file).map_err(io(format!("creating {}", ns.file.display())))?;
        let mut script = String::from("set -e\n");
        // The new namespace starts with a copy of every mount, including the nsfs
        // pins of the machine's named netns (`/run/netns/*`, other labs' too) and of
        // other nodes' mount namespaces. A copy holds its namespace alive after its
        // owner lets go (`ip netns delete` would leave a netns with its veths in the
        // kernel), so drop them all here.
        script.push_str(
            "awk '$0 ~ / - nsfs / {print $5}' /proc/self/mountinfo | sort -r | \
             while read -r m; do umount -l \"$m\"; done\n",
        );
        for d in PRIVATE_DIRS {
            script.push_str(&format!("mount -t tmpfs -o mode=755 {tag} {d}\n"));
        }
        script.push_str(&format!("mkdir -p {}\n", PRIVATE_SUBDIRS.join(" ")));
        let mut cmd = Command::new("unshare");
        cmd.arg(format!("--mount={}", ns.file.display()))
            .args(["--propagation", "slave", "--", "sh", "-c"])
            .arg(&script);
        run(&mut cmd)?;
        ns.pinned = true;
        Ok(ns)
    }

    /// The namespace pinned at `<dir>/mnt` by a process that is gone (a killed lab
    /// agent), to take back with [`MountNs::remove`].
    pub fn existing(dir: &Path) -> MountNs {
        MountNs {
            dir: dir.to_owned(),
            file: dir.join("mnt"),
            pinned: true,
            dir_mounted: true,
        }
    }

    /// The nsfs file that pins the namespace (open it to `setns(2)` into it).
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// The namespace's inode, as in `/proc/<pid>/ns/mnt` of its processes.
    pub fn inode(&self) -> Option<u64> {
        std::fs::metadata(&self.file).ok().map(|m| m.ino())
    }

    /// Unpins the namespace (freed with all its mounts once no process uses it) and
    /// removes the private folder mount. Idempotent.
    pub fn remove(&mut self) -> Result<(), Error> {
        use nix::mount::{MntFlags, umount2};
        if self.pinned {
            umount2(&self.file, MntFlags::empty())
                .or_else(|_| umount2(&self.file, MntFlags::MNT_DETACH))
                .map_err(|e| Error::Mount {
                    what: format!("unmounting {}", self.file.display()),
                    source: e,
                })?;
            self.pinned = false;
        }
        if self.dir_mounted {
            umount2(&self.dir, MntFlags::empty())
                .or_else(|_| umount2(&self.dir, MntFlags::MNT_DETACH))
                .map_err(|e| Error::Mount {
                    what: format!("unmounting {}", self.dir.display()),
                    source: e,
                })?;
            self.dir_mounted = false;
        }
        Ok(())
    }
}

impl Drop for MountNs {
    fn drop(&mut self) {
        if let Err(e) = self.remove() {
            tracing::warn!(error = %e, "real node: mount namespace left behind");
        }
    }
}

/// Mount points under `prefix` in the machine's mount table (for leftover checks).
pub fn mounts_under(prefix: &Path) -> Vec<PathBuf> {
    let Ok(text) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(PathBuf::from)
        .filter(|p| p.starts_with(prefix))
        .collect()
}

// --- cgroups ------------------------------------------------------------------------

/// One cgroup hierarchy: where it is mounted and whether it is the v1 cpuset one.
#[derive(Debug, Clone)]
struct Hierarchy {
    mount: PathBuf,
    cpuset: bool,
}

/// The cgroup hierarchies mounted under `/sys/fs/cgroup` (v1 controllers, the named
/// systemd one and the unified v2 one), from `/proc/self/mountinfo`.
fn hierarchies() -> Result<Vec<Hierarchy>, Error> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(io("reading /proc/self/mountinfo"))?;
    Ok(parse_cgroup_mounts(&text))
}

/// Pure part of [`hierarchies`].
fn parse_cgroup_mounts(mountinfo: &str) -> Vec<Hierarchy> {
    let mut out = Vec::new();
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let Some(mount) = left.split(' ').nth(4) else {
            continue;
        };
        let mut r = right.split(' ');
        let fstype = r.next().unwrap_or("");
        let super_opts = r.nth(1).unwrap_or("");
        if (fstype == "cgroup" || fstype == "cgroup2")
            && Path::new(mount).starts_with(CGROUP_MOUNT_ROOT)
        {
            out.push(Hierarchy {
                mount: PathBuf::from(mount),
                cpuset: fstype == "cgroup" && super_opts.split(',').any(|o| o == "cpuset"),
            });
        }
    }
    out
}

/// `/<name>` in every cgroup hierarchy (see the module docs). Dropping it kills what
/// is left in it and removes it.
#[derive(Debug)]
pub struct NodeCgroup {
    name: String,
    hierarchies: Vec<Hierarchy>,
    created: Vec<PathBuf>,
}

/// The sub-cgroup of the node's daemons (containerd and its shims, kubelet,
/// kube-proxy).
const SYSTEM: &str = "system";

impl NodeCgroup {
    /// Creates `/<name>` and `/<name>/system` in every hierarchy.
    pub fn create(name: &str) -> Result<NodeCgroup, Error> {
        let mut cg = NodeCgroup {
            name: name.to_owned(),
            hierarchies: hierarchies()?,
            created: Vec::new(),
        };
        if cg.hierarchies.is_empty() {
            return Err(Error::Cgroup {
                path: PathBuf::from(CGROUP_MOUNT_ROOT),
                message: "no cgroup hierarchy is mounted there".into(),
            });
        }
        for h in cg.hierarchies.clone() {
            let root = h.mount.join(name);
            for dir in [root.clone(), root.join(SYSTEM)] {
                std::fs::create_dir(&dir).map_err(|e| Error::Cgroup {
                    path: dir.clone(),
                    message: format!("mkdir: {e}"),
                })?;
                cg.created.push(dir.clone());
                if h.cpuset {
                    let parent = dir.parent().unwrap_or(&h.mount).to_owned();
                    for f in ["cpuset.cpus", "cpuset.mems"] {
                        let value = std::fs::read_to_string(parent.join(f))
                            .map_err(io(format!("reading {}", parent.join(f).display())))?;
                        std::fs::write(dir.join(f), value.trim())
                            .map_err(io(format!("writing {}", dir.join(f).display())))?;
                    }
                }
            }
        }
        Ok(cg)
    }

    /// The subtree `/<name>` a process that is gone left in the hierarchies (a killed
    /// lab agent), to take back with [`NodeCgroup::remove`].
    pub fn existing(name: &str) -> Result<NodeCgroup, Error> {
        let hierarchies = hierarchies()?;
        let created = hierarchies.iter().map(|h| h.mount.join(name)).collect();
        Ok(NodeCgroup {
            name: name.to_owned(),
            hierarchies,
            created,
        })
    }

    /// The kubelet's `cgroupRoot` (`/<name>`).
    pub fn root(&self) -> String {
        format!("/{}", self.name)
    }

    /// `cgroup.procs` of `/<name>/system` in every hierarchy.
    fn system_procs(&self) -> Vec<PathBuf> {
        self.hierarchies
            .iter()
            .map(|h| h.mount.join(&self.name).join(SYSTEM).join("cgroup.procs"))
            .collect()
    }

    /// Every pid in the subtree, in any hierarchy.
    pub fn pids(&self) -> Vec<u32> {
        let mut pids = Vec::new();
        for h in &self.hierarchies {
            collect_pids(&h.mount.join(&self.name), &mut pids);
        }
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// SIGKILLs every process in the subtree until none is left (bounded by
    /// `bound`); returns the pids still there.
    pub fn kill_all(&self, bound: Duration) -> Vec<u32> {
        let deadline = Instant::now() + bound;
        loop {
            let pids = self.pids();
            if pids.is_empty() || Instant::now() >= deadline {
                return pids;
            }
            for pid in &pids {
                if let Ok(raw) = i32::try_from(*pid) {
                    // ESRCH if it just exited: fine.
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(raw),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Removes the subtree (deepest first) in every hierarchy, retrying while the
    /// kernel still holds a just-emptied cgroup. Idempotent.
    pub fn remove(&mut self) -> Result<(), Error> {
        let left = self.kill_all(Duration::from_secs(10));
        if !left.is_empty() {
            return Err(Error::Cgroup {
                path: PathBuf::from(self.root()),
                message: format!("processes {left:?} survive SIGKILL"),
            });
        }
        let mut last = None;
        for h in &self.hierarchies {
            let root = h.mount.join(&self.name);
            let mut dirs = Vec::new();
            collect_dirs(&root, &mut dirs);
            // Deepest first.
            dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
            for d in dirs {
                let deadline = Instant::now() + Duration::from_secs(5);
                loop {
                    match std::fs::remove_dir(&d) {
                        Ok(()) => break,
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                        Err(e) if Instant::now() < deadline => {
                            tracing::debug!(path = %d.display(), error = %e, "cgroup busy; retrying");
                            std::thread::sleep(Duration::from_millis(50));
                        }
                        Err(e) => {
                            last = Some(Error::Cgroup {
                                path: d.clone(),
                                message: format!("rmdir: {e}"),
                            });
                            break;
                        }
                    }
                }
            }
        }
        self.created.clear();
        match last {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for NodeCgroup {
    fn drop(&mut self) {
        if !self.created.is_empty()
            && let Err(e) = self.remove()
        {
            tracing::warn!(error = %e, "real node: cgroup left behind");
        }
    }
}

fn collect_dirs(dir: &Path, out: &mut Vec<PathBuf>) {
    if !dir.is_dir() {
        return;
    }
    out.push(dir.to_owned());
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                collect_dirs(&e.path(), out);
            }
        }
    }
}

fn collect_pids(dir: &Path, out: &mut Vec<u32>) {
    let mut dirs = Vec::new();
    collect_dirs(dir, &mut dirs);
    for d in dirs {
        if let Ok(text) = std::fs::read_to_string(d.join("cgroup.procs")) {
            out.extend(text.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
        }
    }
}

/// Cgroups named `name` left in any hierarchy (for leftover checks).
pub fn cgroup_leftovers(name: &str) -> Vec<PathBuf> {
    hierarchies()
        .unwrap_or_default()
        .into_iter()
        .map(|h| h.mount.join(name))
        .filter(|p| p.exists())
        .collect()
}

// --- spawning into a node -------------------------------------------------------------

/// Open handles on a node's namespaces and cgroup, kept while commands are built.
#[derive(Debug)]
pub struct NodeEntry {
    netns: File,
    mntns: File,
    cgroup_procs: Vec<File>,
}

impl NodeEntry {
    /// Opens `/run/netns/<netns>`, the mount namespace's file and the cgroup's
    /// `system/cgroup.procs` files (write-only).
    pub fn open(netns: &Path, mntns: &MountNs, cgroup: &NodeCgroup) -> Result<NodeEntry, Error> {
        let netns_file = File::open(netns).map_err(io(format!("opening {}", netns.display())))?;
        let mntns_file =
            File::open(mntns.file()).map_err(io(format!("opening {}", mntns.file().display())))?;
        let cgroup_procs = cgroup
            .system_procs()
            .iter()
            .map(|p| {
                File::options()
                    .write(true)
                    .open(p)
                    .map_err(io(format!("opening {}", p.display())))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(NodeEntry {
            netns: netns_file,
            mntns: mntns_file,
            cgroup_procs,
        })
    }

    /// Makes `cmd` join the node's cgroup, netns and mount namespace (in that order)
    /// between fork and exec, then `chdir("/")` inside the new mount namespace.
    /// The handles must outlive the spawn (they are borrowed by raw fd).
    pub fn prepare(&self, cmd: &mut Command) {
        let net = self.netns.as_raw_fd();
        let mnt = self.mntns.as_raw_fd();
        let procs: Vec<i32> = self.cgroup_procs.iter().map(|f| f.as_raw_fd()).collect();
        // SAFETY: the closure runs in the forked child before exec and only calls
        // write(2), setns(2) and chdir(2), which are async-signal-safe; it reads the
        // captured fds and a static C string, and allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                for fd in &procs {
                    // "0": the writing process itself (cgroup v1 and v2).
                    if libc::write(*fd, b"0".as_ptr().cast(), 1) != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if libc::setns(net, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::setns(mnt, libc::CLONE_NEWNS) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::chdir(c"/".as_ptr()) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
}

/// Runs `program args` inside the node to completion; Err with its stderr on a
/// non-zero exit.
pub fn run_in_node(entry: &NodeEntry, program: &str, args: &[&str]) -> Result<String, Error> {
    let mut cmd = Command::new(program);
    cmd.args(args).stdin(std::process::Stdio::null());
    entry.prepare(&mut cmd);
    let text = format!("{program} {}", args.join(" "));
    let out = cmd
        .output()
        .map_err(io(format!("running {text} in the node")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(Error::Command {
            cmd: text,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

/// Pids of processes whose mount namespace has inode `ino` (a node's daemons and
/// shims; containers have their own).
pub fn pids_in_mount_ns(ino: u64) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::metadata(format!("/proc/{pid}/ns/mnt")).is_ok_and(|m| m.ino() == ino)
        })
        .collect()
}

// --- global sysctls -------------------------------------------------------------------

/// The machine-wide sysctls a 1.20 kubelet sets at start (`setupKernelTunables`):
/// not per netns, so the lab puts them back as soon as the kubelets are up and again
/// on teardown.
pub const KUBELET_SYSCTLS: [&str; 3] = [
    "vm/overcommit_memory",
    "kernel/panic",
    "kernel/panic_on_oops",
];

/// An exclusive `flock(2)` on the kubelet binary, held by a lab from saving the
/// global sysctls until it has put them back after its kubelets started (and by
/// tests while they read them). Every lab on the machine runs the same cached
/// kubelet, so two labs starting at once take turns instead of one saving the
/// other's kubelet values as the originals; the lock goes with the descriptor, also
/// when the process dies, and no file is created for it.
#[derive(Debug)]
pub struct KubeletStartLock {
    _lock: nix::fcntl::Flock<File>,
}

impl KubeletStartLock {
    /// Takes the lock on `kubelet`, waiting at most `timeout` for another lab.
    pub fn take(kubelet: &Path, timeout: Duration) -> Result<KubeletStartLock, Error> {
        use nix::fcntl::{Flock, FlockArg};
        let t0 = Instant::now();
        let mut file =
            File::open(kubelet).map_err(io(format!("opening {} to lock it", kubelet.display())))?;
        loop {
            match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(lock) => return Ok(KubeletStartLock { _lock: lock }),
                Err((f, nix::errno::Errno::EWOULDBLOCK)) if t0.elapsed() < timeout => {
                    file = f;
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err((_, e)) => {
                    return Err(Error::Node {
                        node: "(all)".into(),
                        message: format!(
                            "cannot lock {} within {timeout:?} ({e}): another lab's kubelets are starting (it holds the lock until they run and the global sysctls are back); retry when it is up",
                            kubelet.display()
                        ),
                    });
                }
            }
        }
    }
}

/// Saved values of [`KUBELET_SYSCTLS`].
#[derive(Debug, Clone)]
pub struct GlobalSysctls {
    saved: Vec<(&'static str, String)>,
}

impl GlobalSysctls {
    pub fn save() -> Result<GlobalSysctls, Error> {
        let saved = KUBELET_SYSCTLS
            .iter()
            .map(|k| {
                let path = format!("/proc/sys/{k}");
                std::fs::read_to_string(&path)
                    .map(|v| (*k, v.trim().to_owned()))
                    .map_err(io(format!("reading {path}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(GlobalSysctls { saved })
    }

    /// Writes back every value that differs; returns `(key, found, restored)` for each.
    pub fn restore(&self) -> Result<Vec<(&'static str, String, String)>, Error> {
        let mut changed = Vec::new();
        for (k, want) in &self.saved {
            let path = format!("/proc/sys/{k}");
            let now = std::fs::read_to_string(&path)
                .map_err(io(format!("reading {path}")))?
                .trim()
                .to_owned();
            if &now != want {
                let mut f = File::options()
                    .write(true)
                    .open(&path)
                    .map_err(io(format!("opening {path}")))?;
                f.write_all(want.as_bytes())
                    .map_err(io(format!("writing {want} to {path}")))?;
                changed.push((*k, now, want.clone()));
            }
        }
        if !changed.is_empty() {
            tracing::info!(?changed, "put back the global sysctls the kubelet changed");
        }
        Ok(changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_v1_v2_and_named_hierarchies_and_tells_cpuset() {
        let mi = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
50 23 0:50 / /other/cg rw - cgroup cgroup rw,pids
";
        let h = parse_cgroup_mounts(mi);
        let mounts: Vec<_> = h.iter().map(|h| h.mount.display().to_string()).collect();
        assert_eq!(
            mounts,
            [
                "/sys/fs/cgroup/cpuset",
                "/sys/fs/cgroup/memory",
                "/sys/fs/cgroup/systemd",
                "/sys/fs/cgroup/unified"
            ]
        );
        assert_eq!(
            h.iter().map(|h| h.cpuset).collect::<Vec<_>>(),
            [true, false, false, false]
        );
    }
}
