//! End-to-end engine throughput on the GPU, on the PEFT peer bench's model and workload (16
//! requests × 64 prompt ids × 32 greedy new tokens, EOS ignored; the base, or 2 requests on each
//! of 8 rank-16 adapters): new tokens per second of the base and the mixed batch, and the mixed
//! batch against transformers + PEFT's `adapter_names=` batch measured by `bench_peft_cuda.py` on
//! the same GPU, with the same weights and prompts, just before.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::Device;
use multilora::{DType, Engine, GenerateRequest, SamplingParams};
use serde_json::Value;

use crate::report::Report;
use crate::util::{engine_device, ids, median};

const SECTION: &str = "engine";

/// Wall seconds to serve every `(model, prompt)` at once, after checking each got 32 tokens.
fn serve(engine: &Engine, requests: &[(String, Vec<u32>)], new: usize) -> Result<f64> {
    let t = Instant::now();
    let mut streams = Vec::with_capacity(requests.len());
    for (model, prompt) in requests {
        let mut params = SamplingParams::greedy(new);
        params.ignore_eos = true;
        let params = params.validate(engine.config().vocab_size)?;
        streams.push(engine.submit(GenerateRequest::new(model.clone(), prompt.clone()).params(params))?);
    }
    for s in streams {
        let c = s.collect_blocking()?;
        anyhow::ensure!(c.token_ids.len() == new, "a request stopped after {} tokens", c.token_ids.len());
    }
    Ok(t.elapsed().as_secs_f64())
}

pub(crate) fn throughput(report: &mut Report, dev: &Device, workdir: &Path, peft: &Value) -> Result<()> {
    let prompts: Vec<Vec<u32>> = peft["prompt_ids"]
        .as_array()
        .context("the PEFT report has no prompt_ids")?
        .iter()
        .map(ids)
        .collect::<Result<_>>()?;
    let names: Vec<String> = peft["adapter_names"]
        .as_array()
        .context("the PEFT report has no adapter_names")?
        .iter()
        .map(|v| v.as_str().unwrap_or("a0").to_string())
        .collect();
    let new = peft["info"]["workload"]["new_tokens"].as_u64().unwrap_or(32) as usize;
    let tokens = (prompts.len() * new) as f64;
    for (dname, dtype) in [("f32", DType::F32), ("bf16", DType::BF16)] {
        let mut b = Engine::builder(workdir.join("base").display().to_string())
            .served_model_name("base")
            .device(engine_device(dev))
            .dtype(dtype)
            .max_loras(8)
            .max_lora_rank(16)
            .kv_cache_bytes(4 << 30);
        for k in 0..8 {
            b = b.lora(format!("a{k}"), workdir.join(format!("a{k}")).display().to_string());
        }
        let engine = b.build().context("engine on the PEFT bench model")?;
        let base: Vec<(String, Vec<u32>)> = prompts.iter().map(|p| ("base".to_string(), p.clone())).collect();
        let mixed: Vec<(String, Vec<u32>)> = prompts.iter().cloned().zip(&names).map(|(p, n)| (n.clone(), p)).collect();
        serve(&engine, &base, new)?;
        serve(&engine, &mixed, new)?;
        let (mut tb, mut tm) = (Vec::new(), Vec::new());
        // Alternating rounds, so both scenarios see the same minutes of the machine.
        for _ in 0..3 {
            tb.push(serve(&engine, &base, new)?);
            tm.push(serve(&engine, &mixed, new)?);
        }
        let (base_tps, mixed_tps) = (tokens / median(tb), tokens / median(tm));
        report.info(SECTION, format!("{dname} base"), format!("{base_tps:.0} new tokens/s"));
        report.info(
            SECTION,
            format!("{dname} 16 over 8 adapters"),
            format!("{mixed_tps:.0} new tokens/s = {:.3} of base", mixed_tps / base_tps),
        );
        let peft_base = peft["results"][dname]["base"]["new_tokens_per_s"].as_f64();
        let peft_mixed = peft["results"][dname]["mixed_8"]["new_tokens_per_s"].as_f64();
        match (peft_base, peft_mixed) {
            (Some(pb), Some(pm)) => {
                report.info(
                    SECTION,
                    format!("{dname} PEFT on this GPU"),
                    format!("base {pb:.0}, mixed {pm:.0} new tokens/s"),
                );
                report.target(
                    SECTION,
                    format!("{dname} mixed vs PEFT's mixed batch"),
                    format!("{:.2}×", mixed_tps / pm),
                    "≥ 3×",
                    mixed_tps >= 3.0 * pm,
                );
                report.key(
                    SECTION,
                    format!(
                        "{dname}: base {base_tps:.0}, 8-adapter mix {mixed_tps:.0} tok/s = {:.2}× PEFT's mix (≥ 3×)",
                        mixed_tps / pm
                    ),
                );
            }
            _ => {
                report.skipped(SECTION, &format!("no {dname} PEFT figures in the report"));
                report.key(
                    SECTION,
                    format!("{dname}: base {base_tps:.0}, 8-adapter mix {mixed_tps:.0} tok/s (no PEFT figure)"),
                );
            }
        }
    }
    Ok(())
}
