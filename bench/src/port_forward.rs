//! The raw port-forward baseline: a plain forwarder in the laptop netns, listening on
//! loopback ports and carrying each accepted connection over its own
//! `pods/portforward` request to the same pod (kube-rs's websocket port-forward,
//! the client library and protocol kvpn's own data channel uses), with nothing of
//! kvpn's in between: no TLS inside, no TUN, no manager.
//!
//! Not `kubectl port-forward`: when one forwarded connection fails (iperf3's server
//! closes a data stream at the end of a test while bytes are in flight: `write:
//! broken pipe` in the pod's netns), kubectl ends the whole port-forward ("lost
//! connection to pod"), and iperf3's control connection with it, so no iperf3 run
//! through it ever reported (seen with kubectl 1.32 against the lab's 1.20 API
//! server). Here each connection stands alone, as in kvpn.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::thread::JoinHandle;

use anyhow::{Context, Result, anyhow};
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kvpn_lab::netns::Netns;

/// A running forwarder; [`RawPortForward::stop`] ends it.
pub struct RawPortForward {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<Result<()>>>,
}

impl RawPortForward {
    /// Starts forwarding `127.0.0.1:<local>` in `netns` to port `remote` of pod
    /// `namespace/pod` for each `(local, remote)`, with the API identity of
    /// `kubeconfig`; returns once every port listens.
    pub fn start(
        netns: &Netns,
        kubeconfig: &Path,
        namespace: &str,
        pod: &str,
        ports: &[(u16, u16)],
    ) -> Result<Self> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<()>>();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (netns, kubeconfig) = (netns.clone(), kubeconfig.to_path_buf());
        let (namespace, pod, ports) = (namespace.to_owned(), pod.to_owned(), ports.to_vec());
        let thread = std::thread::spawn(move || -> Result<()> {
            let fail = ready_tx.clone();
            let run = netns.run(move || -> Result<()> {
                // Built inside the netns: the runtime's worker threads inherit it,
                // so the API connections and the listeners are the laptop's.
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()?;
                rt.block_on(serve(
                    &kubeconfig,
                    &namespace,
                    &pod,
                    &ports,
                    ready_tx,
                    stop_rx,
                ))
            });
            let result = run.map_err(anyhow::Error::new).and_then(|r| r);
            if let Err(e) = &result {
                let _ = fail.send(Err(anyhow!("{e:#}")));
            }
            result
        });
        let mut this = RawPortForward {
            stop: Some(stop_tx),
            thread: Some(thread),
        };
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(this),
            Ok(Err(e)) => {
                this.stop();
                Err(e.context("the raw port-forward did not start"))
            }
            Err(_) => {
                let e = this.join();
                Err(anyhow!(
                    "the raw port-forward's thread ended before it listened: {e:?}"
                ))
            }
        }
    }

    /// Ends the forwarder (its listeners and every connection) and waits for it.
    pub fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = self.join();
    }

    fn join(&mut self) -> Result<()> {
        match self.thread.take() {
            Some(t) => t
                .join()
                .map_err(|_| anyhow!("the raw port-forward's thread panicked"))?,
            None => Ok(()),
        }
    }
}

impl Drop for RawPortForward {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn serve(
    kubeconfig: &Path,
    namespace: &str,
    pod: &str,
    ports: &[(u16, u16)],
    ready: std::sync::mpsc::Sender<Result<()>>,
    stop: tokio::sync::oneshot::Receiver<()>,
) -> Result<()> {
    let config = kube::config::Kubeconfig::read_from(kubeconfig)
        .with_context(|| format!("kubeconfig {}", kubeconfig.display()))?;
    let config = kube::Config::from_custom_kubeconfig(config, &Default::default())
        .await
        .with_context(|| format!("kubeconfig {}", kubeconfig.display()))?;
    let pods: Api<Pod> = Api::namespaced(kube::Client::try_from(config)?, namespace);
    let mut accept = tokio::task::JoinSet::new();
    for &(local, remote) in ports {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, local));
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("listen on {addr}"))?;
        let (pods, pod) = (pods.clone(), pod.to_owned());
        accept.spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((mut conn, _)) = listener.accept().await else {
                    continue;
                };
                let _ = conn.set_nodelay(true);
                let (pods, pod) = (pods.clone(), pod.clone());
                conns.spawn(async move {
                    let Ok(mut pf) = pods.portforward(&pod, &[remote]).await else {
                        return;
                    };
                    if let Some(mut upstream) = pf.take_stream(remote) {
                        let _ = tokio::io::copy_bidirectional(&mut conn, &mut upstream).await;
                    }
                    drop(pf);
                });
                // Reap finished connections so the set stays small.
                while conns.try_join_next().is_some() {}
            }
        });
    }
    let _ = ready.send(Ok(()));
    let _ = stop.await;
    accept.shutdown().await;
    Ok(())
}
