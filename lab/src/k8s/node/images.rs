//! Images for the real nodes.
//!
//! The project's own archives (`cargo xtask image`: manager, lab server, pause) are
//! found with [`project_archive`] and imported as they are. For pods that need a
//! shell (`kubectl exec` tests), a small archive of Debian's busybox-static built
//! with umoci, with two tags — `busybox` (no entrypoint; pods give a command) and
//! `pause` (`busybox sleep` for ~68 years). Import it with `--base-name`
//! [`BASE_NAME`]: the images are then `kvpn.local/lab:busybox` and
//! `kvpn.local/lab:pause`.
//!
//! I/O: reads the environment, runs `umoci` and `tar`, writes under the given folder.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{Error, ImageArchive};

/// The `--base-name` of the archive's images.
pub const BASE_NAME: &str = "kvpn.local/lab";
/// The workload image (busybox applets, no entrypoint).
pub const BUSYBOX_IMAGE: &str = "kvpn.local/lab:busybox";
/// The pod sandbox image.
pub const PAUSE_IMAGE: &str = "kvpn.local/lab:pause";
/// Debian's busybox-static.
const BUSYBOX: &str = "/usr/bin/busybox";
/// Applets linked in `/bin` (what the lab's tests and pods call).
const APPLETS: [&str; 20] = [
    "sh",
    "sleep",
    "httpd",
    "wget",
    "hostname",
    "cat",
    "echo",
    "ls",
    "mkdir",
    "head",
    "md5sum",
    "nc",
    "ip",
    "ping",
    "sync",
    "dd",
    "env",
    "true",
    "sha256sum",
    "printf",
];

/// The folder of the project's OCI image archives (`cargo xtask image`):
/// `$KVPN_IMAGE_DIR`, else `$KVPN_CACHE/images`, else `/var/cache/kvpn/images`.
pub fn project_image_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("KVPN_IMAGE_DIR") {
        return PathBuf::from(d);
    }
    let cache = std::env::var("KVPN_CACHE").unwrap_or_else(|_| "/var/cache/kvpn".into());
    PathBuf::from(cache).join("images")
}

/// The name of the project's image `key` (`manager`, `lab-server`, `pause`) at this
/// version, as its archive's index names it: `localhost/kvpn/<key>:<version>`.
pub fn project_image(key: &str) -> String {
    format!("localhost/kvpn/{key}:{}", env!("CARGO_PKG_VERSION"))
}

/// The archive `kvpn-<key>-<version>.oci.tar` of [`project_image_dir`], to import as
/// it is (its index names the image in full); an error with the fix when it was not
/// built.
pub fn project_archive(key: &str) -> Result<ImageArchive, Error> {
    let path =
        project_image_dir().join(format!("kvpn-{key}-{}.oci.tar", env!("CARGO_PKG_VERSION")));
    if !path.is_file() {
        return Err(Error::MissingBinary {
            name: format!("the {key} image archive"),
            path,
            hint: "build the project's images with `cargo xtask image` (`./x test` does it first) or point KVPN_IMAGE_DIR at them",
        });
    }
    Ok(ImageArchive {
        path,
        base_name: None,
    })
}

fn run(cmd: &mut Command) -> Result<(), Error> {
    let text = format!("{cmd:?}");
    let out = cmd.output().map_err(|source| Error::Io {
        what: format!("running {text} (install umoci: scripts/setup.sh)"),
        source,
    })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Error::Command {
            cmd: text,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

/// Builds `<dir>/busybox-oci.tar` (an OCI layout as tar) and returns it as an
/// [`ImageArchive`] with base name [`BASE_NAME`]. About 1 MiB; takes well under a
/// second.
pub fn busybox_archive(dir: &Path) -> Result<ImageArchive, Error> {
    if !Path::new(BUSYBOX).is_file() {
        return Err(Error::MissingBinary {
            name: "busybox".into(),
            path: PathBuf::from(BUSYBOX),
            hint: "install Debian's busybox-static (scripts/setup.sh does)",
        });
    }
    let work = dir.join("busybox-image");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(|source| Error::Io {
        what: format!("creating {}", work.display()),
        source,
    })?;
    let layout = work.join("oci");
    let bundle = work.join("bundle");
    let image = |tag: &str| format!("{}:{tag}", layout.display());
    run(Command::new("umoci")
        .args(["init", "--layout"])
        .arg(&layout))?;
    run(Command::new("umoci").args(["new", "--image", &image("busybox")]))?;
    run(Command::new("umoci")
        .args(["unpack", "--image", &image("busybox")])
        .arg(&bundle))?;
    let rootfs = bundle.join("rootfs");
    for d in ["bin", "tmp", "etc", "proc", "sys", "dev"] {
        std::fs::create_dir_all(rootfs.join(d)).map_err(|source| Error::Io {
            what: format!("creating {}", rootfs.join(d).display()),
            source,
        })?;
    }
    std::fs::copy(BUSYBOX, rootfs.join("bin/busybox")).map_err(|source| Error::Io {
        what: format!("copying {BUSYBOX}"),
        source,
    })?;
    for a in APPLETS {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(a)).map_err(|source| {
            Error::Io {
                what: format!("linking applet {a}"),
                source,
            }
        })?;
    }
    run(Command::new("umoci")
        .args(["repack", "--image", &image("busybox")])
        .arg(&bundle))?;
    run(Command::new("umoci").args([
        "config",
        "--image",
        &image("busybox"),
        "--tag",
        "pause",
        "--config.entrypoint",
        "/bin/busybox",
        "--config.cmd",
        "sleep",
        "--config.cmd",
        "2147483647",
    ]))?;
    let archive = dir.join("busybox-oci.tar");
    run(Command::new("tar")
        .arg("-C")
        .arg(&layout)
        .arg("-cf")
        .arg(&archive)
        .arg("."))?;
    let _ = std::fs::remove_dir_all(&work);
    Ok(ImageArchive {
        path: archive,
        base_name: Some(BASE_NAME.to_owned()),
    })
}
