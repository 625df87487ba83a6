//! `multilora generate`: the offline batch runner. Every request of the input file is submitted
//! before any result is read, so the engine batches them together (mixed adapters per step);
//! results are written one line per request, in input order.
//!
//! Input policy: an unreadable file, a line that is not JSON, or a line that is not an object
//! stops the command (exit 2) before the engine is built, naming the line; an object with a bad
//! field (wrong type, unknown name, neither or both of `input_ids` / `prompt`) gets an
//! `invalid_request` error line and the other requests still run. Exit status 1 when any request
//! failed for an internal reason (the engine failed, …), after every line is written.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, anyhow};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use multilora::{GenerateRequest, Prompt, SamplingParams};
use serde_json::Value;

use crate::Failure;
use crate::engine_args::EngineArgs;
use crate::jsonl::{RequestLine, contract_kind, error_line, result_line};

/// `generate`'s flags (the contract; another program depends on them).
#[derive(Debug, Args)]
pub(crate) struct GenerateArgs {
    #[command(flatten)]
    pub(crate) engine: EngineArgs,
    /// Requests, one JSON object per line.
    #[arg(long)]
    pub(crate) input: PathBuf,
    /// Results, one JSON object per line, in input order.
    #[arg(long)]
    pub(crate) output: PathBuf,
}

/// One input line once read: a request to submit, or the error line it already earned.
#[derive(Debug)]
enum Parsed {
    /// `line`'s sampling fields were checked at parse; its parameters are made once the engine's
    /// defaults are known.
    Request {
        id: Value,
        model: Option<String>,
        prompt: PromptIn,
        line: Box<RequestLine>,
    },
    Error {
        id: Value,
        message: String,
    },
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
        let parsed = serde_json::from_value::<RequestLine>(v).map_err(|e| e.to_string()).and_then(|mut r| {
            r.params(SamplingParams::default())?;
            let prompt = match (r.input_ids.take(), r.prompt.take()) {
                (Some(ids), None) => PromptIn::Ids(ids),
                (None, Some(t)) => PromptIn::Text(t),
                _ => return Err("give exactly one of input_ids and prompt".to_string()),
            };
            Ok(Parsed::Request { id: id.clone(), model: r.model.take(), prompt, line: Box::new(r) })
        });
        out.push(parsed.unwrap_or_else(|message| Parsed::Error { id, message }));
    }
    Ok(out)
}

/// Runs `generate`.
pub(crate) fn run(a: GenerateArgs) -> Result<(), Failure> {
    let parsed = parse_input(&a.input)?;
    // Open the output before the (slow) engine build so a bad path fails at once.
    let file = File::create(&a.output)
        .with_context(|| format!("creating --output {}", a.output.display()))
        .map_err(Failure::input)?;
    let engine = a.engine.build(|b| b)?;
    let served = engine.config().served_model_name.clone();
    let defaults = engine.config().default_params();
    // Tokenize text prompts here (as the engine would: special tokens added) so `prompt_ids`
    // can be reported.
    let handle = engine.handle();

    let bar = ProgressBar::new(parsed.len() as u64);
    bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} requests {elapsed}").expect("valid template"));
    let mut pending = Vec::with_capacity(parsed.len());
    for p in parsed {
        let (id, model, prompt, params) = match p {
            Parsed::Error { id, message } => {
                pending.push(Err(error_line(&id, "invalid_request", &message)));
                continue;
            }
            Parsed::Request { id, model, prompt, line } => match line.params(defaults.clone()) {
                Ok(params) => (id, model.unwrap_or_else(|| served.clone()), prompt, Box::new(params)),
                Err(message) => {
                    pending.push(Err(error_line(&id, "invalid_request", &message)));
                    continue;
                }
            },
        };
        let (engine_prompt, ids) = match prompt {
            PromptIn::Ids(ids) => (Prompt::Tokens(ids.clone()), Some(ids)),
            PromptIn::Text(t) => match handle.tokenize(&t, true) {
                Ok(ids) => (Prompt::Tokens(ids.clone()), Some(ids)),
                Err(e) => {
                    pending.push(Err(error_line(&id, "invalid_request", &e.to_string())));
                    continue;
                }
            },
        };
        let submitted = (*params)
            .clone()
            .validate(engine.config().vocab_size)
            .and_then(|valid| engine.submit(GenerateRequest::new(model.clone(), engine_prompt).params(valid)));
        match submitted {
            Ok(stream) => pending.push(Ok((id, model, ids, params, stream))),
            Err(e) => pending.push(Err(error_line(&id, contract_kind(&e), &e.to_string()))),
        }
    }

    let mut w = BufWriter::new(file);
    let mut internal = 0usize;
    for p in pending {
        let line = match p {
            Err(line) => line,
            Ok((id, model, ids, params, stream)) => match stream.collect_blocking() {
                Ok(c) => result_line(&id, &model, ids.as_deref(), &params, &c),
                Err(e) => error_line(&id, contract_kind(&e), &e.to_string()),
            },
        };
        if line.pointer("/error/kind").and_then(Value::as_str) == Some("internal") {
            internal += 1;
        }
        bar.inc(1);
        writeln!(w, "{line}").with_context(|| format!("writing {}", a.output.display()))?;
    }
    w.flush().with_context(|| format!("writing {}", a.output.display()))?;
    bar.finish_and_clear();
    engine.shutdown();
    // Every line is written; a request that failed for the engine's own reason (not its input)
    // still makes the run a failure, so a script does not take a broken run for a good one.
    if internal > 0 {
        return Err(Failure::from(anyhow!(
            "{internal} request(s) failed for an internal reason (their error lines are in {})",
            a.output.display()
        )));
    }
    Ok(())
}
