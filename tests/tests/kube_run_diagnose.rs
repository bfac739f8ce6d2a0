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
