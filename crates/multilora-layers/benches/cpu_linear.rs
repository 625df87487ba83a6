//! CPU benchmark of the base linear kernel (`multilora_layers::linear`, `y = x · Wᵀ`, f32) against
//! candle's matmul, at the decode (16 rows) and prefill (1,024 rows) batch sizes of the engine
//! bench, on the projection shapes of its model (hidden 1024, intermediate 2816, vocab 32000):
//! `in × out` = 1024×1024, 1024×2816, 2816×1024, 1024×32000.
//!
//! After criterion, a summary measured in the same run gives GFLOPS and the GB/s of reading `W`
//! (the bound of a decode step) for each side, and the speed-up, from the median of
//! alternating pairs.
//!
//! `cargo bench -p multilora-layers --bench cpu_linear -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::time::Instant;

use candle_core::{Device, Tensor};
use criterion::{Criterion, Throughput};
use multilora_layers::{Isa, linear, linear_with};

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

fn ours(x: &Tensor, w: &Tensor) -> Tensor {
    linear(x, w).expect("linear")
}

/// Median seconds of each side over alternating pairs, and the median per-pair ratio.
fn paired(x: &Tensor, w: &Tensor, pairs: usize) -> (f64, f64, f64) {
    let time = |f: &dyn Fn() -> Tensor| {
        let t = Instant::now();
        black_box(f());
        t.elapsed().as_secs_f64()
    };
    let (mut a, mut b, mut r) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..pairs {
        let tc = time(&|| candle(x, w));
        let to = time(&|| ours(x, w));
        a.push(tc);
        b.push(to);
        r.push(tc / to);
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    (med(&mut a), med(&mut b), med(&mut r))
}

fn main() -> anyhow::Result<()> {
    let mut criterion = Criterion::default().configure_from_args().sample_size(10);
    let mut summary = Vec::new();
    for (k, n) in SHAPES {
        let w = tensor((n, k), 1)?;
        for m in ROWS {
            let x = tensor((m, k), 2)?;
            let flops = 2 * m * n * k;
            let mut g = criterion.benchmark_group(format!("cpu_linear/{m}x{k}x{n}"));
            g.throughput(Throughput::Elements(flops as u64));
            g.bench_function("candle", |b| b.iter(|| candle(black_box(&x), &w)));
            g.bench_function("ours", |b| b.iter(|| ours(black_box(&x), &w)));
            if m == 16 {
                // The other instruction sets at the decode size, for the record.
                for isa in Isa::all_available().into_iter().filter(|&i| i != Isa::best()) {
                    g.bench_function(format!("{isa:?}"), |b| {
                        b.iter(|| linear_with(black_box(&x), &w, isa).expect("linear"))
                    });
                }
            }
            g.finish();
            let pairs = if m == 16 { 41 } else { 9 };
            let (tc, to, ratio) = paired(&x, &w, pairs);
            summary.push((m, k, n, flops as f64, (n * k * 4) as f64, tc, to, ratio));
        }
    }
    criterion.final_summary();
    println!("\nlinear y = x·Wᵀ, f32, {:?} kernels (median of alternating pairs):", Isa::best());
    println!("  rows  in×out        candle GFLOPS  GB/s(W)   ours GFLOPS  GB/s(W)   speed-up");
    for (m, k, n, flops, wbytes, tc, to, ratio) in summary {
        println!(
            "  {m:>4}  {:<12} {:>10.1} {:>8.1} {:>12.1} {:>8.1} {:>9.2}x",
            format!("{k}x{n}"),
            flops / tc / 1e9,
            wbytes / tc / 1e9,
            flops / to / 1e9,
            wbytes / to / 1e9,
            ratio
        );
    }
    Ok(())
}
