//! `POST /v1/chat/completions`: messages rendered into the prompt as every chat-shaped API does
//! (`conversation.rs`), then generated like a completion.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::Response;
use multilora::Prompt;
use serde_json::{Value, json};

use crate::completions::TokenNames;
use crate::conversation::{Turn, prompt_ids};
use crate::error::{Error, Result};
use crate::generation::{self, End, Meta, Output, Render, TokenOut, choices_body, stop_reason_json, usage_chunk};
use crate::protocol::{ChatRequest, fan_out};
use crate::state::{AppState, unix_now};

pub(crate) async fn chat_completions(State(state): State<AppState>, body: Bytes) -> Result<Response> {
    let req = ChatRequest::parse(&body)?;
    if req.messages.is_empty() {
        return Err(Error::bad("messages", "messages must not be empty"));
    }
    let turns =
        req.messages.iter().enumerate().map(|(i, m)| Ok(Turn::new(&m.role, m.text(i)?))).collect::<Result<Vec<_>>>()?;
    let add_generation_prompt = req.add_generation_prompt.unwrap_or(true);
    let ids =
        prompt_ids(&state, req.chat_template.as_deref(), &turns, add_generation_prompt, &req.chat_template_kwargs)?;
    let n = req.sampling.n()?;
    let admission = state.admit(n)?;
    let logprobs = req.logprobs()?;
    let params = req.sampling.params(state.engine.config().default_params(), req.max_completion_tokens, logprobs)?;
    let requests = fan_out(&req.model, vec![Prompt::Tokens(ids)], &params, n);
    let started = generation::start(&state, admission, requests, n).await?;
    let meta = Meta { id: state.response_id("chatcmpl"), created: unix_now(), model: req.model.clone() };
    let names = TokenNames::new(&state.engine, req.sampling.return_tokens_as_token_ids);
    let render = ChatRender { meta, names, logprobs: logprobs.is_some() };
    started.respond(render, req.sampling.stream, req.sampling.include_usage()).await
}

/// One entry of chat logprobs: `{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}`.
fn token_logprob(names: &TokenNames, t: &TokenOut) -> Value {
    let entry = |id: u32, lp: f32| {
        let text = names.name(id);
        json!({"token": text, "logprob": lp, "bytes": text.as_bytes()})
    };
    let mut v = entry(t.id, t.logprob.unwrap_or(f32::NAN));
    v["top_logprobs"] = Value::Array(t.top.iter().map(|&(id, lp)| entry(id, lp)).collect());
    v
}

struct ChatRender {
    meta: Meta,
    names: TokenNames,
    logprobs: bool,
}

impl ChatRender {
    fn chunk(&self, choices: Vec<Value>) -> Value {
        let m = &self.meta;
        json!({"id": m.id, "object": "chat.completion.chunk", "created": m.created, "model": m.model, "choices": choices})
    }
}

impl Render for ChatRender {
    fn body(&self, outputs: &[Output], n: usize) -> Value {
        choices_body(&self.meta, "chat.completion", outputs, n, |index, o| {
            let logprobs = self.logprobs.then(
                || json!({"content": o.tokens.iter().map(|t| token_logprob(&self.names, t)).collect::<Vec<_>>()}),
            );
            json!({
                "index": index,
                "message": {"role": "assistant", "content": o.text},
                "logprobs": logprobs,
                "finish_reason": o.finish_reason.as_str(),
                "stop_reason": stop_reason_json(&o.stop_reason),
            })
        })
    }

    fn opening(&mut self, n_choices: usize) -> Vec<Value> {
        (0..n_choices)
            .map(|i| {
                let delta = json!({"role": "assistant", "content": ""});
                self.chunk(vec![
                    json!({"index": i, "delta": delta, "logprobs": Value::Null, "finish_reason": Value::Null}),
                ])
            })
            .collect()
    }

    fn token(&mut self, index: usize, token: &TokenOut) -> Vec<Value> {
        let logprobs = token.logprob.map(|_| json!({"content": [token_logprob(&self.names, token)]}));
        let choice = json!({"index": index, "delta": {"content": token.text}, "logprobs": logprobs, "finish_reason": Value::Null});
        vec![self.chunk(vec![choice])]
    }

    fn finish(&mut self, index: usize, end: &End) -> Vec<Value> {
        vec![self.chunk(vec![json!({"index": index, "delta": {}, "logprobs": Value::Null,
            "finish_reason": end.reason.as_str(), "stop_reason": stop_reason_json(&end.stop_reason)})])]
    }

    fn closing(&mut self, usage: Option<Value>) -> Vec<Value> {
        usage_chunk(&self.meta, "chat.completion.chunk", usage)
    }
}
