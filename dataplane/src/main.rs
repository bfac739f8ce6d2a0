//! `kvpn-dataplane`: kvpn's root daemon. Serves the Dataplane gRPC API on
//! `$KVPN_RUNTIME_DIR/dataplane.sock` and logs to stderr (the CLI redirects it to
//! `$KVPN_RUNTIME_DIR/dataplane.log`). Runs in the network namespace it was
//! started in; SIGINT/SIGTERM tear all sessions down and remove the socket.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Parser;
use kvpn_dataplane::daemon::{DEFAULT_RUNTIME_DIR, Daemon, RuntimeDir};
use kvpn_dataplane::dns::{Dns, DnsSettings, guard::Guard, resolv_conf::Restored};
use kvpn_dataplane::liveness::HEARTBEAT_INTERVAL;
use kvpn_dataplane::netlink::Netlink;
use kvpn_dataplane::session::EbpfClassifiers;
use kvpn_dataplane::sweep::{Record, SweepReport};
use tokio::signal::unix::{SignalKind, signal};

/// kvpn's root daemon: TUN device, routes, eBPF classifier and packet pump.
#[derive(Debug, Parser)]
#[command(name = "kvpn-dataplane", version)]
struct Args {
    /// Directory for the gRPC socket (dataplane.sock) and the pid file.
    #[arg(long, env = "KVPN_RUNTIME_DIR", default_value = DEFAULT_RUNTIME_DIR)]
    runtime_dir: PathBuf,
    /// Log filter: error, warn, info, debug, trace, or a tracing directive list
    /// such as `kvpn_dataplane=debug`.
    #[arg(long, env = "KVPN_LOG_LEVEL", default_value = "info")]
    log_level: String,
    /// Do not serve: undo what a killed daemon of this runtime folder left (restore
    /// resolv.conf from its backup, remove its hosts-file block, delete the TUN
    /// devices it recorded and their routes) and exit. Refused while a
    /// daemon serves on the socket (it repaired when it started). `kvpn quit` and
    /// `kvpn disconnect` run this when no daemon answers.
    #[arg(long)]
    repair: bool,
    /// The one non-root uid allowed to use the gRPC socket (the user daemon's);
    /// root is always allowed, every other uid is refused (SO_PEERCRED). Default:
    /// SUDO_UID when started through sudo, PKEXEC_UID through pkexec, else root
    /// only.
    #[arg(long, env = "KVPN_ALLOW_UID")]
    allow_uid: Option<u32>,
    /// Append stdout and stderr to `<runtime-dir>/dataplane.log` (what `kvpn
    /// logs` shows). `kvpn connect` of a normal user passes it when it starts the
    /// daemon through sudo or pkexec, since the user cannot open that file. The
    /// path is fixed, not an argument, so that a sudo rule for this binary
    /// cannot be used to append to any file.
    #[arg(long)]
    log_to_runtime_dir: bool,
    /// Internal: the DNS guard the daemon starts for itself (see
    /// `dataplane/src/dns/guard.rs`): waits on stdin for the daemon to exit and,
    /// if it died without cleaning up, restores resolv.conf and the hosts file.
    #[arg(long, hide = true)]
    dns_guard: bool,
}

/// The uid that started this daemon through sudo or pkexec (`SUDO_UID`,
/// `PKEXEC_UID`: set by them, not by the caller, whose environment they reset).
fn elevating_uid() -> Option<u32> {
    ["SUDO_UID", "PKEXEC_UID"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.trim().parse().ok())
}

/// `--log-to-runtime-dir`: point stdout and stderr at the log, opened without
/// following a symlink.
fn redirect_output(runtime_dir: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt as _;
    use std::os::unix::io::AsRawFd as _;
    let path = runtime_dir.join(kvpn_dataplane::daemon::LOG_NAME);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
        .with_context(|| format!("cannot open the log {}", path.display()))?;
    for fd in [libc::STDOUT_FILENO, libc::STDERR_FILENO] {
        // SAFETY: dup2 of a descriptor we own onto a standard descriptor; no memory involved.
        if unsafe { libc::dup2(log.as_raw_fd(), fd) } < 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("cannot send output to {}", path.display()));
        }
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Started by another user through sudo or pkexec: that user chose the
    // arguments, so the runtime folder (whose files this daemon trusts at
    // start: the resolv.conf backup, the TUN records) must be root's alone.
    if let Some(uid) = elevating_uid()
        && uid != 0
    {
        RuntimeDir::prepare(&args.runtime_dir)?.require_private()?;
    }
    if args.log_to_runtime_dir {
        RuntimeDir::prepare(&args.runtime_dir)?;
        redirect_output(&args.runtime_dir)?;
    }
    let filter = tracing_subscriber::EnvFilter::try_new(&args.log_level)
        .with_context(|| format!("invalid --log-level {:?}", args.log_level))?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    if args.dns_guard {
        let settings = DnsSettings::from_env(&args.runtime_dir).map_err(anyhow::Error::msg)?;
        kvpn_dataplane::dns::guard::run(&args.runtime_dir, &Dns::new(settings));
        return Ok(());
    }
    if !nix::unistd::Uid::effective().is_root() {
        tracing::warn!(
            "not running as root: creating TUN devices, routes and eBPF programs will fail"
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kvpn-dataplane")
        .build()
        .context("cannot start the tokio runtime")?;
    runtime.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    if args.repair {
        return repair(&args.runtime_dir).await;
    }
    let allowed_uid = args.allow_uid.or_else(elevating_uid);
    let dir = RuntimeDir::prepare(&args.runtime_dir)?;
    let listener = dir.bind_for(allowed_uid)?;
    let result = serve(&dir, listener, allowed_uid).await;
    dir.cleanup();
    tracing::info!("kvpn-dataplane stopped");
    // Everything was torn down and restored: the guard has nothing to do.
    // (On an error the guard sees the pipe close and repairs what is left.)
    match result {
        Ok(guard) => {
            if let Some(guard) = guard {
                guard.release(dir.path());
            }
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// The daemon with its DNS, after undoing what an earlier (killed) daemon of
/// `runtime_dir` left: resolv.conf (case dns-06), hosts-file lines (dns-07), and
/// its recorded TUN devices with their routes (lc-02, [`kvpn_dataplane::sweep`]).
/// With `reset_tcp` (`--repair`) also the laptop TCP sockets on its sessions'
/// tunnel IPs. Returns the daemon, what could not be undone, and how many TCP
/// sockets were reset.
async fn repaired_daemon(
    runtime_dir: &std::path::Path,
    allowed_uid: Option<u32>,
    reset_tcp: bool,
) -> anyhow::Result<(Arc<Daemon>, Vec<String>, u64)> {
    let netlink = Netlink::new().context("cannot open a NETLINK_ROUTE socket")?;
    let settings = DnsSettings::from_env(runtime_dir).map_err(anyhow::Error::msg)?;
    let dns = Arc::new(Dns::new(settings));
    let mut failed = Vec::new();
    match dns.repair() {
        Ok(Restored::NothingToDo) => {}
        Ok(outcome) => {
            tracing::info!(?outcome, path = %dns.settings().resolv_conf.display(), "repaired resolv.conf left by an earlier daemon")
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot repair resolv.conf left by an earlier daemon");
            failed.push(format!("resolv.conf: {e}"));
        }
    }
    // Hosts-file entries left by a daemon that was killed (case dns-07).
    match dns.repair_hosts() {
        Ok(Restored::NothingToDo) => {}
        Ok(outcome) => {
            tracing::info!(?outcome, path = %dns.settings().hosts.display(), "removed hosts-file entries left by an earlier daemon")
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot repair the hosts file left by an earlier daemon")
        }
    }
    let daemon = Arc::new(
        Daemon::new(netlink, Arc::new(EbpfClassifiers), HEARTBEAT_INTERVAL)
            .with_dns(dns)
            .with_allowed_uid(allowed_uid)
            .with_record(Record::new(runtime_dir)),
    );
    let mut tcp_reset = 0;
    match daemon.sweep_leftovers(reset_tcp).await {
        Ok(report) if report == SweepReport::default() => {}
        Ok(report) => {
            tcp_reset = report.tcp_reset;
            tracing::info!(
                tuns = ?report.tuns,
                routes = report.routes,
                tcp_reset = report.tcp_reset,
                "removed TUN devices and routes left by an earlier daemon"
            );
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot sweep leftover TUN devices and routes");
            failed.push(format!("TUN devices and routes: {e}"));
        }
    }
    Ok((daemon, failed, tcp_reset))
}

/// `--repair`: undo an earlier daemon's leftovers without serving.
async fn repair(runtime_dir: &std::path::Path) -> anyhow::Result<()> {
    let socket = runtime_dir.join(kvpn_dataplane::daemon::SOCKET_NAME);
    if tokio::net::UnixStream::connect(&socket).await.is_ok() {
        anyhow::bail!(
            "a root daemon serves on {} — it repaired leftovers when it started; stop it \
             with `kvpn quit` instead",
            socket.display()
        );
    }
    let (_daemon, failed, tcp_reset) = repaired_daemon(runtime_dir, None, true).await?;
    if !failed.is_empty() {
        anyhow::bail!("could not undo: {}", failed.join("; "));
    }
    // For `kvpn disconnect`/`quit` (control/src/daemon.rs reads this line).
    use std::io::Write as _;
    writeln!(std::io::stdout(), "tcp_reset {tcp_reset}").context("cannot write to stdout")?;
    Ok(())
}

/// Serve until SIGTERM/SIGINT; returns the DNS guard to release after a clean
/// teardown (`None` when it could not start).
async fn serve(
    dir: &RuntimeDir,
    listener: tokio::net::UnixListener,
    allowed_uid: Option<u32>,
) -> anyhow::Result<Option<Guard>> {
    let (daemon, _failed, _) = repaired_daemon(dir.path(), allowed_uid, false).await?;
    // After the start's own repair, before any session can change resolv.conf.
    let guard = match Guard::spawn(dir.path()) {
        Ok(g) => Some(g),
        Err(e) => {
            tracing::warn!(
                error = %e,
                "cannot start the DNS guard: if this daemon dies without cleaning up, \
                 resolv.conf stays pointed at its forwarder until `kvpn quit` or the next start"
            );
            None
        }
    };
    let mut sigterm =
        signal(SignalKind::terminate()).context("cannot install the SIGTERM handler")?;
    let mut sigint =
        signal(SignalKind::interrupt()).context("cannot install the SIGINT handler")?;
    let shutdown = async move {
        tokio::select! {
            _ = sigterm.recv() => tracing::info!("SIGTERM: tearing down all sessions"),
            _ = sigint.recv() => tracing::info!("SIGINT: tearing down all sessions"),
        }
    };
    tracing::info!(socket = %dir.socket().display(), pid = std::process::id(), allowed_uid, "kvpn-dataplane serving");
    daemon
        .serve(listener, shutdown)
        .await
        .context("gRPC server failed")?;
    Ok(guard)
}
