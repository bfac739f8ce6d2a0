//! The `kvpn-manager` binary: listens where told, serves a session (hello,
//! heartbeat echo), and exits on SIGTERM.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvpn_proto::frame::{self, Hello, Kind, PROTOCOL_VERSION};

#[test]
fn binary_serves_a_session_and_stops_on_sigterm() {
    let manager = common::ManagerProcess::start(&[]);

    let mut s = TcpStream::connect(manager.addr).expect("connect to the manager");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let hello = Hello::new(PROTOCOL_VERSION, "100.96.0.2".parse().expect("ip"));
    let mut out = Vec::new();
    frame::encode_into(Kind::Hello, &hello.encode().expect("hello"), &mut out).expect("fits");
    frame::encode_into(Kind::Heartbeat, b"12345678", &mut out).expect("fits");
    s.write_all(&out).expect("write");
    let mut buf = Vec::new();
    let start = Instant::now();
    let echoed = loop {
        let mut chunk = [0u8; 64];
        let n = s.read(&mut chunk).expect("read heartbeat echo");
        assert!(n > 0, "manager closed the session");
        buf.extend_from_slice(&chunk[..n]);
        // The manager's first stats frame may come before the echo.
        if let Some(first) = common::take_first_non_stats(&mut buf) {
            break first;
        }
        assert!(start.elapsed() < Duration::from_secs(5));
    };
    assert_eq!(echoed, (Kind::Heartbeat, b"12345678".to_vec()));
    // Close cleanly: FIN, then read what the manager still sends (its stats
    // frames) until it closes too. Closing with unread bytes would send a RST,
    // and the manager would log "session ended" with the reset instead.
    s.shutdown(std::net::Shutdown::Write).expect("shutdown");
    let mut sink = [0u8; 4096];
    loop {
        match s.read(&mut sink) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => panic!("reading until the manager closes: {e}"),
        }
    }
    drop(s);
    // The manager notices the close before it is asked to stop (else SIGTERM may
    // win the race and the close is never logged).
    manager.wait_for_line("session closed by the laptop", Duration::from_secs(5));
    let log = manager.stop();
    assert!(
        log.iter()
            .any(|l| l.contains("session closed by the laptop")),
        "{log:#?}"
    );
    assert!(log.iter().any(|l| l.contains("heartbeats=1")), "{log:#?}");
}

/// The runtime's worker threads (tokio names them `tokio-rt-worker`).
fn tokio_workers(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("task list")
        .filter_map(Result::ok)
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|comm| comm.trim() == "tokio-rt-worker")
        })
        .count()
}

#[test]
fn worker_threads_setting_sizes_the_runtime() {
    for (setting, want) in [("1", 1), ("3", 3)] {
        let manager = common::ManagerProcess::start(&[(
            "KVPN_MANAGER_WORKER_THREADS",
            std::path::Path::new(setting),
        )]);
        // A worker thread names itself once it runs: poll (a CI run read 0 of
        // 1 right after start-up), then check no more appear.
        let t0 = Instant::now();
        let mut seen = tokio_workers(manager.pid());
        while seen < want && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(20));
            seen = tokio_workers(manager.pid());
        }
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(
            tokio_workers(manager.pid()),
            want,
            "--worker-threads {setting} (after {:?})",
            t0.elapsed()
        );
        // Killed on drop: a SIGTERM this early may come before the handler.
        drop(manager);
    }
}

/// `--tcp-window` outside 16 KiB..=16 MiB is refused before anything starts,
/// naming the flag and the range.
#[test]
fn tcp_window_out_of_range_is_refused_with_the_range() {
    for bad in ["100", "33554432", "lots"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvpn-manager"))
            .args(["--tcp-window", bad])
            .output()
            .expect("run kvpn-manager");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {err}");
        assert!(err.contains("--tcp-window"), "{bad}: {err}");
        assert!(
            err.contains("16 KiB to 16 MiB") || err.contains("not a byte count"),
            "{bad}: {err}"
        );
    }
}

/// `--worker-threads` above 256 is refused before any thread starts (a
/// tester's 100000 aborted the manager while it spawned them).
#[test]
fn worker_threads_beyond_the_bound_are_refused() {
    for bad in ["257", "100000", "many"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvpn-manager"))
            .args(["--worker-threads", bad])
            .output()
            .expect("run kvpn-manager");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {err}");
        assert!(err.contains("--worker-threads"), "{bad}: {err}");
    }
}
