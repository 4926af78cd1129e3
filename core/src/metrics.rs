//! Prometheus text exposition → the few vLLM numbers a router needs.
//!
//! The router scores replicas on queue depth, KV-cache pressure and prefix-cache hit rate, and
//! it must hash prompts with the same block size the server uses. All of that is published on
//! the server's `/metrics` page, so the plugin scrapes it and feeds the page through here.
//!
//! The parser is hand-written rather than built on a regex or a Prometheus client crate: it
//! runs inside the proxy-wasm sandbox and the browser, where every dependency costs binary size,
//! and it must never panic, because a panic inside Envoy's Wasm VM takes the plugin down for
//! every request, not just for one scrape. Errors name the line so an operator can match them
//! against `curl /metrics` output.
//!
//! Only the classic Prometheus text format is accepted (what vLLM serves by default); the
//! OpenMetrics extras (exemplars, quoted UTF-8 metric names) are rejected as malformed rather
//! than half-understood.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The metric-name prefix vLLM uses. Kept separate from the extraction logic because other
/// servers that copied vLLM's metric set (and forks) publish the same names under another prefix.
pub const DEFAULT_PREFIX: &str = "vllm:";

/// Longest piece of offending input quoted in an error: scrapes are attacker-influenced text
/// that ends up in logs and debug headers, so echoing a whole line back is not acceptable.
const MAX_SNIPPET_CHARS: usize = 32;

/// Why a scrape could not be parsed. Every variant carries the 1-based line number, and the
/// messages are stable because they are surfaced verbatim in logs and in the plugin's debug
/// headers.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum MetricsError {
    #[error("line {line}: missing or invalid metric name")]
    InvalidMetricName { line: usize },
    #[error("line {line}: invalid label name")]
    InvalidLabelName { line: usize },
    #[error("line {line}: expected '=' after label name")]
    ExpectedEquals { line: usize },
    #[error("line {line}: expected '\"' to open label value")]
    ExpectedLabelValue { line: usize },
    #[error("line {line}: unterminated label value")]
    UnterminatedLabelValue { line: usize },
    #[error("line {line}: invalid escape sequence '\\{escape}' in label value")]
    InvalidEscape { line: usize, escape: char },
    #[error("line {line}: expected ',' or '}}' after label value")]
    ExpectedCommaOrBrace { line: usize },
    #[error("line {line}: unterminated label set")]
    UnterminatedLabelSet { line: usize },
    #[error("line {line}: duplicate label {name:?}")]
    DuplicateLabel { line: usize, name: String },
    #[error("line {line}: missing sample value")]
    MissingValue { line: usize },
    #[error("line {line}: invalid sample value {value:?}")]
    InvalidValue { line: usize, value: String },
    #[error("line {line}: invalid timestamp {value:?}")]
    InvalidTimestamp { line: usize, value: String },
    #[error("line {line}: unexpected text after timestamp")]
    TrailingText { line: usize },
}

impl MetricsError {
    /// The 1-based line the error was found on, for callers that report it structurally
    /// (e.g. as a metric label) instead of as text.
    pub fn line(&self) -> usize {
        match self {
            MetricsError::InvalidMetricName { line }
            | MetricsError::InvalidLabelName { line }
            | MetricsError::ExpectedEquals { line }
            | MetricsError::ExpectedLabelValue { line }
            | MetricsError::UnterminatedLabelValue { line }
            | MetricsError::InvalidEscape { line, .. }
            | MetricsError::ExpectedCommaOrBrace { line }
            | MetricsError::UnterminatedLabelSet { line }
            | MetricsError::DuplicateLabel { line, .. }
            | MetricsError::MissingValue { line }
            | MetricsError::InvalidValue { line, .. }
            | MetricsError::InvalidTimestamp { line, .. }
            | MetricsError::TrailingText { line } => *line,
        }
    }
}

/// One series' value from one scrape. Labels keep exposition order (a `Vec`, not a map)
/// because series have a handful of labels and a linear scan beats hashing at that size.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    /// Label lookup by name; label names are unique within a sample (the parser rejects
    /// duplicates), so the first match is the only one.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Parses a whole exposition. Comments (`# HELP`, `# TYPE` and anything else after `#`) are
/// skipped because the router only needs sample values and knows each metric's type already.
/// Timestamps are accepted and dropped: the router treats a scrape as "now".
pub fn parse_text(text: &str) -> Result<Vec<Sample>, MetricsError> {
    let mut samples = Vec::new();
    for (index, raw) in text.split('\n').enumerate() {
        let line = raw.strip_suffix('\r').unwrap_or(raw);
        let body = line.trim_start_matches([' ', '\t']);
        if body.is_empty() || body.starts_with('#') {
            continue;
        }
        samples.push(parse_sample(body, index + 1)?);
    }
    Ok(samples)
}

fn is_blank(c: char) -> bool {
    c == ' ' || c == '\t'
}

fn is_name_start(b: u8, allow_colon: bool) -> bool {
    b.is_ascii_alphabetic() || b == b'_' || (allow_colon && b == b':')
}

fn is_name_continue(b: u8, allow_colon: bool) -> bool {
    is_name_start(b, allow_colon) || b.is_ascii_digit()
}

fn snippet(s: &str) -> String {
    match s.char_indices().nth(MAX_SNIPPET_CHARS) {
        Some((cut, _)) => format!("{}…", &s[..cut]),
        None => s.to_string(),
    }
}

/// A byte position within one line. Name scanning works on ASCII bytes only, so every index it
/// stops at is a char boundary; label values are walked char by char.
struct Cursor<'a> {
    s: &'a str,
    pos: usize,
    line: usize,
}

impl<'a> Cursor<'a> {
    fn rest(&self) -> &'a str {
        &self.s[self.pos..]
    }

    fn peek(&self) -> Option<char> {
        self.rest().chars().next()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += c.len_utf8();
        Some(c)
    }

    fn skip_blanks(&mut self) {
        let rest = self.rest();
        self.pos += rest.len() - rest.trim_start_matches(is_blank).len();
    }

    /// Metric names may contain ':' (vLLM's `vllm:` namespace relies on it); label names may not.
    fn name(&mut self, allow_colon: bool) -> &'a str {
        let bytes = self.rest().as_bytes();
        let len = match bytes.first() {
            Some(&b) if is_name_start(b, allow_colon) => bytes
                .iter()
                .position(|&b| !is_name_continue(b, allow_colon))
                .unwrap_or(bytes.len()),
            _ => 0,
        };
        let name = &self.rest()[..len];
        self.pos += len;
        name
    }

    /// Up to the next blank or end of line: values and timestamps cannot contain blanks.
    fn token(&mut self) -> &'a str {
        let rest = self.rest();
        let len = rest.find(is_blank).unwrap_or(rest.len());
        self.pos += len;
        &rest[..len]
    }

    fn label_value(&mut self) -> Result<String, MetricsError> {
        let line = self.line;
        let mut out = String::new();
        loop {
            match self.bump() {
                None => return Err(MetricsError::UnterminatedLabelValue { line }),
                Some('"') => return Ok(out),
                Some('\\') => match self.bump() {
                    Some('\\') => out.push('\\'),
                    Some('"') => out.push('"'),
                    Some('n') => out.push('\n'),
                    Some(escape) => return Err(MetricsError::InvalidEscape { line, escape }),
                    None => return Err(MetricsError::UnterminatedLabelValue { line }),
                },
                Some(c) => out.push(c),
            }
        }
    }

    /// Called just after `{`. Blanks are allowed around every token and a trailing comma is
    /// allowed, matching what Prometheus itself accepts, since hand-rolled exporters emit both.
    fn labels(&mut self) -> Result<Vec<(String, String)>, MetricsError> {
        let line = self.line;
        let mut labels: Vec<(String, String)> = Vec::new();
        loop {
            self.skip_blanks();
            match self.peek() {
                None => return Err(MetricsError::UnterminatedLabelSet { line }),
                Some('}') => {
                    self.bump();
                    return Ok(labels);
                }
                Some(_) => {}
            }
            let name = self.name(false);
            if name.is_empty() {
                return Err(MetricsError::InvalidLabelName { line });
            }
            self.skip_blanks();
            match self.bump() {
                Some('=') => {}
                None => return Err(MetricsError::UnterminatedLabelSet { line }),
                Some(_) => return Err(MetricsError::ExpectedEquals { line }),
            }
            self.skip_blanks();
            match self.bump() {
                Some('"') => {}
                None => return Err(MetricsError::UnterminatedLabelSet { line }),
                Some(_) => return Err(MetricsError::ExpectedLabelValue { line }),
            }
            let value = self.label_value()?;
            if labels.iter().any(|(k, _)| k == name) {
                return Err(MetricsError::DuplicateLabel {
                    line,
                    name: name.to_string(),
                });
            }
            labels.push((name.to_string(), value));
            self.skip_blanks();
            match self.bump() {
                Some(',') => {}
                Some('}') => return Ok(labels),
                None => return Err(MetricsError::UnterminatedLabelSet { line }),
                Some(_) => return Err(MetricsError::ExpectedCommaOrBrace { line }),
            }
        }
    }
}

/// A sample value: Prometheus's `NaN`, `+Inf`, `-Inf` (case-insensitive, `Infinity` too), then a
/// decimal number with an optional sign and exponent (`1.5e+03`, `.5`, `5.`, `007`).
///
/// The digits go through serde_json's number parser, not `str::parse::<f64>`: the plugin links
/// serde_json's anyway, while std's (Eisel-Lemire with a 10 KB table of powers of five, plus a
/// big-decimal fallback) would add 15 KB to the `.wasm` for this one call. serde_json's
/// (without its `float_roundtrip` feature, which would cost more than std's) is one correctly
/// rounded multiplication or division when the digits fit in 2^53 and the power of ten is at
/// most 22, so exact for the counts, fractions and seconds engines report, and otherwise a
/// few ulps away (a 17-digit `repr` such as `0.30000000000000004`; at most two in 2 million
/// random values over the whole range, subnormals included): nothing a score could notice. A value beyond `f64`'s range is rejected rather than taken as infinite.
fn parse_value(token: &str) -> Option<f64> {
    let (negative, unsigned) = match token.as_bytes().first()? {
        b'-' => (true, &token[1..]),
        b'+' => (false, &token[1..]),
        _ => (false, token),
    };
    let magnitude =
        if unsigned.eq_ignore_ascii_case("inf") || unsigned.eq_ignore_ascii_case("infinity") {
            f64::INFINITY
        } else if unsigned.eq_ignore_ascii_case("nan") {
            f64::NAN
        } else {
            parse_decimal(unsigned)?
        };
    Some(if negative { -magnitude } else { magnitude })
}

/// An unsigned decimal number as JSON spells it after the forms JSON lacks are rewritten:
/// leading zeros dropped, `.5` → `0.5`, `5.` → `5`.
fn parse_decimal(digits: &str) -> Option<f64> {
    // Digits and at most one point before the exponent: no sign here, no `_`, no hex.
    let (mantissa, exponent) = match digits.find(['e', 'E']) {
        Some(at) => digits.split_at(at),
        None => (digits, ""),
    };
    let mut dots = 0;
    let mut has_digit = false;
    for b in mantissa.bytes() {
        match b {
            b'0'..=b'9' => has_digit = true,
            b'.' => dots += 1,
            _ => return None,
        }
    }
    if !has_digit || dots > 1 {
        return None;
    }
    let trimmed = mantissa.trim_start_matches('0');
    let mut json = String::with_capacity(digits.len() + 2);
    if trimmed.is_empty() || trimmed.starts_with('.') {
        json.push('0');
    }
    json.push_str(trimmed);
    if json.ends_with('.') {
        // `5.` is the integer 5 (a `.0` would be one more digit to scale by).
        json.pop();
    }
    json.push_str(exponent);
    // `from_slice`, like every other read of JSON here: serde_json's parser is compiled once
    // per reader type, and a `from_str` beside the others cost the plugin 7.9 KB of `.wasm`.
    serde_json::from_slice::<f64>(json.as_bytes()).ok()
}

/// Prometheus writes integer milliseconds, OpenMetrics fractional seconds; both are accepted
/// since the value is discarded anyway and rejecting a scrape over it would help nobody.
fn is_timestamp(token: &str) -> bool {
    parse_value(token).is_some_and(f64::is_finite)
}

fn parse_sample(body: &str, line: usize) -> Result<Sample, MetricsError> {
    let mut cur = Cursor {
        s: body,
        pos: 0,
        line,
    };
    let name = cur.name(true);
    if name.is_empty() || cur.peek().is_some_and(|c| c != '{' && !is_blank(c)) {
        return Err(MetricsError::InvalidMetricName { line });
    }
    cur.skip_blanks();
    let labels = if cur.peek() == Some('{') {
        cur.bump();
        cur.labels()?
    } else {
        Vec::new()
    };
    cur.skip_blanks();
    let token = cur.token();
    if token.is_empty() {
        return Err(MetricsError::MissingValue { line });
    }
    let value = parse_value(token).ok_or_else(|| MetricsError::InvalidValue {
        line,
        value: snippet(token),
    })?;
    cur.skip_blanks();
    let timestamp = cur.token();
    if !timestamp.is_empty() && !is_timestamp(timestamp) {
        return Err(MetricsError::InvalidTimestamp {
            line,
            value: snippet(timestamp),
        });
    }
    cur.skip_blanks();
    if !cur.rest().is_empty() {
        return Err(MetricsError::TrailingText { line });
    }
    Ok(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// What one vLLM server reports about load and cache, reduced to one number per field. Every
/// field is optional because servers differ by version and configuration (the prefix-cache
/// counters only exist with prefix caching on), and the scorer must tell "zero" from "unknown".
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerMetrics {
    pub num_requests_waiting: Option<f64>,
    pub num_requests_running: Option<f64>,
    /// A fraction in 0..=1, not a percentage, despite the name vLLM gives it.
    pub kv_cache_usage_perc: Option<f64>,
    pub prefix_cache_queries_total: Option<f64>,
    pub prefix_cache_hits_total: Option<f64>,
    /// Requests the server finished (every finish reason, every engine): with several
    /// gateways in front, the only count of its requests that includes the other gateways'.
    pub request_success_total: Option<f64>,
    pub block_size: Option<u32>,
    /// Summed over engines: the router sees one endpoint, whose cache is the union of them.
    pub num_gpu_blocks: Option<u64>,
}

/// Sum and count of the series seen for one metric, so "no series" stays distinguishable
/// from "series that add up to zero".
#[derive(Debug, Clone, Copy, Default)]
struct Acc {
    sum: f64,
    count: usize,
}

impl Acc {
    fn add(&mut self, value: f64) {
        self.sum += value;
        self.count += 1;
    }

    fn total(self) -> Option<f64> {
        (self.count > 0).then_some(self.sum)
    }

    fn mean(self) -> Option<f64> {
        (self.count > 0).then(|| self.sum / self.count as f64)
    }
}

/// Reduces a scrape to [`ServerMetrics`].
///
/// A data-parallel vLLM server exposes one series per engine behind a single endpoint, so
/// queue sizes and counters are summed (they measure the endpoint's total work), while the KV
/// usage fraction is averaged (summing fractions would exceed 1). `model` narrows the scrape to
/// one served model when a server hosts several; series without a `model_name` label describe
/// the whole server and always count. NaN samples are skipped so that one engine that has not
/// reported yet does not poison the endpoint's total.
///
/// Fallback names exist for older vLLM releases: `gpu_cache_usage_perc` before it was renamed
/// to `kv_cache_usage_perc`, and counters exposed without the `_total` suffix. The newer name
/// wins whenever it has any usable series.
pub fn extract_vllm(samples: &[Sample], prefix: &str, model: Option<&str>) -> ServerMetrics {
    let mut waiting = Acc::default();
    let mut running = Acc::default();
    let mut kv_usage = Acc::default();
    let mut gpu_usage = Acc::default();
    let mut queries_total = Acc::default();
    let mut queries_bare = Acc::default();
    let mut hits_total = Acc::default();
    let mut hits_bare = Acc::default();
    let mut success_total = Acc::default();
    let mut block_size: Option<u32> = None;
    let mut block_size_conflict = false;
    let mut num_gpu_blocks: Option<u64> = None;

    for sample in samples {
        let Some(metric) = sample.name.strip_prefix(prefix) else {
            continue;
        };
        if sample.value.is_nan() {
            continue;
        }
        if let Some(model) = model {
            if sample.label("model_name").is_some_and(|m| m != model) {
                continue;
            }
        }
        let acc = match metric {
            "num_requests_waiting" => &mut waiting,
            "num_requests_running" => &mut running,
            "kv_cache_usage_perc" => &mut kv_usage,
            "gpu_cache_usage_perc" => &mut gpu_usage,
            "prefix_cache_queries_total" => &mut queries_total,
            "prefix_cache_queries" => &mut queries_bare,
            "prefix_cache_hits_total" => &mut hits_total,
            "prefix_cache_hits" => &mut hits_bare,
            "request_success_total" => &mut success_total,
            "cache_config_info" => {
                // vLLM fills these labels from its config's string form, so before the memory
                // profile finishes `num_gpu_blocks` reads "None"; such series are skipped.
                if let Some(size) = sample.label("block_size").and_then(parse_label_int) {
                    match block_size {
                        None => block_size = Some(size),
                        Some(seen) if seen != size => block_size_conflict = true,
                        Some(_) => {}
                    }
                }
                if let Some(blocks) = sample.label("num_gpu_blocks").and_then(parse_label_int) {
                    num_gpu_blocks = Some(num_gpu_blocks.unwrap_or(0).saturating_add(blocks));
                }
                continue;
            }
            _ => continue,
        };
        acc.add(sample.value);
    }

    ServerMetrics {
        num_requests_waiting: waiting.total(),
        num_requests_running: running.total(),
        kv_cache_usage_perc: kv_usage.mean().or_else(|| gpu_usage.mean()),
        prefix_cache_queries_total: queries_total.total().or_else(|| queries_bare.total()),
        prefix_cache_hits_total: hits_total.total().or_else(|| hits_bare.total()),
        request_success_total: success_total.total(),
        // Engines that disagree on block size cannot share one hashing scheme; reporting
        // nothing makes the caller fall back to its configured size instead of guessing.
        block_size: if block_size_conflict {
            None
        } else {
            block_size
        },
        num_gpu_blocks,
    }
}

fn parse_label_int<T: std::str::FromStr>(value: &str) -> Option<T> {
    value.trim().parse().ok()
}

/// One call for the plugin's scrape callback, which has the page as text and wants numbers.
pub fn parse_vllm(
    text: &str,
    prefix: &str,
    model: Option<&str>,
) -> Result<ServerMetrics, MetricsError> {
    Ok(extract_vllm(&parse_text(text)?, prefix, model))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Shaped after a real vLLM V1 `/metrics` page for a data-parallel (2 engine) server, with
    /// histogram buckets, counters with their `_created` siblings and the cache-config info.
    const VLLM_SCRAPE: &str = r#"# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12873.0
python_gc_objects_collected_total{generation="1"} 1580.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 2.147483648e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.75
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.5e+03
vllm:prefix_cache_queries_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 500.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7300000123e+09
vllm:prefix_cache_queries_created{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7300000123e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 640.0
vllm:prefix_cache_hits_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 160.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="meta-llama/Llama-3.1-8B-Instruct"} 30.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.005",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 42.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 42.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.217
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="27000",num_gpu_blocks_override="None",prefix_caching_hash_algo="builtin",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="1",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="26500",num_gpu_blocks_override="None",prefix_caching_hash_algo="builtin",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0
"#;

    const LLAMA: &str = "meta-llama/Llama-3.1-8B-Instruct";

    fn one(text: &str) -> Sample {
        let mut samples = parse_text(text).expect("parses");
        assert_eq!(samples.len(), 1, "{samples:?}");
        samples.remove(0)
    }

    fn value_of(text: &str) -> f64 {
        one(text).value
    }

    fn err(text: &str) -> String {
        parse_text(text).expect_err("must fail").to_string()
    }

    #[test]
    fn realistic_scrape_parses_every_sample() {
        let samples = parse_text(VLLM_SCRAPE).unwrap();
        assert_eq!(samples.len(), 24);
        assert_eq!(samples[2].name, "process_resident_memory_bytes");
        assert!(samples[2].labels.is_empty());
        assert_eq!(samples[2].value, 2_147_483_648.0);

        let inf_bucket = samples
            .iter()
            .find(|s| s.label("le") == Some("+Inf"))
            .expect("+Inf bucket");
        assert_eq!(inf_bucket.name, "vllm:time_to_first_token_seconds_bucket");
        assert_eq!(inf_bucket.value, 42.0);
        assert_eq!(
            inf_bucket.labels,
            vec![
                ("engine".to_string(), "0".to_string()),
                ("le".to_string(), "+Inf".to_string()),
                ("model_name".to_string(), LLAMA.to_string()),
            ]
        );

        let info = samples.last().unwrap();
        assert_eq!(info.name, "vllm:cache_config_info");
        assert_eq!(info.labels.len(), 15);
        assert_eq!(info.label("gpu_memory_utilization"), Some("0.9"));
        assert_eq!(info.label("enable_prefix_caching"), Some("True"));
        assert_eq!(info.label("num_gpu_blocks"), Some("26500"));
        assert_eq!(info.label("missing"), None);
    }

    #[test]
    fn realistic_scrape_extracts_summed_and_averaged_metrics() {
        let m = parse_vllm(VLLM_SCRAPE, DEFAULT_PREFIX, None).unwrap();
        assert_eq!(
            m,
            ServerMetrics {
                num_requests_waiting: Some(3.0),
                num_requests_running: Some(12.0),
                kv_cache_usage_perc: Some(0.5),
                prefix_cache_queries_total: Some(2000.0),
                prefix_cache_hits_total: Some(800.0),
                request_success_total: Some(42.0),
                block_size: Some(16),
                num_gpu_blocks: Some(53_500),
            }
        );
        // Filtering by the served model changes nothing, and the info series (which carry no
        // model_name) still count.
        assert_eq!(parse_vllm(VLLM_SCRAPE, "vllm:", Some(LLAMA)).unwrap(), m);
    }

    #[test]
    fn model_filter_keeps_only_matching_and_unlabelled_series() {
        let text = "\
vllm:num_requests_waiting{model_name=\"a\"} 1
vllm:num_requests_waiting{model_name=\"b\"} 10
vllm:num_requests_waiting 100
vllm:kv_cache_usage_perc{model_name=\"a\"} 0.2
vllm:kv_cache_usage_perc{model_name=\"b\"} 0.6
vllm:cache_config_info{block_size=\"32\",num_gpu_blocks=\"1000\"} 1
";
        let a = parse_vllm(text, DEFAULT_PREFIX, Some("a")).unwrap();
        assert_eq!(a.num_requests_waiting, Some(101.0));
        assert_eq!(a.kv_cache_usage_perc, Some(0.2));
        assert_eq!(a.block_size, Some(32));
        assert_eq!(a.num_gpu_blocks, Some(1000));

        let b = parse_vllm(text, DEFAULT_PREFIX, Some("b")).unwrap();
        assert_eq!(b.num_requests_waiting, Some(110.0));
        assert_eq!(b.kv_cache_usage_perc, Some(0.6));

        let all = parse_vllm(text, DEFAULT_PREFIX, None).unwrap();
        assert_eq!(all.num_requests_waiting, Some(111.0));
        assert!((all.kv_cache_usage_perc.unwrap() - 0.4).abs() < 1e-12);

        let none = parse_vllm(text, DEFAULT_PREFIX, Some("c")).unwrap();
        assert_eq!(none.num_requests_waiting, Some(100.0));
        assert_eq!(none.kv_cache_usage_perc, None);
    }

    #[test]
    fn missing_metrics_are_none_not_zero() {
        assert_eq!(
            parse_vllm("", DEFAULT_PREFIX, None).unwrap(),
            ServerMetrics::default()
        );
        let m = parse_vllm(
            "# only one metric\nvllm:num_requests_running 0\n",
            DEFAULT_PREFIX,
            None,
        )
        .unwrap();
        assert_eq!(
            m,
            ServerMetrics {
                num_requests_running: Some(0.0),
                ..ServerMetrics::default()
            }
        );
    }

    #[test]
    fn older_kv_usage_name_is_a_fallback_only() {
        let old_only = "vllm:gpu_cache_usage_perc{engine=\"0\"} 0.3\n";
        assert_eq!(
            parse_vllm(old_only, DEFAULT_PREFIX, None)
                .unwrap()
                .kv_cache_usage_perc,
            Some(0.3)
        );
        let both = "vllm:gpu_cache_usage_perc 0.3\nvllm:kv_cache_usage_perc 0.9\n";
        assert_eq!(
            parse_vllm(both, DEFAULT_PREFIX, None)
                .unwrap()
                .kv_cache_usage_perc,
            Some(0.9)
        );
        // A new name that is present but NaN carries no information, so the old one is used.
        let new_nan = "vllm:kv_cache_usage_perc NaN\nvllm:gpu_cache_usage_perc 0.4\n";
        assert_eq!(
            parse_vllm(new_nan, DEFAULT_PREFIX, None)
                .unwrap()
                .kv_cache_usage_perc,
            Some(0.4)
        );
    }

    #[test]
    fn finished_requests_sum_every_reason() {
        let text = "vllm:request_success_total{finished_reason=\"stop\"} 7\n\
                    vllm:request_success_total{finished_reason=\"abort\"} 2\n";
        let m = parse_vllm(text, DEFAULT_PREFIX, None).unwrap();
        assert_eq!(m.request_success_total, Some(9.0));
        let none = parse_vllm("vllm:num_requests_running 1\n", DEFAULT_PREFIX, None).unwrap();
        assert_eq!(none.request_success_total, None);
    }

    #[test]
    fn counters_without_total_suffix_are_a_fallback_only() {
        let bare = "vllm:prefix_cache_queries 40\nvllm:prefix_cache_hits 10\n";
        let m = parse_vllm(bare, DEFAULT_PREFIX, None).unwrap();
        assert_eq!(m.prefix_cache_queries_total, Some(40.0));
        assert_eq!(m.prefix_cache_hits_total, Some(10.0));

        let both = "vllm:prefix_cache_queries 40\nvllm:prefix_cache_queries_total 50\n\
                    vllm:prefix_cache_hits 10\nvllm:prefix_cache_hits_total 20\n\
                    vllm:prefix_cache_hits_created 1.7e9\n";
        let m = parse_vllm(both, DEFAULT_PREFIX, None).unwrap();
        assert_eq!(m.prefix_cache_queries_total, Some(50.0));
        assert_eq!(m.prefix_cache_hits_total, Some(20.0));
    }

    #[test]
    fn prefix_is_configurable_and_exact() {
        let text = "sglang:num_requests_waiting 4\nvllm:num_requests_waiting 9\n\
                    num_requests_waiting 1\n";
        assert_eq!(
            parse_vllm(text, "sglang:", None)
                .unwrap()
                .num_requests_waiting,
            Some(4.0)
        );
        assert_eq!(
            parse_vllm(text, DEFAULT_PREFIX, None)
                .unwrap()
                .num_requests_waiting,
            Some(9.0)
        );
        assert_eq!(
            parse_vllm(text, "", None).unwrap().num_requests_waiting,
            Some(1.0)
        );
        assert_eq!(
            parse_vllm(text, "tgi_", None).unwrap().num_requests_waiting,
            None
        );
    }

    #[test]
    fn nan_series_are_ignored() {
        let text = "\
vllm:num_requests_waiting{engine=\"0\"} NaN
vllm:num_requests_waiting{engine=\"1\"} 3
vllm:kv_cache_usage_perc{engine=\"0\"} NaN
vllm:kv_cache_usage_perc{engine=\"1\"} 0.8
vllm:num_requests_running NaN
vllm:cache_config_info{block_size=\"64\",num_gpu_blocks=\"10\"} NaN
";
        let m = parse_vllm(text, DEFAULT_PREFIX, None).unwrap();
        assert_eq!(m.num_requests_waiting, Some(3.0));
        // Mean over the one engine that reported, not over two with NaN counted as 0.
        assert_eq!(m.kv_cache_usage_perc, Some(0.8));
        assert_eq!(m.num_requests_running, None);
        assert_eq!(m.block_size, None);
        assert_eq!(m.num_gpu_blocks, None);
    }

    #[test]
    fn cache_config_edge_cases() {
        // Not yet profiled: "None" is skipped rather than failing the scrape.
        let unprofiled = "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1\n";
        let m = parse_vllm(unprofiled, DEFAULT_PREFIX, None).unwrap();
        assert_eq!(m.block_size, Some(16));
        assert_eq!(m.num_gpu_blocks, None);

        let disagree = "\
vllm:cache_config_info{engine=\"0\",block_size=\"16\",num_gpu_blocks=\"100\"} 1
vllm:cache_config_info{engine=\"1\",block_size=\"32\",num_gpu_blocks=\"50\"} 1
";
        let m = parse_vllm(disagree, DEFAULT_PREFIX, None).unwrap();
        assert_eq!(m.block_size, None);
        assert_eq!(m.num_gpu_blocks, Some(150));

        let huge = "vllm:cache_config_info{num_gpu_blocks=\"18446744073709551615\"} 1\n\
                    vllm:cache_config_info{num_gpu_blocks=\"5\",block_size=\"-1\"} 1\n";
        let m = parse_vllm(huge, DEFAULT_PREFIX, None).unwrap();
        assert_eq!(m.num_gpu_blocks, Some(u64::MAX));
        assert_eq!(m.block_size, None);
    }

    #[test]
    fn engine_metrics_round_trip_through_json() {
        let m = parse_vllm(VLLM_SCRAPE, DEFAULT_PREFIX, None).unwrap();
        let json = serde_json::to_string(&m).unwrap();
        assert!(json.contains("\"num_gpu_blocks\":53500"), "{json}");
        let back: ServerMetrics = serde_json::from_str(&json).unwrap();
        assert_eq!(back, m);
    }

    #[test]
    fn special_and_exponent_values() {
        assert!(value_of("m NaN").is_nan());
        assert_eq!(value_of("m +Inf"), f64::INFINITY);
        assert_eq!(value_of("m Inf"), f64::INFINITY);
        assert_eq!(value_of("m -Inf"), f64::NEG_INFINITY);
        assert_eq!(value_of("m 1.5e+03"), 1500.0);
        assert_eq!(value_of("m 2E-2"), 0.02);
        assert_eq!(value_of("m -7"), -7.0);
        assert_eq!(value_of("m +.5"), 0.5);
        assert_eq!(value_of("m 1e308"), 1e308);
        assert_eq!(value_of("m 5."), 5.0);
        assert_eq!(value_of("m 007.25"), 7.25);
        assert_eq!(value_of("m -INFINITY"), f64::NEG_INFINITY);
        assert_eq!(value_of("m 0.30000000000000004"), 0.30000000000000004);
        for bad in [
            "1e400", ".", "-", "1.2.3", ".e5", "0x10", "1_000", "1e", "++1", "nan1",
        ] {
            assert_eq!(parse_value(bad), None, "{bad}");
        }
    }

    #[test]
    fn label_value_escapes_are_decoded() {
        let s = one(r#"m{path="C:\\dir\\f",quote="say \"hi\"",nl="a\nb"} 1"#);
        assert_eq!(s.label("path"), Some(r"C:\dir\f"));
        assert_eq!(s.label("quote"), Some("say \"hi\""));
        assert_eq!(s.label("nl"), Some("a\nb"));
    }

    #[test]
    fn label_values_may_hold_syntax_characters_and_unicode() {
        let s = one(r#"m{a="x} 1 # {y=\"z\",",b="héllo 日本", c=""} 2"#);
        assert_eq!(s.label("a"), Some(r#"x} 1 # {y="z","#));
        assert_eq!(s.label("b"), Some("héllo 日本"));
        assert_eq!(s.label("c"), Some(""));
        assert_eq!(s.value, 2.0);
    }

    #[test]
    fn label_set_syntax_variants() {
        let trailing = one(r#"m{a="1",b="2",} 3"#);
        assert_eq!(
            trailing.labels,
            vec![
                ("a".to_string(), "1".to_string()),
                ("b".to_string(), "2".to_string())
            ]
        );
        let spaced = one("m { a = \"1\" ,\tb=\"2\" , } 3");
        assert_eq!(spaced.labels, trailing.labels);
        assert_eq!(spaced.value, 3.0);
        let empty = one("m{} 4");
        assert!(empty.labels.is_empty());
        let tight = one(r#"m{a="1"}5"#);
        assert_eq!(tight.value, 5.0);
    }

    #[test]
    fn metric_names_with_colons_and_underscores() {
        let s = one("vllm:num_requests_waiting 3");
        assert_eq!(s.name, "vllm:num_requests_waiting");
        assert_eq!(one(":a:b_c:9 1").name, ":a:b_c:9");
        assert_eq!(one("_x 1").name, "_x");
    }

    #[test]
    fn timestamps_are_accepted_and_ignored() {
        assert_eq!(value_of("m 1 1700000000000"), 1.0);
        assert_eq!(value_of("m{a=\"b\"} 2 -5"), 2.0);
        assert_eq!(value_of("m 3 1700000000.125"), 3.0);
        assert_eq!(value_of("m\t4\t1700000000000\t "), 4.0);
    }

    #[test]
    fn comments_blank_lines_and_crlf() {
        let text = "# HELP m Some \\ help with \"quotes\" and {braces}\r\n\
                    # TYPE m gauge\r\n\
                    #\r\n\
                    \r\n\
                    \t  \r\n\
                    \t# indented comment\r\n\
                    m{a=\"b\"} 1\r\n\
                    n 2 1700000000000\r\n\
                    # EOF";
        let samples = parse_text(text).unwrap();
        assert_eq!(samples.len(), 2);
        assert_eq!(samples[0].label("a"), Some("b"));
        assert_eq!(samples[1].name, "n");
        assert_eq!(samples[1].value, 2.0);
        // Line numbers count CRLF lines like LF lines.
        assert_eq!(
            parse_text("a 1\r\n\r\nb{x=\"1} 2\r\n").unwrap_err(),
            MetricsError::UnterminatedLabelValue { line: 3 }
        );
    }

    #[test]
    fn error_messages_name_the_line_and_the_problem() {
        let cases: &[(&str, &str)] = &[
            (
                "# HELP\nm 1\nm{a=\"b} 1",
                "line 3: unterminated label value",
            ),
            ("m{a=\"b\\", "line 1: unterminated label value"),
            (
                "m{a=\"\\t\"} 1",
                "line 1: invalid escape sequence '\\t' in label value",
            ),
            (
                "m{a=\"b\" c=\"d\"} 1",
                "line 1: expected ',' or '}' after label value",
            ),
            ("m{a=\"b\"", "line 1: unterminated label set"),
            ("m{a=\"b\",", "line 1: unterminated label set"),
            ("m{", "line 1: unterminated label set"),
            ("m{a", "line 1: unterminated label set"),
            ("m{a=", "line 1: unterminated label set"),
            ("m{a b} 1", "line 1: expected '=' after label name"),
            ("m{a=b} 1", "line 1: expected '\"' to open label value"),
            ("m{,} 1", "line 1: invalid label name"),
            ("m{9a=\"b\"} 1", "line 1: invalid label name"),
            ("m{a:b=\"c\"} 1", "line 1: expected '=' after label name"),
            ("m{a=\"1\",a=\"2\"} 1", "line 1: duplicate label \"a\""),
            ("\n\nm", "line 3: missing sample value"),
            ("m{a=\"b\"}", "line 1: missing sample value"),
            ("m{a=\"b\"}   \t", "line 1: missing sample value"),
            ("m abc", "line 1: invalid sample value \"abc\""),
            ("m 1,5", "line 1: invalid sample value \"1,5\""),
            ("m 1 ts", "line 1: invalid timestamp \"ts\""),
            ("m 1 2 3", "line 1: unexpected text after timestamp"),
            ("9m 1", "line 1: missing or invalid metric name"),
            ("m-x 1", "line 1: missing or invalid metric name"),
            ("{a=\"b\"} 1", "line 1: missing or invalid metric name"),
            ("m\u{e9} 1", "line 1: missing or invalid metric name"),
        ];
        for (text, want) in cases {
            assert_eq!(&err(text), want, "input {text:?}");
        }
    }

    #[test]
    fn error_variants_expose_line_and_bounded_snippets() {
        let e = parse_text("ok 1\nbad 0x10\n").unwrap_err();
        assert_eq!(
            e,
            MetricsError::InvalidValue {
                line: 2,
                value: "0x10".to_string()
            }
        );
        assert_eq!(e.line(), 2);

        let long = format!("m {}", "z".repeat(1000));
        let e = parse_text(&long).unwrap_err();
        let MetricsError::InvalidValue { value, .. } = &e else {
            panic!("unexpected {e:?}");
        };
        assert_eq!(value.chars().count(), MAX_SNIPPET_CHARS + 1);
        assert!(value.ends_with('…'));
        assert!(e.to_string().len() < 80);
    }

    #[test]
    fn first_error_wins_and_parse_vllm_propagates_it() {
        let text = "vllm:num_requests_waiting 1\nvllm:num_requests_running x\nm{\n";
        assert_eq!(
            parse_vllm(text, DEFAULT_PREFIX, None).unwrap_err(),
            MetricsError::InvalidValue {
                line: 2,
                value: "x".to_string()
            }
        );
    }

    #[test]
    fn truncated_scrapes_never_panic() {
        let mut boundaries: Vec<usize> = VLLM_SCRAPE.char_indices().map(|(i, _)| i).collect();
        boundaries.push(VLLM_SCRAPE.len());
        let mut failures = 0;
        for &end in &boundaries {
            let prefix = &VLLM_SCRAPE[..end];
            if parse_text(prefix).is_err() {
                failures += 1;
            }
            let _ = parse_vllm(&VLLM_SCRAPE[end..], DEFAULT_PREFIX, Some(LLAMA));
        }
        // Cutting mid-label must be reported, so plenty of prefixes fail...
        assert!(failures > 100, "only {failures} truncations failed");
        // ...but cutting at a line end never does.
        for (i, _) in VLLM_SCRAPE.match_indices('\n') {
            assert!(parse_text(&VLLM_SCRAPE[..i]).is_ok(), "cut at {i}");
        }
    }

    #[test]
    fn garbage_never_panics() {
        // Deterministic xorshift so failures reproduce; bytes biased towards syntax characters.
        let alphabet = b"{}=\",\\n# \t\r\nab:_09.eE+-InfNa\xc3\xa9\xff";
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..2000 {
            let mut bytes = Vec::new();
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = (state % 64) as usize;
            for _ in 0..len {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                bytes.push(alphabet[(state % alphabet.len() as u64) as usize]);
            }
            let text = String::from_utf8_lossy(&bytes);
            if let Err(e) = parse_text(&text) {
                assert!(e.line() >= 1);
                assert!(e.to_string().starts_with(&format!("line {}: ", e.line())));
            }
            let _ = parse_vllm(&text, "", Some("a"));
        }
    }

    fn render(sample: &Sample) -> String {
        let labels: Vec<String> = sample
            .labels
            .iter()
            .map(|(k, v)| {
                let escaped = v
                    .replace('\\', "\\\\")
                    .replace('"', "\\\"")
                    .replace('\n', "\\n");
                format!("{k}=\"{escaped}\"")
            })
            .collect();
        format!("{}{{{}}} {}", sample.name, labels.join(","), sample.value)
    }

    proptest! {
        #[test]
        fn arbitrary_text_never_panics(text in any::<String>()) {
            let _ = parse_text(&text);
            let _ = parse_vllm(&text, DEFAULT_PREFIX, None);
        }

        #[test]
        fn rendered_samples_parse_back(
            name in "[a-zA-Z_:][a-zA-Z0-9_:]{0,12}",
            labels in proptest::collection::btree_map("[a-zA-Z_][a-zA-Z0-9_]{0,8}", any::<String>(), 0..5),
            value in prop_oneof![
                any::<f64>().prop_filter("NaN breaks equality", |v| !v.is_nan()),
                Just(f64::INFINITY),
                Just(f64::NEG_INFINITY),
            ],
        ) {
            let sample = Sample { name, labels: labels.into_iter().collect(), value };
            let text = format!("# HELP x y\n{}\n", render(&sample));
            let parsed = parse_text(&text).unwrap();
            prop_assert_eq!(parsed.len(), 1);
            prop_assert_eq!(&parsed[0].name, &sample.name);
            prop_assert_eq!(&parsed[0].labels, &sample.labels);
            // Within two ulps (see `parse_value`): the same sign, bit patterns at most 2 apart.
            let (got, want) = (parsed[0].value.to_bits() as i64, sample.value.to_bits() as i64);
            prop_assert!((got - want).abs() <= 2, "{} parsed as {}", sample.value, parsed[0].value);
        }

        #[test]
        fn values_with_at_most_15_digits_and_small_exponents_parse_as_std_does(
            digits in 0u64..(1 << 53),
            exponent in -22i32..=22,
            style in 0..3,
        ) {
            let text = match style {
                0 => format!("{digits}e{exponent}"),
                1 => {
                    // A point `places` digits from the right: `123.45`, `0.0012`, `5.`.
                    let places = exponent.unsigned_abs() as usize % 16;
                    let scale = 10u64.pow(places as u32);
                    format!("{}.{:0places$}", digits / scale, if places == 0 { String::new() } else { (digits % scale).to_string() })
                }
                _ => format!("+{digits}E{exponent:+}"),
            };
            prop_assert_eq!(parse_value(&text), text.parse::<f64>().ok(), "{}", text);
        }
    }
}
