//! Structured outputs' cost on SmolLM2's Q4_1 file (`MULTILORA_SMOLLM2_GGUF`): 16 streams of the
//! base model and its three adapters (`tests/fixtures/smollm2/adapters`), each with a JSON schema
//! of its own, against the same 16 unconstrained; and one stream of each. Every stream writes 48
//! new tokens (the schemas ask for at least 30 objects, so no reply can end sooner; the
//! unconstrained ones ignore EOS), so the tokens/s compare like for like. Compiled grammars are
//! cached by content: the first iteration compiles them, the others copy them, as a server that
//! sees the same schemas again does. After the runs it prints how many of the constrained tokens
//! the grammars forced, how many needed a mask (a greedy or plain-temperature row tries its token
//! first), and the mean time of a mask (`grammar_mask_duration`).
//!
//! `MULTILORA_SMOLLM2_GGUF=…/SmolLM2-135M-Instruct.Q4_1.gguf cargo bench -p multilora --bench structured`

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use multilora::{Constraint, Engine, GenerateRequest, SamplingParams};
use serde_json::json;

const NEW: usize = 48;
const MODELS: [&str; 4] = ["base", "french", "pirate", "shout"];

/// Tokens the constrained streams generated, in all.
static CONSTRAINED: AtomicUsize = AtomicUsize::new(0);

/// Stream `i`'s schema: at least 30 objects with keys of its own.
fn schema(i: usize) -> serde_json::Value {
    json!({"type": "array", "minItems": 30, "items": {"type": "object",
        "properties": {format!("id_{i}"): {"type": "integer", "minimum": 0, "maximum": 9999},
                       format!("label_{i}"): {"type": "string", "maxLength": 24}, "ok": {"type": "boolean"}},
        "required": [format!("id_{i}"), format!("label_{i}"), "ok"], "additionalProperties": false}})
}

/// Runs `rows` streams (constrained or not) to `NEW` tokens each; returns the tokens generated.
fn run(engine: &Engine, rows: usize, constrained: bool) -> usize {
    let streams: Vec<_> = (0..rows)
        .map(|i| {
            let mut p = SamplingParams::greedy(NEW);
            (p.temperature, p.seed) = (0.8, Some(i as u64));
            if constrained {
                p.constraint = Some(Constraint::JsonSchema(schema(i)));
            } else {
                p.ignore_eos = true;
            }
            let p = p.validate(engine.config().vocab_size).expect("valid");
            let prompt = format!("List items for user {i} as JSON.");
            engine.submit(GenerateRequest::new(MODELS[i % MODELS.len()], prompt).params(p)).expect("submit")
        })
        .collect();
    let tokens = streams.into_iter().map(|s| s.collect_blocking().expect("complete").token_ids.len()).sum();
    if constrained {
        CONSTRAINED.fetch_add(tokens, Ordering::Relaxed);
    }
    tokens
}

fn main() {
    let Some(gguf) = std::env::var_os("MULTILORA_SMOLLM2_GGUF").map(PathBuf::from) else {
        eprintln!("structured: MULTILORA_SMOLLM2_GGUF is not set (scripts/fetch-smollm2.sh fetches the file); skipped");
        return;
    };
    let adapters = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/smollm2/adapters");
    let mut b = Engine::builder(gguf.display().to_string()).served_model_name("base").max_loras(3);
    for a in &MODELS[1..] {
        b = b.lora(*a, adapters.join(a).display().to_string());
    }
    let engine = b.build().expect("engine");
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(20))
        .configure_from_args();
    for rows in [16, 1] {
        let mut g = c.benchmark_group(format!("structured/{rows}_rows"));
        g.throughput(Throughput::Elements((rows * NEW) as u64));
        for (name, constrained) in [("plain", false), ("json_schema", true)] {
            g.bench_function(BenchmarkId::from_parameter(name), |bench| {
                bench.iter_custom(|iters| {
                    let start = Instant::now();
                    for _ in 0..iters {
                        assert_eq!(run(&engine, rows, constrained), rows * NEW);
                    }
                    start.elapsed()
                })
            });
        }
        g.finish();
    }
    c.final_summary();
    let m = engine.metrics();
    let h = &m.grammar_mask_duration;
    let tokens = CONSTRAINED.load(Ordering::Relaxed);
    println!(
        "structured: {tokens} constrained tokens: {} forced by the grammars, {} masks computed ({:.0}%), \
         mean {:.1} µs a mask",
        m.grammar_forced_tokens,
        h.count,
        h.count as f64 * 100.0 / tokens.max(1) as f64,
        h.sum / h.count.max(1) as f64 * 1e6,
    );
}
