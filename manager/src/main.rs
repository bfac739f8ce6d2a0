//! `kvpn-manager`: the traffic manager binary. Listens for laptops' data
//! channels and relays their traffic into the cluster (see the library docs).

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use kvpn_ebpf::snat::SnatTimeouts;
use kvpn_manager::ebpf_snat::{self, EbpfSnatConfig};
use kvpn_manager::lease::LeaseTable;
use kvpn_manager::leases::Leases;
use kvpn_manager::metrics::ManagerCounters;
use kvpn_manager::preserve::{self, PreserveConfig, SourcePolicy};
use kvpn_manager::route_watch::RouteWatch;
use kvpn_manager::routes::DiscoveryConfig;
use kvpn_manager::session::SessionConfig;
use kvpn_manager::{grpc, metrics_server, server};
use tracing::{info, warn};

mod tunnel;

/// kvpn traffic manager: terminates laptops' tunnel packets and dials the real
/// destinations in the cluster.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Address of the data channel (framed packets from laptops).
    #[arg(long, default_value = "0.0.0.0:10801")]
    listen: SocketAddr,
    /// Tokio worker threads; 0 = one per core. 1 puts every session's tasks on
    /// one thread: no hand-off between threads per packet (on the 2-core lab
    /// VM ~16% less kvpn CPU per Gbit, but a higher busy-ping RTT; see
    /// docs/queues.md), and the manager then uses at most one core for all
    /// laptops.
    /// At most 256.
    #[arg(long, env = "KVPN_MANAGER_WORKER_THREADS", default_value_t = 0, value_parser = clap::value_parser!(u16).range(0..=256))]
    worker_threads: u16,
    /// Give up a TCP dial after this many milliseconds (the laptop then gets
    /// ICMP host unreachable).
    #[arg(long, default_value_t = 5000)]
    dial_timeout_ms: u64,
    /// End a session after this many seconds without any frame (laptops send
    /// a heartbeat every 1 s).
    #[arg(long, default_value_t = 60)]
    idle_timeout_secs: u64,
    /// Serving certificate (PEM chain) for TLS 1.3 on the data channel. With
    /// --tls-key, every data connection must be TLS; without both, the data
    /// channel is plain TCP (static lab, `kvpn connect --manager`).
    #[arg(long, env = "KVPN_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(long, env = "KVPN_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Lease tunnel IPs (gRPC `Lease` on --grpc-listen) and require every
    /// hello to carry its lease's session token. Off: any tunnel IP is accepted
    /// (static lab, `kvpn connect --manager`). The Kubernetes install turns it on.
    #[arg(long, env = "KVPN_LEASES")]
    leases: bool,
    /// Address of the control gRPC API (with --leases). The loopback default
    /// makes it reachable only through pods/portforward.
    #[arg(long, default_value = "127.0.0.1:10802")]
    grpc_listen: SocketAddr,
    /// Pool of tunnel IPs (IPv4); its first host address is the manager's own.
    #[arg(long, default_value = "100.96.0.0/16")]
    tunnel_pool: ipnet::Ipv4Net,
    /// A lease without a data channel expires after this long: seconds, or
    /// with a unit (90s, 30m, 1h).
    #[arg(long, default_value = "1h", value_parser = parse_duration)]
    lease_time: Duration,
    /// ConfigMap (in the pod's namespace) where managers before Lease objects
    /// kept the leases (key leases.json): moved into Lease objects once at
    /// start, then the key is removed. The leases themselves are
    /// coordination.k8s.io Lease objects in the pod's namespace, one per
    /// tunnel IP (docs/scale.md), when the API server is reachable with the
    /// pod's service account.
    #[arg(long, default_value = "kvpn-manager")]
    lease_configmap: String,
    /// This replica's name (the Kubernetes install passes the pod name through
    /// the downward API): written as the holder of the lease objects it writes.
    #[arg(long, env = "KVPN_POD_NAME")]
    replica_name: Option<String>,
    /// The cluster domain that `WatchRoutes` reports (the kubelet's
    /// --cluster-domain).
    #[arg(long, env = "KVPN_CLUSTER_DOMAIN", default_value = "cluster.local")]
    cluster_domain: String,
    /// The cluster DNS Service, NAMESPACE/NAME: its ClusterIPs are the DNS
    /// servers `WatchRoutes` reports.
    #[arg(long, env = "KVPN_DNS_SERVICE", default_value = "kube-system/kube-dns", value_parser = parse_service_ref)]
    dns_service: (String, String),
    /// Most concurrent flows (TCP, UDP, ping) of one laptop. Beyond it a new
    /// TCP flow is refused with RST and a new UDP flow with ICMP
    /// "administratively prohibited"; counted (`refused_cap` in the session
    /// stats log).
    #[arg(long, default_value_t = kvpn_manager::engine::DEFAULT_MAX_FLOWS, value_parser = parse_positive)]
    max_flows_per_client: usize,
    /// New flows per second one laptop may open, sustained; a SYN flood or a
    /// UDP sweep of closed ports beyond it is dropped (counted,
    /// `rate_limited`). 0 turns the limit off.
    #[arg(long, default_value_t = kvpn_manager::limit::NEW_FLOWS_PER_SEC)]
    new_flows_per_sec: u32,
    /// New flows one laptop may open at once (the token bucket's size).
    #[arg(long, default_value_t = kvpn_manager::limit::NEW_FLOW_BURST)]
    new_flow_burst: u32,
    /// TCP dials per second one laptop may have fail (refused, unreachable,
    /// timed out), sustained: a port scan or SYN flood to closed ports beyond
    /// it is dropped (counted, `rate_limited`). 0 turns this limit off (so does
    /// --new-flows-per-sec 0).
    #[arg(long, env = "KVPN_FAILED_DIALS_PER_SEC", default_value_t = kvpn_manager::limit::FAILED_FLOWS_PER_SEC)]
    failed_dials_per_sec: u32,
    /// Receive buffer of each laptop TCP flow in the manager's stack, bytes:
    /// the most data the laptop's sender has in flight per flow. Everything in
    /// flight waits in the tunnel's queues ahead of a packet of another flow,
    /// so a smaller window lowers the round trip other flows see during a
    /// bulk upload (about window ÷ throughput), and a window below the path's
    /// bandwidth-delay product caps one flow's upload at about window ÷ RTT.
    /// 16384 (16 KiB) to 16777216 (16 MiB), a plain byte count. Unless
    /// --fixed-tcp-window, this is the most: a data connection whose round
    /// trip (measured by the kernel when it is accepted) is short gives its
    /// flows the bandwidth-delay product of 10 Gbit/s at that round trip, at
    /// least 256 KiB; connections from loopback (kubectl port-forward, SSH)
    /// always get this value.
    #[arg(long, env = "KVPN_TCP_WINDOW", default_value_t = kvpn_manager::engine::TCP_RX_BUFFER, value_parser = parse_tcp_window)]
    tcp_window: usize,
    /// Give every TCP flow --tcp-window, whatever the data connection's round
    /// trip: for a laptop that reaches the manager through a TCP proxy near
    /// the pod (the manager then measures the proxy's round trip, not the
    /// laptop's, and would cap a long path's flows at 256 KiB ÷ RTT).
    #[arg(long, env = "KVPN_FIXED_TCP_WINDOW")]
    fixed_tcp_window: bool,
    /// Seconds between the `session stats` log lines of each live session
    /// (flows against the cap, limits, manager memory).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    stats_interval_secs: u64,
    /// Milliseconds an ended data connection's engine (its TCP flows and the
    /// connections it dialed to pods) is kept for the laptop's re-dial: a
    /// laptop worker that re-dials with the same resume token (hello option 5)
    /// within it gets its flows back instead of losing them. 0 turns resuming
    /// off: every re-dial then starts with no flows (the laptop's open
    /// connections through the tunnel are lost).
    #[arg(long, env = "KVPN_RESUME_GRACE_MS", default_value_t = kvpn_manager::resume::DEFAULT_GRACE.as_millis() as u64)]
    resume_grace_ms: u64,
    /// Most engines parked for a resume at once (the oldest is dropped
    /// first beyond it); each holds its flows' buffers like a session does.
    #[arg(long, env = "KVPN_RESUME_MAX_PARKED", default_value_t = kvpn_manager::resume::DEFAULT_MAX_PARKED)]
    resume_max_parked: usize,
    /// Whose address the cluster's backends see: `snat` (the manager pod's IP;
    /// smoltcp terminates, unprivileged) or `preserve` (the laptop's tunnel IP; the
    /// pod's kernel forwards through a TUN device, needs NET_ADMIN and NET_RAW, and
    /// the nodes must route --tunnel-pool via --preserve-gateway).
    /// `ebpf-snat`: the pod's IP, rewritten by kvpn's TC programs on
    /// --egress-interface (no termination; CAP_BPF and CAP_NET_ADMIN).
    #[arg(long, env = "KVPN_SOURCE_POLICY", value_enum, default_value_t = SourcePolicy::Snat)]
    source_policy: SourcePolicy,
    /// With ebpf-snat: the ports translated flows leave with, per destination. The
    /// default lies above Linux's default ephemeral range (32768-60999), so the
    /// pod's own sockets never collide with it.
    #[arg(long, default_value = "61000-65535", value_parser = kvpn_manager::ebpf_snat::parse_ports)]
    snat_ports: std::ops::RangeInclusive<u16>,
    /// With ebpf-snat: an established TCP flow idle this long loses its port
    /// (seconds, or 90s, 30m, 2h).
    #[arg(long, default_value = "2h", value_parser = parse_duration)]
    snat_tcp_timeout: Duration,
    /// With ebpf-snat: UDP and ICMP echo flows, and TCP flows after a FIN or RST,
    /// idle this long lose their port.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    snat_idle_timeout: Duration,
    /// With preserve: the stable address this pod claims on --egress-interface
    /// (announced by gratuitous ARP) for the nodes' route `POOL via GATEWAY`. It
    /// moves with the live manager pod, so a reschedule changes no node route.
    /// `none`: claim nothing (the nodes route the pool some other way).
    #[arg(long, default_value = "169.254.96.1")]
    preserve_gateway: String,
    /// The pod's interface towards the node: carries the stable gateway (with
    /// preserve) and is where `kvpn diagnose source` watches the pod's egress.
    #[arg(long, default_value = "eth0")]
    egress_interface: String,
    /// With preserve: the TUN device the laptops' packets enter the pod's kernel by.
    #[arg(long, default_value = "kvpn-pool")]
    pool_tun: String,
    /// Address of the metrics endpoint (`GET /metrics`, Prometheus text: refused
    /// hellos, spoofed sources, lease denials, drops), or `off`. The Kubernetes
    /// install gives 127.0.0.1:10803 (the pod's loopback: reachable only
    /// through pods/portforward). Off by default, so managers sharing a network
    /// namespace (tests, a laptop) do not fight over one port.
    #[arg(long, default_value = "off", value_parser = parse_metrics_listen)]
    metrics_listen: MetricsListen,
    /// Serve `Lease` to attached pods' tunnel containers on this address (TLS
    /// with --tls-cert/--tls-key, only for calls carrying the attach key derived
    /// from --tls-key), or `off`. The install gives 0.0.0.0:10804, in the Service
    /// (docs/attach.md). Needs --leases.
    #[arg(long, default_value = "off", value_parser = parse_metrics_listen)]
    attach_listen: MetricsListen,
    /// Be the egress gateway of `kvpn attach --via gateway` on this UDP
    /// address (VXLAN from attached pods; they reach the laptops with this
    /// manager's tunnel address as source), or `off`. The install gives
    /// 0.0.0.0:10805, in the Service (docs/tunnel-ownership.md). Needs --leases.
    #[arg(long, default_value = "off", value_parser = parse_metrics_listen)]
    gateway_listen: MetricsListen,
}

fn parse_gateway(s: &str) -> Result<Option<std::net::Ipv4Addr>, String> {
    if s == "none" {
        return Ok(None);
    }
    s.parse()
        .map(Some)
        .map_err(|e| format!("{s:?}: {e}; expected an IPv4 address or `none`"))
}

/// `--metrics-listen`: an address, or `None` for `off`.
#[derive(Debug, Clone)]
struct MetricsListen(Option<SocketAddr>);

fn parse_metrics_listen(s: &str) -> Result<MetricsListen, String> {
    if s == "off" {
        return Ok(MetricsListen(None));
    }
    s.parse()
        .map(|a| MetricsListen(Some(a)))
        .map_err(|e| format!("{s:?}: {e}; expected IP:PORT (e.g. 127.0.0.1:10803) or off"))
}

fn parse_service_ref(s: &str) -> Result<(String, String), String> {
    match s.split_once('/') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
            Ok((ns.to_owned(), name.to_owned()))
        }
        _ => Err(format!(
            "{s:?}: expected NAMESPACE/NAME, e.g. kube-system/kube-dns"
        )),
    }
}

fn parse_positive(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{s:?}: expected a positive number of flows")),
    }
}

/// `--tcp-window`: bytes, 16 KiB to 16 MiB (smoltcp's window scaling covers it).
fn parse_tcp_window(s: &str) -> Result<usize, String> {
    const RANGE: std::ops::RangeInclusive<usize> = 16 * 1024..=16 * 1024 * 1024;
    let n: usize = s
        .parse()
        .map_err(|e| format!("{s:?} is not a byte count: {e}"))?;
    if RANGE.contains(&n) {
        Ok(n)
    } else {
        Err(format!(
            "{n} bytes is outside {}..={} (16 KiB to 16 MiB)",
            RANGE.start(),
            RANGE.end()
        ))
    }
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?}: expected a number of seconds or e.g. 90s, 30m, 1h"))?;
    let scale = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (s, m or h)")),
    };
    if n == 0 {
        return Err(format!("{s:?}: the duration must be positive"));
    }
    Ok(Duration::from_secs(n.saturating_mul(scale)))
}

/// Where the pod's service account lives (Kubernetes convention).
const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The API client of this pod's service account and the pod's namespace.
fn in_cluster_client() -> anyhow::Result<(kube::Client, String)> {
    if std::env::var_os("KUBERNETES_SERVICE_HOST").is_none() {
        anyhow::bail!("not in a cluster (KUBERNETES_SERVICE_HOST unset)");
    }
    let config = kube::Config::incluster()
        .context("no in-cluster configuration (service-account token or CA missing?)")?;
    let namespace = match std::env::var("KVPN_NAMESPACE") {
        Ok(ns) if !ns.is_empty() => ns,
        _ => std::fs::read_to_string(format!("{SERVICE_ACCOUNT_DIR}/namespace"))
            .map(|s| s.trim().to_owned())
            .unwrap_or_else(|_| config.default_namespace.clone()),
    };
    let client = kube::Client::try_from(config).context("cannot build the API client")?;
    Ok((client, namespace))
}

/// The lease store: the ConfigMap when this pod can reach the API server with
/// its service account, else memory (warned).
async fn open_leases(args: &Args, api: &anyhow::Result<(kube::Client, String)>) -> Arc<Leases> {
    let table = LeaseTable::new(args.tunnel_pool, args.lease_time);
    let in_cluster = async {
        let (client, namespace) = match api {
            Ok((client, namespace)) => (client.clone(), namespace.clone()),
            Err(e) => anyhow::bail!("{e:#}"),
        };
        let leases = tokio::time::timeout(
            Duration::from_secs(10),
            Leases::in_objects(
                table.clone(),
                client,
                &namespace,
                args.replica_name.clone(),
                &args.lease_configmap,
            ),
        )
        .await
        .context("the API server did not answer within 10 s")?
        .with_context(|| format!("cannot use Lease objects (coordination.k8s.io) in {namespace} (the manager's Role needs list, create, update and delete on leases; `kvpn connect` re-applies it)"))?;
        info!(namespace = %namespace, replica = args.replica_name.as_deref().unwrap_or("(unnamed)"), "leases are stored as Lease objects, one per tunnel IP (create-only grants, resourceVersion-checked renewals)");
        anyhow::Ok(leases)
    };
    match in_cluster.await {
        Ok(leases) => leases,
        Err(e) => {
            warn!(reason = %format!("{e:#}"), "leases are kept in memory only: a restarted manager forgets them and laptops must lease again");
            Leases::in_memory(table)
        }
    }
}

/// Every flow holds a kernel socket: raise the soft open-files limit to the
/// hard one (the usual 1024 soft limit would cap a laptop at ~1000 TCP flows).
fn raise_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read/write the struct we pass.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0;
    if !ok || lim.rlim_cur >= lim.rlim_max {
        return;
    }
    let before = lim.rlim_cur;
    lim.rlim_cur = lim.rlim_max;
    // SAFETY: as above.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } == 0 {
        info!(
            from = before,
            to = lim.rlim_cur,
            "raised the open-files limit"
        );
    } else {
        warn!(
            limit = before,
            "cannot raise the open-files limit; flows beyond it fail to dial"
        );
    }
}

/// Keep glibc's mmap threshold at its 128 KiB default instead of letting it
/// grow: each TCP flow's smoltcp buffers (2 x 512 KiB, zero-filled) must stay
/// fresh zero pages that only become resident when data passes. With the
/// dynamic threshold, the first freed buffer raises it, later buffers come
/// from the heap and calloc writes all of their zeros: 1 MiB resident per
/// flow, however idle (measured with case tr-12's 3000 flows).
fn fix_mmap_threshold() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes allocator parameters.
        let ok = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024) } == 1;
        if !ok {
            warn!(
                "cannot fix the malloc mmap threshold; idle TCP flows may cost 1 MiB resident each"
            );
        }
    }
}

/// SIGTERM and SIGINT handlers, installed before the manager says it listens:
/// a signal that comes right after a laptop's first session (a test, or a
/// rollout) must stop the manager cleanly, not kill it by the default action.
fn shutdown_signals() -> anyhow::Result<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>
{
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate()).context("cannot install the SIGTERM handler")?;
    let int = signal(SignalKind::interrupt()).context("cannot install the SIGINT handler")?;
    Ok((term, int))
}

async fn shutdown_signal(
    (mut term, mut int): (tokio::signal::unix::Signal, tokio::signal::unix::Signal),
) -> &'static str {
    tokio::select! {
        _ = int.recv() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    }
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Plain text when the log goes to a file or pipe (the lab, kubectl logs).
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    // The tunnel container of an attached pod runs the same image.
    if let Some(sub) = std::env::args().nth(1)
        && (sub == "tunnel"
            || sub == "tunnel-wait"
            || sub == "gateway-route"
            || sub == "probe-send")
    {
        return tunnel::main_from_args(std::env::args().skip(1));
    }
    // The node agent of `--source-policy preserve` (a DaemonSet) too.
    if std::env::args().nth(1).as_deref() == Some("node-agent") {
        return kvpn_manager::node_agent::main_from_args(std::env::args().skip(2));
    }
    let args = Args::parse();
    let threads = match args.worker_threads {
        0 => std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
        n => usize::from(n),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    info!(
        worker_threads = threads,
        setting = args.worker_threads,
        "runtime started (setting 0: one worker thread per core)"
    );
    runtime.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let signals = shutdown_signals()?;
    raise_fd_limit();
    fix_mmap_threshold();
    let counters = Arc::new(ManagerCounters::default());
    let mut config = SessionConfig {
        dial_timeout: Duration::from_millis(args.dial_timeout_ms),
        idle_timeout: Duration::from_secs(args.idle_timeout_secs),
        max_flows: args.max_flows_per_client,
        new_flows_per_sec: args.new_flows_per_sec,
        new_flow_burst: args.new_flow_burst,
        failed_dials_per_sec: args.failed_dials_per_sec,
        stats_interval: Duration::from_secs(args.stats_interval_secs),
        tcp_window: args.tcp_window,
        auto_tcp_window: !args.fixed_tcp_window,
        counters: counters.clone(),
        resumes: kvpn_manager::resume::Resumes::new(
            Duration::from_millis(args.resume_grace_ms),
            args.resume_max_parked,
        ),
        ..SessionConfig::default()
    };
    if let MetricsListen(Some(addr)) = args.metrics_listen {
        let metrics_listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr} for metrics (give --metrics-listen another address, or off)"))?;
        let bound = metrics_listener
            .local_addr()
            .context("cannot read the metrics address")?;
        info!(metrics = %bound, reach = metrics_server::describe(bound), "metrics at GET /metrics");
        tokio::spawn(metrics_server::serve(metrics_listener, counters.clone()));
    }
    let mut grpc_task = None;
    if args.leases {
        let api = in_cluster_client();
        let leases = open_leases(&args, &api).await;
        let routes = match &api {
            Ok((client, _)) => RouteWatch::spawn(
                client.clone(),
                DiscoveryConfig {
                    cluster_domain: args.cluster_domain.clone(),
                    dns_service: args.dns_service.clone(),
                    ..DiscoveryConfig::default()
                },
            ),
            Err(e) => {
                warn!(reason = %format!("{e:#}"), "no route watch: WatchRoutes answers FAILED_PRECONDITION and laptops keep the CIDRs they detected");
                RouteWatch::unavailable(format!("{e:#}"))
            }
        };
        let grpc_listener = tokio::net::TcpListener::bind(args.grpc_listen)
            .await
            .with_context(|| format!("cannot listen on {} for gRPC", args.grpc_listen))?;
        let grpc_addr = grpc_listener
            .local_addr()
            .context("cannot read the gRPC address")?;
        info!(
            grpc = %grpc_addr,
            reach = grpc::describe(grpc_addr),
            pool = %args.tunnel_pool,
            lease_time_s = args.lease_time.as_secs(),
            persistent = leases.persistent(),
            "leases on: hellos must carry their lease's session token"
        );
        let maintained = leases.clone();
        let interval = Leases::maintain_interval(args.lease_time);
        let resumes = config.resumes.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.tick().await;
            loop {
                tick.tick().await;
                // An expired lease's parked engines go with it (a lease time
                // shorter than --resume-grace-ms).
                for ip in maintained.maintain().await {
                    resumes.drop_ip(std::net::IpAddr::V4(ip));
                }
            }
        });
        let attach = match (args.attach_listen.0, &args.tls_cert, &args.tls_key) {
            (None, _, _) => None,
            (Some(addr), Some(cert), Some(key)) => {
                let tls = kvpn_manager::tls::load_server_config(cert, key)
                    .context("cannot set up TLS for the attach port")?;
                let key_pem = std::fs::read(key)
                    .with_context(|| format!("cannot read the TLS key {}", key.display()))?;
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("cannot listen on {addr} for the attach port (give --attach-listen another address, or off)"))?;
                info!(attach = %addr, "attach port: Lease for attached pods' tunnel containers (TLS, attach key required)");
                Some(grpc::AttachListener {
                    listener,
                    tls,
                    attach_key: kvpn_proto::attach::attach_key(&key_pem),
                })
            }
            (Some(_), _, _) => anyhow::bail!(
                "--attach-listen needs --tls-cert and --tls-key: the attach port is TLS and its key is derived from the TLS key"
            ),
        };
        grpc_task = Some(tokio::spawn(grpc::serve(
            grpc_listener,
            attach,
            leases.clone(),
            routes,
            grpc::TraceConfig {
                trace: config.trace.clone(),
                policy: args.source_policy.as_str().to_owned(),
                egress: args.egress_interface.clone(),
            },
            counters.clone(),
        )));
        config.leases = Some(leases);
        config.tunnel_pool = Some(args.tunnel_pool);
    } else {
        info!(
            "leases off: any unicast tunnel IP is accepted (give --leases to require session tokens)"
        );
    }
    if matches!(
        args.source_policy,
        SourcePolicy::Preserve | SourcePolicy::EbpfSnat
    ) {
        let policy = args.source_policy;
        config.tunnel_pool = Some(args.tunnel_pool);
        let tun = preserve::setup(&PreserveConfig {
            tun_name: args.pool_tun.clone(),
            pool: args.tunnel_pool,
            egress: args.egress_interface.clone(),
            // ebpf-snat's replies come to the pod IP: no stable gateway to claim.
            gateway: if policy == SourcePolicy::Preserve {
                parse_gateway(&args.preserve_gateway)
                    .map_err(|e| anyhow::anyhow!("--preserve-gateway {e}"))?
            } else {
                None
            },
        })
        .await
        .with_context(|| format!("cannot set up --source-policy {policy}"))?;
        if policy == SourcePolicy::EbpfSnat {
            ebpf_snat::setup(
                &EbpfSnatConfig {
                    egress: args.egress_interface.clone(),
                    pool: args.tunnel_pool,
                    ports: args.snat_ports.clone(),
                    timeouts: SnatTimeouts {
                        tcp: args.snat_tcp_timeout,
                        idle: args.snat_idle_timeout,
                    },
                },
                counters.clone(),
            )
            .await
            .context("cannot set up --source-policy ebpf-snat")?;
        }
        tokio::spawn(tun.clone().run_reader(config.peers.clone()));
        config.pool_tun = Some(tun);
    } else {
        info!("source policy snat: backends see this pod's IP");
    }
    if let Some(listen) = args.gateway_listen.0 {
        anyhow::ensure!(
            args.leases,
            "--gateway-listen needs --leases (the gateway forwards only to leased tunnel IPs of the pool)"
        );
        let gw = Arc::new(
            kvpn_manager::gateway::Gateway::bind(
                listen,
                kvpn_manager::engine::MANAGER_STACK_V4,
                args.tunnel_pool,
                config.peers.clone(),
            )
            .await?,
        );
        tokio::spawn(gw.clone().run());
        config.gateway = Some(gw);
    }
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(
            kvpn_manager::tls::load_server_config(cert, key)
                .context("cannot set up TLS for the data channel")?,
        ),
        _ => None,
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| {
            format!(
                "cannot listen on {} (is another manager running, or the port taken?)",
                args.listen
            )
        })?;
    let bound = listener
        .local_addr()
        .context("cannot read the listening address")?;
    match (&tls, &args.tls_cert) {
        (Some(_), Some(cert)) => info!(
            listen = %bound,
            mtu = kvpn_manager::DEFAULT_MTU,
            security = "tls",
            cert = %cert.display(),
            "kvpn-manager listening; data channel is TLS 1.3"
        ),
        _ => warn!(
            listen = %bound,
            mtu = kvpn_manager::DEFAULT_MTU,
            security = "plain",
            "kvpn-manager listening; data channel is plain TCP, unencrypted (give --tls-cert and --tls-key for TLS)"
        ),
    }
    let grpc_failed = async {
        match grpc_task {
            Some(task) => match task.await {
                Ok(Ok(())) => anyhow::bail!("the gRPC server stopped"),
                Ok(Err(e)) => Err(anyhow::Error::new(e).context("the gRPC server failed")),
                Err(e) => Err(anyhow::Error::new(e).context("the gRPC server task failed")),
            },
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        () = server::serve(listener, Arc::new(config), tls) => Ok(()),
        r = grpc_failed => r,
        sig = shutdown_signal(signals) => {
            info!(signal = sig, "shutting down");
            Ok(())
        }
    }
}
