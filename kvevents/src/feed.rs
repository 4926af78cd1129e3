//! Every server's truth and the log of its changes, paged for the plugin (core's
//! [`FeedPage`]): "what changed since version V".
//!
//! Each change gets the next version. The log keeps the last `max_log` changes; a fetcher
//! further behind gets a snapshot (`reset`) of every server instead, so the log's memory is
//! bounded and nobody is ever served a hole.

use std::collections::VecDeque;

use prefixroute_core::feed::{FeedPage, FeedServer};

use crate::schema::Message;
use crate::truth::{Change, Counts, ServerTruth};

#[derive(Debug)]
struct Server {
    address: String,
    truth: ServerTruth,
    live: bool,
}

#[derive(Debug)]
pub struct Feed {
    servers: Vec<Server>,
    /// (version, server, change), versions consecutive.
    log: VecDeque<(u64, usize, Change)>,
    version: u64,
    max_log: usize,
    scratch: Vec<Change>,
}

impl Feed {
    pub fn new(max_log: usize) -> Self {
        Feed {
            servers: Vec::new(),
            log: VecDeque::new(),
            version: 0,
            max_log: max_log.max(1),
            scratch: Vec::new(),
        }
    }

    /// Adds a server (not live until its first message).
    pub fn add_server(&mut self, address: &str, truth: ServerTruth) -> usize {
        self.servers.push(Server {
            address: address.to_string(),
            truth,
            live: false,
        });
        self.servers.len() - 1
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    pub fn counts(&self, server: usize) -> Option<Counts> {
        self.servers.get(server).map(|s| s.truth.counts)
    }

    pub fn blocks(&self, server: usize) -> usize {
        self.servers.get(server).map_or(0, |s| s.truth.len())
    }

    pub fn is_live(&self, server: usize) -> bool {
        self.servers.get(server).is_some_and(|s| s.live)
    }

    /// A message from `server`'s publisher.
    pub fn apply(&mut self, server: usize, message: &Message) {
        let Some(s) = self.servers.get_mut(server) else {
            return;
        };
        let mut changes = std::mem::take(&mut self.scratch);
        if !s.live {
            // Coming (back) up: whatever was believed before the silence is void.
            s.live = true;
            s.truth.reset(&mut changes);
        }
        s.truth.apply(message, &mut changes);
        self.record(server, &mut changes);
        self.scratch = changes;
    }

    /// `server`'s publisher went away (or stopped answering): its truth is unknown now.
    pub fn lost(&mut self, server: usize) {
        let Some(s) = self.servers.get_mut(server) else {
            return;
        };
        if !s.live {
            return;
        }
        s.live = false;
        let mut changes = std::mem::take(&mut self.scratch);
        s.truth.reset(&mut changes);
        self.record(server, &mut changes);
        self.scratch = changes;
    }

    fn record(&mut self, server: usize, changes: &mut Vec<Change>) {
        for change in changes.drain(..) {
            self.version += 1;
            self.log.push_back((self.version, server, change));
        }
        while self.log.len() > self.max_log {
            self.log.pop_front();
        }
    }

    /// What changed after `since`, at most `limit` changes (the page's `version` says where
    /// to continue). Too far behind (or `since` from another relay's life): a snapshot.
    pub fn page(&self, since: u64, limit: usize) -> FeedPage {
        let oldest = self.log.front().map_or(self.version + 1, |(v, _, _)| *v);
        if since > self.version || since + 1 < oldest {
            return self.snapshot();
        }
        let mut servers: Vec<FeedServer> = self
            .servers
            .iter()
            .map(|s| FeedServer {
                address: s.address.clone(),
                live: s.live,
                ..FeedServer::default()
            })
            .collect();
        let mut version = since;
        let skip = (since + 1 - oldest) as usize;
        for &(v, server, change) in self.log.iter().skip(skip).take(limit.max(1)) {
            version = v;
            let s = &mut servers[server];
            match change {
                Change::Stored(h) => s.stored.push(h),
                Change::Removed(h) => {
                    // Stored and removed within this page: not stored after all, but still a
                    // removal (the plugin may hold the block from its own routing).
                    if let Some(i) = s.stored.iter().position(|&x| x == h) {
                        s.stored.swap_remove(i);
                    }
                    s.removed.push(h);
                }
                Change::Run(run) => s.runs.push(run),
                Change::Cleared => {
                    s.cleared = true;
                    s.stored.clear();
                    s.removed.clear();
                    s.runs.clear();
                }
            }
        }
        FeedPage {
            version,
            reset: false,
            servers,
        }
    }

    /// Every server's whole truth.
    pub fn snapshot(&self) -> FeedPage {
        FeedPage {
            version: self.version,
            reset: true,
            servers: self
                .servers
                .iter()
                .map(|s| FeedServer {
                    address: s.address.clone(),
                    live: s.live,
                    cleared: true,
                    stored: s.truth.blocks().collect(),
                    ..FeedServer::default()
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::{EngineHash, Event, EventBatch};

    fn message(seq: u64, event: Event) -> Message {
        Message {
            topic: String::new(),
            seq,
            batch: EventBatch {
                ts: 0.0,
                events: vec![event],
                data_parallel_rank: None,
            },
        }
    }

    fn stored(seq: u64, engine: u64, tokens: Vec<u32>) -> Message {
        message(
            seq,
            Event::BlockStored {
                block_hashes: vec![EngineHash(engine)],
                parent_block_hash: None,
                token_ids: tokens,
                block_size: 2,
                lora_id: None,
                medium: None,
            },
        )
    }

    fn removed(seq: u64, engine: u64) -> Message {
        message(
            seq,
            Event::BlockRemoved {
                block_hashes: vec![EngineHash(engine)],
                medium: None,
            },
        )
    }

    fn feed(max_log: usize) -> Feed {
        let mut f = Feed::new(max_log);
        f.add_server("a:1", ServerTruth::new("m", 2, 100));
        f.add_server("b:1", ServerTruth::new("m", 2, 100));
        f
    }

    #[test]
    fn pages_carry_what_changed_since_a_version_and_continue_from_theirs() {
        let mut f = feed(100);
        f.apply(0, &stored(0, 1, vec![1, 2]));
        f.apply(0, &stored(1, 2, vec![3, 4]));
        let first = f.page(0, 100);
        assert!(!first.reset);
        assert!(first.servers[0].live && !first.servers[1].live);
        // Coming up clears, then the two blocks.
        assert!(first.servers[0].cleared);
        assert_eq!(first.servers[0].stored.len(), 2);
        // And each event's run: where its request ended.
        let ends: Vec<u64> = first.servers[0].runs.iter().map(|r| r.end).collect();
        assert_eq!(ends, first.servers[0].stored);
        f.apply(0, &removed(2, 1));
        f.apply(1, &stored(0, 9, vec![5, 6]));
        let next = f.page(first.version, 100);
        assert_eq!(next.servers[0].removed.len(), 1);
        assert!(!next.servers[0].cleared);
        assert!(next.servers[1].cleared && next.servers[1].stored.len() == 1);
        assert_eq!(
            f.page(next.version, 100).servers[0],
            FeedServer {
                address: "a:1".into(),
                live: true,
                ..FeedServer::default()
            }
        );
        // Paging: one change at a time still gets everywhere.
        let one = f.page(0, 1);
        assert_eq!(one.version, 1);
    }

    #[test]
    fn a_block_stored_and_removed_within_one_page_still_reaches_the_plugin_as_removed() {
        // The plugin may hold it from its own routing (a speculative holder): it must hear
        // of the removal even when the store never reaches it.
        let mut f = feed(100);
        f.apply(0, &stored(0, 1, vec![1, 2]));
        let v = f.version();
        f.apply(0, &stored(1, 2, vec![3, 4]));
        f.apply(0, &removed(2, 2));
        let page = f.page(v, 100);
        assert!(page.servers[0].stored.is_empty());
        assert_eq!(page.servers[0].removed.len(), 1);
    }

    #[test]
    fn a_fetcher_too_far_behind_gets_a_snapshot_and_the_log_stays_bounded() {
        let mut f = feed(4);
        for i in 0..10u64 {
            f.apply(0, &stored(i, 100 + i, vec![i as u32, 0]));
        }
        assert!(f.log.len() <= 4);
        let page = f.page(1, 100);
        assert!(page.reset);
        assert_eq!(page.servers[0].stored.len(), 10);
        assert_eq!(page.version, f.version());
        // A version from the future (the relay restarted) also gets a snapshot.
        assert!(f.page(f.version() + 5, 100).reset);
    }

    #[test]
    fn a_lost_publisher_is_not_live_and_its_blocks_are_cleared() {
        let mut f = feed(100);
        f.apply(0, &stored(0, 1, vec![1, 2]));
        let v = f.version();
        f.lost(0);
        let page = f.page(v, 100);
        assert!(!page.servers[0].live && page.servers[0].cleared);
        assert_eq!(f.blocks(0), 0);
        f.lost(0);
        assert!(!f.page(page.version, 100).servers[0].cleared, "lost once");
    }
}
