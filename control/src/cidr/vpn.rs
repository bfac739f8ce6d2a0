//! Other VPNs' endpoints: addresses the laptop's own policy routing and routes
//! send somewhere on purpose, which a cluster range must never capture (issue 29
//! item 3: with a wg-quick-style setup whose endpoint was inside the pod CIDR,
//! kvpn's pod route won and the other VPN's own packets went into the TUN device).
//!
//! Three witnesses, each what a kind of VPN leaves in the kernel:
//! - fwmark policy routing (wg-quick, wireguard-go, Tailscale, OpenVPN `--mark`):
//!   an `ip rule` matching a firewall mark, and the VPN's own sockets carrying
//!   that mark; the peers of those sockets are its endpoints. Socket marks come
//!   from sock_diag (`INET_DIAG_MARK`), which the kernel only reports to a
//!   caller with CAP_NET_ADMIN: without it, a found fwmark rule becomes a
//!   problem the user is told about.
//! - an `ip rule` sending one host to the main table (`to 203.0.113.7 lookup
//!   main`): a VPN exempting its endpoint from its own catch-all table, so the
//!   main table, where kvpn's routes are, decides;
//! - a host route through a gateway (`203.0.113.7 via 192.168.1.1`, OpenVPN,
//!   vpnc, strongSwan's table 220): a VPN pinning its endpoint to the uplink.
//!
//! Rules are consulted by priority, so only traffic that ends up in the main
//! table can meet kvpn's routes: a host or mark rule that sends its traffic to
//! another table (which routes it) is no capture risk and names nothing; an
//! inverted mark rule (`not fwmark M lookup T`) lets the marked traffic fall
//! through to main, and so does `fwmark M lookup main` (Tailscale's).
//!
//! Pure: [`mark_rules`], [`host_rules`], [`gateway_host_routes`],
//! [`parse_diag_msg`], [`marked_endpoints`]. I/O: [`dump_rules`] (rtnetlink,
//! unprivileged) and [`dump_sockets`] (a NETLINK_SOCK_DIAG socket).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use futures::TryStreamExt as _;
use rtnetlink::packet_route::route::{RouteAddress, RouteAttribute, RouteMessage, RouteType};
use rtnetlink::packet_route::rule::{RuleAction, RuleAttribute, RuleFlags, RuleMessage};

/// The route protocol of kvpn's own routes (never a witness).
const RTPROT_KVPN: u8 = kvpn_dataplane::netlink::RTPROT_KVPN;

/// A policy rule that selects packets by firewall mark.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MarkRule {
    pub pref: u32,
    pub mark: u32,
    /// `0xffffffff` when the rule gave none.
    pub mask: u32,
    /// `not fwmark …` (wg-quick's rule: everything *but* its own packets).
    pub invert: bool,
    /// The table it looks up (`None` for other actions).
    pub table: Option<u32>,
}

impl MarkRule {
    /// Whether a socket mark `mark` is what this rule selects (or, inverted,
    /// what it lets through: the VPN's own packets).
    pub fn matches(&self, mark: u32) -> bool {
        mark != 0 && mark & self.mask == self.mark
    }

    /// Whether the marked traffic this rule is about reaches the main table
    /// (where kvpn's routes are): an inverted rule lets it fall through, a
    /// rule to `main` sends it there.
    pub fn leads_to_main(&self) -> bool {
        self.invert || self.table == Some(254)
    }

    /// `ip rule`'s wording of it.
    pub fn describe(&self) -> String {
        let not = if self.invert { "not " } else { "" };
        let mask = if self.mask == u32::MAX {
            String::new()
        } else {
            format!("/{:#x}", self.mask)
        };
        let action = self
            .table
            .map_or_else(String::new, |t| format!(" lookup {}", table_name(t)));
        format!(
            "ip rule pref {} {not}fwmark {:#x}{mask}{action}",
            self.pref, self.mark
        )
    }
}

fn table_name(t: u32) -> String {
    match t {
        254 => "main".into(),
        255 => "local".into(),
        253 => "default".into(),
        n => n.to_string(),
    }
}

fn rule_table(r: &RuleMessage) -> Option<u32> {
    if r.header.action != RuleAction::ToTable {
        return None;
    }
    r.attributes
        .iter()
        .find_map(|a| match a {
            RuleAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .or(Some(u32::from(r.header.table)))
}

fn rule_pref(r: &RuleMessage) -> u32 {
    r.attributes
        .iter()
        .find_map(|a| match a {
            RuleAttribute::Priority(p) => Some(*p),
            _ => None,
        })
        .unwrap_or(0)
}

/// The fwmark rules among `rules` (an RTM_GETRULE dump).
pub fn mark_rules(rules: &[RuleMessage]) -> Vec<MarkRule> {
    rules
        .iter()
        .filter_map(|r| {
            let mark = r.attributes.iter().find_map(|a| match a {
                RuleAttribute::FwMark(m) => Some(*m),
                _ => None,
            })?;
            if mark == 0 {
                return None;
            }
            let mask = r
                .attributes
                .iter()
                .find_map(|a| match a {
                    RuleAttribute::FwMask(m) => Some(*m),
                    _ => None,
                })
                .unwrap_or(u32::MAX);
            Some(MarkRule {
                pref: rule_pref(r),
                mark,
                mask,
                invert: r.header.flags.contains(RuleFlags::Invert),
                table: rule_table(r),
            })
        })
        .collect()
}

/// Hosts that a rule sends to the main table by destination (`to <host> lookup
/// main`, full prefix length, not inverted), with the rule's wording.
pub fn host_rules(rules: &[RuleMessage]) -> Vec<(IpAddr, String)> {
    rules
        .iter()
        .filter(|r| !r.header.flags.contains(RuleFlags::Invert))
        .filter_map(|r| {
            let dst = r.attributes.iter().find_map(|a| match a {
                RuleAttribute::Destination(ip) => Some(*ip),
                _ => None,
            })?;
            let full = if dst.is_ipv4() { 32 } else { 128 };
            if r.header.dst_len != full || rule_table(r) != Some(254) {
                return None;
            }
            let action = "lookup main";
            Some((
                dst,
                format!(
                    "a host the laptop's policy routing sends its own way, as VPNs do for their \
                     endpoint (ip rule pref {} to {dst} {action})",
                    rule_pref(r)
                ),
            ))
        })
        .collect()
}

/// Host routes (`/32`, `/128`) through a gateway in any table but `local`, not
/// kvpn's own: a VPN pinning its endpoint to the uplink. With the route's wording.
pub fn gateway_host_routes(routes: &[RouteMessage]) -> Vec<(IpAddr, String)> {
    let mut out = Vec::new();
    for r in routes {
        let full = match r.header.address_family {
            rtnetlink::packet_route::AddressFamily::Inet => 32,
            rtnetlink::packet_route::AddressFamily::Inet6 => 128,
            _ => continue,
        };
        if r.header.destination_prefix_length != full
            || r.header.kind != RouteType::Unicast
            || u8::from(r.header.protocol) == RTPROT_KVPN
        {
            continue;
        }
        let table = r
            .attributes
            .iter()
            .find_map(|a| match a {
                RouteAttribute::Table(t) => Some(*t),
                _ => None,
            })
            .unwrap_or(u32::from(r.header.table));
        if table == 255 {
            continue;
        }
        let addr = |a: &RouteAddress| match a {
            RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
            RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
            _ => None,
        };
        let dst = r.attributes.iter().find_map(|a| match a {
            RouteAttribute::Destination(d) => addr(d),
            _ => None,
        });
        let gw = r.attributes.iter().find_map(|a| match a {
            RouteAttribute::Gateway(g) => addr(g),
            _ => None,
        });
        if let (Some(dst), Some(gw)) = (dst, gw) {
            out.push((
                dst,
                format!(
                    "a host route through a gateway, as VPNs pin their endpoint ({dst} via {gw}, \
                     table {})",
                    table_name(table)
                ),
            ));
        }
    }
    out
}

/// One socket of a sock_diag dump.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiagSocket {
    /// `"udp"` or `"tcp"`.
    pub proto: &'static str,
    pub peer: IpAddr,
    pub peer_port: u16,
    /// `None` when the kernel did not report it (no CAP_NET_ADMIN).
    pub mark: Option<u32>,
}

/// `struct inet_diag_msg` (linux/inet_diag.h) is 72 bytes; attributes follow.
const INET_DIAG_MSG_LEN: usize = 72;
/// `INET_DIAG_MARK` (linux/inet_diag.h): the socket's mark, u32.
const INET_DIAG_MARK: u16 = 15;

/// One `inet_diag_msg` payload (after its netlink header): the peer and, when
/// present, the mark. `None` for a payload too short to be one; never panics.
pub fn parse_diag_msg(proto: &'static str, payload: &[u8]) -> Option<DiagSocket> {
    let head = payload.get(..INET_DIAG_MSG_LEN)?;
    let family = head[0];
    // id: sport (4..6), dport (6..8), src (8..24), dst (24..40), both big-endian.
    let peer_port = u16::from_be_bytes([head[6], head[7]]);
    let dst: [u8; 16] = head[24..40].try_into().ok()?;
    let peer = match i32::from(family) {
        libc::AF_INET => IpAddr::V4(Ipv4Addr::new(dst[0], dst[1], dst[2], dst[3])),
        libc::AF_INET6 => IpAddr::V6(Ipv6Addr::from(dst)),
        _ => return None,
    };
    let mut mark = None;
    let mut rest = &payload[INET_DIAG_MSG_LEN..];
    while rest.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([rest[0], rest[1]]));
        let kind = u16::from_ne_bytes([rest[2], rest[3]]) & 0x3fff;
        if len < 4 || len > rest.len() {
            break;
        }
        if kind == INET_DIAG_MARK && len >= 8 {
            mark = Some(u32::from_ne_bytes([rest[4], rest[5], rest[6], rest[7]]));
        }
        let step = (len + 3) & !3;
        rest = rest.get(step..).unwrap_or_default();
    }
    Some(DiagSocket {
        proto,
        peer,
        peer_port,
        mark,
    })
}

/// The peers of sockets whose mark one of `rules` selects: the endpoints of the
/// VPN those rules belong to, with the wording. Sockets without a peer
/// (listening, unconnected UDP) name no endpoint.
pub fn marked_endpoints(sockets: &[DiagSocket], rules: &[MarkRule]) -> Vec<(IpAddr, String)> {
    let mut out: Vec<(IpAddr, String)> = Vec::new();
    for s in sockets {
        let Some(mark) = s.mark else { continue };
        if s.peer.is_unspecified() || s.peer_port == 0 || s.peer.is_loopback() {
            continue;
        }
        let Some(rule) = rules.iter().find(|r| r.leads_to_main() && r.matches(mark)) else {
            continue;
        };
        if out.iter().any(|(ip, _)| *ip == s.peer) {
            continue;
        }
        out.push((
            s.peer,
            format!(
                "another VPN's endpoint (a {} socket to {}:{} with fwmark {mark:#x}, {})",
                s.proto,
                s.peer,
                s.peer_port,
                rule.describe()
            ),
        ));
    }
    out
}

/// Why the sockets could not be listed.
#[derive(Debug, thiserror::Error)]
#[error("cannot list the laptop's sockets over sock_diag netlink: {0}")]
pub struct DiagError(std::io::Error);

/// Every UDP and TCP socket of the calling thread's network namespace (both
/// families), with marks when the caller has CAP_NET_ADMIN. Blocking (a few
/// netlink round trips, sub-millisecond here).
pub fn dump_sockets() -> Result<Vec<DiagSocket>, DiagError> {
    let mut out = Vec::new();
    for (family, v6) in [(libc::AF_INET, false), (libc::AF_INET6, true)] {
        for (proto, name) in [(libc::IPPROTO_UDP, "udp"), (libc::IPPROTO_TCP, "tcp")] {
            match dump_one(family, proto, name) {
                Ok(mut s) => out.append(&mut s),
                // IPv6 off (rt-08): no IPv6 sockets to list.
                Err(_) if v6 => {}
                Err(e) => return Err(DiagError(e)),
            }
        }
    }
    Ok(out)
}

/// `SOCK_DIAG_BY_FAMILY` (linux/sock_diag.h).
const SOCK_DIAG_BY_FAMILY: u16 = 20;

fn dump_one(family: i32, proto: i32, name: &'static str) -> std::io::Result<Vec<DiagSocket>> {
    use std::os::fd::{FromRawFd as _, OwnedFd};
    // SAFETY: socket(2) with constant arguments; the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor this function owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    use std::os::fd::AsRawFd as _;
    // nlmsghdr (16) + inet_diag_req_v2 (56): family, protocol, ext, pad,
    // states (all), an all-zero socket id (no filter).
    let mut req = [0u8; 72];
    req[0..4].copy_from_slice(&72u32.to_ne_bytes());
    req[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    req[6..8].copy_from_slice(&flags.to_ne_bytes());
    req[8..12].copy_from_slice(&1u32.to_ne_bytes());
    req[16] = family as u8;
    req[17] = proto as u8;
    req[20..24].copy_from_slice(&u32::MAX.to_ne_bytes());
    // SAFETY: sends `req`'s bytes on the owned socket (kernel address: zeroed
    // sockaddr_nl with the family set).
    let sent = unsafe {
        let mut addr: libc::sockaddr_nl = std::mem::zeroed();
        addr.nl_family = libc::AF_NETLINK as u16;
        libc::sendto(
            fd.as_raw_fd(),
            req.as_ptr().cast(),
            req.len(),
            0,
            (&raw const addr).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as u32,
        )
    };
    if sent < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        // SAFETY: receives into `buf`, whose length is passed.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        let mut rest = &buf[..n as usize];
        while rest.len() >= 16 {
            let len = u32::from_ne_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
            let kind = u16::from_ne_bytes([rest[4], rest[5]]);
            if len < 16 || len > rest.len() {
                return Ok(out);
            }
            match i32::from(kind) {
                libc::NLMSG_DONE => return Ok(out),
                libc::NLMSG_ERROR => {
                    let code = rest
                        .get(16..20)
                        .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                        .unwrap_or(0);
                    if code == 0 {
                        return Ok(out);
                    }
                    return Err(std::io::Error::from_raw_os_error(-code));
                }
                _ => out.extend(parse_diag_msg(name, &rest[16..len])),
            }
            rest = rest.get((len + 3) & !3..).unwrap_or_default();
        }
    }
}

/// The policy rules of the calling thread's network namespace, both families.
/// Needs a tokio runtime.
pub async fn dump_rules() -> Result<Vec<RuleMessage>, String> {
    let (connection, handle, _) = rtnetlink::new_connection().map_err(|e| e.to_string())?;
    let task = tokio::spawn(connection);
    let mut rules = Vec::new();
    let mut result = Ok(());
    for v in [rtnetlink::IpVersion::V4, rtnetlink::IpVersion::V6] {
        let v6 = v == rtnetlink::IpVersion::V6;
        let mut stream = handle.rule().get(v).execute();
        loop {
            match stream.try_next().await {
                Ok(Some(r)) => rules.push(r),
                Ok(None) => break,
                Err(_) if v6 => break,
                Err(e) => {
                    result = Err(e.to_string());
                    break;
                }
            }
        }
    }
    task.abort();
    result.map(|()| rules)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(attrs: Vec<RuleAttribute>, invert: bool, dst_len: u8) -> RuleMessage {
        let mut r = RuleMessage::default();
        r.header.action = RuleAction::ToTable;
        r.header.dst_len = dst_len;
        if invert {
            r.header.flags = RuleFlags::Invert;
        }
        r.attributes = attrs;
        r
    }

    #[test]
    fn wg_quick_rules_name_the_marked_sockets_peers_as_endpoints() {
        let rules = vec![
            rule(
                vec![
                    RuleAttribute::Priority(32765),
                    RuleAttribute::FwMark(0xca6c),
                    RuleAttribute::Table(51820),
                ],
                true,
                0,
            ),
            rule(
                vec![RuleAttribute::Priority(32764), RuleAttribute::Table(254)],
                false,
                0,
            ),
        ];
        let marks = mark_rules(&rules);
        assert_eq!(marks.len(), 1);
        assert_eq!(
            marks[0].describe(),
            "ip rule pref 32765 not fwmark 0xca6c lookup 51820"
        );
        let peer: IpAddr = "10.244.250.7".parse().expect("ip");
        let sockets = vec![
            DiagSocket {
                proto: "udp",
                peer,
                peer_port: 51820,
                mark: Some(0xca6c),
            },
            // Unmarked, unconnected and other-marked sockets name nothing.
            DiagSocket {
                proto: "udp",
                peer: "10.244.1.1".parse().expect("ip"),
                peer_port: 53,
                mark: Some(0),
            },
            DiagSocket {
                proto: "udp",
                peer: "0.0.0.0".parse().expect("ip"),
                peer_port: 0,
                mark: Some(0xca6c),
            },
            DiagSocket {
                proto: "tcp",
                peer: "10.244.1.2".parse().expect("ip"),
                peer_port: 443,
                mark: Some(0x1),
            },
            DiagSocket {
                proto: "tcp",
                peer: "10.244.1.3".parse().expect("ip"),
                peer_port: 443,
                mark: None,
            },
        ];
        let found = marked_endpoints(&sockets, &marks);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].0, peer);
        assert!(found[0].1.contains("another VPN's endpoint"), "{found:?}");
        assert!(found[0].1.contains("fwmark 0xca6c"), "{found:?}");
    }

    #[test]
    fn a_masked_mark_matches_by_mask() {
        let r = MarkRule {
            pref: 5270,
            mark: 0x80000,
            mask: 0xff0000,
            invert: false,
            table: Some(52),
        };
        assert!(r.matches(0x80000));
        assert!(r.matches(0x80abc));
        assert!(!r.matches(0x90000));
        assert!(!r.matches(0));
        assert_eq!(
            r.describe(),
            "ip rule pref 5270 fwmark 0x80000/0xff0000 lookup 52"
        );
    }

    #[test]
    fn host_rules_take_full_length_destinations_to_main_only() {
        let rules = vec![
            rule(
                vec![
                    RuleAttribute::Priority(100),
                    RuleAttribute::Destination("203.0.113.7".parse().expect("ip")),
                    RuleAttribute::Table(254),
                ],
                false,
                32,
            ),
            rule(
                vec![
                    RuleAttribute::Priority(101),
                    RuleAttribute::Destination("10.0.0.0".parse().expect("ip")),
                    RuleAttribute::Table(254),
                ],
                false,
                8,
            ),
            // To another table: that table routes it, kvpn's main routes never
            // see it.
            rule(
                vec![
                    RuleAttribute::Priority(50),
                    RuleAttribute::Destination("10.96.0.10".parse().expect("ip")),
                    RuleAttribute::Table(29001),
                ],
                false,
                32,
            ),
        ];
        let hosts = host_rules(&rules);
        assert_eq!(hosts.len(), 1, "{hosts:?}");
        assert_eq!(hosts[0].0, "203.0.113.7".parse::<IpAddr>().expect("ip"));
        assert!(hosts[0].1.contains("pref 100 to 203.0.113.7 lookup main"));
    }

    /// A mark rule that sends the marked traffic to its own table keeps it
    /// away from the main table: its sockets' peers are no capture risk.
    #[test]
    fn marked_traffic_sent_to_another_table_names_no_endpoint() {
        let own_table = MarkRule {
            pref: 100,
            mark: 0x1,
            mask: u32::MAX,
            invert: false,
            table: Some(100),
        };
        let tailscale = MarkRule {
            table: Some(254),
            ..own_table.clone()
        };
        let s = DiagSocket {
            proto: "udp",
            peer: "10.244.1.9".parse().expect("ip"),
            peer_port: 41641,
            mark: Some(0x1),
        };
        assert!(marked_endpoints(std::slice::from_ref(&s), &[own_table]).is_empty());
        assert_eq!(marked_endpoints(&[s], &[tailscale]).len(), 1);
    }

    #[test]
    fn diag_messages_parse_and_short_ones_do_not_panic() {
        let mut msg = vec![0u8; INET_DIAG_MSG_LEN];
        msg[0] = libc::AF_INET as u8;
        msg[6..8].copy_from_slice(&51820u16.to_be_bytes());
        msg[24..28].copy_from_slice(&[10, 244, 250, 7]);
        // INET_DIAG_MARK attribute: len 8, type 15, value.
        msg.extend_from_slice(&8u16.to_ne_bytes());
        msg.extend_from_slice(&INET_DIAG_MARK.to_ne_bytes());
        msg.extend_from_slice(&0xca6cu32.to_ne_bytes());
        let s = parse_diag_msg("udp", &msg).expect("parsed");
        assert_eq!(s.peer, "10.244.250.7".parse::<IpAddr>().expect("ip"));
        assert_eq!(s.peer_port, 51820);
        assert_eq!(s.mark, Some(0xca6c));
        for cut in 0..msg.len() {
            let _ = parse_diag_msg("udp", &msg[..cut]);
        }
        assert_eq!(parse_diag_msg("udp", &msg[..INET_DIAG_MSG_LEN - 1]), None);
    }
}
