//! The approximate prefix index: which blocks the router believes each endpoint holds.
//!
//! It learns only from the router's own decisions (pick → forward → commit), so it is a belief,
//! not a fact: a server may have evicted a block the index still lists. Each endpoint's set is
//! bounded and evicts least-recently-recorded blocks first, which roughly tracks what an LRU
//! server cache of the same size keeps.

use std::num::NonZeroUsize;

use lru::LruCache;

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
}

/// An in-memory [`PrefixStore`]: one LRU set of block hashes per endpoint.
#[derive(Debug)]
pub struct PrefixIndex {
    capacity: NonZeroUsize,
    endpoints: Vec<LruCache<u64, ()>>,
}

impl PrefixIndex {
    /// An empty index for `endpoints` endpoints, each holding at most `capacity_blocks`
    /// (at least one).
    pub fn new(endpoints: usize, capacity_blocks: usize) -> Self {
        let capacity = NonZeroUsize::new(capacity_blocks.max(1)).unwrap_or(NonZeroUsize::MIN);
        PrefixIndex {
            capacity,
            endpoints: (0..endpoints).map(|_| LruCache::new(capacity)).collect(),
        }
    }

    pub fn capacity_blocks(&self) -> usize {
        self.capacity.get()
    }

    /// Blocks currently believed held by `endpoint`.
    pub fn len(&self, endpoint: usize) -> usize {
        self.endpoints.get(endpoint).map_or(0, LruCache::len)
    }

    pub fn is_empty(&self) -> bool {
        self.endpoints.iter().all(LruCache::is_empty)
    }

    pub fn contains(&self, endpoint: usize, hash: u64) -> bool {
        self.endpoints
            .get(endpoint)
            .is_some_and(|set| set.contains(&hash))
    }

    /// Grows the index when endpoints are added (new ones start empty).
    pub fn ensure_endpoints(&mut self, endpoints: usize) {
        while self.endpoints.len() < endpoints {
            self.endpoints.push(LruCache::new(self.capacity));
        }
    }
}

impl PrefixStore for PrefixIndex {
    fn longest_match(&self, endpoint: usize, chain: &[u64]) -> usize {
        let Some(set) = self.endpoints.get(endpoint) else {
            return 0;
        };
        chain.iter().take_while(|h| set.contains(h)).count()
    }

    fn record(&mut self, endpoint: usize, chain: &[u64]) {
        self.ensure_endpoints(endpoint + 1);
        let set = &mut self.endpoints[endpoint];
        // Recording in chain order leaves the *first* block most recently used last, so when the
        // set is full the tail of a long prompt goes before its head — the head is what other
        // requests share. Touch in reverse so the head is the most recent.
        for &hash in chain.iter().rev() {
            set.put(hash, ());
        }
    }

    fn forget_endpoint(&mut self, endpoint: usize) {
        if let Some(set) = self.endpoints.get_mut(endpoint) {
            set.clear();
        }
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
    fn record_grows_for_new_endpoints() {
        let mut index = PrefixIndex::new(0, 10);
        index.record(3, &[5]);
        assert_eq!(index.longest_match(3, &[5]), 1);
        assert!(!index.is_empty());
    }
}
