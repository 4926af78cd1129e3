//! A worker's memory of the chat messages it has hashed.
//!
//! Requests repeat most of their text: the same system prompt, the same document, the earlier
//! turns of a conversation. Tokenizing and hashing that text again is most of what routing a
//! long prompt costs (counting its pieces and hashing its bytes; with token ids, FNV-1a's
//! multiply per byte, one after another). A message tokenizes on its own (its chat header
//! starts with `<`, which ends every piece before it), and its blocks depend only on its bytes
//! and the chain's state where it starts (the last full block's hash and the open block: its
//! tokens, or the hash of its bytes so far). So the memo keys each message by one xxh3 pass over
//! its bytes, seeded with that state, and keeps the blocks it completed and the state it left.
//! A hit appends those blocks: the answer is exactly what hashing the message would give
//! (tested against [`super::hash_request`]), at ~1 instruction per byte instead of ~40.
//!
//! A message is remembered the second time it is met, not the first: a stream of prompts that
//! never repeat (batch jobs, agents, every first turn) then costs the memo one key each and
//! pushes nothing out, and a hot system prompt is tokenized twice, once more than without the
//! memo's admission rule (the keys met once sit in a direct-mapped table of `MAX_SEEN` slots:
//! a key pushed out by another before it came back is met "once" again).
//!
//! Memory is bounded by two generations: entries go into the young one; when it holds
//! `capacity_blocks / 2` blocks (or `MAX_ENTRIES / 2` messages) it becomes the old one and the
//! old one is dropped; a hit in the old generation moves the entry to the young one. So what
//! was used within the last half of the capacity stays, as in an LRU, at O(1) per request.
//! The default half holds about sixty 64 KB system prompts.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use xxhash_rust::xxh3::xxh3_64;

use super::fixed::xxh64_pair;
use super::{Chainer, Partial};
use crate::request::{JsonStr, RawMessage};
use crate::tokenizer::Stopped;

/// Mixed into the seed of the keys of messages read in place (see [`ChainMemo::chain_raw`]).
const RAW_KEYS: u64 = 0x7261_775f_6b65_7973;
/// Mixed into the seed of the keys of completions prompts read in place
/// ([`ChainMemo::chain_raw_text`]): their bytes as written must never key a decoded text that
/// has the same bytes (`a\nb` written out is another text than `a\nb` decoded).
const RAW_TEXT_KEYS: u64 = 0x7261_775f_7465_7874;

/// Messages shorter than this are hashed directly: a lookup would cost about what it saves.
pub const MIN_MESSAGE_BYTES: usize = 256;
/// Block hashes the memo keeps by default (two generations of half), 8 bytes each: 1 MB.
pub const DEFAULT_CAPACITY_BLOCKS: usize = 131_072;
const MAX_ENTRIES: usize = 1_024;
/// Keys of messages met once, remembered to admit them when met again.
const MAX_SEEN: usize = 4_096;

/// The memo's key of `bytes` met in the chain state `seed`: xxh3 of the bytes, mixed with the
/// seed. A key reads every byte of every message the memo is asked about, hits and misses
/// alike: xxh3's long-input loop takes 64 bytes a step (wasm SIMD in the plugin), ~4x fewer
/// wasm instructions per byte than xxh64's chain of multiplies (docs/benchmarks.md). Unseeded,
/// so it never derives a secret from the seed; the seed is mixed in after.
fn message_key(bytes: &[u8], seed: u64) -> u64 {
    xxh64_pair(xxh3_64(bytes), seed)
}

/// What hashing one message did to a chain.
#[derive(Debug, Clone)]
struct Segment {
    /// The message's length, checked on a hit (a second guard beside the 64-bit key).
    bytes: usize,
    tokens: usize,
    /// The full blocks the message completed.
    blocks: Vec<u64>,
    /// The chain's state after it: last hash and open block.
    parent: u64,
    partial: Partial,
}

/// Hits and misses since the memo was made (misses count only messages long enough to keep).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoStats {
    pub hits: u64,
    pub misses: u64,
}

/// The keys are hash values already: use them as they are.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type Map = HashMap<u64, Segment, BuildHasherDefault<KeyHasher>>;

/// See the module documentation.
#[derive(Debug)]
pub struct ChainMemo {
    young: Map,
    old: Map,
    young_blocks: usize,
    capacity_blocks: usize,
    /// Keys met once and not remembered yet, each in the slot its low bits name.
    seen: Vec<u64>,
    stats: MemoStats,
    /// Room for a chat message read in place, flattened to be tokenized (see
    /// [`ChainMemo::chain_raw`]): kept here so that a request allocates none.
    pub(super) scratch: Vec<u8>,
}

impl Default for ChainMemo {
    fn default() -> Self {
        ChainMemo::new(DEFAULT_CAPACITY_BLOCKS)
    }
}

impl ChainMemo {
    /// A memo that keeps about `capacity_blocks` block hashes (at least the young half of it).
    pub fn new(capacity_blocks: usize) -> ChainMemo {
        ChainMemo {
            young: Map::default(),
            old: Map::default(),
            young_blocks: 0,
            capacity_blocks,
            // Made here, not on a request's path (32 KB to zero).
            seen: vec![0; MAX_SEEN],
            stats: MemoStats::default(),
            scratch: Vec::new(),
        }
    }

    pub fn stats(&self) -> MemoStats {
        self.stats
    }

    /// Messages held.
    pub fn len(&self) -> usize {
        self.young.len() + self.old.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Continues `chain` with the tokens of `message`, appending the blocks it completes to
    /// `out`: from memory when the message was met in the same state before, else by hashing it
    /// (and remembering it when it is long enough).
    pub(super) fn chain(&mut self, message: &str, chain: &mut Chainer, out: &mut Vec<u64>) {
        if message.len() < MIN_MESSAGE_BYTES {
            chain.push_text(message, out);
            return;
        }
        let key = message_key(message.as_bytes(), chain.state_key());
        self.chain_keyed(key, message.len(), chain, out, |chain, out| {
            chain.push_text(message, out)
        });
    }

    /// [`ChainMemo::chain`] for a chat message read in place: keyed by its role and its
    /// content's bytes as they are in the body, so a message the memo holds is never decoded;
    /// `scratch` takes its text (`<|role|>\ncontent\n`, as `parse_request` flattens it) only
    /// when it has to be tokenized.
    pub(super) fn chain_raw(
        &mut self,
        message: &RawMessage,
        chain: &mut Chainer,
        out: &mut Vec<u64>,
        scratch: &mut Vec<u8>,
    ) {
        let content = message.content.map_or(&[][..], |c| c.raw());
        let [open, close] = crate::request::HEADER;
        // The flattened message is at most this long (escapes only shorten it).
        let bytes = open.len() + message.role.len() + close.len() + content.len() + 1;
        // Seeded apart from the decoded messages' keys, so that the raw bytes of one message
        // never key another's decoded text; the role's hash seeds the content's.
        let key = |chain: &Chainer| {
            let role = message_key(message.role.as_bytes(), chain.state_key() ^ RAW_KEYS);
            message_key(content, role)
        };
        self.chain_in_place(bytes, key, chain, out, scratch, |scratch| {
            scratch.extend_from_slice(open.as_bytes());
            scratch.extend_from_slice(message.role.as_bytes());
            scratch.extend_from_slice(close.as_bytes());
            if let Some(c) = message.content {
                c.decode_into(scratch);
            }
            scratch.push(b'\n');
        });
    }

    /// [`ChainMemo::chain`] for a completions prompt read in place: keyed by its bytes as they
    /// are in the body (seeded apart from both kinds of message keys), decoded into `scratch`
    /// only when it has to be tokenized.
    pub(super) fn chain_raw_text(
        &mut self,
        text: JsonStr,
        chain: &mut Chainer,
        out: &mut Vec<u64>,
        scratch: &mut Vec<u8>,
    ) {
        let raw = text.raw();
        let key = |chain: &Chainer| message_key(raw, chain.state_key() ^ RAW_TEXT_KEYS);
        self.chain_in_place(raw.len(), key, chain, out, scratch, |scratch| {
            text.decode_into(scratch)
        });
    }

    /// Continues `chain` with a text read in place, at most `bytes` long once decoded: `fill`
    /// writes it into `scratch`, and it is tokenized from there only when the memo does not
    /// hold it under `key(chain)` (a text under [`MIN_MESSAGE_BYTES`] is not looked up).
    fn chain_in_place(
        &mut self,
        bytes: usize,
        key: impl FnOnce(&Chainer) -> u64,
        chain: &mut Chainer,
        out: &mut Vec<u64>,
        scratch: &mut Vec<u8>,
        fill: impl Fn(&mut Vec<u8>),
    ) {
        let mut push = |chain: &mut Chainer, out: &mut Vec<u64>| {
            scratch.clear();
            // And the tokenizer's stop byte after it.
            scratch.reserve(bytes + 1);
            fill(scratch);
            chain.push_stopped(Stopped::stop(scratch), out);
        };
        if bytes < MIN_MESSAGE_BYTES {
            push(chain, out);
            return;
        }
        let key = key(chain);
        self.chain_keyed(key, bytes, chain, out, push);
    }

    /// The memo's lookup, admission and insertion for a message keyed `key` whose text is
    /// `bytes` long; `tokenize` pushes its tokens into the chain when it is not held.
    fn chain_keyed(
        &mut self,
        key: u64,
        bytes: usize,
        chain: &mut Chainer,
        out: &mut Vec<u64>,
        tokenize: impl FnOnce(&mut Chainer, &mut Vec<u64>),
    ) {
        if let Some(segment) = self.get(key, bytes) {
            // The partial block always fits (the key's seed holds the block size); checked
            // anyway, since this runs in the data plane: a mismatch hashes the message.
            if chain.resume((segment.parent, &segment.partial), segment.tokens) {
                out.extend_from_slice(&segment.blocks);
                self.stats.hits += 1;
                return;
            }
        }
        self.stats.misses += 1;
        let slot = &mut self.seen[(key % MAX_SEEN as u64) as usize];
        if *slot != key {
            // Met for the first time: remember the key only.
            *slot = key;
            tokenize(chain, out);
            return;
        }
        *slot = 0;
        let (before, tokens) = (out.len(), chain.count());
        tokenize(chain, out);
        let (parent, partial) = chain.state();
        let segment = Segment {
            bytes,
            tokens: chain.count() - tokens,
            blocks: out[before..].to_vec(),
            parent,
            partial,
        };
        self.insert(key, segment);
    }

    fn get(&mut self, key: u64, bytes: usize) -> Option<&Segment> {
        if !self.young.contains_key(&key) {
            let segment = self.old.remove(&key)?;
            self.insert(key, segment);
        }
        self.young.get(&key).filter(|s| s.bytes == bytes)
    }

    fn insert(&mut self, key: u64, segment: Segment) {
        let half = self.capacity_blocks / 2;
        let weight = segment.blocks.len() + 1;
        if weight > half {
            return;
        }
        if self.young_blocks + weight > half || self.young.len() >= MAX_ENTRIES / 2 {
            self.old = std::mem::take(&mut self.young);
            self.young_blocks = 0;
        }
        self.young_blocks += weight;
        if let Some(replaced) = self.young.insert(key, segment) {
            self.young_blocks -= replaced.blocks.len() + 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::{
        hash_request, hash_request_memo, hash_request_memo_into, BlockHashes, HashConfig,
    };
    use crate::request::parse_request;
    use proptest::prelude::*;

    /// A message of about `words` words, different for each `seed`.
    fn text(seed: usize, words: usize) -> String {
        let vocab = [
            "alpha", "beta,", "gamma", "delta.", "x_y", "42", "(z)", "über", "\n",
        ];
        (0..words)
            .map(|i| vocab[(seed * 31 + i * 7 + i * i) % vocab.len()])
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn chat(messages: &[(&str, String)]) -> Vec<u8> {
        let messages: Vec<_> = messages
            .iter()
            .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
            .collect();
        serde_json::json!({"model": "m", "messages": messages})
            .to_string()
            .into_bytes()
    }

    const CONFIG: HashConfig = HashConfig {
        block_size: 16,
        include_partial: true,
        non_ascii: crate::tokenizer::NonAscii::Pieces,
        identity: crate::hashing::BlockIdentity::Text,
    };

    #[test]
    fn hashing_into_the_vectors_of_an_earlier_request_gives_what_hashing_afresh_gives() {
        let mut memo = ChainMemo::default();
        let mut out = BlockHashes::default();
        let long = text(2, 400);
        let bodies = [
            chat(&[("system", long.clone()), ("user", "why?".to_string())]),
            br#"{"model":"m","prompt":["a b c d e f g h i j","x y z"]}"#.to_vec(),
            br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9]}"#.to_vec(),
            chat(&[("user", "short".to_string())]),
            chat(&[("system", long), ("user", "and then?".to_string())]),
            br#"{"model":"m","prompt":""}"#.to_vec(),
        ];
        // Longer and shorter, more and fewer prompts, text and token ids, in turn.
        for (i, body) in bodies.iter().enumerate() {
            let request = parse_request(body).unwrap();
            hash_request_memo_into(&request, CONFIG, &mut memo, &mut out);
            assert_eq!(out, hash_request(&request, CONFIG), "request {i}");
        }
    }

    #[test]
    fn a_repeated_system_prompt_is_hashed_from_memory_from_its_third_time_on() {
        let mut memo = ChainMemo::default();
        let system = text(1, 400);
        let questions = ["why?", "how so?", "and then?", "so?"];
        for (i, question) in questions.iter().enumerate() {
            let body = chat(&[("system", system.clone()), ("user", question.to_string())]);
            let request = parse_request(&body).unwrap();
            assert_eq!(
                hash_request_memo(&request, CONFIG, &mut memo),
                hash_request(&request, CONFIG)
            );
            // Met once: its key; twice: remembered; then taken from memory.
            assert_eq!(memo.stats().hits, i.saturating_sub(1) as u64, "request {i}");
            assert_eq!(memo.len(), usize::from(i > 0), "request {i}");
        }
        assert_eq!(memo.stats().misses, 2);
        // Another system prompt is not a hit.
        let other = chat(&[("system", text(2, 400)), ("user", "why?".into())]);
        hash_request_memo(&parse_request(&other).unwrap(), CONFIG, &mut memo);
        assert_eq!(memo.stats().misses, 3);
    }

    #[test]
    fn prompts_that_never_repeat_push_nothing_out_of_the_memo() {
        let mut memo = ChainMemo::new(2_000);
        let system = chat(&[("system", text(1, 400))]);
        for _ in 0..3 {
            hash_request_memo(&parse_request(&system).unwrap(), CONFIG, &mut memo);
        }
        let hits = memo.stats().hits;
        for seed in 10..(10 + 3 * MAX_SEEN / 2) {
            let body = chat(&[("system", format!("request {seed}. {}", text(seed, 60)))]);
            hash_request_memo(&parse_request(&body).unwrap(), CONFIG, &mut memo);
        }
        assert_eq!(
            memo.len(),
            1,
            "only the system prompt met more than once is kept"
        );
        hash_request_memo(&parse_request(&system).unwrap(), CONFIG, &mut memo);
        assert_eq!(memo.stats().hits, hits + 1);
    }

    #[test]
    fn a_message_met_in_another_chain_state_is_not_taken_from_memory() {
        // The same document after two different system prompts: different blocks.
        let mut memo = ChainMemo::default();
        let document = text(3, 300);
        for system in ["be brief", "be thorough and cite"] {
            let body = chat(&[("system", system.into()), ("user", document.clone())]);
            let request = parse_request(&body).unwrap();
            assert_eq!(
                hash_request_memo(&request, CONFIG, &mut memo),
                hash_request(&request, CONFIG)
            );
        }
        assert_eq!(memo.stats(), MemoStats { hits: 0, misses: 2 });
        assert!(memo.is_empty(), "each met once");
    }

    #[test]
    fn the_memo_keeps_no_more_blocks_than_its_capacity() {
        let capacity = 400;
        let mut memo = ChainMemo::new(capacity);
        for seed in 0..200 {
            let body = chat(&[("system", text(seed, 100 + seed % 50))]);
            // Twice each, so each is remembered.
            hash_request_memo(&parse_request(&body).unwrap(), CONFIG, &mut memo);
            hash_request_memo(&parse_request(&body).unwrap(), CONFIG, &mut memo);
            let held: usize = memo
                .young
                .values()
                .chain(memo.old.values())
                .map(|s| s.blocks.len() + 1)
                .sum();
            assert!(held <= capacity, "{held} blocks held after {seed} messages");
        }
        assert!(!memo.is_empty());
    }

    proptest! {
        /// Any sequence of chats drawn from a few messages (so some repeat, in other places,
        /// after other messages), with any block size and a memo small enough to rotate,
        /// hashes exactly as without the memo.
        #[test]
        fn hashing_through_the_memo_changes_no_result(
            chats in proptest::collection::vec(
                proptest::collection::vec((0usize..3, 0usize..6), 1..5), 1..12),
            block_size in 1usize..20,
            include_partial in any::<bool>(),
            capacity in 0usize..300,
        ) {
            let config = HashConfig { block_size, include_partial, ..HashConfig::default() };
            let roles = ["system", "user", "assistant"];
            let mut memo = ChainMemo::new(capacity);
            for messages in &chats {
                let messages: Vec<(&str, String)> = messages
                    .iter()
                    .map(|&(role, m)| (roles[role], text(m, if m < 3 { 80 } else { 5 })))
                    .collect();
                let request = parse_request(&chat(&messages)).unwrap();
                prop_assert_eq!(
                    hash_request_memo(&request, config, &mut memo),
                    hash_request(&request, config)
                );
            }
        }

        /// Completions prompts (one message each, no boundaries) too.
        #[test]
        fn completions_prompts_through_the_memo_hash_alike(
            prompts in proptest::collection::vec(0usize..4, 1..8),
            block_size in 1usize..20,
        ) {
            let config = HashConfig { block_size, include_partial: true, ..HashConfig::default() };
            let mut memo = ChainMemo::default();
            for &p in &prompts {
                let body = serde_json::json!({"model": "m", "prompt": text(p, 90)}).to_string();
                let request = parse_request(body.as_bytes()).unwrap();
                prop_assert_eq!(
                    hash_request_memo(&request, config, &mut memo),
                    hash_request(&request, config)
                );
            }
        }
    }
}
