//! Router and plugin configuration, with validation that every front end shares: the plugin
//! refuses a bad configuration at `on_configure`, the CLI at start-up, and the Kubernetes
//! manifest tests check the JSON embedded in manifests with this same code.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::hashing::BlockIdentity;
use crate::hashing::HashConfig;
use crate::index::DEFAULT_CAPACITY_BLOCKS;
use crate::latency::LatencyConfig;
use crate::scorer::MatchLength;
use crate::tokenizer::NonAscii;

#[derive(Debug, Clone, PartialEq, Error)]
pub enum ConfigError {
    #[error("unknown policy {0:?} (expected one of: latency, prefix, prefix-only, least-queue, round-robin, random)")]
    UnknownPolicy(String),
    #[error("invalid weights {0:?}: expected name=value pairs such as prefix=3,queue=2,kv=2")]
    BadWeights(String),
    #[error("{field} must be {expected}, got {got}")]
    OutOfRange {
        field: &'static str,
        expected: &'static str,
        got: String,
    },
    #[error("invalid configuration JSON: {0}")]
    Json(String),
    #[error("endpoints: at least one endpoint is required (or configure discovery)")]
    NoEndpoints,
    #[error("endpoints and discovery are exclusive: list the endpoints, or discover them from the pool cluster")]
    EndpointsAndDiscovery,
    #[error("endpoints[{index}].address {address:?} is not ip:port")]
    BadAddress { index: usize, address: String },
    #[error("endpoints: name {0:?} is used twice")]
    DuplicateName(String),
    #[error("endpoints: address {0:?} is used twice")]
    DuplicateAddress(String),
    #[error("destination_header {0:?} is not a valid lower-case HTTP header name")]
    BadHeader(String),
}

pub(crate) fn out_of_range(
    field: &'static str,
    expected: &'static str,
    got: impl Shown,
) -> ConfigError {
    ConfigError::OutOfRange {
        field,
        expected,
        got: got.shown(),
    }
}

/// A configured value as an error message shows it.
pub(crate) trait Shown {
    fn shown(self) -> String;
}

/// Whole numbers as integers (`got 0`, not `got 0.0`), others through `zmij`, the formatter
/// serde_json's own messages use. Not `core::fmt`'s: its float code (~14 KB of the plugin's
/// `.wasm`, docs/benchmarks.md) was there for these messages alone.
impl Shown for f64 {
    fn shown(self) -> String {
        // Exactly representable, and far inside i64.
        if self.fract() == 0.0 && self.abs() < 1e15 {
            (self as i64).to_string()
        } else {
            zmij::Buffer::new().format(self).to_string()
        }
    }
}

macro_rules! shown_as_displayed {
    ($($t:ty),*) => {$(
        impl Shown for $t {
            fn shown(self) -> String {
                self.to_string()
            }
        }
    )*};
}
shown_as_displayed!(i32, u32, u64, usize, &str, &String);

/// Routing policies: `latency` is the product; the others are baselines in the same router so
/// comparisons differ only in the decision rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// The lowest predicted time to first token (queue wait + uncached prefill), plus the
    /// prefill that evictions will cost later (see [`crate::latency`]).
    #[default]
    Latency,
    /// llm-d's default profile: weighted prefix-cache + queue + kv-cache-utilization +
    /// no-hit-lru scorers behind a saturation filter.
    Prefix,
    /// The prefix-cache scorer alone: locality without any load signal.
    PrefixOnly,
    LeastQueue,
    RoundRobin,
    Random,
}

impl Policy {
    pub const ALL: [Policy; 6] = [
        Policy::Latency,
        Policy::Prefix,
        Policy::PrefixOnly,
        Policy::LeastQueue,
        Policy::RoundRobin,
        Policy::Random,
    ];

    /// The scorer outputs (fields of `router::EndpointScores`) this policy's score is made
    /// of; the others are computed for reference. `latency` scores with its prediction instead
    /// (see [`Policy::predicts`]).
    pub fn scorers(self) -> &'static [&'static str] {
        match self {
            Policy::Prefix => &["prefix", "queue", "kv_cache", "no_hit_lru"],
            Policy::PrefixOnly => &["prefix"],
            Policy::LeastQueue => &["queue"],
            Policy::Latency | Policy::RoundRobin | Policy::Random => &[],
        }
    }

    /// The policy picks by a predicted cost (`router::EndpointScores::prediction`), lowest wins.
    pub fn predicts(self) -> bool {
        self == Policy::Latency
    }

    /// The names of [`Policy::ALL`], in its order: what the config, the flags and the
    /// decisions say.
    const NAMES: [&'static str; 6] = [
        "latency",
        "prefix",
        "prefix-only",
        "least-queue",
        "round-robin",
        "random",
    ];

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

impl<'de> Deserialize<'de> for Policy {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(UnitVariant(&Policy::NAMES))
            .map(|i| Policy::ALL[i])
    }
}

/// A unit enum's variant by its name, as its index in `.0`: a string, and serde's message for
/// an unknown name (``unknown variant `x`, expected one of …``, as derived). One visitor for
/// every such enum of the configuration: a derived deserializer per enum cost ~1.5 KB of the
/// plugin's `.wasm` each (2,931 bytes for these two). Unlike the derived one it refuses
/// serde's map spelling of a unit variant (`{"latency": null}`), which no one writes, and says
/// what it wanted for any other type (`invalid type: integer `3`, expected a string`, where
/// the derived one said `expected value`).
struct UnitVariant(&'static [&'static str]);

impl serde::de::Visitor<'_> for UnitVariant {
    type Value = usize;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<usize, E> {
        self.0
            .iter()
            .position(|name| *name == v)
            .ok_or_else(|| E::unknown_variant(v, self.0))
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Policy {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Policy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| ConfigError::UnknownPolicy(s.to_string()))
    }
}

/// Scorer weights of the `prefix` policy (llm-d chart defaults: prefix 3, queue 2, kv 2).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Weights {
    pub prefix: f64,
    pub queue: f64,
    pub kv_cache: f64,
    /// Spreads cold prefixes across endpoints; 0 turns the scorer off.
    pub no_hit_lru: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Weights {
            prefix: 3.0,
            queue: 2.0,
            kv_cache: 2.0,
            no_hit_lru: 1.0,
        }
    }
}

impl Weights {
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, w) in [
            ("weights.prefix", self.prefix),
            ("weights.queue", self.queue),
            ("weights.kv_cache", self.kv_cache),
            ("weights.no_hit_lru", self.no_hit_lru),
        ] {
            if !(w.is_finite() && w >= 0.0) {
                return Err(out_of_range(field, "a finite number >= 0", w));
            }
        }
        Ok(())
    }
}

impl fmt::Display for Weights {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "prefix={},queue={},kv={},no-hit-lru={}",
            self.prefix, self.queue, self.kv_cache, self.no_hit_lru
        )
    }
}

impl FromStr for Weights {
    type Err = ConfigError;

    /// `prefix=3,queue=2,kv=2,no-hit-lru=1`; names left out keep their defaults.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ConfigError::BadWeights(s.to_string());
        let mut weights = Weights::default();
        for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').ok_or_else(bad)?;
            let value: f64 = value.trim().parse().map_err(|_| bad())?;
            let slot = match name.trim() {
                "prefix" | "prefix-cache" => &mut weights.prefix,
                "queue" => &mut weights.queue,
                "kv" | "kv-cache" | "kv_cache" | "kv-cache-utilization" => &mut weights.kv_cache,
                "no-hit-lru" | "no_hit_lru" | "lru" => &mut weights.no_hit_lru,
                _ => return Err(bad()),
            };
            *slot = value;
        }
        weights.validate()?;
        Ok(weights)
    }
}

/// The saturation filter of the `prefix` policy: before scoring, endpoints whose queue or
/// KV-cache usage is at or above a threshold are set aside while some endpoint is below both
/// (the Gateway API Inference Extension's default scheduler filters the same way). Without it
/// a long prefix match outweighs any queue, because the queue scorer saturates at its weight.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SaturationFilter {
    /// Waiting requests at which an endpoint counts as saturated.
    pub queue_threshold: f64,
    /// KV-cache usage (0..1) at which an endpoint counts as saturated.
    pub kv_threshold: f64,
}

impl Default for SaturationFilter {
    fn default() -> Self {
        SaturationFilter {
            queue_threshold: 5.0,
            kv_threshold: 0.8,
        }
    }
}

impl SaturationFilter {
    /// Never filters.
    pub const OFF: SaturationFilter = SaturationFilter {
        queue_threshold: f64::INFINITY,
        kv_threshold: f64::INFINITY,
    };

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.queue_threshold.is_nan() || self.queue_threshold < 1.0 {
            return Err(out_of_range(
                "saturation.queue_threshold",
                "at least 1",
                self.queue_threshold,
            ));
        }
        if self.kv_threshold.is_nan() || self.kv_threshold <= 0.0 {
            return Err(out_of_range(
                "saturation.kv_threshold",
                "above 0",
                self.kv_threshold,
            ));
        }
        Ok(())
    }
}

/// Everything that decides a routing choice.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RouterConfig {
    pub policy: Policy,
    pub weights: Weights,
    pub saturation: SaturationFilter,
    pub match_length: MatchLength,
    pub hash: HashConfig,
    pub index_capacity_blocks: usize,
    pub latency: LatencyConfig,
    /// Seeds tie-breaking and the `random` policy.
    pub seed: u64,
    /// `latency` only: where a group is placed (see [`Placement`]).
    #[serde(default)]
    pub placement: Placement,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            policy: Policy::Latency,
            weights: Weights::default(),
            saturation: SaturationFilter::default(),
            match_length: MatchLength::default(),
            hash: HashConfig::default(),
            index_capacity_blocks: DEFAULT_CAPACITY_BLOCKS,
            latency: LatencyConfig::default(),
            seed: 0,
            placement: Placement::Local,
        }
    }
}

impl RouterConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.weights.validate()?;
        self.saturation.validate()?;
        let w = self.match_length.weight;
        if !(0.0..=1.0).contains(&w) {
            return Err(out_of_range("match_length.weight", "in 0..1", w));
        }
        let scale = self.match_length.scale;
        if !(scale.is_finite() && scale > 0.0) {
            return Err(out_of_range("match_length.scale", "a number > 0", scale));
        }
        if !(1..=4096).contains(&self.hash.block_size) {
            return Err(out_of_range(
                "block_size",
                "in 1..4096",
                self.hash.block_size,
            ));
        }
        if self.index_capacity_blocks == 0 {
            return Err(out_of_range("index_capacity_blocks", "at least 1", 0));
        }
        self.latency.validate()?;
        Ok(())
    }
}

/// One model-server endpoint the plugin may route to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointConfig {
    pub name: String,
    /// `ip:port`, exactly as Envoy's override_host expects it (a cluster member's address).
    pub address: String,
}

/// How the plugin scrapes each endpoint's metrics.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScrapeConfig {
    /// Envoy cluster the callouts go through; it must exist in Envoy's configuration.
    pub cluster: String,
    pub path: String,
    pub interval_ms: u64,
    pub timeout_ms: u64,
    /// A scrape older than this makes the endpoint unmeasured.
    pub stale_after_ms: u64,
    /// Consecutive failed scrapes after which the endpoint is taken out of rotation until it
    /// answers again.
    pub failures_to_down: u32,
}

impl Default for ScrapeConfig {
    fn default() -> Self {
        ScrapeConfig {
            cluster: "prefixroute_metrics".into(),
            path: "/metrics".into(),
            interval_ms: 1000,
            timeout_ms: 500,
            stale_after_ms: 5000,
            failures_to_down: 2,
        }
    }
}

/// Where the plugin learns the pool's members at run time instead of a static `endpoints`
/// list: Envoy's admin interface (`/clusters?format=json`, see core's `discovery`), reached by
/// callouts through a loopback-only cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoveryConfig {
    /// The cluster the callouts go through: one member, Envoy's own admin address.
    pub cluster: String,
    /// The cluster whose members are the pool (the one override_host balances).
    pub pool_cluster: String,
    pub path: String,
    pub interval_ms: u64,
    pub timeout_ms: u64,
    /// Endpoints the shared prefix index is sized for. The table cannot grow at run time
    /// (shared data cannot delete keys), so size it for the largest pool you expect; more
    /// members still route, with a fuller table.
    pub expected_endpoints: usize,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        DiscoveryConfig {
            cluster: "prefixroute_admin".into(),
            pool_cluster: "prefixroute_pool".into(),
            path: "/clusters?format=json".into(),
            interval_ms: 1000,
            timeout_ms: 500,
            expected_endpoints: 16,
        }
    }
}

impl DiscoveryConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.cluster.is_empty() {
            return Err(out_of_range("discovery.cluster", "a cluster name", "\"\""));
        }
        if self.pool_cluster.is_empty() {
            return Err(out_of_range(
                "discovery.pool_cluster",
                "a cluster name",
                "\"\"",
            ));
        }
        if !self.path.starts_with('/') {
            return Err(out_of_range(
                "discovery.path",
                "a path starting with /",
                &self.path,
            ));
        }
        if self.interval_ms < 100 {
            return Err(out_of_range(
                "discovery.interval_ms",
                "at least 100",
                self.interval_ms,
            ));
        }
        if self.timeout_ms == 0 || self.timeout_ms > self.interval_ms * 10 {
            return Err(out_of_range(
                "discovery.timeout_ms",
                "between 1 and 10 × interval_ms",
                self.timeout_ms,
            ));
        }
        if !(1..=1024).contains(&self.expected_endpoints) {
            return Err(out_of_range(
                "discovery.expected_endpoints",
                "between 1 and 1024",
                self.expected_endpoints,
            ));
        }
        Ok(())
    }
}

/// Which belief the router routes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum IndexMode {
    /// What the router sent where, aged like the servers' LRU caches (no server help).
    #[default]
    Approximate,
    /// What the servers' KV events report (through `prefixroute kv-events`), plus a short
    /// speculation for requests just routed; an endpoint without events stays approximate.
    Precise,
}

impl IndexMode {
    const ALL: [IndexMode; 2] = [IndexMode::Approximate, IndexMode::Precise];
    const NAMES: [&'static str; 2] = ["approximate", "precise"];

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }

    /// What a router with this index hashes its blocks from: their text, or their token ids
    /// as the servers hash them when its belief is built from their KV events.
    pub fn block_identity(self) -> BlockIdentity {
        match self {
            IndexMode::Approximate => BlockIdentity::Text,
            IndexMode::Precise => BlockIdentity::TokenIds,
        }
    }
}

impl<'de> Deserialize<'de> for IndexMode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(UnitVariant(&IndexMode::NAMES))
            .map(|i| IndexMode::ALL[i])
    }
}

impl<'de> Deserialize<'de> for NonAscii {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(UnitVariant(&NonAscii::NAMES))
            .map(|i| NonAscii::ALL[i])
    }
}

impl FromStr for IndexMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        IndexMode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown index {s:?} (expected approximate or precise)"))
    }
}

/// Where a group of requests is placed: by this router's own view alone, or also at a home every
/// router computes the same way, so that gateways that share nothing agree (the plugin's
/// `consistent_placement: true`; `prefixroute serve|simulate --placement consistent`).
///
/// Several Envoys with `index: approximate` each believe only what they routed. A tenant's
/// questions spread over the gateways: each gateway places the tenant where its own view says,
/// the fleet holds one copy of the system prompt per gateway, and with caches that hold a third
/// of the tenants the copies push each other out (the simulator's 24-tenant trace: 81% of the
/// upper bound's hit rate with three gateways, 94% with two). `consistent` gives every group a
/// *home*: rendezvous hashing of the group's head ([`crate::router::group_head`]) over the
/// eligible endpoints, the same on every gateway. The router chooses as if the home held the
/// head (as if it had routed it there) and, among near-ties, places the group there; load and
/// cache pressure still move a request away when the prediction says that is faster. The
/// request is accounted with what the router really believes ([`crate::Router::prediction_for`]).
/// What it costs:
/// homes are spread by hashing, not by load (24 tenants over 6 replicas: max/mean 1.6), so one
/// gateway alone should keep `local`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// This router's belief, the requests it has in flight and the scrape.
    #[default]
    Local,
    /// Also a home per group that every router computes alike (for several gateways).
    Consistent,
}

impl Placement {
    const ALL: [Placement; 2] = [Placement::Local, Placement::Consistent];
    const NAMES: [&'static str; 2] = ["local", "consistent"];

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

impl<'de> Deserialize<'de> for Placement {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(UnitVariant(&Placement::NAMES))
            .map(|i| Placement::ALL[i])
    }
}

impl FromStr for Placement {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Placement::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown placement {s:?} (expected local or consistent)"))
    }
}

/// The longest a relay holds a feed fetch ([`KvEventsConfig::wait_ms`]); the relay caps a
/// request's `wait_ms` to it too.
pub const MAX_FEED_WAIT_MS: u64 = 30_000;

/// Where `index: precise` gets the servers' truth: the relay's feed, fetched by callouts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvEventsConfig {
    /// The cluster whose member is the relay (`prefixroute kv-events --listen`).
    pub cluster: String,
    pub path: String,
    pub interval_ms: u64,
    pub timeout_ms: u64,
    /// How long the relay may hold a fetch that has nothing new (a long poll): it answers as
    /// soon as a server reports a change, and the plugin fetches again at once, so a change
    /// reaches every gateway within milliseconds instead of up to `interval_ms`. 0 polls every
    /// `interval_ms`, which then also spaces fetches after a failure or an answer from a relay
    /// that did not wait. Why: a second gateway learns of the first one's new placements only
    /// from the feed, and meanwhile places the same new prefix elsewhere (docs/benchmarks.md).
    pub wait_ms: u64,
    /// Changes fetched per callout at most.
    pub page_changes: u32,
    /// Clock positions a block the router recorded (not yet in the server's events) stays
    /// believed: long enough for the events of a request just routed to arrive.
    pub speculative_blocks: u64,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            cluster: "prefixroute_kv".into(),
            path: "/v1/kv/feed".into(),
            interval_ms: 200,
            timeout_ms: 500,
            wait_ms: 1000,
            page_changes: 65_536,
            speculative_blocks: 4096,
        }
    }
}

impl KvEventsConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.cluster.is_empty() {
            return Err(out_of_range("kv_events.cluster", "a cluster name", "\"\""));
        }
        if !self.path.starts_with('/') {
            return Err(out_of_range(
                "kv_events.path",
                "a path starting with /",
                &self.path,
            ));
        }
        if self.interval_ms < 10 {
            return Err(out_of_range(
                "kv_events.interval_ms",
                "at least 10",
                self.interval_ms,
            ));
        }
        if self.timeout_ms == 0 || self.timeout_ms > self.interval_ms.max(1) * 50 {
            return Err(out_of_range(
                "kv_events.timeout_ms",
                "between 1 and 50 × interval_ms",
                self.timeout_ms,
            ));
        }
        if self.wait_ms > MAX_FEED_WAIT_MS {
            return Err(out_of_range(
                "kv_events.wait_ms",
                "at most 30000",
                self.wait_ms,
            ));
        }
        if self.page_changes == 0 {
            return Err(out_of_range("kv_events.page_changes", "at least 1", 0));
        }
        if self.speculative_blocks == 0 {
            return Err(out_of_range(
                "kv_events.speculative_blocks",
                "at least 1",
                0,
            ));
        }
        Ok(())
    }
}

/// The header that carries the chosen `ip:port` to Envoy's `override_host` policy: the Gateway
/// API Inference Extension's contract.
pub const DEFAULT_DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";

/// The plugin's JSON configuration (the filter's `configuration` value).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PluginConfig {
    /// A static pool; empty when `discovery` is set.
    pub endpoints: Vec<EndpointConfig>,
    /// Learn the pool from Envoy's view of its cluster instead (see [`DiscoveryConfig`]).
    pub discovery: Option<DiscoveryConfig>,
    /// Next-best endpoints the destination header lists after the chosen one
    /// (`ip:port,ip:port,…`), for the route's retry policy to walk when the chosen one refuses
    /// the connection or resets the stream.
    pub failover: usize,
    /// The router's belief: its own (`approximate`) or the servers' KV events (`precise`).
    pub index: IndexMode,
    /// For several gateways in front of one pool with `index: approximate`: every group also
    /// gets a home all of them compute alike ([`Placement::Consistent`]).
    pub consistent_placement: bool,
    pub kv_events: KvEventsConfig,
    pub policy: Policy,
    pub weights: Weights,
    pub saturation: SaturationFilter,
    pub match_length: MatchLength,
    pub block_size: usize,
    /// What the tokenizer does with a character outside ASCII: `pieces` (one token each) or
    /// `skip` (as llm-d-inference-sim does; what `index: precise` in front of it needs).
    pub non_ascii: NonAscii,
    /// Believed-cached blocks per endpoint when the endpoint does not report its capacity
    /// (`vllm:cache_config_info`'s `num_gpu_blocks`); a reported capacity bounds it further.
    pub index_capacity_blocks: usize,
    /// Priors and bounds of the `latency` policy's model.
    pub latency: LatencyConfig,
    pub scrape: ScrapeConfig,
    /// Request header that carries the chosen `ip:port` to Envoy's override_host policy.
    pub destination_header: String,
    /// Bodies larger than this are not parsed; the request is routed by fallback.
    pub max_body_bytes: usize,
    /// Prefix of the scraped metric names (vLLM: `vllm:`).
    pub metric_prefix: String,
    /// Only count metric series of this model (`model_name` label); all when unset.
    pub model: Option<String>,
    pub seed: u64,
}

impl Default for PluginConfig {
    fn default() -> Self {
        let router = RouterConfig::default();
        PluginConfig {
            endpoints: Vec::new(),
            discovery: None,
            failover: 2,
            index: IndexMode::Approximate,
            consistent_placement: false,
            kv_events: KvEventsConfig::default(),
            policy: router.policy,
            weights: router.weights,
            saturation: router.saturation,
            match_length: router.match_length,
            block_size: router.hash.block_size,
            non_ascii: router.hash.non_ascii,
            index_capacity_blocks: router.index_capacity_blocks,
            latency: router.latency,
            scrape: ScrapeConfig::default(),
            destination_header: DEFAULT_DESTINATION_HEADER.into(),
            max_body_bytes: 4 << 20,
            metric_prefix: "vllm:".into(),
            model: None,
            seed: 0,
        }
    }
}

/// `ip:port` with a numeric IPv4 or bracketed IPv6 address and a non-zero port: exactly the
/// strings `str::parse::<std::net::SocketAddr>` accepts (dotted quads without leading zeros,
/// IPv6 with one `::` and an optional trailing dotted quad, a `%scope` in brackets, a port with
/// leading zeros allowed), tested against it. Why not call std's parser: the plugin validates
/// addresses but never needs their bytes, and std's parser is 3.8 KB of the `.wasm`.
pub fn is_ip_port(address: &str) -> bool {
    let mut p = Parser(address.as_bytes());
    let host = if p.eat(b'[') {
        ipv6(&mut p)
            && (!p.eat(b'%')
                || p.number(10, usize::MAX, true, u64::from(u32::MAX))
                    .is_some())
            && p.eat(b']')
    } else {
        ipv4(&mut p)
    };
    host && p.eat(b':')
        && matches!(p.number(10, usize::MAX, true, u64::from(u16::MAX)), Some(port) if port != 0)
        && p.0.is_empty()
}

/// What is left of an address being read.
#[derive(Clone, Copy)]
struct Parser<'a>(&'a [u8]);

impl Parser<'_> {
    fn eat(&mut self, b: u8) -> bool {
        let ok = self.0.first() == Some(&b);
        if ok {
            self.0 = &self.0[1..];
        }
        ok
    }

    /// A number in `radix` of at most `max_digits` digits and at most `max`; with
    /// `zero_prefix` false a leading `0` must be the whole number. Reads nothing on `None`.
    fn number(
        &mut self,
        radix: u32,
        max_digits: usize,
        zero_prefix: bool,
        max: u64,
    ) -> Option<u64> {
        let digits = self
            .0
            .iter()
            .take_while(|b| (**b as char).is_digit(radix))
            .count();
        if digits == 0 || digits > max_digits || (!zero_prefix && digits > 1 && self.0[0] == b'0') {
            return None;
        }
        let mut value: u64 = 0;
        for &b in &self.0[..digits] {
            value = value * u64::from(radix) + u64::from((b as char).to_digit(radix)?);
            if value > max {
                return None;
            }
        }
        self.0 = &self.0[digits..];
        Some(value)
    }
}

/// A dotted quad: four decimal octets of one to three digits, no leading zeros.
fn ipv4(p: &mut Parser) -> bool {
    let mut q = *p;
    for i in 0..4 {
        if (i > 0 && !q.eat(b'.')) || q.number(10, 3, false, 255).is_none() {
            return false;
        }
    }
    *p = q;
    true
}

/// Up to `limit` groups separated by `:` (a trailing dotted quad counts as two, if two are
/// left); how many, and whether the quad ended them. Reads no separator it cannot follow.
fn groups(p: &mut Parser, limit: usize) -> (usize, bool) {
    for i in 0..limit {
        if i + 1 < limit {
            let mut q = *p;
            if (i == 0 || q.eat(b':')) && ipv4(&mut q) {
                *p = q;
                return (i + 2, true);
            }
        }
        let mut q = *p;
        if (i > 0 && !q.eat(b':')) || q.number(16, 4, true, 0xffff).is_none() {
            return (i, false);
        }
        *p = q;
    }
    (limit, false)
}

/// Eight groups, or fewer around one `::` (a dotted quad only after it, or as the last two).
fn ipv6(p: &mut Parser) -> bool {
    let mut q = *p;
    let (head, quad) = groups(&mut q, 8);
    if head < 8 {
        if quad || !q.eat(b':') || !q.eat(b':') {
            return false;
        }
        groups(&mut q, 8 - (head + 1));
    }
    *p = q;
    true
}

fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// One step of a path into a configuration value.
enum Step<'a> {
    Key(&'a str),
    Index(usize),
}

fn child<'v>(node: &'v serde_json::Value, step: &Step) -> &'v serde_json::Value {
    match step {
        Step::Key(k) => &node[*k],
        Step::Index(i) => &node[*i],
    }
}

/// `value` cut down to the branch `path` takes (every object along it keeps only that key,
/// every list only that element), ending in the node it reaches, or in that node without its
/// child at `without`.
fn pruned(value: &serde_json::Value, path: &[Step], without: Option<&Step>) -> serde_json::Value {
    use serde_json::Value;
    let Some((step, rest)) = path.split_first() else {
        return match (value, without) {
            (Value::Object(map), Some(Step::Key(k))) => {
                // Inserted one by one: `collect` would link the B-tree's bulk build (a sort).
                let mut kept = serde_json::Map::new();
                for (key, v) in map.iter().filter(|(key, _)| key.as_str() != *k) {
                    kept.insert(key.clone(), v.clone());
                }
                Value::Object(kept)
            }
            (Value::Array(list), Some(Step::Index(i))) => {
                let mut kept = list.clone();
                kept.remove(*i);
                Value::Array(kept)
            }
            _ => value.clone(),
        };
    };
    let inner = pruned(child(value, step), rest, without);
    match step {
        Step::Key(k) => {
            let mut map = serde_json::Map::new();
            map.insert(k.to_string(), inner);
            Value::Object(map)
        }
        Step::Index(_) => Value::Array(vec![inner]),
    }
}

/// A configuration from its JSON value, through its text: serde_json's reader of text is in
/// the plugin already (request bodies), and reading a `Value` directly put serde_json's `Value`
/// deserializer, with the fields' visitors inlined, in the plugin beside it (1.1 KB of `.wasm`
/// net, docs/benchmarks.md). The error is serde_json's message without the position in that
/// text, which the operator never wrote.
fn decode_config(value: &serde_json::Value) -> Result<PluginConfig, String> {
    let text = serde_json::to_vec(value).map_err(|e| e.to_string())?;
    serde_json::from_slice::<PluginConfig>(&text).map_err(|e| {
        let message = e.to_string();
        let at = format!(" at line {} column {}", e.line(), e.column());
        match message.strip_suffix(&at) {
            Some(m) => m.to_string(),
            None => message,
        }
    })
}

/// Where in `value` the error `message` of deserializing a [`PluginConfig`] from it lies, as
/// `endpoints[0].address` (empty: at the top). The path descends, one step at a time, into the
/// child that on its own (the configuration cut down to it) fails with exactly this message
/// and without which it no longer does; it stops where no child is both, also where the same
/// error is in two places (then it names the object holding both). A missing field or a wrong
/// length is an object's or a list's error, so it never descends into a scalar for one; nor into the key of an unknown
/// variant (`{"variant": …}` is how an enum is spelled, the error is the enum's).
///
/// Why not `serde_path_to_error`, which tracks the path as serde walks: its wrapper is
/// instantiated for every type of the configuration, 15 KB of the plugin's `.wasm` for a path
/// only an error needs. This costs a few deserializations of small cut-down values, once, on
/// a broken configuration; a test checks it against `serde_path_to_error` on every field.
fn error_path(value: &serde_json::Value, message: &str) -> String {
    use serde_json::Value;
    let fails = |v: Value| decode_config(&v).is_err_and(|e| e == message);
    // Errors of an object or list as a whole: never at a scalar inside it.
    let whole = message.starts_with("missing field") || message.starts_with("invalid length");
    let mut path: Vec<Step> = Vec::new();
    let mut node = value;
    'descend: loop {
        let steps: Vec<Step> = match node {
            Value::Object(map) => map.keys().map(|k| Step::Key(k)).collect(),
            Value::Array(list) => (0..list.len()).map(Step::Index).collect(),
            _ => break,
        };
        for step in steps {
            let next = child(node, &step);
            if whole && !(next.is_object() || next.is_array()) {
                continue;
            }
            if matches!(step, Step::Key(k) if message.starts_with(&format!("unknown variant `{k}`")))
            {
                continue; // `{"variant": …}` is the enum's value: the error is the object's
            }
            path.push(step);
            if !fails(pruned(value, &path, None)) {
                path.pop();
                continue;
            }
            let Some(step) = path.pop() else {
                break 'descend;
            };
            if fails(pruned(value, &path, Some(&step))) {
                break 'descend; // the same error elsewhere too
            }
            path.push(step);
            node = next;
            continue 'descend;
        }
        break;
    }
    let mut text = String::new();
    for step in &path {
        match step {
            Step::Key(k) => {
                if !text.is_empty() {
                    text.push('.');
                }
                text.push_str(k);
            }
            Step::Index(i) => text.push_str(&format!("[{i}]")),
        }
    }
    text
}

impl PluginConfig {
    /// Parses and validates; an empty configuration is an error (there are no endpoints).
    pub fn from_json(bytes: &[u8]) -> Result<Self, ConfigError> {
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| ConfigError::Json(e.to_string()))?;
        Self::from_value(value)
    }

    /// Parses and validates an already decoded configuration. A type error names the field
    /// (`block_size: invalid type: …`), since the operator's text may have been re-encoded
    /// (a protobuf Struct) and a line/column would point at nothing they wrote.
    pub fn from_value(value: serde_json::Value) -> Result<Self, ConfigError> {
        let config = match decode_config(&value) {
            Ok(config) => config,
            Err(message) => {
                let path = error_path(&value, &message);
                return Err(ConfigError::Json(if path.is_empty() {
                    message
                } else {
                    format!("{path}: {message}")
                }));
            }
        };
        config.validate()?;
        Ok(config)
    }

    pub fn router_config(&self) -> RouterConfig {
        RouterConfig {
            policy: self.policy,
            weights: self.weights,
            saturation: self.saturation,
            match_length: self.match_length,
            hash: HashConfig {
                block_size: self.block_size,
                include_partial: true,
                non_ascii: self.non_ascii,
                identity: self.index.block_identity(),
            },
            index_capacity_blocks: self.index_capacity_blocks,
            latency: self.latency,
            seed: self.seed,
            placement: if self.consistent_placement {
                Placement::Consistent
            } else {
                Placement::Local
            },
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        match &self.discovery {
            Some(_) if !self.endpoints.is_empty() => {
                return Err(ConfigError::EndpointsAndDiscovery)
            }
            Some(discovery) => discovery.validate()?,
            None if self.endpoints.is_empty() => return Err(ConfigError::NoEndpoints),
            None => {}
        }
        self.kv_events.validate()?;
        if self.failover > 8 {
            return Err(out_of_range("failover", "between 0 and 8", self.failover));
        }
        for (index, endpoint) in self.endpoints.iter().enumerate() {
            if !is_ip_port(&endpoint.address) {
                return Err(ConfigError::BadAddress {
                    index,
                    address: endpoint.address.clone(),
                });
            }
            let earlier = &self.endpoints[..index];
            if earlier.iter().any(|e| e.name == endpoint.name) {
                return Err(ConfigError::DuplicateName(endpoint.name.clone()));
            }
            if earlier.iter().any(|e| e.address == endpoint.address) {
                return Err(ConfigError::DuplicateAddress(endpoint.address.clone()));
            }
        }
        if self.endpoints.len() > 1024 {
            return Err(out_of_range(
                "endpoints",
                "at most 1024 entries",
                self.endpoints.len(),
            ));
        }
        self.router_config().validate()?;
        if !is_header_name(&self.destination_header) {
            return Err(ConfigError::BadHeader(self.destination_header.clone()));
        }
        if self.max_body_bytes == 0 {
            return Err(out_of_range("max_body_bytes", "at least 1", 0));
        }
        let s = &self.scrape;
        if s.cluster.is_empty() {
            return Err(out_of_range("scrape.cluster", "a cluster name", "\"\""));
        }
        if !s.path.starts_with('/') {
            return Err(out_of_range(
                "scrape.path",
                "a path starting with /",
                &s.path,
            ));
        }
        if s.interval_ms < 10 {
            return Err(out_of_range(
                "scrape.interval_ms",
                "at least 10",
                s.interval_ms,
            ));
        }
        if s.timeout_ms == 0 || s.timeout_ms > s.interval_ms.max(1) * 10 {
            return Err(out_of_range(
                "scrape.timeout_ms",
                "between 1 and 10 × interval_ms",
                s.timeout_ms,
            ));
        }
        if s.stale_after_ms < s.interval_ms {
            return Err(out_of_range(
                "scrape.stale_after_ms",
                "at least scrape.interval_ms",
                s.stale_after_ms,
            ));
        }
        if s.failures_to_down == 0 {
            return Err(out_of_range("scrape.failures_to_down", "at least 1", 0));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_range_values_read_as_the_standard_formatter_would_write_them() {
        for v in [0.0, -1.0, 4096.0, 1.5, 0.001, -2.25, 123_456.789, f64::NAN] {
            assert_eq!(v.shown(), format!("{v}"), "{v}");
        }
        // Only where the two disagree does the message read differently, never wrongly.
        assert_eq!(f64::INFINITY.shown(), "inf");
        assert_eq!(1e20.shown(), "1e+20");
        assert_eq!(1e-7.shown(), "1e-7");
        let e = out_of_range("latency.lanes", "in 1..4096", f64::from(0u32));
        assert_eq!(e.to_string(), "latency.lanes must be in 1..4096, got 0");
    }

    #[test]
    fn policies_round_trip_by_name() {
        for p in Policy::ALL {
            assert_eq!(p.name().parse::<Policy>().unwrap(), p);
            let json = format!("\"{}\"", p.name());
            assert_eq!(serde_json::to_string(&p).unwrap(), json);
            assert_eq!(serde_json::from_str::<Policy>(&json).unwrap(), p);
        }
        assert!("fastest".parse::<Policy>().is_err());
    }

    #[test]
    fn index_modes_and_placements_round_trip_by_name() {
        for m in IndexMode::ALL {
            assert_eq!(m.name().parse::<IndexMode>().unwrap(), m);
            let json = format!("\"{}\"", m.name());
            assert_eq!(serde_json::to_string(&m).unwrap(), json);
            assert_eq!(serde_json::from_str::<IndexMode>(&json).unwrap(), m);
        }
        for p in Placement::ALL {
            assert_eq!(p.name().parse::<Placement>().unwrap(), p);
            let json = format!("\"{}\"", p.name());
            assert_eq!(serde_json::to_string(&p).unwrap(), json);
            assert_eq!(serde_json::from_str::<Placement>(&json).unwrap(), p);
        }
        let err = serde_json::from_str::<Placement>("\"nearby\"").unwrap_err();
        assert!(
            err.to_string()
                .contains("unknown variant `nearby`, expected `local` or `consistent`"),
            "{err}"
        );
    }

    #[test]
    fn each_policy_says_what_its_score_is_made_of() {
        for p in Policy::ALL {
            let scores = !p.scorers().is_empty() || p.predicts();
            let draws = matches!(p, Policy::RoundRobin | Policy::Random);
            assert_eq!(scores, !draws, "{p}");
        }
        assert_eq!(Policy::Prefix.scorers().len(), 4);
    }

    #[test]
    fn weights_parse_with_defaults_and_aliases() {
        let w: Weights = "prefix=5,kv=0.5".parse().unwrap();
        assert_eq!(
            (w.prefix, w.queue, w.kv_cache, w.no_hit_lru),
            (5.0, 2.0, 0.5, 1.0)
        );
        assert!("prefix".parse::<Weights>().is_err());
        assert!("speed=1".parse::<Weights>().is_err());
        assert!("queue=-1".parse::<Weights>().is_err());
        assert!("queue=NaN".parse::<Weights>().is_err());
        let round: Weights = Weights::default().to_string().parse().unwrap();
        assert_eq!(round, Weights::default());
    }

    #[test]
    fn router_config_rejects_out_of_range_match_length() {
        let mut c = RouterConfig::default();
        c.match_length.weight = 1.5;
        assert_eq!(
            c.validate().unwrap_err().to_string(),
            "match_length.weight must be in 0..1, got 1.5"
        );
        c.match_length.weight = 0.3;
        assert!(c.validate().is_ok());
        c.hash.block_size = 0;
        assert!(c.validate().is_err());
    }

    fn plugin(json: &str) -> Result<PluginConfig, ConfigError> {
        PluginConfig::from_json(json.as_bytes())
    }

    #[test]
    fn plugin_config_minimal_and_full() {
        let c = plugin(r#"{"endpoints":[{"name":"a","address":"127.0.0.1:8001"}]}"#).unwrap();
        assert_eq!(c.policy, Policy::Latency);
        assert_eq!(c.destination_header, "x-gateway-destination-endpoint");
        assert_eq!(c.router_config().placement, Placement::Local);
        let c = plugin(
            r#"{"endpoints":[{"name":"a","address":"127.0.0.1:8001"}],"consistent_placement":true}"#,
        )
        .unwrap();
        assert_eq!(c.router_config().placement, Placement::Consistent);
        assert_eq!("consistent".parse(), Ok(Placement::Consistent));
        assert_eq!(Placement::Consistent.name(), "consistent");
        assert_eq!(c.router_config().hash.non_ascii, NonAscii::Pieces);
        let c =
            plugin(r#"{"endpoints":[{"name":"a","address":"127.0.0.1:8001"}],"non_ascii":"skip"}"#)
                .unwrap();
        assert_eq!(c.router_config().hash.non_ascii, NonAscii::Skip);
        let c = plugin(
            r#"{"endpoints":[{"name":"a","address":"10.0.0.1:8000"},{"name":"b","address":"[::1]:8000"}],
                "policy":"least-queue","weights":{"prefix":1},"block_size":32,
                "scrape":{"interval_ms":250,"timeout_ms":200,"stale_after_ms":1000},
                "destination_header":"x-dest","metric_prefix":"sglang:","model":"m"}"#,
        )
        .unwrap();
        assert_eq!(c.weights.prefix, 1.0);
        assert_eq!(c.weights.queue, 2.0);
        assert_eq!(c.router_config().hash.block_size, 32);
    }

    #[test]
    fn a_discovered_pool_needs_no_endpoint_list() {
        let c = plugin(r#"{"discovery":{"pool_cluster":"llm"}}"#).unwrap();
        assert!(c.endpoints.is_empty());
        let d = c.discovery.unwrap();
        assert_eq!(
            (d.cluster.as_str(), d.pool_cluster.as_str(), d.interval_ms),
            ("prefixroute_admin", "llm", 1000)
        );
        assert_eq!(c.failover, 2);
    }

    #[test]
    fn plugin_config_errors_are_specific() {
        let cases = [
            ("", "invalid configuration JSON"),
            ("{}", "endpoints: at least one endpoint is required"),
            (
                r#"{"endpoints":[{"name":"a","address":"x:1"}]}"#,
                "is not ip:port",
            ),
            (
                r#"{"endpoints":[{"name":"a","address":"1.2.3.4:0"}]}"#,
                "is not ip:port",
            ),
            (
                r#"{"endpoints":[{"name":"a","address":"1.2.3.4:1"},{"name":"a","address":"1.2.3.4:2"}]}"#,
                "name \"a\" is used twice",
            ),
            (
                r#"{"endpoints":[{"name":"a","address":"1.2.3.4:1"},{"name":"b","address":"1.2.3.4:1"}]}"#,
                "address \"1.2.3.4:1\" is used twice",
            ),
            (r#"{"endpoints":[],"polcy":"x"}"#, "unknown field `polcy`"),
            (
                r#"{"endpoints":[{"name":"a","address":"1.2.3.4:1"}],"discovery":{}}"#,
                "endpoints and discovery are exclusive",
            ),
            (
                r#"{"discovery":{"interval_ms":10}}"#,
                "discovery.interval_ms must be at least 100, got 10",
            ),
            (
                r#"{"discovery":{"pool_cluster":""}}"#,
                "discovery.pool_cluster must be a cluster name",
            ),
            (
                r#"{"discovery":{"clutser":"x"}}"#,
                "unknown field `clutser`",
            ),
            (
                r#"{"endpoints":[{"name":"a","address":"1.2.3.4:1"}],"index":"exact"}"#,
                "index: unknown variant `exact`",
            ),
            (
                r#"{"endpoints":[{"name":"a","address":"1.2.3.4:1"}],"non_ascii":"none"}"#,
                "non_ascii: unknown variant `none`, expected `pieces` or `skip`",
            ),
            (
                r#"{"endpoints":[{"name":"a","address":"1.2.3.4:1"}],"policy":3}"#,
                "policy: invalid type: integer `3`, expected a string",
            ),
            (
                r#"{"endpoints":[{"name":"a","address":"1.2.3.4:1"}],"consistent_placement":"yes"}"#,
                "consistent_placement: invalid type: string \"yes\", expected a boolean",
            ),
            (
                r#"{"endpoints":[{"name":"a","address":"1.2.3.4:1"}],"kv_events":{"interval_ms":1}}"#,
                "kv_events.interval_ms must be at least 10, got 1",
            ),
            (
                r#"{"endpoints":[{"name":"a","address":"1.2.3.4:1"}],"kv_events":{"wait_ms":40000}}"#,
                "kv_events.wait_ms must be at most 30000, got 40000",
            ),
            (
                r#"{"endpoints":[{"name":"a","address":"1.2.3.4:1"}],"failover":9}"#,
                "failover must be between 0 and 8, got 9",
            ),
            (
                r#"{"endpoints":[{"name":"a","address":"1.2.3.4:1"}],"block_size":16.5}"#,
                "block_size: invalid type",
            ),
            (
                r#"{"endpoints":[{"name":"a","address":7}]}"#,
                "endpoints[0].address: invalid type",
            ),
            (
                r#"{"endpoints":[{"name":"a","address":"1.2.3.4:1"}],"scrape":{"path":1}}"#,
                "scrape.path: invalid type",
            ),
            (
                r#"{"endpoints":[{"name":"a","address":"1.2.3.4:1"}],"policy":"fast"}"#,
                "unknown variant `fast`",
            ),
            (
                r#"{"endpoints":[{"name":"a","address":"1.2.3.4:1"}],"destination_header":"X Dest"}"#,
                "destination_header",
            ),
            (
                r#"{"endpoints":[{"name":"a","address":"1.2.3.4:1"}],"scrape":{"interval_ms":1}}"#,
                "scrape.interval_ms",
            ),
            (
                r#"{"endpoints":[{"name":"a","address":"1.2.3.4:1"}],"max_body_bytes":0}"#,
                "max_body_bytes",
            ),
            (
                r#"{"endpoints":[{"name":"a","address":"1.2.3.4:1"}],"weights":{"queue":-2}}"#,
                "weights.queue",
            ),
            (
                r#"{"endpoints":[{"name":"a","address":"1.2.3.4:1"}],"latency":{"lanes":0}}"#,
                "latency.lanes must be in 1..4096, got 0",
            ),
            (
                r#"{"endpoints":[{"name":"a","address":"1.2.3.4:1"}],"latency":{"speed":1}}"#,
                "latency.speed: unknown field `speed`",
            ),
            (
                r#"{"endpoints":[{"name":"a","address":"1.2.3.4:1"}],"latency":{"balance_factor":0.5}}"#,
                "latency.balance_factor must be 0 (off) or in 1..100, got 0.5",
            ),
            (
                r#"{"endpoints":[{"name":"a","address":"1.2.3.4:1"}],"latency":{"balance_factor":-1}}"#,
                "latency.balance_factor must be 0 (off) or in 1..100, got -1",
            ),
        ];
        for (json, needle) in cases {
            let err = plugin(json).unwrap_err().to_string();
            assert!(err.contains(needle), "{json}: {err}");
        }
    }

    /// Every node of `value` with its path in `serde_path_to_error`'s spelling.
    fn nodes(value: &serde_json::Value, path: String, out: &mut Vec<String>) {
        use serde_json::Value;
        out.push(path.clone());
        match value {
            Value::Object(map) => {
                for (k, v) in map {
                    let sub = if path.is_empty() {
                        k.clone()
                    } else {
                        format!("{path}.{k}")
                    };
                    nodes(v, sub, out);
                }
            }
            Value::Array(list) => {
                for (i, v) in list.iter().enumerate() {
                    nodes(v, format!("{path}[{i}]"), out);
                }
            }
            _ => {}
        }
    }

    /// The node at a path spelled as [`nodes`] spells it.
    fn at<'v>(value: &'v mut serde_json::Value, path: &str) -> &'v mut serde_json::Value {
        let mut node = value;
        for part in path.split('.').filter(|p| !p.is_empty()) {
            let (key, indices) = part.split_once('[').map_or((part, ""), |(k, r)| (k, r));
            if !key.is_empty() {
                node = &mut node[key];
            }
            for index in indices.split('[').filter(|i| !i.is_empty()) {
                node = &mut node[index.trim_end_matches(']').parse::<usize>().unwrap()];
            }
        }
        node
    }

    #[test]
    fn error_paths_name_the_same_field_as_serde_path_to_error_for_every_broken_field() {
        // A configuration with every section present, then one break at a time: each node
        // replaced by a value of each JSON type, an unknown key added to each object, each key
        // of each object removed. Wherever the result does not deserialize, the path must be
        // the one serde_path_to_error tracks while deserializing.
        let mut full = serde_json::to_value(PluginConfig {
            endpoints: vec![
                EndpointConfig {
                    name: "a".into(),
                    address: "10.0.0.1:80".into(),
                },
                EndpointConfig {
                    name: "b".into(),
                    address: "10.0.0.2:80".into(),
                },
            ],
            discovery: Some(DiscoveryConfig::default()),
            model: Some("m".into()),
            ..PluginConfig::default()
        })
        .unwrap();
        full["policy"] = serde_json::json!("prefix");
        let mut all = Vec::new();
        nodes(&full, String::new(), &mut all);
        let replacements = [
            serde_json::json!("x"),
            serde_json::json!(1.5),
            serde_json::json!(-1),
            serde_json::json!(true),
            serde_json::json!(null),
            serde_json::json!([1]),
            serde_json::json!({"k": 1}),
        ];
        let mut broken = Vec::new();
        for path in &all {
            for r in &replacements {
                let mut v = full.clone();
                *at(&mut v, path) = r.clone();
                broken.push(v);
            }
            let mut v = full.clone();
            if let Some(map) = at(&mut v, path).as_object_mut() {
                let keys: Vec<String> = map.keys().cloned().collect();
                map.insert("bogus".into(), serde_json::json!(1));
                broken.push(v);
                for key in keys {
                    let mut v = full.clone();
                    at(&mut v, path).as_object_mut().unwrap().remove(&key);
                    broken.push(v);
                }
            }
        }
        let mut checked = 0;
        for v in broken {
            // The oracle reads the same text `decode_config` does.
            let text = serde_json::to_vec(&v).unwrap();
            let mut reader = serde_json::Deserializer::from_slice(&text);
            let Err(oracle) = serde_path_to_error::deserialize::<_, PluginConfig>(&mut reader)
            else {
                continue;
            };
            let want = oracle.path().to_string();
            let want = if want == "." { String::new() } else { want };
            let message = decode_config(&v).unwrap_err();
            assert_eq!(error_path(&v, &message), want, "{message} in {v}");
            checked += 1;
        }
        assert!(checked > 100, "only {checked} broken configurations");
    }

    #[test]
    fn ip_port_validation_accepts_exactly_what_std_parses_as_a_socket_address() {
        // Addresses std prints (compressed IPv6, embedded quads, scopes), then every one- and
        // two-byte edit of them: the edits make the near misses a random string never would.
        let mut seeds: Vec<String> = vec![
            "10.0.0.1:80".into(),
            "255.255.255.255:65535".into(),
            "[::]:1".into(),
            "[::1]:8000".into(),
            "[::ffff:10.0.0.1]:80".into(),
            "[1:2:3:4:5:6:7:8]:9".into(),
            "[1:2:3:4:5:6:1.2.3.4]:9".into(),
            "[1::2:3.4.5.6]:9".into(),
            "[fe80::1%12]:443".into(),
            "[a:b::]:0080".into(),
        ];
        let mut rng = rand_pcg::Pcg64::new(7, 11);
        use rand::Rng;
        for _ in 0..300 {
            let v6 = std::net::Ipv6Addr::from(
                rng.gen::<u128>() & if rng.gen() { !0 } else { 0xffff_0000_ffff_ffff },
            );
            seeds.push(format!("[{v6}]:{}", rng.gen_range(0..70000)));
            let v4 = std::net::Ipv4Addr::from(rng.gen::<u32>());
            seeds.push(format!("{v4}:{}", rng.gen_range(0..70000)));
        }
        let alphabet = b"0123456789afAF.:[]%x ";
        let std_says = |s: &str| {
            s.parse::<std::net::SocketAddr>()
                .is_ok_and(|a| a.port() != 0)
        };
        let mut checked = 0;
        let mut accepted = 0;
        for seed in &seeds {
            let bytes = seed.as_bytes();
            let mut variants = vec![bytes.to_vec()];
            for at in 0..=bytes.len() {
                if at < bytes.len() {
                    let mut v = bytes.to_vec();
                    v.remove(at);
                    variants.push(v);
                }
                for &c in alphabet {
                    let mut v = bytes.to_vec();
                    v.insert(at, c);
                    variants.push(v.clone());
                    if at < bytes.len() {
                        v.remove(at + 1);
                        variants.push(v);
                    }
                }
            }
            for v in variants {
                let text = String::from_utf8(v).unwrap();
                assert_eq!(is_ip_port(&text), std_says(&text), "{text:?}");
                checked += 1;
                accepted += usize::from(std_says(&text));
            }
        }
        assert!(
            checked > 100_000 && accepted > 10_000,
            "{checked} checked, {accepted} valid"
        );
    }
}
