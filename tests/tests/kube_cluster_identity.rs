//! Two clusters answering at one API server URL (k3s and kind both write
//! `https://127.0.0.1:6443`; port-forwards to several clusters) are two clusters
//! to kvpn: connect, status and uninstall tell them apart by their CA, not by the
//! URL alone.
//!
//! How one URL leads to two API servers here: two labs (the second with other
//! CIDRs, its uplink in the first lab's laptop netns) and, in the laptop netns, a
//! TCP relay on 127.0.0.1 that reads the TLS ClientHello's server name and
//! forwards to one lab's API server or the other's. Both kubeconfigs name the
//! same server URL and the same cluster and context names (as two k3s installs
//! would); only `tls-server-name` (both names are in both labs' serving
//! certificates) and the CA differ. The relay runs on threads of this test and
//! stops when it is dropped.
//!
//! Needs the workspace binaries (`cargo build --bins`, then `KVPN_BIN_DIR`) and the
//! Kubernetes binaries of `scripts/build-kubernetes.sh`.

use std::io::{Read as _, Write as _};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use kube::api::Api;
use kvpn_lab::{Addressing, WEB_SERVICE_PORT};
use kvpn_tests::kube_lab::{KubeFixture, MANAGER_NAMESPACE};
use kvpn_tests::text;

/// The server name of a TLS ClientHello (RFC 8446 4.1.2, RFC 6066 3) in
/// `record` (one whole TLS record), if it has one.
fn client_hello_sni(record: &[u8]) -> Option<String> {
    let body = record.get(5..)?;
    if record.first()? != &0x16 || body.first()? != &0x01 {
        return None;
    }
    // handshake type (1), length (3), version (2), random (32).
    let mut at = 1 + 3 + 2 + 32;
    let u8_at = |at: usize| body.get(at).map(|b| usize::from(*b));
    let u16_at = |at: usize| {
        Some(usize::from(u16::from_be_bytes([
            *body.get(at)?,
            *body.get(at + 1)?,
        ])))
    };
    at += 1 + u8_at(at)?; // session id
    at += 2 + u16_at(at)?; // cipher suites
    at += 1 + u8_at(at)?; // compression methods
    let end = at + 2 + u16_at(at)?;
    at += 2;
    while at + 4 <= end {
        let (kind, len) = (u16_at(at)?, u16_at(at + 2)?);
        at += 4;
        if kind == 0 {
            // server_name_list: length (2), then name type (1) and name (2 + n).
            let name_len = u16_at(at + 3)?;
            let name = body.get(at + 5..at + 5 + name_len)?;
            return String::from_utf8(name.to_vec()).ok();
        }
        at += len;
    }
    None
}

/// A relay on 127.0.0.1 in the laptop netns: a connection whose ClientHello asks
/// for server name `name` goes to `backends[name]` (an API server, dialled from
/// this test's netns), anything else is closed.
struct SniRelay {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    routed: Arc<std::sync::Mutex<Vec<String>>>,
}

impl SniRelay {
    fn start(f: &KubeFixture, backends: Vec<(String, SocketAddr)>) -> Self {
        let listener = f
            .lab()
            .netns_lab()
            .run_in(kvpn_lab::LAPTOP, || TcpListener::bind("127.0.0.1:0"))
            .unwrap_or_else(|e| panic!("laptop netns: {e:#}"))
            .unwrap_or_else(|e| panic!("relay listener: {e}"));
        let addr = listener.local_addr().expect("relay address");
        listener
            .set_nonblocking(true)
            .expect("nonblocking listener");
        let stop = Arc::new(AtomicBool::new(false));
        let routed = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (stop2, routed2) = (stop.clone(), routed.clone());
        std::thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        let backends = backends.clone();
                        let routed = routed2.clone();
                        std::thread::spawn(move || relay(conn, &backends, &routed));
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    Err(e) => {
                        eprintln!("relay accept: {e}");
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            }
        });
        SniRelay { addr, stop, routed }
    }
}

impl Drop for SniRelay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// One relayed connection: read the first TLS record, pick the backend by its
/// server name, then copy both ways until either side closes.
fn relay(
    mut conn: TcpStream,
    backends: &[(String, SocketAddr)],
    routed: &std::sync::Mutex<Vec<String>>,
) {
    let _ = conn.set_nonblocking(false);
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let mut first = Vec::new();
    let mut buf = [0u8; 4096];
    let need = |b: &[u8]| {
        b.get(3..5)
            .map(|l| 5 + usize::from(u16::from_be_bytes([l[0], l[1]])))
    };
    while need(&first).is_none_or(|n| first.len() < n) {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => first.extend_from_slice(&buf[..n]),
        }
    }
    let _ = conn.set_read_timeout(None);
    let Some(name) = client_hello_sni(&first) else {
        eprintln!("relay: a connection without a server name");
        return;
    };
    let Some((_, to)) = backends.iter().find(|(n, _)| *n == name) else {
        eprintln!("relay: no backend for server name {name}");
        return;
    };
    let Ok(mut up) = TcpStream::connect_timeout(to, Duration::from_secs(5)) else {
        eprintln!("relay: cannot reach {to}");
        return;
    };
    if let Ok(mut r) = routed.lock() {
        r.push(name.clone());
    }
    let _ = up.set_nodelay(true);
    let _ = conn.set_nodelay(true);
    if up.write_all(&first).is_err() {
        return;
    }
    let (Ok(mut up_r), Ok(mut conn_w)) = (up.try_clone(), conn.try_clone()) else {
        return;
    };
    let back = std::thread::spawn(move || {
        let _ = std::io::copy(&mut up_r, &mut conn_w);
        let _ = conn_w.shutdown(Shutdown::Write);
    });
    let _ = std::io::copy(&mut conn, &mut up);
    let _ = up.shutdown(Shutdown::Write);
    let _ = back.join();
}

/// A copy of the lab kubeconfig `from` whose server is `server`, whose TLS
/// server name is `sni` and whose cluster is named `cluster` (the context and
/// user keep theirs, with the cluster name in them replaced the same way).
fn same_url_kubeconfig(from: &Path, to: PathBuf, server: &str, sni: &str, cluster: &str) -> String {
    let kc = std::fs::read_to_string(from).unwrap_or_else(|e| panic!("{}: {e}", from.display()));
    let old_cluster = kc
        .lines()
        .skip_while(|l| l.trim() != "clusters:")
        .find_map(|l| l.trim().strip_prefix("- name: "))
        .map(|s| s.trim_matches('"').to_owned())
        .unwrap_or_else(|| panic!("no cluster name in {kc}"));
    let mut out = String::new();
    for line in kc.lines() {
        if let Some(indent) = line.strip_suffix(line.trim_start())
            && line.trim_start().starts_with("server: ")
        {
            out.push_str(&format!(
                "{indent}server: \"{server}\"\n{indent}tls-server-name: \"{sni}\"\n"
            ));
        } else {
            // Names only (quoted, alone or after `user@`), not the paths that
            // contain the lab's name.
            out.push_str(
                &line
                    .replace(&format!("\"{old_cluster}\""), &format!("\"{cluster}\""))
                    .replace(&format!("@{old_cluster}\""), &format!("@{cluster}\"")),
            );
            out.push('\n');
        }
    }
    std::fs::write(&to, &out).unwrap_or_else(|e| panic!("{}: {e}", to.display()));
    to.to_string_lossy().into_owned()
}

fn session_by_id(f: &KubeFixture, id: &str) -> serde_json::Value {
    f.sessions()
        .into_iter()
        .find(|s| s["id"] == id)
        .unwrap_or_else(|| panic!("no session {id}: {:#?}", f.sessions()))
}

fn wait_connected(f: &KubeFixture, n: usize, within: Duration) -> Vec<serde_json::Value> {
    let t0 = Instant::now();
    loop {
        let sessions = f.sessions();
        if sessions.len() == n && sessions.iter().all(|s| s["state"] == "connected") {
            return sessions;
        }
        assert!(
            t0.elapsed() < within,
            "not {n} connected sessions within {within:?}: {sessions:#?}\n{}",
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn curl_ok(f: &KubeFixture, ip: std::net::Ipv4Addr) -> bool {
    let url = format!("http://{ip}:{WEB_SERVICE_PORT}/");
    let out = f.laptop(&["curl", "-sS", "--max-time", "5", &url]);
    out.status.success() && text(&out.stdout).contains("kvpn-lab-server")
}

#[test]
fn two_clusters_at_one_url_are_told_apart_by_their_ca() {
    let mut f = KubeFixture::new();
    let b = f.add_cluster(Addressing::second());
    let (a_addr, b_addr) = (Addressing::default(), Addressing::second());
    // The relay dials each API server at its host-netns address (the admin
    // client's); the name decides which, as SNI routing in a real proxy would.
    let relay = SniRelay::start(
        &f,
        vec![
            ("kubernetes".to_owned(), f.lab().state().apiserver),
            (
                "kubernetes.default".to_owned(),
                f.cluster(b).state().apiserver,
            ),
        ],
    );
    let url = format!("https://127.0.0.1:{}", relay.addr.port());
    let dir = f.lab().netns_lab().dir().to_path_buf();
    let kc_a = same_url_kubeconfig(
        f.lab().laptop_user_kubeconfig(),
        dir.join("same-url-a.kubeconfig"),
        &url,
        "kubernetes",
        "kvpn-same",
    );
    let kc_b = same_url_kubeconfig(
        f.cluster(b).laptop_user_kubeconfig(),
        dir.join("same-url-b.kubeconfig"),
        &url,
        "kubernetes.default",
        "kvpn-same",
    );

    let out_a = f.kvpn_ok(&["connect", "--kubeconfig", &kc_a]);
    assert!(out_a.contains("Installing traffic manager"), "{out_a}");
    let out_b = f.kvpn_ok(&["connect", "--kubeconfig", &kc_b]);
    assert!(
        out_b.contains("Installing traffic manager") && !out_b.contains("Already connected"),
        "cluster B at the same URL gets its own manager and session: {out_b}"
    );
    let routed = relay.routed.lock().map(|r| r.clone()).unwrap_or_default();
    assert!(
        routed.iter().any(|n| n == "kubernetes")
            && routed.iter().any(|n| n == "kubernetes.default"),
        "both API servers were reached through the relay: {routed:?}"
    );
    let sessions = wait_connected(&f, 2, Duration::from_secs(30));
    for s in &sessions {
        assert_eq!(s["server"], url.as_str(), "{s:#}");
        assert_eq!(s["cluster"], "kvpn-same", "{s:#}");
    }
    let id_of_tun = |tun: &str| {
        sessions
            .iter()
            .find(|s| s["tun_name"] == tun)
            .unwrap_or_else(|| panic!("no session on {tun}: {sessions:#?}"))
            .clone()
    };
    let (sa, sb) = (id_of_tun("kvpn0"), id_of_tun("kvpn1"));
    let (ca_a, ca_b) = (
        sa["cluster_id"].as_str().unwrap_or_default().to_owned(),
        sb["cluster_id"].as_str().unwrap_or_default().to_owned(),
    );
    assert!(
        ca_a.starts_with("ca-sha256:") && ca_b.starts_with("ca-sha256:") && ca_a != ca_b,
        "each session carries its cluster's CA digest: {ca_a} / {ca_b}"
    );
    let table = f.kvpn_ok(&["status"]);
    for ca in [&ca_a, &ca_b] {
        let short = &ca["ca-sha256:".len().."ca-sha256:".len() + 12];
        assert!(
            table.contains(&format!("CA sha256 {short}")),
            "status names each CA: {table}"
        );
    }
    let id_a = sa["id"].as_str().unwrap_or_default().to_owned();
    let id_b = sb["id"].as_str().unwrap_or_default().to_owned();
    assert!(curl_ok(&f, a_addr.web_cluster_ip()), "A's web Service");
    assert!(curl_ok(&f, b_addr.web_cluster_ip()), "B's web Service");

    // Connect is still idempotent per cluster: A again finds A's session.
    let again = f.kvpn_ok(&["connect", "--kubeconfig", &kc_a]);
    assert!(
        again.contains("Already connected") && again.contains(&id_a) && !again.contains(&id_b),
        "{again}"
    );

    // Uninstall from B ends B's session only, and removes B's manager only.
    let un = f.kvpn_ok(&["uninstall", "--kubeconfig", &kc_b]);
    assert!(
        un.contains(&format!("Disconnected session {id_b}")) && !un.contains(&id_a),
        "uninstall of B names B's session alone: {un}"
    );
    assert!(
        !un.contains("nothing to remove"),
        "B's manager was there: {un}"
    );
    let left = f.sessions();
    assert_eq!(left.len(), 1, "{left:#?}");
    assert_eq!(left[0]["id"], id_a.as_str(), "A's session stays");
    assert_eq!(session_by_id(&f, &id_a)["state"], "connected");
    assert!(curl_ok(&f, a_addr.web_cluster_ip()), "A still answers");
    let deployments = |lab: &kvpn_lab::k8s::K8sLab| {
        let client = f
            .block_on(lab.admin_client())
            .unwrap_or_else(|e| panic!("admin client: {e}"));
        let api: Api<Deployment> = Api::namespaced(client, MANAGER_NAMESPACE);
        f.block_on(api.get_opt("kvpn-manager"))
            .unwrap_or_else(|e| panic!("get deployment: {e}"))
            .is_some()
    };
    assert!(deployments(f.lab()), "A's manager stays installed");
    assert!(!deployments(f.cluster(b)), "B's manager is removed");
    drop(relay);
}
