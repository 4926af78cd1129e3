//! The replica itself: prefixroute-sim's [`BlockCache`], lanes and the counters `/metrics` reports.
//!
//! Time is real here (unlike core's `ReplicaSim`, which is driven by a simulated clock): a request
//! holds a tokio semaphore permit while it "runs" and sleeps for its prefill and decode time.
//! Every count that a gauge reports is kept by a guard whose `Drop` undoes it, because hyper drops
//! a request's future when its client disconnects, and the gauges must not drift when that
//! happens.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use prefixroute_core::hashing::BlockIdentity;
use prefixroute_core::hashing::{hash_request, hash_request_memo, ChainMemo, HashConfig};
use prefixroute_core::request::{ParsedRequest, Prompt};
use prefixroute_core::tokenizer::{tokenize, NonAscii};
use prefixroute_kvevents::schema::{EngineHash, Event};
use prefixroute_sim::replica::{BlockCache, CacheChange};
use tokio::sync::{AcquireError, OwnedSemaphorePermit, Semaphore};

/// What the command line configures.
#[derive(Debug, Clone)]
pub struct ReplicaConfig {
    pub model: String,
    pub kv_blocks: usize,
    pub block_size: usize,
    /// How the server tokenizes characters outside ASCII (the router must do it alike).
    pub non_ascii: NonAscii,
    pub lanes: usize,
    pub prefill_overhead_ms: f64,
    pub prefill_ms_per_token: f64,
    pub decode_ms_per_token: f64,
}

/// The cache-relevant shape of one request: one full-block chain per prompt.
#[derive(Debug, Clone)]
pub struct Job {
    chains: Vec<Vec<u64>>,
    tokens: Vec<usize>,
    /// Each prompt's token ids (for `BlockStored` events).
    token_ids: Vec<Vec<u32>>,
    pub output_tokens: usize,
}

impl Job {
    /// Hashes full blocks only (`include_partial: false`): a server can only reuse blocks it has
    /// completely computed, unlike the router, which also names the partial tail.
    #[cfg(test)]
    pub fn new(request: &ParsedRequest, block_size: usize, output_tokens: usize) -> Job {
        let hash = HashConfig {
            block_size,
            include_partial: false,
            non_ascii: NonAscii::default(),
            identity: BlockIdentity::TokenIds,
        };
        Job::build(request, hash, output_tokens, None, true)
    }

    /// `Job::new` (the tests' constructor) through `memo` (a system prompt seen before is not
    /// tokenized again), with the token ids only when `token_ids` (the KV events carry them;
    /// nothing else reads them).
    fn build(
        request: &ParsedRequest,
        config: HashConfig,
        output_tokens: usize,
        memo: Option<&mut ChainMemo>,
        token_ids: bool,
    ) -> Job {
        let hashes = match memo {
            Some(memo) => hash_request_memo(request, config, memo),
            None => hash_request(request, config),
        };
        let token_ids = if token_ids {
            request
                .prompts
                .iter()
                .map(|p| match p {
                    Prompt::Text(text) => tokenize(text, config.non_ascii),
                    Prompt::Tokens(ids) => ids.clone(),
                })
                .collect()
        } else {
            Vec::new()
        };
        Job {
            chains: hashes.chains,
            tokens: hashes.tokens,
            token_ids,
            output_tokens,
        }
    }

    /// Prompt tokens of each prompt, in order.
    pub fn tokens(&self) -> &[usize] {
        &self.tokens
    }

    /// Full-block hash chains, one per prompt.
    #[cfg(test)]
    pub fn chains(&self) -> &[Vec<u64>] {
        &self.chains
    }

    pub fn prompts(&self) -> usize {
        self.tokens.len()
    }
}

/// A consistent-enough reading of every gauge and counter, for one `/metrics` page.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Snapshot {
    pub waiting: usize,
    pub running: usize,
    pub kv_usage: f64,
    pub query_tokens: u64,
    pub hit_tokens: u64,
    pub succeeded: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
}

/// The engine's own name for a block, deliberately not the router's (as vLLM's is not): the
/// relay must map it back through the events' token ids.
pub fn engine_hash(router_hash: u64) -> EngineHash {
    EngineHash(xxhash_rust::xxh64::xxh64(
        &router_hash.to_le_bytes(),
        0x766c_6c6d,
    ))
}

/// What the cache changed, as vLLM's KV events.
fn events_of(
    changes: &[CacheChange],
    chain: &[u64],
    tokens: &[u32],
    block_size: usize,
) -> Vec<Event> {
    changes
        .iter()
        .map(|c| match *c {
            CacheChange::Stored { first, len } => Event::BlockStored {
                block_hashes: chain[first..first + len]
                    .iter()
                    .map(|&h| engine_hash(h))
                    .collect(),
                parent_block_hash: first.checked_sub(1).map(|p| engine_hash(chain[p])),
                token_ids: tokens[first * block_size..(first + len) * block_size].to_vec(),
                block_size: block_size as u32,
                lora_id: None,
                medium: Some("GPU".into()),
            },
            CacheChange::Evicted(h) => Event::BlockRemoved {
                block_hashes: vec![engine_hash(h)],
                medium: Some("GPU".into()),
            },
        })
        .collect()
}

#[derive(Debug)]
pub struct Replica {
    pub config: ReplicaConfig,
    cache: Mutex<BlockCache>,
    /// Where KV events go (the publisher task), when the server publishes them.
    events: Option<tokio::sync::mpsc::UnboundedSender<Vec<Event>>>,
    /// The messages this replica hashed: benchmarks send it the same system prompts over and
    /// over, and the CPU it saves is the routers' (they share the machine).
    memo: Mutex<ChainMemo>,
    lanes: Arc<Semaphore>,
    waiting: AtomicUsize,
    running: AtomicUsize,
    /// Blocks privately held by running sequences (uncached prompt + output), as in core's
    /// `ReplicaSim::kv_usage`: shared prefix blocks are counted once, by the cache.
    running_blocks: AtomicUsize,
    succeeded: AtomicU64,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
}

impl Replica {
    #[cfg(test)]
    pub fn new(config: ReplicaConfig) -> Replica {
        Replica::with_events(config, None)
    }

    /// A replica that sends every cache change to `events` (see `kv_events.rs`).
    pub fn with_events(
        config: ReplicaConfig,
        events: Option<tokio::sync::mpsc::UnboundedSender<Vec<Event>>>,
    ) -> Replica {
        Replica {
            events,
            memo: Mutex::new(ChainMemo::default()),
            cache: Mutex::new(BlockCache::new(config.kv_blocks, config.block_size)),
            lanes: Arc::new(Semaphore::new(config.lanes.max(1))),
            config,
            waiting: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            running_blocks: AtomicUsize::new(0),
            succeeded: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
        }
    }

    /// The job of `request`: its full-block chains, hashed through the replica's memo.
    pub fn job(&self, request: &ParsedRequest, output_tokens: usize) -> Job {
        let mut memo = self.memo.lock().unwrap_or_else(PoisonError::into_inner);
        let hash = HashConfig {
            block_size: self.config.block_size,
            include_partial: false,
            non_ascii: self.config.non_ascii,
            // A server hashes its blocks' token ids, numbered as llm-d-inference-sim does; its
            // KV events carry those hashes, which `index: precise` computes alike.
            identity: BlockIdentity::TokenIds,
        };
        Job::build(
            request,
            hash,
            output_tokens,
            Some(&mut memo),
            self.events.is_some(),
        )
    }

    /// A poisoned lock only means another request panicked mid-update; the cache is still a
    /// valid LRU, so keep serving rather than turning one bug into an outage.
    fn cache(&self) -> std::sync::MutexGuard<'_, BlockCache> {
        self.cache.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits for a free lane, then looks the prompts up in the cache (counting the query and
    /// the hit, as vLLM's scheduler does when it schedules a request) and caches their blocks.
    pub async fn admit(self: &Arc<Self>, job: &Job) -> Result<Lane, AcquireError> {
        let permit = {
            let _waiting = Counted::new(&self.waiting);
            Arc::clone(&self.lanes).acquire_owned().await?
        };
        let block_size = self.config.block_size.max(1);
        let mut cached_tokens = 0;
        let mut blocks = 0;
        {
            let mut cache = self.cache();
            let mut changes = Vec::new();
            for (i, (chain, &tokens)) in job.chains.iter().zip(&job.tokens).enumerate() {
                let log = self.events.as_ref().map(|_| &mut changes);
                let cached = cache.serve_logged(chain, tokens, log);
                cached_tokens += cached;
                blocks += tokens.saturating_sub(cached).div_ceil(block_size)
                    + job.output_tokens.div_ceil(block_size);
                if let (Some(events), false) = (&self.events, changes.is_empty()) {
                    // Sent under the cache lock, so events leave in the order of the changes.
                    let ids = job.token_ids.get(i).map_or(&[][..], Vec::as_slice);
                    let _ = events.send(events_of(&changes, chain, ids, block_size));
                    changes.clear();
                }
            }
        }
        self.running.fetch_add(1, Ordering::Relaxed);
        self.running_blocks.fetch_add(blocks, Ordering::Relaxed);
        Ok(Lane {
            replica: Arc::clone(self),
            _permit: permit,
            blocks,
            prompt_tokens: job.tokens.iter().sum(),
            cached_tokens,
            generated: job.output_tokens * job.prompts(),
        })
    }

    pub fn snapshot(&self) -> Snapshot {
        let (query_tokens, hit_tokens) = {
            let cache = self.cache();
            (cache.query_tokens(), cache.hit_tokens())
        };
        let held = self.running_blocks.load(Ordering::Relaxed);
        Snapshot {
            waiting: self.waiting.load(Ordering::Relaxed),
            running: self.running.load(Ordering::Relaxed),
            kv_usage: (held as f64 / self.config.kv_blocks.max(1) as f64).min(1.0),
            query_tokens,
            hit_tokens,
            succeeded: self.succeeded.load(Ordering::Relaxed),
            prompt_tokens: self.prompt_tokens.load(Ordering::Relaxed),
            generation_tokens: self.generation_tokens.load(Ordering::Relaxed),
        }
    }
}

/// Adds one to a gauge for as long as it lives.
struct Counted<'a>(&'a AtomicUsize);

impl<'a> Counted<'a> {
    fn new(gauge: &'a AtomicUsize) -> Self {
        gauge.fetch_add(1, Ordering::Relaxed);
        Counted(gauge)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A running request: holds its lane and its private KV blocks until dropped.
#[derive(Debug)]
pub struct Lane {
    replica: Arc<Replica>,
    _permit: OwnedSemaphorePermit,
    blocks: usize,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    generated: usize,
}

impl Lane {
    pub fn uncached_tokens(&self) -> usize {
        self.prompt_tokens.saturating_sub(self.cached_tokens)
    }

    /// Sleeps for the prefill (TTFT = lane wait + overhead + uncached tokens × per-token time).
    pub async fn prefill(&self) {
        let config = &self.replica.config;
        let ms = config.prefill_overhead_ms
            + self.uncached_tokens() as f64 * config.prefill_ms_per_token;
        sleep_ms(ms).await;
        self.replica
            .prompt_tokens
            .fetch_add(self.prompt_tokens as u64, Ordering::Relaxed);
    }

    /// Sleeps for `steps` decode steps.
    pub async fn decode(&self, steps: usize) {
        sleep_ms(steps as f64 * self.replica.config.decode_ms_per_token).await;
    }

    /// Counts the request as a success; only called once the whole answer was handed over.
    pub fn finish(self) {
        self.replica.succeeded.fetch_add(1, Ordering::Relaxed);
        self.replica
            .generation_tokens
            .fetch_add(self.generated as u64, Ordering::Relaxed);
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        self.replica.running.fetch_sub(1, Ordering::Relaxed);
        self.replica
            .running_blocks
            .fetch_sub(self.blocks, Ordering::Relaxed);
    }
}

async fn sleep_ms(ms: f64) {
    // Flags are validated as finite and >= 0; the guard keeps a bad value from panicking in
    // `Duration::from_secs_f64` all the same.
    if ms.is_finite() && ms > 0.0 {
        tokio::time::sleep(Duration::from_secs_f64(ms / 1000.0)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prefixroute_core::request::parse_request;

    fn replica(lanes: usize) -> Arc<Replica> {
        Arc::new(Replica::new(ReplicaConfig {
            model: "m".into(),
            kv_blocks: 64,
            block_size: 4,
            non_ascii: prefixroute_core::tokenizer::NonAscii::Pieces,
            lanes,
            prefill_overhead_ms: 0.0,
            prefill_ms_per_token: 0.0,
            decode_ms_per_token: 0.0,
        }))
    }

    fn job(prompt: &str) -> Job {
        let body = serde_json::json!({"model": "m", "prompt": prompt}).to_string();
        Job::new(&parse_request(body.as_bytes()).unwrap(), 4, 4)
    }

    #[tokio::test]
    async fn second_identical_prompt_hits_the_cache() {
        let replica = replica(2);
        let prompt = "one two three four five six seven eight nine ten";
        let first = replica.admit(&job(prompt)).await.unwrap();
        assert_eq!((first.prompt_tokens, first.cached_tokens), (10, 0));
        first.finish();
        let second = replica.admit(&job(prompt)).await.unwrap();
        // 10 tokens, two full blocks of 4 cached; the lookup cap (10−1)/4 = 2 allows both.
        assert_eq!(second.cached_tokens, 8);
        drop(second);
        let s = replica.snapshot();
        assert_eq!((s.query_tokens, s.hit_tokens), (20, 8));
        assert_eq!((s.running, s.succeeded), (0, 1));
        assert_eq!(s.kv_usage, 0.0);
    }

    #[tokio::test]
    async fn running_lane_holds_private_blocks_and_others_wait() {
        let replica = replica(1);
        let lane = replica.admit(&job("a b c d e")).await.unwrap();
        // 5 uncached tokens → 2 blocks, 4 output tokens → 1 block, of 64.
        assert_eq!(replica.snapshot().kv_usage, 3.0 / 64.0);
        let waiter = {
            let replica = Arc::clone(&replica);
            tokio::spawn(async move { replica.admit(&job("x")).await.map(drop) })
        };
        while replica.snapshot().waiting == 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(replica.snapshot().running, 1);
        drop(lane);
        waiter.await.unwrap().unwrap();
        let s = replica.snapshot();
        assert_eq!((s.waiting, s.running, s.kv_usage), (0, 0, 0.0));
    }
}
