//! A session's watched routes and cluster information: what the session agent
//! reports through UpdateRoutes from the traffic manager's route watch (routes
//! added and removed while the session runs, where the routes come from, the
//! cluster DNS settings and Services).
//!
//! I/O: rtnetlink route add/delete through the session's TUN device (protocol
//! [`crate::netlink::RTPROT_KVPN`], like Connect's routes) and the session's
//! eBPF classifier (LPM entries). The decisions are [`routes::plan_update`]'s.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

use ipnet::IpNet;
use kvpn_proto::dataplane as api;

use crate::conflicts;
use crate::ebpf::RouteKind;
use crate::netlink::{Netlink, RTPROT_KVPN};
use crate::routes;
use crate::session::{AttachedClassifier, kind_from_api};

/// What the route watch reported for one session.
#[derive(Debug, Default, Clone)]
pub struct Watched {
    /// Watched routes installed (kernel route and classifier entry).
    pub routes: BTreeMap<IpNet, RouteKind>,
    /// Where the routes come from; `None` until reported.
    pub source: Option<api::RouteSource>,
    /// The cluster DNS settings; `None` until reported.
    pub dns: Option<api::ClusterDns>,
    /// Services by namespace/name.
    pub services: BTreeMap<(String, String), api::ClusterService>,
    /// Classifier entries of single ClusterIPs (`/32`, `/128`), so that `kvpn top`
    /// counts each Service on its own: the address → its Services
    /// ("namespace/name"). No kernel routes: the Service route covers them.
    pub service_entries: BTreeMap<IpNet, Vec<String>>,
    /// Cluster ranges (Connect or watched) not installed as kernel routes
    /// because a main-table laptop route has the same prefix (override only,
    /// [`crate::conflicts`]); their classifier entries exist.
    pub not_installed: BTreeMap<IpNet, RouteKind>,
    /// Watched additions refused because they overlap a laptop route and the
    /// session has no override.
    pub refused: BTreeMap<IpNet, RouteKind>,
    /// Host routes (`/32`, `/128`) of ClusterIPs inside conflicting laptop
    /// routes, installed through the TUN device (override only).
    pub pinned: BTreeSet<IpNet>,
}

/// At most this many ClusterIP entries per classifier, so that Services never take
/// all per-route counter slots (`kvpn top`) from routes
/// ([`kvpn_dataplane_common::MAX_ROUTE_COUNTERS`] = 1024; the tries themselves hold
/// [`kvpn_dataplane_common::MAX_ROUTES`] = 16384 entries).
pub const MAX_SERVICE_ENTRIES: usize = 512;

/// The ClusterIP entries `services` call for: each ClusterIP inside a Service
/// route of `routes` (the longest covering one not being the address itself),
/// with its Services, at most [`MAX_SERVICE_ENTRIES`] (the lowest addresses).
pub fn service_entries<'a>(
    routes: &[(IpNet, RouteKind)],
    services: impl IntoIterator<Item = &'a api::ClusterService>,
) -> BTreeMap<IpNet, Vec<String>> {
    let mut out: BTreeMap<IpNet, Vec<String>> = BTreeMap::new();
    for svc in services {
        for ip in &svc.cluster_ips {
            let Ok(ip) = ip.parse::<IpAddr>() else {
                continue;
            };
            let host = IpNet::from(ip);
            let covering = routes
                .iter()
                .filter(|(net, _)| net.contains(&ip))
                .max_by_key(|(net, _)| net.prefix_len());
            match covering {
                Some((net, RouteKind::Service)) if *net != host => {}
                _ => continue,
            }
            out.entry(host)
                .or_default()
                .push(format!("{}/{}", svc.namespace, svc.name));
        }
    }
    while out.len() > MAX_SERVICE_ENTRIES {
        out.pop_last();
    }
    for names in out.values_mut() {
        names.sort();
        names.dedup();
    }
    out
}

/// The shared classifier slot of a session (`None` without a classifier).
pub type ClassifierSlot = Arc<Mutex<Option<Box<dyn AttachedClassifier>>>>;

/// Everything UpdateRoutes needs of a session, cloned out of the session table
/// so that no lock is held across netlink calls.
#[derive(Clone)]
pub struct WatchHandle {
    pub ifindex: u32,
    /// The session's tunnel IPs (IPv4, and IPv6 for a dual-stack session):
    /// preferred sources of its routes.
    pub tunnel_ips: Vec<IpAddr>,
    /// The Connect routes (kernel routes).
    pub connect: Vec<(IpNet, RouteKind)>,
    /// Steer around route conflicts instead of refusing them (rt-05).
    pub allow_route_conflict: bool,
    pub classifier: ClassifierSlot,
    pub state: Arc<Mutex<Watched>>,
    /// Serialises UpdateRoutes calls of one session.
    pub update_lock: Arc<tokio::sync::Mutex<()>>,
}

/// Why an UpdateRoutes request failed.
#[derive(Debug, thiserror::Error)]
pub enum UpdateError {
    /// A CIDR or kind in the request is invalid.
    #[error("{0}")]
    Invalid(String),
    /// Installing or removing a route failed; earlier changes of the request stay.
    #[error("{0}")]
    Apply(String),
}

fn parse_routes(
    routes: &[api::Route],
    need_kind: bool,
) -> Result<Vec<(IpNet, RouteKind)>, UpdateError> {
    routes
        .iter()
        .map(|r| {
            let cidr: IpNet = r.cidr.parse().map_err(|_| {
                UpdateError::Invalid(format!(
                    "invalid CIDR {:?} — give it as ADDRESS/PREFIX, e.g. 10.244.7.0/24",
                    r.cidr
                ))
            })?;
            let kind = match kind_from_api(r.kind) {
                Some(k) => k,
                None if !need_kind => RouteKind::Extra,
                None => {
                    return Err(UpdateError::Invalid(format!(
                        "route {} has no kind — set pod, service or extra",
                        r.cidr
                    )));
                }
            };
            Ok((cidr, kind))
        })
        .collect()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The state stays consistent even if a Status call panicked mid-read.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl WatchHandle {
    /// Make the classifier's ClusterIP entries `wanted`. Best effort: they only
    /// feed `kvpn top`, so a failure is logged and the entry left out.
    fn sync_service_entries(&self, st: &mut Watched, wanted: BTreeMap<IpNet, Vec<String>>) {
        let mut classifier = lock(&self.classifier);
        let Some(c) = classifier.as_mut() else {
            st.service_entries = wanted;
            return;
        };
        for net in st.service_entries.keys() {
            if !wanted.contains_key(net)
                && !st.routes.contains_key(net)
                && let Err(e) = c.remove_route(*net)
            {
                tracing::debug!(cidr = %net, error = %e, "cannot remove a ClusterIP entry");
            }
        }
        let mut installed = BTreeMap::new();
        for (net, names) in wanted {
            if st.service_entries.contains_key(&net) {
                installed.insert(net, names);
                continue;
            }
            match c.insert_route(net, RouteKind::Service) {
                Ok(()) => {
                    installed.insert(net, names);
                }
                Err(e) => {
                    tracing::debug!(cidr = %net, error = %e, "cannot add a ClusterIP entry");
                }
            }
        }
        st.service_entries = installed;
    }

    /// Make the pinned host routes (override of a route conflict) the known
    /// ClusterIPs inside the laptop routes that conflict with the session's
    /// ranges. Best effort: a failure is logged and the address stays with
    /// the laptop's route.
    async fn sync_pinned(&self, netlink: &Netlink, laptop: &[conflicts::LaptopRoute]) {
        let (wanted, current) = {
            let st = lock(&self.state);
            let ranges: Vec<(IpNet, RouteKind)> = self
                .connect
                .iter()
                .copied()
                .chain(st.routes.iter().map(|(n, k)| (*n, *k)))
                .chain(st.not_installed.iter().map(|(n, k)| (*n, *k)))
                .collect();
            let found = conflicts::find(&ranges, laptop, RTPROT_KVPN, Some(self.ifindex));
            let ips: Vec<IpAddr> = st
                .services
                .values()
                .flat_map(|s| s.cluster_ips.iter().filter_map(|ip| ip.parse().ok()))
                .collect();
            let mut wanted = conflicts::pinned_hosts(&found, ips.iter());
            while wanted.len() > MAX_SERVICE_ENTRIES {
                wanted.pop_last();
            }
            (wanted, st.pinned.clone())
        };
        let mut now = current.clone();
        for net in current.difference(&wanted) {
            match netlink.del_route(self.ifindex, *net).await {
                Ok(()) => {}
                Err(e) if e.errno == Some(libc::ESRCH) => {}
                Err(e) => {
                    tracing::warn!(cidr = %net, error = %e, "cannot delete a pinned ClusterIP route");
                    continue;
                }
            }
            now.remove(net);
        }
        for net in wanted.difference(&current) {
            match netlink
                .add_route(self.ifindex, *net, &self.tunnel_ips)
                .await
            {
                Ok(()) => {
                    tracing::info!(cidr = %net, "ClusterIP pinned through the TUN device past a conflicting laptop route");
                    now.insert(*net);
                }
                Err(e) => {
                    tracing::warn!(cidr = %net, error = %e, "cannot pin a ClusterIP route");
                }
            }
        }
        lock(&self.state).pinned = now;
    }

    /// Apply an UpdateRoutes request: removals, then additions, then the
    /// reported source, DNS settings and Services.
    pub async fn update(
        &self,
        netlink: &Netlink,
        req: &api::UpdateRoutesRequest,
    ) -> Result<api::UpdateRoutesResponse, UpdateError> {
        let mut add = parse_routes(&req.add, true)?;
        let remove: Vec<IpNet> = parse_routes(&req.remove, false)?
            .into_iter()
            .map(|(c, _)| c)
            .collect();
        let _serial = self.update_lock.lock().await;
        let laptop = netlink
            .laptop_routes()
            .await
            .map_err(|e| UpdateError::Apply(format!("cannot check route conflicts: {e}")))?;
        let mut conflict_msgs = Vec::new();
        {
            let mut st = lock(&self.state);
            for net in &remove {
                st.refused.remove(&net.trunc());
                if st.not_installed.remove(&net.trunc()).is_some()
                    && let Some(c) = lock(&self.classifier).as_mut()
                    && let Err(e) = c.remove_route(net.trunc())
                {
                    tracing::warn!(cidr = %net, error = %e, "cannot remove a classifier entry");
                }
            }
            // Additions a Connect route covers were checked at Connect.
            let fresh: Vec<(IpNet, RouteKind)> = add
                .iter()
                .filter(|(n, _)| !self.connect.iter().any(|(c, _)| c.contains(n)))
                .copied()
                .collect();
            let found = conflicts::find(&fresh, &laptop, RTPROT_KVPN, Some(self.ifindex));
            add.retain(|(net, kind)| {
                let net = net.trunc();
                let mine: Vec<&conflicts::Conflict> =
                    found.iter().filter(|c| c.cluster == net).collect();
                if mine.is_empty() {
                    return true;
                }
                if !self.allow_route_conflict {
                    for c in &mine {
                        tracing::warn!(conflict = %c, "watched route refused: it overlaps a laptop route");
                        conflict_msgs.push(c.to_string());
                    }
                    st.refused.insert(net, *kind);
                    return false;
                }
                if mine.iter().any(|c| c.exact_in_main()) {
                    if let Some(c) = lock(&self.classifier).as_mut()
                        && let Err(e) = c.insert_route(net, *kind)
                    {
                        tracing::warn!(cidr = %net, error = %e, "cannot add a classifier entry");
                    }
                    st.not_installed.insert(net, *kind);
                    return false;
                }
                true
            });
        }
        let plan = {
            let st = lock(&self.state);
            routes::plan_update(&self.connect, &st.routes, &add, &remove)
        };
        let mut resp = api::UpdateRoutesResponse {
            covered: plan.covered.iter().map(ToString::to_string).collect(),
            conflicts: conflict_msgs,
            ..Default::default()
        };
        for net in &plan.remove {
            // Kernel route first: the classifier must never lack an entry for a
            // prefix the kernel still routes into the TUN device.
            match netlink.del_route(self.ifindex, *net).await {
                Ok(()) => {}
                Err(e) if e.errno == Some(libc::ESRCH) => {}
                Err(e) => return Err(UpdateError::Apply(e.to_string())),
            }
            if let Some(c) = lock(&self.classifier).as_mut()
                && let Err(e) = c.remove_route(*net)
            {
                tracing::warn!(cidr = %net, error = %e, "cannot remove the classifier entry of a watched route");
            }
            lock(&self.state).routes.remove(net);
            resp.removed.push(net.to_string());
            tracing::info!(cidr = %net, "watched route removed");
        }
        for (net, kind) in &plan.add {
            // Classifier entry first, so nothing the new route carries is dropped
            // as unrouted.
            if let Some(c) = lock(&self.classifier).as_mut() {
                c.insert_route(*net, *kind).map_err(|e| {
                    UpdateError::Apply(format!(
                        "cannot add the eBPF classifier entry for {net}: {e}"
                    ))
                })?;
            }
            if let Err(e) = netlink
                .add_route(self.ifindex, *net, &self.tunnel_ips)
                .await
            {
                if let Some(c) = lock(&self.classifier).as_mut() {
                    let _ = c.remove_route(*net);
                }
                return Err(UpdateError::Apply(e.to_string()));
            }
            lock(&self.state).routes.insert(*net, *kind);
            resp.added.push(net.to_string());
            tracing::info!(cidr = %net, ?kind, "watched route added");
        }
        {
            let mut st = lock(&self.state);
            // A watched route that replaced a ClusterIP entry owns it now.
            for net in &plan.add {
                st.service_entries.remove(&net.0);
            }
            if let Some(dns) = &req.dns {
                st.dns = Some(dns.clone());
            }
            if req.services_replace {
                st.services.clear();
            }
            for s in &req.services_remove {
                st.services.remove(&(s.namespace.clone(), s.name.clone()));
            }
            for s in &req.services_upsert {
                st.services
                    .insert((s.namespace.clone(), s.name.clone()), s.clone());
            }
            let services_changed = req.services_replace
                || !req.services_remove.is_empty()
                || !req.services_upsert.is_empty();
            if services_changed || !plan.add.is_empty() || !plan.remove.is_empty() {
                let routes: Vec<(IpNet, RouteKind)> = self
                    .connect
                    .iter()
                    .copied()
                    .chain(st.routes.iter().map(|(n, k)| (*n, *k)))
                    .collect();
                let wanted = service_entries(&routes, st.services.values());
                self.sync_service_entries(&mut st, wanted);
            }
        }
        if self.allow_route_conflict {
            self.sync_pinned(netlink, &laptop).await;
        }
        // Last: a reported source tells `kvpn connect` (which waits for it) that
        // this request's routes and pinned host routes are in place.
        if let Some(source) = &req.route_source {
            lock(&self.state).source = Some(source.clone());
        }
        Ok(resp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(ns: &str, name: &str, ips: &[&str]) -> api::ClusterService {
        api::ClusterService {
            namespace: ns.into(),
            name: name.into(),
            cluster_ips: ips.iter().map(|s| (*s).to_owned()).collect(),
            ports: vec![],
        }
    }

    fn net(s: &str) -> IpNet {
        s.parse().expect("CIDR")
    }

    #[test]
    fn cluster_ips_inside_service_routes_get_entries() {
        let routes = vec![
            (net("10.244.0.0/16"), RouteKind::Pod),
            (net("10.96.0.0/12"), RouteKind::Service),
        ];
        let services = [
            svc("default", "web", &["10.96.0.100"]),
            svc("default", "web-alias", &["10.96.0.100"]),
            svc("default", "headless", &[]),
            svc("other", "outside", &["192.168.7.7"]),
            svc("other", "in-pod-range", &["10.244.3.3"]),
            svc("other", "garbage", &["not-an-ip"]),
        ];
        let entries = service_entries(&routes, services.iter());
        assert_eq!(
            entries.into_iter().collect::<Vec<_>>(),
            vec![(
                net("10.96.0.100/32"),
                vec!["default/web".to_owned(), "default/web-alias".to_owned()]
            )]
        );
    }

    #[test]
    fn service_entries_are_capped() {
        let routes = vec![(net("10.96.0.0/12"), RouteKind::Service)];
        let services: Vec<_> = (0..MAX_SERVICE_ENTRIES + 10)
            .map(|i| {
                let ip = std::net::Ipv4Addr::from(
                    u32::from(std::net::Ipv4Addr::new(10, 96, 0, 0)) + 1 + i as u32,
                );
                svc("ns", &format!("s{i}"), &[&ip.to_string()])
            })
            .collect();
        assert_eq!(
            service_entries(&routes, services.iter()).len(),
            MAX_SERVICE_ENTRIES
        );
    }
}
