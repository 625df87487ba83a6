//! Llama 3 (llama3 RoPE scaling, tied embeddings), Mistral (sliding window) and Qwen2 (q/k/v bias,
//! sharded checkpoint) load from small generated checkpoints, and the paged forward (two prefill
//! chunks, then decode steps) matches a reference written here from plain tensor ops (full
//! sequence, no cache, HF `rotate_half` RoPE, the sliding window as transformers masks it).

use std::collections::HashMap;
use std::path::Path;

use anyhow::Result;
use candle_core::{D, DType, Device, Tensor};
use multilora_models::{Batch, KvCacheConfig, Model, ModelOptions, SeqInput};
use multilora_types::{LogitsWanted, LoraLimits};
use serde_json::{Value, json};

const H: usize = 64;
const I: usize = 96;
const LAYERS: usize = 2;
const HEADS: usize = 4;
const KV: usize = 2;
const HD: usize = 16;
const VOCAB: usize = 80;

fn config(model_type: &str) -> Value {
    let class = match model_type {
        "llama" => "LlamaForCausalLM",
        "mistral" => "MistralForCausalLM",
        _ => "Qwen2ForCausalLM",
    };
    json!({"architectures": [class], "model_type": model_type, "hidden_size": H, "intermediate_size": I,
           "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV,
           "vocab_size": VOCAB, "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "bos_token_id": 1,
           "eos_token_id": 2})
}

fn random_weights(cfg: &Value, seed: u64) -> Result<HashMap<String, Tensor>> {
    let dev = Device::Cpu;
    // A small LCG keeps the checkpoint independent of candle's RNG.
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut rand = |shape: &[usize], std: f32, mean: f32| -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let u = ((state >> 40) as f32) / (1u64 << 24) as f32;
                mean + std * (u * 2.0 - 1.0) * 1.7
            })
            .collect();
        Ok(Tensor::from_vec(v, shape, &dev)?)
    };
    let mut w = HashMap::new();
    let bias = cfg["model_type"] == "qwen2";
    w.insert("model.embed_tokens.weight".to_string(), rand(&[VOCAB, H], 1.0, 0.0)?);
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        for (name, out, inp) in [
            ("self_attn.q_proj", HEADS * HD, H),
            ("self_attn.k_proj", KV * HD, H),
            ("self_attn.v_proj", KV * HD, H),
            ("self_attn.o_proj", H, HEADS * HD),
            ("mlp.gate_proj", I, H),
            ("mlp.up_proj", I, H),
            ("mlp.down_proj", H, I),
        ] {
            w.insert(format!("{p}.{name}.weight"), rand(&[out, inp], 1.0 / (inp as f32).sqrt(), 0.0)?);
            if bias && ["q_proj", "k_proj", "v_proj"].iter().any(|s| name.ends_with(s)) {
                w.insert(format!("{p}.{name}.bias"), rand(&[out], 0.1, 0.0)?);
            }
        }
        w.insert(format!("{p}.input_layernorm.weight"), rand(&[H], 0.1, 1.0)?);
        w.insert(format!("{p}.post_attention_layernorm.weight"), rand(&[H], 0.1, 1.0)?);
    }
    w.insert("model.norm.weight".to_string(), rand(&[H], 0.1, 1.0)?);
    if !cfg["tie_word_embeddings"].as_bool().unwrap_or(false) {
        w.insert("lm_head.weight".to_string(), rand(&[VOCAB, H], 1.0 / (H as f32).sqrt(), 0.0)?);
    }
    Ok(w)
}

fn write_checkpoint(dir: &Path, cfg: &Value, w: &HashMap<String, Tensor>, sharded: bool) -> Result<()> {
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(cfg)?)?;
    if !sharded {
        candle_core::safetensors::save(w, dir.join("model.safetensors"))?;
        return Ok(());
    }
    let (mut a, mut b) = (HashMap::new(), HashMap::new());
    let mut map = serde_json::Map::new();
    for (k, t) in w {
        let (shard, file) = if k.contains("layers.1") || k.starts_with("lm_head") {
            (&mut b, "model-00002-of-00002.safetensors")
        } else {
            (&mut a, "model-00001-of-00002.safetensors")
        };
        shard.insert(k.clone(), t.clone());
        map.insert(k.clone(), json!(file));
    }
    candle_core::safetensors::save(&a, dir.join("model-00001-of-00002.safetensors"))?;
    candle_core::safetensors::save(&b, dir.join("model-00002-of-00002.safetensors"))?;
    std::fs::write(dir.join("model.safetensors.index.json"), json!({"metadata": {}, "weight_map": map}).to_string())?;
    Ok(())
}

/// HF's inverse frequencies, with Llama 3's scaling when the config asks for it.
fn ref_inv_freq(cfg: &Value) -> Vec<f64> {
    let theta = cfg["rope_theta"].as_f64().unwrap_or(10000.0);
    let plain: Vec<f64> = (0..HD / 2).map(|i| 1.0 / theta.powf((2 * i) as f64 / HD as f64)).collect();
    let Some(s) = cfg.get("rope_scaling").filter(|s| s["rope_type"] == "llama3") else { return plain };
    let (factor, lo, hi) = (
        s["factor"].as_f64().unwrap(),
        s["low_freq_factor"].as_f64().unwrap(),
        s["high_freq_factor"].as_f64().unwrap(),
    );
    let old = s["original_max_position_embeddings"].as_f64().unwrap();
    plain
        .into_iter()
        .map(|f| {
            let wl = 2.0 * std::f64::consts::PI / f;
            if wl < old / hi {
                f
            } else if wl > old / lo {
                f / factor
            } else {
                let smooth = (old / wl - lo) / (hi - lo);
                (1.0 - smooth) * f / factor + smooth * f
            }
        })
        .collect()
}

fn rms(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let var = x.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(x.broadcast_div(&(var + eps)?.sqrt()?)?.broadcast_mul(w)?)
}

fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    // x: [heads, seq, d]; rotate_half(x) = cat(-x2, x1).
    let half = HD / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rot = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    Ok((x.broadcast_mul(cos)? + rot.broadcast_mul(sin)?)?)
}

/// `x · Φ(x)` with Φ from erf, element by element in f64 (libm's erf, not candle's).
fn gelu_erf(x: &Tensor) -> Result<Tensor> {
    let v: Vec<f32> = x.flatten_all()?.to_vec1()?;
    let g: Vec<f32> =
        v.iter().map(|&t| (0.5 * t as f64 * (1.0 + erf(t as f64 / std::f64::consts::SQRT_2))) as f32).collect();
    Ok(Tensor::from_vec(g, x.shape(), x.device())?)
}

/// erf by its Maclaurin series, `2/√π · Σ (-1)ⁿ x^(2n+1) / (n! (2n+1))`, summed in f64 (the
/// cancellation costs at most ~1e-8 for |x| ≤ 5); beyond 5, erf is ±1 to 1.5e-12.
fn erf(x: f64) -> f64 {
    if x.abs() > 5.0 {
        return x.signum();
    }
    let (mut term, mut sum, mut n) = (x, x, 0.0f64);
    while term.abs() > 1e-17 * sum.abs().max(1e-300) {
        n += 1.0;
        term *= -x * x / n;
        sum += term / (2.0 * n + 1.0);
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

/// `0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))`.
fn gelu_tanh(x: &Tensor) -> Result<Tensor> {
    let v: Vec<f32> = x.flatten_all()?.to_vec1()?;
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let g: Vec<f32> = v
        .iter()
        .map(|&t| (0.5 * t as f64 * (1.0 + (c * (t as f64 + 0.044715 * (t as f64).powi(3))).tanh())) as f32)
        .collect();
    Ok(Tensor::from_vec(g, x.shape(), x.device())?)
}

/// The whole sequence at once, straight from the weights: logits `[seq, vocab]`.
fn reference(cfg: &Value, w: &HashMap<String, Tensor>, ids: &[u32]) -> Result<Tensor> {
    let dev = Device::Cpu;
    let n = ids.len();
    let lin = |x: &Tensor, name: &str| -> Result<Tensor> {
        let mut y = x.matmul(&w[&format!("{name}.weight")].t()?)?;
        if let Some(b) = w.get(&format!("{name}.bias")) {
            y = y.broadcast_add(b)?;
        }
        Ok(y)
    };
    let inv = ref_inv_freq(cfg);
    let ang: Vec<f32> = (0..n).flat_map(|p| inv.iter().map(move |f| (p as f64 * f) as f32)).collect();
    let ang = Tensor::from_vec(ang, (n, HD / 2), &dev)?;
    let ang = Tensor::cat(&[&ang, &ang], 1)?;
    let (cos, sin) = (ang.cos()?, ang.sin()?);
    // Query i sees key j when j <= i and, under a sliding window of w, i - j < w.
    let window = cfg["sliding_window"].as_u64().map_or(usize::MAX, |w| w as usize);
    let mask: Vec<f32> = (0..n)
        .flat_map(|i| (0..n).map(move |j| if j <= i && i - j < window { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    let mask = Tensor::from_vec(mask, (n, n), &dev)?;
    let eps = cfg["rms_norm_eps"].as_f64().unwrap_or(1e-6);
    let embed = &w["model.embed_tokens.weight"];
    let mut x = embed.index_select(&Tensor::new(ids, &dev)?, 0)?;
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        let h = rms(&x, &w[&format!("{p}.input_layernorm.weight")], eps)?;
        let heads =
            |t: Tensor, nh: usize| -> Result<Tensor> { Ok(t.reshape((n, nh, HD))?.transpose(0, 1)?.contiguous()?) };
        let q = rotate(&heads(lin(&h, &format!("{p}.self_attn.q_proj"))?, HEADS)?, &cos, &sin)?;
        let k = rotate(&heads(lin(&h, &format!("{p}.self_attn.k_proj"))?, KV)?, &cos, &sin)?;
        let v = heads(lin(&h, &format!("{p}.self_attn.v_proj"))?, KV)?;
        let mut outs = Vec::new();
        for hh in 0..HEADS {
            let kv = hh / (HEADS / KV);
            let s = (q.get(hh)?.matmul(&k.get(kv)?.t()?)? / (HD as f64).sqrt())?.broadcast_add(&mask)?;
            let pr = candle_nn::ops::softmax_last_dim(&s)?;
            outs.push(pr.matmul(&v.get(kv)?)?);
        }
        let attn = Tensor::stack(&outs, 0)?.transpose(0, 1)?.reshape((n, HEADS * HD))?;
        x = (x + lin(&attn, &format!("{p}.self_attn.o_proj"))?)?;
        let h = rms(&x, &w[&format!("{p}.post_attention_layernorm.weight")], eps)?;
        let gate = lin(&h, &format!("{p}.mlp.gate_proj"))?;
        // transformers' ACT2FN: `gelu` is erf GELU, `gelu_pytorch_tanh` its tanh approximation.
        let gate = match cfg["hidden_act"].as_str().unwrap_or("silu") {
            "gelu" => gelu_erf(&gate)?,
            "gelu_pytorch_tanh" => gelu_tanh(&gate)?,
            _ => candle_nn::ops::silu(&gate)?,
        };
        let act = (gate * lin(&h, &format!("{p}.mlp.up_proj"))?)?;
        x = (x + lin(&act, &format!("{p}.mlp.down_proj"))?)?;
    }
    let x = rms(&x, &w["model.norm.weight"], eps)?;
    let head = w.get("lm_head.weight").unwrap_or(embed);
    Ok(x.matmul(&head.t()?)?)
}

fn check(cfg: Value, sharded: bool) -> Result<Model> {
    let dir = tempfile::tempdir()?;
    let w = random_weights(&cfg, 7)?;
    write_checkpoint(dir.path(), &cfg, &w, sharded)?;
    let model = Model::load_dir(
        dir.path(),
        &ModelOptions::default().lora(LoraLimits::new(2, 8, &LoraLimits::default_targets())?),
    )?;
    let ids: Vec<u32> = (0..37).map(|i| (i * 7 + 3) % VOCAB as u32).collect();
    let want = reference(&cfg, &w, &ids)?;
    // Paged: a 20-token prefill chunk, then the rest as a second chunk, in blocks of 8.
    let mut kv = model.new_kv_cache(KvCacheConfig::new(8, 8))?;
    let table: Vec<u32> = vec![5, 1, 7, 0, 2];
    let a = model.forward(
        &Batch::new(vec![
            SeqInput::new(ids[..20].to_vec(), 0, table.clone(), None).with_logits(LogitsWanted::AllPrompt),
        ]),
        &mut kv,
    )?;
    let b = model.forward(
        &Batch::new(vec![
            SeqInput::new(ids[20..34].to_vec(), 20, table.clone(), None).with_logits(LogitsWanted::AllPrompt),
        ]),
        &mut kv,
    )?;
    // Then one token at a time (the decode path).
    let mut parts = vec![a, b];
    for (p, &id) in ids.iter().enumerate().skip(34) {
        let seq = SeqInput::new(vec![id], p, table.clone(), None).with_logits(LogitsWanted::Last);
        parts.push(model.forward(&Batch::new(vec![seq]), &mut kv)?);
    }
    let got = Tensor::cat(&parts, 0)?;
    let d = (got - &want)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    println!("{}: max abs diff vs tensor-op reference {d}", cfg["model_type"]);
    assert!(d < 1e-4, "{}: {d}", cfg["model_type"]);
    Ok(model)
}

#[test]
fn llama3_with_rope_scaling_and_tied_embeddings() -> Result<()> {
    let mut cfg = config("llama");
    cfg["tie_word_embeddings"] = json!(true);
    cfg["rope_theta"] = json!(500000.0);
    // A small original context makes every band of the llama3 scaling (kept, smoothed, divided) occur.
    cfg["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
    let model = check(cfg, false)?;
    assert!(model.config().tie_word_embeddings);
    assert_eq!(model.shapes().architecture, "LlamaForCausalLM");
    Ok(())
}

/// A window of 8 under a 37-token sequence: every prefill row and decode step past the window
/// matches the windowed reference, and a context beyond the window is served.
#[test]
fn mistral_attends_within_its_sliding_window() -> Result<()> {
    let mut cfg = config("mistral");
    cfg["sliding_window"] = json!(8);
    let model = check(cfg.clone(), false)?;
    assert_eq!(model.config().sliding_window, Some(8));
    assert_eq!(model.config().max_model_len(), 256, "the window is not a context cap");
    // The window changes the result: without it the same weights give other logits.
    let w = random_weights(&cfg, 7)?;
    let ids: Vec<u32> = (0..37).map(|i| (i * 7 + 3) % VOCAB as u32).collect();
    let mut open = cfg.clone();
    open["sliding_window"] = Value::Null;
    let d = (reference(&cfg, &w, &ids)? - reference(&open, &w, &ids)?)?.abs()?.max_keepdim(1)?;
    let d = d.flatten_all()?.to_vec1::<f32>()?;
    assert!(d[..8].iter().all(|&x| x == 0.0), "inside the window nothing changes");
    assert!(d[8..].iter().all(|&x| x > 1e-3), "past the window every row changes: {d:?}");
    Ok(())
}

#[test]
fn gelu_activations_match_their_definitions() -> Result<()> {
    for act in ["gelu", "gelu_pytorch_tanh"] {
        let mut cfg = config("llama");
        cfg["hidden_act"] = json!(act);
        check(cfg, false)?;
    }
    Ok(())
}

#[test]
fn qwen2_with_qkv_bias_from_shards() -> Result<()> {
    let model = check(config("qwen2"), true)?;
    assert!(model.config().attention_bias);
    assert_eq!(model.shapes().model_type, "qwen2");
    Ok(())
}

#[test]
fn missing_tensor_and_wrong_shape_are_named() -> Result<()> {
    let cfg = config("llama");
    let dir = tempfile::tempdir()?;
    let mut w = random_weights(&cfg, 3)?;
    w.remove("model.layers.1.mlp.up_proj.weight");
    write_checkpoint(dir.path(), &cfg, &w, false)?;
    let err = Model::load_dir(dir.path(), &ModelOptions::default()).unwrap_err();
    assert_eq!(err.kind(), "tensor_missing");
    assert!(err.to_string().contains("model.layers.1.mlp.up_proj.weight"), "{err}");
    w.insert("model.layers.1.mlp.up_proj.weight".into(), Tensor::zeros((I, H + 1), DType::F32, &Device::Cpu)?);
    write_checkpoint(dir.path(), &cfg, &w, false)?;
    let err = Model::load_dir(dir.path(), &ModelOptions::default()).unwrap_err();
    assert_eq!(err.kind(), "shape_mismatch");
    assert!(err.to_string().contains("up_proj") && err.to_string().contains("65"), "{err}");
    let mut bad = cfg.clone();
    bad["model_type"] = json!("gemma");
    bad["architectures"] = json!(["GemmaForCausalLM"]);
    std::fs::write(dir.path().join("config.json"), bad.to_string())?;
    let err = Model::load_dir(dir.path(), &ModelOptions::default()).unwrap_err();
    assert_eq!(err.kind(), "unsupported_architecture");
    assert!(err.to_string().contains("gemma"), "{err}");
    Ok(())
}
