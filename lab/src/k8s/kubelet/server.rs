//! The stand-in's HTTPS endpoint, the one the API server dials for `pods/portforward`
//! and `pods/log`: TLS with a serving certificate from the lab CA (SAN = the node's
//! InternalIP), client certificates required and verified against the lab CA (the
//! API server presents `--kubelet-client-certificate`).
//!
//! Routes (HTTP/1.1, one request per connection):
//! - `GET /healthz` → `ok`
//! - `GET|POST /portForward/{namespace}/{pod}[/{uid}]`: with a websocket upgrade and
//!   `?port=…` → [`super::portforward`] (kube-rs); with `Upgrade: SPDY/3.1` →
//!   [`super::spdy`] (kubectl; ports come in stream headers). A websocket upgrade
//!   without `port` (kubectl ≥ 1.30 tunnelling SPDY) gets 400, on which kubectl falls
//!   back to SPDY.
//! - `GET /containerLogs/{namespace}/{pod}/{container}?tailLines=&limitBytes=&previous=`
//!   → the container's log file (`follow` returns what is there and ends).
//!
//! I/O: the listener, TLS, the pod log files. The pod table comes from the pod workers
//! ([`PodDirectory`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;

use super::{Error, portforward, spdy};

/// Longest request head accepted (bytes).
const MAX_HEAD: usize = 32 * 1024;
/// How often a followed log file is checked for new bytes.
const FOLLOW_POLL: Duration = Duration::from_millis(250);
/// How long a client may take for the TLS handshake and the request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);

/// What the endpoint knows about a running pod.
#[derive(Debug, Clone)]
pub struct PodEntry {
    pub uid: String,
    /// Full netns name (`kvpn-<id>-<role>`).
    pub netns: String,
    /// Log files per container, one per run, oldest first.
    pub logs: HashMap<String, Vec<PathBuf>>,
}

/// Pods of this node by (namespace, name), shared by the pod workers and the endpoint.
#[derive(Debug, Clone, Default)]
pub struct PodDirectory(Arc<Mutex<HashMap<(String, String), PodEntry>>>);

impl PodDirectory {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), PodEntry>> {
        // A panic while holding the lock leaves a plain map; it stays usable.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn insert(&self, namespace: &str, name: &str, entry: PodEntry) {
        self.lock()
            .insert((namespace.to_owned(), name.to_owned()), entry);
    }

    /// Removes the entry if it still belongs to `uid`.
    pub fn remove(&self, namespace: &str, name: &str, uid: &str) {
        let mut map = self.lock();
        let key = (namespace.to_owned(), name.to_owned());
        if map.get(&key).is_some_and(|e| e.uid == uid) {
            map.remove(&key);
        }
    }

    pub fn add_log(&self, namespace: &str, name: &str, container: &str, log: PathBuf) {
        if let Some(e) = self
            .lock()
            .get_mut(&(namespace.to_owned(), name.to_owned()))
        {
            e.logs.entry(container.to_owned()).or_default().push(log);
        }
    }

    pub fn get(&self, namespace: &str, name: &str) -> Option<PodEntry> {
        self.lock()
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }
}

/// The rustls server configuration: our certificate chain and key, client
/// certificates required and checked against `client_ca_pem`.
pub fn tls_acceptor(
    cert_pem: &str,
    key_pem: &str,
    client_ca_pem: &str,
) -> Result<TlsAcceptor, Error> {
    let tls = |what: &str, e: &dyn std::fmt::Display| Error::Tls(format!("{what}: {e}"));
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(client_ca_pem.as_bytes()) {
        let ca = ca.map_err(|e| tls("lab CA certificate", &e))?;
        roots.add(ca).map_err(|e| tls("lab CA certificate", &e))?;
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .map_err(|e| tls("client certificate verifier", &e))?;
    let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| tls("serving certificate", &e))?;
    let key =
        PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|e| tls("serving key", &e))?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| tls("TLS versions", &e))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| tls("serving certificate", &e))?;
    // Upgrades need HTTP/1.1: never agree to h2.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Accepts connections until `shutdown` turns true.
pub async fn serve(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    pods: PodDirectory,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, peer)) => {
                    let acceptor = acceptor.clone();
                    let pods = pods.clone();
                    tokio::spawn(async move {
                        if let Err(e) = connection(tcp, acceptor, pods).await {
                            tracing::debug!(%peer, error = %e, "kubelet endpoint connection ended");
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "kubelet endpoint accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            _ = super::wait_true(&mut shutdown) => return,
        }
    }
}

#[derive(Debug, Clone)]
struct Head {
    method: String,
    path: String,
    query: String,
    headers: Vec<(String, String)>,
}

impl Head {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Parses a request head; Ok(None) when more bytes are needed. Returns the head and
/// its length.
fn parse_head(buf: &[u8]) -> Result<Option<(Head, usize)>, String> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Partial) => Ok(None),
        Ok(httparse::Status::Complete(n)) => {
            let target = req.path.unwrap_or("/");
            let (path, query) = target.split_once('?').unwrap_or((target, ""));
            Ok(Some((
                Head {
                    method: req.method.unwrap_or("").to_owned(),
                    path: path.to_owned(),
                    query: query.to_owned(),
                    headers: req
                        .headers
                        .iter()
                        .map(|h| {
                            (
                                h.name.to_owned(),
                                String::from_utf8_lossy(h.value).into_owned(),
                            )
                        })
                        .collect(),
                },
                n,
            )))
        }
        Err(e) => Err(format!("bad request: {e}")),
    }
}

fn response(code: u16, reason: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

async fn connection(
    tcp: tokio::net::TcpStream,
    acceptor: TlsAcceptor,
    pods: PodDirectory,
) -> Result<(), String> {
    let _ = tcp.set_nodelay(true);
    let (mut tls, head, rest) = tokio::time::timeout(HEAD_TIMEOUT, async {
        let mut tls = acceptor
            .accept(tcp)
            .await
            .map_err(|e| format!("TLS: {e}"))?;
        let mut buf = Vec::with_capacity(4096);
        let mut chunk = [0u8; 4096];
        loop {
            let n = tls.read(&mut chunk).await.map_err(|e| e.to_string())?;
            if n == 0 {
                return Err("closed before the request head".to_owned());
            }
            buf.extend_from_slice(&chunk[..n]);
            if let Some((head, len)) = parse_head(&buf)? {
                let rest = buf.split_off(len);
                return Ok((tls, head, rest));
            }
            if buf.len() > MAX_HEAD {
                return Err("request head too large".to_owned());
            }
        }
    })
    .await
    .map_err(|_| "timed out waiting for the request".to_owned())??;
    tracing::debug!(method = %head.method, path = %head.path, query = %head.query, "kubelet endpoint request");
    let segments: Vec<&str> = head.path.trim_start_matches('/').split('/').collect();
    let reply = |code: u16, reason: &str, body: &str| response(code, reason, body);
    let out = match (head.method.as_str(), segments.as_slice()) {
        ("GET", ["healthz"]) => reply(200, "OK", "ok"),
        ("GET" | "POST", ["portForward", ns, pod] | ["portForward", ns, pod, _]) => {
            return port_forward(tls, head.clone(), ns, pod, rest, &pods).await;
        }
        ("GET", ["containerLogs", ns, pod, container])
            if query_param(&head.query, "follow") == Some("true") =>
        {
            return follow_logs(tls, &pods, ns, pod, container, &head.query).await;
        }
        ("GET", ["containerLogs", ns, pod, container]) => {
            logs(&pods, ns, pod, container, &head.query)
        }
        _ => reply(404, "Not Found", "404 page not found\n"),
    };
    tls.write_all(&out).await.map_err(|e| e.to_string())?;
    let _ = tls.shutdown().await;
    Ok(())
}

async fn port_forward<S>(
    mut io: S,
    head: Head,
    ns: &str,
    pod: &str,
    rest: Vec<u8>,
    pods: &PodDirectory,
) -> Result<(), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let fail = |code: u16, reason: &str, body: String| response(code, reason, &body);
    let upgrade = head.header("upgrade").unwrap_or("");
    if upgrade
        .split(',')
        .any(|u| u.trim().eq_ignore_ascii_case(spdy::UPGRADE))
    {
        return spdy_port_forward(io, head, ns, pod, rest, pods).await;
    }
    let is_ws = upgrade.eq_ignore_ascii_case("websocket");
    let out = if !is_ws {
        Some(fail(
            400,
            "Bad Request",
            format!(
                "port-forward needs an upgrade to websocket (v4.channel.k8s.io) or {} ({}); got {upgrade:?}\n",
                spdy::UPGRADE,
                spdy::PORT_FORWARD_PROTOCOL
            ),
        ))
    } else {
        None
    };
    let ports = match portforward::parse_ports(&head.query) {
        Ok(p) => p,
        Err(e) => {
            let out = out.unwrap_or_else(|| fail(400, "Bad Request", format!("{e}\n")));
            io.write_all(&out).await.map_err(|e| e.to_string())?;
            return Ok(());
        }
    };
    if let Some(out) = out {
        io.write_all(&out).await.map_err(|e| e.to_string())?;
        return Ok(());
    }
    let Some(entry) = pods.get(ns, pod) else {
        let out = fail(
            404,
            "Not Found",
            format!("pod {ns}/{pod} is not running on this node\n"),
        );
        io.write_all(&out).await.map_err(|e| e.to_string())?;
        return Ok(());
    };
    let Some(protocol) = portforward::choose_protocol(head.header("sec-websocket-protocol")) else {
        let out = fail(
            400,
            "Bad Request",
            format!(
                "requested protocol(s) are not supported: {}; supports {:?}\n",
                head.header("sec-websocket-protocol").unwrap_or(""),
                portforward::PROTOCOLS
            ),
        );
        io.write_all(&out).await.map_err(|e| e.to_string())?;
        return Ok(());
    };
    let Some(key) = head.header("sec-websocket-key") else {
        io.write_all(&fail(
            400,
            "Bad Request",
            "missing Sec-WebSocket-Key\n".into(),
        ))
        .await
        .map_err(|e| e.to_string())?;
        return Ok(());
    };
    let mut resp = format!(
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {}\r\n",
        derive_accept_key(key.trim().as_bytes())
    );
    if !protocol.is_empty() {
        resp.push_str(&format!("Sec-WebSocket-Protocol: {protocol}\r\n"));
    }
    resp.push_str("\r\n");
    io.write_all(resp.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    io.flush().await.map_err(|e| e.to_string())?;
    let ws = WebSocketStream::from_partially_read(io, rest, Role::Server, None).await;
    let what = format!("{ns}/{pod}, uid {}", entry.uid);
    tracing::debug!(pod = %what, ?ports, protocol, "port-forward started");
    portforward::serve(ws, entry.netns, what, ports).await;
    Ok(())
}

/// `kubectl port-forward`: the SPDY/3.1 upgrade, then [`spdy::serve`].
async fn spdy_port_forward<S>(
    mut io: S,
    head: Head,
    ns: &str,
    pod: &str,
    rest: Vec<u8>,
    pods: &PodDirectory,
) -> Result<(), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let offered = head
        .headers
        .iter()
        .filter(|(k, _)| k.eq_ignore_ascii_case("x-stream-protocol-version"))
        .map(|(_, v)| v.as_str());
    let protocol = match spdy::negotiate(offered) {
        Ok(p) => p,
        Err(offered) => {
            let body = format!(
                "unable to upgrade: unable to negotiate protocol: client supports [{offered}], server supports [{}]\n",
                spdy::PORT_FORWARD_PROTOCOL
            );
            io.write_all(&response(403, "Forbidden", &body))
                .await
                .map_err(|e| e.to_string())?;
            return Ok(());
        }
    };
    let Some(entry) = pods.get(ns, pod) else {
        let body = format!("pod {ns}/{pod} is not running on this node\n");
        io.write_all(&response(404, "Not Found", &body))
            .await
            .map_err(|e| e.to_string())?;
        return Ok(());
    };
    io.write_all(spdy::upgrade_response(protocol).as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    io.flush().await.map_err(|e| e.to_string())?;
    let what = format!("{ns}/{pod}, uid {}", entry.uid);
    tracing::debug!(pod = %what, "SPDY port-forward started");
    spdy::serve(io, rest, entry.netns, what).await;
    tracing::debug!(pod = %format!("{ns}/{pod}"), "SPDY port-forward ended");
    Ok(())
}

fn query_param<'a>(query: &'a str, name: &str) -> Option<&'a str> {
    query
        .split('&')
        .filter_map(|p| p.split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// The log file a `containerLogs` request asks for, or the error response.
fn log_file(
    pods: &PodDirectory,
    ns: &str,
    pod: &str,
    container: &str,
    query: &str,
) -> Result<PathBuf, Vec<u8>> {
    let Some(entry) = pods.get(ns, pod) else {
        return Err(response(
            404,
            "Not Found",
            &format!("pod {ns}/{pod} is not running on this node\n"),
        ));
    };
    let Some(runs) = entry.logs.get(container) else {
        return Err(response(
            400,
            "Bad Request",
            &format!("container \"{container}\" in pod \"{pod}\" is waiting to start\n"),
        ));
    };
    let previous = query_param(query, "previous") == Some("true");
    let file = if previous {
        runs.len().checked_sub(2).and_then(|i| runs.get(i))
    } else {
        runs.last()
    };
    file.cloned().ok_or_else(|| {
        response(
            400,
            "Bad Request",
            &format!("previous terminated container \"{container}\" in pod \"{pod}\" not found\n"),
        )
    })
}

/// The log text with `tailLines` and `limitBytes` applied.
fn log_text(file: &Path, query: &str) -> Vec<u8> {
    let mut text = std::fs::read(file).unwrap_or_default();
    if let Some(n) = query_param(query, "tailLines").and_then(|v| v.parse::<usize>().ok()) {
        let lines: Vec<&[u8]> = text.split_inclusive(|b| *b == b'\n').collect();
        text = lines[lines.len().saturating_sub(n)..].concat();
    }
    if let Some(n) = query_param(query, "limitBytes").and_then(|v| v.parse::<usize>().ok()) {
        text.truncate(n);
    }
    text
}

fn logs(pods: &PodDirectory, ns: &str, pod: &str, container: &str, query: &str) -> Vec<u8> {
    match log_file(pods, ns, pod, container, query) {
        Ok(file) => response(200, "OK", &String::from_utf8_lossy(&log_text(&file, query))),
        Err(resp) => resp,
    }
}

/// `follow=true`: the log so far, then new lines as they are written, until the
/// container's run ends (a newer log file appears), the pod leaves the node, or the
/// client goes away. The body ends with the connection (no length).
async fn follow_logs<S>(
    io: S,
    pods: &PodDirectory,
    ns: &str,
    pod: &str,
    container: &str,
    query: &str,
) -> Result<(), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (mut rd, mut wr) = tokio::io::split(io);
    let file = match log_file(pods, ns, pod, container, query) {
        Ok(f) => f,
        Err(resp) => return wr.write_all(&resp).await.map_err(|e| e.to_string()),
    };
    let start = log_text(&file, query);
    let mut pos = std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0);
    wr.write_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n\r\n",
    )
    .await
    .map_err(|e| e.to_string())?;
    wr.write_all(&start).await.map_err(|e| e.to_string())?;
    let mut scratch = [0u8; 256];
    loop {
        wr.flush().await.map_err(|e| e.to_string())?;
        tokio::select! {
            _ = tokio::time::sleep(FOLLOW_POLL) => {}
            r = rd.read(&mut scratch) => {
                if matches!(r, Ok(0) | Err(_)) {
                    return Ok(());
                }
            }
        }
        let grown = std::fs::metadata(&file).map(|m| m.len()).unwrap_or(pos);
        if grown > pos {
            let mut f = tokio::fs::File::open(&file)
                .await
                .map_err(|e| e.to_string())?;
            tokio::io::AsyncSeekExt::seek(&mut f, std::io::SeekFrom::Start(pos))
                .await
                .map_err(|e| e.to_string())?;
            let mut more = Vec::new();
            f.read_to_end(&mut more).await.map_err(|e| e.to_string())?;
            pos += more.len() as u64;
            wr.write_all(&more).await.map_err(|e| e.to_string())?;
        }
        let current = pods
            .get(ns, pod)
            .and_then(|e| e.logs.get(container).and_then(|r| r.last().cloned()));
        if current.as_deref() != Some(file.as_path()) {
            let _ = wr.shutdown().await;
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_request_heads() {
        let raw = b"GET /portForward/ns/web-1?port=8080 HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nSec-WebSocket-Protocol: v5.channel.k8s.io, v4.channel.k8s.io\r\n\r\nEXTRA";
        assert!(parse_head(&raw[..20]).expect("partial").is_none());
        let (head, len) = parse_head(raw).expect("ok").expect("complete");
        assert_eq!(&raw[len..], b"EXTRA");
        assert_eq!(head.path, "/portForward/ns/web-1");
        assert_eq!(head.query, "port=8080");
        assert_eq!(head.header("upgrade"), Some("websocket"));
        assert!(parse_head(b"\x00\x01garbage\r\n\r\n").is_err());
    }

    #[test]
    fn log_route_tails_and_picks_runs() {
        let dir = std::env::temp_dir().join(format!("kvpn-kubelet-logs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let (a, b) = (dir.join("c-0.log"), dir.join("c-1.log"));
        std::fs::write(&a, "first run\n").expect("write");
        std::fs::write(&b, "one\ntwo\nthree\n").expect("write");
        let pods = PodDirectory::default();
        pods.insert(
            "ns",
            "p",
            PodEntry {
                uid: "u".into(),
                netns: "n".into(),
                logs: [("c".to_owned(), vec![a, b])].into(),
            },
        );
        let body = |r: Vec<u8>| String::from_utf8(r).expect("utf8");
        assert!(body(logs(&pods, "ns", "p", "c", "tailLines=2")).ends_with("\r\n\r\ntwo\nthree\n"));
        assert!(body(logs(&pods, "ns", "p", "c", "previous=true")).ends_with("first run\n"));
        assert!(body(logs(&pods, "ns", "p", "x", "")).starts_with("HTTP/1.1 400"));
        assert!(body(logs(&pods, "ns", "q", "c", "")).starts_with("HTTP/1.1 404"));
        pods.remove("ns", "p", "other-uid");
        assert!(
            pods.get("ns", "p").is_some(),
            "only the same pod's worker removes it"
        );
        pods.remove("ns", "p", "u");
        assert!(pods.get("ns", "p").is_none());
        std::fs::remove_dir_all(&dir).expect("rm");
    }
}
