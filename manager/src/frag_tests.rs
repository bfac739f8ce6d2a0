//! Unit and property tests of fragment reassembly and fragmentation.

use super::*;
use crate::packet::{self, Parsed};
use proptest::prelude::*;
use std::net::SocketAddr;

fn v4(a: [u8; 4], port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::from(a)), port)
}

fn v6(last: u16, port: u16) -> SocketAddr {
    SocketAddr::new(
        IpAddr::V6(Ipv6Addr::new(0xfd6b, 0x7670, 0x6e00, 0, 0, 0, 0, last)),
        port,
    )
}

fn payload(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
}

fn datagram_v4(n: usize) -> Vec<u8> {
    packet::udp_datagram(
        v4([100, 96, 0, 2], 40000),
        v4([10, 96, 0, 102], 7),
        &payload(n),
    )
    .expect("builds")
}

fn datagram_v6(n: usize) -> Vec<u8> {
    packet::udp_datagram(v6(2, 40000), v6(9, 7), &payload(n)).expect("builds")
}

fn udp_payload(pkt: &[u8]) -> Vec<u8> {
    match packet::parse(pkt) {
        Ok(Parsed::Udp { payload, .. }) => payload.to_vec(),
        other => panic!("not UDP: {other:?}"),
    }
}

fn feed(r: &mut Reassembler, frags: &[Vec<u8>], now: Instant) -> Vec<Reassembly> {
    frags.iter().map(|f| r.push(f, now)).collect()
}

#[test]
fn whole_packets_pass_untouched() {
    let mut r = Reassembler::default();
    assert_eq!(r.push(&datagram_v4(100), Instant::now()), Reassembly::Whole);
    assert_eq!(r.push(&datagram_v6(100), Instant::now()), Reassembly::Whole);
    assert_eq!(r.push(&[], Instant::now()), Reassembly::Whole);
    assert_eq!(r.in_progress(), 0);
}

#[test]
fn large_udp_v4_reassembles_in_any_order() {
    for n in [4000usize, 20_000, 65_507] {
        let whole = datagram_v4(n);
        let mut frags = fragment(whole.clone(), 1500, 77);
        assert!(frags.len() > 1, "{n} bytes must fragment");
        for f in &frags {
            assert!(f.len() <= 1500);
            let ip = Ipv4Packet::new_checked(&f[..]).expect("ipv4");
            assert!(ip.verify_checksum());
            assert!(!ip.dont_frag());
            assert_eq!(ip.ident(), 77);
        }
        frags.reverse();
        let mut r = Reassembler::default();
        let out = feed(&mut r, &frags, Instant::now());
        let (last, rest) = out.split_last().expect("fragments");
        assert!(rest.iter().all(|o| *o == Reassembly::Pending), "{rest:?}");
        let Reassembly::Complete(got) = last else {
            panic!("not complete: {last:?}");
        };
        let ip = Ipv4Packet::new_checked(&got[..]).expect("ipv4");
        assert!(ip.verify_checksum());
        assert!(!ip.more_frags() && ip.frag_offset() == 0);
        assert_eq!(got.len(), whole.len());
        assert_eq!(udp_payload(got), payload(n));
        assert_eq!((r.in_progress(), r.buffered_bytes()), (0, 0));
    }
}

#[test]
fn large_udp_v6_reassembles() {
    let whole = datagram_v6(20_000);
    let frags = fragment(whole.clone(), 1280, 0xdead_beef);
    assert!(frags.len() > 1);
    for f in &frags {
        assert!(f.len() <= 1280);
    }
    let mut r = Reassembler::default();
    let mut out = feed(&mut r, &frags[1..], Instant::now());
    out.push(r.push(&frags[0], Instant::now()));
    let Some(Reassembly::Complete(got)) = out.pop() else {
        panic!("not complete: {out:?}");
    };
    assert_eq!(
        got, whole,
        "IPv6 reassembly restores the packet byte for byte"
    );
}

#[test]
fn atomic_v6_fragment_is_a_whole_packet() {
    let whole = datagram_v6(100);
    // One fragment carrying everything: offset 0, M = 0.
    let mut frag = whole[..40].to_vec();
    frag[6] = 44;
    let len = (whole.len() - 40 + 8) as u16;
    frag[4..6].copy_from_slice(&len.to_be_bytes());
    frag.extend_from_slice(&[17, 0, 0, 0, 0, 0, 0, 1]);
    frag.extend_from_slice(&whole[40..]);
    let mut r = Reassembler::default();
    assert_eq!(r.push(&frag, Instant::now()), Reassembly::Complete(whole));
}

#[test]
fn duplicates_are_ignored_and_overlaps_discard_the_datagram() {
    let frags = fragment(datagram_v4(4000), 1500, 1);
    let mut r = Reassembler::default();
    let now = Instant::now();
    assert_eq!(r.push(&frags[0], now), Reassembly::Pending);
    assert_eq!(r.push(&frags[0], now), Reassembly::Pending, "duplicate");
    // A fragment overlapping the first: same datagram, offset 8.
    let mut overlap = frags[1].clone();
    Ipv4Packet::new_unchecked(&mut overlap[..]).set_frag_offset(8);
    assert_eq!(
        r.push(&overlap, now),
        Reassembly::Dropped(FragDrop::Overlap)
    );
    assert_eq!(r.in_progress(), 0, "the whole datagram is gone");
    // The rest alone never completes.
    assert_eq!(r.push(&frags[1], now), Reassembly::Pending);
    assert_eq!(r.push(&frags[2], now), Reassembly::Pending);
}

#[test]
fn oversized_datagram_is_refused() {
    // Last fragment at offset 65528 with 100 bytes: beyond 65535.
    let frags = fragment(datagram_v4(4000), 1500, 2);
    let mut f = frags[2].clone();
    let mut ip = Ipv4Packet::new_unchecked(&mut f[..]);
    ip.set_frag_offset(65_528);
    ip.fill_checksum();
    let mut r = Reassembler::default();
    assert_eq!(
        r.push(&f, Instant::now()),
        Reassembly::Dropped(FragDrop::Malformed)
    );
    assert_eq!(r.in_progress(), 0);
}

#[test]
fn incomplete_datagram_expires_and_quotes_its_first_fragment() {
    let frags = fragment(datagram_v4(4000), 1500, 3);
    let mut r = Reassembler::default();
    let t0 = Instant::now();
    r.push(&frags[0], t0);
    r.push(&frags[2], t0);
    assert_eq!(r.poll_timeout(), Some(t0 + REASSEMBLY_TIMEOUT_V4));
    assert!(r.handle_timeout(t0 + Duration::from_secs(29)).is_empty());
    let expired = r.handle_timeout(t0 + REASSEMBLY_TIMEOUT_V4);
    assert_eq!(expired.len(), 1);
    let first = expired[0].first.as_ref().expect("first fragment arrived");
    assert_eq!(first.len(), 20 + 8, "header plus 8 bytes (the UDP header)");
    assert_eq!(&first[20..22], &40000u16.to_be_bytes());
    assert_eq!((r.in_progress(), r.buffered_bytes()), (0, 0));
    assert_eq!(r.poll_timeout(), None);

    // Without the first fragment nothing can be quoted.
    r.push(&frags[1], t0);
    let expired = r.handle_timeout(t0 + Duration::from_secs(31));
    assert_eq!(expired, [Expired { first: None }]);
}

#[test]
fn memory_and_datagram_counts_are_bounded() {
    let mut r = Reassembler::default();
    let now = Instant::now();
    // 200 datagrams, each missing its last fragment.
    for i in 0..200u32 {
        let frags = fragment(datagram_v4(20_000), 1500, i);
        for f in &frags[..frags.len() - 1] {
            r.push(f, now);
        }
        assert!(r.in_progress() <= MAX_REASSEMBLIES);
        assert!(r.buffered_bytes() <= MAX_BUFFERED_BYTES);
    }
    // The newest datagrams survived eviction: completing the last one works.
    let frags = fragment(datagram_v4(20_000), 1500, 199);
    let last = frags.last().expect("fragments");
    assert!(matches!(r.push(last, now), Reassembly::Complete(_)));
}

#[test]
fn too_many_tiny_fragments_are_refused() {
    let frags = fragment(datagram_v4(20_000), 28, 5);
    assert!(frags.len() > MAX_FRAGMENTS_PER_DATAGRAM);
    let mut r = Reassembler::default();
    let out = feed(&mut r, &frags, Instant::now());
    assert!(out.contains(&Reassembly::Dropped(FragDrop::Malformed)));
    assert!(!out.iter().any(|o| matches!(o, Reassembly::Complete(_))));
}

#[test]
fn small_packets_and_odd_inputs_are_not_fragmented() {
    let small = datagram_v4(100);
    assert_eq!(fragment(small.clone(), 1500, 1), vec![small.clone()]);
    assert_eq!(fragment(small.clone(), 10, 1), vec![small]);
    assert_eq!(fragment(vec![0x70; 3000], 1500, 1), vec![vec![0x70; 3000]]);
}

#[test]
fn dont_fragment_and_source() {
    let mut p = datagram_v4(10);
    assert!(must_not_fragment(&p), "smoltcp's emitter sets DF");
    Ipv4Packet::new_unchecked(&mut p[..]).set_dont_frag(false);
    assert!(!must_not_fragment(&p));
    assert!(must_not_fragment(&datagram_v6(10)));
    assert!(!must_not_fragment(&[]));
    assert_eq!(source(&p), Some("100.96.0.2".parse().expect("ip")));
    assert_eq!(source(&[0x45, 0]), None);
}

proptest! {
    /// Any split into fragments, in any order, with duplicates, reassembles
    /// to the original datagram.
    #[test]
    fn fragments_in_any_order_reassemble(
        n in 1usize..30_000,
        mtu in 68usize..9000,
        six in any::<bool>(),
        order in proptest::collection::vec(any::<u16>(), 0..64),
        dups in proptest::collection::vec(any::<u16>(), 0..4),
    ) {
        let whole = if six { datagram_v6(n) } else { datagram_v4(n) };
        let mtu = if six { mtu.max(1280) } else { mtu };
        let mut frags = fragment(whole.clone(), mtu, 9);
        prop_assume!(frags.len() <= MAX_FRAGMENTS_PER_DATAGRAM);
        for (i, k) in order.iter().enumerate() {
            let len = frags.len();
            frags.swap(i % len, usize::from(*k) % len);
        }
        // A whole packet twice is two packets; duplicates only of fragments.
        let fragmented = frags.len() > 1;
        for k in dups.into_iter().filter(|_| fragmented) {
            // Right behind its original: a second copy of a whole datagram
            // would (rightly) be delivered twice.
            let i = usize::from(k) % frags.len();
            let f = frags[i].clone();
            frags.insert(i + 1, f);
        }
        let mut r = Reassembler::default();
        let mut done = Vec::new();
        for f in &frags {
            match r.push(f, Instant::now()) {
                Reassembly::Complete(p) => done.push(p),
                Reassembly::Whole => done.push(f.clone()),
                Reassembly::Pending => {}
                Reassembly::Dropped(d) => prop_assert!(false, "dropped: {d:?}"),
            }
        }
        prop_assert_eq!(done.len(), 1);
        prop_assert_eq!(udp_payload(&done[0]), payload(n));
        // A duplicate arriving after completion starts a datagram that only
        // times out (as in Linux); nothing else is left.
        let _ = r.handle_timeout(Instant::now() + REASSEMBLY_TIMEOUT_V6);
        prop_assert_eq!((r.in_progress(), r.buffered_bytes()), (0, 0));
    }

    /// Random bytes and random fragment headers never panic, and the memory
    /// bounds hold throughout.
    #[test]
    fn arbitrary_fragments_never_panic(steps in proptest::collection::vec((
        any::<bool>(),
        any::<u8>(),
        0u16..8192,
        any::<bool>(),
        proptest::collection::vec(any::<u8>(), 0..600),
        0u64..40_000,
    ), 0..80)) {
        let mut r = Reassembler::default();
        let t0 = Instant::now();
        let mut now = t0;
        for (six, ident, off8, more, body, advance_ms) in steps {
            let pkt = if six {
                let mut p = datagram_v6(0)[..40].to_vec();
                p[6] = 44;
                let len = (8 + body.len()) as u16;
                p[4..6].copy_from_slice(&len.to_be_bytes());
                let off_m = (off8 << 3) | u16::from(more);
                p.extend_from_slice(&[17, 0]);
                p.extend_from_slice(&off_m.to_be_bytes());
                p.extend_from_slice(&u32::from(ident % 4).to_be_bytes());
                p.extend_from_slice(&body);
                p
            } else {
                let mut p = datagram_v4(body.len());
                let mut ip = Ipv4Packet::new_unchecked(&mut p[..]);
                ip.set_ident(u16::from(ident % 4));
                ip.set_more_frags(more);
                ip.set_frag_offset(off8 << 3);
                let n = p.len() - 20;
                p[20..].copy_from_slice(&[&[0u8; 8][..], &body].concat()[..n]);
                p
            };
            let _ = r.push(&pkt, now);
            let _ = r.push(&body, now);
            prop_assert!(r.in_progress() <= MAX_REASSEMBLIES);
            prop_assert!(r.buffered_bytes() <= MAX_BUFFERED_BYTES);
            now += Duration::from_millis(advance_ms);
            let _ = r.handle_timeout(now);
        }
        let _ = r.handle_timeout(now + REASSEMBLY_TIMEOUT_V6);
        prop_assert_eq!((r.in_progress(), r.buffered_bytes()), (0, 0));
    }
}
