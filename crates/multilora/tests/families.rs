//! Tiny Gemma 3 (`tests/fixtures/families/gemma3`: a sliding window of 8 tokens, every sixth
//! layer full) served by the engine with its three PEFT adapters, all cases at once: its sliding
//! layers in a KV pool of their own whose blocks behind the window are freed as requests advance,
//! prompts fed in chunks of 16 tokens over blocks of 4, then every case again, hitting the prefix
//! cache (the full layers' blocks and the sliding layers' last window). Both rounds give every
//! greedy token of transformers + PEFT wherever the reference's top-2 margin exceeds 1e-3.

mod common;

use std::path::PathBuf;

use anyhow::{Result, ensure};
use common::{assert_idle, ids, list, wait_for};
use multilora::{Engine, GenerateRequest, SamplingParams};
use serde_json::Value;

/// Reference margins at or below this may flip on rounding.
const MARGIN: f64 = 1e-3;

fn gemma3() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/families/gemma3")
}

#[test]
fn gemma3_served_with_a_sliding_pool_follows_transformers() -> Result<()> {
    let dir = gemma3();
    let expected: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json"))?)?;
    let mut builder = Engine::builder(dir.join("base").display().to_string())
        .served_model_name("base")
        .max_loras(3)
        .max_lora_rank(16)
        .block_size(4)
        .max_num_batched_tokens(16)
        .kv_cache_bytes(64 << 20);
    for a in ["all_r16", "qv_r8", "rs_r4"] {
        builder = builder.lora(a, dir.join("adapters").join(a).display().to_string());
    }
    let engine = builder.build()?;
    let cfg = engine.config();
    let sliding = cfg.sliding_kv_blocks.expect("the sliding layers in a pool of their own");
    // 256 sequences × (an 8-token window over blocks of 4, + 2) + a 16-token step: 1028 blocks;
    // the full layer (1 of 4) takes the rest of the budget.
    ensure!(sliding == 1028 && cfg.num_kv_blocks > 4 * sliding, "{sliding} sliding, {} full", cfg.num_kv_blocks);
    let cases = list(&expected, "cases");
    for round in ["cold", "cached"] {
        let mut streams = Vec::new();
        for c in cases {
            let mut params = SamplingParams::greedy(16);
            params.ignore_eos = true;
            let model = c["adapter"].as_str().expect("fixture: an adapter name");
            streams.push(engine.submit(
                GenerateRequest::new(model, ids(&c["prompt_ids"])).params(params.validate(engine.config().vocab_size)?),
            )?);
        }
        let mut compared = 0;
        for (c, stream) in cases.iter().zip(streams) {
            let got = stream.collect_blocking()?.token_ids;
            let (want, margins) = (ids(&c["output_ids"]), c["margins"].as_array().expect("fixture: margins"));
            for (j, w) in want.iter().enumerate() {
                if margins[j].as_f64().expect("a margin") <= MARGIN {
                    break;
                }
                ensure!(got[j] == *w, "{round} {}: token {j} is {} (reference {w})", c["adapter"], got[j]);
                compared += 1;
            }
        }
        println!("{round}: {compared} greedy tokens equal to the reference's");
        ensure!(compared > 0, "{round}: no token compared");
    }
    let m = wait_for(&engine, |m| m.running == 0);
    assert_idle(&m);
    ensure!(m.prefix_cache_hit_tokens > 0, "the second round hit nothing: {m:?}");
    Ok(())
}
