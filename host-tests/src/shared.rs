//! Envoy's shared data: one key-value store per `vm_id`, shared by every VM instance (every
//! worker thread) of the process, behind one lock.
//!
//! Semantics copied from proxy-wasm-cpp-host's `SharedData`:
//! * a value carries a CAS token from one process-wide counter that starts at 1 and skips 0;
//! * `set` with a non-zero CAS on an *existing* key fails with `CasMismatch` unless the token
//!   matches; on a *missing* key the CAS is ignored and the key is created;
//! * keys are never deleted.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::abi::Status;

/// One `vm_id`'s keys: value and CAS token.
type KeyValues = BTreeMap<Vec<u8>, (Vec<u8>, u32)>;

#[derive(Debug, Default)]
struct Inner {
    by_vm: BTreeMap<String, KeyValues>,
    next_cas: u32,
    /// Make the next N conditional writes to existing keys lose a race (see [`SharedStore::interfere`]).
    interfere: u32,
    gets: u64,
    sets: u64,
    mismatches: u64,
}

/// The process-wide shared data, cloned into every VM of a [`crate::Host`].
#[derive(Debug, Clone)]
pub struct SharedStore {
    inner: Arc<Mutex<Inner>>,
}

impl Default for SharedStore {
    fn default() -> Self {
        SharedStore {
            inner: Arc::new(Mutex::new(Inner {
                next_cas: 1,
                ..Inner::default()
            })),
        }
    }
}

impl SharedStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A test that panicked while holding the lock must not hide the original panic.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The value and CAS token of `key`, `None` when absent.
    pub fn get(&self, vm_id: &str, key: &[u8]) -> Option<(Vec<u8>, u32)> {
        let mut inner = self.lock();
        inner.gets += 1;
        inner.by_vm.get(vm_id)?.get(key).cloned()
    }

    /// Writes `value` unless `cas` is non-zero, the key exists and its token differs.
    pub fn set(&self, vm_id: &str, key: &[u8], value: &[u8], cas: u32) -> Status {
        let mut inner = self.lock();
        inner.sets += 1;
        let exists = inner.by_vm.get(vm_id).is_some_and(|m| m.contains_key(key));
        if cas != 0 && exists && inner.interfere > 0 {
            // Another worker wrote the key between the guest's get and this set: same value,
            // new token, exactly what a concurrent CAS write would leave behind.
            inner.interfere -= 1;
            let token = next_cas(&mut inner);
            if let Some(slot) = inner.by_vm.get_mut(vm_id).and_then(|m| m.get_mut(key)) {
                slot.1 = token;
            }
        }
        let token = match inner.by_vm.get(vm_id).and_then(|m| m.get(key)) {
            Some((_, current)) if cas != 0 && cas != *current => {
                inner.mismatches += 1;
                return Status::CasMismatch;
            }
            _ => next_cas(&mut inner),
        };
        inner
            .by_vm
            .entry(vm_id.to_string())
            .or_default()
            .insert(key.to_vec(), (value.to_vec(), token));
        Status::Ok
    }

    /// Makes the next `n` conditional writes to existing keys fail with `CasMismatch`, as if
    /// another worker had written each key between the guest's read and its write. Envoy's
    /// workers are threads, so this interleaving happens inside one callback; a sequential
    /// host can only reproduce it this way.
    pub fn interfere(&self, n: u32) {
        self.lock().interfere = n;
    }

    /// Every key of `vm_id`, sorted.
    pub fn keys(&self, vm_id: &str) -> Vec<Vec<u8>> {
        self.lock()
            .by_vm
            .get(vm_id)
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Keys of `vm_id` that start with `prefix`, with their values.
    pub fn scan(&self, vm_id: &str, prefix: &str) -> Vec<(String, Vec<u8>)> {
        self.lock()
            .by_vm
            .get(vm_id)
            .map(|m| {
                m.iter()
                    .filter(|(k, _)| k.starts_with(prefix.as_bytes()))
                    .map(|(k, (v, _))| (String::from_utf8_lossy(k).into_owned(), v.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Total bytes of keys and values held for `vm_id`.
    pub fn footprint(&self, vm_id: &str) -> usize {
        self.lock()
            .by_vm
            .get(vm_id)
            .map(|m| m.iter().map(|(k, (v, _))| k.len() + v.len()).sum())
            .unwrap_or(0)
    }

    /// (gets, sets, CAS mismatches) over all VMs so far.
    pub fn counters(&self) -> (u64, u64, u64) {
        let inner = self.lock();
        (inner.gets, inner.sets, inner.mismatches)
    }
}

fn next_cas(inner: &mut Inner) -> u32 {
    let token = inner.next_cas;
    inner.next_cas = inner.next_cas.wrapping_add(1);
    if inner.next_cas == 0 {
        inner.next_cas = 1;
    }
    token
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envoy_cas_semantics() {
        let s = SharedStore::new();
        assert_eq!(s.get("vm", b"k"), None);
        // CAS is ignored on a missing key.
        assert_eq!(s.set("vm", b"k", b"a", 12345), Status::Ok);
        let (v, cas) = s.get("vm", b"k").unwrap();
        assert_eq!((v.as_slice(), cas), (&b"a"[..], 1));
        assert_eq!(s.set("vm", b"k", b"b", cas + 1), Status::CasMismatch);
        assert_eq!(s.set("vm", b"k", b"b", cas), Status::Ok);
        assert_eq!(s.set("vm", b"k", b"c", cas), Status::CasMismatch, "stale");
        assert_eq!(s.set("vm", b"k", b"d", 0), Status::Ok, "unconditional");
        assert_eq!(s.get("vm", b"k").unwrap().0, b"d");
        // Stores are per vm_id.
        assert_eq!(s.get("other", b"k"), None);
        assert_eq!(s.counters().2, 2);
    }

    #[test]
    fn interference_bumps_the_token_once_per_write() {
        let s = SharedStore::new();
        s.set("vm", b"k", b"a", 0);
        let (_, cas) = s.get("vm", b"k").unwrap();
        s.interfere(1);
        assert_eq!(s.set("vm", b"k", b"b", cas), Status::CasMismatch);
        let (v, cas) = s.get("vm", b"k").unwrap();
        assert_eq!(v, b"a");
        assert_eq!(s.set("vm", b"k", b"b", cas), Status::Ok);
        // Unconditional writes and new keys are never interfered with.
        s.interfere(1);
        assert_eq!(s.set("vm", b"k", b"c", 0), Status::Ok);
        assert_eq!(s.set("vm", b"new", b"c", 99), Status::Ok);
    }
}
