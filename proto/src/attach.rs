//! Per-workload tunnels (`kvpn attach`): the names and derivations the laptop's
//! CLI and the tunnel container in an attached pod must agree on. Pure, no I/O.
//!
//! The tunnel container leases its own tunnel IP from the traffic manager over
//! gRPC on the manager's attach port ([`ATTACH_PORT`], TLS with the manager's
//! certificate, reachable through the manager's Service). That port answers only
//! calls that carry the **attach key** in metadata [`ATTACH_KEY_HEADER`]: a
//! SHA-256 over the manager's TLS private key ([`attach_key`]). Whoever may read
//! Secret `kvpn-manager-tls` (the laptop that installed the manager) can compute
//! it, the manager computes it from its mounted key, and nobody else in the
//! cluster can: a pod that merely reaches the Service cannot lease. Replacing
//! the TLS key (a new install) replaces the attach key.
//!
//! Each replica's client id is derived from the attach key and its pod UID
//! ([`replica_client_id`]): stable across restarts of the tunnel container (the
//! same lease comes back), distinct per replica, and computable by the laptop
//! for `kvpn status`, which finds each replica's lease by it.

use sha2::{Digest as _, Sha256};

/// The manager's attach port: gRPC `Lease` over TLS for tunnel containers.
pub const ATTACH_PORT: u16 = 10804;

/// The manager's gateway port (UDP): VXLAN from the pods of workloads attached
/// with `kvpn attach --via gateway` (docs/tunnel-ownership.md).
pub const GATEWAY_PORT: u16 = 10805;

/// The VXLAN network identifier of the gateway's encapsulation.
pub const GATEWAY_VNI: u32 = 9696;

/// The next hop an attached pod routes the tunnel pool through (link-local,
/// on its VXLAN device, never on a wire).
pub const GATEWAY_NEXT_HOP: std::net::Ipv4Addr = std::net::Ipv4Addr::new(169, 254, 96, 2);

/// The next hop's MAC address (locally administered), a permanent neighbour
/// entry in the pod; the manager answers from it.
pub const GATEWAY_MAC: [u8; 6] = [0x02, 0x6b, 0x76, 0x70, 0x6e, 0x01];

/// gRPC metadata key carrying the attach key on the attach port.
pub const ATTACH_KEY_HEADER: &str = "kvpn-attach-key";

/// Domain separation of [`attach_key`] so the digest is used for nothing else.
const ATTACH_KEY_CONTEXT: &[u8] = b"kvpn attach key v1\0";

/// Domain separation of [`replica_client_id`].
const CLIENT_ID_CONTEXT: &[u8] = b"kvpn attach client id v1\0";

/// The attach key of a manager whose TLS private key is `key_pem` (the bytes of
/// `tls.key` in Secret `kvpn-manager-tls`): 64 lowercase hex digits.
pub fn attach_key(key_pem: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(ATTACH_KEY_CONTEXT);
    h.update(key_pem);
    hex(&h.finalize())
}

/// The client id of the replica with pod UID `pod_uid` under `attach_key`:
/// 32 lowercase hex digits (the shape of a laptop's client id).
pub fn replica_client_id(attach_key: &str, pod_uid: &str) -> String {
    let mut h = Sha256::new();
    h.update(CLIENT_ID_CONTEXT);
    h.update(attach_key.as_bytes());
    h.update(b"\0");
    h.update(pod_uid.as_bytes());
    hex(&h.finalize()[..16])
}

/// Compare two keys in time independent of where they differ.
pub fn keys_equal(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attach_key_is_64_hex_digits_and_depends_on_the_key() {
        let a = attach_key(b"-----BEGIN PRIVATE KEY-----\nAAAA\n");
        let b = attach_key(b"-----BEGIN PRIVATE KEY-----\nAAAB\n");
        assert_eq!(a.len(), 64);
        assert!(
            a.bytes()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_ne!(a, b);
        assert_eq!(a, attach_key(b"-----BEGIN PRIVATE KEY-----\nAAAA\n"));
    }

    #[test]
    fn replica_client_ids_are_stable_per_pod_and_distinct_across_pods_and_keys() {
        let key = attach_key(b"k");
        let one = replica_client_id(&key, "7c1a0f9e-0000-4000-8000-000000000001");
        assert_eq!(one.len(), 32);
        assert_eq!(
            one,
            replica_client_id(&key, "7c1a0f9e-0000-4000-8000-000000000001")
        );
        assert_ne!(
            one,
            replica_client_id(&key, "7c1a0f9e-0000-4000-8000-000000000002")
        );
        assert_ne!(
            one,
            replica_client_id(
                &attach_key(b"other"),
                "7c1a0f9e-0000-4000-8000-000000000001"
            )
        );
    }

    #[test]
    fn keys_equal_compares_whole_strings() {
        assert!(keys_equal("abc", "abc"));
        assert!(!keys_equal("abc", "abd"));
        assert!(!keys_equal("abc", "abcd"));
        assert!(!keys_equal("", "a"));
    }
}
