//! Replays every committed cargo-fuzz input — the corpora in
//! `fuzz/corpus/<target>/` and the crash regressions in
//! `fuzz/artifacts-regressions/<target>/` — through the same entry functions
//! the fuzz targets call (`<crate>::fuzzing::<target>`), on stable, in
//! seconds. CI runs this with every `./x test`; `./x fuzz` runs the fuzzers.
//!
//! Fails when an input panics, when a target under `fuzz/fuzz_targets/` has
//! no entry here or no corpus, or when a corpus is nearly empty.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

/// A target's entry function: one fuzz input.
type Entry = fn(&[u8]);

/// Every fuzz target and its entry function.
const TARGETS: &[(&str, Entry)] = &[
    ("frame_decode", kvpn_proto::fuzzing::frame_decode),
    ("packet_parse", kvpn_manager::fuzzing::packet_parse),
    ("frag_reassembly", kvpn_manager::fuzzing::frag_reassembly),
    ("engine_ingest", kvpn_manager::fuzzing::engine_ingest),
    ("lease_hello", kvpn_manager::fuzzing::lease_hello),
    ("dns_query", kvpn_dataplane::fuzzing::dns_query),
    ("dns_answer", kvpn_dataplane::fuzzing::dns_answer),
    (
        "dns_cluster_config",
        kvpn_dataplane::fuzzing::dns_cluster_config,
    ),
    ("ssh_config", kvpn_control::fuzzing::ssh_config),
    ("known_hosts", kvpn_control::fuzzing::known_hosts),
    ("cidr_flags", kvpn_control::fuzzing::cidr_flags),
    ("kubeconfig", kvpn_control::fuzzing::kubeconfig),
    ("manager_messages", kvpn_control::fuzzing::manager_messages),
];

/// Fewest seed inputs a corpus may have.
const MIN_CORPUS: usize = 5;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .map(|e| e.expect("corpus directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    out.sort();
    out
}

/// Runs every input of `target`; returns how many ran.
fn replay(target: &str) -> usize {
    let entry = TARGETS
        .iter()
        .find(|(name, _)| *name == target)
        .map(|(_, f)| *f)
        .unwrap_or_else(|| panic!("no entry function for fuzz target {target}"));
    let corpus = fuzz_dir().join("corpus").join(target);
    let inputs = files(&corpus);
    assert!(
        inputs.len() >= MIN_CORPUS,
        "fuzz target {target}: {} inputs in {} (need {MIN_CORPUS}) — run `python3 fuzz/seeds.py`",
        inputs.len(),
        corpus.display()
    );
    let regressions = files(&fuzz_dir().join("artifacts-regressions").join(target));
    let mut failed = Vec::new();
    for path in inputs.iter().chain(&regressions) {
        let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        if catch_unwind(AssertUnwindSafe(|| entry(&data))).is_err() {
            failed.push(path.display().to_string());
        }
    }
    assert!(
        failed.is_empty(),
        "fuzz target {target}: these inputs panic (see the messages above): {failed:#?}"
    );
    inputs.len() + regressions.len()
}

#[test]
fn every_fuzz_target_has_an_entry_and_a_corpus() {
    let dir = fuzz_dir().join("fuzz_targets");
    let mut found: Vec<String> = files(&dir)
        .iter()
        .filter_map(|p| Some(p.file_stem()?.to_str()?.to_owned()))
        .collect();
    found.sort();
    let mut listed: Vec<String> = TARGETS.iter().map(|(n, _)| (*n).to_owned()).collect();
    listed.sort();
    assert_eq!(
        found, listed,
        "fuzz/fuzz_targets/ and this test's TARGETS differ: add the entry here"
    );
    for (name, _) in TARGETS {
        assert!(
            fuzz_dir().join("corpus").join(name).is_dir(),
            "fuzz target {name} has no corpus directory"
        );
    }
    // The cargo-fuzz manifest names every target too.
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).expect("fuzz/Cargo.toml");
    for (name, _) in TARGETS {
        assert!(
            manifest.contains(&format!("name = \"{name}\"")),
            "fuzz/Cargo.toml has no [[bin]] {name}"
        );
    }
}

macro_rules! replay_tests {
    ($($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                let n = replay(stringify!($name));
                assert!(n >= MIN_CORPUS);
            }
        )*
    };
}

replay_tests!(
    frame_decode,
    packet_parse,
    frag_reassembly,
    engine_ingest,
    lease_hello,
    dns_query,
    dns_answer,
    dns_cluster_config,
    ssh_config,
    known_hosts,
    cidr_flags,
    kubeconfig,
    manager_messages,
);
