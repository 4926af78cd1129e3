//! Replicas that come and go during a run (`prefixroute simulate --fleet-event`): the router
//! stops using a replica that went away at once, believes nothing of a new one, and forgets a
//! restarted one at its next scrape. The simulator is deterministic, so these are exact
//! properties of this code.

mod common;

use common::{six_replicas, spec};
use prefixroute_core::config::Policy;
use prefixroute_sim::fleet::FleetEvent;
use prefixroute_sim::simulation::{
    upper_bound, SimConfig, SimReport, Simulation, SCRAPE_INTERVAL_MS,
};
use prefixroute_sim::trace::{TraceRecord, TraceShape, TraceSpec};

/// `prefixroute trace --shape tenants --tenants 24 --prompt-words 600 --question-words 40
/// --rate R --requests N --seed S`.
fn tenants(rate: f64, requests: usize, seed: u64) -> Vec<TraceRecord> {
    TraceSpec {
        rate,
        ..spec(TraceShape::Tenants, 24, 600, 40, requests, seed)
    }
    .generate()
    .unwrap()
}

/// The sweep's `tenants` fleet: six replicas caching a third of the tenants each, 4 lanes.
fn fleet(policy: Policy, ms_per_token: f64) -> SimConfig {
    let mut config = six_replicas(420, ms_per_token);
    config.router.policy = policy;
    config
}

fn events(specs: &[&str]) -> Vec<FleetEvent> {
    specs.iter().map(|s| s.parse().unwrap()).collect()
}

/// The run's report, its TTFT p95 over the upper bound's (one server, unlimited cache) on the
/// same trace, and the bound's report.
fn against_bound(
    sim: &Simulation,
    trace: &[TraceRecord],
    config: SimConfig,
) -> (SimReport, f64, SimReport) {
    let (report, bound) = (sim.report(), upper_bound(trace, config).unwrap());
    let ratio = report.ttft_p95_ms / bound.ttft_p95_ms;
    (report, ratio, bound)
}

fn run(trace: &[TraceRecord], config: SimConfig, fleet: &[&str]) -> Simulation {
    let mut sim = Simulation::new(trace, config)
        .unwrap()
        .with_fleet_events(&events(fleet))
        .unwrap();
    sim.run();
    sim
}

#[test]
fn a_replica_gets_no_request_while_it_is_down_and_its_share_once_it_is_up() {
    let trace = tenants(20.0, 400, 11);
    for policy in [Policy::Latency, Policy::RoundRobin] {
        let sim = run(
            &trace,
            fleet(policy, 0.5),
            &["down:5@0", "up:5@10", "down:1@5"],
        );
        let on = |replica: usize, from: f64, to: f64| {
            sim.steps()
                .iter()
                .filter(|s| s.decision.endpoint == replica && (from..to).contains(&s.t))
                .count()
        };
        assert_eq!(on(5, 0.0, 10.0), 0, "{policy}: replica-5 before it joined");
        assert_eq!(on(1, 5.0, f64::MAX), 0, "{policy}: replica-1 after it left");
        assert!(on(1, 0.0, 5.0) > 0, "{policy}: replica-1 before it left");
        if policy == Policy::RoundRobin {
            // Every fifth request once five replicas are up again.
            assert!(on(5, 10.0, f64::MAX) >= 35, "{}", on(5, 10.0, f64::MAX));
        }
    }
}

#[test]
fn a_restarted_replica_is_believed_empty_from_its_next_scrape_on() {
    let trace = tenants(20.0, 400, 11);
    let restart_ms = 10_250.0;
    let seen_ms = 11_000.0;
    assert_eq!(
        seen_ms,
        ((restart_ms / SCRAPE_INTERVAL_MS).floor() + 1.0) * SCRAPE_INTERVAL_MS
    );
    let sim = run(&trace, fleet(Policy::Latency, 0.5), &["restart:0@10.25"]);
    // Sent to replica-0 believing some of the prompt there, and none of it was.
    let false_hits = |from: f64, to: f64| {
        sim.steps()
            .iter()
            .filter(|s| {
                s.decision.endpoint == 0
                    && (from..to).contains(&(s.t * 1000.0))
                    && s.decision.matched_blocks() > 0
                    && s.served.cached_tokens == 0
            })
            .count()
    };
    assert_eq!(false_hits(0.0, restart_ms), 0);
    assert!(
        false_hits(restart_ms, seen_ms) > 0,
        "the stale belief routes to the restarted replica until the scrape"
    );
    assert_eq!(
        false_hits(seen_ms, f64::MAX),
        0,
        "after the scrape every believed block there was recorded since the restart"
    );
    // With the servers' KV events, the restart is known at once.
    let mut precise = fleet(Policy::Latency, 0.5);
    precise.index = prefixroute_core::config::IndexMode::Precise;
    let sim = run(&trace, precise, &["restart:0@10.25"]);
    assert_eq!(sim.belief_check().false_hits, 0);
}

#[test]
fn the_groups_of_replicas_that_went_away_are_not_piled_onto_one() {
    // Two of six replicas go away 8 s into a 60 req/s tenants trace at 1 ms per token: eight
    // tenants need a new home at once, ~0.75 s of prefill each. Before the prediction capped
    // its lanes by what a queueing server runs, every one of them went to the replica whose
    // learned rate was a few percent lower (each seeing no queue there): TTFT p95 684 ms,
    // 9.9x the upper bound's.
    let trace = tenants(60.0, 1200, 13);
    let config = fleet(Policy::Latency, 1.0);
    let sim = run(&trace, config, &["down:1@8", "down:2@8"]);
    let (report, ratio, bound) = against_bound(&sim, &trace, config);
    assert!(ratio <= 2.0, "p95 {ratio:.2}x the bound's");
    assert!(report.hit_rate >= 0.99 * bound.hit_rate);
}

#[test]
fn displaced_groups_spread_by_the_prefill_work_in_flight() {
    // The scale-in above, on the seeds where `latency` still trailed `prefix` once the lanes
    // were capped: the displaced tenants, cached nowhere, each saw a free lane on the replica
    // whose learned rate was lowest, so four of eight stacked there (seed 11: TTFT p95 111.7
    // ms, `prefix` 71.0, bound 69.0), its own tenants queued behind their prefills, and it
    // held more system prompts than its cache. Priced with the work in flight spread over
    // the fewest plausible lanes, they spread.
    //
    // Measured with a scrape at every decision, as this was tuned. With the plugin's 1 s
    // scrapes they spread as well, but seed 11's p95 was 1.13x the bound's: the scrape that
    // shows the queues comes up to a second after the scale-in (docs/benchmarks.md).
    for seed in [11, 13] {
        let trace = tenants(60.0, 1200, seed);
        let config = SimConfig {
            scrape_interval_ms: 0.0,
            ..fleet(Policy::Latency, 1.0)
        };
        let sim = run(&trace, config, &["down:1@8", "down:2@8"]);
        let home = |from: f64, to: f64| {
            let mut homes = std::collections::BTreeMap::new();
            for s in sim.steps().iter().filter(|s| (from..to).contains(&s.t)) {
                homes.entry(s.group.clone()).or_insert(s.decision.endpoint);
            }
            homes
        };
        let before = home(0.0, 8.0);
        let after = home(8.0, f64::MAX);
        let mut taken = [0usize; 6];
        for (group, old) in &before {
            if [1, 2].contains(old) {
                taken[after[group]] += 1;
            }
        }
        assert_eq!(taken.iter().sum::<usize>(), 8, "seed {seed}: {taken:?}");
        assert!(
            taken.iter().all(|&n| n <= 3),
            "seed {seed}: displaced tenants per replica {taken:?}"
        );
    }
    // The tail over twelve seeds: one seed's p95 moves by a few requests when the block hashes
    // change (it went from 1.03x to 1.11x the bound's at seed 11, and from 1.44x to 1.06x at
    // seed 18, when the blocks were hashed by their text; docs/benchmarks.md).
    let ratios: Vec<f64> = (11..=22)
        .map(|seed| {
            let trace = tenants(60.0, 1200, seed);
            let config = SimConfig {
                scrape_interval_ms: 0.0,
                ..fleet(Policy::Latency, 1.0)
            };
            let sim = run(&trace, config, &["down:1@8", "down:2@8"]);
            against_bound(&sim, &trace, config).1
        })
        .collect();
    let mean = ratios.iter().sum::<f64>() / ratios.len() as f64;
    assert!(
        mean <= 1.12,
        "mean p95 {mean:.3}x the bound's: {ratios:.2?}"
    );
    assert!(
        ratios.iter().filter(|&&r| r <= 1.1).count() >= 9,
        "p95 over 1.1x the bound's on more than three seeds: {ratios:.2?}"
    );
}

#[test]
fn fleet_events_naming_a_replica_the_fleet_lacks_are_refused() {
    let trace = tenants(20.0, 10, 11);
    let err = Simulation::new(&trace, fleet(Policy::Latency, 0.5))
        .unwrap()
        .with_fleet_events(&events(&["down:6@1"]))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("the fleet has 6 replicas (replica-0 to replica-5)"),
        "{err}"
    );
}

#[test]
fn a_replica_whose_engine_failed_costs_five_retried_tries_then_leaves_the_rotation() {
    // Replica 0's engine dies 2 s in; its pod, HTTP server and scrapes live on, so nothing but
    // its answers says so. Each gateway retries the failed tries on the failover list and
    // takes it out after five in a row, for 30 s: longer than the rest of this trace.
    let trace = tenants(20.0, 400, 11);
    for policy in [Policy::Latency, Policy::RoundRobin] {
        for gateways in [1, 3] {
            let config = SimConfig {
                gateways,
                ..fleet(policy, 0.5)
            };
            let sim = run(&trace, config, &["fail:0@2"]);
            let report = sim.report();
            assert_eq!(
                report.failed_requests, 0,
                "{policy}, {gateways}: a retry answers"
            );
            assert_eq!(
                report.failed_tries,
                5 * gateways,
                "{policy}, {gateways}: five per gateway, then out of rotation"
            );
            let retried: Vec<_> = sim
                .steps()
                .iter()
                .filter(|s| !s.failed_tries.is_empty())
                .collect();
            assert!(retried.iter().all(|s| s.failed_tries == [0]
                && s.replica().is_some_and(|r| r != 0)
                && s.served.ttft_ms >= 2.5));
            let last_retried = retried.last().map_or(0.0, |s| s.t);
            assert!(
                sim.steps()
                    .iter()
                    .filter(|s| s.t > last_retried)
                    .all(|s| s.decision.endpoint != 0),
                "{policy}, {gateways}: chosen after its ejection"
            );
            assert_eq!(
                report.requests_per_replica[0],
                sim.steps()
                    .iter()
                    .filter(|s| s.t < 2.0 && s.decision.endpoint == 0)
                    .count()
            );
        }
    }
}

#[test]
fn requests_whose_every_try_fails_are_counted_and_left_out_of_the_latencies() {
    // Three of six replicas fail at once; a request chosen for one of them with its two
    // failover replicas failing too gets the last 503, until the ejections take them out.
    let trace = tenants(20.0, 400, 11);
    let sim = run(
        &trace,
        fleet(Policy::RoundRobin, 0.5),
        &["fail:0@2", "fail:1@2", "fail:2@2"],
    );
    let report = sim.report();
    let failed: Vec<_> = sim.steps().iter().filter(|s| s.failed).collect();
    assert_eq!(report.failed_requests, failed.len());
    assert!(!failed.is_empty());
    assert!(failed.iter().all(|s| s.replica().is_none()
        && s.failed_tries.len() == 3
        && s.served.prompt_tokens == 0));
    assert_eq!(
        report.requests_per_replica.iter().sum::<usize>(),
        report.requests - report.failed_requests
    );
    assert!(report.failed_tries <= 5 * 3, "{}", report.failed_tries);
}

#[test]
fn a_new_pod_in_a_failed_ones_slot_is_routed_to_at_once_and_a_restart_waits_out_the_ejection() {
    let trace = tenants(20.0, 400, 11);
    let chosen_after = |sim: &Simulation, t: f64| {
        sim.steps()
            .iter()
            .filter(|s| s.t >= t && s.decision.endpoint == 0)
            .count()
    };
    // Replaced by a new pod (a new address): nothing of the old one's failures counts.
    let sim = run(
        &trace,
        fleet(Policy::RoundRobin, 0.5),
        &["fail:0@2", "down:0@5", "up:0@6"],
    );
    assert_eq!(sim.report().failed_tries, 5);
    assert!(chosen_after(&sim, 6.0) > 0);
    // Restarted in place (the same address): its ejection runs its 30 s, as Envoy's would.
    let sim = run(
        &trace,
        fleet(Policy::RoundRobin, 0.5),
        &["fail:0@2", "restart:0@6"],
    );
    assert_eq!(sim.report().failed_tries, 5);
    assert_eq!(chosen_after(&sim, 6.0), 0);
}
