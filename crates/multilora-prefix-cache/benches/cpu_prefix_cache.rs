//! Prefix-cache benches: block hashing throughput and cached-prefix lookups on a 4,000-token prompt.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use multilora_prefix_cache::{DEFAULT_HASH_SEED, ExtraKeys, KvConfig, KvManager, hash_blocks};

const PROMPT_TOKENS: usize = 4000;

fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| i.wrapping_mul(2_654_435_761) % 128_000).collect()
}

fn hashing(c: &mut Criterion) {
    let tokens = prompt(PROMPT_TOKENS);
    let mut group = c.benchmark_group("hash_blocks");
    group.throughput(Throughput::Elements(tokens.len() as u64));
    // Base model, an adapter, and an adapter plus a tenant salt: the per-block cost grows with the
    // extra keys, which are hashed into every block.
    let cases = [
        ("base", ExtraKeys::base()),
        ("adapter", ExtraKeys::adapter([7; 32])),
        ("adapter_salt", ExtraKeys::adapter([7; 32]).with_salt(b"tenant-0001".to_vec())),
    ];
    for (name, extra) in &cases {
        group.bench_with_input(BenchmarkId::new("bs16", name), extra, |b, extra| {
            b.iter(|| hash_blocks(DEFAULT_HASH_SEED, 16, black_box(&tokens), extra))
        });
    }
    group.finish();
}

fn lookups(c: &mut Criterion) {
    let tokens = prompt(PROMPT_TOKENS);
    let extra = ExtraKeys::adapter([7; 32]);
    // A pool where the whole prompt is cached and free (the common "system prompt" case).
    let mut kv = KvManager::new(KvConfig { num_blocks: 512, ..KvConfig::default() });
    kv.admit(1, &tokens, &extra, false, tokens.len()).expect("room for the prompt");
    kv.commit(1, &tokens, tokens.len()).expect("computed");
    kv.free(1);
    let hashes = hash_blocks(DEFAULT_HASH_SEED, 16, &tokens, &extra);

    let mut group = c.benchmark_group("prefix_4000_tokens");
    group.throughput(Throughput::Elements(tokens.len() as u64));
    // Takes and returns the references, so each iteration starts from the same pool.
    group.bench_function("longest_cache_hit", |b| {
        let mut pool = kv.pool().clone();
        b.iter(|| {
            let hit = pool.longest_cache_hit(black_box(&hashes));
            pool.free(&hit).expect("held");
            hit.len()
        })
    });
    // Hashes the prompt and walks the map, as the scheduler does for every waiting request.
    group.bench_function("lookup", |b| b.iter(|| kv.lookup(black_box(&tokens), &extra, false)));
    // A prompt that misses in its second block: lookup hashes lazily and stops there.
    let mut novel = tokens.clone();
    novel[20] = novel[20].wrapping_add(1);
    group.bench_function("lookup_miss_block_2", |b| b.iter(|| kv.lookup(black_box(&novel), &extra, false)));
    group.bench_function("admit_free", |b| {
        b.iter(|| {
            let cached = kv.admit(2, black_box(&tokens), &extra, false, 16).expect("room");
            kv.free(2);
            cached
        })
    });
    group.finish();
}

criterion_group!(benches, hashing, lookups);
criterion_main!(benches);
