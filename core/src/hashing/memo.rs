//! A worker's memory of the chat messages (and long texts' segments) it has hashed.
//!
//! Requests repeat most of their text: the same system prompt, the same document, the earlier
//! turns of a conversation. Tokenizing and hashing that text again is most of what routing a
//! long prompt costs (counting its pieces and hashing its bytes; with token ids, FNV-1a's
//! multiply per byte, one after another). A message tokenizes on its own (its chat header
//! starts with `<`, which ends every piece before it), and its blocks depend only on its bytes
//! and the chain's state where it starts (the last full block's hash and the open block: its
//! tokens, or its bytes so far). So the memo keys each message by one xxh3 pass over its bytes,
//! seeded with that state, and keeps the blocks it completed and the state it left. A hit
//! appends those blocks: the answer is exactly what hashing the message would give (tested
//! against [`super::hash_request`]), at ~1 instruction per byte instead of ~40.
//!
//! A long message, or a completions prompt, often repeats only its beginning (a document, then
//! a new question): it is also known by its segments ([`super::segments`], cut where a word
//! starts, which changes no hash), each keyed the same way, so that only the segments after
//! the shared beginning are tokenized (see `ChainMemo::chain` for which are looked up and
//! kept).
//!
//! A text is remembered the second time it is met, not the first: a stream of prompts that
//! never repeat (batch jobs, agents, every first turn) then costs the memo one key each (of its
//! first segment's bytes only, for a long one) and pushes nothing out, and a hot system prompt
//! is tokenized twice, once more than without the memo's admission rule (the keys met once sit
//! in a direct-mapped table of `MAX_SEEN` slots: a key pushed out by another before it came back
//! is met "once" again).
//!
//! Memory is bounded by two generations: entries go into the young one; when it holds
//! `capacity_blocks / 2` blocks (or `MAX_ENTRIES / 2` entries) it becomes the old one and the
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

/// Mixed into the seed of the keys of messages read in place ([`Source::Message`]).
const RAW_KEYS: u64 = 0x7261_775f_6b65_7973;
/// Mixed into the seed of the keys of completions prompts read in place ([`Source::Prompt`]).
const RAW_TEXT_KEYS: u64 = 0x7261_775f_7465_7874;

/// Mixed into the seed of the keys of a text's last segment (or of a text of one segment): it
/// ends the text's run of bytes (and a message's line break follows it), which the same bytes
/// as a longer text's first or middle segment do not (found by the property test of one memo
/// shared by both readings: the two were keyed alike and left the open block apart).
const LAST_KEYS: u64 = 0x6c61_7374_5f73_6567;

/// Mixed into the seed of the key of a text of more than one segment, hashed on from its first
/// segment's key.
const WHOLE_KEYS: u64 = 0x7768_6f6c_655f_6b65;

/// When the memo remembers a text it does not hold (see [`ChainMemo::chain`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Admit {
    /// The second time it is met.
    Twice,
    /// The first time.
    Now,
}

/// A text the memo continues a chain with (see [`ChainMemo::chain`]).
#[derive(Debug, Clone, Copy)]
pub(super) enum Source<'a> {
    /// Text as it is tokenized: a part of `parse_request`'s prompt (a chat message with its
    /// header, or a completions prompt).
    Decoded(&'a [u8]),
    /// A chat message read in place: keyed by its role and its content's bytes as they are in
    /// the body, so a segment the memo holds is never decoded; written out as `parse_request`
    /// flattens it (`<|role|>\ncontent\n`, the header with the first segment and the line
    /// break with the last). Its cuts are found in the content's bytes as they lie.
    Message(&'a RawMessage<'a>),
    /// A completions prompt read in place: keyed by its bytes as they are in the body.
    Prompt(JsonStr<'a>),
}

impl<'a> Source<'a> {
    /// The bytes its cuts are found in, and the bytes it has more before its first segment and
    /// after its last once written out.
    fn layout(&self) -> (&'a [u8], usize, usize) {
        match *self {
            Source::Decoded(text) => (text, 0, 0),
            Source::Message(message) => {
                let [open, close] = crate::request::HEADER;
                let role = message.role.as_bytes();
                let header = open.len() + role.len() + close.len();
                let content = message.content.unwrap_or_default();
                (content.raw(), header, 1)
            }
            Source::Prompt(text) => (text.raw(), 0, 0),
        }
    }

    /// The memo's key of the segment `piece` met in the chain state `state`. Keys of texts
    /// read in place are seeded apart from the decoded texts' and from each other's, so that
    /// the raw bytes of one text never key another's decoded text (`a\nb` written out is
    /// another text than `a\nb` decoded); a message's role seeds its first segment's key (the
    /// header precedes it), and every text's last segment's is seeded apart ([`LAST_KEYS`]).
    fn key(&self, state: u64, piece: &[u8], edge: Edge) -> u64 {
        let seed = match *self {
            Source::Decoded(_) => state,
            Source::Message(message) if edge.first => {
                message_key(message.role.as_bytes(), state ^ RAW_KEYS)
            }
            Source::Message(_) => state ^ RAW_KEYS,
            Source::Prompt(_) => state ^ RAW_TEXT_KEYS,
        };
        // A last segment ends its text's run of bytes; the same bytes inside a longer text
        // leave the open block's bytes to the next segment: another state after them.
        message_key(piece, if edge.last { seed ^ LAST_KEYS } else { seed })
    }

    /// Continues `chain` with the segment `piece` (at most `bytes` long written out),
    /// written into `scratch` and tokenized from there.
    fn push(
        &self,
        edge: Edge,
        piece: &[u8],
        bytes: usize,
        chain: &mut Chainer,
        out: &mut Vec<u64>,
        scratch: &mut Vec<u8>,
    ) {
        scratch.clear();
        // And the tokenizer's stop byte after it.
        scratch.reserve(bytes + 1);
        self.write(scratch, piece, edge);
        chain.push_stopped(Stopped::stop(scratch), edge.last, out);
    }

    /// Writes the segment `piece` into `scratch` as it is tokenized.
    fn write(&self, scratch: &mut Vec<u8>, piece: &[u8], edge: Edge) {
        match *self {
            Source::Decoded(_) => scratch.extend_from_slice(piece),
            Source::Message(message) => {
                let [open, close] = crate::request::HEADER;
                if edge.first {
                    scratch.extend_from_slice(open.as_bytes());
                    scratch.extend_from_slice(message.role.as_bytes());
                    scratch.extend_from_slice(close.as_bytes());
                }
                if let Some(content) = message.content {
                    content.with_raw(piece).decode_into(scratch);
                }
                if edge.last {
                    scratch.push(b'\n');
                }
            }
            Source::Prompt(text) => text.with_raw(piece).decode_into(scratch),
        }
    }
}

/// Where a segment lies in its text.
#[derive(Debug, Clone, Copy)]
struct Edge {
    first: bool,
    last: bool,
}

impl Edge {
    /// A text of one segment.
    const WHOLE: Edge = Edge {
        first: true,
        last: true,
    };
    /// The first segment of a longer text.
    const FIRST: Edge = Edge {
        first: true,
        last: false,
    };
}

/// Segments shorter than this are hashed directly: a lookup would cost about what it saves.
pub const MIN_MESSAGE_BYTES: usize = 256;
/// Block hashes the memo keeps by default (two generations of half), 8 bytes each: 1 MB.
pub const DEFAULT_CAPACITY_BLOCKS: usize = 131_072;
/// Texts and segments held (a 64 KB prompt is ~30 segments).
const MAX_ENTRIES: usize = 4_096;
/// Keys of texts and segments met once, remembered to admit them when met again.
const MAX_SEEN: usize = 4_096;

/// The memo's key of `bytes` met in the chain state `seed`: xxh3 of the bytes, mixed with the
/// seed. A key reads every byte it keys (all of a text met before, the first segment of a
/// long one that was not): xxh3's long-input loop takes 64 bytes a step (wasm SIMD in the
/// plugin), ~4x fewer wasm instructions per byte than xxh64's chain of multiplies
/// (docs/benchmarks.md). Unseeded, so it never derives a secret from the seed; the seed is
/// mixed in after.
fn message_key(bytes: &[u8], seed: u64) -> u64 {
    xxh64_pair(xxh3_64(bytes), seed)
}

/// What hashing one segment of a text did to a chain.
#[derive(Debug, Clone)]
struct Segment {
    /// The segment's length, checked on a hit (a second guard beside the 64-bit key).
    bytes: usize,
    tokens: usize,
    /// The full blocks the segment completed.
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
    /// Room for a segment written out to be tokenized (see [`ChainMemo::chain`]): kept here so
    /// that a request allocates none.
    scratch: Vec<u8>,
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

    /// Continues `chain` with the tokens of `text`, appending the blocks it completes to
    /// `out`: from memory when the text was met whole in the same state before, else segment
    /// by segment ([`super::segments`]), each from memory when it was met in the same state
    /// before, else by hashing it. What is hashed is written out first (decoded, for a text
    /// read in place); a text under [`MIN_MESSAGE_BYTES`] is not looked up.
    ///
    /// A text of more than one segment is first known by its first segment: if that was never
    /// met, neither was the text, and the whole of it is hashed at once, for the cost of one
    /// key of its first segment's bytes (a prompt never met, the common cold case, costs less
    /// than a key of all its bytes did). Else the whole text is looked up: a system prompt or a
    /// document met in full before (most long texts of a warm chat) is one lookup. Else its
    /// segments are, the first remembered the second time it is met and the ones after it the
    /// first time (a document repeated, now followed by a new question), but the last (the part
    /// that is likely new), remembered the second time; the whole text is remembered the
    /// second time it is met.
    pub(super) fn chain(&mut self, text: Source<'_>, chain: &mut Chainer, out: &mut Vec<u64>) {
        // Taken out while the memo is borrowed for the lookups, and put back.
        let mut scratch = std::mem::take(&mut self.scratch);
        let scratch = &mut scratch;
        let (cut, before, after) = text.layout();
        let bytes = cut.len() + before + after;
        let whole = Edge::WHOLE;
        // Where its first segment ends (a text shorter than a segment is one).
        let first_end = super::segments::segment_end(cut, 0);
        if bytes < MIN_MESSAGE_BYTES {
            text.push(whole, cut, bytes, chain, out, scratch);
        } else if first_end == cut.len() {
            let key = text.key(chain.state_key(), cut, whole);
            let segment = (whole, cut, bytes);
            self.chain_keyed(key, Admit::Twice, text, segment, chain, out, scratch);
        } else {
            let first_key = text.key(chain.state_key(), &cut[..first_end], Edge::FIRST);
            if !self.known(first_key) {
                self.stats.misses += 1;
                self.admits(first_key, Admit::Twice);
                text.push(whole, cut, bytes, chain, out, scratch);
            } else {
                // Its first segment's key covers the chain's state and those bytes: the rest
                // of the bytes are hashed on from it, each byte once.
                let key = message_key(&cut[first_end..], first_key ^ WHOLE_KEYS);
                if !self.recall(key, bytes, chain, out) {
                    let remember = self.admits(key, Admit::Twice);
                    let (start, tokens) = (out.len(), chain.count());
                    self.chain_segments(text, (first_end, first_key), chain, out, scratch);
                    if remember {
                        self.remember(key, bytes, start, tokens, chain, out);
                    }
                }
            }
        }
        self.scratch = std::mem::take(scratch);
    }

    /// [`ChainMemo::chain`] of a text of more than one segment, its first (ending at
    /// `first_end`, keyed `first_key`) met before: segment by segment.
    fn chain_segments(
        &mut self,
        text: Source<'_>,
        (first_end, first_key): (usize, u64),
        chain: &mut Chainer,
        out: &mut Vec<u64>,
        scratch: &mut Vec<u8>,
    ) {
        let (cut, before, after) = text.layout();
        let segment = (Edge::FIRST, &cut[..first_end], first_end + before);
        self.chain_keyed(first_key, Admit::Twice, text, segment, chain, out, scratch);
        let mut start = first_end;
        while start < cut.len() {
            let end = super::segments::segment_end(cut, start);
            let last = end == cut.len();
            let edge = Edge { first: false, last };
            let piece = &cut[start..end];
            // At most this long once written out (escapes only shorten it).
            let bytes = piece.len() + usize::from(last) * after;
            let admit = if last { Admit::Twice } else { Admit::Now };
            let key = text.key(chain.state_key(), piece, edge);
            self.chain_keyed(key, admit, text, (edge, piece, bytes), chain, out, scratch);
            start = end;
        }
    }

    /// The memo's lookup, admission and insertion for the segment `piece` of `text` (where
    /// `edge` says, at most `bytes` long written out) keyed `key`: pushed into the chain
    /// ([`Source::push`]) when it is not held.
    #[allow(clippy::too_many_arguments)]
    fn chain_keyed(
        &mut self,
        key: u64,
        admit: Admit,
        text: Source<'_>,
        (edge, piece, bytes): (Edge, &[u8], usize),
        chain: &mut Chainer,
        out: &mut Vec<u64>,
        scratch: &mut Vec<u8>,
    ) {
        if self.recall(key, bytes, chain, out) {
            return;
        }
        let remember = self.admits(key, admit);
        let (start, tokens) = (out.len(), chain.count());
        text.push(edge, piece, bytes, chain, out, scratch);
        if remember {
            self.remember(key, bytes, start, tokens, chain, out);
        }
    }

    /// Whether `key` was met before: held, or noted among the keys met once.
    fn known(&self, key: u64) -> bool {
        self.young.contains_key(&key)
            || self.old.contains_key(&key)
            || self.seen[(key % MAX_SEEN as u64) as usize] == key
    }

    /// Continues `chain` from memory with the text keyed `key`, `bytes` long: false (and
    /// nothing done) if the memo does not hold it.
    fn recall(&mut self, key: u64, bytes: usize, chain: &mut Chainer, out: &mut Vec<u64>) -> bool {
        let held = self.get(key, bytes).is_some_and(|segment| {
            // The partial block always fits (the key's seed holds the block size); checked
            // anyway, since this runs in the data plane: a mismatch hashes the text.
            chain.resume((segment.parent, &segment.partial), segment.tokens) && {
                out.extend_from_slice(&segment.blocks);
                true
            }
        });
        if held {
            self.stats.hits += 1;
        } else {
            self.stats.misses += 1;
        }
        held
    }

    /// Whether a text keyed `key` that the memo does not hold is to be remembered once hashed:
    /// with [`Admit::Twice`], if its key was met once before (else the key is noted).
    fn admits(&mut self, key: u64, admit: Admit) -> bool {
        if admit == Admit::Now {
            return true;
        }
        let slot = &mut self.seen[(key % MAX_SEEN as u64) as usize];
        let again = *slot == key;
        *slot = if again { 0 } else { key };
        again
    }

    /// Remembers what hashing the text keyed `key` did: the blocks it appended to `out` from
    /// `start`, the tokens it added to the `tokens` the chain had, the state it left.
    fn remember(
        &mut self,
        key: u64,
        bytes: usize,
        start: usize,
        tokens: usize,
        chain: &Chainer,
        out: &[u64],
    ) {
        let (parent, partial) = chain.state();
        let segment = Segment {
            bytes,
            tokens: chain.count() - tokens,
            blocks: out[start..].to_vec(),
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
        // One segment.
        let system = text(1, 250);
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
        let other = chat(&[("system", text(2, 250)), ("user", "why?".into())]);
        hash_request_memo(&parse_request(&other).unwrap(), CONFIG, &mut memo);
        assert_eq!(memo.stats().misses, 3);
    }

    /// A completions prompt (or a chat message) of a long document and a question in one text:
    /// the whole text is never met twice; its segments are met again.
    #[test]
    fn a_long_shared_prefix_inside_one_text_is_taken_from_memory_but_its_last_segment() {
        let mut memo = ChainMemo::default();
        let document = text(4, 2_000);
        let segments = {
            let mut n = 0;
            let prompt = format!("{document} question number 0: why?");
            let mut start = 0;
            while start < prompt.len() {
                start = super::super::segments::segment_end(prompt.as_bytes(), start);
                n += 1;
            }
            n
        };
        assert!(segments >= 5, "{segments} segments");
        for i in 0..6 {
            let prompt = format!("{document} question number {i}: why?");
            let body = serde_json::json!({"model": "m", "prompt": prompt}).to_string();
            let request = parse_request(body.as_bytes()).unwrap();
            let before = memo.stats();
            assert_eq!(
                hash_request_memo(&request, CONFIG, &mut memo),
                hash_request(&request, CONFIG)
            );
            let (hits, misses) = (
                memo.stats().hits - before.hits,
                memo.stats().misses - before.misses,
            );
            // From the second time on, the whole text (another question each time) is looked up
            // before its segments.
            match i {
                // Its first segment never met: nothing else is looked up.
                0 => assert_eq!((hits, misses), (0, 1)),
                // Met twice: the first segment and the ones after it are remembered now; the
                // last one (the question in it) is met once.
                1 => assert_eq!((hits, misses), (0, 1 + segments as u64)),
                // Every segment but the last from memory.
                _ => assert_eq!((hits, misses), (segments as u64 - 1, 1 + 1), "request {i}"),
            }
        }
        assert_eq!(memo.len(), segments - 1);
    }

    /// A prompt of one segment whose bytes are another prompt's first segment: the first ends
    /// its run of bytes (its last block hashes them), the second leaves them to its next
    /// segment. Keyed alike, the memo gave the second's state to the first.
    #[test]
    fn a_text_of_one_segment_is_not_taken_for_a_longer_texts_first() {
        use crate::hashing::segments::segment_end;
        // The second "question" of the longer prompt starts just past 2 KB: a cut there.
        let start = format!("{}x question ", "w ".repeat(1020));
        let (short, long) = (start.clone(), format!("{start}question "));
        assert_eq!(segment_end(short.as_bytes(), 0), short.len());
        assert_eq!(segment_end(long.as_bytes(), 0), short.len());
        let mut memo = ChainMemo::default();
        for prompt in [&long, &long, &long, &short, &short, &short] {
            let body = serde_json::json!({"model": "m", "prompt": prompt}).to_string();
            let request = parse_request(body.as_bytes()).unwrap();
            assert_eq!(
                hash_request_memo(&request, CONFIG, &mut memo),
                hash_request(&request, CONFIG),
                "{} bytes",
                prompt.len()
            );
        }
    }

    #[test]
    fn prompts_that_never_repeat_push_nothing_out_of_the_memo() {
        let mut memo = ChainMemo::new(2_000);
        let system = chat(&[("system", text(1, 250))]);
        for _ in 0..3 {
            hash_request_memo(&parse_request(&system).unwrap(), CONFIG, &mut memo);
        }
        let hits = memo.stats().hits;
        for seed in 10..(10 + 3 * MAX_SEEN / 2) {
            // Long enough to be cut into segments: one key each (its first segment's).
            let body = chat(&[("system", format!("request {seed}. {}", text(seed, 700)))]);
            let misses = memo.stats().misses;
            hash_request_memo(&parse_request(&body).unwrap(), CONFIG, &mut memo);
            assert_eq!(memo.stats().misses, misses + 1);
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
