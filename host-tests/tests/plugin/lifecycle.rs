//! Envoy's stream lifecycle as the plugin relies on it: pause in the headers, buffer the body,
//! decide, continue; trailers; body limits; the response decoration; costs per request.

use host_tests::{Action, Chunks, Headers, HostOptions, Request};
use serde_json::json;

use crate::common::{self, chat_body, config, destination, endpoint_of};

#[test]
fn headers_are_held_until_the_body_is_complete_and_leave_with_the_destination() {
    let host = common::host();
    let mut vm = common::configured(&host, &config(3, json!({})));
    let body = chat_body(&common::tenant_prompt(1), "hello");
    let id = vm.create_stream().unwrap();
    let headers = Headers::from_pairs([
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        (":authority", "gw"),
    ]);
    assert_eq!(
        vm.request_headers(id, headers, false).unwrap(),
        Action::Pause
    );
    assert!(vm.stream(id).unwrap().upstream_headers.is_none());
    let (a, b) = body.split_at(body.len() / 2);
    assert_eq!(vm.request_body(id, a, false).unwrap(), Action::Pause);
    assert!(
        vm.stream(id).unwrap().upstream_headers.is_none(),
        "still held"
    );
    assert_eq!(vm.request_body(id, b, true).unwrap(), Action::Continue);
    let s = vm.stream(id).unwrap();
    assert_eq!(
        s.upstream_body, body,
        "the whole body went upstream, unchanged"
    );
    assert!(s.upstream_complete && !s.stalled());
    let dest = s
        .upstream_headers
        .as_ref()
        .unwrap()
        .get_str(common::DEST)
        .unwrap();
    for address in dest.split(',') {
        endpoint_of(address);
    }
    // The header was written while the headers were held, never after they left.
    assert!(vm
        .capture()
        .header_ops
        .iter()
        .all(|op| op.status == host_tests::Status::Ok));
}

#[test]
fn without_allow_on_headers_stop_iteration_the_request_hangs() {
    let host = common::host_with(HostOptions {
        allow_on_headers_stop_iteration: false,
        ..HostOptions::default()
    });
    let mut vm = common::configured(&host, &config(2, json!({})));
    let x = vm.send(&Request::chat(chat_body("s", "q"))).unwrap();
    assert!(
        x.stalled,
        "Envoy never hands the body to a filter paused in the headers"
    );
    assert!(x.upstream.is_none());
    // Requests that do not pause still flow.
    let x = vm
        .send(&Request::new("GET", "/v1/models", Vec::new()))
        .unwrap();
    assert!(!x.stalled && x.upstream.is_some());
}

#[test]
fn a_body_that_ends_with_trailers_is_routed_on_the_trailers() {
    let host = common::host();
    let mut vm = common::configured(&host, &config(3, json!({})));
    let body = chat_body(&common::tenant_prompt(2), "q");
    let warm = common::route(&mut vm, &body);
    let r = Request::chat(body)
        .chunks(Chunks::Every(100))
        .trailers(Headers::from_pairs([("grpc-status", "0")]));
    let x = vm.send(&r).unwrap();
    assert_eq!(x.actions.last(), Some(&Action::Continue));
    assert!(x.actions[..x.actions.len() - 1]
        .iter()
        .all(|a| *a == Action::Pause));
    assert!(!x.stalled);
    assert_eq!(
        endpoint_of(&destination(&x)),
        warm,
        "routed on the body, not by fallback"
    );
    let response = vm.respond(x.id, 200).unwrap();
    assert_eq!(
        response.get_str("x-prefixroute-policy").as_deref(),
        Some("latency"),
        "the default policy"
    );
}

/// The request `id` went through the fallback for its size, the first such one counted.
fn assert_answered_as_too_large(host: &host_tests::Host, vm: &mut host_tests::Vm, id: u32) {
    let response = vm.respond(id, 200).unwrap();
    assert_eq!(
        response.get_str("x-prefixroute-fallback").as_deref(),
        Some("body_too_large")
    );
    assert_eq!(host.stats().value("prefixroute.fallback.body_too_large"), 1);
}

#[test]
fn a_body_over_the_limit_falls_back_as_soon_as_it_is_too_large() {
    let host = common::host();
    let mut vm = common::configured(&host, &config(3, json!({"max_body_bytes": 1000})));
    let body = chat_body(&"word ".repeat(500), "q");
    let x = vm
        .send(&Request::chat(body.clone()).chunks(Chunks::Every(400)))
        .unwrap();
    // 400 and 800 bytes are buffered; at 1200 the plugin gives up and lets everything through.
    assert_eq!(
        &x.actions[..4],
        &[
            Action::Pause,
            Action::Pause,
            Action::Pause,
            Action::Continue
        ]
    );
    assert!(x.actions[4..].iter().all(|a| *a == Action::Continue));
    assert_eq!(x.upstream_body, body);
    assert_answered_as_too_large(&host, &mut vm, x.id);
}

#[test]
fn a_body_declared_over_the_limit_falls_back_at_the_headers_and_is_never_held() {
    let host = common::host();
    let mut vm = common::configured(&host, &config(3, json!({"max_body_bytes": 1000})));
    let body = chat_body(&"word ".repeat(500), "q");
    let declared = Request::chat(body.clone())
        .header("content-length", body.len().to_string())
        .chunks(Chunks::Every(400));
    let x = vm.send(&declared).unwrap();
    // Not one pause: Envoy never holds a byte of it, so it cannot pass Envoy's buffer limit.
    assert!(
        x.actions.iter().all(|a| *a == Action::Continue),
        "{:?}",
        x.actions
    );
    assert_eq!(x.upstream_body, body);
    assert_answered_as_too_large(&host, &mut vm, x.id);

    // A length within the limit, or one that is not a count, decides nothing: the body is
    // held and routed (or let go at the limit) as without the header.
    for length in [body.len().min(999).to_string(), "lots".to_string()] {
        let small = chat_body("a short question", "q");
        let x = vm
            .send(&Request::chat(small).header("content-length", &length))
            .unwrap();
        assert_eq!(x.actions[0], Action::Pause, "content-length {length}");
        let response = vm.respond(x.id, 200).unwrap();
        assert_eq!(response.get_str("x-prefixroute-fallback"), None, "{length}");
    }
    assert_eq!(host.stats().value("prefixroute.fallback.body_too_large"), 1);
}

#[test]
fn the_response_names_the_endpoint_policy_and_match() {
    let host = common::host();
    let mut vm = common::configured(&host, &config(4, json!({})));
    let system = common::tenant_prompt(3);
    let first = vm
        .round_trip(&Request::chat(chat_body(&system, "a")))
        .unwrap();
    let second = vm
        .round_trip(&Request::chat(chat_body(&system, "b")))
        .unwrap();
    let e = endpoint_of(&destination(&first.exchange));
    assert_eq!(endpoint_of(&destination(&second.exchange)), e);
    assert_eq!(
        first.response_header("x-prefixroute-endpoint"),
        Some(common::name(e))
    );
    let matched = |rt: &host_tests::RoundTrip| -> (usize, usize) {
        let m = rt.response_header("x-prefixroute-match").unwrap();
        let (a, b) = m.split_once('/').unwrap();
        (a.parse().unwrap(), b.parse().unwrap())
    };
    let (m1, t1) = matched(&first);
    let (m2, t2) = matched(&second);
    assert_eq!((m1, t1 > 5), (0, true), "cold");
    assert!(m2 > 0 && m2 < t2, "warm, all but the tail: {m2}/{t2}");
}

#[test]
fn a_streamed_answer_is_timed_from_its_first_body_byte_not_its_headers() {
    // A streaming server (vLLM's OpenAI server, the fake server) sends its headers as soon as
    // it accepts the request, its first token after the prefill, and the rest while decoding.
    let host = common::host();
    let mut vm = common::configured(&host, &config(2, json!({"policy": "latency"})));
    let t0 = host.clock().now_ms();
    let x = vm
        .send(&Request::chat(chat_body(&common::tenant_prompt(2), "q")))
        .unwrap();
    host.clock().set_ms(t0 + 1);
    let mut ok = Headers::new();
    ok.add(":status", b"200");
    ok.add("content-type", b"text/event-stream");
    vm.response_headers(x.id, ok, false).unwrap();
    host.clock().set_ms(t0 + 400);
    vm.response_body(x.id, b"data: {\"choices\":[]}\n\n", false)
        .unwrap();
    host.clock().set_ms(t0 + 900);
    vm.response_body(x.id, b"data: {\"choices\":[]}\n\n", false)
        .unwrap();
    host.clock().set_ms(t0 + 1400);
    vm.response_body(x.id, b"data: [DONE]\n\n", true).unwrap();
    vm.finish(x.id).unwrap();
    vm.tick().unwrap();
    assert_eq!(host.stats().value("prefixroute.latency.observations"), 1);
    // Held 1,000 ms after its first token (1,399 ms after its headers).
    assert_eq!(host.stats().value("prefixroute.latency.hold_us"), 1_000_000);
}

#[test]
fn a_system_prompt_met_again_is_hashed_from_memory_and_matches_as_core_says() {
    use prefixroute_core::hashing::{hash_request, HashConfig};
    let host = common::host();
    let mut vm = common::configured(&host, &config(3, json!({})));
    let system = common::tenant_prompt(5);
    assert!(system.len() >= prefixroute_core::hashing::memo::MIN_MESSAGE_BYTES);
    let bodies = [
        chat_body(&system, "first"),
        chat_body(&system, "and second"),
        chat_body(&system, "a third one"),
    ];
    let hashes: Vec<_> = bodies
        .iter()
        .map(|b| {
            hash_request(
                &prefixroute_core::parse_request(b).unwrap(),
                HashConfig::default(),
            )
        })
        .collect();
    let mut matches = Vec::new();
    for (i, body) in bodies.iter().enumerate() {
        let rt = vm.round_trip(&Request::chat(body.clone())).unwrap();
        matches.push(rt.response_header("x-prefixroute-match").unwrap());
        // The system prompt is tokenized when met first and when met again (then it is
        // remembered); the questions are too short to remember.
        let misses = (i + 1).min(2) as i64;
        assert_eq!(host.stats().value("prefixroute.hash_memo.misses"), misses);
        let hits = i.saturating_sub(1) as i64;
        assert_eq!(host.stats().value("prefixroute.hash_memo.hits"), hits);
    }
    // Hashed from memory, the third request has the blocks core hashes: it matches the
    // second up to where they part (its checkpoints are recorded, the grid where it ends, and
    // the 16 after a match).
    let shared = hashes[1].chains[0]
        .iter()
        .zip(&hashes[2].chains[0])
        .take_while(|(a, b)| a == b)
        .count();
    assert!(shared > 3);
    assert_eq!(matches[2], format!("{shared}/{}", hashes[2].total_blocks()));
}

#[test]
fn costs_are_counted_per_request_and_repeat_exactly() {
    let run = || {
        let host = common::host();
        let mut vm = common::configured(&host, &config(4, json!({})));
        common::tick_and_answer(&mut vm, |_| {
            host_tests::CalloutReply::ok(common::page(0.0, 1.0, 0.1))
        });
        let system = common::tenant_prompt(4);
        vm.round_trip(&Request::chat(chat_body(&system, "a")))
            .unwrap();
        vm.round_trip(&Request::chat(chat_body(&system, "b")))
            .unwrap()
            .costs
    };
    let (a, b) = (run(), run());
    assert_eq!(a, b, "instructions, calls and bytes are deterministic");
    let t = &a.total;
    assert!(t.fuel > 10_000, "{t:?}");
    // headers, body, response headers, response body, log, done, delete (+ create).
    assert_eq!(t.callbacks, 8);
    assert_eq!(
        t.calls("proxy_get_buffer_bytes"),
        1,
        "the body is copied in once"
    );
    // The endpoint records are carried from the first request; the index is read (the
    // bucket the first, cold request lodged its blocks in).
    assert!(t.calls("proxy_get_shared_data") >= 1, "{t:?}");
    assert!(
        a.by_callback["proxy_on_request_body"].fuel > t.fuel / 2,
        "routing dominates"
    );
    assert!(t.shared_bytes_in > 0 && t.shared_bytes_out > 0);
}

/// A `memory.copy` or `memory.fill` is one instruction however many bytes it moves, as V8 runs
/// it; with bytes priced too (wasmtime's default), the same request costs at least its
/// prompt's bytes more: a cold prompt is decoded into the text it hashes with a bulk copy.
#[test]
fn a_bulk_copy_is_one_instruction_and_its_bytes_are_counted_apart() {
    let prompt = "word ".repeat(4000);
    let run = |fuel| {
        let plugin = host_tests::Plugin::prefixroute_counting(fuel).unwrap();
        let host = host_tests::Host::new(plugin, host_tests::HostOptions::default());
        let mut vm = common::configured(&host, &config(3, json!({})));
        let rt = vm
            .round_trip(&Request::chat(chat_body(&prompt, "a")))
            .unwrap();
        rt.costs.total.fuel
    };
    let instructions = run(host_tests::Fuel::Instructions);
    let priced = run(host_tests::Fuel::InstructionsAndBulkBytes);
    assert!(
        priced >= instructions + prompt.len() as u64,
        "{priced} priced against {instructions} instructions for {} prompt bytes",
        prompt.len()
    );
}

/// A cold request records a bounded number of positions: its writes do not grow with the
/// number of its messages (an agent's long history arriving at a gateway that never saw it).
/// Before the marks were capped (`prefixroute_core::hashing::KEPT_MARKS`), 256 messages of the
/// same 4k tokens cost about one bucket write per message.
#[test]
fn a_cold_requests_index_writes_do_not_grow_with_its_message_count() {
    let sets = |messages: usize| {
        let host = common::host();
        let mut vm = common::configured(&host, &config(3, json!({})));
        let body = if messages == 1 {
            host_tests::bench::body(7, 4096, "what changed?")
        } else {
            host_tests::bench::conversation(7, 4096, messages, "what changed?")
        };
        let rt = vm.round_trip(&Request::chat(body)).unwrap();
        let matched = rt
            .response_header("x-prefixroute-match")
            .unwrap_or_default();
        assert!(matched.starts_with("0/"), "cold: {matched}");
        rt.costs.by_callback["proxy_on_request_body"].calls("proxy_set_shared_data")
    };
    let one = sets(1);
    for messages in [16, 64, 256] {
        let many = sets(messages);
        // The first and last two boundaries, each with its gap's grid, are recorded over one
        // message's; a cold chain lodges them all in its first block's bucket, one write.
        assert_eq!(
            many, one,
            "{messages} messages: {many} writes against {one} for one message"
        );
    }
}

/// A cold request writes shared data a constant number of times whatever its length: its
/// recorded positions lodge in its first block's bucket (one write), beside the endpoint's
/// clock and the ledger. Before, one write per recorded position: 47 for 16k tokens.
#[test]
fn a_cold_requests_shared_data_writes_do_not_grow_with_its_length() {
    let sets = |tokens: usize| {
        let host = common::host();
        let mut vm = common::configured(&host, &config(3, json!({})));
        let body = host_tests::bench::body(7, tokens, "what changed?");
        let rt = vm.round_trip(&Request::chat(body)).unwrap();
        let matched = rt
            .response_header("x-prefixroute-match")
            .unwrap_or_default();
        assert!(matched.starts_with("0/"), "cold: {matched}");
        rt.costs.total.calls("proxy_set_shared_data")
    };
    let short = sets(1024);
    assert!(short <= 6, "{short} writes for a cold 1k-token request");
    // Up to ~35k tokens every recorded position lodges (`prefixroute_plugin::store::
    // LODGER_WAYS`); a longer prompt writes the rest to their own buckets.
    for tokens in [4096, 16384, 32768] {
        assert_eq!(sets(tokens), short, "{tokens} tokens");
    }
}

/// Why the plugin's README asks for `per_connection_buffer_limit_bytes` above
/// `max_body_bytes`: with Envoy's default 1 MiB limit and the plugin's default 4 MiB
/// `max_body_bytes`, a 2 MiB request is answered 413 by Envoy before the plugin can fall back.
#[test]
fn envoys_buffer_limit_must_exceed_max_body_bytes() {
    let body = chat_body(&"a".repeat(2_200_000), "q");
    assert!(body.len() > 1 << 21);
    for (limit, expect_413) in [(1 << 20, true), (8 << 20, false)] {
        let host = common::host_with(HostOptions {
            buffer_limit_bytes: Some(limit),
            ..HostOptions::default()
        });
        let mut vm = common::configured(&host, &config(2, json!({})));
        let x = vm
            .send(&Request::chat(body.clone()).chunks(Chunks::Every(64 << 10)))
            .unwrap();
        assert_eq!(
            x.local_reply.as_ref().map(|r| r.status_code) == Some(413),
            expect_413,
            "limit {limit}"
        );
        assert_eq!(x.upstream.is_some(), !expect_413, "limit {limit}");
        assert!(!x.stalled);
    }
}
