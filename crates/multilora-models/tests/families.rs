//! The model families beside Llama, Mistral and Qwen2, against transformers + PEFT: the tiny
//! random checkpoints of `tests/fixtures/families` (README there), each with three PEFT adapters,
//! in f32 on the CPU. All of a family's cases (base and every adapter) in one mixed flat batch,
//! teacher-forced (the prompt and the reference's outputs in, the logprob of each next reference
//! token out): every logprob within 1e-4. Then greedy generation of every case in one mixed batch,
//! one prefill step and decode steps: the reference's tokens wherever its top-2 margin exceeds
//! 1e-3 (up to the first position where it does not, after which the two texts may part). A
//! family's GGUF file (written here from the checkpoint, f32 tensors under llama.cpp's names and
//! metadata keys) gives the checkpoint's logits.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, ensure};
use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use candle_core::{D, DType, Tensor};
use common::{Blocks, argmax, cache, ids, list, text};
use multilora_adapter::LoadOptions;
use multilora_models::{Batch, Model, ModelConfig, ModelOptions, ModelSource, SeqInput};
use multilora_types::{LogitsWanted, LoraLimits, SlotId};
use serde_json::Value;

/// The largest |Δ logprob| a teacher-forced position may have.
const LOGPROB_TOL: f32 = 1e-4;
/// Reference margins at or below this may flip on rounding: greedy tokens are compared up to the
/// first such position.
const MARGIN: f64 = 1e-3;

fn family(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/families").join(name)
}

/// The family's base in f32 with each of its adapters (the folders of `adapters/`) in a slot.
fn load(name: &str) -> Result<(Model, HashMap<String, SlotId>, Value)> {
    load_from(name, None)
}

/// [`load`], the base from `gguf` instead of the checkpoint when given.
fn load_from(name: &str, gguf: Option<&Path>) -> Result<(Model, HashMap<String, SlotId>, Value)> {
    let dir = family(name);
    let mut adapters: Vec<String> = std::fs::read_dir(dir.join("adapters"))?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_>>()?;
    adapters.sort();
    ensure!(adapters.len() == 3, "{name}: expected three adapters, found {adapters:?}");
    let lora = LoraLimits::new(adapters.len(), 16, &LoraLimits::default_targets())?;
    let opts = ModelOptions::default().lora(lora);
    let mut model = match gguf {
        // In f32 throughout, as the checkpoint (a GGUF file's cache and slots are f16 by default).
        Some(path) => Model::load(
            &ModelSource::parse(path.to_str().context("path")?)?,
            &opts.kv_dtype(DType::F32).lora_dtype(DType::F32),
        )?,
        None => Model::load_dir(&dir.join("base"), &opts)?,
    };
    let mut slots = HashMap::new();
    for (i, a) in adapters.iter().enumerate() {
        let load = LoadOptions::new(DType::F32).max_lora_rank(16);
        let adapter = multilora_adapter::load_dir(a, &dir.join("adapters").join(a), model.shapes(), &load)?;
        model.write_slot(SlotId::new(i), &adapter)?;
        slots.insert(a.clone(), SlotId::new(i));
    }
    let expected: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json"))?)?;
    Ok((model, slots, expected))
}

/// A case's slot: `None` for the base model.
fn slot(slots: &HashMap<String, SlotId>, case: &Value) -> Option<SlotId> {
    match text(case, "adapter") {
        "base" => None,
        a => Some(*slots.get(a).unwrap_or_else(|| panic!("fixture: unknown adapter {a:?}"))),
    }
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array().expect("fixture: a list of numbers").iter().map(|x| x.as_f64().expect("a number")).collect()
}

/// Every case teacher-forced in one mixed flat batch: the largest |Δ logprob| over all positions.
fn teacher_forced(name: &str) -> Result<f32> {
    let (model, slots, expected) = load(name)?;
    Ok(teacher_forced_logits(name, &model, &slots, &expected)?.1)
}

/// Every case of `expected` teacher-forced through `model` in one mixed flat batch: the logits of
/// every position and the largest |Δ logprob| against the reference.
fn teacher_forced_logits(
    name: &str,
    model: &Model,
    slots: &HashMap<String, SlotId>,
    expected: &Value,
) -> Result<(Tensor, f32)> {
    let cases = list(expected, "cases");
    let bs = 8;
    let inputs: Vec<Vec<u32>> = cases
        .iter()
        .map(|c| {
            let out = ids(&c["output_ids"]);
            // The last output token predicts nothing the reference gives.
            [ids(&c["prompt_ids"]), out[..out.len() - 1].to_vec()].concat()
        })
        .collect();
    let mut kv = cache(model, inputs.iter().map(|i| i.len().div_ceil(bs)).sum(), bs)?;
    let mut blocks = Blocks::default();
    let seqs = cases
        .iter()
        .zip(&inputs)
        .map(|(c, ids)| {
            SeqInput::new(ids.clone(), 0, blocks.table(ids.len(), bs), slot(slots, c))
                .with_logits(LogitsWanted::AllPrompt)
        })
        .collect();
    let logits = model.forward(&Batch::new(seqs), &mut kv)?;
    let logprobs = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, D::Minus1)?;
    let (mut at, mut worst) = (0, 0f32);
    for (c, input) in cases.iter().zip(&inputs) {
        let (prompt, out, want) = (ids(&c["prompt_ids"]), ids(&c["output_ids"]), floats(&c["logprobs"]));
        for (j, (&token, &w)) in out.iter().zip(&want).enumerate() {
            let row = at + prompt.len() - 1 + j;
            let got = logprobs.get(row)?.get(token as usize)?.to_scalar::<f32>()?;
            let d = (got - w as f32).abs();
            worst = worst.max(d);
            ensure!(d <= LOGPROB_TOL, "{name} {} position {j}: logprob {got} vs {w}", text(c, "adapter"));
        }
        at += input.len();
    }
    Ok((logits, worst))
}

/// Every case generated greedily in one mixed batch; returns how many tokens were compared.
fn greedy(name: &str) -> Result<usize> {
    let (model, slots, expected) = load(name)?;
    let cases = list(&expected, "cases");
    let bs = 8;
    let n = cases.iter().map(|c| ids(&c["output_ids"]).len()).max().context("no cases")?;
    let mut kv = cache(&model, cases.iter().map(|c| (ids(&c["prompt_ids"]).len() + n).div_ceil(bs)).sum(), bs)?;
    let mut blocks = Blocks::default();
    let tables: Vec<Vec<u32>> = cases.iter().map(|c| blocks.table(ids(&c["prompt_ids"]).len() + n, bs)).collect();
    let mut pending: Vec<(Vec<u32>, usize)> = cases.iter().map(|c| (ids(&c["prompt_ids"]), 0)).collect();
    let mut outputs: Vec<Vec<u32>> = vec![Vec::new(); cases.len()];
    for _ in 0..n {
        let seqs = cases
            .iter()
            .zip(&pending)
            .zip(&tables)
            .map(|((c, (toks, start)), table)| SeqInput::new(toks.clone(), *start, table.clone(), slot(&slots, c)))
            .collect();
        let logits = model.forward(&Batch::new(seqs), &mut kv)?;
        for (i, p) in pending.iter_mut().enumerate() {
            let next = argmax(&logits.get(i)?)?;
            outputs[i].push(next);
            *p = (vec![next], p.1 + p.0.len());
        }
    }
    let mut compared = 0;
    for (c, got) in cases.iter().zip(&outputs) {
        let (want, margins) = (ids(&c["output_ids"]), floats(&c["margins"]));
        for j in 0..want.len() {
            if margins[j] <= MARGIN {
                break;
            }
            ensure!(
                got[j] == want[j],
                "{name} {}: token {j} is {} (reference {})",
                text(c, "adapter"),
                got[j],
                want[j]
            );
            compared += 1;
        }
    }
    Ok(compared)
}

fn check(name: &str) -> Result<()> {
    let worst = teacher_forced(name)?;
    let compared = greedy(name)?;
    println!("{name}: teacher-forced max |Δ logprob| {worst:.2e}; {compared} greedy tokens equal to the reference's");
    ensure!(compared > 0, "{name}: no greedy token compared");
    Ok(())
}

#[test]
fn qwen3_with_its_adapters_follows_transformers() -> Result<()> {
    check("qwen3")
}

/// The family's checkpoint as a GGUF file in `dir`: every tensor in f32 under llama.cpp's name,
/// the hyper-parameters under `{arch}.*` as its converter writes them.
fn write_gguf(name: &str, dir: &Path) -> Result<PathBuf> {
    let base = family(name).join("base");
    let cfg = ModelConfig::from_file(&base.join("config.json"))?;
    let arch = cfg.architecture.model_type();
    let tensors = candle_core::safetensors::load(base.join("model.safetensors"), &candle_core::Device::Cpu)?;
    let gguf_name = |hf: &str| -> Option<String> {
        let fixed = [
            ("model.embed_tokens.weight", "token_embd.weight"),
            ("model.norm.weight", "output_norm.weight"),
            ("lm_head.weight", "output.weight"),
        ];
        if let Some((_, g)) = fixed.iter().find(|(h, _)| *h == hf) {
            return Some(g.to_string());
        }
        let (layer, rest) = hf.strip_prefix("model.layers.")?.split_once('.')?;
        let (module, param) = rest.rsplit_once('.')?;
        let stems = [
            ("self_attn.q_proj", "attn_q"),
            ("self_attn.k_proj", "attn_k"),
            ("self_attn.v_proj", "attn_v"),
            ("self_attn.o_proj", "attn_output"),
            ("self_attn.q_norm", "attn_q_norm"),
            ("self_attn.k_norm", "attn_k_norm"),
            ("mlp.gate_proj", "ffn_gate"),
            ("mlp.up_proj", "ffn_up"),
            ("mlp.down_proj", "ffn_down"),
            ("input_layernorm", "attn_norm"),
            ("post_attention_layernorm", "ffn_norm"),
        ];
        let (_, stem) = stems.iter().find(|(m, _)| *m == module)?;
        Some(format!("blk.{layer}.{stem}.{param}"))
    };
    let mut q = Vec::new();
    for (hf, t) in &tensors {
        // A tied head is the embedding: llama.cpp's converter writes no `output.weight`.
        if hf == "lm_head.weight" && cfg.tie_word_embeddings {
            continue;
        }
        let g = gguf_name(hf).with_context(|| format!("no GGUF name for {hf}"))?;
        q.push((g, QTensor::quantize(&t.to_dtype(DType::F32)?, GgmlDType::F32)?));
    }
    use gguf_file::Value as V;
    let k = |key: &str| format!("{arch}.{key}");
    let meta: Vec<(String, V)> = vec![
        ("general.architecture".into(), V::String(arch.into())),
        (k("block_count"), V::U32(cfg.num_layers as u32)),
        (k("embedding_length"), V::U32(cfg.hidden_size as u32)),
        (k("feed_forward_length"), V::U32(cfg.intermediate_size as u32)),
        (k("attention.head_count"), V::U32(cfg.num_heads as u32)),
        (k("attention.head_count_kv"), V::U32(cfg.num_kv_heads as u32)),
        (k("attention.key_length"), V::U32(cfg.head_dim as u32)),
        (k("attention.value_length"), V::U32(cfg.head_dim as u32)),
        (k("attention.layer_norm_rms_epsilon"), V::F32(cfg.rms_norm_eps as f32)),
        (k("rope.freq_base"), V::F32(cfg.rope_theta as f32)),
        (k("context_length"), V::U32(cfg.max_position_embeddings as u32)),
    ];
    let path = dir.join(format!("{name}.gguf"));
    let meta: Vec<(&str, &V)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let refs: Vec<(&str, &QTensor)> = q.iter().map(|(n, t)| (n.as_str(), t)).collect();
    gguf_file::write(&mut std::fs::File::create(&path)?, &meta, &refs)?;
    Ok(path)
}

/// The family's GGUF file, f32, gives the checkpoint's logits at every teacher-forced position
/// (the same weights through the GGUF reader: its names, its metadata, its tied head).
fn gguf_matches_the_checkpoint(name: &str) -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let path = write_gguf(name, tmp.path())?;
    let (model, slots, expected) = load(name)?;
    let (want, _) = teacher_forced_logits(name, &model, &slots, &expected)?;
    let (gguf, slots, expected) = load_from(name, Some(&path))?;
    assert_eq!(gguf.config().architecture, model.config().architecture);
    let (got, worst) = teacher_forced_logits(name, &gguf, &slots, &expected)?;
    let d = (got - want)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    println!(
        "{name} GGUF: max |Δ logit| against the checkpoint {d:.2e}, max |Δ logprob| against transformers {worst:.2e}"
    );
    ensure!(d <= 1e-5, "{name}: the GGUF file's logits differ from the checkpoint's by {d}");
    Ok(())
}

#[test]
fn a_qwen3_gguf_file_gives_the_checkpoints_logits() -> Result<()> {
    gguf_matches_the_checkpoint("qwen3")
}

#[test]
fn phi3_with_its_adapters_on_the_fused_modules_follows_transformers() -> Result<()> {
    check("phi3")
}

#[test]
fn gemma3_with_its_adapters_follows_transformers() -> Result<()> {
    check("gemma3")
}
