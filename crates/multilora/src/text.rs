//! The model's text side, resolved once at start: its tokenizer and its chat template.
//!
//! - `tokenizer(DIR)` (vLLM's `--tokenizer`) wins; else a Hugging Face checkpoint's own folder;
//!   else a GGUF file's metadata ([`gguf`]: the tokenizer transformers builds from it, and
//!   `tokenizer.chat_template`).
//! - A folder's chat template is `chat_template.jinja` (what transformers writes since 4.43),
//!   else `chat_template.json`, else `tokenizer_config.json`'s `chat_template` (a string, or the
//!   one named `default` of a list); `bos_token` / `eos_token` come from `tokenizer_config.json`.
//!
//! The server renders the template; the engine only says what it is ([`ChatTemplateSource`]), so
//! an embedder's own HTTP layer sees the same one.

mod gguf;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use multilora_models::{Checkpoint, GgufFile};
use serde_json::Value;
use tokenizers::Tokenizer;

use crate::error::BuildError;

/// What reading the text side returns: an error is the engine's start-up error.
type Result<T> = std::result::Result<T, BuildError>;

/// The model's chat template and the special tokens it may name.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChatTemplateSource {
    /// The Jinja source.
    pub source: String,
    /// What the template sees as `bos_token`.
    pub bos_token: String,
    /// What the template sees as `eos_token`.
    pub eos_token: String,
    /// Where it came from, for messages: a file, or `tokenizer.chat_template of FILE.gguf`.
    pub origin: String,
}

impl ChatTemplateSource {
    /// A template with its special tokens.
    pub fn new(source: impl Into<String>, bos_token: impl Into<String>, eos_token: impl Into<String>) -> Self {
        ChatTemplateSource {
            source: source.into(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            origin: "the caller".into(),
        }
    }
}

/// The tokenizer (none: only token-id prompts are accepted) and the chat template (none: chat
/// requests are refused).
#[derive(Debug, Default)]
pub(crate) struct ModelText {
    pub(crate) tokenizer: Option<Tokenizer>,
    pub(crate) chat_template: Option<ChatTemplateSource>,
    /// Where the tokenizer came from (for the start-up log).
    pub(crate) from: String,
}

/// The text side of `checkpoint`, or of `tokenizer_dir` when given.
pub(crate) fn load(checkpoint: &Checkpoint, tokenizer_dir: Option<&Path>) -> Result<ModelText> {
    match (tokenizer_dir, checkpoint.gguf()) {
        (Some(dir), _) => from_dir(dir),
        (None, Some(g)) => from_gguf(g),
        (None, None) => from_dir(&checkpoint.dir()),
    }
}

fn from_gguf(g: &GgufFile) -> Result<ModelText> {
    let refused = |reason: String| BuildError::Tokenizer {
        path: g.path().to_path_buf(),
        source: Arc::from(Box::<dyn std::error::Error + Send + Sync>::from(format!(
            "its tokenizer metadata: {reason}"
        ))),
    };
    let tokenizer = gguf::tokenizer(g).map_err(refused)?;
    let token = |key: &str| {
        g.integer(&format!("tokenizer.ggml.{key}")).and_then(|id| tokenizer.id_to_token(id as u32)).unwrap_or_default()
    };
    let chat_template = g.chat_template().map(|source| ChatTemplateSource {
        source: source.to_string(),
        bos_token: token("bos_token_id"),
        eos_token: token("eos_token_id"),
        origin: format!("tokenizer.chat_template of {}", g.path().display()),
    });
    Ok(ModelText { tokenizer: Some(tokenizer), chat_template, from: format!("the metadata of {}", g.path().display()) })
}

fn from_dir(dir: &Path) -> Result<ModelText> {
    let path = dir.join("tokenizer.json");
    let tokenizer = if path.is_file() {
        Some(
            Tokenizer::from_file(&path)
                .map_err(|e| BuildError::Tokenizer { path: path.clone(), source: Arc::from(e) })?,
        )
    } else {
        tracing::warn!(path = %path.display(), "no tokenizer.json: only token-id prompts are accepted");
        None
    };
    Ok(ModelText { tokenizer, chat_template: template_in(dir)?, from: path.display().to_string() })
}

/// The chat template a Hugging Face folder carries, if any.
fn template_in(dir: &Path) -> Result<Option<ChatTemplateSource>> {
    let cfg = read_json(&dir.join("tokenizer_config.json"))?;
    let special = |key: &str| match cfg.get(key) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).unwrap_or_default().to_string(),
        _ => String::new(),
    };
    let found = |source: String, origin: PathBuf| {
        Some(ChatTemplateSource {
            source,
            bos_token: special("bos_token"),
            eos_token: special("eos_token"),
            origin: origin.display().to_string(),
        })
    };
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        let text = std::fs::read_to_string(&jinja).map_err(|e| file_error(&jinja, e))?;
        return Ok(found(text, jinja));
    }
    let json = dir.join("chat_template.json");
    if let Some(source) = template_value(&read_json(&json)?) {
        return Ok(found(source, json));
    }
    Ok(template_value(&cfg).and_then(|source| found(source, dir.join("tokenizer_config.json"))))
}

/// `chat_template` of a JSON config: a string, or the entry named `default` of a list of them.
fn template_value(cfg: &Value) -> Option<String> {
    match cfg.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    }
}

/// A JSON file's value; `Null` when the file does not exist.
fn read_json(path: &Path) -> Result<Value> {
    if !path.is_file() {
        return Ok(Value::Null);
    }
    let text = std::fs::read_to_string(path).map_err(|e| file_error(path, e))?;
    serde_json::from_str(&text).map_err(|e| file_error(path, e))
}

fn file_error(path: &Path, e: impl std::error::Error + Send + Sync + 'static) -> BuildError {
    BuildError::Tokenizer { path: path.to_path_buf(), source: Arc::new(e) }
}
