//! Adapter management while serving: refused when off; load, use, reload in place with
//! different weights (outputs change, and prefix-cache blocks of the old generation are not
//! reused), unload (then `model_not_found`, refused at submit); a request accepted before an
//! unload or reload finishes on the generation it was accepted with; loads into a CPU tier full
//! of pinned entries wait for room instead of failing; ten thousand loads over an engine's life
//! leave no growing queue of load events.

mod common;

use anyhow::Result;
use common::*;
use multilora::{Engine, GenerateRequest, SamplingParams, Tier};

fn run(engine: &Engine, model: &str, prompt: &[u32]) -> Result<(Vec<u32>, u64)> {
    let before = engine.metrics().prefix_cache_hit_tokens;
    let mut p = SamplingParams::greedy(8);
    p.ignore_eos = true;
    let out = engine
        .submit(GenerateRequest::new(model, prompt.to_vec()).params(p.validate(engine.config().vocab_size)?))?
        .collect_blocking()?;
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

/// A request accepted for an adapter keeps the generation it was accepted with: the adapter is
/// unloaded (or reloaded in place with other weights) before the request's first token, and the
/// request still finishes, with the tokens of the weights it was accepted on, while new requests
/// see the unload (`model_not_found` at submit) or the new weights. (Before, the loop looked the
/// name up again, and such a request failed mid-stream with `model_not_found`.)
#[test]
fn an_accepted_request_finishes_on_its_generation_after_an_unload_or_a_reload() -> Result<()> {
    let engine = Engine::builder(path("base"))
        .served_model_name(BASE)
        .max_loras(2)
        .max_num_seqs(1)
        .kv_cache_bytes(8 << 20)
        .allow_runtime_lora_updating(true)
        .allowed_lora_root(fixtures())
        .build()?;
    let h = engine.handle();
    let prompt: Vec<u32> = (0..24).map(|i| (5 + i * 13) % 512).collect();
    for name in ["x", "y"] {
        assert!(h.load_adapter(name, &path("adapters/qv_r8"))?, "cached at once");
    }
    let (want, _) = run(&engine, "x", &prompt)?;
    // One sequence at a time, and the base model busy: both requests wait in the scheduler.
    let blockers = hold(&engine, BASE, 8)?;
    let mut p = SamplingParams::greedy(8);
    p.ignore_eos = true;
    let x = engine
        .submit(GenerateRequest::new("x", prompt.clone()).params(p.clone().validate(engine.config().vocab_size)?))?;
    let y = engine.submit(GenerateRequest::new("y", prompt.clone()).params(p.validate(engine.config().vocab_size)?))?;
    assert!(x.adapter_ready() && y.adapter_ready());
    until(&engine, "both wait behind the blockers", |m| m.waiting == 7 + 2);
    h.unload_adapter("x")?;
    assert!(h.reload_adapter("y", &path("adapters/all_r16"))?);
    assert_eq!(engine.submit(GenerateRequest::new("x", prompt.clone())).unwrap_err().kind(), "model_not_found");
    let m = engine.metrics();
    assert_eq!(m.per_adapter.get("x").map(|u| u.generation_tokens), Some(want.len() as u64), "only the reference");
    assert_eq!(m.per_adapter.get("y").map_or(0, |u| u.generation_tokens), 0, "y has no token yet");
    drop(blockers);
    assert_eq!(x.collect_blocking()?.token_ids, want, "x finished on the weights it was accepted with");
    assert_eq!(y.collect_blocking()?.token_ids, want, "y too, not on the reloaded ones");
    let (after, _) = run(&engine, "y", &prompt)?;
    assert_ne!(after, want, "new requests get the reloaded weights");
    let m = wait_for(&engine, |m| m.running == 0);
    assert_idle(&m);
    assert!(m.request_errors.is_empty(), "{:?}", m.request_errors);
    // The unloaded and the superseded generation left host memory with their last request.
    assert_eq!((m.cpu_tier.entries, m.device_tier.entries), (1, 1), "{m:?}");
    Ok(())
}

/// With every host-memory entry pinned by running requests, an operator's load and an in-place
/// reload are not refused: they validate and register the adapter, say it waits for room
/// (`Ok(false)`), and a request for it waits (accepted, not failed) until an entry frees, then
/// runs on the reloaded weights. (Before, both answered "all 2 entries of the cpu tier are
/// pinned".)
#[test]
fn loads_into_a_pinned_cpu_tier_wait_for_room_and_serve_once_it_frees() -> Result<()> {
    let reference = builder(4).build()?;
    let prompt: Vec<u32> = (0..16).map(|i| (11 + i * 7) % 512).collect();
    let (want, _) = run(&reference, "pattern_r8", &prompt)?;
    drop(reference);

    let engine = Engine::builder(path("base"))
        .served_model_name(BASE)
        .max_loras(2)
        .max_cpu_loras(2)
        .kv_cache_bytes(8 << 20)
        .allow_runtime_lora_updating(true)
        .allowed_lora_root(fixtures())
        .lora("a", path("adapters/qv_r8"))
        .lora("b", path("adapters/all_r16"))
        .build()?;
    let h = engine.handle();
    let running = [hold(&engine, "a", 1)?, hold(&engine, "b", 1)?];
    until(&engine, "both entries pinned by running requests", |m| m.running == 2 && m.pinned_slots == 2);
    assert!(!h.load_adapter("c", &path("adapters/rslora_r4"))?, "waits for room");
    assert!(!h.reload_adapter("c", &path("adapters/pattern_r8"))?, "the new version waits in its place");
    let mut p = SamplingParams::greedy(want.len());
    p.ignore_eos = true;
    let c = engine.submit(GenerateRequest::new("c", prompt).params(p.validate(engine.config().vocab_size)?))?;
    assert!(!c.adapter_ready(), "it waits for its adapter's entry");
    let m = engine.metrics();
    assert_eq!((m.adapter_loads_waiting, m.running), (1, 2), "{m:?}");
    assert!(m.request_errors.is_empty(), "{:?}", m.request_errors);
    drop(running);
    assert_eq!(c.collect_blocking()?.token_ids, want, "served on the reloaded version once room freed");
    let m = wait_for(&engine, |m| m.running == 0 && m.waiting == 0);
    assert_idle(&m);
    assert_eq!(m.adapter_loads_waiting, 0, "{m:?}");
    assert!(m.request_errors.is_empty(), "{:?}", m.request_errors);
    Ok(())
}
