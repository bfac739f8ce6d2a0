//! A small OCI image archive for the real nodes until the project's own images
//! (`cargo xtask image`) exist: Debian's busybox-static in an empty image, built with
//! umoci, with two tags — `busybox` (no entrypoint; pods give a command) and `pause`
//! (the pod sandbox: `busybox sleep` for ~68 years).
//!
//! Import it with `--base-name` [`BASE_NAME`]: the images are then
//! `kvpn.local/lab:busybox` and `kvpn.local/lab:pause`.
//!
//! I/O: runs `umoci` and `tar`, writes under the given folder.

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
