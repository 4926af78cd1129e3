//! `index: precise` in the simulator: the replicas publish what their caches do and the
//! router's belief follows, against the router's own approximate belief, on one trace.

mod common;

use common::{latency_report, sweep_conversations, sweep_fleet};
use prefixroute_core::config::{IndexMode, Policy};
use prefixroute_sim::simulation::{BeliefCheck, SimConfig, Simulation};
use prefixroute_sim::summary::max_over_mean;
use prefixroute_sim::trace::{TraceRecord, TraceShape, TraceSpec};

/// 24 tenants through caches that hold about half of them, whose size the replicas do not
/// report (llm-d's default belief of 31,250 blocks): the approximate belief keeps believing
/// prefixes the replicas already evicted. (With the size reported, the simulator's belief is
/// exactly the replicas' LRU: one router, the same recording order.)
fn run(index: IndexMode) -> Simulation {
    run_reported(index, false)
}

fn trace() -> Vec<TraceRecord> {
    TraceSpec {
        shape: TraceShape::Tenants,
        tenants: 24,
        prompt_words: 180,
        rate: 20.0,
        requests: 300,
        seed: 7,
        ..TraceSpec::default()
    }
    .generate()
    .unwrap()
}

fn config(index: IndexMode, capacity_reported: bool) -> SimConfig {
    let mut config = SimConfig {
        cache_blocks: 52,
        capacity_reported,
        index,
        ..SimConfig::default()
    };
    config.router.policy = Policy::Latency;
    config
}

fn run_reported(index: IndexMode, capacity_reported: bool) -> Simulation {
    let mut sim = Simulation::new(&trace(), config(index, capacity_reported)).unwrap();
    sim.run();
    sim
}

#[test]
fn the_precise_belief_holds_every_block_the_replicas_hold_and_believes_no_evicted_prefix() {
    let precise = run(IndexMode::Precise);
    for (e, replica) in precise.replicas().iter().enumerate() {
        for h in replica.cache.blocks() {
            assert!(
                precise.router().store().contains(e, h),
                "replica {e} block {h:x}"
            );
        }
    }
    assert_eq!(precise.belief_check().false_hits, 0);
    let approximate = run(IndexMode::Approximate);
    eprintln!(
        "wrong beliefs: precise {}, approximate {}; false hits approximate {}",
        precise.belief_check().wrong,
        approximate.belief_check().wrong,
        approximate.belief_check().false_hits
    );
    assert_eq!(precise.belief_check().wrong, 0);
    // The replicas' reported size bounds the room, not the events: still never wrong (with
    // the belief bounded by it, the router's own records of each request, counted once more
    // until the events come, pushed held blocks out: 15 of 300 wrong).
    assert_eq!(
        run_reported(IndexMode::Precise, true).belief_check(),
        BeliefCheck {
            requests: 300,
            wrong: 0,
            false_hits: 0
        }
    );
    assert!(
        approximate.belief_check().wrong > 0,
        "on this trace the approximate belief is sometimes wrong"
    );
}

/// The sweep's conversations (24 growing conversations behind one system prompt, 6 replicas
/// of 900 blocks that report their size): the events say which blocks a replica holds, its
/// reported capacity says how much room is left, as in the plugin. Without the capacity the
/// precise belief saw 31,250 blocks of room everywhere, priced no conversation's growth, and
/// piled them next to the system prompt (max/mean 4.12, one replica 275 of 400 requests).
#[test]
fn a_precise_belief_knows_the_reported_capacity_so_growing_conversations_spread() {
    let trace = sweep_conversations();
    let report = |index| {
        let config = SimConfig {
            index,
            ..sweep_fleet(0.5)
        };
        latency_report(&trace, config)
    };
    let (precise, approximate) = (report(IndexMode::Precise), report(IndexMode::Approximate));
    let per = &precise.requests_per_replica;
    assert!(max_over_mean(per) <= 1.3, "requests per replica {per:?}");
    assert!(
        precise.hit_rate >= approximate.hit_rate - 0.005,
        "precise {:.3}, approximate {:.3}",
        precise.hit_rate,
        approximate.hit_rate
    );
}

/// The plugin fetches the relay's feed every `kv_events.interval_ms`: until its next fetch a
/// precise belief still holds what a replica just evicted and lacks what it just stored.
/// Applied at once (the default), it is never wrong on this trace; fetched every 200 ms, it is
/// sometimes, and the beliefs it is wrong about are fewer than the approximate belief's.
#[test]
fn a_feed_fetched_every_interval_lags_the_replicas_by_up_to_that_interval() {
    let at = |kv_interval_ms: f64| {
        let mut sim = Simulation::new(
            &trace(),
            SimConfig {
                kv_interval_ms,
                ..config(IndexMode::Precise, false)
            },
        )
        .unwrap();
        sim.run();
        sim.belief_check()
    };
    assert_eq!(at(0.0).wrong, 0);
    let lagging = at(200.0);
    assert!(lagging.wrong > 0, "{lagging:?}");
    assert!(lagging.wrong < run(IndexMode::Approximate).belief_check().wrong);
    let bad = SimConfig {
        kv_interval_ms: -1.0,
        ..config(IndexMode::Precise, false)
    };
    assert!(Simulation::new(&trace(), bad).is_err());
}
