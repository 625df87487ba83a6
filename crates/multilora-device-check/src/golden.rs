//! The PEFT fixtures through the whole engine on the GPU: every fixture row's prompt logprobs
//! against transformers + PEFT (log-softmax of the stored logits), and the greedy cases token for
//! token, in f32 (cuBLAS with TF32 off, candle's default); then bf16 against the same reference.

use std::path::Path;

use anyhow::{Context, Result};
use candle_core::Device;
use multilora::{DType, Engine, GenerateRequest, SamplingParams};
use serde_json::Value;

use crate::report::Report;
use crate::util::{cases, engine_device, ids};

const SECTION: &str = "golden";

fn log_softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + row.iter().map(|x| ((x - max) as f64).exp()).sum::<f64>().ln() as f32;
    row.iter().map(|x| x - lse).collect()
}

/// Every adapter the fixture's rows use: the valid ones, and the two the engine accepts from
/// `invalid_adapters/` (LoRA on `embed_tokens`, and `bias: "all"` without bias tensors).
fn adapters(cases: &Value) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = cases["adapters"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(name, _)| (name.clone(), format!("adapters/{name}")))
        .collect();
    for section in ["optional_adapters", "either_adapters"] {
        for (name, v) in cases[section].as_object().into_iter().flatten() {
            if let Some(path) = v["path"].as_str() {
                out.push((name.clone(), path.to_string()));
            }
        }
    }
    out
}

/// `(worst prompt-logprob error, greedy cases equal, greedy cases)`.
fn run(fixtures: &Path, dev: &Device, dtype: DType) -> Result<(f32, usize, usize)> {
    let cases = cases(fixtures)?;
    let mut b = Engine::builder(fixtures.join("base").display().to_string())
        .served_model_name("base")
        .device(engine_device(dev))
        .dtype(dtype)
        .max_loras(9)
        .max_lora_rank(32)
        .kv_cache_bytes(64 << 20);
    for (name, path) in adapters(&cases) {
        b = b.lora(name, fixtures.join(path).display().to_string());
    }
    let engine = b.build().context("engine on the fixture model")?;
    let mut pending = Vec::new();
    for list in ["batches", "extra_batches"] {
        for batch in cases[list].as_array().into_iter().flatten() {
            let file = fixtures.join(batch["expected"].as_str().context("a batch without expected")?);
            let tensors = candle_core::safetensors::load(&file, &Device::Cpu)?;
            for row in batch["rows"].as_array().into_iter().flatten() {
                let ids = ids(&row["input_ids"])?;
                let tensor = row["tensor"].as_str().context("a row without tensor")?;
                let logits: Vec<Vec<f32>> = tensors.get(tensor).context("missing expected tensor")?.to_vec2()?;
                let model = row["adapter"].as_str().unwrap_or("base").to_string();
                let mut params = SamplingParams::greedy(1);
                params.prompt_logprobs = Some(0);
                let params = params.validate(engine.config().vocab_size)?;
                let stream = engine.submit(GenerateRequest::new(model, ids.clone()).params(params))?;
                pending.push((stream, ids, logits));
            }
        }
    }
    let mut worst = 0f32;
    for (stream, ids, logits) in pending {
        let c = stream.collect_blocking()?;
        let lps = c.prompt_logprobs.context("no prompt logprobs came back")?;
        for t in 1..ids.len() {
            let want = log_softmax(&logits[t - 1]);
            let got = lps[t].as_ref().context("a prompt position without a logprob")?.logprob;
            worst = worst.max((got - want[ids[t] as usize]).abs());
        }
    }
    let (mut equal, mut total) = (0, 0);
    let mut gens = Vec::new();
    for list in ["generation", "extra_generation"] {
        for g in cases[list].as_array().into_iter().flatten() {
            let model = g["adapter"].as_str().unwrap_or("base").to_string();
            let n = g["max_new_tokens"].as_u64().unwrap_or(16) as usize;
            let mut params = SamplingParams::greedy(n);
            params.ignore_eos = true;
            let params = params.validate(engine.config().vocab_size)?;
            let stream = engine.submit(GenerateRequest::new(model, ids(&g["input_ids"])?).params(params))?;
            gens.push((stream, ids(&g["output_ids"])?));
        }
    }
    for (stream, want) in gens {
        total += 1;
        if stream.collect_blocking()?.token_ids == want {
            equal += 1;
        }
    }
    Ok((worst, equal, total))
}

pub(crate) fn check(report: &mut Report, fixtures: &Path, dev: &Device) -> Result<()> {
    let (worst, equal, total) = run(fixtures, dev, DType::F32)?;
    report.check(SECTION, "f32 prompt logprobs vs PEFT (max abs)", format!("{worst:.2e}"), "≤ 1e-4", worst <= 1e-4);
    report.check(SECTION, "f32 greedy cases equal", format!("{equal}/{total}"), "all", equal == total);
    report.key(SECTION, format!("f32: logprobs vs PEFT {worst:.1e} (≤ 1e-4), greedy {equal}/{total} equal"));
    let (worst, equal, total) = run(fixtures, dev, DType::BF16)?;
    report.check(SECTION, "bf16 prompt logprobs vs PEFT f32 (max abs)", format!("{worst:.3}"), "≤ 0.1", worst <= 0.1);
    report.info(SECTION, "bf16 greedy cases equal to f32 PEFT", format!("{equal}/{total}"));
    report.key(SECTION, format!("bf16: logprobs vs PEFT f32 {worst:.3} (≤ 0.1), greedy {equal}/{total} equal"));
    Ok(())
}
