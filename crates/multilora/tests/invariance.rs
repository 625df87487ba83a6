//! Batch invariance: every greedy fixture case gives the same tokens alone and among 64 other
//! requests of 8 adapters, in f32 and on a bf16 checkpoint served in its own dtype; a prompt cut
//! into steps by a small step budget gives the tokens it gives in one step.

mod common;

use anyhow::Result;
use common::*;
use multilora::{DType, Engine, GenerateRequest, SamplingParams, ValidParams};

#[test]
fn greedy_cases_are_batch_invariant() -> Result<()> {
    let engine = builder(8).build()?;
    assert_eq!(engine.config().dtype, DType::F32);
    let agree = invariant_cases(&engine)?;
    assert_eq!(agree, 1.0, "f32 greedy tokens are the reference's");
    Ok(())
}

/// A step budget caps the tokens of a step (logged as `max_num_batched_tokens`): a 200-token prompt
/// is then served in steps of at most that many, with the tokens of one step, and a budget that
/// holds no token is refused at build.
#[test]
fn a_step_budget_cuts_prompts_and_changes_no_token() -> Result<()> {
    let prompt: Vec<u32> = (0..200).map(|i| (7 + i * 31) % 500).collect();
    let run = |engine: &Engine| -> Result<Vec<u32>> {
        let p = SamplingParams::greedy(8).validate(engine.config().vocab_size)?;
        Ok(engine.submit(GenerateRequest::new("qv_r8", prompt.clone()).params(p))?.collect_blocking()?.token_ids)
    };
    let whole = builder(2).build()?;
    let want = run(&whole)?;
    assert_eq!(whole.metrics().prefill_tokens_per_step.count, 1, "200 tokens in one step by default");
    // About what 50 tokens take (the bytes grow about linearly with the tokens).
    let (bytes, tokens) = (whole.config().step_memory_bytes, whole.config().max_num_batched_tokens as u64);
    let budget = bytes * 50 / tokens;
    let cut = builder(2).step_memory_bytes(budget).build()?;
    let cap = cut.config().max_num_batched_tokens;
    assert!((1..200).contains(&cap), "{budget} bytes cap a step's tokens: {cap}");
    assert!(cut.config().step_memory_bytes <= budget);
    assert_eq!(run(&cut)?, want, "the same tokens from a prompt in steps of {cap}");
    let steps = cut.metrics().prefill_tokens_per_step.count;
    assert!(steps >= 200usize.div_ceil(cap) as u64, "{steps} prefill steps of at most {cap} tokens for 200");
    let Err(err) = builder(2).step_memory_bytes(1).build() else { panic!("a budget of one byte holds no step") };
    assert_eq!(err.kind(), "invalid_config", "{err}");
    Ok(())
}

/// A bf16 checkpoint with no dtype asked for is served in bf16 (`auto`), and its rows are
/// batch invariant; its greedy tokens follow the f32 reference's at most positions.
#[test]
fn a_bf16_checkpoint_is_served_in_bf16_and_batch_invariant() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("base-bf16");
    bf16_checkpoint(&fixtures().join("base"), &dir)?;
    let engine = builder_at(&dir.display().to_string(), 8).build()?;
    assert_eq!(engine.config().dtype, DType::BF16, "auto serves the checkpoint's dtype");
    assert_eq!(engine.config().lora_dtype, DType::BF16, "slots in the model's dtype");
    let agree = invariant_cases(&engine)?;
    println!("bf16: greedy tokens equal to the f32 reference's at {:.1}% of positions", agree * 100.0);
    assert!(agree >= 0.9, "bf16 greedy tokens follow the reference at only {agree}");
    Ok(())
}

/// Runs every greedy case alone, then again among 64 other requests over 8 adapters, and
/// asserts the tokens are the same; returns the share of tokens equal to the f32 reference's.
fn invariant_cases(engine: &Engine) -> Result<f64> {
    let cases = cases()?;
    let mut p = SamplingParams::greedy(16);
    p.ignore_eos = true;
    let p = p.validate(engine.config().vocab_size)?;
    let gens: Vec<_> = list(&cases, "generation").iter().chain(list(&cases, "extra_generation")).collect();
    let mut alone = Vec::new();
    for g in &gens {
        let req = GenerateRequest::new(model_of(g), ids(&g["input_ids"])).params(p.clone());
        alone.push(engine.submit(req)?.collect_blocking()?.token_ids);
    }
    let names =
        ["qv_r8", "all_r16", "rslora_r4", "pattern_r8", "regex_layers", "layers_subset", "rank32", "embed_target"];
    let mut others = Vec::new();
    for i in 0..64usize {
        let prompt: Vec<u32> = (0..5 + i % 23).map(|k| ((i * 37 + k * 13) % 509 + 3) as u32).collect();
        others.push(engine.submit(GenerateRequest::new(names[i % 8], prompt).params(p.clone()))?);
    }
    let mut mixed = Vec::new();
    for g in &gens {
        mixed.push(engine.submit(GenerateRequest::new(model_of(g), ids(&g["input_ids"])).params(p.clone()))?);
    }
    let (mut same, mut total) = (0usize, 0usize);
    for (i, (stream, want)) in mixed.into_iter().zip(&alone).enumerate() {
        assert_eq!(&stream.collect_blocking()?.token_ids, want, "case {i}");
        let reference = ids(&gens[i]["output_ids"]);
        // Tokens after the first difference follow another prefix: count up to it.
        let prefix = want.iter().zip(&reference).take_while(|(a, b)| a == b).count();
        same += prefix;
        total += reference.len().min(want.len());
    }
    for o in others {
        assert_eq!(o.collect_blocking()?.token_ids.len(), 16);
    }
    Ok(same as f64 / total.max(1) as f64)
}

/// Seeded sampled requests (OpenAI's default of temperature 1 with no filters, top-k, top-p, all
/// filters with logprobs) give the same tokens alone and among 64 unseeded sampled requests of 8
/// adapters, whose rows are sampled beside theirs on the pool's threads.
#[test]
fn seeded_sampled_requests_are_batch_invariant() -> Result<()> {
    let engine = builder(8).build()?;
    let settings =
        [(1.0, 0, 1.0, 0.0, None), (0.8, 40, 1.0, 0.0, None), (0.7, 0, 0.9, 0.0, None), (0.8, 40, 0.95, 0.05, Some(3))];
    let params: Vec<ValidParams> = settings
        .iter()
        .enumerate()
        .map(|(i, &(t, k, top_p, min_p, logprobs))| {
            let mut p = SamplingParams::default();
            (p.temperature, p.top_k, p.top_p, p.min_p, p.logprobs) = (t, k, top_p, min_p, logprobs);
            (p.seed, p.max_tokens, p.ignore_eos) = (Some(100 + i as u64), Some(24), true);
            p.validate(engine.config().vocab_size)
        })
        .collect::<Result<_, _>>()?;
    let names = ["qv_r8", "all_r16", "rslora_r4", "pattern_r8"];
    let request = |i: usize, p: &ValidParams| {
        GenerateRequest::new(names[i % 4], vec![1, 450, 496, 7 + i as u32]).params(p.clone())
    };
    let mut alone = Vec::new();
    for (i, p) in params.iter().enumerate() {
        alone.push(engine.submit(request(i, p))?.collect_blocking()?);
    }
    let mut unseeded = SamplingParams::default();
    (unseeded.max_tokens, unseeded.ignore_eos) = (Some(24), true);
    let unseeded = unseeded.validate(engine.config().vocab_size)?;
    let others: Vec<_> = (0..64usize)
        .map(|i| {
            let prompt: Vec<u32> = (0..5 + i % 23).map(|k| ((i * 37 + k * 13) % 509 + 3) as u32).collect();
            engine.submit(GenerateRequest::new(names[i % 4], prompt).params(unseeded.clone()))
        })
        .collect::<Result<_, _>>()?;
    let mixed: Vec<_> =
        params.iter().enumerate().map(|(i, p)| engine.submit(request(i, p))).collect::<Result<_, _>>()?;
    for (i, (stream, want)) in mixed.into_iter().zip(&alone).enumerate() {
        let got = stream.collect_blocking()?;
        assert_eq!(got.token_ids, want.token_ids, "setting {i}");
        assert_eq!(got.logprobs, want.logprobs, "setting {i}");
    }
    for o in others {
        assert_eq!(o.collect_blocking()?.token_ids.len(), 24);
    }
    Ok(())
}
