//! The peer agent of `kvpn ssh`'s full mode (`kvpn ssh-peer`, hidden): one TUN
//! device with a point-to-point address pair from the SSH tunnel range
//! ([`TUNNEL_RANGE`], 198.19.0.0/16), whose packets travel as kvpn-proto frames on
//! the agent's stdin (inbound packets, written to the TUN) and stdout (packets the
//! TUN gave, framed).
//!
//! The same agent runs on both ends: on the SSH host, started by `kvpn ssh` through
//! an `exec` channel (its stdin/stdout are that channel), and on the laptop as a
//! root child process of `kvpn ssh` (its stdin/stdout are pipes). `kvpn ssh` itself
//! only splices the two byte streams, so the root-only work (the TUN device, its
//! address and peer route) stays in a small root process on each side and the
//! laptop's root daemon is not involved.
//!
//! Wire: the agent writes one Hello frame (its tunnel IP) once its TUN is up, then
//! Packet frames, one IPv4 packet each. It accepts Packet frames whose source is
//! the peer's tunnel IP only (so the other side cannot inject other addresses),
//! ignores Heartbeat and unknown kinds, and exits when stdin closes; the TUN is not
//! persistent, so the kernel removes it with the agent's last file descriptor.
//!
//! Pure parts: the address pairs ([`pair`], [`first_free_pair`]) and the inbound
//! source check ([`accept_inbound`]). I/O: the TUN device, stdin/stdout, the list
//! of local addresses (getifaddrs).

use std::collections::BTreeSet;
use std::io;
use std::net::{IpAddr, Ipv4Addr};

use clap::Args;
use ipnet::Ipv4Net;
use kvpn_proto::frame::{self, Kind};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tracing::{debug, trace, warn};

/// The tunnel range of `kvpn ssh` (RFC 2544 benchmarking space, next to the
/// 198.18.0.0/16 KubeVPN uses, so the two can run side by side). Pair `n` is
/// `.4n+1` (laptop) and `.4n+2` (SSH host).
pub const TUNNEL_RANGE: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(198, 19, 0, 0), 16);

/// Default TUN MTU in bytes: a byte-stream transport, like the manager sessions
/// ([`frame::DEFAULT_TUN_MTU`]), so bulk TCP needs few frames.
pub const DEFAULT_MTU: u16 = frame::DEFAULT_TUN_MTU;

/// TUN device name pattern on both ends (the kernel fills in the number).
pub const TUN_NAME: &str = "kvssh%d";

/// Exit code of the agent: its tunnel IP is already on an interface of this host
/// (another `kvpn ssh` session holds the pair), so the laptop tries the next pair.
pub const EXIT_ADDRESS_IN_USE: i32 = 3;
/// Exit code: not allowed to create the TUN device (not root, no CAP_NET_ADMIN).
pub const EXIT_NOT_PERMITTED: i32 = 4;
/// Exit code: any other failure to set the TUN device up.
pub const EXIT_TUN: i32 = 5;
/// Exit code: the frame stream on stdin is corrupt.
pub const EXIT_BAD_STREAM: i32 = 6;

/// Pair `n` of [`TUNNEL_RANGE`]: (laptop, SSH host), or `None` past the range.
pub fn pair(n: u32) -> Option<(Ipv4Addr, Ipv4Addr)> {
    let base = u32::from(TUNNEL_RANGE.network());
    let offset = n.checked_mul(4)?;
    if u64::from(offset) + 4 > 1u64 << (32 - TUNNEL_RANGE.prefix_len()) {
        return None;
    }
    Some((
        Ipv4Addr::from(base + offset + 1),
        Ipv4Addr::from(base + offset + 2),
    ))
}

/// The first pair, from `from` on, with neither address in `used`.
pub fn first_free_pair(from: u32, used: &BTreeSet<Ipv4Addr>) -> Option<(u32, Ipv4Addr, Ipv4Addr)> {
    (from..)
        .map_while(|n| pair(n).map(|(a, b)| (n, a, b)))
        .find(|(_, a, b)| !used.contains(a) && !used.contains(b))
}

/// Whether an inbound packet (from the other end) may enter this TUN: IPv4 with
/// the peer's tunnel IP as source. Never panics on any input.
pub fn accept_inbound(packet: &[u8], peer_ip: Ipv4Addr) -> bool {
    match smoltcp::wire::Ipv4Packet::new_checked(packet) {
        Ok(p) => p.src_addr() == peer_ip,
        Err(_) => false,
    }
}

/// The IPv4 addresses on this host's interfaces.
pub fn local_ipv4s() -> BTreeSet<Ipv4Addr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return BTreeSet::new();
    };
    addrs
        .filter_map(|a| a.address?.as_sockaddr_in().map(|s| s.ip()))
        .collect()
}

/// `kvpn ssh-peer` flags (internal; `kvpn ssh` passes them).
#[derive(Debug, Args, Clone)]
pub struct PeerArgs {
    /// This end's tunnel IP.
    #[arg(long)]
    pub tunnel_ip: Ipv4Addr,
    /// The other end's tunnel IP (the point-to-point peer).
    #[arg(long)]
    pub peer_ip: Ipv4Addr,
    /// TUN MTU in bytes.
    #[arg(long, default_value_t = DEFAULT_MTU)]
    pub mtu: u16,
}

/// Runs the peer agent until stdin closes; returns the process exit code. Errors
/// go to stderr as one line each (the laptop shows them to the user).
pub async fn run(args: PeerArgs) -> i32 {
    if local_ipv4s().contains(&args.tunnel_ip) {
        eprintln!(
            "kvpn ssh-peer: tunnel IP {} is already on an interface of this host (another kvpn ssh session?)",
            args.tunnel_ip
        );
        return EXIT_ADDRESS_IN_USE;
    }
    let device = match tun_rs::DeviceBuilder::new()
        .name(TUN_NAME)
        .mtu(args.mtu)
        .ipv4(args.tunnel_ip, 32u8, Some(args.peer_ip))
        .build_async()
    {
        Ok(d) => d,
        Err(e) => {
            let (code, hint) = match e.raw_os_error() {
                Some(libc::EPERM) | Some(libc::EACCES) => (
                    EXIT_NOT_PERMITTED,
                    "creating a TUN device needs root (CAP_NET_ADMIN) on this host",
                ),
                Some(libc::ENOENT) | Some(libc::ENODEV) => (
                    EXIT_TUN,
                    "/dev/net/tun is missing: load the tun module (modprobe tun)",
                ),
                _ => (EXIT_TUN, "cannot set the TUN device up"),
            };
            eprintln!("kvpn ssh-peer: cannot create a TUN device: {e} ({hint})");
            return code;
        }
    };
    let name = device.name().unwrap_or_else(|_| TUN_NAME.to_owned());
    debug!(tun = %name, ip = %args.tunnel_ip, peer = %args.peer_ip, "ssh peer TUN up");

    let mut stdout = tokio::io::stdout();
    let hello = frame::Hello {
        version: frame::PROTOCOL_VERSION,
        tunnel_ip: IpAddr::V4(args.tunnel_ip),
        token: name.into_bytes(),
        mtu: None,
        tunnel_ip_v6: None,
        offloads: None,
        shard: None,
        resume_token: None,
    };
    let mut out = Vec::new();
    if let Err(e) = hello
        .encode()
        .map_err(|e| e.to_string())
        .and_then(|p| frame::encode_into(Kind::Hello, &p, &mut out).map_err(|e| e.to_string()))
    {
        eprintln!("kvpn ssh-peer: cannot encode the hello frame: {e}");
        return EXIT_TUN;
    }
    if stdout.write_all(&out).await.is_err() || stdout.flush().await.is_err() {
        return 0;
    }

    let device = std::sync::Arc::new(device);
    let outbound = tokio::spawn(tun_to_stdout(device.clone(), stdout, args.mtu));
    let code = stdin_to_tun(&device, args.peer_ip).await;
    outbound.abort();
    code
}

/// Frames from stdin into the TUN, until stdin closes.
async fn stdin_to_tun(device: &tun_rs::AsyncDevice, peer_ip: Ipv4Addr) -> i32 {
    let mut stdin = tokio::io::stdin();
    let decoder = frame::Decoder::default();
    let mut buf: Vec<u8> = Vec::with_capacity(2 * frame::MAX_FRAME_LEN);
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let n = match stdin.read(&mut chunk).await {
            Ok(0) => return 0,
            Ok(n) => n,
            Err(e) => {
                debug!("ssh peer: stdin: {e}");
                return 0;
            }
        };
        buf.extend_from_slice(&chunk[..n]);
        let mut at = 0;
        loop {
            match decoder.decode(&buf[at..]) {
                Ok(Some((f, used))) => {
                    if f.kind == Kind::Packet {
                        if accept_inbound(f.payload, peer_ip) {
                            if let Err(e) = device.send(f.payload).await {
                                trace!("ssh peer: TUN write: {e}");
                            }
                        } else {
                            trace!(
                                len = f.payload.len(),
                                "ssh peer: dropped a packet not from the peer"
                            );
                        }
                    }
                    at += used;
                }
                Ok(None) => break,
                Err(e) => {
                    eprintln!("kvpn ssh-peer: corrupt frame stream from the other end: {e}");
                    return EXIT_BAD_STREAM;
                }
            }
        }
        buf.drain(..at);
    }
}

/// Packets from the TUN, framed, to stdout; a batch of whatever the TUN has ready
/// goes out with one write.
async fn tun_to_stdout(
    device: std::sync::Arc<tun_rs::AsyncDevice>,
    mut stdout: tokio::io::Stdout,
    mtu: u16,
) {
    let mut packet = vec![0u8; usize::from(mtu).max(1500) + 64];
    let mut out: Vec<u8> = Vec::with_capacity(256 * 1024);
    loop {
        let n = match device.recv(&mut packet).await {
            Ok(n) => n,
            Err(e) => {
                warn!("ssh peer: TUN read: {e}");
                return;
            }
        };
        out.clear();
        push_outbound(&packet[..n], &mut out);
        while out.len() < 192 * 1024 {
            match device.try_recv(&mut packet) {
                Ok(n) => push_outbound(&packet[..n], &mut out),
                Err(_) => break,
            }
        }
        if out.is_empty() {
            continue;
        }
        if stdout.write_all(&out).await.is_err() || stdout.flush().await.is_err() {
            return;
        }
    }
}

fn push_outbound(packet: &[u8], out: &mut Vec<u8>) {
    // Only IPv4 crosses (the tunnel has no IPv6 addresses); a packet too big for a
    // frame cannot come from a TUN whose MTU fits one.
    if packet.first().is_some_and(|b| b >> 4 == 4)
        && let Err(e) = frame::encode_into(Kind::Packet, packet, out)
    {
        trace!("ssh peer: packet not framed: {e}");
    }
}

/// How the laptop reads an agent's early exit.
pub fn describe_exit(code: Option<i32>) -> &'static str {
    match code {
        Some(EXIT_ADDRESS_IN_USE) => "its tunnel IP is in use there",
        Some(EXIT_NOT_PERMITTED) => "it is not allowed to create a TUN device (needs root)",
        Some(EXIT_TUN) => "it could not set up its TUN device",
        Some(127) => "the kvpn binary was not found",
        Some(126) => "the kvpn binary is not executable",
        _ => "it exited early",
    }
}

/// Whether `e` means the other end closed (normal at the end of a session).
pub fn is_closed(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::BrokenPipe | io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_are_slash_30_aligned_and_stay_in_the_range() {
        assert_eq!(
            pair(0),
            Some((Ipv4Addr::new(198, 19, 0, 1), Ipv4Addr::new(198, 19, 0, 2)))
        );
        assert_eq!(
            pair(1),
            Some((Ipv4Addr::new(198, 19, 0, 5), Ipv4Addr::new(198, 19, 0, 6)))
        );
        assert_eq!(
            pair(16383),
            Some((
                Ipv4Addr::new(198, 19, 255, 253),
                Ipv4Addr::new(198, 19, 255, 254)
            ))
        );
        assert_eq!(pair(16384), None);
        assert_eq!(pair(u32::MAX), None);
    }

    #[test]
    fn the_first_free_pair_skips_pairs_with_either_address_taken() {
        let used: BTreeSet<Ipv4Addr> = [Ipv4Addr::new(198, 19, 0, 1), Ipv4Addr::new(198, 19, 0, 6)]
            .into_iter()
            .collect();
        assert_eq!(
            first_free_pair(0, &used),
            Some((
                2,
                Ipv4Addr::new(198, 19, 0, 9),
                Ipv4Addr::new(198, 19, 0, 10)
            ))
        );
        assert_eq!(first_free_pair(3, &used).map(|p| p.0), Some(3));
        assert_eq!(first_free_pair(16384, &used), None);
    }

    #[test]
    fn only_ipv4_from_the_peer_enters_the_tun() {
        let peer = Ipv4Addr::new(198, 19, 0, 1);
        // A minimal valid IPv4 header (20 bytes, no payload), checksum unchecked.
        let mut p = vec![0x45, 0, 0, 20, 0, 0, 0, 0, 64, 1, 0, 0];
        p.extend_from_slice(&peer.octets());
        p.extend_from_slice(&[198, 19, 0, 2]);
        assert!(accept_inbound(&p, peer));
        assert!(!accept_inbound(&p, Ipv4Addr::new(198, 19, 0, 5)));
        assert!(!accept_inbound(&p[..19], peer));
        assert!(!accept_inbound(&[], peer));
        let mut v6 = p.clone();
        v6[0] = 0x60;
        assert!(!accept_inbound(&v6, peer));
    }
}
