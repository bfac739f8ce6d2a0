//! Traffic manager replicas with leases in Kubernetes (issue #26 [scale], items 1
//! and 2), on the Kubernetes lab (the kubelet stand-in runs each manager replica
//! as its own process in its own pod netns, so three replicas are three managers
//! sharing one API server).
//!
//! One lab, in order:
//! - `kvpn connect --replicas 3` installs three replicas, picks the ready one with
//!   the fewest sessions and names it in its output and `kvpn status`;
//! - 20 `Lease` calls at the same moment spread over the three replicas get 20
//!   distinct tunnel IPs, none the CLI session's; each is one Lease object
//!   (coordination.k8s.io) named after its IP, written by more than one replica;
//! - a lease object edited into garbage by hand: the managers skip it (logged
//!   with the object and the fix), never hand its IP out, and every other
//!   client's lease is still there (same IP and token on a second `Lease`);
//! - leases an older manager kept in its ConfigMap (key `leases.json`) move into
//!   Lease objects when a replica starts, and the key goes;
//! - the CLI session's replica pod is deleted: the session goes on through
//!   another replica with the same tunnel IP (its lease lives in the object);
//! - `--replicas 0` is refused naming the flag; someone else scales the
//!   Deployment to 2 and a plain `kvpn connect` keeps 2;
//! - `kvpn uninstall --force` removes the lease objects too.
//!
//! Needs root and the Kubernetes lab binaries, like every `kube_*` test.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, ListParams, LogParams, Patch, PatchParams};
use kvpn_control::install::objects::GRPC_PORT;
use kvpn_tests::kube_lab::{KubeFixture, MANAGER_NAMESPACE, pod_name, pod_ready, web};
use kvpn_tests::text;

const SELECTOR: &str =
    "app.kubernetes.io/name=kvpn-manager,app.kubernetes.io/component=tunnel-ip-lease";
const RECORD: &str = "kvpn.dev/lease";
const CLIENTS: usize = 20;

/// Every lease object: name → (holder, record JSON as stored).
fn lease_objects(f: &KubeFixture) -> BTreeMap<String, (Option<String>, String)> {
    let api: Api<Lease> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    f.block_on(api.list(&ListParams::default().labels(SELECTOR)))
        .unwrap_or_else(|e| panic!("list Lease objects: {e}"))
        .items
        .into_iter()
        .map(|l| {
            let name = l.metadata.name.clone().unwrap_or_default();
            let holder = l.spec.as_ref().and_then(|s| s.holder_identity.clone());
            let record = l
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(RECORD).cloned())
                .unwrap_or_default();
            (name, (holder, record))
        })
        .collect()
}

fn object_name(ip: Ipv4Addr) -> String {
    let [a, b, c, d] = ip.octets();
    format!("kvpn-lease-{a}-{b}-{c}-{d}")
}

fn ready_manager_pods(f: &KubeFixture) -> Vec<String> {
    let mut names: Vec<String> = f
        .manager_pods()
        .iter()
        .filter(|p| pod_ready(p))
        .map(pod_name)
        .collect();
    names.sort();
    names
}

fn wait_ready_replicas(f: &KubeFixture, n: usize, within: Duration) -> Vec<String> {
    let t0 = Instant::now();
    loop {
        let ready = ready_manager_pods(f);
        if ready.len() == n {
            return ready;
        }
        assert!(
            t0.elapsed() < within,
            "{n} ready manager replicas expected within {within:?}, have {ready:?}\n{}",
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `Lease` for each `(client id, replica)` at the same moment; (tunnel IP,
/// token) per client id.
fn lease_all(f: &KubeFixture, asks: &[(String, String)]) -> BTreeMap<String, (Ipv4Addr, String)> {
    let kube = f.admin();
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(asks.len()));
    f.block_on(async {
        let mut tasks = tokio::task::JoinSet::new();
        for (id, pod) in asks.iter().cloned() {
            let (kube, barrier) = (kube.clone(), barrier.clone());
            tasks.spawn(async move {
                barrier.wait().await;
                let r = tokio::time::timeout(
                    Duration::from_secs(30),
                    kvpn_control::lease::lease(&kube, MANAGER_NAMESPACE, &pod, GRPC_PORT, &id),
                )
                .await;
                (id, pod, r)
            });
        }
        let mut out = BTreeMap::new();
        while let Some(joined) = tasks.join_next().await {
            let (id, pod, r) = joined.unwrap_or_else(|e| panic!("lease task: {e}"));
            let leased = r
                .unwrap_or_else(|_| panic!("{id} on {pod}: no answer within 30 s"))
                .unwrap_or_else(|e| panic!("{id} on {pod}: {e:#}"));
            let ip: Ipv4Addr = leased
                .tunnel_ip
                .parse()
                .unwrap_or_else(|e| panic!("{id}: tunnel IP {:?}: {e}", leased.tunnel_ip));
            out.insert(id, (ip, leased.session_token));
        }
        out
    })
}

/// The logs of every manager pod, joined.
fn manager_logs(f: &KubeFixture) -> String {
    let api: Api<Pod> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    f.manager_pods()
        .iter()
        .map(|p| {
            let name = pod_name(p);
            f.block_on(api.logs(&name, &LogParams::default()))
                .unwrap_or_else(|e| format!("(no log of {name}: {e})"))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn deployment_replicas(f: &KubeFixture) -> i32 {
    let api: Api<Deployment> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    f.block_on(api.get("kvpn-manager"))
        .unwrap_or_else(|e| panic!("get Deployment kvpn-manager: {e}"))
        .spec
        .and_then(|s| s.replicas)
        .unwrap_or_else(|| panic!("Deployment kvpn-manager without spec.replicas"))
}

#[test]
fn three_replicas_share_leases_in_lease_objects_spread_sessions_and_survive_a_pod_deletion() {
    let t0 = Instant::now();
    let f = KubeFixture::new();
    let lab_id = f.lab().netns_lab().id().to_owned();
    let kubeconfig = f.user_kubeconfig();

    // Refused before anything is written, naming the flag, the cause and the fix.
    for bad in ["0", "21"] {
        let out = f.kvpn(&["connect", "--kubeconfig", &kubeconfig, "--replicas", bad]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "--replicas {bad} was accepted: {err}"
        );
        assert!(
            err.contains("--replicas") && err.contains("give 1 to 20"),
            "{err}"
        );
    }

    let out = f.kvpn_ok(&["connect", "--kubeconfig", &kubeconfig, "--replicas", "3"]);
    assert!(
        out.contains("Traffic manager replica kvpn-manager-"),
        "{out}"
    );
    f.wait_state("connected", Duration::from_secs(30));
    assert_eq!(deployment_replicas(&f), 3);
    let replicas = wait_ready_replicas(&f, 3, Duration::from_secs(60));
    let session = f.session();
    let cli_replica = session["manager_replica"]
        .as_str()
        .unwrap_or_else(|| panic!("status names no replica: {session:#}"))
        .to_owned();
    assert!(
        replicas.contains(&cli_replica),
        "{cli_replica} not among {replicas:?}"
    );
    assert!(
        session["manager_replica_reason"]
            .as_str()
            .is_some_and(|r| !r.is_empty()),
        "{session:#}"
    );
    let status_text = f.kvpn_ok(&["status"]);
    assert!(
        status_text.contains(&format!("manager replica {cli_replica}")),
        "{status_text}"
    );
    let cli_ip: Ipv4Addr = session["tunnel_ip"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no tunnel IP: {session:#}"));
    f.wait_http(web(), Instant::now(), Duration::from_secs(10));

    // 20 Lease calls at once, spread over the three replicas.
    let asks: Vec<(String, String)> = (0..CLIENTS)
        .map(|i| {
            (
                format!("scale-{i:02}-{lab_id}"),
                replicas[i % replicas.len()].clone(),
            )
        })
        .collect();
    let t_lease = Instant::now();
    let leased = lease_all(&f, &asks);
    let lease_wall = t_lease.elapsed();
    let ips: BTreeSet<Ipv4Addr> = leased.values().map(|(ip, _)| *ip).collect();
    assert_eq!(ips.len(), CLIENTS, "no tunnel IP twice: {leased:#?}");
    assert!(
        !ips.contains(&cli_ip),
        "none is the CLI's {cli_ip}: {ips:?}"
    );
    let objects = lease_objects(&f);
    assert_eq!(
        objects.len(),
        CLIENTS + 1,
        "one object per lease: {objects:#?}"
    );
    for ip in ips.iter().chain([&cli_ip]) {
        let (_, record) = objects
            .get(&object_name(*ip))
            .unwrap_or_else(|| panic!("no object for {ip}: {objects:#?}"));
        let rec: serde_json::Value =
            serde_json::from_str(record).unwrap_or_else(|e| panic!("{ip}: {e}: {record}"));
        assert_eq!(rec["ip"], ip.to_string());
    }
    let holders: BTreeSet<&str> = objects.values().filter_map(|(h, _)| h.as_deref()).collect();
    assert!(
        holders.len() >= 2 && holders.iter().all(|h| replicas.iter().any(|r| r == h)),
        "written by several replicas, named as holders: {holders:?} of {replicas:?}"
    );
    let cms: Api<ConfigMap> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    let cm = f
        .block_on(cms.get("kvpn-manager"))
        .unwrap_or_else(|e| panic!("get ConfigMap kvpn-manager: {e}"));
    assert!(
        cm.data
            .as_ref()
            .is_none_or(|d| !d.contains_key("leases.json")),
        "no leases in the ConfigMap any more: {:?}",
        cm.data
    );

    // Garbage in one client's object: skipped, its IP not handed out, nothing
    // else lost.
    let (victim_id, (victim_ip, _)) = leased
        .iter()
        .nth(5)
        .map(|(k, v)| (k.clone(), v.clone()))
        .unwrap_or_else(|| panic!("20 leases"));
    let leases_api: Api<Lease> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    let garbage =
        serde_json::json!({"metadata": {"annotations": {RECORD: "{\"client_id\": 42, garbage"}}});
    f.block_on(leases_api.patch(
        &object_name(victim_ip),
        &PatchParams::default(),
        &Patch::Merge(&garbage),
    ))
    .unwrap_or_else(|e| panic!("edit the lease object of {victim_ip}: {e}"));
    let mut again: Vec<(String, String)> = asks
        .iter()
        .filter(|(id, _)| *id != victim_id)
        .enumerate()
        .map(|(i, (id, _))| (id.clone(), replicas[(i + 1) % replicas.len()].clone()))
        .collect();
    let newcomers: Vec<String> = (0..3).map(|i| format!("scale-new-{i}-{lab_id}")).collect();
    again.extend(
        newcomers
            .iter()
            .enumerate()
            .map(|(i, id)| (id.clone(), replicas[i].clone())),
    );
    let second = lease_all(&f, &again);
    for (id, (ip, token)) in &leased {
        if *id == victim_id {
            continue;
        }
        assert_eq!(
            second.get(id),
            Some(&(*ip, token.clone())),
            "{id} keeps its IP and token on another replica after the garbage edit"
        );
    }
    let new_ips: BTreeSet<Ipv4Addr> = newcomers
        .iter()
        .map(|id| {
            second
                .get(id)
                .map(|(ip, _)| *ip)
                .unwrap_or_else(|| panic!("{id}"))
        })
        .collect();
    assert_eq!(new_ips.len(), 3);
    assert!(
        !new_ips.contains(&victim_ip) && new_ips.is_disjoint(&ips) && !new_ips.contains(&cli_ip),
        "newcomers {new_ips:?} avoid the garbage IP {victim_ip}, the 20 and the CLI's"
    );
    let after = lease_objects(&f);
    assert_eq!(after.len(), CLIENTS + 1 + 3, "{after:#?}");
    assert!(
        after
            .get(&object_name(victim_ip))
            .is_some_and(|(_, r)| r.contains("garbage")),
        "the garbage object is left for a human: {after:#?}"
    );
    let logs = manager_logs(&f);
    assert!(
        logs.contains("lease object unreadable") && logs.contains(&object_name(victim_ip)),
        "a manager says which object and the fix:\n{logs}"
    );

    // Leases of an older manager in the ConfigMap move into objects when a replica
    // starts; the CLI session's replica goes away meanwhile.
    let old_ip: Ipv4Addr = "100.96.200.9".parse().unwrap_or_else(|e| panic!("{e}"));
    let old_token = "ab".repeat(32);
    let now_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let old = serde_json::json!([{
        "client_id": format!("scale-old-{lab_id}"),
        "ip": old_ip.to_string(),
        "token": old_token,
        "expires_at": now_s + 3600,
    }]);
    let patch = serde_json::json!({"data": {"leases.json": old.to_string()}});
    f.block_on(cms.patch(
        "kvpn-manager",
        &PatchParams::default(),
        &Patch::Merge(&patch),
    ))
    .unwrap_or_else(|e| panic!("write the old leases.json: {e}"));
    let pods: Api<Pod> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    let t_delete = Instant::now();
    f.block_on(pods.delete(&cli_replica, &Default::default()))
        .unwrap_or_else(|e| panic!("delete pod {cli_replica}: {e}"));
    // Once the pod is gone (its process ended, its data channel with it),
    // traffic goes through another replica with the same tunnel IP.
    while f.manager_pods().iter().any(|p| pod_name(p) == cli_replica) {
        assert!(
            t_delete.elapsed() < Duration::from_secs(40),
            "pod {cli_replica} still there 40 s after its deletion"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let gone = t_delete.elapsed();
    f.wait_http(web(), Instant::now(), Duration::from_secs(30));
    let resumed = t_delete.elapsed();
    assert_eq!(
        f.session()["tunnel_ip"],
        cli_ip.to_string(),
        "same tunnel IP"
    );
    let replacement = wait_ready_replicas(&f, 3, Duration::from_secs(60));
    assert!(!replacement.contains(&cli_replica), "{replacement:?}");
    let t_mig = Instant::now();
    let migrated = loop {
        let objects = lease_objects(&f);
        if let Some((_, rec)) = objects.get(&object_name(old_ip)) {
            break rec.clone();
        }
        assert!(
            t_mig.elapsed() < Duration::from_secs(20),
            "the old ConfigMap lease was not migrated: {objects:#?}\n{}",
            manager_logs(&f)
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(migrated.contains(&old_token), "{migrated}");
    let cm = f
        .block_on(cms.get("kvpn-manager"))
        .unwrap_or_else(|e| panic!("get ConfigMap kvpn-manager: {e}"));
    assert!(
        cm.data
            .as_ref()
            .is_none_or(|d| !d.contains_key("leases.json")),
        "key removed after the migration: {:?}",
        cm.data
    );
    let back = lease_all(
        &f,
        &[(format!("scale-old-{lab_id}"), replacement[0].clone())],
    );
    assert_eq!(
        back.values().next(),
        Some(&(old_ip, old_token.clone())),
        "the migrated client gets its IP and token"
    );
    assert!(
        lease_objects(&f).contains_key(&object_name(cli_ip)),
        "the CLI session's lease outlived its replica"
    );

    // Someone else scales; a plain connect does not fight them.
    f.kvpn_ok(&["disconnect", "--all"]);
    let deployments: Api<Deployment> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    f.block_on(deployments.patch(
        "kvpn-manager",
        &PatchParams::default(),
        &Patch::Merge(&serde_json::json!({"spec": {"replicas": 2}})),
    ))
    .unwrap_or_else(|e| panic!("scale to 2: {e}"));
    let out = f.kvpn_ok(&["connect", "--kubeconfig", &kubeconfig]);
    f.wait_state("connected", Duration::from_secs(30));
    assert_eq!(deployment_replicas(&f), 2, "kept: {out}");
    assert_eq!(
        f.session()["tunnel_ip"],
        cli_ip.to_string(),
        "same client id, same IP"
    );
    // Uninstall takes the lease objects with it (the other clients' live leases
    // need --force).
    f.kvpn_ok(&["disconnect", "--all"]);
    f.kvpn_ok(&["uninstall", "--kubeconfig", &kubeconfig, "--force"]);
    let left = lease_objects(&f);
    assert!(
        left.is_empty(),
        "lease objects left after uninstall: {left:#?}"
    );
    eprintln!(
        "scale: {CLIENTS} concurrent leases over 3 replicas in {:.2} s; replica {cli_replica} gone \
         {:.1} s after its deletion, traffic back at {:.1} s; whole test {:.0} s",
        lease_wall.as_secs_f64(),
        gone.as_secs_f64(),
        resumed.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
}

/// T3: someone scales the traffic manager Deployment to 0 under a connected
/// session. `kvpn status` and `kvpn connect` name that cause and the fix
/// (`kubectl scale … --replicas=1`) first, not the TLS handshake the root daemon
/// saw end; a new `kvpn connect` scales it back to 1 and connects.
#[test]
fn a_manager_scaled_to_zero_is_named_with_the_fix_and_connect_scales_it_back() {
    let f = KubeFixture::new();
    let kubeconfig = f.user_kubeconfig();
    f.kvpn_ok(&["connect", "--kubeconfig", &kubeconfig]);
    f.wait_state("connected", Duration::from_secs(30));
    let deployments: Api<Deployment> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    f.block_on(deployments.patch(
        "kvpn-manager",
        &PatchParams::default(),
        &Patch::Merge(&serde_json::json!({"spec": {"replicas": 0}})),
    ))
    .unwrap_or_else(|e| panic!("scale to 0: {e}"));
    let cause = format!(
        "no ready traffic manager pod in {MANAGER_NAMESPACE}: Deployment kvpn-manager is scaled \
         to 0 replicas"
    );
    let fix =
        format!("`kubectl scale -n {MANAGER_NAMESPACE} deployment/kvpn-manager --replicas=1`");
    // The session goes down and re-dials; its reason names the cause first.
    let t0 = Instant::now();
    let reason = loop {
        let s = f.session();
        let reason = s["reason"].as_str().unwrap_or_default().to_owned();
        if s["state"] != "connected" && reason.starts_with(&cause) {
            break reason;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "status does not name the Deployment scaled to 0 first: {s:#}\n{}",
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    assert!(reason.contains(&fix), "status names no fix: {reason}");
    let table = f.kvpn_ok(&["status"]);
    assert!(table.contains("scaled to 0 replicas"), "{table}");
    // `kvpn connect` of the same cluster: not connected, with the same cause.
    let out = f.kvpn(&["connect", "--kubeconfig", &kubeconfig]);
    let said = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(
        !out.status.success() && said.contains(&cause) && said.contains(&fix),
        "connect of the degraded session does not name the cause and fix: {said}"
    );
    // A new connect (no session of the cluster) scales it back to 1.
    f.kvpn_ok(&["disconnect", "--all"]);
    let out = f.kvpn_ok(&["connect", "--kubeconfig", &kubeconfig]);
    assert!(
        out.contains("is scaled to 0 replicas: scaling it back to 1"),
        "connect did not say it scaled the manager back: {out}"
    );
    assert_eq!(deployment_replicas(&f), 1);
    f.wait_state("connected", Duration::from_secs(30));
}
