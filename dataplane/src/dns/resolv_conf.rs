//! The laptop's `resolv.conf` while the forwarder serves (resolver(5)).
//!
//! On the first session with cluster DNS, the exact bytes of the file (through a
//! symlink if it is one), whether it is a symlink and its target, its mode and owner
//! are saved to a backup file in `$KVPN_RUNTIME_DIR` *before* anything changes; then
//! the file is replaced by one that names the forwarder only, with the cluster
//! search domains before the laptop's own and the laptop's options kept. When the
//! last such session ends, and at the next daemon start after a crash (the backup
//! file drives the repair), the original comes back byte for byte and a symlink is
//! a symlink again (case dns-06). If somebody else rewrote the file meanwhile (a
//! DHCP client, NetworkManager), their version stays and the backup is dropped.
//!
//! The runtime directory is often a tmpfs (`/run`): a reboot after a killed daemon
//! would lose the backup and leave kvpn's file behind. So a second copy of the
//! backup lives in a persistent state directory (`/var/lib/kvpn`, env
//! `KVPN_STATE_DIR`), named after the runtime directory so that daemons with
//! different runtime directories never share it; restore reads the runtime copy,
//! else the persistent one, and removes both.
//!
//! A symlinked `resolv.conf` is replaced by a regular file rather than written
//! through, so the target (owned by systemd-resolved, NetworkManager, …) is never
//! touched. Where the path is a mount point (containers, `ip netns exec`'s bind
//! mount of `/etc/netns/<name>/resolv.conf`), rename fails with EBUSY and the file
//! is written in place instead.
//!
//! Pure: [`parse`], [`render`], [`Backup::encode`]/[`Backup::decode`]. I/O:
//! [`ResolvConf`] (the file and its backup).

use std::ffi::OsString;
use std::fs;
use std::io::{self, Write as _};
use std::net::IpAddr;
use std::os::unix::ffi::OsStringExt as _;
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Default path (env `KVPN_RESOLV_CONF` overrides it).
pub const DEFAULT_PATH: &str = "/etc/resolv.conf";
/// Backup file name in the runtime directory.
pub const BACKUP_NAME: &str = "resolv.conf.kvpn-backup";
/// Default persistent state directory (env `KVPN_STATE_DIR`) for the second
/// copy of each backup.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/kvpn";
/// First line of a backup file.
const BACKUP_MAGIC: &str = "kvpn resolv.conf backup v1";

/// Errors of resolv.conf handling.
#[derive(Debug, thiserror::Error)]
pub enum ResolvConfError {
    /// File system I/O failed.
    #[error(
        "{what} {path}: {source} — check that the root daemon runs as root and the file system is writable"
    )]
    Io {
        /// What was attempted.
        what: &'static str,
        /// On which path.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// The backup file is damaged.
    #[error("backup {path} is damaged ({why}) — restore {target} by hand and remove the backup")]
    BadBackup {
        /// The backup file.
        path: PathBuf,
        /// The resolv.conf it belongs to.
        target: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// The symlink's target is not UTF-8 (kvpn could not restore it faithfully).
    #[error("{path} is a symlink to a non-UTF-8 path — kvpn leaves such a resolv.conf alone")]
    OddSymlink {
        /// The path.
        path: PathBuf,
    },
}

// --- pure: parse and render ----------------------------------------------------

/// A `nameserver` line's address with its scope, as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nameserver {
    /// The address.
    pub ip: IpAddr,
    /// The `%scope` of an IPv6 address (`fe80::1%eth0`: `eth0`; an interface
    /// name or index, as glibc's resolver accepts), `None` without one. A
    /// link-local address is only reachable through its interface, so the
    /// forwarder needs the scope to reach it ([`super::upstreams_with`]).
    pub scope: Option<String>,
}

/// What kvpn reads from a resolv.conf.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resolv {
    /// `nameserver` lines, in order (a `%scope` suffix is dropped; it is in
    /// [`Resolv::scoped_nameservers`]).
    pub nameservers: Vec<IpAddr>,
    /// The same `nameserver` lines with their scopes.
    pub scoped_nameservers: Vec<Nameserver>,
    /// The search list: the last `search` or `domain` line wins, as in glibc.
    pub search: Vec<String>,
    /// `options` lines, verbatim (without the keyword), in order.
    pub options: Vec<String>,
    /// `sortlist` lines, verbatim (without the keyword).
    pub sortlist: Vec<String>,
}

/// One `nameserver` address: `192.168.1.1`, `fd00::53`, `fe80::1%eth0`,
/// `fe80::1%2`. A scope on an IPv4 address, or an empty one, is dropped.
pub fn parse_nameserver(word: &str) -> Option<Nameserver> {
    let (addr, scope) = match word.split_once('%') {
        Some((addr, scope)) => (addr, Some(scope)),
        None => (word, None),
    };
    let ip: IpAddr = addr.parse().ok()?;
    let scope = scope
        .filter(|s| ip.is_ipv6() && !s.is_empty())
        .map(str::to_owned);
    Some(Nameserver { ip, scope })
}

/// Parse resolv.conf bytes. Never fails: unknown or broken lines are skipped, as
/// the resolver does.
pub fn parse(bytes: &[u8]) -> Resolv {
    let text = String::from_utf8_lossy(bytes);
    let mut r = Resolv::default();
    for line in text.lines() {
        let line = line.trim_end_matches('\r');
        if line.starts_with(['#', ';']) {
            continue;
        }
        let mut words = line.split_whitespace();
        let Some(keyword) = words.next() else {
            continue;
        };
        let rest: Vec<&str> = words.take_while(|w| !w.starts_with(['#', ';'])).collect();
        match keyword {
            "nameserver" => {
                if let Some(ns) = rest.first().and_then(|w| parse_nameserver(w)) {
                    r.nameservers.push(ns.ip);
                    r.scoped_nameservers.push(ns);
                }
            }
            "search" | "domain" => r.search = rest.iter().map(|s| (*s).to_owned()).collect(),
            "options" if !rest.is_empty() => r.options.push(rest.join(" ")),
            "sortlist" if !rest.is_empty() => r.sortlist.push(rest.join(" ")),
            _ => {}
        }
    }
    r
}

/// The resolv.conf kvpn writes: the forwarder as the only nameserver (any other
/// would let cluster names leak upstream when the forwarder is slow), the cluster
/// search domains first and then the laptop's (duplicates dropped), and the
/// laptop's options and sortlist.
pub fn render(forwarder: IpAddr, cluster_search: &[String], original: &Resolv) -> String {
    let mut out = String::from(RENDER_HEADER);
    out.push_str(&format!("nameserver {forwarder}\n"));
    let mut search: Vec<&str> = Vec::new();
    for s in cluster_search.iter().chain(&original.search) {
        let s = s.trim_end_matches('.');
        if !s.is_empty() && !search.iter().any(|x| x.eq_ignore_ascii_case(s)) {
            search.push(s);
        }
    }
    if !search.is_empty() {
        out.push_str(&format!("search {}\n", search.join(" ")));
    }
    for o in &original.options {
        out.push_str(&format!("options {o}\n"));
    }
    for s in &original.sortlist {
        out.push_str(&format!("sortlist {s}\n"));
    }
    out
}

/// The comment [`render`] starts kvpn's resolv.conf with.
const RENDER_HEADER: &str = "# Written by kvpn: cluster names resolve through kvpn's DNS forwarder, all\n\
     # other names through this laptop's own nameservers. The original file comes\n\
     # back byte for byte when kvpn disconnects.\n";

/// `bytes` without the `nameserver` lines naming `own` (kvpn's forwarder) and
/// without [`render`]'s header comment, every other byte kept; `None` when no
/// nameserver line names `own`. Such a file is kvpn's own text (left by a killed
/// root daemon, or by another one with its own runtime directory): it must never
/// be recorded, nor left behind, as the laptop's original, or the laptop keeps
/// asking a forwarder that is gone.
pub fn without_own_nameserver(bytes: &[u8], own: IpAddr) -> Option<Vec<u8>> {
    let header: Vec<&str> = RENDER_HEADER.lines().collect();
    let mut found = false;
    let mut out = Vec::with_capacity(bytes.len());
    for line in bytes.split_inclusive(|b| *b == b'\n') {
        let text = String::from_utf8_lossy(line);
        let text = text.trim_end_matches(['\n', '\r']);
        let names_own = parse(text.as_bytes()).nameservers.first() == Some(&own);
        found |= names_own;
        if !names_own && !header.contains(&text) {
            out.extend_from_slice(line);
        }
    }
    found.then_some(out)
}

// --- pure: the backup file -----------------------------------------------------

/// What the path was before kvpn changed it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A regular file.
    File,
    /// A symlink to `target` (as `readlink` gave it).
    Symlink {
        /// The link's target.
        target: String,
    },
    /// Nothing.
    Absent,
}

/// Header of the backup file (one JSON line).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct BackupHeader {
    path: PathBuf,
    kind: Kind,
    mode: u32,
    uid: u32,
    gid: u32,
    original_len: usize,
    written: String,
}

/// The saved original and what kvpn wrote in its place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backup {
    /// The resolv.conf path.
    pub path: PathBuf,
    /// What it was.
    pub kind: Kind,
    /// Permission bits of the regular file (0o644 otherwise).
    pub mode: u32,
    /// Owner of the regular file.
    pub uid: u32,
    /// Group of the regular file.
    pub gid: u32,
    /// The exact bytes a reader saw (through the symlink); empty when absent.
    pub original: Vec<u8>,
    /// What kvpn wrote last.
    pub written: String,
}

impl Backup {
    /// `magic\n{json}\n<original bytes>`: the bytes stay exact whatever they hold.
    pub fn encode(&self) -> Vec<u8> {
        let header = BackupHeader {
            path: self.path.clone(),
            kind: self.kind.clone(),
            mode: self.mode,
            uid: self.uid,
            gid: self.gid,
            original_len: self.original.len(),
            written: self.written.clone(),
        };
        let mut out = format!("{BACKUP_MAGIC}\n").into_bytes();
        // Serialising a struct of strings and numbers cannot fail.
        out.extend(serde_json::to_vec(&header).unwrap_or_default());
        out.push(b'\n');
        out.extend_from_slice(&self.original);
        out
    }

    /// Inverse of [`Backup::encode`]; the error says what is wrong.
    pub fn decode(bytes: &[u8]) -> Result<Backup, String> {
        let rest = bytes
            .strip_prefix(format!("{BACKUP_MAGIC}\n").as_bytes())
            .ok_or("no kvpn backup header")?;
        let nl = rest
            .iter()
            .position(|b| *b == b'\n')
            .ok_or("header line not terminated")?;
        let header: BackupHeader =
            serde_json::from_slice(&rest[..nl]).map_err(|e| format!("header: {e}"))?;
        let original = &rest[nl + 1..];
        if original.len() != header.original_len {
            return Err(format!(
                "{} bytes of the original saved, header says {}",
                original.len(),
                header.original_len
            ));
        }
        Ok(Backup {
            path: header.path,
            kind: header.kind,
            mode: header.mode,
            uid: header.uid,
            gid: header.gid,
            original: original.to_vec(),
            written: header.written,
        })
    }
}

// --- I/O -----------------------------------------------------------------------

/// How a restore ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Restored {
    /// No backup: nothing to do.
    NothingToDo,
    /// The original is back.
    Original,
    /// Somebody else changed the file after kvpn wrote it; theirs was kept.
    KeptOthers,
}

/// A resolv.conf and its backup in the runtime directory (plus, optionally, a
/// copy of the backup in a persistent directory).
#[derive(Debug, Clone)]
pub struct ResolvConf {
    path: PathBuf,
    backup: PathBuf,
    persistent: Option<PathBuf>,
    /// kvpn's forwarder address: never recorded as, nor left behind in, the
    /// laptop's original ([`without_own_nameserver`]); `None` for the hosts file.
    own_nameserver: Option<IpAddr>,
}

/// File name of the persistent copy of backup `backup_name` for the daemon of
/// `runtime_dir`: the runtime directory's path with `/` as `-` and every byte
/// other than `[A-Za-z0-9_.]` (and `-` itself) as `%XX`, then `.` and the
/// backup name. Distinct runtime directories give distinct names.
pub fn persistent_name(runtime_dir: &Path, backup_name: &str) -> String {
    let raw = runtime_dir.as_os_str().as_encoded_bytes();
    let trimmed = raw.strip_prefix(b"/").unwrap_or(raw);
    let mut name = String::with_capacity(trimmed.len() + backup_name.len() + 1);
    for &b in trimmed {
        match b {
            b'/' => name.push('-'),
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'_' => name.push(char::from(b)),
            // A leading dot would hide the file; later dots are plain.
            b'.' if !name.is_empty() => name.push('.'),
            _ => name.push_str(&format!("%{b:02X}")),
        }
    }
    name.push('.');
    name.push_str(backup_name);
    name
}

pub(crate) fn io<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(io::Error) -> ResolvConfError + 'a {
    move |source| ResolvConfError::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_else(|| OsString::from("resolv.conf"));
    name.push(suffix);
    let mut hidden = OsString::from(".");
    hidden.push(name);
    path.with_file_name(hidden)
}

fn sync_dir(path: &Path) {
    if let Some(dir) = path.parent()
        && let Ok(d) = fs::File::open(dir)
    {
        let _ = d.sync_all();
    }
}

/// Write `bytes` to `path` atomically (temp file in the same directory, fsync,
/// rename); where rename cannot replace the path (a mount point: EBUSY; another
/// file system: EXDEV), write in place.
pub(crate) fn replace_with_file(
    path: &Path,
    bytes: &[u8],
    mode: u32,
) -> Result<(), ResolvConfError> {
    let tmp = sibling(path, ".kvpn-tmp");
    let _ = fs::remove_file(&tmp);
    let write_tmp = || -> io::Result<()> {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.set_permissions(fs::Permissions::from_mode(mode))?;
        f.sync_all()
    };
    write_tmp().map_err(io("cannot write", &tmp))?;
    match fs::rename(&tmp, path) {
        Ok(()) => {
            sync_dir(path);
            Ok(())
        }
        Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY) | Some(libc::EXDEV)) => {
            let _ = fs::remove_file(&tmp);
            tracing::debug!(path = %path.display(), error = %e, "cannot rename over resolv.conf; writing it in place");
            let mut f = fs::OpenOptions::new()
                .write(true)
                .truncate(true)
                .open(path)
                .map_err(io("cannot open", path))?;
            f.write_all(bytes).map_err(io("cannot write", path))?;
            f.sync_all().map_err(io("cannot sync", path))
        }
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(ResolvConfError::Io {
                what: "cannot replace",
                path: path.to_owned(),
                source: e,
            })
        }
    }
}

pub(crate) fn replace_with_symlink(path: &Path, target: &str) -> Result<(), ResolvConfError> {
    let tmp = sibling(path, ".kvpn-tmp");
    let _ = fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp).map_err(io("cannot create symlink", &tmp))?;
    fs::rename(&tmp, path).map_err(|e| {
        let _ = fs::remove_file(&tmp);
        ResolvConfError::Io {
            what: "cannot put the symlink back at",
            path: path.to_owned(),
            source: e,
        }
    })?;
    sync_dir(path);
    Ok(())
}

impl ResolvConf {
    /// `path` (normally [`DEFAULT_PATH`]) with its backup in `runtime_dir`.
    pub fn new(path: impl Into<PathBuf>, runtime_dir: &Path) -> Self {
        ResolvConf {
            path: path.into(),
            backup: runtime_dir.join(BACKUP_NAME),
            persistent: None,
            own_nameserver: None,
        }
    }

    /// Also keep a copy of the backup in `state_dir` (see the module header), so
    /// that a reboot that empties the runtime directory still finds it.
    pub fn with_persistent_copy(mut self, state_dir: &Path) -> Self {
        let (Some(runtime_dir), Some(name)) = (self.backup.parent(), self.backup.file_name())
        else {
            return self;
        };
        let name = persistent_name(runtime_dir, &name.to_string_lossy());
        self.persistent = Some(state_dir.join(name));
        self
    }

    /// The persistent copy of the backup, if one is kept.
    pub fn persistent_path(&self) -> Option<&Path> {
        self.persistent.as_deref()
    }

    /// The same, knowing that `ip` is kvpn's forwarder (`KVPN_DNS_IP`).
    pub fn with_own_nameserver(mut self, ip: IpAddr) -> Self {
        self.own_nameserver = Some(ip);
        self
    }

    /// Another file of `/etc` managed the same way (the hosts file), with its
    /// backup `backup_name` in `runtime_dir`.
    pub fn with_backup_name(
        path: impl Into<PathBuf>,
        runtime_dir: &Path,
        backup_name: &str,
    ) -> Self {
        ResolvConf {
            path: path.into(),
            backup: runtime_dir.join(backup_name),
            persistent: None,
            own_nameserver: None,
        }
    }

    /// The resolv.conf path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The backup file path.
    pub fn backup_path(&self) -> &Path {
        &self.backup
    }

    /// The backup, if one exists: the runtime copy, else the persistent one.
    pub fn backup(&self) -> Result<Option<Backup>, ResolvConfError> {
        match Self::read_backup(&self.backup, &self.path)? {
            Some(b) => Ok(Some(b)),
            None => match &self.persistent {
                Some(p) => Self::read_backup(p, &self.path),
                None => Ok(None),
            },
        }
    }

    fn read_backup(file: &Path, target: &Path) -> Result<Option<Backup>, ResolvConfError> {
        let bytes = match fs::read(file) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io("cannot read", file)(e)),
        };
        Backup::decode(&bytes)
            .map(Some)
            .map_err(|why| ResolvConfError::BadBackup {
                path: file.to_owned(),
                target: target.to_owned(),
                why,
            })
    }

    pub(crate) fn save_backup(&self, backup: &Backup) -> Result<(), ResolvConfError> {
        let bytes = backup.encode();
        // The persistent copy first: whichever copy exists then holds the original.
        if let Some(p) = &self.persistent {
            if let Some(dir) = p.parent() {
                fs::create_dir_all(dir).map_err(io("cannot create", dir))?;
            }
            replace_with_file(p, &bytes, 0o600)?;
        }
        replace_with_file(&self.backup, &bytes, 0o600)
    }

    /// What the path holds now, as a backup of it would record it.
    pub(crate) fn snapshot(&self) -> Result<Backup, ResolvConfError> {
        let (kind, mode, uid, gid) = match fs::symlink_metadata(&self.path) {
            Ok(meta) if meta.file_type().is_symlink() => {
                let target =
                    fs::read_link(&self.path).map_err(io("cannot read link", &self.path))?;
                let target =
                    String::from_utf8(target.into_os_string().into_vec()).map_err(|_| {
                        ResolvConfError::OddSymlink {
                            path: self.path.clone(),
                        }
                    })?;
                (Kind::Symlink { target }, 0o644, 0, 0)
            }
            Ok(meta) => (Kind::File, meta.mode() & 0o7777, meta.uid(), meta.gid()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => (Kind::Absent, 0o644, 0, 0),
            Err(e) => return Err(io("cannot inspect", &self.path)(e)),
        };
        let original = match kind {
            Kind::Absent => Vec::new(),
            // A dangling symlink reads as nothing, as the resolver sees it.
            _ => match fs::read(&self.path) {
                Ok(b) => b,
                Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
                Err(e) => return Err(io("cannot read", &self.path)(e)),
            },
        };
        Ok(Backup {
            path: self.path.clone(),
            kind,
            mode,
            uid,
            gid,
            original,
            written: String::new(),
        })
    }

    /// Save the original (unless a backup exists already: then it *is* the
    /// original) and write `render(original bytes)` in its place. Returns the
    /// original bytes.
    pub fn apply(&self, render: impl FnOnce(&[u8]) -> String) -> Result<Vec<u8>, ResolvConfError> {
        let mut backup = match self.backup()? {
            Some(b) => b,
            None => {
                let mut now = self.snapshot()?;
                if let Some(own) = self.own_nameserver
                    && let Some(clean) = without_own_nameserver(&now.original, own)
                {
                    tracing::warn!(
                        path = %self.path.display(),
                        forwarder = %own,
                        "resolv.conf already names kvpn's DNS forwarder but no backup exists \
                         (left by a killed root daemon, or one with another runtime directory); \
                         recording it without kvpn's nameserver line as the original"
                    );
                    now.original = clean;
                }
                now
            }
        };
        let content = render(&backup.original);
        backup.written = content.clone();
        // The backup reaches the disk before the file changes: a crash in between
        // leaves a backup whose `written` does not match, which restore handles.
        self.save_backup(&backup)?;
        let mode = if backup.kind == Kind::File {
            backup.mode
        } else {
            0o644
        };
        replace_with_file(&self.path, content.as_bytes(), mode)?;
        if backup.kind == Kind::File {
            let _ = nix::unistd::chown(
                &self.path,
                Some(nix::unistd::Uid::from_raw(backup.uid)),
                Some(nix::unistd::Gid::from_raw(backup.gid)),
            );
        }
        tracing::info!(path = %self.path.display(), backup = %self.backup.display(), "resolv.conf now names kvpn's DNS forwarder");
        Ok(backup.original)
    }

    /// Whether the file is exactly what kvpn last wrote (`true` without a
    /// backup: nothing of kvpn's to watch). A symlink where kvpn wrote a
    /// regular file is not kvpn's.
    pub fn is_ours(&self) -> Result<bool, ResolvConfError> {
        let Some(backup) = self.backup()? else {
            return Ok(true);
        };
        match fs::symlink_metadata(&self.path) {
            Ok(m) if m.file_type().is_file() => Ok(fs::read(&self.path)
                .map_err(io("cannot read", &self.path))?
                == backup.written.as_bytes()),
            Ok(_) => Ok(false),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io("cannot inspect", &self.path)(e)),
        }
    }

    /// While kvpn's entry is in place, somebody else (NetworkManager on a
    /// Wi-Fi change, a DHCP client) rewrote the file (issue 29 item 6): their
    /// version becomes the new original (kind, mode, owner and bytes, without
    /// kvpn's own nameserver line if they copied it), so the next restore
    /// gives *their* file back, and `render(new original)` is written again.
    /// Returns the new original, or `None` when the file is still kvpn's (or
    /// there is no backup: kvpn has nothing in place).
    pub fn reapply_if_rewritten(
        &self,
        render: impl FnOnce(&[u8]) -> String,
    ) -> Result<Option<Vec<u8>>, ResolvConfError> {
        if self.is_ours()? {
            return Ok(None);
        }
        let mut now = self.snapshot()?;
        if let Some(own) = self.own_nameserver
            && let Some(clean) = without_own_nameserver(&now.original, own)
        {
            now.original = clean;
        }
        let content = render(&now.original);
        now.written = content.clone();
        self.save_backup(&now)?;
        let mode = if now.kind == Kind::File {
            now.mode
        } else {
            0o644
        };
        replace_with_file(&self.path, content.as_bytes(), mode)?;
        if now.kind == Kind::File {
            let _ = nix::unistd::chown(
                &self.path,
                Some(nix::unistd::Uid::from_raw(now.uid)),
                Some(nix::unistd::Gid::from_raw(now.gid)),
            );
        }
        Ok(Some(now.original))
    }

    /// Put the original back (see the module header) and remove the backup.
    pub fn restore(&self) -> Result<Restored, ResolvConfError> {
        let Some(backup) = self.backup()? else {
            return Ok(Restored::NothingToDo);
        };
        let current = match fs::symlink_metadata(&self.path) {
            Ok(m) if m.file_type().is_file() => fs::read(&self.path).ok(),
            Ok(_) => None,
            Err(e) if e.kind() == io::ErrorKind::NotFound => Some(Vec::new()),
            Err(e) => return Err(io("cannot inspect", &self.path)(e)),
        };
        let ours = current.as_deref() == Some(backup.written.as_bytes());
        // Killed between saving the backup and writing the file: the file is still
        // the original.
        let untouched = self.snapshot().is_ok_and(|now| {
            now.kind == backup.kind && now.original == backup.original && now.kind != Kind::Absent
        });
        let outcome = if ours {
            match &backup.kind {
                Kind::File => {
                    replace_with_file(&self.path, &backup.original, backup.mode)?;
                    let _ = nix::unistd::chown(
                        &self.path,
                        Some(nix::unistd::Uid::from_raw(backup.uid)),
                        Some(nix::unistd::Gid::from_raw(backup.gid)),
                    );
                }
                Kind::Symlink { target } => replace_with_symlink(&self.path, target)?,
                Kind::Absent => match fs::remove_file(&self.path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io("cannot remove", &self.path)(e)),
                },
            }
            tracing::info!(path = %self.path.display(), "resolv.conf restored");
            Restored::Original
        } else if untouched {
            Restored::Original
        } else {
            tracing::warn!(
                path = %self.path.display(),
                "resolv.conf was changed by something else while kvpn was connected; keeping that version instead of kvpn's backup"
            );
            Restored::KeptOthers
        };
        self.drop_own_nameserver()?;
        for file in std::iter::once(&self.backup).chain(&self.persistent) {
            match fs::remove_file(file) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io("cannot remove", file)(e)),
            }
            sync_dir(file);
        }
        Ok(outcome)
    }

    /// After a restore the forwarder is going away: a regular file that still
    /// names it (somebody else's version that copied kvpn's text, or a backup
    /// that recorded kvpn's own text before [`ResolvConf::apply`] refused to)
    /// loses that line rather than keep the laptop asking a dead address.
    fn drop_own_nameserver(&self) -> Result<(), ResolvConfError> {
        let Some(own) = self.own_nameserver else {
            return Ok(());
        };
        let Ok(meta) = fs::symlink_metadata(&self.path) else {
            return Ok(());
        };
        if !meta.file_type().is_file() {
            return Ok(());
        }
        let current = fs::read(&self.path).map_err(io("cannot read", &self.path))?;
        if let Some(clean) = without_own_nameserver(&current, own) {
            tracing::warn!(
                path = %self.path.display(),
                forwarder = %own,
                "resolv.conf still names kvpn's DNS forwarder after the restore; dropping that \
                 nameserver line — check the file's other nameservers"
            );
            replace_with_file(&self.path, &clean, meta.mode() & 0o7777)?;
            let _ = nix::unistd::chown(
                &self.path,
                Some(nix::unistd::Uid::from_raw(meta.uid())),
                Some(nix::unistd::Gid::from_raw(meta.gid())),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ORIGINAL: &[u8] = b"# laptop\r\nnameserver 192.168.1.1\nnameserver fe80::1%eth0\n\
        search corp.test lab.test\noptions ndots:2 timeout:1\noptions edns0 # trust-ad\n\
        sortlist 10.0.0.0/255.0.0.0\nunknown line\n\tnameserver\t10.0.0.53";

    #[test]
    fn parse_reads_what_the_resolver_reads() {
        let r = parse(ORIGINAL);
        assert_eq!(
            r.nameservers,
            vec![
                "192.168.1.1".parse::<IpAddr>().expect("ip"),
                "fe80::1".parse().expect("ip"),
                "10.0.0.53".parse().expect("ip")
            ]
        );
        assert_eq!(
            r.scoped_nameservers
                .iter()
                .map(|n| n.scope.as_deref())
                .collect::<Vec<_>>(),
            vec![None, Some("eth0"), None],
            "the scope of fe80::1%eth0 is kept"
        );
        assert_eq!(r.search, vec!["corp.test", "lab.test"]);
        assert_eq!(r.options, vec!["ndots:2 timeout:1", "edns0"]);
        assert_eq!(r.sortlist, vec!["10.0.0.0/255.0.0.0"]);
        // domain and search: the last wins.
        assert_eq!(parse(b"search a b\ndomain c\n").search, vec!["c"]);
        assert_eq!(parse(b"").nameservers, Vec::<IpAddr>::new());
        assert_eq!(parse(&[0xff, 0xfe, b'\n']).search, Vec::<String>::new());
    }

    #[test]
    fn nameserver_scopes_are_kept_for_ipv6_only() {
        let ns = |w: &str| parse_nameserver(w).map(|n| (n.ip.to_string(), n.scope));
        assert_eq!(
            ns("fe80::1%eth0"),
            Some(("fe80::1".to_owned(), Some("eth0".to_owned())))
        );
        assert_eq!(
            ns("FE80::1%2"),
            Some(("fe80::1".to_owned(), Some("2".to_owned())))
        );
        assert_eq!(ns("fd00::53"), Some(("fd00::53".to_owned(), None)));
        assert_eq!(ns("fe80::1%"), Some(("fe80::1".to_owned(), None)));
        assert_eq!(ns("10.0.0.1%eth0"), Some(("10.0.0.1".to_owned(), None)));
        assert_eq!(ns("eth0%fe80::1"), None);
        assert_eq!(ns("dns.example"), None);
    }

    #[test]
    fn render_names_the_forwarder_only_and_prepends_the_cluster_search() {
        let text = render(
            "127.0.0.153".parse().expect("ip"),
            &[
                "dev.svc.cluster.local".into(),
                "svc.cluster.local".into(),
                "cluster.local.".into(),
                "corp.test".into(),
            ],
            &parse(ORIGINAL),
        );
        let r = parse(text.as_bytes());
        assert_eq!(
            r.nameservers,
            vec!["127.0.0.153".parse::<IpAddr>().expect("ip")]
        );
        assert_eq!(
            r.search,
            vec![
                "dev.svc.cluster.local",
                "svc.cluster.local",
                "cluster.local",
                "corp.test",
                "lab.test"
            ]
        );
        assert_eq!(r.options, parse(ORIGINAL).options);
        assert_eq!(r.sortlist, parse(ORIGINAL).sortlist);
        assert!(text.starts_with("# Written by kvpn"));
    }

    #[test]
    fn backup_round_trips_any_bytes() {
        for (kind, original) in [
            (Kind::File, ORIGINAL.to_vec()),
            (
                Kind::Symlink {
                    target: "../run/systemd/resolve/stub-resolv.conf".into(),
                },
                b"nameserver 127.0.0.53\n".to_vec(),
            ),
            (Kind::Absent, Vec::new()),
            (Kind::File, vec![0, 10, 255, 13, 10]),
        ] {
            let b = Backup {
                path: "/etc/resolv.conf".into(),
                kind,
                mode: 0o644,
                uid: 0,
                gid: 0,
                original,
                written: "nameserver 127.0.0.153\n".into(),
            };
            assert_eq!(Backup::decode(&b.encode()), Ok(b.clone()));
            let mut cut = b.encode();
            if !b.original.is_empty() {
                cut.pop();
                assert!(Backup::decode(&cut).is_err(), "a short backup is refused");
            }
        }
        assert!(Backup::decode(b"nameserver 1.1.1.1\n").is_err());
    }

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "kvpn-resolv-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("scratch dir");
        dir
    }

    fn render_test(original: &[u8]) -> String {
        render(
            "127.0.0.153".parse().expect("ip"),
            &["dev.svc.cluster.local".into()],
            &parse(original),
        )
    }

    #[test]
    fn apply_and_restore_a_regular_file_byte_for_byte() {
        let dir = scratch("file");
        let path = dir.join("resolv.conf");
        fs::write(&path, ORIGINAL).expect("write");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o640)).expect("chmod");
        let rc = ResolvConf::new(&path, &dir);
        assert_eq!(rc.apply(render_test).expect("apply"), ORIGINAL);
        let ours = fs::read_to_string(&path).expect("read");
        assert!(ours.contains("nameserver 127.0.0.153"));
        assert!(rc.backup_path().exists());
        // A second session: the backup keeps the original, not kvpn's file.
        assert_eq!(rc.apply(render_test).expect("apply again"), ORIGINAL);
        assert_eq!(rc.restore().expect("restore"), Restored::Original);
        assert_eq!(fs::read(&path).expect("read"), ORIGINAL);
        assert_eq!(
            fs::metadata(&path).expect("meta").permissions().mode() & 0o777,
            0o640
        );
        assert!(!rc.backup_path().exists());
        assert_eq!(rc.restore().expect("again"), Restored::NothingToDo);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn apply_and_restore_a_symlink_and_leave_its_target_alone() {
        let dir = scratch("link");
        let target = dir.join("stub-resolv.conf");
        fs::write(
            &target,
            b"nameserver 127.0.0.53\noptions edns0 trust-ad\nsearch .",
        )
        .expect("write");
        let path = dir.join("resolv.conf");
        std::os::unix::fs::symlink("stub-resolv.conf", &path).expect("symlink");
        let rc = ResolvConf::new(&path, &dir);
        rc.apply(render_test).expect("apply");
        assert!(
            !fs::symlink_metadata(&path)
                .expect("meta")
                .file_type()
                .is_symlink()
        );
        assert_eq!(
            fs::read(&target).expect("target"),
            b"nameserver 127.0.0.53\noptions edns0 trust-ad\nsearch .",
            "the symlink's target is untouched"
        );
        assert_eq!(rc.restore().expect("restore"), Restored::Original);
        assert!(
            fs::symlink_metadata(&path)
                .expect("meta")
                .file_type()
                .is_symlink()
        );
        assert_eq!(
            fs::read_link(&path).expect("link"),
            Path::new("stub-resolv.conf")
        );
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_absent_file_is_absent_again_and_others_changes_are_kept() {
        let dir = scratch("absent");
        let path = dir.join("resolv.conf");
        let rc = ResolvConf::new(&path, &dir);
        rc.apply(render_test).expect("apply");
        assert!(path.exists());
        assert_eq!(rc.restore().expect("restore"), Restored::Original);
        assert!(!path.exists());

        fs::write(&path, b"nameserver 10.0.0.1\n").expect("write");
        rc.apply(render_test).expect("apply");
        fs::write(&path, b"nameserver 10.9.9.9\n# DHCP renewed\n").expect("write");
        assert_eq!(rc.restore().expect("restore"), Restored::KeptOthers);
        assert_eq!(
            fs::read(&path).expect("read"),
            b"nameserver 10.9.9.9\n# DHCP renewed\n"
        );
        assert!(!rc.backup_path().exists());
        let _ = fs::remove_dir_all(&dir);
    }

    /// The SIGKILL case: resolv.conf is kvpn's text (a killed daemon's, or a
    /// second root daemon's with another runtime dir) and this daemon has no
    /// backup. apply records it without kvpn's nameserver line; restore never
    /// puts 127.0.0.153 back — also from an old backup that recorded it.
    #[test]
    fn kvpn_s_own_text_is_never_the_original() {
        let own: IpAddr = "127.0.0.153".parse().expect("ip");
        let laptop = b"nameserver 192.168.1.1\nsearch corp.test\noptions ndots:2\n";
        let left_by_killed_daemon = render_test(laptop);
        let dir = scratch("own");
        let path = dir.join("resolv.conf");
        fs::write(&path, &left_by_killed_daemon).expect("write");
        let rc = ResolvConf::new(&path, &dir).with_own_nameserver(own);
        let original = rc.apply(render_test).expect("apply");
        let original_text = String::from_utf8(original).expect("utf-8");
        assert!(!original_text.contains("127.0.0.153"), "{original_text}");
        assert!(
            !original_text.contains("Written by kvpn"),
            "{original_text}"
        );
        assert!(
            original_text.contains("search dev.svc.cluster.local corp.test"),
            "{original_text}"
        );
        let saved = rc.backup().expect("backup").expect("a backup exists");
        assert!(without_own_nameserver(&saved.original, own).is_none());
        assert_eq!(rc.restore().expect("restore"), Restored::Original);
        let after = fs::read_to_string(&path).expect("read");
        assert!(!after.contains("127.0.0.153"), "{after}");

        // A backup from before this rule, holding kvpn's text as the original.
        fs::write(&path, &left_by_killed_daemon).expect("write");
        let rc_old = ResolvConf::new(&path, &dir);
        rc_old.apply(render_test).expect("apply without the rule");
        assert!(
            String::from_utf8_lossy(&rc_old.backup().expect("b").expect("b").original)
                .contains("127.0.0.153")
        );
        let rc = ResolvConf::new(&path, &dir).with_own_nameserver(own);
        assert_eq!(rc.restore().expect("restore"), Restored::Original);
        let after = fs::read_to_string(&path).expect("read");
        assert!(!after.contains("127.0.0.153"), "{after}");
        assert!(
            after.contains("options ndots:2"),
            "other lines stay: {after}"
        );

        // Somebody else's version that still names the forwarder: kept, minus it.
        fs::write(&path, laptop).expect("write");
        rc.apply(render_test).expect("apply");
        fs::write(&path, b"nameserver 127.0.0.153\nnameserver 10.9.9.9\n").expect("write");
        assert_eq!(rc.restore().expect("restore"), Restored::KeptOthers);
        assert_eq!(fs::read(&path).expect("read"), b"nameserver 10.9.9.9\n");

        // Without kvpn's line nothing changes.
        assert_eq!(without_own_nameserver(laptop, own), None);
        let _ = fs::remove_dir_all(&dir);
    }

    /// Issue 29 item 6: a rewrite by somebody else while connected becomes the
    /// new original (also a symlink, also a copy of kvpn's text); kvpn's
    /// entry is written again; the restore gives their version back.
    #[test]
    fn a_rewrite_by_others_becomes_the_original_and_kvpn_s_entry_comes_back() {
        let own: IpAddr = "127.0.0.153".parse().expect("ip");
        let dir = scratch("rewrite");
        let path = dir.join("resolv.conf");
        fs::write(&path, ORIGINAL).expect("write");
        let rc = ResolvConf::new(&path, &dir).with_own_nameserver(own);
        assert!(
            rc.is_ours().expect("no backup"),
            "nothing of kvpn's in place"
        );
        rc.apply(render_test).expect("apply");
        assert!(rc.is_ours().expect("is ours"));
        assert_eq!(rc.reapply_if_rewritten(render_test).expect("noop"), None);

        // dhclient writes in place.
        let wifi = b"# dhclient\nnameserver 10.9.9.9\nsearch wifi.test\n";
        fs::write(&path, wifi).expect("write");
        assert!(!rc.is_ours().expect("not ours"));
        let original = rc.reapply_if_rewritten(render_test).expect("reapply");
        assert_eq!(original.as_deref(), Some(&wifi[..]));
        let now = parse(&fs::read(&path).expect("read"));
        assert_eq!(now.nameservers, vec![own], "kvpn's entry is back");
        assert_eq!(now.search, vec!["dev.svc.cluster.local", "wifi.test"]);
        assert!(rc.is_ours().expect("ours again"));
        assert_eq!(rc.reapply_if_rewritten(render_test).expect("noop"), None);

        // A copy of kvpn's file with one line changed: kvpn's line is not recorded.
        let copied = format!("{}nameserver 10.8.8.8\n", render_test(wifi));
        fs::write(&path, &copied).expect("write");
        let original = rc
            .reapply_if_rewritten(render_test)
            .expect("reapply")
            .expect("rewritten");
        let original = parse(&original);
        assert!(!original.nameservers.contains(&own), "{original:?}");
        assert!(
            original
                .nameservers
                .contains(&"10.8.8.8".parse().expect("ip"))
        );

        // NetworkManager replaces it with a symlink: the restore makes it one again.
        let target = dir.join("nm-resolv.conf");
        fs::write(&target, b"nameserver 10.7.7.7\n").expect("write");
        fs::remove_file(&path).expect("rm");
        std::os::unix::fs::symlink("nm-resolv.conf", &path).expect("symlink");
        rc.reapply_if_rewritten(render_test)
            .expect("reapply")
            .expect("rewritten");
        assert!(
            !fs::symlink_metadata(&path)
                .expect("meta")
                .file_type()
                .is_symlink()
        );
        assert_eq!(fs::read(&target).expect("read"), b"nameserver 10.7.7.7\n");
        assert_eq!(rc.restore().expect("restore"), Restored::Original);
        assert_eq!(
            fs::read_link(&path).expect("link"),
            Path::new("nm-resolv.conf")
        );
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_crash_between_backup_and_write_restores_cleanly() {
        let dir = scratch("crash");
        let path = dir.join("resolv.conf");
        fs::write(&path, ORIGINAL).expect("write");
        let rc = ResolvConf::new(&path, &dir);
        // What apply writes first, without the second step.
        let mut b = rc.snapshot().expect("snapshot");
        b.written = render_test(ORIGINAL);
        rc.save_backup(&b).expect("backup");
        assert_eq!(rc.restore().expect("restore"), Restored::Original);
        assert_eq!(fs::read(&path).expect("read"), ORIGINAL);
        assert!(!rc.backup_path().exists());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn persistent_names_are_distinct_per_runtime_dir() {
        assert_eq!(
            persistent_name(Path::new("/run/kvpn"), BACKUP_NAME),
            "run-kvpn.resolv.conf.kvpn-backup"
        );
        assert_eq!(
            persistent_name(Path::new("/tmp/.x-y/z"), "b"),
            "tmp-.x%2Dy-z.b"
        );
        assert_ne!(
            persistent_name(Path::new("/a-b"), "b"),
            persistent_name(Path::new("/a/b"), "b")
        );
        assert_eq!(persistent_name(Path::new("/.hidden"), "b"), "%2Ehidden.b");
    }

    /// A daemon killed while connected, then a reboot that empties the runtime
    /// directory (a tmpfs): the next daemon start repairs from the persistent copy.
    #[test]
    fn a_reboot_after_a_kill_restores_from_the_persistent_copy() {
        let dir = scratch("reboot");
        let runtime = dir.join("run");
        let state = dir.join("var-lib-kvpn");
        fs::create_dir_all(&runtime).expect("runtime dir");
        let path = dir.join("resolv.conf");
        fs::write(&path, ORIGINAL).expect("write");
        let rc = ResolvConf::new(&path, &runtime).with_persistent_copy(&state);
        let keep = rc.persistent_path().expect("persistent path").to_owned();
        assert!(keep.starts_with(&state));
        rc.apply(render_test).expect("apply");
        assert!(keep.exists() && rc.backup_path().exists());
        // The kill leaves both copies; the reboot empties the tmpfs.
        fs::remove_dir_all(&runtime).expect("reboot");
        fs::create_dir_all(&runtime).expect("runtime dir again");
        let after_boot = ResolvConf::new(&path, &runtime).with_persistent_copy(&state);
        assert_eq!(after_boot.restore().expect("repair"), Restored::Original);
        assert_eq!(fs::read(&path).expect("read"), ORIGINAL);
        assert!(!keep.exists(), "the persistent copy goes with the repair");
        assert_eq!(after_boot.restore().expect("again"), Restored::NothingToDo);
        // Without the persistent copy the same reboot leaves kvpn's file: the
        // copy is what makes the repair possible.
        let bare = ResolvConf::new(&path, &runtime);
        bare.apply(render_test).expect("apply");
        fs::remove_file(bare.backup_path()).expect("reboot");
        assert_eq!(bare.restore().expect("repair"), Restored::NothingToDo);
        assert_ne!(fs::read(&path).expect("read"), ORIGINAL);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_normal_restore_removes_both_copies() {
        let dir = scratch("both");
        let path = dir.join("resolv.conf");
        fs::write(&path, ORIGINAL).expect("write");
        let rc = ResolvConf::new(&path, &dir).with_persistent_copy(&dir.join("state"));
        rc.apply(render_test).expect("apply");
        assert_eq!(rc.restore().expect("restore"), Restored::Original);
        assert_eq!(fs::read(&path).expect("read"), ORIGINAL);
        assert!(!rc.backup_path().exists());
        assert!(!rc.persistent_path().expect("persistent").exists());
        let _ = fs::remove_dir_all(&dir);
    }
}
