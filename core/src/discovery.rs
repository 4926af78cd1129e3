//! The pool's members as Envoy sees them: its admin interface's `/clusters?format=json`.
//!
//! A proxy-wasm filter has no API that lists a cluster's hosts in stock Envoy, but the admin
//! interface does, for every cluster type (STATIC, file-based EDS, Istio's or Envoy Gateway's
//! xDS): each host's address, its `hostname` when the endpoint carries one, and its health
//! (`health_status.eds_health_status` plus the active/outlier check flags). The plugin calls it
//! through a loopback-only cluster and hands the body to [`members_of`].
//!
//! The answer is a [`Member`] list sorted by address, so every Envoy worker that reads the same
//! page builds the same membership. A host counts as *routable* when Envoy's own
//! `override_host` would accept it (healthy or degraded, not draining, not failing a check);
//! an unroutable host stays a member (its prefix index is kept) but receives no request.

use serde_json::Value;
use thiserror::Error;

use crate::config::{is_ip_port, EndpointConfig};

/// More members than this are cut (sorted by address) and reported: the shared index and the
/// destination header are sized for a pool, not a fleet of thousands.
pub const MAX_MEMBERS: usize = 1024;

/// One host of the pool cluster.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Member {
    /// `ip:port`, the value `override_host` takes.
    pub address: String,
    /// The endpoint's `hostname` when Envoy has one (Kubernetes: the pod name), else the
    /// address. Unique within a membership.
    pub name: String,
    /// Envoy would route to it now.
    pub routable: bool,
}

impl Member {
    pub fn from_endpoint(endpoint: &EndpointConfig) -> Self {
        Member {
            address: endpoint.address.clone(),
            name: endpoint.name.clone(),
            routable: true,
        }
    }
}

/// Why an admin page gave no membership. The caller keeps the last one it had.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DiscoveryError {
    #[error("admin /clusters answer is not the expected JSON: {0}")]
    Json(String),
    #[error("cluster {0:?} is not in Envoy's /clusters answer")]
    NoSuchCluster(String),
}

/// What [`members_of`] found, with what it had to leave out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Discovered {
    pub members: Vec<Member>,
    /// Hosts without a numeric `ip:port` (a pipe, a DNS name not yet resolved): not routable
    /// through `override_host`, so left out.
    pub skipped: usize,
    /// Hosts beyond [`MAX_MEMBERS`].
    pub truncated: usize,
}

/// What `override_host` accepts by default: HEALTHY, DEGRADED or UNKNOWN (EDS says nothing)
/// and no failed check (a failed *degraded* check still serves, as in Envoy). Envoy's JSON omits
/// false flags and an UNKNOWN status.
fn routable(health: &Value) -> bool {
    let eds_ok = matches!(
        health.get("eds_health_status").and_then(Value::as_str),
        None | Some("HEALTHY" | "DEGRADED" | "UNKNOWN")
    );
    let failed = [
        "failed_active_health_check",
        "failed_outlier_check",
        "pending_dynamic_removal",
        "excluded_via_immediate_hc_fail",
        "active_hc_timeout",
    ]
    .iter()
    .any(|flag| health.get(*flag).and_then(Value::as_bool) == Some(true));
    eds_ok && !failed
}

/// `ip:port` of a host's `address.socket_address`, IPv6 bracketed as `override_host` expects.
fn ip_port(host: &Value) -> Option<String> {
    let socket = host.get("address")?.get("socket_address")?;
    let ip = socket.get("address")?.as_str()?;
    let port = socket
        .get("port_value")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let address = if ip.contains(':') {
        format!("[{ip}]:{port}")
    } else {
        format!("{ip}:{port}")
    };
    is_ip_port(&address).then_some(address)
}

/// The members of `cluster` in an admin `/clusters?format=json` page.
pub fn members_of(page: &[u8], cluster: &str) -> Result<Discovered, DiscoveryError> {
    // Only a few fields of one cluster matter; a generic parse keeps the plugin small (the
    // JSON parser is linked anyway) where typed structs would add their own decoders.
    let page: Value =
        serde_json::from_slice(page).map_err(|e| DiscoveryError::Json(e.to_string()))?;
    let statuses = page
        .get("cluster_statuses")
        .map_or(Some(&[][..]), |v| v.as_array().map(Vec::as_slice))
        .ok_or_else(|| DiscoveryError::Json("cluster_statuses is not a list".into()))?;
    let mut status = None;
    for c in statuses {
        match c.get("name") {
            Some(Value::String(name)) if name == cluster => {
                status = Some(c);
                break;
            }
            Some(Value::String(_)) => {}
            _ => return Err(DiscoveryError::Json("a cluster without a name".into())),
        }
    }
    let status = status.ok_or_else(|| DiscoveryError::NoSuchCluster(cluster.to_string()))?;
    let mut found = Discovered::default();
    let mut hosts: Vec<(String, String, bool)> = Vec::new();
    let listed = status
        .get("host_statuses")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    for host in listed {
        let Some(address) = ip_port(host) else {
            found.skipped += 1;
            continue;
        };
        let hostname = host
            .get("hostname")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        // The same address twice (two localities, two priorities): one member, routable if
        // either copy is. Hosts are kept in address order as they come (a binary search
        // each, and no sort for the .wasm to carry).
        let routable = routable(host.get("health_status").unwrap_or(&Value::Null));
        match hosts.binary_search_by(|(a, _, _)| a.cmp(&address)) {
            Ok(i) => hosts[i].2 |= routable,
            Err(i) => hosts.insert(i, (address, hostname, routable)),
        }
    }
    if hosts.len() > MAX_MEMBERS {
        found.truncated = hosts.len() - MAX_MEMBERS;
        hosts.truncate(MAX_MEMBERS);
    }
    found.members = name_members(hosts);
    Ok(found)
}

/// Names hosts by hostname, falling back to the address when there is none or when another
/// host (in address order) already took that hostname: names key stats, so they are unique.
fn name_members(hosts: Vec<(String, String, bool)>) -> Vec<Member> {
    let mut members: Vec<Member> = Vec::with_capacity(hosts.len());
    for (address, hostname, routable) in hosts {
        let taken = |name: &str| members.iter().any(|m| m.name == name);
        let name = if hostname.is_empty() || taken(&hostname) {
            address.clone()
        } else {
            hostname
        };
        members.push(Member {
            address,
            name,
            routable,
        });
    }
    members
}

/// How one membership differs from the one before it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Change {
    /// Addresses that were not members before: new endpoints, whatever their name (a name at
    /// a new address is a new endpoint; nothing it was believed to hold carries over).
    pub added: Vec<String>,
    pub removed: Vec<String>,
    /// Members whose name or routability changed.
    pub updated: Vec<String>,
}

impl Change {
    pub fn between(before: &[Member], after: &[Member]) -> Change {
        let find = |list: &[Member], address: &str| -> Option<Member> {
            list.iter().find(|m| m.address == address).cloned()
        };
        let mut change = Change::default();
        for m in after {
            match find(before, &m.address) {
                None => change.added.push(m.address.clone()),
                Some(old) if old != *m => change.updated.push(m.address.clone()),
                Some(_) => {}
            }
        }
        for m in before {
            if find(after, &m.address).is_none() {
                change.removed.push(m.address.clone());
            }
        }
        change
    }

    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty() && self.updated.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(ip: &str, port: u32, hostname: &str, health: &str) -> String {
        let hostname = if hostname.is_empty() {
            String::new()
        } else {
            format!(r#""hostname":"{hostname}","#)
        };
        format!(
            r#"{{"address":{{"socket_address":{{"address":"{ip}","port_value":{port}}}}},
               "stats":[{{"name":"cx_active","type":"GAUGE"}}],{hostname}
               "health_status":{health},"weight":1,"locality":{{}}}}"#
        )
    }

    fn page(pool: &[String]) -> String {
        format!(
            r#"{{"cluster_statuses":[
                 {{"name":"other","host_statuses":[{}]}},
                 {{"name":"pool","host_statuses":[{}],"observability_name":"pool"}}]}}"#,
            host("10.9.9.9", 80, "", "{}"),
            pool.join(",")
        )
    }

    const HEALTHY: &str = r#"{"eds_health_status":"HEALTHY"}"#;

    #[test]
    fn members_are_the_pool_clusters_hosts_sorted_by_address_and_named_by_hostname() {
        let body = page(&[
            host("127.0.0.1", 18002, "replica-b", HEALTHY),
            host("127.0.0.1", 18001, "replica-a", HEALTHY),
            host("::1", 18003, "", "{}"),
        ]);
        let found = members_of(body.as_bytes(), "pool").unwrap();
        let got: Vec<(&str, &str, bool)> = found
            .members
            .iter()
            .map(|m| (m.address.as_str(), m.name.as_str(), m.routable))
            .collect();
        assert_eq!(
            got,
            [
                ("127.0.0.1:18001", "replica-a", true),
                ("127.0.0.1:18002", "replica-b", true),
                ("[::1]:18003", "[::1]:18003", true),
            ]
        );
        assert_eq!((found.skipped, found.truncated), (0, 0));
    }

    #[test]
    fn unhealthy_draining_and_failing_hosts_are_members_but_not_routable() {
        let body = page(&[
            host("10.0.0.1", 1, "a", r#"{"eds_health_status":"UNHEALTHY"}"#),
            host("10.0.0.2", 1, "b", r#"{"eds_health_status":"DRAINING"}"#),
            host("10.0.0.3", 1, "c", r#"{"failed_outlier_check":true}"#),
            host(
                "10.0.0.4",
                1,
                "d",
                r#"{"eds_health_status":"HEALTHY","failed_active_health_check":true}"#,
            ),
            host("10.0.0.5", 1, "e", r#"{"eds_health_status":"DEGRADED"}"#),
            host("10.0.0.6", 1, "f", r#"{"eds_health_status":"TIMEOUT"}"#),
        ]);
        let found = members_of(body.as_bytes(), "pool").unwrap();
        let routable: Vec<bool> = found.members.iter().map(|m| m.routable).collect();
        assert_eq!(routable, [false, false, false, false, true, false]);
    }

    #[test]
    fn hosts_without_a_numeric_address_are_skipped_and_counted() {
        let body = page(&[
            host("10.0.0.1", 80, "a", HEALTHY),
            r#"{"address":{"pipe":{"path":"/tmp/sock"}}}"#.to_string(),
            host("not-an-ip", 80, "b", HEALTHY),
            host("10.0.0.2", 0, "c", HEALTHY),
        ]);
        let found = members_of(body.as_bytes(), "pool").unwrap();
        assert_eq!(found.members.len(), 1);
        assert_eq!(found.skipped, 3);
    }

    #[test]
    fn a_repeated_hostname_falls_back_to_the_address_and_a_repeated_address_is_one_member() {
        let body = page(&[
            host("10.0.0.2", 80, "same", HEALTHY),
            host("10.0.0.1", 80, "same", HEALTHY),
            host(
                "10.0.0.1",
                80,
                "same",
                r#"{"eds_health_status":"UNHEALTHY"}"#,
            ),
        ]);
        let found = members_of(body.as_bytes(), "pool").unwrap();
        let names: Vec<&str> = found.members.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["same", "10.0.0.2:80"]);
        assert!(found.members[0].routable);
    }

    #[test]
    fn an_empty_pool_is_an_empty_membership_not_an_error() {
        let body = r#"{"cluster_statuses":[{"name":"pool"}]}"#;
        assert_eq!(members_of(body.as_bytes(), "pool").unwrap().members, []);
    }

    #[test]
    fn garbage_and_a_missing_cluster_are_typed_errors() {
        let err = members_of(b"<html>", "pool").unwrap_err();
        assert!(matches!(err, DiscoveryError::Json(_)), "{err}");
        let err = members_of(br#"{"cluster_statuses":[]}"#, "pool").unwrap_err();
        assert_eq!(
            err.to_string(),
            r#"cluster "pool" is not in Envoy's /clusters answer"#
        );
        let err = members_of(br#"{"cluster_statuses":[{"name":7}]}"#, "pool").unwrap_err();
        assert!(matches!(err, DiscoveryError::Json(_)));
    }

    #[test]
    fn more_than_max_members_are_cut_and_counted() {
        let hosts: Vec<String> = (0..MAX_MEMBERS + 3)
            .map(|i| host("10.0.0.1", 1000 + i as u32, "", "{}"))
            .collect();
        let found = members_of(page(&hosts).as_bytes(), "pool").unwrap();
        assert_eq!(found.members.len(), MAX_MEMBERS);
        assert_eq!(found.truncated, 3);
    }

    #[test]
    fn a_change_names_added_removed_and_updated_addresses() {
        let m = |address: &str, name: &str, routable: bool| Member {
            address: address.into(),
            name: name.into(),
            routable,
        };
        let before = [
            m("a:1", "a", true),
            m("b:1", "b", true),
            m("c:1", "c", true),
        ];
        let after = [
            m("a:1", "a", true),
            m("b:1", "b", false),
            m("d:1", "c", true),
        ];
        let change = Change::between(&before, &after);
        assert_eq!(change.added, ["d:1"]);
        assert_eq!(change.removed, ["c:1"]);
        assert_eq!(change.updated, ["b:1"]);
        assert!(Change::between(&after, &after).is_empty());
    }
}
