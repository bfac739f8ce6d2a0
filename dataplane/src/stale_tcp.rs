//! The laptop's TCP sockets an earlier session left when its root daemon died
//! (SIGKILL, crash), destroyed when a new session connects, so that their
//! applications get an error at once instead of waiting for their own timeout.
//!
//! Why: a root daemon that dies takes its session with it — TUN device,
//! routes, the pump and its table of carried flows ([`crate::carried`]) — but
//! not the laptop's sockets. A socket that only receives (curl waiting for the
//! rest of a download) has nothing to send that could draw a RST, so it stays
//! established until the application gives up. The new session's engine on
//! the manager is a fresh one that knows none of its flows.
//!
//! Decision: reset, not resume. Resuming would need the dead root daemon's
//! per-worker resume tokens (hello option 5), which by design live only in
//! its memory (only the process that made them may take the flows back, see
//! [`crate::session`]), the manager still parking the engine (its resume
//! grace; with leases a new session of the tunnel IP drops it), the same
//! tunnel IP and worker count, and the packets the dead pump had read from the
//! TUN but not sent, which are lost. So a prompt, explicit reset is the sound
//! outcome; the new session's Connect runs this sweep (counted in
//! `stale_tcp_flows_reset`, logged).
//!
//! Which sockets: TCP, IPv4 and IPv6, in a state that waits for the peer
//! ([`WAITING_STATES`]), whose remote address is inside the session's routes
//! and whose local address is on none of the laptop's interfaces other than
//! TUN devices: on no interface at all, or on a TUN device. The second case
//! is the normal two-cluster laptop: every traffic manager gives its first
//! client the same tunnel IP (100.96.0.2), so after a root daemon died, the
//! reconnect of cluster 1 puts the dead cluster-2 session's tunnel IP back on
//! a TUN device (cluster 1's) before cluster 2 reconnects; likewise with two
//! root daemons (two runtime folders), one killed. The remote address is what
//! tells sessions apart: no live session routes the new session's routes
//! (Connect refuses a route that another kvpn session holds), so a socket
//! into them from a tunnel IP belongs to no live session, whatever TUN device
//! has that address now. A live session's sockets (remote inside its own
//! routes), every socket of the laptop's own interfaces and every socket to
//! an address outside the routes never qualify. The sweep runs before the
//! new TUN device gets its address.
//!
//! The same sweep runs when a session is disconnected (also by `kvpn quit`
//! and the root daemon's own shutdown), before its TUN device and routes go,
//! with the session's routes: a download in flight then fails at once with
//! ECONNABORTED instead of hanging with no route left (tester: 155 s until
//! killed), and its RST still leaves through the tunnel.
//!
//! A TUN device is told by its sysfs `tun_flags` attribute
//! (`/sys/class/net/DEV/tun_flags`, drivers/net/tun.c), which only TUN/TAP
//! devices have. A TUN device of another VPN whose sockets reach into a kvpn
//! session's routes would qualify too; such a VPN already loses those
//! addresses to kvpn's routes while the session is up.
//!
//! How: a `SOCK_DIAG_BY_FAMILY` dump (`NETLINK_SOCK_DIAG`, `inet_diag_req_v2`,
//! include/uapi/linux/inet_diag.h), then `SOCK_DESTROY` with each chosen
//! socket's exact id (cookie included), as `ss -K` does. The kernel
//! (`tcp_abort`, net/ipv4/tcp.c; `CONFIG_INET_DIAG_DESTROY`) sets the
//! socket's error to ECONNABORTED, wakes its reader and sends a RST; with no
//! kvpn route yet, that RST leaves by the laptop's own route to the cluster
//! address, if it has one (usually the default route), and is dropped
//! somewhere that knows no such flow. Needs CAP_NET_ADMIN, which the root
//! daemon has.
//!
//! I/O: one netlink socket per sweep ([`sweep`]); the message codec and the
//! choice of sockets are pure and tested below.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};

use ipnet::IpNet;

const NETLINK_SOCK_DIAG: i32 = 4;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_HDR_LEN: usize = 16;
/// `struct inet_diag_sockid`: ports, addresses, interface, cookie.
const SOCKID_LEN: usize = 48;
/// `struct inet_diag_req_v2`.
const REQ_LEN: usize = 8 + SOCKID_LEN;
/// `struct inet_diag_msg` up to and including the socket id (what is read).
const MSG_MIN_LEN: usize = 4 + SOCKID_LEN;

/// TCP states (include/net/tcp_states.h) whose socket waits for its peer:
/// ESTABLISHED, SYN_SENT, FIN_WAIT1, FIN_WAIT2, CLOSE_WAIT, LAST_ACK, CLOSING.
/// TIME_WAIT, CLOSE and LISTEN wait for nobody.
pub const WAITING_STATES: u32 =
    (1 << 1) | (1 << 2) | (1 << 4) | (1 << 5) | (1 << 8) | (1 << 9) | (1 << 11);

/// Errors of the sock_diag exchange.
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    #[error("sock_diag netlink socket: {0}")]
    Io(#[from] io::Error),
    #[error("sock_diag answered a malformed message: {0}")]
    Malformed(&'static str),
    #[error("sock_diag refused the dump: {0}")]
    Refused(io::Error),
}

/// One TCP socket of a dump.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiagSocket {
    /// `AF_INET` or `AF_INET6`.
    pub family: u8,
    /// TCP state (include/net/tcp_states.h).
    pub state: u8,
    pub local: SocketAddr,
    pub remote: SocketAddr,
    /// The kernel's id of the socket as dumped, sent back whole to destroy it.
    id: [u8; SOCKID_LEN],
}

/// A request of `kind` with `flags` and an `inet_diag_req_v2` body.
fn request(
    kind: u16,
    flags: u16,
    seq: u32,
    family: u8,
    states: u32,
    id: &[u8; SOCKID_LEN],
) -> Vec<u8> {
    let len = NLMSG_HDR_LEN + REQ_LEN;
    let mut m = Vec::with_capacity(len);
    m.extend_from_slice(&(len as u32).to_ne_bytes());
    m.extend_from_slice(&kind.to_ne_bytes());
    m.extend_from_slice(&flags.to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    m.extend_from_slice(&[family, libc::IPPROTO_TCP as u8, 0, 0]);
    m.extend_from_slice(&states.to_ne_bytes());
    m.extend_from_slice(id);
    m
}

/// The dump request of every TCP socket of `family` in [`WAITING_STATES`].
pub fn dump_request(family: u8, seq: u32) -> Vec<u8> {
    request(
        SOCK_DIAG_BY_FAMILY,
        NLM_F_REQUEST | NLM_F_DUMP,
        seq,
        family,
        WAITING_STATES,
        &[0; SOCKID_LEN],
    )
}

/// The request that destroys `socket` (acknowledged).
pub fn destroy_request(socket: &DiagSocket, seq: u32) -> Vec<u8> {
    request(
        SOCK_DESTROY,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        socket.family,
        u32::MAX,
        &socket.id,
    )
}

/// What one datagram of netlink messages said.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Answer {
    pub sockets: Vec<DiagSocket>,
    /// The dump ended (`NLMSG_DONE`).
    pub done: bool,
    /// An `NLMSG_ERROR`'s code: 0 is an acknowledgement, else minus an errno.
    pub error: Option<i32>,
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// Parse one datagram of netlink messages (never panics on any input).
pub fn parse(datagram: &[u8]) -> Result<Answer, SweepError> {
    let mut answer = Answer::default();
    let mut at = 0;
    while at + NLMSG_HDR_LEN <= datagram.len() {
        let len = u32_at(datagram, at).ok_or(SweepError::Malformed("header"))? as usize;
        let kind = u16_at(datagram, at + 4).ok_or(SweepError::Malformed("header"))?;
        if len < NLMSG_HDR_LEN || at + len > datagram.len() {
            return Err(SweepError::Malformed("message length"));
        }
        let body = &datagram[at + NLMSG_HDR_LEN..at + len];
        match kind {
            NLMSG_DONE => answer.done = true,
            NLMSG_ERROR => {
                let code = u32_at(body, 0).ok_or(SweepError::Malformed("error message"))?;
                answer.error = Some(code as i32);
            }
            SOCK_DIAG_BY_FAMILY => answer.sockets.push(parse_socket(body)?),
            _ => {}
        }
        // NLMSG_ALIGN: messages start on 4-byte boundaries.
        at += (len + 3) & !3;
    }
    Ok(answer)
}

/// An `inet_diag_msg`.
fn parse_socket(body: &[u8]) -> Result<DiagSocket, SweepError> {
    if body.len() < MSG_MIN_LEN {
        return Err(SweepError::Malformed("inet_diag_msg too short"));
    }
    let (family, state) = (body[0], body[1]);
    let mut id = [0u8; SOCKID_LEN];
    id.copy_from_slice(&body[4..4 + SOCKID_LEN]);
    let port = |at: usize| u16::from_be_bytes([id[at], id[at + 1]]);
    let addr = |at: usize| -> Result<IpAddr, SweepError> {
        match i32::from(family) {
            libc::AF_INET => Ok(IpAddr::V4(Ipv4Addr::new(
                id[at],
                id[at + 1],
                id[at + 2],
                id[at + 3],
            ))),
            libc::AF_INET6 => {
                let mut a = [0u8; 16];
                a.copy_from_slice(&id[at..at + 16]);
                Ok(IpAddr::V6(Ipv6Addr::from(a)).to_canonical())
            }
            _ => Err(SweepError::Malformed("address family")),
        }
    };
    Ok(DiagSocket {
        family,
        state,
        local: SocketAddr::new(addr(4)?, port(0)),
        remote: SocketAddr::new(addr(20)?, port(2)),
        id,
    })
}

/// Whether `socket` is one an earlier (or the ending) session left: its
/// remote address in `routes` and its local address none of `addresses` (the
/// addresses of the laptop's interfaces that are not TUN devices).
pub fn is_stale(socket: &DiagSocket, routes: &[IpNet], addresses: &[IpAddr]) -> bool {
    let local = socket.local.ip();
    routes.iter().any(|r| r.contains(&socket.remote.ip()))
        && !local.is_unspecified()
        && !addresses.contains(&local)
}

/// A netlink socket of the sock_diag family.
fn diag_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments; the descriptor is owned below.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn send(fd: &OwnedFd, message: &[u8]) -> io::Result<()> {
    // SAFETY: the buffer is valid for its length; netlink's kernel end is the
    // default destination of an unbound netlink socket.
    let n = unsafe { libc::send(fd.as_raw_fd(), message.as_ptr().cast(), message.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn recv<'b>(fd: &OwnedFd, buf: &'b mut [u8]) -> io::Result<&'b [u8]> {
    // SAFETY: the buffer is valid and writable for its length.
    let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(&buf[..n as usize])
}

/// Whether the interface `name` is a TUN/TAP device (it has `tun_flags`).
fn is_tun_device(name: &str) -> bool {
    std::path::Path::new("/sys/class/net")
        .join(name)
        .join("tun_flags")
        .exists()
}

/// The addresses on the laptop's interfaces (this network namespace) whose
/// interface name `keep` accepts.
fn addresses_where(mut keep: impl FnMut(&str) -> bool) -> io::Result<Vec<IpAddr>> {
    let addrs = nix::ifaddrs::getifaddrs().map_err(io::Error::from)?;
    Ok(addrs
        .filter(|a| keep(&a.interface_name))
        .filter_map(|a| a.address)
        .filter_map(|a| {
            a.as_sockaddr_in()
                .map(|s| IpAddr::V4(s.ip()))
                .or_else(|| a.as_sockaddr_in6().map(|s| IpAddr::V6(s.ip())))
        })
        .collect())
}

/// Every address on the laptop's interfaces.
fn all_addresses() -> io::Result<Vec<IpAddr>> {
    addresses_where(|_| true)
}

/// The addresses on the laptop's interfaces other than TUN devices.
fn non_tun_addresses() -> io::Result<Vec<IpAddr>> {
    let mut tun: std::collections::HashMap<String, bool> = std::collections::HashMap::new();
    addresses_where(|name| {
        !*tun
            .entry(name.to_owned())
            .or_insert_with(|| is_tun_device(name))
    })
}

/// Destroy the TCP sockets of this network namespace that an earlier (or
/// the ending) session left toward `routes` (see the module docs); returns the
/// (local, remote) addresses of those destroyed. A socket that closed between
/// the dump and its destruction (ENOENT) is not counted.
pub fn sweep(routes: &[IpNet]) -> Result<Vec<(SocketAddr, SocketAddr)>, SweepError> {
    let addresses = non_tun_addresses()?;
    destroy_where(|s| is_stale(s, routes, &addresses))
}

/// Whether `socket`'s local address is one of `dead` (tunnel IPs of a dead
/// root daemon's sessions) and on none of `addresses` (every address of every
/// interface now): a session of another root daemon that holds the same
/// tunnel IP on its TUN device keeps its sockets.
pub fn is_dead_local(socket: &DiagSocket, dead: &[IpAddr], addresses: &[IpAddr]) -> bool {
    let local = socket.local.ip();
    dead.contains(&local) && !addresses.contains(&local)
}

/// Destroy the TCP sockets whose local address is one of `dead` and on no
/// interface any more ([`is_dead_local`]); the (local, remote) addresses of
/// those destroyed.
pub fn sweep_dead_locals(dead: &[IpAddr]) -> Result<Vec<(SocketAddr, SocketAddr)>, SweepError> {
    let addresses = all_addresses()?;
    destroy_where(|s| is_dead_local(s, dead, &addresses))
}

/// Dump this netns's TCP sockets and destroy those `stale_if` picks.
fn destroy_where(
    stale_if: impl Fn(&DiagSocket) -> bool,
) -> Result<Vec<(SocketAddr, SocketAddr)>, SweepError> {
    let fd = diag_socket()?;
    // 32 KiB: the kernel fills a dump datagram up to about a page or two.
    let mut buf = vec![0u8; 32 * 1024];
    let mut stale = Vec::new();
    for (seq, family) in [(1, libc::AF_INET), (2, libc::AF_INET6)] {
        send(&fd, &dump_request(family as u8, seq))?;
        loop {
            let answer = parse(recv(&fd, &mut buf)?)?;
            if let Some(code) = answer.error.filter(|c| *c != 0) {
                return Err(SweepError::Refused(io::Error::from_raw_os_error(-code)));
            }
            stale.extend(answer.sockets.into_iter().filter(|s| stale_if(s)));
            if answer.done {
                break;
            }
        }
    }
    let mut destroyed = Vec::new();
    for (i, socket) in stale.iter().enumerate() {
        send(&fd, &destroy_request(socket, 3 + i as u32))?;
        match parse(recv(&fd, &mut buf)?)?.error {
            Some(0) => destroyed.push((socket.local, socket.remote)),
            Some(code) if -code == libc::ENOENT => {}
            Some(code) => return Err(SweepError::Refused(io::Error::from_raw_os_error(-code))),
            None => return Err(SweepError::Malformed("no answer to SOCK_DESTROY")),
        }
    }
    Ok(destroyed)
}

/// Why a [`reset`] runs; names the sockets in its log lines.
#[derive(Debug, Clone, Copy)]
pub enum Why<'a> {
    /// A new session's Connect: sockets a dead root daemon's session left.
    EarlierSession,
    /// Disconnect, quit or shutdown of the session with this id.
    Disconnecting(&'a str),
    /// The sweep of a new root daemon (or `--repair`): sockets on the tunnel
    /// IPs of a killed root daemon's sessions.
    DeadDaemon,
}

impl Why<'_> {
    /// Whose sockets, and what happens if they cannot be looked for.
    fn texts(self) -> (&'static str, &'static str) {
        match self {
            Why::EarlierSession => (
                "laptop TCP sockets an earlier session left (its root daemon died)",
                "a download of a dead root daemon's session may hang until its application's timeout",
            ),
            Why::Disconnecting(_) => (
                "the laptop TCP sockets through the session being disconnected",
                "a download in flight may hang until its application's timeout",
            ),
            Why::DeadDaemon => (
                "laptop TCP sockets on the tunnel IPs of a killed root daemon's sessions",
                "a download through it may hang until the next `kvpn connect` or its application's timeout",
            ),
        }
    }
}

/// [`sweep`], log what it destroyed (or why it could not look) and return how
/// many sockets it destroyed; an error is logged and counts as none.
pub fn reset(routes: &[IpNet], why: Why<'_>) -> u64 {
    report(sweep(routes), why)
}

/// [`sweep_dead_locals`], logged and counted like [`reset`].
pub fn reset_dead_locals(dead: &[IpAddr]) -> u64 {
    report(sweep_dead_locals(dead), Why::DeadDaemon)
}

fn report(swept: Result<Vec<(SocketAddr, SocketAddr)>, SweepError>, why: Why<'_>) -> u64 {
    let (whose, risk) = why.texts();
    let id = match why {
        Why::Disconnecting(id) => id,
        _ => "",
    };
    let destroyed = match swept {
        Ok(destroyed) => destroyed,
        Err(e) => {
            tracing::warn!(%id, error = %e, "cannot look for {whose}: {risk}");
            return 0;
        }
    };
    if destroyed.is_empty() {
        return 0;
    }
    let flows: Vec<String> = destroyed
        .iter()
        .map(|(local, remote)| format!("{local} -> {remote}"))
        .collect();
    let flows_text = flows.join(", ");
    // Asked for on a disconnect; a dead daemon's leftovers are worth a warning.
    if matches!(why, Why::Disconnecting(_)) {
        tracing::info!(%id, count = flows.len(), flows = %flows_text, "destroyed {whose}: their applications get ECONNABORTED now");
    } else {
        tracing::warn!(count = flows.len(), flows = %flows_text, "destroyed {whose}: their applications get ECONNABORTED now");
    }
    flows.len() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An `inet_diag_msg` answer as the kernel writes it (IPv4).
    fn v4_message(state: u8, local: SocketAddr, remote: SocketAddr) -> Vec<u8> {
        let (IpAddr::V4(l), IpAddr::V4(r)) = (local.ip(), remote.ip()) else {
            panic!("IPv4 only");
        };
        let mut body = vec![libc::AF_INET as u8, state, 0, 0];
        body.extend_from_slice(&local.port().to_be_bytes());
        body.extend_from_slice(&remote.port().to_be_bytes());
        body.extend_from_slice(&l.octets());
        body.extend_from_slice(&[0; 12]);
        body.extend_from_slice(&r.octets());
        body.extend_from_slice(&[0; 12]);
        body.extend_from_slice(&7u32.to_ne_bytes()); // interface
        body.extend_from_slice(&[0xab; 8]); // cookie
        body.extend_from_slice(&[0; 20]); // expires .. inode
        let mut m = Vec::new();
        m.extend_from_slice(&((NLMSG_HDR_LEN + body.len()) as u32).to_ne_bytes());
        m.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        m.extend_from_slice(&body);
        m
    }

    fn done() -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&20u32.to_ne_bytes());
        m.extend_from_slice(&NLMSG_DONE.to_ne_bytes());
        m.extend_from_slice(&[0; 14]);
        m
    }

    fn sa(s: &str) -> SocketAddr {
        s.parse().expect("socket address")
    }

    #[test]
    fn a_dump_is_parsed_and_its_ids_go_back_whole_in_the_destroy() {
        let mut datagram = v4_message(1, sa("100.96.0.2:51008"), sa("10.244.1.11:80"));
        datagram.extend(done());
        let answer = parse(&datagram).expect("parses");
        assert!(answer.done);
        assert_eq!(answer.sockets.len(), 1);
        let s = &answer.sockets[0];
        assert_eq!(
            (s.local, s.remote, s.state),
            (sa("100.96.0.2:51008"), sa("10.244.1.11:80"), 1)
        );
        let destroy = destroy_request(s, 9);
        assert_eq!(destroy.len(), NLMSG_HDR_LEN + REQ_LEN);
        assert_eq!(u16_at(&destroy, 4), Some(SOCK_DESTROY));
        assert_eq!(
            &destroy[NLMSG_HDR_LEN + 8..],
            &datagram[NLMSG_HDR_LEN + 4..NLMSG_HDR_LEN + 52]
        );
    }

    #[test]
    fn truncated_or_garbled_answers_are_errors_not_panics() {
        let full = v4_message(1, sa("100.96.0.2:1"), sa("10.244.1.11:80"));
        for cut in 0..full.len() {
            let _ = parse(&full[..cut]);
        }
        let mut bad_len = full.clone();
        bad_len[..4].copy_from_slice(&1000u32.to_ne_bytes());
        assert!(parse(&bad_len).is_err());
        let mut bad_family = full;
        bad_family[NLMSG_HDR_LEN] = 99;
        assert!(parse(&bad_family).is_err());
        let mut error = Vec::new();
        error.extend_from_slice(&20u32.to_ne_bytes());
        error.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
        error.extend_from_slice(&[0; 10]);
        error.extend_from_slice(&(-libc::ENOENT).to_ne_bytes());
        assert_eq!(parse(&error).expect("parses").error, Some(-libc::ENOENT));
    }

    /// An established IPv4 socket as a dump reports it.
    fn socket(local: &str, remote: &str) -> DiagSocket {
        DiagSocket {
            family: libc::AF_INET as u8,
            state: 1,
            local: sa(local),
            remote: sa(remote),
            id: [0; SOCKID_LEN],
        }
    }

    /// Only sockets into the routes whose local address is on no interface
    /// but a TUN device (`laptop` holds the other interfaces' addresses).
    #[test]
    fn stale_means_into_the_routes_from_an_address_no_interface_but_a_tun_has() {
        let routes: Vec<IpNet> = vec!["10.244.0.0/16".parse().expect("net")];
        let laptop: Vec<IpAddr> = vec!["192.168.1.5".parse().expect("ip")];
        // The dead session's tunnel IP, into the cluster.
        assert!(is_stale(
            &socket("100.96.0.2:5000", "10.244.1.11:80"),
            &routes,
            &laptop
        ));
        // The same tunnel IP on another cluster's live session (every
        // manager's first client gets 100.96.0.2): its own flows go into its
        // own routes, never the new session's.
        assert!(!is_stale(
            &socket("100.96.0.2:5001", "10.245.1.11:80"),
            &routes,
            &laptop
        ));
        // The laptop's own address, or outside the routes.
        assert!(!is_stale(
            &socket("192.168.1.5:5000", "10.244.1.11:80"),
            &routes,
            &laptop
        ));
        assert!(!is_stale(
            &socket("100.96.0.2:5000", "8.8.8.8:53"),
            &routes,
            &laptop
        ));
        // A dual-stack socket's IPv4-mapped addresses count as IPv4.
        let mut mapped = vec![libc::AF_INET6 as u8, 1, 0, 0];
        mapped.extend_from_slice(&5000u16.to_be_bytes());
        mapped.extend_from_slice(&80u16.to_be_bytes());
        mapped.extend_from_slice(
            &"::ffff:100.96.0.2"
                .parse::<Ipv6Addr>()
                .expect("v6")
                .octets(),
        );
        mapped.extend_from_slice(
            &"::ffff:10.244.1.11"
                .parse::<Ipv6Addr>()
                .expect("v6")
                .octets(),
        );
        mapped.extend_from_slice(&[0; 32]);
        let s = parse_socket(&mapped).expect("parses");
        assert!(is_stale(&s, &routes, &laptop), "{s:?}");
    }

    /// After a root daemon was killed: sockets on its sessions' tunnel IPs, to
    /// anywhere, while no interface holds the address; not while another root
    /// daemon's session holds the same tunnel IP on its TUN device.
    #[test]
    fn dead_local_means_a_dead_tunnel_ip_no_interface_holds() {
        let dead: Vec<IpAddr> = vec!["100.96.0.2".parse().expect("ip")];
        let laptop: Vec<IpAddr> = vec!["192.168.1.5".parse().expect("ip")];
        let mut with_other_session = laptop.clone();
        with_other_session.push("100.96.0.2".parse().expect("ip"));
        let s = socket("100.96.0.2:5000", "10.244.1.11:80");
        assert!(is_dead_local(&s, &dead, &laptop));
        assert!(is_dead_local(
            &socket("100.96.0.2:5001", "172.20.0.9:443"),
            &dead,
            &laptop
        ));
        assert!(!is_dead_local(&s, &dead, &with_other_session));
        assert!(!is_dead_local(
            &socket("192.168.1.5:5000", "10.244.1.11:80"),
            &dead,
            &laptop
        ));
        assert!(!is_dead_local(&s, &[], &laptop));
    }

    #[test]
    fn only_tun_devices_have_tun_flags() {
        assert!(!is_tun_device("lo"));
        assert!(!is_tun_device("kvpn-no-such-device"));
    }
}
