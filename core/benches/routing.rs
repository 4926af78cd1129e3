//! Scale of the routing core: tokenize+hash throughput, index lookup and commit, pick over many
//! endpoints, and index memory per entry. Run: `cargo bench -p prefixroute-core --bench routing`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use prefixroute_core::hashing::{
    chain_hashes, chain_seed, hash_raw_memo_into, hash_request, ChainMemo, HashConfig,
};
use prefixroute_core::index::{PrefixIndex, PrefixStore};
use prefixroute_core::request::parse_request;
use prefixroute_core::request::read_request;
use prefixroute_core::router::{EndpointLoad, Router, RouterConfig};
use prefixroute_core::tokenizer::tokenize;
use prefixroute_core::BlockHashes;
use prefixroute_sim::trace::TraceSpec;

/// A chat body whose system prompt is about `kib` KiB of text.
fn body_of(kib: usize) -> Vec<u8> {
    let spec = TraceSpec {
        prompt_words: kib * 1024 / 7,
        requests: 1,
        ..TraceSpec::default()
    };
    serde_json::to_vec(&spec.generate().unwrap()[0].body).unwrap()
}

fn tokenize_and_hash(c: &mut Criterion) {
    let mut group = c.benchmark_group("body_to_hashes");
    for kib in [1, 8, 64] {
        let body = body_of(kib);
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(
            BenchmarkId::new("parse+tokenize+hash", format!("{kib}KiB")),
            &body,
            |b, body| {
                b.iter(|| {
                    let request = parse_request(black_box(body)).unwrap();
                    hash_request(&request, HashConfig::default())
                })
            },
        );
        // The plugin's path: the body read in place, every message flattened and tokenized
        // (an empty memo: a prompt never seen, the cold request of issue 12).
        group.bench_with_input(
            BenchmarkId::new("read_request+tokenize+hash, cold", format!("{kib}KiB")),
            &body,
            |b, body| {
                let mut out = BlockHashes::default();
                b.iter(|| {
                    let request = read_request(black_box(body)).unwrap();
                    let mut memo = ChainMemo::new(0);
                    hash_raw_memo_into(&request, HashConfig::default(), &mut memo, &mut out);
                    out.total_blocks()
                })
            },
        );
    }
    group.finish();
}

fn index_ops(c: &mut Criterion) {
    let tokens = tokenize(&String::from_utf8(body_of(8)).unwrap(), Default::default());
    let chain = chain_hashes(&tokens, chain_seed("m", ""), HashConfig::default());
    let mut group = c.benchmark_group("index");
    group.throughput(Throughput::Elements(chain.len() as u64));
    let mut index = PrefixIndex::new(8, 31_250);
    index.record(3, &chain);
    group.bench_function(format!("longest_match_{}_blocks", chain.len()), |b| {
        b.iter(|| index.longest_match(black_box(3), black_box(&chain)))
    });
    group.bench_function(format!("record_{}_blocks", chain.len()), |b| {
        b.iter(|| index.record(black_box(5), black_box(&chain)))
    });
    group.finish();
}

fn pick(c: &mut Criterion) {
    let request = parse_request(&body_of(8)).unwrap();
    let hashes = hash_request(&request, HashConfig::default());
    let mut group = c.benchmark_group("pick");
    for endpoints in [8, 64, 256] {
        let mut router = Router::new(RouterConfig::default(), endpoints);
        let first = router.pick(&hashes, &[]).unwrap();
        router.commit(&first, &hashes);
        let loads: Vec<EndpointLoad> = (0..endpoints)
            .map(|i| EndpointLoad::measured((i % 7) as f64, (i % 10) as f64 / 10.0))
            .collect();
        group.bench_function(BenchmarkId::new("warm_8KiB", endpoints), |b| {
            b.iter(|| router.pick(black_box(&hashes), black_box(&loads)).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, tokenize_and_hash, index_ops, pick);
criterion_main!(benches);
