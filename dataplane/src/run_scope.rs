//! The laptop half of a process-scoped session (`kvpn run -- CMD`, issue 27): what
//! lets one process tree, and only it, reach a cluster, without a laptop-wide route
//! or resolv.conf change, so that two sessions to clusters with the same pod and
//! service CIDRs can run side by side.
//!
//! Per run session (slot `n`, the lowest free one of this daemon):
//! - routing table [`RUN_TABLE_BASE`]` + n` holds the session's cluster routes
//!   through its TUN device with the tunnel IP as source (the session itself
//!   installs them there, [`crate::netlink::Netlink::in_table`]);
//! - the IPv4 policy rule `fwmark `[`RUN_MARK_BASE`]`+n lookup <table>` at priority
//!   [`RUN_RULE_PRIORITY`] (before main): a destination the table has no route for
//!   falls through to the laptop's usual tables;
//! - a cgroup v2 folder `kvpn-run-<session id>` whose sockets get that mark and
//!   whose port-53 traffic goes to the session's own DNS forwarder on
//!   `127.0.154.<n+1>:53` (eBPF, `kvpn_ebpf::run_scope`); the forwarder's own sockets
//!   carry the mark, so cluster names reach the cluster DNS through the session's
//!   table, and other names the laptop's nameservers; it takes only packets that
//!   carry the mark (a socket filter), so no process outside the run can use it,
//!   and [`ask_forwarder`] asks it for the route watch's `--extra-domain` names;
//! - rp_filter 0 on the TUN device: replies come from cluster addresses that no
//!   unmarked lookup routes into that device. The effective value is the larger of
//!   `all` and the device's, so with `net.ipv4.conf.all.rp_filter=1` (strict) the
//!   check still runs: the TUN's ingress check marks each reply with the run's
//!   fwmark and the device has `src_valid_mark`, so the reverse lookup goes through
//!   the run's rule to its table, which routes the source into this device.
//!
//! Teardown stops whatever is still in the cgroup: SIGTERM to each process, up to
//! [`TERM_GRACE`] for them to exit (as `docker stop` gives a container), then
//! `cgroup.kill`; it waits for the cgroup to empty, removes it, and removes the rule
//! and the forwarder.
//!
//! I/O: the cgroup filesystem, /proc, rtnetlink (rules), bpf(2) and sockets.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvpn_ebpf::run_scope::RunPrograms;

use crate::dns::forwarder::Forwarder;
use crate::netlink::Netlink;

/// First routing table of run sessions ("kv" in ASCII, then the slot).
pub const RUN_TABLE_BASE: u32 = 0x6b76_0000;
/// First fwmark of run sessions (same scheme as the table).
pub const RUN_MARK_BASE: u32 = 0x6b76_0000;
/// Priority of the run sessions' rules: after the local table (0), before main
/// (32766) and default (32767).
pub const RUN_RULE_PRIORITY: u32 = 9000;
/// Run sessions one daemon serves at once.
pub const MAX_RUN_SESSIONS: u16 = 250;
/// Where the cgroup v2 hierarchy is unless `KVPN_CGROUP_ROOT` says otherwise:
/// the first of these that is a cgroup2 mount (its root has `cgroup.procs` and
/// `cgroup.controllers`). Hybrid machines (this one) mount it at `unified`.
const CGROUP_ROOTS: [&str; 2] = ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"];

/// The cgroup2 mount this daemon made itself ([`cgroup_root`]), if any.
static OWN_MOUNT: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);

/// Mount the cgroup v2 hierarchy (there is only one per machine, so this is the
/// same tree a mount elsewhere shows) at a folder of this daemon's own, for a
/// daemon that sees none: `ip netns exec` puts a fresh sysfs on /sys, without the
/// cgroup mounts below it. [`release_own_mount`] undoes it at exit.
fn mount_own() -> Result<PathBuf, String> {
    let mut own = OWN_MOUNT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(p) = own.as_ref() {
        return Ok(p.clone());
    }
    let dir = std::env::temp_dir().join(format!("kvpn-cgroup2-{}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .map_err(|e| format!("cannot create {} to mount cgroup2 on: {e}", dir.display()))?;
    nix::mount::mount(
        Some("cgroup2"),
        &dir,
        Some("cgroup2"),
        nix::mount::MsFlags::MS_NOSUID
            | nix::mount::MsFlags::MS_NODEV
            | nix::mount::MsFlags::MS_NOEXEC,
        None::<&str>,
    )
    .map_err(|e| {
        let _ = std::fs::remove_dir(&dir);
        format!(
            "no cgroup v2 hierarchy at /sys/fs/cgroup or /sys/fs/cgroup/unified, and mounting \
             one at {} failed: {e} — mount it (`mount -t cgroup2 none /sys/fs/cgroup/unified`) \
             or set KVPN_CGROUP_ROOT",
            dir.display()
        )
    })?;
    tracing::info!(path = %dir.display(), "mounted the cgroup v2 hierarchy for run sessions (none visible in this mount namespace)");
    *own = Some(dir.clone());
    Ok(dir)
}

/// Unmount and remove what [`mount_own`] made (daemon exit).
pub fn release_own_mount() {
    let taken = OWN_MOUNT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take();
    if let Some(dir) = taken {
        if let Err(e) = nix::mount::umount2(&dir, nix::mount::MntFlags::MNT_DETACH) {
            tracing::warn!(path = %dir.display(), error = %e, "cannot unmount the run sessions' cgroup2 mount");
        }
        let _ = std::fs::remove_dir(&dir);
    }
}
/// How long teardown waits for killed processes to leave the cgroup.
const KILL_WAIT: Duration = Duration::from_secs(3);

/// How long the processes of a run get after SIGTERM before `cgroup.kill`: a
/// command whose session is disconnected from outside may clean up (the user
/// daemon's hold on the run says why on kvpn run's stderr).
pub const TERM_GRACE: Duration = Duration::from_secs(2);

/// The routing table, fwmark and DNS forwarder address of run slot `slot`.
pub fn slot_params(slot: u16) -> (u32, u32, SocketAddrV4) {
    let dns_last = u8::try_from(slot + 1).unwrap_or(u8::MAX);
    (
        RUN_TABLE_BASE + u32::from(slot),
        RUN_MARK_BASE + u32::from(slot),
        SocketAddrV4::new(Ipv4Addr::new(127, 0, 154, dns_last), 53),
    )
}

/// The largest DNS question [`ask_forwarder`] takes (RFC 1035's UDP size).
pub const MAX_RUN_DNS_QUERY: usize = 512;

/// How long [`ask_forwarder`] waits for the answer: the forwarder's own
/// exchange with the cluster DNS is bounded by a few seconds, and the route
/// watch asking it waits 2 s per try.
const RUN_DNS_TIMEOUT: Duration = Duration::from_secs(3);

/// Ask a run's DNS forwarder at `dns` one question `query` from a UDP socket
/// with the run's fwmark `mark`, as the run's processes do (its socket filter
/// takes only packets with that mark); the answer's bytes.
pub async fn ask_forwarder(dns: SocketAddrV4, mark: u32, query: &[u8]) -> std::io::Result<Vec<u8>> {
    let socket = tokio::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).await?;
    nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::Mark, &mark)
        .map_err(std::io::Error::from)?;
    socket.connect(dns).await?;
    socket.send(query).await?;
    let mut buf = vec![0u8; 65535];
    let n = tokio::time::timeout(RUN_DNS_TIMEOUT, socket.recv(&mut buf))
        .await
        .map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer within {} s", RUN_DNS_TIMEOUT.as_secs()),
            )
        })??;
    buf.truncate(n);
    Ok(buf)
}

/// The lowest slot not in `used` (pure).
pub fn free_slot(used: &[u16]) -> Option<u16> {
    (0..MAX_RUN_SESSIONS).find(|s| !used.contains(s))
}

/// The cgroup v2 root to make run folders in.
pub fn cgroup_root() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("KVPN_CGROUP_ROOT").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    match CGROUP_ROOTS
        .iter()
        .map(PathBuf::from)
        .find(|p| p.join("cgroup.controllers").exists() && p.join("cgroup.procs").exists())
    {
        Some(p) => Ok(p),
        None => mount_own(),
    }
}

/// The uids of `pid` (real, effective) from /proc.
pub fn pid_uids(pid: u32) -> Result<(u32, u32), String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("no process {pid}: {e}"))?;
    parse_uids(&status).ok_or_else(|| format!("cannot read the uids of process {pid}"))
}

/// Real and effective uid from a /proc/PID/status text (pure).
pub fn parse_uids(status: &str) -> Option<(u32, u32)> {
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    let mut ids = line["Uid:".len()..].split_whitespace();
    let real = ids.next()?.parse().ok()?;
    let effective = ids.next()?.parse().ok()?;
    Some((real, effective))
}

/// Whether a caller of uid `caller_uid` may use the run of `session` that
/// uid `owner_uid` connected (`what`: the call, for the message): root and the
/// owner may, nobody else (pure). The root daemon also serves one non-root uid
/// besides root, so a run a root `kvpn run` made is not that user's to ask
/// or join.
pub fn check_owner(
    session: &str,
    owner_uid: u32,
    caller_uid: u32,
    what: &str,
) -> Result<(), String> {
    if caller_uid == 0 || caller_uid == owner_uid {
        return Ok(());
    }
    Err(format!(
        "{what} refused: run session {session} belongs to uid {owner_uid}, not to the caller \
         (uid {caller_uid}) — only the user who started `kvpn run` (or root) may use its \
         forwarder and cgroup; start a `kvpn run` of your own"
    ))
}

/// A run session's cgroup, eBPF programs, rule and DNS forwarder.
#[derive(Debug)]
pub struct RunScope {
    pub slot: u16,
    /// The uid that connected the run (the caller of Connect): only it and
    /// root may ask its forwarder or move processes into it ([`check_owner`]).
    pub owner_uid: u32,
    pub table: u32,
    pub mark: u32,
    pub dns: SocketAddrV4,
    cgroup: PathBuf,
    programs: Option<RunPrograms>,
    forwarder: Option<Forwarder>,
    rule: bool,
    /// A process was admitted: from then on an empty cgroup means the command
    /// and all it started are gone ([`RunScope::abandoned`]).
    admitted: std::sync::atomic::AtomicBool,
    /// Since when the cgroup was seen empty after an admission.
    empty_since: std::sync::Mutex<Option<Instant>>,
    /// The user's include and exclude suffixes (`--include-suffix` with the
    /// `--extra-domain` names, `--exclude-suffix`) the session was connected
    /// with: a later update of the cluster's DNS settings (the route watch
    /// sends none) keeps them.
    suffixes: std::sync::Mutex<Suffixes>,
}

/// Include and exclude suffixes of a run's forwarder.
pub type Suffixes = (Vec<String>, Vec<String>);

impl RunScope {
    /// Make the cgroup, start the forwarder (upstreams: the laptop's
    /// nameservers), attach the programs and add the rule. On an error what was
    /// made is removed again and the error names the step.
    pub async fn setup(
        id: &str,
        slot: u16,
        owner_uid: u32,
        netlink: &Netlink,
        upstreams: Vec<SocketAddr>,
    ) -> Result<RunScope, String> {
        let (table, mark, dns) = slot_params(slot);
        let cgroup = cgroup_root()?.join(format!("kvpn-run-{id}"));
        std::fs::create_dir(&cgroup)
            .map_err(|e| format!("cannot create the run's cgroup {}: {e}", cgroup.display()))?;
        let mut scope = RunScope {
            slot,
            owner_uid,
            table,
            mark,
            dns,
            cgroup,
            programs: None,
            forwarder: None,
            rule: false,
            admitted: std::sync::atomic::AtomicBool::new(false),
            empty_since: std::sync::Mutex::new(None),
            suffixes: std::sync::Mutex::new(Suffixes::default()),
        };
        if let Err(e) = scope.setup_parts(netlink, upstreams).await {
            let leftovers = scope.teardown(netlink).await;
            return Err(if leftovers.is_empty() {
                e
            } else {
                format!("{e} (cleanup left: {})", leftovers.join("; "))
            });
        }
        Ok(scope)
    }

    async fn setup_parts(
        &mut self,
        netlink: &Netlink,
        upstreams: Vec<SocketAddr>,
    ) -> Result<(), String> {
        self.forwarder = Some(
            Forwarder::start_marked(SocketAddr::V4(self.dns), upstreams, Some(self.mark))
                .await
                .map_err(|e| format!("run DNS forwarder: {e}"))?,
        );
        let dir = std::fs::File::open(&self.cgroup)
            .map_err(|e| format!("cannot open cgroup {}: {e}", self.cgroup.display()))?;
        self.programs = Some(RunPrograms::attach(&dir, self.mark, self.dns).map_err(|e| {
            format!(
                "cannot attach the run's eBPF programs to {}: {}",
                self.cgroup.display(),
                crate::session::error_chain(&e)
            )
        })?);
        netlink
            .add_mark_rule(self.mark, self.table, RUN_RULE_PRIORITY)
            .await
            .map_err(|e| e.to_string())?;
        self.rule = true;
        Ok(())
    }

    /// The forwarder of this run (cluster names: [`Forwarder::set_clusters`]).
    pub fn forwarder(&self) -> Option<&Forwarder> {
        self.forwarder.as_ref()
    }

    /// The include and exclude suffixes the session was connected with.
    pub fn suffixes(&self) -> Suffixes {
        self.suffixes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Remember the suffixes of the cluster DNS settings given to the forwarder.
    pub fn set_suffixes(&self, suffixes: Suffixes) {
        *self
            .suffixes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = suffixes;
    }

    /// The cgroup folder.
    pub fn cgroup(&self) -> &Path {
        &self.cgroup
    }

    /// Move `pid` into the cgroup, for a caller of uid `caller_uid` (root may move
    /// any process, others only their own).
    pub fn admit(&self, pid: u32, caller_uid: u32) -> Result<(), String> {
        let (real, effective) = pid_uids(pid)?;
        if caller_uid != 0 && (real != caller_uid || effective != caller_uid) {
            return Err(format!(
                "process {pid} belongs to uid {real}, not to the caller (uid {caller_uid})"
            ));
        }
        std::fs::write(self.cgroup.join("cgroup.procs"), pid.to_string()).map_err(|e| {
            format!(
                "cannot move process {pid} into {}: {e}",
                self.cgroup.display()
            )
        })?;
        self.admitted
            .store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Whether the run's command and everything it started have been gone for
    /// `grace` without anyone ending the session: kvpn run disconnects as its
    /// command ends, so only a kvpn run that died with its user daemon leaves
    /// such a session. Call periodically; the first empty sight starts the clock.
    pub fn abandoned(&self, grace: Duration) -> bool {
        if !self.admitted.load(std::sync::atomic::Ordering::Relaxed) {
            return false;
        }
        let mut since = self
            .empty_since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.populated() != Some(false) {
            *since = None;
            return false;
        }
        since.get_or_insert_with(Instant::now).elapsed() >= grace
    }

    /// Whether any process is in the cgroup (`populated 1` in cgroup.events);
    /// `None` when that cannot be read.
    pub fn populated(&self) -> Option<bool> {
        let events = std::fs::read_to_string(self.cgroup.join("cgroup.events")).ok()?;
        events
            .lines()
            .find_map(|l| l.strip_prefix("populated "))
            .map(|v| v.trim() == "1")
    }

    /// SIGTERM to every process in the cgroup, then up to [`TERM_GRACE`] for the
    /// cgroup to empty. Pids are read from `cgroup.procs` at the moment of the
    /// signal: a process the cgroup no longer holds is not there to be named.
    async fn terminate(&self) {
        let procs = std::fs::read_to_string(self.cgroup.join("cgroup.procs")).unwrap_or_default();
        for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        let deadline = Instant::now() + TERM_GRACE;
        while self.populated() == Some(true) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Kill what is left in the cgroup and remove it, the programs, the
    /// forwarder and the rule; what could not be removed.
    pub async fn teardown(mut self, netlink: &Netlink) -> Vec<String> {
        let mut leftovers = Vec::new();
        if self.cgroup.exists() {
            if self.populated() == Some(true) {
                self.terminate().await;
            }
            if self.populated() == Some(true) {
                if let Err(e) = std::fs::write(self.cgroup.join("cgroup.kill"), "1") {
                    tracing::warn!(cgroup = %self.cgroup.display(), error = %e, "cannot kill the run's processes");
                }
                let deadline = Instant::now() + KILL_WAIT;
                while self.populated() == Some(true) && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            if let Err(e) = std::fs::remove_dir(&self.cgroup) {
                leftovers.push(format!("cgroup {}: {e}", self.cgroup.display()));
            }
        }
        drop(self.programs.take());
        if let Some(f) = self.forwarder.take() {
            f.stop().await;
        }
        if self.rule {
            if let Err(e) = netlink
                .del_mark_rule(self.mark, self.table, RUN_RULE_PRIORITY)
                .await
            {
                leftovers.push(e.to_string());
            }
            match netlink.mark_rule_exists(self.mark).await {
                Ok(true) => leftovers.push(format!("rule fwmark {:#x} still there", self.mark)),
                Ok(false) => {}
                Err(e) => leftovers.push(format!("cannot list rules: {e}")),
            }
        }
        leftovers
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_the_lowest_free_and_give_distinct_tables_marks_and_dns() {
        assert_eq!(free_slot(&[]), Some(0));
        assert_eq!(free_slot(&[0, 1, 3]), Some(2));
        let all: Vec<u16> = (0..MAX_RUN_SESSIONS).collect();
        assert_eq!(free_slot(&all), None);
        let (t0, m0, d0) = slot_params(0);
        let (t1, m1, d1) = slot_params(1);
        assert_ne!(t0, t1);
        assert_ne!(m0, m1);
        assert_eq!(d0.to_string(), "127.0.154.1:53");
        assert_eq!(d1.to_string(), "127.0.154.2:53");
        let (_, _, last) = slot_params(MAX_RUN_SESSIONS - 1);
        assert_eq!(last.ip().octets()[3], 250);
    }

    /// R1: another uid may neither ask a run's forwarder nor join its cgroup;
    /// root and the owner may.
    #[test]
    fn only_root_and_the_owner_may_use_a_run() {
        assert_eq!(check_owner("s1", 1000, 1000, "RunDnsQuery"), Ok(()));
        assert_eq!(check_owner("s1", 1000, 0, "RunDnsQuery"), Ok(()));
        assert_eq!(check_owner("s1", 0, 0, "AdmitToRun"), Ok(()));
        let err = check_owner("s1", 0, 1000, "RunDnsQuery").expect_err("uid 1000 asks root's run");
        assert!(
            err.contains("RunDnsQuery refused")
                && err.contains("run session s1 belongs to uid 0")
                && err.contains("(uid 1000)")
                && err.contains("start a `kvpn run` of your own"),
            "{err}"
        );
        assert!(check_owner("s1", 1000, 1001, "AdmitToRun").is_err());
    }

    #[test]
    fn uids_come_from_the_status_uid_line() {
        let status = "Name:\tsleep\nUid:\t1000\t1001\t1000\t1000\nGid:\t0\t0\t0\t0\n";
        assert_eq!(parse_uids(status), Some((1000, 1001)));
        assert_eq!(parse_uids("Name:\tx\n"), None);
    }
}
