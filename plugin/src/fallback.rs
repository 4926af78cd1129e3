//! The choice for requests the router cannot score: non-OpenAI paths (`GET /v1/models`), bodies
//! that do not parse or are too large, host errors. They still get a destination, because the
//! plugin always overwrites a client-supplied one.
//!
//! Least in-flight among endpoints that are up (all endpoints when every one is down), ties
//! broken by a rotating cursor so that idle endpoints share the load. Deterministic: no clock,
//! no randomness.

/// Why a request was routed by the fallback rather than the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FallbackReason {
    /// Not a POST to `/v1/chat/completions` or `/v1/completions`.
    NotRoutable,
    /// A routable request without a body.
    NoBody,
    /// Body larger than `max_body_bytes`.
    BodyTooLarge,
    /// The body is not an OpenAI request the core can parse (not JSON, wrong types, empty
    /// messages, …).
    ParseError,
    /// The host did not hand over the buffered body.
    BodyUnavailable,
    /// The plugin state was unavailable (re-entrant call or not configured).
    Internal,
    /// The discovered pool has no member (yet): no destination is set, so Envoy's
    /// override_host `fallback_policy` picks.
    NoEndpoints,
}

impl FallbackReason {
    pub const ALL: [FallbackReason; 7] = [
        FallbackReason::NotRoutable,
        FallbackReason::NoBody,
        FallbackReason::BodyTooLarge,
        FallbackReason::ParseError,
        FallbackReason::BodyUnavailable,
        FallbackReason::Internal,
        FallbackReason::NoEndpoints,
    ];

    /// Stable name used in stats and the `x-prefixroute-fallback` response header.
    pub fn name(self) -> &'static str {
        match self {
            FallbackReason::NotRoutable => "not_routable",
            FallbackReason::NoBody => "no_body",
            FallbackReason::BodyTooLarge => "body_too_large",
            FallbackReason::ParseError => "parse_error",
            FallbackReason::BodyUnavailable => "body_unavailable",
            FallbackReason::Internal => "internal",
            FallbackReason::NoEndpoints => "no_endpoints",
        }
    }
}

/// Picks the fallback endpoint and advances `cursor`. `down[i]` and `in_flight[i]` describe
/// endpoint `i`; missing entries count as up and idle. Returns 0 when there are no endpoints
/// (callers never configure none).
pub fn choose(down: &[bool], in_flight: &[u32], cursor: &mut usize) -> usize {
    let n = down.len().max(in_flight.len());
    if n == 0 {
        return 0;
    }
    let all_down = (0..n).all(|i| down.get(i).copied().unwrap_or(false));
    let eligible = |i: usize| all_down || !down.get(i).copied().unwrap_or(false);
    let load = |i: usize| in_flight.get(i).copied().unwrap_or(0);
    let start = *cursor % n;
    let mut best: Option<usize> = None;
    for step in 0..n {
        let i = (start + step) % n;
        if !eligible(i) {
            continue;
        }
        // Strictly less: the first endpoint at the minimum, from the cursor on, wins.
        if best.map_or(true, |b| load(i) < load(b)) {
            best = Some(i);
        }
    }
    let chosen = best.unwrap_or(start);
    *cursor = chosen + 1;
    chosen
}

/// Where a fallback request retries if `chosen` refuses: up to `k` other endpoints that are
/// up, in rotation order after it.
pub fn failover(down: &[bool], chosen: usize, k: usize) -> Vec<usize> {
    let n = down.len();
    (1..n)
        .map(|step| (chosen + step) % n)
        .filter(|&i| !down[i])
        .take(k)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_in_flight_among_up_endpoints() {
        let mut cursor = 0;
        assert_eq!(choose(&[false, false, false], &[3, 1, 2], &mut cursor), 1);
        assert_eq!(choose(&[false, true, false], &[3, 0, 2], &mut cursor), 2);
    }

    #[test]
    fn idle_ties_rotate() {
        let mut cursor = 0;
        let picks: Vec<usize> = (0..6)
            .map(|_| choose(&[false; 3], &[0, 0, 0], &mut cursor))
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        let mut cursor = 0;
        let picks: Vec<usize> = (0..4)
            .map(|_| choose(&[false, true, false], &[0, 0, 0], &mut cursor))
            .collect();
        assert_eq!(picks, vec![0, 2, 0, 2]);
    }

    #[test]
    fn all_down_ignores_health_and_empty_is_zero() {
        let mut cursor = 0;
        assert_eq!(choose(&[true, true], &[5, 1], &mut cursor), 1);
        assert_eq!(choose(&[], &[], &mut cursor), 0);
        assert_eq!(choose(&[false, false], &[], &mut cursor), 0);
    }

    #[test]
    fn failover_lists_up_endpoints_after_the_chosen_one() {
        assert_eq!(failover(&[false, true, false, false], 2, 2), [3, 0]);
        assert_eq!(failover(&[false, false], 0, 0), Vec::<usize>::new());
        assert_eq!(failover(&[], usize::MAX, 2), Vec::<usize>::new());
    }

    #[test]
    fn reasons_have_unique_names() {
        let mut names: Vec<&str> = FallbackReason::ALL.iter().map(|r| r.name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), FallbackReason::ALL.len());
    }
}
