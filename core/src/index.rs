//! The approximate prefix index: which blocks the router believes each endpoint holds.
//!
//! It learns only from the router's own decisions (pick → forward → commit), so it is a belief,
//! not a fact: a server may have evicted a block the index still lists. Each endpoint's set is
//! bounded and evicts least-recently-recorded blocks first, which roughly tracks what an LRU
//! server cache of the same size keeps.

mod blocks;

use crate::latency::CacheRoom;
use blocks::BlockLru;

/// llm-d's default capacity per endpoint, in blocks.
pub const DEFAULT_CAPACITY_BLOCKS: usize = 31_250;

/// Where the router's belief lives: in process memory ([`PrefixIndex`]) for the CLI and the
/// browser, in proxy-wasm shared data for the plugin.
pub trait PrefixStore {
    /// How many leading hashes of `chain` `endpoint` is believed to hold.
    fn longest_match(&self, endpoint: usize, chain: &[u64]) -> usize;

    /// Believe that `endpoint` now holds every block of `chain`.
    fn record(&mut self, endpoint: usize, chain: &[u64]);

    /// Drop everything believed about `endpoint` (it restarted or left the pool).
    fn forget_endpoint(&mut self, endpoint: usize);

    /// Bounds what `endpoint` is believed to hold by its real cache (`blocks` of the router's
    /// block size, at least one): a server that holds 128 blocks cannot hold 31,250, and a
    /// belief that thinks it does never sees the cache fill up. Shrinking drops the least
    /// recently recorded blocks first, as the server would have evicted them.
    fn set_capacity(&mut self, endpoint: usize, blocks: usize);

    /// `endpoint`'s believed cache: its capacity and how many blocks it is believed to hold.
    fn room(&self, endpoint: usize) -> CacheRoom;

    /// Remembers that a request's full blocks ended at `hash` on `endpoint`.
    fn mark_end(&mut self, endpoint: usize, hash: u64);

    /// Whether a request whose believed match on `endpoint` is `chain[..matched]` continues an
    /// earlier request there: its match ends exactly where that request's full blocks ended,
    /// as the next turn of a conversation does. A request that shares only a head with others
    /// (a system prompt, a document) and adds its own tail does not.
    fn continues(&self, endpoint: usize, chain: &[u64], matched: usize) -> bool;
}

/// An in-memory [`PrefixStore`]: one LRU set of block hashes per endpoint, each block with
/// whether a recorded request's full blocks ended there (see [`PrefixStore::continues`]).
#[derive(Debug)]
pub struct PrefixIndex {
    /// Capacity of endpoints whose own capacity was never set.
    capacity: usize,
    endpoints: Vec<BlockLru>,
}

impl PrefixIndex {
    /// An empty index for `endpoints` endpoints, each holding at most `capacity_blocks`
    /// (at least one).
    pub fn new(endpoints: usize, capacity_blocks: usize) -> Self {
        let capacity = capacity_blocks.max(1);
        PrefixIndex {
            capacity,
            endpoints: (0..endpoints).map(|_| BlockLru::new(capacity)).collect(),
        }
    }

    pub fn capacity_blocks(&self) -> usize {
        self.capacity
    }

    /// Blocks currently believed held by `endpoint`.
    pub fn len(&self, endpoint: usize) -> usize {
        self.endpoints.get(endpoint).map_or(0, BlockLru::len)
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
    }
}

impl PrefixStore for PrefixIndex {
    fn longest_match(&self, endpoint: usize, chain: &[u64]) -> usize {
        let Some(e) = self.endpoints.get(endpoint) else {
            return 0;
        };
        chain.iter().take_while(|&&h| e.contains(h)).count()
    }

    fn record(&mut self, endpoint: usize, chain: &[u64]) {
        self.ensure_endpoints(endpoint + 1);
        let e = &mut self.endpoints[endpoint];
        // Recording in chain order leaves the *first* block most recently used last, so when the
        // set is full the tail of a long prompt goes before its head — the head is what other
        // requests share. Touch in reverse so the head is the most recent.
        for &hash in chain.iter().rev() {
            e.touch(hash);
        }
    }

    fn mark_end(&mut self, endpoint: usize, hash: u64) {
        if let Some(e) = self.endpoints.get_mut(endpoint) {
            e.mark_end(hash);
        }
    }

    fn continues(&self, endpoint: usize, chain: &[u64], matched: usize) -> bool {
        let (Some(e), Some(last)) = (self.endpoints.get(endpoint), matched.checked_sub(1)) else {
            return false;
        };
        chain
            .get(last)
            .is_some_and(|&hash| e.peek_end(hash) == Some(true))
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
            .map_or(CacheRoom::default(), |e| CacheRoom {
                capacity_blocks: e.cap(),
                believed_blocks: e.len(),
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
        assert_eq!(index.longest_match(0, &[1, 2, 7, 3]), 2);
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
    fn a_match_that_ends_where_a_request_ended_continues_it() {
        let mut index = PrefixIndex::new(1, 100);
        // Turn 1 of a conversation: system prompt 1, 2, then its own 3.
        index.record(0, &[1, 2, 3]);
        index.mark_end(0, 3);
        // Turn 2 matches all of turn 1 and adds 4, 5: it continues.
        assert!(index.continues(0, &[1, 2, 3, 4, 5], 3));
        // Another conversation shares only the system prompt: it does not.
        assert!(!index.continues(0, &[1, 2, 9], 2));
        assert!(!index.continues(0, &[1, 2, 9], 0));
        assert!(!index.continues(1, &[1, 2, 3], 3), "unknown endpoint");
        // A mark for a block not held is ignored.
        index.mark_end(0, 77);
        assert!(!index.continues(0, &[77], 1));
    }

    #[test]
    fn record_grows_for_new_endpoints() {
        let mut index = PrefixIndex::new(0, 10);
        index.record(3, &[5]);
        assert_eq!(index.longest_match(3, &[5]), 1);
        assert!(!index.is_empty());
    }
}
