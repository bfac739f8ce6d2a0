//! Client-source policy: `snat` (smoltcp terminates, the kernel dials from the pod
//! IP) or `preserve` (the manager is a forwarder: the laptop's packets go into a TUN
//! device inside the pod and the pod's kernel routes them with the client's tunnel
//! IP as source).
//!
//! `preserve` needs, in the pod's netns (NET_ADMIN, NET_RAW; never privileged, and
//! no write to `/proc/sys`, which runtimes mount read-only):
//! - a TUN device ([`PoolTun`], default `kvpn-pool`) with the route `pool dev
//!   kvpn-pool`;
//! - IPv4 forwarding on the TUN (laptop → cluster) and on `eth0` (replies → the
//!   pool), per device over rtnetlink ([`crate::devconf`]), not the global
//!   `net.ipv4.ip_forward`: the kernel decides forwarding by the input device;
//! - rp_filter loose (2) on the same two: replies for a tunnel IP arrive on
//!   `eth0` while that source's route is the TUN (RFC 3704 loose mode,
//!   Documentation/networking/ip-sysctl.rst: the kernel applies max(all, dev));
//! - the stable gateway address (default 169.254.96.1/32) on `eth0`, announced with a
//!   gratuitous ARP: the nodes route the pool `via` that address, so whichever manager
//!   pod is live receives the replies and a reschedule changes no node route.
//!
//! Outside the pod (the cluster's part, see docs/source-policy.md):
//! a node route `pool via <stable gateway>` and the pool kept out of the CNI's
//! masquerade. Replies read from the TUN go to the session that owns their
//! destination tunnel IP ([`Peers`]).
//!
//! I/O: the TUN device, one rtnetlink socket, one AF_PACKET socket for the ARP
//! announcement.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context as _, bail};
use futures::TryStreamExt as _;
use ipnet::Ipv4Net;
use rtnetlink::RouteMessageBuilder;
use rtnetlink::packet_route::link::LinkAttribute;
use rtnetlink::packet_route::route::{RouteProtocol, RouteScope};
use tracing::{debug, info, warn};

use crate::devconf;
use crate::peers::{self, Peers};

/// Whose address the backends see (defined once, in kvpn-proto).
pub use kvpn_proto::SourcePolicy;

/// Settings of `preserve`.
#[derive(Debug, Clone)]
pub struct PreserveConfig {
    /// TUN device name in the pod.
    pub tun_name: String,
    /// The tunnel pool (routed into the TUN).
    pub pool: Ipv4Net,
    /// The pod's interface towards the node (carries the stable gateway).
    pub egress: String,
    /// The stable gateway the nodes route the pool through; `None`: not claimed.
    pub gateway: Option<Ipv4Addr>,
}

/// `rtm_protocol` of kvpn's routes (as the dataplane's).
const RTPROT_KVPN: u8 = 0x6b;
/// The TUN's MTU: laptops send up to the data channel's MTU
/// ([`kvpn_proto::frame::DEFAULT_TUN_MTU`]); the pod's kernel fragments or answers
/// "fragmentation needed" towards `eth0` itself.
const TUN_MTU: u16 = kvpn_proto::frame::DEFAULT_TUN_MTU;

/// The pod's TUN device of `preserve` and its counters.
pub struct PoolTun {
    device: tun_rs::AsyncDevice,
    name: String,
    pool: Ipv4Net,
    /// Laptop packets written into the TUN.
    pub to_kernel: AtomicU64,
    /// Laptop packets dropped because the TUN queue was full or the write failed.
    pub to_kernel_dropped: AtomicU64,
    /// Packets read from the TUN and queued on their session.
    pub from_kernel: AtomicU64,
    /// Packets read from the TUN for no live session (or a full queue).
    pub from_kernel_dropped: AtomicU64,
}

impl fmt::Debug for PoolTun {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolTun")
            .field("name", &self.name)
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

impl PoolTun {
    /// Whether a laptop packet goes to the pod's kernel: sent by the session's own
    /// tunnel IP, to an address outside the pool (pool addresses are the manager's
    /// stack and other laptops, handled in the session).
    pub fn takes(&self, packet: &[u8], tunnel_ip: IpAddr) -> bool {
        match peers::addrs(packet) {
            Some((src, IpAddr::V4(dst))) => src == tunnel_ip && !self.pool.contains(&dst),
            _ => false,
        }
    }

    /// Writes one laptop packet into the TUN without waiting (a full queue drops
    /// it, counted; TCP retransmits).
    pub fn write(&self, packet: &[u8]) {
        match self.device.try_send(packet) {
            Ok(_) => {
                self.to_kernel.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                self.to_kernel_dropped.fetch_add(1, Ordering::Relaxed);
                debug!(error = %e, bytes = packet.len(), "packet into the pool TUN dropped");
            }
        }
    }

    /// Reads the TUN forever, handing each packet to the session of its destination
    /// tunnel IP.
    pub async fn run_reader(self: Arc<Self>, peers: Peers) {
        let mut buf = vec![0u8; usize::from(TUN_MTU) + 64];
        loop {
            let n = match self.device.recv(&mut buf).await {
                Ok(n) => n,
                Err(e) => {
                    warn!(tun = %self.name, error = %e, "reading the pool TUN failed; replies for laptops stop");
                    return;
                }
            };
            let Some(packet) = buf.get(..n) else { continue };
            let sent = peers::addrs(packet).and_then(|(_, dst)| peers.try_send(dst, packet));
            if sent == Some(true) {
                self.from_kernel.fetch_add(1, Ordering::Relaxed);
            } else {
                self.from_kernel_dropped.fetch_add(1, Ordering::Relaxed);
                tracing::trace!(bytes = n, "packet from the pool TUN for no live session");
            }
        }
    }
}

async fn link_index(handle: &rtnetlink::Handle, name: &str) -> anyhow::Result<(u32, Vec<u8>)> {
    let mut links = handle.link().get().match_name(name.to_owned()).execute();
    let link = links
        .try_next()
        .await
        .with_context(|| format!("cannot find interface {name} in the pod"))?
        .with_context(|| format!("the pod has no interface {name}; set --egress-interface"))?;
    let mac = link
        .attributes
        .iter()
        .find_map(|a| match a {
            LinkAttribute::Address(m) => Some(m.clone()),
            _ => None,
        })
        .unwrap_or_default();
    Ok((link.header.index, mac))
}

/// Forwarding on and rp_filter loose on interface `index` ([`devconf::ensure`]),
/// logged with what it was before.
async fn forward_through(
    handle: &rtnetlink::Handle,
    index: u32,
    name: &str,
    role: &str,
) -> anyhow::Result<()> {
    let outcome = devconf::ensure(handle, index, name).await?;
    info!(
        interface = name,
        role,
        forwarding_before = outcome.before.0,
        rp_filter_before = outcome.before.1,
        changed = outcome.changed,
        "IPv4 forwarding on and rp_filter loose on the interface (rtnetlink, no /proc/sys write)"
    );
    Ok(())
}

/// Sets up `preserve` in the pod (see the module docs) and returns the TUN. Errors
/// name the step and the missing permission.
pub async fn setup(config: &PreserveConfig) -> anyhow::Result<Arc<PoolTun>> {
    let device = tun_rs::DeviceBuilder::new()
        .name(&config.tun_name)
        .mtu(TUN_MTU)
        .enable(true)
        .build_async()
        .with_context(|| {
            format!(
                "cannot create TUN device {} for --source-policy preserve — the pod needs \
                 CAP_NET_ADMIN and /dev/net/tun",
                config.tun_name
            )
        })?;
    let (connection, handle, _) =
        rtnetlink::new_connection().context("cannot open a NETLINK_ROUTE socket")?;
    tokio::spawn(connection);
    let (tun_index, _) = link_index(&handle, &config.tun_name).await?;
    let route = RouteMessageBuilder::<Ipv4Addr>::new()
        .destination_prefix(config.pool.network(), config.pool.prefix_len())
        .output_interface(tun_index)
        .scope(RouteScope::Link)
        .protocol(RouteProtocol::Other(RTPROT_KVPN))
        .build();
    handle
        .route()
        .add(route)
        .replace()
        .execute()
        .await
        .with_context(|| format!("cannot route {} into {}", config.pool, config.tun_name))?;
    forward_through(&handle, tun_index, &config.tun_name, "laptops → cluster").await?;
    let (egress_index, mac) = link_index(&handle, &config.egress).await?;
    forward_through(&handle, egress_index, &config.egress, "replies → laptops").await?;
    if let Some(gateway) = config.gateway {
        // Replace: a restarted manager in the same pod already holds it.
        handle
            .address()
            .add(egress_index, IpAddr::V4(gateway), 32)
            .replace()
            .execute()
            .await
            .with_context(|| {
                format!(
                    "cannot add the stable gateway {gateway}/32 to {}",
                    config.egress
                )
            })?;
        match announce(egress_index, &mac, gateway) {
            Ok(()) => {
                info!(%gateway, egress = %config.egress, "stable gateway claimed and announced")
            }
            Err(e) => {
                warn!(%gateway, error = %e, "gratuitous ARP failed; nodes learn the new pod when their neighbour entry expires")
            }
        }
    }
    info!(tun = %config.tun_name, pool = %config.pool, egress = %config.egress, "pool TUN ready: laptop packets go to the pod's kernel with their tunnel IP");
    Ok(Arc::new(PoolTun {
        device,
        name: config.tun_name.clone(),
        pool: config.pool,
        to_kernel: AtomicU64::new(0),
        to_kernel_dropped: AtomicU64::new(0),
        from_kernel: AtomicU64::new(0),
        from_kernel_dropped: AtomicU64::new(0),
    }))
}

/// The gratuitous ARP request announcing `ip` at `mac` (RFC 5227 section 3):
/// sender and target protocol address both `ip`.
pub fn garp_payload(mac: &[u8; 6], ip: Ipv4Addr) -> [u8; 28] {
    let mut p = [0u8; 28];
    p[0..2].copy_from_slice(&1u16.to_be_bytes()); // Ethernet
    p[2..4].copy_from_slice(&0x0800u16.to_be_bytes()); // IPv4
    p[4] = 6;
    p[5] = 4;
    p[6..8].copy_from_slice(&1u16.to_be_bytes()); // request
    p[8..14].copy_from_slice(mac);
    p[14..18].copy_from_slice(&ip.octets());
    p[24..28].copy_from_slice(&ip.octets());
    p
}

/// Broadcasts [`garp_payload`] on interface `index` (AF_PACKET, needs NET_RAW), so
/// the node replaces its neighbour entry of the gateway (the old pod's MAC) at once.
fn announce(index: u32, mac: &[u8], ip: Ipv4Addr) -> anyhow::Result<()> {
    let Ok(mac) = <[u8; 6]>::try_from(mac) else {
        bail!("interface #{index} has no Ethernet address");
    };
    let payload = garp_payload(&mac, ip);
    let proto = (libc::ETH_P_ARP as u16).to_be();
    // SAFETY: plain socket(2); the fd is closed below.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_DGRAM, i32::from(proto)) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("AF_PACKET socket (needs NET_RAW)");
    }
    // SAFETY: sockaddr_ll is plain old data; zero is a valid value.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_protocol = proto;
    addr.sll_ifindex = index as i32;
    addr.sll_halen = 6;
    addr.sll_addr[..6].copy_from_slice(&[0xff; 6]);
    let mut result = Ok(());
    for _ in 0..3 {
        // SAFETY: buffer and address point to live values of the given lengths.
        let n = unsafe {
            libc::sendto(
                fd,
                payload.as_ptr().cast(),
                payload.len(),
                0,
                std::ptr::addr_of!(addr).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if n < 0 {
            result = Err(std::io::Error::last_os_error()).context("sending the gratuitous ARP");
            break;
        }
    }
    // SAFETY: fd is ours and open.
    unsafe { libc::close(fd) };
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garp_announces_the_address_as_sender_and_target() {
        let p = garp_payload(&[2, 0, 0, 0, 0, 1], Ipv4Addr::new(169, 254, 96, 1));
        assert_eq!(&p[..8], &[0, 1, 8, 0, 6, 4, 0, 1]);
        assert_eq!(&p[8..14], &[2, 0, 0, 0, 0, 1]);
        assert_eq!(&p[14..18], &[169, 254, 96, 1]);
        assert_eq!(&p[18..24], &[0; 6]);
        assert_eq!(&p[24..28], &[169, 254, 96, 1]);
    }

    #[test]
    fn policy_names() {
        assert_eq!(SourcePolicy::default().to_string(), "snat");
        assert_eq!(SourcePolicy::Preserve.as_str(), "preserve");
        use clap::ValueEnum as _;
        for p in [
            SourcePolicy::Snat,
            SourcePolicy::Preserve,
            SourcePolicy::EbpfSnat,
        ] {
            let value = p.to_possible_value().map(|v| v.get_name().to_owned());
            assert_eq!(
                value.as_deref(),
                Some(p.as_str()),
                "the flag value is the name"
            );
        }
    }
}
