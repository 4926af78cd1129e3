//! The scheduler over a discovered pool: several workers sharing one `MemShared` follow the
//! membership that one of them learned from an admin `/clusters` page.

use super::*;
use crate::shared::MemShared;
use prefixroute_core::config::DiscoveryConfig;

fn config(policy: Policy) -> PluginConfig {
    PluginConfig {
        discovery: Some(DiscoveryConfig {
            pool_cluster: "pool".into(),
            ..DiscoveryConfig::default()
        }),
        policy,
        block_size: 4,
        seed: 3,
        ..PluginConfig::default()
    }
}

/// An admin page listing `hosts` (`(port, hostname, healthy)`) in the pool cluster.
fn page(hosts: &[(u16, &str, bool)]) -> Vec<u8> {
    let hosts: Vec<serde_json::Value> = hosts
        .iter()
        .map(|&(port, hostname, healthy)| {
            serde_json::json!({
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                "hostname": hostname,
                "health_status": {"eds_health_status": if healthy { "HEALTHY" } else { "UNHEALTHY" }},
                "stats": [{"name": "rq_active", "type": "GAUGE"}],
            })
        })
        .collect();
    serde_json::json!({"cluster_statuses": [
        {"name": "prefixroute_metrics"},
        {"name": "pool", "host_statuses": hosts},
    ]})
    .to_string()
    .into_bytes()
}

/// One discovery round on `w`: claim, send, answer with `body`.
fn discover(w: &mut Scheduler<MemShared>, now: u64, body: &[u8]) -> DiscoveryOutcome {
    assert!(w.claim_discovery(now), "the discovery is due at {now}");
    w.discovery_sent(7, now);
    assert!(w.is_discovery(7));
    w.discovery_done(Some(200), body)
}

fn chat(system: &str, user: &str) -> Vec<u8> {
    serde_json::json!({"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]})
    .to_string()
    .into_bytes()
}

fn addresses(w: &Scheduler<MemShared>) -> Vec<String> {
    w.members().iter().map(|m| m.address.clone()).collect()
}

#[test]
fn before_the_first_discovery_the_pool_is_empty_and_requests_get_no_destination() {
    let mut w = Scheduler::new(MemShared::new(), config(Policy::Latency));
    let choice = w.route(&chat("s", "u"), 0);
    assert_eq!(choice.route, Route::Fallback(FallbackReason::NoEndpoints));
    assert_eq!(w.destination(&choice), None);
    // Its stream ends without touching any account.
    w.release(&choice.ticket, 5);
    assert!(w.drain_events().iter().any(|e| matches!(
        e,
        Event::Fallback {
            reason: FallbackReason::NoEndpoints,
            ..
        }
    )));
}

#[test]
fn one_worker_discovers_and_every_worker_follows_on_its_next_tick() {
    let host = MemShared::new();
    let mut w1 = Scheduler::new(host.clone(), config(Policy::Latency));
    let mut w2 = Scheduler::new(host.clone(), config(Policy::Latency));
    let outcome = discover(&mut w1, 0, &page(&[(8002, "b", true), (8001, "a", true)]));
    let DiscoveryOutcome::Applied(Some(change)) = outcome else {
        panic!("{outcome:?}")
    };
    assert_eq!(change.added, ["127.0.0.1:8001", "127.0.0.1:8002"]);
    assert_eq!(addresses(&w1), ["127.0.0.1:8001", "127.0.0.1:8002"]);
    assert_eq!(w1.name(0), "a");
    assert!(w1.drain_events().iter().any(|e| matches!(
        e,
        Event::MembershipChanged {
            added: 2,
            removed: 0,
            updated: 0
        }
    )));
    // The lease: w2 may not call again within the interval.
    assert!(!w2.claim_discovery(10));
    assert_eq!(w2.endpoints(), 0);
    w2.tick(10);
    assert_eq!(addresses(&w2), addresses(&w1));
    // A prefix routed by one worker is found by the other.
    let system = "You are the helpful assistant of a shop. ".repeat(8);
    let first = w1.route(&chat(&system, "hi"), 20);
    let second = w2.route(&chat(&system, "hello"), 21);
    assert_eq!(first.endpoint, second.endpoint);
    // The destination lists the other member for a retry.
    let other = 1 - first.endpoint;
    assert_eq!(
        w1.destination(&first).unwrap(),
        format!("{},{}", w1.address(first.endpoint), w1.address(other))
    );
}

#[test]
fn an_unchanged_page_changes_nothing_and_the_lease_moves_on_each_interval() {
    let host = MemShared::new();
    let mut w = Scheduler::new(host.clone(), config(Policy::Latency));
    let body = page(&[(8001, "a", true)]);
    discover(&mut w, 0, &body);
    w.drain_events();
    assert!(!w.claim_discovery(999), "not due before one interval");
    assert_eq!(
        discover(&mut w, 1000, &body),
        DiscoveryOutcome::Applied(None)
    );
    assert!(!w
        .drain_events()
        .iter()
        .any(|e| matches!(e, Event::MembershipChanged { .. })));
}

#[test]
fn a_new_member_gets_traffic_and_a_removed_one_gets_none_after_the_change() {
    let host = MemShared::new();
    let mut w1 = Scheduler::new(host.clone(), config(Policy::LeastQueue));
    let mut w2 = Scheduler::new(host.clone(), config(Policy::LeastQueue));
    discover(&mut w1, 0, &page(&[(8001, "a", true), (8002, "b", true)]));
    w2.tick(1);
    discover(
        &mut w1,
        1000,
        &page(&[(8001, "a", true), (8002, "b", true), (8003, "c", true)]),
    );
    w2.tick(1001);
    let mut seen = Vec::new();
    for i in 0..6 {
        let c = w2.route(&chat("s", &format!("question {i}")), 1002);
        seen.push(w2.name(c.endpoint).to_string());
    }
    assert!(seen.iter().any(|n| n == "c"), "{seen:?}");
    discover(
        &mut w1,
        2000,
        &page(&[(8001, "a", true), (8003, "c", true)]),
    );
    w2.tick(2001);
    for i in 0..20 {
        let c = w2.route(&chat("s", &format!("later {i}")), 2002 + i);
        let destination = w2.destination(&c).unwrap();
        assert!(!destination.contains(":8002"), "{destination}");
    }
    assert!(w2
        .drain_events()
        .iter()
        .any(|e| *e == Event::EndpointLeft("b".into())));
    // Index 1 was `b` and is `c` now: the stats named by index must be named again.
    assert_eq!(w2.stat_names().names, ["a", "c"]);
    let generation = w2.stat_names().generation;
    assert_ne!(generation, 0);
    discover(
        &mut w1,
        3000,
        &page(&[(8001, "a", true), (8003, "c", false)]),
    );
    w2.tick(3001);
    assert_eq!(
        w2.stat_names().generation,
        generation,
        "the same names (c is unhealthy, not gone) keep their generation"
    );
}

#[test]
fn the_same_name_at_a_new_address_is_a_new_endpoint_that_holds_nothing() {
    let host = MemShared::new();
    let mut w = Scheduler::new(host.clone(), config(Policy::PrefixOnly));
    discover(&mut w, 0, &page(&[(8001, "a", true)]));
    let system = "A long shared system prompt about the billing policy. ".repeat(6);
    let Route::Routed { cold, .. } = w.route(&chat(&system, "1"), 10).route else {
        panic!()
    };
    assert!(cold);
    let Route::Routed { cold, .. } = w.route(&chat(&system, "2"), 20).route else {
        panic!()
    };
    assert!(!cold, "the prefix is believed held");
    // Pod "a" restarted at a new port.
    discover(&mut w, 1000, &page(&[(9001, "a", true)]));
    assert_eq!(w.address(0), "127.0.0.1:9001");
    let Route::Routed { cold, .. } = w.route(&chat(&system, "3"), 1010).route else {
        panic!()
    };
    assert!(cold, "nothing of the old address carries over");
}

#[test]
fn an_address_that_comes_back_starts_with_an_empty_belief() {
    let host = MemShared::new();
    let mut w = Scheduler::new(host.clone(), config(Policy::PrefixOnly));
    let both = page(&[(8001, "a", true), (8002, "b", true)]);
    discover(&mut w, 0, &both);
    let system = "Shared instructions for every ticket of tenant nine. ".repeat(6);
    let first = w.route(&chat(&system, "1"), 10);
    let holder = w.address(first.endpoint).to_string();
    let port: u16 = holder.rsplit(':').next().unwrap().parse().unwrap();
    let survivor = if port == 8001 { 8002 } else { 8001 };
    discover(&mut w, 1000, &page(&[(survivor, "x", true)]));
    discover(&mut w, 2000, &both);
    let again = w.route(&chat(&system, "2"), 2010);
    let Route::Routed { cold, .. } = again.route else {
        panic!()
    };
    assert!(cold, "the returning address's old blocks are not believed");
}

#[test]
fn an_unhealthy_member_stays_in_the_pool_but_gets_no_request() {
    let host = MemShared::new();
    let mut w = Scheduler::new(host.clone(), config(Policy::Latency));
    discover(&mut w, 0, &page(&[(8001, "a", true), (8002, "b", false)]));
    assert_eq!(w.endpoints(), 2);
    for i in 0..10 {
        let c = w.route(&chat("s", &format!("{i}")), 10 + i);
        assert_eq!(w.name(c.endpoint), "a");
        assert_eq!(w.destination(&c).unwrap(), "127.0.0.1:8001");
        let f = w.fallback(FallbackReason::NotRoutable, 10 + i);
        assert_eq!(w.name(f.endpoint), "a");
    }
}

#[test]
fn a_failed_or_garbage_discovery_keeps_the_last_membership_and_is_counted() {
    let host = MemShared::new();
    let mut w = Scheduler::new(host.clone(), config(Policy::Latency));
    discover(&mut w, 0, &page(&[(8001, "a", true)]));
    w.drain_events();
    assert!(w.claim_discovery(1000));
    w.discovery_sent(8, 1000);
    assert_eq!(
        w.discovery_done(Some(503), b"no"),
        DiscoveryOutcome::Failed(Some(503))
    );
    let outcome = discover(&mut w, 2000, b"{\"cluster_statuses\": 7");
    assert!(
        matches!(outcome, DiscoveryOutcome::Unusable(_)),
        "{outcome:?}"
    );
    let outcome = discover(&mut w, 3000, br#"{"cluster_statuses":[]}"#);
    assert_eq!(
        outcome,
        DiscoveryOutcome::Unusable(r#"cluster "pool" is not in Envoy's /clusters answer"#.into())
    );
    assert_eq!(addresses(&w), ["127.0.0.1:8001"]);
    let events = w.drain_events();
    assert!(events.contains(&Event::Discovery(CalloutEnd::Failed)));
    assert_eq!(
        events
            .iter()
            .filter(|e| **e == Event::Discovery(CalloutEnd::Unparseable))
            .count(),
        2
    );
}

#[test]
fn a_lost_discovery_callout_does_not_block_the_next_one_forever() {
    let mut w = Scheduler::new(MemShared::new(), config(Policy::Latency));
    assert!(w.claim_discovery(0));
    w.discovery_sent(1, 0);
    // No answer ever comes: once the timeout and an interval have passed, the next is sent.
    assert!(!w.claim_discovery(1000));
    assert!(w.claim_discovery(1501));
}

#[test]
fn requests_in_flight_across_a_change_release_on_the_endpoint_they_went_to() {
    let host = MemShared::new();
    let mut w = Scheduler::new(host.clone(), config(Policy::LeastQueue));
    discover(&mut w, 0, &page(&[(8002, "b", true), (8003, "c", true)]));
    let mut tickets = Vec::new();
    for i in 0..4 {
        tickets.push(w.route(&chat("s", &format!("{i}")), 10).ticket);
    }
    let before: Vec<u32> = w.ledger.local().iter().map(|x| x.in_flight).collect();
    assert_eq!(before.iter().sum::<u32>(), 4);
    // "a" joins in front: every index shifts by one, and "c" leaves.
    discover(&mut w, 1000, &page(&[(8001, "a", true), (8002, "b", true)]));
    let b = w.members().iter().position(|m| m.name == "b").unwrap();
    assert_eq!(b, 1);
    assert_eq!(w.ledger.local()[b].in_flight, before[0]);
    for t in &tickets {
        w.release(t, 1100);
    }
    let after: Vec<u32> = w.ledger.local().iter().map(|x| x.in_flight).collect();
    assert_eq!(after, [0, 0]);
}
