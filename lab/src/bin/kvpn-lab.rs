//! `kvpn-lab`: the built-in lab's command line (`kvpn lab …` runs it). Lab-only: the
//! lab's kubelet, kube-proxy and DNS stand-ins live in this crate, so the `kvpn`
//! that users install carries none of them (issue #24: no arrow kvpn-control →
//! kvpn-lab).

use std::process::ExitCode;

use clap::Parser;
use kvpn_lab::cli::LabCommand;

/// The built-in lab: a cluster in network namespaces for trying kvpn out.
#[derive(Debug, Parser)]
#[command(name = "kvpn lab", bin_name = "kvpn lab", version)]
struct Args {
    #[command(subcommand)]
    command: LabCommand,
}

fn main() -> ExitCode {
    let args = Args::parse();
    // As `kvpn` logs (KVPN_LOG): warnings only, kube's expected errors off.
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVPN_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,kube_client=off"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvpn: error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(kvpn_lab::cli::run(args.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvpn: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
