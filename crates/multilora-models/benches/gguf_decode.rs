//! One decode step of a real GGUF model, its weights kept quantized (SmolLM2-135M-Instruct, the
//! Q4_1 file `scripts/fetch-smollm2.sh` fetches, found through `MULTILORA_SMOLLM2_GGUF`), at batch
//! 1, 16 and 64 with 64 tokens of context each: the base alone, and 8 adapters of rank 16 on all
//! seven projections (rows spread over them), slots and KV cache in the model's defaults for the
//! file (f16, as llama.cpp's; `MULTILORA_BENCH_F32=1` for f32 ones). After criterion, a summary measured in
//! the same run (the bandwidth and the peak: the better of a measurement before and after the
//! steps) prints tokens/s, the LoRA/base ratio, and each step against its floor: the larger
//! of its memory time (the quantized weights' bytes, the tied `lm_head` among them, plus the A and
//! B of the adapters its rows use, at the read bandwidth of all threads) and its compute time (its
//! multiply-adds at the peak of the quantized kernel on this CPU's best instruction set: the best
//! GMAC/s of a product whose weight stays in L2).
//!
//! `MULTILORA_SMOLLM2_GGUF=…/SmolLM2-135M-Instruct.Q4_1.gguf cargo bench -p multilora-models --bench gguf_decode -- --warm-up-time 1 --measurement-time 3`
//! (`MULTILORA_BENCH_ISA=avx2`: with the kernels of an AVX2-only CPU).

mod common;

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Instant;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use criterion::{BenchmarkId, Criterion, Throughput};
use multilora_adapter::{LoadOptions, SyntheticAdapter};
use multilora_cpu::Isa;
use multilora_cpu::quant::QuantType;
use multilora_layers::QuantWeight;
use multilora_models::{Batch, KvCache, KvCacheConfig, Model, ModelOptions, ModelSource, SeqInput};
use multilora_types::{LoraLimits, ModuleKind, SlotId};

const CONTEXT: usize = 64;
const BLOCK: usize = 16;
const BATCHES: [usize; 3] = [1, 16, 64];
const RANK: usize = 16;
const ADAPTERS: usize = 8;
/// Steps timed for each line of the summary (their median).
const STEPS: usize = 31;

struct Setup {
    model: Model,
    cache: KvCache,
    /// Bytes of the weights one step reads (every projection and the tied `lm_head`, quantized).
    weight_bytes: f64,
    /// Bytes of one adapter's A and B over the seven projections of every layer (slot dtype).
    adapter_bytes: f64,
    /// Multiply-adds of one row through every projection and `lm_head`, and through one adapter.
    base_macs: f64,
    lora_macs: f64,
}

fn setup(path: PathBuf) -> Setup {
    let limits = LoraLimits::new(ADAPTERS, RANK, &ModuleKind::PROJECTIONS).expect("limits");
    let mut opts = ModelOptions::default().lora(limits);
    if std::env::var_os("MULTILORA_BENCH_F32").is_some() {
        opts = opts.lora_dtype(DType::F32).kv_dtype(DType::F32);
    }
    let mut model = Model::load(&ModelSource::Gguf(path), &opts).expect("the GGUF model");
    let cfg = model.config().clone();
    let (h, i, q, kv) = (cfg.hidden_size, cfg.intermediate_size, cfg.q_size(), cfg.kv_size());
    let per_layer_in_out = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h);
    let per_layer_macs = h * (q + 2 * kv) + q * h + 2 * h * i + i * h;
    let dir = tempfile::tempdir().expect("tempdir");
    for slot in 0..ADAPTERS {
        let d = dir.path().join(format!("a{slot}"));
        SyntheticAdapter::new(RANK, &ModuleKind::PROJECTIONS, slot as u64 + 1)
            .write(&d, model.shapes())
            .expect("write");
        let a = multilora_adapter::load_dir(
            &format!("a{slot}"),
            &d,
            model.shapes(),
            &LoadOptions::new(model.lora_dtype()).max_lora_rank(RANK),
        )
        .expect("load");
        model.write_slot(SlotId::new(slot), &a).expect("slot");
    }
    let per_seq = (CONTEXT + 1).div_ceil(BLOCK);
    let cache = model.new_kv_cache(KvCacheConfig::new(per_seq * 64, BLOCK)).expect("cache");
    // Every row of the cache holds values, as after the context's prefill: a cache never written
    // reads its untouched pages through the system's one shared zero page, which no server step
    // does (and which cost a 16-row step ~0.3 ms on Zen 5: its L1 cache misses on the aliases).
    for l in 0..cache.num_layers() {
        for t in [cache.keys(l).expect("keys"), cache.values(l).expect("values")] {
            let v = Tensor::randn(0f32, 1.0, t.dims(), &Device::Cpu).and_then(|v| v.to_dtype(t.dtype()));
            t.slice_set(&v.expect("values"), 0, 0).expect("fill");
        }
    }
    Setup {
        weight_bytes: model.weight_bytes() as f64,
        adapter_bytes: (RANK * per_layer_in_out * cfg.num_layers * model.lora_dtype().size_in_bytes()) as f64,
        base_macs: (per_layer_macs * cfg.num_layers + cfg.vocab_size * h) as f64,
        lora_macs: (RANK * per_layer_in_out * cfg.num_layers) as f64,
        model,
        cache,
    }
}

/// Multiply-adds per second of the quantized kernel at its best: a 1024 × 1024 Q4_1 weight
/// (0.6 MB, in L2) at 16, 64 and 256 rows on all threads; the best of 20 calls of each.
fn kernel_peak() -> f64 {
    let (n, k) = (1024, 1024);
    let w = Tensor::randn(0f32, 0.02, (n, k), &Device::Cpu).expect("w");
    let q = QTensor::quantize(&w, GgmlDType::Q4_1).expect("quantize");
    let w = QuantWeight::from_bytes(QuantType::Q4_1, n, k, &q.data().expect("bytes")).expect("weight");
    let mut best = 0f64;
    for m in [16, 64, 256] {
        let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).expect("x");
        for _ in 0..20 {
            let t = Instant::now();
            black_box(w.forward(&x).expect("forward"));
            best = best.max((m * n * k) as f64 / t.elapsed().as_secs_f64());
        }
    }
    best
}

fn batch(n: usize, lora: bool) -> Batch {
    let per_seq = (CONTEXT + 1).div_ceil(BLOCK) as u32;
    Batch::new(
        (0..n)
            .map(|i| {
                let table = (i as u32 * per_seq..(i as u32 + 1) * per_seq).collect();
                SeqInput::new(vec![(i * 31 % 32000) as u32], CONTEXT, table, lora.then(|| SlotId::new(i % ADAPTERS)))
            })
            .collect(),
    )
}

fn main() {
    let Some(path) = std::env::var_os("MULTILORA_SMOLLM2_GGUF").map(PathBuf::from) else {
        eprintln!(
            "gguf_decode: MULTILORA_SMOLLM2_GGUF is not set (scripts/fetch-smollm2.sh fetches the file); skipped"
        );
        return;
    };
    // `MULTILORA_BENCH_ISA=avx2` (any set's `Isa::name`, e.g. `avx512-vnni`): the kernels an
    // AVX2-only CPU (Zen 3) runs, measured on this one (`Isa::set_max`), its floor's peak included.
    if let Ok(name) = std::env::var("MULTILORA_BENCH_ISA") {
        let names: Vec<&str> = Isa::ALL.iter().map(|i| i.name()).collect();
        let isa = Isa::from_name(&name).unwrap_or_else(|| panic!("MULTILORA_BENCH_ISA={name}: one of {names:?}"));
        Isa::set_max(isa);
    }
    let mut s = setup(path);
    let mut c = Criterion::default().configure_from_args();
    let mut g = c.benchmark_group("gguf_decode");
    g.sample_size(20);
    for &n in &BATCHES {
        g.throughput(Throughput::Elements(n as u64));
        for (name, lora) in [("base", false), ("lora8_r16", true)] {
            let b = batch(n, lora);
            g.bench_with_input(BenchmarkId::new(name, n), &b, |bench, b| {
                bench.iter(|| black_box(s.model.forward(b, &mut s.cache).expect("forward")))
            });
        }
    }
    g.finish();
    // The machine's best before and after the steps: a moment of noise from another process
    // during one measurement would otherwise lower the floor the steps are compared with.
    let (bw0, peak0) = (common::read_bandwidth(), kernel_peak());
    let mut rows = Vec::new();
    for &n in &BATCHES {
        let (bb, bl) = (batch(n, false), batch(n, true));
        let tb = common::median_time(STEPS, || {
            black_box(s.model.forward(&bb, &mut s.cache).expect("forward"));
        });
        let tl = common::median_time(STEPS, || {
            black_box(s.model.forward(&bl, &mut s.cache).expect("forward"));
        });
        rows.push((n, tb, tl));
    }
    let (bw, peak) = (common::read_bandwidth().max(bw0), kernel_peak().max(peak0));
    println!(
        "\nsummary (median of {STEPS} steps, same run): read bandwidth of all threads {:.2} GB/s, quantized kernel peak \
         {:.1} GMAC/s ({})",
        bw / 1e9,
        peak / 1e9,
        Isa::best().describe()
    );
    println!("kernels: {}", s.model.kernels());
    println!(
        "{:>5} {:>11} {:>11} {:>9} {:>10} {:>10} {:>11} {:>11} {:>12} {:>12}",
        "batch",
        "base tok/s",
        "lora tok/s",
        "lora/base",
        "MB/step",
        "GMAC/step",
        "mem floor",
        "mac floor",
        "base/floor",
        "lora/floor"
    );
    for (n, tb, tl) in rows {
        let floor = |bytes: f64, macs: f64| (bytes / bw).max(macs / peak);
        let (base_floor, lora_bytes) =
            (floor(s.weight_bytes, n as f64 * s.base_macs), s.weight_bytes + n.min(ADAPTERS) as f64 * s.adapter_bytes);
        let lora_macs = n as f64 * (s.base_macs + s.lora_macs);
        let lora_floor = floor(lora_bytes, lora_macs);
        println!(
            "{n:>5} {:>11.1} {:>11.1} {:>9.3} {:>10.1} {:>10.3} {:>9.2}ms {:>9.2}ms {:>12.3} {:>12.3}",
            n as f64 / tb,
            n as f64 / tl,
            tl / tb,
            lora_bytes / 1e6,
            lora_macs / 1e9,
            lora_bytes / bw * 1e3,
            lora_macs / peak * 1e3,
            tb / base_floor,
            tl / lora_floor,
        );
    }
}
