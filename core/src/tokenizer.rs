//! Tokens without a tokenizer.
//!
//! This is the scheme llm-d-inference-sim uses for models it has no tokenizer for: the text is
//! split into pieces, each piece is either one punctuation character from a fixed set or a run of
//! word characters, and each piece owns the whitespace that follows it. A token id is the 32-bit
//! FNV-1a hash of the piece's text (including that whitespace). Characters that are neither
//! (the other ASCII symbols, and there every character outside ASCII) belong to no piece and
//! are skipped, exactly as a regex `FindAll` would skip them.
//!
//! Word characters follow Go/RE2 `\w`: ASCII letters, digits and underscore only, as the
//! simulator's RE2 has them. What happens to a character outside ASCII is [`NonAscii`]'s choice:
//! the simulator skips it (so Chinese or Japanese text yields almost no tokens, and every
//! prompt in such a script would look like every other one to a router that skipped it too);
//! by default here it is a piece of its own, about one token per character as a model's
//! tokenizer gives such text, so prompts in any script are told apart and priced.
//!
//! The scanner is written by hand so the wasm plugin carries no regex engine. A router whose
//! blocks are known by their text needs no ids, only where every 16th piece starts: `spans`
//! counts the same pieces 64 bytes at a time from bit masks (`cut_blocks`).

/// The single-character pieces.
const PUNCTUATION: &[u8] = b"{}:,-.?!;@#$%^&*()+_~/\\><[]=\"'";

const OTHER: u8 = 0;
const WORD: u8 = 1;
const PUNCT: u8 = 2;
const SPACE: u8 = 3;
/// The first byte of a UTF-8 character outside ASCII (continuation bytes are `OTHER`).
const LEAD: u8 = 4;
/// The first byte of a two-byte character from U+00C0 to U+07FF: accented Latin, Greek,
/// Cyrillic, Armenian, Hebrew and Arabic letters, alphabets that space their words.
const LETTER_LEAD: u8 = 5;

/// What the tokenizer does with a character outside ASCII (the plugin's `non_ascii`,
/// `prefixroute … --non-ascii`). ASCII text tokenizes the same either way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NonAscii {
    /// A piece of its own, owning the whitespace after it, as punctuation is: a prompt in
    /// Chinese gets about one token per character, a model's tokenizer ~0.7–1.5. Except a
    /// letter of an alphabet that spaces its words (two-byte UTF-8 from U+00C0: accented
    /// Latin, Greek, Cyrillic, Armenian, Hebrew, Arabic), which continues a word as an ASCII
    /// letter does: "Größe" and "привет" are one piece each, not one per letter.
    #[default]
    Pieces,
    /// Skipped, as llm-d-inference-sim's `\w+` pattern skips it: the router's token ids then
    /// equal that simulator's on every text, which `index: precise` in front of it needs (its
    /// KV events carry its own ids). Text in other scripts then yields tokens only from its
    /// ASCII characters.
    Skip,
}

impl NonAscii {
    pub const ALL: [NonAscii; 2] = [NonAscii::Pieces, NonAscii::Skip];
    pub const NAMES: [&'static str; 2] = ["pieces", "skip"];

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

impl std::str::FromStr for NonAscii {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        NonAscii::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown non-ASCII rule {s:?} (expected pieces or skip)"))
    }
}

/// Byte classes, looked up once per byte: the scanner is the hottest loop of a routing
/// decision, and a table beats searching the punctuation list for every byte.
const CLASS: [u8; 256] = {
    let mut table = [OTHER; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        if c.is_ascii_alphanumeric() || c == b'_' {
            table[b] = WORD;
        }
        // Whitespace as RE2 `\s` (and Go's): space, \t, \n, \v, \f, \r.
        if matches!(c, b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c) {
            table[b] = SPACE;
        }
        if c >= 0xc0 {
            table[b] = if matches!(c, 0xc3..=0xdf) {
                LETTER_LEAD
            } else {
                LEAD
            };
        }
        b += 1;
    }
    let mut i = 0;
    while i < PUNCTUATION.len() {
        // `_` is both; as a piece's first byte it is punctuation (see `scan_with`).
        table[PUNCTUATION[i] as usize] = PUNCT;
        i += 1;
    }
    table
};

/// Bytes that continue a run of word characters (`\w`, so `_` too): one lookup per byte in
/// the scanner's inner loop instead of a class test and a comparison.
const CONTINUES_WORD: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] = c.is_ascii_alphanumeric() || c == b'_';
        b += 1;
    }
    table
};

/// [`CONTINUES_WORD`] with [`NonAscii::Pieces`]: also a letter of an alphabet that spaces its
/// words, its first byte and its continuation byte. A continuation byte follows only its own
/// first byte in UTF-8, so after a word byte it is always such a letter's second byte.
const CONTINUES_WORD_OR_LETTER: [bool; 256] = {
    let mut table = CONTINUES_WORD;
    let mut b = 0x80;
    while b < 0xc0 {
        table[b] = true;
        b += 1;
    }
    let mut b = 0xc3;
    while b <= 0xdf {
        table[b] = true;
        b += 1;
    }
    table
};

/// Whitespace as RE2 `\s` has it (the class SPACE), as a table the scanner's runs read.
const IS_SPACE: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        table[b] = CLASS[b] == SPACE;
        b += 1;
    }
    table
};

fn class(b: u8) -> u8 {
    CLASS[b as usize]
}

/// Does `b` end every run before it (neither continues a word nor is whitespace)? Then no
/// piece crosses it, and the text from it on tokenizes the same on its own.
pub(crate) fn ends_runs(b: u8) -> bool {
    // A continuation byte would continue a character's piece, a letter a word (under either
    // rule, so that this holds for both).
    !CONTINUES_WORD_OR_LETTER[b as usize] && class(b) != SPACE
}

const FNV_OFFSET: u32 = 0x811c_9dc5;

/// One byte into the hash. The byte comes widened: the scanner reads each byte once as an
/// index into its tables, and a `u8` here made LLVM mask it again for every byte.
fn fnv_step(hash: u32, b: usize) -> u32 {
    (hash ^ b as u32).wrapping_mul(0x0100_0193)
}

/// 32-bit FNV-1a, as Go's `hash/fnv.New32a`.
pub fn fnv1a32(bytes: &[u8]) -> u32 {
    bytes
        .iter()
        .fold(FNV_OFFSET, |hash, &b| fnv_step(hash, usize::from(b)))
}

/// The byte after a text that the scanner reads: it continues no run (it is neither a word
/// byte, a continuation byte nor whitespace), so every run of the last piece stops there.
pub const STOP: u8 = 0;

// What the scanner's safety rests on: no run takes the stop.
const _: () = assert!(
    !CONTINUES_WORD[STOP as usize]
        && !CONTINUES_WORD_OR_LETTER[STOP as usize]
        && !IS_SPACE[STOP as usize]
        && STOP & 0xc0 != 0x80
);

/// A text followed by [`STOP`]: what the byte scanner reads. Made only by [`Stopped::stop`],
/// which appends the stop, so the scanner may read up to it without comparing indices with the
/// end.
#[derive(Debug, Clone, Copy)]
pub struct Stopped<'a>(&'a [u8]);

impl<'a> Stopped<'a> {
    /// Appends [`STOP`] to `buf` (text the caller built there, such as a flattened chat
    /// message) and lends it to the scanners.
    pub fn stop(buf: &'a mut Vec<u8>) -> Stopped<'a> {
        buf.push(STOP);
        Stopped(buf)
    }

    /// The text, without the stop after it.
    pub(crate) fn text(&self) -> &'a [u8] {
        &self.0[..self.0.len() - 1]
    }

    /// Calls `f` with `bytes` copied once with [`STOP`] after them (one `memory.copy` in the
    /// plugin), for a text not built in a buffer of the caller's.
    pub fn copied<R>(bytes: &[u8], f: impl FnOnce(Stopped<'_>) -> R) -> R {
        let mut buf = Vec::with_capacity(bytes.len() + 1);
        buf.extend_from_slice(bytes);
        f(Stopped::stop(&mut buf))
    }
}

/// The scanner over `bytes`, copied with the stop after them. A caller that builds its text in
/// a buffer stops it there instead ([`for_each_token_stopped`]).
fn scan(bytes: &[u8], non_ascii: NonAscii, emit: impl FnMut(std::ops::Range<usize>, u32)) {
    Stopped::copied(bytes, |text| scan_stopped(text, non_ascii, emit))
}

/// The byte scanner: calls `emit` with each piece of the text, its byte range and token id, in
/// order. Each byte is classified once and hashed as it is scanned (no piece slices, no second
/// pass): with token ids (`index: precise`) this is the plugin's hottest loop, every prompt byte goes through it once per
/// request. The stop byte is why it is fast: a run reads bytes until one does not continue it,
/// and the stop is such a byte, so no run compares its index with the text's end (what that
/// saves is in docs/benchmarks.md).
#[inline(always)]
fn scan_stopped(
    text: Stopped<'_>,
    non_ascii: NonAscii,
    emit: impl FnMut(std::ops::Range<usize>, u32),
) {
    // One loop per rule, each with its table at a fixed address: choosing the table at run
    // time cost ~8% more instructions per token on a cold prompt.
    match non_ascii {
        NonAscii::Pieces => scan_with::<false>(text, emit),
        NonAscii::Skip => scan_with::<true>(text, emit),
    }
}

// Inlined into its caller, so that an `emit` closure's captures stay in locals (a chain's
// fill count and last hash; through memory they cost ~20 instructions per token).
#[inline(always)]
fn scan_with<const SKIP: bool>(
    Stopped(buf): Stopped<'_>,
    mut emit: impl FnMut(std::ops::Range<usize>, u32),
) {
    let continues = if SKIP {
        &CONTINUES_WORD
    } else {
        &CONTINUES_WORD_OR_LETTER
    };
    /// Hashes the bytes from `*p` on that `accepts` takes, leaving `*p` at the first it does
    /// not (written so that a byte costs one load and one test).
    ///
    /// SAFETY: `*p` points into a stopped buffer and `accepts` takes no [`STOP`], so `*p` never
    /// passes the stop.
    #[inline(always)]
    unsafe fn run(p: &mut *const u8, mut hash: u32, accepts: impl Fn(usize) -> bool) -> u32 {
        let mut c = usize::from(**p);
        while accepts(c) {
            hash = fnv_step(hash, c);
            *p = p.add(1);
            c = usize::from(**p);
        }
        hash
    }
    let base = buf.as_ptr();
    // SAFETY (every `*p` below): `p` never passes the stop, the buffer's last byte: the outer
    // loop reads below it, and a run stops on it at the latest.
    let stop = unsafe { base.add(buf.len() - 1) };
    let offset = |p: *const u8| p as usize - base as usize;
    let mut p = base;
    while p < stop {
        // Skip bytes that start no piece. A piece starts on an ASCII byte or a character's
        // first byte and ends after a whole character, so every range falls on UTF-8
        // character boundaries.
        let b = unsafe { *p };
        let start = p;
        p = unsafe { p.add(1) };
        let first = class(b);
        if first == OTHER || first == SPACE || (first >= LEAD && SKIP) {
            continue;
        }
        let mut hash = fnv_step(FNV_OFFSET, usize::from(b));
        // The simulator's pattern lists the punctuation alternatives before `\w+` and RE2 is
        // leftmost-first, so `_` at the start of a piece is a piece of its own (class PUNCT),
        // while `_` inside a run of word characters continues the run.
        if first == WORD || first == LETTER_LEAD {
            hash = unsafe { run(&mut p, hash, |c| continues[c]) };
        } else if first == LEAD {
            // The rest of the character: its continuation bytes.
            hash = unsafe { run(&mut p, hash, |c| c & 0xc0 == 0x80) };
        }
        hash = unsafe { run(&mut p, hash, |c| IS_SPACE[c]) };
        emit(offset(start)..offset(p), hash);
    }
}

mod spans;
pub(crate) use spans::cut_blocks;

/// The pieces of `text`, in order, each with its trailing whitespace (for explanations and
/// tests; routing only needs their ids, see [`for_each_token`]).
pub fn pieces(text: &str, non_ascii: NonAscii) -> Vec<&str> {
    let mut out = Vec::new();
    scan(text.as_bytes(), non_ascii, |range, _| {
        out.push(&text[range])
    });
    out
}

/// Calls `emit` with each token id of `text`, in order: the FNV-1a of every piece of
/// [`pieces`].
pub fn for_each_token(text: &str, non_ascii: NonAscii, mut emit: impl FnMut(u32)) {
    scan(text.as_bytes(), non_ascii, |_, id| emit(id));
}

/// [`for_each_token`] of a stopped text (the plugin flattens each chat message into a buffer
/// and stops it there, so the text is not copied again; its bytes were checked to be UTF-8 as
/// they were read).
#[inline(always)]
pub fn for_each_token_stopped(text: Stopped<'_>, non_ascii: NonAscii, mut emit: impl FnMut(u32)) {
    scan_stopped(text, non_ascii, |_, id| emit(id));
}

/// [`for_each_token`] with the byte offset where each token's piece starts.
pub fn for_each_token_at(text: &str, non_ascii: NonAscii, mut emit: impl FnMut(usize, u32)) {
    scan(text.as_bytes(), non_ascii, |range, id| {
        emit(range.start, id)
    });
}

/// Token ids of `text`, appended to `out` (so callers can reuse one buffer).
pub fn tokenize_into(text: &str, non_ascii: NonAscii, out: &mut Vec<u32>) {
    for_each_token(text, non_ascii, |id| out.push(id));
}

/// Token ids of `text`.
pub fn tokenize(text: &str, non_ascii: NonAscii) -> Vec<u32> {
    let mut out = Vec::with_capacity(text.len() / 4 + 1);
    tokenize_into(text, non_ascii, &mut out);
    out
}

/// Texts of every byte class the scanners tell apart (letters, digits, `_`, each kind of
/// whitespace, NUL, the other ASCII symbols, punctuation, continuation bytes, letters at the
/// ends of the two-byte range, other characters), up to `max` characters: the property tests'
/// strategy for both scanners.
#[cfg(test)]
pub(crate) fn texts_of_every_class(max: usize) -> proptest::string::RegexGeneratorStrategy<String> {
    let class = "[a-zA-Z0-9_ \t\n\r\x0b\x0c\x00\x01\x7f,.!?:;{}()\\[\\]<>=+*&^%$#@~/\\\\'\"`|\u{80}\u{bf}\u{c0}éдߺࠀ«日🦀-]";
    proptest::string::string_regex(&format!("{class}{{0,{max}}}")).expect("a valid pattern")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces_of(text: &str) -> Vec<&str> {
        pieces(text, NonAscii::default())
    }

    fn is_word_byte(b: u8) -> bool {
        CONTINUES_WORD[b as usize]
    }

    #[test]
    fn byte_classes_match_the_documented_sets() {
        for b in 0..=255u8 {
            let expected = if PUNCTUATION.contains(&b) {
                PUNCT
            } else if b.is_ascii_alphanumeric() {
                WORD
            } else if b" \t\n\r\x0b\x0c".contains(&b) {
                SPACE
            } else if (0xc3..=0xdf).contains(&b) {
                LETTER_LEAD
            } else if b >= 0xc0 {
                LEAD
            } else {
                OTHER
            };
            assert_eq!(class(b), expected, "byte {b:#04x}");
        }
        assert!(is_word_byte(b'_') && is_word_byte(b'a') && !is_word_byte(b'-'));
    }

    #[test]
    fn fnv1a32_matches_reference_vectors() {
        // Reference values of the FNV-1a 32-bit test suite.
        assert_eq!(fnv1a32(b""), 0x811c9dc5);
        assert_eq!(fnv1a32(b"a"), 0xe40c292c);
        assert_eq!(fnv1a32(b"foobar"), 0xbf9cf968);
    }

    #[test]
    fn words_and_punctuation_own_trailing_whitespace() {
        assert_eq!(
            pieces_of("Hello, world!  How are-you?\n"),
            vec!["Hello", ", ", "world", "!  ", "How ", "are", "-", "you", "?\n"]
        );
    }

    #[test]
    fn leading_whitespace_and_unknown_symbols_are_skipped() {
        assert_eq!(pieces_of("   a | b`c"), vec!["a ", "b", "c"]);
        assert_eq!(pieces_of(""), Vec::<&str>::new());
        assert_eq!(pieces_of(" \n\t"), Vec::<&str>::new());
    }

    #[test]
    fn underscore_continues_a_word_but_starts_none() {
        assert_eq!(pieces_of("snake_case _x"), vec!["snake_case ", "_", "x"]);
    }

    #[test]
    fn a_character_outside_ascii_is_a_piece_of_its_own_by_default() {
        assert_eq!(
            pieces_of("日本語 2024。🦀"),
            vec!["日", "本", "語 ", "2024", "。", "🦀"]
        );
        assert_eq!(pieces_of("«x» ¿y?"), vec!["«", "x", "» ", "¿", "y", "?"]);
    }

    #[test]
    fn letters_of_alphabets_that_space_their_words_continue_words_by_default() {
        assert_eq!(pieces_of("café au lait"), vec!["café ", "au ", "lait"]);
        assert_eq!(pieces_of("Größe: naïve_x"), vec!["Größe", ": ", "naïve_x"]);
        assert_eq!(
            pieces_of("Привет, мир! Γειά σου"),
            vec!["Привет", ", ", "мир", "! ", "Γειά ", "σου"]
        );
        // A word of one script and a character of another part where they meet.
        assert_eq!(pieces_of("abcдеф日x"), vec!["abcдеф", "日", "x"]);
        // Under `skip` every one of them goes, as the simulator's RE2 `\w` has it.
        assert_eq!(pieces("café мир", NonAscii::Skip), vec!["caf"]);
    }

    #[test]
    fn with_skip_a_character_outside_ascii_is_skipped_as_the_simulator_does() {
        assert_eq!(pieces("café au", NonAscii::Skip), vec!["caf", "au"]);
        assert_eq!(pieces("日本語 2024.", NonAscii::Skip), vec!["2024", "."]);
    }

    #[test]
    fn prompts_in_chinese_are_told_apart_only_when_their_characters_are_pieces() {
        let a = "<|system|>\n你是一个乐于助人的客服助手。\n<|user|>\n我的订单什么时候到？\n";
        let b = "<|system|>\n你是一名专业的法律顾问。\n<|user|>\n合同可以提前解除吗？\n";
        assert_ne!(tokenize(a, NonAscii::Pieces), tokenize(b, NonAscii::Pieces));
        assert!(tokenize(a, NonAscii::Pieces).len() > 20);
        // Skipped, the two are the same six tokens: their chat headers.
        assert_eq!(tokenize(a, NonAscii::Skip), tokenize(b, NonAscii::Skip));
        assert_eq!(tokenize(a, NonAscii::Skip).len(), 6);
    }

    #[test]
    fn token_ids_are_fnv_of_piece_with_whitespace() {
        let ids = tokenize("a b", NonAscii::default());
        assert_eq!(ids, vec![fnv1a32(b"a "), fnv1a32(b"b")]);
        assert_ne!(ids, tokenize("ab", NonAscii::default()));
    }

    #[test]
    fn tokenize_into_appends() {
        let mut buf = vec![7];
        tokenize_into("x", NonAscii::default(), &mut buf);
        assert_eq!(buf, vec![7, fnv1a32(b"x")]);
    }

    #[test]
    fn rules_have_names() {
        for rule in NonAscii::ALL {
            assert_eq!(rule.name().parse::<NonAscii>(), Ok(rule));
        }
        assert!("none".parse::<NonAscii>().is_err());
    }

    /// The pieces as the module's doc defines them, read a character at a time: the oracle
    /// the byte scanner (tables, a stop byte, no bounds checks) is held to.
    fn pieces_by_chars(text: &str, rule: NonAscii) -> Vec<&str> {
        let skip = rule == NonAscii::Skip;
        let letter = |c: char| !skip && ('\u{c0}'..='\u{7ff}').contains(&c);
        let starts_word = |c: char| c.is_ascii_alphanumeric() || letter(c);
        let continues_word = |c: char| starts_word(c) || c == '_';
        let space = |c: char| matches!(c, ' ' | '\t' | '\n' | '\r' | '\x0b' | '\x0c');
        let starts = |c: char| {
            starts_word(c)
                || (c.is_ascii() && PUNCTUATION.contains(&(c as u8)))
                || !(c.is_ascii() || skip)
        };
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        let (mut out, mut k) = (Vec::new(), 0);
        while k < chars.len() {
            let (start, c) = chars[k];
            k += 1;
            if !starts(c) {
                continue;
            }
            if starts_word(c) {
                while k < chars.len() && continues_word(chars[k].1) {
                    k += 1;
                }
            }
            while k < chars.len() && space(chars[k].1) {
                k += 1;
            }
            out.push(&text[start..chars.get(k).map_or(text.len(), |&(i, _)| i)]);
        }
        out
    }

    #[test]
    fn a_stopped_text_is_read_up_to_its_stop() {
        let mut buf = b"ab cd".to_vec();
        let mut ids = Vec::new();
        for_each_token_stopped(Stopped::stop(&mut buf), NonAscii::Pieces, |id| ids.push(id));
        assert_eq!(ids, tokenize("ab cd", NonAscii::Pieces));
        assert_eq!(buf, b"ab cd\0", "the stop is appended, after the text");
        // A stop byte inside a text is an unknown symbol there, as in any text.
        assert_eq!(pieces_of("a\0b"), vec!["a", "b"]);
        let mut empty = Vec::new();
        ids.clear();
        for_each_token_stopped(Stopped::stop(&mut empty), NonAscii::Pieces, |id| {
            ids.push(id)
        });
        assert!(ids.is_empty(), "an empty text has no tokens");
    }

    proptest::proptest! {
        #[test]
        fn each_token_id_is_the_fnv_of_its_piece(
            text in "[a-zA-Z0-9_ \t\n,.!?:;{}()\\[\\]<>=+*&^%$#@~/\\\\'\"`|éд«日🦀-]{0,80}",
            skip in proptest::bool::ANY,
        ) {
            let rule = if skip { NonAscii::Skip } else { NonAscii::Pieces };
            let from_pieces: Vec<u32> =
                pieces(&text, rule).iter().map(|p| fnv1a32(p.as_bytes())).collect();
            proptest::prop_assert_eq!(tokenize(&text, rule), from_pieces);
        }

        #[test]
        fn the_byte_scanner_cuts_the_pieces_the_characters_define(
            text in texts_of_every_class(120),
            skip in proptest::bool::ANY,
        ) {
            let rule = if skip { NonAscii::Skip } else { NonAscii::Pieces };
            proptest::prop_assert_eq!(pieces(&text, rule), pieces_by_chars(&text, rule));
            // And the plugin's entry, over a buffer that ends with the stop byte.
            let mut buf = text.as_bytes().to_vec();
            let mut ids = Vec::new();
            for_each_token_stopped(Stopped::stop(&mut buf), rule, |id| ids.push(id));
            proptest::prop_assert_eq!(ids, tokenize(&text, rule));
        }

        #[test]
        fn ascii_text_tokenizes_alike_under_either_rule(
            text in "[a-zA-Z0-9_ \t\n,.!?:;{}()<>=+*&^%$#@~/|-]{0,80}"
        ) {
            proptest::prop_assert_eq!(
                tokenize(&text, NonAscii::Pieces),
                tokenize(&text, NonAscii::Skip)
            );
        }

        #[test]
        fn text_from_a_piece_boundary_on_tokenizes_the_same_on_its_own(
            text in "[a-z ,<éд«日🦀]{0,60}",
            at in 0usize..60,
        ) {
            // What the memo relies on (`ends_runs`): at a byte that ends every run, the rest
            // of the text is the rest of the pieces.
            let at = at.min(text.len());
            if text.is_char_boundary(at) && text.as_bytes().get(at).is_some_and(|&b| ends_runs(b)) {
                for rule in NonAscii::ALL {
                    let whole = tokenize(&text, rule);
                    let (head, tail) = (tokenize(&text[..at], rule), tokenize(&text[at..], rule));
                    proptest::prop_assert_eq!(&whole[whole.len() - tail.len()..], &tail[..]);
                    proptest::prop_assert_eq!(whole.len(), head.len() + tail.len());
                }
            }
        }
    }
}
