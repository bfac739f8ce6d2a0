//! `--source-policy preserve` and `ebpf-snat` with `/proc/sys` read-only, as a
//! container runtime (runc) mounts it in every non-privileged pod (needs root, as
//! CI runs). The manager binary runs in a `pod` netns inside a private mount
//! namespace whose `/proc/sys` is a read-only bind mount; a laptop session's ICMP
//! echo to the `node` netns is forwarded by the pod's kernel (TUN → veth, and the
//! reply veth → TUN) while `net.ipv4.ip_forward` stays 0. The same mount refuses
//! the write the manager used to make (`/proc/sys/net/ipv4/ip_forward`), so the
//! old code path could not have started there. The manager runs with only the
//! capabilities its policy needs, and [`each_capability_is_needed`] shows which
//! step fails without each of them. Also `devconf::ensure` directly:
//! without CAP_NET_ADMIN it fails naming the capability, and with forwarding
//! already on it changes nothing.

mod common;

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use kvpn_manager::devconf::{self, DevConfError};
use kvpn_proto::frame::{self, Decoder, Hello, Kind, PROTOCOL_VERSION};
use smoltcp::phy::ChecksumCapabilities;
use smoltcp::wire::{Icmpv4Packet, Icmpv4Repr, IpProtocol, Ipv4Packet, Ipv4Repr};

const POD: Ipv4Addr = Ipv4Addr::new(10, 201, 0, 2);
const NODE: Ipv4Addr = Ipv4Addr::new(10, 201, 0, 1);
const POOL: &str = "100.96.0.0/16";
const TUNNEL_IP: Ipv4Addr = Ipv4Addr::new(100, 96, 0, 2);

/// Mounts a read-only bind of `/proc/sys` over itself in a new private mount
/// namespace, then execs the arguments — what runc does to a container's
/// `/proc/sys`.
const READ_ONLY_PROC_SYS: &str = "mount --bind /proc/sys /proc/sys && \
     mount -o remount,bind,ro /proc/sys && exec \"$@\"";

fn run(args: &[&str]) -> String {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A `pod` and a `node` netns joined by a veth pair (`kvp<id>` in the pod,
/// `kvn<id>` in the node), all deleted on drop (also on failure).
struct Topology {
    pod: String,
    node: String,
    pod_if: String,
    tun: String,
}

impl Topology {
    fn new(tag: &str) -> Self {
        assert!(
            nix::unistd::Uid::effective().is_root(),
            "this test needs root (network namespaces, mounts, TUN): run it as root, as CI does"
        );
        let mut h = RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.write(tag.as_bytes());
        let id = format!("{:07x}", h.finish() as u32 & 0x0fff_ffff);
        let t = Self {
            pod: format!("kvpn-t{id}-pod"),
            node: format!("kvpn-t{id}-node"),
            pod_if: format!("kvp{id}"),
            tun: format!("kvt{id}"),
        };
        let node_if = format!("kvn{id}");
        run(&["ip", "netns", "add", &t.pod]);
        run(&["ip", "netns", "add", &t.node]);
        for ns in [&t.pod, &t.node] {
            run(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        }
        run(&[
            "ip", "-n", &t.pod, "link", "add", &t.pod_if, "type", "veth", "peer", "name", &node_if,
            "netns", &t.node,
        ]);
        let pod_cidr = format!("{POD}/24");
        let node_cidr = format!("{NODE}/24");
        run(&[
            "ip", "-n", &t.pod, "addr", "add", &pod_cidr, "dev", &t.pod_if,
        ]);
        run(&["ip", "-n", &t.pod, "link", "set", &t.pod_if, "up"]);
        run(&[
            "ip", "-n", &t.node, "addr", "add", &node_cidr, "dev", &node_if,
        ]);
        run(&["ip", "-n", &t.node, "link", "set", &node_if, "up"]);
        t
    }

    fn sysctl(&self, key: &str) -> String {
        let path = format!("/proc/sys/{}", key.replace('.', "/"));
        run(&["ip", "netns", "exec", &self.pod, "cat", &path])
            .trim()
            .to_owned()
    }

    /// The manager binary in the pod netns with a read-only `/proc/sys`, as root
    /// with only `caps` (setpriv: bounding set, no inheritable or ambient
    /// capabilities, no_new_privs — what a runtime gives a container whose
    /// securityContext drops ALL and adds `caps`); the log if it does not start.
    fn manager(
        &self,
        policy: &str,
        caps: &[&str],
        gateway: &str,
    ) -> Result<common::ManagerProcess, Vec<String>> {
        let bounding: String = std::iter::once("-all".to_owned())
            .chain(caps.iter().map(|c| format!("+{c}")))
            .collect::<Vec<_>>()
            .join(",");
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.pod])
            .args(["unshare", "--mount", "--propagation", "private"])
            .args(["sh", "-c", READ_ONLY_PROC_SYS, "sh"])
            .args([
                "setpriv",
                "--no-new-privs",
                "--inh-caps=-all",
                "--ambient-caps=-all",
            ])
            .arg(format!("--bounding-set={bounding}"))
            .arg(env!("CARGO_BIN_EXE_kvpn-manager"))
            .args(["--listen", &format!("{POD}:0")])
            .args(["--source-policy", policy, "--tunnel-pool", POOL])
            .args(["--egress-interface", &self.pod_if, "--pool-tun", &self.tun])
            .args(["--preserve-gateway", gateway])
            .env("RUST_LOG", "info")
            .env("RUST_BACKTRACE", "0");
        common::ManagerProcess::try_spawn(cmd)
    }

    /// What writing `net.ipv4.ip_forward` (the manager's old step) gives in the
    /// pod netns under the same read-only mount: exit status and stderr.
    fn old_ip_forward_write(&self) -> (bool, String) {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.pod])
            .args(["unshare", "--mount", "--propagation", "private"])
            .args(["sh", "-c", READ_ONLY_PROC_SYS, "sh"])
            .args(["sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])
            .output()
            .expect("run the write probe");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Runs `f` on a thread inside netns `ns`.
    fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{ns}");
        std::thread::spawn(move || {
            let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
            nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            f()
        })
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for ns in [&self.pod, &self.node] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// Whether the process `pid` sees `/proc/sys` mounted read-only.
fn proc_sys_read_only(pid: u32) -> bool {
    let info = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).expect("mountinfo");
    info.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.get(4) == Some(&"/proc/sys") && f.get(5).is_some_and(|o| o.split(',').any(|o| o == "ro"))
    })
}

fn echo_request(ident: u16, seq: u16) -> Vec<u8> {
    let icmp = Icmpv4Repr::EchoRequest {
        ident,
        seq_no: seq,
        data: b"kvpn-readonly-proc-sys",
    };
    let ip = Ipv4Repr {
        src_addr: TUNNEL_IP,
        dst_addr: NODE,
        next_header: IpProtocol::Icmp,
        payload_len: icmp.buffer_len(),
        hop_limit: 64,
    };
    let mut buf = vec![0u8; ip.buffer_len() + icmp.buffer_len()];
    let caps = ChecksumCapabilities::default();
    ip.emit(&mut Ipv4Packet::new_unchecked(&mut buf[..]), &caps);
    icmp.emit(&mut Icmpv4Packet::new_unchecked(&mut buf[20..]), &caps);
    buf
}

/// The echo reply `NODE → TUNNEL_IP` with `ident` in `packet`, if it is one.
fn is_echo_reply(packet: &[u8], ident: u16) -> bool {
    let Ok(ip) = Ipv4Packet::new_checked(packet) else {
        return false;
    };
    if ip.src_addr() != NODE || ip.dst_addr() != TUNNEL_IP || ip.next_header() != IpProtocol::Icmp {
        return false;
    }
    let Ok(icmp) = Icmpv4Packet::new_checked(ip.payload()) else {
        return false;
    };
    matches!(
        Icmpv4Repr::parse(&icmp, &ChecksumCapabilities::default()),
        Ok(Icmpv4Repr::EchoReply { ident: i, .. }) if i == ident
    )
}

/// From the node netns: a session with the manager at `addr` as laptop
/// `TUNNEL_IP`, pinging `NODE` through it (one echo every 200 ms) until a reply
/// comes back through the session; the round trip, or a panic after 10 s.
fn ping_through_the_pod(addr: SocketAddr) -> Duration {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .expect("timeout");
    let hello = Hello::new(PROTOCOL_VERSION, TUNNEL_IP.into());
    let mut out = Vec::new();
    frame::encode_into(Kind::Hello, &hello.encode().expect("hello"), &mut out).expect("fits");
    s.write_all(&out).expect("hello");
    let ident = 0x6b76;
    let start = Instant::now();
    let mut buf = Vec::new();
    for seq in 0u16.. {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no echo reply from {NODE} through the pod within 10 s ({seq} sent)"
        );
        out.clear();
        frame::encode_into(Kind::Packet, &echo_request(ident, seq), &mut out).expect("fits");
        s.write_all(&out).expect("echo request");
        let mut chunk = [0u8; 4096];
        match s.read(&mut chunk) {
            Ok(0) => panic!("the manager closed the session"),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => continue,
            Err(e) => panic!("reading the session: {e}"),
        }
        while let Some((f, used)) = Decoder::default().decode(&buf).expect("valid frame") {
            let reply = f.kind == Kind::Packet && is_echo_reply(f.payload, ident);
            buf.drain(..used);
            if reply {
                return start.elapsed();
            }
        }
    }
    unreachable!("the loop returns or panics")
}

/// The capabilities each policy needs, measured by
/// [`each_capability_is_needed`]: preserve creates the TUN device, its route, the
/// interfaces' IPv4 settings and the gateway address (NET_ADMIN) and announces the
/// gateway by gratuitous ARP (NET_RAW); ebpf-snat needs NET_ADMIN for the same TUN
/// path and to load and attach TC programs, and BPF for the maps and programs —
/// not PERFMON (the verifier accepts the programs from a loader without it; a
/// variable-offset stack write, such as an out-of-line memset, would need it).
/// The same sets as `kvpn install` renders, minus NET_RAW for ebpf-snat (there
/// only for `kvpn diagnose source`).
const PRESERVE_CAPS: &[&str] = &["net_admin", "net_raw"];
const EBPF_SNAT_CAPS: &[&str] = &["bpf", "net_admin"];

/// One source policy end to end under a read-only `/proc/sys` and only `caps`.
fn forwards_with_read_only_proc_sys(policy: &str, caps: &[&str]) {
    let t = Topology::new(policy);
    let preserve = policy == "preserve";
    if preserve {
        // preserve: the node routes the pool back to the pod (the cluster's part);
        // ebpf-snat's replies can only come back translated (no route to the pool).
        run(&[
            "ip",
            "-n",
            &t.node,
            "route",
            "add",
            POOL,
            "via",
            &POD.to_string(),
        ]);
    }
    assert_eq!(t.sysctl("net.ipv4.ip_forward"), "0", "a fresh netns");

    // What the manager did before: refused under the runtime's mount.
    let (ok, stderr) = t.old_ip_forward_write();
    assert!(
        !ok && stderr.contains("Read-only file system"),
        "the old step (write 1 to /proc/sys/net/ipv4/ip_forward) must fail with EROFS \
         here, got success={ok} stderr={stderr:?}"
    );

    let gateway = if preserve { "169.254.96.1" } else { "none" };
    let manager = t
        .manager(policy, caps, gateway)
        .unwrap_or_else(|log| panic!("{policy} with {caps:?} did not start: {log:#?}"));
    assert!(
        proc_sys_read_only(manager.pid()),
        "the manager must run with /proc/sys read-only"
    );
    let addr = manager.addr;
    let rtt = Topology::in_netns(&t.node, move || ping_through_the_pod(addr));
    eprintln!("{policy}: echo reply through the pod after {rtt:?}");

    // Forwarding on exactly the two interfaces, never globally.
    assert_eq!(t.sysctl("net.ipv4.ip_forward"), "0");
    assert_eq!(t.sysctl("net.ipv4.conf.all.forwarding"), "0");
    assert_eq!(t.sysctl("net.ipv4.conf.lo.forwarding"), "0");
    for dev in [&t.tun, &t.pod_if] {
        assert_eq!(
            t.sysctl(&format!("net.ipv4.conf.{dev}.forwarding")),
            "1",
            "{dev}"
        );
        assert_eq!(
            t.sysctl(&format!("net.ipv4.conf.{dev}.rp_filter")),
            "2",
            "{dev}"
        );
    }
    let log = manager.stop();
    assert_eq!(
        log.iter()
            .filter(|l| l.contains("IPv4 forwarding on") && l.contains("changed=true"))
            .count(),
        2,
        "both interfaces set over rtnetlink: {log:#?}"
    );
    if preserve {
        assert!(
            log.iter()
                .any(|l| l.contains("stable gateway claimed and announced")),
            "the gratuitous ARP went out: {log:#?}"
        );
    }
}

#[test]
fn preserve_forwards_with_read_only_proc_sys() {
    forwards_with_read_only_proc_sys("preserve", PRESERVE_CAPS);
}

#[test]
fn ebpf_snat_forwards_with_read_only_proc_sys() {
    forwards_with_read_only_proc_sys("ebpf-snat", EBPF_SNAT_CAPS);
}

/// Each policy's set minus one capability: which step fails, and how.
#[test]
fn each_capability_is_needed() {
    let t = Topology::new("caps");
    let without = |policy: &str, all: &[&str], drop: &str| {
        let caps: Vec<&str> = all.iter().copied().filter(|c| *c != drop).collect();
        let gateway = if policy == "preserve" {
            "169.254.96.1"
        } else {
            "none"
        };
        let outcome = t.manager(policy, &caps, gateway);
        // The TUN device goes with the process; the next run creates it anew.
        match outcome {
            Ok(m) => Ok(m.stop().join("\n")),
            Err(log) => Err(log.join("\n")),
        }
    };
    // preserve without NET_ADMIN: the first step, the TUN device.
    let log = without("preserve", PRESERVE_CAPS, "net_admin").expect_err("cannot start");
    assert!(
        log.contains("cannot create TUN device") && log.contains("CAP_NET_ADMIN"),
        "{log}"
    );
    // preserve without NET_RAW: serves, but the gateway is not announced (a
    // rescheduled pod is found when the nodes' neighbour entries expire).
    let log = without("preserve", PRESERVE_CAPS, "net_raw").expect("starts without NET_RAW");
    assert!(
        log.contains("gratuitous ARP failed") && log.contains("needs NET_RAW"),
        "{log}"
    );
    let log = without("ebpf-snat", EBPF_SNAT_CAPS, "net_admin").expect_err("cannot start");
    assert!(log.contains("cannot create TUN device"), "{log}");
    let log = without("ebpf-snat", EBPF_SNAT_CAPS, "bpf").expect_err("cannot start");
    assert!(
        log.contains("cannot attach the ebpf-snat programs")
            && log.contains("failed to create map")
            && log.contains("Operation not permitted"),
        "{log}"
    );
}

/// CAP_NET_ADMIN off in this thread's effective set (capabilities are per thread).
fn drop_net_admin_in_this_thread() {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    const CAP_NET_ADMIN: u32 = 12;
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget/capset with a v3 header and two data structs, as capget(2) says.
    unsafe {
        assert_eq!(
            libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()),
            0,
            "capget"
        );
        data[0].effective &= !(1 << CAP_NET_ADMIN);
        assert_eq!(
            libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()),
            0,
            "capset"
        );
    }
}

/// `devconf::ensure` on the pod's veth, in its netns, on a current-thread runtime.
fn ensure_in(t: &Topology, without_net_admin: bool) -> Result<devconf::Outcome, DevConfError> {
    let dev = t.pod_if.clone();
    Topology::in_netns(&t.pod, move || {
        if without_net_admin {
            drop_net_admin_in_this_thread();
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let (connection, handle, _) = rtnetlink::new_connection().expect("netlink");
            tokio::spawn(connection);
            let name = std::ffi::CString::new(dev.as_str()).expect("name");
            // SAFETY: a NUL-terminated name that lives across the call.
            let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
            assert_ne!(index, 0, "no interface {dev}");
            devconf::ensure(&handle, index, &dev).await
        })
    })
}

#[test]
fn without_net_admin_the_error_names_the_capability_and_nothing_changes() {
    let t = Topology::new("denied");
    let err = ensure_in(&t, true).expect_err("RTM_SETLINK without CAP_NET_ADMIN");
    let text = err.to_string();
    assert!(matches!(err, DevConfError::Denied { .. }), "{err:?}");
    assert!(
        text.contains("CAP_NET_ADMIN") && text.contains("capabilities.add"),
        "{text}"
    );
    let dev = &t.pod_if;
    assert_eq!(t.sysctl(&format!("net.ipv4.conf.{dev}.forwarding")), "0");
}

#[test]
fn with_ip_forward_on_only_rp_filter_is_set_and_a_second_call_changes_nothing() {
    let t = Topology::new("preset");
    // A pod whose ip_forward is already 1 (a privileged init set it): every
    // interface forwards, so only rp_filter is missing.
    run(&[
        "ip",
        "netns",
        "exec",
        &t.pod,
        "sh",
        "-c",
        "echo 1 > /proc/sys/net/ipv4/ip_forward",
    ]);
    let dev = t.pod_if.clone();
    run(&[
        "ip",
        "netns",
        "exec",
        &t.pod,
        "sh",
        "-c",
        &format!("echo 1 > /proc/sys/net/ipv4/conf/{dev}/rp_filter"),
    ]);
    assert_eq!(t.sysctl(&format!("net.ipv4.conf.{dev}.forwarding")), "1");
    let first = ensure_in(&t, false).expect("ensure");
    assert_eq!(first.before, (1, 1), "forwarding on, rp_filter strict");
    assert!(first.changed);
    assert_eq!(t.sysctl(&format!("net.ipv4.conf.{dev}.rp_filter")), "2");
    // Already right: no RTM_SETLINK, so it would pass without CAP_NET_ADMIN too.
    let second = ensure_in(&t, true).expect("nothing to set needs no capability");
    assert_eq!(
        second,
        devconf::Outcome {
            before: (1, 2),
            changed: false
        }
    );
}
