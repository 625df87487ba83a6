//! Request bodies of the OpenAI endpoints (with vLLM's extra sampling fields) and their
//! translation into engine requests. Bodies are parsed with `serde_path_to_error`, so a bad field
//! is named in the 400. Unknown fields are ignored, as OpenAI's clients send some we do not use,
//! except those that would change the output if honoured and are not implemented (beam search,
//! logits processors, …): those are refused by name rather than silently dropped. Structured
//! outputs' fields are read in `structured.rs`, tools in `tools.rs`.

use std::collections::BTreeMap;

use multilora::{
    GenerateRequest, MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, Prompt, SamplingParams, ValidParams,
};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::structured::ConstraintFields;
use crate::tools::ToolFields;

/// Parses a JSON body, naming the field that failed.
pub(crate) fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<T> {
    from_value(&json_body(body)?)
}

/// The body as JSON, or a 400 saying where it is not JSON.
pub(crate) fn json_body(body: &[u8]) -> Result<Value> {
    serde_json::from_slice(body)
        .map_err(|e| Error::BadRequest { param: None, message: format!("invalid JSON body: {e}") })
}

/// Deserializes `v`, naming the field that failed (its path, e.g. `messages[1].role`).
pub(crate) fn from_value<'a, T: Deserialize<'a>>(v: &'a Value) -> Result<T> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." || path.is_empty() {
            Error::BadRequest { param: None, message: format!("invalid request body: {inner}") }
        } else {
            Error::bad(path.clone(), format!("{path}: {inner}"))
        }
    })
}

/// A request body with the sampling fields parsed on their own (no `serde(flatten)`, which
/// would hide the failing field's name), for the OpenAI endpoints (`unsupported`: their
/// [`UNSUPPORTED`]) and the APIs of their own (Messages, Responses): `unsupported` refused
/// unless off, and `foreign`, sampling fields that API spells otherwise, refused whatever their
/// value with `hint`. The body comes back too, for the API's own checks.
pub(crate) fn parse_with_sampling_under<T: DeserializeOwned>(
    body: &[u8],
    unsupported: &[&str],
    foreign: &[&str],
    hint: &str,
) -> Result<(Value, T, Sampling)> {
    let v = json_body(body)?;
    refuse_unsupported(&v, unsupported)?;
    if let Some(name) = foreign.iter().find(|&&n| v.get(n).is_some()) {
        return Err(Error::bad(*name, format!("{name} is not a field of this API ({hint})")));
    }
    let (req, sampling) = (from_value(&v)?, from_value(&v)?);
    Ok((v, req, sampling))
}

/// Fields that change what is generated, which this server does not implement: a request that
/// sets one (to anything but its "off" value) is refused with a 400 naming it, as silently
/// ignoring it would return an output the client did not ask for.
const UNSUPPORTED: &[&str] = &[
    "functions",
    "function_call",
    "logits_processors",
    "allowed_token_ids",
    "bad_words",
    "use_beam_search",
    "include_stop_str_in_output",
    "truncate_prompt_tokens",
    "prompt_embeds",
    "continue_final_message",
    "add_special_tokens",
];

/// Whether `value` of field `name` is its "off" value (absent, null, empty, false, or the
/// setting that means "plain text": `tool_choice: "none"`/`"auto"` without tools,
/// `response_format: {"type": "text"}`, Anthropic's `thinking: {"type": "disabled"}`, a
/// Responses `reasoning` object of nulls).
fn is_off(name: &str, value: &Value) -> bool {
    let kind = || value.get("type").and_then(Value::as_str);
    match value {
        Value::Null | Value::Bool(false) => true,
        Value::Array(a) => a.is_empty(),
        Value::String(s) => matches!((name, s.as_str()), ("tool_choice" | "function_call", "none" | "auto")),
        Value::Object(o) => match name {
            "response_format" => kind() == Some("text"),
            "thinking" => kind() == Some("disabled"),
            "reasoning" => o.values().all(Value::is_null),
            _ => false,
        },
        _ => false,
    }
}

/// A 400 naming the first of `names` the body sets to anything but its "off" value: fields this
/// server does not implement, which silently ignored would change the output.
fn refuse_unsupported(body: &Value, names: &[&str]) -> Result<()> {
    let Some(obj) = body.as_object() else { return Ok(()) };
    match names.iter().find(|&&name| obj.get(name).is_some_and(|v| !is_off(name, v))) {
        Some(name) => Err(Error::bad(*name, format!("{name} is not supported by this server"))),
        None => Ok(()),
    }
}

/// A string or a list of strings (`stop`).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
pub(crate) struct StreamOptions {
    #[serde(default)]
    pub(crate) include_usage: bool,
}

/// Sampling fields both endpoints take (OpenAI's, plus vLLM's extras).
#[derive(Clone, Debug, Default, Deserialize)]
pub(crate) struct Sampling {
    pub(crate) max_tokens: Option<usize>,
    pub(crate) temperature: Option<f32>,
    pub(crate) top_p: Option<f32>,
    pub(crate) top_k: Option<i32>,
    pub(crate) min_p: Option<f32>,
    pub(crate) n: Option<usize>,
    #[serde(default)]
    pub(crate) stream: bool,
    pub(crate) stream_options: Option<StreamOptions>,
    pub(crate) stop: Option<OneOrMany>,
    #[serde(default)]
    pub(crate) stop_token_ids: Vec<u32>,
    pub(crate) seed: Option<u64>,
    pub(crate) presence_penalty: Option<f32>,
    pub(crate) frequency_penalty: Option<f32>,
    pub(crate) repetition_penalty: Option<f32>,
    #[serde(default)]
    pub(crate) logit_bias: BTreeMap<String, f32>,
    #[serde(default)]
    pub(crate) min_tokens: usize,
    #[serde(default)]
    pub(crate) ignore_eos: bool,
    pub(crate) skip_special_tokens: Option<bool>,
    /// vLLM's switch: logprobs name tokens `token_id:<id>` instead of their text.
    #[serde(default)]
    pub(crate) return_tokens_as_token_ids: bool,
    /// vLLM's prompt logprobs: each prompt token's, with this many alternatives.
    pub(crate) prompt_logprobs: Option<usize>,
}

impl Sampling {
    /// The engine's parameters: `base` (the engine's defaults, `EngineConfig::default_params`)
    /// with every field the request sets in its place; `logprobs` is the count of alternatives
    /// asked for.
    pub(crate) fn params(
        &self,
        base: SamplingParams,
        max_tokens: Option<usize>,
        logprobs: Option<usize>,
    ) -> Result<SamplingParams> {
        // The lists a body can make long are bounded before they are copied into the engine's
        // parameters (which the engine validates in full before the fan-out copies them).
        let stops = match &self.stop {
            Some(OneOrMany::Many(v)) => v.len(),
            Some(OneOrMany::One(_)) => 1,
            None => 0,
        };
        if stops > MAX_STOP_STRINGS {
            return Err(Error::bad("stop", format!("stop: at most {MAX_STOP_STRINGS} stop strings, got {stops}")));
        }
        if self.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(Error::bad(
                "stop_token_ids",
                format!(
                    "stop_token_ids: at most {MAX_STOP_TOKEN_IDS} stop token ids, got {}",
                    self.stop_token_ids.len()
                ),
            ));
        }
        let mut p = base;
        p.max_tokens = max_tokens.or(self.max_tokens).or(p.max_tokens);
        if let Some(t) = self.temperature {
            p.temperature = t;
        }
        if let Some(v) = self.top_p {
            p.top_p = v;
        }
        if let Some(v) = self.top_k {
            p.top_k = v;
        }
        if let Some(v) = self.min_p {
            p.min_p = v;
        }
        p.seed = self.seed;
        if let Some(v) = self.presence_penalty {
            p.presence_penalty = v;
        }
        if let Some(v) = self.frequency_penalty {
            p.frequency_penalty = v;
        }
        if let Some(v) = self.repetition_penalty {
            p.repetition_penalty = v;
        }
        for (k, v) in &self.logit_bias {
            let id: u32 =
                k.parse().map_err(|_| Error::bad("logit_bias", format!("logit_bias key {k:?} is not a token id")))?;
            if !(-100.0..=100.0).contains(v) {
                return Err(Error::bad("logit_bias", format!("logit_bias values must be in [-100, 100], got {v}")));
            }
            p.logit_bias.insert(id, *v);
        }
        p.stop = match &self.stop {
            None => Vec::new(),
            Some(OneOrMany::One(s)) => vec![s.clone()],
            Some(OneOrMany::Many(v)) => v.clone(),
        };
        p.stop_token_ids = self.stop_token_ids.clone();
        p.min_tokens = self.min_tokens;
        p.ignore_eos = self.ignore_eos;
        if let Some(v) = self.skip_special_tokens {
            p.skip_special_tokens = v;
        }
        if let Some(n) = logprobs
            && n > MAX_LOGPROBS
        {
            return Err(Error::bad("logprobs", format!("at most {MAX_LOGPROBS} logprobs, got {n}")));
        }
        p.logprobs = logprobs;
        p.prompt_logprobs = self.prompt_logprobs;
        Ok(p)
    }

    /// Completions per prompt (`n`), at least 1.
    pub(crate) fn n(&self) -> Result<usize> {
        match self.n.unwrap_or(1) {
            0 => Err(Error::bad("n", "n must be at least 1")),
            n if n > 128 => Err(Error::bad("n", format!("n must be at most 128, got {n}"))),
            n => Ok(n),
        }
    }

    pub(crate) fn include_usage(&self) -> bool {
        self.stream_options.is_some_and(|o| o.include_usage)
    }
}

/// `prompt` of `/v1/completions`: text, texts, token ids, or lists of token ids.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

/// `POST /v1/completions`.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct CompletionRequest {
    pub(crate) model: String,
    pub(crate) prompt: PromptInput,
    #[serde(skip)]
    pub(crate) sampling: Sampling,
    pub(crate) logprobs: Option<usize>,
    #[serde(default)]
    pub(crate) echo: bool,
    pub(crate) suffix: Option<String>,
    pub(crate) best_of: Option<usize>,
    #[serde(skip)]
    pub(crate) constraints: ConstraintFields,
}

impl CompletionRequest {
    pub(crate) fn parse(body: &[u8]) -> Result<CompletionRequest> {
        let (v, mut req, sampling): (Value, CompletionRequest, Sampling) =
            parse_with_sampling_under(body, UNSUPPORTED, &[], "")?;
        // Tools are chat's: a completion cannot call one.
        refuse_unsupported(&v, &["tools", "tool_choice"])?;
        req.sampling = sampling;
        req.constraints = from_value(&v)?;
        Ok(req)
    }

    /// The prompts, refusing what this server does not do rather than ignoring it.
    pub(crate) fn prompts(&self) -> Result<Vec<Prompt>> {
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(Error::bad("suffix", "suffix is not supported"));
        }
        if let Some(b) = self.best_of
            && b != self.sampling.n.unwrap_or(1)
        {
            return Err(Error::bad("best_of", "best_of other than n is not supported"));
        }
        let prompts: Vec<Prompt> = match &self.prompt {
            PromptInput::Text(t) => vec![Prompt::Text(t.clone())],
            PromptInput::Texts(v) => v.iter().cloned().map(Prompt::Text).collect(),
            PromptInput::Tokens(ids) => vec![Prompt::Tokens(ids.clone())],
            PromptInput::TokenLists(v) => v.iter().cloned().map(Prompt::Tokens).collect(),
        };
        if prompts.is_empty() {
            return Err(Error::bad("prompt", "prompt must not be an empty list"));
        }
        Ok(prompts)
    }
}

/// One chat message; `content` is a string or a list of `{"type": "text", "text": ...}` parts.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct ChatMessage {
    pub(crate) role: String,
    #[serde(default)]
    pub(crate) content: Option<Value>,
    /// An assistant turn's calls.
    pub(crate) tool_calls: Option<Value>,
    /// A tool's answer: the call it answers, and the tool's name.
    pub(crate) tool_call_id: Option<String>,
    pub(crate) name: Option<String>,
}

impl ChatMessage {
    /// The message's text, refusing non-text parts.
    pub(crate) fn text(&self, index: usize) -> Result<String> {
        let param = format!("messages[{index}].content");
        match &self.content {
            None | Some(Value::Null) => Ok(String::new()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(Value::Array(parts)) => {
                let mut out = String::new();
                for part in parts {
                    match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => out.push_str(t),
                        _ => return Err(Error::bad(param, "only text content parts are supported")),
                    }
                }
                Ok(out)
            }
            Some(_) => Err(Error::bad(param, "content must be a string or a list of text parts")),
        }
    }
}

/// `POST /v1/chat/completions`.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct ChatRequest {
    pub(crate) model: String,
    pub(crate) messages: Vec<ChatMessage>,
    #[serde(skip)]
    pub(crate) sampling: Sampling,
    pub(crate) max_completion_tokens: Option<usize>,
    #[serde(default)]
    pub(crate) logprobs: bool,
    pub(crate) top_logprobs: Option<usize>,
    pub(crate) add_generation_prompt: Option<bool>,
    #[serde(default)]
    pub(crate) chat_template_kwargs: serde_json::Map<String, Value>,
    /// vLLM's per-request template, honoured when the server trusts request templates.
    pub(crate) chat_template: Option<String>,
    #[serde(skip)]
    pub(crate) constraints: ConstraintFields,
    /// `tools` and `tool_choice`, read on their own.
    #[serde(skip)]
    pub(crate) tools: ToolFields,
}

impl ChatRequest {
    pub(crate) fn parse(body: &[u8]) -> Result<ChatRequest> {
        let (v, mut req, sampling): (Value, ChatRequest, Sampling) =
            parse_with_sampling_under(body, UNSUPPORTED, &[], "")?;
        req.sampling = sampling;
        req.constraints = from_value(&v)?;
        req.tools = from_value(&v)?;
        Ok(req)
    }

    /// Alternatives asked for: `top_logprobs` when `logprobs` is on.
    pub(crate) fn logprobs(&self) -> Result<Option<usize>> {
        match (self.logprobs, self.top_logprobs) {
            (false, Some(n)) if n > 0 => Err(Error::bad("top_logprobs", "top_logprobs needs logprobs: true")),
            (false, _) => Ok(None),
            (true, n) => Ok(Some(n.unwrap_or(0))),
        }
    }
}

/// `POST /v1/load_lora_adapter`.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct LoadLoraRequest {
    pub(crate) lora_name: String,
    pub(crate) lora_path: String,
    #[serde(default)]
    pub(crate) load_inplace: bool,
}

/// `POST /v1/unload_lora_adapter`.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct UnloadLoraRequest {
    pub(crate) lora_name: String,
}

/// The engine requests of one HTTP request, `n` per prompt, built only as they are submitted
/// (`generation::start`), after the parameters were validated once: a request refused for its
/// parameters costs no copy of them, and each copy made is of checked, bounded parameters.
#[derive(Debug)]
pub(crate) struct FanOut<'a> {
    pub(crate) model: &'a str,
    pub(crate) prompts: Vec<Prompt>,
    pub(crate) params: &'a SamplingParams,
    pub(crate) n: usize,
    /// The field `params.constraint` came from, which a refused constraint's 400 names.
    pub(crate) constraint_param: Option<&'static str>,
}

/// `n` engine requests per prompt of `model`, with `params`; nothing is copied yet.
pub(crate) fn fan_out<'a>(model: &'a str, prompts: Vec<Prompt>, params: &'a SamplingParams, n: usize) -> FanOut<'a> {
    FanOut { model, prompts, params, n, constraint_param: None }
}

impl FanOut<'_> {
    /// Names the field the parameters' constraint came from.
    pub(crate) fn constrained_by(mut self, param: Option<&'static str>) -> Self {
        self.constraint_param = param;
        self
    }

    /// Engine requests in all (prompts × `n`).
    pub(crate) fn len(&self) -> usize {
        self.prompts.len().saturating_mul(self.n)
    }

    /// Choice `i` of `prompt`, with `params` (this fan-out's, validated once): choice `i` of a
    /// seeded request gets seed + i, so the choices differ and the whole response is
    /// reproducible. The seed is the one field no check reads, so the copy is not checked again.
    pub(crate) fn request(&self, prompt: Prompt, params: &ValidParams, i: usize) -> GenerateRequest {
        let seed = params.params().seed.map(|s| s.wrapping_add(i as u64));
        GenerateRequest::new(self.model, prompt).params(params.clone().with_seed(seed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_field_is_named() {
        let err = CompletionRequest::parse(br#"{"model": "m", "prompt": "x", "temperature": "hot"}"#).unwrap_err();
        assert!(matches!(&err, Error::BadRequest { param: Some(p), .. } if p == "temperature"), "{err:?}");
        let err = CompletionRequest::parse(br#"{"prompt": "x"}"#).unwrap_err();
        assert!(err.to_string().contains("model"), "{err}");
        let err = CompletionRequest::parse(b"{not json").unwrap_err();
        assert!(err.to_string().contains("invalid JSON"), "{err}");
    }

    #[test]
    fn prompts_of_every_shape() {
        for (body, count) in [(r#""a""#, 1), (r#"["a", "b"]"#, 2), (r#"[1, 2, 3]"#, 1), (r#"[[1, 2], [3]]"#, 2)] {
            let req = CompletionRequest::parse(format!(r#"{{"model": "m", "prompt": {body}}}"#).as_bytes()).unwrap();
            assert_eq!(req.prompts().unwrap().len(), count, "{body}");
        }
        let req = CompletionRequest::parse(br#"{"model": "m", "prompt": [], "echo": false}"#).unwrap();
        assert!(req.prompts().is_err());
        let req = CompletionRequest::parse(br#"{"model": "m", "prompt": "a", "suffix": "b"}"#).unwrap();
        assert!(matches!(req.prompts(), Err(Error::BadRequest { param: Some(p), .. }) if p == "suffix"));
    }

    #[test]
    fn sampling_fields_map_onto_the_engine() {
        let req = CompletionRequest::parse(
            br#"{"model": "m", "prompt": "a", "max_tokens": 5, "temperature": 0, "stop": "x",
                "logit_bias": {"7": 3.5}, "seed": 9, "n": 2}"#,
        )
        .unwrap();
        let p = req.sampling.params(SamplingParams::default(), None, Some(2)).unwrap();
        assert_eq!((p.max_tokens, p.temperature, p.stop.clone()), (Some(5), 0.0, vec!["x".to_string()]));
        assert_eq!(p.logit_bias.get(&7), Some(&3.5));
        let fan = fan_out("m", req.prompts().unwrap(), &p, req.sampling.n().unwrap());
        assert_eq!(fan.len(), 2);
        let valid = p.clone().validate(usize::MAX).unwrap();
        let seeds: Vec<_> =
            (0..fan.n).map(|i| fan.request(fan.prompts[0].clone(), &valid, i).params.params().seed).collect();
        assert_eq!(seeds, vec![Some(9), Some(10)]);
        let bad = CompletionRequest::parse(br#"{"model": "m", "prompt": "a", "logit_bias": {"x": 1}}"#).unwrap();
        assert!(bad.sampling.params(SamplingParams::default(), None, None).is_err());
    }

    #[test]
    fn fields_that_would_change_the_output_are_refused_by_name() {
        for field in [r#""functions": [{"name": "f"}]"#, r#""use_beam_search": true"#, r#""logits_processors": ["x"]"#]
        {
            let name = field.split('"').nth(1).unwrap();
            let body = format!(r#"{{"model": "m", "messages": [], {field}}}"#);
            let err = ChatRequest::parse(body.as_bytes()).unwrap_err();
            assert!(matches!(&err, Error::BadRequest { param: Some(p), .. } if p == name), "{field}: {err:?}");
        }
        for off in [
            r#""tools": []"#,
            r#""tool_choice": "none""#,
            r#""response_format": {"type": "text"}"#,
            r#""use_beam_search": false"#,
            r#""guided_json": null"#,
        ] {
            let body = format!(r#"{{"model": "m", "messages": [], {off}}}"#);
            assert!(ChatRequest::parse(body.as_bytes()).is_ok(), "{off} is the off value");
        }
    }

    #[test]
    fn chat_content_parts() {
        let req = ChatRequest::parse(
            br#"{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}"#,
        )
        .unwrap();
        assert_eq!(req.messages[0].text(0).unwrap(), "hi");
        assert!(req.messages[1].text(1).is_err());
    }
}
