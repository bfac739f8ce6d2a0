//! End-to-end: `kvpn version` (issue #22 item 6) on the Kubernetes lab. Before
//! any connect it names the CLI and says both daemons are not running, and
//! starts neither; once connected it names the CLI, the user daemon, the root
//! daemon and the session's traffic manager, each with this build's version
//! and commit, in the table and in `-o json` / `-o yaml`.

use std::time::Duration;

use kvpn_tests::kube_lab::{KVPN_VERSION, KubeFixture};
use serde_json::Value;

/// The build every binary under test comes from (they are built together).
const COMMIT: &str = kvpn_build_info::COMMIT;

fn version_json(f: &KubeFixture) -> Value {
    let out = f.kvpn_ok(&["version", "-o", "json"]);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("kvpn version -o json: {e}: {out}"))
}

#[test]
fn version_names_cli_daemons_and_manager_with_this_build() {
    let f = KubeFixture::new();

    // Nothing runs yet: nothing is started for the answer.
    let before = version_json(&f);
    assert_eq!(before["cli"]["version"], KVPN_VERSION, "{before:#}");
    assert_eq!(before["cli"]["commit"], COMMIT, "{before:#}");
    assert_eq!(before["user_daemon"]["state"], "not_running", "{before:#}");
    assert_eq!(before["root_daemon"]["state"], "not_running", "{before:#}");
    assert_eq!(before["root_daemon"]["version"], Value::Null, "{before:#}");
    assert_eq!(before["managers"], serde_json::json!([]), "{before:#}");
    assert!(
        f.user_daemon_pids().is_empty(),
        "kvpn version started a user daemon"
    );
    assert!(
        !f.runtime_dir().join("dataplane.sock").exists()
            && !f.runtime_dir().join("dataplane.pid").exists(),
        "kvpn version started a root daemon"
    );
    let table = f.kvpn_ok(&["version"]);
    let root_line = table
        .lines()
        .find(|l| l.starts_with("root daemon"))
        .unwrap_or_else(|| panic!("no root daemon line: {table}"));
    assert!(root_line.ends_with("not running"), "{table}");

    f.connect_restricted();
    let session = f.session();
    let id = session["id"].as_str().expect("session id").to_owned();

    let v = version_json(&f);
    for part in ["user_daemon", "root_daemon"] {
        assert_eq!(v[part]["state"], "running", "{part}: {v:#}");
        assert_eq!(v[part]["version"], KVPN_VERSION, "{part}: {v:#}");
        assert_eq!(v[part]["commit"], COMMIT, "{part}: {v:#}");
        assert_eq!(v[part]["note"], Value::Null, "{part}: {v:#}");
        assert!(
            v[part]["pid"].as_u64().is_some_and(|p| p > 1),
            "{part}: {v:#}"
        );
    }
    let user_pids = f.user_daemon_pids();
    assert_eq!(
        v["user_daemon"]["pid"].as_u64(),
        user_pids.first().map(|p| u64::from(*p)),
        "{v:#}"
    );
    let managers = v["managers"].as_array().expect("managers");
    assert_eq!(managers.len(), 1, "{v:#}");
    let m = &managers[0];
    assert_eq!(m["session"], id.as_str(), "{v:#}");
    assert_eq!(m["transport"], "port-forward", "{v:#}");
    assert_eq!(m["namespace"], "kvpn-system", "{v:#}");
    assert_eq!(m["version"], KVPN_VERSION, "the manager's version: {v:#}");
    assert_eq!(m["commit"], COMMIT, "the manager's commit: {v:#}");
    assert_eq!(m["note"], Value::Null, "{v:#}");

    // The table names every part with the same build.
    let table = f.kvpn_ok(&["version"]);
    for part in ["kvpn (CLI)", "user daemon", "root daemon", "manager"] {
        let line = table
            .lines()
            .find(|l| l.starts_with(part))
            .unwrap_or_else(|| panic!("no {part} line: {table}"));
        let cells: Vec<&str> = line[part.len()..].split_whitespace().collect();
        assert_eq!(
            cells.get(..2),
            Some(&[KVPN_VERSION, COMMIT][..]),
            "{part}: {table}"
        );
    }
    assert!(
        !table.contains("  ! "),
        "no notes for a matching build: {table}"
    );
    assert!(
        table.contains(&format!("session {id}: cluster ")),
        "{table}"
    );

    // YAML is the same document.
    let yaml = f.kvpn_ok(&["version", "-o", "yaml"]);
    let y: Value = serde_yaml_ng::from_str(&yaml).unwrap_or_else(|e| panic!("{e}: {yaml}"));
    assert_eq!(y["managers"][0]["commit"], COMMIT, "{yaml}");
    assert_eq!(y["root_daemon"]["version"], KVPN_VERSION, "{yaml}");

    // `kvpn --version` carries the commit too.
    let short = f.kvpn_ok(&["--version"]);
    assert_eq!(
        short.trim(),
        format!("kvpn {KVPN_VERSION} (commit {COMMIT})"),
        "{short}"
    );

    // After quit, nothing runs and nothing is started again.
    f.kvpn_ok(&["quit"]);
    let after = version_json(&f);
    assert_eq!(after["user_daemon"]["state"], "not_running", "{after:#}");
    assert_eq!(after["root_daemon"]["state"], "not_running", "{after:#}");
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        f.user_daemon_pids().is_empty(),
        "kvpn version started a user daemon"
    );
}
