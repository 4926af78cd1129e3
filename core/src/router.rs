//! The router: scores → pick, then commit.
//!
//! Picking and committing are separate steps because a proxy decides, forwards, and only then
//! believes the blocks are on the chosen endpoint. [`Router::pick`] never changes the belief;
//! [`Router::commit`] records it.

use rand::Rng;
use rand::SeedableRng;
use rand_pcg::Pcg64Mcg;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::feed::StoredRun;
use crate::hashing::BlockHashes;
use crate::index::{PrefixIndex, PrefixStore, Turn};
use crate::latency::{
    copy_credit_ms, predict, CacheRoom, Footprint, GroupGrowth, LiveGroups, Prediction,
    PrefixRates, RecentRequests, ServedRequests,
};
use crate::scorer::{kv_cache_scores, no_hit_lru_scores, prefix_score, queue_scores};

pub use crate::config::{Placement, Policy, RouterConfig, SaturationFilter, Weights};
pub use crate::scorer::EndpointLoad;

/// One endpoint's view of a decision: every scorer's output and the weighted total.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EndpointScores {
    pub matched_blocks: usize,
    pub prefix: f64,
    pub queue: f64,
    pub kv_cache: f64,
    pub no_hit_lru: f64,
    /// The policy's score, higher is better: the weighted sum for `prefix`, one scorer for the
    /// single-signal policies, minus the predicted cost in ms for `latency`, 0 for
    /// `round-robin` and `random`, which do not score.
    pub total: f64,
    /// Not eligible: down while another endpoint was up, saturated while another was not,
    /// `away_from_head` or `over_share`.
    pub excluded: bool,
    /// Set aside for a group's second request under `latency`: the group lives elsewhere and
    /// this endpoint does not hold its shared head (see `keep_moves_among_head_holders`).
    #[serde(default)]
    pub away_from_head: bool,
    /// Set aside for a group's first request under `latency`: the endpoint holds the request's
    /// prefix, which is hotter than one endpoint's fair share, and has taken more than
    /// `latency.balance_factor` times the mean endpoint's recent requests (see
    /// `bound_busy_holders`).
    #[serde(default)]
    pub over_share: bool,
    /// At or above a saturation threshold (queue or KV-cache usage).
    pub saturated: bool,
    /// The `latency` policy's prediction for this endpoint (`None` under other policies).
    pub prediction: Option<Prediction>,
    /// The endpoint's believed cache when the decision was made.
    pub room: CacheRoom,
    /// The request continues an earlier request on this endpoint (see
    /// [`PrefixStore::continues`]).
    pub continues: bool,
}

/// A routing decision with its full explanation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    pub endpoint: usize,
    pub policy: Policy,
    pub total_blocks: usize,
    pub total_tokens: usize,
    pub scores: Vec<EndpointScores>,
    /// The best endpoint not picked (by the policy's score), if any other was eligible.
    pub runner_up: Option<usize>,
    /// Every other eligible endpoint, best first (by score; in rotation order for
    /// round-robin and random): where a failover goes when the chosen one refuses.
    pub next_best: Vec<usize>,
    /// No eligible endpoint held any block of the request.
    pub cold: bool,
    /// The winner was drawn among endpoints with exactly equal scores.
    pub tie: bool,
    /// Every endpoint was down, so the pick ignored health.
    pub all_down: bool,
    /// The turn of the earlier request this one continues on some eligible endpoint (its
    /// group grows); `None` when it starts a group.
    pub continued: Option<Turn>,
    /// `placement: consistent`: the group's home, believed to hold the group's head (its
    /// `matched_blocks` count it) and preferred among near-ties ([`group_head`]).
    #[serde(default)]
    pub home: Option<usize>,
}

impl Decision {
    pub fn matched_blocks(&self) -> usize {
        self.scores[self.endpoint].matched_blocks
    }

    /// Where a request goes try after try: the chosen endpoint, then [`Decision::next_best`] in
    /// order (the destination header's failover list, as Envoy's retries walk it).
    pub fn tries(&self) -> impl Iterator<Item = usize> + '_ {
        std::iter::once(self.endpoint).chain(self.next_best.iter().copied())
    }

    pub fn score(&self) -> f64 {
        self.scores[self.endpoint].total
    }

    /// The chosen endpoint's prediction (`latency` only).
    pub fn prediction(&self) -> Option<&Prediction> {
        self.scores.get(self.endpoint)?.prediction.as_ref()
    }

    /// Whether the request continued its group on endpoint `e` (where the group lived).
    pub fn continues_on(&self, e: usize) -> bool {
        self.scores.get(e).is_some_and(|s| s.continues)
    }

    /// Blocks of the request the chosen endpoint was not believed to hold.
    pub fn new_blocks(&self) -> usize {
        let matched = self
            .scores
            .get(self.endpoint)
            .map_or(0, |s| s.matched_blocks);
        self.total_blocks.saturating_sub(matched)
    }

    /// `prefix -> replica-2: match 12/14 blocks, score 6.63, next replica-1 4.50`, or for
    /// `latency`, `latency -> replica-2: match 60/62 blocks, 40 uncached tokens, queue 0 ms,
    /// TTFT 45 ms, next replica-1 1005 ms`.
    pub fn explain(&self, names: &[String]) -> String {
        let name = |i: usize| names.get(i).map_or_else(|| format!("#{i}"), Clone::clone);
        let mut line = format!(
            "{} -> {}: match {}/{} blocks",
            self.policy,
            name(self.endpoint),
            self.matched_blocks(),
            self.total_blocks,
        );
        match self.prediction() {
            Some(p) => {
                line.push_str(&format!(
                    ", {} uncached tokens, queue {:.0} ms, TTFT {:.0} ms",
                    p.uncached_tokens, p.queue_ms, p.ttft_ms
                ));
                if p.cost_ms > p.ttft_ms {
                    line.push_str(&format!(", cost {:.0} ms", p.cost_ms));
                }
            }
            None => line.push_str(&format!(", score {:.2}", self.score())),
        }
        if let Some(next) = self.runner_up {
            match &self.scores[next].prediction {
                Some(p) => line.push_str(&format!(", next {} {:.0} ms", name(next), p.cost_ms)),
                None => line.push_str(&format!(
                    ", next {} {:.2}",
                    name(next),
                    self.scores[next].total
                )),
            }
        }
        if self.tie {
            line.push_str(" (tie)");
        }
        if let Some(home) = self.home {
            line.push_str(&format!(" (home {})", name(home)));
        }
        if self.all_down {
            line.push_str(" (all endpoints down)");
        }
        line
    }
}

impl Decision {
    /// One line per endpoint with what the policy saw there: for `latency` the predicted
    /// queue, uncached tokens, TTFT and evictions; for the others each scorer's output.
    pub fn endpoint_lines(&self, names: &[String]) -> Vec<String> {
        let name = |i: usize| names.get(i).map_or_else(|| format!("#{i}"), Clone::clone);
        self.scores
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let mark = if i == self.endpoint { "*" } else { " " };
                let state = if s.away_from_head {
                    " (set aside: a second request moves only to its shared head)"
                } else if s.over_share {
                    " (set aside: holds a hot prefix and took over its share of requests)"
                } else if s.excluded {
                    " (excluded)"
                } else {
                    ""
                };
                let growing = s
                    .prediction
                    .map_or(0.0, |p| p.growing_blocks)
                    .round();
                let room = if growing > 0.0 {
                    format!(
                        "cache {}/{} blocks + {growing} growing",
                        s.room.believed_blocks, s.room.capacity_blocks
                    )
                } else {
                    format!(
                        "cache {}/{} blocks",
                        s.room.believed_blocks, s.room.capacity_blocks
                    )
                };
                match &s.prediction {
                    Some(p) => format!(
                        "{mark} {}: match {}/{}{}, {} uncached tokens, queue {:.0} ms ({:.1} requests), \
                         TTFT {:.0} ms at {:.3} ms/token and {} lanes, delay to others {:.0} ms, \
                         room {:.1} blocks {:.0} ms, {}{}cost {:.0} ms, {room}{state}",
                        name(i),
                        s.matched_blocks,
                        self.total_blocks,
                        if s.continues { " (continues)" } else { "" },
                        p.uncached_tokens,
                        p.queue_ms,
                        p.queue_requests,
                        p.ttft_ms,
                        p.ms_per_token,
                        p.lanes,
                        p.delay_to_others_ms,
                        p.room_blocks,
                        p.room_ms,
                        if p.copy_credit_ms > 0.0 {
                            format!("copy credit {:.0} ms, ", p.copy_credit_ms)
                        } else {
                            String::new()
                        },
                        if p.caution_ms > 0.0 {
                            format!("caution {:.0} ms, ", p.caution_ms)
                        } else {
                            String::new()
                        },
                        p.cost_ms,
                    ),
                    None => format!(
                        "{mark} {}: match {}/{}, prefix {:.2}, queue {:.2}, kv {:.2}, no-hit-lru {:.2}, \
                         total {:.2}, {room}{state}",
                        name(i),
                        s.matched_blocks,
                        self.total_blocks,
                        s.prefix,
                        s.queue,
                        s.kv_cache,
                        s.no_hit_lru,
                        s.total,
                    ),
                }
            })
            .collect()
    }
}

/// Which endpoints a pick may choose from (the eligibility filter's output).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Eligibility {
    pub eligible: Vec<bool>,
    pub saturated: Vec<bool>,
    /// Every endpoint was down, so every one is eligible again.
    pub all_down: bool,
}

/// The eligibility filter: endpoints that are down are out while another is up; under
/// `prefix`, saturated endpoints (queue or KV usage at a threshold) are out while another is
/// below both, as the Gateway API Inference Extension's default scheduler does. `latency`
/// needs no saturation filter: a long queue is a long predicted wait.
pub fn eligibility(
    policy: Policy,
    loads: &[EndpointLoad],
    limits: SaturationFilter,
) -> Eligibility {
    let n = loads.len();
    let all_down = n > 0 && loads.iter().all(|l| l.down);
    let mut eligible: Vec<bool> = loads.iter().map(|l| all_down || !l.down).collect();
    let mut saturated = vec![false; n];
    if policy == Policy::Prefix {
        for (i, load) in loads.iter().enumerate() {
            saturated[i] = load.queue.is_some_and(|q| q >= limits.queue_threshold)
                || load.kv_usage.is_some_and(|u| u >= limits.kv_threshold);
        }
        if (0..n).any(|i| eligible[i] && !saturated[i]) {
            for i in 0..n {
                eligible[i] &= !saturated[i];
            }
        }
    }
    Eligibility {
        eligible,
        saturated,
        all_down,
    }
}

/// What the index believes of each endpoint for one request (see [`Router::believed_matches`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matches {
    /// The believed-held blocks of each of the request's chains, endpoint after endpoint (see
    /// [`Matches::of`]): one vector per request, not one per endpoint.
    blocks: Vec<usize>,
    chains: usize,
    /// Per endpoint, the turn of the earlier request this one continues there, if any.
    pub continues: Vec<Option<Turn>>,
    /// The group's consistent home when no eligible endpoint was believed to hold the group's
    /// head before the home was (this router has not seen the group): the home takes it
    /// without a room price (see [`Footprint::agreed_home`]).
    pub agreed_home: Option<usize>,
}

impl Matches {
    /// Believes `endpoint` holds at least the first `blocks` blocks of chain `chain`.
    fn believe_at_least(&mut self, endpoint: usize, chain: usize, blocks: usize) {
        if chain < self.chains {
            if let Some(b) = self
                .blocks
                .get_mut(endpoint.saturating_mul(self.chains) + chain)
            {
                *b = (*b).max(blocks);
            }
        }
    }

    /// The believed-held blocks of each of the request's chains on `endpoint` (empty for an
    /// endpoint it does not know).
    pub fn of(&self, endpoint: usize) -> &[usize] {
        let start = endpoint.saturating_mul(self.chains);
        self.blocks
            .get(start..start.saturating_add(self.chains))
            .unwrap_or_default()
    }
}

/// The turn of the earlier request a request continues on some eligible endpoint (a later one
/// where its group lives on several and they differ), or `None` when it starts a group.
pub fn continued_turn(matches: &Matches, eligible: &[bool]) -> Option<Turn> {
    matches
        .continues
        .iter()
        .zip(eligible)
        .filter_map(|(turn, &ok)| turn.filter(|_| ok))
        .max()
}

/// What [`Router::commit`] learned about a request's group, for a proxy to mirror in its
/// pooled account: the chance the request is followed it was counted with, the gap since the
/// request it continued (when measured), and the clock and mean gap its live-group count was
/// decayed with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Committed {
    pub share: f64,
    pub gap_ms: Option<f64>,
    pub live_gap_ms: f64,
    pub now_ms: f64,
}

/// The end blocks of recent requests and when they were committed, to measure a group's gap
/// when its next request continues one: a direct-mapped table (a block hash's low bits pick
/// its slot, a newer end overwrites an older one there), fixed at 256 KiB however long the
/// router runs, and no hash map in the plugin. It spans about the last 16,000 requests of one
/// router (a proxy worker): a gap longer than that is not measured, so on a worker routing more
/// than a few hundred requests a second the mean gap is biased short (measured: sampling a
/// quarter of the ends by hash to span four times as long made the 400-request `mixed` trace's
/// p95 worse, docs/benchmarks.md).
#[derive(Debug)]
struct RecentEnds {
    /// `(hash, ms)`; hash 0 is an empty slot, so the table is zeroed memory. Allocated with
    /// the router (a proxy builds it when configured), not on a request: clearing 256 KiB is
    /// ~260k wasm instructions.
    slots: Vec<(u64, f64)>,
}

impl RecentEnds {
    const SLOTS: usize = 16_384;

    fn new() -> Self {
        RecentEnds {
            slots: vec![(0, 0.0); Self::SLOTS],
        }
    }

    fn get(&self, hash: u64) -> Option<f64> {
        let &(h, t) = self.slots.get(hash as usize % Self::SLOTS)?;
        (h == hash && hash != 0).then_some(t)
    }

    fn insert(&mut self, hash: u64, now_ms: f64) {
        if let Some(slot) = self.slots.get_mut(hash as usize % Self::SLOTS) {
            *slot = (hash, now_ms);
        }
    }
}

/// Why [`Router::pick`] could not choose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum PickError {
    #[error("no endpoints to route to")]
    NoEndpoints,
}

/// Routes requests over a fixed list of endpoints (by index), remembering what it sent where.
#[derive(Debug)]
pub struct Router<S: PrefixStore = PrefixIndex> {
    config: RouterConfig,
    endpoints: usize,
    store: S,
    rng: Pcg64Mcg,
    next_round_robin: usize,
    /// Logical time each endpoint last took a cold request (for no-hit-lru).
    last_cold: Vec<Option<u64>>,
    cold_clock: u64,
    /// How groups grow, learned from every committed request (for `latency`'s room price).
    growth: GroupGrowth,
    /// Groups living on each endpoint (expected counts).
    live: LiveGroups,
    /// The router's clock, ms (set by the caller before each pick: the simulator's arrival time,
    /// the proxy's host clock). Only the live-group counts read it.
    now_ms: f64,
    /// When each recent request's full blocks ended (its last block hash → the clock then),
    /// so a request that continues one measures its group's gap ([`GroupGrowth::observe_gap`]).
    ends: RecentEnds,
    /// How often requests start groups on each shared prefix (for `latency`'s copy credit).
    starts: PrefixRates,
    /// The requests this router sent to each endpoint lately (for `latency`'s bounded share).
    recent: RecentRequests,
    /// The requests every router of a proxy sent each endpoint lately, when its caller pools
    /// them ([`Router::set_fleet_recent`]): what the bounded share weighs a holder's load by.
    fleet_recent: Option<RecentRequests>,
    /// The requests each endpoint finished lately, every gateway's, by its own counter
    /// ([`Router::observe_served`]): what the bounded share weighs a holder's load by when
    /// every eligible endpoint reports it.
    served: ServedRequests,
    /// The request's first block hash while it is picked: exact ties go where it hashes
    /// highest (see [`rendezvous`]).
    tie_key: Option<u64>,
    /// The request's home while it is picked (`placement: consistent`): near-ties go there.
    tie_home: Option<usize>,
}

impl Router<PrefixIndex> {
    pub fn new(config: RouterConfig, endpoints: usize) -> Self {
        let index = PrefixIndex::new(endpoints, config.index_capacity_blocks);
        Router::with_store(config, endpoints, index)
    }
}

impl<S: PrefixStore> Router<S> {
    pub fn with_store(config: RouterConfig, endpoints: usize, store: S) -> Self {
        Router {
            config,
            endpoints,
            store,
            rng: Pcg64Mcg::seed_from_u64(config.seed),
            next_round_robin: 0,
            last_cold: vec![None; endpoints],
            cold_clock: 0,
            growth: GroupGrowth::default(),
            live: LiveGroups::new(endpoints),
            now_ms: 0.0,
            ends: RecentEnds::new(),
            starts: PrefixRates::default(),
            recent: RecentRequests::new(endpoints),
            fleet_recent: None,
            served: ServedRequests::new(endpoints),
            tie_key: None,
            tie_home: None,
        }
    }

    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// Sets the router's clock (ms); a clock that goes back is taken as it is.
    pub fn set_now(&mut self, now_ms: f64) {
        if now_ms.is_finite() {
            self.now_ms = now_ms;
        }
    }

    pub fn endpoints(&self) -> usize {
        self.endpoints
    }

    /// The pool changed to `endpoints` members (the store already describes them). What the
    /// router kept per endpoint (no-hit-lru's memory, the live groups) starts over; callers that share it
    /// (the plugin) set it again before every pick anyway.
    pub fn set_endpoints(&mut self, endpoints: usize) {
        self.endpoints = endpoints;
        self.last_cold = vec![None; endpoints];
        self.live = LiveGroups::new(endpoints);
        self.recent = RecentRequests::new(endpoints);
        self.fleet_recent = None;
        self.served = ServedRequests::new(endpoints);
        self.next_round_robin = self.next_round_robin.min(endpoints.saturating_sub(1));
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    pub fn store_mut(&mut self) -> &mut S {
        &mut self.store
    }

    /// Blocks of each chain of `hashes` `endpoint` is believed to hold.
    pub fn matched_per_chain(&self, endpoint: usize, hashes: &BlockHashes) -> Vec<usize> {
        self.matches_on(endpoint, hashes).collect()
    }

    /// [`Router::matched_per_chain`] as it is looked up, chain by chain.
    fn matches_on<'a>(
        &'a self,
        endpoint: usize,
        hashes: &'a BlockHashes,
    ) -> impl Iterator<Item = usize> + 'a {
        hashes
            .chains
            .iter()
            .map(move |chain| self.store.longest_match(endpoint, chain))
    }

    /// Blocks of `hashes` each endpoint is believed to hold (summed over the request's chains).
    pub fn matched_blocks(&self, hashes: &BlockHashes) -> Vec<usize> {
        (0..self.endpoints)
            .map(|e| self.matched_per_chain(e, hashes).iter().sum())
            .collect()
    }

    /// Chooses an endpoint for a request. `loads` has one entry per endpoint; a missing entry
    /// counts as unmeasured. A router over zero endpoints has nothing to choose from:
    /// [`PickError::NoEndpoints`].
    ///
    /// The steps, each its own function: [`eligibility`] → [`Router::believed_matches`] →
    /// [`Router::score`] (every scorer, or the latency prediction) → [`Router::choose`] (max
    /// score, near-ties by a seeded draw) → [`runner_up`].
    pub fn pick(
        &mut self,
        hashes: &BlockHashes,
        loads: &[EndpointLoad],
    ) -> Result<Decision, PickError> {
        let n = self.endpoints;
        if n == 0 {
            return Err(PickError::NoEndpoints);
        }
        // One load per endpoint: a caller's slice as it is when it has one (a proxy's does, on
        // every request), else padded with idle loads.
        let padded: Vec<EndpointLoad>;
        let loads = if loads.len() == n {
            loads
        } else {
            padded = (0..n)
                .map(|i| loads.get(i).copied().unwrap_or_default())
                .collect();
            &padded
        };
        let policy = self.config.policy;
        let filter = eligibility(policy, loads, self.config.saturation);
        let mut matches = self.believed_matches(hashes);
        let home = self.consistent_home(hashes, &filter.eligible);
        if let Some((home, head)) = home {
            let unseen = (0..n).all(|e| {
                !filter.eligible[e] || matches.of(e).first().is_none_or(|&held| held < head)
            });
            matches.agreed_home = unseen.then_some(home);
            matches.believe_at_least(home, 0, head);
        }
        let cold = !(0..n).any(|e| filter.eligible[e] && matches.of(e).iter().any(|&b| b > 0));
        let continued = continued_turn(&matches, &filter.eligible);
        let scores = self.score(hashes, &matches, loads, &filter, cold, continued);
        // What the policy may choose from: the eligible endpoints, less those the scoring set
        // aside (a second request's moves, see `keep_moves_among_head_holders`; a hot prefix's
        // busy holders, see `bound_busy_holders`).
        let set_aside = scores.iter().any(|s| s.away_from_head || s.over_share);
        let narrowed: Vec<bool>;
        let choosable = if set_aside {
            narrowed = scores.iter().map(|s| !s.excluded).collect();
            &narrowed
        } else {
            &filter.eligible
        };
        self.tie_key = hashes.chains.iter().find_map(|c| c.first().copied());
        self.tie_home = home.map(|(e, _)| e);
        let (endpoint, tie) = self.choose(&scores, choosable);
        self.tie_key = None;
        self.tie_home = None;
        let (runner_up, next_best) = match policy {
            Policy::RoundRobin | Policy::Random => {
                let rotation = (1..n)
                    .map(|k| (endpoint + k) % n)
                    .filter(|&i| filter.eligible[i])
                    .collect();
                (None, rotation)
            }
            _ => {
                let mut ranked = ranked_after(&scores, choosable, endpoint);
                let runner_up = ranked.first().copied();
                if set_aside {
                    // A failover may still go anywhere eligible, the set-aside ones last.
                    let rest = ranked_after(&scores, &filter.eligible, endpoint);
                    ranked.extend(
                        rest.into_iter()
                            .filter(|&i| scores[i].away_from_head || scores[i].over_share),
                    );
                }
                (runner_up, ranked)
            }
        };
        Ok(Decision {
            endpoint,
            policy,
            total_blocks: hashes.total_blocks(),
            total_tokens: hashes.total_tokens(),
            scores,
            runner_up,
            next_best,
            cold,
            tie,
            all_down: filter.all_down,
            continued,
            home: home.map(|(e, _)| e),
        })
    }

    /// `placement: consistent` under `latency`: the eligible endpoint every router sends the
    /// request's group to (rendezvous hashing of its head's last block, see [`group_head`]),
    /// and the head's length in blocks.
    fn consistent_home(&self, hashes: &BlockHashes, eligible: &[bool]) -> Option<(usize, usize)> {
        if self.config.placement != Placement::Consistent || self.config.policy != Policy::Latency {
            return None;
        }
        let (head, key) = group_head(hashes)?;
        let candidates: Vec<usize> = (0..self.endpoints).filter(|&e| eligible[e]).collect();
        if candidates.is_empty() {
            return None;
        }
        Some((rendezvous(&candidates, key), head))
    }

    /// What the index believes of each endpoint for this request: the blocks of each chain it
    /// holds, and whether the request continues an earlier one there (see
    /// [`PrefixStore::continues`]).
    pub fn believed_matches(&self, hashes: &BlockHashes) -> Matches {
        let chains = hashes.chains.len();
        let mut blocks = Vec::with_capacity(self.endpoints * chains);
        for e in 0..self.endpoints {
            blocks.extend(self.matches_on(e, hashes));
        }
        let continues = (0..self.endpoints)
            .map(|e| {
                hashes
                    .chains
                    .iter()
                    .zip(&blocks[e * chains..])
                    .filter_map(|(chain, &m)| self.store.continues(e, chain, m))
                    .max()
            })
            .collect();
        Matches {
            blocks,
            chains,
            continues,
            agreed_home: None,
        }
    }

    /// The picker: the next endpoint in rotation, a random one, or the best score (see
    /// `max_score`), among the eligible ones. Returns the endpoint and whether it was
    /// drawn among ties.
    pub fn choose(&mut self, scores: &[EndpointScores], eligible: &[bool]) -> (usize, bool) {
        match self.config.policy {
            Policy::RoundRobin => (self.next_in_rotation(eligible), false),
            Policy::Random => (self.random_eligible(eligible), false),
            _ => self.max_score(scores, eligible),
        }
    }

    /// Every scorer's output per endpoint and the policy's total.
    pub fn score(
        &self,
        hashes: &BlockHashes,
        matches: &Matches,
        loads: &[EndpointLoad],
        filter: &Eligibility,
        cold: bool,
        continued: Option<Turn>,
    ) -> Vec<EndpointScores> {
        let total_blocks = hashes.total_blocks();
        let total_tokens = hashes.total_tokens();
        let queue = queue_scores(loads);
        let kv = kv_cache_scores(loads);
        let lru = no_hit_lru_scores(!cold, &self.last_cold);
        let block_size = hashes.block_size.max(1);
        let w = self.config.weights;
        let future_blocks = self.growth.future_blocks(continued);
        // A group's second request is placed again only where another endpoint holds its
        // shared head (see `keep_moves_among_head_holders`); otherwise it is a continuation
        // like any other.
        let head = if self.config.policy == Policy::Latency && continued == Some(Turn::First) {
            shared_head(matches, &filter.eligible)
        } else {
            0
        };
        let second_request = head > 0;
        let live_group_blocks = self.growth.live_group_blocks();
        let live = self.live.at(self.now_ms, self.growth.mean_gap_ms());
        let mut scores: Vec<EndpointScores> = (0..loads.len())
            .map(|i| {
                let matched_blocks: usize = matches.of(i).iter().sum();
                let matched_tokens = (matched_blocks * block_size).min(total_tokens);
                let prefix = prefix_score(
                    matched_blocks,
                    total_blocks,
                    matched_tokens,
                    self.config.match_length,
                );
                let room = self.store.room(i);
                let prediction = (self.config.policy == Policy::Latency).then(|| {
                    predict(
                        hashes,
                        matches.of(i),
                        room,
                        Footprint {
                            continues: matches.continues[i].is_some(),
                            second_request,
                            future_blocks,
                            growing_blocks: live.on(i) * live_group_blocks,
                            agreed_home: matches.agreed_home == Some(i),
                        },
                        &loads[i].latency,
                        &self.config.latency,
                    )
                });
                // Nothing to lose by spreading a request no endpoint holds any of.
                let prediction = match (prediction, loads[i].latency.fewest_lanes) {
                    (Some(p), Some(fewest)) if cold => Some(p.with_caution(fewest)),
                    (p, _) => p,
                };
                let total = match self.config.policy {
                    Policy::Latency => prediction.map_or(0.0, |p| -p.cost_ms),
                    Policy::Prefix => {
                        w.prefix * prefix
                            + w.queue * queue[i]
                            + w.kv_cache * kv[i]
                            + w.no_hit_lru * lru[i]
                    }
                    Policy::PrefixOnly => prefix,
                    Policy::LeastQueue => queue[i],
                    Policy::RoundRobin | Policy::Random => 0.0,
                };
                EndpointScores {
                    matched_blocks,
                    prefix,
                    queue: queue[i],
                    kv_cache: kv[i],
                    no_hit_lru: lru[i],
                    total,
                    excluded: !filter.eligible[i],
                    away_from_head: false,
                    over_share: false,
                    saturated: filter.saturated[i],
                    prediction,
                    room,
                    continues: matches.continues[i].is_some(),
                }
            })
            .collect();
        if let (None, [chain]) = (continued, hashes.chains.as_slice()) {
            // The longest believed match, and how many eligible endpoints hold it as far: the
            // prefix's requests spread over them.
            let held = scores
                .iter()
                .filter(|s| !s.excluded)
                .map(|s| s.matched_blocks)
                .max();
            let held = held.unwrap_or(0);
            let holders = scores
                .iter()
                .filter(|s| !s.excluded && s.matched_blocks == held)
                .count() as f64;
            if let Some(end) = prefix_end(chain, held) {
                let starts = self.starts.of(end, self.now_ms);
                credit_copies(&mut scores, held, starts.per_second / holders);
                if self.config.policy == Policy::Latency {
                    let factor = self.config.latency.balance_factor;
                    let per_holder = starts.count / holders;
                    bound_busy_holders(
                        &mut scores,
                        held,
                        per_holder,
                        [&self.recent, {
                            let own = self.pooled_recent();
                            self.served
                                .beyond(own, &filter.eligible, self.now_ms)
                                .unwrap_or(own)
                        }],
                        factor,
                        self.now_ms,
                    );
                }
            }
        }
        if second_request {
            keep_moves_among_head_holders(&mut scores, head);
        }
        scores
    }

    /// Records a decision: the chosen endpoint now (believably) holds the request's full
    /// blocks, which end where the next request of its group will continue. Returns what it
    /// learned about the request's group, so a proxy that pools every worker's account can
    /// mirror it (`None` for an endpoint the router does not have).
    pub fn commit(&mut self, decision: &Decision, hashes: &BlockHashes) -> Option<Committed> {
        if decision.endpoint >= self.endpoints {
            return None;
        }
        let endpoint = decision.endpoint;
        let block_size = hashes.block_size.max(1);
        // The gap since the request this one continues (looked up before recording moves it).
        let gap_ms = self.continued_gap_ms(decision, hashes);
        if let Some(gap) = gap_ms {
            // A refused gap (a clock that went back, or over an hour) teaches nothing; the
            // plugin's ledger, which mirrors this, counts it in a metric.
            let _ = self.growth.observe_gap(gap);
        }
        for (i, (chain, &tokens)) in hashes.chains.iter().zip(&hashes.tokens).enumerate() {
            // Full blocks only: a server never caches the partial last block, and believing it
            // would take room in the belief that the server's cache does not spend.
            let full = (tokens / block_size).min(chain.len());
            if full == 0 {
                continue;
            }
            let marks = hashes.marks.get(i).map_or(&[][..], Vec::as_slice);
            self.store.record_marked(endpoint, &chain[..full], marks);
            self.store
                .mark_end(endpoint, &chain[..full], Turn::of(decision.continued));
            self.ends.insert(chain[full - 1], self.now_ms);
        }
        // A group started on a shared prefix: counted for the copy credit under the prefix's
        // longest believed holding (the block a later request's holder lookup keys by).
        if let (None, [chain]) = (decision.continued, hashes.chains.as_slice()) {
            let held = decision.scores.iter().map(|s| s.matched_blocks).max();
            if let Some(h) = held.and_then(|m| prefix_end(chain, m)) {
                self.starts.record(h, self.now_ms);
            }
        }
        self.recent.record(endpoint, self.now_ms);
        let new_blocks = decision.total_blocks.saturating_sub(
            decision
                .scores
                .get(endpoint)
                .map_or(0, |s| s.matched_blocks),
        );
        let committed = Committed {
            share: self.growth.follow_share(decision.continued),
            gap_ms,
            live_gap_ms: self.growth.mean_gap_ms(),
            now_ms: self.now_ms,
        };
        self.live.observe(
            endpoint,
            committed.share,
            committed.now_ms,
            committed.live_gap_ms,
        );
        self.growth
            .observe(decision.continued, new_blocks, committed.now_ms);
        if decision.cold {
            self.cold_clock = self.next_cold_stamp();
            self.last_cold[decision.endpoint] = Some(self.cold_clock);
        }
        Some(committed)
    }

    /// Marks where a request ended on `endpoint`, from the server's own report of the blocks
    /// it stored for it ([`StoredRun`]: its new full blocks, after `parent`). With
    /// `index: precise` every gateway reads every server's events, so it sees where the
    /// requests the other gateways routed ended. Call after the store believes the blocks.
    /// The run's last block gets an end mark, `Turn::Later` if the run's parent carries one
    /// (the request continued an earlier one) and `Turn::First` if not; a block this router
    /// marked itself (its own request) keeps its mark. So a conversation's next turn continues
    /// the turn another gateway routed, as [`PrefixStore::continues`] sees it, and its gap is
    /// measured from when the run was read. Without this, two gateways taking turns each see
    /// every other turn of a conversation and price growth two turns long
    /// (docs/benchmarks.md, "Precise gateways mark where the other gateways' requests ended").
    ///
    /// Only the marks: how often groups continue and how much they grow is still learned from
    /// this router's own requests, because a run is not always a request (vLLM reports a
    /// prompt prefilled in chunks, and every block its decoding fills, as runs of their own;
    /// each would count as a request that continued the one before). Returns whether the run
    /// ended a request this router did not know.
    pub fn mark_stored(&mut self, endpoint: usize, run: &StoredRun) -> bool {
        if endpoint >= self.endpoints
            || run.blocks == 0
            || self.store.continues(endpoint, &[run.end], 1).is_some()
        {
            return false;
        }
        let continued = run
            .parent
            .and_then(|p| self.store.continues(endpoint, &[p], 1));
        self.store
            .mark_end(endpoint, &[run.end], Turn::of(continued));
        self.ends.insert(run.end, self.now_ms);
        true
    }

    /// How long ago the request this one continues was committed, ms, if the router still
    /// remembers it (`RecentEnds`): its believed match on the endpoint it continues ends at
    /// that request's last full block. Measured for one-chain requests (every chat request;
    /// a batch of prompts is skipped, so the mean gap is a sample), from the decision's own
    /// matches, so that it costs no second lookup.
    pub fn continued_gap_ms(&self, decision: &Decision, hashes: &BlockHashes) -> Option<f64> {
        let [chain] = hashes.chains.as_slice() else {
            return None;
        };
        let e = std::iter::once(decision.endpoint)
            .chain(0..self.endpoints)
            .find(|&e| decision.continues_on(e))?;
        let matched = decision.scores.get(e)?.matched_blocks;
        let then = self.ends.get(*chain.get(matched.checked_sub(1)?)?)?;
        Some(self.now_ms - then)
    }

    /// The chosen endpoint's prediction, also under policies that do not predict (a proxy
    /// accounts every request's prefill work the same way). Call before `commit`.
    ///
    /// What the router believes, not what it chose by: at a consistent home
    /// (`Decision::home`) the choice believed the group's head held there, which a group's
    /// first request there does not find; its pending work and the rate its first byte
    /// teaches count the tokens the router's own belief leaves uncached.
    pub fn prediction_for(
        &self,
        decision: &Decision,
        hashes: &BlockHashes,
        load: &EndpointLoad,
    ) -> Prediction {
        if let Some(p) = decision.prediction() {
            if decision.home != Some(decision.endpoint) {
                return *p;
            }
        }
        let e = decision.endpoint;
        predict(
            hashes,
            &self.matched_per_chain(e, hashes),
            self.store.room(e),
            Footprint::default(),
            &load.latency,
            &self.config.latency,
        )
    }

    /// Forgets an endpoint's blocks (e.g. after it restarted with an empty cache).
    pub fn forget_endpoint(&mut self, endpoint: usize) {
        self.store.forget_endpoint(endpoint);
        // Its groups are gone with its cache: their later requests start over elsewhere.
        if let Some(v) = self.live.count.get_mut(endpoint) {
            *v = 0.0;
        }
    }

    /// Bounds an endpoint's believed cache by its real capacity (see
    /// [`PrefixStore::set_capacity`]).
    pub fn set_capacity(&mut self, endpoint: usize, blocks: usize) {
        self.store.set_capacity(endpoint, blocks);
    }

    /// How groups grow, as learned so far.
    pub fn growth(&self) -> GroupGrowth {
        self.growth
    }

    /// Replaces the learned growth, e.g. with the view a proxy shares between its workers.
    pub fn set_growth(&mut self, growth: GroupGrowth) {
        self.growth = growth;
    }

    /// The groups living on each endpoint, as counted so far.
    pub fn live_groups(&self) -> &LiveGroups {
        &self.live
    }

    /// `endpoint`'s scrape taken at `at_ms` counted `total` finished requests
    /// (`vllm:request_success_total`); call once per scrape. `false` when the reading was
    /// refused (negative or not a number), for the caller to count.
    pub fn observe_served(&mut self, endpoint: usize, total: f64, at_ms: f64) -> bool {
        self.served.observe(endpoint, total, at_ms)
    }

    /// The requests every router of this proxy sent each endpoint lately (a proxy's workers
    /// pool their counts in shared data), for the bounded share's holder test; this router's
    /// own counts still say whether a prefix is hot, since its prefix starts are its own
    /// sample. Why: a worker's own counts are a small sample in a trace's first seconds, and
    /// one that saw five of a document's six requests found its holder over twice the mean
    /// and copied a document the fleet's counts put well under it (docs/benchmarks.md).
    pub fn set_fleet_recent(&mut self, fleet: &RecentRequests) {
        match &mut self.fleet_recent {
            Some(mine) => mine.clone_from(fleet),
            None => self.fleet_recent = Some(fleet.clone()),
        }
    }

    /// The requests sent to each endpoint lately: every router's of the proxy when its caller
    /// pools them ([`Router::set_fleet_recent`]), else this router's own.
    fn pooled_recent(&self) -> &RecentRequests {
        self.fleet_recent.as_ref().unwrap_or(&self.recent)
    }

    /// Replaces the live-group counts, e.g. with the sum a proxy's workers share (copied into
    /// the router's own, which keeps its room: a proxy does this on every route).
    pub fn set_live_groups(&mut self, live: &LiveGroups) {
        let LiveGroups { count, at_ms } = live;
        self.live.count.clone_from(count);
        self.live.at_ms = *at_ms;
    }

    /// no-hit-lru's memory: the logical time each endpoint last took a cold request (larger =
    /// more recent, `None` = never).
    pub fn last_cold(&self) -> &[Option<u64>] {
        &self.last_cold
    }

    /// The logical time the next cold commit stamps its endpoint with (one past the largest
    /// so far): a proxy that shares [`Self::last_cold`] can write it with the other things the
    /// commit writes, before the commit.
    pub fn next_cold_stamp(&self) -> u64 {
        self.cold_clock + 1
    }

    /// Replaces no-hit-lru's memory, e.g. with the view a proxy shares between its workers so
    /// that they spread cold prefixes as one router. Entries beyond `last_cold` count as never;
    /// the next cold request is stamped one past the largest time given.
    pub fn set_last_cold(&mut self, last_cold: &[Option<u64>]) {
        for (i, slot) in self.last_cold.iter_mut().enumerate() {
            *slot = last_cold.get(i).copied().flatten();
        }
        self.cold_clock = self.last_cold.iter().flatten().copied().max().unwrap_or(0);
    }

    fn next_in_rotation(&mut self, eligible: &[bool]) -> usize {
        let n = eligible.len();
        for step in 0..n {
            let candidate = (self.next_round_robin + step) % n;
            if eligible[candidate] {
                self.next_round_robin = candidate + 1;
                return candidate;
            }
        }
        0
    }

    fn random_eligible(&mut self, eligible: &[bool]) -> usize {
        let candidates: Vec<usize> = (0..eligible.len()).filter(|&i| eligible[i]).collect();
        if candidates.is_empty() {
            return 0;
        }
        candidates[draw_index(&mut self.rng, candidates.len())]
    }

    /// Max-score picker; exact ties are broken by a seeded random draw so that equal endpoints
    /// share load instead of the first one taking everything. Under `latency`, see
    /// [`latency_tied`].
    fn max_score(&mut self, scores: &[EndpointScores], eligible: &[bool]) -> (usize, bool) {
        let best = scores
            .iter()
            .zip(eligible)
            .filter(|(_, &ok)| ok)
            .map(|(s, _)| s.total)
            .fold(f64::NEG_INFINITY, f64::max);
        let tied: Vec<usize> = if self.config.policy == Policy::Latency {
            let recent = self.pooled_recent().counts_at(self.now_ms);
            latency_tied(scores, eligible, -best, self.tie_home, |e| recent.on(e))
        } else {
            (0..scores.len())
                .filter(|&i| eligible[i] && scores[i].total == best)
                .collect()
        };
        match tied.len() {
            0 => (0, false),
            1 => (tied[0], false),
            // `latency` agrees with every other router on the same view (rendezvous on the
            // request's first block); the baselines keep their seeded draw.
            k => match self
                .tie_key
                .filter(|_| self.config.policy == Policy::Latency)
            {
                Some(key) => (rendezvous(&tied, key), true),
                None => (tied[draw_index(&mut self.rng, k)], true),
            },
        }
    }
}

/// Predicted costs closer than this share of the best one (or than [`TIE_MS`]) are equal:
/// the prediction is not more precise than that (learned rates of identical replicas differ
/// by a few percent of noise).
pub const TIE_SHARE: f64 = 0.02;
pub const TIE_MS: f64 = 1.0;
/// Endpoints whose recent request counts are within this many requests of the fewest are
/// equally loaded when `latency` breaks a tie: one request, the counts' own step.
pub const TIE_REQUESTS: f64 = 1.0;

/// The `latency` policy's ties: eligible endpoints within [`TIE_SHARE`] of the best cost,
/// narrowed to where the request's group lives if it lives on one of them, else to its `home`
/// if that is among them (`placement: consistent`), then to those with
/// the fewest requests holding their lanes, then to those with the most free believed cache
/// once the groups living there grow (a new prefix goes where it fits, as sglang-router's
/// "smallest tree"; the growth counted as taken, as the room price counts it), then to those
/// sent the fewest requests lately (`recent`, within [`TIE_REQUESTS`]).
///
/// Why holders before room: a prediction sees a queue only where every believed lane is
/// taken, and the lane count is learned from queues the router has seen; until it has seen
/// some, it believes many lanes, every endpoint predicts no wait, and the most free cache
/// alone would send request after request to one endpoint until its real lanes run out. The
/// fewest holders is where a request surely finds a lane, whatever the lane count
/// (measured in docs/benchmarks.md: nothing-shared traffic at 1 ms/token, TTFT p95 1.12x the
/// bound's over 16 seeds, worst 1.73x, then 1.00x on every seed).
///
/// Why the recent requests last: once every cache is full (believed so) and no group living
/// anywhere grows, the room ties too, and the rendezvous after it spreads requests as a
/// random draw does: on the nothing-shared trace the busiest replica took 1.26x the mean
/// request count at 0.1 ms/token (12 seeds), 1.10x with the counts, and a hot tenant's
/// holders their copies' share unevenly (2.07x to 1.62x). Before the room, they overruled it
/// where caches overflow and placement is what keeps histories: conversations that outgrow
/// every cache fell from 87.9% to 84.9% of the bound's hit rate (docs/benchmarks.md).
fn latency_tied(
    scores: &[EndpointScores],
    eligible: &[bool],
    best_cost: f64,
    home: Option<usize>,
    recent: impl Fn(usize) -> f64,
) -> Vec<usize> {
    let tolerance = (best_cost.abs() * TIE_SHARE).max(TIE_MS);
    let mut tied: Vec<usize> = (0..scores.len())
        .filter(|&i| eligible[i] && -scores[i].total <= best_cost + tolerance)
        .collect();
    // A move within the prediction's precision buys nothing and costs the group's history
    // later: among ties, a request stays where its group lives, else goes to its home
    // (`placement: consistent`), where every other gateway sends it too.
    if tied.iter().any(|&i| scores[i].continues) {
        tied.retain(|&i| scores[i].continues);
    } else if let Some(home) = home.filter(|h| tied.contains(h)) {
        return vec![home];
    }
    keep_least(&mut tied, |i| {
        scores[i].prediction.map_or(0.0, |p| p.backlog.holders)
    });
    keep_least(&mut tied, |i| {
        let growing = scores[i].prediction.map_or(0.0, |p| p.growing_blocks);
        -scores[i].room.free_after(growing)
    });
    keep_within(&mut tied, &recent, TIE_REQUESTS);
    tied
}

/// Narrows `tied` to those with the least `key`. A key that is not a number reads as zero: a
/// comparison with NaN would empty the ties.
fn keep_least(tied: &mut Vec<usize>, key: impl Fn(usize) -> f64) {
    keep_within(tied, key, 0.0);
}

/// Narrows `tied` to those whose `key` is at most `slack` above the least (read as
/// [`keep_least`] reads it).
fn keep_within(tied: &mut Vec<usize>, key: impl Fn(usize) -> f64, slack: f64) {
    let key = |i: usize| Some(key(i)).filter(|k| k.is_finite()).unwrap_or(0.0);
    let least = tied.iter().map(|&i| key(i)).fold(f64::INFINITY, f64::min);
    tied.retain(|&i| key(i) <= least + slack);
}

/// Among tied endpoints, the one where `key` (a request's first block hash) hashes highest:
/// rendezvous hashing. Every router with the same view of the fleet (Envoy's workers, several
/// gateways) sends the same new prefix to the same endpoint without talking, and one prefix's
/// ties always fall the same way while different prefixes spread evenly.
pub fn rendezvous(tied: &[usize], key: u64) -> usize {
    let weight = |e: usize| {
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&key.to_le_bytes());
        bytes[8..].copy_from_slice(&(e as u64).to_le_bytes());
        xxhash_rust::xxh64::xxh64(&bytes, 0x7469_6573)
    };
    tied.iter()
        .copied()
        .max_by_key(|&e| (weight(e), std::cmp::Reverse(e)))
        .unwrap_or(0)
}

/// A request's group head, for `placement: consistent`: how many leading blocks of its
/// (first) chain its home is believed to hold, and the hash its home is found by (see
/// [`rendezvous`]): the last block of the part every request of its group shares. From the
/// message boundaries the chain records ([`BlockHashes::marks`]):
///
/// * three or more: a conversation's later turn. Its home is keyed by its first exchange
///   (through the second boundary: the system prompt and the first user message), which
///   every turn repeats, so each conversation has its own home; and believed to hold the
///   conversation up to this turn's last exchange (through the second-to-last boundary: the
///   previous turn's prompt), which every gateway sent there. Believing only the first
///   exchange left a gateway that did not route the last turn predicting the history cold at
///   the home (three gateways on conversations: 86.1% of the bound's hit rate, 96.5% with the
///   previous prompt; docs/benchmarks.md);
/// * one or two: through the second boundary if there is one (a few-shot prompt), else the
///   first (a tenant's system prompt, a document in its own message), which the group's
///   questions share;
/// * none: the first block (a single-message prompt; its head is not known from one request).
///
/// With one boundary or none, a last message longer than what comes before it and at least
/// [`HEAD_PROBE_TOKENS`] long moves the key on to the block that ends that message's first
/// `HEAD_PROBE_TOKENS` tokens: such a request is mostly its last message (a document and the
/// question after it), so its group is more likely that message's opening than the short head
/// before it, which every document shares. Keyed by that head, every document of a RAG fleet
/// had one home, which near-ties all went to, and gateways that had not seen a document yet
/// placed it apart: three approximate gateways on the sweep's RAG trace had 93.0% hits and a
/// TTFT p95 of 900 ms at 0.5 ms/token, against 93.7% and 25.5 ms keyed by the document
/// (docs/benchmarks.md). The opening is read that far in, not at the message's first block,
/// because a RAG template often starts its user message with words every document shares
/// ("Context information is below." and a rule, as LlamaIndex's default does), and a first
/// block of those keys every document alike again. A tenant's question after its system
/// prompt is shorter than the prompt and keeps its key.
///
/// `None` for a request without a full block.
pub fn group_head(hashes: &BlockHashes) -> Option<(usize, u64)> {
    let chain = hashes.chains.first()?;
    let marks = hashes.marks.first().map_or(&[][..], Vec::as_slice);
    // One boundary or none: the head, or the last message's opening after it (see above).
    let opening = |head: usize| {
        let last_message = chain.len().saturating_sub(head);
        let probe_blocks = HEAD_PROBE_TOKENS.div_ceil(hashes.block_size.max(1));
        let key = if last_message > head && last_message >= probe_blocks {
            head + probe_blocks
        } else {
            head
        };
        (key, key)
    };
    let (keyed, held) = match marks {
        [_, second, .., before_last, _] => (*second, (*second).max(*before_last)),
        [_, second, ..] => (*second, *second),
        [first] => opening(*first),
        [] => opening(1),
    };
    let key = *chain.get(keyed.min(chain.len()).checked_sub(1)?)?;
    Some((held.min(chain.len()), key))
}

/// How long (in tokens) a request's last message must be, besides longer than what comes
/// before it, for [`group_head`] to key its home by that message rather than by the head
/// before it: a document, not a question (the sweep's questions are 20–40 words; a tenant's
/// question is rarely past a hundred tokens).
pub const HEAD_PROBE_TOKENS: usize = 128;

/// A uniform index below `n`, drawn through u64 so that 32-bit targets (the browser, the
/// proxy-wasm plugin) make exactly the same draws as native builds.
pub fn draw_index(rng: &mut impl Rng, n: usize) -> usize {
    rng.gen_range(0..n as u64) as usize
}

/// The eligible endpoints other than `chosen`, best score first (ties: lower index first).
pub fn ranked_after(scores: &[EndpointScores], eligible: &[bool], chosen: usize) -> Vec<usize> {
    // (key, index) pairs: the index breaks ties (equal totals keep index order), and the
    // sort is the one `crate::order` shares.
    let mut ranked: Vec<(u64, usize)> = (0..scores.len())
        .filter(|&i| i != chosen && eligible.get(i).copied().unwrap_or(false))
        .map(|i| (crate::order::f64_key_descending(scores[i].total), i))
        .collect();
    ranked.sort_unstable();
    ranked.into_iter().map(|(_, i)| i).collect()
}

pub fn runner_up(scores: &[EndpointScores], eligible: &[bool], chosen: usize) -> Option<usize> {
    ranked_after(scores, eligible, chosen).first().copied()
}

/// The longest prefix of a request believed held on an eligible endpoint its group does not
/// live on, in blocks: its shared head (0 if none).
fn shared_head(matches: &Matches, eligible: &[bool]) -> usize {
    (0..eligible.len())
        .filter(|&e| eligible[e] && matches.continues.get(e).is_some_and(Option::is_none))
        .map(|e| matches.of(e).iter().sum())
        .max()
        .unwrap_or(0)
}

/// A group's second request places its group again (its growth is now priced where it lives
/// too, see [`crate::latency::Footprint::second_request`]) when another endpoint holds its
/// shared `head` ([`shared_head`]), and then only among the endpoints that hold it: moving
/// there prefills again only the group's own short history; moving anywhere else would also
/// copy the head, and a copy is a first request's decision (priced by the copy credit and the
/// room price), not a side effect of a move. The others are set aside (`away_from_head`).
/// With no eligible endpoint where the group lives (it went down), nothing is.
fn keep_moves_among_head_holders(scores: &mut [EndpointScores], head: usize) {
    if !scores.iter().any(|s| !s.excluded && s.continues) {
        return;
    }
    for s in scores.iter_mut() {
        if !s.excluded && !s.continues && s.matched_blocks < head {
            s.excluded = true;
            s.away_from_head = true;
        }
    }
}

/// Sets aside, for a group's first request, each eligible endpoint that holds the request's
/// prefix (the `held` blocks of the longest believed match) and has taken more than `factor`
/// times the mean eligible endpoint's recent requests ([`RecentRequests`]: `[own, fleet]`; the
/// fleet's are what the servers report finishing where other gateways send a quarter or more
/// of them ([`ServedRequests::beyond`]), else what a proxy's workers pooled, else the router's
/// own) by more than [`RecentRequests::SLACK`], when the prefix is hot: it started
/// [`RecentRequests::HOT_SHARE`] times more groups per endpoint holding it
/// (`starts_per_holder`, from its decayed count, [`crate::latency::PrefixRates::of`], with
/// the same time constant) than the mean endpoint took requests from this router (its own
/// sample of both), so it cannot fit on one endpoint's fair share. The request then goes
/// where the prediction puts it among the others: to a copy of the prefix if one is believed
/// anywhere, else it makes one. Some
/// eligible endpoint is always left: the least busy one is at most the mean, and the factor is
/// at least 1. Until the endpoints have taken a request each on average, shares say nothing (a
/// start's first requests all go where its first prompt went) and nothing is set aside.
///
/// Why a bound on requests and not only the prediction: the prediction is a mean. At a holder
/// that a hot prefix keeps busy half the time the mean wait is a few ms (3.5 measured against
/// 2.7 predicted, on a tenant that turns hot after 5 s) while the tail is tens (its 95th
/// percentile 22 ms), and a copy that evicts another tenant's prompt pays back in mean time
/// only after ten seconds or more, so the prediction rightly never makes it, and the tail
/// stays (TTFT p95 50.2 ms against the bound's 37.0). Capping a hot prefix's holders at a
/// multiple of the mean share is consistent hashing with bounded loads (Mirrokni, Thorup and
/// Zadimoghaddam; Envoy's `hash_balance_factor`), applied only to a prefix no single endpoint
/// can serve at its fair share, so a prefix that fits on one (a RAG document among eight, a
/// tenant among 24) is never copied for balance (docs/benchmarks.md).
fn bound_busy_holders(
    scores: &mut [EndpointScores],
    held: usize,
    starts_per_holder: f64,
    [own, fleet]: [&RecentRequests; 2],
    factor: f64,
    now_ms: f64,
) {
    let mean = |recent: &RecentRequests| {
        let counts = recent.counts_at(now_ms);
        let (mut n, mut total) = (0usize, 0.0);
        for (e, _) in scores.iter().enumerate().filter(|(_, s)| !s.excluded) {
            n += 1;
            total += counts.on(e);
        }
        total / n.max(1) as f64
    };
    let own_mean = mean(own);
    if factor <= 0.0 || own_mean < 1.0 || starts_per_holder <= RecentRequests::HOT_SHARE * own_mean
    {
        return;
    }
    let bound = factor * mean(fleet) + RecentRequests::SLACK;
    let fleet = fleet.counts_at(now_ms);
    for (e, s) in scores.iter_mut().enumerate() {
        if !s.excluded && s.matched_blocks == held && fleet.on(e) > bound {
            s.excluded = true;
            s.over_share = true;
        }
    }
}

/// The block a believed match of `held` blocks of `chain` ends with: the key the copy credit
/// counts a shared prefix by ([`PrefixRates`]).
fn prefix_end(chain: &[u64], held: usize) -> Option<u64> {
    chain.get(held.checked_sub(1)?).copied()
}

/// Credits each eligible endpoint that holds less of the request's prefix than the best
/// holder with what a copy there saves the requests queueing for the prefix at that holder
/// ([`crate::latency::copy_credit_ms`]; `rate`: how often requests start a group on the
/// `held` blocks the longest believed match holds, per endpoint holding them as far). The
/// holder: among those, the shortest queue. Called for a group's first request only.
fn credit_copies(scores: &mut [EndpointScores], held: usize, rate: f64) {
    let holder = scores
        .iter()
        .enumerate()
        .filter(|(_, s)| !s.excluded && s.matched_blocks == held)
        .filter_map(|(i, s)| s.prediction.map(|p| (i, p)))
        .min_by(|a, b| a.1.queue_ms.total_cmp(&b.1.queue_ms));
    let Some((h, at_holder)) = holder else {
        return;
    };
    if at_holder.queue_ms <= 0.0 {
        return;
    }
    for (i, s) in scores.iter_mut().enumerate() {
        if i == h || s.excluded || s.matched_blocks >= held {
            continue;
        }
        if let Some(p) = s.prediction {
            let credit = copy_credit_ms(&at_holder, &p, rate);
            if credit > 0.0 {
                let credited = p.with_copy_credit(credit);
                s.total = -credited.cost_ms;
                s.prediction = Some(credited);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::BlockIdentity;
    use crate::hashing::{hash_request, HashConfig};
    use crate::request::parse_request;
    use crate::tokenizer::NonAscii;

    fn hashes(text: &str) -> BlockHashes {
        let body = serde_json::json!({"model": "m", "prompt": text}).to_string();
        hash_request(
            &parse_request(body.as_bytes()).unwrap(),
            HashConfig {
                block_size: 2,
                include_partial: true,
                ..HashConfig::default()
            },
        )
    }

    fn router(policy: Policy, endpoints: usize) -> Router {
        Router::new(
            RouterConfig {
                policy,
                ..RouterConfig::default()
            },
            endpoints,
        )
    }

    fn idle(n: usize) -> Vec<EndpointLoad> {
        vec![EndpointLoad::measured(0.0, 0.0); n]
    }

    /// A chat of `messages`: the system prompt, then user and assistant in turn.
    fn chat_hashes(messages: &[&str]) -> BlockHashes {
        let messages: Vec<serde_json::Value> = messages
            .iter()
            .enumerate()
            .map(|(i, content)| {
                let role = match i {
                    0 => "system",
                    i if i % 2 == 1 => "user",
                    _ => "assistant",
                };
                serde_json::json!({"role": role, "content": content})
            })
            .collect();
        let body = serde_json::json!({"model": "m", "messages": messages}).to_string();
        hash_request(
            &parse_request(body.as_bytes()).unwrap(),
            HashConfig {
                block_size: 4,
                include_partial: true,
                ..HashConfig::default()
            },
        )
    }

    #[test]
    fn a_group_home_is_keyed_by_its_first_message_or_its_first_exchange() {
        let system = "you are the assistant of tenant seven";
        let question = chat_hashes(&[system, "what changed in my invoice"]);
        let (head, key) = group_head(&question).unwrap();
        assert_eq!(head, question.marks[0][0]);
        assert_eq!(key, question.chains[0][head - 1]);
        // Every question of the tenant has the same head.
        let other = chat_hashes(&[system, "how do I export my data"]);
        assert_eq!(group_head(&other), Some((head, key)));
        // A conversation's later turns share their home's key (through the first user
        // message), and conversations behind one system prompt do not.
        let turn = |first: &str, later: &[&str]| {
            let mut m = vec![system, first];
            m.extend_from_slice(later);
            group_head(&chat_hashes(&m)).unwrap()
        };
        let second = turn("plan my trip to lisbon", &["sure, when", "in may"]);
        let third = turn(
            "plan my trip to lisbon",
            &["sure, when", "in may", "ok, booked", "and a hotel"],
        );
        // Same home; the later turn's home is believed to hold its previous prompt.
        assert_eq!(second.1, third.1);
        assert!(second.0 > head);
        let third_hashes = chat_hashes(&[
            system,
            "plan my trip to lisbon",
            "sure, when",
            "in may",
            "ok, booked",
            "and a hotel",
        ]);
        let marks = &third_hashes.marks[0];
        assert_eq!(third.0, marks[marks.len() - 2]);
        assert!(third.0 > second.0);
        assert_ne!(
            turn("fix my printer please", &["which one", "the red one"]),
            second
        );
        // A single prompt: its first block; nothing without a full block.
        let prompt = hashes("a single prompt of several words");
        assert_eq!(group_head(&prompt), Some((1, prompt.chains[0][0])));
        assert_eq!(group_head(&hashes("")), None);
    }

    #[test]
    fn a_document_after_a_shared_system_prompt_keys_its_home_by_its_own_opening() {
        // RAG: one short instruction for every document, then the document and a question in
        // one user message.
        let system = "answer from the document only";
        let document = |n: usize| -> String {
            (0..200)
                .map(|i| format!("doc{n} word{i} "))
                .collect::<String>()
        };
        let ask = |n: usize, question: &str| {
            let user = format!("{}question: {question}", document(n));
            chat_hashes(&[system, &user])
        };
        let first = ask(1, "what is the refund policy");
        let mark = first.marks[0][0];
        assert_eq!(
            first.marks[0],
            vec![mark],
            "one boundary: the user message's start"
        );
        let (held, key) = group_head(&first).unwrap();
        // Keyed by the block that ends the document's first HEAD_PROBE_TOKENS tokens (4-token
        // blocks here), believed held through it.
        let probe = HEAD_PROBE_TOKENS / 4;
        assert_eq!(
            (held, key),
            (mark + probe, first.chains[0][mark + probe - 1])
        );
        // Every question of the document has its home; another document has another key.
        assert_eq!(group_head(&ask(1, "who signs it")), Some((held, key)));
        assert_ne!(
            group_head(&ask(2, "what is the refund policy")).unwrap().1,
            key
        );
        // Keyed by the system prompt, as before, every document would share one home.
        assert_eq!(first.chains[0][mark - 1], ask(2, "x").chains[0][mark - 1]);
        // A template whose user message opens with words every document shares (LlamaIndex's
        // default) still keys each document apart, which its first block would not.
        let templated = |n: usize| {
            let user = format!(
                "Context information is below.\n---------------------\n{}\n\
                 ---------------------\nGiven the context information, answer the query.",
                document(n)
            );
            chat_hashes(&[system, &user])
        };
        let (a, b) = (templated(1), templated(2));
        assert_eq!(a.chains[0][mark], b.chains[0][mark]);
        assert_ne!(group_head(&a).unwrap().1, group_head(&b).unwrap().1);

        // A tenant's question, shorter than its system prompt, keeps the system prompt's key
        // however long the question.
        let tenant: String = (0..300).map(|i| format!("rule{i} ")).collect();
        let long_question: String = (0..200).map(|i| format!("detail{i} ")).collect();
        let question = chat_hashes(&[&tenant, &long_question]);
        let mark = question.marks[0][0];
        assert!(question.chains[0].len() - mark >= HEAD_PROBE_TOKENS.div_ceil(4));
        assert_eq!(
            group_head(&question),
            Some((mark, question.chains[0][mark - 1]))
        );
        // A short last message (a question after a one-line instruction) keeps its key too.
        let short = chat_hashes(&[system, "what is the refund policy for damaged goods"]);
        let mark = short.marks[0][0];
        assert_eq!(group_head(&short), Some((mark, short.chains[0][mark - 1])));
    }

    #[test]
    fn gateways_that_share_nothing_agree_on_a_new_groups_home_only_with_consistent_placement() {
        let gateways = |placement| {
            let config = RouterConfig {
                policy: Policy::Latency,
                placement,
                index_capacity_blocks: 64,
                ..RouterConfig::default()
            };
            // One gateway has routed eight tenants while endpoints 2 and 3 were down (its
            // belief fills 0 and 1), the other nothing.
            let mut busy = Router::new(config, 4);
            let mut half_down = idle(4);
            half_down[2].down = true;
            half_down[3].down = true;
            for t in 0..8 {
                let h = chat_hashes(&[&format!("tenant {t} {}", "policy text ".repeat(20)), "hi"]);
                let d = busy.pick(&h, &half_down).unwrap();
                busy.commit(&d, &h);
            }
            (busy, Router::new(config, 4))
        };
        let new_tenants: Vec<BlockHashes> = (100..120)
            .map(|t| {
                chat_hashes(&[
                    &format!("{t} is a tenant: {}", "rules ".repeat(30)),
                    "hello",
                ])
            })
            .collect();
        let (mut busy, mut fresh) = gateways(Placement::Consistent);
        for h in &new_tenants {
            let (a, b) = (
                busy.pick(h, &idle(4)).unwrap(),
                fresh.pick(h, &idle(4)).unwrap(),
            );
            assert_eq!(a.endpoint, b.endpoint);
            assert_eq!(a.home, Some(a.endpoint));
            assert!(a.explain(&[]).ends_with(&format!("(home #{})", a.endpoint)));
            // The choice believed the head at the home; what the request is accounted with
            // (pending work, the rate its first byte teaches) is what the router believes.
            let chose_by = b.prediction().unwrap();
            let accounted = fresh.prediction_for(&b, h, &idle(4)[b.endpoint]);
            assert!(chose_by.cached_tokens > 0, "{chose_by:?}");
            assert_eq!(accounted.cached_tokens, 0);
            assert_eq!(
                accounted.uncached_tokens,
                chose_by.uncached_tokens + chose_by.cached_tokens
            );
            let (head, _) = group_head(h).unwrap();
            assert!(a.scores[a.endpoint].matched_blocks >= head);
        }
        // Local placement: each gateway's own view decides (the busy one avoids the caches it
        // filled), and they part on many (8 of 20).
        let (mut busy, mut fresh) = gateways(Placement::Local);
        let parted = new_tenants
            .iter()
            .filter(|h| {
                let (a, b) = (
                    busy.pick(h, &idle(4)).unwrap(),
                    fresh.pick(h, &idle(4)).unwrap(),
                );
                assert_eq!((a.home, b.home), (None, None));
                a.endpoint != b.endpoint
            })
            .count();
        assert!(parted >= 5, "{parted}");
    }

    #[test]
    fn a_document_the_router_has_not_seen_goes_to_its_home_however_full_it_believes_the_home() {
        let config = RouterConfig {
            policy: Policy::Latency,
            placement: Placement::Consistent,
            index_capacity_blocks: 1500,
            ..RouterConfig::default()
        };
        let mut r = Router::new(config, 4);
        // One short instruction every document shares, then a document of 2,000 tokens (500
        // blocks of 4) and its question.
        let question = |d: usize, q: usize| {
            chat_hashes(&[
                "Answer from the document only.",
                &format!(
                    "document {d}: {} question {q}: what does it say about item {q}, and why?",
                    "facts ".repeat(2000)
                ),
            ])
        };
        let first = question(0, 0);
        let d = r.pick(&first, &idle(4)).unwrap();
        r.commit(&d, &first);
        let home = d.endpoint;
        // Another document with the same home, which this router believes a third full (the
        // other endpoints empty): another gateway may have placed it there already. Priced for
        // room (over 300 ms of prefill), the home would lose to an empty endpoint by far more
        // than the head it is believed to hold saves (68 ms).
        let doc = (1..100)
            .find(|&d| {
                let (_, key) = group_head(&question(d, 0)).unwrap();
                rendezvous(&[0, 1, 2, 3], key) == home
            })
            .unwrap();
        let other = question(doc, 0);
        let d = r.pick(&other, &idle(4)).unwrap();
        assert_eq!((d.endpoint, d.home), (home, Some(home)));
        let at_home = d.scores[home].prediction.unwrap();
        assert_eq!(at_home.room_ms, 0.0);
        assert!(r.store.room(home).believed_blocks > 0);
        r.commit(&d, &other);
        // Its next question: the router has seen the document, and the home's room is priced
        // as anywhere (the question's new block).
        let next = r.pick(&question(doc, 1), &idle(4)).unwrap();
        assert_eq!(next.endpoint, home);
        assert!(next.scores[home].prediction.unwrap().room_ms > 0.0);
    }

    #[test]
    fn routers_with_different_seeds_place_a_new_prefix_on_the_same_endpoint_under_latency() {
        // Two gateways (own seeds, own draws) with the same view of an idle fleet: every new
        // prefix is an exact tie, and both break it the same way; different prefixes spread.
        let mut chosen = std::collections::BTreeMap::new();
        for seed in [1, 99] {
            let mut r = Router::new(
                RouterConfig {
                    policy: Policy::Latency,
                    seed,
                    ..RouterConfig::default()
                },
                4,
            );
            for p in 0..40 {
                let h = hashes(&format!("tenant {p} has its own system prompt"));
                let d = r.pick(&h, &idle(4)).unwrap();
                assert!(d.tie, "an idle fleet ties");
                chosen.entry(p).or_insert_with(Vec::new).push(d.endpoint);
            }
        }
        assert!(chosen.values().all(|e| e[0] == e[1]), "{chosen:?}");
        let used: std::collections::BTreeSet<usize> = chosen.values().map(|e| e[0]).collect();
        assert_eq!(used.len(), 4, "prefixes spread over every endpoint");
        // The baselines keep their seeded draw.
        let draws: Vec<usize> = [1, 99]
            .iter()
            .map(|&seed| {
                let mut r = Router::new(
                    RouterConfig {
                        policy: Policy::PrefixOnly,
                        seed,
                        ..RouterConfig::default()
                    },
                    4,
                );
                (0..20)
                    .map(|p| {
                        r.pick(&hashes(&format!("t{p}")), &idle(4))
                            .unwrap()
                            .endpoint
                    })
                    .fold(0, |acc, e| acc * 4 + e)
            })
            .collect();
        assert_ne!(draws[0], draws[1]);
    }

    #[test]
    fn pick_does_not_change_belief_until_commit() {
        let mut r = router(Policy::Prefix, 3);
        let h = hashes("one two three four");
        let first = r.pick(&h, &idle(3)).unwrap();
        assert!(first.cold);
        assert_eq!(r.matched_blocks(&h), vec![0, 0, 0]);
        r.commit(&first, &h);
        let second = r.pick(&h, &idle(3)).unwrap();
        assert_eq!(second.endpoint, first.endpoint);
        assert_eq!(second.matched_blocks(), 2);
        assert!(!second.cold);
        assert_eq!(second.scores[second.endpoint].prefix, 1.0);
        // 3·1 + 2·1 + 2·1 + 1·0.5
        assert_eq!(second.score(), 7.5);
    }

    #[test]
    fn a_prompt_in_chinese_is_not_believed_cached_where_another_one_went() {
        let chat = |system: &str, question: &str, non_ascii, identity| {
            let body = serde_json::json!({"model": "m", "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ]})
            .to_string();
            let config = HashConfig {
                block_size: 4,
                non_ascii,
                identity,
                ..HashConfig::default()
            };
            hash_request(&parse_request(body.as_bytes()).unwrap(), config)
        };
        let support = "你是一个乐于助人的客服助手，专门回答关于订单、退货和物流的问题。";
        let lawyer = "作为一名专业的法律顾问，请根据中国法律谨慎地回答合同纠纷的问题。";
        for (non_ascii, identity, believed) in [
            (NonAscii::Pieces, BlockIdentity::Text, false),
            (NonAscii::Pieces, BlockIdentity::TokenIds, false),
            // Skipped by the tokenizer, the characters are still the blocks' bytes.
            (NonAscii::Skip, BlockIdentity::Text, false),
            // Skipped, with blocks of the servers' token ids, the characters leave two chat
            // headers: the same full block in both.
            (NonAscii::Skip, BlockIdentity::TokenIds, true),
        ] {
            let mut r = router(Policy::Latency, 2);
            let a = chat(support, "我的订单什么时候到？", non_ascii, identity);
            let d = r.pick(&a, &idle(2)).unwrap();
            r.commit(&d, &a);
            let b = chat(lawyer, "合同可以提前解除吗？", non_ascii, identity);
            let matched = r.matched_blocks(&b)[d.endpoint];
            assert_eq!(
                matched > 0,
                believed,
                "{non_ascii:?} {identity:?}: {matched} blocks"
            );
            assert_eq!(
                matched == b.chains[0].len() - 1,
                believed,
                "{non_ascii:?} {identity:?}"
            );
        }
    }

    #[test]
    fn only_full_blocks_are_believed_as_only_they_are_cached() {
        let mut r = router(Policy::Prefix, 2);
        // Five tokens in blocks of two: two full blocks and a partial one.
        let h = hashes("one two three four five");
        assert_eq!(h.total_blocks(), 3);
        let d = r.pick(&h, &idle(2)).unwrap();
        r.commit(&d, &h);
        assert_eq!(r.matched_blocks(&h)[d.endpoint], 2);
        assert_eq!(r.store().room(d.endpoint).believed_blocks, 2);
        // The next turn of the same prompt continues where its full blocks ended.
        let next = hashes("one two three four five six seven");
        let m = r.matched_per_chain(d.endpoint, &next);
        assert_eq!(
            r.store().continues(d.endpoint, &next.chains[0], m[0]),
            Some(Turn::First)
        );
        // A prompt shorter than a block leaves nothing to believe.
        let tiny = hashes("x");
        let t = r.pick(&tiny, &idle(2)).unwrap();
        r.commit(&t, &tiny);
        assert_eq!(r.matched_blocks(&tiny), vec![0, 0]);
    }

    #[test]
    fn prefix_policy_trades_locality_against_queue() {
        let mut r = router(Policy::Prefix, 2);
        let h = hashes("alpha beta gamma delta");
        let d = r.pick(&h, &idle(2)).unwrap();
        r.commit(&d, &h);
        let holder = d.endpoint;
        let other = 1 - holder;
        // A small queue on the holder does not beat the full prefix match...
        let mut loads = idle(2);
        loads[holder].queue = Some(1.0);
        loads[other].queue = Some(0.0);
        assert_eq!(r.pick(&h, &loads).unwrap().endpoint, holder);
        // ...but the holder also busy on kv-cache does: 3 + 0 + 0.6 + 0.5 < 0 + 2 + 2 + 0.5.
        loads[holder].kv_usage = Some(0.7);
        let spilled = r.pick(&h, &loads).unwrap();
        assert_eq!(spilled.endpoint, other);
        assert_eq!(spilled.runner_up, Some(holder));
    }

    #[test]
    fn no_hit_lru_spreads_cold_prefixes() {
        let mut r = router(Policy::Prefix, 3);
        let mut seen = Vec::new();
        for text in ["a a a", "b b b", "c c c"] {
            let h = hashes(text);
            let d = r.pick(&h, &idle(3)).unwrap();
            r.commit(&d, &h);
            seen.push(d.endpoint);
        }
        seen.sort();
        assert_eq!(seen, vec![0, 1, 2]);
    }

    #[test]
    fn exact_ties_are_seeded_random() {
        let picks = |seed| {
            let mut r = Router::new(
                RouterConfig {
                    policy: Policy::PrefixOnly,
                    seed,
                    ..RouterConfig::default()
                },
                4,
            );
            (0..32)
                .map(|i| {
                    r.pick(&hashes(&format!("p{i}")), &idle(4))
                        .unwrap()
                        .endpoint
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(picks(1), picks(1));
        assert_ne!(picks(1), picks(2));
        let spread = picks(1);
        assert!((0..4).all(|e| spread.contains(&e)), "{spread:?}");
    }

    #[test]
    fn shared_cold_history_steers_the_next_cold_pick() {
        let mut a = router(Policy::Prefix, 3);
        let d = a.pick(&hashes("first tenant"), &idle(3)).unwrap();
        a.commit(&d, &hashes("first tenant"));
        assert_eq!(a.last_cold()[d.endpoint], Some(1));
        // A second router (another worker) that learns the first one's history avoids the
        // endpoint that just took a cold prefix, as the first router itself would.
        let mut b = router(Policy::Prefix, 3);
        b.set_last_cold(a.last_cold());
        let h = hashes("second tenant");
        let (da, db) = (a.pick(&h, &idle(3)).unwrap(), b.pick(&h, &idle(3)).unwrap());
        let totals = |d: &Decision| d.scores.iter().map(|s| s.total).collect::<Vec<_>>();
        assert_eq!(totals(&db), totals(&da));
        assert_ne!(db.endpoint, d.endpoint);
        assert_eq!(b.next_cold_stamp(), 2);
        b.commit(&db, &h);
        assert_eq!(
            b.last_cold()[db.endpoint],
            Some(2),
            "clock continues past the history"
        );
        b.set_last_cold(&[None]);
        assert_eq!(b.last_cold(), &[None, None, None]);
    }

    #[test]
    fn round_robin_rotates_over_up_endpoints() {
        let mut r = router(Policy::RoundRobin, 3);
        let h = hashes("x");
        let mut loads = idle(3);
        loads[1].down = true;
        let order: Vec<usize> = (0..4)
            .map(|_| r.pick(&h, &loads).unwrap().endpoint)
            .collect();
        assert_eq!(order, vec![0, 2, 0, 2]);
    }

    #[test]
    fn least_queue_picks_shortest_measured_queue() {
        let mut r = router(Policy::LeastQueue, 3);
        let loads = [
            EndpointLoad::measured(5.0, 0.0),
            EndpointLoad::measured(1.0, 0.0),
            EndpointLoad::default(),
        ];
        let d = r.pick(&hashes("x"), &loads).unwrap();
        assert_eq!(d.endpoint, 1);
        assert_eq!(d.runner_up, Some(0));
    }

    #[test]
    fn down_endpoints_are_skipped_unless_all_are_down() {
        let mut r = router(Policy::Prefix, 2);
        let h = hashes("q r s");
        let d = r.pick(&h, &idle(2)).unwrap();
        r.commit(&d, &h);
        let mut loads = idle(2);
        loads[d.endpoint].down = true;
        let moved = r.pick(&h, &loads).unwrap();
        assert_eq!(moved.endpoint, 1 - d.endpoint);
        assert!(moved.scores[d.endpoint].excluded);
        loads[1 - d.endpoint].down = true;
        let all = r.pick(&h, &loads).unwrap();
        assert!(all.all_down);
        assert_eq!(
            all.endpoint, d.endpoint,
            "with all down the prefix holder wins again"
        );
    }

    #[test]
    fn saturated_holder_is_filtered_while_another_endpoint_has_room() {
        let mut r = router(Policy::Prefix, 2);
        let h = hashes("long shared system prompt text");
        let d = r.pick(&h, &idle(2)).unwrap();
        r.commit(&d, &h);
        let holder = d.endpoint;
        let mut loads = idle(2);
        loads[holder].queue = Some(5.0);
        let spilled = r.pick(&h, &loads).unwrap();
        assert_eq!(spilled.endpoint, 1 - holder);
        assert!(spilled.scores[holder].saturated && spilled.scores[holder].excluded);
        // Both saturated: nothing is filtered and the prefix holder wins on score.
        loads[1 - holder].kv_usage = Some(0.9);
        assert_eq!(r.pick(&h, &loads).unwrap().endpoint, holder);
        // prefix-only ignores load entirely.
        let mut only = router(Policy::PrefixOnly, 2);
        only.commit(&d, &h);
        loads[1 - holder].kv_usage = Some(0.0);
        assert_eq!(only.pick(&h, &loads).unwrap().endpoint, holder);
    }

    #[test]
    fn unmeasured_endpoints_lose_load_scores() {
        let mut r = router(Policy::Prefix, 2);
        let loads = [EndpointLoad::default(), EndpointLoad::measured(3.0, 0.5)];
        let d = r.pick(&hashes("cold"), &loads).unwrap();
        assert_eq!(d.endpoint, 1);
        assert_eq!(d.scores[0].queue, 0.0);
        assert_eq!(d.scores[0].kv_cache, 0.0);
    }

    #[test]
    fn the_explanation_names_winner_and_runner_up() {
        let mut r = router(Policy::Prefix, 2);
        let h = hashes("aa bb cc dd");
        let d = r.pick(&h, &idle(2)).unwrap();
        r.commit(&d, &h);
        let d = r.pick(&h, &idle(2)).unwrap();
        let names = vec!["replica-0".to_string(), "replica-1".to_string()];
        let line = d.explain(&names);
        assert!(
            line.starts_with(&format!(
                "prefix -> {}: match 2/2 blocks, score 7.50, next ",
                names[d.endpoint]
            )),
            "{line}"
        );
    }

    #[test]
    fn a_pick_over_no_endpoints_is_an_error_not_endpoint_zero() {
        let mut r = router(Policy::Latency, 0);
        assert_eq!(r.pick(&hashes("a b"), &[]), Err(PickError::NoEndpoints));
        assert_eq!(
            PickError::NoEndpoints.to_string(),
            "no endpoints to route to"
        );
    }

    #[test]
    fn believed_matches_count_held_blocks_and_continuations_per_endpoint() {
        let mut r = router(Policy::PrefixOnly, 2);
        // A token owns its trailing whitespace: the first turn ends in one, so its four tokens
        // begin the next turn.
        let first = hashes("aa bb cc dd ");
        let d = r.pick(&first, &idle(2)).unwrap();
        r.commit(&d, &first);
        let next = hashes("aa bb cc dd ee ff ");
        let m = r.believed_matches(&next);
        let other = 1 - d.endpoint;
        assert_eq!(m.of(d.endpoint), [2], "two full blocks of two tokens");
        assert_eq!(m.of(other), [0]);
        assert_eq!(m.of(7), [0; 0], "an endpoint it does not know");
        assert_eq!(
            m.continues[d.endpoint],
            Some(Turn::First),
            "the next turn continues where the first ended"
        );
        assert_eq!(m.continues[other], None);
        assert_eq!(continued_turn(&m, &[true, true]), Some(Turn::First));
        let mut only_other = [true; 2];
        only_other[d.endpoint] = false;
        assert_eq!(
            continued_turn(&m, &only_other),
            None,
            "not where it is ineligible"
        );
        // The second turn is a later one: the third continues it as such.
        let d2 = r.pick(&next, &idle(2)).unwrap();
        assert_eq!(d2.continued, Some(Turn::First));
        r.commit(&d2, &next);
        let third = hashes("aa bb cc dd ee ff gg hh");
        let m3 = r.believed_matches(&third);
        assert_eq!(m3.continues[d2.endpoint], Some(Turn::Later));
    }

    #[test]
    fn a_run_another_gateway_routed_marks_where_its_request_ended() {
        // Two gateways take turns with one conversation: this one routed turns one and three,
        // the other turn two, which this one sees only as the server's run of stored blocks.
        let mut r = router(Policy::Latency, 2);
        let first = hashes("aa bb cc dd ");
        r.set_now(1_000.0);
        let d = r.pick(&first, &idle(2)).unwrap();
        r.commit(&d, &first);
        let e = d.endpoint;
        let [chain] = hashes("aa bb cc dd ee ff ").chains.try_into().unwrap();
        let second = StoredRun {
            parent: Some(chain[1]),
            end: chain[2],
            blocks: 1,
        };
        r.store_mut().record(e, &chain);
        let third = hashes("aa bb cc dd ee ff gg hh");
        assert_eq!(
            r.believed_matches(&third).continues[e],
            None,
            "without the mark, turn three looks like a new group's request"
        );
        r.set_now(1_500.0);
        assert!(r.mark_stored(e, &second));
        let m = r.believed_matches(&third);
        assert_eq!(m.continues[e], Some(Turn::Later), "it continued turn one");
        // Turn three's gap is measured from when the run was read.
        r.set_now(2_000.0);
        let d3 = r.pick(&third, &idle(2)).unwrap();
        assert_eq!(d3.endpoint, e);
        assert_eq!(r.continued_gap_ms(&d3, &third), Some(500.0));
        // The run of this gateway's own request is known, and one on an endpoint it does not
        // have, or of no blocks, is ignored.
        r.commit(&d3, &third);
        let [chain3] = third.chains.try_into().unwrap();
        let own = StoredRun {
            parent: Some(chain3[2]),
            end: chain3[3],
            blocks: 1,
        };
        assert!(!r.mark_stored(e, &own));
        assert!(!r.mark_stored(7, &second));
        assert!(!r.mark_stored(1 - e, &StoredRun::default()));
        // A run that starts a chain starts a group.
        let other = hashes("zz yy ");
        let [chain] = other.chains.try_into().unwrap();
        r.store_mut().record(1 - e, &chain);
        let start = StoredRun {
            parent: None,
            end: chain[0],
            blocks: 1,
        };
        assert!(r.mark_stored(1 - e, &start));
        assert_eq!(r.store().continues(1 - e, &chain, 1), Some(Turn::First));
    }

    #[test]
    fn a_continuation_measures_its_groups_gap_on_the_routers_clock() {
        let mut r = router(Policy::Latency, 2);
        let first = hashes("aa bb cc dd ");
        r.set_now(1_000.0);
        let d = r.pick(&first, &idle(2)).unwrap();
        let c = r.commit(&d, &first).unwrap();
        assert_eq!(c.gap_ms, None, "a first turn continues nothing");
        assert_eq!(c.now_ms, 1_000.0);
        assert!(c.share > 0.0 && c.share <= 1.0, "{c:?}");
        let live_after_first = r.live_groups().on(d.endpoint, 1_000.0, c.live_gap_ms);
        assert!((live_after_first - c.share).abs() < 1e-12);
        // The next turn 1.5 s later continues it: the gap is measured and learned.
        let next = hashes("aa bb cc dd ee ff ");
        r.set_now(2_500.0);
        let d2 = r.pick(&next, &idle(2)).unwrap();
        assert_eq!(r.continued_gap_ms(&d2, &next), Some(1_500.0));
        let c2 = r.commit(&d2, &next).unwrap();
        assert_eq!(c2.gap_ms, Some(1_500.0));
        assert_eq!(r.growth().gaps, 1.0 * 0.98);
        // An unrelated request measures nothing; a clock that is not a number is ignored.
        r.set_now(f64::NAN);
        let other = hashes("zz yy ");
        let d3 = r.pick(&other, &idle(2)).unwrap();
        assert_eq!(r.commit(&d3, &other).unwrap().now_ms, 2_500.0);
    }

    #[test]
    fn a_request_no_endpoint_holds_is_priced_with_the_work_in_flight_over_the_fewest_lanes() {
        let words = |tag: &str| -> String { (0..120).map(|i| format!("{tag}{i} ")).collect() };
        // Endpoint 0 is 10% cheaper per token; 256 lanes are believed everywhere.
        let loads = |in_flight_at_0: u32, fewest: Option<u32>| -> Vec<EndpointLoad> {
            let mut loads = idle(3);
            for (e, load) in loads.iter_mut().enumerate() {
                load.latency.ms_per_token = Some(if e == 0 { 0.9 } else { 1.0 });
                load.latency.lanes = Some(256);
                load.latency.fewest_lanes = fewest;
            }
            loads[0].latency.work = crate::latency::EndpointWork {
                in_flight: in_flight_at_0,
                prefilling: in_flight_at_0,
                prefill_tokens: 800 * u64::from(in_flight_at_0),
            };
            loads
        };
        let mut r = router(Policy::Latency, 3);
        let held = hashes(&words("p"));
        let d = r.pick(&held, &loads(0, Some(1))).unwrap();
        assert_eq!(d.endpoint, 0, "idle: the cheapest");
        r.commit(&d, &held).unwrap();

        // One long prefill in flight on 0. A new prompt gains nothing by stacking behind it:
        // with no evidence of more than one lane, the wait it might have is priced there.
        let new = hashes(&words("n"));
        let d = r.pick(&new, &loads(1, Some(1))).unwrap();
        assert_ne!(d.endpoint, 0);
        let at_0 = d.scores[0].prediction.unwrap();
        assert_eq!(
            at_0.queue_ms, 0.0,
            "the prediction itself keeps the learned lanes"
        );
        assert!((at_0.caution_ms - 800.0 * 0.9).abs() < 1e-6, "{at_0:?}");
        let names: Vec<String> = (0..3).map(|e| format!("e{e}")).collect();
        let lines = d.endpoint_lines(&names);
        assert!(lines[0].contains("caution 720 ms, cost"), "{lines:?}");
        // Once two were seen to run at once, a lane is free, but not for the whole prefill:
        // half of the work in flight is priced, still more than the cheaper rate saves.
        let d = r.pick(&new, &loads(1, Some(2))).unwrap();
        assert_ne!(d.endpoint, 0);
        let at_0 = d.scores[0].prediction.unwrap();
        assert!(
            (at_0.caution_ms - 800.0 * 0.9 / 2.0).abs() < 1e-6,
            "{at_0:?}"
        );
        // With many lanes plausible the share is small and the cheaper rate wins; without a
        // fit there is no caution at all.
        let d = r.pick(&new, &loads(1, Some(256))).unwrap();
        assert_eq!(d.endpoint, 0);
        assert!((d.scores[0].prediction.unwrap().caution_ms - 800.0 * 0.9 / 256.0).abs() < 1e-6);
        let d = r.pick(&new, &loads(1, None)).unwrap();
        assert_eq!(d.endpoint, 0);
        assert_eq!(d.scores[0].prediction.unwrap().caution_ms, 0.0);
        // A request whose prefix 0 holds stays there: stacking it keeps its locality.
        let continued = hashes(&format!("{} more words here", words("p")));
        let d = r.pick(&continued, &loads(1, Some(1))).unwrap();
        assert_eq!(d.endpoint, 0);
        assert_eq!(d.scores[0].prediction.unwrap().caution_ms, 0.0);
    }

    #[test]
    fn a_first_request_on_a_prefix_that_queues_at_its_holder_credits_a_copy_elsewhere() {
        let shared: String = (0..40).map(|i| format!("s{i} ")).collect();
        let question = |i: usize| hashes(&format!("{shared}q{i} x{i} "));
        let mut r = router(Policy::Latency, 2);
        // 30 questions a second on one prefix, all held by the endpoint the first went to.
        let mut home = None;
        for i in 0..15 {
            r.set_now(i as f64 * 1000.0 / 30.0);
            let h = question(i);
            let d = r.pick(&h, &idle(2)).unwrap();
            assert_eq!(*home.get_or_insert(d.endpoint), d.endpoint);
            r.commit(&d, &h).unwrap();
        }
        let (home, other) = (home.unwrap(), 1 - home.unwrap());
        // Now the holder has four prefills of 100 tokens ahead on one lane; the other is idle.
        let mut loads = idle(2);
        for load in &mut loads {
            load.latency.lanes = Some(1);
            load.latency.ms_per_token = Some(1.0);
        }
        loads[home].latency.work = crate::latency::EndpointWork {
            in_flight: 4,
            prefilling: 4,
            prefill_tokens: 400,
        };
        r.set_now(500.0);
        let h = question(15);
        let d = r.pick(&h, &loads).unwrap();
        let at = |e: usize| d.scores[e].prediction.unwrap();
        assert_eq!(at(home).copy_credit_ms, 0.0, "the holder makes no copy");
        let credit = at(other).copy_credit_ms;
        assert!(credit > 0.0, "{:?}", at(other));
        assert!((d.scores[other].total + at(other).cost_ms).abs() < 1e-9);
        assert!(d
            .endpoint_lines(&[])
            .iter()
            .any(|l| l.contains("copy credit")));
        // A continuation's prefix is its own history, which nobody else shares: no credit.
        let next = hashes(&format!("{shared}q3 x3 more words "));
        let d = r.pick(&next, &loads).unwrap();
        assert!(d.continued.is_some());
        assert!(d
            .scores
            .iter()
            .all(|s| s.prediction.unwrap().copy_credit_ms == 0.0));
        // Nor where the holder does not queue.
        let d = r.pick(&question(16), &idle(2)).unwrap();
        assert!(d
            .scores
            .iter()
            .all(|s| s.prediction.unwrap().copy_credit_ms == 0.0));
    }

    #[test]
    fn a_hot_prefix_gets_a_second_holder_once_its_holder_took_over_twice_the_mean_share() {
        let shared: String = (0..40).map(|i| format!("s{i} ")).collect();
        let question = |i: usize| hashes(&format!("{shared}q{i} x{i} "));
        let place = |factor: f64| {
            let mut r = Router::new(
                RouterConfig {
                    policy: Policy::Latency,
                    latency: crate::latency::LatencyConfig {
                        balance_factor: factor,
                        ..Default::default()
                    },
                    ..RouterConfig::default()
                },
                4,
            );
            let mut placed = Vec::new();
            for i in 0..8 {
                r.set_now(i as f64);
                let h = question(i);
                let d = r.pick(&h, &idle(4)).unwrap();
                placed.push((d.endpoint, d.scores.iter().position(|s| s.over_share)));
                r.commit(&d, &h).unwrap();
            }
            placed
        };
        let placed = place(2.0);
        let home = placed[0].0;
        // Idle replicas, so the prediction alone keeps every question where the prefix is. The
        // first five stay: until the four endpoints have taken a request each on average
        // (decayed a little, so not yet at the fifth), shares say nothing.
        assert!(placed[..5].iter().all(|&p| p == (home, None)), "{placed:?}");
        // The sixth: the holder took 5 of 5 requests (over twice the mean, 1.25), and the
        // prefix started 4 groups there (over 1.5 times the mean): the holder is set aside and
        // the question makes a copy elsewhere.
        assert_eq!(placed[5].1, Some(home), "{placed:?}");
        assert_ne!(placed[5].0, home);
        // Off, nothing is set aside.
        assert!(place(0.0).iter().all(|&p| p == (home, None)));
    }

    #[test]
    fn a_busy_holder_is_set_aside_only_for_a_prefix_busier_than_a_fair_share() {
        // Endpoint 0 took 8 of 14 recent requests (the mean is 3.5), and holds the prefix.
        let mut recent = RecentRequests::new(4);
        for (e, n) in [(0, 8), (1, 2), (2, 2), (3, 2)] {
            for _ in 0..n {
                recent.record(e, 0.0);
            }
        }
        let scores = || {
            let mut s = vec![seen(0, 400.0, false, true); 4];
            s[0] = seen(10, 30.0, false, true);
            s
        };
        let bounded = |starts_per_holder: f64, factor: f64, recent: &RecentRequests| {
            let mut s = scores();
            bound_busy_holders(&mut s, 10, starts_per_holder, [recent, recent], factor, 0.0);
            assert_eq!(
                excluded(&s),
                s.iter().map(|s| s.over_share).collect::<Vec<_>>()
            );
            excluded(&s)
        };
        // The prefix started 6 groups there, over 1.5 × 3.5: set aside, 8 > 2 × 3.5.
        assert_eq!(bounded(6.0, 2.0, &recent), [true, false, false, false]);
        // 5 is under 1.5 × 3.5: it fits a fair share, the holder keeps it however busy.
        assert_eq!(bounded(5.0, 2.0, &recent), [false; 4]);
        // A factor of 3 allows 10.5: endpoint 0 is within it. 0 turns the bound off.
        assert_eq!(bounded(6.0, 3.0, &recent), [false; 4]);
        assert_eq!(bounded(6.0, 0.0, &recent), [false; 4]);
        // An endpoint that holds less of the prefix is never set aside for it: here the busy
        // one holds 4 of the 10 blocks endpoint 1 holds.
        let mut s = scores();
        s[0].matched_blocks = 4;
        s[1].matched_blocks = 10;
        bound_busy_holders(&mut s, 10, 6.0, [&recent, &recent], 2.0, 0.0);
        assert_eq!(excluded(&s), [false; 4]);
    }

    #[test]
    fn a_handful_of_requests_sets_a_holder_aside_only_a_whole_request_over_the_bound() {
        // An Envoy worker's first four requests of the demo trace: three of one tenant on
        // endpoint 2, one on endpoint 0. The mean is 4/3, the bound 8/3, and the tenant's 3
        // starts are over 1.5 × 4/3: hot by its share, but its holder is over the bound by a
        // third of a request, which one request more or less decides. Kept.
        let mut recent = RecentRequests::new(3);
        for e in [0, 2, 2, 2] {
            recent.record(e, 0.0);
        }
        let scores = || {
            let mut s = vec![seen(0, 400.0, false, true); 3];
            s[2] = seen(10, 30.0, false, true);
            s
        };
        let mut s = scores();
        bound_busy_holders(&mut s, 10, 3.0, [&recent, &recent], 2.0, 0.0);
        assert_eq!(excluded(&s), [false; 3]);
        // A fourth request there puts it over by more than the slack: set aside.
        recent.record(2, 0.0);
        let mut s = scores();
        bound_busy_holders(&mut s, 10, 4.0, [&recent, &recent], 2.0, 0.0);
        assert_eq!(excluded(&s), [false, false, true]);
    }

    #[test]
    fn a_holder_is_weighed_by_the_fleets_requests_when_a_proxy_pools_them() {
        // A worker saw 5 of a document's 6 requests and 4 others: its own counts make the
        // holder (endpoint 0) hot and over the bound (5 > 2 × 1.5 + 0.5), and its 5 starts
        // are over 1.5 × 1.5.
        let mut own = RecentRequests::new(6);
        for e in [0, 0, 0, 0, 0, 1, 2, 3, 4] {
            own.record(e, 0.0);
        }
        // The fleet (both workers) sent 6 of 23 there: the bound is 2 × 23/6 + 0.5 = 8.2.
        let mut fleet = RecentRequests::default();
        fleet.reset(6, 0.0);
        for (e, n) in [(0, 6.0), (1, 4.0), (2, 4.0), (3, 3.0), (4, 3.0), (5, 3.0)] {
            fleet.add(e, n, 0.0);
        }
        let scores = || {
            let mut s = vec![seen(0, 900.0, false, true); 6];
            s[0] = seen(110, 20.0, false, true);
            s
        };
        let mut s = scores();
        bound_busy_holders(&mut s, 110, 5.0, [&own, &own], 2.0, 0.0);
        assert!(excluded(&s)[0], "its own counts set the holder aside");
        let mut s = scores();
        bound_busy_holders(&mut s, 110, 5.0, [&own, &fleet], 2.0, 0.0);
        assert_eq!(excluded(&s), [false; 6], "the fleet's keep it");
        // A holder over the fleet's bound is set aside however few this worker sent it.
        fleet.add(0, 4.0, 0.0);
        let mut s = scores();
        bound_busy_holders(&mut s, 110, 5.0, [&own, &fleet], 2.0, 0.0);
        assert_eq!(excluded(&s), [true, false, false, false, false, false]);
    }

    #[test]
    fn the_picker_skips_ineligible_endpoints_and_the_runner_up_is_the_best_other() {
        let mut r = router(Policy::LeastQueue, 3);
        let loads = [
            EndpointLoad::measured(0.0, 0.0),
            EndpointLoad::measured(5.0, 0.0),
            EndpointLoad::measured(1.0, 0.0),
        ];
        let h = hashes("x");
        let matches = r.believed_matches(&h);
        let filter = eligibility(Policy::LeastQueue, &loads, SaturationFilter::default());
        let scores = r.score(&h, &matches, &loads, &filter, true, None);
        assert_eq!(r.choose(&scores, &[true, true, true]), (0, false));
        assert_eq!(r.choose(&scores, &[false, true, true]), (2, false));
        assert_eq!(runner_up(&scores, &[true, true, true], 0), Some(2));
        assert_eq!(runner_up(&scores, &[true, false, false], 0), None);
        assert_eq!(ranked_after(&scores, &[true, true, true], 0), [2, 1]);
        assert_eq!(ranked_after(&scores, &[true, true, true], 2), [0, 1]);
        assert_eq!(ranked_after(&scores, &[false, true, true], 2), [1]);
    }

    /// An endpoint's view for the pure steps below: `matched` blocks, `cost_ms` predicted,
    /// whether the request's group lives there, whether it is eligible.
    fn seen(matched: usize, cost_ms: f64, continues: bool, eligible: bool) -> EndpointScores {
        EndpointScores {
            matched_blocks: matched,
            prefix: 0.0,
            queue: 0.0,
            kv_cache: 0.0,
            no_hit_lru: 0.0,
            total: -cost_ms,
            excluded: !eligible,
            away_from_head: false,
            over_share: false,
            saturated: false,
            prediction: Some(Prediction {
                cost_ms,
                ..Prediction::default()
            }),
            room: CacheRoom::default(),
            continues,
        }
    }

    /// No requests sent anywhere lately.
    fn none(_: usize) -> f64 {
        0.0
    }

    fn excluded(scores: &[EndpointScores]) -> Vec<bool> {
        scores.iter().map(|s| s.excluded).collect()
    }

    #[test]
    fn a_second_request_moves_its_group_only_to_holders_of_its_shared_head() {
        // The group lives on 0 (its 20 blocks); 1 and 3 hold the 12-block shared head, but 3
        // is down; 2 holds part of it.
        let mut scores = vec![
            seen(20, 50.0, true, true),
            seen(12, 40.0, false, true),
            seen(3, 30.0, false, true),
            seen(12, 10.0, false, false),
        ];
        keep_moves_among_head_holders(&mut scores, 12);
        assert_eq!(excluded(&scores), [false, false, true, true]);
        let away: Vec<bool> = scores.iter().map(|s| s.away_from_head).collect();
        assert_eq!(
            away,
            [false, false, true, false],
            "3 was out already: it is down"
        );
        // Where it lived is down: it may go anywhere eligible.
        let mut homeless = vec![seen(20, 50.0, true, false), seen(0, 1.0, false, true)];
        keep_moves_among_head_holders(&mut homeless, 12);
        assert_eq!(excluded(&homeless), [true, false]);
    }

    #[test]
    fn a_second_request_is_placed_again_only_where_another_endpoint_holds_its_head() {
        let mut r = router(Policy::Latency, 3);
        let head: String = (0..40).map(|i| format!("s{i} ")).collect();
        let first = hashes(&format!("{head}q1 a b c d e f g h i j k l m n o p"));
        let loads = idle(3);
        // The group's first request: only endpoint 0 holds nothing yet, so it goes somewhere.
        let d1 = r.pick(&first, &loads).unwrap();
        r.commit(&d1, &first);
        let second = hashes(&format!(
            "{head}q1 a b c d e f g h i j k l m n o p answer q2 r s t u v w x y z"
        ));
        // Nobody else holds any of it: a continuation like any other, nothing set aside.
        let d2 = r.pick(&second, &loads).unwrap();
        assert_eq!(d2.continued, Some(Turn::First));
        assert!(d2.scores.iter().all(|s| !s.away_from_head), "{d2:?}");
        // Another group's first request copies the head to another endpoint: now the second
        // request may move there, and only there.
        let other = (d1.endpoint + 1) % 3;
        let copy = hashes(&format!("{head}other question"));
        let mut d3 = r.pick(&copy, &loads).unwrap();
        d3.endpoint = other;
        r.commit(&d3, &copy);
        let d4 = r.pick(&second, &loads).unwrap();
        let away: Vec<usize> = (0..3).filter(|&i| d4.scores[i].away_from_head).collect();
        assert_eq!(away, [3 - d1.endpoint - other], "{:?}", d4.scores);
    }

    #[test]
    fn a_tie_keeps_a_request_where_its_group_lives() {
        let scores = [
            seen(20, 100.0, true, true),
            seen(12, 99.0, false, true),
            seen(12, 150.0, false, true),
        ];
        let eligible = [true; 3];
        // Within the prediction's precision of the best (99 ms), 0 and 1 tie; 0 is home.
        assert_eq!(latency_tied(&scores, &eligible, 99.0, None, none), [0]);
        // Without a home among the ties, the fewest holders and the most free cache decide.
        let away = [seen(12, 100.0, false, true), seen(12, 99.0, false, true)];
        assert_eq!(latency_tied(&away, &[true, true], 99.0, None, none), [0, 1]);
    }

    #[test]
    fn a_tie_goes_where_fewest_requests_hold_lanes_before_where_most_cache_is_free() {
        let with = |holders: f64, free: usize| {
            let mut s = seen(0, 100.0, false, true);
            if let Some(p) = s.prediction.as_mut() {
                p.backlog.holders = holders;
            }
            s.room = CacheRoom {
                capacity_blocks: 900,
                believed_blocks: 900 - free,
            };
            s
        };
        // Every endpoint predicts no wait (many lanes believed): 0 has the most room but
        // three requests in flight, 1 and 2 one each; of those, 2 has more room.
        let scores = [with(3.0, 800), with(1.0, 300), with(1.0, 500)];
        assert_eq!(latency_tied(&scores, &[true; 3], 100.0, None, none), [2]);
        // Equal holders: the room decides.
        let scores = [with(1.0, 800), with(1.0, 300)];
        assert_eq!(latency_tied(&scores, &[true; 2], 100.0, None, none), [0]);
        // ... the room left once the groups living there grow: 0's conversations are
        // expected to add 600 blocks, so 1 has more room to come.
        let mut growing = with(1.0, 800);
        if let Some(p) = growing.prediction.as_mut() {
            p.growing_blocks = 600.0;
        }
        let scores = [growing, with(1.0, 300)];
        assert_eq!(latency_tied(&scores, &[true; 2], 100.0, None, none), [1]);
        // Numbers that are not numbers never empty the ties.
        let mut broken = with(f64::NAN, 800);
        if let Some(p) = broken.prediction.as_mut() {
            p.growing_blocks = f64::NAN;
        }
        let scores = [broken, with(0.0, 300)];
        assert_eq!(latency_tied(&scores, &[true; 2], 100.0, None, none), [0]);
    }

    #[test]
    fn a_tie_goes_where_fewer_requests_went_lately_once_lanes_and_room_are_equal() {
        let with = |free: usize| {
            let mut s = seen(0, 100.0, false, true);
            s.room = CacheRoom {
                capacity_blocks: 900,
                believed_blocks: 900 - free,
            };
            s
        };
        // Three full caches: 0 took two requests more than 2 lately, 1 half a request more.
        let full = [with(0), with(0), with(0)];
        let recent = [6.0, 4.5, 4.0];
        assert_eq!(
            latency_tied(&full, &[true; 3], 100.0, None, |e| recent[e]),
            [1, 2]
        );
        // The room comes first: 0 has room, whatever it took.
        let roomy = [with(100), with(0), with(0)];
        assert_eq!(
            latency_tied(&roomy, &[true; 3], 100.0, None, |e| recent[e]),
            [0]
        );
        // Holders before both: 0's lanes are free, the others' are not.
        let mut busy = full.clone();
        for s in &mut busy[1..] {
            if let Some(p) = s.prediction.as_mut() {
                p.backlog.holders = 1.0;
            }
        }
        assert_eq!(
            latency_tied(&busy, &[true; 3], 100.0, None, |e| recent[e]),
            [0]
        );
        // A count that is not a number reads as none and never empties the ties.
        let broken = [f64::NAN, 4.5, f64::INFINITY];
        assert_eq!(
            latency_tied(&full, &[true; 3], 100.0, None, |e| broken[e]),
            [0, 2]
        );
    }
}
