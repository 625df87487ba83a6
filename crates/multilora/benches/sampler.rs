//! The sampler on one row, one core: each setting the sampling issue's table names (greedy,
//! OpenAI's default of temperature 1 with no filters, temperature 0.8, top-p, top-k, all four
//! filters, greedy with 5 logprobs) at SmolLM2's, Qwen2.5's and Gemma 3's vocabulary sizes
//! (49,152, 151,936, 262,144), on two rows of seeded logits: `peaked`, a language model's (a
//! Gaussian tail, σ 2, under 32 tokens lifted 14 … 1.6 above it, which hold most of the mass),
//! and `flat`, a random-weight model's (σ 2.5, the head only 8 … 1.8 above: most of the mass in
//! the tail, so top-p's nucleus holds thousands of tokens — the sampler's worst case).
//!
//! `cargo bench -p multilora --bench sampler`

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput};
use multilora::{Sampler, SamplingParams};

/// `vocab` seeded logits: Gaussian with deviation `sigma`, the 32 tokens `i · 7919 mod vocab`
/// lifted by `lift − 0.4 i` (peaked) or `lift − 0.2 i` (flat).
fn row(vocab: usize, sigma: f64, lift: f32, step: f32) -> Vec<f32> {
    // SplitMix64, as the workspace's generator (not a dependency of the benches).
    let mut state = 0x5eed_u64;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut x: Vec<f32> = (0..vocab)
        .map(|_| {
            let (u, v) = (next().max(1e-300), next());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos() * sigma) as f32
        })
        .collect();
    for i in 0..32 {
        x[(i * 7919) % vocab] += lift - i as f32 * step;
    }
    x
}

/// `SamplingParams` with the given temperature, top-k, top-p, min-p and logprobs.
fn params(temperature: f32, top_k: i32, top_p: f32, min_p: f32, logprobs: Option<usize>) -> SamplingParams {
    let mut p = SamplingParams::default();
    (p.temperature, p.top_k, p.top_p, p.min_p, p.logprobs) = (temperature, top_k, top_p, min_p, logprobs);
    p
}

fn settings() -> Vec<(&'static str, SamplingParams)> {
    vec![
        ("greedy", params(0.0, 0, 1.0, 0.0, None)),
        ("t1_no_filters", params(1.0, 0, 1.0, 0.0, None)),
        ("t0.8", params(0.8, 0, 1.0, 0.0, None)),
        ("t0.7_top_p0.9", params(0.7, 0, 0.9, 0.0, None)),
        ("t0.8_top_k40", params(0.8, 40, 1.0, 0.0, None)),
        ("t0.8_k40_p0.95_min_p0.05", params(0.8, 40, 0.95, 0.05, None)),
        ("greedy_logprobs5", params(0.0, 0, 1.0, 0.0, Some(5))),
    ]
}

fn main() {
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    for vocab in [49_152, 151_936, 262_144] {
        for (shape, mut x) in [("peaked", row(vocab, 2.0, 14.0, 0.4)), ("flat", row(vocab, 2.5, 8.0, 0.2))] {
            let mut g = c.benchmark_group(format!("sampler/{vocab}/{shape}"));
            g.throughput(Throughput::Elements(vocab as u64));
            for (name, params) in settings() {
                let mut s = Sampler::new(&params, 1, &[], &[]).expect("valid settings");
                g.bench_function(BenchmarkId::from_parameter(name), |b| b.iter(|| s.sample(&mut x).0));
            }
            g.finish();
        }
    }
    c.final_summary();
}
