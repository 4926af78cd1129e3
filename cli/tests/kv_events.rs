//! KV events end to end over real ZMQ: `fake-server --kv-events` publishes what its cache does,
//! a subscriber written with vLLM's own msgspec schema decodes it, and `prefixroute kv-events`
//! turns it into the router's block hashes for the plugin.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use prefixroute_core::feed::FeedPage;
use prefixroute_core::hashing::{hash_request, BlockIdentity, HashConfig};
use prefixroute_core::request::parse_request;
use support::{free_port, http, FakeServer, Killed, Served, BIN};

/// A fake server publishing KV events on a free port; returns it and its ZMQ endpoint.
fn publishing(name: &str, extra: &[&str]) -> (FakeServer, String) {
    let mut args = vec![
        "--kv-events",
        "tcp://127.0.0.1:0",
        "--prefill-ms-per-token",
        "0",
    ];
    args.extend_from_slice(extra);
    let server = FakeServer::start(name, &args);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let endpoint = server.log.lock().unwrap().iter().find_map(|l| {
            l.strip_prefix(&format!("fake-server {name} publishing KV events on "))
                .map(str::to_string)
        });
        if let Some(endpoint) = endpoint {
            return (server, endpoint);
        }
        assert!(Instant::now() < deadline, "no publishing line");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A prompt of more than one block, new every time (so the cache stores something).
fn warm() -> String {
    format!("{:?} ", Instant::now()).repeat(8)
}

fn completion(prompt: &str) -> String {
    serde_json::json!({"model": "cc-sim", "prompt": prompt, "max_tokens": 1}).to_string()
}

/// The router's full-block hashes of a completion body.
fn router_blocks(body: &str, block_size: usize) -> Vec<u64> {
    let request = parse_request(body.as_bytes()).unwrap();
    hash_request(
        &request,
        HashConfig {
            block_size,
            include_partial: false,
            identity: BlockIdentity::TokenIds,
            ..HashConfig::default()
        },
    )
    .chains
    .concat()
}

fn python() -> String {
    std::env::var("PREFIXROUTE_PYTHON")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../.venv/bin/python").into())
}

#[test]
#[ignore = "needs pyzmq and msgspec in .venv: run ./test.sh"]
fn the_fake_servers_events_decode_with_vllms_schema() {
    let (server, endpoint) = publishing("kv-a", &["--kv-blocks", "4", "--block-size", "4"]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/kv/subscriber.py");
    let mut sub = Command::new(python())
        .args([script, &endpoint, "2", "10"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the Python subscriber");
    // PUB drops what is sent before a subscriber joins: wait until it says it subscribed.
    let mut err = sub.stderr.take().unwrap();
    let mut first = [0u8; 10];
    err.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"subscribed");
    std::thread::sleep(Duration::from_millis(300));
    let a = completion("one two three four five six seven eight nine ten");
    let b = completion("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu");
    assert_eq!(server.post("/v1/completions", &a).status, 200);
    assert_eq!(server.post("/v1/completions", &b).status, 200);
    let out = sub.wait_with_output().unwrap();
    assert!(out.status.success(), "subscriber failed");
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["seq"], 0);
    assert_eq!(lines[1]["seq"], 1);
    assert_eq!(
        lines[0]["topic"],
        format!("kv@127.0.0.1:{}@cc-sim", server.port)
    );
    let stored = &lines[0]["events"][0];
    assert_eq!(stored["type"], "BlockStored");
    assert_eq!(stored["block_size"], 4);
    assert_eq!(stored["medium"], "GPU");
    assert!(stored["parent_block_hash"].is_null());
    // 10 tokens: two full blocks, their 8 token ids.
    assert_eq!(stored["block_hashes"].as_array().unwrap().len(), 2);
    assert_eq!(stored["token_ids"].as_array().unwrap().len(), 8);
    // 13 more tokens (3 blocks) into a 4-block cache: one of the first prompt's is evicted.
    let kinds: Vec<&str> = lines[1]["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["BlockStored", "BlockRemoved"]);
    let removed = &lines[1]["events"][1]["block_hashes"][0];
    assert!(stored["block_hashes"].as_array().unwrap().contains(removed));
}

fn relay(publishers: &[(u16, &str)], block_size: usize) -> (Killed, u16) {
    let mut args = vec!["--block-size".to_string(), block_size.to_string()];
    for (http_port, endpoint) in publishers {
        args.push("--publisher".into());
        args.push(format!("127.0.0.1:{http_port}={endpoint}"));
    }
    start_relay(&args)
}

/// `prefixroute kv-events --listen 127.0.0.1:<free port> ARGS…`, once it accepts connections.
fn start_relay(args: &[String]) -> (Killed, u16) {
    let port = free_port();
    let child = Killed(
        Command::new(BIN)
            .args(["kv-events", "--listen", &format!("127.0.0.1:{port}")])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "relay did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    (child, port)
}

/// The feed page since `since`, read raw (it is binary).
fn feed(port: u16, since: u64) -> FeedPage {
    feed_waiting(port, since, 0)
}

/// [`feed`] as a long poll: the relay may hold it up to `wait_ms` for news.
fn feed_waiting(port: u16, since: u64, wait_ms: u64) -> FeedPage {
    let query = format!("since={since}&wait_ms={wait_ms}&layout=2");
    FeedPage::decode(&feed_raw(port, &query)).unwrap()
}

/// The body of `GET /v1/kv/feed?QUERY` (binary).
fn feed_raw(port: u16, query: &str) -> Vec<u8> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        stream,
        "GET /v1/kv/feed?{query} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let at = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    raw.split_off(at)
}

/// Waits until the relay has seen `n` messages from every server.
fn wait_for_messages(port: u16, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let stats = http(port, "GET", "/stats", None).json();
        let all = stats["servers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["messages"].as_u64() >= Some(n));
        if all {
            return;
        }
        assert!(Instant::now() < deadline, "relay stats: {stats}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_relay_serves_each_servers_blocks_in_the_routers_own_hashes() {
    let (a, a_events) = publishing("kv-r1", &["--kv-blocks", "64"]);
    let (b, b_events) = publishing("kv-r2", &["--kv-blocks", "64"]);
    let (_relay, port) = relay(&[(a.port, &a_events), (b.port, &b_events)], 16);
    // The SUB sockets connect in the background: send until the relay has seen events.
    let prompt = "The quick brown fox jumps over the lazy dog again and again. ".repeat(8);
    let body = completion(&prompt);
    let deadline = Instant::now() + Duration::from_secs(10);
    let heard = |i: usize| http(port, "GET", "/stats", None).json()["servers"][i]["messages"] != 0;
    while !(heard(0) && heard(1)) {
        assert!(Instant::now() < deadline);
        a.post("/v1/completions", &completion(&warm()));
        b.post("/v1/completions", &completion(&warm()));
        std::thread::sleep(Duration::from_millis(50));
    }
    let before = feed(port, 0).version;
    assert_eq!(a.post("/v1/completions", &body).status, 200);
    let other = completion(&"Unrelated words for the second server only. ".repeat(5));
    b.post("/v1/completions", &other);
    wait_for_messages(port, 2);
    std::thread::sleep(Duration::from_millis(200));
    let page = feed(port, before);
    assert!(!page.reset);
    let expected = router_blocks(&body, 16);
    assert!(!expected.is_empty());
    let server_a = page
        .servers
        .iter()
        .find(|s| s.address == format!("127.0.0.1:{}", a.port))
        .unwrap();
    assert!(server_a.live);
    for h in &expected {
        assert!(
            server_a.stored.contains(h),
            "{h:x} not in {:x?}",
            server_a.stored
        );
    }
    // The request's blocks came in one event: one run, from the chain's start to its end, so
    // a gateway that did not route it learns where it ended.
    assert!(
        server_a.runs.iter().any(|r| r.parent.is_none()
            && r.end == *expected.last().unwrap()
            && r.blocks as usize == expected.len()),
        "{:x?}",
        server_a.runs
    );
    let server_b = page
        .servers
        .iter()
        .find(|s| s.address.ends_with(&b.port.to_string()));
    let b_blocks = router_blocks(&other, 16);
    let server_b = server_b.unwrap();
    assert!(b_blocks.iter().all(|h| server_b.stored.contains(h)));
    assert!(expected.iter().all(|h| !server_b.stored.contains(h)));
    // A fetcher that does not ask for layout 2 (a plugin from before runs) gets layout 1:
    // the same blocks, no runs.
    let old = feed_raw(port, &format!("since={before}"));
    assert_eq!(old[4], 1, "layout 1");
    let old = FeedPage::decode(&old).unwrap();
    assert_eq!(old.servers[0].stored, page.servers[0].stored);
    assert!(old.servers.iter().all(|s| s.runs.is_empty()));
    // Asked again from the new version: nothing new.
    let again = feed(port, page.version);
    assert!(again
        .servers
        .iter()
        .all(|s| s.stored.is_empty() && s.removed.is_empty()));
    // A long poll from there waits for the next change and brings it: the request goes out
    // first, the completion 300 ms later (a relay that answered at once would send nothing).
    let since = page.version;
    let poll = std::thread::spawn(move || feed_waiting(port, since, 20_000));
    std::thread::sleep(Duration::from_millis(300));
    let third = completion(&"A third prompt, asked while the gateway waits. ".repeat(5));
    assert_eq!(a.post("/v1/completions", &third).status, 200);
    let news = poll.join().unwrap();
    assert!(news.version > since);
    let server_a = news
        .servers
        .iter()
        .find(|s| s.address == format!("127.0.0.1:{}", a.port))
        .unwrap();
    assert!(router_blocks(&third, 16)
        .iter()
        .all(|h| server_a.stored.contains(h)));
    // With nothing new it answers an empty page when the wait is over.
    let quiet = feed_waiting(port, news.version, 200);
    assert_eq!(quiet.version, news.version);
    assert!(quiet.servers.iter().all(|s| s.stored.is_empty()));
}

#[test]
fn a_publisher_that_goes_away_is_not_live_and_comes_back_from_empty() {
    let (a, endpoint) = publishing("kv-gone", &["--kv-blocks", "64"]);
    let (_relay, port) = relay(&[(a.port, &endpoint)], 16);
    let deadline = Instant::now() + Duration::from_secs(10);
    while http(port, "GET", "/stats", None).json()["servers"][0]["messages"] == 0 {
        assert!(Instant::now() < deadline);
        a.post("/v1/completions", &completion(&warm()));
        std::thread::sleep(Duration::from_millis(50));
    }
    let v = feed(port, 0).version;
    drop(a);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let stats = http(port, "GET", "/stats", None).json();
        if stats["servers"][0]["live"] == false {
            assert_eq!(stats["servers"][0]["blocks"], 0);
            assert_eq!(stats["servers"][0]["disconnects"], 1);
            break;
        }
        assert!(Instant::now() < deadline, "never noticed: {stats}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let page = feed(port, v);
    assert!(!page.servers[0].live && page.servers[0].cleared);
}

/// `prefixroute serve` in front of `replicas` (r0, r1, …) with `extra` flags, once the pool
/// is discovered and the feed fetched (both every 200 ms).
fn serve(replicas: &[&FakeServer], extra: &[&str]) -> Served {
    let mut args: Vec<String> = ["--policy", "prefix-only", "--scrape-interval-ms", "200"]
        .iter()
        .chain(&["--discovery-interval-ms", "200"])
        .map(|a| a.to_string())
        .collect();
    for (i, r) in replicas.iter().enumerate() {
        args.push("--endpoint".into());
        args.push(format!("r{i}=http://127.0.0.1:{}", r.port));
    }
    args.extend(extra.iter().map(|a| a.to_string()));
    let served = support::serve(&args);
    std::thread::sleep(Duration::from_millis(1200));
    served
}

fn chat(tenant: &str) -> String {
    serde_json::json!({
        "model": "cc-sim",
        "max_tokens": 1,
        "messages": [
            {"role": "system", "content": format!("You are the assistant of {tenant}. {}", "Answer in full sentences. ".repeat(12))},
            {"role": "user", "content": "What can you do?"},
        ],
    })
    .to_string()
}

/// Sends `tenant`'s request through Envoy; returns (served by, matched blocks).
fn through(port: u16, tenant: &str) -> (String, usize) {
    let reply = http(port, "POST", "/v1/chat/completions", Some(&chat(tenant)));
    assert_eq!(reply.status, 200, "{}", reply.body);
    let matched = reply
        .header("x-prefixroute-match")
        .and_then(|m| m.split('/').next())
        .and_then(|m| m.parse().ok())
        .expect("routed by the plugin");
    (reply.header("x-served-by").unwrap().to_string(), matched)
}

#[test]
#[ignore = "needs Envoy and the plugin build: run ./test.sh"]
fn an_evicted_prefix_is_routed_cold_with_precise_events_and_believed_with_the_approximate_index() {
    let small = ["--kv-blocks", "24", "--block-size", "16"];
    for index in ["approximate", "precise"] {
        let (r0, e0) = publishing("r0", &small);
        let (r1, e1) = publishing("r1", &small);
        let (_relay, relay_port) = relay(&[(r0.port, &e0), (r1.port, &e1)], 16);
        // ZMQ's slow joiner: what is published before the relay's subscription is in place is
        // lost, so wait until the relay hears both servers.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let stats = http(relay_port, "GET", "/stats", None).json();
            let heard = |i: usize| stats["servers"][i]["messages"].as_u64() > Some(0);
            if heard(0) && heard(1) {
                break;
            }
            assert!(Instant::now() < deadline, "relay never heard: {stats}");
            for r in [&r0, &r1] {
                r.post("/v1/completions", &completion(&warm()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut extra = vec!["--index", index];
        let relay_addr = format!("127.0.0.1:{relay_port}");
        if index == "precise" {
            extra.extend(["--kv-relay", relay_addr.as_str()]);
        }
        let envoy = serve(&[&r0, &r1], &extra);
        let (port, admin) = (envoy.port, envoy.admin);
        let (holder, _) = through(port, "tenant-a");
        let (again, matched) = through(port, "tenant-a");
        assert_eq!(again, holder, "{index}: the prefix stays home");
        assert!(matched > 0, "{index}: and is found there");
        // Other tenants fill the holder's cache directly (not through this gateway) until
        // tenant-a's blocks are evicted there.
        let replica = if holder == "r0" { &r0 } else { &r1 };
        // 10 tenants of ~6 blocks each through a 24-block LRU: every block of tenant-a goes.
        for t in 0..10 {
            let filler = chat(&format!("filler-{t}"));
            assert_eq!(replica.post("/v1/chat/completions", &filler).status, 200);
        }
        std::thread::sleep(Duration::from_millis(800));
        let (_, matched) = through(port, "tenant-a");
        let stats = http(admin, "GET", "/stats?filter=prefixroute", None).body;
        if index == "precise" {
            let relay_stats = http(relay_port, "GET", "/stats", None).body;
            assert_eq!(
                matched, 0,
                "precise: the eviction was reported, so it routes cold\n{stats}\n{relay_stats}"
            );
            assert!(
                stats.contains("wasmcustom.prefixroute.kv.removed"),
                "{stats}"
            );
        } else {
            assert!(matched > 0, "approximate: still believed (stale)");
        }
    }
}

#[test]
fn publishers_that_connect_to_a_bound_relay_are_known_by_their_topic() {
    let zmq = free_port();
    let bind = format!("tcp://127.0.0.1:{zmq}");
    let (_relay, port) = start_relay(&[
        "--bind".into(),
        bind.clone(),
        "--max-servers".into(),
        "8".into(),
    ]);
    let server = FakeServer::start("kv-pod", &["--kv-events-to", &bind]);
    let address = format!("127.0.0.1:{}", server.port);
    // ZMQ's slow joiner: until the relay's subscription has reached the publisher, what it
    // sends is dropped, so new prompts (new blocks, new events) until the relay names it.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !feed(port, 0).servers.iter().any(|s| s.address == address) {
        assert!(
            Instant::now() < deadline,
            "the relay never named the server by its topic"
        );
        assert_eq!(
            server.post("/v1/completions", &completion(&warm())).status,
            200
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let before = feed(port, 0).version;
    let body = completion(&"Documents about the pool and its pods move around. ".repeat(6));
    let expected = router_blocks(&body, 16);
    assert_eq!(server.post("/v1/completions", &body).status, 200);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let page = feed(port, before);
        let mine = page.servers.iter().find(|s| s.address == address).unwrap();
        if expected.iter().all(|h| mine.stored.contains(h)) {
            assert!(mine.live);
            break;
        }
        assert!(Instant::now() < deadline, "the blocks never came: {mine:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let stats = http(port, "GET", "/stats", None).json();
    assert_eq!(stats["unknown_topics"], 0);
}
