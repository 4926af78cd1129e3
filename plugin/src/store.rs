//! The prefix index in shared data: core's [`PrefixStore`] over proxy-wasm shared data, so that
//! every Envoy worker routes on the same belief.
//!
//! # Layout
//! * Each endpoint has an *insertion clock* (in its `prefixroute/ep/<ip:port>` record). Recording
//!   blocks on an endpoint reserves stamps from its clock with one CAS.
//! * Block hashes live in a fixed table of `2^bits` buckets (`prefixroute/ix/<bits>/<n>`,
//!   bucket = low bits of the hash), each holding up to [`WAYS`] entries `hash → [(endpoint id,
//!   stamp)]`. The table is sized from `endpoints × capacity`, so the key count is bounded and
//!   never grows with traffic (shared data cannot delete keys).
//! * Endpoint `e` holds block `h` iff `clock(e) − stamp(h, e) < capacity`: the last `capacity`
//!   stamps of `e` are its LRU set, and eviction is implicit: nothing is deleted, old stamps
//!   just age out. `forget_endpoint` advances the clock by `capacity`, ageing out everything
//!   with one write.
//! * Not every block of a chain is written: core's [`record_positions`] picks its checkpoints
//!   (the first 4, then one in 16, one in 32 beyond block 259, one in 64 beyond 771, …), the
//!   last block before each marked message boundary (the first and last two) and the last,
//!   with the one-in-16 grid of their gaps up to them, and the 16 after the believed match
//!   (when there is one), each reserving
//!   its weight of stamps (the blocks it stands for); lookups are core's [`believed_match`]
//!   over the same positions (binary searches over the checkpoints and a gap's grid).
//! * A *cold* chain (nothing of it believed on the endpoint: a new conversation, a batch job's
//!   unique prompt) *lodges* its recorded positions in the bucket of its first block, not each
//!   in its own: one bucket read and one write for the whole chain (a cold 16k-token prompt:
//!   2 gets and 4 sets in all, where it was 45 and 47), and a later search of the chain reads
//!   that one bucket. A block's claim is looked for there first, then in its own bucket: a
//!   block hash names its whole prefix, so every chain through a block begins with the same
//!   first block. Positions recorded past a believed match (a conversation's next turn, a
//!   tenant's question after its system prompt) go to their own buckets: lodged under a
//!   shared first block they would make it a key every request of the tenant writes. A
//!   bucket keeps up to [`WAYS`] entries of its own and [`LODGER_WAYS`] lodged ones. Not with
//!   `index: precise`: the servers' events name a block by its hash alone.
//! * A block `e` already holds is re-stamped only when its age reaches `capacity / 4`: hot
//!   prefixes (the shared system prompt) cost reads only. A re-stamp rewrites the prefix's
//!   recorded positions, each standing for the blocks since the one before, and leaves a dead
//!   position behind (the block's old stamp), so the window is `capacity` plus the dead
//!   positions inside it, counted per epoch of the clock in the endpoint record (`window`). It then
//!   holds about `capacity` distinct blocks, as the server's LRU does: a block not referenced
//!   while `capacity` others were ages out, hot or not.
//!
//! While no endpoint has been sent more than `capacity` distinct blocks (and no bucket more
//! than its limits) this gives exactly the core [`prefixroute_core::PrefixIndex`]'s answers
//! for chained hashes, where a block's hash names its prefix, as every hash core makes does
//! (both record the same positions and search them the same way; core's answers are
//! themselves bounded approximations of the longest shared prefix, see
//! [`record_positions`]); beyond that it is an approximate LRU (a re-used
//! block survives as long as it is re-used within ~¾ of the capacity).
//!
//! Reads are cached for one request (the router asks every endpoint about every block), so a
//! request costs one `get` per bucket it touches, and the CAS writes reuse the tokens of those
//! reads. Endpoint records are also carried to the worker's next requests for [`CARRY_MS`]
//! (reads only; dropped as soon as this worker writes any endpoint record): a `get` costs Envoy
//! microseconds and the router reads every endpoint's record per request, so this is what keeps
//! a request's cost from growing with the pool (68 gets at 64 endpoints before, 5 after).
//! Past that, a record read again whose CAS token has not changed (the host gives every write
//! a new one) is not decoded again: most records do not change between a worker's requests.

use std::cell::{Cell, RefCell};
use std::hash::{BuildHasherDefault, Hasher};

use prefixroute_core::index::{believed_length, believed_match, record_positions, Search};
use prefixroute_core::latency::CacheRoom;
use prefixroute_core::order::{f64_key, sort_by_u64_key};
use prefixroute_core::{PrefixStore, Turn};

use crate::codec::{Bucket, EndpointState, Entry, Holder};
use crate::shared::{
    endpoint_key, read_modify_write, read_or_default, BucketKeys, EndpointIds, SetError,
    SharedData, SharedDataErrors, Versioned, CAS_ATTEMPTS, ENDPOINT_KEY_PREFIX,
};
use crate::window::DeadStamps;

/// Entries per bucket. With the table sized for half load, a bucket overflows rarely
/// (Poisson(4) > 8 ≈ 2%), and a bucket value stays ~200 bytes to copy.
pub const WAYS: usize = 8;
/// Endpoints remembered per block; more only when many endpoints share one prefix.
pub const MAX_HOLDERS: usize = 16;
/// Entries a bucket keeps, beyond its [`WAYS`], for blocks lodged there by chains that begin
/// in it: a cold chain lodges its first this many recorded positions in its first block's
/// bucket (see the module docs; all of a prompt up to ~35k tokens: 43 at 1,024 blocks, 61 at
/// 2,048, 84 at 4,096) and the rest in their own buckets, so a chain's are never shed by its
/// own.
pub const LODGER_WAYS: usize = 64;
pub const MIN_TABLE_BITS: u32 = 8;
pub const MAX_TABLE_BITS: u32 = 18;

/// log2 of the bucket count: room for every endpoint's full capacity at half load.
pub fn table_bits(endpoints: usize, capacity_blocks: usize) -> u32 {
    let blocks = (endpoints.max(1) as u128) * (capacity_blocks.max(1) as u128);
    let buckets = blocks.div_ceil(WAYS as u128 / 2).max(1);
    let bits = 128 - (buckets - 1).leading_zeros();
    bits.clamp(MIN_TABLE_BITS, MAX_TABLE_BITS)
}

/// Is a stamp still within the endpoint's last `capacity` stamps? A stamp newer than the clock
/// we read (another worker reserved it after our read) counts as fresh.
pub fn held(clock: u64, stamp: u64, capacity: u64) -> bool {
    clock.saturating_sub(stamp) < capacity
}

/// How much a holder is worth keeping when a bucket must shed something.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Freshness {
    /// A configured endpoint's holder, with the fraction of its capacity window left (0..=1].
    Live(f64),
    /// Aged out of a configured endpoint's window: can be dropped at once.
    Expired,
    /// An endpoint this configuration does not know (another configuration sharing the
    /// `vm_id`, or a removed endpoint): kept while there is room.
    Foreign,
}

fn keep_score(f: Freshness) -> f64 {
    match f {
        Freshness::Live(x) => x,
        Freshness::Foreign => 0.0,
        Freshness::Expired => -1.0,
    }
}

/// One holder write: `endpoint` holds `hash` with `stamp` (and, with `end`, the full blocks
/// of a request, that turn of its group, ended there; with `confirmed`, the server's events
/// reported it), or with `remove` it no longer holds it (the server's events said it evicted
/// the block).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Update {
    pub endpoint: u64,
    pub hash: u64,
    pub stamp: u64,
    pub end: Option<Turn>,
    pub confirmed: bool,
    pub remove: bool,
}

/// Applies `updates` to a bucket: drops expired holders, upserts (the newer stamp wins, an
/// end mark stays unless a newer one replaces it, as in core's index), then sheds the least
/// fresh holders/entries beyond the limits: `ways` entries of blocks that fall in the bucket
/// (`own`), [`LODGER_WAYS`] of blocks lodged there by chains that begin in it (see the module
/// docs). Pure and idempotent (applying the same updates twice changes nothing), so it is
/// tested on its own and a write that lost a CAS race re-applies its updates to the fresh
/// value.
pub fn apply_updates(
    bucket: &mut Bucket,
    updates: &[Update],
    ways: usize,
    own: &dyn Fn(u64) -> bool,
    freshness: &dyn Fn(&Holder) -> Freshness,
) {
    for entry in &mut bucket.entries {
        entry.holders.retain(|h| freshness(h) != Freshness::Expired);
    }
    for u in updates {
        let holder = Holder {
            endpoint: u.endpoint,
            stamp: u.stamp,
            end: u.end,
            confirmed: u.confirmed,
        };
        match bucket.entries.iter_mut().find(|e| e.hash == u.hash) {
            Some(entry) if u.remove => entry.holders.retain(|h| h.endpoint != u.endpoint),
            Some(entry) => match entry.holders.iter_mut().find(|h| h.endpoint == u.endpoint) {
                Some(h) => {
                    h.stamp = h.stamp.max(u.stamp);
                    h.end = u.end.or(h.end);
                    h.confirmed |= u.confirmed;
                }
                None => entry.holders.push(holder),
            },
            None if u.remove => {}
            None => bucket.entries.push(Entry {
                hash: u.hash,
                holders: vec![holder],
            }),
        }
    }
    bucket.entries.retain(|e| !e.holders.is_empty());
    for entry in bucket
        .entries
        .iter_mut()
        .filter(|e| e.holders.len() > MAX_HOLDERS)
    {
        let scores = entry.holders.iter().map(|h| Some(keep_score(freshness(h))));
        let gone = least_fresh(scores, MAX_HOLDERS);
        retain_unmarked(&mut entry.holders, &gone);
    }
    for (keep, lodger) in [(ways.max(1), false), (LODGER_WAYS, true)] {
        let scores = bucket.entries.iter().map(|e| {
            (own(e.hash) != lodger).then(|| {
                e.holders
                    .iter()
                    .map(|h| keep_score(freshness(h)))
                    .fold(f64::NEG_INFINITY, f64::max)
            })
        });
        let gone = least_fresh(scores, keep);
        retain_unmarked(&mut bucket.entries, &gone);
    }
}

/// Which items go so that at most `keep` of the scored ones (`Some`) stay: the lowest
/// scores, on ties the first (the oldest). Each item is scored once: a cold chain lodges
/// dozens of entries in a bucket at once.
fn least_fresh(scores: impl Iterator<Item = Option<f64>>, keep: usize) -> Vec<bool> {
    let mut ranked: Vec<(u64, usize)> = Vec::new();
    let mut len = 0;
    for (i, score) in scores.enumerate() {
        len = i + 1;
        if let Some(score) = score {
            ranked.push((f64_key(score), i));
        }
    }
    let mut gone = vec![false; len];
    if ranked.len() > keep {
        ranked.sort_unstable();
        for &(_, i) in &ranked[..ranked.len() - keep] {
            gone[i] = true;
        }
    }
    gone
}

/// Keeps the items `gone` does not mark.
fn retain_unmarked<T>(items: &mut Vec<T>, gone: &[bool]) {
    let mut i = 0;
    items.retain(|_| {
        i += 1;
        !gone.get(i - 1).copied().unwrap_or(false)
    });
}

/// The ranges of consecutive items of `items` with equal `key`, in order (what
/// `slice::chunk_by` gives on newer Rust than our MSRV).
fn runs<'a, T, K: PartialEq>(
    items: &'a [T],
    key: impl Fn(&T) -> K + 'a,
) -> impl Iterator<Item = std::ops::Range<usize>> + 'a {
    let mut start = 0;
    std::iter::from_fn(move || {
        let first = key(items.get(start)?);
        let len = items[start..]
            .iter()
            .take_while(|x| key(x) == first)
            .count();
        start += len;
        Some(start - len..start)
    })
}

/// Calls `f` with each bucket of `(bucket, update)` pairs and its updates, in the order they
/// were given (a stable sort, not a map of vectors: a map would allocate per bucket).
fn for_each_bucket(mut pairs: Vec<(u64, Update)>, f: &mut dyn FnMut(u64, &[Update])) {
    sort_by_u64_key(&mut pairs, |&(bucket, _)| bucket);
    let updates: Vec<Update> = pairs.iter().map(|&(_, u)| u).collect();
    for run in runs(&pairs, |&(bucket, _)| bucket) {
        f(pairs[run.start].0, &updates[run]);
    }
}

/// A cached value with what we know of its CAS token.
#[derive(Debug, Clone)]
struct Slot<T> {
    value: T,
    /// `Some(0)`: the key did not exist (write unconditionally); `Some(c)`: token of our read;
    /// `None`: we wrote it since and do not know the new token (re-read before a CAS write).
    cas: Option<u32>,
}

impl<T> From<Versioned<T>> for Slot<T> {
    #[inline(always)]
    fn from(read: Versioned<T>) -> Self {
        Slot {
            value: read.value,
            cas: Some(read.cas),
        }
    }
}

/// The request cache's bucket map: a cold request caches one bucket per new block (a
/// thousand for a 16k-token prompt), and a hash map with a one-multiply hasher costs a
/// fraction of a B-tree's comparisons per lookup. Deterministic: no random seed.
type CacheMap<K, V> = hashbrown::HashMap<K, V, BuildHasherDefault<KeyHasher>>;

/// Hashes the cache's bucket numbers (already uniform) with one multiply by an odd constant:
/// distinct keys keep distinct low bits (hashbrown's slot) and the top bits (its control
/// byte) are mixed.
#[derive(Debug, Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(29) ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// Marks a cached copy as of unknown CAS token (another worker wrote the key since), so the
/// next read-modify-write re-reads it. Cheaper than removing it from the cache (the `.wasm`
/// then carries no removal at all). A give-up leaves the last read cached: the rest of this
/// request sees it, the next request re-reads.
fn forget_cas<T>(cached: Option<&mut Slot<T>>) {
    if let Some(slot) = cached {
        slot.cas = None;
    }
}

/// The request cache's per-endpoint entries, by endpoint index: the indices are dense
/// (`0..endpoints`), so a vector of slots serves where a map would hash every lookup, and the
/// `.wasm` carries one hash table type fewer per use.
#[derive(Debug)]
struct PerEndpoint<T>(Vec<Option<T>>);

impl<T> Default for PerEndpoint<T> {
    fn default() -> Self {
        PerEndpoint(Vec::new())
    }
}

impl<T> PerEndpoint<T> {
    fn get(&self, endpoint: usize) -> Option<&T> {
        self.0.get(endpoint)?.as_ref()
    }

    fn get_mut(&mut self, endpoint: usize) -> Option<&mut T> {
        self.0.get_mut(endpoint)?.as_mut()
    }

    fn insert(&mut self, endpoint: usize, value: T) {
        if endpoint >= self.0.len() {
            self.0.resize_with(endpoint + 1, || None);
        }
        self.0[endpoint] = Some(value);
    }

    /// Empties every slot (keeping the room).
    fn clear(&mut self) {
        self.0.iter_mut().for_each(|slot| *slot = None);
    }

    /// Empties the slots whose value `keep` refuses.
    fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        for slot in &mut self.0 {
            if slot.as_ref().is_some_and(|value| !keep(value)) {
                *slot = None;
            }
        }
    }

    /// Takes every value out, with its endpoint.
    fn drain(&mut self) -> impl Iterator<Item = (usize, T)> + '_ {
        self.0
            .iter_mut()
            .enumerate()
            .filter_map(|(endpoint, slot)| Some((endpoint, slot.take()?)))
    }
}

/// How long a worker serves an endpoint record it read for an earlier request to the reads of
/// later ones (not to writes: a CAS write always reads the record first). A shared-data read
/// costs Envoy 3-6 us (docs/benchmarks.md), one per endpoint per request; within this window
/// another worker's write to the record (its clock, a scrape, a down mark) reaches this
/// worker's decisions up to this much later, against scrape intervals of hundreds of ms.
pub const CARRY_MS: u64 = 5;

/// The index's host: the worker's shared data, counting this worker's writes to endpoint
/// records (`prefixroute/ep/...`), so that records carried from an earlier request are dropped
/// once this worker wrote any (the scheduler's scrape, cold-pick and down writes go through
/// here too).
#[derive(Debug)]
pub struct TrackedHost<H> {
    inner: H,
    endpoint_writes: Cell<u64>,
}

impl<H: SharedData> SharedData for TrackedHost<H> {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, u32> {
        self.inner.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), SetError> {
        if key.starts_with(ENDPOINT_KEY_PREFIX) {
            self.endpoint_writes.set(self.endpoint_writes.get() + 1);
        }
        self.inner.set(key, value, cas)
    }
}

/// Per-request read cache, and the request's index writes, applied to the cached buckets at
/// once (so the request reads its own writes) and sent to shared data by `end_request`.
#[derive(Debug, Default)]
struct Cache {
    states: PerEndpoint<Slot<EndpointState>>,
    /// Endpoint records read by earlier requests, with the time of the read: served to reads
    /// while younger than [`CARRY_MS`] (see [`SharedIndex::begin_request_at`]).
    carried: PerEndpoint<(EndpointState, u64)>,
    /// The time of the current request (`begin_request_at`); `None`: carry nothing.
    now_ms: Option<u64>,
    /// The host's count of endpoint-record writes when `carried` was last filled.
    carried_writes: u64,
    /// The last version of each endpoint record this worker decoded, with its CAS token: a
    /// read that returns the same token (the host gives every write a new one) reuses it
    /// instead of decoding the bytes again. Kept across requests: most records do not change
    /// between one request and the next (the router reads every endpoint's for every request,
    /// and a request changes only its own endpoint's).
    decoded: PerEndpoint<Slot<EndpointState>>,
    buckets: CacheMap<u64, Slot<Bucket>>,
    /// (bucket, update) in the order queued; grouped by bucket when sent.
    pending: Vec<(u64, Update)>,
    /// A cold pick's stamp for an endpoint's `last_cold` (see [`SharedIndex::publish_cold`]),
    /// until a write of that endpoint's record carries it.
    cold: Option<(usize, u64)>,
    errors: SharedDataErrors,
}

/// [`PrefixStore`] over shared data (see the module docs).
#[derive(Debug)]
pub struct SharedIndex<H: SharedData> {
    host: TrackedHost<H>,
    ids: EndpointIds,
    state_keys: Vec<String>,
    /// The configured capacity (what the table is sized for).
    capacity: u64,
    /// Each endpoint's window: the configured capacity, or less where the endpoint reports a
    /// smaller cache (core's `PrefixStore::set_capacity`).
    capacities: Vec<u64>,
    bits: u32,
    keys: BucketKeys,
    cache: RefCell<Cache>,
    /// `index: precise`: how many clock positions a block the router recorded but the server
    /// has not confirmed stays believed on an endpoint whose events arrive.
    speculative_blocks: Option<u64>,
}

/// How `endpoint`'s holders are judged during one request.
#[derive(Debug, Clone, Copy)]
struct View {
    clock: u64,
    window: u64,
    /// (truth epoch, speculative window) on an endpoint whose events are live.
    precise: Option<(u64, u64)>,
}

impl View {
    // Not inlined: inlined into every search's probes it cost the .wasm ~700 bytes.
    #[inline(never)]
    fn holds(&self, h: &Holder) -> bool {
        match self.precise {
            Some((epoch, speculative)) => {
                h.stamp >= epoch
                    && (h.confirmed || self.clock.saturating_sub(h.stamp) < speculative)
            }
            None => held(self.clock, h.stamp, self.window),
        }
    }

    fn freshness(&self, h: &Holder) -> Freshness {
        if !self.holds(h) {
            return Freshness::Expired;
        }
        let span = match self.precise {
            Some(_) if h.confirmed => return Freshness::Live(1.0),
            Some((_, speculative)) => speculative,
            None => self.window,
        };
        Freshness::Live(1.0 - self.clock.saturating_sub(h.stamp) as f64 / span.max(1) as f64)
    }
}

impl<H: SharedData> SharedIndex<H> {
    /// An index over `addresses` with its table sized for exactly them.
    pub fn new(host: H, addresses: &[String], capacity_blocks: usize) -> Self {
        let bits = table_bits(addresses.len(), capacity_blocks);
        Self::with_table_bits(host, addresses, capacity_blocks, bits)
    }

    /// An index whose table has `2^bits` buckets whatever the current pool: a discovered pool
    /// changes size, the table cannot (its keys carry `bits`, and every worker must agree).
    pub fn with_table_bits(
        host: H,
        addresses: &[String],
        capacity_blocks: usize,
        bits: u32,
    ) -> Self {
        let capacity = capacity_blocks.max(1) as u64;
        let mut index = SharedIndex {
            host: TrackedHost {
                inner: host,
                endpoint_writes: Cell::new(0),
            },
            state_keys: Vec::new(),
            capacities: Vec::new(),
            ids: EndpointIds::new(&[]),
            capacity,
            bits: bits.clamp(MIN_TABLE_BITS, MAX_TABLE_BITS),
            keys: BucketKeys::new(bits.clamp(MIN_TABLE_BITS, MAX_TABLE_BITS)),
            cache: RefCell::new(Cache::default()),
            speculative_blocks: None,
        };
        index.set_endpoints(addresses);
        index
    }

    /// The pool is now `addresses`. Nothing in shared data changes: an endpoint's records are
    /// keyed by its address (and its holders by the address's id), so one that stays keeps its
    /// belief under its new index, and one that left becomes a foreign holder that buckets
    /// shed first.
    pub fn set_endpoints(&mut self, addresses: &[String]) {
        self.state_keys = addresses.iter().map(|a| endpoint_key(a)).collect();
        self.capacities = vec![self.capacity; addresses.len()];
        self.ids = EndpointIds::new(addresses);
        *self.cache.get_mut() = Cache::default();
    }

    /// `index: precise`: endpoints whose KV events arrive are judged by them, blocks only the
    /// router recorded staying believed for `speculative_blocks` clock positions.
    pub fn set_precise(&mut self, speculative_blocks: Option<u64>) {
        self.speculative_blocks = speculative_blocks.map(|b| b.max(1));
    }

    /// How `endpoint`'s holders are judged now.
    fn view(&self, endpoint: usize) -> View {
        let capacity = self.endpoint_capacity(endpoint);
        self.read_state(endpoint, true, |state| View {
            clock: state.clock,
            window: state.dead.window(state.clock, state.window_start, capacity),
            precise: self
                .speculative_blocks
                .filter(|_| state.precise)
                .map(|speculative| (state.truth_epoch, speculative)),
        })
    }

    /// What `endpoint`'s server reported through the relay: whether its events arrive
    /// (`live`), whether it lost everything first (`cleared`), the blocks it stored and the
    /// ones it removed. One CAS on its record (stamps for the stored blocks; a clear moves its
    /// truth epoch past every older stamp), then the holders, batched per bucket like a
    /// request's writes (send them with `end_request`).
    pub fn apply_truth(
        &mut self,
        endpoint: usize,
        live: bool,
        cleared: bool,
        stored: &[u64],
        removed: &[u64],
    ) {
        let Some(id) = self.ids.id(endpoint) else {
            return;
        };
        let n = stored.len() as u64;
        let clock = self.update_state(endpoint, |mut next: EndpointState| {
            if cleared || !live {
                next.truth_epoch = next.clock.saturating_add(1);
            }
            next.precise = live;
            next.clock = next.clock.saturating_add(n);
            Some(next)
        });
        let Some(clock) = clock else {
            return;
        };
        let confirmed = stored.iter().enumerate().map(|(k, &hash)| Update {
            endpoint: id,
            hash,
            stamp: clock - k as u64,
            confirmed: true,
            ..Update::default()
        });
        let removals = removed.iter().map(|&hash| Update {
            endpoint: id,
            hash,
            remove: true,
            ..Update::default()
        });
        self.queue_by_bucket(
            confirmed
                .chain(removals)
                .map(|u| (self.bucket_of(u.hash), u)),
        );
    }

    /// The id table the index writes holders with.
    pub fn ids(&self) -> &EndpointIds {
        &self.ids
    }

    pub fn host(&self) -> &TrackedHost<H> {
        &self.host
    }

    pub fn table_bits(&self) -> u32 {
        self.bits
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The capacity of `endpoint`'s belief, in blocks.
    pub fn endpoint_capacity(&self, endpoint: usize) -> u64 {
        self.capacities
            .get(endpoint)
            .copied()
            .unwrap_or(self.capacity)
    }

    /// Forget cached reads: call before each request so it sees other workers' writes.
    pub fn begin_request(&mut self) {
        self.cache.get_mut().carried.clear();
        self.start_request(None);
    }

    /// [`Self::begin_request`] for a request at `now_ms` that may read the endpoint records
    /// earlier requests of this worker read, while younger than [`CARRY_MS`] and not written by
    /// this worker since (buckets are always read afresh: they are what a decision matches on).
    /// With one worker this reads exactly what shared data holds; with several, another
    /// worker's write to a record is seen up to [`CARRY_MS`] late.
    pub fn begin_request_at(&mut self, now_ms: u64) {
        let writes = self.host.endpoint_writes.get();
        let cache = self.cache.get_mut();
        if writes != cache.carried_writes {
            cache.carried.clear();
        } else {
            cache
                .carried
                .retain(|&(_, read_at)| now_ms.saturating_sub(read_at) < CARRY_MS);
        }
        self.start_request(Some(now_ms));
    }

    /// The per-request part of the cache, emptied for a request at `now_ms` (`None`: one whose
    /// reads are not carried on).
    fn start_request(&mut self, now_ms: Option<u64>) {
        let cache = self.cache.get_mut();
        cache.now_ms = now_ms;
        cache.states.clear();
        cache.buckets.clear();
        cache.pending.clear();
        cache.cold = None;
    }

    /// Shares a cold pick of this request: `endpoint`'s `last_cold` becomes `stamp` unless a
    /// worker wrote a later one. Carried by the write that reserves the request's stamps on
    /// that record when it records blocks there (a cold request always does, unless it is
    /// shorter than a block), else written by [`Self::end_request`]: one CAS of the record a
    /// cold request, not two.
    pub fn publish_cold(&mut self, endpoint: usize, stamp: u64) {
        self.cache.get_mut().cold = Some((endpoint, stamp));
    }

    /// Sends the request's index writes (one CAS per bucket touched), drops the request's
    /// cache and returns the counters it produced.
    pub fn end_request(&mut self) -> SharedDataErrors {
        let pending = std::mem::take(&mut self.cache.get_mut().pending);
        for_each_bucket(pending, &mut |bucket, updates| {
            self.write_bucket(bucket, updates)
        });
        if let Some((endpoint, stamp)) = self.cache.get_mut().cold.take() {
            self.update_state(endpoint, |mut next: EndpointState| {
                (next.last_cold < stamp).then(|| {
                    next.last_cold = stamp;
                    next
                })
            });
        }
        let writes = self.host.endpoint_writes.get();
        let cache = self.cache.get_mut();
        // What this request read or wrote of the endpoint records is current as of its time:
        // carried to the next request (see `begin_request_at`).
        if let Some(read_at) = cache.now_ms.take() {
            for (endpoint, slot) in cache.states.drain() {
                cache.carried.insert(endpoint, (slot.value, read_at));
            }
            cache.carried_writes = writes;
        }
        cache.states.clear();
        cache.buckets.clear();
        std::mem::take(&mut cache.errors)
    }

    /// `f` of the endpoint's record as read during this request, without copying it (the
    /// router reads a few fields of every endpoint's record for every request, and copies of
    /// records are what a wasm instruction count sees).
    pub fn with_endpoint_state<R>(
        &self,
        endpoint: usize,
        f: impl FnOnce(&EndpointState) -> R,
    ) -> R {
        self.read_state(endpoint, false, f)
    }

    /// `f` of the cached record; `after_own_write`: a copy our own write left (its CAS token
    /// unknown) serves too, else it is re-read.
    fn read_state<R>(
        &self,
        endpoint: usize,
        after_own_write: bool,
        f: impl FnOnce(&EndpointState) -> R,
    ) -> R {
        {
            let cache = self.cache.borrow();
            if let Some(slot) = cache.states.get(endpoint) {
                if after_own_write || slot.cas.is_some() {
                    return f(&slot.value);
                }
            } else if let Some((value, _)) = cache.carried.get(endpoint) {
                return f(value);
            }
        }
        if let Err(status) = self.fetch_state(endpoint) {
            self.note_read_error::<()>(status);
            return f(&EndpointState::default());
        }
        let cache = self.cache.borrow();
        match cache.states.get(endpoint) {
            Some(slot) => f(&slot.value),
            None => f(&EndpointState::default()),
        }
    }

    fn bucket_of(&self, hash: u64) -> u64 {
        hash & ((1u64 << self.bits) - 1)
    }

    /// Counts a failed read, which then reads as the default (nothing believed).
    fn note_read_error<T: Default>(&self, _status: u32) -> T {
        self.cache.borrow_mut().errors.host_errors += 1;
        T::default()
    }

    /// The endpoint's record through the request cache. The cached copy serves unless our own
    /// write made its CAS token unknown or `stale` (a lost race) says another worker wrote it.
    /// An endpoint index out of range reads as the default and is never written.
    fn load_state(&self, endpoint: usize, stale: bool) -> Result<Slot<EndpointState>, u32> {
        if stale {
            forget_cas(self.cache.borrow_mut().states.get_mut(endpoint));
        }
        let usable =
            matches!(self.cache.borrow().states.get(endpoint), Some(slot) if slot.cas.is_some());
        if !usable {
            self.fetch_state(endpoint)?;
        }
        Ok(self
            .cache
            .borrow()
            .states
            .get(endpoint)
            .cloned()
            .unwrap_or(Slot {
                value: EndpointState::default(),
                cas: None,
            }))
    }

    /// Reads the endpoint's record from shared data into the request cache. An endpoint index
    /// out of range has no record: nothing is cached, and it reads as the default.
    fn fetch_state(&self, endpoint: usize) -> Result<(), u32> {
        let Some(key) = self.state_keys.get(endpoint) else {
            return Ok(());
        };
        let slot = match self.host.get(key)? {
            None => Slot {
                value: EndpointState::default(),
                cas: Some(0),
            },
            Some((bytes, cas)) => {
                let known = self
                    .cache
                    .borrow()
                    .decoded
                    .get(endpoint)
                    .filter(|known| cas != 0 && known.cas == Some(cas))
                    .map(|known| known.value.clone());
                let value = known.unwrap_or_else(|| {
                    let value = EndpointState::decode(&bytes).unwrap_or_default();
                    let copy = Slot {
                        value: value.clone(),
                        cas: Some(cas),
                    };
                    self.cache.borrow_mut().decoded.insert(endpoint, copy);
                    value
                });
                Slot {
                    value,
                    cas: Some(cas),
                }
            }
        };
        self.cache.borrow_mut().states.insert(endpoint, slot);
        Ok(())
    }

    /// Reads a bucket from shared data into the request cache (replacing what was cached),
    /// without copying it: the hot read path only looks into the cached copy.
    fn fetch_bucket(&self, bucket: u64) -> Result<(), u32> {
        let read = self.keys.with_key(bucket, |key| {
            read_or_default(&self.host, key, Bucket::decode)
        });
        let slot = Slot::from(read?);
        self.cache.borrow_mut().buckets.insert(bucket, slot);
        Ok(())
    }

    /// The bucket for the write at `end_request`, taken out of the request cache (not copied:
    /// the cache is dropped after the writes, and the write puts back what it wrote); re-read
    /// if our own write made the cached CAS token unknown or a lost race made it stale.
    fn take_bucket(&self, bucket: u64) -> Result<Slot<Bucket>, u32> {
        let usable = matches!(
            self.cache.borrow().buckets.get(&bucket),
            Some(slot) if slot.cas.is_some()
        );
        if !usable {
            self.fetch_bucket(bucket)?;
        }
        let mut cache = self.cache.borrow_mut();
        Ok(match cache.buckets.get_mut(&bucket) {
            Some(slot) => Slot {
                value: std::mem::take(&mut slot.value),
                cas: slot.cas,
            },
            None => Slot {
                value: Bucket::default(),
                cas: Some(0),
            },
        })
    }

    /// `endpoint_id`'s claim on `hash` in `bucket`. Reads go through the cache without copying
    /// the bucket: `longest_match` asks every endpoint about every block, so this is the
    /// plugin's hottest path.
    fn holder_in(&self, bucket: u64, hash: u64, endpoint_id: u64) -> Option<Holder> {
        if !self.cache.borrow().buckets.contains_key(&bucket) {
            if let Err(status) = self.fetch_bucket(bucket) {
                return self.note_read_error::<Option<Holder>>(status);
            }
        }
        self.cache
            .borrow()
            .buckets
            .get(&bucket)?
            .value
            .holder(hash, endpoint_id)
    }

    /// `id`'s claim on block `i` of `chain`, and the bucket it is in: lodged in the bucket of
    /// the chain's first block (a cold chain's positions, see the module docs) or in its own.
    /// The lodged claim is looked at first and serves when `view` holds it, so a chain
    /// recorded cold costs a later search one bucket read; else a claim in the block's own
    /// bucket, else the lodged one (not held).
    fn locate(&self, chain: &[u64], i: usize, id: u64, view: View) -> Option<(u64, Holder)> {
        let (&first, &hash) = chain.first().zip(chain.get(i))?;
        let head = self.bucket_of(first);
        let own = self.bucket_of(hash);
        let lodged = self.holder_in(head, hash, id);
        if own == head || lodged.is_some_and(|h| view.holds(&h)) {
            return lodged.map(|h| (head, h));
        }
        match self.holder_in(own, hash, id) {
            Some(h) => Some((own, h)),
            None => lodged.map(|h| (head, h)),
        }
    }

    /// How many leading blocks of `chain` the endpoint is believed to hold, and the held
    /// positions the search looked at: core's [`believed_match`] (a binary search over the
    /// recorded checkpoints, then the positions before the next one), one bucket read per
    /// position looked at, shared by every endpoint's search.
    fn probe(&self, id: u64, view: View, chain: &[u64]) -> (usize, Vec<usize>) {
        believed_match(chain.len(), Search::Binary, self.holds(id, view, chain))
    }

    /// Whether the endpoint `id` (as `view` sees it) is believed to hold `chain[i]`.
    fn holds<'a>(
        &'a self,
        id: u64,
        view: View,
        chain: &'a [u64],
    ) -> impl FnMut(usize) -> bool + 'a {
        move |i| {
            self.locate(chain, i, id, view)
                .is_some_and(|(_, h)| view.holds(&h))
        }
    }

    fn freshness(&self, h: &Holder) -> Freshness {
        match self.ids.index(h.endpoint) {
            None => Freshness::Foreign,
            Some(endpoint) => self.view(endpoint).freshness(h),
        }
    }

    /// Advances `endpoint`'s clock by `n` stamps, `new` of them for blocks it did not hold,
    /// `dead` the stamps the others replace (their positions die), with a CAS (with `restart`,
    /// its belief is emptied instead: it holds nothing); returns the new clock, or `None` when
    /// the write failed (counted).
    fn advance_clock(
        &self,
        endpoint: usize,
        n: u64,
        new: u64,
        dead: &[(u64, u64)],
        restart: bool,
    ) -> Option<u64> {
        let capacity = self.endpoint_capacity(endpoint);
        let cold = match self.cache.borrow().cold {
            Some((e, stamp)) if e == endpoint => Some(stamp),
            _ => None,
        };
        let clock = self.update_state(endpoint, |mut next: EndpointState| {
            if let Some(stamp) = cold {
                next.last_cold = next.last_cold.max(stamp);
            }
            let from = next.clock;
            next.clock = next.clock.saturating_add(n);
            if restart {
                next.window_start = next.clock;
                next.fill = 0;
                next.dead = DeadStamps::default();
                next.dead.fit(capacity, next.clock);
            } else {
                next.fill = next.fill.saturating_add(new);
                next.dead.fit(capacity, from);
                next.dead.advance(from, next.clock);
                for &(stamp, count) in dead {
                    next.dead.kill_many(stamp, count, next.clock);
                }
            }
            Some(next)
        });
        if clock.is_some() && cold.is_some() {
            self.cache.borrow_mut().cold = None;
        }
        clock
    }

    /// A read-modify-write of `endpoint`'s record through the request cache (the cached copy
    /// serves the first attempt); the written record's clock, or `None` when it failed
    /// (counted). Our write changes the CAS token, so the cached copy then serves reads and a
    /// later write re-reads.
    fn update_state(
        &self,
        endpoint: usize,
        update: impl FnMut(EndpointState) -> Option<EndpointState>,
    ) -> Option<u64> {
        let key = self.state_keys.get(endpoint)?;
        let outcome = read_modify_write(
            CAS_ATTEMPTS,
            |stale| {
                self.load_state(endpoint, stale).map(|slot| Versioned {
                    value: slot.value,
                    cas: slot.cas.unwrap_or(0),
                })
            },
            update,
            |next, cas| self.host.set(key, &next.encode(), cas),
        );
        let next = self.cache.borrow_mut().errors.settle(outcome)?;
        let clock = next.clock;
        self.cache.borrow_mut().states.insert(
            endpoint,
            Slot {
                value: next,
                cas: None,
            },
        );
        Some(clock)
    }

    /// Queues `(bucket, update)` pairs, grouped by bucket (one write per bucket at
    /// `end_request`).
    fn queue_by_bucket(&self, updates: impl Iterator<Item = (u64, Update)>) {
        for_each_bucket(updates.collect(), &mut |bucket, updates| {
            self.queue_updates(bucket, updates)
        });
    }

    /// Applies `updates` to the cached bucket now (so this request reads its own writes) and
    /// queues them for `end_request`. The cached CAS token stays the one of our read.
    fn queue_updates(&self, bucket: u64, updates: &[Update]) {
        let cached = self.cache.borrow().buckets.contains_key(&bucket);
        if !cached {
            if let Err(status) = self.fetch_bucket(bucket) {
                return self.note_read_error(status);
            }
        }
        // Updated in place, not copied: taken out of the cache while `freshness` reads the
        // endpoint records through it, and put back.
        let mut value = self
            .cache
            .borrow_mut()
            .buckets
            .get_mut(&bucket)
            .map(|slot| std::mem::take(&mut slot.value))
            .unwrap_or_default();
        let own = |hash| self.bucket_of(hash) == bucket;
        apply_updates(&mut value, updates, WAYS, &own, &|h| self.freshness(h));
        let mut cache = self.cache.borrow_mut();
        if let Some(cached) = cache.buckets.get_mut(&bucket) {
            cached.value = value;
        }
        cache.pending.extend(updates.iter().map(|&u| (bucket, u)));
    }

    fn write_bucket(&self, bucket: u64, updates: &[Update]) {
        let key = self.keys.key(bucket);
        let outcome = read_modify_write(
            CAS_ATTEMPTS,
            |stale| {
                // After a lost race the cached copy is another worker's past: re-read.
                if stale {
                    forget_cas(self.cache.borrow_mut().buckets.get_mut(&bucket));
                }
                // The first attempt writes the cached copy `queue_updates` already applied
                // the updates to, under the token of its read; only a re-read needs them again.
                let applied = !stale
                    && self
                        .cache
                        .borrow()
                        .buckets
                        .get(&bucket)
                        .is_some_and(|slot| slot.cas.is_some());
                let slot = self.take_bucket(bucket)?;
                Ok(Versioned {
                    value: (slot.value, applied),
                    cas: slot.cas.unwrap_or(0),
                })
            },
            |(mut next, applied): (Bucket, bool)| {
                if !applied {
                    let own = |hash| self.bucket_of(hash) == bucket;
                    apply_updates(&mut next, updates, WAYS, &own, &|h| self.freshness(h));
                }
                Some((next, true))
            },
            |(next, _), cas| self.host.set(&key, &next.encode(), cas),
        );
        let written = self.cache.borrow_mut().errors.settle(outcome);
        if let Some((next, _)) = written {
            self.cache.borrow_mut().buckets.insert(
                bucket,
                Slot {
                    value: next,
                    cas: None,
                },
            );
        }
    }
}

impl<H: SharedData> PrefixStore for SharedIndex<H> {
    fn longest_match(&self, endpoint: usize, chain: &[u64]) -> usize {
        let Some(id) = self.ids.id(endpoint) else {
            return 0;
        };
        // The length only: the held positions are for a record's refresh.
        believed_length(
            chain.len(),
            Search::Binary,
            self.holds(id, self.view(endpoint), chain),
        )
    }

    fn record_marked(&mut self, endpoint: usize, chain: &[u64], marks: &[usize]) {
        let Some(id) = self.ids.id(endpoint) else {
            return;
        };
        let view = self.view(endpoint);
        let (clock, window) = (view.clock, view.window);
        let refresh_after = (self.endpoint_capacity(endpoint) / 4).max(1);
        let (matched, probes) = self.probe(id, view, chain);
        let located = |i: usize| self.locate(chain, i, id, view);
        let age = |i: usize| located(i).map(|(_, h)| clock.saturating_sub(h.stamp));
        let needs_stamp = |i: usize| age(i).map_or(true, |a| a >= refresh_after);
        // The matched prefix keeps its stamps while the blocks the search looked at are young:
        // then reading the prefix again would only confirm that. When one is old enough to
        // refresh (once per `capacity/4` records of a hot prefix), the prefix's recorded
        // positions are re-stamped (those this request would record over it, and what the
        // search found), each taking the clock positions of the blocks since the one before,
        // so a refresh ages the endpoint's other blocks as core's LRU touching every block of
        // the prefix does. Not every block: a 16k-token prefix is 1,024 blocks, one bucket
        // read each, where its ~80 positions are all a later search looks at. A position
        // another request recorded inside the prefix (its end, its window) is left to age
        // out; a request ending there is then believed to the checkpoint before, as anywhere
        // the belief is approximate (see `record_positions`). The unmatched tail always needs
        // stamps: only its recorded positions are written, each standing for its weight of
        // clock positions, so the window still counts blocks as core's LRU does.
        let refresh_prefix = probes.iter().any(|&i| needs_stamp(i));
        // (position, weight, bucket) of each write.
        let mut stale: Vec<(usize, u64, u64)> = Vec::new();
        if refresh_prefix {
            // In order, without a sort (the plugin's .wasm carries one, of pairs, see
            // core's `order`): the positions come sorted, the few probes are put in place.
            let mut recorded: Vec<usize> = record_positions(matched, marks, 0)
                .into_iter()
                .map(|(i, _)| i)
                .collect();
            for &i in probes.iter().filter(|&&i| i < matched) {
                if let Err(at) = recorded.binary_search(&i) {
                    recorded.insert(at, i);
                }
            }
            let mut next = 0;
            stale.extend(recorded.into_iter().filter_map(|i| {
                let span = (i + 1 - next) as u64;
                next = i + 1;
                // A block of the matched prefix is re-stamped only if recorded here before
                // (as core refreshes only the blocks it holds: they are counted already),
                // where its claim is.
                let (bucket, h) = located(i)?;
                (clock.saturating_sub(h.stamp) >= refresh_after).then_some((i, span, bucket))
            }));
        }
        // A cold chain (nothing of it believed here) lodges its positions in its first block's
        // bucket: one write for the whole chain. Not with `index: precise`: the servers'
        // events name a block by its hash alone (a run's end, its parent), so its claim must
        // be in its own bucket.
        let head = (matched == 0 && self.speculative_blocks.is_none())
            .then(|| chain.first().map(|&first| self.bucket_of(first)))
            .flatten();
        stale.extend(
            record_positions(chain.len(), marks, matched)
                .into_iter()
                .filter(|&(i, _)| i >= matched)
                .enumerate()
                .map(|(k, (i, weight))| {
                    let bucket = match head {
                        Some(head) if k < LODGER_WAYS => head,
                        _ => self.bucket_of(chain[i]),
                    };
                    (i, weight as u64, bucket)
                }),
        );
        if stale.is_empty() {
            return;
        }
        let n: u64 = stale.iter().map(|&(_, weight, _)| weight).sum();
        let new = chain.len().saturating_sub(matched) as u64;
        // The stamps these replace: positions that die inside the window and widen it.
        let dead: Vec<(u64, u64)> = stale
            .iter()
            .filter_map(|&(i, weight, bucket)| {
                Some((self.holder_in(bucket, chain[i], id)?.stamp, weight))
            })
            .filter(|&(s, _)| held(clock, s, window))
            .collect();
        let Some(new_clock) = self.advance_clock(endpoint, n, new, &dead, false) else {
            return;
        };
        // Stamps new_clock−n+1 ..= new_clock in chain order, the head newest, so when the
        // window slides the tail of a prompt ages out before its shared head (as in core): a
        // block standing for `weight` positions takes the oldest of them, ageing out when the
        // last block it stands for would.
        let mut before = 0;
        let updates = stale.iter().map(|&(i, weight, bucket)| {
            before += weight;
            let update = Update {
                endpoint: id,
                hash: chain[i],
                stamp: new_clock - (before - 1),
                ..Update::default()
            };
            (bucket, update)
        });
        self.queue_by_bucket(updates);
    }

    fn forget_endpoint(&mut self, endpoint: usize) {
        let capacity = self.endpoint_capacity(endpoint);
        self.advance_clock(endpoint, capacity, 0, &[], true);
    }

    fn set_capacity(&mut self, endpoint: usize, blocks: usize) {
        if let Some(slot) = self.capacities.get_mut(endpoint) {
            *slot = (blocks as u64).clamp(1, self.capacity);
        }
    }

    fn room(&self, endpoint: usize) -> CacheRoom {
        if endpoint >= self.ids.len() {
            return CacheRoom::default();
        }
        let capacity = self.endpoint_capacity(endpoint);
        // New blocks since the belief was emptied, up to the capacity: exactly core's LRU
        // size while the window holds, an approximation beyond (like the whole index).
        let believed = self
            .with_endpoint_state(endpoint, |state| state.fill)
            .min(capacity);
        CacheRoom {
            capacity_blocks: capacity as usize,
            believed_blocks: believed as usize,
        }
    }

    fn mark_end(&mut self, endpoint: usize, chain: &[u64], turn: Turn) {
        let (Some(id), Some(&hash)) = (self.ids.id(endpoint), chain.last()) else {
            return;
        };
        {
            let mut cache = self.cache.borrow_mut();
            if let Some(&mut (bucket, ref mut update)) = cache
                .pending
                .iter_mut()
                .find(|(_, u)| u.endpoint == id && u.hash == hash)
            {
                // Recorded by this request: the mark rides on that write.
                update.end = Some(turn);
                let update = *update;
                if let Some(h) = cache
                    .buckets
                    .get_mut(&bucket)
                    .and_then(|b| b.value.entries.iter_mut().find(|e| e.hash == hash))
                    .and_then(|e| e.holders.iter_mut().find(|h| h.endpoint == update.endpoint))
                {
                    h.end = Some(turn);
                }
                return;
            }
        }
        // Held already (a request that repeats an earlier one exactly): mark it, unless it is.
        let view = self.view(endpoint);
        match self.locate(chain, chain.len() - 1, id, view) {
            Some((bucket, h)) if h.end != Some(turn) && view.holds(&h) => self.queue_updates(
                bucket,
                &[Update {
                    endpoint: id,
                    hash,
                    stamp: h.stamp,
                    end: Some(turn),
                    ..Update::default()
                }],
            ),
            _ => {}
        }
    }

    fn continues(&self, endpoint: usize, chain: &[u64], matched: usize) -> Option<Turn> {
        let id = self.ids.id(endpoint)?;
        let view = self.view(endpoint);
        self.locate(chain, matched.checked_sub(1)?, id, view)?.1.end
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::{bucket_key, MemShared};
    use prefixroute_core::index::{gap_blocks, STRIDE_BLOCKS};
    use prefixroute_core::PrefixIndex;
    use std::rc::Rc;

    fn up(endpoint: u64, stamps: &[(u64, u64)]) -> Vec<Update> {
        stamps
            .iter()
            .map(|&(hash, stamp)| Update {
                endpoint,
                hash,
                stamp,
                end: None,
                ..Update::default()
            })
            .collect()
    }

    fn stamp(b: &Bucket, hash: u64, endpoint: u64) -> Option<u64> {
        b.holder(hash, endpoint).map(|h| h.stamp)
    }

    /// A chain of `blocks` spread-out hashes (`seed` 0, 1, …: distinct chains).
    fn spread_chain(blocks: u64, seed: u64) -> Vec<u64> {
        (1..=blocks)
            .map(|k| (k + seed * 1_000_000).wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect()
    }

    /// The bucket in shared data that `chain`'s first block falls in (where a cold chain
    /// lodges).
    fn head_bucket(host: &MemShared, bits: u32, chain: &[u64]) -> Bucket {
        let key = bucket_key(bits, chain[0] & ((1 << bits) - 1));
        Bucket::decode(&host.value(&key).unwrap()).unwrap()
    }

    fn addrs(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("127.0.0.1:{}", 9000 + i)).collect()
    }

    #[test]
    fn runs_are_the_maximal_ranges_of_equal_keys() {
        let items = [3, 3, 1, 4, 4, 4, 3];
        assert_eq!(
            runs(&items, |&x| x).collect::<Vec<_>>(),
            vec![0..2, 2..3, 3..6, 6..7]
        );
        assert_eq!(runs(&[] as &[u8], |&x| x).count(), 0);
    }

    #[test]
    fn table_is_sized_for_half_load_and_clamped() {
        // 8 × 31,250 blocks at 4 per bucket = 62,500 buckets → 2^16.
        assert_eq!(table_bits(8, 31_250), 16);
        assert_eq!(table_bits(1, 10), MIN_TABLE_BITS);
        assert_eq!(table_bits(1024, usize::MAX), MAX_TABLE_BITS);
        assert_eq!(table_bits(1, 1 << 12), 10);
    }

    #[test]
    fn held_window_and_future_stamps() {
        assert!(held(10, 1, 10));
        assert!(!held(11, 1, 10));
        assert!(held(3, 9, 10), "a stamp newer than our clock read is fresh");
    }

    #[test]
    fn apply_updates_upserts_drops_expired_and_sheds_least_fresh() {
        let mut b = Bucket::default();
        let f = |h: &Holder| {
            let stamp = h.stamp;
            if stamp == 0 {
                Freshness::Expired
            } else if stamp == 1 {
                Freshness::Foreign
            } else {
                Freshness::Live(stamp as f64 / 100.0)
            }
        };
        apply_updates(&mut b, &up(5, &[(1, 50), (2, 60)]), 3, &|_| true, &f);
        apply_updates(&mut b, &up(6, &[(1, 70)]), 3, &|_| true, &f);
        assert_eq!(stamp(&b, 1, 5), Some(50));
        assert_eq!(stamp(&b, 1, 6), Some(70));
        // Re-recording keeps the newer stamp.
        apply_updates(&mut b, &up(5, &[(1, 40)]), 3, &|_| true, &f);
        assert_eq!(stamp(&b, 1, 5), Some(50));
        // Expired holders vanish; an entry with no holder left is dropped.
        b.entries.push(Entry {
            hash: 9,
            holders: vec![Holder {
                endpoint: 7,
                stamp: 0,
                end: None,
                confirmed: false,
            }],
        });
        apply_updates(&mut b, &up(5, &[]), 3, &|_| true, &f);
        assert!(b.find(9).is_none());
        // Over capacity: the least fresh entry (foreign-only) goes first, then the stalest.
        b.entries.push(Entry {
            hash: 10,
            holders: vec![Holder {
                endpoint: 8,
                stamp: 1,
                end: None,
                confirmed: false,
            }],
        });
        apply_updates(&mut b, &up(5, &[(3, 90)]), 3, &|_| true, &f);
        assert_eq!(b.entries.len(), 3);
        assert!(b.find(10).is_none(), "foreign-only entry shed first");
        apply_updates(&mut b, &up(5, &[(4, 95)]), 3, &|_| true, &f);
        assert!(b.find(2).is_none(), "stalest live entry (60) shed next");
        assert!(b.find(1).is_some() && b.find(3).is_some() && b.find(4).is_some());
    }

    #[test]
    fn holders_per_entry_are_capped_keeping_the_freshest() {
        let mut b = Bucket::default();
        let f = |h: &Holder| Freshness::Live(h.stamp as f64 / 1000.0);
        for e in 0..(MAX_HOLDERS as u64 + 4) {
            apply_updates(&mut b, &up(e, &[(1, 100 + e)]), WAYS, &|_| true, &f);
        }
        let holders = &b.find(1).unwrap().holders;
        assert_eq!(holders.len(), MAX_HOLDERS);
        assert!(holders.iter().all(|h| h.stamp >= 104));
    }

    #[test]
    fn a_bucket_sheds_its_own_entries_and_its_lodgers_each_beyond_their_own_limit() {
        let mut b = Bucket::default();
        let f = |h: &Holder| Freshness::Live(h.stamp as f64 / 1000.0);
        // Hashes below 100 fall in this bucket; the others are lodged by chains beginning here.
        let own = |hash: u64| hash < 100;
        let owned: Vec<(u64, u64)> = (0..WAYS as u64 + 3).map(|k| (k, 10 + k)).collect();
        let lodged: Vec<(u64, u64)> = (0..LODGER_WAYS as u64 + 5)
            .map(|k| (100 + k, 500 + k))
            .collect();
        apply_updates(&mut b, &up(1, &owned), WAYS, &own, &f);
        apply_updates(&mut b, &up(1, &lodged), WAYS, &own, &f);
        let count =
            |b: &Bucket, lodger: bool| b.entries.iter().filter(|e| own(e.hash) != lodger).count();
        // Fresher lodgers do not push out the bucket's own entries, nor the other way round;
        // within each class the least fresh went.
        assert_eq!(count(&b, false), WAYS);
        assert_eq!(count(&b, true), LODGER_WAYS);
        assert!(b.find(2).is_none() && b.find(3).is_some());
        assert!(b.find(104).is_none() && b.find(105).is_some());
    }

    #[test]
    fn a_cold_chain_beyond_the_lodged_positions_writes_the_rest_to_their_own_buckets() {
        let host = MemShared::new();
        let mut s = SharedIndex::new(host.clone(), &addrs(2), 31_250);
        // A cold 128k-token prompt: 8,192 blocks, 100 recorded positions.
        let chain = spread_chain(8192, 0);
        let positions = record_positions(chain.len(), &[], 0);
        assert!(positions.len() > LODGER_WAYS);
        s.begin_request();
        let (_, before) = host.calls();
        s.record(1, &chain);
        s.end_request();
        let mask = (1u64 << s.table_bits()) - 1;
        let head = head_bucket(&host, s.table_bits(), &chain);
        assert_eq!(head.entries.len(), LODGER_WAYS);
        let spilled: std::collections::BTreeSet<u64> = positions[LODGER_WAYS..]
            .iter()
            .map(|&(p, _)| chain[p] & mask)
            .collect();
        // The head bucket, the spilled positions' buckets and the endpoint's clock.
        assert_eq!(host.calls().1 - before, 2 + spilled.len() as u64);
        // Believed whole, and to its checkpoints on either side of the spill.
        s.begin_request();
        assert_eq!(s.longest_match(1, &chain), 8192);
        assert_eq!(s.longest_match(0, &chain), 0);
        for &(p, _) in &positions[LODGER_WAYS - 2..LODGER_WAYS + 2] {
            let mut other = chain[..=p].to_vec();
            other.push(7);
            assert_eq!(s.longest_match(1, &other), p + 1, "to position {p}");
        }
        s.end_request();
    }

    #[test]
    fn cold_chains_on_two_endpoints_lodge_side_by_side_in_their_first_blocks_bucket() {
        let host = MemShared::new();
        let mut s = SharedIndex::new(host.clone(), &addrs(3), 1000);
        let chain: Vec<u64> = (1..=200u64).map(|k| k * 1_000_003).collect();
        // The same prompt sent cold to endpoints 0 and 2 (two gateways, or a spread), and
        // another sharing its first 40 blocks sent cold to endpoint 1.
        let mut other = chain[..40].to_vec();
        other.extend((0..60u64).map(|k| k * 7 + 5));
        for (e, c) in [(0, &chain), (2, &chain), (1, &other)] {
            s.begin_request();
            assert_eq!(s.longest_match(e, c), 0);
            s.record(e, c);
            s.end_request();
        }
        s.begin_request();
        assert_eq!(s.longest_match(0, &chain), 200);
        assert_eq!(s.longest_match(2, &chain), 200);
        assert_eq!(s.longest_match(1, &other), 100);
        // Endpoint 1 is believed to hold the shared head to a checkpoint of its own chain.
        assert_eq!(s.longest_match(1, &chain), 36);
        s.end_request();
    }

    #[test]
    fn matches_core_index_below_capacity() {
        let host = MemShared::new();
        let a = addrs(3);
        let mut shared = SharedIndex::new(host, &a, 1000);
        let mut core = PrefixIndex::new(3, 1000);
        let (first, later) = (Turn::First, Turn::Later);
        let chains: Vec<(usize, Vec<u64>, Turn)> = vec![
            (0, vec![1, 2, 3, 4], first),
            (1, vec![1, 2, 9], later),
            (0, vec![1, 2, 3, 5, 6], later),
            (2, vec![7], first),
            (1, vec![1, 2, 3, 4], first),
            // The same prompt again, now as a later turn: the newer mark replaces the older.
            (1, vec![1, 2, 9], first),
        ];
        for (e, chain, turn) in &chains {
            shared.begin_request();
            shared.record(*e, chain);
            shared.mark_end(*e, chain, *turn);
            core.record(*e, chain);
            core.mark_end(*e, chain, *turn);
            shared.end_request();
        }
        let probes = [
            vec![1, 2, 3, 4, 8],
            vec![1, 2, 9],
            vec![1, 2, 9, 10],
            vec![7, 11],
            vec![1, 2, 3, 5, 6, 7],
        ];
        shared.begin_request();
        for e in 0..3 {
            assert_eq!(shared.room(e), core.room(e), "endpoint {e}");
            for p in &probes {
                let m = shared.longest_match(e, p);
                assert_eq!(m, core.longest_match(e, p), "endpoint {e} probe {p:?}");
                assert_eq!(
                    shared.continues(e, p, m),
                    core.continues(e, p, m),
                    "endpoint {e} probe {p:?}"
                );
            }
        }
        assert_eq!(
            shared.continues(0, &[1, 2, 3, 5, 6, 7], 5),
            Some(later),
            "ends where a request ended, and says which turn it was"
        );
        assert_eq!(shared.continues(1, &[1, 2, 9, 10], 3), Some(first));
        assert_eq!(
            shared.continues(0, &[1, 2, 3, 4, 8], 3),
            None,
            "a shared head only"
        );
    }

    #[test]
    fn long_chains_are_believed_as_core_believes_them_and_message_boundaries_exactly() {
        let host = MemShared::new();
        let mut shared = SharedIndex::new(host, &addrs(2), 31_250);
        let mut core = PrefixIndex::new(2, 31_250);
        // A 2,000-block prompt (32k tokens) whose messages begin at blocks 300, 1,000 and
        // 1,500: all three lie inside gaps of 32 or 64 blocks between checkpoints.
        let base = spread_chain(2000, 0);
        let marks = [300, 1000, 1500];
        let with_tail = |shared_blocks: usize, seed: u64| -> Vec<u64> {
            let mut chain = base[..shared_blocks].to_vec();
            chain.extend((0..20u64).map(|k| (k + 1) * 0x5555 + seed));
            chain
        };
        shared.begin_request();
        shared.record_marked(0, &base, &marks);
        shared.end_request();
        core.record_marked(0, &base, &marks);
        shared.begin_request();
        for k in [3, 5, 259, 300, 640, 1000, 1333, 1500, 1990, 2000] {
            let probe = with_tail(k, 1);
            let believed = shared.longest_match(0, &probe);
            assert_eq!(believed, core.longest_match(0, &probe), "sharing {k}");
            assert!(
                believed <= k && k - believed < gap_blocks(k - 1),
                "sharing {k}"
            );
            if marks.contains(&k) || k == 2000 || k <= 4 {
                assert_eq!(
                    believed, k,
                    "a message boundary or the end is found exactly"
                );
            }
        }
        shared.end_request();
        // Sharing 1,333 blocks (inside a message, in a gap of 64) is believed short, at the
        // checkpoint before; the request that fell short records its gap's grid, so the next
        // one sharing as much is believed to within 16 blocks.
        let short = with_tail(1333, 1);
        shared.begin_request();
        let first = shared.longest_match(0, &short);
        assert!(first < 1333 - 16, "{first}");
        shared.record(0, &short);
        shared.end_request();
        core.record(0, &short);
        let again = with_tail(1333, 2);
        shared.begin_request();
        let second = shared.longest_match(0, &again);
        assert_eq!(second, core.longest_match(0, &again));
        assert!(second <= 1333 && 1333 - second < STRIDE_BLOCKS, "{second}");
        shared.end_request();
    }

    #[test]
    fn a_reported_capacity_narrows_one_endpoints_window() {
        let host = MemShared::new();
        let mut s = SharedIndex::new(host, &addrs(2), 100);
        s.set_capacity(0, 3);
        s.set_capacity(1, 1000);
        assert_eq!(
            s.endpoint_capacity(1),
            100,
            "never above the configured window"
        );
        s.begin_request();
        s.record(0, &[1, 2, 3, 4]);
        s.record(1, &[1, 2, 3, 4]);
        s.end_request();
        s.begin_request();
        // Stamps 1..=4 with the head newest: the tail block aged out of a window of 3.
        assert_eq!(s.longest_match(0, &[1, 2, 3, 4]), 3);
        assert_eq!(s.longest_match(1, &[1, 2, 3, 4]), 4);
        assert_eq!(
            s.room(0),
            CacheRoom {
                capacity_blocks: 3,
                believed_blocks: 3
            }
        );
        s.forget_endpoint(0);
        s.end_request();
        s.begin_request();
        assert_eq!(s.room(0).believed_blocks, 0, "a restart empties the belief");
        assert_eq!(s.longest_match(0, &[1]), 0);
    }

    #[test]
    fn writes_wait_for_the_end_of_the_request_and_take_one_cas_per_bucket() {
        let host = MemShared::new();
        let mut s = SharedIndex::new(host.clone(), &addrs(1), 1000);
        s.begin_request();
        let (_, sets_before) = host.calls();
        let chain: Vec<u64> = (0..40).collect();
        s.record(0, &chain);
        s.mark_end(0, &chain[..40], Turn::Later);
        // The request reads its own writes before they are sent...
        assert_eq!(s.longest_match(0, &chain), 40);
        assert_eq!(s.continues(0, &chain, 40), Some(Turn::Later));
        let (_, sets_mid) = host.calls();
        assert_eq!(
            sets_mid - sets_before,
            1,
            "only the clock reservation so far"
        );
        s.end_request();
        // ...and the end mark rode on the chain's one write: its 7 recorded positions (the 4
        // dense ones, checkpoints 19 and 35, and the end, 39) lodge in its first block's
        // bucket, which holds them all.
        assert_eq!(record_positions(chain.len(), &[], 0).len(), 7);
        let (_, sets_after) = host.calls();
        assert_eq!(sets_after - sets_mid, 1);
        let head = head_bucket(&host, s.table_bits(), &chain);
        assert_eq!(head.entries.len(), 7);
        s.begin_request();
        assert_eq!(
            s.continues(0, &chain, 40),
            Some(Turn::Later),
            "visible to the next request"
        );
    }

    #[test]
    fn a_cold_picks_stamp_rides_on_the_records_clock_write_or_is_written_at_the_end() {
        let host = MemShared::new();
        let mut s = SharedIndex::new(host.clone(), &addrs(2), 1000);
        let last_cold = |s: &mut SharedIndex<MemShared>, e: usize| {
            s.begin_request();
            s.with_endpoint_state(e, |state| state.last_cold)
        };
        let record_sets = |host: &MemShared, e: usize| host.writes_to(&endpoint_key(&addrs(2)[e]));
        // A cold request that records blocks: one write of the record carries the clock
        // and the stamp.
        s.begin_request();
        s.publish_cold(1, 7);
        s.record(1, &(0..40).collect::<Vec<u64>>());
        s.end_request();
        assert_eq!(record_sets(&host, 1), 1);
        assert_eq!(last_cold(&mut s, 1), 7);
        // Nothing recorded (a prompt shorter than a block): the stamp is written at the end.
        s.begin_request();
        s.publish_cold(0, 8);
        s.end_request();
        assert_eq!(record_sets(&host, 0), 1);
        assert_eq!(last_cold(&mut s, 0), 8);
        // Another worker's later stamp is not taken back; an older one is not rewritten.
        s.begin_request();
        s.publish_cold(0, 5);
        s.end_request();
        assert_eq!(record_sets(&host, 0), 1, "nothing to write");
        assert_eq!(last_cold(&mut s, 0), 8);
        // Recording on one endpoint does not carry another's stamp.
        s.begin_request();
        s.publish_cold(0, 9);
        s.record(1, &(100..140).collect::<Vec<u64>>());
        s.end_request();
        assert_eq!(last_cold(&mut s, 1), 7);
        assert_eq!(last_cold(&mut s, 0), 9);
    }

    #[test]
    fn a_cold_prompt_costs_one_bucket_write_whatever_its_length() {
        let host = MemShared::new();
        let mut s = SharedIndex::new(host.clone(), &addrs(3), 31_250);
        // A cold 16k-token prompt: 1,024 blocks of spread-out hashes.
        let chain = spread_chain(1024, 0);
        s.begin_request();
        let (gets_before, before) = host.calls();
        assert_eq!(s.longest_match(0, &chain), 0);
        s.record(0, &chain);
        s.mark_end(0, &chain, Turn::First);
        s.end_request();
        let (gets, after) = host.calls();
        // Its 39 checkpoints (0–3, 19, 35, …, 259, then 291, …, 771 every 32, then 835, 899,
        // 963), the grid of the end's gap (979, 995, 1011) and the end lodge in the bucket of
        // its first block: one read and one write of it, and of the endpoint's record.
        assert_eq!(
            after - before,
            2,
            "the chain's bucket and the endpoint's clock"
        );
        assert_eq!(gets - gets_before, 2);
        let head = head_bucket(&host, s.table_bits(), &chain);
        assert_eq!(head.entries.len(), record_positions(1024, &[], 0).len());
        // The belief still matches it whole, and counts every block against the capacity.
        s.begin_request();
        assert_eq!(s.longest_match(0, &chain), 1024);
        assert_eq!(s.continues(0, &chain, 1024), Some(Turn::First));
        assert_eq!(s.room(0).believed_blocks, 1024);
        // A prompt sharing 510 blocks of it is believed to share them up to the last
        // checkpoint before, 483 (the checkpoints are 32 blocks apart there).
        let mut other = chain[..510].to_vec();
        other.extend((0..20u64).map(|k| k ^ 0x5555));
        assert_eq!(s.longest_match(0, &other), 484);
        assert!(510 - 484 < gap_blocks(509));
        s.end_request();
        // Searching the chain again reads that bucket and nothing else.
        s.begin_request();
        let (gets_before, _) = host.calls();
        assert_eq!(s.longest_match(0, &chain), 1024);
        assert_eq!(
            host.calls().0 - gets_before,
            2,
            "the endpoint's record and the bucket"
        );
        s.end_request();
    }

    #[test]
    fn two_workers_share_one_belief() {
        let host = MemShared::new();
        let a = addrs(2);
        let mut w1 = SharedIndex::new(host.clone(), &a, 100);
        let mut w2 = SharedIndex::new(host.clone(), &a, 100);
        w1.begin_request();
        w1.record(1, &[10, 11, 12]);
        assert_eq!(w1.end_request(), SharedDataErrors::default());
        w2.begin_request();
        assert_eq!(w2.longest_match(1, &[10, 11, 12, 13]), 3);
        assert_eq!(w2.longest_match(0, &[10, 11]), 0);
        w2.forget_endpoint(1);
        w2.end_request();
        w1.begin_request();
        assert_eq!(w1.longest_match(1, &[10]), 0, "forgotten on every worker");
    }

    #[test]
    fn capacity_ages_out_least_recent_tails_first() {
        let host = MemShared::new();
        let mut s = SharedIndex::new(host, &addrs(1), 4);
        s.begin_request();
        s.record(0, &[1, 2, 3]);
        s.record(0, &[10, 11]);
        // 5 stamps into a window of 4: the oldest recording's tail (3) ages out, its head stays.
        assert_eq!(s.longest_match(0, &[1, 2, 3]), 2);
        assert_eq!(s.longest_match(0, &[10, 11]), 2);
        s.end_request();
    }

    #[test]
    fn a_cyclic_working_set_larger_than_the_capacity_is_believed_as_an_lru_holds_it() {
        // 24 conversations of 10 blocks, each re-sent in turn, growing a block per turn: 240+
        // distinct blocks through a cache of 100. Re-stamps of the blocks a conversation
        // re-sends must not make the window believe more than about 100 of them.
        let host = MemShared::new();
        let mut shared = SharedIndex::new(host, &addrs(1), 100);
        let mut core = PrefixIndex::new(1, 100);
        let mut chains: Vec<Vec<u64>> = (0..24u64)
            .map(|c| (0..10).map(|b| c * 1000 + b).collect())
            .collect();
        for turn in 0..6u64 {
            for (c, chain) in chains.iter_mut().enumerate() {
                chain.push(c as u64 * 1000 + 10 + turn);
                shared.begin_request();
                shared.record(0, chain);
                shared.end_request();
                core.record(0, chain);
            }
        }
        shared.begin_request();
        let believed =
            |store: &dyn Fn(&[u64]) -> usize| -> usize { chains.iter().map(|c| store(c)).sum() };
        let in_shared = believed(&|c: &[u64]| shared.longest_match(0, c));
        let in_core = believed(&|c: &[u64]| core.longest_match(0, c));
        assert!(in_core <= 100, "{in_core}");
        assert!(
            in_shared <= 130 && in_shared + 30 >= in_core,
            "shared index believes {in_shared} blocks, an LRU of 100 holds {in_core}"
        );
    }

    #[test]
    fn conversations_through_a_full_cache_are_not_believed_after_the_lru_evicted_them() {
        // 16 conversations that share a 12-block system prompt, each turn adding 4 blocks,
        // in a shuffled order, through an endpoint that caches 160 blocks: the LRU holds a
        // few conversations. The shared prompt is re-stamped often, the histories rarely; their
        // dead positions sit far back and must not make the belief outlive the server's cache.
        let host = MemShared::new();
        let mut shared = SharedIndex::new(host, &addrs(1), 160);
        let mut core = PrefixIndex::new(1, 160);
        let system: Vec<u64> = (0..12).collect();
        let mut chains: Vec<Vec<u64>> = vec![system.clone(); 16];
        let (mut over, mut under, mut matched, mut seed) = (0usize, 0usize, 0usize, 7u64);
        for _ in 0..400 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let c = (seed >> 33) as usize % chains.len();
            let chain = &mut chains[c];
            let next = chain.len() as u64;
            chain.extend((next..next + 4).map(|b| (c as u64 + 1) * 1_000_000 + b));
            shared.begin_request();
            let (believed, held) = (shared.longest_match(0, chain), core.longest_match(0, chain));
            over += believed.saturating_sub(held);
            under += held.saturating_sub(believed);
            matched += held;
            shared.record(0, chain);
            shared.end_request();
            core.record(0, chain);
        }
        assert!(matched > 0);
        assert!(
            over * 20 <= matched,
            "believed {over} blocks the LRU no longer held, against {matched} it did"
        );
        // And the belief does not give up what the LRU still holds.
        assert!(
            under * 10 <= matched,
            "missed {under} of {matched} held blocks"
        );
    }

    #[test]
    fn hot_prompts_that_fit_stay_believed_while_their_questions_churn() {
        // Three tenants' 15-block prompts on one endpoint that caches 64 blocks, each request
        // with a new 2-block question: an LRU keeps the three prompts (45 blocks) and evicts
        // old questions. Re-stamping the prompts must not push them out of the belief.
        let host = MemShared::new();
        let mut shared = SharedIndex::new(host, &addrs(1), 64);
        let mut core = PrefixIndex::new(1, 64);
        let prompt = |t: u64| -> Vec<u64> { (0..15).map(|b| t * 1000 + b).collect() };
        for i in 0..90u64 {
            let t = i % 3;
            let mut chain = prompt(t);
            chain.extend([t * 1000 + 100 + 2 * i, t * 1000 + 101 + 2 * i]);
            shared.begin_request();
            shared.record(0, &chain);
            shared.end_request();
            core.record(0, &chain);
        }
        shared.begin_request();
        for t in 0..3 {
            assert_eq!(core.longest_match(0, &prompt(t)), 15);
            assert_eq!(shared.longest_match(0, &prompt(t)), 15, "tenant {t}");
        }
    }

    #[test]
    fn hot_prefix_is_not_rewritten_every_request() {
        let host = MemShared::new();
        let mut s = SharedIndex::new(host.clone(), &addrs(2), 1000);
        let chain: Vec<u64> = (100..140).collect();
        s.begin_request();
        s.record(0, &chain);
        s.end_request();
        let (_, sets_before) = host.calls();
        for _ in 0..10 {
            s.begin_request();
            assert_eq!(s.longest_match(0, &chain), 40);
            s.record(0, &chain);
            s.end_request();
        }
        assert_eq!(
            host.calls().1,
            sets_before,
            "no writes for a fresh hot prefix"
        );
    }

    #[test]
    fn refreshing_a_long_hot_prefix_rewrites_the_one_bucket_its_positions_lodge_in() {
        // Two 16k-token prompts, each a quarter of the endpoint's capacity, alternating: each
        // request finds its prefix a quarter of the capacity old and refreshes it.
        let host = MemShared::new();
        let mut s = SharedIndex::new(host.clone(), &addrs(1), 4096);
        let (a, b) = (spread_chain(1024, 1), spread_chain(1024, 2));
        for c in [&a, &b] {
            s.begin_request();
            s.record(0, c);
            s.end_request();
        }
        let positions = record_positions(1024, &[], 0);
        let (bits, id) = (s.table_bits(), s.ids().id(0).unwrap());
        for round in 0..6 {
            let c = if round % 2 == 0 { &a } else { &b };
            s.begin_request();
            let clock = s.with_endpoint_state(0, |state| state.clock);
            s.end_request();
            let (gets_before, sets_before) = host.calls();
            s.begin_request();
            assert_eq!(s.longest_match(0, c), 1024, "round {round}");
            s.record(0, c);
            s.end_request();
            let (gets, sets) = host.calls();
            // Every recorded position re-stamped, in the one bucket they lodge in.
            let bucket = head_bucket(&host, bits, c);
            for &(p, _) in &positions {
                let stamp = bucket.holder(c[p], id).unwrap().stamp;
                assert!(stamp > clock, "round {round}: position {p} refreshed");
            }
            // That bucket and the endpoint record, each read once and written once.
            assert_eq!(gets - gets_before, 2, "round {round}");
            assert_eq!(sets - sets_before, 2, "round {round}");
        }
    }

    #[test]
    fn cas_races_retry_and_give_up_is_counted() {
        let host = MemShared::new();
        let mut s = SharedIndex::new(host.clone(), &addrs(1), 100);
        s.begin_request();
        s.longest_match(0, &[1, 2]);
        host.force_mismatches(3);
        s.record(0, &[1, 2]);
        assert_eq!(s.end_request(), SharedDataErrors::default());
        s.begin_request();
        assert_eq!(s.longest_match(0, &[1, 2]), 2, "written after retries");
        host.force_mismatches(CAS_ATTEMPTS);
        s.record(0, &[3]);
        assert_eq!(s.end_request().cas_give_ups, 1);
    }

    #[test]
    fn foreign_configuration_entries_survive_and_are_not_matched() {
        let host = MemShared::new();
        let mut other = SharedIndex::new(host.clone(), &["10.9.9.9:1".to_string()], 100);
        other.begin_request();
        other.record(0, &[42]);
        other.end_request();
        let mut mine = SharedIndex::new(host.clone(), &addrs(1), 100);
        mine.begin_request();
        assert_eq!(mine.longest_match(0, &[42]), 0);
        mine.record(0, &[42]);
        mine.end_request();
        other.begin_request();
        assert_eq!(other.longest_match(0, &[42]), 1, "its belief was kept");
    }

    #[test]
    fn corrupt_values_read_as_empty() {
        let host = MemShared::new();
        let s = SharedIndex::new(host.clone(), &addrs(1), 100);
        host.set(&endpoint_key("127.0.0.1:9000"), b"\xff\x00", 0)
            .unwrap();
        host.set(&bucket_key(s.table_bits(), 1), b"junk", 0)
            .unwrap();
        assert_eq!(
            s.with_endpoint_state(0, EndpointState::clone),
            EndpointState::default()
        );
        assert_eq!(s.longest_match(0, &[1]), 0);
    }

    /// One request at `now_ms` asking what endpoint 0's cache holds: reads only its record.
    fn believed_blocks(s: &mut SharedIndex<impl SharedData>, now_ms: u64) -> usize {
        s.begin_request_at(now_ms);
        let room = s.room(0);
        s.end_request();
        room.believed_blocks
    }

    #[test]
    fn a_record_read_for_one_request_serves_the_next_within_carry_ms_and_is_read_again_after() {
        let host = MemShared::new();
        let mut s = SharedIndex::new(host.clone(), &addrs(2), 1000);
        believed_blocks(&mut s, 100);
        let (gets, _) = host.calls();
        believed_blocks(&mut s, 100 + CARRY_MS - 1);
        assert_eq!(host.calls().0, gets, "served from the last request's read");
        believed_blocks(&mut s, 100 + CARRY_MS - 1 + CARRY_MS);
        assert_eq!(host.calls().0, gets + 1, "older than CARRY_MS: read again");
        // `begin_request` (no time) carries nothing.
        s.begin_request();
        s.room(0);
        s.end_request();
        assert_eq!(host.calls().0, gets + 2);
    }

    /// Shared data whose reads can be made to report a pinned CAS token, whatever was written
    /// since: a record the host says is unchanged must be served without decoding it again.
    #[derive(Clone)]
    struct PinnedToken {
        inner: MemShared,
        pinned: Rc<Cell<Option<u32>>>,
    }

    impl SharedData for PinnedToken {
        fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, u32> {
            let read = self.inner.get(key)?;
            Ok(read.map(|(bytes, cas)| (bytes, self.pinned.get().unwrap_or(cas))))
        }

        fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), SetError> {
            self.inner.set(key, value, cas)
        }
    }

    #[test]
    fn an_endpoint_record_is_decoded_again_only_when_its_cas_token_changed() {
        let inner = MemShared::new();
        let a = addrs(1);
        let mut writer = SharedIndex::new(inner.clone(), &a, 1000);
        let pinned = Rc::new(Cell::new(None));
        let host = PinnedToken {
            inner: inner.clone(),
            pinned: pinned.clone(),
        };
        let mut reader = SharedIndex::new(host, &a, 1000);
        writer.begin_request_at(0);
        writer.record(0, &[1, 2, 3]);
        writer.end_request();
        assert_eq!(believed_blocks(&mut reader, 0), 3);
        let (_, token) = inner.get(&endpoint_key(&a[0])).unwrap().unwrap();
        writer.begin_request_at(1);
        writer.record(0, &[4, 5]);
        writer.end_request();
        // Read again (past CARRY_MS), with the host reporting the token it had: the record
        // decoded then serves; with the real token the new record is decoded.
        pinned.set(Some(token));
        assert_eq!(believed_blocks(&mut reader, 2 * CARRY_MS), 3);
        pinned.set(None);
        assert_eq!(believed_blocks(&mut reader, 4 * CARRY_MS), 5);
    }

    #[test]
    fn another_workers_write_is_seen_within_carry_ms_and_this_workers_own_write_at_once() {
        let host = MemShared::new();
        let a = addrs(2);
        let mut w1 = SharedIndex::new(host.clone(), &a, 1000);
        let mut w2 = SharedIndex::new(host.clone(), &a, 1000);
        assert_eq!(believed_blocks(&mut w2, 0), 0);
        w1.begin_request_at(0);
        w1.record(0, &[1, 2, 3]);
        w1.end_request();
        assert_eq!(believed_blocks(&mut w1, 1), 3, "the writer sees its write");
        // w2 still serves its read of time 0 (at most CARRY_MS old), then reads w1's write.
        assert_eq!(believed_blocks(&mut w2, 1), 0);
        assert_eq!(believed_blocks(&mut w2, CARRY_MS), 3);
        // A write of w2's own to an endpoint record between its requests (as the scheduler's
        // scrape, cold-pick and down writes are) drops what it carries: w1's next write is
        // seen by w2's next request without waiting.
        w1.begin_request_at(CARRY_MS);
        w1.record(0, &[4, 5]);
        w1.end_request();
        assert_eq!(believed_blocks(&mut w2, CARRY_MS + 1), 3);
        let key = endpoint_key(&a[1]);
        w2.host()
            .set(&key, &EndpointState::default().encode(), 0)
            .unwrap();
        assert_eq!(believed_blocks(&mut w2, CARRY_MS + 2), 5);
    }
}
