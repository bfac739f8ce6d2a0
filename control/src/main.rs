//! `kvpn`: the command-line client. Parses flags, then hands off to
//! [`kvpn_control`], which talks to the root daemon over its Unix socket.

use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = kvpn_control::cli::Cli::try_parse_with_tips(std::env::args_os())
        .unwrap_or_else(|e| e.exit());
    kvpn_control::init_tracing(cli.verbose);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            kvpn_control::output::error(&format!("cannot start the async runtime: {e}"));
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(kvpn_control::run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            kvpn_control::output::error(&kvpn_control::output::error_chain(&e));
            ExitCode::FAILURE
        }
    }
}
