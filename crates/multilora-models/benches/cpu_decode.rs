//! One decode step of a random Llama of the PEFT comparison shape (hidden 1024, intermediate 2816,
//! 8 layers, 16 heads / 8 KV heads, vocab 32000) in f32 and in bf16 (weights, slots and KV cache;
//! f32 activations) at batch 1, 16 and 64 with 64 tokens of context each: base only, 8 adapters
//! of rank 16 on all seven projections (rows spread over them), and the bare f32 matmuls of one
//! step through candle. After criterion, a summary measured in the same run prints tokens/s, the
//! LoRA/base ratio, and each step against its memory floor: the bytes it must read (every base
//! weight once, plus the A and B of the adapters its rows use) at the read bandwidth of all
//! threads measured in the same run.
//!
//! `cargo bench -p multilora-models --bench cpu_decode -- --warm-up-time 1 --measurement-time 3`

use std::collections::HashMap;
mod common;

use std::hint::black_box;

use candle_core::{DType, Device, Tensor};
use criterion::{BenchmarkId, Criterion, Throughput};
use multilora_adapter::{LoadOptions, SyntheticAdapter};
use multilora_models::{Batch, KvCache, KvCacheConfig, Model, ModelConfig, ModelOptions, SeqInput};
use multilora_types::{LoraLimits, ModuleKind, SlotId};

const CONTEXT: usize = 64;
const BLOCK: usize = 16;
const BATCHES: [usize; 3] = [1, 16, 64];

fn config() -> ModelConfig {
    let v = serde_json::json!({"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816,
        "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 2048});
    ModelConfig::from_json(&v).expect("config")
}

fn random_tensors(cfg: &ModelConfig) -> HashMap<String, Tensor> {
    let dev = Device::Cpu;
    let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let r = |shape: (usize, usize)| Tensor::randn(0f32, 0.02, shape, &dev).expect("randn");
    let ones = || Tensor::ones(h, DType::F32, &dev).expect("ones");
    let mut w = HashMap::new();
    w.insert("model.embed_tokens.weight".to_string(), r((v, h)));
    w.insert("lm_head.weight".to_string(), r((v, h)));
    w.insert("model.norm.weight".to_string(), ones());
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}");
        for (n, shape) in [
            ("self_attn.q_proj", (cfg.q_size(), h)),
            ("self_attn.k_proj", (cfg.kv_size(), h)),
            ("self_attn.v_proj", (cfg.kv_size(), h)),
            ("self_attn.o_proj", (h, cfg.q_size())),
            ("mlp.gate_proj", (i, h)),
            ("mlp.up_proj", (i, h)),
            ("mlp.down_proj", (h, i)),
        ] {
            w.insert(format!("{p}.{n}.weight"), r(shape));
        }
        w.insert(format!("{p}.input_layernorm.weight"), ones());
        w.insert(format!("{p}.post_attention_layernorm.weight"), ones());
    }
    w
}

struct Setup {
    model: Model,
    cache: KvCache,
    weights: Vec<Tensor>,
    /// Bytes of the base weights one step reads (every projection and `lm_head`, in the dtype).
    base_bytes: f64,
    /// Bytes of one adapter's A and B over the seven projections of every layer, in the dtype.
    adapter_bytes: f64,
}

fn setup(dtype: DType) -> Setup {
    let cfg = config();
    let tensors = random_tensors(&cfg);
    let size = dtype.size_in_bytes() as f64;
    let weights: Vec<Tensor> = {
        // The step's GEMM operands in the model's fused layout: qkv, o, gate_up, down per layer, lm_head.
        let get = |k: &str| tensors[k].clone();
        let mut ws = Vec::new();
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}");
            let cat = |names: &[&str]| {
                Tensor::cat(&names.iter().map(|n| get(&format!("{p}.{n}.weight"))).collect::<Vec<_>>(), 0).expect("cat")
            };
            ws.push(cat(&["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]));
            ws.push(get(&format!("{p}.self_attn.o_proj.weight")));
            ws.push(cat(&["mlp.gate_proj", "mlp.up_proj"]));
            ws.push(get(&format!("{p}.mlp.down_proj.weight")));
        }
        ws.push(get("lm_head.weight"));
        ws
    };
    let base_bytes = weights.iter().map(|w| w.elem_count() as f64).sum::<f64>() * size;
    let (h, i, q, kv) = (cfg.hidden_size, cfg.intermediate_size, cfg.q_size(), cfg.kv_size());
    // Per layer, rank 16 · (in + out) per projection: q, k, v, o, gate, up, down.
    let per_layer = 16 * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h));
    let adapter_bytes = (per_layer * cfg.num_layers) as f64 * size;
    let opts =
        ModelOptions::default().dtype(dtype).lora(LoraLimits::new(8, 16, &ModuleKind::PROJECTIONS).expect("limits"));
    let mut model = Model::from_tensors(cfg, tensors, &opts).expect("model");
    let dir = tempfile::tempdir().expect("tempdir");
    for slot in 0..8 {
        let d = dir.path().join(format!("a{slot}"));
        SyntheticAdapter::new(16, &ModuleKind::PROJECTIONS, slot as u64 + 1).write(&d, model.shapes()).expect("write");
        let a = multilora_adapter::load_dir(
            &format!("a{slot}"),
            &d,
            model.shapes(),
            &LoadOptions::new(dtype).max_lora_rank(16),
        )
        .expect("load");
        model.write_slot(SlotId::new(slot), &a).expect("slot");
    }
    let per_seq = (CONTEXT + 1).div_ceil(BLOCK);
    // The cache content does not change the cost of a step, so the context is left zeroed.
    let cache = model.new_kv_cache(KvCacheConfig::new(per_seq * 64, BLOCK)).expect("cache");
    Setup { model, cache, weights, base_bytes, adapter_bytes }
}

fn batch(n: usize, lora: bool) -> Batch {
    let per_seq = (CONTEXT + 1).div_ceil(BLOCK) as u32;
    Batch::new(
        (0..n)
            .map(|i| {
                let table = (i as u32 * per_seq..(i as u32 + 1) * per_seq).collect();
                SeqInput::new(vec![(i * 31 % 32000) as u32], CONTEXT, table, lora.then(|| SlotId::new(i % 8)))
            })
            .collect(),
    )
}

/// The engine bench's prefill: 16 prompts of 64 tokens from position 0 in one step, logits for
/// the last token of each (over the 8 adapters when `lora`).
fn prefill(lora: bool) -> Batch {
    let per_seq = (CONTEXT + 1).div_ceil(BLOCK) as u32;
    Batch::new(
        (0..16)
            .map(|i| {
                let table = (i as u32 * per_seq..(i as u32 + 1) * per_seq).collect();
                let tokens = (0..CONTEXT).map(|k| ((i * 131 + k * 17) % 31990 + 3) as u32).collect();
                SeqInput::new(tokens, 0, table, lora.then(|| SlotId::new(i % 8)))
            })
            .collect(),
    )
}

fn matmuls(s: &Setup, x: &Tensor, xi: &Tensor) -> Tensor {
    let mut last = x.clone();
    for (j, w) in s.weights.iter().enumerate() {
        // down_proj takes the intermediate activation; every other GEMM the hidden state.
        let input = if j % 4 == 3 && j < s.weights.len() - 1 { xi } else { x };
        last = input.matmul(&w.t().expect("t")).expect("matmul");
    }
    last
}

fn main() {
    let mut setups = [(DType::F32, setup(DType::F32)), (DType::BF16, setup(DType::BF16))];
    let mut c = Criterion::default().configure_from_args();
    let mut g = c.benchmark_group("cpu_decode");
    // A step at batch 64 takes a good fraction of a second on two cores; ten samples keep a run short.
    g.sample_size(10);
    for &n in &BATCHES {
        g.throughput(Throughput::Elements(n as u64));
        for (dt, s) in setups.iter_mut() {
            for (name, lora) in [("base", false), ("lora8_r16", true)] {
                let b = batch(n, lora);
                g.bench_with_input(BenchmarkId::new(format!("{dt:?}/{name}"), n), &b, |bench, b| {
                    bench.iter(|| black_box(s.model.forward(b, &mut s.cache).expect("forward")))
                });
            }
        }
        let s = &setups[0].1;
        let x = Tensor::randn(0f32, 1.0, (n, 1024), &Device::Cpu).expect("x");
        let xi = Tensor::randn(0f32, 1.0, (n, 2816), &Device::Cpu).expect("xi");
        g.bench_with_input(BenchmarkId::new("bare_matmuls", n), &n, |bench, _| {
            bench.iter(|| black_box(matmuls(s, &x, &xi)))
        });
    }
    g.throughput(Throughput::Elements(16 * CONTEXT as u64));
    for (dt, s) in setups.iter_mut() {
        for (name, lora) in [("prefill base", false), ("prefill lora8_r16", true)] {
            let b = prefill(lora);
            g.bench_with_input(BenchmarkId::new(format!("{dt:?}/{name}"), 16 * CONTEXT), &b, |bench, b| {
                bench.iter(|| black_box(s.model.forward(b, &mut s.cache).expect("forward")))
            });
        }
    }
    g.finish();
    let bw = common::read_bandwidth();
    println!("\nsummary (median of 7 steps, same run); read bandwidth of all threads {:.2} GB/s", bw / 1e9);
    println!("kernels: {}", setups[1].1.model.kernels());
    println!(
        "{:>5} {:>6} {:>11} {:>11} {:>11} {:>9} {:>12} {:>12} {:>10}",
        "dtype", "batch", "base tok/s", "lora tok/s", "candle f32", "lora/base", "base/floor", "lora/floor", "MB/step"
    );
    for &n in &BATCHES {
        let x = Tensor::randn(0f32, 1.0, (n, 1024), &Device::Cpu).expect("x");
        let xi = Tensor::randn(0f32, 1.0, (n, 2816), &Device::Cpu).expect("xi");
        let tm = common::median_time(7, || {
            black_box(matmuls(&setups[0].1, &x, &xi));
        });
        for (dt, s) in setups.iter_mut() {
            let (bb, bl) = (batch(n, false), batch(n, true));
            let tb = common::median_time(7, || {
                black_box(s.model.forward(&bb, &mut s.cache).expect("forward"));
            });
            let tl = common::median_time(7, || {
                black_box(s.model.forward(&bl, &mut s.cache).expect("forward"));
            });
            // Rows spread over the 8 adapters: min(n, 8) of them are read.
            let lora_bytes = s.base_bytes + n.min(8) as f64 * s.adapter_bytes;
            println!(
                "{:>5} {n:>6} {:>11.1} {:>11.1} {:>11.1} {:>9.3} {:>12.3} {:>12.3} {:>10.1}",
                format!("{dt:?}"),
                n as f64 / tb,
                n as f64 / tl,
                n as f64 / tm,
                tl / tb,
                tb / (s.base_bytes / bw),
                tl / (lora_bytes / bw),
                lora_bytes / 1e6,
            );
        }
    }
    println!("\nprefill: 16 prompts of {CONTEXT} tokens in one step (median of 7), prompt tokens/s:");
    for (dt, s) in setups.iter_mut() {
        let (bb, bl) = (prefill(false), prefill(true));
        let tb = common::median_time(7, || {
            black_box(s.model.forward(&bb, &mut s.cache).expect("forward"));
        });
        let tl = common::median_time(7, || {
            black_box(s.model.forward(&bl, &mut s.cache).expect("forward"));
        });
        let t = (16 * CONTEXT) as f64;
        println!("  {:>5}  base {:>8.1}   lora {:>8.1}   lora/base {:.3}", format!("{dt:?}"), t / tb, t / tl, tl / tb);
    }
}
