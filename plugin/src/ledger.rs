//! In-flight requests per endpoint, counted by the plugin and summed across Envoy workers.
//!
//! A scrape is a snapshot; what the router sent since is not in it. Each plugin instance (root
//! context that routes requests, i.e. one per worker) counts the requests it steered and has
//! not seen finish, and publishes them under its own key. Only that instance writes the key,
//! so publishing is one unconditional `set` and never races.
//!
//! Instances join a registry (one CAS) to get a *slot* (its key) and a *nonce* (which
//! registration wrote a record). A worker whose VM is reloaded stops heartbeating; once its
//! heartbeat is older than `stale_ms` its counts are ignored, and the next tick of any
//! instance removes it from the registry, freeing the slot for reuse. So counts never stick
//! forever and the key count is bounded by the number of live instances.

use crate::codec::{InstanceRecord, Member, Registry};
use crate::shared::{instance_key, SetError, SharedData, REGISTRY_KEY};
use crate::store::CAS_ATTEMPTS;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InFlightStats {
    pub cas_give_ups: u32,
    pub host_errors: u32,
}

#[derive(Debug)]
pub struct InFlight {
    /// Endpoint ids (see [`crate::store::endpoint_id`]) by index.
    ids: Vec<u64>,
    by_id: Vec<(u64, usize)>,
    local: Vec<u32>,
    me: Option<Member>,
    /// Other live instances, as of the last tick.
    peers: Vec<Member>,
    stale_ms: u64,
    stats: InFlightStats,
}

impl InFlight {
    pub fn new(ids: Vec<u64>, stale_ms: u64) -> Self {
        let mut by_id: Vec<(u64, usize)> = ids.iter().copied().zip(0..).collect();
        by_id.sort_unstable();
        InFlight {
            local: vec![0; ids.len()],
            ids,
            by_id,
            me: None,
            peers: Vec::new(),
            stale_ms,
            stats: InFlightStats::default(),
        }
    }

    /// This instance's own counts.
    pub fn local(&self) -> &[u32] {
        &self.local
    }

    pub fn slot(&self) -> Option<u32> {
        self.me.map(|m| m.slot)
    }

    pub fn peers(&self) -> usize {
        self.peers.len()
    }

    pub fn take_stats(&mut self) -> InFlightStats {
        std::mem::take(&mut self.stats)
    }

    /// A request was steered to `endpoint`.
    pub fn acquire(&mut self, host: &impl SharedData, endpoint: usize, now_ms: u64) {
        let Some(count) = self.local.get_mut(endpoint) else {
            return;
        };
        *count = count.saturating_add(1);
        if self.me.is_none() {
            // Registering lazily keeps the main thread's root context (which ticks but never
            // sees a request) out of the registry.
            self.register(host, now_ms);
        }
        self.publish(host, now_ms);
    }

    /// A steered request finished (completed, reset or destroyed).
    pub fn release(&mut self, host: &impl SharedData, endpoint: usize, now_ms: u64) {
        let Some(count) = self.local.get_mut(endpoint) else {
            return;
        };
        *count = count.saturating_sub(1);
        self.publish(host, now_ms);
    }

    /// Requests in flight to each endpoint across all live instances: ours from memory, the
    /// others' from their records (one `get` per peer).
    pub fn totals(&mut self, host: &impl SharedData, now_ms: u64) -> Vec<u32> {
        let mut totals = self.local.clone();
        for peer in &self.peers {
            let record = match host.get(&instance_key(peer.slot)) {
                Ok(Some((bytes, _))) => InstanceRecord::decode(&bytes),
                Ok(None) => None,
                Err(_) => {
                    self.stats.host_errors += 1;
                    None
                }
            };
            let Some(record) = record else { continue };
            if record.nonce != peer.nonce || self.is_stale(record.heartbeat_ms, now_ms) {
                continue;
            }
            for (id, count) in record.counts {
                if let Ok(pos) = self.by_id.binary_search_by_key(&id, |&(id, _)| id) {
                    let e = self.by_id[pos].1;
                    totals[e] = totals[e].saturating_add(count);
                }
            }
        }
        totals
    }

    fn is_stale(&self, heartbeat_ms: u64, now_ms: u64) -> bool {
        now_ms.saturating_sub(heartbeat_ms) > self.stale_ms
    }

    /// Periodic work (every root context's tick): heartbeat, refresh the peer list, reap
    /// instances whose heartbeat is stale, and re-register if we were reaped ourselves.
    pub fn tick(&mut self, host: &impl SharedData, now_ms: u64) {
        let (registry, cas) = match host.get(REGISTRY_KEY) {
            Ok(Some((bytes, cas))) => (Registry::decode(&bytes).unwrap_or_default(), cas),
            Ok(None) => (Registry::default(), 0),
            Err(_) => {
                self.stats.host_errors += 1;
                return;
            }
        };
        let mut alive = Vec::with_capacity(registry.members.len());
        let mut dead = false;
        for member in &registry.members {
            if Some(*member) == self.me {
                alive.push(*member);
                continue;
            }
            let record = match host.get(&instance_key(member.slot)) {
                Ok(Some((bytes, _))) => InstanceRecord::decode(&bytes),
                Ok(None) => None,
                Err(_) => {
                    // Unknown is not dead: keep it.
                    self.stats.host_errors += 1;
                    alive.push(*member);
                    continue;
                }
            };
            let last_sign_of_life = match record {
                Some(r) if r.nonce == member.nonce => r.heartbeat_ms,
                // Registered but not yet published (or the slot still holds its previous
                // owner's record): judge by the registration time.
                _ => member.registered_ms,
            };
            if self.is_stale(last_sign_of_life, now_ms) {
                dead = true;
            } else {
                alive.push(*member);
            }
        }
        if dead {
            let pruned = Registry {
                next_nonce: registry.next_nonce,
                members: alive.clone(),
            };
            // One attempt: if another instance changed the registry, the next tick retries.
            match host.set(REGISTRY_KEY, &pruned.encode(), cas) {
                Ok(()) | Err(SetError::CasMismatch) => {}
                Err(SetError::Host(_)) => self.stats.host_errors += 1,
            }
        }
        if let Some(me) = self.me {
            if !registry.members.contains(&me) {
                // We were reaped (a long stall): our requests are still in flight, so join
                // again under a new registration and publish them.
                self.me = None;
                self.register(host, now_ms);
            }
        }
        self.peers = alive.into_iter().filter(|m| Some(*m) != self.me).collect();
        self.publish(host, now_ms);
    }

    fn register(&mut self, host: &impl SharedData, now_ms: u64) {
        for _ in 0..CAS_ATTEMPTS {
            let (mut registry, cas) = match host.get(REGISTRY_KEY) {
                Ok(Some((bytes, cas))) => (Registry::decode(&bytes).unwrap_or_default(), cas),
                Ok(None) => (Registry::default(), 0),
                Err(_) => {
                    self.stats.host_errors += 1;
                    return;
                }
            };
            let member = Member {
                slot: registry.free_slot(),
                nonce: registry.next_nonce.max(1),
                registered_ms: now_ms,
            };
            registry.next_nonce = member.nonce + 1;
            registry.members.push(member);
            match host.set(REGISTRY_KEY, &registry.encode(), cas) {
                Ok(()) => {
                    self.me = Some(member);
                    return;
                }
                Err(SetError::CasMismatch) => continue,
                Err(SetError::Host(_)) => {
                    self.stats.host_errors += 1;
                    return;
                }
            }
        }
        self.stats.cas_give_ups += 1;
    }

    fn publish(&mut self, host: &impl SharedData, now_ms: u64) {
        let Some(me) = self.me else { return };
        let record = InstanceRecord {
            nonce: me.nonce,
            heartbeat_ms: now_ms,
            counts: self
                .ids
                .iter()
                .zip(&self.local)
                .filter(|(_, &n)| n > 0)
                .map(|(&id, &n)| (id, n))
                .collect(),
        };
        if host
            .set(&instance_key(me.slot), &record.encode(), 0)
            .is_err()
        {
            self.stats.host_errors += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::MemShared;

    const STALE: u64 = 3000;

    fn instance() -> InFlight {
        InFlight::new(vec![11, 22, 33], STALE)
    }

    #[test]
    fn counts_are_summed_across_instances() {
        let host = MemShared::new();
        let (mut a, mut b, mut main) = (instance(), instance(), instance());
        a.acquire(&host, 0, 0);
        a.acquire(&host, 0, 0);
        b.acquire(&host, 2, 0);
        assert_ne!(a.slot(), b.slot());
        for i in [&mut a, &mut b, &mut main] {
            i.tick(&host, 100);
        }
        assert_eq!(a.totals(&host, 100), vec![2, 0, 1]);
        assert_eq!(b.totals(&host, 100), vec![2, 0, 1]);
        assert_eq!(main.totals(&host, 100), vec![2, 0, 1]);
        assert_eq!(
            main.slot(),
            None,
            "an instance that never routes never registers"
        );
        a.release(&host, 0, 150);
        assert_eq!(
            b.totals(&host, 150),
            vec![1, 0, 1],
            "releases show up at once"
        );
        // Releasing more than acquired never underflows.
        b.release(&host, 2, 150);
        b.release(&host, 2, 150);
        assert_eq!(a.totals(&host, 150), vec![1, 0, 0]);
    }

    #[test]
    fn a_dead_instance_is_ignored_then_reaped_and_its_slot_reused() {
        let host = MemShared::new();
        let (mut a, mut dead) = (instance(), instance());
        dead.acquire(&host, 1, 0);
        dead.acquire(&host, 1, 0);
        a.acquire(&host, 0, 0);
        a.tick(&host, 10);
        assert_eq!(a.totals(&host, 10), vec![1, 2, 0]);
        let dead_slot = dead.slot();
        // `dead` stops ticking (its VM was reloaded). `a` keeps heartbeating.
        let mut now = 10;
        while now <= STALE + 10 {
            now += 250;
            a.tick(&host, now);
        }
        assert_eq!(a.totals(&host, now), vec![1, 0, 0], "stale counts ignored");
        assert_eq!(a.peers(), 0, "and reaped from the registry");
        let mut fresh = instance();
        fresh.acquire(&host, 2, now);
        assert_eq!(fresh.slot(), dead_slot, "slot reused: bounded keys");
        a.tick(&host, now + 1);
        assert_eq!(a.totals(&host, now + 1), vec![1, 0, 1]);
    }

    #[test]
    fn a_stalled_instance_that_was_reaped_rejoins_with_its_counts() {
        let host = MemShared::new();
        let (mut a, mut b) = (instance(), instance());
        a.acquire(&host, 0, 0);
        b.acquire(&host, 1, 0);
        // b stalls; a reaps it.
        a.tick(&host, STALE + 100);
        assert_eq!(a.peers(), 0);
        // b wakes up: it notices and registers again, keeping its in-flight request.
        b.tick(&host, STALE + 200);
        assert!(b.slot().is_some());
        a.tick(&host, STALE + 300);
        assert_eq!(a.totals(&host, STALE + 300), vec![1, 1, 0]);
    }

    #[test]
    fn registration_races_retry_and_unknown_endpoints_are_skipped() {
        let host = MemShared::new();
        let mut a = instance();
        host.force_mismatches(2);
        // First registration creates the key (no CAS), so force a mismatch on a later one.
        a.acquire(&host, 0, 0);
        let mut b = instance();
        host.force_mismatches(2);
        b.acquire(&host, 0, 0);
        assert!(b.slot().is_some());
        assert_eq!(b.take_stats(), InFlightStats::default());
        // A peer configured with other endpoints: only the shared ids add up.
        let mut other = InFlight::new(vec![22, 99], STALE);
        other.acquire(&host, 0, 0);
        other.acquire(&host, 1, 0);
        a.tick(&host, 1);
        assert_eq!(a.totals(&host, 1), vec![2, 1, 0]);
    }
}
