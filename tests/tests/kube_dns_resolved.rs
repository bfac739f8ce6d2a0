//! Case dns-04 against a real systemd-resolved: the laptop netns runs its own
//! system bus and `/lib/systemd/systemd-resolved` in a private mount namespace
//! whose /etc/resolv.conf names only the stub 127.0.0.53 and whose nsswitch.conf
//! resolves hosts through nss-resolve ([`ResolvedLaptop`]); the laptop's own
//! resolver is the dnsmasq of the other DNS tests, configured as resolved's
//! global DNS. `kvpn connect` there must put the cluster DNS, the cluster domain
//! as a routing domain and the search list on the TUN link (and not make it a
//! default route, nor use LLMNR or mDNS on it), so that `getent hosts` finds
//! short and full cluster names while the laptop's names still go to dnsmasq;
//! disconnect, and a SIGKILL of the root daemon, must leave resolved exactly as
//! before. This machine's /etc/resolv.conf and /etc/nsswitch.conf never change.

use std::time::{Duration, Instant};

use kvpn_tests::dns_lab::*;
use kvpn_tests::kube_lab::KubeFixture;
use kvpn_tests::resolved_lab::ResolvedLaptop;

/// resolved's view of DNS, per link and global, with the link numbers left out.
fn resolved_view(r: &ResolvedLaptop) -> String {
    ["dns", "domain", "default-route", "dnsovertls", "dnssec"]
        .iter()
        .map(|what| r.resolvectl(&[what]))
        .collect::<Vec<_>>()
        .join("")
}

/// `kvpn connect` to namespace `default`, which must choose systemd-resolved.
fn connect(r: &ResolvedLaptop, kubeconfig: &str) {
    let out = r.kvpn_ok(&[
        "connect",
        "--kubeconfig",
        kubeconfig,
        "--namespace",
        "default",
    ]);
    assert!(out.contains("DNS: systemd-resolved"), "{out}");
}

#[test]
fn dns_04_systemd_resolved_link_dns_routing_domain_search_getent_and_clean_disconnect() {
    let host_resolv = std::fs::read("/etc/resolv.conf").unwrap_or_default();
    let host_nsswitch = std::fs::read("/etc/nsswitch.conf").unwrap_or_default();
    let f = KubeFixture::new();
    let upstream = Upstream::start(&f);
    let r = ResolvedLaptop::start(&f);
    // The laptop's own name through resolved (global DNS → dnsmasq), by nss-resolve.
    assert_eq!(
        r.getent(CORP_HOST.0).as_deref(),
        Some(CORP_HOST.1),
        "laptop name before connect\n{}",
        r.log()
    );
    let before = resolved_view(&r);

    let kubeconfig = f.user_kubeconfig();
    connect(&r, &kubeconfig);
    let tuns = f.tun_devices();
    assert_eq!(tuns.len(), 1, "one TUN device: {tuns:?}");
    let tun = &tuns[0];
    let web = cluster_ip(&f, "default", "web");
    wait_cluster_name(&f, "web.default.svc.cluster.local");

    // The TUN link carries the cluster DNS, the routing domain and the search
    // list (connected namespace first), and is no default route.
    let status = r.resolvectl(&["status", tun]);
    let dns = r.resolvectl(&["dns", tun]);
    assert!(
        dns.trim_end().ends_with(&format!("({tun}): {CLUSTER_DNS}")),
        "{dns}\n{status}"
    );
    // The lab's search list ends with the cluster domain itself, which routes
    // as well as any `~cluster.local` would (resolved keeps one entry per name).
    let domain = r.resolvectl(&["domain", tun]);
    assert!(
        domain.trim_end().ends_with(&format!(
            "({tun}): default.svc.cluster.local svc.cluster.local cluster.local"
        )),
        "{domain}\n{status}"
    );
    let default_route = r.resolvectl(&["default-route", tun]);
    assert!(
        default_route.trim_end().ends_with(&format!("({tun}): no")),
        "{default_route}\n{status}"
    );
    assert!(status.contains("Current Scopes: DNS"), "{status}");
    // No LLMNR or mDNS on the TUN link.
    assert!(
        status.contains("Protocols: -DefaultRoute -LLMNR -mDNS"),
        "{status}"
    );
    // Plain DNS to the cluster DNS whatever the global settings say (this
    // resolved has DNSOverTLS=opportunistic): no TLS to its port 853.
    for (what, want) in [("dnsovertls", "no"), ("dnssec", "no")] {
        let got = r.resolvectl(&[what, tun]);
        assert!(
            got.trim_end().ends_with(&format!("({tun}): {want}")),
            "resolvectl {what} {tun}: {got}\n{status}"
        );
    }
    eprintln!("dns-04: resolvectl status {tun}:\n{status}");

    // Every lookup through nss-resolve: a short name (search list), the full
    // name, and the laptop's own names, which still go to dnsmasq.
    assert_eq!(
        r.getent("web").as_deref(),
        Some(web.as_str()),
        "getent hosts web\n{}\n{}",
        f.diagnostics(),
        r.log()
    );
    assert_eq!(
        r.getent("web.default.svc.cluster.local").as_deref(),
        Some(web.as_str()),
        "getent hosts web.default.svc.cluster.local"
    );
    assert_eq!(
        r.getent(CORP_HOST.0).as_deref(),
        Some(CORP_HOST.1),
        "laptop name while connected"
    );
    assert_eq!(
        r.getent(PUBLIC_HOST.0).as_deref(),
        Some(PUBLIC_HOST.1),
        "public-looking name while connected"
    );
    // The stub (what resolv.conf readers such as dig use) routes the same way.
    let d = parse_dig(&kvpn_tests::text(
        &r.run(&[
            "dig",
            "+time=2",
            "+tries=1",
            "web.default.svc.cluster.local",
        ])
        .stdout,
    ));
    assert_eq!(d.a(), vec![web.clone()], "dig via 127.0.0.53: {}", d.raw);
    upstream.assert_no_cluster_names(&f, &["web"]);

    // Disconnect: the TUN and its link settings are gone, nothing else changed.
    r.kvpn_ok(&["disconnect", "--all"]);
    assert!(f.tun_devices().is_empty(), "{:?}", f.tun_devices());
    let after = resolved_view(&r);
    assert_eq!(after, before, "resolved's DNS settings after disconnect");
    assert!(!after.contains(tun.as_str()), "{after}");
    assert_eq!(
        r.getent("web.default.svc.cluster.local"),
        None,
        "cluster name after disconnect"
    );
    assert_eq!(
        r.getent(CORP_HOST.0).as_deref(),
        Some(CORP_HOST.1),
        "laptop name after disconnect"
    );
    assert_eq!(
        std::fs::read(r.dir().join("resolv.conf")).unwrap_or_default(),
        kvpn_tests::resolved_lab::STUB_RESOLV,
        "kvpn must not write resolv.conf where resolved manages DNS"
    );

    // A killed root daemon leaves nothing in resolved either: the settings go
    // with its TUN device.
    connect(&r, &kubeconfig);
    assert_ne!(resolved_view(&r), before, "settings while connected again");
    kill_daemon_and_agents(&f);
    let t0 = Instant::now();
    while !f.tun_devices().is_empty() || resolved_view(&r) != before {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "resolved after SIGKILL of the root daemon: {}",
            resolved_view(&r)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        r.getent(CORP_HOST.0).as_deref(),
        Some(CORP_HOST.1),
        "laptop name after the daemon was killed"
    );

    // This machine's own files never changed.
    assert_eq!(
        std::fs::read("/etc/resolv.conf").unwrap_or_default(),
        host_resolv
    );
    assert_eq!(
        std::fs::read("/etc/nsswitch.conf").unwrap_or_default(),
        host_nsswitch
    );
}
