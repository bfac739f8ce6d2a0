//! `kvpn attach` / `kvpn detach` on real node software (issue #25 item 1): a lab
//! with two real nodes (kubelet 1.20.2, containerd + runc, the project's
//! images, and the lab's busybox for a workload with a shell).
//!
//! The laptop connects (port-forward, the restricted user); a Deployment in a
//! fresh namespace (busybox `httpd`) is attached with the admin kubeconfig (the
//! lab's `kvpn-user` may not patch workloads outside `kvpn-system`). The output
//! names the classic sidecar and why (v1.20 < 1.29); the new pod's first
//! container is the tunnel container, which runs as uid 0 with exactly
//! NET_ADMIN and MKNOD effective; `kvpn attach --list` shows the replica's own
//! tunnel IP; the laptop reaches the replica's httpd by that IP, and the replica
//! reaches a listener on the laptop's tunnel IP, which sees the replica's tunnel
//! IP as the source. Scaled to two replicas, each has its own tunnel IP (the
//! first keeps its lease) and the laptop reaches both. When the manager pod is
//! deleted, the kubelet restarts the replica's tunnel container, which comes back
//! with the same tunnel IP and is reached again. `kvpn detach` leaves the pod template exactly as it was
//! before the attach (JSON compared) and removes the Secret. Bad input: a
//! Deployment that does not exist, a detach of something never attached, a
//! second attach — each an error naming the object, the cause and the fix.
//!
//! Needs root, the Kubernetes binaries, Debian's containerd, runc, CNI plugins,
//! umoci and busybox-static, and the images of `cargo xtask image` with the
//! tunnel subcommand in the manager image (`KVPN_IMAGE_DIR`).

use std::net::Ipv4Addr;
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Pod, Secret};
use kube::api::{Api, PostParams};
use kvpn_lab::LAPTOP;
use kvpn_lab::k8s::node::images;
use kvpn_tests::kube_lab::{KubeFixture, pod_ready};

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

/// The pids whose cgroup names container `id`.
fn container_pids(id: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if std::fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|c| c.contains(id)) {
            pids.push(pid);
        }
    }
    pids
}

fn status_field(pid: u32, key: &str) -> String {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/status: {e}"));
    s.lines()
        .find_map(|l| l.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"))
        .trim()
        .to_owned()
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

/// Wait until every pod of `app=<name>` in `ns` is ready and satisfies `pred`, and
/// there is exactly one.
fn wait_single_pod(
    f: &KubeFixture,
    ns: &str,
    name: &str,
    what: &str,
    pred: impl Fn(&Pod) -> bool,
) -> Pod {
    let admin = f
        .lab()
        .laptop_admin_kubeconfig()
        .to_string_lossy()
        .into_owned();
    let t0 = Instant::now();
    loop {
        let pods = f.pods(ns, &format!("app={name}"));
        if pods.len() == 1 && pred(&pods[0]) && pod_ready(&pods[0]) {
            return pods.into_iter().next().unwrap_or_else(|| unreachable!());
        }
        assert!(
            t0.elapsed() < Duration::from_secs(90),
            "no single ready pod {what} within 90 s: {:#?}\ntunnel container logs:\n{}\n{}",
            pods.iter()
                .map(|p| (p.metadata.name.clone(), p.status.clone()))
                .collect::<Vec<_>>(),
            tunnel_logs(f, &admin, ns, name),
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The tunnel containers' logs (current and previous), for failure messages.
fn tunnel_logs(f: &KubeFixture, admin: &str, ns: &str, name: &str) -> String {
    let kubectl = kvpn_lab::k8s::kubectl_path().to_string_lossy().into_owned();
    let mut out = String::new();
    for prev in ["--previous=false", "--previous=true"] {
        let o = f.laptop(&[
            &kubectl,
            "--kubeconfig",
            admin,
            "-n",
            ns,
            "logs",
            "-l",
            &format!("app={name}"),
            "-c",
            "kvpn-tunnel",
            "--tail",
            "30",
            prev,
        ]);
        out.push_str(&text(&o));
    }
    out
}

fn has_tunnel(p: &Pod) -> bool {
    p.spec
        .as_ref()
        .is_some_and(|s| s.containers.iter().any(|c| c.name == "kvpn-tunnel"))
}

#[test]
fn attach_a_deployment_on_real_nodes_gives_its_replica_a_tunnel_both_ways_and_detach_restores_the_template()
 {
    let t0 = Instant::now();
    let scratch =
        Scratch(std::env::temp_dir().join(format!("kvpn-attach-test-{}", std::process::id())));
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

    f.kvpn_ok(&["connect", "--kubeconfig", &user]);
    f.wait_state("connected", Duration::from_secs(30));
    let laptop_ip: Ipv4Addr = f.session()["tunnel_ip"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no tunnel IP: {:#}", f.session()));

    // A workload with a shell in a fresh namespace.
    let ns = format!("kvpn-att-{lab_id}");
    let name = "kvpn-att-app";
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
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{
                        "name": "app",
                        "image": images::BUSYBOX_IMAGE,
                        "imagePullPolicy": "IfNotPresent",
                        "command": ["sh", "-c",
                            "mkdir -p /tmp/www && echo kvpn-replica-page > /tmp/www/index.html && exec httpd -f -p 8080 -h /tmp/www"],
                    }],
                },
            },
        },
    }))
    .expect("deployment");
    let deployments: Api<Deployment> = Api::namespaced(f.admin(), &ns);
    f.block_on(deployments.create(&PostParams::default(), &deploy))
        .unwrap_or_else(|e| panic!("create deployment: {e}"));
    let before_pod = wait_single_pod(&f, &ns, name, "before attach", |p| !has_tunnel(p));
    let before = template(&f, &ns, name);

    // Whether containerd gives a container without capabilities a /dev/net/tun
    // node (it decides whether the tunnel container needs MKNOD).
    let kubectl = kvpn_lab::k8s::kubectl_path().to_string_lossy().into_owned();
    let before_pod_name = before_pod.metadata.name.clone().unwrap_or_default();
    let o = f.laptop(&[
        &kubectl,
        "--kubeconfig",
        &admin,
        "-n",
        &ns,
        "exec",
        &before_pod_name,
        "-c",
        "app",
        "--",
        "ls",
        "-l",
        "/dev/net/tun",
        "/dev",
    ]);
    eprintln!("/dev/net/tun in a plain container: {}", text(&o));

    // Bad input first: nothing exists, nothing attached.
    let o = f.kvpn(&[
        "attach",
        "deploy/kvpn-att-nope",
        "-n",
        &ns,
        "--kubeconfig",
        &admin,
    ]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        err.contains("deployment/kvpn-att-nope")
            && err.contains("not found")
            && err.contains("kubectl get deployments"),
        "attach of a missing deployment: {err}"
    );
    let o = f.kvpn(&[
        "detach",
        &format!("deploy/{name}"),
        "-n",
        &ns,
        "--kubeconfig",
        &admin,
    ]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        err.contains("is not attached") && err.contains(name),
        "detach before attach: {err}"
    );
    assert_eq!(
        template(&f, &ns, name),
        before,
        "a refused detach changed nothing"
    );

    // Attach: classic sidecar on 1.20, and the output says so and why.
    let t_attach = Instant::now();
    let out = f.kvpn_ok(&[
        "attach",
        &format!("deploy/{name}"),
        "-n",
        &ns,
        "--kubeconfig",
        &admin,
    ]);
    let attach_took = t_attach.elapsed();
    assert!(
        out.contains("classic sidecar") && out.contains("v1.20") && out.contains("1.29"),
        "{out}"
    );
    let attached = template(&f, &ns, name);
    let containers = attached["spec"]["containers"]
        .as_array()
        .expect("containers");
    assert_eq!(
        containers[0]["name"], "kvpn-tunnel",
        "the tunnel container comes first: {attached:#}"
    );
    assert_eq!(containers[1]["name"], "app");
    assert_eq!(
        containers[1], before["spec"]["containers"][0],
        "the app container is untouched"
    );
    assert_eq!(
        containers[0]["lifecycle"]["postStart"]["exec"]["command"][1],
        "tunnel-wait"
    );
    let secrets: Api<Secret> = Api::namespaced(f.admin(), &ns);
    let secret_name = format!("kvpn-attach-deploy-{name}");
    assert!(
        f.block_on(secrets.get_opt(&secret_name))
            .expect("get secret")
            .is_some()
    );

    // Twice: refused, nothing changes.
    let o = f.kvpn(&[
        "attach",
        &format!("deploy/{name}"),
        "-n",
        &ns,
        "--kubeconfig",
        &admin,
    ]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        err.contains("already attached") && err.contains("kvpn detach"),
        "second attach: {err}"
    );
    assert_eq!(template(&f, &ns, name), attached);

    // The new replica runs the tunnel container first, ready.
    let t_pod = Instant::now();
    let pod = wait_single_pod(&f, &ns, name, "with the tunnel", has_tunnel);
    let pod_up = t_pod.elapsed();
    assert_ne!(pod.metadata.uid, before_pod.metadata.uid);
    let pod_name = pod.metadata.name.clone().unwrap_or_default();
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.clone())
        .unwrap_or_default();
    let tunnel_status = statuses
        .iter()
        .find(|s| s.name == "kvpn-tunnel")
        .unwrap_or_else(|| panic!("no tunnel container status: {statuses:#?}"));
    let container_id = tunnel_status
        .container_id
        .as_deref()
        .and_then(|c| c.strip_prefix("containerd://"))
        .unwrap_or_else(|| panic!("not a containerd container: {tunnel_status:#?}"));
    let pids = container_pids(container_id);
    let tunnel_pid = pids
        .iter()
        .copied()
        .find(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm"))
                .is_ok_and(|c| c.trim() == "kvpn-manager")
        })
        .unwrap_or_else(|| panic!("no tunnel process in container {container_id}: {pids:?}"));
    assert!(status_field(tunnel_pid, "Uid:").starts_with("0\t"));
    // NET_ADMIN (12) and MKNOD (27), nothing else.
    assert_eq!(status_field(tunnel_pid, "CapEff:"), "0000000008001000");
    assert_eq!(status_field(tunnel_pid, "NoNewPrivs:"), "1");

    // The replica's own tunnel IP, as `kvpn attach --list` shows it.
    let list = f.kvpn_ok(&[
        "attach",
        "--list",
        "-n",
        &ns,
        "-o",
        "json",
        "--kubeconfig",
        &admin,
    ]);
    let replicas: serde_json::Value =
        serde_json::from_str(&list).unwrap_or_else(|e| panic!("--list JSON: {e}: {list}"));
    let replica = replicas
        .as_array()
        .and_then(|r| r.iter().find(|x| x["pod"] == pod_name.as_str()))
        .unwrap_or_else(|| panic!("{pod_name} not listed: {list}"));
    let replica_ip: Ipv4Addr = replica["tunnel_ip"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no tunnel IP for {pod_name}: {list}"));
    assert_ne!(replica_ip, laptop_ip);
    assert_eq!(
        replica_ip.octets()[..2],
        laptop_ip.octets()[..2],
        "both in the tunnel pool"
    );

    // Laptop → replica, by the replica's tunnel IP.
    let t_first = Instant::now();
    let url = format!("http://{replica_ip}:8080/");
    let o = f.laptop(&["curl", "-sS", "--max-time", "5", &url]);
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("kvpn-replica-page"),
        "laptop → replica {url}: {}\n{}",
        text(&o),
        f.diagnostics()
    );
    let first_get = t_first.elapsed();

    // Replica → laptop, by the laptop's tunnel IP; the laptop sees the replica's.
    let mut listener = Command::new("socat");
    listener.args([
        &format!("TCP-LISTEN:9090,bind={laptop_ip},reuseaddr,fork"),
        "SYSTEM:echo kvpn-laptop-saw-$SOCAT_PEERADDR",
    ]);
    let listener_pid = f
        .lab()
        .netns_lab()
        .spawn_in(LAPTOP, "kvpn-att-listener", &listener)
        .unwrap_or_else(|e| panic!("laptop listener: {e}"));
    let mut answer = String::new();
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
        answer = String::from_utf8_lossy(&o.stdout).into_owned();
        if answer.contains("kvpn-laptop-saw") {
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    assert_eq!(
        answer.trim(),
        format!("kvpn-laptop-saw-{replica_ip}"),
        "replica → laptop {laptop_ip}:9090\n{}",
        f.diagnostics()
    );
    let _ = f
        .lab()
        .netns_lab()
        .stop_process(listener_pid, Duration::from_secs(2));

    // Two replicas: each its own lease and session, each reachable by its own IP.
    let scale = |n: i32| {
        let patch = serde_json::json!({"spec": {"replicas": n}});
        f.block_on(deployments.patch(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        ))
        .unwrap_or_else(|e| panic!("scale to {n}: {e}"));
    };
    scale(2);
    let t_scale = Instant::now();
    let listed = loop {
        let ready: Vec<Pod> = f
            .pods(&ns, &format!("app={name}"))
            .into_iter()
            .filter(|p| has_tunnel(p) && pod_ready(p))
            .collect();
        let list = f.kvpn_ok(&[
            "attach",
            "--list",
            "-n",
            &ns,
            "-o",
            "json",
            "--kubeconfig",
            &admin,
        ]);
        let v: serde_json::Value =
            serde_json::from_str(&list).unwrap_or_else(|e| panic!("--list JSON: {e}: {list}"));
        let ips: std::collections::BTreeSet<Ipv4Addr> = v
            .as_array()
            .map(|a| {
                a.iter()
                    .filter(|x| {
                        ready
                            .iter()
                            .any(|p| p.metadata.name.as_deref() == x["pod"].as_str())
                    })
                    .filter_map(|x| x["tunnel_ip"].as_str().and_then(|t| t.parse().ok()))
                    .collect()
            })
            .unwrap_or_default();
        if ready.len() == 2 && ips.len() == 2 {
            break ips;
        }
        assert!(
            t_scale.elapsed() < Duration::from_secs(90),
            "no 2 ready attached replicas with distinct tunnel IPs within 90 s: {list}\n{}",
            tunnel_logs(&f, &admin, &ns, name)
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    assert!(
        listed.contains(&replica_ip),
        "the first replica kept its lease: {listed:?}"
    );
    for ip in &listed {
        let url = format!("http://{ip}:8080/");
        let o = f.laptop(&["curl", "-sS", "--max-time", "5", &url]);
        assert!(
            o.status.success() && String::from_utf8_lossy(&o.stdout).contains("kvpn-replica-page"),
            "laptop → replica {url}: {}",
            text(&o)
        );
    }
    scale(1);
    let kept = wait_single_pod(&f, &ns, name, "after scaling back to 1", has_tunnel);
    let kept_name = kept.metadata.name.clone().unwrap_or_default();

    // The manager pod goes: the replica's data channel ends, the kubelet restarts
    // its tunnel container (postStart again), which gets the same lease from the
    // new manager pod; the laptop reaches the replica again.
    let kept_ip = |f: &KubeFixture| -> Option<Ipv4Addr> {
        let list = f.kvpn_ok(&[
            "attach",
            "--list",
            "-n",
            &ns,
            "-o",
            "json",
            "--kubeconfig",
            &admin,
        ]);
        let v: serde_json::Value = serde_json::from_str(&list).ok()?;
        v.as_array()?
            .iter()
            .find(|x| x["pod"] == kept_name.as_str())?["tunnel_ip"]
            .as_str()?
            .parse()
            .ok()
    };
    let ip_before = kept_ip(&f).unwrap_or_else(|| panic!("no tunnel IP for {kept_name}"));
    let managers: Api<Pod> = Api::namespaced(f.admin(), kvpn_tests::kube_lab::MANAGER_NAMESPACE);
    for m in f.manager_pods() {
        let m_name = m.metadata.name.clone().unwrap_or_default();
        f.block_on(managers.delete(&m_name, &kube::api::DeleteParams::default()))
            .unwrap_or_else(|e| panic!("delete manager pod {m_name}: {e}"));
    }
    let t_restart = Instant::now();
    let url = format!("http://{ip_before}:8080/");
    loop {
        let o = f.laptop(&["curl", "-sS", "--max-time", "3", &url]);
        let restarted = f
            .pods(&ns, &format!("app={name}"))
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some(kept_name.as_str()))
            .and_then(|p| p.status.as_ref()?.container_statuses.clone())
            .and_then(|c| c.into_iter().find(|c| c.name == "kvpn-tunnel"))
            .is_some_and(|c| c.restart_count >= 1);
        if restarted
            && o.status.success()
            && String::from_utf8_lossy(&o.stdout).contains("kvpn-replica-page")
        {
            break;
        }
        assert!(
            t_restart.elapsed() < Duration::from_secs(120),
            "replica {kept_name} not reachable at {url} within 120 s of the manager's restart (tunnel restarted: {restarted}): {}\n{}\n{}",
            text(&o),
            tunnel_logs(&f, &admin, &ns, name),
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let back_after = t_restart.elapsed();
    assert_eq!(
        kept_ip(&f),
        Some(ip_before),
        "same pod, same lease after the restart"
    );
    eprintln!(
        "manager pod deleted: replica {kept_name} reachable again at {ip_before} after {:.1} s",
        back_after.as_secs_f64()
    );

    // Detach: the template is exactly as before, the Secret gone, the pod without it.
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
    assert!(
        f.block_on(secrets.get_opt(&secret_name))
            .expect("get secret")
            .is_none(),
        "Secret left"
    );
    wait_single_pod(&f, &ns, name, "after detach", |p| !has_tunnel(p));
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

    f.kvpn_ok(&["disconnect"]);
    drop(f);
    let netns = kvpn_lab::lab_netns(&lab_id).unwrap_or_else(|e| panic!("list netns: {e}"));
    assert!(netns.is_empty(), "netns left behind: {netns:?}");
    eprintln!(
        "attach: lab up {:.1} s, attach {:.1} s, attached pod ready {:.1} s, first GET {:.0} ms, total {:.1} s",
        lab_up.as_secs_f64(),
        attach_took.as_secs_f64(),
        pod_up.as_secs_f64(),
        first_get.as_secs_f64() * 1000.0,
        t0.elapsed().as_secs_f64()
    );
}
