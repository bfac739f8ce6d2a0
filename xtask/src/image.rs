//! `cargo xtask image`: the project's OCI images, built without Docker.
//!
//! Each image is one static (musl) binary of this workspace on an empty base
//! (`FROM scratch`), run as the numeric non-root user 65532, with the binary as
//! entrypoint and OCI labels and annotations naming the version and source commit.
//! `images/Containerfile` describes the same image for docker/podman/buildah.
//!
//! Steps, each with a Debian tool rather than a hand-written format:
//! 1. `cargo build --profile image --target x86_64-unknown-linux-musl` of the
//!    binaries (the manager's eBPF object is embedded by its build script);
//! 2. a staging folder with the binary, every mtime set to the commit's time;
//! 3. the layer as a GNU tar (ustar, sorted, fixed mtime and owner), then
//!    `umoci init/new/raw add-layer/config/gc` into a scratch OCI layout, with every
//!    timestamp set to the commit's time (so two builds of one commit give the same
//!    digest);
//! 4. `skopeo copy oci:… oci:…:NAME` so the layout's index names the image in full
//!    (`ctr images import`, `kind load image-archive` and `podman load` then need no
//!    extra name flag);
//! 5. GNU tar with sorted names, fixed mtimes and owners: the OCI image archive
//!    `<out>/<file>.oci.tar`.
//!
//! I/O: cargo, umoci, skopeo, tar and git as child processes; files under `--out`
//! (default `$KVPN_CACHE/images`) and a scratch folder beside it.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, Result, bail};

/// The musl target of every image binary.
pub const TARGET: &str = "x86_64-unknown-linux-musl";
/// The cargo profile of image binaries (Cargo.toml: release, stripped).
pub const PROFILE: &str = "image";
/// The numeric user every image runs as (the "nonroot" uid of distroless images).
pub const USER: &str = "65532:65532";

/// One image the project builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageDef {
    /// Short name used on the command line and in file names (`manager`).
    pub key: &'static str,
    /// Repository without tag; the tag is the kvpn version.
    pub repository: &'static str,
    /// Cargo package and binary.
    pub package: &'static str,
    pub binary: &'static str,
    /// `org.opencontainers.image.description`.
    pub description: &'static str,
}

/// Every image: the manager users install, and the lab's own images.
pub const IMAGES: &[ImageDef] = &[
    ImageDef {
        key: "manager",
        repository: "localhost/kvpn/manager",
        package: "kvpn-manager",
        binary: "kvpn-manager",
        description: "kvpn traffic manager: terminates laptop sessions and dials cluster destinations",
    },
    ImageDef {
        key: "lab-server",
        repository: "localhost/kvpn/lab-server",
        package: "kvpn-lab",
        binary: "kvpn-lab-server",
        description: "kvpn lab backend (HTTP, TCP and UDP echo); lab-only",
    },
    ImageDef {
        key: "pause",
        repository: "localhost/kvpn/pause",
        package: "kvpn-lab",
        binary: "kvpn-lab-pause",
        description: "kvpn lab pod sandbox (pause) image; lab-only",
    },
];

/// What `image` was asked to do.
#[derive(Debug, Clone)]
pub struct ImageRequest {
    pub root: PathBuf,
    pub target_dir: PathBuf,
    pub out: PathBuf,
    /// Image keys; empty means all.
    pub only: Vec<String>,
    /// Reuse the binaries already built (no cargo call).
    pub no_build: bool,
    pub version: String,
    /// PATH for cargo (the manager's build script needs bpf-linker from the cache).
    pub path: String,
}

/// One built image, as reported.
#[derive(Debug, Clone)]
pub struct Built {
    pub name: String,
    pub archive: PathBuf,
    /// The manifest digest (`sha256:…`): what `ctr images ls` and a registry show.
    pub digest: String,
    pub archive_bytes: u64,
}

fn run(cmd: &mut Command) -> Result<()> {
    let shown = format!("{cmd:?}");
    let out = cmd.output().with_context(|| {
        format!("cannot run {shown} (is it installed? scripts/setup.sh installs umoci, skopeo)")
    })?;
    if !out.status.success() {
        bail!(
            "{shown} failed with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The source commit (`git rev-parse HEAD`, `-dirty` when the tree has changes) and
/// its commit time (seconds since the epoch), or `unknown` and 0 outside git.
pub fn source(root: &Path) -> (String, u64) {
    let git = |args: &[&str]| output(Command::new("git").arg("-C").arg(root).args(args));
    let Some(commit) = git(&["rev-parse", "HEAD"]) else {
        return ("unknown".into(), 0);
    };
    let dirty =
        git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    let time = git(&["log", "-1", "--format=%ct"])
        .and_then(|t| t.parse().ok())
        .unwrap_or(0);
    (
        if dirty {
            format!("{commit}-dirty")
        } else {
            commit
        },
        time,
    )
}

/// RFC 3339 UTC for `secs` since the epoch (days from civil, Howard Hinnant's method).
pub fn rfc3339(secs: u64) -> String {
    let days = secs / 86_400;
    let rem = secs % 86_400;
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// The images `only` names (all when empty), or an error naming the known keys.
pub fn select(only: &[String]) -> Result<Vec<ImageDef>> {
    if only.is_empty() {
        return Ok(IMAGES.to_vec());
    }
    only.iter()
        .map(|k| {
            IMAGES
                .iter()
                .copied()
                .find(|d| d.key == k)
                .with_context(|| {
                    let known: Vec<_> = IMAGES.iter().map(|d| d.key).collect();
                    format!(
                        "no image named {k:?}: the project builds {}",
                        known.join(", ")
                    )
                })
        })
        .collect()
}

/// Builds the selected images.
pub fn build(req: &ImageRequest) -> Result<Vec<Built>> {
    let defs = select(&req.only)?;
    let (commit, time) = source(&req.root);
    if !req.no_build {
        compile(req, &defs)?;
    }
    std::fs::create_dir_all(&req.out)
        .with_context(|| format!("cannot create {}", req.out.display()))?;
    let bins = req.target_dir.join(TARGET).join(PROFILE);
    defs.iter()
        .map(|def| {
            let binary = bins.join(def.binary);
            if !binary.is_file() {
                bail!(
                    "{} is not built: run `cargo xtask image` without --no-build",
                    binary.display()
                );
            }
            assemble(def, &binary, &req.version, &commit, time, &req.out)
        })
        .collect()
}

/// `cargo build` of the images' binaries, static, with paths in the binaries made
/// independent of where the checkout and the cargo home are.
fn compile(req: &ImageRequest, defs: &[ImageDef]) -> Result<()> {
    let cargo_home = std::env::var("CARGO_HOME").unwrap_or_else(|_| {
        format!(
            "{}/.cargo",
            std::env::var("HOME").unwrap_or_else(|_| "/root".into())
        )
    });
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(&req.root)
        .args(["build", "--profile", PROFILE, "--target", TARGET]);
    let mut packages: Vec<&str> = defs.iter().map(|d| d.package).collect();
    packages.dedup();
    for p in packages {
        cmd.args(["-p", p]);
    }
    for d in defs {
        cmd.args(["--bin", d.binary]);
    }
    cmd.env("PATH", &req.path).env(
        "CARGO_TARGET_X86_64_UNKNOWN_LINUX_MUSL_RUSTFLAGS",
        format!(
            "--remap-path-prefix={}=/src/kvpn --remap-path-prefix={cargo_home}=/cargo",
            req.root.display()
        ),
    );
    let shown = format!("{cmd:?}");
    let status = cmd
        .status()
        .with_context(|| format!("cannot run {shown}"))?;
    if !status.success() {
        bail!(
            "{shown} failed with {status} (the musl target comes from `rustup target add {TARGET}`, musl-gcc from musl-tools: scripts/setup.sh installs both)"
        );
    }
    Ok(())
}

fn assemble(
    def: &ImageDef,
    binary: &Path,
    version: &str,
    commit: &str,
    time: u64,
    out: &Path,
) -> Result<Built> {
    let name = format!("{}:{version}", def.repository);
    let created = rfc3339(time);
    let scratch = out.join(format!(".{}.work", def.key));
    let _ = std::fs::remove_dir_all(&scratch);
    let stage = scratch.join("rootfs");
    std::fs::create_dir_all(&stage)?;
    let staged = stage.join(def.binary);
    std::fs::copy(binary, &staged)
        .with_context(|| format!("cannot copy {} into the image", binary.display()))?;
    run(Command::new("chmod").arg("0755").arg(&staged).arg(&stage))?;
    run(Command::new("touch")
        .args(["-h", "-d", &format!("@{time}")])
        .arg(&staged)
        .arg(&stage))?;

    let layout = scratch.join("layout");
    let img = format!("{}:build", layout.display());
    run(Command::new("umoci")
        .args(["init", "--layout"])
        .arg(&layout))?;
    run(Command::new("umoci").args(["new", "--image", &img]))?;
    // The layer is a tar GNU tar writes (ustar, sorted, the commit's mtime, owner
    // 0), added verbatim: `umoci insert` (0.4.7) left its layer tar unterminated —
    // no padding after the binary's last 72 bytes and no end-of-archive blocks —
    // which Go readers (containerd, podman) took but GNU tar truncates.
    let layer = scratch.join("layer.tar");
    run(Command::new("tar")
        .args([
            "--sort=name",
            &format!("--mtime=@{time}"),
            "--owner=0",
            "--group=0",
            "--numeric-owner",
            "--format=ustar",
        ])
        .arg("-C")
        .arg(&stage)
        .arg("-cf")
        .arg(&layer)
        .arg(def.binary))?;
    run(Command::new("umoci")
        .args(["raw", "add-layer", "--image", &img])
        .args(["--history.created", &created])
        .args([
            "--history.created_by",
            &format!("kvpn image {}", def.binary),
        ])
        .arg(&layer))?;
    let labels = [
        ("org.opencontainers.image.title", def.binary.to_owned()),
        (
            "org.opencontainers.image.description",
            def.description.to_owned(),
        ),
        ("org.opencontainers.image.version", version.to_owned()),
        ("org.opencontainers.image.revision", commit.to_owned()),
        ("org.opencontainers.image.created", created.clone()),
        ("org.opencontainers.image.licenses", "Apache-2.0".to_owned()),
    ];
    let mut config = Command::new("umoci");
    config
        .args([
            "config",
            "--image",
            &img,
            "--created",
            &created,
            "--no-history",
        ])
        .args(["--config.user", USER])
        .args(["--config.entrypoint", &format!("/{}", def.binary)])
        .args(["--config.workingdir", "/"]);
    for (k, v) in &labels {
        config
            .args(["--config.label", &format!("{k}={v}")])
            .args(["--manifest.annotation", &format!("{k}={v}")]);
    }
    // The image's name is an annotation (as `skopeo copy` writes it into the
    // index), not a label: a label would travel with the image to a registry
    // under another name (images/Containerfile sets the same labels).
    config.args([
        "--manifest.annotation",
        &format!("org.opencontainers.image.ref.name={name}"),
    ]);
    run(&mut config)?;
    run(Command::new("umoci").args(["gc", "--layout"]).arg(&layout))?;

    let named = scratch.join("named");
    run(Command::new("skopeo")
        .args(["copy", "--quiet"])
        .arg(format!("oci:{img}"))
        .arg(format!("oci:{}:{name}", named.display())))?;

    let archive = out.join(format!("kvpn-{}-{version}.oci.tar", def.key));
    let partial = out.join(format!(".kvpn-{}-{version}.oci.tar.partial", def.key));
    run(Command::new("tar")
        .args([
            "--sort=name",
            "--mtime=@0",
            "--owner=0",
            "--group=0",
            "--numeric-owner",
            "--mode=go+rX,go-w",
            "--format=gnu",
        ])
        .arg("-C")
        .arg(&named)
        .arg("-cf")
        .arg(&partial)
        .arg("."))?;
    std::fs::rename(&partial, &archive)?;
    let digest = manifest_digest(&named.join("index.json"))?;
    std::fs::remove_dir_all(&scratch)?;
    let archive_bytes = std::fs::metadata(&archive)?.len();
    Ok(Built {
        name,
        archive,
        digest,
        archive_bytes,
    })
}

/// The first manifest's digest in an OCI `index.json`.
fn manifest_digest(index: &Path) -> Result<String> {
    let text = std::fs::read_to_string(index)
        .with_context(|| format!("cannot read {}", index.display()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", index.display()))?;
    json["manifests"][0]["digest"]
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("{} names no manifest", index.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_matches_known_instants() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_535_045), "2026-12-06T05:30:45Z");
    }

    #[test]
    fn unknown_image_names_the_known_ones() {
        let e = select(&["nope".into()]).expect_err("unknown image");
        assert!(e.to_string().contains("manager, lab-server, pause"), "{e}");
        assert_eq!(select(&[]).expect("all").len(), IMAGES.len());
    }
}
