//! The pump's per-packet path allocates nothing once it runs (the claim of
//! dataplane/src/pump.rs: every buffer is allocated when the pump starts).
//!
//! A counting `#[global_allocator]` (its own test binary, so nothing else
//! counts) tallies the allocations made on the pump's thread: the pump runs
//! on a current-thread tokio runtime of its own, so its four tasks, the I/O
//! driver and the timers all run there, while the test drives it from the
//! main thread. Real file descriptors on both sides: a Unix datagram socket
//! pair stands in for a TUN device with `IFF_VNET_HDR` (it keeps packet
//! boundaries like the TUN; [`VnetSocket`] is that test double, writing the
//! `virtio_net_hdr` and the packet in one `writev` like the TUN device does),
//! and a Unix stream socket pair is the framed transport to the manager.
//!
//! Each round sends, outbound, plain packets, a packet with a partial
//! checksum and TCP super-packets (first cut into packet frames by the pump,
//! then, after the manager's hello, sent whole in GSO frames), and, inbound,
//! packet frames and GSO frames; the test reads every one of them at the far
//! end before the next round. After warm-up rounds (the flow table of the
//! re-dial hook, the scheduler's queues and tokio's channel blocks reach
//! their size), the rounds that follow must not allocate at all.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::{self, IoSlice, Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpn_dataplane::liveness::Liveness;
use kvpn_dataplane::pump::{self, Counters, PacketIo, PumpConfig, PumpExit, Refusal};
use kvpn_dataplane::redial::Redial;
use kvpn_dataplane::tun::{VNET_HDR_LEN, VNET_HDR_NONE};
use kvpn_lab::packets::{PROTO_UDP, ipv4, tcp_partial_checksum};
use kvpn_proto::frame::{
    self, Decoder, GsoHeader, Kind, ManagerHello, OFFLOAD_TCP_GSO, PROTOCOL_VERSION,
};
use kvpn_proto::gso;
use tokio::io::Interest;

/// Counts allocations (alloc, alloc_zeroed, realloc) made on a thread that
/// set [`ON_PUMP`].
struct Counting;

static PUMP_ALLOCS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Set on the pump's thread. Const-initialised without a destructor, so
    /// reading it inside the allocator never allocates.
    static ON_PUMP: Cell<bool> = const { Cell::new(false) };
}

fn count() {
    if ON_PUMP.try_with(Cell::get).unwrap_or(false) {
        PUMP_ALLOCS.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: every call is passed to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Test double of a TUN device with `IFF_VNET_HDR` offloads (see the file
/// header): reads carry the `virtio_net_hdr` the test wrote before each
/// packet; a write puts the header and the packet in one datagram with one
/// `writev`, without a copy, as `tun_rs::AsyncDevice` does.
struct VnetSocket(tokio::net::UnixDatagram);

impl PacketIo for VnetSocket {
    fn vnet_hdr(&self) -> bool {
        true
    }
    async fn readable(&self) -> io::Result<()> {
        self.0.readable().await
    }
    fn try_recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.try_recv(buf)
    }
    async fn send(&self, packet: &[u8]) -> io::Result<usize> {
        self.send_vnet(&VNET_HDR_NONE, packet).await
    }
    async fn send_vnet(&self, vnet: &[u8; VNET_HDR_LEN], packet: &[u8]) -> io::Result<usize> {
        let iov = [IoSlice::new(vnet), IoSlice::new(packet)];
        let fd = self.0.as_raw_fd();
        let n = self
            .0
            .async_io(Interest::WRITABLE, || {
                // SAFETY: `iov` holds two valid IoSlices (iovec-compatible on
                // Unix) that live across the call; `fd` is the open socket.
                let n = unsafe { libc::writev(fd, iov.as_ptr().cast(), iov.len() as i32) };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            })
            .await?;
        Ok(n.saturating_sub(VNET_HDR_LEN))
    }
}

const LAPTOP: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(100, 96, 0, 2), 40000);
const POD: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 244, 1, 20), 7007);
/// Super-packet payload and MSS: 4 segments (3 × 1000 + 500 bytes).
const SUPER_PAYLOAD: usize = 3500;
const MSS: u16 = 1000;

/// A TUN read: `virtio_net_hdr` (host byte order; csum_start 20, csum_offset
/// 16, header length 40: TCP over IPv4) + `packet`.
fn vnet_read(flags: u8, gso_type: u8, gso_size: u16, packet: &[u8]) -> Vec<u8> {
    let mut r = vec![flags, gso_type];
    for v in [40u16, gso_size, 20, 16] {
        r.extend_from_slice(&v.to_ne_bytes());
    }
    r.extend_from_slice(packet);
    r
}

/// What one round puts in and expects out.
struct Round {
    /// TUN reads, in order.
    reads: Vec<Vec<u8>>,
    /// The bytes the manager end receives for them before the hello
    /// (packet frames only) and after it (a GSO frame per super-packet).
    framed_segmented: Vec<u8>,
    framed_gso: Vec<u8>,
    /// Frames from the manager, and the TUN writes they become.
    inbound: Vec<u8>,
    tun_writes: Vec<Vec<u8>>,
}

fn round() -> Round {
    let data: Vec<u8> = (0..SUPER_PAYLOAD).map(|i| (i % 251) as u8).collect();
    let super_packet = tcp_partial_checksum(LAPTOP, POD, &data, 0x18);
    let gso_read = vnet_read(gso::F_NEEDS_CSUM, gso::GSO_TCPV4, MSS, &super_packet);
    let plain: Vec<Vec<u8>> = [20usize, 60, 576, 1400, 1500, 40]
        .iter()
        .map(|&len| {
            let mut udp = vec![0u8; 8 + len];
            udp[0..2].copy_from_slice(&LAPTOP.port().to_be_bytes());
            udp[2..4].copy_from_slice(&5353u16.to_be_bytes());
            udp[4..6].copy_from_slice(&((8 + len) as u16).to_be_bytes());
            ipv4(PROTO_UDP, *LAPTOP.ip(), *POD.ip(), &udp)
        })
        .collect();
    let ack = tcp_partial_checksum(LAPTOP, POD, b"x", 0x10);

    let mut reads: Vec<Vec<u8>> = plain.iter().map(|p| vnet_read(0, 0, 0, p)).collect();
    reads.push(vnet_read(gso::F_NEEDS_CSUM, gso::GSO_NONE, 0, &ack));
    reads.push(gso_read.clone());
    reads.push(gso_read);

    // What the pump sends for them: the plain packets as they are, the ACK
    // with its checksum completed, each super-packet as 4 segments or whole.
    let mut completed = ack.clone();
    gso::complete_checksum(&mut completed, 20, 16).expect("partial checksum");
    let mut segments = Vec::new();
    let cut = gso::segment_tcp(
        &super_packet,
        gso::GsoKind::TcpV4,
        usize::from(MSS),
        &mut segments,
        0,
    )
    .expect("segment");
    let gso_header = GsoHeader {
        flags: gso::F_NEEDS_CSUM,
        gso_type: gso::GSO_TCPV4,
        hdr_len: 40,
        gso_size: MSS,
        csum_start: 20,
        csum_offset: 16,
    };
    let gso_frame = [&gso_header.encode()[..], &super_packet].concat();
    let mut framed_segmented = Vec::new();
    let mut framed_gso = Vec::new();
    for p in plain.iter().chain([&completed]) {
        frame::encode_into(Kind::Packet, p, &mut framed_segmented).expect("fits");
        frame::encode_into(Kind::Packet, p, &mut framed_gso).expect("fits");
    }
    assert_eq!(cut.count, 4, "3 × 1000 + 500 payload bytes");
    for _ in 0..2 {
        for span in cut.spans() {
            frame::encode_into(Kind::Packet, &segments[span], &mut framed_segmented).expect("fits");
        }
        frame::encode_into(Kind::Gso, &gso_frame, &mut framed_gso).expect("fits");
    }

    // Inbound: packets and a super-packet pod -> laptop (the manager's
    // coalescer leaves the pseudo-header sum, as here).
    let down = tcp_partial_checksum(POD, LAPTOP, &data, 0x18);
    let down_header = [&gso_header.encode()[..], &down].concat();
    let mut inbound = Vec::new();
    let mut tun_writes = Vec::new();
    for p in &plain[..4] {
        frame::encode_into(Kind::Packet, p, &mut inbound).expect("fits");
        tun_writes.push([&VNET_HDR_NONE[..], p].concat());
    }
    for _ in 0..2 {
        frame::encode_into(Kind::Gso, &down_header, &mut inbound).expect("fits");
        let mut written = vec![gso::F_NEEDS_CSUM, gso::GSO_TCPV4];
        for v in [40u16, MSS, 20, 16] {
            written.extend_from_slice(&v.to_ne_bytes());
        }
        written.extend_from_slice(&down);
        tun_writes.push(written);
    }
    Round {
        reads,
        framed_segmented,
        framed_gso,
        inbound,
        tun_writes,
    }
}

/// The test's ends: the laptop's side of the TUN and the manager's side of
/// the transport (blocking, with timeouts so a stuck pump fails the test).
struct Ends {
    app: std::os::unix::net::UnixDatagram,
    manager: std::os::unix::net::UnixStream,
    /// Bytes read from the manager end, not yet taken as frames.
    from_pump: Vec<u8>,
}

impl Ends {
    /// The next frame from the pump that is not a heartbeat (the pump sends
    /// its first at once).
    fn next_frame(&mut self) -> (Kind, Vec<u8>) {
        loop {
            if let Some((f, used)) = Decoder::default()
                .decode(&self.from_pump)
                .expect("valid frames from the pump")
            {
                let found = (f.kind, f.payload.to_vec());
                self.from_pump.drain(..used);
                if found.0 != Kind::Heartbeat {
                    return found;
                }
                continue;
            }
            let mut chunk = [0u8; 65536];
            let n = self.manager.read(&mut chunk).expect("frames from the pump");
            assert!(n > 0, "the pump closed the transport");
            self.from_pump.extend_from_slice(&chunk[..n]);
        }
    }

    /// One round through the pump; `gso` selects which framing the outbound
    /// packets must arrive in.
    fn run(&mut self, r: &Round, gso: bool) {
        for read in &r.reads {
            self.app.send(read).expect("TUN read into the pump");
        }
        let want = frames(if gso {
            &r.framed_gso
        } else {
            &r.framed_segmented
        });
        let got: Vec<_> = (0..want.len()).map(|_| self.next_frame()).collect();
        assert_eq!(got, want, "outbound frames (gso frames: {gso})");
        self.manager.write_all(&r.inbound).expect("inbound frames");
        let mut buf = vec![0u8; 70_000];
        for (i, want) in r.tun_writes.iter().enumerate() {
            let n = self.app.recv(&mut buf).expect("TUN write from the pump");
            assert_eq!(&buf[..n], &want[..], "inbound TUN write {i}");
        }
    }
}

/// The frames in `bytes`: kind and payload.
fn frames(mut bytes: &[u8]) -> Vec<(Kind, Vec<u8>)> {
    let mut out = Vec::new();
    while let Some((f, used)) = Decoder::default().decode(bytes).expect("valid frames") {
        out.push((f.kind, f.payload.to_vec()));
        bytes = &bytes[used..];
    }
    assert!(bytes.is_empty(), "a partial frame at the end");
    out
}

/// The pump's thread: a current-thread runtime running [`pump::run`] until
/// the manager end closes.
fn start_pump(
    tun: std::os::unix::net::UnixDatagram,
    transport: std::os::unix::net::UnixStream,
    counters: Arc<Counters>,
) -> std::thread::JoinHandle<PumpExit> {
    std::thread::spawn(move || {
        ON_PUMP.with(|c| c.set(true));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        rt.block_on(async move {
            tun.set_nonblocking(true).expect("nonblocking TUN stand-in");
            transport
                .set_nonblocking(true)
                .expect("nonblocking transport");
            let tun = tokio::net::UnixDatagram::from_std(tun).expect("register TUN stand-in");
            let transport = tokio::net::UnixStream::from_std(transport).expect("register");
            let (rx, tx) = transport.into_split();
            // No heartbeat within the test: the steady state is packets only.
            let mut liveness = Liveness::new(Duration::from_secs(3600));
            liveness.handle_transport_up(Instant::now());
            pump::run(
                Arc::new(VnetSocket(tun)),
                rx,
                tx,
                Arc::new(Mutex::new(liveness)),
                counters,
                Arc::new(Refusal::default()),
                PumpConfig {
                    // As a session runs it: the re-dial hooks track every flow.
                    redial: Some(Arc::new(Redial::default())),
                    ..PumpConfig::default()
                },
            )
            .await
        })
    })
}

/// Allocations on the pump's thread so far, once it has gone idle (the
/// writers return their buffers after the far end already read the bytes).
fn pump_allocs() -> u64 {
    std::thread::sleep(Duration::from_millis(200));
    PUMP_ALLOCS.load(Ordering::Relaxed)
}

#[test]
fn per_packet_path_does_not_allocate_after_warm_up() {
    // Measured: with 20 warm-up rounds, 4 allocations still came in the next
    // 200, all of them tokio's mpsc channels growing their block list (32
    // slots a block) for the buffer queues until it covers the buffers in
    // flight; after 100 rounds, none in 1,000.
    const WARM_UP: usize = 100;
    const STEADY: usize = 1000;
    let (tun, app) = std::os::unix::net::UnixDatagram::pair().expect("datagram socketpair");
    let (transport, manager) = std::os::unix::net::UnixStream::pair().expect("stream socketpair");
    app.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    manager
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let counters = Arc::new(Counters::default());
    let pump = start_pump(tun, transport, counters.clone());
    let mut ends = Ends {
        app,
        manager,
        from_pump: Vec::new(),
    };
    let r = round();

    // Before the manager's hello: super-packets are cut by the pump.
    for _ in 0..WARM_UP {
        ends.run(&r, false);
    }
    let before = pump_allocs();
    for _ in 0..STEADY {
        ends.run(&r, false);
    }
    let segmenting = pump_allocs() - before;

    // The manager accepts GSO frames: super-packets leave whole.
    let mut hello = Vec::new();
    let answer = ManagerHello {
        version: PROTOCOL_VERSION,
        offloads: OFFLOAD_TCP_GSO,
    };
    frame::encode_into(Kind::Hello, &answer.encode(), &mut hello).expect("fits");
    ends.manager.write_all(&hello).expect("manager hello");
    std::thread::sleep(Duration::from_millis(200));
    for _ in 0..WARM_UP {
        ends.run(&r, true);
    }
    let before = pump_allocs();
    for _ in 0..STEADY {
        ends.run(&r, true);
    }
    let gso_frames = pump_allocs() - before;

    // The rounds went through the paths they were meant to.
    let rounds = (2 * (WARM_UP + STEADY)) as u64;
    assert_eq!(
        Counters::get(&counters.tx_gso_segmented),
        rounds,
        "super-packets cut by the pump"
    );
    assert_eq!(
        Counters::get(&counters.tx_gso_frames),
        rounds,
        "super-packets sent in GSO frames"
    );
    assert_eq!(Counters::get(&counters.rx_gso_frames), 2 * rounds);
    assert_eq!(Counters::get(&counters.rx_packets), 6 * rounds);
    assert_eq!(Counters::get(&counters.rx_invalid), 0);
    assert_eq!(Counters::get(&counters.tx_offload_dropped), 0);
    assert!(
        Counters::get(&counters.tx_batches) >= 2 * STEADY as u64,
        "at least one batch per round"
    );

    assert_eq!(
        (segmenting, gso_frames),
        (0, 0),
        "allocations on the pump's thread over {STEADY} rounds of 9 TUN reads (2 \
         super-packets) and 6 inbound frames (2 GSO): (self-segmenting, GSO frames)"
    );

    drop(ends);
    match pump.join().expect("pump thread") {
        PumpExit::TransportClosed => {}
        other => panic!("the pump ended with {other:?}, not the manager's close"),
    }
}
