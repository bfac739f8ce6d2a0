//! `kvpn ssh` on the netns lab: the lab's node netns plays the SSH host, running
//! the real OpenSSH `sshd` (its own config, host key and authorized_keys in the
//! test's folder, never /etc/ssh) on 172.31.255.1:2222, reachable from the laptop
//! netns over the lab's uplink, and on 127.0.0.1:2222, reachable only from inside
//! the node (the second hop of a ProxyJump chain through the first listener).
//!
//! Accounts inside the node come from `/etc/netns/<node>/passwd` and `shadow`
//! (bind-mounted by `ip netns exec` for sshd and its sessions only): root and an
//! unprivileged `kvpnt` (uid 4242), both logging in with one test key.
//!
//! [`PtyProc`] runs a command on a fresh pty (its own session, the pty as
//! controlling terminal, so window changes send it SIGWINCH), records everything
//! it prints, and lets the test type, resize and read the pty's settings.
//!
//! Everything is removed on drop: sshd (by pid), the lab (netns, links, files).

use std::os::fd::{AsFd as _, AsRawFd as _, OwnedFd};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpn_lab::{Lab, LabOptions, Netns};

use crate::text;

/// sshd's port.
pub const SSHD_PORT: u16 = 2222;
/// The unprivileged login on the SSH host.
pub const USER: &str = "kvpnt";

/// The lab plus sshd in its node netns.
pub struct SshHost {
    sshd: Option<Child>,
    /// Test folder: keys, known_hosts, sshd config and log, HOME of the kvpn runs.
    pub dir: PathBuf,
    /// The client key (ed25519, no passphrase), authorized for root and [`USER`].
    pub key: PathBuf,
    /// known_hosts with both listeners' host key.
    pub known_hosts: PathBuf,
    /// The kvpn binary (world-executable copy, for the unprivileged login too).
    pub kvpn: PathBuf,
    /// Root's home on the SSH host (inside [`SshHost::dir`]).
    pub root_home: PathBuf,
    /// The lab (last: dropped after sshd).
    pub lab: Lab,
}

fn run(cmd: &mut Command) -> std::process::Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}): {}{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    out
}

impl SshHost {
    /// A topology-only lab with sshd in its node netns.
    pub fn new() -> Self {
        let lab = Lab::up(LabOptions::default().topology_only())
            .unwrap_or_else(|e| panic!("lab up: {e:#}"));
        let dir = lab.dir().join("sshterm");
        std::fs::create_dir_all(dir.join("home/.ssh")).unwrap_or_else(|e| panic!("mkdir: {e}"));
        let _ = std::fs::create_dir_all("/run/sshd");
        // A copy every user may run (the binaries may sit under root-only folders).
        let bin = dir.join("bin");
        std::fs::create_dir_all(&bin).unwrap_or_else(|e| panic!("mkdir: {e}"));
        let kvpn = bin.join("kvpn");
        let built = kvpn_lab::bin_path("kvpn").unwrap_or_else(|e| panic!("kvpn binary: {e:#}"));
        std::fs::copy(&built, &kvpn).unwrap_or_else(|e| panic!("copy kvpn: {e}"));
        for d in [lab.dir().to_path_buf(), dir.clone(), bin.clone()] {
            run(Command::new("chmod").arg("755").arg(&d));
        }
        run(Command::new("chmod").arg("755").arg(&kvpn));

        let key = dir.join("id_ed25519");
        run(Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-C", "kvpn-sshterm", "-f"])
            .arg(&key));
        let authorized = std::fs::read_to_string(key.with_extension("pub"))
            .unwrap_or_else(|e| panic!("pub key: {e}"));
        std::fs::write(dir.join("authorized_keys"), &authorized).unwrap_or_else(|e| panic!("{e}"));
        run(Command::new("chmod")
            .arg("644")
            .arg(dir.join("authorized_keys")));
        let host_key = dir.join("ssh_host_ed25519_key");
        run(Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-f"])
            .arg(&host_key));
        let host_pub = std::fs::read_to_string(host_key.with_extension("pub"))
            .unwrap_or_else(|e| panic!("host key: {e}"));
        let host_pub: Vec<&str> = host_pub.split_whitespace().take(2).collect();
        let host_pub = host_pub.join(" ");
        let known_hosts = dir.join("known_hosts");
        std::fs::write(
            &known_hosts,
            format!(
                "[{uplink}]:{SSHD_PORT} {host_pub}\n[127.0.0.1]:{SSHD_PORT} {host_pub}\n",
                uplink = kvpn_lab::NODE_UPLINK_IP
            ),
        )
        .unwrap_or_else(|e| panic!("{e}"));

        // Accounts inside the node: the host's plus the unprivileged test user.
        let node = Netns::from_name(lab.node_netns().name());
        // Root's home moves into the test folder, so what a session leaves in it
        // (`--upload-kvpn`'s copy under ~/.cache) goes with the lab.
        let root_home = dir.join("roothome");
        std::fs::create_dir_all(&root_home).unwrap_or_else(|e| panic!("mkdir: {e}"));
        let mut passwd: String = std::fs::read_to_string("/etc/passwd")
            .unwrap_or_default()
            .lines()
            .map(|l| match l.strip_prefix("root:") {
                Some(_) => format!("root:x:0:0:root:{}:/bin/bash\n", root_home.display()),
                None => format!("{l}\n"),
            })
            .collect();
        passwd.push_str(&format!(
            "{USER}:x:4242:4242:kvpn test:{}:/bin/sh\n",
            dir.display()
        ));
        node.write_etc_file("passwd", passwd.as_bytes())
            .unwrap_or_else(|e| panic!("passwd: {e:#}"));
        node.write_etc_file(
            "shadow",
            format!("root:*:20000:0:99999:7:::\n{USER}:*:20000:0:99999:7:::\n").as_bytes(),
        )
        .unwrap_or_else(|e| panic!("shadow: {e:#}"));

        let config = format!(
            "Port {SSHD_PORT}\nListenAddress {uplink}\nListenAddress 127.0.0.1\nPidFile {pid}\n\
             HostKey {hk}\nAuthorizedKeysFile {ak}\nStrictModes no\nPermitRootLogin yes\n\
             PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n\
             AllowTcpForwarding yes\nPermitOpen any\nLogLevel VERBOSE\n",
            uplink = kvpn_lab::NODE_UPLINK_IP,
            pid = dir.join("sshd.pid").display(),
            hk = host_key.display(),
            ak = dir.join("authorized_keys").display(),
        );
        std::fs::write(dir.join("sshd_config"), config).unwrap_or_else(|e| panic!("{e}"));
        let sshd = node
            .command("/usr/sbin/sshd")
            .arg("-D")
            .arg("-f")
            .arg(dir.join("sshd_config"))
            .arg("-E")
            .arg(dir.join("sshd.log"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("sshd: {e}"));
        let host = SshHost {
            sshd: Some(sshd),
            dir,
            key,
            known_hosts,
            kvpn,
            root_home,
            lab,
        };
        host.wait_listening();
        host
    }

    fn wait_listening(&self) {
        let t0 = Instant::now();
        let want = format!("{}:{SSHD_PORT}", kvpn_lab::NODE_UPLINK_IP);
        loop {
            let out = self
                .node()
                .exec(&["ss", "-Htln"])
                .unwrap_or_else(|e| panic!("ss: {e:#}"));
            if text(&out.stdout).contains(&want) {
                return;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "sshd did not listen within 10 s: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The node netns (the SSH host).
    pub fn node(&self) -> Netns {
        Netns::from_name(self.lab.node_netns().name())
    }

    /// The laptop netns.
    pub fn laptop(&self) -> Netns {
        Netns::from_name(self.lab.laptop_netns().name())
    }

    /// `--ssh-addr` of the SSH host as the laptop reaches it.
    pub fn addr(&self) -> String {
        format!("{}:{SSHD_PORT}", kvpn_lab::NODE_UPLINK_IP)
    }

    /// The sshd log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("sshd.log")).unwrap_or_default()
    }

    /// The SSH flags for logging in as `user` at `addr`.
    pub fn ssh_flags(&self, user: &str, addr: &str) -> Vec<String> {
        vec![
            "--ssh-addr".into(),
            addr.into(),
            "--ssh-username".into(),
            user.into(),
            "--ssh-keyfile".into(),
            self.key.to_string_lossy().into_owned(),
            "--ssh-known-hosts".into(),
            self.known_hosts.to_string_lossy().into_owned(),
        ]
    }

    /// `kvpn <args>` in the laptop netns, with HOME in the test folder and no
    /// SSH_AUTH_SOCK; stdio left to the caller.
    pub fn kvpn_command(&self, args: &[String]) -> Command {
        let mut cmd = self.laptop().command(&self.kvpn);
        cmd.args(args)
            .env("HOME", self.dir.join("home"))
            .env("KVPN_RUNTIME_DIR", self.dir.join("runtime"))
            .env("TERM", "xterm")
            .env_remove("SSH_AUTH_SOCK")
            .env_remove("KVPN_SSH_CONFIG")
            .env_remove("KVPN_SSH_KNOWN_HOSTS");
        cmd
    }

    /// IPv4 addresses (`ip -o -4 addr`) of `netns`, one line per address.
    pub fn addrs(netns: &Netns) -> String {
        let out = netns
            .exec(&["ip", "-o", "-4", "addr", "show"])
            .unwrap_or_else(|e| panic!("ip addr: {e:#}"));
        text(&out.stdout)
    }
}

impl Default for SshHost {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for SshHost {
    fn drop(&mut self) {
        if let Some(mut c) = self.sshd.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A process on its own pty.
pub struct PtyProc {
    master: Arc<std::fs::File>,
    /// Kept open so the master never reads EIO while the test looks at the pty.
    slave: OwnedFd,
    child: Child,
    out: Arc<Mutex<Vec<u8>>>,
    status: Option<ExitStatus>,
}

fn winsize(rows: u16, cols: u16) -> nix::pty::Winsize {
    nix::pty::Winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

impl PtyProc {
    /// Starts `cmd` with the slave side of a new `rows`x`cols` pty as stdin, stdout,
    /// stderr and controlling terminal.
    pub fn spawn(mut cmd: Command, rows: u16, cols: u16) -> Self {
        let pty = nix::pty::openpty(Some(&winsize(rows, cols)), None)
            .unwrap_or_else(|e| panic!("openpty: {e}"));
        let dup =
            |fd: &OwnedFd| -> OwnedFd { fd.try_clone().unwrap_or_else(|e| panic!("dup: {e}")) };
        cmd.stdin(Stdio::from(dup(&pty.slave)))
            .stdout(Stdio::from(dup(&pty.slave)))
            .stderr(Stdio::from(dup(&pty.slave)));
        // SAFETY: only async-signal-safe calls (setsid, ioctl) between fork and exec.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        let master = Arc::new(std::fs::File::from(pty.master));
        let out = Arc::new(Mutex::new(Vec::new()));
        let (m, o) = (master.clone(), out.clone());
        std::thread::spawn(move || {
            use std::io::Read as _;
            let mut buf = [0u8; 4096];
            while let Ok(n) = (&*m).read(&mut buf) {
                if n == 0 {
                    break;
                }
                if let Ok(mut v) = o.lock() {
                    v.extend_from_slice(&buf[..n]);
                }
            }
        });
        PtyProc {
            master,
            slave: pty.slave,
            child,
            out,
            status: None,
        }
    }

    /// Everything printed so far.
    pub fn output(&self) -> String {
        self.out.lock().map(|v| text(&v)).unwrap_or_default()
    }

    /// Types `s`.
    pub fn send(&self, s: &str) {
        use std::io::Write as _;
        (&*self.master)
            .write_all(s.as_bytes())
            .unwrap_or_else(|e| panic!("write to the pty: {e}"));
    }

    /// Waits until the output contains `needle` (after byte `from`); returns the
    /// offset after it. Panics with the output after `within`.
    pub fn expect(&self, needle: &str, from: usize, within: Duration) -> usize {
        let t0 = Instant::now();
        loop {
            let all = self.output();
            if let Some(at) = all.get(from..).and_then(|s| s.find(needle)) {
                return from + at + needle.len();
            }
            assert!(
                t0.elapsed() < within,
                "{needle:?} not printed within {within:?}; output so far:\n{all}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sets the pty's window size (the kernel sends SIGWINCH to its foreground group).
    pub fn resize(&self, rows: u16, cols: u16) {
        let ws = winsize(rows, cols);
        // SAFETY: TIOCSWINSZ reads one `struct winsize` from a live local.
        let rc = unsafe { libc::ioctl(self.master.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
        assert_eq!(rc, 0, "TIOCSWINSZ: {}", std::io::Error::last_os_error());
    }

    /// The pty's local modes as the program left them.
    pub fn termios(&self) -> nix::sys::termios::Termios {
        nix::sys::termios::tcgetattr(self.slave.as_fd())
            .unwrap_or_else(|e| panic!("tcgetattr: {e}"))
    }

    /// Waits for the process to exit within `within`.
    pub fn wait(&mut self, within: Duration) -> ExitStatus {
        if let Some(s) = self.status {
            return s;
        }
        let t0 = Instant::now();
        loop {
            if let Some(s) = self
                .child
                .try_wait()
                .unwrap_or_else(|e| panic!("wait: {e}"))
            {
                self.status = Some(s);
                // Let the reader thread drain what is left.
                std::thread::sleep(Duration::from_millis(100));
                return s;
            }
            assert!(
                t0.elapsed() < within,
                "the process did not exit within {within:?}; output:\n{}",
                self.output()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for PtyProc {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
