//! The data channel's TCP socket settings, the same on both ends (the root
//! daemon's pump on the laptop, the traffic manager's session): one place so
//! the two cannot drift apart.

use std::os::fd::AsFd;

/// Unsent bytes the kernel may hold for a data connection before the socket
/// stops being writable (TCP_NOTSENT_LOWAT): 128 KiB, half an outbound batch
/// of the pump. Without it the send buffer grows to 4 MiB, and a heartbeat (or
/// its echo) written after a burst of data waits behind all of it on a slow
/// path (port-forward, SSH); with it the bounded queues of the pump and the
/// manager hold the rest, and a flood's excess is dropped and counted there
/// (docs/queues.md).
pub const NOTSENT_LOWAT: u32 = 128 * 1024;

/// Set TCP_NOTSENT_LOWAT (Linux 3.12, net/ipv4/tcp.c) to `bytes` on a
/// connected TCP socket.
pub fn set_notsent_lowat(socket: &impl AsFd, bytes: u32) -> std::io::Result<()> {
    socket2::SockRef::from(socket).set_tcp_notsent_lowat(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notsent_lowat_is_set_on_a_real_socket() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let stream = std::net::TcpStream::connect(addr).expect("connect loopback");
        set_notsent_lowat(&stream, NOTSENT_LOWAT).expect("setsockopt");
        assert_eq!(
            socket2::SockRef::from(&stream)
                .tcp_notsent_lowat()
                .expect("getsockopt"),
            NOTSENT_LOWAT
        );
    }
}
