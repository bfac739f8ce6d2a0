//! The protocol side of `kvpn-lab-server`, pure and shared with the tests: a minimal
//! HTTP/1.1 request-head parser, the pod page's format, and the TCP echo server's
//! commands. No I/O.

use std::net::{IpAddr, SocketAddr};

/// Longest request head the server accepts (bytes, request line + headers).
pub const MAX_HEAD_BYTES: usize = 16 * 1024;

/// A parsed request head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    /// Path without the query, e.g. `/big`.
    pub path: String,
    /// Raw query after `?`, if any.
    pub query: Option<String>,
    /// Whether the connection stays open after the response (HTTP/1.1 default unless
    /// `Connection: close`; HTTP/1.0 only with `Connection: keep-alive`).
    pub keep_alive: bool,
    /// `Content-Length` of a request body (the server discards bodies).
    pub content_length: u64,
}

impl Request {
    /// Value of query parameter `key` (no percent-decoding: the lab's parameters are
    /// plain numbers and words).
    pub fn query_param(&self, key: &str) -> Option<&str> {
        self.query
            .as_deref()?
            .split('&')
            .filter_map(|kv| kv.split_once('=').or(Some((kv, ""))))
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HttpError {
    #[error("request head longer than {MAX_HEAD_BYTES} bytes")]
    HeadTooLong,
    #[error("malformed request line `{0}`")]
    BadRequestLine(String),
    #[error("malformed header `{0}`")]
    BadHeader(String),
}

/// Parses a request head from the start of `buf`. `Ok(None)`: incomplete, read more.
/// `Ok(Some((request, consumed)))`: `consumed` bytes (head and its blank line) used.
pub fn parse_request_head(buf: &[u8]) -> Result<Option<(Request, usize)>, HttpError> {
    let Some(end) = find_head_end(buf) else {
        return if buf.len() > MAX_HEAD_BYTES {
            Err(HttpError::HeadTooLong)
        } else {
            Ok(None)
        };
    };
    if end.0 > MAX_HEAD_BYTES {
        return Err(HttpError::HeadTooLong);
    }
    let head = String::from_utf8_lossy(&buf[..end.0]);
    let mut lines = head.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l));
    let request_line = lines.next().unwrap_or_default();
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(HttpError::BadRequestLine(request_line.to_owned()));
    };
    if method.is_empty() || !target.starts_with('/') || !version.starts_with("HTTP/1.") {
        return Err(HttpError::BadRequestLine(request_line.to_owned()));
    }
    let http10 = version == "HTTP/1.0";
    let mut keep_alive = !http10;
    let mut content_length = 0;
    for line in lines.filter(|l| !l.is_empty()) {
        let Some((name, value)) = line.split_once(':') else {
            return Err(HttpError::BadHeader(line.to_owned()));
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("connection") {
            for token in value.split(',').map(str::trim) {
                if token.eq_ignore_ascii_case("close") {
                    keep_alive = false;
                } else if token.eq_ignore_ascii_case("keep-alive") {
                    keep_alive = true;
                }
            }
        } else if name.eq_ignore_ascii_case("content-length") {
            content_length = value
                .parse()
                .map_err(|_| HttpError::BadHeader(line.to_owned()))?;
        }
    }
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p.to_owned(), Some(q.to_owned())),
        None => (target.to_owned(), None),
    };
    Ok(Some((
        Request {
            method: method.to_owned(),
            path,
            query,
            keep_alive,
            content_length,
        },
        end.1,
    )))
}

/// (end of head without the blank line, end including it); accepts CRLF or bare LF.
fn find_head_end(buf: &[u8]) -> Option<(usize, usize)> {
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, i + 4));
    let lf = buf
        .windows(2)
        .position(|w| w == b"\n\n")
        .map(|i| (i, i + 2));
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// The UDP datagram `kvpn-lab-server`'s echo port answers with the sender's
/// address as it saw it (`ip:port`) instead of echoing.
pub const UDP_PEER_QUERY: &[u8] = b"KVPN-PEER?";

/// What `GET /` answers: which pod served it, at which address, and who asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageInfo {
    pub pod: String,
    /// The server's own address of the connection (the pod IP, also behind a ClusterIP
    /// since DNAT happens before the pod).
    pub pod_ip: IpAddr,
    /// The client address as the pod saw it (SNAT/masquerade shows here).
    pub client: SocketAddr,
}

impl PageInfo {
    /// The page text (text/plain), one `key: value` per line.
    pub fn render(&self) -> String {
        format!(
            "kvpn-lab-server\npod: {}\npod-ip: {}\nclient: {}\n",
            self.pod, self.pod_ip, self.client
        )
    }

    /// Parses a page made by [`PageInfo::render`].
    pub fn parse(page: &str) -> Option<PageInfo> {
        let mut lines = page.lines();
        if lines.next()? != "kvpn-lab-server" {
            return None;
        }
        let mut pod = None;
        let mut pod_ip = None;
        let mut client = None;
        for line in lines {
            match line.split_once(": ") {
                Some(("pod", v)) => pod = Some(v.to_owned()),
                Some(("pod-ip", v)) => pod_ip = v.parse().ok(),
                Some(("client", v)) => client = v.parse().ok(),
                _ => {}
            }
        }
        Some(PageInfo {
            pod: pod?,
            pod_ip: pod_ip?,
            client: client?,
        })
    }
}

/// A command on the TCP echo port, sent as the connection's first line. Anything
/// else is echoed back until EOF.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EchoCommand {
    /// `WRITE <n> CLOSE\n`: the server writes `n` bytes of [`crate::payload`] and then
    /// closes its side (FIN), still reading and discarding until the client's EOF so
    /// unread data never turns the close into a reset (case tr-05).
    WriteThenClose { bytes: u64 },
    /// `RESET\n`: the server aborts the connection with a TCP RST (case tr-06).
    Reset,
}

/// Longest command line (bytes, newline included).
pub const MAX_COMMAND_BYTES: usize = 64;

/// What the echo server should do with the first bytes of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EchoStart {
    /// Still a possible command prefix without its newline: read more.
    NeedMore,
    /// A command ending at byte `consumed`.
    Command {
        command: EchoCommand,
        consumed: usize,
    },
    /// Plain data: echo everything read so far and keep echoing.
    Echo,
}

/// Classifies the first bytes of an echo connection.
pub fn classify_echo_start(buf: &[u8]) -> EchoStart {
    if let Some(nl) = buf.iter().position(|&b| b == b'\n') {
        let line = &buf[..nl];
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        return match parse_echo_command(line) {
            Some(command) => EchoStart::Command {
                command,
                consumed: nl + 1,
            },
            None => EchoStart::Echo,
        };
    }
    let could_be_command = |keyword: &[u8]| {
        let n = buf.len().min(keyword.len());
        buf[..n] == keyword[..n]
    };
    if buf.len() < MAX_COMMAND_BYTES && (could_be_command(b"WRITE ") || could_be_command(b"RESET"))
    {
        EchoStart::NeedMore
    } else {
        EchoStart::Echo
    }
}

fn parse_echo_command(line: &[u8]) -> Option<EchoCommand> {
    let line = std::str::from_utf8(line).ok()?;
    let words: Vec<&str> = line.split_ascii_whitespace().collect();
    match words.as_slice() {
        ["RESET"] => Some(EchoCommand::Reset),
        ["WRITE", n, "CLOSE"] => Some(EchoCommand::WriteThenClose {
            bytes: n.parse().ok()?,
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_curl_request() {
        let raw = b"GET /big?bytes=1000&x HTTP/1.1\r\nHost: 10.96.0.100\r\nUser-Agent: curl/7.88.1\r\nAccept: */*\r\n\r\nrest";
        let (req, used) = parse_request_head(raw).expect("valid").expect("complete");
        assert_eq!(req.method, "GET");
        assert_eq!(req.path, "/big");
        assert_eq!(req.query_param("bytes"), Some("1000"));
        assert_eq!(req.query_param("x"), Some(""));
        assert_eq!(req.query_param("y"), None);
        assert!(req.keep_alive);
        assert_eq!(&raw[used..], b"rest");
    }

    #[test]
    fn incomplete_and_bad_heads() {
        assert_eq!(
            parse_request_head(b"GET / HTTP/1.1\r\nHost: x\r\n"),
            Ok(None)
        );
        assert!(matches!(
            parse_request_head(b"GARBAGE\r\n\r\n"),
            Err(HttpError::BadRequestLine(_))
        ));
        assert!(matches!(
            parse_request_head(b"GET / HTTP/1.1\r\nNoColon\r\n\r\n"),
            Err(HttpError::BadHeader(_))
        ));
        let long = vec![b'a'; MAX_HEAD_BYTES + 1];
        assert_eq!(parse_request_head(&long), Err(HttpError::HeadTooLong));
    }

    #[test]
    fn connection_header_decides_keep_alive() {
        let close = parse_request_head(b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n")
            .expect("ok")
            .expect("complete");
        assert!(!close.0.keep_alive);
        let old = parse_request_head(b"GET / HTTP/1.0\n\n")
            .expect("ok")
            .expect("complete");
        assert!(!old.0.keep_alive);
        let old_ka = parse_request_head(b"GET / HTTP/1.0\r\nconnection: Keep-Alive\r\n\r\n")
            .expect("ok")
            .expect("complete");
        assert!(old_ka.0.keep_alive);
    }

    #[test]
    fn page_round_trips() {
        let info = PageInfo {
            pod: "backend-1".into(),
            pod_ip: "10.244.1.11".parse().expect("ip"),
            client: "10.244.1.10:40000".parse().expect("addr"),
        };
        assert_eq!(PageInfo::parse(&info.render()), Some(info));
        assert_eq!(PageInfo::parse("hello"), None);
    }

    #[test]
    fn echo_commands() {
        assert_eq!(classify_echo_start(b"WRI"), EchoStart::NeedMore);
        assert_eq!(classify_echo_start(b"WRITE 5000"), EchoStart::NeedMore);
        assert_eq!(
            classify_echo_start(b"WRITE 5000000 CLOSE\nmore"),
            EchoStart::Command {
                command: EchoCommand::WriteThenClose { bytes: 5_000_000 },
                consumed: 20
            }
        );
        assert_eq!(
            classify_echo_start(b"RESET\r\n"),
            EchoStart::Command {
                command: EchoCommand::Reset,
                consumed: 7
            }
        );
        assert_eq!(classify_echo_start(b"hello"), EchoStart::Echo);
        assert_eq!(classify_echo_start(b"WRITE x CLOSE\n"), EchoStart::Echo);
        assert_eq!(classify_echo_start(b""), EchoStart::NeedMore);
        assert_eq!(classify_echo_start(&[b'W'; 1]), EchoStart::NeedMore);
        let long = [b"WRITE ".as_slice(), &[b'1'; 70]].concat();
        assert_eq!(classify_echo_start(&long), EchoStart::Echo);
    }
}
