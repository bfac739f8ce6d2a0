//! Traffic manager install, upgrade and uninstall against the lab's real
//! kube-apiserver and kube-controller-manager (`kvpn_lab::k8s::ControlPlane`, one per
//! test on its own loopback address).
//!
//! Nothing runs pods in a bare control plane, so each test runs a *status writer*:
//! a task that plays the kubelet's reporting role only, writing `pods/status` for
//! the manager pods the controllers create (ready with a pod IP, or an image pull
//! error). The pods themselves, their ReplicaSets and the rollouts are the real
//! controllers' work. Tests with the lab's kubelet stand-in (real processes) live
//! in `install_kubelet.rs`.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kvpn_control::install::objects::{self, MANAGER, TLS_SECRET};
use kvpn_control::install::wait::WaitConfig;
use kvpn_control::install::{self, Error, InstallOptions, ManagerInfo, Outcome, Recorder};
use kvpn_lab::k8s::{self, ControlPlane, ControlPlaneConfig};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn unique() -> String {
    let mut b = [0u8; 4];
    let f = std::fs::File::open("/dev/urandom").expect("/dev/urandom");
    std::io::Read::read_exact(&mut &f, &mut b).expect("random bytes");
    format!("{:05x}", u32::from_le_bytes(b) & 0xfffff)
}

/// A folder removed on drop (declared before the control plane living in it).
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str, id: &str) -> Self {
        let p = std::env::temp_dir().join(format!("kvpn-inst-{tag}-{id}"));
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

async fn start_control_plane(scratch: &Scratch, id: &str) -> ControlPlane {
    let t0 = Instant::now();
    let cp = ControlPlane::start(ControlPlaneConfig::new(
        scratch.0.join("cp"),
        format!("kvpn-lab-{id}"),
    ))
    .await
    .expect("lab control plane starts (binaries from scripts/build-kubernetes.sh)");
    eprintln!("control plane {} ready in {:?}", cp.name(), t0.elapsed());
    cp
}

/// What the status writer reports for each new manager pod.
#[derive(Debug, Clone, Copy)]
enum PodBehaviour {
    /// Running and ready with the next pod IP 10.244.1.100+n.
    Ready,
    /// ErrImagePull, then ImagePullBackOff a second later, like a kubelet.
    BadImage,
}

/// Plays the kubelet's status reporting for manager pods in `namespace` (see the
/// module docs). Aborted on drop.
struct StatusWriter {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for StatusWriter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn ready_status(ip: &str) -> serde_json::Value {
    json!({"status": {
        "phase": "Running",
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True"},
            {"type": "ContainersReady", "status": "True"},
        ],
        "containerStatuses": [{"name": "manager", "image": "x", "imageID": "", "ready": true,
            "restartCount": 0, "state": {"running": {}}}],
    }})
}

fn waiting_status(reason: &str, message: &str) -> serde_json::Value {
    json!({"status": {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "True"}],
        "containerStatuses": [{"name": "manager", "image": "x", "imageID": "", "ready": false,
            "restartCount": 0, "state": {"waiting": {"reason": reason, "message": message}}}],
    }})
}

fn status_writer(admin: kube::Client, namespace: &str, behaviour: PodBehaviour) -> StatusWriter {
    let pods: Api<Pod> = Api::namespaced(admin, namespace);
    let next_ip = Arc::new(AtomicU32::new(100));
    let task = tokio::spawn(async move {
        let lp = ListParams::default().labels(&objects::selector());
        let mut seen: BTreeMap<String, Instant> = BTreeMap::new();
        loop {
            if let Ok(list) = pods.list(&lp).await {
                for p in list.items {
                    let name = p.metadata.name.clone().unwrap_or_default();
                    if p.metadata.deletion_timestamp.is_some() {
                        continue;
                    }
                    let first = *seen.entry(name.clone()).or_insert_with(Instant::now);
                    let phase = p.status.as_ref().and_then(|s| s.phase.clone());
                    let patch = match behaviour {
                        PodBehaviour::Ready if phase.as_deref() != Some("Running") => {
                            let n = next_ip.fetch_add(1, Ordering::Relaxed);
                            Some(ready_status(&format!("10.244.1.{n}")))
                        }
                        PodBehaviour::BadImage => {
                            Some(if first.elapsed() < Duration::from_secs(1) {
                                waiting_status(
                                    "ErrImagePull",
                                    "rpc error: pull access denied for does-not-exist, repository does not exist",
                                )
                            } else {
                                waiting_status(
                                    "ImagePullBackOff",
                                    "Back-off pulling image \"does-not-exist\"",
                                )
                            })
                        }
                        PodBehaviour::Ready => None,
                    };
                    if let Some(patch) = patch {
                        let _ = pods
                            .patch_status(&name, &PatchParams::default(), &Patch::Merge(patch))
                            .await;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    StatusWriter { task }
}

fn opts(namespace: &str, version: &str) -> InstallOptions {
    InstallOptions {
        namespace: namespace.to_owned(),
        image: install::default_image(version),
        version: version.to_owned(),
        wait: WaitConfig {
            ready_timeout: Duration::from_secs(60),
            fatal_grace: Duration::from_secs(10),
        },
        source_policy: install::SourcePolicy::Snat,
        keep_installed_policy: false,
        ..InstallOptions::default()
    }
}

fn has_kvpn_labels(meta: &ObjectMeta) -> bool {
    let l = meta.labels.clone().unwrap_or_default();
    l.get("app.kubernetes.io/name").map(String::as_str) == Some("kvpn-manager")
        && l.get("app.kubernetes.io/managed-by").map(String::as_str) == Some("kvpn")
}

fn applied_by_kvpn(meta: &ObjectMeta) -> bool {
    meta.managed_fields
        .iter()
        .flatten()
        .any(|m| m.manager.as_deref() == Some("kvpn") && m.operation.as_deref() == Some("Apply"))
}

/// Checks labels, owner annotation and field manager of one object; returns its
/// resourceVersion.
fn check_meta(what: &str, meta: &ObjectMeta, version: &str) -> String {
    assert!(has_kvpn_labels(meta), "{what}: labels {:?}", meta.labels);
    assert!(
        applied_by_kvpn(meta),
        "{what}: managedFields {:?}",
        meta.managed_fields
    );
    assert_eq!(
        objects::version_of(meta),
        Some(version),
        "{what}: owner annotation"
    );
    meta.resource_version.clone().expect("resourceVersion")
}

/// Every object of the install as the admin sees it: name → resourceVersion.
async fn installed_objects(
    admin: &kube::Client,
    ns: &str,
    version: &str,
) -> BTreeMap<String, String> {
    let mut rv = BTreeMap::new();
    let get = |what: &str, meta: &ObjectMeta, rv: &mut BTreeMap<String, String>, v: &str| {
        rv.insert(what.to_owned(), check_meta(what, meta, v));
    };
    let sa = Api::<ServiceAccount>::namespaced(admin.clone(), ns)
        .get(MANAGER)
        .await
        .expect("ServiceAccount");
    get("ServiceAccount", &sa.metadata, &mut rv, version);
    let role = Api::<Role>::namespaced(admin.clone(), ns)
        .get(MANAGER)
        .await
        .expect("Role");
    get("Role", &role.metadata, &mut rv, version);
    let rb = Api::<RoleBinding>::namespaced(admin.clone(), ns)
        .get(MANAGER)
        .await
        .expect("RoleBinding");
    get("RoleBinding", &rb.metadata, &mut rv, version);
    let cr_name = objects::cluster_role_name(ns);
    let cr = Api::<ClusterRole>::all(admin.clone())
        .get(&cr_name)
        .await
        .expect("ClusterRole");
    get("ClusterRole", &cr.metadata, &mut rv, version);
    let crb = Api::<ClusterRoleBinding>::all(admin.clone())
        .get(&cr_name)
        .await
        .expect("ClusterRoleBinding");
    get("ClusterRoleBinding", &crb.metadata, &mut rv, version);
    let cm = Api::<ConfigMap>::namespaced(admin.clone(), ns)
        .get(MANAGER)
        .await
        .expect("ConfigMap");
    get("ConfigMap", &cm.metadata, &mut rv, version);
    let svc = Api::<Service>::namespaced(admin.clone(), ns)
        .get(MANAGER)
        .await
        .expect("Service");
    get("Service", &svc.metadata, &mut rv, version);
    let dep = Api::<Deployment>::namespaced(admin.clone(), ns)
        .get(MANAGER)
        .await
        .expect("Deployment");
    get("Deployment", &dep.metadata, &mut rv, version);
    // The Secret keeps the version that generated it (kept across upgrades), and is
    // created with a plain create (parallel connects race for it), so its field
    // manager entry is an Update.
    let secret = Api::<Secret>::namespaced(admin.clone(), ns)
        .get(TLS_SECRET)
        .await
        .expect("Secret");
    assert!(has_kvpn_labels(&secret.metadata), "Secret labels");
    assert!(
        secret
            .metadata
            .managed_fields
            .iter()
            .flatten()
            .any(|m| m.manager.as_deref() == Some("kvpn")),
        "Secret written by field manager kvpn: {:?}",
        secret.metadata.managed_fields
    );
    rv.insert(
        "Secret".into(),
        secret.metadata.resource_version.clone().expect("rv"),
    );
    rv
}

/// A real TLS handshake: a server with the Secret's tls.crt/tls.key on loopback, a
/// client trusting only its ca.crt, for the Service DNS name and the ClusterIP.
async fn tls_handshake_works(secret: &Secret, server_names: &[String]) {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    let data = secret.data.as_ref().expect("secret data");
    let pem = |k: &str| data.get(k).unwrap_or_else(|| panic!("no {k}")).0.clone();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem("tls.crt"))
        .collect::<Result<_, _>>()
        .expect("tls.crt is PEM");
    let key = PrivateKeyDer::from_pem_slice(&pem("tls.key")).expect("tls.key is PEM");
    let server_config = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .expect("protocols")
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .expect("tls.key matches tls.crt");
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(&pem("ca.crt")) {
        roots
            .add(ca.expect("ca.crt is PEM"))
            .expect("ca.crt is a CA");
    }
    let client_config = Arc::new(
        rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("protocols")
            .with_root_certificates(roots)
            .with_no_client_auth(),
    );
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server_config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.expect("accept");
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                if let Ok(mut tls) = acceptor.accept(tcp).await {
                    let mut b = [0u8; 4];
                    if tls.read_exact(&mut b).await.is_ok() {
                        let _ = tls.write_all(&b).await;
                    }
                }
            });
        }
    });
    for name in server_names {
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let sn = ServerName::try_from(name.clone()).expect("server name");
        let mut tls = tokio_rustls::TlsConnector::from(client_config.clone())
            .connect(sn, tcp)
            .await
            .unwrap_or_else(|e| panic!("TLS handshake for {name} with the Secret's CA: {e}"));
        tls.write_all(b"ping").await.expect("write");
        let mut b = [0u8; 4];
        tls.read_exact(&mut b).await.expect("read");
        assert_eq!(&b, b"ping");
    }
    // A name outside the certificate is refused.
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let wrong = ServerName::try_from("kvpn-manager.elsewhere.svc").expect("name");
    assert!(
        tokio_rustls::TlsConnector::from(client_config)
            .connect(wrong, tcp)
            .await
            .is_err(),
        "a name outside the SANs must not verify"
    );
    server.abort();
}

fn lines_with(rec: &Recorder, needle: &str) -> Vec<String> {
    rec.lines()
        .into_iter()
        .filter(|l| l.contains(needle))
        .collect()
}

fn check_info(info: &ManagerInfo, ns: &str, version: &str) {
    assert_eq!(info.namespace, ns);
    assert_eq!(info.version, version);
    assert_eq!(info.image, install::default_image(version));
    assert!(
        info.pod_name.starts_with("kvpn-manager-"),
        "{}",
        info.pod_name
    );
    assert_eq!(info.server_name, format!("kvpn-manager.{ns}.svc"));
    assert!(info.ca_pem.starts_with("-----BEGIN CERTIFICATE-----"));
    assert_eq!((info.data_port, info.grpc_port), (10801, 10802));
}

async fn pod_ip_of(admin: &kube::Client, ns: &str, pod: &str) -> IpAddr {
    let p = Api::<Pod>::namespaced(admin.clone(), ns)
        .get(pod)
        .await
        .expect("pod");
    p.status
        .and_then(|s| s.pod_ip)
        .and_then(|ip| ip.parse().ok())
        .expect("pod IP")
}

/// The lab's restricted Role grants delete and the cluster-scoped verbs by these
/// names; they must be the names install uses.
#[test]
fn lab_rbac_names_match_the_installed_objects() {
    assert_eq!(k8s::rbac::MANAGER_OBJECT_NAMES, &[MANAGER, TLS_SECRET]);
    assert_eq!(
        k8s::rbac::MANAGER_CLUSTER_ROLE,
        objects::cluster_role_name(k8s::KVPN_NAMESPACE)
    );
    assert_eq!(install::DEFAULT_NAMESPACE, k8s::KVPN_NAMESPACE);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_installs_keeps_upgrades_and_uninstalls() {
    let id = unique();
    let scratch = Scratch::new("admin", &id);
    let cp = start_control_plane(&scratch, &id).await;
    let admin = cp.admin_client().await.expect("admin client");
    let ns = format!("kvpn-t-{id}");
    let _writer = status_writer(admin.clone(), &ns, PodBehaviour::Ready);

    // --- install an "older" manager: fresh namespace, every object created ----------
    let rec = Recorder::default();
    let t0 = Instant::now();
    let old = install::ensure_manager(&admin, &opts(&ns, "0.0.9"), &rec)
        .await
        .expect("install 0.0.9");
    eprintln!(
        "install took {:?}; progress:\n{}",
        t0.elapsed(),
        rec.lines().join("\n")
    );
    assert_eq!(old.outcome, Outcome::Installed);
    check_info(&old, &ns, "0.0.9");
    assert_eq!(old.pod_ip, pod_ip_of(&admin, &ns, &old.pod_name).await);
    for kind in [
        format!("Namespace {ns}"),
        "ServiceAccount kvpn-manager".into(),
        "Role kvpn-manager".into(),
        "RoleBinding kvpn-manager".into(),
        format!("ClusterRole kvpn-manager-{ns}"),
        format!("ClusterRoleBinding kvpn-manager-{ns}"),
        "ConfigMap kvpn-manager".into(),
        "Service kvpn-manager".into(),
        "Secret kvpn-manager-tls".into(),
        "Deployment kvpn-manager".into(),
    ] {
        let want = format!("Creating {kind}…");
        assert_eq!(
            lines_with(&rec, &want).len(),
            1,
            "{want} once in {:#?}",
            rec.lines()
        );
    }
    assert!(
        !lines_with(
            &rec,
            &format!("Pod {}: Running, ready (IP {})", old.pod_name, old.pod_ip)
        )
        .is_empty(),
        "pod state reported: {:#?}",
        rec.lines()
    );
    let rv_old = installed_objects(&admin, &ns, "0.0.9").await;
    let namespace = Api::<Namespace>::all(admin.clone())
        .get(&ns)
        .await
        .expect("namespace");
    assert!(has_kvpn_labels(&namespace.metadata) && applied_by_kvpn(&namespace.metadata));

    // The Secret: a CA, and a serving certificate for the Service's names and ClusterIP.
    let svc = Api::<Service>::namespaced(admin.clone(), &ns)
        .get(MANAGER)
        .await
        .expect("svc");
    let spec = svc.spec.expect("service spec");
    let cluster_ip = spec.cluster_ip.clone().expect("ClusterIP");
    assert_eq!(old.cluster_ip, Some(cluster_ip.parse().expect("ip")));
    assert_eq!(spec.type_.as_deref(), Some("ClusterIP"));
    let ports: Vec<(Option<String>, i32)> = spec
        .ports
        .unwrap_or_default()
        .into_iter()
        .map(|p| (p.name, p.port))
        .collect();
    assert_eq!(
        ports,
        vec![
            (Some("data".into()), 10801),
            (Some("grpc".into()), 10802),
            (Some("attach".into()), 10804),
            (Some("gateway".into()), 10805)
        ]
    );
    let secret = Api::<Secret>::namespaced(admin.clone(), &ns)
        .get(TLS_SECRET)
        .await
        .expect("secret");
    assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
    let ca =
        String::from_utf8(secret.data.as_ref().expect("data")["ca.crt"].0.clone()).expect("utf8");
    assert_eq!(ca, old.ca_pem, "ManagerInfo carries the Secret's CA");
    tls_handshake_works(
        &secret,
        &[
            format!("kvpn-manager.{ns}.svc"),
            format!("kvpn-manager.{ns}.svc.cluster.local"),
            cluster_ip.clone(),
        ],
    )
    .await;

    // The manager's RBAC: reads of pods/services/endpoints, its ConfigMap and Secret by name.
    let role = Api::<Role>::namespaced(admin.clone(), &ns)
        .get(MANAGER)
        .await
        .expect("role");
    let rules = role.rules.expect("rules");
    let named: Vec<_> = rules
        .iter()
        .filter_map(|r| r.resource_names.clone())
        .collect();
    assert_eq!(
        named,
        vec![
            vec!["kvpn-manager".to_owned()],
            vec!["kvpn-manager-tls".to_owned()]
        ]
    );
    let rb = Api::<RoleBinding>::namespaced(admin.clone(), &ns)
        .get(MANAGER)
        .await
        .expect("rb");
    let subject = &rb.subjects.expect("subjects")[0];
    assert_eq!(
        (subject.kind.as_str(), subject.name.as_str()),
        ("ServiceAccount", "kvpn-manager")
    );

    // --- upgrade to 0.1.0: every object re-applied, a new pod, the Secret kept -------
    let dep_before = Api::<Deployment>::namespaced(admin.clone(), &ns)
        .get(MANAGER)
        .await
        .expect("dep");
    let rec = Recorder::default();
    let t0 = Instant::now();
    let new = install::ensure_manager(&admin, &opts(&ns, "0.1.0"), &rec)
        .await
        .expect("upgrade to 0.1.0");
    eprintln!(
        "upgrade took {:?}; progress:\n{}",
        t0.elapsed(),
        rec.lines().join("\n")
    );
    assert_eq!(
        new.outcome,
        Outcome::Upgraded {
            from: Some("0.0.9".into())
        }
    );
    check_info(&new, &ns, "0.1.0");
    assert_eq!(
        lines_with(&rec, "Upgrading traffic manager v0.0.9 → v0.1.0").len(),
        1,
        "{:#?}",
        rec.lines()
    );
    assert_eq!(
        lines_with(&rec, "Updating Deployment kvpn-manager…").len(),
        1
    );
    assert!(
        lines_with(&rec, "Secret").is_empty(),
        "the Secret is kept: {:#?}",
        rec.lines()
    );
    assert_ne!(new.pod_name, old.pod_name, "the rollout made a new pod");
    let rv_new = installed_objects(&admin, &ns, "0.1.0").await;
    assert_eq!(
        rv_new["Secret"], rv_old["Secret"],
        "Secret untouched by the upgrade"
    );
    assert_eq!(new.ca_pem, old.ca_pem);
    let dep_after = Api::<Deployment>::namespaced(admin.clone(), &ns)
        .get(MANAGER)
        .await
        .expect("dep");
    assert_ne!(
        objects::template_hash(&dep_after),
        objects::template_hash(&dep_before)
    );
    let template = dep_after.spec.as_ref().expect("spec").template.clone();
    assert_eq!(
        template
            .metadata
            .as_ref()
            .and_then(|m| objects::version_of(m)),
        Some("0.1.0"),
        "pod template annotation"
    );
    assert_eq!(
        template
            .spec
            .as_ref()
            .map(|s| s.containers[0].image.clone()),
        Some(Some(install::default_image("0.1.0")))
    );
    let new_pod = Api::<Pod>::namespaced(admin.clone(), &ns)
        .get(&new.pod_name)
        .await
        .expect("new pod");
    assert_eq!(
        new_pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(objects::ANNOTATION_TEMPLATE_HASH))
            .map(String::as_str),
        objects::template_hash(&dep_after),
        "the returned pod runs the new template"
    );

    // --- same version again: a no-op that says so ----------------------------------
    let rec = Recorder::default();
    let t0 = Instant::now();
    let again = install::ensure_manager(&admin, &opts(&ns, "0.1.0"), &rec)
        .await
        .expect("ensure again");
    eprintln!("no-op ensure took {:?}", t0.elapsed());
    assert_eq!(again.outcome, Outcome::AlreadyInstalled);
    assert_eq!(again.pod_name, new.pod_name);
    assert_eq!(
        lines_with(
            &rec,
            &format!("Traffic manager v0.1.0 already installed in {ns}")
        )
        .len(),
        1,
        "{:#?}",
        rec.lines()
    );
    assert!(
        lines_with(&rec, "Creating").is_empty() && lines_with(&rec, "Updating").is_empty(),
        "{:#?}",
        rec.lines()
    );
    assert_eq!(
        installed_objects(&admin, &ns, "0.1.0").await,
        rv_new,
        "nothing written"
    );

    // --- an older kvpn leaves the newer manager alone --------------------------------
    let rec = Recorder::default();
    let older = install::ensure_manager(&admin, &opts(&ns, "0.0.5"), &rec)
        .await
        .expect("older kvpn");
    assert_eq!(
        older.outcome,
        Outcome::NewerInstalled {
            version: "0.1.0".into()
        }
    );
    assert_eq!(older.version, "0.1.0");
    assert_eq!(
        installed_objects(&admin, &ns, "0.1.0").await,
        rv_new,
        "no downgrade"
    );

    // --- a deleted object is re-created at the same version --------------------------
    Api::<Service>::namespaced(admin.clone(), &ns)
        .delete(MANAGER, &Default::default())
        .await
        .expect("delete service");
    let rec = Recorder::default();
    let repaired = install::ensure_manager(&admin, &opts(&ns, "0.1.0"), &rec)
        .await
        .expect("repair");
    assert_eq!(
        lines_with(&rec, "Creating Service kvpn-manager…").len(),
        1,
        "{:#?}",
        rec.lines()
    );
    // The new Service has another ClusterIP: the certificate follows, so the pod rolls.
    assert_ne!(repaired.cluster_ip, new.cluster_ip);
    assert_eq!(
        lines_with(&rec, "Replacing Secret kvpn-manager-tls").len(),
        1,
        "{:#?}",
        rec.lines()
    );
    assert_eq!(repaired.outcome, Outcome::Updated);
    assert_ne!(repaired.ca_pem, new.ca_pem);
    let secret = Api::<Secret>::namespaced(admin.clone(), &ns)
        .get(TLS_SECRET)
        .await
        .expect("secret");
    let ip = repaired.cluster_ip.expect("ClusterIP").to_string();
    tls_handshake_works(&secret, &[ip]).await;

    // --- uninstall: everything goes, the namespace too (kvpn created it) -------------
    let rec = Recorder::default();
    let t0 = Instant::now();
    let report = install::uninstall(&admin, &ns, &rec)
        .await
        .expect("uninstall");
    eprintln!(
        "uninstall took {:?}; progress:\n{}",
        t0.elapsed(),
        rec.lines().join("\n")
    );
    for kind in [
        "Deployment kvpn-manager",
        "Service kvpn-manager",
        "ConfigMap kvpn-manager",
        "Secret kvpn-manager-tls",
        "RoleBinding kvpn-manager",
        "Role kvpn-manager",
        "ServiceAccount kvpn-manager",
    ] {
        assert!(
            report.deleted.contains(&kind.to_owned()),
            "{kind} in {:?}",
            report.deleted
        );
        assert_eq!(
            lines_with(&rec, &format!("Deleting {kind}…")).len(),
            1,
            "{:#?}",
            rec.lines()
        );
    }
    let cr = objects::cluster_role_name(&ns);
    assert!(report.deleted.contains(&format!("ClusterRole {cr}")));
    assert!(report.deleted.contains(&format!("ClusterRoleBinding {cr}")));
    assert!(report.deleted.contains(&format!("Namespace {ns}")));
    assert!(
        Api::<ClusterRole>::all(admin.clone())
            .get_opt(&cr)
            .await
            .expect("get")
            .is_none()
    );
    assert!(
        Api::<ClusterRoleBinding>::all(admin.clone())
            .get_opt(&cr)
            .await
            .expect("get")
            .is_none()
    );
    assert!(
        Api::<Namespace>::all(admin.clone())
            .get_opt(&ns)
            .await
            .expect("get")
            .is_none()
    );
    let pods = Api::<Pod>::namespaced(admin.clone(), &ns)
        .list(&ListParams::default())
        .await
        .expect("pods");
    assert!(
        pods.items.is_empty(),
        "pods left: {:?}",
        pods.items
            .iter()
            .map(|p| &p.metadata.name)
            .collect::<Vec<_>>()
    );

    // Idempotent.
    let rec = Recorder::default();
    let report = install::uninstall(&admin, &ns, &rec)
        .await
        .expect("second uninstall");
    assert!(report.deleted.is_empty(), "{:?}", report.deleted);
    assert_eq!(
        lines_with(&rec, "nothing to remove").len(),
        1,
        "{:#?}",
        rec.lines()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restricted_user_installs_and_uninstalls_and_failures_carry_the_pods_reason() {
    let id = unique();
    let scratch = Scratch::new("user", &id);
    let cp = start_control_plane(&scratch, &id).await;
    let admin = cp.admin_client().await.expect("admin client");
    let user = cp.user_client().await.expect("restricted user client");
    let ns = k8s::KVPN_NAMESPACE;

    // --- the restricted kubeconfig is enough to install ------------------------------
    let writer = status_writer(admin.clone(), ns, PodBehaviour::Ready);
    let rec = Recorder::default();
    let t0 = Instant::now();
    let info = install::ensure_manager(&user, &opts(ns, "0.1.0"), &rec)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "restricted user installs: {e}\nprogress:\n{}",
                rec.lines().join("\n")
            )
        });
    eprintln!("restricted install took {:?}", t0.elapsed());
    assert_eq!(info.outcome, Outcome::Installed);
    check_info(&info, ns, "0.1.0");
    // kvpn-system existed (the lab made it); the user may not read namespaces.
    assert!(
        lines_with(&rec, "Namespace").is_empty(),
        "{:#?}",
        rec.lines()
    );
    installed_objects(&admin, ns, "0.1.0").await;

    // ... and to uninstall, leaving the namespace kvpn did not create.
    let rec = Recorder::default();
    let report = install::uninstall(&user, ns, &rec)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "restricted user uninstalls: {e}\nprogress:\n{}",
                rec.lines().join("\n")
            )
        });
    assert_eq!(report.deleted.len(), 9, "{:?}", report.deleted);
    assert!(
        Api::<Namespace>::all(admin.clone())
            .get_opt(ns)
            .await
            .expect("get")
            .is_some()
    );
    let lp = ListParams::default().labels(&objects::selector());
    let left = [
        Api::<Deployment>::namespaced(admin.clone(), ns)
            .list(&lp)
            .await
            .expect("list")
            .items
            .len(),
        Api::<Service>::namespaced(admin.clone(), ns)
            .list(&lp)
            .await
            .expect("list")
            .items
            .len(),
        Api::<Secret>::namespaced(admin.clone(), ns)
            .list(&lp)
            .await
            .expect("list")
            .items
            .len(),
        Api::<ConfigMap>::namespaced(admin.clone(), ns)
            .list(&lp)
            .await
            .expect("list")
            .items
            .len(),
        Api::<ServiceAccount>::namespaced(admin.clone(), ns)
            .list(&lp)
            .await
            .expect("list")
            .items
            .len(),
        Api::<Role>::namespaced(admin.clone(), ns)
            .list(&lp)
            .await
            .expect("list")
            .items
            .len(),
        Api::<RoleBinding>::namespaced(admin.clone(), ns)
            .list(&lp)
            .await
            .expect("list")
            .items
            .len(),
        Api::<Pod>::namespaced(admin.clone(), ns)
            .list(&lp)
            .await
            .expect("list")
            .items
            .len(),
    ];
    assert_eq!(left, [0; 8], "objects left after uninstall");
    assert!(
        Api::<ClusterRole>::all(admin.clone())
            .get_opt(&objects::cluster_role_name(ns))
            .await
            .expect("get")
            .is_none()
    );
    // The uninstall rights are by name: nothing else can be deleted.
    let other = Api::<ClusterRole>::all(user.clone())
        .delete(k8s::rbac::CLUSTER_ROLE, &Default::default())
        .await;
    assert!(
        matches!(&other, Err(kube::Error::Api(s)) if s.code == 403),
        "deleting another ClusterRole must be forbidden: {other:?}"
    );
    drop(writer);

    // --- an image that cannot be pulled fails with the pod's reason, early -----------
    let _writer = status_writer(admin.clone(), ns, PodBehaviour::BadImage);
    let mut bad = opts(ns, "0.1.0");
    bad.image = "does-not-exist".into();
    bad.wait.fatal_grace = Duration::from_secs(5);
    let rec = Recorder::default();
    let t0 = Instant::now();
    let err = install::ensure_manager(&user, &bad, &rec)
        .await
        .expect_err("bad image fails");
    let took = t0.elapsed();
    eprintln!(
        "bad image failed after {took:?}: {err}\nprogress:\n{}",
        rec.lines().join("\n")
    );
    assert!(matches!(err, Error::CannotStart { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.starts_with("traffic manager cannot start: pod kvpn-manager-"),
        "{msg}"
    );
    assert!(
        msg.contains("ImagePullBackOff") || msg.contains("ErrImagePull"),
        "{msg}"
    );
    assert!(
        msg.contains("pull access denied for does-not-exist"),
        "the pull error: {msg}"
    );
    assert!(
        msg.contains("the nodes cannot pull does-not-exist") && msg.contains("--image-pull-secret"),
        "the hint names the image and the fix: {msg}"
    );
    assert!(took < Duration::from_secs(20), "failed only after {took:?}");
    assert!(
        !lines_with(&rec, ": Waiting: ErrImagePull: rpc error").is_empty(),
        "{:#?}",
        rec.lines()
    );
    install::uninstall(&user, ns, &install::Quiet)
        .await
        .expect("clean up");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_installs_agree_on_one_certificate_and_one_rollout() {
    let id = unique();
    let scratch = Scratch::new("parallel", &id);
    let cp = start_control_plane(&scratch, &id).await;
    let admin = cp.admin_client().await.expect("admin client");
    let user = cp.user_client().await.expect("restricted user client");
    let ns = k8s::KVPN_NAMESPACE;
    let _writer = status_writer(admin.clone(), ns, PodBehaviour::Ready);
    const CLIENTS: usize = 6;
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let user = user.clone();
            tokio::spawn(async move {
                let rec = Recorder::default();
                let r = install::ensure_manager(&user, &opts(ns, "0.1.0"), &rec).await;
                (r, rec.lines())
            })
        })
        .collect();
    let mut infos = Vec::new();
    for t in tasks {
        let (r, lines) = t.await.expect("task");
        infos.push(r.unwrap_or_else(|e| panic!("parallel install: {e}\n{}", lines.join("\n"))));
    }
    eprintln!("{CLIENTS} parallel installs took {:?}", t0.elapsed());
    let secret = Api::<Secret>::namespaced(admin.clone(), ns)
        .get(TLS_SECRET)
        .await
        .expect("secret");
    let ca =
        String::from_utf8(secret.data.as_ref().expect("data")["ca.crt"].0.clone()).expect("utf8");
    for info in &infos {
        assert_eq!(info.ca_pem, ca, "every client trusts the CA in the Secret");
        assert_eq!(info.pod_name, infos[0].pod_name, "one manager pod");
    }
    let dep = Api::<Deployment>::namespaced(admin.clone(), ns)
        .get(MANAGER)
        .await
        .expect("dep");
    let fingerprint = dep
        .spec
        .and_then(|s| s.template.metadata)
        .and_then(|m| m.annotations)
        .and_then(|a| a.get(objects::ANNOTATION_TLS_FINGERPRINT).cloned());
    assert_eq!(
        fingerprint,
        Some(objects::digest(ca.as_bytes())),
        "the pod mounts that CA"
    );
    let replica_sets = Api::<k8s_openapi::api::apps::v1::ReplicaSet>::namespaced(admin.clone(), ns)
        .list(&ListParams::default().labels(&objects::selector()))
        .await
        .expect("replica sets");
    assert_eq!(
        replica_sets.items.len(),
        1,
        "one pod template, no certificate churn"
    );
    install::uninstall(&user, ns, &install::Quiet)
        .await
        .expect("clean up");

    // The Secret step alone, many at once on an empty namespace: every caller
    // races for the create, the losers read the winner's Secret.
    let ip: IpAddr = "10.96.0.77".parse().expect("ip");
    let t0 = Instant::now();
    let start = Arc::new(tokio::sync::Barrier::new(CLIENTS));
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let user = user.clone();
            let start = start.clone();
            tokio::spawn(async move {
                let rec = Recorder::default();
                start.wait().await;
                let r = install::ensure_tls_secret(&user, &opts(ns, "0.1.0"), Some(ip), &rec).await;
                (r, rec.lines())
            })
        })
        .collect();
    let mut creators = 0;
    let mut cas = Vec::new();
    for t in tasks {
        let (r, lines) = t.await.expect("task");
        creators += lines
            .iter()
            .filter(|l| l.contains("Creating Secret"))
            .count();
        cas.push(r.unwrap_or_else(|e| panic!("secret step: {e}")).ca_pem);
    }
    eprintln!(
        "{CLIENTS} parallel Secret steps: {creators} create attempts, {:?}",
        t0.elapsed()
    );
    let stored = install::read_tls(&user, ns)
        .await
        .expect("read")
        .expect("a Secret");
    assert!(
        cas.iter().all(|c| *c == stored.ca_pem),
        "all callers return the stored CA"
    );
    assert!(
        creators >= 2,
        "the callers raced ({creators} create attempts)"
    );
    install::uninstall(&user, ns, &install::Quiet)
        .await
        .expect("clean up");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_nobody_runs_times_out_with_its_last_state() {
    let id = unique();
    let scratch = Scratch::new("timeout", &id);
    let cp = start_control_plane(&scratch, &id).await;
    let admin = cp.admin_client().await.expect("admin client");
    let ns = format!("kvpn-t-{id}");
    let mut o = opts(&ns, "0.1.0");
    o.wait.ready_timeout = Duration::from_secs(4);
    let rec = Recorder::default();
    let t0 = Instant::now();
    let err = install::ensure_manager(&admin, &o, &rec)
        .await
        .expect_err("nothing runs pods");
    let took = t0.elapsed();
    let msg = err.to_string();
    eprintln!("timed out after {took:?}: {msg}");
    assert!(matches!(err, Error::NotReady { .. }), "{err:?}");
    assert!(msg.contains("not ready after 4s"), "{msg}");
    assert!(
        msg.contains("Pending (not scheduled to a node yet)"),
        "{msg}"
    );
    assert!(took < Duration::from_secs(15), "{took:?}");
    assert!(
        !lines_with(&rec, "Pending (not scheduled to a node yet)").is_empty(),
        "{:#?}",
        rec.lines()
    );
    install::uninstall(&admin, &ns, &install::Quiet)
        .await
        .expect("clean up");
}
