//! `prefixroute replay` against fake servers on 127.0.0.1.

mod support;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use prefixroute_sim::trace::{to_jsonl, TraceSpec};
use serde_json::Value;
use support::{temp, FakeServer, BIN};

const REQUESTS: usize = 12;

/// 12 requests at 50/s over 3 tenants; every other one streams, so usage is read from both
/// JSON bodies and SSE streams.
fn write_trace(name: &str) -> PathBuf {
    let spec = TraceSpec {
        requests: REQUESTS,
        rate: 50.0,
        tenants: 3,
        prompt_words: 60,
        ..TraceSpec::default()
    };
    let mut records = spec.generate().unwrap();
    for record in records.iter_mut().step_by(2) {
        record.body["stream"] = Value::Bool(true);
    }
    let path = temp(name);
    std::fs::write(&path, to_jsonl(&records)).unwrap();
    path
}

fn replay(trace: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("replay")
        .arg(trace)
        .args(args)
        .args(["--no-progress"])
        .output()
        .expect("run replay")
}

fn json_of(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not one JSON object ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

#[test]
fn replay_reports_cache_hits_that_match_the_server_counters() {
    let trace = write_trace("hits.jsonl");
    let a = FakeServer::start("a", &["--prefill-ms-per-token", "0.1"]);
    let b = FakeServer::start("b", &[]);
    let metrics_a = format!("a={}", a.url());
    let metrics_b = format!("b={}/metrics", b.url());
    let out = replay(
        &trace,
        &[
            "--url",
            &a.url(),
            "--metrics",
            &metrics_a,
            "--metrics",
            &metrics_b,
            "--json",
        ],
    );
    let report = json_of(&out);
    assert_eq!(report["requests"], REQUESTS);
    assert_eq!(report["succeeded"], REQUESTS);
    assert_eq!(report["errors"], 0);
    assert_eq!(report["endpoints"], serde_json::json!({ "a": REQUESTS }));
    let groups = &report["groups_on_one_endpoint"];
    assert_eq!(groups["single"], groups["groups"]);
    assert_eq!(report["usage"]["responses_without_usage"], 0);
    assert!(report["latency_ms"]["p50"].as_f64().unwrap() > 0.0);

    let counters = &report["server_counters"];
    assert_eq!(counters["settled"], true);
    let hit_rate = counters["hit_rate"].as_f64().unwrap();
    assert!(hit_rate > 0.0, "{report:#}");
    // One replica, nothing else talking to it: what the responses said is what the cache did.
    assert_eq!(counters["hits"], report["usage"]["cached_tokens"]);
    assert_eq!(counters["queries"], report["usage"]["prompt_tokens"]);

    // And it is what the server's own page says now (its counters started at zero).
    let now = a.metrics();
    let servers = counters["servers"].as_array().unwrap();
    assert_eq!(servers[0]["name"], "a");
    assert_eq!(
        servers[0]["hits"].as_f64(),
        now.prefix_cache_hits_total,
        "{report:#}"
    );
    assert_eq!(
        servers[0]["queries"].as_f64(),
        now.prefix_cache_queries_total
    );
    assert_eq!(
        Some(hit_rate),
        Some(now.prefix_cache_hits_total.unwrap() / now.prefix_cache_queries_total.unwrap())
    );
    assert_eq!(servers[1]["name"], "b");
    assert_eq!(servers[1]["queries"], 0);
    assert_eq!(servers[1]["hit_rate"], Value::Null);
}

#[test]
fn text_report_names_every_figure() {
    let trace = write_trace("text.jsonl");
    let a = FakeServer::start("a", &["--prefill-ms-per-token", "0"]);
    let metrics = format!("a={}", a.url());
    let out = replay(&trace, &["--url", &a.url(), "--metrics", &metrics]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "replayed 12 requests",
        "errors            0",
        "latency           p50 ",
        "endpoints         a 12",
        "groups on one",
        "cached tokens",
        "server hit rate",
        "  a ",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
}

#[test]
fn silent_or_closed_url_counts_errors_within_the_timeout() {
    let trace = write_trace("silent.jsonl");
    // Accepts connections (the kernel does) but never answers.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_url = format!("http://{}", silent.local_addr().unwrap());
    let started = Instant::now();
    let report = json_of(&replay(
        &trace,
        &["--url", &silent_url, "--timeout-s", "1", "--json"],
    ));
    assert!(started.elapsed() < Duration::from_secs(10), "replay hung");
    assert_eq!(report["errors"], REQUESTS);
    assert_eq!(report["errors_by_kind"]["timeout"], REQUESTS);
    assert_eq!(report["latency_ms"]["p50"], Value::Null);
    assert_eq!(report["server_counters"], Value::Null);

    let closed_port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let closed_url = format!("http://127.0.0.1:{closed_port}");
    let out = replay(&trace, &["--url", &closed_url, "--timeout-s", "1"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("errors            12 (connect 12)"), "{text}");
    assert!(text.contains("Connection refused"), "{text}");
    drop(silent);
}

fn assert_fails_with(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "one error line, got:\n{stderr}");
    assert!(
        stderr.starts_with("error: ") && stderr.contains(needle),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
}

#[test]
fn bad_trace_url_or_metrics_exit_2_with_one_line() {
    let good = write_trace("good.jsonl");
    let bad = temp("bad.jsonl");
    std::fs::write(&bad, "{\"t\": 0.0, \"group\": \"g\"}\n").unwrap();
    let a = FakeServer::start("a", &[]);

    assert_fails_with(&replay(&bad, &["--url", &a.url()]), "bad trace");
    assert_fails_with(
        &replay(&temp("missing.jsonl"), &["--url", &a.url()]),
        "cannot read trace",
    );
    assert_fails_with(&replay(&good, &["--url", "ftp://x"]), "--url");
    assert_fails_with(&replay(&good, &["--url", "https://x"]), "https");
    let closed_port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let unreachable = format!("a=http://127.0.0.1:{closed_port}");
    assert_fails_with(
        &replay(&good, &["--url", &a.url(), "--metrics", &unreachable]),
        "cannot read metrics of a",
    );
    assert_fails_with(
        &replay(&good, &["--url", &a.url(), "--metrics", "nameless"]),
        "NAME=URL",
    );
    // Nothing was sent by any of the refused runs.
    assert_eq!(a.metrics().prefix_cache_queries_total, Some(0.0));
}

#[test]
fn requests_out_has_one_line_per_request_whose_usage_adds_up_to_the_report() {
    let trace = write_trace("requests-out.jsonl");
    let a = FakeServer::start("a", &[]);
    let lines_path = temp("requests-out-lines.jsonl");
    let out = replay(
        &trace,
        &[
            "--url",
            &a.url(),
            "--json",
            "--requests-out",
            lines_path.to_str().unwrap(),
        ],
    );
    let report = json_of(&out);
    let text = std::fs::read_to_string(&lines_path).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), REQUESTS);
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(line["index"], i);
        assert_eq!(
            line["endpoint"], "a",
            "x-served-by without a router: {line}"
        );
        assert_eq!(line["error"], Value::Null);
        assert_eq!(line["router"], serde_json::json!({}), "no router in front");
    }
    let sum = |field: &str| {
        lines
            .iter()
            .map(|l| l[field].as_u64().unwrap())
            .sum::<u64>()
    };
    assert_eq!(sum("prompt_tokens"), report["usage"]["prompt_tokens"]);
    assert_eq!(sum("cached_tokens"), report["usage"]["cached_tokens"]);
    let at: Vec<f64> = lines.iter().map(|l| l["at_ms"].as_f64().unwrap()).collect();
    assert!(at.windows(2).all(|w| w[0] <= w[1]), "trace order: {at:?}");

    // A file that cannot be written fails before anything is sent, with a clear message.
    let before = a.metrics().prefix_cache_queries_total;
    let out = replay(
        &trace,
        &[
            "--url",
            &a.url(),
            "--requests-out",
            "/nonexistent-dir/x.jsonl",
        ],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--requests-out /nonexistent-dir/x.jsonl: cannot create it"),
        "{err}"
    );
    assert_eq!(
        a.metrics().prefix_cache_queries_total,
        before,
        "nothing was sent"
    );
}

/// Two URLs (two servers standing in for two gateways): in turn, every tenant's requests land
/// on both; by group, each tenant's on one (session affinity, the simulator's
/// `--gateway-spread by-group` mapping).
#[test]
fn several_urls_take_requests_in_turn_or_each_group_on_one() {
    let trace = write_trace("spread.jsonl");
    let a = FakeServer::start("a", &[]);
    let b = FakeServer::start("b", &[]);
    let run = |spread: &str| {
        json_of(&replay(
            &trace,
            &[
                "--url",
                &a.url(),
                "--url",
                &b.url(),
                "--url-spread",
                spread,
                "--json",
            ],
        ))
    };
    let in_turn = run("in-turn");
    assert_eq!(
        in_turn["endpoints"],
        serde_json::json!({ "a": REQUESTS / 2, "b": REQUESTS / 2 })
    );
    // (A tenant whose requests all fell on even indexes stays on one.)
    assert!(
        in_turn["groups_on_one_endpoint"]["single"]
            .as_u64()
            .unwrap()
            < 3
    );
    let by_group = run("by-group");
    let groups = &by_group["groups_on_one_endpoint"];
    assert_eq!(groups["groups"], 3);
    assert_eq!(groups["single"], 3);
    assert_eq!(by_group["succeeded"], REQUESTS);
}
