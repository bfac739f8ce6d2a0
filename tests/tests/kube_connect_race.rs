//! End-to-end on the Kubernetes lab: `kvpn connect`s that meet (tester findings).
//!
//! - Two `kvpn connect --kubeconfig` started together (same user daemon): both
//!   found no session and both set one up; the second failed with "add route …
//!   File exists". Now one connect runs at a time (flock on `connect.lock` in the
//!   user daemon's folder): the second says "Waiting for another `kvpn connect`
//!   (pid N) to finish", then finds the first one's session, "nothing to do". Three
//!   rounds: no daemon running, after `kvpn quit`, daemons running.
//! - `kvpn quit` during a `kvpn connect` stopped the root daemon, then the connect
//!   started a new one, left running. Now quit interrupts the connect (SIGINT: a
//!   connect is all or nothing), waits for it, and stops the daemons after it.

use std::path::Path;
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use kvpn_tests::kube_lab::KubeFixture;
use kvpn_tests::text;

/// Waits for `child` (its stdout and stderr piped) up to `within`; SIGKILL and a
/// failed test after that, so a regression cannot hang the suite.
fn wait_bounded(child: Child, what: &str, within: Duration) -> Output {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(within) {
        Ok(out) => out.unwrap_or_else(|e| panic!("{what}: {e}")),
        Err(_) => {
            // SAFETY: kill of the pid of our own child, which has not been reaped
            // (wait_with_output has not returned).
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            panic!("{what} did not finish within {within:?}");
        }
    }
}

fn spawn(f: &KubeFixture, args: &[&str]) -> Child {
    f.kvpn_command(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn kvpn {args:?}: {e}"))
}

fn both(out: &Output) -> String {
    format!("{}{}", text(&out.stdout), text(&out.stderr))
}

/// Root daemons (`kvpn-dataplane --runtime-dir <runtime_dir>`) that run.
fn root_daemon_pids(runtime_dir: &Path) -> Vec<u32> {
    let dir = runtime_dir.to_string_lossy().into_owned();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                return false;
            };
            let args: Vec<String> = cmdline
                .split(|b| *b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            let running = std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                s.rsplit_once(") ")
                    .and_then(|(_, r)| r.chars().next())
                    .is_some_and(|c| c != 'Z' && c != 'X')
            });
            running
                && args.first().is_some_and(|a| a.ends_with("kvpn-dataplane"))
                && args.iter().any(|a| a == &dir)
                && !args.iter().any(|a| a == "--repair")
        })
        .collect()
}

#[test]
fn two_connects_started_together_make_one_session_and_both_succeed() {
    let f = KubeFixture::new();
    let kubeconfig = f.user_kubeconfig();
    let args = ["connect", "--kubeconfig", kubeconfig.as_str()];
    for round in 1..=3 {
        let t0 = Instant::now();
        let a = spawn(&f, &args);
        let b = spawn(&f, &args);
        let pids = [a.id(), b.id()];
        let outs = [
            wait_bounded(a, "connect a", Duration::from_secs(120)),
            wait_bounded(b, "connect b", Duration::from_secs(120)),
        ];
        eprintln!(
            "round {round}: both connects done in {:.1} s",
            t0.elapsed().as_secs_f64()
        );
        for (i, out) in outs.iter().enumerate() {
            assert!(
                out.status.success(),
                "round {round}: connect {i} of two started together failed ({}):\n{}\n--- the other:\n{}\n{}",
                out.status,
                both(out),
                both(&outs[1 - i]),
                f.diagnostics()
            );
        }
        // One of them set the session up, the other waited for it and found it.
        let waited: Vec<usize> = (0..2)
            .filter(|&i| both(&outs[i]).contains("nothing to do"))
            .collect();
        assert_eq!(
            waited.len(),
            1,
            "round {round}: exactly one connect finds the other's session:\n{}\n---\n{}",
            both(&outs[0]),
            both(&outs[1])
        );
        let (w, other) = (waited[0], 1 - waited[0]);
        let wanted = format!(
            "Waiting for another `kvpn connect` (pid {}) to finish",
            pids[other]
        );
        assert!(
            both(&outs[w]).contains(&wanted),
            "round {round}: {wanted:?} missing:\n{}",
            both(&outs[w])
        );
        let sessions = f.sessions();
        assert_eq!(
            sessions.len(),
            1,
            "round {round}: exactly one session: {sessions:#?}"
        );
        f.wait_state("connected", Duration::from_secs(15));
        assert_eq!(f.tun_devices().len(), 1, "round {round}: one TUN device");
        match round {
            // The next round starts both daemons again.
            1 => drop(f.kvpn_ok(&["quit"])),
            // The next one finds them running.
            _ => drop(f.kvpn_ok(&["disconnect", "--all"])),
        }
    }
}

#[test]
fn quit_during_a_connect_interrupts_it_and_leaves_no_daemon_running() {
    let f = KubeFixture::new();
    let kubeconfig = f.user_kubeconfig();
    // The first connect installs the traffic manager (seconds: the pod must get
    // ready), so a quit soon after the user daemon is up meets it in mid-connect.
    let connect = spawn(&f, &["connect", "--kubeconfig", &kubeconfig]);
    let connect_pid = connect.id();
    let t0 = Instant::now();
    while f.user_daemon_pids().is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no user daemon within 20 s of connect\n{}",
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let quit = wait_bounded(spawn(&f, &["quit"]), "kvpn quit", Duration::from_secs(60));
    let connect = wait_bounded(connect, "connect", Duration::from_secs(60));
    eprintln!(
        "quit:\n{}\nconnect ({}):\n{}",
        both(&quit),
        connect.status,
        both(&connect)
    );
    assert!(
        quit.status.success(),
        "kvpn quit failed ({}):\n{}\n{}",
        quit.status,
        both(&quit),
        f.diagnostics()
    );
    // Give a connect that went on after quit the time to start daemons again.
    std::thread::sleep(Duration::from_secs(2));
    let roots = root_daemon_pids(f.runtime_dir());
    let users = f.user_daemon_pids();
    assert!(
        roots.is_empty() && users.is_empty(),
        "daemons left running after `kvpn quit` met a connect: root {roots:?}, user {users:?}\n{}",
        f.diagnostics()
    );
    assert!(f.tun_devices().is_empty(), "{:?}", f.tun_devices());
    assert!(
        both(&quit).contains(&format!("Interrupting `kvpn connect` (pid {connect_pid})")),
        "quit names the connect it interrupts:\n{}",
        both(&quit)
    );
    assert!(
        !connect.status.success(),
        "the interrupted connect says it did not connect: {}\n{}",
        connect.status,
        both(&connect)
    );
    // And kvpn works afterwards.
    f.connect_restricted();
    f.wait_state("connected", Duration::from_secs(15));
}
