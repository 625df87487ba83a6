//! Batch invariance: every greedy fixture case gives the same tokens alone and among 64 other
//! requests of 8 adapters.

mod common;

use anyhow::Result;
use common::*;
use multilora::{GenerateRequest, SamplingParams};

#[test]
fn greedy_cases_are_batch_invariant() -> Result<()> {
    let engine = builder(8).build()?;
    let cases = cases()?;
    let mut p = SamplingParams::greedy(16);
    p.ignore_eos = true;
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
    for (i, (stream, want)) in mixed.into_iter().zip(&alone).enumerate() {
        assert_eq!(&stream.collect_blocking()?.token_ids, want, "case {i}");
        assert_eq!(want, &ids(&gens[i]["output_ids"]), "case {i} against the reference");
    }
    for o in others {
        assert_eq!(o.collect_blocking()?.token_ids.len(), 16);
    }
    Ok(())
}
