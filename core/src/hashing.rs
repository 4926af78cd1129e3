//! Tokens → chained block hashes.
//!
//! As in vLLM and llm-d, a block's hash covers its own tokens *and* the hash of the block
//! before it, so one hash names the whole prefix up to the end of its block. "The longest run
//! of leading hashes an endpoint knows" is then exactly "the longest shared prefix".
//!
//! What a block's own part is made of is [`BlockIdentity`]'s choice: its token ids, as the
//! servers hash them, or its text.

use xxhash_rust::xxh64::{xxh64, Xxh64};

use crate::request::{ParsedRequest, Prompt, RawPrompt, RawRequest};
use crate::tokenizer::{cut_blocks, for_each_token_at, for_each_token_stopped, NonAscii, Stopped};

/// What a block's hash is made of, besides the block before it. The blocks are cut alike either
/// way, every `block_size` tokens (so token counts, blocks and marks are the same); only the
/// numbers differ.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum BlockIdentity {
    /// The block's bytes, from its first token's piece to the next block's (xxh64): the router's
    /// own identity, compared with nothing but its own (`index: approximate`). No token is
    /// numbered or visited: the pieces are counted 64 bytes at a time from bit masks, and only
    /// the piece that ends a block is looked for (`tokenizer::cut_blocks`). On a prompt the
    /// router has never seen this is most of what routing costs (docs/benchmarks.md). A chat's
    /// blocks are hashed message by message: a block that spans messages hashes each one's
    /// part in turn. A block that spans the segments a long message is looked up in (`segments`)
    /// hashes its bytes in that message as one run: the segments change no hash.
    #[default]
    Text,
    /// The block's token ids, FNV-1a of each piece as llm-d-inference-sim and
    /// `prefixroute serve` number them, then xxh64 as vLLM's chained hash: what
    /// `index: precise` needs, since the servers' KV events carry hashes of their ids.
    TokenIds,
}

/// How prompts are cut into blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HashConfig {
    /// Tokens per block; vLLM's default on GPUs is 16.
    pub block_size: usize,
    /// Hash the final, partial block too. The router does (so a short prompt still has an
    /// identity); a server caches full blocks only, so the replica model turns this off.
    pub include_partial: bool,
    /// What the tokenizer does with a character outside ASCII.
    #[serde(default)]
    pub non_ascii: NonAscii,
    /// What a block's hash is made of: its text (the router's own), or its token ids as the
    /// servers hash them (`index: precise`).
    #[serde(default)]
    pub identity: BlockIdentity,
}

impl Default for HashConfig {
    fn default() -> Self {
        HashConfig {
            block_size: 16,
            include_partial: true,
            non_ascii: NonAscii::default(),
            identity: BlockIdentity::default(),
        }
    }
}

/// The seed every chain starts from. Each field is length-prefixed so that
/// ("ab", "c") and ("a", "bc") give different seeds; a request without a salt hashes like an
/// empty salt.
pub fn chain_seed(model: &str, cache_salt: &str) -> u64 {
    let mut h = Xxh64::new(0);
    h.update(&(model.len() as u64).to_le_bytes());
    h.update(model.as_bytes());
    h.update(&(cache_salt.len() as u64).to_le_bytes());
    h.update(cache_salt.as_bytes());
    h.digest()
}

/// The hash of one block given its tokens and the previous block's hash (or the seed):
/// xxh64 of the token ids as little-endian bytes, then xxh64 of that hash and the parent's.
pub fn block_hash(tokens: &[u32], parent: u64) -> u64 {
    let own = match <&[u32; 16]>::try_from(tokens) {
        // vLLM's default block size on GPUs: the specialised hash (see `fixed`).
        Ok(block) => fixed::xxh64_64(&std::array::from_fn(|i| {
            u64::from(block[2 * i]) | u64::from(block[2 * i + 1]) << 32
        })),
        Err(_) => {
            let mut h = Xxh64::new(0);
            for t in tokens {
                h.update(&t.to_le_bytes());
            }
            h.digest()
        }
    };
    fixed::xxh64_pair(own, parent)
}

/// Chained hashes of `tokens`, appended to `out`.
pub fn chain_hashes_into(tokens: &[u32], seed: u64, config: HashConfig, out: &mut Vec<u64>) {
    let block_size = config.block_size.max(1);
    let mut parent = seed;
    for block in tokens.chunks(block_size) {
        if block.len() < block_size && !config.include_partial {
            break;
        }
        parent = block_hash(block, parent);
        out.push(parent);
    }
}

/// Chained hashes of `tokens`.
pub fn chain_hashes(tokens: &[u32], seed: u64, config: HashConfig) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len() / config.block_size.max(1) + 1);
    chain_hashes_into(tokens, seed, config, &mut out);
    out
}

/// Message boundaries kept per chain at each end of its messages
/// ([`BlockHashes::marks`]): the first (a system prompt, a conversation's first exchange: what
/// other groups and the group's home share) and the last (the previous turn's prompt, the
/// history before the new message). The belief records a position for each boundary kept
/// (and the grid of its gap), so keeping every one made a cold request's shared-data writes
/// grow with its message count: an agent's 256-message, 16k-token history cost the plugin 303
/// writes against 47 for the same tokens in one message (docs/benchmarks.md). A prefix that
/// ends at a boundary between them is found like any other, at the checkpoints.
pub const KEPT_MARKS: usize = 2;

/// One hash chain per prompt of a request, plus token counts.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockHashes {
    /// One chain per prompt (chat requests have exactly one).
    pub chains: Vec<Vec<u64>>,
    /// Tokens per prompt, in the same order.
    pub tokens: Vec<usize>,
    pub block_size: usize,
    /// Per chain, the numbers of full blocks that lie before a message boundary (increasing,
    /// each at least one), the first and the last [`KEPT_MARKS`] of them: the prefixes other
    /// requests are likely to share, which the belief records exactly (see
    /// [`crate::index::record_positions`]).
    #[serde(default)]
    pub marks: Vec<Vec<usize>>,
}

impl BlockHashes {
    /// Empties `prompts` chains and their marks for a new request, keeping the vectors' room
    /// (a proxy hashes one request after another).
    fn reset(&mut self, prompts: usize, block_size: usize) {
        self.block_size = block_size;
        self.tokens.clear();
        self.chains.resize_with(prompts, Vec::new);
        self.marks.resize_with(prompts, Vec::new);
        self.chains.iter_mut().for_each(Vec::clear);
        self.marks.iter_mut().for_each(Vec::clear);
    }

    pub fn total_blocks(&self) -> usize {
        self.chains.iter().map(Vec::len).sum()
    }

    pub fn total_tokens(&self) -> usize {
        self.tokens.iter().sum()
    }

    /// Every hash of every chain, in order.
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.chains.iter().flatten().copied()
    }
}

/// Chained hashes of the tokens of `text`, appended to `out`, in one pass: each block is hashed
/// as soon as its tokens are scanned, so no vector of every token is built (a 64 KB prompt
/// would be a 64 KB allocation and a second pass). Returns the token count. Exactly
/// `chain_hashes_into(&tokenize(text), ..)`.
pub fn chain_text_into(text: &str, seed: u64, config: HashConfig, out: &mut Vec<u64>) -> usize {
    chain_text_marked(text, seed, config, &[], out, &mut Vec::new())
}

/// [`chain_text_into`], also appending to `marks` the number of full blocks before each of
/// `boundaries` (increasing byte offsets where a token starts, such as a chat message's
/// start), leaving out zeros and repeats.
pub fn chain_text_marked(
    text: &str,
    seed: u64,
    config: HashConfig,
    boundaries: &[usize],
    out: &mut Vec<u64>,
    marks: &mut Vec<usize>,
) -> usize {
    match config.identity {
        BlockIdentity::TokenIds => chain_tokens_marked(text, seed, config, boundaries, out, marks),
        BlockIdentity::Text => chain_messages(text, seed, config, boundaries, None, out, marks),
    }
}

/// [`chain_text_marked`] token by token, the whole text in one scan.
fn chain_tokens_marked(
    text: &str,
    seed: u64,
    config: HashConfig,
    boundaries: &[usize],
    out: &mut Vec<u64>,
    marks: &mut Vec<usize>,
) -> usize {
    let mut chain = Chainer::new(seed, config);
    // One comparison per token: the next boundary, `usize::MAX` once none is left.
    let mut boundaries = boundaries.iter().copied();
    let mut next_boundary = boundaries.next().unwrap_or(usize::MAX);
    for_each_token_at(text, config.non_ascii, |start, id| {
        while start >= next_boundary {
            chain.mark(marks);
            next_boundary = boundaries.next().unwrap_or(usize::MAX);
        }
        chain.push(id, out);
    });
    if next_boundary != usize::MAX {
        chain.mark(marks);
        for _ in boundaries {
            chain.mark(marks);
        }
    }
    chain.finish(out)
}

/// [`chain_text_marked`] message by message: `text` cut at each of `boundaries` (those that
/// increase and fall between characters), each part pushed on its own, through `memo` if
/// given, with a mark between parts.
fn chain_messages(
    text: &str,
    seed: u64,
    config: HashConfig,
    boundaries: &[usize],
    mut memo: Option<&mut ChainMemo>,
    out: &mut Vec<u64>,
    marks: &mut Vec<usize>,
) -> usize {
    let mut chain = Chainer::new(seed, config);
    let mut start = 0;
    let usable = boundaries
        .iter()
        .copied()
        .filter(|&b| text.is_char_boundary(b));
    for end in usable.chain([text.len()]) {
        if end < start {
            continue;
        }
        if start > 0 {
            chain.mark(marks);
        }
        let part = &text[start..end];
        match memo.as_deref_mut() {
            Some(memo) => memo.chain(Source::Decoded(part.as_bytes()), &mut chain, out),
            None => chain.push_text(part.as_bytes(), out),
        }
        start = end;
    }
    chain.finish(out)
}

/// Where a [`BlockIdentity::Text`] block's bytes are hashed from (the seed of its first part).
const TEXT_SEED: u64 = 0;

/// The hash of a [`BlockIdentity::Text`] block's bytes in its message, seeded with `span` (its
/// bytes in the messages before): those `open` holds from the segments before (emptied), then
/// `tail`. One pass over `tail` when `open` is empty, as it is for every block but a segment's
/// first. (Inlining this, or testing for the first block in the loop instead, cost 1–2% more
/// instructions on a cold prompt: host-tests profile.)
fn own_hash(open: &mut Vec<u8>, span: u64, tail: &[u8]) -> u64 {
    if open.is_empty() {
        return xxh64(tail, span);
    }
    let mut h = Xxh64::new(span);
    h.update(open);
    h.update(tail);
    open.clear();
    h.digest()
}

/// A chain's open block between texts: what [`Chainer::resume`] needs to go on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Partial {
    /// Its token ids ([`BlockIdentity::TokenIds`]; empty otherwise).
    ids: Vec<u32>,
    /// The hash of its bytes in the messages before ([`BlockIdentity::Text`]; [`TEXT_SEED`]
    /// otherwise), and its bytes in this message's segments before.
    span: u64,
    open: Vec<u8>,
    /// Its tokens.
    filled: usize,
}

/// A chain being built: the hash of its last full block (or the seed) and the block not yet
/// full (its token ids, or its bytes so far).
#[derive(Debug, Clone)]
struct Chainer {
    parent: u64,
    /// The partial block's token ids, `filled` of them; a token costs one store here, and
    /// the count of tokens is kept per block, not per token (this is the plugin's hottest
    /// path after the tokenizer's byte loop).
    pending: Vec<u32>,
    filled: usize,
    /// [`BlockIdentity::Text`]: the open block's bytes hashed so far, message by message (a
    /// block that spans chat messages), and its bytes in the segments of this message before
    /// the one being pushed, hashed with the rest of its bytes in this message as one run.
    span: u64,
    open: Vec<u8>,
    /// Tokens in the full blocks so far.
    full_tokens: usize,
    block_size: usize,
    include_partial: bool,
    /// The tokenizer's rule for the text this chain hashes (the memo tokenizes with it).
    non_ascii: NonAscii,
    /// What its blocks' hashes are made of.
    identity: BlockIdentity,
}

impl Chainer {
    fn new(seed: u64, config: HashConfig) -> Chainer {
        let block_size = config.block_size.max(1);
        Chainer {
            parent: seed,
            // Only a chain of token ids keeps its open block's tokens.
            pending: match config.identity {
                BlockIdentity::TokenIds => vec![0; block_size],
                BlockIdentity::Text => Vec::new(),
            },
            filled: 0,
            span: TEXT_SEED,
            open: Vec::new(),
            full_tokens: 0,
            block_size,
            include_partial: config.include_partial,
            non_ascii: config.non_ascii,
            identity: config.identity,
        }
    }

    #[inline(always)]
    fn push(&mut self, id: u32, out: &mut Vec<u64>) {
        if let Some(slot) = self.pending.get_mut(self.filled) {
            *slot = id;
        }
        self.filled += 1;
        if self.filled == self.block_size {
            self.parent = block_hash(&self.pending, self.parent);
            out.push(self.parent);
            self.filled = 0;
            self.full_tokens += self.block_size;
        }
    }

    /// [`Chainer::push_stopped`] of `text`, copied once with the stop after it.
    fn push_text(&mut self, text: &[u8], out: &mut Vec<u64>) {
        Stopped::copied(text, |text| self.push_stopped(text, true, out));
    }

    /// Continues the chain with `text`, appending the blocks it completes to `out`: a message
    /// (or its last segment) when `ends`, else a segment of one, cut where a piece starts,
    /// that the next text continues.
    fn push_stopped(&mut self, text: Stopped<'_>, ends: bool, out: &mut Vec<u64>) {
        match self.identity {
            BlockIdentity::TokenIds => self.push_tokens(text, out),
            BlockIdentity::Text => self.push_bytes(text, ends, out),
        }
    }

    /// [`Chainer::push`] of every token of `text`. The chain's state is kept in locals while
    /// the text is scanned and written back once (pushed token by token through `&mut self`,
    /// each token loads and stores the fill count through memory).
    fn push_tokens(&mut self, text: Stopped<'_>, out: &mut Vec<u64>) {
        let block_size = self.block_size;
        let (mut parent, mut filled, mut full) = (self.parent, self.filled, 0);
        let pending = &mut self.pending[..];
        for_each_token_stopped(text, self.non_ascii, |id| {
            if let Some(slot) = pending.get_mut(filled) {
                *slot = id;
            }
            filled += 1;
            if filled == block_size {
                parent = block_hash(pending, parent);
                out.push(parent);
                filled = 0;
                full += block_size;
            }
        });
        self.parent = parent;
        self.filled = filled;
        self.full_tokens += full;
    }

    /// The blocks of `text` by their bytes ([`BlockIdentity::Text`]): the pieces are counted,
    /// not visited, and a block's bytes run from where the block before it ended (or the
    /// text's start) to where the piece after its last starts (or the text's end).
    fn push_bytes(&mut self, text: Stopped<'_>, ends: bool, out: &mut Vec<u64>) {
        let (bytes, block_size) = (text.text(), self.block_size);
        let (mut parent, mut span, mut filled, mut full, mut from) =
            (self.parent, self.span, self.filled, 0, 0);
        let open = &mut self.open;
        cut_blocks(text, self.non_ascii, block_size, &mut filled, |at| {
            let own = own_hash(open, span, bytes.get(from..at).unwrap_or_default());
            parent = fixed::xxh64_pair(own, parent);
            out.push(parent);
            (span, from) = (TEXT_SEED, at);
            full += block_size;
        });
        // The text's end ends its last piece: the open block takes the rest of the bytes, and
        // is complete if it holds a block's tokens; else the rest is hashed at a message's end,
        // kept for the next segment's bytes otherwise.
        let rest = bytes.get(from..).unwrap_or_default();
        if filled == block_size {
            parent = fixed::xxh64_pair(own_hash(open, span, rest), parent);
            out.push(parent);
            (span, filled) = (TEXT_SEED, 0);
            full += block_size;
        } else if ends {
            span = own_hash(open, span, rest);
        } else {
            open.extend_from_slice(rest);
        }
        self.parent = parent;
        self.span = span;
        self.filled = filled;
        self.full_tokens += full;
    }

    /// Tokens so far.
    fn count(&self) -> usize {
        self.full_tokens + self.filled
    }

    /// The number of full blocks so far, appended to `marks` unless zero or a repeat; beyond
    /// [`KEPT_MARKS`] at each end, the oldest of the last ones goes.
    fn mark(&self, marks: &mut Vec<usize>) {
        let blocks = self.full_tokens / self.block_size;
        if blocks > 0 && marks.last() != Some(&blocks) {
            if marks.len() == 2 * KEPT_MARKS {
                marks.remove(KEPT_MARKS);
            }
            marks.push(blocks);
        }
    }

    /// Hashes the partial block (if configured) and returns the token count.
    fn finish(self, out: &mut Vec<u64>) -> usize {
        if self.filled > 0 && self.include_partial {
            out.push(match self.identity {
                BlockIdentity::TokenIds => block_hash(&self.pending[..self.filled], self.parent),
                // Every text ends with a message's last segment, which hashes the open block's
                // bytes into its span (`push_bytes`).
                BlockIdentity::Text => fixed::xxh64_pair(self.span, self.parent),
            });
        }
        self.count()
    }

    /// The state a text leaves the chain in (see [`Chainer::resume`]): its last hash and its
    /// open block.
    fn state(&self) -> (u64, Partial) {
        let ids = match self.identity {
            BlockIdentity::TokenIds => self.pending[..self.filled].to_vec(),
            BlockIdentity::Text => Vec::new(),
        };
        let partial = Partial {
            ids,
            span: self.span,
            open: self.open.clone(),
            filled: self.filled,
        };
        (self.parent, partial)
    }

    /// Continues as if `tokens` more tokens had left the chain in `state`. False (and the
    /// chain unchanged) if the open block does not fit this chain's block size or identity.
    fn resume(&mut self, (parent, partial): (u64, &Partial), tokens: usize) -> bool {
        let total = self.count() + tokens;
        let ids_fit = match self.identity {
            BlockIdentity::TokenIds => {
                partial.ids.len() == partial.filled && partial.open.is_empty()
            }
            BlockIdentity::Text => partial.ids.is_empty(),
        };
        if !ids_fit || partial.filled >= self.block_size || total < partial.filled {
            return false;
        }
        self.pending[..partial.ids.len()].copy_from_slice(&partial.ids);
        self.filled = partial.filled;
        self.span = partial.span;
        self.open.clear();
        self.open.extend_from_slice(&partial.open);
        self.full_tokens = total - partial.filled;
        self.parent = parent;
        true
    }

    /// What the chain's future depends on: its last hash, its partial block, the block size
    /// and the tokenizer's rule. Two chains in the same state hash the same text to the same
    /// blocks.
    fn state_key(&self) -> u64 {
        // A few multiplies per field rather than a streaming hash: a long text is looked up
        // once per segment (`segments`). Each field in its own bits: block sizes and fills
        // under 2^32 and 2^24.
        let layout = self.block_size as u64
            ^ (self.filled as u64) << 32
            ^ (self.non_ascii as u64) << 56
            ^ (self.identity as u64) << 60;
        let key = fixed::xxh64_pair(self.parent, layout);
        let key = fixed::xxh64_pair(key, xxh64(&self.open, self.span));
        // The open block's token ids (none are kept for blocks known by their text).
        let ids = self.pending.get(..self.filled).unwrap_or_default();
        ids.iter()
            .fold(key, |key, &t| fixed::xxh64_pair(key, u64::from(t)))
    }
}

mod fixed;
pub mod memo;
pub mod segments;
use memo::Source;
pub use memo::{ChainMemo, MemoStats};

/// [`chain_text_marked`] through `memo`: each chat message whose bytes the chain met in the
/// same state before is not tokenized again. Exactly `chain_text_marked`'s results.
fn chain_text_memo(
    text: &str,
    seed: u64,
    config: HashConfig,
    boundaries: &[usize],
    memo: &mut ChainMemo,
    out: &mut Vec<u64>,
    marks: &mut Vec<usize>,
) -> usize {
    // Blocks of token ids: a message is tokenized on its own only if no piece crosses into
    // it: its first byte must end every run before it (the chat header's `<` does). Otherwise
    // hash the text whole. (Blocks of bytes are hashed message by message either way.)
    if config.identity == BlockIdentity::TokenIds {
        let bytes = text.as_bytes();
        let apart = |b: usize| {
            b == bytes.len()
                || bytes
                    .get(b)
                    .is_some_and(|&c| crate::tokenizer::ends_runs(c))
        };
        let ordered = boundaries.windows(2).all(|w| w[0] <= w[1]);
        if !ordered || !boundaries.iter().all(|&b| apart(b)) {
            return chain_text_marked(text, seed, config, boundaries, out, marks);
        }
    }
    chain_messages(text, seed, config, boundaries, Some(memo), out, marks)
}

/// The whole front half of the pipeline: parsed request → tokens → block hashes.
pub fn hash_request(request: &ParsedRequest, config: HashConfig) -> BlockHashes {
    hash_request_with(request, config, None)
}

/// [`hash_request`] through a memo of the chat messages (and prompts) hashed before: the same
/// hashes, without tokenizing again a system prompt, document or earlier turn `memo` holds.
pub fn hash_request_memo(
    request: &ParsedRequest,
    config: HashConfig,
    memo: &mut ChainMemo,
) -> BlockHashes {
    hash_request_with(request, config, Some(memo))
}

/// [`hash_request_memo`] into `out`, whose vectors keep their room from the request before (a
/// proxy hashes one request after another: six vectors per request otherwise).
pub fn hash_request_memo_into(
    request: &ParsedRequest,
    config: HashConfig,
    memo: &mut ChainMemo,
    out: &mut BlockHashes,
) {
    hash_request_into(request, config, Some(memo), out);
}

/// [`hash_request_memo_into`] for a chat or completions body read in place
/// ([`crate::request::read_request`]): the same chain, marks and token count as for
/// `parse_request` of the same body, but a message (or prompt) the memo holds is looked up by
/// its bytes as they lie in the body and is never decoded (see `request/raw.rs` for what that
/// saves).
pub fn hash_raw_memo_into(
    request: &RawRequest,
    config: HashConfig,
    memo: &mut ChainMemo,
    out: &mut BlockHashes,
) {
    let seed = chain_seed(request.model, request.cache_salt.unwrap_or(""));
    out.reset(1, config.block_size.max(1));
    let (blocks, marks) = (&mut out.chains[0], &mut out.marks[0]);
    let mut chain = Chainer::new(seed, config);
    match &request.prompt {
        RawPrompt::Messages(messages) => {
            for (i, message) in messages.iter().enumerate() {
                // As `chain_text_memo`: a mark at every message's start but the first.
                if i > 0 {
                    chain.mark(marks);
                }
                memo.chain(Source::Message(message), &mut chain, blocks);
            }
        }
        RawPrompt::Text(text) => memo.chain(Source::Prompt(*text), &mut chain, blocks),
    }
    let count = chain.finish(blocks);
    out.tokens.push(count);
}

fn hash_request_with(
    request: &ParsedRequest,
    config: HashConfig,
    memo: Option<&mut ChainMemo>,
) -> BlockHashes {
    let mut hashes = BlockHashes::default();
    hash_request_into(request, config, memo, &mut hashes);
    hashes
}

fn hash_request_into(
    request: &ParsedRequest,
    config: HashConfig,
    mut memo: Option<&mut ChainMemo>,
    out: &mut BlockHashes,
) {
    let seed = chain_seed(&request.model, request.cache_salt.as_deref().unwrap_or(""));
    let block_size = config.block_size.max(1);
    out.reset(request.prompts.len(), block_size);
    for (i, prompt) in request.prompts.iter().enumerate() {
        let (chain, marks) = (&mut out.chains[i], &mut out.marks[i]);
        let count = match prompt {
            Prompt::Text(text) => {
                // About 4 bytes per token in English text.
                chain.reserve(text.len() / (4 * block_size) + 1);
                // Message boundaries belong to the chat prompt, the only one.
                let boundaries = if i == 0 { &request.boundaries[..] } else { &[] };
                match memo.as_deref_mut() {
                    Some(memo) => {
                        chain_text_memo(text, seed, config, boundaries, memo, chain, marks)
                    }
                    None => chain_text_marked(text, seed, config, boundaries, chain, marks),
                }
            }
            Prompt::Tokens(ids) => {
                chain_hashes_into(ids, seed, config, chain);
                ids.len()
            }
        };
        out.tokens.push(count);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const FULL: HashConfig = HashConfig {
        block_size: 4,
        include_partial: false,
        non_ascii: NonAscii::Pieces,
        identity: BlockIdentity::TokenIds,
    };

    #[test]
    fn seed_is_length_prefixed() {
        assert_ne!(chain_seed("ab", "c"), chain_seed("a", "bc"));
        assert_ne!(chain_seed("m", ""), chain_seed("", "m"));
        assert_eq!(chain_seed("m", "s"), chain_seed("m", "s"));
    }

    #[test]
    fn partial_block_is_hashed_only_when_asked() {
        let tokens: Vec<u32> = (0..10).collect();
        assert_eq!(chain_hashes(&tokens, 1, FULL).len(), 2);
        let with_partial = HashConfig {
            include_partial: true,
            ..FULL
        };
        let all = chain_hashes(&tokens, 1, with_partial);
        assert_eq!(all.len(), 3);
        assert_eq!(all[..2], chain_hashes(&tokens, 1, FULL)[..]);
    }

    #[test]
    fn every_block_length_hashes_as_xxh64_of_its_bytes_then_of_the_pair() {
        // 16 tokens take the specialised path, every other length the crate's streaming one;
        // both must be xxh64(token bytes) then xxh64(own ++ parent).
        for len in 0..=40u32 {
            let tokens: Vec<u32> = (0..len)
                .map(|t| t.wrapping_mul(0x9E37_79B9) ^ len)
                .collect();
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            let own = xxhash_rust::xxh64::xxh64(&bytes, 0);
            let mut pair = own.to_le_bytes().to_vec();
            pair.extend_from_slice(&9u64.to_le_bytes());
            assert_eq!(
                block_hash(&tokens, 9),
                xxhash_rust::xxh64::xxh64(&pair, 0),
                "{len} tokens"
            );
        }
    }

    #[test]
    fn chat_hashes_mark_the_full_blocks_before_each_message() {
        let body = br#"{"messages":[{"role":"system","content":"a b c d e"},{"role":"user","content":"q r"},{"role":"assistant","content":"s"}]}"#;
        let req = crate::request::parse_request(body).unwrap();
        let Prompt::Text(text) = &req.prompts[0] else {
            panic!("chat is text")
        };
        for (block_size, identity) in
            (1..6).flat_map(|b| [BlockIdentity::TokenIds, BlockIdentity::Text].map(|i| (b, i)))
        {
            let config = HashConfig {
                block_size,
                include_partial: true,
                non_ascii: NonAscii::Pieces,
                identity,
            };
            let h = hash_request(&req, config);
            let expected: Vec<usize> = req
                .boundaries
                .iter()
                .map(|&b| {
                    crate::tokenizer::tokenize(&text[..b], NonAscii::default()).len() / block_size
                })
                .filter(|&k| k > 0)
                .collect();
            assert_eq!(
                h.marks,
                vec![expected.clone()],
                "{identity:?}, block size {block_size}"
            );
            let mut plain = Vec::new();
            chain_text_into(text, chain_seed("", ""), config, &mut plain);
            assert_eq!(h.chains[0].len(), plain.len());
            if identity == BlockIdentity::TokenIds {
                // Marking changes no hash.
                assert_eq!(h.chains[0], plain);
            } else {
                // Hashed message by message, the first block that spans a message boundary
                // differs from the same text's hashed in one piece, and no block before it.
                let spanning = req
                    .boundaries
                    .iter()
                    .map(|&b| crate::tokenizer::tokenize(&text[..b], NonAscii::default()).len())
                    .filter(|t| t % block_size != 0)
                    .map(|t| t / block_size)
                    .min()
                    .unwrap_or(plain.len());
                assert_eq!(
                    h.chains[0][..spanning],
                    plain[..spanning],
                    "block size {block_size}"
                );
                if spanning < plain.len() {
                    assert_ne!(
                        h.chains[0][spanning], plain[spanning],
                        "block size {block_size}"
                    );
                }
            }
        }
        // "<", "system", ">\n", "a ", …, "e\n": 8 tokens before the user message.
        assert_eq!(hash_request(&req, FULL).marks, vec![vec![2, 3]]);
    }

    #[test]
    fn a_long_chat_keeps_the_marks_of_its_first_and_last_messages() {
        let messages: Vec<serde_json::Value> = (0..12)
            .map(|i| serde_json::json!({"role": "user", "content": format!("message {i} words")}))
            .collect();
        let body = serde_json::json!({ "messages": messages }).to_string();
        let req = crate::request::parse_request(body.as_bytes()).unwrap();
        let Prompt::Text(text) = &req.prompts[0] else {
            panic!("chat is text")
        };
        let config = HashConfig {
            block_size: 2,
            include_partial: true,
            non_ascii: NonAscii::Pieces,
            identity: BlockIdentity::TokenIds,
        };
        let every: Vec<usize> = req
            .boundaries
            .iter()
            .map(|&b| crate::tokenizer::tokenize(&text[..b], NonAscii::default()).len() / 2)
            .collect();
        assert_eq!(every.len(), 11);
        let kept = [&every[..KEPT_MARKS], &every[every.len() - KEPT_MARKS..]].concat();
        assert_eq!(hash_request(&req, config).marks, vec![kept.clone()]);
        // The memo's path and the in-place reader's keep the same ones.
        let mut memo = ChainMemo::default();
        let mut out = BlockHashes::default();
        for _ in 0..2 {
            hash_request_memo_into(&req, config, &mut memo, &mut out);
            assert_eq!(out.marks, vec![kept.clone()]);
            let chat = crate::request::read_request(body.as_bytes()).unwrap();
            hash_raw_memo_into(&chat, config, &mut memo, &mut out);
            assert_eq!(out.marks, vec![kept.clone()]);
        }
    }

    #[test]
    fn request_hashes_cover_each_prompt() {
        let req =
            crate::request::parse_request(br#"{"model":"m","prompt":["a b c d e","x"]}"#).unwrap();
        let h = hash_request(
            &req,
            HashConfig {
                block_size: 2,
                include_partial: true,
                non_ascii: NonAscii::Pieces,
                identity: BlockIdentity::TokenIds,
            },
        );
        assert_eq!(h.tokens, vec![5, 1]);
        assert_eq!(h.marks, vec![Vec::<usize>::new(), vec![]]);
        assert_eq!(h.chains[0].len(), 3);
        assert_eq!(h.chains[1].len(), 1);
        assert_eq!(h.total_blocks(), 4);
        assert_eq!(h.iter().count(), 4);
    }

    fn shared_prefix_pair() -> impl Strategy<Value = (Vec<u32>, Vec<u32>, usize)> {
        (0usize..80, 0usize..40, 0usize..40, any::<u64>()).prop_map(|(k, a, b, s)| {
            let mut x = s;
            let mut next = || {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (x >> 33) as u32
            };
            let prefix: Vec<u32> = (0..k).map(|_| next()).collect();
            let mut left = prefix.clone();
            let mut right = prefix;
            // The first token after the shared prefix differs, so exactly k tokens are shared.
            let first = next();
            left.push(first);
            right.push(first ^ 1);
            left.extend((0..a).map(|_| next()));
            right.extend((0..b).map(|_| next()));
            (left, right, k)
        })
    }

    proptest! {
        #[test]
        fn hashing_text_in_one_pass_equals_hashing_its_tokens(
            text in "[a-z ,.!_\n]{0,200}",
            block_size in 1usize..20,
            include_partial in any::<bool>(),
        ) {
            let config = HashConfig { block_size, include_partial, non_ascii: NonAscii::Pieces, identity: BlockIdentity::TokenIds };
            let seed = chain_seed("m", "s");
            let tokens = crate::tokenizer::tokenize(&text, NonAscii::default());
            let mut streamed = Vec::new();
            let count = chain_text_into(&text, seed, config, &mut streamed);
            prop_assert_eq!(count, tokens.len());
            prop_assert_eq!(streamed, chain_hashes(&tokens, seed, config));
        }
    }

    proptest! {
        /// A message pushed in segments cut before words hashes as the whole message does,
        /// with either identity, whatever the open block holds at each cut.
        #[test]
        fn a_text_pushed_in_parts_cut_before_words_hashes_as_the_whole(
            text in "[a-c_ ,.é日\n`]{0,300}",
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..6),
            block_size in 1usize..20,
            include_partial in any::<bool>(),
            skip in any::<bool>(),
            ids in any::<bool>(),
        ) {
            let non_ascii = if skip { NonAscii::Skip } else { NonAscii::Pieces };
            let identity = if ids { BlockIdentity::TokenIds } else { BlockIdentity::Text };
            let config = HashConfig { block_size, include_partial, non_ascii, identity };
            let bytes = text.as_bytes();
            let starts: Vec<usize> = (1..bytes.len())
                .filter(|&i| bytes[i - 1] == b' ' && bytes[i].is_ascii_alphanumeric())
                .collect();
            let mut at: Vec<usize> = match starts.len() {
                0 => Vec::new(),
                n => cuts.iter().map(|c| starts[c.index(n)]).collect(),
            };
            at.sort_unstable();
            at.dedup();
            let seed = chain_seed("m", "");
            let mut whole = Vec::new();
            let tokens = chain_text_into(&text, seed, config, &mut whole);
            let mut chain = Chainer::new(seed, config);
            let mut parts = Vec::new();
            let mut from = 0;
            for end in at.into_iter().chain([bytes.len()]) {
                Stopped::copied(&bytes[from..end], |text| {
                    chain.push_stopped(text, end == bytes.len(), &mut parts)
                });
                from = end;
            }
            prop_assert_eq!(chain.finish(&mut parts), tokens);
            prop_assert_eq!(parts, whole);
        }

        #[test]
        fn blocks_of_text_are_cut_where_blocks_of_token_ids_are(
            text in "[a-z_ ,.!é日\n`]{0,300}",
            block_size in 1usize..20,
            include_partial in any::<bool>(),
            skip in any::<bool>(),
        ) {
            let non_ascii = if skip { NonAscii::Skip } else { NonAscii::Pieces };
            let config = |identity| HashConfig { block_size, include_partial, non_ascii, identity };
            let (mut by_text, mut by_ids) = (Vec::new(), Vec::new());
            let seed = chain_seed("m", "");
            let tokens = chain_text_into(&text, seed, config(BlockIdentity::Text), &mut by_text);
            prop_assert_eq!(tokens, crate::tokenizer::tokenize(&text, non_ascii).len());
            prop_assert_eq!(tokens, chain_text_into(&text, seed, config(BlockIdentity::TokenIds), &mut by_ids));
            prop_assert_eq!(by_text.len(), by_ids.len());
        }

        #[test]
        fn texts_share_the_blocks_their_common_pieces_fill(
            prefix in "[a-z ,.é日\n]{0,200}",
            tail in "[a-z ,.]{0,40}",
            block_size in 1usize..9,
        ) {
            // The texts part where a piece starts in both, "x" against "y".
            let prefix = format!("{prefix} ");
            let (a, b) = (format!("{prefix}x{tail}"), format!("{prefix}y{tail}"));
            let config = HashConfig { block_size, include_partial: true, non_ascii: NonAscii::Pieces, identity: BlockIdentity::Text };
            let (mut ha, mut hb) = (Vec::new(), Vec::new());
            chain_text_into(&a, 1, config, &mut ha);
            chain_text_into(&b, 1, config, &mut hb);
            let shared = ha.iter().zip(&hb).take_while(|(x, y)| x == y).count();
            // Every block whose pieces all lie in the common part, and none after.
            prop_assert_eq!(shared, crate::tokenizer::tokenize(&prefix, NonAscii::Pieces).len() / block_size);
            for (x, y) in ha.iter().zip(&hb).skip(shared) {
                prop_assert_ne!(x, y);
            }
        }
    }

    proptest! {
        #[test]
        fn sharing_k_tokens_shares_exactly_floor_k_over_bs_hashes(
            (left, right, k) in shared_prefix_pair(),
            block_size in 1usize..9,
            include_partial in any::<bool>(),
        ) {
            let config = HashConfig { block_size, include_partial, non_ascii: NonAscii::Pieces, identity: BlockIdentity::TokenIds };
            let seed = chain_seed("model", "");
            let a = chain_hashes(&left, seed, config);
            let b = chain_hashes(&right, seed, config);
            let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
            prop_assert_eq!(shared, k / block_size);
            // No later position may collide either: chaining makes every later hash differ.
            for (x, y) in a.iter().zip(&b).skip(shared) {
                prop_assert_ne!(x, y);
            }
        }

        #[test]
        fn different_salt_or_model_shares_no_hash(
            tokens in proptest::collection::vec(any::<u32>(), 1..64),
            block_size in 1usize..9,
            salt in "[a-z]{0,6}",
        ) {
            let config = HashConfig { block_size, include_partial: true, non_ascii: NonAscii::Pieces, identity: BlockIdentity::TokenIds };
            let base = chain_hashes(&tokens, chain_seed("m", &salt), config);
            let salted = chain_hashes(&tokens, chain_seed("m", &format!("{salt}x")), config);
            let other_model = chain_hashes(&tokens, chain_seed("m2", &salt), config);
            for h in &base {
                prop_assert!(!salted.contains(h));
                prop_assert!(!other_model.contains(h));
            }
        }
    }
}
