//! `kvpn attach --via gateway` on real node software (issue #25 item 2): a lab
//! with two real nodes (kubelet 1.20.2, containerd + runc, the CNI bridge and
//! kube-proxy's iptables rules), the project's images and the lab's busybox.
//!
//! A Deployment with two replicas is attached through the manager's gateway:
//! the pod template gets one init container first (`kvpn-gateway`, NET_ADMIN
//! only, no other change: the app container is byte-for-byte the same); the new
//! pods run it to completion (exit 0) and start the app. Each replica reaches a
//! listener on the laptop's tunnel IP, and the laptop sees ONE source for both:
//! the manager's tunnel address (100.96.0.1). The seed's checks: `kvpn attach
//! check sessions` (5 replicas, 0 own sessions, 1 source, scaled back to 2) and
//! `kvpn attach check leak` (nothing outside the tunnel, the very first datagram
//! through, the probe pod deleted). `kvpn detach` leaves the pod template
//! exactly as before the attach (JSON compared); a second detach and a check of
//! an unattached workload are refused naming the workload. Then the same checks
//! on a per-workload (sidecar) attachment: 5 sessions, 5 distinct tunnel IPs, 5
//! sources, each the replica's own; no leak, no window; detach restores the
//! template again.
//!
//! Needs root, the Kubernetes binaries, Debian's containerd, runc, CNI plugins,
//! umoci and busybox-static, and the images of `cargo xtask image` with the
//! gateway in the manager image (`KVPN_IMAGE_DIR`).

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, PostParams};
use kvpn_lab::LAPTOP;
use kvpn_lab::k8s::node::images;
use kvpn_tests::kube_lab::{KubeFixture, pod_ready};

/// The source every replica's traffic has at the laptop: the manager's own
/// tunnel address (the first host of the pool).
const GATEWAY_SOURCE: &str = "100.96.0.1";

/// A scratch folder removed on drop (the busybox archive is built there).
struct Scratch(std::path::PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn text(o: &std::process::Output) -> String {
    format!(
        "{}\nstdout: {}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The Deployment's pod template as JSON.
fn template(f: &KubeFixture, ns: &str, name: &str) -> serde_json::Value {
    let api: Api<Deployment> = Api::namespaced(f.admin(), ns);
    let d = f
        .block_on(api.get(name))
        .unwrap_or_else(|e| panic!("get deployment {ns}/{name}: {e}"));
    serde_json::to_value(d.spec.map(|s| s.template))
        .unwrap_or_else(|e| panic!("template JSON: {e}"))
}

fn has_gateway(p: &Pod) -> bool {
    p.spec.as_ref().is_some_and(|s| {
        s.init_containers
            .as_ref()
            .is_some_and(|l| l.iter().any(|c| c.name == "kvpn-gateway"))
    })
}

/// Wait until exactly `n` pods of `app=<name>` exist, all ready and satisfying `pred`.
fn wait_pods(
    f: &KubeFixture,
    ns: &str,
    name: &str,
    n: usize,
    what: &str,
    pred: impl Fn(&Pod) -> bool,
) -> Vec<Pod> {
    let t0 = Instant::now();
    loop {
        let pods = f.pods(ns, &format!("app={name}"));
        if pods.len() == n && pods.iter().all(|p| pred(p) && pod_ready(p)) {
            return pods;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "not {n} ready pods {what} within 120 s: {:#?}\n{}",
            pods.iter()
                .map(|p| (p.metadata.name.clone(), p.status.clone()))
                .collect::<Vec<_>>(),
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn attach_via_gateway_gives_every_replica_one_translated_source_the_checks_show_it_and_detach_restores_the_template()
 {
    let t0 = Instant::now();
    let scratch =
        Scratch(std::env::temp_dir().join(format!("kvpn-attach-gw-test-{}", std::process::id())));
    std::fs::create_dir_all(&scratch.0).expect("scratch dir");
    let busybox = images::busybox_archive(&scratch.0).expect("build the busybox image");
    let f = KubeFixture::real_nodes_with_images(2, vec![busybox]);
    let lab_up = t0.elapsed();
    let lab_id = f.lab().netns_lab().id().to_owned();
    let user = f.user_kubeconfig();
    let admin = f
        .lab()
        .laptop_admin_kubeconfig()
        .to_string_lossy()
        .into_owned();
    let kubectl = kvpn_lab::k8s::kubectl_path().to_string_lossy().into_owned();

    f.kvpn_ok(&["connect", "--kubeconfig", &user]);
    f.wait_state("connected", Duration::from_secs(30));
    let laptop_ip: Ipv4Addr = f.session()["tunnel_ip"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no tunnel IP: {:#}", f.session()));

    let ns = format!("kvpn-agw-{lab_id}");
    let name = "kvpn-agw-app";
    let namespaces: Api<Namespace> = Api::all(f.admin());
    let ns_obj: Namespace = serde_json::from_value(serde_json::json!({
        "metadata": {"name": ns}
    }))
    .expect("namespace");
    f.block_on(namespaces.create(&PostParams::default(), &ns_obj))
        .unwrap_or_else(|e| panic!("create namespace {ns}: {e}"));
    let deploy: Deployment = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{
                        "name": "app",
                        "image": images::BUSYBOX_IMAGE,
                        "imagePullPolicy": "IfNotPresent",
                        "command": ["sh", "-c", "exec sleep 3600"],
                    }],
                },
            },
        },
    }))
    .expect("deployment");
    let deployments: Api<Deployment> = Api::namespaced(f.admin(), &ns);
    f.block_on(deployments.create(&PostParams::default(), &deploy))
        .unwrap_or_else(|e| panic!("create deployment: {e}"));
    wait_pods(&f, &ns, name, 2, "before attach", |p| !has_gateway(p));
    let before = template(&f, &ns, name);

    // Attach through the gateway.
    let t_attach = Instant::now();
    let out = f.kvpn_ok(&[
        "attach",
        "--via",
        "gateway",
        &format!("deploy/{name}"),
        "-n",
        &ns,
        "--kubeconfig",
        &admin,
    ]);
    assert!(
        out.contains("gateway") && out.contains("kvpn-gateway"),
        "{out}"
    );
    let attached = template(&f, &ns, name);
    let init = attached["spec"]["initContainers"]
        .as_array()
        .unwrap_or_else(|| panic!("no initContainers: {attached:#}"));
    assert_eq!(init.len(), 1, "{attached:#}");
    assert_eq!(init[0]["name"], "kvpn-gateway");
    assert_eq!(init[0]["args"][0], "gateway-route");
    let sc = &init[0]["securityContext"];
    assert_eq!(sc["capabilities"]["add"], serde_json::json!(["NET_ADMIN"]));
    assert_eq!(sc["capabilities"]["drop"], serde_json::json!(["ALL"]));
    assert_eq!(sc["privileged"], false);
    assert_eq!(
        attached["spec"]["containers"], before["spec"]["containers"],
        "the app container is untouched"
    );
    assert!(
        attached["spec"].get("volumes").is_none(),
        "no volume in gateway mode"
    );
    // Attached twice: refused, nothing changes.
    let o = f.kvpn(&[
        "attach",
        "--via",
        "gateway",
        &format!("deploy/{name}"),
        "-n",
        &ns,
        "--kubeconfig",
        &admin,
    ]);
    assert!(!o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        err.contains("already attached")
            && err.contains("kvpn-gateway")
            && err.contains("kvpn detach"),
        "{err}"
    );
    assert_eq!(template(&f, &ns, name), attached);

    let pods = wait_pods(&f, &ns, name, 2, "with the gateway route", has_gateway);
    let pods_up = t_attach.elapsed();
    for p in &pods {
        let st = p
            .status
            .as_ref()
            .and_then(|s| s.init_container_statuses.clone())
            .unwrap_or_default();
        let gw = st
            .iter()
            .find(|s| s.name == "kvpn-gateway")
            .unwrap_or_else(|| panic!("no kvpn-gateway status: {st:#?}"));
        let code = gw
            .state
            .as_ref()
            .and_then(|s| s.terminated.as_ref())
            .map(|t| t.exit_code);
        assert_eq!(code, Some(0), "the init container exited 0: {gw:#?}");
    }

    // Each replica → the laptop's tunnel IP; the laptop sees one source.
    let mut listener = Command::new("socat");
    listener.args([
        &format!("TCP-LISTEN:9090,bind={laptop_ip},reuseaddr,fork"),
        "SYSTEM:echo kvpn-laptop-saw-$SOCAT_PEERADDR",
    ]);
    let listener_pid = f
        .lab()
        .netns_lab()
        .spawn_in(LAPTOP, "kvpn-agw-listener", &listener)
        .unwrap_or_else(|e| panic!("laptop listener: {e}"));
    let mut sources = BTreeSet::new();
    let mut first_answer = None;
    for p in &pods {
        let pod_name = p.metadata.name.clone().unwrap_or_default();
        let mut answer = String::new();
        let t = Instant::now();
        for _ in 0..20 {
            let o = f.laptop(&[
                &kubectl,
                "--kubeconfig",
                &admin,
                "-n",
                &ns,
                "exec",
                &pod_name,
                "-c",
                "app",
                "--",
                "sh",
                "-c",
                &format!("echo | nc -w 3 {laptop_ip} 9090"),
            ]);
            answer = String::from_utf8_lossy(&o.stdout).trim().to_owned();
            if answer.contains("kvpn-laptop-saw") {
                break;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        first_answer.get_or_insert(t.elapsed());
        let Some(src) = answer.strip_prefix("kvpn-laptop-saw-").map(str::to_owned) else {
            let pod_state = f.laptop(&[
                &kubectl,
                "--kubeconfig",
                &admin,
                "-n",
                &ns,
                "exec",
                &pod_name,
                "-c",
                "app",
                "--",
                "sh",
                "-c",
                "ip -d link; ip addr; ip route; ip neigh",
            ]);
            let manager_log = f.laptop(&[
                &kubectl,
                "--kubeconfig",
                &admin,
                "-n",
                kvpn_tests::kube_lab::MANAGER_NAMESPACE,
                "logs",
                "deploy/kvpn-manager",
                "--tail",
                "60",
            ]);
            let init_log = f.laptop(&[
                &kubectl,
                "--kubeconfig",
                &admin,
                "-n",
                &ns,
                "logs",
                &pod_name,
                "-c",
                "kvpn-gateway",
            ]);
            let laptop_state =
                f.laptop(&["sh", "-c", "ip addr; ip route; ip rule; cat /proc/net/dev"]);
            let pod_dev = f.laptop(&[
                &kubectl,
                "--kubeconfig",
                &admin,
                "-n",
                &ns,
                "exec",
                &pod_name,
                "-c",
                "app",
                "--",
                "cat",
                "/proc/net/dev",
            ]);
            let script = format!(
                "for n in $(ip netns list | awk '{{print $1}}' | grep -- '-{lab_id}-\\|kvpn-{lab_id}'); do echo \"== $n\"; ip netns exec $n sh -c 'grep 10805 /proc/net/nf_conntrack; iptables-save -t nat | grep -i gateway | head -8; ip route | head -8'; done; for p in $(pgrep -x kvpn-manager); do if tr '\\0' ' ' < /proc/$p/cmdline | grep -q gateway-listen; then echo \"== manager $p\"; nsenter -t $p -n sh -c 'cat /proc/net/udp; grep Udp: /proc/net/snmp; ip addr | grep inet; ip route'; fi; done"
            );
            let nodes = Command::new("sh").args(["-c", &script]).output();
            eprintln!(
                "pod /proc/net/dev: {}\nnodes: {}",
                text(&pod_dev),
                nodes.map(|o| text(&o)).unwrap_or_default()
            );
            panic!(
                "replica {pod_name} → laptop {laptop_ip}:9090 got {answer:?}\npod: {}\ninit: {}\nmanager: {}\nlaptop: {}\n{}",
                text(&pod_state),
                text(&init_log),
                text(&manager_log),
                text(&laptop_state),
                f.diagnostics()
            )
        };
        sources.insert(src);
    }
    let _ = f
        .lab()
        .netns_lab()
        .stop_process(listener_pid, Duration::from_secs(2));
    assert_eq!(
        sources,
        BTreeSet::from([GATEWAY_SOURCE.to_owned()]),
        "two replicas, one translated source (the manager's tunnel address)"
    );

    // The seed's checks through the gateway.
    let check = |what: &str| -> serde_json::Value {
        let t = Instant::now();
        let out = f.kvpn_ok(&[
            "attach",
            "check",
            what,
            &format!("deploy/{name}"),
            "-n",
            &ns,
            "-o",
            "json",
            "--kubeconfig",
            &admin,
        ]);
        eprintln!(
            "check {what} took {:.1} s: {out}",
            t.elapsed().as_secs_f64()
        );
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("check {what} JSON: {e}: {out}"))
    };
    let gw_sessions = check("sessions");
    assert_eq!(gw_sessions["via"], "gateway", "{gw_sessions:#}");
    assert_eq!(gw_sessions["replicas"], 5, "{gw_sessions:#}");
    assert_eq!(
        gw_sessions["sessions"], 0,
        "no per-replica session: {gw_sessions:#}"
    );
    assert_eq!(gw_sessions["distinct_sources"], 1, "{gw_sessions:#}");
    for row in gw_sessions["rows"].as_array().expect("rows") {
        assert_eq!(row["source_seen"], GATEWAY_SOURCE, "{gw_sessions:#}");
    }
    assert_eq!(gw_sessions["scaled_back_to"], 2);
    wait_pods(
        &f,
        &ns,
        name,
        2,
        "scaled back after the sessions check",
        has_gateway,
    );
    let gw_leak = check("leak");
    assert_eq!(gw_leak["via"], "gateway");
    assert_eq!(
        gw_leak["outside_tunnel"], 0,
        "nothing outside the tunnel: {gw_leak:#}"
    );
    assert!(
        gw_leak["through_tunnel"].as_u64().unwrap_or(0) > 0,
        "the probe came through: {gw_leak:#}"
    );
    assert_eq!(
        gw_leak["first_through_seq"], 0,
        "the init container routes before the app starts, so even the first datagram comes through: {gw_leak:#}"
    );
    assert_eq!(
        gw_leak["sources"],
        serde_json::json!([GATEWAY_SOURCE]),
        "{gw_leak:#}"
    );
    let probe_pods = f.pods(&ns, "kvpn.dev/check=leak");
    assert!(
        probe_pods
            .iter()
            .all(|p| p.metadata.deletion_timestamp.is_some()),
        "the probe pod is deleted: {probe_pods:#?}"
    );

    // Detach: the template is byte-for-byte as before; pods without the init container.
    let out = f.kvpn_ok(&[
        "detach",
        &format!("deploy/{name}"),
        "-n",
        &ns,
        "--kubeconfig",
        &admin,
    ]);
    assert!(out.contains("Detached"), "{out}");
    let after = template(&f, &ns, name);
    assert_eq!(
        serde_json::to_string(&after).expect("json"),
        serde_json::to_string(&before).expect("json"),
        "pod template after detach differs from before attach"
    );
    wait_pods(&f, &ns, name, 2, "after detach", |p| !has_gateway(p));
    let o = f.kvpn(&[
        "detach",
        &format!("deploy/{name}"),
        "-n",
        &ns,
        "--kubeconfig",
        &admin,
    ]);
    assert!(!o.status.success(), "second detach: {}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("is not attached"),
        "{}",
        text(&o)
    );
    // A check of a workload that is not attached: refused, naming the fix.
    let o = f.kvpn(&[
        "attach",
        "check",
        "leak",
        &format!("deploy/{name}"),
        "-n",
        &ns,
        "--kubeconfig",
        &admin,
    ]);
    assert!(!o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        err.contains("is not attached") && err.contains("kvpn attach"),
        "{err}"
    );

    // The same checks on a per-workload attachment (sidecar), for comparison.
    f.kvpn_ok(&[
        "attach",
        &format!("deploy/{name}"),
        "-n",
        &ns,
        "--kubeconfig",
        &admin,
    ]);
    let has_tunnel = |p: &Pod| {
        p.spec
            .as_ref()
            .is_some_and(|s| s.containers.iter().any(|c| c.name == "kvpn-tunnel"))
    };
    wait_pods(&f, &ns, name, 2, "with the tunnel sidecar", has_tunnel);
    let sc_sessions = check("sessions");
    assert_eq!(sc_sessions["via"], "sidecar", "{sc_sessions:#}");
    assert_eq!(sc_sessions["replicas"], 5, "{sc_sessions:#}");
    assert_eq!(sc_sessions["sessions"], 5, "{sc_sessions:#}");
    assert_eq!(sc_sessions["distinct_tunnel_ips"], 5, "{sc_sessions:#}");
    assert_eq!(sc_sessions["distinct_sources"], 5, "{sc_sessions:#}");
    for row in sc_sessions["rows"].as_array().expect("rows") {
        assert_eq!(
            row["source_seen"], row["tunnel_ip"],
            "the laptop sees each replica's own tunnel IP: {sc_sessions:#}"
        );
    }
    wait_pods(&f, &ns, name, 2, "scaled back (sidecar)", has_tunnel);
    let sc_leak = check("leak");
    assert_eq!(sc_leak["via"], "sidecar");
    assert_eq!(sc_leak["outside_tunnel"], 0, "{sc_leak:#}");
    assert_eq!(
        sc_leak["first_through_seq"], 0,
        "ordered start: the first datagram comes through: {sc_leak:#}"
    );
    f.kvpn_ok(&[
        "detach",
        &format!("deploy/{name}"),
        "-n",
        &ns,
        "--kubeconfig",
        &admin,
    ]);
    assert_eq!(
        serde_json::to_string(&template(&f, &ns, name)).expect("json"),
        serde_json::to_string(&before).expect("json"),
        "pod template after the sidecar detach differs from before attach"
    );

    f.kvpn_ok(&["disconnect"]);
    drop(f);
    let netns = kvpn_lab::lab_netns(&lab_id).unwrap_or_else(|e| panic!("list netns: {e}"));
    assert!(netns.is_empty(), "netns left behind: {netns:?}");
    eprintln!(
        "attach --via gateway: lab up {:.1} s, attached pods ready {:.1} s after the attach, first replica → laptop answer {:.0} ms, sources seen {:?}, total {:.1} s",
        lab_up.as_secs_f64(),
        pods_up.as_secs_f64(),
        first_answer.unwrap_or_default().as_secs_f64() * 1000.0,
        sources,
        t0.elapsed().as_secs_f64()
    );
    eprintln!(
        "leak gateway: through {} outside {} first #{} at {} ms; sidecar: through {} outside {} first #{} at {} ms",
        gw_leak["through_tunnel"],
        gw_leak["outside_tunnel"],
        gw_leak["first_through_seq"],
        gw_leak["first_through_after_ms"],
        sc_leak["through_tunnel"],
        sc_leak["outside_tunnel"],
        sc_leak["first_through_seq"],
        sc_leak["first_through_after_ms"]
    );
}
