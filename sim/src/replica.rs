//! A model-server replica as vLLM behaves, for the simulator and the fake server.
//!
//! [`BlockCache`] is vLLM's automatic prefix cache: full blocks only, LRU eviction, a lookup that
//! always leaves at least one prompt token to compute, and hit/query counters in tokens
//! (`vllm:prefix_cache_hits_total`, `vllm:prefix_cache_queries_total`). [`ReplicaSim`] adds
//! lanes (concurrent sequences) and a time-to-first-token model:
//! TTFT = lane wait + overhead + uncached tokens × per-token prefill time.

use std::collections::VecDeque;
use std::num::NonZeroUsize;

use lru::LruCache;
use serde::{Deserialize, Serialize};

/// What one [`BlockCache::serve_logged`] changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheChange {
    /// Blocks `first..first + len` of the chain are newly held.
    Stored { first: usize, len: usize },
    /// This block was evicted.
    Evicted(u64),
}

/// vLLM's prefix cache over chained block hashes.
#[derive(Debug)]
pub struct BlockCache {
    block_size: usize,
    blocks: LruCache<u64, ()>,
    hit_tokens: u64,
    query_tokens: u64,
}

impl BlockCache {
    pub fn new(capacity_blocks: usize, block_size: usize) -> Self {
        BlockCache {
            block_size: block_size.max(1),
            blocks: LruCache::new(
                NonZeroUsize::new(capacity_blocks.max(1)).unwrap_or(NonZeroUsize::MIN),
            ),
            hit_tokens: 0,
            query_tokens: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn capacity_blocks(&self) -> usize {
        self.blocks.cap().get()
    }

    pub fn used_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn contains(&self, hash: u64) -> bool {
        self.blocks.contains(&hash)
    }

    /// Cached blocks in LRU order, most recent first (for visualisations).
    pub fn blocks(&self) -> impl Iterator<Item = u64> + '_ {
        self.blocks.iter().map(|(h, _)| *h)
    }

    /// `vllm:prefix_cache_hits_total`, in tokens.
    pub fn hit_tokens(&self) -> u64 {
        self.hit_tokens
    }

    /// `vllm:prefix_cache_queries_total`, in tokens.
    pub fn query_tokens(&self) -> u64 {
        self.query_tokens
    }

    /// Leading blocks of `full_chain` a prompt of `prompt_tokens` tokens would reuse. vLLM
    /// caps the lookup at (n−1)/block_size blocks so the last token is always computed (its
    /// logits are needed).
    pub fn lookup(&self, full_chain: &[u64], prompt_tokens: usize) -> usize {
        let cap = prompt_tokens.saturating_sub(1) / self.block_size;
        full_chain
            .iter()
            .take(cap)
            .take_while(|h| self.blocks.contains(h))
            .count()
    }

    /// Serves one prompt: counts the query and the hit, then caches every full block (touching
    /// the reused ones). Returns the cached tokens. Blocks are inserted tail first, as vLLM
    /// frees a finished sequence's blocks in reverse, so under pressure a prompt's tail is
    /// evicted before its shared head.
    pub fn serve(&mut self, full_chain: &[u64], prompt_tokens: usize) -> usize {
        self.serve_logged(full_chain, prompt_tokens, None)
    }

    /// [`BlockCache::serve`], also saying what changed (for a server that publishes KV
    /// events): runs of blocks it now holds that it did not (in chain order), then the blocks
    /// evicted to make room.
    pub fn serve_logged(
        &mut self,
        full_chain: &[u64],
        prompt_tokens: usize,
        log: Option<&mut Vec<CacheChange>>,
    ) -> usize {
        let cached_tokens = self.lookup(full_chain, prompt_tokens) * self.block_size;
        self.query_tokens += prompt_tokens as u64;
        self.hit_tokens += cached_tokens as u64;
        let full = (prompt_tokens / self.block_size).min(full_chain.len());
        let Some(log) = log else {
            for &hash in full_chain[..full].iter().rev() {
                self.blocks.put(hash, ());
            }
            return cached_tokens;
        };
        let new: Vec<bool> = full_chain[..full]
            .iter()
            .map(|h| !self.blocks.contains(h))
            .collect();
        let mut evicted = Vec::new();
        for &hash in full_chain[..full].iter().rev() {
            if let Some((old, ())) = self.blocks.push(hash, ()) {
                if old != hash {
                    evicted.push(old);
                }
            }
        }
        let mut i = 0;
        while i < full {
            if !new[i] {
                i += 1;
                continue;
            }
            let first = i;
            while i < full && new[i] {
                i += 1;
            }
            log.push(CacheChange::Stored {
                first,
                len: i - first,
            });
        }
        // Net changes only: a block of this chain can be the LRU victim while the chain's tail
        // goes in and come back with its head; it was held before and is held now.
        log.extend(
            evicted
                .into_iter()
                .filter(|h| !self.blocks.contains(h))
                .map(CacheChange::Evicted),
        );
        cached_tokens
    }

    /// Drops every cached block (a restart); counters keep counting, as Prometheus counters do
    /// within one process.
    pub fn clear(&mut self) {
        self.blocks.clear();
    }
}

/// Timing of a simulated replica.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ReplicaTiming {
    /// Sequences served at once (vLLM's running batch, simplified to independent lanes).
    pub lanes: usize,
    pub prefill_overhead_ms: f64,
    pub prefill_ms_per_token: f64,
    /// Decode time per output token; keeps a lane busy after the first token.
    pub decode_ms_per_token: f64,
}

impl Default for ReplicaTiming {
    fn default() -> Self {
        ReplicaTiming {
            lanes: 8,
            prefill_overhead_ms: 5.0,
            prefill_ms_per_token: 1.0,
            decode_ms_per_token: 5.0,
        }
    }
}

/// What happened to one request on a replica.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Served {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    /// Requests already waiting for a lane when this one arrived.
    pub queue_at_arrival: usize,
    pub wait_ms: f64,
    pub ttft_ms: f64,
    pub finish_ms: f64,
}

#[derive(Debug, Clone, Copy)]
struct InFlight {
    start_ms: f64,
    end_ms: f64,
    blocks: usize,
}

/// A replica: a [`BlockCache`] plus lanes, driven by the caller's clock (milliseconds).
#[derive(Debug)]
pub struct ReplicaSim {
    pub cache: BlockCache,
    timing: ReplicaTiming,
    lane_free_at: Vec<f64>,
    in_flight: VecDeque<InFlight>,
    /// Requests ever admitted (what `vllm:request_success_total` counts, less those in flight).
    admitted: u64,
    /// What the cache did, per prompt index, when the replica publishes its KV events
    /// ([`ReplicaSim::publish_changes`]).
    changes: Option<Vec<(usize, CacheChange)>>,
}

impl ReplicaSim {
    pub fn new(cache_blocks: usize, block_size: usize, timing: ReplicaTiming) -> Self {
        ReplicaSim {
            cache: BlockCache::new(cache_blocks, block_size),
            timing,
            lane_free_at: vec![0.0; timing.lanes.max(1)],
            in_flight: VecDeque::new(),
            admitted: 0,
            changes: None,
        }
    }

    /// Keeps what the cache does from now on, as a server publishing KV events would.
    pub fn publish_changes(&mut self) {
        self.changes.get_or_insert_with(Vec::new);
    }

    /// The cache's changes since the last call: `(prompt index, change)`.
    pub fn take_changes(&mut self) -> Vec<(usize, CacheChange)> {
        self.changes
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    pub fn timing(&self) -> ReplicaTiming {
        self.timing
    }

    /// Forgets finished requests (keeps the in-flight list short on long runs).
    fn retire(&mut self, now_ms: f64) {
        self.in_flight.retain(|r| r.end_ms > now_ms);
    }

    fn live(&self, now_ms: f64) -> impl Iterator<Item = &InFlight> {
        self.in_flight.iter().filter(move |r| r.end_ms > now_ms)
    }

    /// Requests admitted but not yet started (`vllm:num_requests_waiting`) at `now_ms`.
    pub fn waiting(&self, now_ms: f64) -> usize {
        self.live(now_ms).filter(|r| r.start_ms > now_ms).count()
    }

    /// Requests finished by `now_ms` (`vllm:request_success_total`), for a scrape at or after
    /// the last admission.
    pub fn finished(&self, now_ms: f64) -> u64 {
        self.admitted - self.live(now_ms).count() as u64
    }

    /// Requests being served (`vllm:num_requests_running`) at `now_ms`.
    pub fn running(&self, now_ms: f64) -> usize {
        self.live(now_ms).filter(|r| r.start_ms <= now_ms).count()
    }

    /// Share of cache blocks held privately by running sequences (`vllm:kv_cache_usage_perc`,
    /// without the shared prefix blocks, which every replica of a warm fleet holds alike).
    pub fn kv_usage(&self, now_ms: f64) -> f64 {
        let held: usize = self
            .live(now_ms)
            .filter(|r| r.start_ms <= now_ms)
            .map(|r| r.blocks)
            .sum();
        (held as f64 / self.cache.capacity_blocks() as f64).min(1.0)
    }

    /// Admits a request arriving at `now_ms`: one `(full-block chain, prompt tokens)` per prompt,
    /// served on the earliest free lane.
    pub fn admit(
        &mut self,
        now_ms: f64,
        prompts: &[(&[u64], usize)],
        output_tokens: usize,
    ) -> Served {
        self.place(now_ms, prompts, output_tokens, None)
    }

    /// Admits a request whose uncached tokens were prefilled elsewhere: their KV cache lands
    /// here at `kv_ready_ms` (and the cache holds those blocks from then on, as after a local
    /// prefill). Decoding starts on the first lane free from then; the request's TTFT counts
    /// from `now_ms`, its arrival at the router.
    pub fn admit_prefilled(
        &mut self,
        now_ms: f64,
        kv_ready_ms: f64,
        prompts: &[(&[u64], usize)],
        output_tokens: usize,
    ) -> Served {
        self.place(
            now_ms,
            prompts,
            output_tokens,
            Some(kv_ready_ms.max(now_ms)),
        )
    }

    /// How many of `prompts`' tokens this replica's cache holds now (nothing changes).
    pub fn cached_tokens(&self, prompts: &[(&[u64], usize)]) -> usize {
        prompts
            .iter()
            .map(|&(chain, tokens)| self.cache.lookup(chain, tokens) * self.cache.block_size())
            .sum()
    }

    fn place(
        &mut self,
        now_ms: f64,
        prompts: &[(&[u64], usize)],
        output_tokens: usize,
        kv_ready_ms: Option<f64>,
    ) -> Served {
        self.retire(now_ms);
        let queue_at_arrival = self.waiting(now_ms);
        let mut prompt_tokens = 0;
        let mut cached_tokens = 0;
        let mut scratch = Vec::new();
        for (i, &(chain, tokens)) in prompts.iter().enumerate() {
            prompt_tokens += tokens;
            let log = self.changes.as_ref().map(|_| &mut scratch);
            cached_tokens += self.cache.serve_logged(chain, tokens, log);
            if let Some(changes) = self.changes.as_mut() {
                changes.extend(scratch.drain(..).map(|c| (i, c)));
            }
        }
        let uncached = prompt_tokens.saturating_sub(cached_tokens);
        let lane = (0..self.lane_free_at.len())
            .min_by(|&a, &b| self.lane_free_at[a].total_cmp(&self.lane_free_at[b]))
            .unwrap_or(0);
        let start_ms = self.lane_free_at[lane].max(kv_ready_ms.unwrap_or(now_ms));
        let prefill_ms = match kv_ready_ms {
            Some(_) => 0.0,
            None => {
                self.timing.prefill_overhead_ms + uncached as f64 * self.timing.prefill_ms_per_token
            }
        };
        let finish_ms =
            start_ms + prefill_ms + output_tokens as f64 * self.timing.decode_ms_per_token;
        self.lane_free_at[lane] = finish_ms;
        let block_size = self.cache.block_size();
        self.admitted += 1;
        self.in_flight.push_back(InFlight {
            start_ms,
            end_ms: finish_ms,
            // Reused prefix blocks are shared with the cache (counted once, there); a sequence
            // holds its own uncached and output blocks.
            blocks: uncached.div_ceil(block_size) + output_tokens.div_ceil(block_size),
        });
        Served {
            prompt_tokens,
            cached_tokens,
            queue_at_arrival,
            wait_ms: start_ms - now_ms,
            ttft_ms: start_ms - now_ms + prefill_ms,
            finish_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_keeps_one_token_to_compute() {
        let mut cache = BlockCache::new(10, 4);
        cache.serve(&[1, 2], 8);
        // 8 tokens, both blocks cached: lookup capped at (8−1)/4 = 1 block.
        assert_eq!(cache.lookup(&[1, 2], 8), 1);
        assert_eq!(cache.lookup(&[1, 2, 3], 9), 2);
        assert_eq!(cache.lookup(&[9], 9), 0);
    }

    #[test]
    fn counters_are_in_tokens() {
        let mut cache = BlockCache::new(10, 4);
        assert_eq!(cache.serve(&[1, 2], 10), 0);
        assert_eq!(cache.serve(&[1, 2], 10), 8);
        assert_eq!(cache.query_tokens(), 20);
        assert_eq!(cache.hit_tokens(), 8);
    }

    #[test]
    fn only_full_blocks_are_cached() {
        let mut cache = BlockCache::new(10, 4);
        // A chain that includes a partial third block: only 2 full blocks exist in 10 tokens.
        cache.serve(&[1, 2, 3], 10);
        assert_eq!(cache.used_blocks(), 2);
        assert!(!cache.contains(3));
    }

    #[test]
    fn a_logged_serve_reports_new_runs_in_chain_order_then_evictions() {
        let mut cache = BlockCache::new(4, 1);
        let mut log = Vec::new();
        cache.serve_logged(&[1, 2, 3], 4, Some(&mut log));
        assert_eq!(log, [CacheChange::Stored { first: 0, len: 3 }]);
        log.clear();
        // 1 and 2 are held; 5 and 6 are new; 3 (least recently used) makes room.
        cache.serve_logged(&[1, 2, 5, 6], 5, Some(&mut log));
        assert_eq!(
            log,
            [
                CacheChange::Stored { first: 2, len: 2 },
                CacheChange::Evicted(3)
            ]
        );
        let mut plain = BlockCache::new(4, 1);
        plain.serve(&[1, 2, 3], 4);
        plain.serve(&[1, 2, 5, 6], 5);
        assert!(
            plain.contains(6) && !plain.contains(3),
            "logging changes nothing"
        );
    }

    #[test]
    fn a_block_evicted_and_stored_again_within_one_serve_is_not_reported_removed() {
        // Capacity 3: [1, 2, 3] held, 1 least recent. Serving [1, 2, 3, 4] inserts 4 first
        // (tail first), which evicts 1, and then 1 again: net, only 4 is new and 2... let the
        // cache say what went.
        let mut cache = BlockCache::new(3, 1);
        cache.serve(&[1, 2, 3], 4);
        let mut log = Vec::new();
        cache.serve_logged(&[1, 2, 3, 4], 5, Some(&mut log));
        for change in &log {
            if let CacheChange::Evicted(h) = change {
                assert!(!cache.contains(*h), "reported evicted but held: {h}");
            }
        }
        for h in cache.blocks() {
            let was_held = [1, 2, 3].contains(&h);
            let stored = log.iter().any(|c| matches!(c, CacheChange::Stored { first, len } if (*first..first + len).contains(&((h - 1) as usize))));
            assert!(was_held || stored, "{h} is held but was never reported");
        }
    }

    #[test]
    fn lru_evicts_tails_before_heads() {
        let mut cache = BlockCache::new(3, 1);
        cache.serve(&[1, 2, 3], 4);
        cache.serve(&[7], 2);
        assert!(cache.contains(1) && cache.contains(2) && cache.contains(7));
        assert!(!cache.contains(3));
    }

    #[test]
    fn lanes_queue_and_ttft_follow_the_model() {
        let timing = ReplicaTiming {
            lanes: 1,
            prefill_overhead_ms: 5.0,
            prefill_ms_per_token: 1.0,
            decode_ms_per_token: 10.0,
        };
        let mut r = ReplicaSim::new(100, 4, timing);
        let a = r.admit(0.0, &[(&[1, 2], 8)], 2);
        assert_eq!(a.ttft_ms, 13.0);
        assert_eq!(a.finish_ms, 33.0);
        // Second request arrives at 10 ms, waits until 33, reuses 1 block (cap (8−1)/4 = 1).
        let b = r.admit(10.0, &[(&[1, 2], 8)], 0);
        assert_eq!(b.cached_tokens, 4);
        assert_eq!(b.wait_ms, 23.0);
        assert_eq!(b.ttft_ms, 23.0 + 5.0 + 4.0);
        assert_eq!(r.waiting(11.0), 1);
        assert_eq!(r.running(11.0), 1);
        assert!(r.kv_usage(11.0) > 0.0);
        assert_eq!(r.waiting(40.0), 0);
        assert_eq!(r.running(100.0), 0);
        assert_eq!(r.kv_usage(100.0), 0.0);
    }
}
