use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use prefixroute_core::config::{
    EndpointConfig, IndexMode, Placement, PluginConfig, Policy, Weights,
};
use prefixroute_core::latency::LatencyConfig;
use prefixroute_core::tokenizer::NonAscii;

use crate::envoy::{self, Balancer, EnvoySetup, Pool};

/// Envoy in front of model servers, routing with the prefixroute plugin (or, to compare like
/// for like, with Envoy's own round-robin or least-request balancer).
#[derive(clap::Args)]
pub struct Args {
    /// Where clients connect.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Envoy's admin interface (keep it on loopback).
    #[arg(long, default_value = "127.0.0.1:9901")]
    admin: SocketAddr,
    /// A model server: NAME=http://IP:PORT (repeat for each replica). The pool cluster's
    /// members; the plugin discovers them from Envoy (see --static-pool).
    #[arg(
        long = "endpoint",
        required_unless_present = "eds_file",
        conflicts_with = "eds_file"
    )]
    endpoints: Vec<String>,
    /// Take the pool from this EDS file instead (a ClusterLoadAssignment for
    /// `prefixroute_pool`, YAML or JSON). Envoy watches it: write a new file next to it and
    /// rename it over to change the pool while serving.
    #[arg(long, value_name = "PATH")]
    eds_file: Option<PathBuf>,
    /// latency, prefix, prefix-only, least-queue, random (the plugin), or round-robin,
    /// least-request (Envoy's own balancers, no plugin).
    #[arg(long, default_value = "latency")]
    policy: String,
    #[command(flatten)]
    plugin: PluginArgs,
    /// Envoy binary (default: $ENVOY, envoy on PATH, or .venv/bin/envoy).
    #[arg(long)]
    envoy: Option<PathBuf>,
    /// The plugin .wasm (default: the release build in the target directory).
    #[arg(long)]
    plugin_wasm: Option<PathBuf>,
    /// Envoy worker threads.
    #[arg(long, default_value_t = 2)]
    concurrency: usize,
    /// Print the Envoy configuration and exit.
    #[arg(long)]
    print_config: bool,
    /// Have Envoy write an access log line per request to PATH (JSON: the request, the
    /// endpoint the plugin chose, and where its time went in microseconds: receiving it,
    /// routing it, the server, the response).
    #[arg(long, value_name = "PATH")]
    access_log: Option<PathBuf>,
}

/// The plugin's options (its JSON configuration, flag by flag).
#[derive(clap::Args, Clone)]
pub struct PluginArgs {
    /// Scorer weights of the prefix policy.
    #[arg(long, default_value_t = Weights::default())]
    weights: Weights,
    /// The latency policy's prior prefill cost per uncached token (it learns the real one).
    #[arg(long, default_value_t = LatencyConfig::default().prefill_ms_per_token)]
    prior_ms_per_token: f64,
    /// The latency policy's fixed time per request besides prefill.
    #[arg(long, default_value_t = LatencyConfig::default().overhead_ms)]
    overhead_ms: f64,
    /// The most sequences the latency policy assumes a replica prefills at once (it learns
    /// how many do; 1 = one compute-bound batch from the start).
    #[arg(long, default_value_t = LatencyConfig::default().lanes)]
    prior_lanes: u32,
    /// A prefix busier than one replica's fair share gets another copy once its holders have
    /// taken more than this many times the mean replica's recent requests; 0 turns it off.
    #[arg(long, default_value_t = LatencyConfig::default().balance_factor)]
    balance_factor: f64,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Characters outside ASCII: one token each (`pieces`), or skipped as llm-d-inference-sim
    /// does (`skip`: what `--index precise` in front of it needs).
    #[arg(long, default_value = "pieces")]
    non_ascii: NonAscii,
    /// Index capacity per endpoint, in blocks.
    #[arg(long, default_value_t = prefixroute_core::index::DEFAULT_CAPACITY_BLOCKS)]
    index_capacity: usize,
    #[arg(long, default_value_t = 1000)]
    scrape_interval_ms: u64,
    #[arg(long, default_value_t = 500)]
    scrape_timeout_ms: u64,
    #[arg(long, default_value_t = 5000)]
    stale_after_ms: u64,
    /// Consecutive failed scrapes that take an endpoint out of rotation.
    #[arg(long, default_value_t = 2)]
    failures_to_down: u32,
    /// Header that carries the chosen ip:port to Envoy.
    #[arg(long, default_value = prefixroute_core::config::DEFAULT_DESTINATION_HEADER)]
    header: String,
    #[arg(long, default_value_t = 4 << 20)]
    max_body_bytes: usize,
    #[arg(long, default_value = "vllm:")]
    metric_prefix: String,
    /// Only count metric series of this model (model_name label).
    #[arg(long)]
    model: Option<String>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Next-best replicas listed after the chosen one in the destination header; the route
    /// retries connect failures and resets on them, in order.
    #[arg(long, default_value_t = 2)]
    failover: usize,
    /// How often the plugin reads the pool's members from Envoy's admin interface.
    #[arg(long, default_value_t = 1000)]
    discovery_interval_ms: u64,
    /// Give the plugin the --endpoint list itself instead of discovering the pool cluster
    /// (the pool then cannot change without a new configuration).
    #[arg(long)]
    static_pool: bool,
    /// The router's belief: `approximate` (what it sent where) or `precise` (the servers' KV
    /// events through `prefixroute kv-events`; needs --kv-relay).
    #[arg(long, default_value = "approximate", value_parser = str::parse::<IndexMode>)]
    index: IndexMode,
    /// `local`, or `consistent` when several gateways route to this pool with `--index
    /// approximate`: every group also gets a home all of them compute alike.
    #[arg(long, default_value = "local", value_parser = str::parse::<Placement>)]
    placement: Placement,
    /// Where `prefixroute kv-events` serves its feed (`--listen` there), for --index precise.
    #[arg(long, value_name = "IP:PORT")]
    kv_relay: Option<SocketAddr>,
    /// How often the plugin fetches the relay's feed (--index precise) when it does not long
    /// poll, and after a failed fetch.
    #[arg(long, default_value_t = 200)]
    kv_interval_ms: u64,
    /// How long the relay may hold a fetch with nothing new (a long poll: a change reaches the
    /// gateway within milliseconds); 0 polls every --kv-interval-ms.
    #[arg(long, default_value_t = 1000)]
    kv_wait_ms: u64,
}

impl PluginArgs {
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn non_ascii(&self) -> NonAscii {
        self.non_ascii
    }

    /// The relay's address for --index precise (an error without it).
    pub fn kv_relay(&self) -> Result<Option<SocketAddr>> {
        match (self.index, self.kv_relay) {
            (IndexMode::Precise, None) => {
                anyhow::bail!(
                    "--index precise needs --kv-relay IP:PORT (prefixroute kv-events --listen)"
                )
            }
            (IndexMode::Approximate, Some(_)) => {
                anyhow::bail!("--kv-relay is only used with --index precise")
            }
            (_, relay) => Ok(relay),
        }
    }

    /// The plugin configuration for a pool of these endpoints, validated as the plugin will:
    /// discovery of the pool cluster, or (`--static-pool`) the list itself.
    pub fn config(&self, endpoints: &[EndpointConfig], policy: Policy) -> Result<PluginConfig> {
        let (endpoints, discovery) = if self.static_pool {
            anyhow::ensure!(
                !endpoints.is_empty(),
                "--static-pool needs the --endpoint list (an EDS file's pool can only be discovered)"
            );
            (endpoints.to_vec(), None)
        } else {
            (
                Vec::new(),
                Some(envoy::discovery(self.discovery_interval_ms)),
            )
        };
        let mut config = PluginConfig {
            endpoints,
            discovery,
            failover: self.failover,
            index: self.index,
            consistent_placement: self.placement == Placement::Consistent,
            policy,
            weights: self.weights,
            block_size: self.block_size,
            non_ascii: self.non_ascii,
            index_capacity_blocks: self.index_capacity,
            destination_header: self.header.clone(),
            max_body_bytes: self.max_body_bytes,
            metric_prefix: self.metric_prefix.clone(),
            model: self.model.clone(),
            seed: self.seed,
            ..PluginConfig::default()
        };
        config.latency.prefill_ms_per_token = self.prior_ms_per_token;
        config.latency.overhead_ms = self.overhead_ms;
        config.latency.lanes = self.prior_lanes;
        config.latency.balance_factor = self.balance_factor;
        config.scrape.interval_ms = self.scrape_interval_ms;
        config.scrape.timeout_ms = self.scrape_timeout_ms;
        config.scrape.stale_after_ms = self.stale_after_ms;
        config.scrape.failures_to_down = self.failures_to_down;
        config.kv_events.interval_ms = self.kv_interval_ms;
        config.kv_events.wait_ms = self.kv_wait_ms;
        config.validate().context("invalid plugin options")?;
        Ok(config)
    }
}

/// `round-robin` and `least-request` mean Envoy's balancers; every other name is a plugin
/// policy.
pub fn balancer_for(policy: &str) -> Result<(Balancer, Policy)> {
    Ok(match policy {
        "round-robin" | "envoy-round-robin" => (Balancer::EnvoyRoundRobin, Policy::RoundRobin),
        "least-request" | "envoy-least-request" => (Balancer::EnvoyLeastRequest, Policy::LeastQueue),
        name => (Balancer::Plugin, name.parse::<Policy>().map_err(|_| {
            anyhow::anyhow!("unknown policy {name:?} (expected latency, prefix, prefix-only, least-queue, random, round-robin or least-request)")
        })?),
    })
}

/// Parses `--endpoint NAME=http://IP:PORT` specs.
pub fn endpoints(specs: &[String]) -> Result<Vec<EndpointConfig>> {
    specs.iter().map(|e| envoy::parse_endpoint(e)).collect()
}

/// `--access-log`, absolute (Envoy runs from anywhere) and in a directory that exists (Envoy
/// would refuse to start, with a message about its configuration, not about this flag).
fn access_log_path(path: &Path) -> Result<PathBuf> {
    let path =
        std::path::absolute(path).with_context(|| format!("--access-log {}", path.display()))?;
    let dir = path.parent().unwrap_or(Path::new("/"));
    anyhow::ensure!(
        dir.is_dir(),
        "--access-log {}: no such directory {}",
        path.display(),
        dir.display()
    );
    Ok(path)
}

pub fn run(args: Args) -> Result<()> {
    let (balancer, policy) = balancer_for(&args.policy)?;
    let endpoints = endpoints(&args.endpoints)?;
    let plugin = args.plugin.config(&endpoints, policy)?;
    let pool = match &args.eds_file {
        Some(path) => {
            let path = std::path::absolute(path)
                .with_context(|| format!("--eds-file {}", path.display()))?;
            anyhow::ensure!(
                path.is_file(),
                "--eds-file {}: no such file",
                path.display()
            );
            Pool::EdsFile(path)
        }
        None => Pool::Static(endpoints),
    };
    let wasm_path = if balancer == Balancer::Plugin {
        envoy::find_plugin(args.plugin_wasm.as_deref())?
    } else {
        PathBuf::new()
    };
    let setup = EnvoySetup {
        listen: args.listen,
        admin: args.admin,
        balancer,
        kv_relay: args.plugin.kv_relay()?,
        plugin,
        pool,
        wasm_path,
        access_log: args
            .access_log
            .as_deref()
            .map(access_log_path)
            .transpose()?,
    };
    if args.print_config {
        print!("{}", envoy::bootstrap_yaml(&setup)?);
        return Ok(());
    }
    let envoy_bin = envoy::find_envoy(args.envoy.as_deref())?;
    let bootstrap = envoy::bootstrap_yaml(&setup)?;
    let pool = match &setup.pool {
        Pool::Static(endpoints) => format!("{} endpoints", endpoints.len()),
        Pool::EdsFile(path) => format!("the pool in {}", path.display()),
    };
    eprintln!(
        "prefixroute serve: {} ({}) on http://{} with {pool}; admin http://{}; \
         the same command with --print-config prints Envoy's configuration",
        args.policy,
        envoy_bin.display(),
        args.listen,
        args.admin,
    );
    // Envoy runs in the foreground in place of this process, so signals reach it directly.
    // Its configuration goes on its command line: a file written here would outlive the
    // process with no one left to remove it (one directory per run in the temp dir).
    use std::os::unix::process::CommandExt;
    let err = std::process::Command::new(&envoy_bin)
        .args(envoy::envoy_args(
            envoy::Bootstrap::Inline(&bootstrap),
            args.concurrency,
        ))
        .exec();
    Err(err).with_context(|| format!("cannot run {}", envoy_bin.display()))
}
