//! `kvpn`'s usage errors as a user sees them: the binary run with
//! `KVPN_RUNTIME_DIR` set, as the tester had it. Every case fails while the
//! flags are parsed: no daemon is started, no cluster or network is touched.
//!
//! `KVPN_USAGE_TEST_BIN` (a kvpn binary) runs the cases against another build,
//! e.g. main's, to see the old behaviour.

use std::process::Command;

fn kvpn(args: &[&str]) -> (Option<i32>, String) {
    let bin = std::env::var_os("KVPN_USAGE_TEST_BIN")
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_kvpn").into());
    let out = Command::new(&bin)
        .args(args)
        .env("KVPN_RUNTIME_DIR", "/nonexistent/kvpn-usage-test")
        .env_remove("KUBECONFIG")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {bin:?} {args:?}: {e}"));
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// With KVPN_RUNTIME_DIR set, clap's usage line of a `requires` or
/// `conflicts_with` error listed `--runtime-dir <RUNTIME_DIR>` as if the
/// command needed it (a tester's finding; clap counted the variable as given).
#[test]
fn usage_lines_do_not_list_runtime_dir_from_the_environment() {
    for args in [
        &["connect", "--socks", "--workers", "2"][..],
        &["connect", "--socks-listen", "127.0.0.1:1081"],
        &["connect", "--steer", "ebpf"],
        &["ssh", "--ssh-addr", "h", "--tunnel-ip", "198.19.0.1"],
    ] {
        let (code, err) = kvpn(args);
        assert_eq!(code, Some(2), "kvpn {args:?} is a usage error: {err}");
        let usage = err
            .lines()
            .find(|l| l.starts_with("Usage:"))
            .unwrap_or_else(|| panic!("kvpn {args:?}: no usage line in {err}"));
        assert!(
            !usage.contains("--runtime-dir"),
            "kvpn {args:?}: the usage line lists --runtime-dir: {usage}"
        );
    }
}

/// The tester's command lines that were taken silently are usage errors (exit
/// 2) that name the flag, before any cluster work.
#[test]
fn the_testers_command_lines_are_usage_errors() {
    for (args, want) in [
        (
            &["connect", "--socks", "--socks-listen", "0.0.0.0:1081"][..],
            "--socks-allow-remote",
        ),
        (&["connect", "-n", "Bad_NS!"], "RFC 1123"),
        (
            &[
                "connect",
                "--kubeconfig",
                "/nonexistent/k",
                "--tunnel-ip",
                "100.96.0.9",
            ],
            "leases the tunnel IP",
        ),
    ] {
        let (code, err) = kvpn(args);
        assert_eq!(code, Some(2), "kvpn {args:?} is a usage error: {err}");
        assert!(err.contains(want), "kvpn {args:?}: no {want:?} in {err}");
    }
}

/// `kvpn connect --cidr 10.1.2.3/8` is a usage error naming the flag, the value
/// and both things it may have meant (on main it connected with 10.0.0.0/8 and
/// said nothing); `--pod-cidr` and `--service-cidr` likewise.
#[test]
fn a_cidr_with_host_bits_is_refused_with_the_network_it_would_be() {
    for (flag, value, want) in [
        (
            "--cidr",
            "10.1.2.3/8",
            "10.1.2.3/8 has host bits set (the address of a /8 network ends in zero bits); \
             did you mean 10.0.0.0/8 (the network) or 10.1.2.3/32 (that one address)?",
        ),
        (
            "--pod-cidr",
            "10.244.1.7/16",
            "did you mean 10.244.0.0/16 (the network) or 10.244.1.7/32 (that one address)?",
        ),
        (
            "--service-cidr",
            "fd00:10:96::1/112",
            "did you mean fd00:10:96::/112 (the network) or fd00:10:96::1/128",
        ),
    ] {
        let args = ["connect", "--manager", "127.0.0.1:10801", flag, value];
        let (code, err) = kvpn(&args);
        assert_eq!(code, Some(2), "kvpn {args:?} is a usage error: {err}");
        assert!(err.contains(want), "kvpn {args:?}: no {want:?} in {err}");
        assert!(
            err.contains(&format!("'{value}' for '{flag} <CIDR>'")),
            "kvpn {args:?}: the flag and value are not named in {err}"
        );
    }
}
