//! `kvpn version`: which kvpn build each part runs — the CLI, the user daemon,
//! the root daemon and each connected cluster's traffic manager — and what to do
//! when a daemon runs another build than the CLI (after an upgrade, daemons
//! started by the old kvpn keep running its code).
//!
//! The pure core is [`Build`], [`relation`], the notes and [`Report`] with its
//! table; [`run`] is the shell: it asks the daemons that already run (it never
//! starts one that does not), restarts a daemon older than the CLI when no
//! session exists, and hands the report to [`crate::output::version`].
//! A manager's build is what it said in its Lease answer at connect (kept in the
//! session's origin); a direct (`--manager`) session's manager is never asked.

use std::cmp::Ordering;
use std::path::Path;

use anyhow::Result;
use kvpn_proto::dataplane::Origin;
use serde::Serialize;

use crate::cli::VersionArgs;
use crate::install::objects::compare_versions;
use crate::userd::connect_lock::ConnectLock;
use crate::{daemon, liveness, output, userd};

/// A kvpn build: version and short source commit, each empty when the part
/// did not say ([`kvpn_build_info::UNKNOWN_COMMIT`] when its build knew none).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Build {
    pub version: String,
    pub commit: String,
}

impl Build {
    /// This binary's build.
    pub fn this() -> Build {
        Build::new(kvpn_build_info::VERSION, kvpn_build_info::COMMIT)
    }

    pub fn new(version: &str, commit: &str) -> Build {
        Build {
            version: version.to_owned(),
            commit: commit.to_owned(),
        }
    }

    /// "0.1.0 at commit 5d92e3c", or "0.1.0" without a known commit.
    pub fn describe(&self) -> String {
        if commit_known(&self.commit) {
            format!("{} at commit {}", self.version, self.commit)
        } else {
            self.version.clone()
        }
    }
}

fn commit_known(commit: &str) -> bool {
    !commit.is_empty() && commit != kvpn_build_info::UNKNOWN_COMMIT
}

/// How another part's build relates to the CLI's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Relation {
    /// The same version, and the same commit where both know theirs.
    Same,
    /// An older version.
    Older,
    /// A newer version.
    Newer,
    /// The same version from another commit, or versions that do not compare.
    OtherBuild,
    /// The part said nothing (an empty version).
    Unknown,
}

/// How `theirs` relates to the CLI's build `cli` (pure).
pub fn relation(theirs: &Build, cli: &Build) -> Relation {
    if theirs.version.is_empty() {
        return Relation::Unknown;
    }
    match compare_versions(&theirs.version, &cli.version) {
        Some(Ordering::Less) => Relation::Older,
        Some(Ordering::Greater) => Relation::Newer,
        Some(Ordering::Equal) if theirs.version == cli.version => {
            if commit_known(&theirs.commit)
                && commit_known(&cli.commit)
                && theirs.commit != cli.commit
            {
                Relation::OtherBuild
            } else {
                Relation::Same
            }
        }
        _ => Relation::OtherBuild,
    }
}

/// Whether a daemon of build `theirs` should make way for the CLI's: older, from
/// another commit, or so old it reports no version. A newer one stays (another,
/// newer kvpn started it).
fn outdated(theirs: &Build, cli: &Build) -> bool {
    matches!(
        relation(theirs, cli),
        Relation::Older | Relation::OtherBuild | Relation::Unknown
    )
}

/// A daemon's state as `kvpn version` found (or left) it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DaemonState {
    /// It answered.
    Running,
    /// None runs (nothing was started for this).
    NotRunning,
    /// Its process runs but does not answer (stopped, hung), or it refused.
    NotAnswering,
    /// It ran another build, held no session and was restarted with this one.
    Restarted,
    /// It ran another build, held no session and was stopped (a normal user's
    /// kvpn does not start a root daemon just for this).
    Stopped,
}

impl DaemonState {
    fn words(self) -> &'static str {
        match self {
            DaemonState::Running => "running",
            DaemonState::NotRunning => "not running",
            DaemonState::NotAnswering => "not answering",
            DaemonState::Restarted => "restarted",
            DaemonState::Stopped => "stopped",
        }
    }
}

/// One local daemon in the report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DaemonVersion {
    pub state: DaemonState,
    pub pid: Option<u32>,
    /// `None` when it did not answer, or answered without a version (older
    /// than `kvpn version`).
    pub version: Option<String>,
    pub commit: Option<String>,
    /// What is wrong and the fix, or what `kvpn version` did about it.
    pub note: Option<String>,
}

impl DaemonVersion {
    fn absent(state: DaemonState, note: Option<String>) -> Self {
        DaemonVersion {
            state,
            pid: None,
            version: None,
            commit: None,
            note,
        }
    }

    /// One that answered with `build`; `which` ("user daemon", "root daemon")
    /// and `sessions` (how many sessions exist) go into the note.
    fn answered(
        which: &str,
        pid: Option<u32>,
        build: &Build,
        cli: &Build,
        sessions: usize,
    ) -> Self {
        DaemonVersion {
            state: DaemonState::Running,
            pid,
            version: non_empty(&build.version),
            commit: non_empty(&build.commit),
            note: daemon_note(which, build, cli, sessions),
        }
    }
}

fn non_empty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_owned())
}

/// What to say about a running daemon of build `theirs` when the CLI is `cli`
/// and `sessions` sessions exist (pure); `None` when they match.
pub fn daemon_note(which: &str, theirs: &Build, cli: &Build, sessions: usize) -> Option<String> {
    let what = match relation(theirs, cli) {
        Relation::Same => return None,
        Relation::Newer => {
            return Some(format!(
                "newer than this CLI ({}): a newer kvpn started it — use that kvpn, or run \
                 `kvpn quit` to stop it and let this one start its own",
                cli.describe()
            ));
        }
        Relation::Unknown => format!(
            "older than this CLI ({}): it reports no version",
            cli.describe()
        ),
        Relation::Older => format!("older than this CLI ({})", cli.describe()),
        Relation::OtherBuild => format!(
            "another build than this CLI ({}) — an old daemon still running after a rebuild",
            cli.describe()
        ),
    };
    let ends = match sessions {
        0 => String::new(),
        1 => " (it ends the session: connect again after)".to_owned(),
        n => format!(" (it ends the {n} sessions: connect again after)"),
    };
    Some(format!(
        "the {which} is {what} — run `kvpn quit`{ends}; the next kvpn command starts this version's"
    ))
}

/// The note of a daemon `kvpn version` restarted (or stopped) because it ran
/// `was` and held no session.
fn replaced_note(was: &Build, state: DaemonState) -> String {
    let was = if was.version.is_empty() {
        "a build that reports no version".to_owned()
    } else {
        was.describe()
    };
    match state {
        DaemonState::Stopped => format!(
            "it ran {was} and held no session: stopped; the next `kvpn connect` starts this \
             version's"
        ),
        _ => format!("it ran {was} and held no session: restarted with this build"),
    }
}

/// One connected cluster's traffic manager.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ManagerVersion {
    /// The session id.
    pub session: String,
    /// "port-forward", "socks" or "direct".
    pub transport: String,
    pub cluster: String,
    pub context: String,
    pub server: String,
    pub namespace: String,
    pub version: Option<String>,
    pub commit: Option<String>,
    pub note: Option<String>,
}

/// A session's manager row (pure).
pub fn manager_version(session: &str, origin: &Origin, cli: &Build) -> ManagerVersion {
    let build = Build::new(&origin.manager_version, &origin.manager_commit);
    let note = match relation(&build, cli) {
        Relation::Same => None,
        Relation::Unknown if origin.transport == crate::connect::TRANSPORT_DIRECT => Some(
            "a direct (--manager) session: kvpn does not ask that manager its version".to_owned(),
        ),
        Relation::Unknown => Some(format!(
            "not known: an older kvpn connected this session — `kvpn disconnect {session}` \
             and connect again to see it"
        )),
        Relation::Older => Some(format!(
            "older than this CLI ({}): `kvpn disconnect {session}`, then `kvpn connect` \
             upgrades it",
            cli.describe()
        )),
        Relation::Newer => Some(format!(
            "newer than this CLI ({}): a newer kvpn installed it",
            cli.describe()
        )),
        Relation::OtherBuild => Some(format!(
            "another build than this CLI ({}): `kvpn disconnect {session}`, then `kvpn connect` \
             re-applies this CLI's manager",
            cli.describe()
        )),
    };
    ManagerVersion {
        session: session.to_owned(),
        transport: origin.transport.clone(),
        cluster: origin.cluster.clone(),
        context: origin.context.clone(),
        server: origin.server.clone(),
        namespace: origin.manager_namespace.clone(),
        version: non_empty(&build.version),
        commit: non_empty(&build.commit),
        note,
    }
}

/// Everything `kvpn version` shows (`-o json|yaml`: this document).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    pub cli: Build,
    pub user_daemon: DaemonVersion,
    pub root_daemon: DaemonVersion,
    pub managers: Vec<ManagerVersion>,
}

/// The table (pure): one line per part, its note indented under it.
pub fn table(r: &Report) -> String {
    let dash = |s: &Option<String>| s.clone().unwrap_or_else(|| "-".to_owned());
    let mut rows: Vec<[String; 4]> = vec![[
        "kvpn (CLI)".to_owned(),
        r.cli.version.clone(),
        r.cli.commit.clone(),
        String::new(),
    ]];
    let mut notes: Vec<Option<String>> = vec![None];
    for (name, d) in [
        ("user daemon", &r.user_daemon),
        ("root daemon", &r.root_daemon),
    ] {
        let detail = match d.pid {
            Some(pid) => format!("{} (pid {pid})", d.state.words()),
            None => d.state.words().to_owned(),
        };
        rows.push([name.to_owned(), dash(&d.version), dash(&d.commit), detail]);
        notes.push(d.note.clone());
    }
    for m in &r.managers {
        let place = if m.transport == crate::connect::TRANSPORT_DIRECT {
            format!("session {} (direct)", m.session)
        } else {
            format!(
                "session {}: cluster {} (context {}), namespace {}",
                m.session, m.cluster, m.context, m.namespace
            )
        };
        rows.push([
            "manager".to_owned(),
            dash(&m.version),
            dash(&m.commit),
            place,
        ]);
        notes.push(m.note.clone());
    }
    let header = [
        "PART".to_owned(),
        "VERSION".to_owned(),
        "COMMIT".to_owned(),
        "STATE".to_owned(),
    ];
    let mut widths = [0usize; 3];
    for row in std::iter::once(&header).chain(&rows) {
        for (w, cell) in widths.iter_mut().zip(row.iter()) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |row: &[String; 4]| {
        format!(
            "{:w0$}  {:w1$}  {:w2$}  {}",
            row[0],
            row[1],
            row[2],
            row[3],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2]
        )
        .trim_end()
        .to_owned()
    };
    let mut out = line(&header) + "\n";
    for (row, note) in rows.iter().zip(&notes) {
        out.push_str(&line(row));
        out.push('\n');
        if let Some(n) = note {
            out.push_str(&format!("  ! {n}\n"));
        }
    }
    if r.managers.is_empty() {
        out.push_str("(no session: managers are listed while connected)\n");
    }
    out
}

/// What a daemon said when asked.
enum Answer<T> {
    Running(T),
    NotRunning,
    /// Its process runs and does not answer, or the call failed: why.
    NotAnswering(String),
}

/// `kvpn version`.
pub async fn run(runtime_dir: &Path, args: VersionArgs) -> Result<()> {
    let cli = Build::this();
    let mut user = ask_user_daemon(runtime_dir).await;
    let mut root = ask_root_daemon(runtime_dir).await;
    let sessions = sessions_of(&user, &root);

    // A daemon of another build that holds no session is replaced now, so the
    // next connect runs this build's; one with sessions is only named (replacing
    // it would end them).
    let mut user_replaced = None;
    let mut root_replaced = None;
    let user_outdated = matches!(&user, Answer::Running(st) if outdated(&Build::new(&st.version, &st.commit), &cli));
    let root_outdated = matches!(&root, Answer::Running(st) if outdated(&Build::new(&st.version, &st.commit), &cli));
    if sessions.is_empty() && (user_outdated || root_outdated) {
        // Held while replacing: a `kvpn connect` starting now waits for it.
        let lock_dir = ConnectLock::path(runtime_dir);
        let lock = if lock_dir.parent().is_some_and(Path::is_dir) {
            ConnectLock::try_for_restart(runtime_dir)?.map(Some)
        } else {
            Some(None)
        };
        if let Some(_lock) = lock {
            if let Answer::Running(st) = &user
                && user_outdated
            {
                let was = Build::new(&st.version, &st.commit);
                userd::quit(runtime_dir).await?;
                user = match userd::connect_or_start(runtime_dir).await {
                    Ok(_) => ask_user_daemon(runtime_dir).await,
                    Err(e) => Answer::NotAnswering(output::error_chain(&e)),
                };
                user_replaced = Some(was);
            }
            if let Answer::Running(st) = &root
                && root_outdated
            {
                let was = Build::new(&st.version, &st.commit);
                daemon::stop_quietly(runtime_dir).await?;
                // SAFETY: geteuid has no preconditions and cannot fail.
                let is_root = unsafe { libc::geteuid() } == 0;
                root = if is_root {
                    match daemon::connect_or_start(runtime_dir).await {
                        Ok(_) => ask_root_daemon(runtime_dir).await,
                        Err(e) => Answer::NotAnswering(output::error_chain(&e)),
                    }
                } else {
                    Answer::NotRunning
                };
                root_replaced = Some(was);
            }
        }
    }

    let user_daemon = match &user {
        Answer::Running(st) => {
            let mut d = DaemonVersion::answered(
                "user daemon",
                Some(st.daemon_pid),
                &Build::new(&st.version, &st.commit),
                &cli,
                sessions.len(),
            );
            if let Some(was) = &user_replaced {
                d.state = DaemonState::Restarted;
                d.note = Some(replaced_note(was, DaemonState::Restarted));
            }
            d
        }
        Answer::NotRunning => DaemonVersion::absent(DaemonState::NotRunning, None),
        Answer::NotAnswering(why) => {
            DaemonVersion::absent(DaemonState::NotAnswering, Some(why.clone()))
        }
    };
    let root_daemon = match &root {
        Answer::Running(st) => {
            let mut d = DaemonVersion::answered(
                "root daemon",
                read_pid(&daemon::pid_path(runtime_dir)),
                &Build::new(&st.version, &st.commit),
                &cli,
                sessions.len(),
            );
            if let Some(was) = &root_replaced {
                d.state = DaemonState::Restarted;
                d.note = Some(replaced_note(was, DaemonState::Restarted));
            }
            d
        }
        Answer::NotRunning => match &root_replaced {
            Some(was) => DaemonVersion::absent(
                DaemonState::Stopped,
                Some(replaced_note(was, DaemonState::Stopped)),
            ),
            None => DaemonVersion::absent(DaemonState::NotRunning, None),
        },
        Answer::NotAnswering(why) => {
            DaemonVersion::absent(DaemonState::NotAnswering, Some(why.clone()))
        }
    };
    let managers = sessions
        .iter()
        .map(|(id, origin)| manager_version(id, origin, &cli))
        .collect();
    output::version(
        &Report {
            cli,
            user_daemon,
            root_daemon,
            managers,
        },
        args.output,
    )
}

/// The running user daemon's Status; none is started.
async fn ask_user_daemon(runtime_dir: &Path) -> Answer<kvpn_proto::userd::StatusResponse> {
    let paths = userd::Paths::current(runtime_dir);
    match userd::connect_existing(&paths).await {
        Ok(None) => Answer::NotRunning,
        Err(e) => Answer::NotAnswering(output::error_chain(&e)),
        Ok(Some(mut c)) => match c.status(kvpn_proto::userd::StatusRequest {}).await {
            Ok(st) => Answer::Running(st.into_inner()),
            Err(s) => Answer::NotAnswering(output::error_chain(&daemon::status_to_error(s))),
        },
    }
}

/// The running root daemon's Status; none is started, and a stopped one is not
/// waited for.
async fn ask_root_daemon(runtime_dir: &Path) -> Answer<kvpn_proto::dataplane::StatusResponse> {
    let not_answering = || match liveness::probe(&daemon::pid_path(runtime_dir), None) {
        liveness::Liveness::NotAnswering { pid, state } => {
            Some(liveness::not_answering_text(pid, state))
        }
        liveness::Liveness::Gone => None,
    };
    if let liveness::Liveness::NotAnswering { pid, state } =
        liveness::probe(&daemon::pid_path(runtime_dir), None)
        && matches!(state, 'T' | 't')
    {
        return Answer::NotAnswering(liveness::not_answering_text(pid, state));
    }
    match daemon::connect_existing(runtime_dir).await {
        Ok(None) => not_answering().map_or(Answer::NotRunning, Answer::NotAnswering),
        Err(e) => Answer::NotAnswering(output::error_chain(&e)),
        Ok(Some(mut c)) => match c.status(kvpn_proto::dataplane::StatusRequest {}).await {
            Ok(st) => Answer::Running(st.into_inner()),
            Err(s) => Answer::NotAnswering(output::error_chain(&daemon::status_to_error(s))),
        },
    }
}

/// Every session with its origin, by id: the user daemon's view (both halves)
/// when it runs, else the root daemon's.
fn sessions_of(
    user: &Answer<kvpn_proto::userd::StatusResponse>,
    root: &Answer<kvpn_proto::dataplane::StatusResponse>,
) -> Vec<(String, Origin)> {
    let mut out: Vec<(String, Origin)> = Vec::new();
    let mut add = |id: &str, origin: Option<&Origin>| {
        if !out.iter().any(|(have, _)| have == id) {
            out.push((id.to_owned(), origin.cloned().unwrap_or_default()));
        }
    };
    match (user, root) {
        (Answer::Running(st), _) => {
            for s in &st.root_sessions {
                add(&s.id, s.origin.as_ref());
            }
            for s in &st.user_sessions {
                add(&s.id, s.origin.as_ref());
            }
        }
        (_, Answer::Running(st)) => {
            for s in &st.sessions {
                add(&s.id, s.origin.as_ref());
            }
        }
        _ => {}
    }
    out
}

fn read_pid(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli() -> Build {
        Build::new("0.2.0", "abc1234")
    }

    #[test]
    fn relation_orders_versions_then_commits() {
        let cli = cli();
        assert_eq!(
            relation(&Build::new("0.2.0", "abc1234"), &cli),
            Relation::Same
        );
        assert_eq!(
            relation(&Build::new("0.1.9", "abc1234"), &cli),
            Relation::Older
        );
        assert_eq!(
            relation(&Build::new("0.10.0", "0000000"), &cli),
            Relation::Newer
        );
        assert_eq!(
            relation(&Build::new("0.2.0", "def5678"), &cli),
            Relation::OtherBuild
        );
        // A commit nobody knows is no evidence of another build.
        assert_eq!(
            relation(&Build::new("0.2.0", "unknown"), &cli),
            Relation::Same
        );
        assert_eq!(relation(&Build::new("0.2.0", ""), &cli), Relation::Same);
        assert_eq!(relation(&Build::new("", ""), &cli), Relation::Unknown);
        assert_eq!(
            relation(&Build::new("nightly", "abc1234"), &cli),
            Relation::OtherBuild
        );
    }

    /// An older daemon is named with the fix, and how many sessions the fix
    /// ends; a matching one has no note; one that reports no version counts as
    /// older; a newer one is not told to make way silently.
    #[test]
    fn daemon_notes_name_the_fix() {
        let cli = cli();
        assert_eq!(daemon_note("user daemon", &cli, &cli, 3), None);
        let older =
            daemon_note("root daemon", &Build::new("0.1.0", "1111111"), &cli, 2).expect("a note");
        assert_eq!(
            older,
            "the root daemon is older than this CLI (0.2.0 at commit abc1234) — run `kvpn quit` \
             (it ends the 2 sessions: connect again after); the next kvpn command starts this \
             version's"
        );
        let silent = daemon_note("user daemon", &Build::default(), &cli, 1).expect("a note");
        assert!(silent.contains("it reports no version"), "{silent}");
        assert!(silent.contains("it ends the session"), "{silent}");
        let rebuilt =
            daemon_note("user daemon", &Build::new("0.2.0", "fff0000"), &cli, 0).expect("a note");
        assert!(rebuilt.contains("another build"), "{rebuilt}");
        assert!(rebuilt.contains("`kvpn quit`;"), "{rebuilt}");
        let newer = daemon_note("user daemon", &Build::new("0.3.0", ""), &cli, 0).expect("a note");
        assert!(newer.starts_with("newer than this CLI"), "{newer}");
        assert!(outdated(&Build::default(), &cli));
        assert!(outdated(&Build::new("0.1.0", ""), &cli));
        assert!(!outdated(&Build::new("0.3.0", ""), &cli));
        assert!(!outdated(&cli, &cli));
    }

    fn origin(transport: &str, version: &str, commit: &str) -> Origin {
        Origin {
            transport: transport.into(),
            cluster: "lab".into(),
            context: "kvpn-lab".into(),
            server: "https://172.31.255.1:6443".into(),
            manager_namespace: "kvpn-system".into(),
            manager_version: version.into(),
            manager_commit: commit.into(),
            ..Default::default()
        }
    }

    #[test]
    fn manager_rows_say_what_is_known_and_the_fix() {
        let cli = cli();
        let same = manager_version("s1", &origin("port-forward", "0.2.0", "abc1234"), &cli);
        assert_eq!(same.version.as_deref(), Some("0.2.0"));
        assert_eq!(same.commit.as_deref(), Some("abc1234"));
        assert_eq!(same.note, None);
        let old = manager_version("s2", &origin("port-forward", "0.1.0", ""), &cli);
        assert_eq!(old.commit, None);
        let note = old.note.expect("a note");
        assert!(note.contains("`kvpn disconnect s2`"), "{note}");
        let direct = manager_version("s3", &origin("direct", "", ""), &cli);
        assert_eq!(direct.version, None);
        assert!(
            direct.note.as_deref().is_some_and(|n| n.contains("direct")),
            "{direct:?}"
        );
        let unknown = manager_version("s4", &origin("port-forward", "", ""), &cli);
        assert!(
            unknown
                .note
                .as_deref()
                .is_some_and(|n| n.contains("older kvpn connected")),
            "{unknown:?}"
        );
    }

    fn report() -> Report {
        let cli = cli();
        Report {
            user_daemon: DaemonVersion::answered("user daemon", Some(41), &cli, &cli, 1),
            root_daemon: DaemonVersion::absent(DaemonState::NotRunning, None),
            managers: vec![manager_version(
                "kvpn-1",
                &origin("port-forward", "0.1.0", "1111111"),
                &cli,
            )],
            cli,
        }
    }

    #[test]
    fn table_lists_every_part_with_its_build_and_notes() {
        let text = table(&report());
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0].split_whitespace().collect::<Vec<_>>(),
            ["PART", "VERSION", "COMMIT", "STATE"]
        );
        assert_eq!(
            lines[1].split_whitespace().collect::<Vec<_>>(),
            ["kvpn", "(CLI)", "0.2.0", "abc1234"]
        );
        assert_eq!(
            lines[2].split_whitespace().collect::<Vec<_>>(),
            [
                "user", "daemon", "0.2.0", "abc1234", "running", "(pid", "41)"
            ]
        );
        assert_eq!(
            lines[3].split_whitespace().collect::<Vec<_>>(),
            ["root", "daemon", "-", "-", "not", "running"]
        );
        assert!(lines[4].starts_with("manager "), "{text}");
        assert!(lines[4].contains("0.1.0"), "{text}");
        assert!(
            lines[4]
                .contains("session kvpn-1: cluster lab (context kvpn-lab), namespace kvpn-system"),
            "{text}"
        );
        assert!(lines[5].starts_with("  ! older than this CLI"), "{text}");
        assert_eq!(lines.len(), 6, "{text}");
        // The columns line up: VERSION starts at the same place in every row.
        let col = lines[0].find("VERSION").expect("VERSION");
        for l in &lines[1..5] {
            assert_ne!(
                l.as_bytes()[col],
                b' ',
                "{l:?}: nothing at VERSION's column"
            );
            assert_eq!(
                l.as_bytes()[col - 1],
                b' ',
                "{l:?}: no gap before VERSION's column"
            );
        }
        let none = Report {
            managers: Vec::new(),
            ..report()
        };
        assert!(table(&none).ends_with("(no session: managers are listed while connected)\n"));
    }

    /// `-o json`: the document's fields and their types (docs/usage: `kvpn version`).
    #[test]
    fn json_document_has_every_part() {
        let v = serde_json::to_value(report()).expect("serialises");
        assert_eq!(v["cli"]["version"], "0.2.0");
        assert_eq!(v["cli"]["commit"], "abc1234");
        assert_eq!(v["user_daemon"]["state"], "running");
        assert_eq!(v["user_daemon"]["pid"], 41);
        assert_eq!(v["user_daemon"]["version"], "0.2.0");
        assert_eq!(v["user_daemon"]["note"], serde_json::Value::Null);
        assert_eq!(v["root_daemon"]["state"], "not_running");
        assert_eq!(v["root_daemon"]["version"], serde_json::Value::Null);
        assert_eq!(v["managers"][0]["session"], "kvpn-1");
        assert_eq!(v["managers"][0]["version"], "0.1.0");
        assert_eq!(v["managers"][0]["commit"], "1111111");
        assert_eq!(v["managers"][0]["namespace"], "kvpn-system");
        assert!(v["managers"][0]["note"].is_string());
    }

    #[test]
    fn replaced_daemons_say_what_ran_before() {
        assert_eq!(
            replaced_note(&Build::new("0.1.0", "1111111"), DaemonState::Restarted),
            "it ran 0.1.0 at commit 1111111 and held no session: restarted with this build"
        );
        assert!(
            replaced_note(&Build::default(), DaemonState::Stopped)
                .starts_with("it ran a build that reports no version and held no session: stopped")
        );
    }
}
