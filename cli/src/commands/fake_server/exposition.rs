//! `GET /metrics`: the Prometheus text page, with vLLM's metric names, types and labels, so a
//! router scrapes a fake replica exactly as it scrapes a real one.

use std::fmt::Write;

use super::replica::{ReplicaConfig, Snapshot};

/// vLLM serves the classic text format through prometheus_client.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Label values are free text (the model name comes from the command line): escape them as the
/// text format requires, or one odd name would make the whole page unparseable.
fn escape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// One metric family: help, type and a single series. `{:?}` prints floats as Python does
/// (`3.0`, `0.25`), which keeps the page looking like vLLM's.
fn family(page: &mut String, name: &str, kind: &str, help: &str, labels: &str, value: f64) {
    // Writing to a String cannot fail.
    let _ = write!(
        page,
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {value:?}\n"
    );
}

pub fn render(config: &ReplicaConfig, s: &Snapshot) -> String {
    let labels = format!("model_name=\"{}\",engine=\"0\"", escape(&config.model));
    let finished = format!("{labels},finished_reason=\"length\"");
    let mut page = String::with_capacity(2048);
    let gauges = [
        (
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            s.running as f64,
        ),
        (
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            s.waiting as f64,
        ),
        (
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            s.kv_usage,
        ),
    ];
    for (name, help, value) in gauges {
        family(&mut page, name, "gauge", help, &labels, value);
    }
    let counters = [
        (
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.query_tokens,
        ),
        (
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.hit_tokens,
        ),
        (
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            s.prompt_tokens,
        ),
        (
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            s.generation_tokens,
        ),
    ];
    for (name, help, value) in counters {
        family(&mut page, name, "counter", help, &labels, value as f64);
    }
    // Every answer runs to max_tokens, so "length" is the only finish reason this server has.
    family(
        &mut page,
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        &finished,
        s.succeeded as f64,
    );
    // vLLM's info gauge carries the cache config as labels (and no model_name); routers read
    // block_size from it to hash prompts the way the server does.
    let info = format!(
        "block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",\
         gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{}\",\
         prefix_caching_hash_algo=\"xxhash\"",
        config.block_size, config.kv_blocks
    );
    family(
        &mut page,
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig",
        &info,
        1.0,
    );
    page
}

#[cfg(test)]
mod tests {
    use super::*;
    use prefixroute_core::metrics::{parse_text, parse_vllm, DEFAULT_PREFIX};

    fn config(model: &str) -> ReplicaConfig {
        ReplicaConfig {
            model: model.into(),
            kv_blocks: 64,
            block_size: 16,
            non_ascii: prefixroute_core::tokenizer::NonAscii::Pieces,
            lanes: 4,
            prefill_overhead_ms: 5.0,
            prefill_ms_per_token: 1.0,
            decode_ms_per_token: 0.0,
        }
    }

    const SNAPSHOT: Snapshot = Snapshot {
        waiting: 2,
        running: 3,
        kv_usage: 0.25,
        query_tokens: 1000,
        hit_tokens: 640,
        succeeded: 9,
        prompt_tokens: 1000,
        generation_tokens: 144,
    };

    #[test]
    fn page_parses_with_core_into_the_snapshot() {
        let page = render(&config("cc-sim"), &SNAPSHOT);
        let m = parse_vllm(&page, DEFAULT_PREFIX, Some("cc-sim")).unwrap();
        assert_eq!(m.num_requests_waiting, Some(2.0));
        assert_eq!(m.num_requests_running, Some(3.0));
        assert_eq!(m.kv_cache_usage_perc, Some(0.25));
        assert_eq!(m.prefix_cache_queries_total, Some(1000.0));
        assert_eq!(m.prefix_cache_hits_total, Some(640.0));
        assert_eq!(m.block_size, Some(16));
        assert_eq!(m.num_gpu_blocks, Some(64));
        assert!(page.contains("# TYPE vllm:prefix_cache_hits_total counter\n"));
        assert!(page.contains("vllm:request_success_total{"));
    }

    #[test]
    fn odd_model_names_are_escaped() {
        let page = render(&config("a\"b\\c\nd"), &SNAPSHOT);
        let samples = parse_text(&page).unwrap();
        assert_eq!(samples[0].label("model_name"), Some("a\"b\\c\nd"));
    }
}
