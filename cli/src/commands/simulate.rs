use std::path::PathBuf;

use anyhow::Result;
use prefixroute_core::config::{Policy, Weights};
use prefixroute_core::latency::LatencyConfig;
use prefixroute_sim::replica::ReplicaTiming;
use prefixroute_sim::simulation::{replica_names, upper_bound, SimConfig, SimReport, Simulation};
use prefixroute_sim::summary::max_over_mean;

#[derive(clap::Args)]
pub struct Args {
    /// Trace file (JSONL) from `prefixroute trace`.
    trace: PathBuf,
    /// Policies to compare, comma-separated (latency, prefix, prefix-only, least-queue,
    /// round-robin, random), or `all`.
    #[arg(long, default_value = "all")]
    policy: String,
    #[arg(long, default_value_t = 3)]
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
    let names = replica_names(args.replicas);
    let mut base = SimConfig {
        replicas: args.replicas,
        cache_blocks: args.cache_blocks,
        capacity_reported: !args.capacity_unreported,
        timing: ReplicaTiming {
            lanes: args.slots,
            prefill_ms_per_token: args.prefill_ms_per_token,
            prefill_overhead_ms: args.prefill_overhead_ms,
            decode_ms_per_token: args.decode_ms_per_token,
        },
        ..SimConfig::default()
    };
    base.router.weights = args.weights;
    base.router.hash.block_size = args.block_size;
    base.router.index_capacity_blocks = args.index_capacity_blocks;
    base.router.seed = args.seed;
    base.router.latency.prefill_ms_per_token = args.prior_ms_per_token;
    let mut reports = Vec::new();
    let mut out = String::new();
    for policy in policies {
        let mut config = base;
        config.router.policy = policy;
        let mut sim = Simulation::new(&trace, config)?;
        sim.run();
        if args.show_decisions > 0 && !args.json {
            for step in sim.steps().iter().take(args.show_decisions) {
                let outcome = format!(
                    "  [{} of {} tokens cached, ttft {:.0} ms]",
                    step.served.cached_tokens, step.served.prompt_tokens, step.served.ttft_ms
                );
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
        let json = serde_json::json!({"policies": reports, "upper_bound": bound});
        out += &serde_json::to_string_pretty(&json)?;
        out.push('\n');
    } else {
        out += &render_table(&reports, Some(&bound));
    }
    super::write_stdout(&out)
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
    out
}
