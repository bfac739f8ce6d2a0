//! `kvpn ssh` ([ssh] item 5) end to end: the real CLI in the lab's laptop netns logs
//! in to the real OpenSSH sshd in the node netns ([`SshHost`]), driven through a
//! real pty ([`PtyProc`]) for the interactive cases: commands run remotely, the
//! initial window size and a resize reach the remote pty (`stty size`), the exit
//! code comes back, the local terminal is raw during the session and restored
//! after. Without a pty: one-off commands through a two-hop ProxyJump chain with
//! stdout, stderr, stdin and exit codes/signals passed through. Full mode: TUN
//! devices on both sides, pings both ways between the tunnel IPs, a second
//! address pair when the SSH host already holds the first, nothing left after
//! exit, and a clear refusal when the login is not root.
//!
//! Needs the workspace binaries (`cargo build --bins`, then `KVPN_BIN_DIR`) and
//! openssh-server/-client.

use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use kvpn_tests::ssh_term_lab::{PtyProc, SshHost, USER};
use kvpn_tests::text;
use nix::sys::termios::LocalFlags;

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_owned()).collect()
}

/// `kvpn ssh <flags> -- <command>` with pipes, stdin from `input`.
fn one_off(host: &SshHost, flags: &[String], command: &str, input: &str) -> Output {
    let mut args = strings(&["ssh"]);
    args.extend_from_slice(flags);
    args.push("--".into());
    args.push(command.into());
    let mut cmd = host.kvpn_command(&args);
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("spawn kvpn ssh: {e}"));
    if let Some(mut stdin) = child.stdin.take() {
        use std::io::Write as _;
        stdin
            .write_all(input.as_bytes())
            .unwrap_or_else(|e| panic!("stdin: {e}"));
    }
    child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("kvpn ssh: {e}"))
}

fn describe(out: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    )
}

fn is_raw(p: &PtyProc) -> bool {
    let t = p.termios();
    !t.local_flags.contains(LocalFlags::ECHO) && !t.local_flags.contains(LocalFlags::ICANON)
}

#[test]
fn lite_shell_on_a_pty_runs_commands_follows_resizes_and_passes_the_exit_code() {
    let host = SshHost::new();
    let mut args = strings(&["ssh", "--lite"]);
    args.extend(host.ssh_flags("root", &host.addr()));
    let mut p = PtyProc::spawn(host.kvpn_command(&args), 33, 101);
    assert!(!is_raw(&p), "a fresh pty starts in cooked mode");

    // Only the remote shell turns this into KV42 (the echo of the typed line
    // shows the expression).
    p.send("echo KV$((6*7))\r");
    let mut at = p.expect("KV42", 0, Duration::from_secs(20));
    assert!(
        is_raw(&p),
        "the local terminal must be raw during the session"
    );
    // It runs on the SSH host: the node's uplink address is there.
    p.send("echo NS$(ip -o -4 addr show | grep -o 172.31.255.1 | head -n1)X\r");
    at = p.expect("NS172.31.255.1X", at, Duration::from_secs(10));
    p.send("echo TM${TERM}X\r");
    at = p.expect("TMxtermX", at, Duration::from_secs(10));
    // The window size at start.
    p.send("echo SZ$(stty size)Z\r");
    at = p.expect("SZ33 101Z", at, Duration::from_secs(10));

    // A resize reaches the remote pty (SIGWINCH -> window-change).
    p.resize(40, 120);
    let t0 = Instant::now();
    loop {
        p.send("echo SZ$(stty size)Z\r");
        std::thread::sleep(Duration::from_millis(200));
        if p.output()[at..].contains("SZ40 120Z") {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the remote pty never saw the resize to 40x120:\n{}",
            &p.output()[at..]
        );
    }
    eprintln!(
        "remote pty followed the resize within {:.2} s",
        t0.elapsed().as_secs_f64()
    );

    p.send("exit 7\r");
    let status = p.wait(Duration::from_secs(15));
    assert_eq!(
        status.code(),
        Some(7),
        "exit 7 on the remote must make kvpn exit 7:\n{}",
        p.output()
    );
    assert!(
        !is_raw(&p),
        "the local terminal must be restored after the session"
    );
}

#[test]
fn one_off_commands_through_a_proxyjump_chain_pass_output_input_exit_codes_and_signals() {
    let host = SshHost::new();
    // The second hop (127.0.0.1 on the node) is reachable only through the first.
    let jump = format!(
        "--ssh-addr {} --ssh-username root --ssh-keyfile {}",
        host.addr(),
        host.key.display()
    );
    let mut flags = strings(&["--lite"]);
    flags.extend(host.ssh_flags("root", "127.0.0.1:2222"));
    flags.push("--ssh-jump".into());
    flags.push(jump);

    let out = one_off(
        &host,
        &flags,
        "echo out-$((2+3)); echo err-$((3+4)) >&2; exit 3",
        "",
    );
    assert_eq!(out.status.code(), Some(3), "{}", describe(&out));
    assert!(text(&out.stdout).contains("out-5"), "{}", describe(&out));
    assert!(text(&out.stderr).contains("err-7"), "{}", describe(&out));
    assert!(
        !text(&out.stdout).contains("err-7"),
        "stderr must stay apart from stdout without a pty: {}",
        describe(&out)
    );
    let log = host.log();
    assert!(
        log.contains("Accepted publickey for root from 127.0.0.1"),
        "the second hop must be dialled from the first:\n{log}"
    );

    // stdin goes to the remote command, EOF included (tr ends).
    let out = one_off(&host, &flags, "tr a-z A-Z", "hello kvpn\n");
    assert!(out.status.success(), "{}", describe(&out));
    assert_eq!(text(&out.stdout), "HELLO KVPN\n", "{}", describe(&out));

    // Killed by a signal: 128 + n.
    let out = one_off(&host, &flags, "kill -TERM $$", "");
    assert_eq!(out.status.code(), Some(128 + 15), "{}", describe(&out));
}

fn tun_state(host: &SshHost) -> (String, String) {
    (SshHost::addrs(&host.laptop()), SshHost::addrs(&host.node()))
}

fn ping(netns: &kvpn_lab::Netns, ip: &str) -> Output {
    netns
        .exec(&["ping", "-n", "-c", "3", "-i", "0.2", "-W", "2", ip])
        .unwrap_or_else(|e| panic!("ping: {e:#}"))
}

fn no_tunnel_left(host: &SshHost) {
    let (laptop, node) = tun_state(host);
    let links = |n: &kvpn_lab::Netns| {
        text(
            &n.exec(&["ip", "-o", "link", "show"])
                .unwrap_or_else(|e| panic!("ip link: {e:#}"))
                .stdout,
        )
    };
    for (side, addrs, links) in [
        ("laptop", laptop, links(&host.laptop())),
        ("SSH host", node, links(&host.node())),
    ] {
        assert!(
            !links.contains("kvssh"),
            "a kvpn ssh TUN device is left on the {side}:\n{links}"
        );
        assert!(
            !addrs
                .lines()
                .any(|l| l.contains("198.19.") && !l.contains(" lo ")),
            "a tunnel address is left on the {side}:\n{addrs}"
        );
    }
}

#[test]
fn full_mode_joins_laptop_and_host_with_a_tunnel_pinging_both_ways_and_leaves_nothing() {
    let host = SshHost::new();
    let mut args = strings(&["ssh", "--remote-kvpn"]);
    args.push(host.kvpn.to_string_lossy().into_owned());
    args.extend(host.ssh_flags("root", &host.addr()));
    let mut p = PtyProc::spawn(host.kvpn_command(&args), 30, 100);
    let mut at = p.expect(
        "tunnel up: this machine 198.19.0.1",
        0,
        Duration::from_secs(30),
    );
    p.send("echo KV$((6*7))\r");
    at = p.expect("KV42", at, Duration::from_secs(20));

    let (laptop, node) = tun_state(&host);
    assert!(
        laptop.contains("198.19.0.1 peer 198.19.0.2"),
        "laptop TUN:\n{laptop}"
    );
    assert!(
        node.contains("198.19.0.2 peer 198.19.0.1"),
        "SSH host TUN:\n{node}"
    );
    // Both ways, between the tunnel IPs only (the uplink is not in the way: the
    // addresses exist only on the TUN devices).
    let there = ping(&host.laptop(), "198.19.0.2");
    assert!(
        there.status.success(),
        "laptop -> host:\n{}",
        describe(&there)
    );
    let back = ping(&host.node(), "198.19.0.1");
    assert!(
        back.status.success(),
        "host -> laptop:\n{}",
        describe(&back)
    );
    for (what, out) in [("laptop -> host", &there), ("host -> laptop", &back)] {
        if let Some(rtt) = text(&out.stdout).lines().find(|l| l.contains("rtt")) {
            eprintln!("ping {what} over the SSH tunnel: {rtt}");
        }
    }
    // And from the remote shell itself.
    p.send("ping -n -c 1 -W 2 198.19.0.1 >/dev/null && echo PING$((1+1))OK\r");
    p.expect("PING2OK", at, Duration::from_secs(10));

    p.send("exit\r");
    let status = p.wait(Duration::from_secs(20));
    assert_eq!(status.code(), Some(0), "{}", p.output());
    assert!(!is_raw(&p), "terminal restored after a full-mode session");
    // kvpn waits for both peer agents: nothing is left when it has exited.
    no_tunnel_left(&host);
}

#[test]
fn full_mode_takes_the_next_pair_when_the_host_holds_the_first_and_refuses_non_root_clearly() {
    let host = SshHost::new();
    // Another session's address on the SSH host (on its loopback; gone with the lab).
    host.node()
        .ip(&["addr", "add", "198.19.0.2/32", "dev", "lo"])
        .unwrap_or_else(|e| panic!("address on lo: {e:#}"));
    // This time kvpn copies itself to the host (--upload-kvpn).
    let mut flags = strings(&["--upload-kvpn"]);
    flags.extend(host.ssh_flags("root", &host.addr()));
    let t0 = Instant::now();
    let out = one_off(
        &host,
        &flags,
        "ip -o -4 addr show | grep kvssh; ping -n -c 2 -i 0.2 -W 2 198.19.0.5",
        "",
    );
    eprintln!(
        "full-mode one-off command with kvpn copied to the host took {:.2} s",
        t0.elapsed().as_secs_f64()
    );
    assert!(out.status.success(), "{}", describe(&out));
    assert!(
        text(&out.stderr).contains("copying kvpn"),
        "{}",
        describe(&out)
    );
    let cached: Vec<_> = std::fs::read_dir(host.root_home.join(".cache/kvpn"))
        .unwrap_or_else(|e| panic!("no upload cache on the host: {e}"))
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(cached.len(), 1, "one copy, no temporary left: {cached:?}");
    assert_eq!(
        std::fs::read(&cached[0]).ok(),
        std::fs::read(&host.kvpn).ok(),
        "the copy on the host is this kvpn"
    );
    assert!(
        text(&out.stderr).contains("this machine 198.19.0.5"),
        "{}",
        describe(&out)
    );
    assert!(
        text(&out.stdout).contains("198.19.0.6 peer 198.19.0.5"),
        "{}",
        describe(&out)
    );
    no_tunnel_left(&host);
    // The same build is not copied twice.
    let t0 = Instant::now();
    let out = one_off(&host, &flags, "ping -n -c 1 -W 2 198.19.0.5", "");
    eprintln!(
        "the same with kvpn already on the host: {:.2} s",
        t0.elapsed().as_secs_f64()
    );
    assert!(out.status.success(), "{}", describe(&out));
    assert!(
        !text(&out.stderr).contains("copying kvpn"),
        "{}",
        describe(&out)
    );
    no_tunnel_left(&host);

    // Not root on the SSH host: the peer agent cannot create a TUN device.
    let mut flags = strings(&["--remote-kvpn"]);
    flags.push(host.kvpn.to_string_lossy().into_owned());
    flags.extend(host.ssh_flags(USER, &host.addr()));
    let out = one_off(&host, &flags, "true", "");
    assert!(!out.status.success(), "{}", describe(&out));
    let err = text(&out.stderr);
    eprintln!("non-root full mode refused with: {}", err.trim());
    assert!(
        err.contains("needs root") && err.contains("--lite"),
        "the refusal must say root is needed and offer --lite:\n{err}"
    );
    no_tunnel_left(&host);
    // The same login with --lite works (and is that user).
    let mut flags = strings(&["--lite"]);
    flags.extend(host.ssh_flags(USER, &host.addr()));
    let out = one_off(&host, &flags, "id -u", "");
    assert!(out.status.success(), "{}", describe(&out));
    assert_eq!(text(&out.stdout).trim(), "4242", "{}", describe(&out));
}

/// Waits until no tunnel is left (liveness bound `within`).
fn wait_no_tunnel(host: &SshHost, within: Duration) -> Duration {
    let t0 = Instant::now();
    loop {
        let gone = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| no_tunnel_left(host)));
        if gone.is_ok() {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < within,
            "the tunnel was not removed within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_signalled_session_restores_the_terminal_and_removes_the_tunnel() {
    let host = SshHost::new();
    let mut args = strings(&["ssh", "--remote-kvpn"]);
    args.push(host.kvpn.to_string_lossy().into_owned());
    args.extend(host.ssh_flags("root", &host.addr()));

    // SIGTERM: an orderly end, exit 128+15, terminal restored, nothing left.
    let mut p = PtyProc::spawn(host.kvpn_command(&args), 30, 100);
    let at = p.expect("tunnel up", 0, Duration::from_secs(30));
    p.send("echo KV$((6*7))\r");
    p.expect("KV42", at, Duration::from_secs(20));
    assert!(is_raw(&p));
    // SAFETY: kill by pid a process this test started.
    unsafe { libc::kill(p.pid() as i32, libc::SIGTERM) };
    let status = p.wait(Duration::from_secs(20));
    assert_eq!(status.code(), Some(128 + 15), "{}", p.output());
    assert!(!is_raw(&p), "terminal restored after SIGTERM");
    no_tunnel_left(&host);

    // SIGKILL: kvpn cannot clean up, but both peer agents see their stdin close
    // (pipe on the laptop, SSH connection on the host) and take their TUN with them.
    let mut p = PtyProc::spawn(host.kvpn_command(&args), 30, 100);
    p.expect("tunnel up", 0, Duration::from_secs(30));
    let (laptop, node) = tun_state(&host);
    assert!(laptop.contains("198.19.0.1") && node.contains("198.19.0.2"));
    // SAFETY: as above.
    unsafe { libc::kill(p.pid() as i32, libc::SIGKILL) };
    p.wait(Duration::from_secs(10));
    let took = wait_no_tunnel(&host, Duration::from_secs(15));
    eprintln!(
        "both TUN devices gone {:.2} s after kvpn ssh was killed",
        took.as_secs_f64()
    );
}
