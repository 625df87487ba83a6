//! End-to-end throughput through the engine API on the PEFT comparison model shape (hidden 1024,
//! intermediate 2816, 8 layers, 16 heads / 8 KV heads, vocab 32000, f32; random weights written
//! to a temp dir): 16 requests of 64-token prompts and 32 greedy new tokens, (1) base only,
//! (2) over 8 rank-16 adapters on all seven projections, (3) the same with `max_loras 1`.
//! After criterion, a summary prints new tokens/s and the ratios to the base run from rounds that
//! run every scenario in turn (medians), so that the machine's drift falls on all of them alike.
//!
//! `cargo bench -p multilora --bench cpu_engine -- --warm-up-time 1 --measurement-time 10`

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use criterion::Criterion;
use multilora::{Engine, GenerateRequest, SamplingParams};
use multilora_adapter::{ModelShapes, ModuleKind, SyntheticAdapter};

const REQUESTS: usize = 16;
const PROMPT: usize = 64;
const NEW: usize = 32;
const ADAPTERS: usize = 8;

fn write_model(dir: &Path) -> anyhow::Result<()> {
    let (h, i, v, layers, heads, kv_heads) = (1024, 2816, 32000, 8, 16, 8);
    let head_dim = h / heads;
    let config = serde_json::json!({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": h, "intermediate_size": i, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": v, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 2048, "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2});
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config)?)?;
    let dev = Device::Cpu;
    let r = |shape: (usize, usize)| Tensor::randn(0f32, 0.02, shape, &dev);
    let mut w: HashMap<String, Tensor> = HashMap::new();
    w.insert("model.embed_tokens.weight".into(), r((v, h))?);
    w.insert("lm_head.weight".into(), r((v, h))?);
    w.insert("model.norm.weight".into(), Tensor::ones(h, DType::F32, &dev)?);
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        for (n, shape) in [
            ("self_attn.q_proj", (heads * head_dim, h)),
            ("self_attn.k_proj", (kv_heads * head_dim, h)),
            ("self_attn.v_proj", (kv_heads * head_dim, h)),
            ("self_attn.o_proj", (h, heads * head_dim)),
            ("mlp.gate_proj", (i, h)),
            ("mlp.up_proj", (i, h)),
            ("mlp.down_proj", (h, i)),
        ] {
            w.insert(format!("{p}.{n}.weight"), r(shape)?);
        }
        w.insert(format!("{p}.input_layernorm.weight"), Tensor::ones(h, DType::F32, &dev)?);
        w.insert(format!("{p}.post_attention_layernorm.weight"), Tensor::ones(h, DType::F32, &dev)?);
    }
    candle_core::safetensors::save(&w, dir.join("model.safetensors"))?;
    let shapes = ModelShapes::llama(layers, h, i, v, heads, kv_heads);
    for a in 0..ADAPTERS {
        SyntheticAdapter::new(16, &ModuleKind::PROJECTIONS, 100 + a as u64)
            .write(&dir.join(format!("lora{a}")), &shapes)?;
    }
    Ok(())
}

fn engine(dir: &Path, max_loras: usize) -> anyhow::Result<Engine> {
    let mut b = Engine::builder(dir.display().to_string())
        .served_model_name("base")
        .max_loras(max_loras)
        .kv_cache_bytes(512 << 20)
        .enable_prefix_caching(false);
    for a in 0..ADAPTERS {
        b = b.lora(format!("lora{a}"), dir.join(format!("lora{a}")).display().to_string());
    }
    Ok(b.build()?)
}

/// Submits the 16 requests at once and waits for all; returns new tokens generated.
fn run(engine: &Engine, mixed: bool) -> usize {
    let mut p = SamplingParams::greedy(NEW);
    p.ignore_eos = true;
    let streams: Vec<_> = (0..REQUESTS)
        .map(|r| {
            let model = if mixed { format!("lora{}", r % ADAPTERS) } else { "base".to_string() };
            let prompt: Vec<u32> = (0..PROMPT).map(|k| ((r * 131 + k * 17) % 31990 + 3) as u32).collect();
            engine.submit(GenerateRequest::new(model, prompt).params(p.clone())).expect("submit")
        })
        .collect();
    streams.into_iter().map(|s| s.collect_blocking().expect("request").token_ids.len()).sum()
}

/// Rounds of the alternating summary: each round runs every scenario once, in turn.
const ROUNDS: usize = 7;

fn main() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    write_model(tmp.path())?;
    let mut criterion = Criterion::default().configure_from_args().sample_size(10);
    let scenarios =
        [("base only", 8, false), ("16 over 8 adapters", 8, true), ("16 over 8 adapters, max_loras 1", 1, true)];
    let engines =
        scenarios.iter().map(|&(_, max_loras, _)| engine(tmp.path(), max_loras)).collect::<Result<Vec<_>, _>>()?;
    for ((name, _, mixed), engine) in scenarios.iter().zip(&engines) {
        run(engine, *mixed);
        criterion.bench_function(&format!("cpu_engine/{name}"), |b| b.iter(|| run(engine, *mixed)));
    }
    criterion.final_summary();
    // The scenarios one after another, round after round, so that a slower or faster spell of a
    // shared machine falls on all of them: medians of the times and of the per-round ratios.
    let mut times = vec![Vec::new(); scenarios.len()];
    let mut ratios = vec![Vec::new(); scenarios.len()];
    let mut tokens = 0;
    for _ in 0..ROUNDS {
        let mut t = Vec::new();
        for ((_, _, mixed), engine) in scenarios.iter().zip(&engines) {
            let start = Instant::now();
            tokens = run(engine, *mixed);
            t.push(start.elapsed().as_secs_f64());
        }
        for (i, &ti) in t.iter().enumerate() {
            times[i].push(ti);
            ratios[i].push(t[0] / ti);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!("\nend-to-end new tokens/s (16 requests, 64-token prompts, 32 new tokens; PEFT mixed: 131),");
    println!("medians of {ROUNDS} alternating rounds:");
    for (i, (name, _, _)) in scenarios.iter().enumerate() {
        let tps = tokens as f64 / median(&mut times[i]);
        println!(
            "  {name:<34} {tps:8.1} tok/s   {:.3}x base (per-round median)   {:.2}x PEFT mixed",
            median(&mut ratios[i]),
            tps / 131.0
        );
    }
    Ok(())
}
