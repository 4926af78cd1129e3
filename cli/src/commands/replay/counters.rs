//! The servers' own view of the run: `vllm:prefix_cache_{hits,queries}_total` before and after.
//!
//! Usage in responses says what each request was told; the counters say what the caches did,
//! including for requests the client gave up on. vLLM updates its counters from a periodic stats
//! loop, slightly after it answers, so the final reading is polled until it has caught up.

use std::str::FromStr;
use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use prefixroute_core::metrics::{parse_vllm, DEFAULT_PREFIX};
use serde::Serialize;
use tokio::time::Instant;

use hyper::Uri;

use super::client::{BaseUrl, HttpClient};

/// Time between polls while waiting for the counters to catch up.
const POLL_EVERY: Duration = Duration::from_millis(100);

/// `--metrics name=URL`: a server whose counters are read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsTarget {
    pub name: String,
    /// The page read: a bare `http://host:port` means that server's `/metrics`; a URL with a
    /// path is taken as is.
    pub page: Uri,
}

impl FromStr for MetricsTarget {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        let Some((name, url)) = s.split_once('=') else {
            bail!("expected NAME=URL, e.g. a=http://127.0.0.1:8001");
        };
        if name.is_empty() {
            bail!("the name before '=' is empty");
        }
        let url = BaseUrl::parse(url)?;
        let page = url.join(if url.is_root() { "/metrics" } else { "" })?;
        Ok(MetricsTarget {
            name: name.to_string(),
            page,
        })
    }
}

/// One reading of a server's prefix-cache counters, in tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counters {
    pub hits: f64,
    pub queries: f64,
}

impl Counters {
    /// Growth since `before`; a counter that went down (server restarted) counts from zero.
    pub fn since(self, before: Counters) -> Counters {
        let grow = |now: f64, then: f64| if now >= then { now - then } else { now };
        Counters {
            hits: grow(self.hits, before.hits),
            queries: grow(self.queries, before.queries),
        }
    }
}

/// One server's share of the run, as reported.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ServerDelta {
    pub name: String,
    pub metrics_url: String,
    pub hits: u64,
    pub queries: u64,
    /// hits / queries; null when the server saw no queries.
    pub hit_rate: Option<f64>,
}

pub fn ratio(part: u64, whole: u64) -> Option<f64> {
    (whole > 0).then(|| part as f64 / whole as f64)
}

impl ServerDelta {
    pub fn new(target: &MetricsTarget, delta: Counters) -> ServerDelta {
        // Counters count tokens, so they are whole numbers however the page prints them.
        let (hits, queries) = (delta.hits.round() as u64, delta.queries.round() as u64);
        ServerDelta {
            name: target.name.clone(),
            metrics_url: target.page.to_string(),
            hits,
            queries,
            hit_rate: ratio(hits, queries),
        }
    }
}

pub async fn scrape(client: &HttpClient, target: &MetricsTarget) -> Result<Counters> {
    let context = || format!("metrics of {} ({})", target.name, target.page);
    let exchange = client
        .get(target.page.clone())
        .await
        .map_err(|err| anyhow!("cannot read {}: {err}", context()))?;
    if !exchange.status.is_success() {
        bail!("cannot read {}: HTTP {}", context(), exchange.status);
    }
    let text = String::from_utf8_lossy(&exchange.body);
    let metrics = parse_vllm(&text, DEFAULT_PREFIX, None)
        .map_err(|err| anyhow!("bad {}: {err}", context()))?;
    match (
        metrics.prefix_cache_hits_total,
        metrics.prefix_cache_queries_total,
    ) {
        (Some(hits), Some(queries)) => Ok(Counters { hits, queries }),
        _ => bail!(
            "{} has no vllm:prefix_cache_hits_total / queries_total (is prefix caching on?)",
            context()
        ),
    }
}

pub async fn scrape_all(client: &HttpClient, targets: &[MetricsTarget]) -> Result<Vec<Counters>> {
    let mut readings = Vec::with_capacity(targets.len());
    for target in targets {
        readings.push(scrape(client, target).await?);
    }
    Ok(readings)
}

/// Reads the counters until their query growth covers `expected_queries` prompt tokens (what
/// the responses reported) or `within` has passed. Returns the deltas and whether they caught up.
pub async fn settle(
    client: &HttpClient,
    targets: &[MetricsTarget],
    before: &[Counters],
    expected_queries: u64,
    within: Duration,
) -> Result<(Vec<Counters>, bool)> {
    let deadline = Instant::now() + within;
    loop {
        let deltas: Vec<Counters> = scrape_all(client, targets)
            .await?
            .into_iter()
            .zip(before)
            .map(|(after, &before)| after.since(before))
            .collect();
        let seen: f64 = deltas.iter().map(|d| d.queries).sum();
        let settled = seen.round() as u64 >= expected_queries;
        if settled || Instant::now() + POLL_EVERY > deadline {
            return Ok((deltas, settled));
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_as_name_equals_url() {
        let t: MetricsTarget = "a=http://127.0.0.1:9/".parse().unwrap();
        assert_eq!(t.name, "a");
        assert_eq!(t.page.to_string(), "http://127.0.0.1:9/metrics");
        let t: MetricsTarget = "b=http://h/custom/path".parse().unwrap();
        assert_eq!(t.page.to_string(), "http://h/custom/path");
        assert!("http://x".parse::<MetricsTarget>().is_err());
        assert!("=http://x".parse::<MetricsTarget>().is_err());
        assert!("a=https://x".parse::<MetricsTarget>().is_err());
    }

    #[test]
    fn deltas_survive_a_counter_reset() {
        let before = Counters {
            hits: 10.0,
            queries: 100.0,
        };
        let grown = Counters {
            hits: 30.0,
            queries: 150.0,
        };
        assert_eq!(
            grown.since(before),
            Counters {
                hits: 20.0,
                queries: 50.0
            }
        );
        let reset = Counters {
            hits: 5.0,
            queries: 20.0,
        };
        assert_eq!(reset.since(before), reset);
        assert_eq!(ratio(1, 4), Some(0.25));
        assert_eq!(ratio(0, 0), None);
    }
}
