//! Resuming a worker connection's engine after a re-dial (hello option 5,
//! `kvpn_manager::resume`): a scripted laptop (smoltcp) downloads from a real
//! server on loopback through a real manager session; its data connection
//! breaks and it re-dials. With the same resume token the download goes on
//! intact; with another token it gets a fresh engine, the parked one is left
//! alone and expires after the grace period, resetting its connection.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use common::{LAPTOP_V4, Laptop, hello_frame_resumable, pattern, session_config};
use kvpn_manager::metrics::ManagerCounters;
use kvpn_manager::resume::Resumes;
use kvpn_manager::session::SessionConfig;
use kvpn_proto::frame::{Kind, PROTOCOL_VERSION, ResumeAnswer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

const TOKEN: [u8; 16] = [0x5a; 16];
const OTHER_TOKEN: [u8; 16] = [0xa5; 16];

fn config(grace: Duration) -> (SessionConfig, Arc<ManagerCounters>) {
    let counters = Arc::new(ManagerCounters::default());
    let config = SessionConfig {
        counters: counters.clone(),
        resumes: Resumes::new(grace, 16),
        ..session_config()
    };
    (config, counters)
}

fn metric(counters: &ManagerCounters, name: &str) -> u64 {
    let text = counters.render_prometheus();
    let prefix = format!("kvpn_manager_{name} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} not rendered:\n{text}"))
}

/// A server that sends `total` bytes of [`pattern`] in `chunk`-byte writes
/// `pause` apart, then reads until the peer goes away; reports how its
/// connection ended (`Ok(bytes read)` on EOF, `Err` on a reset).
async fn slow_sender(
    total: usize,
    chunk: usize,
    pause: Duration,
) -> (SocketAddr, oneshot::Receiver<Result<usize, String>>) {
    let listener = TcpListener::bind(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0))
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = oneshot::channel();
    tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.expect("accept");
        let data = pattern(total, 3);
        let mut ended = None;
        for part in data.chunks(chunk) {
            if let Err(e) = conn.write_all(part).await {
                ended = Some(Err(e.to_string()));
                break;
            }
            tokio::time::sleep(pause).await;
        }
        let ended = match ended {
            Some(e) => e,
            None => {
                let mut buf = vec![0u8; 4096];
                let mut n = 0;
                loop {
                    match conn.read(&mut buf).await {
                        Ok(0) => break Ok(n),
                        Ok(k) => n += k,
                        Err(e) => break Err(e.to_string()),
                    }
                }
            }
        };
        let _ = tx.send(ended);
    });
    (addr, rx)
}

/// The answers to hello option 5 the laptop has read so far.
fn resume_answers(laptop: &Laptop) -> Vec<Option<ResumeAnswer>> {
    laptop
        .other_frames
        .iter()
        .filter(|(k, _)| *k == Kind::Resume)
        .map(|(_, p)| ResumeAnswer::decode(p))
        .collect()
}

/// Step the laptop, moving what `h` received into `got`, until `done`.
async fn receive_until(
    laptop: &mut Laptop,
    h: smoltcp::iface::SocketHandle,
    got: &mut Vec<u8>,
    timeout: Duration,
    done: impl Fn(&[u8], &Laptop) -> bool,
) -> bool {
    laptop
        .run_until(timeout, |l| {
            let s = l.tcp(h);
            common::drain(s, got);
            done(got, l)
        })
        .await
}

/// A laptop with `token` (hello option 5) connected to a manager with
/// `config`, with one TCP connection from local port `port` to `server`
/// that received at least `want` bytes.
async fn downloading(
    config: &SessionConfig,
    token: Option<[u8; 16]>,
    server: SocketAddr,
    port: u16,
    rx_buffer: usize,
    want: usize,
) -> (Laptop, smoltcp::iface::SocketHandle, Vec<u8>) {
    let hello = hello_frame_resumable(LAPTOP_V4, PROTOCOL_VERSION, token);
    let mut laptop = Laptop::connect_with(LAPTOP_V4, config.clone(), &hello).await;
    let h = laptop.tcp_socket(rx_buffer, 16 * 1024);
    laptop.connect_tcp(h, server, port);
    let mut got = Vec::new();
    assert!(
        receive_until(&mut laptop, h, &mut got, Duration::from_secs(10), |g, _| g
            .len()
            >= want)
        .await,
        "the download started: {} of {want} bytes",
        got.len()
    );
    (laptop, h, got)
}

/// Step the laptop every `step` until the server's connection ended (its
/// result: bytes it sent after the laptop's close, or its error), within `timeout`.
async fn server_end(
    laptop: &mut Laptop,
    ended: &mut oneshot::Receiver<Result<usize, String>>,
    step: Duration,
    timeout: Duration,
) -> Result<usize, String> {
    tokio::time::timeout(timeout, async {
        loop {
            laptop.step(step).await;
            match ended.try_recv() {
                Ok(r) => break r,
                Err(oneshot::error::TryRecvError::Empty) => {}
                Err(e) => panic!("server task gone: {e}"),
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the server's connection did not end within {timeout:?}"))
}

#[tokio::test]
async fn download_survives_a_redial_with_the_same_resume_token() {
    // 1 MiB in 16 KiB writes 10 ms apart: about 0.65 s of download.
    let total = 1 << 20;
    let (server, ended) = slow_sender(total, 16 * 1024, Duration::from_millis(10)).await;
    let (config, counters) = config(Duration::from_secs(30));
    let (mut laptop, h, mut got) =
        downloading(&config, Some(TOKEN), server, 40100, 256 * 1024, 100_000).await;
    let hello = hello_frame_resumable(LAPTOP_V4, PROTOCOL_VERSION, Some(TOKEN));
    assert_eq!(resume_answers(&laptop), [Some(ResumeAnswer::New)]);

    // The data connection breaks mid-download; the laptop re-dials at once.
    laptop.redial(config.clone(), &hello).await;
    assert!(
        receive_until(&mut laptop, h, &mut got, Duration::from_secs(20), |g, _| g
            .len()
            >= total)
        .await,
        "the download went on after the re-dial: {} of {total} bytes",
        got.len()
    );
    assert!(
        got == pattern(total, 3),
        "the bytes arrived intact and in order"
    );
    assert_eq!(
        resume_answers(&laptop),
        [Some(ResumeAnswer::New), Some(ResumeAnswer::Resumed)]
    );
    assert_eq!(metric(&counters, "engines_parked_total"), 1);
    assert_eq!(metric(&counters, "engines_resumed_total"), 1);
    assert_eq!(metric(&counters, "engines_expired_total"), 0);
    assert_eq!(metric(&counters, "engines_parked"), 0);

    // The laptop closes; the server sees an orderly end, not a reset.
    laptop.tcp(h).close();
    let mut ended = ended;
    let result = server_end(
        &mut laptop,
        &mut ended,
        Duration::from_millis(5),
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(result, Ok(0), "the server saw EOF, not a reset");
}

#[tokio::test]
async fn a_wrong_token_gets_a_fresh_engine_and_the_parked_one_expires() {
    let grace = Duration::from_millis(1500);
    // 64 KiB at once, then the server waits for the laptop.
    let (server, mut ended) = slow_sender(64 * 1024, 64 * 1024, Duration::ZERO).await;
    let (config, counters) = config(grace);
    let (mut laptop, _h, _got) =
        downloading(&config, Some(TOKEN), server, 40101, 256 * 1024, 64 * 1024).await;

    // Another laptop process (another token) re-dials as this tunnel IP.
    laptop
        .redial(
            config.clone(),
            &hello_frame_resumable(LAPTOP_V4, PROTOCOL_VERSION, Some(OTHER_TOKEN)),
        )
        .await;
    assert!(
        laptop
            .run_until(Duration::from_secs(5), |l| resume_answers(l).len() == 2)
            .await,
        "the manager answered the second hello"
    );
    assert_eq!(
        resume_answers(&laptop),
        [Some(ResumeAnswer::New), Some(ResumeAnswer::New)],
        "a wrong token never resumes"
    );
    // The parked engine is untouched: still parked, its connection to the
    // server still open.
    assert_eq!(metric(&counters, "engines_parked"), 1);
    assert_eq!(metric(&counters, "engines_resumed_total"), 0);
    assert!(
        matches!(ended.try_recv(), Err(oneshot::error::TryRecvError::Empty)),
        "the parked engine's connection to the server is still open"
    );

    // The grace period ends: the parked engine is dropped and its connection
    // to the server reset.
    let result = server_end(
        &mut laptop,
        &mut ended,
        Duration::from_millis(20),
        grace + Duration::from_secs(5),
    )
    .await;
    assert!(
        result.is_err() || result == Ok(0),
        "the server's connection ended: {result:?}"
    );
    assert_eq!(metric(&counters, "engines_parked"), 0);
    assert_eq!(metric(&counters, "engines_expired_total"), 1);
    assert_eq!(metric(&counters, "engines_resumed_total"), 0);

    // The right token now finds nothing to resume.
    laptop
        .redial(
            config.clone(),
            &hello_frame_resumable(LAPTOP_V4, PROTOCOL_VERSION, Some(TOKEN)),
        )
        .await;
    assert!(
        laptop
            .run_until(Duration::from_secs(5), |l| resume_answers(l).len() == 3)
            .await
    );
    assert_eq!(resume_answers(&laptop)[2], Some(ResumeAnswer::New));
}

#[tokio::test]
async fn a_laptop_that_says_it_is_leaving_is_not_parked() {
    let (server, ended) = slow_sender(8 * 1024, 8 * 1024, Duration::ZERO).await;
    let (config, counters) = config(Duration::from_secs(30));
    let (mut laptop, _h, _got) =
        downloading(&config, Some(TOKEN), server, 40103, 64 * 1024, 8 * 1024).await;
    // Disconnect: frame kind 6 "leaving", then the laptop hangs up.
    let mut bye = Vec::new();
    kvpn_proto::frame::encode_into(Kind::Resume, &[ResumeAnswer::Leaving.to_u8()], &mut bye)
        .expect("fits");
    laptop.send_raw(&bye).await;
    laptop.finish().await;
    let result = tokio::time::timeout(Duration::from_secs(5), ended)
        .await
        .expect("the engine's connection ended at once")
        .expect("server reported");
    assert!(result.is_err() || result == Ok(0), "{result:?}");
    assert_eq!(metric(&counters, "engines_parked_total"), 0);
    assert_eq!(metric(&counters, "engines_parked"), 0);
    // And the same token finds nothing to resume.
    let mut laptop = Laptop::connect_with(
        LAPTOP_V4,
        config,
        &hello_frame_resumable(LAPTOP_V4, PROTOCOL_VERSION, Some(TOKEN)),
    )
    .await;
    assert!(
        laptop
            .run_until(Duration::from_secs(5), |l| !resume_answers(l).is_empty())
            .await
    );
    assert_eq!(resume_answers(&laptop), [Some(ResumeAnswer::New)]);
}

#[tokio::test]
async fn without_a_token_nothing_is_parked() {
    let (server, mut ended) = slow_sender(8 * 1024, 8 * 1024, Duration::ZERO).await;
    let (config, counters) = config(Duration::from_secs(30));
    let (mut laptop, _h, _got) =
        downloading(&config, None, server, 40102, 64 * 1024, 8 * 1024).await;
    laptop
        .redial(
            config.clone(),
            &hello_frame_resumable(LAPTOP_V4, PROTOCOL_VERSION, None),
        )
        .await;
    // Without a token the old engine is dropped at once, resetting its
    // connection; no resume answer is ever sent.
    let result = server_end(
        &mut laptop,
        &mut ended,
        Duration::from_millis(20),
        Duration::from_secs(5),
    )
    .await;
    assert!(result.is_err() || result == Ok(0), "{result:?}");
    assert!(resume_answers(&laptop).is_empty());
    assert_eq!(metric(&counters, "engines_parked_total"), 0);
}

/// A hello with lease token `lease` and resume token `resume` (worker 0).
fn leased_hello(ip: IpAddr, lease: &str, resume: [u8; 16]) -> Vec<u8> {
    let hello = kvpn_proto::frame::Hello {
        token: lease.as_bytes().to_vec(),
        resume_token: Some(resume),
        ..kvpn_proto::frame::Hello::new(PROTOCOL_VERSION, ip)
    }
    .encode()
    .expect("hello encodes");
    let mut out = Vec::new();
    kvpn_proto::frame::encode_into(Kind::Hello, &hello, &mut out).expect("fits");
    out
}

/// Step `laptop` until it has read `n` resume answers; they.
async fn answers(laptop: &mut Laptop, n: usize) -> Vec<Option<ResumeAnswer>> {
    assert!(
        laptop
            .run_until(Duration::from_secs(5), |l| resume_answers(l).len() >= n)
            .await,
        "the manager answered hello number {n}: {:?}",
        resume_answers(laptop)
    );
    resume_answers(laptop)
}

/// The tester's case: session A's engine is parked for (tunnel IP, worker 0)
/// when A's lease expires and the `Lease` call of another client takes the
/// same IP (the call expires A's lease itself, before the manager's periodic
/// round). Session B's worker 0 must then park and resume normally instead
/// of being answered "new" until A's engine's grace runs out; A's engine is
/// dropped (its connection to the server reset). Then B's laptop starts a
/// new session on the same lease (another resume token): B's parked engine
/// gives way too. On main, B's re-dial was answered "new" (A's engine held
/// the slot for the 30 s grace).
#[tokio::test]
async fn a_new_session_of_the_tunnel_ip_replaces_a_finished_sessions_parked_engine() {
    use kvpn_manager::lease::LeaseTable;
    use kvpn_manager::leases::Leases;

    let leases = Leases::in_memory(LeaseTable::new(
        "100.96.0.0/16".parse().expect("pool"),
        Duration::from_secs(1),
    ));
    let (counters_config, counters) = config(Duration::from_secs(30));
    let config = SessionConfig {
        leases: Some(leases.clone()),
        tunnel_pool: Some("100.96.0.0/16".parse().expect("pool")),
        ..counters_config
    };
    let (a, _) = leases.lease("client-a").await.expect("lease a");
    let ip = IpAddr::V4(a.ip);

    // Session A downloads, then its connection breaks: its engine parks.
    let (server, mut a_ended) = slow_sender(64 * 1024, 64 * 1024, Duration::ZERO).await;
    let mut laptop_a =
        Laptop::connect_with(ip, config.clone(), &leased_hello(ip, &a.token, TOKEN)).await;
    let h = laptop_a.tcp_socket(256 * 1024, 16 * 1024);
    laptop_a.connect_tcp(h, server, 40104);
    let mut got = Vec::new();
    assert!(
        receive_until(
            &mut laptop_a,
            h,
            &mut got,
            Duration::from_secs(10),
            |g, _| g.len() >= 64 * 1024
        )
        .await,
        "session A's download arrived: {} bytes",
        got.len()
    );
    laptop_a.hang_up().await;
    let parked = tokio::time::timeout(Duration::from_secs(5), async {
        while metric(&counters, "engines_parked") == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(parked.is_ok(), "session A's engine parked");

    // A's lease runs out (1 s after its data channel ended; whole seconds);
    // client B's Lease call gets the same IP with its own token.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let (b, _) = leases.lease("client-b").await.expect("lease b");
    assert_eq!(b.ip, a.ip, "the pool's first address again");
    assert_ne!(b.token, a.token);

    // B's worker 0 connects; A's engine goes at once (its connection to the
    // server is reset, checked below).
    let mut laptop_b =
        Laptop::connect_with(ip, config.clone(), &leased_hello(ip, &b.token, OTHER_TOKEN)).await;
    assert_eq!(answers(&mut laptop_b, 1).await, [Some(ResumeAnswer::New)]);

    // B's connection breaks and B re-dials with its token: resumed.
    laptop_b
        .redial(config.clone(), &leased_hello(ip, &b.token, OTHER_TOKEN))
        .await;
    assert_eq!(
        answers(&mut laptop_b, 2).await,
        [Some(ResumeAnswer::New), Some(ResumeAnswer::Resumed)],
        "B's re-dial resumed B's engine"
    );
    assert_eq!(metric(&counters, "engines_resumed_total"), 1);
    assert_eq!(metric(&counters, "engines_replaced_total"), 1);
    let result = server_end(
        &mut laptop_b,
        &mut a_ended,
        Duration::from_millis(20),
        Duration::from_secs(5),
    )
    .await;
    assert!(
        result.is_err() || result == Ok(0),
        "A's connection to the server ended with A's engine: {result:?}"
    );

    // B's laptop starts a new session on the same lease (a new resume
    // token) while the manager still runs the old connection: the new
    // session takes the slot and re-dials resume it.
    let third = [0x33; 16];
    laptop_b
        .redial(config.clone(), &leased_hello(ip, &b.token, third))
        .await;
    assert_eq!(answers(&mut laptop_b, 3).await[2], Some(ResumeAnswer::New));
    laptop_b
        .redial(config.clone(), &leased_hello(ip, &b.token, third))
        .await;
    assert_eq!(
        answers(&mut laptop_b, 4).await[3],
        Some(ResumeAnswer::Resumed),
        "the newest session's re-dial resumed"
    );
    assert_eq!(metric(&counters, "engines_resumed_total"), 2);
}
