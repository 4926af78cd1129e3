//! One endpoint's believed blocks: an LRU set of block hashes, each with an end mark (and the
//! [`Turn`] of the request that ended there) and the number of blocks it stands for (see
//! [`super::record_positions`]), in about 22 bytes per entry.
//!
//! A general LRU map (`lru::LruCache<u64, bool>`) spends ~68 bytes per entry: a heap node per
//! entry with two pointers, plus a hash table of pointers. Here every block is one 16-byte node
//! in a vector (its hash and two 4-byte list links), the end marks are two bits each, and the hash
//! table is open addressing over 4-byte node numbers, kept at most 7/8 full (linear probing,
//! deletion by backward shift, so no tombstones). The keys are block hashes (xxh64), spread by
//! one multiply before they pick a home slot so that small test keys spread too.

use super::Turn;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Node {
    hash: u64,
    /// Towards the most recently used end.
    prev: u32,
    /// Towards the least recently used end.
    next: u32,
}

#[derive(Debug, Clone)]
pub(crate) struct BlockLru {
    nodes: Vec<Node>,
    /// One bit per node: a recorded request's full blocks ended at that block.
    ends: Vec<u64>,
    /// One bit per node, set with its end bit: that request was a [`Turn::Later`].
    later: Vec<u64>,
    /// Per node, the blocks it stands for (0 to 255): the capacity counts blocks, not nodes.
    weights: Vec<u8>,
    /// Sum of `weights`.
    blocks: usize,
    /// Node numbers by home slot; `NIL` = empty.
    slots: Vec<u32>,
    /// Most and least recently used nodes.
    head: u32,
    tail: u32,
    capacity: usize,
}

/// Table size for `capacity` entries at 7/8 load.
fn table_for(entries: usize) -> usize {
    (entries.saturating_mul(8) / 7 + 1).max(8)
}

impl BlockLru {
    pub(crate) fn new(capacity: usize) -> Self {
        BlockLru {
            nodes: Vec::new(),
            ends: Vec::new(),
            later: Vec::new(),
            weights: Vec::new(),
            blocks: 0,
            slots: vec![NIL; table_for(capacity.clamp(1, 64))],
            head: NIL,
            tail: NIL,
            // Node numbers are u32 with NIL reserved.
            capacity: capacity.clamp(1, NIL as usize - 1),
        }
    }

    /// Entries (recorded blocks).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Blocks the entries stand for (what the capacity bounds).
    pub(crate) fn blocks(&self) -> usize {
        self.blocks
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    pub(crate) fn cap(&self) -> usize {
        self.capacity
    }

    /// Entries of weight 0 count no blocks, so entries may outnumber the capacity; this bounds
    /// them (and the table) all the same.
    fn max_entries(&self) -> usize {
        self.capacity.saturating_mul(2)
    }

    fn home(&self, hash: u64) -> usize {
        let mixed = hash.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        ((u128::from(mixed) * self.slots.len() as u128) >> 64) as usize
    }

    /// The table slot holding `hash`, if present.
    fn slot_of(&self, hash: u64) -> Option<usize> {
        let n = self.slots.len();
        let mut i = self.home(hash);
        loop {
            let node = self.slots[i];
            if node == NIL {
                return None;
            }
            if self.nodes[node as usize].hash == hash {
                return Some(i);
            }
            i = if i + 1 == n { 0 } else { i + 1 };
        }
    }

    fn find(&self, hash: u64) -> Option<usize> {
        self.slot_of(hash).map(|slot| self.slots[slot] as usize)
    }

    fn place(&mut self, node: u32) {
        let n = self.slots.len();
        let mut i = self.home(self.nodes[node as usize].hash);
        while self.slots[i] != NIL {
            i = if i + 1 == n { 0 } else { i + 1 };
        }
        self.slots[i] = node;
    }

    /// Empties `slot` and shifts later entries of its probe run back, so that every entry
    /// stays reachable from its home slot without tombstones.
    fn vacate(&mut self, mut slot: usize) {
        let n = self.slots.len();
        self.slots[slot] = NIL;
        let mut j = slot;
        loop {
            j = if j + 1 == n { 0 } else { j + 1 };
            let node = self.slots[j];
            if node == NIL {
                return;
            }
            let home = self.home(self.nodes[node as usize].hash);
            // The entry at `j` may move to `slot` unless its home lies cyclically in (slot, j].
            let stays = if slot <= j {
                slot < home && home <= j
            } else {
                slot < home || home <= j
            };
            if !stays {
                self.slots[slot] = node;
                self.slots[j] = NIL;
                slot = j;
            }
        }
    }

    fn unlink(&mut self, node: usize) {
        let Node { prev, next, .. } = self.nodes[node];
        match prev {
            NIL => self.head = next,
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.nodes[n as usize].prev = prev,
        }
    }

    fn push_front(&mut self, node: usize) {
        self.nodes[node].prev = NIL;
        self.nodes[node].next = self.head;
        match self.head {
            NIL => self.tail = node as u32,
            h => self.nodes[h as usize].prev = node as u32,
        }
        self.head = node as u32;
    }

    fn end(&self, node: usize) -> Option<Turn> {
        let bit = |words: &[u64]| words[node / 64] >> (node % 64) & 1 == 1;
        bit(&self.ends).then(|| {
            if bit(&self.later) {
                Turn::Later
            } else {
                Turn::First
            }
        })
    }

    fn set_end(&mut self, node: usize, end: Option<Turn>) {
        let bit = 1u64 << (node % 64);
        let set = |words: &mut [u64], on: bool| {
            if on {
                words[node / 64] |= bit;
            } else {
                words[node / 64] &= !bit;
            }
        };
        set(&mut self.ends, end.is_some());
        set(&mut self.later, end == Some(Turn::Later));
    }

    fn grow_table(&mut self) {
        let size = (self.slots.len() * 2).min(table_for(self.max_entries()));
        self.slots = vec![NIL; size];
        for node in 0..self.nodes.len() as u32 {
            self.place(node);
        }
    }

    /// Makes `hash` the most recently used block, inserting it (end mark cleared) and
    /// evicting least recently used blocks while the entries stand for more than the
    /// capacity (never the one just touched).
    pub(crate) fn touch(&mut self, hash: u64) {
        self.touch_weighted(hash, 1);
    }

    /// Makes `hash` the most recently used block if held, keeping its weight.
    pub(crate) fn refresh(&mut self, hash: u64) {
        if let Some(node) = self.find(hash) {
            self.unlink(node);
            self.push_front(node);
        }
    }

    /// [`Self::touch`] for an entry that stands for `weight` blocks (at most 255; 0 for a block
    /// whose blocks another entry counts).
    pub(crate) fn touch_weighted(&mut self, hash: u64, weight: usize) {
        let weight = weight.min(u8::MAX as usize) as u8;
        if let Some(node) = self.find(hash) {
            self.unlink(node);
            self.push_front(node);
            self.blocks = self.blocks - usize::from(self.weights[node]) + usize::from(weight);
            self.weights[node] = weight;
        } else {
            if (self.nodes.len() + 1) * 8 > self.slots.len() * 7 {
                self.grow_table();
            }
            self.nodes.push(Node {
                hash,
                prev: NIL,
                next: NIL,
            });
            self.weights.push(weight);
            self.blocks += usize::from(weight);
            if self.nodes.len() > self.ends.len() * 64 {
                self.ends.push(0);
                self.later.push(0);
            }
            let node = self.nodes.len() - 1;
            self.set_end(node, None);
            self.place(node as u32);
            self.push_front(node);
        }
        while (self.blocks > self.capacity || self.nodes.len() > self.max_entries())
            && self.tail != self.head
        {
            let victim = self.nodes[self.tail as usize].hash;
            self.remove(victim);
        }
    }

    pub(crate) fn contains(&self, hash: u64) -> bool {
        self.slot_of(hash).is_some()
    }

    /// The end mark of `hash`, without making it more recent; `None` when not held.
    pub(crate) fn peek_end(&self, hash: u64) -> Option<Option<Turn>> {
        self.find(hash).map(|node| self.end(node))
    }

    /// Marks that a `turn` request's full blocks ended at `hash`, if held, without making it
    /// more recent.
    pub(crate) fn mark_end(&mut self, hash: u64, turn: Turn) {
        if let Some(node) = self.find(hash) {
            self.set_end(node, Some(turn));
        }
    }

    /// Drops `hash` (the server evicted it). The last node moves into its place, so the
    /// nodes stay dense.
    pub(crate) fn remove(&mut self, hash: u64) {
        let Some(slot) = self.slot_of(hash) else {
            return;
        };
        let node = self.slots[slot] as usize;
        self.vacate(slot);
        self.unlink(node);
        self.blocks -= usize::from(self.weights[node]);
        let last = self.nodes.len() - 1;
        if node != last {
            // Re-point everything that names `last` at `node`.
            let moved = self.nodes[last];
            let end = self.end(last);
            if let Some(s) = self.slot_of(moved.hash) {
                self.slots[s] = node as u32;
            }
            self.nodes[node] = moved;
            self.weights[node] = self.weights[last];
            match moved.prev {
                NIL => self.head = node as u32,
                p => self.nodes[p as usize].next = node as u32,
            }
            match moved.next {
                NIL => self.tail = node as u32,
                n => self.nodes[n as usize].prev = node as u32,
            }
            self.set_end(node, end);
        }
        self.set_end(last, None);
        self.nodes.pop();
        self.weights.pop();
    }

    pub(crate) fn clear(&mut self) {
        *self = BlockLru::new(self.capacity);
    }

    /// Block hashes, most recently used first.
    pub(crate) fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        let mut node = self.head;
        std::iter::from_fn(move || {
            if node == NIL {
                return None;
            }
            let n = self.nodes[node as usize];
            node = n.next;
            Some(n.hash)
        })
    }

    /// Changes the capacity; shrinking keeps the most recently used blocks (and their marks).
    pub(crate) fn resize(&mut self, capacity: usize) {
        let capacity = capacity.clamp(1, NIL as usize - 1);
        if capacity >= self.blocks {
            self.capacity = capacity;
            return;
        }
        let kept: Vec<(u64, Option<Turn>, u8)> = {
            let mut out = Vec::new();
            let (mut node, mut blocks) = (self.head, 0);
            while node != NIL {
                let n = node as usize;
                blocks += usize::from(self.weights[n]);
                if blocks > capacity && !out.is_empty() {
                    break;
                }
                out.push((self.nodes[n].hash, self.end(n), self.weights[n]));
                node = self.nodes[n].next;
            }
            out
        };
        *self = BlockLru::new(capacity);
        // Oldest first, so the most recent ends at the front again.
        for &(hash, end, weight) in kept.iter().rev() {
            self.touch_weighted(hash, usize::from(weight));
            if let Some(turn) = end {
                self.mark_end(hash, turn);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    /// The obvious weighted LRU: a deque of (hash, end, weight), most recent first.
    #[derive(Default)]
    struct Model {
        order: VecDeque<(u64, Option<Turn>, usize)>,
        capacity: usize,
    }

    impl Model {
        fn blocks(&self) -> usize {
            self.order.iter().map(|e| e.2).sum()
        }

        fn touch(&mut self, hash: u64, weight: usize) {
            let end = match self.order.iter().position(|e| e.0 == hash) {
                Some(pos) => self.order.remove(pos).unwrap().1,
                None => None,
            };
            self.order.push_front((hash, end, weight));
            while (self.blocks() > self.capacity || self.order.len() > 2 * self.capacity)
                && self.order.len() > 1
            {
                self.order.pop_back();
            }
        }

        fn shrink(&mut self, capacity: usize) {
            self.capacity = capacity;
            let mut blocks = 0;
            let keep = self
                .order
                .iter()
                .take_while(|e| {
                    blocks += e.2;
                    blocks <= capacity
                })
                .count()
                .min(2 * capacity)
                .max(1);
            self.order.truncate(keep);
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Touch(u64, usize),
        Mark(u64, Turn),
        Remove(u64),
        Resize(usize),
        Clear,
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few distinct keys, so that hits, evictions and probe-run collisions all happen.
        prop_oneof![
            6 => (0u64..40).prop_map(|h| Op::Touch(h, 1)),
            2 => (0u64..40, 0usize..6).prop_map(|(h, w)| Op::Touch(h, w)),
            2 => (0u64..40, any::<bool>())
                .prop_map(|(h, later)| Op::Mark(h, if later { Turn::Later } else { Turn::First })),
            3 => (0u64..40).prop_map(Op::Remove),
            1 => (1usize..20).prop_map(Op::Resize),
            1 => Just(Op::Clear),
        ]
    }

    proptest! {
        #[test]
        fn behaves_like_the_obvious_lru(capacity in 1usize..20, ops in proptest::collection::vec(op(), 0..300)) {
            let mut lru = BlockLru::new(capacity);
            let mut model = Model { capacity, ..Model::default() };
            for op in ops {
                match op {
                    Op::Touch(h, w) => { lru.touch_weighted(h, w); model.touch(h, w); }
                    Op::Mark(h, turn) => {
                        lru.mark_end(h, turn);
                        if let Some(e) = model.order.iter_mut().find(|e| e.0 == h) { e.1 = Some(turn); }
                    }
                    Op::Resize(c) => {
                        lru.resize(c);
                        if c < model.blocks() { model.shrink(c) } else { model.capacity = c; }
                    }
                    Op::Remove(h) => {
                        lru.remove(h);
                        model.order.retain(|e| e.0 != h);
                    }
                    Op::Clear => { lru.clear(); model.order.clear(); }
                }
                prop_assert_eq!(lru.len(), model.order.len());
                prop_assert_eq!(lru.blocks(), model.blocks());
                prop_assert_eq!(lru.cap(), model.capacity);
                let order: Vec<u64> = lru.iter().collect();
                let expected: Vec<u64> = model.order.iter().map(|e| e.0).collect();
                prop_assert_eq!(order, expected);
                for k in 0u64..40 {
                    let expected = model.order.iter().find(|e| e.0 == k).map(|e| e.1);
                    prop_assert_eq!(lru.peek_end(k), expected);
                    prop_assert_eq!(lru.contains(k), expected.is_some());
                }
            }
        }
    }

    #[test]
    fn large_tables_keep_every_key_reachable_through_evictions() {
        let mut lru = BlockLru::new(1000);
        for k in 0..5000u64 {
            lru.touch(k.wrapping_mul(0x2545_f491_4f6c_dd1d));
        }
        assert_eq!(lru.len(), 1000);
        for k in 4000..5000u64 {
            assert!(lru.contains(k.wrapping_mul(0x2545_f491_4f6c_dd1d)), "{k}");
        }
        for k in 0..4000u64 {
            assert!(!lru.contains(k.wrapping_mul(0x2545_f491_4f6c_dd1d)), "{k}");
        }
    }
}
