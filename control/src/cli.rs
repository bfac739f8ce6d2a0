//! Command-line flags of `kvpn`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use ipnet::IpNet;

/// `kvpn connect --manager` without `--tunnel-ip`: this machine's address inside the tunnel.
pub const DEFAULT_TUNNEL_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(100, 96, 0, 2));

/// kvpn puts this machine on a Kubernetes cluster's network: after `kvpn connect`,
/// pod IPs, ClusterIPs and service names are reachable over TCP, UDP and ICMP.
#[derive(Debug, Parser)]
#[command(
    name = "kvpn",
    version = kvpn_build_info::VERSION_LINE,
    about = "Put this machine on a Kubernetes cluster's network",
    long_about = "kvpn puts this machine on a Kubernetes cluster's network: after `kvpn connect`, \
pod IPs, ClusterIPs and service names (`web.default`) are reachable over TCP, UDP and ICMP, \
as if it were a pod.\n\n\
Traffic to the cluster's CIDRs is routed into a TUN device, classified by an eBPF program, \
framed by the root daemon (kvpn-dataplane) and carried to the in-cluster traffic manager \
(kvpn-manager), which terminates it in a userspace TCP/IP stack and dials the real destinations.\n\n\
Try it on the built-in lab: `kvpn lab up` (it prints the laptop's kubeconfigs), then \
`kvpn lab exec laptop -- kvpn connect --kubeconfig <the printed laptop-kvpn-user.kubeconfig>`; \
`kvpn lab exec laptop -- curl http://web.default/`."
)]
pub struct Cli {
    /// More log output on stderr (-v debug, -vv trace).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,

    /// Folder of the root daemon's socket, pid file and log (and, for root or when
    /// given, of the user daemon's; else that is $XDG_RUNTIME_DIR/kvpn). Default:
    /// $KVPN_RUNTIME_DIR, else /run/kvpn.
    #[arg(long = "runtime-dir", value_name = "RUNTIME_DIR", global = true)]
    runtime_dir_flag: Option<PathBuf>,

    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// `--runtime-dir`, else `KVPN_RUNTIME_DIR` (when not empty), else
    /// /run/kvpn. The variable is read here, not by clap's `env`: clap counts a
    /// value from the environment as given, and the usage line of its errors
    /// (`requires`, `conflicts_with`) then listed `--runtime-dir <RUNTIME_DIR>`
    /// as if the command needed it.
    pub fn runtime_dir(&self) -> PathBuf {
        runtime_dir_from(
            self.runtime_dir_flag.clone(),
            std::env::var_os("KVPN_RUNTIME_DIR"),
        )
    }

    /// Flag rules checked after clap, with their own words. `--steer` without
    /// `--allow-route-conflict`: its usage line names just those two flags.
    pub fn validate(self) -> Result<Self, clap::Error> {
        match &self.command {
            Command::Connect(a) => a.validate()?,
            Command::Run(r) => {
                r.connect.validate_run()?;
                r.connect.validate()?;
            }
            _ => {}
        }
        Ok(self)
    }
}

impl Cli {
    /// Parses `argv` (the program name first) as [`clap::Parser::try_parse_from`]
    /// does, with kvpn's tips added to clap's errors, then [`Cli::validate`]s it.
    pub fn try_parse_with_tips<I, T>(argv: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let argv: Vec<std::ffi::OsString> = argv.into_iter().map(Into::into).collect();
        Self::try_parse_from(&argv)
            .map_err(|e| with_tips(e, &argv))
            .and_then(Self::validate)
    }
}

/// The exit status for a parse error `e` of `argv` (the program name first):
/// clap's (0 for --help and --version, 2 for a usage error), but
/// [`crate::run::EXIT_RUN_FAILED`] for a usage error of `kvpn run`, whose other
/// statuses are its command's.
pub fn parse_error_exit_code(e: &clap::Error, argv: &[std::ffi::OsString]) -> u8 {
    let code = u8::try_from(e.exit_code()).unwrap_or(2);
    if code == 0 || subcommand_of(argv).as_deref() != Some("run") {
        return code;
    }
    u8::try_from(crate::run::EXIT_RUN_FAILED).unwrap_or(2)
}

/// The subcommand `argv` names (the program name first): its first word that
/// is one, before a `--`.
fn subcommand_of(argv: &[std::ffi::OsString]) -> Option<String> {
    use clap::CommandFactory as _;
    let cmd = Cli::command();
    argv.iter()
        .skip(1)
        .filter_map(|a| a.to_str())
        .take_while(|a| *a != "--")
        .find(|a| cmd.find_subcommand(a).is_some())
        .map(ToOwned::to_owned)
}

/// Adds a tip to clap's "unexpected argument" error for `--json` and `--yaml`
/// (common in other tools) on a command that has `-o/--output`: there it is
/// `-o json` / `-o yaml`.
fn with_tips(mut e: clap::Error, argv: &[std::ffi::OsString]) -> clap::Error {
    use clap::CommandFactory as _;
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if e.kind() != ErrorKind::UnknownArgument {
        return e;
    }
    let Some(ContextValue::String(arg)) = e.get(ContextKind::InvalidArg) else {
        return e;
    };
    let format = match arg.split_once('=').map_or(arg.as_str(), |(name, _)| name) {
        "--json" => "json",
        "--yaml" => "yaml",
        _ => return e,
    };
    // The (sub)command the arguments name: the last subcommand found on the way.
    let mut cmd = Cli::command();
    for a in argv.iter().skip(1).filter_map(|a| a.to_str()) {
        if let Some(sub) = cmd.find_subcommand(a) {
            cmd = sub.clone();
        }
    }
    if !cmd.get_arguments().any(|a| a.get_id() == "output") {
        return e;
    }
    let mut tips = match e.get(ContextKind::Suggested) {
        Some(ContextValue::StyledStrs(tips)) => tips.clone(),
        _ => Vec::new(),
    };
    tips.push(
        format!(
            "for {} output give '-o {format}' (--output {format})",
            format.to_uppercase()
        )
        .into(),
    );
    e.insert(ContextKind::Suggested, ContextValue::StyledStrs(tips));
    e
}

/// [`Cli::runtime_dir`] given the flag and the environment variable.
fn runtime_dir_from(flag: Option<PathBuf>, env: Option<std::ffi::OsString>) -> PathBuf {
    flag.or_else(|| env.filter(|v| !v.is_empty()).map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(crate::userd::DEFAULT_ROOT_RUNTIME_DIR))
}

/// A usage error with kvpn's words and a usage line of the flags it is about.
fn usage_error(kind: clap::error::ErrorKind, message: &str, usage: &str) -> clap::Error {
    clap::Error::raw(
        kind,
        format!("{message}\n\nUsage: {usage}\n\nFor more information, try '--help'.\n"),
    )
}

/// Whether a SOCKS listen address is reachable from this machine only
/// (127.0.0.0/8, ::1, or ::ffff:127.x.y.z).
pub fn is_loopback_listen(addr: SocketAddr) -> bool {
    addr.ip().to_canonical().is_loopback()
}

impl ConnectArgs {
    /// The flag rules of `kvpn connect` clap cannot say in kvpn's words.
    fn validate(&self) -> Result<(), clap::Error> {
        use clap::error::ErrorKind;
        if self.steer.is_some() && !self.allow_route_conflict {
            return Err(usage_error(
                ErrorKind::MissingRequiredArgument,
                "--steer needs --allow-route-conflict (it chooses how cluster-bound traffic \
                 is steered past routes that conflict with the laptop's)",
                "kvpn connect --allow-route-conflict --steer <STEER> [OPTIONS]",
            ));
        }
        if let Some(ip) = self.tunnel_ip
            && self.manager.is_none()
        {
            let mode = if self.socks {
                "SOCKS5 mode (--socks)"
            } else {
                "kubeconfig mode (no --manager)"
            };
            return Err(usage_error(
                ErrorKind::ArgumentConflict,
                &format!(
                    "--tunnel-ip {ip} is not used in {mode}: there the traffic manager leases \
                     the tunnel IP — leave --tunnel-ip out (it only sets the address with \
                     --manager HOST:PORT)"
                ),
                "kvpn connect --manager <HOST:PORT> --tunnel-ip <IP> [OPTIONS]",
            ));
        }
        if let Some(listen) = self.socks_listen
            && !self.socks_allow_remote
            && !is_loopback_listen(listen)
        {
            return Err(usage_error(
                ErrorKind::ValueValidation,
                &format!(
                    "--socks-listen {listen} is not a loopback address: other machines could \
                     reach the SOCKS5 server, which has no authentication, and use it to open \
                     connections into the cluster — listen on loopback (e.g. --socks-listen \
                     127.0.0.1:{port}), or add --socks-allow-remote to accept that risk",
                    port = listen.port()
                ),
                "kvpn connect --socks --socks-listen <IP:PORT> --socks-allow-remote [OPTIONS]",
            ));
        }
        if let Some(both) = self
            .include_suffixes
            .iter()
            .find(|s| self.exclude_suffixes.contains(s))
        {
            return Err(usage_error(
                ErrorKind::ArgumentConflict,
                &format!(
                    "{both} is given to both --include-suffix and --exclude-suffix: names \
                     under it cannot go to the cluster DNS and to the laptop's nameservers \
                     at once — keep one of the two"
                ),
                "kvpn connect --include-suffix <SUFFIX> --exclude-suffix <SUFFIX> [OPTIONS]",
            ));
        }
        Ok(())
    }

    /// The connect flags `kvpn run` refuses, each with why: they make a laptop-wide
    /// or SOCKS session, which a run is not.
    fn validate_run(&self) -> Result<(), clap::Error> {
        use clap::error::ErrorKind;
        let refused = [
            (
                self.socks || self.socks_listen.is_some() || self.socks_allow_remote,
                "the SOCKS flags (--socks, --socks-listen, --socks-allow-remote)",
                "a run gets its own TUN device, routes and DNS, not a proxy",
            ),
            (
                self.manager.is_some() || self.tunnel_ip.is_some(),
                "--manager and --tunnel-ip",
                "a run works through the Kubernetes API (--kubeconfig, --context)",
            ),
            (
                self.hosts,
                "--hosts",
                "/etc/hosts is every process's; the run's own DNS forwarder resolves Service \
                 names for the run alone",
            ),
        ];
        if let Some((_, flags, why)) = refused.iter().find(|(given, _, _)| *given) {
            return Err(usage_error(
                ErrorKind::ArgumentConflict,
                &format!("kvpn run does not take {flags}: {why} — leave them out"),
                "kvpn run [OPTIONS] -- <COMMAND>...",
            ));
        }
        Ok(())
    }

    /// `--tunnel-ip`, [`DEFAULT_TUNNEL_IP`] when not given (with --manager).
    pub fn tunnel_ip(&self) -> IpAddr {
        self.tunnel_ip.unwrap_or(DEFAULT_TUNNEL_IP)
    }

    /// `--steer`, `routes` when not given.
    pub fn steer(&self) -> Steer {
        self.steer.unwrap_or(Steer::Routes)
    }
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Connect to a traffic manager and route cluster CIDRs through a TUN device.
    Connect(Box<ConnectArgs>),
    /// Run a command that, with its children and only they, reaches the cluster:
    /// pod IPs, ClusterIPs and Service names. A session of its own (its own TUN
    /// device, routing table, cgroup and DNS forwarder; no laptop-wide route or
    /// DNS change) that ends with the command; kvpn exits with the command's
    /// status. Takes `kvpn connect`'s flags.
    ///
    /// Example: kvpn run --context staging -- curl http://web.default
    #[command(
        after_help = "Exit status: the command's (128 + N when signal N ended it); 125 when \
kvpn itself failed and the command did not run (bad flags, no command, cannot connect, a \
daemon error); 126 when the command cannot be executed, 127 when it is not found \
(docs/run.md).",
        mut_arg("socks", |a| a.hide(true)),
        mut_arg("socks_listen", |a| a.hide(true)),
        mut_arg("socks_allow_remote", |a| a.hide(true)),
        mut_arg("manager", |a| a.hide(true)),
        mut_arg("tunnel_ip", |a| a.hide(true)),
        mut_arg("hosts", |a| a.hide(true))
    )]
    Run(Box<RunArgs>),
    /// Show sessions: state, routes, counters.
    ///
    /// States (STATE column; docs/status.md has the details):
    ///   connecting    the root daemon dials the traffic manager for the first time
    ///   connected     the manager echoed a heartbeat (one every 1 s) within 3 s
    ///   reconnecting  a data connection dropped or 3 s without an echo: kvpn
    ///                 re-dials by itself
    ///   degraded      the root daemon's process runs but does not answer (stopped,
    ///                 hung): the session is kept; `sudo kill -CONT PID` resumes it
    ///   failed        cannot carry traffic and will not recover by itself; the
    ///                 reason says what to run
    ///   lost          its TUN device and routes are gone (a restarted user daemon
    ///                 could not bring it back); listed until `kvpn disconnect ID`
    ///
    /// While a session is reconnecting, kvpn re-dials (pauses of at most 2 s) and
    /// answers packets to cluster routes with ICMP host unreachable, so connections
    /// fail at once with "No route to host" instead of hanging; traffic resumes on
    /// its own when the path heals, on the same TUN device, addresses and routes.
    /// (`restoring` is the state of a session's user daemon half, in `-o json`,
    /// while a restarted user daemon brings its port-forward back.)
    /// `-` in the table: not known (e.g. counters of a session whose root daemon
    /// half is gone).
    #[command(verbatim_doc_comment)]
    Status(StatusArgs),
    /// Tear a session down (TUN device, routes, eBPF classifier, port-forward).
    Disconnect(DisconnectArgs),
    /// Live packet and byte rates per route and per Service, from the eBPF
    /// classifier's counters (outbound: laptop → cluster), refreshed every second.
    Top(TopArgs),
    /// Disconnect every session, then stop the user daemon and the root daemon.
    Quit(QuitArgs),
    /// The version and source commit of this CLI, the user daemon, the root
    /// daemon (when running; none is started for this) and each connected
    /// cluster's traffic manager. A daemon of another build than the CLI is named
    /// with the fix (`kvpn quit`), or restarted when no session exists.
    Version(VersionArgs),
    /// Print the user daemon's and the root daemon's logs.
    Logs(LogsArgs),
    /// Install or upgrade the traffic manager without connecting; with --dry-run,
    /// print every object an install would apply (for GitOps and review), touching
    /// no cluster.
    Install(Box<InstallArgs>),
    /// Remove the traffic manager and every object kvpn created in the cluster.
    Uninstall(UninstallArgs),
    /// An interactive shell (or one command, after `--`) on an SSH host, reached
    /// with the --ssh-* flags (ProxyJump chains, known_hosts checks). Full mode (the
    /// default) also joins this machine and the host with a tunnel (198.19.0.0/16,
    /// a TUN device on each side; root needed on both, and kvpn on the host:
    /// --remote-kvpn); --lite gives only the terminal. The exit code is the remote
    /// command's (128+n when a signal killed it).
    Ssh(crate::ssh::session::SshCommandArgs),
    /// (internal) The tunnel end of `kvpn ssh` (TUN device, frames on stdin/stdout).
    #[command(hide = true)]
    SshPeer(crate::ssh::peer::PeerArgs),
    /// (internal) The user daemon: holds every session's port-forwards, route
    /// watch and SSH connections; started on demand by the other commands.
    #[command(hide = true)]
    Daemon,
    /// The built-in lab: a cluster in network namespaces for trying kvpn out
    /// (runs the `kvpn-lab` program, which ships with kvpn's source tree, not with
    /// kvpn itself).
    Lab(LabArgs),
    /// Checks of the path through the traffic manager.
    #[command(subcommand)]
    Diagnose(DiagnoseCommand),
    /// Give each replica of a workload its own tunnel to the developers'
    /// laptops: a tunnel container (the manager's image) with its own lease and
    /// session, added to the pod template by server-side apply (field manager
    /// kvpn-attach). The pods reach laptops by their tunnel IPs, laptops reach
    /// each replica by its own. API servers ≥ 1.29 get a native sidecar
    /// (restartable init container), older ones a classic one (first container
    /// whose postStart hook waits for the tunnel). See docs/attach.md.
    ///
    /// Example: kvpn attach deploy/web -n shop
    ///
    /// `kvpn attach check leak|sessions deploy/NAME` runs the checks of
    /// docs/tunnel-ownership.md on an attached workload.
    #[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
    Attach(Box<AttachArgs>),
    /// Remove what `kvpn attach` added: the tunnel container, its volume and
    /// its Secret; the pod template is as before the attach.
    Detach(DetachArgs),
}

/// `kvpn attach` flags.
#[derive(Debug, Args)]
pub struct AttachArgs {
    /// KIND/NAME: deploy/NAME, sts/NAME or ds/NAME (required unless --list).
    #[arg(value_parser = crate::attach::render::parse_workload, required_unless_present = "list")]
    pub workload: Option<crate::attach::render::WorkloadRef>,
    /// List the attached replicas of the namespace (pod, phase, tunnel IP)
    /// instead of attaching.
    #[arg(long)]
    pub list: bool,
    /// Who owns the tunnel: `sidecar` (each replica its own tunnel container,
    /// lease and session) or `gateway` (no sidecar: an init container routes
    /// the tunnel range to the traffic manager, which translates every
    /// replica's traffic to its own tunnel address). See
    /// docs/tunnel-ownership.md.
    #[arg(long, value_enum, default_value_t = crate::attach::render::Via::Sidecar)]
    pub via: crate::attach::render::Via,
    #[command(subcommand)]
    pub command: Option<AttachCommand>,
    /// Output format of --list.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
    #[command(flatten)]
    pub kube: KubeArgs,
}

/// `kvpn attach` subcommands.
#[derive(Debug, Subcommand)]
pub enum AttachCommand {
    /// Check the property an attachment sells (docs/tunnel-ownership.md).
    #[command(subcommand)]
    Check(AttachCheck),
}

/// `kvpn attach check` subcommands.
#[derive(Debug, Subcommand)]
pub enum AttachCheck {
    /// Start a new pod of the workload whose app sends to this laptop's
    /// tunnel IP from its first moment (every 10 ms for 3 s): whether anything
    /// arrived outside the tunnel, and when the first datagram came through.
    /// The pod is deleted afterwards.
    Leak(AttachCheckArgs),
    /// Scale the workload to 5 replicas, have each connect to this laptop's
    /// tunnel IP, and count what the laptop side sees: sessions (leases) and
    /// distinct sources; then scale back. The app image needs sh and nc.
    Sessions(AttachCheckArgs),
}

/// `kvpn attach check …` flags.
#[derive(Debug, Args)]
pub struct AttachCheckArgs {
    /// KIND/NAME of an attached workload: deploy/NAME, sts/NAME (or ds/NAME for leak).
    #[arg(value_parser = crate::attach::render::parse_workload)]
    pub workload: crate::attach::render::WorkloadRef,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
    #[command(flatten)]
    pub kube: KubeArgs,
}

/// `kvpn detach` flags.
#[derive(Debug, Args)]
pub struct DetachArgs {
    /// KIND/NAME: deploy/NAME, sts/NAME or ds/NAME.
    #[arg(value_parser = crate::attach::render::parse_workload)]
    pub workload: crate::attach::render::WorkloadRef,
    #[command(flatten)]
    pub kube: KubeArgs,
}

/// `kvpn diagnose` subcommands.
#[derive(Debug, Subcommand)]
pub enum DiagnoseCommand {
    /// For one fresh connection to TARGET:PORT (a Service name, ClusterIP or pod
    /// IP), the source address after decapsulation in the traffic manager, at the
    /// manager pod's egress and as the backend saw it, and where it changed and
    /// why (source policy, masquerade, proxy) — or whether the flow was refused,
    /// rejected or lost. Needs a connected session.
    Source(DiagnoseSourceArgs),
}

/// `kvpn diagnose source` flags.
#[derive(Debug, Args)]
pub struct DiagnoseSourceArgs {
    /// HOST:PORT of the backend (Service name, ClusterIP or pod IP).
    #[arg(value_parser = parse_target)]
    pub target: String,
    /// One UDP datagram instead of a TCP connection.
    #[arg(long)]
    pub udp: bool,
    /// Output format (json/yaml: the report's fields as in the table).
    #[arg(short, long, value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
    /// Which cluster.
    #[command(flatten)]
    pub kube: KubeArgs,
}

/// Which cluster: the kubeconfig flags shared by the Kubernetes commands.
#[derive(Debug, Args, Clone, Default)]
pub struct KubeArgs {
    /// Kubeconfig file (default: $KUBECONFIG, a colon-separated list, else ~/.kube/config).
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
    /// Kubeconfig context (default: its current-context).
    #[arg(long)]
    pub context: Option<String>,
    /// Namespace whose services short names resolve in (default: the context's).
    #[arg(short, long, value_parser = parse_namespace)]
    pub namespace: Option<String>,
    /// Namespace of the traffic manager.
    #[arg(long, default_value = "kvpn-system", value_parser = parse_namespace)]
    pub manager_namespace: String,
    /// SSH jump hosts to the API server.
    #[command(flatten, next_help_heading = "SSH jump host to the API server")]
    pub ssh: crate::ssh::SshArgs,
}

impl KubeArgs {
    /// The kubeconfig flags as the kubeconfig module takes them.
    pub fn flags(&self) -> crate::kubeconfig::KubeFlags {
        crate::kubeconfig::KubeFlags {
            kubeconfig: self.kubeconfig.clone(),
            context: self.context.clone(),
            namespace: self.namespace.clone(),
        }
    }
}

/// `kvpn install` flags.
#[derive(Debug, Args)]
pub struct InstallArgs {
    /// Print the objects instead of applying them (no cluster is contacted; the
    /// TLS Secret is generated fresh, valid for the Service's DNS names). Apply
    /// them with `kubectl apply -f -`; developers then connect with --no-install.
    #[arg(long)]
    pub dry_run: bool,
    /// Output format of --dry-run: a YAML stream of documents, or a JSON List.
    #[arg(short = 'o', long, value_enum, default_value_t = ManifestFormat::Yaml)]
    pub output: ManifestFormat,
    /// Traffic manager image (also $KVPN_IMAGE or the settings file; see
    /// `kvpn connect --help`).
    #[arg(long, value_name = "IMAGE", value_parser = parse_image)]
    pub image: Option<String>,
    /// Secret the nodes use to pull the image (repeatable).
    #[arg(long = "image-pull-secret", value_name = "NAME", value_parser = parse_secret_name)]
    pub image_pull_secrets: Vec<String>,
    /// When the nodes pull the image.
    #[arg(long, value_name = "POLICY", value_parser = ["Always", "IfNotPresent", "Never"])]
    pub image_pull_policy: Option<String>,
    /// Whose address the cluster's backends see (see `kvpn connect --help`).
    #[arg(long, value_enum)]
    pub source_policy: Option<crate::install::SourcePolicy>,
    /// Traffic manager replicas (see `kvpn connect --help`).
    #[arg(long, value_name = "N", value_parser = parse_replicas)]
    pub replicas: Option<i32>,
    /// Kubeconfig file (default: $KUBECONFIG, a colon-separated list, else ~/.kube/config).
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
    /// Kubeconfig context (default: its current-context); also picks the settings
    /// file's per-context entry with --dry-run.
    #[arg(long)]
    pub context: Option<String>,
    /// Namespace of the traffic manager.
    #[arg(long, default_value = "kvpn-system", value_parser = parse_namespace)]
    pub manager_namespace: String,
    /// SSH jump hosts to the API server.
    #[command(flatten, next_help_heading = "SSH jump host to the API server")]
    pub ssh: crate::ssh::SshArgs,
}

/// `kvpn install --dry-run -o` formats.
#[derive(Debug, Clone, Copy, ValueEnum, Default, PartialEq, Eq)]
pub enum ManifestFormat {
    /// YAML documents separated by `---` (kubectl apply -f -).
    #[default]
    Yaml,
    /// One JSON `v1/List` (kubectl apply -f -).
    Json,
}

impl InstallArgs {
    /// The cluster flags as the other Kubernetes commands take them (no namespace).
    pub fn kube(&self) -> KubeArgs {
        KubeArgs {
            kubeconfig: self.kubeconfig.clone(),
            context: self.context.clone(),
            namespace: None,
            manager_namespace: self.manager_namespace.clone(),
            ssh: self.ssh.clone(),
        }
    }
}

/// `kvpn uninstall` flags: [`KubeArgs`] without `-n/--namespace`, which says
/// where short service names resolve and means nothing to an uninstall.
#[derive(Debug, Args)]
pub struct UninstallArgs {
    /// Kubeconfig file (default: $KUBECONFIG, a colon-separated list, else ~/.kube/config).
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
    /// Kubeconfig context (default: its current-context).
    #[arg(long)]
    pub context: Option<String>,
    /// Namespace of the traffic manager to remove.
    #[arg(long, default_value = "kvpn-system", value_parser = parse_namespace)]
    pub manager_namespace: String,
    /// Remove the manager although other laptops hold live leases on it (their
    /// sessions drop until a manager is back, then reconnect on their own to the
    /// new one).
    #[arg(long)]
    pub force: bool,
    /// SSH jump hosts to the API server.
    #[command(flatten, next_help_heading = "SSH jump host to the API server")]
    pub ssh: crate::ssh::SshArgs,
}

impl UninstallArgs {
    /// The cluster flags as the other Kubernetes commands take them (no namespace).
    pub fn kube(&self) -> KubeArgs {
        KubeArgs {
            kubeconfig: self.kubeconfig.clone(),
            context: self.context.clone(),
            namespace: None,
            manager_namespace: self.manager_namespace.clone(),
            ssh: self.ssh.clone(),
        }
    }
}

/// `kvpn run` flags and command.
#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub connect: ConnectArgs,
    /// The command and its arguments, after `--`.
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<std::ffi::OsString>,
}

/// `kvpn connect` flags.
#[derive(Debug, Args)]
pub struct ConnectArgs {
    /// Traffic manager data address, host:port: a direct TCP transport instead of
    /// installing the manager and port-forwarding through the API server.
    #[arg(
        long,
        value_name = "HOST:PORT",
        conflicts_with_all = ["kubeconfig", "context"],
        value_parser = parse_manager_addr
    )]
    pub manager: Option<String>,
    /// Traffic manager image to install or upgrade to (also $KVPN_IMAGE, or
    /// `image:` in ~/.config/kvpn/config.yaml, per context under `contexts:`).
    /// Remembered by the install: a later connect without it keeps this image (at
    /// this kvpn's version when its tag was the manager's version). Default:
    /// localhost/kvpn/manager:<version>, which `./x image manager` builds; load it
    /// into the cluster or push it to a registry (README: "Use kvpn with your own
    /// cluster").
    #[arg(long, value_name = "IMAGE", value_parser = parse_image)]
    pub image: Option<String>,
    /// A Secret (type kubernetes.io/dockerconfigjson, in the manager namespace) the
    /// nodes use to pull the manager image from a private registry (repeatable;
    /// remembered by the install like --image).
    #[arg(long = "image-pull-secret", value_name = "NAME", value_parser = parse_secret_name)]
    pub image_pull_secrets: Vec<String>,
    /// When the nodes pull the manager image (remembered by the install like
    /// --image). Kubernetes' default: IfNotPresent for a tagged image.
    #[arg(long, value_name = "POLICY", value_parser = ["Always", "IfNotPresent", "Never"])]
    pub image_pull_policy: Option<String>,
    /// Use a traffic manager someone installed (e.g. from `kvpn install --dry-run
    /// -o yaml`): write nothing to the cluster, fail with the fix when it is
    /// missing, not ready or of another version. A developer then needs only
    /// get/list/watch and pods/portforward (README: "Use kvpn with your own cluster").
    #[arg(long)]
    pub no_install: bool,
    /// A pod CIDR to route through the tunnel (repeatable).
    #[arg(long = "pod-cidr", value_name = "CIDR", value_parser = parse_cidr)]
    pub pod_cidrs: Vec<IpNet>,
    /// The service CIDR (ClusterIPs) to route through the tunnel (repeatable).
    #[arg(long = "service-cidr", value_name = "CIDR", value_parser = parse_cidr)]
    pub service_cidrs: Vec<IpNet>,
    /// Any other CIDR to route through the tunnel (repeatable).
    #[arg(long = "cidr", visible_alias = "extra-cidr", value_name = "CIDR", value_parser = parse_cidr)]
    pub extra_cidrs: Vec<IpNet>,
    /// A range kept off the tunnel even inside a cluster range (repeatable): the
    /// laptop reaches it the way it did before connect. Also for the watched
    /// routes that appear later.
    #[arg(long = "never-proxy", value_name = "CIDR", value_parser = parse_cidr)]
    pub never_proxy: Vec<IpNet>,
    /// A name the cluster resolves (repeatable): the laptop asks the cluster DNS
    /// for it and routes its addresses through the tunnel (re-resolved every
    /// 30 s). A name the cluster DNS does not know only warns.
    #[arg(long = "extra-domain", value_name = "NAME", value_parser = parse_domain)]
    pub extra_domains: Vec<String>,
    /// Names under this suffix go to the cluster DNS (repeatable), unchanged.
    #[arg(long = "include-suffix", value_name = "SUFFIX", value_parser = parse_domain)]
    pub include_suffixes: Vec<String>,
    /// Names under this suffix always go to the laptop's own nameservers
    /// (repeatable), also under the cluster domain: it wins over every other rule.
    #[arg(long = "exclude-suffix", value_name = "SUFFIX", value_parser = parse_domain)]
    pub exclude_suffixes: Vec<String>,
    /// Detect the cluster's pod and service CIDRs again instead of using the ones a
    /// previous connect cached in the manager's ConfigMap (the cache is rewritten).
    #[arg(long)]
    pub redetect_cidrs: bool,
    /// This machine's address inside the tunnel, with --manager only (default
    /// 100.96.0.2); with a kubeconfig or --socks the traffic manager leases one.
    #[arg(long, value_name = "IP")]
    pub tunnel_ip: Option<IpAddr>,
    /// TUN device name (default: the first free kvpnN).
    #[arg(long)]
    pub tun_name: Option<String>,
    /// TUN MTU in bytes, 1280 to 65534 (default: the root daemon's, 9000 for
    /// byte-stream transports).
    #[arg(long, value_parser = parse_connect_mtu)]
    pub mtu: Option<u32>,
    /// Pump workers (1 to 16): TUN queues, each with its own data connection to
    /// the traffic manager and its own smoltcp interface there. The kernel keeps
    /// each flow on one queue (by flow hash), so flows of one worker never wait
    /// behind another's. Needs a manager that understands worker shards (hello
    /// option 3); an older one gets 1 worker, with a line in the root daemon's log.
    #[arg(
        long,
        default_value_t = 1,
        value_parser = clap::value_parser!(u32).range(1..=16),
        conflicts_with = "socks"
    )]
    pub workers: u32,
    /// Also add hosts-file entries (`svc svc.ns svc.ns.svc svc.ns.svc.<domain>`) for
    /// the Services of the connected namespace, kept up to date by the route watch,
    /// for programs that do not use DNS. The root daemon writes one marked block to
    /// /etc/hosts (env KVPN_HOSTS of the root daemon) and takes it out byte for byte
    /// on disconnect. Off by default: split DNS already resolves these names.
    #[arg(long)]
    pub hosts: bool,
    /// SOCKS5 mode: no TUN device, no root daemon, no root. A SOCKS5 server
    /// (CONNECT and UDP ASSOCIATE; domain names resolve through the cluster DNS,
    /// as in `curl --socks5-hostname`) carries flows through the traffic manager.
    #[arg(long, conflicts_with = "manager")]
    pub socks: bool,
    /// Where the SOCKS5 server listens (with --socks). An address other machines
    /// can reach needs --socks-allow-remote. [default: 127.0.0.1:1080]
    // The default is written out, not clap's `default_value`: `None` says the flag
    // was not given (an existing session on another address is then no mismatch to
    // warn about). A unit test keeps the text equal to socks::DEFAULT_LISTEN.
    #[arg(long, value_name = "IP:PORT", requires = "socks", value_parser = parse_socks_listen)]
    pub socks_listen: Option<SocketAddr>,
    /// Let --socks-listen take an address that is not loopback (e.g. 0.0.0.0).
    /// RISK: the SOCKS5 server has no authentication, so anyone who can reach that
    /// address can open connections into the cluster through your session.
    #[arg(long, requires = "socks")]
    pub socks_allow_remote: bool,
    /// Connect even where a cluster range overlaps a route the laptop already has
    /// (case rt-05: e.g. a docker bridge owning the service CIDR). The laptop's
    /// route stays untouched; only cluster-bound traffic goes through kvpn: a
    /// cluster range equal to the laptop's route is not installed, and the known
    /// ClusterIPs inside the laptop's route get /32 routes through the TUN device.
    /// `kvpn status` lists the conflicts. Default: refuse such a connect.
    #[arg(long, conflicts_with = "socks")]
    pub allow_route_conflict: bool,
    /// How --allow-route-conflict steers cluster-bound traffic. `routes` (default):
    /// only with routes in the main table, as above. `ebpf`: also, when the laptop's
    /// conflicting route sits outside the main table (another VPN's `ip rule ...
    /// lookup <table>` consulted before main, where kvpn's routes are never looked
    /// at), a TC egress program on that route's device redirects the cluster-bound
    /// IPv4 packets into the TUN device with the tunnel IP as source, and the
    /// replies are translated back. IPv4 only (an IPv6 conflict there is refused);
    /// kernel >= 6.6; detached on disconnect.
    /// Needs --allow-route-conflict.
    #[arg(long, value_enum)]
    pub steer: Option<Steer>,
    /// Whose address the cluster's backends see: `snat` (the traffic manager pod's
    /// IP; smoltcp terminates), `ebpf-snat` (the pod's IP, rewritten in the pod's
    /// kernel by TC programs; BPF and NET_ADMIN) or `preserve` (this laptop's tunnel
    /// IP; the nodes must route the tunnel pool back via the manager's stable
    /// gateway, see docs/source-policy.md). Installs or updates
    /// the manager with it. Not given: an installed manager keeps its policy, a
    /// new install gets `snat`.
    #[arg(long, value_enum)]
    pub source_policy: Option<crate::install::SourcePolicy>,
    /// Run N traffic manager replicas (1 to 20; leases are shared through
    /// Kubernetes Lease objects, docs/scale.md). Installs or scales the manager
    /// to N. Not given: an installed manager keeps the replica count its
    /// Deployment has, whoever set it (`kubectl scale`, an autoscaler); a new
    /// install gets 1. Connect picks the ready replica with the fewest sessions.
    #[arg(long, value_name = "N", value_parser = parse_replicas)]
    pub replicas: Option<i32>,
    /// Which cluster (used unless --manager is given). Last, so its SSH help
    /// heading covers only the SSH flags.
    #[command(flatten)]
    pub kube: KubeArgs,
}

/// Output formats.
#[derive(Debug, Clone, Copy, ValueEnum, Default)]
pub enum OutputFormat {
    /// A table for people.
    #[default]
    Table,
    /// JSON for programs.
    Json,
    /// YAML, the same document as JSON.
    Yaml,
}

/// `kvpn status` flags.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Output format (the json/yaml fields: docs/status.md).
    #[arg(short, long, value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
}

/// `kvpn version` flags.
#[derive(Debug, Args)]
pub struct VersionArgs {
    /// Output format (json/yaml: cli, user_daemon, root_daemon, managers).
    #[arg(short, long, value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
}

/// `kvpn top` flags.
#[derive(Debug, Args)]
pub struct TopArgs {
    /// Output format (json: one document per refresh, on its own line; yaml: one
    /// `---` document per refresh; the fields: docs/usage.md, `kvpn top`).
    #[arg(short, long, value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
    /// Print one refresh (two samples one interval apart) and exit.
    #[arg(long)]
    pub once: bool,
    /// Seconds between samples (0.1 to 3600).
    #[arg(long, default_value = "1", value_parser = parse_interval, allow_hyphen_values = true)]
    pub interval: Duration,
}

/// Bounds of `kvpn top --interval`: shorter than 0.1 s the samples are mostly
/// noise; longer than an hour nobody is watching.
const TOP_INTERVAL_SECS: std::ops::RangeInclusive<f64> = 0.1..=3600.0;

/// `--interval` value parser: seconds as a decimal number within
/// [`TOP_INTERVAL_SECS`]. Rejects NaN, infinities and negatives here, so the
/// `Duration` conversion after it cannot panic.
fn parse_interval(text: &str) -> Result<Duration, String> {
    let secs: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("--interval {text:?} is not a number — give seconds between 0.1 and 3600, e.g. --interval 0.5"))?;
    if !TOP_INTERVAL_SECS.contains(&secs) {
        return Err(format!(
            "--interval {text} is out of range — give seconds between {} and {}",
            TOP_INTERVAL_SECS.start(),
            TOP_INTERVAL_SECS.end()
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// `--mtu` value parser: the TUN MTU bounds the root daemon enforces
/// ([`kvpn_dataplane::tun::MIN_MTU`], [`kvpn_dataplane::tun::MAX_MTU`]), checked
/// while parsing so a bad value fails before any cluster or laptop work.
pub(crate) fn parse_tun_mtu(text: &str) -> Result<u16, String> {
    use kvpn_dataplane::tun::{MAX_MTU, MIN_MTU};
    let range = || format!("must be between {MIN_MTU} and {MAX_MTU} bytes");
    match text.trim().parse::<u64>() {
        Ok(m) if (u64::from(MIN_MTU)..=u64::from(MAX_MTU)).contains(&m) => Ok(m as u16),
        Ok(m) => Err(format!("invalid TUN MTU {m}: {}", range())),
        Err(_) => Err(format!(
            "invalid TUN MTU {text:?}: not a number; {}",
            range()
        )),
    }
}

/// [`parse_tun_mtu`] for `kvpn connect --mtu` (a u32 on the wire).
fn parse_connect_mtu(text: &str) -> Result<u32, String> {
    parse_tun_mtu(text).map(u32::from)
}

/// `--pod-cidr`/`--service-cidr`/`--cidr` value parser: ADDRESS/PREFIX, where a
/// prefix length over 32 (IPv4) or 128 (IPv6) is named as such instead of
/// ipnet's "invalid IP address syntax", and an address with host bits set
/// (`10.1.2.3/8`) is refused with the network it would be, as `ip route` refuses
/// it ("Invalid prefix for given prefix length"): taking it silently as
/// 10.0.0.0/8 routed 16 million addresses where the user may have meant one.
/// CIDRs kvpn detects itself are normalised without a word instead
/// ([`kvpn_proto::cidr::normalise`]).
/// A domain name or suffix as typed (`db.corp.example`, `.corp.example`,
/// trailing dot allowed): lower-cased, without the dots at either end.
fn parse_domain(text: &str) -> Result<String, String> {
    // One leading dot (a suffix written `.corp.example`) and one trailing dot (a
    // fully qualified name) are spellings of the name; more are an empty label.
    let trimmed = text.trim();
    let name = trimmed.strip_prefix('.').unwrap_or(trimmed);
    let name = name.strip_suffix('.').unwrap_or(name);
    let bad = |why: &str| {
        Err(format!(
            "{text:?} is not a domain name: {why} — give one such as db.corp.example"
        ))
    };
    if name.is_empty() {
        return bad("it is empty");
    }
    if let Ok(ip) = name.parse::<IpAddr>() {
        let len = if ip.is_ipv4() { 32 } else { 128 };
        return Err(format!(
            "{text:?} is an IP address, not a domain name — to send it through the tunnel \
             give it as a range: --cidr {ip}/{len}"
        ));
    }
    if name.len() > 253 {
        return bad("longer than 253 characters");
    }
    for label in name.split('.') {
        if label.is_empty() {
            return bad("an empty label (two dots in a row)");
        }
        if label.len() > 63 {
            return bad("a label longer than 63 characters");
        }
        if !label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return bad("only letters, digits, '-' and '_' go in a label");
        }
    }
    if name
        .rsplit('.')
        .next()
        .is_some_and(|tld| tld.bytes().all(|b| b.is_ascii_digit()))
    {
        return bad("its last label is all digits, which no domain has");
    }
    Ok(name.to_ascii_lowercase())
}

fn parse_cidr(text: &str) -> Result<IpNet, String> {
    let example = "e.g. 10.244.0.0/16 or fd00:10:244::/64";
    let Some((addr, prefix)) = text.split_once('/') else {
        return Err(format!(
            "{text:?} has no prefix length — give ADDRESS/PREFIX, {example}"
        ));
    };
    let addr: IpAddr = addr.parse().map_err(|_| {
        format!("{addr:?} is no IPv4 or IPv6 address — give ADDRESS/PREFIX, {example}")
    })?;
    let (family, max) = if addr.is_ipv4() {
        ("IPv4", 32)
    } else {
        ("IPv6", 128)
    };
    let too_long =
        || format!("prefix length /{prefix} is too long: an {family} CIDR has at most /{max}");
    let prefix_len: u8 = match prefix.parse::<u32>() {
        Ok(p) if p <= max => p as u8,
        Ok(_) => return Err(too_long()),
        Err(_) => {
            return Err(format!(
                "prefix length {prefix:?} is not a number from 0 to {max} ({family}) — {example}"
            ));
        }
    };
    let net = IpNet::new(addr, prefix_len).map_err(|_| too_long())?;
    if net.trunc() != net {
        return Err(host_bits_message(net));
    }
    Ok(net)
}

/// The refusal of a CIDR whose address has bits set after its prefix length,
/// with both things the user may have meant: the whole network, or the address.
fn host_bits_message(net: IpNet) -> String {
    let host = IpNet::from(net.addr());
    format!(
        "{net} has host bits set (the address of a /{} network ends in zero bits); did you \
         mean {} (the network) or {host} (that one address)?",
        net.prefix_len(),
        net.trunc(),
    )
}

/// `--manager` value parser: HOST:PORT with a host and a port from 1 to 65535,
/// checked while parsing so a bad address is named before anything else (it was
/// reported only after the "nothing to route" check).
fn parse_manager_addr(addr: &str) -> Result<String, String> {
    let example = "write it as HOST:PORT, e.g. 172.31.255.1:10801";
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err(format!("{addr:?} has no port: {example}"));
    };
    if host.is_empty() {
        return Err(format!("{addr:?} has no host: {example}"));
    }
    match port.parse::<u16>() {
        Ok(0) | Err(_) => Err(format!(
            "{addr:?}: port {port:?} is not a number from 1 to 65535 — {example}"
        )),
        Ok(_) => Ok(addr.to_owned()),
    }
}

/// `--image` value parser: the reference grammar registries use
/// ([`crate::install::image::validate`]), checked before anything is written.
fn parse_image(image: &str) -> Result<String, String> {
    crate::install::image::validate(image)
        .map(|()| image.to_owned())
        .map_err(|e| e.to_string())
}

/// `--image-pull-secret` value parser: a Secret name (RFC 1123 subdomain).
fn parse_secret_name(name: &str) -> Result<String, String> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        });
    if ok {
        Ok(name.to_owned())
    } else {
        Err(format!(
            "{name:?} is not a Secret name (lower-case letters, digits, '-' and '.', e.g. regcred)"
        ))
    }
}

/// `--socks-listen` value parser: IP:PORT (`[IPv6]:PORT`); a name is not
/// resolved, so the address the server listens on is the one given.
fn parse_socks_listen(text: &str) -> Result<SocketAddr, String> {
    let example = "e.g. 127.0.0.1:1080 or [::1]:1080";
    let text = text.trim();
    if let Ok(addr) = text.parse::<SocketAddr>() {
        if addr.port() == 0 {
            return Err(format!(
                "{text:?} has port 0, which would make the SOCKS server listen on a port \
                 nobody is told — give a port 1-65535, {example}"
            ));
        }
        return Ok(addr);
    }
    // Say which half is wrong: the address, or a port outside 1-65535.
    if let Some((host, port)) = text.rsplit_once(':')
        && host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
            .is_ok()
    {
        return Err(match port.parse::<u64>() {
            Ok(n) => format!("{text:?}: port {n} is out of range — give a port 1-65535, {example}"),
            Err(_) => format!("{text:?}: {port:?} is not a port number (1-65535), {example}"),
        });
    }
    Err(format!(
        "{text:?} is not IP:PORT with an IP address — {example}"
    ))
}

/// `--replicas` value parser: 1 to [`crate::install::objects::MAX_REPLICAS`].
pub(crate) fn parse_replicas(text: &str) -> Result<i32, String> {
    let max = crate::install::objects::MAX_REPLICAS;
    let n: i64 = text.trim().parse().map_err(|_| {
        format!("{text:?} is not a number — give 1 to {max} replicas, e.g. --replicas 3")
    })?;
    if n < 1 {
        return Err(format!(
            "{n} replicas would leave no traffic manager to connect to — give 1 to {max}              (`kvpn uninstall` removes the manager)"
        ));
    }
    if n > i64::from(max) {
        return Err(format!(
            "{n} replicas is more than kvpn's maximum of {max} (each replica lists every lease              per grant; docs/scale.md) — give 1 to {max}, or scale the Deployment yourself              (`kubectl -n kvpn-system scale deploy/kvpn-manager --replicas {n}`; a plain              `kvpn connect` keeps that count)"
        ));
    }
    i32::try_from(n).map_err(|_| format!("{n} is out of range"))
}

/// The longest Kubernetes namespace name (an RFC 1123 label).
const NAMESPACE_MAX_LEN: usize = 63;

/// `-n/--namespace` and `--manager-namespace` value parser: a Kubernetes
/// namespace name is an RFC 1123 label (lowercase letters, digits and '-',
/// starting and ending with a letter or digit, at most 63 characters), as the
/// API server validates it. Anything else would never name a namespace, and
/// as a DNS search domain or certificate name it breaks name resolution.
pub(crate) fn parse_namespace(text: &str) -> Result<String, String> {
    let rule = "a namespace name is an RFC 1123 label: lowercase letters (a-z), digits and \
                '-', starting and ending with a letter or digit, at most 63 characters, \
                e.g. default or kvpn-system";
    let why = if text.is_empty() {
        "it is empty".to_owned()
    } else if text.len() > NAMESPACE_MAX_LEN {
        format!("it has {} characters", text.chars().count())
    } else if let Some(c) = text
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-'))
    {
        if c.is_ascii_uppercase() {
            format!("{c:?} is uppercase")
        } else {
            format!("{c:?} is not allowed")
        }
    } else if text.starts_with('-') || text.ends_with('-') {
        "it starts or ends with '-'".to_owned()
    } else {
        return Ok(text.to_owned());
    };
    Err(format!("{why}; {rule}"))
}

/// `kvpn diagnose source TARGET` value parser: HOST:PORT with a port 1-65535
/// (port 0 is no port a backend listens on). HOST is resolved later.
fn parse_target(text: &str) -> Result<String, String> {
    let (host, port) = text
        .rsplit_once(':')
        .ok_or_else(|| format!("{text:?} has no port — give HOST:PORT, e.g. web.default:80"))?;
    match port.parse::<u16>() {
        Ok(p) if p > 0 && !host.is_empty() => Ok(text.to_owned()),
        _ => Err(format!(
            "{text:?}: expected HOST:PORT with a port from 1 to 65535, e.g. web.default:80"
        )),
    }
}

/// `kvpn disconnect` flags.
#[derive(Debug, Args)]
pub struct DisconnectArgs {
    /// Session id (see `kvpn status`); without it, every session but those of
    /// `kvpn run` (they end with their command; give their id, or --all).
    pub id: Option<String>,
    /// Disconnect every session, those of `kvpn run` too (their commands get
    /// SIGTERM).
    #[arg(long, conflicts_with = "id")]
    pub all: bool,
}

/// `kvpn quit` flags.
#[derive(Debug, Args)]
pub struct QuitArgs {
    /// Also quit in every other runtime folder used in this network namespace:
    /// those of kvpn daemons running here and of session records made here
    /// (sessions started with a `--runtime-dir` of their own). `kvpn lab down`
    /// uses it in the lab's laptop.
    #[arg(long)]
    pub every_runtime_dir: bool,
}

/// `kvpn logs` flags.
#[derive(Debug, Args)]
pub struct LogsArgs {
    /// Lines of each log to print (from its end); 0 = all.
    #[arg(short = 'n', long, default_value_t = 200)]
    pub lines: usize,
    /// Keep printing what the daemons log, until interrupted.
    #[arg(short, long)]
    pub follow: bool,
}

/// `kvpn lab`'s arguments, handed to the `kvpn-lab` program as they are.
#[derive(Debug, Args)]
#[command(disable_help_flag = true)]
pub struct LabArgs {
    /// `up [--dual-stack]`, `down`, `info`, `exec ROLE -- CMD…` (`kvpn lab --help`).
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "ARGS"
    )]
    pub args: Vec<std::ffi::OsString>,
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::*;

    /// A usage error of `kvpn run` exits 125 (kvpn failed, the command did not
    /// run), other commands' keep clap's 2, --help stays 0 (#27 F21).
    #[test]
    fn run_usage_errors_exit_125_others_keep_clap_codes() {
        let code = |args: &[&str]| {
            let argv: Vec<std::ffi::OsString> = args.iter().map(Into::into).collect();
            let e = Cli::try_parse_with_tips(argv.clone())
                .map(|_| ())
                .expect_err(&format!("{args:?} was accepted"));
            parse_error_exit_code(&e, &argv)
        };
        assert_eq!(code(&["kvpn", "run", "--mtu", "lots", "--", "true"]), 125);
        assert_eq!(
            code(&["kvpn", "-v", "run", "--no-such-flag", "--", "true"]),
            125
        );
        assert_eq!(
            code(&[
                "kvpn",
                "--runtime-dir",
                "/tmp/x",
                "run",
                "--socks",
                "--",
                "true"
            ]),
            125
        );
        assert_eq!(code(&["kvpn", "run", "--help"]), 0);
        assert_eq!(code(&["kvpn", "connect", "--mtu", "lots"]), 2);
        // A later word `run` is not the subcommand.
        assert_eq!(code(&["kvpn", "top", "--interval", "0", "run"]), 2);
    }

    /// `kvpn top --interval nan|inf|-1|0` is refused by clap with the flag, the value
    /// and the range (it used to panic in `Duration::from_secs_f64`).
    #[test]
    fn top_interval_rejects_nan_inf_negative_and_zero() {
        for bad in [
            "nan", "inf", "-inf", "-1", "0", "0.05", "3601", "1e400", "soon",
        ] {
            let err = Cli::try_parse_from(["kvpn", "top", "--interval", bad])
                .expect_err(&format!("--interval {bad} was accepted"))
                .to_string();
            assert!(err.contains("--interval"), "{bad}: no flag in {err:?}");
            assert!(err.contains(bad), "{bad}: no value in {err:?}");
            assert!(
                err.contains("0.1") && err.contains("3600"),
                "{bad}: no range in {err:?}"
            );
        }
    }

    #[test]
    fn top_interval_accepts_the_range() {
        for (text, want) in [("0.1", 0.1), ("1", 1.0), ("2.5", 2.5), ("3600", 3600.0)] {
            let cli = Cli::try_parse_from(["kvpn", "top", "--interval", text])
                .unwrap_or_else(|e| panic!("--interval {text}: {e}"));
            let Command::Top(args) = cli.command else {
                panic!("not the top command: {:?}", cli.command);
            };
            assert_eq!(
                args.interval,
                Duration::from_secs_f64(want),
                "--interval {text}"
            );
        }
        let cli = Cli::try_parse_from(["kvpn", "top"]).expect("kvpn top parses");
        let Command::Top(args) = cli.command else {
            panic!("not the top command");
        };
        assert_eq!(args.interval, Duration::from_secs(1), "default --interval");
    }

    /// `kvpn diagnose source HOST:0` (or no port) is refused by clap, naming the
    /// value; ports 1-65535 pass.
    #[test]
    fn diagnose_target_rejects_port_zero() {
        for bad in ["10.244.1.250:0", "10.244.1.250", "web:", ":80", "web:65536"] {
            let err = Cli::try_parse_from(["kvpn", "diagnose", "source", bad])
                .expect_err(&format!("{bad} was accepted"))
                .to_string();
            assert!(err.contains(bad), "{bad}: no value in {err:?}");
        }
        for good in ["10.244.1.250:80", "web.default:65535", "[fd00::1]:1"] {
            let cli = Cli::try_parse_from(["kvpn", "diagnose", "source", good])
                .unwrap_or_else(|e| panic!("{good}: {e}"));
            let Command::Diagnose(DiagnoseCommand::Source(args)) = cli.command else {
                panic!("not diagnose source");
            };
            assert_eq!(args.target, good);
        }
    }

    /// `--mtu` out of the TUN bounds is refused while parsing (on main it was
    /// refused by the root daemon, after the manager install, lease and
    /// port-forward), with the same words the root daemon used.
    #[test]
    fn connect_mtu_is_checked_while_parsing() {
        for bad in ["10", "1279", "65535", "100000", "4294967296", "-1", "big"] {
            let err = Cli::try_parse_from(["kvpn", "connect", &format!("--mtu={bad}")])
                .expect_err(&format!("--mtu {bad} was accepted"))
                .to_string();
            assert!(err.contains("--mtu"), "{bad}: no flag in {err}");
            assert!(err.contains("invalid TUN MTU"), "{bad}: {err}");
            assert!(
                err.contains("between 1280 and 65534"),
                "{bad}: no range in {err}"
            );
        }
        for (good, want) in [("1280", 1280), ("9000", 9000), ("65534", 65534)] {
            let cli = Cli::try_parse_from(["kvpn", "connect", "--mtu", good])
                .unwrap_or_else(|e| panic!("--mtu {good}: {e}"));
            let Command::Connect(args) = cli.command else {
                panic!("not connect");
            };
            assert_eq!(args.mtu, Some(want));
        }
    }

    /// A CIDR with a too long prefix names the prefix length, its maximum and
    /// the flag (on main: "invalid IP address syntax").
    #[test]
    fn cidr_flags_name_a_too_long_prefix() {
        for flag in ["--pod-cidr", "--service-cidr", "--cidr"] {
            for (bad, want) in [
                ("10.0.0.0/33", "at most /32"),
                ("fd00::/129", "at most /128"),
                ("10.0.0.0/x", "not a number"),
                ("10.0.0.0", "no prefix length"),
                ("10.0.0/8", "no IPv4 or IPv6 address"),
            ] {
                let err = Cli::try_parse_from(["kvpn", "connect", flag, bad])
                    .expect_err(&format!("{flag} {bad} was accepted"))
                    .to_string();
                assert!(err.contains(flag), "{flag} {bad}: no flag in {err}");
                assert!(err.contains(want), "{flag} {bad}: no {want:?} in {err}");
            }
            let cli =
                Cli::try_parse_from(["kvpn", "connect", flag, "10.244.0.0/16", flag, "fd00::/128"])
                    .unwrap_or_else(|e| panic!("{flag}: {e}"));
            let Command::Connect(args) = cli.command else {
                panic!("not connect");
            };
            let all = [args.pod_cidrs, args.service_cidrs, args.extra_cidrs].concat();
            assert_eq!(
                all,
                vec![
                    "10.244.0.0/16".parse::<IpNet>().expect("cidr"),
                    "fd00::/128".parse().expect("cidr")
                ]
            );
        }
    }

    /// A CIDR typed with host bits set is refused, naming the network and the
    /// one address the user may have meant (on main `--cidr 10.1.2.3/8` became
    /// 10.0.0.0/8 without a word); a network address and a /32 or /128 pass.
    #[test]
    fn cidr_flags_refuse_host_bits_with_what_was_meant() {
        for flag in ["--pod-cidr", "--service-cidr", "--cidr", "--extra-cidr"] {
            for (bad, network, host) in [
                ("10.1.2.3/8", "10.0.0.0/8", "10.1.2.3/32"),
                ("10.42.2.5/24", "10.42.2.0/24", "10.42.2.5/32"),
                ("192.168.1.1/31", "192.168.1.0/31", "192.168.1.1/32"),
                ("0.0.0.1/0", "0.0.0.0/0", "0.0.0.1/32"),
                ("fd00::1/64", "fd00::/64", "fd00::1/128"),
            ] {
                let err = Cli::try_parse_from(["kvpn", "connect", flag, bad])
                    .expect_err(&format!("{flag} {bad} was accepted"))
                    .to_string();
                let want = format!(
                    "{bad} has host bits set (the address of a /{} network ends in zero \
                     bits); did you mean {network} (the network) or {host} (that one address)?",
                    bad.split_once('/').expect("prefix").1
                );
                assert!(err.contains(&want), "{flag} {bad}: no {want:?} in {err}");
                let shown = if flag == "--extra-cidr" {
                    "--cidr"
                } else {
                    flag
                };
                assert!(err.contains(shown), "{flag} {bad}: no flag in {err}");
            }
            for good in [
                "10.0.0.0/8",
                "10.1.2.3/32",
                "0.0.0.0/0",
                "fd00::/64",
                "fd00::1/128",
                "::/0",
            ] {
                let cli = Cli::try_parse_from(["kvpn", "connect", flag, good])
                    .unwrap_or_else(|e| panic!("{flag} {good}: {e}"));
                let Command::Connect(args) = cli.command else {
                    panic!("not connect");
                };
                let all = [args.pod_cidrs, args.service_cidrs, args.extra_cidrs].concat();
                assert_eq!(all, vec![good.parse::<IpNet>().expect("cidr")], "{flag}");
            }
        }
    }

    /// `kvpn status --help` lists every session state of docs/status.md's
    /// States table, one per line (on main it named only connected and
    /// reconnecting).
    #[test]
    fn status_help_lists_the_states_of_the_docs() {
        let doc = include_str!("../../docs/status.md");
        let table = doc
            .split("## States")
            .nth(1)
            .expect("docs/status.md has a States section");
        let states: Vec<&str> = table
            .lines()
            .skip_while(|l| !l.starts_with("| `"))
            .take_while(|l| l.starts_with('|'))
            .filter_map(|l| l.strip_prefix("| `")?.split('`').next())
            .collect();
        assert!(states.len() >= 6, "states read from the docs: {states:?}");
        let err = Cli::try_parse_from(["kvpn", "status", "--help"]).expect_err("--help exits");
        let help = err.to_string();
        for state in states {
            assert!(
                help.lines()
                    .any(|l| l.trim_start().starts_with(&format!("{state} "))),
                "state {state} missing from kvpn status --help:\n{help}"
            );
        }
    }

    /// `--steer` without `--allow-route-conflict` is refused with a usage
    /// line of just those two flags, also with KVPN_RUNTIME_DIR set (on main
    /// clap's line added `--runtime-dir <RUNTIME_DIR>` as if it were required).
    #[test]
    fn steer_needs_allow_route_conflict_and_says_only_that() {
        let parse = |argv: &[&str]| Cli::try_parse_from(argv).and_then(Cli::validate);
        for argv in [
            &["kvpn", "connect", "--steer", "ebpf"][..],
            &[
                "kvpn",
                "--runtime-dir",
                "/tmp/kvpn-x",
                "connect",
                "--steer",
                "routes",
            ][..],
        ] {
            let err = parse(argv).expect_err(&format!("{argv:?} was accepted"));
            assert_eq!(err.kind(), clap::error::ErrorKind::MissingRequiredArgument);
            let text = err.to_string();
            let usage = text
                .lines()
                .find(|l| l.starts_with("Usage:"))
                .unwrap_or_else(|| panic!("no usage line in {text}"));
            assert_eq!(
                usage,
                "Usage: kvpn connect --allow-route-conflict --steer <STEER> [OPTIONS]"
            );
            assert!(
                text.contains("--steer needs --allow-route-conflict"),
                "{text}"
            );
        }
        let ok = parse(&[
            "kvpn",
            "connect",
            "--allow-route-conflict",
            "--steer",
            "ebpf",
        ])
        .expect("both flags parse");
        let Command::Connect(a) = ok.command else {
            panic!("not connect");
        };
        assert_eq!(a.steer(), Steer::Ebpf);
        let plain = parse(&["kvpn", "connect"]).expect("no --steer parses");
        let Command::Connect(a) = plain.command else {
            panic!("not connect");
        };
        assert_eq!(a.steer(), Steer::Routes);
    }

    /// The long help of `kvpn <path…>`.
    fn long_help(path: &[&str]) -> String {
        let mut cmd = Cli::command();
        cmd.build();
        let mut cmd = &mut cmd;
        for name in path {
            cmd = cmd
                .find_subcommand_mut(name)
                .unwrap_or_else(|| panic!("no subcommand {name}"));
        }
        cmd.render_long_help().to_string()
    }

    /// `-o json` points at a description of its fields only where one exists:
    /// docs/status.md describes `kvpn status`'s document, not `kvpn top`'s
    /// (docs/usage.md's `kvpn top` paragraph has those) nor `kvpn diagnose source`'s.
    #[test]
    fn output_help_points_at_the_right_schema() {
        assert!(long_help(&["status"]).contains("docs/status.md"));
        let top = long_help(&["top"]);
        assert!(!top.contains("docs/status.md"), "{top}");
        assert!(top.contains("yaml"), "{top}");
        let diagnose = long_help(&["diagnose", "source"]);
        assert!(!diagnose.contains("docs/status.md"), "{diagnose}");
        // docs/usage.md's synopsis lists what `-o` takes.
        let readme = include_str!("../../docs/usage.md");
        assert!(
            readme.contains("kvpn top [--once] [-o table|json|yaml]"),
            "docs/usage.md: kvpn top synopsis"
        );
        for value in ["table", "json", "yaml"] {
            let cli = Cli::try_parse_from(["kvpn", "top", "-o", value])
                .unwrap_or_else(|e| panic!("top -o {value}: {e}"));
            assert!(matches!(cli.command, Command::Top(_)));
        }
    }

    /// `kvpn uninstall` has no `-n/--namespace` (where short service names
    /// resolve: nothing an uninstall uses); `--manager-namespace` stays.
    #[test]
    fn uninstall_takes_no_namespace_flag() {
        for flag in ["-n", "--namespace"] {
            let e = Cli::try_parse_from(["kvpn", "uninstall", flag, "default"])
                .expect_err(&format!("uninstall {flag} accepted"));
            assert_eq!(e.kind(), clap::error::ErrorKind::UnknownArgument, "{e}");
        }
        let help = long_help(&["uninstall"]);
        assert!(!help.contains("short names"), "{help}");
        let cli = Cli::try_parse_from([
            "kvpn",
            "uninstall",
            "--manager-namespace",
            "kvpn-x",
            "--context",
            "c",
        ])
        .expect("uninstall flags");
        let Command::Uninstall(a) = cli.command else {
            panic!("not uninstall");
        };
        let kube = a.kube();
        assert_eq!(kube.manager_namespace, "kvpn-x");
        assert_eq!(kube.context.as_deref(), Some("c"));
        assert_eq!(kube.namespace, None);
        // connect keeps it.
        assert!(Cli::try_parse_from(["kvpn", "connect", "-n", "default"]).is_ok());
    }

    /// `--socks-listen`'s help shows its default, the one kvpn uses.
    #[test]
    fn socks_listen_help_shows_the_default() {
        let help = long_help(&["connect"]);
        let want = format!("[default: {}]", crate::socks::DEFAULT_LISTEN);
        let at = help
            .find("--socks-listen <IP:PORT>")
            .expect("--socks-listen in help");
        let end = help[at..]
            .find("--socks-allow-remote\n")
            .expect("next flag")
            + at;
        assert!(help[at..end].contains(&want), "{}", &help[at..end]);
    }

    /// `--json` (as in other tools) on a command with `-o` is still an error,
    /// one that says to use `-o json`; elsewhere clap's error stays as it was.
    #[test]
    fn json_flag_error_suggests_output_json() {
        for (argv, format) in [
            (&["kvpn", "status", "--json"][..], "json"),
            (&["kvpn", "-v", "top", "--once", "--json"][..], "json"),
            (&["kvpn", "status", "--yaml"][..], "yaml"),
            (
                &["kvpn", "diagnose", "source", "web.default:80", "--json=1"][..],
                "json",
            ),
        ] {
            let e = Cli::try_parse_with_tips(argv.iter().copied())
                .expect_err(&format!("{argv:?} accepted"));
            assert_eq!(e.kind(), clap::error::ErrorKind::UnknownArgument, "{e}");
            let text = e.to_string();
            assert!(text.contains(&format!("'-o {format}'")), "{argv:?}: {text}");
        }
        let e = Cli::try_parse_with_tips(["kvpn", "connect", "--json"]).expect_err("accepted");
        assert!(!e.to_string().contains("-o json"), "{e}");
        assert!(Cli::try_parse_with_tips(["kvpn", "status", "-o", "json"]).is_ok());
    }

    /// A bad `--manager` is named before anything else (it was reported only
    /// after "nothing to route", i.e. only when a CIDR was given too).
    #[test]
    fn manager_address_is_validated_while_parsing() {
        for (bad, why) in [
            ("foo", "has no port"),
            (":80", "has no host"),
            ("foo:0", "from 1 to 65535"),
            ("foo:65536", "from 1 to 65535"),
            ("foo:http", "from 1 to 65535"),
        ] {
            let e = connect_args(&["kvpn", "connect", "--manager", bad])
                .expect_err(&format!("--manager {bad} accepted"));
            assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation, "{e}");
            let text = e.to_string();
            assert!(
                text.contains("--manager") && text.contains(why),
                "{bad}: {text}"
            );
            assert!(!text.contains("nothing to route"), "{text}");
        }
        for good in ["172.31.255.1:10801", "mgr.example:1", "[fd00::1]:65535"] {
            let a = connect_args(&["kvpn", "connect", "--manager", good])
                .unwrap_or_else(|e| panic!("--manager {good}: {e}"));
            assert_eq!(a.manager.as_deref(), Some(good));
        }
    }

    fn connect_args(argv: &[&str]) -> Result<ConnectArgs, clap::Error> {
        let cli = Cli::try_parse_from(argv).and_then(Cli::validate)?;
        match cli.command {
            Command::Connect(a) => Ok(*a),
            other => panic!("not connect: {other:?}"),
        }
    }

    /// `--socks-listen` on an address other machines can reach is refused
    /// unless `--socks-allow-remote` accepts the risk (on main `0.0.0.0:1081`
    /// was taken silently: an unauthenticated SOCKS5 server on the network).
    #[test]
    fn socks_listen_off_loopback_needs_allow_remote() {
        for bad in [
            "0.0.0.0:1081",
            "[::]:1080",
            "192.0.2.7:1080",
            "[fd00::1]:1080",
        ] {
            let err = connect_args(&["kvpn", "connect", "--socks", "--socks-listen", bad])
                .expect_err(&format!("--socks-listen {bad} was accepted"))
                .to_string();
            assert!(
                err.contains(&format!("--socks-listen {bad}")),
                "{bad}: {err}"
            );
            assert!(err.contains("no authentication"), "{bad}: {err}");
            assert!(err.contains("--socks-allow-remote"), "{bad}: {err}");
            let a = connect_args(&[
                "kvpn",
                "connect",
                "--socks",
                "--socks-listen",
                bad,
                "--socks-allow-remote",
            ])
            .unwrap_or_else(|e| panic!("{bad} with --socks-allow-remote: {e}"));
            assert_eq!(a.socks_listen, Some(bad.parse().expect("address")));
        }
        for good in [
            "127.0.0.1:1081",
            "127.0.0.2:1080",
            "[::1]:1080",
            "[::ffff:127.0.0.1]:1080",
        ] {
            let a = connect_args(&["kvpn", "connect", "--socks", "--socks-listen", good])
                .unwrap_or_else(|e| panic!("--socks-listen {good}: {e}"));
            assert_eq!(a.socks_listen, Some(good.parse().expect("address")));
        }
        let err = connect_args(&[
            "kvpn",
            "connect",
            "--socks",
            "--socks-listen",
            "localhost:1080",
        ])
        .expect_err("a name is no listen address")
        .to_string();
        assert!(
            err.contains("--socks-listen") && err.contains("IP:PORT"),
            "{err}"
        );
        connect_args(&["kvpn", "connect", "--socks-allow-remote"])
            .expect_err("--socks-allow-remote needs --socks");
        let help = Cli::command()
            .find_subcommand_mut("connect")
            .expect("connect")
            .render_long_help()
            .to_string();
        let flag = help
            .split("\n      --socks-allow-remote\n")
            .nth(1)
            .expect("--socks-allow-remote in kvpn connect --help");
        assert!(
            flag.contains("RISK") && flag.contains("no authentication"),
            "{help}"
        );
    }

    /// Namespace flags take RFC 1123 labels only; the error names the flag and
    /// the rule (on main `-n 'Bad_NS!'` was taken, and DNS broke later).
    #[test]
    fn namespace_flags_take_rfc_1123_labels_only() {
        let long = "a".repeat(64);
        let max = "a".repeat(63);
        let commands: [&[&str]; 3] = [
            &["kvpn", "connect"],
            &["kvpn", "uninstall"],
            &["kvpn", "diagnose", "source", "web:80"],
        ];
        for command in commands {
            for (flag, named) in [
                ("-n", "--namespace"),
                ("--namespace", "--namespace"),
                ("--manager-namespace", "--manager-namespace"),
            ] {
                // `kvpn uninstall` has no -n/--namespace (see
                // uninstall_takes_no_namespace_flag).
                if command[1] == "uninstall" && flag != "--manager-namespace" {
                    continue;
                }
                for bad in [
                    "Bad_NS!",
                    "Dev",
                    "-dev",
                    "dev-",
                    "a.b",
                    "",
                    "ns with space",
                    &long,
                ] {
                    // `--flag=VALUE`: as a separate word, "-dev" would be read
                    // as flags and "" as no value; `-n` takes the others.
                    let joined = format!("{flag}={bad}");
                    let mut argv = command.to_vec();
                    if flag.starts_with("--") {
                        argv.push(&joined);
                    } else if bad.starts_with('-') || bad.is_empty() {
                        continue;
                    } else {
                        argv.extend([flag, bad]);
                    }
                    let err = Cli::try_parse_from(&argv)
                        .expect_err(&format!("{argv:?} was accepted"))
                        .to_string();
                    assert!(err.contains(named), "{argv:?}: no flag in {err}");
                    assert!(err.contains("RFC 1123 label"), "{argv:?}: no rule in {err}");
                    assert!(err.contains("at most 63"), "{argv:?}: {err}");
                }
                for good in ["default", "kvpn-system", "a", "0ns", "a-1-b", &max] {
                    let mut argv = command.to_vec();
                    argv.extend([flag, good]);
                    Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
                }
            }
        }
    }

    /// `--tunnel-ip` without `--manager` is a usage error saying the manager
    /// leases the tunnel IP there (on main it was silently ignored).
    #[test]
    fn replicas_zero_and_absurd_counts_are_refused_with_the_flag_cause_and_fix() {
        for command in ["connect", "install"] {
            for (bad, cause) in [
                ("0", "would leave no traffic manager"),
                ("-1", "would leave no traffic manager"),
                ("21", "more than kvpn's maximum of 20"),
                ("100000", "more than kvpn's maximum of 20"),
                ("three", "is not a number"),
            ] {
                let arg = format!("--replicas={bad}");
                let err = Cli::try_parse_from(["kvpn", command, &arg])
                    .map(|_| ())
                    .expect_err(&format!("{command} {arg} was accepted"))
                    .to_string();
                assert!(err.contains("--replicas"), "{command} {arg}: {err}");
                assert!(err.contains(cause), "{command} {arg}: {err}");
                assert!(err.contains("give 1 to 20"), "{command} {arg}: {err}");
            }
            for good in ["1", "3", "20"] {
                Cli::try_parse_from(["kvpn", command, "--replicas", good])
                    .unwrap_or_else(|e| panic!("{command} --replicas {good}: {e}"));
            }
        }
    }

    #[test]
    fn tunnel_ip_is_refused_where_the_manager_leases_it() {
        for argv in [
            &["kvpn", "connect", "--tunnel-ip", "100.96.0.9"][..],
            &[
                "kvpn",
                "connect",
                "--kubeconfig",
                "/k",
                "--tunnel-ip",
                "100.96.0.9",
            ][..],
            &["kvpn", "connect", "--socks", "--tunnel-ip", "100.96.0.9"][..],
        ] {
            let err = connect_args(argv)
                .expect_err(&format!("{argv:?} was accepted"))
                .to_string();
            assert!(err.contains("--tunnel-ip 100.96.0.9"), "{argv:?}: {err}");
            assert!(
                err.contains("the traffic manager leases the tunnel IP"),
                "{argv:?}: {err}"
            );
        }
        let a = connect_args(&[
            "kvpn",
            "connect",
            "--manager",
            "10.0.0.1:10801",
            "--tunnel-ip",
            "100.96.0.9",
        ])
        .expect("--tunnel-ip with --manager");
        assert_eq!(a.tunnel_ip(), "100.96.0.9".parse::<IpAddr>().expect("ip"));
        let a = connect_args(&["kvpn", "connect", "--manager", "10.0.0.1:10801"])
            .expect("--manager alone");
        assert_eq!(a.tunnel_ip(), DEFAULT_TUNNEL_IP);
        connect_args(&["kvpn", "connect", "--kubeconfig", "/k"]).expect("kubeconfig alone");
    }

    /// The long help of every command and subcommand, hidden ones included
    /// (with its path, for messages).
    fn all_long_help() -> Vec<(String, String)> {
        fn walk(cmd: &mut clap::Command, path: String, out: &mut Vec<(String, String)>) {
            out.push((path.clone(), cmd.render_long_help().to_string()));
            for sub in cmd.get_subcommands_mut() {
                let p = format!("{path} {}", sub.get_name());
                walk(sub, p, out);
            }
        }
        let mut cmd = Cli::command();
        cmd.build();
        let mut out = Vec::new();
        walk(&mut cmd, "kvpn".into(), &mut out);
        out
    }

    /// No help text shows rustdoc syntax (on main `kvpn connect --help` said
    /// "([`Cli::validate`] says so ...)").
    #[test]
    fn help_texts_have_no_rustdoc_links() {
        let all = all_long_help();
        assert!(all.len() >= 15, "commands walked: {}", all.len());
        for (path, help) in all {
            assert!(
                !help.contains("[`"),
                "{path} --help shows a rustdoc link:\n{help}"
            );
        }
    }

    /// `--runtime-dir` wins over KVPN_RUNTIME_DIR, which wins over /run/kvpn;
    /// an empty variable counts as unset. Clap no longer reads the variable, so
    /// its usage lines never list `--runtime-dir` the user did not give
    /// (control/tests/cli_usage.rs runs the binary with the variable set).
    #[test]
    fn runtime_dir_is_the_flag_then_the_variable_then_run_kvpn() {
        let flag = Some(PathBuf::from("/f"));
        assert_eq!(
            runtime_dir_from(flag.clone(), Some("/e".into())),
            PathBuf::from("/f")
        );
        assert_eq!(
            runtime_dir_from(None, Some("/e".into())),
            PathBuf::from("/e")
        );
        assert_eq!(
            runtime_dir_from(None, Some("".into())),
            PathBuf::from("/run/kvpn")
        );
        assert_eq!(runtime_dir_from(None, None), PathBuf::from("/run/kvpn"));
        let cli = Cli::try_parse_from(["kvpn", "status", "--runtime-dir", "/x"]).expect("parses");
        assert_eq!(cli.runtime_dir_flag, Some(PathBuf::from("/x")));
        let cmd = Cli::command();
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_long() == Some("runtime-dir"))
            .expect("--runtime-dir");
        assert_eq!(arg.get_env(), None, "clap must not read KVPN_RUNTIME_DIR");
    }

    /// SOCKS5 mode has no TUN device: `--workers`, `--allow-route-conflict`
    /// and `--steer` are refused with it instead of silently ignored (a
    /// tester's finding); `--socks` alone still parses.
    #[test]
    fn socks_refuses_tun_only_flags() {
        for flags in [
            &["--workers", "2"][..],
            &["--allow-route-conflict"][..],
            &["--allow-route-conflict", "--steer", "ebpf"][..],
        ] {
            let mut argv = vec!["kvpn", "connect", "--socks"];
            argv.extend_from_slice(flags);
            let err = Cli::try_parse_from(&argv)
                .expect_err(&format!("{argv:?} was accepted"))
                .to_string();
            assert!(err.contains("cannot be used with"), "{argv:?}: {err}");
        }
        Cli::try_parse_from(["kvpn", "connect", "--socks"]).expect("--socks alone parses");
    }

    /// #29 F3: one suffix both included and excluded is refused; `kvpn run` checks
    /// its connect flags as `kvpn connect` does.
    #[test]
    fn contradicting_suffixes_are_refused_by_connect_and_run() {
        let flags = [
            "--include-suffix",
            "corp.example",
            "--exclude-suffix",
            ".corp.example",
        ];
        let err = connect_args(&[&["kvpn", "connect"][..], &flags[..]].concat())
            .expect_err("include and exclude of one suffix was accepted")
            .to_string();
        assert!(err.contains("corp.example is given to both"), "{err}");
        let run: Vec<&str> = [&["kvpn", "run"][..], &flags[..], &["--", "true"][..]].concat();
        let err = Cli::try_parse_from(&run)
            .and_then(Cli::validate)
            .expect_err("kvpn run took contradicting suffixes")
            .to_string();
        assert!(err.contains("given to both"), "{err}");
        for flags in [
            &["--hosts"][..],
            &["--socks"],
            &["--tunnel-ip", "100.96.0.9"],
        ] {
            let argv: Vec<&str> = [&["kvpn", "run"][..], flags, &["--", "true"][..]].concat();
            let err = Cli::try_parse_from(&argv)
                .and_then(Cli::validate)
                .expect_err(&format!("kvpn run took {flags:?}"))
                .to_string();
            assert!(err.contains("kvpn run does not take"), "{flags:?}: {err}");
        }
        let err = Cli::try_parse_from(["kvpn", "run", "--steer", "ebpf", "--", "true"])
            .and_then(Cli::validate)
            .expect_err("kvpn run took --steer without --allow-route-conflict")
            .to_string();
        assert!(
            err.contains("--steer needs --allow-route-conflict"),
            "{err}"
        );
    }

    /// #30 F9: a bad --socks-listen port is named as the port, not as the address.
    #[test]
    fn socks_listen_names_a_bad_port() {
        for (bad, says) in [
            ("127.0.0.1:99999", "port 99999 is out of range"),
            ("[::1]:70000", "port 70000 is out of range"),
            ("127.0.0.1:0", "port 0"),
            ("127.0.0.1:http", "\"http\" is not a port number"),
            ("localhost:1080", "not IP:PORT with an IP address"),
        ] {
            let err = connect_args(&["kvpn", "connect", "--socks", "--socks-listen", bad])
                .expect_err(&format!("--socks-listen {bad} was accepted"))
                .to_string();
            assert!(err.contains(says), "--socks-listen {bad}: {err}");
        }
    }

    /// #29 F4: names are taken as written or refused: `..x` is an empty label (not
    /// `x`), an IP address points at --cidr, a numeric top-level label is no name.
    #[test]
    fn domain_flags_refuse_what_is_no_domain_name() {
        for (flag, good, want) in [
            ("--include-suffix", ".corp.example", "corp.example"),
            (
                "--exclude-suffix",
                "Legacy.Cluster.Local.",
                "legacy.cluster.local",
            ),
            ("--extra-domain", "db.corp.example", "db.corp.example"),
        ] {
            let a = connect_args(&["kvpn", "connect", flag, good])
                .unwrap_or_else(|e| panic!("{flag} {good}: {e}"));
            let got = match flag {
                "--include-suffix" => &a.include_suffixes,
                "--exclude-suffix" => &a.exclude_suffixes,
                _ => &a.extra_domains,
            };
            assert_eq!(got, &vec![want.to_owned()], "{flag} {good}");
        }
        for (flag, bad, says) in [
            ("--include-suffix", "..x", "empty label"),
            ("--exclude-suffix", "corp.example..", "empty label"),
            ("--extra-domain", "10.0.0.1", "--cidr 10.0.0.1/32"),
            ("--extra-domain", "fd00::1", "--cidr fd00::1/128"),
            ("--include-suffix", "host.10", "all digits"),
        ] {
            let err = connect_args(&["kvpn", "connect", flag, bad])
                .expect_err(&format!("{flag} {bad} was accepted"))
                .to_string();
            assert!(err.contains(says), "{flag} {bad}: {err}");
        }
    }
}

/// `kvpn connect --steer`: how the route-conflict override steers traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Steer {
    /// Routes in the main table only.
    Routes,
    /// Routes, plus a TC redirect on devices of conflicting non-main-table routes.
    Ebpf,
}
