//! What each server really holds, in the router's own block hashes.
//!
//! A server names blocks by its engine's hash; the router by core's chained hash of the
//! block's token ids. A `BlockStored` event carries the token ids and the parent's engine hash,
//! so [`ServerTruth`] keeps llm-d's *dual-key* map: engine hash → router hash. A stored block's
//! router hash is `block_hash(its tokens, the parent's router hash)`, or from
//! `chain_seed(model, "")` for a block without a parent (a request with a `cache_salt` starts
//! elsewhere: its blocks are mapped only when their parent is known).
//!
//! Sequence numbers are consecutive per publisher. A gap means lost events, so the belief is
//! no longer the truth: the server is treated as cleared (`AllBlocksCleared`) and rebuilt from
//! the events that follow; the router's approximate belief covers it meanwhile. Memory is bounded
//! by the server's real capacity: more held blocks than `capacity_blocks` means events were
//! missed (a removal), and the oldest are dropped and counted.

use hashbrown::HashMap;
use std::collections::VecDeque;

use prefixroute_core::feed::StoredRun;
use prefixroute_core::hashing::{block_hash, chain_seed};

use crate::schema::{EngineHash, Event, Message};

/// A change to one server's truth, in router hashes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Stored(u64),
    /// The blocks one `BlockStored` event stored (after its `Stored` changes), when any was
    /// new: where a request ended, for the gateways' end marks.
    Run(StoredRun),
    Removed(u64),
    /// Everything it held is gone (AllBlocksCleared, a sequence gap, a restart).
    Cleared,
}

/// Counts of what could not be used, for stats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub messages: u64,
    pub stored: u64,
    pub removed: u64,
    /// Sequence gaps (and restarts: the sequence went back), each a resync.
    pub gaps: u64,
    /// Stored blocks whose parent the map does not know (missed events, or a salted chain).
    pub orphans: u64,
    /// Events in another block size than the router's: their hashes cannot match the router's.
    pub foreign_block_size: u64,
    /// Blocks dropped because the server seemed to hold more than its capacity.
    pub over_capacity: u64,
    /// Events of a LoRA adapter or another medium than the GPU: not the base model's cache.
    pub skipped: u64,
}

/// One server's blocks, as its events say.
#[derive(Debug, Clone)]
pub struct ServerTruth {
    seed: u64,
    block_size: usize,
    capacity_blocks: usize,
    last_seq: Option<u64>,
    /// engine hash → router hash, for every block held.
    router_of: HashMap<EngineHash, u64>,
    /// Held blocks in the order they were stored (oldest first), for the capacity bound;
    /// entries of removed blocks are skipped lazily.
    order: VecDeque<EngineHash>,
    pub counts: Counts,
}

impl ServerTruth {
    /// A server of `model`, hashing the router's way with `block_size`, holding at most
    /// `capacity_blocks`.
    pub fn new(model: &str, block_size: usize, capacity_blocks: usize) -> Self {
        ServerTruth {
            seed: chain_seed(model, ""),
            block_size: block_size.max(1),
            capacity_blocks: capacity_blocks.max(1),
            last_seq: None,
            router_of: HashMap::new(),
            order: VecDeque::new(),
            counts: Counts::default(),
        }
    }

    /// Router hashes of the blocks held now.
    pub fn blocks(&self) -> impl Iterator<Item = u64> + '_ {
        self.router_of.values().copied()
    }

    pub fn len(&self) -> usize {
        self.router_of.len()
    }

    pub fn is_empty(&self) -> bool {
        self.router_of.is_empty()
    }

    pub fn holds(&self, router_hash: u64) -> bool {
        self.router_of.values().any(|&h| h == router_hash)
    }

    /// The publisher went away or restarted: nothing it said is known to hold any more.
    pub fn reset(&mut self, changes: &mut Vec<Change>) {
        self.router_of.clear();
        self.order.clear();
        self.last_seq = None;
        changes.push(Change::Cleared);
    }

    /// Applies one message; the changes go to `changes`.
    pub fn apply(&mut self, message: &Message, changes: &mut Vec<Change>) {
        self.counts.messages += 1;
        let consecutive = match self.last_seq {
            None => true,
            Some(last) => message.seq == last.wrapping_add(1),
        };
        if !consecutive {
            // Lost (or replayed) events: what we hold may be wrong both ways.
            self.counts.gaps += 1;
            self.router_of.clear();
            self.order.clear();
            changes.push(Change::Cleared);
        }
        self.last_seq = Some(message.seq);
        for event in &message.batch.events {
            self.apply_event(event, changes);
        }
    }

    fn apply_event(&mut self, event: &Event, changes: &mut Vec<Change>) {
        match event {
            Event::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
            } => {
                if lora_id.is_some() || medium.as_deref().is_some_and(|m| m != "GPU") {
                    self.counts.skipped += 1;
                    return;
                }
                if *block_size as usize != self.block_size {
                    self.counts.foreign_block_size += 1;
                    return;
                }
                let mut parent = match parent_block_hash {
                    None => self.seed,
                    Some(p) => match self.router_of.get(p) {
                        Some(&h) => h,
                        None => {
                            self.counts.orphans += 1;
                            return;
                        }
                    },
                };
                let mut run = StoredRun {
                    parent: parent_block_hash.map(|_| parent),
                    ..StoredRun::default()
                };
                let mut new = false;
                for (engine, tokens) in block_hashes.iter().zip(token_ids.chunks(self.block_size)) {
                    parent = block_hash(tokens, parent);
                    run.end = parent;
                    run.blocks += 1;
                    if self.router_of.insert(*engine, parent).is_none() {
                        self.order.push_back(*engine);
                        self.counts.stored += 1;
                        changes.push(Change::Stored(parent));
                        new = true;
                    }
                }
                if new {
                    changes.push(Change::Run(run));
                }
                self.bound(changes);
            }
            Event::BlockRemoved {
                block_hashes,
                medium,
            } => {
                if medium.as_deref().is_some_and(|m| m != "GPU") {
                    self.counts.skipped += 1;
                    return;
                }
                for engine in block_hashes {
                    if let Some(h) = self.router_of.remove(engine) {
                        self.counts.removed += 1;
                        changes.push(Change::Removed(h));
                    }
                }
                // Keep the order queue from growing with removed entries.
                if self.order.len() > 2 * self.router_of.len() + 64 {
                    let held = &self.router_of;
                    self.order.retain(|e| held.contains_key(e));
                }
            }
            Event::AllBlocksCleared => {
                self.router_of.clear();
                self.order.clear();
                changes.push(Change::Cleared);
            }
        }
    }

    /// Drops the oldest blocks beyond the capacity: a removal we never saw.
    fn bound(&mut self, changes: &mut Vec<Change>) {
        while self.router_of.len() > self.capacity_blocks {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            if let Some(h) = self.router_of.remove(&oldest) {
                self.counts.over_capacity += 1;
                changes.push(Change::Removed(h));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::EventBatch;
    use prefixroute_core::hashing::{chain_hashes, HashConfig};

    fn message(seq: u64, events: Vec<Event>) -> Message {
        Message {
            topic: "kv@127.0.0.1:1@m".into(),
            seq,
            batch: EventBatch {
                ts: 0.0,
                events,
                data_parallel_rank: None,
            },
        }
    }

    fn stored(engine: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> Event {
        Event::BlockStored {
            block_hashes: engine.iter().map(|&e| EngineHash(e)).collect(),
            parent_block_hash: parent.map(EngineHash),
            token_ids: tokens,
            block_size: 4,
            lora_id: None,
            medium: Some("GPU".into()),
        }
    }

    fn router_chain(tokens: &[u32]) -> Vec<u64> {
        chain_hashes(
            tokens,
            chain_seed("m", ""),
            HashConfig {
                block_size: 4,
                include_partial: false,
                ..HashConfig::default()
            },
        )
    }

    #[test]
    fn stored_blocks_map_to_the_routers_own_chain_across_events() {
        let tokens: Vec<u32> = (100..112).collect();
        let expected = router_chain(&tokens);
        let mut truth = ServerTruth::new("m", 4, 100);
        let mut changes = Vec::new();
        // The first two blocks in one event, the third later with its parent's engine hash.
        truth.apply(
            &message(0, vec![stored(&[11, 12], None, tokens[..8].to_vec())]),
            &mut changes,
        );
        truth.apply(
            &message(1, vec![stored(&[13], Some(12), tokens[8..].to_vec())]),
            &mut changes,
        );
        // Each event's blocks, then the run they make: where it starts and ends, in router
        // hashes, so a gateway can mark where that request ended.
        let run = |parent, end, blocks| {
            Change::Run(StoredRun {
                parent,
                end,
                blocks,
            })
        };
        assert_eq!(
            changes,
            [
                Change::Stored(expected[0]),
                Change::Stored(expected[1]),
                run(None, expected[1], 2),
                Change::Stored(expected[2]),
                run(Some(expected[1]), expected[2], 1),
            ]
        );
        assert!(expected.iter().all(|&h| truth.holds(h)));
        // An event that stores nothing new (a block stored again) makes no run.
        changes.clear();
        truth.apply(
            &message(2, vec![stored(&[13], Some(12), tokens[8..].to_vec())]),
            &mut changes,
        );
        assert_eq!(changes, []);
        truth.apply(
            &message(
                3,
                vec![Event::BlockRemoved {
                    block_hashes: vec![EngineHash(13)],
                    medium: None,
                }],
            ),
            &mut changes,
        );
        assert!(!truth.holds(expected[2]));
        assert_eq!(changes.last(), Some(&Change::Removed(expected[2])));
        assert_eq!(truth.len(), 2);
    }

    #[test]
    fn a_sequence_gap_clears_the_server_and_rebuilds_from_what_follows() {
        let tokens: Vec<u32> = (0..8).collect();
        let mut truth = ServerTruth::new("m", 4, 100);
        let mut changes = Vec::new();
        truth.apply(
            &message(5, vec![stored(&[1, 2], None, tokens.clone())]),
            &mut changes,
        );
        assert_eq!(truth.len(), 2);
        changes.clear();
        // 6 and 7 were lost (one of them may have removed block 1).
        truth.apply(
            &message(8, vec![stored(&[3], None, tokens[..4].to_vec())]),
            &mut changes,
        );
        assert_eq!(changes[0], Change::Cleared);
        assert_eq!(truth.len(), 1);
        assert_eq!(truth.counts.gaps, 1);
        // A child of a block lost in the gap cannot be placed: an orphan, not a wrong hash.
        truth.apply(
            &message(9, vec![stored(&[4], Some(2), tokens[4..].to_vec())]),
            &mut changes,
        );
        assert_eq!(truth.counts.orphans, 1);
        assert_eq!(truth.len(), 1);
        // A publisher restart (sequence back to 0) is a gap too.
        truth.apply(&message(0, vec![]), &mut changes);
        assert_eq!(truth.counts.gaps, 2);
        assert!(truth.is_empty());
    }

    #[test]
    fn memory_is_bounded_by_the_capacity_and_foreign_events_are_skipped() {
        let mut truth = ServerTruth::new("m", 4, 3);
        let mut changes = Vec::new();
        let tokens: Vec<u32> = (0..20).collect();
        truth.apply(
            &message(0, vec![stored(&[1, 2, 3, 4, 5], None, tokens.clone())]),
            &mut changes,
        );
        assert_eq!(truth.len(), 3);
        assert_eq!(truth.counts.over_capacity, 2);
        let chain = router_chain(&tokens);
        assert!(
            !truth.holds(chain[0]) && truth.holds(chain[4]),
            "the oldest went"
        );
        let mut lora = stored(&[9], None, tokens[..4].to_vec());
        if let Event::BlockStored { lora_id, .. } = &mut lora {
            *lora_id = Some(2);
        }
        let mut eight = stored(&[10], None, (0..8).collect());
        if let Event::BlockStored { block_size, .. } = &mut eight {
            *block_size = 8;
        }
        truth.apply(&message(1, vec![lora, eight]), &mut changes);
        assert_eq!(
            (truth.counts.skipped, truth.counts.foreign_block_size),
            (1, 1)
        );
        assert_eq!(truth.len(), 3);
        truth.apply(&message(2, vec![Event::AllBlocksCleared]), &mut changes);
        assert!(truth.is_empty());
    }

    #[test]
    fn a_flood_of_stores_and_removes_keeps_the_order_queue_bounded() {
        let mut truth = ServerTruth::new("m", 4, 16);
        let mut changes = Vec::new();
        for i in 0..10_000u64 {
            let tokens: Vec<u32> = (0..4).map(|t| (i * 4 + t) as u32).collect();
            truth.apply(
                &message(2 * i, vec![stored(&[i + 1_000_000], None, tokens)]),
                &mut changes,
            );
            truth.apply(
                &message(
                    2 * i + 1,
                    vec![Event::BlockRemoved {
                        block_hashes: vec![EngineHash(i + 1_000_000)],
                        medium: None,
                    }],
                ),
                &mut changes,
            );
        }
        assert!(truth.is_empty());
        assert!(truth.order.len() <= 64 + 1, "{}", truth.order.len());
        assert_eq!(truth.counts.gaps, 0);
    }
}
