//! `kvpn`: the command-line client. Parses flags, then hands off to
//! [`kvpn_control`], which talks to the root daemon over its Unix socket.

use std::process::ExitCode;

fn main() -> ExitCode {
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let cli = match kvpn_control::cli::Cli::try_parse_with_tips(argv.clone()) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(kvpn_control::cli::parse_error_exit_code(&e, &argv));
        }
    };
    kvpn_control::init_tracing(cli.verbose);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            kvpn_control::output::error(&format!("cannot start the async runtime: {e}"));
            return match cli.command {
                kvpn_control::cli::Command::Run(_) => {
                    ExitCode::from(kvpn_control::run::EXIT_RUN_FAILED as u8)
                }
                _ => ExitCode::FAILURE,
            };
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
