//! `prefixroute fake-server` over real HTTP on 127.0.0.1.

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use prefixroute_core::metrics::parse_text;
use serde_json::{json, Value};
use support::FakeServer;

/// Long enough to span several 16-token blocks.
const SYSTEM: &str = "You are the assistant of tenant seven. Answer briefly, cite the \
    handbook, never guess, and keep every answer under three sentences so that the \
    prompt is long enough to fill a few full blocks of sixteen tokens each.";

fn chat(question: &str, extra: Value) -> String {
    let mut body = json!({
        "model": "cc-sim",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
        "max_tokens": 4,
    });
    if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
        body.extend(extra.clone());
    }
    body.to_string()
}

fn usage(reply: &Value) -> (u64, u64) {
    let usage = &reply["usage"];
    (
        usage["prompt_tokens"].as_u64().unwrap(),
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
    )
}

#[test]
fn repeated_prompt_is_served_from_cache_and_counted() {
    let server = FakeServer::start("a", &["--prefill-ms-per-token", "0"]);
    let before = server.metrics();
    assert_eq!(before.prefix_cache_hits_total, Some(0.0));

    let first = server.post("/v1/chat/completions", &chat("What is a block?", json!({})));
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(first.header("x-served-by"), Some("a"));
    let first = first.json();
    assert_eq!(first["object"], "chat.completion");
    assert_eq!(first["usage"]["completion_tokens"], 4);
    let (prompt, cached) = usage(&first);
    assert!(
        prompt > 48,
        "prompt of {prompt} tokens is too short for the test"
    );
    assert_eq!(cached, 0);

    let second = server
        .post("/v1/chat/completions", &chat("What is a block?", json!({})))
        .json();
    let (prompt2, cached2) = usage(&second);
    assert_eq!(prompt2, prompt);
    assert!(
        cached2 > 0 && cached2 < prompt2,
        "cached {cached2} of {prompt2}"
    );
    assert_eq!(cached2 % 16, 0, "only full blocks are cached");

    let after = server.metrics();
    assert_eq!(after.prefix_cache_hits_total, Some(cached2 as f64));
    assert_eq!(after.prefix_cache_queries_total, Some((2 * prompt) as f64));
    assert_eq!(after.num_requests_running, Some(0.0));
    assert_eq!(after.kv_cache_usage_perc, Some(0.0));
}

#[test]
fn metrics_page_has_vllm_names_and_cache_config() {
    let server = FakeServer::start("m", &["--kv-blocks", "128", "--block-size", "32"]);
    let page = server.get("/metrics");
    assert!(page
        .header("content-type")
        .is_some_and(|t| t.starts_with("text/plain")));
    for family in [
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:request_success_total",
        "vllm:prompt_tokens_total",
        "vllm:cache_config_info",
    ] {
        assert!(
            page.body.contains(&format!("# TYPE {family} ")),
            "no TYPE line for {family}"
        );
    }
    let samples = parse_text(&page.body).unwrap();
    let waiting = samples
        .iter()
        .find(|s| s.name == "vllm:num_requests_waiting")
        .unwrap();
    assert_eq!(waiting.label("model_name"), Some("cc-sim"));
    assert_eq!(waiting.label("engine"), Some("0"));
    let metrics = server.metrics();
    assert_eq!(metrics.block_size, Some(32));
    assert_eq!(metrics.num_gpu_blocks, Some(128));
}

#[test]
fn stream_sends_sse_chunks_usage_and_done() {
    let server = FakeServer::start("s", &["--decode-ms-per-token", "2"]);
    let body = chat(
        "Stream it.",
        json!({"stream": true, "stream_options": {"include_usage": true}}),
    );
    let reply = server.post("/v1/chat/completions", &body);
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-served-by"), Some("s"));
    assert!(reply
        .header("content-type")
        .is_some_and(|t| t.starts_with("text/event-stream")));
    let events: Vec<&str> = reply
        .body
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .expect("every event is a data line")
        })
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    // Role chunk, 4 token chunks, usage chunk.
    assert_eq!(chunks.len(), 6, "{:#?}", chunks);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks[1..5]
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    assert!(!text.is_empty());
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[5]["choices"], json!([]));
    assert!(usage(&chunks[5]).0 > 0);

    // Without include_usage, vLLM sends no usage chunk.
    let plain = server.post(
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "stream": true, "max_tokens": 3}).to_string(),
    );
    let events: Vec<&str> = plain.body.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 4, "{events:?}");
    assert!(events[0].contains("\"text\""));
    assert!(!plain.body.contains("usage"));
    assert_eq!(events[3], "data: [DONE]");
}

#[test]
fn bad_input_gets_an_error_status_and_the_server_lives_on() {
    let server = FakeServer::start("e", &[]);
    let bad_json = server.post("/v1/chat/completions", "{not json");
    assert_eq!(bad_json.status, 400);
    assert_eq!(bad_json.header("x-served-by"), Some("e"));
    assert_eq!(bad_json.json()["error"]["type"], "invalid_request_error");
    let cases = [
        (
            "/v1/chat/completions",
            r#"{"prompt":"chat needs messages"}"#,
            400,
        ),
        ("/v1/completions", r#"{"prompt":[1,-2]}"#, 400),
        ("/v1/completions", r#"{"prompt":"x","max_tokens":0}"#, 400),
        (
            "/v1/completions",
            r#"{"prompt":"x","max_tokens":4294967295}"#,
            400,
        ),
        ("/v1/completions", r#"{"prompt":"x","model":"other"}"#, 404),
        ("/v1/completions", "\u{0}\u{1}\u{2}", 400),
    ];
    for (path, body, status) in cases {
        let reply = server.post(path, body);
        assert_eq!(reply.status, status, "{path} {body}: {}", reply.body);
        assert!(reply.json()["error"]["message"].is_string());
    }
    let missing = server.get("/v2/nothing");
    assert_eq!(missing.status, 404);
    assert_eq!(missing.json()["detail"], "Not Found");
    let wrong = server.get("/v1/chat/completions");
    assert_eq!(wrong.status, 405);
    assert_eq!(wrong.header("allow"), Some("POST"));
    assert_eq!(server.post("/health", "").status, 405);
    // Bytes that are not HTTP at all.
    {
        use std::io::Write;
        let mut raw = std::net::TcpStream::connect(("127.0.0.1", server.port)).unwrap();
        let _ = raw.write_all(b"\x16\x03\x01garbage\r\n\r\n");
    }
    assert_eq!(server.get("/health").status, 200);
}

#[test]
fn health_and_models_answer_as_vllm() {
    let server = FakeServer::start("h", &["--model", "tiny"]);
    let health = server.get("/health");
    assert_eq!((health.status, health.body.as_str()), (200, ""));
    assert_eq!(health.header("x-served-by"), Some("h"));
    let models = server.get("/v1/models").json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "tiny");
    assert_eq!(models["data"][0]["object"], "model");
}

#[test]
fn one_lane_makes_concurrent_requests_wait() {
    let server = FakeServer::start("q", &["--lanes", "1", "--prefill-overhead-ms", "300"]);
    let port = server.port;
    let senders: Vec<_> = (0..3)
        .map(|i| {
            std::thread::spawn(move || {
                let body = json!({"prompt": format!("request {i}"), "max_tokens": 1});
                support::http(port, "POST", "/v1/completions", Some(&body.to_string())).status
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut peak_waiting = 0.0f64;
    while Instant::now() < deadline && peak_waiting < 1.0 {
        let m = server.metrics();
        let (waiting, running) = (
            m.num_requests_waiting.unwrap(),
            m.num_requests_running.unwrap(),
        );
        assert!(running <= 1.0, "one lane, {running} running");
        if waiting > 0.0 {
            assert_eq!(running, 1.0);
            assert!(m.kv_cache_usage_perc.unwrap() > 0.0);
        }
        peak_waiting = peak_waiting.max(waiting);
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(peak_waiting >= 1.0, "never saw a waiting request");
    for sender in senders {
        assert_eq!(sender.join().unwrap(), 200);
    }
    let m = server.metrics();
    assert_eq!(
        (m.num_requests_waiting, m.num_requests_running),
        (Some(0.0), Some(0.0))
    );
    let page = server.get("/metrics").body;
    assert!(page.contains("vllm:request_success_total{model_name=\"cc-sim\",engine=\"0\",finished_reason=\"length\"} 3.0"));
}

#[test]
fn sigterm_stops_the_server_cleanly() {
    let mut server = FakeServer::start("t", &[]);
    assert_eq!(server.get("/health").status, 200);
    let killed = Command::new("kill")
        .args(["-TERM", &server.pid().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = server
        .wait_exit(Duration::from_secs(5))
        .expect("exits within 5 s of SIGTERM");
    assert!(status.success(), "{status:?}");
    // The reader thread may lag the exit slightly.
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline && server.log.lock().unwrap().is_empty() {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        server.log.lock().unwrap().as_slice(),
        ["fake-server t stopped"]
    );
}

#[test]
fn a_client_that_hangs_up_frees_its_lane() {
    use std::io::Write;
    let server = FakeServer::start("c", &["--lanes", "1", "--prefill-overhead-ms", "5000"]);
    let gauges = || {
        let m = server.metrics();
        (
            m.num_requests_running.unwrap(),
            m.num_requests_waiting.unwrap(),
        )
    };
    let clients: Vec<_> = (0..2)
        .map(|i| {
            let body = json!({"prompt": format!("abandoned {i}"), "stream": i == 1}).to_string();
            let mut stream = std::net::TcpStream::connect(("127.0.0.1", server.port)).unwrap();
            write!(
                stream,
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
            stream
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(3);
    while gauges() != (1.0, 1.0) {
        assert!(Instant::now() < deadline, "requests never queued");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(clients);
    // Both gave up long before their 5 s prefill would end; nothing may stay counted.
    let deadline = Instant::now() + Duration::from_secs(3);
    while gauges() != (0.0, 0.0) {
        assert!(Instant::now() < deadline, "lane still held: {:?}", gauges());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(server.metrics().kv_cache_usage_perc, Some(0.0));
}
