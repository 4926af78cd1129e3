//! `cargo run --release -p host-tests --example profile -- [TOKENS] [cold|warm] [REQUESTS] [ENDPOINTS] [GAP_MS] [MESSAGES] [TEXT] [SHAPE]`:
//! routes REQUESTS chat requests of about TOKENS tokens (default 16384, cold, 300) through one
//! VM with ENDPOINTS endpoints (default 3) and prints the wasm instructions per request and per
//! token, then per request in each callback (`proxy_on_request_body` is the routing decision)
//! with the last request's host calls. GAP_MS (default 1) is the clock's step between requests:
//! a worker that routes a request every 130 ms (a sweep's load on two workers) no longer
//! carries the endpoint records it read (`CARRY_MS`) and reads them again. MESSAGES (one by
//! default) spreads the prompt over that many messages (`host_tests::bench::conversation`: an
//! agent's or a long chat's history, one boundary per message). TEXT `ja` (default `ascii`)
//! puts three Japanese characters before every word after the first: 9 of every ~13 bytes of
//! the prompt are then non-ASCII, and each such character is a token of its own (the plugin's
//! default `non_ascii: pieces`), so there are about four times the tokens. TEXT `lines` breaks
//! the line every twelve words: a `\n` escape every ~50 bytes of the body, as in most real
//! prompts (markdown, code, documents). SHAPE `completions` (default `chat`) sends the same
//! text as a completions body (`host_tests::bench::as_completions`) to `/v1/completions`;
//! `parts` writes every chat content as a list of one text part
//! (`host_tests::bench::as_text_parts`). Cold: each request a
//! new tenant's system prompt (no block matches); warm: one tenant's, a new question each. The
//! bodies are the cost table's (`host_tests::bench::body`).
//!
//! Where the instructions go, by guest function: build the plugin with its names kept, run
//! this under perf with wasmtime's perf map, and read the `[JIT]` rows:
//!
//! ```text
//! CARGO_TARGET_DIR=/tmp/named cargo build -p prefixroute-plugin --target wasm32-wasip1 \
//!   --profile wasm --config 'profile.wasm.package.prefixroute-plugin.strip="none"'
//! PREFIXROUTE_PERF_MAP=1 PREFIXROUTE_PLUGIN_WASM=/tmp/named/wasm32-wasip1/wasm/prefixroute_plugin.wasm \
//!   perf record -o /tmp/perf.data target/release/examples/profile 16384 cold
//! perf report -i /tmp/perf.data --no-children --sort dso,symbol | grep JIT
//! ```
//!
//! LLVM inlines the tokenizer and the chain into the scheduler's `route`; mark the functions
//! of interest `#[inline(never)]` for such a build to see them apart.
//!
//! Where the last request's wasm instructions go, by guest function, counted rather than
//! sampled (`host_tests::execution`; read its caveats): instrument the named build with
//! binaryen, keep its text, and point `PREFIXROUTE_EXECUTION_WAT` at it:
//!
//! ```text
//! wasm-opt -g --all-features --log-execution /tmp/named/wasm32-wasip1/wasm/prefixroute_plugin.wasm -o /tmp/logged.wasm
//! wasm-dis /tmp/logged.wasm -o /tmp/logged.wat
//! PREFIXROUTE_PLUGIN_WASM=/tmp/logged.wasm PREFIXROUTE_EXECUTION_WAT=/tmp/logged.wat \
//!   target/release/examples/profile 1024 warm 200 64 130
//! ```
use host_tests::{Host, Request};

/// What the prompt's words are written in.
#[derive(Clone, Copy)]
enum Text {
    Ascii,
    /// Three Japanese characters before every word after the first.
    Japanese,
    /// ASCII with a line break every twelve words (an escape in the JSON every ~50 bytes, as
    /// in most real prompts: the benchmark bodies have none).
    Lines,
}

/// How the prompt is sent.
#[derive(Clone, Copy)]
enum Shape {
    Chat,
    /// One completions `prompt`: the contents joined.
    Completions,
    /// A chat whose every content is a list of one text part.
    Parts,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("profile: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let tokens: usize = match args.first() {
        Some(t) => t
            .parse()
            .map_err(|_| format!("TOKENS must be a number, not {t:?}"))?,
        None => 16_384,
    };
    let warm = match args.get(1).map(String::as_str) {
        None | Some("cold") => false,
        Some("warm") => true,
        Some(other) => return Err(format!("expected cold or warm, not {other:?}")),
    };
    let requests: usize = match args.get(2) {
        Some(n) => n
            .parse()
            .map_err(|_| format!("REQUESTS must be a number, not {n:?}"))?,
        None => 300,
    };
    let endpoints: usize = match args.get(3) {
        Some(n) => n
            .parse()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("ENDPOINTS must be a number above 0, not {n:?}"))?,
        None => 3,
    };
    let gap_ms: u64 = match args.get(4) {
        Some(g) => g
            .parse()
            .map_err(|_| format!("GAP_MS must be a number, not {g:?}"))?,
        None => 1,
    };
    let messages: usize = match args.get(5) {
        Some(m) => m
            .parse()
            .map_err(|_| format!("MESSAGES must be a number, not {m:?}"))?,
        None => 1,
    };
    let text = match args.get(6).map(String::as_str) {
        None | Some("ascii") => Text::Ascii,
        Some("ja") => Text::Japanese,
        Some("lines") => Text::Lines,
        Some(other) => return Err(format!("TEXT must be ascii, ja or lines, not {other:?}")),
    };
    let shape = match args.get(7).map(String::as_str) {
        None | Some("chat") => Shape::Chat,
        Some("completions") => Shape::Completions,
        Some("parts") => Shape::Parts,
        Some(other) => {
            return Err(format!(
                "SHAPE must be chat, completions or parts, not {other:?}"
            ))
        }
    };
    let host = Host::prefixroute().map_err(|e| format!("{e:#}"))?;
    let config = host_tests::bench::endpoint_config(endpoints).to_string();
    let mut vm = host
        .configured_vm(config.as_bytes())
        .map_err(|e| format!("{e:#}"))?;
    vm.tick().map_err(|e| format!("{e:#}"))?;
    host_tests::bench::scrape_all(&mut vm).map_err(|e| format!("{e:#}"))?;
    // Bodies (and their token counts) are made before the first request, so a profile of the
    // loop is the guest's.
    let mut routed_tokens = 0;
    let mut bodies = Vec::with_capacity(requests);
    for r in 0..requests {
        let tenant = if warm { 1 } else { r };
        let question = format!("question {r}");
        let body = if messages > 1 {
            host_tests::bench::conversation(tenant, tokens, messages, &question)
        } else {
            host_tests::bench::body(tenant, tokens, &question)
        };
        // Only inside the contents: the JSON around them has no " w".
        let body = match text {
            Text::Ascii => body,
            Text::Japanese => String::from_utf8_lossy(&body)
                .replace(" w", " 日本語w")
                .into_bytes(),
            Text::Lines => host_tests::bench::in_lines(&body, host_tests::bench::LINE_WORDS),
        };
        let body = match shape {
            Shape::Chat => body,
            Shape::Completions => host_tests::bench::as_completions(&body),
            Shape::Parts => host_tests::bench::as_text_parts(&body),
        };
        let parsed = prefixroute_core::parse_request(&body).map_err(|e| e.to_string())?;
        routed_tokens +=
            prefixroute_core::hashing::hash_request(&parsed, Default::default()).total_tokens();
        bodies.push(body);
    }
    let mut fuel = 0u64;
    let mut by_callback: std::collections::BTreeMap<&str, u64> = Default::default();
    // The last request's costs, kept whole: the host calls printed are its (formatting them on
    // every request would put the host's work into a `perf` profile of this loop).
    let mut last = None;
    let execution_wat = std::env::var_os("PREFIXROUTE_EXECUTION_WAT");
    for (r, body) in bodies.iter().enumerate() {
        if execution_wat.is_some() && r + 1 == bodies.len() {
            vm.record_execution();
        }
        let rt = vm
            .round_trip(&if matches!(shape, Shape::Completions) {
                Request::post("/v1/completions", body.clone())
            } else {
                Request::chat(body.clone())
            })
            .map_err(|e| format!("{e:#}"))?;
        fuel += rt.costs.total.fuel;
        for (callback, costs) in &rt.costs.by_callback {
            *by_callback.entry(callback).or_default() += costs.fuel;
        }
        last = Some(rt.costs);
        host.clock().advance_ms(gap_ms);
    }
    if let Some(why) = vm.trapped() {
        return Err(format!("the plugin trapped: {why}"));
    }
    let n = bodies.len().max(1) as u64;
    println!(
        "{} requests, {} tokens each ({}): {} instructions per request, {:.1} per token",
        bodies.len(),
        routed_tokens / bodies.len().max(1),
        if warm { "warm" } else { "cold" },
        fuel / n,
        fuel as f64 / routed_tokens.max(1) as f64,
    );
    for (callback, callback_fuel) in by_callback {
        let calls = last
            .as_ref()
            .and_then(|costs| costs.by_callback.get(callback))
            .map(|costs| costs.host_calls.clone())
            .unwrap_or_default();
        println!("  {callback}: {} per request; {calls:?}", callback_fuel / n);
    }
    if let Some(path) = execution_wat {
        let wat = std::fs::read_to_string(&path)
            .map_err(|e| format!("reading {}: {e}", path.to_string_lossy()))?;
        let points = host_tests::execution::points_by_function(&wat);
        let log = vm.take_execution();
        if log.is_empty() {
            return Err(
                "the module logged nothing: is it instrumented with wasm-opt --log-execution?"
                    .into(),
            );
        }
        println!("the last request by guest function (instructions, points reached):");
        for (function, fuel, reached) in host_tests::execution::by_function(&log, &points)
            .iter()
            .take(40)
        {
            println!("  {fuel:>9} {reached:>7}  {function}");
        }
    }
    Ok(())
}
