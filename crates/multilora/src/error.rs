//! `EngineError`: why one request, or one engine call, failed; `kind()` is a stable label.

use std::sync::Arc;

/// The crate's result type.
pub type Result<T> = std::result::Result<T, EngineError>;

/// Errors of the engine. Each fails only the request or call that got it; the engine goes on.
///
/// Exhaustive on purpose: a new variant is a compile error in every `match` over it, the
/// server's mapping to HTTP statuses among them, instead of a silent 500.
#[derive(Clone, Debug, thiserror::Error)]
pub enum EngineError {
    /// The request names neither the served base model nor a known adapter.
    #[error("model {name:?} not found")]
    ModelNotFound {
        /// The name asked for.
        name: String,
    },
    /// Invalid sampling parameters or prompt.
    #[error("invalid request: {reason}")]
    InvalidRequest {
        /// What is wrong.
        reason: String,
    },
    /// The prompt leaves no room for a new token within `max_model_len`.
    #[error("prompt of {prompt_len} tokens leaves no room for a new token within max_model_len {max_model_len}")]
    PromptTooLong {
        /// Tokens in the prompt.
        prompt_len: usize,
        /// The engine's context length.
        max_model_len: usize,
    },
    /// The adapter could not be loaded, validated or activated.
    #[error("{}", adapter_message(name, message))]
    Adapter {
        /// The adapter.
        name: String,
        /// The store's message.
        message: String,
        /// The store's error kind (e.g. `truncated`, `shape_mismatch`).
        cause_kind: &'static str,
    },
    /// Runtime adapter updates are off (`allow_runtime_lora_updating`).
    #[error("runtime lora updating is disabled (set allow_runtime_lora_updating)")]
    RuntimeUpdatesDisabled,
    /// The engine configuration cannot work.
    #[error("invalid engine config: {0}")]
    Config(String),
    /// Loading the model or tokenizer failed.
    #[error("model: {0}")]
    Model(String),
    /// The engine has shut down.
    #[error("the engine has shut down")]
    Shutdown,
    /// A bug or an unexpected failure inside a step.
    #[error("internal error: {0}")]
    Internal(String),
}

impl EngineError {
    /// A stable snake_case label for metrics and API error bodies.
    pub fn kind(&self) -> &'static str {
        match self {
            EngineError::ModelNotFound { .. } => "model_not_found",
            EngineError::InvalidRequest { .. } => "invalid_request",
            EngineError::PromptTooLong { .. } => "prompt_too_long",
            EngineError::Adapter { .. } => "adapter_error",
            EngineError::RuntimeUpdatesDisabled => "runtime_updates_disabled",
            EngineError::Config(_) => "invalid_config",
            EngineError::Model(_) => "model_error",
            EngineError::Shutdown => "shutdown",
            EngineError::Internal(_) => "internal",
        }
    }

    pub(crate) fn invalid(reason: impl Into<String>) -> EngineError {
        EngineError::InvalidRequest { reason: reason.into() }
    }

    /// Maps a store error about adapter `name` onto the engine's kinds.
    pub(crate) fn from_store(name: &str, e: &multilora_store::Error) -> EngineError {
        use multilora_store::Error as S;
        match e {
            S::UnknownAdapter { .. } => EngineError::ModelNotFound { name: name.to_string() },
            S::RuntimeUpdatesDisabled { .. } => EngineError::RuntimeUpdatesDisabled,
            S::InvalidName { .. }
            | S::AlreadyRegistered { .. }
            | S::PathOutsideRoots { .. }
            | S::HubDisabled { .. } => EngineError::InvalidRequest { reason: e.to_string() },
            S::Shutdown { .. } => EngineError::Shutdown,
            _ => EngineError::Adapter { name: name.to_string(), message: e.to_string(), cause_kind: e.kind() },
        }
    }

    pub(crate) fn from_store_arc(name: &str, e: &Arc<multilora_store::Error>) -> EngineError {
        EngineError::from_store(name, e)
    }
}

impl From<multilora_models::Error> for EngineError {
    fn from(e: multilora_models::Error) -> EngineError {
        EngineError::Model(e.to_string())
    }
}

impl From<candle_core::Error> for EngineError {
    fn from(e: candle_core::Error) -> EngineError {
        EngineError::Internal(e.to_string())
    }
}

/// The store's message, prefixed with the adapter's name unless it already leads with it.
fn adapter_message(name: &str, message: &str) -> String {
    let prefix = format!("adapter {name:?}");
    if message.starts_with(&prefix) { message.to_string() } else { format!("{prefix}: {message}") }
}
