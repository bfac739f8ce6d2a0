//! End-to-end, `kvpn lab up --name NAME --pod-cidr CIDR --service-cidr CIDR` (issue
//! #30 item 6): two labs up at once from one CLI state folder — the default one
//! and a named one on ranges of its own — each its own cluster; `info`, `exec` and
//! `down` take `--name`; kvpn connects in the named lab and reaches its pods and
//! Services on the ranges given. Bad input (a range too narrow, pod and service
//! ranges overlapping, a range on the lab's uplink, a bad name, a name already up)
//! is refused naming the flag, and leaves no lab behind.
//!
//! Needs root and the Kubernetes binaries.

use kvpn_tests::lab_cli::LabRun;
use kvpn_tests::text;

/// The stderr of a `kvpn` call that must fail.
fn refused(lab: &LabRun, args: &[&str]) -> String {
    let out = lab.kvpn(args);
    assert!(
        !out.status.success(),
        "kvpn {args:?} succeeded:\n{}",
        text(&out.stdout)
    );
    text(&out.stderr)
}

/// The names of the lab state files in the test's state folder.
fn state_files(lab: &LabRun) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(lab.state_dir())
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".json"))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

#[test]
fn two_named_labs_with_their_own_cidrs_are_up_at_once_and_go_down_by_name() {
    let lab = LabRun::new("labnamed", 180);
    let name = format!("kvpn-named-{}", std::process::id());
    lab.track(&name);

    // Bad input first: refused before anything is made, naming the flag.
    let e = refused(
        &lab,
        &["lab", "up", "--name", &name, "--pod-cidr", "10.50.0.0/24"],
    );
    assert!(
        e.contains("--pod-cidr 10.50.0.0/24") && e.contains("/20 or wider"),
        "{e}"
    );
    let e = refused(
        &lab,
        &["lab", "up", "--name", &name, "--pod-cidr", "10.96.0.0/16"],
    );
    assert!(
        e.contains("overlap") && e.contains("--service-cidr 10.96.0.0/12"),
        "{e}"
    );
    let e = refused(
        &lab,
        &[
            "lab",
            "up",
            "--name",
            &name,
            "--service-cidr",
            "172.31.0.0/16",
        ],
    );
    assert!(
        e.contains("--service-cidr 172.31.0.0/16") && e.contains("uplink"),
        "{e}"
    );
    let e = refused(&lab, &["lab", "up", "--service-cidr", "10.60.0.0/25"]);
    assert!(
        e.contains("--service-cidr 10.60.0.0/25") && e.contains("/24 or wider"),
        "{e}"
    );
    let e = refused(&lab, &["lab", "up", "--name", "no spaces"]);
    assert!(e.contains("--name") && e.contains("no spaces"), "{e}");
    let e = refused(&lab, &["lab", "up", "--pod-cidr", "10.50.0.0/33"]);
    assert!(e.contains("--pod-cidr") && e.contains("not a CIDR"), "{e}");
    let e = refused(&lab, &["lab", "up", "--pod-cidr", "10.50.1.2/16"]);
    assert!(e.contains("host bits") && e.contains("10.50.0.0/16"), "{e}");
    let e = refused(&lab, &["lab", "up", "--service-cidr", "fd00::/108"]);
    assert!(e.contains("--service-cidr") && e.contains("IPv4"), "{e}");
    assert!(state_files(&lab).is_empty(), "{:?}", state_files(&lab));

    // Two labs at once: the default one and the named one on its own ranges.
    let a = lab.ok(&["lab", "up"]);
    assert!(a.contains("Lab kvpn-lab is up"), "{a}");
    let b = lab.ok(&[
        "lab",
        "up",
        "--name",
        &name,
        "--pod-cidr",
        "10.50.0.0/16",
        "--service-cidr",
        "10.60.0.0/16",
    ]);
    assert!(b.contains(&format!("Lab {name} is up")), "{b}");
    assert!(
        b.contains(&format!("kvpn lab down --name {name}"))
            && b.contains(&format!("kvpn lab exec --name {name} laptop")),
        "the hints name the lab: {b}"
    );
    assert_eq!(
        state_files(&lab),
        vec!["kvpn-lab.json".to_owned(), format!("{name}.json")]
    );
    // The same name again is refused, saying how to go on.
    let e = refused(&lab, &["lab", "up", "--name", &name]);
    assert!(
        e.contains("already up") && e.contains(&format!("kvpn lab down --name {name}")),
        "{e}"
    );

    // Each lab is its own cluster on its own ranges.
    let info = lab.ok(&["lab", "info", "--name", &name]);
    assert!(
        info.contains("10.50.1.1/24") && info.contains("Service 10.60.0.10"),
        "{info}"
    );
    let svc = |n: &str| {
        lab.ok(&[
            "lab",
            "exec",
            "--name",
            n,
            "laptop",
            "--",
            "kubectl",
            "get",
            "service",
            "web",
            "-o",
            "jsonpath={.spec.clusterIP}",
        ])
    };
    assert_eq!(svc(&name).trim(), "10.60.0.100");
    assert_eq!(svc(kvpn_lab::DEFAULT_LAB_NAME).trim(), "10.96.0.100");

    // kvpn in the named lab routes its ranges and reaches its pods by name.
    let kvpn = lab.kvpn.to_string_lossy().into_owned();
    let connect = lab.ok(&[
        "lab", "exec", "--name", &name, "laptop", "--", &kvpn, "connect",
    ]);
    assert!(
        connect.contains("route 10.60.0.0/16 (service)") && connect.contains("10.50.1.0/24"),
        "{connect}"
    );
    let page = lab.ok(&[
        "lab",
        "exec",
        "--name",
        &name,
        "laptop",
        "--",
        "curl",
        "-sS",
        "--max-time",
        "10",
        "http://web.default/",
    ]);
    assert!(page.contains("pod-ip: 10.50.1."), "{page}");
    assert!(
        lab.laptop_runtime(&name).join("user.log").exists(),
        "the named lab's laptop has its own runtime folder"
    );

    // Down by name: the other lab stays up.
    let down = lab.ok(&["lab", "down", "--name", &name]);
    assert!(down.contains("Lab is down"), "{down}");
    assert!(!lab.laptop_runtime(&name).exists());
    assert_eq!(state_files(&lab), vec!["kvpn-lab.json".to_owned()]);
    let e = refused(&lab, &["lab", "info", "--name", &name]);
    assert!(e.contains(&format!("kvpn lab up --name {name}")), "{e}");
    assert!(lab.ok(&["lab", "info"]).contains("10.96.0.10"));
    let down = lab.ok(&["lab", "down"]);
    assert!(down.contains("Lab is down"), "{down}");
    assert!(state_files(&lab).is_empty(), "{:?}", state_files(&lab));
}
