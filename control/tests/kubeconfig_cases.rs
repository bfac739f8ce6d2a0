//! Cases kube-01 … kube-04 (shared/cases/ssh-kube.md) against the lab's real
//! kube-apiserver (`kvpn_lab::k8s::ControlPlane`, one per test, on its own
//! loopback address): kubeconfig lists, relative exec plugins, plugins on the
//! user's PATH, and sudo.
//!
//! The lab apiserver authenticates by client certificate only, so the exec
//! plugins here answer with an ExecCredential carrying `clientCertificateData`
//! and `clientKeyData` (the admin user's), which kube-rs supports. Listing
//! namespaces needs that identity: anonymous requests get 403.
//!
//! kube-04 needs root (CI runs as root): it creates a temporary user
//! `kvpn-t<hex>` with useradd and removes it (and its home) on drop.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ListParams};
use kvpn_control::kubeconfig::{self, Error, KubeFlags, KubeTarget, UserEnv};
use kvpn_lab::k8s::{ControlPlane, ControlPlaneConfig};
use serde_json::json;

fn unique() -> String {
    let mut b = [0u8; 4];
    let f = std::fs::File::open("/dev/urandom").expect("/dev/urandom");
    std::io::Read::read_exact(&mut &f, &mut b).expect("random bytes");
    format!("{:08x}", u32::from_le_bytes(b))
}

/// A folder removed on drop (declare it before the control plane living in it).
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str, id: &str) -> Self {
        let p = std::env::temp_dir().join(format!("kvpn-kc-{tag}-{id}"));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("scratch folder");
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn start_lab(scratch: &Scratch, id: &str) -> ControlPlane {
    let t0 = Instant::now();
    let cp = ControlPlane::start(ControlPlaneConfig::new(
        scratch.0.join("lab"),
        format!("kvpn-lab-{id}"),
    ))
    .await
    .expect("lab control plane starts (binaries from scripts/build-kubernetes.sh)");
    eprintln!(
        "control plane {} at {} in {:?}",
        cp.name(),
        cp.server_url(),
        t0.elapsed()
    );
    cp
}

fn mkdirs(p: &Path) {
    std::fs::create_dir_all(p).unwrap_or_else(|e| panic!("mkdir {}: {e}", p.display()));
}

fn write(p: &Path, text: &str) {
    std::fs::write(p, text).unwrap_or_else(|e| panic!("write {}: {e}", p.display()));
}

fn write_exe(p: &Path, text: &str) {
    write(p, text);
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).expect("chmod +x");
}

/// The ExecCredential a plugin prints: the lab admin's client certificate.
fn admin_exec_credential(cp: &ControlPlane) -> String {
    let read = |f: &str| {
        let p = cp.dir().join("pki").join(f);
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
    };
    json!({
        "apiVersion": "client.authentication.k8s.io/v1",
        "kind": "ExecCredential",
        "status": {
            "clientCertificateData": read("kvpn-lab-admin.crt"),
            "clientKeyData": read("kvpn-lab-admin.key"),
        }
    })
    .to_string()
}

/// A one-context kubeconfig (JSON is YAML) whose user is the exec plugin `command`.
fn exec_kubeconfig(context: &str, server: &str, ca: &str, command: &str) -> String {
    json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": format!("{context}-cluster"), "cluster": {"server": server, "certificate-authority": ca}}],
        "users": [{"name": format!("{context}-user"), "user": {"exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": command,
            "interactiveMode": "Never",
        }}}],
        "contexts": [{"name": context, "context": {"cluster": format!("{context}-cluster"), "user": format!("{context}-user")}}],
        "current-context": context,
    })
    .to_string()
}

/// A kubeconfig pointing at nothing (port 9 on loopback refuses connections).
fn elsewhere_kubeconfig(context: &str) -> String {
    json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "elsewhere", "cluster": {"server": "https://127.0.0.1:9", "insecure-skip-tls-verify": true}}],
        "users": [{"name": "elsewhere", "user": {"token": "not-a-real-token"}}],
        "contexts": [{"name": context, "context": {"cluster": "elsewhere", "user": "elsewhere"}}],
        "current-context": context,
    })
    .to_string()
}

async fn namespace_names(client: kube::Client) -> Vec<String> {
    let list = Api::<Namespace>::all(client)
        .list(&ListParams::default())
        .await
        .expect("list namespaces");
    list.items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect()
}

fn assert_lab_namespaces(names: &[String]) {
    for want in ["default", "kube-system", "kvpn-system"] {
        assert!(
            names.iter().any(|n| n == want),
            "namespace {want} missing from {names:?}"
        );
    }
}

/// kube-01: `KUBECONFIG=a:b` where the wanted context exists only in `b`:
/// `--context` finds it and a real list of namespaces succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_01_kubeconfig_list_context_only_in_second_file() {
    let id = unique();
    let s = Scratch::new("kube01", &id);
    let cp = start_lab(&s, &id).await;
    let a = s.0.join("a.yaml");
    write(&a, &elsewhere_kubeconfig("a-ctx"));
    let b = cp.admin_kubeconfig();
    let lab_context = format!("kvpn-lab-admin@{}", cp.name());
    // A missing entry in the list is skipped, as kubectl does.
    let list = format!(
        "{}:{}:{}",
        a.display(),
        s.0.join("missing.yaml").display(),
        b.display()
    );
    let env = UserEnv::current()
        .expect("env")
        .with_var("KUBECONFIG", &list)
        .with_var("HOME", s.0.join("no-home"));

    let flags = KubeFlags {
        context: Some(lab_context.clone()),
        namespace: Some("kvpn-system".into()),
        ..Default::default()
    };
    let conn = kubeconfig::connect(&flags, &env)
        .await
        .expect("connect via --context from b");
    let d = &conn.description;
    eprintln!("{d}");
    assert_eq!(d.context, lab_context);
    assert_eq!(d.server, cp.server_url());
    assert_eq!(d.context_file, b);
    assert_eq!(
        d.kubeconfig,
        vec![a.clone(), b.clone()],
        "files read, missing one skipped"
    );
    assert_eq!(d.namespace, "kvpn-system");
    assert_eq!(d.server_version.as_deref(), Some("v1.20.2"));
    assert_eq!(conn.client.default_namespace(), "kvpn-system");
    assert_lab_namespaces(&namespace_names(conn.client.clone()).await);

    // Without --context the first file's current-context wins (b's is ignored),
    // and that cluster is unreachable: the error names server and context.
    let t = KubeTarget::resolve(&KubeFlags::default(), &env).expect("resolve");
    assert_eq!(t.selection.context, "a-ctx");
    assert_eq!(t.selection.namespace, "default");
    let e = kubeconfig::connect_target(t)
        .await
        .expect_err("a-ctx is unreachable");
    let msg = e.to_string();
    assert!(matches!(e, Error::Unreachable { .. }), "{msg}");
    assert!(
        msg.starts_with("cannot reach the API server https://127.0.0.1:9 of context \"a-ctx\""),
        "{msg}"
    );

    // A context in neither file: the error lists the files read and what exists.
    let e = KubeTarget::resolve(
        &KubeFlags {
            context: Some("nope".into()),
            ..Default::default()
        },
        &env,
    )
    .expect_err("unknown context");
    assert_eq!(
        e.to_string(),
        format!(
            "context \"nope\" not found in kubeconfig {}:{} — available: a-ctx, {lab_context}; pick one with --context",
            a.display(),
            b.display()
        )
    );
}

/// kube-02: a kubeconfig in `cfg/` whose user is the exec plugin
/// `./get-token.sh` and whose CA is `ca.crt`, both relative to `cfg/`, used
/// from another working folder with a relative `--kubeconfig`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_02_relative_exec_plugin_and_ca_from_another_folder() {
    let id = unique();
    let s = Scratch::new("kube02", &id);
    let cp = start_lab(&s, &id).await;
    let cfg = s.0.join("cfg");
    let work = s.0.join("work");
    mkdirs(&cfg);
    mkdirs(&work);
    std::fs::copy(cp.ca_file(), cfg.join("ca.crt")).expect("copy CA");
    write(&cfg.join("cred.json"), &admin_exec_credential(&cp));
    // The plugin finds its credential next to itself and records that it ran.
    write_exe(
        &cfg.join("get-token.sh"),
        "#!/bin/sh\nd=$(dirname \"$0\")\necho ran >> \"$d/ran\"\nexec cat \"$d/cred.json\"\n",
    );
    write(
        &cfg.join("config"),
        &exec_kubeconfig("rel", &cp.server_url(), "ca.crt", "./get-token.sh"),
    );

    let env = UserEnv::current()
        .expect("env")
        .with_cwd(&work)
        .without_var("KUBECONFIG");
    assert_ne!(
        std::env::current_dir().expect("cwd"),
        work,
        "the test process runs elsewhere"
    );
    let flags = KubeFlags {
        kubeconfig: Some("../cfg/config".into()),
        ..Default::default()
    };
    let conn = kubeconfig::connect(&flags, &env)
        .await
        .expect("connect with the relative plugin");
    eprintln!("{}", conn.description);
    assert_eq!(
        conn.description.auth,
        format!(
            "exec plugin {}",
            work.join("../cfg/./get-token.sh").display()
        )
    );
    assert_eq!(conn.description.context_file, work.join("../cfg/config"));
    assert_lab_namespaces(&namespace_names(conn.client.clone()).await);
    assert!(cfg.join("ran").exists(), "the plugin ran");

    // A failing plugin: the error names it and says what to do.
    write_exe(
        &cfg.join("get-token.sh"),
        "#!/bin/sh\necho 'token expired' >&2\nexit 3\n",
    );
    let e = kubeconfig::connect(&flags, &env)
        .await
        .expect_err("plugin fails");
    let msg = e.to_string();
    assert!(matches!(e, Error::PluginFailed { .. }), "{msg}");
    assert!(
        msg.contains("get-token.sh") && msg.contains("run it by hand"),
        "{msg}"
    );
}

/// kube-03: the exec plugin exists only in `~/bin` of the user's (temporary)
/// HOME, which is on the user's PATH but not on this process's. The plugin
/// reads its credential from `$HOME`, so it also proves it got the user's HOME.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_03_exec_plugin_found_on_the_users_path() {
    let id = unique();
    let s = Scratch::new("kube03", &id);
    let cp = start_lab(&s, &id).await;
    let home = s.0.join("home");
    mkdirs(&home.join("bin"));
    mkdirs(&home.join(".kube"));
    let plugin = format!("kvpn-auth-{id}");
    write_exe(
        &home.join("bin").join(&plugin),
        "#!/bin/sh\nexec cat \"$HOME/.kube/cred.json\"\n",
    );
    write(&home.join(".kube/cred.json"), &admin_exec_credential(&cp));
    let ca = cp.ca_file().display().to_string();
    write(
        &home.join(".kube/config"),
        &exec_kubeconfig("home", &cp.server_url(), &ca, &plugin),
    );

    let process_path = std::env::var("PATH").unwrap_or_default();
    assert!(!process_path.contains(&home.display().to_string()));
    let user_path = format!(
        "{}:/usr/local/bin:/usr/bin:/bin",
        home.join("bin").display()
    );
    let env = UserEnv::current()
        .expect("env")
        .without_var("KUBECONFIG")
        .with_var("HOME", &home)
        .with_var("PATH", &user_path);
    // No --kubeconfig, no KUBECONFIG: ~/.kube/config of the user's HOME.
    let conn = kubeconfig::connect(&KubeFlags::default(), &env)
        .await
        .expect("connect");
    eprintln!("{}", conn.description);
    assert_eq!(conn.description.kubeconfig, vec![home.join(".kube/config")]);
    assert_eq!(
        conn.description.auth,
        format!("exec plugin {}", home.join("bin").join(&plugin).display())
    );
    assert_lab_namespaces(&namespace_names(conn.client.clone()).await);

    // The same user without ~/bin on PATH: not found, and the error shows the PATH searched.
    let env = env.with_var("PATH", "/usr/local/bin:/usr/bin:/bin");
    let e = KubeTarget::resolve(&KubeFlags::default(), &env).expect_err("not on PATH");
    assert_eq!(
        e.to_string(),
        format!(
            "exec auth plugin \"{plugin}\" of user \"home-user\" (in {}) not found on PATH /usr/local/bin:/usr/bin:/bin \
             — install it or add its folder to PATH",
            home.join(".kube/config").display()
        )
    );
}

/// A temporary local user, removed with its home on drop.
struct TempUser {
    name: String,
    home: PathBuf,
}

impl TempUser {
    fn create(id: &str) -> Self {
        let name = format!("kvpn-t{id}");
        let home = std::env::temp_dir().join(&name);
        let mut last = String::new();
        // useradd fails while another process holds /etc/passwd's lock: retry.
        for _ in 0..20 {
            let out = Command::new("useradd")
                .args(["--create-home", "--home-dir"])
                .arg(&home)
                .args(["--shell", "/bin/sh", "--user-group", &name])
                .output()
                .expect("run useradd");
            if out.status.success() {
                return TempUser { name, home };
            }
            last = String::from_utf8_lossy(&out.stderr).into_owned();
            std::thread::sleep(std::time::Duration::from_millis(250));
        }
        panic!("useradd {name} failed: {last}");
    }

    fn chown_home(&self) {
        let st = Command::new("chown")
            .arg("-R")
            .arg(format!("{0}:{0}", self.name))
            .arg(&self.home)
            .status()
            .expect("run chown");
        assert!(st.success(), "chown -R {}", self.home.display());
    }
}

impl Drop for TempUser {
    fn drop(&mut self) {
        for _ in 0..20 {
            match Command::new("userdel")
                .args(["--remove", &self.name])
                .output()
            {
                Ok(o) if o.status.success() => break,
                Ok(o) => eprintln!(
                    "userdel {}: {}",
                    self.name,
                    String::from_utf8_lossy(&o.stderr)
                ),
                Err(e) => eprintln!("userdel {}: {e}", self.name),
            }
            std::thread::sleep(std::time::Duration::from_millis(250));
        }
        let _ = std::fs::remove_dir_all(&self.home);
    }
}

/// kube-04: as root with SUDO_USER set to a real (temporary) user, kvpn uses that
/// user's `~/.kube/config` (pointing at the lab) and `~/.config/kvpn`, not
/// root's (HOME set to a folder whose kubeconfig points elsewhere), and runs the
/// user's exec plugin — found in the user's `~/bin` — as that user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_04_sudo_uses_the_invoking_users_kubeconfig_and_config_dir() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "kube-04 needs root (CI runs as root)"
    );
    let id = unique();
    let s = Scratch::new("kube04", &id);
    let cp = start_lab(&s, &id).await;
    let user = TempUser::create(&id);
    let acct = kubeconfig::Account::by_name(&user.name)
        .expect("getpwnam")
        .expect("user exists");
    assert_eq!(acct.home, user.home);

    // The user's side: kubeconfig -> lab, plugin in ~/bin recording who ran it.
    let home = &user.home;
    mkdirs(&home.join("bin"));
    mkdirs(&home.join(".kube"));
    write_exe(
        &home.join("bin/kvpn-auth"),
        "#!/bin/sh\n{ id -u; echo \"$HOME\"; } > \"$HOME/plugin-ran-as\"\nexec cat \"$HOME/.kube/cred.json\"\n",
    );
    write(&home.join(".kube/cred.json"), &admin_exec_credential(&cp));
    let user_ctx = format!("user-ctx-{id}");
    let ca = cp.ca_file().display().to_string();
    write(
        &home.join(".kube/config"),
        &exec_kubeconfig(&user_ctx, &cp.server_url(), &ca, "kvpn-auth"),
    );
    user.chown_home();
    std::fs::set_permissions(
        home.join(".kube/cred.json"),
        std::fs::Permissions::from_mode(0o600),
    )
    .expect("chmod");

    // Root's side: its own kubeconfig points elsewhere.
    let root_home = s.0.join("root-home");
    mkdirs(&root_home.join(".kube"));
    write(
        &root_home.join(".kube/config"),
        &elsewhere_kubeconfig("root-ctx"),
    );

    // What sudo leaves: secure_path PATH, root's HOME, SUDO_* variables.
    let env = UserEnv::current()
        .expect("env")
        .without_var("KUBECONFIG")
        .with_var("HOME", &root_home)
        .with_var("XDG_CONFIG_HOME", root_home.join(".config"))
        .with_var("USER", "root")
        .with_var(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        )
        .with_var("SUDO_USER", &user.name)
        .with_var("SUDO_UID", acct.uid.to_string())
        .with_var("SUDO_GID", acct.gid.to_string());

    // Control: without SUDO_USER root's own kubeconfig is the one.
    let as_root = KubeTarget::resolve(&KubeFlags::default(), &env.clone().without_var("SUDO_USER"))
        .expect("root");
    assert_eq!(as_root.selection.context, "root-ctx");

    let conn = kubeconfig::connect(&KubeFlags::default(), &env)
        .await
        .expect("connect as the sudo user");
    let d = &conn.description;
    eprintln!("{d}");
    assert_eq!(d.context, user_ctx);
    assert_eq!(d.server, cp.server_url());
    assert_eq!(d.kubeconfig, vec![home.join(".kube/config")]);
    assert_eq!(d.acting_for.as_deref(), Some(user.name.as_str()));
    assert_eq!(
        d.auth,
        format!(
            "exec plugin {} (as {} via setpriv)",
            home.join("bin/kvpn-auth").display(),
            user.name
        )
    );
    assert_lab_namespaces(&namespace_names(conn.client.clone()).await);

    // The plugin ran as the user, with the user's HOME.
    let marker = home.join("plugin-ran-as");
    let ran = std::fs::read_to_string(&marker).expect("plugin wrote its marker");
    assert_eq!(
        ran,
        format!("{}\n{}\n", acct.uid, home.display()),
        "uid and HOME of the plugin"
    );
    assert_eq!(std::fs::metadata(&marker).expect("stat").uid(), acct.uid);

    // The config folder is the user's, created owned by the user.
    assert_eq!(conn.target.config_dir, Some(home.join(".config/kvpn")));
    let dir = kubeconfig::ensure_config_dir(&env, &conn.target.acting).expect("config dir");
    assert_eq!(dir, home.join(".config/kvpn"));
    for p in [home.join(".config"), dir.clone()] {
        let m = std::fs::metadata(&p).expect("stat");
        assert_eq!(
            (m.uid(), m.gid()),
            (acct.uid, acct.gid),
            "{} owned by the user",
            p.display()
        );
    }
    assert_eq!(std::fs::metadata(&dir).expect("stat").mode() & 0o777, 0o700);
    assert!(
        !root_home.join(".config").exists(),
        "nothing written to root's config folder"
    );
    drop(conn);
    drop(cp);
}
