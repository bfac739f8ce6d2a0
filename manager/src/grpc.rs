//! The manager's control gRPC service (:10802): `Lease`.
//!
//! Plain HTTP/2, not TLS, and by default bound to the pod's loopback
//! (`127.0.0.1:10802`): the only way in is `pods/portforward`, which the kubelet
//! dials inside the pod's network namespace and which the API server and the
//! kubelet carry over TLS and authorise (the same RBAC as the data channel's
//! port-forward). Other pods cannot reach it through the Service. The session
//! token it hands out is only useful on the data channel, which is TLS.

use std::net::SocketAddr;
use std::sync::Arc;

use kvpn_proto::manager::manager_server::{Manager, ManagerServer};
use kvpn_proto::manager::{LeaseRequest, LeaseResponse};
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};
use tracing::warn;

use crate::lease::LeaseError;
use crate::leases::{LeaseServiceError, Leases};

/// The `Manager` service over a lease table.
#[derive(Debug, Clone)]
pub struct ManagerService {
    leases: Arc<Leases>,
    pool: String,
    manager_ip: String,
}

impl ManagerService {
    /// A service handing out leases from `leases`.
    pub async fn new(leases: Arc<Leases>) -> Self {
        let t = leases.table_snapshot().await;
        Self {
            pool: t.pool().to_string(),
            manager_ip: t.manager_ip().to_string(),
            leases,
        }
    }
}

#[tonic::async_trait]
impl Manager for ManagerService {
    async fn lease(
        &self,
        request: Request<LeaseRequest>,
    ) -> Result<Response<LeaseResponse>, Status> {
        let client_id = request.into_inner().client_id;
        match self.leases.lease(&client_id).await {
            Ok((rec, expires_in_s)) => Ok(Response::new(LeaseResponse {
                tunnel_ip: rec.ip.to_string(),
                manager_ip: self.manager_ip.clone(),
                pool_cidr: self.pool.clone(),
                session_token: rec.token,
                expires_in_s,
            })),
            Err(LeaseServiceError::Lease(e @ LeaseError::BadClientId(_))) => {
                Err(Status::invalid_argument(e.to_string()))
            }
            Err(LeaseServiceError::Lease(e @ LeaseError::PoolExhausted(_))) => {
                warn!(error = %e, "lease refused");
                Err(Status::resource_exhausted(e.to_string()))
            }
            Err(e @ LeaseServiceError::Store(_)) => {
                warn!(error = %e, "lease failed");
                Err(Status::unavailable(e.to_string()))
            }
        }
    }
}

/// Serve the gRPC API on `listener` until the process ends.
pub async fn serve(
    listener: TcpListener,
    leases: Arc<Leases>,
) -> Result<(), tonic::transport::Error> {
    let service = ManagerService::new(leases).await;
    tonic::transport::Server::builder()
        .add_service(ManagerServer::new(service))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
        .await
}

/// Bound address, for logs.
pub fn describe(addr: SocketAddr) -> &'static str {
    if addr.ip().is_loopback() {
        "pod loopback only: reachable through pods/portforward"
    } else {
        "all interfaces: reachable through the Service too"
    }
}
