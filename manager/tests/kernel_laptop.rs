//! The manager against a real Linux TCP/IP stack as the laptop (needs root, as
//! CI runs): a `laptop` netns with a TUN device routed to a "cluster" range,
//! a small frame pump, and a manager session in a `cluster` netns whose
//! servers hold the cluster addresses. Checks what Linux applications see:
//! ECONNREFUSED / EHOSTUNREACH on connect (tr-04), all bytes then EOF and
//! half-close (tr-05), ECONNRESET (tr-06), a 4000-byte UDP echo (tr-02) and
//! `ping` (tr-03).

mod common;

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;
use std::time::{Duration, Instant};

use kvpn_manager::session::{SessionConfig, run_session};
use kvpn_proto::frame::{self, Decoder, Kind};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

const TUN_MTU: usize = kvpn_manager::DEFAULT_MTU;
const SERVER: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 5);

fn run(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two netns `kvpn-t<hex>-l` (laptop) and `kvpn-t<hex>-c` (cluster), deleted on drop.
struct Netns {
    laptop: String,
    cluster: String,
    tun: String,
}

impl Netns {
    fn new() -> Self {
        assert!(
            nix::unistd::Uid::effective().is_root(),
            "this test needs root (network namespaces, TUN): run it as root, as CI does"
        );
        let mut h = RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        let id = format!("{:08x}", h.finish() as u32);
        let ns = Self {
            laptop: format!("kvpn-t{id}-l"),
            cluster: format!("kvpn-t{id}-c"),
            tun: format!("kvt{id}"),
        };
        run(&["ip", "netns", "add", &ns.laptop]);
        run(&["ip", "netns", "add", &ns.cluster]);
        for n in [&ns.laptop, &ns.cluster] {
            run(&["ip", "-n", n, "link", "set", "lo", "up"]);
        }
        // The cluster's "pods" live on the cluster netns's loopback.
        run(&[
            "ip",
            "-n",
            &ns.cluster,
            "addr",
            "add",
            "10.99.0.5/32",
            "dev",
            "lo",
        ]);
        run(&[
            "ip",
            "netns",
            "exec",
            &ns.cluster,
            "sysctl",
            "-qw",
            "net.ipv4.ping_group_range=0 2147483647",
        ]);
        ns
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in [&self.laptop, &self.cluster] {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

/// Spawn a thread in netns `name` running `f` on a current-thread runtime.
fn in_netns<F, Fut, T>(name: &str, f: F) -> std::thread::JoinHandle<T>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = T>,
    T: Send + 'static,
{
    let path = format!("/run/netns/{name}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
        nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(f())
    })
}

/// Open a TUN device `name` (IFF_TUN | IFF_NO_PI) in the calling thread's netns.
fn open_tun(name: &str) -> OwnedFd {
    const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
    #[repr(C)]
    struct IfReq {
        name: [u8; libc::IFNAMSIZ],
        flags: libc::c_short,
        _pad: [u8; 22],
    }
    // SAFETY: plain open(2) of a NUL-terminated path.
    let fd = unsafe {
        libc::open(
            c"/dev/net/tun".as_ptr(),
            libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC,
        )
    };
    assert!(fd >= 0, "open /dev/net/tun: {}", io::Error::last_os_error());
    // SAFETY: fd is a fresh, owned descriptor.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut ifr = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags: (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short,
        _pad: [0; 22],
    };
    ifr.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads an ifreq, which IfReq lays out.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETIFF, &mut ifr) };
    assert!(r == 0, "TUNSETIFF: {}", io::Error::last_os_error());
    fd
}

/// Move packets between the TUN device and the data channel as frames (the
/// root daemon's job, minimally).
async fn pump(tun: OwnedFd, channel: tokio::net::UnixStream) {
    // SAFETY: `tun` is an owned descriptor that moves into the AsyncFd, so it
    // stays open (and is not reused) for as long as it is registered.
    let tun = unsafe { AsyncFd::register(tun) }.unwrap_or_else(|e| panic!("register TUN: {e}"));
    let (mut rd, mut wr) = channel.into_split();
    let to_manager = async {
        let mut buf = vec![0u8; TUN_MTU + 64];
        loop {
            let mut guard = tun.readable().await.expect("TUN readable");
            // SAFETY: reading into an owned buffer of the given length.
            let n = unsafe {
                libc::read(
                    tun.get_ref().as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                assert_eq!(e.kind(), io::ErrorKind::WouldBlock, "TUN read: {e}");
                guard.clear_ready();
                continue;
            }
            let mut out = Vec::new();
            frame::encode_into(Kind::Packet, &buf[..n as usize], &mut out).expect("fits");
            if wr.write_all(&out).await.is_err() {
                return;
            }
        }
    };
    let from_manager = async {
        let mut rbuf = Vec::new();
        loop {
            rbuf.reserve(256 * 1024);
            match rd.read_buf(&mut rbuf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let mut used = 0;
            while let Some((f, n)) = Decoder::default()
                .decode(&rbuf[used..])
                .expect("valid frames")
            {
                used += n;
                if f.kind == Kind::Packet {
                    // SAFETY: writing a borrowed buffer of the given length.
                    let w = unsafe {
                        libc::write(
                            tun.get_ref().as_raw_fd(),
                            f.payload.as_ptr().cast(),
                            f.payload.len(),
                        )
                    };
                    assert!(w >= 0, "TUN write: {}", io::Error::last_os_error());
                }
            }
            rbuf.drain(..used);
        }
    };
    tokio::select! {
        () = to_manager => {}
        () = from_manager => {}
    }
}

async fn cluster_servers() -> (u16, u16, u16, u16) {
    // 1: writes 5 MB then closes. 2: reads to EOF then replies 2 MB.
    // 3: resets every connection after the first read. 4: UDP echo.
    let big = TcpListener::bind((SERVER, 0)).await.expect("bind");
    let half = TcpListener::bind((SERVER, 0)).await.expect("bind");
    let reset = TcpListener::bind((SERVER, 0)).await.expect("bind");
    let udp = UdpSocket::bind((SERVER, 0)).await.expect("bind");
    let ports = (
        big.local_addr().expect("addr").port(),
        half.local_addr().expect("addr").port(),
        reset.local_addr().expect("addr").port(),
        udp.local_addr().expect("addr").port(),
    );
    tokio::spawn(async move {
        while let Ok((mut s, _)) = big.accept().await {
            tokio::spawn(async move {
                let _ = s.write_all(&common::pattern(5 << 20, 1)).await;
            });
        }
    });
    tokio::spawn(async move {
        while let Ok((mut s, _)) = half.accept().await {
            tokio::spawn(async move {
                let mut req = Vec::new();
                if s.read_to_end(&mut req).await.is_ok() {
                    let _ = s.write_all(&(req.len() as u64).to_be_bytes()).await;
                    let _ = s.write_all(&common::pattern(2 << 20, 2)).await;
                }
            });
        }
    });
    tokio::spawn(async move {
        while let Ok((mut s, _)) = reset.accept().await {
            let mut b = [0u8; 16];
            let _ = s.read(&mut b).await;
            let _ = s.set_zero_linger();
            drop(s);
        }
    });
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65536];
        while let Ok((n, from)) = udp.recv_from(&mut buf).await {
            let _ = udp.send_to(&buf[..n], from).await;
        }
    });
    ports
}

#[test]
fn linux_laptop_through_the_manager() {
    let ns = Netns::new();
    let (laptop_end, manager_end) = std::os::unix::net::UnixStream::pair().expect("socketpair");
    let (ports_tx, ports_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();

    let cluster = in_netns(&ns.cluster, move || async move {
        ports_tx.send(cluster_servers().await).expect("ports");
        manager_end.set_nonblocking(true).expect("nonblocking");
        let stream = tokio::net::UnixStream::from_std(manager_end).expect("register");
        let config = SessionConfig {
            dial_timeout: Duration::from_secs(2),
            ..SessionConfig::default()
        };
        tokio::select! {
            r = run_session(stream, &config) => r.map(|m| m.to_string()).map_err(|e| e.to_string()),
            _ = done_rx => Ok("test done".to_string()),
        }
    });
    let (big, half, reset, udp) = ports_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("servers up");

    let tun_name = ns.tun.clone();
    let laptop_ns = ns.laptop.clone();
    let laptop = in_netns(&ns.laptop, move || async move {
        let tun = open_tun(&tun_name);
        for args in [
            vec!["addr", "add", "100.96.0.2/32", "dev", &tun_name],
            vec!["link", "set", &tun_name, "mtu", "9000", "up"],
            vec!["route", "add", "10.99.0.0/16", "dev", &tun_name],
        ] {
            let mut full = vec!["ip", "-n", &laptop_ns];
            full.extend(args);
            run(&full);
        }
        laptop_end.set_nonblocking(true).expect("nonblocking");
        let mut channel = tokio::net::UnixStream::from_std(laptop_end).expect("register");
        channel
            .write_all(&common::hello_frame(
                common::LAPTOP_V4,
                kvpn_proto::frame::PROTOCOL_VERSION,
            ))
            .await
            .expect("hello");
        tokio::spawn(pump(tun, channel));
        laptop_checks(&laptop_ns, big, half, reset, udp).await
    });
    let laptop_result = laptop.join();
    let _ = done_tx.send(());
    let cluster_result = cluster.join().expect("cluster thread");
    eprintln!("manager session: {cluster_result:?}");
    if let Err(panic) = laptop_result {
        std::panic::resume_unwind(panic);
    }
}

async fn laptop_checks(laptop_ns: &str, big: u16, half: u16, reset: u16, udp: u16) {
    let server = |port| SocketAddr::from((SERVER, port));

    // tr-04: a closed port refuses at once; an address nobody holds is unreachable.
    let t = Instant::now();
    let e = TcpStream::connect(server(1))
        .await
        .expect_err("closed port must refuse");
    assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "refusal took {:?}",
        t.elapsed()
    );
    let e = tokio::time::timeout(Duration::from_secs(10), TcpStream::connect("10.99.0.77:80"))
        .await
        .expect("unreachable address must fail, not hang")
        .expect_err("unreachable address must not connect");
    assert_eq!(e.kind(), io::ErrorKind::HostUnreachable, "{e}");

    // tr-05: 5 MB then EOF.
    let mut s = TcpStream::connect(server(big)).await.expect("connect");
    let t = Instant::now();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut got))
        .await
        .expect("5 MB and EOF in time")
        .expect("read");
    let elapsed = t.elapsed();
    assert_eq!(got.len(), 5 << 20);
    assert!(got == common::pattern(5 << 20, 1), "bytes differ");
    eprintln!(
        "Linux laptop, 5 MB download through the manager ({} build): {:.1} ms, {:.0} Mbit/s",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        elapsed.as_secs_f64() * 1e3,
        (5 << 20) as f64 * 8.0 / elapsed.as_secs_f64() / 1e6
    );

    // tr-05: half-close, then the whole reply, read slowly.
    let mut s = TcpStream::connect(server(half)).await.expect("connect");
    let request = common::pattern(1 << 20, 3);
    s.write_all(&request).await.expect("write request");
    s.shutdown().await.expect("shutdown(SHUT_WR)");
    tokio::time::sleep(Duration::from_millis(500)).await; // let windows close
    let mut reply = Vec::new();
    let mut chunk = vec![0u8; 8192];
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n = s.read(&mut chunk).await.expect("read reply");
        if n == 0 {
            break;
        }
        reply.extend_from_slice(&chunk[..n]);
        assert!(
            Instant::now() < deadline,
            "reply too slow: {} bytes",
            reply.len()
        );
    }
    assert_eq!(reply.len(), 8 + (2 << 20));
    assert_eq!(
        u64::from_be_bytes(reply[..8].try_into().expect("8 bytes")),
        1 << 20,
        "server saw the whole request"
    );
    assert!(
        reply[8..] == common::pattern(2 << 20, 2),
        "reply bytes differ"
    );

    // tr-06: the server resets; the laptop sees ECONNRESET; others keep working.
    let mut s = TcpStream::connect(server(reset)).await.expect("connect");
    s.write_all(b"x").await.expect("write");
    let mut b = [0u8; 1];
    let e = tokio::time::timeout(Duration::from_secs(5), s.read(&mut b))
        .await
        .expect("reset in time")
        .expect_err("reset, not EOF");
    assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}");
    let mut s = TcpStream::connect(server(big))
        .await
        .expect("a new connection after a reset");
    let mut first = [0u8; 1024];
    s.read_exact(&mut first).await.expect("data after a reset");

    // tr-02: a 4000-byte datagram comes back whole, from the server's address.
    let u = UdpSocket::bind("100.96.0.2:0").await.expect("bind");
    let msg = common::pattern(4000, 4);
    u.send_to(&msg, server(udp)).await.expect("send");
    let mut buf = vec![0u8; 65536];
    let (n, from) = tokio::time::timeout(Duration::from_secs(5), u.recv_from(&mut buf))
        .await
        .expect("UDP echo in time")
        .expect("recv");
    assert_eq!((&buf[..n], from), (&msg[..], server(udp)));

    // tr-03: Linux's own ping accepts the manager's echo replies. (Async
    // process: the pump runs on this thread.)
    let out = tokio::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            laptop_ns,
            "ping",
            "-c",
            "2",
            "-i",
            "0.2",
            "-W",
            "2",
            "10.99.0.5",
        ])
        .output()
        .await
        .expect("run ping");
    assert!(
        out.status.success(),
        "ping 10.99.0.5 failed: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = tokio::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            laptop_ns,
            "ping",
            "-c",
            "1",
            "-W",
            "2",
            "10.99.0.77",
        ])
        .output()
        .await
        .expect("run ping");
    assert!(!out.status.success(), "ping to an unused address succeeded");
}
