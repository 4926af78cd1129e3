//! Scraping each endpoint's metrics once per interval across all workers.
//!
//! Every root context (one per worker plus Envoy's main thread) ticks. The endpoint record's
//! `next_scrape_ms` is a lease: on a tick, an instance that finds it due moves it one interval
//! ahead with a CAS; only the winner of that CAS sends the callout, the others see a mismatch
//! (or a future due time) and skip. So each endpoint is scraped once per interval in total,
//! whatever the number of workers. The only exception is the very first claim, when the record
//! does not exist yet: Envoy ignores the CAS on a missing key, so two instances racing on the
//! first tick may both scrape once.
//!
//! The winner writes the result back with a CAS retry loop (the record is also written by
//! index clock reservations). Failed scrapes (non-200 or no response) count up to
//! `failures_to_down`, which marks the endpoint down until a scrape succeeds again. An endpoint
//! that comes back up, or whose `prefix_cache_queries_total` went backwards, has restarted with
//! an empty cache: its index window is advanced past everything recorded (forgotten).

use prefixroute_core::metrics::{parse_vllm, ServerMetrics};

use crate::codec::EndpointState;
use crate::shared::{cas_update, read_or_default, CasOutcome, SetError, SharedData};

/// Outcome of trying to take an endpoint's scrape lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// We own this interval's scrape: send the callout.
    Claimed,
    /// Scraped (or claimed) recently by someone.
    NotDue,
    /// Another instance claimed it between our read and our write.
    Lost,
    HostError(u32),
}

/// The endpoint record at `key` (default when absent or unreadable).
pub fn read(host: &impl SharedData, key: &str) -> EndpointState {
    read_or_default(host, key, EndpointState::decode)
        .map(|read| read.value)
        .unwrap_or_default()
}

/// Takes the scrape lease of the endpoint whose record is at `key` if it is due. Also returns
/// the record as read (default when absent or unreadable), which the tick reuses for gauges.
pub fn try_claim(
    host: &impl SharedData,
    key: &str,
    now_ms: u64,
    interval_ms: u64,
) -> (Claim, EndpointState) {
    let (state, cas) = match read_or_default(host, key, EndpointState::decode) {
        Ok(read) => (read.value, read.cas),
        Err(status) => return (Claim::HostError(status), EndpointState::default()),
    };
    if now_ms < state.next_scrape_ms {
        return (Claim::NotDue, state);
    }
    let mut claimed = state.clone();
    // Keep the schedule on its grid: Envoy's timers fire a little late, and scheduling from
    // `now` would let that lateness accumulate until a whole tick (and a scrape) is skipped.
    // After a long pause (no tick for an interval), restart the grid from now.
    let on_grid = state.next_scrape_ms.saturating_add(interval_ms);
    claimed.next_scrape_ms = if on_grid > now_ms {
        on_grid
    } else {
        now_ms.saturating_add(interval_ms)
    };
    let claim = match host.set(key, &claimed.encode(), cas) {
        Ok(()) => Claim::Claimed,
        Err(SetError::CasMismatch) => Claim::Lost,
        Err(SetError::Host(status)) => Claim::HostError(status),
    };
    (claim, state)
}

/// What a scrape callout produced.
#[derive(Debug, Clone, PartialEq)]
pub enum Observation {
    /// HTTP 200 with a page that parsed.
    Metrics(ServerMetrics),
    /// HTTP 200, but the page is not Prometheus text: the endpoint is up but unmeasured.
    Unparseable,
    /// Non-200, timeout, reset or connection failure.
    Failed,
}

/// Turns a callout response into an observation. `status` is the `:status` header, `None`
/// when there was no response at all.
pub fn observe(
    status: Option<u32>,
    body: &[u8],
    metric_prefix: &str,
    model: Option<&str>,
) -> Observation {
    if status != Some(200) {
        return Observation::Failed;
    }
    let Ok(text) = std::str::from_utf8(body) else {
        return Observation::Unparseable;
    };
    match parse_vllm(text, metric_prefix, model) {
        Ok(m) => Observation::Metrics(m),
        Err(_) => Observation::Unparseable,
    }
}

/// State changes a result caused, for logs and stats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Transition {
    pub went_down: bool,
    pub came_up: bool,
    /// The endpoint restarted: its index window was advanced past everything recorded.
    pub forgot: bool,
    /// The scrape succeeded but did not say how large the endpoint's cache is
    /// (`vllm:cache_config_info` with `num_gpu_blocks` and `block_size`).
    pub no_capacity: bool,
}

/// The cache a scrape reports, in tokens: `num_gpu_blocks × block_size`, or `None` when
/// either is missing or zero (vLLM reports "None" blocks before its memory profile).
pub fn reported_capacity_tokens(metrics: &ServerMetrics) -> Option<u64> {
    let blocks = metrics.num_gpu_blocks.filter(|&b| b > 0)?;
    let block_size = metrics.block_size.filter(|&b| b > 0)?;
    Some(blocks.saturating_mul(u64::from(block_size)))
}

/// The window of an endpoint in the router's blocks: the reported cache when there is one,
/// never more than the configured capacity (which also stands when nothing is reported).
pub fn capacity_blocks(state: &EndpointState, block_size: usize, configured: usize) -> usize {
    if state.capacity_tokens == 0 {
        return configured;
    }
    let blocks = state.capacity_tokens / block_size.max(1) as u64;
    usize::try_from(blocks)
        .unwrap_or(usize::MAX)
        .clamp(1, configured.max(1))
}

/// Applies an observation to an endpoint record (pure).
pub fn apply(
    state: &mut EndpointState,
    observation: &Observation,
    now_ms: u64,
    failures_to_down: u32,
    capacity: u64,
    calibration: Option<f64>,
) -> Transition {
    let mut t = Transition::default();
    match observation {
        Observation::Failed => {
            // What the endpoint reported before it stopped answering says nothing about it
            // now: it is unmeasured until a scrape succeeds.
            state.metrics = None;
            state.failures = state.failures.saturating_add(1);
            if u32::from(state.failures) >= failures_to_down && !state.down {
                state.down = true;
                t.went_down = true;
            }
        }
        Observation::Metrics(_) | Observation::Unparseable => {
            let counter_reset = match (&state.metrics, observation) {
                (Some(old), Observation::Metrics(new)) => matches!(
                    (old.prefix_cache_queries_total, new.prefix_cache_queries_total),
                    (Some(before), Some(after)) if after < before
                ),
                _ => false,
            };
            if state.down {
                t.came_up = true;
            }
            if state.down || counter_reset {
                state.clock = state.clock.saturating_add(capacity);
                state.window_start = state.clock;
                state.fill = 0;
                state.calibration = 1.0;
                t.forgot = true;
            }
            state.down = false;
            state.failures = 0;
            match observation {
                Observation::Metrics(m) => {
                    if let Some(scale) = calibration.filter(|s| s.is_finite()) {
                        state.calibration = scale;
                    }
                    match reported_capacity_tokens(m) {
                        Some(tokens) => state.capacity_tokens = tokens,
                        None => t.no_capacity = true,
                    }
                    state.metrics = Some(m.clone());
                    state.scraped_at_ms = now_ms;
                }
                _ => state.metrics = None,
            }
        }
    }
    t
}

/// Metrics recent enough to score with; older (or none) = unmeasured.
pub fn fresh_metrics(
    state: &EndpointState,
    now_ms: u64,
    stale_after_ms: u64,
) -> Option<&ServerMetrics> {
    state
        .metrics
        .as_ref()
        .filter(|_| now_ms.saturating_sub(state.scraped_at_ms) <= stale_after_ms)
}

/// Writes a scrape result into the shared record with bounded CAS retries.
pub fn record(
    host: &impl SharedData,
    key: &str,
    observation: &Observation,
    now_ms: u64,
    failures_to_down: u32,
    capacity: u64,
    calibration: Option<f64>,
) -> (CasOutcome<EndpointState>, Transition) {
    let mut transition = Transition::default();
    let outcome = cas_update(
        host,
        key,
        EndpointState::decode,
        EndpointState::encode,
        |mut state| {
            transition = apply(
                &mut state,
                observation,
                now_ms,
                failures_to_down,
                capacity,
                calibration,
            );
            Some(state)
        },
    );
    (outcome, transition)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::MemShared;

    const PAGE: &str = "# TYPE vllm:num_requests_waiting gauge\n\
        vllm:num_requests_waiting{model_name=\"m\"} 3\n\
        vllm:num_requests_running{model_name=\"m\"} 1\n\
        vllm:kv_cache_usage_perc{model_name=\"m\"} 0.5\n\
        vllm:prefix_cache_queries_total{model_name=\"m\"} 100\n";

    #[test]
    fn exactly_one_claim_per_interval_among_many_instances() {
        let host = MemShared::new();
        let key = "prefixroute/ep/127.0.0.1:1";
        let mut claims = 0;
        // Five instances tick every 250 ms for 10 s with a 1 s interval.
        for now in (0..10_000).step_by(250) {
            for _instance in 0..5 {
                if try_claim(&host, key, now, 1000).0 == Claim::Claimed {
                    claims += 1;
                }
            }
        }
        assert_eq!(claims, 10);
    }

    #[test]
    fn a_lost_race_is_reported() {
        let host = MemShared::new();
        let key = "k";
        assert_eq!(try_claim(&host, key, 0, 1000).0, Claim::Claimed);
        host.force_mismatches(1);
        assert_eq!(try_claim(&host, key, 1000, 1000).0, Claim::Lost);
        assert_eq!(try_claim(&host, key, 1000, 1000).0, Claim::Claimed);
        assert_eq!(try_claim(&host, key, 1500, 1000).0, Claim::NotDue);
    }

    #[test]
    fn observe_classifies_responses() {
        assert_eq!(observe(None, b"", "vllm:", None), Observation::Failed);
        assert_eq!(
            observe(Some(503), PAGE.as_bytes(), "vllm:", None),
            Observation::Failed
        );
        assert_eq!(
            observe(Some(200), b"{\"not\": \"prometheus\"}", "vllm:", None),
            Observation::Unparseable
        );
        assert_eq!(
            observe(Some(200), b"\xff\xfe", "vllm:", None),
            Observation::Unparseable
        );
        let Observation::Metrics(m) = observe(Some(200), PAGE.as_bytes(), "vllm:", Some("m"))
        else {
            panic!("expected metrics");
        };
        assert_eq!(m.num_requests_waiting, Some(3.0));
        assert_eq!(m.kv_cache_usage_perc, Some(0.5));
    }

    #[test]
    fn failures_mark_down_and_success_brings_up_and_forgets() {
        let mut s = EndpointState {
            clock: 50,
            fill: 30,
            ..EndpointState::default()
        };
        let ok = observe(Some(200), PAGE.as_bytes(), "vllm:", None);
        let no_capacity = Transition {
            no_capacity: true,
            ..Transition::default()
        };
        assert_eq!(apply(&mut s, &ok, 10, 2, 1000, None), no_capacity);
        assert_eq!(s.scraped_at_ms, 10);
        assert_eq!(
            apply(&mut s, &Observation::Failed, 20, 2, 1000, None),
            Transition::default()
        );
        assert!(!s.down);
        // One failure already makes the endpoint unmeasured: its old numbers are dropped.
        assert!(fresh_metrics(&s, 20, 5000).is_none());
        let t = apply(&mut s, &Observation::Failed, 30, 2, 1000, None);
        assert!(t.went_down && s.down);
        assert_eq!(
            apply(&mut s, &Observation::Failed, 40, 2, 1000, None),
            Transition::default()
        );
        assert_eq!(s.failures, 3);
        assert!(fresh_metrics(&s, 40, 5000).is_none());
        let t = apply(&mut s, &ok, 50, 2, 1000, None);
        assert!(t.came_up && t.forgot && !t.went_down);
        assert_eq!((s.down, s.failures, s.clock), (false, 0, 1050));
        assert_eq!(
            (s.fill, s.window_start),
            (0, 1050),
            "the belief starts empty"
        );
    }

    #[test]
    fn a_reported_cache_survives_failed_scrapes_and_bounds_the_window() {
        let mut s = EndpointState::default();
        let page =
            format!("{PAGE}vllm:cache_config_info{{block_size=\"32\",num_gpu_blocks=\"100\"}} 1\n");
        let ok = observe(Some(200), page.as_bytes(), "vllm:", None);
        assert_eq!(apply(&mut s, &ok, 10, 2, 1000, None), Transition::default());
        assert_eq!(s.capacity_tokens, 3200);
        apply(&mut s, &Observation::Failed, 20, 2, 1000, None);
        assert_eq!(s.capacity_tokens, 3200, "a timeout does not shrink a cache");
        // 3200 tokens in the router's blocks of 16: 200; never above the configured window.
        assert_eq!(capacity_blocks(&s, 16, 31_250), 200);
        assert_eq!(capacity_blocks(&s, 16, 50), 50);
        assert_eq!(capacity_blocks(&EndpointState::default(), 16, 50), 50);
        // "None" blocks (before vLLM's memory profile) and zero sizes report nothing.
        let unprofiled = ServerMetrics {
            num_gpu_blocks: Some(0),
            block_size: Some(16),
            ..ServerMetrics::default()
        };
        assert_eq!(reported_capacity_tokens(&unprofiled), None);
        let huge = ServerMetrics {
            num_gpu_blocks: Some(u64::MAX),
            block_size: Some(16),
            ..ServerMetrics::default()
        };
        assert_eq!(reported_capacity_tokens(&huge), Some(u64::MAX));
    }

    #[test]
    fn counter_reset_means_restart_and_unparseable_means_unmeasured() {
        let page = |q: u32| {
            observe(
                Some(200),
                format!("vllm:prefix_cache_queries_total {q}\n").as_bytes(),
                "vllm:",
                None,
            )
        };
        let mut s = EndpointState::default();
        apply(&mut s, &page(500), 1, 2, 10, None);
        assert!(!apply(&mut s, &page(600), 2, 2, 10, None).forgot);
        assert!(apply(&mut s, &page(20), 3, 2, 10, None).forgot);
        assert_eq!(s.clock, 10);
        apply(&mut s, &Observation::Unparseable, 4, 2, 10, None);
        assert!(s.metrics.is_none() && !s.down);
        assert!(fresh_metrics(&s, 4, 5000).is_none());
    }

    #[test]
    fn record_merges_with_concurrent_clock_writes() {
        let host = MemShared::new();
        let key = "k";
        assert_eq!(try_claim(&host, key, 0, 1000).0, Claim::Claimed);
        // Someone reserves index stamps meanwhile.
        let mut s = EndpointState::decode(&host.value(key).unwrap()).unwrap();
        s.clock = 77;
        host.set(key, &s.encode(), 0).unwrap();
        host.force_mismatches(1);
        let ok = observe(Some(200), PAGE.as_bytes(), "vllm:", None);
        let (outcome, _) = record(&host, key, &ok, 5, 2, 1000, None);
        let CasOutcome::Written(written) = outcome else {
            panic!("{outcome:?}")
        };
        assert_eq!(written.clock, 77, "clock kept");
        assert_eq!(written.next_scrape_ms, 1000, "lease kept");
        assert!(written.metrics.is_some());
    }
}
