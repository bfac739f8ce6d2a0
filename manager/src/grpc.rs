//! The manager's control gRPC service (:10802): `Lease` and `WatchRoutes` (the
//! route and DNS discovery stream, fed by [`crate::route_watch`]); the same
//! service on the attach port for attached pods' tunnel containers
//! ([`AttachListener`]: TLS, and only with the attach key).
//!
//! Plain HTTP/2, not TLS, and by default bound to the pod's loopback
//! (`127.0.0.1:10802`): the only way in is `pods/portforward`, which the kubelet
//! dials inside the pod's network namespace and which the API server and the
//! kubelet carry over TLS and authorise (the same RBAC as the data channel's
//! port-forward). Other pods cannot reach it through the Service. The session
//! token it hands out is only useful on the data channel, which is TLS.
//!
//! These two RPCs are the whole surface: there is no call that lists, renews
//! by tunnel IP, releases or edits another client's lease (a client's only
//! handle on a lease is its own client id), and no reflection service. Refused
//! `Lease` calls are counted (`kvpn_manager_lease_denied_total`), see
//! docs/trust-model.md.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use kvpn_proto::manager::manager_server::{Manager, ManagerServer};
use kvpn_proto::manager::{
    LeaseRequest, LeaseResponse, RoutesUpdate, TraceSourceEvent, TraceSourceRequest,
    WatchRoutesRequest,
};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};
use tracing::{debug, warn};

use crate::lease::LeaseError;
use crate::leases::{LeaseServiceError, Leases};
use crate::metrics::{LeaseDenial, ManagerCounters};
use crate::route_watch::{Failure, Published, RouteWatch};
use crate::routes::{self, View};
use crate::trace::{self as source_trace, EgressCapture, SourceTrace};

/// How long a new `WatchRoutes` call waits for the watches' first lists before
/// it answers UNAVAILABLE. Listing every pod and Service of a large cluster
/// takes a few seconds; the lab's takes ~50 ms.
const FIRST_VIEW_WAIT: Duration = Duration::from_secs(10);

/// The `Manager` service over a lease table and the route watch.
#[derive(Debug, Clone)]
pub struct ManagerService {
    leases: Arc<Leases>,
    routes: RouteWatch,
    pool: String,
    manager_ip: String,
    trace: TraceConfig,
    counters: Arc<ManagerCounters>,
}

/// What `TraceSource` needs: the sessions' shared trace, the source policy and
/// the pod's egress interface.
#[derive(Debug, Clone)]
pub struct TraceConfig {
    pub trace: Arc<SourceTrace>,
    pub policy: String,
    pub egress: String,
}

impl ManagerService {
    /// A service handing out leases from `leases` and routes from `routes`,
    /// counting into `counters`.
    pub async fn new(
        leases: Arc<Leases>,
        routes: RouteWatch,
        trace: TraceConfig,
        counters: Arc<ManagerCounters>,
    ) -> Self {
        let t = leases.table_snapshot().await;
        Self {
            pool: t.pool().to_string(),
            manager_ip: t.manager_ip().to_string(),
            leases,
            routes,
            trace,
            counters,
        }
    }
}

/// The failure that ends streams: only a lasting one (RBAC, no API). A failing
/// API server is retried by the watches, and streams keep their last view.
fn fatal(p: &Published) -> Option<&Failure> {
    p.failure.as_ref()
}

/// Send `namespace`'s updates of `rx` to `tx` until either side is gone.
async fn stream_updates(
    mut rx: tokio::sync::watch::Receiver<Published>,
    tx: mpsc::Sender<Result<RoutesUpdate, Status>>,
    namespace: String,
) {
    let mut last: Option<Arc<View>> = None;
    loop {
        let current = rx.borrow_and_update().clone();
        if let Some(f) = fatal(&current) {
            let _ = tx.send(Err(f.to_status())).await;
            return;
        }
        if let Some(view) = current.view {
            if let Some(update) = routes::delta(last.as_deref(), &view, &namespace)
                && tx.send(Ok(update)).await.is_err()
            {
                return;
            }
            last = Some(view);
        }
        tokio::select! {
            changed = rx.changed() => if changed.is_err() { return },
            () = tx.closed() => {
                debug!(%namespace, "WatchRoutes client gone");
                return;
            }
        }
    }
}

#[tonic::async_trait]
impl Manager for ManagerService {
    type WatchRoutesStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<RoutesUpdate, Status>> + Send + 'static>>;

    async fn watch_routes(
        &self,
        request: Request<WatchRoutesRequest>,
    ) -> Result<Response<Self::WatchRoutesStream>, Status> {
        let namespace = request.into_inner().namespace;
        let mut rx = self.routes.subscribe();
        let first = tokio::time::timeout(FIRST_VIEW_WAIT, async {
            loop {
                {
                    let p = rx.borrow_and_update();
                    if p.view.is_some() || p.failure.is_some() {
                        return Ok(());
                    }
                }
                if rx.changed().await.is_err() {
                    return Err(Status::unavailable("the route watch stopped"));
                }
            }
        })
        .await
        .map_err(|_| {
            Status::unavailable(format!(
                "the route watch has not finished listing pods and Services within {} s — retry",
                FIRST_VIEW_WAIT.as_secs()
            ))
        })?;
        first?;
        if let Some(f) = fatal(&rx.borrow()) {
            warn!(error = %f.to_status().message(), "WatchRoutes refused");
            return Err(f.to_status());
        }
        // Small: a slow client makes the sender wait, and the next delta is then
        // computed from the newest view (the watch channel keeps only that).
        let (tx, out_rx) = mpsc::channel(4);
        tokio::spawn(stream_updates(rx, tx, namespace));
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(out_rx),
        )))
    }

    type TraceSourceStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<TraceSourceEvent, Status>> + Send>>;

    async fn trace_source(
        &self,
        request: Request<TraceSourceRequest>,
    ) -> Result<Response<Self::TraceSourceStream>, Status> {
        let r = request.into_inner();
        let protocol = match r.protocol.as_str() {
            "tcp" => source_trace::TCP,
            "udp" => source_trace::UDP,
            other => {
                return Err(Status::invalid_argument(format!(
                    "protocol {other:?}: expected tcp or udp"
                )));
            }
        };
        let ip: std::net::Ipv4Addr = r.destination_ip.parse().map_err(|e| {
            Status::invalid_argument(format!("destination_ip {:?}: {e}", r.destination_ip))
        })?;
        let port = u16::try_from(r.destination_port)
            .map_err(|_| Status::invalid_argument("destination_port above 65535"))?;
        let destination = std::net::SocketAddrV4::new(ip, port);
        let timeout = Duration::from_millis(u64::from(r.timeout_ms)).min(source_trace::MAX_TRACE);
        let config = self.trace.clone();
        // The capture first: armed must mean both points watch.
        let capture = EgressCapture::open(&config.egress);
        if !config.trace.arm(protocol, destination) {
            return Err(Status::resource_exhausted(
                "another `kvpn diagnose source` is tracing on this manager; try again in a few seconds",
            ));
        }
        let note = match &capture {
            Ok(_) => String::new(),
            Err(e) => format!(
                "no capture at the pod's egress {}: {e} (needs NET_RAW in the manager pod)",
                config.egress
            ),
        };
        let (tx, rx) = mpsc::channel(2);
        let event = |armed: bool| TraceSourceEvent {
            armed,
            policy: config.policy.clone(),
            egress_interface: config.egress.clone(),
            note: note.clone(),
            ..Default::default()
        };
        let _ = tx.try_send(Ok(event(true)));
        let mut last = event(false);
        tokio::spawn(async move {
            let deadline = std::time::Instant::now() + timeout;
            let trace = config.trace.clone();
            let egress = match capture {
                Ok(capture) => tokio::task::spawn_blocking(move || {
                    capture.first_source(protocol, destination, deadline, || false)
                })
                .await
                .ok()
                .flatten(),
                Err(_) => None,
            };
            // The decapsulated packet comes first; give it until the deadline
            // when the egress saw nothing.
            while trace.decapsulated().is_none() && std::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let seen = trace.disarm();
            last.decapsulated_source = seen
                .and_then(|w| w.decapsulated)
                .map(|a| a.to_string())
                .unwrap_or_default();
            last.egress_source = egress.map(|a| a.to_string()).unwrap_or_default();
            debug!(%destination, decap = %last.decapsulated_source, egress = %last.egress_source, "source trace done");
            let _ = tx.send(Ok(last)).await;
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn lease(
        &self,
        request: Request<LeaseRequest>,
    ) -> Result<Response<LeaseResponse>, Status> {
        let client_id = request.into_inner().client_id;
        match self.leases.lease(&client_id).await {
            Ok((rec, expires_in_s)) => {
                self.counters.lease_granted();
                Ok(Response::new(LeaseResponse {
                    tunnel_ip: rec.ip.to_string(),
                    tunnel_ip_v6: kvpn_proto::tunnel::ipv6_tunnel_ip(rec.ip).to_string(),
                    pool_cidr_v6: kvpn_proto::tunnel::TUNNEL_POOL_V6.to_string(),
                    manager_ip: self.manager_ip.clone(),
                    pool_cidr: self.pool.clone(),
                    session_token: rec.token,
                    expires_in_s,
                    manager_version: kvpn_build_info::VERSION.to_owned(),
                    manager_commit: kvpn_build_info::COMMIT.to_owned(),
                }))
            }
            Err(LeaseServiceError::Lease(e @ LeaseError::BadClientId(_))) => {
                self.counters.deny_lease(LeaseDenial::BadClientId);
                // The id itself is not logged: it may be someone's credential with a typo.
                warn!(
                    id_bytes = client_id.len(),
                    "lease refused: invalid client id"
                );
                Err(Status::invalid_argument(e.to_string()))
            }
            Err(LeaseServiceError::Lease(e @ LeaseError::PoolExhausted(_))) => {
                self.counters.deny_lease(LeaseDenial::PoolExhausted);
                warn!(error = %e, "lease refused");
                Err(Status::resource_exhausted(e.to_string()))
            }
            Err(e @ LeaseServiceError::Store(_)) => {
                self.counters.deny_lease(LeaseDenial::StoreUnavailable);
                warn!(error = %e, "lease failed");
                Err(Status::unavailable(e.to_string()))
            }
        }
    }
}

/// Serve the gRPC API on `listener` until the process ends; refusals are
/// counted into `counters`.
pub async fn serve(
    listener: TcpListener,
    attach: Option<AttachListener>,
    leases: Arc<Leases>,
    routes: RouteWatch,
    trace: TraceConfig,
    counters: Arc<ManagerCounters>,
) -> Result<(), tonic::transport::Error> {
    let service = ManagerService::new(leases, routes, trace, counters).await;
    let port_forward = tonic::transport::Server::builder()
        .add_service(ManagerServer::new(service.clone()))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
    match attach {
        None => port_forward.await,
        Some(a) => {
            let key = a.attach_key;
            let checked = ManagerServer::with_interceptor(service, move |req: Request<()>| {
                check_attach_key(&req, &key)?;
                Ok(req)
            });
            let attach_port = tonic::transport::Server::builder()
                .add_service(checked)
                .serve_with_incoming(attach_incoming(a.listener, a.tls));
            tokio::select! {
                r = port_forward => r,
                r = attach_port => r,
            }
        }
    }
}

/// The attach port (`--attach-listen`, [`kvpn_proto::attach::ATTACH_PORT`]):
/// the same service for the tunnel containers of attached pods, over TLS with
/// the data channel's certificate, answering only calls that carry the attach
/// key (docs/attach.md).
pub struct AttachListener {
    /// Bound listener (the install: `0.0.0.0:10804`, in the Service).
    pub listener: TcpListener,
    /// The data channel's TLS configuration.
    pub tls: Arc<rustls::ServerConfig>,
    /// [`kvpn_proto::attach::attach_key`] of this manager's TLS key.
    pub attach_key: String,
}

/// UNAUTHENTICATED unless metadata `kvpn-attach-key` is this manager's key.
fn check_attach_key(req: &Request<()>, key: &str) -> Result<(), Status> {
    let presented = req
        .metadata()
        .get(kvpn_proto::attach::ATTACH_KEY_HEADER)
        .and_then(|v| v.to_str().ok());
    match presented {
        Some(p) if kvpn_proto::attach::keys_equal(p, key) => Ok(()),
        Some(_) => {
            warn!("attach port: call with a wrong attach key refused");
            Err(Status::unauthenticated(
                "wrong attach key: the pod's Secret was made for another traffic manager — run `kvpn detach` and `kvpn attach` again",
            ))
        }
        None => Err(Status::unauthenticated(
            "no attach key: this port answers only tunnel containers that `kvpn attach` added",
        )),
    }
}

/// A TLS connection on the attach port, as tonic's server takes it.
struct AttachConn(tokio_rustls::server::TlsStream<tokio::net::TcpStream>);

impl tonic::transport::server::Connected for AttachConn {
    type ConnectInfo = ();
    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl tokio::io::AsyncRead for AttachConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for AttachConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// Time a client has for its TLS handshake on the attach port.
const ATTACH_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Accepted, TLS-handshaken connections of the attach port. Each handshake runs
/// in its own task, so a slow client holds up nobody.
fn attach_incoming(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
) -> impl tokio_stream::Stream<Item = Result<AttachConn, std::io::Error>> {
    let (conn_tx, conn_rx) = mpsc::channel(16);
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = match listener.accept().await {
                Ok(a) => a,
                Err(e) => {
                    warn!(error = %e, "attach port: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let acceptor = acceptor.clone();
            let conn_tx = conn_tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(ATTACH_HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(tls)) => {
                        let _ = conn_tx.send(Ok(AttachConn(tls))).await;
                    }
                    Ok(Err(e)) => debug!(%peer, error = %e, "attach port: TLS handshake failed"),
                    Err(_) => debug!(%peer, "attach port: TLS handshake timed out"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(conn_rx)
}

/// Bound address, for logs.
pub fn describe(addr: SocketAddr) -> &'static str {
    if addr.ip().is_loopback() {
        "pod loopback only: reachable through pods/portforward"
    } else {
        "all interfaces: reachable through the Service too"
    }
}
