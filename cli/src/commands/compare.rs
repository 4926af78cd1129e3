use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use prefixroute_sim::summary::max_over_mean;
use prefixroute_sim::trace::{TraceRecord, TraceSpec};
use serde::Serialize;

use super::replay::{replay_records, Summary};
use super::serve::{balancer_for, PluginArgs};
use crate::envoy::{self, Balancer, EnvoyProcess, EnvoySetup};

/// Runs one trace through real Envoy per policy, each time in front of fresh fake vLLM
/// replicas, and compares what the replicas' own counters say.
#[derive(clap::Args)]
pub struct Args {
    /// Trace file (JSONL); default: `prefixroute trace`'s default trace.
    trace: Option<PathBuf>,
    /// Policies to compare: round-robin and least-request are Envoy's own balancers; latency,
    /// prefix, prefix-only, least-queue and random are the plugin's.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "round-robin,least-request,prefix,latency"
    )]
    policies: Vec<String>,
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    /// Prefix-cache capacity of each fake replica, in blocks.
    #[arg(long, default_value_t = 64)]
    kv_blocks: usize,
    #[arg(long, default_value_t = 4)]
    lanes: usize,
    #[arg(long, default_value_t = 5.0)]
    prefill_overhead_ms: f64,
    #[arg(long, default_value_t = 1.0)]
    prefill_ms_per_token: f64,
    #[arg(long, default_value_t = 0.0)]
    decode_ms_per_token: f64,
    #[command(flatten)]
    plugin: PluginArgs,
    /// Envoy worker threads.
    #[arg(long, default_value_t = 2)]
    concurrency: usize,
    #[arg(long)]
    envoy: Option<PathBuf>,
    #[arg(long)]
    plugin_wasm: Option<PathBuf>,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 60.0)]
    timeout_s: f64,
    #[arg(long)]
    json: bool,
}

/// A fake replica child process, stopped when dropped.
struct FakeReplica {
    child: Child,
    name: String,
    addr: SocketAddr,
}

impl Drop for FakeReplica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_replica(args: &Args, name: &str) -> Result<FakeReplica> {
    let exe = std::env::current_exe().context("cannot find the prefixroute binary")?;
    let mut child = Command::new(exe)
        .args(["fake-server", "--port", "0", "--name", name])
        .args(["--kv-blocks", &args.kv_blocks.to_string()])
        .args(["--block-size", &args.plugin.block_size().to_string()])
        .args(["--non-ascii", args.plugin.non_ascii().name()])
        .args(["--lanes", &args.lanes.to_string()])
        .args([
            "--prefill-overhead-ms",
            &args.prefill_overhead_ms.to_string(),
        ])
        .args([
            "--prefill-ms-per-token",
            &args.prefill_ms_per_token.to_string(),
        ])
        .args([
            "--decode-ms-per-token",
            &args.decode_ms_per_token.to_string(),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot start a fake replica")?;
    let stderr = child.stderr.take().context("no stderr")?;
    let mut lines = BufReader::new(stderr).lines();
    let addr = loop {
        let Some(line) = lines.next() else {
            bail!("fake replica {name} exited before listening");
        };
        let line = line?;
        if let Some((_, url)) = line.split_once("listening on http://") {
            break url.trim().parse::<SocketAddr>()?;
        }
    };
    // Keep draining so the child never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines.by_ref() {});
    Ok(FakeReplica {
        child,
        name: name.to_string(),
        addr,
    })
}

#[derive(Serialize)]
struct Row {
    policy: String,
    summary: Summary,
    /// Counters the plugin defines in Envoy (`prefixroute.*`), when the plugin ran.
    plugin_stats: Vec<(String, u64)>,
}

fn plugin_stats(envoy: &EnvoyProcess) -> Vec<(String, u64)> {
    envoy
        .stats()
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("prefixroute"))
        .filter_map(|l| {
            let (name, value) = l.split_once(": ")?;
            Some((name.to_string(), value.trim().parse().ok()?))
        })
        .collect()
}

fn run_policy(args: &Args, policy: &str, trace: &[TraceRecord], label: &str) -> Result<Row> {
    let (balancer, core_policy) = balancer_for(policy)?;
    let replicas = (0..args.replicas)
        .map(|i| start_replica(args, &format!("replica-{i}")))
        .collect::<Result<Vec<_>>>()?;
    let endpoints: Vec<String> = replicas
        .iter()
        .map(|r| format!("{}=http://{}", r.name, r.addr))
        .collect();
    let endpoints = super::serve::endpoints(&endpoints)?;
    let plugin = args.plugin.config(&endpoints, core_policy)?;
    let setup = EnvoySetup {
        listen: SocketAddr::from(([127, 0, 0, 1], envoy::free_port()?)),
        admin: SocketAddr::from(([127, 0, 0, 1], envoy::free_port()?)),
        balancer,
        wasm_path: if balancer == Balancer::Plugin {
            envoy::find_plugin(args.plugin_wasm.as_deref())?
        } else {
            PathBuf::new()
        },
        kv_relay: args.plugin.kv_relay()?,
        plugin,
        pool: envoy::Pool::Static(endpoints),
        access_log: None,
    };
    let work = std::env::temp_dir().join(format!(
        "prefixroute-compare-{}-{policy}",
        std::process::id()
    ));
    std::fs::create_dir_all(&work)?;
    let envoy_bin = envoy::find_envoy(args.envoy.as_deref())?;
    let envoy = EnvoyProcess::start(&envoy_bin, &setup, args.concurrency, &work)?;
    if balancer == Balancer::Plugin {
        // Let the first scrapes land so the first decisions see measured endpoints.
        std::thread::sleep(Duration::from_millis(
            2 * setup.plugin.scrape.interval_ms + 100,
        ));
    }
    let metrics: Vec<String> = replicas
        .iter()
        .map(|r| format!("{}=http://{}", r.name, r.addr))
        .collect();
    let summary = replay_records(
        label,
        trace,
        &format!("http://{}", setup.listen),
        &metrics,
        Duration::from_secs_f64(args.timeout_s),
        Duration::from_secs(10),
    )
    .with_context(|| {
        format!(
            "replaying through Envoy ({policy}); Envoy log: {}",
            envoy.log_path.display()
        )
    })?;
    let row = Row {
        policy: policy.to_string(),
        summary,
        plugin_stats: plugin_stats(&envoy),
    };
    // The configuration and Envoy's log are kept only when the run failed (the error names
    // the log); a finished run removes them.
    drop(envoy);
    let _ = std::fs::remove_dir_all(&work);
    Ok(row)
}

fn render(rows: &[Row], replicas: usize) -> String {
    let mut out = format!(
        "{:<14} {:>8} {:>6} {:>15} {:>11} {:>11} {:>14} {:>8}  {}\n",
        "policy",
        "requests",
        "errors",
        "server hit rate",
        "latency p50",
        "latency p95",
        "groups on one",
        "max/mean",
        "requests per replica"
    );
    for row in rows {
        let s = &row.summary;
        let counts: Vec<usize> = (0..replicas)
            .map(|i| {
                s.endpoints
                    .get(&format!("replica-{i}"))
                    .copied()
                    .unwrap_or(0)
            })
            .collect();
        let hit = s
            .server_counters
            .as_ref()
            .and_then(|c| c.hit_rate)
            .map_or("-".to_string(), |h| format!("{:.1}%", h * 100.0));
        let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1} ms"));
        out.push_str(&format!(
            "{:<14} {:>8} {:>6} {:>15} {:>11} {:>11} {:>14} {:>8.2}  {}\n",
            row.policy,
            s.requests,
            s.errors,
            hit,
            ms(s.latency_ms.p50),
            ms(s.latency_ms.p95),
            format!(
                "{}/{}",
                s.groups_on_one_endpoint.single, s.groups_on_one_endpoint.groups
            ),
            max_over_mean(&counts),
            counts
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(" ")
        ));
    }
    out
}

pub fn run(args: Args) -> Result<()> {
    anyhow::ensure!(args.replicas >= 1, "--replicas must be at least 1");
    let (trace, label) = match &args.trace {
        Some(path) => (super::read_trace(path)?, path.display().to_string()),
        None => (
            TraceSpec::default().generate()?,
            "default trace".to_string(),
        ),
    };
    for policy in &args.policies {
        balancer_for(policy)?;
    }
    let mut rows = Vec::new();
    for policy in &args.policies {
        if !args.json {
            eprintln!(
                "running {} requests through Envoy with {policy} ...",
                trace.len()
            );
        }
        rows.push(run_policy(&args, policy, &trace, &label)?);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!(
            "{} requests, {} fake vLLM replicas ({} cache blocks of {} tokens each), real Envoy with {} workers\n",
            trace.len(),
            args.replicas,
            args.kv_blocks,
            args.plugin.block_size(),
            args.concurrency
        );
        print!("{}", render(&rows, args.replicas));
        println!("\nserver hit rate: the replicas' own vllm:prefix_cache_hits_total / queries_total over the run");
    }
    Ok(())
}
