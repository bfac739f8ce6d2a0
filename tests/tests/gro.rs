//! Issue [fastpath], manager → laptop GSO frames (offload bit 2 of hello
//! option 4): the laptop's pump offers them (its TUN has `IFF_VNET_HDR`), the
//! manager merges a TCP flow's segments into super-packets, and the pump
//! writes each to the real kernel TUN with its `virtio_net_hdr` in one write.
//! A 64 MB download through kvpn arrives intact (sha256), and `kvpn status`
//! counts the GSO frames the pump wrote.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use kvpn_lab::{BACKEND_1_IP, ECHO_PORT};
use kvpn_tests::{Fixture, text};
use sha2::{Digest, Sha256};

#[test]
fn download_arrives_intact_in_gso_frames_written_to_the_tun() {
    const LEN: u64 = 64 * 1024 * 1024;
    let f = Fixture::connected();
    let before = f.status_json();
    assert!(
        before["sessions"][0]["rx"]["gso_frames"].is_u64(),
        "no rx.gso_frames in status: {before}"
    );
    let addr = SocketAddr::from((BACKEND_1_IP, ECHO_PORT));
    let (n, digest) = f.in_laptop(move || {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        s.write_all(format!("WRITE {LEN} CLOSE\n").as_bytes())
            .expect("command");
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 256 * 1024];
        let mut n = 0u64;
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(k) => {
                    hasher.update(&buf[..k]);
                    n += k as u64;
                }
                Err(e) => panic!("read after {n} bytes: {e}"),
            }
        }
        (n, hasher.finalize())
    });
    assert_eq!(
        n,
        LEN,
        "bytes before EOF\ndaemon log:\n{}\nmanager log:\n{}",
        f.daemon_log(),
        f.manager_log()
    );
    assert_eq!(
        digest[..],
        kvpn_lab::payload::sha256(LEN)[..],
        "sha256 of the {LEN}-byte download"
    );
    let status = f.status_json();
    let s = &status["sessions"][0];
    let delta = |field: &str| {
        s["rx"][field].as_u64().unwrap_or(0)
            - before["sessions"][0]["rx"][field].as_u64().unwrap_or(0)
    };
    let (frames, packets, bytes) = (delta("gso_frames"), delta("packets"), delta("bytes"));
    eprintln!("{LEN} bytes: {bytes} bytes in {packets} TUN writes, {frames} of them GSO frames");
    assert!(
        frames > 0,
        "no GSO frames written to the TUN: {s}\ndaemon log:\n{}\nmanager log:\n{}",
        f.daemon_log(),
        f.manager_log()
    );
    // A super-packet counts once in rx.packets: writes average more than
    // the TUN's 9000-byte MTU only when most of them were super-packets.
    assert!(
        bytes / packets > 9000,
        "{bytes} bytes in {packets} TUN writes ({frames} GSO frames): segments were not merged: {s}"
    );
    // rx.gso_segments counts what the super-packets carried (each merged at
    // least two segments); the table's RX PKTS counts those segments and an
    // offloads line shows the frames (the table showed TUN writes and no
    // GSO count before).
    let segments = delta("gso_segments");
    assert!(
        segments >= 2 * frames,
        "{segments} segments in {frames} GSO frames: {s}"
    );
    let table = text(&f.kvpn(&["status"]).stdout);
    let rx = |s: &serde_json::Value, field: &str| s["rx"][field].as_u64().unwrap_or(0);
    let rx_segments = rx(s, "packets") - rx(s, "gso_frames") + rx(s, "gso_segments");
    let id = s["id"].as_str().unwrap_or_default();
    let shown: u64 = table
        .lines()
        .find(|l| l.starts_with(id))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|c| c.split('/').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no RX PKTS for {id}:\n{table}"));
    // At least what the JSON said before (more may have come since).
    assert!(
        shown >= rx_segments && shown > rx(s, "packets"),
        "RX PKTS {shown}: segments {rx_segments}, TUN writes {}:\n{table}",
        rx(s, "packets")
    );
    assert!(table.contains("offloads: tx "), "{table}");
}
