//! Kubeconfig handling for kvpn's client side: which kubeconfig files, which
//! context and namespace, whose environment exec auth plugins run in, and a
//! ready `kube::Client` with a one-line description for progress output.
//!
//! # Use
//! ```text
//! let env = UserEnv::current()?;                       // or the CLI's, in the user daemon
//! let flags = KubeFlags { kubeconfig, context, namespace }; // --kubeconfig/--context/--namespace
//! let conn = kubeconfig::connect(&flags, &env).await?; // client + GET /version
//! output::step(&format!("Using {}", conn.description));
//! let state_dir = kubeconfig::ensure_config_dir(&env, &conn.target.acting)?;
//! ```
//! [`KubeTarget::resolve`] alone does the local part (files, context, plugin
//! lookup) without network I/O, e.g. for `status`.
//!
//! # Where this code runs
//! Only in the unprivileged CLI or the user daemon, never in the root daemon
//! (`kvpn-dataplane` holds no Kubernetes credentials, see DESIGN.md). Exec auth
//! plugins (`users[].user.exec`) therefore run as the user, with the user's
//! environment: their `PATH` (so a plugin in `~/bin` is found, case kube-03),
//! `HOME` and the rest. The environment is an explicit [`UserEnv`] snapshot, not
//! this process's own variables, so a long-running user daemon can act on the
//! environment a CLI call sent it.
//!
//! # Under sudo (case kube-04)
//! When kvpn runs as root with `SUDO_USER` set (see [`sudo_user`]), it acts for
//! that user:
//! - kubeconfig: `KUBECONFIG` if it survived sudo (`sudo -E`,
//!   `--preserve-env=KUBECONFIG`), else `~user/.kube/config` (home from
//!   `getpwnam`), never root's `~/.kube/config`;
//! - config folder: `~user/.config/kvpn` ([`config_dir`]), created owned by the
//!   user ([`ensure_config_dir`]);
//! - exec plugins run *as the user*: kube-rs has no hook to set a uid, so the
//!   plugin's command is wrapped in util-linux `setpriv --reuid=<uid>
//!   --regid=<gid> --init-groups -- <plugin> <args>` (Debian: util-linux is
//!   Essential). Their environment gets the user's `HOME`, `USER`, `LOGNAME`,
//!   and a `PATH` of `~user/bin:~user/.local/bin:` + sudo's `PATH` (the user's
//!   real `PATH` is gone after sudo's env_reset; those two folders are what
//!   Debian's default `~/.profile` adds). Without `setpriv` the plugin runs as
//!   root with that environment and a warning is logged.
//! - Not covered: legacy `auth-provider` command plugins (`cmd-path`) run with
//!   this process's environment and uid (kube-rs spawns them itself).
//!
//! # Relative paths (case kube-02)
//! `certificate-authority`, `client-certificate`, `client-key`, `tokenFile` and
//! an exec `command` containing a `/` are relative to the folder of the
//! kubeconfig file that defines them. kube-rs's `Kubeconfig::read_from` already
//! rewrites them against the file's parent folder (matching client-go); this
//! module makes every kubeconfig path absolute against the user's working
//! folder first, so the result never depends on this process's working folder.
//!
//! # Pure core and I/O shell
//! Decisions are pure functions of a [`UserEnv`] and lookups passed in:
//! [`sudo_user`], [`decide_acting_user`], [`kubeconfig_sources`],
//! [`config_dir`], [`plugin_env`], [`resolve_program`], [`merge`], [`select`],
//! [`run_as_user`]. I/O: passwd lookups ([`Account::by_name`]), reading the
//! kubeconfig files and the `PATH` search ([`KubeTarget::resolve`]), running
//! the exec plugin while building the client ([`KubeTarget::client`]) and one
//! `GET /version` ([`connect`]).

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kube::config::{AuthInfo, ExecConfig, KubeConfigOptions, Kubeconfig, KubeconfigError};

/// The namespace used when neither `--namespace` nor the context names one.
pub const DEFAULT_NAMESPACE: &str = "default";

/// How long [`connect`] waits for the API server's `/version`.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(15);

/// Where [`run_as_user`]'s `setpriv` is looked for (util-linux).
const SETPRIV_PATH: &str = "/usr/bin:/bin";

/// `PATH` when the environment has none (matches Debian's login default).
const FALLBACK_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// Errors of kubeconfig handling. Each message names the thing, the cause and
/// the fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read the working folder: {0} — run kvpn from an existing folder")]
    Cwd(#[source] std::io::Error),
    #[error(
        "SUDO_USER={name}: no such user in the password database — unset SUDO_USER or run kvpn as that user"
    )]
    SudoUserUnknown { name: String },
    #[error("looking up user {who} in the password database: {source}")]
    Passwd {
        who: String,
        #[source]
        source: nix::Error,
    },
    #[error(
        "cannot find your kubeconfig: HOME is not set and uid {uid} has no home folder — set --kubeconfig or KUBECONFIG"
    )]
    NoHome { uid: u32 },
    #[error("kubeconfig {path}: no such file — {fix}")]
    NoSuchFile { path: PathBuf, fix: String },
    #[error(
        "none of the kubeconfig files in KUBECONFIG exists ({list}) — fix KUBECONFIG or set --kubeconfig"
    )]
    NoFileInList { list: String },
    #[error("reading kubeconfig {path}: {source} — check that file and its permissions")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "kubeconfig {path} is not a valid kubeconfig: {message} — fix the file or pick another with --kubeconfig"
    )]
    Parse { path: PathBuf, message: String },
    #[error(
        "no context selected: kubeconfig {files} has no current-context — pick one with --context (available: {available})"
    )]
    NoCurrentContext { files: String, available: String },
    #[error(
        "context {context:?} not found in kubeconfig {files} — available: {available}; pick one with --context"
    )]
    ContextNotFound {
        context: String,
        files: String,
        available: String,
    },
    #[error(
        "context {context:?} (in {file}) names cluster {cluster:?}, which no file of kubeconfig {files} defines — add the cluster or pick another --context"
    )]
    ClusterNotFound {
        context: String,
        cluster: String,
        file: PathBuf,
        files: String,
    },
    #[error(
        "context {context:?} (in {file}) names user {user:?}, which no file of kubeconfig {files} defines — add the user or pick another --context"
    )]
    UserNotFound {
        context: String,
        user: String,
        file: PathBuf,
        files: String,
    },
    #[error(
        "cluster {cluster:?} (in {file}) has no server URL — add `server: https://HOST:PORT` to it"
    )]
    NoServer { cluster: String, file: PathBuf },
    #[error(
        "exec auth plugin {command:?} of user {user:?} (in {file}) not found{searched} — {fix}"
    )]
    PluginNotFound {
        command: String,
        user: String,
        file: PathBuf,
        /// " on PATH …" or " at …".
        searched: String,
        fix: String,
    },
    #[error(
        "building the client for context {context:?} from {files}: {source} — fix the context's cluster or user entry"
    )]
    Config {
        context: String,
        files: String,
        #[source]
        source: KubeconfigError,
    },
    #[error("cannot send the API server {server} through the SSH forward {via}: {cause}")]
    Via {
        server: String,
        via: std::net::SocketAddr,
        cause: String,
    },
    #[error(
        "exec auth plugin {command} of user {user:?} failed: {source} — run it by hand to see why (often: log in again with your cloud CLI)"
    )]
    PluginFailed {
        command: String,
        user: String,
        #[source]
        source: kube::Error,
    },
    #[error("building the client for context {context:?} ({server}): {source}")]
    Client {
        context: String,
        server: String,
        #[source]
        source: kube::Error,
    },
    #[error(
        "API server {server} of context {context:?} rejected the credentials of user {user:?} ({code} {reason}) — refresh them or pick another --context"
    )]
    Rejected {
        server: String,
        context: String,
        user: String,
        code: u16,
        reason: String,
    },
    #[error(
        "the {ca} holds no PEM certificate (no `-----BEGIN CERTIFICATE-----` block) — put the cluster's CA certificate there (compare with `kubectl config view --raw --minify --context {context}`)"
    )]
    CaNotPem {
        context: String,
        /// [`KubeTarget::ca_entry`]: which CA entry of which cluster in which file.
        ca: String,
    },
    #[error(
        "the API server {server} of context {context:?} has a certificate that is not signed by the {ca} ({cause}) — put the cluster's CA there (compare with `kubectl config view --raw --minify --context {context}` and the CA the cluster was set up with), or pick another --context"
    )]
    UntrustedServer {
        server: String,
        context: String,
        /// As in [`Error::CaNotPem`].
        ca: String,
        cause: String,
    },
    #[error(
        "cannot reach the API server {server} of context {context:?}: {cause} — check that the cluster runs and is reachable from this machine, or pick another --context"
    )]
    Unreachable {
        server: String,
        context: String,
        cause: String,
    },
    #[error("creating config folder {path}: {source}")]
    ConfigDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

// ---------------------------------------------------------------------------
// Inputs
// ---------------------------------------------------------------------------

/// What the user asked for: `--kubeconfig`, `--context`, `--namespace`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KubeFlags {
    /// `--kubeconfig PATH`: this one file, `KUBECONFIG` is ignored (as kubectl).
    pub kubeconfig: Option<PathBuf>,
    /// `--context NAME`, else the merged kubeconfig's current-context.
    pub context: Option<String>,
    /// `--namespace NAME`, else the context's namespace, else [`DEFAULT_NAMESPACE`].
    pub namespace: Option<String>,
}

/// A snapshot of the environment kvpn acts in: variables, working folder and
/// effective uid. [`UserEnv::current`] takes this process's; the user daemon
/// can build one from what the CLI sent ([`UserEnv::from_parts`]). `Debug`
/// shows variable names only: values may hold secrets.
#[derive(Clone, PartialEq, Eq)]
pub struct UserEnv {
    vars: BTreeMap<OsString, OsString>,
    /// Relative paths (`--kubeconfig`, `KUBECONFIG` entries) resolve against this.
    pub cwd: PathBuf,
    /// The effective uid kvpn runs with (0 = root).
    pub euid: u32,
}

impl fmt::Debug for UserEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UserEnv")
            .field("vars", &self.vars.keys().collect::<Vec<_>>())
            .field("cwd", &self.cwd)
            .field("euid", &self.euid)
            .finish()
    }
}

impl UserEnv {
    /// This process's environment, working folder and effective uid.
    pub fn current() -> Result<Self, Error> {
        Ok(UserEnv {
            vars: std::env::vars_os().collect(),
            cwd: std::env::current_dir().map_err(Error::Cwd)?,
            euid: nix::unistd::geteuid().as_raw(),
        })
    }

    pub fn from_parts(
        vars: impl IntoIterator<Item = (OsString, OsString)>,
        cwd: PathBuf,
        euid: u32,
    ) -> Self {
        UserEnv {
            vars: vars.into_iter().collect(),
            cwd,
            euid,
        }
    }

    pub fn var(&self, name: &str) -> Option<&OsStr> {
        self.vars.get(OsStr::new(name)).map(OsString::as_os_str)
    }

    /// The variable if set and not empty.
    fn nonempty(&self, name: &str) -> Option<&OsStr> {
        self.var(name).filter(|v| !v.is_empty())
    }

    pub fn vars(&self) -> impl Iterator<Item = (&OsStr, &OsStr)> {
        self.vars
            .iter()
            .map(|(k, v)| (k.as_os_str(), v.as_os_str()))
    }

    pub fn with_var(mut self, name: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.vars.insert(name.into(), value.into());
        self
    }

    pub fn without_var(mut self, name: &str) -> Self {
        self.vars.remove(OsStr::new(name));
        self
    }

    pub fn with_cwd(mut self, cwd: impl Into<PathBuf>) -> Self {
        self.cwd = cwd.into();
        self
    }

    pub fn with_euid(mut self, euid: u32) -> Self {
        self.euid = euid;
        self
    }

    /// `path` made absolute against [`UserEnv::cwd`] (lexically; symlinks stay).
    fn absolute(&self, path: &Path) -> PathBuf {
        if path.is_absolute() {
            path.to_owned()
        } else {
            self.cwd.join(path)
        }
    }
}

/// A password database entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
}

impl Account {
    fn from_nix(u: nix::unistd::User) -> Self {
        Account {
            name: u.name,
            uid: u.uid.as_raw(),
            gid: u.gid.as_raw(),
            home: u.dir,
        }
    }

    /// `getpwnam(name)`.
    pub fn by_name(name: &str) -> Result<Option<Account>, Error> {
        nix::unistd::User::from_name(name)
            .map(|u| u.map(Account::from_nix))
            .map_err(|source| Error::Passwd {
                who: name.to_owned(),
                source,
            })
    }

    /// `getpwuid(uid)`.
    pub fn by_uid(uid: u32) -> Result<Option<Account>, Error> {
        nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
            .map(|u| u.map(Account::from_nix))
            .map_err(|source| Error::Passwd {
                who: format!("uid {uid}"),
                source,
            })
    }
}

// ---------------------------------------------------------------------------
// Pure decisions: whose files, which files, which folder, which environment
// ---------------------------------------------------------------------------

/// For whom kvpn acts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ActingUser {
    /// kvpn runs as the user itself (also root without sudo); `home` from
    /// `HOME`, else the passwd entry of the effective uid.
    Current { home: Option<PathBuf> },
    /// kvpn runs as root under sudo and acts for the invoking user.
    Sudo(Account),
}

impl ActingUser {
    /// The acting user's home folder.
    pub fn home(&self) -> Option<&Path> {
        match self {
            ActingUser::Current { home } => home.as_deref(),
            ActingUser::Sudo(a) => Some(&a.home),
        }
    }

    /// The invoking user's account when running under sudo.
    pub fn sudo_account(&self) -> Option<&Account> {
        match self {
            ActingUser::Sudo(a) => Some(a),
            ActingUser::Current { .. } => None,
        }
    }

    /// Finds out for whom kvpn acts (passwd lookups; see [`decide_acting_user`]).
    pub fn detect(env: &UserEnv) -> Result<Self, Error> {
        decide_acting_user(env, Account::by_name, Account::by_uid)
    }
}

/// The invoking user's name when kvpn runs as root under sudo: effective uid 0
/// and `SUDO_USER` set, non-empty and not `root`. Otherwise None (a non-root
/// process with a stray `SUDO_USER` acts for itself).
pub fn sudo_user(env: &UserEnv) -> Option<&str> {
    if env.euid != 0 {
        return None;
    }
    env.nonempty("SUDO_USER")
        .and_then(OsStr::to_str)
        .filter(|name| *name != "root")
}

/// For whom kvpn acts, given the environment and passwd lookups (pure when the
/// lookups are). Under sudo the invoking user must exist; otherwise the home
/// folder is `HOME` when absolute, else the effective uid's passwd entry.
pub fn decide_acting_user(
    env: &UserEnv,
    by_name: impl FnOnce(&str) -> Result<Option<Account>, Error>,
    by_uid: impl FnOnce(u32) -> Result<Option<Account>, Error>,
) -> Result<ActingUser, Error> {
    if let Some(name) = sudo_user(env) {
        return match by_name(name)? {
            Some(account) => Ok(ActingUser::Sudo(account)),
            None => Err(Error::SudoUserUnknown {
                name: name.to_owned(),
            }),
        };
    }
    let home = match env.nonempty("HOME").map(Path::new) {
        Some(h) if h.is_absolute() => Some(h.to_owned()),
        _ => by_uid(env.euid)?.map(|a| a.home),
    };
    Ok(ActingUser::Current { home })
}

/// Where the kubeconfig file list came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceKind {
    /// `--kubeconfig`: one file, must exist.
    Flag,
    /// `KUBECONFIG`: a colon-separated list; missing files are skipped (as kubectl).
    EnvList,
    /// `~/.kube/config` of the acting user: must exist.
    Default,
}

/// The kubeconfig files to read, absolute, in merge order (first wins).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sources {
    pub kind: SourceKind,
    pub paths: Vec<PathBuf>,
}

impl Sources {
    /// `a:b` for messages.
    pub fn display(&self) -> String {
        display_list(&self.paths)
    }
}

fn display_list(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(":")
}

/// Which kubeconfig files to read: `--kubeconfig` alone if given; else the
/// `KUBECONFIG` list (empty entries dropped, duplicates removed, relative
/// entries against the working folder); else `~/.kube/config` of the acting
/// user (under sudo: the invoking user's, never root's). A `KUBECONFIG` that
/// survived sudo is the invoking user's choice and is used.
pub fn kubeconfig_sources(
    flags: &KubeFlags,
    env: &UserEnv,
    user: &ActingUser,
) -> Result<Sources, Error> {
    if let Some(path) = &flags.kubeconfig {
        return Ok(Sources {
            kind: SourceKind::Flag,
            paths: vec![env.absolute(path)],
        });
    }
    if let Some(list) = env.nonempty("KUBECONFIG") {
        let mut paths: Vec<PathBuf> = Vec::new();
        for p in std::env::split_paths(list).filter(|p| !p.as_os_str().is_empty()) {
            let abs = env.absolute(&p);
            if !paths.contains(&abs) {
                paths.push(abs);
            }
        }
        if !paths.is_empty() {
            return Ok(Sources {
                kind: SourceKind::EnvList,
                paths,
            });
        }
    }
    let home = user.home().ok_or(Error::NoHome { uid: env.euid })?;
    Ok(Sources {
        kind: SourceKind::Default,
        paths: vec![home.join(".kube").join("config")],
    })
}

/// kvpn's config folder (session state): under sudo `~user/.config/kvpn` of the
/// invoking user; otherwise `$XDG_CONFIG_HOME/kvpn` when that is absolute, else
/// `~/.config/kvpn`. None without a home folder.
pub fn config_dir(env: &UserEnv, user: &ActingUser) -> Option<PathBuf> {
    match user {
        ActingUser::Sudo(a) => Some(a.home.join(".config").join("kvpn")),
        ActingUser::Current { home } => {
            if let Some(xdg) = env.nonempty("XDG_CONFIG_HOME").map(Path::new)
                && xdg.is_absolute()
            {
                return Some(xdg.join("kvpn"));
            }
            home.as_ref().map(|h| h.join(".config").join("kvpn"))
        }
    }
}

/// The environment exec auth plugins get, before the kubeconfig's own
/// `exec.env` entries (which win). Not under sudo: the user's environment as
/// is. Under sudo: the same with `HOME`, `USER` and `LOGNAME` of the invoking
/// user and `~user/bin` and `~user/.local/bin` put in front of `PATH` (unless
/// already in it).
pub fn plugin_env(env: &UserEnv, user: &ActingUser) -> BTreeMap<OsString, OsString> {
    let mut vars: BTreeMap<OsString, OsString> = env
        .vars()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    if let ActingUser::Sudo(a) = user {
        vars.insert("HOME".into(), a.home.clone().into_os_string());
        vars.insert("USER".into(), a.name.clone().into());
        vars.insert("LOGNAME".into(), a.name.clone().into());
        let old = env
            .nonempty("PATH")
            .map(OsStr::to_owned)
            .unwrap_or_else(|| FALLBACK_PATH.into());
        let existing: Vec<PathBuf> = std::env::split_paths(&old).collect();
        let mut dirs: Vec<PathBuf> = [a.home.join("bin"), a.home.join(".local").join("bin")]
            .into_iter()
            .filter(|d| !existing.contains(d))
            .collect();
        dirs.extend(existing);
        // join_paths fails only for an entry containing ':', which split_paths
        // cannot produce and a home folder (from passwd, ':'-separated) cannot hold.
        if let Ok(path) = std::env::join_paths(dirs) {
            vars.insert("PATH".into(), path);
        }
    }
    vars
}

/// Finds an exec plugin's program the way `execvp` does: a command with a `/`
/// is taken as is (relative against `cwd`); otherwise each `PATH` entry is
/// tried in order (an empty entry means `cwd`) and the first where
/// `is_executable` holds wins.
pub fn resolve_program(
    command: &str,
    path_var: Option<&OsStr>,
    cwd: &Path,
    is_executable: impl Fn(&Path) -> bool,
) -> Option<PathBuf> {
    if command.is_empty() {
        return None;
    }
    if command.contains('/') {
        let p = if Path::new(command).is_absolute() {
            PathBuf::from(command)
        } else {
            cwd.join(command)
        };
        return is_executable(&p).then_some(p);
    }
    let path_var = path_var.unwrap_or(OsStr::new(FALLBACK_PATH));
    std::env::split_paths(path_var)
        .map(|dir| {
            if dir.as_os_str().is_empty() {
                cwd.join(command)
            } else if dir.is_absolute() {
                dir.join(command)
            } else {
                cwd.join(dir).join(command)
            }
        })
        .find(|p| is_executable(p))
}

/// A regular file with an execute bit (what `execvp` would try).
fn is_executable_file(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// `exec` rewritten to run `program` (the resolved plugin) as `account` through
/// `setpriv`: `setpriv --reuid=U --regid=G --init-groups -- program args…`.
/// The environment is left to the caller (`setpriv` passes it through).
pub fn run_as_user(
    exec: &ExecConfig,
    program: &Path,
    account: &Account,
    setpriv: &Path,
) -> ExecConfig {
    let mut args = vec![
        format!("--reuid={}", account.uid),
        format!("--regid={}", account.gid),
        "--init-groups".to_owned(),
        "--".to_owned(),
        program.display().to_string(),
    ];
    args.extend(exec.args.iter().flatten().cloned());
    ExecConfig {
        command: Some(setpriv.display().to_string()),
        args: Some(args),
        ..exec.clone()
    }
}

// ---------------------------------------------------------------------------
// Pure: merging and selecting
// ---------------------------------------------------------------------------

/// Several kubeconfig files merged, with the file that defined each entry.
#[derive(Debug, Clone, Default)]
pub struct Merged {
    pub config: Kubeconfig,
    pub context_file: BTreeMap<String, PathBuf>,
    pub cluster_file: BTreeMap<String, PathBuf>,
    pub user_file: BTreeMap<String, PathBuf>,
    /// The files read, in order.
    pub files: Vec<PathBuf>,
}

/// Merges kubeconfigs the way kubectl does with `KUBECONFIG`: the first file
/// to define a context, cluster or user by name wins whole (later entries of
/// the same name are dropped, not merged field by field); the first
/// current-context wins. Unlike kube-rs's `Kubeconfig::merge`, differing
/// `kind`/`apiVersion` are no error (kubectl ignores them).
pub fn merge(files: Vec<(PathBuf, Kubeconfig)>) -> Merged {
    let mut m = Merged::default();
    for (path, kc) in files {
        for c in kc.clusters {
            if !m.cluster_file.contains_key(&c.name) {
                m.cluster_file.insert(c.name.clone(), path.clone());
                m.config.clusters.push(c);
            }
        }
        for u in kc.auth_infos {
            if !m.user_file.contains_key(&u.name) {
                m.user_file.insert(u.name.clone(), path.clone());
                m.config.auth_infos.push(u);
            }
        }
        for c in kc.contexts {
            if !m.context_file.contains_key(&c.name) {
                m.context_file.insert(c.name.clone(), path.clone());
                m.config.contexts.push(c);
            }
        }
        let cfg = &mut m.config;
        cfg.current_context = cfg
            .current_context
            .take()
            .or(kc.current_context.filter(|c| !c.is_empty()));
        cfg.preferences = cfg.preferences.take().or(kc.preferences);
        cfg.extensions = cfg.extensions.take().or(kc.extensions);
        cfg.kind = cfg.kind.take().or(kc.kind);
        cfg.api_version = cfg.api_version.take().or(kc.api_version);
        for (k, v) in kc.other {
            cfg.other.entry(k).or_insert(v);
        }
        m.files.push(path);
    }
    m
}

/// The chosen context and what it points at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    pub context: String,
    /// The file that defined the context.
    pub context_file: PathBuf,
    pub cluster: String,
    /// The file that defined the cluster.
    pub cluster_file: PathBuf,
    pub server: String,
    /// None: the context names no user (allowed, as client-go: no credentials).
    pub user: Option<String>,
    pub namespace: String,
}

/// Picks the context (`--context`, else current-context), checks that its
/// cluster (with a server) and user exist, and settles the namespace
/// (`--namespace`, else the context's, else `default`).
pub fn select(merged: &Merged, flags: &KubeFlags) -> Result<Selection, Error> {
    let files = display_list(&merged.files);
    let mut names: Vec<&str> = merged
        .config
        .contexts
        .iter()
        .map(|c| c.name.as_str())
        .collect();
    names.sort_unstable();
    let available = if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    };
    let name = match (&flags.context, &merged.config.current_context) {
        (Some(c), _) => c.clone(),
        (None, Some(c)) => c.clone(),
        (None, None) => return Err(Error::NoCurrentContext { files, available }),
    };
    let Some(ctx) = merged
        .config
        .contexts
        .iter()
        .find(|c| c.name == name)
        .and_then(|c| c.context.clone())
    else {
        return Err(Error::ContextNotFound {
            context: name,
            files,
            available,
        });
    };
    let context_file = merged.context_file.get(&name).cloned().unwrap_or_default();
    let Some(cluster) = merged
        .config
        .clusters
        .iter()
        .find(|c| c.name == ctx.cluster)
        .and_then(|c| c.cluster.as_ref())
    else {
        return Err(Error::ClusterNotFound {
            context: name,
            cluster: ctx.cluster,
            file: context_file,
            files,
        });
    };
    let Some(server) = cluster.server.clone().filter(|s| !s.is_empty()) else {
        return Err(Error::NoServer {
            file: merged
                .cluster_file
                .get(&ctx.cluster)
                .cloned()
                .unwrap_or_default(),
            cluster: ctx.cluster,
        });
    };
    let user = ctx.user.clone().filter(|u| !u.is_empty());
    if let Some(u) = &user
        && !merged.config.auth_infos.iter().any(|a| &a.name == u)
    {
        return Err(Error::UserNotFound {
            context: name,
            user: u.clone(),
            file: context_file,
            files,
        });
    }
    let namespace = flags
        .namespace
        .clone()
        .filter(|n| !n.is_empty())
        .or_else(|| ctx.namespace.clone().filter(|n| !n.is_empty()))
        .unwrap_or_else(|| DEFAULT_NAMESPACE.to_owned());
    Ok(Selection {
        context: name,
        context_file,
        cluster_file: merged
            .cluster_file
            .get(&ctx.cluster)
            .cloned()
            .unwrap_or_default(),
        cluster: ctx.cluster,
        server,
        user,
        namespace,
    })
}

/// How the chosen user authenticates, for the description.
fn auth_summary(auth: Option<&AuthInfo>) -> String {
    let Some(a) = auth else {
        return "no credentials".to_owned();
    };
    if let Some(exec) = &a.exec {
        return format!("exec plugin {}", exec.command.as_deref().unwrap_or("?"));
    }
    if let Some(p) = &a.auth_provider {
        return format!("auth provider {}", p.name);
    }
    if a.client_certificate.is_some() || a.client_certificate_data.is_some() {
        return "client certificate".to_owned();
    }
    if a.token.is_some() {
        return "bearer token".to_owned();
    }
    if let Some(f) = &a.token_file {
        return format!("token file {f}");
    }
    if a.username.is_some() {
        return "basic auth".to_owned();
    }
    "no credentials".to_owned()
}

// ---------------------------------------------------------------------------
// I/O shell
// ---------------------------------------------------------------------------

/// Creates [`config_dir`] (mode 0700). Under sudo, the folders it creates
/// (`~/.config` if missing, `~/.config/kvpn`) are given to the invoking user, so
/// root never leaves root-owned files in a user's home.
pub fn ensure_config_dir(env: &UserEnv, user: &ActingUser) -> Result<PathBuf, Error> {
    use std::os::unix::fs::PermissionsExt;
    let dir = config_dir(env, user).ok_or(Error::NoHome { uid: env.euid })?;
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| Error::ConfigDir { path, source }
    };
    let mut created = Vec::new();
    let mut p = dir.as_path();
    while !p.exists() {
        created.push(p.to_owned());
        match p.parent() {
            Some(parent) => p = parent,
            None => break,
        }
    }
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).map_err(io(&dir))?;
    if let ActingUser::Sudo(a) = user {
        for c in &created {
            std::os::unix::fs::chown(c, Some(a.uid), Some(a.gid)).map_err(io(c))?;
        }
    }
    Ok(dir)
}

/// Reads the files of `sources` (missing `KUBECONFIG` entries are skipped).
/// kube-rs's `read_from` turns relative paths inside each file into paths
/// under that file's folder; the file paths themselves are already absolute.
fn read_sources(sources: &Sources, user: &ActingUser) -> Result<Merged, Error> {
    let mut files = Vec::new();
    for path in &sources.paths {
        match std::fs::metadata(path) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match sources.kind {
                SourceKind::EnvList => {
                    tracing::debug!(path = %path.display(), "KUBECONFIG entry missing, skipped");
                    continue;
                }
                SourceKind::Flag => {
                    return Err(Error::NoSuchFile {
                        path: path.clone(),
                        fix: "check the path given with --kubeconfig".to_owned(),
                    });
                }
                SourceKind::Default => {
                    let whose = match user {
                        ActingUser::Sudo(a) => format!(
                            " (the kubeconfig of {}, who ran sudo; preserve KUBECONFIG with `sudo --preserve-env=KUBECONFIG` to use another)",
                            a.name
                        ),
                        ActingUser::Current { .. } => String::new(),
                    };
                    return Err(Error::NoSuchFile {
                        path: path.clone(),
                        fix: format!("set --kubeconfig or KUBECONFIG{whose}"),
                    });
                }
            },
            Err(source) => {
                return Err(Error::Read {
                    path: path.clone(),
                    source,
                });
            }
        }
        let kc = Kubeconfig::read_from(path).map_err(|e| match e {
            KubeconfigError::ReadConfig(source, _) => Error::Read {
                path: path.clone(),
                source,
            },
            other => Error::Parse {
                path: path.clone(),
                message: parse_message(&other),
            },
        })?;
        files.push((path.clone(), kc));
    }
    if files.is_empty() {
        return Err(Error::NoFileInList {
            list: sources.display(),
        });
    }
    Ok(merge(files))
}

/// A kubeconfig parse error in words that quote nothing of the file: the YAML
/// parser's message carries a snippet of the lines around the error (the first
/// lines of `--kubeconfig /etc/passwd`, say), and its wording can quote a value
/// (`invalid type: string "…"`). Like kubectl, kvpn names only what was expected
/// and where: line and column.
fn parse_message(e: &KubeconfigError) -> String {
    let KubeconfigError::Parse(yaml) = e else {
        return e.to_string();
    };
    let plain = yaml.without_snippet().to_string();
    // First line only, and nothing between quotes: the words of the error stay.
    let first = plain.lines().next().unwrap_or_default();
    let mut out = String::with_capacity(first.len());
    let mut quote: Option<char> = None;
    for c in first.chars() {
        match quote {
            Some(q) if c == q => {
                out.push('…');
                out.push(c);
                quote = None;
            }
            Some(_) => {}
            None => {
                out.push(c);
                if c == '"' || c == '`' {
                    quote = Some(c);
                }
            }
        }
    }
    if quote.is_some() {
        out.push('…');
    }
    match yaml.location() {
        Some(l) if !out.contains(" at line ") => {
            format!("{out} at line {}, column {}", l.line(), l.column())
        }
        _ => out,
    }
}

/// How an exec plugin will be run, for the description.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PluginRun {
    /// As this process's uid with the user's environment.
    AsCaller,
    /// Under sudo, through `setpriv`, as the invoking user.
    AsUser { user: String },
    /// Under sudo without `setpriv`: as root, with the invoking user's HOME/PATH.
    AsRootWithUserEnv { user: String },
}

/// Prepares the chosen user's exec plugin: finds its program on the acting
/// user's `PATH` (or at its absolute path, relative ones already resolved
/// against the kubeconfig's folder), gives it exactly the acting user's
/// environment (plus the kubeconfig's `exec.env`), and under sudo runs it as
/// the invoking user via `setpriv`.
fn prepare_exec(
    auth: &mut AuthInfo,
    user_name: &str,
    file: &Path,
    env: &UserEnv,
    acting: &ActingUser,
) -> Result<Option<(PathBuf, PluginRun)>, Error> {
    let Some(exec) = auth.exec.as_mut() else {
        return Ok(None);
    };
    let command = exec.command.clone().unwrap_or_default();
    let vars = plugin_env(env, acting);
    let path_var = vars.get(OsStr::new("PATH")).map(OsString::as_os_str);
    let Some(program) = resolve_program(&command, path_var, &env.cwd, is_executable_file) else {
        let searched = if command.contains('/') {
            String::new()
        } else {
            format!(
                " on PATH {}",
                path_var
                    .map(|p| p.to_string_lossy().into_owned())
                    .unwrap_or_default()
            )
        };
        let hint = exec
            .install_hint
            .as_deref()
            .map(|h| format!("install it ({})", h.trim()))
            .unwrap_or_else(|| "install it".to_owned());
        let fix = if command.contains('/') {
            format!(
                "{hint}; relative commands are resolved against the kubeconfig's folder {} (no such executable file there)",
                file.parent().unwrap_or(Path::new("/")).display()
            )
        } else {
            format!("{hint} or add its folder to PATH")
        };
        return Err(Error::PluginNotFound {
            command,
            user: user_name.to_owned(),
            file: file.to_owned(),
            searched,
            fix,
        });
    };

    // The plugin's environment: the acting user's, then the kubeconfig's own
    // entries (later entries win in kube-rs, as in client-go), and every
    // variable of this process the user's environment lacks is dropped.
    let original = exec.env.take().unwrap_or_default();
    let mut entries: Vec<std::collections::HashMap<String, String>> = Vec::new();
    let mut keep: BTreeSet<String> = BTreeSet::new();
    for (k, v) in &vars {
        match (k.to_str(), v.to_str()) {
            (Some(k), Some(v)) => {
                keep.insert(k.to_owned());
                entries.push(
                    [
                        ("name".to_owned(), k.to_owned()),
                        ("value".to_owned(), v.to_owned()),
                    ]
                    .into(),
                );
            }
            _ => {
                tracing::debug!(var = %k.to_string_lossy(), "non-UTF-8 variable not passed to the exec plugin")
            }
        }
    }
    for e in &original {
        if let Some(name) = e.get("name") {
            keep.insert(name.clone());
        }
    }
    entries.extend(original);
    exec.env = Some(entries);
    exec.drop_env = Some(
        std::env::vars_os()
            .filter_map(|(k, _)| k.into_string().ok())
            .filter(|k| !keep.contains(k) && k != "KUBERNETES_EXEC_INFO")
            .collect(),
    );

    let run = match acting {
        ActingUser::Current { .. } => {
            exec.command = Some(program.display().to_string());
            PluginRun::AsCaller
        }
        ActingUser::Sudo(account) => {
            match resolve_program(
                "setpriv",
                Some(OsStr::new(SETPRIV_PATH)),
                &env.cwd,
                is_executable_file,
            ) {
                Some(setpriv) => {
                    *exec = run_as_user(exec, &program, account, &setpriv);
                    PluginRun::AsUser {
                        user: account.name.clone(),
                    }
                }
                None => {
                    tracing::warn!(
                        user = %account.name,
                        plugin = %program.display(),
                        "setpriv (util-linux) not found: the exec auth plugin runs as root with the user's HOME and PATH"
                    );
                    exec.command = Some(program.display().to_string());
                    PluginRun::AsRootWithUserEnv {
                        user: account.name.clone(),
                    }
                }
            }
        }
    };
    Ok(Some((program, run)))
}

/// What kvpn connects to, for progress output and `status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterDescription {
    /// The API server URL.
    pub server: String,
    pub context: String,
    pub cluster: String,
    pub user: Option<String>,
    pub namespace: String,
    /// The kubeconfig files read, in merge order.
    pub kubeconfig: Vec<PathBuf>,
    /// The file that defined the context.
    pub context_file: PathBuf,
    /// e.g. "client certificate", "exec plugin /home/a/bin/x (as alice via setpriv)".
    pub auth: String,
    /// The invoking user when running under sudo.
    pub acting_for: Option<String>,
    /// The API server's `gitVersion`, once [`connect`] asked.
    pub server_version: Option<String>,
    /// [`cluster_id`] of the kubeconfig's CA (empty without one): with the
    /// server URL, what identifies this cluster's sessions.
    pub cluster_id: String,
}

impl fmt::Display for ClusterDescription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "context {} (cluster {} at {}",
            self.context, self.cluster, self.server
        )?;
        if let Some(v) = &self.server_version {
            write!(f, ", Kubernetes {v}")?;
        }
        write!(
            f,
            "), user {} with {}, namespace {}, from {}",
            self.user.as_deref().unwrap_or("(none)"),
            self.auth,
            self.namespace,
            self.context_file.display()
        )?;
        if let Some(u) = &self.acting_for {
            write!(f, ", for {u} (sudo)")?;
        }
        Ok(())
    }
}

/// A resolved target: files read, context chosen, exec plugin prepared. No
/// network I/O yet and no plugin run. `Debug` leaves out the kubeconfig (the
/// exec plugin's environment is in it).
#[derive(Clone)]
pub struct KubeTarget {
    /// The merged kubeconfig, with the chosen user's exec plugin prepared.
    pub kubeconfig: Kubeconfig,
    pub sources: Sources,
    pub selection: Selection,
    pub acting: ActingUser,
    /// kvpn's config folder for the acting user (not created; see [`ensure_config_dir`]).
    pub config_dir: Option<PathBuf>,
    /// The exec plugin's resolved program and how it runs, if the user has one.
    pub plugin: Option<(PathBuf, PluginRun)>,
    /// A loopback forward that leads to the API server (an SSH jump host,
    /// `crate::ssh`): the client dials it instead of the server's address and
    /// keeps the server's host name for TLS, so its certificate still verifies.
    pub api_via: Option<std::net::SocketAddr>,
    auth: String,
}

impl fmt::Debug for KubeTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KubeTarget")
            .field("sources", &self.sources)
            .field("selection", &self.selection)
            .field("acting", &self.acting)
            .field("config_dir", &self.config_dir)
            .field("plugin", &self.plugin)
            .finish_non_exhaustive()
    }
}

impl KubeTarget {
    /// Resolves `flags` in `env`: who kvpn acts for, which files, which
    /// context and namespace, and the exec plugin. Reads files and the passwd
    /// database; runs nothing.
    pub fn resolve(flags: &KubeFlags, env: &UserEnv) -> Result<Self, Error> {
        let acting = ActingUser::detect(env)?;
        Self::resolve_for(flags, env, acting)
    }

    /// [`KubeTarget::resolve`] with the acting user already known.
    pub fn resolve_for(
        flags: &KubeFlags,
        env: &UserEnv,
        acting: ActingUser,
    ) -> Result<Self, Error> {
        let sources = kubeconfig_sources(flags, env, &acting)?;
        let mut merged = read_sources(&sources, &acting)?;
        let selection = select(&merged, flags)?;
        let mut plugin = None;
        let mut auth = auth_summary(None);
        if let Some(user) = &selection.user {
            let file = merged.user_file.get(user).cloned().unwrap_or_default();
            if let Some(named) = merged
                .config
                .auth_infos
                .iter_mut()
                .find(|a| &a.name == user)
            {
                auth = auth_summary(named.auth_info.as_ref());
                if let Some(info) = named.auth_info.as_mut() {
                    plugin = prepare_exec(info, user, &file, env, &acting)?;
                }
            }
        }
        if let Some((program, run)) = &plugin {
            auth = match run {
                PluginRun::AsCaller => format!("exec plugin {}", program.display()),
                PluginRun::AsUser { user } => {
                    format!("exec plugin {} (as {user} via setpriv)", program.display())
                }
                PluginRun::AsRootWithUserEnv { user } => format!(
                    "exec plugin {} (as root with {user}'s HOME and PATH: setpriv not found)",
                    program.display()
                ),
            };
        }
        let config_dir = config_dir(env, &acting);
        tracing::debug!(
            context = %selection.context,
            server = %selection.server,
            files = %sources.display(),
            "kubeconfig resolved"
        );
        Ok(KubeTarget {
            kubeconfig: merged.config,
            sources,
            selection,
            acting,
            config_dir,
            plugin,
            api_via: None,
            auth,
        })
    }

    /// The description (without server version; [`connect`] fills that in).
    pub fn description(&self) -> ClusterDescription {
        ClusterDescription {
            server: self.selection.server.clone(),
            context: self.selection.context.clone(),
            cluster: self.selection.cluster.clone(),
            user: self.selection.user.clone(),
            namespace: self.selection.namespace.clone(),
            kubeconfig: self.sources_read(),
            context_file: self.selection.context_file.clone(),
            auth: self.auth.clone(),
            acting_for: self.acting.sudo_account().map(|a| a.name.clone()),
            server_version: None,
            cluster_id: String::new(),
        }
    }

    fn sources_read(&self) -> Vec<PathBuf> {
        self.sources
            .paths
            .iter()
            .filter(|p| self.sources.kind != SourceKind::EnvList || p.exists())
            .cloned()
            .collect()
    }

    /// The kube-rs config for the chosen context, with the namespace settled.
    pub async fn config(&self) -> Result<kube::Config, Error> {
        let options = KubeConfigOptions {
            context: Some(self.selection.context.clone()),
            cluster: None,
            user: None,
        };
        let mut config = kube::Config::from_custom_kubeconfig(self.kubeconfig.clone(), &options)
            .await
            .map_err(|source| Error::Config {
                context: self.selection.context.clone(),
                files: self.sources.display(),
                source,
            })?;
        config.default_namespace = self.selection.namespace.clone();
        // kube reads a CA without a PEM certificate in it as an empty trust
        // list, and the handshake then fails with UnknownIssuer, as if the CA
        // were the wrong one: say what is wrong with it instead.
        if config.root_cert.as_ref().is_some_and(Vec::is_empty) {
            return Err(Error::CaNotPem {
                context: self.selection.context.clone(),
                ca: self.ca_entry(),
            });
        }
        if let Some(via) = self.api_via {
            let original = config.cluster_url.clone();
            let host = original.host().unwrap_or_default();
            let host = host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned();
            let rewritten = format!(
                "{}://{via}{}",
                original.scheme_str().unwrap_or("https"),
                original.path()
            )
            .parse()
            .map_err(|e| Error::Via {
                server: self.selection.server.clone(),
                via,
                cause: format!("{e}"),
            })?;
            config.cluster_url = rewritten;
            if config.tls_server_name.is_none() {
                config.tls_server_name = Some(host);
            }
        }
        Ok(config)
    }

    /// Where the chosen cluster's CA comes from, for messages:
    /// `certificate-authority PATH of cluster "c" (in FILE)`, the same with
    /// `certificate-authority-data`, or the system trust store when the
    /// cluster entry names neither.
    pub fn ca_entry(&self) -> String {
        let cluster = self
            .kubeconfig
            .clusters
            .iter()
            .find(|c| c.name == self.selection.cluster)
            .and_then(|c| c.cluster.as_ref());
        let entry = match cluster {
            Some(c) if c.certificate_authority_data.is_some() => {
                "certificate-authority-data".to_owned()
            }
            Some(c) if c.certificate_authority.is_some() => format!(
                "certificate-authority {}",
                c.certificate_authority.as_deref().unwrap_or_default()
            ),
            _ => "system trust store (no certificate-authority in the entry)".to_owned(),
        };
        format!(
            "{entry} of cluster {:?} (in {})",
            self.selection.cluster,
            self.selection.cluster_file.display()
        )
    }

    /// A client for the chosen context. Runs the exec plugin (if any) on a
    /// blocking thread; no request is sent.
    pub async fn client(&self) -> Result<kube::Client, Error> {
        Ok(self.client_and_id().await?.0)
    }

    /// [`KubeTarget::client`] and the [`cluster_id`] of the CA it trusts.
    pub async fn client_and_id(&self) -> Result<(kube::Client, String), Error> {
        let config = self.config().await?;
        let id = cluster_id(config.root_cert.as_deref());
        self.client_of(config).await.map(|c| (c, id))
    }

    async fn client_of(&self, config: kube::Config) -> Result<kube::Client, Error> {
        let built = tokio::task::spawn_blocking(move || client_with_nodelay(config))
            .await
            .map_err(|e| Error::Client {
                context: self.selection.context.clone(),
                server: self.selection.server.clone(),
                source: kube::Error::Service(Box::new(e)),
            })?;
        built.map_err(|source| match (&self.plugin, &source) {
            (Some((program, _)), kube::Error::Auth(_)) => Error::PluginFailed {
                command: program.display().to_string(),
                user: self.selection.user.clone().unwrap_or_default(),
                source,
            },
            _ => Error::Client {
                context: self.selection.context.clone(),
                server: self.selection.server.clone(),
                source,
            },
        })
    }
}

/// `kube::Client::try_from(config)` with TCP_NODELAY on its API server
/// connections. kube's own builder leaves Nagle on, and every port-forward (the
/// data channel, [`crate::agent`]) rides one of those connections as websocket
/// messages: the second of two back-to-back small messages (a tunnelled TCP
/// handshake's last ACK, then the request) waited for the API server's delayed
/// ACK, 40 ms per tunnelled connection. Same layers as kube's builder (base URI,
/// retry, auth, extra headers, connect/read/write timeouts) without its tracing
/// spans; a proxied cluster (`proxy-url`) keeps kube's builder as it is. The one
/// thing kube keeps private, the expiry of an exec plugin's client certificate
/// (`Client::valid_until`), is not set; kvpn never reads it.
fn client_with_nodelay(config: kube::Config) -> Result<kube::Client, kube::Error> {
    use kube::client::ConfigExt as _;
    use tower::ServiceBuilder;

    if config.proxy_url.is_some() {
        return kube::Client::try_from(config);
    }
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    let https = config.rustls_https_connector_with_connector(http)?;
    let mut connector = hyper_timeout::TimeoutConnector::new(https);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    connector.set_reset_reader_on_write(config.reset_reader_on_write);
    let client: hyper_util::client::legacy::Client<_, kube::client::Body> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build(connector);
    let retry = config
        .default_retry
        .then(|| tower::retry::RetryLayer::new(kube::client::retry::RetryPolicy::server_retry()));
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(retry)
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(tower::BoxError::from)
        .service(client);
    Ok(kube::Client::new(service, config.default_namespace))
}

/// A ready client and what it talks to.
#[derive(Clone)]
pub struct KubeConnection {
    pub client: kube::Client,
    pub description: ClusterDescription,
    pub target: KubeTarget,
}

impl fmt::Debug for KubeConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KubeConnection")
            .field("description", &self.description)
            .finish_non_exhaustive()
    }
}

/// Resolves `flags` in `env`, builds the client and checks it with one
/// `GET /version` (bounded by [`PROBE_TIMEOUT`]), so a wrong server or stale
/// credentials fail here with a message naming them.
pub async fn connect(flags: &KubeFlags, env: &UserEnv) -> Result<KubeConnection, Error> {
    let target = KubeTarget::resolve(flags, env)?;
    connect_target(target).await
}

/// What identifies a cluster besides its API server URL: `ca-sha256:<hex>`, the
/// SHA-256 of the CA certificates `roots` (DER, in kubeconfig order) the client
/// trusts; empty without a CA of the kubeconfig's own.
///
/// Why the CA and not the `kube-system` namespace UID or the manager's install:
/// every cluster installer (kind, k3s, kubeadm, the lab) makes its own CA, so
/// two clusters answering at one URL have different ones; it is known from the
/// kubeconfig alone, before the cluster is asked anything, so disconnect and
/// uninstall can match sessions without a request; it needs no RBAC (a
/// least-privileged user may not read namespaces: the lab's kvpn-user cannot);
/// and it survives a manager reinstall, which a manager's install id would not.
/// A CA rotation makes the cluster look new to sessions connected before it;
/// those could not verify the API server any more anyway.
pub fn cluster_id(roots: Option<&[Vec<u8>]>) -> String {
    use sha2::{Digest as _, Sha256};
    match roots {
        Some(certs) if !certs.is_empty() => {
            let mut h = Sha256::new();
            for der in certs {
                h.update(der);
            }
            let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
            format!("ca-sha256:{hex}")
        }
        _ => String::new(),
    }
}

/// Whether `a` and `b` (two [`cluster_id`]s) may name the same cluster: equal,
/// or one of them unknown (an older session, a kubeconfig without a CA), when
/// the API server URL alone decides as before.
pub fn same_cluster_id(a: &str, b: &str) -> bool {
    a.is_empty() || b.is_empty() || a == b
}

/// [`connect`] for an already resolved target.
pub async fn connect_target(target: KubeTarget) -> Result<KubeConnection, Error> {
    let (client, cluster_id) = target.client_and_id().await?;
    let mut description = target.description();
    description.cluster_id = cluster_id;
    let unreachable = |cause: String| Error::Unreachable {
        server: target.selection.server.clone(),
        context: target.selection.context.clone(),
        cause,
    };
    match tokio::time::timeout(PROBE_TIMEOUT, client.apiserver_version()).await {
        Err(_) => return Err(unreachable(format!("no answer within {PROBE_TIMEOUT:?}"))),
        Ok(Err(kube::Error::Api(s))) if s.code == 401 || s.code == 403 => {
            return Err(Error::Rejected {
                server: target.selection.server.clone(),
                context: target.selection.context.clone(),
                user: target.selection.user.clone().unwrap_or_default(),
                code: s.code,
                reason: s.reason.clone(),
            });
        }
        // UnknownIssuer: no CA of that name; BadSignature: a CA of the same name
        // with another key (a cluster set up again under the same name).
        Ok(Err(e))
            if matches!(
                certificate_error(&e),
                Some(
                    rustls::CertificateError::UnknownIssuer
                        | rustls::CertificateError::BadSignature
                )
            ) =>
        {
            return Err(Error::UntrustedServer {
                server: target.selection.server.clone(),
                context: target.selection.context.clone(),
                ca: target.ca_entry(),
                cause: error_chain(&e),
            });
        }
        Ok(Err(e)) => return Err(unreachable(error_chain(&e))),
        Ok(Ok(info)) => description.server_version = Some(info.git_version),
    }
    Ok(KubeConnection {
        client,
        description,
        target,
    })
}

/// The rustls certificate verdict somewhere in `e`'s source chain. An
/// `io::Error` hides the error it wraps from `source()` (it returns the
/// wrapped error's source), so the walk goes into the wrapped error instead.
pub(crate) fn certificate_error<'a>(
    e: &'a (dyn std::error::Error + 'static),
) -> Option<&'a rustls::CertificateError> {
    let mut cur = Some(e);
    // Bounded: a cyclic chain is a bug elsewhere, not a reason to spin.
    for _ in 0..32 {
        let err = cur?;
        if let Some(rustls::Error::InvalidCertificate(c)) = err.downcast_ref::<rustls::Error>() {
            return Some(c);
        }
        cur = match err
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
            None => err.source(),
        };
    }
    None
}

/// `e: cause: cause…` (kube's errors keep the useful part in their sources).
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)], cwd: &str, euid: u32) -> UserEnv {
        UserEnv::from_parts(
            vars.iter()
                .map(|(k, v)| (OsString::from(k), OsString::from(v))),
            PathBuf::from(cwd),
            euid,
        )
    }

    fn alice() -> Account {
        Account {
            name: "alice".into(),
            uid: 1000,
            gid: 1001,
            home: PathBuf::from("/home/alice"),
        }
    }

    fn no_name(_: &str) -> Result<Option<Account>, Error> {
        panic!("no passwd lookup by name expected")
    }

    fn no_uid(_: u32) -> Result<Option<Account>, Error> {
        panic!("no passwd lookup by uid expected")
    }

    #[test]
    fn user_env_debug_hides_values() {
        let e = env(&[("AWS_SECRET_ACCESS_KEY", "hunter2")], "/", 1);
        let d = format!("{e:?}");
        assert!(
            d.contains("AWS_SECRET_ACCESS_KEY") && !d.contains("hunter2"),
            "{d}"
        );
    }

    #[test]
    fn sudo_is_root_with_a_non_root_sudo_user() {
        assert_eq!(
            sudo_user(&env(&[("SUDO_USER", "alice")], "/", 0)),
            Some("alice")
        );
        assert_eq!(
            sudo_user(&env(&[("SUDO_USER", "alice")], "/", 1000)),
            None,
            "not root"
        );
        assert_eq!(sudo_user(&env(&[("SUDO_USER", "root")], "/", 0)), None);
        assert_eq!(sudo_user(&env(&[("SUDO_USER", "")], "/", 0)), None);
        assert_eq!(sudo_user(&env(&[], "/", 0)), None);
    }

    #[test]
    fn acting_user_under_sudo_is_the_invoking_user() {
        let e = env(&[("SUDO_USER", "alice"), ("HOME", "/root")], "/", 0);
        let got = decide_acting_user(&e, |n| Ok((n == "alice").then(alice)), no_uid).expect("ok");
        assert_eq!(got, ActingUser::Sudo(alice()));
        assert_eq!(got.home(), Some(Path::new("/home/alice")));

        let err = decide_acting_user(&e, |_| Ok(None), no_uid).expect_err("unknown user");
        assert!(
            matches!(err, Error::SudoUserUnknown { ref name } if name == "alice"),
            "{err}"
        );
        assert!(err.to_string().contains("unset SUDO_USER"), "{err}");
    }

    #[test]
    fn acting_user_without_sudo_uses_home_then_passwd() {
        let e = env(&[("HOME", "/home/bob")], "/", 1002);
        assert_eq!(
            decide_acting_user(&e, no_name, no_uid).expect("ok"),
            ActingUser::Current {
                home: Some("/home/bob".into())
            }
        );
        // Relative or missing HOME: passwd entry of the effective uid.
        for e in [env(&[("HOME", "rel")], "/", 1000), env(&[], "/", 1000)] {
            let got =
                decide_acting_user(&e, no_name, |uid| Ok((uid == 1000).then(alice))).expect("ok");
            assert_eq!(got.home(), Some(Path::new("/home/alice")));
        }
        // A non-root process ignores a stray SUDO_USER.
        let e = env(&[("SUDO_USER", "alice"), ("HOME", "/home/bob")], "/", 1002);
        assert_eq!(
            decide_acting_user(&e, no_name, no_uid).expect("ok").home(),
            Some(Path::new("/home/bob"))
        );
    }

    #[test]
    fn sources_flag_beats_env_beats_default() {
        let user = ActingUser::Current {
            home: Some("/home/bob".into()),
        };
        let e = env(&[("KUBECONFIG", "/a::b:/a")], "/work", 1000);
        let flags = KubeFlags {
            kubeconfig: Some("cfg/config".into()),
            ..Default::default()
        };
        assert_eq!(
            kubeconfig_sources(&flags, &e, &user).expect("flag"),
            Sources {
                kind: SourceKind::Flag,
                paths: vec!["/work/cfg/config".into()]
            }
        );
        let s = kubeconfig_sources(&KubeFlags::default(), &e, &user).expect("env");
        assert_eq!(s.kind, SourceKind::EnvList);
        assert_eq!(
            s.paths,
            vec![PathBuf::from("/a"), PathBuf::from("/work/b")],
            "empty dropped, relative resolved, duplicate removed"
        );
        assert_eq!(s.display(), "/a:/work/b");

        for e in [
            env(&[], "/work", 1000),
            env(&[("KUBECONFIG", "")], "/work", 1000),
            env(&[("KUBECONFIG", ":")], "/", 1),
        ] {
            let s = kubeconfig_sources(&KubeFlags::default(), &e, &user).expect("default");
            assert_eq!(s.kind, SourceKind::Default);
            assert_eq!(s.paths, vec![PathBuf::from("/home/bob/.kube/config")]);
        }
        let err = kubeconfig_sources(
            &KubeFlags::default(),
            &env(&[], "/", 7),
            &ActingUser::Current { home: None },
        )
        .expect_err("no home");
        assert!(
            err.to_string().contains("set --kubeconfig or KUBECONFIG"),
            "{err}"
        );
    }

    #[test]
    fn sources_under_sudo_are_the_invoking_users_not_roots() {
        let e = env(&[("SUDO_USER", "alice"), ("HOME", "/root")], "/tmp", 0);
        let user = ActingUser::Sudo(alice());
        let s = kubeconfig_sources(&KubeFlags::default(), &e, &user).expect("default");
        assert_eq!(s.paths, vec![PathBuf::from("/home/alice/.kube/config")]);
        // A KUBECONFIG that survived sudo (sudo -E) is the user's choice.
        let e = e.with_var("KUBECONFIG", "/home/alice/k1:/home/alice/k2");
        let s = kubeconfig_sources(&KubeFlags::default(), &e, &user).expect("env");
        assert_eq!(
            s.paths,
            vec![
                PathBuf::from("/home/alice/k1"),
                PathBuf::from("/home/alice/k2")
            ]
        );
    }

    #[test]
    fn config_dir_follows_xdg_and_sudo() {
        let bob = ActingUser::Current {
            home: Some("/home/bob".into()),
        };
        assert_eq!(
            config_dir(&env(&[], "/", 1), &bob),
            Some("/home/bob/.config/kvpn".into())
        );
        assert_eq!(
            config_dir(&env(&[("XDG_CONFIG_HOME", "/x/cfg")], "/", 1), &bob),
            Some("/x/cfg/kvpn".into())
        );
        assert_eq!(
            config_dir(&env(&[("XDG_CONFIG_HOME", "relative")], "/", 1), &bob),
            Some("/home/bob/.config/kvpn".into()),
            "XDG spec: relative values are ignored"
        );
        // Under sudo: the user's folder even if root's XDG_CONFIG_HOME leaked through.
        assert_eq!(
            config_dir(
                &env(&[("XDG_CONFIG_HOME", "/root/.config")], "/", 0),
                &ActingUser::Sudo(alice())
            ),
            Some("/home/alice/.config/kvpn".into())
        );
        assert_eq!(
            config_dir(&env(&[], "/", 1), &ActingUser::Current { home: None }),
            None
        );
    }

    #[test]
    fn plugin_env_under_sudo_has_the_users_home_and_bin_folders() {
        let e = env(
            &[
                ("SUDO_USER", "alice"),
                ("HOME", "/root"),
                ("PATH", "/usr/bin:/home/alice/.local/bin"),
                ("LANG", "C.UTF-8"),
            ],
            "/",
            0,
        );
        let v = plugin_env(&e, &ActingUser::Sudo(alice()));
        let get = |k: &str| {
            v.get(OsStr::new(k))
                .map(|s| s.to_string_lossy().into_owned())
        };
        assert_eq!(get("HOME").as_deref(), Some("/home/alice"));
        assert_eq!(get("USER").as_deref(), Some("alice"));
        assert_eq!(get("LOGNAME").as_deref(), Some("alice"));
        assert_eq!(
            get("PATH").as_deref(),
            Some("/home/alice/bin:/usr/bin:/home/alice/.local/bin")
        );
        assert_eq!(
            get("LANG").as_deref(),
            Some("C.UTF-8"),
            "the rest passes through"
        );

        let v = plugin_env(&e.clone().without_var("PATH"), &ActingUser::Sudo(alice()));
        assert_eq!(
            v.get(OsStr::new("PATH"))
                .map(|s| s.to_string_lossy().into_owned())
                .as_deref(),
            Some("/home/alice/bin:/home/alice/.local/bin:/usr/local/bin:/usr/bin:/bin")
        );
        // Not under sudo: exactly the user's environment.
        let mine = env(
            &[("HOME", "/home/bob"), ("PATH", "/home/bob/bin:/usr/bin")],
            "/",
            1000,
        );
        let v = plugin_env(
            &mine,
            &ActingUser::Current {
                home: Some("/home/bob".into()),
            },
        );
        assert_eq!(
            v,
            mine.vars()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect()
        );
    }

    #[test]
    fn resolve_program_searches_path_like_execvp() {
        let exists =
            |set: &'static [&'static str]| move |p: &Path| set.iter().any(|s| Path::new(s) == p);
        let path = OsStr::new("/home/a/bin::rel:/usr/bin");
        assert_eq!(
            resolve_program(
                "tok",
                Some(path),
                Path::new("/cwd"),
                exists(&["/usr/bin/tok", "/home/a/bin/tok"])
            ),
            Some("/home/a/bin/tok".into()),
            "first PATH entry wins"
        );
        assert_eq!(
            resolve_program(
                "tok",
                Some(path),
                Path::new("/cwd"),
                exists(&["/cwd/tok", "/usr/bin/tok"])
            ),
            Some("/cwd/tok".into()),
            "empty entry is the working folder"
        );
        assert_eq!(
            resolve_program(
                "tok",
                Some(path),
                Path::new("/cwd"),
                exists(&["/cwd/rel/tok"])
            ),
            Some("/cwd/rel/tok".into())
        );
        assert_eq!(
            resolve_program("tok", Some(path), Path::new("/cwd"), exists(&[])),
            None
        );
        assert_eq!(
            resolve_program(
                "./x/tok",
                Some(path),
                Path::new("/cwd"),
                exists(&["/usr/bin/tok", "/cwd/./x/tok"])
            ),
            Some("/cwd/./x/tok".into()),
            "a command with a slash is never searched on PATH"
        );
        assert_eq!(
            resolve_program("/opt/tok", None, Path::new("/cwd"), exists(&["/opt/tok"])),
            Some("/opt/tok".into())
        );
        assert_eq!(
            resolve_program("", Some(path), Path::new("/cwd"), |_| true),
            None
        );
    }

    #[test]
    fn run_as_user_wraps_the_plugin_in_setpriv() {
        let exec = ExecConfig {
            api_version: Some("client.authentication.k8s.io/v1".into()),
            command: Some("tok".into()),
            args: Some(vec!["get-token".into(), "--x".into()]),
            ..Default::default()
        };
        let w = run_as_user(
            &exec,
            Path::new("/home/alice/bin/tok"),
            &alice(),
            Path::new("/usr/bin/setpriv"),
        );
        assert_eq!(w.command.as_deref(), Some("/usr/bin/setpriv"));
        assert_eq!(
            w.args.expect("args"),
            [
                "--reuid=1000",
                "--regid=1001",
                "--init-groups",
                "--",
                "/home/alice/bin/tok",
                "get-token",
                "--x"
            ]
        );
        assert_eq!(w.api_version, exec.api_version);
    }

    const A: &str = r#"
apiVersion: v1
kind: Config
current-context: a-ctx
clusters:
- name: shared
  cluster: {server: "https://a.example:6443"}
- name: a-only
  cluster: {server: "https://a-only.example:6443"}
users:
- name: u
  user: {token: "from-a"}
contexts:
- name: a-ctx
  context: {cluster: a-only, user: u}
- name: both
  context: {cluster: shared, user: u, namespace: from-a}
"#;

    const B: &str = r#"
apiVersion: v1
kind: Config
current-context: b-ctx
clusters:
- name: shared
  cluster: {server: "https://b.example:6443", insecure-skip-tls-verify: true}
users:
- name: u
  user: {token: "from-b"}
- name: v
  user: {client-certificate: v.crt, client-key: v.key}
contexts:
- name: b-ctx
  context: {cluster: shared, user: v}
- name: both
  context: {cluster: shared, user: v, namespace: from-b}
- name: dangling-cluster
  context: {cluster: nowhere, user: v}
- name: dangling-user
  context: {cluster: shared, user: nobody}
- name: no-user
  context: {cluster: shared}
"#;

    fn merged() -> Merged {
        merge(vec![
            ("/k/a".into(), Kubeconfig::from_yaml(A).expect("A")),
            ("/k/b".into(), Kubeconfig::from_yaml(B).expect("B")),
        ])
    }

    fn ctx(name: &str) -> KubeFlags {
        KubeFlags {
            context: Some(name.into()),
            ..Default::default()
        }
    }

    #[test]
    fn merge_first_file_wins_per_name() {
        let m = merged();
        assert_eq!(m.config.current_context.as_deref(), Some("a-ctx"));
        let shared = m
            .config
            .clusters
            .iter()
            .find(|c| c.name == "shared")
            .expect("shared");
        let shared = shared.cluster.as_ref().expect("cluster");
        assert_eq!(shared.server.as_deref(), Some("https://a.example:6443"));
        assert_eq!(
            shared.insecure_skip_tls_verify, None,
            "a later file's entry is dropped whole, not merged"
        );
        assert_eq!(m.context_file["both"], PathBuf::from("/k/a"));
        assert_eq!(m.context_file["b-ctx"], PathBuf::from("/k/b"));
        assert_eq!(m.user_file["u"], PathBuf::from("/k/a"));
        // a-ctx, both (from a); b-ctx, dangling-cluster, dangling-user, no-user (from b).
        assert_eq!(m.config.contexts.len(), 6);
    }

    #[test]
    fn select_finds_a_context_from_any_file() {
        let m = merged();
        let s = select(&m, &ctx("b-ctx")).expect("b-ctx");
        assert_eq!(s.context_file, PathBuf::from("/k/b"));
        assert_eq!(
            s.server, "https://a.example:6443",
            "cluster `shared` comes from the first file"
        );
        assert_eq!(s.user.as_deref(), Some("v"));
        assert_eq!(s.namespace, "default");

        let s = select(&m, &KubeFlags::default()).expect("current");
        assert_eq!(s.context, "a-ctx");
        assert_eq!(s.server, "https://a-only.example:6443");

        assert_eq!(select(&m, &ctx("both")).expect("both").namespace, "from-a");
        let mut f = ctx("both");
        f.namespace = Some("mine".into());
        assert_eq!(select(&m, &f).expect("both").namespace, "mine");
        assert_eq!(select(&m, &ctx("no-user")).expect("no user").user, None);
    }

    #[test]
    fn select_errors_name_the_thing_and_the_fix() {
        let m = merged();
        let e = select(&m, &ctx("foo")).expect_err("missing");
        assert_eq!(
            e.to_string(),
            "context \"foo\" not found in kubeconfig /k/a:/k/b — available: a-ctx, b-ctx, both, dangling-cluster, \
             dangling-user, no-user; pick one with --context"
        );
        let e = select(&m, &ctx("dangling-cluster")).expect_err("cluster");
        assert!(e.to_string().contains("names cluster \"nowhere\""), "{e}");
        assert!(e.to_string().contains("(in /k/b)"), "{e}");
        let e = select(&m, &ctx("dangling-user")).expect_err("user");
        assert!(e.to_string().contains("names user \"nobody\""), "{e}");

        let mut none = merged();
        none.config.current_context = None;
        let e = select(&none, &KubeFlags::default()).expect_err("no current");
        assert!(
            e.to_string()
                .contains("has no current-context — pick one with --context (available: a-ctx"),
            "{e}"
        );

        let no_server = merge(vec![(
            "/k/c".into(),
            Kubeconfig::from_yaml("clusters: [{name: c, cluster: {}}]\ncontexts: [{name: x, context: {cluster: c}}]\n")
                .expect("yaml"),
        )]);
        let e = select(&no_server, &ctx("x")).expect_err("no server");
        assert!(
            e.to_string()
                .contains("cluster \"c\" (in /k/c) has no server URL"),
            "{e}"
        );
    }

    #[test]
    fn cluster_id_tells_cas_apart_and_is_empty_without_one() {
        let a = cluster_id(Some(&[b"ca one".to_vec()]));
        let b = cluster_id(Some(&[b"ca two".to_vec()]));
        assert!(
            a.starts_with("ca-sha256:") && a.len() == "ca-sha256:".len() + 64,
            "{a}"
        );
        assert_ne!(a, b);
        assert_eq!(a, cluster_id(Some(&[b"ca one".to_vec()])), "stable");
        assert_eq!(cluster_id(None), "");
        assert_eq!(cluster_id(Some(&[])), "");
        assert!(same_cluster_id(&a, &a));
        assert!(!same_cluster_id(&a, &b));
        assert!(same_cluster_id(&a, ""), "an older session matches by URL");
        assert!(same_cluster_id("", &b));
    }

    #[test]
    fn description_reads_as_one_line() {
        let d = ClusterDescription {
            server: "https://127.1.2.3:6443".into(),
            context: "lab".into(),
            cluster: "kvpn-lab-x".into(),
            user: Some("kvpn-user".into()),
            namespace: "kvpn-system".into(),
            kubeconfig: vec!["/k/a".into()],
            context_file: "/k/a".into(),
            auth: "client certificate".into(),
            acting_for: Some("alice".into()),
            server_version: Some("v1.20.2".into()),
            cluster_id: String::new(),
        };
        assert_eq!(
            d.to_string(),
            "context lab (cluster kvpn-lab-x at https://127.1.2.3:6443, Kubernetes v1.20.2), user kvpn-user \
             with client certificate, namespace kvpn-system, from /k/a, for alice (sudo)"
        );
    }

    /// A scratch folder removed on drop.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(tag: &str) -> Self {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("clock")
                .as_nanos();
            let p =
                std::env::temp_dir().join(format!("kvpn-kc-{tag}-{}-{t:x}", std::process::id()));
            std::fs::create_dir_all(&p).expect("scratch folder");
            Scratch(p)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn write_exe(path: &Path, text: &str) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(path, text).expect("write");
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }

    /// kube-02's pure half: every relative path in a kubeconfig ends up under
    /// the kubeconfig's own folder, wherever kvpn runs from and however the
    /// kubeconfig path was written; bare exec commands stay PATH lookups.
    #[test]
    fn relative_paths_resolve_against_the_kubeconfigs_folder() {
        let s = Scratch::new("rel");
        let cfg = s.0.join("cfg");
        let work = s.0.join("work");
        std::fs::create_dir_all(cfg.join("bin")).expect("mkdir");
        std::fs::create_dir_all(&work).expect("mkdir");
        write_exe(&cfg.join("get-token.sh"), "#!/bin/sh\n");
        write_exe(&cfg.join("bin").join("helper"), "#!/bin/sh\n");
        std::fs::write(
            cfg.join("config"),
            r#"
clusters:
- name: c
  cluster: {server: "https://127.0.0.1:1", certificate-authority: ca.crt}
users:
- name: rel-exec
  user:
    client-certificate: pki/u.crt
    client-key: ./pki/u.key
    tokenFile: tok
    exec: {apiVersion: client.authentication.k8s.io/v1, command: ./get-token.sh}
- name: sub-exec
  user:
    exec: {apiVersion: client.authentication.k8s.io/v1, command: bin/helper}
- name: path-exec
  user:
    exec: {apiVersion: client.authentication.k8s.io/v1, command: sh}
contexts:
- {name: rel, context: {cluster: c, user: rel-exec}}
- {name: sub, context: {cluster: c, user: sub-exec}}
- {name: path, context: {cluster: c, user: path-exec}}
current-context: rel
"#,
        )
        .expect("write config");
        let env = UserEnv::current()
            .expect("env")
            .with_cwd(&work)
            .without_var("KUBECONFIG");
        let me = ActingUser::Current {
            home: Some(s.0.clone()),
        };
        let flags = KubeFlags {
            // Relative to the user's working folder, not this process's.
            kubeconfig: Some("../cfg/config".into()),
            ..Default::default()
        };
        let t = KubeTarget::resolve_for(&flags, &env, me.clone()).expect("resolve");
        let c = t.kubeconfig.clusters[0].cluster.as_ref().expect("cluster");
        let base = work.join("../cfg");
        let under = |rel: &str| base.join(rel).display().to_string();
        assert_eq!(
            c.certificate_authority.as_deref(),
            Some(under("ca.crt").as_str())
        );
        let u = t.kubeconfig.auth_infos[0].auth_info.as_ref().expect("user");
        assert_eq!(
            u.client_certificate.as_deref(),
            Some(under("pki/u.crt").as_str())
        );
        assert_eq!(u.client_key.as_deref(), Some(under("./pki/u.key").as_str()));
        assert_eq!(u.token_file.as_deref(), Some(under("tok").as_str()));
        assert_eq!(
            u.exec.as_ref().and_then(|e| e.command.clone()),
            Some(under("./get-token.sh"))
        );
        assert_eq!(
            t.plugin,
            Some((base.join("./get-token.sh"), PluginRun::AsCaller))
        );
        assert_eq!(t.description().context_file, base.join("config"));

        let sub = KubeTarget::resolve_for(
            &KubeFlags {
                context: Some("sub".into()),
                ..flags.clone()
            },
            &env,
            me.clone(),
        )
        .expect("sub");
        assert_eq!(sub.plugin.map(|p| p.0), Some(base.join("bin/helper")));

        // A bare command is looked up on the user's PATH, not made relative.
        let path = KubeTarget::resolve_for(
            &KubeFlags {
                context: Some("path".into()),
                ..flags.clone()
            },
            &env.clone().with_var("PATH", "/usr/bin:/bin"),
            me.clone(),
        )
        .expect("path");
        assert_eq!(path.plugin.map(|p| p.0), Some(PathBuf::from("/usr/bin/sh")));

        // The plugin missing from the kubeconfig's folder: the error says where it looked.
        std::fs::remove_file(cfg.join("get-token.sh")).expect("rm");
        let e = KubeTarget::resolve_for(&flags, &env, me).expect_err("plugin gone");
        let msg = e.to_string();
        assert!(matches!(e, Error::PluginNotFound { .. }), "{msg}");
        assert!(msg.contains("get-token.sh"), "{msg}");
        assert!(
            msg.contains("resolved against the kubeconfig's folder"),
            "{msg}"
        );
    }

    /// A file that is no kubeconfig (`--kubeconfig /etc/passwd`): the error names
    /// the file, where parsing failed and the fix, and quotes none of the file's
    /// lines (the YAML parser's message showed the first three).
    #[test]
    fn parse_errors_do_not_echo_the_file() {
        let s = Scratch::new("parse-echo");
        let env = UserEnv::current()
            .expect("env")
            .with_cwd(&s.0)
            .without_var("KUBECONFIG");
        let me = ActingUser::Current {
            home: Some(s.0.join("home")),
        };
        let secret = "hunter2-s3cr3t";
        for (name, text) in [
            (
                "passwd",
                format!(
                    "root:x:0:0:root:/root:/bin/bash\nalice:{secret}:1000:1000::/home/alice:/bin/sh\nbob:x:1001:1001::/home/bob:/bin/sh\n"
                ),
            ),
            ("scalar", format!("token-{secret}\n")),
            (
                "badyaml",
                format!("apiVersion: v1\nusers: [{{name: a, token: {secret}}}\nclusters: [oops\n"),
            ),
            ("wrongtype", format!("apiVersion: v1\nclusters: {secret}\n")),
            (
                "wrongfield",
                format!("apiVersion: v1\nclusters:\n- name: c\n  cluster: \"{secret}\"\n"),
            ),
            (
                "badport",
                format!("apiVersion: v1\npreferences: {{colors: \"{secret}\"}}\n"),
            ),
        ] {
            let path = s.0.join(name);
            std::fs::write(&path, text).expect("write");
            let flags = KubeFlags {
                kubeconfig: Some(path.clone()),
                ..Default::default()
            };
            let e = KubeTarget::resolve_for(&flags, &env, me.clone()).expect_err(name);
            let msg = e.to_string();
            assert!(matches!(e, Error::Parse { .. }), "{name}: {msg}");
            assert!(
                !msg.contains(secret) && !msg.contains("root:x"),
                "{name} echoes the file: {msg}"
            );
            assert!(!msg.contains(" | "), "{name} quotes lines: {msg}");
            assert!(msg.contains(&path.display().to_string()), "{name}: {msg}");
            assert!(msg.contains("line "), "{name}: no line in {msg}");
            assert!(
                msg.contains("pick another with --kubeconfig"),
                "{name}: {msg}"
            );
        }
    }

    #[test]
    fn missing_files_give_the_fix() {
        let s = Scratch::new("missing");
        let env = UserEnv::current()
            .expect("env")
            .with_cwd(&s.0)
            .without_var("KUBECONFIG");
        let me = ActingUser::Current {
            home: Some(s.0.join("home")),
        };
        let e = KubeTarget::resolve_for(&KubeFlags::default(), &env, me.clone())
            .expect_err("no default");
        assert_eq!(
            e.to_string(),
            format!(
                "kubeconfig {}: no such file — set --kubeconfig or KUBECONFIG",
                s.0.join("home/.kube/config").display()
            )
        );
        let flags = KubeFlags {
            kubeconfig: Some("nope".into()),
            ..Default::default()
        };
        let e = KubeTarget::resolve_for(&flags, &env, me.clone()).expect_err("no flag file");
        assert!(
            e.to_string()
                .contains("nope: no such file — check the path given with --kubeconfig"),
            "{e}"
        );
        let env = env.with_var("KUBECONFIG", "x:y");
        let e = KubeTarget::resolve_for(&KubeFlags::default(), &env, me.clone())
            .expect_err("no list file");
        assert!(
            e.to_string()
                .starts_with("none of the kubeconfig files in KUBECONFIG exists ("),
            "{e}"
        );
        std::fs::write(s.0.join("y"), "clusters: [oops").expect("write");
        let e = KubeTarget::resolve_for(&KubeFlags::default(), &env, me).expect_err("bad yaml");
        assert!(matches!(e, Error::Parse { .. }), "{e}");
        assert!(e.to_string().contains("is not a valid kubeconfig"), "{e}");
    }

    /// A TLS server on loopback with a certificate of one CA, and kubeconfig
    /// clusters pointing at it: with another CA, with a CA file of garbage, and
    /// with the right CA. On main the first two read "cannot reach the API
    /// server … UnknownIssuer — check that the cluster runs"; now each names
    /// the CA entry, the cluster and the file. The right CA gets past TLS (the
    /// server speaks no HTTP), so it is no certificate error.
    #[tokio::test]
    async fn a_wrong_or_garbage_ca_is_named_not_called_unreachable() {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let loopback = std::net::IpAddr::from([127, 0, 0, 1]);
        let served = crate::install::certs::generate("kvpn-ca-test", Some(loopback))
            .expect("server certificate");
        // Another CA by name (UnknownIssuer), and one of the same name with
        // another key (BadSignature: the cluster was set up again).
        let other =
            crate::install::certs::generate("kvpn-ca-other", Some(loopback)).expect("another CA");
        let again = crate::install::certs::generate("kvpn-ca-test", Some(loopback))
            .expect("a CA of the same name");
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let certs: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(served.cert_pem.as_bytes())
                .collect::<Result<_, _>>()
                .expect("cert is PEM");
        let key = PrivateKeyDer::from_pem_slice(served.key_pem.as_bytes()).expect("key is PEM");
        let server = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("protocols")
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .expect("key matches cert");
        let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(server));
        let listener = tokio::net::TcpListener::bind((loopback, 0))
            .await
            .expect("bind loopback");
        let port = listener.local_addr().expect("addr").port();
        let accept = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    // Handshake, then close: no HTTP.
                    let _ = acceptor.accept(tcp).await;
                });
            }
        });

        let s = Scratch::new("ca");
        std::fs::write(s.0.join("wrong.crt"), &other.ca_pem).expect("write");
        std::fs::write(s.0.join("again.crt"), &again.ca_pem).expect("write");
        std::fs::write(s.0.join("garbage.crt"), "garbage\n").expect("write");
        std::fs::write(s.0.join("right.crt"), &served.ca_pem).expect("write");
        let mut yaml = String::from("clusters:\n");
        for c in ["wrong", "again", "garbage", "right"] {
            yaml.push_str(&format!(
                "- name: {c}-cluster\n  cluster: {{server: \"https://127.0.0.1:{port}\", certificate-authority: {c}.crt}}\n"
            ));
        }
        yaml.push_str("contexts:\n");
        for c in ["wrong", "again", "garbage", "right"] {
            yaml.push_str(&format!(
                "- {{name: {c}, context: {{cluster: {c}-cluster}}}}\n"
            ));
        }
        let config = s.0.join("config");
        std::fs::write(&config, yaml).expect("write config");
        let env = UserEnv::current()
            .expect("env")
            .with_cwd(&s.0)
            .without_var("KUBECONFIG");
        let flags = |c: &str| KubeFlags {
            kubeconfig: Some(config.clone()),
            context: Some(c.into()),
            namespace: None,
        };

        for (c, cause) in [("wrong", "UnknownIssuer"), ("again", "BadSignature")] {
            let e = connect(&flags(c), &env).await.expect_err("wrong CA");
            let msg = e.to_string();
            assert!(matches!(e, Error::UntrustedServer { .. }), "{msg}");
            for want in [
                "not signed by the certificate-authority",
                &format!("{c}.crt"),
                &format!("\"{c}-cluster\""),
                config.to_str().expect("utf-8 path"),
                "kubectl config view --raw",
                cause,
            ] {
                assert!(msg.contains(want), "no {want:?} in {msg}");
            }
            assert!(!msg.contains("check that the cluster runs"), "{msg}");
        }

        let e = connect(&flags("garbage"), &env)
            .await
            .expect_err("garbage CA");
        let msg = e.to_string();
        assert!(matches!(e, Error::CaNotPem { .. }), "{msg}");
        for want in [
            "garbage.crt",
            "holds no PEM certificate",
            "\"garbage-cluster\"",
        ] {
            assert!(msg.contains(want), "no {want:?} in {msg}");
        }

        let e = connect(&flags("right"), &env).await.expect_err("no HTTP");
        assert!(matches!(e, Error::Unreachable { .. }), "right CA: {e}");
        accept.abort();
    }
}
