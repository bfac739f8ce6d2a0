//! The SSH peers of the bench on the Kubernetes lab: one OpenSSH `sshd` (Debian's
//! openssh-server) in a node's netns — a jump host that is a cluster node, so it
//! reaches pod IPs and, through kube-proxy's rules, ClusterIPs — used both by
//! `kvpn connect --ssh-addr` (ssh-direct data path) and by Debian's `sshuttle` as
//! the peer. Keys, config and logs live in the lab's folder (never /etc/ssh or
//! ~/.ssh); sshd and sshuttle are lab processes, stopped by pid here and by the
//! lab's teardown if the bench fails before that.

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvpn_lab::{LAPTOP, Lab};

/// sshd's port on the node's uplink address.
pub const SSHD_PORT: u16 = 2222;

/// An sshd in the node netns, a client key it accepts and a known_hosts naming it.
pub struct NodeSshd {
    /// `host:port` the laptop dials.
    pub addr: SocketAddr,
    /// The client's private key (ed25519, no passphrase).
    pub key: PathBuf,
    /// known_hosts with the sshd's host key as `[host]:port`.
    pub known_hosts: PathBuf,
    /// The fake HOME for the SSH clients (kvpn, ssh under sshuttle).
    pub home: PathBuf,
    /// The laptop's next hop towards `addr` (the router of a real-node lab).
    pub via: Ipv4Addr,
    pid: u32,
}

fn run(cmd: &mut Command) -> Result<String> {
    let shown = format!("{cmd:?}");
    let out = cmd
        .output()
        .with_context(|| format!("cannot run {shown}"))?;
    if !out.status.success() {
        bail!(
            "{shown} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl NodeSshd {
    /// Starts sshd in the netns of `role` (a node of `lab`) on `node_ip`:[`SSHD_PORT`]
    /// and waits until the laptop can open TCP to it. `service_route`: a bridge to
    /// route the service CIDR to in that netns first, for the stand-in node, whose
    /// own connections to ClusterIPs would fail before kube-proxy's DNAT without
    /// it (a real node's default route does it). `via`: the laptop's next hop
    /// towards `node_ip`.
    pub fn start(
        lab: &Lab,
        role: &str,
        node_ip: Ipv4Addr,
        via: Ipv4Addr,
        service_route: Option<(&str, &str)>,
    ) -> Result<Self> {
        let dir = lab.dir().join("bench-ssh");
        let home = dir.join("home");
        std::fs::create_dir_all(home.join(".ssh"))
            .with_context(|| format!("cannot create {}", home.display()))?;
        // sshd's privilege separation folder (what the Debian service creates).
        std::fs::create_dir_all("/run/sshd").context("cannot create /run/sshd")?;
        let node = lab.netns(role)?;
        if let Some((service_cidr, bridge)) = service_route {
            // The route may exist already (a lab that routes it itself): fine either way.
            let _ = node.ip(&["route", "add", service_cidr, "dev", bridge]);
        }

        let key = dir.join("id_ed25519");
        let host_key = dir.join("ssh_host_ed25519_key");
        for (path, comment) in [(&key, "kvpn-bench"), (&host_key, "kvpn-bench-host")] {
            run(Command::new("ssh-keygen")
                .args(["-q", "-t", "ed25519", "-N", "", "-C", comment, "-f"])
                .arg(path))?;
        }
        let read_pub = |p: &Path| {
            std::fs::read_to_string(p.with_extension("pub"))
                .with_context(|| format!("cannot read {}.pub", p.display()))
        };
        std::fs::write(dir.join("authorized_keys"), read_pub(&key)?)?;
        let host_pub = read_pub(&host_key)?;
        let mut parts = host_pub.split_whitespace();
        let (ty, b64) = (parts.next(), parts.next());
        let (Some(ty), Some(b64)) = (ty, b64) else {
            bail!(
                "malformed host key {}.pub: {host_pub:?}",
                host_key.display()
            );
        };
        let known_hosts = dir.join("known_hosts");
        std::fs::write(
            &known_hosts,
            format!("[{node_ip}]:{SSHD_PORT} {ty} {b64}\n"),
        )?;
        // Root's account must not look locked to sshd without PAM (Debian's root may
        // have `*` or `!` in /etc/shadow): a shadow file for the node netns only,
        // bind-mounted by `ip netns exec`, removed with the netns.
        let hash = run(Command::new("openssl").args([
            "passwd",
            "-6",
            "-salt",
            "kvpnbench",
            "kvpn-bench-unused-password",
        ]))?;
        node.write_etc_file(
            "shadow",
            format!("root:{}:20000:0:99999:7:::\n", hash.trim()).as_bytes(),
        )?;
        let config = format!(
            "Port {SSHD_PORT}\nListenAddress {node_ip}\nPidFile {pid}\nAuthorizedKeysFile {ak}\n\
             StrictModes no\nPermitRootLogin yes\nPasswordAuthentication no\n\
             KbdInteractiveAuthentication no\nUsePAM no\nAllowTcpForwarding yes\n\
             PermitOpen any\nLogLevel INFO\n",
            pid = dir.join("sshd.pid").display(),
            ak = dir.join("authorized_keys").display(),
        );
        std::fs::write(dir.join("sshd_config"), config)?;
        let mut sshd = Command::new("/usr/sbin/sshd");
        sshd.arg("-D")
            .arg("-e")
            .arg("-f")
            .arg(dir.join("sshd_config"))
            .arg("-h")
            .arg(&host_key);
        let pid = lab.spawn_in(role, "bench-sshd", &sshd)?;
        let addr = SocketAddr::from((node_ip, SSHD_PORT));
        let this = NodeSshd {
            addr,
            key,
            known_hosts,
            home,
            via,
            pid,
        };
        if let Err(e) = lab.wait_tcp(LAPTOP, addr, Duration::from_secs(10)) {
            let log = std::fs::read_to_string(lab.dir().join("bench-sshd.log")).unwrap_or_default();
            this.stop(lab);
            return Err(anyhow::Error::new(e).context(format!(
                "sshd in the {role} netns never listened on {addr}; its log:\n{log}"
            )));
        }
        Ok(this)
    }

    /// Stops sshd (by pid).
    pub fn stop(self, lab: &Lab) {
        let _ = lab.stop_process(self.pid, Duration::from_secs(2));
    }
}

/// Debian's `sshuttle` in the laptop netns, NAT method (iptables in the laptop
/// netns; its `sshuttle-<port>` chains live and die with that netns), carrying the
/// pod CIDR through `sshd`.
pub struct Sshuttle {
    pid: u32,
    log: PathBuf,
    route: Route,
}

/// The laptop's route and guard table for sshuttle.
struct Route {
    pod_cidr: String,
    table: String,
}

impl Route {
    fn add(&self, lab: &Lab, sshd: &NodeSshd) -> Result<()> {
        let (pod_cidr, table) = (&self.pod_cidr, &self.table);
        let rules = format!(
            "table ip {table} {{\n  chain out {{\n    type filter hook output priority 0; policy accept;\n    \
             ip daddr {pod_cidr} counter drop\n  }}\n}}\n"
        );
        let rules_file = lab.dir().join("bench-sshuttle-guard.nft");
        std::fs::write(&rules_file, rules)?;
        let laptop = lab.laptop_netns();
        let out = laptop.exec(&["nft", "-f", &rules_file.to_string_lossy()])?;
        if !out.status.success() {
            bail!(
                "nft -f {} in the laptop netns: {}",
                rules_file.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        laptop.ip(&["route", "add", pod_cidr, "via", &sshd.via.to_string()])?;
        Ok(())
    }

    /// Removes what [`Route::add`] made (whatever part of it exists).
    fn remove(&self, lab: &Lab) {
        let laptop = lab.laptop_netns();
        let _ = laptop.ip(&["route", "del", &self.pod_cidr]);
        let _ = laptop.exec(&["nft", "delete", "table", "ip", &self.table]);
    }
}

impl Sshuttle {
    /// Starts sshuttle for `pod_cidr` and waits until `probe` (a pod's TCP port)
    /// answers through it.
    ///
    /// The laptop has no route to the pod CIDR, and a connect() without a route fails
    /// before iptables' OUTPUT chain could redirect it; so the pod CIDR is routed to
    /// towards the node like a default route would, and an nftables table `kvpn_bench_<id>`
    /// in the laptop netns drops whatever to the pod CIDR sshuttle did not redirect
    /// (its NAT runs before the filter hook): every success is sshuttle's, never the
    /// raw path.
    pub fn start(lab: &Lab, sshd: &NodeSshd, pod_cidr: &str, probe: SocketAddr) -> Result<Self> {
        let route = Route {
            pod_cidr: pod_cidr.to_owned(),
            table: format!("kvpn_bench_{}", lab.id()),
        };
        let pid = match route.add(lab, sshd).and_then(|()| {
            let ssh_cmd = format!(
                "ssh -F /dev/null -i {} -o UserKnownHostsFile={} -o StrictHostKeyChecking=yes \
                 -o BatchMode=yes",
                sshd.key.display(),
                sshd.known_hosts.display()
            );
            let mut cmd = Command::new("sshuttle");
            cmd.args(["--method", "nat", "-r"])
                .arg(format!("root@{}", sshd.addr))
                .arg("-e")
                .arg(&ssh_cmd)
                .arg(pod_cidr)
                .env("HOME", &sshd.home);
            Ok(lab.spawn_in(LAPTOP, "bench-sshuttle", &cmd)?)
        }) {
            Ok(pid) => pid,
            Err(e) => {
                route.remove(lab);
                return Err(e);
            }
        };
        let this = Sshuttle {
            pid,
            log: lab.dir().join("bench-sshuttle.log"),
            route,
        };
        let t0 = Instant::now();
        loop {
            if let Err(e) = crate::interrupt::check() {
                this.stop(lab);
                return Err(e.into());
            }
            let ok = lab
                .run_in(LAPTOP, move || {
                    TcpStream::connect_timeout(&probe, Duration::from_secs(1)).is_ok()
                })
                .unwrap_or(false);
            let log = std::fs::read_to_string(&this.log).unwrap_or_default();
            if ok && log.contains("Connected") {
                return Ok(this);
            }
            if t0.elapsed() > Duration::from_secs(20) {
                this.stop(lab);
                bail!("sshuttle did not carry TCP to {probe} within 20 s; its log:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Stops sshuttle (by pid; SIGTERM lets it remove its iptables rules).
    pub fn stop(self, lab: &Lab) {
        let _ = lab.stop_process(self.pid, Duration::from_secs(5));
        self.route.remove(lab);
    }
}
