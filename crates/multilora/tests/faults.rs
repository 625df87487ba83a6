//! Faults affect only the request they hit: an unknown model, invalid parameters, a corrupt
//! adapter loaded at run time, a stream dropped at any point (waiting, prefilling, decoding,
//! preempted), and 1,000 requests from 8 threads at once; afterwards every KV block and slot
//! lease is back.

mod common;

use anyhow::Result;
use common::*;
use multilora::{Event, GenerateRequest, SamplingParams, ValidParams};

/// Greedy decoding of `n` tokens past EOS: parameters that name no token, so valid for any
/// vocabulary (`submit` checks token ids against the engine's own).
fn greedy(n: usize) -> ValidParams {
    let mut p = SamplingParams::greedy(n);
    p.ignore_eos = true;
    p.validate(usize::MAX).expect("greedy parameters are valid")
}

#[test]
fn unknown_model_and_bad_params_fail_alone() -> Result<()> {
    let engine = builder(4).build()?;
    let ok1 = engine.submit(GenerateRequest::new("qv_r8", vec![1, 294, 488]).params(greedy(4)))?;
    // An unknown model is refused at submit, before anything is queued.
    let err = engine.submit(GenerateRequest::new("no-such-adapter", vec![1, 294, 488]).params(greedy(4))).unwrap_err();
    assert_eq!(err.kind(), "model_not_found", "{err}");
    assert!(err.to_string().contains("no-such-adapter"), "{err}");
    let ok2 = engine.submit(GenerateRequest::new(BASE, "Hello world").params(greedy(4)))?;
    assert!(ok1.adapter_ready() && ok2.adapter_ready(), "start-up adapters and the base are in host memory");
    assert_eq!(ok1.collect_blocking()?.token_ids.len(), 4);
    assert_eq!(ok2.collect_blocking()?.token_ids.len(), 4);

    // Invalid parameters are refused once, by `validate`, before any request is built.
    let vocab = engine.config().vocab_size;
    let mut p = greedy(4).into_params();
    p.top_p = 0.0;
    let err = p.validate(vocab).unwrap_err();
    assert_eq!(err.kind(), "invalid_request");
    assert!(err.to_string().contains("top_p"), "{err}");
    let mut p = greedy(4).into_params();
    p.n = 2;
    assert_eq!(p.validate(vocab).unwrap_err().kind(), "invalid_request");
    // Token ids are checked against the engine's vocabulary at submit too, whatever vocabulary
    // the parameters were validated for.
    let mut p = greedy(4).into_params();
    p.stop_token_ids = vec![vocab as u32];
    assert!(p.clone().validate(vocab).unwrap_err().to_string().contains("outside the vocabulary"));
    let err = engine.submit(GenerateRequest::new(BASE, vec![1, 2]).params(p.validate(usize::MAX)?)).unwrap_err();
    assert_eq!(err.kind(), "invalid_request");
    assert!(err.to_string().contains(&format!("token id {vocab} is outside the vocabulary of {vocab}")), "{err}");
    let long = vec![5u32; 600];
    let err = engine.submit(GenerateRequest::new(BASE, long).params(greedy(4))).unwrap_err();
    assert_eq!(err.kind(), "prompt_too_long");
    assert_idle(&wait_for(&engine, |m| m.running == 0));
    Ok(())
}

#[test]
fn corrupt_runtime_adapter_is_refused_and_serving_goes_on() -> Result<()> {
    let engine = builder(2).allow_runtime_lora_updating(true).allowed_lora_root(fixtures()).build()?;
    let running = engine.submit(GenerateRequest::new("qv_r8", vec![1, 294, 488]).params(greedy(8)))?;
    for bad in ["truncated", "corrupt_header", "shape_mismatch"] {
        let err = engine.handle().load_adapter(bad, &path(&format!("invalid_adapters/{bad}"))).unwrap_err();
        assert_eq!(err.kind(), "adapter_error", "{bad}: {err}");
        assert!(err.to_string().contains(bad), "{err}");
    }
    assert_eq!(running.collect_blocking()?.token_ids.len(), 8);
    let later = engine.submit(GenerateRequest::new("truncated", vec![1, 2]).params(greedy(2))).unwrap_err();
    assert_eq!(later.kind(), "model_not_found");
    Ok(())
}

#[test]
fn dropped_stream_returns_its_lease_and_blocks_at_any_point() -> Result<()> {
    let prompt = |n: usize, k: usize| -> Vec<u32> { (0..n).map(|i| (3 + i * 7 + k * 31) as u32 % 509).collect() };

    // Decoding: after its first token.
    let engine = builder(4).build()?;
    let slot_bytes = engine.config().lora_slot_bytes;
    let mut stream = engine.submit(GenerateRequest::new("all_r16", prompt(40, 0)).params(greedy(400)))?;
    let first = stream.recv_blocking();
    assert!(matches!(first, Some(Event::Token { .. })), "{first:?}");
    let m = engine.metrics();
    assert!(m.running == 1 && m.kv_usage > 0.0 && m.pinned_slots == 1, "{m:?}");
    drop(stream);
    let m = wait_for(&engine, |m| m.running == 0);
    assert_idle(&m);
    assert_eq!(m.requests_finished.get("abort"), Some(&1), "{m:?}");

    // Prefilling: a long prompt in 16-token chunks, dropped before its first token.
    let engine = builder(4).max_num_batched_tokens(16).build()?;
    let stream = engine.submit(GenerateRequest::new("all_r16", prompt(480, 1)).params(greedy(4)))?;
    until(&engine, "prefilling", |m| m.running == 1 && m.pinned_slots == 1 && m.kv_usage > 0.0);
    let m = engine.metrics();
    assert_eq!(m.generation_tokens, 0, "still in its prefill: {m:?}");
    drop(stream);
    assert_idle(&wait_for(&engine, |m| m.running == 0));

    // Waiting: one sequence at a time, behind a long request of another adapter.
    let engine = builder(4).max_num_seqs(1).build()?;
    let blockers = hold(&engine, "qv_r8", 4)?;
    let waiting = engine.submit(GenerateRequest::new("all_r16", prompt(8, 3)).params(greedy(4)))?;
    until(&engine, "one running, the rest waiting", |m| m.running == 1 && m.waiting == 4);
    drop(waiting);
    let m = wait_for(&engine, |m| m.waiting == 3);
    assert_eq!((m.running, m.pinned_slots), (1, 1), "only the running blocker's lease is left: {m:?}");
    drop(blockers);
    assert_idle(&wait_for(&engine, |m| m.running == 0));

    // Preempted: a KV pool of ~600 tokens (2 KiB each; the slots count against the budget) and
    // two requests that grow to 464 each; the newer one is preempted (its blocks and lease
    // returned) and dropped while it waits again.
    let engine = builder(4).kv_cache_bytes(slot_bytes + 1_250_000).build()?;
    let first = engine.submit(GenerateRequest::new("qv_r8", prompt(64, 4)).params(greedy(400)))?;
    let second = engine.submit(GenerateRequest::new("all_r16", prompt(64, 5)).params(greedy(400)))?;
    until(&engine, "a preemption", |m| m.preemptions >= 1 && m.running == 1 && m.waiting == 1);
    let m = engine.metrics();
    assert_eq!(m.pinned_slots, 1, "the preempted request holds no lease while it waits: {m:?}");
    drop(second);
    let m = wait_for(&engine, |m| m.waiting == 0);
    assert_eq!((m.running, m.pinned_slots), (1, 1), "{m:?}");
    drop(first);
    let m = wait_for(&engine, |m| m.running == 0);
    assert_idle(&m);
    assert_eq!(m.requests_finished.get("abort"), Some(&2), "{m:?}");
    Ok(())
}

#[test]
fn a_thousand_requests_from_eight_threads() -> Result<()> {
    let engine = builder(4).build()?;
    let names: Vec<&str> =
        ["qv_r8", "all_r16", "rslora_r4", "pattern_r8", "layers_subset", "embed_target", BASE].to_vec();
    std::thread::scope(|s| {
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let handle = engine.handle();
                let names = &names;
                s.spawn(move || -> Result<usize> {
                    let streams = (0..125)
                        .map(|i| {
                            let prompt: Vec<u32> =
                                (0..3 + (i % 6)).map(|k| (1 + t * 31 + i * 7 + k * 13) as u32 % 512).collect();
                            let name = names[(t + i) % names.len()];
                            handle.submit(GenerateRequest::new(name, prompt).params(greedy(2)))
                        })
                        .collect::<multilora::Result<Vec<_>>>()?;
                    let mut tokens = 0;
                    for st in streams {
                        tokens += st.collect_blocking()?.token_ids.len();
                    }
                    Ok(tokens)
                })
            })
            .collect();
        for t in threads {
            let tokens = t.join().expect("thread panicked")?;
            assert_eq!(tokens, 250);
        }
        anyhow::Ok(())
    })?;
    let m = wait_for(&engine, |m| m.running == 0);
    assert_idle(&m);
    assert_eq!(m.requests_finished.get("length"), Some(&1000), "{m:?}");
    assert_eq!(m.generation_tokens, 2000);
    let per: u64 = m.per_adapter.values().map(|u| u.requests).sum();
    assert_eq!(per, 1000);
    Ok(())
}

/// Copies a fixture adapter directory to `dst`.
fn copy_adapter(rel: &str, dst: &std::path::Path) -> Result<()> {
    std::fs::create_dir_all(dst)?;
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(fixtures().join(rel).join(f), dst.join(f))?;
    }
    Ok(())
}

#[test]
fn adapter_whose_files_disappear_fails_alone() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    copy_adapter("adapters/qv_r8", &a)?;
    copy_adapter("adapters/rslora_r4", &b)?;
    // One CPU entry: loading "b" at start evicts "a", which must come back from disk later.
    let engine = multilora::Engine::builder(path("base"))
        .served_model_name(BASE)
        .max_loras(1)
        .max_cpu_loras(1)
        .kv_cache_bytes(8 << 20)
        .lora("a", a.display().to_string())
        .lora("b", b.display().to_string())
        .build()?;
    std::fs::remove_dir_all(&a)?;
    let gone = engine.submit(GenerateRequest::new("a", vec![1, 2, 3]).params(greedy(2)))?;
    let fine = engine.submit(GenerateRequest::new("b", vec![1, 2, 3]).params(greedy(2)))?;
    let err = gone.collect_blocking().unwrap_err();
    assert_eq!(err.kind(), "adapter_error", "{err}");
    assert_eq!(fine.collect_blocking()?.token_ids.len(), 2);
    let m = wait_for(&engine, |m| m.running == 0);
    assert_idle(&m);
    assert_eq!(m.request_errors.get("adapter_error"), Some(&1), "{m:?}");
    Ok(())
}

/// The directory resolver, holding its answer for `rslora_r4` until the gate opens (a message
/// or the sender dropped): that adapter's load is in flight for as long as the test wants.
struct Gated {
    inner: multilora::DirectoryResolver,
    gate: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
}

impl multilora::Resolver for Gated {
    fn resolve(&self, name: &str) -> std::result::Result<Option<multilora::AdapterSource>, multilora::ResolveError> {
        if name == "rslora_r4" {
            let _ = self.gate.lock().map(|g| g.recv());
        }
        self.inner.resolve(name)
    }
}

#[test]
fn resolved_adapter_waits_in_the_engine_while_it_loads() -> Result<()> {
    let root = fixtures().join("adapters");
    let (open, gate) = std::sync::mpsc::channel();
    let engine = multilora::Engine::builder(path("base"))
        .served_model_name(BASE)
        .max_lora_rank(16)
        .kv_cache_bytes(8 << 20)
        .allow_runtime_lora_updating(true)
        .allowed_lora_root(root.clone())
        .lora_resolver(Gated { inner: multilora::DirectoryResolver::new(root), gate: std::sync::Mutex::new(gate) })
        .build()?;
    let streams: Vec<_> = (0..3)
        .map(|i| engine.submit(GenerateRequest::new("rslora_r4", vec![1, 2, 3 + i]).params(greedy(3))))
        .collect::<multilora::Result<_>>()?;
    assert!(streams.iter().all(|s| !s.adapter_ready()), "its load had only started at submit");
    until(&engine, "all three waiting in the engine for the load", |m| m.deferred == 3 && m.running == 0);
    // They wait as the scheduler's own requests do: counted as waiting, their adapter listed.
    let m = engine.metrics();
    assert_eq!(m.waiting, 3, "{m:?}");
    assert_eq!(m.waiting_adapters, vec!["rslora_r4".to_string()], "{m:?}");
    drop(open);
    for s in streams {
        assert_eq!(s.collect_blocking()?.token_ids.len(), 3);
    }
    let err = engine.submit(GenerateRequest::new("rank32", vec![1, 2]).params(greedy(2)))?.collect_blocking();
    assert_eq!(err.unwrap_err().kind(), "adapter_error", "rank 32 exceeds max_lora_rank 16");
    let m = wait_for(&engine, |m| m.running == 0);
    assert_idle(&m);
    assert!(m.adapter_loads >= 1 && m.adapter_load_time.count >= 1, "{m:?}");
    assert!(m.deferred_max >= 1, "requests waited for the load: {m:?}");
    Ok(())
}

/// A request accepted while its adapter is being resolved holds that load: the operator loads
/// other weights under the name and then unloads it before the load ends, and the request still
/// runs, on the weights the load it was accepted on read, with the tokens those weights give; a
/// request accepted on the operator's weights keeps those through the unload.
#[test]
fn a_request_waiting_on_a_load_keeps_it_across_a_load_and_an_unload_of_its_name() -> Result<()> {
    let prompt = vec![1u32, 294, 488, 7];
    let reference = builder(4).build()?;
    let want = reference.submit(GenerateRequest::new("rslora_r4", prompt.clone()).params(greedy(5)))?;
    let want = want.collect_blocking()?.token_ids;
    drop(reference);
    let root = fixtures().join("adapters");
    let (gate_tx, gate) = std::sync::mpsc::channel::<()>();
    let engine = multilora::Engine::builder(path("base"))
        .served_model_name(BASE)
        .max_lora_rank(16)
        .kv_cache_bytes(8 << 20)
        .allow_runtime_lora_updating(true)
        .allowed_lora_root(fixtures())
        .lora_resolver(Gated { inner: multilora::DirectoryResolver::new(root), gate: std::sync::Mutex::new(gate) })
        .build()?;
    // Bound after the engine, so that a failing assertion opens the gate before the engine's
    // loader threads are joined.
    let open = gate_tx;
    let waiting = engine.submit(GenerateRequest::new("rslora_r4", prompt.clone()).params(greedy(5)))?;
    assert!(!waiting.adapter_ready());
    until(&engine, "waiting in the engine for the load", |m| m.deferred == 1);
    let h = engine.handle();
    assert!(h.load_adapter("rslora_r4", &path("adapters/all_r16"))?);
    // A later request gets the operator's weights at once (and waits behind the earlier one for
    // the same name, in arrival order), and keeps them through the unload too.
    let other = engine.submit(GenerateRequest::new("rslora_r4", prompt.clone()).params(greedy(5)))?;
    assert!(other.adapter_ready());
    h.unload_adapter("rslora_r4")?;
    drop(open);
    assert_eq!(waiting.collect_blocking()?.token_ids, want, "the request ran on what its load read");
    assert_ne!(other.collect_blocking()?.token_ids, want, "the later one on the operator's weights");
    let m = wait_for(&engine, |m| m.running == 0 && m.waiting == 0);
    assert_idle(&m);
    assert!(m.request_errors.is_empty(), "{:?}", m.request_errors);
    assert_eq!(m.cpu_tier.entries, 0, "the superseded generation left with its request: {m:?}");
    Ok(())
}

/// A start-up adapter whose config claims a rank of a billion (or a rank pattern of that size):
/// the engine sizes its slots from the start-up ranks, so this once aborted the process on a
/// 2 TB allocation. It is a typed error naming the adapter, before any slot is allocated; so is a
/// `max_lora_rank` above the ceiling.
#[test]
fn a_startup_adapter_claiming_a_huge_rank_is_a_typed_error() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let src = fixtures().join("adapters/qv_r8");
    for (name, changes) in [
        ("huge", serde_json::json!({"r": 1_000_000_000})),
        ("huge_pattern", serde_json::json!({"rank_pattern": {"v_proj": 1_000_000_000}})),
    ] {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir)?;
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(src.join("adapter_config.json"))?)?;
        for (k, v) in changes.as_object().expect("object") {
            config[k] = v.clone();
        }
        std::fs::write(dir.join("adapter_config.json"), config.to_string())?;
        std::fs::copy(src.join("adapter_model.safetensors"), dir.join("adapter_model.safetensors"))?;
        let err = multilora::Engine::builder(path("base"))
            .served_model_name(BASE)
            .lora(name, dir.display().to_string())
            .build()
            .expect_err("a rank of a billion must be refused");
        let msg = err.to_string();
        assert_eq!(err.kind(), "adapter_error", "{msg}");
        assert_eq!(err.cause_kind(), Some("rank_too_large"), "{msg}");
        assert!(msg.contains(&format!("{name:?}")) && msg.contains("1000000000"), "{msg}");
    }
    let err = builder(4).max_lora_rank(1_000_000_000).build().expect_err("a max_lora_rank above the ceiling");
    assert_eq!(err.kind(), "invalid_config", "{err}");
    assert!(err.to_string().contains("ceiling"), "{err}");
    Ok(())
}

/// The fixture base with two slots and no start-up adapter, runtime loading allowed inside the
/// fixtures.
fn runtime_builder() -> multilora::EngineBuilder {
    multilora::Engine::builder(path("base"))
        .served_model_name(BASE)
        .max_loras(2)
        .max_lora_rank(32)
        .kv_cache_bytes(16 << 20)
        .allow_runtime_lora_updating(true)
        .allowed_lora_root(fixtures())
}

/// A CPU tier as small as the slots (2) and five adapters in use at once from four threads:
/// a load that finds every CPU entry pinned waits for one to unpin instead of failing, so every
/// request finishes, and the engine comes back to idle. (Before, such loads failed with "all 2
/// entries of the cpu tier are pinned", and the failure stuck.)
#[test]
fn a_tight_cpu_tier_makes_requests_wait_not_fail() -> Result<()> {
    let engine = runtime_builder()
        .max_cpu_loras(2)
        .lora_resolver(multilora::DirectoryResolver::new(fixtures().join("adapters")))
        .build()?;
    let names = ["qv_r8", "all_r16", "rslora_r4", "pattern_r8", "rank32"];
    std::thread::scope(|s| -> Result<()> {
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let handle = engine.handle();
                s.spawn(move || -> Result<usize> {
                    let mut done = 0;
                    for round in 0..6 {
                        let streams = names
                            .iter()
                            .enumerate()
                            .map(|(i, name)| {
                                let prompt: Vec<u32> =
                                    (0..4).map(|k| (1 + t * 17 + i * 5 + round * 3 + k) as u32).collect();
                                handle.submit(GenerateRequest::new(*name, prompt).params(greedy(3)))
                            })
                            .collect::<multilora::Result<Vec<_>>>()?;
                        for st in streams {
                            assert_eq!(st.collect_blocking()?.token_ids.len(), 3);
                            done += 1;
                        }
                    }
                    Ok(done)
                })
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().expect("thread")?, 30);
        }
        Ok(())
    })?;
    let m = wait_for(&engine, |m| m.running == 0 && m.waiting == 0);
    assert_idle(&m);
    assert!(m.request_errors.is_empty(), "no request failed: {:?}", m.request_errors);
    assert_eq!(m.adapter_loads_waiting, 0, "no load is left waiting");
    assert_eq!(m.requests_finished.get("length"), Some(&120), "{m:?}");
    Ok(())
}

/// `max_model_len` beyond the model's own limit (512 positions in the fixture's config.json)
/// is refused at build, naming both, before anything is loaded; vLLM refuses it too. Before,
/// it was accepted and a sequence past the model's positions failed every request in its step.
#[test]
fn max_model_len_beyond_the_model_is_refused() {
    let err = builder(2).max_model_len(4096).build().unwrap_err();
    assert_eq!(err.kind(), "invalid_config", "{err}");
    let msg = err.to_string();
    assert!(msg.contains("max_model_len 4096") && msg.contains("512"), "{msg}");
    let engine = builder(2).max_model_len(512).build().expect("the model's own limit is fine");
    assert_eq!(engine.config().max_model_len, 512);
}

/// An in-place reload with a version that targets modules without slot buffers is refused and
/// rolled back: the version before it stays current and serves the same output. (Before, the
/// target check ran after the swap, so the refused version stayed current and every later
/// request for the name failed.)
#[test]
fn a_refused_reload_leaves_the_previous_version_serving() -> Result<()> {
    let engine = runtime_builder()
        .lora_target_modules(&[multilora::ModuleKind::QProj, multilora::ModuleKind::VProj])
        .lora("sql", path("adapters/qv_r8"))
        .build()?;
    let run = || -> Result<Vec<u32>> {
        Ok(engine
            .submit(GenerateRequest::new("sql", vec![1, 294, 488]).params(greedy(6)))?
            .collect_blocking()?
            .token_ids)
    };
    let before = run()?;
    let err = engine.handle().reload_adapter("sql", &path("adapters/all_r16")).unwrap_err();
    assert_eq!(err.cause_kind(), Some("not_a_target"), "{err}");
    assert!(err.to_string().contains("sql"), "{err}");
    assert_eq!(run()?, before, "the previous version still serves");
    let info = engine.models().into_iter().find(|m| m.id == "sql").expect("still listed");
    assert_eq!(info.source, path("adapters/qv_r8"), "{info:?}");
    Ok(())
}

/// A request preempted (its KV blocks and slot given back) keeps its adapter generation while it
/// waits: its adapter is reloaded in place with other weights meanwhile, and it still resumes and
/// finishes on the weights it started with, with the tokens it would have had without the
/// reload. (Before, the old generation was dropped at the reload, and the request failed with
/// "left host memory mid-request".)
#[test]
fn a_preempted_request_keeps_its_generation_across_a_reload() -> Result<()> {
    let prompt = |k: usize| -> Vec<u32> { (0..64).map(|i| (3 + i * 7 + k * 31) as u32 % 509).collect() };
    let alone = builder(4).build()?;
    let want = alone.submit(GenerateRequest::new("all_r16", prompt(5)).params(greedy(200)))?.collect_blocking()?;
    drop(alone);

    let probe = builder(4).build()?;
    let slot_bytes = probe.config().lora_slot_bytes;
    drop(probe);
    let engine = builder(4)
        .max_model_len(320)
        .kv_cache_bytes(slot_bytes + 700_000)
        .allow_runtime_lora_updating(true)
        .allowed_lora_root(fixtures())
        .build()?;
    let first = engine.submit(GenerateRequest::new("qv_r8", prompt(4)).params(greedy(200)))?;
    let second = engine.submit(GenerateRequest::new("all_r16", prompt(5)).params(greedy(200)))?;
    until(&engine, "a preemption", |m| m.preemptions >= 1 && m.waiting == 1);
    engine.handle().reload_adapter("all_r16", &path("adapters/rank32"))?;
    let (first, second) = (first.collect_blocking()?, second.collect_blocking()?);
    assert_eq!(first.token_ids.len(), 200);
    assert_eq!(second.token_ids, want.token_ids, "resumed on the weights it started with");
    let m = wait_for(&engine, |m| m.running == 0);
    assert_idle(&m);
    assert!(m.request_errors.is_empty(), "{:?}", m.request_errors);
    Ok(())
}

/// A request admitted to the scheduler holds its adapter's host-memory entry while it waits, so
/// a load of another adapter into a full CPU tier waits for it instead of evicting it: the
/// waiting request keeps its place (it runs first, on the weights it was admitted on) and its
/// adapter is loaded once, not evicted and loaded again. (Before, the load evicted it, and the
/// request was sent back to wait for its adapter behind later ones.)
#[test]
fn a_waiting_request_keeps_its_place_when_another_adapter_needs_its_cpu_entry() -> Result<()> {
    let engine = runtime_builder()
        .max_num_seqs(1)
        .max_loras(1)
        .max_cpu_loras(1)
        .lora("sql", path("adapters/qv_r8"))
        .lora_resolver(multilora::DirectoryResolver::new(fixtures().join("adapters")))
        .build()?;
    let blockers = hold(&engine, BASE, 8)?;
    let first = engine.submit(GenerateRequest::new("sql", vec![1, 294, 488]).params(greedy(4)))?;
    // Admitted (and so holding sql's cpu entry) before all_r16's load starts: a submission not
    // yet taken in by the loop holds no entry, and the loader could evict sql's first.
    until(&engine, "sql is admitted and waits", |m| m.waiting_adapters.iter().any(|a| a == "sql"));
    let mut second = engine.submit(GenerateRequest::new("all_r16", vec![1, 294, 488]).params(greedy(4)))?;
    until(&engine, "all_r16's load waits for the one cpu entry", |m| m.adapter_loads_waiting == 1);
    drop(blockers);
    // One request at a time (max_num_seqs 1): when all_r16's first token arrives, sql, admitted
    // first, has generated all of its tokens. Told by the engine's own counters (answered between
    // two steps), not by the clocks of two reader threads, which on a loaded machine may wake in
    // either order.
    loop {
        match second.recv_blocking() {
            Some(Event::Token { .. }) => break,
            Some(Event::Error(e)) => panic!("{e}"),
            None => panic!("all_r16's stream ended without a token"),
            Some(_) => {}
        }
    }
    let at_second = engine.metrics();
    assert_eq!(
        at_second.per_adapter.get("sql").map(|u| u.generation_tokens),
        Some(4),
        "the request admitted first ran first: {at_second:?}"
    );
    let (first, second) = (first.collect_blocking()?, second.collect_blocking()?);
    assert_eq!((first.token_ids.len(), second.token_ids.len()), (4, 3), "all_r16's first token was read above");
    let m = wait_for(&engine, |m| m.running == 0 && m.waiting == 0);
    assert_idle(&m);
    assert_eq!(m.adapter_loads, 2, "sql at start and all_r16 once: nothing evicted and loaded again: {m:?}");
    assert_eq!(m.adapter_capacity_waits, 1, "{m:?}");
    Ok(())
}

/// A failed load from source is not retried by every request (within its back-off the next
/// request gets the same error at submit, without touching the files), and `retry_adapter`
/// loads it again at once: once the files are fixed, it serves.
#[test]
fn a_failed_load_is_answered_from_memory_and_retry_reloads_it() -> Result<()> {
    let root = tempfile::tempdir()?;
    let dir = root.path().join("fixme");
    std::fs::create_dir_all(&dir)?;
    let src = fixtures().join("adapters/qv_r8");
    std::fs::copy(src.join("adapter_config.json"), dir.join("adapter_config.json"))?;
    let weights = std::fs::read(src.join("adapter_model.safetensors"))?;
    std::fs::write(dir.join("adapter_model.safetensors"), &weights[..weights.len() / 2])?;
    let engine = runtime_builder()
        .allowed_lora_root(root.path())
        .lora_resolver(multilora::DirectoryResolver::new(root.path()))
        .build()?;
    let submit = || engine.submit(GenerateRequest::new("fixme", vec![1, 294, 488]).params(greedy(3)));
    let err = submit()?.collect_blocking().unwrap_err();
    assert_eq!(err.cause_kind(), Some("truncated"), "{err}");
    // Within the back-off (1 s): refused at submit with the same error.
    let again = submit().unwrap_err();
    assert_eq!(again.cause_kind(), Some("truncated"), "{again}");
    assert_eq!(engine.metrics().adapter_loads, 0, "the truncated file never loaded");
    std::fs::write(dir.join("adapter_model.safetensors"), &weights)?;
    // `retry_adapter` may answer before or after the fresh load ends (true or false), and that
    // load may end before or after the next submit looks: the store's load counter, not either
    // answer, tells that the fixed files were read.
    engine.handle().retry_adapter("fixme")?;
    assert_eq!(submit()?.collect_blocking()?.token_ids.len(), 3);
    assert_eq!(engine.metrics().adapter_loads, 1, "the fixed files loaded once");
    Ok(())
}
