//! A generated corpus of bad input: nothing traps, panics or hangs; every request gets a
//! destination and goes upstream; each fallback has the reason the spec gives, and the
//! parse-error counter counts exactly the bodies core cannot parse.

use host_tests::{Chunks, Request, Vm};
use serde_json::{json, Value};

use crate::common::{self, address, config, destination, endpoint_of};

const MAX_BODY: usize = 4 << 20;

/// The fallback reason the plugin must give, or `None` when it must route (the rules of
/// `plugin/src/settings.rs::is_routable`, `max_body_bytes` and core's `parse_request`).
fn expected_fallback(r: &Request) -> Option<&'static str> {
    let path = r.path.split(['?', '#']).next().unwrap_or("");
    let routable = r.method.eq_ignore_ascii_case("POST")
        && matches!(path, "/v1/chat/completions" | "/v1/completions");
    if !routable {
        Some("not_routable")
    } else if r.body.is_empty() {
        Some("no_body")
    } else if r.body.len() > MAX_BODY {
        Some("body_too_large")
    } else if prefixroute_core::parse_request(&r.body).is_err() {
        Some("parse_error")
    } else {
        None
    }
}

fn valid() -> Vec<u8> {
    common::chat_body(
        &common::tenant_prompt(0),
        "What is the status of order 1234?",
    )
}

fn chat(v: Value) -> Request {
    Request::chat(v.to_string().into_bytes())
}

fn corpus() -> Vec<(String, Request)> {
    let mut cases: Vec<(String, Request)> = Vec::new();
    let base = valid();
    // Truncated JSON, every 11 bytes.
    for cut in (0..base.len()).step_by(11) {
        cases.push((
            format!("truncated at {cut}"),
            Request::chat(base[..cut].to_vec()),
        ));
    }
    // Wrong types, field by field.
    let wrong: Vec<Value> = vec![
        json!(null),
        json!(true),
        json!(42),
        json!("a string"),
        json!([1, 2, 3]),
        json!({"model": 5, "messages": [{"role": "user", "content": "x"}]}),
        json!({"model": ["m"], "prompt": "x"}),
        json!({"messages": "hello"}),
        json!({"messages": {"role": "user"}}),
        json!({"messages": [1, 2]}),
        json!({"messages": [null]}),
        json!({"messages": [{"role": 1, "content": "x"}]}),
        json!({"messages": [{"content": "x"}]}),
        json!({"messages": [{"role": "user", "content": 12}]}),
        json!({"messages": [{"role": "user", "content": {"text": "x"}}]}),
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
        json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}]}),
        json!({"messages": [{"role": "user", "content": null}]}),
        json!({"prompt": 7}),
        json!({"prompt": {"text": "x"}}),
        json!({"prompt": [1, "a"]}),
        json!({"prompt": [[1, 2], [3]]}),
        json!({"prompt": [-1, 2]}),
        json!({"prompt": [4294967296u64]}),
        json!({"prompt": [true]}),
        json!({"prompt": "x", "stream": "yes"}),
        json!({"prompt": "x", "stream": 1}),
        json!({"prompt": "x", "max_tokens": -1}),
        json!({"prompt": "x", "max_tokens": 1.5}),
        json!({"prompt": "x", "max_tokens": "16"}),
        json!({"prompt": "x", "max_completion_tokens": 1e30}),
        json!({"prompt": "x", "cache_salt": 7}),
        json!({"prompt": "x", "cache_salt": null, "model": null}),
        json!({"prompt": "x", "messages": "both"}),
    ];
    for (i, v) in wrong.into_iter().enumerate() {
        cases.push((format!("wrong type {i}: {v}"), chat(v)));
    }
    // Empty and missing.
    for (i, raw) in [
        "",
        " ",
        "{}",
        "[]",
        "{\"model\": \"m\"}",
        "{\"messages\": []}",
        "{\"prompt\": \"\"}",
        "{\"prompt\": []}",
        "{\"prompt\": [\"\"]}",
        "{\"messages\": [{}]}",
        "{\"messages\": [{\"role\": \"\", \"content\": \"\"}]}",
        "\u{feff}{\"prompt\": \"bom\"}",
        "{\"prompt\": \"x\"} trailing",
        "{\"prompt\": \"x\",}",
        "{\"prompt\": \"x\", \"prompt\": \"y\"}",
    ]
    .into_iter()
    .enumerate()
    {
        cases.push((
            format!("empty or missing {i}: {raw:?}"),
            Request::chat(raw.as_bytes().to_vec()),
        ));
    }
    // Huge strings.
    let words = "lorem ipsum dolor sit amet ".repeat(10_000);
    cases.push(("270 KB of words".into(), chat(json!({"prompt": words}))));
    cases.push((
        "3 MB single token".into(),
        chat(json!({"prompt": "a".repeat(3 << 20)})),
    ));
    cases.push((
        "1 MB of multi-byte text".into(),
        chat(json!({"prompt": "é漢🦀 ".repeat(100_000)})),
    ));
    cases.push((
        "100 KB model name".into(),
        chat(json!({"model": "m".repeat(100_000), "prompt": "x"})),
    ));
    cases.push((
        "10k messages".into(),
        chat(json!({"messages": vec![json!({"role": "user", "content": "hi"}); 10_000]})),
    ));
    cases.push((
        "5 MB body".into(),
        chat(json!({"prompt": "b".repeat(5 << 20)})),
    ));
    // Deep nesting.
    cases.push((
        "100k open brackets".into(),
        Request::chat("[".repeat(100_000).into_bytes()),
    ));
    cases.push((
        "10k nested objects".into(),
        Request::chat("{\"a\":".repeat(10_000).into_bytes()),
    ));
    let mut deep = json!("x");
    for _ in 0..120 {
        deep = json!([deep]);
    }
    cases.push((
        "content nested 120 deep".into(),
        chat(json!({"messages": [{"role": "user", "content": deep}]})),
    ));
    let mut deep = json!(1);
    for _ in 0..120 {
        deep = json!({"k": deep});
    }
    cases.push((
        "unknown field nested 120 deep".into(),
        chat(json!({"prompt": "x", "extra": deep})),
    ));
    // Invalid UTF-8 and broken escapes.
    let mut bad = base.clone();
    let at = bad.len() / 2;
    bad[at] = 0xff;
    cases.push(("0xff inside a string".into(), Request::chat(bad)));
    cases.push((
        "overlong encoding".into(),
        Request::chat(b"{\"prompt\": \"\xc0\xaf\"}".to_vec()),
    ));
    cases.push((
        "truncated multi-byte".into(),
        Request::chat(b"{\"prompt\": \"\xe6\xbc\"}".to_vec()),
    ));
    cases.push((
        "lone surrogate escape".into(),
        Request::chat(br#"{"prompt": "\ud800"}"#.to_vec()),
    ));
    cases.push((
        "bad escape".into(),
        Request::chat(br#"{"prompt": "\q"}"#.to_vec()),
    ));
    cases.push((
        "NUL bytes".into(),
        Request::chat(b"{\"prompt\": \"a\0b\"}".to_vec()),
    ));
    cases.push((
        "binary".into(),
        Request::chat((0..=255u8).cycle().take(4096).collect::<Vec<u8>>()),
    ));
    // Paths and methods.
    for path in [
        "/v1/models",
        "/v2/chat/completions",
        "/v1/chat/completions/extra",
        "/V1/CHAT/COMPLETIONS",
        "/",
        "",
        "/v1/chat/completions?stream=true",
        "/v1/completions#frag",
        "/v1//completions",
        "v1/completions",
    ] {
        cases.push((format!("path {path:?}"), Request::post(path, base.clone())));
    }
    for method in [
        "GET", "HEAD", "PUT", "DELETE", "OPTIONS", "post", "PATCH", "",
    ] {
        for body in [Vec::new(), base.clone()] {
            let r = Request::new(method, "/v1/chat/completions", body.clone());
            cases.push((format!("method {method:?} body {}", body.len()), r));
        }
    }
    cases
}

fn check(vm: &mut Vm, what: &str, r: &Request) {
    let x = vm.send(r).unwrap_or_else(|e| panic!("{what}: {e:?}"));
    assert!(!x.stalled, "{what}: stalled");
    assert!(x.upstream.is_some(), "{what}: nothing went upstream");
    assert_eq!(
        x.upstream_body, r.body,
        "{what}: the body went upstream unchanged"
    );
    let dest = destination(&x);
    assert!((0..3).any(|e| address(e) == dest), "{what}: {dest}");
    let response = vm.respond(x.id, 200).unwrap();
    vm.finish(x.id).unwrap();
    let fallback = response.get_str("x-prefixroute-fallback");
    assert_eq!(
        fallback.as_deref(),
        expected_fallback(r),
        "{what}: policy {:?}",
        response.get_str("x-prefixroute-policy")
    );
}

/// The chat reader finds the bytes of a message's content that need a look of their own
/// (`"`, `\\`, control and non-ASCII bytes) sixteen and sixty-four at a time in the `.wasm`
/// (`simd128`) and eight at a time natively, where core's tests run. So each such byte, and a
/// few that need none, is put at every offset of a content in the plugin, and the plugin must
/// read the body as core's `parse_request` does: refuse what core refuses, and otherwise route
/// the same number of tokens (a content read with an escape taken as plain text, or cut short
/// at a byte the scan missed, would not).
#[test]
fn a_special_byte_at_any_offset_of_a_content_is_read_as_core_reads_it() {
    use prefixroute_core::hashing::{hash_request, HashConfig};
    let host = common::host();
    let mut vm = common::configured(&host, &config(3, json!({})));
    let specials: [&[u8]; 23] = [
        br#"\""#,
        br"\n",
        br"\\",
        br"\u00e9",
        br"\ud83e\udd80",
        br"\q",
        "é".as_bytes(),
        "漢".as_bytes(),
        "🦀".as_bytes(),
        b"\x01",
        b"\x1f",
        b"\x7f",
        b"\xff",
        b"\xc3",
        b"\"",
        b"~",
        // Non-ASCII text is checked as UTF-8 a run at a time, up to the next stop.
        "日本語のテキスト、そして".as_bytes(),
        "é\\n".as_bytes(),
        "é\\\"é".as_bytes(),
        b"\xc3\xa9\xff",
        b"\xe6\xbc",
        "é\u{1}".as_bytes(),
        "é\"".as_bytes(),
    ];
    let (mut routed, mut refused) = (0, 0);
    for (s, special) in specials.iter().enumerate() {
        // Past 64 too: a content is read 64 bytes at a time until a block holds a stop.
        for offset in 0..80 {
            let filler = b"abc de fghij, klm nopq rstu vwxyz. ".repeat(3);
            let mut content = filler[..offset].to_vec();
            content.extend_from_slice(special);
            content.extend_from_slice(&filler[offset..]);
            // A unique first message, so that no block of one case matches another's.
            let mut body = format!(
                r#"{{"model":"m","messages":[{{"role":"system","content":"case {s} at {offset}"}},{{"role":"user","content":""#
            )
            .into_bytes();
            body.extend_from_slice(&content);
            body.extend_from_slice(br#""}]}"#);
            let what = format!(
                "{} at {offset}",
                String::from_utf8_lossy(special).escape_debug()
            );
            let r = Request::chat(body);
            let rt = vm
                .round_trip(&r)
                .unwrap_or_else(|e| panic!("{what}: {e:?}"));
            assert!(vm.trapped().is_none(), "{what}: {:?}", vm.trapped());
            let fallback = rt.response_header("x-prefixroute-fallback");
            match prefixroute_core::parse_request(&r.body) {
                Err(_) => {
                    assert_eq!(fallback.as_deref(), Some("parse_error"), "{what}");
                    refused += 1;
                }
                Ok(parsed) => {
                    assert_eq!(fallback, None, "{what}");
                    let hashes = hash_request(&parsed, HashConfig::default());
                    let matched = format!("0/{}", hashes.total_blocks());
                    assert_eq!(
                        rt.response_header("x-prefixroute-match"),
                        Some(matched),
                        "{what}"
                    );
                    assert_eq!(
                        rt.response_header("x-prefixroute-uncached-tokens"),
                        Some(hashes.total_tokens().to_string()),
                        "{what}"
                    );
                    routed += 1;
                }
            }
        }
    }
    // Refused: a raw quote (it ends the string early, also after `é`), `\q`, the control
    // bytes, 0xff (also after `é`) and lead bytes with too few continuations; DEL (0x7f) is a
    // plain byte in JSON.
    assert_eq!((routed, refused), (13 * 80, 10 * 80));
}

/// The same text spelled with escapes and without is the same prompt: the plugin decodes a
/// chat content (a string or one text part) or a completions prompt it has not met (finding
/// each escape with the reader's SIMD scan) before hashing it. So a prompt whose content escapes characters (`\u00e9\/`, `\u000a`, `\"\\\n\t`), at
/// every offset across the scan's 16- and 64-byte steps, sent after the same text spelled
/// otherwise (`é/` written out, the other escapes of the same characters), must match all its
/// full blocks, as an exact repeat does. A decoding that lost, kept or misplaced a byte would
/// hash other text and match less.
#[test]
fn a_content_with_escapes_hashes_as_the_same_text_written_out() {
    use prefixroute_core::hashing::{hash_request, HashConfig};
    let host = common::host();
    let mut vm = common::configured(&host, &config(3, json!({})));
    // (escaped, written out): the second is the JSON of the same characters.
    let spellings: [(&[u8], &[u8]); 3] = [
        (br"\u00e9\/", "é/".as_bytes()),
        (br"\u000a", br"\n"),
        (br#"\"\\\n\t"#, br#"\"\u005c\u000A\u0009"#),
    ];
    let filler = b"abc de fghij, klm nopq rstu vwxyz. ".repeat(5);
    for (s, (escaped, written)) in spellings.iter().enumerate() {
        for (offset, shape) in (0..150).flat_map(|o| [(o, "chat"), (o, "completions"), (o, "part")])
        {
            // A chat's user message (its content a string or one text part), or a completions
            // prompt, holds the spelling twice.
            let request = |special: &[u8]| {
                let head = format!("spelling {s} at {offset}, {shape}: ");
                let mut text = head.into_bytes();
                text.extend_from_slice(&filler[..offset]);
                text.extend_from_slice(special);
                text.extend_from_slice(&filler[offset..]);
                text.extend_from_slice(special);
                let (path, open, close): (_, &[u8], &[u8]) = match shape {
                    "completions" => ("/v1/completions", br#"{"model":"m","prompt":""#, br#""}"#),
                    "chat" => (
                        "/v1/chat/completions",
                        br#"{"model":"m","messages":[{"role":"user","content":""#,
                        br#""}]}"#,
                    ),
                    _ => (
                        "/v1/chat/completions",
                        br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":""#,
                        br#""}]}]}"#,
                    ),
                };
                Request::post(path, [open, &text, close].concat())
            };
            let what = format!("spelling {s} at {offset}, {shape}");
            let parsed = prefixroute_core::parse_request(&request(written).body).unwrap();
            let hashes = hash_request(&parsed, HashConfig::default());
            // A repeat matches the full blocks (what a server caches), not the partial last.
            let full = hashes.total_tokens() / HashConfig::default().block_size;
            let first = vm.round_trip(&request(written)).unwrap();
            assert_eq!(
                first.response_header("x-prefixroute-match"),
                Some(format!("0/{}", hashes.total_blocks())),
                "{what}"
            );
            let again = vm.round_trip(&request(escaped)).unwrap();
            assert!(vm.trapped().is_none(), "{what}: {:?}", vm.trapped());
            assert_eq!(
                again.response_header("x-prefixroute-fallback"),
                None,
                "{what}"
            );
            assert_eq!(
                again.response_header("x-prefixroute-match"),
                Some(format!("{full}/{}", hashes.total_blocks())),
                "{what}"
            );
        }
    }
}

#[test]
fn bad_input_never_traps_and_always_gets_a_destination() {
    let host = common::host();
    let mut vm = common::configured(&host, &config(3, json!({})));
    let cases = corpus();
    let mut parse_errors = 0;
    let mut checked = 0;
    for (what, r) in &cases {
        if expected_fallback(r) == Some("parse_error") {
            parse_errors += 1;
        }
        check(&mut vm, what, r);
        checked += 1;
        // The same input in 3 chunks decides the same way.
        if r.body.len() > 3 && r.body.len() < 1 << 20 {
            let n = r.body.len();
            let chunked = r.clone().chunks(Chunks::At(vec![n / 3, 2 * n / 3]));
            if expected_fallback(r) == Some("parse_error") {
                parse_errors += 1;
            }
            check(&mut vm, &format!("{what} (3 chunks)"), &chunked);
            checked += 1;
        }
        assert!(vm.trapped().is_none(), "{what}: {:?}", vm.trapped());
    }
    assert!(
        checked >= 250 && parse_errors > 100,
        "{checked} cases, {parse_errors} parse errors"
    );
    assert_eq!(
        host.stats().value("prefixroute.fallback.parse_error"),
        parse_errors,
        "the parse-error metric counts every unparseable body"
    );
    assert!(vm
        .capture()
        .logs_containing(host_tests::LogLevel::Critical, "")
        .is_empty());
}

#[test]
fn a_body_split_at_every_byte_boundary_routes_like_the_whole_body() {
    let host = common::host();
    let mut vm = common::configured(&host, &config(3, json!({})));
    let body = valid();
    vm.round_trip(&Request::chat(body.clone())).unwrap();
    // The whole body again, warm: what every split of it must match (its full blocks).
    let whole = vm.round_trip(&Request::chat(body.clone())).unwrap();
    let home = endpoint_of(&destination(&whole.exchange));
    let full = whole.response_header("x-prefixroute-match").unwrap();
    let (matched, total) = full.split_once('/').unwrap();
    assert!(
        matched.parse::<u32>().unwrap() + 1 >= total.parse::<u32>().unwrap(),
        "{full}"
    );
    let mut requests = 0;
    for at in 1..body.len() {
        let x = vm
            .send(&Request::chat(body.clone()).chunks(Chunks::At(vec![at])))
            .unwrap();
        assert_eq!(endpoint_of(&destination(&x)), home, "split at {at}");
        let response = vm.respond(x.id, 200).unwrap();
        assert_eq!(
            response.get_str("x-prefixroute-match"),
            Some(full.clone()),
            "split at {at}"
        );
        vm.finish(x.id).unwrap();
        requests += 1;
    }
    let x = vm
        .send(&Request::chat(body.clone()).chunks(Chunks::Every(1)))
        .unwrap();
    assert_eq!(endpoint_of(&destination(&x)), home, "one byte at a time");
    assert!(requests > 400, "{requests}");
    assert_eq!(host.stats().value("prefixroute.fallback.parse_error"), 0);
}
