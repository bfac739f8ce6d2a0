//! The per-interface IPv4 settings the pool TUN path (`preserve`, `ebpf-snat`)
//! needs — forwarding on, rp_filter loose — set over rtnetlink, never through
//! `/proc/sys`.
//!
//! Why not `net.ipv4.ip_forward`: container runtimes (runc) mount `/proc/sys`
//! read-only in every non-privileged container, so a write there fails in a pod
//! whatever its capabilities. The kernel does not need the global switch: IPv4
//! decides forwarding by the packet's *input* device (`IN_DEV_FORWARD(in_dev)` in
//! `ip_route_input_slow`, net/ipv4/route.c), and that per-device value can be set
//! with RTM_SETLINK, `IFLA_AF_SPEC` → `AF_INET` → `IFLA_INET_CONF`, given
//! CAP_NET_ADMIN over the pod's network namespace (net/ipv4/devinet.c
//! `inet_validate_link_af`, `inet_set_link_af`). rp_filter is per device as well;
//! the kernel applies max(all, device) (`IN_DEV_MAXCONF`), so loose (2) on the
//! device is loose whatever `all` says.
//!
//! Wire formats: a dump (RTM_GETLINK) carries `IFLA_INET_CONF` as a flat array of
//! u32, entry *i* holding `IPV4_DEVCONF_*` index *i*+1; a request carries it as
//! nested attributes whose type is the `IPV4_DEVCONF_*` index
//! (include/uapi/linux/ip.h: FORWARDING = 1, RP_FILTER = 8) and whose payload is
//! a u32. netlink-packet-route 0.34 emits the request format for
//! [`AfSpecInet::DevConfRequest`], leaving out fields that are 0 (so a request
//! can raise a value, never lower one to 0 — enough here); the unit tests pin both
//! formats byte for byte.
//!
//! What the sysctl path did that this one does not: a write of
//! `conf/<dev>/forwarding` also turns LRO off on the device and sends
//! RTM_NEWNETCONF (`devinet_sysctl_forward`). A TUN device and a pod's veth have
//! no LRO, and nothing in the pod listens for netconf events.
//!
//! I/O: only [`ensure`] (RTM_GETLINK, RTM_SETLINK, RTM_GETLINK on the given
//! rtnetlink handle); the rest is pure.

use futures::TryStreamExt as _;
use rtnetlink::LinkUnspec;
use rtnetlink::packet_core::ErrorMessage;
use rtnetlink::packet_route::link::{
    AfSpecInet, AfSpecUnspec, InetDevConf, LinkAttribute, LinkMessage,
};

/// `IPV4_DEVCONF_FORWARDING` on: the kernel forwards packets that arrive on the
/// device.
pub const FORWARDING_ON: i32 = 1;
/// `IPV4_DEVCONF_RP_FILTER` loose (RFC 3704): a source must be routable through
/// some device, not necessarily the one it arrived on.
pub const RP_FILTER_LOOSE: i32 = 2;

/// Setting or reading an interface's IPv4 settings failed.
#[derive(Debug, thiserror::Error)]
pub enum DevConfError {
    /// RTM_GETLINK failed.
    #[error("cannot read the IPv4 settings of {interface} (RTM_GETLINK): {source}")]
    Read {
        interface: String,
        #[source]
        source: rtnetlink::Error,
    },
    /// The dump had no `IFLA_INET_CONF`: the device has no IPv4 state.
    #[error(
        "{interface} reports no IPv4 settings (no IFLA_INET_CONF in RTM_GETLINK; is its MTU \
         below 68, or the interface gone?) — the pool TUN path needs IPv4 on it"
    )]
    NoIpv4 { interface: String },
    /// The kernel refused RTM_SETLINK for lack of a capability.
    #[error(
        "cannot set {changes} on {interface}: permission denied (RTM_SETLINK needs \
         CAP_NET_ADMIN in the pod's network namespace) — add NET_ADMIN to the manager \
         container's securityContext.capabilities.add (`kvpn install` does for \
         preserve and ebpf-snat), or use --source-policy snat"
    )]
    Denied { interface: String, changes: String },
    /// RTM_SETLINK failed for another reason.
    #[error("cannot set {changes} on {interface} (RTM_SETLINK IFLA_INET_CONF): {source}")]
    Set {
        interface: String,
        changes: String,
        #[source]
        source: rtnetlink::Error,
    },
    /// The kernel accepted the request but the values read back differ.
    #[error(
        "{interface} still has forwarding={forwarding} rp_filter={rp_filter} after RTM_SETLINK \
         asked for forwarding={FORWARDING_ON} rp_filter={RP_FILTER_LOOSE} — something in \
         the pod resets them (a CNI plugin or an agent writing conf/{interface}); \
         the laptops' packets would not be forwarded"
    )]
    NotApplied {
        interface: String,
        forwarding: i32,
        rp_filter: i32,
    },
}

/// What [`ensure`] found and did on one interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// The values before (`forwarding`, `rp_filter`).
    pub before: (i32, i32),
    /// Whether a RTM_SETLINK was needed (false: both were already right).
    pub changed: bool,
}

/// Whether `conf` already forwards and filters loosely.
pub fn satisfied(conf: &InetDevConf) -> bool {
    conf.forwarding == FORWARDING_ON && conf.rp_filter == RP_FILTER_LOOSE
}

/// The request that brings `current` to forwarding on and rp_filter loose, with
/// only the fields that must change (others 0, which the request format leaves
/// out); `None` when nothing must change.
pub fn request(current: &InetDevConf) -> Option<InetDevConf> {
    let mut want = InetDevConf::default();
    if current.forwarding != FORWARDING_ON {
        want.forwarding = FORWARDING_ON;
    }
    if current.rp_filter != RP_FILTER_LOOSE {
        want.rp_filter = RP_FILTER_LOOSE;
    }
    (want != InetDevConf::default()).then_some(want)
}

/// The request's fields as `forwarding=1 rp_filter=2` (for errors and logs).
pub fn describe(request: &InetDevConf) -> String {
    let mut parts = Vec::new();
    if request.forwarding != 0 {
        parts.push(format!("forwarding={}", request.forwarding));
    }
    if request.rp_filter != 0 {
        parts.push(format!("rp_filter={}", request.rp_filter));
    }
    parts.join(" ")
}

/// The RTM_SETLINK attribute carrying `request`: `IFLA_AF_SPEC` → `AF_INET` →
/// `IFLA_INET_CONF` (nested, request format).
pub fn set_attribute(request: InetDevConf) -> LinkAttribute {
    LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet(vec![AfSpecInet::DevConfRequest(
        request,
    )])])
}

/// The IPv4 settings in a RTM_GETLINK answer (its `IFLA_INET_CONF`), if any.
pub fn inet_conf(link: &LinkMessage) -> Option<InetDevConf> {
    link.attributes.iter().find_map(|attr| match attr {
        LinkAttribute::AfSpecUnspec(specs) => specs.iter().find_map(|spec| match spec {
            AfSpecUnspec::Inet(inet) => inet.iter().find_map(|item| match item {
                AfSpecInet::DevConf(conf) => Some(*conf),
                _ => None,
            }),
            _ => None,
        }),
        _ => None,
    })
}

async fn read(
    handle: &rtnetlink::Handle,
    index: u32,
    interface: &str,
) -> Result<InetDevConf, DevConfError> {
    let link = handle
        .link()
        .get()
        .match_index(index)
        .execute()
        .try_next()
        .await
        .map_err(|source| DevConfError::Read {
            interface: interface.to_owned(),
            source,
        })?;
    link.as_ref()
        .and_then(inet_conf)
        .ok_or_else(|| DevConfError::NoIpv4 {
            interface: interface.to_owned(),
        })
}

/// Turns IPv4 forwarding on and rp_filter loose on interface `index` (named
/// `interface` in errors) unless both already are, then reads them back: an
/// error unless the kernel now reports forwarding=1 rp_filter=2. Needs
/// CAP_NET_ADMIN only when something must change; without it the error says so.
pub async fn ensure(
    handle: &rtnetlink::Handle,
    index: u32,
    interface: &str,
) -> Result<Outcome, DevConfError> {
    let current = read(handle, index, interface).await?;
    let before = (current.forwarding, current.rp_filter);
    let Some(want) = request(&current) else {
        return Ok(Outcome {
            before,
            changed: false,
        });
    };
    let changes = describe(&want);
    let msg = LinkUnspec::new_with_index(index)
        .append_extra_attribute(set_attribute(want))
        .build();
    if let Err(source) = handle.link().set(msg).execute().await {
        let denied = matches!(
            &source,
            rtnetlink::Error::NetlinkError(ErrorMessage { code: Some(code), .. })
                if -code.get() == libc::EPERM || -code.get() == libc::EACCES
        );
        return Err(if denied {
            DevConfError::Denied {
                interface: interface.to_owned(),
                changes,
            }
        } else {
            DevConfError::Set {
                interface: interface.to_owned(),
                changes,
                source,
            }
        });
    }
    let after = read(handle, index, interface).await?;
    if !satisfied(&after) {
        return Err(DevConfError::NotApplied {
            interface: interface.to_owned(),
            forwarding: after.forwarding,
            rp_filter: after.rp_filter,
        });
    }
    Ok(Outcome {
        before,
        changed: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtnetlink::packet_core::{Emitable as _, NlaBuffer, Parseable as _};

    fn conf(forwarding: i32, rp_filter: i32) -> InetDevConf {
        let mut c = InetDevConf::default();
        c.forwarding = forwarding;
        c.rp_filter = rp_filter;
        c
    }

    /// One netlink attribute header (native byte order, as netlink is).
    fn nla_header(len: u16, kind: u16) -> Vec<u8> {
        let mut v = len.to_ne_bytes().to_vec();
        v.extend_from_slice(&kind.to_ne_bytes());
        v
    }

    #[test]
    fn request_asks_only_for_what_differs() {
        let both = request(&conf(0, 1)).expect("both differ");
        assert_eq!((both.forwarding, both.rp_filter), (1, 2));
        assert_eq!(describe(&both), "forwarding=1 rp_filter=2");
        // ip_forward=1 in the pod: forwarding is already on, only rp_filter.
        let rp = request(&conf(1, 0)).expect("rp_filter differs");
        assert_eq!((rp.forwarding, rp.rp_filter), (0, 2));
        assert_eq!(describe(&rp), "rp_filter=2");
        let fwd = request(&conf(0, 2)).expect("forwarding differs");
        assert_eq!(describe(&fwd), "forwarding=1");
        assert_eq!(request(&conf(1, 2)), None);
        assert!(satisfied(&conf(1, 2)));
        assert!(!satisfied(&conf(1, 1)));
        // Only the two fields: the rest of the request stays 0 (left out).
        let mut other = conf(0, 0);
        other.accept_local = 1;
        let r = request(&other).expect("differs");
        assert_eq!(r.accept_local, 0);
    }

    /// The SET format the kernel's `inet_validate_link_af` accepts:
    /// IFLA_AF_SPEC(26) { AF_INET(2) { IFLA_INET_CONF(1)|NLA_F_NESTED {
    /// FORWARDING(1): u32 1, RP_FILTER(8): u32 2 } } }.
    #[test]
    fn set_attribute_is_nested_devconf_index_and_u32() {
        let attr = set_attribute(conf(1, 2));
        let mut got = vec![0u8; attr.buffer_len()];
        attr.emit(&mut got);
        let mut want = nla_header(28, 26); // IFLA_AF_SPEC
        want.extend(nla_header(24, 2)); // AF_INET
        want.extend(nla_header(20, 1 | 0x8000)); // IFLA_INET_CONF, NLA_F_NESTED
        want.extend(nla_header(8, 1)); // IPV4_DEVCONF_FORWARDING
        want.extend(1u32.to_ne_bytes());
        want.extend(nla_header(8, 8)); // IPV4_DEVCONF_RP_FILTER
        want.extend(2u32.to_ne_bytes());
        assert_eq!(got, want);

        // Only forwarding: one inner attribute, rp_filter left alone.
        let attr = set_attribute(conf(1, 0));
        let mut got = vec![0u8; attr.buffer_len()];
        attr.emit(&mut got);
        let mut want = nla_header(20, 26);
        want.extend(nla_header(16, 2));
        want.extend(nla_header(12, 1 | 0x8000));
        want.extend(nla_header(8, 1));
        want.extend(1u32.to_ne_bytes());
        assert_eq!(got, want);
    }

    /// The GET format: IFLA_INET_CONF is a flat u32 array, entry i = index i+1.
    #[test]
    fn dump_format_is_a_flat_array() {
        // 33 entries as the library knows them; the kernel may send more.
        let mut values = [0u32; 40];
        values[0] = 1; // FORWARDING
        values[7] = 2; // RP_FILTER
        values[22] = 1; // ACCEPT_LOCAL
        let mut bytes = nla_header(4 + 4 * values.len() as u16, 1);
        for v in values {
            bytes.extend(v.to_ne_bytes());
        }
        let parsed = AfSpecInet::parse(&NlaBuffer::new(&bytes[..])).expect("parses");
        let AfSpecInet::DevConf(c) = parsed else {
            panic!("expected DevConf, got {parsed:?}");
        };
        assert_eq!((c.forwarding, c.rp_filter, c.accept_local), (1, 2, 1));
        let mut link = LinkMessage::default();
        link.attributes = vec![LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet(vec![
            AfSpecInet::DevConf(c),
        ])])];
        assert_eq!(inet_conf(&link), Some(c));
        assert_eq!(inet_conf(&LinkMessage::default()), None);
    }

    #[test]
    fn denied_names_the_capability_and_the_fix() {
        let e = DevConfError::Denied {
            interface: "eth0".into(),
            changes: "forwarding=1".into(),
        }
        .to_string();
        assert!(e.contains("CAP_NET_ADMIN"), "{e}");
        assert!(e.contains("capabilities.add"), "{e}");
        assert!(e.contains("eth0") && e.contains("forwarding=1"), "{e}");
    }
}
