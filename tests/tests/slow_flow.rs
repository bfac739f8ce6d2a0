//! Issue #8: one slow flow does not block the others, even on the same worker
//! (`kvpn connect --workers 1`: one TUN queue, one data connection, one
//! manager engine). Flow control per flow has to hold a stalled flow's bytes
//! back at its own ends, never in the shared pump or transport.
//!
//! Two stalled flows to a pod: an upload to a server that accepts and never
//! reads, and a download the laptop never reads. While both are stuck (their
//! senders made no progress for a while), another flow's echo exchanges and a
//! new connection work with every byte intact. Afterwards the stalled flows
//! are read and carry every byte they were given, in order: held back, not
//! dropped or broken. Behaviour only: the bounds are generous timeouts, no
//! throughput or latency figure.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvpn_lab::{BACKEND_1_IP, BACKEND_1_POD, ECHO_PORT};
use kvpn_tests::Fixture;

/// Ports of the test's own servers in the pod netns (the lab's servers use
/// 7007 and 8080).
const SINK_PORT: u16 = 17_101;
const SOURCE_PORT: u16 = 17_102;
/// Bytes each stalled flow is given: far more than every buffer on its path
/// (socket buffers on both ends, the manager's flow window), so its sender
/// really stalls.
const STALLED_BYTES: u64 = 48 << 20;

/// Byte `i` of a stalled flow's stream: a pattern whose period (251) is no
/// divisor of any buffer size, so a lost or repeated chunk shows.
fn pattern(i: u64) -> u8 {
    (i % 251) as u8
}

/// Writes [`STALLED_BYTES`] of the pattern to `s`, counting in `progress`.
fn write_pattern(mut s: TcpStream, progress: &AtomicU64) -> std::io::Result<()> {
    let mut buf = [0u8; 64 * 1024];
    let mut sent = 0u64;
    while sent < STALLED_BYTES {
        let n = (STALLED_BYTES - sent).min(buf.len() as u64) as usize;
        for (j, b) in buf[..n].iter_mut().enumerate() {
            *b = pattern(sent + j as u64);
        }
        s.write_all(&buf[..n])?;
        sent += n as u64;
        progress.store(sent, Ordering::Relaxed);
    }
    s.shutdown(Shutdown::Write)
}

/// Reads `s` to its end, checking the pattern; the byte count.
fn read_pattern(mut s: TcpStream) -> Result<u64, String> {
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .map_err(|e| e.to_string())?;
    let mut buf = [0u8; 64 * 1024];
    let mut got = 0u64;
    loop {
        let n = match s.read(&mut buf) {
            Ok(0) => return Ok(got),
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("read after {got} bytes: {e}")),
        };
        if let Some(j) = (0..n).find(|&j| buf[j] != pattern(got + j as u64)) {
            return Err(format!("byte {} differs", got + j as u64));
        }
        got += n as u64;
    }
}

/// Waits until `progress` has not moved for 2 s (the sender is stuck), at
/// most 60 s; returns where it stopped.
fn wait_stalled(what: &str, progress: &AtomicU64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = progress.load(Ordering::Relaxed);
    let mut since = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = progress.load(Ordering::Relaxed);
        if now != last {
            (last, since) = (now, Instant::now());
        } else if since.elapsed() >= Duration::from_secs(2) {
            assert!(
                last < STALLED_BYTES,
                "{what}: all {STALLED_BYTES} bytes went out, nothing stalled"
            );
            assert!(last > 0, "{what}: not one byte went out");
            return last;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: still sending after 60 s ({last} bytes)"
        );
    }
}

/// `rounds` echo exchanges of growing size on `s`, every byte compared.
fn echo_rounds(s: &mut TcpStream, rounds: usize) -> Result<(), String> {
    for r in 0..rounds {
        let len = 1 + (r * 4093) % 60_000;
        let msg: Vec<u8> = (0..len).map(|i| ((i * 7 + r) % 256) as u8).collect();
        s.write_all(&msg)
            .map_err(|e| format!("round {r}: write: {e}"))?;
        let mut back = vec![0u8; len];
        s.read_exact(&mut back)
            .map_err(|e| format!("round {r}: read {len} bytes: {e}"))?;
        if back != msg {
            return Err(format!("round {r}: the echo differs"));
        }
    }
    Ok(())
}

#[test]
fn a_stalled_flow_does_not_block_others_on_the_same_worker() {
    let f = Fixture::new();
    f.connect_with(&["--workers", "1"]);
    let (sink, source) = f
        .lab
        .run_in(BACKEND_1_POD, || {
            (
                TcpListener::bind((BACKEND_1_IP, SINK_PORT)),
                TcpListener::bind((BACKEND_1_IP, SOURCE_PORT)),
            )
        })
        .unwrap_or_else(|e| panic!("pod netns: {e:#}"));
    let sink = sink.unwrap_or_else(|e| panic!("sink listener: {e}"));
    let source = source.unwrap_or_else(|e| panic!("source listener: {e}"));
    let connect = |port: u16| {
        let addr = SocketAddr::from((BACKEND_1_IP, port));
        f.in_laptop(move || TcpStream::connect_timeout(&addr, Duration::from_secs(10)))
            .unwrap_or_else(|e| panic!("laptop connect to {addr}: {e}"))
    };

    let echo = SocketAddr::from((BACKEND_1_IP, ECHO_PORT));
    let early = f.in_laptop(move || TcpStream::connect_timeout(&echo, Duration::from_secs(10)));

    // Upload: the laptop writes, the pod's sink does not read yet.
    let up = connect(SINK_PORT);
    let (sink_conn, _) = sink.accept().expect("sink accept");
    let up_progress = Arc::new(AtomicU64::new(0));
    let up_writer = {
        let p = up_progress.clone();
        std::thread::spawn(move || write_pattern(up, &p))
    };
    // Download: the pod writes, the laptop does not read yet.
    let down = connect(SOURCE_PORT);
    let (source_conn, _) = source.accept().expect("source accept");
    let down_progress = Arc::new(AtomicU64::new(0));
    let down_writer = {
        let p = down_progress.clone();
        std::thread::spawn(move || write_pattern(source_conn, &p))
    };
    let up_stuck = wait_stalled("upload to the non-reading pod", &up_progress);
    let down_stuck = wait_stalled("download the laptop does not read", &down_progress);

    // Meanwhile, on the same worker: echo exchanges on a flow opened before
    // the stall and on one opened now, every byte intact.
    let other = f.in_laptop(move || -> Result<(), String> {
        let mut before = early.map_err(|e| format!("connect to the echo server: {e}"))?;
        let mut now = TcpStream::connect_timeout(&echo, Duration::from_secs(10))
            .map_err(|e| format!("connect to the echo server during the stall: {e}"))?;
        for s in [&mut before, &mut now] {
            s.set_read_timeout(Some(Duration::from_secs(20)))
                .map_err(|e| e.to_string())?;
            echo_rounds(s, 50)?;
        }
        Ok(())
    });
    if let Err(e) = other {
        panic!(
            "another flow on the same worker failed while two flows were stalled \
             (upload stuck at {up_stuck}, download at {down_stuck} bytes): {e}\ndaemon log:\n{}",
            f.daemon_log()
        );
    }
    // Both stalled senders are still stuck: the echo did not free them.
    assert!(up_progress.load(Ordering::Relaxed) < STALLED_BYTES);
    assert!(down_progress.load(Ordering::Relaxed) < STALLED_BYTES);

    // Release them: every byte arrives, in order.
    let sink_reader = std::thread::spawn(move || read_pattern(sink_conn));
    assert_eq!(
        read_pattern(down),
        Ok(STALLED_BYTES),
        "the download, read at last"
    );
    assert_eq!(
        sink_reader.join().expect("sink reader"),
        Ok(STALLED_BYTES),
        "the upload, read at last"
    );
    up_writer
        .join()
        .expect("upload writer")
        .unwrap_or_else(|e| panic!("upload writer: {e}"));
    down_writer
        .join()
        .expect("download writer")
        .unwrap_or_else(|e| panic!("download writer: {e}"));
}
