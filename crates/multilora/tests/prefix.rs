//! Prefix caching is per adapter generation: two adapters with the same system prompt never
//! share cached blocks, and the same adapter does (the hit counters prove it).

mod common;

use anyhow::Result;
use common::*;
use multilora::{Engine, GenerateRequest, SamplingParams};

fn hits(engine: &Engine, model: &str, prompt: &[u32]) -> Result<u64> {
    let before = engine.metrics().prefix_cache_hit_tokens;
    engine
        .submit(
            GenerateRequest::new(model, prompt.to_vec())
                .params(SamplingParams::greedy(2).validate(engine.config().vocab_size)?),
        )?
        .collect_blocking()?;
    Ok(engine.metrics().prefix_cache_hit_tokens - before)
}

#[test]
fn adapters_never_share_blocks_and_the_same_adapter_does() -> Result<()> {
    let engine = builder(4).build()?;
    let system: Vec<u32> = (0..48).map(|i| (11 + i * 17) % 512).collect();
    let with = |tail: u32| system.iter().copied().chain([tail, tail + 1]).collect::<Vec<u32>>();
    assert_eq!(hits(&engine, "qv_r8", &with(100))?, 0, "cold cache");
    assert_eq!(hits(&engine, "all_r16", &with(101))?, 0, "another adapter must not hit qv_r8's blocks");
    assert_eq!(hits(&engine, BASE, &with(102))?, 0, "nor the base model");
    assert_eq!(hits(&engine, "qv_r8", &with(103))?, 48, "the same adapter reuses all 3 full blocks");
    assert_eq!(hits(&engine, "all_r16", &with(104))?, 48);
    Ok(())
}
