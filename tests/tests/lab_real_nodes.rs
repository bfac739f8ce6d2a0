//! End-to-end, `kvpn lab up --real-nodes` (docs/lab-real-node.md): the persistent
//! lab on real node software, run by `kvpn-lab-agent` after `kvpn lab up` returned.
//! `kvpn lab exec laptop -- kubectl get nodes` shows two Ready nodes with containerd;
//! `kvpn lab exec <pod>` runs in a real pod's netns (the lab server answers on its
//! loopback with the pod's name); `kvpn lab exec n1` in a node's netns (its CNI
//! bridge); the cluster DNS answers from a node. Then the agent is killed with
//! SIGKILL, as a crash would, and `kvpn lab down` must still leave nothing: no
//! process naming the lab, no netns, mount, cgroup or link of it, the kubelet's
//! global sysctls as before.
//!
//! The lab's persistent state goes to a folder of this test (`KVPN_LAB_STATE_DIR`).
//! Needs root, the Kubernetes binaries, Debian's containerd, runc, CNI plugins, and
//! the images of `cargo xtask image` (`KVPN_IMAGE_DIR`).

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use kvpn_lab::k8s::node;
use kvpn_tests::lab_cli::LabRun;
use kvpn_tests::text;

/// The value after `key` in `text` up to the next space, comma or parenthesis.
fn after<'a>(text: &'a str, key: &str) -> &'a str {
    text.split(key)
        .nth(1)
        .and_then(|rest| rest.split([' ', ',', ')', '\n']).next())
        .unwrap_or_else(|| panic!("no {key:?} in:\n{text}"))
}

#[test]
fn lab_up_real_nodes_exec_into_nodes_and_pods_and_down_after_a_killed_agent_leaves_nothing() {
    let sysctls_before =
        node::settled_global_sysctls().unwrap_or_else(|e| panic!("global sysctls: {e}"));
    let lab = LabRun::new("labreal", 240);
    let t_up = Instant::now();
    let up = lab.ok(&["lab", "up", "--real-nodes"]);
    let lab_up = t_up.elapsed();
    let id = after(&up, "(id ").to_owned();
    let lab_dir = PathBuf::from(after(&up, "folder "));
    let agent: i32 = after(&up, "kvpn-lab-agent (pid ")
        .parse()
        .unwrap_or_else(|e| panic!("agent pid: {e}\n{up}"));
    assert!(
        up.contains(&format!("kvpn-{id}-n1, kvpn-{id}-n2")),
        "two real nodes named: {up}"
    );

    // Two Ready nodes on containerd, the DNS pod and the samples running.
    let nodes = lab.ok(&[
        "lab",
        "exec",
        "laptop",
        "--",
        "kubectl",
        "get",
        "nodes",
        "-o",
        "jsonpath={range .items[*]}{.metadata.name} {.status.nodeInfo.containerRuntimeVersion} {.status.conditions[?(@.type==\"Ready\")].status}{\"\\n\"}{end}",
    ]);
    let lines: Vec<&str> = nodes.lines().collect();
    assert_eq!(lines.len(), 2, "{nodes}");
    for l in &lines {
        assert!(
            l.contains(" containerd://1.6.") && l.ends_with(" True"),
            "not a Ready containerd node: {l}"
        );
    }
    let web = lab.ok(&[
        "lab",
        "exec",
        "laptop",
        "--",
        "kubectl",
        "get",
        "pods",
        "-l",
        "app=web",
        "-o",
        "jsonpath={.items[0].metadata.name}",
    ]);
    let web = web.trim();
    assert!(web.starts_with("web-"), "{web}");

    // `lab exec <pod>`: the pod's netns, where the lab server listens.
    let page = lab.ok(&[
        "lab",
        "exec",
        web,
        "--",
        "curl",
        "-sS",
        "--max-time",
        "5",
        "http://127.0.0.1:8080/",
    ]);
    assert!(page.contains(&format!("pod: {web}")), "{page}");
    // `lab exec n1`: the node's netns, with its CNI bridge; the cluster DNS answers
    // there through kube-proxy's rules.
    let links = lab.ok(&["lab", "exec", "n1", "--", "ip", "-br", "link"]);
    assert!(links.contains(&format!("kv{id}cni")), "{links}");
    let dns = lab.ok(&[
        "lab",
        "exec",
        "n1",
        "--",
        "dig",
        "+short",
        "+time=2",
        "@10.96.0.10",
        "web.default.svc.cluster.local",
    ]);
    assert_eq!(dns.trim(), "10.96.0.100", "{dns}");
    let missing = lab.kvpn(&["lab", "exec", "kvpn-no-such-pod", "--", "true"]);
    assert!(!missing.status.success());
    assert!(
        text(&missing.stderr).contains("unknown role"),
        "{}",
        text(&missing.stderr)
    );

    // A crashed agent: its nodes stay behind until `kvpn lab down` takes them.
    // SAFETY: kill(2) on the agent's pid, read from `kvpn lab up`'s output just now.
    unsafe {
        libc::kill(agent, libc::SIGKILL);
    }
    let t_down = Instant::now();
    let down = lab.ok(&["lab", "down"]);
    let lab_down = t_down.elapsed();
    assert!(down.contains("Lab is down"), "{down}");
    let left = node::leftovers(&id, &lab_dir.join("nodes"), 2);
    assert!(left.is_empty(), "left behind: {left:#?}");
    let netns = kvpn_lab::lab_netns(&id).unwrap_or_else(|e| panic!("list netns: {e}"));
    assert!(netns.is_empty(), "netns left behind: {netns:?}");
    // No process names the lab (control plane, nodes, the agent); a killed one may
    // stay a zombie for a moment.
    let t_gone = Instant::now();
    loop {
        let procs: Vec<String> = std::fs::read_dir("/proc")
            .map(|d| {
                d.flatten()
                    .filter_map(|e| {
                        let pid = e.file_name().to_str()?.parse::<u32>().ok()?;
                        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
                        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
                        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
                        let zombie = stat.split_whitespace().nth(2) == Some("Z");
                        (!zombie && cmd.contains(&lab_dir.to_string_lossy().into_owned()))
                            .then(|| format!("{pid}: {cmd}"))
                    })
                    .collect()
            })
            .unwrap_or_default();
        if procs.is_empty() {
            break;
        }
        assert!(
            t_gone.elapsed() < Duration::from_secs(10),
            "processes of the lab left: {procs:#?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!lab_dir.exists(), "lab folder {} left", lab_dir.display());
    let links = Command::new("ip")
        .args(["-o", "link"])
        .output()
        .unwrap_or_else(|e| panic!("ip link: {e}"));
    assert!(
        !text(&links.stdout).contains(&format!("kv{id}")),
        "links of the lab left:\n{}",
        text(&links.stdout)
    );
    assert_eq!(
        node::settled_global_sysctls().unwrap_or_else(|e| panic!("global sysctls: {e}")),
        sysctls_before,
        "kubelet sysctls not restored"
    );
    eprintln!(
        "kvpn lab up --real-nodes {:.1} s, kvpn lab down after a killed agent {:.1} s",
        lab_up.as_secs_f64(),
        lab_down.as_secs_f64()
    );
}
