//! The Kubernetes lab on real node software ([`kvpn_lab::k8s::node`]): the lab's
//! control plane plus kube-scheduler, two nodes each with containerd 1.6 + runc, CNI
//! bridge/host-local/portmap, a real kubelet 1.20.2 and kube-proxy in iptables mode.
//! One test drives the whole life: up, nodes Ready, a Deployment spread over both
//! nodes, pod-to-pod across nodes, a ClusterIP through kube-proxy, `kubectl exec` and
//! `kubectl port-forward` through the apiserver and the real kubelet, then down with
//! nothing left behind.
//!
//! Needs root, the Kubernetes binaries of `scripts/build-kubernetes.sh` (kubelet,
//! kube-proxy, kube-scheduler too), etcd, kubectl, and Debian's containerd, runc,
//! containernetworking-plugins, umoci and busybox-static, and the pause image of `cargo xtask image`.

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ipnet::Ipv4Net;
use kvpn_lab::k8s::node::{self, images};
use kvpn_lab::k8s::{K8sLab, K8sLabOptions, RealNodeOptions};
use sha2::Digest as _;

fn kubectl(kubeconfig: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(kvpn_lab::k8s::kubectl_path());
    cmd.arg("--kubeconfig")
        .arg(kubeconfig)
        .arg("--request-timeout=30s")
        .args(args)
        .stdin(Stdio::null());
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run kubectl {args:?}: {e}"))
}

fn text(o: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn kubectl_ok(kubeconfig: &Path, args: &[&str]) -> String {
    let o = kubectl(kubeconfig, args);
    assert!(o.status.success(), "kubectl {args:?} failed: {}", text(&o));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn kubectl_apply(kubeconfig: &Path, manifest: &str) {
    let mut child = Command::new(kvpn_lab::k8s::kubectl_path())
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["apply", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kubectl apply");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(manifest.as_bytes())
        .expect("write manifest");
    let o = child.wait_with_output().expect("kubectl apply");
    assert!(o.status.success(), "kubectl apply failed: {}", text(&o));
}

fn kubectl_exec(kubeconfig: &Path, pod: &str, cmd: &[&str]) -> Output {
    let mut args = vec!["exec", pod, "--"];
    args.extend_from_slice(cmd);
    kubectl(kubeconfig, &args)
}

/// One HTTP/1.0 GET of `http://<addr>/` from inside `pod` (`kubectl exec`), with
/// busybox `nc` (Debian's busybox-static `wget -q -T 5` dies with SIGSEGV, also on
/// the host); the body.
fn get_from_pod(kubeconfig: &Path, pod: &str, addr: &str) -> Result<String, String> {
    let (ip, port) = addr.rsplit_once(':').expect("ip:port");
    let script = format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 5 {ip} {port}");
    let o = kubectl_exec(kubeconfig, pod, &["sh", "-c", &script]);
    if !o.status.success() {
        return Err(text(&o));
    }
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    match out.split_once("\r\n\r\n") {
        Some((head, body)) if head.starts_with("HTTP/1.") && head.contains(" 200 ") => {
            Ok(body.trim().to_owned())
        }
        _ => Err(format!("not an HTTP 200 answer: {out:?}")),
    }
}

/// The global sysctls a 1.20 kubelet sets at start, read while no lab's kubelets
/// are starting (docs/lab-real-node.md).
fn global_sysctls() -> Vec<(String, String)> {
    node::settled_global_sysctls().unwrap_or_else(|e| panic!("global sysctls: {e}"))
}

/// Pods of the `web` Deployment: (name, node, podIP, phase).
fn web_pods(kubeconfig: &Path) -> Vec<(String, String, String, String)> {
    let out = kubectl_ok(kubeconfig, &["get", "pods", "-l", "app=web", "-o", "json"]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("pods json");
    v["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|p| {
            let s = |v: &serde_json::Value| v.as_str().unwrap_or("").to_owned();
            (
                s(&p["metadata"]["name"]),
                s(&p["spec"]["nodeName"]),
                s(&p["status"]["podIP"]),
                s(&p["status"]["phase"]),
            )
        })
        .collect()
}

const WEB: &str = r#"
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
  namespace: default
spec:
  replicas: 2
  selector:
    matchLabels: {app: web}
  template:
    metadata:
      labels: {app: web}
    spec:
      terminationGracePeriodSeconds: 1
      affinity:
        podAntiAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
          - labelSelector:
              matchLabels: {app: web}
            topologyKey: kubernetes.io/hostname
      containers:
      - name: web
        image: kvpn.local/lab:busybox
        imagePullPolicy: Never
        command:
        - /bin/sh
        - -c
        - mkdir -p /www && hostname > /www/index.html && head -c 1048576 /dev/urandom > /www/blob && exec httpd -f -p 8080 -h /www
        ports:
        - containerPort: 8080
        readinessProbe:
          tcpSocket: {port: 8080}
          periodSeconds: 1
---
apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: default
spec:
  selector: {app: web}
  ports:
  - port: 80
    targetPort: 8080
"#;

fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .expect("free loopback port")
        .port()
}

/// A running `kubectl port-forward` (host netns, 127.0.0.1), killed by pid on drop.
struct PortForward {
    child: Child,
    port: u16,
}

impl PortForward {
    fn start(kubeconfig: &Path, pod: &str, remote: u16) -> PortForward {
        let port = free_port();
        let mut child = Command::new(kvpn_lab::k8s::kubectl_path())
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(["port-forward", "--address", "127.0.0.1"])
            .arg(format!("pod/{pod}"))
            .arg(format!("{port}:{remote}"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn kubectl port-forward");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let want = format!("Forwarding from 127.0.0.1:{port}");
        let t0 = Instant::now();
        loop {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(l) if l.contains(&want) => break,
                Ok(_) => {}
                Err(_) => {
                    if let Ok(Some(status)) = child.try_wait() {
                        panic!("kubectl port-forward exited ({status})");
                    }
                    assert!(
                        t0.elapsed() < Duration::from_secs(30),
                        "kubectl port-forward not listening within 30 s"
                    );
                }
            }
        }
        std::thread::spawn(move || while rx.recv().is_ok() {});
        PortForward { child, port }
    }
}

impl Drop for PortForward {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// HTTP/1.0 GET of `path` on 127.0.0.1:`port`; the body.
fn http_get_body(port: u16, path: &str) -> Vec<u8> {
    let mut s = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).expect("connect port-forward");
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").expect("send request");
    let mut all = Vec::new();
    s.read_to_end(&mut all).expect("read response");
    let split = all
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP head in {} bytes", all.len()));
    let head = String::from_utf8_lossy(&all[..split]).into_owned();
    assert!(
        head.starts_with("HTTP/1.") && head.contains(" 200 "),
        "{head}"
    );
    all[split + 4..].to_vec()
}

/// The test's scratch folder (the busybox archive), removed on drop, also when the
/// test fails.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn in_cidr(ip: &str, cidr: Ipv4Net) -> bool {
    ip.parse::<Ipv4Addr>().is_ok_and(|a| cidr.contains(&a))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_real_nodes_run_pods_across_nodes_with_services_and_port_forward() {
    kvpn_lab::require_root().expect("root");
    // The lab's warnings (a process killed after its SIGTERM grace, an incomplete
    // teardown) in the test's output; not kube's errors while the apiserver starts.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("warn,kube_client=off"))
        .with_test_writer()
        .try_init();
    let sysctls_before = global_sysctls();
    let scratch =
        Scratch(std::env::temp_dir().join(format!("kvpn-realnode-test-{}", std::process::id())));
    std::fs::create_dir_all(&scratch.0).expect("scratch dir");
    // The workload needs a shell (`kubectl exec`): busybox. The sandbox is the
    // project's pause image (`cargo xtask image`).
    let image = images::busybox_archive(&scratch.0).expect("build the busybox image");
    let pause = images::project_archive("pause").unwrap_or_else(|e| panic!("{e}"));

    let t0 = Instant::now();
    let mut options = K8sLabOptions::default().real_nodes(RealNodeOptions {
        count: 2,
        images: vec![image, pause],
        sandbox_image: images::project_image("pause"),
        samples_image: None,
        cluster_dns_image: None,
        ready_timeout: Duration::from_secs(180),
    });
    // KVPN_LAB_KEEP_DIR=1 keeps the lab folder (node logs, configs) for a post-mortem.
    if std::env::var_os("KVPN_LAB_KEEP_DIR").is_some() {
        options.lab = options.lab.keep_dir(true);
    }
    let lab = K8sLab::up(options).await.expect("lab with two real nodes");
    let lab_up = t0.elapsed();
    let real = lab.real_nodes().expect("real nodes");
    eprintln!(
        "real-node lab up in {:.1} s (nodes Ready with kube-proxy rules {:.1} s after the control plane)",
        lab_up.as_secs_f64(),
        real.startup().as_secs_f64()
    );
    let kc = lab.admin_kubeconfig().to_owned();
    let lab_id = lab.netns_lab().id().to_owned();
    let nodes_dir: PathBuf = lab.netns_lab().dir().join("nodes");
    let cidr_of = |node: &str| -> Ipv4Net {
        real.nodes()
            .iter()
            .find(|n| n.name() == node)
            .unwrap_or_else(|| panic!("pod on unknown node {node}"))
            .plan
            .pod_cidr
    };

    // The global sysctls are back already (the kubelet changed them at start).
    assert_eq!(
        global_sysctls(),
        sysctls_before,
        "kubelet sysctls not restored"
    );

    // Two Ready nodes, kubelet v1.20.2, containerd 1.6.
    let wide = kubectl_ok(&kc, &["get", "nodes", "-o", "wide", "--no-headers"]);
    eprintln!("kubectl get nodes -o wide:\n{wide}");
    let rows: Vec<Vec<&str>> = wide
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 2, "{wide}");
    for (row, n) in rows.iter().zip(real.nodes()) {
        assert_eq!(row[0], n.name(), "{wide}");
        assert_eq!(row[1], "Ready", "{wide}");
        assert_eq!(row[4], "v1.20.2", "{wide}");
        assert_eq!(row[5], n.plan.ip.to_string(), "{wide}");
        let runtime = row.last().expect("runtime column");
        assert!(runtime.starts_with("containerd://1.6."), "{wide}");
    }

    // A Deployment spread over both nodes, Running with IPs from each node's range.
    kubectl_apply(&kc, WEB);
    let t_deploy = Instant::now();
    let pods = loop {
        let pods = web_pods(&kc);
        let ready = kubectl_ok(
            &kc,
            &[
                "get",
                "endpoints",
                "web",
                "-o",
                "jsonpath={.subsets[*].addresses[*].ip}",
            ],
        );
        if pods.len() == 2
            && pods.iter().all(|p| p.3 == "Running" && !p.2.is_empty())
            && ready.split_whitespace().count() == 2
        {
            break pods;
        }
        assert!(
            t_deploy.elapsed() < Duration::from_secs(120),
            "web pods not Running and ready within 120 s: {pods:?}\n{}",
            kubectl_ok(&kc, &["describe", "pods", "-l", "app=web"])
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    eprintln!(
        "web pods Running and ready {:.1} s after apply: {pods:?}",
        t_deploy.elapsed().as_secs_f64()
    );
    assert_ne!(pods[0].1, pods[1].1, "both replicas on one node: {pods:?}");
    for (name, node, ip, _) in &pods {
        assert!(
            in_cidr(ip, cidr_of(node)),
            "{name} on {node} has {ip}, outside {}",
            cidr_of(node)
        );
    }
    let (a, b) = (&pods[0], &pods[1]);

    // Pod A reaches pod B (other node) by pod IP; `kubectl exec` runs through the
    // apiserver, the egress proxy, the kubelet and containerd's streaming server.
    let got = get_from_pod(&kc, &a.0, &format!("{}:8080", b.2))
        .unwrap_or_else(|e| panic!("pod {} -> pod {} ({}): {e}", a.0, b.0, b.2));
    assert_eq!(got, b.0);

    // The ClusterIP through kube-proxy: both backends answer within a bounded number
    // of tries (kube-proxy picks at random).
    let cluster_ip = kubectl_ok(
        &kc,
        &["get", "service", "web", "-o", "jsonpath={.spec.clusterIP}"],
    );
    let svc = format!("{}:80", cluster_ip.trim());
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..30 {
        let got = get_from_pod(&kc, &a.0, &svc)
            .unwrap_or_else(|e| panic!("pod {} -> ClusterIP {svc}: {e}", a.0));
        seen.insert(got);
        if seen.len() == 2 {
            break;
        }
    }
    let want: std::collections::BTreeSet<String> = [a.0.clone(), b.0.clone()].into();
    assert_eq!(seen, want, "ClusterIP {svc} did not reach both backends");

    // kubectl port-forward to pod B carries 1 MiB intact.
    let o = kubectl_exec(&kc, &b.0, &["sha256sum", "/www/blob"]);
    assert!(o.status.success(), "sha256sum in {}: {}", b.0, text(&o));
    let want_sum = String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .next()
        .expect("sha256sum output")
        .to_owned();
    let pf = PortForward::start(&kc, &b.0, 8080);
    let t_pf = Instant::now();
    let body = tokio::task::spawn_blocking(move || http_get_body(pf.port, "/blob"))
        .await
        .expect("port-forward GET");
    let pf_time = t_pf.elapsed();
    assert_eq!(body.len(), 1 << 20, "port-forward body length");
    let got_sum: String = sha2::Sha256::digest(&body)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(got_sum, want_sum, "port-forward corrupted the blob");
    eprintln!(
        "port-forward: 1 MiB in {:.0} ms",
        pf_time.as_secs_f64() * 1000.0
    );

    // Down: nothing of the nodes is left.
    let t_down = Instant::now();
    tokio::task::spawn_blocking(move || lab.down())
        .await
        .expect("down task")
        .expect("lab down");
    eprintln!("lab down in {:.1} s", t_down.elapsed().as_secs_f64());
    let left = node::leftovers(&lab_id, &nodes_dir, 2);
    assert!(left.is_empty(), "left behind: {left:#?}");
    let netns = kvpn_lab::lab_netns(&lab_id).expect("list netns");
    assert!(netns.is_empty(), "netns left behind: {netns:?}");
    assert_eq!(
        global_sysctls(),
        sysctls_before,
        "kubelet sysctls not restored"
    );
}
