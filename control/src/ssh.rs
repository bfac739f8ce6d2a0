//! SSH jump hosts for the API server (issue [ssh] items 1–2): when the API server is
//! reachable only from a bastion, `kvpn connect --ssh-addr …` (or `--ssh-alias`, with
//! `--ssh-jump` or ProxyJump chains) opens an SSH connection through every hop, offers
//! one loopback listener whose connections become `direct-tcpip` channels to the API
//! server, and the kube client talks to that listener with the kubeconfig's own TLS
//! server name, so the API server's certificate still verifies.
//!
//! Who uses it: the CLI for the duration of `kvpn connect`/`uninstall` (install, CIDR
//! detection, lease) and the session agent for its whole life (port-forwards, route
//! watch). The agent opens its own SSH connection from the [`SshPlan`] the CLI
//! resolved, passed in the environment (never on the command line: passwords).
//!
//! Parts: [`resolve_plan`] (pure: flags + `~/.ssh/config` lookups → the ordered hops,
//! ProxyJump cycle detection, case ssh-01), [`known_hosts`] (pure host-key decisions,
//! case ssh-03), [`client`] (russh: dial hop by hop, host keys, authentication with
//! ssh-agent, key files and passwords, case ssh-02) and [`tunnel`] (the loopback
//! listener, keepalives and reconnect).
//!
//! [`bypass`] is item 4, the SSH data-plane bypass: when the last hop reaches the
//! traffic manager Service's ClusterIP, the session agent carries the data channel
//! over `direct-tcpip` channels to it instead of port-forwarding.
//!
//! [`gssapi`] is item 3, Kerberos login (`gssapi-with-mic`, RFC 4462) through the
//! system's MIT GSSAPI library: `--gssapi-password`, `--gssapi-keytab`,
//! `--gssapi-cache`, or the default credential cache.

pub mod bypass;
pub mod client;
pub mod config;
pub mod direct_path;
pub mod gssapi;
pub mod known_hosts;
pub mod peer;
pub mod session;
pub mod terminal;
pub mod tunnel;

use std::path::{Path, PathBuf};

use clap::{Args, Parser};
use serde::{Deserialize, Serialize};

pub use tunnel::{SshDialer, SshTunnel};

/// Default SSH port.
pub const SSH_PORT: u16 = 22;

/// The longest hop chain accepted (a guard against configs that grow without a cycle).
pub const MAX_HOPS: usize = 16;

/// Environment variable that carries a resolved [`SshPlan`] (JSON) to the session agent.
pub const PLAN_ENV: &str = "KVPN_SSH_PLAN";

/// Flags of one SSH hop, as given on the command line or inside `--ssh-jump`.
#[derive(Debug, Args, Clone, Default, PartialEq, Eq)]
pub struct HopFlags {
    /// SSH host, HOST[:PORT] (port 22 by default): for `kvpn ssh` the host of the
    /// shell, for `kvpn connect` the jump host that reaches the API server.
    #[arg(long, value_name = "HOST[:PORT]")]
    pub ssh_addr: Option<String>,
    /// SSH user (default: the config's User, else the current user).
    #[arg(long, value_name = "USER", value_parser = non_empty_user)]
    pub ssh_username: Option<String>,
    /// SSH password, tried before ssh-agent keys and key files (kept in the user
    /// daemon's session record while connected; prefer keys).
    #[arg(long, value_name = "PASSWORD")]
    pub ssh_password: Option<String>,
    /// SSH private key file (a passphrase-protected one must be loaded in ssh-agent).
    #[arg(long, value_name = "PATH")]
    pub ssh_keyfile: Option<PathBuf>,
    /// A `Host` alias of the SSH config (HostName, User, Port, IdentityFile, ProxyJump).
    #[arg(long, value_name = "ALIAS", conflicts_with = "ssh_addr")]
    pub ssh_alias: Option<String>,
    /// Kerberos (GSSAPI) login with this password for the principal --ssh-username
    /// (tickets kept in memory only; the password is kept in the user daemon's session
    /// record while connected, like --ssh-password; prefer a keytab or kinit tickets).
    #[arg(long, value_name = "PASSWORD", conflicts_with_all = ["gssapi_keytab", "gssapi_cache"])]
    pub gssapi_password: Option<String>,
    /// Kerberos (GSSAPI) login with the key of --ssh-username from this keytab.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["gssapi_password", "gssapi_cache"])]
    pub gssapi_keytab: Option<PathBuf>,
    /// Kerberos (GSSAPI) login with the tickets in this credential cache (as from
    /// `kinit -c PATH`); without any --gssapi-* flag the default cache is tried last.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["gssapi_password", "gssapi_keytab"])]
    pub gssapi_cache: Option<PathBuf>,
    /// The hop before this one, as its own --ssh-* flags in one string, e.g.
    /// --ssh-jump "--ssh-addr bastion:22 --ssh-username ops" (nests for longer chains).
    #[arg(long, value_name = "FLAGS", allow_hyphen_values = true)]
    pub ssh_jump: Option<String>,
}

impl HopFlags {
    /// Whether any hop is asked for.
    pub fn is_set(&self) -> bool {
        self.ssh_addr.is_some() || self.ssh_alias.is_some()
    }
}

/// The SSH flags of a command: the last hop (with its `--ssh-jump` chain) and the
/// settings shared by every hop.
#[derive(Debug, Args, Clone, Default)]
pub struct SshArgs {
    #[command(flatten)]
    pub hop: HopFlags,
    /// SSH config file for --ssh-alias and ProxyJump (default ~/.ssh/config).
    #[arg(long, env = "KVPN_SSH_CONFIG", value_name = "PATH")]
    pub ssh_config: Option<PathBuf>,
    /// known_hosts file every SSH host's key is checked against, for all hops
    /// (default ~/.ssh/known_hosts).
    #[arg(long, env = "KVPN_SSH_KNOWN_HOSTS", value_name = "PATH")]
    pub ssh_known_hosts: Option<PathBuf>,
    /// Accept and record the key of an SSH host (any hop) not yet in known_hosts (a
    /// changed key is always refused).
    #[arg(long)]
    pub ssh_accept_new: bool,
}

/// `--ssh-username`'s value: a name, not empty.
fn non_empty_user(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Err("the user name is empty — give the login name, e.g. --ssh-username ops".into());
    }
    Ok(s.to_owned())
}

/// Flags whose values are secrets, never echoed in messages or logs.
const SECRET_FLAGS: [&str; 2] = ["--ssh-password", "--gssapi-password"];

/// Flags shared by every hop: given once, outside `--ssh-jump`.
const TOP_LEVEL_FLAGS: [&str; 3] = ["--ssh-known-hosts", "--ssh-accept-new", "--ssh-config"];

/// `value` (an `--ssh-jump` string) with the values of [`SECRET_FLAGS`] replaced by
/// `***`, nested `--ssh-jump` strings too; the secret values found are added to
/// `secrets`.
fn redact_jump(value: &str, secrets: &mut Vec<String>) -> String {
    let Some(words) = shlex::split(value) else {
        // Unbalanced quotes: words may be cut anywhere, so everything after the
        // first secret flag goes.
        let mut out = Vec::new();
        for w in value.split_whitespace() {
            let flag = w.split_once('=').map_or(w, |(f, _)| f);
            if SECRET_FLAGS.contains(&flag) {
                out.push(format!("{flag} ***"));
                return out.join(" ");
            }
            out.push(w.to_owned());
        }
        return out.join(" ");
    };
    let mut out = Vec::with_capacity(words.len());
    let mut it = words.into_iter();
    while let Some(w) = it.next() {
        if let Some((flag, v)) = w.split_once('=') {
            if SECRET_FLAGS.contains(&flag) {
                secrets.push(v.to_owned());
                out.push(format!("{flag}=***"));
                continue;
            }
            if flag == "--ssh-jump" {
                out.push(format!("{flag}={}", redact_jump(v, secrets)));
                continue;
            }
        }
        let secret = SECRET_FLAGS.contains(&w.as_str());
        let jump = w == "--ssh-jump";
        out.push(w);
        if secret {
            if let Some(v) = it.next() {
                secrets.push(v);
                out.push("***".into());
            }
        } else if jump && let Some(v) = it.next() {
            out.push(redact_jump(&v, secrets));
        }
    }
    shlex::try_join(out.iter().map(String::as_str)).unwrap_or_else(|_| out.join(" "))
}

/// An `--ssh-jump` error that echoes `value` and `why` with their secrets redacted.
fn bad_jump(value: &str, why: &str) -> Error {
    let mut secrets = Vec::new();
    let value = redact_jump(value, &mut secrets);
    let mut why = why.to_owned();
    for s in secrets.iter().filter(|s| !s.is_empty()) {
        why = why.replace(s.as_str(), "***");
    }
    Error::BadJump { value, why }
}

/// Every explicitly given `--ssh-keyfile` of `flags` and its `--ssh-jump` chain (a
/// default or config IdentityFile that does not exist is skipped later, as ssh does).
fn check_keyfiles(flags: &HopFlags) -> Result<(), Error> {
    if let Some(k) = &flags.ssh_keyfile {
        check_keyfile(k)?;
    }
    // resolve_hops has parsed the chain already: a string that does not parse here
    // was refused there.
    let inner = flags
        .ssh_jump
        .as_deref()
        .and_then(shlex::split)
        .and_then(|words| JumpFlags::try_parse_from(words).ok());
    match inner {
        Some(j) => check_keyfiles(&j.hop),
        None => Ok(()),
    }
}

/// An explicitly given `--ssh-keyfile`: it must exist, be readable and be a private key.
fn check_keyfile(path: &Path) -> Result<(), Error> {
    let bad = |why: String| Error::KeyFile {
        path: path.to_owned(),
        why,
    };
    let mut head = [0u8; 64];
    let n = std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read(&mut f, &mut head))
        .map_err(|e| {
            bad(if e.kind() == std::io::ErrorKind::NotFound {
                "the file does not exist — give the path of your private key".into()
            } else {
                format!("cannot read it ({e}) — check the path and its permissions")
            })
        })?;
    let head = String::from_utf8_lossy(&head[..n]);
    let public = path.extension().is_some_and(|x| x == "pub")
        || ["ssh-", "ecdsa-sha2-", "sk-"]
            .iter()
            .any(|p| head.starts_with(p));
    if public {
        return Err(bad(
            "this is a public key; give the private key (the same path without .pub)".into(),
        ));
    }
    Ok(())
}

/// `--ssh-jump`'s value parsed as flags.
#[derive(Debug, Parser)]
#[command(name = "--ssh-jump", no_binary_name = true)]
struct JumpFlags {
    #[command(flatten)]
    hop: HopFlags,
}

/// One SSH server on the way to the API server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hop {
    /// What the user called it (alias, or host:port), for messages.
    pub label: String,
    /// Where to connect: a name or address as the *previous* hop resolves it.
    pub host: String,
    pub port: u16,
    pub user: String,
    /// Key files to offer, in order (explicit flag first, then the config's).
    pub identity_files: Vec<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub password: Option<String>,
    /// Kerberos credentials from a --gssapi-* flag; `None` = the default cache, if
    /// it holds any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gssapi: Option<gssapi::Creds>,
}

impl Hop {
    /// `user@host:port`, for messages.
    pub fn display(&self) -> String {
        let what = format!("{}@{}:{}", self.user, self.host, self.port);
        if self.label == format!("{}:{}", self.host, self.port) {
            what
        } else {
            format!("{} ({what})", self.label)
        }
    }
}

/// Everything needed to open the SSH path: the hops in dialling order (the first
/// one is dialled from the laptop, the last one dials the API server) and the
/// host-key policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SshPlan {
    pub hops: Vec<Hop>,
    pub known_hosts: PathBuf,
    pub accept_new: bool,
    /// SSH keepalive interval in ms; `None` = [`client::KEEPALIVE_INTERVAL`]. The
    /// session agent shortens it ([`bypass::SESSION_KEEPALIVE`]) so a black-holed
    /// jump host is given up and redialled within seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keepalive_ms: Option<u64>,
    /// The CLI's `KRB5CCNAME`, for hops without a --gssapi-* flag: the user daemon,
    /// started earlier, may have another (or none) in its environment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_ccache: Option<String>,
}

impl SshPlan {
    /// `a -> b -> c`, for messages.
    pub fn describe(&self) -> String {
        self.hops
            .iter()
            .map(Hop::display)
            .collect::<Vec<_>>()
            .join(" -> ")
    }

    /// The SSH keepalive interval of every hop.
    pub fn keepalive_interval(&self) -> std::time::Duration {
        self.keepalive_ms
            .map_or(client::KEEPALIVE_INTERVAL, std::time::Duration::from_millis)
    }

    /// The plan for the session agent's environment ([`PLAN_ENV`]).
    pub fn to_env(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The plan from [`PLAN_ENV`]'s value.
    pub fn from_env(value: &str) -> Result<Self, Error> {
        serde_json::from_str(value).map_err(|e| Error::BadPlan(e.to_string()))
    }
}

/// What the SSH config says about one `Host` (the fields kvpn uses).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostEntry {
    pub host_name: Option<String>,
    pub user: Option<String>,
    pub port: Option<u16>,
    pub identity_files: Vec<PathBuf>,
    /// `ProxyJump` hops; `None` when unset, empty for `ProxyJump none`.
    pub proxy_jump: Option<Vec<String>>,
    /// `UserKnownHostsFile` (the first file when it names several, `~`
    /// expanded); `None` when unset.
    pub known_hosts: Option<PathBuf>,
}

/// Errors of SSH option handling and the SSH path. Each names the hop, the cause
/// and the fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{flag} {value:?}: {why}")]
    BadFlag {
        flag: &'static str,
        value: String,
        why: String,
    },
    #[error(
        "--ssh-jump {value:?}: {why} — give the previous hop's flags, e.g. --ssh-jump \"--ssh-addr bastion:22 --ssh-username ops\""
    )]
    BadJump { value: String, why: String },
    #[error("--ssh-keyfile {}: {why}", path.display())]
    KeyFile { path: PathBuf, why: String },
    #[error("ProxyJump cycle: {chain} — fix the ProxyJump lines of {config}")]
    Cycle { chain: String, config: String },
    #[error(
        "the SSH chain is longer than {MAX_HOPS} hops ({chain}) — check the ProxyJump lines of {config}"
    )]
    TooLong { chain: String, config: String },
    #[error("SSH config {path}: {why} — fix the file or pass another with --ssh-config")]
    Config { path: PathBuf, why: String },
    #[error(
        "SSH alias {alias:?} has no HostName in {config} and is not an address — add `Host {alias}` with a HostName, or use --ssh-addr"
    )]
    UnknownAlias { alias: String, config: String },
    #[error(
        "cannot tell which user to log in as on {host}: no --ssh-username, no User in the SSH config, no USER/LOGNAME and no passwd entry for this uid — pass --ssh-username"
    )]
    NoUser { host: String },
    #[error("the session agent's SSH settings are unreadable ({0}) — run `kvpn connect` again")]
    BadPlan(String),
}

/// Where the hops are looked up: `Host` entries by name.
pub trait HostLookup {
    /// The entry for `name`, or a default (all `None`) when no `Host` matches.
    fn lookup(&self, name: &str) -> HostEntry;
    /// The config file, for messages.
    fn describe(&self) -> String;
}

/// No SSH config (the file does not exist).
pub struct NoConfig;

impl HostLookup for NoConfig {
    fn lookup(&self, _name: &str) -> HostEntry {
        HostEntry::default()
    }
    fn describe(&self) -> String {
        "(no SSH config file)".into()
    }
}

/// `host[:port]` / `[v6]:port` / `user@host:port` (a ProxyJump or --ssh-addr value).
pub fn parse_destination(s: &str) -> Option<(Option<String>, String, Option<u16>)> {
    let s = s.trim();
    let s = s.strip_prefix("ssh://").unwrap_or(s);
    let (user, rest) = match s.rsplit_once('@') {
        Some((u, r)) if !u.is_empty() => (Some(u.to_owned()), r),
        Some(_) => return None,
        None => (None, s),
    };
    let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
        let (h, after) = v6.split_once(']')?;
        match after.strip_prefix(':') {
            Some(p) => (h.to_owned(), Some(p.parse::<u16>().ok()?)),
            None if after.is_empty() => (h.to_owned(), None),
            None => return None,
        }
    } else if rest.matches(':').count() > 1 {
        // A bare IPv6 address.
        (rest.to_owned(), None)
    } else {
        match rest.split_once(':') {
            Some((h, p)) => (h.to_owned(), Some(p.parse::<u16>().ok()?)),
            None => (rest.to_owned(), None),
        }
    };
    if host.is_empty() || port == Some(0) || host.contains(char::is_whitespace) {
        return None;
    }
    Some((user, host, port))
}

/// Resolves the flags of the last hop (and, through `--ssh-jump` and ProxyJump, every
/// hop before it) into the hops in dialling order. Pure: `lookup` is the SSH config,
/// `default_user` the login user when nothing else names one.
pub fn resolve_hops(
    flags: &HopFlags,
    lookup: &dyn HostLookup,
    default_user: Option<&str>,
) -> Result<Vec<Hop>, Error> {
    let mut hops = match &flags.ssh_jump {
        Some(jump) => {
            let words = shlex::split(jump).ok_or_else(|| bad_jump(jump, "unbalanced quotes"))?;
            let top_level = words
                .iter()
                .map(|w| w.split_once('=').map_or(w.as_str(), |(f, _)| f))
                .find(|w| TOP_LEVEL_FLAGS.contains(w));
            let parsed = JumpFlags::try_parse_from(words.iter()).map_err(|e| {
                let mut why = e.to_string().lines().next().unwrap_or_default().to_owned();
                if let Some(flag) = top_level {
                    why.push_str(&format!(
                        " ({flag} is not a per-hop flag: give it once, outside --ssh-jump; \
                         --ssh-known-hosts, --ssh-accept-new and --ssh-config apply to every hop)"
                    ));
                }
                bad_jump(jump, &why)
            })?;
            if !parsed.hop.is_set() {
                return Err(bad_jump(
                    jump,
                    "it names no host (--ssh-addr or --ssh-alias)",
                ));
            }
            resolve_hops(&parsed.hop, lookup, default_user)?
        }
        None => Vec::new(),
    };
    let mut own = if let Some(alias) = &flags.ssh_alias {
        let mut stack = Vec::new();
        let mut out = Vec::new();
        expand(
            alias,
            flags.ssh_username.clone(),
            None,
            lookup,
            default_user,
            &mut stack,
            &mut out,
        )?;
        out
    } else if let Some(addr) = &flags.ssh_addr {
        let (user, host, port) = parse_destination(addr).ok_or_else(|| Error::BadFlag {
            flag: "--ssh-addr",
            value: addr.clone(),
            why: match addr.rsplit_once(':').map(|(_, p)| p.parse::<u64>()) {
                Some(Ok(p)) if !(1..=65535).contains(&p) && addr.matches(':').count() == 1 => {
                    format!("port {p} is out of range 1–65535 — e.g. bastion.example.com:22")
                }
                _ => "not HOST[:PORT] — e.g. bastion.example.com:22 or 10.0.0.5".into(),
            },
        })?;
        // An address is still looked up (like `ssh host`): the config may give its
        // User, Port or IdentityFile; its ProxyJump is not followed (--ssh-jump is).
        let entry = lookup.lookup(&host);
        let user = flags
            .ssh_username
            .clone()
            .or(user)
            .or_else(|| entry.user.clone())
            .or_else(|| default_user.map(str::to_owned))
            .ok_or_else(|| Error::NoUser { host: host.clone() })?;
        let port = port.or(entry.port).unwrap_or(SSH_PORT);
        vec![Hop {
            label: format!("{host}:{port}"),
            host: entry.host_name.unwrap_or(host),
            port,
            user,
            identity_files: entry.identity_files,
            password: None,
            gssapi: None,
        }]
    } else {
        Vec::new()
    };
    // The flags of this hop override the config's for the hop they describe (the last).
    if let Some(last) = own.last_mut() {
        if let Some(u) = &flags.ssh_username {
            last.user = u.clone();
        }
        if let Some(k) = &flags.ssh_keyfile {
            last.identity_files.insert(0, k.clone());
        }
        last.password = flags.ssh_password.clone();
        last.gssapi = gssapi::Creds::from_flags(flags);
    }
    hops.append(&mut own);
    if hops.len() > MAX_HOPS {
        return Err(Error::TooLong {
            chain: hops
                .iter()
                .map(|h| h.label.clone())
                .collect::<Vec<_>>()
                .join(" -> "),
            config: lookup.describe(),
        });
    }
    Ok(hops)
}

/// Appends the hops that reach `name` (its ProxyJump chain, recursively, then itself)
/// to `out`. `stack` holds the names being expanded, for cycle detection.
fn expand(
    name: &str,
    user_override: Option<String>,
    port_override: Option<u16>,
    lookup: &dyn HostLookup,
    default_user: Option<&str>,
    stack: &mut Vec<String>,
    out: &mut Vec<Hop>,
) -> Result<(), Error> {
    if stack.iter().any(|s| s == name) {
        let mut chain = stack.clone();
        chain.push(name.to_owned());
        return Err(Error::Cycle {
            chain: chain.join(" -> "),
            config: lookup.describe(),
        });
    }
    if stack.len() + out.len() >= MAX_HOPS {
        return Err(Error::TooLong {
            chain: stack.join(" -> "),
            config: lookup.describe(),
        });
    }
    let entry = lookup.lookup(name);
    stack.push(name.to_owned());
    if let Some(jumps) = &entry.proxy_jump {
        for j in jumps {
            if j.eq_ignore_ascii_case("none") {
                continue;
            }
            let (u, h, p) = parse_destination(j).ok_or_else(|| Error::Config {
                path: PathBuf::from(lookup.describe()),
                why: format!("ProxyJump {j:?} of Host {name} is not [USER@]HOST[:PORT]"),
            })?;
            expand(&h, u, p, lookup, default_user, stack, out)?;
        }
    }
    stack.pop();
    let host = entry.host_name.clone().unwrap_or_else(|| name.to_owned());
    let user = user_override
        .or(entry.user.clone())
        .or_else(|| default_user.map(str::to_owned))
        .ok_or_else(|| Error::NoUser { host: host.clone() })?;
    let port = port_override.or(entry.port).unwrap_or(SSH_PORT);
    out.push(Hop {
        label: name.to_owned(),
        host,
        port,
        user,
        identity_files: entry.identity_files,
        password: None,
        gssapi: None,
    });
    Ok(())
}

/// The host part of an `--ssh-addr` value (`[user@]host[:port]`, IPv6 in
/// brackets).
fn host_of(addr: &str) -> &str {
    let addr = addr.rsplit_once('@').map_or(addr, |(_, h)| h);
    if let Some(rest) = addr.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    addr.split(':').next().unwrap_or(addr)
}

/// The SSH plan of `args`, or `None` when no SSH hop is asked for. Reads the SSH
/// config (`--ssh-config`, else `<home>/.ssh/config` when it exists).
pub fn resolve_plan(
    args: &SshArgs,
    home: Option<&Path>,
    default_user: Option<&str>,
) -> Result<Option<SshPlan>, Error> {
    if !args.hop.is_set() {
        if let Some(j) = &args.hop.ssh_jump {
            return Err(bad_jump(
                j,
                "--ssh-jump needs --ssh-addr or --ssh-alias for the last hop",
            ));
        }
        return Ok(None);
    }
    let config_path = args
        .ssh_config
        .clone()
        .or_else(|| home.map(|h| h.join(".ssh/config")));
    let (hops, config_known_hosts) = match config_path {
        Some(path) if path.exists() || args.ssh_config.is_some() => {
            let cfg = config::FileConfig::read(&path, home)?;
            // UserKnownHostsFile of the host asked for (its Host block or
            // `Host *`), as OpenSSH reads it; one file serves every hop.
            let asked = args
                .hop
                .ssh_alias
                .clone()
                .or_else(|| args.hop.ssh_addr.as_deref().map(|a| host_of(a).to_owned()));
            let known = asked.and_then(|name| cfg.lookup(&name).known_hosts);
            (resolve_hops(&args.hop, &cfg, default_user)?, known)
        }
        _ => (resolve_hops(&args.hop, &NoConfig, default_user)?, None),
    };
    check_keyfiles(&args.hop)?;
    let known_hosts = args
        .ssh_known_hosts
        .clone()
        .or(config_known_hosts)
        .or_else(|| home.map(|h| h.join(".ssh/known_hosts")))
        .ok_or_else(|| Error::BadFlag {
            flag: "--ssh-known-hosts",
            value: String::new(),
            why: "no home folder to find ~/.ssh/known_hosts in — pass --ssh-known-hosts".into(),
        })?;
    Ok(Some(SshPlan {
        hops,
        known_hosts,
        accept_new: args.ssh_accept_new,
        keepalive_ms: None,
        default_ccache: std::env::var("KRB5CCNAME").ok().filter(|c| !c.is_empty()),
    }))
}

/// The API server's host and port from a kubeconfig server URL (`https://h:6443`,
/// `https://[fd00::1]`, port 443 when none is given).
pub fn server_host_port(server: &str) -> Option<(String, u16)> {
    let (scheme, rest) = server.split_once("://").unwrap_or(("https", server));
    let authority = rest.split('/').next().unwrap_or(rest);
    let default_port = if scheme.eq_ignore_ascii_case("http") {
        80
    } else {
        443
    };
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (h, after) = v6.split_once(']')?;
        let port = match after.strip_prefix(':') {
            Some(p) => p.parse().ok()?,
            None => default_port,
        };
        (h.to_owned(), port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h.to_owned(), p.parse().ok()?),
            None => (authority.to_owned(), default_port),
        }
    };
    (!host.is_empty()).then_some((host, port))
}

/// The user kvpn logs in as when nothing names one: the invoking user under sudo,
/// else `USER`/`LOGNAME`, else the passwd name of the effective uid (as OpenSSH,
/// which always takes that one: a cron job or `env -i` has neither variable).
fn default_user(env: &crate::kubeconfig::UserEnv) -> Option<String> {
    default_user_with(env, |uid| {
        crate::kubeconfig::Account::by_uid(uid)
            .ok()
            .flatten()
            .map(|a| a.name)
    })
}

/// [`default_user`] with the passwd lookup `name_of_uid` (uid → login name).
fn default_user_with(
    env: &crate::kubeconfig::UserEnv,
    name_of_uid: impl FnOnce(u32) -> Option<String>,
) -> Option<String> {
    if let Some(u) = crate::kubeconfig::sudo_user(env) {
        return Some(u.to_owned());
    }
    ["USER", "LOGNAME"]
        .iter()
        .filter_map(|v| env.var(v).map(|s| s.to_string_lossy().into_owned()))
        .find(|s| !s.is_empty())
        .or_else(|| name_of_uid(env.euid).filter(|s| !s.is_empty()))
}

/// [`resolve_plan`] in the user's environment (their home's `~/.ssh`, their name).
pub fn plan_for(
    args: &SshArgs,
    env: &crate::kubeconfig::UserEnv,
) -> anyhow::Result<Option<SshPlan>> {
    use anyhow::Context as _;
    if !args.hop.is_set() && args.hop.ssh_jump.is_none() {
        return Ok(None);
    }
    let acting =
        crate::kubeconfig::ActingUser::detect(env).context("cannot tell whose ~/.ssh to use")?;
    let mut plan = resolve_plan(args, acting.home(), default_user(env).as_deref())?;
    if let (Some(plan), Some(home)) = (plan.as_mut(), acting.home()) {
        // No key named for a hop: ssh's default identities, those that exist.
        for hop in &mut plan.hops {
            if hop.identity_files.is_empty() {
                hop.identity_files = ["id_ed25519", "id_ecdsa", "id_rsa"]
                    .iter()
                    .map(|f| home.join(".ssh").join(f))
                    .filter(|p| p.exists())
                    .collect();
            }
        }
    }
    Ok(plan)
}

/// A kube client for `flags`, through the SSH path of `plan` when there is one.
/// The returned tunnel must live as long as the client is used.
pub async fn connect_kube(
    flags: &crate::kubeconfig::KubeFlags,
    plan: Option<&SshPlan>,
    env: &crate::kubeconfig::UserEnv,
) -> anyhow::Result<(crate::kubeconfig::KubeConnection, Option<SshTunnel>)> {
    use anyhow::Context as _;
    let Some(plan) = plan else {
        return Ok((crate::kubeconfig::connect(flags, env).await?, None));
    };
    let mut target = crate::kubeconfig::KubeTarget::resolve(flags, env)?;
    let server = target.selection.server.clone();
    let api = server_host_port(&server).ok_or_else(|| {
        anyhow::anyhow!("cannot tell the API server's host and port from {server:?}")
    })?;
    let agent_sock = env.var("SSH_AUTH_SOCK").map(PathBuf::from);
    let tunnel = SshTunnel::start(plan.clone(), agent_sock, api.clone())
        .await
        .with_context(|| {
            format!(
                "cannot reach the API server {}:{} through SSH ({})",
                api.0,
                api.1,
                plan.describe()
            )
        })?;
    target.api_via = Some(tunnel.local_addr());
    let conn = crate::kubeconfig::connect_target(target).await?;
    Ok((conn, Some(tunnel)))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    struct Map(BTreeMap<&'static str, HostEntry>);

    impl HostLookup for Map {
        fn lookup(&self, name: &str) -> HostEntry {
            self.0.get(name).cloned().unwrap_or_default()
        }
        fn describe(&self) -> String {
            "/t/ssh_config".into()
        }
    }

    fn entry(host: &str, user: &str, port: u16, jump: Option<&str>) -> HostEntry {
        HostEntry {
            host_name: Some(host.into()),
            user: Some(user.into()),
            port: Some(port),
            identity_files: vec![PathBuf::from(format!("/k/{user}"))],
            proxy_jump: jump.map(|j| j.split(',').map(str::to_owned).collect()),
            known_hosts: None,
        }
    }

    fn alias(a: &str) -> HopFlags {
        HopFlags {
            ssh_alias: Some(a.into()),
            ..Default::default()
        }
    }

    fn labels(hops: &[Hop]) -> Vec<String> {
        hops.iter()
            .map(|h| format!("{}={}@{}:{}", h.label, h.user, h.host, h.port))
            .collect()
    }

    fn env_of(vars: &[(&str, &str)], euid: u32) -> crate::kubeconfig::UserEnv {
        crate::kubeconfig::UserEnv::from_parts(
            vars.iter().map(|(k, v)| ((*k).into(), (*v).into())),
            PathBuf::from("/"),
            euid,
        )
    }

    /// With USER and LOGNAME unset (cron, `env -i`) the login user is the
    /// passwd name of the effective uid, as OpenSSH takes it (on main: no user,
    /// "pass --ssh-username"); the variables and sudo's user still come first.
    #[test]
    fn default_user_falls_back_to_the_passwd_name_of_the_uid() {
        let passwd = |uid: u32| (uid == 1000).then(|| "alice".to_owned());
        assert_eq!(
            default_user_with(&env_of(&[], 1000), passwd).as_deref(),
            Some("alice")
        );
        assert_eq!(
            default_user_with(&env_of(&[("USER", "")], 1000), passwd).as_deref(),
            Some("alice")
        );
        assert_eq!(
            default_user_with(&env_of(&[("LOGNAME", "bob")], 1000), passwd).as_deref(),
            Some("bob")
        );
        assert_eq!(
            default_user_with(
                &env_of(&[("USER", "carol"), ("LOGNAME", "bob")], 1000),
                passwd
            )
            .as_deref(),
            Some("carol")
        );
        assert_eq!(
            default_user_with(
                &env_of(&[("SUDO_USER", "dave"), ("USER", "root")], 0),
                passwd
            )
            .as_deref(),
            Some("dave")
        );
        assert_eq!(default_user_with(&env_of(&[], 4242), passwd), None);
        // The real lookup: this process's uid has a passwd entry here.
        let uid = nix::unistd::geteuid().as_raw();
        let want = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
            .expect("getpwuid_r")
            .expect("this uid is in passwd")
            .name;
        assert_eq!(default_user(&env_of(&[], uid)), Some(want));
    }

    #[test]
    fn ssh_01_alias_with_proxyjump_chain_of_three_never_resolves_alias_names() {
        let cfg = Map(BTreeMap::from([
            ("target", entry("10.3.0.2", "t", 2203, Some("b2"))),
            ("b2", entry("10.2.0.2", "u2", 2202, Some("b1"))),
            ("b1", entry("10.1.0.2", "u1", 2201, None)),
        ]));
        let hops = resolve_hops(&alias("target"), &cfg, Some("me")).expect("chain");
        assert_eq!(
            labels(&hops),
            [
                "b1=u1@10.1.0.2:2201",
                "b2=u2@10.2.0.2:2202",
                "target=t@10.3.0.2:2203"
            ]
        );
        assert_eq!(hops[0].identity_files, [PathBuf::from("/k/u1")]);
    }

    #[test]
    fn ssh_01_proxyjump_list_and_inline_user_port() {
        let cfg = Map(BTreeMap::from([
            ("target", entry("10.3.0.2", "t", 22, Some("a,ops@b:2222"))),
            ("a", entry("10.1.0.2", "ua", 22, None)),
        ]));
        let hops = resolve_hops(&alias("target"), &cfg, Some("me")).expect("chain");
        // `b` is not in the config: its name is dialled as written, through `a`.
        assert_eq!(
            labels(&hops),
            ["a=ua@10.1.0.2:22", "b=ops@b:2222", "target=t@10.3.0.2:22"]
        );
    }

    #[test]
    fn proxyjump_cycles_are_refused_naming_the_chain() {
        let cfg = Map(BTreeMap::from([
            ("a", entry("10.1.0.2", "u", 22, Some("b"))),
            ("b", entry("10.2.0.2", "u", 22, Some("c"))),
            ("c", entry("10.3.0.2", "u", 22, Some("a"))),
        ]));
        let e = resolve_hops(&alias("a"), &cfg, Some("me")).expect_err("cycle");
        let msg = e.to_string();
        assert!(matches!(e, Error::Cycle { .. }), "{msg}");
        assert!(msg.contains("a -> b -> c -> a"), "{msg}");
        assert!(msg.contains("/t/ssh_config"), "{msg}");
        let self_loop = Map(BTreeMap::from([("s", entry("h", "u", 22, Some("s")))]));
        assert!(matches!(
            resolve_hops(&alias("s"), &self_loop, None),
            Err(Error::Cycle { .. })
        ));
    }

    #[test]
    fn a_diamond_is_not_a_cycle() {
        // target jumps through a and b, both of which jump through c: c appears twice
        // in the chain (as OpenSSH would dial it), but nothing loops.
        let cfg = Map(BTreeMap::from([
            ("target", entry("10.9.0.2", "t", 22, Some("a,b"))),
            ("a", entry("10.1.0.2", "u", 22, Some("c"))),
            ("b", entry("10.2.0.2", "u", 22, Some("c"))),
            ("c", entry("10.3.0.2", "u", 22, None)),
        ]));
        let hops = resolve_hops(&alias("target"), &cfg, None).expect("no cycle");
        assert_eq!(hops.len(), 5);
    }

    #[test]
    fn nested_ssh_jump_flags_build_the_chain_first_hop_first() {
        let flags = HopFlags {
            ssh_addr: Some("10.3.0.2:2203".into()),
            ssh_username: Some("t".into()),
            ssh_password: Some("pw".into()),
            ssh_jump: Some(
                "--ssh-addr 10.2.0.2:2202 --ssh-username u2 --ssh-keyfile '/k/my key' \
                 --ssh-jump \"--ssh-addr 10.1.0.2 --ssh-username u1\""
                    .into(),
            ),
            ..Default::default()
        };
        let hops = resolve_hops(&flags, &NoConfig, Some("me")).expect("chain");
        assert_eq!(
            labels(&hops),
            [
                "10.1.0.2:22=u1@10.1.0.2:22",
                "10.2.0.2:2202=u2@10.2.0.2:2202",
                "10.3.0.2:2203=t@10.3.0.2:2203"
            ]
        );
        assert_eq!(hops[1].identity_files, [PathBuf::from("/k/my key")]);
        assert_eq!(hops[2].password.as_deref(), Some("pw"));
        assert_eq!(hops[0].password, None);
        assert_eq!(hops[2].gssapi, None);
    }

    #[test]
    fn gssapi_flags_belong_to_their_hop_and_exclude_each_other() {
        let flags = JumpFlags::try_parse_from([
            "--ssh-addr",
            "10.3.0.2",
            "--gssapi-cache",
            "/t/cc",
            "--ssh-jump",
            "--ssh-addr 10.1.0.2 --gssapi-password 'p w'",
        ])
        .expect("flags");
        let hops = resolve_hops(&flags.hop, &NoConfig, Some("me")).expect("chain");
        assert_eq!(hops[0].gssapi, Some(gssapi::Creds::Password("p w".into())));
        assert_eq!(hops[1].gssapi, Some(gssapi::Creds::Cache("/t/cc".into())));
        let both = JumpFlags::try_parse_from([
            "--ssh-addr",
            "h",
            "--gssapi-cache",
            "/t/cc",
            "--gssapi-keytab",
            "/t/kt",
        ]);
        assert!(both.is_err(), "two credential sources must be refused");
    }

    #[test]
    fn bad_flags_say_what_to_write() {
        let bad = HopFlags {
            ssh_addr: Some("host:99999".into()),
            ..Default::default()
        };
        let e = resolve_hops(&bad, &NoConfig, Some("me")).expect_err("bad port");
        assert!(
            e.to_string().contains("port 99999 is out of range 1–65535"),
            "{e}"
        );
        let bad = HopFlags {
            ssh_addr: Some("host:x".into()),
            ..Default::default()
        };
        let e = resolve_hops(&bad, &NoConfig, Some("me")).expect_err("bad port");
        assert!(e.to_string().contains("HOST[:PORT]"), "{e}");
        assert!(
            JumpFlags::try_parse_from(["--ssh-addr", "h", "--ssh-username", ""]).is_err(),
            "an empty user name must be refused"
        );
        let bad_jump = HopFlags {
            ssh_addr: Some("h".into()),
            ssh_jump: Some("--ssh-username x".into()),
            ..Default::default()
        };
        let e = resolve_hops(&bad_jump, &NoConfig, Some("me")).expect_err("no host");
        assert!(e.to_string().contains("names no host"), "{e}");
        let e = resolve_hops(
            &HopFlags {
                ssh_addr: Some("h".into()),
                ..Default::default()
            },
            &NoConfig,
            None,
        )
        .expect_err("no user");
        assert!(e.to_string().contains("--ssh-username"), "{e}");
        // --ssh-username alone is enough, with no USER in the environment.
        let named = resolve_hops(
            &HopFlags {
                ssh_addr: Some("h".into()),
                ssh_username: Some("ops".into()),
                ..Default::default()
            },
            &NoConfig,
            None,
        )
        .expect("user from the flag");
        assert_eq!(named[0].user, "ops");
    }

    fn jump_error(jump: &str) -> String {
        let flags = HopFlags {
            ssh_addr: Some("10.3.0.2".into()),
            ssh_jump: Some(jump.into()),
            ..Default::default()
        };
        resolve_hops(&flags, &NoConfig, Some("me"))
            .expect_err("a bad --ssh-jump")
            .to_string()
    }

    #[test]
    fn ssh_jump_errors_never_echo_passwords() {
        for (jump, secrets) in [
            (
                "--ssh-addr b --ssh-password s3cret --gssapi-password k5pw --gssapi-cache /x",
                &["s3cret", "k5pw"][..],
            ),
            (
                "--ssh-addr b --ssh-password=s3cret --gssapi-password='k5 pw' --gssapi-cache /x",
                &["s3cret", "k5 pw"][..],
            ),
            // The error is the outer one, echoing the nested string.
            (
                "--ssh-addr b --bogus --ssh-jump \"--ssh-addr a --ssh-password nestedpw\"",
                &["nestedpw"][..],
            ),
            (
                "--ssh-addr b --ssh-password \"pa55 w0rd",
                &["pa55", "w0rd"][..],
            ),
            // clap echoes a repeated value.
            (
                "--ssh-addr b --ssh-password pw1 --ssh-password pw2",
                &["pw1", "pw2"][..],
            ),
        ] {
            let e = jump_error(jump);
            assert!(e.starts_with("--ssh-jump"), "{e}");
            assert!(e.contains("***"), "{e}");
            for s in secrets {
                assert!(!e.contains(s), "{s:?} echoed: {e}");
            }
        }
        // The nested hop's own error is redacted too.
        let e = jump_error("--ssh-addr b --ssh-jump \"--ssh-username u --gssapi-password=inner\"");
        assert!(!e.contains("inner"), "{e}");
    }

    #[test]
    fn ssh_jump_says_the_shared_flags_apply_to_every_hop() {
        let e = jump_error("--ssh-addr b --ssh-known-hosts /t/kh");
        assert!(e.contains("--ssh-known-hosts is not a per-hop flag"), "{e}");
        assert!(e.contains("apply to every hop"), "{e}");
        let e = jump_error("--ssh-addr b --ssh-accept-new");
        assert!(e.contains("--ssh-accept-new is not a per-hop flag"), "{e}");
    }

    #[test]
    fn an_explicit_keyfile_must_exist_and_be_private_naming_it() {
        let dir = std::env::temp_dir().join(format!("kvpn-keyfile-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let public = dir.join("id_ed25519.pub");
        std::fs::write(&public, "ssh-ed25519 AAAAC3Nza me@laptop\n").expect("write");
        let public_named_private = dir.join("id_other");
        std::fs::write(&public_named_private, "ssh-ed25519 AAAAC3Nza me@laptop\n").expect("write");
        let private = dir.join("id_ed25519");
        std::fs::write(&private, "-----BEGIN OPENSSH PRIVATE KEY-----\n").expect("write");
        // The key of the first hop of a chain, inside --ssh-jump.
        let hop = |k: &Path| SshArgs {
            hop: HopFlags {
                ssh_addr: Some("h".into()),
                ssh_jump: Some(format!(
                    "--ssh-addr j --ssh-keyfile {}",
                    shlex::try_quote(&k.to_string_lossy()).expect("quotable")
                )),
                ..Default::default()
            },
            ssh_known_hosts: Some("/t/kh".into()),
            ..Default::default()
        };
        let resolve =
            |a: &SshArgs| resolve_plan(a, None, Some("me")).map(|p| p.expect("a plan").hops);
        let missing = dir.join("nonexistent");
        let e = resolve(&hop(&missing))
            .expect_err("missing key file")
            .to_string();
        let results = [
            (e.clone(), missing.display().to_string(), "does not exist"),
            (
                resolve(&hop(&public)).expect_err("public key").to_string(),
                public.display().to_string(),
                "this is a public key; give the private key",
            ),
            (
                resolve(&hop(&public_named_private))
                    .expect_err("public key")
                    .to_string(),
                public_named_private.display().to_string(),
                "this is a public key",
            ),
        ];
        let ok = resolve(&hop(&private));
        let _ = std::fs::remove_dir_all(&dir);
        for (e, path, why) in results {
            assert!(e.contains(&path) && e.contains(why), "{e}");
        }
        assert_eq!(ok.expect("a private key file")[0].identity_files, [private]);
    }

    #[test]
    fn ssh_help_fits_both_kvpn_ssh_and_connect_and_tells_the_real_login_order() {
        use clap::Args as _;
        let help = SshArgs::augment_args(clap::Command::new("ssh"))
            .render_long_help()
            .to_string()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        assert!(!help.contains("jump host for the API server"), "{help}");
        assert!(!help.contains("jump hosts' keys"), "{help}");
        assert!(
            help.contains("for `kvpn ssh` the host of the shell"),
            "{help}"
        );
        assert!(
            help.contains("tried before ssh-agent keys and key files"),
            "{help}"
        );
    }

    #[test]
    fn api_server_host_and_port() {
        assert_eq!(
            server_host_port("https://172.31.255.1:6443"),
            Some(("172.31.255.1".into(), 6443))
        );
        assert_eq!(
            server_host_port("https://api.example.com/x"),
            Some(("api.example.com".into(), 443))
        );
        assert_eq!(
            server_host_port("https://[fd00::1]:6443"),
            Some(("fd00::1".into(), 6443))
        );
        assert_eq!(server_host_port("http://h"), Some(("h".into(), 80)));
        assert_eq!(server_host_port("https://h:x"), None);
    }

    #[test]
    fn destinations() {
        assert_eq!(
            parse_destination("ops@[fd00::1]:2222"),
            Some((Some("ops".into()), "fd00::1".into(), Some(2222)))
        );
        assert_eq!(
            parse_destination("fd00::1"),
            Some((None, "fd00::1".into(), None))
        );
        assert_eq!(
            parse_destination("h:22"),
            Some((None, "h".into(), Some(22)))
        );
        assert_eq!(parse_destination("h:0"), None);
        assert_eq!(parse_destination("@h"), None);
        assert_eq!(parse_destination(""), None);
    }

    #[test]
    fn the_plan_round_trips_through_the_agent_environment() {
        let plan = SshPlan {
            hops: vec![Hop {
                label: "b".into(),
                host: "10.0.0.1".into(),
                port: 2222,
                user: "root".into(),
                identity_files: vec![],
                password: Some("pw".into()),
                gssapi: Some(gssapi::Creds::Keytab("/t/user.keytab".into())),
            }],
            known_hosts: "/t/kh".into(),
            accept_new: true,
            keepalive_ms: Some(2000),
            default_ccache: Some("FILE:/t/krb5cc".into()),
        };
        assert_eq!(SshPlan::from_env(&plan.to_env()).expect("parse"), plan);
        assert!(SshPlan::from_env("{").is_err());
    }
}
