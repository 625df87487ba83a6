//! Prefix caching is per adapter generation: two adapters with the same system prompt never
//! share cached blocks, and the same adapter does (the hit counters prove it). On the CPU the KV
//! pool has `cache_ram` more room for cached prefixes, none without prefix caching.

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

/// `cache_ram_bytes` adds its bytes' worth of blocks to the CPU's default KV pool (and nothing
/// when prefix caching is off, or the pool's bytes are given).
#[test]
fn cache_ram_adds_room_for_cached_prefixes() -> Result<()> {
    let base = || Engine::builder(path("base")).served_model_name(BASE).max_lora_rank(32);
    let blocks = |b: multilora::EngineBuilder| -> Result<usize> { Ok(b.build()?.config().num_kv_blocks) };
    // Blocks in 64 MiB, from two given pools.
    let per_64 = blocks(base().kv_cache_bytes(80 << 20))? - blocks(base().kv_cache_bytes(16 << 20))?;
    let none = blocks(base().cache_ram_bytes(0))?;
    let more = blocks(base().cache_ram_bytes(64 << 20))?;
    assert!((more - none).abs_diff(per_64) <= 1, "{} blocks more for 64 MiB, {per_64} in 64 MiB", more - none);
    assert_eq!(blocks(base().cache_ram_bytes(64 << 20).enable_prefix_caching(false))?, none, "no room without caching");
    let given = blocks(base().kv_cache_bytes(16 << 20).cache_ram_bytes(64 << 20))?;
    assert_eq!(given, blocks(base().kv_cache_bytes(16 << 20))?, "kv_cache_bytes is the whole pool");
    Ok(())
}
