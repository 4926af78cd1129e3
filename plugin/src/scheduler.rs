//! Everything the plugin decides, without proxy-wasm: the root context owns one `Scheduler` and
//! the HTTP contexts call into it. Time comes in as milliseconds and shared data through
//! [`SharedData`], so the whole request/tick/scrape cycle runs in native tests, several
//! "workers" sharing one [`crate::shared::MemShared`].

use prefixroute_core::config::{IndexMode, PluginConfig};
use prefixroute_core::discovery::{members_of, Change, Member};
use prefixroute_core::feed::FeedPage;
use prefixroute_core::hashing::{
    hash_raw_memo_into, hash_request_memo_into, BlockHashes, ChainMemo, HashConfig,
};
use prefixroute_core::latency::{scaled_capacity, Observation, Prediction};
use prefixroute_core::outlier::{Answered, OutlierState};
use prefixroute_core::request::read_request;
use prefixroute_core::scorer::estimate_load;
use prefixroute_core::{parse_request, EndpointLoad, Policy, Router};

use crate::codec::{CalibrationRecord, EndpointState, FeedCursor, Membership};
use crate::fallback::{self, FallbackReason};
use crate::ledger::Ledger;
use crate::scrape::{self, Claim, Transition};
use crate::settings::{instance_stale_ms, tick_ms};
use crate::shared::{
    calibration_key, cas_update, endpoint_key, members_key, read_or_default, CasOutcome,
    EndpointIds, SharedData, SharedDataErrors, FEED_KEY,
};
use crate::stats::{stat_token, CalloutEnd, Event, StatNames};
use crate::store::{table_bits, SharedIndex, TrackedHost};

/// How a request's endpoint was chosen.
// One per request, held by its HTTP context until the stream ends: boxing the prediction
// would add an allocation to every request (the allocator is already a third of a small
// request's instructions, docs/benchmarks.md), to save bytes of a value that is never stored
// in bulk.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Route {
    /// By the router, on the parsed body.
    Routed {
        policy: Policy,
        matched_blocks: usize,
        total_blocks: usize,
        cold: bool,
        /// The `latency` policy's prediction for the chosen endpoint.
        prediction: Option<Prediction>,
    },
    /// By the fallback choice.
    Fallback(FallbackReason),
}

/// What a request's HTTP context keeps until its stream ends: where it went, the prefill work
/// the router accounted for it, and what to compare its first byte with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ticket {
    pub endpoint: usize,
    /// The endpoint's stable id (its address's): the pool may change while the request is in
    /// flight, and its index with it. 0 for a request with no endpoint.
    pub endpoint_id: u64,
    pub uncached_tokens: u64,
    /// The prediction for the chosen endpoint (under every policy); `None` for fallbacks,
    /// which teach the rate estimator nothing.
    pub prediction: Option<Prediction>,
    pub sent_ms: u64,
    /// When the first response byte came (prefill work released), if it did.
    pub first_byte_ms: Option<u64>,
    /// That first byte was a 2xx answer: the stream's end will say how long it decoded.
    pub answered: bool,
    /// The client asked for a streamed answer (or the body could not say): its first byte
    /// comes long before its end, so the first byte is published on its own. A whole answer's
    /// first byte is published with its end ([`crate::ledger::Ledger::note_first_byte`]).
    pub streamed: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// The chosen endpoint; out of range (no destination) when the pool is empty.
    pub endpoint: usize,
    /// Where a retry goes if the chosen endpoint refuses: the next best, best first (at most
    /// `failover` of them).
    pub failover: Vec<usize>,
    pub route: Route,
    pub ticket: Ticket,
}

impl Choice {
    /// The endpoint that answered after `attempts` tries: the chosen one, or the one of the
    /// failover list Envoy's retries reached; `None` past the list.
    pub fn answered_by(&self, attempts: u32) -> Option<usize> {
        let tries = attempts.max(1) as usize;
        std::iter::once(self.endpoint)
            .chain(self.failover.iter().copied())
            .nth(tries - 1)
    }
}

/// Envoy's attribute for the tries its router made for a stream (`upstream.request_attempt_count`,
/// Envoy 1.33 and later), as the ABI names a property path: its segments joined by NUL.
pub const ATTEMPT_COUNT_PROPERTY: &[u8] = b"upstream\0request_attempt_count";

/// The value of [`ATTEMPT_COUNT_PROPERTY`]: Envoy serializes an integer attribute as its 8
/// bytes, little-endian (the host's order; every Envoy platform is little-endian). Anything
/// else is not a count.
pub fn decode_attempt_count(value: &[u8]) -> Option<u32> {
    let bytes: [u8; 8] = value.try_into().ok()?;
    Some(u32::try_from(u64::from_le_bytes(bytes)).unwrap_or(u32::MAX))
}

/// A discovered membership as this instance last applied it.
#[derive(Debug, Clone, Default)]
struct Pool {
    /// The shared record's version it was built from (0 = the static configuration).
    version: u64,
    members: Vec<Member>,
    /// The discovery callout this instance sent and awaits, with when it was sent.
    awaiting: Option<(u32, u64)>,
    /// When a request last looked for the shared membership (see [`Scheduler::route`]).
    looked_ms: Option<u64>,
    /// This instance's own discovery was answered with a usable page (possibly an empty pool,
    /// which is a membership too).
    answered: bool,
}

/// What a discovery answer changed, for the root context to log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiscoveryOutcome {
    /// The answer was used; the membership changed as described (`None`: it did not).
    Applied(Option<Change>),
    /// Envoy answered with this status (or not at all): the last membership stays.
    Failed(Option<u32>),
    /// The page did not give the pool's members (the message says why).
    Unusable(String),
}

/// A scrape callout this instance sent and awaits.
#[derive(Debug, Clone, Copy)]
struct Pending {
    /// The scraped endpoint's id: the pool may change before the answer comes.
    endpoint_id: u64,
    sent_ms: u64,
}

pub struct Scheduler<H: SharedData> {
    config: PluginConfig,
    pool: Pool,
    /// The KV-feed callout this instance awaits: token, sent at, the version it asked from.
    feed_awaiting: Option<(u32, u64, u64)>,
    stat_names: StatNames,
    keys: Vec<String>,
    router: Router<SharedIndex<H>>,
    hash: HashConfig,
    /// This worker's memory of the messages it hashed (a system prompt seen before is not
    /// tokenized again; see core's `hashing::memo`).
    memo: ChainMemo,
    ledger: Ledger,
    fallback_cursor: usize,
    /// Scrapes in flight by callout token: at most one per endpoint, so a vector searched
    /// front to back (a tick already walks it per endpoint).
    pending: Vec<(u32, Pending)>,
    events: Vec<Event>,
    /// Every worker's last cold pick per endpoint, as read for one route (kept between routes
    /// so that reading it allocates nothing).
    last_cold: Vec<Option<u64>>,
    /// The last request's block hashes: the next one is hashed into their vectors.
    hashes: BlockHashes,
    tick_ms: u64,
    /// Per endpoint, the last scrape this worker saw.
    scrape_seen: Vec<SeenScrape>,
    /// Per endpoint, whether its record showed server errors or ejections when this worker last
    /// read it: only then does a good answer from it have anything to forget (see
    /// [`Scheduler::answered`]).
    outliers_seen: Vec<bool>,
}

/// The last scrape of one endpoint a worker saw.
#[derive(Debug, Clone, Copy, Default)]
struct SeenScrape {
    /// Its `scraped_at_ms`.
    at_ms: u64,
    /// The router's requests in flight there when the worker first saw it (core's
    /// `ServerQueue::sent_then`).
    sent_then: u32,
}

/// What a try that Envoy retried counts as: a server error (it refused the connection, reset
/// the stream or answered 5xx; which one, the filter does not see).
const FAILED_TRY: u32 = 503;

/// Whether an endpoint gets no request now: its scrapes failed (`down`), or its answers
/// ejected it (core's `outlier`).
fn out_of_rotation(state: &EndpointState, now_ms: u64) -> bool {
    state.down || state.outlier.ejected(now_ms)
}

impl<H: SharedData> Scheduler<H> {
    pub fn new(host: H, config: PluginConfig) -> Self {
        let members: Vec<Member> = config.endpoints.iter().map(Member::from_endpoint).collect();
        let addresses: Vec<String> = members.iter().map(|m| m.address.clone()).collect();
        let router_config = config.router_config();
        // A discovered pool's table is sized for the pool it may grow to, once: every worker
        // must map hashes to the same buckets whatever the membership is now.
        let sized_for = config
            .discovery
            .as_ref()
            .map_or(addresses.len(), |d| d.expected_endpoints);
        let bits = table_bits(sized_for, config.index_capacity_blocks);
        let mut store =
            SharedIndex::with_table_bits(host, &addresses, config.index_capacity_blocks, bits);
        if config.index == IndexMode::Precise {
            store.set_precise(Some(config.kv_events.speculative_blocks));
        }
        let tick = tick_ms(config.scrape.interval_ms);
        Scheduler {
            stat_names: StatNames {
                names: members.iter().map(|m| stat_token(&m.name)).collect(),
                generation: 0,
            },
            keys: addresses.iter().map(|a| endpoint_key(a)).collect(),
            router: Router::with_store(router_config, addresses.len(), store),
            hash: router_config.hash,
            memo: ChainMemo::default(),
            ledger: Ledger::new(EndpointIds::new(&addresses), instance_stale_ms(tick)),
            fallback_cursor: 0,
            pending: Vec::new(),
            events: Vec::new(),
            last_cold: Vec::new(),
            scrape_seen: Vec::new(),
            outliers_seen: Vec::new(),
            hashes: BlockHashes::default(),
            tick_ms: tick,
            pool: Pool {
                version: 0,
                members,
                awaiting: None,
                looked_ms: None,
                answered: false,
            },
            feed_awaiting: None,
            config,
        }
    }

    pub fn config(&self) -> &PluginConfig {
        &self.config
    }

    pub fn tick_ms(&self) -> u64 {
        self.tick_ms
    }

    pub fn endpoints(&self) -> usize {
        self.pool.members.len()
    }

    /// A discovered pool whose first membership this instance has not seen yet (neither its
    /// own discovery answer nor another instance's in shared data): the root ticks fast until
    /// then (`settings::next_tick_ms`).
    pub fn awaiting_pool(&self) -> bool {
        self.config.discovery.is_some() && self.pool.version == 0 && !self.pool.answered
    }

    /// The pool routed over now: the configured endpoints, or the discovered members.
    pub fn members(&self) -> &[Member] {
        &self.pool.members
    }

    /// `ip:port` of an endpoint.
    pub fn address(&self, endpoint: usize) -> &str {
        self.pool
            .members
            .get(endpoint)
            .map_or("", |e| e.address.as_str())
    }

    pub fn name(&self, endpoint: usize) -> &str {
        self.pool
            .members
            .get(endpoint)
            .map_or("", |e| e.name.as_str())
    }

    /// The destination header's value: the chosen `ip:port`, then the failover ones
    /// (`ip:port,ip:port,…`, which override_host walks on retries); `None` when the choice has
    /// no endpoint (an empty pool), so Envoy's fallback policy picks.
    pub fn destination(&self, choice: &Choice) -> Option<String> {
        let first = self.pool.members.get(choice.endpoint)?;
        let failover = || {
            choice
                .failover
                .iter()
                .filter_map(|&e| self.pool.members.get(e))
        };
        let bytes = failover().map(|m| m.address.len() + 1).sum::<usize>();
        let mut value = String::with_capacity(first.address.len() + bytes);
        value.push_str(&first.address);
        for m in failover() {
            value.push(',');
            value.push_str(&m.address);
        }
        Some(value)
    }

    /// Endpoint names as they appear in stat names.
    pub fn stat_names(&self) -> &StatNames {
        &self.stat_names
    }

    pub fn table_bits(&self) -> u32 {
        self.router.store().table_bits()
    }

    fn host(&self) -> &TrackedHost<H> {
        self.router.store().host()
    }

    /// Routes a complete request body; anything the core cannot parse goes to the fallback.
    pub fn route(&mut self, body: &[u8], now_ms: u64) -> Choice {
        if self.endpoints() == 0 && self.awaiting_pool() && self.pool.looked_ms != Some(now_ms) {
            // Right after Envoy starts, the worker whose tick won the discovery lease learns
            // the pool first; the others would route without it until their next tick. One
            // `get` (at most one per millisecond) while no membership was ever seen here.
            self.pool.looked_ms = Some(now_ms);
            self.follow_pool();
        }
        if self.endpoints() == 0 {
            return self.fallback(FallbackReason::NoEndpoints, now_ms);
        }
        let before = self.memo.stats();
        // Taken out for this route and put back at its end (an early return only loses the
        // vectors' room).
        let mut hashes = std::mem::take(&mut self.hashes);
        // A chat or completions body of the common shape is read where it lies (its messages,
        // or its prompt, are decoded only if the memo does not hold them); any other body is
        // parsed. Both give the same hashes.
        let streamed = if let Some(request) = read_request(body) {
            hash_raw_memo_into(&request, self.hash, &mut self.memo, &mut hashes);
            request.stream
        } else {
            match parse_request(body) {
                Ok(request) => {
                    hash_request_memo_into(&request, self.hash, &mut self.memo, &mut hashes);
                    request.stream
                }
                Err(_) => {
                    self.hashes = hashes;
                    return self.fallback(FallbackReason::ParseError, now_ms);
                }
            }
        };
        let after = self.memo.stats();
        if after != before {
            self.events.push(Event::HashMemo {
                hits: (after.hits - before.hits) as u32,
                misses: (after.misses - before.misses) as u32,
            });
        }
        self.router.store_mut().begin_request_at(now_ms);
        self.router.set_now(now_ms as f64);
        let loads = self.loads(now_ms);
        // no-hit-lru must see the cold picks of every worker, not just this one's.
        let endpoints = self.endpoints();
        self.last_cold.clear();
        self.last_cold.extend((0..endpoints).map(|e| {
            let last_cold = self
                .router
                .store()
                .with_endpoint_state(e, |state| state.last_cold);
            Some(last_cold).filter(|&t| t > 0)
        }));
        self.router.set_last_cold(&self.last_cold);
        let Ok(decision) = self.router.pick(&hashes, &loads) else {
            // No endpoints: configuration refuses that, so it is a bug; count it, route by the
            // fallback (which leaves the request to Envoy's own policy) and go on.
            self.router.store_mut().end_request();
            return self.fallback(FallbackReason::Internal, now_ms);
        };
        let endpoint = decision.endpoint;
        if decision.cold {
            // Shared with the other workers by the commit's own write of the record.
            let stamp = self.router.next_cold_stamp();
            self.router.store_mut().publish_cold(endpoint, stamp);
        }
        let prediction = self
            .router
            .prediction_for(&decision, &hashes, &loads[endpoint]);
        // What the router's commit learned about the request's group, mirrored in this
        // instance's account so that the pooled counts are core's.
        if let Some(committed) = self.router.commit(&decision, &hashes) {
            self.ledger.observe_growth(
                endpoint,
                &committed,
                decision.continued,
                decision.new_blocks(),
            );
        }
        self.ledger.record_request(endpoint, now_ms);
        let errors = self.router.store_mut().end_request();
        self.count_shared(errors);
        let uncached = prediction.uncached_tokens as u64;
        self.acquire(endpoint, &prediction, now_ms);
        self.events.push(Event::Routed {
            policy: decision.policy,
            endpoint,
            cold: decision.cold,
        });
        let failover = decision
            .next_best
            .iter()
            .copied()
            .take(self.config.failover)
            .collect();
        self.hashes = hashes;
        Choice {
            endpoint,
            failover,
            route: Route::Routed {
                policy: decision.policy,
                matched_blocks: decision.matched_blocks(),
                total_blocks: decision.total_blocks,
                cold: decision.cold,
                prediction: decision.prediction().copied(),
            },
            ticket: Ticket {
                endpoint,
                endpoint_id: self.ledger.id_of(endpoint).unwrap_or_default(),
                uncached_tokens: uncached,
                prediction: Some(prediction),
                sent_ms: now_ms,
                first_byte_ms: None,
                answered: false,
                streamed,
            },
        }
    }

    /// What the router knows of every endpoint now: its last fresh scrape, the work of every
    /// worker's requests on it, its learned prefill model, and (bounding its believed cache)
    /// its reported capacity; the fleet's learned lanes and group growth, and where groups live.
    fn loads(&mut self, now_ms: u64) -> Vec<EndpointLoad> {
        let endpoints = self.endpoints();
        let pooled = self.ledger.totals(self.router.store().host(), now_ms);
        let learned = pooled.learned.estimate(&self.config.latency);
        self.router.set_growth(pooled.growth);
        self.router.set_live_groups(&pooled.live);
        self.router.set_fleet_recent(&pooled.recent);
        let stale_after = self.config.scrape.stale_after_ms;
        self.scrape_seen.resize(endpoints, SeenScrape::default());
        self.outliers_seen.resize(endpoints, false);
        let seen = &mut self.scrape_seen;
        let outliers_seen = &mut self.outliers_seen;
        let mut refused = 0;
        let loads = (0..endpoints)
            .map(|e| {
                // Read off the shared record in place: a copy per endpoint per request shows.
                let (capacity, mut load, served) =
                    self.router.store().with_endpoint_state(e, |state| {
                        let capacity = scrape::capacity_blocks(
                            state,
                            self.hash.block_size,
                            self.config.index_capacity_blocks,
                        );
                        let metrics = scrape::fresh_metrics(state, now_ms, stale_after);
                        let work = pooled.work[e];
                        let seen = &mut seen[e];
                        // A scrape this worker sees for the first time: its finished-request
                        // counter goes to the router once.
                        let mut served = None;
                        if seen.at_ms != state.scraped_at_ms {
                            *seen = SeenScrape {
                                at_ms: state.scraped_at_ms,
                                sent_then: work.in_flight,
                            };
                            served = state.metrics.as_ref().and_then(|m| m.request_success_total);
                        }
                        outliers_seen[e] = state.outlier != OutlierState::default();
                        (
                            scaled_capacity(capacity, state.calibration),
                            estimate_load(
                                metrics,
                                work,
                                Some(seen.sent_then),
                                out_of_rotation(state, now_ms) || !self.pool.members[e].routable,
                            ),
                            served.map(|total| (total, state.scraped_at_ms)),
                        )
                    });
                self.router.set_capacity(e, capacity);
                if let Some((total, at_ms)) = served {
                    refused += u32::from(!self.router.observe_served(e, total, at_ms as f64));
                }
                learned.apply_to(e, &mut load.latency);
                load
            })
            .collect();
        // Refused readings are counted with the refused first bytes (drained with the
        // ledger's counts when the request is steered).
        self.ledger.count_refused(refused);
        loads
    }

    /// Chooses an endpoint without a parsed body (see [`fallback`]).
    pub fn fallback(&mut self, reason: FallbackReason, now_ms: u64) -> Choice {
        self.router.store_mut().begin_request();
        let down: Vec<bool> = (0..self.endpoints())
            .map(|e| {
                let routable = self.pool.members[e].routable;
                !routable
                    || self
                        .router
                        .store()
                        .with_endpoint_state(e, |state| out_of_rotation(state, now_ms))
            })
            .collect();
        let errors = self.router.store_mut().end_request();
        self.count_shared(errors);
        let in_flight: Vec<u32> = self
            .ledger
            .totals(self.router.store().host(), now_ms)
            .work
            .iter()
            .map(|w| w.in_flight)
            .collect();
        let endpoint = if down.is_empty() {
            usize::MAX
        } else {
            fallback::choose(&down, &in_flight, &mut self.fallback_cursor)
        };
        self.acquire(endpoint, &Prediction::default(), now_ms);
        self.events.push(Event::Fallback { reason, endpoint });
        Choice {
            endpoint,
            failover: fallback::failover(&down, endpoint, self.config.failover),
            route: Route::Fallback(reason),
            ticket: Ticket {
                endpoint,
                endpoint_id: self.ledger.id_of(endpoint).unwrap_or_default(),
                uncached_tokens: 0,
                prediction: None,
                sent_ms: now_ms,
                first_byte_ms: None,
                answered: false,
                streamed: true,
            },
        }
    }

    fn acquire(&mut self, endpoint: usize, prediction: &Prediction, now_ms: u64) {
        self.ledger
            .acquire(self.router.store().host(), endpoint, prediction, now_ms);
        self.drain_ledger_counts();
    }

    /// The first response byte of a steered request (the first byte of its body, or its end
    /// without one): its prefill is done. A 2xx answer to a request routed with a prediction
    /// also teaches the endpoint's prefill model how long that took; anything else (a local
    /// reply, an error) does not.
    pub fn first_byte(&mut self, ticket: &mut Ticket, success: bool, now_ms: u64) {
        if ticket.first_byte_ms.is_some() {
            return;
        }
        ticket.first_byte_ms = Some(now_ms);
        ticket.answered = success && ticket.prediction.is_some();
        let elapsed = now_ms.saturating_sub(ticket.sent_ms) as f64;
        let observation = ticket
            .prediction
            .filter(|_| success)
            .map(|p| Observation::of(&p, elapsed));
        let latency = self.config.latency;
        let Some(endpoint) = self.ledger.index_of(ticket.endpoint_id) else {
            return; // It left the pool, and its work with it.
        };
        if ticket.streamed {
            self.ledger.first_byte(
                self.router.store().host(),
                endpoint,
                ticket.uncached_tokens,
                observation,
                &latency,
                now_ms,
            );
        } else {
            self.ledger
                .note_first_byte(endpoint, ticket.uncached_tokens, observation, &latency);
        }
        self.drain_ledger_counts();
    }

    /// A steered request finished (or was reset): it no longer holds a lane, and its prefill
    /// work goes with it if its first byte never came. A request answered 2xx tells how long
    /// it held its lane after its first byte (about nothing for a non-streaming answer).
    pub fn release(&mut self, ticket: &Ticket, now_ms: u64) {
        let pending = match ticket.first_byte_ms {
            None => Some(ticket.uncached_tokens),
            Some(_) => None,
        };
        let hold = ticket
            .first_byte_ms
            .filter(|_| ticket.answered)
            .map(|at| now_ms.saturating_sub(at) as f64);
        let Some(endpoint) = self.ledger.index_of(ticket.endpoint_id) else {
            return;
        };
        self.ledger
            .release(self.router.store().host(), endpoint, pending, hold, now_ms);
        self.drain_ledger_counts();
    }

    fn drain_ledger_counts(&mut self) {
        let counts = self.ledger.take_counts();
        self.count_shared(counts.shared);
        if counts.observations > 0 || counts.refused_observations > 0 {
            self.events.push(Event::Observations {
                used: counts.observations,
                refused: counts.refused_observations,
            });
        }
    }

    /// The answer to a steered request came with HTTP `status` after `attempts` tries (Envoy's
    /// `upstream.request_attempt_count`; the route retries refused connections, resets and server
    /// errors on the next endpoints of the destination header): the endpoints of the tries
    /// before the last failed, and the last one answered `status`. Server errors count towards
    /// taking an endpoint out of rotation for a while (core's [`outlier`]), a good answer
    /// forgets them; `ejected` hears of each endpoint this took out, and for how long (ms).
    /// An endpoint's record is written only when that changes something, so a healthy
    /// endpoint's answers cost no shared-data call.
    ///
    /// [`outlier`]: prefixroute_core::outlier
    pub fn answered(
        &mut self,
        choice: &Choice,
        attempts: u32,
        status: u32,
        now_ms: u64,
        mut ejected: impl FnMut(&Self, usize, u64),
    ) {
        // No endpoint, or it left the pool.
        let Some(chosen) = self.ledger.index_of(choice.ticket.endpoint_id) else {
            return;
        };
        let tries = attempts.max(1) as usize;
        // The failover list is by index: if the pool changed since, only the chosen endpoint
        // (known by its id) is certain.
        let listed = if chosen == choice.endpoint { tries } else { 1 };
        let tried = std::iter::once(chosen).chain(choice.failover.iter().copied());
        for (k, e) in tried.take(listed).enumerate() {
            // A try Envoy retried failed before answering, or answered a server error.
            let status = if k + 1 < tries { FAILED_TRY } else { status };
            if let Some(for_ms) = self.answer_from(e, status, now_ms) {
                ejected(self, e, for_ms);
            }
        }
    }

    /// [`Scheduler::answered`] for one endpoint: how long it is out of rotation if this
    /// answer took it out.
    fn answer_from(&mut self, e: usize, status: u32, now_ms: u64) -> Option<u64> {
        if e >= self.endpoints()
            || status < 500 && !self.outliers_seen.get(e).copied().unwrap_or(false)
        {
            return None;
        }
        let (mut answered, mut after) = (Answered::Unchanged, None);
        let outcome = cas_update(
            self.host(),
            &self.keys[e],
            EndpointState::decode,
            EndpointState::encode,
            |mut state| {
                answered = state.outlier.answered(status, now_ms);
                after = Some(state.outlier);
                (answered != Answered::Unchanged).then_some(state)
            },
        );
        let written = self.settle(outcome).is_some();
        if let (Some(seen), Some(after)) = (self.outliers_seen.get_mut(e), after) {
            *seen = after != OutlierState::default();
        }
        let Answered::Ejected { until_ms } = answered else {
            return None;
        };
        let for_ms = until_ms.saturating_sub(now_ms);
        written.then(|| {
            self.events.push(Event::EndpointEjected {
                endpoint: e,
                for_ms,
            });
            for_ms
        })
    }

    /// Counts what went wrong in a read-modify-write and returns its written value.
    fn settle<T>(&mut self, outcome: CasOutcome<T>) -> Option<T> {
        let mut errors = SharedDataErrors::default();
        let written = errors.settle(outcome);
        self.count_shared(errors);
        written
    }

    fn count_shared(&mut self, errors: SharedDataErrors) {
        if errors.cas_give_ups > 0 {
            self.events.push(Event::CasGiveUps(errors.cas_give_ups));
        }
        if errors.host_errors > 0 {
            self.events
                .push(Event::SharedDataErrors(errors.host_errors));
        }
    }

    /// Periodic work of a root context: heartbeat and reap in-flight counts, publish gauges,
    /// and claim due scrapes. Returns the endpoints this instance must scrape now.
    pub fn tick(&mut self, now_ms: u64) -> Vec<usize> {
        self.follow_pool();
        self.ledger.tick(self.router.store().host(), now_ms);
        self.drain_ledger_counts();
        // A callout always completes (Envoy enforces its timeout), but never let a lost one
        // block its endpoint's scrapes.
        let expiry = self.config.scrape.timeout_ms + self.config.scrape.interval_ms;
        self.pending
            .retain(|(_, p)| now_ms.saturating_sub(p.sent_ms) <= expiry);
        let pooled = self.ledger.totals(self.router.store().host(), now_ms);
        let estimate = pooled.learned.estimate(&self.config.latency);
        self.events.push(Event::Learned {
            lanes: estimate.lanes,
            fewest_lanes: estimate.fewest_lanes,
            hold_us: (estimate.hold_ms * 1e3).round() as u64,
        });
        let rates = estimate.ms_per_token;
        // A copy: the loop below reads and claims through `self` (once per tick, not per
        // request).
        let works = pooled.work.clone();
        let mut due = Vec::new();
        for (e, work) in works.iter().enumerate() {
            let key = &self.keys[e];
            let id = self.ledger.id_of(e);
            let awaiting = self.pending.iter().any(|(_, p)| Some(p.endpoint_id) == id);
            let (claim, state) = if awaiting {
                (Claim::NotDue, scrape::read(self.host(), key))
            } else {
                scrape::try_claim(self.host(), key, now_ms, self.config.scrape.interval_ms)
            };
            match claim {
                Claim::Claimed => due.push(e),
                Claim::HostError(_) => self.events.push(Event::SharedDataErrors(1)),
                Claim::NotDue | Claim::Lost => {}
            }
            self.events.push(Event::Gauges {
                endpoint: e,
                in_flight: work.in_flight,
                prefill_tokens: work.prefill_tokens,
                capacity_blocks: scrape::capacity_blocks(
                    &state,
                    self.hash.block_size,
                    self.config.index_capacity_blocks,
                ) as u64,
                prefill_ns_per_token: (rates[e] * 1e6).round() as u64,
                down: out_of_rotation(&state, now_ms),
                precise: self.config.index == IndexMode::Precise && state.precise,
            });
        }
        due
    }

    /// Headers of the scrape callout to `endpoint`. `:authority` and
    /// `x-envoy-original-dst-host` both carry `ip:port`, so an ORIGINAL_DST cluster with
    /// `use_http_header: true` connects exactly there (see README).
    pub fn scrape_headers(&self, endpoint: usize) -> Vec<(&str, &str)> {
        let address = self.address(endpoint);
        vec![
            (":method", "GET"),
            (":path", self.config.scrape.path.as_str()),
            (":authority", address),
            (":scheme", "http"),
            ("x-envoy-original-dst-host", address),
            ("accept", "text/plain"),
        ]
    }

    /// The callout for `endpoint` was sent with `token`.
    pub fn scrape_sent(&mut self, token: u32, endpoint: usize, now_ms: u64) {
        let Some(endpoint_id) = self.ledger.id_of(endpoint) else {
            return;
        };
        self.pending.push((
            token,
            Pending {
                endpoint_id,
                sent_ms: now_ms,
            },
        ));
    }

    /// Envoy refused to send the callout. Not the endpoint's fault, so not a failure towards
    /// `down`; the lease simply moves on to the next interval.
    pub fn scrape_not_sent(&mut self, endpoint: usize) {
        self.events.push(Event::Scrape {
            endpoint,
            end: CalloutEnd::DispatchError,
        });
    }

    /// A callout finished: `status` is the response's `:status` (`None` for no response).
    /// Returns the endpoint and what changed, or `None` for an unknown token.
    pub fn scrape_done(
        &mut self,
        token: u32,
        status: Option<u32>,
        body: &[u8],
        now_ms: u64,
    ) -> Option<(usize, Transition)> {
        let at = self.pending.iter().position(|(t, _)| *t == token)?;
        let (_, Pending { endpoint_id, .. }) = self.pending.swap_remove(at);
        // An endpoint that left the pool meanwhile: its answer no longer matters.
        let endpoint = self.ledger.index_of(endpoint_id)?;
        let observation = scrape::observe(
            status,
            body,
            &self.config.metric_prefix,
            self.config.model.as_deref(),
        );
        let end = match observation {
            scrape::Observation::Metrics(_) => CalloutEnd::Ok,
            scrape::Observation::Unparseable => CalloutEnd::Unparseable,
            scrape::Observation::Failed => CalloutEnd::Failed,
        };
        let calibration = match &observation {
            scrape::Observation::Metrics(m) => self.calibrate(endpoint, m, now_ms),
            _ => None,
        };
        let (outcome, transition) = scrape::record(
            self.host(),
            &self.keys[endpoint],
            &observation,
            now_ms,
            self.config.scrape.failures_to_down,
            self.router.store().capacity(),
            calibration,
        );
        self.events.push(Event::Scrape { endpoint, end });
        if self.settle(outcome).is_none() {
            return Some((endpoint, Transition::default()));
        }
        if transition.went_down {
            self.events.push(Event::EndpointDown(endpoint));
        }
        if transition.came_up {
            self.events.push(Event::EndpointUp(endpoint));
        }
        if transition.forgot {
            // Its groups went with its cache, as core's `Router::forget_endpoint` says. Only
            // this worker's share of the count is ours to clear; the others' leak away.
            self.ledger.forget_live_groups(endpoint);
            self.events.push(Event::IndexForgotten(endpoint));
        }
        if transition.no_capacity {
            self.events.push(Event::CapacityUnreported(endpoint));
        }
        Some((endpoint, transition))
    }

    /// Checks `endpoint`'s belief against the counters of the scrape that just came back (see
    /// core's `Calibration`): the server's hits and queries since its previous scrape, against
    /// what every worker predicted for what it sent there since. Returns the new scale, or
    /// `None` when there is nothing to compare (no counters, or no earlier scrape).
    fn calibrate(
        &mut self,
        endpoint: usize,
        now: &prefixroute_core::metrics::ServerMetrics,
        now_ms: u64,
    ) -> Option<f64> {
        let before = scrape::read(self.host(), &self.keys[endpoint]).metrics;
        let sent = self
            .ledger
            .totals(self.router.store().host(), now_ms)
            .sent
            .get(endpoint)
            .copied()?;
        let key = calibration_key(self.address(endpoint));
        let mut scale = None;
        let outcome = cas_update(
            self.host(),
            &key,
            CalibrationRecord::decode,
            CalibrationRecord::encode,
            |mut record: CalibrationRecord| {
                let served = before.as_ref().and_then(|b| {
                    let hits = now.prefix_cache_hits_total? - b.prefix_cache_hits_total?;
                    let queries = now.prefix_cache_queries_total? - b.prefix_cache_queries_total?;
                    Some((hits, queries))
                });
                if let Some((hits, queries)) = served {
                    // A worker that went away takes its totals with it: no evidence then.
                    if sent.prompt >= record.sent.prompt
                        && sent.predicted_cached >= record.sent.predicted_cached
                    {
                        record.calibration.observe(
                            hits,
                            queries,
                            (sent.predicted_cached - record.sent.predicted_cached) as f64,
                            (sent.prompt - record.sent.prompt) as f64,
                        );
                    }
                }
                record.sent = sent;
                scale = served.map(|_| record.calibration.scale);
                Some(record)
            },
        );
        self.settle(outcome);
        scale
    }

    /// Applies the shared membership if another instance changed it since we last looked
    /// (one `get` per tick). Nothing to follow for a static pool.
    fn follow_pool(&mut self) {
        let Some(key) = self.members_key() else {
            return;
        };
        let Ok(read) = read_or_default(self.host(), &key, Membership::decode) else {
            self.events.push(Event::SharedDataErrors(1));
            return;
        };
        if read.value.version != self.pool.version {
            self.set_members(read.value.members, read.value.version);
        }
    }

    fn members_key(&self) -> Option<String> {
        let discovery = self.config.discovery.as_ref()?;
        Some(members_key(&discovery.pool_cluster))
    }

    /// Rebuilds every per-endpoint table for `members`: the index's keys and ids, the
    /// router's endpoint count, this instance's account (which follows each endpoint by id),
    /// stat names. Endpoints keep their shared records, which are keyed by address.
    fn set_members(&mut self, members: Vec<Member>, version: u64) {
        for left in Change::between(&self.pool.members, &members).removed {
            if let Some(m) = self.pool.members.iter().find(|m| m.address == left) {
                self.events.push(Event::EndpointLeft(m.name.clone()));
            }
        }
        let addresses: Vec<String> = members.iter().map(|m| m.address.clone()).collect();
        self.router.store_mut().set_endpoints(&addresses);
        self.router.set_endpoints(addresses.len());
        self.ledger.set_endpoints(EndpointIds::new(&addresses));
        self.keys = addresses.iter().map(|a| endpoint_key(a)).collect();
        let names: Vec<String> = members.iter().map(|m| stat_token(&m.name)).collect();
        if names != self.stat_names.names {
            self.stat_names = StatNames {
                names,
                generation: self.stat_names.generation.wrapping_add(1),
            };
        }
        self.events.push(Event::Pool {
            members: members.len() as u32,
            routable: members.iter().filter(|m| m.routable).count() as u32,
        });
        self.pool.members = members;
        self.pool.version = version;
    }

    /// Claims the discovery call if it is due (a lease in the shared membership record, so one
    /// instance calls per interval across all workers). Returns whether this instance must
    /// send it now.
    pub fn claim_discovery(&mut self, now_ms: u64) -> bool {
        let (Some(discovery), Some(key)) = (self.config.discovery.as_ref(), self.members_key())
        else {
            return false;
        };
        let interval = discovery.interval_ms;
        let expiry = discovery.timeout_ms + interval;
        if let Some((_, sent)) = self.pool.awaiting {
            if now_ms.saturating_sub(sent) <= expiry {
                return false;
            }
            self.pool.awaiting = None;
        }
        self.claim_lease(
            &key,
            Membership::decode,
            Membership::encode,
            |m| &mut m.next_discovery_ms,
            now_ms,
            interval,
        )
        .is_some()
    }

    /// A lease kept in a shared record: the instance whose CAS moves `next(record)` from due
    /// (at or before `now_ms`) to one interval later owns the next callout, so one instance
    /// across all workers sends it per interval. Returns the record as claimed.
    fn claim_lease<T: Default>(
        &mut self,
        key: &str,
        decode: fn(&[u8]) -> Option<T>,
        encode: fn(&T) -> Vec<u8>,
        next: fn(&mut T) -> &mut u64,
        now_ms: u64,
        interval_ms: u64,
    ) -> Option<T> {
        let outcome = cas_update(self.host(), key, decode, encode, |mut record: T| {
            (*next(&mut record) <= now_ms).then(|| {
                *next(&mut record) = now_ms + interval_ms;
                record
            })
        });
        self.settle(outcome)
    }

    /// Headers of the discovery callout (Envoy's admin interface answers any authority).
    pub fn discovery_headers(&self) -> Vec<(&str, &str)> {
        let path = self
            .config
            .discovery
            .as_ref()
            .map_or("/clusters?format=json", |d| d.path.as_str());
        vec![
            (":method", "GET"),
            (":path", path),
            (":authority", "prefixroute-discovery"),
            (":scheme", "http"),
            ("accept", "application/json"),
        ]
    }

    pub fn discovery_sent(&mut self, token: u32, now_ms: u64) {
        self.pool.awaiting = Some((token, now_ms));
    }

    pub fn discovery_not_sent(&mut self) {
        self.events
            .push(Event::Discovery(CalloutEnd::DispatchError));
    }

    pub fn is_discovery(&self, token: u32) -> bool {
        self.pool.awaiting.is_some_and(|(t, _)| t == token)
    }

    /// The discovery callout came back. A usable page becomes the shared membership if it
    /// differs (one CAS); anything else keeps the last membership and is counted.
    pub fn discovery_done(&mut self, status: Option<u32>, body: &[u8]) -> DiscoveryOutcome {
        self.pool.awaiting = None;
        let Some(pool_cluster) = self
            .config
            .discovery
            .as_ref()
            .map(|d| d.pool_cluster.clone())
        else {
            return DiscoveryOutcome::Unusable("discovery is not configured".into());
        };
        if status != Some(200) {
            self.events.push(Event::Discovery(CalloutEnd::Failed));
            return DiscoveryOutcome::Failed(status);
        }
        let found = match members_of(body, &pool_cluster) {
            Ok(found) => found,
            Err(err) => {
                self.events.push(Event::Discovery(CalloutEnd::Unparseable));
                return DiscoveryOutcome::Unusable(err.to_string());
            }
        };
        self.events.push(Event::Discovery(CalloutEnd::Ok));
        self.pool.answered = true;
        let skipped = found.skipped + found.truncated;
        if skipped > 0 {
            self.events.push(Event::DiscoverySkipped(
                skipped.min(u32::MAX as usize) as u32
            ));
        }
        DiscoveryOutcome::Applied(self.publish_members(found.members))
    }

    /// Makes `members` the shared membership if it differs from the shared one, and applies
    /// it here. A newcomer's address may have been a member before (a pod that came back
    /// with the same IP): its old belief is aged out first, since a new endpoint holds
    /// nothing it was believed to hold.
    fn publish_members(&mut self, members: Vec<Member>) -> Option<Change> {
        let key = self.members_key()?;
        let shared = match read_or_default(self.host(), &key, Membership::decode) {
            Ok(read) => read.value,
            Err(_) => {
                self.events.push(Event::SharedDataErrors(1));
                return None;
            }
        };
        let change = Change::between(&shared.members, &members);
        if change.is_empty() {
            if shared.version != self.pool.version {
                self.set_members(shared.members, shared.version);
            }
            return None;
        }
        // Build the new tables first: forgetting a newcomer needs its index.
        self.set_members(members.clone(), self.pool.version);
        for address in &change.added {
            if let Some(e) = self.pool.members.iter().position(|m| &m.address == address) {
                self.router.store_mut().begin_request();
                prefixroute_core::PrefixStore::forget_endpoint(self.router.store_mut(), e);
                let errors = self.router.store_mut().end_request();
                self.count_shared(errors);
            }
        }
        let mut version = None;
        let outcome = cas_update(
            self.host(),
            &key,
            Membership::decode,
            Membership::encode,
            |mut record: Membership| {
                record.version = record.version.wrapping_add(1).max(1);
                record.members = members.clone();
                version = Some(record.version);
                Some(record)
            },
        );
        if self.settle(outcome).is_some() {
            self.pool.version = version.unwrap_or_default();
            self.events.push(Event::MembershipChanged {
                added: change.added.len() as u32,
                removed: change.removed.len() as u32,
                updated: change.updated.len() as u32,
            });
        }
        Some(change)
    }

    /// Claims the KV-feed fetch if it is due (`index: precise`; a lease in the feed cursor,
    /// so one instance fetches per interval across all workers). Returns the `:path` to ask.
    /// A long poll (`kv_events.wait_ms`) holds the lease until its answer frees it (see
    /// [`Self::feed_done`]), or for as long as the relay may hold it and the callout may take.
    pub fn claim_feed(&mut self, now_ms: u64) -> Option<String> {
        if self.config.index != IndexMode::Precise {
            return None;
        }
        let kv = &self.config.kv_events;
        let lease = if kv.wait_ms > 0 {
            kv.wait_ms + kv.timeout_ms
        } else {
            kv.interval_ms
        };
        let (interval, expiry) = (lease, kv.interval_ms + kv.timeout_ms + kv.wait_ms);
        if let Some((_, sent, _)) = self.feed_awaiting {
            if now_ms.saturating_sub(sent) <= expiry {
                return None;
            }
            self.feed_awaiting = None;
        }
        let since = self
            .claim_lease(
                FEED_KEY,
                FeedCursor::decode,
                FeedCursor::encode,
                |c| &mut c.next_fetch_ms,
                now_ms,
                interval,
            )?
            .version;
        self.feed_awaiting = Some((0, now_ms, since));
        let kv = &self.config.kv_events;
        Some(format!(
            "{}?since={since}&limit={}&wait_ms={}&layout=2",
            kv.path, kv.page_changes, kv.wait_ms
        ))
    }

    /// The timeout of the feed callout: the relay may hold it for `wait_ms` first.
    pub fn feed_timeout_ms(&self) -> u64 {
        let kv = &self.config.kv_events;
        kv.timeout_ms + kv.wait_ms
    }

    pub fn feed_sent(&mut self, token: u32) {
        if let Some(awaiting) = self.feed_awaiting.as_mut() {
            awaiting.0 = token;
        }
    }

    pub fn feed_not_sent(&mut self) {
        self.feed_awaiting = None;
        self.events.push(Event::KvFeed(CalloutEnd::DispatchError));
    }

    pub fn is_feed(&self, token: u32) -> bool {
        self.feed_awaiting.is_some_and(|(t, _, _)| t == token)
    }

    /// A feed page came back: if no other instance applied a page since ours was asked for
    /// (the cursor still says `since`), move the cursor and write the page into the index.
    /// Returns false when the answer was unusable (counted).
    /// With a long poll, an answer that brought news or was held by the relay (an empty page
    /// after at least half the wait) frees the lease at once, so the caller's next
    /// [`Self::claim_feed`] asks again; any other answer (an empty page at once: a relay that
    /// does not wait) and a failed fetch make the next one due `interval_ms` after this one
    /// was sent.
    pub fn feed_done(&mut self, status: Option<u32>, body: &[u8], now_ms: u64) -> bool {
        let Some((_, sent_ms, since)) = self.feed_awaiting.take() else {
            return false;
        };
        let page = match status {
            Some(200) => FeedPage::decode(body).map_err(|_| CalloutEnd::Unparseable),
            _ => Err(CalloutEnd::Failed),
        };
        let page = match page {
            Ok(page) => page,
            Err(end) => {
                self.events.push(Event::KvFeed(end));
                self.feed_failed(sent_ms);
                return false;
            }
        };
        self.events.push(Event::KvFeed(CalloutEnd::Ok));
        let next = page.version;
        let kv = &self.config.kv_events;
        let held = now_ms.saturating_sub(sent_ms) >= kv.wait_ms / 2;
        let again_ms = if kv.wait_ms > 0 && (next != since || page.reset || held) {
            now_ms
        } else {
            sent_ms + kv.interval_ms
        };
        let reset = page.reset;
        let moved = self.update_feed_cursor(|mut cursor| {
            // A reset page replaces whatever we had: apply it even if the cursor moved.
            (cursor.version == since || reset).then(|| {
                cursor.version = next;
                cursor.next_fetch_ms = again_ms;
                cursor
            })
        });
        if moved.is_none() {
            return true;
        }
        self.router.set_now(now_ms as f64);
        self.apply_page(&page);
        true
    }

    /// A long poll failed (a timeout, an error, garbage): the next fetch is due `interval_ms`
    /// after it was sent, as when polling, not when its lease would have run out. Left alone
    /// if another instance claimed the feed since.
    fn feed_failed(&mut self, sent_ms: u64) {
        let kv = &self.config.kv_events;
        if kv.wait_ms == 0 {
            return;
        }
        let (leased, due) = (
            sent_ms + kv.wait_ms + kv.timeout_ms,
            sent_ms + kv.interval_ms,
        );
        let _ = self.update_feed_cursor(|mut cursor| {
            (cursor.next_fetch_ms == leased).then(|| {
                cursor.next_fetch_ms = due;
                cursor
            })
        });
    }

    /// Changes the feed's cursor in shared data (a CAS; `change` returns `None` to leave it);
    /// the cursor written, if it was.
    fn update_feed_cursor(
        &mut self,
        change: impl FnMut(FeedCursor) -> Option<FeedCursor>,
    ) -> Option<FeedCursor> {
        let outcome = cas_update(
            self.host(),
            FEED_KEY,
            FeedCursor::decode,
            FeedCursor::encode,
            change,
        );
        self.settle(outcome)
    }

    /// Writes a feed page into the shared index: per server of the pool, whether its events
    /// flow, a clear, its confirmed and removed blocks (one CAS per bucket touched), and the
    /// end marks of the requests other gateways routed (core's `Router::mark_stored`; they ride
    /// on the confirmed blocks' writes).
    fn apply_page(&mut self, page: &FeedPage) {
        let (mut stored, mut removed, mut cleared, mut lost) = (0u64, 0u64, 0u32, 0u32);
        let mut ends = 0u64;
        self.router.store_mut().begin_request();
        for server in &page.servers {
            let Some(endpoint) = self
                .pool
                .members
                .iter()
                .position(|m| m.address == server.address)
            else {
                continue;
            };
            let store = self.router.store_mut();
            let was_precise = store.with_endpoint_state(endpoint, |s| s.precise);
            if was_precise && !server.live {
                lost += 1;
            }
            let unchanged = server.stored.is_empty()
                && server.removed.is_empty()
                && server.runs.is_empty()
                && !server.cleared
                && was_precise == server.live;
            if unchanged {
                continue;
            }
            cleared += u32::from(server.cleared);
            stored += server.stored.len() as u64;
            removed += server.removed.len() as u64;
            store.apply_truth(
                endpoint,
                server.live,
                server.cleared || page.reset,
                &server.stored,
                &server.removed,
            );
            for run in &server.runs {
                ends += u64::from(self.router.mark_stored(endpoint, run));
            }
        }
        let errors = self.router.store_mut().end_request();
        self.count_shared(errors);
        self.events.push(Event::KvApplied {
            stored,
            removed,
            cleared,
            lost,
            ends,
        });
    }

    /// What happened since the events were last cleared, for the stats.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// Forgets the events, keeping their room: a request pushes a few, and a vector taken
    /// away on every flush would be allocated again by the next request.
    pub fn clear_events(&mut self) {
        self.events.clear();
    }

    #[cfg(test)]
    pub fn drain_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }
}

#[cfg(test)]
mod pool_tests;

#[cfg(test)]
mod precise_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::MemShared;
    use prefixroute_core::config::EndpointConfig;
    use prefixroute_core::hashing::hash_request;
    use prefixroute_core::latency::{EndpointWork, RequestLedger};
    use prefixroute_core::metrics::ServerMetrics;
    use prefixroute_core::PrefixStore;

    #[test]
    fn an_attempt_count_is_read_from_envoys_eight_little_endian_bytes_and_nothing_else() {
        assert_eq!(decode_attempt_count(&3u64.to_le_bytes()), Some(3));
        assert_eq!(decode_attempt_count(&1u64.to_le_bytes()), Some(1));
        assert_eq!(
            decode_attempt_count(&u64::MAX.to_le_bytes()),
            Some(u32::MAX)
        );
        // Text (the `x-envoy-attempt-count` header's form), a 4-byte integer, nothing.
        for value in [&b"2"[..], &2u32.to_le_bytes(), b"", b"123456789"] {
            assert_eq!(decode_attempt_count(value), None, "{value:?}");
        }
    }

    fn config(n: usize, policy: Policy) -> PluginConfig {
        PluginConfig {
            endpoints: (0..n)
                .map(|i| EndpointConfig {
                    name: format!("e{i}"),
                    address: format!("127.0.0.1:{}", 18000 + i),
                })
                .collect(),
            policy,
            block_size: 4,
            seed: 11,
            ..PluginConfig::default()
        }
    }

    fn chat(system: &str, user: &str) -> Vec<u8> {
        serde_json::json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": user}
            ]
        })
        .to_string()
        .into_bytes()
    }

    fn page(waiting: u32, running: u32, kv: f64) -> String {
        format!(
            "vllm:num_requests_waiting {waiting}\nvllm:num_requests_running {running}\n\
             vllm:kv_cache_usage_perc {kv}\n"
        )
    }

    /// Runs one tick and answers every claimed scrape with `pages[e]`.
    fn tick_and_scrape(scheduler: &mut Scheduler<MemShared>, now: u64, pages: &[Option<String>]) {
        for (k, e) in scheduler.tick(now).into_iter().enumerate() {
            let token = 1000 + now as u32 * 16 + k as u32;
            scheduler.scrape_sent(token, e, now);
            match &pages[e] {
                Some(p) => scheduler.scrape_done(token, Some(200), p.as_bytes(), now + 1),
                None => scheduler.scrape_done(token, None, b"", now + 1),
            };
        }
    }

    #[test]
    fn same_prefix_goes_to_the_same_endpoint_across_workers() {
        let host = MemShared::new();
        let mut w1 = Scheduler::new(host.clone(), config(4, Policy::Prefix));
        let mut w2 = Scheduler::new(host.clone(), config(4, Policy::Prefix));
        let system = "You are the support bot of tenant seven. ".repeat(20);
        let first = w1.route(&chat(&system, "where is my order?"), 0);
        let Route::Routed { cold, .. } = first.route else {
            panic!("{first:?}")
        };
        assert!(cold);
        w1.release(&first.ticket, 1);
        let second = w2.route(&chat(&system, "cancel it please"), 2);
        assert_eq!(second.endpoint, first.endpoint);
        let Route::Routed {
            matched_blocks,
            total_blocks,
            cold,
            ..
        } = second.route
        else {
            panic!("{second:?}")
        };
        assert!(!cold && matched_blocks > 0 && matched_blocks < total_blocks);
    }

    #[test]
    fn cold_prefixes_spread_across_workers() {
        let host = MemShared::new();
        let mut workers: Vec<Scheduler<MemShared>> = (0..3)
            .map(|_| Scheduler::new(host.clone(), config(3, Policy::Prefix)))
            .collect();
        // Three new tenants, each arriving on a different worker, land on three replicas.
        // (Completions prompts: chat bodies would share their first block, the role marker.)
        let mut seen: Vec<usize> = (0..3)
            .map(|t| {
                let body = serde_json::json!({"prompt": format!("tenant {t} prompt ").repeat(30)});
                workers[t].route(body.to_string().as_bytes(), 0).endpoint
            })
            .collect();
        seen.sort();
        assert_eq!(seen, vec![0, 1, 2]);
    }

    #[test]
    fn bad_bodies_fall_back_and_are_counted() {
        let host = MemShared::new();
        let mut e = Scheduler::new(host, config(3, Policy::Prefix));
        for body in [
            &b"not json"[..],
            b"[1,2]",
            br#"{"messages":[]}"#,
            br#"{"messages":"x"}"#,
            br#"{"prompt":5}"#,
        ] {
            let c = e.route(body, 0);
            assert_eq!(c.route, Route::Fallback(FallbackReason::ParseError));
        }
        let events = e.drain_events();
        let fallbacks = events
            .iter()
            .filter(|ev| matches!(ev, Event::Fallback { .. }))
            .count();
        assert_eq!(fallbacks, 5);
        // Streaming requests route normally.
        let c = e.route(br#"{"model":"m","prompt":"hi there","stream":true}"#, 0);
        assert!(matches!(c.route, Route::Routed { .. }));
    }

    #[test]
    fn a_retried_request_was_answered_by_the_failover_endpoint_its_tries_reached() {
        let mut e = Scheduler::new(MemShared::new(), config(3, Policy::RoundRobin));
        let choice = e.route(&chat("You are a helpful assistant.", "hi"), 0);
        let listed: Vec<usize> = std::iter::once(choice.endpoint)
            .chain(choice.failover.iter().copied())
            .collect();
        assert_eq!(listed.len(), 3);
        assert_eq!(choice.answered_by(0), Some(listed[0]), "no count: one try");
        assert_eq!(choice.answered_by(1), Some(listed[0]));
        assert_eq!(choice.answered_by(3), Some(listed[2]));
        assert_eq!(
            choice.answered_by(4),
            None,
            "past the list: Envoy's fallback chose"
        );
    }

    #[test]
    fn fallback_spreads_by_in_flight_and_skips_down_endpoints() {
        let host = MemShared::new();
        let mut e = Scheduler::new(host, config(3, Policy::Prefix));
        let picks: Vec<Choice> = (0..3)
            .map(|_| e.fallback(FallbackReason::NotRoutable, 0))
            .collect();
        assert_eq!(
            picks.iter().map(|c| c.endpoint).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        e.release(&picks[1].ticket, 0);
        assert_eq!(e.fallback(FallbackReason::NotRoutable, 0).endpoint, 1);
        // Endpoint 0 fails its scrapes twice: down.
        let pages = [None, Some(page(0, 0, 0.0)), Some(page(0, 0, 0.0))];
        tick_and_scrape(&mut e, 1000, &pages);
        tick_and_scrape(&mut e, 2000, &pages);
        assert!(e.drain_events().contains(&Event::EndpointDown(0)));
        for _ in 0..4 {
            assert_ne!(e.fallback(FallbackReason::NotRoutable, 2100).endpoint, 0);
        }
        // The router avoids it too.
        for i in 0..4 {
            let body = chat("sys", &format!("q{i}"));
            assert_ne!(e.route(&body, 2100).endpoint, 0);
        }
    }

    #[test]
    fn one_scrape_per_endpoint_per_interval_across_workers() {
        let host = MemShared::new();
        let mut workers: Vec<Scheduler<MemShared>> = (0..3)
            .map(|_| Scheduler::new(host.clone(), config(2, Policy::Prefix)))
            .collect();
        let mut scrapes = [0; 2];
        // interval 1000 ms, tick 250 ms, 5 s.
        for now in (0..5000).step_by(250) {
            for w in workers.iter_mut() {
                for e in w.tick(now) {
                    scrapes[e] += 1;
                    w.scrape_sent(now as u32 + e as u32, e, now);
                    w.scrape_done(now as u32 + e as u32, Some(200), b"", now + 5);
                }
            }
        }
        assert_eq!(scrapes, [5, 5]);
    }

    #[test]
    fn stale_or_failed_scrapes_leave_endpoints_unmeasured() {
        let host = MemShared::new();
        let mut e = Scheduler::new(host.clone(), config(2, Policy::LeastQueue));
        tick_and_scrape(&mut e, 0, &[Some(page(9, 0, 0.0)), Some(page(1, 0, 0.0))]);
        let c = e.route(&chat("s", "a"), 10);
        assert_eq!(c.endpoint, 1, "shorter measured queue");
        e.release(&c.ticket, 10);
        // Long after stale_after_ms (5 s) without new scrapes both are unmeasured: a tie.
        let mut seen = [false; 2];
        for i in 0..32 {
            let c = e.route(&chat("s", &format!("{i}")), 60_000);
            e.release(&c.ticket, 60_000);
            seen[c.endpoint] = true;
        }
        assert_eq!(seen, [true, true]);
    }

    #[test]
    fn in_flight_requests_shift_load_between_scrapes() {
        let host = MemShared::new();
        let mut w1 = Scheduler::new(host.clone(), config(2, Policy::LeastQueue));
        let mut w2 = Scheduler::new(host.clone(), config(2, Policy::LeastQueue));
        let idle = Some(page(0, 0, 0.0));
        tick_and_scrape(&mut w1, 0, &[idle.clone(), idle]);
        // w1 sends requests; w2 sees them without any new scrape.
        let a = w1.route(&chat("s", "1"), 10);
        let b = w1.route(&chat("s", "2"), 10);
        assert_ne!(
            a.endpoint, b.endpoint,
            "the first in-flight request already counts"
        );
        let c = w1.route(&chat("s", "3"), 10).endpoint;
        // w1 registered on its first request; peers learn of it on their next tick.
        w2.tick(15);
        w1.release(&a.ticket, 20);
        w1.release(&b.ticket, 20);
        let d = w2.route(&chat("s", "4"), 30).endpoint;
        assert_ne!(d, c, "w2 sees w1's remaining in-flight request");
    }

    #[test]
    fn restart_detection_forgets_the_index() {
        let host = MemShared::new();
        let mut e = Scheduler::new(host, config(2, Policy::PrefixOnly));
        let body = chat(&"long shared prompt ".repeat(10), "q");
        let choice = e.route(&body, 0);
        e.release(&choice.ticket, 0);
        let first = choice.endpoint;
        let mut pages = vec![Some(page(0, 0, 0.0)), Some(page(0, 0, 0.0))];
        pages[first] = None;
        tick_and_scrape(&mut e, 1000, &pages);
        tick_and_scrape(&mut e, 2000, &pages);
        pages[first] = Some(page(0, 0, 0.0));
        tick_and_scrape(&mut e, 3000, &pages);
        let events = e.drain_events();
        assert!(events.contains(&Event::EndpointUp(first)));
        assert!(events.contains(&Event::IndexForgotten(first)));
        let again = e.route(&body, 3100);
        assert!(matches!(again.route, Route::Routed { cold: true, .. }));
    }

    /// Core's side of the differential property: the in-memory `Router` and a `RequestLedger`
    /// fed exactly what the plugin is documented to decide with.
    struct CoreMirror {
        cfg: PluginConfig,
        router: Router,
        ledger: RequestLedger,
        /// The requests in flight per endpoint when the (one) scrape was first used.
        sent_then: Vec<Option<u32>>,
    }

    impl CoreMirror {
        fn new(cfg: &PluginConfig) -> Self {
            let n = cfg.endpoints.len();
            CoreMirror {
                cfg: cfg.clone(),
                router: Router::new(cfg.router_config(), n),
                ledger: RequestLedger::new(n),
                sent_then: vec![None; n],
            }
        }

        fn route(
            &mut self,
            body: &[u8],
            metrics: &[ServerMetrics],
            now_ms: u64,
        ) -> (usize, Prediction) {
            self.router.set_now(now_ms as f64);
            let hashes = hash_request(&parse_request(body).unwrap(), self.cfg.router_config().hash);
            let learned = self.ledger.learned.estimate(&self.cfg.latency);
            let loads: Vec<EndpointLoad> = (0..metrics.len())
                .map(|e| {
                    let work = self.ledger.work[e];
                    let then = *self.sent_then[e].get_or_insert(work.in_flight);
                    let mut load = estimate_load(Some(&metrics[e]), work, Some(then), false);
                    learned.apply_to(e, &mut load.latency);
                    load
                })
                .collect();
            let d = self.router.pick(&hashes, &loads).unwrap();
            let p = self.router.prediction_for(&d, &hashes, &loads[d.endpoint]);
            self.router.commit(&d, &hashes);
            self.ledger.sent(d.endpoint, &p);
            (d.endpoint, p)
        }
    }

    /// The differential property the wasmtime harness checks end to end: with one VM, the
    /// plugin's choices equal core's in-memory Router's for the same requests and loads,
    /// including what both learn from first bytes.
    #[test]
    fn one_instance_decides_exactly_like_core_router() {
        for policy in Policy::ALL {
            let host = MemShared::new();
            let cfg = config(4, policy);
            let mut scheduler = Scheduler::new(host, cfg.clone());
            let mut core = CoreMirror::new(&cfg);
            let metrics = [
                ServerMetrics {
                    num_requests_waiting: Some(0.0),
                    num_requests_running: Some(0.0),
                    kv_cache_usage_perc: Some(0.1),
                    ..ServerMetrics::default()
                },
                ServerMetrics {
                    num_requests_waiting: Some(2.0),
                    num_requests_running: Some(1.0),
                    kv_cache_usage_perc: Some(0.5),
                    ..ServerMetrics::default()
                },
                ServerMetrics::default(),
                ServerMetrics {
                    num_requests_waiting: Some(1.0),
                    num_requests_running: Some(3.0),
                    kv_cache_usage_perc: Some(0.95),
                    ..ServerMetrics::default()
                },
            ];
            let pages: Vec<Option<String>> = metrics
                .iter()
                .map(|m| {
                    let mut p = String::new();
                    if let Some(w) = m.num_requests_waiting {
                        p += &format!("vllm:num_requests_waiting {w}\n");
                    }
                    if let Some(r) = m.num_requests_running {
                        p += &format!("vllm:num_requests_running {r}\n");
                    }
                    if let Some(k) = m.kv_cache_usage_perc {
                        p += &format!("vllm:kv_cache_usage_perc {k}\n");
                    }
                    Some(p)
                })
                .collect();
            tick_and_scrape(&mut scheduler, 0, &pages);
            let mut open: Vec<(Ticket, u64)> = Vec::new();
            let tenants: Vec<String> = (0..5)
                .map(|t| format!("tenant {t} system prompt. ").repeat(8))
                .collect();
            let latency = cfg.latency;
            for i in 0..120u64 {
                // Within stale_after_ms of the one scrape, as the core side assumes.
                let now = 10 + 30 * i;
                let body = chat(&tenants[(i * 7 % 5) as usize], &format!("question {i}"));
                let (expected, prediction) = core.route(&body, &metrics, now);
                let mut got = scheduler.route(&body, now);
                assert_eq!(got.endpoint, expected, "{policy} request {i}");
                // The first byte comes back after a time that depends on the work: the rate
                // both sides learn from it must agree too. Every 17th is a failed answer.
                let elapsed = 5 + prediction.uncached_tokens as u64 / 3 + i % 11;
                let success = i % 17 != 0;
                scheduler.first_byte(&mut got.ticket, success, now + elapsed);
                let observation = success.then(|| Observation::of(&prediction, elapsed as f64));
                let _ = core.ledger.first_byte(
                    expected,
                    prediction.uncached_tokens as u64,
                    observation,
                    &latency,
                );
                open.push((got.ticket, now + elapsed));
                if i % 3 == 2 {
                    let (ticket, first_byte) = open.remove(0);
                    let end = (now + 20).max(first_byte);
                    let hold = ticket.answered.then(|| (end - first_byte) as f64);
                    core.ledger.done(ticket.endpoint, None, hold).unwrap();
                    scheduler.release(&ticket, end);
                }
            }
            let learned = core
                .ledger
                .learned
                .rates
                .iter()
                .any(|r| r.work_tokens > 0.0);
            assert!(learned, "{policy}: first bytes taught the model something");
        }
    }

    #[test]
    fn a_reset_before_the_first_byte_releases_the_prefill_work() {
        let host = MemShared::new();
        let mut e = Scheduler::new(host.clone(), config(2, Policy::Latency));
        let c = e.route(&chat(&"doc ".repeat(200), "q"), 0);
        let pooled = e.ledger.totals(&host, 0);
        assert_eq!(pooled.work[c.endpoint].prefilling, 1);
        assert!(pooled.work[c.endpoint].prefill_tokens > 100);
        e.release(&c.ticket, 5);
        let pooled = e.ledger.totals(&host, 5);
        assert_eq!(pooled.work[c.endpoint], EndpointWork::default());
        // First byte then end: released once each, nothing left over.
        let mut c = e.route(&chat(&"doc ".repeat(200), "q2"), 10);
        e.first_byte(&mut c.ticket, true, 40);
        e.first_byte(&mut c.ticket, true, 41);
        e.release(&c.ticket, 50);
        assert_eq!(
            e.ledger.totals(&host, 50).work[c.endpoint],
            EndpointWork::default()
        );
    }

    #[test]
    fn a_whole_answers_first_byte_is_published_with_its_end_and_a_streamed_ones_at_once() {
        let host = MemShared::new();
        let mut w1 = Scheduler::new(host.clone(), config(2, Policy::Latency));
        let mut w2 = Scheduler::new(host.clone(), config(2, Policy::Latency));
        let body = |stream: bool, q: &str| {
            serde_json::json!({
                "model": "m",
                "stream": stream,
                "messages": [{"role": "system", "content": "doc ".repeat(200)},
                             {"role": "user", "content": q}]
            })
            .to_string()
            .into_bytes()
        };
        // w1 registers on its first request, w2 learns of it at its tick.
        let warmup = w1.route(&body(false, "w"), 0);
        w1.release(&warmup.ticket, 1);
        w2.tick(2);
        for (stream, q) in [(false, "a"), (true, "b"), (false, "c\n"), (true, "d")] {
            let mut c = w1.route(&body(stream, q), 10);
            assert_eq!(c.ticket.streamed, stream);
            let e = c.endpoint;
            assert_eq!(w2.ledger.totals(&host, 10).work[e].prefilling, 1);
            let (_, sets) = host.calls();
            w1.first_byte(&mut c.ticket, true, 40);
            let written = host.calls().1 - sets;
            // This worker's own view has the first byte either way.
            assert_eq!(w1.ledger.totals(&host, 40).work[e].prefilling, 0);
            let seen = w2.ledger.totals(&host, 40).work[e];
            if stream {
                assert_eq!(written, 1, "a streamed first byte is written at once");
                assert_eq!((seen.prefilling, seen.in_flight), (0, 1));
            } else {
                assert_eq!(written, 0, "a whole answer's first byte waits for its end");
                assert_eq!((seen.prefilling, seen.in_flight), (1, 1));
            }
            let (_, sets) = host.calls();
            w1.release(&c.ticket, 41);
            assert_eq!(host.calls().1 - sets, 1, "the end: one write");
            assert_eq!(w2.ledger.totals(&host, 41).work[e], EndpointWork::default());
        }
        // A body that is not parsed (fallback) cannot say: published at once, as before.
        let mut f = w1.route(b"{not json", 50);
        assert!(f.ticket.streamed);
        w1.first_byte(&mut f.ticket, true, 51);
        w1.release(&f.ticket, 52);
    }

    #[test]
    fn absurd_first_bytes_are_counted_and_teach_nothing() {
        let host = MemShared::new();
        let mut e = Scheduler::new(host.clone(), config(2, Policy::Latency));
        let mut c = e.route(&chat("s", "q"), 100);
        // The clock went backwards: zero elapsed time.
        e.first_byte(&mut c.ticket, true, 50);
        assert_one_refused(&e.drain_events());
        let learned = &e.ledger.totals(&host, 100).learned;
        assert!(learned.rates.iter().all(|r| r.work_tokens == 0.0));
    }

    /// The events count one refused observation, and none the model learned from.
    fn assert_one_refused(events: &[Event]) {
        let one = Event::Observations {
            used: 0,
            refused: 1,
        };
        assert!(events.contains(&one), "{events:?}");
    }

    #[test]
    fn a_negative_finished_request_counter_is_counted_once_per_scrape() {
        let host = MemShared::new();
        let mut e = Scheduler::new(host.clone(), config(2, Policy::Latency));
        let counter = |total: &str| {
            format!("vllm:num_requests_waiting 0\nvllm:request_success_total {total}\n")
        };
        tick_and_scrape(&mut e, 0, &[Some(counter("-3")), Some(counter("7"))]);
        e.drain_events();
        e.route(&chat("s", "q"), 10);
        assert_one_refused(&e.drain_events());
        // Read once per scrape: the next request of the same scrape counts nothing again.
        e.route(&chat("s", "q2"), 20);
        let again = e.drain_events();
        assert!(
            !again
                .iter()
                .any(|ev| matches!(ev, Event::Observations { .. })),
            "{again:?}"
        );
    }

    #[test]
    fn a_reported_cache_bounds_the_belief_and_an_unreported_one_is_counted() {
        let host = MemShared::new();
        let mut e = Scheduler::new(host.clone(), config(2, Policy::Latency));
        let with_capacity = "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n\
            vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"10\"} 1\n";
        tick_and_scrape(
            &mut e,
            0,
            &[Some(with_capacity.into()), Some(page(0, 0, 0.0))],
        );
        let events = e.drain_events();
        assert!(events.contains(&Event::CapacityUnreported(1)));
        assert!(!events.contains(&Event::CapacityUnreported(0)));
        // 10 blocks of 16 tokens = 40 of the router's blocks of 4.
        e.route(&chat("s", "q"), 10);
        assert_eq!(e.router.store().room(0).capacity_blocks, 40);
        assert_eq!(
            e.router.store().room(1).capacity_blocks,
            e.config().index_capacity_blocks
        );
    }

    #[test]
    fn a_server_that_hits_less_than_believed_shrinks_its_belief_until_they_agree() {
        let host = MemShared::new();
        let mut e = Scheduler::new(host.clone(), config(1, Policy::Latency));
        let system = "word ".repeat(400); // ~100 blocks of 4 tokens
                                          // The replica caches 100 blocks of 16 tokens = 400 of the router's blocks of 4.
        let page = |hits: u64, queries: u64| {
            Some(format!(
                "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n\
                 vllm:cache_config_info{{block_size=\"16\",num_gpu_blocks=\"100\"}} 1\n\
                 vllm:prefix_cache_hits_total {hits}\nvllm:prefix_cache_queries_total {queries}\n"
            ))
        };
        let (mut hits, mut queries) = (0u64, 0u64);
        let mut now = 0;
        tick_and_scrape(&mut e, now, &[page(hits, queries)]);
        let mut capacity = Vec::new();
        let mut run = |e: &mut Scheduler<MemShared>, now: &mut u64, served_share: f64| {
            // Twenty warm requests per interval; the server reports what share it really hit.
            let mut sent = 0;
            for i in 0..20 {
                let c = e.route(&chat(&system, &format!("q{i} at {now}")), *now + 10);
                e.release(&c.ticket, *now + 20);
                let Route::Routed { .. } = c.route else {
                    panic!()
                };
                sent += c.ticket.prediction.unwrap().uncached_tokens
                    + c.ticket.prediction.unwrap().cached_tokens;
            }
            queries += sent as u64;
            hits += (sent as f64 * served_share) as u64;
            *now += 1000;
            tick_and_scrape(e, *now, &[page(hits, queries)]);
            e.router.store().room(0).capacity_blocks
        };
        for _ in 0..8 {
            capacity.push(run(&mut e, &mut now, 0.1));
        }
        assert_eq!(
            capacity[0], 400,
            "the first interval has no earlier counters to compare"
        );
        assert!(capacity.windows(2).all(|w| w[1] <= w[0]), "{capacity:?}");
        assert_eq!(
            *capacity.last().unwrap(),
            100,
            "a quarter of 400: {capacity:?}"
        );
        // The server serves what the belief predicts again: the belief grows back.
        let mut recovered = 0;
        for _ in 0..30 {
            recovered = run(&mut e, &mut now, 0.97);
        }
        assert_eq!(recovered, 400);
    }

    #[test]
    fn shared_data_cost_per_request() {
        let host = MemShared::new();
        let mut e = Scheduler::new(host.clone(), config(4, Policy::Prefix));
        let system = "word ".repeat(400); // ~100 blocks of 4 tokens
        let warm = e.route(&chat(&system, "q0"), 0);
        e.release(&warm.ticket, 0);
        let (g0, s0) = host.calls();
        let c = e.route(&chat(&system, "q1 is new"), 1);
        let (g1, s1) = host.calls();
        let Route::Routed { total_blocks, .. } = c.route else {
            panic!()
        };
        // gets: 4 endpoint records + the buckets a binary search over the chain probes (about
        // two per halving) + re-reads before CAS writes; sets: the new tail blocks' buckets,
        // one clock, one in-flight record. Far fewer than one get per block.
        let (gets, sets) = (g1 - g0, s1 - s0);
        let halvings = usize::BITS - total_blocks.leading_zeros();
        assert!(
            gets as usize <= 4 + 2 * halvings as usize + 4,
            "gets {gets} for {total_blocks} blocks"
        );
        assert!(sets <= 6, "sets {sets}");
        eprintln!("blocks {total_blocks}: {gets} gets, {sets} sets");
    }
}
