//! The `latency` policy's model of an endpoint: the time to first token a request would see
//! there, in milliseconds.
//!
//! A prefix hit saves prefill, and prefill is what a long prompt costs: ~1 s for a
//! 1,000-token document at 1 ms per token, ~20 ms for its question alone. Counting waiting
//! requests (the `prefix` policy) cannot weigh that; time can. For each eligible endpoint the
//! router predicts
//!
//! ```text
//! TTFT = overhead + queue wait + uncached tokens × ms per token
//! ```
//!
//! * **uncached tokens**: the request's prompt minus what the endpoint is believed to hold,
//!   with the server's rules (full blocks only, the last prompt token always computed);
//! * **queue wait**: the endpoint serves `lanes` sequences at once; when every lane is taken,
//!   the request waits for enough of the requests ahead of it to finish. What is ahead is
//!   the prefill work the router itself sent there and has not seen a first byte of (summed
//!   over every worker), plus requests the endpoint reports (`num_requests_waiting` +
//!   `num_requests_running`) that the router did not send, e.g. another gateway's;
//! * **ms per token**: learned per endpoint from what the router observes ([`PrefillRate`]).
//!
//! The prediction is a belief, as the prefix index is: it is only as good as the index and
//! the learned rate. Placement adds one more term, the eviction cost (see [`predict`]): a
//! request whose new blocks do not fit into what the endpoint's cache has free pushes out
//! blocks some later request will need, and that later prefill is priced now.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::config::{out_of_range, ConfigError};
use crate::hashing::BlockHashes;
use crate::index::Turn;

/// Priors and bounds of the latency model (the `latency` section of the configuration).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LatencyConfig {
    /// Prefill cost per uncached token an endpoint starts with, before the router has
    /// observed it (and what it falls back to when its observations are unusable).
    pub prefill_ms_per_token: f64,
    /// Bounds of the learned cost: an estimate outside them is clamped. They keep one absurd
    /// stretch of observations (a stalled replica, a clock jump) from taking an endpoint out
    /// of rotation for good, or from making it look free.
    pub min_ms_per_token: f64,
    pub max_ms_per_token: f64,
    /// Fixed time per request besides prefill (network, scheduling, the first decode step).
    pub overhead_ms: f64,
    /// The most sequences an endpoint is assumed to prefill at once; the first bytes of
    /// stacked requests show how many really do (see [`LaneFit`]), and until they do, this
    /// stands. The default assumes no waiting: a wrong optimistic guess keeps requests with
    /// their prefix and is corrected by the first observations, a wrong pessimistic one moves
    /// them away and never is. Set 1 to assume one compute-bound prefill batch from the start.
    pub lanes: u32,
    /// How many tokens of observations the prior is worth: the fleet's learned cost moves
    /// away from `prefill_ms_per_token` once the router has seen about this much prefill work.
    pub prior_tokens: f64,
    /// How many tokens of observations the fleet's cost is worth for each endpoint: one
    /// endpoint's cost moves away from the fleet's once it alone has seen about this much.
    /// Replicas of a pool are usually identical, so this is large: the noise in a few
    /// observations must not make one replica look faster and attract every new prefix.
    pub fleet_tokens: f64,
    /// Observations older than about this many tokens of work are forgotten (an exponential
    /// window), so the estimate follows a replica that becomes slower or faster.
    pub window_tokens: f64,
    /// A prefix that starts groups [`RecentRequests::HOT_SHARE`] times faster per endpoint
    /// holding it than the mean endpoint takes requests gets another copy once each endpoint
    /// that holds it has taken more than this many times the mean endpoint's recent requests
    /// ([`RecentRequests`], [`Router`]'s bounded share); 0 turns the bound off, otherwise at
    /// least 1 (so the least busy endpoint is never over it). Consistent hashing with bounded
    /// loads, applied to a hot prefix.
    ///
    /// [`Router`]: crate::Router
    pub balance_factor: f64,
}

impl Default for LatencyConfig {
    fn default() -> Self {
        LatencyConfig {
            prefill_ms_per_token: 0.5,
            min_ms_per_token: 0.001,
            max_ms_per_token: 100.0,
            overhead_ms: 5.0,
            lanes: 256,
            prior_tokens: 2048.0,
            fleet_tokens: 16384.0,
            window_tokens: 65536.0,
            balance_factor: 2.0,
        }
    }
}

impl LatencyConfig {
    /// `ms` within `min_ms_per_token..=max_ms_per_token`: what `f64::clamp` returns whenever
    /// it does not panic. Not `f64::clamp` itself: its panic (bounds out of order or not a
    /// number, which [`Self::validate`] rules out) formats both floats with `Debug`, and that
    /// branch, which the data plane never takes, kept float formatting code in the plugin's
    /// `.wasm` that nothing else needs (docs/benchmarks.md).
    pub fn bounded_ms_per_token(&self, ms: f64) -> f64 {
        let mut ms = ms;
        if ms < self.min_ms_per_token {
            ms = self.min_ms_per_token;
        }
        if ms > self.max_ms_per_token {
            ms = self.max_ms_per_token;
        }
        ms
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = |field, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(out_of_range(field, "a finite number > 0", v))
            }
        };
        positive("latency.min_ms_per_token", self.min_ms_per_token)?;
        positive("latency.max_ms_per_token", self.max_ms_per_token)?;
        positive("latency.prior_tokens", self.prior_tokens)?;
        positive("latency.fleet_tokens", self.fleet_tokens)?;
        positive("latency.window_tokens", self.window_tokens)?;
        if self.min_ms_per_token > self.max_ms_per_token {
            return Err(out_of_range(
                "latency.min_ms_per_token",
                "at most latency.max_ms_per_token",
                self.min_ms_per_token,
            ));
        }
        let prior = self.prefill_ms_per_token;
        if !(prior.is_finite() && (self.min_ms_per_token..=self.max_ms_per_token).contains(&prior))
        {
            return Err(out_of_range(
                "latency.prefill_ms_per_token",
                "between latency.min_ms_per_token and latency.max_ms_per_token",
                prior,
            ));
        }
        if !(self.overhead_ms.is_finite() && (0.0..=60_000.0).contains(&self.overhead_ms)) {
            return Err(out_of_range(
                "latency.overhead_ms",
                "in 0..60000",
                self.overhead_ms,
            ));
        }
        let factor = self.balance_factor;
        if !(factor == 0.0 || (1.0..=100.0).contains(&factor)) {
            return Err(out_of_range(
                "latency.balance_factor",
                "0 (off) or in 1..100",
                factor,
            ));
        }
        if !(1..=MAX_LANES).contains(&self.lanes) {
            return Err(out_of_range(
                "latency.lanes",
                "in 1..4096",
                f64::from(self.lanes),
            ));
        }
        Ok(())
    }
}

/// Lanes beyond this are not believed (a scrape reporting more is garbage or not a queue).
pub const MAX_LANES: u32 = 4096;

/// Time to first byte longer than this is not a prefill observation (an hour: a stalled
/// connection, a suspended process, a clock jump).
pub const MAX_OBSERVED_MS: f64 = 3_600_000.0;

/// Why an observation was not used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum ObservationError {
    #[error("elapsed time is not a finite number of milliseconds above 0")]
    NotPositive,
    #[error("elapsed time is longer than an hour")]
    TooLong,
    #[error("predicted work is not a finite number of tokens")]
    BadWork,
    #[error("time between a group's requests is negative or not a finite number of milliseconds")]
    BadGap,
}

/// What the router saw of one request: the endpoint's backlog when it was sent, its own
/// uncached tokens, the model the prediction used, and the time from sending it to its first
/// response byte.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    pub backlog: Backlog,
    pub uncached_tokens: f64,
    /// Cost per token, lanes and hold time the prediction used.
    pub ms_per_token: f64,
    pub lanes: u32,
    pub hold_ms: f64,
    pub elapsed_ms: f64,
}

impl Observation {
    /// What a request routed with `prediction` would tell, once its first byte came back after
    /// `elapsed_ms`.
    pub fn of(prediction: &Prediction, elapsed_ms: f64) -> Self {
        Observation {
            backlog: prediction.backlog,
            uncached_tokens: prediction.uncached_tokens as f64,
            ms_per_token: prediction.ms_per_token,
            lanes: prediction.lanes,
            hold_ms: prediction.hold_ms,
            elapsed_ms,
        }
    }

    /// The prefill work the request waited for and computed, by the prediction's model.
    pub fn work_tokens(&self) -> f64 {
        self.uncached_tokens + self.backlog.queue(self.lanes, self.hold_ms).tokens
    }

    /// The time it waited for lanes held by decoding, by the prediction's model.
    pub fn hold_wait_ms(&self) -> f64 {
        self.backlog.queue(self.lanes, self.hold_ms).hold_ms
    }

    pub fn check(&self) -> Result<(), ObservationError> {
        if !(self.elapsed_ms.is_finite() && self.elapsed_ms > 0.0) {
            return Err(ObservationError::NotPositive);
        }
        if self.elapsed_ms > MAX_OBSERVED_MS {
            return Err(ObservationError::TooLong);
        }
        let finite = |v: f64| v.is_finite() && v >= 0.0;
        if !(finite(self.uncached_tokens)
            && finite(self.backlog.holders)
            && finite(self.backlog.pending_tokens)
            && finite(self.backlog.prefilling)
            && finite(self.backlog.decoding)
            && finite(self.hold_ms)
            && finite(self.ms_per_token))
        {
            return Err(ObservationError::BadWork);
        }
        Ok(())
    }
}

/// An endpoint's learned prefill cost, as two decayed sums.
///
/// The estimator is a ratio of sums, `Σ busy ms / Σ work tokens`, over a window of recent
/// observations, where busy = elapsed − overhead and work = the tokens the request was
/// predicted to wait for plus its own uncached tokens. A ratio of sums, unlike a mean of
/// per-request ratios, weighs each observation by its work: a fully cached request (a few
/// tokens, a few ms of noise) barely moves it, a cold 4,000-token prompt moves it a lot.
///
/// Each endpoint's estimate is shrunk towards the fleet's (see [`estimate_rates`]): the
/// fleet's pooled observations, themselves starting from the configured prior with a weight
/// of `prior_tokens`, are worth `fleet_tokens` of pseudo-work for every endpoint. So a replica
/// the router has not observed yet costs what the fleet costs, not the configured guess
/// (which would make it look faster or slower than the replicas it has seen, and attract or
/// repel traffic for no reason), and a replica that really is slower moves away from the fleet
/// as its own evidence grows. The results are clamped to the configured bounds. With
/// non-streaming responses the first byte comes after decoding, so the learned cost includes
/// decode time; it is then an effective cost per prefill token, which is what ranking
/// endpoints needs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PrefillRate {
    pub busy_ms: f64,
    pub work_tokens: f64,
}

impl PrefillRate {
    pub fn usable(&self) -> bool {
        let (busy, work) = (self.busy_ms, self.work_tokens);
        busy.is_finite() && work.is_finite() && busy >= 0.0 && work >= 0.0
    }

    /// Milliseconds per uncached token from these observations, shrunk towards `prior` (ms
    /// per token) with a weight of `weight_tokens`, clamped to the bounds.
    pub fn ms_per_token_towards(
        &self,
        prior: f64,
        weight_tokens: f64,
        config: &LatencyConfig,
    ) -> f64 {
        let prior = config.bounded_ms_per_token(prior);
        if !self.usable() {
            return prior;
        }
        let estimate = (self.busy_ms + prior * weight_tokens) / (self.work_tokens + weight_tokens);
        config.bounded_ms_per_token(estimate)
    }

    /// Milliseconds per uncached token from these observations and the configured prior.
    pub fn ms_per_token(&self, config: &LatencyConfig) -> f64 {
        self.ms_per_token_towards(config.prefill_ms_per_token, config.prior_tokens, config)
    }

    /// Adds an observation; an unusable one (zero, negative, hours, not a number) changes
    /// nothing and says why, for the caller to count.
    pub fn observe(
        &mut self,
        observation: Observation,
        config: &LatencyConfig,
    ) -> Result<(), ObservationError> {
        observation.check()?;
        let busy =
            (observation.elapsed_ms - config.overhead_ms - observation.hold_wait_ms()).max(0.0);
        self.busy_ms += busy;
        self.work_tokens += observation.work_tokens();
        if self.work_tokens > config.window_tokens {
            // Exponential forgetting by work, not by count: scale both sums back to the window.
            let keep = config.window_tokens / self.work_tokens;
            self.busy_ms *= keep;
            self.work_tokens *= keep;
        }
        if !(self.busy_ms.is_finite() && self.work_tokens.is_finite()) {
            *self = PrefillRate::default();
        }
        Ok(())
    }
}

/// Every endpoint's cost per token: its own evidence shrunk towards the fleet's pooled
/// evidence, which is shrunk towards the configured prior (see [`PrefillRate`]). Unusable
/// (corrupt) sums count as no evidence.
pub fn estimate_rates(rates: &[PrefillRate], config: &LatencyConfig) -> Vec<f64> {
    let pooled = rates
        .iter()
        .filter(|r| r.usable())
        .fold(PrefillRate::default(), |acc, r| PrefillRate {
            busy_ms: acc.busy_ms + r.busy_ms,
            work_tokens: acc.work_tokens + r.work_tokens,
        });
    let fleet = pooled.ms_per_token(config);
    rates
        .iter()
        .map(|r| r.ms_per_token_towards(fleet, config.fleet_tokens, config))
        .collect()
}

/// The lane counts the router chooses between (see [`LaneFit`]).
pub const LANE_MODELS: [u32; 8] = [1, 2, 4, 8, 16, 32, 64, 256];

/// Which queue model explains an endpoint's first bytes best.
///
/// How much a request waits for the prefill work ahead of it depends on the server: vLLM runs
/// prefill as one compute-bound batch, so a request waits for all of it (one lane); a server
/// that runs sequences independently makes it wait only when every lane is busy. The scrape
/// cannot tell them apart (vLLM reports hundreds of running sequences that still share one
/// GPU), the first bytes can: for every observation the router replays the prediction under
/// each lane count in [`LANE_MODELS`], and adds to each model its *excess* squared log error
/// over the best model for that observation. An observation with nothing ahead predicts the
/// same under every model and adds nothing; one with a backlog separates them. The sums decay,
/// so the fit follows a server that changes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LaneFit {
    pub excess: [f64; LANE_MODELS.len()],
}

/// How fast a [`LaneFit`] forgets: each observation keeps this share of the old evidence.
const LANE_FIT_KEEP: f64 = 0.98;

/// Excess error within which a model counts as good as the best: half the squared log error
/// of one request that took 2× (or ½) its prediction.
const LANE_FIT_TOLERANCE: f64 = 0.5 * std::f64::consts::LN_2 * std::f64::consts::LN_2;

impl LaneFit {
    /// Adds an observation (already checked) to every model's excess error.
    fn observe(&mut self, observation: &Observation, config: &LatencyConfig) {
        let obs = observation.elapsed_ms;
        let errors = LANE_MODELS.map(|lanes| {
            let wait = observation.backlog.queue(lanes, observation.hold_ms);
            let predicted = config.overhead_ms
                + observation.ms_per_token * (observation.uncached_tokens + wait.tokens)
                + wait.hold_ms;
            // libm's log, as `decay`'s exp: the same bits natively and in the plugin.
            let miss = libm::log(predicted.max(1e-3) / obs);
            miss * miss
        });
        let best = errors.iter().copied().fold(f64::INFINITY, f64::min);
        for (excess, error) in self.excess.iter_mut().zip(errors) {
            *excess = *excess * LANE_FIT_KEEP + (error - best);
            if !excess.is_finite() {
                *excess = 0.0;
            }
        }
    }
}

/// The lane counts, up to the configured `lanes`, whose excess error pooled over every
/// endpoint is within a tolerance of the best model's: the fewest and the most of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlausibleLanes {
    /// The fleet's lane count, what every prediction assumes: the most lanes not ruled out.
    ///
    /// Why the most: observations with `k` requests ahead cannot tell `k + 1` lanes from 256,
    /// and the choice decides what the router will see next. Assuming few lanes makes it avoid
    /// stacking requests, so it never observes whether more would have run at once: the
    /// mistake confirms itself. Assuming many makes it stack requests where the prefix is, and
    /// if that was wrong their first bytes say so and the fit moves down: the mistake corrects
    /// itself, and in the meantime it errs towards locality.
    pub most: u32,
    /// The fewest lanes not ruled out: with no evidence, one; once requests were seen to run
    /// `k` at a time without waiting, the next model above `k`. What a request that no
    /// endpoint holds is priced with ([`Prediction::with_caution`]).
    pub fewest: u32,
}

/// Which lane counts the first bytes pooled in `fits` have not ruled out ([`PlausibleLanes`]).
pub fn estimate_lanes(fits: &[LaneFit], config: &LatencyConfig) -> PlausibleLanes {
    let mut pooled = [0.0f64; LANE_MODELS.len()];
    for fit in fits {
        for (sum, e) in pooled.iter_mut().zip(fit.excess) {
            if e.is_finite() && e >= 0.0 {
                *sum += e;
            }
        }
    }
    let cap = config.lanes.clamp(1, MAX_LANES);
    let allowed = |l: u32| l <= cap;
    let least = LANE_MODELS
        .iter()
        .zip(pooled)
        .filter(|&(&l, _)| allowed(l))
        .map(|(_, e)| e)
        .fold(f64::INFINITY, f64::min);
    // LANE_MODELS ascend: the first plausible model is the fewest, the last the most.
    let (fewest, most) = LANE_MODELS
        .iter()
        .zip(pooled)
        .filter(|&(&l, e)| allowed(l) && e <= least + LANE_FIT_TOLERANCE)
        .fold((None, 1), |(fewest, _), (&l, _)| (fewest.or(Some(l)), l));
    let most = most.min(cap);
    PlausibleLanes {
        most,
        fewest: fewest.unwrap_or(1).min(most),
    }
}

/// What the router learns from first bytes: every endpoint's prefill rate and the fleet's
/// lane fit. A proxy keeps one per worker and adds them up (see [`LearnedModel::add`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LearnedModel {
    pub rates: Vec<PrefillRate>,
    pub lanes: LaneFit,
    pub hold: HoldTime,
}

/// The fleet's mean lane hold after a first byte (a request decoding), as decayed sums. With
/// non-streaming responses the first byte is the end, and it is about zero: the prefill cost
/// learned from those first bytes includes decoding instead.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct HoldTime {
    pub ms: f64,
    pub count: f64,
}

impl HoldTime {
    pub fn mean_ms(&self) -> f64 {
        if self.count > 1e-9 && self.ms.is_finite() && self.ms >= 0.0 {
            self.ms / self.count
        } else {
            0.0
        }
    }

    fn observe(&mut self, ms: f64) -> Result<(), ObservationError> {
        if !(ms.is_finite() && ms >= 0.0) {
            return Err(ObservationError::NotPositive);
        }
        if ms > MAX_OBSERVED_MS {
            return Err(ObservationError::TooLong);
        }
        self.ms = self.ms * LANE_FIT_KEEP + ms;
        self.count = self.count * LANE_FIT_KEEP + 1.0;
        Ok(())
    }
}

/// What [`LearnedModel::estimate`] gives a decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    pub ms_per_token: Vec<f64>,
    pub lanes: u32,
    /// The fewest lanes not ruled out ([`PlausibleLanes::fewest`]).
    pub fewest_lanes: u32,
    pub hold_ms: f64,
}

impl Estimate {
    /// Puts what was learned into one endpoint's inputs: its cost per token (the prior if it
    /// has none), the fleet's lanes and hold time.
    pub fn apply_to(&self, endpoint: usize, inputs: &mut LatencyInputs) {
        inputs.ms_per_token = self.ms_per_token.get(endpoint).copied();
        inputs.lanes = Some(self.lanes);
        inputs.fewest_lanes = Some(self.fewest_lanes);
        inputs.hold_ms = Some(self.hold_ms);
    }
}

impl LearnedModel {
    pub fn new(endpoints: usize) -> Self {
        LearnedModel {
            rates: vec![PrefillRate::default(); endpoints],
            lanes: LaneFit::default(),
            hold: HoldTime::default(),
        }
    }

    /// Learns how long a request held its lane after its first byte.
    pub fn observe_hold(&mut self, ms: f64) -> Result<(), ObservationError> {
        self.hold.observe(ms)
    }

    /// Learns from one first byte of a request to `endpoint`; an unusable observation changes
    /// nothing and says why.
    pub fn observe(
        &mut self,
        endpoint: usize,
        observation: Observation,
        config: &LatencyConfig,
    ) -> Result<(), ObservationError> {
        let Some(rate) = self.rates.get_mut(endpoint) else {
            return Err(ObservationError::BadWork);
        };
        rate.observe(observation, config)?;
        self.lanes.observe(&observation, config);
        Ok(())
    }

    /// Adds another learner's evidence (another worker's): the sums simply add up. Corrupt
    /// (non-finite or negative) sums are left out.
    pub fn add(&mut self, other: &LearnedModel) {
        if self.rates.len() < other.rates.len() {
            self.rates.resize(other.rates.len(), PrefillRate::default());
        }
        for (mine, theirs) in self.rates.iter_mut().zip(&other.rates) {
            if theirs.usable() {
                mine.busy_ms += theirs.busy_ms;
                mine.work_tokens += theirs.work_tokens;
            }
        }
        for (mine, theirs) in self.lanes.excess.iter_mut().zip(other.lanes.excess) {
            if theirs.is_finite() && theirs >= 0.0 {
                *mine += theirs;
            }
        }
        let h = other.hold;
        if h.ms.is_finite() && h.ms >= 0.0 && h.count.is_finite() && h.count >= 0.0 {
            self.hold.ms += h.ms;
            self.hold.count += h.count;
        }
    }

    /// Every endpoint's cost per token, the fleet's lanes and hold time.
    pub fn estimate(&self, config: &LatencyConfig) -> Estimate {
        let lanes = estimate_lanes(&[self.lanes], config);
        Estimate {
            ms_per_token: estimate_rates(&self.rates, config),
            lanes: lanes.most,
            fewest_lanes: lanes.fewest,
            hold_ms: self.hold.mean_ms(),
        }
    }
}

/// The router's own requests on one endpoint, summed over every worker: all that are in
/// flight (each holds a lane until its stream ends) and, of those, the ones whose first
/// response byte has not come back, with the uncached tokens predicted for them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointWork {
    pub in_flight: u32,
    pub prefilling: u32,
    pub prefill_tokens: u64,
}

/// How far an endpoint's believed cache is from its server's truth, and the scale that brings
/// it back.
///
/// The router's belief is approximate (it learns only from its own decisions; the plugin's
/// shared index is an approximate LRU), and a belief that promises hits the server no longer
/// has keeps sending requests to a thrashing cache. The server's own counters tell
/// (`vllm:prefix_cache_hits_total / queries_total`): every scrape interval, its hit rate is
/// compared with the hit rate the router predicted for the requests it sent there
/// (`Prediction::cached_tokens / prompt tokens`), both as decayed sums. Rates, not totals, so
/// traffic from other gateways does not skew it. When the server hits less than predicted,
/// the believed capacity is scaled down (multiplicatively, by the square root of the ratio,
/// so it settles instead of overshooting), and back up, never above the real capacity, when
/// the belief promises no more than the server delivers.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    pub scale: f64,
    pub served_hits: f64,
    pub served_queries: f64,
    pub predicted_hits: f64,
    pub predicted_queries: f64,
}

impl Default for Calibration {
    fn default() -> Self {
        Calibration {
            scale: 1.0,
            served_hits: 0.0,
            served_queries: 0.0,
            predicted_hits: 0.0,
            predicted_queries: 0.0,
        }
    }
}

/// `capacity_blocks` scaled by a calibration (clamped to `MIN_CALIBRATION..=1`; garbage is 1).
pub fn scaled_capacity(capacity_blocks: usize, scale: f64) -> usize {
    let scale = if scale.is_finite() {
        scale.clamp(MIN_CALIBRATION, 1.0)
    } else {
        1.0
    };
    ((capacity_blocks as f64 * scale).round() as usize).max(1)
}

/// Each interval keeps this share of the older evidence (a memory of a few intervals).
const CALIBRATION_KEEP: f64 = 0.5;
/// The belief never shrinks below this share of the real capacity.
pub const MIN_CALIBRATION: f64 = 0.25;
/// Prompt tokens of evidence (each side) below which the scale is left alone.
const CALIBRATION_MIN_TOKENS: f64 = 2048.0;
/// Predicted and served hit rates within this ratio of each other agree.
const CALIBRATION_TOLERANCE: f64 = 0.9;

impl Calibration {
    /// One scrape interval: the server's hit and query tokens since the last one, and the
    /// hit (cached) and prompt tokens the router predicted for what it sent there. Negative
    /// or non-finite deltas (a restart, a reset counter, a worker that went away) are no
    /// evidence.
    pub fn observe(
        &mut self,
        served_hits: f64,
        served_queries: f64,
        predicted_hits: f64,
        predicted_queries: f64,
    ) {
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        if !(ok(served_hits) && ok(served_queries) && ok(predicted_hits) && ok(predicted_queries))
            || served_hits > served_queries
        {
            return;
        }
        self.served_hits = self.served_hits * CALIBRATION_KEEP + served_hits;
        self.served_queries = self.served_queries * CALIBRATION_KEEP + served_queries;
        self.predicted_hits = self.predicted_hits * CALIBRATION_KEEP + predicted_hits;
        self.predicted_queries = self.predicted_queries * CALIBRATION_KEEP + predicted_queries;
        if self.served_queries < CALIBRATION_MIN_TOKENS
            || self.predicted_queries < CALIBRATION_MIN_TOKENS
            || self.predicted_hits <= 0.0
        {
            return;
        }
        let served = self.served_hits / self.served_queries;
        let predicted = self.predicted_hits / self.predicted_queries;
        let ratio = served / predicted;
        let step = if ratio < CALIBRATION_TOLERANCE {
            ratio.sqrt()
        } else if ratio > 1.0 / CALIBRATION_TOLERANCE || self.scale < 1.0 {
            // Agreeing again (or the belief is pessimistic): grow back towards the real size.
            ratio.max(1.0).sqrt().max(1.1)
        } else {
            1.0
        };
        let scale = self.scale * step;
        self.scale = if scale.is_finite() {
            scale.clamp(MIN_CALIBRATION, 1.0)
        } else {
            1.0
        };
    }

    /// The believed capacity for a real one of `capacity_blocks`.
    pub fn capacity(&self, capacity_blocks: usize) -> usize {
        scaled_capacity(capacity_blocks, self.scale)
    }
}

/// A router's account of its own requests per endpoint ([`EndpointWork`]) and what it learns
/// from their first bytes ([`LearnedModel`]): a request is *sent* with the uncached tokens
/// predicted for it, its *first byte* releases that prefill work (and teaches the model), and
/// it is *done* when its stream ends. Every release saturates at zero, so a duplicate or
/// stray release cannot underflow the account.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestLedger {
    pub work: Vec<EndpointWork>,
    pub learned: LearnedModel,
    /// Per endpoint, since the start: prompt tokens sent and how many of them were predicted
    /// cached (what [`Calibration`] compares with the server's counters).
    pub sent: Vec<SentTokens>,
}

/// Prompt tokens a router sent to one endpoint, and how many it predicted cached there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SentTokens {
    pub prompt: u64,
    pub predicted_cached: u64,
}

impl RequestLedger {
    pub fn new(endpoints: usize) -> Self {
        RequestLedger {
            work: vec![EndpointWork::default(); endpoints],
            learned: LearnedModel::new(endpoints),
            sent: vec![SentTokens::default(); endpoints],
        }
    }

    /// The same account over a changed pool: `previous[new]` is the index endpoint `new` had
    /// before (`None` for a newcomer, which starts empty). Endpoints that left take their work
    /// and their learned rates with them; the fleet-wide fits stay.
    pub fn remapped(&self, previous: &[Option<usize>]) -> RequestLedger {
        let mut next = RequestLedger::new(previous.len());
        next.learned.lanes = self.learned.lanes;
        next.learned.hold = self.learned.hold;
        for (new, old) in previous.iter().enumerate() {
            let Some(old) = *old else { continue };
            if let Some(w) = self.work.get(old) {
                next.work[new] = *w;
            }
            if let Some(s) = self.sent.get(old) {
                next.sent[new] = *s;
            }
            if let Some(r) = self.learned.rates.get(old) {
                next.learned.rates[new] = *r;
            }
        }
        next
    }

    /// A request went to `endpoint` with the prediction the router made for it there.
    pub fn sent(&mut self, endpoint: usize, prediction: &Prediction) {
        let uncached = prediction.uncached_tokens as u64;
        if let Some(w) = self.work.get_mut(endpoint) {
            w.in_flight = w.in_flight.saturating_add(1);
            w.prefilling = w.prefilling.saturating_add(1);
            w.prefill_tokens = w.prefill_tokens.saturating_add(uncached);
        }
        if let Some(s) = self.sent.get_mut(endpoint) {
            let cached = prediction.cached_tokens as u64;
            s.prompt = s.prompt.saturating_add(cached + uncached);
            s.predicted_cached = s.predicted_cached.saturating_add(cached);
        }
    }

    /// The first byte of a request sent with `uncached_tokens`; with an observation the model
    /// learns from it (`Err` says why it was refused; the work is released either way).
    pub fn first_byte(
        &mut self,
        endpoint: usize,
        uncached_tokens: u64,
        observation: Option<Observation>,
        config: &LatencyConfig,
    ) -> Result<(), ObservationError> {
        if let Some(w) = self.work.get_mut(endpoint) {
            w.prefilling = w.prefilling.saturating_sub(1);
            w.prefill_tokens = w.prefill_tokens.saturating_sub(uncached_tokens);
        }
        match observation {
            Some(o) => self.learned.observe(endpoint, o, config),
            None => Ok(()),
        }
    }

    /// The stream ended; `prefill_pending` are its uncached tokens if its first byte never
    /// came (a reset, a client that went away); `hold_ms`, for a request answered normally,
    /// how long it held its lane after its first byte (`Err` if that was absurd).
    pub fn done(
        &mut self,
        endpoint: usize,
        prefill_pending: Option<u64>,
        hold_ms: Option<f64>,
    ) -> Result<(), ObservationError> {
        if let Some(w) = self.work.get_mut(endpoint) {
            w.in_flight = w.in_flight.saturating_sub(1);
            if let Some(tokens) = prefill_pending {
                w.prefilling = w.prefilling.saturating_sub(1);
                w.prefill_tokens = w.prefill_tokens.saturating_sub(tokens);
            }
        }
        match hold_ms {
            Some(ms) => self.learned.observe_hold(ms),
            None => Ok(()),
        }
    }
}

/// What an endpoint's last fresh scrape says about its queue.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ServerQueue {
    pub waiting: f64,
    pub running: f64,
    /// The router's own requests in flight there when it first saw this scrape: those the
    /// scrape's counts include of its own. `None`: the scrape is current (a simulator's), its
    /// own are the ones in flight now. A scrape is up to an interval old (a second by
    /// default) and requests last a fraction of that: counted against the requests in flight
    /// *now*, every request that ended since looked like another gateway's, and the router
    /// saw queues that were gone (a hot tenant with decode time: TTFT p50 86 ms against 14 ms
    /// with 100 ms scrapes, docs/benchmarks.md).
    #[serde(default)]
    pub sent_then: Option<u32>,
}

/// The per-endpoint inputs of a prediction besides the request: its work, its scrape, and
/// its learned model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencyInputs {
    pub work: EndpointWork,
    /// `None` when the endpoint has no fresh scrape: only the router's own work counts.
    pub server: Option<ServerQueue>,
    /// `None` = not learned yet: the configured prior.
    pub ms_per_token: Option<f64>,
    /// `None` = not learned yet: the configured prior.
    pub lanes: Option<u32>,
    /// The fewest lanes the first bytes have not ruled out ([`PlausibleLanes::fewest`]);
    /// `None`: no caution ([`Prediction::with_caution`]).
    pub fewest_lanes: Option<u32>,
    /// Mean time a request holds its lane after its first byte (decoding); `None` = 0.
    pub hold_ms: Option<f64>,
}

/// One endpoint's predicted time to first token for one request, and why.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Prompt tokens the endpoint would reuse (believed), by the server's rules.
    pub cached_tokens: usize,
    pub uncached_tokens: usize,
    /// What held the endpoint's lanes, and the lane count and hold time the prediction assumed.
    pub backlog: Backlog,
    pub lanes: u32,
    pub hold_ms: f64,
    /// Requests ahead of this one that must finish before it gets a lane.
    pub queue_requests: f64,
    /// Prefill tokens the request is predicted to wait for, and decode time.
    pub queue_tokens: f64,
    pub queue_hold_ms: f64,
    pub queue_ms: f64,
    pub ms_per_token: f64,
    pub ttft_ms: f64,
    /// Where requests queue, how much this one's prefill delays those behind it.
    pub delay_to_others_ms: f64,
    /// Blocks of the request the endpoint does not hold.
    pub new_blocks: usize,
    /// Of those, the ones its cache has no free room for: placing it there evicts them now.
    pub evicted_blocks: usize,
    /// Blocks the groups already living on the endpoint are expected to add (see
    /// [`Footprint::growing_blocks`]): counted as taken when pricing room.
    #[serde(default)]
    pub growing_blocks: f64,
    /// Blocks priced for the room they take: (new + expected later) × the cache's pressure
    /// ([`CacheRoom::pressure_with`]), counting the growing blocks as taken.
    pub room_blocks: f64,
    pub room_ms: f64,
    /// What a copy of the request's prefix here would save the requests that share it and
    /// queue where it is held ([`copy_credit_ms`]); 0 where it continues or holds the most.
    #[serde(default)]
    pub copy_credit_ms: f64,
    /// What the request would wait for beyond `queue_ms` if the endpoint had only the fewest
    /// lanes not ruled out ([`Prediction::with_caution`]); 0 unless no endpoint holds any of it.
    #[serde(default)]
    pub caution_ms: f64,
    /// What the router minimises: TTFT + delay to others + room − copy credit + caution.
    pub cost_ms: f64,
}

impl Prediction {
    /// The same prediction with a copy credit ([`copy_credit_ms`]) taken off its cost.
    pub fn with_copy_credit(mut self, credit_ms: f64) -> Prediction {
        let credit = if credit_ms.is_finite() {
            credit_ms.max(0.0)
        } else {
            0.0
        };
        self.cost_ms = self.cost_ms + self.copy_credit_ms - credit;
        self.copy_credit_ms = credit;
        self
    }

    /// The same prediction priced with caution: its cost adds, beyond the predicted wait, the
    /// work already on the endpoint spread over `fewest_lanes` lanes (the fewest the first
    /// bytes have not ruled out): the wait a request would have if that work shared the lanes
    /// evenly, as one compute-bound prefill batch does.
    ///
    /// For a request no endpoint holds any of. The lane fit believes the most lanes it cannot
    /// rule out ([`PlausibleLanes::most`]) because stacking requests where their prefix is errs
    /// towards locality and corrects itself from first bytes. A request with nothing cached
    /// anywhere gains no locality by stacking, and a burst of them (a replica went away and its
    /// groups look for homes; a batch of new conversations) is placed before any first byte
    /// comes back: each sees no wait behind the others' prefills and all go where the
    /// learned cost per token is a few percent lower, until the real lanes run out.
    ///
    /// Why the work spread over the lanes and not the wait for a lane: a lane that is free now
    /// is not free for the whole prefill. Stacked cold prefills take an endpoint's lanes for
    /// their whole length, and the requests of the groups living there that arrive meanwhile
    /// find them taken (measured in docs/benchmarks.md: after a scale-in at 1 ms/token, four
    /// displaced tenants' 770 ms prefills went to one replica whose fewest plausible lanes
    /// were 4, each seeing a free lane; its own tenants' requests then waited up to 340 ms,
    /// and it ended up holding more system prompts than its cache). Spread over the lanes,
    /// each cold prefill in flight prices the next one a share of its length, so a burst
    /// spreads by the prefill work in flight: a share of a prefill, not the few percent the
    /// learned rates differ by.
    pub fn with_caution(mut self, fewest_lanes: u32) -> Prediction {
        let fewest = fewest_lanes.clamp(1, self.lanes.max(1));
        let waited = self
            .backlog
            .spread_ms(fewest, self.ms_per_token, self.hold_ms);
        let caution = waited - self.queue_ms;
        let caution = if caution.is_finite() {
            caution.max(0.0)
        } else {
            0.0
        };
        self.cost_ms = self.cost_ms - self.caution_ms + caution;
        self.caution_ms = caution;
        self
    }
}

/// What a second copy of a queued prefix saves, credited to an endpoint that would make it.
///
/// A request priced alone never pays for a copy that all later requests of its prefix would
/// gain from: where one replica holds a hot prefix and queues, each request would rather wait
/// (tens of ms) than prefill the whole prefix elsewhere (hundreds), until the wait is as long
/// as that prefill. Measured on the sweep's hot tenant at 1 ms/token: its first 30 requests
/// queued up to 270 ms before one paid for the second copy (docs/benchmarks.md).
///
/// The credit is what the copy saves the requests that will share the prefix while the
/// holder's queue lasts. By Little's law, the prefix's requests waiting at the holder are its
/// rate times the wait: `starts_per_s` (how often requests start a group on this prefix, per
/// replica that holds it, [`PrefixRates`]; a continuation needs its own history, which a copy
/// does not hold) times the holder's queue. With a second copy they split between the two,
/// and each saves about half the difference between the holder's wait and the candidate's.
/// That counts a queue seen now; the copy is ready only after its own prefill, and it helps
/// only if the queue is still there. A queue the prefix makes itself persists as long as its
/// requests keep the holder's lanes busy: the sharers are weighted by that utilization (the
/// prefix's rate × a request's lane time at the holder / its lanes, at most 1; M/M/1's chance
/// to wait), so a queue left by a burst of other work, or one a further copy would hardly
/// shorten, earns little (measured in docs/benchmarks.md: without it, the hot tenant got four
/// copies in its first second and other tenants' prompts were pushed out).
///
/// Only where the candidate has a free lane: where it queues too, a copy moves the queue
/// rather than removes it, and the whole prefill it costs delays the candidate's own requests.
/// Only a group's first request earns the credit (see the router), for the reason above.
pub fn copy_credit_ms(holder: &Prediction, candidate: &Prediction, starts_per_s: f64) -> f64 {
    if candidate.queue_requests > 0.0 {
        return 0.0;
    }
    let lane_ms = holder.uncached_tokens as f64 * holder.ms_per_token + holder.hold_ms;
    let busy = (starts_per_s * lane_ms / 1000.0 / f64::from(holder.lanes.max(1))).clamp(0.0, 1.0);
    let sharers = starts_per_s * holder.queue_ms / 1000.0 * busy;
    let saved = holder.queue_ms - candidate.queue_ms;
    if sharers.is_finite() && sharers > 0.0 && saved.is_finite() && saved > 0.0 {
        0.5 * sharers * saved
    } else {
        0.0
    }
}

/// The requests the router sent each endpoint lately, as exponentially decayed counts with a
/// time constant of [`Self::WINDOW_MS`]: what a hot prefix's bounded share compares
/// ([`crate::Router`], `latency.balance_factor`).
///
/// Counted by this router (a proxy worker counts its own requests; its share of the fleet's
/// is a random sample, so the ratios hold).
///
/// The counting is [`LiveGroups`]' (a share of 1 per request, decayed over the window), so
/// the plugin carries one copy of it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RecentRequests(LiveGroups);

impl RecentRequests {
    /// The counts' time constant, ms: [`PrefixRates::WINDOW_MS`], so that a prefix's count
    /// and an endpoint's compare.
    pub const WINDOW_MS: f64 = PrefixRates::WINDOW_MS;

    pub fn new(endpoints: usize) -> Self {
        RecentRequests(LiveGroups::new(endpoints))
    }

    /// The decayed count of requests sent to `endpoint`, as of `now_ms`.
    pub fn count(&self, endpoint: usize, now_ms: f64) -> f64 {
        self.0.on(endpoint, now_ms, Self::WINDOW_MS)
    }

    /// Every endpoint's [`Self::count`] as of `now_ms`, decayed with one `exp`.
    pub fn counts_at(&self, now_ms: f64) -> LiveAt<'_> {
        self.0.at(now_ms, Self::WINDOW_MS)
    }

    /// One request sent to `endpoint` at `now_ms`.
    pub fn record(&mut self, endpoint: usize, now_ms: f64) {
        self.0.observe(endpoint, 1.0, now_ms, Self::WINDOW_MS);
    }

    /// No requests on `endpoints` endpoints, as of `now_ms`: where [`Self::add`] sums counts.
    pub fn reset(&mut self, endpoints: usize, now_ms: f64) {
        self.0.count.clear();
        self.0.count.resize(endpoints, 0.0);
        self.0.at_ms = now_ms;
    }

    /// `count` requests on `endpoint` at `at_ms` (the counts move on to `at_ms` if it is later).
    pub fn record_many(&mut self, endpoint: usize, count: f64, at_ms: f64) {
        self.0.advance(at_ms, Self::WINDOW_MS);
        self.add(endpoint, count, at_ms);
    }

    /// Adds another router's count on `endpoint`, as it was at `counted_at_ms`, decayed to
    /// this one's instant (a count that is not a finite non-negative number adds nothing).
    pub fn add(&mut self, endpoint: usize, count: f64, counted_at_ms: f64) {
        if !counted_at_ms.is_finite() {
            return;
        }
        let keep = self.keep_since(counted_at_ms);
        self.add_kept(endpoint, count, keep);
    }

    /// What of a count taken at `counted_at_ms` is left at this one's instant: one `exp` for
    /// all the counts another router took at once ([`Self::add_kept`]).
    pub fn keep_since(&self, counted_at_ms: f64) -> f64 {
        decay(self.0.at_ms - counted_at_ms, Self::WINDOW_MS)
    }

    /// [`Self::add`] of a count whose decay is `keep` ([`Self::keep_since`] its instant).
    pub fn add_kept(&mut self, endpoint: usize, count: f64, keep: f64) {
        if !(count.is_finite() && count > 0.0) {
            return;
        }
        if let Some(v) = self.0.count.get_mut(endpoint) {
            *v += count * keep;
        }
    }

    /// How much busier than the mean endpoint a prefix must be, per endpoint holding it, to be
    /// bounded: half again a fair share. At 1 (any prefix over a fair share) the sweep's RAG
    /// documents (8 over 6 replicas, some a little busier than the rest) got copies they did
    /// not need (hit rate 100% → 99.6–99.7% of the bound's over 8 seeds; with three
    /// gateways TTFT p95 31.7× → 36.0× the bound's); at 2 the hot tenant's copy came later
    /// (TTFT p95 at 0.5 ms/token 1.04× → 1.12× the bound's), docs/benchmarks.md.
    pub const HOT_SHARE: f64 = 1.5;

    /// How far past `balance_factor` × the mean a holder's count must be to be set aside:
    /// half a request. In a router's first handful of requests the bound is a fraction (2 ×
    /// 4/3 requests) and one request decides: an Envoy worker that had seen 4 of the first 7
    /// requests of the demo trace, 3 of them one tenant's, found that tenant hot and its
    /// holder's 3 requests over the bound of 2.67, and copied an even tenant (6 of 32 runs
    /// with two workers; none with one worker, whose sample is every request). With the
    /// slack a holder must be over by a request, less the decay: 0 of 48 runs. The
    /// simulator's single router moves little (docs/benchmarks.md).
    pub const SLACK: f64 = 0.5;
}

/// The requests each endpoint finished lately, every gateway's, from its own counter
/// (`vllm:request_success_total`, read at each scrape), decayed as [`RecentRequests`] are so
/// the two compare. Behind several gateways a router's own counts hold only its own requests:
/// behind session affinity, the few groups it routes look like most of every replica's load
/// (docs/benchmarks.md). A counter that went back (the server restarted) starts a new
/// baseline; the first reading of an endpoint only sets one.
#[derive(Debug, Clone, PartialEq)]
pub struct ServedRequests {
    /// Per endpoint, its counter's last reading, and whether two readings were ever counted.
    last: Vec<(Option<f64>, bool)>,
    recent: RecentRequests,
}

impl ServedRequests {
    pub fn new(endpoints: usize) -> Self {
        ServedRequests {
            last: vec![(None, false); endpoints],
            recent: RecentRequests::new(endpoints),
        }
    }

    /// `endpoint`'s counter read `total` in a scrape taken at `at_ms`. `false` when the
    /// reading is refused (a count that is negative or not a number, or no clock): it changes
    /// nothing. A counter lower than before is a server that restarted, a new baseline. An
    /// endpoint this count does not have is ignored (not bad input: the caller's pool moved).
    pub fn observe(&mut self, endpoint: usize, total: f64, at_ms: f64) -> bool {
        let Some((last, counted)) = self.last.get_mut(endpoint) else {
            return true;
        };
        if !(total >= 0.0 && total.is_finite() && at_ms.is_finite()) {
            return false;
        }
        match *last {
            Some(before) if total >= before => {
                self.recent.record_many(endpoint, total - before, at_ms);
                *counted = true;
            }
            _ => {}
        }
        *last = Some(total);
        true
    }

    /// The counts, where they say more than `own` (the requests this router, or every worker
    /// of its proxy, sent each endpoint lately): every endpoint `eligible` marks has reported
    /// twice (a count for some and none for others would read as those being idle), and
    /// `own` adds up to less than [`Self::OWN_SHARE`] of what the servers finished. A router
    /// that sends most of the fleet's requests keeps its own counts, which are exact and
    /// current; the servers' lag a scrape and a request's length behind (a single gateway's
    /// hot tenant at 1 ms/token: TTFT p95 1.65 → 2.70× the bound's over 8 seeds when they
    /// replaced its own, docs/benchmarks.md).
    pub fn beyond(
        &self,
        own: &RecentRequests,
        eligible: &[bool],
        now_ms: f64,
    ) -> Option<&RecentRequests> {
        let (mut served, mut sent) = (0.0, 0.0);
        for (e, _) in eligible.iter().enumerate().filter(|(_, &ok)| ok) {
            if !self.last.get(e)?.1 {
                return None;
            }
            served += self.recent.count(e, now_ms);
            sent += own.count(e, now_ms);
        }
        (served > 0.0 && sent < Self::OWN_SHARE * served).then_some(&self.recent)
    }

    /// How much of what the servers finished a router's own requests must be for its own
    /// counts to stand for the fleet's: three quarters. One gateway's own run ahead of the
    /// servers' (they count a request when it ends); two gateways alike send half each.
    pub const OWN_SHARE: f64 = 0.75;
}

/// How often requests start a group on each shared prefix, per second: the rate the copy
/// credit ([`copy_credit_ms`]) counts the requests that would use a second copy by.
///
/// Keyed by the hash of the prefix's last block (a tenant's system prompt ends at a message
/// boundary, which the index records exactly, so its questions share that block). A
/// direct-mapped table of exponentially decayed counts with a time constant of
/// [`Self::WINDOW_MS`]: the rate is the count over the window's span since the prefix was
/// first seen, `WINDOW × (1 − exp(−age / WINDOW))`, so a prefix seen for half a second is
/// measured over half a second (a hot prefix right after a start is what the credit is for).
/// A prefix whose slot holds a busier one is not counted (its credit stays 0): the busy ones
/// are the ones that matter. Each proxy worker counts the requests it routes; the rates it
/// sees are its share of the fleet's, so with several workers the credit errs low.
#[derive(Debug, Clone)]
pub struct PrefixRates {
    slots: Vec<RateSlot>,
}

/// How many groups a prefix started lately ([`PrefixRates::of`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Starts {
    /// Decayed with [`PrefixRates::WINDOW_MS`], as [`RecentRequests`] counts requests.
    pub count: f64,
    pub per_second: f64,
}

/// One prefix's count in [`PrefixRates`]; hash 0 is an empty slot.
#[derive(Debug, Clone, Copy, Default)]
struct RateSlot {
    hash: u64,
    /// Starts counted, decayed to `at_ms`.
    count: f64,
    /// When the prefix was first counted.
    first_ms: f64,
    at_ms: f64,
}

impl Default for PrefixRates {
    fn default() -> Self {
        PrefixRates {
            slots: vec![RateSlot::default(); Self::SLOTS],
        }
    }
}

impl PrefixRates {
    pub(crate) const SLOTS: usize = 1024;
    /// The counts' time constant, ms.
    pub const WINDOW_MS: f64 = 10_000.0;

    /// The requests that started a group on the prefix ending with block `hash`, as of
    /// `now_ms`: their decayed count, and their rate per second (the count over the window's
    /// span since the prefix was first seen); zeros for one not counted (or a clock that went
    /// back).
    pub fn of(&self, hash: u64, now_ms: f64) -> Starts {
        let slot = match self.slots.get(hash as usize % Self::SLOTS) {
            Some(slot) if slot.hash == hash && hash != 0 => slot,
            _ => return Starts::default(),
        };
        let age = now_ms - slot.first_ms;
        if age.is_nan() || age <= 0.0 {
            return Starts::default();
        }
        let count = slot.count * decay(now_ms - slot.at_ms, Self::WINDOW_MS);
        let span_ms = Self::WINDOW_MS * (1.0 - decay(age, Self::WINDOW_MS));
        let finite = |v: f64| if v.is_finite() { v.max(0.0) } else { 0.0 };
        Starts {
            count: finite(count),
            per_second: finite(count / span_ms * 1000.0),
        }
    }

    /// A request that started a group on the prefix ending with block `hash` at `now_ms`.
    pub fn record(&mut self, hash: u64, now_ms: f64) {
        if hash == 0 || !now_ms.is_finite() {
            return;
        }
        let Some(slot) = self.slots.get_mut(hash as usize % Self::SLOTS) else {
            return;
        };
        let kept = slot.count * decay(now_ms - slot.at_ms, Self::WINDOW_MS);
        if slot.hash == hash {
            slot.count = kept + 1.0;
            slot.at_ms = now_ms.max(slot.at_ms);
        } else if slot.hash == 0 || kept < 1.0 {
            *slot = RateSlot {
                hash,
                count: 1.0,
                first_ms: now_ms,
                at_ms: now_ms,
            };
        }
    }
}

/// A predicted time in whole milliseconds, as the plugin's response headers carry it: rounded
/// half to even like `format!("{:.0}")`, without the float formatter (exact float printing
/// costs the plugin thousands of instructions per header). Not a number reads 0; beyond
/// `i64` saturates.
pub fn whole_ms(ms: f64) -> i64 {
    ms.round_ties_even() as i64
}

/// Prompt tokens a server would reuse given `matched` believed blocks per chain: full
/// blocks only, and never the last prompt token (vLLM computes it for its logits).
pub fn cached_tokens(hashes: &BlockHashes, matched: &[usize]) -> usize {
    let block_size = hashes.block_size.max(1);
    hashes
        .tokens
        .iter()
        .zip(matched)
        .map(|(&tokens, &m)| m.min(tokens.saturating_sub(1) / block_size) * block_size)
        .sum()
}

/// Capacity of one endpoint's cache as the router believes it, in the router's blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheRoom {
    pub capacity_blocks: usize,
    pub believed_blocks: usize,
}

impl CacheRoom {
    pub fn free_blocks(&self) -> usize {
        self.capacity_blocks.saturating_sub(self.believed_blocks)
    }

    /// Free blocks once `growing` more arrive (the groups living there grow), as
    /// [`Self::pressure_with`] counts them: negative when they are promised more than is free.
    /// A growth that is not a number counts as none.
    pub fn free_after(&self, growing: f64) -> f64 {
        let growing = if growing.is_finite() { growing } else { 0.0 };
        self.free_blocks() as f64 - growing
    }

    /// What one more block costs here, in blocks some request will prefill again: the share
    /// `p` of the cache in use once `growing` more blocks arrive, as long as it fits (the
    /// chance the block displaces one that is needed); past full, `2 − 1/p`: every block
    /// displaces a needed one, and its own group's blocks are pushed out before they are
    /// used again with the chance `1 − 1/p`. So an over-full cache still weighs less than a
    /// fuller one (the price stays a gradient where every cache is promised more than it
    /// holds), bounded by 2, and smooth at full.
    pub fn pressure_with(&self, growing: f64) -> f64 {
        if self.capacity_blocks == 0 {
            return 0.0;
        }
        let p = (self.believed_blocks as f64 + growing) / self.capacity_blocks as f64;
        if p.is_nan() || p <= 0.0 {
            0.0
        } else if p <= 1.0 {
            p
        } else {
            2.0 - 1.0 / p
        }
    }
}

/// What holds an endpoint's lanes when a request arrives: requests in flight there, the
/// prefill work of those not yet past their first byte, and how many are past it (decoding).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Backlog {
    pub holders: f64,
    pub pending_tokens: f64,
    /// Holders whose first byte has not come back (they still prefill, then decode).
    pub prefilling: f64,
    /// Holders past their first byte (decoding: about half their hold time is left).
    pub decoding: f64,
}

/// How long a request waits for a lane: how many holders must finish first, and the prefill
/// tokens and the decode (hold) time of theirs it waits for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct QueueWait {
    pub requests: f64,
    pub tokens: f64,
    pub hold_ms: f64,
}

impl Backlog {
    /// The router's own work, plus the requests the scrape shows that the router did not send
    /// (another gateway's: those beyond its own in flight when the scrape was taken, see
    /// [`ServerQueue::sent_then`]): they hold lanes too, with work like the router's own, or
    /// like `own_uncached` when the router has none pending there.
    pub fn of(inputs: &LatencyInputs, own_uncached: usize) -> Backlog {
        let work = inputs.work;
        let unseen = inputs.server.map_or(0.0, |s| {
            let reported = s.waiting.max(0.0) + s.running.max(0.0);
            let own = s.sent_then.unwrap_or(work.in_flight);
            if reported.is_finite() {
                (reported - f64::from(own)).max(0.0)
            } else {
                0.0
            }
        });
        let mean_prefill = if work.prefilling > 0 {
            work.prefill_tokens as f64 / f64::from(work.prefilling)
        } else {
            own_uncached as f64
        };
        let prefilling = f64::from(work.prefilling.min(work.in_flight)) + unseen;
        Backlog {
            holders: f64::from(work.in_flight) + unseen,
            pending_tokens: work.prefill_tokens as f64 + unseen * mean_prefill,
            prefilling,
            decoding: f64::from(work.in_flight.saturating_sub(work.prefilling)),
        }
    }

    /// With `lanes` lanes and a mean lane hold of `hold_ms` after each first byte: if a lane
    /// is free, no wait; otherwise `n − p + 1` of the `n` holders must finish first, each with
    /// its share of the pending prefill work and of the hold time left (all of it for one
    /// still prefilling, about half for one decoding), spread over the `p` lanes. With one lane
    /// and no hold time this is all the prefill work ahead (NVIDIA Dynamo's cost).
    pub fn queue(&self, lanes: u32, hold_ms: f64) -> QueueWait {
        let p = f64::from(lanes.max(1));
        if self.holders < p {
            return QueueWait::default();
        }
        let ahead = self.holders - p + 1.0;
        let share = ahead / (p * self.holders);
        let hold = self.hold_work_ms(hold_ms);
        QueueWait {
            requests: ahead,
            tokens: share * self.pending_tokens,
            hold_ms: share * hold,
        }
    }

    /// The work the holders have left, prefill and decode (as [`Self::queue`] counts them),
    /// spread evenly over `lanes` lanes: a fluid queue's wait. Never below the wait for a lane
    /// of [`Self::queue`] (which waits for a share of it only once every lane is taken).
    pub fn spread_ms(&self, lanes: u32, ms_per_token: f64, hold_ms: f64) -> f64 {
        let work = self.pending_tokens * ms_per_token + self.hold_work_ms(hold_ms);
        work / f64::from(lanes.max(1))
    }

    /// The lane time the holders have left after their first bytes, with a mean hold of
    /// `hold_ms`: all of it for one still prefilling, about half for one decoding.
    fn hold_work_ms(&self, hold_ms: f64) -> f64 {
        hold_ms.max(0.0) * (self.prefilling + 0.5 * self.decoding)
    }
}

/// How requests extend the groups they belong to, learned over the whole fleet: how often a
/// group's first request is followed by another, how often a later one is (see
/// [`crate::index::PrefixStore::continues`] and [`Turn`]), and how many blocks a continuation
/// adds. Conversations continue almost always and grow every turn; tenants' and documents'
/// questions never continue (they share a head, not a history).
///
/// Why two shares and not one: a gateway carries both kinds at once. A single share of
/// continuing requests mixes them: with as many tenants' questions as conversation turns it
/// says 0.5, so a conversation looks two turns long when it is twenty, its growth is not
/// priced, and the router piles conversations next to their shared system prompt until that
/// cache thrashes (measured in docs/benchmarks.md: TTFT p95 5.7× the upper bound). Every first
/// request is a question whose future nobody knows yet; a later request belongs to a group
/// that has already grown, and how such groups go on is learned from them alone.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct GroupGrowth {
    /// Requests that continued no earlier request: their groups' first turns.
    pub first_turns: f64,
    /// Requests that continued a first turn.
    pub second_turns: f64,
    /// Requests that continued a later turn (a group's third request and on).
    pub further_turns: f64,
    /// Blocks the continuing requests added.
    pub added_blocks: f64,
    /// Continuations whose gap was measured (the time since the request they continued).
    pub gaps: f64,
    /// The sum of those gaps, ms.
    pub gap_ms: f64,
    /// First turns too recent to have been followed yet: each counts `exp(−age / gap)`, the
    /// chance its follow-up, if any, is still to come ([`Self::first_share`]).
    pub recent_first: f64,
    /// The instant (ms) `recent_first` is decayed to.
    pub at_ms: f64,
}

/// How fast [`GroupGrowth`] forgets: each request keeps this share of the old evidence
/// (a memory of about fifty requests, so it follows a workload that changes).
const GROWTH_KEEP: f64 = 0.98;

/// The shares are capped so the expected number of further requests of a group stays finite
/// (at most 19).
const MAX_CONTINUATION_SHARE: f64 = 0.95;

impl GroupGrowth {
    /// Learns from one routed request: `continued` is the turn of the request it continued, if
    /// any; `new_blocks` the blocks it added to its group; `now_ms` when it was routed (the
    /// router's clock; one that goes back counts as no time passing).
    pub fn observe(&mut self, continued: Option<Turn>, new_blocks: usize, now_ms: f64) {
        let waiting = decay(now_ms - self.at_ms, self.mean_gap_ms());
        if now_ms > self.at_ms {
            self.at_ms = now_ms;
        }
        self.recent_first *= GROWTH_KEEP * waiting;
        self.first_turns *= GROWTH_KEEP;
        self.second_turns *= GROWTH_KEEP;
        self.further_turns *= GROWTH_KEEP;
        self.added_blocks *= GROWTH_KEEP;
        self.gaps *= GROWTH_KEEP;
        self.gap_ms *= GROWTH_KEEP;
        match continued {
            None => {
                self.first_turns += 1.0;
                self.recent_first += 1.0;
            }
            Some(turn) => {
                match turn {
                    Turn::First => self.second_turns += 1.0,
                    Turn::Later => self.further_turns += 1.0,
                }
                self.added_blocks += new_blocks as f64;
            }
        }
        if ![
            self.first_turns,
            self.second_turns,
            self.further_turns,
            self.added_blocks,
            self.gaps,
            self.gap_ms,
            self.recent_first,
            self.at_ms,
        ]
        .iter()
        .all(|v| v.is_finite())
        {
            *self = GroupGrowth::default();
        }
    }

    /// Adds another router's evidence (a proxy pools every worker's); non-finite or negative
    /// sums count as none.
    pub fn add(&mut self, other: &GroupGrowth) {
        self.first_turns += finite_or_zero(other.first_turns);
        self.second_turns += finite_or_zero(other.second_turns);
        self.further_turns += finite_or_zero(other.further_turns);
        self.added_blocks += finite_or_zero(other.added_blocks);
        self.gaps += finite_or_zero(other.gaps);
        self.gap_ms += finite_or_zero(other.gap_ms);
        // Each as of its own last request; a proxy's workers route within milliseconds of
        // each other, so the sum is taken as of the latest.
        self.recent_first += finite_or_zero(other.recent_first);
        if other.at_ms.is_finite() && other.at_ms > self.at_ms {
            self.at_ms = other.at_ms;
        }
    }

    /// Learns one measured gap: a request continued one sent `gap_ms` before it. Absurd values
    /// (negative, not finite: a clock that went back; beyond [`MAX_GAP_MS`]) are not evidence,
    /// and say why, so that a proxy can count them.
    pub fn observe_gap(&mut self, gap_ms: f64) -> Result<(), ObservationError> {
        if !gap_ms.is_finite() || gap_ms < 0.0 {
            return Err(ObservationError::BadGap);
        }
        if gap_ms > MAX_GAP_MS {
            return Err(ObservationError::TooLong);
        }
        self.gaps += 1.0;
        self.gap_ms += gap_ms;
        Ok(())
    }

    /// The mean time between a request and its group's next one, ms: the measured gaps blended
    /// with a prior ([`PRIOR_GAP_MS`], worth [`PRIOR_GAPS`] gaps). It is how long a request
    /// counts as a live group where it went ([`LiveGroups`]).
    pub fn mean_gap_ms(&self) -> f64 {
        let n = finite_or_zero(self.gaps);
        let sum = finite_or_zero(self.gap_ms);
        ((sum + PRIOR_GAP_MS * PRIOR_GAPS) / (n + PRIOR_GAPS)).clamp(MIN_GAP_MS, MAX_GAP_MS)
    }

    /// Requests that continued an earlier one.
    fn continuations(&self) -> f64 {
        finite_or_zero(self.second_turns) + finite_or_zero(self.further_turns)
    }

    /// The chance that a group's first request is followed by another: second turns over the
    /// first turns of the last ~50 requests that are old enough to have been followed, blended
    /// with a prior ([`PRIOR_FIRST_SHARE`], worth [`PRIOR_FIRST_REQUESTS`] requests) and capped.
    ///
    /// Old enough: a first turn sent a moment ago has had no time to be followed, so it counts
    /// `1 − exp(−age / gap)` of a trial, the chance its follow-up would have come by now
    /// ([`Self::mean_gap_ms`]; the rest is `recent_first`). Without that, right after groups
    /// start (a fleet coming up, a wave of new conversations) the plain share says groups are
    /// short exactly when it matters most where they start, and a heavy prior had to hold it up
    /// for good: on a gateway that also carries questions nobody follows (tenants'), that prior
    /// kept pricing each of them as a conversation to come. Chat is what an OpenAI gateway mostly
    /// carries; the prior says so until there is evidence.
    pub fn first_share(&self) -> f64 {
        let exposed = finite_or_zero(self.first_turns) - finite_or_zero(self.recent_first);
        blend(
            finite_or_zero(self.second_turns),
            exposed.max(0.0),
            PRIOR_FIRST_SHARE,
            PRIOR_FIRST_REQUESTS,
        )
    }

    /// The chance that a later request (one that continued its group) is followed by another:
    /// further turns over all continuations, blended with a prior ([`PRIOR_LATER_SHARE`], worth
    /// [`PRIOR_LATER_REQUESTS`] continuations) and capped.
    ///
    /// Why the prior weighs four times the estimate's memory: the window sees young groups.
    /// While conversations start (the first seconds of a fleet or of a wave) most continuations
    /// in it are second turns whose successors have not come yet, so its share is far below
    /// what the groups will do: 0.5–0.7 in the first seconds of the benchmark traces whose
    /// conversations continue 94% of the time. Under-estimating it is the costly mistake: new
    /// groups pile next to a shared head and thrash its cache later, when moving them costs
    /// their whole history. Over-estimating it spreads new groups over more replicas than they
    /// need, which costs one prefill of the shared head per replica. So evidence moves this
    /// share between about 0.76 and the cap, not below (the weights are compared in
    /// docs/benchmarks.md).
    pub fn later_share(&self) -> f64 {
        blend(
            finite_or_zero(self.further_turns),
            self.continuations(),
            PRIOR_LATER_SHARE,
            PRIOR_LATER_REQUESTS,
        )
    }

    /// The chance that a request is followed by another of its group, given the turn of the
    /// request it `continued`: [`Self::first_share`] for a first request, [`Self::later_share`]
    /// for any other.
    pub fn follow_share(&self, continued: Option<Turn>) -> f64 {
        match Turn::of(continued) {
            Turn::First => self.first_share(),
            Turn::Later => self.later_share(),
        }
    }

    /// A continuation's mean size in blocks, shrunk towards 0 by one continuation's worth
    /// (`added / (continuations + 1)`): 0 before any was seen, so a fleet that carries only
    /// questions nobody follows prices no growth at all, and half the first one's size after
    /// it, so the first conversations of a fleet are not priced on one turn's say. Compared
    /// with the plain mean and with prior sizes in docs/benchmarks.md.
    fn mean_continuation_blocks(&self) -> f64 {
        let continuations = self.continuations();
        finite_or_zero(finite_or_zero(self.added_blocks) / (continuations + 1.0))
    }

    /// Blocks a request's group is expected to add after it: with the chance `f` that it is
    /// followed ([`Self::follow_share`]), then as a group that lives
    /// ([`Self::live_group_blocks`]).
    pub fn future_blocks(&self, continued: Option<Turn>) -> f64 {
        finite_or_zero(self.follow_share(continued) * self.live_group_blocks())
    }

    /// Blocks a group known to live (one that will send another request) is expected to add:
    /// a continuation's mean size times `1 / (1 − q)` continuations, for the later share `q`
    /// (each later request is followed by another with probability `q`).
    pub fn live_group_blocks(&self) -> f64 {
        let q = self.later_share();
        finite_or_zero(self.mean_continuation_blocks() / (1.0 - q))
    }
}

/// `(hits + weight × prior) / (trials + weight)`, capped at [`MAX_CONTINUATION_SHARE`].
fn blend(hits: f64, trials: f64, prior: f64, weight: f64) -> f64 {
    let hits = hits.min(trials);
    ((hits + weight * prior) / (trials + weight)).clamp(0.0, MAX_CONTINUATION_SHARE)
}

/// The prior of [`GroupGrowth::first_share`] and its weight in requests. Light, because the
/// share counts only first turns old enough to have been followed (see there): right after
/// groups start, the prior is all there is whatever its weight; later the evidence decides.
pub const PRIOR_FIRST_SHARE: f64 = 0.9;
pub const PRIOR_FIRST_REQUESTS: f64 = 2.0;

/// The prior of [`GroupGrowth::mean_gap_ms`] and its weight in gaps: a chat user reads and
/// types for tens of seconds; one measured gap outweighs it.
pub const PRIOR_GAP_MS: f64 = 30_000.0;
pub const PRIOR_GAPS: f64 = 0.25;
/// Bounds of the mean gap, ms, and the longest gap taken as evidence (an hour).
const MIN_GAP_MS: f64 = 10.0;
pub const MAX_GAP_MS: f64 = 3_600_000.0;

/// The prior of [`GroupGrowth::later_share`] (the cap) and its weight in continuations (see
/// there why four times the memory).
pub const PRIOR_LATER_SHARE: f64 = MAX_CONTINUATION_SHARE;
pub const PRIOR_LATER_REQUESTS: f64 = 200.0;

fn finite_or_zero(v: f64) -> f64 {
    if v.is_finite() {
        v.max(0.0)
    } else {
        0.0
    }
}

/// What a count keeps after `elapsed_ms` with the time constant `gap_ms`: `exp(−elapsed/gap)`;
/// all of it when no time passed (or the clock went back, or is not a number), none of it
/// when the gap is not a positive number.
pub fn decay(elapsed_ms: f64, gap_ms: f64) -> f64 {
    if elapsed_ms.is_nan() || elapsed_ms <= 0.0 {
        return 1.0;
    }
    if !gap_ms.is_finite() || gap_ms <= 0.0 {
        return 0.0;
    }
    // libm's, not std's: the plugin (wasm) and core (native) must agree to the last bit.
    libm::exp(-elapsed_ms / gap_ms)
}

/// Groups living on each endpoint, as an expected count: the groups whose later requests will
/// take room in its cache although the belief does not hold those blocks yet.
///
/// The belief's occupancy says how full a cache is now; a replica that has just taken ten new
/// conversations is nearly empty now and full in a minute. Counted by Little's law: the groups
/// waiting for their next request on an endpoint are the rate at which requests that will be
/// followed arrive there times how long a group waits, the mean gap between a request and its
/// group's next ([`GroupGrowth::mean_gap_ms`]). So each request routed to an endpoint adds the
/// chance it is followed ([`GroupGrowth::follow_share`]) and every count decays with the gap
/// as its time constant: a request's share is gone about when its follow-up would have come.
///
/// Why decay, not bookkeeping: nobody sees a group end. A question that is never followed
/// (a tenant's, a batch job's) leaves no trace to subtract; counts that waited for one grew
/// with every such question and, on a long-lived gateway, outgrew every cache (measured in
/// docs/benchmarks.md: the mixed trace at 2,000 requests fell to 56% of the bound's hit rate).
/// Counts, not blocks: what each live group will still add is priced when a decision reads it
/// ([`GroupGrowth::live_group_blocks`]). The sums are linear, so a proxy adds up its workers'
/// (each decayed to the same instant).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LiveGroups {
    pub count: Vec<f64>,
    /// The instant (ms, the router's clock) the counts are decayed to.
    pub at_ms: f64,
}

/// [`LiveGroups`] as of one instant ([`LiveGroups::at`]; [`RecentRequests::counts_at`] too,
/// whose counts are kept as a `LiveGroups`).
#[derive(Debug, Clone, Copy)]
pub struct LiveAt<'a> {
    count: &'a [f64],
    keep: f64,
}

impl LiveAt<'_> {
    /// The groups expected to live on `endpoint`, never negative.
    pub fn on(&self, endpoint: usize) -> f64 {
        let v = self
            .count
            .get(endpoint)
            .copied()
            .filter(|v| v.is_finite())
            .map_or(0.0, |v| v.max(0.0));
        v * self.keep
    }
}

impl LiveGroups {
    pub fn new(endpoints: usize) -> Self {
        LiveGroups {
            count: vec![0.0; endpoints],
            at_ms: 0.0,
        }
    }

    /// The groups expected to live on `endpoint` at `now_ms`, never negative.
    pub fn on(&self, endpoint: usize, now_ms: f64, gap_ms: f64) -> f64 {
        self.at(now_ms, gap_ms).on(endpoint)
    }

    /// The counts as of `now_ms`, to read endpoint by endpoint: the decay is the same for
    /// every endpoint, so it is computed once (an `exp` per endpoint per request showed in the
    /// plugin's instruction counts at 64 endpoints). Reads exactly what [`Self::on`] reads.
    pub fn at(&self, now_ms: f64, gap_ms: f64) -> LiveAt<'_> {
        LiveAt {
            count: &self.count,
            keep: decay(now_ms - self.at_ms, gap_ms),
        }
    }

    /// Decays every count to `now_ms` (a clock that went back keeps them as they are).
    pub fn advance(&mut self, now_ms: f64, gap_ms: f64) {
        if !now_ms.is_finite() {
            return;
        }
        let keep = decay(now_ms - self.at_ms, gap_ms);
        for v in &mut self.count {
            *v = if v.is_finite() { *v * keep } else { 0.0 };
        }
        if now_ms > self.at_ms || !self.at_ms.is_finite() {
            self.at_ms = now_ms;
        }
    }

    /// One request routed to `chosen` at `now_ms`, followed with probability `share`.
    pub fn observe(&mut self, chosen: usize, share: f64, now_ms: f64, gap_ms: f64) {
        self.advance(now_ms, gap_ms);
        let share = if share.is_finite() {
            share.clamp(0.0, 1.0)
        } else {
            0.0
        };
        if let Some(v) = self.count.get_mut(chosen) {
            *v += share;
        }
    }

    /// The same counts over a changed pool (`previous[new]` as in [`RequestLedger::remapped`]).
    pub fn remapped(&self, previous: &[Option<usize>]) -> LiveGroups {
        LiveGroups {
            count: previous
                .iter()
                .map(|old| old.and_then(|o| self.count.get(o).copied()).unwrap_or(0.0))
                .collect(),
            at_ms: self.at_ms,
        }
    }
}

/// What placing the request on an endpoint adds to that endpoint's cache over time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Footprint {
    /// The request continues an earlier one on this endpoint (its group already lives there).
    pub continues: bool,
    /// The request is its group's second (it continues a first request) and another endpoint
    /// holds its shared head: the first moment the router knows the group grows, so the group
    /// is placed again as what it is, its future blocks priced where it lives too (see
    /// `future_blocks` and the router's `keep_moves_among_head_holders`).
    pub second_request: bool,
    /// Blocks the group is expected to add later ([`GroupGrowth::future_blocks`]); counted
    /// where the request would start (or move) its group, not where it continues it, except
    /// for a second request. A group's first request was priced as any first request (most of
    /// which nobody follows, and before any continuation was seen as growing nothing), so
    /// groups that start together before the router has seen one continue all start next to
    /// their shared prefix; at their second request staying costs what their growth will
    /// displace there, and they spread (docs/benchmarks.md). Later requests price it only where
    /// they would move again: by then a move costs their history.
    pub future_blocks: f64,
    /// Blocks the groups already living on the endpoint are expected to add
    /// ([`LiveGroups::on`] × [`GroupGrowth::live_group_blocks`]): room that is taken soon
    /// although it is free now.
    pub growing_blocks: f64,
    /// The endpoint is the home every gateway computes for the request's group
    /// (`placement: consistent`) and this router believes no endpoint holds the group's head:
    /// it has not seen the group, which another gateway may already have placed there. The
    /// request takes no room price there as long as its blocks fit in the room believed free
    /// (nothing is evicted now): every gateway sends the group to its home, so the room it
    /// takes is taken whichever gateway comes first, and this router's belief of how full the
    /// home is counts only its own groups (the other endpoints look emptier only because it
    /// has not seen what the other gateways put there). Priced like anywhere else, three
    /// approximate gateways each placed a document they had not seen yet on the replica they
    /// believed emptiest, and one document's questions were prefilled cold on up to three
    /// replicas (the sweep's RAG over 8 seeds: TTFT p95 18–35× the bound's; docs/benchmarks.md).
    /// A home believed full is priced as any endpoint: more groups hash to it than it holds,
    /// and the eviction is real whoever places the group.
    pub agreed_home: bool,
}

/// The lanes a prediction assumes on an endpoint: the learned count, but no more than the
/// server runs while its scrape shows requests waiting. A server that queues has every lane it
/// will give taken, whatever the fit believes; and the fit believes many lanes until it has
/// seen first bytes come back late, which takes a prefill's time. Without this, a burst of new
/// prefixes (a replica went away and its groups look for a home) all go where the prediction
/// is a few percent lower, each seeing no queue, until the first of them answers.
pub fn scraped_lanes(learned: u32, server: Option<ServerQueue>) -> u32 {
    match server {
        Some(s) if s.waiting >= 1.0 && s.running.is_finite() && s.running >= 1.0 => {
            learned.min(s.running.min(f64::from(MAX_LANES)) as u32)
        }
        _ => learned,
    }
}

/// Predicts one request's time to first token on one endpoint, and what the router minimises.
///
/// `matched` is the believed match per chain; `room` the endpoint's believed cache. The queue
/// model is [`Backlog::queue`] with the learned lanes, at the learned cost per token. The cost
/// adds two prices to the TTFT:
///
/// * **delay to others**: where requests queue, this one's prefill also delays those that
///   will arrive after it, and so does its share of the lanes while it decodes (its hold time
///   over the lanes); in a steady queue about as many as wait ahead of it now. It is what
///   makes a hot prefix spill to a second replica before its queue runs away, although each
///   request alone would rather wait than miss. Without the hold, a replica whose lanes are
///   taken by long answers looked as cheap to queue on as one whose lanes free up at once
///   (hot tenant with 160 ms of decode per request at 0.1 ms/token: TTFT p95 3.46× the upper
///   bound's, round robin's 2.96×; with it 2.63×, docs/benchmarks.md).
/// * **room**: the blocks the request brings (those the endpoint does not hold, plus, if its
///   group starts or moves here, the blocks the group is expected to add later) take room in
///   the endpoint's cache. Each will displace a block some later request needs with about the
///   probability that the cache is full, its believed occupancy counting what the groups
///   living there will add (past full, more: [`CacheRoom::pressure_with`]); that request then
///   pays the block's prefill. So a new prefix goes where it fits (the emptiest cache) unless that is
///   slower by the prediction, and a growing group is not started where its history will not
///   stay.
pub fn predict(
    hashes: &BlockHashes,
    matched: &[usize],
    room: CacheRoom,
    footprint: Footprint,
    inputs: &LatencyInputs,
    config: &LatencyConfig,
) -> Prediction {
    let total_tokens = hashes.total_tokens();
    let cached = cached_tokens(hashes, matched).min(total_tokens);
    let uncached = total_tokens - cached;
    let ms_per_token = config.bounded_ms_per_token(
        inputs
            .ms_per_token
            .filter(|v| v.is_finite() && *v > 0.0)
            .unwrap_or(config.prefill_ms_per_token),
    );
    let lanes = scraped_lanes(
        inputs.lanes.unwrap_or(config.lanes).clamp(1, MAX_LANES),
        inputs.server,
    );
    let hold_ms = inputs
        .hold_ms
        .filter(|v| v.is_finite() && *v >= 0.0)
        .unwrap_or(0.0)
        .min(MAX_OBSERVED_MS);
    let backlog = Backlog::of(inputs, uncached);
    let wait = backlog.queue(lanes, hold_ms);
    let (queue_requests, queue_tokens) = (wait.requests, wait.tokens);
    let queue_ms = queue_tokens * ms_per_token + wait.hold_ms;
    let prefill_ms = uncached as f64 * ms_per_token;
    let ttft_ms = config.overhead_ms + queue_ms + prefill_ms;
    // Each request that queues behind this one waits for its prefill (one compute-bound batch)
    // and for its lane's share of its hold.
    let delay_to_others_ms = (prefill_ms + hold_ms / f64::from(lanes)) * queue_requests;

    let total_blocks = hashes.total_blocks();
    let matched_blocks: usize = matched.iter().sum();
    let new_blocks = total_blocks.saturating_sub(matched_blocks);
    let evicted_blocks = if room.capacity_blocks == 0 {
        0
    } else {
        new_blocks.saturating_sub(room.free_blocks())
    };
    let future = if footprint.continues && !footprint.second_request {
        0.0
    } else {
        footprint.future_blocks.max(0.0)
    };
    let growing = if footprint.growing_blocks.is_finite() {
        footprint.growing_blocks.max(0.0)
    } else {
        0.0
    };
    let room_blocks = if footprint.agreed_home && evicted_blocks == 0 {
        0.0
    } else {
        (new_blocks as f64 + future) * room.pressure_with(growing)
    };
    let block_size = hashes.block_size.max(1) as f64;
    let room_ms = room_blocks * block_size * ms_per_token;
    Prediction {
        cached_tokens: cached,
        uncached_tokens: uncached,
        backlog,
        lanes,
        hold_ms,
        queue_requests,
        queue_tokens,
        queue_hold_ms: wait.hold_ms,
        queue_ms,
        ms_per_token,
        ttft_ms,
        delay_to_others_ms,
        new_blocks,
        evicted_blocks,
        growing_blocks: growing,
        room_blocks,
        room_ms,
        copy_credit_ms: 0.0,
        caution_ms: 0.0,
        cost_ms: ttft_ms + delay_to_others_ms + room_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hashes(tokens: usize, block_size: usize) -> BlockHashes {
        let blocks = tokens.div_ceil(block_size);
        BlockHashes {
            chains: vec![(0..blocks as u64).collect()],
            tokens: vec![tokens],
            block_size,
            marks: vec![vec![]],
        }
    }

    fn config() -> LatencyConfig {
        LatencyConfig {
            prefill_ms_per_token: 1.0,
            overhead_ms: 5.0,
            lanes: 4,
            ..LatencyConfig::default()
        }
    }

    fn at(
        h: &BlockHashes,
        matched: usize,
        room: CacheRoom,
        inputs: &LatencyInputs,
        config: &LatencyConfig,
    ) -> Prediction {
        predict(h, &[matched], room, Footprint::default(), inputs, config)
    }

    fn busy(in_flight: u32, tokens: u64) -> LatencyInputs {
        LatencyInputs {
            work: EndpointWork {
                in_flight,
                prefilling: in_flight,
                prefill_tokens: tokens,
            },
            ..LatencyInputs::default()
        }
    }

    fn observation(backlog: Backlog, uncached: f64, elapsed_ms: f64) -> Observation {
        Observation {
            backlog,
            uncached_tokens: uncached,
            ms_per_token: 1.0,
            lanes: 1,
            hold_ms: 0.0,
            elapsed_ms,
        }
    }

    #[test]
    fn whole_ms_rounds_as_the_float_formatter_does() {
        for ms in [0.0, 0.4, 0.5, 1.5, 2.5, 2.51, 99.49, 1e6 + 0.5, 3_600_000.0] {
            assert_eq!(whole_ms(ms).to_string(), format!("{ms:.0}"), "{ms}");
        }
        assert_eq!(whole_ms(f64::NAN), 0);
        assert_eq!(whole_ms(f64::INFINITY), i64::MAX);
    }

    #[test]
    fn cached_tokens_follow_the_servers_rules() {
        // 40 tokens in blocks of 16: 3 blocks (the last partial). All matched: the server
        // reuses 2 full blocks, never the partial one.
        let h = hashes(40, 16);
        assert_eq!(cached_tokens(&h, &[3]), 32);
        assert_eq!(cached_tokens(&h, &[1]), 16);
        // 32 tokens, both blocks matched: the last token is always computed, so only 1 block.
        assert_eq!(cached_tokens(&hashes(32, 16), &[2]), 16);
        assert_eq!(cached_tokens(&hashes(1, 16), &[1]), 0);
    }

    #[test]
    fn an_idle_holder_beats_an_idle_stranger_by_the_prefill_it_saves() {
        let h = hashes(1000, 16);
        let idle = LatencyInputs::default();
        let hit = at(&h, 60, CacheRoom::default(), &idle, &config());
        let miss = at(&h, 0, CacheRoom::default(), &idle, &config());
        assert_eq!(hit.uncached_tokens, 1000 - 960);
        assert_eq!(hit.ttft_ms, 5.0 + 40.0);
        assert_eq!(miss.ttft_ms, 5.0 + 1000.0);
        assert_eq!((hit.queue_ms, hit.cost_ms), (0.0, hit.ttft_ms));
    }

    #[test]
    fn work_ahead_delays_only_when_every_lane_is_taken() {
        let h = hashes(100, 16);
        let room = CacheRoom::default();
        // Three of four lanes busy with a long prefill each: a lane is free.
        let free = at(&h, 0, room, &busy(3, 3000), &config());
        assert_eq!(free.queue_ms, 0.0);
        // Four busy: one must finish; its share of 4000 tokens over 4 lanes.
        let full = at(&h, 0, room, &busy(4, 4000), &config());
        assert_eq!(full.queue_requests, 1.0);
        assert_eq!(full.queue_ms, 1000.0 / 4.0);
        // ...and this request's 100 ms of prefill delays about one request behind it.
        assert_eq!(full.delay_to_others_ms, 100.0);
        assert_eq!(full.cost_ms, full.ttft_ms + 100.0);
        // One lane: all the work ahead (Dynamo's cost).
        let one = LatencyConfig {
            lanes: 1,
            ..config()
        };
        assert_eq!(at(&h, 0, room, &busy(2, 500), &one).queue_ms, 500.0);
    }

    #[test]
    fn lanes_held_by_decoding_requests_delay_the_next_one() {
        let h = hashes(100, 16);
        // Four lanes, all taken: two requests still prefilling 200 tokens each, two decoding.
        let inputs = LatencyInputs {
            work: EndpointWork {
                in_flight: 4,
                prefilling: 2,
                prefill_tokens: 400,
            },
            lanes: Some(4),
            hold_ms: Some(80.0),
            ..LatencyInputs::default()
        };
        let p = at(&h, 0, CacheRoom::default(), &inputs, &config());
        assert_eq!((p.backlog.prefilling, p.backlog.decoding), (2.0, 2.0));
        // One of four must finish: a quarter of each holder's share. Prefill: 400 / 4 / 4;
        // hold: 80 ms for each prefilling one, about half of it for each decoding one.
        assert_eq!(p.queue_tokens, 400.0 / 16.0);
        assert_eq!(p.queue_hold_ms, (80.0 * (2.0 + 0.5 * 2.0)) / 16.0);
        assert_eq!(p.queue_ms, p.queue_tokens * 1.0 + p.queue_hold_ms);
        // The observation of such a request does not blame the decode wait on prefill.
        let obs = Observation::of(&p, 5.0 + p.queue_ms + 100.0);
        assert_eq!(obs.hold_wait_ms(), p.queue_hold_ms);
        let mut rate = PrefillRate::default();
        rate.observe(obs, &config()).unwrap();
        assert!((rate.busy_ms / rate.work_tokens - 1.0).abs() < 1e-9);
    }

    #[test]
    fn where_requests_queue_a_request_delays_those_behind_it_by_its_prefill_and_its_share_of_a_lane(
    ) {
        let h = hashes(100, 16);
        let queued = |hold_ms: f64| LatencyInputs {
            work: EndpointWork {
                in_flight: 4,
                prefilling: 2,
                prefill_tokens: 400,
            },
            lanes: Some(2),
            hold_ms: Some(hold_ms),
            ..LatencyInputs::default()
        };
        let quick = at(&h, 0, CacheRoom::default(), &queued(0.0), &config());
        let long = at(&h, 0, CacheRoom::default(), &queued(160.0), &config());
        // Three of four holders must finish first on two lanes: three wait behind it too.
        assert_eq!(quick.queue_requests, 3.0);
        assert_eq!(quick.delay_to_others_ms, 100.0 * 3.0);
        // A request that will hold its lane 160 ms after its first byte takes half of that
        // from each of them (one of two lanes).
        assert_eq!(long.delay_to_others_ms, (100.0 + 160.0 / 2.0) * 3.0);
        assert!(long.cost_ms > quick.cost_ms);
        // With a lane free nobody waits behind it, however long it holds its own.
        let free = LatencyInputs {
            work: EndpointWork::default(),
            ..queued(160.0)
        };
        assert_eq!(
            at(&h, 0, CacheRoom::default(), &free, &config()).delay_to_others_ms,
            0.0
        );
    }

    #[test]
    fn a_server_that_reports_requests_waiting_is_predicted_to_queue_whatever_the_fit_believes() {
        let h = hashes(100, 16);
        // Six long prefills in flight; the fit still believes 256 lanes (it has not yet seen a
        // first byte come back late).
        let mut inputs = LatencyInputs {
            work: EndpointWork {
                in_flight: 6,
                prefilling: 6,
                prefill_tokens: 6 * 700,
            },
            lanes: Some(256),
            server: Some(ServerQueue {
                waiting: 0.0,
                running: 6.0,
                sent_then: None,
            }),
            ..LatencyInputs::default()
        };
        let free = at(&h, 0, CacheRoom::default(), &inputs, &config());
        assert_eq!((free.lanes, free.queue_ms), (256, 0.0));
        // The scrape says four run and two wait: every lane is taken, three must finish first.
        inputs.server = Some(ServerQueue {
            waiting: 2.0,
            running: 4.0,
            sent_then: None,
        });
        let queued = at(&h, 0, CacheRoom::default(), &inputs, &config());
        assert_eq!(queued.lanes, 4);
        assert_eq!(queued.queue_requests, 3.0);
        assert!(queued.ttft_ms > free.ttft_ms + 500.0, "{queued:?}");
        // The cap never raises the learned count, and an absurd scrape leaves it alone.
        let one_lane = |running: f64| {
            scraped_lanes(
                1,
                Some(ServerQueue {
                    waiting: 3.0,
                    running,
                    sent_then: None,
                }),
            )
        };
        assert_eq!(one_lane(4.0), 1);
        assert_eq!(scraped_lanes(8, None), 8);
        for running in [0.0, f64::NAN, f64::INFINITY, -2.0] {
            let s = Some(ServerQueue {
                waiting: 3.0,
                running,
                sent_then: None,
            });
            assert_eq!(scraped_lanes(8, s), 8, "running {running}");
        }
        assert_eq!(
            scraped_lanes(
                8,
                Some(ServerQueue {
                    waiting: 1.0,
                    running: 1e12,
                    sent_then: None,
                })
            ),
            8
        );
    }

    #[test]
    fn the_hold_time_is_learned_from_the_ends_of_streams() {
        let c = config();
        let mut ledger = RequestLedger::new(1);
        assert_eq!(ledger.learned.estimate(&c).hold_ms, 0.0);
        for _ in 0..200 {
            ledger.sent(
                0,
                &Prediction {
                    uncached_tokens: 10,
                    ..Prediction::default()
                },
            );
            ledger.first_byte(0, 10, None, &c).unwrap();
            ledger.done(0, None, Some(120.0)).unwrap();
        }
        assert!((ledger.learned.estimate(&c).hold_ms - 120.0).abs() < 1e-6);
        assert!(ledger.done(0, None, Some(-1.0)).is_err());
        assert!(ledger.done(0, None, Some(f64::INFINITY)).is_err());
        assert!((ledger.learned.estimate(&c).hold_ms - 120.0).abs() < 1e-6);
    }

    #[test]
    fn requests_the_router_did_not_send_count_as_queue() {
        let h = hashes(100, 16);
        let inputs = LatencyInputs {
            server: Some(ServerQueue {
                waiting: 4.0,
                running: 4.0,
                sent_then: None,
            }),
            lanes: Some(4),
            ..busy(1, 200)
        };
        let p = at(&h, 0, CacheRoom::default(), &inputs, &config());
        // 8 on the server, 1 of them ours: 7 unseen, each like our 200-token one.
        assert_eq!(p.backlog.holders, 8.0);
        assert_eq!((p.backlog.prefilling, p.backlog.decoding), (8.0, 0.0));
        assert_eq!(p.queue_requests, 5.0);
        assert_eq!(p.queue_tokens, 5.0 * (1600.0 / 8.0) / 4.0);
        // A scrape showing fewer than the router has in flight adds nothing.
        let stale = LatencyInputs {
            server: Some(ServerQueue {
                waiting: 0.0,
                running: 0.0,
                sent_then: None,
            }),
            ..busy(3, 300)
        };
        assert_eq!(Backlog::of(&stale, 10).holders, 3.0);
    }

    #[test]
    fn requests_that_ended_since_the_scrape_are_not_taken_for_another_gateways() {
        let scraped = |running: f64, sent_then: Option<u32>| LatencyInputs {
            server: Some(ServerQueue {
                waiting: 0.0,
                running,
                sent_then,
            }),
            lanes: Some(4),
            ..busy(1, 200)
        };
        // The scrape saw six running, all the router's own; five have ended since.
        assert_eq!(Backlog::of(&scraped(6.0, Some(6)), 10).holders, 1.0);
        // Counted against the one in flight now, they were five phantoms.
        assert_eq!(Backlog::of(&scraped(6.0, None), 10).holders, 6.0);
        // Beyond the router's own at the scrape, another gateway's still count.
        assert_eq!(Backlog::of(&scraped(8.0, Some(6)), 10).holders, 3.0);
    }

    #[test]
    fn served_requests_count_what_the_servers_finished_and_stand_in_only_for_a_partial_view() {
        let mut served = ServedRequests::new(2);
        let both = [true, true];
        let mut own = RecentRequests::new(2);
        // A first reading is a baseline; until both endpoints have two, nothing stands in.
        served.observe(0, 100.0, 0.0);
        served.observe(1, 40.0, 0.0);
        served.observe(0, 130.0, 1000.0);
        assert_eq!(served.beyond(&own, &both, 1000.0), None);
        served.observe(1, 40.0, 1000.0);
        let counts = served.beyond(&own, &both, 1000.0).unwrap();
        assert_eq!(counts.count(0, 1000.0), 30.0);
        assert_eq!(counts.count(1, 1000.0), 0.0);
        // An endpoint that is not eligible need not report.
        let mut three = ServedRequests::new(3);
        three.observe(0, 1.0, 0.0);
        three.observe(0, 5.0, 10.0);
        assert!(three.beyond(&own, &[true, false, false], 10.0).is_some());
        assert_eq!(three.beyond(&own, &[true, true, false], 10.0), None);
        // A router that sent three quarters of what the servers finished keeps its own counts.
        for _ in 0..22 {
            own.record(0, 1000.0);
        }
        assert!(served.beyond(&own, &both, 1000.0).is_some());
        own.record(1, 1000.0);
        assert_eq!(served.beyond(&own, &both, 1000.0), None);
        // A counter that went back (a restart) is a new baseline, and garbage adds nothing
        // and is refused (for the caller to count).
        assert!(served.observe(0, 5.0, 2000.0));
        assert!(!served.observe(0, f64::NAN, 2000.0));
        assert!(!served.observe(0, -1.0, 2000.0));
        assert!(!served.observe(0, f64::INFINITY, 2000.0));
        assert!(!served.observe(0, 6.0, f64::NAN));
        served.observe(7, 1.0, 2000.0);
        assert!(served.observe(0, 5.0, 2000.0));
        let count_at = |served: &ServedRequests, at: f64| {
            served
                .beyond(&RecentRequests::new(2), &both, at)
                .unwrap()
                .count(0, at)
        };
        let kept = 30.0 * decay(1000.0, RecentRequests::WINDOW_MS);
        assert!((count_at(&served, 2000.0) - kept).abs() < 1e-9);
        served.observe(0, 9.0, 3000.0);
        let decayed = 30.0 * decay(2000.0, RecentRequests::WINDOW_MS);
        assert!((count_at(&served, 3000.0) - (decayed + 4.0)).abs() < 1e-9);
    }

    #[test]
    fn room_is_priced_by_occupancy_and_a_new_group_by_its_expected_growth() {
        let h = hashes(160, 16); // 10 blocks
        let idle = LatencyInputs::default();
        let half = CacheRoom {
            capacity_blocks: 100,
            believed_blocks: 50,
        };
        let empty = CacheRoom {
            capacity_blocks: 100,
            believed_blocks: 0,
        };
        let continuing = Footprint {
            continues: true,
            future_blocks: 30.0,
            ..Footprint::default()
        };
        let starting = Footprint {
            continues: false,
            ..continuing
        };
        // 8 new blocks at half occupancy: 4 blocks of 16 tokens at 1 ms.
        let c = predict(&h, &[2], half, continuing, &idle, &config());
        assert_eq!((c.new_blocks, c.room_blocks, c.room_ms), (8, 4.0, 64.0));
        // A group that starts here also brings its expected 30 later blocks.
        let s = predict(&h, &[2], half, starting, &idle, &config());
        assert_eq!(s.room_blocks, (8.0 + 30.0) * 0.5);
        // So does a group's second request where the group lives: it is placed again, now
        // that the group is known to grow.
        let second = Footprint {
            second_request: true,
            ..continuing
        };
        let r = predict(&h, &[2], half, second, &idle, &config());
        assert_eq!(r.room_blocks, s.room_blocks);
        // Groups already living here will take 25 more blocks: the cache is three quarters
        // full for this request's blocks; past full (5.5 times) each block displaces a needed
        // one and is itself pushed out before it is used again with the chance 1 - 1/5.5.
        let crowded = Footprint {
            growing_blocks: 25.0,
            ..continuing
        };
        let g = predict(&h, &[2], half, crowded, &idle, &config());
        assert_eq!(g.room_blocks, 8.0 * 0.75);
        let overfull = Footprint {
            growing_blocks: 500.0,
            ..continuing
        };
        let o = predict(&h, &[2], half, overfull, &idle, &config());
        assert!((o.room_blocks - 8.0 * (2.0 - 1.0 / 5.5)).abs() < 1e-9);
        let garbage = Footprint {
            growing_blocks: f64::NAN,
            ..continuing
        };
        assert_eq!(
            predict(&h, &[2], half, garbage, &idle, &config()).room_blocks,
            4.0
        );
        // The home every gateway sends a group to, when this router has not seen the group,
        // takes it without a room price; the rest of the prediction is the same.
        let agreed = Footprint {
            agreed_home: true,
            ..starting
        };
        let a = predict(&h, &[2], half, agreed, &idle, &config());
        assert_eq!((a.room_blocks, a.room_ms), (0.0, 0.0));
        assert_eq!((a.ttft_ms, a.new_blocks), (s.ttft_ms, s.new_blocks));
        assert_eq!(a.cost_ms, s.cost_ms - s.room_ms);
        // Unless the home is believed too full for its blocks: then it is priced as anywhere.
        let nearly_full = CacheRoom {
            capacity_blocks: 100,
            believed_blocks: 95,
        };
        let f = predict(&h, &[2], nearly_full, agreed, &idle, &config());
        let anywhere = predict(&h, &[2], nearly_full, starting, &idle, &config());
        assert_eq!(f.evicted_blocks, 3);
        assert!(f.room_ms > 0.0);
        assert_eq!(f.room_ms, anywhere.room_ms);
        // An empty cache costs no room; an unknown capacity neither.
        let e = predict(&h, &[0], empty, starting, &idle, &config());
        assert_eq!(e.room_ms, 0.0);
        // A full cache evicts what does not fit.
        let full = CacheRoom {
            capacity_blocks: 100,
            believed_blocks: 96,
        };
        assert_eq!(at(&h, 2, full, &idle, &config()).evicted_blocks, 4);
    }

    #[test]
    fn the_rate_starts_at_the_prior_and_learns_from_observations() {
        let c = config();
        let mut rate = PrefillRate::default();
        assert_eq!(rate.ms_per_token(&c), 1.0);
        // A replica four times slower than the prior: 4 ms per token, 5 ms overhead.
        for _ in 0..100 {
            rate.observe(observation(Backlog::default(), 500.0, 5.0 + 2000.0), &c)
                .unwrap();
        }
        let learned = rate.ms_per_token(&c);
        assert!((learned - 4.0).abs() < 0.25, "{learned}");
        // Faster again: the window forgets the old observations.
        for _ in 0..2000 {
            rate.observe(observation(Backlog::default(), 500.0, 5.0 + 50.0), &c)
                .unwrap();
        }
        assert!((rate.ms_per_token(&c) - 0.1).abs() < 0.05);
    }

    #[test]
    fn the_work_an_observation_is_compared_with_includes_the_predicted_wait() {
        let backlog = Backlog {
            holders: 2.0,
            pending_tokens: 600.0,
            prefilling: 2.0,
            decoding: 0.0,
        };
        // One lane: all 600 tokens ahead, plus its own 100.
        assert_eq!(observation(backlog, 100.0, 10.0).work_tokens(), 700.0);
        let four = Observation {
            lanes: 4,
            ..observation(backlog, 100.0, 10.0)
        };
        assert_eq!(four.work_tokens(), 100.0, "a lane was free");
    }

    #[test]
    fn an_endpoint_without_observations_costs_what_the_fleet_costs() {
        let c = config();
        let mut seen = PrefillRate::default();
        for _ in 0..400 {
            seen.observe(observation(Backlog::default(), 1000.0, 5.0 + 3000.0), &c)
                .unwrap();
        }
        let rates = estimate_rates(&[seen, PrefillRate::default()], &c);
        assert!((rates[0] - 3.0).abs() < 0.1, "{rates:?}");
        assert!(
            (rates[1] - rates[0]).abs() < 0.1,
            "the unseen endpoint follows the fleet, not the 1 ms prior: {rates:?}"
        );
        assert_eq!(estimate_rates(&[PrefillRate::default()], &c), vec![1.0]);
        let corrupt = PrefillRate {
            busy_ms: -1.0,
            work_tokens: 5.0,
        };
        assert_eq!(estimate_rates(&[corrupt], &c), vec![1.0]);
    }

    #[test]
    fn a_few_observations_of_one_replica_do_not_make_it_look_faster_than_the_fleet() {
        let c = config();
        // The fleet has seen a lot at 1 ms per token; one replica had two lucky requests.
        let mut fleet = PrefillRate::default();
        for _ in 0..100 {
            fleet
                .observe(observation(Backlog::default(), 1000.0, 1005.0), &c)
                .unwrap();
        }
        let mut lucky = PrefillRate::default();
        for _ in 0..2 {
            lucky
                .observe(observation(Backlog::default(), 700.0, 5.0 + 350.0), &c)
                .unwrap();
        }
        let rates = estimate_rates(&[fleet, lucky], &c);
        assert!(rates[1] > 0.9, "{rates:?}");
    }

    #[test]
    fn absurd_observations_are_refused_and_leave_the_model_alone() {
        let c = config();
        let mut model = LearnedModel::new(1);
        for (elapsed, err) in [
            (0.0, ObservationError::NotPositive),
            (-3.0, ObservationError::NotPositive),
            (f64::NAN, ObservationError::NotPositive),
            (7_200_000.0, ObservationError::TooLong),
        ] {
            let obs = observation(Backlog::default(), 10.0, elapsed);
            assert_eq!(model.observe(0, obs, &c), Err(err));
        }
        let bad_work = observation(Backlog::default(), f64::INFINITY, 10.0);
        assert_eq!(
            model.observe(0, bad_work, &c),
            Err(ObservationError::BadWork)
        );
        let fine = observation(Backlog::default(), 10.0, 20.0);
        assert_eq!(
            model.observe(7, fine, &c),
            Err(ObservationError::BadWork),
            "unknown endpoint"
        );
        assert_eq!(model, LearnedModel::new(1));
        // A corrupt state reads as the prior; the bounds clamp an extreme estimate.
        let corrupt = PrefillRate {
            busy_ms: f64::NAN,
            work_tokens: 1.0,
        };
        assert_eq!(corrupt.ms_per_token(&c), 1.0);
        let extreme = PrefillRate {
            busy_ms: 1e12,
            work_tokens: 1.0,
        };
        assert_eq!(extreme.ms_per_token(&c), c.max_ms_per_token);
    }

    /// First bytes of requests sent behind `holders` others with `pending` tokens, on a server
    /// that really has `lanes` lanes at 1 ms per token.
    fn fit_on(lanes: u32, cases: &[(f64, f64)]) -> LaneFit {
        let c = config();
        let mut fit = LaneFit::default();
        for _ in 0..10 {
            for &(holders, pending) in cases {
                let backlog = Backlog {
                    holders,
                    pending_tokens: pending,
                    prefilling: holders,
                    decoding: 0.0,
                };
                let wait = backlog.queue(lanes, 0.0).tokens;
                let obs = Observation {
                    lanes: 256,
                    ..observation(backlog, 50.0, c.overhead_ms + 50.0 + wait)
                };
                fit.observe(&obs, &c);
            }
        }
        fit
    }

    #[test]
    fn lanes_are_learned_from_how_much_stacked_requests_wait() {
        let c = LatencyConfig::default();
        let stacked = [
            (0.0, 0.0),
            (1.0, 400.0),
            (2.0, 800.0),
            (3.0, 1200.0),
            (5.0, 2000.0),
        ];
        // One compute-bound batch (vLLM): every request waits for all the work ahead.
        assert_eq!(estimate_lanes(&[fit_on(1, &stacked)], &c).most, 1);
        // Four independent lanes: waits start at the fourth request.
        assert_eq!(estimate_lanes(&[fit_on(4, &stacked)], &c).most, 4);
        // Nothing stacked yet: every model fits, the configured (optimistic) prior stands.
        assert_eq!(
            estimate_lanes(&[fit_on(1, &[(0.0, 0.0)])], &c).most,
            c.lanes
        );
        // With at most one request ahead, more than one lane can't be told apart from many:
        // the largest consistent model wins (its mistakes show up and get corrected).
        assert_eq!(estimate_lanes(&[fit_on(2, &[(1.0, 400.0)])], &c).most, 256);
        // The configured lanes cap the choice.
        let capped = LatencyConfig { lanes: 2, ..c };
        assert_eq!(estimate_lanes(&[fit_on(8, &stacked)], &capped).most, 2);
    }

    #[test]
    fn the_fewest_lanes_not_ruled_out_are_one_more_than_were_seen_running_at_once() {
        let c = LatencyConfig::default();
        let fewest = |fit: LaneFit| estimate_lanes(&[fit], &c).fewest;
        // No evidence: one lane cannot be ruled out.
        assert_eq!(fewest(LaneFit::default()), 1);
        assert_eq!(fewest(fit_on(8, &[(0.0, 0.0)])), 1);
        // One request ahead that did not wait rules out one lane, not two.
        assert_eq!(fewest(fit_on(8, &[(1.0, 400.0)])), 2);
        // Three ahead without waiting: four lanes at least (the next model above three).
        assert_eq!(fewest(fit_on(8, &[(1.0, 400.0), (3.0, 1200.0)])), 4);
        // Where the waits show the lanes, the fewest and the most agree.
        let stacked = [(1.0, 400.0), (2.0, 800.0), (3.0, 1200.0), (5.0, 2000.0)];
        assert_eq!(fewest(fit_on(4, &stacked)), 4);
        assert_eq!(estimate_lanes(&[fit_on(4, &stacked)], &c).most, 4);
        assert_eq!(fewest(fit_on(1, &stacked)), 1);
        // Never more than the configured lanes.
        let capped = LatencyConfig { lanes: 2, ..c };
        assert_eq!(estimate_lanes(&[fit_on(8, &stacked)], &capped).fewest, 2);
    }

    #[test]
    fn caution_prices_the_work_in_flight_spread_over_the_fewest_lanes() {
        let h = hashes(100, 16);
        // Two prefills of 600 tokens in flight; 256 lanes believed: no wait predicted.
        let inputs = LatencyInputs {
            ms_per_token: Some(1.0),
            lanes: Some(256),
            ..busy(2, 1200)
        };
        let p = at(&h, 0, CacheRoom::default(), &inputs, &config());
        assert_eq!((p.queue_ms, p.caution_ms), (0.0, 0.0));
        // With one lane the request would wait for all 1,200 tokens.
        let one = p.with_caution(1);
        assert_eq!(one.caution_ms, 1200.0);
        assert_eq!(one.cost_ms, p.cost_ms + 1200.0);
        assert_eq!(
            one.ttft_ms, p.ttft_ms,
            "the prediction is not changed, only its price"
        );
        // Three lanes leave one free now, but not for the whole prefill: a third of the work.
        // Applied again, it replaces itself.
        assert_eq!(one.with_caution(3).caution_ms, 400.0);
        assert_eq!(one.with_caution(3).cost_ms, p.cost_ms + 400.0);
        assert_eq!(p.with_caution(256).caution_ms, 1200.0 / 256.0);
        // Nothing in flight: nothing to spread.
        let idle = LatencyInputs {
            ms_per_token: Some(1.0),
            lanes: Some(256),
            ..LatencyInputs::default()
        };
        let i = at(&h, 0, CacheRoom::default(), &idle, &config());
        assert_eq!(i.with_caution(1).caution_ms, 0.0);
        // Never below the predicted wait: fewest lanes above the learned ones change nothing.
        let one_lane = LatencyInputs {
            lanes: Some(1),
            ..inputs
        };
        let q = at(&h, 0, CacheRoom::default(), &one_lane, &config());
        assert_eq!(q.queue_ms, 1200.0);
        assert_eq!(q.with_caution(4).caution_ms, 0.0);
        assert_eq!(q.with_caution(0).caution_ms, 0.0);
    }

    #[test]
    fn the_spread_work_is_never_less_than_the_wait_for_a_lane() {
        for holders in 0..12u32 {
            for decoding in 0..=holders {
                let backlog = Backlog {
                    holders: f64::from(holders),
                    pending_tokens: 300.0 * f64::from(holders - decoding),
                    prefilling: f64::from(holders - decoding),
                    decoding: f64::from(decoding),
                };
                for lanes in [1, 2, 3, 4, 8, 256] {
                    let wait = backlog.queue(lanes, 40.0);
                    let waited = wait.tokens * 0.5 + wait.hold_ms;
                    let spread = backlog.spread_ms(lanes, 0.5, 40.0);
                    assert!(
                        spread >= waited - 1e-9,
                        "{backlog:?} lanes {lanes}: {spread} < {waited}"
                    );
                }
            }
        }
    }

    #[test]
    fn learned_models_add_up_across_workers() {
        let c = config();
        let (mut a, mut b) = (LearnedModel::new(2), LearnedModel::new(2));
        let stacked = Backlog {
            holders: 2.0,
            pending_tokens: 800.0,
            prefilling: 2.0,
            decoding: 0.0,
        };
        a.observe(0, observation(Backlog::default(), 500.0, 1505.0), &c)
            .unwrap();
        b.observe(1, observation(stacked, 100.0, 905.0), &c)
            .unwrap();
        let mut pooled = LearnedModel::new(2);
        pooled.add(&a);
        pooled.add(&b);
        assert_eq!(pooled.rates[0], a.rates[0]);
        assert_eq!(pooled.rates[1], b.rates[1]);
        assert_eq!(pooled.lanes, b.lanes, "a's observation had nothing ahead");
        let corrupt = LearnedModel {
            rates: vec![PrefillRate {
                busy_ms: f64::NAN,
                work_tokens: 1.0,
            }],
            lanes: LaneFit {
                excess: [f64::INFINITY; LANE_MODELS.len()],
            },
            hold: HoldTime {
                ms: f64::NAN,
                count: 1.0,
            },
        };
        pooled.add(&corrupt);
        assert_eq!(pooled.hold, HoldTime::default());
        assert_eq!(pooled.rates[0], a.rates[0]);
        assert_eq!(pooled.lanes, b.lanes);
    }

    #[test]
    fn a_remapped_ledger_follows_endpoints_to_their_new_index_and_drops_the_ones_that_left() {
        let mut ledger = RequestLedger::new(3);
        let p = Prediction {
            uncached_tokens: 7,
            ..Prediction::default()
        };
        ledger.sent(0, &p);
        ledger.sent(2, &p);
        ledger.sent(2, &p);
        ledger.learned.rates[2].work_tokens = 99.0;
        ledger.learned.lanes.excess[0] = 5.0;
        // Endpoint 1 left, 2 moved to index 0, and a newcomer took index 1.
        let next = ledger.remapped(&[Some(2), None]);
        assert_eq!(next.work.len(), 2);
        assert_eq!(next.work[0].in_flight, 2);
        assert_eq!(next.work[0].prefill_tokens, 14);
        assert_eq!(next.work[1], EndpointWork::default());
        assert_eq!(next.learned.rates[0].work_tokens, 99.0);
        assert_eq!(next.learned.rates[1], PrefillRate::default());
        assert_eq!(next.learned.lanes.excess[0], 5.0);
    }

    #[test]
    fn the_ledger_releases_prefill_at_the_first_byte_and_the_lane_at_the_end() {
        let c = config();
        let mut ledger = RequestLedger::new(2);
        let predicted = |cached, uncached| Prediction {
            cached_tokens: cached,
            uncached_tokens: uncached,
            ..Prediction::default()
        };
        ledger.sent(1, &predicted(0, 300));
        ledger.sent(1, &predicted(100, 40));
        assert_eq!(
            ledger.sent[1],
            SentTokens {
                prompt: 440,
                predicted_cached: 100
            }
        );
        assert_eq!(
            ledger.work[1],
            EndpointWork {
                in_flight: 2,
                prefilling: 2,
                prefill_tokens: 340
            }
        );
        ledger
            .first_byte(
                1,
                300,
                Some(observation(Backlog::default(), 300.0, 305.0)),
                &c,
            )
            .unwrap();
        assert_eq!(ledger.work[1].prefill_tokens, 40);
        assert_eq!(ledger.learned.rates[1].work_tokens, 300.0);
        // A reset before its first byte releases both; strays and repeats saturate.
        ledger.done(1, Some(40), None).unwrap();
        ledger.done(1, None, None).unwrap();
        ledger.done(1, Some(999), None).unwrap();
        ledger.done(7, None, None).unwrap();
        assert_eq!(ledger.work[1], EndpointWork::default());
        assert!(ledger
            .first_byte(0, 1, Some(observation(Backlog::default(), 1.0, 0.0)), &c)
            .is_err());
    }

    #[test]
    fn a_belief_that_promises_more_hits_than_the_server_serves_shrinks_and_recovers() {
        let mut c = Calibration::default();
        assert_eq!(c.capacity(900), 900);
        // Too little evidence: nothing changes.
        c.observe(100.0, 1000.0, 900.0, 1000.0);
        assert_eq!(c.scale, 1.0);
        // The server hits 20% where the router predicted 80%: the belief shrinks, by the
        // square root of the ratio per interval, not below a quarter of the real size.
        let mut scales = Vec::new();
        for _ in 0..12 {
            c.observe(2000.0, 10_000.0, 8000.0, 10_000.0);
            scales.push(c.scale);
        }
        assert!(scales.windows(2).all(|w| w[1] <= w[0]), "{scales:?}");
        assert_eq!(c.scale, MIN_CALIBRATION);
        assert_eq!(c.capacity(900), 225);
        // Agreement again: back up, never above the real capacity.
        for _ in 0..40 {
            c.observe(6000.0, 10_000.0, 6000.0, 10_000.0);
        }
        assert_eq!(c.scale, 1.0);
        assert_eq!(c.capacity(900), 900);
        // Agreement within 10% leaves a full-size belief alone; garbage is no evidence.
        let mut ok = Calibration::default();
        for _ in 0..10 {
            ok.observe(5600.0, 10_000.0, 6000.0, 10_000.0);
        }
        assert_eq!(ok.scale, 1.0);
        ok.observe(f64::NAN, 1.0, 1.0, 1.0);
        ok.observe(-5.0, 1.0, 1.0, 1.0);
        ok.observe(20.0, 10.0, 1.0, 1.0);
        assert_eq!(ok.scale, 1.0);
    }

    #[test]
    fn growth_is_learned_from_continuations() {
        let mut growth = GroupGrowth::default();
        // Before any evidence the shares are the priors, and groups add nothing: none was seen
        // to continue.
        assert_eq!(growth.first_share(), PRIOR_FIRST_SHARE);
        assert_eq!(growth.later_share(), PRIOR_LATER_SHARE);
        assert_eq!(growth.live_group_blocks(), 0.0);
        // One continuation of 10 blocks is half the evidence of a size: 5.
        let mut once = GroupGrowth::default();
        once.observe(Some(Turn::First), 10, 0.0);
        let q1 = once.later_share();
        assert!((once.live_group_blocks() * (1.0 - q1) - 5.0).abs() < 1e-9);
        // Conversations of four requests each, a request every 100 ms and a turn a second
        // after the one it continues, adding 8 blocks a turn: a first turn is always followed,
        // a later one two times in three.
        let mut t = 0.0;
        for i in 0..400 {
            let continued = match i % 4 {
                0 => None,
                1 => Some(Turn::First),
                _ => Some(Turn::Later),
            };
            if continued.is_some() {
                growth.observe_gap(1000.0).unwrap();
            }
            growth.observe(continued, 8, t);
            t += 100.0;
        }
        let (f, q) = (growth.first_share(), growth.later_share());
        // The measured gaps, with the prior's quarter of a gap still in: within a quarter.
        assert!((growth.mean_gap_ms() - 1000.0).abs() < 250.0, "{growth:?}");
        // Every first turn old enough to have been followed was: the share is at the cap.
        assert!(f > 0.9, "{growth:?}");
        let evidence = 2.0 / 3.0;
        let memory = 0.75 / (1.0 - GROWTH_KEEP);
        let expected = (memory * evidence + 200.0 * 0.95) / (memory + 200.0);
        assert!((q - expected).abs() < 0.01, "{q} vs {expected}: {growth:?}");
        // A live group adds a continuation's size 1 / (1 - q) times (the size shrunk by one
        // continuation's worth: 8 × n / (n + 1) over the ~38 continuations remembered); a
        // request adds that with the chance it is followed.
        let group = growth.live_group_blocks();
        let n = growth.second_turns + growth.further_turns;
        assert!(
            (group * (1.0 - q) - 8.0 * n / (n + 1.0)).abs() < 1e-9,
            "{group} {q}"
        );
        assert!((growth.future_blocks(None) - f * group).abs() < 1e-9);
        assert!(
            (growth.future_blocks(Some(Turn::First)) - q * group).abs() < 1e-9,
            "a continuing request is followed with the later share"
        );
        // Always continuing is capped: at most 20 more continuations.
        for _ in 0..400 {
            growth.observe(Some(Turn::Later), 1, t);
            t += 100.0;
        }
        assert!(growth.live_group_blocks() <= 20.0 * 1.01, "{growth:?}");
        // Garbage sums are no evidence.
        let broken = GroupGrowth {
            first_turns: f64::NAN,
            second_turns: f64::INFINITY,
            further_turns: -1.0,
            added_blocks: -3.0,
            gaps: f64::NAN,
            gap_ms: -1.0,
            recent_first: f64::INFINITY,
            at_ms: f64::NAN,
        };
        assert_eq!(broken.future_blocks(None), 0.0);
        assert_eq!(broken.live_group_blocks(), 0.0);
        assert_eq!(broken.mean_gap_ms(), PRIOR_GAP_MS);
        let mut reset = broken;
        reset.observe(None, 1, 5.0);
        assert_eq!(reset, GroupGrowth::default(), "non-finite sums start over");
    }

    #[test]
    fn a_first_turn_counts_against_the_first_share_only_once_it_could_have_been_followed() {
        // Tenants' questions, one a second, never followed.
        let mut questions = GroupGrowth::default();
        questions.observe_gap(2000.0).unwrap(); // one conversation elsewhere told the gap
        for i in 0..3 {
            questions.observe(None, 3, i as f64 * 1000.0);
        }
        // Three seconds in, their follow-ups could still come: mostly the prior.
        assert!(questions.first_share() > 0.5, "{questions:?}");
        for i in 3..300 {
            questions.observe(None, 3, i as f64 * 1000.0);
        }
        // Minutes on, nobody followed them.
        assert!(questions.first_share() < 0.1, "{questions:?}");
        // The same questions counted without the clock (all at one instant) are all too
        // recent to say anything: the share stays the prior.
        let mut instant = GroupGrowth::default();
        for _ in 0..300 {
            instant.observe(None, 3, 0.0);
        }
        assert!(
            (instant.first_share() - PRIOR_FIRST_SHARE).abs() < 1e-9,
            "{instant:?}"
        );
    }

    #[test]
    fn a_copy_is_credited_with_what_it_saves_the_prefix_queueing_at_its_holder() {
        // The holder: 200 ms of queue for a request that needs 50 ms of a lane (of 2).
        let holder = Prediction {
            uncached_tokens: 50,
            ms_per_token: 1.0,
            lanes: 2,
            queue_requests: 4.0,
            queue_ms: 200.0,
            ..Prediction::default()
        };
        let idle = Prediction::default();
        // 30 starts/s: 1.5 s of lane time per second over 2 lanes, 75% busy; 30 × 0.2 s = 6
        // sharers waiting, weighted 0.75, each saving half the 200 ms.
        let credit = copy_credit_ms(&holder, &idle, 30.0);
        assert!((credit - 0.5 * 6.0 * 0.75 * 200.0).abs() < 1e-9, "{credit}");
        // A rarer prefix earns less than in proportion: its queue is mostly others' work.
        let rare = copy_credit_ms(&holder, &idle, 3.0);
        assert!((rare - 0.5 * 0.6 * 0.075 * 200.0).abs() < 1e-9, "{rare}");
        // Utilization is at most 1.
        let flood = copy_credit_ms(&holder, &idle, 1000.0);
        assert!((flood - 0.5 * 200.0 * 200.0).abs() < 1e-9, "{flood}");
        // No credit where the candidate queues too, where the holder does not, or for a prefix
        // nobody starts on; nothing absurd gets through.
        let queued = Prediction {
            queue_requests: 1.0,
            queue_ms: 50.0,
            ..Prediction::default()
        };
        assert_eq!(copy_credit_ms(&holder, &queued, 30.0), 0.0);
        assert_eq!(copy_credit_ms(&idle, &idle, 30.0), 0.0);
        assert_eq!(copy_credit_ms(&holder, &idle, 0.0), 0.0);
        for bad in [f64::NAN, f64::INFINITY, -5.0] {
            assert_eq!(copy_credit_ms(&holder, &idle, bad), 0.0, "{bad}");
        }
        // The credit comes off the cost, once.
        let p = Prediction {
            cost_ms: 500.0,
            ..Prediction::default()
        };
        let credited = p.with_copy_credit(120.0).with_copy_credit(100.0);
        assert_eq!((credited.copy_credit_ms, credited.cost_ms), (100.0, 400.0));
        assert_eq!(p.with_copy_credit(f64::NAN).cost_ms, 500.0);
    }

    #[test]
    fn prefix_rates_measure_starts_per_second_from_the_first_one_seen() {
        let mut rates = PrefixRates::default();
        assert_eq!(rates.of(7, 0.0).per_second, 0.0);
        // 30 requests/s for half a second: the rate is measured over what was seen.
        for i in 0..15 {
            rates.record(7, f64::from(i) * 1000.0 / 30.0);
        }
        let early = rates.of(7, 500.0).per_second;
        assert!((early - 30.0).abs() < 3.0, "{early}");
        // Steady for a minute: the count over the window, about the rate.
        for i in 15..1800 {
            rates.record(7, f64::from(i) * 1000.0 / 30.0);
        }
        let steady = rates.of(7, 60_000.0);
        assert!((steady.per_second - 30.0).abs() < 1.5, "{steady:?}");
        // The decayed count is the rate over the window (10 s): what the bounded share
        // compares with the endpoints' counts of requests.
        assert!((steady.count - 300.0).abs() < 15.0, "{steady:?}");
        // It fades once the prefix stops.
        assert!(rates.of(7, 120_000.0).per_second < 0.1);
        // A colliding prefix does not take a busy one's slot; it does take a faded one's.
        let other = 7 + PrefixRates::SLOTS as u64;
        rates.record(7, 120_000.0);
        for _ in 0..3 {
            rates.record(7, 120_000.0);
        }
        rates.record(other, 120_001.0);
        assert_eq!(rates.of(other, 121_000.0).per_second, 0.0);
        assert!(rates.of(7, 121_000.0).per_second > 0.0);
        rates.record(other, 500_000.0);
        rates.record(other, 500_100.0);
        assert!(rates.of(other, 500_200.0).per_second > 0.0);
        assert_eq!(rates.of(7, 500_200.0).per_second, 0.0);
        // Hash 0 is no prefix, a clock that goes back reads nothing, garbage is ignored.
        rates.record(0, 1.0);
        assert_eq!(rates.of(0, 2.0).per_second, 0.0);
        assert_eq!(rates.of(other, 0.0).per_second, 0.0);
        rates.record(9, f64::NAN);
        assert_eq!(rates.of(9, 1.0).per_second, 0.0);
    }

    #[test]
    fn gaps_are_learned_and_absurd_ones_refused() {
        let mut growth = GroupGrowth::default();
        assert_eq!(growth.mean_gap_ms(), PRIOR_GAP_MS);
        for (bad, why) in [
            (-1.0, ObservationError::BadGap),
            (f64::NAN, ObservationError::BadGap),
            (f64::INFINITY, ObservationError::BadGap),
            (10.0 * MAX_GAP_MS, ObservationError::TooLong),
        ] {
            assert_eq!(growth.observe_gap(bad), Err(why), "{bad}");
        }
        assert_eq!(growth, GroupGrowth::default());
        assert_eq!(
            growth.observe_gap(0.0),
            Ok(()),
            "two requests in the same millisecond"
        );
        growth = GroupGrowth::default();
        for _ in 0..200 {
            growth.observe_gap(1500.0).unwrap();
        }
        assert!((growth.mean_gap_ms() - 1500.0).abs() < 0.05 * 1500.0);
        // Pooled with another worker's evidence, the mean is both's.
        let mut other = GroupGrowth::default();
        for _ in 0..200 {
            other.observe_gap(500.0).unwrap();
        }
        growth.add(&other);
        assert!((growth.mean_gap_ms() - 1000.0).abs() < 0.05 * 1000.0);
    }

    #[test]
    fn tenants_questions_do_not_dilute_how_conversations_grow() {
        // A gateway carrying both: every other request is a tenant's question (a first turn
        // never followed), the rest are turns of 40-turn conversations. One share of
        // continuing requests would say 0.5; the later share sees the conversations alone.
        let mut mixed = GroupGrowth::default();
        let mut chat = GroupGrowth::default();
        for i in 0..4000 {
            let turn = match (i / 2) % 40 {
                0 => None,
                1 => Some(Turn::First),
                _ => Some(Turn::Later),
            };
            let t = i as f64 * 50.0;
            if i % 2 == 0 {
                mixed.observe(None, 2, t);
            } else {
                if turn.is_some() {
                    mixed.observe_gap(100.0).unwrap();
                    chat.observe_gap(100.0).unwrap();
                }
                mixed.observe(turn, 6, t);
                chat.observe(turn, 6, t);
            }
        }
        assert_eq!(mixed.later_share(), chat.later_share());
        assert!(mixed.later_share() > 0.94, "{mixed:?}");
        assert!(
            (mixed.live_group_blocks() - chat.live_group_blocks()).abs()
                < 0.05 * chat.live_group_blocks(),
            "{mixed:?} {chat:?}"
        );
        // A first turn is expected to grow less where most first turns are never followed.
        assert!(
            mixed.first_share() < chat.first_share() - 0.2,
            "{mixed:?} {chat:?}"
        );
    }

    proptest::proptest! {
        #[test]
        fn counts_decayed_once_per_instant_are_the_counts_decayed_one_by_one(
            counts in proptest::collection::vec(-10.0f64..1e6, 1..8),
            at_ms in -1e6f64..1e6,
            now_ms in -1e6f64..1e7,
            gap_ms in 0.0f64..1e5,
            peer in proptest::collection::vec((0usize..9, -1.0f64..1e3), 0..12),
            peer_at_ms in -1e6f64..1e7,
        ) {
            let live = LiveGroups { count: counts.clone(), at_ms };
            let at = live.at(now_ms, gap_ms);
            for e in 0..counts.len() + 2 {
                proptest::prop_assert_eq!(at.on(e).to_bits(), live.on(e, now_ms, gap_ms).to_bits());
            }
            let mut one_by_one = RecentRequests(live.clone());
            let mut at_once = one_by_one.clone();
            let keep = at_once.keep_since(peer_at_ms);
            for &(e, count) in &peer {
                one_by_one.add(e, count, peer_at_ms);
                at_once.add_kept(e, count, keep);
            }
            proptest::prop_assert_eq!(at_once, one_by_one);
        }
    }

    #[test]
    fn live_groups_count_the_requests_that_will_be_followed_for_about_one_gap() {
        let gap = 1000.0;
        let mut live = LiveGroups::new(3);
        // Two requests on endpoint 0 and one on 1, each followed with probability 0.75.
        live.observe(0, 0.75, 0.0, gap);
        live.observe(0, 0.75, 0.0, gap);
        live.observe(1, 0.75, 0.0, gap);
        assert_eq!(live.on(0, 0.0, gap), 1.5);
        assert_eq!(live.on(1, 0.0, gap), 0.75);
        // One gap later most have been followed or have ended: e^-1 of the count is left.
        assert!((live.on(0, gap, gap) - 1.5 / std::f64::consts::E).abs() < 1e-12);
        // Little's law: a group that sends a request every gap, forever, counts its share on
        // average over the gap (between 1.58 and 0.58 of it).
        let mut steady = LiveGroups::new(1);
        let mut t = 0.0;
        for _ in 0..50 {
            steady.observe(0, 0.9, t, gap);
            t += gap;
        }
        let mean: f64 = (0..100)
            .map(|k| steady.on(0, t - gap + gap * k as f64 / 100.0, gap))
            .sum::<f64>()
            / 100.0;
        assert!((mean - 0.9).abs() < 0.02, "{mean}");
        // A request that is never followed is forgotten: questions nobody continues do not
        // pile up however many come.
        let mut questions = LiveGroups::new(1);
        for i in 0..10_000 {
            questions.observe(0, 0.3, i as f64 * 100.0, gap);
        }
        assert!(questions.on(0, 1_000_000.0, gap) < 0.3 * 10.0 * 1.1);
        // Garbage shares add nothing, a clock that is not a number changes nothing, a clock
        // that goes back decays nothing; unknown endpoints are 0; never negative.
        let before = live.clone();
        live.observe(2, f64::NAN, 0.0, gap);
        live.observe(2, -4.0, f64::NAN, gap);
        assert_eq!(live, before);
        assert_eq!(live.on(0, -50.0, gap), 1.5);
        assert_eq!(live.on(9, 0.0, gap), 0.0);
        live.count[1] = -2.0;
        assert_eq!(live.on(1, 0.0, gap), 0.0);
        // A changed pool keeps each endpoint's count by identity.
        let moved = live.remapped(&[Some(2), None, Some(0)]);
        assert_eq!(moved.on(0, 0.0, gap), live.on(2, 0.0, gap));
        assert_eq!(moved.on(1, 0.0, gap), 0.0);
        assert_eq!(moved.on(2, 0.0, gap), live.on(0, 0.0, gap));
    }

    #[test]
    fn an_over_full_cache_still_weighs_less_than_a_fuller_one() {
        let room = CacheRoom {
            capacity_blocks: 100,
            believed_blocks: 50,
        };
        assert_eq!(room.pressure_with(0.0), 0.5);
        assert_eq!(room.pressure_with(50.0), 1.0);
        // Past full it still grows, smoothly and never past 2.
        let over = [60.0, 150.0, 450.0, 1e9];
        for w in over.windows(2) {
            assert!(room.pressure_with(w[0]) < room.pressure_with(w[1]));
        }
        assert!(room.pressure_with(1e12) <= 2.0);
        assert!((room.pressure_with(50.001) - room.pressure_with(49.999) - 0.00002).abs() < 1e-9);
        // Unknown capacity prices nothing; garbage growth counts as none.
        assert_eq!(CacheRoom::default().pressure_with(10.0), 0.0);
        assert_eq!(room.pressure_with(f64::NAN), 0.0);
    }

    #[test]
    fn configuration_bounds_are_checked() {
        assert!(LatencyConfig::default().validate().is_ok());
        let bad = [
            LatencyConfig {
                prefill_ms_per_token: 0.0,
                ..LatencyConfig::default()
            },
            LatencyConfig {
                min_ms_per_token: 2.0,
                max_ms_per_token: 1.0,
                ..LatencyConfig::default()
            },
            LatencyConfig {
                lanes: 0,
                ..LatencyConfig::default()
            },
            LatencyConfig {
                overhead_ms: f64::NAN,
                ..LatencyConfig::default()
            },
            LatencyConfig {
                fleet_tokens: -1.0,
                ..LatencyConfig::default()
            },
        ];
        for c in bad {
            assert!(c.validate().is_err(), "{c:?}");
        }
    }
}
