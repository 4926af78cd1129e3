//! One module per subcommand; each only adapts I/O to `prefixroute-core`.

mod compare;
mod disagg;
mod fake_server;
mod hash;
mod kv_events;
mod pool;
mod replay;
mod serve;
mod simulate;
mod trace;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "prefixroute", version, about = "Prefix-cache-aware routing for LLM replicas", long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a synthetic request trace (JSONL).
    Trace(trace::Args),
    /// Replay a trace through the router in front of simulated vLLM replicas.
    Simulate(simulate::Args),
    /// Prefill/decode disaggregation calculator.
    Disagg(disagg::Args),
    /// Print the tokens and block hashes of a prompt or OpenAI body read from stdin.
    Hash(hash::Args),
    /// Run a vLLM look-alike replica (OpenAI API, /metrics, real prefix cache, fake timing).
    FakeServer(fake_server::Args),
    /// Replay a trace against a live endpoint at its timestamps and report cache hits.
    Replay(replay::Args),
    /// Compare routing policies through real Envoy in front of fresh fake replicas.
    Compare(compare::Args),
    /// Run Envoy in front of model servers with the prefixroute plugin (or Envoy's balancers).
    Serve(serve::Args),
    /// Validate InferencePools by the CRD's rules and resolve their endpoints.
    Pool(pool::Args),
    /// Relay the servers' KV-cache events (vLLM's ZMQ publishers) to the plugin.
    KvEvents(kv_events::Args),
}

pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Trace(args) => trace::run(args),
        Command::Simulate(args) => simulate::run(args),
        Command::Disagg(args) => disagg::run(args),
        Command::Hash(args) => hash::run(args),
        Command::FakeServer(args) => fake_server::run(args),
        Command::Replay(args) => replay::run(args),
        Command::Pool(args) => pool::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Compare(args) => compare::run(args),
        Command::KvEvents(args) => kv_events::run(args),
    }
}

/// Writes a command's output to stdout. A closed pipe (`| head`) is the reader's choice, not
/// an error (and not a panic, which `println!` would make of it).
pub(crate) fn write_stdout(text: &str) -> Result<()> {
    use anyhow::Context;
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other.context("cannot write to stdout"),
    }
}

/// Reads a trace file with the file name in every error.
pub(crate) fn read_trace(
    path: &std::path::Path,
) -> Result<Vec<prefixroute_sim::trace::TraceRecord>> {
    use anyhow::Context;
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read trace {}", path.display()))?;
    let records = prefixroute_sim::trace::parse_jsonl(&text)
        .with_context(|| format!("bad trace {}", path.display()))?;
    anyhow::ensure!(
        !records.is_empty(),
        "trace {} has no requests",
        path.display()
    );
    Ok(records)
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// Clap's own consistency checks (unique flag names across flattened groups, …), which it
    /// otherwise runs only when a command is parsed.
    #[test]
    fn every_command_line_is_well_formed() {
        super::Cli::command().debug_assert();
    }
}
