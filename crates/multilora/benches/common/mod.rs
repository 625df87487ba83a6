//! What the engine benches share: the PEFT comparison model (hidden 1024, intermediate 2816, 8
//! layers, 16 heads / 8 KV heads, vocab 32000, f32, random weights) and 8 rank-16 adapters on all
//! seven projections, written once to a directory.
#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use multilora_adapter::{ModelShapes, SyntheticAdapter};
use multilora_types::ModuleKind;

/// Adapters written next to the model, `lora0` … `lora7`.
pub const ADAPTERS: usize = 8;

/// Writes the model (`config.json`, `model.safetensors`) and the adapters into `dir`.
pub fn write_model(dir: &Path) -> anyhow::Result<()> {
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
