//! Flows survive a re-dial of the data connection (hello option 5, resume
//! tokens): a receive-only download (`curl --limit-rate`, nothing it sends
//! would draw a reset) is in progress through the real TUN, root daemon and
//! smoltcp manager of the plain lab when the laptop's data connection is
//! killed (`ss -K`). The laptop re-dials with its worker's resume token, the
//! manager re-attaches the parked engine, and the download completes intact
//! (sha256), with `kvpn status` and the manager's metrics showing one resume.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use kvpn_lab::{BACKEND_1_IP, HTTP_PORT, LAPTOP};
use kvpn_tests::{Fixture, text};

const METRICS_PORT: u16 = 10804;

/// A command of the test running in its own process group, killed (the whole
/// group) on drop unless waited for.
struct Spawned(Option<Child>);

impl Drop for Spawned {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            // The group: bash and the curl it started.
            let pgid = child.id() as i32;
            // SAFETY: kill(2) with a process group id we created; no memory involved.
            unsafe {
                libc::kill(-pgid, libc::SIGKILL);
            }
            let _ = child.wait();
        }
    }
}

fn manager_metric(f: &Fixture, name: &str) -> u64 {
    f.manager_metric(METRICS_PORT, name)
}

#[test]
fn receive_only_download_survives_a_killed_data_connection() {
    download_survives_killed_connections(1);
}

/// `--workers 2`: both workers' data connections are killed at once; each
/// re-dials with its own token and resumes its own engine.
#[test]
fn receive_only_download_survives_with_two_workers_both_killed() {
    download_survives_killed_connections(2);
}

fn download_survives_killed_connections(workers: u16) {
    let f = Fixture::with_manager_args(&["--metrics-listen", &format!("127.0.0.1:{METRICS_PORT}")]);
    f.connect_with(&["--workers", &workers.to_string()]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while f.status_json()["sessions"][0]["workers_connected"] != u64::from(workers) {
        assert!(
            Instant::now() < deadline,
            "not all {workers} workers connected\n{}",
            f.daemon_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // 3 MiB at 256 KiB/s: about 12 s, receive-only.
    let len: u64 = 3 * 1024 * 1024;
    let url = format!("http://{BACKEND_1_IP}:{HTTP_PORT}/big?bytes={len}");
    let mut cmd = f
        .lab
        .command_in(LAPTOP, "bash")
        .unwrap_or_else(|e| panic!("laptop netns: {e:#}"));
    cmd.args([
        "-c",
        &format!("curl -sS --limit-rate 256k --max-time 60 {url} | sha256sum"),
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .process_group(0);
    let mut download = Spawned(Some(cmd.spawn().expect("spawn curl")));

    // Wait until the download is well under way.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let rx = f.status_json()["sessions"][0]["rx"]["bytes"]
            .as_u64()
            .unwrap_or(0);
        if rx > 500_000 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the download did not start: {rx} bytes received\n{}",
            f.daemon_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // Kill every data connection; each worker re-dials.
    let manager = kvpn_lab::MANAGER_ADDR_FROM_LAPTOP.to_string();
    let killed = f.laptop(&["ss", "-K", "-Htn", "state", "established", "dst", &manager]);
    assert!(
        killed.status.success() && text(&killed.stdout).lines().count() == usize::from(workers),
        "ss -K did not kill the {workers} data connections: {} {}",
        text(&killed.stdout),
        text(&killed.stderr)
    );

    let out = download
        .0
        .take()
        .expect("download running")
        .wait_with_output()
        .expect("curl finished");
    let got = text(&out.stdout);
    let got = got.split_whitespace().next().unwrap_or_default();
    assert!(
        out.status.success() && got == kvpn_lab::payload::sha256_hex(len),
        "the download did not complete intact after the re-dial (sha256 {got}): {}\ndaemon log:\n{}\nmanager log:\n{}",
        text(&out.stderr),
        f.daemon_log(),
        f.manager_log()
    );

    let n = u64::from(workers);
    let session = f.status_json()["sessions"][0].clone();
    assert_eq!(session["liveness"]["transports_lost"], n, "{session}");
    assert_eq!(session["resumes"], n, "{session}");
    assert_eq!(session["resumes_lost"], 0, "{session}");
    let table = text(&f.kvpn(&["status"]).stdout);
    assert!(
        table.contains(&format!("re-dials: {n} resumed their flows, 0 lost them")),
        "the status table shows the resumes: {table}"
    );
    for w in 0..workers {
        assert!(
            f.daemon_log()
                .contains(&format!("worker {w} resumed its flows after a re-dial")),
            "{}",
            f.daemon_log()
        );
    }
    assert_eq!(manager_metric(&f, "engines_resumed_total"), n);
    assert_eq!(manager_metric(&f, "engines_parked_total"), n);
    assert_eq!(manager_metric(&f, "engines_parked"), 0);

    // A deliberate disconnect tells the manager the worker is leaving: its
    // engine is dropped at once, not parked for a resume.
    f.disconnect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while manager_metric(&f, "sessions_active") > 0 {
        assert!(
            Instant::now() < deadline,
            "the manager's session did not end after the disconnect"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        manager_metric(&f, "engines_parked_total"),
        n,
        "nothing parked on disconnect\n{}",
        f.manager_log()
    );
    assert_eq!(manager_metric(&f, "engines_parked"), 0);
}
