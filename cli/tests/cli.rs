//! The `prefixroute` binary as a user runs it.

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
    let dir = std::env::temp_dir().join(format!("prefixroute-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
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
fn simulate_default_trace_shows_prefix_far_ahead_with_every_tenant_pinned() {
    let trace = temp("default.jsonl");
    assert!(prefixroute(&["trace", "-o", trace.to_str().unwrap()])
        .status
        .success());
    let rows = simulate_rows(&trace, &[]);
    assert_eq!(rows.len(), 5, "one row per policy");
    let prefix = hit_rate(&rows, "prefix");
    assert!(prefix > hit_rate(&rows, "round-robin") + 25.0);
    assert!(prefix > hit_rate(&rows, "least-queue") + 25.0);
    let pinned = &rows.iter().find(|r| r[0] == "prefix").unwrap()[7];
    assert_eq!(pinned, "8/8");
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
