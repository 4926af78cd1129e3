use std::path::PathBuf;

use anyhow::Result;
use prefixroute_core::config::{Policy, Weights};
use prefixroute_core::replica::ReplicaTiming;
use prefixroute_core::sim::{replica_names, SimConfig, SimReport, Simulation};
use prefixroute_core::stats::max_over_mean;

#[derive(clap::Args)]
pub struct Args {
    /// Trace file (JSONL) from `prefixroute trace`.
    trace: PathBuf,
    /// A policy (prefix, prefix-only, least-queue, round-robin, random) or `all`.
    #[arg(long, default_value = "all")]
    policy: String,
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    /// Prefix-cache capacity of each replica, in blocks.
    #[arg(long, default_value_t = 64)]
    cache_blocks: usize,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Concurrent sequences per replica.
    #[arg(long, default_value_t = ReplicaTiming::default().lanes)]
    slots: usize,
    #[arg(long, default_value_t = ReplicaTiming::default().prefill_ms_per_token)]
    prefill_ms_per_token: f64,
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
        vec![args.policy.parse()?]
    };
    let names = replica_names(args.replicas);
    let mut reports = Vec::new();
    for policy in policies {
        let mut config = SimConfig {
            replicas: args.replicas,
            cache_blocks: args.cache_blocks,
            timing: ReplicaTiming {
                lanes: args.slots,
                prefill_ms_per_token: args.prefill_ms_per_token,
                decode_ms_per_token: args.decode_ms_per_token,
                ..ReplicaTiming::default()
            },
            ..SimConfig::default()
        };
        config.router.policy = policy;
        config.router.weights = args.weights;
        config.router.hash.block_size = args.block_size;
        config.router.seed = args.seed;
        let mut sim = Simulation::new(&trace, config)?;
        sim.run();
        if args.show_decisions > 0 && !args.json {
            for step in sim.steps().iter().take(args.show_decisions) {
                let outcome = format!(
                    "  [{} of {} tokens cached, ttft {:.0} ms]",
                    step.served.cached_tokens, step.served.prompt_tokens, step.served.ttft_ms
                );
                println!("{}{}", step.summary(&names), outcome);
            }
            println!();
        }
        reports.push(sim.report());
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    } else {
        print!("{}", render_table(&reports));
    }
    Ok(())
}

pub fn render_table(reports: &[SimReport]) -> String {
    let mut out = format!(
        "{:<12} {:>8} {:>10} {:>10} {:>9} {:>14} {:>8}  {}\n",
        "policy",
        "hit rate",
        "TTFT p50",
        "TTFT p95",
        "queue p95",
        "groups on one",
        "max/mean",
        "requests per replica"
    );
    for r in reports {
        let per: Vec<String> = r
            .requests_per_replica
            .iter()
            .map(ToString::to_string)
            .collect();
        out.push_str(&format!(
            "{:<12} {:>7.1}% {:>7.1} ms {:>7.1} ms {:>9.0} {:>14} {:>8.2}  {}\n",
            r.policy,
            r.hit_rate * 100.0,
            r.ttft_p50_ms,
            r.ttft_p95_ms,
            r.queue_p95,
            format!("{}/{}", r.groups_on_one, r.groups),
            max_over_mean(&r.requests_per_replica),
            per.join(" ")
        ));
    }
    out
}
