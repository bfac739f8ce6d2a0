//! The lab's API-server relay (lab-only code): a plain TCP relay that listens inside
//! the node netns on the node's uplink address (`172.31.255.1:6443`, and the
//! apiserver's own port when that differs) and connects, from the host netns, to the
//! apiserver on its loopback address (`127.x.y.z:port`), splicing bytes both ways.
//!
//! Why: the control plane runs in the host netns on a loopback address nobody in the
//! lab can reach. The relay makes the apiserver reachable exactly where a cluster's
//! apiserver is: from the laptop over the uplink (kvpn connects with only a kubeconfig
//! whose server is `https://172.31.255.1:6443`), and from pods through the
//! `kubernetes` Service (10.96.0.1:443, whose Endpoints the apiserver sets to
//! `172.31.255.1:<its port>`, DNATed there by the kube-proxy stand-in). TLS is end to
//! end: the relay never looks at the bytes, and the apiserver's serving certificate
//! names `172.31.255.1` (see [`super::control_plane`]). The laptop still has no route
//! to the pod or service CIDR; only this one port is exposed.
//!
//! I/O: the listening sockets are created on a scratch thread that entered the node
//! netns ([`Netns::run`]); the relay's own thread (a current-thread tokio runtime)
//! stays in the host netns, so its outgoing connections reach the loopback address.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::thread::JoinHandle;

use tokio::sync::oneshot;

use crate::netns::Netns;
use crate::{LabError, Result};

/// The port laptop kubeconfigs name (`https://172.31.255.1:6443`).
pub const API_PORT: u16 = 6443;

/// A running relay. Dropping it stops it like [`ApiRelay::stop`].
#[derive(Debug)]
pub struct ApiRelay {
    listen: Vec<SocketAddrV4>,
    upstream: SocketAddr,
    stop_tx: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl ApiRelay {
    /// Listens on `ip:port` for every port in `ports` (duplicates ignored) inside
    /// `netns` and relays each connection to `upstream` from the host netns. Returns
    /// once the listening sockets exist (connections queue until the thread runs).
    pub fn start(
        netns: &Netns,
        ip: Ipv4Addr,
        ports: &[u16],
        upstream: SocketAddr,
    ) -> Result<ApiRelay> {
        let mut listen: Vec<SocketAddrV4> = Vec::new();
        for p in ports {
            let addr = SocketAddrV4::new(ip, *p);
            if !listen.contains(&addr) {
                listen.push(addr);
            }
        }
        let netns_name = netns.name().to_owned();
        let to_bind = listen.clone();
        let listeners = netns.run(move || -> Result<Vec<std::net::TcpListener>> {
            to_bind
                .iter()
                .map(|addr| {
                    let l = std::net::TcpListener::bind(addr).map_err(|source| LabError::Io {
                        what: format!("cannot listen on {addr} in netns {netns_name}"),
                        source,
                    })?;
                    l.set_nonblocking(true).map_err(|source| LabError::Io {
                        what: format!("cannot make the listener on {addr} non-blocking"),
                        source,
                    })?;
                    Ok(l)
                })
                .collect()
        })??;
        let (stop_tx, stop_rx) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name(format!("api-relay-{ip}"))
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        tracing::error!(error = %e, "api relay: cannot start its runtime");
                        return;
                    }
                };
                runtime.block_on(serve(listeners, upstream, stop_rx));
            })
            .map_err(|source| LabError::Io {
                what: "cannot start the api relay thread".into(),
                source,
            })?;
        tracing::info!(?listen, %upstream, "api relay up");
        Ok(ApiRelay {
            listen,
            upstream,
            stop_tx: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// Where it listens (inside the node netns).
    pub fn listen(&self) -> &[SocketAddrV4] {
        &self.listen
    }

    /// Where it connects to (the apiserver in the host netns).
    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// Closes the listeners and every relayed connection; joins the thread.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(tx) = self.stop_tx.take() {
            let _ = tx.send(());
        }
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("api relay: its thread panicked");
        }
    }
}

impl Drop for ApiRelay {
    fn drop(&mut self) {
        self.shutdown();
    }
}

async fn serve(
    listeners: Vec<std::net::TcpListener>,
    upstream: SocketAddr,
    stop_rx: oneshot::Receiver<()>,
) {
    let mut tasks = tokio::task::JoinSet::new();
    for l in listeners {
        let listener = match tokio::net::TcpListener::from_std(l) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "api relay: cannot register a listener");
                continue;
            }
        };
        tasks.spawn(accept_loop(listener, upstream));
    }
    // Dropping the JoinSet aborts the accept loops and, with them, every connection
    // task (they live in the loops' own JoinSets).
    let _ = stop_rx.await;
    tasks.shutdown().await;
}

async fn accept_loop(listener: tokio::net::TcpListener, upstream: SocketAddr) {
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((client, peer)) => {
                    conns.spawn(relay_one(client, peer, upstream));
                }
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "api relay: accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

async fn relay_one(mut client: tokio::net::TcpStream, peer: SocketAddr, upstream: SocketAddr) {
    let mut server = match tokio::net::TcpStream::connect(upstream).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(%peer, %upstream, error = %e, "api relay: apiserver unreachable");
            return;
        }
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    match tokio::io::copy_bidirectional(&mut client, &mut server).await {
        Ok((up, down)) => {
            tracing::trace!(%peer, up, down, "api relay: connection closed");
        }
        Err(e) => tracing::debug!(%peer, error = %e, "api relay: connection ended"),
    }
}
