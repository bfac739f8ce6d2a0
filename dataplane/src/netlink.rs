//! Addresses, routes, rp_filter and link removal through rtnetlink. I/O: one
//! NETLINK_ROUTE socket, opened in the network namespace of the thread that calls
//! [`Netlink::new`] (the daemon runs inside the laptop's namespace).
//!
//! Every route kvpn installs carries the route protocol [`RTPROT_KVPN`] (0x6b,
//! 107; `ip route` prints `proto 107`), so that a sweep after a crash finds exactly
//! kvpn's routes (`ip route show proto 107`) without guessing from device names.

use std::net::IpAddr;

use futures::TryStreamExt as _;
use ipnet::IpNet;
use rtnetlink::packet_core::ErrorMessage;
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::packet_route::link::{
    AfSpecInet, AfSpecUnspec, InetDevConf, LinkAttribute, LinkMessage,
};
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope,
};
use rtnetlink::packet_route::rule::{RuleAction, RuleAttribute, RuleMessage};
use rtnetlink::{Handle, LinkUnspec, RouteMessageBuilder};

use crate::conflicts::LaptopRoute;

/// Route protocol number tagging kvpn's routes (`rtm_protocol`). Values above
/// RTPROT_STATIC (4) are free for routing daemons (include/uapi/linux/rtnetlink.h);
/// 107 is not in iproute2's `rt_protos` list.
pub const RTPROT_KVPN: u8 = 0x6b;

/// Transmit queue of the TUN device, packets (the kernel's default for TUN is
/// 500). Applications hand the kernel bursts faster than the pump reads: a
/// process closing 1,000 sockets with SO_LINGER 0 (the bench's idle flows)
/// queues 1,000 RSTs at once, and with 500 up to 228 of them were dropped, so
/// the manager kept those flows (and their pod connections) open. Only queued
/// packets cost memory; TCP's own small-queue limit keeps bulk flows far
/// below it.
pub const TUN_TX_QUEUE_LEN: u32 = 4096;

/// rp_filter value for loose reverse-path filtering (RFC 3704 loose mode;
/// Documentation/networking/ip-sysctl.rst). The kernel applies
/// max(conf/all, conf/<dev>), so 2 on the TUN wins over a strict `all=1` (rt-06).
pub const RP_FILTER_LOOSE: i32 = 2;

/// A failed netlink operation.
#[derive(Debug, thiserror::Error)]
#[error("{op}: {cause}")]
pub struct NetlinkError {
    /// What was attempted, with its inputs.
    pub op: String,
    /// The kernel's answer, as text (errno name where there is one).
    pub cause: String,
    /// The errno, when the kernel sent one.
    pub errno: Option<i32>,
}

impl NetlinkError {
    fn new(op: impl Into<String>, err: rtnetlink::Error) -> Self {
        let (cause, errno) = match &err {
            rtnetlink::Error::NetlinkError(ErrorMessage {
                code: Some(code), ..
            }) => {
                let errno = -code.get();
                (
                    std::io::Error::from_raw_os_error(errno).to_string(),
                    Some(errno),
                )
            }
            other => (other.to_string(), None),
        };
        Self {
            op: op.into(),
            cause,
            errno,
        }
    }
}

/// A route kvpn installed, as read back from the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvpnRoute {
    /// Destination prefix.
    pub dst: IpNet,
    /// Output interface index.
    pub oif: u32,
}

/// An rtnetlink connection.
#[derive(Debug, Clone)]
pub struct Netlink {
    handle: Handle,
    /// One dump at a time on this socket (shared by the clones, like the
    /// socket): the kernel answers a second dump
    /// request on a socket whose dump is still running with EBUSY
    /// (`netlink_dump_start`), and Status, Connect and the route watch dump
    /// routes concurrently.
    dumps: std::sync::Arc<tokio::sync::Mutex<()>>,
    /// The routing table [`Netlink::add_route`], [`Netlink::del_route`] and
    /// [`Netlink::kvpn_routes`] work on: main, or a run session's own
    /// ([`Netlink::in_table`]).
    table: u32,
}

impl Netlink {
    /// Open a NETLINK_ROUTE socket in the calling thread's network namespace and
    /// drive it on the current tokio runtime.
    pub fn new() -> std::io::Result<Self> {
        let (connection, handle, _) = rtnetlink::new_connection()?;
        tokio::spawn(connection);
        Ok(Self {
            handle,
            dumps: std::sync::Arc::new(tokio::sync::Mutex::new(())),
            table: u32::from(RouteHeader::RT_TABLE_MAIN),
        })
    }

    /// This connection, its route calls working on routing table `table` (a
    /// `kvpn run` session's own table) instead of main.
    pub fn in_table(&self, table: u32) -> Self {
        Self {
            table,
            ..self.clone()
        }
    }

    /// The routing table route calls work on.
    pub fn table(&self) -> u32 {
        self.table
    }

    fn rule_message(mark: u32, table: u32, priority: u32) -> RuleMessage {
        let mut msg = RuleMessage::default();
        msg.header.family = AddressFamily::Inet;
        msg.header.action = RuleAction::ToTable;
        if let Ok(t) = u8::try_from(table) {
            msg.header.table = t;
        }
        msg.attributes.push(RuleAttribute::Table(table));
        msg.attributes.push(RuleAttribute::FwMark(mark));
        msg.attributes.push(RuleAttribute::Priority(priority));
        msg
    }

    /// Add the IPv4 policy rule `fwmark <mark> lookup <table> priority <priority>`
    /// (a `kvpn run` session: the sockets of its cgroup carry the mark).
    pub async fn add_mark_rule(
        &self,
        mark: u32,
        table: u32,
        priority: u32,
    ) -> Result<(), NetlinkError> {
        let mut req = self.handle.rule().add();
        *req.message_mut() = Self::rule_message(mark, table, priority);
        req.execute().await.map_err(|e| {
            NetlinkError::new(
                format!("add rule fwmark {mark:#x} lookup {table} priority {priority}"),
                e,
            )
        })
    }

    /// Delete the rule [`Netlink::add_mark_rule`] added. A missing rule is not an error.
    pub async fn del_mark_rule(
        &self,
        mark: u32,
        table: u32,
        priority: u32,
    ) -> Result<(), NetlinkError> {
        match self
            .handle
            .rule()
            .del(Self::rule_message(mark, table, priority))
            .execute()
            .await
        {
            Ok(()) => Ok(()),
            Err(e) if matches!(errno_of(&e), Some(libc::ENOENT) | Some(libc::ESRCH)) => Ok(()),
            Err(e) => Err(NetlinkError::new(
                format!("delete rule fwmark {mark:#x} lookup {table}"),
                e,
            )),
        }
    }

    /// Delete every IPv4 rule at `priority` whose fwmark is in `marks` (what a
    /// killed daemon's run sessions left in this network namespace); how many.
    pub async fn del_mark_rules(
        &self,
        priority: u32,
        marks: std::ops::Range<u32>,
    ) -> Result<usize, NetlinkError> {
        let found: Vec<(u32, u32)> = {
            let _dump = self.dumps.lock().await;
            let mut rules = self.handle.rule().get(rtnetlink::IpVersion::V4).execute();
            let mut found = Vec::new();
            while let Some(rule) = rules
                .try_next()
                .await
                .map_err(|e| NetlinkError::new("dump rules", e))?
            {
                let mut mark = None;
                let mut table = None;
                let mut prio = None;
                for a in &rule.attributes {
                    match a {
                        RuleAttribute::FwMark(m) => mark = Some(*m),
                        RuleAttribute::Table(t) => table = Some(*t),
                        RuleAttribute::Priority(p) => prio = Some(*p),
                        _ => {}
                    }
                }
                if let (Some(m), Some(t), Some(p)) = (mark, table, prio)
                    && p == priority
                    && marks.contains(&m)
                {
                    found.push((m, t));
                }
            }
            found
        };
        for (mark, table) in &found {
            self.del_mark_rule(*mark, *table, priority).await?;
        }
        Ok(found.len())
    }

    /// Whether a rule with fwmark `mark` exists (IPv4), for leftover checks.
    pub async fn mark_rule_exists(&self, mark: u32) -> Result<bool, NetlinkError> {
        let _dump = self.dumps.lock().await;
        let mut rules = self.handle.rule().get(rtnetlink::IpVersion::V4).execute();
        while let Some(rule) = rules
            .try_next()
            .await
            .map_err(|e| NetlinkError::new("dump rules", e))?
        {
            if rule
                .attributes
                .iter()
                .any(|a| matches!(a, RuleAttribute::FwMark(m) if *m == mark))
            {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The index of the interface called `name`, if there is one.
    pub async fn link_index(&self, name: &str) -> Result<Option<u32>, NetlinkError> {
        let _dump = self.dumps.lock().await;
        let mut links = self
            .handle
            .link()
            .get()
            .match_name(name.to_owned())
            .execute();
        match links.try_next().await {
            Ok(Some(link)) => Ok(Some(link.header.index)),
            Ok(None) => Ok(None),
            Err(e) if errno_of(&e) == Some(libc::ENODEV) => Ok(None),
            Err(e) => Err(NetlinkError::new(format!("look up interface {name}"), e)),
        }
    }

    async fn link(&self, index: u32) -> Result<Option<LinkMessage>, NetlinkError> {
        let mut links = self.handle.link().get().match_index(index).execute();
        match links.try_next().await {
            Ok(link) => Ok(link),
            Err(e) if errno_of(&e) == Some(libc::ENODEV) => Ok(None),
            Err(e) => Err(NetlinkError::new(format!("look up interface #{index}"), e)),
        }
    }

    /// Whether an interface with this index exists.
    pub async fn link_exists(&self, index: u32) -> Result<bool, NetlinkError> {
        Ok(self.link(index).await?.is_some())
    }

    /// Bytes of L2 header in front of the IP header of a packet at interface
    /// `index`'s TC egress (`dev_hard_header` has run): 14 for Ethernet-like devices
    /// (ARPHRD_ETHER: veth, dummy, bridges, Wi-Fi), 0 for L3 devices (ARPHRD_NONE:
    /// TUN, WireGuard; PPP; raw IP). `None` for another link type or no such link.
    pub async fn l2_hdr_len(&self, index: u32) -> Result<Option<u32>, NetlinkError> {
        use rtnetlink::packet_route::link::LinkLayerType;
        Ok(self
            .link(index)
            .await?
            .and_then(|link| match link.header.link_layer_type {
                LinkLayerType::Ether => Some(14),
                LinkLayerType::None | LinkLayerType::Ppp | LinkLayerType::Rawip => Some(0),
                _ => None,
            }))
    }

    /// Add `ip` as a host address (/32 or /128) on interface `index`.
    pub async fn add_host_address(&self, index: u32, ip: IpAddr) -> Result<(), NetlinkError> {
        let len = if ip.is_ipv4() { 32 } else { 128 };
        self.handle
            .address()
            .add(index, ip, len)
            .execute()
            .await
            .map_err(|e| {
                NetlinkError::new(format!("add address {ip}/{len} to interface #{index}"), e)
            })
    }

    fn route_message(
        table: u32,
        index: u32,
        dst: IpNet,
        pref_src: &[IpAddr],
    ) -> Result<RouteMessage, NetlinkError> {
        fn invalid(dst: IpNet) -> impl Fn(&dyn std::fmt::Display) -> NetlinkError {
            move |e| NetlinkError {
                op: format!("build route {dst}"),
                cause: e.to_string(),
                errno: None,
            }
        }
        let mut builder = RouteMessageBuilder::<IpAddr>::new()
            .destination_prefix(dst.addr(), dst.prefix_len())
            .map_err(|e| invalid(dst)(&e))?
            .output_interface(index)
            .protocol(RouteProtocol::Other(RTPROT_KVPN))
            .scope(RouteScope::Link)
            .table_id(table);
        if let Some(&src) = pref_src
            .iter()
            .find(|s| s.is_ipv4() == dst.addr().is_ipv4())
        {
            builder = builder.pref_source(src).map_err(|e| invalid(dst)(&e))?;
        }
        Ok(builder.build())
    }

    /// Install `dst` in the main table through interface `index`, tagged with
    /// [`RTPROT_KVPN`], preferring the address of `dst`'s family among
    /// `pref_src` (the tunnel IPs) as source address; none of that family
    /// leaves the choice to the kernel.
    pub async fn add_route(
        &self,
        index: u32,
        dst: IpNet,
        pref_src: &[IpAddr],
    ) -> Result<(), NetlinkError> {
        let msg = Self::route_message(self.table, index, dst, pref_src)?;
        self.handle.route().add(msg).execute().await.map_err(|e| {
            let mut err = NetlinkError::new(format!("add route {dst} dev #{index}"), e);
            if err.errno == Some(libc::EEXIST) {
                err.cause = format!("{} — another route for {dst} already exists in the main table (see `ip route show {dst}`)", err.cause);
            }
            err
        })
    }

    /// Remove kvpn's route to `dst` through interface `index`.
    pub async fn del_route(&self, index: u32, dst: IpNet) -> Result<(), NetlinkError> {
        let msg = Self::route_message(self.table, index, dst, &[])?;
        self.handle
            .route()
            .del(msg)
            .execute()
            .await
            .map_err(|e| NetlinkError::new(format!("delete route {dst} dev #{index}"), e))
    }

    /// Routes in the main table tagged [`RTPROT_KVPN`], optionally only those
    /// through interface `index`. Both address families.
    pub async fn kvpn_routes(&self, index: Option<u32>) -> Result<Vec<KvpnRoute>, NetlinkError> {
        let _dump = self.dumps.lock().await;
        let mut out = Vec::new();
        for route in self.dump_routes().await? {
            if route.header.protocol != RouteProtocol::Other(RTPROT_KVPN)
                || table_of(&route) != self.table
            {
                continue;
            }
            let Some(found) = parse_route(&route) else {
                continue;
            };
            if index.is_none_or(|i| i == found.oif) {
                out.push(found);
            }
        }
        Ok(out)
    }

    /// Every route of the laptop in every table, both families, with its
    /// device name (for route-conflict checks, [`crate::conflicts`]).
    ///
    /// A dump that the kernel marks inconsistent (NLM_F_DUMP_INTR: links or
    /// routes changed while it ran, e.g. another session's TUN device coming
    /// up) arrives as EBUSY; it is taken again, a bounded number of times.
    pub async fn laptop_routes(&self) -> Result<Vec<LaptopRoute>, NetlinkError> {
        const ATTEMPTS: u32 = 20;
        let mut attempt = 1;
        loop {
            match self.laptop_routes_once().await {
                Err(e) if e.errno == Some(libc::EBUSY) && attempt < ATTEMPTS => {
                    attempt += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
                other => return other,
            }
        }
    }

    async fn laptop_routes_once(&self) -> Result<Vec<LaptopRoute>, NetlinkError> {
        let _dump = self.dumps.lock().await;
        let mut names = std::collections::HashMap::new();
        let mut links = self.handle.link().get().execute();
        loop {
            match links.try_next().await {
                Ok(Some(link)) => {
                    if let Some(name) = link.attributes.iter().find_map(|a| match a {
                        LinkAttribute::IfName(n) => Some(n.clone()),
                        _ => None,
                    }) {
                        names.insert(link.header.index, name);
                    }
                }
                Ok(None) => break,
                Err(e) => return Err(NetlinkError::new("list interfaces", e)),
            }
        }
        let mut out = Vec::new();
        for route in self.dump_routes().await? {
            let (dst, oif) = match parse_route(&route) {
                Some(found) => (found.dst, found.oif),
                None => match route_dst(&route) {
                    // Blackhole/unreachable routes have no output device.
                    Some(dst) => (dst, 0),
                    None => continue,
                },
            };
            out.push(LaptopRoute {
                dst: dst.trunc(),
                dev: names.get(&oif).cloned().unwrap_or_default(),
                oif,
                protocol: u8::from(route.header.protocol),
                table: table_of(&route),
                kind: u8::from(route.header.kind),
            });
        }
        Ok(out)
    }

    /// Every route in every table, IPv4 then IPv6 (none when IPv6 is disabled in
    /// this namespace: the kernel answers EAFNOSUPPORT). The caller holds `dumps`.
    async fn dump_routes(&self) -> Result<Vec<RouteMessage>, NetlinkError> {
        let mut out = Vec::new();
        for family in [AddressFamily::Inet, AddressFamily::Inet6] {
            let mut query = RouteMessage::default();
            query.header.address_family = family;
            let mut routes = self.handle.route().get(query).execute();
            loop {
                match routes.try_next().await {
                    Ok(Some(r)) => out.push(r),
                    Ok(None) => break,
                    Err(e)
                        if family == AddressFamily::Inet6
                            && errno_of(&e) == Some(libc::EAFNOSUPPORT) =>
                    {
                        break;
                    }
                    Err(e) => return Err(NetlinkError::new("list routes", e)),
                }
            }
        }
        Ok(out)
    }

    /// Set the IPv4 rp_filter of interface `index` through RTM_SETLINK with
    /// IFLA_AF_SPEC / AF_INET / IFLA_INET_CONF (what `/proc/sys/net/ipv4/conf/<dev>/rp_filter` shows).
    pub async fn set_rp_filter(&self, index: u32, value: i32) -> Result<(), NetlinkError> {
        let mut conf = InetDevConf::default();
        conf.rp_filter = value;
        let msg = LinkUnspec::new_with_index(index)
            .append_extra_attribute(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet(vec![
                AfSpecInet::DevConfRequest(conf),
            ])]))
            .build();
        self.handle.link().set(msg).execute().await.map_err(|e| {
            NetlinkError::new(format!("set rp_filter={value} on interface #{index}"), e)
        })
    }

    /// The IPv4 rp_filter of interface `index`, read back through RTM_GETLINK.
    pub async fn rp_filter(&self, index: u32) -> Result<Option<i32>, NetlinkError> {
        let Some(link) = self.link(index).await? else {
            return Ok(None);
        };
        for attr in &link.attributes {
            if let LinkAttribute::AfSpecUnspec(specs) = attr {
                for spec in specs {
                    if let AfSpecUnspec::Inet(inet) = spec {
                        for item in inet {
                            if let AfSpecInet::DevConf(conf) = item {
                                return Ok(Some(conf.rp_filter));
                            }
                        }
                    }
                }
            }
        }
        Ok(None)
    }

    /// Bring interface `index` up (RTM_SETLINK, IFF_UP) with a transmit queue
    /// of [`TUN_TX_QUEUE_LEN`] packets.
    pub async fn set_link_up(&self, index: u32) -> Result<(), NetlinkError> {
        self.handle
            .link()
            .set(
                LinkUnspec::new_with_index(index)
                    .up()
                    .txqueuelen(TUN_TX_QUEUE_LEN)
                    .build(),
            )
            .execute()
            .await
            .map_err(|e| NetlinkError::new(format!("bring interface #{index} up"), e))
    }

    /// Delete interface `index` (RTM_DELLINK). A missing interface is not an error.
    pub async fn delete_link(&self, index: u32) -> Result<(), NetlinkError> {
        match self.handle.link().del(index).execute().await {
            Ok(()) => Ok(()),
            Err(e) if errno_of(&e) == Some(libc::ENODEV) => Ok(()),
            Err(e) => Err(NetlinkError::new(format!("delete interface #{index}"), e)),
        }
    }
}

fn errno_of(err: &rtnetlink::Error) -> Option<i32> {
    match err {
        rtnetlink::Error::NetlinkError(ErrorMessage {
            code: Some(code), ..
        }) => Some(-code.get()),
        _ => None,
    }
}

fn table_of(route: &RouteMessage) -> u32 {
    route
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(route.header.table))
}

fn route_dst(route: &RouteMessage) -> Option<IpNet> {
    let dst = route.attributes.iter().find_map(|a| match a {
        RouteAttribute::Destination(RouteAddress::Inet(a)) => Some(IpAddr::V4(*a)),
        RouteAttribute::Destination(RouteAddress::Inet6(a)) => Some(IpAddr::V6(*a)),
        _ => None,
    });
    let dst = match (dst, route.header.address_family) {
        (Some(a), _) => a,
        (None, AddressFamily::Inet) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        (None, AddressFamily::Inet6) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        (None, _) => return None,
    };
    IpNet::new(dst, route.header.destination_prefix_length).ok()
}

fn parse_route(route: &RouteMessage) -> Option<KvpnRoute> {
    let mut dst = None;
    let mut oif = None;
    for attr in &route.attributes {
        match attr {
            RouteAttribute::Destination(RouteAddress::Inet(a)) => dst = Some(IpAddr::V4(*a)),
            RouteAttribute::Destination(RouteAddress::Inet6(a)) => dst = Some(IpAddr::V6(*a)),
            RouteAttribute::Oif(i) => oif = Some(*i),
            _ => {}
        }
    }
    let len = route.header.destination_prefix_length;
    let dst = match (dst, route.header.address_family) {
        (Some(a), _) => a,
        // A default route has no RTA_DST.
        (None, AddressFamily::Inet) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        (None, AddressFamily::Inet6) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        (None, _) => return None,
    };
    Some(KvpnRoute {
        dst: IpNet::new(dst, len).ok()?,
        oif: oif?,
    })
}
