//! Prints the heap bytes the prefix index spends per (block, endpoint) entry, measured with a
//! counting allocator, and how many positions a cold chain records (one shared-data write each
//! in the plugin). Run: `cargo run --release -p prefixroute-core --example index_memory`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use prefixroute_core::index::{
    record_positions, PrefixIndex, PrefixStore, DENSE_BLOCKS, STRIDE_BLOCKS,
};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Fills an 8-endpoint index of llm-d's default capacity with chains of `chain_blocks` blocks
/// and prints its heap bytes per believed (block, endpoint) pair and per recorded entry.
fn fill(chain_blocks: usize) {
    let endpoints = 8;
    let capacity = 31_250;
    let before = LIVE.load(Ordering::Relaxed);
    let mut index = PrefixIndex::new(endpoints, capacity);
    let empty = LIVE.load(Ordering::Relaxed) - before;
    let mut next: u64 = 1;
    for endpoint in 0..endpoints {
        for _ in 0..capacity / chain_blocks {
            let chain: Vec<u64> = (0..chain_blocks as u64)
                .map(|i| next.wrapping_add(i).wrapping_mul(0x9e37_79b9_7f4a_7c15))
                .collect();
            next = next.wrapping_add(chain_blocks as u64);
            index.record(endpoint, &chain);
        }
    }
    let full = LIVE.load(Ordering::Relaxed) - before;
    let believed: usize = (0..endpoints).map(|e| index.len(e)).sum();
    let entries: usize = (0..endpoints).map(|e| index.blocks(e).count()).sum();
    println!(
        "chains of {chain_blocks} blocks: {endpoints} endpoints x {capacity} blocks, \
         {believed} believed, {entries} recorded; empty {empty} B, full {full} B = \
         {:.1} B per believed block-endpoint pair, {:.1} B per recorded entry",
        full as f64 / believed as f64,
        full as f64 / entries as f64
    );
}

/// Positions a cold chain of `tokens` records, against a fixed stride of [`STRIDE_BLOCKS`]
/// beyond the first [`DENSE_BLOCKS`] (what the index recorded before its gaps grew with depth).
fn recorded(tokens: usize) {
    let n = tokens / 16;
    let now = record_positions(n, &[], 0).len();
    let fixed_stride = DENSE_BLOCKS.min(n)
        + n.saturating_sub(DENSE_BLOCKS) / STRIDE_BLOCKS
        + usize::from(n > DENSE_BLOCKS && !(n - DENSE_BLOCKS).is_multiple_of(STRIDE_BLOCKS));
    println!(
        "a cold chain of {tokens} tokens ({n} blocks) records {now} positions \
         ({fixed_stride} with a fixed stride of {STRIDE_BLOCKS})"
    );
}

fn main() {
    for tokens in [1_024, 4_096, 16_384, 32_768, 131_072, 1_048_576] {
        recorded(tokens);
    }
    // Short chains record most of their blocks (the worst case per believed block); long ones
    // their checkpoints (one in 16 beyond their first 4 blocks, sparser beyond block 259).
    fill(16);
    fill(1_000);
}
