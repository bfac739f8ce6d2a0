//! Another VPN's endpoint is never captured (issue 29 item 3). A wg-quick-style
//! VPN on the laptop: `ip rule not fwmark 0xca6c lookup 51820` with a default
//! route through its own device in table 51820, `ip rule lookup main
//! suppress_prefixlength 0`, and its own UDP socket (marked 0xca6c, as
//! wireguard-go's) connected to its endpoint, which lies inside the pod CIDR.
//! Before the fix kvpn's pod route won in the main table and the VPN's own
//! packets went into the TUN device, with no word from connect or status.
//!
//! Also: a nameserver inside the pod CIDR, which kvpn always split the pod
//! route around (rt-02), is now shown as kept off the tunnel.

use std::process::{Child, ChildStdin, Command, Stdio};

use kvpn_tests::kube_lab::KubeFixture;
use kvpn_tests::text;

/// wg-quick's default mark and table (51820 = 0xca6c).
const MARK: &str = "0xca6c";
const TABLE: &str = "51820";
/// The other VPN's endpoint and a nameserver of the laptop, both inside the
/// lab's node pod CIDR 10.244.1.0/24 (no pod has them).
const ENDPOINT: &str = "10.244.1.250";
const NAMESERVER: &str = "10.244.1.253";
/// A pod-CIDR address that is neither: must still go through kvpn.
const POD_SIDE: &str = "10.244.1.77";

fn laptop_ok(f: &KubeFixture, args: &[&str]) -> String {
    let out = f.laptop(args);
    assert!(
        out.status.success(),
        "laptop {args:?}: {}",
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// The device `ip route get <args>` names.
fn route_dev(f: &KubeFixture, args: &[&str]) -> String {
    let mut cmd = vec!["ip", "route", "get"];
    cmd.extend_from_slice(args);
    let out = laptop_ok(f, &cmd);
    out.split_whitespace()
        .skip_while(|w| *w != "dev")
        .nth(1)
        .unwrap_or_default()
        .to_owned()
}

/// The other VPN's own socket: socat with SO_MARK (setsockopt level 1 =
/// SOL_SOCKET, 36 = SO_MARK) connected to the endpoint, in the laptop netns.
/// Killed (by its pid) on drop.
struct VpnSocket {
    child: Child,
    _stdin: ChildStdin,
}

impl VpnSocket {
    fn start(f: &KubeFixture) -> Self {
        let mut cmd: Command = f.lab().netns_lab().laptop_netns().command("socat");
        cmd.args([
            "-u",
            "-",
            &format!("UDP:{ENDPOINT}:51820,setsockopt-int=1:36:51820"),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::null());
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn socat: {e}"));
        let stdin = child.stdin.take().unwrap_or_else(|| panic!("socat stdin"));
        VpnSocket {
            child,
            _stdin: stdin,
        }
    }
}

impl Drop for VpnSocket {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn another_vpns_endpoint_and_a_nameserver_inside_the_pod_cidr_stay_off_the_tunnel() {
    let f = KubeFixture::new();
    let id = f.lab().netns_lab().id().to_owned();
    // The laptop's way out before any VPN: a default route through an
    // "internet" link (metric 900: after any default the lab has).
    let (inet, inet_peer) = (format!("kv{id}in"), format!("kv{id}ip"));
    laptop_ok(
        &f,
        &[
            "ip", "link", "add", &inet, "type", "veth", "peer", "name", &inet_peer,
        ],
    );
    for dev in [&inet, &inet_peer] {
        laptop_ok(&f, &["ip", "link", "set", dev, "up"]);
    }
    laptop_ok(&f, &["ip", "addr", "add", "198.51.100.1/24", "dev", &inet]);
    laptop_ok(
        &f,
        &[
            "ip",
            "route",
            "add",
            "default",
            "via",
            "198.51.100.2",
            "dev",
            &inet,
            "metric",
            "900",
        ],
    );
    // wg-quick: the VPN's device, its table with a default route, its rules.
    let (vpn, vpn_peer) = (format!("kv{id}wg"), format!("kv{id}wp"));
    laptop_ok(
        &f,
        &[
            "ip", "link", "add", &vpn, "type", "veth", "peer", "name", &vpn_peer,
        ],
    );
    for dev in [&vpn, &vpn_peer] {
        laptop_ok(&f, &["ip", "link", "set", dev, "up"]);
    }
    laptop_ok(&f, &["ip", "addr", "add", "100.64.77.2/32", "dev", &vpn]);
    laptop_ok(
        &f,
        &["ip", "route", "add", "default", "dev", &vpn, "table", TABLE],
    );
    laptop_ok(
        &f,
        &[
            "ip", "rule", "add", "not", "fwmark", MARK, "table", TABLE, "pref", "32765",
        ],
    );
    laptop_ok(
        &f,
        &[
            "ip",
            "rule",
            "add",
            "table",
            "main",
            "suppress_prefixlength",
            "0",
            "pref",
            "32764",
        ],
    );
    let _socket = VpnSocket::start(&f);
    // A nameserver of the laptop inside the pod CIDR (after the lab's own).
    let resolv = f.laptop_resolv_conf();
    let mut conf = std::fs::read_to_string(&resolv)
        .unwrap_or_else(|e| panic!("read {}: {e}", resolv.display()));
    conf.push_str(&format!("nameserver {NAMESERVER}\n"));
    std::fs::write(&resolv, conf).unwrap_or_else(|e| panic!("write {}: {e}", resolv.display()));

    // Precondition: the VPN's marked packets leave through the internet link.
    let before = route_dev(&f, &[ENDPOINT, "mark", MARK]);
    assert_eq!(before, inet, "before connect the endpoint goes out {inet}");
    // The nameserver goes where the laptop sends it (here: into the other VPN).
    let ns_before = route_dev(&f, &[NAMESERVER]);
    // Wait until socat's socket exists (it is what names the endpoint).
    kvpn_tests::kube_lab::retry_until(
        "the VPN's marked socket",
        std::time::Duration::from_secs(10),
        std::time::Duration::from_millis(100),
        || {
            let ss = laptop_ok(&f, &["ss", "-uanH", "dst", &format!("{ENDPOINT}:51820")]);
            if ss.contains(ENDPOINT) {
                Ok(())
            } else {
                Err(ss)
            }
        },
        || f.diagnostics(),
    );

    let kubeconfig = f.user_kubeconfig();
    let said = f.kvpn_ok(&[
        "connect",
        "--kubeconfig",
        &kubeconfig,
        "--namespace",
        "default",
    ]);
    let session = f.session();
    let tun = session["tun_name"].as_str().unwrap_or_default().to_owned();
    assert!(!tun.is_empty(), "{session:#}");

    // The VPN's own packets still leave the way they did; the pod CIDR otherwise
    // goes through kvpn.
    assert_eq!(
        route_dev(&f, &[ENDPOINT, "mark", MARK]),
        before,
        "the other VPN's endpoint {ENDPOINT} (marked {MARK}) was captured: {}",
        laptop_ok(&f, &["ip", "route", "show", "table", "all"])
    );
    assert_eq!(route_dev(&f, &[NAMESERVER]), ns_before, "the nameserver");
    assert_ne!(ns_before, tun);
    assert_eq!(route_dev(&f, &[POD_SIDE]), tun, "the rest of the pod CIDR");

    // Connect says so, with the reason.
    for (addr, why) in [
        (ENDPOINT, "another VPN's endpoint"),
        (NAMESERVER, "a nameserver"),
    ] {
        assert!(
            said.lines()
                .any(|l| l.contains("kept off the tunnel") && l.contains(addr) && l.contains(why)),
            "connect does not say that {addr} ({why}) is kept off the tunnel:\n{said}"
        );
    }
    assert!(said.contains(MARK), "connect names the mark: {said}");
    // So does status, human …
    let table = f.kvpn_ok(&["status"]);
    for addr in [ENDPOINT, NAMESERVER] {
        assert!(
            table
                .lines()
                .any(|l| l.contains("kept off the tunnel") && l.contains(addr)),
            "status does not show {addr} kept off the tunnel:\n{table}"
        );
    }
    // … and -o json.
    let kept = session["kept_out"].as_array().cloned().unwrap_or_default();
    let entry = |addr: &str| {
        kept.iter()
            .find(|k| k["address"] == addr)
            .cloned()
            .unwrap_or_else(|| panic!("no kept_out entry for {addr}: {kept:#?}"))
    };
    let e = entry(ENDPOINT);
    assert!(
        e["why"]
            .as_str()
            .is_some_and(|w| w.contains("another VPN's endpoint") && w.contains(TABLE)),
        "{e:#}"
    );
    assert_eq!(e["kind"], "pod", "{e:#}");
    assert!(
        e["cidr"]
            .as_str()
            .and_then(|c| c.parse::<ipnet::IpNet>().ok())
            .is_some_and(|c| c.contains(&ENDPOINT.parse::<std::net::IpAddr>().expect("ip"))),
        "{e:#}"
    );
    assert_eq!(entry(NAMESERVER)["why"], "a nameserver");
}
