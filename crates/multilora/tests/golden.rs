//! End-to-end golden tests through the public API on the PEFT fixtures: every `cases.json` row
//! submitted at once with mixed adapters (prompt logprobs against the log-softmax of the
//! reference logits), and every greedy reference reproduced exactly, with 8 slots and with 2.

mod common;

use anyhow::{Result, ensure};
use common::*;
use multilora::{Engine, GenerateRequest, RequestStream, SamplingParams};
use serde_json::Value;

const TOL: f32 = 1e-4;

fn log_softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
    row.iter().map(|&x| (x as f64 - lse) as f32).collect()
}

/// A prompt-logprob check and its reference: the expected logits `[len, vocab]`.
struct RowCheck {
    label: String,
    ids: Vec<u32>,
    expected: Vec<Vec<f32>>,
    stream: RequestStream,
}

struct GenCheck {
    label: String,
    output: Vec<u32>,
    stream: RequestStream,
}

/// Submits every row of `batches` and every case of `generation`, all before collecting any.
fn submit_all(engine: &Engine, batches: &Value, generation: &Value) -> Result<(Vec<RowCheck>, Vec<GenCheck>)> {
    let mut rows = Vec::new();
    for b in batches.as_array().unwrap_or_else(|| panic!("fixture: batches is not a list: {batches}")) {
        let file = fixtures().join(b["expected"].as_str().expect("fixture: a batch without \"expected\""));
        for r in list(b, "rows") {
            let tensor = r["tensor"].as_str().expect("fixture: a row without \"tensor\"");
            let expected = f32_rows(&file, tensor)?;
            let ids = ids(&r["input_ids"]);
            let mut params = SamplingParams::greedy(1);
            params.prompt_logprobs = Some(0);
            let stream = engine.submit(
                GenerateRequest::new(model_of(r), ids.clone()).params(params.validate(engine.config().vocab_size)?),
            )?;
            rows.push(RowCheck { label: format!("{} {tensor}", b["name"]), ids, expected, stream });
        }
    }
    let mut gens = Vec::new();
    for (i, g) in
        generation.as_array().unwrap_or_else(|| panic!("fixture: not a list: {generation}")).iter().enumerate()
    {
        let mut params = SamplingParams::greedy(16);
        params.ignore_eos = true;
        let stream = engine.submit(
            GenerateRequest::new(model_of(g), ids(&g["input_ids"]))
                .params(params.validate(engine.config().vocab_size)?),
        )?;
        gens.push(GenCheck {
            label: format!("generation {i} ({})", g["adapter"]),
            output: ids(&g["output_ids"]),
            stream,
        });
    }
    Ok((rows, gens))
}

/// Collects and checks; returns the largest prompt-logprob error.
fn check(rows: Vec<RowCheck>, gens: Vec<GenCheck>) -> Result<f32> {
    let mut max_err = 0f32;
    for r in rows {
        let c = r.stream.collect_blocking()?;
        let lps = c.prompt_logprobs.ok_or_else(|| anyhow::anyhow!("{}: no prompt logprobs", r.label))?;
        ensure!(lps.len() == r.ids.len() && lps[0].is_none(), "{}: {} entries", r.label, lps.len());
        for (t, entry) in lps.iter().enumerate().skip(1) {
            let got = entry.as_ref().ok_or_else(|| anyhow::anyhow!("{}: position {t} missing", r.label))?;
            ensure!(got.token == r.ids[t] && got.top_logprobs.is_empty(), "{}: position {t}: {got:?}", r.label);
            let want = log_softmax(&r.expected[t - 1])[r.ids[t] as usize];
            let err = (got.logprob - want).abs();
            ensure!(err <= TOL, "{}: position {t}: logprob {} vs {want}", r.label, got.logprob);
            max_err = max_err.max(err);
        }
    }
    for g in gens {
        let c = g.stream.collect_blocking()?;
        ensure!(c.token_ids == g.output, "{}: got {:?}, want {:?}", g.label, c.token_ids, g.output);
    }
    Ok(max_err)
}

/// Runs both submissions; returns the largest error and the most deferred requests seen.
fn run(max_loras: usize) -> Result<(f32, usize)> {
    run_on(builder(max_loras).build()?, max_loras)
}

/// [`run`] on `engine`.
fn run_on(engine: Engine, max_loras: usize) -> Result<(f32, usize)> {
    let cases = cases()?;
    let (rows, gens) = submit_all(&engine, &cases["batches"], &cases["generation"])?;
    let mut err = check(rows, gens)?;
    let (rows, gens) = submit_all(&engine, &cases["extra_batches"], &cases["extra_generation"])?;
    err = err.max(check(rows, gens)?);
    let m = wait_for(&engine, |m| m.running == 0);
    assert_idle(&m);
    println!("max_loras {max_loras}: max prompt-logprob error {err:e}, most deferred {}", m.deferred_max);
    Ok((err, m.deferred_max))
}

#[test]
fn all_rows_at_once_with_eight_slots_match_peft() -> Result<()> {
    let (err, _) = run(8)?;
    assert!(err <= TOL);
    Ok(())
}

#[test]
fn two_slots_give_the_same_outputs_and_defer_requests() -> Result<()> {
    let (err, deferred_max) = run(2)?;
    assert!(err <= TOL);
    assert!(deferred_max > 0, "with 9 adapters and 2 slots some requests must wait");
    Ok(())
}

/// Steps of 5 tokens: every prompt is computed in chunks, a prompt-logprobs row's logits
/// chunk by chunk (as a large vocabulary's logits budget cuts them), and every prompt logprob and
/// greedy token is still PEFT's.
#[test]
fn prompts_in_chunks_of_five_give_the_same_outputs() -> Result<()> {
    let (err, _) = run_on(builder(8).max_num_batched_tokens(5).build()?, 8)?;
    assert!(err <= TOL);
    Ok(())
}
