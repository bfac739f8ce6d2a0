//! Detected CIDRs cached in the traffic manager's ConfigMap (issue [kube-connect]
//! item 5): detection lists every pod and Service of the cluster and probes the API
//! server, which is slow on big clusters and needs reads a later, more restricted
//! user may not have. The first `kvpn connect` stores what it found under the key
//! [`CIDRS_KEY`] of ConfigMap `<manager namespace>/kvpn-manager`; later connects use
//! it unless `--redetect-cidrs` is given or the cache was written by another kvpn
//! version (whose detection may differ). Ranges that appear later (a new node's
//! podCIDR, a ClusterIP outside the cached range) still reach the laptop through the
//! manager's route stream.
//!
//! The ConfigMap belongs to the manager, which keeps its leases in another key and
//! writes the whole object with resourceVersion checks; the cache is written with a
//! JSON merge patch of this one key, so neither side loses the other's data.
//!
//! I/O: [`read`] and [`write`] talk to the API server; [`parse`] is pure.

use std::time::{SystemTime, UNIX_EPOCH};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use serde::{Deserialize, Serialize};

use crate::install::objects::MANAGER;

/// Key of the cache in the manager's ConfigMap.
pub const CIDRS_KEY: &str = "cidrs.json";

/// What one detection found, as cached.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CachedCidrs {
    /// Normalised pod CIDRs.
    pub pod: Vec<IpNet>,
    /// Normalised service CIDRs.
    pub service: Vec<IpNet>,
    /// When detection ran, seconds since the Unix epoch.
    pub detected_at: u64,
    /// The kvpn version that detected them.
    pub kvpn_version: String,
}

impl CachedCidrs {
    /// A cache entry for `pod` and `service`, detected now by this kvpn.
    pub fn now(pod: Vec<IpNet>, service: Vec<IpNet>) -> CachedCidrs {
        CachedCidrs {
            pod,
            service,
            detected_at: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            kvpn_version: env!("CARGO_PKG_VERSION").to_owned(),
        }
    }

    /// Seconds since detection (0 for a clock that went backwards).
    pub fn age_s(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
            .saturating_sub(self.detected_at)
    }
}

/// Why the cache could not be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CacheError {
    /// The key holds something that is not a cache entry.
    #[error(
        "key {CIDRS_KEY} of ConfigMap {namespace}/{MANAGER} is not a CIDR cache entry \
         ({cause}); detecting again and overwriting it"
    )]
    Malformed { namespace: String, cause: String },
    /// A cache written by another kvpn version.
    #[error(
        "the CIDRs cached in ConfigMap {namespace}/{MANAGER} were detected by kvpn \
         {theirs}, this is {ours}; detecting again"
    )]
    OtherVersion {
        namespace: String,
        theirs: String,
        ours: String,
    },
    /// The cache names no range at all.
    #[error("the CIDR cache in ConfigMap {namespace}/{MANAGER} is empty; detecting again")]
    Empty { namespace: String },
    /// Reading or writing the ConfigMap failed.
    #[error("cannot {action} ConfigMap {namespace}/{MANAGER}: {cause}")]
    Api {
        action: &'static str,
        namespace: String,
        cause: String,
    },
}

/// The cache entry of `cm` (the manager's ConfigMap in `namespace`): `Ok(None)` when
/// there is none, an error when there is one this kvpn must not use.
pub fn parse(cm: &ConfigMap, namespace: &str) -> Result<Option<CachedCidrs>, CacheError> {
    let Some(text) = cm.data.as_ref().and_then(|d| d.get(CIDRS_KEY)) else {
        return Ok(None);
    };
    let cached: CachedCidrs = serde_json::from_str(text).map_err(|e| CacheError::Malformed {
        namespace: namespace.to_owned(),
        cause: e.to_string(),
    })?;
    let ours = env!("CARGO_PKG_VERSION");
    if cached.kvpn_version != ours {
        return Err(CacheError::OtherVersion {
            namespace: namespace.to_owned(),
            theirs: cached.kvpn_version,
            ours: ours.to_owned(),
        });
    }
    if cached.pod.is_empty() && cached.service.is_empty() {
        return Err(CacheError::Empty {
            namespace: namespace.to_owned(),
        });
    }
    Ok(Some(cached))
}

/// The cached CIDRs of the manager in `namespace`, if usable.
pub async fn read(
    client: &kube::Client,
    namespace: &str,
) -> Result<Option<CachedCidrs>, CacheError> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let cm = api.get_opt(MANAGER).await.map_err(|e| CacheError::Api {
        action: "read",
        namespace: namespace.to_owned(),
        cause: e.to_string(),
    })?;
    match cm {
        Some(cm) => parse(&cm, namespace),
        None => Ok(None),
    }
}

/// Store `cached` in the manager's ConfigMap in `namespace` (merge patch of
/// [`CIDRS_KEY`] only).
pub async fn write(
    client: &kube::Client,
    namespace: &str,
    cached: &CachedCidrs,
) -> Result<(), CacheError> {
    let api_error = |action: &'static str, cause: String| CacheError::Api {
        action,
        namespace: namespace.to_owned(),
        cause,
    };
    let text = serde_json::to_string(cached).map_err(|e| api_error("encode for", e.to_string()))?;
    let patch = serde_json::json!({ "data": { CIDRS_KEY: text } });
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    api.patch(MANAGER, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|e| api_error("update", e.to_string()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cm(value: Option<&str>) -> ConfigMap {
        ConfigMap {
            data: value.map(|v| [(CIDRS_KEY.to_owned(), v.to_owned())].into()),
            ..Default::default()
        }
    }

    fn net(s: &str) -> IpNet {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn round_trip_through_the_configmap_text() {
        let c = CachedCidrs::now(vec![net("10.244.0.0/16")], vec![net("10.96.0.0/12")]);
        let text = serde_json::to_string(&c).unwrap_or_else(|e| panic!("{e}"));
        assert!(text.contains("\"detectedAt\""), "{text}");
        assert_eq!(parse(&cm(Some(&text)), "ns"), Ok(Some(c.clone())));
        assert!(c.age_s() < 5, "{}", c.age_s());
    }

    #[test]
    fn absent_key_is_no_cache() {
        assert_eq!(parse(&cm(None), "ns"), Ok(None));
        assert_eq!(parse(&ConfigMap::default(), "ns"), Ok(None));
    }

    #[test]
    fn garbage_other_version_and_empty_are_refused_with_the_configmap_named() {
        let err = parse(&cm(Some("{not json")), "kvpn-system").err();
        let Some(CacheError::Malformed { namespace, .. }) = &err else {
            panic!("{err:?}")
        };
        assert_eq!(namespace, "kvpn-system");
        assert!(
            err.as_ref()
                .map(|e| e.to_string())
                .unwrap_or_default()
                .contains("kvpn-system/kvpn-manager"),
            "{err:?}"
        );

        let mut old = CachedCidrs::now(vec![net("10.244.0.0/16")], vec![]);
        old.kvpn_version = "0.0.1-old".to_owned();
        let text = serde_json::to_string(&old).unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(
            parse(&cm(Some(&text)), "ns"),
            Err(CacheError::OtherVersion { theirs, .. }) if theirs == "0.0.1-old"
        ));

        let empty = serde_json::to_string(&CachedCidrs::now(vec![], vec![]))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(
            parse(&cm(Some(&empty)), "ns"),
            Err(CacheError::Empty { .. })
        ));
    }
}
