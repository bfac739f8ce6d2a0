//! The lab's real control plane (etcd, kube-apiserver, kube-controller-manager
//! 1.20.2): start, drive it with kubectl and kube-rs, check RBAC and the service
//! CIDR, stop without residue.
//!
//! Needs the binaries of `scripts/build-kubernetes.sh` and Debian's etcd-server
//! (scripts/setup.sh installs both); fails with a hint when they are missing.

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{ConfigMap, Endpoints, Namespace, Pod, Secret, Service};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kvpn_lab::k8s::{self, ControlPlane, ControlPlaneConfig, process};

fn unique() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .subsec_nanos();
    format!("{:05x}", (t ^ (std::process::id() << 12)) & 0xfffff)
}

fn test_dir(tag: &str, id: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvpn-k8s-{tag}-{id}"));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn from_json<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
    serde_json::from_value(v).expect("valid object")
}

/// LISTEN sockets on `ip` according to the kernel (`/proc/net/tcp`).
fn listening_ports(ip: Ipv4Addr) -> Vec<u16> {
    let text = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    // Local address is hex of the address in host byte order (little endian here).
    let want = format!("{:08X}", u32::from_le_bytes(ip.octets()));
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (addr, port) = f.get(1)?.split_once(':')?;
            (addr == want && f.get(3) == Some(&"0A")).then(|| u16::from_str_radix(port, 16).ok())?
        })
        .collect()
}

/// Pids whose command line mentions `needle` (the instance folder).
fn processes_mentioning(needle: &Path) -> Vec<i32> {
    let needle = needle.to_string_lossy().into_owned();
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline"))
            && String::from_utf8_lossy(&cmd).contains(&needle)
        {
            pids.push(pid);
        }
    }
    pids
}

async fn eventually<T, F, Fut>(what: &str, bound: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let t0 = Instant::now();
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) if t0.elapsed() > bound => panic!("{what}: not within {bound:?}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

fn api_code(r: Result<impl std::fmt::Debug, kube::Error>) -> Result<u16, String> {
    match r {
        Ok(v) => Err(format!("expected an API error, got {v:?}")),
        Err(kube::Error::Api(s)) => Ok(s.code),
        Err(e) => Err(format!("expected an API error, got {e}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_plane_serves_kubectl_kube_rs_rbac_and_stops_clean() {
    let id = unique();
    let dir = test_dir("cp", &id);
    let t0 = Instant::now();
    let cp = ControlPlane::start(ControlPlaneConfig::new(&dir, format!("kvpn-lab-{id}")))
        .await
        .expect("control plane starts (binaries from scripts/build-kubernetes.sh)");
    eprintln!(
        "control plane {} ready in {:?} at {}",
        cp.name(),
        t0.elapsed(),
        cp.server_url()
    );
    let listen_ip = cp.listen_ip();
    let mut listening = listening_ports(listen_ip);
    listening.sort_unstable();
    let mut expected: Vec<u16> = cp.listen_addrs().iter().map(SocketAddr::port).collect();
    expected.sort_unstable();
    assert_eq!(
        listening, expected,
        "exactly etcd client+peer and the apiserver listen on {listen_ip}"
    );

    // --- kubectl with the admin kubeconfig ---------------------------------------
    let kubectl = k8s::kubectl_path();
    let out = tokio::process::Command::new(&kubectl)
        .arg("--kubeconfig")
        .arg(cp.admin_kubeconfig())
        .args(["get", "ns", "-o", "name"])
        .output()
        .await
        .expect("run kubectl");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{} get ns failed: {}",
        kubectl.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    for ns in [
        "namespace/default",
        "namespace/kube-system",
        "namespace/kvpn-system",
    ] {
        assert!(stdout.lines().any(|l| l == ns), "{ns} missing in: {stdout}");
    }

    // --- Deployment -> ReplicaSet -> Pod (Pending: nothing runs pods yet) ---------
    let admin = cp.admin_client().await.expect("admin client");
    let ns = format!("t-{id}");
    Api::<Namespace>::all(admin.clone())
        .create(
            &PostParams::default(),
            &from_json(serde_json::json!({"metadata": {"name": ns}})),
        )
        .await
        .expect("create namespace");
    // The serviceaccount controller gives every new namespace a token'd `default`.
    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), &ns);
    let dep: Deployment = from_json(serde_json::json!({
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {"containers": [{"name": "web", "image": "kvpn-lab-server", "ports": [{"containerPort": 8080}]}]}
            }
        }
    }));
    let dep = eventually("create deployment", Duration::from_secs(30), || {
        let deployments = deployments.clone();
        let dep = dep.clone();
        async move {
            deployments
                .create(&PostParams::default(), &dep)
                .await
                .map_err(|e| e.to_string())
        }
    })
    .await;
    let dep_uid = dep.metadata.uid.clone().expect("uid");
    let rss: Api<ReplicaSet> = Api::namespaced(admin.clone(), &ns);
    let rs = eventually(
        "deployment controller makes a ReplicaSet",
        Duration::from_secs(30),
        || {
            let rss = rss.clone();
            let dep_uid = dep_uid.clone();
            async move {
                let list = rss
                    .list(&ListParams::default())
                    .await
                    .map_err(|e| e.to_string())?;
                list.items
                    .into_iter()
                    .find(|rs| {
                        rs.metadata
                            .owner_references
                            .iter()
                            .flatten()
                            .any(|o| o.uid == dep_uid)
                    })
                    .ok_or_else(|| "no ReplicaSet owned by the Deployment".to_owned())
            }
        },
    )
    .await;
    let rs_uid = rs.metadata.uid.clone().expect("uid");
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    let pod = eventually(
        "replicaset controller makes a Pod",
        Duration::from_secs(30),
        || {
            let pods = pods.clone();
            let rs_uid = rs_uid.clone();
            async move {
                let list = pods
                    .list(&ListParams::default())
                    .await
                    .map_err(|e| e.to_string())?;
                list.items
                    .into_iter()
                    .find(|p| {
                        p.metadata
                            .owner_references
                            .iter()
                            .flatten()
                            .any(|o| o.uid == rs_uid)
                    })
                    .ok_or_else(|| "no Pod owned by the ReplicaSet".to_owned())
            }
        },
    )
    .await;
    let spec = pod.spec.as_ref().expect("pod spec");
    assert_eq!(spec.node_name, None, "nothing schedules pods yet");
    assert_eq!(spec.containers[0].image.as_deref(), Some("kvpn-lab-server"));
    let phase = pod.status.as_ref().and_then(|s| s.phase.clone());
    assert!(
        matches!(phase.as_deref(), None | Some("Pending")),
        "phase {phase:?}"
    );

    // --- Services: the service CIDR and the endpoints controller -----------------
    let services: Api<Service> = Api::namespaced(admin.clone(), &ns);
    let out_of_range: Service = from_json(serde_json::json!({
        "metadata": {"name": "outside"},
        "spec": {"clusterIP": "10.200.0.5", "ports": [{"port": 80}]}
    }));
    let err = services
        .create(&PostParams::default(), &out_of_range)
        .await
        .expect_err("a ClusterIP outside 10.96.0.0/12 is refused");
    let msg = err.to_string();
    assert!(
        msg.contains("The range of valid IPs is 10.96.0.0/12"),
        "service-CIDR error text: {msg}"
    );
    let web: Service = from_json(serde_json::json!({
        "metadata": {"name": "web"},
        "spec": {"clusterIP": "10.96.0.100", "selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}
    }));
    let web = services
        .create(&PostParams::default(), &web)
        .await
        .expect("in-range ClusterIP");
    assert_eq!(
        web.spec.and_then(|s| s.cluster_ip).as_deref(),
        Some("10.96.0.100")
    );
    let endpoints: Api<Endpoints> = Api::namespaced(admin.clone(), &ns);
    eventually(
        "endpoints controller makes Endpoints for web",
        Duration::from_secs(30),
        || {
            let endpoints = endpoints.clone();
            async move {
                endpoints
                    .get_opt("web")
                    .await
                    .map_err(|e| e.to_string())?
                    .ok_or_else(|| "no Endpoints web yet".to_owned())
            }
        },
    )
    .await;

    // --- the restricted user ----------------------------------------------------------
    let user = cp.user_client().await.expect("user client");
    let code = api_code(
        Api::<Secret>::namespaced(user.clone(), "kube-system")
            .list(&ListParams::default())
            .await,
    )
    .expect("listing kube-system secrets must be an API error");
    assert_eq!(
        code, 403,
        "secrets in kube-system are outside kvpn-user's Role"
    );
    let code = api_code(
        Api::<Deployment>::namespaced(user.clone(), &ns)
            .create(&PostParams::default(), &dep)
            .await,
    )
    .expect("creating outside kvpn-system must be an API error");
    assert_eq!(code, 403, "deployments outside kvpn-system");
    let cms: Api<ConfigMap> = Api::namespaced(user.clone(), k8s::KVPN_NAMESPACE);
    let cm: ConfigMap = from_json(
        serde_json::json!({"metadata": {"name": format!("probe-{id}")}, "data": {"k": "v"}}),
    );
    cms.create(&PostParams::default(), &cm)
        .await
        .expect("kvpn-user creates a ConfigMap in kvpn-system");
    let code = api_code(
        cms.delete(&format!("probe-{id}"), &DeleteParams::default())
            .await,
    )
    .expect("delete must be an API error");
    assert_eq!(code, 403, "kvpn-user's Role has no delete");
    let all_pods = Api::<Pod>::all(user.clone())
        .list(&ListParams::default())
        .await
        .expect("kvpn-user lists pods cluster-wide");
    assert!(
        all_pods
            .items
            .iter()
            .any(|p| p.metadata.uid == pod.metadata.uid)
    );

    // --- the CA, reloaded from pki/, issues certificates the apiserver trusts -----------
    // (the kubelet stand-in's serving certificate will come from here)
    let ca = cp.ca().expect("reload CA");
    let probe = ca
        .issue(&k8s::pki::CertSpec::client(&format!("probe-{id}"), &[]))
        .expect("issue");
    let (crt, key) = (dir.join("probe.crt"), dir.join("probe.key"));
    std::fs::write(&crt, &probe.cert_pem).expect("write");
    std::fs::write(&key, &probe.key_pem).expect("write");
    let probe_kc = dir.join("probe.kubeconfig");
    let server = cp.server_url();
    std::fs::write(
        &probe_kc,
        k8s::kubeconfig::render(&k8s::kubeconfig::KubeconfigSpec {
            cluster: cp.name(),
            server: &server,
            ca_file: &cp.ca_file(),
            user: "probe",
            client_cert_file: &crt,
            client_key_file: &key,
            namespace: None,
        }),
    )
    .expect("write");
    let probe_client = k8s::client_from_kubeconfig(&probe_kc)
        .await
        .expect("probe client");
    // GET /api is for authenticated users only (anonymous gets 403).
    let req = http::Request::get("/api")
        .body(Vec::new())
        .expect("request");
    probe_client
        .request_text(req)
        .await
        .expect("a client cert from the reloaded CA authenticates");

    // --- stop: no process, no listening port -------------------------------------------
    let records = cp.processes();
    assert_eq!(records.len(), 3);
    let addrs = cp.listen_addrs();
    let t_stop = Instant::now();
    cp.stop().expect("stop");
    eprintln!("stopped in {:?}", t_stop.elapsed());
    for r in &records {
        assert!(
            !process::is_alive(r),
            "{} (pid {}) survived stop",
            r.name,
            r.pid
        );
    }
    assert_eq!(
        processes_mentioning(&dir),
        Vec::<i32>::new(),
        "processes still refer to {}",
        dir.display()
    );
    assert_eq!(
        listening_ports(listen_ip),
        Vec::<u16>::new(),
        "ports still listening on {listen_ip}"
    );
    for a in addrs {
        let e = TcpStream::connect_timeout(&a, Duration::from_secs(1))
            .expect_err("nothing listens any more");
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{a}: {e}");
    }
    assert!(
        !dir.join("control-plane.json").exists(),
        "state file removed on stop"
    );
    std::fs::remove_dir_all(&dir).expect("remove test dir");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_dying_at_start_up_is_reported_with_its_log() {
    let id = unique();
    let dir = test_dir("fail", &id);
    let mut config = ControlPlaneConfig::new(&dir, format!("kvpn-lab-{id}"));
    // A stand-in etcd that prints a line and exits: start must fail fast and say so.
    let fake = dir.with_extension("fake-etcd.sh");
    std::fs::write(
        &fake,
        "#!/bin/sh\necho 'fake etcd: cannot start' >&2\nexit 3\n",
    )
    .expect("write");
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    config.etcd = fake.clone();
    let t0 = Instant::now();
    let err = ControlPlane::start(config)
        .await
        .expect_err("fake etcd exits");
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "failure took {:?}",
        t0.elapsed()
    );
    let msg = err.to_string();
    assert!(msg.contains("etcd exited during start-up"), "{msg}");
    assert!(msg.contains("exit status: 3"), "{msg}");
    assert!(
        msg.contains("fake etcd: cannot start"),
        "log tail in the error: {msg}"
    );
    std::fs::remove_file(&fake).expect("rm fake");
    std::fs::remove_dir_all(&dir).expect("rm dir");
}

#[tokio::test]
async fn missing_binaries_name_the_build_script() {
    let id = unique();
    let dir = test_dir("nobin", &id);
    let mut config = ControlPlaneConfig::new(&dir, format!("kvpn-lab-{id}"));
    config.bin_dir = dir.join("no-such-bin");
    let err = ControlPlane::start(config).await.expect_err("no binaries");
    let msg = err.to_string();
    assert!(
        msg.contains("kube-apiserver not found") && msg.contains("scripts/build-kubernetes.sh"),
        "{msg}"
    );
    assert!(
        !dir.exists(),
        "nothing created before the binaries are found"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detached_control_plane_is_stopped_from_its_folder() {
    let id = unique();
    let dir = test_dir("detach", &id);
    let mut config = ControlPlaneConfig::new(&dir, format!("kvpn-lab-{id}"));
    // As `kvpn lab up` does: the processes outlive whoever started them.
    config.tie_to_process = false;
    let cp = ControlPlane::start(config.clone()).await.expect("start");
    let records = cp.processes();
    let ip = cp.listen_ip();
    let folder = cp.detach().expect("detach");
    assert_eq!(folder, dir);
    for r in &records {
        assert!(process::is_alive(r), "{} stopped on detach", r.name);
    }
    // A second start in the same folder must refuse, not clobber a running cluster.
    let err = ControlPlane::start(config)
        .await
        .expect_err("folder in use");
    assert!(err.to_string().contains("still running"), "{err}");
    assert!(
        records.iter().all(process::is_alive),
        "the refused start touched nothing"
    );

    assert!(ControlPlane::stop_dir(&dir, Duration::from_secs(10)).expect("stop_dir"));
    for r in &records {
        assert!(
            !process::is_alive(r),
            "{} (pid {}) survived stop_dir",
            r.name,
            r.pid
        );
    }
    assert_eq!(listening_ports(ip), Vec::<u16>::new());
    assert!(
        !ControlPlane::stop_dir(&dir, Duration::from_secs(1)).expect("second stop_dir"),
        "nothing left to stop"
    );
    std::fs::remove_dir_all(&dir).expect("rm dir");
}
