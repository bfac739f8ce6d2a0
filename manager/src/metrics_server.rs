//! The metrics endpoint: `GET /metrics` answers [`ManagerCounters`] in the
//! Prometheus text format, over plain HTTP/1.1, one request per connection.
//!
//! The Kubernetes install binds it to the pod's loopback (`127.0.0.1:10803`,
//! like the gRPC API): reached through `pods/portforward` or a sidecar, never through the
//! Service, and not from the tunnel (laptops' packets to loopback are dropped,
//! [`crate::packet::DropReason::ForbiddenDestination`]). Requests are parsed
//! with `httparse`; anything but `GET /metrics` gets 404 or 405.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tracing::debug;

use crate::metrics::ManagerCounters;

/// Largest request head read, bytes (a scraper's is a few hundred).
const MAX_HEAD: usize = 8 * 1024;

/// A client has this long to send its request and read the answer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Serve `counters` on `listener` until the process ends.
pub async fn serve(listener: TcpListener, counters: Arc<ManagerCounters>) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                debug!(error = %e, "metrics accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let counters = counters.clone();
        tokio::spawn(async move {
            if tokio::time::timeout(REQUEST_TIMEOUT, answer(stream, &counters))
                .await
                .is_err()
            {
                debug!(%peer, "metrics request timed out");
            }
        });
    }
}

/// The status line and body for a request head; `None` while the head is
/// incomplete.
fn respond(head: &[u8], counters: &ManagerCounters) -> Option<(&'static str, String)> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(head) {
        Ok(httparse::Status::Partial) => None,
        Err(e) => Some(("400 Bad Request", format!("bad request: {e}\n"))),
        Ok(httparse::Status::Complete(_)) => {
            let path = req.path.unwrap_or("");
            let path = path.split('?').next().unwrap_or("");
            Some(match (req.method, path) {
                (Some("GET"), "/metrics") => ("200 OK", counters.render_prometheus()),
                (_, "/metrics") => ("405 Method Not Allowed", "GET only\n".to_owned()),
                _ => ("404 Not Found", "try GET /metrics\n".to_owned()),
            })
        }
    }
}

async fn answer(mut stream: TcpStream, counters: &ManagerCounters) {
    let mut head = Vec::with_capacity(1024);
    let (status, body) = loop {
        if head.len() >= MAX_HEAD {
            break ("431 Request Header Fields Too Large", String::new());
        }
        let mut chunk = [0u8; 1024];
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&chunk[..n]),
        }
        if let Some(r) = respond(&head, counters) {
            break r;
        }
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    if let Err(e) = stream.write_all(reply.as_bytes()).await {
        debug!(error = %e, "metrics reply failed");
    }
    let _ = stream.shutdown().await;
}

/// Bound address, for logs.
pub fn describe(addr: SocketAddr) -> &'static str {
    if addr.ip().is_loopback() {
        "pod loopback only: reachable through pods/portforward"
    } else {
        "all interfaces: reachable from the cluster network"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_get_metrics_is_answered() {
        let c = ManagerCounters::default();
        assert_eq!(respond(b"GET /metrics HTTP/1.1\r\nHost: x", &c), None);
        let (status, body) =
            respond(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", &c).expect("complete");
        assert_eq!(status, "200 OK");
        assert!(body.contains("kvpn_manager_sessions_active 0"), "{body}");
        let (status, _) = respond(b"POST /metrics HTTP/1.1\r\n\r\n", &c).expect("complete");
        assert_eq!(status, "405 Method Not Allowed");
        let (status, _) = respond(b"GET /leases HTTP/1.1\r\n\r\n", &c).expect("complete");
        assert_eq!(status, "404 Not Found");
        let (status, _) = respond(b"\x00\x01garbage\r\n\r\n", &c).expect("complete");
        assert_eq!(status, "400 Bad Request");
    }
}
