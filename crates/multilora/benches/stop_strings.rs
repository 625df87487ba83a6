//! A normal request's latency beside a request with a stop list at the limit
//! (`MAX_STOP_STRINGS` strings of `MAX_STOP_STRING_BYTES` bytes, none of which occurs), against
//! the same request beside a neighbour without stops. Both share every step, so the ratio of
//! the two is what one request's stop list costs the other (the hostile-input issue's target:
//! within 2×). On the PEFT fixture model, the smallest there is, where scanning cost weighs most
//! against a step: 32 greedy tokens for the measured request, 64 for its neighbour.
//!
//! `cargo bench -p multilora --bench stop_strings`

use std::time::{Duration, Instant};

use criterion::Criterion;
use multilora::{Engine, GenerateRequest, MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS, SamplingParams};

fn engine() -> Engine {
    let base = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/peft-tiny/base");
    Engine::builder(base).served_model_name("base").kv_cache_bytes(16 << 20).build().expect("fixture engine")
}

fn greedy(n: usize) -> SamplingParams {
    let mut p = SamplingParams::greedy(n);
    p.ignore_eos = true;
    p
}

/// One measured request, its neighbour running beside it with `stops`.
fn beside(engine: &Engine, stops: &[String]) -> Duration {
    let mut neighbour = greedy(64);
    neighbour.stop = stops.to_vec();
    let vocab = engine.config().vocab_size;
    let neighbour = neighbour.validate(vocab).expect("valid parameters");
    let other = engine.submit(GenerateRequest::new("base", vec![1, 450, 496]).params(neighbour)).expect("submit");
    let mine = greedy(32).validate(vocab).expect("valid parameters");
    let start = Instant::now();
    let done = engine.submit(GenerateRequest::new("base", vec![1, 306, 263]).params(mine)).expect("submit");
    let c = done.collect_blocking().expect("collect");
    let took = start.elapsed();
    assert_eq!(c.token_ids.len(), 32);
    other.collect_blocking().expect("neighbour");
    took
}

fn main() {
    let engine = engine();
    // Distinct strings of non-ASCII and ASCII bytes that the fixture model does not produce.
    let limit: Vec<String> = (0..MAX_STOP_STRINGS)
        .map(|i| {
            let head = format!("§{i:03}§");
            let pad = "q".repeat(MAX_STOP_STRING_BYTES - head.len());
            format!("{head}{pad}")
        })
        .collect();
    assert!(limit.iter().all(|s| s.len() == MAX_STOP_STRING_BYTES));
    let mut c = Criterion::default().configure_from_args().sample_size(20);
    let mut g = c.benchmark_group("stop_strings");
    g.bench_function("beside_no_stops", |b| b.iter_custom(|iters| (0..iters).map(|_| beside(&engine, &[])).sum()));
    g.bench_function("beside_stop_list_at_limit", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| beside(&engine, &limit)).sum())
    });
    g.finish();
    c.final_summary();
}
