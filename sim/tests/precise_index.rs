//! `index: precise` in the simulator: the replicas publish what their caches do and the
//! router's belief follows, against the router's own approximate belief, on one trace.

use prefixroute_core::config::{IndexMode, Policy};
use prefixroute_sim::simulation::{SimConfig, Simulation};
use prefixroute_sim::trace::{TraceShape, TraceSpec};

/// 24 tenants through caches that hold about half of them, whose size the replicas do not
/// report (llm-d's default belief of 31,250 blocks): the approximate belief keeps believing
/// prefixes the replicas already evicted. (With the size reported, the simulator's belief is
/// exactly the replicas' LRU: one router, the same recording order.)
fn run(index: IndexMode) -> Simulation {
    let trace = TraceSpec {
        shape: TraceShape::Tenants,
        tenants: 24,
        prompt_words: 180,
        rate: 20.0,
        requests: 300,
        seed: 7,
        ..TraceSpec::default()
    }
    .generate()
    .unwrap();
    let mut config = SimConfig {
        cache_blocks: 52,
        capacity_reported: false,
        index,
        ..SimConfig::default()
    };
    config.router.policy = Policy::Latency;
    let mut sim = Simulation::new(&trace, config).unwrap();
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
    assert!(
        approximate.belief_check().wrong > 0,
        "on this trace the approximate belief is sometimes wrong"
    );
}
