//! `prefixroute replay`: sends a trace to a live endpoint (router, Envoy or one replica) at the
//! trace's timestamps and reports what happened: errors, latency, which endpoint served each
//! group, the cached tokens the responses reported, and the servers' own hit counters.
//!
//! The replay is open-loop: request i leaves at start + t_i whether or not earlier ones have
//! been answered, because that is how independent users load a service; a closed loop would
//! slow down exactly when the service does and hide its queueing.

mod client;
mod counters;
mod send;
mod summary;

use std::collections::BTreeSet;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use prefixroute_sim::simulation::GatewaySpread;
use tokio::sync::Semaphore;
use tokio::time::Instant;

use client::{BaseUrl, Failure, HttpClient};
use counters::{MetricsTarget, ServerDelta};
use send::{Outcome, Prepared};
use summary::ServerCounters;
pub use summary::Summary;

const JSON_FIELDS: &str = "\
JSON output (--json) is one object; its field names are stable:
  trace, url               the trace file and the base URL (several: comma-separated)
  requests                 requests in the trace (all were sent)
  succeeded, errors        2xx answers / everything else
  errors_by_kind           {kind: count}; kinds: http_<status>, timeout, connect, transport
  error_examples           {kind: message of the first error of that kind}
  duration_s               from the first send to the last answer
  max_send_lag_ms          worst delay of a send behind its timestamp (near 0 unless
                           --concurrency-limit or an overloaded client holds requests back)
  latency_ms               {p50, p95, max}: send to last byte, successful requests only
  ttft_ms                  {p50, p95, max}: send to the body's first byte, successful requests
                           only: a streamed answer's time to first token (bodies with
                           \"stream\": true, see `trace --stream`); about latency_ms otherwise
  endpoints                {endpoint: successful requests}; the endpoint is the response's
                           x-prefixroute-endpoint header, else x-served-by, else \"unknown\"
  groups_on_one_endpoint   {single, groups}: trace groups whose requests all went to one
                           endpoint, out of the groups with a known endpoint
  group_endpoints          {group: {endpoint: successful requests}}
  usage                    {prompt_tokens, cached_tokens, cached_ratio,
                           responses_without_usage}: sums of the responses' usage
                           (cached = usage.prompt_tokens_details.cached_tokens)
  server_counters          null without --metrics; else {hits, queries, hit_rate, settled,
                           servers: [{name, metrics_url, hits, queries, hit_rate}]}: growth of
                           vllm:prefix_cache_hits_total / queries_total during the run, in tokens
                           (settled: the query growth covered every prompt token reported in
                           usage within --settle-s)
Ratios are in 0..1 and null when nothing was counted; latencies are null when nothing succeeded.

--requests-out FILE writes one JSON object per request, in trace order:
  index, group, at_ms      its place in the trace and its timestamp
  send_lag_ms, latency_ms  as above (latency also for failed requests: until the failure)
  ttft_ms                  as above; null for a failed request or an empty body
  endpoint                 as above; null for a failed request
  prompt_tokens, cached_tokens  the response's usage; null without one
  router                   {name: value} of the router's x-prefixroute-* headers but the
                           endpoint (policy, match, uncached-tokens, queue-ms, ttft-ms,
                           fallback); empty from a router that sets none
  error                    null, or the failure's message

A streaming body without stream_options is sent with {\"include_usage\": true} so that its
usage can be counted; every other body is sent exactly as written.

Exit status: 0 when the replay ran (request errors are in the report); 2 when it could not
start (bad trace, bad URL, unreadable --metrics server) or a server's counters could not be
read afterwards (the report is printed first).";

#[derive(clap::Args)]
#[command(after_long_help = JSON_FIELDS)]
pub struct Args {
    /// Trace file (JSONL) from `prefixroute trace`.
    trace: PathBuf,
    /// Base URL requests are sent to, e.g. http://127.0.0.1:8080; bodies with `messages` go to
    /// /v1/chat/completions, bodies with `prompt` to /v1/completions. Repeat it to spread
    /// requests over several gateways (see `--url-spread`).
    #[arg(long = "url", required = true)]
    urls: Vec<String>,
    /// With several `--url`s: `in-turn` (request i to URL i mod n) or `by-group` (every
    /// request of a trace group to one URL, as session affinity in front of the gateways).
    #[arg(long, default_value = "in-turn", value_parser = str::parse::<GatewaySpread>)]
    url_spread: GatewaySpread,
    /// NAME=URL of a server whose prefix-cache counters are read before and after the run
    /// (repeatable). A URL without a path means its /metrics.
    #[arg(long = "metrics", value_name = "NAME=URL")]
    metrics: Vec<String>,
    /// At most N requests in flight; later ones leave late. Default: no limit.
    #[arg(long, value_name = "N", value_parser = positive)]
    concurrency_limit: Option<usize>,
    /// Per-request limit (connect to last byte), also for each metrics read.
    #[arg(long, default_value_t = 30.0, value_parser = seconds)]
    timeout_s: f64,
    /// Longest wait after the run for the servers' counters to catch up with the responses.
    #[arg(long, default_value_t = 10.0, value_parser = seconds)]
    settle_s: f64,
    /// Print one JSON object (fields below) instead of the text report.
    #[arg(long)]
    json: bool,
    /// No progress bar (it is also hidden when stderr is not a terminal).
    #[arg(long)]
    no_progress: bool,
    /// Also write one JSON line per request to FILE: where it went, how long it took, and the
    /// router's explanation from its response headers (fields below).
    #[arg(long, value_name = "FILE")]
    requests_out: Option<PathBuf>,
}

fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err("must be a whole number >= 1".into()),
    }
}

fn seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        // Capped at a day so the value always fits a Duration.
        Ok(v) if v.is_finite() && v > 0.0 && v <= 86_400.0 => Ok(v),
        _ => Err("must be a number of seconds in (0, 86400]".into()),
    }
}

fn metrics_targets(specs: &[String]) -> Result<Vec<MetricsTarget>> {
    let mut names = BTreeSet::new();
    let mut targets = Vec::with_capacity(specs.len());
    for spec in specs {
        let target: MetricsTarget = spec.parse().with_context(|| format!("--metrics {spec}"))?;
        if !names.insert(target.name.clone()) {
            bail!("--metrics: the name {:?} is given twice", target.name);
        }
        targets.push(target);
    }
    Ok(targets)
}

/// Everything a run needs, checked before anything is sent.
struct Run {
    trace: String,
    urls: Vec<BaseUrl>,
    requests: Vec<Prepared>,
    targets: Vec<MetricsTarget>,
    limit: Option<usize>,
    timeout: Duration,
    settle: Duration,
    progress: bool,
    /// Where to write one line per request (`--requests-out`), created before anything is
    /// sent so that a path that cannot be written fails before the run, not after it.
    requests_out: Option<(PathBuf, std::fs::File)>,
}

pub fn run(args: Args) -> Result<()> {
    let urls = args
        .urls
        .iter()
        .map(|u| BaseUrl::parse(u).with_context(|| format!("--url {u}")))
        .collect::<Result<Vec<_>>>()?;
    let targets = metrics_targets(&args.metrics)?;
    let records = super::read_trace(&args.trace)?;
    let run = Run {
        trace: args.trace.display().to_string(),
        requests: send::prepare(&records, &urls, args.url_spread)?,
        urls,
        targets,
        limit: args.concurrency_limit,
        timeout: Duration::from_secs_f64(args.timeout_s),
        settle: Duration::from_secs_f64(args.settle_s),
        progress: !args.no_progress && std::io::stderr().is_terminal(),
        requests_out: match args.requests_out {
            Some(path) => {
                let file = std::fs::File::create(&path).with_context(|| {
                    format!("--requests-out {}: cannot create it", path.display())
                })?;
                Some((path, file))
            }
            None => None,
        },
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let (summary, late_error) = runtime.block_on(replay(run))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print!("{}", summary.text());
    }
    late_error.map_or(Ok(()), Err)
}

/// Replays already-read records without a progress bar (for `compare`, which drives several
/// replays itself). Errors reading the counters afterwards are returned as errors.
pub fn replay_records(
    label: &str,
    records: &[prefixroute_sim::trace::TraceRecord],
    url: &str,
    metrics: &[String],
    timeout: Duration,
    settle: Duration,
) -> Result<Summary> {
    let urls = vec![BaseUrl::parse(url).context("--url")?];
    let run = Run {
        trace: label.to_string(),
        requests: send::prepare(records, &urls, GatewaySpread::InTurn)?,
        urls,
        targets: metrics_targets(metrics)?,
        limit: None,
        timeout,
        settle,
        progress: false,
        requests_out: None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let (summary, late_error) = runtime.block_on(replay(run))?;
    late_error.map_or(Ok(summary), Err)
}

/// Runs the replay. A failure to read counters *after* the run does not discard the report:
/// it comes back beside it, to be printed first.
async fn replay(run: Run) -> Result<(Summary, Option<anyhow::Error>)> {
    let client = HttpClient::new(run.timeout);
    let before = counters::scrape_all(&client, &run.targets).await?;
    let progress = progress_bar(run.requests.len(), run.progress);
    let at: Vec<Duration> = run.requests.iter().map(|r| r.at).collect();
    let started = Instant::now();
    let outcomes = fire(&client, run.requests, run.limit, &progress).await;
    let duration = started.elapsed();
    progress.finish_and_clear();
    if let Some((path, file)) = run.requests_out {
        write_requests(file, &at, &outcomes)
            .with_context(|| format!("--requests-out {}", path.display()))?;
    }

    let reported: u64 = outcomes
        .iter()
        .filter_map(|o| o.result.as_ref().ok()?.usage)
        .map(|u| u.prompt_tokens)
        .sum();
    let (server_counters, late_error) = if run.targets.is_empty() {
        (None, None)
    } else {
        match counters::settle(&client, &run.targets, &before, reported, run.settle).await {
            Ok((deltas, settled)) => {
                let servers = run
                    .targets
                    .iter()
                    .zip(deltas)
                    .map(|(target, delta)| ServerDelta::new(target, delta))
                    .collect();
                (Some(ServerCounters::new(servers, settled)), None)
            }
            Err(err) => (None, Some(err.context("after the replay"))),
        }
    };
    let summary = Summary::new(
        run.trace,
        run.urls
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(","),
        &outcomes,
        duration,
        server_counters,
    );
    Ok((summary, late_error))
}

/// One request's line of `--requests-out`.
fn request_line(index: usize, at: Duration, outcome: &Outcome) -> serde_json::Value {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let answer = outcome.result.as_ref().ok();
    let usage = answer.and_then(|a| a.usage);
    let router: serde_json::Map<String, serde_json::Value> = answer
        .map(|a| a.router.as_slice())
        .unwrap_or_default()
        .iter()
        .map(|(name, value)| (name.clone(), value.clone().into()))
        .collect();
    serde_json::json!({
        "index": index,
        "group": outcome.group,
        "at_ms": ms(at),
        "send_lag_ms": ms(outcome.send_lag),
        "latency_ms": ms(outcome.latency),
        "ttft_ms": answer.and_then(|a| a.first_byte).map(ms),
        "endpoint": answer.and_then(|a| a.endpoint.clone()),
        "prompt_tokens": usage.map(|u| u.prompt_tokens),
        "cached_tokens": usage.map(|u| u.cached_tokens),
        "router": router,
        "error": outcome.result.as_ref().err().map(ToString::to_string),
    })
}

fn write_requests(file: std::fs::File, at: &[Duration], outcomes: &[Outcome]) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::BufWriter::new(file);
    for (index, (at, outcome)) in at.iter().zip(outcomes).enumerate() {
        serde_json::to_writer(&mut out, &request_line(index, *at, outcome))?;
        out.write_all(b"\n")?;
    }
    out.flush().context("cannot write the file")
}

fn progress_bar(len: usize, visible: bool) -> ProgressBar {
    if !visible {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(len as u64), ProgressDrawTarget::stderr());
    if let Ok(style) =
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} answered {msg}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// Sends every request at its time, each from its own task, and collects the outcomes in trace
/// order. With a limit, a request waits for a free slot and leaves late (recorded as lag).
async fn fire(
    client: &HttpClient,
    requests: Vec<Prepared>,
    limit: Option<usize>,
    progress: &ProgressBar,
) -> Vec<Outcome> {
    let slots = limit.map(|n| Arc::new(Semaphore::new(n)));
    let errors = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(requests.len());
    for request in requests {
        let due = start + request.at;
        tokio::time::sleep_until(due).await;
        let slot = match &slots {
            // The semaphore is never closed, so acquiring only ever waits.
            Some(slots) => Arc::clone(slots).acquire_owned().await.ok(),
            None => None,
        };
        let group = request.group.clone();
        let (client, progress, errors) = (client.clone(), progress.clone(), Arc::clone(&errors));
        let task = tokio::spawn(async move {
            let outcome = send::send(&client, request, due).await;
            drop(slot);
            if outcome.result.is_err() {
                let n = errors.fetch_add(1, Ordering::Relaxed) + 1;
                progress.set_message(format!("({n} errors)"));
            }
            progress.inc(1);
            outcome
        });
        tasks.push((group, task));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    for (group, task) in tasks {
        outcomes.push(task.await.unwrap_or_else(|err| Outcome {
            group,
            send_lag: Duration::ZERO,
            latency: Duration::ZERO,
            result: Err(Failure::Transport(format!("request task failed: {err}"))),
        }));
    }
    outcomes
}

#[cfg(test)]
mod tests {
    use super::send::{Answer, Usage};
    use super::*;
    use hyper::StatusCode;

    #[test]
    fn a_request_line_carries_where_it_went_and_why_or_what_failed() {
        let ok = Outcome {
            group: "tenant-3".into(),
            send_lag: Duration::from_micros(1500),
            latency: Duration::from_millis(40),
            result: Ok(Answer {
                endpoint: Some("r2".into()),
                usage: Some(Usage {
                    prompt_tokens: 500,
                    cached_tokens: 480,
                }),
                router: vec![("ttft-ms".into(), "37".into())],
                first_byte: Some(Duration::from_millis(35)),
            }),
        };
        let line = request_line(7, Duration::from_millis(250), &ok);
        assert_eq!(
            line,
            serde_json::json!({
                "index": 7, "group": "tenant-3", "at_ms": 250.0, "send_lag_ms": 1.5,
                "latency_ms": 40.0, "ttft_ms": 35.0, "endpoint": "r2", "prompt_tokens": 500,
                "cached_tokens": 480, "router": {"ttft-ms": "37"}, "error": null,
            })
        );
        let failed = Outcome {
            group: "g".into(),
            send_lag: Duration::ZERO,
            latency: Duration::from_millis(3),
            result: Err(Failure::Status(StatusCode::SERVICE_UNAVAILABLE)),
        };
        let line = request_line(0, Duration::ZERO, &failed);
        assert_eq!(line["endpoint"], serde_json::Value::Null);
        assert_eq!(line["ttft_ms"], serde_json::Value::Null);
        assert_eq!(line["router"], serde_json::json!({}));
        assert_eq!(line["error"], "HTTP 503 Service Unavailable");
    }

    #[test]
    fn requests_are_written_one_line_each_in_trace_order() {
        let dir = std::env::temp_dir().join(format!("prefixroute-requests-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("requests.jsonl");
        let outcome = |group: &str| Outcome {
            group: group.into(),
            send_lag: Duration::ZERO,
            latency: Duration::from_millis(1),
            result: Err(Failure::Timeout(Duration::from_secs(1))),
        };
        let at = [Duration::ZERO, Duration::from_millis(50)];
        let file = std::fs::File::create(&path).unwrap();
        write_requests(file, &at, &[outcome("a"), outcome("b")]).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let groups: Vec<String> = text
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["group"].to_string())
            .collect();
        assert_eq!(groups, vec!["\"a\"", "\"b\""]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
