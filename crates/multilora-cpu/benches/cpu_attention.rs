//! CPU benchmark of the streaming prefill attention ([`causal_attention`]): a chunk of 512 new
//! queries at the end of contexts of 512, 2,048 and 8,192 positions (the last chunk of a prompt of
//! that length), f16 caches (the engine's default for GGUF models) in scattered blocks of 16 rows, at SmolLM2-135M's heads (9 over 3 KV
//! heads of 64) and Llama-3.2-1B's (32 over 8 of 64). Throughput in multiply-adds (`q·kᵀ` and
//! `p·v` over the keys each query sees); after criterion, a summary of GMAC/s per shape.
//!
//! `cargo bench -p multilora-cpu --bench cpu_attention -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::time::Instant;

use criterion::{Criterion, Throughput};
use half::f16;
use multilora_cpu::Isa;
use multilora_cpu::float::{Causal, causal_attention};

/// (name, heads, kv heads, head dim).
const SHAPES: [(&str, usize, usize, usize); 2] = [("smollm2", 9, 3, 64), ("llama1b", 32, 8, 64)];
const CONTEXTS: [usize; 3] = [512, 2048, 8192];
const CHUNK: usize = 512;

struct Case {
    q: Vec<f32>,
    k: Vec<f16>,
    v: Vec<f16>,
    rows: Vec<u32>,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    ctx: usize,
}

impl Case {
    fn new(heads: usize, kv_heads: usize, hd: usize, ctx: usize) -> Case {
        let mut s = 7u64;
        let mut next = move || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let width = kv_heads * hd;
        let blocks = ctx.div_ceil(16);
        // Blocks in a scrambled order, as a paged cache hands them out.
        let rows = (0..ctx).map(|p| (((p / 16) * 37 % blocks) * 16 + p % 16) as u32).collect();
        Case {
            q: (0..CHUNK * heads * hd).map(|_| next() * 0.3).collect(),
            k: (0..blocks * 16 * width).map(|_| f16::from_f32(next())).collect(),
            v: (0..blocks * 16 * width).map(|_| f16::from_f32(next())).collect(),
            rows,
            heads,
            kv_heads,
            hd,
            ctx,
        }
    }

    fn run(&self, out: &mut [f32]) {
        let start = self.ctx - CHUNK;
        let c = Causal {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            rows: &self.rows,
            heads: self.heads,
            kv_heads: self.kv_heads,
            hd: self.hd,
            start,
            lo: 0,
            window: None,
        };
        causal_attention(Isa::best(), c, out).expect("the operands fit");
    }

    /// Multiply-adds: each query's head against the keys it sees, twice (scores and values).
    fn macs(&self) -> u64 {
        let start = self.ctx - CHUNK;
        let keys: usize = (start..self.ctx).map(|p| p + 1).sum();
        (2 * keys * self.heads * self.hd) as u64
    }
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    let cases: Vec<(String, Case)> = SHAPES
        .iter()
        .flat_map(|&(name, h, kv, hd)| CONTEXTS.map(|ctx| (format!("{name}/ctx{ctx}"), Case::new(h, kv, hd, ctx))))
        .collect();
    let mut group = c.benchmark_group("prefill_attention");
    for (name, case) in &cases {
        let mut out = vec![0f32; case.q.len()];
        group.throughput(Throughput::Elements(case.macs()));
        group.bench_function(name.as_str(), |b| b.iter(|| case.run(black_box(&mut out))));
    }
    group.finish();
    c.final_summary();
    println!("\nprefill attention, {CHUNK} queries, {:?}, {} threads:", Isa::best(), rayon::current_num_threads());
    for (name, case) in &cases {
        let mut out = vec![0f32; case.q.len()];
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let t = Instant::now();
            case.run(&mut out);
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!("  {name:16} {:8.2} ms  {:6.1} GMAC/s", best * 1e3, case.macs() as f64 / best / 1e9);
    }
}
