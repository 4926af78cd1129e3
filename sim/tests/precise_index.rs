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

/// Requests whose believed match on the chosen replica (in full blocks the server could
/// reuse) differs from what the replica really reused.
fn wrong_beliefs(sim: &Simulation) -> usize {
    sim.steps()
        .iter()
        .filter(|s| {
            let bs = sim.requests()[s.index].hashes.block_size;
            let reusable = s.served.prompt_tokens.saturating_sub(1) / bs;
            s.decision.matched_blocks().min(reusable) != s.served.cached_tokens / bs
        })
        .count()
}

/// Requests routed to a replica believed to hold some of their prefix that held none of it.
fn false_hits(sim: &Simulation) -> usize {
    sim.steps()
        .iter()
        .filter(|s| s.decision.matched_blocks() > 0 && s.served.cached_tokens == 0)
        .count()
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
    assert_eq!(false_hits(&precise), 0);
    let approximate = run(IndexMode::Approximate);
    eprintln!(
        "wrong beliefs: precise {}, approximate {}; false hits approximate {}",
        wrong_beliefs(&precise),
        wrong_beliefs(&approximate),
        false_hits(&approximate)
    );
    assert_eq!(wrong_beliefs(&precise), 0);
    assert!(
        wrong_beliefs(&approximate) > 0,
        "on this trace the approximate belief is sometimes wrong"
    );
}
