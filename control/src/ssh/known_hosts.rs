//! known_hosts checking (case ssh-03), as OpenSSH's sshd(8) "SSH_KNOWN_HOSTS FILE
//! FORMAT" describes it: `[marker] patterns keytype base64 [comment]` lines, where a
//! pattern is a host name or address, `[host]:port` for ports other than 22, a
//! wildcard (`*`, `?`), a negation (`!pattern`) or a hashed entry `|1|salt|hash`
//! (HMAC-SHA1 of the host string keyed with the salt, both base64).
//!
//! Pure: [`KnownHosts::parse`] takes the file's text and path, [`KnownHosts::check`]
//! decides; reading and appending the file is the caller's ([`append_line`] is the
//! one write, for `--ssh-accept-new`).

use std::path::{Path, PathBuf};

use data_encoding::BASE64;
use hmac::{Hmac, KeyInit, Mac};
use russh::keys::{Algorithm, PublicKey};
use sha1::Sha1;

/// One usable line of a known_hosts file.
#[derive(Debug, Clone)]
struct Entry {
    /// 1-based line number in the file.
    line: usize,
    revoked: bool,
    patterns: String,
    key: PublicKey,
}

/// A parsed known_hosts file.
#[derive(Debug, Clone, Default)]
pub struct KnownHosts {
    path: PathBuf,
    entries: Vec<Entry>,
}

/// What the file says about a server's host key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The key is listed for this host (at `line`).
    Known { line: usize },
    /// Nothing is listed for this host.
    Unknown,
    /// The host is listed with another key of the same type: the key changed (or
    /// someone is in the middle). Never accepted.
    Changed { line: usize, expected: String },
    /// The host is listed only with keys of other types than the one it showed.
    /// Refused like a change: the server should have offered a listed type.
    OtherType { line: usize, listed: String },
    /// The key is marked `@revoked`.
    Revoked { line: usize },
}

/// `host` for port 22, else `[host]:port` — the host string known_hosts stores.
pub fn host_string(host: &str, port: u16) -> String {
    if port == 22 {
        host.to_owned()
    } else {
        format!("[{host}]:{port}")
    }
}

/// The key type family (RSA keys match whatever signature hash they use).
fn same_type(a: &Algorithm, b: &Algorithm) -> bool {
    match (a, b) {
        (Algorithm::Rsa { .. }, Algorithm::Rsa { .. }) => true,
        _ => a == b,
    }
}

impl KnownHosts {
    /// Parses a known_hosts file's `text`; lines that are not understood (comments,
    /// `@cert-authority`, key types this build does not know) are skipped, as
    /// OpenSSH does.
    pub fn parse(path: &Path, text: &str) -> Self {
        let mut entries = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut fields = line.split_whitespace();
            let mut first = fields.next().unwrap_or_default();
            let mut revoked = false;
            if let Some(marker) = first.strip_prefix('@') {
                match marker {
                    "revoked" => revoked = true,
                    // Host certificates are not used by kvpn.
                    _ => continue,
                }
                first = match fields.next() {
                    Some(f) => f,
                    None => continue,
                };
            }
            let (Some(_keytype), Some(b64)) = (fields.next(), fields.next()) else {
                continue;
            };
            let Ok(key) = russh::keys::parse_public_key_base64(b64) else {
                continue;
            };
            entries.push(Entry {
                line: i + 1,
                revoked,
                patterns: first.to_owned(),
                key,
            });
        }
        KnownHosts {
            path: path.to_owned(),
            entries,
        }
    }

    /// The file this came from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn for_host<'a>(&'a self, host: &'a str, port: u16) -> impl Iterator<Item = &'a Entry> + 'a {
        let wanted = host_string(host, port);
        self.entries
            .iter()
            .filter(move |e| patterns_match(&e.patterns, &wanted))
    }

    /// Decides about `key` shown by `host`:`port`.
    pub fn check(&self, host: &str, port: u16, key: &PublicKey) -> Verdict {
        let mut changed = None;
        let mut other = None;
        for e in self.for_host(host, port) {
            if e.key.key_data() == key.key_data() {
                if e.revoked {
                    return Verdict::Revoked { line: e.line };
                }
                // Keep looking for a @revoked line of the same key.
                if self
                    .for_host(host, port)
                    .any(|r| r.revoked && r.key.key_data() == key.key_data())
                {
                    continue;
                }
                return Verdict::Known { line: e.line };
            }
            if e.revoked {
                continue;
            }
            if same_type(&e.key.algorithm(), &key.algorithm()) {
                changed.get_or_insert(Verdict::Changed {
                    line: e.line,
                    expected: e.key.algorithm().as_str().to_owned(),
                });
            } else {
                other.get_or_insert(Verdict::OtherType {
                    line: e.line,
                    listed: e.key.algorithm().as_str().to_owned(),
                });
            }
        }
        changed.or(other).unwrap_or(Verdict::Unknown)
    }

    /// The key types listed for `host`:`port`, in file order (what the client
    /// should ask the server for first, so a server with several host keys shows
    /// the one the file knows).
    pub fn listed_algorithms(&self, host: &str, port: u16) -> Vec<Algorithm> {
        let mut out: Vec<Algorithm> = Vec::new();
        for e in self.for_host(host, port).filter(|e| !e.revoked) {
            let a = e.key.algorithm();
            if !out.iter().any(|o| same_type(o, &a)) {
                out.push(a);
            }
        }
        out
    }
}

/// `preferred` (the client's host key algorithms) with the types in `listed`
/// moved to the front, keeping each group's order.
pub fn prefer_listed(preferred: &[Algorithm], listed: &[Algorithm]) -> Vec<Algorithm> {
    let (mut first, rest): (Vec<Algorithm>, Vec<Algorithm>) = preferred
        .iter()
        .cloned()
        .partition(|p| listed.iter().any(|l| same_type(l, p)));
    first.extend(rest);
    first
}

/// The line `--ssh-accept-new` appends for a new host.
pub fn entry_line(host: &str, port: u16, key: &PublicKey) -> String {
    let b64 = key.to_openssh().unwrap_or_default();
    let mut parts = b64.split_whitespace();
    let (ty, data) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    format!("{} {ty} {data}\n", host_string(host, port))
}

/// Appends `line` to the known_hosts file at `path` (creating it and its folder,
/// mode 0600 / 0700 as ssh does).
pub fn append_line(path: &Path, line: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
    if let Some(dir) = path.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)?;
    // A file whose last line lacks a newline would glue the new entry to it.
    let needs_newline = std::fs::read(path)
        .map(|b| b.last().is_some_and(|c| *c != b'\n'))
        .unwrap_or(false);
    if needs_newline {
        f.write_all(b"\n")?;
    }
    f.write_all(line.as_bytes())
}

/// Whether the comma-separated `patterns` of one line match `host` (already in
/// [`host_string`] form). A matching negation rules the line out.
fn patterns_match(patterns: &str, host: &str) -> bool {
    let mut matched = false;
    for p in patterns.split(',') {
        if let Some(hashed) = p.strip_prefix("|1|") {
            if hashed_match(hashed, host) {
                matched = true;
            }
        } else if let Some(neg) = p.strip_prefix('!') {
            if wildcard_match(&neg.to_ascii_lowercase(), &host.to_ascii_lowercase()) {
                return false;
            }
        } else if wildcard_match(&p.to_ascii_lowercase(), &host.to_ascii_lowercase()) {
            matched = true;
        }
    }
    matched
}

/// `salt|hash` (both base64): HMAC-SHA1(key = salt, host) == hash.
fn hashed_match(salt_and_hash: &str, host: &str) -> bool {
    let Some((salt, hash)) = salt_and_hash.split_once('|') else {
        return false;
    };
    let (Ok(salt), Ok(hash)) = (
        BASE64.decode(salt.as_bytes()),
        BASE64.decode(hash.as_bytes()),
    ) else {
        return false;
    };
    let Ok(mac) = Hmac::<Sha1>::new_from_slice(&salt) else {
        return false;
    };
    mac.chain_update(host.as_bytes())
        .verify_slice(&hash)
        .is_ok()
}

/// `*` any run of characters, `?` one character (ssh's match_pattern).
fn wildcard_match(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut pi, mut ti) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        match p.get(pi) {
            Some('*') => {
                star = Some((pi, ti));
                pi += 1;
            }
            Some(c) if *c == '?' || Some(c) == t.get(ti) => {
                pi += 1;
                ti += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    pi = sp + 1;
                    ti = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    p[pi.min(p.len())..].iter().all(|c| *c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    const ED: &str = "AAAAC3NzaC1lZDI1NTE5AAAAIFt4zzXfhCVNVycP7Q5N1YqdYnUxoHkr6gWBaV7c89t6";
    const ED_OTHER: &str = "AAAAC3NzaC1lZDI1NTE5AAAAINp1Qz1/NbRwzYsihWO/L47kTet0OFcDRPzvpfgKy+VD";
    /// `ssh-keygen -H` of `[10.0.0.1]:2222 ssh-ed25519 <ED>` (OpenSSH 9.2).
    const HASHED: &str = "|1|fLSPmUe2lmk0WWen/ahdH+SW0IQ=|269eleEXIa1+aDSh1L/BMFzIiX8=";

    fn key(b64: &str) -> PublicKey {
        russh::keys::parse_public_key_base64(b64).expect("test key")
    }

    fn kh(text: &str) -> KnownHosts {
        KnownHosts::parse(Path::new("/t/known_hosts"), text)
    }

    #[test]
    fn hashed_entry_made_by_ssh_keygen_matches_only_its_host_and_port() {
        let k = kh(&format!("# c\n{HASHED} ssh-ed25519 {ED}\n"));
        assert_eq!(
            k.check("10.0.0.1", 2222, &key(ED)),
            Verdict::Known { line: 2 }
        );
        assert_eq!(k.check("10.0.0.1", 22, &key(ED)), Verdict::Unknown);
        assert_eq!(k.check("10.0.0.2", 2222, &key(ED)), Verdict::Unknown);
    }

    #[test]
    fn bracketed_port_plain_host_wildcards_and_negation() {
        let k = kh(&format!(
            "[bastion]:2222 ssh-ed25519 {ED}\nplain,10.1.2.3 ssh-ed25519 {ED}\n*.lab,!bad.lab ssh-ed25519 {ED}\n"
        ));
        assert!(matches!(
            k.check("bastion", 2222, &key(ED)),
            Verdict::Known { line: 1 }
        ));
        assert_eq!(k.check("bastion", 22, &key(ED)), Verdict::Unknown);
        assert!(matches!(
            k.check("10.1.2.3", 22, &key(ED)),
            Verdict::Known { line: 2 }
        ));
        assert!(matches!(
            k.check("a.lab", 22, &key(ED)),
            Verdict::Known { line: 3 }
        ));
        assert_eq!(k.check("bad.lab", 22, &key(ED)), Verdict::Unknown);
    }

    #[test]
    fn a_different_key_of_the_same_type_is_a_change_naming_the_line() {
        let k = kh(&format!("\n\n[h]:2200 ssh-ed25519 {ED}\n"));
        assert_eq!(
            k.check("h", 2200, &key(ED_OTHER)),
            Verdict::Changed {
                line: 3,
                expected: "ssh-ed25519".into()
            }
        );
    }

    #[test]
    fn revoked_keys_are_refused_even_when_also_listed() {
        let k = kh(&format!(
            "h ssh-ed25519 {ED}\n@revoked h ssh-ed25519 {ED}\n"
        ));
        assert_eq!(k.check("h", 22, &key(ED)), Verdict::Revoked { line: 2 });
    }

    #[test]
    fn garbage_lines_are_skipped_not_fatal() {
        let k = kh(&format!(
            "h\nh ssh-ed25519 !!!\n@cert-authority * ssh-ed25519 {ED}\nh ssh-ed25519 {ED}\n"
        ));
        assert_eq!(k.check("h", 22, &key(ED)), Verdict::Known { line: 4 });
        assert_eq!(k.check("other", 22, &key(ED)), Verdict::Unknown);
    }

    #[test]
    fn listed_types_go_first_in_the_host_key_preference() {
        let k = kh(&format!("h ssh-ed25519 {ED}\n"));
        let listed = k.listed_algorithms("h", 22);
        assert_eq!(listed, vec![Algorithm::Ed25519]);
        let default = russh::Preferred::DEFAULT.key.to_vec();
        let rsa_first: Vec<Algorithm> = default
            .iter()
            .filter(|a| matches!(a, Algorithm::Rsa { .. }))
            .cloned()
            .chain(
                default
                    .iter()
                    .filter(|a| !matches!(a, Algorithm::Rsa { .. }))
                    .cloned(),
            )
            .collect();
        let ordered = prefer_listed(&rsa_first, &listed);
        assert_eq!(ordered.first(), Some(&Algorithm::Ed25519));
        assert_eq!(ordered.len(), rsa_first.len());
        let ordered = prefer_listed(&default, &[Algorithm::Rsa { hash: None }]);
        assert!(matches!(ordered.first(), Some(Algorithm::Rsa { .. })));
    }

    #[test]
    fn new_entries_use_the_bracketed_form_for_other_ports() {
        let line = entry_line("10.0.0.1", 2222, &key(ED));
        assert_eq!(line, format!("[10.0.0.1]:2222 ssh-ed25519 {ED}\n"));
        let k = kh(&line);
        assert!(matches!(
            k.check("10.0.0.1", 2222, &key(ED)),
            Verdict::Known { .. }
        ));
    }

    #[test]
    fn wildcards() {
        assert!(wildcard_match("*", "x"));
        assert!(wildcard_match("a*c", "abbbc"));
        assert!(wildcard_match("a?c", "abc"));
        assert!(!wildcard_match("a?c", "abbc"));
        assert!(!wildcard_match("abc", "abcd"));
    }
}
