//! `multilora generate`: the offline batch runner. Every request of the input file is submitted
//! before any result is read, so the engine batches them together (mixed adapters per step);
//! results are written one line per request, in input order.
//!
//! Input policy: an unreadable file, a line that is not JSON, or a line that is not an object
//! stops the command (exit 2) before the engine is built, naming the line; an object with a bad
//! field (wrong type, unknown name, neither or both of `input_ids` / `prompt`) gets an
//! `invalid_request` error line and the other requests still run.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, anyhow};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use multilora::{DType, Device, Engine, GenerateRequest, Prompt, SamplingParams};
use serde_json::Value;

use crate::Failure;
use crate::jsonl::{RequestLine, contract_kind, error_line, result_line};

/// `generate`'s flags (the contract; another program depends on them).
#[derive(Debug, Args)]
pub(crate) struct GenerateArgs {
    /// Base model: a directory or a hub id.
    #[arg(long)]
    pub(crate) model: String,
    /// The base model's name in requests (default: `--model` as given).
    #[arg(long)]
    pub(crate) served_model_name: Option<String>,
    /// An adapter, `NAME=<DIR|HUB_ID>`; repeatable.
    #[arg(long = "lora", value_parser = parse_lora)]
    pub(crate) loras: Vec<(String, String)>,
    /// Adapter slots: distinct adapters per step.
    #[arg(long)]
    pub(crate) max_loras: Option<usize>,
    /// Adapters kept in host memory.
    #[arg(long)]
    pub(crate) max_cpu_loras: Option<usize>,
    /// Rank of every slot.
    #[arg(long)]
    pub(crate) max_lora_rank: Option<usize>,
    /// Most running requests.
    #[arg(long)]
    pub(crate) max_num_seqs: Option<usize>,
    /// Most tokens per step.
    #[arg(long)]
    pub(crate) max_num_batched_tokens: Option<usize>,
    /// `cpu` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// Model dtype.
    #[arg(long, value_parser = ["f32", "bf16", "f16"])]
    pub(crate) dtype: Option<String>,
    /// Requests, one JSON object per line.
    #[arg(long)]
    pub(crate) input: PathBuf,
    /// Results, one JSON object per line, in input order.
    #[arg(long)]
    pub(crate) output: PathBuf,
}

fn parse_lora(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((n, src)) if !n.is_empty() && !src.is_empty() => Ok((n.to_string(), src.to_string())),
        _ => Err(format!("expected NAME=<DIR|HUB_ID>, got {s:?}")),
    }
}

fn parse_device(s: &str) -> anyhow::Result<Device> {
    if s == "cpu" {
        return Ok(Device::Cpu);
    }
    let n = s.strip_prefix("cuda:").or((s == "cuda").then_some("0"));
    let n: usize =
        n.and_then(|n| n.parse().ok()).ok_or_else(|| anyhow!("--device must be cpu or cuda:N, got {s:?}"))?;
    Device::new_cuda(n).with_context(|| format!("--device {s}"))
}

/// One input line once read: a request to submit, or the error line it already earned.
#[derive(Debug)]
enum Parsed {
    Request { id: Value, model: Option<String>, prompt: PromptIn, params: Box<SamplingParams> },
    Error { id: Value, message: String },
}

#[derive(Debug)]
enum PromptIn {
    Ids(Vec<u32>),
    Text(String),
}

fn parse_input(path: &Path) -> Result<Vec<Parsed>, Failure> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading --input {}", path.display()))
        .map_err(Failure::input)?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue; // blank lines (a trailing newline, say) are not requests
        }
        let bad = |m: String| Failure::input(anyhow!("{} line {}: {m}", path.display(), i + 1));
        let v: Value = serde_json::from_str(line).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        if !v.is_object() {
            return Err(bad("not a JSON object".into()));
        }
        let id = v.get("id").cloned().unwrap_or(Value::Null);
        let parsed = serde_json::from_value::<RequestLine>(v).map_err(|e| e.to_string()).and_then(|r| {
            let params = r.params()?;
            let prompt = match (r.input_ids, r.prompt) {
                (Some(ids), None) => PromptIn::Ids(ids),
                (None, Some(t)) => PromptIn::Text(t),
                _ => return Err("give exactly one of input_ids and prompt".to_string()),
            };
            Ok(Parsed::Request { id: id.clone(), model: r.model, prompt, params: Box::new(params) })
        });
        out.push(parsed.unwrap_or_else(|message| Parsed::Error { id, message }));
    }
    Ok(out)
}

fn build_engine(a: &GenerateArgs) -> Result<Engine, Failure> {
    let mut b = Engine::builder(a.model.clone())
        .served_model_name(a.served_model_name.clone().unwrap_or_else(|| a.model.clone()))
        .device(parse_device(&a.device).map_err(Failure::input)?);
    if let Some(d) = &a.dtype {
        b = b.dtype(match d.as_str() {
            "bf16" => DType::BF16,
            "f16" => DType::F16,
            _ => DType::F32,
        });
    }
    for (name, src) in &a.loras {
        b = b.lora(name, src);
    }
    if let Some(n) = a.max_loras {
        b = b.max_loras(n);
    }
    if let Some(n) = a.max_cpu_loras {
        b = b.max_cpu_loras(n);
    }
    if let Some(n) = a.max_lora_rank {
        b = b.max_lora_rank(n);
    }
    if let Some(n) = a.max_num_seqs {
        b = b.max_num_seqs(n);
    }
    if let Some(n) = a.max_num_batched_tokens {
        b = b.max_num_batched_tokens(n);
    }
    b.build().map_err(|e| {
        // The adapter error's text names the adapter, its file and the reason; say which flag.
        // (its message already starts with `adapter "NAME":`, so it is not repeated here).
        match &e {
            multilora::EngineError::Adapter { message, .. } => Failure::input(anyhow!("--lora: {message}")),
            _ => Failure::input(anyhow!("--model {}: {e}", a.model)),
        }
    })
}

/// Runs `generate`.
pub(crate) fn run(a: GenerateArgs) -> Result<(), Failure> {
    let parsed = parse_input(&a.input)?;
    // Open the output before the (slow) engine build so a bad path fails at once.
    let file = File::create(&a.output)
        .with_context(|| format!("creating --output {}", a.output.display()))
        .map_err(Failure::input)?;
    let engine = build_engine(&a)?;
    let served = engine.config().served_model_name.clone();
    // Tokenize text prompts here (as the engine would: special tokens added) so `prompt_ids`
    // can be reported; without a local tokenizer.json the engine tokenizes and it is null.
    let tokenizer = {
        let p = Path::new(&a.model).join("tokenizer.json");
        p.is_file().then(|| tokenizers::Tokenizer::from_file(&p).ok()).flatten()
    };

    let bar = ProgressBar::new(parsed.len() as u64);
    bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} requests {elapsed}").expect("valid template"));
    let mut pending = Vec::with_capacity(parsed.len());
    for p in parsed {
        let (id, model, prompt, params) = match p {
            Parsed::Error { id, message } => {
                pending.push(Err(error_line(&id, "invalid_request", &message)));
                continue;
            }
            Parsed::Request { id, model, prompt, params } => {
                (id, model.unwrap_or_else(|| served.clone()), prompt, params)
            }
        };
        let (engine_prompt, ids) = match prompt {
            PromptIn::Ids(ids) => (Prompt::Tokens(ids.clone()), Some(ids)),
            PromptIn::Text(t) => match &tokenizer {
                Some(tok) => match tok.encode(t.as_str(), true) {
                    Ok(enc) => (Prompt::Tokens(enc.get_ids().to_vec()), Some(enc.get_ids().to_vec())),
                    Err(e) => {
                        pending.push(Err(error_line(&id, "invalid_request", &format!("tokenizing: {e}"))));
                        continue;
                    }
                },
                None => (Prompt::Text(t), None),
            },
        };
        let req = GenerateRequest::new(model.clone(), engine_prompt).params((*params).clone());
        match engine.submit(req) {
            Ok(stream) => pending.push(Ok((id, model, ids, params, stream))),
            Err(e) => pending.push(Err(error_line(&id, contract_kind(&e), &e.to_string()))),
        }
    }

    let mut w = BufWriter::new(file);
    for p in pending {
        let line = match p {
            Err(line) => line,
            Ok((id, model, ids, params, stream)) => match stream.collect_blocking() {
                Ok(c) => result_line(&id, &model, ids.as_deref(), &params, &c),
                Err(e) => error_line(&id, contract_kind(&e), &e.to_string()),
            },
        };
        bar.inc(1);
        writeln!(w, "{line}").with_context(|| format!("writing {}", a.output.display()))?;
    }
    w.flush().with_context(|| format!("writing {}", a.output.display()))?;
    bar.finish_and_clear();
    engine.shutdown();
    Ok(())
}
