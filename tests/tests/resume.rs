//! Flows survive a re-dial of the data connection (hello option 5, resume
//! tokens): a receive-only download (`curl --limit-rate`, nothing it sends
//! would draw a reset) is in progress through the real TUN, root daemon and
//! smoltcp manager of the plain lab when the laptop's data connection is
//! killed (`ss -K`). The laptop re-dials with its worker's resume token, the
//! manager re-attaches the parked engine, and the download completes intact
//! (sha256), with `kvpn status` and the manager's metrics showing one resume.

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::process::Stdio;
use std::time::{Duration, Instant};

use kvpn_lab::{BACKEND_1_IP, HTTP_PORT, LAPTOP};
use kvpn_tests::{Fixture, Paused, Spawned, text};

const METRICS_PORT: u16 = 10804;

fn manager_metric(f: &Fixture, name: &str) -> u64 {
    f.manager_metric(METRICS_PORT, name)
}

/// Waits up to 10 s until all `workers` of the session are connected.
fn wait_workers_connected(f: &Fixture, workers: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while f.status_json()["sessions"][0]["workers_connected"] != u64::from(workers) {
        assert!(
            Instant::now() < deadline,
            "not all {workers} workers connected\n{}",
            f.daemon_log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
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
    wait_workers_connected(&f, workers);
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
    kill_data_connections(&f, workers);

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

/// Kills the laptop's `workers` data connections with `ss -K`.
fn kill_data_connections(f: &Fixture, workers: u16) {
    let manager = kvpn_lab::MANAGER_ADDR_FROM_LAPTOP.to_string();
    let killed = f.laptop(&["ss", "-K", "-Htn", "state", "established", "dst", &manager]);
    assert!(
        killed.status.success() && text(&killed.stdout).lines().count() == usize::from(workers),
        "ss -K did not kill the {workers} data connections: {} {}",
        text(&killed.stdout),
        text(&killed.stderr)
    );
}

/// A re-dial that cannot resume (`--resume-grace-ms 0`: the manager drops a
/// lost connection's engine at once and answers "new") resets the flows the
/// worker carried on the laptop: a download whose server went quiet (curl
/// waits for the rest, and its socket sends nothing that would draw a RST
/// from the new engine) ends with "connection reset" at once instead of
/// hanging until curl's own timeout (exit 28 after 45 s). Only live flows
/// are reset and counted: 20 connections that ended normally and 3 that the
/// application aborted (curl's timeout on a rate-limited download: closed
/// with unread data, a RST) before it are not (on main the close's last
/// ACK put each normally closed one back in the worker's table: the count was 21).
#[test]
fn waiting_download_is_reset_when_the_redial_cannot_resume() {
    let f = Fixture::with_manager_args(&["--resume-grace-ms", "0"]);
    f.connect();
    let finished = f.laptop(&[
        "bash",
        "-c",
        &format!(
            "set -u; url=http://{BACKEND_1_IP}:{HTTP_PORT}/big
            for i in $(seq 20); do curl -sS -o /dev/null --max-time 5 \"$url?bytes=1000\" || exit 1; done
            for i in 1 2 3; do
              curl -sS -o /dev/null --max-time 1 --limit-rate 20k \"$url?bytes=10000000\"
              [ $? = 28 ] || exit 2
            done"
        ),
    ]);
    assert!(
        finished.status.success(),
        "the short connections: {:?} {}",
        finished.status,
        text(&finished.stderr)
    );
    // A server in the backend pod that sends the head and 64 KiB of a 1 MiB
    // body, then nothing, holding the connection until its peer closes.
    let listener = f
        .lab
        .run_in(kvpn_lab::BACKEND_1_POD, || {
            std::net::TcpListener::bind((BACKEND_1_IP, 0)).expect("bind in the backend pod")
        })
        .unwrap_or_else(|e| panic!("backend netns: {e:#}"));
    let port = listener.local_addr().expect("local address").port();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let mut request = [0u8; 1024];
        let _ = s.read(&mut request);
        let head = "HTTP/1.1 200 OK\r\nContent-Length: 1048576\r\n\r\n";
        s.write_all(head.as_bytes()).expect("head");
        s.write_all(&[7u8; 65536]).expect("part of the body");
        s.set_read_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        // Until the manager's side closes (or 60 s).
        let _ = s.read(&mut request);
    });
    let url = format!("http://{BACKEND_1_IP}:{port}/");
    let mut download = f.spawn_in_laptop(&format!("curl -sS --max-time 45 -o /dev/null {url}"));
    let deadline = Instant::now() + Duration::from_secs(15);
    while f.status_json()["sessions"][0]["rx"]["bytes"]
        .as_u64()
        .unwrap_or(0)
        < 65536
    {
        assert!(
            Instant::now() < deadline,
            "the download did not start\n{}",
            f.daemon_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Everything sent was delivered and acknowledged: the flow is quiet.
    std::thread::sleep(Duration::from_millis(300));

    kill_data_connections(&f, 1);
    let killed_at = Instant::now();
    let mut child = download.0.take().expect("download running");
    let status = loop {
        if let Some(status) = child.try_wait().expect("curl status") {
            break status;
        }
        // Well under curl's 45 s: the old behaviour waits for all of it.
        assert!(
            killed_at.elapsed() < Duration::from_secs(20),
            "curl still waits {:?} after the data connection was killed\ndaemon log:\n{}",
            killed_at.elapsed(),
            f.daemon_log()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = killed_at.elapsed();
    let out = child.wait_with_output().expect("curl output");
    let stderr = text(&out.stderr);
    assert_eq!(
        status.code(),
        Some(56),
        "curl must fail with a receive error (56), not time out (28): {stderr}\ndaemon log:\n{}",
        f.daemon_log()
    );
    assert!(stderr.contains("reset"), "{stderr}");
    eprintln!("curl reset {took:?} after the kill: {stderr}");

    let session = f.status_json()["sessions"][0].clone();
    assert_eq!(session["resumes_lost"], 1, "{session}");
    assert_eq!(session["resumes"], 0, "{session}");
    assert_eq!(
        session["tcp_flows_reset"], 1,
        "only the waiting download was live: {session}"
    );
    assert!(
        f.daemon_log()
            .contains("reset the TCP flows the lost data connection carried"),
        "{}",
        f.daemon_log()
    );
    let _ = server.join();
    // The session goes on: a new connection works on the new engine.
    let again = f.laptop(&[
        "curl",
        "-sS",
        "--max-time",
        "10",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        &format!("http://{BACKEND_1_IP}:{HTTP_PORT}/big?bytes=1000"),
    ]);
    assert_eq!(text(&again.stdout), "200", "{}", text(&again.stderr));
}

/// New connections opened back to back across a kill of every data
/// connection (`--workers 4`, resumable re-dials) all succeed: while a worker
/// re-dials, its packets are held and sent after the re-dial instead of being
/// answered with ICMP unreachable ("No route to host").
#[test]
fn back_to_back_connections_across_a_redial_all_succeed() {
    let workers = 4u16;
    let f = Fixture::new();
    f.connect_with(&["--workers", &workers.to_string()]);
    wait_workers_connected(&f, workers);
    // Twelve loops of back-to-back curls at once, so that new connections
    // fall into every worker's few milliseconds of re-dial.
    let log = f.lab.dir().join("kvpn-curls.log");
    let (loops, per_loop) = (12, 34);
    let total = loops * per_loop;
    let url = format!("http://{BACKEND_1_IP}:{HTTP_PORT}/big?bytes=100");
    let one_loop = format!(
        "for i in $(seq {per_loop}); do \
           curl -sS --max-time 10 -o /dev/null -w '%{{http_code}}\\n' {url} >> {log} 2>&1 \
             || echo \"FAIL $i\" >> {log}; \
         done",
        log = log.display()
    );
    let mut curls = f.spawn_in_laptop(&format!(
        "{} wait",
        format!("( {one_loop} ) & ").repeat(loops)
    ));
    let lines = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .count()
    };
    // Kill every data connection three times while the connections go on.
    for at in [60, 160, 260] {
        let deadline = Instant::now() + Duration::from_secs(60);
        while lines() < at {
            assert!(Instant::now() < deadline, "curls stalled at {}", lines());
            std::thread::sleep(Duration::from_millis(5));
        }
        // The manager pauses for 300 ms around the kill (as a loaded node
        // or a slow port-forward would): every worker's re-dial connects (the
        // kernel accepts) but waits that long for its answer, so connects
        // fall into the re-dial instead of into its few milliseconds.
        let paused = Paused::manager(&f);
        kill_data_connections(&f, workers);
        std::thread::sleep(Duration::from_millis(300));
        drop(paused);
        // Until all workers are back (the next kill needs all four).
        wait_workers_connected(&f, workers);
    }
    let out = curls
        .0
        .take()
        .expect("curls running")
        .wait_with_output()
        .expect("curl loop finished");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let results = std::fs::read_to_string(&log).expect("curl log");
    let failed: Vec<&str> = results.lines().filter(|l| *l != "200").collect();
    let session = f.status_json()["sessions"][0].clone();
    assert!(
        failed.is_empty() && results.lines().count() == total,
        "{} of {total} connections failed across the re-dials: {failed:?}\nstatus: {session}\ndaemon log:\n{}",
        failed.len(),
        f.daemon_log()
    );
    let n = 3 * u64::from(workers);
    assert_eq!(session["liveness"]["transports_lost"], n, "{session}");
    assert_eq!(session["resumes"], n, "{session}");
    eprintln!(
        "held packets: {}, refused: {}",
        session["held_packets"], session["liveness"]["refused_packets"]
    );
    assert!(
        session["held_packets"].as_u64().unwrap_or(0) > 0,
        "connections fell into the re-dials and were held: {session}"
    );
}
