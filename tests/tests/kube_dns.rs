//! Split DNS on the laptop (issue dns-fidelity item 1, cases dns-01…dns-09) in the
//! Kubernetes lab on real node software (two nodes, `KubeFixture::real_nodes`): the
//! cluster DNS is the lab's hickory-based server as the pod `kube-system/kube-dns`
//! behind ClusterIP 10.96.0.10 (kube-proxy's iptables rules); the laptop's own resolver is a real dnsmasq in the laptop
//! netns on 127.0.0.1 serving `corp.test` and a public-looking name, whose query log
//! proves that cluster names never reach it. Queries come from real `dig`,
//! `getent hosts` and `curl` in the laptop netns, which read the laptop netns's
//! resolv.conf (`/etc/netns/<laptop>/resolv.conf`, managed by the root daemon).
//!
//! The forwarder path is what runs here (the laptop netns's resolv.conf names
//! dnsmasq, not resolved's stub); the systemd-resolved path (dns-04) runs
//! against a real systemd-resolved in kube_dns_resolved.rs.

use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Endpoints;
use kube::api::{Api, PostParams};
use kvpn_tests::dns_lab::*;
use kvpn_tests::kube_lab::KubeFixture;
use kvpn_tests::text;

#[test]
fn dns_01_02_03_short_names_every_spelling_connected_namespace_first() {
    let f = KubeFixture::real_nodes(2);
    let upstream = Upstream::start(&f);
    let path = write_laptop_resolv(&f, LAPTOP_RESOLV);
    service(
        &f,
        "dev",
        serde_json::json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "fluent", "namespace": "dev"},
            "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}
        }),
    );
    let kubeconfig = f.user_kubeconfig();
    let out = f.kvpn_ok(&["connect", "--kubeconfig", &kubeconfig, "--namespace", "dev"]);
    assert!(out.contains("DNS: forwarder on 127.0.0.153:53"), "{out}");
    let dev_web = cluster_ip(&f, "dev", "web");
    let default_web = cluster_ip(&f, "default", "web");
    let fluent = cluster_ip(&f, "dev", "fluent");
    assert_ne!(dev_web, default_web);
    wait_cluster_name(&f, "fluent.dev.svc.cluster.local");

    // dns-03: the connected namespace wins, and leads the search list.
    let resolv = std::fs::read_to_string(&path).unwrap_or_default();
    let search: Vec<&str> = resolv
        .lines()
        .find_map(|l| l.strip_prefix("search "))
        .map(|s| s.split_whitespace().collect())
        .unwrap_or_default();
    assert_eq!(
        search.first().copied(),
        Some("dev.svc.cluster.local"),
        "{resolv}"
    );
    assert!(
        search.contains(&"corp.test"),
        "the laptop's own search domain stays: {resolv}"
    );
    assert!(
        resolv.contains(&format!("nameserver {FORWARDER}\n")),
        "{resolv}"
    );
    assert!(resolv.contains("options edns0 timeout:2"), "{resolv}");
    assert_eq!(dig(&f, &["web"]).a(), vec![dev_web.clone()]);
    assert_eq!(getent(&f, "web").as_deref(), Some(dev_web.as_str()));

    // dns-01: a short name of the connected namespace; a missing one is a fast NXDOMAIN.
    let d = dig(&f, &["fluent"]);
    assert_eq!(d.a(), vec![fluent.clone()], "{}", d.raw);
    let d = dig(&f, &["nosuchsvc"]);
    assert_eq!(d.status, "NXDOMAIN", "{}", d.raw);
    assert!(d.query_ms < 200, "NXDOMAIN took {} ms", d.query_ms);
    eprintln!(
        "dns-01: NXDOMAIN for a missing short name in {} ms",
        d.query_ms
    );

    // dns-02: every spelling, with and without trailing dot (dig +search applies
    // the search list to names without one), A and AAAA, with and without EDNS0.
    let mut checked = 0;
    for spelling in ["web", "web.dev", "web.dev.svc", "web.dev.svc.cluster.local"] {
        for name in [spelling.to_owned(), format!("{spelling}.")] {
            for edns in ["+edns=0", "+noedns"] {
                let d = dig(&f, &["+search", edns, &name, "A"]);
                assert_eq!(d.status, "NOERROR", "{name} A {edns}: {}", d.raw);
                assert_eq!(d.a(), vec![dev_web.clone()], "{name} A {edns}: {}", d.raw);
                let d = dig(&f, &["+search", edns, &name, "AAAA"]);
                assert_eq!(d.status, "NOERROR", "{name} AAAA {edns}: {}", d.raw);
                assert!(d.typed("AAAA").is_empty(), "{name} AAAA {edns}: {}", d.raw);
                checked += 2;
            }
        }
        assert_eq!(
            getent(&f, spelling).as_deref(),
            Some(dev_web.as_str()),
            "getent hosts {spelling}"
        );
    }
    eprintln!("dns-02: {checked} dig questions over 8 spellings all gave {dev_web}");
    // The other namespace by its svc.ns spelling, and a real HTTP client.
    assert_eq!(dig(&f, &["web.default"]).a(), vec![default_web.clone()]);
    let curl = f.laptop(&["curl", "-sS", "--max-time", "5", "http://web.dev/"]);
    assert!(
        curl.status.success() && !curl.stdout.is_empty(),
        "curl http://web.dev/: {}{}\n{}",
        text(&curl.stdout),
        text(&curl.stderr),
        f.diagnostics()
    );

    upstream.assert_no_cluster_names(
        &f,
        &["web", "fluent", "nosuchsvc", "web.dev", "web.default"],
    );

    // dns-06 (regular file): disconnect restores the exact bytes.
    f.kvpn_ok(&["disconnect", "--all"]);
    assert_eq!(
        std::fs::read(&path).unwrap_or_default(),
        LAPTOP_RESOLV,
        "resolv.conf not restored byte for byte"
    );
    assert_eq!(
        dig(&f, &[CORP_HOST.0]).a(),
        vec![CORP_HOST.1.to_owned()],
        "the laptop's own DNS after disconnect"
    );
}

#[test]
fn dns_05_08_09_laptop_names_untouched_big_answers_truncate_fast_negative_aaaa() {
    let f = KubeFixture::real_nodes(2);
    let upstream = Upstream::start(&f);
    write_laptop_resolv(&f, LAPTOP_RESOLV);
    // dns-08: a headless Service with 300 endpoints (no selector, Endpoints by hand).
    service(
        &f,
        "default",
        serde_json::json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "big", "namespace": "default"},
            "spec": {"clusterIP": "None", "ports": [{"name": "http", "port": 80}]}
        }),
    );
    let addresses: Vec<serde_json::Value> = (0..300u32)
        .map(|i| serde_json::json!({"ip": format!("10.244.{}.{}", 2 + i / 200, i % 200 + 1)}))
        .collect();
    let endpoints: Endpoints = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Endpoints",
        "metadata": {"name": "big", "namespace": "default"},
        "subsets": [{"addresses": addresses, "ports": [{"name": "http", "port": 80}]}]
    }))
    .unwrap_or_else(|e| panic!("endpoints JSON: {e}"));
    let api: Api<Endpoints> = Api::namespaced(f.admin(), "default");
    f.block_on(api.create(&PostParams::default(), &endpoints))
        .unwrap_or_else(|e| panic!("create endpoints: {e}"));

    // dns-05, before: the laptop's names through its own resolver.
    let (before_corp, a) = latency(&f, CORP_HOST.0, 20);
    assert_eq!(a, vec![CORP_HOST.1.to_owned()]);
    let (before_public, a) = latency(&f, PUBLIC_HOST.0, 20);
    assert_eq!(a, vec![PUBLIC_HOST.1.to_owned()]);

    connect_default(&f);
    let web = cluster_ip(&f, "default", "web");
    wait_cluster_name(&f, "big.default.svc.cluster.local");

    // dns-05, after: same answers, through the forwarder.
    let (after_corp, a) = latency(&f, CORP_HOST.0, 20);
    assert_eq!(a, vec![CORP_HOST.1.to_owned()]);
    let (after_public, a) = latency(&f, PUBLIC_HOST.0, 20);
    assert_eq!(a, vec![PUBLIC_HOST.1.to_owned()]);
    assert_eq!(getent(&f, CORP_HOST.0).as_deref(), Some(CORP_HOST.1));
    assert_eq!(
        getent(&f, "host").as_deref(),
        Some(CORP_HOST.1),
        "the laptop's search domain"
    );
    assert_eq!(dig(&f, &["nope.corp.test"]).status, "NXDOMAIN");
    eprintln!(
        "dns-05: laptop names, median dig query time before/after connect: {}: {before_corp}/{after_corp} ms, {}: {before_public}/{after_public} ms",
        CORP_HOST.0, PUBLIC_HOST.0
    );

    // dns-08: TC over UDP (dig +ignore keeps the truncated answer), everything over TCP.
    for name in ["big.default.svc.cluster.local", "big"] {
        for edns in ["+noedns", "+edns=0"] {
            let d = dig(&f, &["+ignore", edns, name]);
            assert!(d.tc(), "{name} {edns} over UDP: no TC: {}", d.raw);
            assert!(d.a().len() < 300, "{name}");
        }
        let d = dig(&f, &["+tcp", name]);
        assert!(!d.tc(), "{}", d.raw);
        let mut a = d.a();
        a.sort();
        a.dedup();
        assert_eq!(a.len(), 300, "{name} over TCP: {} A records", a.len());
    }
    // dig without +ignore retries over TCP by itself, through the forwarder.
    assert_eq!(dig(&f, &["big"]).a().len(), 300);
    eprintln!("dns-08: TC over UDP, 300 A records over TCP (FQDN and short name)");

    // dns-09: AAAA of cluster names on this IPv4-only cluster: NOERROR/empty, fast.
    let mut times = Vec::new();
    for name in [
        "web.default.svc.cluster.local",
        "web",
        "web.default",
        "nosuch.default.svc.cluster.local",
    ] {
        let d = dig(&f, &[name, "AAAA"]);
        assert_eq!(d.status, "NOERROR", "{name} AAAA: {}", d.raw);
        assert!(d.typed("AAAA").is_empty(), "{name}: {}", d.raw);
        assert!(d.query_ms < 200, "{name} AAAA took {} ms", d.query_ms);
        times.push(d.query_ms);
    }
    assert_eq!(dig(&f, &["web", "A"]).a(), vec![web]);
    eprintln!("dns-09: AAAA answered NOERROR/empty in {times:?} ms");

    // A missing Service of an existing namespace is NXDOMAIN. Its `….svc`
    // spelling never reaches the laptop's upstream; its `svc.ns` spelling has
    // the shape of a public name (`go.dev` with a namespace `dev`), so after the
    // cluster's NXDOMAIN it is asked upstream (issue 29 item 2), and as this
    // dnsmasq refuses names outside its zones, the cluster's NXDOMAIN stands.
    let d = dig(&f, &["nosuch.default", "A"]);
    assert_eq!(d.status, "NXDOMAIN", "nosuch.default: {}", d.raw);
    let d = dig(&f, &["nosuch.default.svc", "A"]);
    assert_eq!(d.status, "NXDOMAIN", "nosuch.default.svc: {}", d.raw);

    upstream.assert_no_cluster_names(&f, &["web", "big", "web.default", "nosuch.default.svc"]);
    let asked = upstream.queries();
    assert!(asked.iter().any(|q| q == CORP_HOST.0), "{asked:?}");
}

fn is_symlink(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink())
}

#[test]
fn dns_06_resolv_conf_restored_exactly_after_disconnect_and_after_sigkill() {
    let f = KubeFixture::real_nodes(2);
    let _upstream = Upstream::start(&f);
    // A symlinked resolv.conf, as with systemd-resolved or NetworkManager.
    let target = f.lab().netns_lab().dir().join("stub-resolv.conf");
    // CRLF on the comment, a tab, no trailing newline (bytes dig and glibc both parse).
    let stub: &[u8] =
        b"# stub resolver file\r\nnameserver 127.0.0.1\nsearch corp.test\noptions\tedns0 ndots:1";
    std::fs::write(&target, stub).unwrap_or_else(|e| panic!("write stub: {e}"));
    let path = f.laptop_resolv_conf();
    std::fs::remove_file(&path).unwrap_or_else(|e| panic!("remove lab default: {e}"));
    std::os::unix::fs::symlink(&target, &path).unwrap_or_else(|e| panic!("symlink: {e}"));
    let check_original = |when: &str| {
        assert!(is_symlink(&path), "{when}: not a symlink any more");
        assert_eq!(
            std::fs::read_link(&path).ok(),
            Some(target.clone()),
            "{when}: symlink target"
        );
        assert_eq!(
            std::fs::read(&target).unwrap_or_default(),
            stub,
            "{when}: bytes"
        );
    };

    connect_default(&f);
    assert!(!is_symlink(&path), "kvpn's resolv.conf replaces the link");
    assert_eq!(
        std::fs::read(&target).unwrap_or_default(),
        stub,
        "target untouched"
    );
    assert!(
        std::fs::read_to_string(&path)
            .unwrap_or_default()
            .contains(&format!("nameserver {FORWARDER}")),
    );
    let web = cluster_ip(&f, "default", "web");
    assert_eq!(dig(&f, &["web"]).a(), vec![web]);
    f.kvpn_ok(&["disconnect", "--all"]);
    check_original("after disconnect");

    // SIGKILL of the daemons while connected, then a fresh root daemon repairs it.
    connect_default(&f);
    assert!(!is_symlink(&path));
    let pid = kill_daemon_and_agents(&f);
    assert!(
        !is_symlink(&path),
        "a killed daemon cannot restore anything"
    );
    restart_daemon(&f);
    // The link comes back first, then the backup goes.
    let backup = f.runtime_dir().join("resolv.conf.kvpn-backup");
    let t0 = Instant::now();
    while !is_symlink(&path) || backup.exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the restarted daemon did not repair {}: now {:?}\nsockets: {}\nprocess {pid}: {:?}\nits log:\n{}",
            path.display(),
            std::fs::read_to_string(&path),
            text(&f.laptop(&["ss", "-xlpn"]).stdout),
            std::fs::read_to_string(format!("/proc/{pid}/stat")),
            std::fs::read_to_string(f.lab().netns_lab().dir().join("dataplane-restarted.log"))
                .unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    check_original("after SIGKILL and restart");
    // And the laptop's own DNS works as before.
    let d = dig(&f, &[CORP_HOST.0]);
    assert_eq!(d.a(), vec![CORP_HOST.1.to_owned()]);
}
