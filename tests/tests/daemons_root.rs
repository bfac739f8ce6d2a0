//! The root daemon (`kvpn-dataplane`) of issue [daemons]: peer credentials on its
//! socket, the sweep after a SIGKILL (lc-01, lc-02), rollback of a failing
//! privileged Connect step (lc-03), and the counters behind `kvpn top`.
//!
//! Everything is real: the daemon in its own netns, other uids through
//! `setpriv`, the Kubernetes lab with iperf3 in a pod, an immutable resolv.conf
//! (`chattr +i`) as the failing DNS step, `bpftool` for eBPF programs.

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kvpn_lab::k8s::kubelet::spec::netns_role;
use kvpn_lab::{LAPTOP, Netns};
use kvpn_tests::dns_lab::{cluster_ip, connect_default, kill_daemon_and_agents, restart_daemon};
use kvpn_tests::kube_lab::{KubeFixture, classifier_prog_ids, prog_exists, residue};
use kvpn_tests::text;

/// A uid the daemon is told to allow, and one it is not (nobody).
const ALLOWED_UID: u32 = 4242;
const OTHER_UID: u32 = 65534;

fn unique_id() -> String {
    use std::hash::{BuildHasher as _, Hasher as _};
    let mut h = std::hash::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    format!("{:05x}", h.finish() & 0xf_ffff)
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| panic!("run {cmd:?}: {e}"))
}

fn run_ok(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// A netns, a runtime folder and a root daemon of this test; all removed on drop.
struct StandaloneDaemon {
    ns: Netns,
    dir: PathBuf,
    daemon: Option<Child>,
}

impl StandaloneDaemon {
    fn new(id: &str) -> Self {
        let ns =
            Netns::create(&format!("kvpn-{id}-rootd")).unwrap_or_else(|e| panic!("netns: {e:#}"));
        let dir = std::env::temp_dir().join(format!("kvpn-{id}-rootd-run"));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("runtime dir: {e}"));
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))
            .unwrap_or_else(|e| panic!("chmod: {e}"));
        StandaloneDaemon {
            ns,
            dir,
            daemon: None,
        }
    }

    fn ip(&self, args: &[&str]) -> String {
        run_ok(Command::new("ip").args(["-n", self.ns.name()]).args(args))
    }

    fn start(&mut self, extra: &[&str]) {
        let bin = kvpn_lab::bin_path("kvpn-dataplane").unwrap_or_else(|e| panic!("{e:#}"));
        let log = std::fs::File::create(self.dir.join("dataplane.log"))
            .unwrap_or_else(|e| panic!("log: {e}"));
        let mut cmd = self.ns.command(&bin);
        cmd.arg("--runtime-dir")
            .arg(&self.dir)
            .args(extra)
            .env("KVPN_RESOLV_CONF", self.dir.join("resolv.conf"))
            .env("KVPN_HOSTS", self.dir.join("hosts"))
            .env_remove("SUDO_UID")
            .env_remove("KVPN_ALLOW_UID")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        self.daemon = Some(cmd.spawn().unwrap_or_else(|e| panic!("spawn daemon: {e}")));
        let t0 = Instant::now();
        while std::os::unix::net::UnixStream::connect(self.dir.join("dataplane.sock")).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "daemon did not serve: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("dataplane.log")).unwrap_or_default()
    }

    /// `kvpn top --once -o json` as `uid` (through setpriv).
    fn top_as(&self, uid: u32) -> Output {
        let kvpn = kvpn_lab::bin_path("kvpn").unwrap_or_else(|e| panic!("{e:#}"));
        run(Command::new("setpriv")
            .arg(format!("--reuid={uid}"))
            .arg(format!("--regid={uid}"))
            .arg("--clear-groups")
            .arg(&kvpn)
            .args(["top", "--once", "-o", "json", "--interval", "0.2"])
            .env("KVPN_RUNTIME_DIR", &self.dir))
    }
}

impl Drop for StandaloneDaemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.daemon.take() {
            // SAFETY: the pid of the daemon this test started.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let t0 = Instant::now();
            while child.try_wait().ok().flatten().is_none() && t0.elapsed() < Duration::from_secs(5)
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = self.ns.delete();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Peer credentials: root and the allowed uid are served, another uid is
/// refused with PERMISSION_DENIED naming it and the fix, and counted in the log.
/// Sweep scope: of two leftover TUN devices with kvpn routes, only the one this
/// runtime folder recorded is removed; a stale socket is replaced (lc-01).
#[test]
fn root_socket_checks_peer_uid_and_sweeps_only_its_own_tun_devices() {
    kvpn_lab::require_root().unwrap_or_else(|e| panic!("{e:#}"));
    let id = unique_id();
    let mut d = StandaloneDaemon::new(&id);
    // Leftovers: two persistent TUN devices with kvpn's routes (protocol 107);
    // this runtime folder recorded the first, another daemon owns the second.
    let (ours, theirs) = (format!("kv{id}a"), format!("kv{id}b"));
    for (dev, net) in [(&ours, "10.77.1.0/24"), (&theirs, "10.77.2.0/24")] {
        d.ip(&["tuntap", "add", "dev", dev, "mode", "tun"]);
        d.ip(&["link", "set", dev, "up"]);
        d.ip(&["route", "add", net, "dev", dev, "proto", "107"]);
    }
    let ifindex = |dev: &str| -> u32 {
        let v: serde_json::Value =
            serde_json::from_str(&d.ip(&["-j", "link", "show", "dev", dev])).unwrap_or_default();
        v[0]["ifindex"].as_u64().unwrap_or(0) as u32
    };
    std::fs::write(d.dir.join("tuns"), format!("{ours} {}\n", ifindex(&ours)))
        .unwrap_or_else(|e| panic!("record: {e}"));
    // A stale socket nobody listens on, as a SIGKILLed daemon leaves it.
    drop(
        std::os::unix::net::UnixListener::bind(d.dir.join("dataplane.sock"))
            .unwrap_or_else(|e| panic!("stale socket: {e}")),
    );
    std::fs::write(d.dir.join("dataplane.pid"), "999999\n").unwrap_or_else(|e| panic!("{e}"));

    d.start(&["--allow-uid", &ALLOWED_UID.to_string()]);

    let sock = std::fs::metadata(d.dir.join("dataplane.sock")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(sock.uid(), 0, "socket owned by root");
    assert_eq!(
        sock.permissions().mode() & 0o777,
        0o666,
        "socket reachable by the allowed uid"
    );

    // Another uid: refused, with its uid and the fix in the message.
    let refused = d.top_as(OTHER_UID);
    let err = text(&refused.stderr);
    assert!(
        !refused.status.success(),
        "uid {OTHER_UID} was served: {}",
        text(&refused.stdout)
    );
    assert!(
        err.contains(&format!("refuses uid {OTHER_UID}"))
            && err.contains(&format!("--allow-uid {OTHER_UID}")),
        "refusal does not name the uid and the fix: {err}"
    );
    // The allowed uid and root: served (no sessions yet, so no rows).
    for uid in [ALLOWED_UID, 0] {
        let out = d.top_as(uid);
        assert!(
            out.status.success(),
            "uid {uid} refused: {}",
            text(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("top JSON: {e}: {}", text(&out.stdout)));
        assert_eq!(v["rows"], serde_json::json!([]), "{v}");
    }
    // Calls are served only after the sweep (the socket is bound before it, so
    // that a second daemon cannot start meanwhile): the answers above prove it ran.
    let links = d.ip(&["-o", "link", "show"]);
    assert!(
        !links.contains(&format!("{ours}:")),
        "recorded TUN device not swept:\n{links}\n{}",
        d.log()
    );
    assert!(
        links.contains(&format!("{theirs}:")),
        "another daemon's TUN device was touched:\n{links}"
    );
    let routes = d.ip(&["route", "show", "proto", "107"]);
    assert!(
        !routes.contains("10.77.1.0/24"),
        "route through the swept device: {routes}"
    );
    assert!(
        routes.contains("10.77.2.0/24"),
        "another daemon's route was removed: {routes}"
    );
    assert!(
        !d.dir.join("tuns").exists(),
        "record not cleared after the sweep"
    );

    let log = d.log();
    assert_eq!(
        log.matches("refused a call from a uid that is not allowed")
            .count(),
        1,
        "the refusal is logged once (and only the refused call): {log}"
    );
    assert!(log.contains(&format!("uid={OTHER_UID}")), "{log}");
    // And counted: Status (as root) reports the one refused call.
    let socket = d.dir.join("dataplane.sock");
    let refused = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"))
        .block_on(async {
            let mut client = kvpn_dataplane::client::connect(&socket)
                .await
                .unwrap_or_else(|e| panic!("connect {}: {e}", socket.display()));
            client
                .status(kvpn_proto::dataplane::StatusRequest {})
                .await
                .unwrap_or_else(|e| panic!("status: {e}"))
                .into_inner()
                .refused_peers
        });
    assert_eq!(refused, 1, "refused calls counted in Status");
    assert!(log.contains("removing stale socket"), "{log}");
    d.ip(&["link", "del", &theirs]);
}

/// A web pod: its IP and netns role.
fn web_pod(f: &KubeFixture) -> (String, String) {
    for ns in ["default", kvpn_lab::k8s::workloads::DEV_NAMESPACE] {
        let api: Api<Pod> = Api::namespaced(f.admin(), ns);
        let list = f
            .block_on(api.list(&ListParams::default().labels("app=web")))
            .unwrap_or_else(|e| panic!("list pods: {e}"));
        for p in list.items {
            let ip = p.status.as_ref().and_then(|s| s.pod_ip.clone());
            if let (Some(ip), Some(name), Some(uid)) = (ip, p.metadata.name, p.metadata.uid) {
                return (ip, netns_role(&name, &uid));
            }
        }
    }
    panic!("no web pod with an IP");
}

const IPERF_PORT: u16 = 5201;

/// iperf3 from the laptop to `ip` for `seconds`, in the background.
fn iperf3_client(f: &KubeFixture, ip: &str, seconds: u32) -> Child {
    f.lab()
        .netns_lab()
        .command_in(LAPTOP, "iperf3")
        .unwrap_or_else(|e| panic!("{e:#}"))
        .args([
            "-c",
            ip,
            "-p",
            &IPERF_PORT.to_string(),
            "-t",
            &seconds.to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("iperf3 client: {e}"))
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn top_once(f: &KubeFixture) -> Vec<serde_json::Value> {
    let out = f.kvpn_ok(&["top", "--once", "-o", "json", "--interval", "1"]);
    let v: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("top JSON: {e}: {out}"));
    v["rows"].as_array().cloned().unwrap_or_default()
}

fn contains(cidr: &str, ip: &str) -> bool {
    let (Ok(net), Ok(ip)) = (cidr.parse::<ipnet::IpNet>(), ip.parse::<std::net::IpAddr>()) else {
        return false;
    };
    net.contains(&ip)
}

/// `kvpn top`'s data source during iperf3: the route carrying it shows non-zero
/// rates; a Service reached by its ClusterIP gets its own row. Then SIGKILL of
/// the root daemon mid-traffic: the next `kvpn connect` recovers by itself
/// (lc-01), and after a second SIGKILL the restarted daemon leaves no residue
/// (lc-02): TUN devices, routes, nftables tables, eBPF programs and pins,
/// resolv.conf and hosts bytes as before kvpn.
#[test]
fn lc_02_top_rates_then_sigkill_mid_traffic_recovers_and_sweeps() {
    let f = KubeFixture::new();
    let before = residue(&f);
    connect_default(&f);
    let (pod_ip, pod_role) = web_pod(&f);
    let mut iperf = Command::new("iperf3");
    iperf.args(["-s", "-p", &IPERF_PORT.to_string()]);
    f.lab()
        .netns_lab()
        .spawn_in(&pod_role, "iperf3-rootd", &iperf)
        .unwrap_or_else(|e| panic!("iperf3 server: {e:#}"));
    // A listener check, not a probe connection: iperf3 takes a probe for a client
    // and may answer the real one with "the server is busy".
    f.lab()
        .netns_lab()
        .wait_listening(&pod_role, IPERF_PORT, Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("iperf3 server up: {e:#}"));

    // 1. Rates during iperf3, on the route that covers the pod IP.
    let client = KillOnDrop(iperf3_client(&f, &pod_ip, 20));
    std::thread::sleep(Duration::from_secs(2));
    let rows = top_once(&f);
    let route = rows
        .iter()
        .find(|r| r["parent"].is_null() && r["cidr"].as_str().is_some_and(|c| contains(c, &pod_ip)))
        .unwrap_or_else(|| panic!("no route row for {pod_ip}: {rows:#?}"));
    let bps = route["bytes_per_sec"].as_f64().unwrap_or(0.0);
    let pps = route["packets_per_sec"].as_f64().unwrap_or(0.0);
    eprintln!(
        "kvpn top during iperf3: {} {} B/s {} pkt/s",
        route["cidr"], bps, pps
    );
    assert!(
        bps > 0.0 && pps > 0.0,
        "no rate on the pod route during iperf3: {route:#}"
    );
    eprintln!("{}", f.kvpn_ok(&["top", "--once"]));

    // 2. A Service by its ClusterIP: its own row once the route watch reported it.
    let web_ip = cluster_ip(&f, "default", "web");
    let web: std::net::SocketAddr = format!("{web_ip}:80")
        .parse()
        .unwrap_or_else(|e| panic!("{e}"));
    let t0 = Instant::now();
    let service_row = loop {
        let _ = f.http_get(web, Duration::from_secs(3));
        let rows = top_once(&f);
        if let Some(r) = rows.iter().find(|r| {
            r["cidr"] == format!("{web_ip}/32")
                && r["services"]
                    .as_array()
                    .is_some_and(|s| s.iter().any(|n| n == "default/web"))
        }) && r["packets"].as_u64().unwrap_or(0) > 0
        {
            break r.clone();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no counted row for Service default/web ({web_ip}): {rows:#?}\n{}",
            f.diagnostics()
        );
    };
    assert_eq!(service_row["source"], "service", "{service_row:#}");

    // 3. SIGKILL mid-traffic; the stale root-owned socket stays behind.
    let prog_ids = classifier_prog_ids(&f);
    assert!(
        !prog_ids.is_empty(),
        "no classifier attached to {:?}",
        f.tun_devices()
    );
    assert!(
        prog_ids.iter().all(|id| prog_exists(*id)),
        "bpftool does not see {prog_ids:?}"
    );
    kill_daemon_and_agents(&f);
    drop(client);
    let socket = f.runtime_dir().join("dataplane.sock");
    assert!(
        socket.exists(),
        "a SIGKILLed daemon cannot remove its socket"
    );

    // lc-01: the next connect recovers by itself.
    connect_default(&f);
    let page = f.page(web);
    assert_eq!(
        page.pod_ip.to_string().split('.').next(),
        Some("10"),
        "web after recovery: {page:?}"
    );

    // lc-02: SIGKILL again, the restarted daemon sweeps before anything else.
    let prog_ids_2 = classifier_prog_ids(&f);
    kill_daemon_and_agents(&f);
    restart_daemon(&f);
    let t0 = Instant::now();
    loop {
        let now = residue(&f);
        if now == before {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "residue after SIGKILL and restart:\nbefore {before:#?}\nnow {now:#?}\n{}",
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    for id in prog_ids.iter().chain(&prog_ids_2) {
        assert!(!prog_exists(*id), "eBPF program {id} outlived its daemon");
    }
    assert!(classifier_prog_ids(&f).is_empty());
    for leftover in ["tuns", "resolv.conf.kvpn-backup"] {
        assert!(
            !f.runtime_dir().join(leftover).exists(),
            "{leftover} left in the runtime folder"
        );
    }
}

/// Clears the immutable flag on drop, also when the test fails.
struct Immutable(PathBuf);

impl Immutable {
    fn set(path: &Path) -> Self {
        run_ok(Command::new("chattr").arg("+i").arg(path));
        Immutable(path.to_owned())
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        let _ = Command::new("chattr").arg("-i").arg(&self.0).status();
    }
}

/// lc-03: with the laptop's resolv.conf immutable, the DNS step of Connect
/// fails; the TUN device, routes and classifier created before it are removed,
/// the error names the step, and nothing changed. With the flag cleared, the
/// same connect works.
#[test]
fn failing_dns_step_rolls_back_and_names_the_step() {
    let f = KubeFixture::new();
    let before = residue(&f);
    let guard = Immutable::set(&f.laptop_resolv_conf());
    let kubeconfig = f.user_kubeconfig();
    let out = f.kvpn(&[
        "connect",
        "--kubeconfig",
        &kubeconfig,
        "--namespace",
        "default",
    ]);
    let err = text(&out.stderr);
    assert!(
        !out.status.success(),
        "connect succeeded with an immutable resolv.conf: {}",
        text(&out.stdout)
    );
    assert!(
        err.contains("step \"configure DNS\""),
        "error does not name the step: {err}"
    );
    assert!(
        err.contains("rolled back"),
        "error does not say it rolled back: {err}"
    );
    assert_eq!(
        residue(&f),
        before,
        "connect left something behind:\n{err}\n{}",
        f.diagnostics()
    );
    assert!(
        classifier_prog_ids(&f).is_empty(),
        "classifier still attached"
    );
    assert!(!f.runtime_dir().join("resolv.conf.kvpn-backup").exists());
    assert!(
        !f.runtime_dir().join("tuns").exists(),
        "rolled-back TUN still recorded"
    );
    let sessions: Vec<_> = f
        .sessions()
        .into_iter()
        .filter(|s| s["tun_name"].is_string())
        .collect();
    assert!(
        sessions.is_empty(),
        "a session survived the rollback: {sessions:#?}"
    );
    drop(guard);
    connect_default(&f);
    assert_eq!(f.sessions().len(), 1);
}
