//! End-to-end tests of `kvpn connect --kubeconfig` (issue [kube-connect]) on the
//! Kubernetes lab: a real kube-apiserver, the kubelet stand-in running the real
//! traffic manager as a Deployment's pod, and a laptop netns that reaches only the
//! API server, so every packet rides `pods/portforward` through it. Each test has
//! its own lab ([`KubeFixture`]); all run as root, in parallel.
//!
//! Needs the workspace binaries (`cargo build --bins`, then `KVPN_BIN_DIR`) and the
//! Kubernetes binaries of `scripts/build-kubernetes.sh`.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kvpn_lab::HTTP_PORT;
use kvpn_tests::kube_lab::{
    KVPN_VERSION, KubeFixture, MANAGER_NAMESPACE, MANAGER_SELECTOR, TcpSocket, pod_ip, pod_name,
    web,
};
use kvpn_tests::text;

const VERSION_ANNOTATION: &str = "kvpn.dev/version";
const MANAGED_BY: &str = "app.kubernetes.io/managed-by=kvpn";

/// Metadata of the objects `api` lists with `selector`.
macro_rules! metas {
    ($f:expr, $api:expr, $selector:expr) => {{
        let api = $api;
        $f.block_on(api.list(&ListParams::default().labels($selector)))
            .unwrap_or_else(|e| panic!("list {}: {e}", stringify!($api)))
            .items
            .into_iter()
            .map(|o| o.metadata)
            .collect::<Vec<ObjectMeta>>()
    }};
}

/// Every kind kvpn installs, as "Kind name" of the objects labelled as kvpn's
/// (namespaced ones in the manager namespace), with their metadata.
fn kvpn_objects(f: &KubeFixture, selector: &str) -> Vec<(String, ObjectMeta)> {
    let c = f.admin();
    let ns = MANAGER_NAMESPACE;
    let mut all = Vec::new();
    let mut add = |kind: &str, metas: Vec<ObjectMeta>| {
        for m in metas {
            all.push((format!("{kind} {}", m.name.clone().unwrap_or_default()), m));
        }
    };
    add(
        "Deployment",
        metas!(f, Api::<Deployment>::namespaced(c.clone(), ns), selector),
    );
    add(
        "ReplicaSet",
        metas!(f, Api::<ReplicaSet>::namespaced(c.clone(), ns), selector),
    );
    add(
        "Pod",
        metas!(f, Api::<Pod>::namespaced(c.clone(), ns), selector),
    );
    add(
        "Service",
        metas!(f, Api::<Service>::namespaced(c.clone(), ns), selector),
    );
    add(
        "ConfigMap",
        metas!(f, Api::<ConfigMap>::namespaced(c.clone(), ns), selector),
    );
    add(
        "Secret",
        metas!(f, Api::<Secret>::namespaced(c.clone(), ns), selector),
    );
    add(
        "ServiceAccount",
        metas!(
            f,
            Api::<ServiceAccount>::namespaced(c.clone(), ns),
            selector
        ),
    );
    add(
        "Role",
        metas!(f, Api::<Role>::namespaced(c.clone(), ns), selector),
    );
    add(
        "RoleBinding",
        metas!(f, Api::<RoleBinding>::namespaced(c.clone(), ns), selector),
    );
    add(
        "ClusterRole",
        metas!(f, Api::<ClusterRole>::all(c.clone()), selector),
    );
    add(
        "ClusterRoleBinding",
        metas!(f, Api::<ClusterRoleBinding>::all(c.clone()), selector),
    );
    add("Namespace", metas!(f, Api::<Namespace>::all(c), selector));
    all
}

fn annotation<'a>(m: &'a ObjectMeta, key: &str) -> Option<&'a str> {
    m.annotations.as_ref()?.get(key).map(String::as_str)
}

fn label<'a>(m: &'a ObjectMeta, key: &str) -> Option<&'a str> {
    m.labels.as_ref()?.get(key).map(String::as_str)
}

/// The objects a fresh install creates: labelled, written by field manager `kvpn`
/// (server-side apply, except the Secret, which is created conditionally so that
/// parallel connects agree on one certificate), annotated with this version.
fn assert_installed_objects(f: &KubeFixture) {
    let objects = kvpn_objects(f, MANAGER_SELECTOR);
    let names: BTreeSet<&str> = objects.iter().map(|(n, _)| n.as_str()).collect();
    let cluster_scoped = format!("kvpn-manager-{MANAGER_NAMESPACE}");
    for want in [
        "Deployment kvpn-manager".to_owned(),
        "Service kvpn-manager".to_owned(),
        "ConfigMap kvpn-manager".to_owned(),
        "Secret kvpn-manager-tls".to_owned(),
        "ServiceAccount kvpn-manager".to_owned(),
        "Role kvpn-manager".to_owned(),
        "RoleBinding kvpn-manager".to_owned(),
        format!("ClusterRole {cluster_scoped}"),
        format!("ClusterRoleBinding {cluster_scoped}"),
    ] {
        assert!(
            names.contains(want.as_str()),
            "{want} missing among the objects labelled {MANAGER_SELECTOR}: {names:?}"
        );
    }
    assert!(
        objects
            .iter()
            .any(|(n, _)| n.starts_with("Pod kvpn-manager-")),
        "the manager pod carries the labels: {names:?}"
    );
    for (name, m) in &objects {
        assert_eq!(
            label(m, "app.kubernetes.io/name"),
            Some("kvpn-manager"),
            "{name}"
        );
        assert_eq!(
            label(m, "app.kubernetes.io/managed-by"),
            Some("kvpn"),
            "{name}"
        );
        if name.starts_with("Pod ") || name.starts_with("ReplicaSet ") {
            // Made by the controllers from kvpn's pod template, not by kvpn.
            continue;
        }
        assert_eq!(
            annotation(m, VERSION_ANNOTATION),
            Some(KVPN_VERSION),
            "{name}: owner annotation"
        );
        let fields = m.managed_fields.as_deref().unwrap_or_default();
        let kvpn: Vec<_> = fields
            .iter()
            .filter(|e| e.manager.as_deref() == Some("kvpn"))
            .collect();
        assert!(
            !kvpn.is_empty(),
            "{name}: no managedFields entry of field manager kvpn: {:?}",
            fields
                .iter()
                .map(|e| (&e.manager, &e.operation))
                .collect::<Vec<_>>()
        );
        if !name.starts_with("Secret ") {
            assert!(
                kvpn.iter().any(|e| e.operation.as_deref() == Some("Apply")),
                "{name}: kvpn's fields are not server-side applied: {:?}",
                kvpn.iter().map(|e| &e.operation).collect::<Vec<_>>()
            );
        }
    }
}

fn ready_manager(f: &KubeFixture) -> Pod {
    f.wait_manager_pod(Duration::from_secs(30), |_| true)
}

fn pod_version(p: &Pod) -> Option<&str> {
    annotation(&p.metadata, VERSION_ANNOTATION)
}

/// Case 1: connect with the restricted kubeconfig from a laptop that reaches only
/// the API server; a ClusterIP and pod IPs answer; the installed objects carry
/// kvpn's labels and field manager; a second connect is a no-op that says so.
#[test]
fn restricted_connect_reaches_cluster_ip_and_pod_ips_and_is_idempotent() {
    let f = KubeFixture::new();
    // Before: the laptop has no route into the cluster, only to the API server.
    let before = f.http_get(web(), Duration::from_secs(1));
    assert!(
        before.is_err(),
        "the laptop reached the ClusterIP before connecting: {before:?}"
    );
    let routes = f.laptop_routes();
    assert!(
        routes
            .iter()
            .all(|r| !r.starts_with("10.") && !r.starts_with("default")),
        "the laptop netns must reach only the uplink /30: {routes:?}"
    );

    let t0 = Instant::now();
    let out = f.connect_restricted();
    let connect_time = t0.elapsed();
    assert!(out.contains("Installing traffic manager"), "{out}");
    assert!(out.contains("through port-forward"), "{out}");
    f.wait_state("connected", Duration::from_secs(15));
    let s = f.session();
    assert_eq!(s["transport"], "port-forward", "{s:#}");
    assert_eq!(s["cluster"], f.cluster_name(), "{s:#}");
    assert_eq!(s["server"], "https://172.31.255.1:6443", "{s:#}");
    assert!(
        s["context"]
            .as_str()
            .is_some_and(|c| c.contains("kvpn-user")),
        "{s:#}"
    );
    assert_eq!(s["manager_namespace"], MANAGER_NAMESPACE, "{s:#}");
    assert!(
        s["manager"]
            .as_str()
            .is_some_and(|m| m.starts_with("127.0.0.1:")),
        "the root daemon dials the user daemon on loopback: {s:#}"
    );
    assert_eq!(s["tunnel_ip"], "100.96.0.2", "{s:#}");
    assert_eq!(
        s["data_channel"], "tls",
        "the data channel is TLS, verified against the Secret's CA: {s:#}"
    );
    let table = f.kvpn_ok(&["status"]);
    assert!(
        table.contains(&format!("cluster {}", f.cluster_name()))
            && table.contains("through port-forward"),
        "status table shows the origin: {table}"
    );

    // A ClusterIP, balanced over both backends, SNATed by the manager pod.
    let manager = ready_manager(&f);
    let page = f.page(web());
    assert!(page.pod.starts_with("web-"), "{page:?}");
    assert_eq!(
        page.client.ip(),
        pod_ip(&manager),
        "backends see the manager pod's IP (SNAT)"
    );
    // Each backend pod by its pod IP (looked up with the admin kubeconfig).
    let web_pods = f.pods("default", "app=web");
    assert_eq!(web_pods.len(), 2, "default/web pods");
    for p in &web_pods {
        let addr = SocketAddr::new(pod_ip(p), HTTP_PORT);
        let page = f.page(addr);
        assert_eq!(page.pod, pod_name(p), "GET {addr}");
        assert_eq!(page.pod_ip, pod_ip(p), "GET {addr}");
    }

    assert_installed_objects(&f);

    // Idempotent: the same connect again finds the session and does nothing.
    let tun_name = s["tun_name"].as_str().unwrap_or_default().to_owned();
    let tun = f.tun_state(&tun_name);
    let daemons = f.user_daemon_pids();
    assert_eq!(daemons.len(), 1, "one user daemon: {daemons:?}");
    assert_eq!(
        f.session_listeners(),
        vec![s["manager"].as_str().unwrap_or_default().to_owned()],
        "the user daemon listens once, where the root daemon dials"
    );
    assert!(f.agent_pids().is_empty(), "no per-session agent process");
    let kubeconfig = f.user_kubeconfig();
    let again = f.kvpn(&["connect", "--kubeconfig", &kubeconfig]);
    let again_out = text(&again.stdout);
    assert!(
        again.status.success(),
        "second connect: {again_out}\n{}",
        text(&again.stderr)
    );
    assert!(
        again_out.contains("Already connected") && again_out.contains("nothing to do"),
        "second connect says it is a no-op: {again_out}"
    );
    for not in [
        "Installing",
        "Creating",
        "Upgrading",
        "through a port-forward to pod",
        "Detecting",
    ] {
        assert!(
            !again_out.contains(not),
            "second connect did {not:?}: {again_out}"
        );
    }
    let s2 = f.session();
    assert_eq!(s2["id"], s["id"], "same session");
    assert_eq!(f.tun_state(&tun_name), tun, "same TUN device");
    assert_eq!(
        f.tun_devices(),
        vec![tun_name.clone()],
        "no second TUN device"
    );
    assert_eq!(f.user_daemon_pids(), daemons, "the same user daemon");
    assert_eq!(f.session_listeners().len(), 1, "no second listener");
    // Flags that would shape a new session are not silently dropped.
    let third = f.kvpn(&[
        "connect",
        "--kubeconfig",
        &kubeconfig,
        "--cidr",
        "10.1.0.0/16",
        "-n",
        "default",
    ]);
    let third_err = text(&third.stderr);
    assert!(third.status.success(), "{third_err}");
    assert!(
        third_err.contains("--cidr, --namespace not applied")
            && third_err.contains("kvpn disconnect"),
        "the ignored flags are named with the fix: {third_err}"
    );
    assert!(
        !f.laptop_routes()
            .iter()
            .any(|r| r.starts_with("10.1.0.0/16")),
        "{:?}",
        f.laptop_routes()
    );
    assert_eq!(
        pod_name(&ready_manager(&f)),
        pod_name(&manager),
        "manager untouched"
    );
    f.page(web());
    eprintln!(
        "restricted connect (install + CIDR detection + agent + TUN): {:.2} s",
        connect_time.as_secs_f64()
    );
}

/// Cases 2 and 5: disconnect leaves no TUN device, route or agent; an older
/// manager (version annotation 0.0.1) is upgraded by the next connect (a new pod
/// that the session then uses); uninstall while connected disconnects the session
/// first and removes every object kvpn created.
#[test]
fn disconnect_upgrade_of_an_older_manager_and_uninstall() {
    let f = KubeFixture::new();
    let out = f.connect_restricted();
    assert!(out.contains("Installing traffic manager"), "{out}");
    f.wait_state("connected", Duration::from_secs(15));
    f.page(web());
    assert_eq!(f.session_listeners().len(), 1);

    // Disconnect: no TUN device, no cluster route, no listener, no cluster.
    let out = f.kvpn_ok(&["disconnect", "--all"]);
    assert!(out.contains("Disconnected session"), "{out}");
    assert!(
        f.sessions().is_empty(),
        "sessions after disconnect: {:?}",
        f.sessions()
    );
    assert_eq!(f.tun_devices(), Vec::<String>::new(), "TUN devices left");
    let routes = f.laptop_routes();
    assert!(
        routes.iter().all(|r| !r.starts_with("10.")),
        "cluster routes left after disconnect: {routes:?}"
    );
    assert_eq!(
        f.session_listeners(),
        Vec::<String>::new(),
        "port-forward listener left after disconnect"
    );
    assert!(
        f.http_get(web(), Duration::from_secs(1)).is_err(),
        "cluster reachable after disconnect"
    );

    // An older manager: the Deployment and its pod template say 0.0.1 (as an older
    // kvpn would have written them); its pod rolls to a 0.0.1 pod.
    let deployments: Api<Deployment> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    let old_version = serde_json::json!({
        "metadata": {"annotations": {VERSION_ANNOTATION: "0.0.1"}},
        "spec": {"template": {"metadata": {"annotations": {VERSION_ANNOTATION: "0.0.1"}}}},
    });
    f.block_on(deployments.patch(
        "kvpn-manager",
        &PatchParams::default(),
        &Patch::Merge(&old_version),
    ))
    .unwrap_or_else(|e| panic!("patch the manager Deployment to 0.0.1: {e}"));
    let old = f.wait_manager_pod(Duration::from_secs(60), |p| pod_version(p) == Some("0.0.1"));

    let t0 = Instant::now();
    let out = f.connect_restricted();
    let upgrade_time = t0.elapsed();
    assert!(
        out.contains(&format!(
            "Upgrading traffic manager v0.0.1 → v{KVPN_VERSION}"
        )),
        "connect upgrades the older manager: {out}"
    );
    let new = f.wait_manager_pod(Duration::from_secs(60), |p| {
        pod_version(p) == Some(KVPN_VERSION)
    });
    assert_ne!(
        pod_name(&new),
        pod_name(&old),
        "the upgrade rolled a new pod"
    );
    let d = f
        .block_on(deployments.get("kvpn-manager"))
        .unwrap_or_else(|e| panic!("get Deployment: {e}"));
    assert_eq!(
        annotation(&d.metadata, VERSION_ANNOTATION),
        Some(KVPN_VERSION)
    );
    f.wait_state("connected", Duration::from_secs(15));
    let page = f.page(web());
    assert_eq!(
        page.client.ip(),
        pod_ip(&new),
        "traffic goes through the upgraded pod"
    );

    // Uninstall while connected: the session through this manager is disconnected
    // first (said so), then nothing of kvpn's is left in the cluster or the laptop.
    let id = f.session()["id"].as_str().unwrap_or_default().to_owned();
    let kubeconfig = f.user_kubeconfig();
    let out = f.kvpn_ok(&["uninstall", "--kubeconfig", &kubeconfig]);
    assert!(
        out.contains(&format!("Disconnected session {id} first")),
        "{out}"
    );
    // The summary once (it was also repeated as "✓ Removed 9 objects").
    assert_eq!(out.matches("Removed").count(), 1, "{out}");
    assert!(out.contains("Removed the traffic manager from"), "{out}");
    assert_eq!(f.sessions().len(), 0, "session left after uninstall");
    assert_eq!(
        f.session_listeners(),
        Vec::<String>::new(),
        "port-forward listener left after uninstall"
    );
    // ReplicaSets go through the garbage collector after uninstall returns.
    let t1 = Instant::now();
    loop {
        let left = kvpn_objects(&f, MANAGED_BY);
        if left.is_empty() {
            break;
        }
        assert!(
            t1.elapsed() < Duration::from_secs(30),
            "objects labelled {MANAGED_BY} left 30 s after uninstall: {:?}",
            left.iter().map(|(n, _)| n).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let pods = f.pods(MANAGER_NAMESPACE, "app.kubernetes.io/name=kvpn-manager");
    assert!(
        pods.is_empty(),
        "manager pods left: {:?}",
        pods.iter().map(pod_name).collect::<Vec<_>>()
    );
    assert_eq!(f.tun_devices(), Vec::<String>::new(), "TUN devices left");
    eprintln!("connect with upgrade: {:.2} s", upgrade_time.as_secs_f64());
}

/// Case 3: the manager pod is killed → status says reconnecting, then traffic
/// resumes through the replacement pod with the same session, tunnel IP and TUN
/// device. Then no manager pod at all for a while (Deployment scaled to 0): the
/// session stays reconnecting, redialling with backoff instead of spinning (the
/// agent accepts each redial and closes it when it finds no ready pod), and
/// recovers once a pod is back.
#[test]
fn killed_manager_pod_reconnecting_then_traffic_resumes_on_the_same_tun() {
    let f = KubeFixture::new();
    f.connect_restricted();
    f.wait_state("connected", Duration::from_secs(15));
    f.page(web());
    let s0 = f.session();
    let tun_name = s0["tun_name"].as_str().unwrap_or_default().to_owned();
    let tun0 = f.tun_state(&tun_name);
    let old = ready_manager(&f);
    let old_name = pod_name(&old);

    let pods: Api<Pod> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    let t0 = Instant::now();
    f.block_on(pods.delete(&old_name, &DeleteParams::default()))
        .unwrap_or_else(|e| panic!("delete manager pod {old_name}: {e}"));
    let to_reconnecting = f.wait_state("reconnecting", Duration::from_secs(15));
    let reason = f.session()["reason"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let (recovered, page) = f.wait_http(web(), t0, Duration::from_secs(30));
    let to_connected = {
        f.wait_state("connected", Duration::from_secs(15));
        t0.elapsed()
    };
    let new = f.wait_manager_pod(Duration::from_secs(10), |p| pod_name(p) != old_name);
    assert_eq!(
        page.client.ip(),
        pod_ip(&new),
        "traffic goes through the replacement pod {}",
        pod_name(&new)
    );

    let s1 = f.session();
    assert_eq!(s1["id"], s0["id"], "same session");
    assert_eq!(s1["tunnel_ip"], s0["tunnel_ip"], "same tunnel IP");
    assert_eq!(s1["tun_name"], s0["tun_name"], "same TUN device name");
    assert_eq!(
        f.tun_state(&tun_name),
        tun0,
        "same TUN device (ifindex, addresses, routes)"
    );
    assert_eq!(f.user_daemon_pids().len(), 1, "the same single user daemon");
    assert_eq!(f.session_listeners().len(), 1, "one listener");
    eprintln!(
        "manager pod {old_name} deleted → reconnecting after {:.2} s ({reason}), \
         traffic back after {:.2} s, connected after {:.2} s, through {}",
        to_reconnecting.as_secs_f64(),
        recovered.as_secs_f64(),
        to_connected.as_secs_f64(),
        pod_name(&new)
    );

    // No manager pod for 6 s.
    let deployments: Api<Deployment> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    let scale = |replicas: i32| {
        let patch = serde_json::json!({"spec": {"replicas": replicas}});
        f.block_on(deployments.patch(
            "kvpn-manager",
            &PatchParams::default(),
            &Patch::Merge(&patch),
        ))
        .unwrap_or_else(|e| panic!("scale the manager to {replicas}: {e}"));
    };
    let log_len = || {
        std::fs::read_to_string(f.runtime_dir().join("dataplane.log"))
            .unwrap_or_default()
            .len()
    };
    scale(0);
    f.wait_state("reconnecting", Duration::from_secs(30));
    let from = log_len();
    std::thread::sleep(Duration::from_secs(6));
    let log = std::fs::read_to_string(f.runtime_dir().join("dataplane.log")).unwrap_or_default();
    // Each redial ends in one of these (the TLS handshake fails when the agent
    // gives up and closes; it succeeds while the agent still holds it).
    let window = log.get(from..).unwrap_or_default();
    let redials = window.matches("data connection re-established").count()
        + window.matches("re-dial failed").count();
    assert_eq!(
        f.session()["state"],
        "reconnecting",
        "no manager pod, not connected"
    );
    // Backoff 250 ms doubling to 2 s, plus the agent holding each redial up to 4 s
    // while it looks for a ready pod: a handful in 6 s. Spinning made thousands.
    assert!(
        (1..=12).contains(&redials),
        "{redials} redials in 6 s without a manager pod (backoff expected)"
    );
    let t1 = Instant::now();
    scale(1);
    let (back, _) = f.wait_http(web(), t1, Duration::from_secs(30));
    assert_eq!(
        f.tun_state(&tun_name),
        tun0,
        "same TUN device after the outage"
    );
    assert_eq!(f.session()["id"], s0["id"], "same session after the outage");
    eprintln!(
        "no manager pod for 6 s: {redials} redials; traffic back {:.2} s after scaling to 1",
        back.as_secs_f64()
    );
}

/// Case tr-08 over port-forward: the transport is killed five times in a row —
/// alternately the agent's websocket to the API server (the port-forward itself)
/// and the root daemon's connection to the agent — and each time traffic recovers
/// within 3 s on the same TUN device (ifindex, addresses, routes), with no socket
/// left behind.
#[test]
fn tr_08_port_forward_killed_five_times_recovers_each_time_on_the_same_tun() {
    let f = KubeFixture::new();
    f.connect_restricted();
    f.wait_state("connected", Duration::from_secs(15));
    f.page(web());
    let s0 = f.session();
    let id = s0["id"].clone();
    let tun_name = s0["tun_name"].as_str().unwrap_or_default().to_owned();
    let agent_addr = s0["manager"].as_str().unwrap_or_default().to_owned();
    let tun0 = f.tun_state(&tun_name);
    // The user daemon holds the session's port-forward side (it has only this one).
    let agents = f.user_daemon_pids();
    assert_eq!(agents.len(), 1, "one user daemon: {agents:?}");
    let agent = agents[0];
    let sockets0 = f.tcp_sockets_of(agent);
    let listening0: Vec<&TcpSocket> = sockets0.iter().filter(|s| s.state == "LISTEN").collect();
    assert_eq!(listening0.len(), 1, "the agent listens once: {sockets0:?}");
    assert_eq!(listening0[0].local, agent_addr, "{sockets0:?}");
    let fds0 = KubeFixture::fd_count(agent);
    let to_api0 = sockets0
        .iter()
        .filter(|s| s.state == "ESTAB" && s.peer == "172.31.255.1:6443")
        .count();
    let daemon_log =
        || std::fs::read_to_string(f.runtime_dir().join("dataplane.log")).unwrap_or_default();

    let mut times = Vec::new();
    for round in 0..5 {
        let (what, dst) = if round % 2 == 0 {
            (
                "port-forward websocket (agent → API server)",
                "172.31.255.1:6443".to_owned(),
            )
        } else {
            ("transport (root daemon → agent)", agent_addr.clone())
        };
        let redials = daemon_log()
            .matches("data connection re-established")
            .count();
        let t0 = Instant::now();
        let killed = f.laptop(&["ss", "-K", "-Htn", "state", "established", "dst", &dst]);
        assert!(killed.status.success(), "ss -K: {}", text(&killed.stderr));
        assert!(
            !text(&killed.stdout).trim().is_empty(),
            "round {round}: no established connection to {dst} to kill"
        );
        let (dt, _) = f.wait_http(web(), t0, Duration::from_secs(10));
        times.push((what, dt));
        assert!(
            daemon_log()
                .matches("data connection re-established")
                .count()
                > redials,
            "round {round}: the root daemon did not redial after killing the {what}"
        );
        assert_eq!(
            f.tun_state(&tun_name),
            tun0,
            "round {round}: same TUN device"
        );
        assert_eq!(f.session()["id"], id, "round {round}: same session");
    }
    f.wait_state("connected", Duration::from_secs(10));

    // No leftovers: once the old port-forwards have closed, the agent has its one
    // listener, one transport connection from the root daemon, and to the API
    // server the port-forward's websocket, the route watch's port-forward (gone
    // for its backoff after a kill, kube_watch_routes.rs) and at most one idle
    // keep-alive connection of its HTTP client's pool (a pod list that ran while
    // the previous connection was still busy); nothing half-closed.
    let t1 = Instant::now();
    let to_api = loop {
        let sockets = f.tcp_sockets_of(agent);
        let listening: Vec<&TcpSocket> = sockets.iter().filter(|s| s.state == "LISTEN").collect();
        let from_daemon = sockets
            .iter()
            .filter(|s| s.state == "ESTAB" && s.local == agent_addr)
            .count();
        let to_api = sockets
            .iter()
            .filter(|s| s.state == "ESTAB" && s.peer == "172.31.255.1:6443")
            .count();
        let others = sockets
            .iter()
            .filter(|s| s.state != "LISTEN" && s.state != "ESTAB")
            .count();
        if listening == listening0 && from_daemon == 1 && (1..=3).contains(&to_api) && others == 0 {
            break to_api;
        }
        assert!(
            t1.elapsed() < Duration::from_secs(5),
            "agent sockets before {sockets0:?}, after {sockets:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    // One more descriptor than before (slack, as ever), plus one per API-server
    // connection above the start's (the pool's idle keep-alives allowed above;
    // a CI run saw 16 -> 18 with them): a leak per kill shows as 5 more.
    let allowed = fds0 + 1 + to_api.saturating_sub(to_api0);
    let t2 = Instant::now();
    let fds = loop {
        let fds = KubeFixture::fd_count(agent);
        if fds <= allowed || t2.elapsed() > Duration::from_secs(5) {
            break fds;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        fds <= allowed,
        "agent file descriptors: {fds0} before, {fds} after five kills (allowed {allowed}: \
         API-server connections {to_api0} before, {to_api} after)"
    );
    assert_eq!(
        f.user_daemon_pids(),
        agents,
        "the same user daemon survived"
    );
    let daemon_pid: u32 = std::fs::read_to_string(f.runtime_dir().join("dataplane.pid"))
        .ok()
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("root daemon pid file"));
    // Besides its split-DNS forwarder's TCP listener (127.0.0.153:53), the root
    // daemon holds exactly one TCP socket: its data connection to the agent.
    let (dns_listener, daemon_tcp): (Vec<TcpSocket>, Vec<TcpSocket>) = f
        .tcp_sockets_of(daemon_pid)
        .into_iter()
        .partition(|s| s.state == "LISTEN" && s.local == "127.0.0.153:53");
    assert_eq!(dns_listener.len(), 1, "the DNS forwarder listens on TCP");
    let daemon_tcp: Vec<(String, String)> =
        daemon_tcp.into_iter().map(|s| (s.state, s.peer)).collect();
    assert_eq!(
        daemon_tcp,
        vec![("ESTAB".to_owned(), agent_addr.clone())],
        "the root daemon's only other TCP socket is its data connection to the agent"
    );

    let report: Vec<String> = times
        .iter()
        .map(|(what, d)| format!("{:.0} ms ({what})", d.as_secs_f64() * 1000.0))
        .collect();
    eprintln!(
        "tr-08 recovery times: {}; agent fds {fds0} before, {fds} after; agent connections to the API server: {to_api}",
        report.join(", ")
    );
    for (round, (what, d)) in times.iter().enumerate() {
        assert!(
            *d < Duration::from_secs(3),
            "round {round}: traffic took {d:?} to recover after killing the {what} (tr-08: < 3 s)"
        );
    }
}
