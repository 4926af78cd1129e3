//! The host behind the scheduler's abstractions: shared data and Envoy stats.

use proxy_wasm::types::{LogLevel, MetricType};

use crate::abi;
use crate::shared::{SetError, SharedData};
use crate::stats::{updates, Event, Kind, Op};

/// Envoy's shared data (process-wide for this `vm_id`).
#[derive(Debug, Clone, Copy, Default)]
pub struct HostShared;

impl SharedData for HostShared {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, u32> {
        abi::get_shared(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), SetError> {
        abi::set_shared(key, value, cas).map_err(|s| {
            if s == abi::CAS_MISMATCH {
                SetError::CasMismatch
            } else {
                SetError::Host(s)
            }
        })
    }
}

/// Metric ids by name, defined on first use (each VM defines its own ids for the same Envoy
/// stat, so workers add up in one counter). A vector sorted by (kind, name), searched by
/// bisection: the same lookups as a `BTreeMap` (a tick's gauges at 1,024 endpoints are ten
/// comparisons each) without linking a B-tree into the `.wasm` (this and the scheduler's
/// callouts were the plugin's two `BTreeMap`s: 10 KB).
#[derive(Debug, Default)]
pub struct Metrics {
    ids: Vec<((Kind, String), u32)>,
}

impl Metrics {
    pub fn record(&mut self, events: &[Event], names: &[String]) {
        for event in events {
            for u in updates(event, names) {
                let key = (u.kind, u.name);
                let id = match self.ids.binary_search_by(|(k, _)| k.cmp(&key)) {
                    Ok(at) => self.ids[at].1,
                    Err(at) => {
                        let kind = match key.0 {
                            Kind::Counter => MetricType::Counter,
                            Kind::Gauge => MetricType::Gauge,
                        };
                        // A metric the host refuses is skipped, never fatal.
                        let Ok(id) = abi::define_metric(kind, &key.1) else {
                            continue;
                        };
                        self.ids.insert(at, (key, id));
                        id
                    }
                };
                let _ = match u.op {
                    Op::Add(0) => Ok(()),
                    Op::Add(n) => abi::increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX)),
                    Op::Set(v) => abi::record_metric(id, v),
                };
            }
        }
    }
}

pub fn info(message: &str) {
    abi::log(LogLevel::Info, message);
}

pub fn warn(message: &str) {
    abi::log(LogLevel::Warn, message);
}

pub fn error(message: &str) {
    abi::log(LogLevel::Error, message);
}
