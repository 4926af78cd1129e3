//! Several gateways in front of one fleet (`prefixroute simulate --gateways N`): each has its
//! own router, belief and ledger, as separate Envoys do, and requests go to them in turn. The
//! trace and fleet are `bench/gateways.py`'s, whose real-Envoy runs these mirror.

use prefixroute_core::config::{IndexMode, Policy};
use prefixroute_sim::simulation::{SimConfig, SimReport, Simulation};
use prefixroute_sim::trace::{TraceRecord, TraceShape, TraceSpec};

/// `prefixroute trace --shape tenants --tenants 24 --prompt-words 180 --question-words 12
/// --rate 20 --seed 7 --requests 400`.
fn trace() -> Vec<TraceRecord> {
    TraceSpec {
        shape: TraceShape::Tenants,
        tenants: 24,
        prompt_words: 180,
        question_words: 12,
        rate: 20.0,
        requests: 400,
        seed: 7,
        ..TraceSpec::default()
    }
    .generate()
    .unwrap()
}

/// 3 replicas of 52 blocks (about half of the tenants' prompts fit), 0.5 ms per uncached
/// token, policy `latency`.
fn config(gateways: usize, index: IndexMode) -> SimConfig {
    let mut config = SimConfig {
        cache_blocks: 52,
        gateways,
        index,
        ..SimConfig::default()
    };
    config.timing.prefill_ms_per_token = 0.5;
    config.router.policy = Policy::Latency;
    config
}

fn run(gateways: usize, index: IndexMode) -> (Simulation, SimReport) {
    let mut sim = Simulation::new(&trace(), config(gateways, index)).unwrap();
    sim.run();
    let report = sim.report();
    (sim, report)
}

#[test]
fn each_gateway_accounts_only_for_the_requests_it_routed() {
    let (one, _) = run(1, IndexMode::Approximate);
    let (two, _) = run(2, IndexMode::Approximate);
    let sent = |sim: &Simulation| -> u64 { sim.ledger().sent.iter().map(|s| s.prompt).sum() };
    let all: u64 = one
        .requests()
        .iter()
        .map(|r| r.hashes.total_tokens() as u64)
        .sum();
    assert_eq!(sent(&one), all);
    // The first of two gateways routed every other request: the even ones.
    let even: u64 = two
        .requests()
        .iter()
        .step_by(2)
        .map(|r| r.hashes.total_tokens() as u64)
        .sum();
    assert_eq!(sent(&two), even);
}

#[test]
fn zero_gateways_is_an_error() {
    assert!(Simulation::new(&trace(), config(0, IndexMode::Approximate)).is_err());
}

/// Every precise gateway reads the same events, so two of them believe what one does and keep
/// its hit rate (measured through two real Envoys in docs/benchmarks.md, "Several gateways at
/// once"); each approximate gateway believes only what it routed.
#[test]
fn precise_gateways_keep_one_gateways_hit_rate() {
    let (_, one) = run(1, IndexMode::Precise);
    for gateways in [2, 3] {
        let (_, many) = run(gateways, IndexMode::Precise);
        assert!(
            many.hit_rate >= one.hit_rate - 0.02,
            "{gateways} precise gateways: {:.3} against one: {:.3}",
            many.hit_rate,
            one.hit_rate
        );
    }
}
