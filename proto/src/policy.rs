//! The traffic manager's client-source policy (`kvpn-manager --source-policy`,
//! `kvpn connect --source-policy`, `Origin.source_policy` on the wire): whose
//! address the cluster's backends see. One definition for the manager and the
//! laptop side; docs/source-policy.md explains the choice.
//! With the `clap` feature it is a `clap::ValueEnum` (the CLIs' flags).

use std::fmt;
use std::str::FromStr;

/// Whose address the cluster's backends see.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SourcePolicy {
    /// The manager pod's IP: smoltcp terminates, kernel sockets dial. Unprivileged.
    #[default]
    Snat,
    /// The laptop's tunnel IP: the pod's kernel forwards the packets as they are.
    /// NET_ADMIN and NET_RAW; the nodes route the tunnel pool via the stable gateway.
    Preserve,
    /// The manager pod's IP, rewritten by kvpn's TC programs on the pod's `eth0`
    /// (no termination). CAP_BPF and CAP_NET_ADMIN (NET_RAW for `kvpn diagnose
    /// source`'s egress capture); nothing on the nodes.
    EbpfSnat,
}

impl SourcePolicy {
    /// Every policy, in the order the flags list them.
    pub const ALL: [SourcePolicy; 3] = [
        SourcePolicy::Snat,
        SourcePolicy::Preserve,
        SourcePolicy::EbpfSnat,
    ];

    /// The wire and flag name: `snat`, `preserve`, `ebpf-snat`.
    pub fn as_str(self) -> &'static str {
        match self {
            SourcePolicy::Snat => "snat",
            SourcePolicy::Preserve => "preserve",
            SourcePolicy::EbpfSnat => "ebpf-snat",
        }
    }

    /// One line for `--help`.
    pub fn help(self) -> &'static str {
        match self {
            SourcePolicy::Snat => {
                "The manager pod's IP (smoltcp terminates and redials). Unprivileged"
            }
            SourcePolicy::Preserve => {
                "The laptop's tunnel IP (the pod's kernel forwards). NET_ADMIN and NET_RAW; \
                 the nodes route the tunnel pool via the stable gateway"
            }
            SourcePolicy::EbpfSnat => {
                "The manager pod's IP, rewritten by kvpn's TC programs on the pod's eth0 \
                 (no termination). BPF and NET_ADMIN; nothing on the nodes"
            }
        }
    }
}

impl fmt::Display for SourcePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A source policy name that is not `snat`, `preserve` or `ebpf-snat`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown source policy {0:?} — give snat, preserve or ebpf-snat")]
pub struct UnknownSourcePolicy(pub String);

impl FromStr for SourcePolicy {
    type Err = UnknownSourcePolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SourcePolicy::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| UnknownSourcePolicy(s.to_owned()))
    }
}

#[cfg(feature = "clap")]
impl clap::ValueEnum for SourcePolicy {
    fn value_variants<'a>() -> &'a [Self] {
        &SourcePolicy::ALL
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(clap::builder::PossibleValue::new(self.as_str()).help(self.help()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_snat_is_the_default() {
        for p in SourcePolicy::ALL {
            assert_eq!(p.as_str().parse::<SourcePolicy>(), Ok(p));
            assert_eq!(p.to_string(), p.as_str());
        }
        assert_eq!(SourcePolicy::default(), SourcePolicy::Snat);
        assert_eq!(
            "SNAT".parse::<SourcePolicy>(),
            Err(UnknownSourcePolicy("SNAT".into()))
        );
    }

    #[cfg(feature = "clap")]
    #[test]
    fn clap_values_are_the_wire_names() {
        for p in SourcePolicy::ALL {
            assert_eq!(
                <SourcePolicy as clap::ValueEnum>::from_str(p.as_str(), false),
                Ok(p)
            );
        }
    }
}
