//! End-to-end throughput through the engine API on the PEFT comparison model shape (hidden 1024,
//! intermediate 2816, 8 layers, 16 heads / 8 KV heads, vocab 32000; random weights written to a
//! temp dir as an f32 checkpoint and a bf16 copy of it, each served in its own dtype, `auto`):
//! 16 requests of 64-token prompts and 32 greedy new tokens, (1) base only, (2) over 8 rank-16
//! adapters on all seven projections, (3) the same with `max_loras 1`, each in f32 and in bf16,
//! and (4) f32 (2) with the step-time budget off (the default is `auto`: the ratio of (2) to (4)
//! is its cost on a burst that arrives at once).
//! After criterion, a summary prints new tokens/s and the ratios to the base run from rounds that
//! run every scenario in turn (medians), so that the machine's drift falls on all of them alike.
//!
//! `cargo bench -p multilora --bench cpu_engine -- --warm-up-time 1 --measurement-time 10`

use std::path::Path;
use std::time::Instant;

use common::{ADAPTERS, write_model};
use criterion::Criterion;
use multilora::{DEFAULT_STEP_FACTOR, Engine, GenerateRequest, SamplingParams, StepTime};

mod common;

const REQUESTS: usize = 16;
const PROMPT: usize = 64;
const NEW: usize = 32;

fn engine(model: &Path, dir: &Path, max_loras: usize, step_time: StepTime) -> anyhow::Result<Engine> {
    let mut b = Engine::builder(model.display().to_string())
        .served_model_name("base")
        .max_loras(max_loras)
        .kv_cache_bytes(512 << 20)
        .enable_prefix_caching(false)
        .step_time(step_time);
    for a in 0..ADAPTERS {
        b = b.lora(format!("lora{a}"), dir.join(format!("lora{a}")).display().to_string());
    }
    Ok(b.build()?)
}

/// Submits the 16 requests at once and waits for all; returns new tokens generated.
fn run(engine: &Engine, mixed: bool) -> usize {
    let mut p = SamplingParams::greedy(NEW);
    p.ignore_eos = true;
    let p = p.validate(engine.config().vocab_size).expect("valid parameters");
    let streams: Vec<_> = (0..REQUESTS)
        .map(|r| {
            let model = if mixed { format!("lora{}", r % ADAPTERS) } else { "base".to_string() };
            let prompt: Vec<u32> = (0..PROMPT).map(|k| ((r * 131 + k * 17) % 31990 + 3) as u32).collect();
            engine.submit(GenerateRequest::new(model, prompt).params(p.clone())).expect("submit")
        })
        .collect();
    streams.into_iter().map(|s| s.collect_blocking().expect("request").token_ids.len()).sum()
}

/// Rounds of the alternating summary: each round runs every scenario once, in turn.
const ROUNDS: usize = 7;

fn main() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    write_model(tmp.path())?;
    let bf16 = tmp.path().join("bf16");
    multilora_models::write_checkpoint_copy(tmp.path(), &bf16, candle_core::DType::BF16)?;
    let mut criterion = Criterion::default().configure_from_args().sample_size(10);
    let auto = StepTime::Auto { factor: DEFAULT_STEP_FACTOR };
    let (f32_dir, bf16_dir) = (tmp.path(), bf16.as_path());
    let scenarios = [
        ("f32 base only", f32_dir, 8, false, auto),
        ("f32 16 over 8 adapters", f32_dir, 8, true, auto),
        ("f32 16 over 8 adapters, max_loras 1", f32_dir, 1, true, auto),
        ("f32 16 over 8 adapters, step time off", f32_dir, 8, true, StepTime::Unbounded),
        ("bf16 base only", bf16_dir, 8, false, auto),
        ("bf16 16 over 8 adapters", bf16_dir, 8, true, auto),
        ("bf16 16 over 8 adapters, max_loras 1", bf16_dir, 1, true, auto),
    ];
    let engines = scenarios
        .iter()
        .map(|&(_, model, max_loras, _, step_time)| engine(model, tmp.path(), max_loras, step_time))
        .collect::<Result<Vec<_>, _>>()?;
    for e in [&engines[0], &engines[4]] {
        println!("{:?}: {}", e.config().dtype, e.config().kernels);
    }
    let scenarios: Vec<_> = scenarios.iter().map(|&(name, _, l, mixed, st)| (name, l, mixed, st)).collect();
    for ((name, _, mixed, _), engine) in scenarios.iter().zip(&engines) {
        run(engine, *mixed);
        criterion.bench_function(&format!("cpu_engine/{name}"), |b| b.iter(|| run(engine, *mixed)));
    }
    criterion.final_summary();
    // The scenarios one after another, round after round, so that a slower or faster spell of a
    // shared machine falls on all of them: medians of the times and of the per-round ratios.
    let mut times = vec![Vec::new(); scenarios.len()];
    let mut ratios = vec![Vec::new(); scenarios.len()];
    let mut tokens = 0;
    for _ in 0..ROUNDS {
        let mut t = Vec::new();
        for ((_, _, mixed, _), engine) in scenarios.iter().zip(&engines) {
            let start = Instant::now();
            tokens = run(engine, *mixed);
            t.push(start.elapsed().as_secs_f64());
        }
        for (i, &ti) in t.iter().enumerate() {
            times[i].push(ti);
            ratios[i].push(t[0] / ti);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!("\nend-to-end new tokens/s (16 requests, 64-token prompts, 32 new tokens; PEFT mixed: 131),");
    println!("medians of {ROUNDS} alternating rounds:");
    for (i, (name, _, _, _)) in scenarios.iter().enumerate() {
        let tps = tokens as f64 / median(&mut times[i]);
        println!(
            "  {name:<39} {tps:8.1} tok/s   {:.3}x f32 base (per-round median)   {:.2}x PEFT mixed",
            median(&mut ratios[i]),
            tps / 131.0
        );
    }
    Ok(())
}
