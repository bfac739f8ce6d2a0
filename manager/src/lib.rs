//! kvpn traffic manager (`kvpn-manager`): terminates the laptops' packets in a
//! userspace TCP/IP stack (smoltcp, any-IP) and relays them to the real
//! destinations in the cluster through kernel sockets (SNAT mode: destinations
//! see the manager pod's IP).
//!
//! Layout:
//! - [`packet`], [`frag`], [`device`], [`engine`], [`metrics`]: the pure core — packet
//!   classification and construction, fragment reassembly, the per-session
//!   flow table with its smoltcp interface; [`forwarded`]: the flows the pod's
//!   kernel carries under `preserve`/`ebpf-snat` (for the cap and limits);
//!   [`limit`]: the per-client token buckets (new flows, failed new flows,
//!   ICMP errors). No I/O, no clock (`now` is passed in).
//! - [`kernel`]: all I/O towards the cluster (TCP dials and splicing, UDP and
//!   ICMP echo sockets).
//! - [`session`]: the tokio shell of one data-channel session (frames in and
//!   out); [`server`]: the :10801 listener, plain TCP or TLS 1.3 ([`tls`]);
//!   [`peers`]: live sessions by tunnel IP (laptop-to-laptop forwarding);
//!   [`gateway`]: the egress gateway of `kvpn attach --via gateway` (VXLAN
//!   from pods, one translated source towards the laptops);
//!   [`window`]: the TCP flows' receive window from the connection's round trip.
//! - [`lease`]: the pure lease table (tunnel IPs from the pool, tokens,
//!   expiry); [`leases`]: its shell (clock, randomness, the Lease-object store);
//!   [`grpc`]: the control gRPC API on :10802 (`Lease`, `WatchRoutes`).
//! - [`metrics_server`]: `GET /metrics` (the manager-wide [`metrics::ManagerCounters`],
//!   Prometheus text) on `--metrics-listen` (the install: pod loopback :10803).
//! - [`preserve`], [`ebpf_snat`]: the source policies that hand the laptops'
//!   packets to the pod's kernel (pool TUN, eBPF SNAT); [`devconf`]: the
//!   per-interface IPv4 forwarding and rp_filter they need, over rtnetlink
//!   (the pod's `/proc/sys` is read-only under a container runtime).
//! - [`fuzzing`]: entry points of the cargo-fuzz targets and the corpus replay.
//! - [`routes`]: the pure route and DNS discovery core (watch events in, pod
//!   CIDRs, Services and cluster DNS out, deltas per client); [`route_watch`]:
//!   its shell (kube-runtime watches, debounce, subscribers).

pub mod devconf;
pub mod ebpf_snat;
pub mod engine;
pub mod forwarded;
pub mod frag;
pub mod fuzzing;
pub mod gateway;
pub mod grpc;
pub mod kernel;
pub mod lease;
pub mod leases;
pub mod limit;
pub mod metrics;
pub mod metrics_server;
pub mod node_agent;
pub mod packet;
pub mod peers;
pub mod preserve;
pub mod resume;
pub mod route_watch;
pub mod routes;
pub mod server;
pub mod session;
pub mod tls;
pub mod trace;
pub mod window;

pub use engine::DEFAULT_MTU;
