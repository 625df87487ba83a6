//! OpenAI's Responses API, `POST /v1/responses` (and `GET /v1/responses/{id}` for stored ones),
//! translated to and from the engine's one request model: `instructions` and `input` (a string,
//! or message items with `input_text` / `output_text` parts, roles user / assistant / system /
//! developer) become the conversation chat completions renders (`conversation.rs`),
//! `max_output_tokens`, `temperature` and `top_p` the sampling parameters (with vLLM's extra
//! sampling fields from the body, as on chat completions; `text.format` `json_object` /
//! `json_schema` constrains the output as chat's `response_format` does), and the output comes
//! back as a `response` object (or, with `stream`, as the API's typed events with their sequence
//! numbers: `response.created`, `response.in_progress`, `response.output_item.added`,
//! `response.content_part.added`, `response.output_text.delta` …, `response.completed` or
//! `response.incomplete`).
//!
//! Stateless by default. With `--responses-store N` the server keeps the last N responses in
//! memory (`store`, default true as in OpenAI's API; the least recently used dropped first): a
//! request naming one as its
//! `previous_response_id` continues its conversation; without a store, or for one no longer
//! kept, that is an error naming the field.

use std::num::NonZeroUsize;
use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::Response;
use lru::LruCache;
use multilora::{Constraint, FinishReason, Prompt};
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::conversation::{Turn, prompt_ids};
use crate::error::{Error, Result};
use crate::generation::{self, End, Output, Render, TokenOut};
use crate::protocol::{Sampling, fan_out, parse_with_sampling_under};
use crate::state::{AppState, unix_now};
use crate::structured::text_format;

/// `POST /v1/responses`.
#[derive(Debug, Deserialize)]
pub(crate) struct ResponsesRequest {
    model: String,
    input: Value,
    instructions: Option<String>,
    max_output_tokens: Option<usize>,
    #[serde(default)]
    stream: bool,
    store: Option<bool>,
    previous_response_id: Option<String>,
    #[serde(default)]
    metadata: Map<String, Value>,
    /// The body's sampling fields (`temperature`, `top_p`, vLLM's extras).
    #[serde(skip)]
    sampling: Sampling,
    /// `text.format` as given, and the constraint it puts on the output.
    #[serde(skip)]
    format: Option<Value>,
    #[serde(skip)]
    constraint: Option<Constraint>,
}

/// Fields that would change the output and are not served yet: refused by name unless off.
const UNSUPPORTED: &[&str] = &["tools", "tool_choice", "reasoning", "background", "prompt"];

/// A stored response: its conversation (input and output turns) for a continuation, and the
/// response object for `GET`.
#[derive(Debug, Clone)]
struct Stored {
    turns: Vec<Turn>,
    object: Value,
}

/// The last responses kept for `previous_response_id`, at most `capacity`, the least recently
/// used dropped first.
#[derive(Debug)]
pub(crate) struct ResponseStore {
    capacity: usize,
    /// `None` when nothing is kept.
    kept: Option<Mutex<LruCache<String, Arc<Stored>>>>,
}

impl ResponseStore {
    pub(crate) fn new(capacity: usize) -> ResponseStore {
        ResponseStore { capacity, kept: NonZeroUsize::new(capacity).map(|n| Mutex::new(LruCache::new(n))) }
    }

    fn get(&self, id: &str) -> Option<Arc<Stored>> {
        self.kept.as_ref()?.lock().get(id).cloned()
    }

    fn put(&self, id: String, stored: Stored) {
        if let Some(kept) = &self.kept {
            kept.lock().put(id, Arc::new(stored));
        }
    }
}

impl ResponsesRequest {
    pub(crate) fn parse(body: &[u8]) -> Result<ResponsesRequest> {
        let hint = "max_output_tokens; one answer a request";
        let (v, mut req, sampling): (_, ResponsesRequest, Sampling) =
            parse_with_sampling_under(body, UNSUPPORTED, &["max_tokens", "n", "stop"], hint)?;
        if let Some(format) = v.pointer("/text/format").filter(|f| !f.is_null()) {
            req.constraint = text_format(format)?;
            req.format = Some(format.clone());
        }
        req.sampling = sampling;
        Ok(req)
    }

    /// The input's turns: a string is one user message; items are messages whose content is a
    /// string or text parts.
    pub(crate) fn input_turns(&self) -> Result<Vec<Turn>> {
        match &self.input {
            Value::String(s) => Ok(vec![Turn::new("user", s.clone())]),
            Value::Array(items) => items.iter().enumerate().map(|(i, item)| item_turn(i, item)).collect(),
            _ => Err(Error::bad("input", "input: a string or a list of message items")),
        }
    }
}

/// Input item `i` as a turn.
fn item_turn(i: usize, item: &Value) -> Result<Turn> {
    let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
    if kind != "message" {
        return Err(Error::bad(
            format!("input[{i}].type"),
            format!("input[{i}]: items of type {kind:?} are not supported"),
        ));
    }
    let role = item.get("role").and_then(Value::as_str).unwrap_or_default();
    if !matches!(role, "user" | "assistant" | "system" | "developer") {
        return Err(Error::bad(format!("input[{i}].role"), format!("input[{i}].role: {role:?} is not a message role")));
    }
    let param = format!("input[{i}].content");
    let text = match item.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("input_text" | "output_text" | "text"), Some(t)) => out.push_str(t),
                    (kind, _) => {
                        return Err(Error::bad(
                            format!("{param}[{j}]"),
                            format!("{param}[{j}]: content parts of type {kind:?} are not supported (text only)"),
                        ));
                    }
                }
            }
            out
        }
        _ => return Err(Error::bad(param.clone(), format!("{param}: a string or a list of text parts"))),
    };
    Ok(Turn::new(role, text))
}

pub(crate) async fn create(State(state): State<AppState>, body: Bytes) -> Result<Response> {
    let req = ResponsesRequest::parse(&body)?;
    let store = &state.responses;
    let mut turns = Vec::new();
    if let Some(instructions) = &req.instructions {
        turns.push(Turn::new("system", instructions.clone()));
    }
    if let Some(prev) = &req.previous_response_id {
        let stored = match store.capacity {
            0 => {
                return Err(Error::bad(
                    "previous_response_id",
                    "this server keeps no responses (start it with --responses-store N)",
                ));
            }
            _ => store.get(prev).ok_or_else(|| Error::NotFound {
                param: "previous_response_id",
                message: format!(
                    "previous response with id {prev:?} not found (the store keeps the last {})",
                    store.capacity
                ),
            })?,
        };
        turns.extend(stored.turns.iter().cloned());
    }
    turns.extend(req.input_turns()?);
    let ids = prompt_ids(&state, None, &turns, true, &Map::new())?;
    let input_tokens = ids.len();
    let admission = state.admit(1)?;
    let base = state.engine.config().default_params();
    let mut params = req.sampling.params(base, req.max_output_tokens, None)?;
    params.constraint = req.constraint.clone();
    let requests = fan_out(&req.model, vec![Prompt::Tokens(ids)], &params, 1).constrained_by(Some("text.format"));
    let started = generation::start(&state, admission, requests, 1).await?;
    let keep = store.capacity > 0 && req.store.unwrap_or(true);
    let id = state.response_id("resp");
    let shell = json!({
        "id": id, "object": "response", "created_at": unix_now(), "status": "in_progress", "error": null,
        "incomplete_details": null, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "model": req.model, "output": [], "parallel_tool_calls": true, "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": null, "summary": null}, "store": keep, "temperature": params.temperature,
        "text": {"format": req.format.clone().unwrap_or_else(|| json!({"type": "text"}))}, "tool_choice": "auto", "tools": [], "top_p": params.top_p,
        "truncation": "disabled", "usage": null, "user": null, "metadata": req.metadata,
    });
    let render = ResponseRender {
        shell,
        item_id: state.response_id("msg"),
        text: String::new(),
        seq: 0,
        input_tokens,
        keep: keep.then(|| (Arc::clone(&state.responses), turns)),
    };
    started.respond(render, req.stream, false).await
}

pub(crate) async fn retrieve(State(state): State<AppState>, Path(id): Path<String>) -> Result<Json<Value>> {
    match state.responses.get(&id) {
        Some(stored) => Ok(Json(stored.object.clone())),
        None => Err(Error::NotFound { param: "response_id", message: format!("response with id {id:?} not found") }),
    }
}

/// Writes a response object and its stream; stores the finished response when asked.
struct ResponseRender {
    /// The response object before its output (`status: in_progress`).
    shell: Value,
    item_id: String,
    /// The text streamed so far.
    text: String,
    /// The next event's `sequence_number`.
    seq: u64,
    input_tokens: usize,
    /// The store and the conversation so far, when the response is to be kept.
    keep: Option<(Arc<ResponseStore>, Vec<Turn>)>,
}

impl ResponseRender {
    fn event(&mut self, mut v: Value) -> Value {
        v["sequence_number"] = json!(self.seq);
        self.seq += 1;
        v
    }

    fn item(&self, text: &str, status: &str) -> Value {
        json!({"id": self.item_id, "type": "message", "status": status, "role": "assistant",
               "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
    }

    /// The finished response object, stored when asked.
    fn finished(&self, text: &str, reason: FinishReason, prompt: usize, completion: usize) -> Value {
        let mut r = self.shell.clone();
        let complete = reason != FinishReason::Length;
        r["status"] = json!(if complete { "completed" } else { "incomplete" });
        if !complete {
            r["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        r["output"] = json!([self.item(text, if complete { "completed" } else { "incomplete" })]);
        r["usage"] = json!({
            "input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        });
        if let Some((store, turns)) = &self.keep {
            let mut turns = turns.clone();
            turns.push(Turn::new("assistant", text));
            let id = r["id"].as_str().unwrap_or_default().to_string();
            store.put(id, Stored { turns, object: r.clone() });
        }
        r
    }
}

impl Render for ResponseRender {
    fn body(&self, outputs: &[Output], _n: usize) -> Value {
        let Some(o) = outputs.first() else { return Value::Null };
        self.finished(&o.text, o.finish_reason, o.usage.prompt_tokens, o.usage.completion_tokens)
    }

    fn opening(&mut self, _n_choices: usize) -> Vec<Value> {
        let shell = self.shell.clone();
        let (item, part) =
            (self.item("", "in_progress"), json!({"type": "output_text", "text": "", "annotations": []}));
        let mut item = item;
        item["content"] = json!([]);
        let item_id = self.item_id.clone();
        vec![
            self.event(json!({"type": "response.created", "response": shell})),
            self.event(json!({"type": "response.in_progress", "response": self.shell})),
            self.event(json!({"type": "response.output_item.added", "output_index": 0, "item": item})),
            self.event(json!({"type": "response.content_part.added", "item_id": item_id, "output_index": 0,
                              "content_index": 0, "part": part})),
        ]
    }

    fn token(&mut self, _index: usize, token: &TokenOut) -> Vec<Value> {
        if token.text.is_empty() {
            return Vec::new();
        }
        self.text.push_str(&token.text);
        let item_id = self.item_id.clone();
        vec![self.event(json!({"type": "response.output_text.delta", "item_id": item_id, "output_index": 0,
                               "content_index": 0, "delta": token.text, "logprobs": []}))]
    }

    fn finish(&mut self, _index: usize, end: &End) -> Vec<Value> {
        let text = std::mem::take(&mut self.text);
        let response = self.finished(&text, end.reason, self.input_tokens, end.usage.completion_tokens);
        let item = response["output"][0].clone();
        let part = item["content"][0].clone();
        let item_id = self.item_id.clone();
        let last = if end.reason == FinishReason::Length { "response.incomplete" } else { "response.completed" };
        vec![
            self.event(json!({"type": "response.output_text.done", "item_id": item_id, "output_index": 0,
                              "content_index": 0, "text": text, "logprobs": []})),
            self.event(json!({"type": "response.content_part.done", "item_id": item_id, "output_index": 0,
                              "content_index": 0, "part": part})),
            self.event(json!({"type": "response.output_item.done", "output_index": 0, "item": item})),
            self.event(json!({"type": last, "response": response})),
        ]
    }

    fn closing(&mut self, _usage: Option<Value>) -> Vec<Value> {
        Vec::new()
    }

    fn error(&mut self, e: &Error) -> Value {
        let body = e.body();
        let err = &body["error"];
        self.event(json!({"type": "error", "code": err["code"], "message": err["message"], "param": err["param"]}))
    }

    fn typed(&self) -> bool {
        true
    }
}
