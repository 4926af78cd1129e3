use std::path::PathBuf;

use anyhow::{Context, Result};
use prefixroute_sim::trace::{to_jsonl, Script, TraceShape, TraceSpec};

#[derive(clap::Args)]
pub struct Args {
    /// Output file (JSONL); `-` for stdout.
    #[arg(short, long)]
    output: PathBuf,
    /// What the trace exercises.
    #[arg(long, value_enum, default_value = "tenants")]
    shape: Shape,
    /// Groups: tenants, conversations or documents (unused by `unique`; `mixed`: as many
    /// tenants as conversations).
    #[arg(long, default_value_t = 8)]
    tenants: usize,
    /// Words in each tenant's system prompt (or each document).
    #[arg(long, default_value_t = 180)]
    prompt_words: usize,
    #[arg(long, default_value_t = 12)]
    question_words: usize,
    /// Mean requests per second (Poisson); 0 = back to back.
    #[arg(long, default_value_t = 20.0)]
    rate: f64,
    #[arg(long, default_value_t = 64)]
    requests: usize,
    /// Share of traffic for tenant 0 (0..1).
    #[arg(long)]
    hot: Option<f64>,
    /// Conversations end after this many turns and a new one takes the slot (`conversations`
    /// and `mixed`); without it they grow for the whole trace.
    #[arg(long)]
    turns: Option<usize>,
    #[arg(long, default_value = "cc-sim")]
    model: String,
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    /// Ask for streamed answers (`"stream": true`): `replay` then times each answer's first
    /// token (`ttft_ms`) apart from its decoding.
    #[arg(long)]
    stream: bool,
    /// The prompts' writing system: English-like words (`latin`) or the same text in Chinese
    /// characters (`han`), to see how a router handles prompts that are not ASCII.
    #[arg(long, value_enum, default_value = "latin")]
    script: ScriptArg,
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ScriptArg {
    Latin,
    Han,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Shape {
    Tenants,
    Conversations,
    Rag,
    /// Nothing shared: every request a new prompt.
    Unique,
    /// Tenants' questions and conversations on one gateway, half the requests each.
    Mixed,
}

pub fn run(args: Args) -> Result<()> {
    let spec = TraceSpec {
        shape: match args.shape {
            Shape::Tenants => TraceShape::Tenants,
            Shape::Conversations => TraceShape::Conversations,
            Shape::Rag => TraceShape::Rag,
            Shape::Unique => TraceShape::Unique,
            Shape::Mixed => TraceShape::Mixed,
        },
        tenants: args.tenants,
        prompt_words: args.prompt_words,
        question_words: args.question_words,
        rate: args.rate,
        requests: args.requests,
        hot: args.hot,
        turns: args.turns,
        model: args.model,
        max_tokens: args.max_tokens,
        stream: args.stream,
        script: match args.script {
            ScriptArg::Latin => Script::Latin,
            ScriptArg::Han => Script::Han,
        },
        seed: args.seed,
    };
    let records = spec.generate()?;
    let text = to_jsonl(&records);
    if args.output.as_os_str() == "-" {
        super::write_stdout(&text)?;
    } else {
        std::fs::write(&args.output, text)
            .with_context(|| format!("cannot write {}", args.output.display()))?;
        eprintln!(
            "wrote {} requests to {}",
            records.len(),
            args.output.display()
        );
    }
    Ok(())
}
