//! The host behind the scheduler's abstractions: shared data and Envoy stats.

use proxy_wasm::types::{LogLevel, MetricType};

use crate::abi;
use crate::shared::{SetError, SharedData};
use crate::stats::{updates, Event, Kind, MetricIds, Op, StatNames};

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

/// Envoy's stats: what [`MetricIds`] says to send for each update (the metric defined on
/// first use; an increment, or a gauge's new value).
#[derive(Debug, Default)]
pub struct Metrics {
    ids: MetricIds,
}

impl Metrics {
    pub fn record(&mut self, events: &[Event], names: &StatNames) {
        self.ids.follow(names.generation);
        for event in events {
            updates(event, |u| {
                let sent = self.ids.settle(u, &names.names, |kind, name| {
                    let kind = match kind {
                        Kind::Counter => MetricType::Counter,
                        Kind::Gauge => MetricType::Gauge,
                    };
                    // A metric the host refuses is skipped, never fatal.
                    abi::define_metric(kind, name).ok()
                });
                let _ = match sent {
                    None => Ok(()),
                    Some((id, Op::Add(n))) => {
                        abi::increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX))
                    }
                    Some((id, Op::Set(v))) => abi::record_metric(id, v),
                };
            });
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
