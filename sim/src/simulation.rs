//! The simulator: a trace through the router in front of simulated vLLM replicas.
//!
//! Each request arrives at its trace time, the router sees every replica's queue and KV-cache
//! usage as its gateway's last scrape showed them (every second by default, as the plugin
//! scrapes; [`SimConfig::scrape_interval_ms`]), picks, the replica serves (its own prefix cache
//! decides hits, not the router's belief), and the router commits. It is stepwise so the web
//! demo can show one decision at a time.
//!
//! The router also keeps what a proxy keeps: the requests it has in flight per replica and the
//! prefill work of those whose first byte has not come back
//! ([`prefixroute_core::latency::EndpointWork`]), released when the first byte and the end of
//! each response happen in simulated time; the prefill rate it learns from those first bytes;
//! the lanes it learns from the scrapes; and each replica's cache capacity as its metrics
//! report it (`num_gpu_blocks`), which bounds the belief.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::fleet::{FleetChange, FleetError, FleetEvent};
use crate::pd::{decode_stalls, PdConfig, PdStats, PrefillPool, RemotePrefill, Span};
use crate::replica::{ReplicaSim, ReplicaTiming, Served};
use crate::summary::{groups_on_one_endpoint, natural_key, percentile};
use crate::trace::TraceRecord;
use prefixroute_core::config::{IndexMode, PluginConfig};
use prefixroute_core::feed::StoredRun;
use prefixroute_core::hashing::{hash_request, BlockHashes};
use prefixroute_core::latency::{Calibration, Observation, RequestLedger, SentTokens};
use prefixroute_core::metrics::ServerMetrics;
use prefixroute_core::outlier::{mean_retry_back_off_ms, OutlierState};
use prefixroute_core::request::{parse_value, RequestError};
use prefixroute_core::router::{Decision, EndpointLoad, Router, RouterConfig};
use prefixroute_core::scorer::estimate_load;

#[derive(Debug, Clone, PartialEq, Error)]
pub enum SimError {
    #[error("request {index} ({group}): {source}")]
    BadRequest {
        index: usize,
        group: String,
        source: RequestError,
    },
    #[error(transparent)]
    Config(#[from] prefixroute_core::config::ConfigError),
    #[error("replicas must be at least 1")]
    NoReplicas,
    #[error("gateways must be at least 1")]
    NoGateways,
    #[error("kv_interval_ms must be a number >= 0, got {0}")]
    KvInterval(f64),
    #[error("scrape_interval_ms must be a number >= 0, got {0}")]
    ScrapeInterval(f64),
    #[error(transparent)]
    Disagg(#[from] crate::disagg::DisaggError),
    #[error(transparent)]
    Fleet(#[from] FleetError),
}

/// The simulated fleet and the router in front of it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SimConfig {
    pub replicas: usize,
    /// Prefix-cache capacity of each replica, in blocks.
    pub cache_blocks: usize,
    /// The replicas report their capacity (vLLM's `cache_config_info`), so the router bounds
    /// its belief by it. Without, the belief keeps `router.index_capacity_blocks` (llm-d's
    /// 31,250 by default) and does not see a cache fill up.
    pub capacity_reported: bool,
    pub timing: ReplicaTiming,
    pub router: RouterConfig,
    /// Prefill/decode split: `replicas` are then the decode replicas (see [`crate::pd`]).
    pub pd: Option<PdConfig>,
    /// `precise`: the replicas publish their KV events and the router's belief follows them
    /// (every block a replica stores is recorded, every eviction removed, at once); the
    /// router's own records of a request stay until the server's events say otherwise.
    #[serde(default)]
    pub index: IndexMode,
    /// Gateways in front of the fleet, each with its own router, belief and ledger (separate
    /// Envoys do not share their shared data); requests go to them as `spread` says. Each
    /// sees the replicas' scraped state, and with `index: precise` every one of them reads
    /// the replicas' events.
    pub gateways: usize,
    /// How requests reach the gateways.
    pub spread: GatewaySpread,
    /// With `index: precise`: how often each gateway fetches the replicas' events, in ms (the
    /// plugin's `kv_events.interval_ms`; `prefixroute serve --kv-interval-ms`). 0: a change
    /// reaches every belief the moment the replica makes it. The gateways' fetches are spread
    /// evenly over the interval, as independent Envoys' timers are.
    pub kv_interval_ms: f64,
    /// How often each gateway scrapes the replicas' metrics, in ms (the plugin's
    /// `scrape.interval_ms`): a decision sees the queues (`num_requests_waiting`, `running`)
    /// and cache usage of the gateway's last scrape, which counts none of the requests sent
    /// since and all of those that ended since, and the router reads it as the plugin does
    /// (core's `estimate_load`, with its own requests in flight when it first used the scrape).
    /// The gateways' scrapes are spread evenly over the interval, as independent Envoys'
    /// timers are. 0: every decision sees the replicas as they are at that instant (an ideal
    /// scrape). The calibration against the replicas' hit counters and the noticing of a
    /// restart keep their own 1 s cadence ([`SCRAPE_INTERVAL_MS`]) either way.
    pub scrape_interval_ms: f64,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            replicas: 3,
            cache_blocks: 64,
            capacity_reported: true,
            timing: ReplicaTiming::default(),
            router: RouterConfig::default(),
            pd: None,
            index: IndexMode::Approximate,
            gateways: 1,
            spread: GatewaySpread::InTurn,
            kv_interval_ms: 0.0,
            scrape_interval_ms: SCRAPE_INTERVAL_MS,
        }
    }
}

/// How a client's requests reach several gateways.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GatewaySpread {
    /// Request `i` to gateway `i mod N`: a client or load balancer that spreads every
    /// request (the turns of one conversation go to different gateways).
    #[default]
    InTurn,
    /// Every request of a group to one gateway (by a hash of the group's name): session
    /// affinity in front of the gateways (a consistent hash on a user or session header).
    ByGroup,
}

impl GatewaySpread {
    /// The gateway (of `count`) that request `index` of `group` goes through.
    pub fn gateway(self, index: usize, group: &str, count: usize) -> usize {
        let count = count.max(1);
        match self {
            GatewaySpread::InTurn => index % count,
            GatewaySpread::ByGroup => {
                (xxhash_rust::xxh64::xxh64(group.as_bytes(), 0) % count as u64) as usize
            }
        }
    }
}

impl std::str::FromStr for GatewaySpread {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "in-turn" => Ok(GatewaySpread::InTurn),
            "by-group" => Ok(GatewaySpread::ByGroup),
            _ => Err(format!(
                "unknown gateway spread {s:?} (expected in-turn or by-group)"
            )),
        }
    }
}

/// A trace request, parsed and hashed once.
#[derive(Debug, Clone)]
pub struct SimRequest {
    pub t: f64,
    pub group: String,
    pub hashes: BlockHashes,
    pub output_tokens: usize,
}

/// One simulated request: the decision and what the chosen replica did with it.
#[derive(Debug, Clone, Serialize)]
pub struct Step {
    pub index: usize,
    pub t: f64,
    pub group: String,
    pub decision: Decision,
    /// What the replica that answered did with it; nothing (no tokens) when every try failed.
    /// Its TTFT counts from the first try, Envoy's retries included.
    pub served: Served,
    /// Prefilled on a prefill replica (a P/D split), not where it decodes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote: Option<RemotePrefill>,
    /// The replicas whose failed engines answered a try with a 503 before one answered (the
    /// decision's endpoint first, then its failover list, as Envoy's retries walk them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed_tries: Vec<usize>,
    /// Every try failed: the client got the last 503.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub failed: bool,
}

impl Step {
    /// The replica that served the request: the decision's endpoint, or the one of its
    /// failover list Envoy's retries reached; `None` when every try failed.
    pub fn replica(&self) -> Option<usize> {
        if self.failed {
            return None;
        }
        self.decision.tries().nth(self.failed_tries.len())
    }

    /// `#3 tenant-1: prefix -> replica-2: match 12/14 blocks, score 6.63, next replica-1 4.50`
    pub fn explain(&self, names: &[String]) -> String {
        format!(
            "#{} {}: {}",
            self.index,
            self.group,
            self.decision.explain(names)
        )
    }
}

/// Results of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimReport {
    pub policy: String,
    pub requests: usize,
    /// Tries answered with a 503 by a replica whose engine failed (a `fail` fleet event), and
    /// retried by Envoy on the failover list.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub failed_tries: usize,
    /// Requests whose every try failed (the client got a 503). Their TTFTs are left out of the
    /// percentiles.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub failed_requests: usize,
    /// Server-side prefix-cache hit rate in tokens (hits / queries), 0..1.
    pub hit_rate: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p95_ms: f64,
    pub queue_p95: f64,
    pub groups_on_one: usize,
    pub groups: usize,
    pub requests_per_replica: Vec<usize>,
    /// Per group, requests per replica (for "did the hot tenant spill?").
    pub group_replicas: Vec<(String, Vec<usize>)>,
    /// p95 over requests of the time their tokens waited for other requests' prefills on the
    /// same replica (see [`crate::pd::decode_stalls`]); requests of one output token have none.
    #[serde(default)]
    pub decode_stall_p95_ms: f64,
    /// p95 over requests of their longest gap between two tokens.
    #[serde(default)]
    pub itl_worst_p95_ms: f64,
    /// The prefill/decode split's numbers, for a split fleet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pd: Option<PdStats>,
}

/// Names replicas `replica-0`, `replica-1`, … as the CLI and the demo show them.
pub fn replica_names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("replica-{i}")).collect()
}

/// Parses and hashes a trace for the router's block size.
pub fn prepare(trace: &[TraceRecord], router: &RouterConfig) -> Result<Vec<SimRequest>, SimError> {
    trace
        .iter()
        .enumerate()
        .map(|(index, record)| {
            let parsed = parse_value(&record.body).map_err(|source| SimError::BadRequest {
                index,
                group: record.group.clone(),
                source,
            })?;
            Ok(SimRequest {
                t: record.t,
                group: record.group.clone(),
                hashes: hash_request(&parsed, router.hash),
                output_tokens: parsed.max_tokens.unwrap_or(16) as usize,
            })
        })
        .collect()
}

/// Something the router learns at a point of simulated time.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Signal {
    /// The first response byte: the request's prefill is done.
    FirstByte {
        endpoint: usize,
        uncached_tokens: u64,
        /// `None` for a request prefilled elsewhere: its first byte says nothing of this
        /// replica's prefill rate.
        observation: Option<Observation>,
    },
    /// The response ended: the request no longer holds a lane; it held it `hold_ms` after its
    /// first byte (`None`: another replica answered after a retry, which says nothing of this
    /// one, as in the plugin).
    Done {
        endpoint: usize,
        hold_ms: Option<f64>,
    },
}

/// A signal due at `at_ms` to the gateway that sent the request; `seq` keeps equal times in
/// the order they were scheduled.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Due {
    at_ms: f64,
    seq: u64,
    gateway: usize,
    signal: Signal,
}

impl Eq for Due {}

impl Ord for Due {
    /// Reversed, so that `BinaryHeap` (a max-heap) pops the earliest first.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .at_ms
            .total_cmp(&self.at_ms)
            .then(other.seq.cmp(&self.seq))
    }
}

impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// How often the simulated router reads the replicas' counters (the plugin's default scrape
/// interval).
pub const SCRAPE_INTERVAL_MS: f64 = 1000.0;

/// One gateway: a router with what it alone knows (the plugin keeps this in one Envoy's
/// shared data).
struct Gateway {
    router: Router,
    /// The router's account of its requests.
    ledger: RequestLedger,
    /// Each replica's belief against its own counters, checked once per scrape interval,
    /// with the counters and the ledger's totals at the last check. The counters count every
    /// gateway's requests, the ledger only this one's, as on a real fleet.
    calibration: Vec<Calibration>,
    checked: Vec<(u64, u64, SentTokens)>,
    /// The replicas' cache changes this gateway has not fetched yet, oldest first.
    feed: std::collections::VecDeque<Fetched>,
    /// The gateway's last scrape of the replicas (`None` before its first, or with an ideal
    /// scrape at every decision).
    scrape: Option<Scrape>,
    /// Each replica's answers as this gateway saw them: five failed tries in a row take it out
    /// of rotation (core's `outlier`; an Envoy's workers share it, so one per gateway).
    outliers: Vec<OutlierState>,
}

/// What one scrape of every replica read, and what the gateway had in flight there when it
/// first routed on it.
struct Scrape {
    at_ms: f64,
    replicas: Vec<ServerMetrics>,
    /// Set at the first decision that reads this scrape
    /// ([`prefixroute_core::latency::ServerQueue::sent_then`]).
    sent_then: Option<Vec<u32>>,
}

/// The replica's load metrics at `at_ms`, as its `/metrics` would report them.
fn scraped(replica: &ReplicaSim, at_ms: f64) -> ServerMetrics {
    ServerMetrics {
        num_requests_waiting: Some(replica.waiting(at_ms) as f64),
        num_requests_running: Some(replica.running(at_ms) as f64),
        kv_cache_usage_perc: Some(replica.kv_usage(at_ms)),
        request_success_total: Some(replica.finished(at_ms) as f64),
        ..ServerMetrics::default()
    }
}

/// A replica's cache change, as a gateway's feed delivers it.
struct Fetched {
    at_ms: f64,
    endpoint: usize,
    change: FeedChange,
}

#[derive(Clone)]
enum FeedChange {
    /// A request's new full blocks, and where they start and end (the feed's run).
    Stored(Vec<u64>, StoredRun),
    Evicted(u64),
}

/// Gateway `g` of `count` acts every `interval` ms (> 0), the gateways' phases spread evenly
/// over it, as independent Envoys' timers are: its first tick, and its latest tick at or
/// before `now_ms` on that grid (before the first one when `now_ms` is).
fn ticks(now_ms: f64, interval: f64, g: usize, count: usize) -> (f64, f64) {
    let phase = interval * g as f64 / count as f64;
    (
        phase,
        phase + ((now_ms - phase) / interval).floor() * interval,
    )
}

/// When gateway `g` of `count` next fetches the feed after `now_ms` ([`ticks`]); at once with
/// no interval.
fn next_fetch_ms(now_ms: f64, interval: f64, g: usize, count: usize) -> f64 {
    if interval <= 0.0 {
        return now_ms;
    }
    let (first, last) = ticks(now_ms, interval, g, count);
    (last + interval).max(first)
}

/// When gateway `g` of `count` last scraped by `now_ms` ([`ticks`]); `None` before its first.
fn last_scrape_ms(now_ms: f64, interval: f64, g: usize, count: usize) -> Option<f64> {
    let (first, last) = ticks(now_ms, interval, g, count);
    (now_ms >= first).then_some(last)
}

/// A run in progress.
pub struct Simulation {
    requests: Vec<SimRequest>,
    /// The gateways; which one a request goes through is `spread`'s ([`GatewaySpread::gateway`]).
    gateways: Vec<Gateway>,
    replicas: Vec<ReplicaSim>,
    cache_blocks: usize,
    capacity_reported: bool,
    steps: Vec<Step>,
    /// First bytes a ledger refused as observations (absurd timings).
    refused_observations: u64,
    next_check_ms: f64,
    due: BinaryHeap<Due>,
    seq: u64,
    pd: Option<PdConfig>,
    /// The prefill replicas of a split fleet that has any.
    prefill_pool: Option<PrefillPool>,
    /// The belief follows the replicas' KV events (`index: precise`).
    precise: bool,
    kv_interval_ms: f64,
    /// 0: an ideal scrape at every decision.
    scrape_interval_ms: f64,
    spread: GatewaySpread,
    /// Changes to the fleet still to come, latest first (see [`crate::fleet`]).
    fleet: Vec<FleetEvent>,
    /// Replicas the router may send requests to (not `down`).
    routable: Vec<bool>,
    /// Replicas whose engine failed (`fail`): every try they get is answered with a 503.
    failing: Vec<bool>,
    /// Replicas after the chosen one in the destination header, each one more try for Envoy's
    /// retries (the plugin's `failover`).
    failover: usize,
    /// A replica restarted in place: the scrape at which the router sees it and forgets its
    /// belief there.
    restart_seen_at: Vec<Option<f64>>,
}

impl Simulation {
    pub fn new(trace: &[TraceRecord], config: SimConfig) -> Result<Self, SimError> {
        config.router.validate()?;
        if config.replicas == 0 {
            return Err(SimError::NoReplicas);
        }
        if config.gateways == 0 {
            return Err(SimError::NoGateways);
        }
        if !(config.kv_interval_ms.is_finite() && config.kv_interval_ms >= 0.0) {
            return Err(SimError::KvInterval(config.kv_interval_ms));
        }
        if !(config.scrape_interval_ms.is_finite() && config.scrape_interval_ms >= 0.0) {
            return Err(SimError::ScrapeInterval(config.scrape_interval_ms));
        }
        if let Some(pd) = &config.pd {
            pd.validate()?;
        }
        let requests = prepare(trace, &config.router)?;
        let n = config.replicas;
        let gateway = || {
            let mut router = Router::new(config.router, n);
            // The replicas report their capacity (`num_gpu_blocks`) on the first scrape, in
            // the router's block size; the belief is bounded by it from the first request on
            // (never above the configured bound, as in the plugin). A precise belief is the
            // replicas' events, not bounded by it, but its room is: the capacity says how much
            // room a replica has left, which is what prices a new or growing group.
            if config.capacity_reported {
                let blocks = config.cache_blocks.min(config.router.index_capacity_blocks);
                for e in 0..n {
                    match config.index {
                        IndexMode::Approximate => router.set_capacity(e, blocks),
                        IndexMode::Precise => router.store_mut().report_capacity(e, blocks),
                    }
                }
            }
            Gateway {
                router,
                ledger: RequestLedger::new(n),
                calibration: vec![Calibration::default(); n],
                checked: vec![(0, 0, SentTokens::default()); n],
                feed: std::collections::VecDeque::new(),
                scrape: None,
                outliers: vec![OutlierState::default(); n],
            }
        };
        Ok(Simulation {
            requests,
            gateways: (0..config.gateways).map(|_| gateway()).collect(),
            cache_blocks: config.cache_blocks,
            capacity_reported: config.capacity_reported,
            refused_observations: 0,
            next_check_ms: SCRAPE_INTERVAL_MS,
            due: BinaryHeap::new(),
            seq: 0,
            pd: config.pd,
            precise: config.index == IndexMode::Precise,
            kv_interval_ms: config.kv_interval_ms,
            scrape_interval_ms: config.scrape_interval_ms,
            spread: config.spread,
            prefill_pool: config
                .pd
                .filter(|pd| pd.prefill_replicas > 0)
                .map(|pd| PrefillPool::new(pd.prefill_replicas, config.timing)),
            replicas: (0..config.replicas)
                .map(|_| {
                    let mut r = ReplicaSim::new(
                        config.cache_blocks,
                        config.router.hash.block_size,
                        config.timing,
                    );
                    if config.index == IndexMode::Precise {
                        r.publish_changes();
                    }
                    r
                })
                .collect(),
            steps: Vec::new(),
            fleet: Vec::new(),
            routable: vec![true; n],
            failing: vec![false; n],
            failover: PluginConfig::default().failover,
            restart_seen_at: vec![None; n],
        })
    }

    /// Replicas go down, come up and restart during the run as `events` say (see
    /// [`crate::fleet`]); an event naming a replica the fleet lacks is an error.
    pub fn with_fleet_events(mut self, events: &[FleetEvent]) -> Result<Self, SimError> {
        let mut events = crate::fleet::schedule(events, self.replicas.len())?;
        events.reverse();
        self.fleet = events;
        Ok(self)
    }

    /// Applies the fleet changes due by `now_ms`, and forgets the belief on each restarted
    /// replica once a scrape has seen its counters go back.
    fn change_fleet(&mut self, now_ms: f64) {
        while let Some(&event) = self.fleet.last().filter(|e| e.at_s * 1000.0 <= now_ms) {
            self.fleet.pop();
            let r = event.replica;
            // Whatever the change, the pod's cache is gone; whatever it was, the engine that
            // failed is gone too, unless this is the failure.
            self.replicas[r].cache.clear();
            self.failing[r] = event.change == FleetChange::Fail;
            match event.change {
                // Nothing tells the router: health checks and scrapes still pass.
                FleetChange::Fail => {}
                FleetChange::Down => self.routable[r] = false,
                FleetChange::Up => {
                    // A new pod is a new address: nothing is believed of it, and none of the
                    // old one's failures count against it.
                    self.routable[r] = true;
                    self.restart_seen_at[r] = None;
                    self.forget_endpoint(r);
                    for g in &mut self.gateways {
                        g.outliers[r] = OutlierState::default();
                    }
                }
                FleetChange::Restart if self.precise => self.forget_endpoint(r),
                FleetChange::Restart => {
                    // The first scrape after the restart (scrapes run every interval from 0).
                    let at_ms = event.at_s * 1000.0;
                    let scrape = ((at_ms / SCRAPE_INTERVAL_MS).floor() + 1.0) * SCRAPE_INTERVAL_MS;
                    self.restart_seen_at[r] = Some(scrape);
                }
            }
        }
        for r in 0..self.replicas.len() {
            if self.restart_seen_at[r].is_some_and(|at| at <= now_ms) {
                self.restart_seen_at[r] = None;
                self.forget_endpoint(r);
            }
        }
    }

    fn forget_endpoint(&mut self, r: usize) {
        for g in &mut self.gateways {
            g.router.forget_endpoint(r);
            // What the feed still carries of it happened before: the relay delivers in order.
            g.feed.retain(|f| f.endpoint != r);
        }
    }

    pub fn replicas(&self) -> &[ReplicaSim] {
        &self.replicas
    }

    /// The first gateway's router (the only one, unless [`SimConfig::gateways`] says more).
    pub fn router(&self) -> &Router {
        &self.gateways[0].router
    }

    pub fn requests(&self) -> &[SimRequest] {
        &self.requests
    }

    pub fn steps(&self) -> &[Step] {
        &self.steps
    }

    /// The first gateway's ledger.
    pub fn ledger(&self) -> &RequestLedger {
        &self.gateways[0].ledger
    }

    pub fn refused_observations(&self) -> u64 {
        self.refused_observations
    }

    /// Each replica's calibration of the first gateway's belief against its counters.
    pub fn calibration(&self) -> &[Calibration] {
        &self.gateways[0].calibration
    }

    /// Once per scrape interval, as the plugin does on each scrape: every replica's hit and
    /// query counters since the last check against what the router predicted for what it sent
    /// there; the belief's capacity follows the calibration.
    fn calibrate(&mut self, now_ms: f64) {
        // A precise belief is the replicas' own truth: its size is theirs, nothing to calibrate.
        if now_ms < self.next_check_ms || !self.capacity_reported || self.precise {
            return;
        }
        self.next_check_ms = now_ms + SCRAPE_INTERVAL_MS;
        for (e, replica) in self.replicas.iter().enumerate() {
            let cache = &replica.cache;
            let (hits, queries) = (cache.hit_tokens(), cache.query_tokens());
            for g in &mut self.gateways {
                let sent = g.ledger.sent[e];
                let (last_hits, last_queries, last_sent) = g.checked[e];
                g.calibration[e].observe(
                    hits.saturating_sub(last_hits) as f64,
                    queries.saturating_sub(last_queries) as f64,
                    sent.predicted_cached
                        .saturating_sub(last_sent.predicted_cached) as f64,
                    sent.prompt.saturating_sub(last_sent.prompt) as f64,
                );
                g.checked[e] = (hits, queries, sent);
                let real = self
                    .cache_blocks
                    .min(g.router.config().index_capacity_blocks);
                let capacity = g.calibration[e].capacity(real);
                g.router.set_capacity(e, capacity);
            }
        }
    }

    fn schedule(&mut self, at_ms: f64, gateway: usize, signal: Signal) {
        self.seq += 1;
        self.due.push(Due {
            at_ms,
            seq: self.seq,
            gateway,
            signal,
        });
    }

    /// Applies to each gateway's belief the cache changes its feed has fetched by `now_ms`.
    fn fetch_feeds(gateways: &mut [Gateway], now_ms: f64) {
        for g in gateways {
            while g.feed.front().is_some_and(|f| f.at_ms <= now_ms) {
                let Some(fetched) = g.feed.pop_front() else {
                    break;
                };
                match fetched.change {
                    FeedChange::Stored(hashes, run) => {
                        g.router.set_now(fetched.at_ms);
                        g.router
                            .store_mut()
                            .record_blocks(fetched.endpoint, &hashes);
                        g.router.mark_stored(fetched.endpoint, &run);
                    }
                    FeedChange::Evicted(h) => g.router.store_mut().remove(fetched.endpoint, h),
                }
            }
        }
    }

    /// Delivers every signal due by `now_ms` to the ledger of the gateway that sent it.
    fn catch_up(&mut self, now_ms: f64) {
        Self::fetch_feeds(&mut self.gateways, now_ms);
        while self.due.peek().is_some_and(|d| d.at_ms <= now_ms) {
            let Some(due) = self.due.pop() else { break };
            let g = &mut self.gateways[due.gateway];
            match due.signal {
                Signal::FirstByte {
                    endpoint,
                    uncached_tokens,
                    observation,
                } => {
                    let latency = &g.router.config().latency;
                    if g.ledger
                        .first_byte(endpoint, uncached_tokens, observation, latency)
                        .is_err()
                    {
                        self.refused_observations += 1;
                    }
                }
                Signal::Done { endpoint, hold_ms } => {
                    if g.ledger.done(endpoint, None, hold_ms).is_err() {
                        self.refused_observations += 1;
                    }
                }
            }
        }
    }

    /// Every gateway's scrape as of `now_ms`. Called before each admission, so a replica's
    /// state at any time since the previous request is still what it was then.
    fn scrape(&mut self, now_ms: f64) {
        let interval = self.scrape_interval_ms;
        if interval <= 0.0 {
            return;
        }
        let count = self.gateways.len();
        for (g, gateway) in self.gateways.iter_mut().enumerate() {
            let Some(at_ms) = last_scrape_ms(now_ms, interval, g, count) else {
                continue;
            };
            if gateway.scrape.as_ref().is_some_and(|s| s.at_ms == at_ms) {
                continue;
            }
            let replicas: Vec<ServerMetrics> =
                self.replicas.iter().map(|r| scraped(r, at_ms)).collect();
            // As the plugin does when its worker first sees a scrape come back.
            for (e, m) in replicas.iter().enumerate() {
                if let Some(total) = m.request_success_total {
                    gateway.router.observe_served(e, total, at_ms);
                }
            }
            gateway.scrape = Some(Scrape {
                at_ms,
                replicas,
                sent_then: None,
            });
        }
    }

    /// What a gateway's router knows of every replica at `now_ms`: its last scrape (or an
    /// ideal one now) read as the plugin reads it, plus its ledger.
    fn loads(&mut self, gateway: usize, now_ms: f64) -> Vec<EndpointLoad> {
        let ideal = self.scrape_interval_ms <= 0.0;
        let g = &mut self.gateways[gateway];
        let latency = g.router.config().latency;
        let learned = g.ledger.learned.estimate(&latency);
        let work = &g.ledger.work;
        // The plugin notes its own requests in flight when it first routes on a scrape.
        if let Some(scrape) = g.scrape.as_mut() {
            scrape
                .sent_then
                .get_or_insert_with(|| work.iter().map(|w| w.in_flight).collect());
        }
        (0..self.replicas.len())
            .map(|e| {
                let now;
                let (metrics, sent_then) = if ideal {
                    now = scraped(&self.replicas[e], now_ms);
                    (Some(&now), None)
                } else {
                    match &g.scrape {
                        Some(s) => (
                            s.replicas.get(e),
                            s.sent_then.as_ref().and_then(|t| t.get(e).copied()),
                        ),
                        None => (None, None),
                    }
                };
                let out = g.outliers[e].ejected(now_ms as u64);
                let mut load = estimate_load(metrics, work[e], sent_then, !self.routable[e] || out);
                learned.apply_to(e, &mut load.latency);
                load
            })
            .collect()
    }

    pub fn is_done(&self) -> bool {
        self.steps.len() >= self.requests.len()
    }

    /// Runs the next request; `None` when the trace is exhausted.
    pub fn step(&mut self) -> Option<&Step> {
        let index = self.steps.len();
        let now_ms = self.requests.get(index)?.t * 1000.0;
        self.catch_up(now_ms);
        self.change_fleet(now_ms);
        self.calibrate(now_ms);
        self.scrape(now_ms);
        let gateway = self
            .spread
            .gateway(index, &self.requests[index].group, self.gateways.len());
        let loads = self.loads(gateway, now_ms);
        let request = &self.requests[index];
        let router = &mut self.gateways[gateway].router;
        router.set_now(now_ms);
        let decision = router
            .pick(&request.hashes, &loads)
            .expect("a simulation has replicas: `new` refuses none");
        let block_size = request.hashes.block_size;
        // The server caches full blocks only: the router's chain minus any partial tail.
        let prompts: Vec<(&[u64], usize)> = request
            .hashes
            .chains
            .iter()
            .zip(&request.hashes.tokens)
            .map(|(chain, &tokens)| (&chain[..(tokens / block_size).min(chain.len())], tokens))
            .collect();
        let endpoint = decision.endpoint;
        // The router's ledger: what it predicted it sent (its own belief, not the replica's
        // truth), released at the first byte and at the end of the response.
        let predicted = router.prediction_for(&decision, &request.hashes, &loads[endpoint]);
        let Tries {
            answered_by,
            failed: failed_tries,
            waited_ms: retry_ms,
        } = tries(
            &decision,
            self.failover,
            &self.failing,
            &mut self.gateways[gateway].outliers,
            now_ms,
        );
        // The replica that serves it; the router's own account (its belief, its ledger) stays
        // with the one it chose, as the plugin's does.
        let replica = answered_by.unwrap_or(endpoint);
        let remote = match (&self.pd, self.prefill_pool.as_mut()) {
            // llm-d's decider: on what the router predicts uncached there.
            (Some(pd), Some(pool)) if predicted.uncached_tokens as u64 >= pd.threshold_tokens => {
                let lacking = request.hashes.total_tokens()
                    - self.replicas[replica]
                        .cached_tokens(&prompts)
                        .min(request.hashes.total_tokens());
                Some(pool.prefill(now_ms, lacking, pd))
            }
            _ => None,
        };
        let mut served = match (answered_by, remote) {
            (None, _) => Served {
                prompt_tokens: 0,
                cached_tokens: 0,
                queue_at_arrival: 0,
                wait_ms: 0.0,
                ttft_ms: 0.0,
                finish_ms: now_ms,
            },
            (Some(r), Some(remote)) => self.replicas[r].admit_prefilled(
                now_ms,
                remote.kv_ready_ms,
                &prompts,
                request.output_tokens,
            ),
            (Some(r), None) => self.replicas[r].admit(now_ms, &prompts, request.output_tokens),
        };
        // The replica sees it with the first try (its clock only goes forward); the client
        // waits for Envoy's back-off before each retry too.
        served.ttft_ms += retry_ms;
        served.finish_ms += retry_ms;
        self.gateways[gateway]
            .router
            .commit(&decision, &request.hashes);
        if self.precise {
            // The replica's KV events, to every gateway's feed: applied at its next fetch.
            let interval = self.kv_interval_ms;
            let count = self.gateways.len();
            let changes = answered_by.map(|r| self.replicas[r].take_changes());
            for (p, change) in changes.unwrap_or_default() {
                let change = match change {
                    crate::replica::CacheChange::Stored { first, len } => {
                        let Some((chain, _)) = prompts.get(p) else {
                            continue;
                        };
                        let stored = chain[first..first + len].to_vec();
                        let run = StoredRun {
                            parent: first.checked_sub(1).map(|p| chain[p]),
                            end: stored.last().copied().unwrap_or_default(),
                            blocks: len as u32,
                        };
                        FeedChange::Stored(stored, run)
                    }
                    crate::replica::CacheChange::Evicted(h) => FeedChange::Evicted(h),
                };
                for (g, gateway) in self.gateways.iter_mut().enumerate() {
                    let fetched = Fetched {
                        at_ms: next_fetch_ms(now_ms, interval, g, count),
                        endpoint,
                        change: change.clone(),
                    };
                    gateway.feed.push_back(fetched);
                }
            }
            Self::fetch_feeds(&mut self.gateways, now_ms);
        }
        let (t, group) = (request.t, request.group.clone());
        let uncached = predicted.uncached_tokens as u64;
        self.gateways[gateway].ledger.sent(endpoint, &predicted);
        self.schedule(
            now_ms + served.ttft_ms,
            gateway,
            Signal::FirstByte {
                endpoint,
                uncached_tokens: uncached,
                // What another replica answered after a retry teaches nothing of this one.
                observation: (remote.is_none() && failed_tries.is_empty())
                    .then(|| Observation::of(&predicted, served.ttft_ms)),
            },
        );
        let first_byte_ms = now_ms + served.ttft_ms;
        let end_ms = served.finish_ms.max(first_byte_ms);
        self.schedule(
            end_ms,
            gateway,
            Signal::Done {
                endpoint,
                hold_ms: failed_tries.is_empty().then_some(end_ms - first_byte_ms),
            },
        );
        self.steps.push(Step {
            index,
            t,
            group,
            decision,
            served,
            remote,
            failed: answered_by.is_none(),
            failed_tries,
        });
        self.steps.last()
    }

    pub fn run(&mut self) {
        while self.step().is_some() {}
    }
}

/// How Envoy's tries of one request went.
struct Tries {
    /// The replica that answered; `None` if every try failed.
    answered_by: Option<usize>,
    /// The replicas that answered a try with a 503, in order.
    failed: Vec<usize>,
    /// The back-off Envoy waited before its retries.
    waited_ms: f64,
}

/// Envoy's tries of a request at `now_ms`: the decision's endpoint, then up to `failover` of its
/// next best after a back-off each; a replica whose engine failed answers at once with a 503,
/// which counts towards its ejection (`outliers`).
fn tries(
    decision: &Decision,
    failover: usize,
    failing: &[bool],
    outliers: &mut [OutlierState],
    now_ms: f64,
) -> Tries {
    let mut tries = Tries {
        answered_by: None,
        failed: Vec::new(),
        waited_ms: 0.0,
    };
    for (n, e) in decision.tries().take(1 + failover).enumerate() {
        if n > 0 {
            tries.waited_ms += mean_retry_back_off_ms(n as u32);
        }
        let at_ms = (now_ms + tries.waited_ms) as u64;
        if !failing[e] {
            outliers[e].answered(200, at_ms);
            tries.answered_by = Some(e);
            break;
        }
        outliers[e].answered(503, at_ms);
        tries.failed.push(e);
    }
    tries
}

impl Simulation {
    /// Summary of the steps run so far.
    pub fn report(&self) -> SimReport {
        let n = self.replicas.len();
        let mut per_replica = vec![0; n];
        let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
        // Where each request was served (a request every try of which failed was served nowhere).
        let served = || self.steps.iter().filter_map(|s| Some((s, s.replica()?)));
        for (step, replica) in served() {
            per_replica[replica] += 1;
            match groups.iter_mut().find(|(g, _)| *g == step.group) {
                Some((_, counts)) => counts[replica] += 1,
                None => {
                    let mut counts = vec![0; n];
                    counts[replica] = 1;
                    groups.push((step.group.clone(), counts));
                }
            }
        }
        groups.sort_by_key(|(name, _)| natural_key(name));
        let hits: u64 = self.replicas.iter().map(|r| r.cache.hit_tokens()).sum();
        let queries: u64 = self.replicas.iter().map(|r| r.cache.query_tokens()).sum();
        let ttft: Vec<f64> = served().map(|(s, _)| s.served.ttft_ms).collect();
        let queue: Vec<f64> = served()
            .map(|(s, _)| s.served.queue_at_arrival as f64)
            .collect();
        let (groups_on_one, group_count) =
            groups_on_one_endpoint(served().map(|(s, replica)| (s.group.as_str(), replica)));
        let (stalls, pd) = self.decode_report();
        let stall_total: Vec<f64> = stalls.iter().map(|s| s.total_ms).collect();
        let stall_gap: Vec<f64> = stalls.iter().map(|s| s.worst_gap_ms).collect();
        SimReport {
            decode_stall_p95_ms: percentile(&stall_total, 95.0),
            itl_worst_p95_ms: percentile(&stall_gap, 95.0),
            pd,
            policy: self.router().config().policy.to_string(),
            requests: self.steps.len(),
            failed_tries: self.steps.iter().map(|s| s.failed_tries.len()).sum(),
            failed_requests: self.steps.iter().filter(|s| s.failed).count(),
            hit_rate: if queries == 0 {
                0.0
            } else {
                hits as f64 / queries as f64
            },
            ttft_p50_ms: percentile(&ttft, 50.0),
            ttft_p95_ms: percentile(&ttft, 95.0),
            queue_p95: percentile(&queue, 95.0),
            groups_on_one,
            groups: group_count,
            requests_per_replica: per_replica,
            group_replicas: groups,
        }
    }
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// How far the router's belief was from the replicas' truth over a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct BeliefCheck {
    pub requests: usize,
    /// Requests whose believed match on the chosen replica (in blocks the server could reuse)
    /// was not what the replica reused.
    pub wrong: usize,
    /// Requests sent to a replica believed to hold some of their prefix that held none of it.
    pub false_hits: usize,
}

impl Simulation {
    /// The belief against the truth, request by request.
    pub fn belief_check(&self) -> BeliefCheck {
        let mut check = BeliefCheck {
            requests: self.steps.len(),
            ..BeliefCheck::default()
        };
        // Only where the chosen replica served it: elsewhere the belief was not put to the test.
        for s in self.steps.iter().filter(|s| s.failed_tries.is_empty()) {
            let bs = self.requests[s.index].hashes.block_size.max(1);
            let reusable = s.served.prompt_tokens.saturating_sub(1) / bs;
            let believed = s.decision.matched_blocks();
            check.wrong += usize::from(believed.min(reusable) != s.served.cached_tokens / bs);
            check.false_hits += usize::from(believed > 0 && s.served.cached_tokens == 0);
        }
        check
    }

    /// Every decoding request's stall from the local prefills on its replica, and a split
    /// fleet's own numbers.
    fn decode_report(&self) -> (Vec<crate::pd::Stall>, Option<PdStats>) {
        let mut decodes = Vec::new();
        let mut prefills = Vec::new();
        for (step, replica) in self.steps.iter().filter_map(|s| Some((s, s.replica()?))) {
            let arrival = step.t * 1000.0;
            let first_token = arrival + step.served.ttft_ms;
            if self.requests[step.index].output_tokens > 1 {
                decodes.push(Span {
                    replica,
                    start_ms: first_token,
                    end_ms: step.served.finish_ms,
                    tokens: 0,
                });
            }
            if step.remote.is_none() {
                prefills.push(Span {
                    replica,
                    start_ms: arrival + step.served.wait_ms,
                    end_ms: first_token,
                    tokens: step.served.prompt_tokens - step.served.cached_tokens,
                });
            }
        }
        let timing = self
            .replicas
            .first()
            .map(ReplicaSim::timing)
            .unwrap_or_default();
        let chunk = self.pd.and_then(|pd| pd.chunk_tokens);
        let stalls = decode_stalls(&decodes, &prefills, &timing, chunk);
        let pd = self.pd.map(|pd| {
            let remote: Vec<&RemotePrefill> = self
                .steps
                .iter()
                .filter_map(|s| s.remote.as_ref())
                .collect();
            let start = self.steps.first().map_or(0.0, |s| s.t * 1000.0);
            let end = self
                .steps
                .iter()
                .map(|s| s.served.finish_ms)
                .fold(start, f64::max);
            let link_ms = self
                .prefill_pool
                .as_ref()
                .map_or(0.0, PrefillPool::link_busy_ms);
            let links = pd.prefill_replicas as f64 * (end - start);
            PdStats {
                prefill_replicas: pd.prefill_replicas,
                remote_prefill_share: if self.steps.is_empty() {
                    0.0
                } else {
                    remote.len() as f64 / self.steps.len() as f64
                },
                kv_bytes_moved: remote.iter().map(|r| r.kv_bytes).sum(),
                link_busy_share: if links > 0.0 { link_ms / links } else { 0.0 },
            }
        });
        (stalls, pd)
    }
}

/// Runs a whole trace.
pub fn simulate(trace: &[TraceRecord], config: SimConfig) -> Result<SimReport, SimError> {
    let mut sim = Simulation::new(trace, config)?;
    sim.run();
    Ok(sim.report())
}

/// Policy name of the [`upper_bound`] report.
pub const UPPER_BOUND: &str = "upper bound";

/// The same trace on one server with unlimited cache and every replica's lanes: the hit rate
/// no router over the fleet can beat (each prefix is computed once, then always found), and
/// the TTFT of a fleet that never misses for lack of locality. "Unlimited" is exact: the
/// cache has room for every block of the trace.
pub fn upper_bound(trace: &[TraceRecord], config: SimConfig) -> Result<SimReport, SimError> {
    if config.replicas == 0 {
        return Err(SimError::NoReplicas);
    }
    let blocks: usize = prepare(trace, &config.router)?
        .iter()
        .map(|r| r.hashes.total_blocks())
        .sum();
    let mut one = config;
    one.pd = None;
    one.replicas = 1;
    one.cache_blocks = blocks.max(1);
    one.router.index_capacity_blocks = one.router.index_capacity_blocks.max(one.cache_blocks);
    one.timing.lanes = config.timing.lanes.max(1) * config.replicas;
    one.router.policy = prefixroute_core::config::Policy::RoundRobin;
    let mut report = simulate(trace, one)?;
    report.policy = UPPER_BOUND.to_string();
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::TraceSpec;
    use prefixroute_core::config::Policy;

    fn run(trace: &[TraceRecord], policy: Policy, lanes: usize) -> SimReport {
        let mut config = SimConfig::default();
        config.router.policy = policy;
        config.timing.lanes = lanes;
        simulate(trace, config).unwrap()
    }

    fn default_trace() -> Vec<TraceRecord> {
        TraceSpec::default().generate().unwrap()
    }

    #[test]
    fn prefix_beats_round_robin_and_least_queue_and_pins_every_tenant() {
        let trace = default_trace();
        let prefix = run(&trace, Policy::Prefix, 4);
        let rr = run(&trace, Policy::RoundRobin, 4);
        let lq = run(&trace, Policy::LeastQueue, 4);
        assert!(
            prefix.hit_rate > rr.hit_rate + 0.3,
            "{} vs {}",
            prefix.hit_rate,
            rr.hit_rate
        );
        assert!(
            prefix.hit_rate > lq.hit_rate + 0.3,
            "{} vs {}",
            prefix.hit_rate,
            lq.hit_rate
        );
        assert_eq!(prefix.groups_on_one, prefix.groups);
        assert!(prefix.ttft_p50_ms < rr.ttft_p50_ms);
    }

    #[test]
    fn hot_tenant_spills_under_prefix_but_not_prefix_only() {
        let trace = TraceSpec {
            hot: Some(0.7),
            rate: 40.0,
            requests: 200,
            ..TraceSpec::default()
        }
        .generate()
        .unwrap();
        let replicas_of_hot = |r: &SimReport| {
            let (_, counts) = r
                .group_replicas
                .iter()
                .find(|(g, _)| g == "tenant-0")
                .unwrap();
            counts.iter().filter(|&&c| c > 0).count()
        };
        let prefix = run(&trace, Policy::Prefix, 2);
        let only = run(&trace, Policy::PrefixOnly, 2);
        assert!(replicas_of_hot(&prefix) >= 2, "{:?}", prefix.group_replicas);
        assert_eq!(replicas_of_hot(&only), 1, "{:?}", only.group_replicas);
        assert!(
            only.ttft_p95_ms > 2.0 * prefix.ttft_p95_ms,
            "prefix-only p95 {} vs prefix {}",
            only.ttft_p95_ms,
            prefix.ttft_p95_ms
        );
    }

    #[test]
    fn stepping_matches_a_full_run_and_reports_decisions() {
        let trace = default_trace();
        let mut sim = Simulation::new(&trace, SimConfig::default()).unwrap();
        let first = sim.step().unwrap().clone();
        assert_eq!(first.index, 0);
        assert!(first.decision.cold);
        assert_eq!(first.served.cached_tokens, 0);
        sim.run();
        assert!(sim.is_done());
        assert!(sim.step().is_none());
        assert_eq!(
            sim.report(),
            simulate(&trace, SimConfig::default()).unwrap()
        );
        let line = sim.steps()[3].explain(&replica_names(3));
        assert!(line.starts_with("#3 tenant-"), "{line}");
        assert!(line.contains(" uncached tokens, queue "), "{line}");
        assert!(line.contains(" TTFT "), "{line}");
    }

    #[test]
    fn bad_trace_bodies_are_reported_with_their_index() {
        let mut trace = default_trace();
        trace[2].body = serde_json::json!({"messages": 5});
        let err = Simulation::new(&trace, SimConfig::default()).err().unwrap();
        assert!(err.to_string().starts_with("request 2 (tenant-"), "{err}");
    }

    #[test]
    fn requests_reach_gateways_in_turn_or_each_group_through_one() {
        let in_turn: Vec<usize> = (0..5)
            .map(|i| GatewaySpread::InTurn.gateway(i, "conv-1", 2))
            .collect();
        assert_eq!(in_turn, [0, 1, 0, 1, 0]);
        let groups: Vec<String> = (0..24).map(|g| format!("tenant-{g}")).collect();
        let of = |i: usize, g: &str| GatewaySpread::ByGroup.gateway(i, g, 3);
        // A group's every request through one gateway, whatever its index...
        assert!(groups.iter().all(|g| (0..10).all(|i| of(i, g) == of(0, g))));
        // ...and the groups over all of them.
        let used: std::collections::BTreeSet<usize> = groups.iter().map(|g| of(0, g)).collect();
        assert_eq!(used.len(), 3);
        assert_eq!("by-group".parse(), Ok(GatewaySpread::ByGroup));
        assert!("sticky".parse::<GatewaySpread>().is_err());
    }

    #[test]
    fn each_gateway_fetches_the_feed_at_its_own_phase_of_the_interval() {
        // One gateway: at 200, 400, …; the second of two half an interval later.
        assert_eq!(next_fetch_ms(0.0, 200.0, 0, 2), 200.0);
        assert_eq!(next_fetch_ms(200.0, 200.0, 0, 2), 400.0);
        assert_eq!(next_fetch_ms(99.0, 200.0, 1, 2), 100.0);
        assert_eq!(next_fetch_ms(250.0, 200.0, 1, 2), 300.0);
        // No interval: at once.
        assert_eq!(next_fetch_ms(250.0, 0.0, 1, 2), 250.0);
    }

    #[test]
    fn groups_sort_naturally() {
        let spec = TraceSpec {
            tenants: 12,
            requests: 200,
            ..TraceSpec::default()
        };
        let report = run(&spec.generate().unwrap(), Policy::RoundRobin, 4);
        let names: Vec<&str> = report
            .group_replicas
            .iter()
            .map(|(g, _)| g.as_str())
            .collect();
        assert_eq!(names[9], "tenant-9");
        assert_eq!(names[10], "tenant-10");
    }
}
