//! The `kvpn-manager` binary: listens where told, serves a session (hello,
//! heartbeat echo), and exits on SIGTERM.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvpn_proto::frame::{self, Decoder, Hello, Kind, PROTOCOL_VERSION};

/// Kills the manager if the test fails before it exits.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn binary_serves_a_session_and_stops_on_sigterm() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvpn-manager"))
        .args(["--listen", "127.0.0.1:0"])
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kvpn-manager");
    let stderr = child.stderr.take().expect("stderr");
    let guard = KillOnDrop(child);
    // Read the log on a thread (forwarding lines), so the manager never blocks
    // on a full pipe and the test cannot hang on a missing line.
    let (line_tx, line_rx) = std::sync::mpsc::channel::<String>();
    let log = std::thread::spawn(move || {
        let mut all = Vec::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = line_tx.send(line.clone());
            all.push(line);
        }
        all
    });
    let addr = loop {
        let line = line_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("kvpn-manager did not log its listening address");
        if let Some(rest) = line.split("listen=").nth(1) {
            break rest.split_whitespace().next().expect("address").to_string();
        }
    };
    let mut child = guard;

    let mut s = TcpStream::connect(&addr).expect("connect to the manager");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let hello = Hello {
        version: PROTOCOL_VERSION,
        tunnel_ip: "100.96.0.2".parse().expect("ip"),
        token: Vec::new(),
        mtu: None,
        tunnel_ip_v6: None,
        offloads: None,
        shard: None,
        resume_token: None,
    };
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
        let mut first = None;
        while let Some((f, used)) = Decoder::default().decode(&buf).expect("valid frame") {
            if f.kind != Kind::Stats {
                first = Some((f.kind, f.payload.to_vec()));
                break;
            }
            buf.drain(..used);
        }
        if let Some(first) = first {
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
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match line_rx.recv_timeout(left) {
            Ok(l) if l.contains("session closed by the laptop") => break,
            Ok(_) => {}
            Err(e) => panic!("kvpn-manager never logged the laptop's close: {e}"),
        }
    }

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.0.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let deadline = Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(st) = child.0.try_wait().expect("wait") {
            break st;
        }
        assert!(Instant::now() < deadline, "kvpn-manager ignored SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "exit status {status}");
    let log = log.join().expect("log thread");
    assert!(
        log.iter()
            .any(|l| l.contains("session closed by the laptop")),
        "{log:#?}"
    );
    assert!(log.iter().any(|l| l.contains("heartbeats=1")), "{log:#?}");
}
