//! The kubelet stand-in's "container runtime" catalogue: which local program a pod's
//! container image stands for. The lab has no images and no registry; an image name
//! maps to a binary of this workspace or to the machine's own userland. Pure: matching
//! only, no I/O (the binaries are located with [`crate::bin_path`] at start time).
//!
//! Default map ([`ImageMap::lab_default`]); registry host, tag and digest are ignored:
//!
//! | image (examples) | runs |
//! |---|---|
//! | `kvpn/manager:*`, anything whose repository contains `kvpn-manager` (`ghcr.io/x/kvpn-manager:0.1`) | the built `kvpn-manager` |
//! | `kvpn/lab-server:*`, anything whose repository contains `kvpn-lab-server` | the built `kvpn-lab-server` |
//! | `busybox`, `alpine`, `debian`, `ubuntu` (last path component) | the machine's userland: `command`/`args` as given, resolved on `PATH`; no command → `sh` |
//! | `pause` (`registry.k8s.io/pause:3.2`, `k8s.gcr.io/pause`) | `sleep infinity` |
//! | anything else | nothing: the container waits in `ErrImagePull` / `ImagePullBackOff` |
//!
//! For a binary image, `command` (the image's ENTRYPOINT override) may name the binary
//! (`kvpn-manager`, `/usr/local/bin/kvpn-manager`): it is replaced by the built one.
//! Any other `command` runs as given on the machine, as `docker run --entrypoint` would.

use std::path::PathBuf;

/// What a matched image runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageKind {
    /// A binary of this workspace, found with [`crate::bin_path`] (e.g. `kvpn-manager`).
    WorkspaceBinary(String),
    /// The machine's userland: the container's command runs as given; without one,
    /// `default_command`.
    HostUserland { default_command: Vec<String> },
    /// A fixed program with fixed leading arguments (the image's ENTRYPOINT); the
    /// container's `args` follow.
    Program { program: PathBuf, args: Vec<String> },
}

/// How an image name is matched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImagePattern {
    /// The repository path (without registry host, tag, digest) equals this.
    Repository(String),
    /// The repository path contains this.
    RepositoryContains(String),
    /// The repository's last path component equals this (`busybox` matches
    /// `docker.io/library/busybox:1.36`).
    Name(String),
}

impl ImagePattern {
    fn matches(&self, image: &ImageRef) -> bool {
        match self {
            ImagePattern::Repository(r) => image.repository == *r,
            ImagePattern::RepositoryContains(r) => image.repository.contains(r.as_str()),
            ImagePattern::Name(n) => image.name() == n,
        }
    }
}

/// A parsed image reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    /// Registry host, if the reference names one (`ghcr.io`, `localhost:5000`).
    pub registry: Option<String>,
    /// Repository path, e.g. `kvpn/manager` or `library/busybox` → `busybox`
    /// (Docker Hub's `library/` prefix is dropped).
    pub repository: String,
    pub tag: Option<String>,
    pub digest: Option<String>,
}

impl ImageRef {
    /// Parses `[registry/]repository[:tag][@digest]` like Docker does: the first path
    /// component is a registry when it holds a `.` or `:` or is `localhost`.
    pub fn parse(image: &str) -> ImageRef {
        let (rest, digest) = match image.split_once('@') {
            Some((r, d)) => (r, Some(d.to_owned())),
            None => (image, None),
        };
        let (registry, path) = match rest.split_once('/') {
            Some((first, path))
                if first.contains('.') || first.contains(':') || first == "localhost" =>
            {
                (Some(first.to_owned()), path)
            }
            _ => (None, rest),
        };
        // A tag is a `:` after the last `/`.
        let last_slash = path.rfind('/').map_or(0, |i| i + 1);
        let (repository, tag) = match path[last_slash..].rfind(':') {
            Some(i) => (
                &path[..last_slash + i],
                Some(path[last_slash + i + 1..].to_owned()),
            ),
            None => (path, None),
        };
        let repository = repository
            .strip_prefix("library/")
            .unwrap_or(repository)
            .to_owned();
        ImageRef {
            registry,
            repository,
            tag,
            digest,
        }
    }

    /// The repository's last path component.
    pub fn name(&self) -> &str {
        self.repository
            .rsplit('/')
            .next()
            .unwrap_or(&self.repository)
    }
}

/// An ordered list of image patterns; the first match wins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageMap {
    entries: Vec<(ImagePattern, ImageKind)>,
}

impl Default for ImageMap {
    fn default() -> Self {
        ImageMap::lab_default()
    }
}

impl ImageMap {
    /// An empty map: every image fails to "pull".
    pub fn empty() -> ImageMap {
        ImageMap {
            entries: Vec::new(),
        }
    }

    /// The lab's map (see the module docs).
    pub fn lab_default() -> ImageMap {
        let userland = || ImageKind::HostUserland {
            default_command: vec!["sh".to_owned()],
        };
        let mut map = ImageMap::empty();
        map.push(
            ImagePattern::Repository("kvpn/manager".into()),
            ImageKind::WorkspaceBinary("kvpn-manager".into()),
        );
        map.push(
            ImagePattern::RepositoryContains("kvpn-manager".into()),
            ImageKind::WorkspaceBinary("kvpn-manager".into()),
        );
        map.push(
            ImagePattern::Repository("kvpn/lab-server".into()),
            ImageKind::WorkspaceBinary("kvpn-lab-server".into()),
        );
        map.push(
            ImagePattern::RepositoryContains("kvpn-lab-server".into()),
            ImageKind::WorkspaceBinary("kvpn-lab-server".into()),
        );
        for name in ["busybox", "alpine", "debian", "ubuntu"] {
            map.push(ImagePattern::Name(name.into()), userland());
        }
        map.push(
            ImagePattern::Name("pause".into()),
            ImageKind::Program {
                program: PathBuf::from("sleep"),
                args: vec!["infinity".into()],
            },
        );
        map
    }

    /// Adds an entry after the existing ones.
    pub fn push(&mut self, pattern: ImagePattern, kind: ImageKind) -> &mut Self {
        self.entries.push((pattern, kind));
        self
    }

    /// Adds an entry before the existing ones (overrides them).
    pub fn prepend(&mut self, pattern: ImagePattern, kind: ImageKind) -> &mut Self {
        self.entries.insert(0, (pattern, kind));
        self
    }

    /// What `image` runs, or None ("not found in any registry").
    pub fn lookup(&self, image: &str) -> Option<&ImageKind> {
        let parsed = ImageRef::parse(image);
        self.entries
            .iter()
            .find(|(p, _)| p.matches(&parsed))
            .map(|(_, k)| k)
    }

    /// A short list of the known patterns, for error messages.
    pub fn describe(&self) -> String {
        self.entries
            .iter()
            .map(|(p, _)| match p {
                ImagePattern::Repository(r) => r.clone(),
                ImagePattern::RepositoryContains(r) => format!("*{r}*"),
                ImagePattern::Name(n) => n.clone(),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The program and arguments a container runs, before the binary is located.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entrypoint {
    /// Run the workspace binary `name` with `args`.
    WorkspaceBinary { name: String, args: Vec<String> },
    /// Run `program` (a path or a name looked up on `PATH`) with `args`.
    Program { program: String, args: Vec<String> },
}

/// Why a container has nothing to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntrypointError {
    /// The image is not in the map.
    UnknownImage,
    /// A userland image without `command` and without a default command.
    NoCommand,
}

/// Combines the image's entry with the container's `command` and `args` (already
/// `$(VAR)`-expanded) the way a container runtime does: `command` replaces the
/// ENTRYPOINT, `args` the CMD.
pub fn entrypoint(
    map: &ImageMap,
    image: &str,
    command: &[String],
    args: &[String],
) -> Result<Entrypoint, EntrypointError> {
    let kind = map.lookup(image).ok_or(EntrypointError::UnknownImage)?;
    let with_args = |mut v: Vec<String>| {
        v.extend(args.iter().cloned());
        v
    };
    match kind {
        ImageKind::WorkspaceBinary(name) => match command.split_first() {
            None => Ok(Entrypoint::WorkspaceBinary {
                name: name.clone(),
                args: args.to_vec(),
            }),
            Some((first, rest)) if first.rsplit('/').next() == Some(name.as_str()) => {
                Ok(Entrypoint::WorkspaceBinary {
                    name: name.clone(),
                    args: with_args(rest.to_vec()),
                })
            }
            Some((first, rest)) => Ok(Entrypoint::Program {
                program: first.clone(),
                args: with_args(rest.to_vec()),
            }),
        },
        ImageKind::HostUserland { default_command } => {
            let cmd = if command.is_empty() {
                default_command.as_slice()
            } else {
                command
            };
            let (first, rest) = cmd.split_first().ok_or(EntrypointError::NoCommand)?;
            Ok(Entrypoint::Program {
                program: first.clone(),
                args: with_args(rest.to_vec()),
            })
        }
        ImageKind::Program {
            program,
            args: fixed,
        } => match command.split_first() {
            Some((first, rest)) => Ok(Entrypoint::Program {
                program: first.clone(),
                args: with_args(rest.to_vec()),
            }),
            None => Ok(Entrypoint::Program {
                program: program.display().to_string(),
                // The image's CMD is replaced by args when given.
                args: if args.is_empty() {
                    fixed.clone()
                } else {
                    args.to_vec()
                },
            }),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| (*x).to_owned()).collect()
    }

    #[test]
    fn parses_image_references() {
        let r = ImageRef::parse("ghcr.io/acme/kvpn-manager:0.1.0");
        assert_eq!(r.registry.as_deref(), Some("ghcr.io"));
        assert_eq!(r.repository, "acme/kvpn-manager");
        assert_eq!(r.tag.as_deref(), Some("0.1.0"));
        let r = ImageRef::parse("localhost:5000/busybox@sha256:abc");
        assert_eq!(r.registry.as_deref(), Some("localhost:5000"));
        assert_eq!(r.repository, "busybox");
        assert_eq!(r.digest.as_deref(), Some("sha256:abc"));
        let r = ImageRef::parse("docker.io/library/busybox:1.36");
        assert_eq!(r.repository, "busybox");
        let r = ImageRef::parse("kvpn/manager");
        assert_eq!(r.registry, None);
        assert_eq!(r.repository, "kvpn/manager");
        assert_eq!(r.tag, None);
        assert_eq!(ImageRef::parse("registry.k8s.io/pause:3.2").name(), "pause");
    }

    #[test]
    fn default_map_matches_the_documented_images() {
        let m = ImageMap::lab_default();
        let bin = |n: &str| Some(ImageKind::WorkspaceBinary(n.into()));
        assert_eq!(m.lookup("kvpn/manager:0.1").cloned(), bin("kvpn-manager"));
        assert_eq!(
            m.lookup("ghcr.io/x/kvpn-manager:dev").cloned(),
            bin("kvpn-manager")
        );
        assert_eq!(
            m.lookup("kvpn/lab-server:latest").cloned(),
            bin("kvpn-lab-server")
        );
        assert_eq!(m.lookup("kvpn-lab-server").cloned(), bin("kvpn-lab-server"));
        assert!(matches!(
            m.lookup("busybox:1.36"),
            Some(ImageKind::HostUserland { .. })
        ));
        assert!(matches!(
            m.lookup("k8s.gcr.io/pause:3.2"),
            Some(ImageKind::Program { .. })
        ));
        assert_eq!(m.lookup("nginx:1.25"), None);
        // "manager" alone is not the kvpn manager.
        assert_eq!(m.lookup("acme/manager:1"), None);
    }

    #[test]
    fn command_and_args_combine_like_a_runtime() {
        let m = ImageMap::lab_default();
        assert_eq!(
            entrypoint(&m, "kvpn/manager:1", &[], &s(&["--listen", ":1"])),
            Ok(Entrypoint::WorkspaceBinary {
                name: "kvpn-manager".into(),
                args: s(&["--listen", ":1"])
            })
        );
        assert_eq!(
            entrypoint(
                &m,
                "kvpn/manager:1",
                &s(&["/usr/local/bin/kvpn-manager", "-v"]),
                &s(&["x"])
            ),
            Ok(Entrypoint::WorkspaceBinary {
                name: "kvpn-manager".into(),
                args: s(&["-v", "x"])
            })
        );
        assert_eq!(
            entrypoint(&m, "busybox", &s(&["sh", "-c", "exit 3"]), &[]),
            Ok(Entrypoint::Program {
                program: "sh".into(),
                args: s(&["-c", "exit 3"])
            })
        );
        assert_eq!(
            entrypoint(&m, "busybox", &[], &s(&["-c", "true"])),
            Ok(Entrypoint::Program {
                program: "sh".into(),
                args: s(&["-c", "true"])
            })
        );
        assert_eq!(
            entrypoint(&m, "pause", &[], &[]),
            Ok(Entrypoint::Program {
                program: "sleep".into(),
                args: s(&["infinity"])
            })
        );
        assert_eq!(
            entrypoint(&m, "nosuch/image:1", &[], &[]),
            Err(EntrypointError::UnknownImage)
        );
    }
}
