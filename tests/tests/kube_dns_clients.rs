//! Split DNS seen by real clients (issue dns-fidelity item 1, "Tests" and "Done
//! when"), in the Kubernetes lab with the laptop's own resolver as a real dnsmasq
//! ([`Upstream`]):
//! - dns-07: `kvpn connect --hosts` entries in the laptop netns's hosts file
//!   (`/etc/netns/<laptop>/hosts`, which `ip netns exec` binds over /etc/hosts;
//!   never this machine's), removed byte for byte, also after SIGKILL;
//! - a load of 10,000 mixed cluster/other names from `dnsperf`, with the
//!   laptop's upstream query log checked for leaks;
//! - `dig`, `getent hosts`, `curl` by name, a static musl program (getaddrinfo)
//!   and a Go pure resolver (reads resolv.conf itself), both built at test time.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kvpn_tests::dns_lab::*;
use kvpn_tests::kube_lab::KubeFixture;
use kvpn_tests::text;

/// The laptop's hosts file before connect: tabs, CRLF line ends, no trailing newline.
const LAPTOP_HOSTS: &[u8] = b"127.0.0.1\tlocalhost\r\n::1\t\tlocalhost ip6-localhost ip6-loopback\r\n192.0.2.99\tprinter.corp.test printer";

fn hosts_lookup(f: &KubeFixture, name: &str) -> Option<String> {
    // `-s files`: the hosts file only, not DNS (which resolves these names too).
    first_address(&f.laptop(&["getent", "-s", "files", "hosts", name]))
}

fn wait_hosts(f: &KubeFixture, name: &str, ip: &str) {
    let t0 = Instant::now();
    while hosts_lookup(f, name).as_deref() != Some(ip) {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no hosts-file entry {name} -> {ip} within 20 s: {:?}\n{}",
            String::from_utf8_lossy(&std::fs::read(f.laptop_hosts()).unwrap_or_default()),
            f.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn dns_07_hosts_file_edge_cases() {
    let f = KubeFixture::new();
    let _upstream = Upstream::start(&f);
    write_laptop_resolv(&f, LAPTOP_RESOLV);
    let path = f.laptop_hosts();
    std::fs::write(&path, LAPTOP_HOSTS).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    let bytes = || std::fs::read(&path).unwrap_or_default();

    let kubeconfig = f.user_kubeconfig();
    let out = f.kvpn_ok(&[
        "connect",
        "--kubeconfig",
        &kubeconfig,
        "--namespace",
        "default",
        "--hosts",
    ]);
    assert!(
        out.contains("hosts file") && out.contains("namespace default"),
        "{out}"
    );
    let web = cluster_ip(&f, "default", "web");
    wait_hosts(&f, "web", &web);
    let with = bytes();
    assert!(
        with.starts_with(LAPTOP_HOSTS),
        "every original byte stays: {:?}",
        String::from_utf8_lossy(&with)
    );
    let text_now = String::from_utf8_lossy(&with).into_owned();
    assert!(
        text_now.contains(&format!(
            "{web}\tweb web.default web.default.svc web.default.svc.cluster.local\r\n"
        )),
        "CRLF entries like the file's own: {text_now:?}"
    );
    for spelling in [
        "web.default",
        "web.default.svc",
        "web.default.svc.cluster.local",
    ] {
        assert_eq!(hosts_lookup(&f, spelling).as_deref(), Some(web.as_str()));
    }
    // The laptop's own lines still work: localhost and the last line, which kvpn
    // had to end.
    let localhost = hosts_lookup(&f, "localhost");
    assert!(
        matches!(localhost.as_deref(), Some("127.0.0.1") | Some("::1")),
        "{localhost:?}"
    );
    assert_eq!(hosts_lookup(&f, "printer").as_deref(), Some("192.0.2.99"));
    assert!(getent(&f, "localhost").is_some());
    // A Service created while connected gets an entry from the route watch.
    service(
        &f,
        "default",
        serde_json::json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "late", "namespace": "default"},
            "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}
        }),
    );
    let late = cluster_ip(&f, "default", "late");
    wait_hosts(&f, "late", &late);
    eprintln!(
        "dns-07: hosts file while connected:\n{}",
        String::from_utf8_lossy(&bytes())
    );

    f.kvpn_ok(&["disconnect", "--all"]);
    assert_eq!(
        bytes(),
        LAPTOP_HOSTS,
        "hosts file not restored byte for byte: {:?}",
        String::from_utf8_lossy(&bytes())
    );
    assert_eq!(hosts_lookup(&f, "web"), None);

    // SIGKILL while connected: the next daemon start takes the block out.
    f.kvpn_ok(&[
        "connect",
        "--kubeconfig",
        &kubeconfig,
        "--namespace",
        "default",
        "--hosts",
    ]);
    wait_hosts(&f, "web", &web);
    kill_daemon_and_agents(&f);
    assert_ne!(
        bytes(),
        LAPTOP_HOSTS,
        "a killed daemon cannot restore anything"
    );
    restart_daemon(&f);
    let t0 = Instant::now();
    // The file comes back first, then the backup goes.
    let backup = f.runtime_dir().join("hosts.kvpn-backup");
    while bytes() != LAPTOP_HOSTS || backup.exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the restarted daemon did not repair {}: {:?}\n{}",
            path.display(),
            String::from_utf8_lossy(&bytes()),
            std::fs::read_to_string(f.lab().netns_lab().dir().join("dataplane-restarted.log"))
                .unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(hosts_lookup(&f, "localhost").is_some());
}

/// dnsperf's summary.
#[derive(Debug, Default)]
struct Perf {
    sent: u64,
    completed: u64,
    lost: u64,
    rcodes: Vec<(String, u64)>,
    qps: f64,
    raw: String,
}

fn parse_dnsperf(out: &str) -> Perf {
    let mut p = Perf {
        raw: out.to_owned(),
        ..Default::default()
    };
    let num = |s: &str| -> u64 {
        s.split_whitespace()
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    for line in out.lines().map(str::trim) {
        if let Some(r) = line.strip_prefix("Queries sent:") {
            p.sent = num(r);
        } else if let Some(r) = line.strip_prefix("Queries completed:") {
            p.completed = num(r);
        } else if let Some(r) = line.strip_prefix("Queries lost:") {
            p.lost = num(r);
        } else if let Some(r) = line.strip_prefix("Response codes:") {
            // "NOERROR 6000 (60.00%), NXDOMAIN 4000 (40.00%)"
            for part in r.split(',') {
                let mut w = part.split_whitespace();
                if let (Some(code), Some(n)) = (w.next(), w.next()) {
                    p.rcodes.push((code.to_owned(), n.parse().unwrap_or(0)));
                }
            }
        } else if let Some(r) = line.strip_prefix("Queries per second:") {
            p.qps = r.trim().parse().unwrap_or(0.0);
        }
    }
    p
}

#[test]
fn dns_query_load_10000_mixed_names_no_errors_no_cluster_leak() {
    let f = KubeFixture::new();
    let upstream = Upstream::start(&f);
    write_laptop_resolv(&f, LAPTOP_RESOLV);
    connect_default(&f);
    wait_cluster_name(&f, "web.default.svc.cluster.local");
    assert!(!dig(&f, &["web"]).a().is_empty());

    // Half cluster names in every spelling (existing and missing, A and AAAA),
    // half the laptop's names (existing and missing).
    let mut cluster = 0usize;
    let mut other = 0usize;
    let mut data = String::new();
    for i in 0..10_000usize {
        let line = match i % 10 {
            0 => "web.default.svc.cluster.local A".to_owned(),
            1 => "web A".to_owned(),
            2 => "web.default A".to_owned(),
            3 => format!("nosuch{i} A"),
            4 => format!("nosuch{i}.default.svc.cluster.local AAAA"),
            5 => format!("{} A", CORP_HOST.0),
            6 => format!("h{i}.corp.test A"),
            7 => format!("{} A", PUBLIC_HOST.0),
            8 => format!("{} AAAA", CORP_HOST.0),
            _ => format!("n{i}.example.com A"),
        };
        if i % 10 < 5 {
            cluster += 1;
        } else {
            other += 1;
        }
        data.push_str(&line);
        data.push('\n');
    }
    let file = f.lab().netns_lab().dir().join("dnsperf-names.txt");
    std::fs::write(&file, &data).unwrap_or_else(|e| panic!("write {}: {e}", file.display()));
    let asked_before = upstream.queries().len();

    let file_arg = file.to_string_lossy().into_owned();
    let out = f.laptop(&[
        "dnsperf", "-s", FORWARDER, "-d", &file_arg, "-n", "1", "-c", "4", "-q", "100", "-t", "5",
    ]);
    let perf = parse_dnsperf(&text(&out.stdout));
    assert!(
        out.status.success() && perf.sent == 10_000,
        "dnsperf (scripts/setup.sh installs it): {}{}",
        perf.raw,
        text(&out.stderr)
    );
    assert_eq!(perf.completed, 10_000, "{}\n{}", perf.raw, f.diagnostics());
    assert_eq!(perf.lost, 0, "{}", perf.raw);
    let bad: Vec<_> = perf
        .rcodes
        .iter()
        .filter(|(c, _)| c != "NOERROR" && c != "NXDOMAIN")
        .collect();
    assert!(
        bad.is_empty(),
        "SERVFAIL/REFUSED/...: {bad:?}\n{}\nforwarder counters: {}\n{}",
        perf.raw,
        f.session()["dns_counters"],
        f.diagnostics()
    );
    let nx: u64 = perf
        .rcodes
        .iter()
        .filter(|(c, _)| c == "NXDOMAIN")
        .map(|(_, n)| n)
        .sum();
    // nosuch<i> (1,000), h<i>.corp.test and n<i>.example.com (2,000) do not exist;
    // AAAA of a missing cluster FQDN is NOERROR/empty on this IPv4-only cluster
    // (dns-09: answered at once, without asking).
    assert_eq!(nx, 3_000, "{}", perf.raw);

    // The upstream saw every other name and no cluster name.
    let asked: Vec<String> = upstream.queries().into_iter().skip(asked_before).collect();
    let leaked: Vec<&String> = asked
        .iter()
        .filter(|q| {
            q.ends_with("cluster.local")
                || q.starts_with("nosuch")
                || q.as_str() == "web"
                || q.starts_with("web.")
        })
        .collect();
    assert!(
        leaked.is_empty(),
        "{} cluster names reached the laptop's upstream, e.g. {:?}",
        leaked.len(),
        &leaked[..leaked.len().min(10)]
    );
    assert!(
        asked.len() >= other,
        "the laptop's upstream answered only {} of the {other} other names",
        asked.len()
    );
    let status = f.session();
    eprintln!(
        "load: {} queries ({cluster} cluster, {other} other) in one pass, {:.0} qps, {} lost, rcodes {:?}; upstream saw {} queries, 0 cluster names; forwarder counters {}",
        perf.sent,
        perf.qps,
        perf.lost,
        perf.rcodes,
        asked.len(),
        status["dns_counters"]
    );
}

const GETADDRINFO_C: &str = r#"
#include <netdb.h>
#include <stdio.h>
#include <string.h>
#include <arpa/inet.h>
#include <sys/socket.h>

/* Prints "<name> <addr>[,<addr>...]" or "<name> ERR <message>" per argument. */
int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        struct addrinfo hints, *res, *p;
        memset(&hints, 0, sizeof hints);
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        int rc = getaddrinfo(argv[i], NULL, &hints, &res);
        if (rc != 0) {
            printf("%s ERR %s\n", argv[i], gai_strerror(rc));
            continue;
        }
        printf("%s ", argv[i]);
        const char *sep = "";
        for (p = res; p; p = p->ai_next) {
            char buf[INET6_ADDRSTRLEN];
            void *a = p->ai_family == AF_INET
                ? (void *)&((struct sockaddr_in *)p->ai_addr)->sin_addr
                : (void *)&((struct sockaddr_in6 *)p->ai_addr)->sin6_addr;
            inet_ntop(p->ai_family, a, buf, sizeof buf);
            printf("%s%s", sep, buf);
            sep = ",";
        }
        printf("\n");
        freeaddrinfo(res);
    }
    return 0;
}
"#;

const LOOKUP_GO: &str = r#"package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"strings"
	"time"
)

// Prints "<name> <addr>[,<addr>...]" or "<name> ERR <message>" per argument,
// using Go's own resolver (it reads /etc/resolv.conf itself).
func main() {
	r := &net.Resolver{PreferGo: true}
	for _, name := range os.Args[1:] {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		addrs, err := r.LookupHost(ctx, name)
		cancel()
		if err != nil {
			fmt.Printf("%s ERR %v\n", name, err)
			continue
		}
		fmt.Printf("%s %s\n", name, strings.Join(addrs, ","))
	}
}
"#;

fn run_checked(cmd: &mut Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| {
        panic!("{what}: {e} (scripts/setup.sh installs musl-tools and golang-1.19-go)")
    });
    assert!(
        out.status.success(),
        "{what}: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
}

fn build_musl(dir: &Path) -> PathBuf {
    let src = dir.join("getaddrinfo.c");
    let bin = dir.join("getaddrinfo-musl");
    std::fs::write(&src, GETADDRINFO_C).unwrap_or_else(|e| panic!("write {}: {e}", src.display()));
    run_checked(
        Command::new("musl-gcc")
            .args(["-static", "-O1", "-o"])
            .arg(&bin)
            .arg(&src),
        "musl-gcc -static",
    );
    let file = Command::new("file").arg(&bin).output();
    if let Ok(file) = file {
        let t = text(&file.stdout);
        assert!(t.contains("statically linked"), "{t}");
    }
    bin
}

fn build_go(dir: &Path) -> PathBuf {
    let src = dir.join("lookup.go");
    let bin = dir.join("lookup-go");
    std::fs::write(&src, LOOKUP_GO).unwrap_or_else(|e| panic!("write {}: {e}", src.display()));
    // Go's build cache is safe to share between runs and processes; a fresh one
    // compiles the standard library again (a minute on this machine).
    let cache = std::env::temp_dir().join("kvpn-tests-go-build-cache");
    run_checked(
        Command::new("/usr/lib/go-1.19/bin/go")
            .args(["build", "-tags", "netgo", "-o"])
            .arg(&bin)
            .arg(&src)
            .current_dir(dir)
            .env("GOCACHE", &cache)
            .env("GOPATH", dir.join("gopath"))
            .env("HOME", dir)
            .env("CGO_ENABLED", "0")
            .env("GOFLAGS", "")
            .env("GO111MODULE", "off"),
        "go build",
    );
    bin
}

/// `(name, Ok(addresses) or Err(message))` per line of the programs' output.
fn lookups(
    f: &KubeFixture,
    program: &Path,
    names: &[&str],
    env: &[&str],
) -> Vec<(String, Result<Vec<String>, String>)> {
    let mut args: Vec<String> = vec!["env".into()];
    args.extend(env.iter().map(|s| (*s).to_owned()));
    args.push(program.to_string_lossy().into_owned());
    args.extend(names.iter().map(|s| (*s).to_owned()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = f.laptop(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    text(&out.stdout)
        .lines()
        .filter_map(|l| {
            let (name, rest) = l.split_once(' ')?;
            Some((
                name.to_owned(),
                match rest.strip_prefix("ERR ") {
                    Some(e) => Err(e.to_owned()),
                    None => Ok(rest.split(',').map(str::to_owned).collect()),
                },
            ))
        })
        .collect()
}

#[test]
fn dns_static_musl_and_go_resolvers_resolve_cluster_names() {
    let f = KubeFixture::new();
    let upstream = Upstream::start(&f);
    write_laptop_resolv(&f, LAPTOP_RESOLV);
    let dir = f.lab().netns_lab().dir().join("resolvers");
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
    let t0 = Instant::now();
    let musl = build_musl(&dir);
    let go = build_go(&dir);
    eprintln!(
        "built the musl and Go resolvers in {:.1} s",
        t0.elapsed().as_secs_f64()
    );

    connect_default(&f);
    let web = cluster_ip(&f, "default", "web");
    wait_cluster_name(&f, "web.default.svc.cluster.local");

    // dig, getent hosts and curl by service name.
    assert_eq!(dig(&f, &["+search", "web"]).a(), vec![web.clone()]);
    assert_eq!(getent(&f, "web").as_deref(), Some(web.as_str()));
    let curl = f.laptop(&["curl", "-sS", "--max-time", "5", "http://web/"]);
    assert!(
        curl.status.success() && !curl.stdout.is_empty(),
        "curl http://web/: {}{}",
        text(&curl.stdout),
        text(&curl.stderr)
    );

    // PTR of a ClusterIP: the cluster DNS answers it, the laptop's resolver never sees it.
    let ptr = dig(&f, &["-x", &web]);
    assert_eq!(
        ptr.typed("PTR"),
        vec!["web.default.svc.cluster.local.".to_owned()],
        "{}",
        ptr.raw
    );
    let reverse: Vec<String> = upstream
        .queries()
        .into_iter()
        .filter(|q| q.ends_with("in-addr.arpa"))
        .collect();
    assert!(
        reverse.is_empty(),
        "PTR of cluster addresses went upstream: {reverse:?}"
    );

    let names = [
        "web.default.svc.cluster.local",
        "web.default.svc.cluster.local.",
        "web.default",
        "web",
        CORP_HOST.0,
        "host",
    ];
    let expect = |name: &str| -> String {
        if name == CORP_HOST.0 || name == "host" {
            CORP_HOST.1.to_owned()
        } else {
            web.clone()
        }
    };
    let mut report = Vec::new();
    for (label, program, env) in [
        ("static musl getaddrinfo", &musl, &[][..]),
        ("Go pure resolver", &go, &["GODEBUG=netdns=go+2"][..]),
    ] {
        let got = lookups(&f, program, &names, env);
        assert_eq!(got.len(), names.len(), "{label}: {got:?}");
        for (name, result) in &got {
            let want = expect(name);
            match result {
                Ok(addrs) => assert_eq!(
                    addrs,
                    &vec![want.clone()],
                    "{label}: {name} (AAAA must be empty on this IPv4-only cluster)"
                ),
                Err(e) => panic!("{label}: {name} did not resolve: {e}\n{}", f.diagnostics()),
            }
        }
        report.push(format!("{label}: {} names OK", got.len()));
    }
    // Not resolvable: a missing short name answers NXDOMAIN at once, also to them.
    for (label, program) in [("musl", &musl), ("Go", &go)] {
        let t = Instant::now();
        let got = lookups(&f, program, &["nosuchsvc"], &[]);
        assert!(
            matches!(got.first(), Some((_, Err(_)))),
            "{label}: nosuchsvc: {got:?}"
        );
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "{label}: nosuchsvc took {:?} (a timeout, not NXDOMAIN)",
            t.elapsed()
        );
    }
    upstream.assert_no_cluster_names(&f, &["web", "web.default", "nosuchsvc"]);
    eprintln!(
        "done-when: dig, getent, curl, {} resolve {names:?}",
        report.join("; ")
    );
}
