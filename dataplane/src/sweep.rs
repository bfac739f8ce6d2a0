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
//!
//! I/O: the record file (written atomically: temporary file and rename) and
//! rtnetlink ([`crate::netlink`]).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use crate::netlink::{Netlink, NetlinkError};

/// Name of the record of TUN devices in the runtime directory.
pub const RECORD_NAME: &str = "tuns";

/// One recorded TUN device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedTun {
    /// Its name when it was created.
    pub name: String,
    /// Its interface index.
    pub ifindex: u32,
}

/// Parse the record: one `NAME IFINDEX` per line; lines that do not parse are
/// skipped (a torn write of an older format must not stop the sweep).
pub fn parse_record(text: &str) -> Vec<RecordedTun> {
    text.lines()
        .filter_map(|line| {
            let mut parts = line.split_whitespace();
            let name = parts.next()?;
            let ifindex = parts.next()?.parse().ok()?;
            if parts.next().is_some() || crate::tun::validate_name(name).is_err() {
                return None;
            }
            Some(RecordedTun {
                name: name.to_owned(),
                ifindex,
            })
        })
        .collect()
}

fn format_record(tuns: &[RecordedTun]) -> String {
    tuns.iter()
        .map(|t| format!("{} {}\n", t.name, t.ifindex))
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
    pub fn add(&self, name: &str, ifindex: u32) -> io::Result<()> {
        let _guard = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        let mut tuns = self.read()?;
        tuns.retain(|t| t.ifindex != ifindex);
        tuns.push(RecordedTun {
            name: name.to_owned(),
            ifindex,
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
pub async fn sweep(netlink: &Netlink, record: &Record) -> Result<SweepReport, SweepError> {
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
    record.clear().map_err(record_err)?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trips_and_skips_garbage() {
        let tuns = vec![
            RecordedTun {
                name: "kvpn0".into(),
                ifindex: 7,
            },
            RecordedTun {
                name: "kvab12tun".into(),
                ifindex: 12,
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
        record.add("kvpn0", 5).expect("add");
        record.add("kvpn1", 6).expect("add");
        assert_eq!(record.read().expect("read").len(), 2);
        record.remove(5).expect("remove");
        assert_eq!(
            record.read().expect("read"),
            vec![RecordedTun {
                name: "kvpn1".into(),
                ifindex: 6
            }]
        );
        record.remove(6).expect("remove");
        assert!(!record.path().exists(), "an empty record is no file");
        fs::remove_dir_all(&dir).expect("cleanup");
    }
}
