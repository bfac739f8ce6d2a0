//! kvpn's build identity: the version (the workspace's) and the source commit
//! the binaries were built from, which `kvpn version` shows for the CLI, both
//! daemons and the traffic manager. The commit comes from build.rs (git at build
//! time, or `KVPN_COMMIT`); "unknown" outside a git checkout.
//!
//! A crate of its own so that a new commit rebuilds this and its dependents,
//! never a build script with more work in it (dataplane's compiles eBPF).

/// kvpn's version, e.g. "0.1.0".
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The short commit hash the build came from, or [`UNKNOWN_COMMIT`].
pub const COMMIT: &str = env!("KVPN_BUILD_COMMIT");

/// "0.1.0 (commit 5d92e3c)": what `--version` prints after the program name.
pub const VERSION_LINE: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("KVPN_BUILD_COMMIT"),
    ")"
);

/// [`COMMIT`] when the build knew none.
pub const UNKNOWN_COMMIT: &str = "unknown";

#[cfg(test)]
mod tests {
    use super::*;

    /// The commit is a short hex hash from git, or "unknown": never empty,
    /// never git's error text.
    #[test]
    fn commit_is_a_short_hash_or_unknown() {
        assert!(
            COMMIT == UNKNOWN_COMMIT
                || (COMMIT.len() >= 7 && COMMIT.chars().all(|c| c.is_ascii_hexdigit())),
            "{COMMIT:?}"
        );
        assert_eq!(VERSION, env!("CARGO_PKG_VERSION"));
    }
}
