//! `kvpn diagnose source` with only a `kvpn run` session up (trial F10): from
//! outside the run its routes carry nothing of diagnose's, so a target only the
//! run routes is refused naming the run session and the two ways on; from inside
//! the run (`kvpn run -- kvpn diagnose source …`) the trace passes.
//!
//! Needs the workspace binaries (`KVPN_BIN_DIR`) and the Kubernetes binaries.

use std::process::Stdio;
use std::time::{Duration, Instant};

use kvpn_lab::{WEB_CLUSTER_IP, WEB_SERVICE_PORT};
use kvpn_tests::kube_lab::KubeFixture;
use kvpn_tests::text;

/// Kills the background `kvpn run` when dropped (also when the test fails).
struct Reap(std::process::Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn diagnose_outside_a_run_is_refused_naming_the_run_and_passes_inside_it() {
    let f = KubeFixture::new();
    let kubeconfig = f.user_kubeconfig();
    let target = format!("{WEB_CLUSTER_IP}:{WEB_SERVICE_PORT}");
    let _run = Reap(
        f.kvpn_command(&["run", "--kubeconfig", &kubeconfig, "--", "sleep", "90"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn kvpn run: {e}")),
    );
    // The run's session, connected.
    let t0 = Instant::now();
    let id = loop {
        let s = f.sessions();
        if let Some(run) = s
            .iter()
            .find(|s| s["run_cgroup"].is_string() && s["state"] == "connected")
        {
            break run["id"].as_str().unwrap_or_default().to_owned();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no connected run session: {s:#?}\n{}",
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(200));
    };

    let outside = f.kvpn(&["diagnose", "source", &target]);
    let err = text(&outside.stderr);
    assert!(!outside.status.success(), "{}", text(&outside.stdout));
    assert!(
        err.contains(&format!("routed only by the `kvpn run` session {id}"))
            && err.contains("-- kvpn diagnose source")
            && err.contains("kvpn connect"),
        "{err}"
    );

    let kvpn = kvpn_lab::bin_path("kvpn").unwrap_or_else(|e| panic!("kvpn binary: {e:#}"));
    let kvpn = kvpn.to_string_lossy().into_owned();
    let inside = f.kvpn(&[
        "run",
        "--kubeconfig",
        &kubeconfig,
        "--",
        &kvpn,
        "diagnose",
        "source",
        &target,
    ]);
    let out = text(&inside.stdout);
    assert!(
        inside.status.success() && out.contains("outcome") && out.contains("answered"),
        "{out}\n{}",
        text(&inside.stderr)
    );
}

/// A name whose nameserver stays silent: `kvpn diagnose source NAME:PORT` says
/// "no answer within 5 s" and exits then, not when the laptop's resolver gives
/// up after its retries (trial T6: 18 s).
#[test]
fn diagnose_by_name_with_a_silent_nameserver_ends_after_its_5_s_bound() {
    let f = KubeFixture::new();
    let kubeconfig = f.user_kubeconfig();
    f.kvpn_ok(&["connect", "--kubeconfig", &kubeconfig]);
    f.wait_state("connected", Duration::from_secs(20));
    // Every nameserver of the laptop netns silent (kvpn's forwarder included):
    // queries dropped on input (a drop on output fails the send at once).
    let table = format!("kvpn_silent_{}", std::process::id());
    let nft = |args: &[&str]| {
        let o = f.laptop(args);
        assert!(o.status.success(), "{args:?}: {}", text(&o.stderr));
    };
    nft(&["nft", "add", "table", "ip", &table]);
    nft(&[
        "nft",
        "add chain ip",
        &table,
        "in { type filter hook input priority 0 ; policy accept ; }",
    ]);
    nft(&["nft", &format!("add rule ip {table} in udp dport 53 drop")]);
    nft(&["nft", &format!("add rule ip {table} in tcp dport 53 drop")]);
    let t0 = Instant::now();
    let out = f.kvpn(&["diagnose", "source", "web.default:80"]);
    let took = t0.elapsed();
    let _ = f.laptop(&["nft", "delete", "table", "ip", &table]);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{}", text(&out.stdout));
    assert!(err.contains("no answer within 5 s"), "{err}");
    assert!(
        took < Duration::from_secs(9),
        "diagnose said 5 s and took {took:?}: {err}"
    );
}
