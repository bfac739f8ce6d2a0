//! `kvpn connect` as a normal user (issue #6): the CLI starts the root daemon
//! through `sudo -n`, allowing the user's uid on its socket, and connects to it;
//! after a SIGKILL of the root daemon the next connect recovers by itself
//! (case lc-01); without sudo rights and without a root daemon it fails at once
//! with what it tried and the fixes, leaving nothing behind.
//!
//! Everything is real: a throwaway user (`useradd`, removed on drop), a sudoers
//! drop-in granting that user NOPASSWD for the kvpn-dataplane binary only
//! (removed on drop), the CLI run through `setpriv` with the user's own HOME and
//! XDG folders, the Kubernetes lab, curl to a Service.

use std::net::SocketAddr;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use kvpn_tests::kube_lab::{KubeFixture, retry_until, web};
use kvpn_tests::text;

fn unique_id() -> String {
    use std::hash::{BuildHasher as _, Hasher as _};
    let mut h = std::hash::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    format!("{:06x}", h.finish() & 0xff_ffff)
}

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}): {}{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// A throwaway unprivileged user `kvpn-t-<id>` with its own HOME, runtime,
/// state and config folders and copies of the binaries it runs. Drop stops
/// what runs as that user (kvpn quit, then SIGKILL by pid) and removes the
/// user, its group and its folders, also when the test failed.
struct NormalUser {
    name: String,
    uid: u32,
    gid: u32,
    /// Root-owned 0755 folder: `home/` (the user's), `bin/` (kvpn, kvpn-dataplane).
    base: PathBuf,
    /// The root daemon's runtime folder the user's kvpn is pointed at.
    runtime_dir: PathBuf,
    /// The laptop netns the user's kvpn runs in.
    netns: String,
}

impl NormalUser {
    fn new(id: &str, runtime_dir: &Path, netns: &str) -> Self {
        let name = format!("kvpn-t-{id}");
        run_ok(Command::new("useradd").args(["-M", "-U", "-s", "/usr/sbin/nologin", &name]));
        let uid = run_ok(Command::new("id").args(["-u", &name]))
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("uid of {name}: {e}"));
        let gid = run_ok(Command::new("id").args(["-g", &name]))
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("gid of {name}: {e}"));
        let base = std::env::temp_dir().join(format!("kvpn-t-{id}"));
        let user = NormalUser {
            name,
            uid,
            gid,
            base,
            runtime_dir: runtime_dir.to_path_buf(),
            netns: netns.to_owned(),
        };
        for (dir, mode) in [(&user.base, 0o755), (&user.bin_dir(), 0o755)] {
            std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
                .unwrap_or_else(|e| panic!("chmod {}: {e}", dir.display()));
        }
        // Copies in a folder every user can reach (the build's target folder may not be).
        for b in ["kvpn", "kvpn-dataplane"] {
            let from = kvpn_lab::bin_path(b).unwrap_or_else(|e| panic!("{b} binary: {e:#}"));
            std::fs::copy(&from, user.bin_dir().join(b))
                .unwrap_or_else(|e| panic!("copy {}: {e}", from.display()));
        }
        for d in ["", "run", "state", "config", "tmp"] {
            let dir = user.home().join(d);
            std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid))
                .unwrap_or_else(|e| panic!("chown {}: {e}", dir.display()));
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
                .unwrap_or_else(|e| panic!("chmod {}: {e}", dir.display()));
        }
        user
    }

    fn home(&self) -> PathBuf {
        self.base.join("home")
    }

    fn bin_dir(&self) -> PathBuf {
        self.base.join("bin")
    }

    fn dataplane_bin(&self) -> PathBuf {
        self.bin_dir().join("kvpn-dataplane")
    }

    /// `program args` as this user in the laptop netns, with a clean
    /// environment: the user's HOME and XDG folders, `KVPN_RUNTIME_DIR`.
    fn command(&self, program: &Path, args: &[&str]) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.netns, "setpriv"])
            .arg(format!("--reuid={}", self.uid))
            .arg(format!("--regid={}", self.gid))
            .arg("--init-groups")
            .args(["env", "-i", "PATH=/usr/local/bin:/usr/bin:/bin"])
            .arg(format!("HOME={}", self.home().display()))
            .arg(format!("USER={}", self.name))
            .arg(format!(
                "XDG_RUNTIME_DIR={}",
                self.home().join("run").display()
            ))
            .arg(format!(
                "XDG_STATE_HOME={}",
                self.home().join("state").display()
            ))
            .arg(format!(
                "XDG_CONFIG_HOME={}",
                self.home().join("config").display()
            ))
            .arg(format!("TMPDIR={}", self.home().join("tmp").display()))
            .arg(format!("KVPN_RUNTIME_DIR={}", self.runtime_dir.display()))
            .arg(program)
            .args(args)
            .current_dir(&self.base);
        cmd
    }

    fn kvpn(&self, args: &[&str]) -> Output {
        self.command(&self.bin_dir().join("kvpn"), args)
            .output()
            .unwrap_or_else(|e| panic!("kvpn {args:?} as {}: {e}", self.name))
    }

    fn kvpn_ok(&self, args: &[&str], diagnostics: impl Fn() -> String) -> String {
        let out = self.kvpn(args);
        assert!(
            out.status.success(),
            "kvpn {args:?} as {} failed ({}):\n{}\n{}\n{}",
            self.name,
            out.status,
            text(&out.stdout),
            text(&out.stderr),
            diagnostics()
        );
        text(&out.stdout)
    }

    /// The user's copy of `kubeconfig`, with the certificate and key files it
    /// names copied next to it (the lab's are root's alone).
    fn own_kubeconfig(&self, kubeconfig: &Path) -> PathBuf {
        let dir = self.home().join("kube");
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let original = std::fs::read_to_string(kubeconfig)
            .unwrap_or_else(|e| panic!("{}: {e}", kubeconfig.display()));
        let mut copied = Vec::new();
        let mut out = String::new();
        for line in original.lines() {
            let trimmed = line.trim_start();
            let key = [
                "certificate-authority:",
                "client-certificate:",
                "client-key:",
            ]
            .into_iter()
            .find(|k| trimmed.starts_with(k));
            let Some(key) = key else {
                out.push_str(line);
                out.push('\n');
                continue;
            };
            let value = trimmed[key.len()..].trim().trim_matches('"');
            let from = PathBuf::from(value);
            let to = dir.join(
                from.file_name()
                    .unwrap_or_else(|| panic!("no file name in {line:?}")),
            );
            std::fs::copy(&from, &to).unwrap_or_else(|e| panic!("copy {}: {e}", from.display()));
            copied.push(to.clone());
            let indent = &line[..line.len() - trimmed.len()];
            out.push_str(&format!("{indent}{key} \"{}\"\n", to.display()));
        }
        assert_eq!(
            copied.len(),
            3,
            "kubeconfig names CA, cert and key: {original}"
        );
        let path = dir.join("config");
        std::fs::write(&path, out).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for p in copied.iter().chain([&path, &dir]) {
            std::os::unix::fs::chown(p, Some(self.uid), Some(self.gid))
                .unwrap_or_else(|e| panic!("chown {}: {e}", p.display()));
        }
        path
    }

    /// Pids of running processes whose real uid is this user's.
    fn pids(&self) -> Vec<u32> {
        pids_where(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|u| u.split_whitespace().next()?.parse::<u32>().ok())
                == Some(self.uid)
        })
    }
}

impl Drop for NormalUser {
    fn drop(&mut self) {
        let quit = self.kvpn(&["quit"]);
        if !quit.status.success() {
            eprintln!("kvpn quit as {}: {}", self.name, text(&quit.stderr));
        }
        for pid in self.pids() {
            // SAFETY: a process running as this test's throwaway user: one this test started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        let t0 = Instant::now();
        while !self.pids().is_empty() && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let del = Command::new("userdel").arg(&self.name).output();
        if !del.as_ref().is_ok_and(|o| o.status.success()) {
            eprintln!("userdel {}: {del:?}", self.name);
        }
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

/// A [`NormalUser`] whose sudo rule outlives its drop (struct fields drop in
/// declaration order).
struct UserWithRule {
    user: NormalUser,
    _sudo: SudoRule,
}

impl std::ops::Deref for UserWithRule {
    type Target = NormalUser;
    fn deref(&self) -> &NormalUser {
        &self.user
    }
}

/// `/etc/sudoers.d/kvpn-test-<id>`: `user` may run `program` (only it) as
/// root without a password. Removed on drop.
struct SudoRule(PathBuf);

impl SudoRule {
    fn new(id: &str, user: &str, program: &Path) -> Self {
        let path = PathBuf::from(format!("/etc/sudoers.d/kvpn-test-{id}"));
        let rule = format!("{user} ALL=(root) NOPASSWD: {}\n", program.display());
        // Written aside and checked by visudo first: a broken drop-in breaks sudo.
        let staged = std::env::temp_dir().join(format!("kvpn-test-sudoers-{id}"));
        std::fs::write(&staged, &rule).unwrap_or_else(|e| panic!("{}: {e}", staged.display()));
        let check = Command::new("visudo").arg("-cf").arg(&staged).output();
        let ok = check.as_ref().is_ok_and(|o| o.status.success());
        if !ok {
            let _ = std::fs::remove_file(&staged);
            panic!("visudo rejects {rule:?}: {check:?}");
        }
        std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o440))
            .unwrap_or_else(|e| panic!("chmod {}: {e}", staged.display()));
        std::fs::rename(&staged, &path).unwrap_or_else(|e| {
            let _ = std::fs::remove_file(&staged);
            panic!("install {}: {e}", path.display())
        });
        SudoRule(path)
    }
}

impl Drop for SudoRule {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.0) {
            eprintln!("remove {}: {e}", self.0.display());
        }
    }
}

/// Pids whose /proc/<pid>/status satisfies `pred`.
fn pids_where(pred: impl Fn(&str) -> bool) -> Vec<u32> {
    let mut pids: Vec<u32> = std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter(|pid| {
                    std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| {
                        !s.lines().any(|l| {
                            l.starts_with("State:") && (l.contains("zombie") || l.contains("dead"))
                        }) && pred(&s)
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    pids.sort_unstable();
    pids
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(") ")
            .is_some_and(|(_, r)| !r.starts_with('Z') && !r.starts_with('X'))
    })
}

/// The real, effective, saved and file-system uids of `pid`.
fn uids(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .map(|u| {
            u.split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn cmdline(pid: u32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap_or_default()
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

/// The root daemon's pid from its pid file.
fn root_daemon_pid(runtime_dir: &Path) -> u32 {
    let file = runtime_dir.join("dataplane.pid");
    std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
}

fn mode_and_owner(path: &Path) -> (u32, u32) {
    let m = std::fs::metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (m.permissions().mode() & 0o7777, m.uid())
}

/// `curl` as the user in the laptop netns: the HTTP code of GET `target`.
fn curl_as(user: &NormalUser, target: SocketAddr) -> String {
    let out = user
        .command(
            Path::new("/usr/bin/curl"),
            &[
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--max-time",
                "3",
                &format!("http://{target}/"),
            ],
        )
        .output()
        .unwrap_or_else(|e| panic!("curl: {e}"));
    text(&out.stdout)
}

fn wait_curl_ok(user: &NormalUser, target: SocketAddr, f: &KubeFixture) {
    retry_until(
        &format!("HTTP 200 from curl http://{target}/ as {}", user.name),
        Duration::from_secs(20),
        Duration::from_millis(200),
        || match curl_as(user, target) {
            code if code == "200" => Ok(()),
            code => Err(format!("got {code:?}")),
        },
        || f.diagnostics(),
    );
}

/// The user's `kvpn status -o json`.
fn status_doc(user: &NormalUser, f: &KubeFixture) -> serde_json::Value {
    let out = user.kvpn_ok(&["status", "-o", "json"], || f.diagnostics());
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("status JSON: {e}: {out}"))
}

/// The connected sessions of the user's `kvpn status -o json`.
fn connected_sessions(user: &NormalUser, f: &KubeFixture) -> Vec<serde_json::Value> {
    status_doc(user, f)["sessions"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|s| s["state"] == "connected")
        .collect()
}

/// lc-01 as a normal user, through sudo: `kvpn connect` of an unprivileged
/// user starts the root daemon with `sudo -n` (allowed for that binary only),
/// as root, accepting that uid; the user daemon's folder and socket are the
/// user's (0700, 0600); another uid is refused by the root socket and counted
/// (`root_daemon.refused_peers`, and a line in the table); curl to a Service
/// works. After a SIGKILL of the root daemon (its root-owned socket
/// left behind) the next `kvpn connect` of the user recovers by itself, and
/// `kvpn quit` of the user stops both daemons and leaves no TUN device. This
/// machine's resolv.conf and hosts file are untouched throughout.
#[test]
fn lc_01_normal_user_starts_root_daemon_through_sudo_and_recovers_after_sigkill() {
    let host_files = || {
        (
            std::fs::read("/etc/resolv.conf").unwrap_or_default(),
            std::fs::read("/etc/hosts").unwrap_or_default(),
        )
    };
    let host_before = host_files();
    let f = KubeFixture::new();
    // The daemon started through sudo gets sudo's reset environment, so it
    // manages the files `ip netns exec` binds over /etc in the laptop netns:
    // both must exist there (resolv.conf does), or it would see this machine's.
    if !f.laptop_hosts().exists() {
        std::fs::write(f.laptop_hosts(), "127.0.0.1 localhost\n")
            .unwrap_or_else(|e| panic!("{}: {e}", f.laptop_hosts().display()));
    }
    let id = unique_id();
    let netns = f.lab().netns_lab().laptop_netns().name().to_owned();
    let user = NormalUser::new(&id, f.runtime_dir(), &netns);
    // Dropped after `user` (declared before it would be dropped first): the
    // user's `kvpn quit` on a failure path needs the rule to repair resolv.conf.
    let sudo = SudoRule::new(&id, &user.name, &user.dataplane_bin());
    let user = UserWithRule { user, _sudo: sudo };
    let kubeconfig = user.own_kubeconfig(Path::new(&f.user_kubeconfig()));
    let kubeconfig = kubeconfig.to_string_lossy().into_owned();
    let web = web();
    let diag = || f.diagnostics();

    // 1. Connect as the user: the root daemon is started through sudo.
    let t0 = Instant::now();
    let out = user.kvpn_ok(&["connect", "--kubeconfig", &kubeconfig], diag);
    eprintln!(
        "normal-user connect through sudo: {:.1} s\n{out}",
        t0.elapsed().as_secs_f64()
    );
    assert!(
        out.contains("Started the root daemon as root through sudo"),
        "{out}"
    );
    let rootd = root_daemon_pid(f.runtime_dir());
    assert_eq!(
        uids(rootd),
        vec![0, 0, 0, 0],
        "root daemon {rootd} runs as root"
    );
    let args = cmdline(rootd);
    assert!(
        args.windows(2)
            .any(|w| w[0] == "--allow-uid" && w[1] == user.uid.to_string()),
        "root daemon allows the user's uid: {args:?}"
    );
    let parent = std::fs::read_to_string(format!("/proc/{rootd}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(") ")?
                .1
                .split(' ')
                .nth(1)?
                .parse::<u32>()
                .ok()
        })
        .unwrap_or(0);
    assert!(
        cmdline(parent).first().is_some_and(|p| p.ends_with("sudo")),
        "root daemon {rootd} was started by sudo: parent {parent} is {:?}",
        cmdline(parent)
    );
    let (sock_mode, sock_owner) = mode_and_owner(&f.runtime_dir().join("dataplane.sock"));
    assert_eq!(sock_owner, 0, "root socket owned by root");
    assert_eq!(
        sock_mode & 0o777,
        0o666,
        "reachable, the peer uid check decides"
    );
    // The user daemon: the user's, in the user's own folder.
    let user_pids = user.pids();
    let userd: Vec<u32> = user_pids
        .iter()
        .copied()
        .filter(|p| cmdline(*p).iter().any(|a| a == "daemon"))
        .collect();
    assert_eq!(
        userd.len(),
        1,
        "one user daemon of uid {}: {user_pids:?}",
        user.uid
    );
    assert_eq!(uids(userd[0]), vec![user.uid; 4]);
    let run_kvpn = user.home().join("run/kvpn");
    let userd_dir = std::fs::read_dir(&run_kvpn)
        .unwrap_or_else(|e| panic!("{}: {e}", run_kvpn.display()))
        .flatten()
        .map(|e| e.path())
        .find(|p| p.join("user.sock").exists())
        .unwrap_or_else(|| panic!("no user.sock under {}", run_kvpn.display()));
    assert_eq!(
        mode_and_owner(&userd_dir),
        (0o700, user.uid),
        "{}",
        userd_dir.display()
    );
    assert_eq!(
        mode_and_owner(&userd_dir.join("user.sock")),
        (0o600, user.uid),
        "user daemon socket"
    );
    let state = user.home().join("state/kvpn");
    assert_eq!(mode_and_owner(&state).1, user.uid, "{}", state.display());
    assert_eq!(
        mode_and_owner(&state).0 & 0o077,
        0,
        "{} is private",
        state.display()
    );
    // Another uid is refused by the root socket, with its uid and the fix,
    // and counted in `root_daemon.refused_peers`.
    assert_eq!(status_doc(&user, &f)["root_daemon"]["refused_peers"], 0);
    let nobody = Command::new("ip")
        .args([
            "netns",
            "exec",
            &netns,
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
        ])
        .args(["--clear-groups", "env", "-i", "HOME=/nonexistent"])
        .arg(format!("KVPN_RUNTIME_DIR={}", f.runtime_dir().display()))
        .arg(user.bin_dir().join("kvpn"))
        .args(["top", "--once", "-o", "json", "--interval", "0.2"])
        .output()
        .unwrap_or_else(|e| panic!("kvpn top as nobody: {e}"));
    let refusal = text(&nobody.stderr);
    assert!(
        !nobody.status.success() && refusal.contains("refuses uid 65534"),
        "uid 65534 was not refused: {}{refusal}",
        text(&nobody.stdout)
    );
    let refused = status_doc(&user, &f)["root_daemon"]["refused_peers"].as_u64();
    assert!(refused.is_some_and(|n| n >= 1), "refused_peers {refused:?}");
    let table = user.kvpn_ok(&["status"], diag);
    assert!(
        table.contains(&format!(
            "The root daemon refused {} call(s)",
            refused.unwrap_or(0)
        )),
        "{table}"
    );
    // Traffic, as the user.
    assert_eq!(connected_sessions(&user, &f).len(), 1);
    wait_curl_ok(&user, web, &f);

    // 2. lc-01: SIGKILL the root daemon; its root-owned socket stays behind.
    // SAFETY: the root daemon this test's user started.
    unsafe { libc::kill(rootd as i32, libc::SIGKILL) };
    let t0 = Instant::now();
    while alive(rootd) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "{rootd} survived SIGKILL"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        f.runtime_dir().join("dataplane.sock").exists(),
        "a SIGKILLed daemon cannot remove its socket"
    );
    // The next connect of the user recovers by itself: no `rm` of the socket.
    let out = user.kvpn_ok(&["connect", "--kubeconfig", &kubeconfig], diag);
    assert!(
        out.contains("Started the root daemon as root through sudo"),
        "{out}"
    );
    let rootd2 = root_daemon_pid(f.runtime_dir());
    assert_ne!(rootd2, rootd, "a new root daemon");
    assert_eq!(uids(rootd2), vec![0, 0, 0, 0]);
    wait_curl_ok(&user, web, &f);
    let connected = connected_sessions(&user, &f);
    assert_eq!(connected.len(), 1, "{connected:#?}");
    let tun = connected[0]["tun_name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        f.tun_devices().contains(&tun),
        "{tun} in {:?}",
        f.tun_devices()
    );

    // 3. `kvpn quit` of the user stops both daemons (the root one over its
    // socket: a normal user cannot signal it) and leaves no TUN device.
    let out = user.kvpn_ok(&["quit"], diag);
    assert!(
        out.contains(&format!("Stopped the root daemon (pid {rootd2})")),
        "{out}"
    );
    assert!(!alive(rootd2), "root daemon {rootd2} outlived kvpn quit");
    assert!(
        user.pids().is_empty(),
        "processes of the user left: {:?}",
        user.pids()
    );
    assert!(!f.runtime_dir().join("dataplane.sock").exists());
    assert!(
        f.tun_devices().is_empty(),
        "TUN devices left: {:?}",
        f.tun_devices()
    );
    let laptop_routes = f.laptop(&["ip", "route", "show", "proto", "107"]);
    assert_eq!(text(&laptop_routes.stdout).trim(), "", "kvpn routes left");
    assert_eq!(
        host_files(),
        host_before,
        "this machine's resolv.conf/hosts changed"
    );
}

/// Neither sudo rights nor a running root daemon: `kvpn connect` of a normal
/// user fails at once, before reading any kubeconfig, with what it tried (sudo
/// -n and why it failed, pkexec) and the fixes (start the daemon as root for
/// this uid, a NOPASSWD sudo rule, --socks); it leaves no process, no socket,
/// no file in the runtime folder, no user daemon folder and no temp file.
#[test]
fn normal_user_without_sudo_rights_or_root_daemon_fails_at_once_with_the_fix() {
    let id = unique_id();
    let runtime = std::env::temp_dir().join(format!("kvpn-t-{id}-runtime"));
    std::fs::create_dir_all(&runtime).unwrap_or_else(|e| panic!("{}: {e}", runtime.display()));
    struct RemoveDir(PathBuf);
    impl Drop for RemoveDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _runtime_guard = RemoveDir(runtime.clone());
    let netns =
        kvpn_lab::Netns::create(&format!("kvpn-t-{id}")).unwrap_or_else(|e| panic!("netns: {e:#}"));
    struct DeleteNetns(kvpn_lab::Netns);
    impl Drop for DeleteNetns {
        fn drop(&mut self) {
            let _ = self.0.delete();
        }
    }
    let netns = DeleteNetns(netns);
    let user = NormalUser::new(&id, &runtime, netns.0.name());

    let t0 = Instant::now();
    let out = user.kvpn(&["connect", "--kubeconfig", "/nonexistent/kubeconfig"]);
    let took = t0.elapsed();
    let err = text(&out.stderr);
    let stdout = text(&out.stdout);
    eprintln!("refused in {:.2} s:\n{stdout}{err}", took.as_secs_f64());
    assert!(
        !out.status.success(),
        "connected without root: {stdout}{err}"
    );
    assert!(took < Duration::from_secs(5), "not at once: {took:?}");
    let dataplane = user.dataplane_bin().display().to_string();
    for want in [
        format!(
            "cannot start the root daemon kvpn-dataplane for uid {}",
            user.uid
        ),
        format!("none answers on {}/dataplane.sock", runtime.display()),
        format!(
            "`sudo -n -- {dataplane} --runtime-dir {}",
            runtime.display()
        ),
        "sudo: a password is required (no sudo rule lets this user run it without a password)"
            .to_owned(),
        "pkexec".to_owned(),
        format!(
            "`sudo {dataplane} --runtime-dir {} --allow-uid {}`",
            runtime.display(),
            user.uid
        ),
        format!("`{} ALL=(root) NOPASSWD: {dataplane}`", user.name),
        "kvpn connect --socks".to_owned(),
    ] {
        assert!(err.contains(&want), "error lacks {want:?}:\n{err}");
    }
    assert!(
        !stdout.contains("kubeconfig") && !err.contains("/nonexistent"),
        "it went on to the kubeconfig: {stdout}{err}"
    );
    // Nothing left behind.
    assert!(user.pids().is_empty(), "processes left: {:?}", user.pids());
    let left: Vec<_> = std::fs::read_dir(&runtime)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left in {}: {left:?}", runtime.display());
    for d in ["run", "tmp"] {
        let dir = user.home().join(d);
        let left: Vec<_> = std::fs::read_dir(&dir)
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "left in {}: {left:?}", dir.display());
    }
}

/// `kvpn run` as a normal user (issue 27 item 5): the root daemon is started
/// through sudo as for connect, moves the user's own command into the run's
/// cgroup (its uid is checked against the caller's), and the command reaches the
/// web ClusterIP by IP and by name while nothing outside the run does; the session
/// ends with the command.
#[test]
fn normal_user_kvpn_run_reaches_the_cluster_and_leaves_nothing() {
    let f = KubeFixture::new();
    if !f.laptop_hosts().exists() {
        std::fs::write(f.laptop_hosts(), "127.0.0.1 localhost\n")
            .unwrap_or_else(|e| panic!("{}: {e}", f.laptop_hosts().display()));
    }
    let id = unique_id();
    let netns = f.lab().netns_lab().laptop_netns().name().to_owned();
    let user = NormalUser::new(&id, f.runtime_dir(), &netns);
    let sudo = SudoRule::new(&id, &user.name, &user.dataplane_bin());
    let user = UserWithRule { user, _sudo: sudo };
    let kubeconfig = user.own_kubeconfig(Path::new(&f.user_kubeconfig()));
    let kubeconfig = kubeconfig.to_string_lossy().into_owned();
    let web = web();
    let url = format!("http://{web}/");
    let t0 = Instant::now();
    let out = user.kvpn(&[
        "run",
        "--kubeconfig",
        &kubeconfig,
        "--",
        "sh",
        "-c",
        &format!(
            "curl -sS --max-time 10 {url} && curl -sS --max-time 10 http://web.default/ && id -u"
        ),
    ]);
    eprintln!(
        "normal-user kvpn run: {:.1} s, {}\nstdout:\n{}\nstderr:\n{}",
        t0.elapsed().as_secs_f64(),
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    assert!(
        out.status.success(),
        "kvpn run as {}: {}\n{}",
        user.name,
        text(&out.stderr),
        f.diagnostics()
    );
    let stdout = text(&out.stdout);
    assert_eq!(
        stdout.matches("kvpn-lab-server").count(),
        2,
        "two pages (by ClusterIP and by name): {stdout}"
    );
    assert!(
        stdout.trim_end().ends_with(&user.uid.to_string()),
        "the command ran as the user: {stdout}"
    );
    let doc = status_doc(&user, &f);
    let sessions = doc["sessions"].as_array().cloned().unwrap_or_default();
    assert!(sessions.is_empty(), "sessions left: {sessions:#?}");
    let rules = text(&f.laptop(&["ip", "rule", "show"]).stdout);
    assert!(!rules.contains("fwmark 0x6b76"), "run rules left:\n{rules}");
    let outside = f.http_get(web, Duration::from_secs(2));
    assert!(outside.is_err(), "reachable outside a run: {outside:?}");
}

/// The traffic manager's stored leases (its Lease objects' records).
fn stored_leases(f: &KubeFixture) -> String {
    serde_json::Value::Array(f.stored_leases()).to_string()
}

/// A second user, refused by the first user's root daemon: `kvpn status` says
/// the root daemon runs for another uid and refuses this one, with the fix —
/// not "hung or overloaded", and no DNS warning; `kvpn connect` fails before
/// it touches the cluster (no lease taken); `kvpn quit` stops this user's own
/// user daemon and leaves the other user's root daemon and session running.
#[test]
fn a_second_user_refused_by_another_users_root_daemon_is_told_why_takes_no_lease_and_quits() {
    let f = KubeFixture::new();
    if !f.laptop_hosts().exists() {
        std::fs::write(f.laptop_hosts(), "127.0.0.1 localhost\n")
            .unwrap_or_else(|e| panic!("{}: {e}", f.laptop_hosts().display()));
    }
    let id = unique_id();
    let netns = f.lab().netns_lab().laptop_netns().name().to_owned();
    let first = NormalUser::new(&id, f.runtime_dir(), &netns);
    let sudo = SudoRule::new(&id, &first.name, &first.dataplane_bin());
    let first = UserWithRule {
        user: first,
        _sudo: sudo,
    };
    let diag = || f.diagnostics();
    let kubeconfig = first.own_kubeconfig(Path::new(&f.user_kubeconfig()));
    first.kvpn_ok(
        &["connect", "--kubeconfig", &kubeconfig.to_string_lossy()],
        diag,
    );
    let rootd = root_daemon_pid(f.runtime_dir());
    assert_eq!(connected_sessions(&first, &f).len(), 1);

    let second = NormalUser::new(&format!("{id}b"), f.runtime_dir(), &netns);
    let kubeconfig2 = second.own_kubeconfig(Path::new(&f.user_kubeconfig()));
    let refuses = format!("refuses uid {}", second.uid);

    // Status: what happened, in the table and in JSON.
    let t0 = Instant::now();
    let out = second.kvpn(&["status"]);
    let said = format!("{}{}", text(&out.stdout), text(&out.stderr));
    eprintln!("status as the second user ({:?}):\n{said}", t0.elapsed());
    assert!(said.contains(&refuses), "{said}");
    assert!(
        said.contains(&format!("uid {}", first.uid)),
        "names the uid the root daemon runs for: {said}"
    );
    assert!(!said.contains("hung or overloaded"), "{said}");
    assert!(!said.contains("kill -CONT"), "{said}");
    assert!(!said.contains("resolv.conf"), "no DNS warning: {said}");
    let json = second.kvpn(&["status", "-o", "json"]);
    let doc: serde_json::Value = serde_json::from_str(&text(&json.stdout)).unwrap_or_else(|e| {
        panic!(
            "status JSON: {e}: {}{}",
            text(&json.stdout),
            text(&json.stderr)
        )
    });
    let why = doc["root_daemon"]["refuses_this_uid"]
        .as_str()
        .unwrap_or_default();
    assert!(why.contains(&refuses), "{doc:#}");
    assert_eq!(
        doc["root_daemon"]["not_answering"],
        serde_json::Value::Null,
        "{doc:#}"
    );

    // Connect: refused before the cluster is touched.
    let leases_before = stored_leases(&f);
    let t0 = Instant::now();
    let out = second.kvpn(&["connect", "--kubeconfig", &kubeconfig2.to_string_lossy()]);
    let took = t0.elapsed();
    let said = format!("{}{}", text(&out.stdout), text(&out.stderr));
    eprintln!("connect as the second user: {took:?}\n{said}");
    assert!(!out.status.success(), "{said}");
    assert!(said.contains(&refuses), "{said}");
    assert!(
        !said.contains("Leasing") && !said.contains("Installing"),
        "connect touched the cluster: {said}"
    );
    assert_eq!(stored_leases(&f), leases_before, "no lease was taken");

    // Quit: this user's own user daemon stops; the other user's root daemon stays.
    let daemons = || -> Vec<u32> {
        second
            .pids()
            .into_iter()
            .filter(|p| cmdline(*p).iter().any(|a| a == "daemon"))
            .collect()
    };
    // The way the refusal points to: SOCKS mode, which needs no root daemon
    // (and starts this user's own user daemon).
    let socks = second.kvpn(&[
        "connect",
        "--kubeconfig",
        &kubeconfig2.to_string_lossy(),
        "--socks",
        "--socks-listen",
        "127.0.0.1:1090",
    ]);
    assert!(
        socks.status.success(),
        "SOCKS connect as the second user: {}{}",
        text(&socks.stdout),
        text(&socks.stderr)
    );
    assert_eq!(daemons().len(), 1, "the second user's user daemon runs");
    let out = second.kvpn(&["quit"]);
    let said = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "quit as the second user: {said}");
    let t0 = Instant::now();
    while !daemons().is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the second user's user daemon still runs after quit: {said}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(alive(rootd), "the first user's root daemon still runs");
    assert_eq!(connected_sessions(&first, &f).len(), 1, "its session too");
}
