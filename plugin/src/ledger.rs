//! Each plugin instance's account of its requests, summed across Envoy workers: requests in
//! flight per endpoint, the prefill work of those whose first byte has not come back, and what
//! the instance learned from first bytes (each endpoint's prefill rate, the lane fit, how
//! groups grow).
//!
//! A scrape is a snapshot; what the router sent since is not in it. Each plugin instance (root
//! context that routes requests, i.e. one per worker) accounts the requests it steered and
//! publishes its account under its own key. Only that instance writes the key, so publishing
//! is one unconditional `set` and never races; learned sums ride along for free, so every
//! worker decides on the evidence of all of them without a CAS on the request path.
//!
//! Instances join a registry (one CAS) to get a *slot* (its key) and a *nonce* (which
//! registration wrote a record). A worker whose VM is reloaded stops heartbeating; once its
//! heartbeat is older than `stale_ms` its record is ignored, and the next tick of any
//! instance removes it from the registry, freeing the slot for reuse. So counts never stick
//! forever and the key count is bounded by the number of live instances. (What a dead
//! instance learned goes with it; the others keep learning.)

use prefixroute_core::latency::{
    decay, EndpointWork, GroupGrowth, LatencyConfig, LearnedModel, LiveGroups, Observation,
    Prediction, PrefillRate, RecentRequests, RequestLedger, SentTokens,
};
use prefixroute_core::router::Committed;
use prefixroute_core::Turn;

use crate::codec::{EndpointLedger, InstanceRecord, Member, Registry};
use crate::shared::{
    read_modify_write, read_or_default, EndpointIds, InstanceKeys, SetError, SharedData,
    SharedDataErrors, CAS_ATTEMPTS, REGISTRY_KEY,
};

/// What the ledger counted since the scheduler last drained it into stats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LedgerCounts {
    pub shared: SharedDataErrors,
    /// First bytes that taught the rate estimator something, and ones it refused as absurd.
    pub observations: u32,
    pub refused_observations: u32,
}

/// Everything every live instance accounted, added up: what the router decides with.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Pooled {
    pub work: Vec<EndpointWork>,
    pub sent: Vec<SentTokens>,
    pub learned: LearnedModel,
    pub growth: GroupGrowth,
    pub live: LiveGroups,
    /// The requests every instance sent each endpoint lately (core's bounded share).
    pub recent: RecentRequests,
}

impl Pooled {
    fn add_work(&mut self, e: usize, work: &EndpointWork, sent: &SentTokens) {
        let w = &mut self.work[e];
        w.in_flight = w.in_flight.saturating_add(work.in_flight);
        w.prefilling = w.prefilling.saturating_add(work.prefilling);
        w.prefill_tokens = w.prefill_tokens.saturating_add(work.prefill_tokens);
        let s = &mut self.sent[e];
        s.prompt = s.prompt.saturating_add(sent.prompt);
        s.predicted_cached = s.predicted_cached.saturating_add(sent.predicted_cached);
    }

    /// Adds an instance's count on `e`, times `keep`: what is left of it at the pool's
    /// instant (core's `latency::decay`).
    fn add_live(&mut self, e: usize, live: f64, keep: f64) {
        if let Some(v) = self.live.count.get_mut(e) {
            if live.is_finite() {
                *v += live * keep;
            }
        }
    }
}

#[derive(Debug)]
pub struct Ledger {
    ids: EndpointIds,
    /// This instance's own requests and what it learned from them.
    own: RequestLedger,
    growth: GroupGrowth,
    live: LiveGroups,
    /// The requests this instance sent each endpoint lately (as core's router counts them).
    recent: RecentRequests,
    me: Option<Member>,
    /// Other live instances, as of the last tick.
    peers: Vec<Member>,
    stale_ms: u64,
    counts: LedgerCounts,
    keys: InstanceKeys,
    /// What [`Ledger::publish`] writes, kept between publishes (three per request) so that it
    /// allocates neither the record's endpoint list nor its bytes again.
    record: InstanceRecord,
    encoded: Vec<u8>,
    /// A peer's learned model as its record tells it, rebuilt in place for each peer read.
    peer_model: LearnedModel,
    /// What [`Ledger::totals`] answers, rebuilt in place on every route.
    pooled: Pooled,
    /// The peers' live-group counts read by [`Ledger::totals`] (endpoint, count, as of),
    /// kept for their room.
    peer_live: Vec<(usize, f64, f64)>,
}

impl Ledger {
    pub fn new(ids: EndpointIds, stale_ms: u64) -> Self {
        Ledger {
            own: RequestLedger::new(ids.len()),
            growth: GroupGrowth::default(),
            live: LiveGroups::new(ids.len()),
            recent: RecentRequests::new(ids.len()),
            ids,
            me: None,
            peers: Vec::new(),
            stale_ms,
            counts: LedgerCounts::default(),
            keys: InstanceKeys::default(),
            record: InstanceRecord::default(),
            encoded: Vec::new(),
            peer_model: LearnedModel::new(0),
            pooled: Pooled::default(),
            peer_live: Vec::new(),
        }
    }

    /// The pool changed: this instance's account follows each endpoint that stays to its new
    /// index (by id); what it had on endpoints that left is dropped, and newcomers start
    /// empty. Published with the next write, so peers stop counting the leavers too.
    pub fn set_endpoints(&mut self, ids: EndpointIds) {
        let previous: Vec<Option<usize>> = (0..ids.len())
            .map(|e| ids.id(e).and_then(|id| self.ids.index(id)))
            .collect();
        self.own = self.own.remapped(&previous);
        self.live = self.live.remapped(&previous);
        // Seconds of history, as the router's own counts start over with the pool.
        self.recent = RecentRequests::new(ids.len());
        self.ids = ids;
    }

    /// The index of the endpoint with `id` in the current pool.
    pub fn index_of(&self, id: u64) -> Option<usize> {
        self.ids.index(id)
    }

    pub fn id_of(&self, endpoint: usize) -> Option<u64> {
        self.ids.id(endpoint)
    }

    /// This instance's own work per endpoint.
    pub fn local(&self) -> &[EndpointWork] {
        &self.own.work
    }

    pub fn slot(&self) -> Option<u32> {
        self.me.map(|m| m.slot)
    }

    pub fn peers(&self) -> usize {
        self.peers.len()
    }

    /// Counts `n` refused observations made elsewhere (scrapes' counters the router refused).
    pub fn count_refused(&mut self, n: u32) {
        self.counts.refused_observations += n;
    }

    pub fn take_counts(&mut self) -> LedgerCounts {
        std::mem::take(&mut self.counts)
    }

    /// A request was steered to `endpoint` with the prediction made for it there (a
    /// fallback: the default one, nothing cached, nothing to prefill that is known).
    pub fn acquire(
        &mut self,
        host: &impl SharedData,
        endpoint: usize,
        prediction: &Prediction,
        now_ms: u64,
    ) {
        if endpoint >= self.ids.len() {
            return;
        }
        self.own.sent(endpoint, prediction);
        if self.me.is_none() {
            // Registering lazily keeps the main thread's root context (which ticks but never
            // sees a request) out of the registry.
            self.register(host, now_ms);
        }
        self.publish(host, now_ms);
    }

    /// A steered request's first response byte: its prefill is done. With an observation
    /// (the request was routed with a prediction and answered 2xx), the endpoint's rate and
    /// the lane fit learn from it; an absurd one is refused and counted.
    pub fn first_byte(
        &mut self,
        host: &impl SharedData,
        endpoint: usize,
        uncached_tokens: u64,
        observation: Option<Observation>,
        config: &LatencyConfig,
        now_ms: u64,
    ) {
        if self.note_first_byte(endpoint, uncached_tokens, observation, config) {
            self.publish(host, now_ms);
        }
    }

    /// [`Self::first_byte`] kept in memory, for the request's [`Self::release`] to publish:
    /// for an answer whose end follows its first byte at once (not streamed: the server sends
    /// it whole), one write instead of two. Until then the other instances see the request
    /// still prefilling; this instance's own view has it at once. Returns whether it applied
    /// (an endpoint the ledger does not have changes nothing).
    pub fn note_first_byte(
        &mut self,
        endpoint: usize,
        uncached_tokens: u64,
        observation: Option<Observation>,
        config: &LatencyConfig,
    ) -> bool {
        if endpoint >= self.ids.len() {
            return false;
        }
        let observed = observation.is_some();
        match self
            .own
            .first_byte(endpoint, uncached_tokens, observation, config)
        {
            Ok(()) if observed => self.counts.observations += 1,
            Ok(()) => {}
            Err(_) => self.counts.refused_observations += 1,
        }
        true
    }

    /// A steered request finished (completed, reset or destroyed). `prefill_pending`: its
    /// first byte never came, so its prefill work is released now, with its in-flight count.
    /// `hold_ms`: how long an answered request held its lane after its first byte.
    pub fn release(
        &mut self,
        host: &impl SharedData,
        endpoint: usize,
        prefill_pending: Option<u64>,
        hold_ms: Option<f64>,
        now_ms: u64,
    ) {
        if endpoint >= self.ids.len() {
            return;
        }
        if self.own.done(endpoint, prefill_pending, hold_ms).is_err() {
            self.counts.refused_observations += 1;
        }
        self.publish(host, now_ms);
    }

    /// Learns how groups grow from one routed request, and counts where its group lives, as
    /// core's `Router::commit` did (`committed` is what it returned; published with the next
    /// write): it went to `endpoint`, `continued` is the turn of the request it continued,
    /// `new_blocks` the blocks it added.
    pub fn observe_growth(
        &mut self,
        endpoint: usize,
        committed: &Committed,
        continued: Option<Turn>,
        new_blocks: usize,
    ) {
        if let Some(gap) = committed.gap_ms {
            if self.growth.observe_gap(gap).is_err() {
                self.counts.refused_observations += 1;
            }
        }
        self.live.observe(
            endpoint,
            committed.share,
            committed.now_ms,
            committed.live_gap_ms,
        );
        self.growth.observe(continued, new_blocks, committed.now_ms);
    }

    /// One request routed to `endpoint` at `now_ms` (published with the next write).
    pub fn record_request(&mut self, endpoint: usize, now_ms: u64) {
        self.recent.record(endpoint, now_ms as f64);
    }

    /// `endpoint` restarted with an empty cache: this instance's count of the groups living
    /// there starts over (published with the next write).
    pub fn forget_live_groups(&mut self, endpoint: usize) {
        if let Some(v) = self.live.count.get_mut(endpoint) {
            *v = 0.0;
        }
    }

    /// Every live instance's account added up: ours from memory, the others' from their
    /// records (one `get` per peer). Rebuilt in the ledger's own buffers (`clone_from` keeps
    /// their room): a route asks for it once, and four fresh vectors per request showed.
    pub fn totals(&mut self, host: &impl SharedData, now_ms: u64) -> &Pooled {
        let n = self.ids.len();
        let mut pooled = std::mem::take(&mut self.pooled);
        // Field by field, every field named: one added to either struct must be copied too.
        let Pooled {
            work,
            sent,
            learned,
            growth,
            live,
            recent,
        } = &mut pooled;
        let LearnedModel { rates, lanes, hold } = &self.own.learned;
        work.clone_from(&self.own.work);
        sent.clone_from(&self.own.sent);
        learned.rates.clone_from(rates);
        (learned.lanes, learned.hold) = (*lanes, *hold);
        *growth = self.growth;
        // Every instance's live-group counts are as of its last request: each is decayed to
        // now with the pooled mean gap, so the peers' growth is added up first.
        live.count.clear();
        live.count.resize(n, 0.0);
        live.at_ms = now_ms as f64;
        recent.reset(n, now_ms as f64);
        let own_recent = self.recent.counts_at(now_ms as f64);
        for e in 0..n {
            recent.add(e, own_recent.on(e), now_ms as f64);
        }
        let mut peer_live = std::mem::take(&mut self.peer_live);
        peer_live.clear();
        for peer in &self.peers {
            let record = match host.get(self.keys.get(peer.slot)) {
                Ok(Some((bytes, _))) => InstanceRecord::decode(&bytes),
                Ok(None) => None,
                Err(_) => {
                    self.counts.shared.host_errors += 1;
                    None
                }
            };
            let Some(record) = record else { continue };
            if record.nonce != peer.nonce || self.is_stale(record.heartbeat_ms, now_ms) {
                continue;
            }
            let theirs = &mut self.peer_model;
            theirs.rates.clear();
            theirs.rates.resize(n, PrefillRate::default());
            theirs.lanes = record.lanes;
            theirs.hold = record.hold;
            // Every count of a record is as of its heartbeat: one decay for all of them.
            let keep = pooled.recent.keep_since(record.heartbeat_ms as f64);
            for ledger in &record.endpoints {
                if let Some(e) = self.ids.index(ledger.endpoint) {
                    pooled.add_work(e, &ledger.work, &ledger.sent);
                    theirs.rates[e] = ledger.rate;
                    peer_live.push((e, ledger.live_groups, record.live_at_ms));
                    pooled.recent.add_kept(e, ledger.recent_requests, keep);
                }
            }
            pooled.learned.add(theirs);
            pooled.growth.add(&record.growth);
        }
        let gap_ms = pooled.growth.mean_gap_ms();
        let keep_since = |at_ms: f64| {
            if at_ms.is_finite() {
                decay(now_ms as f64 - at_ms, gap_ms)
            } else {
                0.0
            }
        };
        let own = keep_since(self.live.at_ms);
        for (e, &count) in self.live.count.iter().enumerate() {
            pooled.add_live(e, count, own);
        }
        // One instance's entries are in a row and share its instant: one `exp` per instance.
        let mut last = (f64::NAN, 0.0);
        for &(e, count, at_ms) in &peer_live {
            if at_ms.to_bits() != last.0.to_bits() {
                last = (at_ms, keep_since(at_ms));
            }
            pooled.add_live(e, count, last.1);
        }
        self.peer_live = peer_live;
        self.pooled = pooled;
        &self.pooled
    }
    fn is_stale(&self, heartbeat_ms: u64, now_ms: u64) -> bool {
        now_ms.saturating_sub(heartbeat_ms) > self.stale_ms
    }

    /// Periodic work (every root context's tick): heartbeat, refresh the peer list, reap
    /// instances whose heartbeat is stale, and re-register if we were reaped ourselves.
    pub fn tick(&mut self, host: &impl SharedData, now_ms: u64) {
        let Ok(read) = read_or_default(host, REGISTRY_KEY, Registry::decode) else {
            self.counts.shared.host_errors += 1;
            return;
        };
        let (registry, cas) = (read.value, read.cas);
        let mut alive = Vec::with_capacity(registry.members.len());
        let mut dead = false;
        for member in &registry.members {
            if Some(*member) == self.me {
                alive.push(*member);
                continue;
            }
            let record = match host.get(self.keys.get(member.slot)) {
                Ok(Some((bytes, _))) => InstanceRecord::decode(&bytes),
                Ok(None) => None,
                Err(_) => {
                    // Unknown is not dead: keep it.
                    self.counts.shared.host_errors += 1;
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
                Err(SetError::Host(_)) => self.counts.shared.host_errors += 1,
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
        let mut member = None;
        let outcome = read_modify_write(
            CAS_ATTEMPTS,
            |_| read_or_default(host, REGISTRY_KEY, Registry::decode),
            |mut registry: Registry| {
                let joined = Member {
                    slot: registry.free_slot(),
                    nonce: registry.next_nonce.max(1),
                    registered_ms: now_ms,
                };
                registry.next_nonce = joined.nonce + 1;
                registry.members.push(joined);
                member = Some(joined);
                Some(registry)
            },
            |registry, cas| host.set(REGISTRY_KEY, &registry.encode(), cas),
        );
        if self.counts.shared.settle(outcome).is_some() {
            self.me = member;
        }
    }

    fn publish(&mut self, host: &impl SharedData, now_ms: u64) {
        let Some(me) = self.me else { return };
        let record = &mut self.record;
        record.nonce = me.nonce;
        record.heartbeat_ms = now_ms;
        record.lanes = self.own.learned.lanes;
        record.hold = self.own.learned.hold;
        record.growth = self.growth;
        record.live_at_ms = self.live.at_ms;
        record.endpoints.clear();
        let recent = self.recent.counts_at(now_ms as f64);
        record.endpoints.extend(
            (0..self.ids.len())
                .map(|e| EndpointLedger {
                    endpoint: self.ids.id(e).unwrap_or_default(),
                    work: self.own.work[e],
                    rate: self.own.learned.rates[e],
                    sent: self.own.sent[e],
                    live_groups: self.live.count.get(e).copied().unwrap_or(0.0),
                    recent_requests: recent.on(e),
                })
                .filter(|l| !l.is_empty()),
        );
        record.encode_into(&mut self.encoded);
        if host.set(self.keys.get(me.slot), &self.encoded, 0).is_err() {
            self.counts.shared.host_errors += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prefixroute_core::latency::Backlog;

    use crate::shared::MemShared;

    const STALE: u64 = 3000;

    fn instance() -> Ledger {
        Ledger::new(EndpointIds::from_ids(vec![11, 22, 33]), STALE)
    }

    fn work(uncached: u64) -> Prediction {
        Prediction {
            uncached_tokens: uncached as usize,
            ..Prediction::default()
        }
    }

    fn in_flight(p: &Pooled) -> Vec<u32> {
        p.work.iter().map(|w| w.in_flight).collect()
    }

    fn observation(elapsed_ms: f64) -> Observation {
        Observation {
            backlog: Backlog::default(),
            uncached_tokens: 500.0,
            ms_per_token: 1.0,
            lanes: 1,
            hold_ms: 0.0,
            elapsed_ms,
        }
    }

    #[test]
    fn counts_and_prefill_work_are_summed_across_instances() {
        let host = MemShared::new();
        let (mut a, mut b, mut main) = (instance(), instance(), instance());
        a.acquire(&host, 0, &work(100), 0);
        a.acquire(&host, 0, &work(50), 0);
        b.acquire(&host, 2, &work(700), 0);
        assert_ne!(a.slot(), b.slot());
        for i in [&mut a, &mut b, &mut main] {
            i.tick(&host, 100);
        }
        for i in [&mut a, &mut b, &mut main] {
            let p = i.totals(&host, 100);
            assert_eq!(in_flight(p), vec![2, 0, 1]);
            assert_eq!(
                p.work[0],
                EndpointWork {
                    in_flight: 2,
                    prefilling: 2,
                    prefill_tokens: 150
                }
            );
        }
        assert_eq!(
            main.slot(),
            None,
            "an instance that never routes never registers"
        );
        // A first byte releases the prefill work at once; the request still holds its lane.
        let config = LatencyConfig::default();
        a.first_byte(&host, 0, 100, None, &config, 120);
        let w = b.totals(&host, 120).work[0];
        assert_eq!((w.in_flight, w.prefilling, w.prefill_tokens), (2, 1, 50));
        // The stream ends; a request whose first byte never came releases its work with it.
        a.release(&host, 0, None, Some(30.0), 150);
        a.release(&host, 0, Some(50), None, 150);
        assert_eq!(b.totals(&host, 150).work[0], EndpointWork::default());
        assert_eq!(b.totals(&host, 150).learned.hold.mean_ms(), 30.0);
        // Releasing more than acquired never underflows.
        b.release(&host, 2, Some(700), None, 150);
        b.release(&host, 2, Some(700), None, 150);
        assert_eq!(a.totals(&host, 150).work[2], EndpointWork::default());
    }

    #[test]
    fn every_instances_recent_requests_are_pooled_and_decayed_to_now() {
        let host = MemShared::new();
        let (mut a, mut b) = (instance(), instance());
        // The counts ride the record a request's acquire writes.
        for e in [0, 0, 0, 1] {
            a.record_request(e, 0);
            a.acquire(&host, e, &work(10), 0);
        }
        b.record_request(0, 0);
        b.record_request(2, 0);
        b.acquire(&host, 2, &work(10), 0);
        for i in [&mut a, &mut b] {
            i.tick(&host, 0);
        }
        let window = RecentRequests::WINDOW_MS;
        for i in [&mut a, &mut b] {
            let recent = &i.totals(&host, 0).recent;
            let counts: Vec<f64> = (0..3).map(|e| recent.count(e, 0.0)).collect();
            assert_eq!(counts, vec![4.0, 1.0, 1.0]);
            // A fifth of a window later (within the peers' heartbeat), what is left of each.
            let later = &i.totals(&host, window as u64 / 5).recent;
            let left = later.count(0, window / 5.0);
            assert!((left - 4.0 * (-0.2f64).exp()).abs() < 1e-9, "{left}");
        }
    }

    #[test]
    fn a_peer_that_learned_nothing_adds_nothing_after_one_that_did() {
        // The peers' models are rebuilt in one buffer: what the first taught must not be
        // read again as the second's.
        let host = MemShared::new();
        let (mut a, mut b, mut c) = (instance(), instance(), instance());
        let config = LatencyConfig::default();
        a.acquire(&host, 1, &work(500), 0);
        b.acquire(&host, 0, &work(0), 0);
        c.acquire(&host, 2, &work(0), 0);
        a.first_byte(&host, 1, 500, Some(observation(1005.0)), &config, 10);
        c.tick(&host, 20);
        let pooled = c.totals(&host, 20);
        assert_eq!(pooled.learned.rates[1].busy_ms, 1000.0);
        assert_eq!(pooled.learned.rates[1].work_tokens, 500.0);
        assert_eq!(pooled.learned.rates[0], PrefillRate::default());
    }

    #[test]
    fn what_one_instance_learns_every_instance_decides_with() {
        let host = MemShared::new();
        let (mut a, mut b) = (instance(), instance());
        let config = LatencyConfig::default();
        a.acquire(&host, 1, &work(500), 0);
        b.acquire(&host, 1, &work(0), 0);
        a.first_byte(&host, 1, 500, Some(observation(1005.0)), &config, 10);
        let at = |now_ms: f64, share: f64, gap_ms: Option<f64>| Committed {
            share,
            gap_ms,
            live_gap_ms: 1000.0,
            now_ms,
        };
        a.observe_growth(1, &at(10.0, 0.8, Some(400.0)), Some(Turn::First), 6);
        b.observe_growth(2, &at(20.0, 0.6, Some(600.0)), Some(Turn::Later), 9);
        a.release(&host, 1, None, None, 20);
        b.tick(&host, 30);
        let pooled = b.totals(&host, 30);
        assert_eq!(pooled.learned.rates[1].busy_ms, 1000.0);
        assert_eq!(pooled.learned.rates[1].work_tokens, 500.0);
        assert_eq!(
            (pooled.growth.second_turns, pooled.growth.further_turns),
            (1.0, 1.0),
            "each instance's turns, pooled"
        );
        assert_eq!(
            pooled.growth.gaps,
            2.0 * 0.98,
            "each instance's measured gaps"
        );
        // Live groups: each instance's count as of its last request, decayed to now with the
        // pooled mean gap, then summed (a's 0.8 on 1 since 10 ms, b's 0.6 on 2 since 20 ms).
        let gap = pooled.growth.mean_gap_ms();
        let keep = |since: f64| (-(30.0 - since) / gap).exp();
        assert_eq!(pooled.live.at_ms, 30.0);
        assert!((pooled.live.on(1, 30.0, gap) - 0.8 * keep(10.0)).abs() < 1e-12);
        assert!((pooled.live.on(2, 30.0, gap) - 0.6 * keep(20.0)).abs() < 1e-12);
        assert_eq!(pooled.live.on(0, 30.0, gap), 0.0);
        assert_eq!(a.take_counts().observations, 1);
    }

    #[test]
    fn absurd_first_bytes_are_refused_and_counted() {
        let host = MemShared::new();
        let mut a = instance();
        let config = LatencyConfig::default();
        for elapsed in [0.0, -5.0, f64::NAN, 1e12] {
            a.acquire(&host, 0, &work(10), 0);
            a.first_byte(&host, 0, 10, Some(observation(elapsed)), &config, 1);
        }
        let counts = a.take_counts();
        assert_eq!((counts.observations, counts.refused_observations), (0, 4));
        assert_eq!(a.totals(&host, 1).learned.rates[0], PrefillRate::default());
    }

    #[test]
    fn absurd_gaps_are_refused_and_counted() {
        let host = MemShared::new();
        let mut a = instance();
        for gap in [-1.0, f64::NAN, 2.0 * 3_600_000.0, 250.0] {
            let committed = Committed {
                share: 0.5,
                gap_ms: Some(gap),
                live_gap_ms: 1000.0,
                now_ms: 10.0,
            };
            a.observe_growth(0, &committed, Some(Turn::First), 3);
        }
        assert_eq!(a.take_counts().refused_observations, 3);
        a.tick(&host, 10);
        let growth = &a.totals(&host, 10).growth;
        // One gap learned (published with the growth's forgetting), and it is the sane one.
        assert!(growth.gaps > 0.9 && growth.gaps <= 1.0, "{growth:?}");
        assert_eq!(growth.gap_ms / growth.gaps, 250.0, "{growth:?}");
    }

    #[test]
    fn a_dead_instance_is_ignored_then_reaped_and_its_slot_reused() {
        let host = MemShared::new();
        let (mut a, mut dead) = (instance(), instance());
        dead.acquire(&host, 1, &work(0), 0);
        dead.acquire(&host, 1, &work(0), 0);
        a.acquire(&host, 0, &work(0), 0);
        a.tick(&host, 10);
        assert_eq!(in_flight(a.totals(&host, 10)), vec![1, 2, 0]);
        let dead_slot = dead.slot();
        // `dead` stops ticking (its VM was reloaded). `a` keeps heartbeating.
        let mut now = 10;
        while now <= STALE + 10 {
            now += 250;
            a.tick(&host, now);
        }
        assert_eq!(
            in_flight(a.totals(&host, now)),
            vec![1, 0, 0],
            "stale counts ignored"
        );
        assert_eq!(a.peers(), 0, "and reaped from the registry");
        let mut fresh = instance();
        fresh.acquire(&host, 2, &work(0), now);
        assert_eq!(fresh.slot(), dead_slot, "slot reused: bounded keys");
        a.tick(&host, now + 1);
        assert_eq!(in_flight(a.totals(&host, now + 1)), vec![1, 0, 1]);
    }

    #[test]
    fn a_stalled_instance_that_was_reaped_rejoins_with_its_counts() {
        let host = MemShared::new();
        let (mut a, mut b) = (instance(), instance());
        a.acquire(&host, 0, &work(0), 0);
        b.acquire(&host, 1, &work(0), 0);
        // b stalls; a reaps it.
        a.tick(&host, STALE + 100);
        assert_eq!(a.peers(), 0);
        // b wakes up: it notices and registers again, keeping its in-flight request.
        b.tick(&host, STALE + 200);
        assert!(b.slot().is_some());
        a.tick(&host, STALE + 300);
        assert_eq!(in_flight(a.totals(&host, STALE + 300)), vec![1, 1, 0]);
    }

    #[test]
    fn registration_races_retry_and_unknown_endpoints_are_skipped() {
        let host = MemShared::new();
        let mut a = instance();
        host.force_mismatches(2);
        // First registration creates the key (no CAS), so force a mismatch on a later one.
        a.acquire(&host, 0, &work(0), 0);
        let mut b = instance();
        host.force_mismatches(2);
        b.acquire(&host, 0, &work(0), 0);
        assert!(b.slot().is_some());
        assert_eq!(b.take_counts(), LedgerCounts::default());
        // A peer configured with other endpoints: only the shared ids add up.
        let mut other = Ledger::new(EndpointIds::from_ids(vec![22, 99]), STALE);
        other.acquire(&host, 0, &work(0), 0);
        other.acquire(&host, 1, &work(0), 0);
        a.tick(&host, 1);
        assert_eq!(in_flight(a.totals(&host, 1)), vec![2, 1, 0]);
    }
}
