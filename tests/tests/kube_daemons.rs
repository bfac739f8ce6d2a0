//! The user daemon (issue #6): one `kvpn daemon` per user holds every
//! session's port-forward half; `kvpn status -o json|yaml` follows the schema
//! documented in docs/status.md; a SIGKILLed user daemon is restarted by the
//! next `kvpn status` and its sessions come back (or, when the root daemon lost
//! them too, are reported `lost` and cleaned up); `kvpn quit` leaves no process.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
use std::path::Path;
use std::time::{Duration, Instant};

use kvpn_lab::{Addressing, WEB_SERVICE_PORT};
use kvpn_tests::kube_lab::KubeFixture;
use kvpn_tests::text;
use serde_json::Value;

/// The documented fields: path → allowed JSON types ("string", "integer",
/// "boolean", "object", "array", "null").
fn documented() -> BTreeMap<String, BTreeSet<String>> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/status.md");
    let doc =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let mut fields = BTreeMap::new();
    for line in doc.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // "| `path` | type | meaning |" → ["", "`path`", "type", "meaning", ""]
        let (Some(field), Some(ty)) = (cells.get(1), cells.get(2)) else {
            continue;
        };
        let Some(field) = field.strip_prefix('`').and_then(|f| f.strip_suffix('`')) else {
            continue;
        };
        if !(field == "root_daemon"
            || field.starts_with("root_daemon.")
            || field.starts_with("sessions"))
        {
            continue;
        }
        let types: BTreeSet<String> = ty.split(" or ").map(str::to_owned).collect();
        fields.insert(field.to_owned(), types);
    }
    assert!(
        fields.len() > 40,
        "docs/status.md lists its fields: {fields:?}"
    );
    fields
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_u64() || n.is_i64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Every (path, type) of `v`, array elements as `path[]`.
fn flatten(v: &Value, path: &str, out: &mut BTreeSet<(String, &'static str)>) {
    if !path.is_empty() {
        out.insert((path.to_owned(), json_type(v)));
    }
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                flatten(x, &p, out);
            }
        }
        Value::Array(a) => {
            for x in a {
                flatten(x, &format!("{path}[]"), out);
            }
        }
        _ => {}
    }
}

/// The status document matches docs/status.md both ways: every field it has
/// is documented with its type, and every documented session field (one level
/// below `sessions[]`) and `root_daemon.running` are there.
fn check_schema(doc: &Value, what: &str) {
    let fields = documented();
    let mut seen = BTreeSet::new();
    flatten(doc, "", &mut seen);
    for (path, ty) in &seen {
        let allowed = fields
            .get(path)
            .unwrap_or_else(|| panic!("{what}: field {path} ({ty}) is not in docs/status.md"));
        assert!(
            allowed.contains(*ty),
            "{what}: {path} is {ty}, docs/status.md says {allowed:?}"
        );
    }
    assert_eq!(doc["root_daemon"]["running"], true, "{what}: {doc:#}");
    let sessions = doc["sessions"].as_array().cloned().unwrap_or_default();
    assert!(!sessions.is_empty(), "{what}: no session");
    for s in &sessions {
        for field in fields.keys() {
            let Some(key) = field.strip_prefix("sessions[].") else {
                continue;
            };
            if key.contains('.') || key.contains('[') {
                continue;
            }
            assert!(
                s.get(key).is_some(),
                "{what}: documented field sessions[].{key} missing from {s:#}"
            );
        }
    }
}

fn web(a: &Addressing) -> SocketAddr {
    SocketAddr::from((a.web_cluster_ip(), WEB_SERVICE_PORT))
}

fn wait_connected(f: &KubeFixture, n: usize, within: Duration) -> Vec<Value> {
    let t0 = Instant::now();
    loop {
        let sessions = f.sessions();
        if sessions.len() == n && sessions.iter().all(|s| s["state"] == "connected") {
            return sessions;
        }
        assert!(
            t0.elapsed() < within,
            "not {n} connected sessions within {within:?}: {sessions:#?}\n{}",
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(") ")
            .is_some_and(|(_, r)| !r.starts_with('Z') && !r.starts_with('X'))
    })
}

fn sigkill_and_wait(pid: u32) {
    // SAFETY: kill with a pid of this fixture's user daemon (found by its command line).
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let t0 = Instant::now();
    while alive(pid) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "{pid} survived SIGKILL"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A `curl` loop in the laptop netns, one line `<unix ns> <http code>` per
/// request, killed (by pid) on drop.
struct CurlLoop {
    child: std::process::Child,
    out: std::path::PathBuf,
}

impl CurlLoop {
    fn start(f: &KubeFixture, target: SocketAddr) -> Self {
        let out = f.lab().netns_lab().dir().join("curl-loop.txt");
        let file = std::fs::File::create(&out).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
        let script = format!(
            "while :; do c=$(curl -s -o /dev/null -w '%{{http_code}}' --max-time 1 http://{target}/); \
             echo \"$(date +%s%N) $c\"; sleep 0.05; done"
        );
        let child = f
            .lab()
            .netns_lab()
            .command_in(kvpn_lab::LAPTOP, "sh")
            .unwrap_or_else(|e| panic!("laptop netns: {e:#}"))
            .args(["-c", &script])
            .stdout(file)
            .spawn()
            .unwrap_or_else(|e| panic!("curl loop: {e}"));
        CurlLoop { child, out }
    }

    /// (unix ns, ok) of each request so far.
    fn results(&self) -> Vec<(u128, bool)> {
        std::fs::read_to_string(&self.out)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let (t, c) = l.split_once(' ')?;
                Some((t.parse().ok()?, c == "200"))
            })
            .collect()
    }
}

impl Drop for CurlLoop {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn unix_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

fn records(f: &KubeFixture) -> Vec<String> {
    let mut found = Vec::new();
    let base = f.state_dir().join("kvpn").join("sessions");
    for d in std::fs::read_dir(&base).into_iter().flatten().flatten() {
        for e in std::fs::read_dir(d.path()).into_iter().flatten().flatten() {
            found.push(e.file_name().to_string_lossy().into_owned());
        }
    }
    found.sort();
    found
}

#[test]
fn two_sessions_one_user_daemon_schema_sigkill_restore_and_quit() {
    let mut f = KubeFixture::new();
    let b = f.add_cluster(Addressing::second());
    let b_kubeconfig = f
        .cluster(b)
        .laptop_user_kubeconfig()
        .to_string_lossy()
        .into_owned();
    f.connect_restricted();
    f.kvpn_ok(&["connect", "--kubeconfig", &b_kubeconfig]);
    let sessions = wait_connected(&f, 2, Duration::from_secs(20));

    // The split: one user daemon for both sessions, no per-session agents, one
    // loopback listener per session, where the root daemon dials.
    let daemons = f.user_daemon_pids();
    assert_eq!(
        daemons.len(),
        1,
        "one user daemon for two sessions: {daemons:?}"
    );
    assert!(f.agent_pids().is_empty(), "no `kvpn agent` processes");
    let mut listeners = f.session_listeners();
    listeners.sort();
    let mut dialled: Vec<String> = sessions
        .iter()
        .map(|s| s["manager"].as_str().unwrap_or_default().to_owned())
        .collect();
    dialled.sort();
    assert_eq!(listeners, dialled, "one listener per session");
    let socket = f.runtime_dir().join("user.sock");
    let meta = std::fs::metadata(&socket).unwrap_or_else(|e| panic!("{}: {e}", socket.display()));
    assert!(
        meta.file_type().is_socket(),
        "{} is a socket",
        socket.display()
    );
    assert_eq!(
        meta.permissions().mode() & 0o777,
        0o600,
        "user daemon socket mode"
    );
    let pid_file = std::fs::read_to_string(f.runtime_dir().join("user.pid")).unwrap_or_default();
    assert_eq!(pid_file.trim(), daemons[0].to_string(), "pid file");
    assert_eq!(
        records(&f).len(),
        2,
        "two session records: {:?}",
        records(&f)
    );

    // Status: JSON and YAML are the same document and follow docs/status.md.
    let json = f.status_json();
    check_schema(&json, "status -o json");
    let yaml_text = f.kvpn_ok(&["status", "-o", "yaml"]);
    let yaml: Value = serde_yaml_ng::from_str(&yaml_text)
        .unwrap_or_else(|e| panic!("status -o yaml does not parse: {e}\n{yaml_text}"));
    check_schema(&yaml, "status -o yaml");
    let summary = |doc: &Value| -> Vec<(Value, Value, Value, Value, Value)> {
        doc["sessions"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|s| {
                        (
                            s["id"].clone(),
                            s["cluster"].clone(),
                            s["tunnel_ip"].clone(),
                            s["tun_name"].clone(),
                            s["namespace"].clone(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(summary(&yaml), summary(&json), "YAML and JSON agree");
    for s in json["sessions"].as_array().into_iter().flatten() {
        assert_eq!(s["transport"], "port-forward", "{s:#}");
        assert_eq!(s["namespace"], "kvpn-system", "{s:#}");
        assert_eq!(s["user_daemon"]["state"], "running", "{s:#}");
        assert_eq!(s["user_daemon"]["restores"], 0, "{s:#}");
    }
    let table = f.kvpn_ok(&["status"]);
    for col in [
        "ID",
        "CLUSTER",
        "CONTEXT",
        "NAMESPACE",
        "TRANSPORT",
        "TUNNEL IP",
        "TUN",
        "STATE",
    ] {
        assert!(table.contains(col), "table column {col}: {table}");
    }
    assert!(
        table.contains(f.cluster_name()) && table.contains(&f.cluster(b).state().cluster_name),
        "{table}"
    );

    // SIGKILL of the user daemon in the middle of traffic.
    let a_web = web(&Addressing::default());
    let tun_before: Vec<_> = sessions
        .iter()
        .map(|s| f.tun_state(s["tun_name"].as_str().unwrap_or_default()))
        .collect();
    let curl = CurlLoop::start(&f, a_web);
    let t0 = Instant::now();
    while !curl.results().iter().any(|(_, ok)| *ok) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "curl loop never succeeded: {:?}",
            curl.results()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let killed_at = unix_ns();
    let t_kill = Instant::now();
    sigkill_and_wait(daemons[0]);
    assert!(f.user_daemon_pids().is_empty(), "the user daemon is dead");
    // The next command starts it again; it brings both sessions back.
    let t_status = Instant::now();
    let after = f.sessions();
    assert_eq!(
        after.len(),
        2,
        "both sessions listed after the restart: {after:#?}"
    );
    let new = f.user_daemon_pids();
    assert_eq!(new.len(), 1, "one new user daemon: {new:?}");
    assert_ne!(new, daemons, "a new process");
    let sessions2 = wait_connected(&f, 2, Duration::from_secs(15));
    let (back, _) = f.wait_http(a_web, t_status, Duration::from_secs(15));
    let mut ids: Vec<&Value> = sessions.iter().map(|s| &s["id"]).collect();
    let mut ids2: Vec<&Value> = sessions2.iter().map(|s| &s["id"]).collect();
    ids.sort_by_key(|v| v.to_string());
    ids2.sort_by_key(|v| v.to_string());
    assert_eq!(ids, ids2, "the same sessions came back");
    for s in &sessions2 {
        assert_eq!(s["user_daemon"]["restores"], 1, "{s:#}");
        assert_eq!(s["user_daemon"]["state"], "running", "{s:#}");
    }
    let tun_after: Vec<_> = sessions
        .iter()
        .map(|s| f.tun_state(s["tun_name"].as_str().unwrap_or_default()))
        .collect();
    assert_eq!(
        tun_after, tun_before,
        "same TUN devices, addresses and routes"
    );
    let mut listeners2 = f.session_listeners();
    listeners2.sort();
    assert_eq!(listeners2, listeners, "the same loopback addresses again");
    // The curl loop sees traffic again after the restart.
    let t1 = Instant::now();
    let first_ok_after = loop {
        if let Some((t, _)) = curl
            .results()
            .into_iter()
            .find(|(t, ok)| *ok && *t > killed_at)
        {
            break t;
        }
        assert!(
            t1.elapsed() < Duration::from_secs(10),
            "curl loop never recovered: {:?}",
            curl.results()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let outage_ms = (first_ok_after - killed_at) / 1_000_000;
    let failed = curl
        .results()
        .iter()
        .filter(|(t, ok)| !ok && *t > killed_at)
        .count();
    drop(curl);
    eprintln!(
        "user daemon SIGKILL: next `kvpn status` {:.0} ms after the kill; HTTP back {:.0} ms after that \
         status; curl loop outage {outage_ms} ms (kill → first 200; {failed} failed requests, most while \
         no command ran)",
        (t_status - t_kill).as_secs_f64() * 1000.0,
        back.as_secs_f64() * 1000.0,
    );

    // Logs of both daemons.
    let logs = f.kvpn_ok(&["logs", "-n", "50"]);
    assert!(
        logs.contains("==> user daemon log") && logs.contains("==> root daemon log"),
        "{logs}"
    );
    assert!(logs.contains("session restored"), "{logs}");

    // Disconnect one: its listener and record go, the other stays.
    let b_id = sessions2
        .iter()
        .find(|s| s["cluster"] == f.cluster(b).state().cluster_name.as_str())
        .map(|s| s["id"].as_str().unwrap_or_default().to_owned())
        .unwrap_or_else(|| panic!("no session of cluster b: {sessions2:#?}"));
    let out = f.kvpn_ok(&["disconnect", &b_id]);
    assert!(
        out.contains(&format!("Disconnected session {b_id}")),
        "{out}"
    );
    assert_eq!(f.sessions().len(), 1);
    assert_eq!(f.session_listeners().len(), 1, "one listener left");
    assert_eq!(records(&f).len(), 1, "one record left: {:?}", records(&f));
    f.page(a_web);

    // Quit: no process of this fixture's kvpn is left, nor a socket or record.
    let root_pid: u32 = std::fs::read_to_string(f.runtime_dir().join("dataplane.pid"))
        .ok()
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("root daemon pid file"));
    let out = f.kvpn_ok(&["quit"]);
    assert!(out.contains("Disconnected session"), "{out}");
    assert!(
        f.user_daemon_pids().is_empty(),
        "user daemon left after quit"
    );
    assert!(!alive(root_pid), "root daemon left after quit");
    assert!(!socket.exists(), "user daemon socket left");
    assert!(
        !f.runtime_dir().join("dataplane.sock").exists(),
        "root daemon socket left"
    );
    assert!(records(&f).is_empty(), "records left: {:?}", records(&f));
    assert!(
        f.tun_devices().is_empty(),
        "TUN devices left: {:?}",
        f.tun_devices()
    );
    // A status afterwards starts nothing.
    let st = f.kvpn_ok(&["status", "-o", "json"]);
    let st: Value = serde_json::from_str(&st).unwrap_or_else(|e| panic!("{e}: {st}"));
    assert_eq!(st["sessions"], serde_json::json!([]));
    assert_eq!(st["root_daemon"]["running"], false);
    assert!(
        f.user_daemon_pids().is_empty(),
        "status started a user daemon"
    );
}

/// When the root daemon died too, a restarted user daemon cannot bring the
/// session back: `kvpn status` shows it `lost` with the reason, its record is
/// gone, and `kvpn disconnect ID` removes it from the list.
#[test]
fn sigkill_of_both_daemons_reports_the_session_lost_never_half_alive() {
    let f = KubeFixture::new();
    f.connect_restricted();
    f.wait_state("connected", Duration::from_secs(15));
    let id = f.session()["id"].as_str().unwrap_or_default().to_owned();
    let user = f.user_daemon_pids();
    assert_eq!(user.len(), 1);
    let root_pid: u32 = std::fs::read_to_string(f.runtime_dir().join("dataplane.pid"))
        .ok()
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("root daemon pid file"));
    sigkill_and_wait(user[0]);
    sigkill_and_wait(root_pid);

    let t0 = Instant::now();
    let s = loop {
        let out = f.kvpn(&["status", "-o", "json"]);
        let doc: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "status JSON: {e}: {}{}",
                text(&out.stdout),
                text(&out.stderr)
            )
        });
        let sessions = doc["sessions"].as_array().cloned().unwrap_or_default();
        assert_eq!(sessions.len(), 1, "{doc:#}");
        if sessions[0]["state"] == "lost" {
            break sessions[0].clone();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "not lost within 10 s: {doc:#}\n{}",
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(s["id"], id.as_str());
    let reason = s["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("root daemon") && reason.contains("kvpn connect"),
        "the reason names the cause and the fix: {reason}"
    );
    assert_eq!(s["user_daemon"]["state"], "lost", "{s:#}");
    assert!(
        f.session_listeners().is_empty(),
        "a lost session listens nowhere"
    );
    assert!(
        records(&f).is_empty(),
        "its record is gone: {:?}",
        records(&f)
    );
    let out = f.kvpn_ok(&["disconnect", &id]);
    assert!(out.contains(&format!("Disconnected session {id}")), "{out}");
    let st = f.kvpn(&["status", "-o", "json"]);
    let doc: Value = serde_json::from_slice(&st.stdout).unwrap_or_default();
    assert_eq!(doc["sessions"], serde_json::json!([]), "{doc:#}");
}
