//! Prints the heap bytes the prefix index spends per (block, endpoint) entry, measured with a
//! counting allocator. Run: `cargo run --release -p prefixroute-core --example index_memory`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use prefixroute_core::index::{PrefixIndex, PrefixStore};

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

fn main() {
    let endpoints = 8;
    let capacity = 31_250;
    let before = LIVE.load(Ordering::Relaxed);
    let mut index = PrefixIndex::new(endpoints, capacity);
    let empty = LIVE.load(Ordering::Relaxed) - before;
    let mut next: u64 = 1;
    for endpoint in 0..endpoints {
        let chain: Vec<u64> = (0..capacity as u64)
            .map(|i| next.wrapping_add(i.wrapping_mul(0x9e37_79b9_7f4a_7c15)))
            .collect();
        next = next.wrapping_add(capacity as u64);
        index.record(endpoint, &chain);
    }
    let full = LIVE.load(Ordering::Relaxed) - before;
    let entries = endpoints * capacity;
    println!("endpoints {endpoints}, capacity {capacity} blocks each, {entries} entries");
    println!("empty index: {empty} B (tables grow with the entries)");
    println!(
        "full index:  {full} B = {:.1} B per block-endpoint entry",
        full as f64 / entries as f64
    );
}
