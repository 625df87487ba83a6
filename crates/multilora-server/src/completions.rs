//! `POST /v1/completions`: prompts in every OpenAI shape, `n` choices per prompt, legacy
//! `logprobs` (tokens, token_logprobs, top_logprobs as `{token: logprob}`, text_offset),
//! `echo` (the prompt before the completion, its tokens' logprobs too when `logprobs` asks),
//! vLLM's `prompt_logprobs`, structured outputs (`structured.rs`), and streaming.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::Response;
use multilora::{EngineHandle, Prompt, PromptLogprob};
use serde_json::{Map, Value, json};

use crate::error::Result;
use crate::generation::{
    self, End, Meta, Output, Render, TokenOut, choices_body, prompt_logprobs_json, stop_reason_json, usage_chunk,
};
use crate::protocol::{CompletionRequest, fan_out};
use crate::state::{AppState, unix_now};

/// `max_tokens` of a completion that names none (OpenAI's and vLLM's default).
pub(crate) const DEFAULT_MAX_TOKENS: usize = 16;

pub(crate) async fn completions(State(state): State<AppState>, body: Bytes) -> Result<Response> {
    let req = CompletionRequest::parse(&body)?;
    let prompts = req.prompts()?;
    let n = req.sampling.n()?;
    // Counted before the n copies of every prompt are built.
    let admission = state.admit(prompts.len().saturating_mul(n))?;
    // OpenAI's and vLLM's default for completions: 16 tokens, not the rest of the context
    // (unless the checkpoint's generation_config.json sets `max_new_tokens`).
    let base = state.engine.config().default_params();
    let max_tokens = req.sampling.max_tokens.or(base.max_tokens).unwrap_or(DEFAULT_MAX_TOKENS);
    let mut params = req.sampling.params(base, Some(max_tokens), req.logprobs)?;
    let constrained = req.constraints.constraint()?;
    let param = constrained.as_ref().map(|(_, f)| *f);
    params.constraint = constrained.map(|(c, _)| c);
    // Echoed prompts with logprobs carry their tokens' logprobs: computed as prompt logprobs.
    let echo_logprobs = req.echo && req.logprobs.is_some();
    let asked_prompt_logprobs = params.prompt_logprobs.is_some();
    if echo_logprobs {
        params.prompt_logprobs = Some(params.prompt_logprobs.unwrap_or(0).max(req.logprobs.unwrap_or(0)));
    }
    let echoed = if req.echo { echo_texts(&state, &prompts)? } else { Vec::new() };
    let requests = fan_out(&req.model, prompts, &params, n).constrained_by(param);
    let started = generation::start(&state, admission, requests, n).await?;
    let meta = Meta { id: state.response_id("cmpl"), created: unix_now(), model: req.model.clone() };
    let names = TokenNames::new(&state.engine, req.sampling.return_tokens_as_token_ids);
    let echo = Echo { prompts: echoed, n, logprobs: echo_logprobs, prompt_logprobs: asked_prompt_logprobs };
    let render = CompletionRender { meta, names, logprobs: req.logprobs.is_some(), offsets: Vec::new(), echo };
    started.respond(render, req.sampling.stream, req.sampling.include_usage()).await
}

/// Each prompt's text and token ids, for `echo`.
fn echo_texts(state: &AppState, prompts: &[Prompt]) -> Result<Vec<(String, Vec<u32>)>> {
    prompts
        .iter()
        .map(|p| match p {
            Prompt::Text(t) => Ok((t.clone(), state.engine.tokenize(t, true)?)),
            Prompt::Tokens(ids) => Ok((state.engine.detokenize(ids, false)?, ids.clone())),
            _ => Ok((String::new(), Vec::new())),
        })
        .collect()
}

/// What `echo` and `prompt_logprobs` add to each choice.
struct Echo {
    /// Each prompt's text and ids (empty without `echo`); choice `i` echoes prompt `i / n`.
    prompts: Vec<(String, Vec<u32>)>,
    n: usize,
    /// The echoed prompt's tokens come with logprobs.
    logprobs: bool,
    /// The request asked for vLLM's `prompt_logprobs` itself.
    prompt_logprobs: bool,
}

impl Echo {
    fn prompt(&self, choice: usize) -> Option<&(String, Vec<u32>)> {
        self.prompts.get(choice / self.n.max(1))
    }
}

/// The echoed prompt's tokens as logprob entries (the first without a logprob).
fn echo_tokens(names: &TokenNames, ids: &[u32], entries: Option<&[Option<PromptLogprob>]>) -> Vec<TokenOut> {
    ids.iter()
        .enumerate()
        .map(|(i, &id)| {
            let e = entries.and_then(|e| e.get(i)).and_then(Option::as_ref);
            TokenOut {
                id,
                text: names.name(id),
                logprob: e.map(|e| e.logprob),
                top: e.map(|e| e.top_logprobs.clone()).unwrap_or_default(),
            }
        })
        .collect()
}

/// Legacy completions logprobs of `tokens`, text offsets counted from `offset` (characters).
fn logprobs_json(names: &TokenNames, tokens: &[TokenOut], offset: usize) -> Value {
    let mut texts = Vec::with_capacity(tokens.len());
    let mut lps = Vec::with_capacity(tokens.len());
    let mut tops = Vec::with_capacity(tokens.len());
    let mut offsets = Vec::with_capacity(tokens.len());
    let mut at = offset;
    for t in tokens {
        let text = names.name(t.id);
        offsets.push(at);
        at += t.text.chars().count();
        let mut top = Map::new();
        for &(id, lp) in &t.top {
            top.insert(names.name(id), json!(lp));
        }
        texts.push(text);
        lps.push(t.logprob);
        tops.push(Value::Object(top));
    }
    json!({"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

/// How logprobs name tokens: their own text, or `token_id:<id>` (vLLM's
/// `return_tokens_as_token_ids`, for clients that need the exact ids).
#[derive(Clone, Debug)]
pub(crate) struct TokenNames {
    engine: EngineHandle,
    as_ids: bool,
}

impl TokenNames {
    pub(crate) fn new(engine: &EngineHandle, as_ids: bool) -> TokenNames {
        TokenNames { engine: engine.clone(), as_ids }
    }

    /// A token's name (`token_id:<id>` if its text cannot be decoded).
    pub(crate) fn name(&self, id: u32) -> String {
        if self.as_ids {
            return format!("token_id:{id}");
        }
        self.engine.token_texts(&[id]).ok().and_then(|mut v| v.pop()).unwrap_or_else(|| format!("token_id:{id}"))
    }
}

struct CompletionRender {
    meta: Meta,
    names: TokenNames,
    logprobs: bool,
    /// Characters streamed so far per choice, for `text_offset`.
    offsets: Vec<usize>,
    echo: Echo,
}

impl CompletionRender {
    /// Adds `chars` to choice `index`'s streamed characters.
    fn offsets_mut(&mut self, index: usize, chars: usize) {
        if self.offsets.len() <= index {
            self.offsets.resize(index + 1, 0);
        }
        self.offsets[index] += chars;
    }

    fn chunk(&self, choice: Value) -> Value {
        let m = &self.meta;
        json!({"id": m.id, "object": "text_completion", "created": m.created, "model": m.model, "choices": [choice]})
    }
}

impl Render for CompletionRender {
    fn body(&self, outputs: &[Output], n: usize) -> Value {
        choices_body(&self.meta, "text_completion", outputs, n, |index, o| {
            let (mut text, mut tokens) = (o.text.clone(), o.tokens.clone());
            if let Some((prompt, ids)) = self.echo.prompt(index) {
                text.insert_str(0, prompt);
                let echoed = echo_tokens(&self.names, ids, o.prompt_logprobs.as_deref());
                tokens.splice(0..0, echoed);
            }
            let mut choice = json!({
                "index": index,
                "text": text,
                "logprobs": self.logprobs.then(|| logprobs_json(&self.names, &tokens, 0)),
                "finish_reason": o.finish_reason.as_str(),
                "stop_reason": stop_reason_json(&o.stop_reason),
            });
            if let (true, Some(p)) = (self.echo.prompt_logprobs, &o.prompt_logprobs) {
                choice["prompt_logprobs"] = prompt_logprobs_json(&self.names, p);
            }
            choice
        })
    }

    fn opening(&mut self, n_choices: usize) -> Vec<Value> {
        // An echo without logprobs goes out first; with logprobs, once they are computed.
        if self.echo.logprobs {
            return Vec::new();
        }
        (0..n_choices)
            .filter_map(|i| {
                let (prompt, _) = self.echo.prompt(i)?;
                let chunk = json!({"index": i, "text": prompt, "logprobs": Value::Null, "finish_reason": Value::Null});
                self.offsets_mut(i, prompt.chars().count());
                Some(self.chunk(chunk))
            })
            .collect()
    }

    fn prompt_logprobs(&mut self, index: usize, entries: &[Option<PromptLogprob>]) -> Vec<Value> {
        let mut choice = json!({"index": index, "text": "", "logprobs": Value::Null, "finish_reason": Value::Null});
        if self.echo.logprobs
            && let Some((prompt, ids)) = self.echo.prompt(index)
        {
            let tokens = echo_tokens(&self.names, ids, Some(entries));
            choice["text"] = json!(prompt);
            choice["logprobs"] = logprobs_json(&self.names, &tokens, 0);
            let chars = prompt.chars().count();
            self.offsets_mut(index, chars);
        }
        if self.echo.prompt_logprobs {
            choice["prompt_logprobs"] = prompt_logprobs_json(&self.names, entries);
        }
        vec![self.chunk(choice)]
    }

    fn token(&mut self, index: usize, token: &TokenOut) -> Vec<Value> {
        self.offsets_mut(index, 0);
        let logprobs =
            token.logprob.map(|_| logprobs_json(&self.names, std::slice::from_ref(token), self.offsets[index]));
        self.offsets[index] += token.text.chars().count();
        vec![
            self.chunk(json!({"index": index, "text": token.text, "logprobs": logprobs, "finish_reason": Value::Null})),
        ]
    }

    fn finish(&mut self, index: usize, end: &End) -> Vec<Value> {
        vec![self.chunk(json!({"index": index, "text": "", "logprobs": Value::Null,
            "finish_reason": end.reason.as_str(), "stop_reason": stop_reason_json(&end.stop_reason)}))]
    }

    fn closing(&mut self, usage: Option<Value>) -> Vec<Value> {
        usage_chunk(&self.meta, "text_completion", usage)
    }
}
