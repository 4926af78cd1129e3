//! Prefill/decode disaggregation calculator.
//!
//! Question answered: for one request, should the prompt be prefilled on a separate prefill
//! replica and its KV cache shipped to the decode replica, or prefilled where it will be
//! decoded? And what does each choice cost?
//!
//! The model is deliberately simple and every number can be checked by hand:
//!
//! * **KV bytes per token** = 2 (K and V) × layers × kv_heads × head_dim × dtype bytes.
//!   Llama-3.1-8B in bf16: 2 × 32 × 8 × 128 × 2 = 131072 B = 128 KiB.
//! * **Only uncached tokens count.** Tokens already in the decode replica's prefix cache are
//!   neither recomputed nor moved, so `uncached = prompt − cached` drives everything. This is
//!   why prefix-aware routing and disaggregation compose: a good cache hit shrinks both the
//!   prefill and the transfer.
//! * **Prefill time** = uncached / prefill throughput (tokens/s).
//! * **Transfer time** over a link = latency + bytes × 8 / link speed.
//! * **TTFT**: local = prefill; remote = prefill + transfer. This is the upper bound with no
//!   overlap; connectors that stream KV layer by layer hide most of the transfer *if* the link
//!   keeps up with the rate prefill produces KV (see [`DisaggReport::kv_production_gbps`]).
//! * **Decode stall**: co-located prefill occupies the GPU, so every running decode waits for
//!   the whole prefill; with chunked prefill the wait per decode step is one chunk
//!   (chunk / tps). Disaggregation removes this stall from the decode replica entirely.
//! * **Decision**: llm-d's `pd-profile-handler` rule: prefill remotely when the uncached
//!   token count is at least a threshold, otherwise prefill locally on the decode replica.
//! * **KV capacity**: (GPU memory × utilisation − weights) / bytes per token tokens; reported
//!   as 0 (with `weights_fit = false`) when the weights alone exceed the budget.
//!
//! Everything is pure arithmetic: no I/O, no clocks, so it compiles for the proxy-wasm plugin
//! and the browser demo as well as the CLI.

use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use thiserror::Error;

/// Errors from the calculator. Every invalid number is rejected rather than silently producing
/// `inf`/`NaN`, because those would serialise as `null` in JSON and hide the mistake.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum DisaggError {
    /// The model name is not one of the built-in shapes.
    #[error("unknown model {name:?}; known models: {known}")]
    UnknownModel {
        /// The name as given.
        name: String,
        /// Comma-separated list of known names.
        known: String,
    },
    /// More tokens cached than the prompt has: the caller mixed up its numbers.
    #[error("cached tokens ({cached}) exceed prompt tokens ({prompt})")]
    CachedExceedsPrompt {
        /// Cached tokens given.
        cached: u64,
        /// Prompt tokens given.
        prompt: u64,
    },
    /// A numeric input is out of range (zero/negative throughput, non-positive link speed,
    /// utilisation outside (0, 1], NaN, ...).
    #[error("invalid {field}: {value} ({reason})")]
    InvalidNumber {
        /// Input field name.
        field: &'static str,
        /// The offending value.
        value: f64,
        /// What the value must satisfy.
        reason: &'static str,
    },
    /// A model shape with a zero dimension (would give 0 KV bytes per token).
    #[error("invalid model shape {name:?}: {field} must be > 0")]
    InvalidModel {
        /// Model name.
        name: String,
        /// The zero field.
        field: &'static str,
    },
    /// Returned by [`kv_capacity_tokens`] when the weights leave no room for KV cache.
    #[error(
        "weights ({weight_bytes} B) do not fit in usable GPU memory ({usable_bytes} B): no room for KV cache"
    )]
    WeightsDoNotFit {
        /// Model weight bytes.
        weight_bytes: u64,
        /// GPU memory × utilisation.
        usable_bytes: u64,
    },
}

/// The few numbers of a transformer that decide KV-cache size and weight memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelShape {
    /// Canonical lower-case name, e.g. `llama-3.1-8b`.
    pub name: String,
    /// Number of transformer layers (each keeps its own K and V).
    pub layers: u32,
    /// Key/value heads (GQA: fewer than attention heads, which is what keeps KV small).
    pub kv_heads: u32,
    /// Dimension of each head.
    pub head_dim: u32,
    /// Bytes per KV element (bf16/fp16 = 2, fp8 = 1).
    pub dtype_bytes: u32,
    /// Weight memory in bytes = parameters × bytes per parameter.
    pub weight_bytes: u64,
}

impl ModelShape {
    /// Builds a shape from a parameter count (weights stored in the same dtype as the KV).
    pub fn new(
        name: &str,
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        dtype_bytes: u32,
        params: u64,
    ) -> Self {
        ModelShape {
            name: name.to_string(),
            layers,
            kv_heads,
            head_dim,
            dtype_bytes,
            weight_bytes: params * u64::from(dtype_bytes),
        }
    }

    /// KV-cache bytes one token occupies: 2 (K and V) × layers × kv_heads × head_dim × dtype.
    pub fn kv_bytes_per_token(&self) -> u64 {
        2 * u64::from(self.layers)
            * u64::from(self.kv_heads)
            * u64::from(self.head_dim)
            * u64::from(self.dtype_bytes)
    }

    fn validate(&self) -> Result<(), DisaggError> {
        let fields = [
            ("layers", self.layers),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("dtype_bytes", self.dtype_bytes),
        ];
        for (field, v) in fields {
            if v == 0 {
                return Err(DisaggError::InvalidModel {
                    name: self.name.clone(),
                    field,
                });
            }
        }
        Ok(())
    }
}

/// Built-in shapes: (name, layers, kv_heads, head_dim, dtype bytes, parameters).
/// Shapes come from each model's published `config.json`; parameter counts are the rounded
/// figures of the model cards (weights only need to be right to ~1% for the capacity line).
const BUILTIN: &[(&str, u32, u32, u32, u32, u64)] = &[
    ("llama-3.2-1b", 16, 8, 64, 2, 1_240_000_000),
    ("llama-3.1-8b", 32, 8, 128, 2, 8_030_000_000),
    ("llama-3.1-70b", 80, 8, 128, 2, 70_600_000_000),
    ("qwen2.5-7b", 28, 4, 128, 2, 7_610_000_000),
];

/// Names accepted by [`model_shape`] (case-insensitive).
pub fn known_models() -> Vec<&'static str> {
    BUILTIN.iter().map(|b| b.0).collect()
}

/// Looks up a built-in model shape by name, case-insensitively.
///
/// A Hugging Face style id is accepted too: the organisation prefix (`meta-llama/`,
/// `Qwen/`) and an `-Instruct` suffix are ignored, since instruct tunes share the base shape.
pub fn model_shape(name: &str) -> Result<ModelShape, DisaggError> {
    let lower = name.trim().to_ascii_lowercase();
    let base = lower.rsplit('/').next().unwrap_or(&lower);
    let base = base.strip_suffix("-instruct").unwrap_or(base);
    BUILTIN
        .iter()
        .find(|b| b.0 == base)
        .map(|&(n, l, kv, hd, dt, p)| ModelShape::new(n, l, kv, hd, dt, p))
        .ok_or_else(|| DisaggError::UnknownModel {
            name: name.to_string(),
            known: known_models().join(", "),
        })
}

/// Default prefill throughput: 12,000 tokens/s, a round figure for an 8B model on one
/// H100-class GPU. Measure yours (prompt tokens / prefill seconds) and pass it in.
pub const DEFAULT_PREFILL_TPS: f64 = 12_000.0;
/// Default links to compare, Gb/s: 10/25 GbE (plain TCP between nodes), 100 and 400 Gb/s
/// (RDMA NICs: InfiniBand, RoCE, EFA).
pub const DEFAULT_LINK_GBPS: [f64; 4] = [10.0, 25.0, 100.0, 400.0];
/// Default one-way setup latency per transfer, ms (RDMA within a rack is well under this;
/// 0.5 ms also covers the connector's handshake).
pub const DEFAULT_LINK_LATENCY_MS: f64 = 0.5;
/// Default chunked-prefill chunk size, tokens. 512 was vLLM's long-standing default token
/// budget per step with chunked prefill; newer vLLM picks larger budgets per GPU, so pass
/// the `max_num_batched_tokens` you run with. `None` means chunked prefill is off.
pub const DEFAULT_CHUNK_TOKENS: u32 = 512;
/// Default disaggregation threshold, uncached tokens. llm-d leaves the threshold to the
/// operator; 512 is chosen because a prefill that small fits in one default chunk
/// ([`DEFAULT_CHUNK_TOKENS`]): co-located, it stalls decode for a single step (~43 ms at the
/// default throughput), while going remote would add a network hop and a KV transfer for
/// almost no decode benefit. Above it, the co-located stall grows linearly with the prompt
/// while the transfer on a fast link stays small.
pub const DEFAULT_THRESHOLD_TOKENS: u64 = 512;
/// Default GPU memory: 80 GB (decimal). An "80GB" A100/H100 has 80 GiB physically; the
/// smaller decimal figure leaves some room for the CUDA context.
pub const DEFAULT_GPU_MEMORY_BYTES: u64 = 80_000_000_000;
/// Default fraction of GPU memory the engine may use (vLLM's `--gpu-memory-utilization`
/// default).
pub const DEFAULT_GPU_UTILIZATION: f64 = 0.9;

/// Inputs for one request. Every field has a default (see the `DEFAULT_*` constants), so JSON
/// may give only `prompt_tokens`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DisaggInput {
    /// Prompt length in tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens already in the decode replica's prefix cache (not prefilled, not moved).
    pub cached_tokens: u64,
    /// Prefill throughput, tokens/s (> 0).
    pub prefill_tps: f64,
    /// Links to compare, Gb/s (each > 0).
    pub link_gbps: Vec<f64>,
    /// Fixed latency added to every transfer, ms (>= 0).
    pub link_latency_ms: f64,
    /// Chunked-prefill chunk size in tokens; `None` = no chunking.
    pub chunk_tokens: Option<u32>,
    /// Prefill remotely when uncached tokens >= this (llm-d rule). 0 = always remote.
    pub threshold_tokens: u64,
    /// GPU memory per decode replica, bytes (sum over GPUs for tensor parallelism).
    pub gpu_memory_bytes: u64,
    /// Fraction of GPU memory usable, in (0, 1].
    pub gpu_utilization: f64,
}

impl Default for DisaggInput {
    fn default() -> Self {
        DisaggInput {
            prompt_tokens: 0,
            cached_tokens: 0,
            prefill_tps: DEFAULT_PREFILL_TPS,
            link_gbps: DEFAULT_LINK_GBPS.to_vec(),
            link_latency_ms: DEFAULT_LINK_LATENCY_MS,
            chunk_tokens: Some(DEFAULT_CHUNK_TOKENS),
            threshold_tokens: DEFAULT_THRESHOLD_TOKENS,
            gpu_memory_bytes: DEFAULT_GPU_MEMORY_BYTES,
            gpu_utilization: DEFAULT_GPU_UTILIZATION,
        }
    }
}

impl DisaggInput {
    /// Defaults with the given prompt and cached token counts.
    pub fn new(prompt_tokens: u64, cached_tokens: u64) -> Self {
        DisaggInput {
            prompt_tokens,
            cached_tokens,
            ..Default::default()
        }
    }
}

/// Where to prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrefillSite {
    /// On the decode replica itself (co-located prefill).
    Local,
    /// On a prefill replica, then ship the KV cache to the decode replica.
    Remote,
}

/// Decode stall with chunked prefill.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChunkedStall {
    /// Chunk size, tokens.
    pub chunk_tokens: u32,
    /// Number of chunks (= decode steps that carry a prefill chunk).
    pub chunks: u64,
    /// Extra time each of those decode steps takes: min(chunk, uncached) / tps, ms.
    pub per_step_stall_ms: f64,
}

/// How many tokens of KV cache fit next to the weights.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KvCapacity {
    /// GPU memory, bytes.
    pub gpu_memory_bytes: u64,
    /// Fraction usable.
    pub gpu_utilization: f64,
    /// GPU memory × utilisation, bytes.
    pub usable_bytes: u64,
    /// Model weights, bytes.
    pub weight_bytes: u64,
    /// Usable − weights, bytes (0 when the weights do not fit).
    pub kv_budget_bytes: u64,
    /// KV budget / bytes per token (0 when the weights do not fit).
    pub tokens: u64,
    /// False when the weights alone exceed usable memory.
    pub weights_fit: bool,
}

/// Cost of moving the KV cache over one link.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LinkRow {
    /// Link speed, Gb/s.
    pub link_gbps: f64,
    /// latency + bytes × 8 / link, ms.
    pub transfer_ms: f64,
    /// Prefill on the decode replica: = prefill_ms.
    pub ttft_local_ms: f64,
    /// Prefill elsewhere then transfer: prefill_ms + transfer_ms (no overlap assumed).
    pub ttft_remote_ms: f64,
    /// link_gbps >= kv_production_gbps: the link drains KV as fast as prefill makes it, so
    /// a layer-by-layer connector can hide the transfer behind prefill.
    pub link_keeps_up: bool,
}

/// Everything [`calculate`] works out for one request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DisaggReport {
    /// Model name.
    pub model: String,
    /// KV bytes per token.
    pub kv_bytes_per_token: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Cached tokens.
    pub cached_tokens: u64,
    /// prompt − cached: the tokens prefilled and moved.
    pub uncached_tokens: u64,
    /// uncached × bytes per token.
    pub kv_bytes_moved: u64,
    /// Prefill throughput used, tokens/s.
    pub prefill_tps: f64,
    /// uncached / tps, ms.
    pub prefill_ms: f64,
    /// Rate prefill produces KV, Gb/s = uncached × bytes/token × 8 / prefill seconds
    /// (= bytes/token × 8 × tps, independent of prompt length): the link speed needed to keep
    /// up with prefill.
    pub kv_production_gbps: f64,
    /// Threshold used for the decision.
    pub threshold_tokens: u64,
    /// Where to prefill.
    pub decision: PrefillSite,
    /// Why, in words, citing the threshold.
    pub reason: String,
    /// Decode stall if prefill is co-located and unchunked: = prefill_ms.
    pub decode_stall_ms: f64,
    /// Decode stall per step with chunked prefill, when enabled.
    pub chunked: Option<ChunkedStall>,
    /// KV capacity of the decode replica.
    pub kv_capacity: KvCapacity,
    /// Link latency used, ms.
    pub link_latency_ms: f64,
    /// One row per link.
    pub links: Vec<LinkRow>,
}

/// Time to move `bytes` of KV cache over a link of `link_gbps`, with a fixed `latency_ms`:
/// latency + bytes × 8 / link, in ms.
pub fn transfer_ms(bytes: u64, link_gbps: f64, latency_ms: f64) -> f64 {
    latency_ms + bytes as f64 * 8.0 / (link_gbps * 1e9) * 1e3
}

/// llm-d's rule: prefill remotely when the uncached tokens reach the threshold.
pub fn prefill_site(uncached_tokens: u64, threshold_tokens: u64) -> PrefillSite {
    if uncached_tokens >= threshold_tokens {
        PrefillSite::Remote
    } else {
        PrefillSite::Local
    }
}

fn invalid(field: &'static str, value: f64, reason: &'static str) -> DisaggError {
    DisaggError::InvalidNumber {
        field,
        value,
        reason,
    }
}

fn check_utilization(u: f64) -> Result<(), DisaggError> {
    // `!(u > 0.0)` also rejects NaN.
    if !(u > 0.0 && u <= 1.0) {
        return Err(invalid("gpu_utilization", u, "must be in (0, 1]"));
    }
    Ok(())
}

/// KV capacity of a replica: (memory × utilisation − weights) / bytes per token. When the
/// weights do not fit, the result has `weights_fit = false` and 0 tokens rather than an error,
/// so a report for a too-small GPU still shows the transfer numbers; use
/// [`kv_capacity_tokens`] to get an error instead.
pub fn kv_capacity(
    model: &ModelShape,
    gpu_memory_bytes: u64,
    gpu_utilization: f64,
) -> Result<KvCapacity, DisaggError> {
    model.validate()?;
    check_utilization(gpu_utilization)?;
    let usable_bytes = (gpu_memory_bytes as f64 * gpu_utilization).floor() as u64;
    let weights_fit = model.weight_bytes <= usable_bytes;
    let kv_budget_bytes = usable_bytes.saturating_sub(model.weight_bytes);
    Ok(KvCapacity {
        gpu_memory_bytes,
        gpu_utilization,
        usable_bytes,
        weight_bytes: model.weight_bytes,
        kv_budget_bytes,
        tokens: kv_budget_bytes / model.kv_bytes_per_token(),
        weights_fit,
    })
}

/// Like [`kv_capacity`] but only the token count, and an error when the weights do not fit.
pub fn kv_capacity_tokens(
    model: &ModelShape,
    gpu_memory_bytes: u64,
    gpu_utilization: f64,
) -> Result<u64, DisaggError> {
    let cap = kv_capacity(model, gpu_memory_bytes, gpu_utilization)?;
    if !cap.weights_fit {
        return Err(DisaggError::WeightsDoNotFit {
            weight_bytes: cap.weight_bytes,
            usable_bytes: cap.usable_bytes,
        });
    }
    Ok(cap.tokens)
}

/// Works out the disaggregation report for one request (see the module docs for formulas).
///
/// Errors: cached > prompt, prefill_tps not > 0, any link speed not > 0, latency < 0,
/// chunk size 0, utilisation outside (0, 1], any non-finite number, or a model shape with a
/// zero dimension.
pub fn calculate(model: &ModelShape, input: &DisaggInput) -> Result<DisaggReport, DisaggError> {
    model.validate()?;
    if input.cached_tokens > input.prompt_tokens {
        return Err(DisaggError::CachedExceedsPrompt {
            cached: input.cached_tokens,
            prompt: input.prompt_tokens,
        });
    }
    let tps = input.prefill_tps;
    if !(tps > 0.0 && tps.is_finite()) {
        return Err(invalid("prefill_tps", tps, "must be a finite number > 0"));
    }
    for &g in &input.link_gbps {
        if !(g > 0.0 && g.is_finite()) {
            return Err(invalid("link_gbps", g, "must be a finite number > 0"));
        }
    }
    let lat = input.link_latency_ms;
    if !(lat >= 0.0 && lat.is_finite()) {
        return Err(invalid(
            "link_latency_ms",
            lat,
            "must be a finite number >= 0",
        ));
    }
    if input.chunk_tokens == Some(0) {
        return Err(invalid("chunk_tokens", 0.0, "must be > 0 (or absent)"));
    }
    let kv_capacity = kv_capacity(model, input.gpu_memory_bytes, input.gpu_utilization)?;

    let bpt = model.kv_bytes_per_token();
    let uncached = input.prompt_tokens - input.cached_tokens;
    let kv_bytes_moved = uncached * bpt;
    let prefill_ms = uncached as f64 / tps * 1e3;
    let kv_production_gbps = bpt as f64 * 8.0 * tps / 1e9;

    let threshold = input.threshold_tokens;
    let decision = prefill_site(uncached, threshold);
    let reason = if decision == PrefillSite::Remote {
        format!(
            "uncached {uncached} tokens >= threshold {threshold}: prefill on a prefill \
                 replica and ship the KV cache, so decode on this replica does not stall"
        )
    } else {
        format!(
            "uncached {uncached} tokens < threshold {threshold}: prefill locally on the \
                 decode replica; the decode stall is short and no KV transfer or extra hop \
                 is needed"
        )
    };

    let chunked = input.chunk_tokens.map(|c| {
        let c64 = u64::from(c);
        ChunkedStall {
            chunk_tokens: c,
            chunks: uncached.div_ceil(c64),
            per_step_stall_ms: c64.min(uncached) as f64 / tps * 1e3,
        }
    });

    let links = input
        .link_gbps
        .iter()
        .map(|&g| {
            let transfer_ms = transfer_ms(kv_bytes_moved, g, lat);
            LinkRow {
                link_gbps: g,
                transfer_ms,
                ttft_local_ms: prefill_ms,
                ttft_remote_ms: prefill_ms + transfer_ms,
                link_keeps_up: g >= kv_production_gbps,
            }
        })
        .collect();

    Ok(DisaggReport {
        model: model.name.clone(),
        kv_bytes_per_token: bpt,
        prompt_tokens: input.prompt_tokens,
        cached_tokens: input.cached_tokens,
        uncached_tokens: uncached,
        kv_bytes_moved,
        prefill_tps: tps,
        prefill_ms,
        kv_production_gbps,
        threshold_tokens: threshold,
        decision,
        reason,
        decode_stall_ms: prefill_ms,
        chunked,
        kv_capacity,
        link_latency_ms: lat,
        links,
    })
}

/// Decimal byte size with one decimal: 524288000 → "524.3 MB".
pub fn fmt_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["kB", "MB", "GB", "TB", "PB"];
    if b < 1000 {
        return format!("{b} B");
    }
    let mut v = b as f64 / 1000.0;
    let mut i = 0;
    while v >= 1000.0 && i + 1 < UNITS.len() {
        v /= 1000.0;
        i += 1;
    }
    format!("{v:.1} {}", UNITS[i])
}

fn fmt_ms(ms: f64) -> String {
    format!("{ms:.1} ms")
}

/// Renders the report as aligned text for a terminal. Numbers are rounded to one decimal;
/// byte sizes are decimal (MB = 10^6 B) to match Gb/s link speeds.
pub fn render_text(r: &DisaggReport) -> String {
    let mut s = String::new();
    let kib = r.kv_bytes_per_token as f64 / 1024.0;
    // Writing to a String cannot fail; ignore the fmt::Result.
    let _ = writeln!(s, "Prefill/decode disaggregation: {}", r.model);
    let _ = writeln!(
        s,
        "  KV cache per token   {} B/token ({kib:.1} KiB)",
        r.kv_bytes_per_token
    );
    let _ = writeln!(
        s,
        "  Prompt               {} tokens, {} cached, {} uncached (prefilled and moved)",
        r.prompt_tokens, r.cached_tokens, r.uncached_tokens
    );
    let _ = writeln!(s, "  KV to move           {}", fmt_bytes(r.kv_bytes_moved));
    let _ = writeln!(
        s,
        "  Prefill              {} at {} tok/s",
        fmt_ms(r.prefill_ms),
        r.prefill_tps
    );
    let _ = writeln!(
        s,
        "  KV production        {:.1} Gb/s (link speed needed to keep up with prefill)",
        r.kv_production_gbps
    );
    let site = match r.decision {
        PrefillSite::Local => "LOCAL",
        PrefillSite::Remote => "REMOTE",
    };
    let _ = writeln!(s, "  Decision             {site}: {}", r.reason);
    let _ = write!(
        s,
        "  Co-located stall     {} unchunked",
        fmt_ms(r.decode_stall_ms)
    );
    match &r.chunked {
        Some(c) => {
            let _ = writeln!(
                s,
                "; chunked ({} tokens): {} per step for {} step(s)",
                c.chunk_tokens,
                fmt_ms(c.per_step_stall_ms),
                c.chunks
            );
        }
        None => s.push('\n'),
    }
    let cap = &r.kv_capacity;
    if cap.weights_fit {
        let _ = writeln!(
            s,
            "  KV capacity          {} tokens = ({} x {:.2} - {} weights) / {} B",
            cap.tokens,
            fmt_bytes(cap.gpu_memory_bytes),
            cap.gpu_utilization,
            fmt_bytes(cap.weight_bytes),
            r.kv_bytes_per_token
        );
    } else {
        let _ = writeln!(
            s,
            "  KV capacity          0 tokens: weights {} do not fit in {} x {:.2} = {}",
            fmt_bytes(cap.weight_bytes),
            fmt_bytes(cap.gpu_memory_bytes),
            cap.gpu_utilization,
            fmt_bytes(cap.usable_bytes)
        );
    }

    if r.links.is_empty() {
        s.push_str("  (no links given)\n");
        return s;
    }
    let _ = writeln!(
        s,
        "\n  Per link (latency {} added to each transfer):",
        fmt_ms(r.link_latency_ms)
    );
    let header = ["link", "transfer", "TTFT local", "TTFT remote", "keeps up"];
    let rows: Vec<[String; 5]> = r
        .links
        .iter()
        .map(|l| {
            [
                format!("{} Gb/s", l.link_gbps),
                fmt_ms(l.transfer_ms),
                fmt_ms(l.ttft_local_ms),
                fmt_ms(l.ttft_remote_ms),
                if l.link_keeps_up { "yes" } else { "no" }.to_string(),
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut line = |cells: [&str; 5]| {
        s.push_str("  ");
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if i > 0 {
                s.push_str("  ");
            }
            // Numbers right-aligned; the last column (yes/no) left-aligned, trailing space trimmed.
            if i == 4 {
                s.push_str(cell);
            } else {
                let _ = write!(s, "{cell:>w$}");
            }
        }
        s.push('\n');
    };
    line(header);
    for row in &rows {
        line([&row[0], &row[1], &row[2], &row[3], &row[4]]);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol
    }

    fn llama8b_4000() -> DisaggReport {
        let m = model_shape("llama-3.1-8b").unwrap();
        calculate(&m, &DisaggInput::new(4000, 0)).unwrap()
    }

    #[test]
    fn kv_bytes_per_token_matches_hand_math() {
        // 2 × 32 × 8 × 128 × 2 = 128 KiB
        assert_eq!(
            model_shape("llama-3.1-8b").unwrap().kv_bytes_per_token(),
            131_072
        );
        // 2 × 80 × 8 × 128 × 2 = 320 KiB
        assert_eq!(
            model_shape("llama-3.1-70b").unwrap().kv_bytes_per_token(),
            327_680
        );
        // 2 × 16 × 8 × 64 × 2
        assert_eq!(
            model_shape("llama-3.2-1b").unwrap().kv_bytes_per_token(),
            32_768
        );
        // 2 × 28 × 4 × 128 × 2
        assert_eq!(
            model_shape("qwen2.5-7b").unwrap().kv_bytes_per_token(),
            57_344
        );
    }

    #[test]
    fn model_lookup_is_case_insensitive_and_accepts_hf_ids() {
        assert_eq!(model_shape("LLaMA-3.1-8B").unwrap().name, "llama-3.1-8b");
        assert_eq!(
            model_shape("meta-llama/Llama-3.1-70B-Instruct")
                .unwrap()
                .name,
            "llama-3.1-70b"
        );
        assert_eq!(model_shape("Qwen/Qwen2.5-7B").unwrap().name, "qwen2.5-7b");
        let m = model_shape("llama-3.1-8b").unwrap();
        assert_eq!(m.weight_bytes, 16_060_000_000);
    }

    #[test]
    fn unknown_model_lists_known_names() {
        let e = model_shape("gpt-5").unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, DisaggError::UnknownModel { .. }));
        for n in known_models() {
            assert!(msg.contains(n), "{msg} lacks {n}");
        }
    }

    #[test]
    fn llama8b_4000_tokens_exact_numbers() {
        let r = llama8b_4000();
        assert_eq!(r.kv_bytes_per_token, 131_072);
        assert_eq!(r.uncached_tokens, 4000);
        assert_eq!(r.kv_bytes_moved, 524_288_000);
        assert!(close(r.prefill_ms, 333.333_333, 1e-3));
        assert!(close(r.kv_production_gbps, 12.582_912, 1e-6));
        assert_eq!(r.decision, PrefillSite::Remote);
        assert!(close(r.decode_stall_ms, r.prefill_ms, 0.0));
        let c = r.chunked.as_ref().unwrap();
        assert_eq!((c.chunk_tokens, c.chunks), (512, 8));
        assert!(close(c.per_step_stall_ms, 42.666_666, 1e-3));

        // transfer = 0.5 ms + 4.194304e9 bits / link
        let want = [
            (10.0, 419.930_4, false),
            (25.0, 168.272_16, true),
            (100.0, 42.443_04, true),
            (400.0, 10.985_76, true),
        ];
        assert_eq!(r.links.len(), 4);
        for (row, (g, t, keeps)) in r.links.iter().zip(want) {
            assert_eq!(row.link_gbps, g);
            assert!(close(row.transfer_ms, t, 1e-6), "{g}: {}", row.transfer_ms);
            assert_eq!(row.ttft_local_ms, r.prefill_ms);
            assert!(close(row.ttft_remote_ms, r.prefill_ms + t, 1e-6));
            assert_eq!(row.link_keeps_up, keeps);
        }
    }

    #[test]
    fn render_text_contains_required_strings() {
        let t = render_text(&llama8b_4000());
        for needle in [
            "131072 B/token",
            "524.3 MB",
            "333.3 ms",
            "12.6 Gb/s",
            "419.9 ms",
            "753.3 ms",
            "REMOTE",
            "threshold 512",
            "42.7 ms per step for 8 step(s)",
            "426788 tokens",
        ] {
            assert!(t.contains(needle), "missing {needle:?} in:\n{t}");
        }
    }

    #[test]
    fn render_text_table_columns_are_aligned() {
        let t = render_text(&llama8b_4000());
        let table: Vec<&str> = t
            .lines()
            .skip_while(|l| !l.contains("TTFT remote"))
            .collect();
        assert_eq!(table.len(), 5, "{t}");
        // Every right-aligned column ends at the same offset in every line.
        let header = table[0];
        let ends: Vec<usize> = ["link", "transfer", "TTFT local", "TTFT remote"]
            .iter()
            .map(|h| header.find(h).unwrap() + h.len())
            .collect();
        for row in &table[1..] {
            let mut cells = row.split("  ").filter(|c| !c.is_empty());
            for &end in &ends {
                let c = cells.next().unwrap();
                let start = row.find(c).unwrap();
                assert_eq!(start + c.len(), end, "misaligned {c:?} in {row:?}");
            }
            // keeps-up column starts where its header does
            assert_eq!(
                row.rfind(' ').unwrap() + 1,
                header.find("keeps up").unwrap(),
                "{row:?}"
            );
        }
        assert!(table[1].contains("10 Gb/s") && table[1].ends_with("no"));
        assert!(table[4].contains("400 Gb/s") && table[4].ends_with("yes"));
    }

    #[test]
    fn cached_tokens_reduce_prefill_and_transfer() {
        let m = model_shape("llama-3.1-8b").unwrap();
        let full = calculate(&m, &DisaggInput::new(4000, 0)).unwrap();
        let warm = calculate(&m, &DisaggInput::new(4000, 3000)).unwrap();
        assert_eq!(warm.uncached_tokens, 1000);
        assert_eq!(warm.kv_bytes_moved, 1000 * 131_072);
        assert!(close(warm.prefill_ms, full.prefill_ms / 4.0, 1e-9));
        assert!(warm.links[0].transfer_ms < full.links[0].transfer_ms);
        // The production rate depends on model and throughput only, not on the prompt.
        assert_eq!(warm.kv_production_gbps, full.kv_production_gbps);
        // Fully cached: nothing to prefill or move; only the fixed latency remains.
        let hit = calculate(&m, &DisaggInput::new(4000, 4000)).unwrap();
        assert_eq!((hit.uncached_tokens, hit.kv_bytes_moved), (0, 0));
        assert_eq!(hit.prefill_ms, 0.0);
        assert_eq!(hit.links[0].transfer_ms, DEFAULT_LINK_LATENCY_MS);
        assert_eq!(hit.chunked.as_ref().unwrap().chunks, 0);
        assert_eq!(hit.chunked.as_ref().unwrap().per_step_stall_ms, 0.0);
        assert_eq!(hit.decision, PrefillSite::Local);
    }

    #[test]
    fn threshold_rule_both_ways() {
        let m = model_shape("llama-3.1-8b").unwrap();
        let at = calculate(&m, &DisaggInput::new(1512, 1000)).unwrap();
        assert_eq!(at.uncached_tokens, 512);
        assert_eq!(at.decision, PrefillSite::Remote);
        assert!(at.reason.contains(">= threshold 512"), "{}", at.reason);

        let below = calculate(&m, &DisaggInput::new(1511, 1000)).unwrap();
        assert_eq!(below.decision, PrefillSite::Local);
        assert!(below.reason.contains("< threshold 512"), "{}", below.reason);
        assert!(render_text(&below).contains("LOCAL"));

        // A long prompt that is mostly cached stays local: only uncached tokens count.
        let cached = calculate(&m, &DisaggInput::new(100_000, 99_900)).unwrap();
        assert_eq!(cached.decision, PrefillSite::Local);

        // Threshold 0 = always remote.
        let mut inp = DisaggInput::new(10, 10);
        inp.threshold_tokens = 0;
        assert_eq!(calculate(&m, &inp).unwrap().decision, PrefillSite::Remote);
    }

    #[test]
    fn chunked_stall_short_prompt_and_disabled() {
        let m = model_shape("llama-3.1-8b").unwrap();
        let mut inp = DisaggInput::new(120, 0);
        let r = calculate(&m, &inp).unwrap();
        let c = r.chunked.unwrap();
        // A prompt shorter than one chunk stalls one step by its own length.
        assert_eq!(c.chunks, 1);
        assert!(close(c.per_step_stall_ms, 10.0, 1e-9));
        inp.chunk_tokens = None;
        let r = calculate(&m, &inp).unwrap();
        assert!(r.chunked.is_none());
        assert!(close(r.decode_stall_ms, 10.0, 1e-9));
    }

    #[test]
    fn llama70b_capacity_line() {
        let m = model_shape("llama-3.1-70b").unwrap();
        assert_eq!(m.weight_bytes, 141_200_000_000);
        // One 80 GB GPU: 72 GB usable < 141.2 GB of weights.
        let r = calculate(&m, &DisaggInput::new(4000, 0)).unwrap();
        assert!(!r.kv_capacity.weights_fit);
        assert_eq!(r.kv_capacity.tokens, 0);
        assert_eq!(r.kv_capacity.kv_budget_bytes, 0);
        let t = render_text(&r);
        assert!(t.contains("0 tokens: weights 141.2 GB do not fit"), "{t}");
        assert_eq!(
            kv_capacity_tokens(&m, DEFAULT_GPU_MEMORY_BYTES, 0.9),
            Err(DisaggError::WeightsDoNotFit {
                weight_bytes: 141_200_000_000,
                usable_bytes: 72_000_000_000,
            })
        );
        // TP=8 over 8 × 80 GB: (640 × 0.9 − 141.2) GB / 327680 B.
        let mut inp = DisaggInput::new(4000, 0);
        inp.gpu_memory_bytes = 8 * DEFAULT_GPU_MEMORY_BYTES;
        let r = calculate(&m, &inp).unwrap();
        let cap = &r.kv_capacity;
        assert!(cap.weights_fit);
        assert_eq!(cap.usable_bytes, 576_000_000_000);
        assert_eq!(cap.kv_budget_bytes, 434_800_000_000);
        assert_eq!(cap.tokens, 1_326_904);
        assert_eq!(
            kv_capacity_tokens(&m, inp.gpu_memory_bytes, 0.9),
            Ok(1_326_904)
        );
        assert!(render_text(&r).contains("1326904 tokens"));
    }

    #[test]
    fn llama8b_capacity_on_one_gpu() {
        let m = model_shape("llama-3.1-8b").unwrap();
        // (72e9 − 16.06e9) / 131072 = 426788.3
        assert_eq!(
            kv_capacity_tokens(&m, DEFAULT_GPU_MEMORY_BYTES, 0.9),
            Ok(426_788)
        );
    }

    #[test]
    fn error_cases() {
        let m = model_shape("llama-3.1-8b").unwrap();
        let base = DisaggInput::new(1000, 0);
        let err = |f: &dyn Fn(&mut DisaggInput)| {
            let mut i = base.clone();
            f(&mut i);
            calculate(&m, &i).unwrap_err()
        };
        assert_eq!(
            err(&|i| i.cached_tokens = 1001),
            DisaggError::CachedExceedsPrompt {
                cached: 1001,
                prompt: 1000
            }
        );
        let field_of = |e: DisaggError| match e {
            DisaggError::InvalidNumber { field, .. } => field,
            other => panic!("unexpected {other:?}"),
        };
        assert_eq!(field_of(err(&|i| i.prefill_tps = 0.0)), "prefill_tps");
        assert_eq!(field_of(err(&|i| i.prefill_tps = -5.0)), "prefill_tps");
        assert_eq!(field_of(err(&|i| i.prefill_tps = f64::NAN)), "prefill_tps");
        assert_eq!(
            field_of(err(&|i| i.prefill_tps = f64::INFINITY)),
            "prefill_tps"
        );
        assert_eq!(
            field_of(err(&|i| i.link_gbps = vec![10.0, -1.0])),
            "link_gbps"
        );
        assert_eq!(field_of(err(&|i| i.link_gbps = vec![0.0])), "link_gbps");
        assert_eq!(
            field_of(err(&|i| i.link_latency_ms = -0.1)),
            "link_latency_ms"
        );
        assert_eq!(field_of(err(&|i| i.chunk_tokens = Some(0))), "chunk_tokens");
        for u in [0.0, -0.5, 1.01, f64::NAN] {
            assert_eq!(field_of(err(&|i| i.gpu_utilization = u)), "gpu_utilization");
        }
        // Utilisation of exactly 1 is allowed.
        let mut ok = base.clone();
        ok.gpu_utilization = 1.0;
        assert!(calculate(&m, &ok).is_ok());

        let mut bad = m.clone();
        bad.kv_heads = 0;
        assert!(matches!(
            calculate(&bad, &base),
            Err(DisaggError::InvalidModel {
                field: "kv_heads",
                ..
            })
        ));
        assert!(err(&|i| i.prefill_tps = 0.0)
            .to_string()
            .contains("prefill_tps"));
    }

    #[test]
    fn no_links_still_renders() {
        let m = model_shape("llama-3.2-1b").unwrap();
        let mut inp = DisaggInput::new(2000, 0);
        inp.link_gbps.clear();
        let r = calculate(&m, &inp).unwrap();
        assert!(r.links.is_empty());
        assert!(render_text(&r).contains("(no links given)"));
    }

    #[test]
    fn json_round_trip_shapes() {
        let r = llama8b_4000();
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["kv_bytes_per_token"], 131_072);
        assert_eq!(v["decision"], "remote");
        assert_eq!(v["links"][0]["link_keeps_up"], false);
        assert_eq!(v["chunked"]["chunks"], 8);
        // Input JSON may omit everything but the prompt; defaults fill the rest.
        let inp: DisaggInput = serde_json::from_str(r#"{"prompt_tokens": 4000}"#).unwrap();
        assert_eq!(inp, DisaggInput::new(4000, 0));
        let inp: DisaggInput =
            serde_json::from_str(r#"{"prompt_tokens": 10, "chunk_tokens": null}"#).unwrap();
        assert_eq!(inp.chunk_tokens, None);
    }
}
