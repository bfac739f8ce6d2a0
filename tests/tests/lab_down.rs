//! End-to-end, the README's lab workflow ends with `kvpn lab down`: it must leave
//! nothing of the lab behind, the laptop's runtime folder included (issue 29 item
//! 9: kvpn's logs, sockets, pid and lock files stayed in
//! `<lab state>/kvpn-lab-laptop-runtime`, and daemons a user forgot to quit kept
//! running in the deleted laptop netns).
//!
//! The lab's persistent state goes to a folder of this test (`KVPN_LAB_STATE_DIR`),
//! so `kvpn lab up` cannot meet another lab of that name; kvpn in the laptop gets
//! the lab's own runtime folder (no `KVPN_RUNTIME_DIR` of the caller's), as a user
//! who follows the README does.

use std::path::Path;
use std::process::Output;

use kvpn_tests::lab_cli::LabRun;
use kvpn_tests::text;

fn ok(what: &str, out: &Output, logs: impl FnOnce() -> String) -> String {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr),
        logs()
    );
    text(&out.stdout)
}

fn pid_in(path: &Path) -> Option<i32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn alive(pid: i32) -> bool {
    // A zombie (state Z, the third field of /proc/<pid>/stat) is gone too.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| stat.split_whitespace().nth(2).map(|s| s != "Z"))
        .unwrap_or(false)
}

#[test]
fn lab_down_removes_the_laptop_runtime_folder_and_stops_its_daemons() {
    let lab = LabRun::new("labdown", 180);
    ok("kvpn lab up", &lab.kvpn(&["lab", "up"]), String::new);
    let runtime = lab.laptop_runtime(kvpn_lab::DEFAULT_LAB_NAME);
    let logs =
        || kvpn_tests::kube_lab::diagnostics_of(&lab.laptop_runtime(kvpn_lab::DEFAULT_LAB_NAME));
    // A user who connects and then tears the lab down without `kvpn quit`.
    let kvpn = lab.kvpn.to_string_lossy().into_owned();
    ok(
        "kvpn lab exec laptop -- kvpn connect",
        &lab.kvpn(&[
            "lab",
            "exec",
            "laptop",
            "--",
            &kvpn,
            "connect",
            "--namespace",
            "default",
        ]),
        logs,
    );
    // Precondition: the folder holds the daemons' logs and pid files.
    for f in ["dataplane.log", "dataplane.pid", "user.log", "user.pid"] {
        assert!(
            runtime.join(f).exists(),
            "{} has no {f} after connect: {:?}",
            runtime.display(),
            std::fs::read_dir(&runtime)
                .map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
                .unwrap_or_default()
        );
    }
    let pids: Vec<i32> = ["dataplane.pid", "user.pid"]
        .iter()
        .filter_map(|f| pid_in(&runtime.join(f)))
        .collect();
    assert_eq!(pids.len(), 2, "both daemons' pids: {pids:?}");
    assert!(pids.iter().all(|p| alive(*p)), "daemons running: {pids:?}");

    let down = lab.kvpn(&["lab", "down"]);
    let said = ok("kvpn lab down", &down, String::new);
    assert!(
        !runtime.exists(),
        "`kvpn lab down` left the laptop's runtime folder {}: {:?}\n{said}",
        runtime.display(),
        std::fs::read_dir(&runtime)
            .map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
            .unwrap_or_default()
    );
    assert!(
        said.contains(&runtime.display().to_string()),
        "lab down names the folder it removed: {said}"
    );
    let left: Vec<i32> = pids.iter().copied().filter(|p| alive(*p)).collect();
    assert!(
        left.is_empty(),
        "kvpn daemons of the lab laptop still run after `kvpn lab down`: {left:?}\n{said}"
    );
    // Nothing else of the lab in its state folder but what belongs to no lab.
    let state: Vec<String> = std::fs::read_dir(lab.dir.join("lab-state"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(kvpn_lab::DEFAULT_LAB_NAME))
                .collect()
        })
        .unwrap_or_default();
    assert!(state.is_empty(), "left in the lab state folder: {state:?}");
}

/// The session record files under `<xdg-state>/kvpn/sessions/`.
fn session_records(lab: &LabRun) -> Vec<std::path::PathBuf> {
    let root = lab.dir.join("xdg-state").join("kvpn").join("sessions");
    std::fs::read_dir(&root)
        .map(|stores| {
            stores
                .flatten()
                .flat_map(|s| std::fs::read_dir(s.path()).into_iter().flatten().flatten())
                .map(|f| f.path())
                .filter(|p| p.extension().is_some_and(|x| x == "json"))
                .collect()
        })
        .unwrap_or_default()
}

/// T7: sessions started in the lab laptop with a `--runtime-dir` of their own
/// (which `kvpn lab down` is not told about): one whose daemons run, one whose
/// user daemon was killed (only its record is left). Lab down quits both
/// folders, says so, and leaves no session record, daemon or socket of them.
#[test]
fn lab_down_quits_sessions_of_custom_runtime_folders_and_leaves_no_record() {
    let lab = LabRun::new("labdowncustom", 180);
    ok("kvpn lab up", &lab.kvpn(&["lab", "up"]), String::new);
    let kvpn = lab.kvpn.to_string_lossy().into_owned();
    let (live, killed) = (lab.dir.join("rt-live"), lab.dir.join("rt-killed"));
    let in_laptop = |rt: &Path, args: &[&str]| {
        let rt = rt.to_string_lossy().into_owned();
        let mut all = vec![
            "lab",
            "exec",
            "laptop",
            "--",
            kvpn.as_str(),
            "--runtime-dir",
            &rt,
        ];
        all.extend_from_slice(args);
        lab.kvpn(&all)
    };
    let logs = |rt: &Path| kvpn_tests::kube_lab::diagnostics_of(rt);
    ok(
        "kvpn --runtime-dir rt-live connect",
        &in_laptop(&live, &["connect", "--namespace", "default"]),
        || logs(&live),
    );
    ok(
        "kvpn --runtime-dir rt-killed connect --socks",
        &in_laptop(
            &killed,
            &[
                "connect",
                "--namespace",
                "default",
                "--socks",
                "--socks-listen",
                "127.0.0.1:11080",
            ],
        ),
        || logs(&killed),
    );
    let records = session_records(&lab);
    assert_eq!(records.len(), 2, "one record per session: {records:?}");
    let killed_user = pid_in(&killed.join("user.pid")).expect("rt-killed user daemon pid");
    // SAFETY: kill(2) on the user daemon this test started; no memory involved.
    unsafe {
        libc::kill(killed_user, libc::SIGKILL);
    }
    let t0 = std::time::Instant::now();
    while alive(killed_user) {
        assert!(
            t0.elapsed().as_secs() < 10,
            "user daemon {killed_user} survived SIGKILL"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let pids: Vec<i32> = ["dataplane.pid", "user.pid"]
        .iter()
        .filter_map(|f| pid_in(&live.join(f)))
        .collect();
    assert_eq!(pids.len(), 2, "rt-live daemons' pids: {pids:?}");

    let down = lab.kvpn(&["lab", "down"]);
    let said = ok("kvpn lab down", &down, String::new);
    for rt in [&live, &killed] {
        assert!(
            said.contains(&format!("Quitting kvpn in runtime folder {}", rt.display())),
            "lab down does not name the runtime folder {} it quit:\n{said}",
            rt.display()
        );
        for f in ["user.sock", "dataplane.sock", "user.pid", "dataplane.pid"] {
            assert!(
                !rt.join(f).exists(),
                "{} left after lab down:\n{said}",
                rt.join(f).display()
            );
        }
    }
    let left = session_records(&lab);
    assert!(
        left.is_empty(),
        "session records left after lab down: {left:?}\n{said}"
    );
    let running: Vec<i32> = pids.iter().copied().filter(|p| alive(*p)).collect();
    assert!(
        running.is_empty(),
        "daemons of rt-live still run after lab down: {running:?}\n{said}"
    );
}
