//! Floods ([hardening] item 3) end to end on the Kubernetes lab: a laptop
//! flooding SYNs to a closed port is rate-limited by the traffic manager
//! (counted in its `session stats` log) and a second laptop's echo throughput
//! under that flood stays at >= 0.8x its own baseline measured in the same test
//! (ratio, best of five interleaved rounds each).
//!
//! Needs the workspace binaries (`cargo build --bins`, then `KVPN_BIN_DIR`) and the
//! Kubernetes binaries of `scripts/build-kubernetes.sh`.

use std::net::{SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, LogParams};
use kvpn_lab::{BACKEND_1_IP, ECHO_CLUSTER_IP, ECHO_SERVICE_PORT};
use kvpn_tests::kube_lab::{KubeFixture, MANAGER_NAMESPACE, pod_name};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// SYNs per millisecond of the flood.
const FLOOD_PER_MS: usize = 3;

/// Raise this process's open-files soft limit to the hard one (3000 sockets).
fn raise_fd_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls on a struct we own.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = lim.rlim_max;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
    lim.rlim_cur
}

/// The manager pod's log (through the API server and the kubelet stand-in).
fn manager_log(f: &KubeFixture) -> String {
    let pods = f.manager_pods();
    let pod = pods
        .first()
        .unwrap_or_else(|| panic!("no manager pod\n{}", f.diagnostics()));
    let api: Api<Pod> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    f.block_on(api.logs(&pod_name(pod), &LogParams::default()))
        .unwrap_or_else(|e| panic!("manager log: {e}"))
}

/// The largest value of `key=<n>` over the manager log's `session stats` lines.
fn stat_max(log: &str, key: &str) -> u64 {
    let needle = format!(" {key}=");
    log.lines()
        .filter(|l| l.contains("session stats"))
        .filter_map(|l| {
            let rest = &l[l.find(&needle)? + needle.len()..];
            rest.split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .max()
        .unwrap_or(0)
}

/// Echo throughput from laptop `run` for `dur`: bytes echoed back.
fn echo_throughput<R>(run: R, dur: Duration) -> u64
where
    R: FnOnce(Box<dyn FnOnce() -> Result<u64, String> + Send>) -> Result<u64, String>,
{
    let job: Box<dyn FnOnce() -> Result<u64, String> + Send> = Box::new(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("runtime: {e}"))?;
        rt.block_on(async move {
            let echo = SocketAddr::V4(SocketAddrV4::new(ECHO_CLUSTER_IP, ECHO_SERVICE_PORT));
            let s = tokio::net::TcpStream::connect(echo)
                .await
                .map_err(|e| format!("connect {echo}: {e}"))?;
            let (mut rd, mut wr) = s.into_split();
            let stop = Instant::now() + dur;
            let writer = tokio::spawn(async move {
                let chunk = vec![0x5au8; 64 * 1024];
                while Instant::now() < stop {
                    if wr.write_all(&chunk).await.is_err() {
                        break;
                    }
                }
                let _ = wr.shutdown().await;
            });
            let mut buf = vec![0u8; 256 * 1024];
            let mut got = 0u64;
            loop {
                match tokio::time::timeout(Duration::from_secs(10), rd.read(&mut buf)).await {
                    Ok(Ok(0)) => break,
                    Ok(Ok(n)) => {
                        if Instant::now() <= stop {
                            got += n as u64;
                        }
                    }
                    Ok(Err(e)) => return Err(format!("read: {e}")),
                    Err(_) => return Err("echo stalled for 10 s".into()),
                }
            }
            let _ = writer.await;
            Ok(got)
        })
    });
    run(job).unwrap_or_else(|e| panic!("echo throughput: {e}"))
}

/// Best of the rounds: other load on this shared machine only ever lowers a
/// round's throughput, so the best round is the least disturbed estimate of
/// each side (at ~8500 SYN/s the best flooded round was 0.67 of the best
/// baseline, so this still fails when the flood hurts).
fn best(v: &[u64]) -> u64 {
    v.iter().copied().max().unwrap_or(0)
}

#[test]
fn syn_flood_is_rate_limited_without_hurting_another_laptop() {
    raise_fd_limit();
    let mut f = KubeFixture::new();
    f.connect_restricted();
    f.wait_state("connected", Duration::from_secs(20));
    f.add_laptop("laptop2");
    let l2 = f.laptop_of("laptop2");
    l2.connect_restricted();
    let t0 = Instant::now();
    while !l2.sessions().iter().any(|s| s["state"] == "connected") {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "laptop2 not connected\n{}",
            l2.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // The flood: laptop 1 opens ~3000 connections per second (3x the manager's
    // sustained new-flow rate) to a closed port of a backend pod, each given up
    // after 200 ms (before the kernel's SYN retransmit), while `flooding` is
    // set. Faster floods mostly measure this one machine's CPU: at ~8500 SYN/s
    // laptop 1's own agent (its port-forward relay) and the generator used
    // more CPU than the manager, which no manager-side limit can give back.
    let flooding = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let (fl, st, se) = (flooding.clone(), stop.clone(), sent.clone());
    let netns = f.lab().netns_lab().laptop_netns().name().to_owned();
    let flooder = std::thread::spawn(move || {
        kvpn_lab::run_in_netns(&netns, move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap_or_else(|e| panic!("runtime: {e}"));
            rt.block_on(async move {
                let closed = SocketAddr::V4(SocketAddrV4::new(BACKEND_1_IP, 9));
                let mut tick = tokio::time::interval(Duration::from_millis(1));
                while !st.load(Ordering::Relaxed) {
                    tick.tick().await;
                    if !fl.load(Ordering::Relaxed) {
                        continue;
                    }
                    for _ in 0..FLOOD_PER_MS {
                        se.fetch_add(1, Ordering::Relaxed);
                        tokio::spawn(async move {
                            let _ = tokio::time::timeout(
                                Duration::from_millis(200),
                                tokio::net::TcpStream::connect(closed),
                            )
                            .await;
                        });
                    }
                }
            });
        })
        .unwrap_or_else(|e| panic!("flooder netns: {e:#}"));
    });

    // Spend the new-flow bucket's burst first, so the limit bites in every
    // flood round.
    flooding.store(true, Ordering::Relaxed);
    std::thread::sleep(Duration::from_secs(3));
    // Interleaved rounds, so load from elsewhere on the machine hits both sides.
    let round = Duration::from_millis(1200);
    let (mut base, mut flood) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        flooding.store(false, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(300));
        base.push(echo_throughput(|job| l2.run(job), round));
        flooding.store(true, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(300));
        flood.push(echo_throughput(|job| l2.run(job), round));
    }
    stop.store(true, Ordering::Relaxed);
    flooder
        .join()
        .unwrap_or_else(|_| panic!("flooder panicked"));
    let (b, fl) = (best(&base), best(&flood));
    let ratio = fl as f64 / b.max(1) as f64;
    eprintln!(
        "flood: {} SYNs from laptop 1; laptop 2 echo {:.1} MB/s baseline, {:.1} MB/s under flood (ratio {ratio:.2}); rounds base {base:?} flood {flood:?}",
        sent.load(Ordering::Relaxed),
        b as f64 / round.as_secs_f64() / 1e6,
        fl as f64 / round.as_secs_f64() / 1e6,
    );
    assert!(b > 0, "no baseline throughput");

    // The flood was limited: the manager's session stats count it (session end
    // logs the final counters).
    f.kvpn_ok(&["disconnect"]);
    let deadline = Instant::now() + Duration::from_secs(15);
    let log = loop {
        let log = manager_log(&f);
        if stat_max(&log, "rate_limited") > 0 || Instant::now() > deadline {
            break log;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let limited = stat_max(&log, "rate_limited");
    eprintln!("flood: manager rate-limited {limited} new flows");
    assert!(
        limited > 0,
        "the SYN flood was not rate-limited:\n{}",
        log.lines()
            .filter(|l| l.contains("session stats"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        ratio >= 0.8,
        "laptop 2's throughput under laptop 1's SYN flood is {ratio:.2} of its baseline (< 0.8)"
    );
}
