//! The pool discovered from Envoy's admin `/clusters` through the real `.wasm`: the callout it
//! sends, the members it routes to, and what a bad answer changes (nothing, counted).

use host_tests::{CalloutReply, HostOptions, Vm};
use serde_json::json;

use crate::common::{self, address, chat_body, destinations, endpoint_of, page};

/// A host whose Envoy has the admin cluster the configuration names.
fn host() -> host_tests::Host {
    common::host_with(HostOptions {
        clusters: vec!["prefixroute_metrics".into(), "admin".into()],
        ..HostOptions::default()
    })
}

fn discovering() -> serde_json::Value {
    json!({
        "discovery": {"cluster": "admin", "pool_cluster": "pool", "interval_ms": 1000},
        "block_size": 16,
        "seed": 7,
    })
}

/// An admin page whose `pool` cluster has endpoints `members` (indices into `address`).
fn admin_page(members: &[usize]) -> Vec<u8> {
    let hosts: Vec<serde_json::Value> = members
        .iter()
        .map(|&i| {
            let (ip, port) = address(i)
                .rsplit_once(':')
                .map(|(a, p)| (a.to_string(), p.parse::<u16>().unwrap()))
                .unwrap();
            json!({"address": {"socket_address": {"address": ip, "port_value": port}},
                   "hostname": format!("pod-{i}"),
                   "health_status": {"eds_health_status": "HEALTHY"}})
        })
        .collect();
    json!({"cluster_statuses": [{"name": "pool", "host_statuses": hosts}]})
        .to_string()
        .into_bytes()
}

/// Ticks once and answers the discovery callout with `discovery`, every scrape with a page.
/// Returns whether a discovery callout went out.
fn tick(vm: &mut Vm, discovery: &CalloutReply) -> bool {
    vm.tick().unwrap();
    let mut discovered = false;
    for c in vm.pending_callouts() {
        let reply = if c.cluster == "admin" {
            assert_eq!(c.headers.get_str(":method").as_deref(), Some("GET"));
            assert_eq!(
                c.headers.get_str(":path").as_deref(),
                Some("/clusters?format=json")
            );
            discovered = true;
            discovery.clone()
        } else {
            assert_eq!(c.cluster, "prefixroute_metrics");
            CalloutReply::ok(page(0.0, 0.0, 0.1))
        };
        vm.answer_callout(c.token, reply).unwrap();
    }
    discovered
}

fn routed_to(vm: &mut Vm, question: &str) -> Vec<usize> {
    let rt = vm
        .round_trip(&host_tests::Request::chat(chat_body("s", question)))
        .unwrap();
    destinations(&rt.exchange)
        .iter()
        .map(|a| endpoint_of(a))
        .collect()
}

#[test]
fn requests_go_to_the_discovered_members_and_follow_their_changes() {
    let host = host();
    let mut vm = common::configured(&host, &discovering());
    // Nothing discovered yet: no destination, so Envoy's fallback policy picks.
    let rt = vm
        .round_trip(&host_tests::Request::chat(chat_body("s", "early")))
        .unwrap();
    assert!(rt.exchange.upstream_values(common::DEST).is_empty());
    assert_eq!(host.stats().value("prefixroute.fallback.no_endpoints"), 1);
    // The answer says so, and names no endpoint (the plugin chose none).
    assert_eq!(
        rt.response_header("x-prefixroute-fallback").as_deref(),
        Some("no_endpoints")
    );
    assert_eq!(rt.response_header("x-prefixroute-endpoint"), None);

    assert!(tick(&mut vm, &CalloutReply::ok(admin_page(&[0, 1, 2]))));
    assert_eq!(host.stats().value("prefixroute.pool.members"), 3);
    assert_eq!(host.stats().value("prefixroute.pool.added"), 3);
    for q in 0..8 {
        let list = routed_to(&mut vm, &format!("q{q}"));
        assert_eq!(list.len(), 3, "chosen plus two failover endpoints");
        assert!(list.iter().all(|&e| e < 3), "{list:?}");
    }
    // One interval later endpoint 1 is gone and 5 joined.
    host.clock().advance_ms(1000);
    assert!(tick(&mut vm, &CalloutReply::ok(admin_page(&[0, 2, 5]))));
    let mut seen = [0; 6];
    for q in 0..12 {
        let list = routed_to(&mut vm, &format!("later {q}"));
        assert!(!list.contains(&1), "{list:?}");
        seen[list[0]] += 1;
    }
    assert!(seen[5] > 0, "the new member gets requests: {seen:?}");
    assert_eq!(host.stats().value("prefixroute.pool.removed"), 1);
    assert!(vm.trapped().is_none());
}

#[test]
fn a_failing_or_garbage_discovery_keeps_the_pool_and_is_counted_without_trapping() {
    let host = host();
    let mut vm = common::configured(&host, &discovering());
    assert!(tick(&mut vm, &CalloutReply::ok(admin_page(&[0, 1]))));
    let bad = [
        CalloutReply::ok("<html>not json</html>"),
        CalloutReply::ok(r#"{"cluster_statuses":[{"name":"other"}]}"#),
        CalloutReply::ok(vec![0xff, 0x00, 0x7b]),
        CalloutReply::status(503, "no healthy upstream"),
        CalloutReply::Timeout,
        CalloutReply::ConnectFailure,
        CalloutReply::Reset,
    ];
    for reply in &bad {
        host.clock().advance_ms(1000);
        assert!(tick(&mut vm, reply), "{reply:?}");
        let list = routed_to(&mut vm, &format!("{reply:?}"));
        assert!(list.iter().all(|&e| e < 2) && list.len() == 2, "{list:?}");
    }
    assert_eq!(host.stats().value("prefixroute.discovery.parse_errors"), 3);
    assert_eq!(host.stats().value("prefixroute.discovery.failures"), 4);
    assert_eq!(host.stats().value("prefixroute.pool.changes"), 1);
    // An empty pool is a membership too: requests then get no destination.
    host.clock().advance_ms(1000);
    assert!(tick(&mut vm, &CalloutReply::ok(admin_page(&[]))));
    let rt = vm
        .round_trip(&host_tests::Request::chat(chat_body("s", "empty")))
        .unwrap();
    assert!(rt.exchange.upstream_values(common::DEST).is_empty());
    assert!(vm.trapped().is_none());
}

#[test]
fn a_missing_admin_cluster_is_counted_every_interval_and_routing_goes_on() {
    let host = common::host();
    let mut vm = common::configured(&host, &discovering());
    for _ in 0..3 {
        assert!(
            !tick(&mut vm, &CalloutReply::Reset),
            "no callout can be sent"
        );
        host.clock().advance_ms(1000);
    }
    assert_eq!(
        host.stats().value("prefixroute.discovery.dispatch_errors"),
        3
    );
    let rt = vm
        .round_trip(&host_tests::Request::chat(chat_body("s", "q")))
        .unwrap();
    assert!(rt.exchange.upstream_values(common::DEST).is_empty());
    assert!(vm.trapped().is_none());
}

#[test]
fn a_discovered_pool_ticks_fast_until_its_first_membership_and_every_worker_routes_on_it_at_once() {
    let host = host();
    let mut w = [
        common::configured(&host, &discovering()),
        common::configured(&host, &discovering()),
    ];
    // The regular tick is a quarter of the 1 s scrape interval; before any membership the
    // root asks for a 10 ms tick so the discovery goes out right after a start.
    assert_eq!(w[0].tick_period_ms(), 10);
    assert_eq!(w[1].tick_period_ms(), 10);

    // Worker 0's first tick wins the discovery lease; its answer is published in shared data.
    assert!(tick(&mut w[0], &CalloutReply::ok(admin_page(&[0, 1, 2]))));
    assert_eq!(
        w[0].tick_period_ms(),
        250,
        "the pool is known: the regular tick"
    );

    // Worker 1 has not ticked since: its next request reads the published membership
    // instead of falling back to Envoy's pick until its own next tick.
    let list = routed_to(&mut w[1], "right after the start");
    assert_eq!(list.len(), 3, "{list:?}");
    assert!(list.iter().all(|&e| e < 3), "{list:?}");
    assert_eq!(host.stats().value("prefixroute.fallback.no_endpoints"), 0);

    // Worker 1's tick then finds the pool known and slows down at once.
    assert!(
        !tick(&mut w[1], &CalloutReply::Reset),
        "the lease is worker 0's"
    );
    assert_eq!(w[1].tick_period_ms(), 250);
    assert!(w.iter().all(|vm| vm.trapped().is_none()));
}

#[test]
fn a_discovery_that_never_answers_backs_the_fast_tick_off_to_the_regular_one() {
    let host = common::host();
    let mut vm = common::configured(&host, &discovering());
    let mut periods = vec![vm.tick_period_ms()];
    for _ in 0..8 {
        assert!(!tick(&mut vm, &CalloutReply::Reset), "no admin cluster");
        host.clock().advance_ms(u64::from(vm.tick_period_ms()));
        periods.push(vm.tick_period_ms());
    }
    assert_eq!(periods, [10, 20, 40, 80, 160, 250, 250, 250, 250]);
    // Requests meanwhile fall back, each counted, never trapped.
    let rt = vm
        .round_trip(&host_tests::Request::chat(chat_body("s", "q")))
        .unwrap();
    assert!(rt.exchange.upstream_values(common::DEST).is_empty());
    assert_eq!(host.stats().value("prefixroute.fallback.no_endpoints"), 1);
    assert!(vm.trapped().is_none());
}
