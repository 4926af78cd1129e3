//! Outcomes and counter deltas → the report, as JSON (stable names) or as text.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::Duration;

use prefixroute_sim::summary::{groups_on_one_endpoint, percentile};
use serde::Serialize;

use super::counters::{ratio, ServerDelta};
use super::send::Outcome;

/// Successful responses that named no endpoint are counted under this key.
const UNKNOWN_ENDPOINT: &str = "unknown";

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Latency {
    pub p50: Option<f64>,
    pub p95: Option<f64>,
    pub max: Option<f64>,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct GroupsOnOne {
    pub single: usize,
    pub groups: usize,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct UsageTotals {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub cached_ratio: Option<f64>,
    pub responses_without_usage: usize,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ServerCounters {
    pub hits: u64,
    pub queries: u64,
    pub hit_rate: Option<f64>,
    /// Whether the query counters grew by at least the prompt tokens the responses reported
    /// before the settle time ran out (false: some server behind the URL was not scraped, or
    /// the servers were still catching up).
    pub settled: bool,
    pub servers: Vec<ServerDelta>,
}

impl ServerCounters {
    pub fn new(servers: Vec<ServerDelta>, settled: bool) -> ServerCounters {
        let hits = servers.iter().map(|s| s.hits).sum();
        let queries = servers.iter().map(|s| s.queries).sum();
        ServerCounters {
            hits,
            queries,
            hit_rate: ratio(hits, queries),
            settled,
            servers,
        }
    }
}

/// The whole report. Field names are part of the command's interface (documented in
/// `replay --help`); add fields, never rename them.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Summary {
    pub trace: String,
    pub url: String,
    pub requests: usize,
    pub succeeded: usize,
    pub errors: usize,
    pub errors_by_kind: BTreeMap<String, usize>,
    pub error_examples: BTreeMap<String, String>,
    pub duration_s: f64,
    pub max_send_lag_ms: f64,
    pub latency_ms: Latency,
    /// Send to the first byte of the body, successful requests with a body only: a streamed
    /// answer's time to first token (about `latency_ms` for answers sent whole).
    pub ttft_ms: Latency,
    pub endpoints: BTreeMap<String, usize>,
    pub groups_on_one_endpoint: GroupsOnOne,
    pub group_endpoints: GroupEndpoints,
    pub usage: UsageTotals,
    pub server_counters: Option<ServerCounters>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Percentiles of `values` (ms); `None` each when there are none.
fn percentiles(values: &[f64]) -> Latency {
    let at = |p| (!values.is_empty()).then(|| percentile(values, p));
    Latency {
        p50: at(50.0),
        p95: at(95.0),
        max: at(100.0),
    }
}

fn latency(outcomes: &[Outcome]) -> Latency {
    let values: Vec<f64> = outcomes
        .iter()
        .filter(|o| o.result.is_ok())
        .map(|o| ms(o.latency))
        .collect();
    percentiles(&values)
}

fn ttft(outcomes: &[Outcome]) -> Latency {
    let values: Vec<f64> = outcomes
        .iter()
        .filter_map(|o| o.result.as_ref().ok()?.first_byte)
        .map(ms)
        .collect();
    percentiles(&values)
}

fn usage_totals(outcomes: &[Outcome]) -> UsageTotals {
    let mut totals = UsageTotals {
        prompt_tokens: 0,
        cached_tokens: 0,
        cached_ratio: None,
        responses_without_usage: 0,
    };
    for answer in outcomes.iter().filter_map(|o| o.result.as_ref().ok()) {
        match answer.usage {
            Some(usage) => {
                totals.prompt_tokens += usage.prompt_tokens;
                totals.cached_tokens += usage.cached_tokens;
            }
            None => totals.responses_without_usage += 1,
        }
    }
    totals.cached_ratio = ratio(totals.cached_tokens, totals.prompt_tokens);
    totals
}

/// Successful requests per endpoint for each group.
type GroupEndpoints = BTreeMap<String, BTreeMap<String, usize>>;

/// Requests per endpoint, how many groups stayed on one endpoint (prefix locality), and where
/// each group went.
fn routing(outcomes: &[Outcome]) -> (BTreeMap<String, usize>, GroupsOnOne, GroupEndpoints) {
    let mut endpoints: BTreeMap<String, usize> = BTreeMap::new();
    let mut by_group: GroupEndpoints = BTreeMap::new();
    let mut routes = Vec::new();
    for outcome in outcomes {
        let Ok(answer) = &outcome.result else {
            continue;
        };
        let name = answer.endpoint.as_deref().unwrap_or(UNKNOWN_ENDPOINT);
        *endpoints.entry(name.to_string()).or_default() += 1;
        if answer.endpoint.is_some() {
            routes.push((outcome.group.as_str(), name.to_string()));
            *by_group
                .entry(outcome.group.clone())
                .or_default()
                .entry(name.to_string())
                .or_default() += 1;
        }
    }
    // Endpoint indices by sorted name: stable, and all core's helper needs.
    let index: BTreeMap<&str, usize> = endpoints
        .keys()
        .enumerate()
        .map(|(i, name)| (name.as_str(), i))
        .collect();
    let (single, groups) =
        groups_on_one_endpoint(routes.iter().map(|(g, e)| (*g, index[e.as_str()])));
    (endpoints, GroupsOnOne { single, groups }, by_group)
}

impl Summary {
    pub fn new(
        trace: String,
        url: String,
        outcomes: &[Outcome],
        duration: Duration,
        server_counters: Option<ServerCounters>,
    ) -> Summary {
        let mut errors_by_kind: BTreeMap<String, usize> = BTreeMap::new();
        let mut error_examples = BTreeMap::new();
        for failure in outcomes.iter().filter_map(|o| o.result.as_ref().err()) {
            *errors_by_kind.entry(failure.kind()).or_default() += 1;
            error_examples
                .entry(failure.kind())
                .or_insert_with(|| failure.to_string());
        }
        let errors = errors_by_kind.values().sum();
        let (endpoints, groups_on_one_endpoint, group_endpoints) = routing(outcomes);
        Summary {
            trace,
            url,
            requests: outcomes.len(),
            succeeded: outcomes.len() - errors,
            errors,
            errors_by_kind,
            error_examples,
            duration_s: duration.as_secs_f64(),
            max_send_lag_ms: outcomes.iter().map(|o| ms(o.send_lag)).fold(0.0, f64::max),
            latency_ms: latency(outcomes),
            ttft_ms: ttft(outcomes),
            endpoints,
            groups_on_one_endpoint,
            group_endpoints,
            usage: usage_totals(outcomes),
            server_counters,
        }
    }

    /// The human-readable report; every number also appears in the JSON.
    pub fn text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "replayed {} requests from {} to {} in {:.2} s (max send lag {:.1} ms)",
            self.requests, self.trace, self.url, self.duration_s, self.max_send_lag_ms
        );
        self.write_errors(&mut out);
        let fmt_ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1} ms"));
        for (name, l) in [("latency", &self.latency_ms), ("first byte", &self.ttft_ms)] {
            let _ = writeln!(
                out,
                "{:<18}p50 {}  p95 {}  max {}",
                name,
                fmt_ms(l.p50),
                fmt_ms(l.p95),
                fmt_ms(l.max)
            );
        }
        let endpoints: Vec<String> = self
            .endpoints
            .iter()
            .map(|(name, n)| format!("{name} {n}"))
            .collect();
        let endpoints = if endpoints.is_empty() {
            "-".to_string()
        } else {
            endpoints.join(", ")
        };
        let _ = writeln!(out, "{:<18}{endpoints}", "endpoints");
        let g = &self.groups_on_one_endpoint;
        let _ = writeln!(
            out,
            "{:<18}{} of {} groups sent all requests to one endpoint",
            "groups on one", g.single, g.groups
        );
        let u = &self.usage;
        let _ = writeln!(
            out,
            "{:<18}{} of {} prompt tokens ({}) from response usage{}",
            "cached tokens",
            u.cached_tokens,
            u.prompt_tokens,
            percent(u.cached_ratio),
            if u.responses_without_usage > 0 {
                format!("; {} responses had no usage", u.responses_without_usage)
            } else {
                String::new()
            }
        );
        self.write_servers(&mut out);
        out
    }

    fn write_errors(&self, out: &mut String) {
        let kinds: Vec<String> = self
            .errors_by_kind
            .iter()
            .map(|(kind, n)| format!("{kind} {n}"))
            .collect();
        let detail = if kinds.is_empty() {
            String::new()
        } else {
            format!(" ({})", kinds.join(", "))
        };
        let _ = writeln!(out, "{:<18}{}{detail}", "errors", self.errors);
        for (kind, example) in &self.error_examples {
            let _ = writeln!(out, "  {kind:<16}e.g. {example}");
        }
    }

    fn write_servers(&self, out: &mut String) {
        let Some(c) = &self.server_counters else {
            let _ = writeln!(out, "{:<18}- (no --metrics given)", "server hit rate");
            return;
        };
        let note = if c.settled {
            ""
        } else {
            "; counters did not cover every prompt token"
        };
        let _ = writeln!(
            out,
            "{:<18}{} ({} of {} tokens, counter deltas{note})",
            "server hit rate",
            percent(c.hit_rate),
            c.hits,
            c.queries
        );
        for s in &c.servers {
            let _ = writeln!(
                out,
                "  {:<16}{} ({} of {})",
                s.name,
                percent(s.hit_rate),
                s.hits,
                s.queries
            );
        }
    }
}

fn percent(share: Option<f64>) -> String {
    share.map_or("-".into(), |s| format!("{:.1}%", s * 100.0))
}

#[cfg(test)]
mod tests {
    use super::super::client::Failure;
    use super::super::send::{Answer, Usage};
    use super::*;
    use hyper::StatusCode;

    fn ok(group: &str, endpoint: &str, latency_ms: u64, prompt: u64, cached: u64) -> Outcome {
        Outcome {
            group: group.into(),
            send_lag: Duration::ZERO,
            latency: Duration::from_millis(latency_ms),
            result: Ok(Answer {
                endpoint: Some(endpoint.into()),
                usage: Some(Usage {
                    prompt_tokens: prompt,
                    cached_tokens: cached,
                }),
                router: Vec::new(),
                first_byte: Some(Duration::from_millis(latency_ms / 2)),
            }),
        }
    }

    fn failed(failure: Failure) -> Outcome {
        Outcome {
            group: "g".into(),
            send_lag: Duration::from_millis(3),
            latency: Duration::from_secs(1),
            result: Err(failure),
        }
    }

    #[test]
    fn summary_counts_errors_latency_usage_and_locality() {
        let outcomes = vec![
            ok("t0", "a", 10, 100, 0),
            ok("t0", "a", 20, 100, 96),
            ok("t1", "a", 30, 50, 0),
            ok("t1", "b", 40, 50, 48),
            failed(Failure::Status(StatusCode::SERVICE_UNAVAILABLE)),
            failed(Failure::Timeout(Duration::from_secs(1))),
            failed(Failure::Timeout(Duration::from_secs(1))),
        ];
        let s = Summary::new("t".into(), "u".into(), &outcomes, Duration::ZERO, None);
        assert_eq!((s.requests, s.succeeded, s.errors), (7, 4, 3));
        assert_eq!(s.errors_by_kind["timeout"], 2);
        assert_eq!(s.errors_by_kind["http_503"], 1);
        assert_eq!(s.latency_ms.p50, Some(20.0));
        assert_eq!(s.latency_ms.max, Some(40.0));
        // The first bytes came halfway through each answer.
        assert_eq!((s.ttft_ms.p50, s.ttft_ms.max), (Some(10.0), Some(20.0)));
        assert_eq!(s.max_send_lag_ms, 3.0);
        assert_eq!(s.endpoints["a"], 3);
        assert_eq!(
            s.groups_on_one_endpoint,
            GroupsOnOne {
                single: 1,
                groups: 2
            }
        );
        assert_eq!(s.usage.prompt_tokens, 300);
        assert_eq!(s.usage.cached_ratio, Some(144.0 / 300.0));
        let text = s.text();
        assert!(
            text.contains("errors            3 (http_503 1, timeout 2)"),
            "{text}"
        );
        assert!(
            text.contains("first byte        p50 10.0 ms  p95 20.0 ms  max 20.0 ms"),
            "{text}"
        );
    }

    #[test]
    fn all_failed_run_reports_no_latency() {
        let s = Summary::new(
            "t".into(),
            "u".into(),
            &[failed(Failure::Connect("refused".into()))],
            Duration::ZERO,
            None,
        );
        assert_eq!(s.latency_ms.p50, None);
        assert_eq!(s.ttft_ms.p95, None);
        assert_eq!(s.usage.cached_ratio, None);
        assert!(s.text().contains("e.g. cannot connect: refused"));
    }
}
