//! What a root daemon killed with SIGKILL may leave behind, and the sweep that the
//! next daemon of the same runtime directory runs before it creates anything
//! (cases lc-01, lc-02).
//!
//! Scope: one runtime directory and the network namespace the daemon runs in.
//! Tests run many labs side by side, each with its own netns and
//! `KVPN_RUNTIME_DIR`, so the sweep touches only what this runtime directory
//! recorded: the TUN devices listed in `$KVPN_RUNTIME_DIR/tuns` (name and
//! ifindex; a device is deleted only when both still match) and kvpn's routes
//! (protocol 107) through them. Never "every kvpn* device" or "every route of
//! protocol 107" of the machine.
//!
//! What kvpn creates, and what a SIGKILL leaves of it:
//! - TUN devices: not persistent, so the kernel deletes them, with their
//!   addresses and routes, when the killed daemon's descriptors close — unless a
//!   descriptor lives on elsewhere; the record catches that case.
//! - eBPF: the classifier is attached with a TCX link held by a descriptor, and
//!   nothing is pinned in bpffs, so the kernel detaches and frees programs and
//!   maps with the last descriptor. There is nothing to sweep; the tests check it.
//! - nftables: kvpn's laptop side creates no tables.
//! - DNS: resolv.conf (restored from its backup) and hosts-file lines (the
//!   marked block), both in [`crate::dns`]; the daemon's start runs them.
//! - The socket and pid file: [`crate::daemon::RuntimeDir::bind`] replaces a
//!   stale socket nobody answers on.
//! - `kvpn run` sessions' cgroup folders (the cgroup tree is the machine's, not the
//!   network namespace's): listed in `$KVPN_RUNTIME_DIR/run-cgroups`; the sweep
//!   kills what is still in each (`cgroup.kill`) and removes the folder
//!   ([`sweep_run_cgroups`]). Their fwmark rules are swept by the daemon.
//!
//! I/O: the record file (written atomically: temporary file and rename) and
//! rtnetlink ([`crate::netlink`]).

use std::fs;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use crate::netlink::{Netlink, NetlinkError};

/// Name of the record of TUN devices in the runtime directory.
pub const RECORD_NAME: &str = "tuns";

/// Name of the record of `kvpn run` sessions' cgroup folders in the runtime
/// directory, one path per line.
pub const RUN_CGROUPS_NAME: &str = "run-cgroups";

/// How long the sweep waits for a killed run's processes to leave its cgroup.
const CGROUP_KILL_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// One recorded TUN device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedTun {
    /// Its name when it was created.
    pub name: String,
    /// Its interface index.
    pub ifindex: u32,
    /// The session's tunnel IPs on it (none in a record of an older kvpn).
    pub tunnel_ips: Vec<IpAddr>,
}

/// Parse the record: one `NAME IFINDEX [TUNNEL_IP ...]` per line; lines that do
/// not parse are skipped (a torn write of an older format must not stop the
/// sweep).
pub fn parse_record(text: &str) -> Vec<RecordedTun> {
    text.lines()
        .filter_map(|line| {
            let mut parts = line.split_whitespace();
            let name = parts.next()?;
            let ifindex = parts.next()?.parse().ok()?;
            let tunnel_ips = parts
                .map(str::parse)
                .collect::<Result<Vec<IpAddr>, _>>()
                .ok()?;
            if crate::tun::validate_name(name).is_err() {
                return None;
            }
            Some(RecordedTun {
                name: name.to_owned(),
                ifindex,
                tunnel_ips,
            })
        })
        .collect()
}

fn format_record(tuns: &[RecordedTun]) -> String {
    tuns.iter()
        .map(|t| {
            let mut line = format!("{} {}", t.name, t.ifindex);
            for ip in &t.tunnel_ips {
                line.push(' ');
                line.push_str(&ip.to_string());
            }
            line.push('\n');
            line
        })
        .collect()
}

/// The record of this daemon's TUN devices, `$KVPN_RUNTIME_DIR/tuns`.
#[derive(Debug)]
pub struct Record {
    path: PathBuf,
    // Serialises read-modify-write of the file between concurrent Connects.
    lock: Mutex<()>,
}

impl Record {
    /// The record in `runtime_dir`.
    pub fn new(runtime_dir: &Path) -> Self {
        Self {
            path: runtime_dir.join(RECORD_NAME),
            lock: Mutex::new(()),
        }
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The recorded devices (none when the file does not exist).
    pub fn read(&self) -> io::Result<Vec<RecordedTun>> {
        match fs::read_to_string(&self.path) {
            Ok(text) => Ok(parse_record(&text)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }

    fn write(&self, tuns: &[RecordedTun]) -> io::Result<()> {
        if tuns.is_empty() {
            return match fs::remove_file(&self.path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            };
        }
        let tmp = self.path.with_extension("tmp");
        fs::write(&tmp, format_record(tuns))?;
        fs::rename(&tmp, &self.path)
    }

    /// Add a device (before anything goes through it).
    pub fn add(&self, name: &str, ifindex: u32, tunnel_ips: &[IpAddr]) -> io::Result<()> {
        let _guard = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        let mut tuns = self.read()?;
        tuns.retain(|t| t.ifindex != ifindex);
        tuns.push(RecordedTun {
            name: name.to_owned(),
            ifindex,
            tunnel_ips: tunnel_ips.to_vec(),
        });
        self.write(&tuns)
    }

    /// Drop a device (after it was deleted).
    pub fn remove(&self, ifindex: u32) -> io::Result<()> {
        let _guard = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        let mut tuns = self.read()?;
        tuns.retain(|t| t.ifindex != ifindex);
        self.write(&tuns)
    }

    fn cgroups_path(&self) -> PathBuf {
        self.path.with_file_name(RUN_CGROUPS_NAME)
    }

    /// The recorded run cgroup folders (none when the file does not exist). Only
    /// absolute paths of folders named `kvpn-run-*` count.
    pub fn run_cgroups(&self) -> io::Result<Vec<PathBuf>> {
        match fs::read_to_string(self.cgroups_path()) {
            Ok(text) => Ok(text
                .lines()
                .map(PathBuf::from)
                .filter(|p| {
                    p.is_absolute()
                        && p.file_name()
                            .and_then(|n| n.to_str())
                            .is_some_and(|n| n.starts_with("kvpn-run-"))
                })
                .collect()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }

    fn write_run_cgroups(&self, dirs: &[PathBuf]) -> io::Result<()> {
        let path = self.cgroups_path();
        if dirs.is_empty() {
            return match fs::remove_file(&path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            };
        }
        let text: String = dirs.iter().map(|d| format!("{}\n", d.display())).collect();
        let tmp = path.with_extension("tmp");
        fs::write(&tmp, text)?;
        fs::rename(&tmp, &path)
    }

    /// Add a run session's cgroup folder (right after it is made).
    pub fn add_run_cgroup(&self, dir: &Path) -> io::Result<()> {
        let _guard = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        let mut dirs = self.run_cgroups()?;
        dirs.retain(|d| d != dir);
        dirs.push(dir.to_owned());
        self.write_run_cgroups(&dirs)
    }

    /// Drop a run session's cgroup folder (after it was removed).
    pub fn remove_run_cgroup(&self, dir: &Path) -> io::Result<()> {
        let _guard = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        let mut dirs = self.run_cgroups()?;
        dirs.retain(|d| d != dir);
        self.write_run_cgroups(&dirs)
    }

    /// Forget every device (after a sweep).
    fn clear(&self) -> io::Result<()> {
        let _guard = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        self.write(&[])
    }
}

/// What [`sweep`] removed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SweepReport {
    /// TUN devices deleted (`name #ifindex`).
    pub tuns: Vec<String>,
    /// Routes deleted.
    pub routes: usize,
    /// Laptop TCP sockets into those routes that the earlier daemon's session
    /// left on its TUN device's address, destroyed ([`crate::stale_tcp`]): a
    /// download through a killed root daemon ends here instead of hanging until
    /// the next `kvpn connect`.
    pub tcp_reset: u64,
}

/// Why the sweep failed.
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    /// The record cannot be read or cleared.
    #[error("TUN record {path}: {source} — remove the file if the devices in it are gone")]
    Record {
        /// The record file.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// A netlink request failed.
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
}

/// Delete what a killed daemon of `record`'s runtime directory left in this
/// network namespace: its recorded TUN devices that still exist under the same
/// name and ifindex, and kvpn's routes through them; then clear the record. Must
/// run before the daemon creates anything.
pub async fn sweep(
    netlink: &Netlink,
    record: &Record,
    reset_tcp: bool,
) -> Result<SweepReport, SweepError> {
    let record_err = |source| SweepError::Record {
        path: record.path().to_owned(),
        source,
    };
    let recorded = record.read().map_err(record_err)?;
    let mut report = SweepReport::default();
    for tun in &recorded {
        // The ifindex may have been reused by another device since: only a device
        // with the recorded name at the recorded index is ours.
        if netlink.link_index(&tun.name).await? != Some(tun.ifindex) {
            tracing::debug!(name = %tun.name, ifindex = tun.ifindex, "recorded TUN device is gone");
            continue;
        }
        for route in netlink.kvpn_routes(Some(tun.ifindex)).await? {
            match netlink.del_route(route.oif, route.dst).await {
                Ok(()) => report.routes += 1,
                Err(e) if e.errno == Some(libc::ESRCH) => {}
                Err(e) => return Err(e.into()),
            }
        }
        netlink.delete_link(tun.ifindex).await?;
        tracing::info!(name = %tun.name, ifindex = tun.ifindex, "deleted TUN device left by an earlier daemon");
        report.tuns.push(format!("{} #{}", tun.name, tun.ifindex));
    }
    // The killed daemon's TUN devices are gone (closing their fds deleted
    // them) or deleted above, and with them their tunnel IPs: TCP sockets still
    // bound to such an address would hang until their applications' timeouts.
    let dead: Vec<IpAddr> = recorded
        .iter()
        .flat_map(|t| t.tunnel_ips.iter().copied())
        .collect();
    if reset_tcp && !dead.is_empty() {
        report.tcp_reset = crate::stale_tcp::reset_dead_locals(&dead);
    }
    record.clear().map_err(record_err)?;
    Ok(report)
}

/// Whether process `pid` is gone or a zombie (killed, not yet reaped).
fn dead(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
        s.rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z'))
    })
}

/// Stop what a killed daemon's `kvpn run` sessions left in their recorded cgroup
/// folders (`cgroup.kill`, then up to 3 s for them to go) and remove the folders;
/// the folders removed, and what could not be. Clears the record.
///
/// A recorded folder is looked up by its name under `root`, this daemon's view of
/// the cgroup tree: a daemon that sees no cgroup2 mount makes its own
/// (`/tmp/kvpn-cgroup2-<pid>`, [`crate::run_scope`]), which went with the killed
/// daemon's mount namespace; its empty mount point is removed too.
pub async fn sweep_run_cgroups(record: &Record, root: &Path) -> (Vec<PathBuf>, Vec<String>) {
    let dirs = match record.run_cgroups() {
        Ok(d) => d,
        Err(e) => {
            return (
                Vec::new(),
                vec![format!(
                    "run cgroup record {}: {e}",
                    record.cgroups_path().display()
                )],
            );
        }
    };
    let (mut removed, mut failed) = (Vec::new(), Vec::new());
    for recorded in dirs {
        if let Some(parent) = recorded.parent()
            && let Some(pid) = parent
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_prefix("kvpn-cgroup2-"))
                .and_then(|p| p.parse::<u32>().ok())
            && pid != std::process::id()
            && dead(pid)
        {
            // Empty here (the mount was in the dead daemon's namespace); a
            // failure only leaves an empty folder.
            let _ = fs::remove_dir(parent);
        }
        let Some(name) = recorded.file_name() else {
            continue;
        };
        let dir = root.join(name);
        if !dir.exists() {
            continue;
        }
        let populated = || {
            fs::read_to_string(dir.join("cgroup.events"))
                .ok()
                .is_some_and(|e| e.lines().any(|l| l.trim() == "populated 1"))
        };
        if populated() {
            if let Err(e) = fs::write(dir.join("cgroup.kill"), "1") {
                failed.push(format!(
                    "cannot kill the processes of {}: {e}",
                    dir.display()
                ));
            }
            let deadline = std::time::Instant::now() + CGROUP_KILL_WAIT;
            while populated() && std::time::Instant::now() < deadline {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
        match fs::remove_dir(&dir) {
            Ok(()) => {
                tracing::info!(cgroup = %dir.display(), "removed a run cgroup left by an earlier daemon");
                removed.push(dir);
            }
            Err(e) => failed.push(format!("cannot remove {}: {e}", dir.display())),
        }
    }
    if failed.is_empty()
        && let Err(e) = record.write_run_cgroups(&[])
    {
        failed.push(format!(
            "cannot clear {}: {e}",
            record.cgroups_path().display()
        ));
    }
    (removed, failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_cgroup_record_keeps_only_kvpn_run_folders() {
        let dir = std::env::temp_dir().join(format!("kvpn-sweep-cg-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("dir");
        let record = Record::new(&dir);
        let a = Path::new("/sys/fs/cgroup/kvpn-run-abc");
        let b = Path::new("/sys/fs/cgroup/unified/kvpn-run-def");
        record.add_run_cgroup(a).expect("add a");
        record.add_run_cgroup(b).expect("add b");
        record.add_run_cgroup(a).expect("add a again");
        assert_eq!(
            record.run_cgroups().expect("read"),
            vec![b.to_owned(), a.to_owned()]
        );
        record.remove_run_cgroup(b).expect("remove b");
        assert_eq!(record.run_cgroups().expect("read"), vec![a.to_owned()]);
        // A tampered line naming anything but a kvpn-run-* folder is not swept.
        fs::write(
            dir.join(RUN_CGROUPS_NAME),
            "/sys/fs/cgroup/system.slice\nrelative/kvpn-run-x\n/sys/fs/cgroup/kvpn-run-y\n",
        )
        .expect("write");
        assert_eq!(
            record.run_cgroups().expect("read"),
            vec![PathBuf::from("/sys/fs/cgroup/kvpn-run-y")]
        );
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn record_round_trips_and_skips_garbage() {
        let tuns = vec![
            RecordedTun {
                name: "kvpn0".into(),
                ifindex: 7,
                tunnel_ips: vec![
                    "100.96.0.2".parse().expect("ip"),
                    "fd00:100:96::2".parse().expect("ip"),
                ],
            },
            RecordedTun {
                name: "kvab12tun".into(),
                ifindex: 12,
                tunnel_ips: Vec::new(),
            },
        ];
        let text = format_record(&tuns);
        assert_eq!(parse_record(&text), tuns);
        let noisy = format!("{text}garbage\nkvpn1 notanumber\nkvpn2 3 extra\n/bad 4\n");
        assert_eq!(parse_record(&noisy), tuns);
    }

    #[test]
    fn record_file_add_remove() {
        let dir = std::env::temp_dir().join(format!("kvpn-sweep-unit-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("dir");
        let record = Record::new(&dir);
        record.add("kvpn0", 5, &[]).expect("add");
        let ip: IpAddr = "100.96.0.3".parse().expect("ip");
        record.add("kvpn1", 6, &[ip]).expect("add");
        assert_eq!(record.read().expect("read").len(), 2);
        record.remove(5).expect("remove");
        assert_eq!(
            record.read().expect("read"),
            vec![RecordedTun {
                name: "kvpn1".into(),
                ifindex: 6,
                tunnel_ips: vec![ip],
            }]
        );
        record.remove(6).expect("remove");
        assert!(!record.path().exists(), "an empty record is no file");
        fs::remove_dir_all(&dir).expect("cleanup");
    }
}
