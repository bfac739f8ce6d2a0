//! A scripted laptop for in-process tests: a smoltcp interface (the laptop's
//! TCP/IP stack) whose packets travel as frames over an in-memory byte pipe to
//! a real manager session (`run_session`), which dials real servers on
//! loopback.

#![allow(
    dead_code,
    reason = "each test binary uses a different part of the harness"
)]

use std::net::IpAddr;
use std::time::{Duration, Instant};

use kvpn_manager::DEFAULT_MTU;
use kvpn_manager::metrics::Metrics;
use kvpn_manager::session::{SessionConfig, SessionError, run_session};
use kvpn_proto::device::QueueDevice;
use kvpn_proto::frame::{self, Decoder, Hello, Kind, PROTOCOL_VERSION};
use kvpn_proto::gso;
use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::socket::{tcp, udp};
use smoltcp::wire::{HardwareAddress, IpAddress, IpCidr};
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream, ReadHalf, WriteHalf};
use tokio::task::JoinHandle;

pub const LAPTOP_V4: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(100, 96, 0, 2));
pub const LAPTOP_V6: IpAddr = IpAddr::V6(std::net::Ipv6Addr::new(
    0xfd6b, 0x7670, 0x6e00, 0, 0, 0, 0, 2,
));

/// Pipe capacity per direction, bytes.
const PIPE: usize = 4 << 20;

pub struct Laptop {
    pub iface: Interface,
    pub device: QueueDevice,
    pub sockets: SocketSet<'static>,
    rd: ReadHalf<DuplexStream>,
    wr: WriteHalf<DuplexStream>,
    rbuf: Vec<u8>,
    epoch: Instant,
    /// Frames other than packets the manager sent (heartbeats).
    pub other_frames: Vec<(Kind, Vec<u8>)>,
    /// Raw IP packets received, when `keep_packets` is set.
    pub keep_packets: bool,
    pub packets: Vec<Vec<u8>>,
    pub session: Option<JoinHandle<Result<Metrics, SessionError>>>,
    pub manager_closed: bool,
    pub tunnel_ip: IpAddr,
    /// GSO frames (manager → laptop, offload bit 2) received; each was
    /// checked and segmented as the laptop's kernel would.
    pub gso_frames: u64,
    /// Packets those GSO frames were segmented into.
    pub gso_segments: u64,
}

pub fn session_config() -> SessionConfig {
    SessionConfig {
        dial_timeout: Duration::from_secs(2),
        allow_loopback: true,
        ..SessionConfig::default()
    }
}

/// Start a manager session on one end of a pipe; return the other end.
pub fn spawn_session(
    config: SessionConfig,
) -> (DuplexStream, JoinHandle<Result<Metrics, SessionError>>) {
    let (laptop_end, manager_end) = tokio::io::duplex(PIPE);
    let session = tokio::spawn(async move { run_session(manager_end, &config).await });
    (laptop_end, session)
}

pub fn hello_frame(tunnel_ip: IpAddr, version: u16) -> Vec<u8> {
    hello_frame_resumable(tunnel_ip, version, None)
}

/// A current hello offering `offloads` (hello option 4).
pub fn hello_frame_offloads(tunnel_ip: IpAddr, offloads: u8) -> Vec<u8> {
    let hello = Hello {
        offloads: Some(offloads),
        ..Hello::new(PROTOCOL_VERSION, tunnel_ip)
    }
    .encode()
    .expect("hello encodes");
    let mut out = Vec::new();
    frame::encode_into(Kind::Hello, &hello, &mut out).expect("fits");
    out
}

/// [`hello_frame`] with hello option 5 (a resume token) when given.
pub fn hello_frame_resumable(
    tunnel_ip: IpAddr,
    version: u16,
    resume_token: Option<[u8; frame::RESUME_TOKEN_LEN]>,
) -> Vec<u8> {
    let hello = Hello {
        resume_token,
        ..Hello::new(version, tunnel_ip)
    }
    .encode()
    .expect("hello encodes");
    let mut out = Vec::new();
    frame::encode_into(Kind::Hello, &hello, &mut out).expect("fits");
    out
}

impl Laptop {
    /// A laptop with `tunnel_ip`, connected to a fresh manager session.
    pub async fn connect(tunnel_ip: IpAddr) -> Self {
        let (pipe, session) = spawn_session(session_config());
        Self::with_pipe(tunnel_ip, pipe, Some(session)).await
    }

    pub async fn with_pipe(
        tunnel_ip: IpAddr,
        pipe: DuplexStream,
        session: Option<JoinHandle<Result<Metrics, SessionError>>>,
    ) -> Self {
        let hello = hello_frame(tunnel_ip, PROTOCOL_VERSION);
        Self::with_pipe_hello(tunnel_ip, pipe, session, &hello).await
    }

    /// A laptop connected to a fresh manager session of `config` with `hello`.
    pub async fn connect_with(tunnel_ip: IpAddr, config: SessionConfig, hello: &[u8]) -> Self {
        let (pipe, session) = spawn_session(config);
        Self::with_pipe_hello(tunnel_ip, pipe, Some(session), hello).await
    }

    /// The data connection breaks (both pipe ends of the laptop dropped: the
    /// manager reads EOF) and the laptop re-dials a new session of `config`
    /// with `hello`; the laptop's TCP/IP stack and its sockets stay.
    pub async fn redial(&mut self, config: SessionConfig, hello: &[u8]) {
        let (pipe, session) = spawn_session(config);
        let (rd, mut wr) = tokio::io::split(pipe);
        wr.write_all(hello).await.expect("hello written");
        self.rd = rd;
        self.wr = wr;
        self.rbuf.clear();
        self.manager_closed = false;
        self.session = Some(session);
    }

    pub async fn with_pipe_hello(
        tunnel_ip: IpAddr,
        pipe: DuplexStream,
        session: Option<JoinHandle<Result<Metrics, SessionError>>>,
        hello: &[u8],
    ) -> Self {
        let (rd, mut wr) = tokio::io::split(pipe);
        wr.write_all(hello).await.expect("hello written");
        let mut device = QueueDevice::new(DEFAULT_MTU);
        let mut config = Config::new(HardwareAddress::Ip);
        config.random_seed = 0x001a_9707;
        let epoch = Instant::now();
        let mut iface = Interface::new(config, &mut device, smoltcp::time::Instant::from_micros(0));
        iface.update_ip_addrs(|a| {
            let cidr = match tunnel_ip {
                IpAddr::V4(_) => IpCidr::new(IpAddress::from(tunnel_ip), 16),
                IpAddr::V6(_) => IpCidr::new(IpAddress::from(tunnel_ip), 64),
            };
            a.push(cidr).expect("address fits");
        });
        match tunnel_ip {
            IpAddr::V4(_) => {
                iface
                    .routes_mut()
                    .add_default_ipv4_route(std::net::Ipv4Addr::new(100, 96, 0, 1))
                    .expect("route fits");
            }
            IpAddr::V6(_) => {
                iface
                    .routes_mut()
                    .add_default_ipv6_route(std::net::Ipv6Addr::new(
                        0xfd6b, 0x7670, 0x6e00, 0, 0, 0, 0, 1,
                    ))
                    .expect("route fits");
            }
        }
        Self {
            iface,
            device,
            sockets: SocketSet::new(Vec::new()),
            rd,
            wr,
            rbuf: Vec::new(),
            epoch,
            other_frames: Vec::new(),
            keep_packets: false,
            packets: Vec::new(),
            session,
            manager_closed: false,
            tunnel_ip,
            gso_frames: 0,
            gso_segments: 0,
        }
    }

    fn now(&self) -> smoltcp::time::Instant {
        smoltcp::time::Instant::from_micros(self.epoch.elapsed().as_micros() as i64)
    }

    pub fn tcp_socket(&mut self, rx: usize, tx: usize) -> SocketHandle {
        let s = tcp::Socket::new(
            tcp::SocketBuffer::new(vec![0; rx]),
            tcp::SocketBuffer::new(vec![0; tx]),
        );
        self.sockets.add(s)
    }

    pub fn connect_tcp(
        &mut self,
        handle: SocketHandle,
        dst: std::net::SocketAddr,
        local_port: u16,
    ) {
        // The tunnel IP as source explicitly: smoltcp would pick ::1 for ::1.
        let local = std::net::SocketAddr::new(self.tunnel_ip, local_port);
        let cx = self.iface.context();
        self.sockets
            .get_mut::<tcp::Socket>(handle)
            .connect(cx, dst, local)
            .expect("connect starts");
    }

    pub fn tcp(&mut self, handle: SocketHandle) -> &mut tcp::Socket<'static> {
        self.sockets.get_mut::<tcp::Socket>(handle)
    }

    pub fn udp_socket(&mut self, port: u16) -> SocketHandle {
        let mut s = udp::Socket::new(
            udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 64], vec![0; 256 * 1024]),
            udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 64], vec![0; 256 * 1024]),
        );
        s.bind(port).expect("bind");
        self.sockets.add(s)
    }

    pub fn udp(&mut self, handle: SocketHandle) -> &mut udp::Socket<'static> {
        self.sockets.get_mut::<udp::Socket>(handle)
    }

    /// Send raw bytes on the data channel (frames or garbage).
    pub async fn send_raw(&mut self, bytes: &[u8]) {
        self.wr.write_all(bytes).await.expect("pipe write");
    }

    /// Send one raw IP packet as a frame.
    pub async fn send_packet(&mut self, packet: &[u8]) {
        let mut out = Vec::new();
        frame::encode_into(Kind::Packet, packet, &mut out).expect("fits");
        self.send_raw(&out).await;
    }

    /// Close the laptop's sending side of the data channel.
    pub async fn hang_up(&mut self) {
        let _ = self.wr.shutdown().await;
    }

    /// Poll the stack, send its packets, wait up to `max_wait` for frames from
    /// the manager and feed them in.
    pub async fn step(&mut self, max_wait: Duration) {
        let now = self.now();
        self.iface.poll(now, &mut self.device, &mut self.sockets);
        let mut out = Vec::new();
        while let Some(p) = self.device.pop_tx() {
            frame::encode_into(Kind::Packet, &p, &mut out).expect("MTU-sized packet fits a frame");
        }
        if !out.is_empty() {
            self.wr.write_all(&out).await.expect("pipe write");
        }
        let wait = self
            .iface
            .poll_delay(now, &self.sockets)
            .map(|d| Duration::from_micros(d.total_micros()))
            .unwrap_or(max_wait)
            .min(max_wait);
        if self.manager_closed {
            tokio::time::sleep(wait).await;
        } else {
            self.rbuf.reserve(256 * 1024);
            if let Ok(r) = tokio::time::timeout(wait, self.rd.read_buf(&mut self.rbuf)).await {
                match r {
                    Ok(0) | Err(_) => self.manager_closed = true,
                    Ok(_) => {}
                }
            }
        }
        let decoder = Decoder::default();
        let mut used = 0;
        while let Some((f, n)) = decoder
            .decode(&self.rbuf[used..])
            .expect("manager sends valid frames")
        {
            used += n;
            match f.kind {
                Kind::Packet => {
                    if self.keep_packets {
                        self.packets.push(f.payload.to_vec());
                    }
                    self.device.push_rx(f.payload.to_vec());
                }
                // The manager's stats frames (about once a second, the first at
                // once) would race the frames the tests wait for.
                Kind::Stats => {}
                // What the laptop's kernel does with a super-packet written
                // to its TUN: check it, cut it into segments.
                Kind::Gso => {
                    let (h, packet) = frame::GsoHeader::split(f.payload).expect("GSO header");
                    let kind = gso::check_super_packet(
                        packet,
                        h.flags,
                        h.gso_type,
                        h.gso_size,
                        h.csum_start,
                        h.csum_offset,
                    )
                    .expect("a valid super-packet from the manager");
                    let mut segments = Vec::new();
                    let seg =
                        gso::segment_tcp(packet, kind, usize::from(h.gso_size), &mut segments, 0)
                            .expect("segments");
                    assert!(seg.count >= 2, "a GSO frame of one segment");
                    self.gso_frames += 1;
                    self.gso_segments += seg.count as u64;
                    for span in seg.spans() {
                        if self.keep_packets {
                            self.packets.push(segments[span.clone()].to_vec());
                        }
                        self.device.push_rx(segments[span].to_vec());
                    }
                }
                other => self.other_frames.push((other, f.payload.to_vec())),
            }
        }
        self.rbuf.drain(..used);
        let now = self.now();
        self.iface.poll(now, &mut self.device, &mut self.sockets);
    }

    /// Step until `done` returns true; false on timeout.
    pub async fn run_until(
        &mut self,
        timeout: Duration,
        mut done: impl FnMut(&mut Self) -> bool,
    ) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if done(self) {
                return true;
            }
            self.step(Duration::from_millis(5)).await;
        }
        done(self)
    }

    /// End the session (laptop hangs up) and return the manager's counters.
    pub async fn finish(mut self) -> Metrics {
        self.hang_up().await;
        let session = self.session.take().expect("session handle");
        // Keep draining so the manager's writer never blocks on a full pipe.
        let drain = async {
            let mut buf = vec![0u8; 64 * 1024];
            while let Ok(n) = self.rd.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        };
        let (result, ()) = tokio::join!(
            async {
                tokio::time::timeout(Duration::from_secs(10), session)
                    .await
                    .expect("session ends after the laptop hangs up")
            },
            drain
        );
        result
            .expect("session task did not panic")
            .expect("session ended cleanly")
    }
}

/// Move everything `s` has received into `got`.
pub fn drain(s: &mut smoltcp::socket::tcp::Socket<'_>, got: &mut Vec<u8>) {
    while s.can_recv() {
        s.recv(|b| {
            got.extend_from_slice(b);
            (b.len(), ())
        })
        .expect("recv");
    }
}

/// Bytes whose content depends on position (detects reordering and loss).
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 7 + seed as usize) % 251) as u8)
        .collect()
}

/// Takes the first complete frame at the start of `buf` that is not a stats frame,
/// dropping the stats frames before it (the manager sends its stats at its own pace,
/// e.g. its first one before a heartbeat's echo); `None` until such a frame is whole.
pub fn take_first_non_stats(buf: &mut Vec<u8>) -> Option<(Kind, Vec<u8>)> {
    while let Some((f, used)) = Decoder::default().decode(buf).expect("valid frame") {
        let found = (f.kind != Kind::Stats).then(|| (f.kind, f.payload.to_vec()));
        buf.drain(..used);
        if found.is_some() {
            return found;
        }
    }
    None
}

/// A `kvpn-manager` binary run by a test, listening on an ephemeral loopback port,
/// with its log read on a thread (so it never blocks on a full pipe and a test cannot
/// hang on a missing line). Killed on drop if the test fails before [`Self::stop`].
pub struct ManagerProcess {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    log: Option<std::thread::JoinHandle<Vec<String>>>,
    /// The address it logged as `listen=`.
    pub addr: std::net::SocketAddr,
}

impl ManagerProcess {
    /// Starts the binary with `RUST_LOG=info`, `--listen 127.0.0.1:0` and `envs`, and
    /// waits up to 10 s for its listening address.
    pub fn start(envs: &[(&str, &std::path::Path)]) -> Self {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kvpn-manager"));
        cmd.args(["--listen", "127.0.0.1:0"])
            .env("RUST_LOG", "info");
        for (k, v) in envs {
            cmd.env(k, v);
        }
        Self::spawn(cmd)
    }

    /// Starts `cmd` (the binary, possibly behind wrappers that exec it, such as
    /// `ip netns exec`), reading its stderr, and waits up to 10 s for the address
    /// it logs as `listen=`; the log so far in the panic message if it never comes.
    pub fn spawn(cmd: std::process::Command) -> Self {
        Self::try_spawn(cmd).unwrap_or_else(|log| {
            panic!(
                "kvpn-manager did not log its listening address; its log:\n{}",
                log.join("\n")
            )
        })
    }

    /// [`Self::spawn`], or the whole log when the process ends (or stays silent
    /// for 10 s) before it logs its listening address.
    pub fn try_spawn(mut cmd: std::process::Command) -> Result<Self, Vec<String>> {
        use std::io::{BufRead, BufReader};
        cmd.stderr(std::process::Stdio::piped());
        let mut child = cmd.spawn().expect("start kvpn-manager");
        let stderr = child.stderr.take().expect("stderr");
        let (line_tx, lines) = std::sync::mpsc::channel::<String>();
        let log = std::thread::spawn(move || {
            let mut all = Vec::new();
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = line_tx.send(line.clone());
                all.push(line);
            }
            all
        });
        let mut me = Self {
            child,
            lines,
            log: Some(log),
            addr: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        };
        let mut seen = Vec::new();
        me.addr = loop {
            let Ok(line) = me.lines.recv_timeout(Duration::from_secs(10)) else {
                return Err(seen);
            };
            seen.push(line.clone());
            if let Some(rest) = line.split("listen=").nth(1) {
                break rest
                    .split_whitespace()
                    .next()
                    .expect("address")
                    .parse()
                    .expect("socket address");
            }
        };
        Ok(me)
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits up to `within` for a log line containing `needle`.
    pub fn wait_for_line(&self, needle: &str, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.contains(needle) => return,
                Ok(_) => {}
                Err(e) => panic!("kvpn-manager did not log {needle:?} within {within:?}: {e}"),
            }
        }
    }

    /// SIGTERM, then waits up to 5 s for a successful exit; returns its whole log.
    pub fn stop(mut self) -> Vec<String> {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).expect("pid")),
            nix::sys::signal::Signal::SIGTERM,
        )
        .expect("SIGTERM");
        let deadline = Instant::now() + Duration::from_secs(5);
        let status = loop {
            if let Some(st) = self.child.try_wait().expect("wait") {
                break st;
            }
            assert!(Instant::now() < deadline, "kvpn-manager ignored SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(status.success(), "exit status {status}");
        self.log
            .take()
            .expect("log thread")
            .join()
            .expect("log thread")
    }
}

impl Drop for ManagerProcess {
    fn drop(&mut self) {
        if self.log.is_some() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
