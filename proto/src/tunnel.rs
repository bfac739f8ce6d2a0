//! The laptop's IPv6 tunnel IP of a dual-stack session (pure, no I/O).
//!
//! The manager leases IPv4 tunnel IPs from its pool (100.96.0.0/16). A
//! session's IPv6 tunnel IP is not leased separately: it is the IPv4 tunnel IP
//! embedded in the last 32 bits of [`TUNNEL_POOL_V6`] (the way RFC 6052 embeds
//! IPv4 in a /96), so it is unique, stable per client and freed exactly when
//! the IPv4 lease is, and the lease store needs no second pool. The manager
//! stack's own IPv6 address (`fd6b:7670:6e00::1`) maps to 0.0.0.1, never a
//! leased address.

use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::Ipv6Net;

/// The IPv6 tunnel pool, `fd6b:7670:6e00::/96` (a ULA, "kvpn" in the global ID).
pub const TUNNEL_POOL_V6: Ipv6Net =
    Ipv6Net::new_assert(Ipv6Addr::new(0xfd6b, 0x7670, 0x6e00, 0, 0, 0, 0, 0), 96);

/// The IPv6 tunnel IP of the session whose IPv4 tunnel IP is `v4`:
/// `100.96.0.2` → `fd6b:7670:6e00::6460:2`.
pub fn ipv6_tunnel_ip(v4: Ipv4Addr) -> Ipv6Addr {
    let bits = u128::from(TUNNEL_POOL_V6.network()) | u128::from(u32::from(v4));
    Ipv6Addr::from(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embeds_the_ipv4_tunnel_ip_in_the_pool() {
        let v6 = ipv6_tunnel_ip(Ipv4Addr::new(100, 96, 0, 2));
        assert_eq!(
            v6,
            "fd6b:7670:6e00::6460:2"
                .parse::<Ipv6Addr>()
                .expect("literal")
        );
        assert!(TUNNEL_POOL_V6.contains(&v6));
        assert_eq!(TUNNEL_POOL_V6.to_string(), "fd6b:7670:6e00::/96");
        assert_ne!(
            ipv6_tunnel_ip(Ipv4Addr::new(100, 96, 0, 3)),
            v6,
            "distinct IPv4 tunnel IPs give distinct IPv6 ones"
        );
    }
}
