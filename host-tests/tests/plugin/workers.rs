//! Several VMs (Envoy workers) over one shared-data store: affinity across workers and exact
//! in-flight accounting.

use host_tests::{CalloutReply, Request, Vm};
use serde_json::json;

use crate::common::{self, chat_body, config, destination, endpoint_of, name, page};

fn match_of(rt: &host_tests::RoundTrip) -> (usize, usize) {
    let m = rt
        .response_header("x-prefixroute-match")
        .expect("match header");
    let (a, b) = m.split_once('/').unwrap();
    (a.parse().unwrap(), b.parse().unwrap())
}

#[test]
fn a_tenants_second_request_on_another_worker_lands_on_the_same_endpoint() {
    let host = common::host();
    let c = config(4, json!({}));
    let mut w = [common::configured(&host, &c), common::configured(&host, &c)];
    let mut cold_picks = Vec::new();
    for t in 0..8 {
        let system = common::tenant_prompt(100 + t);
        let (first, second) = if t % 2 == 0 { (0, 1) } else { (1, 0) };
        let a = w[first]
            .round_trip(&Request::chat(chat_body(&system, "where is my order?")))
            .unwrap();
        let b = w[second]
            .round_trip(&Request::chat(chat_body(&system, "cancel it, please")))
            .unwrap();
        let (ea, eb) = (
            endpoint_of(&destination(&a.exchange)),
            endpoint_of(&destination(&b.exchange)),
        );
        assert_eq!(
            ea, eb,
            "tenant {t}: worker {first} sent it to {ea}, worker {second} to {eb}"
        );
        assert_eq!(match_of(&a).0, 0, "first request is cold");
        let (m, total) = match_of(&b);
        assert!(
            m > 0 && m < total,
            "second request reuses the prefix: {m}/{total}"
        );
        cold_picks.push(ea);
    }
    // Cold prefixes spread over the endpoints although they arrive on different workers:
    // no-hit-lru's memory is shared.
    let mut first_four = cold_picks[..4].to_vec();
    first_four.sort();
    assert_eq!(first_four, [0, 1, 2, 3], "{cold_picks:?}");
}

/// Per-endpoint in-flight gauges each VM publishes on its tick.
fn gauges(host: &host_tests::Host, n: usize) -> Vec<i64> {
    (0..n)
        .map(|e| {
            host.stats()
                .value(&format!("prefixroute.endpoint.{}.in_flight", name(e)))
        })
        .collect()
}

/// Sum of the in-flight counts in every published instance record
/// (`prefixroute/ledger/<slot>`: layout u8, nonce u64, heartbeat u64, lane fit 8 × f64,
/// hold 2 × f64, growth 8 × f64, live_at_ms f64, n u16, n × (endpoint u64, in_flight u32,
/// prefilling u32, prefill_tokens u64, busy_ms f64, work_tokens f64, sent_prompt u64,
/// sent_predicted_cached u64, live_groups f64, recent_requests f64)).
fn published_total(host: &host_tests::Host) -> u64 {
    const HEAD: usize = 1 + 8 + 8 + 8 * 8 + 2 * 8 + 8 * 8 + 8;
    host.shared()
        .scan("prefixroute", "prefixroute/ledger/")
        .into_iter()
        .map(|(_, v)| {
            let n = u16::from_le_bytes([v[HEAD], v[HEAD + 1]]) as usize;
            (0..n)
                .map(|i| {
                    let at = HEAD + 2 + i * 72 + 8;
                    u64::from(u32::from_le_bytes(v[at..at + 4].try_into().unwrap()))
                })
                .sum::<u64>()
        })
        .sum()
}

#[test]
fn in_flight_counts_summed_across_workers_are_exact_after_interleaved_starts_and_ends() {
    let host = common::host();
    let n = 3;
    let c = config(n, json!({}));
    // Two workers route; the third VM is the main thread, which only ticks.
    let mut vms: Vec<Vm> = (0..3).map(|_| common::configured(&host, &c)).collect();
    let mut open: Vec<(usize, u32, usize)> = Vec::new();
    let mut expected = vec![0i64; n];
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut checks = 0;
    for step in 0..240 {
        host.clock().advance_ms(20);
        let r = next();
        if r % 5 < 3 || open.is_empty() {
            let k = (r >> 8) as usize % 2;
            let request = if (r >> 16) % 4 == 0 {
                Request::new("GET", "/v1/models", Vec::new())
            } else {
                Request::chat(chat_body(
                    &common::tenant_prompt((r >> 20) as usize % 5),
                    &format!("q{step}"),
                ))
            };
            let x = vms[k].send(&request).unwrap();
            let e = endpoint_of(&destination(&x));
            expected[e] += 1;
            open.push((k, x.id, e));
        } else {
            let (k, id, e) = open.remove((r >> 8) as usize % open.len());
            // Some end normally, some are reset before any response: both release.
            if r % 2 == 0 {
                vms[k].respond(id, 200).unwrap();
            }
            vms[k].finish(id).unwrap();
            expected[e] -= 1;
        }
        if step % 12 == 11 {
            for vm in vms.iter_mut() {
                common::tick_and_answer(vm, |_| CalloutReply::ok(page(0.0, 0.0, 0.1)));
                assert_eq!(
                    gauges(&host, n),
                    expected,
                    "VM {} at step {step}",
                    vm.index()
                );
                checks += 1;
            }
            assert_eq!(published_total(&host), expected.iter().sum::<i64>() as u64);
        }
    }
    assert_eq!(checks, 60);
    // Everything ends: every view goes back to zero.
    for (k, id, _) in open.drain(..) {
        vms[k].finish(id).unwrap();
    }
    for vm in vms.iter_mut() {
        vm.tick().unwrap();
        assert_eq!(gauges(&host, n), vec![0; n]);
    }
    assert!(vms.iter().all(|vm| vm.trapped().is_none()));
}

#[test]
fn a_dead_workers_in_flight_requests_stop_counting_after_its_heartbeat_goes_stale() {
    let host = common::host();
    let c = config(2, json!({}));
    let mut alive = common::configured(&host, &c);
    let mut dead = common::configured(&host, &c);
    for i in 0..3 {
        dead.send(&Request::new("GET", &format!("/v1/models?{i}"), Vec::new()))
            .unwrap();
    }
    alive.tick().unwrap();
    let total = |host: &host_tests::Host| gauges(host, 2).iter().sum::<i64>();
    assert_eq!(total(&host), 3);
    drop(dead); // its VM was reloaded: no more heartbeats, no more releases
    let start = host.clock().now_ms();
    while host.clock().now_ms() <= start + 3000 {
        host.clock().advance_ms(250);
        alive.tick().unwrap();
        let expect = if host.clock().now_ms() - start > 3000 {
            0
        } else {
            3
        };
        assert_eq!(
            total(&host),
            expect,
            "at +{} ms",
            host.clock().now_ms() - start
        );
    }
}

/// Every conditional write loses its race (as if other workers always wrote first): the
/// plugin gives up after its bounded retries, counts it, and still routes every request.
#[test]
fn under_constant_cas_contention_requests_still_route_and_give_ups_are_counted() {
    let host = common::host();
    let c = config(3, json!({}));
    let mut w1 = common::configured(&host, &c);
    let mut w2 = common::configured(&host, &c);
    // Registries, index clocks and buckets exist first, so that their writes are conditional.
    for vm in [&mut w1, &mut w2] {
        common::route(vm, &chat_body(&common::tenant_prompt(1), "warm up"));
        vm.tick().unwrap();
    }
    let (_, _, mismatches_before) = host.shared().counters();
    host.shared().interfere(u32::MAX);
    for i in 0..10 {
        let vm = if i % 2 == 0 { &mut w1 } else { &mut w2 };
        let rt = vm
            .round_trip(&Request::chat(chat_body(&common::tenant_prompt(i), "q")))
            .unwrap();
        destination(&rt.exchange);
        assert!(rt.response_header("x-prefixroute-policy").is_some());
    }
    w1.tick().unwrap();
    host.shared().interfere(0);
    let (_, _, mismatches) = host.shared().counters();
    assert!(mismatches > mismatches_before + 50, "{mismatches}");
    assert!(host.stats().value("prefixroute.shared_data.cas_give_ups") > 0);
    assert!(w1.trapped().is_none() && w2.trapped().is_none());
}

#[test]
fn a_holder_busy_by_one_workers_counts_but_not_by_every_workers_keeps_its_prefix() {
    // Two workers over six endpoints. Worker 1 routes 30 tenants' first questions (spread over
    // the endpoints, about 5 each); then worker 0 routes a document's questions, all to its
    // holder, and four tenants of its own. At the document's fifth question worker 0 has
    // routed 8 requests: by its own counts the document is hot (3 starts on one holder against
    // 1.5 × 8/6) and its holder over the bound (4 against 2 × 8/6 + 0.5), so a build that
    // weighed the holder by them copied the document (its whole prefill, for balance). By both
    // workers' counts the holder took about 9 of 38, under 2 × 38/6 + 0.5: it keeps them all.
    let host = common::host();
    let c = config(6, json!({}));
    let mut w = [common::configured(&host, &c), common::configured(&host, &c)];
    let scrape = |_| CalloutReply::ok(page(0.0, 0.0, 0.1));
    for vm in w.iter_mut() {
        common::tick_and_answer(vm, scrape);
    }
    let route = |w: &mut [Vm; 2], k: usize, system: &str, q: &str| {
        host.clock().advance_ms(5);
        let rt = w[k]
            .round_trip(&Request::chat(chat_body(system, q)))
            .unwrap();
        endpoint_of(&destination(&rt.exchange))
    };
    for t in 0..30 {
        route(
            &mut w,
            1,
            &common::tenant_prompt(600 + t),
            "where is my order?",
        );
    }
    // Worker 0 learns its peer at its tick.
    for vm in w.iter_mut() {
        common::tick_and_answer(vm, scrape);
    }
    let doc = common::tenant_prompt(500);
    // Questions of full blocks, so that none ends where the last one did (that would make it
    // the document's next turn, not a new group).
    let question = |q: usize| {
        format!(
            "question {q}: {}",
            "what do the terms say of it? ".repeat(6)
        )
    };
    let holder = route(&mut w, 0, &doc, &question(0));
    for t in 0..4 {
        route(
            &mut w,
            0,
            &common::tenant_prompt(700 + t),
            "where is my order?",
        );
    }
    for q in 1..5 {
        assert_eq!(route(&mut w, 0, &doc, &question(q)), holder);
    }
    assert_eq!(route(&mut w, 0, &doc, &question(5)), holder);
}
