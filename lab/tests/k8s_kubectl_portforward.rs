//! `kubectl port-forward` through the lab's real API server to the kubelet stand-in's
//! SPDY/3.1 endpoint: the pod page over curl, two concurrent connections over one
//! port-forward, a 5 MB download whose sha256 matches (many windows' worth of data),
//! the dial error of a closed port on the error stream, and kube-rs's websocket
//! port-forward on the same pod afterwards. Runs every kubectl found: the machine's
//! (`kvpn_lab::k8s::kubectl_path()`, 1.32 here: it tries websocket-tunnelled SPDY,
//! gets 400, falls back to SPDY) and Debian's 1.20 (SPDY only) if unpacked at
//! `$KVPN_KUBECTL_DEBIAN` or `/var/cache/kvpn/kubernetes/1.20.2/debian-kubectl/kubectl`.
//! Needs root, the binaries of `scripts/build-kubernetes.sh` and etcd.

use std::io::{BufRead as _, BufReader};
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use kube::api::{Api, ListParams, PostParams};
use kvpn_lab::k8s::kubelet::{Kubelet, KubeletConfig};
use kvpn_lab::k8s::{ControlPlane, ControlPlaneConfig};
use kvpn_lab::{Lab, LabOptions};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

fn from_json<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
    serde_json::from_value(v).expect("valid object")
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

/// The kubectl binaries to try: (label, path).
fn kubectls() -> Vec<(String, PathBuf)> {
    let mut out = vec![("machine".to_owned(), kvpn_lab::k8s::kubectl_path())];
    let debian = std::env::var_os("KVPN_KUBECTL_DEBIAN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from("/var/cache/kvpn/kubernetes/1.20.2/debian-kubectl/kubectl")
        });
    if debian.exists() {
        out.push(("debian-1.20".to_owned(), debian));
    } else {
        eprintln!(
            "Debian's kubectl 1.20 not found at {} — only the machine's kubectl is tried",
            debian.display()
        );
    }
    out
}

fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .expect("free loopback port")
        .port()
}

/// A running `kubectl port-forward`, killed (by pid) on drop.
struct PortForward {
    child: Child,
    stderr: mpsc::Receiver<String>,
    local_port: u16,
}

impl PortForward {
    fn start(kubectl: &Path, kubeconfig: &Path, ns: &str, pod: &str, remote: u16) -> Self {
        let local_port = free_port();
        let mut child = Command::new(kubectl)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(["-n", ns, "port-forward", "--address", "127.0.0.1"])
            .arg(format!("pod/{pod}"))
            .arg(format!("{local_port}:{remote}"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kubectl");
        let (line_tx, line_rx) = mpsc::channel::<String>();
        let (err_tx, err_rx) = mpsc::channel::<String>();
        let stdout = child.stdout.take().expect("stdout");
        let stderr = child.stderr.take().expect("stderr");
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = line_tx.send(line);
            }
        });
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = err_tx.send(line);
            }
        });
        let mut pf = PortForward {
            child,
            stderr: err_rx,
            local_port,
        };
        let want = format!("Forwarding from 127.0.0.1:{local_port}");
        let t0 = Instant::now();
        loop {
            match line_rx.recv_timeout(Duration::from_millis(200)) {
                Ok(l) if l.contains(&want) => break,
                Ok(_) => {}
                Err(_) => {
                    if let Ok(Some(status)) = pf.child.try_wait() {
                        panic!(
                            "kubectl port-forward exited ({status}): {}",
                            pf.stderr_text()
                        );
                    }
                    assert!(
                        t0.elapsed() < Duration::from_secs(30),
                        "kubectl port-forward not listening within 30 s: {}",
                        pf.stderr_text()
                    );
                }
            }
        }
        // Keep draining stdout ("Handling connection for …").
        std::thread::spawn(move || while line_rx.recv().is_ok() {});
        pf
    }

    fn stderr_text(&self) -> String {
        self.stderr.try_iter().collect::<Vec<_>>().join("\n")
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.local_port)
    }
}

impl Drop for PortForward {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// curl's body and exit status.
fn curl(url: &str, out: Option<&Path>) -> (Vec<u8>, bool) {
    let mut cmd = Command::new("curl");
    cmd.args(["-sS", "--max-time", "60", url]);
    if let Some(p) = out {
        cmd.arg("-o").arg(p);
    }
    let o = cmd.output().expect("run curl");
    if !o.status.success() {
        eprintln!("curl {url}: {}", String::from_utf8_lossy(&o.stderr));
    }
    (o.stdout, o.status.success())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_port_forward_over_spdy() {
    let mut lab = Lab::up(
        LabOptions {
            backends: false,
            ..LabOptions::default()
        }
        .without_manager(),
    )
    .expect("lab up");
    let id = lab.id().to_owned();
    let cp = ControlPlane::start(ControlPlaneConfig::new(
        lab.dir().join("control-plane"),
        format!("kvpn-lab-{id}"),
    ))
    .await
    .expect("control plane starts (binaries from scripts/build-kubernetes.sh)");
    let kubelet = Kubelet::start(&lab, &cp, KubeletConfig::default())
        .await
        .expect("kubelet stand-in starts");
    let client = cp.admin_client().await.expect("admin client");

    // --- a pod of kvpn-lab-server ------------------------------------------------------
    let ns = format!("kpf-{id}");
    Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &from_json(serde_json::json!({"metadata": {"name": ns}})),
        )
        .await
        .expect("create namespace");
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), &ns);
    eventually("default service account", Duration::from_secs(30), || {
        let sas = sas.clone();
        async move {
            match sas.get_opt("default").await {
                Ok(Some(sa)) if sa.secrets.as_ref().is_some_and(|s| !s.is_empty()) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    let dep: Deployment = from_json(serde_json::json!({
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "terminationGracePeriodSeconds": 2,
                    "containers": [{
                        "name": "web",
                        "image": "kvpn/lab-server:dev",
                        "args": ["--name", "$(POD_NAME)"],
                        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                        "ports": [{"name": "http", "containerPort": 8080}],
                        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1}
                    }]
                }
            }
        }
    }));
    Api::<Deployment>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &dep)
        .await
        .expect("create deployment");
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let pod_name = eventually("a ready web pod", Duration::from_secs(60), || {
        let pods = pods.clone();
        async move {
            let list = pods
                .list(&ListParams::default().labels("app=web"))
                .await
                .map_err(|e| e.to_string())?;
            list.items
                .iter()
                .find(|p| {
                    p.status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
                })
                .and_then(|p| p.metadata.name.clone())
                .ok_or_else(|| "not ready yet".to_owned())
        }
    })
    .await;
    let kubeconfig = cp.admin_kubeconfig();
    let scratch = lab.dir().join("kubectl-pf");
    std::fs::create_dir_all(&scratch).expect("scratch dir");

    for (label, kubectl) in kubectls() {
        eprintln!("--- {label}: {}", kubectl.display());
        let pf = PortForward::start(&kubectl, &kubeconfig, &ns, &pod_name, 8080);

        // The pod page.
        let (page, ok) = tokio::task::spawn_blocking({
            let url = pf.url("/");
            move || curl(&url, None)
        })
        .await
        .expect("join");
        let page = String::from_utf8_lossy(&page).into_owned();
        assert!(ok, "{label}: curl / failed: {}", pf.stderr_text());
        assert!(
            page.contains(&format!("pod: {pod_name}")),
            "{label}: page names the pod: {page:?}"
        );

        // Two concurrent connections over the one port-forward, each a 2 MB download.
        let t0 = Instant::now();
        let concurrent: Vec<_> = (0..2)
            .map(|i| {
                let url = pf.url("/big?bytes=2000000");
                let file = scratch.join(format!("{label}-{i}.bin"));
                tokio::task::spawn_blocking(move || {
                    let (_, ok) = curl(&url, Some(&file));
                    let data = std::fs::read(&file).unwrap_or_default();
                    (ok, data)
                })
            })
            .collect();
        for (i, h) in concurrent.into_iter().enumerate() {
            let (ok, data) = h.await.expect("join");
            assert!(
                ok,
                "{label}: concurrent download {i} failed: {}",
                pf.stderr_text()
            );
            assert_eq!(
                data.len(),
                2_000_000,
                "{label}: concurrent download {i} length"
            );
            assert_eq!(
                kvpn_lab::payload::sha256_hex_of(&data),
                kvpn_lab::payload::sha256_hex(2_000_000),
                "{label}: concurrent download {i} content"
            );
        }
        eprintln!("{label}: 2 × 2 MB concurrently in {:?}", t0.elapsed());

        // 5 MB: far beyond the 64 KiB initial window.
        let t0 = Instant::now();
        let file = scratch.join(format!("{label}-big.bin"));
        let (_, ok) = tokio::task::spawn_blocking({
            let url = pf.url("/big?bytes=5000000");
            let file = file.clone();
            move || curl(&url, Some(&file))
        })
        .await
        .expect("join");
        let took = t0.elapsed();
        assert!(ok, "{label}: 5 MB download failed: {}", pf.stderr_text());
        let data = std::fs::read(&file).expect("read download");
        assert_eq!(data.len(), 5_000_000, "{label}: 5 MB length");
        assert_eq!(
            kvpn_lab::payload::sha256_hex_of(&data),
            kvpn_lab::payload::sha256_hex(5_000_000),
            "{label}: 5 MB content"
        );
        eprintln!(
            "{label}: 5 MB in {took:?} ({:.1} MB/s)",
            5.0 / took.as_secs_f64()
        );
        drop(pf);

        // A closed port: the dial error comes back on the error stream.
        let pf = PortForward::start(&kubectl, &kubeconfig, &ns, &pod_name, 9);
        let (_, ok) = tokio::task::spawn_blocking({
            let url = pf.url("/");
            move || curl(&url, None)
        })
        .await
        .expect("join");
        assert!(!ok, "{label}: nothing listens on the pod's port 9");
        let mut stderr = String::new();
        let t0 = Instant::now();
        while !stderr.contains("connection refused") && t0.elapsed() < Duration::from_secs(10) {
            if let Ok(l) = pf.stderr.recv_timeout(Duration::from_millis(200)) {
                stderr.push_str(&l);
                stderr.push('\n');
            }
        }
        assert!(
            stderr.contains("error forwarding port 9 to pod")
                && stderr.contains("connection refused"),
            "{label}: kubectl reports the pod-side dial error: {stderr:?}"
        );
        drop(pf);
    }

    // --- kube-rs's websocket port-forward still works ------------------------------------
    let mut pf = pods
        .portforward(&pod_name, &[8080])
        .await
        .expect("websocket port-forward upgrade");
    let mut stream = pf.take_stream(8080).expect("stream");
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: pf\r\nConnection: close\r\n\r\n")
        .await
        .expect("write");
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut out))
        .await
        .expect("response within 10 s")
        .expect("read");
    drop(stream);
    let _ = tokio::time::timeout(Duration::from_secs(5), pf.join()).await;
    let out = String::from_utf8_lossy(&out);
    assert!(
        out.contains(&format!("pod: {pod_name}")),
        "kube-rs port-forward: {out:?}"
    );

    kubelet.stop().await.expect("kubelet stops");
    cp.stop().expect("control plane stops");
    lab.down().expect("lab down");
}
