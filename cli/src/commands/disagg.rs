use anyhow::Result;
use prefixroute_sim::disagg::{self, DisaggInput};

#[derive(clap::Args)]
pub struct Args {
    #[arg(long)]
    prompt_tokens: u64,
    #[arg(long, default_value_t = 0)]
    cached_tokens: u64,
    /// llama-3.1-8b, llama-3.1-70b, llama-3.2-1b, qwen2.5-7b (or a Hugging Face id of one).
    #[arg(long, default_value = "llama-3.1-8b")]
    model: String,
    /// Prefill throughput of one prefill worker, tokens/s.
    #[arg(long, default_value_t = disagg::DEFAULT_PREFILL_TPS)]
    prefill_tps: f64,
    /// Link speeds to compare, Gb/s.
    #[arg(long, value_delimiter = ',', default_values_t = disagg::DEFAULT_LINK_GBPS.to_vec())]
    link_gbps: Vec<f64>,
    #[arg(long, default_value_t = disagg::DEFAULT_LINK_LATENCY_MS)]
    link_latency_ms: f64,
    /// Chunked-prefill chunk size (vLLM max_num_batched_tokens); 0 = chunking off.
    #[arg(long, default_value_t = disagg::DEFAULT_CHUNK_TOKENS)]
    chunk_tokens: u32,
    /// Prefill remotely when uncached tokens reach this many (llm-d's rule).
    #[arg(long, default_value_t = disagg::DEFAULT_THRESHOLD_TOKENS)]
    threshold: u64,
    /// GPU memory in GB (10^9 bytes), for the KV capacity line.
    #[arg(long, default_value_t = disagg::DEFAULT_GPU_MEMORY_BYTES as f64 / 1e9)]
    gpu_memory_gb: f64,
    #[arg(long, default_value_t = disagg::DEFAULT_GPU_UTILIZATION)]
    gpu_utilization: f64,
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<()> {
    let model = disagg::model_shape(&args.model)?;
    anyhow::ensure!(
        args.gpu_memory_gb.is_finite() && args.gpu_memory_gb > 0.0,
        "--gpu-memory-gb must be a number > 0"
    );
    let input = DisaggInput {
        prompt_tokens: args.prompt_tokens,
        cached_tokens: args.cached_tokens,
        prefill_tps: args.prefill_tps,
        link_gbps: args.link_gbps,
        link_latency_ms: args.link_latency_ms,
        chunk_tokens: (args.chunk_tokens > 0).then_some(args.chunk_tokens),
        threshold_tokens: args.threshold,
        gpu_memory_bytes: (args.gpu_memory_gb * 1e9) as u64,
        gpu_utilization: args.gpu_utilization,
    };
    let report = disagg::calculate(&model, &input)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", disagg::render_text(&report));
    }
    Ok(())
}
