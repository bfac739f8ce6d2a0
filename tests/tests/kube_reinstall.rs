//! A traffic manager reinstalled under a connected laptop: `kvpn uninstall`
//! names the live leases of other laptops and asks for `--force`; after the
//! reinstall (a new CA in Secret kvpn-manager-tls, no old leases), the other
//! laptop's user daemon reads the new CA, leases again and replaces its session
//! on its own. `kvpn connect` on a session that is not connected does not
//! answer "nothing to do".
//!
//! Two laptop netns on one lab cluster, each with its own root daemon, user
//! daemon and kvpn config folder (own client id, own lease).
//!
//! Needs the workspace binaries (`cargo build --bins`, then `KVPN_BIN_DIR`) and the
//! Kubernetes binaries of `scripts/build-kubernetes.sh`.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kvpn_lab::WEB_SERVICE_PORT;
use kvpn_tests::kube_lab::{KubeFixture, Laptop, MANAGER_NAMESPACE};
use kvpn_tests::text;

/// The CA (ca.crt) of Secret kvpn-manager-tls.
fn manager_ca(f: &KubeFixture) -> Vec<u8> {
    let api: Api<Secret> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    let secret = f
        .block_on(api.get("kvpn-manager-tls"))
        .unwrap_or_else(|e| panic!("Secret kvpn-manager-tls: {e}"));
    secret
        .data
        .and_then(|d| d.get("ca.crt").cloned())
        .map(|b| b.0)
        .unwrap_or_else(|| panic!("no ca.crt in Secret kvpn-manager-tls"))
}

/// The only session of laptop `l`, polled until `done` holds for it.
fn wait_session_of(
    l: &Laptop,
    within: Duration,
    what: &str,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let t0 = Instant::now();
    loop {
        let sessions = l.sessions();
        if let [s] = sessions.as_slice()
            && done(s)
        {
            return s.clone();
        }
        assert!(
            t0.elapsed() < within,
            "laptop2: no session {what} within {within:?}: {sessions:#?}\n{}",
            l.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn curl_web(l: &Laptop) -> Result<String, String> {
    let url = format!(
        "http://{}:{WEB_SERVICE_PORT}/",
        kvpn_lab::Addressing::default().web_cluster_ip()
    );
    let out = l.exec(&["curl", "-sS", "--max-time", "5", &url]);
    if out.status.success() {
        Ok(text(&out.stdout))
    } else {
        Err(text(&out.stderr))
    }
}

#[test]
fn a_reinstall_needs_force_naming_other_laptops_which_then_renew_their_session_on_their_own() {
    let mut f = KubeFixture::new();
    f.add_laptop("laptop2");
    let kubeconfig = f.user_kubeconfig();
    f.connect_restricted();
    f.wait_state("connected", Duration::from_secs(15));
    let l2 = f.laptop_of("laptop2");
    let kubeconfig2 = l2.lab.user_kubeconfig.to_string_lossy().into_owned();
    l2.connect_restricted();
    let s2 = wait_session_of(l2, Duration::from_secs(15), "connected", |s| {
        s["state"] == "connected"
    });
    let ip2 = s2["tunnel_ip"].as_str().unwrap_or_default().to_owned();
    let old_id2 = s2["id"].as_str().unwrap_or_default().to_owned();
    let ip1 = f.session()["tunnel_ip"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(curl_web(l2).is_ok(), "laptop2 reaches the cluster");
    let old_ca = manager_ca(&f);

    // Uninstall from laptop 1 without --force: refused, naming laptop 2's lease
    // (its tunnel IP), not laptop 1's own; nothing is removed or disconnected.
    let refused = f.kvpn(&["uninstall", "--kubeconfig", &kubeconfig]);
    let said = format!("{}{}", text(&refused.stdout), text(&refused.stderr));
    assert!(
        !refused.status.success(),
        "uninstall without --force: {said}"
    );
    assert!(
        said.contains(&ip2) && said.contains("--force") && said.contains("live leases"),
        "the refusal names laptop2's lease and the flag: {said}"
    );
    assert!(
        !said.contains(&format!("{ip1} ")),
        "laptop 1's own lease is not counted: {said}"
    );
    assert_eq!(f.session()["state"], "connected", "laptop 1 untouched");
    assert_eq!(manager_ca(&f), old_ca, "the manager is still the same");
    assert!(curl_web(l2).is_ok(), "laptop2 still reaches the cluster");

    // With --force: removed, with the same names in a warning.
    let forced = f.kvpn_ok(&["uninstall", "--kubeconfig", &kubeconfig, "--force"]);
    assert!(forced.contains("Removed the traffic manager"), "{forced}");

    // Laptop 1 connects again: a new manager with a new CA.
    let out1 = f.connect_restricted();
    assert!(out1.contains("Installing traffic manager"), "{out1}");
    f.wait_state("connected", Duration::from_secs(20));
    assert_ne!(manager_ca(&f), old_ca, "the reinstall made a new CA");

    // Laptop 2's session cannot verify the new manager; its user daemon reads
    // the new CA, leases from the new manager and replaces the session, with no
    // command run on laptop 2.
    let t_reinstalled = Instant::now();
    let s2 = wait_session_of(
        l2,
        Duration::from_secs(60),
        "replaced and connected on its own",
        |s| s["state"] == "connected" && s["id"] != old_id2.as_str(),
    );
    eprintln!(
        "laptop2 renewed its session {} -> {} within {:.1} s of laptop 1's reconnect",
        old_id2,
        s2["id"],
        t_reinstalled.elapsed().as_secs_f64()
    );
    let log = l2.diagnostics();
    assert!(
        log.contains("the traffic manager was reinstalled")
            && log.contains("session renewed through the reinstalled traffic manager"),
        "laptop2's user daemon says what it did: {log}"
    );
    // A connect there now finds the renewed session.
    let out2 = l2.kvpn(&["connect", "--kubeconfig", &kubeconfig2]);
    let again = format!("{}{}", text(&out2.stdout), text(&out2.stderr));
    assert!(out2.status.success(), "connect on laptop2: {again}");
    assert!(
        again.contains("Already connected") && again.contains(s2["id"].as_str().unwrap_or("?")),
        "{again}"
    );
    let t0 = Instant::now();
    loop {
        match curl_web(l2) {
            Ok(page) if page.contains("kvpn-lab-server") => break,
            other => assert!(
                t0.elapsed() < Duration::from_secs(15),
                "laptop2 through the new manager: {other:?}\n{}",
                l2.diagnostics()
            ),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `kvpn connect` on a session that is not connected (its manager gone) does
/// not say "nothing to do": it waits a bounded time, then fails naming the
/// state, the reason and what to run.
#[test]
fn connect_on_a_session_that_is_not_connected_says_so_and_fails() {
    let f = KubeFixture::new();
    let kubeconfig = f.user_kubeconfig();
    f.connect_restricted();
    f.wait_state("connected", Duration::from_secs(15));
    let id = f.session()["id"].as_str().unwrap_or_default().to_owned();
    // Take the manager away under the session: scale its Deployment to 0.
    let api: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    f.block_on(api.patch(
        "kvpn-manager",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(serde_json::json!({"spec": {"replicas": 0}})),
    ))
    .unwrap_or_else(|e| panic!("scale the manager to 0: {e}"));
    let t0 = Instant::now();
    while f.session()["state"] == "connected" {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "session still connected 60 s after the manager went: {}",
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let t1 = Instant::now();
    let out = f.kvpn(&["connect", "--kubeconfig", &kubeconfig]);
    let said = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(!out.status.success(), "connect on a dead session: {said}");
    assert!(!said.contains("nothing to do"), "{said}");
    assert!(
        said.contains(&id)
            && said.contains("not connected")
            && said.contains(&format!("kvpn disconnect {id}")),
        "{said}"
    );
    assert!(
        t1.elapsed() < Duration::from_secs(30),
        "bounded wait: {:?}",
        t1.elapsed()
    );
}

/// When laptop 2 cannot renew its session on its own (here: the kubeconfig it
/// connected with is gone, so its user daemon cannot reach the API server
/// again; the running port-forward keeps its client), its session says the
/// manager was reinstalled and to connect again, and `kvpn connect` there
/// replaces the session instead of answering "nothing to do".
#[test]
fn connect_replaces_a_session_whose_manager_was_reinstalled_when_it_cannot_renew_itself() {
    let mut f = KubeFixture::new();
    f.add_laptop("laptop2");
    let kubeconfig = f.user_kubeconfig();
    f.connect_restricted();
    f.wait_state("connected", Duration::from_secs(15));
    let l2 = f.laptop_of("laptop2");
    let original = l2.lab.user_kubeconfig.clone();
    let moved = original.with_file_name("laptop2-moved.kubeconfig");
    std::fs::copy(&original, &moved).unwrap_or_else(|e| panic!("copy kubeconfig: {e}"));
    let moved_str = moved.to_string_lossy().into_owned();
    l2.kvpn_ok(&["connect", "--kubeconfig", &moved_str]);
    let s2 = wait_session_of(l2, Duration::from_secs(15), "connected", |s| {
        s["state"] == "connected"
    });
    let old_id2 = s2["id"].as_str().unwrap_or_default().to_owned();
    std::fs::remove_file(&moved).unwrap_or_else(|e| panic!("remove kubeconfig: {e}"));

    f.kvpn_ok(&["uninstall", "--kubeconfig", &kubeconfig, "--force"]);
    f.connect_restricted();
    f.wait_state("connected", Duration::from_secs(20));

    let stuck = wait_session_of(l2, Duration::from_secs(60), "naming the reinstall", |s| {
        s["state"] != "connected"
            && s["reason"]
                .as_str()
                .is_some_and(|r| r.contains("reinstalled"))
    });
    assert_eq!(stuck["id"], old_id2.as_str(), "not renewed: {stuck:#}");
    let reason = stuck["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("run `kvpn connect` again") && !reason.contains("kvpn uninstall"),
        "{reason}"
    );
    // Its watcher looks every 2 s: wait for its verdict.
    let t0 = Instant::now();
    while !l2
        .diagnostics()
        .contains("cannot renew the session through the reinstalled traffic manager")
    {
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "the user daemon says why it did not renew: {}",
            l2.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        l2.sessions()[0]["id"],
        old_id2.as_str(),
        "still the old session"
    );

    // The kubeconfig is back (same cluster, CA and context): connect replaces.
    std::fs::copy(&original, &moved).unwrap_or_else(|e| panic!("copy kubeconfig: {e}"));
    let out2 = l2.kvpn(&["connect", "--kubeconfig", &moved_str]);
    let again = format!("{}{}", text(&out2.stdout), text(&out2.stderr));
    assert!(out2.status.success(), "connect on laptop2: {again}");
    assert!(
        again.contains("reinstalled") && again.contains("replacing it"),
        "connect says what it does: {again}"
    );
    assert!(!again.contains("nothing to do"), "{again}");
    let s2 = wait_session_of(l2, Duration::from_secs(20), "connected again", |s| {
        s["state"] == "connected"
    });
    assert_ne!(s2["id"], old_id2.as_str(), "a new session");
    let t0 = Instant::now();
    loop {
        match curl_web(l2) {
            Ok(page) if page.contains("kvpn-lab-server") => break,
            other => assert!(
                t0.elapsed() < Duration::from_secs(15),
                "laptop2 through the new manager: {other:?}\n{}",
                l2.diagnostics()
            ),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A SOCKS session (laptop 2) under a manager reinstalled by another laptop:
/// its user daemon sees the certificate mismatch in the SOCKS session's own
/// status, reads the new CA, leases again and restarts the session on the same
/// SOCKS address, with no command run on laptop 2.
#[test]
fn a_socks_session_renews_itself_after_a_manager_reinstall() {
    let mut f = KubeFixture::new();
    f.add_laptop("laptop2");
    let kubeconfig = f.user_kubeconfig();
    f.connect_restricted();
    f.wait_state("connected", Duration::from_secs(15));
    let l2 = f.laptop_of("laptop2");
    let kubeconfig2 = l2.lab.user_kubeconfig.to_string_lossy().into_owned();
    let out = l2.kvpn(&["connect", "--kubeconfig", &kubeconfig2, "--socks"]);
    assert!(
        out.status.success(),
        "SOCKS connect on laptop2: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    wait_session_of(l2, Duration::from_secs(15), "connected", |s| {
        s["state"] == "connected"
    });
    let url = format!(
        "http://{}:{WEB_SERVICE_PORT}/",
        kvpn_lab::Addressing::default().web_cluster_ip()
    );
    let socks_curl = || {
        let out = l2.exec(&[
            "curl",
            "-sS",
            "--max-time",
            "5",
            "--socks5",
            "127.0.0.1:1080",
            &url,
        ]);
        if out.status.success() {
            Ok(text(&out.stdout))
        } else {
            Err(text(&out.stderr))
        }
    };
    assert!(
        socks_curl().is_ok(),
        "laptop2 reaches the cluster through SOCKS"
    );
    let old_ca = manager_ca(&f);

    f.kvpn_ok(&["uninstall", "--kubeconfig", &kubeconfig, "--force"]);
    f.connect_restricted();
    f.wait_state("connected", Duration::from_secs(20));
    assert_ne!(manager_ca(&f), old_ca, "the reinstall made a new CA");

    let t_reinstalled = Instant::now();
    // First the SOCKS session notices (certificate mismatch), then it is renewed.
    let log_says = |l: &Laptop| {
        l.diagnostics()
            .contains("session renewed through the reinstalled traffic manager")
    };
    loop {
        if log_says(l2) {
            break;
        }
        assert!(
            t_reinstalled.elapsed() < Duration::from_secs(60),
            "laptop2's SOCKS session was not renewed within 60 s: {:#?}\n{}",
            l2.sessions(),
            l2.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let s2 = wait_session_of(l2, Duration::from_secs(20), "connected again", |s| {
        s["state"] == "connected"
    });
    eprintln!(
        "laptop2 renewed its SOCKS session {} within {:.1} s of laptop 1's reconnect",
        s2["id"],
        t_reinstalled.elapsed().as_secs_f64()
    );
    assert_eq!(s2["transport"], "socks", "{s2:#}");
    assert_eq!(s2["socks"]["listen"], "127.0.0.1:1080", "{s2:#}");
    let t0 = Instant::now();
    loop {
        match socks_curl() {
            Ok(page) if page.contains("kvpn-lab-server") => break,
            other => assert!(
                t0.elapsed() < Duration::from_secs(15),
                "laptop2 through SOCKS and the new manager: {other:?}\n{}",
                l2.diagnostics()
            ),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
