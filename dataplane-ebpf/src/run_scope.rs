//! The run scope (`kvpn run -- CMD`): four cgroup programs attached to one run's
//! cgroup v2 folder, so that only the processes in it (and their children, which
//! stay in it) see the cluster.
//!
//! - [`kvpn_run_mark`] (`cgroup/sock_create`): every socket gets the session's
//!   fwmark; the root daemon's policy rule (`fwmark M lookup T`) routes it through
//!   the session's own table, whose routes lead into the session's TUN device.
//!   A destination that table has no route for falls through to the laptop's
//!   usual tables, so the rest of the network works as before.
//! - [`kvpn_run_connect4`] / [`kvpn_run_sendmsg4`]: IPv4 TCP connects and UDP
//!   datagrams to port 53 go to the session's DNS forwarder instead (the nameserver
//!   asked is kept in [`KVPN_RUN_DNS`] by socket cookie).
//! - [`kvpn_run_recvmsg4`]: answers from the forwarder show the asked nameserver
//!   as source, since resolvers drop answers from an address they did not ask.
//!
//! Each session loads its own copy of the object, so the config and table are the
//! session's alone. Return 1 = let the call proceed (these programs never refuse).

use aya_ebpf::{
    helpers::bpf_get_socket_cookie,
    macros::{cgroup_sock, cgroup_sock_addr, map},
    maps::{Array, LruHashMap},
    programs::{SockAddrContext, SockContext},
};
use kvpn_dataplane_common::{DNS_PORT, RUN_DNS_MAX_SOCKETS, RunConfig, RunDnsOrigin};

const ALLOW: i32 = 1;
const IPPROTO_TCP: u32 = 6;
const IPPROTO_UDP: u32 = 17;

#[map]
pub static KVPN_RUN_CFG: Array<RunConfig> = Array::with_max_entries(1, 0);

#[map]
pub static KVPN_RUN_DNS: LruHashMap<u64, RunDnsOrigin> =
    LruHashMap::with_max_entries(RUN_DNS_MAX_SOCKETS, 0);

#[inline(always)]
fn config() -> Option<RunConfig> {
    KVPN_RUN_CFG.get(0).copied()
}

#[cgroup_sock(sock_create)]
pub fn kvpn_run_mark(ctx: SockContext) -> i32 {
    if let Some(cfg) = config() {
        // SAFETY: the kernel hands sock_create a valid `struct bpf_sock`, whose
        // `mark` this attach type may write (bpf_sock_is_valid_access).
        unsafe { (*ctx.sock).mark = cfg.mark };
    }
    ALLOW
}

/// Sends a port-53 destination of `ctx` to the forwarder, remembering the original.
#[inline(always)]
fn redirect_dns(ctx: &SockAddrContext) -> i32 {
    let Some(cfg) = config() else {
        return ALLOW;
    };
    let sa = ctx.sock_addr;
    // SAFETY: the kernel hands sock_addr programs a valid `struct bpf_sock_addr`;
    // user_ip4/user_port/protocol are readable and the first two writable for
    // connect4 and sendmsg4 (sock_addr_is_valid_access), in 4-byte accesses.
    unsafe {
        let protocol = (*sa).protocol;
        if protocol != IPPROTO_TCP && protocol != IPPROTO_UDP {
            return ALLOW;
        }
        let port = (*sa).user_port;
        if port != u32::from(DNS_PORT.to_be()) {
            return ALLOW;
        }
        let ip = (*sa).user_ip4;
        let dns_ip = u32::from_ne_bytes(cfg.dns_ip);
        if ip == dns_ip {
            return ALLOW;
        }
        let cookie = bpf_get_socket_cookie(sa.cast());
        let origin = RunDnsOrigin {
            ip: ip.to_ne_bytes(),
            port: DNS_PORT.to_be(),
            reserved: 0,
        };
        // A full table only costs this socket its source rewrite on answers.
        let _ = KVPN_RUN_DNS.insert(&cookie, &origin, 0);
        (*sa).user_ip4 = dns_ip;
        (*sa).user_port = u32::from(cfg.dns_port);
    }
    ALLOW
}

#[cgroup_sock_addr(connect4)]
pub fn kvpn_run_connect4(ctx: SockAddrContext) -> i32 {
    redirect_dns(&ctx)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn kvpn_run_sendmsg4(ctx: SockAddrContext) -> i32 {
    redirect_dns(&ctx)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn kvpn_run_recvmsg4(ctx: SockAddrContext) -> i32 {
    let Some(cfg) = config() else {
        return ALLOW;
    };
    let sa = ctx.sock_addr;
    // SAFETY: as in redirect_dns; recvmsg4 may read and write user_ip4/user_port
    // (the source address the process will see).
    unsafe {
        if (*sa).user_ip4 != u32::from_ne_bytes(cfg.dns_ip)
            || (*sa).user_port != u32::from(cfg.dns_port)
        {
            return ALLOW;
        }
        let cookie = bpf_get_socket_cookie(sa.cast());
        if let Some(origin) = KVPN_RUN_DNS.get(&cookie) {
            (*sa).user_ip4 = u32::from_ne_bytes(origin.ip);
            (*sa).user_port = u32::from(origin.port);
        }
    }
    ALLOW
}
