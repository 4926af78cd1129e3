//! Endpoints that answer with server errors leave the rotation for a while.
//!
//! A replica whose engine died but whose HTTP server lives answers every request at once with
//! a 5xx, and its `/metrics` page may still say it is idle: to a router that predicts time from
//! queues and caches it is the fastest endpoint there is, and the prefix index keeps sending
//! the groups it believes live there (measured through real Envoy before this existed: one such
//! replica of three took the first try of 114 of 300 requests, each a failed request unless the
//! route retried server errors, docs/benchmarks.md). The scrape only sees a server that does
//! not answer its scrapes. So the answers themselves are watched, as Envoy's
//! outlier detection does (`consecutive_5xx`): [`CONSECUTIVE_5XX`] server errors in a row eject
//! the endpoint for [`BASE_EJECTION_MS`] times the number of ejections in a row (at most
//! [`MAX_EJECTION_MS`]); then it is back in rotation, and one more run of errors ejects it for
//! longer. A success after an ejection ended starts the count of ejections again.
//!
//! A 4xx is the client's error (a malformed body, an unknown model) and counts as an answer
//! like a success: a client that sends bad requests must not empty the pool. What is done
//! when every endpoint is out is the router's rule for endpoints that are all down: it routes
//! among them anyway.

use serde::{Deserialize, Serialize};

/// Server errors in a row that eject an endpoint (Envoy's `consecutive_5xx` default).
pub const CONSECUTIVE_5XX: u16 = 5;
/// The first ejection's length (Envoy's `base_ejection_time` default); the n-th in a row lasts
/// n times as long.
pub const BASE_EJECTION_MS: u64 = 30_000;
/// The longest ejection (Envoy's `max_ejection_time` default).
pub const MAX_EJECTION_MS: u64 = 300_000;

/// The route's retry back-off (`prefixroute serve`'s Envoy configuration): Envoy waits a random
/// time below `(2^n − 1) × base` (at most `max`) before its n-th retry, so that a failed try is
/// retried on the next replica of the failover list within milliseconds.
pub const RETRY_BACK_OFF_BASE_MS: u64 = 5;
pub const RETRY_BACK_OFF_MAX_MS: u64 = 50;

/// The mean wait before Envoy's `n`-th retry (from 1) under [`RETRY_BACK_OFF_BASE_MS`] and
/// [`RETRY_BACK_OFF_MAX_MS`]: half the bound of its fully jittered draw.
pub fn mean_retry_back_off_ms(n: u32) -> f64 {
    let bound = ((1u64 << n.min(16)) - 1) * RETRY_BACK_OFF_BASE_MS;
    bound.min(RETRY_BACK_OFF_MAX_MS) as f64 / 2.0
}

/// One endpoint's recent answers, shared by every worker of a proxy (the plugin keeps it in
/// the endpoint's shared record).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutlierState {
    /// Server errors since the last answer that was not one.
    pub consecutive_5xx: u16,
    /// Ejections since the endpoint last answered well out of an ejection.
    pub ejections: u16,
    /// Out of rotation until this instant (ms on the caller's clock); 0 = never ejected.
    pub ejected_until_ms: u64,
}

/// What an answer did to an [`OutlierState`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answered {
    /// Nothing to record (a success with no errors or ejections to forget).
    Unchanged,
    /// The counts moved; the endpoint stays where it was.
    Counted,
    /// This answer ejected the endpoint, until the given instant.
    Ejected { until_ms: u64 },
}

impl OutlierState {
    /// Whether the endpoint is out of rotation at `now_ms`.
    pub fn ejected(&self, now_ms: u64) -> bool {
        now_ms < self.ejected_until_ms
    }

    /// Records an answer with HTTP `status` at `now_ms`. Errors that arrive while the
    /// endpoint is ejected (requests sent before it was) count towards nothing.
    pub fn answered(&mut self, status: u32, now_ms: u64) -> Answered {
        let ejected = self.ejected(now_ms);
        if status < 500 {
            let forget_ejections = !ejected && self.ejections > 0;
            if self.consecutive_5xx == 0 && !forget_ejections {
                return Answered::Unchanged;
            }
            self.consecutive_5xx = 0;
            if forget_ejections {
                self.ejections = 0;
            }
            return Answered::Counted;
        }
        if ejected {
            return Answered::Unchanged;
        }
        self.consecutive_5xx = self.consecutive_5xx.saturating_add(1);
        if self.consecutive_5xx < CONSECUTIVE_5XX {
            return Answered::Counted;
        }
        self.consecutive_5xx = 0;
        self.ejections = self.ejections.saturating_add(1);
        let length = BASE_EJECTION_MS
            .saturating_mul(u64::from(self.ejections))
            .min(MAX_EJECTION_MS);
        self.ejected_until_ms = now_ms.saturating_add(length);
        Answered::Ejected {
            until_ms: self.ejected_until_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_wait_longer_each_time_up_to_the_maximum() {
        assert_eq!(mean_retry_back_off_ms(1), 2.5);
        assert_eq!(mean_retry_back_off_ms(2), 7.5);
        assert_eq!(mean_retry_back_off_ms(3), 17.5);
        assert_eq!(mean_retry_back_off_ms(4), 25.0);
        assert_eq!(mean_retry_back_off_ms(40), 25.0);
    }

    fn errors(state: &mut OutlierState, n: u16, now_ms: u64) -> Vec<Answered> {
        (0..n).map(|_| state.answered(503, now_ms)).collect()
    }

    #[test]
    fn five_server_errors_in_a_row_eject_an_endpoint_for_thirty_seconds() {
        let mut s = OutlierState::default();
        let four = errors(&mut s, 4, 1_000);
        assert!(four.iter().all(|a| *a == Answered::Counted));
        assert!(!s.ejected(1_000));
        assert_eq!(
            s.answered(500, 1_000),
            Answered::Ejected { until_ms: 31_000 }
        );
        assert!(s.ejected(30_999));
        assert!(!s.ejected(31_000), "back in rotation once the time is up");
    }

    #[test]
    fn a_success_or_a_client_error_between_server_errors_starts_the_count_again() {
        let mut s = OutlierState::default();
        errors(&mut s, 4, 0);
        assert_eq!(s.answered(200, 0), Answered::Counted);
        errors(&mut s, 4, 0);
        assert_eq!(
            s.answered(400, 0),
            Answered::Counted,
            "a bad request is the client's"
        );
        errors(&mut s, 4, 0);
        assert!(!s.ejected(0));
        assert_eq!(s.answered(200, 0), Answered::Counted);
        assert_eq!(
            s.answered(200, 0),
            Answered::Unchanged,
            "nothing left to forget"
        );
    }

    #[test]
    fn ejections_in_a_row_last_longer_up_to_five_minutes() {
        let mut s = OutlierState::default();
        let mut now = 0;
        let mut lengths = Vec::new();
        for _ in 0..12 {
            let last = errors(&mut s, CONSECUTIVE_5XX, now);
            let Some(Answered::Ejected { until_ms }) = last.last().copied() else {
                panic!("not ejected: {last:?}");
            };
            lengths.push(until_ms - now);
            now = until_ms;
        }
        assert_eq!(&lengths[..3], &[30_000, 60_000, 90_000]);
        assert_eq!(lengths[11], MAX_EJECTION_MS);
    }

    #[test]
    fn errors_while_ejected_count_for_nothing_and_a_success_after_forgets_ejections() {
        let mut s = OutlierState::default();
        errors(&mut s, CONSECUTIVE_5XX, 0);
        assert!(errors(&mut s, 20, 10_000)
            .iter()
            .all(|a| *a == Answered::Unchanged));
        assert_eq!(s.ejected_until_ms, 30_000, "not extended by stragglers");
        assert_eq!(
            s.answered(200, 20_000),
            Answered::Unchanged,
            "still ejected"
        );
        assert_eq!(s.answered(200, 30_000), Answered::Counted);
        assert_eq!(s.ejections, 0);
        let again = errors(&mut s, CONSECUTIVE_5XX, 40_000);
        assert_eq!(again.last(), Some(&Answered::Ejected { until_ms: 70_000 }));
    }
}
