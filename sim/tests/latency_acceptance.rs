//! The `latency` policy on the two traces where `prefix` (llm-d's weighted sum) falls into
//! thrash once prefill costs something: the commands of the issue that introduced `latency`,
//!
//! ```text
//! prefixroute trace --shape rag --tenants 6 --prompt-words 800 --question-words 20 --rate 20 \
//!     --requests 200 --seed 5 -o rag.jsonl
//! prefixroute simulate rag.jsonl --cache-blocks 128 --slots 4 --decode-ms-per-token 0
//! prefixroute trace --shape conversations --tenants 16 --prompt-words 60 --question-words 40 \
//!     --rate 20 --requests 200 --seed 5 -o chat.jsonl
//! prefixroute simulate chat.jsonl --cache-blocks 512 --slots 4 --decode-ms-per-token 0
//! ```
//!
//! The simulator is deterministic, so these are exact properties of this code, not timings.

mod common;

use common::{six_replicas, spec, sweep_conversations, sweep_fleet};
use prefixroute_core::config::Policy;
use prefixroute_sim::simulation::{simulate, upper_bound, SimConfig, SimReport};
use prefixroute_sim::summary::max_over_mean;
use prefixroute_sim::trace::{TraceRecord, TraceShape, TraceSpec};

/// The issue's traces: 200 requests at 20/s, seed 5.
fn trace(
    shape: TraceShape,
    groups: usize,
    prompt_words: usize,
    question_words: usize,
) -> Vec<TraceRecord> {
    spec(shape, groups, prompt_words, question_words, 200, 5)
        .generate()
        .unwrap()
}

/// `simulate TRACE --cache-blocks N --slots 4 --decode-ms-per-token 0` with its defaults.
fn fleet(cache_blocks: usize) -> SimConfig {
    let mut config = SimConfig {
        cache_blocks,
        ..SimConfig::default()
    };
    config.timing.lanes = 4;
    config.timing.decode_ms_per_token = 0.0;
    config
}

fn run(trace: &[TraceRecord], config: SimConfig, policy: Policy) -> SimReport {
    let mut config = config;
    config.router.policy = policy;
    simulate(trace, config).unwrap()
}

/// `report`'s hit rate is at least `share` of the upper bound's.
fn assert_hit_share(report: &SimReport, bound: &SimReport, share: f64) {
    assert!(
        report.hit_rate >= share * bound.hit_rate,
        "hit rate {:.3} vs upper bound {:.3}",
        report.hit_rate,
        bound.hit_rate
    );
}

/// Every group sends at least three quarters of its requests to one replica (its home), and
/// no replica is home to more than its share of groups plus one: each document or
/// conversation stays put, and they are spread over the fleet's caches.
fn spread_by_capacity(report: &SimReport) -> Result<(), String> {
    let replicas = report.requests_per_replica.len();
    let mut homes = vec![0usize; replicas];
    for (group, counts) in &report.group_replicas {
        let total: usize = counts.iter().sum();
        let (home, &most) = counts.iter().enumerate().max_by_key(|&(_, c)| *c).unwrap();
        if most * 4 < total * 3 {
            return Err(format!("{group} is not at home anywhere: {counts:?}"));
        }
        homes[home] += 1;
    }
    let share = report.group_replicas.len().div_ceil(replicas);
    if homes.iter().any(|&h| h > share + 1) {
        return Err(format!("homes per replica {homes:?} (share {share})"));
    }
    Ok(())
}

fn check(trace: &[TraceRecord], config: SimConfig) {
    let bound = upper_bound(trace, config).unwrap();
    let latency = run(trace, config, Policy::Latency);
    assert_hit_share(&latency, &bound, 0.95);
    spread_by_capacity(&latency).unwrap();
    let others: Vec<SimReport> = Policy::ALL
        .into_iter()
        .filter(|&p| p != Policy::Latency)
        .map(|p| run(trace, config, p))
        .collect();
    let best = others
        .iter()
        .min_by(|a, b| a.ttft_p95_ms.total_cmp(&b.ttft_p95_ms))
        .unwrap();
    assert!(
        latency.ttft_p95_ms <= 1.1 * best.ttft_p95_ms,
        "TTFT p95 {:.0} ms vs {} {:.0} ms",
        latency.ttft_p95_ms,
        best.policy,
        best.ttft_p95_ms
    );
}

#[test]
fn on_rag_with_expensive_prefill_latency_reaches_the_upper_bound_and_keeps_each_document_home() {
    let trace = trace(TraceShape::Rag, 6, 800, 20);
    check(&trace, fleet(128));
    let latency = run(&trace, fleet(128), Policy::Latency);
    assert_eq!(
        latency.groups_on_one, latency.groups,
        "{:?}",
        latency.group_replicas
    );
}

#[test]
fn on_conversations_sharing_a_system_prompt_latency_spreads_them_by_capacity() {
    let trace = trace(TraceShape::Conversations, 16, 60, 40);
    check(&trace, fleet(512));
    // Where llm-d's weighted sum piles them onto the replica that holds the system prompt.
    let prefix = run(&trace, fleet(512), Policy::Prefix);
    assert!(
        spread_by_capacity(&prefix).is_err(),
        "{:?}",
        prefix.group_replicas
    );
}

#[test]
fn the_upper_bound_is_one_server_that_never_evicts() {
    let trace = trace(TraceShape::Conversations, 16, 60, 40);
    let bound = upper_bound(&trace, fleet(512)).unwrap();
    assert_eq!(bound.requests_per_replica, vec![200]);
    assert_eq!(bound.groups_on_one, bound.groups);
    // No router over the fleet can reuse more than the one server that keeps everything.
    for policy in Policy::ALL {
        let r = run(&trace, fleet(512), policy);
        assert!(r.hit_rate <= bound.hit_rate + 1e-12, "{policy}");
    }
}

/// The bench sweep's conversations (`prefixroute trace --shape conversations --tenants 24
/// --prompt-words 150 --question-words 30 --rate 20 --requests 400 --seed 13`, six replicas of
/// 900 blocks, 4 lanes, cheap prefill): all 24 conversations start within three seconds, next
/// to the one replica that holds the shared system prompt, before any of them has grown.
/// Counting the groups each replica takes, and pricing the room their growth will need, starts
/// later conversations elsewhere. Measured when the counts were built: without them one replica
/// took 279 of the 400 requests (max/mean 4.18) at 96.8% of the upper bound's hit rate; with
/// them, 167 (2.50) at 98.7%. With the growth learned apart for first and later turns, 104
/// (1.56) at 99.8%: the five conversations that start before any has continued still shared
/// the first replica. Since a group's second request places it again, priced as the growing
/// group it now is known to be (moving only among the holders of its shared head), 79 (1.18)
/// at 99.6%, at every prefill cost: issue 10's max/mean ≤ 1.3.
#[test]
fn conversations_that_start_together_are_spread_by_their_second_requests() {
    let trace = sweep_conversations();
    for cost in [0.1, 0.5, 1.0] {
        let config = sweep_fleet(cost);
        let bound = upper_bound(&trace, config).unwrap();
        let latency = run(&trace, config, Policy::Latency);
        assert_hit_share(&latency, &bound, 0.99);
        let spread = max_over_mean(&latency.requests_per_replica);
        assert!(
            spread <= 1.3,
            "{cost} ms/token: max/mean {spread:.2}: {:?}",
            latency.requests_per_replica
        );
        assert_eq!(homes(&latency).len(), 6, "{:?}", latency.group_replicas);
        moves_only_after_one_request(&latency);
    }
}

/// Every group lives on one replica, or moved once, after its first request: on two replicas,
/// one of which served it exactly once.
fn moves_only_after_one_request(report: &SimReport) {
    for (group, counts) in &report.group_replicas {
        let mut served: Vec<usize> = counts.iter().copied().filter(|&c| c > 0).collect();
        served.sort_unstable();
        assert!(
            served.len() == 1 || (served.len() == 2 && served[0] == 1),
            "{group} moved more than once: {counts:?}"
        );
    }
}

/// Replicas that are the home (most requests) of some group.
fn homes(report: &SimReport) -> std::collections::BTreeSet<usize> {
    report
        .group_replicas
        .iter()
        .map(|(_, counts)| {
            counts
                .iter()
                .enumerate()
                .max_by_key(|&(_, c)| *c)
                .unwrap()
                .0
        })
        .collect()
}

/// Asserts that `latency` routes `trace` at the upper bound: hit rate at least `hit` of its
/// and TTFT p95 at most `p95` times its.
fn at_the_upper_bound(trace: &[TraceRecord], config: SimConfig, hit: f64, p95: f64) -> SimReport {
    let bound = upper_bound(trace, config).unwrap();
    let latency = run(trace, config, Policy::Latency);
    assert_hit_share(&latency, &bound, hit);
    assert!(
        latency.ttft_p95_ms <= p95 * bound.ttft_p95_ms,
        "TTFT p95 {:.1} ms vs upper bound {:.1} ms: {:?}",
        latency.ttft_p95_ms,
        bound.ttft_p95_ms,
        latency.requests_per_replica
    );
    latency
}

/// A gateway that carries tenants' questions and conversations at once: the sweep's tenants
/// (24 tenants, ~750-token system prompts) and conversations (24, sharing a ~190-token one)
/// merged by time, over eight replicas of 900 blocks. Half of the requests are questions that
/// are never followed; one share of continuing requests for both says conversations are two
/// turns long, so their growth went unpriced and they piled onto the replica holding their
/// system prompt until it thrashed. Measured before the growth was learned apart for first
/// and later turns: 89.7% of the bound's hit rate and TTFT p95 102.8 ms against its 18.1 at
/// 0.1 ms/token (97.6%, 271.0 against 70.5 ms at 0.5); after: 99.9% and 18.1 ms (99.6%, 71.5).
/// Since a group's second request places it again: 99.8% and 21.0 ms (99.8%, 86.0), the
/// conversations that moved paying their first turn's prefill again once; max/mean 1.42 and
/// 1.60 → 1.24 at both costs.
#[test]
fn tenants_and_conversations_on_one_gateway_are_routed_at_the_upper_bound() {
    let mut trace = spec(TraceShape::Tenants, 24, 600, 40, 400, 11)
        .generate()
        .unwrap();
    trace.extend(sweep_conversations());
    trace.sort_by(|a, b| a.t.total_cmp(&b.t));
    for cost in [0.1, 0.5] {
        let mut config = fleet(900);
        config.replicas = 8;
        config.timing.prefill_ms_per_token = cost;
        let latency = at_the_upper_bound(&trace, config, 0.99, 1.25);
        moves_only_after_one_request(&latency);
        let spread = max_over_mean(&latency.requests_per_replica);
        assert!(spread <= 1.3, "max/mean {spread:.2} at {cost} ms/token");
    }
}

/// Conversations whose shared system prompt is long (40 of them, ~750 tokens, eight replicas
/// of 1,500 blocks): starting a conversation away from the prompt costs 47 blocks of prefill,
/// so without their growth priced they all started next to it, and at 1 ms/token that
/// replica's queue set the tail. Measured before the growth was learned apart for first and
/// later turns: one replica took 263 of 600 requests, 97.2% of the bound's hit rate, TTFT p95
/// 235.1 ms against its 171.0; after: 99.7% and 172.0 ms, but 40 conversations on six of the
/// eight replicas (max/mean 1.87, two replicas idle). Since a group's second request places it
/// again: 99.4% and 205.0 ms, every replica a home, max/mean 1.35; 25 conversations moved
/// once, their second turn prefilling the first one again (~200 tokens, ~0.2 s at 1 ms/token:
/// those set the tail now, not a queue).
#[test]
fn conversations_with_a_long_shared_prompt_do_not_queue_behind_it() {
    // `prefixroute trace --shape conversations --tenants 40 --prompt-words 600
    // --question-words 40 --rate 30 --requests 600 --seed 22`
    let trace = TraceSpec {
        rate: 30.0,
        ..spec(TraceShape::Conversations, 40, 600, 40, 600, 22)
    }
    .generate()
    .unwrap();
    let mut config = fleet(1500);
    config.replicas = 8;
    config.timing.prefill_ms_per_token = 1.0;
    let latency = at_the_upper_bound(&trace, config, 0.99, 1.25);
    moves_only_after_one_request(&latency);
    assert_eq!(homes(&latency).len(), 8, "{:?}", latency.group_replicas);
    let spread = max_over_mean(&latency.requests_per_replica);
    assert!(spread <= 1.4, "max/mean {spread:.2}");
}

/// A gateway that runs for a long time: the sweep's `mixed` fleet (16 tenants' questions and
/// 16 conversations, six replicas of 900 blocks) over 4,000 requests, where a conversation
/// ends after 8 turns and a new one takes its slot (`--turns 8`), so groups keep coming and
/// going for over three minutes of traffic. What the router learned and counted in its first
/// seconds must not bend its later decisions. Measured when this test was written: 100% of the
/// bound's hit rate at 0.1, 0.5 and 1 ms/token, TTFT p95 equal to the bound's; `prefix` 99.8%;
/// busiest replica 2.75, 2.23 and 2.07 times the mean while live groups were counted by
/// requests (a group's count settled only when it was seen again), 1.27, 1.13 and 1.07 once
/// they decay with the learned gap between a group's requests. Since near-ties go to the
/// fewest holders, then to the most room left once the living groups grow: 1.09 at 0.1 and
/// 1.12 at 1 ms/token; over seeds 16-23 of this trace at 1 ms/token 1.04-1.34, mean 1.18
/// (1.05-1.43 with the fewest holders and the room without the growth, 1.11-1.47 before both).
#[test]
fn a_long_lived_gateway_whose_conversations_end_stays_at_the_upper_bound() {
    // `prefixroute trace --shape mixed --tenants 16 --prompt-words 400 --question-words 30
    // --rate 20 --requests 4000 --seed 16 --turns 8`
    let trace = TraceSpec {
        turns: Some(8),
        ..spec(TraceShape::Mixed, 16, 400, 30, 4000, 16)
    }
    .generate()
    .unwrap();
    assert!(trace.iter().any(|r| r.group == "conv-0.10"), "slots reused");
    for cost in [0.1, 1.0] {
        let latency = at_the_upper_bound(&trace, sweep_fleet(cost), 0.99, 1.05);
        let spread = max_over_mean(&latency.requests_per_replica);
        assert!(spread <= 1.4, "max/mean {spread:.2} at {cost} ms/token");
    }
}

/// Conversations that never end outgrow the fleet: the sweep's `mixed` trace at 2,000
/// requests, where the 16 conversations alone hold more blocks than six caches of 900 by the
/// end. The router must keep routing them where their history is and put what is new where
/// there is room, not price every replica as full. Measured: while live groups were counted
/// by requests, every question nobody followed stayed counted as a conversation to come, every
/// replica was believed over-full and `latency` fell to 56% of the bound's hit rate at 0.1
/// ms/token, below `prefix`'s 78%; counted by Little's law with the learned gap, 89.0%.
/// Measured with a scrape at every decision; with the plugin's 1 s scrapes `latency` keeps
/// 85.8% and p95 189 ms, and `prefix`, which moves less on queues it sees late, 81.4% and 307
/// ms (docs/benchmarks.md).
#[test]
fn conversations_that_outgrow_every_cache_are_still_routed_better_than_prefix() {
    // `prefixroute trace --shape mixed --tenants 16 --prompt-words 400 --question-words 30
    // --rate 20 --requests 2000 --seed 16`
    let trace = spec(TraceShape::Mixed, 16, 400, 30, 2000, 16)
        .generate()
        .unwrap();
    let config = SimConfig {
        scrape_interval_ms: 0.0,
        ..sweep_fleet(0.1)
    };
    let bound = upper_bound(&trace, config).unwrap();
    let latency = run(&trace, config, Policy::Latency);
    let prefix = run(&trace, config, Policy::Prefix);
    assert_hit_share(&latency, &bound, 0.85);
    assert!(
        latency.hit_rate > prefix.hit_rate + 0.05 && latency.ttft_p95_ms < prefix.ttft_p95_ms,
        "latency {:.3} / {:.0} ms vs prefix {:.3} / {:.0} ms",
        latency.hit_rate,
        latency.ttft_p95_ms,
        prefix.hit_rate,
        prefix.ttft_p95_ms
    );
}

/// The sweep's `hot` trace and fleet at `ms_per_token`: `prefixroute trace --shape tenants
/// --tenants 8 --prompt-words 600 --question-words 40 --rate 50 --requests 600 --hot 0.6
/// --seed 12` over six replicas of 200 blocks and 2 lanes.
fn sweep_hot(ms_per_token: f64) -> (Vec<TraceRecord>, SimConfig) {
    let trace = TraceSpec {
        rate: 50.0,
        hot: Some(0.6),
        ..spec(TraceShape::Tenants, 8, 600, 40, 600, 12)
    }
    .generate()
    .unwrap();
    let mut config = fleet(200);
    config.replicas = 6;
    config.timing.lanes = 2;
    config.timing.prefill_ms_per_token = ms_per_token;
    (trace, config)
}

/// A hot tenant right after a start: the sweep's `hot` trace (8 tenants, one with 60% of 50
/// requests/s, six replicas of 200 blocks and 2 lanes) at 1 ms/token. Its prompt is held by
/// one replica, whose queue each request would rather wait in (tens of ms) than prefill the
/// prompt elsewhere (~770 ms); priced alone, nobody paid for the second copy until request
/// #29, and the requests before it queued up to 270 ms. The copy credit counts what a copy
/// saves the prefix's later requests. Measured: TTFT p95 150.2 ms before (`prefix` 118.5),
/// 89.6 ms with it, against the bound's 68.0; the hit rate 99.7% → 99.8% of the bound's.
#[test]
fn a_hot_prefix_gets_its_second_copy_before_its_queue_sets_the_tail() {
    let (trace, config) = sweep_hot(1.0);
    let bound = upper_bound(&trace, config).unwrap();
    let latency = at_the_upper_bound(&trace, config, 0.995, 1.5);
    let prefix = run(&trace, config, Policy::Prefix);
    assert!(
        latency.ttft_p95_ms < prefix.ttft_p95_ms,
        "{:.1} ms vs prefix {:.1} ms (bound {:.1})",
        latency.ttft_p95_ms,
        prefix.ttft_p95_ms,
        bound.ttft_p95_ms
    );
}

/// A tenant that turns hot after an even start: the sweep's 8 tenants evenly for 5 s, then the
/// sweep's hot trace (one tenant with 60% of 50 requests/s), at 0.5 ms/token with second-old
/// scrapes. The hot tenant's holder is busy about half the time: the predicted mean wait there
/// is a few ms, a copy would evict another tenant's prompt, and the prediction alone never
/// makes it, so the holder's queue sets the tail. The bounded share (`latency.balance_factor`)
/// sets the holder aside once it has taken over twice the mean replica's requests for a
/// prefix over 1.5 times a fair share, and the tenant gets its second copy. Measured: TTFT
/// p95 38.5 ms against the bound's 37.0 (busiest replica 250 of 850 requests); without the
/// bound 50.2 ms (471 of 850).
#[test]
fn a_tenant_that_turns_hot_after_an_even_start_gets_its_second_copy() {
    let (hot, config) = sweep_hot(0.5);
    let even = TraceSpec {
        rate: 50.0,
        ..spec(TraceShape::Tenants, 8, 600, 40, 250, 12)
    }
    .generate()
    .unwrap();
    let start = even.last().unwrap().t + 0.02;
    let trace: Vec<TraceRecord> = even
        .into_iter()
        .chain(hot.into_iter().map(|mut r| {
            r.t += start;
            r
        }))
        .collect();
    let bound = upper_bound(&trace, config).unwrap();
    let latency = at_the_upper_bound(&trace, config, 0.99, 1.1);
    let mut unbounded = config;
    unbounded.router.latency.balance_factor = 0.0;
    let unbounded = run(&trace, unbounded, Policy::Latency);
    assert!(
        unbounded.ttft_p95_ms > 1.25 * bound.ttft_p95_ms,
        "without the bound {:.1} ms against the bound's {:.1}",
        unbounded.ttft_p95_ms,
        bound.ttft_p95_ms
    );
    let spread = |r: &SimReport| max_over_mean(&r.requests_per_replica);
    assert!(
        spread(&latency) <= 2.0 && spread(&unbounded) > 3.0,
        "busiest replica over the mean: {:.2} bounded, {:.2} not",
        spread(&latency),
        spread(&unbounded)
    );
}

/// The same hot tenant at 0.5 ms/token with the replicas' queues seen as the plugin sees them,
/// a scrape a second old, and the bounded share off (it makes this copy on its own, see
/// `a_tenant_that_turns_hot_after_an_even_start_gets_its_second_copy`): this is the copy
/// credit with the lanes told. Left to learn the lanes, the fit still believed 4 (the
/// replicas have 2) while the tenant queued in short bursts, no queue was seen at a decision,
/// and the tenant stayed on one replica: TTFT p95 51.4 ms against the bound's 36.5, busiest
/// replica 3.89× the mean (real Envoy: 61.5 ms against 39.7). Told the lanes (`latency.lanes`,
/// as an operator who knows them would set it), the router makes the second copy: 37.0 ms and
/// 2.18× (Envoy: 45 ms), at the tenant's second request, in the first burst.
#[test]
fn told_its_replicas_lanes_a_hot_prefix_gets_its_second_copy_with_second_old_scrapes() {
    let (trace, mut config) = sweep_hot(0.5);
    config.router.latency.lanes = 2;
    config.router.latency.balance_factor = 0.0;
    assert_eq!(config.scrape_interval_ms, 1000.0);
    let latency = at_the_upper_bound(&trace, config, 0.99, 1.1);
    let spread = max_over_mean(&latency.requests_per_replica);
    assert!(
        spread <= 2.5,
        "max/mean {spread:.2}: one copy of the hot tenant"
    );
}

#[test]
fn with_nothing_shared_latency_spreads_requests_evenly_at_least_queues_tail() {
    // The sweep's nothing-shared trace: every request a new ~380-token prompt, at 15/s on six
    // replicas. Every replica predicts the same and, once the caches are full, has the same
    // room, so the last tie decides: by rendezvous alone the busiest replica took 1.22x and
    // 1.14x the mean at 0.1 and 0.5 ms/token. At 1 ms/token requests queue and the fewest
    // holders decide first (1.16x before the counts, 1.14x with them); the tail is
    // least-queue's at every cost.
    let trace = TraceSpec {
        shape: TraceShape::Unique,
        prompt_words: 300,
        question_words: 20,
        rate: 15.0,
        requests: 300,
        seed: 15,
        ..TraceSpec::default()
    }
    .generate()
    .unwrap();
    for (ms_per_token, bound) in [(0.1, 1.05), (0.5, 1.05), (1.0, 1.2)] {
        let config = six_replicas(400, ms_per_token);
        let latency = run(&trace, config, Policy::Latency);
        let least_queue = run(&trace, config, Policy::LeastQueue);
        let busiest = max_over_mean(&latency.requests_per_replica);
        assert!(
            busiest <= bound,
            "at {ms_per_token} ms/token: {:?}",
            latency.requests_per_replica
        );
        assert!(
            latency.ttft_p95_ms <= least_queue.ttft_p95_ms,
            "at {ms_per_token} ms/token: TTFT p95 {} vs least-queue {} ms",
            latency.ttft_p95_ms,
            least_queue.ttft_p95_ms
        );
    }
}
