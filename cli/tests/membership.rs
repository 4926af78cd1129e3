//! The pool changing under real Envoy (2 workers) during a replay: members added, removed and
//! moved through a file-based EDS cluster that Envoy watches, and a replica killed mid-replay.
//! The plugin discovers the pool from Envoy's admin interface; the route retries connect
//! failures and resets on the failover endpoints the plugin lists after the chosen one.
//!
//! `#[ignore]`d for a plain `cargo test` (they need Envoy and the release plugin build);
//! `./test.sh` runs them with `--ignored`.

mod support;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::{http, temp, FakeServer, Served, BIN};

const FAST: [&str; 8] = [
    "--scrape-interval-ms",
    "200",
    "--scrape-timeout-ms",
    "150",
    "--stale-after-ms",
    "1000",
    "--discovery-interval-ms",
    "300",
];

/// Replicas whose prefill is cheap enough that 50 req/s never queues on two of them.
fn replica(name: &str) -> FakeServer {
    FakeServer::start(name, &["--prefill-ms-per-token", "0.05", "--lanes", "8"])
}

fn serve(pool: &[&str]) -> Served {
    let args: Vec<&str> = FAST.iter().chain(pool).copied().collect();
    support::serve(&args)
}

impl Served {
    /// The plugin's (`wasmcustom.prefixroute.*`) and the pool cluster's stats.
    fn stat(&self, name: &str) -> u64 {
        let stats = http(self.admin, "GET", "/stats", None);
        stats
            .body
            .lines()
            .find_map(|l| {
                l.strip_prefix(name)?
                    .strip_prefix(": ")?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or(0)
    }

    /// Waits until every worker could have applied a pool of `members` (the gauge is set by
    /// the VM that applied it; one more discovery interval lets the others follow).
    fn wait_for_pool(&self, members: u64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.stat("wasmcustom.prefixroute.pool.members") != members {
            assert!(
                Instant::now() < deadline,
                "the plugin never saw {members} members; see {}",
                self.log.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(400));
    }
}

/// Writes the pool cluster's EDS file the way Envoy wants a watched file replaced: a new file
/// in the same directory, renamed over the old one.
fn write_eds(path: &Path, members: &[(&str, u16)]) {
    let hosts: Vec<Value> = members
        .iter()
        .map(|(name, port)| {
            json!({"endpoint": {"hostname": name, "address": {"socket_address": {
                "address": "127.0.0.1", "port_value": port}}}})
        })
        .collect();
    let eds = json!({"resources": [{
        "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
        "cluster_name": "prefixroute_pool",
        "endpoints": [{"lb_endpoints": hosts}],
    }]});
    let next = path.with_extension("next");
    std::fs::write(&next, eds.to_string()).unwrap();
    std::fs::rename(&next, path).unwrap();
}

/// Starts `prefixroute replay --json` of a fresh trace against Envoy: 40 tenants, so new
/// prefixes keep arriving (where a new member is the best place for them) while the earlier
/// ones come back (where a member that leaves holds some).
fn start_replay(served: &Served, rate: u32, requests: u32) -> Child {
    let trace = temp(&format!("trace-{}.jsonl", served.port));
    let rate = rate.to_string();
    let requests = requests.to_string();
    let out = Command::new(BIN)
        .args(["trace", "--shape", "tenants", "--tenants", "40"])
        .args(["--rate", &rate, "--requests", &requests, "--seed", "3"])
        .arg("-o")
        .arg(&trace)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Command::new(BIN)
        .arg("replay")
        .arg(&trace)
        .args(["--url", &format!("http://127.0.0.1:{}", served.port)])
        .args(["--json", "--timeout-s", "20", "--no-progress"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn finish_replay(replay: Child) -> Value {
    let out = replay.wait_with_output().unwrap();
    assert!(out.status.success(), "replay failed");
    serde_json::from_slice(&out.stdout).unwrap()
}

fn assert_no_errors(report: &Value, served: &Served) {
    // What Envoy saw of the failures and retries, to say why a request was lost.
    let retries: Vec<String> = http(served.admin, "GET", "/stats?filter=prefixroute_pool", None)
        .body
        .lines()
        .filter(|l| {
            l.contains("retry") || l.contains("fail") || l.contains("5xx") || l.contains("reset")
        })
        .filter(|l| !l.ends_with(": 0"))
        .map(str::to_string)
        .collect();
    assert_eq!(
        report["errors"],
        0,
        "lost requests: {} {}; Envoy log {}; Envoy: {retries:?}",
        report["errors_by_kind"],
        report["error_examples"],
        served.log.display()
    );
    assert_eq!(report["succeeded"], report["requests"]);
}

fn queries(replica: &FakeServer) -> f64 {
    replica
        .metrics()
        .prefix_cache_queries_total
        .expect("the fake server counts queries")
}

#[test]
#[ignore = "needs Envoy and the plugin build: run ./test.sh"]
fn the_pool_follows_a_watched_eds_file_during_a_replay_with_no_errors() {
    let a = replica("a");
    let b = replica("b");
    let c = replica("c");
    let eds = temp("pool/eds.json");
    std::fs::create_dir_all(eds.parent().unwrap()).unwrap();
    write_eds(&eds, &[("a", a.port), ("b", b.port)]);
    let served = serve(&["--eds-file", eds.to_str().unwrap()]);
    served.wait_for_pool(2);

    // 50 req/s for 10 s.
    let replay = start_replay(&served, 50, 500);
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(queries(&c), 0.0, "c is not a member yet");
    write_eds(&eds, &[("a", a.port), ("b", b.port), ("c", c.port)]);
    served.wait_for_pool(3);
    std::thread::sleep(Duration::from_millis(1500));
    let routed_to_c = served.stat("wasmcustom.prefixroute.routed.latency.c");
    assert!(
        routed_to_c > 0 && queries(&c) > 0.0,
        "the new member gets requests the latency policy chose for it ({routed_to_c})"
    );

    // Remove a: once the plugin has seen it, no decision names it and it serves nothing new.
    write_eds(&eds, &[("b", b.port), ("c", c.port)]);
    served.wait_for_pool(2);
    let (routed_to_a, served_by_a) = (
        served.stat("wasmcustom.prefixroute.routed.latency.a"),
        queries(&a),
    );

    // Move b to a new port (a restarted pod): a new endpoint under the old name.
    let b2 = replica("b");
    write_eds(&eds, &[("b", b2.port), ("c", c.port)]);
    served.wait_for_pool(2);
    std::thread::sleep(Duration::from_millis(300));
    drop(b);
    let report = finish_replay(replay);
    assert_no_errors(&report, &served);
    assert_eq!(
        served.stat("wasmcustom.prefixroute.routed.latency.a"),
        routed_to_a,
        "a was chosen after it left the pool"
    );
    assert_eq!(queries(&a), served_by_a, "a served requests after it left");
    assert!(queries(&b2) > 0.0, "b at its new port gets requests");
    assert!(served.stat("wasmcustom.prefixroute.pool.changes") >= 4);
    assert_eq!(
        served.stat("wasmcustom.prefixroute.fallback.no_endpoints"),
        0
    );
}

#[test]
#[ignore = "needs Envoy and the plugin build: run ./test.sh"]
fn a_replica_killed_mid_replay_at_60_requests_per_second_loses_no_request() {
    let replicas: Vec<FakeServer> = ["replica-0", "replica-1", "replica-2"]
        .iter()
        .map(|n| replica(n))
        .collect();
    let mut pool = Vec::new();
    for r in &replicas {
        pool.push("--endpoint".to_string());
        pool.push(format!("{}=http://127.0.0.1:{}", replica_name(r), r.port));
    }
    let pool: Vec<&str> = pool.iter().map(String::as_str).collect();
    let served = serve(&pool);
    served.wait_for_pool(3);
    let replay = start_replay(&served, 60, 600);
    std::thread::sleep(Duration::from_secs(3));
    // Kill the replica the plugin sends the most to (the home of the most tenants): it keeps
    // being chosen until the scrapes mark it down, so requests do reach it dead. Which one
    // that is depends on timing (a fixed one was once home to too few tenants to be sent
    // anything in that gap, and the failover assertion below had nothing to see).
    let names: Vec<String> = replicas.iter().map(replica_name).collect();
    let routed = |name: &str| served.stat(&format!("wasmcustom.prefixroute.routed.latency.{name}"));
    let busiest = (0..names.len()).max_by_key(|&i| routed(&names[i])).unwrap();
    let mut replicas = replicas;
    let killed = replicas.remove(busiest);
    let before = queries(&killed);
    let routed_before = routed(&names[busiest]);
    drop(killed);
    let report = finish_replay(replay);
    assert!(before > 0.0, "the killed replica had been serving");
    assert_no_errors(&report, &served);
    let sent_to_dead = routed(&names[busiest]) - routed_before;
    assert!(
        sent_to_dead > 0,
        "the plugin routed requests to {} after it was killed, before marking it down",
        names[busiest]
    );
    assert!(
        served.stat("cluster.prefixroute_pool.upstream_rq_retry_success") > 0,
        "the failover path was exercised: {sent_to_dead} requests sent to the dead replica, \
         none retried; see {}",
        served.log.display()
    );
}

fn replica_name(r: &FakeServer) -> String {
    let reply = r.get("/v1/models");
    reply
        .header("x-served-by")
        .expect("the fake server names itself")
        .to_string()
}
