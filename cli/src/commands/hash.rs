use std::io::Read;

use anyhow::{Context, Result};
use prefixroute_core::config::IndexMode;
use prefixroute_core::hashing::{hash_request, BlockIdentity, HashConfig};
use prefixroute_core::request::{parse_request, ParsedRequest, Prompt};
use prefixroute_core::tokenizer::NonAscii;

#[derive(clap::Args)]
pub struct Args {
    /// Model name in the hash seed (overrides the body's `model`).
    #[arg(long)]
    model: Option<String>,
    /// cache_salt in the hash seed (overrides the body's `cache_salt`).
    #[arg(long)]
    salt: Option<String>,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Leave out the final partial block, as a server's cache does.
    #[arg(long)]
    full_blocks_only: bool,
    /// Characters outside ASCII: one token each (`pieces`) or skipped (`skip`, as
    /// llm-d-inference-sim does); the plugin's `non_ascii`.
    #[arg(long, default_value = "pieces")]
    non_ascii: NonAscii,
    /// The plugin's `index`: `approximate` hashes each block's text (the router's own
    /// identity), `precise` its token ids as the servers do (what their KV events carry).
    #[arg(long, default_value = "approximate", value_parser = str::parse::<IndexMode>)]
    index: IndexMode,
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<()> {
    anyhow::ensure!(args.block_size >= 1, "--block-size must be at least 1");
    let mut input = Vec::new();
    std::io::stdin()
        .read_to_end(&mut input)
        .context("cannot read stdin")?;
    // A JSON object is an OpenAI body; anything else is the prompt text itself.
    let looks_like_body = input.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    let mut request = if looks_like_body {
        parse_request(&input)
            .context("stdin looks like a JSON body but is not a valid OpenAI request")?
    } else {
        let text = String::from_utf8(input).context("stdin is not UTF-8 text")?;
        ParsedRequest {
            model: String::new(),
            cache_salt: None,
            prompts: vec![Prompt::Text(text)],
            boundaries: Vec::new(),
            stream: false,
            max_tokens: None,
        }
    };
    if let Some(model) = args.model {
        request.model = model;
    }
    if args.salt.is_some() {
        request.cache_salt = args.salt;
    }
    let config = HashConfig {
        block_size: args.block_size,
        include_partial: !args.full_blocks_only,
        non_ascii: args.non_ascii,
        identity: args.index.block_identity(),
    };
    let hashes = hash_request(&request, config);
    if args.json {
        let chains: Vec<Vec<String>> = hashes
            .chains
            .iter()
            .map(|c| c.iter().map(|h| format!("{h:016x}")).collect())
            .collect();
        let out = serde_json::json!({
            "model": request.model,
            "cache_salt": request.cache_salt,
            "block_size": args.block_size,
            "identity": config.identity,
            "tokens": hashes.tokens,
            "blocks": hashes.total_blocks(),
            "hashes": chains,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let identity = match config.identity {
        BlockIdentity::Text => "text",
        BlockIdentity::TokenIds => "token ids",
    };
    println!(
        "model: {:?}  cache_salt: {:?}  block size: {}  blocks hashed by: {identity}",
        request.model,
        request.cache_salt.unwrap_or_default(),
        args.block_size
    );
    for (i, (chain, tokens)) in hashes.chains.iter().zip(&hashes.tokens).enumerate() {
        if hashes.chains.len() > 1 {
            println!("prompt {i}:");
        }
        println!("tokens: {tokens}  blocks: {}", chain.len());
        for (b, h) in chain.iter().enumerate() {
            let partial = (b + 1) * args.block_size > *tokens;
            println!(
                "{b:>5}  {h:016x}{}",
                if partial { "  (partial)" } else { "" }
            );
        }
    }
    Ok(())
}
