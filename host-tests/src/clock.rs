//! The host's clock: what `proxy_get_current_time_nanoseconds` and WASI `clock_time_get` return.
//!
//! Envoy hands out wall-clock time. Here time only moves when a test moves it, so a scrape
//! interval, a staleness limit or a heartbeat expiry can be crossed to the millisecond, and a run
//! is the same every time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A settable clock shared by every VM of a [`crate::Host`] (all workers see one time).
#[derive(Debug, Clone)]
pub struct Clock {
    ns: Arc<AtomicU64>,
}

impl Clock {
    /// Starts at `start_ms`. Far from zero by default (see [`crate::HostOptions`]): the plugin
    /// treats a time of 0 as "never".
    pub fn new(start_ms: u64) -> Self {
        Clock {
            ns: Arc::new(AtomicU64::new(start_ms.saturating_mul(1_000_000))),
        }
    }

    pub fn now_ns(&self) -> u64 {
        self.ns.load(Ordering::SeqCst)
    }

    pub fn now_ms(&self) -> u64 {
        self.now_ns() / 1_000_000
    }

    pub fn set_ms(&self, ms: u64) {
        self.ns
            .store(ms.saturating_mul(1_000_000), Ordering::SeqCst);
    }

    pub fn advance_ms(&self, ms: u64) {
        self.ns
            .fetch_add(ms.saturating_mul(1_000_000), Ordering::SeqCst);
    }
}
