//! The arrows between kvpn's crates that must never exist (DESIGN, "Repository
//! layout"): the traffic manager links no laptop code, the root daemon links no
//! Kubernetes/SSH code (the user daemon's `kvpn-control`) and no lab, the CLI links no
//! lab (`kvpn lab` runs the separate kvpn-lab program), the eBPF
//! loader links neither daemon, and the wire formats and map layouts depend on no
//! kvpn crate at all.
//!
//! The graph comes from `cargo metadata --no-deps`: normal and build dependencies
//! between workspace crates, followed through other workspace crates (a manager
//! that reached the root daemon through some third crate would link it all the
//! same). Dev dependencies are left out: tests may use the lab's packet builders.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::process::Command;

/// Which workspace crates a crate must not reach.
#[derive(Debug, Clone, Copy)]
enum Forbidden {
    /// These crates.
    Crates(&'static [&'static str]),
    /// Every other workspace crate.
    AnyWorkspaceCrate,
}

/// The rules: (crate, what it must not reach, why).
const RULES: &[(&str, Forbidden, &str)] = &[
    (
        "kvpn-control",
        Forbidden::Crates(&["kvpn-lab"]),
        "the CLI and user daemon users install ship no lab (`kvpn lab` runs the kvpn-lab program)",
    ),
    (
        "kvpn-manager",
        Forbidden::Crates(&["kvpn-dataplane", "kvpn-control", "kvpn-lab"]),
        "the traffic manager links no laptop or lab code",
    ),
    (
        "kvpn-dataplane",
        Forbidden::Crates(&["kvpn-control", "kvpn-lab"]),
        "the root daemon links no Kubernetes/SSH (user daemon) or lab code",
    ),
    (
        "kvpn-ebpf",
        Forbidden::Crates(&["kvpn-dataplane", "kvpn-control", "kvpn-lab", "kvpn-manager"]),
        "the eBPF loader is shared by both daemons and links neither",
    ),
    (
        "kvpn-proto",
        Forbidden::AnyWorkspaceCrate,
        "the wire formats depend on no kvpn crate",
    ),
    (
        "kvpn-dataplane-common",
        Forbidden::AnyWorkspaceCrate,
        "the eBPF map layout depends on no kvpn crate",
    ),
    (
        "kvpn-exec",
        Forbidden::AnyWorkspaceCrate,
        "the command lookup shared by kvpn run and kvpn lab exec depends on no kvpn crate",
    ),
];

/// Dependency kinds that put a crate into another's build: `None` is a normal
/// dependency in cargo's metadata.
fn counts(kind: Option<&str>) -> Option<&'static str> {
    match kind {
        None => Some("normal"),
        Some("build") => Some("build"),
        _ => None,
    }
}

/// Workspace crate -> (workspace crate it depends on, "normal" or "build").
type Graph = BTreeMap<String, Vec<(String, &'static str)>>;

/// The workspace's crates and their normal and build dependencies on each other,
/// from `cargo metadata --format-version 1 --no-deps` output.
fn graph_from_metadata(metadata: &serde_json::Value) -> Graph {
    let packages = metadata["packages"]
        .as_array()
        .unwrap_or_else(|| panic!("cargo metadata has no `packages` array: {metadata}"));
    let name = |v: &serde_json::Value| {
        v["name"]
            .as_str()
            .unwrap_or_else(|| panic!("cargo metadata entry without a name: {v}"))
            .to_owned()
    };
    let members: BTreeSet<String> = packages.iter().map(name).collect();
    packages
        .iter()
        .map(|package| {
            let deps = package["dependencies"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .filter_map(|dep| {
                    let kind = counts(dep["kind"].as_str())?;
                    let dep = name(dep);
                    members.contains(&dep).then_some((dep, kind))
                })
                .collect();
            (name(package), deps)
        })
        .collect()
}

/// Every forbidden arrow of `rules` in `graph`, one line each: the shortest path
/// from the crate to the forbidden one, each hop with its dependency kind.
fn forbidden_arrows(graph: &Graph, rules: &[(&str, Forbidden, &str)]) -> Vec<String> {
    let mut found = Vec::new();
    for &(from, forbidden, why) in rules {
        // Breadth-first, so each crate is reached first by a shortest path.
        let mut via: BTreeMap<&str, (&str, &str)> = BTreeMap::new();
        let mut queue = VecDeque::from([from]);
        while let Some(at) = queue.pop_front() {
            for (dep, kind) in graph.get(at).map(Vec::as_slice).unwrap_or_default() {
                if dep != from && !via.contains_key(dep.as_str()) {
                    via.insert(dep.as_str(), (at, *kind));
                    queue.push_back(dep.as_str());
                }
            }
        }
        for &to in via.keys() {
            let banned = match forbidden {
                Forbidden::Crates(crates) => crates.contains(&to),
                Forbidden::AnyWorkspaceCrate => true,
            };
            if !banned {
                continue;
            }
            let mut hops = Vec::new();
            let mut at = to;
            while at != from {
                let (prev, kind) = via[at];
                hops.push(format!("-> {at} ({kind})"));
                at = prev;
            }
            hops.reverse();
            found.push(format!("{from} {}: {why}", hops.join(" ")));
        }
    }
    found
}

fn workspace_metadata() -> serde_json::Value {
    // cargo sets CARGO for the tests it runs; "cargo" on PATH when run by hand.
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml");
    let output = Command::new(&cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .args(["--manifest-path", manifest])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} metadata: {e}", cargo.to_string_lossy()));
    assert!(
        output.status.success(),
        "cargo metadata --manifest-path {manifest} failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("cargo metadata printed no JSON: {e}"))
}

#[test]
fn no_forbidden_arrow_between_workspace_crates() {
    let graph = graph_from_metadata(&workspace_metadata());
    // A renamed crate would make its rule check nothing: every crate a rule names
    // must be in the workspace.
    for (from, forbidden, _) in RULES {
        let named: &[&str] = match forbidden {
            Forbidden::Crates(crates) => crates,
            Forbidden::AnyWorkspaceCrate => &[],
        };
        for krate in std::iter::once(from).chain(named) {
            assert!(
                graph.contains_key(*krate),
                "the arrow rules name {krate}, which is not a workspace crate (renamed? \
                 update RULES): workspace has {:?}",
                graph.keys().collect::<Vec<_>>()
            );
        }
    }
    let arrows = forbidden_arrows(&graph, RULES);
    assert!(
        arrows.is_empty(),
        "forbidden dependencies between kvpn crates (normal or build; remove them or \
         move the shared code into a crate both sides may use):\n  {}",
        arrows.join("\n  ")
    );
}

#[test]
fn direct_and_transitive_arrows_are_reported_dev_dependencies_are_not() {
    let metadata = serde_json::json!({ "packages": [
        { "name": "kvpn-manager", "dependencies": [
            { "name": "kvpn-ebpf", "kind": null },
            { "name": "kvpn-lab", "kind": "dev" },
            { "name": "tokio", "kind": null },
        ]},
        { "name": "kvpn-ebpf", "dependencies": [
            { "name": "kvpn-dataplane", "kind": "build" },
        ]},
        { "name": "kvpn-dataplane", "dependencies": [
            { "name": "kvpn-proto", "kind": null },
        ]},
        { "name": "kvpn-proto", "dependencies": [] },
        { "name": "kvpn-dataplane-common", "dependencies": [
            { "name": "kvpn-proto", "kind": null },
        ]},
        { "name": "kvpn-lab", "dependencies": [] },
        { "name": "kvpn-control", "dependencies": [
            { "name": "kvpn-lab", "kind": null },
        ]},
    ]});
    let graph = graph_from_metadata(&metadata);
    let arrows = forbidden_arrows(&graph, RULES);
    assert_eq!(
        arrows,
        [
            "kvpn-control -> kvpn-lab (normal): the CLI and user daemon users install ship \
             no lab (`kvpn lab` runs the kvpn-lab program)",
            "kvpn-manager -> kvpn-ebpf (normal) -> kvpn-dataplane (build): \
             the traffic manager links no laptop or lab code",
            "kvpn-ebpf -> kvpn-dataplane (build): \
             the eBPF loader is shared by both daemons and links neither",
            "kvpn-dataplane-common -> kvpn-proto (normal): \
             the eBPF map layout depends on no kvpn crate",
        ]
    );
}
