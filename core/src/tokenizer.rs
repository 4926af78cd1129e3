//! Tokens without a tokenizer.
//!
//! This is the scheme llm-d-inference-sim uses for models it has no tokenizer for: the text is
//! split into pieces, each piece is either one punctuation character from a fixed set or a run of
//! word characters, and each piece owns the whitespace that follows it. A token id is the 32-bit
//! FNV-1a hash of the piece's text (including that whitespace). Characters that are neither
//! (other symbols, non-ASCII letters) belong to no piece and are skipped, exactly as a regex
//! `FindAll` would skip them.
//!
//! Word characters follow Go/RE2 `\w`: ASCII letters, digits and underscore only. RE2 is what the
//! simulator uses, and the router only needs to agree with itself, so a non-ASCII letter is not a
//! word character here (it is skipped); text in other scripts still yields tokens through its
//! ASCII punctuation and digits, and the block hashes remain deterministic.
//!
//! The scanner is written by hand so the wasm plugin carries no regex engine.

/// The single-character pieces.
const PUNCTUATION: &[u8] = b"{}:,-.?!;@#$%^&*()+_~/\\><[]=\"'";

const OTHER: u8 = 0;
const WORD: u8 = 1;
const PUNCT: u8 = 2;
const SPACE: u8 = 3;

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
        b += 1;
    }
    let mut i = 0;
    while i < PUNCTUATION.len() {
        // `_` is both; as a piece's first byte it is punctuation (see `Pieces::next`).
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

fn class(b: u8) -> u8 {
    CLASS[b as usize]
}

fn is_word_byte(b: u8) -> bool {
    CONTINUES_WORD[b as usize]
}

/// Does `b` end every run before it (neither continues a word nor is whitespace)? Then no
/// piece crosses it, and the text from it on tokenizes the same on its own.
pub(crate) fn ends_runs(b: u8) -> bool {
    !is_word_byte(b) && class(b) != SPACE
}

const FNV_OFFSET: u32 = 0x811c_9dc5;

fn fnv_step(hash: u32, b: u8) -> u32 {
    (hash ^ u32::from(b)).wrapping_mul(0x0100_0193)
}

/// 32-bit FNV-1a, as Go's `hash/fnv.New32a`.
pub fn fnv1a32(bytes: &[u8]) -> u32 {
    bytes.iter().fold(FNV_OFFSET, |hash, &b| fnv_step(hash, b))
}

/// The one scanner: calls `emit` with each piece's byte range and token id, in order. Each
/// byte is classified once and hashed as it is scanned (no piece slices, no second pass): this
/// is the plugin's hottest loop, every prompt byte goes through it once per request.
fn scan(bytes: &[u8], mut emit: impl FnMut(std::ops::Range<usize>, u32)) {
    let n = bytes.len();
    let mut i = 0;
    while i < n {
        // Skip bytes that start no piece. Pieces start and end on ASCII bytes, so every range
        // falls on UTF-8 character boundaries.
        let first = class(bytes[i]);
        if first == OTHER || first == SPACE {
            i += 1;
            continue;
        }
        let start = i;
        let mut hash = fnv_step(FNV_OFFSET, bytes[i]);
        i += 1;
        // The simulator's pattern lists the punctuation alternatives before `\w+` and RE2 is
        // leftmost-first, so `_` at the start of a piece is a piece of its own (class PUNCT),
        // while `_` inside a run of word characters continues the run.
        if first == WORD {
            while i < n && is_word_byte(bytes[i]) {
                hash = fnv_step(hash, bytes[i]);
                i += 1;
            }
        }
        while i < n && class(bytes[i]) == SPACE {
            hash = fnv_step(hash, bytes[i]);
            i += 1;
        }
        emit(start..i, hash);
    }
}

/// The pieces of `text`, in order, each with its trailing whitespace (for explanations and
/// tests; routing only needs their ids, see [`for_each_token`]).
pub fn pieces(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    scan(text.as_bytes(), |range, _| out.push(&text[range]));
    out
}

/// Calls `emit` with each token id of `text`, in order: the FNV-1a of every piece of
/// [`pieces`].
pub fn for_each_token(text: &str, mut emit: impl FnMut(u32)) {
    scan(text.as_bytes(), |_, id| emit(id));
}

/// [`for_each_token`] of UTF-8 text given as its bytes (text checked to be UTF-8 elsewhere,
/// such as a JSON string read in place: the scanner reads bytes and skips every non-ASCII one,
/// so it needs no second check).
pub fn for_each_token_in_bytes(text: &[u8], mut emit: impl FnMut(u32)) {
    scan(text, |_, id| emit(id));
}

/// [`for_each_token`] with the byte offset where each token's piece starts.
pub fn for_each_token_at(text: &str, mut emit: impl FnMut(usize, u32)) {
    scan(text.as_bytes(), |range, id| emit(range.start, id));
}

/// Token ids of `text`, appended to `out` (so callers can reuse one buffer).
pub fn tokenize_into(text: &str, out: &mut Vec<u32>) {
    for_each_token(text, |id| out.push(id));
}

/// Token ids of `text`.
pub fn tokenize(text: &str) -> Vec<u32> {
    let mut out = Vec::with_capacity(text.len() / 4 + 1);
    tokenize_into(text, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces_of(text: &str) -> Vec<&str> {
        pieces(text)
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
    fn non_ascii_letters_are_not_word_characters() {
        // RE2 `\w` is ASCII-only: "é" splits the word and is itself skipped.
        assert_eq!(pieces_of("café au"), vec!["caf", "au"]);
        assert_eq!(pieces_of("日本語 2024."), vec!["2024", "."]);
    }

    #[test]
    fn token_ids_are_fnv_of_piece_with_whitespace() {
        let ids = tokenize("a b");
        assert_eq!(ids, vec![fnv1a32(b"a "), fnv1a32(b"b")]);
        assert_ne!(tokenize("a b"), tokenize("ab"));
    }

    #[test]
    fn tokenize_into_appends() {
        let mut buf = vec![7];
        tokenize_into("x", &mut buf);
        assert_eq!(buf, vec![7, fnv1a32(b"x")]);
    }

    proptest::proptest! {
        #[test]
        fn each_token_id_is_the_fnv_of_its_piece(
            text in "[a-zA-Z0-9_ \t\n,.!?:;{}()\\[\\]<>=+*&^%$#@~/\\\\'\"`|é日-]{0,80}"
        ) {
            let from_pieces: Vec<u32> = pieces(&text).iter().map(|p| fnv1a32(p.as_bytes())).collect();
            proptest::prop_assert_eq!(tokenize(&text), from_pieces);
        }
    }
}
