//! One VM instance of the plugin: what Envoy runs per worker thread (plus one on the main
//! thread). It drives the proxy-wasm lifecycle exactly like Envoy does and keeps what the
//! guest did to each stream.

use std::collections::BTreeMap;

use wasmtime::{Instance, Store, WasmParams, WasmResults};

use crate::abi::{Action, Headers, LogLevel, Status};
use crate::capture::{Callout, Capture, LocalReply};
use crate::costs::{ContextCosts, Costs};
use crate::state::{Active, CallResponse, StreamState, VmState};

/// How a callout is answered (`proxy_on_http_call_response`), with Envoy's semantics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CalloutReply {
    /// A response from the upstream.
    Response {
        status: u16,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    },
    /// The callout's timeout fired. Envoy's async client answers this itself, through the router's
    /// local reply: `504` with the body `upstream request timeout`, so the guest sees headers.
    Timeout,
    /// No connection to the upstream: Envoy's local reply `503`.
    ConnectFailure,
    /// The stream was reset (Envoy's `onHttpCallFailure`): the callback gets 0 headers, 0 body
    /// bytes, and `proxy_get_status` reports `BrokenConnection` / `"reset"`.
    Reset,
}

impl CalloutReply {
    pub fn ok(body: impl Into<Vec<u8>>) -> Self {
        CalloutReply::Response {
            status: 200,
            headers: vec![("content-type".into(), "text/plain; version=0.0.4".into())],
            body: body.into(),
        }
    }

    pub fn status(status: u16, body: impl Into<Vec<u8>>) -> Self {
        CalloutReply::Response {
            status,
            headers: Vec::new(),
            body: body.into(),
        }
    }

    /// The response the guest sees (`None` for a reset), and what `proxy_get_status` reports.
    fn into_response(self) -> (Option<CallResponse>, (u32, String)) {
        let local = |status: u16, body: &str| CalloutReply::Response {
            status,
            headers: vec![
                ("content-length".into(), body.len().to_string()),
                ("content-type".into(), "text/plain".into()),
            ],
            body: body.as_bytes().to_vec(),
        };
        match self {
            CalloutReply::Timeout => local(504, "upstream request timeout").into_response(),
            CalloutReply::ConnectFailure => local(
                503,
                "upstream connect error or disconnect/reset before headers. reset reason: connection failure",
            )
            .into_response(),
            CalloutReply::Reset => (None, (Status::BrokenConnection as u32, "reset".into())),
            CalloutReply::Response {
                status,
                headers,
                body,
            } => {
                let mut h = Headers::new();
                h.add(":status", status.to_string().as_bytes());
                for (k, v) in headers {
                    h.add(&k, v.as_bytes());
                }
                let response = CallResponse {
                    headers: h,
                    body,
                    trailers: Headers::new(),
                };
                (Some(response), (u32::from(status), String::new()))
            }
        }
    }
}

/// How a request body reaches the filter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chunks {
    Whole,
    /// Chunks of this many bytes (the last one shorter).
    Every(usize),
    /// Split at these offsets (sorted, within the body).
    At(Vec<usize>),
}

/// A client request to send through the filter.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
    pub chunks: Chunks,
    pub trailers: Option<Headers>,
}

impl Request {
    pub fn new(method: &str, path: &str, body: impl Into<Vec<u8>>) -> Self {
        Request {
            method: method.into(),
            path: path.into(),
            headers: Vec::new(),
            body: body.into(),
            chunks: Chunks::Whole,
            trailers: None,
        }
    }

    pub fn post(path: &str, body: impl Into<Vec<u8>>) -> Self {
        Request::new("POST", path, body)
    }

    /// `POST /v1/chat/completions` with a JSON body.
    pub fn chat(body: impl Into<Vec<u8>>) -> Self {
        Request::post("/v1/chat/completions", body).header("content-type", "application/json")
    }

    pub fn header(mut self, key: &str, value: impl AsRef<[u8]>) -> Self {
        self.headers.push((key.into(), value.as_ref().to_vec()));
        self
    }

    pub fn chunks(mut self, chunks: Chunks) -> Self {
        self.chunks = chunks;
        self
    }

    pub fn trailers(mut self, trailers: Headers) -> Self {
        self.trailers = Some(trailers);
        self
    }

    fn pieces(&self) -> Vec<&[u8]> {
        let b = &self.body[..];
        match &self.chunks {
            Chunks::Whole => vec![b],
            Chunks::Every(n) => b.chunks((*n).max(1)).collect(),
            Chunks::At(offsets) => {
                let mut out = Vec::new();
                let mut from = 0;
                for &at in offsets {
                    let at = at.clamp(from, b.len());
                    out.push(&b[from..at]);
                    from = at;
                }
                out.push(&b[from..]);
                out
            }
        }
    }
}

/// What happened to a request on its way through the filter.
#[derive(Debug, Clone)]
pub struct Exchange {
    pub id: u32,
    /// The filter's answer to each request callback, in order.
    pub actions: Vec<Action>,
    /// The request headers that went upstream (`None`: nothing went upstream).
    pub upstream: Option<Headers>,
    pub upstream_body: Vec<u8>,
    pub local_reply: Option<LocalReply>,
    /// The client sent everything but the request never went (fully) upstream.
    pub stalled: bool,
}

impl Exchange {
    /// Every value of an upstream request header (empty when nothing went upstream).
    pub fn upstream_values(&self, name: &str) -> Vec<String> {
        self.upstream.as_ref().map_or_else(Vec::new, |h| {
            h.get_all(name)
                .into_iter()
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .collect()
        })
    }
}

/// A request sent, answered by the upstream with 200, and finished.
#[derive(Debug, Clone)]
pub struct RoundTrip {
    pub exchange: Exchange,
    /// The response headers that went downstream.
    pub response: Headers,
    /// Everything the request cost, over all its callbacks.
    pub costs: ContextCosts,
}

impl RoundTrip {
    pub fn response_header(&self, name: &str) -> Option<String> {
        self.response.get_str(name)
    }
}

pub struct Vm {
    store: Store<VmState>,
    instance: Instance,
    index: u32,
    next_context: u32,
    trapped: Option<String>,
}

impl Vm {
    pub(crate) fn new(store: Store<VmState>, instance: Instance, index: u32) -> Vm {
        Vm {
            store,
            instance,
            index,
            next_context: 1,
            trapped: None,
        }
    }

    /// The n-th VM its host created (0-based).
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Why the VM is dead, if a callback trapped (Envoy would answer 503 from now on).
    pub fn trapped(&self) -> Option<&str> {
        self.trapped.as_deref()
    }

    pub fn capture(&self) -> &Capture {
        &self.store.data().capture
    }

    pub fn capture_mut(&mut self) -> &mut Capture {
        &mut self.store.data_mut().capture
    }

    pub fn root_context_id(&self) -> u32 {
        self.store.data().root_context_id
    }

    pub fn tick_period_ms(&self) -> u32 {
        self.store.data().tick_period_ms
    }

    /// Starts recording the calls of `env.log_execution` (a module instrumented by binaryen's
    /// `wasm-opt --log-execution`), forgetting any earlier recording.
    pub fn record_execution(&mut self) {
        self.store.data_mut().execution = Some(Vec::new());
    }

    /// Stops recording and returns what was recorded: each logged point's id with the fuel
    /// left when it was reached, in order.
    pub fn take_execution(&mut self) -> Vec<(u32, u64)> {
        self.store.data_mut().execution.take().unwrap_or_default()
    }

    /// Costs of one context (a request's HTTP context, or the root context).
    pub fn costs(&self, context_id: u32) -> ContextCosts {
        self.store
            .data()
            .costs
            .get(&context_id)
            .cloned()
            .unwrap_or_default()
    }

    /// Costs of every context, by id (0 = outside any callback: `_initialize`).
    pub fn all_costs(&self) -> &BTreeMap<u32, ContextCosts> {
        &self.store.data().costs
    }

    pub fn stream(&self, id: u32) -> Option<&StreamState> {
        self.store.data().streams.get(&id)
    }

    /// Bytes of linear memory the instance has now.
    pub fn memory_bytes(&self) -> usize {
        self.store
            .data()
            .memory
            .map_or(0, |m| m.data_size(&self.store))
    }

    /// Calls a `proxy_on_*` export for `context_id`, measuring fuel and host calls. A missing
    /// export is `Ok(None)` (every callback is optional). A trap kills the VM for good.
    fn call<P: WasmParams, R: WasmResults>(
        &mut self,
        context_id: u32,
        name: &'static str,
        params: P,
    ) -> wasmtime::Result<Option<R>> {
        if let Some(why) = &self.trapped {
            wasmtime::bail!("the VM trapped earlier and is dead: {why}");
        }
        let Some(func) = self.instance.get_func(&mut self.store, name) else {
            return Ok(None);
        };
        let func = func.typed::<P, R>(&self.store)?;
        let limit = self.store.data().options.fuel_per_callback;
        {
            let s = self.store.data_mut();
            s.active = Some(Active {
                context_id,
                callback: name,
            });
            s.effective_context = context_id;
            s.running = Costs::default();
        }
        self.store.set_fuel(limit)?;
        let result = func.call(&mut self.store, params);
        let used = limit - self.store.get_fuel()?;
        let s = self.store.data_mut();
        let mut costs = std::mem::take(&mut s.running);
        costs.fuel = used;
        costs.callbacks = 1;
        let entry = s.costs.entry(context_id).or_default();
        entry.total += &costs;
        *entry.by_callback.entry(name).or_default() += &costs;
        s.active = None;
        s.effective_context = s.root_context_id;
        match result {
            Ok(r) => Ok(Some(r)),
            Err(e) => {
                // The SDK's panic hook logs the panic message just before the trap.
                let last = s
                    .capture
                    .logs
                    .iter()
                    .rev()
                    .find(|l| l.level >= LogLevel::Error)
                    .map_or_else(String::new, |l| {
                        format!(" (last error log: {:?})", l.message)
                    });
                let why = format!("{name}({context_id}) trapped: {e:?}{last}");
                self.trapped = Some(why.clone());
                Err(e.context(why))
            }
        }
    }

    /// Calls any export as a callback of context 0 (for tests of the host with hand-written
    /// modules). `Ok(None)` when the export does not exist.
    pub fn call_export<P: WasmParams, R: WasmResults>(
        &mut self,
        name: &'static str,
        params: P,
    ) -> wasmtime::Result<Option<R>> {
        self.call(0, name, params)
    }

    /// Runs the module's start functions (`_initialize`, then `main` if present; `_start`
    /// otherwise), as Envoy does right after instantiation.
    pub(crate) fn initialize(&mut self) -> wasmtime::Result<()> {
        if self
            .instance
            .get_func(&mut self.store, "_initialize")
            .is_some()
        {
            self.call::<(), ()>(0, "_initialize", ())?;
            if let Some(main) = self.instance.get_func(&mut self.store, "main") {
                if main.typed::<(i32, i32), i32>(&self.store).is_ok() {
                    self.call::<(i32, i32), i32>(0, "main", (0, 0))?;
                }
            }
        } else {
            self.call::<(), ()>(0, "_start", ())?;
        }
        Ok(())
    }

    /// Creates the root context and starts the VM (`proxy_on_context_create(root, 0)`,
    /// `proxy_on_vm_start`). Returns the guest's answer.
    pub fn start(&mut self, vm_configuration: &[u8]) -> wasmtime::Result<bool> {
        let root = self.next_context;
        self.next_context += 1;
        let s = self.store.data_mut();
        s.root_context_id = root;
        s.vm_configuration = vm_configuration.to_vec();
        self.call::<(i32, i32), ()>(root, "proxy_on_context_create", (root as i32, 0))?;
        let ok = self.call::<(i32, i32), i32>(
            root,
            "proxy_on_vm_start",
            (root as i32, vm_configuration.len() as i32),
        )?;
        Ok(ok.is_none_or(|r| r != 0))
    }

    /// `proxy_on_configure` with `configuration` (the plugin's `configuration` bytes, read by
    /// the guest through `proxy_get_buffer_bytes(PLUGIN_CONFIGURATION)`). Starts the VM first
    /// if needed. `false` means Envoy would refuse the filter configuration.
    pub fn configure(&mut self, configuration: &[u8]) -> wasmtime::Result<bool> {
        if self.store.data().root_context_id == 0 {
            self.start(b"")?;
        }
        let root = self.root_context_id();
        self.store.data_mut().plugin_configuration = configuration.to_vec();
        let ok = self.call::<(i32, i32), i32>(
            root,
            "proxy_on_configure",
            (root as i32, configuration.len() as i32),
        )?;
        Ok(ok.is_none_or(|r| r != 0))
    }

    /// One timer tick of the root context, if it asked for a tick period (Envoy never ticks
    /// a root context with period 0). Returns whether it ticked.
    pub fn tick(&mut self) -> wasmtime::Result<bool> {
        if self.tick_period_ms() == 0 {
            return Ok(false);
        }
        let root = self.root_context_id();
        self.call::<i32, ()>(root, "proxy_on_tick", root as i32)?;
        Ok(true)
    }

    /// Callouts the guest made, answered or not.
    pub fn callouts(&self) -> &[Callout] {
        &self.store.data().capture.callouts
    }

    pub fn pending_callouts(&self) -> Vec<Callout> {
        self.capture()
            .pending_callouts()
            .into_iter()
            .cloned()
            .collect()
    }

    /// Answers a pending callout: `proxy_on_http_call_response` on the context that made it.
    pub fn answer_callout(&mut self, token: u32, reply: CalloutReply) -> wasmtime::Result<()> {
        let Some(callout) = self
            .store
            .data_mut()
            .capture
            .callouts
            .iter_mut()
            .find(|c| c.token == token && !c.answered)
        else {
            wasmtime::bail!("no pending callout with token {token} on VM {}", self.index);
        };
        callout.answered = true;
        let context_id = callout.context_id;
        let (response, status) = reply.into_response();
        let (headers, body, trailers) = response.as_ref().map_or((0, 0, 0), |r| {
            (r.headers.len(), r.body.len(), r.trailers.len())
        });
        let s = self.store.data_mut();
        s.call_response = response;
        s.status = status;
        let result = self.call::<(i32, i32, i32, i32, i32), ()>(
            context_id,
            "proxy_on_http_call_response",
            (
                context_id as i32,
                token as i32,
                headers as i32,
                body as i32,
                trailers as i32,
            ),
        );
        let s = self.store.data_mut();
        s.call_response = None;
        s.status = (0, String::new());
        result.map(|_| ())
    }

    /// Answers every pending callout whose timeout has passed with [`CalloutReply::Timeout`],
    /// as Envoy's timers would. Returns how many.
    pub fn expire_callouts(&mut self) -> wasmtime::Result<usize> {
        let now = self.store.data().clock.now_ms();
        let due: Vec<u32> = self
            .capture()
            .pending_callouts()
            .into_iter()
            .filter(|c| c.deadline_ms() <= now)
            .map(|c| c.token)
            .collect();
        for &token in &due {
            self.answer_callout(token, CalloutReply::Timeout)?;
        }
        Ok(due.len())
    }

    /// A new HTTP stream: `proxy_on_context_create(id, root)`.
    pub fn create_stream(&mut self) -> wasmtime::Result<u32> {
        let root = self.root_context_id();
        if root == 0 {
            wasmtime::bail!("start and configure the VM before sending requests");
        }
        let id = self.next_context;
        self.next_context += 1;
        self.store
            .data_mut()
            .streams
            .insert(id, StreamState::default());
        self.call::<(i32, i32), ()>(id, "proxy_on_context_create", (id as i32, root as i32))?;
        Ok(id)
    }

    fn stream_mut(&mut self, id: u32) -> wasmtime::Result<&mut StreamState> {
        match self.store.data_mut().streams.get_mut(&id) {
            Some(s) if !s.deleted => Ok(s),
            _ => wasmtime::bail!("no live stream {id}"),
        }
    }

    /// Request headers arrive. Continue forwards them upstream; Pause holds them (and
    /// everything after them) until a later callback continues.
    pub fn request_headers(
        &mut self,
        id: u32,
        headers: Headers,
        end_of_stream: bool,
    ) -> wasmtime::Result<Action> {
        let n = headers.len();
        let s = self.stream_mut(id)?;
        s.request_headers = headers;
        s.request_complete = end_of_stream;
        let raw = self.call::<(i32, i32, i32), i32>(
            id,
            "proxy_on_request_headers",
            (id as i32, n as i32, i32::from(end_of_stream)),
        )?;
        let action = raw.map_or(Action::Continue, Action::from_raw);
        let s = self.stream_mut(id)?;
        if s.local_reply.is_some() {
            return Ok(action);
        }
        match action {
            Action::Continue => s.forward_request(),
            Action::Pause => s.request_headers_held = true,
        }
        Ok(action)
    }

    /// A request body chunk. The guest sees everything buffered so far (`body_size` is the
    /// total, as in Envoy) while it keeps answering Pause; Continue forwards the held headers
    /// and the buffered body.
    ///
    /// Without `allow_on_headers_stop_iteration`, Envoy does not deliver body to a filter that
    /// paused in the headers: the chunk is kept back and the request hangs.
    pub fn request_body(
        &mut self,
        id: u32,
        chunk: &[u8],
        end_of_stream: bool,
    ) -> wasmtime::Result<Action> {
        let allow = self.store.data().options.allow_on_headers_stop_iteration;
        let s = self.stream_mut(id)?;
        s.request_complete |= end_of_stream;
        if s.request_headers_held && !allow {
            s.undelivered_body.extend_from_slice(chunk);
            return Ok(Action::Pause);
        }
        if s.local_reply.is_some() || s.closed {
            return Ok(Action::Continue);
        }
        s.request_body.extend_from_slice(chunk);
        let size = s.request_body.len();
        let raw = self.call::<(i32, i32, i32), i32>(
            id,
            "proxy_on_request_body",
            (id as i32, size as i32, i32::from(end_of_stream)),
        )?;
        let action = raw.map_or(Action::Continue, Action::from_raw);
        let limit = self.store.data().options.buffer_limit_bytes;
        let s = self.stream_mut(id)?;
        if s.local_reply.is_some() {
            return Ok(action);
        }
        match action {
            Action::Continue => s.forward_request(),
            // Envoy buffers for a paused filter only up to the stream's buffer limit, then
            // answers 413 itself (`request_payload_too_large`).
            Action::Pause if limit.is_some_and(|l| s.request_body.len() > l) => {
                let reply = LocalReply {
                    context_id: id,
                    status_code: 413,
                    details: "request_payload_too_large".into(),
                    body: b"Payload Too Large".to_vec(),
                    headers: Headers::new(),
                    grpc_status: -1,
                };
                s.local_reply = Some(reply.clone());
                self.store.data_mut().capture.local_replies.push(reply);
            }
            Action::Pause => {}
        }
        Ok(action)
    }

    /// Request trailers: the end of a request whose body did not carry end of stream.
    pub fn request_trailers(&mut self, id: u32, trailers: Headers) -> wasmtime::Result<Action> {
        let n = trailers.len();
        let s = self.stream_mut(id)?;
        s.request_trailers = trailers;
        s.request_trailers_received = true;
        s.request_complete = true;
        let raw =
            self.call::<(i32, i32), i32>(id, "proxy_on_request_trailers", (id as i32, n as i32))?;
        let action = raw.map_or(Action::Continue, Action::from_raw);
        let s = self.stream_mut(id)?;
        if action == Action::Continue && s.local_reply.is_none() {
            s.forward_request();
        }
        Ok(action)
    }

    pub fn response_headers(
        &mut self,
        id: u32,
        headers: Headers,
        end_of_stream: bool,
    ) -> wasmtime::Result<Action> {
        let n = headers.len();
        let s = self.stream_mut(id)?;
        s.response_headers = headers;
        let raw = self.call::<(i32, i32, i32), i32>(
            id,
            "proxy_on_response_headers",
            (id as i32, n as i32, i32::from(end_of_stream)),
        )?;
        let action = raw.map_or(Action::Continue, Action::from_raw);
        let s = self.stream_mut(id)?;
        match action {
            Action::Continue => s.forward_response(),
            Action::Pause => s.response_headers_held = true,
        }
        Ok(action)
    }

    /// Envoy's router made `n` tries for stream `id` (retries after the first): its
    /// `upstream.request_attempt_count` attribute, 8 bytes little-endian as Envoy serializes
    /// an integer, for the response callbacks to read. Without it the attribute is absent, as
    /// in an Envoy older than 1.33.
    pub fn set_attempt_count(&mut self, id: u32, n: u64) -> wasmtime::Result<()> {
        self.stream_mut(id)?.properties.insert(
            b"upstream\0request_attempt_count".to_vec(),
            n.to_le_bytes().to_vec(),
        );
        Ok(())
    }

    pub fn response_body(
        &mut self,
        id: u32,
        chunk: &[u8],
        end_of_stream: bool,
    ) -> wasmtime::Result<Action> {
        let s = self.stream_mut(id)?;
        s.response_body.extend_from_slice(chunk);
        let size = s.response_body.len();
        let raw = self.call::<(i32, i32, i32), i32>(
            id,
            "proxy_on_response_body",
            (id as i32, size as i32, i32::from(end_of_stream)),
        )?;
        let action = raw.map_or(Action::Continue, Action::from_raw);
        if action == Action::Continue {
            self.stream_mut(id)?.forward_response();
        }
        Ok(action)
    }

    /// The stream ends (completed or reset): Envoy runs the access-log phase (`proxy_on_log`),
    /// then destroys the filter (`proxy_on_done`, whose answer it ignores for HTTP streams),
    /// then deletes the context (`proxy_on_delete`).
    pub fn finish(&mut self, id: u32) -> wasmtime::Result<()> {
        self.stream_mut(id)?;
        self.call::<i32, ()>(id, "proxy_on_log", id as i32)?;
        self.call::<i32, i32>(id, "proxy_on_done", id as i32)?;
        self.call::<i32, ()>(id, "proxy_on_delete", id as i32)?;
        self.stream_mut(id)?.deleted = true;
        Ok(())
    }

    /// Sends a client request through the filter: headers, body chunks (end of stream on the
    /// last one, or trailers), and reports what went upstream.
    pub fn send(&mut self, request: &Request) -> wasmtime::Result<Exchange> {
        let id = self.create_stream()?;
        let mut headers = Headers::new();
        headers.add(":method", request.method.as_bytes());
        headers.add(":path", request.path.as_bytes());
        headers.add(":authority", b"gateway.local");
        headers.add(":scheme", b"http");
        for (k, v) in &request.headers {
            headers.add(k, v);
        }
        let has_body = !request.body.is_empty();
        let headers_only = !has_body && request.trailers.is_none();
        let mut actions = vec![self.request_headers(id, headers, headers_only)?];
        if has_body {
            let pieces = request.pieces();
            let last = pieces.len() - 1;
            for (i, piece) in pieces.into_iter().enumerate() {
                let eos = i == last && request.trailers.is_none();
                actions.push(self.request_body(id, piece, eos)?);
            }
        }
        if let Some(trailers) = &request.trailers {
            actions.push(self.request_trailers(id, trailers.clone())?);
        }
        let s = self.stream_mut(id)?;
        Ok(Exchange {
            id,
            actions,
            upstream: s.upstream_headers.clone(),
            upstream_body: s.upstream_body.clone(),
            local_reply: s.local_reply.clone(),
            stalled: s.stalled(),
        })
    }

    /// The upstream answers `status` with a small body; returns the headers that went
    /// downstream.
    pub fn respond(&mut self, id: u32, status: u16) -> wasmtime::Result<Headers> {
        let mut h = Headers::new();
        h.add(":status", status.to_string().as_bytes());
        h.add("content-type", b"application/json");
        self.response_headers(id, h, false)?;
        self.response_body(id, b"{\"choices\":[]}", true)?;
        Ok(self
            .stream_mut(id)?
            .downstream_headers
            .clone()
            .unwrap_or_default())
    }

    /// Sends, answers 200, finishes, and returns everything with the request's costs.
    pub fn round_trip(&mut self, request: &Request) -> wasmtime::Result<RoundTrip> {
        let exchange = self.send(request)?;
        let response = self.respond(exchange.id, 200)?;
        self.finish(exchange.id)?;
        Ok(RoundTrip {
            costs: self.costs(exchange.id),
            exchange,
            response,
        })
    }
}
