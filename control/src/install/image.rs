//! The manager image: its default name, the check of an image reference a user
//! typed, and which image a later install keeps. Pure: no I/O.
//!
//! The default is the name `cargo xtask image` (./x image) gives the image it
//! builds, `localhost/kvpn/manager:<version>`: no public registry serves kvpn's
//! manager, so a cluster gets it by loading the project's archive (containerd, kind,
//! podman) or from the user's own registry (`--image`). `localhost/` is the prefix
//! podman and buildah give local images; pulling it from a node fails at once, with
//! the fix in [`pull_hint`].

use thiserror::Error;

/// Repository of the image `cargo xtask image manager` builds (xtask/src/image.rs).
pub const DEFAULT_REPOSITORY: &str = "localhost/kvpn/manager";

/// The default manager image for a kvpn version (`--image` and the settings file
/// override it).
pub fn default_image(version: &str) -> String {
    format!("{DEFAULT_REPOSITORY}:{version}")
}

/// Why an image reference was refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum RefError {
    #[error("image {image:?} is empty")]
    Empty { image: String },
    #[error(
        "image {image:?} has upper-case letters in its repository path {path:?}; registries accept only lower case (fix: {suggest})"
    )]
    UpperCase {
        image: String,
        path: String,
        suggest: String,
    },
    #[error(
        "image {image:?}: path component {component:?} is not valid (lower-case letters, digits and single '.', '_', '__' or '-' between them)"
    )]
    Component { image: String, component: String },
    #[error(
        "image {image:?}: tag {tag:?} is not valid (letters, digits, '_', '.', '-', at most 128, not starting with '.' or '-')"
    )]
    Tag { image: String, tag: String },
    #[error(
        "image {image:?}: digest {digest:?} is not valid (sha256: and 64 lower-case hex digits)"
    )]
    Digest { image: String, digest: String },
    #[error("image {image:?}: registry {registry:?} is not a valid host[:port]")]
    Registry { image: String, registry: String },
}

/// Checks `image` against the reference grammar registries and container runtimes
/// use (distribution/reference: `[registry/]path[:tag][@sha256:digest]`), so a typo
/// fails before anything is written to the cluster instead of as `InvalidImageName`
/// on the node.
pub fn validate(image: &str) -> Result<(), RefError> {
    let err_image = || image.to_owned();
    if image.trim().is_empty() {
        return Err(RefError::Empty { image: err_image() });
    }
    let (rest, digest) = match image.split_once('@') {
        Some((r, d)) => (r, Some(d)),
        None => (image, None),
    };
    if let Some(d) = digest {
        let ok = d.strip_prefix("sha256:").is_some_and(|h| {
            h.len() == 64
                && h.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        });
        if !ok {
            return Err(RefError::Digest {
                image: err_image(),
                digest: d.to_owned(),
            });
        }
    }
    // A tag is after the last ':' that follows the last '/'.
    let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
    let (name, tag) = match rest[last_slash..].rfind(':') {
        Some(i) => (&rest[..last_slash + i], Some(&rest[last_slash + i + 1..])),
        None => (rest, None),
    };
    if let Some(t) = tag {
        let ok = !t.is_empty()
            && t.len() <= 128
            && !t.starts_with(['.', '-'])
            && t.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
        if !ok {
            return Err(RefError::Tag {
                image: err_image(),
                tag: t.to_owned(),
            });
        }
    }
    let mut parts: Vec<&str> = name.split('/').collect();
    let registry = match parts.first() {
        Some(first)
            if parts.len() > 1
                && (first.contains('.') || first.contains(':') || *first == "localhost") =>
        {
            Some(parts.remove(0))
        }
        _ => None,
    };
    if let Some(r) = registry {
        let (host, port) = match r.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (r, None),
        };
        let host_ok = !host.is_empty()
            && host.split('.').all(|l| {
                !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            });
        let port_ok = port.is_none_or(|p| p.parse::<u16>().is_ok());
        if !host_ok || !port_ok {
            return Err(RefError::Registry {
                image: err_image(),
                registry: r.to_owned(),
            });
        }
    }
    let path = parts.join("/");
    if path.bytes().any(|b| b.is_ascii_uppercase()) {
        let fixed = image.replacen(&path, &path.to_ascii_lowercase(), 1);
        return Err(RefError::UpperCase {
            image: err_image(),
            path,
            suggest: format!("--image {fixed}"),
        });
    }
    for c in parts {
        if !component_ok(c) {
            return Err(RefError::Component {
                image: err_image(),
                component: c.to_owned(),
            });
        }
    }
    Ok(())
}

/// `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*`
fn component_ok(c: &str) -> bool {
    if c.is_empty() || !c.starts_with(|ch: char| ch.is_ascii_lowercase() || ch.is_ascii_digit()) {
        return false;
    }
    if !c.ends_with(|ch: char| ch.is_ascii_lowercase() || ch.is_ascii_digit()) {
        return false;
    }
    let mut sep = String::new();
    for ch in c.chars() {
        if ch.is_ascii_lowercase() || ch.is_ascii_digit() {
            if !(sep.is_empty()
                || sep == "."
                || sep == "_"
                || sep == "__"
                || sep.chars().all(|s| s == '-'))
            {
                return false;
            }
            sep.clear();
        } else if ".-_".contains(ch) {
            sep.push(ch);
        } else {
            return false;
        }
    }
    true
}

/// The image a later install uses when nobody names one: the installed image, with
/// its tag moved to `ours` when the tag was the installed manager's version (a
/// user's `registry.example/kvpn/manager:0.1.0` becomes `…:0.2.0` on upgrade: the
/// same place, this kvpn's manager), else as it is (a digest or a custom tag is
/// the user's choice, kept).
pub fn remembered(installed_image: &str, installed_version: Option<&str>, ours: &str) -> String {
    if let Some(v) = installed_version
        && !installed_image.contains('@')
        && let Some(repo) = installed_image.strip_suffix(&format!(":{v}"))
    {
        return format!("{repo}:{ours}");
    }
    installed_image.to_owned()
}

/// The pull policy the apiserver gives a container that names none: `Always` for
/// an image tagged `latest` or without a tag (and no digest), else `IfNotPresent`.
pub fn default_pull_policy(image: &str) -> &'static str {
    if image.contains('@') {
        return "IfNotPresent";
    }
    let last = image.rsplit('/').next().unwrap_or(image);
    match last.rsplit_once(':') {
        Some((_, "latest")) | None => "Always",
        Some(_) => "IfNotPresent",
    }
}

/// The fix for an image the nodes cannot pull, given the pull secrets the pod
/// had (in `namespace`).
pub fn pull_hint(image: &str, namespace: &str, pull_secrets: &[String]) -> String {
    if let Some(first) = pull_secrets.first() {
        let registry = image.split('/').next().unwrap_or(image);
        format!(
            "the nodes cannot pull {image} with the pull secret{s} {names}: check that {it} \
             {hold} credentials the registry {registry} accepts (`kubectl -n {namespace} get secret {first} \
             -o jsonpath='{{.data.\\.dockerconfigjson}}' | base64 -d`; recreate with `kubectl -n {namespace} \
             create secret docker-registry …`), the name and tag (`skopeo inspect docker://{image}`), \
             and that the registry is reachable from the nodes",
            s = if pull_secrets.len() == 1 { "" } else { "s" },
            names = pull_secrets.join(", "),
            it = if pull_secrets.len() == 1 {
                "it"
            } else {
                "they"
            },
            hold = if pull_secrets.len() == 1 {
                "holds"
            } else {
                "hold"
            },
        )
    } else if image.starts_with(&format!("{DEFAULT_REPOSITORY}:")) {
        format!(
            "the nodes do not have {image} and no registry serves it: build it with `./x image manager` \
             (an OCI archive under /var/cache/kvpn/images) and load it on every node \
             (`ctr -n k8s.io images import`, `kind load image-archive`, `k3s ctr images import`), \
             or push it to a registry the cluster can pull from and connect with `--image REGISTRY/kvpn/manager:TAG` \
             (README: \"Use kvpn with your own cluster\")"
        )
    } else {
        format!(
            "the nodes cannot pull {image}: check the name and tag (`skopeo inspect docker://{image}`), \
             that the registry is reachable from the nodes, and for a private registry pass \
             `--image-pull-secret NAME` (a docker-registry Secret in the manager namespace)"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_references_pass() {
        for ok in [
            "localhost/kvpn/manager:0.1.0",
            "kvpn/manager",
            "busybox",
            "registry.example.com:5000/team/kvpn-manager:v0.1.0-rc.1",
            "ghcr.io/a_b/c__d/e--f:latest",
            "localhost:5000/kvpn/manager@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "10.0.0.1:5000/x:1",
        ] {
            assert_eq!(validate(ok), Ok(()), "{ok}");
        }
    }

    #[test]
    fn malformed_references_name_the_part() {
        assert!(matches!(validate(""), Err(RefError::Empty { .. })));
        assert!(matches!(
            validate("Kvpn/Manager:1"),
            Err(RefError::UpperCase { ref suggest, .. }) if suggest == "--image kvpn/manager:1"
        ));
        assert!(matches!(
            validate("kvpn/manager:"),
            Err(RefError::Tag { .. })
        ));
        assert!(matches!(
            validate("kvpn/manager:-x"),
            Err(RefError::Tag { .. })
        ));
        assert!(matches!(
            validate("kvpn//manager"),
            Err(RefError::Component { .. })
        ));
        assert!(matches!(
            validate("kvpn/man ager"),
            Err(RefError::Component { .. })
        ));
        assert!(matches!(
            validate("kvpn/manager-"),
            Err(RefError::Component { .. })
        ));
        assert!(matches!(
            validate("x/y@sha256:abc"),
            Err(RefError::Digest { .. })
        ));
        assert!(matches!(
            validate("reg.io:99999/x"),
            Err(RefError::Registry { .. })
        ));
        let e = validate("kvpn/manager:").expect_err("bad tag").to_string();
        assert!(e.contains("kvpn/manager:") && e.contains("tag"), "{e}");
    }

    #[test]
    fn remembered_image_follows_the_version_tag_only() {
        assert_eq!(
            remembered("reg.example/kvpn/manager:0.1.0", Some("0.1.0"), "0.2.0"),
            "reg.example/kvpn/manager:0.2.0"
        );
        assert_eq!(
            remembered("reg.example/kvpn/manager:custom", Some("0.1.0"), "0.2.0"),
            "reg.example/kvpn/manager:custom"
        );
        let pinned =
            "reg.example/m@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        assert_eq!(remembered(pinned, Some("0.1.0"), "0.2.0"), pinned);
        assert_eq!(remembered("x:0.1.0", None, "0.2.0"), "x:0.1.0");
    }

    #[test]
    fn default_pull_policy_follows_the_tag_like_the_apiserver() {
        assert_eq!(
            default_pull_policy("localhost/kvpn/manager:0.1.0"),
            "IfNotPresent"
        );
        assert_eq!(default_pull_policy("localhost:5000/kvpn/manager"), "Always");
        assert_eq!(default_pull_policy("kvpn/manager:latest"), "Always");
        assert_eq!(
            default_pull_policy(
                "m@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
            ),
            "IfNotPresent"
        );
    }

    #[test]
    fn pull_hint_for_the_default_image_says_how_to_load_it() {
        let h = pull_hint(&default_image("0.1.0"), "kvpn-system", &[]);
        assert!(h.contains("./x image") && h.contains("--image"), "{h}");
        let h = pull_hint("reg.example/x:1", "kvpn-system", &[]);
        assert!(h.contains("--image-pull-secret"), "{h}");
        // With a secret that did not help: the secret, the registry and how to
        // look at what it holds.
        let h = pull_hint("reg.example:5000/x:1", "ns", &["regcred".to_owned()]);
        assert!(
            h.contains("pull secret regcred")
                && h.contains("registry reg.example:5000 accepts")
                && h.contains("kubectl -n ns get secret regcred"),
            "{h}"
        );
    }
}
