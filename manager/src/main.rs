//! `kvpn-manager`: the traffic manager binary. Listens for laptops' data
//! channels and relays their traffic into the cluster (see the library docs).

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use kvpn_manager::server;
use kvpn_manager::session::SessionConfig;
use tracing::{info, warn};

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
    /// Serving certificate (PEM chain) for TLS 1.3 on the data channel. With
    /// --tls-key, every data connection must be TLS; without both, the data
    /// channel is plain TCP (static lab, `kvpn connect --manager`).
    #[arg(long, env = "KVPN_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(long, env = "KVPN_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
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
    tokio::select! {
        () = server::serve(listener, Arc::new(config), tls) => Ok(()),
        sig = shutdown_signal() => {
            info!(signal = sig?, "shutting down");
            Ok(())
        }
    }
}
