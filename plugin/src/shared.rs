//! Shared data as the plugin sees it: a key-value map with compare-and-swap, shared by every
//! VM instance (Envoy worker) with the same `vm_id`.
//!
//! The trait hides the host so the store, the in-flight accounting and the scrape lease run
//! unchanged in native unit tests over [`MemShared`], which copies Envoy's semantics,
//! including the one that matters for correctness: a `set` with a CAS on a key that does not
//! exist yet *succeeds* (Envoy ignores the CAS), so creating a key is never atomic.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;

/// Why a `set` failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetError {
    /// Someone wrote the key since our `get`.
    CasMismatch,
    /// Any other host status (raw proxy-wasm status code).
    Host(u32),
}

pub trait SharedData {
    /// The value and its CAS token, `Ok(None)` when the key does not exist, `Err(status)` on
    /// any other host status.
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, u32>;

    /// Writes `value` if the key's CAS token is still `cas` (0 = unconditional).
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), SetError>;
}

/// What every [`endpoint_key`] starts with.
pub const ENDPOINT_KEY_PREFIX: &str = "prefixroute/ep/";

/// Key of an endpoint's [`crate::codec::EndpointState`].
pub fn endpoint_key(address: &str) -> String {
    format!("{ENDPOINT_KEY_PREFIX}{address}")
}

/// Key of an index bucket. The table size is part of the key so that two configurations with
/// different table sizes never fight over one key with different hash-to-bucket mappings.
pub fn bucket_key(bits: u32, bucket: u64) -> String {
    BucketKeys::new(bits).key(bucket)
}

/// Builds bucket keys without the formatting machinery: a cold request builds two per new
/// block (its read and its write), and `format!` was a tenth of that path's instructions.
#[derive(Debug, Clone)]
pub struct BucketKeys {
    prefix: String,
    /// The last key [`BucketKeys::with_key`] built: the prefix stays, the digits change.
    kept: std::cell::RefCell<String>,
}

impl BucketKeys {
    pub fn new(bits: u32) -> Self {
        let prefix = format!("prefixroute/ix/{bits}/");
        BucketKeys {
            kept: std::cell::RefCell::new(prefix.clone()),
            prefix,
        }
    }

    /// Calls `f` with [`BucketKeys::key`] built in a kept buffer: a warm request reads a few
    /// buckets, and a new string for each key was one allocation per read. Re-entered (from
    /// inside `f`), it builds the key afresh.
    pub fn with_key<R>(&self, bucket: u64, f: impl FnOnce(&str) -> R) -> R {
        let Ok(mut kept) = self.kept.try_borrow_mut() else {
            return f(&self.key(bucket));
        };
        kept.truncate(self.prefix.len());
        push_hex(&mut kept, bucket);
        f(&kept)
    }

    /// `prefixroute/ix/<bits>/<bucket in lowercase hex>`, as [`bucket_key`].
    pub fn key(&self, bucket: u64) -> String {
        let mut key = String::with_capacity(self.prefix.len() + 16);
        key.push_str(&self.prefix);
        push_hex(&mut key, bucket);
        key
    }
}

/// Appends `n` in lowercase hex without leading zeros (`0` for zero).
fn push_hex(out: &mut String, n: u64) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut digits = [0u8; 16];
    let mut n = n;
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = HEX[(n & 0xf) as usize];
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    // Hex digits are ASCII, so this never falls back to the empty string.
    out.push_str(std::str::from_utf8(&digits[i..]).unwrap_or_default());
}

/// Key of an endpoint's [`crate::codec::CalibrationRecord`].
pub fn calibration_key(address: &str) -> String {
    format!("prefixroute/calibration/{address}")
}

pub const REGISTRY_KEY: &str = "prefixroute/instances";

/// Key of the [`crate::codec::FeedCursor`] (`index: precise`).
pub const FEED_KEY: &str = "prefixroute/kvfeed";

/// Key of the discovered [`crate::codec::Membership`] of a pool cluster.
pub fn members_key(pool_cluster: &str) -> String {
    format!("prefixroute/members/{pool_cluster}")
}

/// Key of one instance's [`crate::codec::InstanceRecord`].
pub fn instance_key(slot: u32) -> String {
    format!("prefixroute/ledger/{slot}")
}

/// [`instance_key`]s built once per slot: the ledger names its own record on every publish
/// (three per request) and each peer's on every route, and a `format!` is an allocation each.
/// Slots come from the shared registry, where they are small (one per live instance); a
/// garbled one beyond `InstanceKeys::MAX` is formatted each time rather than growing the
/// table to its number.
#[derive(Debug, Default)]
pub struct InstanceKeys {
    by_slot: Vec<String>,
    other: String,
}

impl InstanceKeys {
    const MAX: usize = 64;

    pub fn get(&mut self, slot: u32) -> &str {
        let i = slot as usize;
        if i >= Self::MAX {
            self.other = instance_key(slot);
            return &self.other;
        }
        while self.by_slot.len() <= i {
            let next = self.by_slot.len() as u32;
            self.by_slot.push(instance_key(next));
        }
        &self.by_slot[i]
    }
}

/// Read-modify-write attempts before giving up (the caller counts a give-up). A lost race
/// means another worker wrote the key between our read and our write; eight losses in a row
/// only happen under a storm of writes to one key, where dropping one update is the lesser harm
/// (every shared value is a belief or a counter that the next request or tick corrects).
pub const CAS_ATTEMPTS: u32 = 8;

/// A value as read, with the CAS token to write it back with (0: the key was absent, and the
/// write creates it; Envoy ignores the CAS then).
#[derive(Debug, Clone, PartialEq)]
pub struct Versioned<T> {
    pub value: T,
    pub cas: u32,
}

/// The value at `key`, or the default when the key is absent or its bytes do not decode (a
/// value of another layout, or corrupt: the next write replaces it). `Err(status)` on any other
/// host status.
// Inlined so that the record lands where the caller keeps it: in wasm every copy of a
// record is a `memory.copy` of its bytes (measured with the host-tests cost table).
#[inline(always)]
pub fn read_or_default<T: Default, H: SharedData + ?Sized>(
    host: &H,
    key: &str,
    decode: impl Fn(&[u8]) -> Option<T>,
) -> Result<Versioned<T>, u32> {
    Ok(match host.get(key)? {
        Some((bytes, cas)) => Versioned {
            value: decode(&bytes).unwrap_or_default(),
            cas,
        },
        None => Versioned {
            value: T::default(),
            cas: 0,
        },
    })
}

/// Result of [`read_modify_write`] and [`cas_update`].
#[derive(Debug, Clone, PartialEq)]
pub enum CasOutcome<T> {
    Written(T),
    /// The update function declined to write.
    Unchanged,
    /// Every attempt lost the race.
    GaveUp,
    /// The host returned an unexpected status.
    HostError(u32),
}

/// The one read-modify-write loop of the plugin, for values read through a cache as well as
/// straight from the host. `read(retry)` returns the current value and its CAS token (`retry`:
/// the previous attempt lost a race, so anything cached is stale); `update` returns the value
/// to write, or `None` to leave it; `write` sends it with the token. A lost race re-reads and
/// re-applies; after `attempts` losses it gives up.
pub fn read_modify_write<T>(
    attempts: u32,
    mut read: impl FnMut(bool) -> Result<Versioned<T>, u32>,
    mut update: impl FnMut(T) -> Option<T>,
    mut write: impl FnMut(&T, u32) -> Result<(), SetError>,
) -> CasOutcome<T> {
    for attempt in 0..attempts.max(1) {
        let current = match read(attempt > 0) {
            Ok(current) => current,
            Err(status) => return CasOutcome::HostError(status),
        };
        let Some(next) = update(current.value) else {
            return CasOutcome::Unchanged;
        };
        match write(&next, current.cas) {
            Ok(()) => return CasOutcome::Written(next),
            Err(SetError::CasMismatch) => continue,
            Err(SetError::Host(status)) => return CasOutcome::HostError(status),
        }
    }
    CasOutcome::GaveUp
}

/// [`read_modify_write`] of one key straight from the host, [`CAS_ATTEMPTS`] times at most.
/// `update` sees the current value (the default when absent or unreadable).
pub fn cas_update<T: Default, H: SharedData + ?Sized>(
    host: &H,
    key: &str,
    decode: impl Fn(&[u8]) -> Option<T>,
    encode: impl Fn(&T) -> Vec<u8>,
    update: impl FnMut(T) -> Option<T>,
) -> CasOutcome<T> {
    read_modify_write(
        CAS_ATTEMPTS,
        |_| read_or_default(host, key, &decode),
        update,
        |next, cas| host.set(key, &encode(next), cas),
    )
}

/// What shared-data operations went wrong, counted where they happen and drained into the
/// `shared_data.*` stats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SharedDataErrors {
    /// Read-modify-writes that lost every race.
    pub cas_give_ups: u32,
    /// Gets and sets the host refused.
    pub host_errors: u32,
}

impl SharedDataErrors {
    /// Counts what went wrong in `outcome`, and returns its written value.
    pub fn settle<T>(&mut self, outcome: CasOutcome<T>) -> Option<T> {
        match outcome {
            CasOutcome::Written(value) => return Some(value),
            CasOutcome::Unchanged => {}
            CasOutcome::GaveUp => self.cas_give_ups += 1,
            CasOutcome::HostError(_) => self.host_errors += 1,
        }
        None
    }
}

/// Endpoint ids by index and back. An id is the xxh64 of the endpoint's `ip:port`, so shared
/// values name endpoints stably across reconfigurations that reorder, add or remove them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointIds {
    ids: Vec<u64>,
    /// (id, index) sorted by id.
    by_id: Vec<(u64, usize)>,
}

impl EndpointIds {
    pub fn new(addresses: &[String]) -> Self {
        Self::from_ids(addresses.iter().map(|a| endpoint_id(a)).collect())
    }

    pub fn from_ids(ids: Vec<u64>) -> Self {
        let mut by_id: Vec<(u64, usize)> = ids.iter().copied().zip(0..).collect();
        by_id.sort_unstable();
        EndpointIds { ids, by_id }
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The id of endpoint `index`.
    pub fn id(&self, index: usize) -> Option<u64> {
        self.ids.get(index).copied()
    }

    /// The index of the endpoint with `id`, if it is one of ours.
    pub fn index(&self, id: u64) -> Option<usize> {
        self.by_id
            .binary_search_by_key(&id, |&(id, _)| id)
            .ok()
            .map(|pos| self.by_id[pos].1)
    }
}

/// Stable id of an endpoint address in shared values (see [`EndpointIds`]).
pub fn endpoint_id(address: &str) -> u64 {
    xxhash_rust::xxh64::xxh64(address.as_bytes(), 0)
}

/// In-memory shared data with Envoy's semantics, for tests and simulations. Clones share the
/// same map, like VM instances share the host's.
#[derive(Debug, Clone, Default)]
pub struct MemShared {
    inner: Rc<RefCell<MemInner>>,
}

#[derive(Debug, Default)]
struct MemInner {
    map: BTreeMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
    gets: u64,
    sets: u64,
    /// Successful writes, per key.
    writes: BTreeMap<String, u64>,
    /// Fail the next N CAS-guarded sets with CasMismatch (to exercise retry paths).
    force_mismatches: u32,
}

impl MemShared {
    pub fn new() -> Self {
        Self::default()
    }

    /// (gets, sets) so far.
    pub fn calls(&self) -> (u64, u64) {
        let i = self.inner.borrow();
        (i.gets, i.sets)
    }

    pub fn keys(&self) -> Vec<String> {
        self.inner.borrow().map.keys().cloned().collect()
    }

    /// How many sets of `key` succeeded so far.
    pub fn writes_to(&self, key: &str) -> u64 {
        self.inner.borrow().writes.get(key).copied().unwrap_or(0)
    }

    pub fn value(&self, key: &str) -> Option<Vec<u8>> {
        self.inner.borrow().map.get(key).map(|(v, _)| v.clone())
    }

    /// Makes the next `n` conditional sets fail as if another worker had won each race.
    pub fn force_mismatches(&self, n: u32) {
        self.inner.borrow_mut().force_mismatches = n;
    }
}

impl SharedData for MemShared {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, u32> {
        let mut i = self.inner.borrow_mut();
        i.gets += 1;
        Ok(i.map.get(key).cloned())
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), SetError> {
        let mut i = self.inner.borrow_mut();
        i.sets += 1;
        if cas != 0 && i.force_mismatches > 0 {
            i.force_mismatches -= 1;
            return Err(SetError::CasMismatch);
        }
        i.next_cas = i.next_cas.wrapping_add(1).max(1);
        let next = i.next_cas;
        match i.map.get_mut(key) {
            Some(slot) => {
                if cas != 0 && cas != slot.1 {
                    return Err(SetError::CasMismatch);
                }
                *slot = (value.to_vec(), next);
            }
            // Like Envoy: the CAS is ignored when the key does not exist.
            None => {
                i.map.insert(key.to_string(), (value.to_vec(), next));
            }
        }
        *i.writes.entry(key.to_string()).or_default() += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dec(b: &[u8]) -> Option<u32> {
        Some(u32::from_le_bytes(b.try_into().ok()?))
    }
    fn enc(v: &u32) -> Vec<u8> {
        v.to_le_bytes().to_vec()
    }

    #[test]
    fn mem_shared_has_envoy_cas_semantics() {
        let h = MemShared::new();
        assert_eq!(h.get("k"), Ok(None));
        // CAS on a missing key is ignored, as in Envoy.
        assert_eq!(h.set("k", b"a", 77), Ok(()));
        let (_, cas) = h.get("k").unwrap().unwrap();
        assert_eq!(
            h.set("k", b"b", cas.wrapping_add(1)),
            Err(SetError::CasMismatch)
        );
        assert_eq!(h.set("k", b"b", cas), Ok(()));
        assert_eq!(
            h.set("k", b"c", cas),
            Err(SetError::CasMismatch),
            "stale cas"
        );
        assert_eq!(h.set("k", b"d", 0), Ok(()), "unconditional");
        assert_eq!(h.value("k").unwrap(), b"d");
    }

    #[test]
    fn cas_update_retries_then_gives_up() {
        let h = MemShared::new();
        let add = |v: u32| Some(v + 1);
        assert_eq!(cas_update(&h, "n", dec, enc, add), CasOutcome::Written(1));
        h.force_mismatches(CAS_ATTEMPTS - 1);
        assert_eq!(cas_update(&h, "n", dec, enc, add), CasOutcome::Written(2));
        h.force_mismatches(CAS_ATTEMPTS);
        assert_eq!(cas_update(&h, "n", dec, enc, add), CasOutcome::GaveUp);
        assert_eq!(dec(&h.value("n").unwrap()), Some(2));
        assert_eq!(
            cas_update(&h, "n", dec, enc, |_| None),
            CasOutcome::Unchanged
        );
    }

    #[test]
    fn read_modify_write_rereads_after_a_lost_race_and_only_then() {
        let h = MemShared::new();
        h.set("n", &enc(&5), 0).unwrap();
        let mut retries = Vec::new();
        h.force_mismatches(2);
        let outcome = read_modify_write(
            4,
            |retry| {
                retries.push(retry);
                read_or_default(&h, "n", dec)
            },
            |v| Some(v + 1),
            |v, cas| h.set("n", &enc(v), cas),
        );
        assert_eq!(outcome, CasOutcome::Written(6));
        assert_eq!(retries, [false, true, true]);
        let mut errors = SharedDataErrors::default();
        assert_eq!(errors.settle(outcome), Some(6));
        assert_eq!(errors.settle(CasOutcome::<u32>::GaveUp), None);
        assert_eq!(errors.settle(CasOutcome::<u32>::HostError(1)), None);
        assert_eq!(
            errors,
            SharedDataErrors {
                cas_give_ups: 1,
                host_errors: 1
            }
        );
    }

    #[test]
    fn read_or_default_treats_absent_and_garbled_values_as_the_default() {
        let h = MemShared::new();
        assert_eq!(
            read_or_default(&h, "n", dec),
            Ok(Versioned { value: 0, cas: 0 })
        );
        h.set("n", b"garbled", 0).unwrap();
        let read = read_or_default(&h, "n", dec).unwrap();
        assert_eq!(read.value, 0);
        assert_ne!(
            read.cas, 0,
            "the garbled value's token, so a write replaces it"
        );
    }

    #[test]
    fn bucket_keys_are_the_bits_and_the_bucket_in_hex() {
        let keys = BucketKeys::new(12);
        for bucket in [0u64, 9, 0xa, 0xff, 0x3_0f0f, u64::MAX] {
            assert_eq!(keys.key(bucket), format!("prefixroute/ix/12/{bucket:x}"));
        }
        assert_eq!(bucket_key(18, 0xab), "prefixroute/ix/18/ab");
        // The kept buffer gives the same keys, a long one after a short one and back, and
        // re-entered it builds a fresh one.
        for bucket in [u64::MAX, 0, 0x3_0f0f, 7] {
            keys.with_key(bucket, |key| assert_eq!(key, keys.key(bucket)));
        }
        keys.with_key(1, |outer| {
            keys.with_key(0xbeef, |inner| assert_eq!(inner, "prefixroute/ix/12/beef"));
            assert_eq!(outer, "prefixroute/ix/12/1");
        });
    }

    #[test]
    fn endpoint_ids_map_both_ways_and_ignore_foreign_ids() {
        let ids = EndpointIds::new(&["10.0.0.2:8000".to_string(), "10.0.0.1:8000".to_string()]);
        assert_eq!(ids.len(), 2);
        assert_eq!(ids.id(1), Some(endpoint_id("10.0.0.1:8000")));
        assert_eq!(ids.index(endpoint_id("10.0.0.2:8000")), Some(0));
        assert_eq!(ids.index(endpoint_id("10.0.0.3:8000")), None);
        assert_eq!(ids.id(2), None);
    }

    #[test]
    fn keys_are_namespaced_and_stable() {
        assert_eq!(
            endpoint_key("10.0.0.1:8000"),
            "prefixroute/ep/10.0.0.1:8000"
        );
        assert_eq!(bucket_key(16, 0xbeef), "prefixroute/ix/16/beef");
        assert_eq!(instance_key(3), "prefixroute/ledger/3");
        let mut keys = InstanceKeys::default();
        assert_eq!(keys.get(12), "prefixroute/ledger/12");
        assert_eq!(keys.get(0), "prefixroute/ledger/0");
        assert_eq!(keys.get(12), instance_key(12));
        assert_eq!(keys.get(u32::MAX), instance_key(u32::MAX));
        for slot in 100..300 {
            assert_eq!(keys.get(slot), instance_key(slot));
        }
        assert!(keys.by_slot.len() <= InstanceKeys::MAX);
    }
}
