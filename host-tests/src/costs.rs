//! What the guest cost the host, counted exactly: wasm instructions (wasmtime fuel), host calls
//! by name, and bytes crossing the VM boundary. Everything is attributed to the context of the
//! callback that was running, so a request's costs are the sum over its HTTP context's
//! callbacks, and a root context's costs are its ticks and callout responses.

use std::collections::BTreeMap;
use std::ops::AddAssign;

/// Costs of one callback, one context, or any sum of them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Costs {
    /// Wasm instructions executed (wasmtime fuel: 1 per operator, 0 for nop/drop/block/loop
    /// markers; a `memory.copy` or `memory.fill` is one, see [`crate::Fuel`]).
    pub fuel: u64,
    /// Callbacks the host made into the guest (`proxy_on_*`, not allocations).
    pub callbacks: u64,
    /// Host calls by import name; `proxy_on_memory_allocate` counts the host's allocations in
    /// the guest (one per buffer the host hands over).
    pub host_calls: BTreeMap<String, u64>,
    /// Bytes the host copied into guest memory (values, bodies, headers).
    pub bytes_in: u64,
    /// Bytes the host read out of guest memory (keys, values, messages).
    pub bytes_out: u64,
    /// Shared-data value bytes copied into the guest by `proxy_get_shared_data`.
    pub shared_bytes_in: u64,
    /// Shared-data value bytes copied out of the guest by `proxy_set_shared_data`.
    pub shared_bytes_out: u64,
}

impl Costs {
    /// Host calls of every kind, allocations excluded.
    pub fn total_host_calls(&self) -> u64 {
        self.host_calls
            .iter()
            .filter(|(k, _)| k.as_str() != ALLOCATE)
            .map(|(_, n)| n)
            .sum()
    }

    pub fn calls(&self, name: &str) -> u64 {
        self.host_calls.get(name).copied().unwrap_or(0)
    }
}

pub(crate) const ALLOCATE: &str = "proxy_on_memory_allocate";

impl AddAssign<&Costs> for Costs {
    fn add_assign(&mut self, other: &Costs) {
        self.fuel += other.fuel;
        self.callbacks += other.callbacks;
        for (k, n) in &other.host_calls {
            *self.host_calls.entry(k.clone()).or_default() += n;
        }
        self.bytes_in += other.bytes_in;
        self.bytes_out += other.bytes_out;
        self.shared_bytes_in += other.shared_bytes_in;
        self.shared_bytes_out += other.shared_bytes_out;
    }
}

/// Costs of one context: the total and a breakdown by callback name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContextCosts {
    pub total: Costs,
    pub by_callback: BTreeMap<&'static str, Costs>,
}
