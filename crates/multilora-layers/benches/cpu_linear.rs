//! CPU benchmark of the base linear kernels (`y = x · Wᵀ`, `x` f32): the weight packed at load
//! time ([`PackedWeight`], what the layers use) in f32 and in bf16, and read in place
//! ([`linear`], f32), against candle's matmul in f32 and in bf16, at the decode (16 rows) and
//! prefill (1,024 rows) batch sizes of the engine bench, on the projection shapes of its model
//! (hidden 1024, intermediate 2816, vocab 32000): `in × out` = 1024×1024, 1024×2816, 2816×1024,
//! 1024×32000.
//!
//! After criterion, a summary measured in the same run gives GFLOPS and the GB/s of reading `W`
//! (the bound of a decode step) for each, and the speed-ups of the packed kernels, from the
//! medians of alternating rounds (one call of each per round).
//!
//! `cargo bench -p multilora-layers --bench cpu_linear -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use criterion::{Criterion, Throughput};
use multilora_cpu::Isa;
use multilora_layers::{PackedWeight, linear, linear_with};

const SHAPES: [(usize, usize); 4] = [(1024, 1024), (1024, 2816), (2816, 1024), (1024, 32000)];
const ROWS: [usize; 2] = [16, 1024];

fn tensor(shape: (usize, usize), seed: u64) -> anyhow::Result<Tensor> {
    let mut s = seed;
    let v: Vec<f32> = (0..shape.0 * shape.1)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
        })
        .collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

fn candle(x: &Tensor, w: &Tensor) -> Tensor {
    x.matmul(&w.t().expect("t")).expect("matmul")
}

fn streaming(x: &Tensor, w: &Tensor) -> Tensor {
    linear(x, w).expect("linear")
}

fn packed(x: &Tensor, w: &PackedWeight) -> Tensor {
    w.forward(x).expect("packed linear")
}

/// Median seconds over alternating rounds of each of `fs` (one call of each per round), and the
/// median per-round ratio of each to the third (packed f32).
fn rounds(fs: &[&dyn Fn() -> Tensor], n: usize) -> (Vec<f64>, Vec<f64>) {
    let time = |f: &dyn Fn() -> Tensor| {
        let t = Instant::now();
        black_box(f());
        t.elapsed().as_secs_f64()
    };
    let mut times = vec![Vec::new(); fs.len()];
    let mut ratios = vec![Vec::new(); fs.len()];
    for _ in 0..n {
        let t: Vec<f64> = fs.iter().map(|f| time(*f)).collect();
        for (i, &ti) in t.iter().enumerate() {
            times[i].push(ti);
            ratios[i].push(ti / t[2]);
        }
    }
    let median = |mut s: Vec<f64>| {
        s.sort_by(f64::total_cmp);
        s[s.len() / 2]
    };
    (times.into_iter().map(median).collect(), ratios.into_iter().map(median).collect())
}

fn main() -> anyhow::Result<()> {
    let mut criterion = Criterion::default().configure_from_args().sample_size(10);
    let mut summary = Vec::new();
    for (k, n) in SHAPES {
        let w = tensor((n, k), 1)?;
        let wb = w.to_dtype(DType::BF16)?;
        let pw = PackedWeight::pack(&w)?.ok_or_else(|| anyhow::anyhow!("f32 cpu weights pack"))?;
        let pb = PackedWeight::pack(&wb)?.ok_or_else(|| anyhow::anyhow!("bf16 cpu weights pack"))?;
        for m in ROWS {
            let x = tensor((m, k), 2)?;
            let xb = x.to_dtype(DType::BF16)?;
            let flops = 2 * m * n * k;
            let mut g = criterion.benchmark_group(format!("cpu_linear/{m}x{k}x{n}"));
            g.throughput(Throughput::Elements(flops as u64));
            g.bench_function("candle", |b| b.iter(|| candle(black_box(&x), &w)));
            g.bench_function("candle bf16", |b| b.iter(|| candle(black_box(&xb), &wb)));
            g.bench_function("streaming", |b| b.iter(|| streaming(black_box(&x), &w)));
            g.bench_function("packed", |b| b.iter(|| packed(black_box(&x), &pw)));
            g.bench_function("packed bf16", |b| b.iter(|| packed(black_box(&x), &pb)));
            if m == 16 {
                // The other instruction sets at the decode size, for the record.
                for isa in Isa::available_of(&Isa::FLOAT).into_iter().filter(|&i| i != Isa::best()) {
                    g.bench_function(format!("streaming {isa:?}"), |b| {
                        b.iter(|| linear_with(black_box(&x), &w, isa).expect("linear"))
                    });
                    g.bench_function(format!("packed {isa:?}"), |b| {
                        b.iter(|| pw.forward_with(black_box(&x), isa).expect("packed linear"))
                    });
                    g.bench_function(format!("packed bf16 {isa:?}"), |b| {
                        b.iter(|| pb.forward_with(black_box(&x), isa).expect("packed linear"))
                    });
                }
            }
            g.finish();
            let fs: [&dyn Fn() -> Tensor; 5] =
                [&|| candle(&x, &w), &|| streaming(&x, &w), &|| packed(&x, &pw), &|| packed(&x, &pb), &|| {
                    candle(&xb, &wb)
                }];
            let r = rounds(&fs, if m == 16 { 41 } else { 9 });
            summary.push((m, k, n, flops as f64, (n * k) as f64, r));
        }
    }
    criterion.final_summary();
    println!("\nlinear y = x·Wᵀ, x f32, {:?} kernels (medians of alternating rounds):", Isa::best());
    println!(
        "  rows  in×out        GFLOPS: candle  streaming  packed  packed-bf16  candle-bf16   GB/s(W): packed  packed-bf16   bf16 vs f32 packed  packed vs candle"
    );
    for (m, k, n, flops, elems, (t, r)) in summary {
        println!(
            "  {m:>4}  {:<12} {:>14.1} {:>10.1} {:>7.1} {:>12.1} {:>12.1} {:>17.1} {:>12.1} {:>19.2}x {:>16.2}x",
            format!("{k}x{n}"),
            flops / t[0] / 1e9,
            flops / t[1] / 1e9,
            flops / t[2] / 1e9,
            flops / t[3] / 1e9,
            flops / t[4] / 1e9,
            4.0 * elems / t[2] / 1e9,
            2.0 * elems / t[3] / 1e9,
            1.0 / r[3],
            r[0],
        );
    }
    Ok(())
}
