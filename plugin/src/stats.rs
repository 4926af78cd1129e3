//! What the plugin counts, and the Envoy stat names it counts under.
//!
//! The engine emits [`Event`]s; the proxy-wasm glue turns each into metric updates with
//! [`updates`] and applies them with `define_metric` / `increment_metric` / `record_metric`.
//! Envoy exposes wasm metrics with a `wasmcustom.` prefix, e.g.
//! `wasmcustom.prefixroute.routed.prefix.replica-1`.

use prefixroute_core::Policy;

use crate::fallback::FallbackReason;

/// How a scrape ended, for counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScrapeEnd {
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
        end: ScrapeEnd,
    },
    EndpointDown(usize),
    EndpointUp(usize),
    /// The endpoint restarted; its index entries were aged out.
    IndexForgotten(usize),
    /// Current view of an endpoint, set on every tick.
    Gauges {
        endpoint: usize,
        in_flight: u32,
        down: bool,
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
                ScrapeEnd::Ok => "ok",
                ScrapeEnd::Failed => "failures",
                ScrapeEnd::Unparseable => "parse_errors",
                ScrapeEnd::DispatchError => "dispatch_errors",
            };
            vec![counter(format!("prefixroute.scrape.{what}"), 1)]
        }
        Event::EndpointDown(_) => vec![counter("prefixroute.endpoint_down".into(), 1)],
        Event::EndpointUp(_) => vec![counter("prefixroute.endpoint_up".into(), 1)],
        Event::IndexForgotten(_) => vec![counter("prefixroute.index_forgotten".into(), 1)],
        Event::Gauges {
            endpoint,
            in_flight,
            down,
        } => vec![
            gauge(
                format!("prefixroute.endpoint.{}.in_flight", name(*endpoint)),
                u64::from(*in_flight),
            ),
            gauge(
                format!("prefixroute.endpoint.{}.down", name(*endpoint)),
                u64::from(*down),
            ),
        ],
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
                down: true,
            },
            &names,
        );
        assert_eq!(
            u,
            vec![
                gauge("prefixroute.endpoint.b.in_flight".into(), 4),
                gauge("prefixroute.endpoint.b.down".into(), 1)
            ]
        );
        let u = updates(&Event::CasGiveUps(3), &names);
        assert_eq!(u[0].op, Op::Add(3));
    }
}
