use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use prefixroute_core::config::{IndexMode, Placement, Policy, Weights};
use prefixroute_core::latency::LatencyConfig;
use prefixroute_core::tokenizer::NonAscii;
use prefixroute_sim::disagg::{self, fmt_bytes};
use prefixroute_sim::fleet::FleetEvent;
use prefixroute_sim::pd::PdConfig;
use prefixroute_sim::replica::ReplicaTiming;
use prefixroute_sim::simulation::{
    replica_names, upper_bound, GatewaySpread, SimConfig, SimReport, Simulation,
};
use prefixroute_sim::summary::max_over_mean;

#[derive(clap::Args)]
pub struct Args {
    /// Trace file (JSONL) from `prefixroute trace`.
    trace: PathBuf,
    /// Policies to compare, comma-separated (latency, prefix, prefix-only, least-queue,
    /// round-robin, random), or `all`.
    #[arg(long, default_value = "all")]
    policy: String,
    #[arg(long, default_value_t = 3, conflicts_with = "decode_replicas")]
    replicas: usize,
    /// Prefix-cache capacity of each replica, in blocks.
    #[arg(long, default_value_t = 64)]
    cache_blocks: usize,
    /// The replicas do not report their capacity: the router's belief keeps
    /// `--index-capacity-blocks` per replica.
    #[arg(long)]
    capacity_unreported: bool,
    /// The bound of the router's belief per replica when no capacity is reported (llm-d's
    /// default).
    #[arg(long, default_value_t = prefixroute_core::index::DEFAULT_CAPACITY_BLOCKS)]
    index_capacity_blocks: usize,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Characters outside ASCII: one token each (`pieces`) or skipped (`skip`, as
    /// llm-d-inference-sim does); routers and replicas tokenize alike.
    #[arg(long, default_value = "pieces")]
    non_ascii: NonAscii,
    /// Concurrent sequences per replica.
    #[arg(long, default_value_t = ReplicaTiming::default().lanes)]
    slots: usize,
    /// The replicas' real prefill cost (the router learns it; `--prior-ms-per-token` is where
    /// it starts).
    #[arg(long, default_value_t = ReplicaTiming::default().prefill_ms_per_token)]
    prefill_ms_per_token: f64,
    #[arg(long, default_value_t = ReplicaTiming::default().prefill_overhead_ms)]
    prefill_overhead_ms: f64,
    /// The latency policy's prior prefill cost per token.
    #[arg(long, default_value_t = LatencyConfig::default().prefill_ms_per_token)]
    prior_ms_per_token: f64,
    /// The most sequences the latency policy assumes a replica prefills at once (the plugin's
    /// `latency.lanes`, `serve --prior-lanes`); it learns how many do, at most this many.
    #[arg(long, default_value_t = LatencyConfig::default().lanes)]
    prior_lanes: u32,
    /// A prefix busier than one replica's fair share gets another copy once its holders have
    /// taken more than this many times the mean replica's recent requests (the plugin's
    /// `latency.balance_factor`); 0 turns the bound off.
    #[arg(long, default_value_t = LatencyConfig::default().balance_factor)]
    balance_factor: f64,
    #[arg(long, default_value_t = ReplicaTiming::default().decode_ms_per_token)]
    decode_ms_per_token: f64,
    /// Print the first N decisions of each policy.
    #[arg(long, default_value_t = 0)]
    show_decisions: usize,
    /// Scorer weights of the prefix policy.
    #[arg(long, default_value_t = Weights::default())]
    weights: Weights,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print JSON reports instead of a table.
    #[arg(long)]
    json: bool,
    /// The router's belief: `approximate` (what it routed) or `precise` (the replicas' KV
    /// events, applied as they happen).
    #[arg(long, default_value = "approximate", value_parser = str::parse::<IndexMode>)]
    index: IndexMode,
    /// Where the `latency` policy places groups: `local` (each gateway's own view) or
    /// `consistent` (also a home every gateway computes alike; for several gateways).
    #[arg(long, default_value = "local", value_parser = str::parse::<Placement>)]
    placement: Placement,
    /// Gateways in front of the fleet, each with its own belief and ledger (separate Envoys
    /// share nothing); requests reach them as `--gateway-spread` says. With `--index precise`
    /// every gateway reads the replicas' events.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    gateways: u64,
    /// How requests reach the gateways: `in-turn` (request i to gateway i mod N; a
    /// conversation's turns go to different gateways) or `by-group` (every request of a group
    /// to one gateway: session affinity in front of them).
    #[arg(long, default_value = "in-turn", value_parser = str::parse::<GatewaySpread>)]
    gateway_spread: GatewaySpread,
    /// With `--index precise`: how often each gateway fetches the replicas' events, in ms, as
    /// the plugin's `kv_events.interval_ms` when it polls (`serve --kv-wait-ms 0
    /// --kv-interval-ms`); 0 applies every change the moment the replica makes it. The
    /// plugin's default long poll delivers a change in about 10 ms.
    #[arg(long, default_value_t = 0.0)]
    kv_interval_ms: f64,
    /// How often each gateway scrapes the replicas' queues and cache usage, in ms (the
    /// plugin's `scrape.interval_ms`): a decision sees the last scrape, as in Envoy. 0: an
    /// ideal scrape at every decision.
    #[arg(long, default_value_t = prefixroute_sim::simulation::SCRAPE_INTERVAL_MS)]
    scrape_interval_ms: f64,
    /// A change to the fleet during the run (repeatable): `down:replica-2@20` (the pod goes
    /// away 20 s into the trace; what it holds finishes), `up:replica-2@40` (a pod with an
    /// empty cache takes the slot), `restart:replica-1@30` (restarts in place: the router sees
    /// it at its next scrape), `fail:replica-0@10` (its engine dies, its pod lives: every try
    /// a 503 at once while its scrapes say idle; Envoy retries on the failover list and each
    /// gateway takes it out after five failures in a row, for 30 s). A replica that joins
    /// later: `down:N@0` and `up:N@T`.
    #[arg(long = "fleet-event", value_name = "KIND:REPLICA@SECONDS",
          value_parser = str::parse::<FleetEvent>)]
    fleet_events: Vec<FleetEvent>,
    #[command(flatten)]
    split: SplitArgs,
}

/// Prefill/decode disaggregation: each policy runs on the split fleet and, for comparison, on
/// the same replicas all serving aggregated.
#[derive(clap::Args)]
#[command(next_help_heading = "Prefill/decode disaggregation")]
pub struct SplitArgs {
    /// Replicas that only prefill; requests whose uncached tokens reach --threshold are
    /// prefilled there and their KV cache moved to the decode replica.
    #[arg(long, value_name = "N")]
    prefill_replicas: Option<usize>,
    /// Replicas the router sends every request to (they decode; they prefill what stays
    /// under the threshold). Default: --replicas.
    #[arg(long, value_name = "M")]
    decode_replicas: Option<usize>,
    /// Prefill remotely when the router predicts at least this many uncached tokens (llm-d's
    /// rule) [default: 512].
    #[arg(long, value_name = "T")]
    threshold: Option<u64>,
    /// Each prefill replica's link to the decode replicas, Gb/s (required with N > 0).
    #[arg(long, value_name = "G", allow_negative_numbers = true)]
    link_gbps: Option<f64>,
    /// Fixed latency of each KV transfer, ms [default: 0.5].
    #[arg(long, value_name = "L", allow_negative_numbers = true)]
    link_latency_ms: Option<f64>,
    /// The model whose KV cache moves (bytes per token; see `prefixroute disagg`)
    /// [default: llama-3.1-8b].
    #[arg(long)]
    model: Option<String>,
    /// Chunked prefill of C tokens per decode step on the replicas that prefill locally.
    #[arg(long, value_name = "C")]
    chunk_tokens: Option<u32>,
}

/// The split the flags ask for, with the model it prices, or `None` without
/// --prefill-replicas. Every inconsistency is one error.
fn split_config(split: &SplitArgs, replicas: usize) -> Result<Option<(PdConfig, usize, String)>> {
    let Some(prefill) = split.prefill_replicas else {
        let stray = [
            (split.decode_replicas.is_some(), "--decode-replicas"),
            (split.threshold.is_some(), "--threshold"),
            (split.link_gbps.is_some(), "--link-gbps"),
            (split.link_latency_ms.is_some(), "--link-latency-ms"),
            (split.model.is_some(), "--model"),
            (split.chunk_tokens.is_some(), "--chunk-tokens"),
        ];
        if let Some((_, flag)) = stray.iter().find(|(given, _)| *given) {
            bail!("{flag} needs --prefill-replicas (it configures a prefill/decode split)");
        }
        return Ok(None);
    };
    let decode = split.decode_replicas.unwrap_or(replicas);
    if prefill + decode == 0 {
        bail!("--prefill-replicas + --decode-replicas is 0: the fleet needs replicas");
    }
    if decode == 0 {
        bail!("--decode-replicas must be at least 1: the router sends every request to a decode replica");
    }
    let link_gbps = match split.link_gbps {
        Some(g) => g,
        None if prefill == 0 => 1.0,
        None => bail!("--link-gbps is required with --prefill-replicas {prefill}"),
    };
    let model = split.model.clone().unwrap_or_else(|| "llama-3.1-8b".into());
    let shape = disagg::model_shape(&model)?;
    let config = PdConfig {
        prefill_replicas: prefill,
        threshold_tokens: split.threshold.unwrap_or(disagg::DEFAULT_THRESHOLD_TOKENS),
        link_gbps,
        link_latency_ms: split
            .link_latency_ms
            .unwrap_or(disagg::DEFAULT_LINK_LATENCY_MS),
        kv_bytes_per_token: shape.kv_bytes_per_token(),
        chunk_tokens: split.chunk_tokens,
    };
    config.validate().context("invalid prefill/decode split")?;
    Ok(Some((config, decode, shape.name)))
}

pub fn run(args: Args) -> Result<()> {
    let trace = super::read_trace(&args.trace)?;
    let policies: Vec<Policy> = if args.policy == "all" {
        Policy::ALL.to_vec()
    } else {
        args.policy
            .split(',')
            .map(|p| p.trim().parse())
            .collect::<Result<_, _>>()?
    };
    let split = split_config(&args.split, args.replicas)?;
    let replicas = split
        .as_ref()
        .map_or(args.replicas, |(_, decode, _)| *decode);
    let names = replica_names(replicas);
    if args.kv_interval_ms != 0.0 && args.index != IndexMode::Precise {
        bail!("--kv-interval-ms delays the replicas' KV events: it needs --index precise");
    }
    let mut base = SimConfig {
        replicas,
        cache_blocks: args.cache_blocks,
        capacity_reported: !args.capacity_unreported,
        timing: ReplicaTiming {
            lanes: args.slots,
            prefill_ms_per_token: args.prefill_ms_per_token,
            prefill_overhead_ms: args.prefill_overhead_ms,
            decode_ms_per_token: args.decode_ms_per_token,
        },
        index: args.index,
        gateways: args.gateways as usize,
        spread: args.gateway_spread,
        kv_interval_ms: args.kv_interval_ms,
        scrape_interval_ms: args.scrape_interval_ms,
        ..SimConfig::default()
    };
    base.router.weights = args.weights;
    base.router.hash.block_size = args.block_size;
    base.router.hash.non_ascii = args.non_ascii;
    base.router.index_capacity_blocks = args.index_capacity_blocks;
    base.router.seed = args.seed;
    base.router.placement = args.placement;
    base.router.latency.prefill_ms_per_token = args.prior_ms_per_token;
    base.router.latency.lanes = args.prior_lanes;
    base.router.latency.balance_factor = args.balance_factor;
    if let Some((pd, _, model)) = &split {
        if !args.fleet_events.is_empty() {
            bail!("--fleet-event is not supported with --prefill-replicas");
        }
        if args.gateways > 1 {
            bail!("--gateways is not supported with --prefill-replicas");
        }
        return run_split(&args, &trace, &policies, base, *pd, model);
    }
    let mut reports = Vec::new();
    let mut out = String::new();
    for policy in policies {
        let mut config = base;
        config.router.policy = policy;
        let mut sim = Simulation::new(&trace, config)?.with_fleet_events(&args.fleet_events)?;
        sim.run();
        if args.show_decisions > 0 && !args.json {
            for step in sim.steps().iter().take(args.show_decisions) {
                let retried: Vec<&str> = step
                    .failed_tries
                    .iter()
                    .map(|&r| names[r].as_str())
                    .collect();
                let served = format!(
                    "{} of {} tokens cached, ttft {:.0} ms",
                    step.served.cached_tokens, step.served.prompt_tokens, step.served.ttft_ms
                );
                let outcome = match step.replica() {
                    None => format!(
                        "  [every try answered 503: {}; after {:.0} ms]",
                        retried.join(", "),
                        step.served.ttft_ms
                    ),
                    Some(r) if !retried.is_empty() => {
                        format!(
                            "  [503 from {}, then {}: {served}]",
                            retried.join(", "),
                            names[r]
                        )
                    }
                    Some(_) => format!("  [{served}]"),
                };
                out += &format!("{}{}\n", step.explain(&names), outcome);
                for line in step.decision.endpoint_lines(&names) {
                    out += &format!("    {line}\n");
                }
            }
            out.push('\n');
        }
        reports.push(sim.report());
    }
    let bound = upper_bound(&trace, base)?;
    if args.json {
        let json = serde_json::json!({
            "policies": reports,
            "upper_bound": bound,
            "fleet_events": args.fleet_events,
        });
        out += &serde_json::to_string_pretty(&json)?;
        out.push('\n');
    } else {
        if !args.fleet_events.is_empty() {
            let events: Vec<String> = args.fleet_events.iter().map(ToString::to_string).collect();
            out += &format!(
                "fleet: {} (the upper bound's one server has none)\n",
                events.join(", ")
            );
        }
        if args.gateways > 1 {
            let spread = match args.gateway_spread {
                GatewaySpread::InTurn => "requests in turn",
                GatewaySpread::ByGroup => "each group's requests to one of them",
            };
            out += &format!(
                "{} gateways, {spread}, each with its own {} belief (the upper bound has one)\n",
                args.gateways,
                args.index.name()
            );
        }
        out += &render_table(&reports, Some(&bound));
    }
    super::write_stdout(&out)
}

/// Each policy on the split fleet and on the same replicas aggregated.
fn run_split(
    args: &Args,
    trace: &[prefixroute_sim::trace::TraceRecord],
    policies: &[Policy],
    base: SimConfig,
    pd: PdConfig,
    model: &str,
) -> Result<()> {
    let mut split = base;
    split.pd = Some(pd);
    // Aggregated: every replica decodes and prefills (the split's chunking applies to it too).
    let mut aggregated = base;
    aggregated.replicas = base.replicas + pd.prefill_replicas;
    aggregated.pd = Some(PdConfig {
        prefill_replicas: 0,
        ..pd
    });
    let names = replica_names(split.replicas);
    let mut out = String::new();
    let mut rows = Vec::new();
    for &policy in policies {
        let mut runs = Vec::new();
        for mut config in [split, aggregated] {
            config.router.policy = policy;
            let mut sim = Simulation::new(trace, config)?;
            sim.run();
            if args.show_decisions > 0 && !args.json && config.replicas == split.replicas {
                for step in sim.steps().iter().take(args.show_decisions) {
                    let site = match &step.remote {
                        Some(r) => format!(
                            "prefilled on prefill-{}, {} of KV in {:.1} ms",
                            r.prefill_replica,
                            fmt_bytes(r.kv_bytes),
                            r.transfer_ms
                        ),
                        None => "prefilled locally".to_string(),
                    };
                    out += &format!(
                        "{}  [{} of {} tokens cached, {site}, ttft {:.0} ms]\n",
                        step.explain(&names),
                        step.served.cached_tokens,
                        step.served.prompt_tokens,
                        step.served.ttft_ms
                    );
                }
                out.push('\n');
            }
            runs.push(sim.report());
        }
        rows.push((policy, runs.remove(0), runs.remove(0)));
    }
    if args.json {
        let json = serde_json::json!({
            "pd": {
                "prefill_replicas": pd.prefill_replicas,
                "decode_replicas": split.replicas,
                "threshold_tokens": pd.threshold_tokens,
                "link_gbps": pd.link_gbps,
                "link_latency_ms": pd.link_latency_ms,
                "model": model,
                "kv_bytes_per_token": pd.kv_bytes_per_token,
                "chunk_tokens": pd.chunk_tokens,
            },
            "policies": rows.iter().map(|(policy, split, aggregated)| serde_json::json!({
                "policy": policy.to_string(),
                "disaggregated": split,
                "aggregated": aggregated,
            })).collect::<Vec<_>>(),
        });
        out += &serde_json::to_string_pretty(&json)?;
        out.push('\n');
    } else {
        out += &format!(
            "{} prefill + {} decode replicas, threshold {} tokens, {} Gb/s links, {model} \
             ({} of KV per token){}; aggregated: the same {} replicas each prefilling and decoding\n\n",
            pd.prefill_replicas,
            split.replicas,
            pd.threshold_tokens,
            pd.link_gbps,
            fmt_bytes(pd.kv_bytes_per_token),
            pd.chunk_tokens
                .map_or(String::new(), |c| format!(", chunked prefill {c} tokens")),
            aggregated.replicas,
        );
        out += &render_split_table(&rows, pd.prefill_replicas, split.replicas);
    }
    super::write_stdout(&out)
}

/// The split table: one row per policy and serving mode.
pub fn render_split_table(
    rows: &[(Policy, SimReport, SimReport)],
    prefill: usize,
    decode: usize,
) -> String {
    let mut out = format!(
        "{:<12} {:<12} {:>8} {:>10} {:>10} {:>11} {:>13} {:>7} {:>10} {:>9}\n",
        "policy",
        "serving",
        "hit rate",
        "TTFT p50",
        "TTFT p95",
        "stall p95",
        "worst ITL p95",
        "remote",
        "KV moved",
        "link busy"
    );
    let split_label = format!("P/D {prefill}+{decode}");
    let aggregated_label = format!("aggregated {}", prefill + decode);
    for (policy, split, aggregated) in rows {
        for (label, r) in [(&split_label, split), (&aggregated_label, aggregated)] {
            let pd = r.pd.unwrap_or(prefixroute_sim::pd::PdStats {
                prefill_replicas: 0,
                remote_prefill_share: 0.0,
                kv_bytes_moved: 0,
                link_busy_share: 0.0,
            });
            let (remote, moved, busy) = if pd.prefill_replicas == 0 {
                ("-".to_string(), "-".to_string(), "-".to_string())
            } else {
                (
                    format!("{:.0}%", pd.remote_prefill_share * 100.0),
                    fmt_bytes(pd.kv_bytes_moved),
                    format!("{:.0}%", pd.link_busy_share * 100.0),
                )
            };
            out.push_str(&format!(
                "{:<12} {:<12} {:>7.1}% {:>7.1} ms {:>7.1} ms {:>8.1} ms {:>10.1} ms {:>7} {:>10} {:>9}\n",
                policy.to_string(),
                label,
                r.hit_rate * 100.0,
                r.ttft_p50_ms,
                r.ttft_p95_ms,
                r.decode_stall_p95_ms,
                r.itl_worst_p95_ms,
                remote,
                moved,
                busy
            ));
        }
    }
    out
}

/// The simulate table; with `bound`, a last row for the upper bound and each policy's hit
/// rate as a share of it.
pub fn render_table(reports: &[SimReport], bound: Option<&SimReport>) -> String {
    let mut out = format!(
        "{:<12} {:>8} {:>8} {:>10} {:>10} {:>9} {:>14} {:>8}  {}\n",
        "policy",
        "hit rate",
        "of bound",
        "TTFT p50",
        "TTFT p95",
        "queue p95",
        "groups on one",
        "max/mean",
        "requests per replica"
    );
    let share = |r: &SimReport| match bound {
        Some(b) if b.hit_rate > 0.0 => format!("{:.1}%", 100.0 * r.hit_rate / b.hit_rate),
        _ => "-".to_string(),
    };
    for r in reports.iter().chain(bound) {
        let per: Vec<String> = r
            .requests_per_replica
            .iter()
            .map(ToString::to_string)
            .collect();
        let is_bound = bound.is_some_and(|b| std::ptr::eq(b, r));
        out.push_str(&format!(
            "{:<12} {:>7.1}% {:>8} {:>7.1} ms {:>7.1} ms {:>9.0} {:>14} {:>8}  {}\n",
            r.policy,
            r.hit_rate * 100.0,
            share(r),
            r.ttft_p50_ms,
            r.ttft_p95_ms,
            r.queue_p95,
            format!("{}/{}", r.groups_on_one, r.groups),
            if is_bound {
                "-".to_string()
            } else {
                format!("{:.2}", max_over_mean(&r.requests_per_replica))
            },
            if is_bound {
                "(1 server, unlimited cache)".to_string()
            } else {
                per.join(" ")
            }
        ));
    }
    // Only with `fail` fleet events: the tries Envoy retried away from a failed engine.
    for r in reports.iter().filter(|r| r.failed_tries > 0) {
        out.push_str(&format!(
            "{}: {} tries answered 503 by a failed engine and retried, {} requests failed \
             every try\n",
            r.policy, r.failed_tries, r.failed_requests
        ));
    }
    out
}
