//! End-to-end: a user's `--cidr 0.0.0.0/0` on the static lab (issue #29 item 7).
//! kvpn never routes the laptop's own ranges (loopback, link-local, …) nor the
//! traffic manager's address, so it installs the CIDR as many smaller ranges;
//! two of them overlap the laptop's own subnet (172.31.255.0/30, the lab's
//! uplink) and the root daemon refuses them. On main the user saw only
//! "extra CIDR 172.31.255.0/32 overlaps …": ranges they never typed, with no word
//! of where they came from. Now connect names what it keeps off the tunnel and
//! why, traces the refused ranges back to `--cidr 0.0.0.0/0`, and gives the
//! ways out; the override it names works.

use kvpn_tests::{Fixture, lab_connect_args, text};

fn connect(f: &Fixture, extra: &[&str]) -> std::process::Output {
    let mut args: Vec<String> = vec!["connect".into()];
    args.extend(lab_connect_args());
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    f.kvpn(&args)
}

#[test]
fn cidr_everything_names_what_it_keeps_off_and_why_a_refused_piece_is_refused() {
    let f = Fixture::new();
    let manager = kvpn_lab::MANAGER_ADDR_FROM_LAPTOP.ip().to_string();
    let out = connect(&f, &["--cidr", "0.0.0.0/0"]);
    let err = text(&out.stderr);
    eprintln!("kvpn connect --cidr 0.0.0.0/0 said:\n{err}");
    assert!(
        !out.status.success(),
        "connect --cidr 0.0.0.0/0 succeeded:\n{err}"
    );
    // What kvpn keeps off the tunnel inside the user's range, and why.
    let holes = err
        .lines()
        .find(|l| l.contains("--cidr 0.0.0.0/0 is routed as "))
        .unwrap_or_else(|| panic!("no line about the holes in 0.0.0.0/0:\n{err}"));
    for hole in [
        "127.0.0.0/8 (loopback)",
        "169.254.0.0/16 (link-local)",
        "224.0.0.0/4 (multicast)",
        &format!("{manager} (the traffic manager)"),
    ] {
        assert!(holes.contains(hole), "no {hole:?} in {holes}");
    }
    // The refusal traces the pieces back to what the user typed, and says why.
    let error = err
        .lines()
        .find(|l| l.starts_with("kvpn: error:"))
        .unwrap_or_else(|| panic!("no error line:\n{err}"));
    assert!(
        error.contains("are parts of --cidr 0.0.0.0/0")
            && error.contains("0.0.0.0/0 covers routes this laptop already has"),
        "the refusal does not trace the refused ranges to --cidr 0.0.0.0/0: {error}"
    );
    assert!(
        error.contains("overlaps 172.31.255.0/30 dev "),
        "the refusal names the laptop's route: {error}"
    );
    assert!(
        error.contains("give narrower --cidr ranges") && error.contains("--allow-route-conflict"),
        "no way out in {error}"
    );
    assert!(
        text(
            &f.laptop(&["ip", "-br", "link", "show", "type", "tun"])
                .stdout
        )
        .trim()
        .is_empty(),
        "a refused connect left a TUN device"
    );

    // The override it names: the laptop keeps its subnet, the rest goes in.
    let out = connect(&f, &["--cidr", "0.0.0.0/0", "--allow-route-conflict"]);
    assert!(
        out.status.success(),
        "connect --cidr 0.0.0.0/0 --allow-route-conflict failed:\n{}\n{}\n{}",
        text(&out.stdout),
        text(&out.stderr),
        f.daemon_log()
    );
    let get = |ip: &str| text(&f.laptop(&["ip", "route", "get", ip]).stdout);
    let tun = f.status_json()["sessions"][0]["tun_name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(!tun.is_empty(), "no TUN device in status");
    assert!(
        get("10.1.2.3").contains(&format!("dev {tun}")),
        "10.1.2.3 not through {tun}: {}",
        get("10.1.2.3")
    );
    for own in [manager.as_str(), "172.31.255.2", "127.0.0.1"] {
        assert!(
            !get(own).contains(&format!("dev {tun}")),
            "{own} goes into the tunnel: {}",
            get(own)
        );
    }
    f.disconnect();
}
