//! A Llama-3-8B-shaped model of random weights and random LoRA adapters on all seven projections,
//! drawn on the device: what the `decode` section times, and what `tests/launch_count.rs` counts
//! the launches of (it includes this file, so it depends on nothing else of the binary).

use std::collections::{BTreeMap, HashMap};

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use multilora_adapter::{AdapterConfig, LoraAdapter, LoraModule, ModuleId};
use multilora_models::ModelConfig;
use multilora_types::{Fingerprint, ModuleKind};

/// `N(0, scale²)` values of `shape` in `dtype` on `dev` (drawn on the device).
pub(crate) fn randn(shape: &[usize], scale: f32, dtype: DType, dev: &Device) -> Result<Tensor> {
    Ok(Tensor::randn(0f32, scale, shape, dev)?.to_dtype(dtype)?)
}

/// Llama-3-8B's config (`layers` of its 32).
pub(crate) fn config(layers: usize) -> Result<ModelConfig> {
    Ok(ModelConfig::from_json(&serde_json::json!({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": layers, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": false, "torch_dtype": "bfloat16"
    }))?)
}

/// Random N(0, 0.02²) weights named as in a Hugging Face checkpoint, drawn on the device.
pub(crate) fn random_weights(cfg: &ModelConfig, dtype: DType, dev: &Device) -> Result<HashMap<String, Tensor>> {
    let (h, i, v, q, kv) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.q_size(), cfg.kv_size());
    let mut w = HashMap::new();
    w.insert("model.embed_tokens.weight".to_string(), randn(&[v, h], 0.02, dtype, dev)?);
    w.insert("lm_head.weight".to_string(), randn(&[v, h], 0.02, dtype, dev)?);
    w.insert("model.norm.weight".to_string(), Tensor::ones(h, dtype, dev)?);
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}");
        for (name, shape) in [
            ("self_attn.q_proj", [q, h]),
            ("self_attn.k_proj", [kv, h]),
            ("self_attn.v_proj", [kv, h]),
            ("self_attn.o_proj", [h, q]),
            ("mlp.gate_proj", [i, h]),
            ("mlp.up_proj", [i, h]),
            ("mlp.down_proj", [h, i]),
        ] {
            w.insert(format!("{p}.{name}.weight"), randn(&shape, 0.02, dtype, dev)?);
        }
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            w.insert(format!("{p}.{norm}.weight"), Tensor::ones(h, dtype, dev)?);
        }
    }
    Ok(w)
}

/// A rank-`rank` adapter on all seven projections of every layer, drawn on the device.
pub(crate) fn random_adapter(
    cfg: &ModelConfig,
    k: usize,
    rank: usize,
    dtype: DType,
    dev: &Device,
) -> Result<LoraAdapter> {
    let (h, i, q, kv) = (cfg.hidden_size, cfg.intermediate_size, cfg.q_size(), cfg.kv_size());
    let mut modules = BTreeMap::new();
    for l in 0..cfg.num_layers {
        for (kind, inp, out) in [
            (ModuleKind::QProj, h, q),
            (ModuleKind::KProj, h, kv),
            (ModuleKind::VProj, h, kv),
            (ModuleKind::OProj, q, h),
            (ModuleKind::GateProj, h, i),
            (ModuleKind::UpProj, h, i),
            (ModuleKind::DownProj, i, h),
        ] {
            let a = randn(&[rank, inp], 0.02, dtype, dev)?;
            let b = randn(&[out, rank], 0.02, dtype, dev)?;
            modules.insert(ModuleId::layer(l, kind), LoraModule::new(a, &b, rank, 2.0 * rank as f64, 2.0)?);
        }
    }
    let config = AdapterConfig::parse(&format!(
        r#"{{"r": {rank}, "lora_alpha": {}, "target_modules": "all-linear"}}"#,
        2 * rank
    ))
    .map_err(anyhow::Error::msg)?;
    Ok(LoraAdapter::new(format!("a{k}"), config, modules, Fingerprint([k as u8; 32])))
}
