//! The router: scores → pick, then commit.
//!
//! Picking and committing are separate steps because a proxy decides, forwards, and only then
//! believes the blocks are on the chosen endpoint. [`Router::pick`] never changes the belief;
//! [`Router::commit`] records it.

use rand::Rng;
use rand::SeedableRng;
use rand_pcg::Pcg64Mcg;
use serde::{Deserialize, Serialize};

use crate::hashing::BlockHashes;
use crate::index::{PrefixIndex, PrefixStore};
use crate::scorer::{kv_cache_scores, no_hit_lru_scores, prefix_score, queue_scores};

pub use crate::config::{Policy, RouterConfig, SaturationFilter, Weights};
pub use crate::scorer::EndpointLoad;

/// One endpoint's view of a decision: every scorer's output and the weighted total.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EndpointScores {
    pub matched_blocks: usize,
    pub prefix: f64,
    pub queue: f64,
    pub kv_cache: f64,
    pub no_hit_lru: f64,
    /// The policy's score: the weighted sum for `prefix`, one scorer for the single-signal
    /// policies, 0 for `round-robin` and `random`, which do not score.
    pub total: f64,
    /// Not eligible: down while another endpoint was up, or saturated while another was not.
    pub excluded: bool,
    /// At or above a saturation threshold (queue or KV-cache usage).
    pub saturated: bool,
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
    /// No eligible endpoint held any block of the request.
    pub cold: bool,
    /// The winner was drawn among endpoints with exactly equal scores.
    pub tie: bool,
    /// Every endpoint was down, so the pick ignored health.
    pub all_down: bool,
}

impl Decision {
    pub fn matched_blocks(&self) -> usize {
        self.scores[self.endpoint].matched_blocks
    }

    pub fn score(&self) -> f64 {
        self.scores[self.endpoint].total
    }

    /// `prefix -> replica-2: match 12/14 blocks, score 6.63, next replica-1 4.50`.
    pub fn summary(&self, names: &[String]) -> String {
        let name = |i: usize| names.get(i).map_or_else(|| format!("#{i}"), Clone::clone);
        let mut line = format!(
            "{} -> {}: match {}/{} blocks, score {:.2}",
            self.policy,
            name(self.endpoint),
            self.matched_blocks(),
            self.total_blocks,
            self.score()
        );
        if let Some(next) = self.runner_up {
            line.push_str(&format!(
                ", next {} {:.2}",
                name(next),
                self.scores[next].total
            ));
        }
        if self.tie {
            line.push_str(" (tie)");
        }
        if self.all_down {
            line.push_str(" (all endpoints down)");
        }
        line
    }
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
        }
    }

    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    pub fn endpoints(&self) -> usize {
        self.endpoints
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    pub fn store_mut(&mut self) -> &mut S {
        &mut self.store
    }

    /// Blocks of `hashes` each endpoint is believed to hold (summed over the request's chains).
    pub fn matched_blocks(&self, hashes: &BlockHashes) -> Vec<usize> {
        (0..self.endpoints)
            .map(|e| {
                hashes
                    .chains
                    .iter()
                    .map(|chain| self.store.longest_match(e, chain))
                    .sum()
            })
            .collect()
    }

    /// Chooses an endpoint for a request. `loads` has one entry per endpoint; a missing entry
    /// counts as unmeasured. Never fails: with no endpoints at all it returns endpoint 0 of an
    /// empty decision, which callers guard against by configuration.
    pub fn pick(&mut self, hashes: &BlockHashes, loads: &[EndpointLoad]) -> Decision {
        let n = self.endpoints;
        let loads: Vec<EndpointLoad> = (0..n)
            .map(|i| loads.get(i).copied().unwrap_or_default())
            .collect();
        let all_down = n > 0 && loads.iter().all(|l| l.down);
        let mut eligible: Vec<bool> = loads.iter().map(|l| all_down || !l.down).collect();
        let mut saturated = vec![false; n];
        if self.config.policy == Policy::Prefix {
            let limits = self.config.saturation;
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

        let matched = self.matched_blocks(hashes);
        let total_blocks = hashes.total_blocks();
        let total_tokens = hashes.total_tokens();
        let cold = !matched.iter().zip(&eligible).any(|(&m, &ok)| ok && m > 0);
        let queue = queue_scores(&loads);
        let kv = kv_cache_scores(&loads);
        let lru = no_hit_lru_scores(!cold, &self.last_cold);
        let block_size = hashes.block_size.max(1);

        let w = self.config.weights;
        let mut scores: Vec<EndpointScores> = (0..n)
            .map(|i| {
                let matched_tokens = (matched[i] * block_size).min(total_tokens);
                let prefix = prefix_score(
                    matched[i],
                    total_blocks,
                    matched_tokens,
                    self.config.match_length,
                );
                let total = match self.config.policy {
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
                    matched_blocks: matched[i],
                    prefix,
                    queue: queue[i],
                    kv_cache: kv[i],
                    no_hit_lru: lru[i],
                    total,
                    excluded: !eligible[i],
                    saturated: saturated[i],
                }
            })
            .collect();

        let (endpoint, tie) = match self.config.policy {
            Policy::RoundRobin => (self.next_in_rotation(&eligible), false),
            Policy::Random => (self.random_eligible(&eligible), false),
            _ => self.max_score(&scores, &eligible),
        };
        let runner_up = match self.config.policy {
            Policy::RoundRobin | Policy::Random => None,
            _ => best_other(&scores, &eligible, endpoint),
        };
        if n == 0 {
            scores.clear();
        }
        Decision {
            endpoint,
            policy: self.config.policy,
            total_blocks,
            total_tokens,
            scores,
            runner_up,
            cold,
            tie,
            all_down,
        }
    }

    /// Records a decision: the chosen endpoint now (believably) holds the request's blocks.
    pub fn commit(&mut self, decision: &Decision, hashes: &BlockHashes) {
        if decision.endpoint >= self.endpoints {
            return;
        }
        for chain in &hashes.chains {
            self.store.record(decision.endpoint, chain);
        }
        if decision.cold {
            self.cold_clock += 1;
            self.last_cold[decision.endpoint] = Some(self.cold_clock);
        }
    }

    /// Forgets an endpoint's blocks (e.g. after it restarted with an empty cache).
    pub fn forget_endpoint(&mut self, endpoint: usize) {
        self.store.forget_endpoint(endpoint);
    }

    /// no-hit-lru's memory: the logical time each endpoint last took a cold request (larger =
    /// more recent, `None` = never).
    pub fn last_cold(&self) -> &[Option<u64>] {
        &self.last_cold
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
    /// share load instead of the first one taking everything.
    fn max_score(&mut self, scores: &[EndpointScores], eligible: &[bool]) -> (usize, bool) {
        let best = scores
            .iter()
            .zip(eligible)
            .filter(|(_, &ok)| ok)
            .map(|(s, _)| s.total)
            .fold(f64::NEG_INFINITY, f64::max);
        let tied: Vec<usize> = (0..scores.len())
            .filter(|&i| eligible[i] && scores[i].total == best)
            .collect();
        match tied.len() {
            0 => (0, false),
            1 => (tied[0], false),
            k => (tied[draw_index(&mut self.rng, k)], true),
        }
    }
}

/// A uniform index below `n`, drawn through u64 so that 32-bit targets (the browser, the
/// proxy-wasm plugin) make exactly the same draws as native builds.
pub fn draw_index(rng: &mut impl Rng, n: usize) -> usize {
    rng.gen_range(0..n as u64) as usize
}

fn best_other(scores: &[EndpointScores], eligible: &[bool], chosen: usize) -> Option<usize> {
    (0..scores.len())
        .filter(|&i| i != chosen && eligible[i])
        .fold(None, |best: Option<usize>, i| match best {
            Some(b) if scores[b].total >= scores[i].total => Some(b),
            _ => Some(i),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::{hash_request, HashConfig};
    use crate::request::parse_request;

    fn hashes(text: &str) -> BlockHashes {
        let body = serde_json::json!({"model": "m", "prompt": text}).to_string();
        hash_request(
            &parse_request(body.as_bytes()).unwrap(),
            HashConfig {
                block_size: 2,
                include_partial: true,
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

    #[test]
    fn pick_does_not_change_belief_until_commit() {
        let mut r = router(Policy::Prefix, 3);
        let h = hashes("one two three four five");
        let first = r.pick(&h, &idle(3));
        assert!(first.cold);
        assert_eq!(r.matched_blocks(&h), vec![0, 0, 0]);
        r.commit(&first, &h);
        let second = r.pick(&h, &idle(3));
        assert_eq!(second.endpoint, first.endpoint);
        assert_eq!(second.matched_blocks(), 3);
        assert!(!second.cold);
        assert_eq!(second.scores[second.endpoint].prefix, 1.0);
        // 3·1 + 2·1 + 2·1 + 1·0.5
        assert_eq!(second.score(), 7.5);
    }

    #[test]
    fn prefix_policy_trades_locality_against_queue() {
        let mut r = router(Policy::Prefix, 2);
        let h = hashes("alpha beta gamma delta");
        let d = r.pick(&h, &idle(2));
        r.commit(&d, &h);
        let holder = d.endpoint;
        let other = 1 - holder;
        // A small queue on the holder does not beat the full prefix match...
        let mut loads = idle(2);
        loads[holder].queue = Some(1.0);
        loads[other].queue = Some(0.0);
        assert_eq!(r.pick(&h, &loads).endpoint, holder);
        // ...but the holder also busy on kv-cache does: 3 + 0 + 0.6 + 0.5 < 0 + 2 + 2 + 0.5.
        loads[holder].kv_usage = Some(0.7);
        let spilled = r.pick(&h, &loads);
        assert_eq!(spilled.endpoint, other);
        assert_eq!(spilled.runner_up, Some(holder));
    }

    #[test]
    fn no_hit_lru_spreads_cold_prefixes() {
        let mut r = router(Policy::Prefix, 3);
        let mut seen = Vec::new();
        for text in ["a a a", "b b b", "c c c"] {
            let h = hashes(text);
            let d = r.pick(&h, &idle(3));
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
                .map(|i| r.pick(&hashes(&format!("p{i}")), &idle(4)).endpoint)
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
        let d = a.pick(&hashes("first tenant"), &idle(3));
        a.commit(&d, &hashes("first tenant"));
        assert_eq!(a.last_cold()[d.endpoint], Some(1));
        // A second router (another worker) that learns the first one's history avoids the
        // endpoint that just took a cold prefix, as the first router itself would.
        let mut b = router(Policy::Prefix, 3);
        b.set_last_cold(a.last_cold());
        let h = hashes("second tenant");
        let (da, db) = (a.pick(&h, &idle(3)), b.pick(&h, &idle(3)));
        assert_eq!(db.scores, da.scores);
        assert_ne!(db.endpoint, d.endpoint);
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
        let order: Vec<usize> = (0..4).map(|_| r.pick(&h, &loads).endpoint).collect();
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
        let d = r.pick(&hashes("x"), &loads);
        assert_eq!(d.endpoint, 1);
        assert_eq!(d.runner_up, Some(0));
    }

    #[test]
    fn down_endpoints_are_skipped_unless_all_are_down() {
        let mut r = router(Policy::Prefix, 2);
        let h = hashes("q r s");
        let d = r.pick(&h, &idle(2));
        r.commit(&d, &h);
        let mut loads = idle(2);
        loads[d.endpoint].down = true;
        let moved = r.pick(&h, &loads);
        assert_eq!(moved.endpoint, 1 - d.endpoint);
        assert!(moved.scores[d.endpoint].excluded);
        loads[1 - d.endpoint].down = true;
        let all = r.pick(&h, &loads);
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
        let d = r.pick(&h, &idle(2));
        r.commit(&d, &h);
        let holder = d.endpoint;
        let mut loads = idle(2);
        loads[holder].queue = Some(5.0);
        let spilled = r.pick(&h, &loads);
        assert_eq!(spilled.endpoint, 1 - holder);
        assert!(spilled.scores[holder].saturated && spilled.scores[holder].excluded);
        // Both saturated: nothing is filtered and the prefix holder wins on score.
        loads[1 - holder].kv_usage = Some(0.9);
        assert_eq!(r.pick(&h, &loads).endpoint, holder);
        // prefix-only ignores load entirely.
        let mut only = router(Policy::PrefixOnly, 2);
        only.commit(&d, &h);
        loads[1 - holder].kv_usage = Some(0.0);
        assert_eq!(only.pick(&h, &loads).endpoint, holder);
    }

    #[test]
    fn unmeasured_endpoints_lose_load_scores() {
        let mut r = router(Policy::Prefix, 2);
        let loads = [EndpointLoad::default(), EndpointLoad::measured(3.0, 0.5)];
        let d = r.pick(&hashes("cold"), &loads);
        assert_eq!(d.endpoint, 1);
        assert_eq!(d.scores[0].queue, 0.0);
        assert_eq!(d.scores[0].kv_cache, 0.0);
    }

    #[test]
    fn summary_names_winner_and_runner_up() {
        let mut r = router(Policy::Prefix, 2);
        let h = hashes("aa bb cc");
        let d = r.pick(&h, &idle(2));
        r.commit(&d, &h);
        let d = r.pick(&h, &idle(2));
        let names = vec!["replica-0".to_string(), "replica-1".to_string()];
        let line = d.summary(&names);
        assert!(
            line.starts_with(&format!(
                "prefix -> {}: match 2/2 blocks, score 7.50, next ",
                names[d.endpoint]
            )),
            "{line}"
        );
    }
}
