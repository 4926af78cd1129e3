//! What a VM did that a test may want to look at afterwards: logs, header writes, local replies,
//! metric updates, callouts, stream control calls and calls the host does not implement.

use crate::abi::{Headers, LogLevel, MapType, MetricKind, Status};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    pub level: LogLevel,
    /// The context the line was logged from (0 outside any callback).
    pub context_id: u32,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderOpKind {
    Add,
    Replace,
    Remove,
    SetPairs,
}

/// One header write the guest asked for, and what the host answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderOp {
    pub context_id: u32,
    pub map: MapType,
    pub kind: HeaderOpKind,
    pub key: String,
    pub value: Vec<u8>,
    pub status: Status,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    pub context_id: u32,
    pub status_code: u32,
    pub details: String,
    pub body: Vec<u8>,
    pub headers: Headers,
    pub grpc_status: i32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricOpKind {
    Define(MetricKind),
    Increment(i64),
    Record(u64),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricOp {
    pub context_id: u32,
    pub name: String,
    pub kind: MetricOpKind,
    pub status: Status,
}

/// A `proxy_http_call` the guest made; the test answers it with [`crate::Vm::answer_callout`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Callout {
    pub token: u32,
    /// The context that made the call (its `proxy_on_http_call_response` receives the answer).
    pub context_id: u32,
    pub cluster: String,
    pub headers: Headers,
    pub body: Vec<u8>,
    pub trailers: Headers,
    pub timeout_ms: u32,
    pub sent_at_ms: u64,
    pub answered: bool,
}

impl Callout {
    /// When Envoy would answer it with a timeout.
    pub fn deadline_ms(&self) -> u64 {
        self.sent_at_ms + u64::from(self.timeout_ms)
    }
}

/// Everything captured for one VM, in call order per kind.
#[derive(Debug, Clone, Default)]
pub struct Capture {
    pub logs: Vec<LogLine>,
    pub header_ops: Vec<HeaderOp>,
    pub local_replies: Vec<LocalReply>,
    pub metric_ops: Vec<MetricOp>,
    pub callouts: Vec<Callout>,
    /// (context, stream type) of every `proxy_continue_stream`.
    pub continues: Vec<(u32, i32)>,
    /// (context, stream type) of every `proxy_close_stream`.
    pub closes: Vec<(u32, i32)>,
    /// Imports the host does not implement that the guest called, by module and name.
    pub unimplemented: Vec<(String, String)>,
    /// Tick periods the root context asked for, in order.
    pub tick_periods: Vec<u32>,
}

impl Capture {
    /// Log lines at `level` or above whose text contains `needle`.
    pub fn logs_containing(&self, level: LogLevel, needle: &str) -> Vec<&LogLine> {
        self.logs
            .iter()
            .filter(|l| l.level >= level && l.message.contains(needle))
            .collect()
    }

    /// Callouts not answered yet.
    pub fn pending_callouts(&self) -> Vec<&Callout> {
        self.callouts.iter().filter(|c| !c.answered).collect()
    }
}
