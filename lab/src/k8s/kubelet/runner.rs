//! Runs one container of a pod as a local process: inside the pod's netns, in a mount
//! namespace of its own where the pod's volumes, `resolv.conf` and `hosts` appear at
//! the paths the pod spec names, with the pod's hostname (UTS namespace), its own
//! process group, stdout+stderr in a log file, and `PR_SET_PDEATHSIG` so it dies with
//! the kubelet stand-in.
//!
//! Mount paths that do not exist on the machine (e.g. `/var/run/secrets/kubernetes.io/
//! serviceaccount`, `/etc/kvpn/tls`) are made without touching the machine's file
//! system: the nearest existing ancestor folder gets an overlayfs whose upper layer is
//! a tmpfs that exists only in the container's mount namespace, the missing folders are
//! created there, and the volume is bind-mounted on top. Mount paths directly below `/`
//! that do not exist cannot be made this way (overlaying `/` would hide `/proc`, `/dev`,
//! …) and fail the container with `CreateContainerError`.
//!
//! [`plan_mounts`] is pure (the file system is asked through [`HostFs`]); [`launch`]
//! does the I/O: a runner thread per process forks it, the child sets itself up in a
//! `pre_exec` hook with raw system calls on buffers prepared before the fork (no
//! allocation after fork), and the thread waits for the exit, kills what is left of
//! the process group and reports the exit status.

use std::ffi::{CString, OsString};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd as _;
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
use std::path::{Component, Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::sync::oneshot;

/// What kind of file a path is on the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    Dir,
    File,
}

/// The file-system questions [`plan_mounts`] asks.
pub trait HostFs {
    /// Kind of `path` after following symlinks, or None if it does not exist.
    fn kind(&self, path: &Path) -> Option<FileKind>;
    /// `path` with symlinks resolved.
    fn canonical(&self, path: &Path) -> Option<PathBuf>;
}

/// The real file system.
#[derive(Debug, Clone, Copy, Default)]
pub struct RealFs;

impl HostFs for RealFs {
    fn kind(&self, path: &Path) -> Option<FileKind> {
        let m = std::fs::metadata(path).ok()?;
        Some(if m.is_dir() {
            FileKind::Dir
        } else {
            FileKind::File
        })
    }

    fn canonical(&self, path: &Path) -> Option<PathBuf> {
        std::fs::canonicalize(path).ok()
    }
}

/// One thing to mount into the container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountRequest {
    /// Folder or file on the machine (a volume folder under the pod folder, a hostPath).
    pub source: PathBuf,
    /// Absolute path inside the container.
    pub target: PathBuf,
    pub source_is_file: bool,
    pub read_only: bool,
    /// A failure is logged and skipped instead of failing the container (the
    /// automatic service-account token mount).
    pub optional: bool,
    /// For messages, e.g. `volume "tls"`.
    pub what: String,
}

/// One mount system call or helper step, run in the child.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Tmpfs {
        target: PathBuf,
    },
    Mkdir {
        path: PathBuf,
    },
    Touch {
        path: PathBuf,
    },
    Overlay {
        target: PathBuf,
        upper: PathBuf,
        work: PathBuf,
    },
    Bind {
        source: PathBuf,
        target: PathBuf,
    },
    RemountReadOnly {
        target: PathBuf,
    },
}

/// Steps that succeed or fail together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountGroup {
    pub what: String,
    pub optional: bool,
    /// Index of an earlier group that must have succeeded (the overlay under it).
    pub depends_on: Option<usize>,
    pub steps: Vec<Step>,
}

fn normalize_absolute(p: &Path) -> Option<PathBuf> {
    if !p.is_absolute() {
        return None;
    }
    let mut out = PathBuf::from("/");
    for c in p.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(n) => out.push(n),
            Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// Plans the mount steps for `requests`; `staging` is an empty folder (under the pod
/// folder) for the overlays' tmpfs mounts. Errors name the first request that cannot be
/// mounted and is not optional.
pub fn plan_mounts(
    requests: &[MountRequest],
    staging: &Path,
    fs: &impl HostFs,
) -> Result<Vec<MountGroup>, String> {
    struct Planned<'a> {
        req: &'a MountRequest,
        target: PathBuf,
        /// (overlay root, components to create below it) when the target is missing.
        missing: Option<(PathBuf, Vec<PathBuf>)>,
        /// Created inside an earlier request's target.
        nested: Option<PathBuf>,
    }
    let mut sorted: Vec<&MountRequest> = requests.iter().collect();
    sorted.sort_by_key(|r| r.target.components().count());
    let mut planned: Vec<Planned<'_>> = Vec::new();
    let mut skipped: Vec<String> = Vec::new();
    for req in sorted {
        let fail = |why: String, skipped: &mut Vec<String>| -> Result<(), String> {
            let msg = format!("{} at {}: {why}", req.what, req.target.display());
            if req.optional {
                skipped.push(msg);
                Ok(())
            } else {
                Err(msg)
            }
        };
        let Some(target) = normalize_absolute(&req.target) else {
            fail(
                "mount path must be absolute without `..`".into(),
                &mut skipped,
            )?;
            continue;
        };
        if let Some(parent) = planned
            .iter()
            .rev()
            .find(|p| target.starts_with(&p.target) && target != p.target)
        {
            let nested = parent.target.clone();
            planned.push(Planned {
                req,
                target,
                missing: None,
                nested: Some(nested),
            });
            continue;
        }
        let want = if req.source_is_file {
            FileKind::File
        } else {
            FileKind::Dir
        };
        let mut ancestor = target.clone();
        let mut below: Vec<PathBuf> = Vec::new();
        let found = loop {
            if let Some(kind) = fs.kind(&ancestor) {
                break Some(kind);
            }
            let Some(name) = ancestor.file_name().map(PathBuf::from) else {
                break None;
            };
            below.insert(0, name);
            if !ancestor.pop() {
                break None;
            }
        };
        match found {
            Some(kind) if below.is_empty() => {
                if kind != want {
                    fail(
                        format!("exists on the machine as a {kind:?}, the volume is a {want:?}"),
                        &mut skipped,
                    )?;
                    continue;
                }
                planned.push(Planned {
                    req,
                    target,
                    missing: None,
                    nested: None,
                });
            }
            Some(FileKind::Dir) if ancestor != Path::new("/") => {
                let root = fs.canonical(&ancestor).unwrap_or(ancestor);
                let mut paths = Vec::new();
                let mut p = root.clone();
                for c in &below {
                    p.push(c);
                    paths.push(p.clone());
                }
                planned.push(Planned {
                    req,
                    target: p,
                    missing: Some((root, paths)),
                    nested: None,
                });
            }
            Some(FileKind::Dir) => {
                fail(
                    "its top-level folder does not exist on this machine; the kvpn lab kubelet stand-in can only create mount paths below an existing top-level folder (/etc, /var, /run, /opt, …)".into(),
                    &mut skipped,
                )?;
                continue;
            }
            _ => {
                fail(
                    format!("{} is a file, not a folder", ancestor.display()),
                    &mut skipped,
                )?;
                continue;
            }
        }
    }
    // Overlay roots: the minimal set covering every missing target, parents first so a
    // later overlay never hides an earlier one.
    let mut roots: Vec<PathBuf> = planned
        .iter()
        .filter_map(|p| p.missing.as_ref().map(|(r, _)| r.clone()))
        .collect();
    roots.sort_by_key(|r| r.components().count());
    roots.dedup();
    let mut minimal: Vec<PathBuf> = Vec::new();
    for r in roots {
        if !minimal.iter().any(|m| r.starts_with(m)) {
            minimal.push(r);
        }
    }
    let mut groups = Vec::new();
    for (i, root) in minimal.iter().enumerate() {
        let stage = staging.join(format!("overlay-{i}"));
        let optional = planned.iter().all(|p| {
            p.req.optional || !p.missing.as_ref().is_some_and(|(r, _)| r.starts_with(root))
        });
        groups.push(MountGroup {
            what: format!("overlay on {}", root.display()),
            optional,
            depends_on: None,
            steps: vec![
                // The staging folder lives in the pod folder (ours); the tmpfs on it
                // exists only in the container's mount namespace.
                Step::Mkdir {
                    path: stage.clone(),
                },
                Step::Tmpfs {
                    target: stage.clone(),
                },
                Step::Mkdir {
                    path: stage.join("upper"),
                },
                Step::Mkdir {
                    path: stage.join("work"),
                },
                Step::Overlay {
                    target: root.clone(),
                    upper: stage.join("upper"),
                    work: stage.join("work"),
                },
            ],
        });
    }
    let mut read_only = Vec::new();
    for p in &planned {
        let mut steps = Vec::new();
        let mut depends_on = None;
        let create_last = |steps: &mut Vec<Step>, path: &Path| {
            steps.push(if p.req.source_is_file {
                Step::Touch {
                    path: path.to_owned(),
                }
            } else {
                Step::Mkdir {
                    path: path.to_owned(),
                }
            });
        };
        if let Some((root, paths)) = &p.missing {
            depends_on = minimal.iter().position(|m| root.starts_with(m));
            if let Some((last, dirs)) = paths.split_last() {
                for d in dirs {
                    steps.push(Step::Mkdir { path: d.clone() });
                }
                create_last(&mut steps, last);
            }
        } else if let Some(parent) = &p.nested {
            let mut cur = parent.clone();
            let rest: Vec<_> = p
                .target
                .strip_prefix(parent)
                .map(|r| r.components().map(|c| c.as_os_str().to_owned()).collect())
                .unwrap_or_default();
            if let Some((last, dirs)) = rest.split_last() {
                for d in dirs {
                    cur.push(d);
                    steps.push(Step::Mkdir { path: cur.clone() });
                }
                cur.push(last);
                create_last(&mut steps, &cur);
            }
        }
        steps.push(Step::Bind {
            source: p.req.source.clone(),
            target: p.target.clone(),
        });
        let index = groups.len();
        groups.push(MountGroup {
            what: format!("{} at {}", p.req.what, p.req.target.display()),
            optional: p.req.optional,
            depends_on,
            steps,
        });
        if p.req.read_only {
            read_only.push(MountGroup {
                what: format!("{} read-only", p.req.what),
                optional: p.req.optional,
                depends_on: Some(index),
                steps: vec![Step::RemountReadOnly {
                    target: p.target.clone(),
                }],
            });
        }
    }
    groups.extend(read_only);
    for s in skipped {
        tracing::warn!(mount = %s, "optional mount skipped");
    }
    Ok(groups)
}

/// Everything needed to start one container process.
#[derive(Debug, Clone)]
pub struct Launch {
    /// Absolute path, or a name looked up on the container's `PATH`.
    pub program: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub working_dir: Option<PathBuf>,
    /// `/run/netns/<pod netns>`.
    pub netns: PathBuf,
    pub hostname: String,
    pub mounts: Vec<MountGroup>,
    /// Appended to; created if missing.
    pub log: PathBuf,
}

/// A started container process.
#[derive(Debug)]
pub struct Running {
    pub pid: u32,
    /// Resolves once the process has exited and its group was killed.
    pub exit_rx: oneshot::Receiver<ExitStatus>,
}

/// Sends `signal` to the container's process group. Only called while the group
/// leader has not been reaped (the runner thread reaps it after killing the group), so
/// the group id cannot belong to anyone else.
pub fn signal_group(pid: u32, signal: Signal) {
    if let Ok(pid) = i32::try_from(pid) {
        // ESRCH: already gone, which is the goal.
        let _ = killpg(Pid::from_raw(pid), signal);
    }
}

/// Starts the process on a runner thread (see the module docs). Errors are spawn
/// errors: the program does not exist, or a required mount failed (then the log holds
/// the failing step).
pub async fn launch(l: Launch) -> io::Result<Running> {
    let (started_tx, started_rx) = oneshot::channel::<io::Result<u32>>();
    let (exit_tx, exit_rx) = oneshot::channel::<ExitStatus>();
    let name = format!(
        "kvpn-pod-{}",
        l.hostname.chars().take(6).collect::<String>()
    );
    std::thread::Builder::new()
        .name(name)
        .spawn(move || run_thread(l, started_tx, exit_tx))
        .map_err(|e| io::Error::other(format!("cannot start a runner thread: {e}")))?;
    let pid = started_rx
        .await
        .map_err(|_| io::Error::other("runner thread ended without starting the process"))??;
    Ok(Running { pid, exit_rx })
}

fn run_thread(
    l: Launch,
    started_tx: oneshot::Sender<io::Result<u32>>,
    exit_tx: oneshot::Sender<ExitStatus>,
) {
    let mut child = match spawn(&l) {
        Ok(c) => c,
        Err(e) => {
            let _ = started_tx.send(Err(e));
            return;
        }
    };
    let pid = child.id();
    let _ = started_tx.send(Ok(pid));
    // Wait without reaping, kill the rest of the group while the leader's pid still
    // pins the group id, then reap.
    let raw = nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap_or(i32::MAX));
    let _ = nix::sys::wait::waitid(
        nix::sys::wait::Id::Pid(raw),
        nix::sys::wait::WaitPidFlag::WEXITED | nix::sys::wait::WaitPidFlag::WNOWAIT,
    );
    signal_group(pid, Signal::SIGKILL);
    let status = child
        .wait()
        .unwrap_or_else(|_| ExitStatus::from_raw(255 << 8));
    let _ = exit_tx.send(status);
}

/// A string prepared before fork for use after it.
fn cstr(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

enum ChildStep {
    Tmpfs(CString),
    Mkdir(CString),
    Touch(CString),
    Overlay(CString, CString),
    Bind(CString, CString),
    RemountReadOnly(CString),
}

struct ChildGroup {
    optional: bool,
    depends_on: Option<usize>,
    /// "kvpn kubelet stand-in: <what>: failed (errno " — written on failure.
    failure_prefix: Vec<u8>,
    steps: Vec<ChildStep>,
}

fn prepare(groups: &[MountGroup]) -> io::Result<Vec<ChildGroup>> {
    groups
        .iter()
        .map(|g| {
            let steps = g
                .steps
                .iter()
                .map(|s| {
                    Ok(match s {
                        Step::Tmpfs { target } => ChildStep::Tmpfs(cstr(target)?),
                        Step::Mkdir { path } => ChildStep::Mkdir(cstr(path)?),
                        Step::Touch { path } => ChildStep::Touch(cstr(path)?),
                        Step::Overlay {
                            target,
                            upper,
                            work,
                        } => {
                            let opts = format!(
                                "lowerdir={},upperdir={},workdir={}",
                                target.display(),
                                upper.display(),
                                work.display()
                            );
                            if [target, upper, work]
                                .iter()
                                .any(|p| p.as_os_str().as_bytes().contains(&b','))
                            {
                                return Err(io::Error::new(
                                    io::ErrorKind::InvalidInput,
                                    "overlay paths must not contain `,`",
                                ));
                            }
                            ChildStep::Overlay(
                                cstr(target)?,
                                CString::new(opts).map_err(|_| {
                                    io::Error::new(io::ErrorKind::InvalidInput, "NUL in path")
                                })?,
                            )
                        }
                        Step::Bind { source, target } => {
                            ChildStep::Bind(cstr(source)?, cstr(target)?)
                        }
                        Step::RemountReadOnly { target } => {
                            ChildStep::RemountReadOnly(cstr(target)?)
                        }
                    })
                })
                .collect::<io::Result<Vec<_>>>()?;
            Ok(ChildGroup {
                optional: g.optional,
                depends_on: g.depends_on,
                failure_prefix: format!(
                    "kvpn lab kubelet stand-in: {}{}: failed (errno ",
                    g.what,
                    if g.optional {
                        " (optional, skipped)"
                    } else {
                        ""
                    }
                )
                .into_bytes(),
                steps,
            })
        })
        .collect()
}

/// Runs one step in the child. Only system calls on prepared buffers.
fn run_step(step: &ChildStep) -> Result<(), i32> {
    let errno = || io::Error::last_os_error().raw_os_error().unwrap_or(0);
    let null = std::ptr::null::<libc::c_char>();
    // SAFETY: every pointer is a NUL-terminated string prepared before fork or null
    // where the system call allows it.
    let rc = unsafe {
        match step {
            ChildStep::Tmpfs(t) => libc::mount(
                c"tmpfs".as_ptr(),
                t.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                c"mode=0755,size=16m".as_ptr().cast(),
            ),
            ChildStep::Mkdir(p) => {
                let rc = libc::mkdir(p.as_ptr(), 0o755);
                if rc != 0 && errno() == libc::EEXIST {
                    0
                } else {
                    rc
                }
            }
            ChildStep::Touch(p) => {
                let fd = libc::open(
                    p.as_ptr(),
                    libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                    0o644,
                );
                if fd >= 0 {
                    libc::close(fd);
                    0
                } else {
                    -1
                }
            }
            ChildStep::Overlay(t, opts) => libc::mount(
                c"overlay".as_ptr(),
                t.as_ptr(),
                c"overlay".as_ptr(),
                0,
                opts.as_ptr().cast(),
            ),
            ChildStep::Bind(s, t) => libc::mount(
                s.as_ptr(),
                t.as_ptr(),
                null,
                libc::MS_BIND | libc::MS_REC,
                std::ptr::null(),
            ),
            ChildStep::RemountReadOnly(t) => libc::mount(
                null,
                t.as_ptr(),
                null,
                libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY,
                std::ptr::null(),
            ),
        }
    };
    if rc == 0 { Ok(()) } else { Err(errno()) }
}

/// Writes `prefix<errno>)\n` to stderr (the container log) without allocating.
fn report(prefix: &[u8], errno: i32) {
    let mut digits = [0u8; 12];
    let mut n = errno.unsigned_abs();
    let mut i = digits.len();
    loop {
        i -= 1;
        // n % 10 < 10 fits u8.
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 || i == 0 {
            break;
        }
    }
    // SAFETY: writes from valid buffers to fd 2; errors are irrelevant here.
    unsafe {
        libc::write(2, prefix.as_ptr().cast(), prefix.len());
        libc::write(2, digits[i..].as_ptr().cast(), digits.len() - i);
        libc::write(2, b")\n".as_ptr().cast(), 2);
    }
}

fn spawn(l: &Launch) -> io::Result<std::process::Child> {
    let netns = File::open(&l.netns)
        .map_err(|e| io::Error::new(e.kind(), format!("open {}: {e}", l.netns.display())))?;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&l.log)
        .map_err(|e| io::Error::new(e.kind(), format!("open {}: {e}", l.log.display())))?;
    let log2 = log.try_clone()?;
    let groups = prepare(&l.mounts)?;
    let hostname = l.hostname.clone().into_bytes();
    let workdir = l.working_dir.as_deref().map(cstr).transpose()?;
    let netns_fd = netns.as_raw_fd();
    let parent = std::process::id();

    let mut cmd = Command::new(&l.program);
    cmd.args(&l.args)
        .env_clear()
        .envs(
            l.env
                .iter()
                .map(|(k, v)| (OsString::from(k), OsString::from(v))),
        )
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2)
        .process_group(0);
    let mut failed = vec![false; groups.len()];
    // SAFETY: the hook only makes system calls on buffers allocated before fork
    // (prepare() above) and writes to `failed`, which was sized before fork.
    unsafe {
        cmd.pre_exec(move || {
            // Die with the runner thread (and so with the kubelet stand-in).
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0
                || libc::getppid() != i32::try_from(parent).unwrap_or(-1)
            {
                return Err(io::Error::other("parent gone"));
            }
            if libc::setns(netns_fd, libc::CLONE_NEWNET) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWUTS) != 0 {
                return Err(io::Error::last_os_error());
            }
            // Nothing mounted from here on may propagate back to the machine.
            if libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            // /sys showing the pod's interfaces, as `ip netns exec` does; optional.
            if libc::umount2(c"/sys".as_ptr(), libc::MNT_DETACH) == 0 {
                libc::mount(
                    c"sysfs".as_ptr(),
                    c"/sys".as_ptr(),
                    c"sysfs".as_ptr(),
                    0,
                    std::ptr::null(),
                );
            }
            libc::sethostname(hostname.as_ptr().cast(), hostname.len());
            for (i, g) in groups.iter().enumerate() {
                if g.depends_on
                    .is_some_and(|d| failed.get(d).copied().unwrap_or(true))
                {
                    failed[i] = true;
                    continue;
                }
                for step in &g.steps {
                    if let Err(errno) = run_step(step) {
                        report(&g.failure_prefix, errno);
                        if !g.optional {
                            return Err(io::Error::from_raw_os_error(errno));
                        }
                        failed[i] = true;
                        break;
                    }
                }
            }
            if let Some(dir) = &workdir
                && libc::chdir(dir.as_ptr()) != 0
            {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn();
    drop(netns);
    child
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    struct FakeFs(BTreeMap<PathBuf, FileKind>, BTreeMap<PathBuf, PathBuf>);

    impl HostFs for FakeFs {
        fn kind(&self, path: &Path) -> Option<FileKind> {
            self.0.get(path).copied()
        }
        fn canonical(&self, path: &Path) -> Option<PathBuf> {
            Some(self.1.get(path).cloned().unwrap_or_else(|| path.to_owned()))
        }
    }

    fn fs() -> FakeFs {
        let dirs = ["/", "/etc", "/var", "/var/run", "/run", "/opt"];
        let mut m: BTreeMap<PathBuf, FileKind> = dirs
            .iter()
            .map(|d| (PathBuf::from(d), FileKind::Dir))
            .collect();
        m.insert("/etc/resolv.conf".into(), FileKind::File);
        FakeFs(
            m,
            [(PathBuf::from("/var/run"), PathBuf::from("/run"))].into(),
        )
    }

    fn req(target: &str, optional: bool) -> MountRequest {
        MountRequest {
            source: PathBuf::from(format!("/pod/volumes{target}")),
            target: target.into(),
            source_is_file: false,
            read_only: true,
            optional,
            what: format!("volume {target}"),
        }
    }

    #[test]
    fn missing_mount_paths_get_an_overlay_on_the_nearest_folder() {
        let reqs = vec![
            req("/var/run/secrets/kubernetes.io/serviceaccount", true),
            req("/etc/kvpn/tls", false),
            MountRequest {
                source: "/pod/resolv.conf".into(),
                target: "/etc/resolv.conf".into(),
                source_is_file: true,
                read_only: false,
                optional: false,
                what: "resolv.conf".into(),
            },
        ];
        let g = plan_mounts(&reqs, Path::new("/pod/stage"), &fs()).expect("plan");
        let overlays: Vec<&MountGroup> =
            g.iter().filter(|g| g.what.starts_with("overlay")).collect();
        assert_eq!(overlays.len(), 2, "{g:#?}");
        assert!(
            g.iter().any(|g| g.steps.contains(&Step::Overlay {
                target: "/run".into(),
                upper: "/pod/stage/overlay-0/upper".into(),
                work: "/pod/stage/overlay-0/work".into()
            }) || g.steps.contains(&Step::Overlay {
                target: "/run".into(),
                upper: "/pod/stage/overlay-1/upper".into(),
                work: "/pod/stage/overlay-1/work".into()
            })),
            "{g:#?}"
        );
        let sa = g
            .iter()
            .find(|g| g.what.contains("serviceaccount at"))
            .expect("sa");
        assert!(sa.optional);
        assert_eq!(
            sa.steps,
            vec![
                Step::Mkdir {
                    path: "/run/secrets".into()
                },
                Step::Mkdir {
                    path: "/run/secrets/kubernetes.io".into()
                },
                Step::Mkdir {
                    path: "/run/secrets/kubernetes.io/serviceaccount".into()
                },
                Step::Bind {
                    source: "/pod/volumes/var/run/secrets/kubernetes.io/serviceaccount".into(),
                    target: "/run/secrets/kubernetes.io/serviceaccount".into()
                },
            ]
        );
        let dep = sa.depends_on.expect("depends on its overlay");
        assert!(g[dep].what == "overlay on /run" && g[dep].optional);
        let etc = g
            .iter()
            .find(|g| g.what == "overlay on /etc")
            .expect("etc overlay");
        assert!(!etc.optional, "a required mount needs it");
        let resolv = g
            .iter()
            .find(|g| g.what.starts_with("resolv.conf at"))
            .expect("resolv");
        assert_eq!(
            resolv.steps,
            vec![Step::Bind {
                source: "/pod/resolv.conf".into(),
                target: "/etc/resolv.conf".into()
            }]
        );
        // Read-only remounts come after every bind.
        let first_ro = g
            .iter()
            .position(|g| g.what.ends_with("read-only"))
            .expect("ro");
        assert!(g[first_ro..].iter().all(|g| g.what.ends_with("read-only")));
    }

    #[test]
    fn nested_and_impossible_mount_paths() {
        let reqs = vec![req("/opt/app", false), req("/opt/app/cache/x", false)];
        let g = plan_mounts(&reqs, Path::new("/s"), &fs()).expect("plan");
        let nested = g
            .iter()
            .find(|g| g.what.contains("/opt/app/cache/x at"))
            .expect("nested");
        assert_eq!(nested.depends_on, None);
        assert_eq!(
            nested.steps[..2],
            [
                Step::Mkdir {
                    path: "/opt/app/cache".into()
                },
                Step::Mkdir {
                    path: "/opt/app/cache/x".into()
                }
            ]
        );
        let err =
            plan_mounts(&[req("/data", false)], Path::new("/s"), &fs()).expect_err("top level");
        assert!(err.contains("/data") && err.contains("top-level"), "{err}");
        assert!(
            plan_mounts(&[req("/data", true)], Path::new("/s"), &fs())
                .expect("optional")
                .is_empty()
        );
        let err = plan_mounts(&[req("/etc/resolv.conf/x", false)], Path::new("/s"), &fs())
            .expect_err("file");
        assert!(err.contains("is a file"), "{err}");
        let err =
            plan_mounts(&[req("/etc/../x", false)], Path::new("/s"), &fs()).expect_err("dots");
        assert!(err.contains("absolute"), "{err}");
    }
}
