//! `kvpn run -- CMD` (issue 27) end to end on the Kubernetes lab: real
//! kube-apiservers, the traffic manager installed by kvpn, the root daemon's run
//! scope (own TUN device and routing table, cgroup v2 folder with eBPF cgroup
//! programs, fwmark rule, per-run DNS forwarder).
//!
//! - One cluster: curl inside the run reaches a pod by IP and the `web` Service by
//!   name; a process outside the run (same laptop netns, same time) reaches
//!   neither and the laptop's main table gains no route; nothing is left after.
//! - Exit status (125 for kvpn's own failures), signal forwarding, SIGKILL of
//!   kvpn, bad input.
//! - The run's DNS forwarder: --include/--exclude-suffix and --extra-domain hold
//!   inside the run (also after the route watch's update), the extra domain is
//!   resolved and routed inside the run only, status counts the run's own
//!   forwarder, and processes outside the run get no answer from it.
//! - A plain `kvpn disconnect` ends a connect session and leaves a run's.
//! - Two clusters with the same pod and service CIDRs (and the same pod IPs, with
//!   different pods behind them) from one laptop netns: two runs at once each
//!   reach their own cluster by IP and by name.
//!
//! Needs the workspace binaries (`cargo build --bins`, then `KVPN_BIN_DIR`) and the
//! Kubernetes binaries of `scripts/build-kubernetes.sh`.

use std::io::{BufRead as _, BufReader};
use std::net::{IpAddr, SocketAddr};
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kvpn_lab::k8s::K8sLab;
use kvpn_lab::protocol::PageInfo;
use kvpn_lab::{Addressing, HTTP_PORT};
use kvpn_tests::dns_lab::{
    CLUSTER_DNS, CORP_HOST, LAPTOP_RESOLV, Upstream, cluster_ip, parse_dig, write_laptop_resolv,
};
use kvpn_tests::kube_lab::{KubeFixture, pod_ip, pod_name};
use kvpn_tests::text;

/// Where the lab's machine mounts cgroup v2 (TOOLCHAIN.md: hybrid hierarchy).
fn cgroup_root() -> std::path::PathBuf {
    ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        .iter()
        .map(std::path::PathBuf::from)
        .find(|p| p.join("cgroup.controllers").exists())
        .unwrap_or_else(|| panic!("no cgroup v2 mount"))
}

/// A run session's cgroup folder as this process sees it (the root daemon may
/// see the hierarchy at another mount point: its own, under `ip netns exec`).
fn host_cgroup(session: &serde_json::Value) -> std::path::PathBuf {
    let path = std::path::PathBuf::from(session["run_cgroup"].as_str().unwrap_or_default());
    let name = path
        .file_name()
        .unwrap_or_else(|| panic!("no run cgroup in {session:#}"));
    cgroup_root().join(name)
}

/// `default/web` pods of `lab`, Running with an IP.
fn web_pods(f: &KubeFixture, lab: &K8sLab) -> Vec<Pod> {
    let client = f
        .block_on(lab.admin_client())
        .unwrap_or_else(|e| panic!("admin client: {e}"));
    let api: Api<Pod> = Api::namespaced(client, "default");
    let pods = f
        .block_on(api.list(&ListParams::default().labels("app=web")))
        .unwrap_or_else(|e| panic!("list web pods: {e}"))
        .items;
    assert!(
        !pods.is_empty(),
        "no web pods in {}",
        lab.state().cluster_name
    );
    pods
}

/// The pages in `stdout` (each starts with `kvpn-lab-server`).
fn pages(stdout: &str) -> Vec<PageInfo> {
    stdout
        .split("kvpn-lab-server\n")
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            PageInfo::parse(&format!("kvpn-lab-server\n{p}"))
                .unwrap_or_else(|| panic!("not a lab page: {p:?} in {stdout:?}"))
        })
        .collect()
}

/// What a run leaves to check afterwards: sessions, TUN devices, fwmark rules and
/// `kvpn-run-*` cgroups of `ids`.
fn assert_nothing_left(f: &KubeFixture, ids: &[String], when: &str) {
    let sessions = f.sessions();
    assert!(sessions.is_empty(), "{when}: sessions left: {sessions:#?}");
    let tuns = f.tun_devices();
    assert!(tuns.is_empty(), "{when}: TUN devices left: {tuns:?}");
    let rules = text(&f.laptop(&["ip", "rule", "show"]).stdout);
    assert!(
        !rules.contains("fwmark 0x6b76"),
        "{when}: run rules left:\n{rules}"
    );
    for id in ids {
        let cg = cgroup_root().join(format!("kvpn-run-{id}"));
        assert!(!cg.exists(), "{when}: cgroup {} left", cg.display());
    }
}

/// Polls until there is a run session (its id and cgroup), or panics.
fn wait_run_session(
    f: &KubeFixture,
    children: &mut [&mut Child],
    n: usize,
    within: Duration,
) -> Vec<serde_json::Value> {
    let t0 = Instant::now();
    loop {
        for c in children.iter_mut() {
            if let Ok(Some(status)) = c.try_wait() {
                let mut err = String::new();
                if let Some(e) = c.stderr.as_mut() {
                    let _ = std::io::Read::read_to_string(e, &mut err);
                }
                panic!(
                    "kvpn run ended ({status}) before its session showed:\n{err}\n{}",
                    f.diagnostics()
                );
            }
        }
        let runs: Vec<serde_json::Value> = f
            .sessions()
            .into_iter()
            .filter(|s| s["run_cgroup"].as_str().is_some_and(|c| !c.is_empty()))
            .collect();
        if runs.len() == n
            && runs.iter().all(|s| {
                std::fs::read_to_string(host_cgroup(s).join("cgroup.procs"))
                    .is_ok_and(|p| !p.trim().is_empty())
            })
        {
            return runs;
        }
        assert!(
            t0.elapsed() < within,
            "not {n} run sessions with processes within {within:?}: {runs:#?}\n{}",
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn spawn_run(f: &KubeFixture, kubeconfig: &str, script: &str) -> Child {
    spawn_run_with(f, kubeconfig, script, &[])
}

/// [`spawn_run`] with `env` set for kvpn (and the daemons it starts).
fn spawn_run_with(f: &KubeFixture, kubeconfig: &str, script: &str, env: &[(&str, &str)]) -> Child {
    f.kvpn_command(&["run", "--kubeconfig", kubeconfig, "--", "sh", "-c", script])
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn kvpn run: {e}"))
}

fn wait_output(child: Child, what: &str, f: &KubeFixture) -> Output {
    let out = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("wait for {what}: {e}"));
    eprintln!(
        "{what}: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr),
        f.diagnostics()
    );
    out
}

/// The curl script of a run: pod by IP, Service by name, pause (so that two runs
/// overlap and the test looks from outside meanwhile), pod by IP again.
fn curl_script(pod: IpAddr, pause_s: u32) -> String {
    let ip = format!("http://{pod}:{HTTP_PORT}/");
    format!(
        "curl -sS --max-time 10 {ip} && curl -sS --max-time 10 http://web.default/ && \
         sleep {pause_s} && curl -sS --max-time 10 {ip}"
    )
}

#[test]
fn a_run_reaches_its_cluster_by_ip_and_name_and_nothing_outside_it_does() {
    let f = KubeFixture::new();
    let kubeconfig = f.user_kubeconfig();
    // Strict reverse-path filtering on the laptop (this fixture's own netns): a
    // distribution default in places, and what dropped every reply of a run
    // before the TUN's ingress check marked them for the run's table (#27).
    // New devices start with conf/default's value: 2 (loose) is what systemd's
    // sysctl defaults set, and the run's TUN device must still end up with 0
    // (trial F1: the setup failed, "reads 2 after setting 0").
    f.laptop(&["sysctl", "-qw", "net.ipv4.conf.all.rp_filter=1"]);
    f.laptop(&["sysctl", "-qw", "net.ipv4.conf.default.rp_filter=2"]);
    let set = f.laptop(&[
        "sysctl",
        "-n",
        "net.ipv4.conf.all.rp_filter",
        "net.ipv4.conf.default.rp_filter",
    ]);
    assert_eq!(
        text(&set.stdout).split_whitespace().collect::<Vec<_>>(),
        ["1", "2"]
    );
    let pods = web_pods(&f, f.lab());
    let names: Vec<String> = pods.iter().map(pod_name).collect();
    let ip = pod_ip(&pods[0]);
    let main_table = || text(&f.laptop(&["ip", "route", "show", "table", "main"]).stdout);
    let main_before = main_table();

    let t0 = Instant::now();
    let mut child = spawn_run(&f, &kubeconfig, &curl_script(ip, 8));
    let runs = wait_run_session(&f, &mut [&mut child], 1, Duration::from_secs(90));
    let setup = t0.elapsed();
    let id = runs[0]["id"].as_str().unwrap_or_default().to_owned();
    // Meanwhile, outside the run: no route, no answer, main table unchanged.
    let outside = f.http_get(SocketAddr::from((ip, HTTP_PORT)), Duration::from_secs(2));
    assert!(
        outside.is_err(),
        "a process outside the run reached {ip}: {outside:?}"
    );
    let get = text(&f.laptop(&["ip", "route", "get", &ip.to_string()]).stdout);
    assert!(
        !get.contains("kvpn"),
        "outside the run {ip} routes into a TUN: {get}"
    );
    assert_eq!(main_table(), main_before, "the main table changed");
    // The run's table holds the cluster routes, through its own TUN device.
    let table = runs[0]["run_table"]
        .as_u64()
        .unwrap_or_else(|| panic!("no run_table: {:#}", runs[0]));
    let run_routes = text(
        &f.laptop(&["ip", "route", "show", "table", &table.to_string()])
            .stdout,
    );
    assert!(
        run_routes.contains("10.244."),
        "run table {table}: {run_routes}"
    );
    let resolv = std::fs::read_to_string(f.laptop_resolv_conf()).unwrap_or_default();
    assert!(
        !resolv.contains("127.0.0.153"),
        "resolv.conf changed: {resolv}"
    );
    let dns = f.laptop(&["getent", "hosts", "web.default.svc.cluster.local"]);
    assert!(
        !dns.status.success(),
        "a cluster name resolved outside the run: {}",
        text(&dns.stdout)
    );

    // `kvpn top` counts the run's traffic per session (its classifier on its TUN).
    let t_top = Instant::now();
    loop {
        let out = f.kvpn_ok(&["top", "--once", "-o", "json", "--interval", "0.2"]);
        let v: serde_json::Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("top JSON: {e}: {out}"));
        let counted = v["rows"].as_array().is_some_and(|rows| {
            rows.iter().any(|r| {
                r["session"] == id.as_str() && r["kind"] == "pod" && r["packets"].as_u64() > Some(0)
            })
        });
        if counted {
            break;
        }
        assert!(
            t_top.elapsed() < Duration::from_secs(5),
            "kvpn top shows no pod packets of run session {id}: {out}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = wait_output(child, "kvpn run curl", &f);
    let total = t0.elapsed();
    let got = pages(&text(&out.stdout));
    assert_eq!(got.len(), 3, "three pages expected: {got:?}");
    for p in &got {
        assert!(
            names.contains(&p.pod),
            "page from {} (not a web pod {names:?})",
            p.pod
        );
    }
    assert_eq!(got[0].pod_ip, ip, "the pod asked by IP answered");
    eprintln!(
        "run session {id} up with its process in {:.1} s; whole run {:.1} s",
        setup.as_secs_f64(),
        total.as_secs_f64()
    );
    assert_nothing_left(&f, &[id], "after the run");
}

#[test]
fn run_exit_status_signals_sigkill_and_bad_input() {
    let f = KubeFixture::new();
    let kubeconfig = f.user_kubeconfig();

    // Bad input first: nothing may be made. kvpn's own failures exit 125, not
    // a status a command could have given (#27 F21).
    let none = f.kvpn(&["run", "--kubeconfig", &kubeconfig]);
    assert_eq!(none.status.code(), Some(125), "{}", text(&none.stderr));
    assert!(
        text(&none.stderr).contains("no command given"),
        "{}",
        text(&none.stderr)
    );
    let missing = f.kvpn(&[
        "run",
        "--kubeconfig",
        &kubeconfig,
        "--",
        "kvpn-no-such-command",
    ]);
    assert_eq!(
        missing.status.code(),
        Some(127),
        "{}",
        text(&missing.stderr)
    );
    assert!(
        text(&missing.stderr).contains("kvpn-no-such-command: command not found"),
        "{}",
        text(&missing.stderr)
    );
    let ctx = f.kvpn(&[
        "run",
        "--kubeconfig",
        &kubeconfig,
        "--context",
        "kvpn-no-such-context",
        "--",
        "true",
    ]);
    assert_eq!(ctx.status.code(), Some(125), "{}", text(&ctx.stderr));
    for flags in [&["--mtu", "lots"][..], &["--hosts"][..]] {
        let mut args = vec!["run", "--kubeconfig", &kubeconfig];
        args.extend_from_slice(flags);
        args.extend_from_slice(&["--", "true"]);
        let bad = f.kvpn(&args);
        assert_eq!(
            bad.status.code(),
            Some(125),
            "kvpn {args:?}: {}",
            text(&bad.stderr)
        );
    }
    // A command's own 1 stays 1.
    let one = f.kvpn(&["run", "--kubeconfig", &kubeconfig, "--", "false"]);
    assert_eq!(one.status.code(), Some(1), "{}", text(&one.stderr));
    assert!(
        text(&ctx.stderr).contains("kvpn-no-such-context"),
        "the error names the context: {}",
        text(&ctx.stderr)
    );
    assert_nothing_left(&f, &[], "after bad input");

    // The command's exit status is kvpn's. A namespace that does not exist is
    // said (#30 F10: short names would resolve in it), and the run goes on.
    let seven = f.kvpn(&[
        "run",
        "--kubeconfig",
        &kubeconfig,
        "-n",
        "kvpn-no-such-namespace",
        "--",
        "sh",
        "-c",
        "exit 7",
    ]);
    assert_eq!(seven.status.code(), Some(7), "{}", text(&seven.stderr));
    assert!(
        text(&seven.stderr).contains("namespace kvpn-no-such-namespace has no Service"),
        "no word on the missing namespace: {}",
        text(&seven.stderr)
    );
    assert_nothing_left(&f, &[], "after exit 7");

    // SIGTERM to kvpn reaches the command, whose status comes back.
    let mut child = spawn_run(
        &f,
        &kubeconfig,
        "trap 'echo got-term; exit 42' TERM; echo ready; while :; do sleep 0.1; done",
    );
    let stdout = child.stdout.take().unwrap_or_else(|| panic!("stdout"));
    let mut lines = BufReader::new(stdout).lines();
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    assert_eq!(first, "ready", "{}", f.diagnostics());
    let runs = wait_run_session(&f, &mut [&mut child], 1, Duration::from_secs(30));
    let id = runs[0]["id"].as_str().unwrap_or_default().to_owned();
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap_or(0));
    let t0 = Instant::now();
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)
        .unwrap_or_else(|e| panic!("SIGTERM kvpn: {e}"));
    let status = child.wait().unwrap_or_else(|e| panic!("wait: {e}"));
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert_eq!(status.code(), Some(42), "after SIGTERM: {rest:?}");
    assert_eq!(rest, vec!["got-term".to_owned()]);
    eprintln!(
        "SIGTERM to exit of kvpn with the session gone: {:.2} s",
        t0.elapsed().as_secs_f64()
    );
    assert_nothing_left(&f, &[id], "after SIGTERM");

    // `kvpn disconnect` of the run's session from elsewhere (#27 F2): the command
    // gets SIGTERM (its trap runs), kvpn run says why and exits with the
    // command's status, with no warning about a session it could not disconnect.
    let mut child = spawn_run(
        &f,
        &kubeconfig,
        "trap 'echo got-term; exit 3' TERM; echo ready; while :; do sleep 0.1; done",
    );
    let stdout = child.stdout.take().unwrap_or_else(|| panic!("stdout"));
    let mut lines = BufReader::new(stdout).lines();
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    assert_eq!(first, "ready", "{}", f.diagnostics());
    let runs = wait_run_session(&f, &mut [&mut child], 1, Duration::from_secs(30));
    let id = runs[0]["id"].as_str().unwrap_or_default().to_owned();
    f.kvpn_ok(&["disconnect", &id]);
    let out = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("wait for kvpn run after kvpn disconnect: {e}"));
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let err = text(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(3),
        "after disconnect: {rest:?} {err}"
    );
    assert_eq!(rest, vec!["got-term".to_owned()], "{err}");
    assert!(
        err.contains(&format!(
            "session {id} was disconnected from outside this run"
        )) && err.contains("SIGTERM"),
        "kvpn run did not say why its command was stopped: {err}"
    );
    assert!(!err.contains("cannot disconnect"), "{err}");
    assert_nothing_left(&f, &[id], "after kvpn disconnect of the run");

    // SIGKILL of kvpn: the user daemon notices, the session goes, the command
    // (still in the run's cgroup) is killed with it.
    let mut child = spawn_run(&f, &kubeconfig, "exec sleep 300");
    let runs = wait_run_session(&f, &mut [&mut child], 1, Duration::from_secs(90));
    let id = runs[0]["id"].as_str().unwrap_or_default().to_owned();
    let cg = host_cgroup(&runs[0]);
    let procs: Vec<i32> = std::fs::read_to_string(cg.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.parse().ok())
        .collect();
    assert!(!procs.is_empty(), "the command is in {}", cg.display());
    child.kill().unwrap_or_else(|e| panic!("SIGKILL kvpn: {e}"));
    let _ = child.wait();
    let t0 = Instant::now();
    loop {
        let gone = f.sessions().is_empty()
            && !cg.exists()
            && procs
                .iter()
                .all(|p| !std::path::Path::new(&format!("/proc/{p}")).exists());
        if gone {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "the run was not cleaned up after SIGKILL of kvpn: sessions {:#?}, cgroup {} exists: {}\n{}",
            f.sessions(),
            cg.display(),
            cg.exists(),
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "SIGKILL of kvpn to the run cleaned up: {:.2} s",
        t0.elapsed().as_secs_f64()
    );
    assert_nothing_left(&f, &[id], "after SIGKILL of kvpn");

    // SIGKILL of the root daemon while a run's command runs: the cgroup (the
    // machine's, not the netns') and the command outlive it; the next root
    // daemon of this runtime folder kills what is in the recorded cgroup and
    // removes it before it serves (#27).
    let mut child = spawn_run(&f, &kubeconfig, "exec sleep 300");
    let runs = wait_run_session(&f, &mut [&mut child], 1, Duration::from_secs(90));
    let id = runs[0]["id"].as_str().unwrap_or_default().to_owned();
    let cg = host_cgroup(&runs[0]);
    let procs: Vec<i32> = std::fs::read_to_string(cg.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.parse().ok())
        .collect();
    assert!(!procs.is_empty(), "the command is in {}", cg.display());
    let pid_file = f.runtime_dir().join("dataplane.pid");
    let root_pid: i32 = std::fs::read_to_string(&pid_file)
        .ok()
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("no root daemon pid in {}", pid_file.display()));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(root_pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap_or_else(|e| panic!("SIGKILL the root daemon {root_pid}: {e}"));
    let t0 = Instant::now();
    while std::path::Path::new(&format!("/proc/{root_pid}/exe")).exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "root daemon {root_pid} still there"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        cg.exists(),
        "the cgroup went with the root daemon: nothing to sweep"
    );
    // Another run starts the next root daemon, whose sweep stops the orphan.
    let next = f.kvpn(&["run", "--kubeconfig", &kubeconfig, "--", "true"]);
    assert_eq!(next.status.code(), Some(0), "{}", text(&next.stderr));
    let t0 = Instant::now();
    while cg.exists()
        || procs
            .iter()
            .any(|p| std::path::Path::new(&format!("/proc/{p}")).exists())
    {
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "the next root daemon left the killed one's run: cgroup {} exists: {}",
            cg.display(),
            cg.exists()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // A daemon that mounted its own cgroup2 view (no mount in its namespace)
    // left that empty mount point in /tmp: swept too.
    let daemon_view = std::path::PathBuf::from(runs[0]["run_cgroup"].as_str().unwrap_or_default());
    if let Some(own) = daemon_view.parent().filter(|p| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("kvpn-cgroup2-"))
    }) {
        assert!(
            !own.exists(),
            "the killed daemon's cgroup2 mount point {} is left",
            own.display()
        );
    }
    let _ = child.kill();
    let _ = child.wait();
    let t0 = Instant::now();
    while !f.sessions().is_empty() && t0.elapsed() < Duration::from_secs(10) {
        let _ = f.kvpn(&["disconnect", &id]);
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_nothing_left(&f, &[id], "after SIGKILL of the root daemon");

    // kvpn run and its user daemon both SIGKILLed: nobody is left to disconnect
    // the run's session; the root daemon ends it once the command itself ended
    // (#27), instead of keeping its TUN device, table and cgroup forever.
    let mut child = spawn_run(&f, &kubeconfig, "exec sleep 3");
    let runs = wait_run_session(&f, &mut [&mut child], 1, Duration::from_secs(90));
    let id = runs[0]["id"].as_str().unwrap_or_default().to_owned();
    let cg = host_cgroup(&runs[0]);
    let user_pid_file = f.runtime_dir().join("user.pid");
    let user_pid: i32 = std::fs::read_to_string(&user_pid_file)
        .ok()
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("no user daemon pid in {}", user_pid_file.display()));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(user_pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap_or_else(|e| panic!("SIGKILL the user daemon {user_pid}: {e}"));
    child.kill().unwrap_or_else(|e| panic!("SIGKILL kvpn: {e}"));
    let _ = child.wait();
    assert!(
        cg.exists(),
        "the run's cgroup went before its command ended"
    );
    let t0 = Instant::now();
    while cg.exists() || !f.tun_devices().is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the root daemon kept the abandoned run session {id}: cgroup {} exists: {}, TUN devices {:?}",
            cg.display(),
            cg.exists(),
            f.tun_devices()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "abandoned run session ended by the root daemon {:.1} s after kvpn and its user daemon were killed (command: sleep 3)",
        t0.elapsed().as_secs_f64()
    );
    let t0 = Instant::now();
    while !f.sessions().is_empty() && t0.elapsed() < Duration::from_secs(10) {
        let _ = f.kvpn(&["disconnect", &id]);
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_nothing_left(&f, &[id], "after the abandoned run");
}

#[test]
fn two_runs_reach_two_clusters_with_the_same_cidrs_and_pod_ips() {
    let mut f = KubeFixture::new();
    let b = f.add_cluster(Addressing::overlapping());
    let kube_a = f.user_kubeconfig();
    let kube_b = f
        .cluster(b)
        .laptop_user_kubeconfig()
        .to_string_lossy()
        .into_owned();
    let pods_a = web_pods(&f, f.lab());
    let pods_b = web_pods(&f, f.cluster(b));
    let names_a: Vec<String> = pods_a.iter().map(pod_name).collect();
    let names_b: Vec<String> = pods_b.iter().map(pod_name).collect();
    assert!(
        names_a.iter().all(|n| !names_b.contains(n)),
        "the clusters' pods must differ: {names_a:?} {names_b:?}"
    );
    let ips_b: Vec<IpAddr> = pods_b.iter().map(pod_ip).collect();
    let shared = pods_a
        .iter()
        .map(pod_ip)
        .find(|ip| ips_b.contains(ip))
        .unwrap_or_else(|| panic!("no pod IP in both clusters: {pods_a:?} {ips_b:?}"));

    let mut run_a = spawn_run(&f, &kube_a, &curl_script(shared, 6));
    let mut run_b = spawn_run(&f, &kube_b, &curl_script(shared, 6));
    let runs = wait_run_session(
        &f,
        &mut [&mut run_a, &mut run_b],
        2,
        Duration::from_secs(120),
    );
    let ids: Vec<String> = runs
        .iter()
        .map(|s| s["id"].as_str().unwrap_or_default().to_owned())
        .collect();
    let tunnel_ips: Vec<&str> = runs
        .iter()
        .filter_map(|s| s["tunnel_ip"].as_str())
        .collect();
    eprintln!("two run sessions {ids:?}, tunnel IPs {tunnel_ips:?}");
    let out_a = wait_output(run_a, "kvpn run on cluster A", &f);
    let out_b = wait_output(run_b, "kvpn run on cluster B", &f);
    for (out, names, other, which) in [
        (&out_a, &names_a, &names_b, "A"),
        (&out_b, &names_b, &names_a, "B"),
    ] {
        let got = pages(&text(&out.stdout));
        assert_eq!(
            got.len(),
            3,
            "cluster {which}: three pages expected: {got:?}"
        );
        for p in &got {
            assert!(
                names.contains(&p.pod) && !other.contains(&p.pod),
                "cluster {which}'s run got a page from {} (own pods {names:?})",
                p.pod
            );
        }
        assert_eq!(got[0].pod_ip, shared);
    }
    assert_nothing_left(&f, &ids, "after both runs");
}

/// A name the lab's cluster DNS answers (CoreDNS's "pods insecure") with an
/// address outside every cluster range: an `--extra-domain` stand-in.
const EXTRA: &str = "198-18-5-44.default.pod.cluster.local";
const EXTRA_IP: &str = "198.18.5.44";

/// The fields of one line `round N k=v1,v2, k2=…` the run's script prints.
fn round_fields(line: &str) -> std::collections::HashMap<String, Vec<String>> {
    line.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| {
            (
                k.to_owned(),
                v.split(',')
                    .filter(|a| !a.is_empty())
                    .map(ToOwned::to_owned)
                    .collect(),
            )
        })
        .collect()
}

#[test]
fn run_dns_forwarder_keeps_suffixes_and_extra_domains_counts_its_own_and_refuses_outsiders() {
    let f = KubeFixture::new();
    let upstream = Upstream::start(&f);
    write_laptop_resolv(&f, LAPTOP_RESOLV);
    let kubeconfig = f.user_kubeconfig();
    let web = cluster_ip(&f, "default", "web");
    let asked_before = upstream.queries().len();
    // Each round asks, inside the run, through the laptop's nameserver (which
    // the run's programs send to its forwarder): a name under --include-suffix,
    // a cluster name under --exclude-suffix, the --extra-domain, a Service
    // (over UDP and TCP).
    // Rounds go on (at most 60) until the test has looked from outside: all of
    // them after the route watch's first update of the cluster DNS settings
    // (which emptied the suffixes, F3), since kvpn run waits for it.
    let done = std::env::temp_dir().join(format!("kvpn-run-dns-done-{}", std::process::id()));
    let _ = std::fs::remove_file(&done);
    let ask = |n: &str| format!("$(dig +short +time=2 +tries=1 {n} | tr '\\n' ,)");
    let script = format!(
        "i=0; while [ $i -lt 60 ]; do i=$((i+1)); echo round $i corp={} kubedns={} extra={} \
         web={} webtcp={}; [ -e {} ] && break; sleep 1; done",
        ask(CORP_HOST.0),
        ask("kube-dns.kube-system.svc.cluster.local"),
        ask(EXTRA),
        ask("web.default.svc.cluster.local"),
        ask("+tcp web.default.svc.cluster.local"),
        done.display(),
    );
    let mut child = f
        .kvpn_command(&[
            "run",
            "--kubeconfig",
            &kubeconfig,
            "--namespace",
            "default",
            "--include-suffix",
            "corp.test",
            "--exclude-suffix",
            ".kube-system.svc.cluster.local",
            "--extra-domain",
            EXTRA,
            "--",
            "sh",
            "-c",
            &script,
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn kvpn run: {e}"));
    let runs = wait_run_session(&f, &mut [&mut child], 1, Duration::from_secs(90));
    let id = runs[0]["id"].as_str().unwrap_or_default().to_owned();
    let run_dns = runs[0]["run_dns"]
        .as_str()
        .unwrap_or_else(|| panic!("no run_dns: {:#}", runs[0]))
        .to_owned();
    let dns_ip = run_dns
        .rsplit_once(':')
        .map_or(run_dns.as_str(), |(ip, _)| ip)
        .to_owned();

    // F22: outside the run, the run's forwarder answers nobody, over UDP or TCP.
    for tcp in [false, true] {
        let mut args = vec!["dig", "+time=2", "+tries=1"];
        if tcp {
            args.push("+tcp");
        }
        let at = format!("@{dns_ip}");
        args.extend_from_slice(&[&at, "web.default.svc.cluster.local"]);
        let out = f.laptop(&args);
        let d = parse_dig(&text(&out.stdout));
        assert!(
            d.status.is_empty() && d.a().is_empty(),
            "a process outside the run got an answer from the run's forwarder {run_dns} \
             (tcp: {tcp}): {}",
            d.raw
        );
    }
    // F4: the --extra-domain name is resolved inside the run (through its
    // forwarder, as its processes ask), not by the user daemon outside the run's
    // cgroup, which has no route to the cluster DNS (it said "Network is
    // unreachable") or would ask whatever else answers at that address; its
    // answer is routed in the run's table only.
    let table = runs[0]["run_table"]
        .as_u64()
        .unwrap_or_else(|| panic!("no run_table: {:#}", runs[0]));
    let t0 = Instant::now();
    loop {
        let routes = text(
            &f.laptop(&["ip", "route", "show", "table", &table.to_string()])
                .stdout,
        );
        if routes.contains(EXTRA_IP) {
            break;
        }
        let session = f
            .sessions()
            .into_iter()
            .find(|s| s["id"] == id.as_str())
            .unwrap_or_default();
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{EXTRA_IP} ({EXTRA}, --extra-domain) is not routed in the run's table {table}:\n\
             {routes}\nextra domains: {:#}",
            session["extra_domains"]
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Outside the run the --extra-domain name resolves as before (the
    // laptop's resolver does not know it), and its address is not routed.
    let outside = f.laptop(&["getent", "hosts", EXTRA]);
    assert!(
        !text(&outside.stdout).contains(EXTRA_IP),
        "{EXTRA} (--extra-domain of the run) resolved outside the run: {}",
        text(&outside.stdout)
    );
    let get = text(&f.laptop(&["ip", "route", "get", EXTRA_IP]).stdout);
    assert!(
        !get.contains("kvpn"),
        "outside the run {EXTRA_IP} routes into a TUN: {get}"
    );

    // F7: the run's status row counts its own forwarder's questions (the
    // rounds' digs), not the laptop-wide forwarder's (there is none here).
    let t0 = Instant::now();
    loop {
        let session = f
            .sessions()
            .into_iter()
            .find(|s| s["id"] == id.as_str())
            .unwrap_or_else(|| panic!("run session {id} gone\n{}", f.diagnostics()));
        let counters = &session["dns_counters"];
        if counters["udp_queries"].as_u64() >= Some(8) && counters["cluster"].as_u64() >= Some(2) {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the run session's DNS counters are not its forwarder's: {counters:#}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let table = f.kvpn_ok(&["status"]);
    assert!(
        table.contains("DNS forwarder") && table.contains(&run_dns),
        "status shows no DNS forwarder counters for the run:\n{table}"
    );

    std::fs::write(&done, b"").unwrap_or_else(|e| panic!("write {}: {e}", done.display()));
    let out = wait_output(child, "kvpn run with DNS options", &f);
    let _ = std::fs::remove_file(&done);
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "extra domain {EXTRA} resolved through the cluster DNS: {EXTRA_IP} routed"
        )),
        "kvpn run did not say the --extra-domain was resolved and routed: {stderr}"
    );
    let stdout = text(&out.stdout);
    let rounds: Vec<&str> = stdout.lines().filter(|l| l.starts_with("round ")).collect();
    assert!(rounds.len() >= 3, "{stdout}");
    for line in &rounds {
        let got = round_fields(line);
        let field = |k: &str| got.get(k).cloned().unwrap_or_default();
        // F3: --include-suffix corp.test: the cluster DNS (which refuses it)
        // is asked, not the laptop's resolver that knows it.
        assert!(
            !field("corp").contains(&CORP_HOST.1.to_owned()),
            "inside the run {} was answered by the laptop's resolver despite \
             --include-suffix corp.test: {line}",
            CORP_HOST.0
        );
        // --exclude-suffix: a cluster name under it gets no cluster answer.
        assert!(
            !field("kubedns").contains(&CLUSTER_DNS.to_owned()),
            "inside the run kube-dns.kube-system got the cluster's answer despite \
             --exclude-suffix: {line}"
        );
        // F4: the --extra-domain name resolves inside the run.
        assert_eq!(field("extra"), vec![EXTRA_IP.to_owned()], "{line}");
        assert_eq!(field("web"), vec![web.clone()], "{line}");
        // Over TCP too (the forwarder's listener takes the run's marked SYN).
        assert_eq!(field("webtcp"), vec![web.clone()], "{line}");
    }
    assert!(
        !upstream.queries()[asked_before..]
            .iter()
            .any(|q| q == CORP_HOST.0),
        "the laptop's resolver was asked {} (--include-suffix corp.test): {:?}",
        CORP_HOST.0,
        upstream.queries()
    );
    assert_nothing_left(&f, &[id], "after the run");
}

#[test]
fn plain_disconnect_ends_connect_sessions_and_leaves_run_sessions() {
    let f = KubeFixture::new();
    let kubeconfig = f.user_kubeconfig();
    let mut child = spawn_run(
        &f,
        &kubeconfig,
        "trap 'echo got-term; exit 3' TERM; echo ready; while :; do sleep 0.1; done",
    );
    let stdout = child.stdout.take().unwrap_or_else(|| panic!("stdout"));
    let mut lines = BufReader::new(stdout).lines();
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    assert_eq!(first, "ready", "{}", f.diagnostics());
    let runs = wait_run_session(&f, &mut [&mut child], 1, Duration::from_secs(90));
    let run_id = runs[0]["id"].as_str().unwrap_or_default().to_owned();
    f.kvpn_ok(&["connect", "--kubeconfig", &kubeconfig]);
    let connect_id = f
        .sessions()
        .into_iter()
        .find(|s| s["run_cgroup"].as_str().is_none_or(str::is_empty))
        .and_then(|s| s["id"].as_str().map(ToOwned::to_owned))
        .unwrap_or_else(|| panic!("no connect session: {:#?}", f.sessions()));

    // A plain disconnect: the connect session goes, the run and its command stay,
    // and it says so, with how to end the run.
    let out = f.kvpn(&["disconnect"]);
    let said = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains(&format!("Disconnected session {connect_id}")),
        "{said}"
    );
    assert!(
        said.contains(&format!("Left `kvpn run` session {run_id}"))
            && said.contains(&format!("kvpn disconnect {run_id}"))
            && said.contains("--all"),
        "a plain disconnect did not say it left run session {run_id}: {said}"
    );
    let ids: Vec<String> = f
        .sessions()
        .iter()
        .filter_map(|s| s["id"].as_str().map(ToOwned::to_owned))
        .collect();
    assert_eq!(
        ids,
        vec![run_id.clone()],
        "after a plain disconnect: {said}"
    );
    assert!(
        child.try_wait().ok().flatten().is_none(),
        "kvpn run ended with a plain disconnect: {said}"
    );

    // --all ends the run too: its command gets SIGTERM.
    f.kvpn_ok(&["disconnect", "--all"]);
    let status = child.wait().unwrap_or_else(|e| panic!("wait: {e}"));
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert_eq!(status.code(), Some(3), "after disconnect --all: {rest:?}");
    assert_eq!(rest, vec!["got-term".to_owned()]);
    assert_nothing_left(&f, &[run_id], "after disconnect --all");
}

/// A DNS question for `name`, type A, class IN (RFC 1035 4.1), id 0x6b76.
fn dns_question(name: &str) -> Vec<u8> {
    let mut q = vec![0x6b, 0x76, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
    for label in name.split('.') {
        q.push(u8::try_from(label.len()).expect("label of at most 63 bytes"));
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    q
}

/// `RunDnsQuery` on the root daemon of `runtime_dir` from a thread whose
/// credentials are `uid`'s (the daemon reads them with SO_PEERCRED).
fn run_dns_query_as(
    uid: u32,
    runtime_dir: std::path::PathBuf,
    req: kvpn_proto::dataplane::RunDnsQueryRequest,
) -> Result<Vec<u8>, tonic::Status> {
    std::thread::spawn(move || {
        // SAFETY: the raw setresgid/setresuid system calls change the calling
        // thread's credentials only (the libc wrappers would change every
        // thread's); this thread ends after the one call.
        let (g, u) = unsafe {
            (
                libc::syscall(libc::SYS_setresgid, uid, uid, uid),
                libc::syscall(libc::SYS_setresuid, uid, uid, uid),
            )
        };
        assert_eq!((g, u), (0, 0), "cannot become uid {uid} in a thread");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("runtime: {e}"));
        rt.block_on(async {
            let mut client = kvpn_control::daemon::connect_existing(&runtime_dir)
                .await
                .unwrap_or_else(|e| panic!("uid {uid} cannot reach the root daemon: {e:#}"))
                .unwrap_or_else(|| panic!("no root daemon in {}", runtime_dir.display()));
            client
                .run_dns_query(req)
                .await
                .map(|r| r.into_inner().answer)
        })
    })
    .join()
    .unwrap_or_else(|_| panic!("the uid {uid} thread panicked"))
}

/// R1: a run's DNS forwarder answers, through the root daemon's RunDnsQuery,
/// only the uid that started the run and root: the other uid the root daemon
/// serves (here 65534, allowed as SUDO_UID) is refused, naming the owner.
#[test]
fn run_dns_query_serves_the_runs_owner_and_root_only() {
    use std::os::unix::fs::PermissionsExt as _;
    // SUDO_UID below.
    const OTHER: u32 = 65534;
    let f = KubeFixture::new();
    let kubeconfig = f.user_kubeconfig();
    let done = std::env::temp_dir().join(format!("kvpn-run-owner-done-{}", std::process::id()));
    let _ = std::fs::remove_file(&done);
    let script = format!(
        "i=0; while [ $i -lt 90 ] && [ ! -e {} ]; do sleep 1; i=$((i+1)); done",
        done.display()
    );
    // The root daemon this run starts also serves uid OTHER (as one started
    // through sudo by that user would).
    let mut child = spawn_run_with(&f, &kubeconfig, &script, &[("SUDO_UID", "65534")]);
    let runs = wait_run_session(&f, &mut [&mut child], 1, Duration::from_secs(90));
    let id = runs[0]["id"].as_str().unwrap_or_default().to_owned();
    let rt = f.runtime_dir().to_path_buf();
    let socket = rt.join("dataplane.sock");
    let mode = std::fs::metadata(&socket)
        .unwrap_or_else(|e| panic!("{}: {e}", socket.display()))
        .permissions()
        .mode();
    assert_eq!(
        mode & 0o777,
        0o666,
        "the root daemon does not serve uid {OTHER}"
    );
    // Let uid OTHER reach the socket (the folders are the test's own).
    for dir in [rt.parent().expect("runtime folder's parent"), rt.as_path()] {
        let mode = std::fs::metadata(dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .permissions()
            .mode();
        std::fs::set_permissions(
            dir,
            std::fs::Permissions::from_mode((mode | 0o011) & 0o7777),
        )
        .unwrap_or_else(|e| panic!("chmod {}: {e}", dir.display()));
    }
    let req = kvpn_proto::dataplane::RunDnsQueryRequest {
        session_id: id.clone(),
        query: dns_question("web.default.svc.cluster.local"),
    };
    let refused = run_dns_query_as(OTHER, rt.clone(), req.clone())
        .expect_err("uid 65534 got an answer from root's run's forwarder");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert!(
        refused.message().contains(&format!(
            "run session {id} belongs to uid 0, not to the caller (uid {OTHER})"
        )),
        "{}",
        refused.message()
    );
    let answer = run_dns_query_as(0, rt, req)
        .unwrap_or_else(|e| panic!("root (the run's owner) was refused: {e:?}"));
    assert!(answer.len() > 12, "no DNS answer for root: {answer:?}");

    std::fs::write(&done, b"").unwrap_or_else(|e| panic!("write {}: {e}", done.display()));
    wait_output(child, "kvpn run", &f);
    let _ = std::fs::remove_file(&done);
    assert_nothing_left(&f, &[id], "after the run");
}
