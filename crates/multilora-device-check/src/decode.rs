//! `decode`: the decode step of a random Llama-3-8B-shaped model in bf16 with 8 rank-16 adapters
//! on all seven projections, at batch 1, 16 and 64 (context 512): base rows and LoRA rows, each
//! step's device time (CUDA events over back-to-back steps) against its floor (the weights, the
//! contexts' keys and values and the used adapters read once at the device's bandwidth), beside the host's time
//! per step; and LoRA against base at batch 64 (a speed target: ≤ 1.10).

use std::collections::{BTreeMap, HashMap};

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use multilora_adapter::ModuleId;
use multilora_adapter::{AdapterConfig, LoraAdapter, LoraModule};
use multilora_models::{Batch, KvCacheConfig, Model, ModelConfig, ModelOptions, SeqInput};
use multilora_types::{Fingerprint, LoraLimits, ModuleKind, SlotId};

use crate::clock::events;
use crate::floor::{DECODE, decode_step_bytes};
use crate::report::Report;
use crate::util::randn;

/// Llama-3-8B's config (`layers` of its 32).
fn llama3_8b(layers: usize) -> Result<ModelConfig> {
    Ok(ModelConfig::from_json(&serde_json::json!({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": layers, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": false, "torch_dtype": "bfloat16"
    }))?)
}

/// Random N(0, 0.02²) weights named as in a Hugging Face checkpoint, drawn on the device.
fn random_weights(cfg: &ModelConfig, dtype: DType, dev: &Device) -> Result<HashMap<String, Tensor>> {
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
fn random_adapter(cfg: &ModelConfig, k: usize, rank: usize, dtype: DType, dev: &Device) -> Result<LoraAdapter> {
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

pub(crate) fn decode(report: &mut Report, dev: &Device, quick: bool) -> Result<()> {
    const SECTION: &str = "decode";
    let (adapters, rank, ctx, bs) = (DECODE.adapters, DECODE.rank, 512, 16);
    let cfg = llama3_8b(if quick { 4 } else { 32 })?;
    let dtype = DType::BF16;
    let opts = ModelOptions::default().dtype(dtype).device(dev.clone()).lora(LoraLimits::new(
        adapters,
        rank,
        &ModuleKind::PROJECTIONS,
    )?);
    let mut model = Model::from_tensors(cfg.clone(), random_weights(&cfg, dtype, dev)?, &opts)?;
    for k in 0..adapters {
        model.write_slot(SlotId::new(k), &random_adapter(&cfg, k, rank, dtype, dev)?)?;
    }
    report.info(
        SECTION,
        "model",
        format!("Llama-3-8B shapes, {} layers, bf16, {adapters} rank-{rank} adapters, context {ctx}", cfg.num_layers),
    );
    let blocks_per_seq = ctx / bs;
    let mut kv = model.new_kv_cache(KvCacheConfig::new(64 * blocks_per_seq, bs))?;
    let mut ratio_64 = f64::NAN;
    for batch in [1usize, 16, 64] {
        let seqs = |lora: bool| -> Batch {
            Batch::new(
                (0..batch)
                    .map(|i| {
                        let table: Vec<u32> = (0..blocks_per_seq).map(|b| (i * blocks_per_seq + b) as u32).collect();
                        let slot = lora.then(|| SlotId::new(i % adapters));
                        SeqInput::new(vec![100 + i as u32], ctx - 1, table, slot)
                    })
                    .collect(),
            )
        };
        let (base, lora) = (seqs(false), seqs(true));
        let t_base = events(dev, 20, || {
            model.forward(&base, &mut kv)?;
            Ok(())
        })?;
        let t_lora = events(dev, 20, || {
            model.forward(&lora, &mut kv)?;
            Ok(())
        })?;
        let layers = cfg.num_layers;
        let base_v = report.timed(
            SECTION,
            format!("batch {batch} base step"),
            t_base,
            decode_step_bytes(layers, batch, ctx, None),
        );
        let lora_v = report.timed(
            SECTION,
            format!("batch {batch} LoRA step"),
            t_lora,
            decode_step_bytes(layers, batch, ctx, Some(DECODE)),
        );
        let ratio = t_lora.device / t_base.device;
        if batch == 64 {
            ratio_64 = ratio;
        }
        report.info(SECTION, format!("batch {batch} lora/base"), format!("{ratio:.3}"));
        if batch != 16 {
            report.key(SECTION, format!("b{batch} base {base_v}"));
            report.key(SECTION, format!("b{batch} LoRA {lora_v}; lora/base {ratio:.3}"));
        }
    }
    report.target(SECTION, "lora/base at batch 64", format!("{ratio_64:.3}"), "≤ 1.10", ratio_64 <= 1.10);
    Ok(())
}
