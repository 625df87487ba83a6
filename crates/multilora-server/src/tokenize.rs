//! `POST /tokenize` and `POST /detokenize`, in vLLM's shapes: a `prompt` (special tokens added
//! unless `add_special_tokens` is false) or chat `messages` (rendered as chat completions renders
//! them, `conversation.rs`) to `{count, max_model_len, tokens, token_strs}`, and `tokens` back to
//! `{prompt}`. The model named, if any, must be one this server serves (every adapter shares the
//! base model's tokenizer).

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use multilora::EngineError;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::admin::blocking;
use crate::conversation::{Turn, prompt_ids};
use crate::error::{Error, Result};
use crate::protocol::{ChatMessage, parse_body};
use crate::state::AppState;

/// `POST /tokenize`.
#[derive(Debug, Deserialize)]
pub(crate) struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<ChatMessage>>,
    add_special_tokens: Option<bool>,
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    return_token_strs: bool,
    chat_template: Option<String>,
    #[serde(default)]
    chat_template_kwargs: Map<String, Value>,
}

/// `POST /detokenize`.
#[derive(Debug, Deserialize)]
pub(crate) struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
}

/// A 404 unless `model` (when given) is the base model or an adapter the server holds.
pub(crate) async fn check_model(state: &AppState, model: Option<&str>) -> Result<()> {
    let Some(model) = model else { return Ok(()) };
    let engine = state.engine.clone();
    let known = blocking(move || Ok(engine.models())).await?;
    if known.iter().any(|m| m.id == model) {
        Ok(())
    } else {
        Err(Error::Engine(EngineError::ModelNotFound { name: model.to_string() }))
    }
}

pub(crate) async fn tokenize(State(state): State<AppState>, body: Bytes) -> Result<Json<Value>> {
    let req: TokenizeRequest = parse_body(&body)?;
    check_model(&state, req.model.as_deref()).await?;
    let tokens = match (&req.prompt, &req.messages) {
        (Some(prompt), None) => state.engine.tokenize(prompt, req.add_special_tokens.unwrap_or(true))?,
        (None, Some(messages)) => {
            if req.add_special_tokens == Some(true) {
                return Err(Error::bad("add_special_tokens", "the chat template writes special tokens for messages"));
            }
            let turns = messages
                .iter()
                .enumerate()
                .map(|(i, m)| Ok(Turn::new(&m.role, m.text(i)?)))
                .collect::<Result<Vec<_>>>()?;
            let add = req.add_generation_prompt.unwrap_or(true);
            prompt_ids(&state, req.chat_template.as_deref(), &turns, add, &req.chat_template_kwargs)?
        }
        _ => return Err(Error::bad("prompt", "give either prompt or messages")),
    };
    let token_strs = match req.return_token_strs {
        true => json!(state.engine.token_texts(&tokens)?),
        false => Value::Null,
    };
    Ok(Json(json!({
        "count": tokens.len(),
        "max_model_len": state.engine.config().max_model_len,
        "tokens": tokens,
        "token_strs": token_strs,
    })))
}

pub(crate) async fn detokenize(State(state): State<AppState>, body: Bytes) -> Result<Json<Value>> {
    let req: DetokenizeRequest = parse_body(&body)?;
    check_model(&state, req.model.as_deref()).await?;
    let vocab = state.engine.config().vocab_size;
    if let Some(bad) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::bad("tokens", format!("token {bad} is out of the vocabulary of {vocab}")));
    }
    Ok(Json(json!({"prompt": state.engine.detokenize(&req.tokens, false)?})))
}
