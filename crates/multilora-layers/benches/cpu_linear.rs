//! CPU benchmark of the base linear kernels (`y = x · Wᵀ`, f32): the weight packed at load time
//! ([`PackedWeight`], what the layers use) and read in place ([`linear`]), against candle's
//! matmul, at the decode (16 rows) and prefill (1,024 rows) batch sizes of the engine bench, on
//! the projection shapes of its model (hidden 1024, intermediate 2816, vocab 32000):
//! `in × out` = 1024×1024, 1024×2816, 2816×1024, 1024×32000.
//!
//! After criterion, a summary measured in the same run gives GFLOPS and the GB/s of reading `W`
//! (the bound of a decode step) for each, and the speed-ups of the packed kernel, from the medians
//! of alternating rounds (one call of each per round).
//!
//! `cargo bench -p multilora-layers --bench cpu_linear -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::time::Instant;

use candle_core::{Device, Tensor};
use criterion::{Criterion, Throughput};
use multilora_layers::{Isa, PackedWeight, linear, linear_with};

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

/// Median seconds of candle, streaming and packed over alternating rounds, and the median
/// per-round ratios candle / packed and streaming / packed.
fn rounds(x: &Tensor, w: &Tensor, p: &PackedWeight, n: usize) -> [f64; 5] {
    let time = |f: &dyn Fn() -> Tensor| {
        let t = Instant::now();
        black_box(f());
        t.elapsed().as_secs_f64()
    };
    let mut v: [Vec<f64>; 5] = Default::default();
    for _ in 0..n {
        let (tc, ts, tp) = (time(&|| candle(x, w)), time(&|| streaming(x, w)), time(&|| packed(x, p)));
        for (i, t) in [tc, ts, tp, tc / tp, ts / tp].into_iter().enumerate() {
            v[i].push(t);
        }
    }
    v.map(|mut s| {
        s.sort_by(f64::total_cmp);
        s[s.len() / 2]
    })
}

fn main() -> anyhow::Result<()> {
    let mut criterion = Criterion::default().configure_from_args().sample_size(10);
    let mut summary = Vec::new();
    for (k, n) in SHAPES {
        let w = tensor((n, k), 1)?;
        let pw = PackedWeight::pack(&w)?.ok_or_else(|| anyhow::anyhow!("f32 cpu weights pack"))?;
        for m in ROWS {
            let x = tensor((m, k), 2)?;
            let flops = 2 * m * n * k;
            let mut g = criterion.benchmark_group(format!("cpu_linear/{m}x{k}x{n}"));
            g.throughput(Throughput::Elements(flops as u64));
            g.bench_function("candle", |b| b.iter(|| candle(black_box(&x), &w)));
            g.bench_function("streaming", |b| b.iter(|| streaming(black_box(&x), &w)));
            g.bench_function("packed", |b| b.iter(|| packed(black_box(&x), &pw)));
            if m == 16 {
                // The other instruction sets at the decode size, for the record.
                for isa in Isa::all_available().into_iter().filter(|&i| i != Isa::best()) {
                    g.bench_function(format!("streaming {isa:?}"), |b| {
                        b.iter(|| linear_with(black_box(&x), &w, isa).expect("linear"))
                    });
                    g.bench_function(format!("packed {isa:?}"), |b| {
                        b.iter(|| pw.forward_with(black_box(&x), isa).expect("packed linear"))
                    });
                }
            }
            g.finish();
            let r = rounds(&x, &w, &pw, if m == 16 { 41 } else { 9 });
            summary.push((m, k, n, flops as f64, (n * k * 4) as f64, r));
        }
    }
    criterion.final_summary();
    println!("\nlinear y = x·Wᵀ, f32, {:?} kernels (medians of alternating rounds):", Isa::best());
    println!(
        "  rows  in×out        GFLOPS: candle  streaming  packed   GB/s(W) packed   packed vs candle  vs streaming"
    );
    for (m, k, n, flops, wbytes, [tc, ts, tp, rc, rs]) in summary {
        println!(
            "  {m:>4}  {:<12} {:>14.1} {:>10.1} {:>7.1} {:>16.1} {:>17.2}x {:>12.2}x",
            format!("{k}x{n}"),
            flops / tc / 1e9,
            flops / ts / 1e9,
            flops / tp / 1e9,
            wbytes / tp / 1e9,
            rc,
            rs
        );
    }
    Ok(())
}
