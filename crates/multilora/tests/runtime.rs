//! Adapter management while serving: refused when off; load, use, reload in place with
//! different weights (outputs change, and prefix-cache blocks of the old generation are not
//! reused), unload (then `model_not_found`, refused at submit); ten thousand loads over an
//! engine's life leave no growing queue of load events.

mod common;

use anyhow::Result;
use common::*;
use multilora::{Engine, GenerateRequest, SamplingParams, Tier};

fn run(engine: &Engine, model: &str, prompt: &[u32]) -> Result<(Vec<u32>, u64)> {
    let before = engine.metrics().prefix_cache_hit_tokens;
    let mut p = SamplingParams::greedy(8);
    p.ignore_eos = true;
    let out = engine.submit(GenerateRequest::new(model, prompt.to_vec()).params(p))?.collect_blocking()?;
    Ok((out.token_ids, engine.metrics().prefix_cache_hit_tokens - before))
}

/// The fixture base with runtime adapter updating on, confined to the fixtures, two slots.
fn runtime_engine() -> Result<Engine> {
    Ok(Engine::builder(path("base"))
        .served_model_name(BASE)
        .max_loras(2)
        .kv_cache_bytes(8 << 20)
        .allow_runtime_lora_updating(true)
        .allowed_lora_root(fixtures())
        .build()?)
}

#[test]
fn refused_when_runtime_updating_is_off() -> Result<()> {
    let engine = builder(2).build()?;
    let h = engine.handle();
    assert_eq!(h.load_adapter("x", &path("adapters/qv_r8")).unwrap_err().kind(), "runtime_updates_disabled");
    assert_eq!(h.reload_adapter("qv_r8", &path("adapters/all_r16")).unwrap_err().kind(), "runtime_updates_disabled");
    assert_eq!(h.unload_adapter("qv_r8").unwrap_err().kind(), "runtime_updates_disabled");
    Ok(())
}

#[test]
fn load_use_reload_in_place_and_unload() -> Result<()> {
    let engine = runtime_engine()?;
    let h = engine.handle();
    let prompt: Vec<u32> = (0..40).map(|i| (7 + i * 11) % 512).collect();
    h.load_adapter("x", &path("adapters/qv_r8"))?;
    let info = engine.models().into_iter().find(|m| m.id == "x").expect("x is listed");
    assert_eq!((info.parent.as_deref(), info.rank, info.tier), (Some(BASE), Some(8), Tier::Cpu));
    let (base_out, _) = run(&engine, BASE, &prompt)?;
    let (old, _) = run(&engine, "x", &prompt)?;
    assert_ne!(old, base_out, "the adapter changes the output");
    let (again, hits) = run(&engine, "x", &prompt)?;
    assert_eq!(again, old);
    assert!(hits >= 32, "the same generation reuses its cached blocks ({hits} hit tokens)");
    assert_eq!(engine.models().iter().find(|m| m.id == "x").map(|m| m.tier), Some(Tier::Device));

    h.reload_adapter("x", &path("adapters/all_r16"))?;
    let (new, hits) = run(&engine, "x", &prompt)?;
    assert_ne!(new, old, "new requests get the new weights");
    assert_eq!(hits, 0, "no block computed with the old weights is reused");

    h.unload_adapter("x")?;
    let err = engine.submit(GenerateRequest::new("x", prompt.clone())).unwrap_err();
    assert_eq!(err.kind(), "model_not_found");
    assert!(engine.models().iter().all(|m| m.id != "x"));
    assert_idle(&wait_for(&engine, |m| m.running == 0));
    Ok(())
}

#[test]
fn ten_thousand_loads_leave_no_growing_queue() -> Result<()> {
    let engine = runtime_engine()?;
    let h = engine.handle();
    const LOADS: u64 = 10_000;
    for i in 0..LOADS {
        h.load_adapter("x", &path("adapters/qv_r8"))?;
        h.unload_adapter("x")?;
        if i % 1000 == 999 {
            let m = engine.metrics();
            // At most the last load's event, if the snapshot came before the loop took it.
            assert!(m.adapter_events_pending <= 1, "after {} loads: {m:?}", i + 1);
        }
    }
    let m = engine.metrics();
    assert_eq!(m.adapter_loads, LOADS);
    assert!(m.adapter_events_pending <= 1, "{m:?}");
    Ok(())
}
