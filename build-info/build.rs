//! Embeds the source commit (`git rev-parse --short HEAD`) as `KVPN_BUILD_COMMIT`:
//! `KVPN_COMMIT` from the environment when set (an image build from a tarball),
//! else git's answer, else "unknown" (not a git checkout, or no git).
//!
//! Reruns when HEAD moves: HEAD itself (a checkout of another branch), the ref
//! it points at (a commit on the branch) and packed-refs (git gc packs refs).
//! A file that does not exist is not named: cargo would rerun every build.

use std::path::{Path, PathBuf};
use std::process::Command;

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(dir)
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?.trim().to_owned();
    (!text.is_empty()).then_some(text)
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=KVPN_COMMIT");
    let dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    // Worktrees keep HEAD in .git/worktrees/<name>/ and refs in the common
    // folder: ask git where each file is rather than assuming .git/HEAD.
    let mut watched = vec![git(&dir, &["rev-parse", "--git-path", "HEAD"])];
    if let Some(head_ref) = git(&dir, &["symbolic-ref", "-q", "HEAD"]) {
        watched.push(git(&dir, &["rev-parse", "--git-path", &head_ref]));
    }
    watched.push(git(&dir, &["rev-parse", "--git-path", "packed-refs"]));
    for path in watched.into_iter().flatten() {
        let path = dir.join(path);
        if path.exists() {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
    let commit = std::env::var("KVPN_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .or_else(|| git(&dir, &["rev-parse", "--short", "HEAD"]))
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=KVPN_BUILD_COMMIT={commit}");
}
