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
use common::{Blocks, argmax, cache, ids, list, max_abs_diff, text};
use multilora_adapter::LoadOptions;
use multilora_models::{Batch, KvCacheConfig, Model, ModelConfig, ModelOptions, ModelSource, SeqInput};
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
    load_from(name, None, false)
}

/// [`load`], the base from `gguf` instead of the checkpoint when given, its quantized weights
/// kept quantized when `quantized` (then with the f16 cache and slots of a quantized file).
fn load_from(name: &str, gguf: Option<&Path>, quantized: bool) -> Result<(Model, HashMap<String, SlotId>, Value)> {
    let dir = family(name);
    let mut adapters: Vec<String> = std::fs::read_dir(dir.join("adapters"))?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_>>()?;
    adapters.sort();
    ensure!(adapters.len() == 3, "{name}: expected three adapters, found {adapters:?}");
    let lora = LoraLimits::new(adapters.len(), 16, &LoraLimits::default_targets())?;
    let opts = ModelOptions::default().lora(lora);
    let lora_dtype = if quantized { DType::F16 } else { DType::F32 };
    let mut model = match gguf {
        Some(path) => {
            let source = ModelSource::parse(path.to_str().context("path")?)?;
            match quantized {
                true => Model::load(&source, &opts.quantized(true))?,
                // In f32 throughout, as the checkpoint (a GGUF file's cache and slots are f16 by
                // default).
                false => Model::load(&source, &opts.kv_dtype(DType::F32).lora_dtype(DType::F32))?,
            }
        }
        None => Model::load_dir(&dir.join("base"), &opts)?,
    };
    let mut slots = HashMap::new();
    for (i, a) in adapters.iter().enumerate() {
        let load = LoadOptions::new(lora_dtype).max_lora_rank(16);
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
    let (logits, worst) = teacher_forced_logits_unchecked(model, slots, expected)?;
    ensure!(worst <= LOGPROB_TOL, "{name}: a teacher-forced logprob is {worst} from the reference's");
    Ok((logits, worst))
}

/// [`teacher_forced_logits`] without the tolerance: the logits and the largest |Δ logprob|.
fn teacher_forced_logits_unchecked(
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
            worst = worst.max((got - w as f32).abs());
        }
        at += input.len();
    }
    Ok((logits, worst))
}

/// How [`greedy`] feeds the cases: each prompt in chunks of at most `chunk` tokens, and with
/// `ring`, the sliding layers in a pool of their own where each case's sliding blocks are a ring of
/// `ring` blocks, reused as the window moves past them; its table holds `u32::MAX` (out of every
/// pool) for the blocks behind the window, so a read of one would fail the step.
#[derive(Clone, Copy)]
struct Feed {
    chunk: usize,
    ring: Option<usize>,
}

const WHOLE_PROMPTS: Feed = Feed { chunk: usize::MAX, ring: None };

/// Every case generated greedily in one mixed batch, fed as `feed` says; returns how many tokens
/// were compared.
fn greedy(name: &str, feed: Feed) -> Result<usize> {
    let (model, slots, expected) = load(name)?;
    let cases = list(&expected, "cases");
    let bs = 4;
    let n = cases.iter().map(|c| ids(&c["output_ids"]).len()).max().context("no cases")?;
    let prompts: Vec<Vec<u32>> = cases.iter().map(|c| ids(&c["prompt_ids"])).collect();
    let total_blocks = prompts.iter().map(|p| (p.len() + n).div_ceil(bs)).sum();
    let mut kv = match feed.ring {
        Some(ring) => {
            model.new_kv_cache(KvCacheConfig::new(total_blocks, bs).with_sliding_blocks(cases.len() * ring))?
        }
        None => cache(&model, total_blocks, bs)?,
    };
    let window = model.config().sliding_window.unwrap_or(usize::MAX);
    let mut blocks = Blocks::default();
    let tables: Vec<Vec<u32>> = prompts.iter().map(|p| blocks.table(p.len() + n, bs)).collect();
    let mut computed = vec![0usize; cases.len()];
    let mut outputs: Vec<Vec<u32>> = vec![Vec::new(); cases.len()];
    while outputs.iter().any(|o| o.len() < n) {
        let mut seqs = Vec::new();
        let mut fed = Vec::new();
        for (i, c) in cases.iter().enumerate() {
            let (start, prompt) = (computed[i], &prompts[i]);
            if outputs[i].len() == n {
                continue;
            }
            let toks = match outputs[i].last() {
                Some(&t) => vec![t],
                None => prompt[start..prompt.len().min(start.saturating_add(feed.chunk))].to_vec(),
            };
            let last = outputs[i].last().is_some() || start + toks.len() == prompt.len();
            let mut seq = SeqInput::new(toks.clone(), start, tables[i].clone(), slot(&slots, c)).with_logits(if last {
                LogitsWanted::Last
            } else {
                LogitsWanted::None
            });
            if let Some(ring) = feed.ring {
                let first = (start + 1).saturating_sub(window) / bs;
                let sliding = (0..tables[i].len())
                    .map(|b| if b < first { u32::MAX } else { (i * ring + b % ring) as u32 })
                    .collect();
                seq = seq.with_sliding_table(sliding);
            }
            seqs.push(seq);
            fed.push((i, toks.len(), last));
        }
        let logits = model.forward(&Batch::new(seqs), &mut kv)?;
        let mut row = 0;
        for (i, len, last) in fed {
            computed[i] += len;
            if last {
                outputs[i].push(argmax(&logits.get(row)?)?);
                row += 1;
            }
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
    let compared = greedy(name, WHOLE_PROMPTS)?;
    println!("{name}: teacher-forced max |Δ logprob| {worst:.2e}; {compared} greedy tokens equal to the reference's");
    ensure!(compared > 0, "{name}: no greedy token compared");
    Ok(())
}

#[test]
fn qwen3_with_its_adapters_follows_transformers() -> Result<()> {
    check("qwen3")
}

/// The family's checkpoint as a GGUF file in `dir`: every tensor in f32 (the projections in
/// `projections`) under llama.cpp's name, the hyper-parameters under `{arch}.*` as its converter
/// writes them.
fn write_gguf(name: &str, dir: &Path, projections: GgmlDType) -> Result<PathBuf> {
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
            ("self_attn.qkv_proj", "attn_qkv"),
            ("mlp.gate_up_proj", "ffn_up"),
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
        let ty = if t.rank() == 2 && hf.contains("_proj") { projections } else { GgmlDType::F32 };
        q.push((g, QTensor::quantize(&t.to_dtype(DType::F32)?, ty)?));
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
    let path = write_gguf(name, tmp.path(), GgmlDType::F32)?;
    let (model, slots, expected) = load(name)?;
    let (want, _) = teacher_forced_logits(name, &model, &slots, &expected)?;
    let (gguf, slots, expected) = load_from(name, Some(&path), false)?;
    assert_eq!(gguf.config().architecture, model.config().architecture);
    let (got, worst) = teacher_forced_logits(name, &gguf, &slots, &expected)?;
    let d = max_abs_diff(&got, &want)?;
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

/// Tiny Gemma 3's sliding layers keep only their window: prompts of up to five windows (8
/// tokens) fed in chunks of 4 and 16 tokens decoded, each case's sliding blocks a ring of 4
/// (the window behind a chunk and the chunk) in a pool of their own, the blocks behind the window
/// out of every pool: the reference's greedy tokens still.
#[test]
fn gemma3_sliding_layers_need_only_their_window() -> Result<()> {
    let compared = greedy("gemma3", Feed { chunk: 4, ring: Some(4) })?;
    println!("gemma3, sliding blocks in rings of 4: {compared} greedy tokens equal to the reference's");
    ensure!(compared > 0, "no greedy token compared");
    Ok(())
}

#[test]
fn a_phi3_gguf_file_gives_the_checkpoints_logits() -> Result<()> {
    gguf_matches_the_checkpoint("phi3")
}

/// A Phi-3 GGUF file with Q8_0 projections, its fused `attn_qkv` and `ffn_up` kept quantized and
/// cut into their parts by rows (each row is whole blocks), gives the logits of the same file
/// dequantized to f32 (the reference path), within the activations' 8-bit rounding.
#[test]
fn a_quantized_phi3_gguf_file_keeps_its_fused_parts_quantized() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let path = write_gguf("phi3", tmp.path(), GgmlDType::Q8_0)?;
    let (reference, slots, expected) = load_from("phi3", Some(&path), false)?;
    let (want, _) = teacher_forced_logits_unchecked(&reference, &slots, &expected)?;
    let (quantized, slots, expected) = load_from("phi3", Some(&path), true)?;
    ensure!(quantized.kernels().contains("Q8_0"), "not kept quantized: {}", quantized.kernels());
    let (got, _) = teacher_forced_logits_unchecked(&quantized, &slots, &expected)?;
    let d = max_abs_diff(&got, &want)?;
    println!("phi3 Q8_0 kept quantized: max |Δ logit| against the file dequantized {d:.2e}");
    ensure!(d <= 0.05, "the quantized path's logits differ by {d}");
    Ok(())
}

/// The tiny Phi-3 with LongRoPE (original context 16; short factors 1, long factors 4, a scale
/// of 1): a sequence within 16 tokens gives exactly the plain checkpoint's logits (its short
/// factors are plain RoPE); one past 16 reads the long factors and gives other logits; and each
/// sequence's factors are its own, whatever shares its step.
#[test]
fn phi3_longrope_picks_its_factors_per_sequence() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let base = family("phi3").join("base");
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(base.join(f), tmp.path().join(f))?;
    }
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(base.join("config.json"))?)?;
    cfg["original_max_position_embeddings"] = 16.into();
    cfg["rope_parameters"] = serde_json::json!({"rope_type": "longrope", "rope_theta": 10000.0,
        "short_factor": vec![1.0; 16], "long_factor": vec![4.0; 16], "attention_factor": 1.0});
    std::fs::write(tmp.path().join("config.json"), cfg.to_string())?;
    let opts = ModelOptions::default();
    let (plain, long) = (Model::load_dir(&base, &opts)?, Model::load_dir(tmp.path(), &opts)?);
    let short_ids: Vec<u32> = (3..15).collect();
    let long_ids: Vec<u32> = (3..40).collect();
    let run = |m: &Model, seqs: &[&[u32]]| -> Result<Tensor> {
        let mut kv = cache(m, 16, 4)?;
        let mut blocks = Blocks::default();
        let seqs = seqs.iter().map(|ids| SeqInput::new(ids.to_vec(), 0, blocks.table(ids.len(), 4), None)).collect();
        Ok(m.forward(&Batch::new(seqs), &mut kv)?)
    };
    let diff = max_abs_diff;
    ensure!(
        diff(&run(&long, &[&short_ids])?, &run(&plain, &[&short_ids])?)? == 0.0,
        "short factors of 1 are plain RoPE"
    );
    let alone = run(&long, &[&long_ids])?;
    ensure!(diff(&alone, &run(&plain, &[&long_ids])?)? > 1e-3, "past 16 tokens the long factors apply");
    let both = run(&long, &[&short_ids, &long_ids])?;
    ensure!(diff(&both.get(0)?, &run(&plain, &[&short_ids])?.get(0)?)? == 0.0, "the short sequence beside a long one");
    ensure!(diff(&both.get(1)?, &alone.get(0)?)? <= 1e-5, "the long sequence beside a short one");
    Ok(())
}
