//! The kubelet's websocket port-forward (`GET /portForward/{namespace}/{pod}?port=…`),
//! as the API server proxies it from `pods/portforward`: subprotocol
//! `v4.channel.k8s.io` (also `channel.k8s.io` and none, which frame the same way).
//! Port i uses data channel 2i and error channel 2i+1; every binary message starts
//! with its channel byte; the server's first message on each channel is the port as a
//! little-endian u16. One TCP connection per port, dialled to `127.0.0.1:<port>`
//! inside the pod's netns, as the kubelet's runtime does. v4 cannot half-close: when
//! the pod closes a port's connection its remaining bytes are sent, and once every
//! port is done the websocket is closed; when the client closes the websocket, the
//! pod connections are closed.
//!
//! Pure parts: [`parse_ports`], [`choose_protocol`], [`frame`], [`split_frame`]. I/O:
//! [`serve`] on an upgraded connection.

use std::net::{Ipv4Addr, SocketAddr};

use futures::{SinkExt as _, StreamExt as _};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::mpsc;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;

/// Subprotocols served, in order of preference.
pub const PROTOCOLS: &[&str] = &["v4.channel.k8s.io", "channel.k8s.io"];

/// Bytes read from a pod connection per websocket message.
const CHUNK: usize = 32 * 1024;

/// The ports of a port-forward request: every `port` query parameter (each may hold a
/// comma-separated list, as the kubelet accepts), or kube-rs's `ports` if the request
/// reached the stand-in directly.
pub fn parse_ports(query: &str) -> Result<Vec<u16>, String> {
    let mut ports = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if k != "port" && k != "ports" {
            continue;
        }
        let v = v.replace("%2C", ",").replace("%2c", ",");
        for p in v.split(',') {
            match p.trim().parse::<u16>() {
                Ok(n) if n > 0 => ports.push(n),
                _ => return Err(format!("unable to parse \"{p}\" as a port")),
            }
        }
    }
    if ports.is_empty() {
        return Err("query parameter \"port\" is required".to_owned());
    }
    Ok(ports)
}

/// Picks the subprotocol from the client's `Sec-WebSocket-Protocol` list: Some("") when
/// the client offered none, None when nothing offered is served.
pub fn choose_protocol(offered: Option<&str>) -> Option<&'static str> {
    let Some(offered) = offered else {
        return Some("");
    };
    let offered: Vec<&str> = offered.split(',').map(str::trim).collect();
    if offered.iter().all(|p| p.is_empty()) {
        return Some("");
    }
    PROTOCOLS.iter().copied().find(|p| offered.contains(p))
}

/// A binary message on `channel`.
pub fn frame(channel: u8, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(payload.len() + 1);
    v.push(channel);
    v.extend_from_slice(payload);
    v
}

/// The channel and payload of a binary message (None for an empty one).
pub fn split_frame(msg: &[u8]) -> Option<(u8, &[u8])> {
    msg.split_first().map(|(c, rest)| (*c, rest))
}

enum Outbound {
    Data(u8, Vec<u8>),
    /// Port index done (pod closed, or the dial failed).
    Done(usize),
}

/// Serves one upgraded port-forward websocket: `netns` is the pod's netns name, `what`
/// names the pod in error messages (`<namespace>/<name>, uid <uid>`, the kubelet's
/// wording).
pub async fn serve<S>(ws: WebSocketStream<S>, netns: String, what: String, ports: Vec<u16>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sink, mut stream) = ws.split();
    for (i, p) in ports.iter().enumerate() {
        // Port count is bounded by the request line; index fits u8 for ≤127 ports.
        let Ok(ch) = u8::try_from(2 * i) else { break };
        for c in [ch, ch + 1] {
            if sink
                .send(Message::binary(frame(c, &p.to_le_bytes())))
                .await
                .is_err()
            {
                return;
            }
        }
    }
    let (out_tx, mut out_rx) = mpsc::channel::<Outbound>(16);
    let mut writers: Vec<Option<OwnedWriteHalf>> = Vec::new();
    let mut readers = Vec::new();
    for (i, &port) in ports.iter().enumerate().take(128) {
        // i < 128, so 2i and 2i+1 fit u8.
        let ch = (2 * i) as u8;
        match connect_in_netns(&netns, SocketAddr::from((Ipv4Addr::LOCALHOST, port))).await {
            Ok(tcp) => {
                let (mut rd, wr) = tcp.into_split();
                writers.push(Some(wr));
                let tx = out_tx.clone();
                readers.push(tokio::spawn(async move {
                    let mut buf = vec![0u8; CHUNK];
                    loop {
                        match rd.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                if tx
                                    .send(Outbound::Data(ch, buf[..n].to_vec()))
                                    .await
                                    .is_err()
                                {
                                    return;
                                }
                            }
                        }
                    }
                    let _ = tx.send(Outbound::Done(i)).await;
                }));
            }
            Err(e) => {
                writers.push(None);
                let msg = format!(
                    "error forwarding port {port} to pod {what}: dial tcp4 127.0.0.1:{port}: connect: {}",
                    describe_connect_error(&e)
                );
                tracing::debug!(%msg, "port-forward dial failed");
                let _ = out_tx.send(Outbound::Data(ch + 1, msg.into_bytes())).await;
                let _ = out_tx.send(Outbound::Done(i)).await;
            }
        }
    }
    drop(out_tx);
    let mut done = 0usize;
    loop {
        tokio::select! {
            out = out_rx.recv() => match out {
                Some(Outbound::Data(ch, data)) => {
                    if sink.send(Message::binary(frame(ch, &data))).await.is_err() {
                        break;
                    }
                }
                Some(Outbound::Done(i)) => {
                    if let Some(w) = writers.get_mut(i) {
                        *w = None;
                    }
                    done += 1;
                    if done == ports.len() {
                        let _ = sink.send(Message::Close(None)).await;
                        break;
                    }
                }
                None => break,
            },
            msg = stream.next() => match msg {
                Some(Ok(Message::Binary(b))) => {
                    if let Some((ch, payload)) = split_frame(&b)
                        && ch % 2 == 0
                        && !payload.is_empty()
                        && let Some(Some(w)) = writers.get_mut(usize::from(ch / 2))
                        && w.write_all(payload).await.is_err()
                    {
                        writers[usize::from(ch / 2)] = None;
                    }
                }
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break,
                Some(Ok(_)) => {}
            },
        }
    }
    for r in readers {
        r.abort();
    }
    drop(writers);
    let _ = sink.close().await;
}

fn describe_connect_error(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::ConnectionRefused => "connection refused".to_owned(),
        _ => e.to_string(),
    }
}

/// A TCP connection to `addr` made from inside the netns `netns` (the socket is
/// created there; connecting is asynchronous).
pub async fn connect_in_netns(
    netns: &str,
    addr: SocketAddr,
) -> std::io::Result<tokio::net::TcpStream> {
    let name = netns.to_owned();
    let socket = tokio::task::spawn_blocking(move || {
        crate::netns::run_in_netns(&name, || {
            if addr.is_ipv4() {
                tokio::net::TcpSocket::new_v4()
            } else {
                tokio::net::TcpSocket::new_v6()
            }
        })
    })
    .await
    .map_err(std::io::Error::other)?
    .map_err(std::io::Error::other)??;
    let stream = socket.connect(addr).await?;
    // As the kubelet's runtime (Go, TCP_NODELAY by default): each websocket message
    // goes to the pod at once, not held by Nagle behind an unacknowledged one.
    stream.set_nodelay(true)?;
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_from_the_apiserver_and_from_kube_rs() {
        assert_eq!(parse_ports("port=8080&port=7007"), Ok(vec![8080, 7007]));
        assert_eq!(parse_ports("&ports=80%2C1234"), Ok(vec![80, 1234]));
        assert_eq!(parse_ports("port=1,2"), Ok(vec![1, 2]));
        assert!(parse_ports("").is_err());
        assert!(parse_ports("port=0").is_err());
        assert!(parse_ports("port=x").is_err());
    }

    #[test]
    fn protocol_choice() {
        assert_eq!(
            choose_protocol(Some("v5.channel.k8s.io, v4.channel.k8s.io")),
            Some("v4.channel.k8s.io")
        );
        assert_eq!(
            choose_protocol(Some("channel.k8s.io")),
            Some("channel.k8s.io")
        );
        assert_eq!(choose_protocol(None), Some(""));
        assert_eq!(choose_protocol(Some("SPDY/3.1+portforward.k8s.io")), None);
        assert_eq!(choose_protocol(Some("v5.channel.k8s.io")), None);
    }

    #[test]
    fn framing() {
        assert_eq!(frame(3, &8080u16.to_le_bytes()), vec![3, 0x90, 0x1f]);
        assert_eq!(split_frame(&[2, 1, 2]), Some((2, &[1u8, 2][..])));
        assert_eq!(split_frame(&[]), None);
    }
}
