//! The same pieces, counted 64 bytes at a time, for blocks known by their text
//! ([`crate::hashing::BlockIdentity::Text`]).
//!
//! Why a second scanner: the byte scanner ([`super::for_each_token_stopped`]) ends each run
//! with a branch, and which byte ends a word is data the CPU cannot predict. Natively and in
//! V8, a cold 64 KB prompt spent most of its tokenizer time in those mispredicted branches and
//! in FNV-1a's multiply chain, not in the instructions the wasm fuel counts (docs/benchmarks.md).
//! A block known by its text needs neither: only where every `block_size`-th piece starts.
//! Here each 64-byte chunk is classified into three bit masks without a branch, the first byte
//! of every piece is computed from the masks (a word's run of `_` and continuation bytes is
//! filled by one addition, with a carry into the next chunk), and the pieces are counted with
//! one population count per chunk; only the piece that opens a block is looked for.
//!
//! The pieces start where the byte scanner's start (a property test holds the two together),
//! so token counts, blocks and marks are the same as with token ids.

use super::{NonAscii, Stopped, CLASS, LEAD, LETTER_LEAD, PUNCT, WORD};

// Class bits of a byte, one mask each per chunk.

/// Starts a word, or continues one: an ASCII letter or digit (with [`NonAscii::Pieces`], also
/// the first byte of a letter of an alphabet that spaces its words).
const W: u8 = 1;
/// Continues a word begun before it: `_` (with [`NonAscii::Pieces`], a continuation byte).
const M: u8 = 2;
/// A piece of its own where no word continues: the punctuation, `_` among it, and (pieces
/// only) the first byte of any other character outside ASCII. Such a byte is never inside a
/// word, so one mask serves both: a fourth would cost every chunk four more `bitmask`es.
const P: u8 = 4;

const fn bits_table(skip: bool) -> [u8; 256] {
    let mut table = [0u8; 256];
    let mut b = 0;
    while b < 256 {
        table[b] = match CLASS[b] {
            WORD => W,
            PUNCT if b == b'_' as usize => P | M,
            PUNCT => P,
            LETTER_LEAD if !skip => W,
            LEAD if !skip => P,
            // A continuation byte continues a word only after a letter's first byte.
            _ if !skip && b & 0xc0 == 0x80 => M,
            _ => 0,
        };
        b += 1;
    }
    table
}

const BITS_PIECES: [u8; 256] = bits_table(false);
const BITS_SKIP: [u8; 256] = bits_table(true);

/// The three class masks of a 64-byte chunk, bit `i` for byte `i`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Masks {
    w: u64,
    m: u64,
    p: u64,
}

/// The masks eight bytes at a time from the class tables: the reference the SIMD versions are
/// held to (natively by a property test, in wasm by the host tests' plugin == core
/// comparisons), and the masks where there is no SIMD.
#[cfg_attr(
    any(
        all(target_arch = "wasm32", target_feature = "simd128"),
        all(target_arch = "x86_64", target_feature = "sse2", not(test))
    ),
    allow(dead_code)
)]
#[inline(always)]
fn masks_by_table<const SKIP: bool>(chunk: &[u8; 64]) -> Masks {
    let table = if SKIP { &BITS_SKIP } else { &BITS_PIECES };
    let mut out = Masks::default();
    for (k, eight) in chunk.chunks_exact(8).enumerate() {
        // Eight class bytes in a word; each class's bits gathered into a byte by one
        // multiply (bit `8j` of the masked word lands on bit `56 + j`).
        let classes = u64::from_le_bytes(std::array::from_fn(|j| table[usize::from(eight[j])]));
        let gather = |bit: u32| {
            ((classes >> bit) & 0x0101_0101_0101_0101).wrapping_mul(0x0102_0408_1020_4080) >> 56
        };
        out.w |= gather(0) << (8 * k);
        out.m |= gather(1) << (8 * k);
        out.p |= gather(2) << (8 * k);
    }
    out
}

/// The masks sixteen bytes at a time: range comparisons in wasm SIMD, one `bitmask` per class
/// and vector.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn masks<const SKIP: bool>(chunk: &[u8; 64]) -> Masks {
    use core::arch::wasm32::*;
    let splat = u8x16_splat;
    // Bytes in `lo..lo + len` (wrapping subtraction, one unsigned comparison).
    let within = |v: v128, lo: u8, len: u8| u8x16_lt(u8x16_sub(v, splat(lo)), splat(len));
    let mut out = Masks::default();
    for k in 0..4 {
        // SAFETY: 16 bytes at 16 * k, inside the 64-byte chunk.
        let v = unsafe { v128_load(chunk.as_ptr().add(16 * k) as *const v128) };
        let alnum = v128_or(
            within(v128_or(v, splat(0x20)), b'a', 26),
            within(v, b'0', 10),
        );
        let underscore = u8x16_eq(v, splat(b'_'));
        // Printable ASCII that is neither a letter, a digit, '`' nor '|': the punctuation.
        let others = v128_or(
            alnum,
            v128_or(u8x16_eq(v, splat(b'`')), u8x16_eq(v, splat(b'|'))),
        );
        let punctuation = v128_andnot(within(v, 0x21, 0x5e), others);
        let (w, m, p) = if SKIP {
            (alnum, underscore, punctuation)
        } else {
            let letter_lead = within(v, 0xc3, 0xdf - 0xc3 + 1);
            let continuation = within(v, 0x80, 0x40);
            let lead = v128_andnot(u8x16_ge(v, splat(0xc0)), letter_lead);
            (
                v128_or(alnum, letter_lead),
                v128_or(underscore, continuation),
                v128_or(punctuation, lead),
            )
        };
        let shift = 16 * k;
        out.w |= u64::from(u8x16_bitmask(w)) << shift;
        out.m |= u64::from(u8x16_bitmask(m)) << shift;
        out.p |= u64::from(u8x16_bitmask(p)) << shift;
    }
    out
}

/// The wasm version's comparisons in SSE2 (every x86-64 has it), for the CLI and the
/// simulator. SSE2 has no unsigned byte comparison: `x < len` is `min(x, len - 1) == x`.
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
#[inline(always)]
fn masks<const SKIP: bool>(chunk: &[u8; 64]) -> Masks {
    use std::arch::x86_64::*;
    // SAFETY (every intrinsic): SSE2 is enabled (the cfg above), and each load reads 16 bytes
    // at 16 * k, inside the 64-byte chunk.
    unsafe {
        let splat = |b: u8| _mm_set1_epi8(b as i8);
        let within = |v: __m128i, lo: u8, len: u8| {
            let x = _mm_sub_epi8(v, splat(lo));
            _mm_cmpeq_epi8(_mm_min_epu8(x, splat(len - 1)), x)
        };
        let mut out = Masks::default();
        for k in 0..4 {
            let v = _mm_loadu_si128(chunk.as_ptr().add(16 * k) as *const __m128i);
            let alnum = _mm_or_si128(
                within(_mm_or_si128(v, splat(0x20)), b'a', 26),
                within(v, b'0', 10),
            );
            let underscore = _mm_cmpeq_epi8(v, splat(b'_'));
            let others = _mm_or_si128(
                alnum,
                _mm_or_si128(
                    _mm_cmpeq_epi8(v, splat(b'`')),
                    _mm_cmpeq_epi8(v, splat(b'|')),
                ),
            );
            // `_mm_andnot_si128(a, b)` is `!a & b`.
            let punctuation = _mm_andnot_si128(others, within(v, 0x21, 0x5e));
            let (w, m, p) = if SKIP {
                (alnum, underscore, punctuation)
            } else {
                let letter_lead = within(v, 0xc3, 0xdf - 0xc3 + 1);
                let continuation = within(v, 0x80, 0x40);
                let lead = _mm_andnot_si128(letter_lead, within(v, 0xc0, 0x40));
                (
                    _mm_or_si128(alnum, letter_lead),
                    _mm_or_si128(underscore, continuation),
                    _mm_or_si128(punctuation, lead),
                )
            };
            let bits = |x: __m128i| u64::from(_mm_movemask_epi8(x) as u16) << (16 * k);
            out.w |= bits(w);
            out.m |= bits(m);
            out.p |= bits(p);
        }
        out
    }
}

#[cfg(not(any(
    all(target_arch = "wasm32", target_feature = "simd128"),
    all(target_arch = "x86_64", target_feature = "sse2")
)))]
#[inline(always)]
fn masks<const SKIP: bool>(chunk: &[u8; 64]) -> Masks {
    masks_by_table::<SKIP>(chunk)
}

/// The first bytes of the chunk's pieces. `in_word` says whether the byte before the chunk
/// is inside a word, and is left saying it of the chunk's last byte.
///
/// A byte is inside a word if it starts or continues one (`w`), or if it is a `_` or a
/// continuation byte (`m`) in a run of them right after such a byte. That run is filled by
/// one addition: adding its first bit to `m` carries through the run and flips exactly its
/// bits (the byte after a run is not in `m`, so the carry stops there).
#[inline(always)]
fn piece_starts(masks: Masks, in_word: &mut u64) -> u64 {
    let Masks { w, m, p } = masks;
    let first = ((w << 1) | *in_word) & m;
    let inside = w | (m.wrapping_add(first) ^ m) & m;
    let before = (inside << 1) | *in_word;
    *in_word = inside >> 63;
    (w & !before) | (p & !inside)
}

/// Counts the pieces of a stopped text into `filled`, the pieces of a chain's open block
/// (at most `block_size`), and calls `complete(at)` wherever a block is full and the next
/// piece starts, at byte `at`: the block's bytes end there. A chunk without such a start
/// costs one population count, its pieces are not visited one by one.
#[inline(always)]
pub(crate) fn cut_blocks(
    text: Stopped<'_>,
    non_ascii: NonAscii,
    block_size: usize,
    filled: &mut usize,
    complete: impl FnMut(usize),
) {
    // One loop per rule, each with its masks computed without a test of the rule.
    match non_ascii {
        NonAscii::Pieces => cut_with::<false>(text.text(), block_size, filled, complete),
        NonAscii::Skip => cut_with::<true>(text.text(), block_size, filled, complete),
    }
}

// Inlined into its caller with `complete`, so that a chain's state stays in locals.
#[inline(always)]
fn cut_with<const SKIP: bool>(
    bytes: &[u8],
    block_size: usize,
    filled: &mut usize,
    mut complete: impl FnMut(usize),
) {
    let block_size = block_size.max(1);
    let mut in_word = 0u64;
    // The text's last bytes, short of a chunk, and zeros after them (zeros start no piece).
    let mut tail = [0u8; 64];
    let mut offset = 0;
    while offset < bytes.len() {
        let chunk: &[u8; 64] = match bytes[offset..].first_chunk() {
            Some(chunk) => chunk,
            None => {
                tail[..bytes.len() - offset].copy_from_slice(&bytes[offset..]);
                &tail
            }
        };
        let mut starts = piece_starts(masks::<SKIP>(chunk), &mut in_word);
        loop {
            let count = starts.count_ones() as usize;
            if *filled + count <= block_size {
                *filled += count;
                break;
            }
            // The piece that opens the next block: past the open block's missing pieces.
            for _ in *filled..block_size {
                starts &= starts - 1;
            }
            complete(offset + starts.trailing_zeros() as usize);
            starts &= starts - 1;
            *filled = 1;
        }
        offset += 64;
    }
}

/// Calls `emit` with the offset of each piece's first byte (the tests' view of the masks).
#[cfg(test)]
fn for_each_start(text: &[u8], non_ascii: NonAscii, mut emit: impl FnMut(usize)) {
    let mut in_word = 0u64;
    for (k, chunk) in text.chunks(64).enumerate() {
        let mut padded = [0u8; 64];
        padded[..chunk.len()].copy_from_slice(chunk);
        let masks = match non_ascii {
            NonAscii::Pieces => masks_by_table::<false>(&padded),
            NonAscii::Skip => masks_by_table::<true>(&padded),
        };
        let mut starts = piece_starts(masks, &mut in_word);
        while starts != 0 {
            emit(64 * k + starts.trailing_zeros() as usize);
            starts &= starts - 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn starts_by_masks(text: &str, rule: NonAscii) -> Vec<usize> {
        let mut out = Vec::new();
        for_each_start(text.as_bytes(), rule, |at| out.push(at));
        out
    }

    fn starts_by_bytes(text: &str, rule: NonAscii) -> Vec<usize> {
        let mut out = Vec::new();
        super::super::for_each_token_at(text, rule, |at, _| out.push(at));
        out
    }

    /// Where `cut_blocks` cuts `text` into blocks of `block_size` from a chain with `filled`
    /// pieces open, and how many it leaves open.
    fn cuts(
        text: &str,
        rule: NonAscii,
        block_size: usize,
        mut filled: usize,
    ) -> (Vec<usize>, usize) {
        let mut out = Vec::new();
        Stopped::copied(text.as_bytes(), |t| {
            cut_blocks(t, rule, block_size, &mut filled, |at| out.push(at))
        });
        (out, filled)
    }

    #[test]
    fn the_class_bits_are_the_byte_classes() {
        // What the SIMD comparisons compute: the punctuation is the printable ASCII that is
        // not a letter, a digit, '`' or '|'; the rest as the byte scanner's tables say.
        for b in 0..=255u8 {
            let bits = BITS_PIECES[b as usize];
            let punct =
                (0x21..=0x7e).contains(&b) && !b.is_ascii_alphanumeric() && b != b'`' && b != b'|';
            let other_lead = b >= 0xc0 && !(0xc3..=0xdf).contains(&b);
            assert_eq!(bits & P != 0, punct || other_lead, "{b:#04x}");
            // A piece of its own that could be inside a word would need a mask of its own.
            assert!(!(other_lead && bits & (W | M) != 0), "{b:#04x}");
            assert_eq!(
                bits & W != 0,
                b.is_ascii_alphanumeric() || (0xc3..=0xdf).contains(&b),
                "{b:#04x}"
            );
            assert_eq!(
                bits & M != 0,
                b == b'_' || (0x80..0xc0).contains(&b),
                "{b:#04x}"
            );
            let skip = BITS_SKIP[b as usize];
            assert_eq!(skip, if b.is_ascii() { bits } else { 0 }, "{b:#04x}");
        }
    }

    #[test]
    fn a_block_ends_where_the_piece_after_its_last_starts() {
        // Pieces "a ", "b, " (", " is one), "c": starts 0, 2, 3, 5.
        assert_eq!(starts_by_masks("a b, c", NonAscii::Pieces), [0, 2, 3, 5]);
        assert_eq!(cuts("a b, c", NonAscii::Pieces, 2, 0), (vec![3], 2));
        assert_eq!(cuts("a b, c", NonAscii::Pieces, 1, 0), (vec![2, 3, 5], 1));
        // A chain with a full block open cuts it at the text's first piece.
        assert_eq!(cuts("  a b", NonAscii::Pieces, 2, 2), (vec![2], 2));
        assert_eq!(cuts("", NonAscii::Pieces, 2, 1), (vec![], 1));
        assert_eq!(cuts(" `|\n", NonAscii::Pieces, 2, 0), (vec![], 0));
    }

    proptest::proptest! {
        #[test]
        fn the_masks_start_the_pieces_where_the_byte_scanner_does(
            text in super::super::texts_of_every_class(200),
            skip in proptest::bool::ANY,
        ) {
            let rule = if skip { NonAscii::Skip } else { NonAscii::Pieces };
            proptest::prop_assert_eq!(starts_by_masks(&text, rule), starts_by_bytes(&text, rule));
        }

        #[test]
        fn the_simd_masks_are_the_tables_masks(
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 64),
        ) {
            // Natively on x86-64 `masks` is the SSE2 version, the wasm one's comparisons.
            let chunk: &[u8; 64] = bytes[..].try_into().unwrap();
            proptest::prop_assert_eq!(masks::<false>(chunk), masks_by_table::<false>(chunk));
            proptest::prop_assert_eq!(masks::<true>(chunk), masks_by_table::<true>(chunk));
        }

        #[test]
        fn words_of_underscores_and_letters_carry_across_chunks(
            pad in 0usize..70,
            word in "[a-zé_]{1,80}",
            skip in proptest::bool::ANY,
        ) {
            // A word that crosses a chunk's end, after anything from nothing to a chunk.
            let rule = if skip { NonAscii::Skip } else { NonAscii::Pieces };
            let text = format!("{}{word} _x", ". ".repeat(pad));
            proptest::prop_assert_eq!(starts_by_masks(&text, rule), starts_by_bytes(&text, rule));
        }

        #[test]
        fn blocks_are_cut_at_every_block_size_th_piece(
            text in "[a-z_ ,.é日\n]{0,300}",
            block_size in 1usize..20,
            filled in 0usize..20,
        ) {
            let filled = filled.min(block_size);
            let starts = starts_by_bytes(&text, NonAscii::Pieces);
            // The open block needs `block_size - filled` more pieces; the one after opens the next.
            let expected: Vec<usize> = starts
                .iter()
                .enumerate()
                .filter(|&(i, _)| (i + filled) >= block_size && (i + filled) % block_size == 0)
                .map(|(_, &at)| at)
                .collect();
            let left = if starts.is_empty() { filled } else { (filled + starts.len() - 1) % block_size + 1 };
            proptest::prop_assert_eq!(cuts(&text, NonAscii::Pieces, block_size, filled), (expected, left));
        }
    }
}
