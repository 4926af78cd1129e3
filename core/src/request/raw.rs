//! A chat or completions body read where it lies: the routing fields, and each message's
//! content (or the completions `prompt`) as the bytes between its JSON string's quotes.
//!
//! [`parse_request`](super::parse_request) decodes every message into one prompt string:
//! serde_json scans each string for its end, checks that it is UTF-8 and copies it, about 9
//! wasm instructions per byte before the prompt is tokenized or looked up in the memo of
//! messages hashed before. A warm request (every long message in that memo) needs none of it:
//! only each message's extent, checked, and a key of its bytes. [`read_request`] finds and
//! checks the contents sixteen bytes at a time (with wasm SIMD; eight without) and keeps them as
//! they are in the body; the hashing decodes a content only when the memo does not hold it
//! (`hashing::hash_raw_memo_into`). A completions `prompt` of one string is read the same way,
//! and so is a content written as a list of one text part (`[{"type": "text", "text": …}]`).
//!
//! It reads the common shape only and declines (`None`) everything else, for
//! [`parse_request`](super::parse_request) to read as before: a body whose answer it is not
//! sure to give exactly (a key or role with escapes, content as a list of several parts or of
//! another kind of part, a repeated routing key, a `prompt` that is not one string, both
//! `messages` and `prompt`, a number that is not a plain integer, deep nesting) or that is
//! wrong (not JSON, a field of the wrong type). Whatever it accepts, `parse_request` accepts
//! too and reads the same fields and text from (property-tested). So it is at least as strict
//! as serde_json everywhere: a string with invalid UTF-8, a control character, a bad escape or
//! a lone surrogate anywhere in the body is declined.

use std::str;

/// The bytes of a JSON string between its quotes, checked to decode: UTF-8, no control
/// characters, only JSON's escapes, surrogates in pairs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JsonStr<'a> {
    raw: &'a [u8],
    escaped: bool,
}

impl<'a> JsonStr<'a> {
    /// The string's bytes as they are in the body (escapes not decoded).
    pub fn raw(&self) -> &'a [u8] {
        self.raw
    }

    /// The same string's `raw` part (between two of its characters, never inside an escape):
    /// a segment of a long text (`hashing::segments` cuts before a word).
    pub(crate) fn with_raw<'b>(&self, raw: &'b [u8]) -> JsonStr<'b> {
        JsonStr {
            raw,
            escaped: self.escaped,
        }
    }

    /// Appends the decoded string's UTF-8 bytes to `out`, as serde_json decodes it. The bytes
    /// were checked when read, so they are not checked again here (at 2.5 wasm instructions
    /// a byte, that check was a tenth of a cold prompt's cost).
    pub fn decode_into(&self, out: &mut Vec<u8>) {
        let mut rest = self.raw;
        if !self.escaped {
            out.extend_from_slice(rest);
            return;
        }
        // The checked bytes hold no quote or control byte, so a run ends only at its escape's
        // backslash: the only byte looked for ([`backslash_at`], SIMD where the build has it).
        // Byte by byte, this search was a quarter of the instructions of a cold prompt broken
        // into lines; by every stop the reader looks for, 3% more (docs/benchmarks.md).
        loop {
            let at = backslash_at(rest);
            out.extend_from_slice(&rest[..at]);
            if at == rest.len() {
                break;
            }
            let escape = &rest[at + 1..];
            let (ch, len) = match escape.first() {
                Some(b'u') => {
                    let unit = hex4(&escape[1..]).unwrap_or(0xFFFD);
                    if (0xD800..0xDC00).contains(&unit) {
                        let low = escape.get(5..7).filter(|e| e == b"\\u");
                        let low = low.and_then(|_| hex4(&escape[7..])).unwrap_or(0xDC00);
                        let c = 0x10000 + ((unit - 0xD800) << 10) + low.wrapping_sub(0xDC00);
                        (char::from_u32(c).unwrap_or('\u{FFFD}'), 11)
                    } else {
                        (char::from_u32(unit).unwrap_or('\u{FFFD}'), 5)
                    }
                }
                // One byte for the common escapes (a line break, a quote): no character to
                // encode.
                Some(&e) => match simple_escape(e) {
                    Some(byte) => {
                        out.push(byte);
                        rest = rest.get(at + 2..).unwrap_or(&[]);
                        continue;
                    }
                    None => ('\u{FFFD}', 1),
                },
                None => break,
            };
            out.extend_from_slice(ch.encode_utf8(&mut [0; 4]).as_bytes());
            rest = rest.get(at + 1 + len..).unwrap_or(&[]);
        }
    }
}

/// The (ASCII) character a one-letter escape stands for.
#[inline(always)]
fn simple_escape(e: u8) -> Option<u8> {
    Some(match e {
        b'"' => b'"',
        b'\\' => b'\\',
        b'/' => b'/',
        b'b' => 0x08,
        b'f' => 0x0c,
        b'n' => b'\n',
        b'r' => b'\r',
        b't' => b'\t',
        _ => return None,
    })
}

/// The value of four hex digits.
fn hex4(bytes: &[u8]) -> Option<u32> {
    let digits = bytes.get(..4)?;
    digits.iter().try_fold(0u32, |acc, &d| {
        let v = (d as char).to_digit(16)?;
        Some(acc << 4 | v)
    })
}

/// One chat message: its role and its content (`None`: absent or `null`, an empty content).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawMessage<'a> {
    pub role: &'a str,
    pub content: Option<JsonStr<'a>>,
}

/// The routing fields of a chat or completions body, read in place (see the module
/// documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawRequest<'a> {
    pub model: &'a str,
    pub cache_salt: Option<&'a str>,
    pub stream: bool,
    pub max_tokens: Option<u32>,
    pub prompt: RawPrompt<'a>,
}

/// What a body read in place asks the model to go on from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RawPrompt<'a> {
    /// A chat's messages (at least one).
    Messages(Vec<RawMessage<'a>>),
    /// A completions `prompt` that is one string (a list of them, or token ids, is left to
    /// `parse_request`).
    Text(JsonStr<'a>),
}

/// Nesting deeper than this is declined (serde_json refuses past 128).
const MAX_DEPTH: usize = 64;

/// Reads a chat or completions body of the common shape, or `None` for
/// [`parse_request`](super::parse_request) to read (see the module documentation).
pub fn read_request(body: &[u8]) -> Option<RawRequest<'_>> {
    let mut r = Reader { bytes: body, at: 0 };
    r.skip_ws();
    let mut model = None;
    let mut cache_salt = None;
    let mut stream = None;
    let mut max_tokens = None;
    let mut max_completion_tokens = None;
    let mut messages: Option<Vec<RawMessage>> = None;
    let mut prompt = None;
    r.object(&mut |r, key| match key {
        b"model" => once(&mut model, r.plain_str_or_null()?),
        b"cache_salt" => once(&mut cache_salt, r.plain_str_or_null()?),
        b"stream" => once(&mut stream, r.bool_or_null()?),
        b"max_tokens" => once(&mut max_tokens, r.u32_or_null()?),
        b"max_completion_tokens" => once(&mut max_completion_tokens, r.u32_or_null()?),
        b"messages" => once(&mut messages, r.messages()?),
        // A string only (`parse_request` reads the other shapes); `null` is declined too.
        b"prompt" if r.peek() == Some(b'"') => once(&mut prompt, r.string()?),
        b"prompt" => None,
        _ => r.skip_value(1),
    })?;
    r.skip_ws();
    if r.at != body.len() {
        return None;
    }
    // `parse_request` reads the messages where both are given: declined, not to be sure of it.
    let prompt = match (messages, prompt) {
        (Some(messages), None) if !messages.is_empty() => RawPrompt::Messages(messages),
        (None, Some(text)) => RawPrompt::Text(text),
        _ => return None,
    };
    Some(RawRequest {
        model: model.flatten().unwrap_or(""),
        cache_salt: cache_salt.flatten(),
        stream: stream.flatten().unwrap_or(false),
        // As parse_request: `max_completion_tokens` (even `null`) before `max_tokens`.
        max_tokens: max_completion_tokens.or(max_tokens).flatten(),
        prompt,
    })
}

/// Sets a field met for the first time; a repeated key is declined.
fn once<T>(slot: &mut Option<T>, value: T) -> Option<()> {
    match slot {
        Some(_) => None,
        None => {
            *slot = Some(value);
            Some(())
        }
    }
}

/// Where the run of plain string text at the start of `rest` ends: the position of its first
/// `"`, `\`, control byte or, with `NON_ASCII`, non-ASCII byte; `rest.len()` when it has none.
/// `run_end::<true>` is what the reader skips without a look; `run_end::<false>` is a run of
/// text whose UTF-8 is checked at once (see [`Reader::string`]).
///
/// Where the build has wasm SIMD (the plugin: `.cargo/config.toml`), sixteen bytes at a time:
/// a compare for the control bytes (signed, to take the non-ASCII bytes with them: both are
/// under 0x20 as `i8`), two for the quote and the backslash, and `bitmask` gives the first
/// one's position; over a stretch without a stop, sixty-four at a time. About 1.3 wasm
/// instructions per byte of a long content (1.6 sixteen at a time, 4.2 with SWAR words). The
/// scan of the messages' contents was the largest single cost of a warm request
/// (docs/benchmarks.md).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn run_end<const NON_ASCII: bool>(rest: &[u8]) -> usize {
    use core::arch::wasm32::{i8x16_lt, i8x16_splat, u8x16_eq, u8x16_lt, u8x16_splat, v128_or};
    first_lane(
        rest,
        |v| {
            let low = if NON_ASCII {
                i8x16_lt(v, i8x16_splat(0x20))
            } else {
                u8x16_lt(v, u8x16_splat(0x20))
            };
            v128_or(
                low,
                v128_or(
                    u8x16_eq(v, u8x16_splat(b'"')),
                    u8x16_eq(v, u8x16_splat(b'\\')),
                ),
            )
        },
        run_end_bytes::<NON_ASCII>,
    )
}

/// Where the first `\\` of `text` is (`text.len()` when it has none): [`run_end`]'s search
/// with one byte to compare instead of three classes, for text already checked (see
/// [`JsonStr::decode_into`]).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn backslash_at(text: &[u8]) -> usize {
    use core::arch::wasm32::{u8x16_eq, u8x16_splat};
    first_lane(
        text,
        |v| u8x16_eq(v, u8x16_splat(b'\\')),
        |rest| rest.iter().position(|&b| b == b'\\').unwrap_or(rest.len()),
    )
}

/// The position of the first byte of `text` whose lane `lanes` sets (all ones), or
/// `text.len()`; `tail` answers for the last bytes, fewer than sixteen. Whole 64-byte blocks
/// first, one test for four vectors (a long content is mostly blocks without a stop); the block
/// with one gives the first's position from its four vectors' masks rather than being looked at
/// again sixteen bytes at a time: text broken into lines (an escape every ~50 bytes) stops in
/// nearly every block.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn first_lane(
    text: &[u8],
    lanes: impl Fn(core::arch::wasm32::v128) -> core::arch::wasm32::v128,
    tail: impl Fn(&[u8]) -> usize,
) -> usize {
    use core::arch::wasm32::{u8x16_bitmask, v128, v128_any_true, v128_or};
    let at = |bytes: &[u8]| {
        // SAFETY: every caller below passes 16 readable bytes or more; `read_unaligned` asks no
        // alignment of them.
        lanes(unsafe { bytes.as_ptr().cast::<v128>().read_unaligned() })
    };
    let mut run = 0;
    for block in text.chunks_exact(64) {
        let (a, b) = (at(block), at(&block[16..]));
        let (c, d) = (at(&block[32..]), at(&block[48..]));
        if v128_any_true(v128_or(v128_or(a, b), v128_or(c, d))) {
            let low = u32::from(u8x16_bitmask(a)) | u32::from(u8x16_bitmask(b)) << 16;
            let high = u32::from(u8x16_bitmask(c)) | u32::from(u8x16_bitmask(d)) << 16;
            let mask = u64::from(low) | u64::from(high) << 32;
            return run + mask.trailing_zeros() as usize;
        }
        run += 64;
    }
    let mut chunks = text[run..].chunks_exact(16);
    for chunk in &mut chunks {
        let mask = u8x16_bitmask(at(chunk));
        if mask != 0 {
            return run + mask.trailing_zeros() as usize;
        }
        run += 16;
    }
    run + tail(chunks.remainder())
}

/// [`backslash_at`] without wasm SIMD (native builds, the web demo).
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
fn backslash_at(text: &[u8]) -> usize {
    text.iter().position(|&b| b == b'\\').unwrap_or(text.len())
}

/// [`run_end`] eight bytes at a time (builds without wasm SIMD: native ones, the web demo):
/// one mask per word, no branch per byte.
/// The classic "has a zero byte" test, `(x - 0x01…) & !x & 0x80…`, applied to the word itself
/// for bytes under 0x20 and to its XOR with `"` and `\`; its lowest flagged byte is always a
/// true one (a borrow only runs upwards), so `trailing_zeros` finds the first stop exactly.
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
fn run_end<const NON_ASCII: bool>(rest: &[u8]) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    let mut words = rest.chunks_exact(8);
    let mut run = 0;
    for chunk in &mut words {
        let w = u64::from_le_bytes([
            chunk[0], chunk[1], chunk[2], chunk[3], chunk[4], chunk[5], chunk[6], chunk[7],
        ]);
        let quote = w ^ (ONES * u64::from(b'"'));
        let backslash = w ^ (ONES * u64::from(b'\\'));
        let stops = ((w.wrapping_sub(ONES * 0x20) & !w)
            | if NON_ASCII { w } else { 0 }
            | (quote.wrapping_sub(ONES) & !quote)
            | (backslash.wrapping_sub(ONES) & !backslash))
            & HIGHS;
        if stops != 0 {
            return run + stops.trailing_zeros() as usize / 8;
        }
        run += 8;
    }
    run + run_end_bytes::<NON_ASCII>(words.remainder())
}

/// Is `text` UTF-8? In the plugin with `simdutf8` (SIMD where the build has it: 16 bytes a
/// step, against the standard library's check of one character at a time, ~4x fewer wasm
/// instructions on Japanese text), natively with the standard library.
#[cfg(target_arch = "wasm32")]
fn is_utf8(text: &[u8]) -> bool {
    simdutf8::basic::from_utf8(text).is_ok()
}

#[cfg(not(target_arch = "wasm32"))]
fn is_utf8(text: &[u8]) -> bool {
    str::from_utf8(text).is_ok()
}

/// [`run_end`] one byte at a time, for the last few bytes.
fn run_end_bytes<const NON_ASCII: bool>(rest: &[u8]) -> usize {
    rest.iter()
        .position(|&b| b == b'"' || b == b'\\' || b < 0x20 || (NON_ASCII && b >= 0x80))
        .unwrap_or(rest.len())
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

/// What `Reader::object` calls with each member's value, and `Reader::array` with each
/// element: through `dyn`, one copy of each serves every caller. Generic, each closure had its
/// own (the reader of one text part alone added 1.2 KB to the `.wasm`); this costs ~350 wasm
/// instructions a request (calls through memory), 0.1–0.5% (docs/benchmarks.md).
type Member<'a, 'r> = dyn FnMut(&mut Reader<'a>, &'a [u8]) -> Option<()> + 'r;
type Element<'a, 'r> = dyn FnMut(&mut Reader<'a>) -> Option<()> + 'r;

impl<'a> Reader<'a> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.at).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let b = self.peek()?;
        self.at += 1;
        Some(b)
    }

    fn eat(&mut self, b: u8) -> Option<()> {
        (self.next()? == b).then_some(())
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.at += 1;
        }
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let end = self.at + word.len();
        (self.bytes.get(self.at..end)? == word).then(|| self.at = end)
    }

    /// A string from its opening quote: its checked contents.
    fn string(&mut self) -> Option<JsonStr<'a>> {
        self.eat(b'"')?;
        let start = self.at;
        let mut escaped = false;
        loop {
            self.at += run_end::<true>(self.bytes.get(self.at..)?);
            let b = self.next()?;
            match b {
                b'"' => {
                    let raw = &self.bytes[start..self.at - 1];
                    return Some(JsonStr { raw, escaped });
                }
                b'\\' => {
                    escaped = true;
                    self.escape()?;
                }
                0..=0x1f => return None,
                0x80.. => {
                    // Text that is not all ASCII: the run up to the next quote, backslash or
                    // control byte, checked as UTF-8 at once (a text in another script is one
                    // run, not a check per character). Those stops are ASCII, so no valid
                    // character spans the run's end.
                    let from = self.at - 1;
                    let end = from + run_end::<false>(&self.bytes[from..]);
                    if !is_utf8(&self.bytes[from..end]) {
                        return None;
                    }
                    self.at = end;
                }
                _ => {}
            }
        }
    }

    /// One escape after its backslash; surrogates only in pairs.
    fn escape(&mut self) -> Option<()> {
        match self.next()? {
            b'u' => {
                let unit = hex4(self.bytes.get(self.at..)?)?;
                self.at += 4;
                match unit {
                    0xD800..=0xDBFF => {
                        self.literal(b"\\u")?;
                        let low = hex4(self.bytes.get(self.at..)?)?;
                        self.at += 4;
                        (0xDC00..=0xDFFF).contains(&low).then_some(())
                    }
                    0xDC00..=0xDFFF => None,
                    _ => Some(()),
                }
            }
            e => simple_escape(e).map(|_| ()),
        }
    }

    /// A string without escapes, or `null` (`None`).
    fn plain_str_or_null(&mut self) -> Option<Option<&'a str>> {
        if self.peek()? == b'n' {
            return self.literal(b"null").map(|()| None);
        }
        let s = self.string()?;
        if s.escaped {
            return None;
        }
        str::from_utf8(s.raw).ok().map(Some)
    }

    fn bool_or_null(&mut self) -> Option<Option<bool>> {
        match self.peek()? {
            b't' => self.literal(b"true").map(|()| Some(true)),
            b'f' => self.literal(b"false").map(|()| Some(false)),
            _ => self.literal(b"null").map(|()| None),
        }
    }

    /// Digits only (no sign, fraction or exponent, no leading zero), within `u32`; or `null`.
    fn u32_or_null(&mut self) -> Option<Option<u32>> {
        if self.peek()? == b'n' {
            return self.literal(b"null").map(|()| None);
        }
        let start = self.at;
        while let Some(b'0'..=b'9') = self.peek() {
            self.at += 1;
        }
        let digits = &self.bytes[start..self.at];
        if digits.is_empty() || digits.len() > 10 || (digits[0] == b'0' && digits.len() > 1) {
            return None;
        }
        if let Some(b'.' | b'e' | b'E') = self.peek() {
            return None;
        }
        str::from_utf8(digits).ok()?.parse().ok().map(Some)
    }

    /// `messages`: an array of message objects.
    fn messages(&mut self) -> Option<Vec<RawMessage<'a>>> {
        let mut messages = Vec::new();
        self.array(&mut |r| {
            messages.push(r.message()?);
            Some(())
        })?;
        Some(messages)
    }

    /// One message: a string `role` (no escapes), `content` a string, one text part or `null`.
    fn message(&mut self) -> Option<RawMessage<'a>> {
        let mut role: Option<&'a str> = None;
        let mut content: Option<Option<JsonStr<'a>>> = None;
        self.object(&mut |r, key| match key {
            b"role" => once(&mut role, r.plain_str_or_null()??),
            b"content" => {
                let value = match r.peek()? {
                    b'"' => Some(r.string()?),
                    b'[' => Some(r.one_text_part()?),
                    _ => r.literal(b"null").map(|()| None)?,
                };
                once(&mut content, value)
            }
            _ => r.skip_value(2),
        })?;
        Some(RawMessage {
            role: role?,
            content: content.flatten(),
        })
    }

    /// A content written as a list of one text part, `[{"type": "text", "text": "…"}]` (keys
    /// in either order), as SDKs and frameworks send it: `parse_request` reads its text as the
    /// content, so it is read as a string content is. Any other list (several parts, an image,
    /// another key) is declined.
    fn one_text_part(&mut self) -> Option<JsonStr<'a>> {
        let (mut parts, mut kind, mut text) = (0, None, None);
        self.array(&mut |r| {
            parts += 1;
            r.object(&mut |r, key| match key {
                b"type" => once(&mut kind, r.string()?.raw),
                b"text" => once(&mut text, r.string()?),
                _ => None,
            })
        })?;
        (parts == 1 && kind == Some(&b"text"[..])).then_some(text)?
    }

    /// An object from its `{`: `member` reads each value after its key (keys with escapes
    /// are declined: one could spell a routing field).
    fn object(&mut self, member: &mut Member<'a, '_>) -> Option<()> {
        self.eat(b'{')?;
        self.skip_ws();
        if self.peek()? == b'}' {
            self.at += 1;
            return Some(());
        }
        loop {
            self.skip_ws();
            let key = self.string()?;
            if key.escaped {
                return None;
            }
            self.skip_ws();
            self.eat(b':')?;
            self.skip_ws();
            member(self, key.raw)?;
            self.skip_ws();
            match self.next()? {
                b',' => continue,
                b'}' => return Some(()),
                _ => return None,
            }
        }
    }

    /// An array from its `[`: `element` reads each element.
    fn array(&mut self, element: &mut Element<'a, '_>) -> Option<()> {
        self.eat(b'[')?;
        self.skip_ws();
        if self.peek()? == b']' {
            self.at += 1;
            return Some(());
        }
        loop {
            self.skip_ws();
            element(self)?;
            self.skip_ws();
            match self.next()? {
                b',' => continue,
                b']' => return Some(()),
                _ => return None,
            }
        }
    }

    /// Any JSON value, checked as strictly as the rest and thrown away.
    fn skip_value(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        match self.peek()? {
            b'"' => self.string().map(|_| ()),
            b'{' => self.object(&mut |r, _| r.skip_value(depth + 1)),
            b'[' => self.array(&mut |r| r.skip_value(depth + 1)),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => self.skip_number(),
            _ => None,
        }
    }

    /// JSON's number grammar: `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`.
    fn skip_number(&mut self) -> Option<()> {
        if self.peek() == Some(b'-') {
            self.at += 1;
        }
        match self.next()? {
            b'0' => {}
            b'1'..=b'9' => {
                self.skip_digits(0);
            }
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.at += 1;
            self.skip_digits(1)?;
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.at += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.at += 1;
            }
            self.skip_digits(1)?;
        }
        Some(())
    }

    /// At least `min` digits.
    fn skip_digits(&mut self, min: usize) -> Option<()> {
        let start = self.at;
        while let Some(b'0'..=b'9') = self.peek() {
            self.at += 1;
        }
        (self.at - start >= min).then_some(())
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::hashing::{hash_raw_memo_into, hash_request, BlockHashes, ChainMemo, HashConfig};
    use crate::request::{parse_request, ParsedRequest, Prompt};
    use proptest::prelude::*;

    /// `chat` and `parsed` are the same request: fields, and hashes at a few block sizes.
    pub(in crate::request) fn assert_same_request(
        chat: &RawRequest,
        parsed: &ParsedRequest,
    ) -> Result<(), TestCaseError> {
        prop_assert_eq!(chat.model, parsed.model.as_str());
        prop_assert_eq!(chat.cache_salt, parsed.cache_salt.as_deref());
        prop_assert_eq!(chat.stream, parsed.stream);
        prop_assert_eq!(chat.max_tokens, parsed.max_tokens);
        for block_size in [1, 3, 16] {
            let config = HashConfig {
                block_size,
                include_partial: true,
                ..HashConfig::default()
            };
            let mut raw = BlockHashes::default();
            hash_raw_memo_into(chat, config, &mut ChainMemo::default(), &mut raw);
            prop_assert_eq!(&raw, &hash_request(parsed, config));
        }
        Ok(())
    }

    /// Pieces of a JSON string's contents as a client may write them: plain words, JSON's
    /// escapes, \u escapes (a surrogate pair among them) and raw UTF-8.
    fn fragment() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec![
            "word ",
            "two words ",
            "x",
            "  ",
            r"\n",
            r"\t",
            r#"\""#,
            r"\\",
            r"\/",
            r"\b",
            r"\f",
            r"\r",
            r"\u00e9",
            r"\u003c",
            r"\u0041",
            r"\u0020",
            r"\u2028",
            r"\ud83d\ude00",
            "é",
            "日本語",
            "snake_case ",
            "{json: [1, 2]}",
            "<|user|>",
        ])
    }

    /// A JSON string's contents, long enough (with `long`) for the memo to keep, often long
    /// enough to be cut into segments (`hashing::segments`).
    fn contents(long: bool) -> impl Strategy<Value = String> {
        let n = if long { 60..700 } else { 0..8 };
        prop::collection::vec(fragment(), n).prop_map(|f| f.concat())
    }

    fn body(system: &str, user: &str, extra: &str) -> String {
        format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{user}","name":"u"}}]{extra}}}"#
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn escaped_and_unicode_contents_hash_as_parse_request_decodes_them(
            system in contents(true),
            user in contents(false),
            extra in prop::sample::select(vec![
                "", r#","stream":true"#, r#","max_tokens":0"#, r#","cache_salt":"t1""#,
                r#","tools":[{"a":{"b":[true,null,-1.5e3]}}],"temperature":0.7"#,
                r#","max_completion_tokens":null,"max_tokens":9"#,
            ]),
        ) {
            let body = body(&system, &user, extra);
            let chat = read_request(body.as_bytes());
            prop_assert!(chat.is_some(), "declined: {}", body);
            assert_same_request(&chat.unwrap(), &parse_request(body.as_bytes()).unwrap())?;
        }

        #[test]
        fn a_completions_prompt_hashes_as_parse_request_decodes_it(
            prompt in prop_oneof![contents(true), contents(false)],
            extra in prop::sample::select(vec![
                "", r#","stream":true"#, r#","max_tokens":0"#, r#","cache_salt":"t1""#,
                r#","logprobs":null,"temperature":0.7,"stop":["\n"]"#,
            ]),
        ) {
            let body = format!(r#"{{"model":"m","prompt":"{prompt}"{extra}}}"#);
            let request = read_request(body.as_bytes());
            prop_assert!(request.is_some(), "declined: {}", body);
            assert_same_request(&request.unwrap(), &parse_request(body.as_bytes()).unwrap())?;
        }

        #[test]
        fn a_memo_shared_by_both_readings_keeps_every_answer_exact(
            systems in prop::collection::vec(contents(true), 1..4),
            picks in prop::collection::vec((0usize..4, any::<bool>(), 0usize..3), 1..12),
        ) {
            // Requests repeat system prompts (memo hits), some read in place and some through
            // parse_request, into one memo, as a plugin worker's are.
            let mut memo = ChainMemo::default();
            let config = HashConfig::default();
            for (k, in_place, user) in picks {
                // Chats, and completions prompts of the same texts (a prompt's bytes as
                // written must not key a message's, nor a decoded text's).
                let system = &systems[k % systems.len()];
                let body = if k % 2 == 0 {
                    body(system, &"question ".repeat(user), "")
                } else {
                    format!(r#"{{"model":"m","prompt":"{system}{}"}}"#, "question ".repeat(user))
                };
                let parsed = parse_request(body.as_bytes()).unwrap();
                let mut got = BlockHashes::default();
                if in_place {
                    let chat = read_request(body.as_bytes()).unwrap();
                    hash_raw_memo_into(&chat, config, &mut memo, &mut got);
                } else {
                    crate::hashing::hash_request_memo_into(&parsed, config, &mut memo, &mut got);
                }
                prop_assert_eq!(got, hash_request(&parsed, config));
            }
        }
    }

    #[test]
    fn a_content_of_one_text_part_is_read_in_place_as_the_same_string_is() {
        let text = format!("{} why?", "the document says ".repeat(200));
        let plain = body(&text, "q", "");
        let expected = hash_request(
            &parse_request(plain.as_bytes()).unwrap(),
            HashConfig::default(),
        );
        for part in [
            format!(r#"[{{"type":"text","text":"{text}"}}]"#),
            format!(r#"[ {{ "text" : "{text}" , "type" : "text" }} ]"#),
        ] {
            let body = plain.replacen(&format!(r#""{text}""#), &part, 1);
            let raw = read_request(body.as_bytes());
            assert!(raw.is_some(), "declined: {body}");
            let parsed = parse_request(body.as_bytes()).unwrap();
            assert_same_request(&raw.unwrap(), &parsed).unwrap();
            assert_eq!(hash_request(&parsed, HashConfig::default()), expected);
        }
        // Any other list is left to `parse_request`: several parts, another kind, another
        // key, a repeated key, no part, a type spelled with an escape.
        for content in [
            r#"[{"type":"text","text":"a"},{"type":"text","text":"b"}]"#,
            r#"[{"type":"image_url","image_url":{"url":"u"}}]"#,
            r#"[{"type":"text","text":"a","cache_control":{"type":"ephemeral"}}]"#,
            r#"[{"type":"text","type":"text","text":"a"}]"#,
            r#"[{"type":"text","text":"a","text":"b"}]"#,
            r#"[{"text":"a"}]"#,
            r#"[]"#,
            r#"[{"type":"t\u0065xt","text":"a"}]"#,
        ] {
            let body = format!(r#"{{"messages":[{{"role":"user","content":{content}}}]}}"#);
            assert_eq!(read_request(body.as_bytes()), None, "{body}");
        }
    }

    /// A message's segment in the middle of one message and the same bytes ending another
    /// (where the line break after the content is tokenized with them) are told apart.
    #[test]
    fn the_same_bytes_as_a_middle_and_as_a_last_segment_hash_apart() {
        // Three parts of more than a segment each.
        let part = |w: &str| format!("{w} ").repeat(crate::hashing::segments::SEGMENT_BYTES / 4);
        let (x, y, z) = (part("alpha"), part("beta"), part("gamma"));
        let config = HashConfig::default();
        let mut memo = ChainMemo::default();
        for content in [
            format!("{x}{y}{z}"),
            format!("{x}{y}{z}"),
            format!("{x}{y}"),
        ] {
            let body = body(&content, "why?", "");
            let raw = read_request(body.as_bytes()).unwrap();
            let mut got = BlockHashes::default();
            hash_raw_memo_into(&raw, config, &mut memo, &mut got);
            assert_eq!(
                got,
                hash_request(&parse_request(body.as_bytes()).unwrap(), config)
            );
        }
        assert!(memo.stats().hits > 0, "{:?}", memo.stats());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn a_body_with_one_byte_changed_is_declined_or_read_as_serde_reads_it(
            system in contents(false),
            shape in 0..3u8,
            at in any::<prop::sample::Index>(),
            byte in any::<u8>(),
        ) {
            let mut body = match shape {
                0 => format!(r#"{{"model":"m","prompt":"{system}","stop":["a",null],"stream":true}}"#),
                1 => body(&system, "q", r#","tools":[{"a":[1.5e3,null]}],"stream":true"#),
                _ => format!(
                    r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"{system}"}}]}}]}}"#
                ),
            }
            .into_bytes();
            let i = at.index(body.len());
            body[i] = byte;
            if let Some(chat) = read_request(&body) {
                let parsed = parse_request(&body);
                prop_assert!(parsed.is_ok(), "read in place, refused by serde: {:?}", parsed);
                assert_same_request(&chat, &parsed.unwrap())?;
            }
        }
    }

    #[test]
    fn a_run_of_text_ends_exactly_at_its_first_stop_byte() {
        let plain = b"Plain text, ~ and DEL \x7f: no stops here at all!!".repeat(2);
        for stop in [b'"', b'\\', 0x00, 0x0a, 0x1f, 0x80, 0xc3, 0xff] {
            for at in 0..plain.len() {
                let mut text = plain.clone();
                text[at] = stop;
                // A second stop later must not move the answer.
                if at + 9 < text.len() {
                    text[at + 9] = b'"';
                }
                let first_of_any = if stop >= 0x80 && at + 9 < text.len() {
                    at + 9
                } else if stop >= 0x80 {
                    text.len()
                } else {
                    at
                };
                assert_eq!(run_end::<true>(&text), at, "{stop:#x} at {at}");
                assert_eq!(run_end::<false>(&text), first_of_any, "{stop:#x} at {at}");
            }
        }
        assert_eq!(run_end::<true>(&plain), plain.len());
        assert_eq!(run_end::<true>(b""), 0);
    }

    #[test]
    fn messages_of_one_length_and_role_are_told_apart_by_their_bytes() {
        // Same role, same length, one letter apart (and one written with an escape): the
        // memo's key must cover the content, not only its length.
        let long = "word ".repeat(80);
        let systems = [
            format!("{long}alpha"),
            format!("{long}alphb"),
            format!(r"{long}alpha"),
        ];
        let mut memo = ChainMemo::default();
        let config = HashConfig::default();
        for _ in 0..3 {
            for system in &systems {
                let body = body(system, "q", "");
                let mut got = BlockHashes::default();
                hash_raw_memo_into(
                    &read_request(body.as_bytes()).unwrap(),
                    config,
                    &mut memo,
                    &mut got,
                );
                let parsed = parse_request(body.as_bytes()).unwrap();
                assert_eq!(got, hash_request(&parsed, config), "{system}");
            }
        }
        assert!(memo.stats().hits >= 3, "{:?}", memo.stats());
    }

    #[test]
    fn bodies_serde_json_refuses_are_declined() {
        for body in [
            &br#"{"messages":[{"role":"user","content":"a"}]"#[..], // cut short
            br#"{"messages":[{"role":"user","content":"a"}]} x"#,   // trailing bytes
            br#"{"messages":[{"role":"user","content":"\ud800"}]}"#, // lone surrogate
            br#"{"messages":[{"role":"user","content":"\udc00 x"}]}"#,
            br#"{"messages":[{"role":"user","content":"\x"}]}"#, // unknown escape
            b"{\"messages\":[{\"role\":\"user\",\"content\":\"a\x01\"}]}", // control byte
            b"{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\"}]}", // not UTF-8
            b"{\"messages\":[{\"role\":\"user\",\"content\":\"\xc3\"}]}", // cut character
            br#"{"messages":[{"role":"user","content":"a"}],"t":01}"#, // leading zero
            br#"{"messages":[{"role":"user","content":"a"}],"t":1.}"#,
            br#"{"messages":[{"role":"user","content":"a"}],"t":[1,]}"#,
            br#"{"messages":[{"role":"user","content":"a"},]}"#,
        ] {
            assert!(
                parse_request(body).is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
            assert_eq!(
                read_request(body),
                None,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn shapes_it_is_not_sure_of_are_left_to_parse_request() {
        for body in [
            &br#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#[..],
            br#"{"messages":[{"role":"us\u0065r","content":"a"}]}"#, // escaped role
            br#"{"m\u006fdel":"x","messages":[{"role":"user","content":"a"}]}"#, // escaped key
            br#"{"model":"a","model":"b","messages":[{"role":"user","content":"a"}]}"#,
            br#"{"prompt":["a","b"]}"#, // a batch: a chain each
            br#"{"prompt":[1,2,3]}"#,   // token ids
            br#"{"prompt":null}"#,
            br#"{"prompt":"a","prompt":"b"}"#,
            br#"{"prompt":"a","messages":[{"role":"user","content":"b"}]}"#,
            br#"{"messages":[{"role":"user","content":"b"}],"prompt":"a"}"#,
            br#"{"messages":[]}"#,
            br#"{"messages":[{"content":"a"}]}"#, // no role: an error for parse_request
            br#"{"max_tokens":1.0,"messages":[{"role":"user","content":"a"}]}"#,
            br#"{"max_tokens":4294967296,"messages":[{"role":"user","content":"a"}]}"#,
        ] {
            assert_eq!(
                read_request(body),
                None,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        // The common shape is read, with what parse_request reads from it.
        let body = br#" {"model":"m","stream":false,"messages":[{"role":"system","content":null},{"content":"hi\n","role":"user"}],"max_tokens":7} "#;
        let chat = read_request(body).expect("the common shape");
        let RawPrompt::Messages(messages) = &chat.prompt else {
            panic!("a chat has messages")
        };
        assert_eq!(messages.len(), 2);
        assert_eq!(chat.max_tokens, Some(7));
        let Prompt::Text(text) = &parse_request(body).unwrap().prompts[0] else {
            panic!("chat is text")
        };
        let mut decoded = Vec::new();
        messages[1].content.unwrap().decode_into(&mut decoded);
        assert_eq!(decoded, b"hi\n");
        assert_eq!(text, "<|system|>\n\n<|user|>\nhi\n\n");
        // A completions prompt of one string is read too.
        let body = br#"{"model":"m","prompt":"Once upon\na time","max_tokens":7,"stream":true}"#;
        let request = read_request(body).expect("a prompt of one string");
        let RawPrompt::Text(prompt) = request.prompt else {
            panic!("a completions prompt is text")
        };
        let mut decoded = Vec::new();
        prompt.decode_into(&mut decoded);
        assert_eq!(decoded, b"Once upon\na time");
        assert!(request.stream);
        assert_eq!(request.max_tokens, Some(7));
    }
}
