//! Which process holds a local UDP or TCP port, for errors such as "cannot
//! listen for DNS on 127.0.0.153:53: Address already in use" (issue 29 item 4:
//! the message blamed "another DNS server" when the holder was kvpn's own
//! previous forwarder). The answer comes the way `ss -p` finds it: the socket's
//! inode from `/proc/net/{udp,udp6,tcp,tcp6}` (this process's network
//! namespace), then the process with a `/proc/<pid>/fd/*` link to
//! `socket:[<inode>]` (socket inodes are unique on the whole machine).
//!
//! Pure: [`parse_proc_net`], [`blocks_bind`], [`socket_inode`]. I/O: [`holders`]
//! and [`describe`] read `/proc` (root sees every process; otherwise only its
//! own user's).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The transport of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    /// UDP.
    Udp,
    /// TCP.
    Tcp,
}

impl Proto {
    fn files(self) -> [&'static str; 2] {
        match self {
            Proto::Udp => ["/proc/net/udp", "/proc/net/udp6"],
            Proto::Tcp => ["/proc/net/tcp", "/proc/net/tcp6"],
        }
    }
}

/// One line of `/proc/net/{udp,tcp}{,6}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcSocket {
    /// The bound local address.
    pub local: SocketAddr,
    /// The `st` column (TCP: 0x0A is LISTEN; UDP: 0x07 is unconnected, 0x01
    /// connected).
    pub state: u8,
    /// The socket's inode.
    pub inode: u64,
}

/// TCP_LISTEN in `include/net/tcp_states.h`.
const TCP_LISTEN: u8 = 0x0A;

/// An address as the kernel prints it in `/proc/net/*` (`net/ipv4/udp.c`
/// `udp4_format_sock`, `net/ipv6/datagram.c` `__ip6_dgram_sock_seq_show`):
/// `%08X:%04X` of the IPv4 address as a host-order u32, or four such words for
/// IPv6, then the port.
fn parse_addr(text: &str) -> Option<SocketAddr> {
    let (ip, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |i: usize| -> Option<[u8; 4]> {
        let hex = ip.get(i * 8..i * 8 + 8)?;
        Some(u32::from_str_radix(hex, 16).ok()?.to_ne_bytes())
    };
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(0)?)),
        32 => {
            let mut octets = [0u8; 16];
            for i in 0..4 {
                octets[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
            }
            IpAddr::V6(Ipv6Addr::from(octets))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// The sockets listed in the text of one `/proc/net/{udp,tcp}{,6}` file; lines
/// that do not parse (the header) are skipped.
pub fn parse_proc_net(text: &str) -> Vec<ProcSocket> {
    text.lines()
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode …
            let local = parse_addr(cols.get(1)?)?;
            let state = u8::from_str_radix(cols.get(3)?, 16).ok()?;
            let inode = cols.get(9)?.parse().ok()?;
            Some(ProcSocket {
                local,
                state,
                inode,
            })
        })
        .collect()
}

/// Whether `socket` keeps a new socket of `proto` from binding `addr`: the
/// same port on the same address or on the wildcard address (an IPv6 wildcard
/// also covers IPv4 unless the socket is v6-only, which `/proc` does not tell:
/// counted), and for TCP only a listening socket (established and TIME_WAIT
/// sockets do not block a listener with SO_REUSEADDR, which tokio sets).
pub fn blocks_bind(socket: &ProcSocket, addr: SocketAddr, proto: Proto) -> bool {
    if socket.local.port() != addr.port() || socket.inode == 0 {
        return false;
    }
    if proto == Proto::Tcp && socket.state != TCP_LISTEN {
        return false;
    }
    let ip = socket.local.ip();
    ip == addr.ip()
        || ip.is_unspecified() && (ip.is_ipv6() || addr.is_ipv4())
        || addr.ip().is_unspecified()
}

/// The inode of a `/proc/<pid>/fd/<n>` link target `socket:[12345]`.
pub fn socket_inode(link: &str) -> Option<u64> {
    link.strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// A process holding a socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// Its pid.
    pub pid: u32,
    /// Its command line (arguments joined by spaces), or its `comm` when the
    /// command line is empty (kernel threads).
    pub command: String,
}

/// The processes whose sockets keep `addr` from being bound for `proto`, each
/// once, in pid order. Empty when none is found (the socket is closing, or
/// belongs to a process this one may not inspect).
pub fn holders(addr: SocketAddr, proto: Proto) -> Vec<Holder> {
    let inodes: std::collections::HashSet<u64> = proto
        .files()
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .flat_map(|text| parse_proc_net(&text))
        .filter(|s| blocks_bind(s, addr, proto))
        .map(|s| s.inode)
        .collect();
    if inodes.is_empty() {
        return Vec::new();
    }
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in procs.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        let holds = fds.flatten().any(|fd| {
            std::fs::read_link(fd.path())
                .ok()
                .and_then(|l| l.to_str().and_then(socket_inode))
                .is_some_and(|inode| inodes.contains(&inode))
        });
        if holds {
            found.push(Holder {
                pid,
                command: command_of(pid),
            });
        }
    }
    found.sort_by_key(|h| h.pid);
    found
}

fn command_of(pid: u32) -> String {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    if !args.is_empty() {
        return args.join(" ");
    }
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|c| format!("[{}]", c.trim()))
        .unwrap_or_else(|_| "?".to_owned())
}

/// Who holds `addr` for `proto`, as the end of an "Address already in use"
/// message: "held by pid 812 (dnsmasq --listen-address=…) — {fix}", "held by
/// this kvpn root daemon itself (pid 4711): …", or "no process holding it was
/// found … — {fix}". `fix` says what to do about another process.
pub fn describe(addr: SocketAddr, proto: Proto, fix: &str) -> String {
    describe_holders(&holders(addr, proto), std::process::id(), fix)
}

/// [`describe`] for known holders and this process's pid (pure).
pub fn describe_holders(holders: &[Holder], own_pid: u32, fix: &str) -> String {
    if holders.is_empty() {
        return format!(
            "no process holding it was found (a socket still closing, or one of a process \
             this daemon may not inspect; `ss -lunp` and `ss -ltnp` list them) — {fix}"
        );
    }
    if holders.iter().all(|h| h.pid == own_pid) {
        return format!(
            "held by this kvpn root daemon itself (pid {own_pid}): a socket of an earlier \
             session has not been closed — a bug; try again, and report it with the \
             daemon's log if it persists"
        );
    }
    let parts: Vec<String> = holders
        .iter()
        .map(|h| {
            let command: String = if h.command.chars().count() > 120 {
                h.command.chars().take(117).chain("...".chars()).collect()
            } else {
                h.command.clone()
            };
            if h.pid == own_pid {
                format!("pid {} (this kvpn root daemon)", h.pid)
            } else {
                format!("pid {} ({command})", h.pid)
            }
        })
        .collect();
    format!("held by {} — {fix}", parts.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines as Linux 6.x prints them (x86-64, little-endian host order).
    const UDP: &str = "   sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops
  187: 9900007F:0035 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 123456 2 0000000000000000 0
  300: 0100007F:0035 00000000:0000 07 00000000:00000000 00:00000000 00000000   100        0 222 2 0000000000000000 0
  301: 00000000:1F90 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 333 2 0000000000000000 0
";
    const UDP6: &str = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops
   12: 000080FE00000000FF3F5002020000FE:0035 00000000000000000000000000000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 444 2 0000000000000000 0
   13: 00000000000000000000000000000000:0035 00000000000000000000000000000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 555 2 0000000000000000 0
";
    const TCP: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 9900007F:0035 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 777 1 0000000000000000 100 0 0 10 0
   1: 9900007F:0035 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 888 1 0000000000000000 20 4 30 10 -1
";

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("addr")
    }

    #[test]
    fn proc_net_lines_parse_to_addresses_states_and_inodes() {
        let udp = parse_proc_net(UDP);
        assert_eq!(
            udp,
            vec![
                ProcSocket {
                    local: addr("127.0.0.153:53"),
                    state: 7,
                    inode: 123456
                },
                ProcSocket {
                    local: addr("127.0.0.1:53"),
                    state: 7,
                    inode: 222
                },
                ProcSocket {
                    local: addr("0.0.0.0:8080"),
                    state: 7,
                    inode: 333
                },
            ]
        );
        let udp6 = parse_proc_net(UDP6);
        assert_eq!(udp6[0].local, addr("[fe80::250:3fff:fe00:2]:53"));
        assert_eq!(udp6[1].local, addr("[::]:53"));
        assert_eq!(parse_proc_net("garbage\n1: zz:0035 x 07"), vec![]);
    }

    #[test]
    fn only_sockets_on_the_same_port_and_address_or_a_wildcard_block_a_bind() {
        let fwd = addr("127.0.0.153:53");
        let blocking: Vec<u64> = parse_proc_net(UDP)
            .iter()
            .chain(&parse_proc_net(UDP6))
            .filter(|s| blocks_bind(s, fwd, Proto::Udp))
            .map(|s| s.inode)
            .collect();
        // 127.0.0.1:53 does not (another address), [::]:53 does (dual-stack).
        assert_eq!(blocking, vec![123456, 555]);
        // TCP: the listener, not the established connection on the same port.
        let tcp: Vec<u64> = parse_proc_net(TCP)
            .iter()
            .filter(|s| blocks_bind(s, fwd, Proto::Tcp))
            .map(|s| s.inode)
            .collect();
        assert_eq!(tcp, vec![777]);
        // Binding the wildcard meets every socket on the port.
        let any: Vec<u64> = parse_proc_net(UDP)
            .iter()
            .filter(|s| blocks_bind(s, addr("0.0.0.0:53"), Proto::Udp))
            .map(|s| s.inode)
            .collect();
        assert_eq!(any, vec![123456, 222]);
    }

    #[test]
    fn fd_links_and_descriptions() {
        assert_eq!(socket_inode("socket:[123456]"), Some(123456));
        assert_eq!(socket_inode("pipe:[123456]"), None);
        assert_eq!(socket_inode("/dev/null"), None);
        let dnsmasq = Holder {
            pid: 812,
            command: "dnsmasq --listen-address=127.0.0.153".to_owned(),
        };
        assert_eq!(
            describe_holders(std::slice::from_ref(&dnsmasq), 1, "stop it"),
            "held by pid 812 (dnsmasq --listen-address=127.0.0.153) — stop it"
        );
        let own = describe_holders(
            &[Holder {
                pid: 4711,
                command: "kvpn-dataplane".to_owned(),
            }],
            4711,
            "stop it",
        );
        assert!(
            own.starts_with("held by this kvpn root daemon itself (pid 4711)"),
            "{own}"
        );
        assert!(!own.contains("stop it"), "{own}");
        let none = describe_holders(&[], 1, "stop it");
        assert!(
            none.starts_with("no process holding it was found"),
            "{none}"
        );
        assert!(none.ends_with("— stop it"), "{none}");
    }

    /// The I/O shell finds this very process holding a UDP and a TCP port.
    #[test]
    fn holders_finds_this_process() {
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").expect("udp");
        let at = udp.local_addr().expect("addr");
        let found = holders(at, Proto::Udp);
        assert!(
            found.iter().any(|h| h.pid == std::process::id()),
            "{at}: {found:?}"
        );
        let text = describe(at, Proto::Udp, "stop it");
        assert!(text.contains("this kvpn root daemon itself"), "{text}");
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").expect("tcp");
        let at = tcp.local_addr().expect("addr");
        assert!(
            holders(at, Proto::Tcp)
                .iter()
                .any(|h| h.pid == std::process::id())
        );
        drop(tcp);
        assert!(
            holders(at, Proto::Tcp).is_empty(),
            "closed: nobody holds it"
        );
    }
}
