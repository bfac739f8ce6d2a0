//! Optional hosts-file entries for the connected namespace's Services (case dns-07),
//! for programs that read the hosts file but not the DNS (or not its search list).
//! Off unless `kvpn connect --hosts` asks for it.
//!
//! kvpn appends one marked block to the hosts file (env `KVPN_HOSTS`, default
//! `/etc/hosts`) and never changes a byte outside it: a file without a trailing
//! newline gets one line break before the block, and the begin marker says so, so
//! that removing the block gives back exactly the original bytes (also CRLF line
//! ends, tabs, any non-UTF-8 bytes). The block uses the file's own line ends and
//! comes last, so the laptop's own entries for the same names win (the resolver
//! takes the first match).
//!
//! ```text
//! # >>> kvpn: cluster Services, removed when kvpn disconnects >>>
//! 10.96.0.100<TAB>web web.dev web.dev.svc web.dev.svc.cluster.local
//! # <<< kvpn <<<
//! ```
//!
//! Like resolv.conf ([`super::resolv_conf`]), the file's state before kvpn wrote it
//! goes to a backup in `$KVPN_RUNTIME_DIR` first. Restoring (at the last session's
//! end, or at the next daemon start after a crash) gives back the exact original
//! when the file is still what kvpn wrote; if somebody edited it meanwhile, only
//! kvpn's block is cut out and their edits stay. A block without a backup (the
//! runtime directory is a tmpfs that a reboot emptied) is cut out too.
//!
//! Pure: [`entries_for`], [`add_block`], [`remove_block`]. I/O: [`HostsFile`].

use std::fs;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use kvpn_proto::dataplane::ClusterService;

use super::resolv_conf::{self, Kind, ResolvConf, ResolvConfError, Restored};

/// Default path (env `KVPN_HOSTS` overrides it).
pub const DEFAULT_PATH: &str = "/etc/hosts";
/// Backup file name in the runtime directory.
pub const BACKUP_NAME: &str = "hosts.kvpn-backup";
/// First line of kvpn's block when the file ended with a line break (or was empty).
pub const BEGIN: &str = "# >>> kvpn: cluster Services, removed when kvpn disconnects >>>";
/// First line of kvpn's block when kvpn had to end the file's last line first.
pub const BEGIN_AFTER_BREAK: &str =
    "# >>> kvpn: cluster Services, removed when kvpn disconnects (kvpn ended the line above) >>>";
/// Last line of kvpn's block.
pub const END: &str = "# <<< kvpn <<<";

/// One hosts-file line: an address and its names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostEntry {
    /// The ClusterIP.
    pub ip: IpAddr,
    /// Host names, the short one first.
    pub names: Vec<String>,
}

/// A DNS label as Kubernetes allows it for namespaces and Service names (RFC 1123:
/// lower-case letters, digits, `-`, 1–63 bytes, no `-` at either end). Anything
/// else is never written to the hosts file (the names come from the network).
fn is_label(s: &str) -> bool {
    (1..=63).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_domain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_label)
}

/// The namespace a search list is connected to: `dev` for a first entry
/// `dev.svc.<domain>`.
pub fn connected_namespace(search: &[String], domain: &str) -> Option<String> {
    let first = search.first()?.trim_end_matches('.');
    let ns = first.strip_suffix(&format!(".svc.{}", domain.trim_end_matches('.')))?;
    is_label(ns).then(|| ns.to_owned())
}

/// Hosts-file entries for the Services of `namespace`: each ClusterIP with the
/// names `svc`, `svc.ns`, `svc.ns.svc` and `svc.ns.svc.<domain>`. Headless
/// Services (no ClusterIP) and names or addresses that are not valid are skipped;
/// sorted by name, then address.
pub fn entries_for<'a>(
    namespace: &str,
    domain: &str,
    services: impl IntoIterator<Item = &'a ClusterService>,
) -> Vec<HostEntry> {
    let domain = domain.trim_end_matches('.');
    if !is_label(namespace) || !is_domain(domain) {
        return Vec::new();
    }
    let mut out: Vec<HostEntry> = services
        .into_iter()
        .filter(|s| s.namespace == namespace && is_label(&s.name))
        .flat_map(|s| {
            s.cluster_ips
                .iter()
                .filter_map(|ip| ip.parse::<IpAddr>().ok())
                .map(|ip| HostEntry {
                    ip,
                    names: vec![
                        s.name.clone(),
                        format!("{}.{namespace}", s.name),
                        format!("{}.{namespace}.svc", s.name),
                        format!("{}.{namespace}.svc.{domain}", s.name),
                    ],
                })
                .collect::<Vec<_>>()
        })
        .collect();
    out.sort_by(|a, b| a.names.cmp(&b.names).then(a.ip.cmp(&b.ip)));
    out.dedup();
    out
}

/// Where kvpn's block is: byte range to cut (including the line break kvpn added
/// before it, if any).
fn find_block(bytes: &[u8]) -> Option<std::ops::Range<usize>> {
    let mut pos = 0;
    let mut begin: Option<(usize, bool, &'static [u8])> = None;
    while pos < bytes.len() {
        let end = bytes[pos..]
            .iter()
            .position(|b| *b == b'\n')
            .map_or(bytes.len(), |i| pos + i + 1);
        let line = &bytes[pos..end];
        let eol: &'static [u8] = if line.ends_with(b"\r\n") {
            b"\r\n"
        } else if line.ends_with(b"\n") {
            b"\n"
        } else {
            b""
        };
        let text = &line[..line.len() - eol.len()];
        match begin {
            None if text == BEGIN.as_bytes() => begin = Some((pos, false, eol)),
            None if text == BEGIN_AFTER_BREAK.as_bytes() => begin = Some((pos, true, eol)),
            Some((start, after_break, begin_eol)) if text == END.as_bytes() => {
                let start = if after_break && bytes[..start].ends_with(begin_eol) {
                    start - begin_eol.len()
                } else {
                    start
                };
                return Some(start..end);
            }
            _ => {}
        }
        pos = end;
    }
    // A begin marker without its end (cut short by hand): the block runs to the end.
    begin.map(|(start, after_break, eol)| {
        if after_break && bytes[..start].ends_with(eol) {
            start - eol.len()..bytes.len()
        } else {
            start..bytes.len()
        }
    })
}

/// `bytes` without kvpn's block (unchanged when there is none).
pub fn remove_block(bytes: &[u8]) -> Vec<u8> {
    match find_block(bytes) {
        Some(range) => {
            let mut out = bytes[..range.start].to_vec();
            out.extend_from_slice(&bytes[range.end..]);
            out
        }
        None => bytes.to_vec(),
    }
}

/// `bytes` (with any earlier kvpn block removed) followed by a block holding
/// `entries`; no block when `entries` is empty. Every byte of the file outside
/// the block stays, so [`remove_block`] of the result gives the file back.
pub fn add_block(bytes: &[u8], entries: &[HostEntry]) -> Vec<u8> {
    let mut out = remove_block(bytes);
    if entries.is_empty() {
        return out;
    }
    // The file's own line ends: CRLF if its first line ends so.
    let eol: &[u8] = match out.iter().position(|b| *b == b'\n') {
        Some(i) if i > 0 && out[i - 1] == b'\r' => b"\r\n",
        _ => b"\n",
    };
    let begin = if out.is_empty() || out.ends_with(b"\n") {
        BEGIN
    } else {
        out.extend_from_slice(eol);
        BEGIN_AFTER_BREAK
    };
    out.extend_from_slice(begin.as_bytes());
    out.extend_from_slice(eol);
    for e in entries {
        out.extend_from_slice(format!("{}\t{}", e.ip, e.names.join(" ")).as_bytes());
        out.extend_from_slice(eol);
    }
    out.extend_from_slice(END.as_bytes());
    out.extend_from_slice(eol);
    out
}

/// The hosts file and its backup in the runtime directory.
#[derive(Debug, Clone)]
pub struct HostsFile {
    file: ResolvConf,
}

impl HostsFile {
    /// `path` (normally [`DEFAULT_PATH`]) with its backup in `runtime_dir`.
    pub fn new(path: impl Into<PathBuf>, runtime_dir: &Path) -> Self {
        HostsFile {
            file: ResolvConf::with_backup_name(path, runtime_dir, BACKUP_NAME),
        }
    }

    /// Also keep a copy of the backup in `state_dir` (as
    /// [`ResolvConf::with_persistent_copy`]).
    pub fn with_persistent_copy(self, state_dir: &Path) -> Self {
        HostsFile {
            file: self.file.with_persistent_copy(state_dir),
        }
    }

    /// The hosts file path.
    pub fn path(&self) -> &Path {
        self.file.path()
    }

    /// The backup file path.
    pub fn backup_path(&self) -> &Path {
        self.file.backup_path()
    }

    fn read_current(&self) -> Result<Vec<u8>, ResolvConfError> {
        match fs::read(self.path()) {
            Ok(b) => Ok(b),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(resolv_conf::io("cannot read", self.path())(e)),
        }
    }

    /// Write kvpn's block with `entries` (none: no block) into the file as it is
    /// now, keeping edits others made since kvpn's last write. The state before
    /// kvpn's first write is saved first (see the module header).
    pub fn apply(&self, entries: &[HostEntry]) -> Result<(), ResolvConfError> {
        let mut backup = match self.file.backup()? {
            Some(b) => b,
            None if entries.is_empty() => return Ok(()),
            None => self.file.snapshot()?,
        };
        let current = self.read_current()?;
        let content = add_block(&current, entries);
        if content == current && backup.written.as_bytes() == current.as_slice() {
            return Ok(());
        }
        // The file without kvpn's block is the original now (others' edits included).
        backup.original = remove_block(&current);
        backup.written = String::from_utf8_lossy(&content).into_owned();
        // Non-UTF-8 bytes in the file: `written` cannot match it exactly, so the
        // restore cuts out the block instead of writing the original back; the
        // result is the same bytes.
        self.file.save_backup(&backup)?;
        let mode = if backup.kind == Kind::File {
            backup.mode
        } else {
            0o644
        };
        resolv_conf::replace_with_file(self.path(), &content, mode)?;
        if backup.kind == Kind::File {
            let _ = nix::unistd::chown(
                self.path(),
                Some(nix::unistd::Uid::from_raw(backup.uid)),
                Some(nix::unistd::Gid::from_raw(backup.gid)),
            );
        }
        tracing::info!(path = %self.path().display(), entries = entries.len(), "hosts file: kvpn's entries written");
        Ok(())
    }

    /// Take kvpn's block out: the exact original when the file is still what kvpn
    /// wrote, else only the block is cut (see the module header). Also cuts a
    /// block left without a backup.
    pub fn restore(&self) -> Result<Restored, ResolvConfError> {
        let backup = self.file.backup()?;
        let is_file = fs::symlink_metadata(self.path()).is_ok_and(|m| m.file_type().is_file());
        let current = if is_file {
            Some(self.read_current()?)
        } else {
            None
        };
        let outcome = match (&backup, &current) {
            (Some(b), Some(cur)) if cur.as_slice() == b.written.as_bytes() => {
                match &b.kind {
                    Kind::File => {
                        resolv_conf::replace_with_file(self.path(), &b.original, b.mode)?;
                        let _ = nix::unistd::chown(
                            self.path(),
                            Some(nix::unistd::Uid::from_raw(b.uid)),
                            Some(nix::unistd::Gid::from_raw(b.gid)),
                        );
                    }
                    Kind::Symlink { target } => {
                        resolv_conf::replace_with_symlink(self.path(), target)?;
                    }
                    Kind::Absent => match fs::remove_file(self.path()) {
                        Ok(()) => {}
                        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                        Err(e) => return Err(resolv_conf::io("cannot remove", self.path())(e)),
                    },
                }
                Restored::Original
            }
            (_, Some(cur)) if find_block(cur).is_some() => {
                let mode = fs::metadata(self.path()).map_or(0o644, |m| {
                    std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o7777
                });
                resolv_conf::replace_with_file(self.path(), &remove_block(cur), mode)?;
                if backup.is_some() {
                    Restored::KeptOthers
                } else {
                    Restored::Original
                }
            }
            (Some(_), _) => Restored::KeptOthers,
            (None, _) => Restored::NothingToDo,
        };
        if backup.is_some() {
            // Both copies: the runtime one and the persistent one (a stale
            // persistent copy would be read as this file's backup after a reboot).
            for file in std::iter::once(self.backup_path()).chain(self.file.persistent_path()) {
                match fs::remove_file(file) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(resolv_conf::io("cannot remove", file)(e)),
                }
            }
        }
        if outcome != Restored::NothingToDo {
            tracing::info!(path = %self.path().display(), ?outcome, "hosts file: kvpn's entries removed");
        }
        Ok(outcome)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn svc(ns: &str, name: &str, ips: &[&str]) -> ClusterService {
        ClusterService {
            namespace: ns.into(),
            name: name.into(),
            cluster_ips: ips.iter().map(|s| (*s).to_owned()).collect(),
            ports: vec!["80/TCP".into()],
        }
    }

    fn web() -> Vec<HostEntry> {
        entries_for(
            "dev",
            "cluster.local",
            &[svc("dev", "web", &["10.96.0.100"])],
        )
    }

    /// The dns-07 files: no trailing newline, CRLF line ends, tabs.
    const EDGE_CASES: [&[u8]; 6] = [
        b"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost",
        b"127.0.0.1 localhost\r\n192.168.1.5\tnas.home nas\r\n",
        b"127.0.0.1 localhost\r\n10.0.0.1\t\tgw",
        b"\t127.0.0.1\t localhost \t\n\n# comment\t\n",
        b"",
        b"127.0.0.1 localhost\r",
    ];

    #[test]
    fn dns_07_hosts_file_edge_cases() {
        for original in EDGE_CASES {
            let with = add_block(original, &web());
            assert!(
                with.starts_with(original),
                "every original byte stays in place: {:?}",
                String::from_utf8_lossy(&with)
            );
            assert_eq!(
                remove_block(&with),
                original,
                "removal gives the exact bytes"
            );
            // Every original line is still a line of its own.
            let text = String::from_utf8_lossy(&with).into_owned();
            for line in String::from_utf8_lossy(original).split('\n') {
                let line = line.trim_end_matches('\r');
                if !line.is_empty() {
                    assert!(
                        text.split('\n').any(|l| l.trim_end_matches('\r') == line),
                        "{line:?} in {text:?}"
                    );
                }
            }
            assert!(
                text.contains("10.96.0.100\tweb web.dev web.dev.svc web.dev.svc.cluster.local"),
                "{text:?}"
            );
            // New entries replace the block, they do not stack.
            let again = add_block(
                &with,
                &entries_for("dev", "cluster.local", &[svc("dev", "api", &["10.96.0.7"])]),
            );
            assert_eq!(again.windows(3).filter(|w| w == b">>>").count(), 2);
            assert_eq!(remove_block(&again), original);
            assert_eq!(add_block(&with, &[]), original, "no entries: no block");
        }
        // CRLF files get CRLF lines, LF files LF.
        let crlf = add_block(EDGE_CASES[1], &web());
        assert!(String::from_utf8_lossy(&crlf).ends_with("# <<< kvpn <<<\r\n"));
        let lf = add_block(EDGE_CASES[0], &web());
        assert!(
            String::from_utf8_lossy(&lf)
                .contains("ip6-localhost\n# >>> kvpn: cluster Services, removed when kvpn disconnects (kvpn ended the line above) >>>\n")
        );
        // Lines added after kvpn's block (by hand, while connected) stay.
        let mut edited = add_block(EDGE_CASES[1], &web());
        edited.extend_from_slice(b"10.1.1.1 added-later\r\n");
        let mut expect = EDGE_CASES[1].to_vec();
        expect.extend_from_slice(b"10.1.1.1 added-later\r\n");
        assert_eq!(remove_block(&edited), expect);
    }

    #[test]
    fn entries_only_for_the_connected_namespace_with_valid_names() {
        let services = [
            svc("dev", "web", &["10.96.0.100", "fd00::64"]),
            svc("dev", "headless", &[]),
            svc("default", "web", &["10.96.0.5"]),
            svc("dev", "bad\nname", &["10.96.0.6"]),
            svc("dev", "odd", &["not-an-ip"]),
        ];
        let e = entries_for("dev", "cluster.local.", &services);
        assert_eq!(
            e.iter().map(|e| e.ip.to_string()).collect::<Vec<_>>(),
            vec!["10.96.0.100", "fd00::64"]
        );
        assert_eq!(e[0].names[0], "web");
        assert_eq!(e[0].names[3], "web.dev.svc.cluster.local");
        assert!(entries_for("Bad NS", "cluster.local", &services).is_empty());
        assert_eq!(
            connected_namespace(
                &["dev.svc.cluster.local".into(), "svc.cluster.local".into()],
                "cluster.local"
            ),
            Some("dev".into())
        );
        assert_eq!(
            connected_namespace(&["svc.cluster.local".into()], "cluster.local"),
            None
        );
    }

    proptest! {
        #[test]
        fn removal_gives_back_any_bytes(original in proptest::collection::vec(any::<u8>(), 0..400)) {
            // Bytes that hold a kvpn marker already are not "any file": skip them.
            prop_assume!(find_block(&original).is_none());
            let with = add_block(&original, &web());
            prop_assert!(with.starts_with(&original));
            prop_assert_eq!(remove_block(&with), original);
        }
    }

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "kvpn-hosts-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("scratch dir");
        dir
    }

    #[test]
    fn restore_removes_the_persistent_copy_too() {
        let dir = scratch("persistent");
        let state = dir.join("state");
        fs::create_dir_all(&state).expect("state dir");
        let path = dir.join("hosts");
        fs::write(&path, EDGE_CASES[1]).expect("write");
        let hosts = HostsFile::new(&path, &dir).with_persistent_copy(&state);
        hosts.apply(&web()).expect("apply");
        let copies = || fs::read_dir(&state).expect("read state").count();
        assert_eq!(copies(), 1, "a persistent copy is kept while connected");
        assert_eq!(hosts.restore().expect("restore"), Restored::Original);
        assert_eq!(fs::read(&path).expect("read"), EDGE_CASES[1]);
        assert_eq!(copies(), 0, "the persistent copy goes with the runtime one");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn apply_and_restore_the_file_exactly_and_after_a_crash() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = scratch("io");
        let path = dir.join("hosts");
        let original = EDGE_CASES[1];
        fs::write(&path, original).expect("write");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o640)).expect("chmod");
        let hosts = HostsFile::new(&path, &dir);
        assert_eq!(hosts.restore().expect("nothing"), Restored::NothingToDo);
        hosts.apply(&[]).expect("no entries");
        assert!(!hosts.backup_path().exists(), "no entries: nothing saved");
        hosts.apply(&web()).expect("apply");
        assert!(hosts.backup_path().exists());
        assert_eq!(fs::read(&path).expect("read"), add_block(original, &web()));
        hosts.apply(&web()).expect("same again");
        assert_eq!(hosts.restore().expect("restore"), Restored::Original);
        assert_eq!(fs::read(&path).expect("read"), original);
        assert_eq!(
            fs::metadata(&path).expect("meta").permissions().mode() & 0o777,
            0o640
        );
        assert!(!hosts.backup_path().exists());

        // Edited while connected: the edit stays, the block goes.
        hosts.apply(&web()).expect("apply");
        let mut edited = fs::read(&path).expect("read");
        edited.extend_from_slice(b"10.1.1.1 mine\r\n");
        fs::write(&path, &edited).expect("edit");
        assert_eq!(hosts.restore().expect("restore"), Restored::KeptOthers);
        let mut expect = original.to_vec();
        expect.extend_from_slice(b"10.1.1.1 mine\r\n");
        assert_eq!(fs::read(&path).expect("read"), expect);

        // A block whose backup went with a reboot (tmpfs runtime dir).
        fs::write(&path, original).expect("write");
        hosts.apply(&web()).expect("apply");
        fs::remove_file(hosts.backup_path()).expect("lose the backup");
        assert_eq!(hosts.restore().expect("repair"), Restored::Original);
        assert_eq!(fs::read(&path).expect("read"), original);

        // An absent file is absent again.
        fs::remove_file(&path).expect("rm");
        hosts.apply(&web()).expect("apply");
        assert!(path.exists());
        assert_eq!(hosts.restore().expect("restore"), Restored::Original);
        assert!(!path.exists());
        let _ = fs::remove_dir_all(&dir);
    }
}
