//! SSH jump hosts for the API server ([ssh] items 1–3, cases ssh-01, ssh-02, ssh-03)
//! end to end: the Kubernetes lab's laptop cannot reach the API server
//! (172.31.255.1:6443 rejected by nftables), bastion netns run the real OpenSSH sshd,
//! and `kvpn connect --ssh-…` installs the manager, leases, detects CIDRs and carries
//! the session's port-forwards through the SSH path. Traffic to the web ClusterIP
//! then works from the laptop.
//!
//! Kerberos logins (item 3) use a real MIT KDC ([`Kdc`]) and sshd with
//! `GSSAPIAuthentication yes`.
//!
//! Needs the workspace binaries (`cargo build --bins`, then `KVPN_BIN_DIR`), the
//! Kubernetes binaries of `scripts/build-kubernetes.sh`, openssh-server/-client and
//! krb5-kdc, krb5-admin-server, krb5-user.

use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use kvpn_tests::krb5_lab::{Kdc, REALM};
use kvpn_tests::kube_lab::{KubeFixture, web};
use kvpn_tests::ssh_lab::{PASSWORD, SshLab, ok};
use kvpn_tests::text;

fn fails(out: Output, what: &str) -> String {
    assert!(
        !out.status.success(),
        "{what} should fail but succeeded:\n{}",
        text(&out.stdout)
    );
    text(&out.stderr)
}

fn args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn disconnect(fx: &KubeFixture, lab: &SshLab) {
    ok(
        lab.kvpn(fx, &["disconnect", "--all"], None),
        "disconnect",
        fx,
        lab,
    );
}

/// `kvpn connect --kubeconfig <user's> <extra>`.
fn connect(fx: &KubeFixture, lab: &SshLab, extra: &[&str], agent: Option<&Path>) -> Output {
    let kubeconfig = fx.user_kubeconfig();
    let mut args = vec!["connect", "--kubeconfig", kubeconfig.as_str()];
    args.extend_from_slice(extra);
    lab.kvpn(fx, &args, agent)
}

#[test]
fn tr_08_password_login_through_a_bastion_then_the_ssh_connection_killed_five_times() {
    let mut fx = KubeFixture::new();
    let lab = SshLab::new(&mut fx, 1);
    assert!(
        !lab.laptop_reaches_api_directly(&fx),
        "the laptop must not reach the API server except through SSH"
    );
    // Without SSH the API server is out of reach.
    let direct = fails(connect(&fx, &lab, &[], None), "connect without SSH");
    assert!(direct.contains("172.31.255.1"), "{direct}");

    let kh = lab.known_hosts_all();
    let b = &lab.bastions[0];
    let ssh_addr = b.ssh_addr();
    let kh_s = kh.to_string_lossy().into_owned();
    let t0 = Instant::now();
    let out = ok(
        connect(
            &fx,
            &lab,
            &[
                "--ssh-addr",
                &ssh_addr,
                "--ssh-username",
                "root",
                "--ssh-password",
                PASSWORD,
                "--ssh-known-hosts",
                &kh_s,
            ],
            None,
        ),
        "connect through the bastion with a password",
        &fx,
        &lab,
    );
    eprintln!(
        "connect through 1 bastion (password) took {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    assert!(out.contains("Connected"), "{out}");
    let page = fx.page(web());
    assert!(!page.pod.is_empty(), "{page:?}");
    assert!(
        b.log().contains("Accepted password for root"),
        "sshd saw no password login:\n{}",
        b.log()
    );

    // tr-08 over SSH: the agent's SSH connection (the only one left: the CLI
    // exited) is killed five times in a row; each time traffic is back within
    // 3 s on the same TUN device and session, through a new SSH connection.
    let s0 = fx.session();
    let tun_name = s0["tun_name"].as_str().unwrap_or_default().to_owned();
    let tun0 = fx.tun_state(&tun_name);
    let mut times = Vec::new();
    for round in 0..5 {
        let before = b.connection_pids();
        assert!(
            !before.is_empty(),
            "round {round}: no SSH connection of the agent on the bastion:\n{}",
            b.log()
        );
        for pid in &before {
            // SAFETY: kill by pid a child process of the sshd this test started.
            unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
        }
        let killed = Instant::now();
        let (took, page) = fx.wait_http(web(), killed, Duration::from_secs(30));
        times.push(took);
        assert!(!page.pod.is_empty());
        let after = b.connection_pids();
        assert!(
            after.iter().all(|p| !before.contains(p)) && !after.is_empty(),
            "round {round}: a new SSH connection must replace the killed one: before {before:?}, after {after:?}"
        );
        assert_eq!(
            fx.tun_state(&tun_name),
            tun0,
            "round {round}: same TUN device"
        );
        assert_eq!(fx.session()["id"], s0["id"], "round {round}: same session");
        // The next kill must find the new connection settled.
        fx.wait_state("connected", Duration::from_secs(15));
    }
    eprintln!("tr-08 (SSH) traffic back after each kill of the SSH connection: {times:?}");
    for (round, d) in times.iter().enumerate() {
        assert!(
            *d < Duration::from_secs(3),
            "round {round}: traffic took {d:?} to recover (tr-08: < 3 s)"
        );
    }
    fx.wait_state("connected", Duration::from_secs(15));
    let agent_log = fx.diagnostics();
    assert!(
        agent_log.contains("SSH connection died"),
        "the agent never noticed the SSH connection dying:\n{agent_log}"
    );
}

#[test]
fn key_file_and_agent_held_encrypted_key_and_ssh_02_without_agent_fails_at_once() {
    let mut fx = KubeFixture::new();
    let mut lab = SshLab::new(&mut fx, 1);
    let kh = lab.known_hosts_all().to_string_lossy().into_owned();
    let ssh_addr = lab.bastions[0].ssh_addr();
    let key = lab.key.to_string_lossy().into_owned();
    let enc = lab.encrypted_key.to_string_lossy().into_owned();
    let base = |k: &str| -> Vec<String> {
        [
            "--ssh-addr",
            &ssh_addr,
            "--ssh-username",
            "root",
            "--ssh-keyfile",
            k,
            "--ssh-known-hosts",
            &kh,
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect()
    };

    // A plain key file.
    let plain = base(&key);
    ok(
        connect(&fx, &lab, &args(&plain), None),
        "connect with a key file",
        &fx,
        &lab,
    );
    assert!(!fx.page(web()).pod.is_empty());
    assert!(
        lab.bastions[0]
            .log()
            .contains("Accepted publickey for root"),
        "{}",
        lab.bastions[0].log()
    );
    disconnect(&fx, &lab);

    // ssh-02: a passphrase-protected key, no agent, no terminal: fails at once, clearly.
    let encrypted = base(&enc);
    let t0 = Instant::now();
    let err = fails(
        connect(&fx, &lab, &args(&encrypted), None),
        "connect with an encrypted key and no agent",
    );
    let took = t0.elapsed();
    eprintln!(
        "ssh-02: encrypted key without agent refused after {:.2} s",
        took.as_secs_f64()
    );
    assert!(
        took < Duration::from_secs(10),
        "must fail at once, took {took:?}"
    );
    assert!(
        err.contains("passphrase") && err.contains("ssh-add") && err.contains(&enc),
        "{err}"
    );
    assert!(err.contains("SSH_AUTH_SOCK is not set"), "{err}");

    // The same key loaded into ssh-agent (ssh-add with the passphrase): works.
    let sock = lab.start_agent();
    ok(
        connect(&fx, &lab, &args(&encrypted), Some(&sock)),
        "connect with an agent-held encrypted key",
        &fx,
        &lab,
    );
    assert!(!fx.page(web()).pod.is_empty());
    let log = lab.bastions[0].log();
    assert!(
        log.matches("Accepted publickey for root").count() >= 2,
        "the agent's key never logged in:\n{log}"
    );
}

#[test]
fn ssh_01_alias_with_a_three_hop_proxyjump_chain_and_a_cycle_refused() {
    let mut fx = KubeFixture::new();
    let lab = SshLab::new(&mut fx, 3);
    // Each bastion is reachable only from the one before it.
    let b2 = lab.bastions[1].addr.clone();
    let reach = fx.laptop(&["ping", "-c1", "-W1", &b2]);
    assert!(
        !reach.status.success(),
        "the laptop must not reach hop 2 ({b2}) directly"
    );

    let kh = lab.known_hosts_all().to_string_lossy().into_owned();
    let key = lab.key.display().to_string();
    let [h1, h2, h3] = [0, 1, 2].map(|i| lab.bastions[i].addr.clone());
    // Alias names that no DNS knows: only the config gives their addresses.
    let config = format!(
        "Host kvpn-target-x9\n  HostName {h3}\n  Port 2222\n  User root\n  ProxyJump kvpn-hop2-x9\n\
         \nHost kvpn-hop2-x9\n  HostName {h2}\n  Port 2222\n  ProxyJump kvpn-hop1-x9\n\
         \nHost kvpn-hop1-x9\n  HostName {h1}\n  Port 2222\n\
         \nHost kvpn-list-x9\n  HostName {h3}\n  Port 2222\n  ProxyJump kvpn-bare1-x9,kvpn-bare2-x9\n\
         \nHost kvpn-bare1-x9\n  HostName {h1}\n  Port 2222\n\
         \nHost kvpn-bare2-x9\n  HostName {h2}\n  Port 2222\n\
         \nHost kvpn-loop-a\n  HostName {h1}\n  ProxyJump kvpn-loop-b\n\
         \nHost kvpn-loop-b\n  HostName {h2}\n  ProxyJump kvpn-loop-a\n\
         \nHost *\n  User root\n  IdentityFile {key}\n"
    );
    let cfg = lab.dir.join("ssh_config");
    std::fs::write(&cfg, config).unwrap_or_else(|e| panic!("{e}"));
    let cfg = cfg.to_string_lossy().into_owned();

    let t0 = Instant::now();
    let out = ok(
        connect(
            &fx,
            &lab,
            &[
                "--ssh-alias",
                "kvpn-target-x9",
                "--ssh-config",
                &cfg,
                "--ssh-known-hosts",
                &kh,
            ],
            None,
        ),
        "connect through a 3-hop ProxyJump chain",
        &fx,
        &lab,
    );
    eprintln!(
        "connect through 3 bastions (ProxyJump chain) took {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    assert!(out.contains("Connected"), "{out}");
    assert!(!fx.page(web()).pod.is_empty());
    for b in &lab.bastions {
        assert!(
            b.log().contains("Accepted publickey for root") && !b.connection_pids().is_empty(),
            "hop {} was not used:\n{}",
            b.netns,
            b.log()
        );
    }
    disconnect(&fx, &lab);

    // `ProxyJump a,b`.
    ok(
        connect(
            &fx,
            &lab,
            &[
                "--ssh-alias",
                "kvpn-list-x9",
                "--ssh-config",
                &cfg,
                "--ssh-known-hosts",
                &kh,
            ],
            None,
        ),
        "connect with ProxyJump a,b",
        &fx,
        &lab,
    );
    assert!(!fx.page(web()).pod.is_empty());
    disconnect(&fx, &lab);

    // A cycle is refused before anything is dialled.
    let t0 = Instant::now();
    let err = fails(
        connect(
            &fx,
            &lab,
            &[
                "--ssh-alias",
                "kvpn-loop-a",
                "--ssh-config",
                &cfg,
                "--ssh-known-hosts",
                &kh,
            ],
            None,
        ),
        "connect with a ProxyJump cycle",
    );
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(
        err.contains("ProxyJump cycle")
            && err.contains("kvpn-loop-a -> kvpn-loop-b -> kvpn-loop-a"),
        "{err}"
    );
    assert!(err.contains(&cfg), "{err}");
}

#[test]
fn ssh_03_hashed_known_hosts_unknown_host_accept_new_and_changed_key() {
    let mut fx = KubeFixture::new();
    let lab = SshLab::new(&mut fx, 1);
    let b = &lab.bastions[0];
    let ssh_addr = b.ssh_addr();
    let key = lab.key.to_string_lossy().into_owned();
    let with_kh = |kh: &Path, extra: &[&str]| -> Output {
        let kh = kh.to_string_lossy().into_owned();
        let mut a = vec![
            "--ssh-addr",
            ssh_addr.as_str(),
            "--ssh-username",
            "root",
            "--ssh-keyfile",
            key.as_str(),
            "--ssh-known-hosts",
            kh.as_str(),
        ];
        a.extend_from_slice(extra);
        connect(&fx, &lab, &a, None)
    };

    // Only the ed25519 key, hashed by ssh-keygen -H, while sshd offers ed25519,
    // ECDSA and RSA host keys.
    let hashed = lab.known_hosts(
        "known_hosts_hashed",
        &[format!(
            "{} {}",
            b.known_hosts_name(),
            b.host_key("ssh-ed25519")
        )],
    );
    let h = std::process::Command::new("ssh-keygen")
        .arg("-H")
        .arg("-f")
        .arg(&hashed)
        .output()
        .unwrap_or_else(|e| panic!("ssh-keygen -H: {e}"));
    assert!(h.status.success(), "{}", text(&h.stderr));
    let content = std::fs::read_to_string(&hashed).unwrap_or_default();
    assert!(
        content.starts_with("|1|") && !content.contains(&b.addr),
        "{content}"
    );
    ok(
        with_kh(&hashed, &[]),
        "connect with a hashed known_hosts",
        &fx,
        &lab,
    );
    assert!(!fx.page(web()).pod.is_empty());
    disconnect(&fx, &lab);

    // Only the ECDSA key listed: kvpn asks for that type first and succeeds.
    let ecdsa = lab.known_hosts(
        "known_hosts_ecdsa",
        &[format!(
            "{} {}",
            b.known_hosts_name(),
            b.host_key("ecdsa-sha2-nistp256")
        )],
    );
    ok(
        with_kh(&ecdsa, &[]),
        "connect with only the ECDSA key known",
        &fx,
        &lab,
    );
    disconnect(&fx, &lab);

    // Unknown host: refused, the file untouched.
    let empty = lab.known_hosts("known_hosts_empty", &[]);
    let err = fails(with_kh(&empty, &[]), "connect to an unknown host");
    assert!(
        err.contains("is not in") && err.contains("SHA256:") && err.contains("--ssh-accept-new"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&empty).unwrap_or_default(), "");

    // --ssh-accept-new records it (and connects).
    ok(
        with_kh(&empty, &["--ssh-accept-new"]),
        "connect with --ssh-accept-new",
        &fx,
        &lab,
    );
    let recorded = std::fs::read_to_string(&empty).unwrap_or_default();
    assert!(
        recorded.starts_with(&b.known_hosts_name()) && recorded.lines().count() == 1,
        "{recorded}"
    );
    disconnect(&fx, &lab);

    // A changed key (another ed25519 key on line 2): refused, naming file and line,
    // also with --ssh-accept-new.
    let other = lab.dir.join("other_host_key");
    let g = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(&other)
        .output()
        .unwrap_or_else(|e| panic!("ssh-keygen: {e}"));
    assert!(g.status.success());
    let other_pub = std::fs::read_to_string(other.with_extension("pub")).unwrap_or_default();
    let other_pub: Vec<&str> = other_pub.split_whitespace().take(2).collect();
    let changed = lab.known_hosts(
        "known_hosts_changed",
        &[
            "# the bastion".to_owned(),
            format!("{} {}", b.known_hosts_name(), other_pub.join(" ")),
        ],
    );
    for extra in [&[][..], &["--ssh-accept-new"][..]] {
        let err = fails(with_kh(&changed, extra), "connect with a changed host key");
        let at = format!("{}:2", changed.display());
        assert!(err.contains("HAS CHANGED") && err.contains(&at), "{err}");
    }
}

#[test]
fn gssapi_logins_with_password_keytab_cache_and_default_cache_and_a_wrong_password_fails_at_once() {
    let mut fx = KubeFixture::new();
    let mut lab = SshLab::new(&mut fx, 1);
    let laptop = fx.lab().netns_lab().laptop_netns().name().to_owned();
    let kdc = Kdc::start(&lab.dir.join("kdc"), &laptop);
    let krb_pw = "kvpn-lab-krb5-pw";
    kdc.kadmin(&format!("addprinc +requires_preauth -pw {krb_pw} root"));
    let b_addr = lab.bastions[0].addr.clone();
    let host_keytab = kdc.add_host(&b_addr);
    let user_keytab = kdc.user_keytab("root");
    // Kerberos only: no password login, any key of the host keytab (host/<address>).
    let rcache_none = Path::new("none");
    lab.bastions[0].restart_sshd(
        "GSSAPIAuthentication yes\nGSSAPIStrictAcceptorCheck no\nPasswordAuthentication no\n",
        &[
            ("KRB5_CONFIG", &kdc.krb5_conf),
            ("KRB5_KTNAME", &host_keytab),
            ("KRB5RCACHETYPE", rcache_none),
        ],
    );
    lab.set_kvpn_env("KRB5_CONFIG", &kdc.krb5_conf);
    // No default cache: only the --gssapi-* flag can log in.
    lab.set_kvpn_env(
        "KRB5CCNAME",
        format!("FILE:{}", lab.dir.join("no-default-cache").display()),
    );
    let kh = lab.known_hosts_all();
    let base = [
        "--ssh-addr".to_owned(),
        lab.bastions[0].ssh_addr(),
        "--ssh-username".to_owned(),
        "root".to_owned(),
        "--ssh-known-hosts".to_owned(),
        kh.to_string_lossy().into_owned(),
    ];
    let logins = |lab: &SshLab| {
        lab.bastions[0]
            .log()
            .matches("Accepted gssapi-with-mic for root")
            .count()
    };

    // A wrong password: refused by the KDC before any SSH login, and said so.
    let t0 = Instant::now();
    let mut wrong = args(&base);
    wrong.extend(["--gssapi-password", "not-the-password"]);
    let err = fails(
        connect(&fx, &lab, &wrong, None),
        "connect with a wrong Kerberos password",
    );
    let took = t0.elapsed();
    eprintln!(
        "wrong Kerberos password refused in {:.2} s: {err}",
        took.as_secs_f64()
    );
    assert!(
        err.contains("Kerberos")
            && err.contains(&format!("root@{REALM}"))
            && err.contains("Preauthentication failed")
            && err.contains("--gssapi-password"),
        "{err}"
    );
    assert!(took < Duration::from_secs(10), "took {took:?}: {err}");
    assert_eq!(logins(&lab), 0, "{}", lab.bastions[0].log());

    let cache = lab.dir.join("krb5cc_kinit");
    kdc.kinit(&laptop, "root", krb_pw, &cache);
    let cache_s = cache.to_string_lossy().into_owned();
    let keytab_s = user_keytab.to_string_lossy().into_owned();
    for (what, extra) in [
        ("--gssapi-password", vec!["--gssapi-password", krb_pw]),
        (
            "--gssapi-keytab",
            vec!["--gssapi-keytab", keytab_s.as_str()],
        ),
        ("--gssapi-cache", vec!["--gssapi-cache", cache_s.as_str()]),
        // No flag: the default cache, the CLI's KRB5CCNAME, also in the user daemon
        // that was started with another one.
        ("the default cache", vec![]),
    ] {
        if extra.is_empty() {
            lab.set_kvpn_env("KRB5CCNAME", format!("FILE:{cache_s}"));
        }
        let before = logins(&lab);
        let mut a = args(&base);
        a.extend(extra);
        let t0 = Instant::now();
        let out = ok(
            connect(&fx, &lab, &a, None),
            &format!("connect with {what}"),
            &fx,
            &lab,
        );
        eprintln!(
            "connect through the bastion with {what} took {:.1} s",
            t0.elapsed().as_secs_f64()
        );
        assert!(out.contains("Connected"), "{out}");
        let page = fx.page(web());
        assert!(!page.pod.is_empty(), "{what}: {page:?}");
        assert!(
            logins(&lab) > before,
            "sshd saw no gssapi-with-mic login with {what}:\n{}",
            lab.bastions[0].log()
        );
        disconnect(&fx, &lab);
    }
    let log = lab.bastions[0].log();
    assert!(!log.contains("Accepted password"), "{log}");
    assert!(
        kdc.log().contains(&format!("host/{b_addr}@{REALM}")),
        "the KDC issued no ticket for the bastion's host principal:\n{}",
        kdc.log()
    );
}
