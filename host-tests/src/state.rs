//! The host-side state of one VM instance (wasmtime's store data): what Envoy keeps per Wasm VM
//! and per context, plus the handles to the process-wide parts it shares with other VMs.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use wasmtime::{Memory, TypedFunc};

use crate::abi::{Headers, MetricKind};
use crate::capture::{Capture, LocalReply};
use crate::clock::Clock;
use crate::costs::{ContextCosts, Costs};
use crate::shared::SharedStore;
use crate::stats::Stats;
use crate::HostOptions;

/// One HTTP stream (request/response pair) as the host sees it: what the client sent, what the
/// guest may currently read and write, and what has been forwarded on each side.
#[derive(Debug, Clone, Default)]
pub struct StreamState {
    /// The request headers as they are now (the guest's edits included).
    pub request_headers: Headers,
    pub request_trailers: Headers,
    pub response_headers: Headers,
    pub response_trailers: Headers,
    /// Request body the host holds for the guest: the current chunk, or everything buffered
    /// since the guest started returning Pause.
    pub request_body: Vec<u8>,
    pub response_body: Vec<u8>,
    /// The guest returned Pause from the request headers; they wait for a Continue.
    pub request_headers_held: bool,
    pub response_headers_held: bool,
    pub request_trailers_received: bool,
    pub response_trailers_received: bool,
    /// The client finished the request (end of stream seen on headers, body or trailers).
    pub request_complete: bool,
    /// Body that arrived while the headers were held and the host would not deliver it (Envoy
    /// without `allow_on_headers_stop_iteration`).
    pub undelivered_body: Vec<u8>,
    /// The request headers that went upstream: `None` until they are forwarded.
    pub upstream_headers: Option<Headers>,
    pub upstream_body: Vec<u8>,
    pub upstream_trailers: Option<Headers>,
    pub upstream_complete: bool,
    /// The response headers that went downstream.
    pub downstream_headers: Option<Headers>,
    pub downstream_body: Vec<u8>,
    pub local_reply: Option<LocalReply>,
    /// The guest closed (reset) the request or response stream.
    pub closed: bool,
    /// The context was deleted (`proxy_on_delete` ran).
    pub deleted: bool,
    /// Attributes Envoy resolves per stream (`proxy_get_property` paths, segments joined by
    /// NUL), read before the VM-wide ones: e.g. `upstream.request_attempt_count`.
    pub properties: BTreeMap<Vec<u8>, Vec<u8>>,
}

impl StreamState {
    /// Forwards held request headers (and whatever body and trailers are held behind them).
    pub(crate) fn forward_request(&mut self) {
        if self.upstream_headers.is_none() {
            self.upstream_headers = Some(self.request_headers.clone());
            self.request_headers_held = false;
        }
        self.upstream_body.append(&mut self.request_body);
        if self.request_trailers_received && self.upstream_trailers.is_none() {
            self.upstream_trailers = Some(self.request_trailers.clone());
        }
        if self.request_complete {
            self.upstream_complete = true;
        }
    }

    pub(crate) fn forward_response(&mut self) {
        if self.downstream_headers.is_none() {
            self.downstream_headers = Some(self.response_headers.clone());
            self.response_headers_held = false;
        }
        self.downstream_body.append(&mut self.response_body);
    }

    /// The request went nowhere and never will without a `proxy_continue_stream`: the client
    /// has sent everything, yet nothing (or not everything) went upstream.
    pub fn stalled(&self) -> bool {
        self.request_complete
            && !self.upstream_complete
            && self.local_reply.is_none()
            && !self.closed
    }
}

/// The response of a callout while its `proxy_on_http_call_response` runs.
#[derive(Debug, Clone)]
pub(crate) struct CallResponse {
    pub headers: Headers,
    pub body: Vec<u8>,
    pub trailers: Headers,
}

/// Which callback is running and for which context.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Active {
    pub context_id: u32,
    pub callback: &'static str,
}

pub(crate) struct VmState {
    pub options: Arc<HostOptions>,
    /// The shared-data namespace (Envoy's `vm_id`).
    pub vm_id: String,
    pub shared: SharedStore,
    pub stats: Stats,
    pub clock: Clock,
    /// Callout tokens are unique per host so an answer can never reach the wrong VM.
    pub tokens: Arc<AtomicU32>,
    pub memory: Option<Memory>,
    pub allocate: Option<TypedFunc<i32, i32>>,
    pub vm_configuration: Vec<u8>,
    pub plugin_configuration: Vec<u8>,
    pub root_context_id: u32,
    pub active: Option<Active>,
    /// Set by `proxy_set_effective_context`; reset to the active context on every callback.
    pub effective_context: u32,
    pub streams: BTreeMap<u32, StreamState>,
    pub call_response: Option<CallResponse>,
    /// What `proxy_get_status` reports.
    pub status: (u32, String),
    pub metric_ids: BTreeMap<u32, (MetricKind, String)>,
    pub next_metric: u32,
    pub tick_period_ms: u32,
    pub properties: BTreeMap<Vec<u8>, Vec<u8>>,
    pub capture: Capture,
    /// Costs of the callback that is running.
    pub running: Costs,
    pub costs: BTreeMap<u32, ContextCosts>,
    /// Partial lines written to stdout / stderr.
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub rng: u64,
    /// While recording ([`crate::Vm::record_execution`]): each `env.log_execution(id)` call of
    /// a module instrumented by binaryen's `wasm-opt --log-execution`, with the fuel left.
    pub execution: Option<Vec<(u32, u64)>>,
}

impl VmState {
    pub fn new(
        options: Arc<HostOptions>,
        shared: SharedStore,
        stats: Stats,
        clock: Clock,
        tokens: Arc<AtomicU32>,
        vm_index: u32,
        vm_id: String,
    ) -> Self {
        let mut properties = BTreeMap::new();
        properties.insert(
            b"plugin_name".to_vec(),
            options.plugin_name.as_bytes().to_vec(),
        );
        properties.insert(b"plugin_vm_id".to_vec(), vm_id.as_bytes().to_vec());
        properties.insert(
            b"plugin_root_id".to_vec(),
            options.root_id.as_bytes().to_vec(),
        );
        VmState {
            rng: options.seed ^ (u64::from(vm_index) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            options,
            vm_id,
            shared,
            stats,
            clock,
            tokens,
            memory: None,
            allocate: None,
            vm_configuration: Vec::new(),
            plugin_configuration: Vec::new(),
            root_context_id: 0,
            active: None,
            effective_context: 0,
            streams: BTreeMap::new(),
            call_response: None,
            status: (0, String::new()),
            metric_ids: BTreeMap::new(),
            next_metric: 1,
            tick_period_ms: 0,
            properties,
            capture: Capture::default(),
            running: Costs::default(),
            costs: BTreeMap::new(),
            stdout: Vec::new(),
            stderr: Vec::new(),
            execution: None,
        }
    }

    pub fn next_token(&self) -> u32 {
        self.tokens.fetch_add(1, Ordering::SeqCst)
    }

    /// The context the running callback acts for (0 outside callbacks).
    pub fn context_id(&self) -> u32 {
        self.active.map_or(0, |a| a.context_id)
    }

    pub fn callback(&self) -> &'static str {
        self.active.map_or("", |a| a.callback)
    }

    pub fn count(&mut self, name: &str) {
        *self.running.host_calls.entry(name.to_string()).or_default() += 1;
    }

    /// xorshift64*: deterministic randomness for `random_get`, so runs (and fuel) repeat.
    pub fn random_byte(&mut self) -> u8 {
        let mut x = self.rng.max(1);
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
    }
}
