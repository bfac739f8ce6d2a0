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
use std::net::IpAddr;
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

#[cfg(test)]
mod tests {
    use super::*;

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
