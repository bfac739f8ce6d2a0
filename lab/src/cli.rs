//! `kvpn lab` (the `kvpn-lab` program): the built-in lab (a Kubernetes cluster in
//! network namespaces) for trying kvpn out. The lab is lab-only code
//! ([`crate::k8s::cluster`]) and never part of what kvpn ships to a laptop: `kvpn lab …`
//! runs this program when it is installed next to `kvpn`. The lab is persistent
//! between commands: `up` records it under a name and leaves its control plane and its
//! node agent (`kvpn-lab-agent`) running; `exec`/`info`/`down` find it by that name.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, anyhow};
use clap::Subcommand;
use ipnet::Ipv4Net;

use kvpn_exec::find_program;

use crate::k8s::cluster::{self, K8sLabState};
use crate::k8s::{K8sLab, K8sLabOptions};
use crate::{DEFAULT_LAB_NAME, Lab, LabError, Netns};

/// kvpn's default root daemon runtime folder (kvpn-control's
/// `DEFAULT_ROOT_RUNTIME_DIR`): a `kvpn` in the laptop netns must not use it.
const DEFAULT_ROOT_RUNTIME_DIR: &str = "/run/kvpn";

/// `kvpn lab` subcommands.
#[derive(Debug, Subcommand)]
pub enum LabCommand {
    /// Bring the lab up: laptop and node network namespaces, a Kubernetes control plane
    /// (etcd, kube-apiserver, kube-controller-manager), kubelet/kube-proxy/DNS stand-ins
    /// and sample workloads; prints the kubeconfig paths. The traffic manager is not
    /// pre-installed: `kvpn connect --kubeconfig …` installs it.
    Up {
        /// A dual-stack cluster: IPv6 pod range fd00:10:244:1::/64 and service range
        /// fd00:10:96::/112 besides the IPv4 ones; `web`, `echo` and `udp-echo` get
        /// an IPv6 ClusterIP too (PreferDualStack), so `kvpn connect` routes both.
        #[arg(long)]
        dual_stack: bool,
        /// Real node software instead of the stand-ins: nodes with Debian's
        /// containerd + runc, the CNI bridge plugin, kubelet and kube-proxy 1.20.2 and
        /// kube-scheduler, running the project's images (`cargo xtask image`;
        /// KVPN_IMAGE_DIR names their folder), the cluster DNS as a pod.
        #[arg(long, conflicts_with = "dual_stack")]
        real_nodes: bool,
        /// How many real nodes.
        #[arg(long, default_value_t = 2, requires = "real_nodes", value_parser = clap::value_parser!(u8).range(1..=8))]
        nodes: u8,
        /// The lab's name: several labs can be up at once, each under its own name
        /// (`down`, `info` and `exec` take the same `--name`).
        #[arg(long, default_value = DEFAULT_LAB_NAME)]
        name: String,
        /// The cluster's pod CIDR (IPv4, a /20 or wider; default 10.244.0.0/16).
        /// Two labs with the same ranges are what two kind or k3d clusters are.
        #[arg(long, value_name = "CIDR")]
        pod_cidr: Option<String>,
        /// The cluster's service CIDR (IPv4, a /24 or wider, disjoint from the pod
        /// CIDR; default 10.96.0.0/12). The cluster DNS is its 10th address.
        #[arg(long, value_name = "CIDR")]
        service_cidr: Option<String>,
    },
    /// Tear the lab down; nothing of it remains.
    Down {
        /// Which lab (`kvpn lab up --name`).
        #[arg(long, default_value = DEFAULT_LAB_NAME)]
        name: String,
    },
    /// Show what runs where in the lab.
    Info {
        /// Which lab (`kvpn lab up --name`).
        #[arg(long, default_value = DEFAULT_LAB_NAME)]
        name: String,
    },
    /// Run a command inside one of the lab's network namespaces (in `laptop`, KUBECONFIG
    /// points at the lab's admin kubeconfig unless already set, and KVPN_HOSTS at the
    /// laptop netns's own hosts file, /etc/netns/<laptop netns>/hosts, so that
    /// `kvpn connect --hosts` there never edits this machine's /etc/hosts).
    Exec {
        /// Which lab (`kvpn lab up --name`).
        #[arg(long, default_value = DEFAULT_LAB_NAME)]
        name: String,
        /// `laptop`, `node`, or a pod name (`kubectl get pods -A`).
        role: String,
        /// The command and its arguments (after `--`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        command: Vec<String>,
    },
}

/// The lines `kvpn lab` prints, in kvpn's style (`•` a step, `✓` done).
mod output {
    #![allow(clippy::print_stdout, reason = "this module is kvpn lab's output")]
    pub fn step(msg: &str) {
        println!("• {msg}…");
    }
    pub fn done(msg: &str) {
        println!("✓ {msg}");
    }
    pub fn info_block(text: &str) {
        println!("{}", text.trim_end());
    }
    pub fn error(msg: &str) {
        eprintln!("kvpn: error: {msg}");
    }
    pub fn detail(msg: &str) {
        println!("    {msg}");
    }
    pub fn warn(msg: &str) {
        eprintln!("⚠ {msg}");
    }
}

/// Run a `kvpn lab` subcommand.
pub async fn run(cmd: LabCommand) -> Result<()> {
    let name = match &cmd {
        LabCommand::Up { name, .. }
        | LabCommand::Down { name }
        | LabCommand::Info { name }
        | LabCommand::Exec { name, .. } => name,
    };
    crate::lab::validate_lab_name(name).context("--name")?;
    match cmd {
        LabCommand::Up {
            dual_stack,
            real_nodes,
            nodes,
            name,
            pod_cidr,
            service_cidr,
        } => {
            let addressing = addressing(dual_stack, pod_cidr, service_cidr)?;
            up(&name, addressing, real_nodes.then_some(usize::from(nodes))).await
        }
        other => tokio::task::spawn_blocking(move || run_blocking(other))
            .await
            .context("lab task panicked")?,
    }
}

/// The lab's address plan from `kvpn lab up`'s flags: the default plan with the
/// pod and service CIDRs given (the node's pod range is the pod CIDR's second /24,
/// as 10.244.1.0/24 of 10.244.0.0/16); refused, naming the flag, when the lab
/// cannot be built on them.
fn addressing(
    dual_stack: bool,
    pod_cidr: Option<String>,
    service_cidr: Option<String>,
) -> Result<crate::Addressing> {
    let pod_cidr = pod_cidr
        .map(|v| parse_cidr("--pod-cidr", &v, "10.50.0.0/16"))
        .transpose()?;
    let service_cidr = service_cidr
        .map(|v| parse_cidr("--service-cidr", &v, "10.60.0.0/16"))
        .transpose()?;
    let mut a = crate::Addressing::default();
    if let Some(pod) = pod_cidr {
        // Real nodes take /24s from the third on (up to 8 nodes): a /20 has 16.
        if pod.prefix_len() > 20 {
            return Err(anyhow!(
                "--pod-cidr {pod}: too narrow; the lab gives each node a /24 of it (up to 8 \
                 nodes, from the third /24 on), so give a /20 or wider, e.g. 10.50.0.0/16"
            ));
        }
        a.pod_cidr = pod;
        a.node_pod_cidr = pod
            .subnets(24)
            .ok()
            .and_then(|mut s| s.nth(1))
            .ok_or_else(|| anyhow!("--pod-cidr {pod}: has no second /24"))?;
    }
    if let Some(svc) = service_cidr {
        if svc.prefix_len() > 24 {
            return Err(anyhow!(
                "--service-cidr {svc}: too narrow; the lab places fixed ClusterIPs up to the \
                 range's 102nd address, so give a /24 or wider, e.g. 10.60.0.0/16"
            ));
        }
        a.service_cidr = svc;
    }
    for (flag, net) in [
        ("--pod-cidr", a.pod_cidr),
        ("--service-cidr", a.service_cidr),
    ] {
        if net.contains(&a.uplink) || a.uplink.contains(&net.network()) {
            return Err(anyhow!(
                "{flag} {net}: overlaps the lab's uplink {} (laptop to node); choose another range",
                a.uplink
            ));
        }
        let first = net.network();
        if first.is_loopback()
            || first.is_multicast()
            || first.is_unspecified()
            || first.is_broadcast()
        {
            return Err(anyhow!(
                "{flag} {net}: not a unicast range; use a private range such as 10.50.0.0/16"
            ));
        }
    }
    if a.pod_cidr.contains(&a.service_cidr.network())
        || a.service_cidr.contains(&a.pod_cidr.network())
    {
        return Err(anyhow!(
            "--pod-cidr {} and --service-cidr {} overlap: a cluster's pod and service ranges \
             are disjoint; choose two that do not overlap",
            a.pod_cidr,
            a.service_cidr
        ));
    }
    a.validate().context("the lab's addressing")?;
    Ok(if dual_stack { a.dual_stack() } else { a })
}

/// An IPv4 CIDR flag's value: refused, naming the flag, when it is not one,
/// is IPv6 (the lab's IPv6 ranges come with `--dual-stack`) or has host bits
/// set (as `kvpn connect --cidr` refuses them).
fn parse_cidr(flag: &str, value: &str, example: &str) -> Result<Ipv4Net> {
    let net: ipnet::IpNet = value
        .parse()
        .map_err(|_| anyhow!("{flag} {value:?}: not a CIDR (ADDRESS/PREFIX), e.g. {example}"))?;
    let ipnet::IpNet::V4(net) = net else {
        return Err(anyhow!(
            "{flag} {value}: the lab's ranges are IPv4 (its IPv6 ranges come with --dual-stack), \
             e.g. {example}"
        ));
    };
    if net.trunc() != net {
        return Err(anyhow!(
            "{flag} {value}: has host bits set — did you mean {}?",
            net.trunc()
        ));
    }
    Ok(net)
}

async fn up(name: &str, addressing: crate::Addressing, real_nodes: Option<usize>) -> Result<()> {
    match real_nodes {
        Some(count) => output::step(&format!(
            "Bringing the lab up: laptop and router network namespaces, etcd + kube-apiserver + \
             kube-controller-manager + kube-scheduler, {count} real nodes (containerd + runc, CNI, \
             kubelet, kube-proxy), the cluster DNS pod, sample workloads (the traffic manager is \
             installed by `kvpn connect`)"
        )),
        None => output::step(
            "Bringing the lab up: laptop and node network namespaces, etcd + kube-apiserver + \
             kube-controller-manager, kubelet/kube-proxy/DNS stand-ins, sample workloads \
             (the traffic manager is installed by `kvpn connect`)",
        ),
    }
    let started = std::time::Instant::now();
    // No pre-installed traffic manager: `kvpn connect --kubeconfig …` installs it, as
    // on a real cluster.
    let workloads = crate::k8s::workloads::Workloads {
        manager: false,
        ..Default::default()
    };
    let mut options = K8sLabOptions::default()
        .persist_as(name)
        .workloads(workloads)
        .addressing(addressing);
    if let Some(count) = real_nodes {
        options = options.real_nodes(
            crate::k8s::RealNodeOptions::project(count, Vec::new())
                .context("kvpn lab up --real-nodes needs the project's images")?,
        );
    }
    let lab = K8sLab::up(options).await.context("kvpn lab up failed")?;
    output::info_block(&lab.info());
    let admin = lab.laptop_admin_kubeconfig().to_owned();
    let user = lab.laptop_user_kubeconfig().to_owned();
    let state = tokio::task::spawn_blocking(move || lab.detach())
        .await
        .context("lab task panicked")?
        .context("cannot record the lab's state")?;
    output::done(&format!(
        "Lab {name} is up in {:.1} s (state {}).\n  \
         kubeconfig (from the laptop netns): {}\n  \
         restricted kubeconfig (user kvpn-user): {}\n  \
         Run commands in it with `{} laptop -- kubectl get pods -A` (KUBECONFIG is set there), \
         remove it with `{}`",
        started.elapsed().as_secs_f64(),
        state.display(),
        admin.display(),
        user.display(),
        crate::lab_cmd("exec", name),
        crate::lab_cmd("down", name),
    ));
    Ok(())
}

fn run_blocking(cmd: LabCommand) -> Result<()> {
    match cmd {
        LabCommand::Up { .. } => Err(anyhow!("`kvpn lab up` runs on the async path")),
        LabCommand::Down { name } => {
            output::step(&format!("Tearing the lab {name} down"));
            let runtime = laptop_runtime_dir_named(&name);
            // kvpn's daemons started by `kvpn lab exec laptop` live in the laptop
            // netns with the runtime folder below: stop them first (they put the
            // laptop's DNS back and remove their TUN device), or they would outlive
            // the lab holding its netns and their folder.
            // A caller with a runtime folder of its own (KVPN_RUNTIME_DIR, which
            // `kvpn lab exec laptop` passes on) has its daemons there: those too,
            // and those of any other folder used in the laptop (`kvpn
            // --runtime-dir DIR connect` there): `kvpn quit --every-runtime-dir`
            // finds them by the daemons running in the laptop netns and by the
            // session records made there.
            if let Ok(lab) = Lab::attach(&name) {
                if let Some(own) = callers_runtime_dir().filter(|d| *d != runtime) {
                    quit_laptop_daemons(&lab, &own);
                }
                quit_laptop_daemons(&lab, &runtime);
            }
            let was_up = cluster::down_named(&name).context("kvpn lab down failed")?;
            let removed = remove_runtime_dir(&runtime)?;
            if was_up {
                output::done(
                    "Lab is down: its agent, control plane, pods, network namespaces, nftables rules and folder are gone",
                );
            } else {
                output::done(&format!("No lab named {name} was up"));
            }
            if removed {
                output::done(&format!(
                    "The laptop's runtime folder {} (kvpn's logs, sockets and lock files there) is gone",
                    runtime.display()
                ));
            }
            Ok(())
        }
        LabCommand::Info { name } => {
            let lab = Lab::attach(&name).with_context(|| {
                format!(
                    "no lab to describe — bring one up with `{}`",
                    crate::lab_cmd("up", &name)
                )
            })?;
            match K8sLabState::read(lab.dir()).context("reading the lab's Kubernetes state")? {
                Some(state) => output::info_block(&cluster::info_text(&lab, &state)),
                None => output::info_block(&lab.info()),
            }
            Ok(())
        }
        LabCommand::Exec {
            name,
            role,
            command,
        } => {
            let lab = Lab::attach(&name).with_context(|| {
                format!(
                    "no lab to run in — bring one up with `{}`",
                    crate::lab_cmd("up", &name)
                )
            })?;
            let (program, args) = command.split_first().ok_or_else(|| {
                anyhow!(
                    "kvpn lab exec {role}: no command given — e.g. `kvpn lab exec laptop -- kubectl get pods -A`"
                )
            })?;
            let (mut cmd, netns) = match find_netns(&lab, &role) {
                Ok(netns) => (netns.command(program), Some(netns)),
                Err(e) => match real_node_pod_pid(&lab, &role)? {
                    // A pod on a real node: its netns is pinned inside the node's
                    // mount namespace; enter it through one of its processes.
                    Some(pid) => {
                        let mut cmd = Command::new("nsenter");
                        cmd.arg(format!("--net=/proc/{pid}/ns/net"))
                            .arg("--")
                            .arg(program);
                        (cmd, None)
                    }
                    None => return Err(e),
                },
            };
            cmd.args(args);
            if role == crate::LAPTOP
                && std::env::var_os("KUBECONFIG").is_none()
                && let Ok(Some(state)) = K8sLabState::read(lab.dir())
            {
                // What a developer's laptop has: a kubeconfig for the cluster.
                cmd.env("KUBECONFIG", &state.laptop_admin_kubeconfig);
            }
            if role == crate::LAPTOP
                && let Some(netns) = &netns
            {
                // The laptop's own hosts file, which `ip netns exec` binds over
                // /etc/hosts there. A root daemon started from here edits the file
                // KVPN_HOSTS names (`kvpn connect --hosts`); without it, it would be
                // whichever /etc/hosts its mount namespace shows, this machine's when
                // the lab has no file of its own (a lab from an older kvpn: made now,
                // as a copy of /etc/hosts). Always set: an inherited KVPN_HOSTS could
                // name this machine's file.
                crate::write_laptop_hosts(netns, false)
                    .context("cannot write the lab laptop's hosts file")?;
                cmd.env("KVPN_HOSTS", netns.etc_dir().join(crate::LAPTOP_HOSTS_FILE));
            }
            if role == crate::LAPTOP {
                // The root daemon's runtime folder is a path, not part of the netns:
                // with the default (/run/kvpn) a `kvpn connect` here would talk to a
                // root daemon of this machine's own network namespace, if one runs,
                // and make its TUN device and routes there. The laptop gets a folder
                // of its own unless the caller chose one; `kvpn lab down` removes it.
                if callers_runtime_dir().is_none() {
                    cmd.env("KVPN_RUNTIME_DIR", laptop_runtime_dir(&lab));
                }
            }
            // `ip netns exec` exits 1 when it cannot start the command, like a
            // failing command; a shell's 127 (not found) and 126 (not executable)
            // tell the two apart, so kvpn checks first and exits with those.
            if let Err(e) = find_program(program, std::env::var_os("PATH").as_deref()) {
                output::error(&format!("kvpn lab exec {role}: {e}"));
                std::process::exit(e.exit_code());
            }
            let status = cmd
                .status()
                .with_context(|| format!("cannot run {program:?} in the lab's {role} namespace"))?;
            // Hand the command's own exit code back, like `ip netns exec` does.
            std::process::exit(status.code().unwrap_or(1));
        }
    }
}

/// The runtime folder `kvpn lab exec laptop` gives kvpn there when the caller
/// set none: `<lab state folder>/<lab name>-laptop-runtime`.
pub fn laptop_runtime_dir(lab: &Lab) -> PathBuf {
    laptop_runtime_dir_named(lab.name())
}

/// The caller's own KVPN_RUNTIME_DIR (set, not empty, not kvpn's default),
/// which `kvpn lab exec laptop` keeps for kvpn there.
fn callers_runtime_dir() -> Option<PathBuf> {
    std::env::var_os("KVPN_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|d| !d.as_os_str().is_empty() && d != Path::new(DEFAULT_ROOT_RUNTIME_DIR))
}

/// [`laptop_runtime_dir`] of the lab called `name` (whether or not it is up).
pub fn laptop_runtime_dir_named(name: &str) -> PathBuf {
    crate::state_dir().join(format!("{name}-laptop-runtime"))
}

/// How long `kvpn lab down` lets `kvpn quit --every-runtime-dir` stop the
/// laptop's daemons: a quit with one session takes well under a second, and
/// it quits each runtime folder used there in turn; a hung daemon must not keep
/// the lab up.
const QUIT_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Run `kvpn quit` in the laptop netns for the daemons of `runtime` (best effort:
/// what fails is said, the teardown goes on). `kvpn` is the one beside this
/// program, else the first in PATH.
fn quit_laptop_daemons(lab: &Lab, runtime: &Path) {
    // Whatever is left there (live daemons, or a killed root daemon's DNS
    // change to repair) and in the other runtime folders of the laptop: `kvpn
    // quit --every-runtime-dir` handles all, and does nothing otherwise.
    let Ok(netns) = lab.netns(crate::LAPTOP) else {
        return;
    };
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join("kvpn")))
        .filter(|p| p.is_file());
    let Some(kvpn) =
        beside.or_else(|| find_program("kvpn", std::env::var_os("PATH").as_deref()).ok())
    else {
        output::warn(&format!(
            "cannot stop kvpn's daemons in the lab laptop: no kvpn next to kvpn-lab nor in \
             PATH — they may outlive the lab; stop them by the pids in {}",
            runtime.display()
        ));
        return;
    };
    let mut cmd = netns.command(&kvpn);
    cmd.args(["quit", "--every-runtime-dir"])
        .env("KVPN_RUNTIME_DIR", runtime)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            output::warn(&format!(
                "cannot run `kvpn quit` in the lab laptop: {e} — its daemons may outlive the lab; \
                 stop them by the pids in {}",
                runtime.display()
            ));
            return;
        }
    };
    let pid = child.id();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done_tx.send(child.wait_with_output());
    });
    match done_rx.recv_timeout(QUIT_WAIT) {
        Ok(Ok(out)) if out.status.success() => {
            output::detail(
                "Stopped kvpn's daemons in the lab laptop (`kvpn quit --every-runtime-dir`)",
            );
            // Which folders and sessions it quit (its step and done lines).
            for line in String::from_utf8_lossy(&out.stdout)
                .lines()
                .chain(String::from_utf8_lossy(&out.stderr).lines())
                .map(str::trim)
                .filter(|l| !l.is_empty())
            {
                output::detail(line);
            }
        }
        Ok(Ok(out)) => output::warn(&format!(
            "`kvpn quit --every-runtime-dir` in the lab laptop failed ({}): {} {} — what it \
             names may outlive the lab",
            out.status,
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Ok(Err(e)) => output::warn(&format!("`kvpn quit` in the lab laptop: {e}")),
        Err(_) => {
            // SAFETY: kill(2) on the pid of the child this function spawned (not
            // yet reaped: its waiter thread is still blocked); no memory involved.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGKILL);
            }
            output::warn(&format!(
                "`kvpn quit` in the lab laptop did not finish within {} s; stopped it (pid {pid})",
                QUIT_WAIT.as_secs()
            ));
        }
    }
}

/// Remove the laptop's runtime folder `runtime` the lab's `exec` chose; `Ok(false)`
/// when there was none. Only this folder: a folder the caller chose with
/// `KVPN_RUNTIME_DIR` is theirs.
fn remove_runtime_dir(runtime: &Path) -> Result<bool> {
    match std::fs::remove_dir_all(runtime) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e).with_context(|| {
            format!(
                "cannot remove the lab laptop's runtime folder {} — remove it by hand (`rm -r`)",
                runtime.display()
            )
        }),
    }
}

/// On a real-node lab, the pid of a process of pod `name` (any namespace; its first
/// container), found through the API (admin kubeconfig) and /proc; None when the lab
/// has no real nodes or no such pod runs.
fn real_node_pod_pid(lab: &Lab, name: &str) -> Result<Option<u32>> {
    let Some(state) = K8sLabState::read(lab.dir()).context("reading the lab's Kubernetes state")?
    else {
        return Ok(None);
    };
    if state.real_nodes.is_none() {
        return Ok(None);
    }
    let out = Command::new(crate::k8s::kubectl_path())
        .arg("--kubeconfig")
        .arg(&state.admin_kubeconfig)
        .args([
            "get",
            "pods",
            "-A",
            "--request-timeout=10s",
            "--field-selector",
            &format!("metadata.name={name}"),
            "-o",
            "jsonpath={.items[*].status.containerStatuses[0].containerID}",
        ])
        .output()
        .context("cannot run kubectl to find the pod")?;
    if !out.status.success() {
        return Err(anyhow!(
            "kvpn lab exec {name}: kubectl get pods failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let ids = String::from_utf8_lossy(&out.stdout).into_owned();
    let ids: Vec<&str> = ids
        .split_whitespace()
        .filter_map(|id| id.strip_prefix("containerd://"))
        .collect();
    let [id] = ids.as_slice() else {
        return match ids.len() {
            0 => Ok(None),
            n => Err(anyhow!(
                "kvpn lab exec {name}: {n} pods of that name in different namespaces — none chosen"
            )),
        };
    };
    let entries = std::fs::read_dir("/proc").context("reading /proc")?;
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if std::fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|c| c.contains(id)) {
            return Ok(Some(pid));
        }
    }
    Err(anyhow!(
        "kvpn lab exec {name}: no process of container {id} on this machine — is the pod running? (`kvpn lab exec laptop -- kubectl get pods -A`)"
    ))
}

/// The netns of `role`: `laptop`, `node`, a static pod, or a Kubernetes pod by its name
/// (the kubelet stand-in names pod netns `kvpn-<id>-<pod>-<uid[..5]>`).
fn find_netns(lab: &Lab, role: &str) -> Result<Netns> {
    match lab.netns(role) {
        Ok(n) => Ok(n),
        Err(LabError::UnknownRole { .. }) => {
            let prefix = format!("kvpn-{}-{role}-", lab.id());
            let names = crate::lab_netns(lab.id()).context("listing the lab's netns")?;
            // A real node (`n1`, `n2`, …): netns `kvpn-<id>-n<i>`.
            let exact = crate::topology::netns_name(lab.id(), role);
            if names.contains(&exact) {
                return Ok(Netns::from_name(&exact));
            }
            let matches: Vec<&String> = names
                .iter()
                .filter(|n| {
                    n.strip_prefix(&prefix)
                        .is_some_and(|uid| uid.len() == 5 && !uid.contains('-'))
                })
                .collect();
            match matches.as_slice() {
                [one] => Ok(Netns::from_name(one)),
                _ => Err(anyhow!(
                    "kvpn lab exec: unknown role {role:?} — use laptop, node, or a pod name from \
                     `kvpn lab exec laptop -- kubectl get pods -A` (netns: {})",
                    names.join(", ")
                )),
            }
        }
        Err(e) => Err(e).context("kvpn lab exec"),
    }
}
