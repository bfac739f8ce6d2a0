//! `kvpn-manager tunnel` and `kvpn-manager tunnel-wait`: the tunnel container
//! that `kvpn attach` adds to a workload's pods (docs/attach.md). It runs from
//! the manager's own image, so an attach needs no second image.
//!
//! `tunnel` leases this replica's own tunnel IP on the manager's attach port
//! (gRPC over TLS, the attach key in metadata; client id derived from the pod
//! UID, so a restarted container gets the same lease back), opens a data
//! channel to the manager (TLS, hello with the lease's token), and only then
//! creates the TUN device in the pod's network namespace with the tunnel IP and
//! the pool's prefix, so the kernel's connected route sends exactly the
//! developers' tunnel range into it. Then it pumps packets both ways and sends
//! a heartbeat every [`HEARTBEAT`]. Any failure ends the process: the kubelet
//! restarts the container (and runs its postStart hook or startup probe
//! again), which is the re-dial.
//!
//! `tunnel-wait` blocks until the TUN device exists (that is: the data channel
//! is up), for the classic sidecar's postStart hook and the native sidecar's
//! startup probe.
//!
//! Why this is not the laptop's client code (`kvpn_dataplane::session`): the
//! manager crate must not depend on the dataplane crate (docs/architecture.md),
//! and the pod needs none of the laptop's batching, offloads, workers or
//! resume; the frame codec and hello are the shared `kvpn_proto::frame`.
//!
//! I/O: files under the mounted Secret, TCP/TLS to the manager's Service, the
//! TUN device, `/dev/net/tun`.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use clap::{Parser, Subcommand};
use hyper_util::rt::TokioIo;
use kvpn_proto::frame::{self, Decoder, Hello, Kind, PROTOCOL_VERSION};
use kvpn_proto::manager::LeaseRequest;
use kvpn_proto::manager::manager_client::ManagerClient;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tracing::{info, warn};

/// Heartbeat interval: well inside the manager's 60 s idle timeout.
const HEARTBEAT: Duration = Duration::from_secs(5);

/// Bound of each step towards the manager (TCP connect, TLS, lease).
const STEP_TIMEOUT: Duration = Duration::from_secs(10);

/// Frames queued towards the manager before the TUN reader waits.
const OUT_QUEUE: usize = 256;

#[derive(Debug, Parser)]
#[command(name = "kvpn-manager", about = "tunnel container of an attached pod")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Lease a tunnel IP, open the data channel and carry the pod's tunnel
    /// range through a TUN device (runs until the channel fails).
    Tunnel(TunnelArgs),
    /// Wait until the tunnel's TUN device exists (postStart hook, startup probe).
    TunnelWait(WaitArgs),
    /// Steer the tunnel pool to the manager's gateway (`kvpn attach --via
    /// gateway`'s init container): a VXLAN device towards the manager
    /// Service, a permanent next hop and the pool's route, then exit.
    GatewayRoute(GatewayArgs),
    /// `kvpn attach check leak`'s probe: from its first moment, send numbered
    /// UDP datagrams (sequence number, microseconds since the process
    /// started) to the laptop, then exit.
    ProbeSend(ProbeArgs),
}

#[derive(Debug, clap::Args)]
struct ProbeArgs {
    /// The laptop's tunnel IP and the check's port.
    #[arg(long)]
    to: std::net::SocketAddr,
    /// Datagrams to send.
    #[arg(long, default_value_t = 300)]
    count: u32,
    /// Milliseconds between datagrams.
    #[arg(long, default_value_t = 10)]
    interval_ms: u64,
}

#[derive(Debug, clap::Args)]
struct GatewayArgs {
    /// The manager Service's address (its ClusterIP).
    #[arg(long, env = "KVPN_MANAGER_HOST")]
    manager_host: Ipv4Addr,
    /// The manager's gateway port (UDP), also this pod's VXLAN port.
    #[arg(long, default_value_t = kvpn_proto::attach::GATEWAY_PORT)]
    gateway_port: u16,
    /// The developers' tunnel range, routed to the gateway.
    #[arg(long, default_value = "100.96.0.0/16")]
    pool: ipnet::Ipv4Net,
    /// The VXLAN device's name in the pod.
    #[arg(long, default_value = "kvpn-gw")]
    device: String,
}

#[derive(Debug, clap::Args)]
struct TunnelArgs {
    /// The manager Service's address (its ClusterIP).
    #[arg(long, env = "KVPN_MANAGER_HOST")]
    manager_host: IpAddr,
    /// The manager's data port.
    #[arg(long, default_value_t = 10801)]
    data_port: u16,
    /// The manager's attach port.
    #[arg(long, default_value_t = kvpn_proto::attach::ATTACH_PORT)]
    attach_port: u16,
    /// The name the manager's certificate is verified against.
    #[arg(long, env = "KVPN_SERVER_NAME")]
    server_name: String,
    /// Folder of the attach Secret (ca.crt, attach.key).
    #[arg(long, default_value = "/etc/kvpn/attach")]
    secret_dir: PathBuf,
    /// This pod's UID (downward API): the replica's identity.
    #[arg(long, env = "KVPN_POD_UID")]
    pod_uid: String,
    /// The TUN device's name in the pod.
    #[arg(long, default_value = "kvpn0")]
    tun: String,
    /// The TUN device's MTU in bytes (the manager fragments to it).
    #[arg(long, default_value_t = 1400)]
    mtu: u16,
}

#[derive(Debug, clap::Args)]
struct WaitArgs {
    /// The TUN device's name in the pod.
    #[arg(long, default_value = "kvpn0")]
    tun: String,
    /// Give up after this many seconds (exit status 1).
    #[arg(long, default_value_t = 60)]
    timeout_s: u64,
}

/// Entry point for `kvpn-manager tunnel …` / `tunnel-wait …` (`args` without
/// the program name).
pub fn main_from_args(args: impl Iterator<Item = String>) -> anyhow::Result<()> {
    let cli = Cli::parse_from(std::iter::once("kvpn-manager".to_owned()).chain(args));
    match cli.cmd {
        Cmd::TunnelWait(w) => wait(&w),
        Cmd::ProbeSend(p) => probe_send(&p),
        Cmd::GatewayRoute(g) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the tokio runtime")?
            .block_on(gateway_route(&g)),
        Cmd::Tunnel(t) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the tokio runtime")?
            .block_on(run(t)),
    }
}

/// `probe-send`: numbered datagrams from the process's first moment. A send
/// that fails (no route yet) counts as sent and lost.
fn probe_send(p: &ProbeArgs) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let bind: std::net::SocketAddr = if p.to.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = std::net::UdpSocket::bind(bind).context("cannot open a UDP socket")?;
    let mut failed = 0u32;
    for seq in 0..p.count {
        let us = t0.elapsed().as_micros();
        let msg = format!("kvpn-probe {seq} {us}");
        if socket.send_to(msg.as_bytes(), p.to).is_err() {
            failed += 1;
        }
        std::thread::sleep(Duration::from_millis(p.interval_ms));
    }
    // The check reads this line from the container's log.
    let mut out = std::io::stdout();
    std::io::Write::write_fmt(
        &mut out,
        format_args!(
            "sent {} datagrams to {}, {failed} refused by the kernel\n",
            p.count, p.to
        ),
    )
    .context("cannot write the probe's summary")?;
    Ok(())
}

/// The init container of `kvpn attach --via gateway`: kernel state only.
async fn gateway_route(g: &GatewayArgs) -> anyhow::Result<()> {
    use futures::TryStreamExt as _;
    use rtnetlink::packet_route::neighbour::NeighbourState;
    use rtnetlink::packet_route::route::RouteFlags;
    use rtnetlink::{LinkUnspec, LinkVxlan, RouteMessageBuilder};

    let (connection, handle, _) =
        rtnetlink::new_connection().context("cannot open a NETLINK_ROUTE socket")?;
    tokio::spawn(connection);
    // A re-run in the same network namespace (the kubelet retried the init
    // container) starts over.
    let mut found = handle.link().get().match_name(g.device.clone()).execute();
    if let Ok(Some(old)) = found.try_next().await {
        handle
            .link()
            .del(old.header.index)
            .execute()
            .await
            .with_context(|| format!("cannot delete the old {} device", g.device))?;
    }
    let port = g.gateway_port;
    let vxlan = LinkVxlan::new(&g.device, kvpn_proto::attach::GATEWAY_VNI)
        .remote(g.manager_host)
        .port(port)
        // Source port = destination port: the manager's replies (through the
        // Service's conntrack) come back to this device's own socket.
        .port_range(port, port.saturating_add(1))
        .learning(false)
        // No outer UDP checksum (RFC 7348 allows zero over IPv4): measured on
        // the real-node lab, checksummed datagrams reached the manager pod
        // with bad checksums after the Service's DNAT (its /proc/net/snmp:
        // InCsumErrors 60 of 80) and were dropped by its kernel.
        .udp_csum(false)
        .up()
        .build();
    handle.link().add(vxlan).execute().await.with_context(|| {
        format!(
            "cannot create the VXLAN device {} (needs NET_ADMIN and a kernel with VXLAN)",
            g.device
        )
    })?;
    let mut found = handle.link().get().match_name(g.device.clone()).execute();
    let index = found
        .try_next()
        .await
        .with_context(|| format!("cannot read the {} device", g.device))?
        .with_context(|| format!("the {} device vanished after it was created", g.device))?
        .header
        .index;
    handle
        .link()
        .set(LinkUnspec::new_with_index(index).up().build())
        .execute()
        .await
        .with_context(|| format!("cannot set {} up", g.device))?;
    let hop = kvpn_proto::attach::GATEWAY_NEXT_HOP;
    handle
        .neighbours()
        .add(index, IpAddr::V4(hop))
        .link_layer_address(&kvpn_proto::attach::GATEWAY_MAC)
        .state(NeighbourState::Permanent)
        .replace()
        .execute()
        .await
        .with_context(|| format!("cannot add the next hop {hop} on {}", g.device))?;
    let mut route = RouteMessageBuilder::<Ipv4Addr>::new()
        .destination_prefix(g.pool.network(), g.pool.prefix_len())
        .gateway(hop)
        .output_interface(index)
        .build();
    route.header.flags |= RouteFlags::Onlink;
    handle
        .route()
        .add(route)
        .replace()
        .execute()
        .await
        .with_context(|| format!("cannot route {} via {hop} dev {}", g.pool, g.device))?;
    info!(
        device = %g.device,
        manager = %g.manager_host,
        port,
        pool = %g.pool,
        "tunnel pool routed to the manager's gateway; exiting (kernel state only)"
    );
    Ok(())
}

fn wait(w: &WaitArgs) -> anyhow::Result<()> {
    let t0 = Instant::now();
    loop {
        if nix::net::if_::if_nametoindex(w.tun.as_str()).is_ok() {
            return Ok(());
        }
        if t0.elapsed() > Duration::from_secs(w.timeout_s) {
            bail!(
                "the tunnel device {} did not appear within {} s — see the tunnel container's log (kubectl logs -c kvpn-tunnel)",
                w.tun,
                w.timeout_s
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The TLS client of the manager: TLS 1.3, only the attach Secret's CA.
fn tls_connector(ca_pem: &[u8]) -> anyhow::Result<tokio_rustls::TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem) {
        roots
            .add(cert.context("ca.crt holds a broken certificate")?)
            .context("ca.crt holds an unusable certificate")?;
    }
    if roots.is_empty() {
        bail!("ca.crt holds no certificate — run `kvpn detach` and `kvpn attach` again");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3 with ring")?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

async fn dial_tls(
    connector: &tokio_rustls::TlsConnector,
    name: &ServerName<'static>,
    addr: (IpAddr, u16),
) -> anyhow::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let tcp = tokio::time::timeout(STEP_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| anyhow!("no TCP connection to the manager at {}:{} within {} s — is the traffic manager running (kvpn connect installs it)?", addr.0, addr.1, STEP_TIMEOUT.as_secs()))?
        .with_context(|| format!("cannot connect to the manager at {}:{}", addr.0, addr.1))?;
    tcp.set_nodelay(true).ok();
    tokio::time::timeout(STEP_TIMEOUT, connector.connect(name.clone(), tcp))
        .await
        .map_err(|_| anyhow!("TLS handshake with {}:{} timed out", addr.0, addr.1))?
        .with_context(|| {
            format!(
                "TLS handshake with the manager at {}:{} failed — a reinstalled manager has a new CA: run `kvpn detach` and `kvpn attach` again",
                addr.0, addr.1
            )
        })
}

fn read(dir: &Path, file: &str) -> anyhow::Result<Vec<u8>> {
    let p = dir.join(file);
    std::fs::read(&p).with_context(|| {
        format!(
            "cannot read {} — the attach Secret is not mounted; run `kvpn attach` again",
            p.display()
        )
    })
}

async fn run(a: TunnelArgs) -> anyhow::Result<()> {
    let ca = read(&a.secret_dir, "ca.crt")?;
    let attach_key = String::from_utf8(read(&a.secret_dir, "attach.key")?)
        .context("attach.key is not text")?
        .trim()
        .to_owned();
    let connector = tls_connector(&ca)?;
    let name = ServerName::try_from(a.server_name.clone())
        .with_context(|| format!("--server-name {:?} is not a DNS name", a.server_name))?;
    let client_id = kvpn_proto::attach::replica_client_id(&attach_key, &a.pod_uid);

    // 1. The replica's own lease, on the attach port.
    let lease_addr = (a.manager_host, a.attach_port);
    let slot = Arc::new(Mutex::new(Some(
        dial_tls(&connector, &name, lease_addr).await?,
    )));
    let channel = tonic::transport::Endpoint::from_static("http://kvpn-manager.attach")
        .connect_with_connector(tower::service_fn(move |_| {
            let stream = slot.lock().ok().and_then(|mut s| s.take());
            async move {
                stream
                    .map(TokioIo::new)
                    .ok_or_else(|| std::io::Error::other("the attach connection was already used"))
            }
        }))
        .await
        .context("cannot open HTTP/2 on the attach port")?;
    let mut request = tonic::Request::new(LeaseRequest {
        client_id: client_id.clone(),
    });
    request.metadata_mut().insert(
        kvpn_proto::attach::ATTACH_KEY_HEADER,
        attach_key
            .parse()
            .context("attach.key is not a valid metadata value")?,
    );
    let lease = tokio::time::timeout(STEP_TIMEOUT, ManagerClient::new(channel).lease(request))
        .await
        .map_err(|_| {
            anyhow!(
                "no lease from the manager's attach port within {} s",
                STEP_TIMEOUT.as_secs()
            )
        })?
        .map_err(|s| {
            anyhow!(
                "the traffic manager refused the lease: {}: {}",
                s.code(),
                s.message()
            )
        })?
        .into_inner();
    let tunnel_ip: Ipv4Addr = lease
        .tunnel_ip
        .parse()
        .with_context(|| format!("the manager leased a bad tunnel IP {:?}", lease.tunnel_ip))?;
    let pool: ipnet::Ipv4Net = lease
        .pool_cidr
        .parse()
        .with_context(|| format!("the manager sent a bad pool {:?}", lease.pool_cidr))?;

    // 2. The data channel, before the TUN device: the device's existence is the
    // signal that the tunnel is up (`tunnel-wait`).
    let data = dial_tls(&connector, &name, (a.manager_host, a.data_port)).await?;
    let (mut data_rx, mut data_tx) = tokio::io::split(data);
    let mut hello = Hello::new(PROTOCOL_VERSION, IpAddr::V4(tunnel_ip));
    hello.token = lease.session_token.as_bytes().to_vec();
    hello.mtu = Some(a.mtu);
    let payload = hello.encode().context("cannot encode the hello")?;
    let mut out = Vec::new();
    frame::encode_into(Kind::Hello, &payload, &mut out).context("cannot frame the hello")?;
    data_tx
        .write_all(&out)
        .await
        .context("cannot send the hello to the manager")?;

    // 3. The TUN device in the pod's netns: the tunnel IP with the pool's
    // prefix, so the connected route carries exactly the tunnel range.
    ensure_tun_node()?;
    let device = tun_rs::DeviceBuilder::new()
        .name(&a.tun)
        .ipv4(tunnel_ip, pool.prefix_len(), None)
        .mtu(a.mtu)
        .enable(true)
        .build_async()
        .with_context(|| {
            format!(
                "cannot create TUN device {} — the tunnel container needs CAP_NET_ADMIN (securityContext capabilities add NET_ADMIN) and /dev/net/tun",
                a.tun
            )
        })?;
    let device = Arc::new(device);
    info!(
        tunnel_ip = %tunnel_ip,
        pool = %pool,
        tun = %a.tun,
        manager = %a.manager_host,
        client = %&client_id[..12],
        "tunnel up: this replica's tunnel IP is leased and its data channel open"
    );

    // 4. Pump both ways; heartbeats; any end is the container's end.
    let (out_tx, mut out_rx) = mpsc::channel::<Vec<u8>>(OUT_QUEUE);
    let writer = async move {
        while let Some(buf) = out_rx.recv().await {
            data_tx.write_all(&buf).await?;
        }
        anyhow::Ok(())
    };
    let tun_reader = {
        let device = device.clone();
        let out_tx = out_tx.clone();
        async move {
            let mut buf = vec![0u8; usize::from(a.mtu) + 64];
            loop {
                let n = device.recv(&mut buf).await.context("TUN read failed")?;
                // Only IPv4 from the tunnel IP: the manager drops anything else as
                // a spoofed source anyway (IPv6 router solicitations of the pod's
                // kernel, for one), and would count it.
                if n < 20 || buf[0] >> 4 != 4 || buf[12..16] != tunnel_ip.octets() {
                    continue;
                }
                let mut f = Vec::with_capacity(n + frame::HEADER_LEN);
                if frame::encode_into(Kind::Packet, &buf[..n], &mut f).is_ok()
                    && out_tx.send(f).await.is_err()
                {
                    bail!("the data channel writer stopped");
                }
            }
        }
    };
    let heartbeats = {
        let out_tx = out_tx.clone();
        async move {
            let mut n: u64 = 0;
            loop {
                tokio::time::sleep(HEARTBEAT).await;
                n += 1;
                let mut f = Vec::new();
                frame::encode_into(Kind::Heartbeat, &n.to_be_bytes(), &mut f)
                    .context("cannot frame a heartbeat")?;
                if out_tx.send(f).await.is_err() {
                    bail!("the data channel writer stopped");
                }
            }
        }
    };
    let manager_reader = async move {
        let decoder = Decoder::default();
        let mut buf: Vec<u8> = Vec::with_capacity(256 * 1024);
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            let n = data_rx
                .read(&mut chunk)
                .await
                .context("data channel read failed")?;
            if n == 0 {
                bail!("the manager closed the data channel (it refused the hello, or restarted)");
            }
            buf.extend_from_slice(&chunk[..n]);
            let mut used = 0;
            while let Some((f, len)) = decoder
                .decode(&buf[used..])
                .context("the manager sent a malformed frame")?
            {
                if f.kind == Kind::Packet
                    && let Err(e) = device.send(f.payload).await
                {
                    warn!(error = %e, "TUN write failed; packet dropped");
                }
                used += len;
            }
            buf.drain(..used);
        }
    };
    tokio::select! {
        r = writer => r.context("data channel write failed"),
        r = tun_reader => r,
        r = heartbeats => r,
        r = manager_reader => r,
    }
}

/// `/dev/net/tun` is not in a container's default device nodes under
/// containerd's CRI plugin, though its cgroup device rule allows it (c 10:200).
/// Create it when missing; that needs CAP_MKNOD.
fn ensure_tun_node() -> anyhow::Result<()> {
    let path = Path::new("/dev/net/tun");
    if path.exists() {
        return Ok(());
    }
    std::fs::create_dir_all("/dev/net").context("cannot create /dev/net")?;
    nix::sys::stat::mknod(
        path,
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o600),
        nix::sys::stat::makedev(10, 200),
    )
    .context("/dev/net/tun is missing in the container and cannot be created (needs CAP_MKNOD)")?;
    Ok(())
}
