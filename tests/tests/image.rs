//! The traffic manager's OCI image (`cargo xtask image`, issue [image]): its config,
//! a reproducible digest, and the manager run from it by a real runtime (containerd
//! 1.6 + runc) under the security context kvpn renders for each source policy,
//! serving a session from the lab's laptop.
//!
//! The runtime test runs the rendered pod's security settings exactly as ctr can
//! express them: user and group, `--cap-drop` of every capability then the added
//! ones, read-only root filesystem, the default seccomp profile, no new privileges
//! (ctr's default), the hostPath TUN device, and the pod's sysctls applied to the
//! pod's network namespace as the CRI does (after closing ping_group_range as a
//! fresh namespace has it). The manager's arguments are the lab's direct-transport
//! ones (the Kubernetes-only `--leases` needs an API server; the Kubernetes lab
//! covers those).

use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::core::v1::PodSpec;
use kvpn_control::install::objects::{self, SourcePolicy, Spec};
use kvpn_lab::{BACKEND_1_IP, HTTP_PORT, LabOptions, MANAGER_POD_IP, ManagerProcess, NODE};
use kvpn_tests::containerd::{Containerd, image_archive, image_name};
use kvpn_tests::{Fixture, text};

/// Every capability runc knows (Linux 6.x), for `--cap-drop`: ctr has no "ALL".
const ALL_CAPS: &[&str] = &[
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
];

fn spec(policy: SourcePolicy) -> Spec {
    Spec {
        namespace: "kvpn-system".into(),
        image: image_name("manager"),
        version: env!("CARGO_PKG_VERSION").into(),
        source_policy: policy,
        image_pull_secrets: Vec::new(),
        image_pull_policy: None,
        replicas: 1,
    }
}

fn pod_spec(policy: SourcePolicy) -> PodSpec {
    objects::deployment(&spec(policy), "CA")
        .spec
        .and_then(|s| s.template.spec)
        .expect("rendered pod spec")
}

/// `ctr run` flags for the rendered pod's security settings (see the module docs).
fn ctr_flags(pod: &PodSpec) -> Vec<String> {
    let c = &pod.containers[0];
    let sc = c
        .security_context
        .as_ref()
        .expect("container securityContext");
    let psc = pod.security_context.as_ref().expect("pod securityContext");
    let mut flags = Vec::new();
    assert_eq!(sc.privileged, Some(false), "never privileged");
    let caps = sc.capabilities.as_ref().expect("capabilities");
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_owned()][..]));
    let added: Vec<String> = caps.add.clone().unwrap_or_default();
    for cap in ALL_CAPS {
        if !added.iter().any(|a| a == cap) {
            flags.push(format!("--cap-drop=CAP_{cap}"));
        }
    }
    for cap in &added {
        flags.push(format!("--cap-add=CAP_{cap}"));
    }
    if sc.read_only_root_filesystem == Some(true) {
        flags.push("--read-only".into());
    }
    let seccomp = psc.seccomp_profile.as_ref().map(|p| p.type_.as_str());
    assert_eq!(seccomp, Some("RuntimeDefault"));
    flags.push("--seccomp".into());
    for v in pod.volumes.iter().flatten() {
        if let Some(hp) = &v.host_path {
            let mount = c
                .volume_mounts
                .iter()
                .flatten()
                .find(|m| m.name == v.name)
                .expect("hostPath volume mounted");
            flags.push(format!(
                "--mount=type=bind,src={},dst={},options=rbind:rw",
                hp.path, mount.mount_path
            ));
        }
    }
    flags
}

/// The rendered pod's user and group (`runAsUser`/`runAsGroup`, container over pod).
fn run_as(pod: &PodSpec) -> (i64, i64) {
    let sc = pod.containers[0].security_context.as_ref();
    let psc = pod.security_context.as_ref();
    let uid = sc
        .and_then(|s| s.run_as_user)
        .or(psc.and_then(|p| p.run_as_user));
    let gid = sc
        .and_then(|s| s.run_as_group)
        .or(psc.and_then(|p| p.run_as_group));
    (uid.expect("runAsUser"), gid.expect("runAsGroup"))
}

/// Imports the manager image into `ctrd` as the rendered pod runs it and returns
/// its name. `ctr run` (1.6) has no `--user`, so a runAsUser other than the image's
/// own `USER` becomes an image of the same layer whose config names that user,
/// made with umoci: what runAsUser does at run time, done before.
fn import_as(ctrd: &Containerd, uid: i64, gid: i64) -> String {
    let archive = image_archive("manager");
    if (uid, gid) == (65532, 65532) {
        ctrd.import(&archive);
        return image_name("manager");
    }
    let work = tempdir::Dir::new("kvpn-image-user");
    let layout = work.path().join("layout");
    let tag = format!("{}:uid{uid}", work.path().join("tagged").display());
    let name = format!(
        "localhost/kvpn/manager-uid{uid}:{}",
        env!("CARGO_PKG_VERSION")
    );
    let variant = work.path().join("variant.oci.tar");
    let steps: Vec<Vec<String>> = vec![
        vec!["mkdir".into(), "-p".into(), layout.display().to_string()],
        vec![
            "tar".into(),
            "-xf".into(),
            archive.display().to_string(),
            "-C".into(),
            layout.display().to_string(),
        ],
        vec![
            "skopeo".into(),
            "copy".into(),
            "--quiet".into(),
            format!("oci:{}:{}", layout.display(), image_name("manager")),
            format!("oci:{tag}"),
        ],
        vec![
            "umoci".into(),
            "config".into(),
            "--image".into(),
            tag.clone(),
            "--config.user".into(),
            format!("{uid}:{gid}"),
        ],
        vec![
            "skopeo".into(),
            "copy".into(),
            "--quiet".into(),
            format!("oci:{tag}"),
            format!("oci-archive:{}:{name}", variant.display()),
        ],
    ];
    for step in steps {
        let out = Command::new(&step[0])
            .args(&step[1..])
            .output()
            .expect("run");
        assert!(out.status.success(), "{step:?}: {}", text(&out.stderr));
    }
    ctrd.import(&variant);
    name
}

/// The shell line that applies the pod's sysctls to its netns (as the CRI does)
/// and `exec`s `ctr run` of the manager there.
fn manager_script(
    ctrd: &Containerd,
    pod: &PodSpec,
    image: &str,
    id: &str,
    args: &[&str],
) -> String {
    let mut script = String::from("set -e; sysctl -qw net.ipv4.ping_group_range='1 0'; ");
    for s in pod
        .security_context
        .as_ref()
        .and_then(|p| p.sysctls.as_ref())
        .into_iter()
        .flatten()
    {
        script.push_str(&format!("sysctl -qw {}='{}'; ", s.name, s.value));
    }
    script.push_str(&format!(
        "exec {} run --rm --with-ns network:/proc/$$/ns/net {} {} {id} /kvpn-manager {}",
        ctrd.ctr_prefix().join(" "),
        ctr_flags(pod).join(" "),
        image,
        args.join(" ")
    ));
    script
}

fn untar(archive: &Path) -> (tempdir::Dir, serde_json::Value, serde_json::Value) {
    let dir = tempdir::Dir::new("kvpn-image-test");
    let out = Command::new("tar")
        .arg("-xf")
        .arg(archive)
        .arg("-C")
        .arg(dir.path())
        .output()
        .expect("tar");
    assert!(out.status.success(), "untar: {}", text(&out.stderr));
    let read = |rel: &str| -> serde_json::Value {
        let p = dir.path().join(rel);
        serde_json::from_slice(
            &std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
        )
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    };
    let index = read("index.json");
    let digest = index["manifests"][0]["digest"]
        .as_str()
        .expect("manifest digest");
    let manifest = read(&format!("blobs/sha256/{}", &digest[7..]));
    let config_digest = manifest["config"]["digest"]
        .as_str()
        .expect("config digest");
    let config = read(&format!("blobs/sha256/{}", &config_digest[7..]));
    (
        dir,
        index,
        serde_json::json!({"manifest": manifest, "config": config}),
    )
}

mod tempdir {
    use std::path::{Path, PathBuf};

    /// A folder under the temp dir removed on drop.
    pub struct Dir(PathBuf);
    impl Dir {
        pub fn new(prefix: &str) -> Dir {
            static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let p = std::env::temp_dir().join(format!("{prefix}-{}-{n}", std::process::id()));
            std::fs::create_dir_all(&p).expect("temp dir");
            Dir(p)
        }
        pub fn path(&self) -> &Path {
            &self.0
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[test]
fn manager_image_runs_as_65532_with_the_manager_as_entrypoint_and_names_its_version() {
    let archive = image_archive("manager");
    let size = std::fs::metadata(&archive).expect("archive").len();
    assert!(
        size < 25 * 1024 * 1024,
        "the manager image archive is {size} bytes, over the 25 MiB target"
    );
    let (_dir, index, doc) = untar(&archive);
    assert_eq!(
        index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"],
        image_name("manager"),
        "the archive names the image in full (ctr/kind/podman need no name flag)"
    );
    let config = &doc["config"]["config"];
    assert_eq!(config["User"], "65532:65532");
    assert_eq!(config["Entrypoint"], serde_json::json!(["/kvpn-manager"]));
    let labels = &config["Labels"];
    assert_eq!(
        labels["org.opencontainers.image.version"],
        env!("CARGO_PKG_VERSION")
    );
    let revision = labels["org.opencontainers.image.revision"]
        .as_str()
        .unwrap_or("");
    assert!(
        revision.len() >= 40,
        "revision label is a commit: {revision:?}"
    );
    let annotations = &doc["manifest"]["annotations"];
    assert_eq!(annotations["org.opencontainers.image.revision"], revision);
    assert_eq!(doc["config"]["os"], "linux");
    let layers = doc["manifest"]["layers"].as_array().expect("layers");
    assert_eq!(
        layers.len(),
        1,
        "one layer: the static binary on an empty base"
    );
}

/// Two image builds from the same binaries and commit give the same manifest
/// digest and byte-identical archives (timestamps are the commit's, tar is sorted).
#[test]
fn manager_image_builds_reproducibly() {
    let xtask = kvpn_lab::bin_path("xtask")
        .unwrap_or_else(|e| panic!("xtask binary (built by `cargo xtask`): {e:#}"));
    let a = tempdir::Dir::new("kvpn-image-a");
    let b = tempdir::Dir::new("kvpn-image-b");
    let mut digests = Vec::new();
    for out in [&a, &b] {
        let o = Command::new(&xtask)
            .args(["image", "--no-build", "--out"])
            .arg(out.path())
            .arg("manager")
            .output()
            .expect("run xtask image");
        assert!(
            o.status.success(),
            "xtask image --no-build: {}{}",
            text(&o.stdout),
            text(&o.stderr)
        );
        let line = text(&o.stdout);
        let digest = line
            .split_whitespace()
            .find(|w| w.starts_with("sha256:"))
            .unwrap_or_else(|| panic!("no digest in {line:?}"))
            .to_owned();
        digests.push(digest);
    }
    assert_eq!(digests[0], digests[1], "same digest twice");
    let name = format!("kvpn-manager-{}.oci.tar", env!("CARGO_PKG_VERSION"));
    let bytes = |d: &tempdir::Dir| std::fs::read(d.path().join(&name)).expect("archive");
    assert!(bytes(&a) == bytes(&b), "byte-identical archives");
}

fn serve_a_session_from_the_image(policy: SourcePolicy) {
    let ctrd = Containerd::start();
    let pod = pod_spec(policy);
    let (uid, gid) = run_as(&pod);
    let image = import_as(&ctrd, uid, gid);
    let id = format!("manager-{}", policy.as_str());
    let mut args: Vec<&str> = vec!["--listen", "0.0.0.0:10801"];
    if policy == SourcePolicy::Preserve {
        // The test routes the tunnel pool itself (below), as the node route does.
        args.extend(["--source-policy", "preserve", "--preserve-gateway", "none"]);
    }
    let script = manager_script(&ctrd, &pod, &image, &id, &args);
    let options = LabOptions::default().manager(ManagerProcess::Command {
        program: PathBuf::from("sh"),
        args: vec!["-c".into(), script.clone()],
    });
    let f = Fixture::with_lab_options(options);
    if policy == SourcePolicy::Preserve {
        let route = format!("route add 100.96.0.0/16 via {MANAGER_POD_IP}");
        f.lab
            .netns(NODE)
            .and_then(|n| n.ip_batch(&[route]))
            .unwrap_or_else(|e| panic!("node route for the tunnel pool: {e:#}"));
    }
    f.connect();
    let url = format!("http://{BACKEND_1_IP}:{HTTP_PORT}/");
    let out = f.laptop(&["curl", "-sS", "--max-time", "5", &url]);
    assert!(
        out.status.success(),
        "{policy:?}: curl {url} through the containerised manager failed: {}\nscript: {script}\nmanager log:\n{}\ncontainerd log:\n{}",
        text(&out.stderr),
        f.manager_log(),
        ctrd.log()
    );
    assert!(
        text(&out.stdout).contains("backend-1"),
        "{}",
        text(&out.stdout)
    );
    // ICMP: the manager's echo sockets are allowed only by the pod's sysctl (the
    // namespace's range was closed before it was applied).
    let ping = f.laptop(&["ping", "-c", "1", "-W", "3", &BACKEND_1_IP.to_string()]);
    assert!(
        ping.status.success(),
        "{policy:?}: ping through the containerised manager failed: {}\nmanager log:\n{}",
        text(&ping.stdout),
        f.manager_log()
    );
    // The manager really runs in the container, as the rendered user.
    let ps = ctrd.ctr(&["tasks", "list"]);
    assert!(
        text(&ps.stdout).contains(&id) && text(&ps.stdout).contains("RUNNING"),
        "{}",
        text(&ps.stdout)
    );
    // The image has no shell: the process is checked through /proc.
    let pids = ctrd.ctr(&["tasks", "ps", &id]);
    let pid: u32 = text(&pids.stdout)
        .lines()
        .skip(1)
        .find_map(|l| l.split_whitespace().next().and_then(|p| p.parse().ok()))
        .unwrap_or_else(|| panic!("no pid in {}", text(&pids.stdout)));
    let proc_status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let want_uid = objects::manager_uid(policy);
    assert!(
        proc_status
            .lines()
            .any(|l| l.starts_with("Uid:")
                && l.split_whitespace().nth(2) == Some(&want_uid.to_string())),
        "{policy:?}: manager uid is not {want_uid}:\n{proc_status}"
    );
    assert!(
        proc_status.lines().any(|l| l == "NoNewPrivs:\t1"),
        "{policy:?}: no_new_privs not set:\n{proc_status}"
    );
    if policy == SourcePolicy::Snat {
        assert!(
            proc_status
                .lines()
                .any(|l| l == "CapEff:\t0000000000000000"),
            "snat: the manager holds capabilities:\n{proc_status}"
        );
    }
    // Nothing of the runtime stays on the machine: not even the namespace's
    // parent cgroup in any hierarchy, which runc does not remove.
    let namespace = ctrd.namespace().to_owned();
    drop(ctrd);
    let left = kvpn_lab::k8s::node::host::cgroup_leftovers(&namespace);
    assert!(left.is_empty(), "{policy:?}: cgroups left: {left:?}");
}

#[test]
fn snat_manager_image_serves_a_session_under_the_restricted_security_context() {
    serve_a_session_from_the_image(SourcePolicy::Snat);
}

#[test]
fn preserve_manager_image_serves_a_session_with_only_its_named_capabilities() {
    serve_a_session_from_the_image(SourcePolicy::Preserve);
}

/// A registry on loopback (Debian's docker-registry, distribution 2.8) for the
/// README's `skopeo copy oci-archive:… docker://REGISTRY/…`; stopped and its
/// storage removed on drop.
struct Registry {
    child: std::process::Child,
    addr: std::net::SocketAddr,
    _dir: tempdir::Dir,
}

impl Registry {
    fn start() -> Registry {
        let dir = tempdir::Dir::new("kvpn-registry");
        // A free loopback port: bound, read, released.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port");
        let config = dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {addr}\n",
                dir.path().join("storage").display()
            ),
        )
        .expect("registry config");
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("docker-registry (apt package docker-registry; scripts/setup.sh installs it)");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::net::TcpStream::connect(addr).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "registry did not listen on {addr}"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        Registry {
            child,
            addr,
            _dir: dir,
        }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The README's registry path: `skopeo copy oci-archive:… docker://REGISTRY/…`
/// pushes the archive, and what a node pulls back has the same manifest digest.
#[test]
fn manager_archive_pushes_to_a_registry_and_pulls_back_with_the_same_digest() {
    let registry = Registry::start();
    let archive = image_archive("manager");
    let remote = format!(
        "docker://{}/kvpn/manager:{}",
        registry.addr,
        env!("CARGO_PKG_VERSION")
    );
    let push = Command::new("skopeo")
        .args(["copy", "--quiet", "--dest-tls-verify=false"])
        .arg(format!("oci-archive:{}", archive.display()))
        .arg(&remote)
        .output()
        .expect("skopeo copy");
    assert!(push.status.success(), "push: {}", text(&push.stderr));
    let inspect = Command::new("skopeo")
        .args(["inspect", "--tls-verify=false"])
        .arg(&remote)
        .output()
        .expect("skopeo inspect");
    assert!(
        inspect.status.success(),
        "inspect: {}",
        text(&inspect.stderr)
    );
    let remote_doc: serde_json::Value =
        serde_json::from_slice(&inspect.stdout).expect("inspect JSON");
    let (_dir, index, _) = untar(&archive);
    assert_eq!(
        remote_doc["Digest"], index["manifests"][0]["digest"],
        "the registry serves the archive's manifest unchanged"
    );
    assert_eq!(
        remote_doc["Labels"]["org.opencontainers.image.version"],
        env!("CARGO_PKG_VERSION")
    );
}

/// podman and buildah with a private store (vfs, their own root and runroot,
/// cgroupfs, file events: no systemd here), removed on drop, so the machine's
/// own images are never touched.
struct PodmanStore {
    dir: tempdir::Dir,
}

impl PodmanStore {
    fn new() -> PodmanStore {
        PodmanStore {
            dir: tempdir::Dir::new("kvpn-podman"),
        }
    }

    fn store_flags(&self) -> Vec<String> {
        let p = |s: &str| self.dir.path().join(s).display().to_string();
        vec![
            "--root".into(),
            p("root"),
            "--runroot".into(),
            p("run"),
            "--storage-driver".into(),
            "vfs".into(),
        ]
    }

    /// `podman ARGS…`, its stdout; the test fails with stderr when it fails.
    fn podman(&self, args: &[&str]) -> String {
        let tmp = self.dir.path().join("tmp");
        std::fs::create_dir_all(&tmp).expect("podman tmpdir");
        let mut cmd = Command::new("podman");
        cmd.args(self.store_flags())
            .args(["--cgroup-manager", "cgroupfs", "--events-backend", "file"])
            .arg("--tmpdir")
            .arg(&tmp)
            .args(args);
        Self::run(cmd, "podman", args)
    }

    /// `buildah ARGS…`, its stdout.
    fn buildah(&self, args: &[&str]) -> String {
        let mut cmd = Command::new("buildah");
        cmd.args(self.store_flags()).args(args);
        Self::run(cmd, "buildah", args)
    }

    fn run(mut cmd: Command, tool: &str, args: &[&str]) -> String {
        let out = cmd
            .output()
            .unwrap_or_else(|e| panic!("cannot run {tool} (scripts/setup.sh installs it): {e}"));
        assert!(
            out.status.success(),
            "{tool} {args:?} failed ({}): {}{}",
            out.status,
            text(&out.stdout),
            text(&out.stderr)
        );
        text(&out.stdout)
    }
}

impl Drop for PodmanStore {
    fn drop(&mut self) {
        // vfs layers are plain folders; containers were run with --rm. Nothing
        // is mounted once the commands ended, but unmount defensively so the
        // folder can go.
        let _ = Command::new("buildah")
            .args(self.store_flags())
            .args(["rm", "--all"])
            .output();
    }
}

/// The README's `podman load -i kvpn-manager-….oci.tar`: the archive loads under
/// kvpn's default image name with the same image ID (the config's digest), its
/// config as built, and podman runs it (runc). The run lowers RLIMIT_NOFILE and
/// RLIMIT_NPROC below this machine's hard limits: podman asks for 1048576 open
/// files and root here lacks CAP_SYS_RESOURCE (TOOLCHAIN.md), which a user's
/// machine does not.
#[test]
fn manager_archive_loads_into_podman_under_the_default_name_and_runs() {
    let archive = image_archive("manager");
    let (_dir, _index, doc) = untar(&archive);
    let config_digest = doc["manifest"]["config"]["digest"]
        .as_str()
        .expect("config digest")
        .to_owned();
    let store = PodmanStore::new();
    let archive_arg = archive.display().to_string();
    let loaded = store.podman(&["load", "-i", &archive_arg]);
    let name = image_name("manager");
    assert!(
        loaded.contains(&format!("Loaded image: {name}")),
        "podman load named no image {name}: {loaded}"
    );
    let inspect: serde_json::Value =
        serde_json::from_str(&store.podman(&["image", "inspect", &name]))
            .expect("podman image inspect JSON");
    let image = &inspect[0];
    assert_eq!(
        format!("sha256:{}", image["Id"].as_str().expect("Id")),
        config_digest,
        "podman's image ID is the archive's config digest"
    );
    assert_eq!(image["Config"]["User"], "65532:65532");
    assert_eq!(
        image["Config"]["Entrypoint"],
        serde_json::json!(["/kvpn-manager"])
    );
    let out = store.podman(&[
        "run",
        "--rm",
        "--network",
        "none",
        "--ulimit",
        "nofile=1024:1024",
        "--ulimit",
        "nproc=1024:1024",
        &name,
        "--version",
    ]);
    assert_eq!(
        out.trim(),
        format!("kvpn-manager {}", env!("CARGO_PKG_VERSION")),
        "the entrypoint is the manager"
    );
}

/// images/Containerfile (for docker, podman and buildah) builds the image
/// `cargo xtask image` builds: from the archive's own static binary, with the
/// archive's version and revision, buildah gives the same user, entrypoint,
/// working folder and labels, and a root filesystem of that one binary, mode
/// 0755, byte for byte.
#[test]
fn containerfile_builds_the_image_xtask_builds() {
    let archive = image_archive("manager");
    let (dir, _index, doc) = untar(&archive);
    let layers = doc["manifest"]["layers"].as_array().expect("layers");
    let layer = layers[0]["digest"].as_str().expect("layer digest");
    let context = tempdir::Dir::new("kvpn-containerfile-ctx");
    let out = Command::new("tar")
        .arg("-xf")
        .arg(dir.path().join("blobs/sha256").join(&layer[7..]))
        .arg("-C")
        .arg(context.path())
        .arg("kvpn-manager")
        .output()
        .expect("tar");
    assert!(
        out.status.success(),
        "the layer holds kvpn-manager at its root: {}",
        text(&out.stderr)
    );
    let binary = std::fs::read(context.path().join("kvpn-manager")).expect("binary");

    let labels = &doc["config"]["config"]["Labels"];
    let label = |k: &str| labels[k].as_str().unwrap_or_default().to_owned();
    let (version, revision, created) = (
        label("org.opencontainers.image.version"),
        label("org.opencontainers.image.revision"),
        label("org.opencontainers.image.created"),
    );
    let containerfile = Path::new(env!("CARGO_MANIFEST_DIR")).join("../images/Containerfile");
    let store = PodmanStore::new();
    let tag = "localhost/kvpn/manager:containerfile";
    store.buildah(&[
        "bud",
        "--isolation",
        "chroot",
        "--timestamp",
        "0",
        "-f",
        &containerfile.display().to_string(),
        "--build-arg",
        &format!("VERSION={version}"),
        "--build-arg",
        &format!("REVISION={revision}"),
        "--build-arg",
        &format!("CREATED={created}"),
        "-t",
        tag,
        &context.path().display().to_string(),
    ]);
    let inspect: serde_json::Value =
        serde_json::from_str(&store.buildah(&["inspect", "--type", "image", tag]))
            .expect("buildah inspect JSON");
    let built = &inspect["OCIv1"]["config"];
    let ours = &doc["config"]["config"];
    for key in ["User", "Entrypoint", "WorkingDir"] {
        assert_eq!(built[key], ours[key], "{key}: Containerfile vs xtask");
    }
    let mut built_labels = built["Labels"].as_object().expect("labels").clone();
    built_labels.remove("io.buildah.version");
    assert_eq!(
        serde_json::Value::Object(built_labels),
        ours["Labels"],
        "labels: Containerfile vs xtask"
    );

    // The built root filesystem: exactly /kvpn-manager, 0755, the same bytes.
    let container = store.buildah(&["from", tag]).trim().to_owned();
    let mount = store.buildah(&["mount", &container]).trim().to_owned();
    let root = Path::new(&mount);
    let entries: Vec<String> = std::fs::read_dir(root)
        .expect("rootfs")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(entries, ["kvpn-manager"], "one file on an empty base");
    use std::os::unix::fs::PermissionsExt as _;
    let mode = std::fs::metadata(root.join("kvpn-manager"))
        .expect("binary in rootfs")
        .permissions()
        .mode();
    assert_eq!(mode & 0o7777, 0o755);
    assert!(
        std::fs::read(root.join("kvpn-manager")).expect("read") == binary,
        "the Containerfile's binary is the archive's"
    );
    store.buildah(&["umount", &container]);
}
