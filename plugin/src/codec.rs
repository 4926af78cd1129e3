//! Binary layouts of the values the plugin keeps in proxy-wasm shared data.
//!
//! Every `get_shared_data` copies the whole value into wasm memory under a process-wide lock,
//! so values are small, fixed-order, little-endian records rather than JSON. Each starts with a
//! layout byte: a value written by a different plugin build sharing the `vm_id` decodes as
//! `None`, and callers treat it as absent (and overwrite it), instead of misreading it.
//! Decoding never panics: truncated or corrupt bytes are `None` too.

use prefixroute_core::latency::{
    Calibration, EndpointWork, GroupGrowth, HoldTime, LaneFit, PrefillRate, SentTokens, LANE_MODELS,
};
use prefixroute_core::metrics::ServerMetrics;
use prefixroute_core::outlier::OutlierState;
use prefixroute_core::Turn;

use crate::window::{DeadStamps, EPOCHS};

/// Layout version of every value below.
pub const LAYOUT: u8 = 10;

/// Appends little-endian fields.
#[derive(Debug, Default)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    pub fn with_layout() -> Self {
        Self::with_layout_capacity(64)
    }
    /// A writer with room for `bytes` (no regrowth while encoding a value of that size).
    pub fn with_layout_capacity(bytes: usize) -> Self {
        let mut buf = Vec::with_capacity(bytes.max(1));
        buf.push(LAYOUT);
        Writer(buf)
    }
    pub fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub fn f64(&mut self, v: f64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    /// A string of at most `u16::MAX` bytes, length first (longer ones are cut at a char).
    pub fn str(&mut self, v: &str) {
        let mut end = v.len().min(u16::MAX as usize);
        while !v.is_char_boundary(end) {
            end -= 1;
        }
        self.u16(end as u16);
        self.0.extend_from_slice(&v.as_bytes()[..end]);
    }
}

/// Reads little-endian fields; every read is `None` past the end.
#[derive(Debug)]
pub struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A reader positioned after the layout byte, or `None` for a foreign layout.
    pub fn with_layout(bytes: &'a [u8]) -> Option<Self> {
        let (&layout, rest) = bytes.split_first()?;
        (layout == LAYOUT).then_some(Reader { bytes: rest })
    }
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        if self.bytes.len() < N {
            return None;
        }
        let (head, rest) = self.bytes.split_at(N);
        self.bytes = rest;
        head.try_into().ok()
    }
    pub fn u8(&mut self) -> Option<u8> {
        self.take::<1>().map(|b| b[0])
    }
    pub fn u16(&mut self) -> Option<u16> {
        self.take().map(u16::from_le_bytes)
    }
    pub fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_le_bytes)
    }
    pub fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }
    pub fn f64(&mut self) -> Option<f64> {
        self.take().map(f64::from_le_bytes)
    }
    pub fn str(&mut self) -> Option<String> {
        let n = self.u16()? as usize;
        if self.bytes.len() < n {
            return None;
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        String::from_utf8(head.to_vec()).ok()
    }
    pub fn remaining(&self) -> usize {
        self.bytes.len()
    }
}

/// Everything shared about one endpoint, under `prefixroute/ep/<ip:port>`: its index clock,
/// its scrape lease and its last scrape. One key per endpoint means one `get` per endpoint per
/// request gives the router the load, the health and the index clock together.
///
/// Layout: `layout u8 | flags u8 (1 = down) | failures u16 | clock u64 | window_start u64 |
/// fill u64 | dead shift u8 | dead mask u16 | one u16 per set mask bit | capacity_tokens u64 |
/// calibration f64 | next_scrape_ms u64 | scraped_at_ms u64 | last_cold u64 | truth_epoch u64 |
/// consecutive_5xx u16 | ejections u16 | ejected_until_ms u64 | metrics mask u16 | one f64 per
/// set mask bit`. 93 to 189 bytes. Flags: 1 = down, 2 = precise.
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointState {
    /// Index insertion clock: how many block stamps were ever handed out for this endpoint.
    /// A block is believed held while `clock − stamp < capacity` (see `store`).
    pub clock: u64,
    /// The clock when the endpoint's belief was last emptied (it restarted).
    pub window_start: u64,
    /// Blocks recorded as new on the endpoint since then; up to the capacity, the blocks it is
    /// believed to hold. Unlike the clock it does not count the re-stamps of blocks already
    /// held.
    pub fill: u64,
    /// Where re-stamps left dead clock positions: what widens the window (see `window`).
    pub dead: DeadStamps,
    /// The cache the endpoint reports, `num_gpu_blocks × block_size` of
    /// `vllm:cache_config_info`, in tokens; 0 = never reported (the configured capacity
    /// applies). Kept across failed scrapes: a cache does not shrink when a scrape times out.
    pub capacity_tokens: u64,
    /// The share of that capacity the belief keeps (core's `Calibration::scale`): below 1 when
    /// the server's own hit rate fell short of what the belief predicted.
    pub calibration: f64,
    /// Scrape lease: the root context that moves this forward (by CAS) owns the next scrape.
    pub next_scrape_ms: u64,
    /// When the last successful scrape finished (0 = never).
    pub scraped_at_ms: u64,
    /// no-hit-lru's memory, shared by all workers: the cold-request sequence number this
    /// endpoint last took (0 = never).
    pub last_cold: u64,
    /// Consecutive failed scrapes (non-200 or no response).
    pub failures: u16,
    pub down: bool,
    /// The server's KV events reach the plugin (`index: precise`): its confirmed blocks are
    /// the truth, its unconfirmed ones a short speculation (see `store`).
    pub precise: bool,
    /// The clock when the server's events last said it lost everything (a restart, a gap, a
    /// publisher back from silence): no stamp before it is held.
    pub truth_epoch: u64,
    /// Its answers' server errors and ejections (core's `outlier`), every worker's.
    pub outlier: OutlierState,
    /// The last successful scrape; `None` = none yet, or the page did not parse.
    pub metrics: Option<ServerMetrics>,
}

const FLAG_DOWN: u8 = 1;
const FLAG_PRECISE: u8 = 2;

impl Default for EndpointState {
    fn default() -> Self {
        EndpointState {
            clock: 0,
            window_start: 0,
            fill: 0,
            dead: DeadStamps::default(),
            capacity_tokens: 0,
            calibration: 1.0,
            next_scrape_ms: 0,
            scraped_at_ms: 0,
            last_cold: 0,
            failures: 0,
            down: false,
            precise: false,
            truth_epoch: 0,
            outlier: OutlierState::default(),
            metrics: None,
        }
    }
}

impl EndpointState {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_layout();
        w.u8(if self.down { FLAG_DOWN } else { 0 } | if self.precise { FLAG_PRECISE } else { 0 });
        w.u16(self.failures);
        w.u64(self.clock);
        w.u64(self.window_start);
        w.u64(self.fill);
        w.u8(self.dead.shift);
        // Most epochs have no dead positions: a mask of the ones that do, then their counts.
        let mask = self
            .dead
            .counts
            .iter()
            .enumerate()
            .filter(|(_, &c)| c != 0)
            .fold(0u16, |m, (i, _)| m | 1 << i);
        w.u16(mask);
        for &count in self.dead.counts.iter().filter(|&&c| c != 0) {
            w.u16(count);
        }
        w.u64(self.capacity_tokens);
        w.f64(self.calibration);
        w.u64(self.next_scrape_ms);
        w.u64(self.scraped_at_ms);
        w.u64(self.last_cold);
        w.u64(self.truth_epoch);
        w.u16(self.outlier.consecutive_5xx);
        w.u16(self.outlier.ejections);
        w.u64(self.outlier.ejected_until_ms);
        match &self.metrics {
            None => w.u16(0),
            Some(m) => {
                // Bit 15 marks "metrics present" so a scrape with no known series is still a
                // (measured, empty) scrape; bits 0..8 say which fields follow.
                let fields = metric_fields(m);
                let mut mask = METRICS_PRESENT;
                for (bit, value) in fields.iter().enumerate() {
                    if value.is_some() {
                        mask |= 1 << bit;
                    }
                }
                w.u16(mask);
                for value in fields.into_iter().flatten() {
                    w.f64(value);
                }
            }
        }
        w.0
    }

    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let mut r = Reader::with_layout(bytes)?;
        let flags = r.u8()?;
        let failures = r.u16()?;
        let clock = r.u64()?;
        let window_start = r.u64()?;
        let fill = r.u64()?;
        let mut dead = DeadStamps {
            shift: r.u8()?.min(62),
            counts: [0; EPOCHS],
        };
        let dead_mask = r.u16()?;
        for (i, count) in dead.counts.iter_mut().enumerate() {
            if dead_mask & (1 << i) != 0 {
                *count = r.u16()?;
            }
        }
        let capacity_tokens = r.u64()?;
        let calibration = r.f64()?;
        let next_scrape_ms = r.u64()?;
        let scraped_at_ms = r.u64()?;
        let last_cold = r.u64()?;
        let truth_epoch = r.u64()?;
        let outlier = OutlierState {
            consecutive_5xx: r.u16()?,
            ejections: r.u16()?,
            ejected_until_ms: r.u64()?,
        };
        let mask = r.u16()?;
        let metrics = if mask & METRICS_PRESENT == 0 {
            None
        } else {
            let mut fields = [None; METRIC_FIELDS];
            for (bit, field) in fields.iter_mut().enumerate() {
                if mask & (1 << bit) != 0 {
                    *field = Some(r.f64()?);
                }
            }
            Some(ServerMetrics {
                num_requests_waiting: fields[0],
                num_requests_running: fields[1],
                kv_cache_usage_perc: fields[2],
                prefix_cache_queries_total: fields[3],
                prefix_cache_hits_total: fields[4],
                block_size: fields[5].map(|v| v as u32),
                num_gpu_blocks: fields[6].map(|v| v as u64),
                request_success_total: fields[7],
            })
        };
        Some(EndpointState {
            clock,
            window_start,
            fill,
            dead,
            capacity_tokens,
            calibration,
            next_scrape_ms,
            scraped_at_ms,
            last_cold,
            failures,
            down: flags & FLAG_DOWN != 0,
            precise: flags & FLAG_PRECISE != 0,
            truth_epoch,
            outlier,
            metrics,
        })
    }
}

/// The metrics mask's "a scrape was read" bit (see [`EndpointState`]'s layout).
const METRICS_PRESENT: u16 = 1 << 15;
const METRIC_FIELDS: usize = 8;

fn metric_fields(m: &ServerMetrics) -> [Option<f64>; METRIC_FIELDS] {
    [
        m.num_requests_waiting,
        m.num_requests_running,
        m.kv_cache_usage_perc,
        m.prefix_cache_queries_total,
        m.prefix_cache_hits_total,
        m.block_size.map(f64::from),
        // Block counts are far below 2^53, so the f64 round trip is exact.
        m.num_gpu_blocks.map(|v| v as f64),
        m.request_success_total,
    ]
}

/// One endpoint's claim on a block: its id (xxh64 of `ip:port`), the stamp its clock gave
/// the block when it was last recorded there, and whether (and which turn of its group) a
/// request's full blocks ended at it (core's `PrefixStore::continues`). The flags are the
/// stamp's top bits on the wire: a clock never reaches 2^61.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holder {
    pub endpoint: u64,
    pub stamp: u64,
    pub end: Option<Turn>,
    /// The server's own KV events reported the block (`index: precise`), not only our routing.
    pub confirmed: bool,
}

const END_BIT: u64 = 1 << 63;
const CONFIRMED_BIT: u64 = 1 << 62;
/// With `END_BIT`: the request that ended there was a later turn of its group.
const LATER_BIT: u64 = 1 << 61;
const STAMP_BITS: u64 = LATER_BIT - 1;

/// One block hash and the endpoints believed to hold it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub hash: u64,
    pub holders: Vec<Holder>,
}

/// A bucket of the shared index (`prefixroute/ix/<bits>/<n>`): a handful of entries whose
/// block hashes fall in it. Layout: `layout u8 | entries u8 | per entry: hash u64 |
/// holders u8 | per holder: endpoint u64, stamp u64 (bit 63: end, bit 62: confirmed, bit 61:
/// the end is a later turn's)`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bucket {
    pub entries: Vec<Entry>,
}

impl Bucket {
    pub fn encode(&self) -> Vec<u8> {
        let entries = &self.entries[..self.entries.len().min(u8::MAX as usize)];
        let holders: usize = entries.iter().map(|e| e.holders.len()).sum();
        let mut w = Writer::with_layout_capacity(2 + entries.len() * 9 + holders * 16);
        w.u8(entries.len() as u8);
        for e in entries {
            w.u64(e.hash);
            let holders = &e.holders[..e.holders.len().min(u8::MAX as usize)];
            w.u8(holders.len() as u8);
            for h in holders {
                w.u64(h.endpoint);
                w.u64(
                    (h.stamp & STAMP_BITS)
                        | match h.end {
                            None => 0,
                            Some(Turn::First) => END_BIT,
                            Some(Turn::Later) => END_BIT | LATER_BIT,
                        }
                        | if h.confirmed { CONFIRMED_BIT } else { 0 },
                );
            }
        }
        w.0
    }

    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let mut r = Reader::with_layout(bytes)?;
        let n = r.u8()? as usize;
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            let hash = r.u64()?;
            let k = r.u8()? as usize;
            let mut holders = Vec::with_capacity(k);
            for _ in 0..k {
                let endpoint = r.u64()?;
                let raw = r.u64()?;
                holders.push(Holder {
                    endpoint,
                    stamp: raw & STAMP_BITS,
                    end: (raw & END_BIT != 0).then_some(if raw & LATER_BIT != 0 {
                        Turn::Later
                    } else {
                        Turn::First
                    }),
                    confirmed: raw & CONFIRMED_BIT != 0,
                });
            }
            entries.push(Entry { hash, holders });
        }
        Some(Bucket { entries })
    }

    pub fn find(&self, hash: u64) -> Option<&Entry> {
        self.entries.iter().find(|e| e.hash == hash)
    }

    /// `endpoint`'s claim on `hash`, if any.
    pub fn holder(&self, hash: u64, endpoint: u64) -> Option<Holder> {
        self.find(hash)?
            .holders
            .iter()
            .find(|h| h.endpoint == endpoint)
            .copied()
    }
}

/// One endpoint's entry in an instance record: the instance's requests there and what it
/// learned from their first bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EndpointLedger {
    /// Endpoint id (xxh64 of `ip:port`).
    pub endpoint: u64,
    pub work: EndpointWork,
    pub rate: PrefillRate,
    pub sent: SentTokens,
    /// This instance's share of the groups living on the endpoint (core's `LiveGroups`;
    /// signed, the sum over instances is what counts).
    pub live_groups: f64,
    /// The requests this instance sent the endpoint lately, as of the record's heartbeat
    /// (core's `RecentRequests`).
    pub recent_requests: f64,
}

impl EndpointLedger {
    pub fn is_empty(&self) -> bool {
        self.work == EndpointWork::default()
            && self.rate == PrefillRate::default()
            && self.sent == SentTokens::default()
            && self.live_groups == 0.0
            && self.recent_requests == 0.0
    }
}

/// One plugin instance's (root context's) account, under `prefixroute/ledger/<slot>`: its
/// requests in flight and prefilling per endpoint, and what it learned (prefill rates, the
/// lane fit, group growth). Only that instance writes it, so it needs no CAS; readers add up
/// every live instance's record.
///
/// Layout: `layout u8 | nonce u64 | heartbeat_ms u64 | lane fit 8 × f64 | hold 2 × f64 |
/// growth 8 × f64 | live_at_ms f64 | n u16 | n × (endpoint u64, in_flight u32, prefilling u32,
/// prefill_tokens u64, busy_ms f64, work_tokens f64, sent_prompt u64,
/// sent_predicted_cached u64, live_groups f64, recent_requests f64)`: 171 + 72 n bytes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InstanceRecord {
    /// Which registration wrote this (a reused slot gets a new nonce).
    pub nonce: u64,
    pub heartbeat_ms: u64,
    pub lanes: LaneFit,
    pub hold: HoldTime,
    pub growth: GroupGrowth,
    /// The instant (ms) the endpoints' `live_groups` are counted as of.
    pub live_at_ms: f64,
    pub endpoints: Vec<EndpointLedger>,
}

const INSTANCE_HEADER_BYTES: usize = 171;
const LEDGER_BYTES: usize = 72;

impl InstanceRecord {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode_into(&mut out);
        out
    }

    /// [`InstanceRecord::encode`] into `out` (cleared first), so that a writer publishing on
    /// every request reuses one buffer.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        // `Writer::with_layout_capacity`'s start, in `out`'s allocation (a shared helper for
        // both measured 121 bytes more of `.wasm`).
        out.clear();
        out.reserve(INSTANCE_HEADER_BYTES + LEDGER_BYTES * self.endpoints.len());
        out.push(LAYOUT);
        let mut w = Writer(std::mem::take(out));
        w.u64(self.nonce);
        w.u64(self.heartbeat_ms);
        for e in self.lanes.excess {
            w.f64(e);
        }
        w.f64(self.hold.ms);
        w.f64(self.hold.count);
        w.f64(self.growth.first_turns);
        w.f64(self.growth.second_turns);
        w.f64(self.growth.further_turns);
        w.f64(self.growth.added_blocks);
        w.f64(self.growth.gaps);
        w.f64(self.growth.gap_ms);
        w.f64(self.growth.recent_first);
        w.f64(self.growth.at_ms);
        w.f64(self.live_at_ms);
        let endpoints = &self.endpoints[..self.endpoints.len().min(u16::MAX as usize)];
        w.u16(endpoints.len() as u16);
        for e in endpoints {
            w.u64(e.endpoint);
            w.u32(e.work.in_flight);
            w.u32(e.work.prefilling);
            w.u64(e.work.prefill_tokens);
            w.f64(e.rate.busy_ms);
            w.f64(e.rate.work_tokens);
            w.u64(e.sent.prompt);
            w.u64(e.sent.predicted_cached);
            w.f64(e.live_groups);
            w.f64(e.recent_requests);
        }
        *out = w.0;
    }

    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let mut r = Reader::with_layout(bytes)?;
        let nonce = r.u64()?;
        let heartbeat_ms = r.u64()?;
        let mut lanes = LaneFit::default();
        for e in lanes.excess.iter_mut() {
            *e = r.f64()?;
        }
        debug_assert_eq!(lanes.excess.len(), LANE_MODELS.len());
        let hold = HoldTime {
            ms: r.f64()?,
            count: r.f64()?,
        };
        let growth = GroupGrowth {
            first_turns: r.f64()?,
            second_turns: r.f64()?,
            further_turns: r.f64()?,
            added_blocks: r.f64()?,
            gaps: r.f64()?,
            gap_ms: r.f64()?,
            recent_first: r.f64()?,
            at_ms: r.f64()?,
        };
        let live_at_ms = r.f64()?;
        let n = r.u16()? as usize;
        if r.remaining() < n * LEDGER_BYTES {
            return None;
        }
        let mut endpoints = Vec::with_capacity(n);
        for _ in 0..n {
            endpoints.push(EndpointLedger {
                endpoint: r.u64()?,
                work: EndpointWork {
                    in_flight: r.u32()?,
                    prefilling: r.u32()?,
                    prefill_tokens: r.u64()?,
                },
                rate: PrefillRate {
                    busy_ms: r.f64()?,
                    work_tokens: r.f64()?,
                },
                sent: SentTokens {
                    prompt: r.u64()?,
                    predicted_cached: r.u64()?,
                },
                live_groups: r.f64()?,
                recent_requests: r.f64()?,
            });
        }
        Some(InstanceRecord {
            nonce,
            heartbeat_ms,
            lanes,
            hold,
            growth,
            live_at_ms,
            endpoints,
        })
    }
}

/// What one endpoint's calibration has seen, under `prefixroute/calibration/<ip:port>`:
/// core's `Calibration` and the ledger totals (all workers) at the last scrape, whose growth
/// is the next interval's prediction. Only the scraper (the lease holder) writes it.
/// Layout: `layout u8 | scale f64 | served_hits f64 | served_queries f64 |
/// predicted_hits f64 | predicted_queries f64 | sent_prompt u64 | sent_predicted_cached u64`:
/// 57 bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CalibrationRecord {
    pub calibration: Calibration,
    pub sent: SentTokens,
}

impl CalibrationRecord {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_layout();
        let c = &self.calibration;
        for v in [
            c.scale,
            c.served_hits,
            c.served_queries,
            c.predicted_hits,
            c.predicted_queries,
        ] {
            w.f64(v);
        }
        w.u64(self.sent.prompt);
        w.u64(self.sent.predicted_cached);
        w.0
    }

    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let mut r = Reader::with_layout(bytes)?;
        Some(CalibrationRecord {
            calibration: Calibration {
                scale: r.f64()?,
                served_hits: r.f64()?,
                served_queries: r.f64()?,
                predicted_hits: r.f64()?,
                predicted_queries: r.f64()?,
            },
            sent: SentTokens {
                prompt: r.u64()?,
                predicted_cached: r.u64()?,
            },
        })
    }
}

/// A registered instance: its slot (which in-flight key it writes), its nonce, and when it
/// registered (for reaping one that died before its first heartbeat).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    pub slot: u32,
    pub nonce: u64,
    pub registered_ms: u64,
}

/// The pool's membership as discovered, `prefixroute/members/<pool cluster>`: what every worker
/// routes over, and the discovery lease. Layout: `layout u8 | version u64 | next_discovery_ms
/// u64 | n u16 | n × (flags u8 (1 = routable), address str, name str)`, a `str` being `len u16 |
/// UTF-8 bytes`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Membership {
    /// Bumped by every change; a worker rebuilds its endpoint tables when it differs from the
    /// one it built them from.
    pub version: u64,
    /// Discovery lease: the root context that moves this forward (by CAS) sends the next call.
    pub next_discovery_ms: u64,
    pub members: Vec<PoolMember>,
}

pub use prefixroute_core::discovery::Member as PoolMember;

const FLAG_ROUTABLE: u8 = 1;

impl Membership {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_layout();
        w.u64(self.version);
        w.u64(self.next_discovery_ms);
        let members = &self.members[..self.members.len().min(u16::MAX as usize)];
        w.u16(members.len() as u16);
        for m in members {
            w.u8(if m.routable { FLAG_ROUTABLE } else { 0 });
            w.str(&m.address);
            w.str(&m.name);
        }
        w.0
    }

    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let mut r = Reader::with_layout(bytes)?;
        let version = r.u64()?;
        let next_discovery_ms = r.u64()?;
        let n = r.u16()? as usize;
        // Each member takes at least five bytes: refuse a count the value cannot hold.
        if r.remaining() < n * 5 {
            return None;
        }
        let mut members = Vec::with_capacity(n);
        for _ in 0..n {
            let flags = r.u8()?;
            members.push(PoolMember {
                routable: flags & FLAG_ROUTABLE != 0,
                address: r.str()?,
                name: r.str()?,
            });
        }
        Some(Membership {
            version,
            next_discovery_ms,
            members,
        })
    }
}

/// Where the plugin is in the relay's KV feed, `prefixroute/kvfeed`: the feed version applied
/// to shared data and the fetch lease. Layout: `layout u8 | version u64 | next_fetch_ms u64`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FeedCursor {
    pub version: u64,
    pub next_fetch_ms: u64,
}

impl FeedCursor {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_layout();
        w.u64(self.version);
        w.u64(self.next_fetch_ms);
        w.0
    }

    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let mut r = Reader::with_layout(bytes)?;
        Some(FeedCursor {
            version: r.u64()?,
            next_fetch_ms: r.u64()?,
        })
    }
}

/// The instance registry, `prefixroute/instances`. Layout: `layout u8 | next_nonce u64 |
/// n u16 | n × (slot u32, nonce u64, registered_ms u64)`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Registry {
    pub next_nonce: u64,
    pub members: Vec<Member>,
}

impl Registry {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_layout();
        w.u64(self.next_nonce);
        let members = &self.members[..self.members.len().min(u16::MAX as usize)];
        w.u16(members.len() as u16);
        for m in members {
            w.u32(m.slot);
            w.u64(m.nonce);
            w.u64(m.registered_ms);
        }
        w.0
    }

    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let mut r = Reader::with_layout(bytes)?;
        let next_nonce = r.u64()?;
        let n = r.u16()? as usize;
        if r.remaining() < n * 20 {
            return None;
        }
        let mut members = Vec::with_capacity(n);
        for _ in 0..n {
            members.push(Member {
                slot: r.u32()?,
                nonce: r.u64()?,
                registered_ms: r.u64()?,
            });
        }
        Some(Registry {
            next_nonce,
            members,
        })
    }

    /// The smallest slot no member uses, so slots (and their keys) are reused and the key
    /// count stays bounded by the largest number of live instances.
    pub fn free_slot(&self) -> u32 {
        let mut slot = 0;
        while self.members.iter().any(|m| m.slot == slot) {
            slot += 1;
        }
        slot
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full_metrics() -> ServerMetrics {
        ServerMetrics {
            num_requests_waiting: Some(3.0),
            num_requests_running: Some(5.5),
            kv_cache_usage_perc: Some(0.25),
            prefix_cache_queries_total: Some(1e9),
            prefix_cache_hits_total: Some(12345.0),
            request_success_total: Some(4321.0),
            block_size: Some(16),
            num_gpu_blocks: Some(1 << 40),
        }
    }

    #[test]
    fn endpoint_state_round_trips_with_and_without_metrics() {
        let mut s = EndpointState {
            clock: u64::MAX - 1,
            window_start: 12,
            fill: 77,
            dead: DeadStamps::default(),
            capacity_tokens: 128 * 16,
            calibration: 0.5,
            next_scrape_ms: 1_700_000_000_123,
            scraped_at_ms: 42,
            last_cold: 7,
            failures: 3,
            down: true,
            precise: true,
            truth_epoch: 99,
            outlier: OutlierState {
                consecutive_5xx: 4,
                ejections: 2,
                ejected_until_ms: 61_000,
            },
            metrics: None,
        };
        assert_eq!(s.encode().len(), 93);
        assert_eq!(EndpointState::decode(&s.encode()), Some(s.clone()));
        s.dead.shift = 5;
        s.dead.counts[3] = 9;
        s.dead.counts[15] = u16::MAX;
        assert_eq!(
            s.encode().len(),
            93 + 2 * 2,
            "only the epochs with dead positions"
        );
        assert_eq!(EndpointState::decode(&s.encode()), Some(s.clone()));
        s.metrics = Some(full_metrics());
        assert_eq!(s.encode().len(), 93 + 2 * 2 + 8 * 8);
        assert_eq!(EndpointState::decode(&s.encode()), Some(s.clone()));
        // Measured but empty (no known series) stays distinct from "no scrape".
        s.metrics = Some(ServerMetrics::default());
        s.down = false;
        assert_eq!(EndpointState::decode(&s.encode()), Some(s.clone()));
        // Partial metrics keep exactly their fields.
        s.metrics = Some(ServerMetrics {
            kv_cache_usage_perc: Some(0.5),
            num_gpu_blocks: Some(7),
            ..ServerMetrics::default()
        });
        assert_eq!(EndpointState::decode(&s.encode()), Some(s));
    }

    #[test]
    fn a_membership_round_trips_and_truncation_or_a_huge_count_decodes_as_none() {
        let m = Membership {
            version: 9,
            next_discovery_ms: 1_700_000_000_000,
            members: vec![
                PoolMember {
                    address: "10.0.0.1:8000".into(),
                    name: "vllm-0".into(),
                    routable: true,
                },
                PoolMember {
                    address: "[::1]:8000".into(),
                    name: "réplica".into(),
                    routable: false,
                },
            ],
        };
        let bytes = m.encode();
        assert_eq!(Membership::decode(&bytes), Some(m.clone()));
        for cut in 0..bytes.len() {
            assert_eq!(Membership::decode(&bytes[..cut]), None, "cut at {cut}");
        }
        let mut huge = bytes.clone();
        huge[17..19].copy_from_slice(&u16::MAX.to_le_bytes());
        assert_eq!(Membership::decode(&huge), None);
        let mut bad_utf8 = bytes;
        let at = bad_utf8.len() - 1;
        bad_utf8[at] = 0xff;
        assert_eq!(Membership::decode(&bad_utf8), None);
        assert_eq!(
            Membership::decode(&Membership::default().encode()),
            Some(Membership::default())
        );
    }

    #[test]
    fn decoders_reject_foreign_layouts_and_truncation_without_panicking() {
        let s = EndpointState {
            metrics: Some(full_metrics()),
            ..EndpointState::default()
        }
        .encode();
        for cut in 0..s.len() {
            assert_eq!(EndpointState::decode(&s[..cut]), None, "cut at {cut}");
        }
        let mut foreign = s.clone();
        foreign[0] = LAYOUT + 1;
        assert_eq!(EndpointState::decode(&foreign), None);
        assert_eq!(Bucket::decode(&[]), None);
        assert_eq!(InstanceRecord::decode(&[LAYOUT, 1, 2]), None);
        // A huge declared count with no data behind it is rejected, not allocated.
        let mut lie = vec![LAYOUT];
        lie.extend_from_slice(&[0; 16 + 13 * 8]);
        lie.extend_from_slice(&u16::MAX.to_le_bytes());
        assert_eq!(InstanceRecord::decode(&lie), None);
        let mut lie = vec![LAYOUT];
        lie.extend_from_slice(&[0; 8]);
        lie.extend_from_slice(&u16::MAX.to_le_bytes());
        assert_eq!(Registry::decode(&lie), None);
    }

    #[test]
    fn bucket_round_trips_and_finds_stamps() {
        let b = Bucket {
            entries: vec![
                Entry {
                    hash: 7,
                    holders: vec![
                        Holder {
                            endpoint: 1,
                            stamp: 10,
                            end: None,
                            confirmed: false,
                        },
                        Holder {
                            endpoint: 2,
                            stamp: 20,
                            end: Some(Turn::First),
                            confirmed: false,
                        },
                        Holder {
                            endpoint: 3,
                            stamp: (1 << 61) - 1,
                            end: Some(Turn::Later),
                            confirmed: true,
                        },
                    ],
                },
                Entry {
                    hash: u64::MAX,
                    holders: vec![],
                },
            ],
        };
        let bytes = b.encode();
        assert_eq!(bytes.len(), 2 + (9 + 48) + 9);
        assert_eq!(Bucket::decode(&bytes), Some(b.clone()));
        let h = b.holder(7, 2).unwrap();
        assert_eq!(
            (h.stamp, h.end),
            (20, Some(Turn::First)),
            "the end flags ride on the stamp's top bits"
        );
        assert_eq!(b.holder(7, 1).unwrap().end, None);
        assert_eq!(
            b.holder(7, 3).map(|h| (h.stamp, h.end, h.confirmed)),
            Some(((1 << 61) - 1, Some(Turn::Later), true)),
            "the largest stamp keeps every flag apart"
        );
        assert_eq!(b.holder(7, 4), None);
        assert_eq!(b.holder(8, 1), None);
        for cut in 0..bytes.len() {
            assert_eq!(Bucket::decode(&bytes[..cut]), None);
        }
    }

    #[test]
    fn calibration_record_round_trips() {
        let rec = CalibrationRecord {
            calibration: Calibration {
                scale: 0.5,
                served_hits: 1.0,
                served_queries: 2.0,
                predicted_hits: 3.0,
                predicted_queries: 4.0,
            },
            sent: SentTokens {
                prompt: 9,
                predicted_cached: 8,
            },
        };
        assert_eq!(rec.encode().len(), 57);
        assert_eq!(CalibrationRecord::decode(&rec.encode()), Some(rec));
        assert_eq!(CalibrationRecord::decode(&rec.encode()[..56]), None);
    }

    #[test]
    fn instance_record_and_registry_round_trip() {
        let mut lanes = LaneFit::default();
        lanes.excess[3] = 2.5;
        let rec = InstanceRecord {
            nonce: 9,
            heartbeat_ms: 123,
            lanes,
            hold: HoldTime {
                ms: 40.0,
                count: 2.0,
            },
            growth: GroupGrowth {
                first_turns: 2.5,
                second_turns: 2.5,
                further_turns: 5.0,
                added_blocks: 60.0,
                gaps: 3.0,
                gap_ms: 4500.0,
                recent_first: 0.75,
                at_ms: 1234.5,
            },
            live_at_ms: 1200.25,
            endpoints: vec![
                EndpointLedger {
                    endpoint: 1,
                    work: EndpointWork {
                        in_flight: 2,
                        prefilling: 1,
                        prefill_tokens: 900,
                    },
                    rate: PrefillRate {
                        busy_ms: 1.5,
                        work_tokens: 3000.0,
                    },
                    sent: SentTokens {
                        prompt: 12_000,
                        predicted_cached: 9_000,
                    },
                    live_groups: -1.25,
                    recent_requests: 3.5,
                },
                EndpointLedger {
                    endpoint: u64::MAX,
                    work: EndpointWork {
                        in_flight: u32::MAX,
                        ..EndpointWork::default()
                    },
                    ..EndpointLedger::default()
                },
            ],
        };
        assert_eq!(rec.encode().len(), 171 + 2 * 72);
        assert_eq!(rec.encode().capacity(), 171 + 2 * 72);
        // The ledger encodes into one buffer over and over: a shorter record written over a
        // longer one leaves none of the longer one's bytes behind.
        let mut buf = rec.encode();
        let shorter = InstanceRecord {
            endpoints: rec.endpoints[..1].to_vec(),
            ..rec.clone()
        };
        shorter.encode_into(&mut buf);
        assert_eq!(buf, shorter.encode());
        assert_eq!(InstanceRecord::decode(&buf), Some(shorter));
        assert_eq!(InstanceRecord::decode(&rec.encode()), Some(rec));
        let reg = Registry {
            next_nonce: 5,
            members: vec![
                Member {
                    slot: 0,
                    nonce: 3,
                    registered_ms: 1,
                },
                Member {
                    slot: 2,
                    nonce: 4,
                    registered_ms: 2,
                },
            ],
        };
        assert_eq!(Registry::decode(&reg.encode()), Some(reg.clone()));
        assert_eq!(reg.free_slot(), 1);
        assert_eq!(Registry::default().free_slot(), 0);
    }
}
