//! The SOCKS5 server (RFC 1928) of SOCKS mode: no authentication (it listens on
//! loopback by default), CONNECT and UDP ASSOCIATE; BIND is refused with
//! "command not supported". The wire protocol (greeting, request, replies, the
//! UDP request header) is the `fast-socks5` crate's; what a request does is
//! ours: targets are reached through the laptop-side [`Stack`] and the data
//! channel, domain names are resolved by the cluster DNS ([`super::dns`]).
//!
//! Bad input never stops the server: each client runs in its own task, and a
//! client that speaks another protocol version, sends a truncated or malformed
//! request, or stalls for [`REQUEST_TIMEOUT`], gets a reply saying so (where the
//! protocol has one) and is closed.
//!
//! I/O: the SOCKS listener, its client connections, one laptop UDP socket per
//! UDP association.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use fast_socks5::server::{Socks5ServerProtocol, SocksServerError};
use fast_socks5::util::target_addr::{AddrError, TargetAddr, read_address};
use fast_socks5::{ReplyError, Socks5Command};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

use super::dns::Resolver;
use super::stack::{Stack, UdpConn};

/// How long a client may take for its greeting and request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a CONNECT waits for the destination's handshake through the
/// manager (which itself gives up on a silent destination after its own dial
/// timeout and answers with a reset).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

/// The SOCKS4 "request rejected" reply, for SOCKS4 clients pointed at us by
/// mistake: they then report a rejection instead of a protocol error.
const SOCKS4_REJECTED: [u8; 8] = [0, 0x5b, 0, 0, 0, 0, 0, 0];

/// "No acceptable methods" (RFC 1928 §3): the reply to a greeting we cannot use.
const NO_ACCEPTABLE_METHODS: [u8; 2] = [5, 0xff];

/// What a client connection needs.
#[derive(Debug, Clone)]
pub struct Server {
    /// The laptop-side stack.
    pub stack: Arc<Stack>,
    /// Cluster DNS over the stack.
    pub resolver: Resolver,
}

impl Server {
    /// Accept clients on `listener` until the task is dropped.
    pub async fn serve(self, listener: TcpListener) {
        loop {
            match listener.accept().await {
                Ok((stream, peer)) => {
                    let server = self.clone();
                    tokio::spawn(async move {
                        if let Err(e) = server.client(stream, peer).await {
                            tracing::debug!(%peer, error = %e, "SOCKS client ended");
                        }
                    });
                }
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "SOCKS accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    async fn client(&self, mut stream: TcpStream, peer: SocketAddr) -> Result<(), String> {
        let _ = stream.set_nodelay(true);
        let request = tokio::time::timeout(REQUEST_TIMEOUT, read_request(&mut stream)).await;
        let (cmd, target) = match request {
            Ok(Ok(r)) => r,
            Ok(Err(bad)) => {
                if let Some(reply) = bad.reply {
                    let _ = stream.write_all(&reply).await;
                }
                let _ = stream.shutdown().await;
                return Err(bad.reason);
            }
            Err(_) => {
                let _ = stream
                    .write_all(&reply(ReplyError::GeneralFailure, None))
                    .await;
                return Err(format!(
                    "no complete SOCKS5 request within {} s",
                    REQUEST_TIMEOUT.as_secs()
                ));
            }
        };
        match cmd {
            Socks5Command::TCPConnect => self.connect(stream, target).await,
            Socks5Command::UDPAssociate => self.associate(stream, peer).await,
            Socks5Command::TCPBind => {
                let _ = stream
                    .write_all(&reply(ReplyError::CommandNotSupported, None))
                    .await;
                Err("BIND is not supported".to_owned())
            }
        }
    }

    async fn resolve(&self, target: &TargetAddr) -> Result<SocketAddr, String> {
        match target {
            TargetAddr::Ip(addr) => Ok(*addr),
            TargetAddr::Domain(name, port) => self
                .resolver
                .resolve(name)
                .await
                .map(|ip| SocketAddr::new(ip, *port))
                .map_err(|e| e.to_string()),
        }
    }

    async fn connect(&self, mut stream: TcpStream, target: TargetAddr) -> Result<(), String> {
        let addr = match self.resolve(&target).await {
            Ok(a) => a,
            Err(e) => {
                let _ = stream
                    .write_all(&reply(ReplyError::HostUnreachable, None))
                    .await;
                return Err(e);
            }
        };
        let mut conn = match self.stack.tcp_connect(addr) {
            Ok(c) => c,
            Err(e) => {
                // InvalidInput: an address the tunnel cannot carry (IPv6 on an
                // IPv4 tunnel IP, unspecified, multicast).
                let code = match e.kind() {
                    std::io::ErrorKind::InvalidInput => ReplyError::NetworkUnreachable,
                    _ => ReplyError::GeneralFailure,
                };
                let _ = stream.write_all(&reply(code, None)).await;
                return Err(format!("cannot open a flow to {addr}: {e}"));
            }
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, conn.established()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let code = match e.kind() {
                    std::io::ErrorKind::HostUnreachable => ReplyError::HostUnreachable,
                    _ => ReplyError::ConnectionRefused,
                };
                let _ = stream.write_all(&reply(code, None)).await;
                return Err(format!("{target} ({addr}): {e}"));
            }
            Err(_) => {
                let _ = stream.write_all(&reply(ReplyError::TtlExpired, None)).await;
                return Err(format!(
                    "{target} ({addr}) did not answer within {} s",
                    CONNECT_TIMEOUT.as_secs()
                ));
            }
        }
        stream
            .write_all(&reply(ReplyError::Succeeded, Some(conn.local_addr())))
            .await
            .map_err(|e| format!("cannot send the SOCKS reply: {e}"))?;
        tracing::debug!(%target, %addr, "CONNECT through the tunnel");
        match tokio::io::copy_bidirectional(&mut stream, &mut conn).await {
            Ok((up, down)) => {
                tracing::debug!(%target, up, down, "CONNECT closed");
                Ok(())
            }
            Err(e) => {
                if e.kind() == std::io::ErrorKind::ConnectionReset {
                    // The flow was reset on the tunnel side: the SOCKS client
                    // gets a reset too (linger 0), not a clean end of stream
                    // that could pass for a complete transfer.
                    let _ = stream.set_zero_linger();
                }
                Err(format!("{target}: {e}"))
            }
        }
    }

    /// UDP ASSOCIATE: a laptop UDP socket next to the SOCKS listener relays the
    /// client's datagrams (with their SOCKS5 UDP header) through one UDP socket
    /// on the stack, until the client closes the TCP connection (RFC 1928 §7).
    async fn associate(&self, mut control: TcpStream, peer: SocketAddr) -> Result<(), String> {
        let local_ip = control
            .local_addr()
            .map_err(|e| format!("no local address: {e}"))?
            .ip();
        let relay = match UdpSocket::bind(SocketAddr::new(local_ip, 0)).await {
            Ok(r) => r,
            Err(e) => {
                let _ = control
                    .write_all(&reply(ReplyError::GeneralFailure, None))
                    .await;
                return Err(format!("cannot bind a UDP relay socket on {local_ip}: {e}"));
            }
        };
        let tunnel = match self.stack.udp_bind() {
            Ok(t) => t,
            Err(e) => {
                let _ = control
                    .write_all(&reply(ReplyError::GeneralFailure, None))
                    .await;
                return Err(format!("cannot open a UDP flow: {e}"));
            }
        };
        let relay_addr = relay
            .local_addr()
            .map_err(|e| format!("no relay address: {e}"))?;
        control
            .write_all(&reply(ReplyError::Succeeded, Some(relay_addr)))
            .await
            .map_err(|e| format!("cannot send the SOCKS reply: {e}"))?;
        tracing::debug!(%peer, %relay_addr, "UDP ASSOCIATE");
        let mut client: Option<SocketAddr> = None;
        // Names this association resolved: a client sending many datagrams to
        // one name (a DNS client, a game) must not cost a lookup each.
        let mut names: HashMap<(String, u16), SocketAddr> = HashMap::new();
        let mut from_client = vec![0u8; 65536];
        let mut from_cluster = vec![0u8; 65536];
        let mut ctl = [0u8; 64];
        loop {
            tokio::select! {
                got = relay.recv_from(&mut from_client) => {
                    let (n, src) = got.map_err(|e| format!("UDP relay: {e}"))?;
                    // Only the client that asked (its IP, RFC 1928 §7) may use the relay.
                    if src.ip() != peer.ip() {
                        continue;
                    }
                    client = Some(src);
                    if let Err(e) = self.forward(&tunnel, &from_client[..n], &mut names).await {
                        tracing::debug!(%src, error = %e, "UDP datagram dropped");
                    }
                }
                got = tunnel.recv_from(&mut from_cluster) => {
                    let (n, src) = got.map_err(|e| format!("UDP flow: {e}"))?;
                    let Some(client) = client else { continue };
                    let mut datagram = udp_header(src);
                    datagram.extend_from_slice(&from_cluster[..n]);
                    if let Err(e) = relay.send_to(&datagram, client).await {
                        tracing::debug!(%client, error = %e, "UDP reply to the SOCKS client failed");
                    }
                }
                got = control.read(&mut ctl) => {
                    match got {
                        Ok(0) | Err(_) => return Ok(()),
                        Ok(_) => {}
                    }
                }
            }
        }
    }

    async fn forward(
        &self,
        tunnel: &UdpConn,
        datagram: &[u8],
        names: &mut HashMap<(String, u16), SocketAddr>,
    ) -> Result<(), String> {
        let (frag, target, payload) = fast_socks5::parse_udp_request(datagram)
            .await
            .map_err(|e| format!("bad SOCKS5 UDP header: {e}"))?;
        if frag != 0 {
            return Err("fragmented SOCKS5 UDP datagrams are not supported".to_owned());
        }
        let to = match target {
            TargetAddr::Ip(addr) => addr,
            TargetAddr::Domain(name, port) => match names.get(&(name.clone(), port)) {
                Some(addr) => *addr,
                None => {
                    let addr = self
                        .resolve(&TargetAddr::Domain(name.clone(), port))
                        .await?;
                    // Bounded: a client cycling through names cannot grow it forever.
                    if names.len() >= 256 {
                        names.clear();
                    }
                    names.insert((name, port), addr);
                    addr
                }
            },
        };
        tunnel
            .send_to(payload, to)
            .await
            .map_err(|e| format!("to {to}: {e}"))
    }
}

/// A request we could not use: the reply owed to the client (if the protocol
/// has one at that point) and why, for the log.
struct BadRequest {
    reply: Option<Vec<u8>>,
    reason: String,
}

/// Greeting (no authentication) and request. On error the client has been sent
/// nothing yet unless `fast-socks5` replied itself (for a greeting without the
/// no-auth method).
async fn read_request(stream: &mut TcpStream) -> Result<(Socks5Command, TargetAddr), BadRequest> {
    // Peek at the version first: a SOCKS4 client gets a SOCKS4 rejection.
    let mut first = [0u8; 1];
    match stream.peek(&mut first).await {
        Ok(1) if first[0] == 4 => {
            return Err(BadRequest {
                reply: Some(SOCKS4_REJECTED.to_vec()),
                reason: "a SOCKS4 request: only SOCKS5 is served".to_owned(),
            });
        }
        Ok(0) => {
            return Err(BadRequest {
                reply: None,
                reason: "closed before the greeting".to_owned(),
            });
        }
        _ => {}
    }
    match Socks5ServerProtocol::accept_no_auth(&mut *stream).await {
        Ok(_authenticated) => {}
        Err(SocksServerError::AuthMethodUnacceptable(methods)) => {
            return Err(BadRequest {
                reply: None,
                reason: format!(
                    "the client offered no usable authentication method ({methods:?}; this server takes \"no authentication\")"
                ),
            });
        }
        Err(e) => {
            return Err(BadRequest {
                reply: Some(NO_ACCEPTABLE_METHODS.to_vec()),
                reason: format!("bad SOCKS5 greeting: {e}"),
            });
        }
    }
    // The request is read here rather than by `read_command`, which answers a
    // truncated address with "connection refused"; a malformed request gets
    // "general failure" (or "address type not supported") instead.
    let mut head = [0u8; 4];
    if let Err(e) = stream.read_exact(&mut head).await {
        return Err(BadRequest {
            reply: Some(reply(ReplyError::GeneralFailure, None)),
            reason: format!("truncated SOCKS5 request: {e}"),
        });
    }
    let [version, cmd, _rsv, atyp] = head;
    if version != 5 {
        return Err(BadRequest {
            reply: Some(reply(ReplyError::GeneralFailure, None)),
            reason: format!("SOCKS5 request with version {version}"),
        });
    }
    let target = match read_address(&mut *stream, atyp).await {
        Ok(t) => t,
        Err(e) => {
            let code = match e {
                AddrError::IncorrectAddressType => ReplyError::AddressTypeNotSupported,
                _ => ReplyError::GeneralFailure,
            };
            return Err(BadRequest {
                reply: Some(reply(code, None)),
                reason: format!("bad address in the SOCKS5 request: {e}"),
            });
        }
    };
    let cmd = match cmd {
        1 => Socks5Command::TCPConnect,
        2 => Socks5Command::TCPBind,
        3 => Socks5Command::UDPAssociate,
        other => {
            return Err(BadRequest {
                reply: Some(reply(ReplyError::CommandNotSupported, None)),
                reason: format!("unknown SOCKS5 command {other}"),
            });
        }
    };
    Ok((cmd, target))
}

/// A SOCKS5 reply with `code` and the bound address (`0.0.0.0:0` when none).
fn reply(code: ReplyError, bound: Option<SocketAddr>) -> Vec<u8> {
    let bound = bound.unwrap_or_else(|| SocketAddr::new(IpAddr::from([0, 0, 0, 0]), 0));
    let mut out = vec![5, code.as_u8(), 0];
    push_addr(&mut out, bound);
    out
}

/// The SOCKS5 UDP request header (RSV, FRAG 0, address of `from`).
fn udp_header(from: SocketAddr) -> Vec<u8> {
    let mut out = vec![0, 0, 0];
    push_addr(&mut out, from);
    out
}

fn push_addr(out: &mut Vec<u8>, addr: SocketAddr) {
    match addr.ip() {
        IpAddr::V4(v4) => {
            out.push(1);
            out.extend_from_slice(&v4.octets());
        }
        IpAddr::V6(v6) => {
            out.push(4);
            out.extend_from_slice(&v6.octets());
        }
    }
    out.extend_from_slice(&addr.port().to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_and_udp_headers_follow_rfc_1928() {
        let a: SocketAddr = "100.96.0.2:40000".parse().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            reply(ReplyError::Succeeded, Some(a)),
            [5, 0, 0, 1, 100, 96, 0, 2, 0x9c, 0x40]
        );
        assert_eq!(
            reply(ReplyError::HostUnreachable, None),
            [5, 4, 0, 1, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(udp_header(a), [0, 0, 0, 1, 100, 96, 0, 2, 0x9c, 0x40]);
    }
}
