//! Replays the committed cargo-fuzz corpus (fuzz/corpus/frame_decode) through the
//! same entry point the fuzz target uses. CI runs this on every change.

use std::path::Path;

#[test]
fn replay_frame_decode_corpus() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/frame_decode");
    let entries =
        std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()));
    let mut n = 0;
    for entry in entries {
        let path = entry.expect("corpus entry").path();
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        kvpn_proto::fuzzing::frame_decode(&data);
        n += 1;
    }
    assert!(n >= 8, "corpus too small: {n} inputs in {}", dir.display());
}
