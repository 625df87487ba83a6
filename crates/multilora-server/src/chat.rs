//! `POST /v1/chat/completions`: messages rendered through the chat template (the request's own
//! when the server trusts request templates, else the server's `--chat-template`, else the
//! model's; a clear 400 when there is none), tokenized without adding
//! special tokens (the template writes them, as in vLLM), then generated like a completion.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::Response;
use multilora::{FinishReason, Prompt};
use serde_json::{Value, json};

use crate::completions::TokenNames;
use crate::error::{Error, Result};
use crate::generation::{self, Meta, Output, Render, TokenOut};
use crate::protocol::{ChatRequest, fan_out};
use crate::state::{AppState, unix_now};
use crate::template::ChatTemplate;

pub(crate) async fn chat_completions(State(state): State<AppState>, body: Bytes) -> Result<Response> {
    let req = ChatRequest::parse(&body)?;
    let own = match &req.chat_template {
        Some(_) if !state.config.trust_request_chat_template => {
            return Err(Error::bad(
                "chat_template",
                "this server does not run a request's own chat template (start it with --trust-request-chat-template)",
            ));
        }
        Some(source) => Some(ChatTemplate::from_request(source, state.engine.config().chat_template.as_ref())?),
        None => None,
    };
    let template = own
        .as_ref()
        .or(state.config.chat_template.as_ref())
        .or(state.chat_template.as_ref())
        .ok_or_else(|| Error::NoChatTemplate { model: state.engine.config().served_model_name.clone() })?;
    if req.messages.is_empty() {
        return Err(Error::bad("messages", "messages must not be empty"));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        messages.push(json!({"role": m.role, "content": m.text(i)?}));
    }
    let text = template.render(&messages, req.add_generation_prompt.unwrap_or(true), &req.chat_template_kwargs)?;
    let ids = state.engine.tokenize(&text, false)?;
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
    fn meta(&self) -> &Meta {
        &self.meta
    }

    fn object(&self) -> &'static str {
        "chat.completion"
    }

    fn choice(&self, index: usize, o: &Output) -> Value {
        let logprobs = self
            .logprobs
            .then(|| json!({"content": o.tokens.iter().map(|t| token_logprob(&self.names, t)).collect::<Vec<_>>()}));
        json!({
            "index": index,
            "message": {"role": "assistant", "content": o.text},
            "logprobs": logprobs,
            "finish_reason": o.finish_reason.as_str(),
        })
    }

    fn opening(&self, n_choices: usize) -> Vec<Value> {
        (0..n_choices)
            .map(|i| {
                let delta = json!({"role": "assistant", "content": ""});
                self.chunk(vec![
                    json!({"index": i, "delta": delta, "logprobs": Value::Null, "finish_reason": Value::Null}),
                ])
            })
            .collect()
    }

    fn token(&mut self, index: usize, token: &TokenOut) -> Value {
        let logprobs = token.logprob.map(|_| json!({"content": [token_logprob(&self.names, token)]}));
        let choice = json!({"index": index, "delta": {"content": token.text}, "logprobs": logprobs, "finish_reason": Value::Null});
        self.chunk(vec![choice])
    }

    fn finish(&mut self, index: usize, reason: FinishReason) -> Value {
        self.chunk(vec![
            json!({"index": index, "delta": {}, "logprobs": Value::Null, "finish_reason": reason.as_str()}),
        ])
    }

    fn usage(&mut self, usage: Value) -> Value {
        let m = &self.meta;
        json!({"id": m.id, "object": "chat.completion.chunk", "created": m.created, "model": m.model,
               "choices": [], "usage": usage})
    }
}
