//! Structured outputs: a request's [`Constraint`] (a JSON schema, any JSON object, a regex, a
//! choice of strings or a Lark grammar), compiled by `llguidance` when the request is submitted
//! (`compile.rs`: one parser factory per engine, compiled grammars cached by content), over the
//! model's vocabulary as bytes (`vocab.rs`), then followed token by token (`guide.rs`): a row
//! tries its sampled token first or samples under its allowed-token mask (computed beside the
//! step's forward pass when it will be needed), that row alone, and the tokens the grammar forces
//! are appended together, to be fed as one chunk in the next step.

mod compile;
mod guide;
mod vocab;

pub use compile::CACHED_GRAMMARS;
pub(crate) use compile::Grammars;
pub(crate) use guide::{Accepted, Guide};

use std::panic::{AssertUnwindSafe, catch_unwind};

/// Runs `f`, turning a panic inside the grammar library into an error naming `what`: a
/// constraint that trips it fails its own request, never the engine.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| Err(format!("the grammar library panicked in {what}")))
}

/// The largest constraint a request may carry: the JSON schema serialized, the regex, the
/// grammar, or the choices together, in bytes.
pub const MAX_CONSTRAINT_BYTES: usize = 256 << 10;

/// Most strings a [`Constraint::Choice`] may offer.
pub const MAX_CHOICES: usize = 1024;

/// What a request's output must match (vLLM's `structured_outputs`): the whole generated text,
/// compiled at `submit` (a bad constraint is [`crate::EngineError::Constraint`] there, never a
/// failure mid-stream). The end-of-sequence token is allowed exactly when the text so far is complete;
/// a grammar that cannot go on ends the request with `stop`.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Constraint {
    /// A JSON schema (what `llguidance` supports of draft 2020-12: nested objects, arrays with
    /// item bounds, enums, `const`, string patterns and lengths, numeric bounds, `anyOf` /
    /// `oneOf`, `$ref` / `$defs` within the schema). Between items the output may put at most 16
    /// blanks in a row (a schema's own `x-guidance` options win).
    JsonSchema(serde_json::Value),
    /// Any JSON object (OpenAI's `json_object`).
    JsonObject,
    /// A regular expression the whole output matches (Rust `regex` syntax, no look-around).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in Lark syntax (llguidance's dialect: `start: …`, `%json`, `%regex`).
    Grammar(String),
}

impl Constraint {
    /// The field's name in vLLM's `structured_outputs` (`json`, `json_object`, `regex`,
    /// `choice`, `grammar`).
    pub fn kind(&self) -> &'static str {
        match self {
            Constraint::JsonSchema(_) => "json",
            Constraint::JsonObject => "json_object",
            Constraint::Regex(_) => "regex",
            Constraint::Choice(_) => "choice",
            Constraint::Grammar(_) => "grammar",
        }
    }

    /// Checks the bounds that need no tokenizer: [`MAX_CONSTRAINT_BYTES`], [`MAX_CHOICES`], no
    /// empty regex, choice or grammar. Returns the constraint's size in bytes.
    pub(crate) fn check(&self) -> Result<usize, String> {
        let bytes = match self {
            Constraint::JsonSchema(v) => {
                if !v.is_object() && !v.is_boolean() {
                    return Err("a JSON schema must be an object (or a boolean)".into());
                }
                serde_json::to_string(v).map_or(usize::MAX, |s| s.len())
            }
            Constraint::JsonObject => 0,
            Constraint::Regex(s) | Constraint::Grammar(s) => {
                if s.trim().is_empty() {
                    return Err(format!("the {} must not be empty", self.kind()));
                }
                s.len()
            }
            Constraint::Choice(v) => {
                if v.is_empty() {
                    return Err("choice must offer at least one string".into());
                }
                if v.len() > MAX_CHOICES {
                    return Err(format!("choice offers {} strings, more than the {MAX_CHOICES} allowed", v.len()));
                }
                v.iter().map(String::len).sum()
            }
        };
        if bytes > MAX_CONSTRAINT_BYTES {
            return Err(format!(
                "the {} constraint is {bytes} bytes, more than the {MAX_CONSTRAINT_BYTES} allowed",
                self.kind()
            ));
        }
        Ok(bytes)
    }
}
