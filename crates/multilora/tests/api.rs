//! The public API's promises: handles are `Send + Sync`, public enums are `#[non_exhaustive]`
//! (all but `EngineError`, exhaustive so that matches over it must handle every variant), the step
//! metrics count every step's rows and adapters exactly, streaming text is valid UTF-8 and adds
//! up to the whole, seeded sampling repeats, stop strings and logprobs behave as in vLLM.

mod common;

use anyhow::Result;
use common::*;
use multilora::{
    Engine, EngineHandle, Event, FinishReason, GenerateRequest, RequestStream, SamplingParams, StopReason,
};

#[test]
fn handles_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Engine>();
    check::<EngineHandle>();
    check::<multilora::EngineError>();
    check::<multilora::MetricsSnapshot>();
    fn send<T: Send>() {}
    send::<RequestStream>();
}

#[test]
fn public_enums_and_structs_are_non_exhaustive() -> Result<()> {
    // The one exception: `EngineError` is exhaustive so that every match over it (the server's
    // HTTP statuses) must handle a new variant.
    const EXHAUSTIVE: &[&str] = &["pub enum EngineError {"];
    let mut files = vec![std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src")];
    while let Some(path) = files.pop() {
        if path.is_dir() {
            for entry in std::fs::read_dir(&path)? {
                files.push(entry?.path());
            }
            continue;
        }
        let text = std::fs::read_to_string(&path)?;
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            if line.starts_with("pub enum ") && !EXHAUSTIVE.contains(line) {
                let attrs = &lines[i.saturating_sub(3)..i];
                assert!(attrs.iter().any(|l| l.contains("#[non_exhaustive]")), "{}: {line}", path.display());
            }
        }
    }
    Ok(())
}

#[test]
fn streaming_text_seeds_stops_and_logprobs() -> Result<()> {
    let engine = builder(2).build()?;
    // Streamed deltas add up to the decoded text and are valid UTF-8 by construction.
    let mut p = SamplingParams::greedy(16);
    p.ignore_eos = true;
    p.logprobs = Some(3);
    let mut stream = engine
        .submit(GenerateRequest::new("qv_r8", "The quick brown fox").params(p.validate(engine.config().vocab_size)?))?;
    let (mut text, mut n) = (String::new(), 0);
    while let Some(ev) = stream.recv_blocking() {
        match ev {
            Event::Token { text_delta, logprob, top_logprobs, id } => {
                text.push_str(&text_delta);
                n += 1;
                assert_eq!(top_logprobs.len(), 3);
                assert_eq!(top_logprobs[0].0, id, "greedy picks the most likely token");
                assert!((logprob.unwrap_or(1.0) - top_logprobs[0].1).abs() < 1e-6);
            }
            Event::Finished { reason, usage, stop_reason } => {
                assert_eq!((reason, usage.completion_tokens, stop_reason), (FinishReason::Length, 16, None));
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(n, 16);
    assert!(!text.contains('\u{FFFD}') || text.chars().filter(|&c| c == '\u{FFFD}').count() < 16);

    // Seeded sampling repeats; a stop string ends the request and is left out.
    let mut p = SamplingParams::default();
    p.seed = Some(42);
    p.max_tokens = Some(24);
    p.ignore_eos = true;
    p.top_k = 40;
    let a = engine
        .submit(GenerateRequest::new("all_r16", "Hello world").params(p.clone().validate(engine.config().vocab_size)?))?
        .collect_blocking()?;
    let b = engine
        .submit(GenerateRequest::new("all_r16", "Hello world").params(p.clone().validate(engine.config().vocab_size)?))?
        .collect_blocking()?;
    assert_eq!(a.token_ids, b.token_ids);
    if let Some(stop) =
        a.text.get(a.text.len() / 2..).and_then(|t| t.chars().find(|c| !c.is_whitespace() && *c != '\u{FFFD}'))
    {
        let mut ps = p.clone();
        ps.stop = vec![stop.to_string()];
        let c = engine
            .submit(GenerateRequest::new("all_r16", "Hello world").params(ps.validate(engine.config().vocab_size)?))?
            .collect_blocking()?;
        assert_eq!(c.finish_reason, FinishReason::Stop);
        assert_eq!(c.stop_reason, Some(StopReason::String(stop.to_string())), "the stop string found is named");
        assert!(!c.text.contains(stop), "{:?} contains {stop:?}", c.text);
        assert!(a.text.starts_with(&c.text));
    }
    // A stop token other than EOS is named too (vLLM's `stop_reason`), the first time it is sampled.
    let token = a.token_ids[a.token_ids.len() / 2];
    let mut pt = p.clone();
    pt.stop_token_ids = vec![token];
    let t = engine
        .submit(GenerateRequest::new("all_r16", "Hello world").params(pt.validate(engine.config().vocab_size)?))?
        .collect_blocking()?;
    let at = a.token_ids.iter().position(|&x| x == token).map(|i| i + 1);
    assert_eq!(
        (t.finish_reason, t.stop_reason, Some(t.token_ids.len())),
        (FinishReason::Stop, Some(StopReason::Token(token)), at)
    );
    Ok(())
}

#[test]
fn defaults_follow_the_startup_adapters_and_max_loras_zero_turns_lora_off() -> Result<()> {
    let engine = Engine::builder(path("base")).lora("sql", path("adapters/qv_r8")).kv_cache_bytes(16 << 20).build()?;
    let c = engine.config();
    assert_eq!(
        (c.lora.max_loras(), c.max_cpu_loras, c.lora.max_lora_rank()),
        (4, 32, 8),
        "rank from the startup adapter"
    );
    assert_eq!(c.served_model_name, path("base"), "served under the source string as given");
    assert_eq!(c.lora.target_modules().len(), 7, "the seven projections");
    assert!(c.lora_slot_bytes > 0);
    let models = engine.models();
    assert_eq!(models.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(), vec![path("base").as_str(), "sql"]);
    drop(engine);

    let with_embed = Engine::builder(path("base"))
        .lora("e", path("invalid_adapters/embed_target"))
        .lora("big", path("adapters/rank32"))
        .kv_cache_bytes(16 << 20)
        .build()?;
    assert_eq!(with_embed.config().lora.max_lora_rank(), 32);
    assert!(with_embed.config().lora.targets(multilora::ModuleKind::EmbedTokens));
    drop(with_embed);

    let off = Engine::builder(path("base")).served_model_name(BASE).max_loras(0).kv_cache_bytes(16 << 20).build()?;
    assert_eq!(off.config().lora_slot_bytes, 0, "no slot buffers");
    let mut p = SamplingParams::greedy(3);
    p.ignore_eos = true;
    assert_eq!(
        off.submit(GenerateRequest::new(BASE, vec![1, 2]).params(p.clone().validate(off.config().vocab_size)?))?
            .collect_blocking()?
            .token_ids
            .len(),
        3
    );
    // Refused at submit, before anything is queued.
    let err =
        off.submit(GenerateRequest::new("qv_r8", vec![1, 2]).params(p.validate(off.config().vocab_size)?)).unwrap_err();
    assert_eq!(err.kind(), "model_not_found");
    let err = Engine::builder(path("base")).max_loras(0).lora("x", path("adapters/qv_r8")).build().unwrap_err();
    assert_eq!(err.kind(), "invalid_config");
    Ok(())
}

#[test]
fn step_metrics_count_every_step_exactly() -> Result<()> {
    let engine = builder(4).build()?;
    let before = engine.metrics();
    let work = [("qv_r8", 5), ("all_r16", 7), (BASE, 3), ("qv_r8", 4)];
    let streams = work
        .iter()
        .map(|&(model, n)| {
            let mut p = SamplingParams::greedy(n);
            p.ignore_eos = true;
            engine
                .submit(GenerateRequest::new(model, vec![1, 294, 488]).params(p.validate(engine.config().vocab_size)?))
        })
        .collect::<multilora::Result<Vec<_>>>()?;
    for s in streams {
        s.collect_blocking()?;
    }
    let m = wait_for(&engine, |m| m.running == 0);
    let steps = m.steps - before.steps;
    assert!(steps >= 7, "the longest request alone needs 7 steps: {steps}");
    assert_eq!(m.step_rows.count - before.step_rows.count, steps);
    assert_eq!(m.step_adapters.count - before.step_adapters.count, steps);
    // A short prompt is one row in the step that prefills it, then one per decode step: each
    // request is in exactly as many steps as it has tokens.
    let rows = m.step_rows.sum - before.step_rows.sum;
    assert_eq!(rows, work.iter().map(|&(_, n)| n as f64).sum::<f64>(), "{m:?}");
    // Two adapters at most in any step, and at least one in each step with adapter rows.
    let adapters = m.step_adapters.sum - before.step_adapters.sum;
    assert!(adapters >= 7.0 && adapters <= 2.0 * steps as f64, "{adapters} over {steps} steps");
    let over_two: u64 = m.step_adapters.counts.iter().skip(3).sum();
    assert_eq!(over_two, 0, "bucket bounds 0, 1, 2 hold every step: {:?}", m.step_adapters);
    Ok(())
}
