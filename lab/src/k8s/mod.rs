//! The lab's real Kubernetes control plane (lab-only code): etcd, kube-apiserver
//! and kube-controller-manager 1.20.2, started as local processes for one lab
//! instance and stopped cleanly.
//!
//! What runs where: all three processes run in the host network namespace and
//! listen only on one loopback address of their own (a random `127.x.y.z`, so
//! parallel labs never share a listening socket, and `ss -ltn` shows which lab
//! owns which port). Tests and the laptop-side tooling reach the apiserver at
//! [`ControlPlane::server_url`] with the kubeconfigs written into the instance
//! folder. The apiserver advertises the lab node's uplink address
//! (`172.31.255.1` by default) as the `kubernetes` Service's endpoint, since
//! Endpoints may not hold a loopback address.
//!
//! I/O lives in [`control_plane`] (processes, files, API calls) and
//! [`process`] (spawn, pid files, SIGTERM then SIGKILL). [`pki`] and
//! [`kubeconfig`] only build bytes; [`rbac`] holds the restricted user's
//! permissions.
//!
//! Binaries: `kube-apiserver`, `kube-controller-manager` and `kubectl` from
//! `scripts/build-kubernetes.sh`'s cache (see [`k8s_bin_dir`]), etcd from
//! Debian's `etcd-server` (`/usr/bin/etcd`).

pub mod cluster;
pub mod control_plane;
pub mod dns;
pub mod kube_proxy;
pub mod kubeconfig;
pub mod kubelet;
pub mod node;
pub mod pki;
pub mod process;
pub mod rbac;
pub mod relay;
pub mod source;
pub mod workloads;

use std::path::PathBuf;
use std::time::Duration;

pub use cluster::{K8sLab, K8sLabOptions, RealNodeOptions};
pub use control_plane::{
    ControlPlane, ControlPlaneConfig, Ports, RealNodesControl, client_from_kubeconfig,
};
pub use pki::CertificateAuthority;

/// The Kubernetes version `scripts/build-kubernetes.sh` builds.
pub const KUBERNETES_VERSION: &str = "1.20.2";

/// The lab's service CIDR (`--service-cluster-ip-range`).
pub const SERVICE_CIDR: &str = "10.96.0.0/12";

/// The `kubernetes` Service's ClusterIP: the service CIDR's first address.
pub const KUBERNETES_SERVICE_IP: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 96, 0, 1);

/// The namespace kvpn installs its manager into; the restricted user's Role lives here.
pub const KVPN_NAMESPACE: &str = "kvpn-system";

/// The restricted user's name (client certificate CN).
pub const RESTRICTED_USER: &str = "kvpn-user";

/// Errors of the lab control plane.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("generating the lab's certificates: {0}")]
    Cert(#[from] rcgen::Error),
    #[error("{name} not found at {path}; {hint}")]
    MissingBinary {
        name: &'static str,
        path: PathBuf,
        hint: &'static str,
    },
    #[error("no free TCP port on {ip} after {tries} tries")]
    NoFreePort { ip: std::net::IpAddr, tries: u32 },
    #[error("{name} exited during start-up ({status}); last lines of {log}:\n{log_tail}")]
    Exited {
        name: &'static str,
        status: String,
        log: PathBuf,
        log_tail: String,
    },
    #[error(
        "{name} not ready after {after:?} (last check: {last_error}); last lines of {log}:\n{log_tail}"
    )]
    NotReady {
        name: &'static str,
        after: Duration,
        last_error: String,
        log: PathBuf,
        log_tail: String,
    },
    #[error("reading kubeconfig {path}: {message}")]
    Kubeconfig { path: PathBuf, message: String },
    #[error("{what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("control-plane state {path}: {message}")]
    State { path: PathBuf, message: String },
    #[error("{name} (pid {pid}) still alive after SIGKILL")]
    Unkillable { name: String, pid: i32 },
}

impl Error {
    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let what = what.into();
        move |source| Error::Io { what, source }
    }

    pub(crate) fn kube(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
        let what = what.into();
        move |source| Error::Kube { what, source }
    }
}

/// Where the Kubernetes binaries live: `$KVPN_K8S_BIN_DIR` if set, else
/// `$KVPN_CACHE/kubernetes/<version>/bin` (`KVPN_CACHE` defaults to
/// `/var/cache/kvpn`), the cache `scripts/build-kubernetes.sh` fills.
pub fn k8s_bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("KVPN_K8S_BIN_DIR") {
        return PathBuf::from(dir);
    }
    let cache = std::env::var_os("KVPN_CACHE").unwrap_or_else(|| "/var/cache/kvpn".into());
    PathBuf::from(cache)
        .join("kubernetes")
        .join(KUBERNETES_VERSION)
        .join("bin")
}

/// The kubectl to use with the lab: the one next to the cached binaries (a link to
/// `/usr/bin/kubectl` or Debian's unpacked kubernetes-client), else `/usr/bin/kubectl`.
pub fn kubectl_path() -> PathBuf {
    let cached = k8s_bin_dir().join("kubectl");
    if cached.exists() {
        cached
    } else {
        PathBuf::from("/usr/bin/kubectl")
    }
}
