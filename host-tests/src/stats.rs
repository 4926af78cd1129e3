//! Envoy's stats store as the plugin's metrics reach it: process-wide, by name. Each VM defines
//! its own ids for a name (as Envoy does), and all of them update the same stat, so counters
//! from every worker add up and a gauge holds the last value any worker recorded.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::abi::{MetricKind, Status};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Metric {
    pub kind: MetricKind,
    /// Counters and gauges; for a histogram, the last recorded value.
    pub value: i64,
    /// Histogram samples recorded.
    pub samples: u64,
}

/// Process-wide stats, shared by every VM of a [`crate::Host`].
#[derive(Debug, Clone, Default)]
pub struct Stats {
    inner: Arc<Mutex<BTreeMap<String, Metric>>>,
}

impl Stats {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Metric>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Creates the stat if needed. A name defined again with another kind keeps its first
    /// kind, as Envoy's store would refuse a second stat of that name.
    pub(crate) fn define(&self, kind: MetricKind, name: &str) {
        self.lock().entry(name.to_string()).or_insert(Metric {
            kind,
            value: 0,
            samples: 0,
        });
    }

    /// `proxy_increment_metric`: counters only go up (Envoy refuses a negative delta).
    pub(crate) fn increment(&self, name: &str, delta: i64) -> Status {
        let mut map = self.lock();
        let Some(m) = map.get_mut(name) else {
            return Status::NotFound;
        };
        match m.kind {
            MetricKind::Counter if delta < 0 => Status::BadArgument,
            MetricKind::Histogram => Status::BadArgument,
            _ => {
                m.value = m.value.saturating_add(delta);
                Status::Ok
            }
        }
    }

    /// `proxy_record_metric`: a counter adds the value, a gauge takes it, a histogram samples it.
    pub(crate) fn record(&self, name: &str, value: u64) -> Status {
        let mut map = self.lock();
        let Some(m) = map.get_mut(name) else {
            return Status::NotFound;
        };
        let value = i64::try_from(value).unwrap_or(i64::MAX);
        match m.kind {
            MetricKind::Counter => m.value = m.value.saturating_add(value),
            MetricKind::Gauge => m.value = value,
            MetricKind::Histogram => {
                m.value = value;
                m.samples += 1;
            }
        }
        Status::Ok
    }

    pub fn get(&self, name: &str) -> Option<Metric> {
        self.lock().get(name).copied()
    }

    /// The value of a stat, 0 when it was never defined (a counter nobody incremented).
    pub fn value(&self, name: &str) -> i64 {
        self.get(name).map_or(0, |m| m.value)
    }

    pub fn snapshot(&self) -> BTreeMap<String, Metric> {
        self.lock().clone()
    }
}
