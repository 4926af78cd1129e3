//! The `prefixroute` binary as a user runs it.

mod support;

use std::path::PathBuf;
use std::process::{Command, Output};

fn prefixroute(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_prefixroute"))
        .args(args)
        .output()
        .expect("run prefixroute")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn temp(name: &str) -> PathBuf {
    support::scratch_dir().join(name)
}

#[test]
fn disagg_prints_the_reference_numbers() {
    let out = prefixroute(&["disagg", "--prompt-tokens", "4000"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    for needle in ["131072 B/token", "524.3 MB", "333.3 ms", "12.6 Gb/s"] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
}

#[test]
fn trace_is_deterministic_and_seed_dependent() {
    let (a, b, c) = (temp("a.jsonl"), temp("b.jsonl"), temp("c.jsonl"));
    for (path, seed) in [(&a, "1"), (&b, "1"), (&c, "2")] {
        let out = prefixroute(&["trace", "-o", path.to_str().unwrap(), "--seed", seed]);
        assert!(out.status.success(), "{}", stderr(&out));
    }
    let read = |p: &PathBuf| std::fs::read_to_string(p).unwrap();
    assert_eq!(read(&a), read(&b));
    assert_ne!(read(&a), read(&c));
    assert_eq!(read(&a).lines().count(), 64);
}

#[test]
fn trace_turns_ends_conversations_and_rejects_zero_with_a_clear_error() {
    let path = temp("turns.jsonl");
    let path = path.to_str().unwrap();
    let out = prefixroute(&[
        "trace",
        "--shape",
        "conversations",
        "--tenants",
        "2",
        "--requests",
        "30",
        "--turns",
        "3",
        "-o",
        path,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = std::fs::read_to_string(path).unwrap();
    assert!(text.contains(r#""group":"conv-0.1""#), "{text}");

    let out = prefixroute(&["trace", "--shape", "mixed", "--turns", "0", "-o", path]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("turns must be at least 1"),
        "{}",
        stderr(&out)
    );
    assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
}

fn simulate_rows(trace: &std::path::Path, extra: &[&str]) -> Vec<Vec<String>> {
    let mut args = vec!["simulate", trace.to_str().unwrap()];
    args.extend_from_slice(extra);
    let out = prefixroute(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    stdout(&out)
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .skip(1)
        .map(|l| l.split_whitespace().map(String::from).collect())
        .collect()
}

fn hit_rate(rows: &[Vec<String>], policy: &str) -> f64 {
    let row = rows.iter().find(|r| r[0] == policy).unwrap();
    row[1].trim_end_matches('%').parse().unwrap()
}

#[test]
fn simulate_default_trace_shows_the_cache_aware_policies_far_ahead_with_every_tenant_pinned() {
    let trace = temp("default.jsonl");
    assert!(prefixroute(&["trace", "-o", trace.to_str().unwrap()])
        .status
        .success());
    let rows = simulate_rows(&trace, &[]);
    assert_eq!(rows.len(), 7, "one row per policy and the upper bound");
    assert_eq!(rows[0][0], "latency", "the default policy first");
    assert_eq!(rows[6][..2], ["upper", "bound"]);
    for policy in ["latency", "prefix"] {
        let hit = hit_rate(&rows, policy);
        assert!(hit > hit_rate(&rows, "round-robin") + 25.0, "{policy}");
        assert!(hit > hit_rate(&rows, "least-queue") + 25.0, "{policy}");
        // policy, hit, of bound, p50, ms, p95, ms, queue p95, groups on one
        let pinned = &rows.iter().find(|r| r[0] == policy).unwrap()[8];
        assert_eq!(pinned, "8/8", "{policy}");
    }
}

#[test]
fn simulate_counts_the_tries_a_failed_engine_answered_and_envoy_retried() {
    let trace = temp("failing.jsonl");
    let t = trace.to_str().unwrap();
    assert!(prefixroute(&["trace", "--requests", "200", "-o", t])
        .status
        .success());
    let flags = ["--policy", "latency", "--fleet-event", "fail:replica-1@1"];
    let out = prefixroute(&[&["simulate", t][..], &flags[..]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains(
            "latency: 5 tries answered 503 by a failed engine and retried, 0 requests failed \
             every try"
        ),
        "{}",
        stdout(&out)
    );
    let out = prefixroute(&[&["simulate", t, "--json"][..], &flags[..]].concat());
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["policies"][0]["failed_tries"], 5);
    assert_eq!(json["fleet_events"][0]["change"], "fail");
    // Each retried decision says where its tries went.
    let out = prefixroute(&[&["simulate", t, "--show-decisions", "200"][..], &flags[..]].concat());
    let retried: Vec<&str> = std::str::from_utf8(&out.stdout)
        .unwrap()
        .lines()
        .filter(|l| l.contains("[503 from replica-1, then replica-"))
        .collect();
    assert_eq!(retried.len(), 5, "{retried:?}");
    // Without a failure the report says nothing of failures.
    let out = prefixroute(&["simulate", t, "--policy", "latency", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(json["policies"][0].get("failed_tries").is_none());
    assert!(!stdout(&out).contains("503"));
}

#[test]
fn simulate_reports_each_policys_share_of_the_upper_bound() {
    // The issue's RAG command: 6 documents of ~1,000 tokens, caches of 2 documents each,
    // 1 ms per uncached token.
    let trace = temp("rag.jsonl");
    let t = trace.to_str().unwrap();
    let out = prefixroute(&[
        "trace",
        "--shape",
        "rag",
        "--tenants",
        "6",
        "--prompt-words",
        "800",
        "--question-words",
        "20",
        "--rate",
        "20",
        "--requests",
        "200",
        "--seed",
        "5",
        "-o",
        t,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let rows = simulate_rows(
        &trace,
        &[
            "--cache-blocks",
            "128",
            "--slots",
            "4",
            "--decode-ms-per-token",
            "0",
        ],
    );
    let share = |policy: &str| -> f64 {
        let row = rows.iter().find(|r| r[0] == policy).unwrap();
        row[2].trim_end_matches('%').parse().unwrap()
    };
    assert!(share("latency") >= 95.0, "{rows:?}");
    // "upper bound" is two words: its share is one column further.
    assert_eq!(rows.last().unwrap()[3], "100.0%");
    assert!(share("round-robin") < 50.0);
    // --json carries the same numbers.
    let out = prefixroute(&[
        "simulate",
        t,
        "--cache-blocks",
        "128",
        "--slots",
        "4",
        "--decode-ms-per-token",
        "0",
        "--policy",
        "latency,round-robin",
        "--json",
    ]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["policies"].as_array().unwrap().len(), 2);
    assert!(json["upper_bound"]["hit_rate"].as_f64().unwrap() > 0.9);
}

#[test]
fn simulate_shows_decisions_in_the_documented_form() {
    let trace = temp("decisions.jsonl");
    assert!(prefixroute(&["trace", "-o", trace.to_str().unwrap()])
        .status
        .success());
    let out = prefixroute(&[
        "simulate",
        trace.to_str().unwrap(),
        "--policy",
        "prefix",
        "--show-decisions",
        "5",
    ]);
    let text = stdout(&out);
    let line = text
        .lines()
        .find(|l| l.starts_with("#3 "))
        .expect("decision #3");
    assert!(line.contains(": prefix -> replica-"), "{line}");
    assert!(line.contains(" blocks, score "), "{line}");
    assert!(line.contains(", next replica-"), "{line}");
}

#[test]
fn output_into_a_closed_pipe_is_not_an_error() {
    use std::io::Read;
    // Far more output than a pipe buffers (64 KiB), so the write really meets the hang-up.
    let trace = temp("pipe.jsonl");
    let t = trace.to_str().unwrap();
    assert!(prefixroute(&["trace", "--requests", "400", "-o", t])
        .status
        .success());
    let mut child = Command::new(env!("CARGO_BIN_EXE_prefixroute"))
        .args([
            "simulate",
            t,
            "--policy",
            "latency",
            "--show-decisions",
            "400",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Read one byte, then hang up, as `| head -c 1` does.
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 1];
    stdout.read_exact(&mut first).unwrap();
    drop(stdout);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
}

#[test]
fn latency_decisions_explain_every_endpoints_prediction() {
    let trace = temp("latency-decisions.jsonl");
    assert!(prefixroute(&["trace", "-o", trace.to_str().unwrap()])
        .status
        .success());
    let out = prefixroute(&[
        "simulate",
        trace.to_str().unwrap(),
        "--policy",
        "latency",
        "--show-decisions",
        "5",
    ]);
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    let at = lines.iter().position(|l| l.starts_with("#3 ")).expect("#3");
    let line = lines[at];
    assert!(line.contains(": latency -> replica-"), "{line}");
    assert!(line.contains(" uncached tokens, queue "), "{line}");
    assert!(line.contains(" ms, TTFT "), "{line}");
    // Then one line per replica, the chosen one starred.
    let per: Vec<&str> = lines[at + 1..at + 4].to_vec();
    assert_eq!(
        per.iter()
            .filter(|l| l.trim_start().starts_with('*'))
            .count(),
        1
    );
    for l in per {
        assert!(
            l.contains("uncached tokens, queue ") && l.contains(" ms/token and "),
            "{l}"
        );
        assert!(l.contains("cost ") && l.contains("cache "), "{l}");
    }
}

#[test]
fn hash_reads_a_body_and_a_plain_prompt() {
    use std::io::Write;
    let run = |input: &str, args: &[&str]| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_prefixroute"))
            .arg("hash")
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    };
    let body = r#"{"model":"m","messages":[{"role":"user","content":"one two three four five"}]}"#;
    let out = run(body, &["--block-size", "4"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    // "<|user|>\n" is 3 pieces, then 5 words: 8 tokens in 2 blocks.
    assert!(text.contains("tokens: 8  blocks: 2"), "{text}");
    let salted = stdout(&run(body, &["--block-size", "4", "--salt", "x"]));
    let last_hash = |t: &str| t.lines().last().unwrap().to_string();
    assert_ne!(last_hash(&text), last_hash(&salted));
    let plain = run("hello world", &["--json"]);
    let json: serde_json::Value = serde_json::from_slice(&plain.stdout).unwrap();
    assert_eq!(json["tokens"][0], 2);
    assert_eq!(json["identity"], "text");
    // `--index precise` hashes the token ids, as the servers do: the same blocks, other hashes.
    let precise = run("hello world", &["--json", "--index", "precise"]);
    let precise: serde_json::Value = serde_json::from_slice(&precise.stdout).unwrap();
    assert_eq!(precise["identity"], "token_ids");
    assert_eq!(precise["tokens"], json["tokens"]);
    assert_ne!(precise["hashes"], json["hashes"]);
    let bad = run("{\"messages\": 3}", &[]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        stderr(&bad).contains("`messages` must be an array"),
        "{}",
        stderr(&bad)
    );
}

#[test]
fn bad_flags_and_files_exit_2_with_one_clear_line() {
    let out = prefixroute(&["simulate", "/nonexistent/trace.jsonl"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.starts_with("error: cannot read trace /nonexistent/trace.jsonl"),
        "{err}"
    );
    assert!(!err.contains("panicked"));

    let bad = temp("bad.jsonl");
    std::fs::write(&bad, "{\"t\":0,\"group\":\"g\",\"body\":{}}\nnope\n").unwrap();
    let out = prefixroute(&["simulate", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("line 2"), "{}", stderr(&out));

    let out = prefixroute(&["simulate", bad.to_str().unwrap(), "--weights", "speed=3"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("invalid weights"), "{}", stderr(&out));

    let out = prefixroute(&["disagg", "--prompt-tokens", "10", "--model", "gpt-9"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("llama-3.1-8b"), "{}", stderr(&out));

    let out = prefixroute(&["trace", "-o", "/nonexistent/dir/x.jsonl"]);
    assert_eq!(out.status.code(), Some(2));

    let out = prefixroute(&["frobnicate"]);
    assert_eq!(out.status.code(), Some(2));
}

/// `simulate TRACE FLAGS` exits 2 with `message` and no panic; its stderr.
fn simulate_refuses(trace: &str, flags: &[&str], message: &str) -> String {
    let mut args = vec!["simulate", trace];
    args.extend(flags);
    let out = prefixroute(&args);
    assert_eq!(out.status.code(), Some(2), "{flags:?}");
    let err = stderr(&out);
    assert!(err.contains(message), "{flags:?}: {err}");
    assert!(!err.contains("panicked"));
    err
}

#[test]
fn bad_prefill_decode_flags_exit_2_with_one_clear_error() {
    let trace = temp("split.jsonl");
    let out = prefixroute(&["trace", "--requests", "8", "-o", trace.to_str().unwrap()]);
    assert!(out.status.success());
    let t = trace.to_str().unwrap();
    for (flags, message) in [
        (
            vec!["--prefill-replicas", "0", "--decode-replicas", "0"],
            "error: --prefill-replicas + --decode-replicas is 0",
        ),
        (
            vec![
                "--prefill-replicas",
                "2",
                "--decode-replicas",
                "0",
                "--link-gbps",
                "100",
            ],
            "error: --decode-replicas must be at least 1",
        ),
        (
            vec!["--prefill-replicas", "1", "--link-gbps", "-10"],
            "error: invalid prefill/decode split: invalid link_gbps: -10",
        ),
        (
            vec!["--threshold", "512"],
            "error: --threshold needs --prefill-replicas",
        ),
        (
            vec!["--prefill-replicas", "1"],
            "error: --link-gbps is required with --prefill-replicas 1",
        ),
        (
            vec![
                "--prefill-replicas",
                "1",
                "--link-gbps",
                "10",
                "--model",
                "gpt-9",
            ],
            "error: unknown model \"gpt-9\"",
        ),
        (
            vec!["--replicas", "3", "--decode-replicas", "2"],
            "cannot be used with",
        ),
    ] {
        let err = simulate_refuses(t, &flags, message);
        if !message.contains("cannot be used") {
            assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
        }
    }
}

#[test]
fn bad_gateway_flags_exit_2_with_one_clear_line() {
    let trace = temp("gateways.jsonl");
    let out = prefixroute(&["trace", "--requests", "8", "-o", trace.to_str().unwrap()]);
    assert!(out.status.success());
    let t = trace.to_str().unwrap();
    for (flags, message) in [
        (vec!["--gateways", "0"], "0 is not in 1..=64"),
        (
            vec!["--gateway-spread", "sticky"],
            "unknown gateway spread \"sticky\"",
        ),
        (
            vec!["--kv-interval-ms", "200"],
            "error: --kv-interval-ms delays the replicas' KV events: it needs --index precise",
        ),
        (
            vec!["--index", "precise", "--kv-interval-ms=-5"],
            "error: kv_interval_ms must be a number >= 0, got -5",
        ),
        (
            vec![
                "--gateways",
                "2",
                "--prefill-replicas",
                "1",
                "--link-gbps",
                "10",
            ],
            "error: --gateways is not supported with --prefill-replicas",
        ),
        (
            vec!["--scrape-interval-ms=-5"],
            "error: scrape_interval_ms must be a number >= 0, got -5",
        ),
        (
            vec!["--prior-lanes", "0"],
            "error: latency.lanes must be in 1..4096, got 0",
        ),
        (
            vec!["--balance-factor", "0.5"],
            "error: latency.balance_factor must be 0 (off) or in 1..100, got 0.5",
        ),
    ] {
        simulate_refuses(t, &flags, message);
    }
    // Two gateways, each group through one, with a delayed feed: a table with the note.
    let out = prefixroute(&[
        "simulate",
        t,
        "--policy",
        "latency",
        "--index",
        "precise",
        "--gateways",
        "2",
        "--gateway-spread",
        "by-group",
        "--kv-interval-ms",
        "200",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(
            "2 gateways, each group's requests to one of them, each with its own precise belief"
        ),
        "{text}"
    );
}

#[test]
fn simulate_splits_prefill_from_decode_and_compares_with_aggregated_serving() {
    let trace = temp("split-long.jsonl");
    let out = prefixroute(&[
        "trace",
        "--shape",
        "unique",
        "--prompt-words",
        "3600",
        "--rate",
        "4",
        "--requests",
        "40",
        "--max-tokens",
        "64",
        "--seed",
        "9",
        "-o",
        trace.to_str().unwrap(),
    ]);
    assert!(out.status.success());
    let out = prefixroute(&[
        "simulate",
        trace.to_str().unwrap(),
        "--policy",
        "latency",
        "--prefill-replicas",
        "2",
        "--decode-replicas",
        "4",
        "--threshold",
        "512",
        "--link-gbps",
        "400",
        "--prefill-ms-per-token",
        "0.1",
        "--decode-ms-per-token",
        "20",
        "--cache-blocks",
        "4096",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["pd"]["prefill_replicas"], 2);
    assert_eq!(json["pd"]["kv_bytes_per_token"], 131_072);
    let row = &json["policies"][0];
    assert_eq!(row["policy"], "latency");
    let split = &row["disaggregated"];
    let aggregated = &row["aggregated"];
    assert_eq!(split["pd"]["remote_prefill_share"], 1.0);
    assert_eq!(
        aggregated["requests_per_replica"].as_array().unwrap().len(),
        6
    );
    for key in [
        "ttft_p50_ms",
        "ttft_p95_ms",
        "decode_stall_p95_ms",
        "itl_worst_p95_ms",
    ] {
        assert!(
            split[key].is_number() && aggregated[key].is_number(),
            "{key}"
        );
    }
    assert!(split["itl_worst_p95_ms"].as_f64() < aggregated["itl_worst_p95_ms"].as_f64());
    // The table names both serving modes for each policy.
    let out = prefixroute(&[
        "simulate",
        trace.to_str().unwrap(),
        "--policy",
        "latency,round-robin",
        "--prefill-replicas",
        "2",
        "--decode-replicas",
        "4",
        "--link-gbps",
        "10",
    ]);
    let text = stdout(&out);
    assert!(
        text.contains("P/D 2+4") && text.contains("aggregated 6"),
        "{text}"
    );
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("round-robin"))
            .count(),
        2
    );
}
