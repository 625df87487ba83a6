//! A conversation's prompt, the one way every chat-shaped API (chat completions, Anthropic's
//! Messages, OpenAI's Responses, `/tokenize` with `messages`, `count_tokens`) turns messages into
//! token ids: rendered through the chat template that serves the request (the request's own when
//! the server trusts request templates, else the server's `--chat-template`, else the model's; a
//! clear 400 when there is none), tokenized without adding special tokens (the template writes
//! them, as in vLLM).

use serde_json::{Map, Value, json};

use crate::error::{Error, Result};
use crate::state::AppState;
use crate::template::ChatTemplate;

/// One message of a conversation, its content already text, with the keys of a tool-using
/// conversation beside (`tool_calls` of an assistant turn, `tool_call_id` and `name` of a tool's
/// answer) as the template sees them.
#[derive(Clone, Debug)]
pub(crate) struct Turn {
    pub(crate) role: String,
    pub(crate) text: String,
    pub(crate) extra: Map<String, Value>,
}

impl Turn {
    pub(crate) fn new(role: impl Into<String>, text: impl Into<String>) -> Turn {
        Turn { role: role.into(), text: text.into(), extra: Map::new() }
    }

    /// The message the template sees.
    fn message(&self) -> Value {
        let mut m = self.extra.clone();
        m.insert("role".into(), json!(self.role));
        m.insert("content".into(), json!(self.text));
        Value::Object(m)
    }
}

/// The token ids of `turns` rendered through the template serving the request (`own`: the
/// request's template source, if it brought one), with the assistant's turn opened when
/// `add_generation_prompt`.
pub(crate) fn prompt_ids(
    state: &AppState,
    own: Option<&str>,
    turns: &[Turn],
    add_generation_prompt: bool,
    kwargs: &Map<String, Value>,
) -> Result<Vec<u32>> {
    prompt_ids_with_tools(state, own, turns, add_generation_prompt, None, kwargs)
}

/// [`prompt_ids`] with the request's `tools` in the template's context.
pub(crate) fn prompt_ids_with_tools(
    state: &AppState,
    own: Option<&str>,
    turns: &[Turn],
    add_generation_prompt: bool,
    tools: Option<&[Value]>,
    kwargs: &Map<String, Value>,
) -> Result<Vec<u32>> {
    let own = match own {
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
    let messages: Vec<Value> = turns.iter().map(Turn::message).collect();
    let text = template.render_with_tools(&messages, add_generation_prompt, tools, kwargs)?;
    Ok(state.engine.tokenize(&text, false)?)
}
