//! CPU benchmark of the quantized products ([`QuantWeight::forward`], `y = x · Wᵀ`, `W` in GGML
//! blocks), per type, on SmolLM2-135M's shapes (`n × k` = 1536×576 up / gate, 576×1536 down, and
//! the 49152×576 Q8_0 `lm_head`), at 1 (decode), 16, 64 and 512 (prefill) rows, beside candle's
//! `QMatMul::forward` on the same bytes and the f32 [`PackedWeight`] of the dequantized weight.
//! Criterion's throughput is the weight's GGML bytes, so it prints GB/s.
//!
//! After criterion, a summary measured in the same run (medians of alternating rounds, one call
//! of each per round) gives the GB/s of each instruction set of ours, of candle and of the f32
//! kernel, and the ratios to candle. Criterion repeats one call, so the weight stays in L2 when
//! it fits; in the alternating rounds the other kernels' weights push it out (the f32 copy alone
//! is 4× its bytes), as the other layers of a model would.
//!
//! `cargo bench -p multilora-layers --bench quant_kernels` (about three minutes; set
//! `RAYON_NUM_THREADS` to compare thread counts, `QUANT_BENCH_TYPES=Q4_1,Q8_0` and
//! `QUANT_BENCH_ROWS=1,512` to run only some cases, `QUANT_BENCH_SHAPES=4096x14336,6144x4096`
//! (`n`x`k`) to run each chosen type at users' shapes instead (an 8B model's down and q/k/v
//! here), `QUANT_BENCH_ISAS=Avx2,Avx512Vnni` only some
//! instruction sets in the summary, `QUANT_BENCH_SUMMARY_ONLY=1` to skip criterion,
//! `QUANT_BENCH_BASELINES=0` to leave candle and the f32 kernel out of the summary).

use std::hint::black_box;
use std::time::{Duration, Instant};

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use criterion::{Criterion, Throughput};
use multilora_cpu::Isa;
use multilora_cpu::quant::QuantType;
use multilora_layers::{PackedWeight, QuantWeight};

const ROWS: [usize; 4] = [1, 16, 64, 512];

/// `(type, n, k)`: SmolLM2-135M's MLP shapes (the K-quants need `k` a multiple of 256: only the
/// down projection has it) and the Q8_0 `lm_head`; or every type at each of `QUANT_BENCH_SHAPES`.
fn cases() -> Vec<(QuantType, usize, usize)> {
    let only = std::env::var("QUANT_BENCH_TYPES").unwrap_or_default();
    let mut v = Vec::new();
    if let Ok(shapes) = std::env::var("QUANT_BENCH_SHAPES") {
        let all = [
            QuantType::Q4_1,
            QuantType::Q8_0,
            QuantType::Q4_0,
            QuantType::Q5_0,
            QuantType::Q5_1,
            QuantType::Q4K,
            QuantType::Q6K,
            QuantType::Q5K,
            QuantType::Q3K,
            QuantType::Q2K,
        ];
        for (n, k) in shapes.split(',').filter_map(|s| s.trim().split_once('x')) {
            let (Ok(n), Ok(k)) = (n.parse(), k.parse()) else { continue };
            v.extend(all.iter().map(|&qt| (qt, n, k)));
        }
        v.retain(|(qt, _, _)| only.is_empty() || only.split(',').any(|t| t == qt.name()));
        return v;
    }
    for qt in [QuantType::Q4_1, QuantType::Q8_0, QuantType::Q4_0, QuantType::Q5_0, QuantType::Q5_1] {
        v.push((qt, 1536, 576));
        v.push((qt, 576, 1536));
    }
    for qt in [QuantType::Q4K, QuantType::Q6K, QuantType::Q5K, QuantType::Q3K, QuantType::Q2K] {
        v.push((qt, 576, 1536));
    }
    v.push((QuantType::Q8_0, 49152, 576));
    v.retain(|(qt, _, _)| only.is_empty() || only.split(',').any(|t| t == qt.name()));
    v
}

/// The batch sizes to run (`QUANT_BENCH_ROWS`, default [`ROWS`]).
fn rows() -> Vec<usize> {
    match std::env::var("QUANT_BENCH_ROWS") {
        Ok(s) => s.split(',').filter_map(|r| r.trim().parse().ok()).collect(),
        Err(_) => ROWS.to_vec(),
    }
}

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

/// Median seconds of each of `fs` over alternating rounds (one call of each per round), about
/// `budget` in all.
fn rounds(fs: &[&dyn Fn() -> Tensor], budget: Duration) -> Vec<f64> {
    let time = |f: &dyn Fn() -> Tensor| {
        let t = Instant::now();
        black_box(f());
        t.elapsed().as_secs_f64()
    };
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); fs.len()];
    let start = Instant::now();
    while times[0].len() < 3 || (start.elapsed() < budget && times[0].len() < 400) {
        for (t, f) in times.iter_mut().zip(fs) {
            t.push(time(*f));
        }
    }
    times
        .into_iter()
        .map(|mut s| {
            s.sort_by(f64::total_cmp);
            s[s.len() / 2]
        })
        .collect()
}

fn main() -> anyhow::Result<()> {
    // Inside a rayon pool, as the engine runs its steps: the calling thread is one of the workers.
    rayon::ThreadPoolBuilder::new().build()?.install(run)
}

fn run() -> anyhow::Result<()> {
    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_millis(50))
        .measurement_time(Duration::from_millis(200))
        .sample_size(10)
        .configure_from_args();
    let summary_only = std::env::var("QUANT_BENCH_SUMMARY_ONLY").is_ok_and(|v| v == "1");
    let baselines = std::env::var("QUANT_BENCH_BASELINES").map_or(true, |v| v != "0");
    let only_isas = std::env::var("QUANT_BENCH_ISAS").unwrap_or_default();
    let mut isas = Isa::available_of(&Isa::QUANT);
    isas.retain(|i| only_isas.is_empty() || only_isas.split(',').any(|o| o == format!("{i:?}")));
    let best = Isa::best();
    let mut summary = Vec::new();
    for (qt, n, k) in cases() {
        let w = tensor((n, k), 1)?;
        let q = QTensor::quantize(&w, multilora_layers::ggml_dtype(qt))?;
        let bytes = q.data()?.to_vec();
        let ours = QuantWeight::from_bytes(qt, n, k, &bytes)?;
        let candle = QMatMul::from_qtensor(q)?;
        let f32w = PackedWeight::pack(&ours.dequantize()?)?.ok_or_else(|| anyhow::anyhow!("f32 weights pack"))?;
        let lm_head = n > 10_000;
        for m in rows() {
            let x = tensor((m, k), 2)?;
            // candle's Q8_0 `lm_head` takes seconds a call from 64 rows on: left out there; its
            // 512-row products of the other types (up to half a second, scalar for Q4_1 / Q5_*)
            // only in the summary's rounds, to keep the run to about three minutes.
            let candle_timed = !(lm_head && m > 16);
            if !summary_only {
                let mut g = criterion.benchmark_group(format!("quant/{}/{m}x{k}x{n}", qt.name()));
                g.throughput(Throughput::Bytes(bytes.len() as u64));
                g.bench_function(format!("ours {best:?}"), |b| {
                    b.iter(|| ours.forward(black_box(&x)).expect("forward"))
                });
                if candle_timed && m < 512 {
                    g.bench_function("candle", |b| b.iter(|| candle.forward(black_box(&x)).expect("candle")));
                }
                g.bench_function("f32 packed", |b| b.iter(|| f32w.forward(black_box(&x)).expect("f32")));
                g.finish();
            }
            // The portable kernels only at decode sizes: at 64 rows and up they take seconds.
            let timed: Vec<Isa> = isas.iter().copied().filter(|&i| i != Isa::Portable || m <= 16).collect();
            let mut fs: Vec<Box<dyn Fn() -> Tensor>> = Vec::new();
            let (o, xr) = (&ours, &x);
            for &isa in &timed {
                fs.push(Box::new(move || o.forward_with(xr, isa).expect("forward")));
            }
            if baselines && candle_timed {
                fs.push(Box::new(|| candle.forward(&x).expect("candle")));
            }
            if baselines {
                fs.push(Box::new(|| f32w.forward(&x).expect("f32")));
            }
            let refs: Vec<&dyn Fn() -> Tensor> = fs.iter().map(|f| f.as_ref()).collect();
            let budget = Duration::from_millis(if lm_head || m == 512 { 400 } else { 200 });
            let t = rounds(&refs, budget);
            // Seconds per instruction set (NaN where not timed), then candle's and the f32 kernel's.
            let mut secs: Vec<f64> =
                isas.iter().map(|i| timed.iter().position(|t| t == i).map_or(f64::NAN, |p| t[p])).collect();
            let mut rest = t[timed.len()..].iter().copied();
            let candle_s = if baselines && candle_timed { rest.next() } else { None };
            secs.extend([candle_s.unwrap_or(f64::NAN), rest.next().unwrap_or(f64::NAN)]);
            summary.push((qt, n, k, m, bytes.len() as f64, secs));
        }
    }
    criterion.final_summary();
    let threads = rayon::current_num_threads();
    println!(
        "\nquantized y = x·Wᵀ on {threads} threads, medians of alternating rounds: GB/s of the weight's GGML bytes"
    );
    println!("(one pass over the weight per call), and for ours at its best and for candle GMAC/s (m·n·k per second)");
    let names: Vec<String> = isas.iter().map(|i| format!("{:>12}", i.describe())).collect();
    println!(
        "  type   n×k         rows {}       candle   f32-packed   GMAC/s: ours  candle   ours/candle  ours/f32",
        names.join(" ")
    );
    for (qt, n, k, m, b, t) in summary {
        let gbs: Vec<String> = t[..isas.len()].iter().map(|s| format!("{:>12.2}", b / s / 1e9)).collect();
        let (c, f) = (t[isas.len()], t[isas.len() + 1]);
        let best_t = t[isas.iter().position(|&i| i == best).unwrap_or(isas.len() - 1)];
        let macs = (m * n * k) as f64;
        println!(
            "  {:<6} {:<11} {m:>4} {} {:>12.2} {:>12.2} {:>12.1} {:>7.1} {:>12.2}x {:>8.2}x",
            qt.name(),
            format!("{n}x{k}"),
            gbs.join(" "),
            b / c / 1e9,
            b / f / 1e9,
            macs / best_t / 1e9,
            macs / c / 1e9,
            c / best_t,
            f / best_t,
        );
    }
    Ok(())
}
