//! Issue #8, busy RTT (docs/queues.md, "Small packets behind bulk data"): the
//! traffic manager sizes the receive window of a data connection's TCP flows
//! from the connection's round trip (`kvpn_manager::window`). The static lab's
//! direct transport is a veth path of tens of µs, so a flow through it is
//! offered the floor, 256 KiB, not `--tcp-window` (512 KiB): what the laptop's
//! kernel reads as the flow's send window after the manager's first ACK.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use kvpn_lab::{BACKEND_1_IP, ECHO_PORT};
use kvpn_manager::window::MIN_TCP_WINDOW;
use kvpn_tests::{Fixture, text};

/// `snd_wnd:<n>` of the laptop's connection to `dst` (`ss -tni` in its netns).
fn send_window(f: &Fixture, dst: SocketAddr) -> u64 {
    let out = f.laptop(&[
        "ss",
        "-tniH",
        "state",
        "established",
        "dst",
        &dst.to_string(),
    ]);
    let ss = text(&out.stdout);
    ss.split_whitespace()
        .find_map(|w| w.strip_prefix("snd_wnd:"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no snd_wnd for {dst} in `ss -tni`:\n{ss}"))
}

#[test]
fn a_flow_over_a_short_direct_path_is_offered_the_floor_window() {
    let f = Fixture::connected();
    let dst = SocketAddr::from((BACKEND_1_IP, ECHO_PORT));
    // One echo round trip: the manager's ACK of it carries the scaled window
    // (the SYN-ACK's is capped at 65535 whatever the buffer).
    let stream = f.in_laptop(move || {
        let mut s = TcpStream::connect_timeout(&dst, Duration::from_secs(5)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        s.write_all(b"ping\n").expect("write");
        let mut echo = [0u8; 5];
        s.read_exact(&mut echo).expect("echo");
        assert_eq!(&echo, b"ping\n");
        s
    });
    let window = send_window(&f, dst);
    let log = f.manager_log();
    assert!(
        window <= MIN_TCP_WINDOW as u64 && window > MIN_TCP_WINDOW as u64 / 2,
        "send window {window} through the lab's direct transport, want ~{MIN_TCP_WINDOW}\nmanager log:\n{log}"
    );
    assert!(
        log.contains(&format!("tcp_window={MIN_TCP_WINDOW}")),
        "the session's flow window is not logged\nmanager log:\n{log}"
    );
    drop(stream);
}
