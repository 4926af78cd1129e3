//! Stable sorts by a number, all through one instantiation of the standard library's sort.
//!
//! Every `sort_by`/`sort_by_key` with its own element type or closure is its own copy of the
//! standard library's driftsort (5 to 9 KB of wasm each): the plugin carried seven sorts, 42 KB
//! of its .wasm. Here the stable sorts sort `(key, index)` pairs with `sort_unstable`, one copy
//! shared with the plugin's endpoint table, and the index breaks ties, so the result is exactly
//! the stable sort by `key` (a property test below). Measured with the host-tests table: the
//! .wasm 480,836 -> 450,427 bytes, request costs within 1%. (The index's recorded positions
//! are not sorted at all: through pairs it cost +2% on a warm 16k prompt, and their own sort of
//! `usize` was another 3 KB; they are collected in a bitset, see `index::record_positions`.)

/// Sorts `items` by `key`, stably: equal keys keep their order.
pub fn sort_by_u64_key<T: Copy>(items: &mut [T], key: impl Fn(&T) -> u64) {
    // Already in order (common for one request's buckets and pending writes): no allocation.
    if items.windows(2).all(|w| key(&w[0]) <= key(&w[1])) {
        return;
    }
    let mut keyed: Vec<(u64, usize)> = items.iter().map(&key).zip(0..).collect();
    keyed.sort_unstable();
    let sorted: Vec<T> = keyed.iter().map(|&(_, i)| items[i]).collect();
    items.copy_from_slice(&sorted);
}

/// A key that orders floats as [`f64::total_cmp`] does (so NaNs cannot break a sort).
pub fn f64_key(x: f64) -> u64 {
    let bits = x.to_bits();
    if bits >> 63 == 1 {
        !bits
    } else {
        bits | 1 << 63
    }
}

/// A key that orders floats from largest to smallest.
pub fn f64_key_descending(x: f64) -> u64 {
    !f64_key(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn sorting_by_a_key_is_the_standard_stable_sort(
            items in proptest::collection::vec((0u64..8, any::<u16>()), 0..40)
        ) {
            let mut ours = items.clone();
            sort_by_u64_key(&mut ours, |&(k, _)| k);
            let mut reference = items;
            reference.sort_by_key(|&(k, _)| k);
            prop_assert_eq!(ours, reference);
        }

        #[test]
        fn float_keys_order_as_total_cmp(a in any::<f64>(), b in any::<f64>()) {
            prop_assert_eq!(f64_key(a).cmp(&f64_key(b)), a.total_cmp(&b));
            prop_assert_eq!(f64_key_descending(a).cmp(&f64_key_descending(b)), b.total_cmp(&a));
        }
    }

    #[test]
    fn special_floats_have_their_total_order() {
        let ordered = [
            f64::NEG_INFINITY,
            -1.0,
            -0.0,
            0.0,
            1e-300,
            1.0,
            f64::INFINITY,
            f64::NAN,
        ];
        for pair in ordered.windows(2) {
            assert!(f64_key(pair[0]) < f64_key(pair[1]), "{pair:?}");
        }
    }
}
