//! XXH64 at the two input lengths the chain hashes once per block: a 16-token block (64
//! bytes) and the pair (own hash, parent) (16 bytes).
//!
//! Same algorithm and output as `xxhash_rust::xxh64::xxh64` (property-tested against it below),
//! written for one fixed length each: the crate's one-shot function dispatches on the length,
//! slices its input and is not inlined, which costs 271 + 126 wasm instructions per block where
//! these take 171 + 64 (measured in the plugin's build profile). At one block per 16 tokens
//! that is a tenth of what a cold prompt costs the plugin per token. Other block sizes keep the
//! crate's function.

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;
const P4: u64 = 0x85EB_CA77_C2B2_AE63;
const P5: u64 = 0x27D4_EB2F_1656_67C5;

#[inline(always)]
fn round(acc: u64, input: u64) -> u64 {
    acc.wrapping_add(input.wrapping_mul(P2))
        .rotate_left(31)
        .wrapping_mul(P1)
}

#[inline(always)]
fn merge_round(acc: u64, lane: u64) -> u64 {
    (acc ^ round(0, lane)).wrapping_mul(P1).wrapping_add(P4)
}

/// The tail step for one 8-byte word.
#[inline(always)]
fn tail_word(acc: u64, word: u64) -> u64 {
    (acc ^ round(0, word))
        .rotate_left(27)
        .wrapping_mul(P1)
        .wrapping_add(P4)
}

#[inline(always)]
fn avalanche(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(P2);
    h ^= h >> 29;
    h = h.wrapping_mul(P3);
    h ^ (h >> 32)
}

/// `xxh64(bytes, 0)` of the 64 bytes whose little-endian 8-byte words are `w`. Written out
/// round by round: the core crate is built for size in the plugin, and a loop over the lanes
/// is then kept as a loop through memory (1.5x the instructions).
#[inline]
pub(super) fn xxh64_64(w: &[u64; 8]) -> u64 {
    let (mut v1, mut v2, mut v3, mut v4) = (P1.wrapping_add(P2), P2, 0, 0u64.wrapping_sub(P1));
    v1 = round(v1, w[0]);
    v2 = round(v2, w[1]);
    v3 = round(v3, w[2]);
    v4 = round(v4, w[3]);
    v1 = round(v1, w[4]);
    v2 = round(v2, w[5]);
    v3 = round(v3, w[6]);
    v4 = round(v4, w[7]);
    let mut h = v1
        .rotate_left(1)
        .wrapping_add(v2.rotate_left(7))
        .wrapping_add(v3.rotate_left(12))
        .wrapping_add(v4.rotate_left(18));
    h = merge_round(h, v1);
    h = merge_round(h, v2);
    h = merge_round(h, v3);
    h = merge_round(h, v4);
    avalanche(h.wrapping_add(64))
}

/// `xxh64(a.to_le_bytes() ++ b.to_le_bytes(), 0)`.
#[inline]
pub(super) fn xxh64_pair(a: u64, b: u64) -> u64 {
    avalanche(tail_word(tail_word(P5.wrapping_add(16), a), b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use xxhash_rust::xxh64::xxh64;

    proptest! {
        #[test]
        fn a_64_byte_block_hashes_as_the_crate_does(words in proptest::array::uniform8(any::<u64>())) {
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            prop_assert_eq!(xxh64_64(&words), xxh64(&bytes, 0));
        }

        #[test]
        fn a_pair_hashes_as_the_crate_does(a in any::<u64>(), b in any::<u64>()) {
            let mut bytes = a.to_le_bytes().to_vec();
            bytes.extend_from_slice(&b.to_le_bytes());
            prop_assert_eq!(xxh64_pair(a, b), xxh64(&bytes, 0));
        }
    }

    #[test]
    fn the_all_zero_inputs_match_too() {
        assert_eq!(xxh64_64(&[0; 8]), xxh64(&[0; 64], 0));
        assert_eq!(xxh64_pair(0, 0), xxh64(&[0; 16], 0));
    }
}
