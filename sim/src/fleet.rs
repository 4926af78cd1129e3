//! Replicas that come and go during a run: the fleet a Kubernetes deployment really is.
//!
//! Three changes, each at a point of the trace's time, each to one replica:
//!
//! * `down`: the pod goes away (scale-in, a node drained, a crash). The router stops sending it
//!   requests at once (Envoy's health checks or the endpoint list say so); the requests it
//!   already holds finish (a drained pod), and its cache is gone.
//! * `up`: a pod takes the slot with an empty cache (scale-out, a replacement pod). It is a new
//!   address, so the router believes nothing of it.
//! * `restart`: the server restarts in place (same address, a container restart, an OOM kill):
//!   its cache is empty, but nothing tells the router until its next scrape shows the prefix
//!   cache counters went back (what the plugin watches for). Until then it routes on a stale
//!   belief; with a precise index the server's `AllBlocksCleared` event tells it at once.
//!
//! * `fail`: the engine dies while the pod lives on: its HTTP server answers every completion
//!   with a 503 at once and its `/metrics` still says it is idle, so health checks, the
//!   endpoint list and the scrape all keep it. Envoy's route retries each failed try on the
//!   next replica of the destination header's failover list, and the gateway takes the
//!   replica out of rotation after five failures in a row (core's `outlier`, as the plugin
//!   does). A `restart` (the liveness probe's) or a `down` ends it.
//!
//! A replica that should join later starts with `down` at time 0.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// What happens to a replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FleetChange {
    Down,
    Up,
    Restart,
    Fail,
}

impl fmt::Display for FleetChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FleetChange::Down => "down",
            FleetChange::Up => "up",
            FleetChange::Restart => "restart",
            FleetChange::Fail => "fail",
        })
    }
}

/// One change to the fleet: `restart:replica-2@20` restarts replica 2 twenty seconds into the
/// trace.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FleetEvent {
    /// Seconds into the trace (the trace's `t`).
    pub at_s: f64,
    pub replica: usize,
    pub change: FleetChange,
}

impl fmt::Display for FleetEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:replica-{}@{}", self.change, self.replica, self.at_s)
    }
}

#[derive(Debug, Clone, PartialEq, Error)]
pub enum FleetError {
    #[error("fleet event {0:?}: expected KIND:REPLICA@SECONDS, e.g. restart:replica-2@20 (KIND: down, up, restart or fail)")]
    Syntax(String),
    #[error("fleet event {0:?}: unknown change {1:?} (expected down, up, restart or fail)")]
    Change(String, String),
    #[error("fleet event {0:?}: the replica is `replica-N` or `N`, not {1:?}")]
    Replica(String, String),
    #[error("fleet event {0:?}: the time must be a number of seconds ≥ 0, not {1:?}")]
    Time(String, String),
    #[error("fleet event {event}: the fleet has {replicas} replicas (replica-0 to replica-{last})", last = replicas.saturating_sub(1))]
    NoSuchReplica { event: FleetEvent, replicas: usize },
}

impl FromStr for FleetEvent {
    type Err = FleetError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let syntax = || FleetError::Syntax(s.to_string());
        let (change, rest) = s.split_once(':').ok_or_else(syntax)?;
        let (replica, at) = rest.rsplit_once('@').ok_or_else(syntax)?;
        let change = match change.trim() {
            "down" => FleetChange::Down,
            "up" => FleetChange::Up,
            "restart" => FleetChange::Restart,
            "fail" => FleetChange::Fail,
            other => return Err(FleetError::Change(s.to_string(), other.to_string())),
        };
        let replica = replica.trim();
        let number = replica.strip_prefix("replica-").unwrap_or(replica);
        let replica = number
            .parse()
            .map_err(|_| FleetError::Replica(s.to_string(), replica.to_string()))?;
        let at = at.trim();
        let at_s = at
            .strip_suffix('s')
            .unwrap_or(at)
            .parse::<f64>()
            .ok()
            .filter(|t| t.is_finite() && *t >= 0.0)
            .ok_or_else(|| FleetError::Time(s.to_string(), at.to_string()))?;
        Ok(FleetEvent {
            at_s,
            replica,
            change,
        })
    }
}

/// The events in the order they happen (equal times in the order given), each checked
/// against a fleet of `replicas`.
pub fn schedule(events: &[FleetEvent], replicas: usize) -> Result<Vec<FleetEvent>, FleetError> {
    if let Some(&event) = events.iter().find(|e| e.replica >= replicas) {
        return Err(FleetError::NoSuchReplica { event, replicas });
    }
    let mut events = events.to_vec();
    events.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
    Ok(events)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_parse_with_or_without_the_replica_prefix_and_the_unit() {
        let e: FleetEvent = "restart:replica-2@20".parse().unwrap();
        assert_eq!(
            e,
            FleetEvent {
                at_s: 20.0,
                replica: 2,
                change: FleetChange::Restart
            }
        );
        assert_eq!("down:0@1.5s".parse::<FleetEvent>().unwrap().at_s, 1.5);
        assert_eq!(
            "up:3@0".parse::<FleetEvent>().unwrap().change,
            FleetChange::Up
        );
        assert_eq!(e.to_string().parse::<FleetEvent>().unwrap(), e);
        let fail: FleetEvent = "fail:replica-1@10".parse().unwrap();
        assert_eq!(fail.change, FleetChange::Fail);
        assert_eq!(fail.to_string(), "fail:replica-1@10");
    }

    #[test]
    fn malformed_events_say_what_is_wrong() {
        let err = |s: &str| s.parse::<FleetEvent>().unwrap_err().to_string();
        assert!(err("restart").contains("expected KIND:REPLICA@SECONDS"));
        assert!(err("reboot:1@2").contains("unknown change \"reboot\""));
        assert!(err("down:node-1@2").contains("not \"node-1\""));
        assert!(err("down:1@-3").contains("≥ 0"));
        assert!(err("down:1@NaN").contains("≥ 0"));
        assert!(err("down:1@soon").contains("not \"soon\""));
    }

    #[test]
    fn a_schedule_is_in_time_order_and_refuses_replicas_the_fleet_lacks() {
        let events: Vec<FleetEvent> = ["up:1@30", "down:1@0", "restart:0@30"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        let order: Vec<String> = schedule(&events, 2)
            .unwrap()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            order,
            [
                "down:replica-1@0",
                "up:replica-1@30",
                "restart:replica-0@30"
            ]
        );
        let err = schedule(&events, 1).unwrap_err().to_string();
        assert!(
            err.contains("the fleet has 1 replicas (replica-0 to replica-0)"),
            "{err}"
        );
    }
}
