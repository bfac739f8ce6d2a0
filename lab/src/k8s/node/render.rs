//! The configuration files of one real node, as bytes (pure: no I/O).
//!
//! Every path in these files is seen from inside the node's mount namespace, where
//! `/run`, `/var/lib`, `/var/log` and `/opt` are the node's own tmpfs (see
//! [`super::host`]), so the components keep their standard paths
//! (`/run/containerd/containerd.sock`, `/var/lib/kubelet`, `/var/lib/cni`) and two
//! nodes on one machine never share a file. Paths into the lab folder (certificates,
//! the CNI configuration, `resolv.conf`) are visible there too: the lab folder is not
//! under one of those four.

use std::net::Ipv4Addr;
use std::path::Path;

use ipnet::Ipv4Net;
use serde_json::json;

/// The containerd socket inside a node's mount namespace.
pub const CONTAINERD_SOCKET: &str = "/run/containerd/containerd.sock";
/// The kubelet's port on the node address (the apiserver dials it through the lab's
/// egress proxy).
pub const KUBELET_PORT: u16 = 10250;
/// Debian's containernetworking-plugins (bridge, host-local, portmap, loopback).
pub const CNI_BIN_DIR: &str = "/usr/lib/cni";
/// The CNI network's name (also the conflist's file stem).
pub const CNI_NETWORK: &str = "kvpn-lab";

/// What containerd needs to know about its node.
#[derive(Debug, Clone)]
pub struct ContainerdSpec<'a> {
    /// Folder holding the node's CNI conflist.
    pub cni_conf_dir: &'a Path,
    /// The pod sandbox ("pause") image, imported before the kubelet starts.
    pub sandbox_image: &'a str,
    /// `HOST:PORT` of a plain-HTTP registry the node may pull from (the lab's,
    /// [`super::LAB_REGISTRY_PORT`] on the router), as a cluster admin configures
    /// an internal registry without TLS: a mirror entry with an `http://` endpoint.
    pub http_registry: Option<&'a str>,
}

/// containerd 1.6's `config.toml` (version 2).
///
/// - `restrict_oom_score_adj = true`: root here lacks CAP_SYS_RESOURCE, so runc cannot
///   lower a container's `oom_score_adj` below containerd's own (it fails with "can't
///   get final child's PID from pipe: EOF"); this clamps what the kubelet asks for.
/// - overlayfs snapshotter on the node's tmpfs `/var/lib` (checked here: works; the
///   btrfs/zfs/aufs/devmapper snapshotters are disabled to keep the log quiet).
/// - cgroupfs (`SystemdCgroup = false`): no systemd manages the lab's cgroups.
/// - the streaming server (exec, port-forward) on the node's loopback: the kubelet
///   proxies streams to it, nothing else needs to reach it.
pub fn containerd_config(spec: &ContainerdSpec<'_>) -> String {
    let q = |s: &str| serde_json::Value::String(s.to_owned()).to_string();
    format!(
        r#"version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = {socket}

[plugins."io.containerd.internal.v1.opt"]
  path = "/opt/containerd"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = {sandbox}
  restrict_oom_score_adj = true
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = {bin}
    conf_dir = {conf}
{registry}"#,
        socket = q(CONTAINERD_SOCKET),
        sandbox = q(spec.sandbox_image),
        bin = q(CNI_BIN_DIR),
        conf = q(&spec.cni_conf_dir.to_string_lossy()),
        registry = spec.http_registry.map_or_else(String::new, |host| format!(
            "  [plugins.\"io.containerd.grpc.v1.cri\".registry.mirrors.{host}]\n    endpoint = [{endpoint}]\n",
            host = q(host),
            endpoint = q(&format!("http://{host}")),
        )),
    )
}

/// The node's CNI conflist: bridge `bridge` with the first address of `pod_cidr` as
/// every pod's gateway, host-local IPAM over `pod_cidr`, and portmap for
/// `hostPort`. containerd runs the loopback plugin itself. No `ipMasq`: the bridge
/// plugin would masquerade everything leaving the node's own `/24`, pod-to-pod
/// traffic across nodes too, so a backend would see the other node's address
/// instead of the client pod's (real clusters keep pod IPs between nodes, e.g.
/// kubenet's non-masquerade CIDR); the lab routes every pod CIDR, so nothing needs
/// masquerading.
pub fn cni_conflist(bridge: &str, pod_cidr: Ipv4Net) -> String {
    let gateway = pod_cidr.hosts().next().unwrap_or(pod_cidr.addr());
    let v = json!({
        "cniVersion": "0.4.0",
        "name": CNI_NETWORK,
        "plugins": [
            {
                "type": "bridge",
                "bridge": bridge,
                "isGateway": true,
                "ipMasq": false,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{ "subnet": pod_cidr.to_string(), "gateway": gateway.to_string() }]],
                    "routes": [{ "dst": "0.0.0.0/0" }]
                }
            },
            { "type": "portmap", "capabilities": { "portMappings": true }, "snat": true }
        ]
    });
    // A json! literal always serializes.
    serde_json::to_string_pretty(&v).unwrap_or_default()
}

/// What the kubelet needs to know about its node.
#[derive(Debug, Clone)]
pub struct KubeletSpec<'a> {
    pub node_ip: Ipv4Addr,
    /// `/kvpn-<id>-<node>`: created in every cgroup v1 hierarchy before the kubelet
    /// starts (see [`super::host::NodeCgroup`]).
    pub cgroup_root: &'a str,
    pub client_ca_file: &'a Path,
    pub tls_cert_file: &'a Path,
    pub tls_key_file: &'a Path,
    pub cluster_dns: Ipv4Addr,
    pub cluster_domain: &'a str,
    /// The `resolv.conf` the kubelet gives pods with `dnsPolicy: Default` and reads
    /// upstream servers from.
    pub resolv_conf: &'a Path,
    pub pod_cidr: Ipv4Net,
}

/// `KubeletConfiguration` (kubelet.config.k8s.io/v1beta1) as JSON, which the kubelet
/// reads like YAML.
///
/// - `cgroupDriver: cgroupfs` and a `cgroupRoot` of the node's own (two kubelets on
///   one machine must not share `/kubepods`).
/// - `oomScoreAdj: 0`: the kubelet's default -999 needs CAP_SYS_RESOURCE.
/// - `failSwapOn: false`, and eviction thresholds that never fire on the lab's tmpfs
///   (a lab node must not evict pods because the machine's disk is busy).
/// - authentication by the lab CA's client certificates only (the apiserver's
///   `apiserver-kubelet-client`), authorization AlwaysAllow: only the apiserver,
///   through the lab's egress proxy, reaches this port.
/// - `protectKernelDefaults: false`: with `true` the kubelet refuses to start on this
///   machine's kernel.panic=1/panic_on_oops=0; it changes them instead and the lab
///   puts them back (see [`super::host::GlobalSysctls`]).
pub fn kubelet_config(spec: &KubeletSpec<'_>) -> String {
    let p = |path: &Path| path.to_string_lossy().into_owned();
    let v = json!({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": spec.node_ip.to_string(),
        "port": KUBELET_PORT,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "tlsCertFile": p(spec.tls_cert_file),
        "tlsPrivateKeyFile": p(spec.tls_key_file),
        "authentication": {
            "anonymous": { "enabled": false },
            "webhook": { "enabled": false },
            "x509": { "clientCAFile": p(spec.client_ca_file) }
        },
        "authorization": { "mode": "AlwaysAllow" },
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": spec.cgroup_root,
        "cgroupsPerQOS": true,
        "enforceNodeAllocatable": ["pods"],
        "failSwapOn": false,
        "oomScoreAdj": 0,
        "protectKernelDefaults": false,
        "clusterDNS": [spec.cluster_dns.to_string()],
        "clusterDomain": spec.cluster_domain,
        "resolvConf": p(spec.resolv_conf),
        "podCIDR": spec.pod_cidr.to_string(),
        "evictionHard": {
            "memory.available": "1Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%"
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": false,
        "maxPods": 60,
        "kernelMemcgNotification": false,
        "makeIPTablesUtilChains": true,
        "hairpinMode": "hairpin-veth",
        "nodeStatusUpdateFrequency": "5s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "20s",
        "staticPodPath": ""
    });
    serde_json::to_string_pretty(&v).unwrap_or_default()
}

/// What kube-proxy needs to know about its node.
#[derive(Debug, Clone)]
pub struct KubeProxySpec<'a> {
    pub kubeconfig: &'a Path,
    pub node_name: &'a str,
    pub node_ip: Ipv4Addr,
    /// The cluster's pod CIDR: traffic to a ClusterIP from outside it is masqueraded.
    pub cluster_cidr: Ipv4Net,
}

/// `KubeProxyConfiguration` (kubeproxy.config.k8s.io/v1alpha1) as JSON.
///
/// - `mode: iptables`: this kernel has no IPVS.
/// - conntrack `maxPerCore: 0` and zero timeouts: kube-proxy leaves
///   `nf_conntrack_max` (global) and the conntrack timeouts as they are.
/// - healthz and metrics on the node's loopback (each node netns has its own).
pub fn kube_proxy_config(spec: &KubeProxySpec<'_>) -> String {
    let v = json!({
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "bindAddress": spec.node_ip.to_string(),
        "clusterCIDR": spec.cluster_cidr.to_string(),
        "hostnameOverride": spec.node_name,
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "clientConnection": { "kubeconfig": spec.kubeconfig.to_string_lossy() },
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s"
        },
        "iptables": { "masqueradeAll": false, "syncPeriod": "10s", "minSyncPeriod": "0s" }
    });
    serde_json::to_string_pretty(&v).unwrap_or_default()
}

/// The apiserver's `EgressSelectorConfiguration` (apiserver.k8s.io/v1beta1): traffic
/// to the cluster (kubelets for logs, exec and port-forward; pod and node proxy) goes
/// through an HTTP CONNECT proxy on the unix socket `uds`, which dials from inside the
/// lab's network (see [`super::egress`]). Control-plane and etcd traffic stay direct.
pub fn egress_selector_config(uds: &Path) -> String {
    let v = json!({
        "apiVersion": "apiserver.k8s.io/v1beta1",
        "kind": "EgressSelectorConfiguration",
        "egressSelections": [{
            "name": "cluster",
            "connection": {
                "proxyProtocol": "HTTPConnect",
                "transport": { "uds": { "udsName": uds.to_string_lossy() } }
            }
        }]
    });
    serde_json::to_string_pretty(&v).unwrap_or_default()
}

/// A pod `resolv.conf` for `dnsPolicy: Default` pods and the kubelet's upstream list:
/// the cluster DNS address (nothing else in the lab answers DNS).
pub fn resolv_conf(nameserver: Ipv4Addr) -> String {
    format!("nameserver {nameserver}\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> Ipv4Net {
        s.parse().expect("cidr")
    }

    #[test]
    fn containerd_config_clamps_oom_score_and_uses_the_node_cni_folder() {
        let text = containerd_config(&ContainerdSpec {
            cni_conf_dir: Path::new("/tmp/kvpn-lab-abcde/nodes/n1/cni"),
            sandbox_image: "kvpn.local/lab:pause",
            http_registry: Some("172.30.0.1:5000"),
        });
        assert!(
            text.contains(
                "[plugins.\"io.containerd.grpc.v1.cri\".registry.mirrors.\"172.30.0.1:5000\"]\n    endpoint = [\"http://172.30.0.1:5000\"]"
            ),
            "{text}"
        );
        assert!(text.contains("restrict_oom_score_adj = true"), "{text}");
        assert!(text.contains("snapshotter = \"overlayfs\""), "{text}");
        assert!(text.contains("SystemdCgroup = false"), "{text}");
        assert!(
            text.contains("conf_dir = \"/tmp/kvpn-lab-abcde/nodes/n1/cni\""),
            "{text}"
        );
        assert!(
            text.contains("sandbox_image = \"kvpn.local/lab:pause\""),
            "{text}"
        );
        assert!(text.contains("bin_dir = \"/usr/lib/cni\""), "{text}");
    }

    #[test]
    fn cni_conflist_hands_out_the_node_pod_cidr_with_its_first_host_as_gateway() {
        let text = cni_conflist("kvabcdecni", net("10.244.2.0/24"));
        let v: serde_json::Value = serde_json::from_str(&text).expect("json");
        let bridge = &v["plugins"][0];
        assert_eq!(bridge["type"], "bridge");
        assert_eq!(bridge["bridge"], "kvabcdecni");
        assert_eq!(bridge["ipam"]["type"], "host-local");
        assert_eq!(bridge["ipam"]["ranges"][0][0]["subnet"], "10.244.2.0/24");
        assert_eq!(bridge["ipam"]["ranges"][0][0]["gateway"], "10.244.2.1");
        assert_eq!(v["plugins"][1]["type"], "portmap");
    }

    #[test]
    fn kubelet_config_uses_cgroupfs_under_the_node_root_and_the_node_address() {
        let text = kubelet_config(&KubeletSpec {
            node_ip: Ipv4Addr::new(172, 30, 0, 11),
            cgroup_root: "/kvpn-abcde-n1",
            client_ca_file: Path::new("/x/ca.crt"),
            tls_cert_file: Path::new("/x/kubelet.crt"),
            tls_key_file: Path::new("/x/kubelet.key"),
            cluster_dns: Ipv4Addr::new(10, 96, 0, 10),
            cluster_domain: "cluster.local",
            resolv_conf: Path::new("/x/resolv.conf"),
            pod_cidr: net("10.244.2.0/24"),
        });
        let v: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(v["cgroupDriver"], "cgroupfs");
        assert_eq!(v["cgroupRoot"], "/kvpn-abcde-n1");
        assert_eq!(v["address"], "172.30.0.11");
        assert_eq!(v["oomScoreAdj"], 0);
        assert_eq!(v["clusterDNS"][0], "10.96.0.10");
        assert_eq!(v["authentication"]["anonymous"]["enabled"], false);
        assert_eq!(v["authentication"]["x509"]["clientCAFile"], "/x/ca.crt");
    }

    #[test]
    fn kube_proxy_config_is_iptables_and_leaves_global_conntrack_alone() {
        let text = kube_proxy_config(&KubeProxySpec {
            kubeconfig: Path::new("/x/kube-proxy.kubeconfig"),
            node_name: "kvpn-abcde-n1",
            node_ip: Ipv4Addr::new(172, 30, 0, 11),
            cluster_cidr: net("10.244.0.0/16"),
        });
        let v: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(v["mode"], "iptables");
        assert_eq!(v["conntrack"]["maxPerCore"], 0);
        assert_eq!(v["hostnameOverride"], "kvpn-abcde-n1");
        assert_eq!(v["clusterCIDR"], "10.244.0.0/16");
    }

    #[test]
    fn egress_selector_sends_only_cluster_traffic_to_the_socket() {
        let text = egress_selector_config(Path::new("/tmp/kvpn-lab-abcde/egress.sock"));
        let v: serde_json::Value = serde_json::from_str(&text).expect("json");
        let sel = &v["egressSelections"];
        assert_eq!(sel.as_array().map(Vec::len), Some(1));
        assert_eq!(sel[0]["name"], "cluster");
        assert_eq!(sel[0]["connection"]["proxyProtocol"], "HTTPConnect");
        assert_eq!(
            sel[0]["connection"]["transport"]["uds"]["udsName"],
            "/tmp/kvpn-lab-abcde/egress.sock"
        );
    }
}
