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
    /// Its answers' server errors took the endpoint out of rotation for `for_ms`.
    EndpointEjected {
        endpoint: usize,
        for_ms: u64,
    },
    /// The endpoint restarted; its index entries were aged out.
    IndexForgotten(usize),
    /// A scrape succeeded without saying how large the endpoint's cache is: its belief stays
    /// bounded by the configured `index_capacity_blocks`.
    CapacityUnreported(usize),
    /// First bytes the prefill model learned from, and absurd ones it refused (zero,
    /// negative, hours): those leave the model at what it knew (the prior at first). Refused
    /// also counts groups' gaps between requests that were negative or over an hour, and
    /// finished-request counters (`vllm:request_success_total`) that were negative or not a
    /// number, once by every worker that reads the scrape.
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

/// Which Envoy stat an update goes to, without the text of its name: the name is built once,
/// when the stat is defined ([`Stat::name`]), and after that an update finds its metric id by
/// comparing these (a request's few counters cost no formatting and no allocation).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stat {
    /// `prefixroute.` + the first part + the second: `("fallback.", "parse_error")`.
    Fixed(&'static str, &'static str),
    /// `prefixroute.routed.<policy>.<endpoint>`, by the endpoint's index in the pool.
    Routed(&'static str, usize),
    /// `prefixroute.endpoint.<endpoint>.<field>`, by the endpoint's index in the pool.
    Endpoint(usize, &'static str),
    /// `prefixroute.endpoint.<name>.<field>` of an endpoint that left the pool.
    Left(String, &'static str),
}

impl Stat {
    /// Named by an endpoint's index, which names another endpoint once the pool changes.
    pub fn by_index(&self) -> bool {
        matches!(self, Stat::Routed(..) | Stat::Endpoint(..))
    }

    /// The stat's name. `names` are the endpoint names, already [`stat_token`]ed.
    pub fn name(&self, names: &[String]) -> String {
        let endpoint = |e: usize| names.get(e).map_or("unknown", String::as_str);
        match self {
            Stat::Fixed(a, b) => format!("prefixroute.{a}{b}"),
            Stat::Routed(policy, e) => format!("prefixroute.routed.{policy}.{}", endpoint(*e)),
            Stat::Endpoint(e, field) => format!("prefixroute.endpoint.{}.{field}", endpoint(*e)),
            Stat::Left(name, field) => format!("prefixroute.endpoint.{}.{field}", stat_token(name)),
        }
    }
}

/// The pool's endpoint names as stat names ([`stat_token`]), and a number that changes
/// whenever they do.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatNames {
    pub names: Vec<String>,
    pub generation: u64,
}

/// Metric ids by stat, defined on first use (each VM defines its own ids for the same Envoy
/// stat, so workers add up in one counter), and the value this VM last gave each gauge. A
/// vector sorted by (kind, stat), searched by bisection: the same lookups as a `BTreeMap` (a
/// tick's gauges at 1,024 endpoints are ten comparisons each) without linking a B-tree into
/// the `.wasm` (this and the scheduler's callouts were the plugin's two `BTreeMap`s: 10 KB). A
/// stat's name is formatted only when it is defined.
#[derive(Debug, Default)]
pub struct MetricIds {
    ids: Vec<((Kind, Stat), Metric)>,
    generation: u64,
    /// Where in `ids` the stats settled last are, by where their names' texts lie: a request
    /// settles the same few stats every time, and the bisection compares names byte by byte
    /// (`memcmp` was ~4% of a warm request's wasm instructions). Two texts at one address are
    /// one text; one text at two addresses is two entries for one index. Emptied whenever
    /// `ids` moves.
    recent: Vec<(Address, usize)>,
}

/// A stat named by `'static` texts, by their addresses and lengths (see [`MetricIds`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Address {
    kind: Kind,
    variant: u8,
    text: (usize, usize),
    more: (usize, usize),
}

impl Address {
    /// `None` for a stat named by an owned text (an endpoint that left).
    fn of(kind: Kind, stat: &Stat) -> Option<Address> {
        let at = |s: &str| (s.as_ptr() as usize, s.len());
        let (variant, text, more) = match stat {
            Stat::Fixed(a, b) => (0, at(a), at(b)),
            Stat::Routed(policy, e) => (1, at(policy), (*e, 0)),
            Stat::Endpoint(e, field) => (2, at(field), (*e, 0)),
            Stat::Left(..) => return None,
        };
        Some(Address {
            kind,
            variant,
            text,
            more,
        })
    }
}

/// Stats [`MetricIds`] finds by address: more than a request settles.
const RECENT_STATS: usize = 16;

#[derive(Debug, Clone, Copy)]
struct Metric {
    id: u32,
    /// The value this VM last set (gauges).
    last: Option<u64>,
}

impl MetricIds {
    /// Forgets the stats named by an endpoint's index when the pool's names changed
    /// (`generation`, see [`StatNames`]): the index now names another endpoint.
    pub fn follow(&mut self, generation: u64) {
        if generation != self.generation {
            self.ids.retain(|((_, stat), _)| !stat.by_index());
            self.recent.clear();
            self.generation = generation;
        }
    }

    /// What to tell the host for `u`: its metric's id, defined with `define(kind, name)` the
    /// first time, and the operation; `None` when there is nothing to send: the host refused
    /// the definition (asked again next time), a count of zero (defined all the same, so the
    /// stat shows 0), or a gauge set to the value this VM last gave it. Every worker sets the
    /// endpoint gauges from the same shared state on every tick, so an unchanged value is
    /// already there, and a tick at 64 endpoints makes 384 fewer host calls.
    pub fn settle(
        &mut self,
        u: Update,
        names: &[String],
        define: impl FnOnce(Kind, &str) -> Option<u32>,
    ) -> Option<(u32, Op)> {
        let address = Address::of(u.kind, &u.stat);
        let known = address.and_then(|a| self.recent.iter().find(|(r, _)| *r == a));
        let at = match known {
            Some(&(_, at)) => at,
            None => {
                let key = (u.kind, u.stat);
                let at = match self.ids.binary_search_by(|(k, _)| k.cmp(&key)) {
                    Ok(at) => at,
                    Err(at) => {
                        let id = define(key.0, &key.1.name(names))?;
                        self.ids.insert(at, (key, Metric { id, last: None }));
                        self.recent.clear();
                        at
                    }
                };
                if let Some(address) = address {
                    if self.recent.len() == RECENT_STATS {
                        self.recent.remove(0);
                    }
                    self.recent.push((address, at));
                }
                at
            }
        };
        let metric = &mut self.ids[at].1;
        match u.op {
            Op::Add(0) => None,
            Op::Set(v) if metric.last == Some(v) => None,
            Op::Set(v) => {
                metric.last = Some(v);
                Some((metric.id, u.op))
            }
            Op::Add(_) => Some((metric.id, u.op)),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    pub kind: Kind,
    pub stat: Stat,
    pub op: Op,
}

/// Endpoint names go into stat names: keep `[A-Za-z0-9_-]`, map the rest (dots included,
/// which Envoy treats as hierarchy) to `_`.
pub fn stat_token(name: &str) -> String {
    // By byte: every byte of a non-ASCII character becomes `_` (no UTF-8 decoding to carry).
    name.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' {
                char::from(b)
            } else {
                '_'
            }
        })
        .collect()
}

fn counter(stat: Stat, n: u64) -> Update {
    Update {
        kind: Kind::Counter,
        stat,
        op: Op::Add(n),
    }
}

fn gauge(stat: Stat, v: u64) -> Update {
    Update {
        kind: Kind::Gauge,
        stat,
        op: Op::Set(v),
    }
}

/// `prefixroute.<name>`.
fn fixed(name: &'static str) -> Stat {
    Stat::Fixed(name, "")
}

fn callout_end(end: CalloutEnd) -> &'static str {
    match end {
        CalloutEnd::Ok => "ok",
        CalloutEnd::Failed => "failures",
        CalloutEnd::Unparseable => "parse_errors",
        CalloutEnd::DispatchError => "dispatch_errors",
    }
}

/// The metric updates of one event, in order, each handed to `emit` (no vector per event).
/// Counts of zero are left out.
pub fn updates(event: &Event, mut emit: impl FnMut(Update)) {
    let mut count = |name: &'static str, n: u64| {
        if n > 0 {
            emit(counter(fixed(name), n));
        }
    };
    match event {
        Event::Request => count("requests", 1),
        Event::Routed {
            policy,
            endpoint,
            cold,
        } => {
            emit(counter(Stat::Routed(policy.name(), *endpoint), 1));
            if *cold {
                emit(counter(fixed("cold"), 1));
            }
        }
        Event::Fallback { reason, .. } => {
            emit(counter(Stat::Fixed("fallback.", reason.name()), 1));
        }
        Event::HeaderError => count("header_errors", 1),
        Event::CasGiveUps(n) => emit(counter(fixed("shared_data.cas_give_ups"), u64::from(*n))),
        Event::SharedDataErrors(n) => {
            emit(counter(fixed("shared_data.errors"), u64::from(*n)));
        }
        Event::Scrape { end, .. } => {
            emit(counter(Stat::Fixed("scrape.", callout_end(*end)), 1));
        }
        Event::Discovery(end) => {
            emit(counter(Stat::Fixed("discovery.", callout_end(*end)), 1));
        }
        Event::KvFeed(end) => {
            emit(counter(Stat::Fixed("kv.fetch.", callout_end(*end)), 1));
        }
        Event::KvApplied {
            stored,
            removed,
            cleared,
            lost,
            ends,
        } => {
            for (name, n) in [
                ("kv.stored", *stored),
                ("kv.removed", *removed),
                ("kv.cleared", u64::from(*cleared)),
                ("kv.lost", u64::from(*lost)),
                ("kv.ends_marked", *ends),
            ] {
                emit(counter(fixed(name), n));
            }
        }
        Event::DiscoverySkipped(n) => {
            emit(counter(fixed("discovery.skipped_hosts"), u64::from(*n)))
        }
        Event::MembershipChanged {
            added,
            removed,
            updated,
        } => {
            for (name, n) in [
                ("pool.changes", 1),
                ("pool.added", *added),
                ("pool.removed", *removed),
                ("pool.updated", *updated),
            ] {
                emit(counter(fixed(name), u64::from(n)));
            }
        }
        Event::Pool { members, routable } => {
            emit(gauge(fixed("pool.members"), u64::from(*members)));
            emit(gauge(fixed("pool.routable"), u64::from(*routable)));
        }
        Event::EndpointLeft(endpoint) => {
            for (field, v) in [("in_flight", 0), ("prefill_tokens", 0), ("down", 1)] {
                emit(gauge(Stat::Left(endpoint.clone(), field), v));
            }
        }
        Event::EndpointDown(_) => count("endpoint_down", 1),
        Event::EndpointUp(_) => count("endpoint_up", 1),
        Event::EndpointEjected { .. } => count("endpoint_ejected", 1),
        Event::IndexForgotten(_) => count("index_forgotten", 1),
        Event::CapacityUnreported(_) => count("scrape.no_capacity", 1),
        Event::HashMemo { hits, misses } => {
            count("hash_memo.hits", u64::from(*hits));
            count("hash_memo.misses", u64::from(*misses));
        }
        Event::Observations { used, refused } => {
            count("latency.observations", u64::from(*used));
            count("latency.observations_refused", u64::from(*refused));
        }
        Event::Learned {
            lanes,
            fewest_lanes,
            hold_us,
        } => {
            emit(gauge(fixed("latency.lanes"), u64::from(*lanes)));
            emit(gauge(
                fixed("latency.fewest_lanes"),
                u64::from(*fewest_lanes),
            ));
            emit(gauge(fixed("latency.hold_us"), *hold_us));
        }
        Event::Gauges {
            endpoint,
            in_flight,
            prefill_tokens,
            capacity_blocks,
            prefill_ns_per_token,
            down,
            precise,
        } => {
            for (field, v) in [
                ("in_flight", u64::from(*in_flight)),
                ("prefill_tokens", *prefill_tokens),
                ("capacity_blocks", *capacity_blocks),
                ("prefill_ns_per_token", *prefill_ns_per_token),
                ("down", u64::from(*down)),
                ("precise", u64::from(*precise)),
            ] {
                emit(gauge(Stat::Endpoint(*endpoint, field), v));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each update of `event` as (kind, name, op), the names as Envoy sees them.
    fn named(event: &Event, names: &[String]) -> Vec<(Kind, String, Op)> {
        let mut out = Vec::new();
        updates(event, |u| out.push((u.kind, u.stat.name(names), u.op)));
        out
    }

    fn gauge_of(name: &str, v: u64) -> (Kind, String, Op) {
        (Kind::Gauge, name.to_string(), Op::Set(v))
    }

    fn counter_of(name: &str, n: u64) -> (Kind, String, Op) {
        (Kind::Counter, name.to_string(), Op::Add(n))
    }

    #[test]
    fn names() {
        let names = vec![stat_token("replica.1"), stat_token("b")];
        assert_eq!(names[0], "replica_1");
        assert_eq!(stat_token("réplica-2"), "r__plica-2", "each byte of é");
        let u = named(
            &Event::Routed {
                policy: Policy::PrefixOnly,
                endpoint: 0,
                cold: true,
            },
            &names,
        );
        assert_eq!(u[0].1, "prefixroute.routed.prefix-only.replica_1");
        assert_eq!(u[1].1, "prefixroute.cold");
        let u = named(
            &Event::Fallback {
                reason: FallbackReason::BodyTooLarge,
                endpoint: 1,
            },
            &names,
        );
        assert_eq!(u[0].1, "prefixroute.fallback.body_too_large");
        let u = named(
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
                gauge_of("prefixroute.endpoint.b.in_flight", 4),
                gauge_of("prefixroute.endpoint.b.prefill_tokens", 900),
                gauge_of("prefixroute.endpoint.b.capacity_blocks", 128),
                gauge_of("prefixroute.endpoint.b.prefill_ns_per_token", 500_000),
                gauge_of("prefixroute.endpoint.b.down", 1),
                gauge_of("prefixroute.endpoint.b.precise", 1),
            ]
        );
        let u = named(&Event::EndpointLeft("10.0.0.9:8000".into()), &names);
        assert_eq!(
            u,
            vec![
                gauge_of("prefixroute.endpoint.10_0_0_9_8000.in_flight", 0),
                gauge_of("prefixroute.endpoint.10_0_0_9_8000.prefill_tokens", 0),
                gauge_of("prefixroute.endpoint.10_0_0_9_8000.down", 1),
            ]
        );
        let u = named(
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
                gauge_of("prefixroute.latency.lanes", 8),
                gauge_of("prefixroute.latency.fewest_lanes", 2),
                gauge_of("prefixroute.latency.hold_us", 1500),
            ]
        );
        let u = named(&Event::HashMemo { hits: 2, misses: 0 }, &names);
        assert_eq!(u, vec![counter_of("prefixroute.hash_memo.hits", 2)]);
        let u = named(
            &Event::Observations {
                used: 3,
                refused: 1,
            },
            &names,
        );
        assert_eq!(
            u,
            vec![
                counter_of("prefixroute.latency.observations", 3),
                counter_of("prefixroute.latency.observations_refused", 1)
            ]
        );
        let u = named(&Event::CapacityUnreported(0), &names);
        assert_eq!(u[0].1, "prefixroute.scrape.no_capacity");
        let u = named(&Event::CasGiveUps(3), &names);
        assert_eq!(u[0].2, Op::Add(3));
        let u = named(&Event::KvFeed(CalloutEnd::Unparseable), &names);
        assert_eq!(u[0].1, "prefixroute.kv.fetch.parse_errors");
        // Counts of zero still define these stats (they show 0 rather than nothing).
        let u = named(
            &Event::KvApplied {
                stored: 5,
                removed: 0,
                cleared: 0,
                lost: 0,
                ends: 1,
            },
            &names,
        );
        assert_eq!(u.len(), 5);
        assert_eq!(u[1], counter_of("prefixroute.kv.removed", 0));
        assert_eq!(u[4], counter_of("prefixroute.kv.ends_marked", 1));
    }

    /// Defines every name it is asked for, numbering them, and remembers the names.
    fn defining(defined: &mut Vec<String>) -> impl FnOnce(Kind, &str) -> Option<u32> + '_ {
        |_, name| {
            defined.push(name.to_string());
            Some(defined.len() as u32)
        }
    }

    fn add(stat: Stat, n: u64) -> Update {
        counter(stat, n)
    }

    fn set(stat: Stat, v: u64) -> Update {
        gauge(stat, v)
    }

    #[test]
    fn a_stat_is_named_and_defined_once_then_found_by_its_id() {
        let names = vec!["a".to_string(), "b".to_string()];
        let mut ids = MetricIds::default();
        let mut defined = Vec::new();
        let routed = Stat::Routed("latency", 1);
        let first = ids.settle(add(routed.clone(), 1), &names, defining(&mut defined));
        let again = ids.settle(add(routed, 2), &names, defining(&mut defined));
        assert_eq!(first, Some((1, Op::Add(1))));
        assert_eq!(again, Some((1, Op::Add(2))));
        let other = ids.settle(add(fixed("requests"), 1), &names, defining(&mut defined));
        assert_eq!(other, Some((2, Op::Add(1))));
        assert_eq!(
            defined,
            ["prefixroute.routed.latency.b", "prefixroute.requests"]
        );
        // The same stat as another kind is another metric.
        let gauge = ids.settle(set(fixed("requests"), 7), &names, defining(&mut defined));
        assert_eq!(gauge, Some((3, Op::Set(7))));
    }

    /// Twenty names, more than `MetricIds` remembers by address.
    const NAMES: [&str; 20] = [
        "n0", "n1", "n2", "n3", "n4", "n5", "n6", "n7", "n8", "n9", "n10", "n11", "n12", "n13",
        "n14", "n15", "n16", "n17", "n18", "n19",
    ];

    fn stat_of(pick: u8) -> Stat {
        match pick % 4 {
            0 => Stat::Fixed(NAMES[usize::from(pick / 4) % 20], ""),
            1 => Stat::Routed("latency", usize::from(pick / 4) % 3),
            2 => Stat::Endpoint(usize::from(pick / 4) % 3, "queue"),
            _ => Stat::Left(format!("gone{}", pick / 4 % 3), "queue"),
        }
    }

    proptest::proptest! {
        /// A map from each stat to its id and last value, defined on first use and forgetting
        /// the stats named by index when the names change: what `settle` answers, whether it
        /// found the stat by address or by bisection.
        #[test]
        fn stats_found_by_address_settle_as_stats_found_by_name(
            steps in proptest::collection::vec((0u8..200, proptest::bool::ANY, 0u64..3, 0u8..40), 1..300),
        ) {
            let names = vec!["a".to_string(), "b".to_string(), "c".to_string()];
            let mut ids = MetricIds::default();
            let mut defined = Vec::new();
            // Each stat with its id and the value last sent.
            type Entry = ((Kind, Stat), (u32, Option<u64>));
            let mut model: Vec<Entry> = Vec::new();
            let mut generation = 0;
            for (pick, gauge, value, follow) in steps {
                if follow == 0 {
                    generation += 1;
                    ids.follow(generation);
                    model.retain(|((_, stat), _)| !stat.by_index());
                }
                let stat = stat_of(pick);
                let (kind, update) = if gauge {
                    (Kind::Gauge, set(stat.clone(), value))
                } else {
                    (Kind::Counter, add(stat.clone(), value))
                };
                let got = ids.settle(update, &names, defining(&mut defined));
                let key = (kind, stat);
                let entry = match model.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, entry)) => entry,
                    None => {
                        model.push((key, (defined.len() as u32, None)));
                        &mut model.last_mut().unwrap().1
                    }
                };
                let expected = match (gauge, value) {
                    (false, 0) => None,
                    (false, n) => Some((entry.0, Op::Add(n))),
                    (true, v) if entry.1 == Some(v) => None,
                    (true, v) => {
                        entry.1 = Some(v);
                        Some((entry.0, Op::Set(v)))
                    }
                };
                proptest::prop_assert_eq!(got, expected);
            }
        }
    }

    #[test]
    fn a_count_of_zero_defines_its_stat_and_sends_nothing() {
        let mut ids = MetricIds::default();
        let mut defined = Vec::new();
        let zero = ids.settle(add(fixed("kv.lost"), 0), &[], defining(&mut defined));
        assert_eq!((zero, defined.len()), (None, 1));
    }

    #[test]
    fn a_gauge_is_sent_only_when_its_value_changes() {
        let mut ids = MetricIds::default();
        let mut defined = Vec::new();
        let names = vec!["a".to_string()];
        let down = || Stat::Endpoint(0, "down");
        let mut sent = |ids: &mut MetricIds, v| {
            ids.settle(set(down(), v), &names, defining(&mut defined))
                .map(|(_, op)| op)
        };
        assert_eq!(sent(&mut ids, 0), Some(Op::Set(0)));
        assert_eq!(sent(&mut ids, 0), None);
        assert_eq!(sent(&mut ids, 1), Some(Op::Set(1)));
        assert_eq!(sent(&mut ids, 1), None);
        assert_eq!(sent(&mut ids, 0), Some(Op::Set(0)));
    }

    #[test]
    fn a_refused_definition_is_asked_again_next_time() {
        let mut ids = MetricIds::default();
        assert_eq!(ids.settle(add(fixed("cold"), 1), &[], |_, _| None), None);
        let mut defined = Vec::new();
        let sent = ids.settle(add(fixed("cold"), 1), &[], defining(&mut defined));
        assert_eq!((sent, defined.len()), (Some((1, Op::Add(1))), 1));
    }

    #[test]
    fn when_the_pool_changes_an_index_names_the_endpoint_now_there() {
        let mut ids = MetricIds::default();
        let mut defined = Vec::new();
        let before = vec!["a".to_string(), "b".to_string()];
        ids.follow(0);
        let routed = || add(Stat::Routed("latency", 0), 1);
        let down = || set(Stat::Endpoint(0, "down"), 0);
        ids.settle(routed(), &before, defining(&mut defined));
        ids.settle(down(), &before, defining(&mut defined));
        ids.settle(add(fixed("requests"), 1), &before, defining(&mut defined));
        // `a` left: index 0 is now `b`, whose gauge was never set by this VM.
        let after = vec!["b".to_string()];
        ids.follow(1);
        let to_b = ids.settle(routed(), &after, defining(&mut defined));
        let b_down = ids.settle(down(), &after, defining(&mut defined));
        let requests = ids.settle(add(fixed("requests"), 1), &after, |_, _| {
            panic!("a fixed name keeps its id")
        });
        assert_eq!(to_b, Some((4, Op::Add(1))));
        assert_eq!(b_down, Some((5, Op::Set(0))));
        assert_eq!(requests, Some((3, Op::Add(1))));
        assert_eq!(
            defined,
            [
                "prefixroute.routed.latency.a",
                "prefixroute.endpoint.a.down",
                "prefixroute.requests",
                "prefixroute.routed.latency.b",
                "prefixroute.endpoint.b.down",
            ]
        );
        // The same generation again changes nothing.
        ids.follow(1);
        assert_eq!(ids.settle(down(), &after, |_, _| None), None);
    }
}
