//! Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`, translated
//! to and from the engine's one request model: `system` and the text blocks of `messages` become
//! the conversation chat completions renders (`conversation.rs`), `max_tokens` (required, as
//! Anthropic requires it), `stop_sequences`, `temperature`, `top_p` and `top_k` become the
//! sampling parameters (with vLLM's extra sampling fields, which clients send in the body, as on
//! chat completions), and the output is written back as a `message` (or, with `stream`, as
//! Anthropic's typed events: `message_start`, `content_block_start`, `ping`,
//! `content_block_delta`, `content_block_stop`, `message_delta`, `message_stop`). Errors come in
//! Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use multilora::{FinishReason, Prompt, StopReason};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::conversation::{Turn, prompt_ids};
use crate::error::{Error, Result};
use crate::generation::{self, End, Output, Render, TokenOut};
use crate::protocol::{OneOrMany, Sampling, fan_out, parse_with_sampling_under};
use crate::state::AppState;

/// `POST /v1/messages` and its `count_tokens`.
#[derive(Debug, Deserialize)]
pub(crate) struct MessagesRequest {
    model: String,
    max_tokens: Option<usize>,
    messages: Vec<Message>,
    system: Option<Value>,
    stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    stream: bool,
    /// The body's sampling fields (`temperature`, `top_p`, `top_k`, vLLM's extras).
    #[serde(skip)]
    sampling: Sampling,
}

/// One message: a role and a string or a list of content blocks.
#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    content: Value,
}

/// Fields that would change the output and are not served yet: refused by name.
const UNSUPPORTED: &[&str] = &["tools", "tool_choice", "thinking"];

/// The text of `content` (a string, or `text` blocks), `param` naming it in errors.
fn text_of(content: &Value, param: &str) -> Result<String> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut out = String::new();
            for (i, b) in blocks.iter().enumerate() {
                match (b.get("type").and_then(Value::as_str), b.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    (kind, _) => {
                        return Err(Error::bad(
                            format!("{param}[{i}]"),
                            format!("{param}[{i}]: content blocks of type {kind:?} are not supported (text only)"),
                        ));
                    }
                }
            }
            Ok(out)
        }
        _ => Err(Error::bad(param, format!("{param}: a string or a list of text blocks"))),
    }
}

impl MessagesRequest {
    pub(crate) fn parse(body: &[u8]) -> Result<MessagesRequest> {
        let hint = "stop_sequences; one answer a request";
        let (_, mut req, sampling): (_, MessagesRequest, Sampling) =
            parse_with_sampling_under(body, UNSUPPORTED, &["stop", "n"], hint)?;
        req.sampling = Sampling { stop: req.stop_sequences.clone().map(OneOrMany::Many), ..sampling };
        Ok(req)
    }

    /// The conversation: `system` first, then each message (user or assistant).
    pub(crate) fn turns(&self) -> Result<Vec<Turn>> {
        if self.messages.is_empty() {
            return Err(Error::bad("messages", "messages: at least one message"));
        }
        let mut turns = Vec::with_capacity(self.messages.len() + 1);
        if let Some(system) = &self.system {
            turns.push(Turn::new("system", text_of(system, "system")?));
        }
        for (i, m) in self.messages.iter().enumerate() {
            if m.role != "user" && m.role != "assistant" {
                let param = format!("messages[{i}].role");
                return Err(Error::bad(param.clone(), format!("{param}: {:?} is not user or assistant", m.role)));
            }
            turns.push(Turn::new(&m.role, text_of(&m.content, &format!("messages[{i}].content"))?));
        }
        Ok(turns)
    }
}

pub(crate) async fn messages(State(state): State<AppState>, body: Bytes) -> Response {
    match create(&state, &body).await {
        Ok(r) => r,
        Err(e) => error_response(&e),
    }
}

pub(crate) async fn count_tokens(State(state): State<AppState>, body: Bytes) -> Response {
    let count = async {
        let req = MessagesRequest::parse(&body)?;
        crate::tokenize::check_model(&state, Some(&req.model)).await?;
        let ids = prompt_ids(&state, None, &req.turns()?, true, &Map::new())?;
        Ok::<_, Error>(Json(json!({"input_tokens": ids.len()})).into_response())
    };
    count.await.unwrap_or_else(|e| error_response(&e))
}

async fn create(state: &AppState, body: &[u8]) -> Result<Response> {
    let req = MessagesRequest::parse(body)?;
    let max_tokens = req.max_tokens.ok_or_else(|| Error::bad("max_tokens", "max_tokens: Field required"))?;
    let ids = prompt_ids(state, None, &req.turns()?, true, &Map::new())?;
    let input_tokens = ids.len();
    let admission = state.admit(1)?;
    let params = req.sampling.params(state.engine.config().default_params(), Some(max_tokens), None)?;
    let requests = fan_out(&req.model, vec![Prompt::Tokens(ids)], &params, 1);
    let started = generation::start(state, admission, requests, 1).await?;
    let render = MessageRender { id: state.response_id("msg"), model: req.model.clone(), input_tokens };
    started.respond(render, req.stream, false).await
}

/// Anthropic's `stop_reason` and `stop_sequence` of an end.
fn stop_of(reason: FinishReason, stop: &Option<StopReason>) -> (&'static str, Value) {
    match (reason, stop) {
        (FinishReason::Length, _) => ("max_tokens", Value::Null),
        (_, Some(StopReason::String(s))) => ("stop_sequence", json!(s)),
        _ => ("end_turn", Value::Null),
    }
}

struct MessageRender {
    id: String,
    model: String,
    /// The prompt's tokens.
    input_tokens: usize,
}

impl MessageRender {
    fn message(&self, content: Value, stop: (Value, Value), usage: (usize, usize)) -> Value {
        json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
            "stop_reason": stop.0, "stop_sequence": stop.1,
            "usage": {"input_tokens": usage.0, "output_tokens": usage.1},
        })
    }
}

impl Render for MessageRender {
    fn body(&self, outputs: &[Output], _n: usize) -> Value {
        let Some(o) = outputs.first() else { return Value::Null };
        let (reason, sequence) = stop_of(o.finish_reason, &o.stop_reason);
        let content = json!([{"type": "text", "text": o.text}]);
        self.message(content, (json!(reason), sequence), (o.usage.prompt_tokens, o.usage.completion_tokens))
    }

    fn opening(&mut self, _n_choices: usize) -> Vec<Value> {
        // Anthropic's opening counts the input and no output yet; `message_delta` the output.
        vec![
            json!({"type": "message_start",
                   "message": self.message(json!([]), (Value::Null, Value::Null), (self.input_tokens, 0))}),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            json!({"type": "ping"}),
        ]
    }

    fn token(&mut self, _index: usize, token: &TokenOut) -> Vec<Value> {
        if token.text.is_empty() {
            return Vec::new();
        }
        vec![json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": token.text}})]
    }

    fn finish(&mut self, _index: usize, end: &End) -> Vec<Value> {
        let (reason, sequence) = stop_of(end.reason, &end.stop_reason);
        vec![
            json!({"type": "content_block_stop", "index": 0}),
            json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                   "usage": {"input_tokens": end.usage.prompt_tokens, "output_tokens": end.usage.completion_tokens}}),
            json!({"type": "message_stop"}),
        ]
    }

    fn closing(&mut self, _usage: Option<Value>) -> Vec<Value> {
        Vec::new()
    }

    fn error(&mut self, e: &Error) -> Value {
        error_body(e)
    }

    fn typed(&self) -> bool {
        true
    }
}

/// Anthropic's error `type` for an HTTP status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

/// `{"type": "error", "error": {"type", "message"}}`.
pub(crate) fn error_body(e: &Error) -> Value {
    json!({"type": "error", "error": {"type": error_type(e.status()), "message": e.to_string()}})
}

/// An error answered in Anthropic's shape, with the status chat completions would give it.
pub(crate) fn error_response(e: &Error) -> Response {
    (e.status(), Json(error_body(e))).into_response()
}
