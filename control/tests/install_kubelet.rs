//! The traffic manager installed into the Kubernetes lab (`kvpn_lab::k8s::K8sLab`:
//! real apiserver and controllers, the kubelet stand-in running pods as processes in
//! network namespaces). Needs root, the Kubernetes binaries and a built
//! `kvpn-manager` next to the test binaries (the image `ghcr.io/kvpn/manager:<v>`
//! maps to it).
//!
//! - the restricted user installs: `ensure_manager` returns the ready pod's IP, which
//!   accepts TCP on :10801 from the node; an older manager is upgraded by a real
//!   rollout; uninstall waits until the pods are gone;
//! - a manager whose image cannot be pulled fails within the bound with the kubelet's
//!   reason.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kvpn_control::install::objects;
use kvpn_control::install::wait::WaitConfig;
use kvpn_control::install::{self, Error, InstallOptions, Outcome, Recorder};
use kvpn_lab::k8s::cluster::{K8sLab, K8sLabOptions};
use kvpn_lab::k8s::workloads::Workloads;
use kvpn_lab::k8s::{self, client_from_kubeconfig};

/// A lab with no sample workloads and no lab-made manager: kvpn installs its own.
async fn lab_up() -> K8sLab {
    let t0 = Instant::now();
    let lab = K8sLab::up(K8sLabOptions::default().workloads(Workloads {
        samples: false,
        manager: false,
    }))
    .await
    .expect("Kubernetes lab up (needs root and scripts/build-kubernetes.sh)");
    eprintln!("Kubernetes lab up in {:?}", t0.elapsed());
    lab
}

async fn user_client(lab: &K8sLab) -> kube::Client {
    client_from_kubeconfig(&lab.state().control_plane_dir.join("kvpn-user.kubeconfig"))
        .await
        .expect("restricted user client")
}

fn opts(version: &str) -> InstallOptions {
    InstallOptions {
        namespace: k8s::KVPN_NAMESPACE.to_owned(),
        image: install::default_image(version),
        version: version.to_owned(),
        wait: WaitConfig::default(),
        source_policy: install::SourcePolicy::Snat,
        keep_installed_policy: false,
        ..InstallOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manager_pod_becomes_ready_is_upgraded_and_uninstalled() {
    let lab = lab_up().await;
    let user = user_client(&lab).await;
    let admin = lab.admin_client().await.expect("admin client");

    let rec = Recorder::default();
    let t0 = Instant::now();
    let old = install::ensure_manager(&user, &opts("0.0.9"), &rec)
        .await
        .unwrap_or_else(|e| panic!("install: {e}\nprogress:\n{}", rec.lines().join("\n")));
    eprintln!(
        "install to a ready pod took {:?}; progress:\n{}",
        t0.elapsed(),
        rec.lines().join("\n")
    );
    assert_eq!(old.outcome, Outcome::Installed);
    let pod_cidr = lab.netns_lab().node().pod_cidr();
    match old.pod_ip {
        std::net::IpAddr::V4(ip) => assert!(pod_cidr.contains(&ip), "{ip} in {pod_cidr}"),
        ip => panic!("IPv4 pod IP expected, got {ip}"),
    }
    let pod = Api::<Pod>::namespaced(admin.clone(), k8s::KVPN_NAMESPACE)
        .get(&old.pod_name)
        .await
        .expect("pod");
    assert_eq!(
        pod.status.and_then(|s| s.pod_ip),
        Some(old.pod_ip.to_string())
    );
    // The real manager listens there (the readiness probe said so; check it ourselves).
    lab.netns_lab()
        .wait_tcp(
            "node",
            SocketAddr::new(old.pod_ip, 10801),
            Duration::from_secs(5),
        )
        .expect("the manager pod accepts TCP on :10801 from the node");
    // The kubelet reported the phases on the way.
    let creating = rec
        .lines()
        .iter()
        .filter(|l| l.contains(&format!("Pod {}:", old.pod_name)))
        .count();
    assert!(creating >= 1, "{:#?}", rec.lines());

    // Upgrade: a real rollout to a new pod; the old one goes.
    let rec = Recorder::default();
    let t0 = Instant::now();
    let new = install::ensure_manager(&user, &opts("0.1.0"), &rec)
        .await
        .unwrap_or_else(|e| panic!("upgrade: {e}\nprogress:\n{}", rec.lines().join("\n")));
    eprintln!(
        "upgrade took {:?}; progress:\n{}",
        t0.elapsed(),
        rec.lines().join("\n")
    );
    assert_eq!(
        new.outcome,
        Outcome::Upgraded {
            from: Some("0.0.9".into())
        }
    );
    assert_ne!(new.pod_name, old.pod_name);
    lab.netns_lab()
        .wait_tcp(
            "node",
            SocketAddr::new(new.pod_ip, 10801),
            Duration::from_secs(5),
        )
        .expect("the new manager pod accepts TCP");

    // Same version: nothing to do, the same pod.
    let rec = Recorder::default();
    let same = install::ensure_manager(&user, &opts("0.1.0"), &rec)
        .await
        .expect("ensure again");
    assert_eq!(same.outcome, Outcome::AlreadyInstalled);
    assert_eq!(same.pod_name, new.pod_name);

    // Uninstall waits for the pods' termination by the kubelet.
    let rec = Recorder::default();
    let t0 = Instant::now();
    let report = install::uninstall(&user, k8s::KVPN_NAMESPACE, &rec)
        .await
        .unwrap_or_else(|e| panic!("uninstall: {e}\nprogress:\n{}", rec.lines().join("\n")));
    eprintln!(
        "uninstall took {:?}; progress:\n{}",
        t0.elapsed(),
        rec.lines().join("\n")
    );
    assert_eq!(report.deleted.len(), 9, "{:?}", report.deleted);
    let pods = Api::<Pod>::namespaced(admin.clone(), k8s::KVPN_NAMESPACE)
        .list(&ListParams::default().labels(&objects::selector()))
        .await
        .expect("pods");
    assert!(pods.items.is_empty(), "manager pods left after uninstall");
    assert!(
        lab.netns_lab()
            .wait_tcp(
                "node",
                SocketAddr::new(new.pod_ip, 10801),
                Duration::from_millis(500)
            )
            .is_err(),
        "nothing listens at the old pod IP after uninstall"
    );
    lab.down().expect("lab down");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_that_does_not_exist_fails_within_the_bound_with_the_kubelets_reason() {
    let lab = lab_up().await;
    let user = user_client(&lab).await;
    let mut o = opts("0.1.0");
    o.image = "does-not-exist".into();
    let rec = Recorder::default();
    let t0 = Instant::now();
    let err = install::ensure_manager(&user, &o, &rec)
        .await
        .expect_err("an unknown image cannot start");
    let took = t0.elapsed();
    eprintln!(
        "failed after {took:?}: {err}\nprogress:\n{}",
        rec.lines().join("\n")
    );
    assert!(matches!(err, Error::CannotStart { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.starts_with("traffic manager cannot start: pod kvpn-manager-"),
        "{msg}"
    );
    assert!(
        msg.contains("ErrImagePull") || msg.contains("ImagePullBackOff"),
        "{msg}"
    );
    assert!(msg.contains("does-not-exist"), "{msg}");
    assert!(
        msg.contains("the nodes cannot pull does-not-exist") && msg.contains("--image-pull-secret"),
        "the hint names the image and the fix: {msg}"
    );
    // Default bounds: 10 s of a fatal reason, well inside the 120 s ready timeout.
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert!(
        rec.lines()
            .iter()
            .any(|l| l.contains(": Waiting: ErrImagePull")),
        "{:#?}",
        rec.lines()
    );
    // A new install whose pod cannot start is removed again: nothing half-installed.
    assert!(
        rec.lines()
            .iter()
            .any(|l| l.contains("Removing the traffic manager objects just created")),
        "{:#?}",
        rec.lines()
    );
    let deployments: kube::Api<k8s_openapi::api::apps::v1::Deployment> =
        kube::Api::namespaced(user.clone(), k8s::KVPN_NAMESPACE);
    assert!(
        deployments
            .get_opt("kvpn-manager")
            .await
            .expect("get")
            .is_none(),
        "the Deployment of the failed install is left"
    );
    let config_maps: kube::Api<k8s_openapi::api::core::v1::ConfigMap> =
        kube::Api::namespaced(user.clone(), k8s::KVPN_NAMESPACE);
    assert!(
        config_maps
            .get_opt("kvpn-manager")
            .await
            .expect("get")
            .is_none(),
        "the ConfigMap of the failed install is left"
    );
    lab.down().expect("lab down");
}
