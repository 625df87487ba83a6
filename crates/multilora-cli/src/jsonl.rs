//! The `generate` file formats: one request object per input line, one result object per output
//! line (field names and meanings as vLLM's offline `LLM.generate`).

use multilora::{Completion, EngineError, PromptLogprob, SamplingParams};
use serde::Deserialize;
use serde_json::{Map, Value, json};

/// One input line, as written. Unknown fields are refused so a misspelt field fails loudly
/// instead of silently taking a default.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RequestLine {
    /// Echoed back on the output line (read from the raw object, kept here so it is not unknown).
    #[serde(default, rename = "id")]
    _id: Value,
    /// Adapter name or served model name; None is the served model.
    pub(crate) model: Option<String>,
    /// Prompt token ids, used as given.
    pub(crate) input_ids: Option<Vec<u32>>,
    /// Prompt text, tokenized with the model's tokenizer.
    pub(crate) prompt: Option<String>,
    /// vLLM's default is 16.
    pub(crate) max_tokens: Option<usize>,
    /// vLLM's default is 1.0.
    pub(crate) temperature: Option<f32>,
    /// `true` or a count of alternatives.
    pub(crate) prompt_logprobs: Option<Value>,
    /// `true` or a count of alternatives.
    pub(crate) logprobs: Option<Value>,
    /// Keep going after EOS.
    pub(crate) ignore_eos: Option<bool>,
    /// Extra stop tokens.
    pub(crate) stop_token_ids: Option<Vec<u32>>,
    /// Stop strings.
    pub(crate) stop: Option<Vec<String>>,
    /// Per-request seed.
    pub(crate) seed: Option<u64>,
    /// Nucleus mass.
    pub(crate) top_p: Option<f32>,
    /// Top-k; 0 or -1 is off.
    pub(crate) top_k: Option<i32>,
    /// Min-p.
    pub(crate) min_p: Option<f32>,
    /// Minimum generated tokens before a stop.
    pub(crate) min_tokens: Option<usize>,
    /// Penalties, vLLM's meanings.
    pub(crate) presence_penalty: Option<f32>,
    /// Penalties, vLLM's meanings.
    pub(crate) frequency_penalty: Option<f32>,
    /// Penalties, vLLM's meanings.
    pub(crate) repetition_penalty: Option<f32>,
}

/// `true` → 0 alternatives, N → N, `false`/`null`/absent → off.
fn logprob_count(field: &str, v: &Option<Value>) -> Result<Option<usize>, String> {
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(None),
        Some(Value::Bool(true)) => Ok(Some(0)),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(n) => Ok(Some(n as usize)),
            None => Err(format!("{field} must be true or a count >= 0, got {n}")),
        },
        Some(other) => Err(format!("{field} must be true or a count, got {other}")),
    }
}

impl RequestLine {
    /// The sampling parameters: `base` (the engine's defaults: vLLM's, or the checkpoint's
    /// `generation_config.json`) with every field the line sets in its place; `max_tokens` is
    /// 16 when neither the line nor `base` sets it (vLLM's completions default).
    pub(crate) fn params(&self, base: SamplingParams) -> Result<SamplingParams, String> {
        let mut p = base;
        p.max_tokens = Some(self.max_tokens.or(p.max_tokens).unwrap_or(16));
        p.temperature = self.temperature.unwrap_or(p.temperature);
        p.prompt_logprobs = logprob_count("prompt_logprobs", &self.prompt_logprobs)?;
        p.logprobs = logprob_count("logprobs", &self.logprobs)?;
        p.ignore_eos = self.ignore_eos.unwrap_or(false);
        p.stop_token_ids = self.stop_token_ids.clone().unwrap_or_default();
        p.stop = self.stop.clone().unwrap_or_default();
        p.seed = self.seed;
        p.top_p = self.top_p.unwrap_or(p.top_p);
        p.top_k = self.top_k.unwrap_or(p.top_k);
        p.min_p = self.min_p.unwrap_or(p.min_p);
        p.min_tokens = self.min_tokens.unwrap_or(0);
        p.presence_penalty = self.presence_penalty.unwrap_or(0.0);
        p.frequency_penalty = self.frequency_penalty.unwrap_or(0.0);
        p.repetition_penalty = self.repetition_penalty.unwrap_or(p.repetition_penalty);
        Ok(p)
    }
}

/// The error kinds of the contract; the engine's other kinds are reported as `internal`.
pub(crate) fn contract_kind(e: &EngineError) -> &'static str {
    match e.kind() {
        k @ ("model_not_found" | "invalid_request" | "prompt_too_long" | "adapter_error") => k,
        _ => "internal",
    }
}

/// An error line.
pub(crate) fn error_line(id: &Value, kind: &str, message: &str) -> Value {
    json!({"id": id, "error": {"kind": kind, "message": message}})
}

fn tops(list: &[(u32, f32)]) -> Value {
    list.iter().map(|&(id, lp)| json!({"id": id, "logprob": lp})).collect()
}

/// A result line. `prompt_ids` is None when the engine tokenized the prompt itself.
pub(crate) fn result_line(
    id: &Value,
    model: &str,
    prompt_ids: Option<&[u32]>,
    params: &SamplingParams,
    c: &Completion,
) -> Value {
    let mut o = Map::new();
    o.insert("id".into(), id.clone());
    o.insert("model".into(), model.into());
    o.insert("prompt_ids".into(), json!(prompt_ids));
    o.insert("output_ids".into(), json!(c.token_ids));
    o.insert("text".into(), c.text.clone().into());
    o.insert("finish_reason".into(), c.finish_reason.as_str().into());
    if let (Some(n), Some(pl)) = (params.prompt_logprobs, &c.prompt_logprobs) {
        let lp: Vec<Option<f32>> = pl.iter().map(|p| p.as_ref().map(|p: &PromptLogprob| p.logprob)).collect();
        o.insert("prompt_logprobs".into(), json!(lp));
        if n > 0 {
            let t: Vec<Value> = pl.iter().map(|p| p.as_ref().map_or(Value::Null, |p| tops(&p.top_logprobs))).collect();
            o.insert("prompt_top_logprobs".into(), t.into());
        }
    }
    if let (Some(n), Some(l)) = (params.logprobs, &c.logprobs) {
        o.insert("logprobs".into(), l.iter().map(|t| json!(t.logprob)).collect());
        if n > 0 {
            o.insert("top_logprobs".into(), l.iter().map(|t| tops(&t.top_logprobs)).collect());
        }
    }
    Value::Object(o)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_vllms() {
        let r: RequestLine = serde_json::from_str(r#"{"id": "a", "input_ids": [1]}"#).unwrap();
        let p = r.params(SamplingParams::default()).unwrap();
        assert_eq!((p.max_tokens, p.temperature, p.logprobs, p.prompt_logprobs), (Some(16), 1.0, None, None));
    }

    #[test]
    fn the_checkpoints_defaults_fill_what_the_line_leaves_unset() {
        let mut base = SamplingParams::default();
        (base.temperature, base.top_p, base.max_tokens) = (0.6, 0.9, Some(64));
        let r: RequestLine = serde_json::from_str(r#"{"input_ids": [1], "top_p": 0.5}"#).unwrap();
        let p = r.params(base).unwrap();
        assert_eq!((p.temperature, p.top_p, p.max_tokens), (0.6, 0.5, Some(64)));
    }

    #[test]
    fn logprob_fields_take_true_or_a_count() {
        let r: RequestLine =
            serde_json::from_str(r#"{"input_ids": [1], "logprobs": 3, "prompt_logprobs": true}"#).unwrap();
        let p = r.params(SamplingParams::default()).unwrap();
        assert_eq!((p.logprobs, p.prompt_logprobs), (Some(3), Some(0)));
        let r: RequestLine = serde_json::from_str(r#"{"input_ids": [1], "logprobs": "x"}"#).unwrap();
        assert!(r.params(SamplingParams::default()).is_err());
        assert!(serde_json::from_str::<RequestLine>(r#"{"input_ids": [1], "max_token": 3}"#).is_err());
    }
}
