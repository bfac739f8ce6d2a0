//! `--source-policy ebpf-snat`: the laptops' packets go into the pool TUN as with
//! `preserve` ([`crate::preserve::setup`]), and kvpn's TC programs on the pod's
//! egress interface translate their source to the pod IP (and back on replies) with
//! their own connection table — kernel-speed SNAT without smoltcp termination. The
//! programs and their loader live with kvpn's other eBPF code
//! (`dataplane-ebpf/src/snat.rs`, [`kvpn_ebpf::snat`]); this module finds
//! the pod IP, attaches them, and runs the sweeper that expires idle flows and
//! publishes the table's size and counters on the metrics endpoint.
//!
//! Needs CAP_NET_ADMIN in the pod (the TUN device, the route, forwarding on the TUN
//! and the egress interface, loading and attaching TC programs) and CAP_BPF (maps,
//! programs), and `/dev/net/tun`; never privileged, no write to `/proc/sys`. Nothing outside the
//! pod: replies come to the pod IP, so no node route and no masquerade exclusion.

use std::net::{IpAddr, Ipv4Addr};
use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use futures::TryStreamExt as _;
use ipnet::Ipv4Net;
use kvpn_ebpf::snat::{Snat, SnatSettings, SnatTimeouts, monotonic_ns};
use rtnetlink::packet_route::address::AddressAttribute;
use tracing::{info, warn};

use crate::metrics::ManagerCounters;

/// Settings of `ebpf-snat`.
#[derive(Debug, Clone)]
pub struct EbpfSnatConfig {
    /// The pod's interface towards the node; its IPv4 address is the new source.
    pub egress: String,
    /// The tunnel pool: sources translated.
    pub pool: Ipv4Net,
    /// Ports allocated to flows.
    pub ports: RangeInclusive<u16>,
    /// Idle timeouts.
    pub timeouts: SnatTimeouts,
}

/// How often the sweeper thread publishes the counters and table sizes.
const PUBLISH_INTERVAL: Duration = Duration::from_secs(1);

/// How often the sweeper runs: half the short timeout, between 1 and 10 seconds.
pub fn sweep_interval(timeouts: SnatTimeouts) -> Duration {
    (timeouts.idle / 2).clamp(Duration::from_secs(1), Duration::from_secs(10))
}

/// Parses `--snat-ports FIRST-LAST`.
pub fn parse_ports(s: &str) -> Result<RangeInclusive<u16>, String> {
    let (a, b) = s
        .split_once('-')
        .ok_or_else(|| format!("{s:?}: expected FIRST-LAST, e.g. 61000-65535"))?;
    let first: u16 = a
        .trim()
        .parse()
        .map_err(|e| format!("{s:?}: first port: {e}"))?;
    let last: u16 = b
        .trim()
        .parse()
        .map_err(|e| format!("{s:?}: last port: {e}"))?;
    if first == 0 || last < first {
        return Err(format!(
            "{s:?}: expected 1 <= FIRST <= LAST <= 65535 (e.g. 61000-65535)"
        ));
    }
    Ok(first..=last)
}

/// The first IPv4 address of interface `name` (the pod IP on `eth0`).
async fn egress_ipv4(name: &str) -> anyhow::Result<Ipv4Addr> {
    let (connection, handle, _) =
        rtnetlink::new_connection().context("cannot open a NETLINK_ROUTE socket")?;
    tokio::spawn(connection);
    let link = handle
        .link()
        .get()
        .match_name(name.to_owned())
        .execute()
        .try_next()
        .await
        .with_context(|| format!("cannot find interface {name} in the pod"))?
        .with_context(|| format!("the pod has no interface {name}; set --egress-interface"))?;
    let mut addresses = handle
        .address()
        .get()
        .set_link_index_filter(link.header.index)
        .execute();
    while let Some(msg) = addresses
        .try_next()
        .await
        .with_context(|| format!("cannot list the addresses of {name}"))?
    {
        for attr in &msg.attributes {
            if let AddressAttribute::Address(IpAddr::V4(ip)) = attr {
                return Ok(*ip);
            }
        }
    }
    anyhow::bail!("{name} has no IPv4 address: ebpf-snat needs the pod's IPv4 address as source")
}

/// Attaches the programs to `config.egress` and starts the sweeper thread, which
/// keeps them attached for the life of the process, expires idle flows every
/// [`sweep_interval`] and publishes the counters and table sizes every second.
pub async fn setup(config: &EbpfSnatConfig, counters: Arc<ManagerCounters>) -> anyhow::Result<()> {
    let pod_ip = egress_ipv4(&config.egress).await?;
    let settings = SnatSettings {
        pod_ip,
        pool: config.pool,
        ports: config.ports.clone(),
    };
    let mut snat = Snat::attach(&config.egress, &settings)
        .map_err(|e| anyhow::anyhow!("{}", error_chain(&e)))
        .with_context(|| {
            format!(
                "cannot attach the ebpf-snat programs to {} — the pod needs CAP_BPF and \
                 CAP_NET_ADMIN (CAP_SYS_ADMIN before Linux 5.8) and a kernel with BPF; \
                 or use --source-policy snat",
                config.egress
            )
        })?;
    counters.snat_enable();
    let timeouts = config.timeouts;
    let interval = sweep_interval(timeouts);
    std::thread::Builder::new()
        .name("ebpf-snat-sweep".into())
        .spawn(move || {
            let mut last_sweep = std::time::Instant::now();
            loop {
                let mut expired = 0;
                if last_sweep.elapsed() >= interval {
                    last_sweep = std::time::Instant::now();
                    match snat.sweep(monotonic_ns(), timeouts) {
                        Ok(r) => expired = r.expired + r.orphans,
                        Err(e) => {
                            warn!(error = %error_chain(&e), "ebpf-snat sweep failed; idle flows keep their ports until the next round")
                        }
                    }
                }
                match snat.stats() {
                    Ok(stats) => counters.snat_update(&stats, expired as u64),
                    Err(e) => {
                        warn!(error = %error_chain(&e), "cannot read the ebpf-snat counters")
                    }
                }
                std::thread::sleep(PUBLISH_INTERVAL);
            }
        })
        .context("cannot start the ebpf-snat sweeper thread")?;
    info!(
        %pod_ip,
        egress = %config.egress,
        pool = %config.pool,
        ports = %format!("{}-{}", config.ports.start(), config.ports.end()),
        tcp_timeout_s = timeouts.tcp.as_secs(),
        idle_timeout_s = timeouts.idle.as_secs(),
        "source policy ebpf-snat: laptop packets leave the pod with its IP, translated by TC programs on its egress interface"
    );
    Ok(())
}

/// An error and its sources on one line.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_ranges() {
        assert_eq!(parse_ports("61000-65535"), Ok(61000..=65535));
        assert_eq!(parse_ports(" 5 - 5 "), Ok(5..=5));
        assert!(parse_ports("0-10").is_err());
        assert!(parse_ports("10-9").is_err());
        assert!(parse_ports("61000").is_err());
        assert!(parse_ports("61000-70000").is_err());
    }

    #[test]
    fn sweep_interval_is_bounded() {
        let t = |idle| SnatTimeouts {
            tcp: Duration::from_secs(7200),
            idle: Duration::from_secs(idle),
        };
        assert_eq!(sweep_interval(t(2)), Duration::from_secs(1));
        assert_eq!(sweep_interval(t(0)), Duration::from_secs(1));
        assert_eq!(sweep_interval(t(60)), Duration::from_secs(10));
        assert_eq!(sweep_interval(t(8)), Duration::from_secs(4));
    }
}
