//! kvpn's root daemon, `kvpn-dataplane`: creates and owns the TUN device, the
//! tunnel IP, the routes to the cluster and rp_filter (rtnetlink), attaches the eBPF
//! classifier, and pumps packets between the TUN device and the traffic manager.
//! It holds no Kubernetes credentials; the user daemon tells it what to set up
//! over gRPC on a root-owned Unix socket.
//!
//! Pure cores (no I/O): [`routes`] (CIDR normalisation), [`liveness`] (heartbeats
//! and session state), [`unreachable`] (ICMP unreachable answers while
//! reconnecting, and their rate limit), [`carried`] (the TCP flows a worker carried,
//! reset when a re-dial cannot resume). I/O shells: [`tun`] (`/dev/net/tun`), [`netlink`]
//! (NETLINK_ROUTE), [`ebpf`] (bpf(2); the `kvpn-ebpf` crate, which the traffic
//! manager shares), [`pump`] (TUN ↔ transport), [`redial`]
//! (holding packets during a re-dial, resetting lost flows), [`session`]
//! (TCP to the manager, setup and teardown), [`steer_watch`] (eBPF steering that
//! follows the laptop's devices while a session runs), [`route_guard`] (re-adds a
//! session's routes deleted from outside kvpn), [`tls`] (TLS on the data channel,
//! verified against the CA from the Connect request), [`daemon`] (gRPC socket, pid file,
//! peer credentials), [`sweep`] (what a killed daemon left),
//! [`client`] (gRPC client over the socket). [`fuzzing`]: entry points of the cargo-fuzz
//! targets and the corpus replay (DNS forwarder decisions without sockets).
//!
//! Outbound means laptop → cluster, inbound cluster → laptop.

pub mod carried;
pub mod client;
pub mod conflicts;
pub mod daemon;
pub mod dns;
pub mod fuzzing;
pub mod liveness;
pub mod netlink;
pub mod pump;
pub mod redial;
pub mod route_guard;
pub mod routes;
pub mod run_scope;
pub mod session;
pub mod stale_tcp;
pub mod steer_watch;
pub mod sweep;
pub mod tls;
pub mod tun;
pub mod unreachable;
pub mod watched;

pub use tun::DEFAULT_MTU;

/// The eBPF loader and map wrappers (`kvpn-ebpf`), under the path the root
/// daemon's modules, tests and the other laptop crates use.
pub use kvpn_ebpf as ebpf;
