//! Prefill/decode disaggregation in the simulator (`simulate --prefill-replicas N
//! --decode-replicas M --threshold T --link-gbps G`), against aggregated serving on the same
//! replicas. Deterministic: these are properties of the model, not timings.

use prefixroute_core::config::Policy;
use prefixroute_sim::disagg::model_shape;
use prefixroute_sim::pd::PdConfig;
use prefixroute_sim::simulation::{SimConfig, SimReport, Simulation};
use prefixroute_sim::trace::{TraceRecord, TraceShape, TraceSpec};

/// `prefixroute trace --shape unique --prompt-words 3600 --rate 4 --requests 120
/// --max-tokens 64 --seed 9`: about 4,000-token prompts, nothing shared.
fn long_prompts() -> Vec<TraceRecord> {
    TraceSpec {
        shape: TraceShape::Unique,
        prompt_words: 3600,
        question_words: 12,
        rate: 4.0,
        requests: 120,
        max_tokens: 64,
        seed: 9,
        ..TraceSpec::default()
    }
    .generate()
    .unwrap()
}

/// A GPU-like fleet of `replicas`: 0.1 ms per prefill token, 20 ms per decode step.
fn fleet(replicas: usize) -> SimConfig {
    let mut config = SimConfig {
        replicas,
        cache_blocks: 4096,
        ..SimConfig::default()
    };
    config.timing.prefill_ms_per_token = 0.1;
    config.timing.decode_ms_per_token = 20.0;
    config.router.policy = Policy::Latency;
    config
}

fn split(prefill: usize, decode: usize, link_gbps: f64) -> SimConfig {
    let mut config = fleet(decode);
    config.pd = Some(PdConfig {
        prefill_replicas: prefill,
        threshold_tokens: 512,
        link_gbps,
        link_latency_ms: 0.5,
        kv_bytes_per_token: model_shape("llama-3.1-8b").unwrap().kv_bytes_per_token(),
        chunk_tokens: None,
    });
    config
}

fn run(trace: &[TraceRecord], config: SimConfig) -> (SimReport, Simulation) {
    let mut sim = Simulation::new(trace, config).unwrap();
    sim.run();
    (sim.report(), sim)
}

#[test]
fn the_trace_has_about_four_thousand_token_prompts() {
    let (_, sim) = run(&long_prompts(), fleet(6));
    let tokens: Vec<usize> = sim
        .requests()
        .iter()
        .map(|r| r.hashes.total_tokens())
        .collect();
    let mean = tokens.iter().sum::<usize>() as f64 / tokens.len() as f64;
    assert!(
        (3500.0..4500.0).contains(&mean),
        "mean prompt {mean} tokens"
    );
}

#[test]
fn no_prefill_replicas_and_threshold_zero_is_exactly_todays_simulation() {
    let trace = long_prompts();
    for policy in Policy::ALL {
        let mut today = fleet(3);
        today.router.policy = policy;
        let mut with_split = split(0, 3, 100.0);
        with_split.router.policy = policy;
        with_split.pd.as_mut().unwrap().threshold_tokens = 0;
        let (a, sa) = run(&trace, today);
        let (mut b, sb) = run(&trace, with_split);
        let pd = b.pd.take().expect("a split fleet reports its split");
        assert_eq!((pd.remote_prefill_share, pd.kv_bytes_moved), (0.0, 0));
        assert_eq!(a, b, "{policy}");
        for (x, y) in sa.steps().iter().zip(sb.steps()) {
            assert_eq!(x.served, y.served, "{policy} request {}", x.index);
            assert_eq!(x.decision.endpoint, y.decision.endpoint);
            assert!(y.remote.is_none());
        }
    }
}

#[test]
fn a_fast_link_takes_prefill_stalls_off_the_decode_replicas() {
    let trace = long_prompts();
    let (aggregated, _) = run(&trace, fleet(6));
    let (fast, _) = run(&trace, split(2, 4, 400.0));
    let pd = fast.pd.unwrap();
    assert_eq!(
        pd.remote_prefill_share, 1.0,
        "every prompt is past the threshold"
    );
    assert!(
        fast.itl_worst_p95_ms < 0.5 * aggregated.itl_worst_p95_ms,
        "worst inter-token gap p95: split {} ms, aggregated {} ms",
        fast.itl_worst_p95_ms,
        aggregated.itl_worst_p95_ms
    );
    assert!(fast.decode_stall_p95_ms < aggregated.decode_stall_p95_ms);
    // ~4,000 tokens × 128 KiB per request.
    let per_request = pd.kv_bytes_moved as f64 / fast.requests as f64;
    assert!((4.0e8..6.0e8).contains(&per_request), "{per_request} B");
}

#[test]
fn a_slow_link_makes_time_to_first_token_worse_than_aggregated() {
    let trace = long_prompts();
    let (aggregated, _) = run(&trace, fleet(6));
    let (slow, _) = run(&trace, split(2, 4, 10.0));
    assert!(
        slow.ttft_p95_ms > aggregated.ttft_p95_ms,
        "TTFT p95: split over 10 Gb/s {} ms, aggregated {} ms",
        slow.ttft_p95_ms,
        aggregated.ttft_p95_ms
    );
    let pd = slow.pd.unwrap();
    assert!(
        pd.link_busy_share > 0.3,
        "the slow links are busy: {}",
        pd.link_busy_share
    );
}

#[test]
fn below_the_threshold_requests_prefill_where_they_decode() {
    let trace = long_prompts();
    let mut config = split(2, 4, 400.0);
    config.pd.as_mut().unwrap().threshold_tokens = 1_000_000;
    let (report, sim) = run(&trace, config);
    assert_eq!(report.pd.unwrap().remote_prefill_share, 0.0);
    assert!(sim.steps().iter().all(|s| s.remote.is_none()));
}

#[test]
fn chunked_prefill_bounds_the_worst_gap_but_not_the_total_stall() {
    let trace = long_prompts();
    let mut plain = split(0, 6, 400.0);
    plain.pd.as_mut().unwrap().threshold_tokens = 0;
    let mut chunked = plain;
    chunked.pd.as_mut().unwrap().chunk_tokens = Some(512);
    let (p, _) = run(&trace, plain);
    let (c, _) = run(&trace, chunked);
    assert_eq!(c.decode_stall_p95_ms, p.decode_stall_p95_ms);
    assert_eq!(c.ttft_p95_ms, p.ttft_p95_ms);
    assert!(
        c.itl_worst_p95_ms <= 20.0 + 512.0 * 0.1 + 1e-9,
        "{}",
        c.itl_worst_p95_ms
    );
    assert!(p.itl_worst_p95_ms > c.itl_worst_p95_ms);
}
