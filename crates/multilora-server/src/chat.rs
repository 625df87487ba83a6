//! `POST /v1/chat/completions`: messages (tool calls and tool answers included) rendered into
//! the prompt with the request's `tools` as every chat-shaped API does (`conversation.rs`), then
//! generated like a completion, constrained when the request asks (`structured.rs`, or a
//! `tool_choice` that names a function or requires a call); a reply's tool calls come back as
//! `message.tool_calls` (`tools.rs`).

use axum::body::Bytes;
use axum::extract::State;
use axum::response::Response;
use multilora::{Prompt, PromptLogprob};
use serde_json::{Value, json};

use crate::completions::TokenNames;
use crate::conversation::{Turn, prompt_ids_with_tools};
use crate::error::{Error, Result};
use crate::generation::{
    self, End, Meta, Output, Render, TokenOut, choices_body, prompt_logprobs_json, stop_reason_json, usage_chunk,
};
use crate::protocol::{ChatMessage, ChatRequest, fan_out};
use crate::state::{AppState, unix_now};
use crate::tools::{CallIds, ToolCall, ToolMode, ToolStream, calls_json};

pub(crate) async fn chat_completions(State(state): State<AppState>, body: Bytes) -> Result<Response> {
    let req = ChatRequest::parse(&body)?;
    if req.messages.is_empty() {
        return Err(Error::bad("messages", "messages must not be empty"));
    }
    let parser = state.config.enable_auto_tool_choice.then_some(state.config.tool_call_parser).flatten();
    let tools = req.tools.read(parser)?;
    let mut constrained = req.constraints.constraint()?;
    if let Some(c) = tools.as_ref().and_then(|t| t.constraint.clone()) {
        if let Some((_, field)) = constrained {
            return Err(Error::bad(
                field,
                format!("{field} and a tool_choice that forces a call both constrain the output"),
            ));
        }
        constrained = Some((c, "tool_choice"));
    }
    let turns = req.messages.iter().enumerate().map(|(i, m)| turn(i, m)).collect::<Result<Vec<_>>>()?;
    let add_generation_prompt = req.add_generation_prompt.unwrap_or(true);
    let ids = prompt_ids_with_tools(
        &state,
        req.chat_template.as_deref(),
        &turns,
        add_generation_prompt,
        tools.as_ref().map(|t| t.for_template.as_slice()),
        &req.chat_template_kwargs,
    )?;
    let n = req.sampling.n()?;
    let admission = state.admit(n)?;
    let logprobs = req.logprobs()?;
    let mut params =
        req.sampling.params(state.engine.config().default_params(), req.max_completion_tokens, logprobs)?;
    let mode = tools.and_then(|t| t.mode);
    if let Some(ToolMode::Auto(p)) = &mode
        && p.needs_special_tokens()
    {
        // The syntax's marker is a special token: the text must keep it to be parsed.
        params.skip_special_tokens = false;
    }
    let param = constrained.as_ref().map(|(_, f)| *f);
    params.constraint = constrained.map(|(c, _)| c);
    let requests = fan_out(&req.model, vec![Prompt::Tokens(ids)], &params, n).constrained_by(param);
    let started = generation::start(&state, admission, requests, n).await?;
    let meta = Meta { id: state.response_id("chatcmpl"), created: unix_now(), model: req.model.clone() };
    let names = TokenNames::new(&state.engine, req.sampling.return_tokens_as_token_ids);
    let render = ChatRender { meta, names, logprobs: logprobs.is_some(), mode, streams: Vec::new() };
    started.respond(render, req.sampling.stream, req.sampling.include_usage()).await
}

/// A message as its turn: text content, and the keys of tool use (an assistant's `tool_calls`,
/// their arguments as objects where they are JSON, as vLLM gives them to templates; a tool
/// answer's `tool_call_id` and `name`).
fn turn(i: usize, m: &ChatMessage) -> Result<Turn> {
    let mut t = Turn::new(&m.role, m.text(i)?);
    if let Some(calls) = m.tool_calls.as_ref().filter(|c| !c.is_null()) {
        let Value::Array(list) = calls else {
            return Err(Error::bad(format!("messages[{i}].tool_calls"), "tool_calls must be a list"));
        };
        let list: Vec<Value> = list
            .iter()
            .map(|c| {
                let mut c = c.clone();
                let args = c.pointer("/function/arguments").and_then(Value::as_str).map(serde_json::from_str::<Value>);
                if let Some(Ok(parsed)) = args
                    && let Some(f) = c.get_mut("function")
                {
                    f["arguments"] = parsed;
                }
                c
            })
            .collect();
        t.extra.insert("tool_calls".into(), Value::Array(list));
    }
    if let Some(id) = &m.tool_call_id {
        t.extra.insert("tool_call_id".into(), json!(id));
    }
    if let Some(name) = &m.name {
        t.extra.insert("name".into(), json!(name));
    }
    Ok(t)
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
    /// What becomes of a reply when the request has tools.
    mode: Option<ToolMode>,
    /// Each choice's tool stream, once it streams.
    streams: Vec<Option<ToolStream>>,
}

impl ChatRender {
    fn chunk(&self, choices: Vec<Value>) -> Value {
        let m = &self.meta;
        json!({"id": m.id, "object": "chat.completion.chunk", "created": m.created, "model": m.model, "choices": choices})
    }

    fn delta(&self, index: usize, delta: Value, logprobs: Option<Value>) -> Value {
        self.chunk(vec![json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": Value::Null})])
    }

    /// The choice's tool-call stream, made at its first token (its mode and call ids once).
    fn stream(&mut self, index: usize) -> Option<&mut ToolStream> {
        let mode = self.mode.as_ref()?;
        if self.streams.len() <= index {
            self.streams.resize_with(index + 1, || None);
        }
        let id = &self.meta.id;
        Some(self.streams[index].get_or_insert_with(|| ToolStream::new(mode.clone(), CallIds::new(id, index))))
    }
}

/// A choice's message and finish reason: with tools, its calls parsed out of the text.
fn message(mode: Option<&ToolMode>, o: &Output, mut ids: CallIds) -> (Value, &'static str) {
    let parsed = mode.map(|m| m.parse(&o.text)).filter(|p| !p.calls.is_empty());
    let (Some(mode), Some(parsed)) = (mode, parsed) else {
        return (json!({"role": "assistant", "content": o.text}), o.finish_reason.as_str());
    };
    let calls: Vec<ToolCall> = parsed
        .calls
        .into_iter()
        .map(|c| ToolCall { id: ids.next_id(), name: c.name, arguments: c.arguments })
        .collect();
    let message = json!({"role": "assistant", "content": parsed.content, "tool_calls": calls_json(&calls)});
    (message, mode.finish_reason(o.finish_reason, true))
}

impl Render for ChatRender {
    fn body(&self, outputs: &[Output], n: usize) -> Value {
        choices_body(&self.meta, "chat.completion", outputs, n, |index, o| {
            let logprobs = self.logprobs.then(
                || json!({"content": o.tokens.iter().map(|t| token_logprob(&self.names, t)).collect::<Vec<_>>()}),
            );
            let ids = CallIds::new(&self.meta.id, index);
            let (message, finish_reason) = message(self.mode.as_ref(), o, ids);
            let mut choice = json!({
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason_json(&o.stop_reason),
            });
            if let Some(p) = &o.prompt_logprobs {
                choice["prompt_logprobs"] = prompt_logprobs_json(&self.names, p);
            }
            choice
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
        let Some(stream) = self.stream(index) else {
            return vec![self.delta(index, json!({"content": token.text}), logprobs)];
        };
        let d = stream.push(&token.text);
        let mut out = Vec::new();
        if !d.content.is_empty() {
            out.push(self.delta(index, json!({"content": d.content}), logprobs));
        }
        if !d.calls.is_empty() {
            out.push(self.delta(index, json!({"tool_calls": d.calls}), None));
        }
        out
    }

    fn prompt_logprobs(&mut self, index: usize, entries: &[Option<PromptLogprob>]) -> Vec<Value> {
        let p = prompt_logprobs_json(&self.names, entries);
        vec![self.chunk(vec![json!({"index": index, "delta": {}, "logprobs": Value::Null,
            "finish_reason": Value::Null, "prompt_logprobs": p})])]
    }

    fn finish(&mut self, index: usize, end: &End) -> Vec<Value> {
        let mut out = Vec::new();
        let mut reason = end.reason.as_str();
        let mode = self.mode.clone();
        if let (Some(stream), Some(mode)) = (self.stream(index), mode) {
            let (d, made) = stream.finish();
            reason = mode.finish_reason(end.reason, made);
            if !d.content.is_empty() {
                out.push(self.delta(index, json!({"content": d.content}), None));
            }
            if !d.calls.is_empty() {
                out.push(self.delta(index, json!({"tool_calls": d.calls}), None));
            }
        }
        out.push(self.chunk(vec![json!({"index": index, "delta": {}, "logprobs": Value::Null,
            "finish_reason": reason, "stop_reason": stop_reason_json(&end.stop_reason)})]));
        out
    }

    fn closing(&mut self, usage: Option<Value>) -> Vec<Value> {
        usage_chunk(&self.meta, "chat.completion.chunk", usage)
    }
}
