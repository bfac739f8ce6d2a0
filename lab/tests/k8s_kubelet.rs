//! The kubelet stand-in against the lab's real control plane: Deployments become
//! running pods in their own netns with pod-CIDR IPs, scaling and deletion create and
//! remove netns, kube-rs port-forward through the API server reaches the pod, and
//! failing pods report the kubelet's statuses (ErrImagePull / ImagePullBackOff,
//! CrashLoopBackOff with exit codes, unready probes). Needs root, the binaries of
//! `scripts/build-kubernetes.sh` and etcd (scripts/setup.sh).

use std::io::{Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Event, Namespace, Node, Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, LogParams, Patch, PatchParams, PostParams};
use kvpn_lab::k8s::kubelet::{Kubelet, KubeletConfig};
use kvpn_lab::k8s::{ControlPlane, ControlPlaneConfig};
use kvpn_lab::protocol::PageInfo;
use kvpn_lab::{Lab, LabOptions, NODE_POD_CIDR};
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
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// A lab (no static pod processes), its control plane and the kubelet stand-in.
struct Cluster {
    lab: Lab,
    cp: Option<ControlPlane>,
    kubelet: Option<Kubelet>,
    client: kube::Client,
}

impl Cluster {
    async fn up() -> Cluster {
        Cluster::up_with(|_| {}).await
    }

    /// `prepare` runs on the lab before the control plane and kubelet start.
    async fn up_with(prepare: impl FnOnce(&Lab)) -> Cluster {
        let lab = Lab::up(
            LabOptions {
                backends: false,
                ..LabOptions::default()
            }
            .without_manager(),
        )
        .expect("lab up");
        prepare(&lab);
        let t0 = Instant::now();
        let cp = ControlPlane::start(ControlPlaneConfig::new(
            lab.dir().join("control-plane"),
            format!("kvpn-lab-{}", lab.id()),
        ))
        .await
        .expect("control plane starts (binaries from scripts/build-kubernetes.sh)");
        eprintln!("control plane ready in {:?}", t0.elapsed());
        let t1 = Instant::now();
        let kubelet = Kubelet::start(&lab, &cp, KubeletConfig::default())
            .await
            .expect("kubelet stand-in starts");
        eprintln!(
            "kubelet stand-in registered {} in {:?}, endpoint {}",
            kubelet.node_name(),
            t1.elapsed(),
            kubelet.endpoint()
        );
        let client = cp.admin_client().await.expect("admin client");
        Cluster {
            lab,
            cp: Some(cp),
            kubelet: Some(kubelet),
            client,
        }
    }

    fn kubelet(&self) -> &Kubelet {
        self.kubelet.as_ref().expect("kubelet running")
    }

    async fn namespace(&self, name: &str) -> String {
        Api::<Namespace>::all(self.client.clone())
            .create(
                &PostParams::default(),
                &from_json(serde_json::json!({"metadata": {"name": name}})),
            )
            .await
            .expect("create namespace");
        // Pods are refused until the namespace's `default` service account exists.
        let sas: Api<k8s_openapi::api::core::v1::ServiceAccount> =
            Api::namespaced(self.client.clone(), name);
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
        name.to_owned()
    }
}

fn phase(p: &Pod) -> &str {
    p.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("")
}

fn pod_ip(p: &Pod) -> Option<Ipv4Addr> {
    p.status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .and_then(|ip| ip.parse().ok())
}

fn is_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn container_status(p: &Pod) -> serde_json::Value {
    let s = p
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .cloned();
    serde_json::to_value(s).expect("json")
}

async fn running_pods(pods: &Api<Pod>, selector: &str) -> Result<Vec<Pod>, String> {
    let list = pods
        .list(&ListParams::default().labels(selector))
        .await
        .map_err(|e| e.to_string())?;
    Ok(list
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect())
}

/// Waits until exactly `n` pods match and all are Running and Ready with a pod-CIDR IP.
async fn wait_ready_pods(pods: &Api<Pod>, selector: &str, n: usize, bound: Duration) -> Vec<Pod> {
    eventually(&format!("{n} ready pods {selector}"), bound, || {
        let pods = pods.clone();
        async move {
            let all = pods
                .list(&ListParams::default().labels(selector))
                .await
                .map_err(|e| e.to_string())?
                .items;
            if all.len() != n {
                return Err(format!("{} pods (terminating ones included)", all.len()));
            }
            for p in &all {
                if phase(p) != "Running" || !is_ready(p) || pod_ip(p).is_none() {
                    return Err(format!(
                        "pod {:?} phase {} ready {} ip {:?}",
                        p.metadata.name,
                        phase(p),
                        is_ready(p),
                        pod_ip(p)
                    ));
                }
            }
            Ok(all)
        }
    })
    .await
}

/// `GET /` from inside `netns`, returning the body.
fn http_get_in(lab: &Lab, role: &str, addr: SocketAddr) -> Result<String, String> {
    lab.run_in(role, move || {
        let mut s =
            TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| e.to_string())?;
        s.write_all(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            .map_err(|e| e.to_string())?;
        let mut out = String::new();
        s.read_to_string(&mut out).map_err(|e| e.to_string())?;
        let body = out
            .split_once("\r\n\r\n")
            .map(|x| x.1.to_owned())
            .unwrap_or_default();
        Ok(body)
    })
    .map_err(|e| e.to_string())?
}

async fn get_via_port_forward(pods: &Api<Pod>, name: &str, port: u16) -> String {
    let mut pf = pods
        .portforward(name, &[port])
        .await
        .expect("port-forward upgrade");
    let mut stream = pf.take_stream(port).expect("stream");
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
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deployment_pods_run_scale_delete_and_port_forward() {
    let mut c = Cluster::up().await;
    let id = c.lab.id().to_owned();
    let kubelet = c.kubelet();

    // --- the Node ---------------------------------------------------------------------
    let node = Api::<Node>::all(c.client.clone())
        .get(kubelet.node_name())
        .await
        .expect("node registered");
    assert_eq!(kubelet.node_name(), format!("kvpn-{id}-node"));
    let spec = node.spec.clone().expect("spec");
    assert_eq!(spec.pod_cidr.as_deref(), Some("10.244.1.0/24"));
    assert_eq!(spec.taints, None, "the not-ready taint is cleared");
    let status = node.status.clone().expect("status");
    let ready = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "Ready")
        .expect("Ready condition");
    assert_eq!(ready.status, "True");
    let addresses = status.addresses.clone().expect("addresses");
    assert!(
        addresses
            .iter()
            .any(|a| a.type_ == "InternalIP" && a.address == kubelet.endpoint().ip().to_string())
    );
    assert!(
        addresses
            .iter()
            .any(|a| a.type_ == "ExternalIP" && a.address == "172.31.255.1")
    );
    let port = status
        .daemon_endpoints
        .and_then(|d| d.kubelet_endpoint)
        .map(|e| e.port);
    assert_eq!(port, Some(i32::from(kubelet.endpoint().port())));

    // --- a Deployment of kvpn-lab-server -----------------------------------------------
    let ns = c.namespace(&format!("kl-{id}")).await;
    let deployments: Api<Deployment> = Api::namespaced(c.client.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(c.client.clone(), &ns);
    let dep: Deployment = from_json(serde_json::json!({
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
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
    let t0 = Instant::now();
    deployments
        .create(&PostParams::default(), &dep)
        .await
        .expect("create deployment");
    let first = eventually("web pod Running", Duration::from_secs(60), || {
        let pods = pods.clone();
        async move {
            let list = running_pods(&pods, "app=web").await?;
            list.into_iter()
                .find(|p| phase(p) == "Running")
                .ok_or_else(|| "no Running pod yet".to_owned())
        }
    })
    .await;
    let running_after = t0.elapsed();
    let web = wait_ready_pods(&pods, "app=web", 1, Duration::from_secs(60)).await;
    eprintln!(
        "deployment → pod Running after {running_after:?}, Ready after {:?}",
        t0.elapsed()
    );
    let web = &web[0];
    assert_eq!(web.metadata.uid, first.metadata.uid);
    let name = web.metadata.name.clone().expect("name");
    let ip = pod_ip(web).expect("pod IP");
    assert!(
        NODE_POD_CIDR.contains(&ip),
        "pod IP {ip} in the node's pod range"
    );
    let st = web.status.as_ref().expect("status");
    assert_eq!(
        st.host_ip.as_deref(),
        Some(kubelet.endpoint().ip().to_string().as_str())
    );
    assert!(st.start_time.is_some());
    let cs = container_status(web);
    assert_eq!(cs["ready"], true);
    assert_eq!(cs["restartCount"], 0);
    assert!(cs["state"]["running"]["startedAt"].is_string(), "{cs}");
    let spec = web.spec.as_ref().expect("spec");
    assert_eq!(
        spec.node_name.as_deref(),
        Some(kubelet.node_name()),
        "bound by the stand-in"
    );
    let netns = kubelet.pod_netns(web);
    assert!(netns.exists(), "{} exists", netns.name());

    // Reachable from another pod's netns: the page names the pod ($(POD_NAME) expanded).
    let body = http_get_in(
        &c.lab,
        kvpn_lab::BACKEND_1_POD,
        SocketAddr::from((ip, 8080)),
    )
    .expect("HTTP from backend-1's netns");
    let page = PageInfo::parse(&body).unwrap_or_else(|| panic!("lab-server page: {body:?}"));
    assert_eq!(page.pod, name);
    assert_eq!(page.pod_ip, std::net::IpAddr::V4(ip));

    // --- port-forward through the API server (kube-rs, websocket v4) --------------------
    let t_pf = Instant::now();
    let answer = get_via_port_forward(&pods, &name, 8080).await;
    eprintln!("port-forward GET took {:?}", t_pf.elapsed());
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let body = answer.split_once("\r\n\r\n").map(|x| x.1).unwrap_or("");
    let page =
        PageInfo::parse(body).unwrap_or_else(|| panic!("page over port-forward: {answer:?}"));
    assert_eq!(page.pod, name);
    // The kubelet dials 127.0.0.1 inside the pod, as a real runtime does.
    assert_eq!(page.client.ip(), std::net::IpAddr::V4(Ipv4Addr::LOCALHOST));
    // Echo port: bytes both ways over two ports of one port-forward.
    let mut pf = pods
        .portforward(&name, &[7007, 8080])
        .await
        .expect("second port-forward");
    let mut echo = pf.take_stream(7007).expect("echo stream");
    echo.write_all(b"kvpn kubelet stand-in\n")
        .await
        .expect("write");
    let mut buf = [0u8; 22];
    tokio::time::timeout(Duration::from_secs(5), echo.read_exact(&mut buf))
        .await
        .expect("echo in time")
        .expect("echo read");
    assert_eq!(&buf, b"kvpn kubelet stand-in\n");
    drop(echo);
    pf.abort();
    // A closed port: the error channel carries the kubelet's message.
    let mut pf = pods
        .portforward(&name, &[9])
        .await
        .expect("port-forward to a closed port");
    let err = tokio::time::timeout(
        Duration::from_secs(5),
        pf.take_error(9).expect("error future"),
    )
    .await
    .expect("error in time");
    let err = err.expect("an error message");
    assert!(
        err.contains("connection refused") && err.contains(&name),
        "{err}"
    );

    // --- scale to 3 and back to 1 --------------------------------------------------------
    let scale = |n: i32| serde_json::json!({"spec": {"replicas": n}});
    deployments
        .patch("web", &PatchParams::default(), &Patch::Merge(scale(3)))
        .await
        .expect("scale to 3");
    let three = wait_ready_pods(&pods, "app=web", 3, Duration::from_secs(60)).await;
    let mut ips: Vec<Ipv4Addr> = three.iter().filter_map(pod_ip).collect();
    ips.sort_unstable();
    ips.dedup();
    assert_eq!(ips.len(), 3, "three distinct pod IPs: {ips:?}");
    let netns3: Vec<_> = three.iter().map(|p| kubelet.pod_netns(p)).collect();
    for n in &netns3 {
        assert!(n.exists(), "{} exists", n.name());
    }
    deployments
        .patch("web", &PatchParams::default(), &Patch::Merge(scale(1)))
        .await
        .expect("scale to 1");
    let one = wait_ready_pods(&pods, "app=web", 1, Duration::from_secs(60)).await;
    for (p, n) in three.iter().zip(&netns3) {
        let kept = p.metadata.uid == one[0].metadata.uid;
        assert_eq!(
            n.exists(),
            kept,
            "{} exists only for the kept pod",
            n.name()
        );
    }

    // --- deleting a pod removes its netns; the ReplicaSet makes a new one ---------------
    let victim = one[0].clone();
    let victim_netns = kubelet.pod_netns(&victim);
    let t_del = Instant::now();
    pods.delete(
        victim.metadata.name.as_deref().expect("name"),
        &DeleteParams::default(),
    )
    .await
    .expect("delete pod");
    eventually(
        "deleted pod gone with its netns",
        Duration::from_secs(30),
        || {
            let pods = pods.clone();
            let name = victim.metadata.name.clone().expect("name");
            let gone_netns = !victim_netns.exists();
            async move {
                let gone = pods
                    .get_opt(&name)
                    .await
                    .map_err(|e| e.to_string())?
                    .is_none();
                if gone && gone_netns {
                    Ok(())
                } else {
                    Err(format!("object gone {gone}, netns gone {gone_netns}"))
                }
            }
        },
    )
    .await;
    eprintln!(
        "pod deletion (object + netns gone) took {:?}",
        t_del.elapsed()
    );
    let replacement = wait_ready_pods(&pods, "app=web", 1, Duration::from_secs(60)).await;
    assert_ne!(replacement[0].metadata.uid, victim.metadata.uid);
    assert!(kubelet.pod_netns(&replacement[0]).exists());

    // --- stop: pods' netns removed, Node deleted ----------------------------------------
    let last_netns = kubelet.pod_netns(&replacement[0]);
    let node_name = kubelet.node_name().to_owned();
    c.kubelet
        .take()
        .expect("kubelet")
        .stop()
        .await
        .expect("kubelet stops");
    assert!(!last_netns.exists(), "stop removes the pods' netns");
    let node = Api::<Node>::all(c.client.clone())
        .get_opt(&node_name)
        .await
        .expect("get node");
    assert!(node.is_none(), "stop deletes the Node");
    let leftovers: Vec<String> = kvpn_lab::lab_netns(&id)
        .expect("list netns")
        .into_iter()
        .filter(|n| n.contains("-web-"))
        .collect();
    assert!(leftovers.is_empty(), "pod netns left: {leftovers:?}");
    c.cp.take()
        .expect("cp")
        .stop()
        .expect("control plane stops");
    c.lab.down().expect("lab down");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_pods_report_kubelet_statuses_and_volumes_reach_processes() {
    // A pod netns recorded by an earlier, killed stand-in run in the same folder: the
    // start removes it (its IP would otherwise be handed out twice).
    let stale_ip = Ipv4Addr::new(10, 244, 1, 2);
    let mut stale_netns = None;
    let mut c = Cluster::up_with(|lab| {
        let pod = lab
            .node()
            .add_pod("stale-0abcd", stale_ip)
            .expect("stale pod netns");
        let records = lab.dir().join("kubelet").join("sandboxes");
        std::fs::create_dir_all(&records).expect("records dir");
        std::fs::write(records.join("stale-0abcd"), stale_ip.to_string()).expect("record");
        assert!(pod.netns.exists());
        stale_netns = Some(pod.netns);
    })
    .await;
    let stale_netns = stale_netns.expect("stale netns");
    assert!(
        !stale_netns.exists(),
        "{} removed at start",
        stale_netns.name()
    );
    let id = c.lab.id().to_owned();
    let ns = c.namespace(&format!("kf-{id}")).await;
    let pods: Api<Pod> = Api::namespaced(c.client.clone(), &ns);
    let create = |v: serde_json::Value| {
        let pods = pods.clone();
        async move {
            pods.create(&PostParams::default(), &from_json::<Pod>(v))
                .await
                .expect("create pod")
        }
    };
    Api::<Secret>::namespaced(c.client.clone(), &ns)
        .create(
            &PostParams::default(),
            &from_json(serde_json::json!({
                "metadata": {"name": "tls"},
                "stringData": {"tls.crt": "CERT-PEM-BYTES", "tls.key": "KEY-PEM-BYTES"}
            })),
        )
        .await
        .expect("create secret");

    create(serde_json::json!({
        "metadata": {"name": "nosuch"},
        "spec": {"containers": [{"name": "app", "image": "registry.example.com/team/nosuch:1.0"}]}
    }))
    .await;
    create(serde_json::json!({
        "metadata": {"name": "crash"},
        "spec": {"containers": [{"name": "app", "image": "busybox:1.36",
            "command": ["sh", "-c", "echo crashing run; exit 3"]}]}
    }))
    .await;
    create(serde_json::json!({
        "metadata": {"name": "nocmd"},
        "spec": {"containers": [{"name": "app", "image": "busybox", "command": ["no-such-binary-kvpn"]}]}
    }))
    .await;
    create(serde_json::json!({
        "metadata": {"name": "files", "labels": {"role": "files"}},
        "spec": {
            "volumes": [{"name": "tls", "secret": {"secretName": "tls"}}],
            "containers": [{
                "name": "app", "image": "busybox",
                "command": ["sh", "-c", "cat /etc/kvpn/tls/tls.crt; echo; echo ip=$POD_IP ns=$MY_NS host=$(hostname); cat /var/run/secrets/kubernetes.io/serviceaccount/namespace; echo; echo done; exec sleep 3600"],
                "env": [
                    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "MY_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}
                ],
                "volumeMounts": [{"name": "tls", "mountPath": "/etc/kvpn/tls", "readOnly": true}],
                "readinessProbe": {"tcpSocket": {"port": 9999}, "periodSeconds": 1}
            }]
        }
    }))
    .await;

    // Unknown image: ErrImagePull, then ImagePullBackOff; the pod stays Pending.
    let reasons = std::sync::Arc::new(std::sync::Mutex::new(std::collections::BTreeSet::new()));
    let t0 = Instant::now();
    let st = eventually(
        "nosuch: ErrImagePull and ImagePullBackOff seen",
        Duration::from_secs(60),
        || {
            let pods = pods.clone();
            let reasons = reasons.clone();
            async move {
                let p = pods.get("nosuch").await.map_err(|e| e.to_string())?;
                let cs = container_status(&p);
                let mut reasons = reasons.lock().expect("lock");
                if let Some(r) = cs["state"]["waiting"]["reason"].as_str() {
                    reasons.insert(r.to_owned());
                }
                if reasons.contains("ErrImagePull") && reasons.contains("ImagePullBackOff") {
                    Ok((p, cs))
                } else {
                    Err(format!("seen {reasons:?}, now {cs}"))
                }
            }
        },
    )
    .await;
    eprintln!(
        "unknown image: both pull reasons seen after {:?}",
        t0.elapsed()
    );
    assert_eq!(phase(&st.0), "Pending");
    let pull_events = Api::<Event>::namespaced(c.client.clone(), &ns)
        .list(&ListParams::default().fields("involvedObject.name=nosuch"))
        .await
        .expect("events");
    let failed: Vec<String> = pull_events
        .items
        .iter()
        .filter(|e| e.reason.as_deref() == Some("Failed"))
        .filter_map(|e| e.message.clone())
        .collect();
    assert!(
        failed
            .iter()
            .any(|m| m.contains("Failed to pull image \"registry.example.com/team/nosuch:1.0\"")),
        "events: {failed:?}"
    );
    let p = pods.get("nosuch").await.expect("get");
    let cs = container_status(&p);
    let msg = cs["state"]["waiting"]["message"].as_str().unwrap_or("");
    assert!(msg.contains("nosuch:1.0"), "{cs}");

    // Crashing command: restarts with back-off, last exit code 3, CrashLoopBackOff.
    let saw_backoff = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let t1 = Instant::now();
    let cs = eventually(
        "crash: 2 restarts with exit code 3 and CrashLoopBackOff",
        Duration::from_secs(60),
        || {
            let pods = pods.clone();
            let saw_flag = saw_backoff.clone();
            async move {
                let p = pods.get("crash").await.map_err(|e| e.to_string())?;
                let cs = container_status(&p);
                if cs["state"]["waiting"]["reason"] == "CrashLoopBackOff" {
                    saw_flag.store(true, std::sync::atomic::Ordering::Relaxed);
                }
                let saw = saw_flag.load(std::sync::atomic::Ordering::Relaxed);
                let restarts = cs["restartCount"].as_i64().unwrap_or(0);
                if restarts >= 2 && saw && cs["lastState"]["terminated"]["exitCode"] == 3 {
                    Ok(cs)
                } else {
                    Err(format!("backoff seen {saw}, status {cs}"))
                }
            }
        },
    )
    .await;
    eprintln!(
        "crash loop: {} restarts after {:?}",
        cs["restartCount"],
        t1.elapsed()
    );
    assert_eq!(cs["lastState"]["terminated"]["reason"], "Error");
    // Without a readiness probe a container is ready exactly while it runs.
    assert_eq!(
        cs["ready"].as_bool(),
        Some(cs["state"]["running"].is_object()),
        "{cs}"
    );
    let crash = pods.get("crash").await.expect("get");
    assert_eq!(
        phase(&crash),
        "Running",
        "a crash-looping Always pod is Running, as in Kubernetes"
    );
    // pods/log through the API server reaches the stand-in's endpoint.
    let prev = pods
        .logs(
            "crash",
            &LogParams {
                previous: true,
                ..LogParams::default()
            },
        )
        .await
        .expect("previous logs");
    assert!(prev.contains("crashing run"), "previous log: {prev:?}");

    // A command that does not exist: StartError with the runtime's wording.
    let cs = eventually("nocmd: start error", Duration::from_secs(30), || {
        let pods = pods.clone();
        async move {
            let cs = container_status(&pods.get("nocmd").await.map_err(|e| e.to_string())?);
            let m = cs["lastState"]["terminated"]["message"]
                .as_str()
                .unwrap_or("")
                .to_owned();
            if m.contains("executable file not found") {
                Ok(cs)
            } else {
                Err(cs.to_string())
            }
        }
    })
    .await;
    assert_eq!(cs["lastState"]["terminated"]["reason"], "StartError");
    assert!(
        cs["lastState"]["terminated"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("no-such-binary-kvpn")
    );

    // Volumes, env and the service-account token reach the process; the readiness probe
    // on a closed port keeps it unready while it runs.
    let files = eventually(
        "files pod printed its inputs",
        Duration::from_secs(60),
        || {
            let pods = pods.clone();
            async move {
                let p = pods.get("files").await.map_err(|e| e.to_string())?;
                if phase(&p) != "Running" {
                    return Err(format!("phase {}", phase(&p)));
                }
                let log = pods
                    .logs("files", &LogParams::default())
                    .await
                    .map_err(|e| e.to_string())?;
                if log.contains("done") {
                    Ok((p, log))
                } else {
                    Err(format!("log so far: {log:?}"))
                }
            }
        },
    )
    .await;
    let ip = pod_ip(&files.0).expect("pod ip");
    let log = files.1;
    assert!(log.contains("CERT-PEM-BYTES"), "secret file mounted: {log}");
    assert!(
        log.contains(&format!("ip={ip} ns={ns} host=files")),
        "{log}"
    );
    assert!(
        log.contains(&format!("\n{ns}\n")),
        "service-account namespace file: {log}"
    );
    assert!(
        !std::path::Path::new("/etc/kvpn/tls").exists(),
        "the mount path exists only inside the pod"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let p = pods.get("files").await.expect("get");
    assert!(
        !is_ready(&p),
        "tcp readiness probe on a closed port: not Ready"
    );
    let cond = p
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "ContainersReady").cloned())
        .expect("ContainersReady");
    assert_eq!(cond.reason.as_deref(), Some("ContainersNotReady"));
    assert!(container_status(&p)["state"]["running"].is_object());

    // pods/log?follow=true streams new lines as the process writes them.
    create(serde_json::json!({
        "metadata": {"name": "ticker"},
        "spec": {"containers": [{"name": "app", "image": "busybox",
            "command": ["sh", "-c", "i=0; while true; do echo tick $i; i=$((i+1)); sleep 0.2; done"]}]}
    }))
    .await;
    eventually("ticker running", Duration::from_secs(30), || {
        let pods = pods.clone();
        async move {
            let p = pods.get("ticker").await.map_err(|e| e.to_string())?;
            if phase(&p) == "Running" {
                Ok(())
            } else {
                Err(phase(&p).to_owned())
            }
        }
    })
    .await;
    let before = pods
        .logs("ticker", &LogParams::default())
        .await
        .expect("logs");
    let known = before.lines().count();
    let follow = LogParams {
        follow: true,
        ..LogParams::default()
    };
    let stream = pods.log_stream("ticker", &follow).await.expect("follow");
    let mut lines = futures::AsyncBufReadExt::lines(stream);
    let mut seen = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(line) = futures::StreamExt::next(&mut lines).await {
            seen.push(line.expect("line"));
            if seen.len() >= known + 5 {
                break;
            }
        }
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "follow delivered only {} lines ({known} existed)",
            seen.len()
        )
    });
    let ticks: Vec<u32> = seen
        .iter()
        .filter_map(|l| l.strip_prefix("tick ").and_then(|n| n.parse().ok()))
        .collect();
    assert!(
        ticks.windows(2).all(|w| w[1] == w[0] + 1),
        "consecutive ticks: {ticks:?}"
    );
    assert!(
        ticks.len() >= known + 5,
        "new lines arrived while following: {ticks:?}"
    );

    c.kubelet
        .take()
        .expect("kubelet")
        .stop()
        .await
        .expect("kubelet stops");
    let left: Vec<String> = kvpn_lab::lab_netns(&id)
        .expect("netns")
        .into_iter()
        .filter(|n| {
            ["-nosuch-", "-crash-", "-nocmd-", "-files-", "-ticker-"]
                .iter()
                .any(|p| n.contains(p))
        })
        .collect();
    assert!(left.is_empty(), "pod netns left after stop: {left:?}");
    c.cp.take()
        .expect("cp")
        .stop()
        .expect("control plane stops");
    c.lab.down().expect("lab down");
}
