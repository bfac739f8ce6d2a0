//! The laptop's own resolvers behind kvpn's DNS forwarder, in the Kubernetes lab
//! (issue 29 items 2, 4 and 5):
//! - public names under a top-level domain that is also a namespace of the
//!   cluster (`go.dev` with a namespace `dev`) get the laptop's answer;
//! - `kvpn disconnect` with questions in flight frees the forwarder's port, so an
//!   immediate `kvpn connect` binds it; a port held by another process is named;
//! - a scoped link-local nameserver (`fe80::53%<interface>`) is reached through
//!   its interface.
//!
//! The laptop's resolvers are real programs in the laptop netns (dnsmasq, and
//! socat as a resolver that never answers) or in a netns of the test's own behind
//! a veth (the link-local one); queries come from `dig` and `getent` in the
//! laptop netns, which read the laptop netns's resolv.conf.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvpn_lab::LAPTOP;
use kvpn_tests::dns_lab::*;
use kvpn_tests::kube_lab::KubeFixture;
use kvpn_tests::text;

/// Public names of the laptop's resolver under `.dev`, the name of a namespace
/// of the lab's cluster.
const DEV_NAMES: [(&str, &str); 3] = [
    ("go.dev", "192.0.2.30"),
    ("pkg.go.dev", "192.0.2.31"),
    ("mycorp.dev", "192.0.2.32"),
];

/// Issue 29 item 2: with a namespace `dev` (connected to it, as in the report),
/// `go.dev`, `pkg.go.dev` and `mycorp.dev` got NXDOMAIN from the forwarder and
/// never reached the laptop's resolver. The cluster is still asked first (a
/// Service `go` in `dev` would answer, as in a pod), its NXDOMAIN falls through;
/// a Service that exists (`web.dev`) and `….svc` spellings never go upstream.
#[test]
fn public_name_under_a_namespace_named_like_its_tld_resolves_upstream() {
    let f = KubeFixture::new();
    let upstream = Upstream::start_with(&f, &DEV_NAMES);
    write_laptop_resolv(&f, LAPTOP_RESOLV);
    let kubeconfig = f.user_kubeconfig();
    let out = f.kvpn_ok(&["connect", "--kubeconfig", &kubeconfig, "--namespace", "dev"]);
    assert!(out.contains("DNS: forwarder on 127.0.0.153:53"), "{out}");
    wait_cluster_name(&f, "web.dev.svc.cluster.local");
    let dev_web = cluster_ip(&f, "dev", "web");

    for (name, ip) in DEV_NAMES {
        for edns in ["+edns=0", "+noedns"] {
            let d = dig(&f, &[edns, name, "A"]);
            assert_eq!(d.status, "NOERROR", "{name} {edns}: {}", d.raw);
            assert_eq!(d.a(), vec![ip.to_owned()], "{name} {edns}: {}", d.raw);
            assert!(
                d.typed("CNAME").is_empty(),
                "{name}: the laptop's answer, not a cluster expansion: {}",
                d.raw
            );
        }
        // glibc, with the cluster's search list first in resolv.conf.
        assert_eq!(getent(&f, name).as_deref(), Some(ip), "getent hosts {name}");
    }
    let asked = upstream.queries();
    for (name, _) in DEV_NAMES {
        assert!(
            asked.iter().any(|q| q == name),
            "{name} never reached the laptop's resolver: {asked:?}"
        );
    }

    // The cluster's own names are unchanged and stay off the laptop's resolver.
    assert_eq!(dig(&f, &["web.dev"]).a(), vec![dev_web.clone()]);
    assert_eq!(dig(&f, &["web"]).a(), vec![dev_web.clone()]);
    let d = dig(&f, &["nosuch.dev.svc", "A"]);
    assert_eq!(d.status, "NXDOMAIN", "nosuch.dev.svc: {}", d.raw);
    upstream.assert_no_cluster_names(&f, &["web", "web.dev", "nosuch.dev.svc"]);
}

/// A resolver in the laptop netns on `addr` (IPv4, port 53) that reads UDP
/// questions and never answers: each question to it stays in the forwarder
/// for its whole exchange timeout.
fn silent_resolver(f: &KubeFixture, name: &str, ip: &str) -> u32 {
    let mut cmd = Command::new("socat");
    cmd.args([
        "-u",
        &format!("UDP4-RECV:53,bind={ip}"),
        "OPEN:/dev/null,wronly",
    ]);
    let pid = f
        .lab()
        .netns_lab()
        .spawn_in(LAPTOP, name, &cmd)
        .unwrap_or_else(|e| panic!("socat in the laptop netns: {e:#}"));
    let t0 = Instant::now();
    while !text(
        &f.laptop(&["ss", "-lunH", "src", &format!("{ip}:53")])
            .stdout,
    )
    .contains(ip)
    {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "socat not listening on {ip}:53"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    pid
}

/// `dig` in the laptop netns in the background.
fn dig_in_background(laptop: &kvpn_lab::Netns, name: &str) -> Child {
    laptop
        .command("dig")
        .args(["+time=6", "+tries=1", name])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn dig: {e}"))
}

/// Issue 29 item 4: `kvpn disconnect && kvpn connect` failed with "Address
/// already in use" on 127.0.0.153:53 while a DNS question was in flight (the
/// old forwarder's socket outlived disconnect), and the message blamed
/// "another DNS server". Here questions to a resolver that never answers are in
/// flight at every disconnect, and the next connect binds at once, four times;
/// then a port that another process really holds is refused with that
/// process's pid and command line.
#[test]
fn disconnect_with_dns_questions_in_flight_frees_the_port_and_a_taken_port_names_its_holder() {
    let f = KubeFixture::new();
    silent_resolver(&f, "silent-resolver", "127.0.0.2");
    write_laptop_resolv(&f, b"nameserver 127.0.0.2\nsearch corp.test\n");
    let out = connect_default(&f);
    assert!(out.contains("DNS: forwarder on 127.0.0.153:53"), "{out}");
    let web = cluster_ip(&f, "default", "web");
    let laptop = f.lab().netns_lab().laptop_netns().clone();
    for round in 0..4 {
        // Questions keep coming until disconnect has returned: some are always
        // waiting for the silent resolver (2 s per try, two tries).
        let stop = std::sync::atomic::AtomicBool::new(false);
        let in_flight = std::thread::scope(|s| {
            let sender = s.spawn(|| {
                let mut digs = Vec::new();
                let mut i = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    digs.push(dig_in_background(
                        &laptop,
                        &format!("r{round}q{i}.example.com"),
                    ));
                    i += 1;
                    std::thread::sleep(Duration::from_millis(100));
                }
                digs
            });
            // The forwarder is asking the silent resolver.
            let t0 = Instant::now();
            let asking = loop {
                let ss = text(&f.laptop(&["ss", "-uanH", "dst", "127.0.0.2:53"]).stdout);
                let n = ss.lines().count();
                if n > 0 || t0.elapsed() > Duration::from_secs(5) {
                    break n;
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            let disconnect = f.kvpn(&["disconnect", "--all"]);
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            let digs = sender
                .join()
                .unwrap_or_else(|_| panic!("dig sender panicked"));
            (asking, disconnect, digs)
        });
        let (asking, disconnect, mut digs) = in_flight;
        assert!(
            asking > 0,
            "round {round}: no question was in flight to the silent resolver"
        );
        assert!(
            disconnect.status.success(),
            "round {round}: kvpn disconnect: {}{}",
            text(&disconnect.stdout),
            text(&disconnect.stderr)
        );
        // Right after: the forwarder's port is free and connect binds it.
        let connect = f.kvpn(&[
            "connect",
            "--kubeconfig",
            &f.user_kubeconfig(),
            "--namespace",
            "default",
        ]);
        let said = format!("{}{}", text(&connect.stdout), text(&connect.stderr));
        assert!(
            connect.status.success() && said.contains("DNS: forwarder on 127.0.0.153:53"),
            "round {round}: connect right after disconnect (with {asking} questions in flight):\n{said}\n{}",
            f.diagnostics()
        );
        assert!(!said.contains("already in use"), "round {round}: {said}");
        eprintln!(
            "round {round}: disconnect with {asking} questions in flight, connect bound 127.0.0.153:53 at once"
        );
        for d in &mut digs {
            let _ = d.kill();
            let _ = d.wait();
        }
    }
    assert_eq!(dig(&f, &["web"]).a(), vec![web]);

    // Another process on the forwarder's address: connect says who.
    f.kvpn_ok(&["disconnect", "--all"]);
    let squatter = silent_resolver(&f, "squatter", "127.0.0.153");
    let out = f.kvpn(&[
        "connect",
        "--kubeconfig",
        &f.user_kubeconfig(),
        "--namespace",
        "default",
    ]);
    let said = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(
        !out.status.success(),
        "connect with 127.0.0.153:53 taken: {said}"
    );
    assert!(
        said.contains("cannot listen for DNS on 127.0.0.153:53")
            && said.contains(&format!(
                "held by pid {squatter} (socat -u UDP4-RECV:53,bind=127.0.0.153"
            ))
            && said.contains("KVPN_DNS_IP"),
        "the error names the holder and the fix: {said}"
    );
    assert!(!said.contains("another DNS server"), "{said}");
    eprintln!("taken port: {}", said.trim());
}

/// Issue 29 item 5: with only a scoped link-local nameserver in resolv.conf
/// (`nameserver fe80::53%<interface>`), every non-cluster name got SERVFAIL
/// without a warning: the forwarder dropped the scope. The resolver here is a
/// dnsmasq in a netns of this test behind a veth, on its link-local address
/// only; a scope naming no interface is refused with a warning in connect's
/// output.
#[test]
fn link_local_upstream_is_reached_through_its_interface_scope() {
    let f = KubeFixture::new();
    let lab = f.lab().netns_lab();
    // The lab deletes `kvpn-<id>-*` namespaces and stops their processes on down.
    let netns = kvpn_lab::Netns::create(&kvpn_lab::topology::netns_name(lab.id(), "lldns"))
        .unwrap_or_else(|e| panic!("link-local resolver netns: {e:#}"));
    let veth = format!("kv{}ll", lab.id());
    lab.laptop_netns()
        .ip_batch(&[
            format!(
                "link add {veth} type veth peer name eth0 netns {}",
                netns.name()
            ),
            format!("addr add fe80::a/64 dev {veth} nodad"),
            format!("link set {veth} up"),
        ])
        .unwrap_or_else(|e| panic!("veth in the laptop netns: {e:#}"));
    netns
        .ip_batch(&[
            "link set lo up".to_owned(),
            "addr add fe80::53/64 dev eth0 nodad".to_owned(),
            "link set eth0 up".to_owned(),
        ])
        .unwrap_or_else(|e| panic!("link-local resolver addresses: {e:#}"));
    let log = lab.dir().join("lldns-queries.log");
    let mut cmd = Command::new("dnsmasq");
    cmd.args([
        "--keep-in-foreground",
        "--conf-file=/dev/null",
        "--no-resolv",
        "--no-hosts",
        "--interface=eth0",
        "--bind-interfaces",
        "--port=53",
        "--user=root",
        "--pid-file=",
        "--log-queries",
        "--local=/corp.test/",
        "--host-record=ll.corp.test,192.0.2.40",
    ])
    .arg(format!("--log-facility={}", log.display()));
    lab.spawn_in("lldns", "lldns-dnsmasq", &cmd)
        .unwrap_or_else(|e| panic!("dnsmasq in the link-local netns: {e:#}"));
    let scoped = format!("fe80::53%{veth}");
    let t0 = Instant::now();
    loop {
        let d = f.laptop(&[
            "dig",
            "+time=1",
            "+tries=1",
            &format!("@{scoped}"),
            "ll.corp.test",
        ]);
        if parse_dig(&text(&d.stdout)).a() == vec!["192.0.2.40".to_owned()] {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the link-local resolver does not answer dig @{scoped}: {}{}\n{}",
            text(&d.stdout),
            text(&d.stderr),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    write_laptop_resolv(
        &f,
        format!("nameserver {scoped}\nsearch corp.test\n").as_bytes(),
    );
    let out = connect_default(&f);
    assert!(out.contains("DNS: forwarder on 127.0.0.153:53"), "{out}");
    assert!(!out.contains("warning: nameserver"), "{out}");
    let web = cluster_ip(&f, "default", "web");
    for _ in 0..3 {
        let d = dig(&f, &["ll.corp.test"]);
        assert_eq!(d.status, "NOERROR", "through {scoped}: {}", d.raw);
        assert_eq!(d.a(), vec!["192.0.2.40".to_owned()], "{}", d.raw);
    }
    assert_eq!(
        getent(&f, "ll").as_deref(),
        Some("192.0.2.40"),
        "search corp.test"
    );
    assert_eq!(dig(&f, &["web"]).a(), vec![web]);
    f.kvpn_ok(&["disconnect", "--all"]);

    // A scope that names no interface: said at connect, not a silent SERVFAIL.
    write_laptop_resolv(
        &f,
        b"nameserver fe80::53%kvpnnosuch0\nnameserver 127.0.0.1\nsearch corp.test\n",
    );
    let out = connect_default(&f);
    assert!(
        out.contains(
            "warning: nameserver fe80::53%kvpnnosuch0 in resolv.conf: no interface kvpnnosuch0"
        ),
        "{out}"
    );
    f.kvpn_ok(&["disconnect", "--all"]);
}
