//! The apiserver's way into the lab's network: an HTTP CONNECT proxy on a unix socket
//! (the apiserver's `--egress-selector-config-file`, selection `cluster`) that dials
//! from inside one of the lab's netns.
//!
//! Why: the control plane runs in the host netns on a loopback address, the real
//! kubelets listen on their node addresses inside node netns the host cannot route
//! to (the lab adds nothing to the machine's root netns). For logs, exec and
//! port-forward the apiserver dials `<node InternalIP>:10250`; with an egress selector
//! it sends `CONNECT 172.30.0.11:10250 HTTP/1.1` over this socket instead, which is
//! Kubernetes' own mechanism for an apiserver outside the node network (what
//! konnectivity does). TLS stays end to end between apiserver and kubelet.
//!
//! I/O: one thread, which enters the netns with `setns(2)` before it builds its tokio
//! runtime, so every socket it opens is in that netns; the unix socket is a path in
//! the lab folder (path sockets are not bound to a netns).

use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::oneshot;

use crate::netns::Netns;

/// Longest CONNECT request head accepted (the apiserver sends about 60 bytes).
const MAX_HEAD: usize = 4096;

/// Errors of the egress proxy.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot start the lab's egress proxy on {path}: {source}")]
    Start {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the lab's egress proxy could not enter netns {netns}: {message}")]
    Netns { netns: String, message: String },
}

/// A running proxy. Dropping it stops it and removes the socket file.
#[derive(Debug)]
pub struct EgressProxy {
    path: PathBuf,
    stop_tx: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

/// What a CONNECT request asked for, or why it is refused.
#[derive(Debug, PartialEq, Eq)]
pub enum Request {
    Connect(String),
    Refused(&'static str),
}

/// Parses a request head (everything up to the blank line). Only `CONNECT host:port`
/// is served.
pub fn parse_head(head: &[u8]) -> Request {
    let Ok(text) = std::str::from_utf8(head) else {
        return Request::Refused("request head is not UTF-8");
    };
    let Some(line) = text.lines().next() else {
        return Request::Refused("empty request");
    };
    let mut parts = line.split_whitespace();
    match (parts.next(), parts.next(), parts.next()) {
        (Some("CONNECT"), Some(target), Some(v)) if v.starts_with("HTTP/1.") => {
            if target
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|port| port != 0))
            {
                Request::Connect(target.to_owned())
            } else {
                Request::Refused("CONNECT target is not host:port")
            }
        }
        _ => Request::Refused("only CONNECT is served"),
    }
}

impl EgressProxy {
    /// Listens on the unix socket `path` (replacing a stale file) and dials CONNECT
    /// targets from inside `netns`. Returns once the socket accepts connections.
    pub fn start(path: &Path, netns: &Netns) -> Result<EgressProxy, Error> {
        let start_err = |source| Error::Start {
            path: path.to_owned(),
            source,
        };
        match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(start_err(e)),
            _ => {}
        }
        let listener = std::os::unix::net::UnixListener::bind(path).map_err(start_err)?;
        listener.set_nonblocking(true).map_err(start_err)?;
        let ns_file = std::fs::File::open(netns.path()).map_err(|e| Error::Netns {
            netns: netns.name().to_owned(),
            message: e.to_string(),
        })?;
        let (stop_tx, stop_rx) = oneshot::channel();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
        let netns_name = netns.name().to_owned();
        let thread = std::thread::Builder::new()
            .name("kvpn-egress".into())
            .spawn(move || {
                if let Err(e) = nix::sched::setns(&ns_file, nix::sched::CloneFlags::CLONE_NEWNET) {
                    let _ = ready_tx.send(Err(e.to_string()));
                    return;
                }
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(format!("tokio runtime: {e}")));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let listener = match tokio::net::UnixListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e.to_string()));
                            return;
                        }
                    };
                    let _ = ready_tx.send(Ok(()));
                    serve(listener, stop_rx).await;
                });
            })
            .map_err(start_err)?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(message)) => {
                let _ = thread.join();
                return Err(Error::Netns {
                    netns: netns_name,
                    message,
                });
            }
            Err(_) => {
                let _ = thread.join();
                return Err(Error::Netns {
                    netns: netns_name,
                    message: "the proxy thread ended during start-up".into(),
                });
            }
        }
        tracing::info!(path = %path.display(), netns = %netns_name, "lab egress proxy up");
        Ok(EgressProxy {
            path: path.to_owned(),
            stop_tx: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// The unix socket the apiserver connects to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Closes the socket and every proxied connection; joins the thread.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(tx) = self.stop_tx.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for EgressProxy {
    fn drop(&mut self) {
        self.shutdown();
    }
}

async fn serve(listener: tokio::net::UnixListener, mut stop_rx: oneshot::Receiver<()>) {
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            _ = &mut stop_rx => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    tasks.spawn(handle(stream));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "lab egress proxy: accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    tasks.abort_all();
}

async fn handle(mut client: tokio::net::UnixStream) {
    let mut head = Vec::with_capacity(256);
    let mut buf = [0u8; 512];
    // Read byte chunks until the blank line; the apiserver sends nothing after the
    // head before it has read the answer, so nothing past it is consumed here.
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match client.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
        if head.len() > MAX_HEAD {
            let _ = client
                .write_all(b"HTTP/1.1 431 Request Header Fields Too Large\r\n\r\n")
                .await;
            return;
        }
    }
    let target = match parse_head(&head) {
        Request::Connect(t) => t,
        Request::Refused(why) => {
            tracing::debug!(why, "lab egress proxy: refused");
            let _ = client
                .write_all(b"HTTP/1.1 405 Method Not Allowed\r\n\r\n")
                .await;
            return;
        }
    };
    let upstream = match tokio::time::timeout(
        std::time::Duration::from_secs(10),
        tokio::net::TcpStream::connect(target.as_str()),
    )
    .await
    {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            tracing::debug!(%target, error = %e, "lab egress proxy: dial failed");
            let _ = client.write_all(b"HTTP/1.1 502 Bad Gateway\r\n\r\n").await;
            return;
        }
        Err(_) => {
            let _ = client
                .write_all(b"HTTP/1.1 504 Gateway Timeout\r\n\r\n")
                .await;
            return;
        }
    };
    let _ = upstream.set_nodelay(true);
    if client
        .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
        .await
        .is_err()
    {
        return;
    }
    let mut upstream = upstream;
    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_apiservers_connect_request() {
        let head = b"CONNECT 172.30.0.11:10250 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
        assert_eq!(
            parse_head(head),
            Request::Connect("172.30.0.11:10250".into())
        );
    }

    #[test]
    fn refuses_anything_but_connect_to_host_and_port() {
        assert!(matches!(
            parse_head(b"GET / HTTP/1.1\r\n\r\n"),
            Request::Refused(_)
        ));
        assert!(matches!(
            parse_head(b"CONNECT 172.30.0.11 HTTP/1.1\r\n\r\n"),
            Request::Refused(_)
        ));
        assert!(matches!(
            parse_head(b"CONNECT 172.30.0.11:0 HTTP/1.1\r\n\r\n"),
            Request::Refused(_)
        ));
        assert!(matches!(parse_head(b""), Request::Refused(_)));
    }
}
