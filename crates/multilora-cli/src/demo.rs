//! `multilora demo`: what multi-LoRA serving does, on this machine, in about a minute.
//!
//! With no arguments it builds (once, deterministically, in a cache directory) a small
//! Llama-architecture model with random weights, the fixture's real byte-level BPE
//! `tokenizer.json` (vocab 512) and 8 PEFT adapters of different ranks, then serves a mixed
//! workload through the engine twice: with 4 adapter slots, and with 1 for contrast. Every figure
//! printed is exact: the step figures from the engine's step metrics (every step counted), the
//! time to first token from each request's own clock, throughput from the wall clock.

#[cfg(test)]
use std::collections::BTreeSet;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow};
use candle_core::{Device, Tensor};
use clap::Args;
use clap::builder::TypedValueParser;
use indicatif::{ProgressBar, ProgressStyle};
use multilora::{Engine, Event, GenerateRequest, MetricsSnapshot, SamplingParams};
use multilora_adapter::{ModelShapes, SyntheticAdapter};
use multilora_types::{ModuleKind, SplitMix64};
use serde_json::json;

use crate::Failure;

/// The fixture's tokenizer: a real byte-level BPE tokenizer, small enough to embed.
const TOKENIZER: &[u8] = include_bytes!("../../../tests/fixtures/peft-tiny/base/tokenizer.json");
/// Bump when the generated model changes, so a stale cache is not reused.
const DEMO_VERSION: &str = "v2";
const HIDDEN: usize = 256;
const LAYERS: usize = 4;
const HEADS: usize = 8;
const KV_HEADS: usize = 4;
const HEAD_DIM: usize = 32;
const MLP: usize = 704;
const VOCAB: usize = 512;
/// The demo's adapters: name, rank, target modules.
const ADAPTERS: [(&str, usize, &[ModuleKind]); 8] = {
    use ModuleKind::{DownProj as D, GateProj as G, KProj as K, OProj as O, QProj as Q, UpProj as U, VProj as V};
    [
        ("sql", 8, &[Q, V]),
        ("chat", 16, &[Q, K, V, O]),
        ("code", 32, &[Q, K, V, O, G, U, D]),
        ("math", 4, &[Q, V]),
        ("legal", 16, &[Q, V, G, U, D]),
        ("medical", 8, &[Q, K, V, O]),
        ("poetry", 64, &[Q, V]),
        ("support", 2, &[Q, K, V, O, G, U, D]),
    ]
};

/// `demo`'s flags.
#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// Where the demo model is built (default `$XDG_CACHE_HOME/multilora/demo` or `~/.cache/multilora/demo`).
    #[arg(long)]
    pub(crate) cache_dir: Option<PathBuf>,
    /// Run on this model (a directory, a GGUF file or a hub id) instead of the built one; with a
    /// chat template, every model first answers the same question.
    #[arg(long)]
    pub(crate) model: Option<String>,
    /// Adapters for `--model`, `NAME=<DIR|FILE.gguf|HUB_ID>`; repeatable.
    #[arg(long = "lora", value_parser = crate::engine_args::parse_lora)]
    pub(crate) loras: Vec<(String, String)>,
    /// Requests in the workload.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..).map(|v| v as usize))]
    pub(crate) requests: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..).map(|v| v as usize))]
    pub(crate) max_tokens: usize,
    /// Sampling temperature of the workload's requests (0: greedy, to compare with).
    #[arg(long, default_value_t = 0.8)]
    pub(crate) temperature: f32,
}

impl Default for DemoArgs {
    /// What `multilora` with no arguments runs: clap's defaults, which a derived Default would not see.
    fn default() -> DemoArgs {
        DemoArgs { cache_dir: None, model: None, loras: Vec::new(), requests: 300, max_tokens: 16, temperature: 0.8 }
    }
}

/// A [rows, cols] tensor, uniform with standard deviation `std`.
fn random(rng: &mut SplitMix64, rows: usize, cols: usize, std: f32) -> candle_core::Result<Tensor> {
    let a = std * 3f32.sqrt();
    let v: Vec<f32> = (0..rows * cols).map(|_| rng.unit_f32() * a).collect();
    Tensor::from_vec(v, (rows, cols), &Device::Cpu)
}

fn module_shape(m: &str) -> (usize, usize) {
    match m {
        "q_proj" => (HIDDEN, HEADS * HEAD_DIM),
        "k_proj" | "v_proj" => (HIDDEN, KV_HEADS * HEAD_DIM),
        "o_proj" => (HEADS * HEAD_DIM, HIDDEN),
        "gate_proj" | "up_proj" => (HIDDEN, MLP),
        _ => (MLP, HIDDEN),
    }
}

fn module_group(m: &str) -> &'static str {
    if ["gate_proj", "up_proj", "down_proj"].contains(&m) { "mlp" } else { "self_attn" }
}

fn write_model(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let config = json!({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": MLP, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": false,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32"});
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config)?)?;
    std::fs::write(dir.join("tokenizer.json"), TOKENIZER)?;
    let mut rng = SplitMix64::new(0x5EED);
    let mut t = HashMap::new();
    let ones = Tensor::ones(HIDDEN, candle_core::DType::F32, &Device::Cpu)?;
    t.insert("model.embed_tokens.weight".to_string(), random(&mut rng, VOCAB, HIDDEN, 1.0)?);
    for l in 0..LAYERS {
        for m in ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] {
            let (i, o) = module_shape(m);
            let w = random(&mut rng, o, i, 1.0 / (i as f32).sqrt())?;
            t.insert(format!("model.layers.{l}.{}.{m}.weight", module_group(m)), w);
        }
        t.insert(format!("model.layers.{l}.input_layernorm.weight"), ones.clone());
        t.insert(format!("model.layers.{l}.post_attention_layernorm.weight"), ones.clone());
    }
    t.insert("model.norm.weight".to_string(), ones);
    // A larger head scale gives peaked next-token distributions, like a trained model's.
    t.insert("lm_head.weight".to_string(), random(&mut rng, VOCAB, HIDDEN, 3.0 / (HIDDEN as f32).sqrt())?);
    candle_core::safetensors::save(&t, dir.join("model.safetensors"))?;
    // The adapters are real PEFT files, written by the adapter crate's seeded generator.
    let shapes = ModelShapes::llama(LAYERS, HIDDEN, MLP, VOCAB, HEADS, KV_HEADS);
    for (k, (name, r, targets)) in ADAPTERS.iter().enumerate() {
        let mut adapter = SyntheticAdapter::new(*r, targets, 0xADA0 + k as u64);
        adapter.std = 0.06;
        adapter.write(&dir.join("adapters").join(name), &shapes)?;
    }
    Ok(())
}

/// The built model's directory, building it first when absent.
fn demo_model(cache: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    let root = match cache {
        Some(c) => c,
        None => std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .ok_or_else(|| anyhow!("no cache directory: set XDG_CACHE_HOME or HOME, or pass --cache-dir"))?
            .join("multilora")
            .join("demo"),
    };
    let dir = root.join(DEMO_VERSION);
    if dir.join(".complete").is_file() {
        return Ok(dir);
    }
    eprintln!("building the demo model and 8 adapters in {} (once)", dir.display());
    // Build beside the final place and rename, so an interrupted build is never taken as done.
    let tmp = root.join(format!("{DEMO_VERSION}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    write_model(&tmp).with_context(|| format!("writing the demo model in {}", tmp.display()))?;
    std::fs::write(tmp.join(".complete"), "")?;
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&tmp, &dir).with_context(|| format!("moving the demo model to {}", dir.display()))?;
    Ok(dir)
}

const SYSTEM: &str = "You are a careful assistant for a small company. Answer in one short paragraph, \
    cite the relevant rule when there is one, and say so plainly when you do not know. ";
const QUESTIONS: [&str; 12] = [
    "How do I reset my password?",
    "Write a query that lists last month's orders.",
    "What is the capital of France?",
    "Summarise the refund policy.",
    "def add(a, b): return a + b  # explain this",
    "Once upon a time, in a village by the river,",
    "What is 17 times 23?",
    "Is this contract clause enforceable?",
    "List three symptoms of the flu.",
    "Write a haiku about the sea.",
    "My parcel has not arrived, what now?",
    "Translate 'good morning' to Spanish.",
];

/// The workload: model name per request (skewed: a few adapters are popular), and a prompt that
/// shares the system prompt so the prefix cache can hit.
fn workload(n: usize, served: &str, adapters: &[String]) -> Vec<(String, String)> {
    let mut rng = SplitMix64::new(42);
    let mut names = vec![served.to_string()];
    names.extend(adapters.iter().cloned());
    // Zipf-like weights 1/(k+1): the base and the first adapters get most requests.
    let weights: Vec<f64> = (0..names.len()).map(|k| 1.0 / (k + 1) as f64).collect();
    let total: f64 = weights.iter().sum();
    (0..n)
        .map(|i| {
            let mut x = rng.next_f64() * total;
            let k = weights.iter().position(|w| {
                x -= w;
                x < 0.0
            });
            let model = names[k.unwrap_or(names.len() - 1)].clone();
            (model, format!("{SYSTEM}{}", QUESTIONS[i % QUESTIONS.len()]))
        })
        .collect()
}

/// What one run measured.
#[derive(Debug)]
struct RunReport {
    wall: Duration,
    metrics: MetricsSnapshot,
    /// Each request's time from its submission to its first token.
    ttft: Vec<Duration>,
    errors: usize,
}

impl RunReport {
    fn tokens_per_s(&self) -> f64 {
        self.metrics.generation_tokens as f64 / self.wall.as_secs_f64()
    }
}

/// Percentile `p` of `v` in milliseconds (nearest rank).
fn percentile_ms(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    v.get(((v.len() as f64 - 1.0) * p).round() as usize).map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
}

fn run_once(
    model: &str,
    loras: &[(String, String)],
    max_loras: usize,
    work: &[(String, String)],
    params: &SamplingParams,
) -> anyhow::Result<RunReport> {
    let mut b = Engine::builder(model.to_string()).served_model_name("base").max_loras(max_loras);
    for (n, s) in loras {
        b = b.lora(n, s);
    }
    let engine = b.build().map_err(|e| anyhow!("{e}"))?;
    let params = params.clone().validate(engine.config().vocab_size).map_err(|e| anyhow!("{e}"))?;
    let bar = ProgressBar::new(work.len() as u64);
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "max_loras {max_loras}: {{bar:40}} {{pos}}/{{len}} requests {{elapsed}}"
        ))
        .expect("valid template"),
    );
    let start = Instant::now();
    let mut streams = Vec::with_capacity(work.len());
    for (i, (m, p)) in work.iter().enumerate() {
        let params = params.clone().with_seed(Some(i as u64));
        streams.push((Instant::now(), engine.submit(GenerateRequest::new(m.clone(), p.as_str()).params(params))));
    }
    // One reader per request, so that each first token is timed when it arrives.
    let outcomes: Vec<Option<Duration>> = std::thread::scope(|s| {
        let readers: Vec<_> = streams
            .into_iter()
            .map(|(submitted, stream)| {
                let bar = &bar;
                s.spawn(move || {
                    let mut stream = stream.ok()?;
                    let mut first = None;
                    while let Some(ev) = stream.recv_blocking() {
                        match ev {
                            Event::Token { .. } => {
                                first.get_or_insert_with(|| submitted.elapsed());
                            }
                            Event::Finished { .. } => break,
                            Event::Error(_) => return None,
                            _ => {}
                        }
                    }
                    bar.inc(1);
                    first
                })
            })
            .collect();
        readers.into_iter().map(|r| r.join().unwrap_or(None)).collect()
    });
    let wall = start.elapsed();
    bar.finish_and_clear();
    let metrics = engine.metrics();
    engine.shutdown();
    let errors = outcomes.iter().filter(|o| o.is_none()).count();
    Ok(RunReport { wall, metrics, ttft: outcomes.into_iter().flatten().collect(), errors })
}

fn print_report(r: &mut RunReport, max_loras: usize) {
    let secs = r.wall.as_secs_f64();
    let tokens_per_s = r.tokens_per_s();
    let (p50, p99) = (percentile_ms(&mut r.ttft, 0.5), percentile_ms(&mut r.ttft, 0.99));
    let m = &r.metrics;
    println!("== max_loras {max_loras} ==");
    let per: Vec<String> = m.per_adapter.iter().map(|(k, u)| format!("{k} {}", u.requests)).collect();
    println!("requests per model:        {}", per.join(", "));
    println!("engine steps:              {} (failed requests: {})", m.steps, r.errors);
    println!("mean batch size:           {:.1} sequences per step", m.step_rows.mean());
    println!("distinct adapters / step:  {:.2}", m.step_adapters.mean());
    let hit = if m.prefix_cache_query_tokens == 0 {
        0.0
    } else {
        100.0 * m.prefix_cache_hit_tokens as f64 / m.prefix_cache_query_tokens as f64
    };
    println!(
        "prefix-cache hit rate:     {hit:.1}% ({} of {} prompt tokens)",
        m.prefix_cache_hit_tokens, m.prefix_cache_query_tokens
    );
    println!(
        "adapter tier moves:        {} loads disk -> CPU, {} evictions (CPU tier and device slots); {} of {} slots in use at the end",
        m.adapter_loads, m.adapter_evictions, m.device_tier.entries, m.device_tier.capacity
    );
    println!(
        "throughput:                {tokens_per_s:.0} generated tokens/s ({} tokens in {secs:.1} s)",
        m.generation_tokens
    );
    println!("time to first token:       p50 {p50:.0} ms, p99 {p99:.0} ms (each request's own clock)");
}

/// The question every model answers first when the demo runs on a real model.
const ANSWER_QUESTION: &str = "What is the capital of France? Answer in one sentence.";

/// On a model with a chat template (a real model): the same question to the base and to every
/// adapter, greedy, all in one mixed batch, and one short answer each, so the adapters' voices
/// show side by side. A model without a template (the built one) prints nothing here.
fn print_answers(model: &str, loras: &[(String, String)]) -> anyhow::Result<()> {
    let mut b = Engine::builder(model.to_string()).served_model_name("base").max_loras(loras.len().max(1));
    for (n, s) in loras {
        b = b.lora(n, s);
    }
    let engine = b.build().map_err(|e| anyhow!("{e}"))?;
    let Some(source) = engine.config().chat_template.clone() else { return Ok(()) };
    let template = multilora_server::ChatTemplate::from_source(&source).map_err(|e| anyhow!("{e}"))?;
    let prompt = template
        .render(&[json!({"role": "user", "content": ANSWER_QUESTION})], true, &Default::default())
        .map_err(|e| anyhow!("{e}"))?;
    let ids = engine.handle().tokenize(&prompt, false).map_err(|e| anyhow!("{e}"))?;
    let names: Vec<&str> = std::iter::once("base").chain(loras.iter().map(|(n, _)| n.as_str())).collect();
    let greedy = SamplingParams::greedy(40).validate(engine.config().vocab_size).map_err(|e| anyhow!("{e}"))?;
    let streams = names
        .iter()
        .map(|n| engine.submit(GenerateRequest::new(*n, multilora::Prompt::Tokens(ids.clone())).params(greedy.clone())))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow!("{e}"))?;
    println!("{ANSWER_QUESTION}");
    let width = names.iter().map(|n| n.len()).max().unwrap_or(4);
    for (name, stream) in names.iter().zip(streams) {
        let done = stream.collect_blocking().map_err(|e| anyhow!("{e}"))?;
        println!("  {name:>width$}: {}", done.text.trim().replace('\n', " "));
    }
    println!();
    engine.shutdown();
    Ok(())
}

/// Runs the demo.
pub(crate) fn run(a: DemoArgs) -> Result<(), Failure> {
    let (model, loras) = match &a.model {
        Some(m) => (m.clone(), a.loras.clone()),
        None => {
            let dir = demo_model(a.cache_dir.clone()).map_err(Failure::input)?;
            let loras = ADAPTERS
                .iter()
                .map(|(n, _, _)| (n.to_string(), dir.join("adapters").join(n).display().to_string()))
                .collect();
            (dir.display().to_string(), loras)
        }
    };
    if a.model.is_some() {
        print_answers(&model, &loras).map_err(Failure::input)?;
    }
    let names: Vec<String> = loras.iter().map(|(n, _)| n.clone()).collect();
    let work = workload(a.requests, "base", &names);
    let mut params = SamplingParams::default();
    params.temperature = a.temperature;
    params.max_tokens = Some(a.max_tokens.max(1));
    params.ignore_eos = true; // every request generates the same number of tokens in both runs
    println!(
        "workload: {} requests, {} new tokens each (temperature {}), over the base and {} adapters, one shared \
         system prompt",
        work.len(),
        a.max_tokens,
        a.temperature,
        names.len()
    );
    let mut wide = run_once(&model, &loras, 4, &work, &params).map_err(Failure::input)?;
    print_report(&mut wide, 4);
    let mut narrow = run_once(&model, &loras, 1, &work, &params).map_err(Failure::input)?;
    print_report(&mut narrow, 1);
    println!(
        "=> with 4 slots a step mixes up to 4 adapters ({:.2} on average), so requests for different adapters share \
         each forward pass; with 1 slot each step serves one adapter and requests for the others wait: {:.0} vs {:.0} tokens/s, \
         {:.1}x the wall time.",
        wide.metrics.step_adapters.mean(),
        wide.tokens_per_s(),
        narrow.tokens_per_s(),
        narrow.wall.as_secs_f64() / wide.wall.as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workload_is_deterministic_and_mixed() {
        let names: Vec<String> = ADAPTERS.iter().map(|(n, _, _)| n.to_string()).collect();
        let a = workload(300, "base", &names);
        assert_eq!(a, workload(300, "base", &names));
        let distinct: BTreeSet<&str> = a.iter().map(|(m, _)| m.as_str()).collect();
        assert_eq!(distinct.len(), 9);
        assert!(a.iter().all(|(_, p)| p.starts_with(SYSTEM)));
    }
}
