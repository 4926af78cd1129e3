//! Scorers: each maps endpoints to a score in 0..1, higher is better. Names follow llm-d.
//!
//! An endpoint without fresh metrics ("unmeasured") scores 0 on every load scorer: the router
//! cannot tell it is idle, and sending traffic to an endpoint it cannot see is the riskier bet.

use serde::{Deserialize, Serialize};

use crate::latency::{EndpointWork, LatencyInputs, ServerQueue};

/// What the router knows about one endpoint's load at decision time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct EndpointLoad {
    /// Requests waiting in the endpoint's queue (`vllm:num_requests_waiting`, plus whatever the
    /// caller knows it sent since the last scrape). `None` = unmeasured.
    pub queue: Option<f64>,
    /// KV-cache usage 0..1 (`vllm:kv_cache_usage_perc`). `None` = unmeasured.
    pub kv_usage: Option<f64>,
    /// The endpoint is known to be failing and must not be picked while others are up.
    pub down: bool,
    /// What the `latency` policy predicts from: the router's own work on the endpoint, its
    /// scraped queue and its learned prefill model.
    pub latency: LatencyInputs,
}

impl EndpointLoad {
    pub fn measured(queue: f64, kv_usage: f64) -> Self {
        EndpointLoad {
            queue: Some(queue),
            kv_usage: Some(kv_usage),
            down: false,
            latency: LatencyInputs::default(),
        }
    }
}

/// The load the router assumes for an endpoint, from its last fresh scrape (if any) and the
/// requests this router has in flight to it (`work`, summed over every worker).
///
/// A scrape is a snapshot; requests sent since are not in it. The router's own in-flight count
/// covers what the server runs, what it queues and what is still on the wire, so
/// `in_flight − running` is a lower bound on what waits there now; the queue estimate is the
/// larger of that and the scraped queue. Without a fresh scrape the endpoint is unmeasured.
/// The latency inputs get the work and the scraped queue (with `sent_then`, the router's own
/// requests in flight when it first saw the scrape: [`ServerQueue::sent_then`]); the caller
/// adds the endpoint's learned prefill model.
pub fn estimate_load(
    metrics: Option<&crate::metrics::ServerMetrics>,
    work: EndpointWork,
    sent_then: Option<u32>,
    down: bool,
) -> EndpointLoad {
    let mut latency = LatencyInputs {
        work,
        ..LatencyInputs::default()
    };
    let Some(m) = metrics else {
        return EndpointLoad {
            queue: None,
            kv_usage: None,
            down,
            latency,
        };
    };
    let waiting = m.num_requests_waiting.unwrap_or(0.0).max(0.0);
    let running = m.num_requests_running.unwrap_or(0.0).max(0.0);
    let unseen = (f64::from(work.in_flight) - running).max(0.0);
    latency.server = Some(ServerQueue {
        waiting,
        running,
        sent_then,
    });
    EndpointLoad {
        queue: Some(waiting.max(unseen)),
        kv_usage: m.kv_cache_usage_perc.map(|u| u.clamp(0.0, 1.0)),
        down,
        latency,
    }
}

/// The optional match-length term of the prefix scorer:
/// `w·min(1, matched_tokens/scale)² + (1−w)·ratio`. With `w = 0` it is the plain ratio.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MatchLength {
    pub weight: f64,
    pub scale: f64,
}

impl Default for MatchLength {
    fn default() -> Self {
        MatchLength {
            weight: 0.0,
            scale: 8192.0,
        }
    }
}

/// prefix-cache scorer: share of the request's blocks the endpoint is believed to hold, with
/// an optional bonus for long absolute matches (a 4k-token hit saves more than a 40-token one
/// even when both are 50%).
pub fn prefix_score(
    matched_blocks: usize,
    total_blocks: usize,
    matched_tokens: usize,
    term: MatchLength,
) -> f64 {
    if total_blocks == 0 {
        return 0.0;
    }
    let ratio = matched_blocks.min(total_blocks) as f64 / total_blocks as f64;
    if term.weight <= 0.0 {
        return ratio;
    }
    let length = (matched_tokens as f64 / term.scale).min(1.0);
    term.weight * length * length + (1.0 - term.weight) * ratio
}

/// queue scorer: `(max − q) / (max − min)` over measured endpoints; all 1.0 when equal.
pub fn queue_scores(loads: &[EndpointLoad]) -> Vec<f64> {
    let measured = loads.iter().filter_map(|l| l.queue);
    let (min, max) = measured.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), q| {
        (lo.min(q), hi.max(q))
    });
    loads
        .iter()
        .map(|l| match l.queue {
            None => 0.0,
            Some(_) if max <= min => 1.0,
            Some(q) => (max - q) / (max - min),
        })
        .collect()
}

/// kv-cache-utilization scorer: `1 − usage`, clamped to 0..1.
pub fn kv_cache_scores(loads: &[EndpointLoad]) -> Vec<f64> {
    loads
        .iter()
        .map(|l| l.kv_usage.map_or(0.0, |u| (1.0 - u).clamp(0.0, 1.0)))
        .collect()
}

/// no-hit-lru scorer. When some endpoint holds part of the prefix, it stays neutral (0.5 for
/// all) and lets the prefix scorer speak. For a cold request it spreads new prefixes: endpoints
/// that never took a cold request score 1, the rest rank by how long ago they last did, the
/// most recent scoring 0. `last_cold[i]` is a logical time, larger = more recent.
pub fn no_hit_lru_scores(any_hit: bool, last_cold: &[Option<u64>]) -> Vec<f64> {
    let n = last_cold.len();
    if any_hit || n <= 1 {
        return vec![if any_hit { 0.5 } else { 1.0 }; n];
    }
    // Rank = how many endpoints took a cold request less recently than this one (never = -inf).
    let key = |i: usize| last_cold[i].map_or(0, |t| t + 1);
    (0..n)
        .map(|i| {
            let older = (0..n).filter(|&j| key(j) < key(i)).count();
            let never = key(i) == 0;
            if never {
                1.0
            } else {
                1.0 - older as f64 / (n - 1) as f64
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ratio_and_match_length_term() {
        let plain = MatchLength::default();
        assert_eq!(prefix_score(3, 4, 48, plain), 0.75);
        assert_eq!(prefix_score(0, 0, 0, plain), 0.0);
        assert_eq!(prefix_score(9, 4, 0, plain), 1.0, "clamped");
        let term = MatchLength {
            weight: 0.5,
            scale: 100.0,
        };
        // 0.5 · (50/100)² + 0.5 · 0.5
        assert!((prefix_score(2, 4, 50, term) - 0.375).abs() < 1e-12);
        // length term saturates at scale
        assert!((prefix_score(2, 4, 500, term) - 0.75).abs() < 1e-12);
    }

    #[test]
    fn queue_scores_normalise_over_measured_only() {
        let loads = [
            EndpointLoad::measured(0.0, 0.0),
            EndpointLoad::measured(4.0, 0.0),
            EndpointLoad::measured(2.0, 0.0),
            EndpointLoad::default(),
        ];
        assert_eq!(queue_scores(&loads), vec![1.0, 0.0, 0.5, 0.0]);
        let equal = [
            EndpointLoad::measured(3.0, 0.0),
            EndpointLoad::measured(3.0, 0.0),
        ];
        assert_eq!(queue_scores(&equal), vec![1.0, 1.0]);
    }

    #[test]
    fn load_estimate_combines_scrape_and_in_flight() {
        use crate::metrics::ServerMetrics;
        let m = ServerMetrics {
            num_requests_waiting: Some(2.0),
            num_requests_running: Some(4.0),
            kv_cache_usage_perc: Some(0.5),
            ..ServerMetrics::default()
        };
        let work = |in_flight| EndpointWork {
            in_flight,
            ..EndpointWork::default()
        };
        assert_eq!(
            estimate_load(Some(&m), work(3), None, false).queue,
            Some(2.0)
        );
        assert_eq!(
            estimate_load(Some(&m), work(9), None, false).queue,
            Some(5.0)
        );
        let load = estimate_load(Some(&m), work(9), None, false);
        assert_eq!(load.kv_usage, Some(0.5));
        assert_eq!(
            load.latency.server,
            Some(ServerQueue {
                waiting: 2.0,
                running: 4.0,
                sent_then: None,
            })
        );
        assert_eq!(load.latency.work.in_flight, 9);
        let unmeasured = estimate_load(None, work(9), None, true);
        assert_eq!(unmeasured.latency.server, None);
        assert_eq!(
            (unmeasured.queue, unmeasured.kv_usage, unmeasured.down),
            (None, None, true)
        );
    }

    #[test]
    fn kv_scores_invert_usage_and_zero_unmeasured() {
        let loads = [
            EndpointLoad::measured(0.0, 0.25),
            EndpointLoad::measured(0.0, 1.5),
            EndpointLoad::default(),
        ];
        assert_eq!(kv_cache_scores(&loads), vec![0.75, 0.0, 0.0]);
    }

    #[test]
    fn no_hit_lru_is_neutral_on_hits_and_favours_least_recent_on_misses() {
        assert_eq!(no_hit_lru_scores(true, &[Some(1), None]), vec![0.5, 0.5]);
        let s = no_hit_lru_scores(false, &[Some(5), None, Some(2)]);
        assert_eq!(s[1], 1.0, "never took a cold request");
        assert!(s[2] > s[0], "older cold pick scores higher");
        assert_eq!(s[0], 0.0, "most recent scores 0");
        assert_eq!(no_hit_lru_scores(false, &[None]), vec![1.0]);
    }
}
