//! Worker shards (hello option 3): a manager session started by a hello with a
//! shard answers at once with a stats frame carrying `workers` (the laptop's
//! proof that this manager takes the option) and holds that worker's share of
//! the per-client flow cap; a hello without the option gets no `workers`.

mod common;

use std::time::Duration;

use common::{LAPTOP_V4, session_config, spawn_session};
use kvpn_proto::frame::{self, Decoder, Hello, Kind, PROTOCOL_VERSION, Shard, Stats, stat};
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

fn hello(shard: Option<Shard>, offloads: Option<u8>) -> Vec<u8> {
    let payload = Hello {
        version: PROTOCOL_VERSION,
        tunnel_ip: LAPTOP_V4,
        token: Vec::new(),
        mtu: None,
        tunnel_ip_v6: None,
        offloads,
        shard,
        resume_token: None,
    }
    .encode()
    .expect("hello encodes");
    let mut out = Vec::new();
    frame::encode_into(Kind::Hello, &payload, &mut out).expect("fits");
    out
}

/// The kinds of the frames the manager sends on `pipe`, up to and with the
/// first [`Kind::Hello`] (its answer to offloads).
async fn kinds_until_manager_hello(pipe: &mut DuplexStream) -> Vec<Kind> {
    let mut buf = Vec::new();
    let mut kinds = Vec::new();
    let read = async {
        loop {
            let mut used = 0;
            while let Some((f, n)) = Decoder::default()
                .decode(&buf[used..])
                .expect("valid frames")
            {
                used += n;
                kinds.push(f.kind);
                if f.kind == Kind::Hello {
                    return;
                }
            }
            buf.drain(..used);
            let mut chunk = [0u8; 4096];
            let n = pipe.read(&mut chunk).await.expect("read");
            assert!(n > 0, "the manager closed the session");
            buf.extend_from_slice(&chunk[..n]);
        }
    };
    tokio::time::timeout(Duration::from_secs(2), read)
        .await
        .expect("the manager's hello at once");
    kinds
}

/// The first stats frame the manager sends on `pipe`.
async fn first_stats(pipe: &mut DuplexStream) -> Stats {
    let mut buf = Vec::new();
    let read = async {
        loop {
            let mut used = 0;
            while let Some((f, n)) = Decoder::default()
                .decode(&buf[used..])
                .expect("valid frames")
            {
                used += n;
                if f.kind == Kind::Stats {
                    return Stats::decode(f.payload).expect("stats decode");
                }
            }
            buf.drain(..used);
            let mut chunk = [0u8; 4096];
            let n = pipe.read(&mut chunk).await.expect("read");
            assert!(n > 0, "the manager closed the session");
            buf.extend_from_slice(&chunk[..n]);
        }
    };
    tokio::time::timeout(Duration::from_secs(2), read)
        .await
        .expect("a stats frame at once")
}

#[tokio::test]
async fn sharded_hellos_are_answered_with_workers_and_a_share_of_the_cap() {
    let mut config = session_config();
    config.max_flows = 1000;
    let (mut w0, s0) = spawn_session(config.clone());
    let (mut w1, s1) = spawn_session(config.clone());
    let (mut plain, s2) = spawn_session(config);
    w0.write_all(&hello(Some(Shard { index: 0, count: 2 }), None))
        .await
        .expect("hello 0");
    w1.write_all(&hello(Some(Shard { index: 1, count: 2 }), None))
        .await
        .expect("hello 1");
    plain.write_all(&hello(None, None)).await.expect("hello");
    for (name, pipe) in [("worker 0", &mut w0), ("worker 1", &mut w1)] {
        let stats = first_stats(pipe).await;
        assert_eq!(stats.get(stat::WORKERS), Some(2), "{name}: {stats:?}");
        assert_eq!(stats.get(stat::FLOW_CAP), Some(500), "{name}: half the cap");
    }
    let stats = first_stats(&mut plain).await;
    assert_eq!(stats.get(stat::WORKERS), None, "no option 3, no answer");
    assert_eq!(stats.get(stat::FLOW_CAP), Some(1000), "the whole cap");
    // Both worker sessions live side by side: neither replaced the other.
    assert!(!s0.is_finished() && !s1.is_finished() && !s2.is_finished());
    for s in [s0, s1, s2] {
        s.abort();
    }
}

/// A worker connection that also offers offloads (hello options 3 and 4): the
/// answer to option 3 (a stats frame with the worker count) comes first, then
/// the manager's hello — the laptop reads frames up to the former before its
/// pump starts, and the pump must see the latter to send GSO frames.
#[tokio::test]
async fn sharded_hello_with_offloads_gets_stats_before_the_manager_hello() {
    let (mut w0, s0) = spawn_session(session_config());
    w0.write_all(&hello(
        Some(Shard { index: 0, count: 2 }),
        Some(frame::OFFLOAD_TCP_GSO),
    ))
    .await
    .expect("hello 0");
    let kinds = kinds_until_manager_hello(&mut w0).await;
    assert_eq!(kinds.first(), Some(&Kind::Stats), "{kinds:?}");
    assert_eq!(kinds.last(), Some(&Kind::Hello), "{kinds:?}");
    s0.abort();
}
