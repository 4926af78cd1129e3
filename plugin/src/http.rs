//! The HTTP context: one per request. Pause on headers, buffer the body, decide, set the
//! destination header, resume; at the response headers (the first byte) release the request's
//! prefill work, let the endpoint's prefill model learn how long it took, and explain the
//! decision in response headers; release the in-flight count when the stream ends.
//!
//! Every host call here goes through [`crate::abi`] and every failure degrades to a fallback
//! choice (or to no destination, which Envoy's override_host `fallback_policy` handles) plus a
//! counted metric. Nothing on this path can panic.

use std::cell::RefCell;
use std::fmt::Write as _;
use std::rc::Rc;

use prefixroute_core::config::DEFAULT_DESTINATION_HEADER;
use prefixroute_core::latency::whole_ms;
use prefixroute_core::outlier::CONSECUTIVE_5XX;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};

use crate::abi;
use crate::fallback::FallbackReason;
use crate::host::{self, Metrics};
use crate::root::{flush, SharedScheduler};
use crate::scheduler::{decode_attempt_count, Choice, Route, ATTEMPT_COUNT_PROPERTY};
use crate::settings::{declared_length, is_routable};
use crate::stats::{Event, StatNames};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Headers not seen yet, or decided.
    Idle,
    /// Routable request paused on headers; buffering the body.
    AwaitingBody {
        buffered: usize,
    },
    Decided,
}

pub struct Filter {
    scheduler: Option<SharedScheduler>,
    metrics: Rc<RefCell<Metrics>>,
    phase: Phase,
    choice: Option<Choice>,
    /// The in-flight count of `choice` was released (stream ended).
    released: bool,
    /// The response's status was 2xx (read with its headers, used at its first byte).
    answered_ok: bool,
}

impl Filter {
    pub fn new(scheduler: Option<SharedScheduler>, metrics: Rc<RefCell<Metrics>>) -> Self {
        Filter {
            scheduler,
            metrics,
            phase: Phase::Idle,
            choice: None,
            released: false,
            answered_ok: false,
        }
    }

    /// Removes the destination header a client may have sent.
    fn remove_destination_header(&self) -> Result<(), u32> {
        let scheduler = self.scheduler.as_ref().and_then(|e| e.try_borrow().ok());
        let name = scheduler.as_ref().map_or(DEFAULT_DESTINATION_HEADER, |e| {
            &e.config().destination_header
        });
        abi::remove_header(MapType::HttpRequestHeaders, name)
    }

    fn max_body_bytes(&self) -> usize {
        self.scheduler
            .as_ref()
            .and_then(|e| e.try_borrow().ok())
            .map_or(usize::MAX, |e| e.config().max_body_bytes)
    }

    fn count(&self, event: Event) {
        let scheduler = self.scheduler.as_ref().and_then(|e| e.try_borrow().ok());
        let unnamed = StatNames::default();
        let names = scheduler.as_ref().map_or(&unnamed, |e| e.stat_names());
        if let Ok(mut m) = self.metrics.try_borrow_mut() {
            m.record(&[event], names);
        }
    }

    /// Decides with `decide`, sets the destination header and records the choice.
    fn steer(
        &mut self,
        decide: impl FnOnce(&mut crate::scheduler::Scheduler<crate::host::HostShared>, u64) -> Choice,
    ) {
        self.phase = Phase::Decided;
        // Without the scheduler (not configured, or a re-entrant call) there is no choice to
        // make: the client's header was already removed, so Envoy's fallback_policy picks.
        let internal = Event::Fallback {
            reason: FallbackReason::Internal,
            endpoint: 0,
        };
        let Some(scheduler) = self.scheduler.clone() else {
            self.count(internal);
            return;
        };
        let Ok(mut e) = scheduler.try_borrow_mut() else {
            self.count(internal);
            return;
        };
        let choice = decide(&mut e, abi::now_ms());
        // No destination (an empty pool): the header stays removed and Envoy's
        // fallback_policy picks.
        let failed = e.destination(&choice).is_some_and(|destination| {
            abi::replace_header(
                MapType::HttpRequestHeaders,
                &e.config().destination_header,
                &destination,
            )
            .is_err()
        });
        flush(&mut e, &self.metrics);
        drop(e);
        self.choice = Some(choice);
        if failed {
            self.count(Event::HeaderError);
        }
    }

    fn fallback(&mut self, reason: FallbackReason) {
        self.steer(|e, now| e.fallback(reason, now));
    }

    fn route_buffered_body(&mut self, size: usize) {
        match abi::get_buffer(BufferType::HttpRequestBody, 0, size) {
            Ok(Some(body)) => self.steer(|e, now| e.route(&body, now)),
            Ok(None) if size == 0 => self.steer(|e, now| e.route(b"", now)),
            _ => self.fallback(FallbackReason::BodyUnavailable),
        }
    }

    fn release(&mut self) {
        if self.released {
            return;
        }
        self.released = true;
        let (Some(choice), Some(scheduler)) = (self.choice.as_ref(), self.scheduler.as_ref())
        else {
            return;
        };
        if let Ok(mut e) = scheduler.try_borrow_mut() {
            e.release(&choice.ticket, abi::now_ms());
            flush(&mut e, &self.metrics);
        }
    }

    /// The response body's first byte arrived (or the response ended without one): the
    /// request's first token. Not its headers: a streaming server sends them as soon as it
    /// accepts the request (vLLM's OpenAI server does, and so does `prefixroute
    /// fake-server`), before the prefill, so timing them taught a prefill of nothing and the
    /// router stopped pricing misses (docs/benchmarks.md: streamed answers with decode time).
    fn first_byte(&mut self) {
        let (Some(choice), Some(scheduler)) = (self.choice.as_mut(), self.scheduler.as_ref())
        else {
            return;
        };
        if choice.ticket.first_byte_ms.is_some() {
            return; // A later chunk of the stream.
        }
        if let Ok(mut e) = scheduler.try_borrow_mut() {
            e.first_byte(&mut choice.ticket, self.answered_ok, abi::now_ms());
            flush(&mut e, &self.metrics);
        }
    }
}

impl Context for Filter {
    fn on_done(&mut self) -> bool {
        self.release();
        true
    }
}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.count(Event::Request);
        // Drop any client-supplied destination first: whatever happens next, a client never
        // picks the upstream host.
        if self.remove_destination_header().is_err() {
            self.count(Event::HeaderError);
        }
        let header = |name| {
            abi::get_header_string(MapType::HttpRequestHeaders, name)
                .ok()
                .flatten()
                .unwrap_or_default()
        };
        if !is_routable(&header(":method"), &header(":path")) {
            self.fallback(FallbackReason::NotRoutable);
            return Action::Continue;
        }
        if end_of_stream {
            self.fallback(FallbackReason::NoBody);
            return Action::Continue;
        }
        // A body declared larger than the plugin reads is never held: once held, Envoy adds
        // each chunk it reads to the held body before the plugin sees it, and a chunk can be
        // as large as the listener's buffer (a read drains the socket up to it), so a held
        // body plus one read could pass Envoy's limit and be answered 413 before the plugin
        // lets it go (seen under CPU load with a 1.5 MiB body). A body without a length
        // (chunked) is still held up to `max_body_bytes`.
        if declared_length(&header("content-length")).is_some_and(|n| n > self.max_body_bytes()) {
            self.fallback(FallbackReason::BodyTooLarge);
            return Action::Continue;
        }
        // Wait for the body (needs `allow_on_headers_stop_iteration: true` in Envoy ≥ 1.35).
        self.phase = Phase::AwaitingBody { buffered: 0 };
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !matches!(self.phase, Phase::AwaitingBody { .. }) {
            return Action::Continue;
        }
        // `body_size` is the total buffered so far.
        self.phase = Phase::AwaitingBody {
            buffered: body_size,
        };
        if body_size > self.max_body_bytes() {
            self.fallback(FallbackReason::BodyTooLarge);
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.route_buffered_body(body_size);
        Action::Continue
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        // A body that ends with trailers: the body callbacks never saw end_of_stream.
        if let Phase::AwaitingBody { buffered } = self.phase {
            self.route_buffered_body(buffered);
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let status = abi::get_header_string(MapType::HttpResponseHeaders, ":status")
            .ok()
            .flatten()
            .and_then(|s| s.trim().parse::<u32>().ok());
        let attempts = self.choice.as_ref().map_or(1, |_| attempts());
        // The chosen endpoint's answer, the only one whose times teach its prefill rate and
        // decode hold: after a retry another replica answered, and Envoy's back-off waited.
        self.answered_ok = attempts <= 1 && status.is_some_and(|s| (200..300).contains(&s));
        if let (Some(status), Some(choice), Some(scheduler)) =
            (status, self.choice.as_ref(), self.scheduler.as_ref())
        {
            if let Ok(mut e) = scheduler.try_borrow_mut() {
                let now = abi::now_ms();
                e.answered(choice, attempts, status, now, |e, endpoint, for_ms| {
                    host::warn(&format!(
                        "prefixroute: endpoint {} ({}) failed {CONSECUTIVE_5XX} requests in a \
                         row; out of rotation for {} s",
                        e.name(endpoint),
                        e.address(endpoint),
                        for_ms / 1000
                    ));
                });
                flush(&mut e, &self.metrics);
            }
        }
        if end_of_stream {
            self.first_byte();
        }
        let (Some(choice), Some(scheduler)) = (self.choice.as_ref(), self.scheduler.as_ref())
        else {
            return Action::Continue;
        };
        let Ok(e) = scheduler.try_borrow() else {
            return Action::Continue;
        };
        // Each header written as it is made, without a list of them; the numbers through one
        // buffer (an allocation per header showed in the instruction counts).
        let put = |header: &str, value: &str| {
            if abi::replace_header(MapType::HttpResponseHeaders, header, value).is_err() {
                self.count(Event::HeaderError);
            }
        };
        // The endpoint that answered: the chosen one, or the one Envoy's retries reached. No
        // name: the pool was empty (none discovered yet) or the retries went past the list, and
        // Envoy's fallback_policy chose.
        let name = choice.answered_by(attempts).map_or("", |a| e.name(a));
        if !name.is_empty() {
            put("x-prefixroute-endpoint", name);
        }
        drop(e);
        match choice.route {
            Route::Routed {
                policy,
                matched_blocks,
                total_blocks,
                prediction,
                ..
            } => {
                put("x-prefixroute-policy", policy.name());
                let mut value = String::with_capacity(24);
                let mut put_value = |header: &str, args: std::fmt::Arguments| {
                    value.clear();
                    // Writing to a String cannot fail.
                    let _ = value.write_fmt(args);
                    put(header, &value);
                };
                put_value(
                    "x-prefixroute-match",
                    format_args!("{matched_blocks}/{total_blocks}"),
                );
                if let Some(p) = prediction {
                    put_value(
                        "x-prefixroute-uncached-tokens",
                        format_args!("{}", p.uncached_tokens),
                    );
                    put_value(
                        "x-prefixroute-queue-ms",
                        format_args!("{}", whole_ms(p.queue_ms)),
                    );
                    put_value(
                        "x-prefixroute-ttft-ms",
                        format_args!("{}", whole_ms(p.ttft_ms)),
                    );
                }
            }
            Route::Fallback(reason) => {
                put("x-prefixroute-policy", "fallback");
                put("x-prefixroute-fallback", reason.name());
            }
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if body_size > 0 || end_of_stream {
            self.first_byte();
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.release();
    }
}

/// How many tries Envoy's router made for this response: Envoy's `upstream.request_attempt_count`
/// attribute (Envoy 1.33 and later, so every Envoy this filter runs on, whatever the route's
/// configuration; the `x-envoy-attempt-count` header needed `include_attempt_count_in_response`
/// on the virtual host, which Envoy Gateway's policies do not offer). 1 when it is missing.
fn attempts() -> u32 {
    abi::get_property(ATTEMPT_COUNT_PROPERTY)
        .ok()
        .flatten()
        .as_deref()
        .and_then(decode_attempt_count)
        .unwrap_or(1)
}
