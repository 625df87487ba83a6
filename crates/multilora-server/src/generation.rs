//! Running one HTTP request's engine requests (one per prompt and choice): admission, one
//! validation of the parameters before any choice is built, submission (where the engine
//! refuses an unknown model or a bad prompt at once, and resolves the model once: a choice keeps
//! the adapter generation it was accepted with to its end), then either collecting
//! every choice or streaming them merged as server-sent events ending in `[DONE]`. A stream's
//! headers go out at once, except while its adapter is still loading: then its first event is
//! awaited, so that a failed load is a 400, not a broken stream (vLLM loads a resolved adapter
//! before it answers too).
//! Dropping the response (a client that disconnects) drops the engine streams, which cancels
//! their requests and frees their KV blocks and adapter slots.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::Json;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, BoxStream, SelectAll, Stream, StreamExt};
use multilora::{EngineError, Event, FinishReason, Prompt, PromptLogprob, RequestStream, StopReason, Usage};
use serde_json::{Value, json};

use crate::completions::TokenNames;
use crate::error::{Error, Result};
use crate::protocol::FanOut;
use crate::state::{Admission, AppState};

/// A generated token with what `logprobs` asked for.
#[derive(Clone, Debug)]
pub(crate) struct TokenOut {
    pub(crate) id: u32,
    pub(crate) text: String,
    pub(crate) logprob: Option<f32>,
    pub(crate) top: Vec<(u32, f32)>,
}

/// One choice's whole output.
#[derive(Debug)]
pub(crate) struct Output {
    pub(crate) text: String,
    pub(crate) tokens: Vec<TokenOut>,
    /// Each prompt token's logprobs (`prompt_logprobs`; the first `None`).
    pub(crate) prompt_logprobs: Option<Vec<Option<PromptLogprob>>>,
    pub(crate) finish_reason: FinishReason,
    pub(crate) stop_reason: Option<StopReason>,
    pub(crate) usage: Usage,
}

/// How a choice ended, as a stream learns it.
#[derive(Debug)]
pub(crate) struct End {
    pub(crate) reason: FinishReason,
    pub(crate) stop_reason: Option<StopReason>,
    pub(crate) usage: Usage,
}

/// vLLM's `stop_reason`: the stop string, the stop token id, or `null` (EOS, or not a stop).
pub(crate) fn stop_reason_json(stop: &Option<StopReason>) -> Value {
    match stop {
        Some(StopReason::String(s)) => json!(s),
        Some(StopReason::Token(id)) => json!(id),
        _ => Value::Null,
    }
}

/// vLLM's `prompt_logprobs`: per prompt position `null` (the first) or `{token_id: {logprob,
/// rank, decoded_token}}` for the prompt token and the most likely alternatives.
pub(crate) fn prompt_logprobs_json(names: &TokenNames, entries: &[Option<PromptLogprob>]) -> Value {
    let entry = |e: &PromptLogprob| {
        let mut m = serde_json::Map::new();
        for (rank, &(id, lp)) in e.top_logprobs.iter().enumerate() {
            m.insert(id.to_string(), json!({"logprob": lp, "rank": rank + 1, "decoded_token": names.name(id)}));
        }
        m.insert(
            e.token.to_string(),
            json!({"logprob": e.logprob, "rank": e.rank, "decoded_token": names.name(e.token)}),
        );
        Value::Object(m)
    };
    Value::Array(entries.iter().map(|e| e.as_ref().map_or(Value::Null, entry)).collect())
}

/// One choice: its stream and the event already read from it.
#[derive(Debug)]
struct Choice {
    first: Option<Event>,
    stream: RequestStream,
}

/// The engine requests of one HTTP request, admitted and started.
#[derive(Debug)]
pub(crate) struct Started {
    choices: Vec<Choice>,
    admission: Admission,
    /// Choices per prompt (`n`): choice `i` belongs to prompt `i / n`.
    n: usize,
}

/// Submits `requests`, admitted (counted) before they were built: their parameters are
/// validated once, before any of the prompts × `n` copies is made, and a text prompt is
/// tokenized once for its `n` choices; a request the engine refuses (unknown model, prompt too
/// long, bad parameters) fails the whole HTTP request, and the others are cancelled by being
/// dropped. For a request whose adapter was still loading, its first event is awaited, so that a
/// failed load fails the HTTP request the same way.
pub(crate) async fn start(state: &AppState, admission: Admission, requests: FanOut<'_>, n: usize) -> Result<Started> {
    // A refused constraint's 400 names the field it came from.
    let named = |e: EngineError| match (&e, requests.constraint_param) {
        (EngineError::Constraint { .. }, Some(param)) => Error::bad(param, e.to_string()),
        _ => Error::Engine(e),
    };
    let params = requests.params.clone().validate(state.engine.config().vocab_size).map_err(named)?;
    let mut streams = Vec::with_capacity(requests.len());
    for prompt in &requests.prompts {
        let prompt = match prompt {
            Prompt::Text(text) => Prompt::Tokens(state.engine.tokenize(text, true)?),
            other => other.clone(),
        };
        for i in 0..requests.n {
            streams.push(state.engine.submit(requests.request(prompt.clone(), &params, i)).map_err(named)?);
        }
    }
    let mut choices = Vec::with_capacity(streams.len());
    for mut stream in streams {
        if stream.adapter_ready() {
            choices.push(Choice { first: None, stream });
            continue;
        }
        match stream.recv().await {
            Some(Event::Error(e)) => return Err(Error::Engine(e)),
            None => return Err(Error::Engine(EngineError::Shutdown)),
            first => choices.push(Choice { first, stream }),
        }
    }
    Ok(Started { choices, admission, n })
}

/// What every chunk and body of a response repeats.
#[derive(Clone, Debug)]
pub(crate) struct Meta {
    pub(crate) id: String,
    pub(crate) created: u64,
    pub(crate) model: String,
}

impl Started {
    /// The endpoint's response: an SSE stream when `stream`, else the collected body
    /// [`Render::body`].
    pub(crate) async fn respond<R: Render>(self, render: R, stream: bool, include_usage: bool) -> Result<Response> {
        if stream {
            return Ok(self.sse(render, include_usage).into_response());
        }
        let n = self.n;
        let outputs = self.collect().await?;
        Ok(Json(render.body(&outputs, n)).into_response())
    }

    /// Waits for every choice's whole output; a choice that fails fails the request.
    pub(crate) async fn collect(self) -> Result<Vec<Output>> {
        let mut outs = Vec::with_capacity(self.choices.len());
        for mut c in self.choices {
            let mut out = Output {
                text: String::new(),
                tokens: Vec::new(),
                prompt_logprobs: None,
                finish_reason: FinishReason::Error,
                stop_reason: None,
                usage: Usage::default(),
            };
            let mut next = c.first.take();
            loop {
                let ev = match next.take() {
                    Some(ev) => ev,
                    None => match c.stream.recv().await {
                        Some(ev) => ev,
                        None => return Err(Error::Engine(EngineError::Shutdown)),
                    },
                };
                match ev {
                    Event::Token { id, text_delta, logprob, top_logprobs } => {
                        out.text.push_str(&text_delta);
                        out.tokens.push(TokenOut { id, text: text_delta, logprob, top: top_logprobs });
                    }
                    Event::Finished { reason, usage, stop_reason } => {
                        out.finish_reason = reason;
                        out.stop_reason = stop_reason;
                        out.usage = usage;
                        break;
                    }
                    Event::PromptLogprobs(entries) => out.prompt_logprobs = Some(entries),
                    Event::Error(e) => return Err(Error::Engine(e)),
                    _ => {}
                }
            }
            outs.push(out);
        }
        drop(self.admission);
        Ok(outs)
    }

    /// Streams the choices as SSE events rendered by `render`: OpenAI's chunks ending in
    /// `data: [DONE]`, or typed events (`event: <type>`) for the APIs that name them.
    pub(crate) fn sse<R: Render>(
        self,
        mut render: R,
        include_usage: bool,
    ) -> Sse<impl Stream<Item = std::result::Result<SseEvent, Infallible>>> {
        let n_choices = self.choices.len();
        let events: SelectAll<BoxStream<'static, (usize, Event)>> =
            stream::select_all(self.choices.into_iter().enumerate().map(|(i, c)| {
                let first = stream::iter(c.first.map(|e| (i, e)));
                let rest = stream::unfold(c.stream, move |mut s| async move { s.recv().await.map(|e| ((i, e), s)) });
                first.chain(rest).boxed()
            }));
        let pending: VecDeque<Value> = render.opening(n_choices).into();
        let state = SseState {
            events,
            render,
            pending,
            prompt_tokens: vec![0; n_choices.div_ceil(self.n.max(1))],
            completion_tokens: 0,
            n: self.n.max(1),
            include_usage,
            done: false,
            failed: vec![false; n_choices],
            ended: vec![false; n_choices],
            _admission: self.admission,
        };
        let body = stream::unfold(state, |mut st| async move {
            let data = st.next_data().await?;
            let event = match (st.render.typed(), data.get("type").and_then(Value::as_str)) {
                (true, Some(kind)) => SseEvent::default().event(kind),
                _ => SseEvent::default(),
            };
            let data = match data {
                Value::String(done) => done,
                other => other.to_string(),
            };
            Some((Ok(event.data(data)), st))
        });
        Sse::new(body).keep_alive(KeepAlive::default())
    }
}

/// How an endpoint writes its collected body and its stream's events: one engine request model,
/// a wire format per API.
pub(crate) trait Render: Send + 'static {
    /// The collected body of `outputs` (`n` choices per prompt, in order).
    fn body(&self, outputs: &[Output], n: usize) -> Value;
    /// Events before any token (chat's assistant role deltas, the Messages and Responses
    /// openings).
    fn opening(&mut self, n_choices: usize) -> Vec<Value>;
    /// The events of a token of choice `index`.
    fn token(&mut self, index: usize, token: &TokenOut) -> Vec<Value>;
    /// The events of choice `index`'s prompt logprobs (before its first token; only when the
    /// request asked for them).
    fn prompt_logprobs(&mut self, _index: usize, _entries: &[Option<PromptLogprob>]) -> Vec<Value> {
        Vec::new()
    }
    /// The events of choice `index`'s end.
    fn finish(&mut self, index: usize, end: &End) -> Vec<Value>;
    /// The events after every choice ended; `usage` (OpenAI's object) when the request asked
    /// for it (`stream_options.include_usage`).
    fn closing(&mut self, usage: Option<Value>) -> Vec<Value>;
    /// The event of a failure after the headers went out.
    fn error(&mut self, e: &Error) -> Value {
        e.body()
    }
    /// Whether each event is named by its `type` (`event: <type>`) and the stream ends without
    /// OpenAI's `[DONE]` (the Messages and Responses APIs).
    fn typed(&self) -> bool {
        false
    }
}

/// An OpenAI body `{id, object, created, model, choices, usage}` of `outputs`, each choice
/// written by `choice`.
pub(crate) fn choices_body(
    meta: &Meta,
    object: &str,
    outputs: &[Output],
    n: usize,
    choice: impl Fn(usize, &Output) -> Value,
) -> Value {
    let choices: Vec<Value> = outputs.iter().enumerate().map(|(i, o)| choice(i, o)).collect();
    json!({
        "id": meta.id, "object": object, "created": meta.created, "model": meta.model,
        "choices": choices, "usage": total_usage(outputs, n),
    })
}

/// OpenAI's closing usage chunk of an `object` stream (`stream_options.include_usage`): none when
/// `usage` was not asked for.
pub(crate) fn usage_chunk(meta: &Meta, object: &str, usage: Option<Value>) -> Vec<Value> {
    let m = meta;
    usage
        .map(|usage| {
            json!({"id": m.id, "object": object, "created": m.created, "model": m.model, "choices": [], "usage": usage})
        })
        .into_iter()
        .collect()
}

struct SseState<R> {
    events: SelectAll<BoxStream<'static, (usize, Event)>>,
    render: R,
    /// Events rendered and not sent yet; a string is sent as it is (`[DONE]`).
    pending: VecDeque<Value>,
    prompt_tokens: Vec<usize>,
    completion_tokens: usize,
    n: usize,
    include_usage: bool,
    done: bool,
    failed: Vec<bool>,
    /// Choices whose stream ended with `Finished` or an error.
    ended: Vec<bool>,
    _admission: Admission,
}

impl<R: Render> SseState<R> {
    /// The next SSE event's payload; `None` after the last.
    async fn next_data(&mut self) -> Option<Value> {
        loop {
            if let Some(d) = self.pending.pop_front() {
                return Some(d);
            }
            if self.done {
                return None;
            }
            match self.events.next().await {
                Some((i, ev)) => self.on_event(i, ev),
                None => {
                    // A stream that ended without a finish or an error (the engine went away)
                    // must not look like a normal end: it gets an error event.
                    if let Some(i) = self.ended.iter().position(|&e| !e) {
                        self.ended[i] = true;
                        self.pending.push_back(self.render.error(&Error::Engine(EngineError::Shutdown)));
                        continue;
                    }
                    let usage =
                        self.include_usage.then(|| usage_json(self.prompt_tokens.iter().sum(), self.completion_tokens));
                    self.pending.extend(self.render.closing(usage));
                    if !self.render.typed() {
                        self.pending.push_back(Value::String("[DONE]".to_string()));
                    }
                    self.done = true;
                }
            }
        }
    }

    fn on_event(&mut self, i: usize, ev: Event) {
        match ev {
            Event::Token { id, text_delta, logprob, top_logprobs } => {
                if text_delta.is_empty() && logprob.is_none() {
                    return; // half a multi-byte character: nothing to send yet
                }
                let token = TokenOut { id, text: text_delta, logprob, top: top_logprobs };
                self.pending.extend(self.render.token(i, &token));
            }
            Event::Finished { reason, usage, stop_reason } => {
                self.ended[i] = true;
                self.prompt_tokens[i / self.n] = usage.prompt_tokens;
                self.completion_tokens += usage.completion_tokens;
                if !self.failed[i] {
                    self.pending.extend(self.render.finish(i, &End { reason, stop_reason, usage }));
                }
            }
            Event::PromptLogprobs(entries) => {
                self.pending.extend(self.render.prompt_logprobs(i, &entries));
            }
            Event::Error(e) => {
                // Headers are sent: the failure travels as an error event, as vLLM sends it.
                self.failed[i] = true;
                self.ended[i] = true;
                self.pending.push_back(self.render.error(&Error::Engine(e)));
            }
            _ => {}
        }
    }
}

/// OpenAI's `usage` object.
fn usage_json(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

/// Usage of a collected response: prompt tokens once per prompt, completion tokens of all choices.
fn total_usage(outputs: &[Output], n: usize) -> Value {
    let prompt: usize = outputs.chunks(n.max(1)).map(|c| c[0].usage.prompt_tokens).sum();
    let completion: usize = outputs.iter().map(|o| o.usage.completion_tokens).sum();
    usage_json(prompt, completion)
}
