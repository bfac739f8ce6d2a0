//! Whether the root daemon, when it does not answer a call, is gone or only
//! not answering. A failed RPC says neither: a process stopped with SIGSTOP (or
//! by a debugger, or in a frozen cgroup) keeps its listening socket, so calls
//! to it time out ([`crate::daemon_channel`]'s keep-alive) exactly as they
//! would if it were hung. Only the process table tells: the pid in its pid file
//! no longer exists, is a zombie, or belongs to another process (its start
//! time or name differs) — then it is gone, and its sessions with it. Any other
//! silence is temporary: the user daemon keeps the sessions and says so.
//!
//! Pure core: [`ProcStat::parse`] and [`judge`]. I/O ([`probe`],
//! [`identity`]): the pid file and `/proc/PID/stat`, `/proc/PID/comm`.

use std::path::Path;

/// The name the root daemon's process has (`/proc/PID/comm`, at most 15 bytes).
pub const ROOT_DAEMON_COMM: &str = "kvpn-dataplane";

/// The fields of `/proc/PID/stat` (proc(5)) this module reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    /// Field 3: `R` running, `S` sleeping, `T` stopped, `t` traced, `Z` zombie, …
    pub state: char,
    /// Field 22: start time after boot, clock ticks. With the pid it names one
    /// process for the machine's uptime (pids are reused, start times are not).
    pub start_ticks: u64,
}

impl ProcStat {
    /// Parse the text of `/proc/PID/stat`. The command name (field 2) may hold
    /// spaces and parentheses, so the fields after it are found from its last `)`.
    pub fn parse(stat: &str) -> Option<Self> {
        let (_, rest) = stat.rsplit_once(") ")?;
        let mut fields = rest.split_ascii_whitespace();
        let state = fields.next()?.chars().next()?;
        // `rest` starts at field 3; field 22 is 19 further.
        let start_ticks = fields.nth(18)?.parse().ok()?;
        Some(ProcStat { state, start_ticks })
    }

    /// A zombie (`Z`) or dead (`X`) process runs no code and never will.
    pub fn dead(&self) -> bool {
        matches!(self.state, 'Z' | 'X')
    }

    /// Stopped by a signal (`T`) or by a tracer (`t`): it answers nothing until continued.
    pub fn stopped(&self) -> bool {
        matches!(self.state, 'T' | 't')
    }
}

/// `PF_EXITING` in the flags of `/proc/PID/stat` (field 9; include/linux/sched.h):
/// the process is in `exit(2)`'s teardown, which closes its files (the
/// daemon's listening socket among them) only after its memory and devices.
const PF_EXITING: u64 = 0x4;

/// SIGKILL's bit in the pending-signal masks of `/proc/PID/status` (bit
/// `n - 1` for signal `n`).
const SIGKILL_BIT: u64 = 1 << (libc::SIGKILL - 1);

/// Whether the process whose `/proc/PID/stat` is `stat` and `/proc/PID/status`
/// is `status` is on its way out (pure): a zombie or dead, in its exit
/// teardown (`PF_EXITING`), or with a SIGKILL queued (`SigPnd`, `ShdPnd`) that
/// its threads have not acted on yet. Right after `kill -9` all but the first
/// show while its listening socket still takes connects into its backlog,
/// which reset when the socket closes.
pub fn dying_from(stat: &str, status: &str) -> bool {
    if ProcStat::parse(stat).is_some_and(|s| s.dead()) {
        return true;
    }
    // Field 9 is the sixth after the state (field 3).
    let flags = stat
        .rsplit_once(") ")
        .and_then(|(_, rest)| rest.split_ascii_whitespace().nth(6))
        .and_then(|f| f.parse::<u64>().ok());
    if flags.is_some_and(|f| f & PF_EXITING != 0) {
        return true;
    }
    status.lines().any(|line| {
        let Some((key, mask)) = line.split_once(':') else {
            return false;
        };
        matches!(key, "SigPnd" | "ShdPnd")
            && u64::from_str_radix(mask.trim(), 16).is_ok_and(|m| m & SIGKILL_BIT != 0)
    })
}

/// [`dying_from`] of process `pid`, from /proc; `false` when there is no
/// such process.
pub fn dying(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    dying_from(&stat, &status)
}

/// One process: its pid and start time ([`ProcStat::start_ticks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    pub pid: i32,
    pub start_ticks: u64,
}

/// What the process table says about a daemon that did not answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// Its process is gone (no pid file, no such process, a zombie, or the pid
    /// is another process's now): what it held (TUN devices, routes) is gone.
    Gone,
    /// Its process exists but did not answer: stopped, hung or overloaded.
    /// `state` is the letter of `/proc/PID/stat`.
    NotAnswering { pid: i32, state: char },
}

impl Liveness {
    /// Whether /proc says the process is stopped (`kill -CONT` resumes it).
    pub fn stopped(&self) -> bool {
        matches!(
            self,
            Liveness::NotAnswering {
                state: 'T' | 't',
                ..
            }
        )
    }
}

/// Judge a root daemon that did not answer (pure). `pid`: its pid file's;
/// `stat`, `comm`: of that pid, `None` when there is no such process;
/// `known`: the process that last answered, if the caller saw one.
pub fn judge(
    pid: Option<i32>,
    stat: Option<ProcStat>,
    comm: Option<&str>,
    known: Option<Identity>,
) -> Liveness {
    let (Some(pid), Some(stat)) = (pid, stat) else {
        return Liveness::Gone;
    };
    if stat.dead() {
        return Liveness::Gone;
    }
    // The same pid started at another time: the daemon died and the pid was reused.
    if known.is_some_and(|k| k.pid == pid && k.start_ticks != stat.start_ticks) {
        return Liveness::Gone;
    }
    // A stale pid file whose pid another program has now.
    if comm.is_some_and(|c| c.trim_end() != ROOT_DAEMON_COMM) {
        return Liveness::Gone;
    }
    Liveness::NotAnswering {
        pid,
        state: stat.state,
    }
}

/// The pid in `pid_file`, if it holds one.
pub fn read_pid(pid_file: &Path) -> Option<i32> {
    std::fs::read_to_string(pid_file).ok()?.trim().parse().ok()
}

/// `/proc/PID/stat` of `pid`, `None` when there is no such process.
pub fn proc_stat(pid: i32) -> Option<ProcStat> {
    ProcStat::parse(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// The process `pid_file` names now, if it exists.
pub fn identity(pid_file: &Path) -> Option<Identity> {
    let pid = read_pid(pid_file)?;
    let stat = proc_stat(pid).filter(|s| !s.dead())?;
    Some(Identity {
        pid,
        start_ticks: stat.start_ticks,
    })
}

/// [`judge`] the root daemon whose pid file is `pid_file`, from /proc.
pub fn probe(pid_file: &Path, known: Option<Identity>) -> Liveness {
    let pid = read_pid(pid_file);
    let stat = pid.and_then(proc_stat);
    let comm = pid.and_then(|p| std::fs::read_to_string(format!("/proc/{p}/comm")).ok());
    judge(pid, stat, comm.as_deref(), known)
}

/// Why the root daemon does not answer and what resumes it, for status
/// reasons and warnings: "the root daemon (kvpn-dataplane, pid 42) is not
/// answering: the process is stopped (…) — resume it with `sudo kill -CONT 42`".
pub fn not_answering_text(pid: i32, state: char) -> String {
    format!(
        "the root daemon (kvpn-dataplane, pid {pid}) is not answering: {} — resume it with \
         `sudo kill -CONT {pid}`; its sessions stay and come back by themselves once it runs",
        crate::daemon_channel::process_cause(Some(state))
    )
}

/// Why a new connect cannot use the root daemon, judged from /proc before any
/// work (pure): a stopped process (`T`/`t`) keeps its socket, so the connect
/// would install, lease and port-forward and then time out on its first call.
/// `None` for a missing daemon (it gets started) or one that merely sleeps.
pub fn connect_refusal(l: Liveness) -> Option<String> {
    match l {
        Liveness::NotAnswering { pid, state } if l.stopped() => Some(format!(
            "the root daemon (kvpn-dataplane, pid {pid}) cannot take a new session: {} — \
             resume it with `sudo kill -CONT {pid}` and connect again",
            crate::daemon_channel::process_cause(Some(state))
        )),
        _ => None,
    }
}

/// [`connect_refusal`] for the root daemon whose pid file is `pid_file`.
pub fn check_before_connect(pid_file: &Path) -> Result<(), String> {
    connect_refusal(probe(pid_file, None)).map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(state: char, start: u64) -> String {
        // A real line's shape (proc(5)); the name holds ") " to test the split.
        format!(
            "4242 (kvpn-d) x) {state} 1 4242 4242 0 -1 4194560 1500 0 0 0 12 7 0 0 20 0 9 0 \
             {start} 123456789 2000 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0"
        )
    }

    #[test]
    fn stat_gives_state_and_start_time() {
        let s = ProcStat::parse(&stat('T', 987_654)).expect("parses");
        assert_eq!(
            s,
            ProcStat {
                state: 'T',
                start_ticks: 987_654
            }
        );
        assert!(s.stopped() && !s.dead());
        assert_eq!(ProcStat::parse("4242 (x) S 1 2"), None, "too short");
        assert_eq!(ProcStat::parse(""), None);
        assert_eq!(ProcStat::parse("garbage without parens"), None);
    }

    #[test]
    fn this_process_has_a_stat_we_can_read() {
        let s = proc_stat(std::process::id() as i32).expect("own stat");
        assert!(!s.dead() && !s.stopped(), "{s:?}");
        assert!(s.start_ticks > 0);
    }

    #[test]
    fn only_a_missing_dead_or_replaced_process_is_gone() {
        let live = |state| {
            Some(ProcStat {
                state,
                start_ticks: 100,
            })
        };
        let known = Some(Identity {
            pid: 7,
            start_ticks: 100,
        });
        let comm = Some("kvpn-dataplane\n");
        // Stopped, sleeping (hung), running (overloaded): not answering, not gone.
        for state in ['T', 't', 'S', 'R', 'D'] {
            assert_eq!(
                judge(Some(7), live(state), comm, known),
                Liveness::NotAnswering { pid: 7, state },
                "{state}"
            );
        }
        assert!(judge(Some(7), live('T'), comm, known).stopped());
        assert!(!judge(Some(7), live('S'), comm, known).stopped());
        // No pid file, no process, a zombie: gone.
        assert_eq!(judge(None, live('S'), comm, known), Liveness::Gone);
        assert_eq!(judge(Some(7), None, None, known), Liveness::Gone);
        assert_eq!(judge(Some(7), live('Z'), comm, known), Liveness::Gone);
        // The same pid, started later: another process.
        let reused = Some(ProcStat {
            state: 'S',
            start_ticks: 555,
        });
        assert_eq!(judge(Some(7), reused, comm, known), Liveness::Gone);
        // A stale pid file whose pid is another program's (no known identity).
        assert_eq!(
            judge(Some(7), live('S'), Some("bash\n"), None),
            Liveness::Gone
        );
        // A new root daemon (another pid) that does not answer yet: not gone.
        assert_eq!(
            judge(Some(8), live('S'), comm, known),
            Liveness::NotAnswering { pid: 8, state: 'S' }
        );
    }

    /// A stopped root daemon refuses a new connect at once, naming the pid and
    /// the fix; a missing or sleeping one does not (on main connect had no
    /// such check: it did all its work, then timed out after 6 s).
    #[test]
    fn connect_refuses_only_a_stopped_root_daemon() {
        for state in ['T', 't'] {
            let t = connect_refusal(Liveness::NotAnswering { pid: 4242, state })
                .unwrap_or_else(|| panic!("state {state} not refused"));
            assert!(t.contains("pid 4242") && t.contains("stopped"), "{t}");
            assert!(t.contains("`sudo kill -CONT 4242`"), "{t}");
        }
        for l in [
            Liveness::Gone,
            Liveness::NotAnswering { pid: 7, state: 'S' },
            Liveness::NotAnswering { pid: 7, state: 'R' },
        ] {
            assert_eq!(connect_refusal(l), None, "{l:?}");
        }
        // A pid file naming this (running, not kvpn-dataplane) process: no refusal.
        let dir = std::env::temp_dir().join(format!("kvpn-liveness-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let pid_file = dir.join("dataplane.pid");
        std::fs::write(&pid_file, std::process::id().to_string()).expect("pid file");
        let result = check_before_connect(&pid_file);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(result, Ok(()));
    }

    /// Right after `kill -9`, /proc shows a running process with SIGKILL
    /// pending, then one in its exit teardown (`PF_EXITING`), then a zombie
    /// (the sequence seen on this kernel): each is dying; a running or
    /// stopped process with other signals pending is not.
    #[test]
    fn a_killed_process_is_dying_before_it_is_a_zombie() {
        let with_flags = |state, flags: u64| {
            format!(
                "4242 (kvpn-d) x) {state} 1 4242 4242 0 -1 {flags} 1500 0 0 0 12 7 0 0 20 0 9 0 \
                 100 123456789 2000 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0"
            )
        };
        let pending = |sig: &str, shd: &str| {
            format!("Name:\tkvpn-dataplane\nState:\tR (running)\nSigPnd:\t{sig}\nShdPnd:\t{shd}\n")
        };
        let none = pending("0000000000000000", "0000000000000000");
        let kill = "0000000000000100";
        assert!(!dying_from(&with_flags('S', 0x40_0040), &none));
        assert!(!dying_from(&with_flags('T', 0x40_0040), &none));
        // SIGTERM (bit 14) and SIGSTOP (bit 18) pending: not dying.
        assert!(!dying_from(
            &with_flags('S', 0x40_0040),
            &pending("0000000000004000", "0000000000020000")
        ));
        assert!(dying_from(
            &with_flags('R', 0x40_0040),
            &pending(kill, kill)
        ));
        assert!(dying_from(
            &with_flags('R', 0x40_0040),
            &pending("0000000000000000", kill)
        ));
        assert!(dying_from(&with_flags('R', 0x40_044c), &none));
        assert!(dying_from(&with_flags('Z', 0x40_844c), &none));
        assert!(dying_from(&with_flags('X', 0), ""));
        assert!(!dying_from("garbage", "garbage"));
        assert!(!dying(std::process::id() as i32));
    }

    #[test]
    fn the_text_names_pid_cause_and_fix() {
        let t = not_answering_text(42, 'T');
        assert!(t.contains("pid 42") && t.contains("stopped"), "{t}");
        assert!(t.contains("`sudo kill -CONT 42`"), "{t}");
    }
}
