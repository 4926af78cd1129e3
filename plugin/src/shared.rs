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

/// Key of an endpoint's [`crate::codec::EndpointState`].
pub fn endpoint_key(address: &str) -> String {
    format!("prefixroute/ep/{address}")
}

/// Key of an index bucket. The table size is part of the key so that two configurations with
/// different table sizes never fight over one key with different hash-to-bucket mappings.
pub fn bucket_key(bits: u32, bucket: u64) -> String {
    format!("prefixroute/ix/{bits}/{bucket:x}")
}

/// Key of an endpoint's [`crate::codec::CalibrationRecord`].
pub fn calibration_key(address: &str) -> String {
    format!("prefixroute/calibration/{address}")
}

pub const REGISTRY_KEY: &str = "prefixroute/instances";

/// Key of one instance's [`crate::codec::InstanceRecord`].
pub fn instance_key(slot: u32) -> String {
    format!("prefixroute/ledger/{slot}")
}

/// Result of [`cas_update`].
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

/// Read-modify-write with bounded retries. `update` sees the current value (`None` when absent
/// or unreadable) and returns the value to write, or `None` to leave it. A lost race re-reads
/// and re-applies; after `attempts` losses it gives up (the caller counts that).
pub fn cas_update<T, H: SharedData + ?Sized>(
    host: &H,
    key: &str,
    attempts: u32,
    decode: impl Fn(&[u8]) -> Option<T>,
    encode: impl Fn(&T) -> Vec<u8>,
    mut update: impl FnMut(Option<T>) -> Option<T>,
) -> CasOutcome<T> {
    for _ in 0..attempts.max(1) {
        let (current, cas) = match host.get(key) {
            Ok(Some((bytes, cas))) => (decode(&bytes), cas),
            Ok(None) => (None, 0),
            Err(status) => return CasOutcome::HostError(status),
        };
        let Some(next) = update(current) else {
            return CasOutcome::Unchanged;
        };
        match host.set(key, &encode(&next), cas) {
            Ok(()) => return CasOutcome::Written(next),
            Err(SetError::CasMismatch) => continue,
            Err(SetError::Host(status)) => return CasOutcome::HostError(status),
        }
    }
    CasOutcome::GaveUp
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
        let add = |v: Option<u32>| Some(v.unwrap_or(0) + 1);
        assert_eq!(
            cas_update(&h, "n", 3, dec, enc, add),
            CasOutcome::Written(1)
        );
        h.force_mismatches(2);
        assert_eq!(
            cas_update(&h, "n", 3, dec, enc, add),
            CasOutcome::Written(2)
        );
        h.force_mismatches(3);
        assert_eq!(cas_update(&h, "n", 3, dec, enc, add), CasOutcome::GaveUp);
        assert_eq!(dec(&h.value("n").unwrap()), Some(2));
        assert_eq!(
            cas_update(&h, "n", 3, dec, enc, |_| None),
            CasOutcome::Unchanged
        );
    }

    #[test]
    fn keys_are_namespaced_and_stable() {
        assert_eq!(
            endpoint_key("10.0.0.1:8000"),
            "prefixroute/ep/10.0.0.1:8000"
        );
        assert_eq!(bucket_key(16, 0xbeef), "prefixroute/ix/16/beef");
        assert_eq!(instance_key(3), "prefixroute/ledger/3");
    }
}
