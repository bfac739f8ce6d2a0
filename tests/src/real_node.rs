//! Helpers of the end-to-end tests on real node software (tests/tests/kube_real_node*.rs):
//! find a pod's container processes on this machine and read their identity.
//!
//! I/O: reads /proc.

use k8s_openapi::api::core::v1::Pod;

/// The pids whose cgroup names container `id` (`containerd://<id>` of the pod
/// status), in any hierarchy.
pub fn container_pids(id: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if std::fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|c| c.contains(id)) {
            pids.push(pid);
        }
    }
    pids
}

/// A `Key:` line of /proc/<pid>/status.
pub fn status_field(pid: u32, key: &str) -> String {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/status: {e}"));
    s.lines()
        .find_map(|l| l.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"))
        .trim()
        .to_owned()
}

/// The containerd id of `pod`'s first container (`containerd://<id>`).
pub fn container_id(pod: &Pod) -> String {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.container_id.as_deref())
        .and_then(|c| c.strip_prefix("containerd://"))
        .unwrap_or_else(|| panic!("not a containerd container: {pod:#?}"))
        .to_owned()
}

/// The pid of the process named `comm` in container `id`.
pub fn container_process(id: &str, comm: &str) -> u32 {
    let pids = container_pids(id);
    pids.iter()
        .copied()
        .find(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == comm)
        })
        .unwrap_or_else(|| panic!("no {comm} process in container {id}: {pids:?}"))
}
