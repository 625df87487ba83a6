//! One decode step of a random Llama of the PEFT comparison shape (hidden 1024, intermediate 2816,
//! 8 layers, 16 heads / 8 KV heads, vocab 32000, f32) at batch 1, 16 and 64 with 64 tokens of
//! context each: base only, 8 adapters of rank 16 on all seven projections (rows spread over
//! them), and the bare matmuls of one step (the floor this machine allows). After criterion, a
//! summary measured in the same run prints tokens/s and the LoRA/base ratio (target ≤ 1.10).
//!
//! `cargo bench -p multilora-models --bench cpu_decode -- --warm-up-time 1 --measurement-time 3`

use std::collections::HashMap;
use std::hint::black_box;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use criterion::{BenchmarkId, Criterion, Throughput};
use multilora_adapter::{LoadOptions, ModuleKind, SyntheticAdapter};
use multilora_models::{Batch, KvCache, KvCacheConfig, LoraLimits, Model, ModelConfig, ModelOptions, SeqInput, SlotId};

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
}

fn setup() -> Setup {
    let cfg = config();
    let tensors = random_tensors(&cfg);
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
    let opts = ModelOptions::default().lora(LoraLimits::new(8, 16, &ModuleKind::PROJECTIONS).expect("limits"));
    let mut model = Model::from_tensors(cfg, tensors, &opts).expect("model");
    let dir = tempfile::tempdir().expect("tempdir");
    for slot in 0..8 {
        let d = dir.path().join(format!("a{slot}"));
        SyntheticAdapter::new(16, &ModuleKind::PROJECTIONS, slot as u64 + 1).write(&d, model.shapes()).expect("write");
        let a = multilora_adapter::load_dir(
            &format!("a{slot}"),
            &d,
            model.shapes(),
            &LoadOptions::default().max_lora_rank(16),
        )
        .expect("load");
        model.write_slot(SlotId::new(slot), &a).expect("slot");
    }
    let per_seq = (CONTEXT + 1).div_ceil(BLOCK);
    // The cache content does not change the cost of a step, so the context is left zeroed.
    let cache = model.new_kv_cache(KvCacheConfig::new(per_seq * 64, BLOCK)).expect("cache");
    Setup { model, cache, weights }
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

fn matmuls(s: &Setup, x: &Tensor, xi: &Tensor) -> Tensor {
    let mut last = x.clone();
    for (j, w) in s.weights.iter().enumerate() {
        // down_proj takes the intermediate activation; every other GEMM the hidden state.
        let input = if j % 4 == 3 && j < s.weights.len() - 1 { xi } else { x };
        last = input.matmul(&w.t().expect("t")).expect("matmul");
    }
    last
}

fn time<F: FnMut()>(mut f: F) -> f64 {
    f();
    let mut runs: Vec<f64> = (0..7)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    runs.sort_by(f64::total_cmp);
    runs[runs.len() / 2]
}

fn main() {
    let mut s = setup();
    let mut c = Criterion::default().configure_from_args();
    let mut g = c.benchmark_group("cpu_decode");
    // A step at batch 64 takes a good fraction of a second on two cores; ten samples keep a run short.
    g.sample_size(10);
    for &n in &BATCHES {
        g.throughput(Throughput::Elements(n as u64));
        for (name, lora) in [("base", false), ("lora8_r16", true)] {
            let b = batch(n, lora);
            g.bench_with_input(BenchmarkId::new(name, n), &b, |bench, b| {
                bench.iter(|| black_box(s.model.forward(b, &mut s.cache).expect("forward")))
            });
        }
        let x = Tensor::randn(0f32, 1.0, (n, 1024), &Device::Cpu).expect("x");
        let xi = Tensor::randn(0f32, 1.0, (n, 2816), &Device::Cpu).expect("xi");
        g.bench_with_input(BenchmarkId::new("bare_matmuls", n), &n, |bench, _| {
            bench.iter(|| black_box(matmuls(&s, &x, &xi)))
        });
    }
    g.finish();
    println!("\nsummary (median of 7 steps, same run):");
    println!(
        "{:>6} {:>12} {:>12} {:>12} {:>10} {:>14}",
        "batch", "base tok/s", "lora tok/s", "floor tok/s", "lora/base", "base/matmuls"
    );
    for &n in &BATCHES {
        let (bb, bl) = (batch(n, false), batch(n, true));
        let tb = time(|| {
            black_box(s.model.forward(&bb, &mut s.cache).expect("forward"));
        });
        let tl = time(|| {
            black_box(s.model.forward(&bl, &mut s.cache).expect("forward"));
        });
        let x = Tensor::randn(0f32, 1.0, (n, 1024), &Device::Cpu).expect("x");
        let xi = Tensor::randn(0f32, 1.0, (n, 2816), &Device::Cpu).expect("xi");
        let tm = time(|| {
            black_box(matmuls(&s, &x, &xi));
        });
        println!(
            "{n:>6} {:>12.1} {:>12.1} {:>12.1} {:>10.3} {:>14.3}",
            n as f64 / tb,
            n as f64 / tl,
            n as f64 / tm,
            tl / tb,
            tb / tm
        );
    }
}
