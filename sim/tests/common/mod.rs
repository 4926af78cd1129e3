//! Traces and fleets several simulator tests share: the prefill-cost sweep's
//! (`bench/bench.py`'s `SWEEP_SCENARIOS`), built in code.

#![allow(dead_code)] // each test file uses part of it

use prefixroute_core::config::Policy;
use prefixroute_sim::simulation::{SimConfig, SimReport, Simulation};
use prefixroute_sim::trace::{TraceRecord, TraceShape, TraceSpec};

/// `prefixroute trace --shape SHAPE --tenants GROUPS --prompt-words P --question-words Q
/// --rate 20 --requests N --seed S`.
pub fn spec(
    shape: TraceShape,
    groups: usize,
    prompt_words: usize,
    question_words: usize,
    requests: usize,
    seed: u64,
) -> TraceSpec {
    TraceSpec {
        shape,
        tenants: groups,
        prompt_words,
        question_words,
        rate: 20.0,
        requests,
        seed,
        ..TraceSpec::default()
    }
}

/// The sweep's conversations: 24 growing conversations behind one ~190-token system prompt.
pub fn sweep_conversations() -> Vec<TraceRecord> {
    spec(TraceShape::Conversations, 24, 150, 30, 400, 13)
        .generate()
        .unwrap()
}

/// The sweep's fleet for its conversations and mixed traces: six replicas of 900 blocks, 4
/// lanes, no decode time, `ms_per_token` per uncached token.
pub fn sweep_fleet(ms_per_token: f64) -> SimConfig {
    six_replicas(900, ms_per_token)
}

/// Six replicas of `cache_blocks` blocks each, 4 lanes, no decode time, `ms_per_token` per
/// uncached token: the sweep's fleets, which differ in their caches.
pub fn six_replicas(cache_blocks: usize, ms_per_token: f64) -> SimConfig {
    let mut config = SimConfig {
        replicas: 6,
        cache_blocks,
        ..SimConfig::default()
    };
    config.timing.lanes = 4;
    config.timing.decode_ms_per_token = 0.0;
    config.timing.prefill_ms_per_token = ms_per_token;
    config
}

/// `trace` simulated under `config` with the `latency` policy alone.
pub fn latency_report(trace: &[TraceRecord], mut config: SimConfig) -> SimReport {
    config.router.policy = Policy::Latency;
    let mut sim = Simulation::new(trace, config).unwrap();
    sim.run();
    sim.report()
}
