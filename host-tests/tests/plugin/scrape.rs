//! The scrape path: leases across root contexts, metrics changing decisions, failures,
//! staleness.

use host_tests::{CalloutReply, Vm};
use serde_json::json;

use crate::common::{self, chat_body, config, page, route, tick_and_answer};

fn least_queue(n: usize) -> serde_json::Value {
    config(n, json!({"policy": "least-queue"}))
}

/// Routes `count` distinct requests one after the other (each finished before the next, so
/// in-flight counts stay 0) and returns how many went to each endpoint.
fn spread(vm: &mut Vm, n: usize, count: usize, tag: &str) -> Vec<usize> {
    let mut hits = vec![0; n];
    for i in 0..count {
        hits[route(vm, &chat_body("s", &format!("{tag} {i}")))] += 1;
    }
    hits
}

/// Three workers and the main thread tick for 10 s with unaligned, drifting timers; every
/// scrape callout is answered at once. Returns the scrape times of each endpoint (ms from the
/// start) and the callouts each VM sent.
fn scrape_for_ten_seconds(interfere: bool) -> (Vec<Vec<u64>>, [usize; 4], host_tests::Host) {
    let host = common::host();
    let c = config(3, json!({}));
    let mut vms: Vec<Vm> = (0..4).map(|_| common::configured(&host, &c)).collect();
    assert!(vms.iter().all(|vm| vm.tick_period_ms() == 250));
    let start = host.clock().now_ms();
    let mut per_vm = [0usize; 4];
    let mut times: Vec<Vec<u64>> = vec![Vec::new(); 3];
    for step in 0..(10_000 / 10) {
        let elapsed = step * 10;
        host.clock().set_ms(start + elapsed);
        let period = elapsed / 250;
        for (k, vm) in vms.iter_mut().enumerate() {
            // Worker k ticks at a different offset in each 250 ms period, so a different
            // worker finds the lease due first.
            let offset = (60 * k as u64 + 70 * period) % 250 / 10 * 10;
            if elapsed % 250 != offset {
                continue;
            }
            // Every third period a concurrent writer makes one claim's CAS fail: that worker
            // loses the lease for that endpoint and must not scrape it (another one will).
            host.shared()
                .interfere(u32::from(interfere && period % 3 == 0));
            vm.tick().unwrap();
            host.shared().interfere(0);
            for c in vm.pending_callouts() {
                assert_eq!(c.cluster, "prefixroute_metrics");
                assert_eq!(c.headers.get_str(":method").as_deref(), Some("GET"));
                assert_eq!(c.headers.get_str(":path").as_deref(), Some("/metrics"));
                assert_eq!(c.timeout_ms, 500);
                let e = common::endpoint_of(&c.headers.get_str(":authority").unwrap());
                per_vm[k] += 1;
                times[e].push(elapsed);
                vm.answer_callout(c.token, CalloutReply::ok(page(0.0, 0.0, 0.1)))
                    .unwrap();
            }
        }
    }
    (times, per_vm, host)
}

#[test]
fn root_contexts_share_one_scrape_lease_per_endpoint() {
    let (times, per_vm, host) = scrape_for_ten_seconds(true);
    for (e, t) in times.iter().enumerate() {
        assert_eq!(t[0], 0, "endpoint {e} is scraped on the first tick");
        for (k, &at) in t.iter().enumerate() {
            // The lease is a grid: the k-th scrape belongs to the k-th interval, whoever ticks
            // and whoever loses a CAS race; late by at most the wait for the next tick plus a
            // lost race (the timers here drift, so under two tick periods). So never two
            // scrapes in one interval, and a late one does not push the next.
            let due = k as u64 * 1000;
            assert!((due..due + 500).contains(&at), "endpoint {e}: {t:?}");
        }
        assert!(t.len() >= 9, "endpoint {e}: {t:?}");
    }
    let total: usize = times.iter().map(Vec::len).sum();
    assert_eq!(host.stats().value("prefixroute.scrape.ok"), total as i64);
    assert!(
        per_vm.iter().filter(|&&n| n > 0).count() >= 2,
        "the lease moves between workers: {per_vm:?}"
    );
}

/// Envoy's timers fire a few milliseconds late, never early. The lease stays on its grid
/// (the next scrape is due one interval after the previous *due* time), so one worker and the
/// main thread (timers 100 ms apart) ticking every 250 ms with 0-4 ms of lateness for 30 s
/// still scrape each endpoint once per interval, with no gap of a whole extra tick.
#[test]
fn exactly_one_scrape_per_endpoint_per_interval_with_late_timers() {
    let host = common::host();
    let c = config(2, json!({}));
    let mut vms: Vec<Vm> = (0..2).map(|_| common::configured(&host, &c)).collect();
    let start = host.clock().now_ms();
    let mut times: Vec<Vec<u64>> = vec![Vec::new(); 2];
    let mut ticks: Vec<(u64, usize)> = Vec::new();
    for period in 0..120u64 {
        for k in 0..2 {
            // Worker k's timer started 100·k ms after the other's; lateness 0-4 ms.
            let late = common_mix(period * 2 + k as u64) % 5;
            ticks.push((period * 250 + 100 * k as u64 + late, k));
        }
    }
    ticks.sort();
    for (at, k) in ticks {
        host.clock().set_ms(start + at);
        for e in common::tick_and_answer(&mut vms[k], |_| CalloutReply::ok(page(0.0, 0.0, 0.1))) {
            times[e].push(at);
        }
    }
    for (e, t) in times.iter().enumerate() {
        let gaps: Vec<u64> = t.windows(2).map(|w| w[1] - w[0]).collect();
        // A scrape is late by at most the timers' own lateness, and none is skipped.
        assert!(
            gaps.iter().all(|&g| g <= 1005),
            "endpoint {e}: gaps {gaps:?}"
        );
        assert_eq!(t.len(), 30, "endpoint {e}: scraped at {t:?}");
    }
}

fn common_mix(x: u64) -> u64 {
    let x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[test]
fn a_scraped_queue_changes_routing() {
    let host = common::host();
    let mut vm = common::configured(&host, &least_queue(2));
    let waiting = |busy: usize| {
        move |e: usize| CalloutReply::ok(page(if e == busy { 9.0 } else { 1.0 }, 0.0, 0.1))
    };
    tick_and_answer(&mut vm, waiting(0));
    assert_eq!(spread(&mut vm, 2, 6, "a"), [0, 6]);
    host.clock().advance_ms(1000);
    assert_eq!(tick_and_answer(&mut vm, waiting(1)).len(), 2);
    assert_eq!(spread(&mut vm, 2, 6, "b"), [6, 0]);
}

#[test]
fn a_scraped_kv_cache_moves_a_warm_prefix_off_a_saturated_holder() {
    // The `prefix` policy's saturation filter (KV usage at 0.8 and above).
    let host = common::host();
    let mut vm = common::configured(&host, &config(2, json!({"policy": "prefix"})));
    tick_and_answer(&mut vm, |_| CalloutReply::ok(page(0.0, 0.0, 0.1)));
    let system = common::tenant_prompt(9);
    let holder = route(&mut vm, &chat_body(&system, "first"));
    assert_eq!(route(&mut vm, &chat_body(&system, "second")), holder);
    host.clock().advance_ms(1000);
    tick_and_answer(&mut vm, |e| {
        CalloutReply::ok(page(0.0, 0.0, if e == holder { 0.95 } else { 0.1 }))
    });
    let rt = vm
        .round_trip(&host_tests::Request::chat(chat_body(&system, "third")))
        .unwrap();
    assert_eq!(
        common::endpoint_of(&common::destination(&rt.exchange)),
        1 - holder
    );
    let m = rt.response_header("x-prefixroute-match").unwrap();
    assert!(
        m.starts_with("0/"),
        "the other endpoint holds nothing yet: {m}"
    );
}

/// The rule: a failed or timed-out callout marks the endpoint unmeasured (its load
/// scorers give 0) at once, not when its last good numbers go stale.
#[test]
fn a_failed_or_timed_out_scrape_makes_the_endpoint_unmeasured() {
    for failure in [
        CalloutReply::Timeout,
        CalloutReply::Reset,
        CalloutReply::ConnectFailure,
    ] {
        let host = common::host();
        let mut vm = common::configured(&host, &least_queue(2));
        tick_and_answer(&mut vm, |e| {
            CalloutReply::ok(page(if e == 0 { 0.0 } else { 3.0 }, 0.0, 0.1))
        });
        assert_eq!(spread(&mut vm, 2, 3, "before"), [3, 0]);
        host.clock().advance_ms(1000);
        tick_and_answer(&mut vm, |e| {
            if e == 0 {
                failure.clone()
            } else {
                CalloutReply::ok(page(3.0, 0.0, 0.1))
            }
        });
        // Endpoint 0 is unmeasured now (queue score 0); endpoint 1 is the only measured one
        // (queue score 1), so least-queue sends everything there.
        assert_eq!(spread(&mut vm, 2, 3, "after"), [0, 3], "{failure:?}");
    }
}

#[test]
fn failed_scrapes_take_an_endpoint_down_and_a_success_brings_it_back() {
    let host = common::host();
    let mut vm = common::configured(&host, &least_queue(2));
    let failures = [CalloutReply::Timeout, CalloutReply::Reset];
    for (round, failure) in failures.iter().enumerate() {
        tick_and_answer(&mut vm, |e| {
            if e == 0 {
                failure.clone()
            } else {
                CalloutReply::ok(page(5.0, 0.0, 0.1))
            }
        });
        host.clock().advance_ms(1000);
        assert_eq!(
            host.stats().value("prefixroute.scrape.failures"),
            round as i64 + 1
        );
    }
    assert_eq!(host.stats().value("prefixroute.endpoint_down"), 1);
    assert_eq!(
        vm.capture()
            .logs_containing(host_tests::LogLevel::Warn, "is down after 2 failed scrapes")
            .len(),
        1
    );
    // Down: excluded although its (unmeasured) queue cannot be compared.
    assert_eq!(spread(&mut vm, 2, 4, "down"), [0, 4]);
    tick_and_answer(&mut vm, |_| CalloutReply::ok(page(0.0, 0.0, 0.1)));
    assert_eq!(host.stats().value("prefixroute.endpoint_up"), 1);
    assert_eq!(host.stats().value("prefixroute.index_forgotten"), 1);
    let hits = spread(&mut vm, 2, 8, "up");
    assert!(hits[0] > 0, "back in rotation: {hits:?}");
}

#[test]
fn a_missing_scrape_cluster_is_refused_by_the_host_and_warned_about_once() {
    let host = common::host_with(host_tests::HostOptions {
        clusters: vec!["another_cluster".into()],
        ..host_tests::HostOptions::default()
    });
    let mut vm = common::configured(&host, &config(2, json!({})));
    vm.tick().unwrap();
    host.clock().advance_ms(1000);
    vm.tick().unwrap();
    // Envoy refuses a callout to a cluster it does not have: no callout is made...
    assert!(vm.callouts().is_empty());
    assert_eq!(host.stats().value("prefixroute.scrape.dispatch_errors"), 4);
    // ...and the operator hears about it once, not on every tick.
    assert_eq!(
        vm.capture()
            .logs_containing(
                host_tests::LogLevel::Warn,
                "cannot send scrape callouts through cluster"
            )
            .len(),
        1
    );
    // A refused callout is not the endpoint's fault: it stays up.
    assert_eq!(host.stats().value("prefixroute.endpoint_down"), 0);
}

#[test]
fn a_stale_scrape_expires_exactly_after_stale_after_ms() {
    let host = common::host();
    let c = config(
        2,
        json!({"policy": "least-queue", "scrape": {"interval_ms": 1000, "stale_after_ms": 3000}}),
    );
    let mut vm = common::configured(&host, &c);
    let scraped_at = host.clock().now_ms();
    tick_and_answer(&mut vm, |e| {
        CalloutReply::ok(page(if e == 0 { 9.0 } else { 0.0 }, 0.0, 0.1))
    });
    // No more scrapes: the callouts later ticks send are never answered. At exactly
    // stale_after_ms the numbers still count...
    host.clock().set_ms(scraped_at + 3000);
    assert_eq!(spread(&mut vm, 2, 12, "fresh"), [0, 12]);
    // ...one millisecond later both endpoints are unmeasured and tie: seeded random picks.
    host.clock().set_ms(scraped_at + 3001);
    let hits = spread(&mut vm, 2, 12, "stale");
    assert!(hits[0] > 0 && hits[1] > 0, "{hits:?}");
}

#[test]
fn an_unanswered_callout_times_out_like_envoy_and_counts_as_a_failure() {
    let host = common::host();
    let mut vm = common::configured(&host, &config(1, json!({})));
    vm.tick().unwrap();
    let pending = vm.pending_callouts();
    assert_eq!(pending.len(), 1);
    host.clock().advance_ms(499);
    assert_eq!(vm.expire_callouts().unwrap(), 0);
    host.clock().advance_ms(1);
    assert_eq!(vm.expire_callouts().unwrap(), 1);
    assert_eq!(host.stats().value("prefixroute.scrape.failures"), 1);
    // While a callout is outstanding, later ticks do not send another one to that endpoint.
    let host = common::host();
    let mut vm = common::configured(&host, &config(1, json!({})));
    vm.tick().unwrap();
    for _ in 0..3 {
        host.clock().advance_ms(250);
        vm.tick().unwrap();
    }
    host.clock().advance_ms(250);
    vm.tick().unwrap();
    assert_eq!(
        vm.callouts().len(),
        1,
        "one outstanding callout per endpoint"
    );
}
