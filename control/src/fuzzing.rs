//! Entry points of the cargo-fuzz targets (fuzz/) for what the laptop side
//! reads from outside: the SSH config and known_hosts files, CIDRs in
//! component flags, config files and API server messages, kubeconfig bytes,
//! and the traffic manager's lease and route-watch messages (prost-encoded,
//! as they arrive over gRPC). The corpus replay test in `kvpn-tests` calls
//! the same functions. Pure apart from what the parsers themselves do (no
//! file is read: `Include` lines are dropped from SSH configs so a fuzz input
//! cannot make the parser walk the disk). Each function panics only on a bug.

use std::net::IpAddr;
use std::path::Path;

use ipnet::IpNet;
use kube::config::Kubeconfig;
use kvpn_proto::fuzzing::chunks;
use kvpn_proto::manager::{LeaseResponse, RoutesUpdate};
use prost::Message as _;

use crate::cidr;
use crate::kubeconfig::{self, KubeFlags};
use crate::route_watch::RouteWatchState;
use crate::ssh::config::FileConfig;
use crate::ssh::known_hosts::{self, KnownHosts};
use crate::ssh::{self, HopFlags, NoConfig};

/// An ed25519 host key used to query parsed known_hosts files.
const ED25519: &str = "AAAAC3NzaC1lZDI1NTE5AAAAIFt4zzXfhCVNVycP7Q5N1YqdYnUxoHkr6gWBaV7c89t6";

/// Words that follow `Host` (the aliases a config defines), at most 8.
fn host_aliases(text: &str) -> Vec<&str> {
    text.lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let (kw, rest) = l.split_once(|c: char| c.is_whitespace() || c == '=')?;
            kw.eq_ignore_ascii_case("host").then_some(rest)
        })
        .flat_map(str::split_whitespace)
        .take(8)
        .collect()
}

/// An SSH config file's bytes: parsed, every alias looked up and resolved
/// into hops (ProxyJump chains, cycles), and every line read as a
/// destination and as an API server URL.
pub fn ssh_config(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let text: String = text
        .lines()
        .filter(|l| {
            !l.trim_start()
                .get(..7)
                .is_some_and(|k| k.eq_ignore_ascii_case("include"))
        })
        .flat_map(|l| [l, "\n"])
        .collect();
    for line in text.lines() {
        let _ = ssh::parse_destination(line);
        let _ = ssh::server_host_port(line);
    }
    let Ok(config) = FileConfig::parse(
        Path::new("/fuzz/.ssh/config"),
        &text,
        Some(Path::new("/fuzz")),
    ) else {
        return;
    };
    for alias in host_aliases(&text).into_iter().chain(["bastion", "x"]) {
        let flags = HopFlags {
            ssh_alias: Some(alias.to_owned()),
            ..HopFlags::default()
        };
        if let Ok(hops) = ssh::resolve_hops(&flags, &config, Some("fuzz")) {
            assert!(!hops.is_empty(), "an alias resolved to no hop");
            for hop in hops {
                let _ = hop.display();
            }
        }
        let flags = HopFlags {
            ssh_addr: Some(alias.to_owned()),
            ssh_jump: Some(format!("--ssh-alias {alias}")),
            ..HopFlags::default()
        };
        let _ = ssh::resolve_hops(&flags, &NoConfig, None);
    }
}

/// A known_hosts file's bytes: parsed, then asked about every host it names
/// (ports 22 and 2222) with a fixed ed25519 key.
pub fn known_hosts(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let kh = KnownHosts::parse(Path::new("/fuzz/.ssh/known_hosts"), &text);
    let Ok(key) = russh::keys::parse_public_key_base64(ED25519) else {
        panic!("the constant test key does not parse");
    };
    let hosts: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .flat_map(|p| p.split(','))
        .map(|p| {
            p.trim_start_matches(['!', '['])
                .split(']')
                .next()
                .unwrap_or(p)
        })
        .take(16)
        .chain(["10.0.0.1", "bastion"])
        .collect();
    for host in hosts {
        for port in [22, 2222] {
            let _ = kh.check(host, port, &key);
            let listed = kh.listed_algorithms(host, port);
            let _ = known_hosts::prefer_listed(&[key.algorithm()], &listed);
            let line = known_hosts::entry_line(host, port, &key);
            // What we would append must read back as the same host and key.
            let again = KnownHosts::parse(Path::new("/fuzz/new"), &line);
            if !host.is_empty()
                && host
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':'))
            {
                assert_eq!(
                    again.check(host, port, &key),
                    known_hosts::Verdict::Known { line: 1 },
                    "entry line {line:?} does not read back"
                );
            }
        }
    }
}

/// Text with CIDRs: as component flags (one command line per line), as
/// kubeadm/kube-proxy config values, and as an API server refusal message;
/// the CIDRs found then go through the CIDR math the routes use.
pub fn cidr_flags(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut nets: Vec<IpNet> = cidr::parse_component_flags(text.lines())
        .into_iter()
        .map(|(_, _, n)| n)
        .collect();
    for key in ["serviceSubnet", "podSubnet", "clusterCIDR"] {
        nets.extend(cidr::parse_config_values(&text, key));
    }
    nets.extend(cidr::parse_valid_ranges(&text));
    let ips: Vec<IpAddr> = text
        .split(|c: char| c.is_whitespace() || c == ',')
        .filter_map(|w| w.parse().ok())
        .take(64)
        .collect();
    nets.truncate(64);
    cidr_math(&nets, &ips);
}

fn cidr_math(nets: &[IpNet], ips: &[IpAddr]) {
    use kvpn_proto::cidr as math;
    let norm = math::normalise(nets);
    let cut = math::exclude(&norm, ips);
    for ip in ips {
        assert!(
            !cut.iter().any(|n| n.contains(ip)),
            "excluded {ip} still routed by {cut:?}"
        );
    }
    let _ = math::subtract(&norm, &cut);
    let _ = math::uncovered(ips, &norm);
    let _ = math::infer_covering(ips, math::InferPolicy::default());
}

/// A kubeconfig file's bytes: parsed as kube-rs does, merged and the
/// current context selected.
pub fn kubeconfig(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(kc) = Kubeconfig::from_yaml(text) else {
        return;
    };
    let merged = kubeconfig::merge(vec![(Path::new("/fuzz/config").to_owned(), kc)]);
    if let Ok(sel) = kubeconfig::select(&merged, &KubeFlags::default()) {
        let _ = ssh::server_host_port(&sel.server);
    }
}

/// A sequence of traffic manager messages ([`chunks`] shape): a chunk whose
/// first byte is even is a prost-encoded `LeaseResponse` (the rest), an odd
/// one a `RoutesUpdate` of the route watch, taken in by the laptop's route
/// state, which then computes its routes and its request to the root daemon.
pub fn manager_messages(data: &[u8]) {
    let connect: Vec<IpNet> = ["10.96.0.0/12", "10.244.0.0/16"]
        .iter()
        .filter_map(|s| s.parse().ok())
        .collect();
    let keep_out = vec![IpAddr::from([172, 31, 255, 1])];
    let mut state = RouteWatchState::new(connect, keep_out.clone());
    for chunk in chunks(data) {
        let Some((tag, body)) = chunk.split_first() else {
            continue;
        };
        if tag % 2 == 0 {
            if let Ok(resp) = LeaseResponse::decode(body) {
                // As `connect` reads them: tunnel IP and pool must parse.
                let _ = resp.tunnel_ip.parse::<IpAddr>();
                let _ = resp.pool_cidr.parse::<IpNet>();
                let _ = resp.manager_ip.parse::<IpAddr>();
            }
        } else if let Ok(update) = RoutesUpdate::decode(body) {
            state.handle_update(&update);
            let desired = state.desired();
            for net in desired.keys() {
                assert!(
                    !keep_out.iter().any(|ip| net.contains(ip)),
                    "watched route {net} covers an address kept out"
                );
            }
            let _ = state.request("fuzz", "fuzz");
            if tag % 4 == 1 {
                state.acknowledge();
            } else {
                state.refused();
            }
        }
    }
}
