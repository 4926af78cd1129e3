//! The cost benchmark: instructions and host calls per routed request, by prompt size, cache
//! state, text (one line or lines) and endpoint count. Counts, not timings: they are exact and repeat run to run, so they
//! serve as a regression budget. Run by `cargo bench -p host-tests` and, without building
//! wasmtime under the release profile, by `cargo run -p host-tests --example costs`.

use serde_json::json;

use crate::{CalloutReply, ContextCosts, Costs, Fuel, Host, HostOptions, Plugin, Request, Vm};

/// One measured request.
#[derive(Debug, Clone)]
pub struct Row {
    pub endpoints: usize,
    pub target_tokens: usize,
    /// Tokens and blocks as core counts them for this body.
    pub tokens: usize,
    pub blocks: usize,
    pub warm: bool,
    /// The prompt broken into lines ([`in_lines`]).
    pub lines: bool,
    /// `x-prefixroute-match` of the request.
    pub matched: String,
    pub body_bytes: usize,
    pub costs: ContextCosts,
    /// Bytes the guest moved with `memory.copy` and `memory.fill` (each of which `costs`
    /// counts as one instruction): the same request measured with fuel that also prices them
    /// per byte, less `costs`.
    pub bulk_bytes: u64,
}

/// Costs of the root context's periodic work.
#[derive(Debug, Clone)]
pub struct TickRow {
    pub endpoints: usize,
    /// A tick that claims and sends every endpoint's scrape.
    pub scrape_tick: Costs,
    /// A tick with nothing due (heartbeat and gauges only).
    pub idle_tick: Costs,
    /// One scrape response (`proxy_on_http_call_response` with a vLLM page).
    pub response: Costs,
}

pub const ENDPOINTS: [usize; 3] = [3, 16, 64];
pub const TOKENS: [usize; 4] = [64, 1024, 4096, 16384];

/// The configuration of `n` endpoints the cost table routes over.
pub fn endpoint_config(n: usize) -> serde_json::Value {
    let endpoints: Vec<_> = (0..n)
        .map(|i| json!({"name": format!("r{i}"), "address": format!("10.2.{}.{}:8000", i / 200, i % 200 + 1)}))
        .collect();
    json!({"endpoints": endpoints, "block_size": 16, "seed": 1})
}

/// The metrics page every endpoint answers its scrapes with.
pub const PAGE: &str = "vllm:num_requests_waiting{model_name=\"m\"} 1\n\
                    vllm:num_requests_running{model_name=\"m\"} 2\n\
                    vllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\n";

/// Answers every scrape the VM has sent with [`PAGE`].
pub fn scrape_all(vm: &mut Vm) -> wasmtime::Result<()> {
    for c in vm.pending_callouts() {
        vm.answer_callout(c.token, CalloutReply::ok(PAGE))?;
    }
    Ok(())
}

/// A chat body whose system prompt is `tokens` one-token words (less the chat markup),
/// starting with the tenant's name so every tenant has its own chain.
pub fn body(tenant: usize, tokens: usize, question: &str) -> Vec<u8> {
    let words: Vec<String> = (0..tokens.saturating_sub(24))
        .map(|i| format!("w{}", (i * 7 + tenant) % 97))
        .collect();
    let system = format!("tenant{tenant} {}", words.join(" "));
    json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question}
        ]
    })
    .to_string()
    .into_bytes()
}

/// Words per line of [`in_lines`] in the cost table: a line break every ~50 bytes of its
/// prompts.
pub const LINE_WORDS: usize = 12;

/// `body` (one of [`body`] or [`conversation`]) with its contents broken into lines: every
/// `words`-th space between words a line break, which the JSON writes `\n`. Most real prompts
/// are lines (markdown, code, documents, a chat's history), and each escape is a stop for the
/// plugin's reader; the bodies above have none.
pub fn in_lines(body: &[u8], words: usize) -> Vec<u8> {
    // Only inside the contents: the JSON around them has no " w".
    let json = String::from_utf8_lossy(body);
    let mut lines = String::with_capacity(json.len());
    for (i, part) in json.split(" w").enumerate() {
        if i > 0 {
            lines.push_str(if i % words.max(1) == 0 { "\\nw" } else { " w" });
        }
        lines.push_str(part);
    }
    lines.into_bytes()
}

/// A chat body (one of [`body`], [`conversation`]) as a completions body: its messages'
/// contents joined by spaces into one `prompt`, the same model.
pub fn as_completions(chat: &[u8]) -> Vec<u8> {
    let chat: serde_json::Value = serde_json::from_slice(chat).expect("a benchmark chat body");
    let contents: Vec<&str> = chat["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["content"].as_str())
        .collect();
    json!({"model": chat["model"], "prompt": contents.join(" ")})
        .to_string()
        .into_bytes()
}

/// A chat body with every string content written as a list of one text part
/// (`[{"type": "text", "text": …}]`), as some SDKs and frameworks send it.
pub fn as_text_parts(chat: &[u8]) -> Vec<u8> {
    let mut chat: serde_json::Value = serde_json::from_slice(chat).expect("a benchmark chat body");
    for message in chat["messages"].as_array_mut().into_iter().flatten() {
        if let Some(text) = message["content"].as_str() {
            message["content"] = json!([{"type": "text", "text": text}]);
        }
    }
    chat.to_string().into_bytes()
}

/// [`body`] as a conversation: the same system prompt's words spread over `messages` messages
/// (the system prompt, then user and assistant in turn, then `question`), so that a cold
/// request carries `messages` boundaries (an agent's or a long chat's history).
pub fn conversation(tenant: usize, tokens: usize, messages: usize, question: &str) -> Vec<u8> {
    let turns = messages.max(1);
    let words: Vec<String> = (0..tokens.saturating_sub(8 * turns + 16))
        .map(|i| format!("w{}", (i * 7 + tenant) % 97))
        .collect();
    let per = words.len().div_ceil(turns).max(1);
    let mut history: Vec<serde_json::Value> = words
        .chunks(per)
        .enumerate()
        .map(|(i, chunk)| {
            let role = match i {
                0 => "system",
                i if i % 2 == 1 => "user",
                _ => "assistant",
            };
            let text = chunk.join(" ");
            let content = if i == 0 {
                format!("tenant{tenant} {text}")
            } else {
                text
            };
            json!({"role": role, "content": content})
        })
        .collect();
    history.push(json!({"role": "user", "content": question}));
    json!({"model": "m", "messages": history})
        .to_string()
        .into_bytes()
}

/// Measures every combination on a fresh host per endpoint count: the VM is configured and
/// has scraped every endpoint once, then for each size a cold request (new tenant), and a warm
/// one (same system prompt as a request sent just before, new question).
pub fn run() -> wasmtime::Result<(Vec<Row>, Vec<TickRow>)> {
    let (mut rows, ticks) = run_counting(Fuel::Instructions)?;
    // The same requests again (every count here repeats exactly), bytes priced too.
    let (with_bytes, _) = run_counting(Fuel::InstructionsAndBulkBytes)?;
    for (row, priced) in rows.iter_mut().zip(&with_bytes) {
        row.bulk_bytes = priced.costs.total.fuel.saturating_sub(row.costs.total.fuel);
    }
    Ok((rows, ticks))
}

fn run_counting(fuel: Fuel) -> wasmtime::Result<(Vec<Row>, Vec<TickRow>)> {
    let mut rows = Vec::new();
    let mut ticks = Vec::new();
    for &n in &ENDPOINTS {
        let host = Host::new(Plugin::prefixroute_counting(fuel)?, HostOptions::default());
        let mut vm = host.configured_vm(endpoint_config(n).to_string().as_bytes())?;
        let root = vm.root_context_id();
        let before = vm.costs(root).total;
        vm.tick()?;
        let mut scrape_tick = vm.costs(root).total;
        subtract(&mut scrape_tick, &before);
        let before = vm.costs(root).total;
        let token = vm.pending_callouts()[0].token;
        vm.answer_callout(token, CalloutReply::ok(PAGE))?;
        let mut response = vm.costs(root).total;
        subtract(&mut response, &before);
        scrape_all(&mut vm)?;
        host.clock().advance_ms(250);
        let before = vm.costs(root).total;
        vm.tick()?;
        let mut idle_tick = vm.costs(root).total;
        subtract(&mut idle_tick, &before);
        ticks.push(TickRow {
            endpoints: n,
            scrape_tick,
            idle_tick,
            response,
        });
        // Prompts in lines at the first endpoint count only: what they add does not depend on
        // the pool.
        let texts: &[bool] = if n == ENDPOINTS[0] {
            &[false, true]
        } else {
            &[false]
        };
        for &lines in texts {
            let text = |tenant: usize, tokens: usize, question: &str| {
                let b = body(tenant, tokens, question);
                if lines {
                    in_lines(&b, LINE_WORDS)
                } else {
                    b
                }
            };
            // Tenants of their own per text, so that no prompt in lines finds a one-line one.
            let tenant0 = if lines { 2 * TOKENS.len() } else { 0 };
            for (t, &tokens) in TOKENS.iter().enumerate() {
                let (cold_tenant, warm_tenant) = (tenant0 + 2 * t, tenant0 + 2 * t + 1);
                let cold_body = text(cold_tenant, tokens, "What changed in my last invoice?");
                let cold = vm.round_trip(&Request::chat(cold_body.clone()))?;
                rows.push(row(n, tokens, false, lines, &cold_body, &cold));
                // Another tenant: its first two requests warm the prefix (the router's index
                // and the hash memo, which remembers a message met twice), the third is
                // measured.
                vm.round_trip(&Request::chat(text(warm_tenant, tokens, "first question")))?;
                vm.round_trip(&Request::chat(text(warm_tenant, tokens, "second question")))?;
                let warm_body = text(warm_tenant, tokens, "What changed in my last invoice?");
                let warm = vm.round_trip(&Request::chat(warm_body.clone()))?;
                rows.push(row(n, tokens, true, lines, &warm_body, &warm));
            }
        }
        if let Some(why) = vm.trapped() {
            wasmtime::bail!("the plugin trapped: {why}");
        }
    }
    Ok((rows, ticks))
}

fn subtract(total: &mut Costs, before: &Costs) {
    total.fuel -= before.fuel;
    total.callbacks -= before.callbacks;
    for (k, v) in &before.host_calls {
        if let Some(n) = total.host_calls.get_mut(k) {
            *n -= v;
        }
    }
    total.host_calls.retain(|_, n| *n > 0);
    total.bytes_in -= before.bytes_in;
    total.bytes_out -= before.bytes_out;
    total.shared_bytes_in -= before.shared_bytes_in;
    total.shared_bytes_out -= before.shared_bytes_out;
}

fn row(
    n: usize,
    target: usize,
    warm: bool,
    lines: bool,
    body: &[u8],
    rt: &crate::RoundTrip,
) -> Row {
    let parsed = prefixroute_core::parse_request(body).expect("benchmark bodies parse");
    let hashes = prefixroute_core::hashing::hash_request(
        &parsed,
        prefixroute_core::HashConfig {
            block_size: 16,
            include_partial: true,
            ..prefixroute_core::HashConfig::default()
        },
    );
    Row {
        endpoints: n,
        target_tokens: target,
        tokens: hashes.total_tokens(),
        blocks: hashes.total_blocks(),
        warm,
        lines,
        matched: rt
            .response_header("x-prefixroute-match")
            .unwrap_or_default(),
        body_bytes: body.len(),
        costs: rt.costs.clone(),
        bulk_bytes: 0,
    }
}

fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The tables as Markdown.
pub fn render(rows: &[Row], ticks: &[TickRow]) -> String {
    let mut out = String::new();
    out += "Per routed request (all callbacks of its HTTP context: headers, body, response, log, done, delete):\n\n";
    out += "| endpoints | prompt | text | tokens | blocks | cache | match | instructions | of which body phase | bulk bytes | host calls | shared gets | shared sets | shared bytes in | shared bytes out | body bytes |\n";
    out += "|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    for r in rows {
        let t = &r.costs.total;
        let body_fuel = r
            .costs
            .by_callback
            .get("proxy_on_request_body")
            .map_or(0, |c| c.fuel);
        out += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.endpoints,
            if r.target_tokens < 1024 {
                r.target_tokens.to_string()
            } else {
                format!("{}k", r.target_tokens / 1024)
            },
            if r.lines { "lines" } else { "one line" },
            r.tokens,
            r.blocks,
            if r.warm { "warm" } else { "cold" },
            r.matched,
            thousands(t.fuel),
            thousands(body_fuel),
            thousands(r.bulk_bytes),
            t.total_host_calls(),
            t.calls("proxy_get_shared_data"),
            t.calls("proxy_set_shared_data"),
            thousands(t.shared_bytes_in),
            thousands(t.shared_bytes_out),
            thousands(r.body_bytes as u64),
        );
    }
    out += "\nRoot context, per endpoint count:\n\n";
    out += "| endpoints | tick that scrapes all: instructions / host calls | idle tick: instructions / host calls | one scrape response: instructions / host calls |\n";
    out += "|---:|---:|---:|---:|\n";
    for t in ticks {
        out += &format!(
            "| {} | {} / {} | {} / {} | {} / {} |\n",
            t.endpoints,
            thousands(t.scrape_tick.fuel),
            t.scrape_tick.total_host_calls(),
            thousands(t.idle_tick.fuel),
            t.idle_tick.total_host_calls(),
            thousands(t.response.fuel),
            t.response.total_host_calls(),
        );
    }
    out
}
