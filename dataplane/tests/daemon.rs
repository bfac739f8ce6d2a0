//! Tests of the `kvpn-dataplane` binary: the gRPC API over its Unix socket, the
//! socket's ownership and mode, stale sockets (lc-01), and teardown on Disconnect
//! and SIGTERM. Each daemon runs in its own network namespace (`ip netns exec`)
//! with its own runtime directory.

mod common;

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::fake_manager::FakeManager;
use common::{Ns, TestNetns, require_root};
use kvpn_proto::dataplane::{ConnectRequest, DisconnectRequest, Route, RouteKind, StatusRequest};

/// A runtime directory for one daemon, removed on drop.
struct RuntimeDir(PathBuf);

impl RuntimeDir {
    fn new(ns: &Ns) -> Self {
        let dir = std::env::temp_dir().join(format!("{}-run", ns.name));
        std::fs::create_dir_all(&dir).expect("create runtime dir");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        Self(dir)
    }
    fn socket(&self) -> PathBuf {
        self.0.join("dataplane.sock")
    }
    fn log(&self) -> String {
        std::fs::read_to_string(self.0.join("dataplane.log")).unwrap_or_default()
    }
}

impl Drop for RuntimeDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A daemon process, killed on drop if still running.
struct Daemon {
    child: Child,
}

impl Daemon {
    fn spawn(ns: &Ns, dir: &RuntimeDir) -> Self {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.0.join("dataplane.log"))
            .expect("log file");
        let child = Command::new("ip")
            .args([
                "netns",
                "exec",
                &ns.name,
                env!("CARGO_BIN_EXE_kvpn-dataplane"),
            ])
            .arg("--runtime-dir")
            .arg(&dir.0)
            .args(["--log-level", "debug"])
            // Root only: a SUDO_UID from the test's own sudo would be allowed too
            // (and make the socket 0666).
            .env_remove("SUDO_UID")
            .env_remove("KVPN_ALLOW_UID")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn kvpn-dataplane");
        Self { child }
    }

    fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).expect("pid fits i32")
    }

    fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), sig)
            .expect("signal the daemon");
    }

    fn wait(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "daemon did not exit within {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn wait_for_socket(dir: &RuntimeDir, daemon: &mut Daemon) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::os::unix::net::UnixStream::connect(dir.socket()).is_err() {
        if let Some(status) = daemon.child.try_wait().expect("try_wait") {
            panic!("daemon exited early with {status}: {}", dir.log());
        }
        assert!(
            Instant::now() < deadline,
            "daemon socket did not appear: {}",
            dir.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn route(cidr: &str, kind: RouteKind) -> Route {
    Route {
        cidr: cidr.to_owned(),
        kind: kind as i32,
        watched: false,
    }
}

#[test]
fn grpc_round_trip_over_the_unix_socket_and_clean_exit() {
    require_root();
    let netns = TestNetns::new();
    let dir = RuntimeDir::new(&netns);
    let mut daemon = Daemon::spawn(&netns, &dir);
    wait_for_socket(&dir, &mut daemon);

    let meta = std::fs::metadata(dir.socket()).expect("socket metadata");
    assert_eq!(meta.permissions().mode() & 0o777, 0o600, "socket mode");
    assert_eq!(meta.uid(), 0, "socket owned by root");
    let pid = std::fs::read_to_string(dir.0.join("dataplane.pid")).expect("pid file");
    assert_eq!(pid.trim(), daemon.child.id().to_string());

    runtime().block_on(async {
        let mut client = kvpn_dataplane::client::connect(&dir.socket()).await.expect("gRPC client");
        let status = client.status(StatusRequest {}).await.expect("status").into_inner();
        assert!(status.sessions.is_empty());

        let bad_ip = ConnectRequest {
            manager: "127.0.0.1:1".into(),
            routes: vec![route("10.244.0.0/16", RouteKind::Pod)],
            tunnel_ip: "not-an-ip".into(),
            ..Default::default()
        };
        let err = client.connect(bad_ip).await.expect_err("bad tunnel IP");
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("invalid tunnel IP"), "{}", err.message());

        let no_kind = ConnectRequest {
            manager: "127.0.0.1:1".into(),
            routes: vec![route("10.244.0.0/16", RouteKind::Unspecified)],
            tunnel_ip: "100.96.0.2".into(),
            ..Default::default()
        };
        let err = client.connect(no_kind).await.expect_err("route without kind");
        assert_eq!(err.code(), tonic::Code::InvalidArgument);

        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").port()
        };
        let unreachable = ConnectRequest {
            manager: format!("127.0.0.1:{closed}"),
            routes: vec![route("10.244.0.0/16", RouteKind::Pod)],
            tunnel_ip: "100.96.0.2".into(),
            ..Default::default()
        };
        let err = client.connect(unreachable).await.expect_err("nobody listens");
        assert_eq!(err.code(), tonic::Code::Unavailable);
        assert_eq!(
            err.message(),
            format!("cannot reach the traffic manager at 127.0.0.1:{closed}: connection refused — is kvpn-manager running and the address right?")
        );

        let err = client
            .disconnect(DisconnectRequest { session_id: "nope".into() })
            .await
            .expect_err("unknown session");
        assert_eq!(err.code(), tonic::Code::NotFound);
        let all = client.disconnect(DisconnectRequest::default()).await.expect("disconnect all").into_inner();
        assert!(all.stopped.is_empty());
    });

    // A second daemon on the same runtime dir refuses to start.
    let second = Command::new("ip")
        .args([
            "netns",
            "exec",
            &netns.name,
            env!("CARGO_BIN_EXE_kvpn-dataplane"),
        ])
        .arg("--runtime-dir")
        .arg(&dir.0)
        .output()
        .expect("run second daemon");
    assert!(!second.status.success());
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(stderr.contains("already serving"), "{stderr}");
    assert!(
        stderr.contains(&format!("pid {}", daemon.child.id())),
        "{stderr}"
    );

    daemon.signal(nix::sys::signal::Signal::SIGTERM);
    let status = daemon.wait(Duration::from_secs(5));
    assert!(
        status.success(),
        "clean exit on SIGTERM: {status}\n{}",
        dir.log()
    );
    assert!(!dir.socket().exists(), "socket removed at exit");
    assert!(
        !dir.0.join("dataplane.pid").exists(),
        "pid file removed at exit"
    );
}

#[test]
fn lc_01_stale_socket_after_sigkill_is_replaced() {
    require_root();
    let netns = TestNetns::new();
    let dir = RuntimeDir::new(&netns);
    let mut first = Daemon::spawn(&netns, &dir);
    wait_for_socket(&dir, &mut first);
    first.signal(nix::sys::signal::Signal::SIGKILL);
    first.wait(Duration::from_secs(5));
    assert!(
        dir.socket().exists(),
        "SIGKILL leaves the socket file behind"
    );

    let mut second = Daemon::spawn(&netns, &dir);
    wait_for_socket(&dir, &mut second);
    runtime().block_on(async {
        let mut client = kvpn_dataplane::client::connect(&dir.socket())
            .await
            .expect("client");
        client
            .status(StatusRequest {})
            .await
            .expect("the new daemon answers");
    });
    assert!(dir.log().contains("removing stale socket"), "{}", dir.log());
    second.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(second.wait(Duration::from_secs(5)).success());
}

fn nothing_left(ns: &Ns) {
    assert_eq!(
        ns.kvpn_links(),
        Vec::<String>::new(),
        "no kvpn link may remain"
    );
    assert_eq!(ns.kvpn_routes(), "", "no kvpn route may remain");
}

/// Connect through the daemon with the real eBPF classifier. With an eBPF
/// object built in, the whole path works and Disconnect and SIGTERM remove
/// everything; built with AYA_BUILD_SKIP, Connect fails at the classifier step,
/// says so, and leaves nothing behind.
#[test]
fn connect_status_disconnect_and_sigterm_through_the_daemon() {
    require_root();
    let netns = TestNetns::new();
    let ns = netns.handle();
    let dir = RuntimeDir::new(&netns);
    let mut daemon = Daemon::spawn(&netns, &dir);
    wait_for_socket(&dir, &mut daemon);
    let socket = dir.socket();
    let connected = netns.block_on(move || async move { connect_and_check(&ns, &socket).await });
    if connected {
        // Connect again, then SIGTERM: the daemon tears the session down.
        let socket = dir.socket();
        let ns = netns.handle();
        netns.block_on(move || async move {
            let manager = FakeManager::start(true).await;
            let mut client = kvpn_dataplane::client::connect(&socket)
                .await
                .expect("client");
            let resp = client
                .connect(request(&manager))
                .await
                .expect("connect")
                .into_inner();
            assert_eq!(ns.kvpn_links(), vec![resp.tun_name]);
        });
        daemon.signal(nix::sys::signal::Signal::SIGTERM);
        assert!(
            daemon.wait(Duration::from_secs(10)).success(),
            "{}",
            dir.log()
        );
        nothing_left(&netns);
        assert!(dir.log().contains("session torn down"), "{}", dir.log());
    }
}

fn request(manager: &FakeManager) -> ConnectRequest {
    ConnectRequest {
        manager: manager.addr.to_string(),
        routes: vec![
            route("10.244.0.0/16", RouteKind::Pod),
            route("10.96.0.0/12", RouteKind::Service),
        ],
        tunnel_ip: "100.96.0.2".into(),
        tun_name: String::new(),
        mtu: 0,
        ..Default::default()
    }
}

async fn connect_and_check(ns: &Ns, socket: &Path) -> bool {
    let manager = FakeManager::start(true).await;
    let mut client = kvpn_dataplane::client::connect(socket)
        .await
        .expect("client");
    match client.connect(request(&manager)).await {
        Ok(resp) => {
            eprintln!("eBPF classifier built in: checking the whole path");
            let resp = resp.into_inner();
            assert_eq!(resp.tun_name, "kvpn0");
            let ping = ns
                .exec_async(&["ping", "-c", "2", "-i", "0.2", "-W", "2", "10.244.1.11"])
                .await;
            assert!(ping.status.success(), "ping through the daemon's TUN");
            let status = client
                .status(StatusRequest {})
                .await
                .expect("status")
                .into_inner();
            assert_eq!(status.sessions.len(), 1);
            let s = &status.sessions[0];
            assert_eq!(s.id, resp.session_id);
            assert_eq!(s.mtu, 9000);
            assert!(s.tx_packets >= 2 && s.rx_packets >= 2, "{s:?}");
            let pod = s
                .ebpf
                .iter()
                .find(|k| k.kind == RouteKind::Pod as i32)
                .expect("pod counters");
            assert!(pod.packets >= 2, "{s:?}");
            let stopped = client
                .disconnect(DisconnectRequest {
                    session_id: resp.session_id.clone(),
                })
                .await
                .expect("disconnect")
                .into_inner();
            assert_eq!(stopped.stopped, vec![resp.session_id]);
            nothing_left(ns);
            true
        }
        Err(err) => {
            eprintln!("eBPF classifier not built in: checking that Connect fails cleanly");
            assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
            let msg = err.message();
            assert!(msg.contains("attach the eBPF classifier"), "{msg}");
            assert!(msg.contains("AYA_BUILD_SKIP"), "{msg}");
            assert!(msg.contains("rolled back"), "{msg}");
            nothing_left(ns);
            false
        }
    }
}

/// UpdateRoutes through the daemon with the real eBPF classifier: a watched
/// route is installed as a kernel route (proto 107) and classifier entry (a
/// ping through it counts as pod traffic), a route a Connect route covers is
/// not, a Connect route is never removed, the route source, DNS settings and
/// Services show in Status, and Disconnect removes watched routes too.
#[test]
fn update_routes_adds_and_removes_watched_routes() {
    require_root();
    let netns = TestNetns::new();
    let ns = netns.handle();
    let dir = RuntimeDir::new(&netns);
    let mut daemon = Daemon::spawn(&netns, &dir);
    wait_for_socket(&dir, &mut daemon);
    let socket = dir.socket();
    netns.block_on(move || async move {
        use kvpn_proto::dataplane::{ClusterDns, ClusterService, RouteSource, UpdateRoutesRequest};
        let manager = FakeManager::start(true).await;
        let mut client = kvpn_dataplane::client::connect(&socket)
            .await
            .expect("client");
        let resp = match client.connect(request(&manager)).await {
            Ok(r) => r.into_inner(),
            Err(e) => {
                // Built with AYA_BUILD_SKIP: covered by the test above.
                assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
                return;
            }
        };
        let id = resp.session_id.clone();
        let unknown = client
            .update_routes(UpdateRoutesRequest {
                session_id: "nope".into(),
                ..Default::default()
            })
            .await
            .expect_err("unknown session");
        assert_eq!(unknown.code(), tonic::Code::NotFound);

        let updated = client
            .update_routes(UpdateRoutesRequest {
                session_id: id.clone(),
                add: vec![
                    route("10.77.0.0/24", RouteKind::Pod),
                    route("10.96.5.5/32", RouteKind::Service),
                ],
                remove: vec![route("10.244.0.0/16", RouteKind::Pod)],
                route_source: Some(RouteSource {
                    mode: "watch".into(),
                    ..Default::default()
                }),
                dns: Some(ClusterDns {
                    servers: vec!["10.96.0.10".into()],
                    domain: "cluster.local".into(),
                    search: vec!["default.svc.cluster.local".into()],
                    ..Default::default()
                }),
                services_replace: true,
                services_upsert: vec![ClusterService {
                    namespace: "default".into(),
                    name: "web".into(),
                    cluster_ips: vec!["10.96.0.100".into()],
                    ports: vec!["http:80/TCP".into()],
                }],
                ..Default::default()
            })
            .await
            .expect("update routes")
            .into_inner();
        assert_eq!(updated.added, vec!["10.77.0.0/24"]);
        assert_eq!(updated.covered, vec!["10.96.5.5/32"]);
        assert!(
            updated.removed.is_empty(),
            "a Connect route is never removed"
        );
        let routes = ns.kvpn_routes();
        assert!(routes.contains("10.77.0.0/24 dev kvpn0"), "{routes}");
        assert!(routes.contains("10.244.0.0/16 dev kvpn0"), "{routes}");
        assert!(!routes.contains("10.96.5.5"), "{routes}");

        let ping = ns
            .exec_async(&["ping", "-c", "2", "-i", "0.2", "-W", "2", "10.77.0.5"])
            .await;
        assert!(ping.status.success(), "ping through the watched route");
        let status = client
            .status(StatusRequest {})
            .await
            .expect("status")
            .into_inner();
        let s = &status.sessions[0];
        assert!(
            s.routes
                .iter()
                .any(|r| r.cidr == "10.77.0.0/24" && r.watched && r.kind == RouteKind::Pod as i32),
            "{s:?}"
        );
        assert_eq!(
            s.route_source.as_ref().map(|r| r.mode.as_str()),
            Some("watch")
        );
        assert_eq!(
            s.dns.as_ref().map(|d| d.servers.clone()),
            Some(vec!["10.96.0.10".to_owned()])
        );
        assert_eq!(s.services.len(), 1);
        let pod = s
            .ebpf
            .iter()
            .find(|k| k.kind == RouteKind::Pod as i32)
            .expect("pod counters");
        // No Connect entry covers 10.77.0.5: without the watched entry the pings
        // would be dropped as unrouted instead.
        assert!(pod.packets >= 2, "classified as pod traffic: {s:?}");

        let removed = client
            .update_routes(UpdateRoutesRequest {
                session_id: id.clone(),
                add: vec![route("10.78.0.0/24", RouteKind::Pod)],
                remove: vec![route("10.77.0.0/24", RouteKind::Pod)],
                ..Default::default()
            })
            .await
            .expect("update routes")
            .into_inner();
        assert_eq!(removed.removed, vec!["10.77.0.0/24"]);
        let routes = ns.kvpn_routes();
        assert!(!routes.contains("10.77.0.0/24"), "{routes}");
        assert!(routes.contains("10.78.0.0/24 dev kvpn0"), "{routes}");
        let status = client
            .status(StatusRequest {})
            .await
            .expect("status")
            .into_inner();
        assert_eq!(status.sessions[0].services.len(), 1, "services unchanged");

        client
            .disconnect(DisconnectRequest { session_id: id })
            .await
            .expect("disconnect");
        nothing_left(&ns);
    });
}
