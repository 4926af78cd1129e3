//! The plugin in real Envoy (2 workers) in front of fake vLLM replicas, end to end.
//!
//! These need the Envoy binary and the release plugin build, so they are `#[ignore]`d for a
//! plain `cargo test`; `./test.sh` installs Envoy, builds the plugin and runs them with
//! `--ignored`.

mod support;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use support::{http, temp, FakeServer, Served, BIN};

fn prefixroute_json(args: &[&str]) -> Value {
    let out = Command::new(BIN)
        .args(args)
        .output()
        .expect("run prefixroute");
    assert!(
        out.status.success(),
        "prefixroute {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON output")
}

fn row<'a>(rows: &'a Value, policy: &str) -> &'a Value {
    rows.as_array()
        .unwrap()
        .iter()
        .find(|r| r["policy"] == policy)
        .unwrap_or_else(|| panic!("no row for {policy}"))
}

fn hit_rate(row: &Value) -> f64 {
    row["summary"]["server_counters"]["hit_rate"]
        .as_f64()
        .unwrap()
}

const FAST_SCRAPES: [&str; 6] = [
    "--scrape-interval-ms",
    "200",
    "--scrape-timeout-ms",
    "150",
    "--stale-after-ms",
    "1000",
];

#[test]
#[ignore = "needs Envoy and the plugin build: run ./test.sh"]
fn latency_and_prefix_beat_round_robin_by_20_points_and_pin_their_tenants() {
    let mut args = vec![
        "compare",
        "--json",
        "--policies",
        "round-robin,prefix,latency",
    ];
    args.extend_from_slice(&FAST_SCRAPES);
    let rows = prefixroute_json(&args);
    let rr = row(&rows, "round-robin");
    assert_eq!(rr["summary"]["errors"], 0, "{rr}");
    for policy in ["prefix", "latency"] {
        let r = row(&rows, policy);
        assert_eq!(r["summary"]["errors"], 0, "{r}");
        assert_eq!(r["summary"]["server_counters"]["settled"], true, "{r}");
        let (rr_hit, hit) = (hit_rate(rr), hit_rate(r));
        assert!(
            hit >= rr_hit + 0.20,
            "{policy} {hit:.3} vs round-robin {rr_hit:.3}"
        );
        let groups = &r["summary"]["groups_on_one_endpoint"];
        assert_eq!(groups["groups"], 8);
        // Every tenant on one replica. Before `RecentRequests::SLACK`, `latency`'s bounded
        // share split one tenant of this even trace in 6 of 32 runs with two Envoy workers: a
        // tenant's three requests in the trace's first 130 ms looked hot to a worker that saw
        // half of the first seven (docs/benchmarks.md).
        assert_eq!(
            groups["single"], 8,
            "{policy}: every tenant on one endpoint: {groups}"
        );
    }
}

#[test]
#[ignore = "needs Envoy and the plugin build: run ./test.sh"]
fn hot_tenant_reaches_a_second_endpoint() {
    let trace = temp("hot.jsonl");
    let out = Command::new(BIN)
        .args([
            "trace",
            "-o",
            trace.to_str().unwrap(),
            "--hot",
            "0.7",
            "--rate",
            "40",
            "--requests",
            "200",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let mut args = vec![
        "compare",
        trace.to_str().unwrap(),
        "--json",
        "--policies",
        "prefix,latency",
        "--lanes",
        "2",
        "--decode-ms-per-token",
        "5",
    ];
    args.extend_from_slice(&FAST_SCRAPES);
    let rows = prefixroute_json(&args);
    for policy in ["prefix", "latency"] {
        let r = row(&rows, policy);
        assert_eq!(r["summary"]["errors"], 0);
        let hot: BTreeMap<String, u64> =
            serde_json::from_value(r["summary"]["group_endpoints"]["tenant-0"].clone()).unwrap();
        assert!(hot.len() >= 2, "{policy}: hot tenant stayed on {hot:?}");
        // Spilling keeps locality: once a second replica holds the hot prefix, it hits there too.
        assert!(hit_rate(r) > 0.6, "{policy}: {}", hit_rate(r));
    }
}

/// `n` fake replicas named replica-0, replica-1, …
fn fleet(n: usize) -> Vec<FakeServer> {
    fleet_with(n, &[])
}

/// [`fleet`] with `extra` `fake-server` arguments for each replica.
fn fleet_with(n: usize, extra: &[&str]) -> Vec<FakeServer> {
    (0..n)
        .map(|i| FakeServer::start(&format!("replica-{i}"), extra))
        .collect()
}

/// `prefixroute serve` in front of `replicas` (named replica-0, replica-1, …) with `extra`.
fn serve(replicas: &[&FakeServer], extra: &[&str]) -> Served {
    let mut args: Vec<String> = Vec::new();
    for (i, r) in replicas.iter().enumerate() {
        args.push("--endpoint".into());
        args.push(format!("replica-{i}=http://127.0.0.1:{}", r.port));
    }
    args.extend(extra.iter().map(|a| a.to_string()));
    support::serve(&args)
}

fn chat(tenant: usize, question: usize) -> String {
    serde_json::json!({
        "model": "cc-sim",
        "max_tokens": 4,
        "messages": [
            {"role": "system", "content": format!("You are the assistant of tenant {tenant}. {}", "Answer briefly and politely. ".repeat(20))},
            {"role": "user", "content": format!("question number {question}")},
        ],
    })
    .to_string()
}

#[test]
#[ignore = "needs Envoy and the plugin build: run ./test.sh"]
fn a_killed_replica_gets_no_traffic_once_its_failures_are_seen() {
    let replicas = fleet(3);
    let refs: Vec<&FakeServer> = replicas.iter().collect();
    let mut args = FAST_SCRAPES.to_vec();
    args.extend_from_slice(&["--failures-to-down", "2"]);
    let envoy = serve(&refs, &args);
    std::thread::sleep(Duration::from_millis(500));

    // Find which replica holds tenant 0, then kill it.
    let first = http(
        envoy.port,
        "POST",
        "/v1/chat/completions",
        Some(&chat(0, 0)),
    );
    assert_eq!(first.status, 200);
    let victim_name = first
        .header("x-prefixroute-endpoint")
        .expect("routed")
        .to_string();
    let victim: usize = victim_name.trim_start_matches("replica-").parse().unwrap();
    let mut replicas = replicas;
    drop(replicas.remove(victim));

    // Two failed scrapes at 200 ms, plus slack for the tick that notices them.
    std::thread::sleep(Duration::from_millis(1500));
    for q in 1..=30 {
        let reply = http(
            envoy.port,
            "POST",
            "/v1/chat/completions",
            Some(&chat(q % 4, q)),
        );
        assert_eq!(
            reply.status, 200,
            "request {q} failed after the failure was seen"
        );
        let endpoint = reply.header("x-prefixroute-endpoint").unwrap();
        assert_ne!(
            endpoint, victim_name,
            "request {q} went to the killed replica"
        );
        assert_eq!(reply.header("x-served-by"), Some(endpoint));
    }
}

#[test]
#[ignore = "needs Envoy and the plugin build: run ./test.sh"]
fn a_replica_whose_engine_died_costs_retries_until_five_failures_take_it_out() {
    // Its HTTP server and /metrics live on and say idle: only its answers tell.
    let healthy = fleet(2);
    let dead = FakeServer::start("replica-2", &["--fail-status", "503"]);
    let envoy = serve(&[&healthy[0], &healthy[1], &dead], &FAST_SCRAPES);
    std::thread::sleep(Duration::from_millis(500));
    for t in 0..60 {
        // Every request a new tenant: each is placed afresh, so the dead replica's turn comes.
        // Its 503s are retried on the next replica of the destination header.
        let reply = http(
            envoy.port,
            "POST",
            "/v1/chat/completions",
            Some(&chat(t, 0)),
        );
        assert_eq!(reply.status, 200, "request {t}");
        assert_ne!(reply.header("x-served-by"), Some("replica-2"));
        // The explanation names the replica that answered, after a retry too.
        assert_eq!(
            reply.header("x-prefixroute-endpoint"),
            reply.header("x-served-by")
        );
    }
    let stats = http(envoy.admin, "GET", "/stats", None).body;
    assert!(stats.contains("prefixroute.endpoint_ejected: 1"), "{stats}");
    // The two workers share the count, so five failures eject it whichever worker saw them;
    // the other worker may still route on its copy of the record for up to 5 ms (`CARRY_MS`).
    // Without the ejection a third of the 60 new tenants would have tried it first.
    let retries: u64 = stats
        .lines()
        .find_map(|l| l.strip_prefix("cluster.prefixroute_pool.upstream_rq_retry: "))
        .and_then(|n| n.trim().parse().ok())
        .expect("retry counter");
    assert!((5..=8).contains(&retries), "{retries} retries");
}

/// Posts `body` the way that breaks a gateway which holds it: the first 60 KB, a pause long
/// enough for the plugin to hold them, then the rest written while Envoy is frozen (as a loaded
/// gateway is), so Envoy reads it in one go, up to the listener's limit, and adds that read to
/// what is held before the plugin can let go. `chunked`: no length, `Transfer-Encoding:
/// chunked`; otherwise `Content-Length`.
fn post_to_a_frozen_gateway(envoy: &Served, body: &str, chunked: bool) -> support::Reply {
    let frame = |b: &str| {
        if chunked {
            format!("{:x}\r\n{b}\r\n", b.len())
        } else {
            b.to_string()
        }
    };
    let length = if chunked {
        "Transfer-Encoding: chunked".to_string()
    } else {
        format!("Content-Length: {}", body.len())
    };
    let mut stream = TcpStream::connect(("127.0.0.1", envoy.port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\n{length}\r\n\r\n{}",
        frame(&body[..60_000])
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    support::signal(envoy.pid(), "STOP");
    let end = if chunked { "0\r\n\r\n" } else { "" };
    let rest = format!("{}{end}", frame(&body[60_000..]));
    let mut writer = stream.try_clone().unwrap();
    let sent = std::thread::spawn(move || writer.write_all(rest.as_bytes()));
    std::thread::sleep(Duration::from_millis(500));
    support::signal(envoy.pid(), "CONT");
    // Envoy resets the connection after a 413 to a body still arriving: keep what came.
    let mut raw = Vec::new();
    let read = stream.read_to_end(&mut raw);
    assert!(!raw.is_empty(), "no response: {read:?}");
    let _ = sent.join();
    support::parse_response(&raw)
}

/// A chat body of ~1.5 MiB (~38k words of 40 letters): far under the replicas' context, past
/// both the plugin's 64 KiB and the listener's buffer `serve` gives it (1 MiB + 64 KiB).
fn body_past_both_limits() -> String {
    let word = "abcdefghijklmnopqrstuvwxyzabcdefghijklmn ";
    let prompt = word.repeat((3 << 19) / word.len());
    let body = serde_json::json!({
        "model": "cc-sim",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": prompt}],
    })
    .to_string();
    assert!(body.len() > (1 << 20) + 65536, "{} bytes", body.len());
    body
}

/// The body went to a replica through the fallback, and Envoy never answered 413.
fn assert_let_go_unread(envoy: &Served, reply: &support::Reply) {
    assert_eq!(reply.status, 200, "{}", reply.body);
    let served = reply.header("x-served-by").expect("a replica answered");
    assert!(served.starts_with("replica-"), "{served}");
    assert_eq!(reply.header("x-prefixroute-policy"), Some("fallback"));
    let stats = http(envoy.admin, "GET", "/stats", None).body;
    assert!(
        stats.contains("prefixroute.fallback.body_too_large: 1"),
        "{stats}"
    );
    assert!(
        stats.contains("http.llm.downstream_rq_too_large: 0"),
        "{stats}"
    );
}

/// A ~1.5 MiB prompt posted to a frozen gateway (see [`post_to_a_frozen_gateway`]) in front of
/// a plugin that reads 64 KiB went to a replica through the fallback, unread, and Envoy never
/// answered 413.
fn let_go_through_a_frozen_gateway(chunked: bool) {
    let replicas = fleet_with(2, &["--prefill-ms-per-token", "0.001"]);
    let refs: Vec<&FakeServer> = replicas.iter().collect();
    let envoy = serve(&refs, &["--max-body-bytes", "65536"]);
    let reply = post_to_a_frozen_gateway(&envoy, &body_past_both_limits(), chunked);
    assert_let_go_unread(&envoy, &reply);
}

#[test]
#[ignore = "needs Envoy and the plugin build: run ./test.sh"]
fn a_body_declared_past_what_the_plugin_reads_is_never_held_and_is_forwarded_unread() {
    // A prompt that declares its length is let go at the headers, so however Envoy reads it,
    // nothing is held to pass Envoy's limit (a plugin that held its first 60 KB was answered
    // 413 here, and sometimes under plain CPU load).
    let_go_through_a_frozen_gateway(false);
}

#[test]
#[ignore = "needs Envoy and the plugin build: run ./test.sh"]
fn a_long_chunked_body_read_in_one_go_is_let_go_not_answered_413() {
    // A body without a length is held up to the plugin's limit, then let go; `serve` gives
    // the route a buffer limit above what is held plus one read of the listener's size.
    let_go_through_a_frozen_gateway(true);
}

#[test]
#[ignore = "needs Envoy and the plugin build: run ./test.sh"]
fn malformed_bodies_are_routed_not_failed_by_the_plugin() {
    let replicas = fleet(2);
    let refs: Vec<&FakeServer> = replicas.iter().collect();
    let envoy = serve(&refs, &FAST_SCRAPES);
    let cases = [
        ("POST", "/v1/chat/completions", Some("{not json")),
        ("POST", "/v1/chat/completions", Some(r#"{"messages": 5}"#)),
        ("POST", "/v1/chat/completions", Some(r#"{"messages": []}"#)),
        ("POST", "/v1/completions", Some(r#"{"prompt": {"a": 1}}"#)),
        ("POST", "/v1/completions", Some("")),
        ("GET", "/v1/models", None),
        ("GET", "/health", None),
    ];
    for (method, path, body) in cases {
        let reply = http(envoy.port, method, path, body);
        assert!(
            reply.status < 500,
            "{method} {path} {body:?} -> {}",
            reply.status
        );
        assert!(
            reply.header("x-served-by").is_some(),
            "{method} {path} {body:?} never reached a replica"
        );
    }
    let stats = http(envoy.admin, "GET", "/stats?filter=prefixroute", None);
    assert!(
        stats.body.contains("prefixroute"),
        "plugin stats missing:\n{}",
        stats.body
    );
}

#[test]
#[ignore = "needs Envoy and the plugin build: run ./test.sh"]
fn a_client_supplied_destination_header_is_overwritten() {
    let replicas = fleet(2);
    let refs: Vec<&FakeServer> = replicas.iter().collect();
    let envoy = serve(&refs, &FAST_SCRAPES);
    let forced = format!("127.0.0.1:{}", replicas[0].port);
    let header = [("x-gateway-destination-endpoint", forced.as_str())];
    let mut served = BTreeMap::new();
    for tenant in 0..12 {
        for (method, path, body) in [
            ("POST", "/v1/chat/completions", Some(chat(tenant, 1))),
            ("GET", "/v1/models", None),
        ] {
            let reply = support::http_with(envoy.port, method, path, &header, body.as_deref());
            assert_eq!(reply.status, 200);
            *served
                .entry(reply.header("x-served-by").unwrap().to_string())
                .or_insert(0) += 1;
        }
    }
    // Twelve tenants spread over both replicas despite every client naming replica-0.
    assert_eq!(served.len(), 2, "{served:?}");
}

#[test]
#[ignore = "needs Envoy and the plugin build: run ./test.sh"]
fn serve_leaves_no_files_in_the_temp_dir() {
    // `serve` execs Envoy, so nothing would be left to remove a configuration file it wrote.
    let replica = FakeServer::start("replica-0", &[]);
    let envoy = serve(&[&replica], &[]);
    let reply = support::http(
        envoy.port,
        "POST",
        "/v1/chat/completions",
        Some(&chat(0, 1)),
    );
    assert_eq!(reply.status, 200);
    let left: Vec<_> = std::fs::read_dir(&envoy.tmpdir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    assert!(left.is_empty(), "serve left {left:?}");
}

#[test]
#[ignore = "needs Envoy and the plugin build: run ./test.sh"]
fn the_access_log_names_each_requests_endpoint_and_where_its_time_went() {
    let replicas = fleet(2);
    let refs: Vec<&FakeServer> = replicas.iter().collect();
    let log = temp("access.log");
    let _ = std::fs::remove_file(&log);
    let mut extra = FAST_SCRAPES.to_vec();
    extra.extend(["--access-log", log.to_str().unwrap()]);
    let envoy = serve(&refs, &extra);
    // What each answer's headers said: the policy that routed it (`fallback` until the
    // plugin has discovered the pool) and the endpoint it chose.
    let mut chosen = Vec::new();
    for tenant in 0..12 {
        let body = chat(tenant, 1);
        let reply = support::http(envoy.port, "POST", "/v1/chat/completions", Some(&body));
        assert_eq!(reply.status, 200);
        let header = |name| reply.header(name).unwrap_or_default().to_string();
        chosen.push((
            header("x-prefixroute-policy"),
            header("x-prefixroute-endpoint"),
        ));
    }
    let routed = chosen
        .iter()
        .filter(|(policy, _)| policy == "latency")
        .count();
    assert!(routed >= 6, "{chosen:?}");
    // Envoy writes its access log from a buffer it flushes about every second.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let lines: Vec<Value> = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect();
        if lines.len() >= chosen.len() || std::time::Instant::now() > deadline {
            break lines;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let text = |line: &Value, field: &str| line[field].as_str().unwrap_or_default().to_string();
    let logged: Vec<(String, String)> = lines
        .iter()
        .map(|l| (text(l, "policy"), text(l, "endpoint")))
        .collect();
    assert_eq!(logged, chosen);
    for line in &lines {
        assert_eq!(line["path"], "/v1/chat/completions", "{line}");
        let us = |field: &str| {
            line[field]
                .as_u64()
                .unwrap_or_else(|| panic!("{field} is not a number: {line}"))
        };
        let total = us("total_us");
        for part in [
            "request_us",
            "routing_us",
            "upstream_us",
            "response_headers_us",
            "response_us",
        ] {
            assert!(us(part) <= total, "{part} > total_us: {line}");
        }
    }
}

fn envoy_validates(config: &std::path::Path) {
    let envoy = std::env::var("ENVOY")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../.venv/bin/envoy").to_string());
    let out = Command::new(envoy)
        .args(["--mode", "validate", "--disable-hot-restart", "-c"])
        .arg(config)
        .output()
        .expect("run envoy --mode validate");
    assert!(
        out.status.success(),
        "{} rejected:\n{}",
        config.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn plugin_wasm() -> String {
    let target = std::env::var("CARGO_TARGET_DIR")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../target").to_string());
    format!("{target}/wasm32-wasip1/wasm/prefixroute_plugin.wasm")
}

#[test]
#[ignore = "needs Envoy and the plugin build: run ./test.sh"]
fn the_reference_config_and_every_serve_config_pass_envoy_validation() {
    let wasm = plugin_wasm();
    let reference =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../envoy/envoy.yaml"))
            .unwrap();
    let path = temp("reference-envoy.yaml");
    std::fs::write(&path, reference.replace("@WASM@", &wasm)).unwrap();
    envoy_validates(&path);
    for policy in [
        "latency",
        "prefix",
        "prefix-only",
        "least-queue",
        "random",
        "round-robin",
        "least-request",
    ] {
        let out = Command::new(BIN)
            .args([
                "serve",
                "--policy",
                policy,
                "--plugin-wasm",
                &wasm,
                "--print-config",
            ])
            .args([
                "--endpoint",
                "a=http://127.0.0.1:18001",
                "--endpoint",
                "b=http://[::1]:18002",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let path = temp(&format!("serve-{policy}.yaml"));
        std::fs::write(&path, &out.stdout).unwrap();
        envoy_validates(&path);
    }
    // The other pool shapes: an EDS file Envoy watches, and a plugin given the list itself.
    let eds = temp("validate-pool/eds.yaml");
    std::fs::create_dir_all(eds.parent().unwrap()).unwrap();
    std::fs::write(&eds, "resources: []\n").unwrap();
    for (name, pool) in [
        ("eds", vec!["--eds-file", eds.to_str().unwrap()]),
        (
            "static",
            vec!["--static-pool", "--endpoint", "a=http://127.0.0.1:18001"],
        ),
    ] {
        let out = Command::new(BIN)
            .args(["serve", "--plugin-wasm", &wasm, "--print-config"])
            .args(&pool)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let path = temp(&format!("serve-pool-{name}.yaml"));
        std::fs::write(&path, &out.stdout).unwrap();
        envoy_validates(&path);
    }
}
