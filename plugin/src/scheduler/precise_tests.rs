//! `index: precise`: the scheduler writes the relay's feed pages into the shared index and
//! routes on what the servers report, with a short speculation for blocks just routed.

use super::*;
use crate::shared::MemShared;
use prefixroute_core::config::EndpointConfig;
use prefixroute_core::feed::{FeedServer, StoredRun};
use prefixroute_core::hashing::{hash_request, BlockIdentity, HashConfig};
use prefixroute_core::index::{PrefixStore, Turn};

fn config(index: IndexMode, speculative_blocks: u64) -> PluginConfig {
    let mut c = PluginConfig {
        endpoints: (0..2)
            .map(|i| EndpointConfig {
                name: format!("e{i}"),
                address: format!("127.0.0.1:{}", 18000 + i),
            })
            .collect(),
        policy: Policy::PrefixOnly,
        index,
        block_size: 4,
        seed: 1,
        ..PluginConfig::default()
    };
    c.kv_events.speculative_blocks = speculative_blocks;
    c
}

fn chat(system: &str, user: &str) -> Vec<u8> {
    serde_json::json!({"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]})
    .to_string()
    .into_bytes()
}

/// The full blocks a server would store for `body` (the router's own hashes).
fn full_blocks(body: &[u8]) -> Vec<u64> {
    let request = prefixroute_core::parse_request(body).unwrap();
    hash_request(
        &request,
        HashConfig {
            block_size: 4,
            include_partial: false,
            identity: BlockIdentity::TokenIds,
            ..HashConfig::default()
        },
    )
    .chains
    .concat()
}

fn server(e: usize, live: bool, stored: Vec<u64>, removed: Vec<u64>) -> FeedServer {
    FeedServer {
        address: format!("127.0.0.1:{}", 18000 + e),
        live,
        cleared: false,
        stored,
        removed,
        runs: Vec::new(),
    }
}

/// One feed round on `w`: claim, send, answer with `servers`.
fn feed(w: &mut Scheduler<MemShared>, now: u64, servers: Vec<FeedServer>, version: u64) {
    let path = w.claim_feed(now).expect("the feed fetch is due");
    assert!(path.starts_with("/v1/kv/feed?since="), "{path}");
    w.feed_sent(3);
    assert!(w.is_feed(3));
    let page = FeedPage {
        version,
        reset: false,
        servers,
    };
    assert!(w.feed_done(Some(200), &page.encode(), now));
}

fn matched(c: &Choice) -> usize {
    match c.route {
        Route::Routed { matched_blocks, .. } => matched_blocks,
        Route::Fallback(r) => panic!("{r:?}"),
    }
}

const SYSTEM: &str = "A long system prompt that every request of this tenant shares, word by word.";

#[test]
fn an_eviction_the_server_reports_is_no_longer_believed_and_the_approximate_index_misses_it() {
    for index in [IndexMode::Precise, IndexMode::Approximate] {
        let host = MemShared::new();
        let mut w = Scheduler::new(host.clone(), config(index, 4096));
        let first_body = chat(SYSTEM, "first question");
        let first = w.route(&first_body, 0);
        let e = first.endpoint;
        if index == IndexMode::Precise {
            // The server stored the prompt's blocks, later evicted them all.
            feed(
                &mut w,
                10,
                vec![server(e, true, full_blocks(&first_body), vec![])],
                5,
            );
            feed(
                &mut w,
                500,
                vec![server(e, true, vec![], full_blocks(&first_body))],
                9,
            );
        }
        let again = w.route(&chat(SYSTEM, "second question"), 1000);
        if index == IndexMode::Precise {
            assert_eq!(matched(&again), 0, "evicted on the server: not believed");
        } else {
            assert!(matched(&again) > 0, "the approximate belief still holds it");
        }
    }
}

#[test]
fn blocks_the_events_confirm_are_believed_beyond_the_speculative_window() {
    let host = MemShared::new();
    let mut w = Scheduler::new(host.clone(), config(IndexMode::Precise, 8));
    let body = chat(SYSTEM, "q");
    let e = w.route(&body, 0).endpoint;
    feed(
        &mut w,
        10,
        vec![server(e, true, full_blocks(&body), vec![])],
        3,
    );
    // Move e's clock far past the speculative window with other prompts routed there.
    for i in 0..6 {
        let other = chat(
            &format!("unrelated tenant {i} with its own prompt text here"),
            "x",
        );
        let c = w.route(&other, 20 + i);
        if c.endpoint != e {
            continue;
        }
    }
    let again = w.route(&chat(SYSTEM, "q2"), 100);
    assert_eq!(again.endpoint, e);
    assert_eq!(
        matched(&again),
        full_blocks(&body).len(),
        "confirmed blocks stay"
    );
}

#[test]
fn unconfirmed_blocks_stop_being_believed_after_the_speculative_window() {
    let host = MemShared::new();
    let mut w = Scheduler::new(host.clone(), config(IndexMode::Precise, 8));
    let body = chat(SYSTEM, "q");
    let e = w.route(&body, 0).endpoint;
    // Events flow for e, but never mention this prompt (the server did not keep it).
    feed(&mut w, 10, vec![server(e, true, vec![], vec![])], 1);
    let soon = w.route(&chat(SYSTEM, "q right after"), 20);
    assert!(
        matched(&soon) > 0,
        "inside the speculative window it is still believed"
    );
    let store = w.router.store_mut();
    store.begin_request();
    // 16 more stamps on e (other blocks recorded there) push the prompt out of the window.
    store.apply_truth(e, true, false, &(1000..1016).collect::<Vec<u64>>(), &[]);
    store.end_request();
    let later = w.route(&chat(SYSTEM, "q much later"), 30);
    let believed_there = later.endpoint == e && matched(&later) > 0;
    assert!(!believed_there, "{later:?}");
}

#[test]
fn an_endpoint_whose_events_stop_falls_back_to_the_approximate_belief() {
    let host = MemShared::new();
    let mut w = Scheduler::new(host.clone(), config(IndexMode::Precise, 8));
    let body = chat(SYSTEM, "q");
    let e = w.route(&body, 0).endpoint;
    feed(&mut w, 10, vec![server(e, true, vec![], vec![])], 1);
    let store = w.router.store_mut();
    store.begin_request();
    store.apply_truth(e, true, false, &(1000..1016).collect::<Vec<u64>>(), &[]);
    store.end_request();
    // Its publisher went away: precise is off for e, and the router's own record counts again.
    feed(&mut w, 500, vec![server(e, false, vec![], vec![])], 2);
    assert!(!w.router.store().with_endpoint_state(e, |s| s.precise));
    let again = w.route(&chat(SYSTEM, "q again"), 600);
    assert_eq!(again.endpoint, e);
    assert!(matched(&again) > 0);
    let events = w.drain_events();
    assert!(events
        .iter()
        .any(|ev| matches!(ev, Event::KvApplied { lost: 1, .. })));
}

#[test]
fn a_bad_or_failed_feed_changes_nothing_and_a_second_fetcher_defers_to_the_lease() {
    let host = MemShared::new();
    let mut w1 = Scheduler::new(host.clone(), config(IndexMode::Precise, 64));
    let mut w2 = Scheduler::new(host.clone(), config(IndexMode::Precise, 64));
    assert!(w1.claim_feed(0).is_some());
    assert!(
        w2.claim_feed(1).is_none(),
        "one fetch per interval across workers"
    );
    w1.feed_sent(1);
    assert!(!w1.feed_done(Some(200), b"<html>", 0));
    assert!(w1.claim_feed(300).is_some());
    w1.feed_sent(2);
    assert!(!w1.feed_done(Some(503), b"", 0));
    let events = w1.drain_events();
    assert!(events.contains(&Event::KvFeed(CalloutEnd::Unparseable)));
    assert!(events.contains(&Event::KvFeed(CalloutEnd::Failed)));
    assert!(!w1.router.store().with_endpoint_state(0, |s| s.precise));
    // Approximate mode never fetches.
    let mut a = Scheduler::new(host, config(IndexMode::Approximate, 64));
    assert!(a.claim_feed(10_000).is_none());
}

fn conversation(turns: &[&str]) -> Vec<u8> {
    let mut messages = vec![serde_json::json!({"role": "system", "content": SYSTEM})];
    for (i, text) in turns.iter().enumerate() {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        messages.push(serde_json::json!({"role": role, "content": text}));
    }
    serde_json::json!({"model": "m", "messages": messages})
        .to_string()
        .into_bytes()
}

/// Whether `body`'s believed match on `endpoint` continues an earlier request there.
fn continues(w: &mut Scheduler<MemShared>, endpoint: usize, body: &[u8]) -> Option<Turn> {
    let chain = full_blocks(body);
    let store = w.router.store_mut();
    store.begin_request();
    let turn = store.continues(endpoint, &chain, chain.len());
    let _ = store.end_request();
    turn
}

#[test]
fn a_run_of_blocks_marks_where_a_request_another_gateway_routed_ended() {
    // This gateway routed a conversation's first turn; another gateway (its own shared data)
    // routed the second, which this one learns of only from the server's events.
    let host = MemShared::new();
    let mut w = Scheduler::new(host.clone(), config(IndexMode::Precise, 4096));
    let first = conversation(&["first question with a few more words"]);
    let e = w.route(&first, 0).endpoint;
    let second = conversation(&[
        "first question with a few more words",
        "an answer the model gave, long enough to fill a block or two",
        "second question",
    ]);
    let (held, all) = (full_blocks(&first), full_blocks(&second));
    assert_eq!(
        all[..held.len()],
        held[..],
        "the second turn extends the first"
    );
    let new = all[held.len()..].to_vec();
    let run = StoredRun {
        parent: held.last().copied(),
        end: *all.last().unwrap(),
        blocks: new.len() as u32,
    };
    let mut page = server(e, true, new.clone(), vec![]);
    feed(&mut w, 10, vec![page.clone()], 5);
    assert_eq!(
        continues(&mut w, e, &second),
        None,
        "the blocks alone (a relay before runs): the second turn's end is unknown here"
    );
    page.stored.clear();
    page.runs = vec![run];
    w.clear_events();
    feed(&mut w, 400, vec![page], 6);
    assert_eq!(
        continues(&mut w, e, &second),
        Some(Turn::Later),
        "with the run: it continued the first turn, so the third continues a later one"
    );
    assert!(w
        .events()
        .iter()
        .any(|ev| matches!(ev, Event::KvApplied { ends: 1, .. })));
    // This gateway's own request is known: its run marks nothing more.
    let own = StoredRun {
        parent: None,
        end: *held.last().unwrap(),
        blocks: held.len() as u32,
    };
    let mut page = server(e, true, vec![], vec![]);
    page.runs = vec![own];
    w.clear_events();
    feed(&mut w, 800, vec![page], 7);
    assert!(w
        .events()
        .iter()
        .any(|ev| matches!(ev, Event::KvApplied { ends: 0, .. })));
    assert_eq!(continues(&mut w, e, &first), Some(Turn::First));
}

/// Answers `w`'s outstanding fetch with a page of `servers` at `version`.
fn answer(w: &mut Scheduler<MemShared>, now: u64, servers: Vec<FeedServer>, version: u64) {
    w.feed_sent(9);
    let page = FeedPage {
        version,
        reset: false,
        servers,
    };
    assert!(w.feed_done(Some(200), &page.encode(), now));
}

#[test]
fn a_long_poll_asks_again_as_soon_as_it_brings_news_or_was_held() {
    let host = MemShared::new();
    let mut w1 = Scheduler::new(host.clone(), config(IndexMode::Precise, 64));
    let mut w2 = Scheduler::new(host.clone(), config(IndexMode::Precise, 64));
    let path = w1.claim_feed(0).unwrap();
    assert!(path.ends_with("&wait_ms=1000&layout=2"), "{path}");
    assert_eq!(w1.feed_timeout_ms(), 1500, "the relay may hold it first");
    assert!(
        w2.claim_feed(900).is_none(),
        "the poll holds the lease while the relay may hold it"
    );
    // News after 40 ms: fetched again at once, by whichever worker ticks first.
    answer(&mut w1, 40, vec![server(0, true, vec![7], vec![])], 1);
    let path = w2.claim_feed(40).unwrap();
    assert!(path.contains("since=1&"), "{path}");
    // Held 800 ms with nothing new: again at once too.
    answer(&mut w2, 840, vec![], 1);
    assert!(w1.claim_feed(840).is_some());
    // Nothing new and not held (a relay that does not long poll): the next one is due an
    // interval after this one was sent, not at once.
    answer(&mut w1, 845, vec![], 1);
    assert!(w2.claim_feed(846).is_none());
    assert!(w2.claim_feed(1040).is_some());
    // A failed poll: due an interval after it was sent, not when its lease runs out.
    w2.feed_sent(10);
    assert!(!w2.feed_done(None, b"", 1500));
    assert!(w1.claim_feed(1239).is_none());
    assert!(w1.claim_feed(1240).is_some());
}

#[test]
fn without_a_wait_the_feed_is_polled_every_interval() {
    let host = MemShared::new();
    let mut c = config(IndexMode::Precise, 64);
    c.kv_events.wait_ms = 0;
    let mut w = Scheduler::new(host, c);
    let path = w.claim_feed(0).unwrap();
    assert!(path.ends_with("&wait_ms=0&layout=2"), "{path}");
    assert_eq!(w.feed_timeout_ms(), 500);
    answer(&mut w, 10, vec![server(0, true, vec![7], vec![])], 1);
    assert!(
        w.claim_feed(150).is_none(),
        "news does not fetch again early"
    );
    assert!(w.claim_feed(200).is_some());
}
