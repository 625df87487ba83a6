//! The tool-call syntaxes of the served families, by vLLM's `--tool-call-parser` names:
//! `hermes` (Qwen 2.5 / 3, SmolLM3, Hermes: `<tool_call>{"name": …, "arguments": …}</tool_call>`),
//! `llama3_json` (Llama 3.1–3.3: a bare `{"name": …, "parameters": …}` object, after
//! `<|python_tag|>` or not, several separated by `;`) and `mistral` (`[TOOL_CALLS]` then a JSON
//! list of `{"name", "arguments"}`, or `name[ARGS]{…}` in newer tokenizers). A reply whose call
//! does not parse is left as text, as vLLM leaves it.

use serde_json::Value;

/// A parsed call: the function's name and its arguments as a JSON string.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ParsedCall {
    pub(crate) name: String,
    pub(crate) arguments: String,
}

/// What a reply parsed into: text before the calls (`None` when empty) and the calls.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Parsed {
    pub(crate) content: Option<String>,
    pub(crate) calls: Vec<ParsedCall>,
}

/// A tool-call syntax.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ToolCallParser {
    /// `<tool_call>{…}</tool_call>` blocks.
    Hermes,
    /// A bare JSON object (or several, `;`-separated), maybe after `<|python_tag|>`.
    Llama3Json,
    /// `[TOOL_CALLS]` and a JSON list of calls.
    Mistral,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";
const MISTRAL_MARK: &str = "[TOOL_CALLS]";

impl ToolCallParser {
    /// The parser vLLM names `name`.
    pub fn from_name(name: &str) -> Option<ToolCallParser> {
        match name {
            "hermes" => Some(ToolCallParser::Hermes),
            "llama3_json" => Some(ToolCallParser::Llama3Json),
            "mistral" => Some(ToolCallParser::Mistral),
            _ => None,
        }
    }

    /// The names [`ToolCallParser::from_name`] knows.
    pub const NAMES: [&'static str; 3] = ["hermes", "llama3_json", "mistral"];

    /// Whether the syntax's marker is a special token (kept in the text only when special tokens
    /// are not skipped).
    pub(crate) fn needs_special_tokens(self) -> bool {
        matches!(self, ToolCallParser::Mistral | ToolCallParser::Llama3Json)
    }

    /// Where the calls of `text` begin (the text before is content), if they have begun; and,
    /// when they have not, how many bytes at its end could be the start of the marker (held back
    /// from a stream until known).
    pub(crate) fn calls_start(self, text: &str) -> Result<usize, usize> {
        let markers: &[&str] = match self {
            ToolCallParser::Hermes => &[HERMES_OPEN],
            ToolCallParser::Mistral => &[MISTRAL_MARK],
            ToolCallParser::Llama3Json => {
                let trimmed = text.trim_start();
                if trimmed.starts_with('{') {
                    return Ok(text.len() - trimmed.len());
                }
                if trimmed.is_empty() {
                    return Err(text.len());
                }
                &[PYTHON_TAG]
            }
        };
        let mut hold = 0;
        for m in markers {
            if let Some(at) = text.find(m) {
                return Ok(at);
            }
            hold = hold.max(partial_suffix(text, m));
        }
        Err(hold)
    }

    /// The calls of a whole reply.
    pub(crate) fn parse(self, text: &str) -> Parsed {
        let as_text = || Parsed { content: Some(text.to_string()), calls: Vec::new() };
        let Ok(start) = self.calls_start(text) else { return as_text() };
        let content = Some(text[..start].trim()).filter(|c| !c.is_empty()).map(str::to_string);
        let rest = &text[start..];
        let calls = match self {
            ToolCallParser::Hermes => hermes(rest),
            ToolCallParser::Llama3Json => llama3(rest.strip_prefix(PYTHON_TAG).unwrap_or(rest)),
            ToolCallParser::Mistral => mistral(&rest[MISTRAL_MARK.len()..]),
        };
        match calls {
            Some(calls) if !calls.is_empty() => Parsed { content, calls },
            _ => as_text(),
        }
    }
}

/// The longest end of `text` that is a proper start of `marker`, in bytes.
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len())
        .rev()
        .find(|&n| {
            text.len() >= n && text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// A call object `{"name": …, <args>: …}`, its arguments an object or a string of JSON.
fn call(v: &Value, args_keys: &[&str]) -> Option<ParsedCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = args_keys.iter().find_map(|k| v.get(*k)).cloned().unwrap_or_else(|| Value::Object(Default::default()));
    let arguments = match args {
        Value::String(s) => s,
        other => other.to_string(),
    };
    Some(ParsedCall { name, arguments })
}

fn hermes(mut rest: &str) -> Option<Vec<ParsedCall>> {
    let mut calls = Vec::new();
    while let Some(open) = rest.find(HERMES_OPEN) {
        let body = &rest[open + HERMES_OPEN.len()..];
        let (inner, next) = match body.find(HERMES_CLOSE) {
            Some(close) => (&body[..close], &body[close + HERMES_CLOSE.len()..]),
            None => (body, ""),
        };
        let v: Value = serde_json::from_str(inner.trim()).ok()?;
        calls.push(call(&v, &["arguments", "parameters"])?);
        rest = next;
    }
    Some(calls)
}

fn llama3(rest: &str) -> Option<Vec<ParsedCall>> {
    let mut calls = Vec::new();
    for part in rest.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        let v: Value = serde_json::from_str(part).ok()?;
        calls.push(call(&v, &["parameters", "arguments"])?);
    }
    Some(calls)
}

fn mistral(rest: &str) -> Option<Vec<ParsedCall>> {
    let rest = rest.trim();
    if rest.starts_with('[') {
        let list: Vec<Value> = serde_json::from_str(rest).ok()?;
        return list.iter().map(|v| call(v, &["arguments", "parameters"])).collect();
    }
    // Newer tokenizers: `name[ARGS]{…}` per call, each after its own `[TOOL_CALLS]`.
    let mut calls = Vec::new();
    for part in rest.split(MISTRAL_MARK).map(str::trim).filter(|p| !p.is_empty()) {
        let (name, args) = part.split_once("[ARGS]")?;
        let v: Value = serde_json::from_str(args.trim()).ok()?;
        calls.push(ParsedCall { name: name.trim().to_string(), arguments: v.to_string() });
    }
    Some(calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(name: &str, arguments: &str) -> ParsedCall {
        ParsedCall { name: name.into(), arguments: arguments.into() }
    }

    #[test]
    fn hermes_calls_and_content() {
        let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let p = ToolCallParser::Hermes.parse(text);
        assert_eq!(p.content.as_deref(), Some("Let me look."));
        assert_eq!(p.calls, vec![one("get_weather", r#"{"city":"Paris"}"#), one("now", "{}")]);
        // Unclosed at the end (stopped at EOS), and a broken one left as text.
        let p = ToolCallParser::Hermes.parse("<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}");
        assert_eq!((p.content, p.calls), (None, vec![one("f", r#"{"a":1}"#)]));
        let p = ToolCallParser::Hermes.parse("<tool_call>{\"name\": ");
        assert_eq!(p.calls, vec![]);
        assert_eq!(ToolCallParser::Hermes.parse("plain").content.as_deref(), Some("plain"));
    }

    #[test]
    fn llama3_and_mistral_calls() {
        let p = ToolCallParser::Llama3Json.parse(
            "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"x\": 2}}; {\"name\": \"g\", \"parameters\": {}}",
        );
        assert_eq!(p.calls, vec![one("f", r#"{"x":2}"#), one("g", "{}")]);
        assert_eq!(
            ToolCallParser::Llama3Json.parse(" {\"name\": \"f\", \"parameters\": {}}").calls,
            vec![one("f", "{}")]
        );
        assert!(ToolCallParser::Llama3Json.parse("Hello {").calls.is_empty());
        let p = ToolCallParser::Mistral.parse("[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"q\": \"a\"}}]");
        assert_eq!(p.calls, vec![one("f", r#"{"q":"a"}"#)]);
        let p = ToolCallParser::Mistral.parse("ok [TOOL_CALLS]f[ARGS]{\"q\": 1}[TOOL_CALLS]g[ARGS]{}");
        assert_eq!((p.content.as_deref(), p.calls), (Some("ok"), vec![one("f", r#"{"q":1}"#), one("g", "{}")]));
    }

    #[test]
    fn a_marker_split_over_tokens_is_held_back() {
        assert_eq!(ToolCallParser::Hermes.calls_start("Sure <tool_"), Err(6));
        assert_eq!(ToolCallParser::Hermes.calls_start("Sure <tool_call>{"), Ok(5));
        assert_eq!(ToolCallParser::Hermes.calls_start("Sure"), Err(0));
        assert_eq!(ToolCallParser::Llama3Json.calls_start("  "), Err(2));
        assert_eq!(ToolCallParser::Llama3Json.calls_start(" {\"n"), Ok(1));
        assert_eq!(ToolCallParser::Mistral.calls_start("x [TOOL"), Err(5));
    }
}
