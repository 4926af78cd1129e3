//! A long text cut into segments where the text itself says, so that a memo can hold its
//! prefixes.
//!
//! The memo of texts hashed before ([`super::ChainMemo`]) looks a text up whole. A prompt that
//! repeats a long prefix inside one text (a completions prompt, or a chat message holding a
//! document and then a question) is then never found: 16k tokens cost 1.31M wasm instructions
//! warm, against 273k for the same words as a system message and a question
//! (docs/benchmarks.md). Cut into segments, every segment that lies inside the shared prefix is
//! found, and only the last one (the prefix's tail and what follows) is tokenized.
//!
//! A cut depends only on the bytes before it, so that two prompts with the same prefix cut it
//! alike: a segment ends at the first word start (an ASCII letter or digit after a space) at
//! least [`SEGMENT_BYTES`] from its start, looked for over [`LOOK_BYTES`], then again
//! [`SEGMENT_BYTES`] further, and so on. Such a cut is where a piece of the tokenizer starts (a
//! piece owns the whitespace after it), in a decoded text and in a JSON string's bytes as they
//! lie alike (a space and a letter or digit are never part of an escape, and written as they
//! are they decode to themselves). The chain hashes a block that spans a cut as one run of
//! bytes (`Chainer::push_bytes`), so the blocks are the same wherever the cuts fall: they
//! decide what the memo can find, never a hash.

/// Bytes a segment holds at least: the last segment of a warm prompt (its shared prefix's tail
/// and its new text) is tokenized, so shorter segments tokenize less of the prefix again; longer
/// ones cost fewer lookups (a few hundred instructions each) and memo entries.
pub const SEGMENT_BYTES: usize = 2048;

/// How far past [`SEGMENT_BYTES`] a word start is looked for before the next try (one mask of
/// 64 bytes, with the byte before): a text without spaces before words (Chinese, Japanese)
/// costs a look at one byte in 32. In English a word starts every ~6 bytes.
pub const LOOK_BYTES: usize = 63;

/// Where the segment of `text` that starts at `start` ends (see the module documentation), or
/// `text.len()`.
pub(crate) fn segment_end(text: &[u8], start: usize) -> usize {
    let mut mark = start + SEGMENT_BYTES;
    while mark < text.len() {
        // The spaces among the look's bytes and the one before it, each followed by a word?
        let look = &text[mark - 1..text.len().min(mark + LOOK_BYTES)];
        let mut spaces = space_mask(look);
        while spaces != 0 {
            let at = spaces.trailing_zeros() as usize + 1;
            if look.get(at).is_some_and(u8::is_ascii_alphanumeric) {
                return mark - 1 + at;
            }
            spaces &= spaces - 1;
        }
        mark += SEGMENT_BYTES;
    }
    text.len()
}

/// Bit `i` set for each space at `look[i]`, of its first 64 bytes: with wasm SIMD sixteen
/// bytes a compare (text without spaces, such as Japanese, is looked at in a few instructions).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
fn space_mask(look: &[u8]) -> u64 {
    use core::arch::wasm32::{u8x16_bitmask, u8x16_eq, u8x16_splat, v128};
    // A look shorter than 64 bytes (at the text's end), padded with zeros.
    let mut padded = [0; 64];
    let look = match look.get(..64) {
        Some(look) => look,
        None => {
            padded[..look.len()].copy_from_slice(look);
            &padded[..]
        }
    };
    let spaces = |at: usize| {
        // SAFETY: `look` holds 64 bytes, so 16 from `at` ≤ 48 are readable; `read_unaligned`
        // asks no alignment of them.
        let v = unsafe { look[at..].as_ptr().cast::<v128>().read_unaligned() };
        u64::from(u8x16_bitmask(u8x16_eq(v, u8x16_splat(b' '))))
    };
    spaces(0) | spaces(16) << 16 | spaces(32) << 32 | spaces(48) << 48
}

/// [`space_mask`] a byte at a time.
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
fn space_mask(look: &[u8]) -> u64 {
    look.iter()
        .take(64)
        .enumerate()
        .fold(0, |mask, (i, &b)| mask | u64::from(b == b' ') << i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn segments(text: &str) -> Vec<&str> {
        let (mut out, mut start) = (Vec::new(), 0);
        loop {
            let end = segment_end(text.as_bytes(), start);
            out.push(&text[start..end]);
            if end == text.len() {
                return out;
            }
            start = end;
        }
    }

    /// `words` words of 3 to 7 letters, one space apart.
    fn prose(words: usize) -> String {
        (0..words)
            .map(|i| &"abcdefg"[..3 + i % 5])
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn a_segment_ends_at_the_first_word_past_its_length() {
        let text = prose(3000);
        let parts = segments(&text);
        assert_eq!(parts.concat(), text);
        assert_eq!(parts.len(), text.len() / SEGMENT_BYTES + 1);
        for part in &parts[..parts.len() - 1] {
            assert!(
                (SEGMENT_BYTES..SEGMENT_BYTES + 8).contains(&part.len()),
                "{}",
                part.len()
            );
            assert!(part.ends_with(' '));
        }
    }

    #[test]
    fn a_text_without_words_after_spaces_is_one_segment() {
        assert_eq!(segments(&"漢字".repeat(5_000)).len(), 1);
        assert_eq!(segments(&"( ".repeat(5_000)).len(), 1);
        assert_eq!(segments(""), [""]);
    }

    #[test]
    fn a_segment_without_a_word_near_its_length_ends_further_on() {
        // No word start within the look past 2 KB: the next is tried 2 KB further.
        let text = format!(
            "{}{}{}",
            "w ".repeat(SEGMENT_BYTES / 2 - 1),
            "(".repeat(2 * LOOK_BYTES),
            "x ".repeat(SEGMENT_BYTES)
        );
        let parts = segments(&text);
        assert_eq!(parts[0].len(), 2 * SEGMENT_BYTES, "{:?}", &parts[0][..40]);
    }

    proptest! {
        /// A cut depends only on the text before it: a prefix of the text is cut alike.
        #[test]
        fn a_prefix_is_cut_where_the_whole_text_is(
            text in "[a-c ,\n(]{0,9000}",
            cut in 0usize..9000,
        ) {
            let whole: Vec<usize> = segments(&text).iter().scan(0, |at, s| {
                *at += s.len();
                Some(*at)
            }).collect();
            let prefix = &text[..cut.min(text.len())];
            let ends: Vec<usize> = segments(prefix).iter().scan(0, |at, s| {
                *at += s.len();
                Some(*at)
            }).collect();
            let inside: Vec<usize> = whole.iter().copied().filter(|&e| e < prefix.len()).collect();
            prop_assert_eq!(&ends[..ends.len() - 1], &inside[..]);
            // Each cut is a word start after a space.
            for &e in &ends[..ends.len() - 1] {
                prop_assert!(prefix.as_bytes()[e - 1] == b' ');
                prop_assert!(prefix.as_bytes()[e].is_ascii_alphanumeric());
            }
        }
    }
}
