//! `POST /v1/completions`: prompts in every OpenAI shape, `n` choices per prompt, legacy
//! `logprobs` (tokens, token_logprobs, top_logprobs as `{token: logprob}`, text_offset), and
//! streaming.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::Response;
use multilora::EngineHandle;
use serde_json::{Map, Value, json};

use crate::error::Result;
use crate::generation::{self, End, Meta, Output, Render, TokenOut, choices_body, stop_reason_json, usage_chunk};
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
    let params = req.sampling.params(base, Some(max_tokens), req.logprobs)?;
    let requests = fan_out(&req.model, prompts, &params, n);
    let started = generation::start(&state, admission, requests, n).await?;
    let meta = Meta { id: state.response_id("cmpl"), created: unix_now(), model: req.model.clone() };
    let names = TokenNames::new(&state.engine, req.sampling.return_tokens_as_token_ids);
    let render = CompletionRender { meta, names, logprobs: req.logprobs.is_some(), offsets: Vec::new() };
    started.respond(render, req.sampling.stream, req.sampling.include_usage()).await
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
}

impl CompletionRender {
    fn chunk(&self, choice: Value) -> Value {
        let m = &self.meta;
        json!({"id": m.id, "object": "text_completion", "created": m.created, "model": m.model, "choices": [choice]})
    }
}

impl Render for CompletionRender {
    fn body(&self, outputs: &[Output], n: usize) -> Value {
        choices_body(&self.meta, "text_completion", outputs, n, |index, o| {
            json!({
                "index": index,
                "text": o.text,
                "logprobs": self.logprobs.then(|| logprobs_json(&self.names, &o.tokens, 0)),
                "finish_reason": o.finish_reason.as_str(),
                "stop_reason": stop_reason_json(&o.stop_reason),
            })
        })
    }

    fn opening(&mut self, _n_choices: usize) -> Vec<Value> {
        Vec::new()
    }

    fn token(&mut self, index: usize, token: &TokenOut) -> Vec<Value> {
        if self.offsets.len() <= index {
            self.offsets.resize(index + 1, 0);
        }
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
