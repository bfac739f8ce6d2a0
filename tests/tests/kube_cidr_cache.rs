//! Detected CIDRs are cached in the manager's ConfigMap ([kube-connect] item 5):
//! the first connect detects and caches, later connects use the cache (so a range
//! only the cache names is routed), `--redetect-cidrs` detects again and rewrites
//! it, and a damaged cache is named in a warning, detected over and repaired —
//! all against the lab's real kube-apiserver with the restricted user's kubeconfig.

use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use kvpn_tests::kube_lab::{KubeFixture, MANAGER_NAMESPACE};

const CIDRS_KEY: &str = "cidrs.json";
/// A range no detection step can find in the lab: routed only if the cache is used.
const PLANTED: &str = "10.200.0.0/16";

fn configmap_data(f: &KubeFixture) -> std::collections::BTreeMap<String, String> {
    let api: Api<ConfigMap> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    f.block_on(api.get("kvpn-manager"))
        .unwrap_or_else(|e| panic!("get ConfigMap kvpn-manager: {e}"))
        .data
        .unwrap_or_default()
}

fn cache(f: &KubeFixture) -> serde_json::Value {
    let data = configmap_data(f);
    let text = data
        .get(CIDRS_KEY)
        .unwrap_or_else(|| panic!("no {CIDRS_KEY} in ConfigMap kvpn-manager: {data:?}"));
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{CIDRS_KEY}: {e}: {text}"))
}

fn set_cache(f: &KubeFixture, text: &str) {
    let api: Api<ConfigMap> = Api::namespaced(f.admin(), MANAGER_NAMESPACE);
    let patch = serde_json::json!({ "data": { CIDRS_KEY: text } });
    f.block_on(api.patch(
        "kvpn-manager",
        &PatchParams::default(),
        &Patch::Merge(&patch),
    ))
    .unwrap_or_else(|e| panic!("patch ConfigMap kvpn-manager: {e}"));
}

fn routed(f: &KubeFixture, cidr: &str) -> bool {
    f.laptop_routes().iter().any(|r| r.starts_with(cidr))
}

fn strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn detected_cidrs_are_cached_used_redetected_and_repaired() {
    let f = KubeFixture::new();

    // 1. First connect: detects (the lab node's podCIDR and the service CIDR), caches
    // next to the manager's leases.
    let out = f.connect_restricted();
    assert!(
        out.contains("Detecting the cluster's pod and service CIDRs"),
        "{out}"
    );
    assert!(
        out.contains("cached in ConfigMap kvpn-system/kvpn-manager"),
        "{out}"
    );
    f.wait_state("connected", Duration::from_secs(15));
    let first = cache(&f);
    assert_eq!(strings(&first["pod"]), ["10.244.1.0/24"], "{first}");
    assert_eq!(strings(&first["service"]), ["10.96.0.0/12"], "{first}");
    assert_eq!(first["kvpnVersion"], env!("CARGO_PKG_VERSION"), "{first}");
    assert!(
        !f.stored_leases().is_empty(),
        "the cache write left the manager's leases (Lease objects) alone"
    );
    assert!(!routed(&f, PLANTED));
    f.kvpn_ok(&["disconnect", "--all"]);

    // 2. A cached range is used as is: plant one detection would never find.
    let mut planted = first.clone();
    planted["service"] = serde_json::json!(["10.96.0.0/12", PLANTED]);
    set_cache(&f, &planted.to_string());
    let out = f.connect_restricted();
    assert!(
        out.contains("Using the cluster's CIDRs cached by an earlier connect"),
        "{out}"
    );
    assert!(!out.contains("Detecting the cluster's"), "{out}");
    f.wait_state("connected", Duration::from_secs(15));
    assert!(
        routed(&f, PLANTED),
        "the cached range is routed: {:?}",
        f.laptop_routes()
    );
    f.kvpn_ok(&["disconnect", "--all"]);

    // 3. --redetect-cidrs ignores the cache and rewrites it.
    let kubeconfig = f.user_kubeconfig();
    let out = f.kvpn_ok(&["connect", "--kubeconfig", &kubeconfig, "--redetect-cidrs"]);
    assert!(
        out.contains("Detecting the cluster's pod and service CIDRs"),
        "{out}"
    );
    f.wait_state("connected", Duration::from_secs(15));
    assert!(!routed(&f, PLANTED), "{:?}", f.laptop_routes());
    assert_eq!(
        strings(&cache(&f)["service"]),
        ["10.96.0.0/12"],
        "cache rewritten"
    );
    f.kvpn_ok(&["disconnect", "--all"]);

    // 4. A damaged cache is named, detected over and repaired.
    set_cache(&f, "{not json");
    let out = f.kvpn(&["connect", "--kubeconfig", &kubeconfig]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let all = format!("{stdout}{stderr}");
    assert!(
        all.contains(
            "key cidrs.json of ConfigMap kvpn-system/kvpn-manager is not a CIDR cache entry"
        ),
        "{all}"
    );
    assert!(all.contains("Detecting the cluster's"), "{all}");
    assert_eq!(strings(&cache(&f)["pod"]), ["10.244.1.0/24"], "repaired");
    f.wait_state("connected", Duration::from_secs(15));
}
