//! SSH jump hosts on the Kubernetes lab: bastion netns running the real OpenSSH
//! `sshd` (Debian's openssh-server) with their own config, host keys and
//! authorized_keys in the test's folder (never /etc/ssh), chained so that each
//! bastion is reachable only from the one before it, the last one reaches the API
//! server (172.31.255.1:6443), and the laptop cannot reach the API server itself (an
//! nftables table `kvpn_ssh_<id>` in the laptop netns rejects it).
//!
//! ```text
//! laptop ──veth 10.254.1.0/30── b1 ──veth 10.254.2.0/30── b2 ── … ── bN ──uplink── node (API :6443)
//! ```
//! The last bastion is an extra laptop netns of the lab ([`KubeFixture::add_laptop`]:
//! its own uplink with a route to the API server only); the ones before it are netns
//! of their own. Root's password inside a bastion comes from a `shadow` file in the
//! bastion's `/etc/netns/<name>/` (bind-mounted by `ip netns exec` for sshd only).
//!
//! [`SshLab::on_node`] instead runs one sshd in the lab's node netns (a jump host that
//! is a cluster node and reaches ClusterIPs, for the SSH data-plane bypass), and
//! [`SshLab::black_hole_ssh`] silently drops the laptop's SSH traffic.
//!
//! Everything is removed on drop: sshd (by pid), ssh-agent (by pid), the links, the
//! netns made here and the nftables table.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use kvpn_lab::{LAPTOP, Netns};

use crate::kube_lab::{KubeFixture, retry_until};
use crate::text;

/// sshd's port in every bastion.
pub const SSHD_PORT: u16 = 2222;
/// Root's password on every bastion.
pub const PASSWORD: &str = "kvpn-lab-ssh-pw";
/// The API server as the laptop's kubeconfig names it.
pub const API: &str = "172.31.255.1:6443";

/// One bastion: a netns with sshd.
pub struct Bastion {
    /// Netns name.
    pub netns: String,
    /// Its address as the previous hop (laptop or bastion) reaches it.
    pub addr: String,
    /// Host public keys (`type base64`) by type name (`ssh-ed25519`, …).
    pub host_keys: Vec<(String, String)>,
    /// Its folder (config, keys, log).
    pub dir: PathBuf,
    sshd: Option<Child>,
    /// The netns is this helper's own (not the lab's extra laptop).
    own_netns: bool,
}

impl Bastion {
    /// sshd's listener pid.
    pub fn sshd_pid(&self) -> u32 {
        self.sshd.as_ref().map_or(0, Child::id)
    }

    /// The per-connection sshd processes (children of the listener).
    pub fn connection_pids(&self) -> Vec<u32> {
        let parent = self.sshd_pid();
        let mut out = Vec::new();
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return out;
        };
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // pid (comm) state ppid …; comm may hold spaces, so split after ')'.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            if ppid == Some(parent) {
                out.push(pid);
            }
        }
        out
    }

    /// Established TCP connections in the bastion's netns whose peer is `peer`, as
    /// `ss -tnp` lines (with the owning process, e.g. `users:(("sshd",pid=…))`).
    pub fn connections_to(&self, peer: std::net::SocketAddr) -> Vec<String> {
        let out = Netns::from_name(&self.netns)
            .exec(&["ss", "-Htnp", "state", "established"])
            .unwrap_or_else(|e| panic!("ss in {}: {e:#}", self.netns));
        text(&out.stdout)
            .lines()
            .filter(|l| l.split_whitespace().any(|w| w == peer.to_string()))
            .map(str::to_owned)
            .collect()
    }

    /// The sshd log (`-E`).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("sshd.log")).unwrap_or_default()
    }

    /// The host key of `ty` (e.g. `ssh-ed25519`) as `type base64`.
    pub fn host_key(&self, ty: &str) -> String {
        self.host_keys
            .iter()
            .find(|(t, _)| t == ty)
            .map(|(t, k)| format!("{t} {k}"))
            .unwrap_or_else(|| panic!("bastion {} has no {ty} host key", self.netns))
    }

    /// `[addr]:port`, as known_hosts writes it.
    pub fn known_hosts_name(&self) -> String {
        format!("[{}]:{SSHD_PORT}", self.addr)
    }

    /// `addr:port` for --ssh-addr.
    pub fn ssh_addr(&self) -> String {
        format!("{}:{SSHD_PORT}", self.addr)
    }
}

impl Drop for Bastion {
    fn drop(&mut self) {
        if let Some(mut c) = self.sshd.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if self.own_netns {
            let _ = Netns::from_name(&self.netns).delete();
        } else {
            let _ = std::fs::remove_file(Netns::from_name(&self.netns).etc_dir().join("shadow"));
        }
    }
}

/// A chain of bastions in front of the API server plus the laptop-side block.
pub struct SshLab {
    /// The bastions, first hop (reached from the laptop) first.
    pub bastions: Vec<Bastion>,
    /// Test folder: keys, known_hosts, ssh config, HOME.
    pub dir: PathBuf,
    /// A client key (ed25519, no passphrase) in every bastion's authorized_keys.
    pub key: PathBuf,
    /// A passphrase-protected client key (also authorized), and its passphrase.
    pub encrypted_key: PathBuf,
    pub passphrase: &'static str,
    laptop_netns: String,
    nft_table: String,
    agent: Option<Child>,
    /// Extra environment of every [`SshLab::kvpn`] run.
    kvpn_env: Vec<(String, std::ffi::OsString)>,
}

/// Runs `cmd` to completion; fails the test unless it succeeded.
pub(crate) fn run(cmd: &mut Command) -> Output {
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

fn ip_batch(netns: &str, lines: &[String]) {
    Netns::from_name(netns)
        .ip_batch(lines)
        .unwrap_or_else(|e| panic!("ip in {netns}: {e:#}"));
}

impl SshLab {
    /// `hops` bastions (1..=5) in front of the API server of `fx`'s cluster; the
    /// laptop can no longer reach the API server directly.
    pub fn new(fx: &mut KubeFixture, hops: usize) -> Self {
        assert!((1..=5).contains(&hops), "1 to 5 hops");
        let id = fx.lab().netns_lab().id().to_owned();
        let dir = fx.lab().netns_lab().dir().join("ssh");
        let laptop_netns = fx.lab().netns_lab().laptop_netns().name().to_owned();
        let creds = Credentials::new(&dir);

        // The last bastion is an extra laptop netns (it reaches the API server).
        let last_role = format!("laptop-b{hops}");
        let last_ns = fx.add_laptop(&last_role).netns().name().to_owned();
        let mut names: Vec<(String, bool)> = (1..hops)
            .map(|i| (format!("kvpn-{id}-sshb{i}"), true))
            .collect();
        names.push((last_ns, false));
        for (name, own) in &names {
            if *own {
                Netns::create(name).unwrap_or_else(|e| panic!("netns {name}: {e:#}"));
                ip_batch(name, &["link set lo up".to_owned()]);
            }
        }
        let mut bastions: Vec<Bastion> = Vec::new();
        let mut prev = laptop_netns.clone();
        for (i, (name, own)) in names.iter().enumerate() {
            let n = i + 1;
            let (a, b) = (format!("kv{id}s{n}a"), format!("kv{id}s{n}b"));
            let (a_ip, b_ip) = (format!("10.254.{n}.1"), format!("10.254.{n}.2"));
            ip_batch(
                &prev,
                &[
                    format!("link add {a} type veth peer name {b} netns {name}"),
                    format!("addr add {a_ip}/30 dev {a}"),
                    format!("link set {a} up"),
                ],
            );
            ip_batch(
                name,
                &[
                    format!("addr add {b_ip}/30 dev {b}"),
                    format!("link set {b} up"),
                ],
            );
            bastions.push(creds.start_sshd(name, &b_ip, &dir.join(format!("b{n}")), *own));
            prev = name.clone();
        }
        Self::finish(laptop_netns, &id, dir, creds, bastions)
    }

    /// One "bastion" that is a cluster node: sshd in the lab's node netns, on the
    /// node's uplink address (172.31.255.1:2222, which the laptop reaches), so it
    /// reaches the API server and, through kube-proxy's rules, every ClusterIP —
    /// the case the SSH data-plane bypass is for (the lab's node netns routes the
    /// service CIDR, like a real node).
    pub fn on_node(fx: &mut KubeFixture) -> Self {
        let id = fx.lab().netns_lab().id().to_owned();
        let dir = fx.lab().netns_lab().dir().join("ssh");
        let laptop_netns = fx.lab().netns_lab().laptop_netns().name().to_owned();
        let creds = Credentials::new(&dir);
        let node_ns = fx.lab().netns_lab().node().netns().name().to_owned();
        let node_ip = API
            .split(':')
            .next()
            .unwrap_or_else(|| unreachable!("API is host:port"));
        let bastion = creds.start_sshd(&node_ns, node_ip, &dir.join("node"), false);
        Self::finish(laptop_netns, &id, dir, creds, vec![bastion])
    }

    fn finish(
        laptop_netns: String,
        id: &str,
        dir: PathBuf,
        creds: Credentials,
        bastions: Vec<Bastion>,
    ) -> Self {
        // The laptop must not reach the API server but through SSH.
        let nft_table = format!("kvpn_ssh_{id}");
        let rules = format!(
            "table inet {nft_table} {{\n  chain out {{\n    type filter hook output priority 0; policy accept;\n    \
             ip daddr 172.31.255.1 tcp dport 6443 reject with tcp reset\n  }}\n}}\n"
        );
        nft_load(&laptop_netns, &rules);
        SshLab {
            bastions,
            dir,
            key: creds.key,
            encrypted_key: creds.encrypted_key,
            passphrase: creds.passphrase,
            laptop_netns,
            nft_table,
            agent: None,
            kvpn_env: Vec::new(),
        }
    }
}

fn nft_load(netns: &str, rules: &str) {
    let mut nft = Netns::from_name(netns)
        .command("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("nft: {e}"));
    if let Some(mut stdin) = nft.stdin.take() {
        use std::io::Write as _;
        stdin
            .write_all(rules.as_bytes())
            .unwrap_or_else(|e| panic!("nft stdin: {e}"));
    }
    assert!(
        nft.wait().is_ok_and(|s| s.success()),
        "nft in {netns}: {rules}"
    );
}

/// The client keys and root's password hash every bastion accepts.
struct Credentials {
    key: PathBuf,
    encrypted_key: PathBuf,
    passphrase: &'static str,
    authorized: String,
    hash: String,
}

impl Credentials {
    fn new(dir: &Path) -> Self {
        std::fs::create_dir_all(dir.join("home/.ssh")).unwrap_or_else(|e| panic!("mkdir: {e}"));
        // sshd's privilege separation folder (what the Debian service creates).
        let _ = std::fs::create_dir_all("/run/sshd");
        // Client keys.
        let key = dir.join("id_ed25519");
        run(Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-C", "kvpn-test", "-f"])
            .arg(&key));
        let passphrase = "correct horse battery";
        let encrypted_key = dir.join("id_encrypted");
        run(Command::new("ssh-keygen")
            .args([
                "-q", "-t", "ed25519", "-N", passphrase, "-C", "kvpn-enc", "-f",
            ])
            .arg(&encrypted_key));
        let authorized = [&key, &encrypted_key]
            .iter()
            .map(|k| {
                std::fs::read_to_string(k.with_extension("pub"))
                    .unwrap_or_else(|e| panic!("pub key: {e}"))
            })
            .collect::<String>();
        let hash = text(
            &run(Command::new("openssl").args(["passwd", "-6", "-salt", "kvpnlab", PASSWORD]))
                .stdout,
        )
        .trim()
        .to_owned();
        Credentials {
            key,
            encrypted_key,
            passphrase,
            authorized,
            hash,
        }
    }

    /// sshd in `name` on `addr`:[`SSHD_PORT`], its files in `bdir`.
    fn start_sshd(&self, name: &str, b_ip: &str, bdir: &Path, own: bool) -> Bastion {
        let (authorized, hash) = (&self.authorized, &self.hash);
        std::fs::create_dir_all(bdir).unwrap_or_else(|e| panic!("mkdir: {e}"));
        let mut host_keys = Vec::new();
        for (ty, extra) in [
            ("ed25519", vec![]),
            ("ecdsa", vec!["-b", "256"]),
            ("rsa", vec!["-b", "2048"]),
        ] {
            let path = bdir.join(format!("ssh_host_{ty}_key"));
            run(Command::new("ssh-keygen")
                .args(["-q", "-t", ty, "-N", ""])
                .args(&extra)
                .arg("-f")
                .arg(&path));
            let public = std::fs::read_to_string(path.with_extension("pub")).unwrap_or_default();
            let mut parts = public.split_whitespace();
            host_keys.push((
                parts.next().unwrap_or_default().to_owned(),
                parts.next().unwrap_or_default().to_owned(),
            ));
        }
        std::fs::write(bdir.join("authorized_keys"), authorized).unwrap_or_else(|e| panic!("{e}"));
        let config = format!(
            "Port {SSHD_PORT}\nListenAddress {b_ip}\nPidFile {pid}\nAuthorizedKeysFile {ak}\n\
             StrictModes no\nPermitRootLogin yes\nPasswordAuthentication yes\n\
             KbdInteractiveAuthentication no\nUsePAM no\nAllowTcpForwarding yes\n\
             PermitOpen any\nMaxAuthTries 10\nLogLevel VERBOSE\n",
            pid = bdir.join("sshd.pid").display(),
            ak = bdir.join("authorized_keys").display(),
        );
        std::fs::write(bdir.join("sshd_config"), config).unwrap_or_else(|e| panic!("{e}"));
        let ns = Netns::from_name(name);
        ns.write_etc_file(
            "shadow",
            format!("root:{hash}:20000:0:99999:7:::\n").as_bytes(),
        )
        .unwrap_or_else(|e| panic!("shadow: {e:#}"));
        let bastion = Bastion {
            netns: name.to_owned(),
            addr: b_ip.to_owned(),
            host_keys,
            dir: bdir.to_owned(),
            sshd: Some(spawn_sshd(name, bdir, &[])),
            own_netns: own,
        };
        wait_listening(&bastion);
        bastion
    }
}

/// The host key types every bastion has (`ssh_host_<type>_key` in its folder).
const HOST_KEY_TYPES: [&str; 3] = ["ed25519", "ecdsa", "rsa"];

/// sshd in `name` with the config, host keys and log of `bdir`, and `env`.
fn spawn_sshd(name: &str, bdir: &Path, env: &[(&str, &Path)]) -> Child {
    let mut cmd = Netns::from_name(name).command("/usr/sbin/sshd");
    cmd.arg("-D").arg("-f").arg(bdir.join("sshd_config"));
    for ty in HOST_KEY_TYPES {
        cmd.arg("-h").arg(bdir.join(format!("ssh_host_{ty}_key")));
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.arg("-E")
        .arg(bdir.join("sshd.log"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("sshd in {name}: {e}"))
}

impl Bastion {
    /// Stops sshd — its listener and every connection it serves, by pid — so the
    /// bastion refuses SSH until [`Bastion::restart_sshd`].
    pub fn stop_sshd(&mut self) {
        let connections = self.connection_pids();
        if let Some(mut c) = self.sshd.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        for pid in connections {
            // SAFETY: kill by pid a child process of the sshd this helper started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }

    /// Restarts sshd with `first` as the first lines of its config (sshd keeps the
    /// first value of a keyword, so they override the defaults of this lab) and
    /// `env` added to its environment; waits until it listens again.
    pub fn restart_sshd(&mut self, first: &str, env: &[(&str, &Path)]) {
        if let Some(mut c) = self.sshd.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let path = self.dir.join("sshd_config");
        let config = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(&path, format!("{first}{config}")).unwrap_or_else(|e| panic!("{e}"));
        self.sshd = Some(spawn_sshd(&self.netns, &self.dir, env));
        wait_listening(self);
    }
}

impl SshLab {
    /// The fake HOME of the kvpn runs (its `.ssh/` is empty unless a test fills it).
    pub fn home(&self) -> PathBuf {
        self.dir.join("home")
    }

    /// Writes a known_hosts file `name` with `lines`; returns its path.
    pub fn known_hosts(&self, name: &str, lines: &[String]) -> PathBuf {
        let path = self.dir.join(name);
        std::fs::write(
            &path,
            lines.iter().map(|l| format!("{l}\n")).collect::<String>(),
        )
        .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        path
    }

    /// A known_hosts file with every bastion's ed25519 key (plain entries).
    pub fn known_hosts_all(&self) -> PathBuf {
        let lines: Vec<String> = self
            .bastions
            .iter()
            .map(|b| format!("{} {}", b.known_hosts_name(), b.host_key("ssh-ed25519")))
            .collect();
        self.known_hosts("known_hosts", &lines)
    }

    /// Starts ssh-agent and adds the passphrase-protected key with `ssh-add` (the
    /// passphrase through SSH_ASKPASS, no terminal); returns the agent socket.
    pub fn start_agent(&mut self) -> PathBuf {
        let sock = self.dir.join("agent.sock");
        let child = Command::new("ssh-agent")
            .arg("-D")
            .arg("-a")
            .arg(&sock)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("ssh-agent: {e}"));
        self.agent = Some(child);
        let t0 = Instant::now();
        while !sock.exists() {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "ssh-agent socket never appeared"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let askpass = self.dir.join("askpass.sh");
        std::fs::write(&askpass, format!("#!/bin/sh\necho '{}'\n", self.passphrase))
            .unwrap_or_else(|e| panic!("{e}"));
        run(Command::new("chmod").arg("700").arg(&askpass));
        run(Command::new("ssh-add")
            .arg(&self.encrypted_key)
            .env("SSH_AUTH_SOCK", &sock)
            .env("SSH_ASKPASS", &askpass)
            .env("SSH_ASKPASS_REQUIRE", "force")
            .env("DISPLAY", "kvpn-none:0")
            .stdin(Stdio::null()));
        sock
    }

    /// Sets `key=value` in the environment of every later [`SshLab::kvpn`] run (and
    /// so of the user daemon it starts).
    pub fn set_kvpn_env(&mut self, key: &str, value: impl Into<std::ffi::OsString>) {
        self.kvpn_env.retain(|(k, _)| k != key);
        self.kvpn_env.push((key.to_owned(), value.into()));
    }

    /// `kvpn <args>` in the laptop netns like [`KubeFixture::kvpn`], with HOME in the
    /// test folder and SSH_AUTH_SOCK set to `agent` (or unset).
    pub fn kvpn(&self, fx: &KubeFixture, args: &[&str], agent: Option<&Path>) -> Output {
        let kvpn = kvpn_lab::bin_path("kvpn").unwrap_or_else(|e| panic!("kvpn binary: {e:#}"));
        let mut cmd = fx
            .lab()
            .netns_lab()
            .command_in(LAPTOP, &kvpn.to_string_lossy())
            .unwrap_or_else(|e| panic!("laptop netns: {e:#}"));
        cmd.args(args)
            .env("KVPN_RUNTIME_DIR", fx.runtime_dir())
            .env("KVPN_RESOLV_CONF", fx.laptop_resolv_conf())
            .env("HOME", self.home())
            .env("XDG_STATE_HOME", fx.state_dir())
            .env_remove("KUBECONFIG")
            .env_remove("KVPN_SSH_CONFIG")
            .env_remove("KVPN_SSH_KNOWN_HOSTS")
            .env_remove("SSH_AUTH_SOCK")
            .stdin(Stdio::null());
        if let Some(a) = agent {
            cmd.env("SSH_AUTH_SOCK", a);
        }
        cmd.envs(self.kvpn_env.iter().map(|(k, v)| (k, v)));
        cmd.output()
            .unwrap_or_else(|e| panic!("run kvpn {args:?}: {e}"))
    }

    /// Whether the laptop can open TCP to the API server directly (it must not).
    pub fn laptop_reaches_api_directly(&self, fx: &KubeFixture) -> bool {
        let addr: std::net::SocketAddr = API.parse().unwrap_or_else(|e| panic!("{e}"));
        fx.lab()
            .netns_lab()
            .run_in(LAPTOP, move || {
                std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_ok()
            })
            .unwrap_or_else(|e| panic!("laptop netns: {e:#}"))
    }

    /// Silently drops everything between the laptop and the first bastion's sshd
    /// (both directions, no RST) until the returned guard heals or drops: a
    /// black-holed SSH connection.
    pub fn black_hole_ssh(&self) -> SshBlackHole {
        let b = &self.bastions[0];
        let table = format!("{}_hole", self.nft_table);
        let rules = format!(
            "table inet {table} {{\n  chain out {{\n    type filter hook output priority 0; policy accept;\n    \
             ip daddr {a} tcp dport {SSHD_PORT} counter drop\n  }}\n  chain in {{\n    \
             type filter hook input priority 0; policy accept;\n    \
             ip saddr {a} tcp sport {SSHD_PORT} counter drop\n  }}\n}}\n",
            a = b.addr
        );
        nft_load(&self.laptop_netns, &rules);
        SshBlackHole {
            netns: self.laptop_netns.clone(),
            table: Some(table),
        }
    }

    /// sshd logs of all bastions, for failure messages.
    pub fn logs(&self) -> String {
        self.bastions
            .iter()
            .map(|b| format!("--- sshd in {} ---\n{}", b.netns, b.log()))
            .collect()
    }
}

fn wait_listening(b: &Bastion) {
    let ns = Netns::from_name(&b.netns);
    let listen = format!("{}:{SSHD_PORT}", b.addr);
    retry_until(
        &format!("sshd in {} listening on {listen}", b.netns),
        Duration::from_secs(10),
        Duration::from_millis(20),
        || {
            let out = ns
                .exec(&["ss", "-Htln"])
                .unwrap_or_else(|e| panic!("ss: {e:#}"));
            let listening = text(&out.stdout);
            if listening.contains(&listen) {
                Ok(())
            } else {
                Err(format!("listening sockets: {listening}"))
            }
        },
        || b.log(),
    );
}

/// `out`'s stdout when it succeeded; otherwise fails the test with its output, the
/// Kubernetes lab's diagnostics and the SSH lab's logs.
pub fn ok(out: Output, what: &str, fx: &KubeFixture, lab: &SshLab) -> String {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}\n{}\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr),
        fx.diagnostics(),
        lab.logs()
    );
    text(&out.stdout)
}

impl Drop for SshLab {
    fn drop(&mut self) {
        if let Some(mut a) = self.agent.take() {
            let _ = a.kill();
            let _ = a.wait();
        }
        let _ = Netns::from_name(&self.laptop_netns).exec(&[
            "nft",
            "delete",
            "table",
            "inet",
            &self.nft_table,
        ]);
        // Bastions (sshd, own netns) drop with the Vec, last first.
        while self.bastions.pop().is_some() {}
    }
}

/// An nftables table in the laptop netns dropping the SSH traffic of the first
/// bastion ([`SshLab::black_hole_ssh`]); removed by [`SshBlackHole::heal`] or on drop.
pub struct SshBlackHole {
    netns: String,
    table: Option<String>,
}

impl SshBlackHole {
    /// Removes the rules: the SSH path works again.
    pub fn heal(&mut self) {
        if let Some(t) = self.table.take() {
            let out = Netns::from_name(&self.netns)
                .exec(&["nft", "delete", "table", "inet", &t])
                .unwrap_or_else(|e| panic!("nft delete {t}: {e:#}"));
            assert!(
                out.status.success(),
                "nft delete table {t}: {}",
                text(&out.stderr)
            );
        }
    }
}

impl Drop for SshBlackHole {
    fn drop(&mut self) {
        if let Some(t) = self.table.take() {
            let _ = Netns::from_name(&self.netns).exec(&["nft", "delete", "table", "inet", &t]);
        }
    }
}
