//! The destination header is the plugin's whole output: a client must never choose it.

use host_tests::{Chunks, Headers, Request};
use serde_json::json;

use crate::common::{self, address, chat_body, config, destination, DEST};

#[test]
fn a_client_supplied_destination_header_is_always_overwritten() {
    let host = common::host();
    let mut vm = common::configured(&host, &config(3, json!({"max_body_bytes": 2000})));
    let valid = chat_body("system prompt", "question");
    let requests = vec![
        ("routed", Request::chat(valid.clone())),
        (
            "routed in chunks",
            Request::chat(valid.clone()).chunks(Chunks::Every(7)),
        ),
        ("parse error", Request::chat(b"{not json".to_vec())),
        (
            "not routable",
            Request::new("GET", "/v1/models", Vec::new()),
        ),
        (
            "unknown path",
            Request::post("/v1/embeddings", valid.clone()),
        ),
        ("no body", Request::post("/v1/chat/completions", Vec::new())),
        (
            "too large",
            Request::chat(chat_body(&"x".repeat(3000), "q")),
        ),
        (
            "trailers",
            Request::chat(valid.clone()).trailers(Headers::from_pairs([("x-t", "1")])),
        ),
    ];
    let configured: Vec<String> = (0..3).map(address).collect();
    for (what, request) in requests {
        for forged in [
            vec![(DEST, "6.6.6.6:666")],
            vec![("X-Gateway-Destination-Endpoint", "6.6.6.6:666")],
            vec![(DEST, "6.6.6.6:666"), (DEST, "7.7.7.7:777")],
            vec![(DEST, "")],
        ] {
            let mut r = request.clone();
            for (k, v) in &forged {
                r = r.header(k, v);
            }
            let x = vm.send(&r).unwrap();
            assert!(!x.stalled, "{what}");
            let dest = destination(&x);
            assert!(configured.contains(&dest), "{what} {forged:?}: {dest:?}");
            vm.finish(x.id).unwrap();
        }
    }
    assert!(vm.trapped().is_none());
}

#[test]
fn a_configured_header_name_is_the_one_overwritten() {
    let host = common::host();
    let mut vm = common::configured(&host, &config(2, json!({"destination_header": "x-dest"})));
    let x = vm
        .send(&Request::chat(chat_body("s", "q")).header("X-Dest", "6.6.6.6:1"))
        .unwrap();
    let values = x.upstream_values("x-dest");
    assert_eq!(values.len(), 1);
    let chosen = values[0].split(',').next().unwrap();
    assert!(chosen == address(0) || chosen == address(1), "{values:?}");
    assert!(x.upstream_values(DEST).is_empty());
}

#[test]
fn the_destination_lists_the_chosen_endpoint_then_distinct_failover_endpoints() {
    let host = common::host();
    for (failover, expected) in [(2, 3), (0, 1), (8, 4)] {
        let mut vm = common::configured(&host, &config(4, json!({"failover": failover})));
        for q in 0..6 {
            let x = vm
                .send(&Request::chat(chat_body(
                    "shared system prompt",
                    &format!("q{q}"),
                )))
                .unwrap();
            let list = common::destinations(&x);
            assert_eq!(list.len(), expected, "failover {failover}: {list:?}");
            let mut distinct = list.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct.len(), list.len(), "{list:?}");
            for a in &list {
                common::endpoint_of(a);
            }
            vm.finish(x.id).unwrap();
        }
    }
}
