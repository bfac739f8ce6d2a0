//! The manager image as a user chooses it (issue [image]), on the Kubernetes lab:
//! `--image` checked before the cluster is touched, remembered by the install,
//! taken from `$KVPN_IMAGE` or the settings file; an image the nodes cannot pull
//! fails within seconds naming the image and the fix and leaves nothing; `kvpn
//! install --dry-run` manifests applied with kubectl give a manager that `kvpn
//! connect --no-install` uses.

use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use kvpn_tests::kube_lab::{KVPN_VERSION, KubeFixture, MANAGER_NAMESPACE, web};
use kvpn_tests::text;

/// The running manager Deployment's image, if there is one.
fn installed_image(f: &KubeFixture) -> Option<String> {
    let api: Api<Deployment> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    f.block_on(api.get_opt("kvpn-manager"))
        .unwrap_or_else(|e| panic!("get Deployment: {e}"))
        .and_then(|d| d.spec)
        .and_then(|s| s.template.spec)
        .and_then(|s| s.containers.into_iter().next())
        .and_then(|c| c.image)
}

fn config_map_exists(f: &KubeFixture) -> bool {
    let api: Api<ConfigMap> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    f.block_on(api.get_opt("kvpn-manager"))
        .unwrap_or_else(|e| panic!("get ConfigMap: {e}"))
        .is_some()
}

/// An image in a user's registry; the lab's kubelet stand-in runs the built
/// manager for any repository path containing `kvpn-manager`.
fn custom_image() -> String {
    format!("registry.example.com:5000/team/kvpn-manager:{KVPN_VERSION}")
}

#[test]
fn a_custom_image_is_remembered_by_a_plain_reconnect() {
    let f = KubeFixture::new();
    let kubeconfig = f.user_kubeconfig();
    let image = custom_image();
    let out = f.kvpn_ok(&["connect", "--kubeconfig", &kubeconfig, "--image", &image]);
    assert!(
        out.contains(&format!("manager image {image} (from --image)")),
        "{out}"
    );
    assert_eq!(installed_image(&f).as_deref(), Some(image.as_str()));
    f.kvpn_ok(&["disconnect", "--all"]);
    // A plain connect keeps the custom image: no roll back to the default.
    let out = f.kvpn_ok(&["connect", "--kubeconfig", &kubeconfig]);
    assert!(
        out.contains("already installed"),
        "nothing re-applied: {out}"
    );
    assert_eq!(installed_image(&f).as_deref(), Some(image.as_str()));
    let page = f.page(web());
    assert!(!page.pod.is_empty(), "traffic through the kept manager");
}

#[test]
fn kvpn_image_and_the_settings_file_choose_the_image_per_context() {
    let f = KubeFixture::new();
    let kubeconfig = f.user_kubeconfig();
    // The context of the lab's restricted kubeconfig, from kvpn's own words.
    let settings = f.config_dir().join("kvpn");
    std::fs::create_dir_all(&settings).expect("settings folder");
    let from_file = format!("localhost:5000/from-file/kvpn-manager:{KVPN_VERSION}");
    let context = format!("kvpn-user@{}", f.cluster_name());
    std::fs::write(
        settings.join("config.yaml"),
        format!(
            "image: localhost:5000/top-level/kvpn-manager:{KVPN_VERSION}\ncontexts:\n  {context}:\n    image: {from_file}\n"
        ),
    )
    .expect("write config.yaml");
    let out = f.kvpn_ok(&["connect", "--kubeconfig", &kubeconfig]);
    assert!(
        out.contains(&format!("manager image {from_file} (from ")) && out.contains(&context),
        "the context's entry wins over the top level: {out}"
    );
    assert_eq!(installed_image(&f).as_deref(), Some(from_file.as_str()));
    f.kvpn_ok(&["disconnect", "--all"]);

    // $KVPN_IMAGE beats the file.
    let from_env = format!("localhost:5000/from-env/kvpn-manager:{KVPN_VERSION}");
    let out = f.kvpn_env(
        &["connect", "--kubeconfig", &kubeconfig],
        &[("KVPN_IMAGE", std::ffi::OsStr::new(&from_env))],
    );
    assert!(
        out.status.success(),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    assert!(
        text(&out.stdout).contains(&format!("manager image {from_env} (from $KVPN_IMAGE)")),
        "{}",
        text(&out.stdout)
    );
    assert_eq!(installed_image(&f).as_deref(), Some(from_env.as_str()));

    // A broken settings file is named with the fix, before the cluster is touched.
    f.kvpn_ok(&["disconnect", "--all"]);
    std::fs::write(settings.join("config.yaml"), "imgae: x\n").expect("write");
    let out = f.kvpn(&["connect", "--kubeconfig", &kubeconfig]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("config.yaml") && err.contains("imgae") && err.contains("keys: image"),
        "{err}"
    );
}

#[test]
fn a_malformed_image_is_refused_before_the_cluster_is_touched() {
    let f = KubeFixture::new();
    let kubeconfig = f.user_kubeconfig();
    let out = f.kvpn(&[
        "connect",
        "--kubeconfig",
        &kubeconfig,
        "--image",
        "Team/KVPN-Manager:1",
    ]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a usage error: {}",
        text(&out.stderr)
    );
    let err = text(&out.stderr);
    assert!(
        err.contains("Team/KVPN-Manager:1") && err.contains("--image team/kvpn-manager:1"),
        "names the image, the cause and the fix: {err}"
    );
    assert_eq!(installed_image(&f), None, "nothing was installed");
}

#[test]
fn an_image_the_nodes_cannot_pull_fails_within_seconds_and_leaves_nothing() {
    let f = KubeFixture::new();
    let kubeconfig = f.user_kubeconfig();
    let t0 = Instant::now();
    let out = f.kvpn(&[
        "connect",
        "--kubeconfig",
        &kubeconfig,
        "--image",
        "registry.example.com/team/nothing-here:1",
    ]);
    let took = t0.elapsed();
    assert!(!out.status.success(), "{}", text(&out.stdout));
    let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(
        all.contains("ErrImagePull") || all.contains("ImagePullBackOff"),
        "the kubelet's reason: {all}"
    );
    assert!(
        all.contains("registry.example.com/team/nothing-here:1")
            && all.contains("--image-pull-secret"),
        "the image and the fix: {all}"
    );
    assert!(took < Duration::from_secs(45), "failed only after {took:?}");
    assert_eq!(installed_image(&f), None, "the failed install was removed");
    assert!(
        !config_map_exists(&f),
        "the failed install's ConfigMap was removed"
    );
}

#[test]
fn dry_run_manifests_applied_with_kubectl_give_a_manager_that_no_install_connects_to() {
    let f = KubeFixture::new();
    let kubeconfig = f.user_kubeconfig();
    // Nothing installed yet: --no-install says so, with the fix, and writes nothing.
    let out = f.kvpn(&["connect", "--kubeconfig", &kubeconfig, "--no-install"]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("no traffic manager installed") && err.contains("kvpn install --dry-run"),
        "{err}"
    );
    assert_eq!(installed_image(&f), None);

    let manifests = f.kvpn_ok(&["install", "--dry-run", "-o", "yaml"]);
    for kind in [
        "kind: Namespace",
        "kind: ServiceAccount",
        "kind: Role",
        "kind: RoleBinding",
        "kind: ClusterRole",
        "kind: ClusterRoleBinding",
        "kind: ConfigMap",
        "kind: Service",
        "kind: Secret",
        "kind: Deployment",
    ] {
        assert!(manifests.contains(kind), "{kind} missing:\n{manifests}");
    }
    let json = f.kvpn_ok(&["install", "--dry-run", "-o", "json"]);
    let list: serde_json::Value = serde_json::from_str(&json).expect("JSON list");
    assert_eq!(list["kind"], "List");
    assert_eq!(list["items"].as_array().map(Vec::len), Some(10));

    let file = f.config_dir().join("kvpn-manager.yaml");
    std::fs::create_dir_all(f.config_dir()).expect("folder");
    std::fs::write(&file, &manifests).expect("write manifests");
    let kubectl = kvpn_lab::k8s::kubectl_path();
    let applied = std::process::Command::new(&kubectl)
        .arg("--kubeconfig")
        .arg(f.lab().admin_kubeconfig())
        .args(["apply", "-f"])
        .arg(&file)
        .output()
        .expect("kubectl apply");
    assert!(
        applied.status.success(),
        "kubectl apply: {}{}",
        text(&applied.stdout),
        text(&applied.stderr)
    );
    let out = f.kvpn_ok(&["connect", "--kubeconfig", &kubeconfig, "--no-install"]);
    assert!(out.contains("--no-install"), "{out}");
    // Install steps print as "• Creating …" / "• Updating …"; a pod's phase line
    // ("Pending (ContainerCreating)") is not one.
    assert!(
        !out.lines()
            .any(|l| l.starts_with("• Creating") || l.starts_with("• Updating")),
        "--no-install wrote something: {out}"
    );
    let page = f.page(web());
    assert!(!page.pod.is_empty());
}
