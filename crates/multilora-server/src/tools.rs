//! `tools` and `tool_choice` of chat completions, as OpenAI and vLLM take them: the tools go to
//! the chat template (`tools` in its context); `tool_choice` decides what becomes of the reply.
//! `none` leaves it text; a named function constrains the reply to that function's parameters
//! schema and returns it as the call's arguments; `required` constrains it to a JSON list of
//! `{"name", "parameters"}` calls of the given tools; `auto` (the default with tools; it needs
//! `--enable-auto-tool-choice` and a `--tool-call-parser`) lets the model write a call in its
//! own syntax, parsed by that parser. Calls come back as `message.tool_calls`, streamed as
//! OpenAI's tool-call deltas ([`ToolStream`]).

use multilora::{Constraint, FinishReason};
use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::tool_parsers::{Parsed, ParsedCall, ToolCallParser};

/// Most tools one request may offer (OpenAI's bound).
pub const MAX_TOOLS: usize = 128;

/// The fields, as the body spells them.
#[derive(Clone, Debug, Default, serde::Deserialize)]
pub(crate) struct ToolFields {
    tools: Option<Value>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
}

/// A tool: its name, its parameters' schema, and the object as given (for the template).
#[derive(Clone, Debug)]
struct Tool {
    name: String,
    parameters: Value,
}

/// What becomes of a reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ToolMode {
    /// The named function: the reply is its arguments.
    Named(String),
    /// A JSON list of calls.
    Required,
    /// The model's own syntax, parsed.
    Auto(ToolCallParser),
}

/// A request's tools, read and checked.
#[derive(Clone, Debug)]
pub(crate) struct Tools {
    /// The tools as given, for the template's `tools`.
    pub(crate) for_template: Vec<Value>,
    /// `None`: `tool_choice: "none"`.
    pub(crate) mode: Option<ToolMode>,
    /// The constraint that `Named` and `Required` put on the reply.
    pub(crate) constraint: Option<Constraint>,
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b))
}

impl ToolFields {
    /// The request's tools (`None` without any), `auto` parsed by `parser` when the server
    /// enables it.
    pub(crate) fn read(&self, parser: Option<ToolCallParser>) -> Result<Option<Tools>> {
        const T: &str = "tools";
        const C: &str = "tool_choice";
        let list = match &self.tools {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a.clone(),
            Some(_) => return Err(Error::bad(T, "tools must be a list")),
        };
        let choice = self.tool_choice.as_ref().filter(|v| !v.is_null());
        if list.is_empty() {
            return match choice {
                None | Some(Value::String(_)) if choice.is_none_or(|c| c == "none" || c == "auto") => Ok(None),
                _ => Err(Error::bad(C, "tool_choice other than none or auto needs tools")),
            };
        }
        if list.len() > MAX_TOOLS {
            return Err(Error::bad(T, format!("at most {MAX_TOOLS} tools, got {}", list.len())));
        }
        let mut tools: Vec<Tool> = Vec::with_capacity(list.len());
        for (i, t) in list.iter().enumerate() {
            let at = |m: &str| Error::bad(format!("tools[{i}]"), format!("tools[{i}]: {m}"));
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(at("type must be \"function\""));
            }
            let f = t.get("function").and_then(Value::as_object).ok_or_else(|| at("function must be an object"))?;
            let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
            if !valid_name(name) {
                return Err(at("function.name must be 1 to 64 of a-z, A-Z, 0-9, _, - and ."));
            }
            if tools.iter().any(|t| t.name == name) {
                return Err(at(&format!("a second tool named {name:?}")));
            }
            let parameters = match f.get("parameters") {
                None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
                Some(p @ Value::Object(_)) => p.clone(),
                Some(_) => return Err(at("function.parameters must be a JSON schema object")),
            };
            tools.push(Tool { name: name.to_string(), parameters });
        }
        let mode = match choice {
            None => Some("auto"),
            Some(Value::String(s)) => Some(s.as_str()),
            Some(Value::Object(o)) => {
                let name = o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str).ok_or_else(|| {
                    Error::bad(
                        C,
                        "tool_choice must name a function: {\"type\": \"function\", \"function\": {\"name\": …}}",
                    )
                })?;
                if !tools.iter().any(|t| t.name == name) {
                    return Err(Error::bad(C, format!("tool_choice names {name:?}, which is not among the tools")));
                }
                return Ok(Some(self.tools_with(list, &tools, ToolMode::Named(name.to_string()))));
            }
            Some(_) => None,
        };
        let mode = match mode {
            Some("none") => None,
            Some("required") => Some(ToolMode::Required),
            Some("auto") => match parser {
                Some(p) => Some(ToolMode::Auto(p)),
                None => {
                    return Err(Error::bad(
                        C,
                        "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set",
                    ));
                }
            },
            _ => return Err(Error::bad(C, "tool_choice must be none, auto, required or a named function")),
        };
        Ok(Some(match mode {
            Some(m) => self.tools_with(list, &tools, m),
            None => Tools { for_template: list, mode: None, constraint: None },
        }))
    }

    fn tools_with(&self, list: Vec<Value>, tools: &[Tool], mode: ToolMode) -> Tools {
        let constraint = match &mode {
            ToolMode::Named(name) => {
                tools.iter().find(|t| &t.name == name).map(|t| Constraint::JsonSchema(t.parameters.clone()))
            }
            ToolMode::Required => {
                let calls: Vec<Value> = tools
                    .iter()
                    .map(|t| {
                        json!({"type": "object", "properties": {"name": {"const": t.name}, "parameters": t.parameters},
                               "required": ["name", "parameters"], "additionalProperties": false})
                    })
                    .collect();
                let mut schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": calls}});
                if self.parallel_tool_calls == Some(false) {
                    schema["maxItems"] = json!(1);
                }
                Some(Constraint::JsonSchema(schema))
            }
            ToolMode::Auto(_) => None,
        };
        Tools { for_template: list, mode: Some(mode), constraint }
    }
}

/// A call as the reply returns it.
#[derive(Clone, Debug)]
pub(crate) struct ToolCall {
    pub(crate) id: String,
    pub(crate) name: String,
    pub(crate) arguments: String,
}

/// Call ids unique to a response's choice: `call_`, the response id's hex, the choice and the
/// call's number.
#[derive(Clone, Debug)]
pub(crate) struct CallIds {
    base: String,
    next: usize,
}

impl CallIds {
    pub(crate) fn new(response_id: &str, choice: usize) -> CallIds {
        let hex = response_id.rsplit('-').next().unwrap_or(response_id);
        CallIds { base: format!("call_{hex}{choice:x}"), next: 0 }
    }

    pub(crate) fn next_id(&mut self) -> String {
        self.next += 1;
        format!("{}{:x}", self.base, self.next - 1)
    }
}

impl ToolMode {
    /// The reply `text` as content and calls.
    pub(crate) fn parse(&self, text: &str) -> Parsed {
        match self {
            ToolMode::Named(name) => {
                Parsed { content: None, calls: vec![ParsedCall { name: name.clone(), arguments: text.to_string() }] }
            }
            ToolMode::Required => {
                let list: Option<Vec<ParsedCall>> = serde_json::from_str::<Vec<Value>>(text).ok().and_then(|l| {
                    l.iter()
                        .map(|c| {
                            let name = c.get("name")?.as_str()?.to_string();
                            Some(ParsedCall { name, arguments: c.get("parameters")?.to_string() })
                        })
                        .collect()
                });
                match list {
                    Some(calls) if !calls.is_empty() => Parsed { content: None, calls },
                    _ => Parsed { content: Some(text.to_string()), calls: Vec::new() },
                }
            }
            ToolMode::Auto(p) => p.parse(text),
        }
    }

    /// The finish reason of a reply that ended with `end`: one that stopped on its own and made
    /// calls finishes with OpenAI's `tool_calls` (`stop` for a named function, as OpenAI answers
    /// a forced call).
    pub(crate) fn finish_reason(&self, end: FinishReason, made_calls: bool) -> &'static str {
        match self {
            _ if end != FinishReason::Stop || !made_calls => end.as_str(),
            ToolMode::Named(_) => "stop",
            _ => "tool_calls",
        }
    }
}

/// The JSON of calls, as `message.tool_calls`.
pub(crate) fn calls_json(calls: &[ToolCall]) -> Value {
    Value::Array(
        calls
            .iter()
            .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
            .collect(),
    )
}

/// One choice's stream under a tool mode: which of its text goes out as content now, and the
/// tool-call deltas. A named function streams its arguments as they come; `required` and
/// `auto` hold the calls back until the reply ends and then send each call whole (the same
/// parse as the collected reply, so both give the same calls); `auto` streams the content
/// before the calls, holding back what may be the start of the call marker.
#[derive(Debug)]
pub(crate) struct ToolStream {
    mode: ToolMode,
    /// The reply so far.
    text: String,
    /// Bytes of `text` sent as content (or, for a named function, as arguments).
    sent: usize,
    /// The calls have begun (`auto`): nothing more goes out as content.
    in_calls: bool,
    /// A named function's call id, once its first delta went out.
    named_id: Option<String>,
    /// Where its calls' ids come from.
    ids: CallIds,
}

/// What a [`ToolStream`] sends for a piece of text.
#[derive(Debug, Default)]
pub(crate) struct ToolDeltas {
    /// Content to send.
    pub(crate) content: String,
    /// Tool-call deltas to send (`delta.tool_calls` entries).
    pub(crate) calls: Vec<Value>,
}

impl ToolStream {
    pub(crate) fn new(mode: ToolMode, ids: CallIds) -> ToolStream {
        ToolStream { mode, text: String::new(), sent: 0, in_calls: false, named_id: None, ids }
    }

    /// The deltas for `piece`, the reply's next text.
    pub(crate) fn push(&mut self, piece: &str) -> ToolDeltas {
        self.text.push_str(piece);
        let mut out = ToolDeltas::default();
        match &self.mode {
            ToolMode::Named(name) => {
                if self.named_id.is_none() {
                    let id = self.ids.next_id();
                    out.calls.push(
                        json!({"index": 0, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}),
                    );
                    self.named_id = Some(id);
                }
                if !piece.is_empty() {
                    out.calls.push(json!({"index": 0, "function": {"arguments": piece}}));
                }
                self.sent = self.text.len();
            }
            ToolMode::Required => {}
            ToolMode::Auto(p) if !self.in_calls => {
                let upto = match p.calls_start(&self.text) {
                    Ok(start) => {
                        self.in_calls = true;
                        start
                    }
                    Err(hold) => self.text.len() - hold,
                };
                if upto > self.sent {
                    out.content = self.text[self.sent..upto].to_string();
                    self.sent = upto;
                }
            }
            ToolMode::Auto(_) => {}
        }
        out
    }

    /// The deltas at the reply's end, and whether it made calls.
    pub(crate) fn finish(&mut self) -> (ToolDeltas, bool) {
        let mut out = ToolDeltas::default();
        if let ToolMode::Named(_) = self.mode {
            return (out, self.named_id.is_some());
        }
        let parsed = self.mode.parse(&self.text);
        if parsed.calls.is_empty() {
            // No call after all: what was held back is content.
            out.content = self.text[self.sent..].to_string();
            self.sent = self.text.len();
            return (out, false);
        }
        for (i, c) in parsed.calls.into_iter().enumerate() {
            out.calls.push(json!({"index": i, "id": self.ids.next_id(), "type": "function",
                "function": {"name": c.name, "arguments": c.arguments}}));
        }
        (out, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(body: Value, parser: Option<ToolCallParser>) -> Result<Option<Tools>> {
        serde_json::from_value::<ToolFields>(body).unwrap().read(parser)
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    }

    #[test]
    fn choices_read_into_modes_and_constraints() {
        let t = read(json!({"tools": [weather()], "tool_choice": "required"}), None).unwrap().unwrap();
        assert_eq!(t.mode, Some(ToolMode::Required));
        let Some(Constraint::JsonSchema(s)) = t.constraint else { panic!() };
        assert_eq!(s["items"]["anyOf"][0]["properties"]["name"]["const"], "get_weather");
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let t = read(json!({"tools": [weather()], "tool_choice": named}), None).unwrap().unwrap();
        assert_eq!(t.mode, Some(ToolMode::Named("get_weather".into())));
        assert_eq!(t.constraint, Some(Constraint::JsonSchema(weather()["function"]["parameters"].clone())));
        let t = read(json!({"tools": [weather()]}), Some(ToolCallParser::Hermes)).unwrap().unwrap();
        assert_eq!((t.mode, t.constraint), (Some(ToolMode::Auto(ToolCallParser::Hermes)), None));
        let t = read(json!({"tools": [weather()], "tool_choice": "none"}), None).unwrap().unwrap();
        assert_eq!((t.mode, t.for_template.len()), (None, 1));
        assert!(read(json!({"tool_choice": "auto"}), None).unwrap().is_none());
    }

    #[test]
    fn bad_tools_are_named() {
        let named = |n: &str| json!({"type": "function", "function": {"name": n}});
        for (body, param) in [
            (json!({"tools": [weather()]}), "tool_choice"),
            (json!({"tools": [weather()], "tool_choice": named("nope")}), "tool_choice"),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (json!({"tools": [{"type": "function", "function": {"name": "bad name"}}]}), "tools[0]"),
            (json!({"tools": [weather(), weather()], "tool_choice": "required"}), "tools[1]"),
            (json!({"tools": [{"type": "code"}], "tool_choice": "required"}), "tools[0]"),
            (json!({"tools": {"a": 1}}), "tools"),
        ] {
            let err = read(body.clone(), None).unwrap_err();
            assert!(matches!(&err, Error::BadRequest { param: Some(p), .. } if p == param), "{body}: {err:?}");
        }
    }

    #[test]
    fn streamed_calls_are_the_collected_ones() {
        let text =
            "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
        let mode = ToolMode::Auto(ToolCallParser::Hermes);
        let collected = mode.parse(text);
        let mut stream = ToolStream::new(mode, CallIds::new("chatcmpl-00ff", 0));
        let mut content = String::new();
        for piece in text.as_bytes().chunks(3).map(|c| std::str::from_utf8(c).unwrap()) {
            let d = stream.push(piece);
            assert!(d.calls.is_empty());
            content.push_str(&d.content);
        }
        let (end, made) = stream.finish();
        assert!(made);
        assert_eq!(content.trim(), collected.content.unwrap());
        assert_eq!(end.calls.len(), 1);
        assert_eq!(end.calls[0]["function"]["name"], "get_weather");
        assert_eq!(end.calls[0]["function"]["arguments"], collected.calls[0].arguments.as_str());
        // A named function streams its arguments as they come.
        let mut stream = ToolStream::new(ToolMode::Named("f".into()), CallIds::new("chatcmpl-00ff", 1));
        let a = stream.push("{\"x\":");
        let b = stream.push(" 1}");
        assert_eq!(a.calls[0]["function"]["name"], "f");
        assert_eq!(a.calls[1]["function"]["arguments"], "{\"x\":");
        assert_eq!(b.calls[0]["function"]["arguments"], " 1}");
    }
}
