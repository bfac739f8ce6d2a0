//! Leases end to end on the Kubernetes lab (tr-11, [kube-connect] item 4): the
//! traffic manager pod stores leases as Lease objects (in-cluster API access
//! with its service account), `kvpn connect` gets its tunnel IP from `Lease`,
//! and a reconnecting laptop gets its old IP back.
//!
//! tr-11 (20 clients at the same moment): after one `kvpn connect` installed the
//! manager, 20 lightweight clients in the laptop netns each lease a tunnel IP
//! (the CLI's own lease code, through a port-forward with the restricted
//! kubeconfig), open the TLS data channel through another port-forward, send
//! the hello and ping a backend pod from their tunnel IP with raw ICMP echo
//! frames. No TUN device per client: the frames are what a session's pump sends.
//!
//! Two laptop netns on one lab reaching each other's tunnel IPs: kube_multi.rs
//! (and in process: manager/tests/leases.rs).

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use kube::api::Api;
use kvpn_lab::LAPTOP;
use kvpn_tests::kube_lab::{KubeFixture, MANAGER_NAMESPACE, pod_ip, pod_name, web};

fn stored_leases(f: &KubeFixture) -> serde_json::Value {
    serde_json::Value::Array(f.stored_leases())
}

#[test]
fn leased_tunnel_ip_is_stored_in_a_lease_object_and_comes_back_on_reconnect() {
    let f = KubeFixture::new();
    let out = f.connect_restricted();
    assert!(out.contains("Leasing a tunnel IP"), "{out}");
    f.wait_state("connected", Duration::from_secs(15));
    let ip = f.session()["tunnel_ip"]
        .as_str()
        .unwrap_or_else(|| panic!("no tunnel IP"))
        .to_owned();
    assert!(ip.starts_with("100.96."), "{ip}");
    assert!(
        f.laptop_routes()
            .iter()
            .any(|r| r.starts_with("100.96.0.0/16")),
        "tunnel pool routed into the TUN: {:?}",
        f.laptop_routes()
    );
    // Traffic flows, so the hello's token was accepted.
    f.wait_http(web(), std::time::Instant::now(), Duration::from_secs(10));

    let leases = stored_leases(&f);
    let mine: Vec<_> = leases
        .as_array()
        .unwrap_or_else(|| panic!("a list: {leases}"))
        .iter()
        .filter(|l| l["ip"] == ip.as_str())
        .collect();
    assert_eq!(mine.len(), 1, "a Lease object holds the lease: {leases}");
    let token = mine[0]["token"].as_str().unwrap_or_default().to_owned();
    assert_eq!(token.len(), 64);

    f.kvpn_ok(&["disconnect", "--all"]);
    f.connect_restricted();
    f.wait_state("connected", Duration::from_secs(15));
    assert_eq!(
        f.session()["tunnel_ip"],
        ip.as_str(),
        "same client id, same IP"
    );
    f.wait_http(web(), std::time::Instant::now(), Duration::from_secs(10));
    let again = stored_leases(&f);
    assert_eq!(
        again.as_array().map(Vec::len),
        Some(1),
        "one lease, reused: {again}"
    );
    assert_eq!(
        again[0]["token"],
        token.as_str(),
        "the live lease keeps its token"
    );

    // The installed manager counts on GET /metrics (pod loopback :10803, reached
    // by port-forward like its gRPC port): two connects, no refusal.
    let metrics = manager_metrics(&f);
    let value = |name: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing in\n{metrics}"))
    };
    assert!(value("kvpn_manager_leases_granted_total") >= 2, "{metrics}");
    assert!(
        value("kvpn_manager_sessions_accepted_total") >= 2,
        "{metrics}"
    );
    assert!(value("kvpn_manager_sessions_active") >= 1, "{metrics}");
    for reason in ["wrong_token", "no_lease", "tls"] {
        assert_eq!(
            value(&format!(
                "kvpn_manager_refused_hello_total{{reason=\"{reason}\"}}"
            )),
            0,
            "{metrics}"
        );
    }
}

/// `GET /metrics` of the manager pod, through a port-forward to its loopback port.
fn manager_metrics(f: &KubeFixture) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let pod = pod_name(&f.wait_manager_pod(Duration::from_secs(30), |_| true));
    let port = kvpn_control::install::objects::METRICS_PORT;
    let api: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    f.block_on(async {
        let mut pf = api
            .portforward(&pod, &[port])
            .await
            .unwrap_or_else(|e| panic!("port-forward to {pod}:{port}: {e}"));
        let mut s = pf
            .take_stream(port)
            .unwrap_or_else(|| panic!("no port-forward stream"));
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: kvpn-manager\r\n\r\n")
            .await
            .unwrap_or_else(|e| panic!("metrics request: {e}"));
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
            .await
            .unwrap_or_else(|_| panic!("no metrics answer within 10 s"))
            .unwrap_or_else(|e| panic!("metrics answer: {e}"));
        pf.abort();
        let text = String::from_utf8_lossy(&out).into_owned();
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        text
    })
}

/// Clients that connect at the same moment (case tr-11).
const CLIENTS: usize = 20;

#[test]
fn tr_11_twenty_parallel_clients_get_unique_leases() {
    let f = KubeFixture::new();
    f.connect_restricted();
    f.wait_state("connected", Duration::from_secs(15));
    let cli_ip = f.session()["tunnel_ip"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let manager = f.wait_manager_pod(Duration::from_secs(30), |_| true);
    let pod = pod_name(&manager);
    let backend = f
        .pods("default", "app=web")
        .first()
        .map(pod_ip)
        .unwrap_or_else(|| panic!("no web backend pod"));
    let IpAddr::V4(backend) = backend else {
        panic!("IPv4 backend expected: {backend}")
    };
    let material = f
        .block_on(kvpn_control::install::read_tls(
            &f.admin(),
            MANAGER_NAMESPACE,
        ))
        .unwrap_or_else(|e| panic!("read the manager's TLS Secret: {e}"))
        .unwrap_or_else(|| panic!("no TLS Secret"));
    let tls = kvpn_dataplane::tls::TlsClient::new(
        material.ca_pem.as_bytes(),
        &kvpn_control::install::objects::server_name(MANAGER_NAMESPACE),
    )
    .unwrap_or_else(|e| panic!("TLS client: {e}"));
    let kubeconfig = std::path::PathBuf::from(f.user_kubeconfig());
    let lab_id = f.lab().netns_lab().id().to_owned();

    let report = f
        .lab()
        .netns_lab()
        .run_in(LAPTOP, move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap_or_else(|e| panic!("tokio runtime: {e}"));
            rt.block_on(twenty_clients(kubeconfig, pod, tls, backend, lab_id))
        })
        .unwrap_or_else(|e| panic!("laptop netns: {e:#}"));

    let ips: BTreeSet<Ipv4Addr> = report.ips.iter().copied().collect();
    assert_eq!(
        ips.len(),
        CLIENTS,
        "{CLIENTS} distinct tunnel IPs: {:?}",
        report.ips
    );
    assert!(
        !ips.iter().any(|ip| ip.to_string() == cli_ip),
        "none collides with the CLI session's {cli_ip}: {ips:?}"
    );
    assert!(
        ips.iter().all(|ip| ip.octets()[..2] == [100, 96]),
        "all from the pool 100.96.0.0/16: {ips:?}"
    );
    assert_eq!(report.replies, CLIENTS * 2, "every client pinged twice");
    assert_eq!(
        report.reconnected_ip, report.ips[0],
        "same client id, same IP"
    );
    // Stored with optimistic concurrency: 21 leases (the CLI's and the 20), no
    // update lost, no IP twice.
    let stored = stored_leases(&f);
    let stored_ips: BTreeSet<&str> = stored
        .as_array()
        .unwrap_or_else(|| panic!("a list: {stored}"))
        .iter()
        .filter_map(|l| l["ip"].as_str())
        .collect();
    assert_eq!(stored_ips.len(), CLIENTS + 1, "{stored}");
    assert_eq!(
        stored.as_array().map(Vec::len),
        Some(CLIENTS + 1),
        "{stored}"
    );
    assert!(stored_ips.contains(cli_ip.as_str()), "{stored}");
    eprintln!(
        "tr-11: {CLIENTS} clients leased, opened TLS data channels and pinged {backend} in {:.2} s \
         (slowest client {:.2} s); second round of pings with all open {:.2} s; \
         reconnect of one client {:.2} s; IPs {:?}",
        report.connect_wall.as_secs_f64(),
        report.slowest.as_secs_f64(),
        report.second_round.as_secs_f64(),
        report.reconnect.as_secs_f64(),
        report.ips
    );
    // The CLI's own session was not disturbed.
    f.wait_http(web(), std::time::Instant::now(), Duration::from_secs(10));
}

struct Report {
    ips: Vec<Ipv4Addr>,
    replies: usize,
    connect_wall: Duration,
    slowest: Duration,
    second_round: Duration,
    reconnect: Duration,
    reconnected_ip: Ipv4Addr,
}

/// Runs inside the laptop netns: 20 clients start at the same moment (a
/// barrier), each leases, opens its data channel and pings `backend`; then all,
/// still open, ping again; then client 0 reconnects with its client id.
async fn twenty_clients(
    kubeconfig: std::path::PathBuf,
    pod: String,
    tls: kvpn_dataplane::tls::TlsClient,
    backend: Ipv4Addr,
    lab_id: String,
) -> Report {
    let flags = kvpn_control::kubeconfig::KubeFlags {
        kubeconfig: Some(kubeconfig),
        context: None,
        namespace: None,
    };
    let env =
        kvpn_control::kubeconfig::UserEnv::current().unwrap_or_else(|e| panic!("environment: {e}"));
    let kube = kvpn_control::kubeconfig::connect(&flags, &env)
        .await
        .unwrap_or_else(|e| panic!("restricted kubeconfig: {e}"))
        .client;
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(CLIENTS));
    let t0 = std::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..CLIENTS {
        let (kube, pod, tls, barrier) = (kube.clone(), pod.clone(), tls.clone(), barrier.clone());
        let id = format!("tr11-client-{i:02}-{lab_id}");
        tasks.spawn(async move {
            barrier.wait().await;
            let started = std::time::Instant::now();
            let mut c = light::open(&kube, &pod, &tls, &id).await?;
            c.ping(backend, 0x1100 + i as u16, 1).await?;
            Ok::<_, String>((i, c, started.elapsed()))
        });
    }
    let mut clients: Vec<Option<light::Client>> = (0..CLIENTS).map(|_| None).collect();
    let mut slowest = Duration::ZERO;
    let mut errors = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok((i, c, took))) => {
                slowest = slowest.max(took);
                clients[i] = Some(c);
            }
            Ok(Err(e)) => errors.push(e),
            Err(e) => errors.push(format!("client task: {e}")),
        }
    }
    assert!(errors.is_empty(), "clients failed: {errors:#?}");
    let connect_wall = t0.elapsed();
    let mut clients: Vec<light::Client> = clients.into_iter().flatten().collect();
    let ips: Vec<Ipv4Addr> = clients.iter().map(|c| c.ip).collect();

    // All 20 sessions open at once: each still gets its own replies.
    let t1 = std::time::Instant::now();
    let pings = clients
        .iter_mut()
        .enumerate()
        .map(|(i, c)| c.ping(backend, 0x1100 + i as u16, 2));
    let results = futures::future::join_all(pings).await;
    let second_round = t1.elapsed();
    let failed: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(failed.is_empty(), "second round: {failed:#?}");
    let replies = 2 * results.len();

    // Client 0 goes away and comes back with the same client id.
    let first = clients.remove(0);
    let id = first.id.clone();
    drop(first);
    let t2 = std::time::Instant::now();
    let mut again = light::open(&kube, &pod, &tls, &id)
        .await
        .unwrap_or_else(|e| panic!("reconnect: {e}"));
    again
        .ping(backend, 0x1100, 3)
        .await
        .unwrap_or_else(|e| panic!("ping after reconnect: {e}"));
    Report {
        ips,
        replies,
        connect_wall,
        slowest,
        second_round,
        reconnect: t2.elapsed(),
        reconnected_ip: again.ip,
    }
}

/// Lightweight tr-11 clients: lease, data channel, ICMP echo.
mod light {
    use std::net::{IpAddr, Ipv4Addr};
    use std::time::{Duration, Instant};

    use k8s_openapi::api::core::v1::Pod;
    use kube::Api;
    use kube::api::Portforwarder;
    use kvpn_control::agent::MANAGER_DATA_PORT;
    use kvpn_control::install::objects::GRPC_PORT;
    use kvpn_dataplane::tls::TlsClient;
    use kvpn_proto::frame::{self, Decoder, Kind};
    use smoltcp::phy::ChecksumCapabilities;
    use smoltcp::wire::{Icmpv4Packet, Icmpv4Repr, IpProtocol, Ipv4Packet, Ipv4Repr};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, DuplexStream};
    use tokio_rustls::client::TlsStream;

    use super::MANAGER_NAMESPACE;

    /// One lightweight client with its data channel open.
    pub struct Client {
        pub id: String,
        pub ip: Ipv4Addr,
        /// Kept so the port-forward lives as long as the client.
        _pf: Portforwarder,
        tls: TlsStream<DuplexStream>,
        buf: Vec<u8>,
    }

    /// Lease a tunnel IP for `id` from manager pod `pod`, open the data channel
    /// and send the hello.
    pub async fn open(
        kube: &kube::Client,
        pod: &str,
        tls: &TlsClient,
        id: &str,
    ) -> Result<Client, String> {
        let leased = kvpn_control::lease::lease(kube, MANAGER_NAMESPACE, pod, GRPC_PORT, id)
            .await
            .map_err(|e| format!("{id}: lease: {e:#}"))?;
        let ip: Ipv4Addr = leased
            .tunnel_ip
            .parse()
            .map_err(|e| format!("{id}: leased IP {:?}: {e}", leased.tunnel_ip))?;
        let api: Api<Pod> = Api::namespaced(kube.clone(), MANAGER_NAMESPACE);
        let mut pf = api
            .portforward(pod, &[MANAGER_DATA_PORT])
            .await
            .map_err(|e| format!("{id}: port-forward to {pod}: {e}"))?;
        let stream = pf
            .take_stream(MANAGER_DATA_PORT)
            .ok_or_else(|| format!("{id}: no port-forward stream"))?;
        let mut tls_stream = tls
            .handshake(stream, &format!("pod {pod} port {MANAGER_DATA_PORT}"))
            .await
            .map_err(|e| format!("{id}: {e}"))?;
        let hello =
            kvpn_dataplane::session::hello_frame(IpAddr::V4(ip), leased.session_token.as_bytes())
                .map_err(|e| format!("{id}: hello: {e}"))?;
        tls_stream
            .write_all(&hello)
            .await
            .map_err(|e| format!("{id}: send hello: {e}"))?;
        Ok(Client {
            id: id.to_owned(),
            ip,
            _pf: pf,
            tls: tls_stream,
            buf: Vec::new(),
        })
    }

    /// An ICMP echo request from `src` to `dst`.
    pub fn echo_request(src: Ipv4Addr, dst: Ipv4Addr, ident: u16, seq_no: u16) -> Vec<u8> {
        let data = b"kvpn tr-11";
        let icmp = Icmpv4Repr::EchoRequest {
            ident,
            seq_no,
            data,
        };
        let ip = Ipv4Repr {
            src_addr: src,
            dst_addr: dst,
            next_header: IpProtocol::Icmp,
            payload_len: icmp.buffer_len(),
            hop_limit: 64,
        };
        let mut buf = vec![0u8; 20 + icmp.buffer_len()];
        let caps = ChecksumCapabilities::default();
        let mut p = Ipv4Packet::new_unchecked(&mut buf[..]);
        ip.emit(&mut p, &caps);
        icmp.emit(&mut Icmpv4Packet::new_unchecked(p.payload_mut()), &caps);
        buf
    }

    impl Client {
        /// Ping `dst` through the manager; the round-trip time. Frames other
        /// than the matching echo reply are skipped.
        pub async fn ping(
            &mut self,
            dst: Ipv4Addr,
            ident: u16,
            seq_no: u16,
        ) -> Result<Duration, String> {
            let id = self.id.clone();
            let mut out = Vec::new();
            frame::encode_into(
                Kind::Packet,
                &echo_request(self.ip, dst, ident, seq_no),
                &mut out,
            )
            .map_err(|e| format!("{id}: frame: {e}"))?;
            let t0 = Instant::now();
            self.tls
                .write_all(&out)
                .await
                .map_err(|e| format!("{id}: send echo request: {e}"))?;
            self.tls
                .flush()
                .await
                .map_err(|e| format!("{id}: flush: {e}"))?;
            let wait = async {
                loop {
                    while let Some((f, used)) = Decoder::default()
                        .decode(&self.buf)
                        .map_err(|e| format!("{id}: bad frame from the manager: {e}"))?
                    {
                        let hit = f.kind == Kind::Packet
                            && is_reply(f.payload, dst, self.ip, ident, seq_no);
                        self.buf.drain(..used);
                        if hit {
                            return Ok(t0.elapsed());
                        }
                    }
                    let mut chunk = [0u8; 16 * 1024];
                    let n = self
                        .tls
                        .read(&mut chunk)
                        .await
                        .map_err(|e| format!("{id}: read: {e}"))?;
                    if n == 0 {
                        return Err(format!("{id}: the manager closed the data channel"));
                    }
                    self.buf.extend_from_slice(&chunk[..n]);
                }
            };
            tokio::time::timeout(Duration::from_secs(10), wait)
                .await
                .map_err(|_| format!("{id}: no echo reply from {dst} within 10 s"))?
        }
    }

    fn is_reply(packet: &[u8], from: Ipv4Addr, to: Ipv4Addr, ident: u16, seq_no: u16) -> bool {
        let Ok(ip) = Ipv4Packet::new_checked(packet) else {
            return false;
        };
        if ip.src_addr() != from || ip.dst_addr() != to || ip.next_header() != IpProtocol::Icmp {
            return false;
        }
        let Ok(icmp) = Icmpv4Packet::new_checked(ip.payload()) else {
            return false;
        };
        matches!(
            Icmpv4Repr::parse(&icmp, &ChecksumCapabilities::default()),
            Ok(Icmpv4Repr::EchoReply { ident: i, seq_no: s, .. }) if i == ident && s == seq_no
        )
    }
}
