//! `kvpn-lab-agent`: the background process of a persistent Kubernetes lab (lab-only).
//! `kvpn lab up` starts it after the control plane; it attaches to the lab, runs the
//! node services ([`kvpn_lab::k8s::cluster::NodeServices`]: API relay, kube-proxy and
//! cluster DNS stand-ins, kubelet stand-in with the pods' processes) and keeps them
//! running after `kvpn lab up` returns. `kvpn lab down` stops it with SIGTERM; it then
//! stops the pods, removes their netns, the nftables table and the DNS Service, and
//! exits with status 0.
//!
//! It runs in its own session (no controlling terminal, so closing the shell that ran
//! `kvpn lab up` does not stop the lab) and logs to stderr, which `kvpn lab up` points
//! at `<lab folder>/agent.log`.

use anyhow::Context as _;
use clap::Parser;
use tokio::signal::unix::{SignalKind, signal};

#[derive(Debug, Parser)]
#[command(about = "kvpn lab agent: runs a persistent lab's kubelet, kube-proxy, DNS and API relay")]
struct Args {
    /// Name of the persistent lab (its state file in $KVPN_LAB_STATE_DIR).
    #[arg(long)]
    lab: String,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    // Leave the caller's session; fails only if we already lead a process group, in
    // which case we are detached enough.
    if let Err(e) = nix::unistd::setsid() {
        tracing::debug!(error = %e, "setsid");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    runtime.block_on(async {
        let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
        let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
        let mut hup = signal(SignalKind::hangup()).context("SIGHUP handler")?;
        let stop = async move {
            loop {
                tokio::select! {
                    _ = term.recv() => break,
                    _ = int.recv() => break,
                    // A hang-up is not a reason to take the lab down.
                    _ = hup.recv() => continue,
                }
            }
        };
        kvpn_lab::k8s::cluster::run_agent(&args.lab, stop)
            .await
            .with_context(|| format!("kvpn-lab-agent for lab {}", args.lab))
    })
}
