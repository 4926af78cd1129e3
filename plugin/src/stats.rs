//! What the plugin counts, and the Envoy stat names it counts under.
//!
//! The scheduler emits [`Event`]s; the proxy-wasm glue turns each into metric updates with
//! [`updates`] and applies them with `define_metric` / `increment_metric` / `record_metric`.
//! Envoy exposes wasm metrics with a `wasmcustom.` prefix, e.g.
//! `wasmcustom.prefixroute.routed.prefix.replica-1`.

use prefixroute_core::Policy;

use crate::fallback::FallbackReason;

/// How a callout (a scrape or a discovery) ended, for counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CalloutEnd {
    Ok,
    /// Non-200, timeout, reset, connection failure.
    Failed,
    /// 200 but not Prometheus text.
    Unparseable,
    /// Envoy refused to send the callout (e.g. the scrape cluster does not exist).
    DispatchError,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A request entered the filter.
    Request,
    /// The router chose `endpoint` for a parsed request.
    Routed {
        policy: Policy,
        endpoint: usize,
        cold: bool,
    },
    /// The fallback chose `endpoint`.
    Fallback {
        reason: FallbackReason,
        endpoint: usize,
    },
    /// The host refused a header write (the request goes on with Envoy's fallback policy).
    HeaderError,
    CasGiveUps(u32),
    SharedDataErrors(u32),
    Scrape {
        endpoint: usize,
        end: CalloutEnd,
    },
    EndpointDown(usize),
    EndpointUp(usize),
    /// The endpoint restarted; its index entries were aged out.
    IndexForgotten(usize),
    /// A scrape succeeded without saying how large the endpoint's cache is: its belief stays
    /// bounded by the configured `index_capacity_blocks`.
    CapacityUnreported(usize),
    /// First bytes the prefill model learned from, and absurd ones it refused (zero,
    /// negative, hours): those leave the model at what it knew (the prior at first). Refused
    /// also counts groups' gaps between requests that were negative or over an hour.
    Observations {
        used: u32,
        refused: u32,
    },
    /// Chat messages (and prompts) of a request long enough for the hash memo: found there
    /// (not tokenized again) or hashed and remembered.
    HashMemo {
        hits: u32,
        misses: u32,
    },
    /// How a discovery callout (Envoy's admin `/clusters`) ended.
    Discovery(CalloutEnd),
    /// Hosts of the pool cluster the discovery left out: no numeric `ip:port`, or beyond
    /// the member limit.
    DiscoverySkipped(u32),
    /// This instance published a new membership (counted once per change, by its publisher).
    MembershipChanged {
        added: u32,
        removed: u32,
        updated: u32,
    },
    /// The membership this instance routes over, set whenever it changes.
    Pool {
        members: u32,
        routable: u32,
    },
    /// How a KV-feed callout (`index: precise`) ended.
    KvFeed(CalloutEnd),
    /// What one feed page changed in the index: blocks confirmed, removed, servers cleared,
    /// and servers whose events stopped (their endpoints fall back to the approximate belief).
    KvApplied {
        stored: u64,
        removed: u64,
        cleared: u32,
        lost: u32,
        /// Requests other gateways routed whose ends the runs marked.
        ends: u64,
    },
    /// An endpoint left the pool: its gauges go to zero (and `down` to 1) under its name.
    EndpointLeft(String),
    /// What the fleet's first bytes taught the latency model, set on every tick: the lane
    /// count that explains them best (how many sequences a replica is believed to prefill at
    /// once) and the mean time a request holds its lane after its first byte (decoding).
    Learned {
        lanes: u32,
        /// The fewest lanes the first bytes have not ruled out: what a request no endpoint
        /// holds is priced with (core's `Prediction::with_caution`).
        fewest_lanes: u32,
        hold_us: u64,
    },
    /// Current view of an endpoint, set on every tick.
    Gauges {
        endpoint: usize,
        in_flight: u32,
        /// Prefill tokens of requests in flight there whose first byte has not come back.
        prefill_tokens: u64,
        /// The believed cache's capacity (reported, or configured).
        capacity_blocks: u64,
        /// The learned prefill cost.
        prefill_ns_per_token: u64,
        down: bool,
        /// Its KV events reach the index (`index: precise`); 0 = approximate belief.
        precise: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Counter,
    Gauge,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Add(u64),
    Set(u64),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    pub kind: Kind,
    pub name: String,
    pub op: Op,
}

/// Endpoint names go into stat names: keep `[A-Za-z0-9_-]`, map the rest (dots included,
/// which Envoy treats as hierarchy) to `_`.
pub fn stat_token(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// A counter increment per name whose count is not zero.
fn counts(named: &[(&str, u32)]) -> Vec<Update> {
    named
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|&(name, n)| counter(name.to_string(), u64::from(n)))
        .collect()
}

fn counter(name: String, n: u64) -> Update {
    Update {
        kind: Kind::Counter,
        name,
        op: Op::Add(n),
    }
}

fn gauge(name: String, v: u64) -> Update {
    Update {
        kind: Kind::Gauge,
        name,
        op: Op::Set(v),
    }
}

/// The metric updates of one event. `names` are the endpoint names, already [`stat_token`]ed.
pub fn updates(event: &Event, names: &[String]) -> Vec<Update> {
    let name = |e: usize| names.get(e).map_or("unknown", String::as_str);
    match event {
        Event::Request => vec![counter("prefixroute.requests".into(), 1)],
        Event::Routed {
            policy,
            endpoint,
            cold,
        } => {
            let mut v = vec![counter(
                format!("prefixroute.routed.{}.{}", policy.name(), name(*endpoint)),
                1,
            )];
            if *cold {
                v.push(counter("prefixroute.cold".into(), 1));
            }
            v
        }
        Event::Fallback { reason, .. } => {
            vec![counter(
                format!("prefixroute.fallback.{}", reason.name()),
                1,
            )]
        }
        Event::HeaderError => vec![counter("prefixroute.header_errors".into(), 1)],
        Event::CasGiveUps(n) => vec![counter(
            "prefixroute.shared_data.cas_give_ups".into(),
            u64::from(*n),
        )],
        Event::SharedDataErrors(n) => {
            vec![counter(
                "prefixroute.shared_data.errors".into(),
                u64::from(*n),
            )]
        }
        Event::Scrape { end, .. } => {
            let what = match end {
                CalloutEnd::Ok => "ok",
                CalloutEnd::Failed => "failures",
                CalloutEnd::Unparseable => "parse_errors",
                CalloutEnd::DispatchError => "dispatch_errors",
            };
            vec![counter(format!("prefixroute.scrape.{what}"), 1)]
        }
        Event::Discovery(end) => {
            let what = match end {
                CalloutEnd::Ok => "ok",
                CalloutEnd::Failed => "failures",
                CalloutEnd::Unparseable => "parse_errors",
                CalloutEnd::DispatchError => "dispatch_errors",
            };
            vec![counter(format!("prefixroute.discovery.{what}"), 1)]
        }
        Event::KvFeed(end) => {
            let what = match end {
                CalloutEnd::Ok => "ok",
                CalloutEnd::Failed => "failures",
                CalloutEnd::Unparseable => "parse_errors",
                CalloutEnd::DispatchError => "dispatch_errors",
            };
            vec![counter(format!("prefixroute.kv.fetch.{what}"), 1)]
        }
        Event::KvApplied {
            stored,
            removed,
            cleared,
            lost,
            ends,
        } => vec![
            counter("prefixroute.kv.stored".into(), *stored),
            counter("prefixroute.kv.removed".into(), *removed),
            counter("prefixroute.kv.cleared".into(), u64::from(*cleared)),
            counter("prefixroute.kv.lost".into(), u64::from(*lost)),
            counter("prefixroute.kv.ends_marked".into(), *ends),
        ],
        Event::DiscoverySkipped(n) => vec![counter(
            "prefixroute.discovery.skipped_hosts".into(),
            u64::from(*n),
        )],
        Event::MembershipChanged {
            added,
            removed,
            updated,
        } => vec![
            counter("prefixroute.pool.changes".into(), 1),
            counter("prefixroute.pool.added".into(), u64::from(*added)),
            counter("prefixroute.pool.removed".into(), u64::from(*removed)),
            counter("prefixroute.pool.updated".into(), u64::from(*updated)),
        ],
        Event::Pool { members, routable } => vec![
            gauge("prefixroute.pool.members".into(), u64::from(*members)),
            gauge("prefixroute.pool.routable".into(), u64::from(*routable)),
        ],
        Event::EndpointLeft(endpoint) => {
            let e = stat_token(endpoint);
            vec![
                gauge(format!("prefixroute.endpoint.{e}.in_flight"), 0),
                gauge(format!("prefixroute.endpoint.{e}.prefill_tokens"), 0),
                gauge(format!("prefixroute.endpoint.{e}.down"), 1),
            ]
        }
        Event::EndpointDown(_) => vec![counter("prefixroute.endpoint_down".into(), 1)],
        Event::EndpointUp(_) => vec![counter("prefixroute.endpoint_up".into(), 1)],
        Event::IndexForgotten(_) => vec![counter("prefixroute.index_forgotten".into(), 1)],
        Event::CapacityUnreported(_) => {
            vec![counter("prefixroute.scrape.no_capacity".into(), 1)]
        }
        Event::HashMemo { hits, misses } => counts(&[
            ("prefixroute.hash_memo.hits", *hits),
            ("prefixroute.hash_memo.misses", *misses),
        ]),
        Event::Observations { used, refused } => counts(&[
            ("prefixroute.latency.observations", *used),
            ("prefixroute.latency.observations_refused", *refused),
        ]),
        Event::Learned {
            lanes,
            fewest_lanes,
            hold_us,
        } => vec![
            gauge("prefixroute.latency.lanes".into(), u64::from(*lanes)),
            gauge(
                "prefixroute.latency.fewest_lanes".into(),
                u64::from(*fewest_lanes),
            ),
            gauge("prefixroute.latency.hold_us".into(), *hold_us),
        ],
        Event::Gauges {
            endpoint,
            in_flight,
            prefill_tokens,
            capacity_blocks,
            prefill_ns_per_token,
            down,
            precise,
        } => {
            let e = name(*endpoint);
            vec![
                gauge(
                    format!("prefixroute.endpoint.{e}.in_flight"),
                    u64::from(*in_flight),
                ),
                gauge(
                    format!("prefixroute.endpoint.{e}.prefill_tokens"),
                    *prefill_tokens,
                ),
                gauge(
                    format!("prefixroute.endpoint.{e}.capacity_blocks"),
                    *capacity_blocks,
                ),
                gauge(
                    format!("prefixroute.endpoint.{e}.prefill_ns_per_token"),
                    *prefill_ns_per_token,
                ),
                gauge(format!("prefixroute.endpoint.{e}.down"), u64::from(*down)),
                gauge(
                    format!("prefixroute.endpoint.{e}.precise"),
                    u64::from(*precise),
                ),
            ]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        let names = vec![stat_token("replica.1"), stat_token("b")];
        assert_eq!(names[0], "replica_1");
        let u = updates(
            &Event::Routed {
                policy: Policy::PrefixOnly,
                endpoint: 0,
                cold: true,
            },
            &names,
        );
        assert_eq!(u[0].name, "prefixroute.routed.prefix-only.replica_1");
        assert_eq!(u[1].name, "prefixroute.cold");
        let u = updates(
            &Event::Fallback {
                reason: FallbackReason::BodyTooLarge,
                endpoint: 1,
            },
            &names,
        );
        assert_eq!(u[0].name, "prefixroute.fallback.body_too_large");
        let u = updates(
            &Event::Gauges {
                endpoint: 1,
                in_flight: 4,
                prefill_tokens: 900,
                capacity_blocks: 128,
                prefill_ns_per_token: 500_000,
                down: true,
                precise: true,
            },
            &names,
        );
        assert_eq!(
            u,
            vec![
                gauge("prefixroute.endpoint.b.in_flight".into(), 4),
                gauge("prefixroute.endpoint.b.prefill_tokens".into(), 900),
                gauge("prefixroute.endpoint.b.capacity_blocks".into(), 128),
                gauge(
                    "prefixroute.endpoint.b.prefill_ns_per_token".into(),
                    500_000
                ),
                gauge("prefixroute.endpoint.b.down".into(), 1),
                gauge("prefixroute.endpoint.b.precise".into(), 1),
            ]
        );
        let u = updates(
            &Event::Learned {
                lanes: 8,
                fewest_lanes: 2,
                hold_us: 1500,
            },
            &names,
        );
        assert_eq!(
            u,
            vec![
                gauge("prefixroute.latency.lanes".into(), 8),
                gauge("prefixroute.latency.fewest_lanes".into(), 2),
                gauge("prefixroute.latency.hold_us".into(), 1500),
            ]
        );
        let u = updates(&Event::HashMemo { hits: 2, misses: 0 }, &names);
        assert_eq!(u, vec![counter("prefixroute.hash_memo.hits".into(), 2)]);
        let u = updates(
            &Event::Observations {
                used: 3,
                refused: 1,
            },
            &names,
        );
        assert_eq!(
            u,
            vec![
                counter("prefixroute.latency.observations".into(), 3),
                counter("prefixroute.latency.observations_refused".into(), 1)
            ]
        );
        let u = updates(&Event::CapacityUnreported(0), &names);
        assert_eq!(u[0].name, "prefixroute.scrape.no_capacity");
        let u = updates(&Event::CasGiveUps(3), &names);
        assert_eq!(u[0].op, Op::Add(3));
    }
}
