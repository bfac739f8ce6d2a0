//! Session records of the user daemon: what a restarted user daemon needs to
//! bring a session back (the CLI's StartSession request, the listener address
//! the root daemon dials), one JSON file per session.
//!
//! Where: `$XDG_STATE_HOME/kvpn/sessions/<key>/<session id>.json` (else
//! `~/.local/state/kvpn/...`), folders 0700 and files 0600 — a record holds
//! the CLI's environment and possibly SSH passwords. `<key>` names the user
//! daemon by its socket path, so user daemons of different runtime folders (one
//! per laptop netns in the tests) never pick up each other's sessions.
//!
//! I/O: those files only.

use std::io::Write as _;
use std::net::SocketAddr;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

use data_encoding::BASE64;
use kvpn_proto::userd::StartSessionRequest;
use prost::Message as _;
use serde::{Deserialize, Serialize};

/// Format version of a record file.
pub const RECORD_VERSION: u32 = 1;

/// One session as the user daemon persists it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SessionRecord {
    pub version: u32,
    /// The root daemon's session id.
    pub id: String,
    /// The loopback listener the root daemon dials for the data channel.
    pub data_addr: SocketAddr,
    /// When the session was started (Unix time, ms).
    pub created_unix_ms: u64,
    /// How many times a restarted user daemon brought it back.
    pub restores: u32,
    /// For messages about a lost session.
    pub cluster: String,
    pub context: String,
    pub namespace: String,
    pub tunnel_ip: String,
    pub tun_name: String,
    /// The CLI's StartSession request, protobuf, base64.
    pub request: String,
    /// The root daemon's runtime folder the recording user daemon serves
    /// (`kvpn quit --every-runtime-dir` quits there); empty in records of an
    /// older kvpn.
    #[serde(default)]
    pub runtime_dir: String,
    /// The network namespace the session was made in, as the link
    /// `/proc/self/ns/net` names it (`net:[4026532345]`); empty in records of
    /// an older kvpn.
    #[serde(default)]
    pub netns: String,
}

impl SessionRecord {
    /// A record of a session just started.
    /// `made_in`: the root daemon's runtime folder and the network namespace
    /// ([`current_netns`]) of the user daemon that records it.
    pub fn new(
        id: &str,
        data_addr: SocketAddr,
        tun_name: &str,
        created_unix_ms: u64,
        request: &StartSessionRequest,
        made_in: (&Path, &str),
    ) -> Self {
        let origin = request
            .connect
            .as_ref()
            .and_then(|c| c.origin.clone())
            .unwrap_or_default();
        SessionRecord {
            version: RECORD_VERSION,
            id: id.to_owned(),
            data_addr,
            created_unix_ms,
            restores: 0,
            cluster: origin.cluster,
            context: origin.context,
            namespace: request.connected_namespace.clone(),
            tunnel_ip: request
                .connect
                .as_ref()
                .map(|c| c.tunnel_ip.clone())
                .unwrap_or_default(),
            tun_name: tun_name.to_owned(),
            request: BASE64.encode(&request.encode_to_vec()),
            runtime_dir: made_in.0.display().to_string(),
            netns: made_in.1.to_owned(),
        }
    }

    /// The StartSession request inside.
    pub fn request(&self) -> Result<StartSessionRequest, String> {
        let bytes = BASE64
            .decode(self.request.as_bytes())
            .map_err(|e| format!("bad base64: {e}"))?;
        StartSessionRequest::decode(bytes.as_slice()).map_err(|e| format!("bad protobuf: {e}"))
    }
}

/// FNV-1a (64 bit) of `bytes`, hex: a short stable folder name.
fn fnv1a_hex(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// `$XDG_STATE_HOME/kvpn` when that is absolute, else `$HOME/.local/state/kvpn`.
pub fn state_dir(xdg_state_home: Option<&Path>, home: Option<&Path>) -> Option<PathBuf> {
    xdg_state_home
        .filter(|p| p.is_absolute())
        .map(Path::to_path_buf)
        .or_else(|| {
            home.filter(|p| p.is_absolute())
                .map(|h| h.join(".local").join("state"))
        })
        .map(|d| d.join("kvpn"))
}

/// This process's network namespace as the link `/proc/self/ns/net` names it
/// (`net:[INODE]`); empty when it cannot be read.
pub fn current_netns() -> String {
    std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.display().to_string())
        .unwrap_or_default()
}

/// This process's state folder (`$XDG_STATE_HOME/kvpn`, else
/// `~/.local/state/kvpn`), `None` when neither is an absolute path.
pub fn current_state_dir() -> Option<PathBuf> {
    let xdg = std::env::var_os("XDG_STATE_HOME").map(PathBuf::from);
    let home = std::env::var_os("HOME").map(PathBuf::from);
    state_dir(xdg.as_deref(), home.as_deref())
}

/// Every readable record under `state_dir` (all user daemons' stores) made in
/// network namespace `netns`, with its file.
pub fn records_made_in(state_dir: &Path, netns: &str) -> Vec<(PathBuf, SessionRecord)> {
    let mut out = Vec::new();
    if netns.is_empty() {
        return out;
    }
    let Ok(stores) = std::fs::read_dir(state_dir.join("sessions")) else {
        return out;
    };
    for store in stores.flatten() {
        let Ok(files) = std::fs::read_dir(store.path()) else {
            continue;
        };
        for f in files.flatten() {
            let path = f.path();
            if path.extension().is_none_or(|x| x != "json") {
                continue;
            }
            if let Some(r) = std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice::<SessionRecord>(&b).ok())
                .filter(|r| r.netns == netns)
            {
                out.push((path, r));
            }
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The session records of one user daemon.
#[derive(Debug, Clone)]
pub struct Store {
    dir: PathBuf,
}

impl Store {
    /// The store of the user daemon listening on `socket`, under `state_dir`.
    pub fn new(state_dir: &Path, socket: &Path) -> Self {
        Store {
            dir: state_dir
                .join("sessions")
                .join(fnv1a_hex(socket.as_os_str().as_encoded_bytes())),
        }
    }

    /// This process's store for `socket` (from its XDG_STATE_HOME / HOME).
    pub fn current(socket: &Path) -> std::io::Result<Self> {
        let dir = current_state_dir().ok_or_else(|| {
            std::io::Error::other(
                "neither XDG_STATE_HOME nor HOME is an absolute path: nowhere to keep session \
                 state — set one of them",
            )
        })?;
        Ok(Store::new(&dir, socket))
    }

    /// The folder of the records.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    /// Write `record` (atomically: a temporary file renamed over the old one).
    pub fn save(&self, record: &SessionRecord) -> std::io::Result<()> {
        let path = self.path(&record.id);
        let tmp = path.with_extension("json.tmp");
        let text = serde_json::to_vec_pretty(record).map_err(std::io::Error::other)?;
        let open = || {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&self.dir)?;
            std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)
        };
        // The folder goes away with its last record (`remove`): if that raced
        // with this save, make it again.
        let mut f = match open() {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => open()?,
            other => other?,
        };
        f.write_all(&text)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
    }

    /// Forget session `id` (no error when it was not recorded).
    /// The folder goes with its last record.
    pub fn remove(&self, id: &str) -> std::io::Result<()> {
        match std::fs::remove_file(self.path(id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        self.remove_dir_if_empty();
        Ok(())
    }

    /// Remove the folder when no file is left in it (`rmdir` refuses otherwise),
    /// so that disconnected sessions leave no empty folders under `sessions/`.
    fn remove_dir_if_empty(&self) {
        let _ = std::fs::remove_dir(&self.dir);
    }

    /// Every readable record, and a message for each file that is not one.
    pub fn load_all(&self) -> (Vec<SessionRecord>, Vec<String>) {
        let mut records = Vec::new();
        let mut problems = Vec::new();
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return (records, problems);
        };
        for e in entries.flatten() {
            let path = e.path();
            if path.extension().is_none_or(|x| x != "json") {
                continue;
            }
            match std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| {
                    serde_json::from_slice::<SessionRecord>(&b).map_err(|e| e.to_string())
                }) {
                Ok(r) if r.version == RECORD_VERSION => records.push(r),
                Ok(r) => problems.push(format!(
                    "{}: record version {} (this kvpn reads {RECORD_VERSION})",
                    path.display(),
                    r.version
                )),
                Err(e) => problems.push(format!("{}: {e}", path.display())),
            }
        }
        records.sort_by(|a, b| a.id.cmp(&b.id));
        (records, problems)
    }

    /// Whether any record (readable or not) is there.
    pub fn any(&self) -> bool {
        std::fs::read_dir(&self.dir).is_ok_and(|mut d| {
            d.any(|e| e.is_ok_and(|e| e.path().extension().is_some_and(|x| x == "json")))
        })
    }

    /// Remove every record file (after the sessions ended).
    pub fn clear(&self) -> std::io::Result<()> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Ok(());
        };
        for e in entries.flatten() {
            if e.path()
                .extension()
                .is_some_and(|x| x == "json" || x == "tmp")
            {
                std::fs::remove_file(e.path())?;
            }
        }
        self.remove_dir_if_empty();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    #[test]
    fn state_dir_follows_xdg_then_home() {
        let p = |s: &str| PathBuf::from(s);
        assert_eq!(
            state_dir(Some(&p("/x/state")), Some(&p("/home/a"))),
            Some(p("/x/state/kvpn"))
        );
        assert_eq!(
            state_dir(Some(&p("relative")), Some(&p("/home/a"))),
            Some(p("/home/a/.local/state/kvpn"))
        );
        assert_eq!(state_dir(None, None), None);
    }

    /// T7: the records of every store made in one network namespace are found
    /// (with their runtime folders), those of another namespace are not.
    #[test]
    fn records_are_found_by_the_network_namespace_they_were_made_in() {
        let base = std::env::temp_dir().join(format!("kvpn-record-netns-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let req = StartSessionRequest::default();
        let addr: SocketAddr = "127.0.0.1:4000".parse().expect("addr");
        let lab = "net:[4026532001]";
        for (socket, rt, id, netns) in [
            ("/lab/rt/user.sock", "/lab/rt", "s1", lab),
            ("/custom/user.sock", "/custom", "s2", lab),
            ("/run/kvpn/user.sock", "/run/kvpn", "s3", "net:[4026531840]"),
        ] {
            Store::new(&base, Path::new(socket))
                .save(&SessionRecord::new(
                    id,
                    addr,
                    "kvpn0",
                    1,
                    &req,
                    (Path::new(rt), netns),
                ))
                .expect("save");
        }
        let found = records_made_in(&base, lab);
        let mut got: Vec<(&str, &str)> = found
            .iter()
            .map(|(_, r)| (r.id.as_str(), r.runtime_dir.as_str()))
            .collect();
        got.sort_unstable();
        assert_eq!(got, vec![("s1", "/lab/rt"), ("s2", "/custom")]);
        assert!(
            found
                .iter()
                .all(|(p, _)| p.starts_with(base.join("sessions")))
        );
        assert!(records_made_in(&base, "").is_empty());
        // A record of an older kvpn (no such fields) is read, and is nobody's.
        let old = serde_json::json!({"version": 1, "id": "s0", "data_addr": "127.0.0.1:1",
            "created_unix_ms": 1, "restores": 0, "cluster": "", "context": "", "namespace": "",
            "tunnel_ip": "", "tun_name": "", "request": ""});
        let r: SessionRecord = serde_json::from_value(old).expect("old record");
        assert_eq!((r.runtime_dir.as_str(), r.netns.as_str()), ("", ""));
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn records_round_trip_private_and_per_socket() {
        let base = std::env::temp_dir().join(format!("kvpn-record-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let a = Store::new(&base, Path::new("/run/a/user.sock"));
        let b = Store::new(&base, Path::new("/run/b/user.sock"));
        assert_ne!(a.dir(), b.dir());
        let req = StartSessionRequest {
            kubeconfig: "/k".into(),
            connected_namespace: "default".into(),
            connect: Some(kvpn_proto::dataplane::ConnectRequest {
                tunnel_ip: "100.96.0.2".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let addr = "127.0.0.1:4567".parse().expect("addr");
        let r = SessionRecord::new(
            "s1",
            addr,
            "kvpn0",
            42,
            &req,
            (Path::new("/tmp/rt"), "net:[4026532001]"),
        );
        a.save(&r).expect("save");
        let (loaded, problems) = a.load_all();
        assert_eq!(loaded, vec![r.clone()]);
        assert!(problems.is_empty());
        assert_eq!(loaded[0].request().expect("request"), req);
        assert_eq!(loaded[0].tunnel_ip, "100.96.0.2");
        assert!(b.load_all().0.is_empty(), "another daemon's store is empty");
        let mode = |p: &Path| std::fs::metadata(p).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode(a.dir()), 0o700);
        assert_eq!(mode(&a.dir().join("s1.json")), 0o600);
        std::fs::write(a.dir().join("bad.json"), b"{").expect("write");
        let (loaded, problems) = a.load_all();
        assert_eq!(loaded.len(), 1);
        assert_eq!(problems.len(), 1, "{problems:?}");
        a.remove("s1").expect("remove");
        a.remove("s1").expect("remove twice");
        assert!(a.any(), "the bad file is still there");
        a.clear().expect("clear");
        assert!(!a.any());
        assert!(!a.dir().exists(), "no empty record folder is left");
        // The last record's removal takes the folder; a save makes it again.
        a.save(&r).expect("save again");
        assert_eq!(mode(a.dir()), 0o700);
        a.remove("s1").expect("remove");
        assert!(!a.dir().exists(), "no empty record folder after disconnect");
        let _ = std::fs::remove_dir_all(&base);
    }
}
