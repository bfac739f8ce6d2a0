//! `kvpn-manager`: the traffic manager binary. Listens for laptops' data
//! channels and relays their traffic into the cluster (see the library docs).

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use kvpn_manager::server;
use kvpn_manager::session::SessionConfig;
use tracing::info;

/// kvpn traffic manager: terminates laptops' tunnel packets and dials the real
/// destinations in the cluster.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Address of the data channel (framed packets from laptops).
    #[arg(long, default_value = "0.0.0.0:10801")]
    listen: SocketAddr,
    /// Give up a TCP dial after this many milliseconds (the laptop then gets
    /// ICMP host unreachable).
    #[arg(long, default_value_t = 5000)]
    dial_timeout_ms: u64,
    /// End a session after this many seconds without any frame (laptops send
    /// a heartbeat every 2 s).
    #[arg(long, default_value_t = 60)]
    idle_timeout_secs: u64,
}

async fn shutdown_signal() -> anyhow::Result<&'static str> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("cannot install the SIGTERM handler")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => { r.context("cannot install the SIGINT handler")?; Ok("SIGINT") }
        _ = term.recv() => Ok("SIGTERM"),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Plain text when the log goes to a file or pipe (the lab, kubectl logs).
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    let config = SessionConfig {
        dial_timeout: Duration::from_millis(args.dial_timeout_ms),
        idle_timeout: Duration::from_secs(args.idle_timeout_secs),
        ..SessionConfig::default()
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
    info!(listen = %bound, mtu = kvpn_manager::DEFAULT_MTU, "kvpn-manager listening");
    tokio::select! {
        () = server::serve(listener, Arc::new(config)) => Ok(()),
        sig = shutdown_signal() => {
            info!(signal = sig?, "shutting down");
            Ok(())
        }
    }
}
