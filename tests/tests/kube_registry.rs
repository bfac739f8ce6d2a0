//! The manager image from a private registry (issue #22, "Getting it into a
//! cluster" and the install's pull settings), on real nodes (containerd 1.6 under a
//! real kubelet 1.20): the project's archive is pushed with `skopeo copy` (the
//! README's registry path) to Debian's docker-registry with htpasswd auth, served
//! over plain HTTP on the lab router's node-network address (every lab node's
//! containerd has it as an `http://` mirror, as an admin configures an internal
//! registry without TLS).
//!
//! Without a pull secret the registry refuses the node (401): `kvpn connect --image
//! REGISTRY/…` fails within seconds with the kubelet's reason, the registry's
//! refusal, the image and the fix (`--image-pull-secret`), and the failed install
//! is removed; a pull secret with a wrong password fails the same way and the
//! error names the secret to check. With `--image-pull-secret` naming a docker-registry Secret in the
//! manager namespace, the node pulls the image, the session connects and reaches a
//! pod, and the Deployment carries the secret.

use std::net::SocketAddr;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, PostParams};
use kvpn_lab::k8s::node::{self, images};
use kvpn_tests::kube_lab::{KubeFixture, MANAGER_NAMESPACE, web};
use kvpn_tests::text;

const USER: &str = "kvpn-puller";
const PASSWORD: &str = "lab-only-secret";
const SECRET: &str = "kvpn-regcred";

/// docker-registry in the router netns with htpasswd auth; stopped and its
/// folder removed on drop.
struct LabRegistry {
    child: Child,
    dir: std::path::PathBuf,
}

impl LabRegistry {
    fn start(router: &kvpn_lab::Netns, addr: SocketAddr) -> LabRegistry {
        let dir = std::env::temp_dir().join(format!("kvpn-labregistry-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("registry folder");
        let hash = bcrypt::hash(PASSWORD, 5).expect("bcrypt");
        std::fs::write(dir.join("htpasswd"), format!("{USER}:{hash}\n")).expect("htpasswd");
        let config = dir.join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {dir}/storage\n\
                 http:\n  addr: {addr}\nauth:\n  htpasswd:\n    realm: kvpn-lab\n    path: {dir}/htpasswd\n",
                dir = dir.display()
            ),
        )
        .expect("registry config");
        let child = router
            .command("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("registry.log")).expect("log"))
            .spawn()
            .expect("docker-registry (apt package docker-registry; scripts/setup.sh installs it)");
        let registry = LabRegistry { child, dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let probe = router
                .command("curl")
                .args(["-s", "-o", "/dev/null", "-w", "%{http_code}"])
                .arg(format!("http://{addr}/v2/"))
                .output()
                .expect("curl");
            // 401: up, and refusing anonymous callers.
            if text(&probe.stdout) == "401" {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "registry on {addr} not up: {}",
                registry.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        registry
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("registry.log")).unwrap_or_default()
    }
}

impl Drop for LabRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn deployment_exists(f: &KubeFixture) -> bool {
    let api: Api<Deployment> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    f.block_on(api.get_opt("kvpn-manager"))
        .expect("get deployment")
        .is_some()
}

#[test]
fn a_registry_that_refuses_the_node_fails_connect_with_its_reason_a_wrong_secret_is_named_the_right_one_gets_the_image()
 {
    let f = KubeFixture::real_nodes(2);
    let router = f
        .lab()
        .netns_lab()
        .netns(kvpn_lab::NODE)
        .expect("router netns");
    let addr = SocketAddr::from((node::router_ip(node::NODE_NET), node::LAB_REGISTRY_PORT));
    let registry = LabRegistry::start(&router, addr);
    let image = format!("{addr}/kvpn/manager:{}", env!("CARGO_PKG_VERSION"));
    let archive = images::project_archive("manager").unwrap_or_else(|e| panic!("{e}"));
    let push = router
        .command("skopeo")
        .args(["copy", "--quiet", "--dest-tls-verify=false", "--dest-creds"])
        .arg(format!("{USER}:{PASSWORD}"))
        .arg(format!("oci-archive:{}", archive.path.display()))
        .arg(format!("docker://{image}"))
        .output()
        .expect("skopeo copy");
    assert!(
        push.status.success(),
        "push: {}\n{}",
        text(&push.stderr),
        registry.log()
    );

    // No pull secret: the registry refuses the node.
    let kubeconfig = f.user_kubeconfig();
    let t0 = Instant::now();
    let mut child = f
        .kvpn_command(&["connect", "--kubeconfig", &kubeconfig, "--image", &image])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvpn connect");
    let stdout = child.stdout.take().expect("stdout");
    let mut all = String::new();
    for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)).map_while(Result::ok) {
        all.push_str(&format!("[{:5.1} s] {line}\n", t0.elapsed().as_secs_f64()));
    }
    let out = child.wait_with_output().expect("kvpn connect");
    let took = t0.elapsed();
    all.push_str(&text(&out.stderr));
    assert!(
        !out.status.success(),
        "connected without credentials: {all}"
    );
    assert!(
        all.contains("ErrImagePull") || all.contains("ImagePullBackOff"),
        "the kubelet's reason: {all}"
    );
    assert!(
        all.contains("401") || all.to_lowercase().contains("unauthorized"),
        "the registry's refusal: {all}"
    );
    assert!(
        all.contains(&image) && all.contains("--image-pull-secret"),
        "the image and the fix: {all}"
    );
    assert!(
        took < Duration::from_secs(30),
        "failed only after {took:?}: {all}"
    );
    assert!(!deployment_exists(&f), "the failed install was removed");

    // The pull secret, as a user creates it (kubectl create secret docker-registry).
    let client = f.admin();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    if f.block_on(namespaces.get_opt(MANAGER_NAMESPACE))
        .expect("get namespace")
        .is_none()
    {
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "metadata": { "name": MANAGER_NAMESPACE }
        }))
        .expect("namespace");
        f.block_on(namespaces.create(&PostParams::default(), &ns))
            .expect("create namespace");
    }
    let mut secret = Secret::default();
    secret.metadata.name = Some(SECRET.to_owned());
    secret.type_ = Some("kubernetes.io/dockerconfigjson".to_owned());
    let secrets: Api<Secret> = Api::namespaced(client.clone(), MANAGER_NAMESPACE);
    let with_password = |password: &str| {
        let dockerconfig = serde_json::json!({
            "auths": { addr.to_string(): { "username": USER, "password": password } }
        });
        let mut secret = secret.clone();
        secret.data = Some(
            [(
                ".dockerconfigjson".to_owned(),
                ByteString(dockerconfig.to_string().into_bytes()),
            )]
            .into(),
        );
        secret
    };

    // A wrong pull secret: refused too, and the error names the secret.
    f.block_on(secrets.create(&PostParams::default(), &with_password("not-it")))
        .expect("create pull secret");
    let out = f.kvpn(&[
        "connect",
        "--kubeconfig",
        &kubeconfig,
        "--image",
        &image,
        "--image-pull-secret",
        SECRET,
    ]);
    let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(
        !out.status.success(),
        "connected with a wrong password: {all}"
    );
    assert!(
        all.contains("401") && all.contains(&format!("pull secret {SECRET}")),
        "the refusal and the secret to check: {all}"
    );
    assert!(!deployment_exists(&f), "the failed install was removed");

    // The right one.
    f.block_on(secrets.delete(SECRET, &Default::default()))
        .expect("delete the wrong secret");
    f.block_on(secrets.create(&PostParams::default(), &with_password(PASSWORD)))
        .expect("create pull secret");

    let out = f.kvpn(&[
        "connect",
        "--kubeconfig",
        &kubeconfig,
        "--image",
        &image,
        "--image-pull-secret",
        SECRET,
    ]);
    assert!(
        out.status.success(),
        "connect with the pull secret: {}{}\n{}\nregistry log:\n{}",
        text(&out.stdout),
        text(&out.stderr),
        f.diagnostics(),
        registry.log()
    );
    let deployments: Api<Deployment> = Api::namespaced(client, MANAGER_NAMESPACE);
    let d = f
        .block_on(deployments.get("kvpn-manager"))
        .expect("deployment");
    let pod = d.spec.and_then(|s| s.template.spec).expect("pod spec");
    assert_eq!(pod.containers[0].image.as_deref(), Some(image.as_str()));
    let pull_secrets: Vec<String> = pod
        .image_pull_secrets
        .unwrap_or_default()
        .into_iter()
        .map(|r| r.name)
        .collect();
    assert_eq!(pull_secrets, [SECRET]);
    // The session works: the web Service through the manager pulled from the registry.
    let page = f.page(web());
    assert!(!page.pod.is_empty(), "web answered: {page:?}");
    f.kvpn_ok(&["disconnect", "--all"]);
}
