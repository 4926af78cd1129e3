//! The approximate prefix index: which blocks the router believes each endpoint holds.
//!
//! It learns only from the router's own decisions (pick → forward → commit), so it is a belief,
//! not a fact: a server may have evicted a block the index still lists. Each endpoint's set is
//! bounded and evicts least-recently-recorded blocks first, which roughly tracks what an LRU
//! server cache of the same size keeps.

mod blocks;

use serde::{Deserialize, Serialize};

use crate::latency::CacheRoom;
use blocks::BlockLru;

/// llm-d's default capacity per endpoint, in blocks.
pub const DEFAULT_CAPACITY_BLOCKS: usize = 31_250;

/// A chain's first blocks are all recorded: a prompt of a few dozen tokens is believed exactly.
/// Longer shared heads are exact where it matters without them: a system prompt or a document
/// in its own message ends at a recorded message boundary, and a head that ends inside a
/// message is found short once and then recorded densely by the request that fell short (see
/// [`record_positions`]). Measured at 16 (git aa75b3c) and 4: every hit rate of the simulator's
/// sweep traces equal to the digit, 11 fewer shared-data gets and sets per cold 1k-token
/// request in the plugin (docs/benchmarks.md).
pub const DENSE_BLOCKS: usize = 4;
/// Beyond [`DENSE_BLOCKS`], the *grid*: one block in this many. Where a chain ends or leaves
/// its believed match, the grid around it is recorded, so a later request sharing the chain
/// is believed to within this many blocks of what it shares.
pub const STRIDE_BLOCKS: usize = 16;
/// Grid points that are *checkpoints* (recorded by every chain that passes them) at each
/// spacing: the first [`DENSE_BLOCKS`] blocks, then this many grid points in a row (blocks 19,
/// 35, …, 259), then this many every other grid point (stride 32, to block 771), this many
/// every fourth (stride 64, to 1,795), and so on, doubling. So a cold prompt's recorded
/// positions grow with the logarithm of its length, not with it (the plugin writes a cold
/// chain's into one shared-data bucket): a cold 16k-token prompt (1,024 blocks) records 39
/// checkpoints instead of 67 with a fixed stride, a 128k-token one 84 instead of 515. Chains up
/// to 260 blocks (4,160 tokens at 16 per block) record exactly what a fixed stride records.
pub const CHECKPOINTS_PER_LEVEL: usize = 16;

/// The positions of a chain of `n` blocks the belief records, in order, each with the number
/// of new blocks it stands for (itself and the unrecorded ones before it, counted from `from`):
///
/// * every checkpoint (see [`CHECKPOINTS_PER_LEVEL`]);
/// * the last block of each prefix in `marks` (block counts: where the request's first and
///   last few messages begin, see [`crate::hashing::BlockHashes::marks`]), and the grid points
///   of its gap up to it (so a gap's grid is held as a prefix up to a recorded end, see
///   `grid_to`);
/// * leaving a believed match of `from` blocks, the grid points from `from` to the next
///   checkpoint;
/// * densely, the blocks around `from`, the request's believed match on the endpoint before
///   this record, where it leaves what is believed there (see `window`); nothing for a cold
///   request (`from` 0): a later request sharing part of it is found short once, as below;
/// * the last block, where the request ends, and the grid of its gap up to it.
///
/// Positions before `from` have weight 0: their blocks are believed and counted already, and
/// a store only refreshes the ones it holds there, it never adds them.
///
/// Recording fewer blocks is what bounds a cold prompt's cost in the plugin (one shared-data
/// write per recorded block); the weights keep the capacity counting blocks, as the server's
/// cache does. What it costs: a match is found at recorded positions only (see
/// [`believed_match`]), so the believed match of a chain that shares part of a recorded chain
/// can fall short of the true shared prefix: by fewer than [`STRIDE_BLOCKS`] blocks where the
/// recorded chain ended or left its match in the same gap between checkpoints, else by fewer
/// than the gap ([`gap_blocks`]: 16 blocks up to block 259, 32 to 771, 64 to 1,795, … about
/// a sixteenth of the depth). Never within the first [`DENSE_BLOCKS`] blocks, never when the
/// shared prefix ends where the recorded request ended (the next turn of a conversation, an
/// exact repeat) or where one of its marked messages began (its first and last
/// [`crate::hashing::KEPT_MARKS`]: a system prompt, a document in its own message, the
/// previous turn's prompt), and only once for a prefix that ends inside a message or at an
/// unmarked boundary between those (a document and its
/// question in one): the request that fell short records its gap's grid and the blocks after
/// its match densely, so the next one finds the end to within [`STRIDE_BLOCKS`], or exactly.
pub fn record_positions(n: usize, marks: &[usize], from: usize) -> Vec<(usize, usize)> {
    let k = checkpoints(n);
    let grid_n = grid_points(n);
    // The last block of each message that begins a later one, and the chain's last.
    let ends = marks
        .iter()
        .filter(|&&k| (1..=n).contains(&k))
        .map(|k| k - 1)
        .chain(n.checked_sub(1));
    // The grid of the match's gap: from `from` to the next checkpoint (none for a cold chain).
    let from_gap = if from == 0 {
        0..0
    } else {
        let next = checkpoints(from);
        grid_points(from)..if next < k {
            checkpoint_on_grid(next)
        } else {
            grid_n
        }
    };
    // One bit per block, read back in order: the sources overlap and come in several
    // increasing runs; a sort would carry its own copy of the standard library's (~3 KB of
    // the plugin's .wasm).
    let mut recorded = vec![0u64; n.div_ceil(64)];
    let mut put = |p: usize| recorded[p / 64] |= 1 << (p % 64);
    (0..k).map(checkpoint_position).for_each(&mut put);
    from_gap.map(grid_point).for_each(&mut put);
    window(from, n).for_each(&mut put);
    for end in ends {
        grid_to(end).map(grid_point).for_each(&mut put);
        put(end);
    }
    // Blocks before `from` are believed already, counted by whatever recorded them: weight 0.
    // The new ones are counted once, each by the next recorded position.
    let mut next = from.min(n);
    let count = recorded.iter().map(|w| w.count_ones() as usize).sum();
    let mut positions = Vec::with_capacity(count);
    for (w, &word) in recorded.iter().enumerate() {
        let mut bits = word;
        while bits != 0 {
            let p = w * 64 + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            if p < next {
                positions.push((p, 0));
            } else {
                positions.push((p, p + 1 - next));
                next = p + 1;
            }
        }
    }
    positions
}

/// The dense part of [`record_positions`] for a request leaving a believed match of `from`
/// blocks: the [`STRIDE_BLOCKS`] blocks from `from` (a later request sharing the prefix then
/// finds its exact end between two grid points), and before them the blocks back to the last
/// grid point (an earlier request's dense part there stays fresh while the prefix is used).
fn window(from: usize, n: usize) -> std::ops::Range<usize> {
    if from == 0 {
        // A cold chain: what a later request shares of it is found at its checkpoints and
        // message boundaries, short by less than a gap once (that request then records
        // densely from its match). Recording the first stride densely here cost the plugin a
        // shared-data get and set per block for every new prompt.
        return 0..0;
    }
    let start = if from <= DENSE_BLOCKS {
        from
    } else {
        grid_point(grid_points(from) - 1) + 1
    };
    start.min(n)..from.saturating_add(STRIDE_BLOCKS).min(n)
}

/// The `g`-th grid point's position (from 0): the dense blocks, then every
/// [`STRIDE_BLOCKS`]-th block.
#[inline]
fn grid_point(g: usize) -> usize {
    if g < DENSE_BLOCKS {
        g
    } else {
        DENSE_BLOCKS + (g - DENSE_BLOCKS + 1) * STRIDE_BLOCKS - 1
    }
}

/// How many grid points lie in a chain of `n` blocks.
#[inline]
fn grid_points(n: usize) -> usize {
    if n <= DENSE_BLOCKS {
        n
    } else {
        DENSE_BLOCKS + (n - DENSE_BLOCKS) / STRIDE_BLOCKS
    }
}

/// The grid points of `p`'s gap up to `p`: those after the last checkpoint at or before it.
/// Recorded up to where a chain ends or a message begins, so the grid of a gap is held as a
/// prefix up to there and a later request's search finds that end (see [`believed_match`]).
fn grid_to(p: usize) -> std::ops::Range<usize> {
    let below = checkpoints(p + 1);
    let start = below
        .checked_sub(1)
        .map_or(0, |c| checkpoint_on_grid(c) + 1);
    start..grid_points(p + 1)
}

/// Grid points that are checkpoints at the first spacing (every grid point): the dense blocks
/// and the first level.
const FIRST_LEVEL_END: usize = DENSE_BLOCKS + CHECKPOINTS_PER_LEVEL;

/// The grid point of the last checkpoint of level `level` (level 0: every grid point; level
/// `j`: every `2^j`-th), so level `j` takes grid points `end(j − 1) + 2^j·(r + 1)`, `r` <
/// [`CHECKPOINTS_PER_LEVEL`]. A chain's levels stay below 27 (a grid point of level `j` lies
/// beyond block `2^(j+8)`), so the shifts fit a 32-bit `usize`.
fn level_end(level: u32) -> usize {
    FIRST_LEVEL_END - 1 + CHECKPOINTS_PER_LEVEL * ((2 << level) - 2)
}

/// The grid point of the `c`-th checkpoint (from 0).
#[inline]
fn checkpoint_on_grid(c: usize) -> usize {
    if c < FIRST_LEVEL_END {
        return c;
    }
    let beyond = c - FIRST_LEVEL_END;
    let level = (beyond / CHECKPOINTS_PER_LEVEL) as u32 + 1;
    level_end(level - 1) + ((beyond % CHECKPOINTS_PER_LEVEL + 1) << level)
}

/// The position of the `c`-th checkpoint.
#[inline]
fn checkpoint_position(c: usize) -> usize {
    grid_point(checkpoint_on_grid(c))
}

/// How many checkpoints lie in a chain of `n` blocks: a count that grows with the logarithm of
/// `n` beyond the first level (see [`CHECKPOINTS_PER_LEVEL`]).
pub fn checkpoints(n: usize) -> usize {
    let grid = grid_points(n);
    let mut count = grid.min(FIRST_LEVEL_END);
    // Each level with grid points beyond the one before: those up to the chain's last.
    let mut level = 1;
    while level_end(level - 1) + 1 < grid {
        count += ((grid - 1 - level_end(level - 1)) >> level).min(CHECKPOINTS_PER_LEVEL);
        level += 1;
    }
    count
}

/// The gap from the checkpoint at or before block `p` of a chain to the next, in blocks: a
/// shared prefix whose last block is `p` is believed short of it by less (see
/// [`record_positions`]).
pub fn gap_blocks(p: usize) -> usize {
    let c = checkpoints(p + 1);
    let below = c.checked_sub(1).map_or(0, |c| checkpoint_position(c) + 1);
    checkpoint_position(c).saturating_sub(below) + 1
}

/// The believed match of a chain of `n` blocks on one endpoint, given which of its positions
/// the endpoint is believed to hold, and the held positions looked at.
///
/// The belief about one chain is prefix-closed at its checkpoints by construction (a block
/// hash names its whole prefix, and recording a chain records every checkpoint before its
/// end), so a binary search over the checkpoints finds the last held one, `log2(checkpoints)`
/// probes; then a binary search over the grid points up to the next checkpoint (recorded up to
/// where a request ended or left its match), `log2(gap / 16)` probes; then the positions up to
/// the next grid point are tried from the furthest down, because a request that ended between
/// two grid points recorded its last block there: the next turn of a conversation matches
/// exactly where the previous one ended. At most `STRIDE_BLOCKS − 1` probes more.
///
/// Near the capacity's edge the belief can have holes (a block aged out while later ones of
/// its chain stayed); then [`Search::Walk`] stops at the first, where the binary search may
/// jump over it and believe more. Whatever it finds is held with its whole prefix, so the
/// answer never exceeds what the endpoint is believed to hold.
pub fn believed_match(
    n: usize,
    search: Search,
    holds: impl FnMut(usize) -> bool,
) -> (usize, Vec<usize>) {
    let mut probed = Vec::new();
    let matched = believed_match_with(n, search, holds, &mut |p| probed.push(p));
    (matched, probed)
}

/// [`believed_match`] without the list of held positions (a lookup that only needs the
/// length allocates nothing).
pub fn believed_length(n: usize, search: Search, holds: impl FnMut(usize) -> bool) -> usize {
    believed_match_with(n, search, holds, &mut |_| {})
}

/// [`believed_match`], telling `held` each held position the search looked at (through
/// `dyn`: one copy of the search per store, whichever list it keeps).
fn believed_match_with(
    n: usize,
    search: Search,
    mut holds: impl FnMut(usize) -> bool,
    held: &mut dyn FnMut(usize),
) -> usize {
    let probe = &mut |p: usize| {
        let is_held = holds(p);
        if is_held {
            held(p);
        }
        is_held
    };
    let k = checkpoints(n);
    let grid_n = grid_points(n);
    let c = held_run(0..k, search, false, probe);
    if c == 0 {
        // Not even the first block (most endpoints, for most requests).
        return 0;
    }
    // Every checkpoint held and the last block too: the whole chain (an exact repeat). Not
    // held: the positions below are tried from the one before it.
    let mut top = n;
    if c == k && n > 0 {
        if probe(n - 1) {
            return n;
        }
        top = n - 1;
    }
    // The grid between the last held checkpoint and the first not held (or the end).
    let gap = checkpoint_on_grid(c - 1) + 1..if c < k { checkpoint_on_grid(c) } else { grid_n };
    // Its last grid point first: a checkpoint before it is held, so most often the prefix
    // runs on through the gap (a warm long prompt), one probe.
    let g = match search {
        Search::Binary if !gap.is_empty() => {
            if probe(grid_point(gap.end - 1)) {
                gap.end
            } else {
                held_run(gap.start..gap.end - 1, search, true, probe)
            }
        }
        _ => held_run(gap, search, true, probe),
    };
    let held_to = if g == 0 { 0 } else { grid_point(g - 1) + 1 };
    let next = if g < grid_n { grid_point(g) } else { top };
    for p in (held_to..next).rev() {
        if probe(p) {
            return p + 1;
        }
    }
    held_to
}

/// Where a run of candidates `range` (believed held as a prefix of it) stops being held: the
/// first index not held, or `range.end`. The candidates are grid points (`on_grid`) or
/// checkpoints.
fn held_run(
    range: std::ops::Range<usize>,
    search: Search,
    on_grid: bool,
    probe: &mut impl FnMut(usize) -> bool,
) -> usize {
    let (start, end) = (range.start, range.end);
    let mut holds = |i: usize| probe(grid_point(if on_grid { i } else { checkpoint_on_grid(i) }));
    if search == Search::Walk {
        let mut i = start;
        while i < end && holds(i) {
            i += 1;
        }
        return i;
    }
    if start == end || !holds(start) {
        return start;
    }
    // The whole run held is the common case (an exact repeat, the next turn).
    if end - start == 1 || holds(end - 1) {
        return end;
    }
    let (mut lo, mut hi) = (start + 1, end - 1);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if holds(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// How [`believed_match`] looks at the checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Search {
    /// Binary search: `log2(checkpoints)` probes; for stores where a probe costs a read
    /// (the plugin's shared data).
    Binary,
    /// Every checkpoint in order up to the first not held: exact with holes; for stores where
    /// a probe is a memory lookup.
    Walk,
}

/// Where the router's belief lives: in process memory ([`PrefixIndex`]) for the CLI and the
/// browser, in proxy-wasm shared data for the plugin.
pub trait PrefixStore {
    /// How many leading hashes of `chain` `endpoint` is believed to hold.
    fn longest_match(&self, endpoint: usize, chain: &[u64]) -> usize;

    /// Believe that `endpoint` now holds every block of `chain`.
    fn record(&mut self, endpoint: usize, chain: &[u64]) {
        self.record_marked(endpoint, chain, &[]);
    }

    /// [`Self::record`], where the prefixes of `marks` blocks (block counts, increasing) end
    /// at message boundaries: the belief records their last blocks (see [`record_positions`]).
    fn record_marked(&mut self, endpoint: usize, chain: &[u64], marks: &[usize]);

    /// Drop everything believed about `endpoint` (it restarted or left the pool).
    fn forget_endpoint(&mut self, endpoint: usize);

    /// Bounds what `endpoint` is believed to hold by its real cache (`blocks` of the router's
    /// block size, at least one): a server that holds 128 blocks cannot hold 31,250, and a
    /// belief that thinks it does never sees the cache fill up. Shrinking drops the least
    /// recently recorded blocks first, as the server would have evicted them.
    fn set_capacity(&mut self, endpoint: usize, blocks: usize);

    /// `endpoint`'s believed cache: its capacity and how many blocks it is believed to hold.
    fn room(&self, endpoint: usize) -> CacheRoom;

    /// Remembers that the full blocks of a request, its group's `turn`, ended at the last block
    /// of `chain` on `endpoint` (the whole chain: a store may keep a block under its chain's
    /// head, see the plugin's store).
    fn mark_end(&mut self, endpoint: usize, chain: &[u64], turn: Turn);

    /// Whether a request whose believed match on `endpoint` is `chain[..matched]` continues an
    /// earlier request there, and that request's turn: the match ends exactly where that
    /// request's full blocks ended, as the next turn of a conversation does. A request that
    /// shares only a head with others (a system prompt, a document) and adds its own tail does
    /// not.
    fn continues(&self, endpoint: usize, chain: &[u64], matched: usize) -> Option<Turn>;
}

/// Where a request stands in its group (a conversation, a tenant's questions, the questions
/// about one document): the first request of the group, or a later one that continues an
/// earlier request (see [`PrefixStore::continues`]). The index keeps it with each end mark, so
/// a request learns what kind of request it continued: how often first requests and later ones
/// are followed differ (a tenant's question is never continued, a conversation's turns
/// nearly always are), and [`crate::latency::GroupGrowth`] learns each apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Turn {
    First,
    Later,
}

impl Turn {
    /// The turn of a request that `continued` an earlier one of its group (or nothing).
    pub fn of(continued: Option<Turn>) -> Turn {
        if continued.is_some() {
            Turn::Later
        } else {
            Turn::First
        }
    }
}

/// An in-memory [`PrefixStore`]: one LRU set of block hashes per endpoint, each block with
/// whether (and which [`Turn`] of) a recorded request's full blocks ended there (see
/// [`PrefixStore::continues`]).
#[derive(Debug)]
pub struct PrefixIndex {
    /// Capacity of endpoints whose own capacity was never set.
    capacity: usize,
    endpoints: Vec<BlockLru>,
    /// Each endpoint's cache size as its server reports it, where the belief is the server's
    /// own events and so not bounded by it (see [`PrefixIndex::report_capacity`]).
    reported: Vec<Option<usize>>,
}

impl PrefixIndex {
    /// An empty index for `endpoints` endpoints, each holding at most `capacity_blocks`
    /// (at least one).
    pub fn new(endpoints: usize, capacity_blocks: usize) -> Self {
        let capacity = capacity_blocks.max(1);
        PrefixIndex {
            capacity,
            endpoints: (0..endpoints).map(|_| BlockLru::new(capacity)).collect(),
            reported: vec![None; endpoints],
        }
    }

    pub fn capacity_blocks(&self) -> usize {
        self.capacity
    }

    /// Blocks currently believed held by `endpoint` (recorded or stood for by a recorded one).
    pub fn len(&self, endpoint: usize) -> usize {
        self.endpoints.get(endpoint).map_or(0, BlockLru::blocks)
    }

    /// Believe that `endpoint` holds each of `hashes`, one by one, whatever their positions (a
    /// server's own report of the blocks it stored, `index: precise`); the first is the most
    /// recent.
    pub fn record_blocks(&mut self, endpoint: usize, hashes: &[u64]) {
        self.ensure_endpoints(endpoint + 1);
        let e = &mut self.endpoints[endpoint];
        for &hash in hashes.iter().rev() {
            e.touch(hash);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.endpoints.iter().all(BlockLru::is_empty)
    }

    pub fn contains(&self, endpoint: usize, hash: u64) -> bool {
        self.endpoints
            .get(endpoint)
            .is_some_and(|e| e.contains(hash))
    }

    /// `endpoint` no longer holds `hash` (its server reported the eviction).
    pub fn remove(&mut self, endpoint: usize, hash: u64) {
        if let Some(e) = self.endpoints.get_mut(endpoint) {
            e.remove(hash);
        }
    }

    /// Believed blocks of `endpoint`, most recently recorded first (for visualisations).
    pub fn blocks(&self, endpoint: usize) -> impl Iterator<Item = u64> + '_ {
        self.endpoints
            .get(endpoint)
            .into_iter()
            .flat_map(BlockLru::iter)
    }

    /// Grows the index when endpoints are added (new ones start empty).
    pub fn ensure_endpoints(&mut self, endpoints: usize) {
        while self.endpoints.len() < endpoints {
            self.endpoints.push(BlockLru::new(self.capacity));
        }
        self.reported.resize(self.endpoints.len(), None);
    }

    /// `endpoint`'s server caches `blocks`: its [`PrefixStore::room`] is measured against
    /// that, while what it holds is left as recorded. For a belief that follows the server's
    /// own KV events (`index: precise`), which are the truth: bounding it as
    /// [`PrefixStore::set_capacity`] does would evict blocks the server still holds (the
    /// router's own records of a request count them a second time until the events come), as
    /// the plugin keeps an event-confirmed block until its removal is reported. The room is
    /// what prices a new or growing group, so it still needs the real size.
    pub fn report_capacity(&mut self, endpoint: usize, blocks: usize) {
        self.ensure_endpoints(endpoint + 1);
        self.reported[endpoint] = Some(blocks.max(1));
    }
}

impl PrefixStore for PrefixIndex {
    fn longest_match(&self, endpoint: usize, chain: &[u64]) -> usize {
        let Some(e) = self.endpoints.get(endpoint) else {
            return 0;
        };
        believed_length(chain.len(), Search::Walk, |p| e.contains(chain[p]))
    }

    fn record_marked(&mut self, endpoint: usize, chain: &[u64], marks: &[usize]) {
        self.ensure_endpoints(endpoint + 1);
        // Recording in chain order leaves the *first* block most recently used last, so when the
        // set is full the tail of a long prompt goes before its head — the head is what other
        // requests share. Touch in reverse so the head is the most recent.
        // Where the request leaves what is believed here (see `record_positions`).
        let from = self.longest_match(endpoint, chain);
        let e = &mut self.endpoints[endpoint];
        let positions = record_positions(chain.len(), marks, from);
        let new = &positions[positions.partition_point(|&(p, _)| p < from)..];
        // The believed prefix is in use, all of it, whoever recorded its blocks (the server's
        // LRU sees the whole prompt): refreshed first, so the new blocks evict others, not it
        // (a server cannot evict blocks a running request reads); and again after, head last.
        let prefix = &chain[..from.min(chain.len())];
        for &hash in prefix {
            e.refresh(hash);
        }
        for &(p, weight) in new.iter().rev() {
            e.touch_weighted(chain[p], weight);
        }
        for &hash in prefix.iter().rev() {
            e.refresh(hash);
        }
    }

    fn mark_end(&mut self, endpoint: usize, chain: &[u64], turn: Turn) {
        if let (Some(e), Some(&hash)) = (self.endpoints.get_mut(endpoint), chain.last()) {
            e.mark_end(hash, turn);
        }
    }

    fn continues(&self, endpoint: usize, chain: &[u64], matched: usize) -> Option<Turn> {
        let e = self.endpoints.get(endpoint)?;
        let &hash = chain.get(matched.checked_sub(1)?)?;
        e.peek_end(hash).flatten()
    }

    fn forget_endpoint(&mut self, endpoint: usize) {
        if let Some(e) = self.endpoints.get_mut(endpoint) {
            e.clear();
        }
    }

    fn set_capacity(&mut self, endpoint: usize, blocks: usize) {
        self.ensure_endpoints(endpoint + 1);
        let e = &mut self.endpoints[endpoint];
        let capacity = blocks.max(1);
        if e.cap() != capacity {
            // Shrinking pops from the LRU end: the oldest records go first.
            e.resize(capacity);
        }
    }

    fn room(&self, endpoint: usize) -> CacheRoom {
        self.endpoints
            .get(endpoint)
            .map_or(CacheRoom::default(), |e| {
                let capacity = self.reported[endpoint].unwrap_or(e.cap());
                CacheRoom {
                    capacity_blocks: capacity,
                    believed_blocks: e.blocks().min(capacity),
                }
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_match_counts_leading_known_hashes_per_endpoint() {
        let mut index = PrefixIndex::new(2, 100);
        index.record(0, &[1, 2, 3]);
        index.record(1, &[1, 9]);
        assert_eq!(index.longest_match(0, &[1, 2, 3, 4]), 3);
        assert_eq!(index.longest_match(0, &[1, 2, 7, 8]), 2);
        assert_eq!(index.longest_match(1, &[1, 2, 3]), 1);
        assert_eq!(index.longest_match(0, &[5, 1, 2]), 0);
        assert_eq!(
            index.longest_match(7, &[1]),
            0,
            "unknown endpoint matches nothing"
        );
    }

    #[test]
    fn capacity_evicts_least_recently_recorded_tails_first() {
        let mut index = PrefixIndex::new(1, 4);
        index.record(0, &[1, 2, 3]);
        index.record(0, &[10, 11]);
        // 5 blocks into 4 slots: the oldest recording's tail (3) goes, its head stays.
        assert_eq!(index.len(0), 4);
        assert!(!index.contains(0, 3));
        assert_eq!(index.longest_match(0, &[1, 2, 3]), 2);
        assert_eq!(index.longest_match(0, &[10, 11]), 2);
    }

    #[test]
    fn forget_endpoint_clears_only_that_endpoint() {
        let mut index = PrefixIndex::new(2, 10);
        index.record(0, &[1]);
        index.record(1, &[1]);
        index.forget_endpoint(0);
        assert_eq!(index.longest_match(0, &[1]), 0);
        assert_eq!(index.longest_match(1, &[1]), 1);
    }

    #[test]
    fn capacity_bounds_one_endpoint_and_shrinking_drops_the_oldest() {
        let mut index = PrefixIndex::new(2, 100);
        index.record(0, &[1, 2, 3, 4]);
        index.record(0, &[9]);
        index.set_capacity(0, 3);
        assert_eq!(
            index.room(0),
            CacheRoom {
                capacity_blocks: 3,
                believed_blocks: 3,
            }
        );
        // The oldest recording's tail went first; the newest record and the old head stay.
        assert_eq!(index.longest_match(0, &[9]), 1);
        assert_eq!(index.longest_match(0, &[1, 2, 3, 4]), 2);
        assert_eq!(
            index.room(1).capacity_blocks,
            100,
            "other endpoints keep theirs"
        );
        index.set_capacity(0, 0);
        assert_eq!(index.room(0).capacity_blocks, 1, "at least one block");
        assert_eq!(index.room(7), CacheRoom::default());
    }

    #[test]
    fn a_match_that_ends_where_a_request_ended_continues_it_and_says_its_turn() {
        let mut index = PrefixIndex::new(1, 100);
        // Turn 1 of a conversation: system prompt 1, 2, then its own 3.
        index.record(0, &[1, 2, 3]);
        index.mark_end(0, &[1, 2, 3], Turn::First);
        // Turn 2 matches all of turn 1 and adds 4, 5: it continues a first turn.
        assert_eq!(index.continues(0, &[1, 2, 3, 4, 5], 3), Some(Turn::First));
        index.record(0, &[1, 2, 3, 4, 5]);
        index.mark_end(0, &[1, 2, 3, 4, 5], Turn::Later);
        // Turn 3 continues a later turn; turn 1's mark stays.
        assert_eq!(
            index.continues(0, &[1, 2, 3, 4, 5, 6], 5),
            Some(Turn::Later)
        );
        assert_eq!(index.continues(0, &[1, 2, 3, 7], 3), Some(Turn::First));
        // Another conversation shares only the system prompt: it does not.
        assert_eq!(index.continues(0, &[1, 2, 9], 2), None);
        assert_eq!(index.continues(0, &[1, 2, 9], 0), None);
        assert_eq!(index.continues(1, &[1, 2, 3], 3), None, "unknown endpoint");
        // A mark for a block not held is ignored.
        index.mark_end(0, &[77], Turn::Later);
        assert_eq!(index.continues(0, &[77], 1), None);
    }

    #[test]
    fn recorded_positions_cover_the_chain_and_are_bounded() {
        for n in (0..300).chain((300..3000).step_by(37)) {
            for from in [0, 7, 40, 130, 700] {
                let positions = record_positions(n, &[], from);
                let new = n - from.min(n);
                assert_eq!(positions.iter().map(|&(_, w)| w).sum::<usize>(), new);
                assert!(positions.iter().all(|&(p, w)| (p < from) == (w == 0)));
            }
            let positions = record_positions(n, &[], 0);
            assert_eq!(positions.iter().map(|&(_, w)| w).sum::<usize>(), n, "n={n}");
            assert!(positions.windows(2).all(|w| w[0].0 < w[1].0), "n={n}");
            assert_eq!(positions.last().map(|&(p, _)| p), n.checked_sub(1), "n={n}");
            // The checkpoints, the grid of the end's gap, the end.
            let end_gap = n
                .checked_sub(1)
                .map_or(0, |p| gap_blocks(p) / STRIDE_BLOCKS);
            assert!(positions.len() <= checkpoints(n) + end_gap + 1, "n={n}");
            // Each weight is the distance from the previous recorded position.
            let mut prev = None;
            for &(p, w) in &positions {
                assert_eq!(w, p - prev.map_or(0, |q: usize| q + 1) + 1, "n={n} p={p}");
                prev = Some(p);
            }
        }
        // Up to 260 blocks every grid point is a checkpoint: a fixed stride of 16.
        for n in 0..=260 {
            let fixed = DENSE_BLOCKS.min(n) + n.saturating_sub(DENSE_BLOCKS) / STRIDE_BLOCKS;
            assert_eq!(checkpoints(n), fixed, "n={n}");
        }
        // Beyond, the gaps double every 16 checkpoints: the count grows with the logarithm.
        assert_eq!(
            [2, 100, 259, 260, 300, 771, 772, 1000, 1795, 1796].map(gap_blocks),
            [1, 16, 32, 32, 32, 64, 64, 64, 128, 128]
        );
        assert_eq!(checkpoints(1024), 20 + 16 + 3);
        assert_eq!(checkpoints(8192), 20 + 16 * 4);
        assert!(checkpoints(1 << 20) < 200);
        // A cold 16k-token chain: 39 checkpoints (the last 963), the end's gap's grid (979,
        // 995, 1011) and the end.
        let cold = record_positions(1024, &[], 0);
        assert_eq!(cold.len(), 39 + 3 + 1);
        let tail: Vec<usize> = cold[cold.len() - 5..].iter().map(|&(p, _)| p).collect();
        assert_eq!(tail, [963, 979, 995, 1011, 1023]);
        assert_eq!(
            record_positions(40, &[], 0),
            [(0, 1), (1, 1), (2, 1), (3, 1), (19, 16), (35, 16), (39, 4)]
        );
        // A mark adds the last block before its boundary and splits the weights around it.
        assert_eq!(
            record_positions(40, &[21, 40, 99, 0], 0)[4..],
            [(19, 16), (20, 1), (35, 15), (39, 4)]
        );
        // ...and, in a wider gap, the grid up to it: a message beginning at block 1,000 of a
        // 2,000-block chain records 979 and 995 (between checkpoints 963 and 1027), then 999.
        let marked = record_positions(2000, &[1000], 0);
        let at = |p: usize| marked.iter().any(|&(q, _)| q == p);
        assert!(at(963) && at(979) && at(995) && at(999) && at(1027));
        assert!(!at(1011) && !at(1043));
        // Leaving a believed match at 50: the 16 blocks from there are recorded densely.
        let left = record_positions(100, &[], 50);
        assert!((50..66).all(|p| left.iter().any(|&(q, w)| q == p && w == 1)));
        // Back to grid point 47, refreshed only.
        assert!(left.iter().any(|&(q, w)| q == 48 && w == 0));
        assert!(!left.iter().any(|&(q, _)| q == 66));
        assert_eq!(left.iter().map(|&(_, w)| w).sum::<usize>(), 50);
        // Leaving it at 900 (between checkpoints 899 and 963): the grid to 963 as well.
        let deep = record_positions(2000, &[], 900);
        assert!([915, 931, 947]
            .iter()
            .all(|&p| deep.iter().any(|&(q, _)| q == p)));
        // A chain believed whole (an exact repeat) records its positions again, counting none.
        assert_eq!(
            record_positions(10, &[], 50),
            [(0, 0), (1, 0), (2, 0), (3, 0), (9, 0)]
        );
    }

    proptest::proptest! {
        /// The belief holds a recorded chain of `len` blocks; a request shares its first
        /// `shared` blocks (and may be longer). Its believed match is the furthest recorded
        /// shared position, found by the search with few probes, and falls short of the true
        /// shared prefix by less than the gap between the checkpoints there, not at all within
        /// the dense head, when the request extends the recorded chain or when the shared
        /// prefix ends at one of its message boundaries.
        #[test]
        fn the_believed_match_is_the_furthest_recorded_shared_block(
            len in 1usize..3000,
            shared in 0usize..3000,
            extra in 0usize..40,
            mark in 0usize..3000,
        ) {
            let shared = shared.min(len);
            let n = shared + extra;
            let recorded: std::collections::BTreeSet<usize> =
                record_positions(len, &[mark], 0).iter().map(|&(p, _)| p).collect();
            let holds = |p: usize| p < shared && recorded.contains(&p);
            let mut probes = 0;
            let (found, probed) = believed_match(n, Search::Binary, |p| { probes += 1; holds(p) });
            let (walked, _) = believed_match(n, Search::Walk, holds);
            proptest::prop_assert_eq!(walked, found, "prefix-closed: both searches agree");
            let expected = (0..shared).rev().find(|&p| recorded.contains(&p)).map_or(0, |p| p + 1);
            proptest::prop_assert_eq!(found, expected);
            proptest::prop_assert!(found <= shared);
            if shared > 0 {
                proptest::prop_assert!(shared - found < gap_blocks(shared - 1));
            }
            if shared <= DENSE_BLOCKS || shared == len || shared == mark {
                proptest::prop_assert_eq!(found, shared);
            }
            proptest::prop_assert!(probed.iter().all(|&p| holds(p)));
            // Binary searches over ≤ 62 checkpoints (first, last, 6), the chain's last block,
            // ≤ 8 grid points (last, first, 3), then one stride.
            proptest::prop_assert!(probes <= 8 + 1 + 5 + STRIDE_BLOCKS, "{} probes", probes);
        }

        /// A prefix shared inside a message, deep in a long chain, is found short once: the
        /// request that fell short records its gap's grid and the blocks after its match, so
        /// the next request sharing as much is believed to within a stride of it.
        #[test]
        fn a_prefix_found_short_is_found_within_a_stride_the_next_time(
            len in 1usize..3000,
            shared in 0usize..3000,
            own in 1usize..40,
        ) {
            let shared = shared.min(len);
            let first: std::collections::BTreeSet<usize> =
                record_positions(len, &[], 0).iter().map(|&(p, _)| p).collect();
            let (short, _) =
                believed_match(shared + own, Search::Binary, |p| p < shared && first.contains(&p));
            // What the short request writes: the positions from its match on (before it, the
            // store only refreshes what it holds).
            let second: std::collections::BTreeSet<usize> = record_positions(shared + own, &[], short)
                .iter()
                .filter(|&&(p, _)| p >= short)
                .map(|&(p, _)| p)
                .collect();
            let holds = |p: usize| p < shared && (first.contains(&p) || second.contains(&p));
            let (found, _) = believed_match(shared + own, Search::Binary, holds);
            let (walked, _) = believed_match(shared + own, Search::Walk, holds);
            proptest::prop_assert_eq!(walked, found);
            proptest::prop_assert!(found <= shared && shared - found < STRIDE_BLOCKS,
                "shared {} found {} (short {})", shared, found, short);
        }
    }

    #[test]
    fn the_capacity_counts_the_blocks_a_recorded_block_stands_for() {
        let mut index = PrefixIndex::new(1, 100);
        let chain: Vec<u64> = (1..=64).collect();
        index.record(0, &chain);
        // 4 dense blocks, checkpoints 19, 35 and 51 (16 each), the end 63 (12).
        assert_eq!(index.blocks(0).count(), 8);
        assert_eq!(index.len(0), 64);
        assert_eq!(index.room(0).believed_blocks, 64);
        // A second chain of 64 blocks does not fit beside it: the first one's tail goes.
        let other: Vec<u64> = (1001..=1064).collect();
        index.record(0, &other);
        assert!(index.len(0) <= 100);
        assert_eq!(index.longest_match(0, &other), 64);
        assert!(index.longest_match(0, &chain) < 64);
    }

    #[test]
    fn a_reported_capacity_bounds_the_room_not_what_the_server_is_believed_to_hold() {
        let mut index = PrefixIndex::new(2, 1000);
        let events: Vec<u64> = (1..=30).collect();
        index.record_blocks(0, &events);
        index.report_capacity(0, 20);
        // The server said it stored 30 blocks: all are believed, none dropped.
        assert!(events.iter().all(|&h| index.contains(0, h)));
        assert_eq!(index.longest_match(0, &events), 30);
        // Its room is measured against what it reports: full.
        let room = index.room(0);
        assert_eq!((room.capacity_blocks, room.believed_blocks), (20, 20));
        // Bounding it instead drops the oldest blocks.
        index.set_capacity(1, 20);
        index.record_blocks(1, &events);
        assert_eq!(index.len(1), 20);
        assert_eq!(index.room(1).capacity_blocks, 20);
    }

    #[test]
    fn record_grows_for_new_endpoints() {
        let mut index = PrefixIndex::new(0, 10);
        index.record(3, &[5]);
        assert_eq!(index.longest_match(3, &[5]), 1);
        assert!(!index.is_empty());
    }
}
