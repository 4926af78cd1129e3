//! The simulated router reads the replicas as a gateway's scrapes show them: a snapshot every
//! `scrape_interval_ms`, not the replicas' state at each decision.

use prefixroute_core::config::Policy;
use prefixroute_sim::simulation::{SimConfig, SimError, Simulation};
use prefixroute_sim::trace::TraceRecord;
use serde_json::json;

/// One replica with one lane, two gateways taking turns, and three requests 10 ms apart, each
/// a different prompt of ~100 ms of prefill: the third request arrives while the first is
/// prefilling and the second waits behind it.
fn three_requests_on_one_lane(scrape_interval_ms: f64) -> Simulation {
    let trace: Vec<TraceRecord> = (0..3)
        .map(|i| TraceRecord {
            t: 0.05 + 0.01 * i as f64,
            group: format!("g{i}"),
            body: json!({
                "model": "m",
                "prompt": format!("request {i}: {}", "word ".repeat(200)),
                "max_tokens": 1,
            }),
        })
        .collect();
    let mut config = SimConfig {
        replicas: 1,
        gateways: 2,
        scrape_interval_ms,
        ..SimConfig::default()
    };
    config.timing.lanes = 1;
    config.timing.prefill_ms_per_token = 0.5;
    config.router.policy = Policy::Latency;
    let mut sim = Simulation::new(&trace, config).unwrap();
    sim.run();
    sim
}

/// What the third request's prediction counted as holding the replica's lane.
fn holders_seen_by_the_third(sim: &Simulation) -> f64 {
    let decision = &sim.steps()[2].decision;
    decision.scores[0].prediction.unwrap().backlog.holders
}

#[test]
fn a_gateway_sees_another_gateways_requests_only_through_a_scrape_taken_after_they_arrived() {
    // Gateway 0 routes requests 0 and 2, gateway 1 request 1. With a scrape at every decision
    // gateway 0 sees its own request and the other gateway's; with its last scrape taken at
    // 0 ms, before either arrived, only its own.
    assert_eq!(
        holders_seen_by_the_third(&three_requests_on_one_lane(0.0)),
        2.0
    );
    assert_eq!(
        holders_seen_by_the_third(&three_requests_on_one_lane(1000.0)),
        1.0
    );
    // Every 140 ms, spread over the two gateways: gateway 1 scrapes at 70 ms, right as the
    // third request arrives, but gateway 0, which routes it, last scraped at 0 ms.
    assert_eq!(
        holders_seen_by_the_third(&three_requests_on_one_lane(140.0)),
        1.0
    );
}

#[test]
fn a_scrape_interval_that_is_not_a_number_of_ms_is_refused() {
    for bad in [-1.0, f64::NAN, f64::INFINITY] {
        let config = SimConfig {
            scrape_interval_ms: bad,
            ..SimConfig::default()
        };
        let err = Simulation::new(&[], config).err();
        assert!(
            matches!(err, Some(SimError::ScrapeInterval(v)) if v.is_nan() == bad.is_nan()),
            "{bad}: {err:?}"
        );
    }
}
