//! The crate's error type and `Result` alias.

use multilora_prefix_cache::RequestId;

/// Errors of the scheduler.
///
/// A rejected `add_request` leaves the scheduler exactly as it was; so does a rejected `update`.
#[non_exhaustive]
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum Error {
    /// A configuration that cannot work; the message names the field.
    #[error("invalid scheduler config: {0}")]
    InvalidConfig(String),
    /// A request asked for zero new tokens.
    #[error("request {id}: max_new_tokens must be at least 1")]
    ZeroMaxTokens {
        /// The request.
        id: RequestId,
    },
    /// A request with no prompt tokens.
    #[error("request {id}: the prompt is empty")]
    EmptyPrompt {
        /// The request.
        id: RequestId,
    },
    /// The prompt leaves no room for one new token within `max_model_len`.
    #[error(
        "request {id}: prompt of {prompt_len} tokens leaves no room for a new token within max_model_len {max_model_len}"
    )]
    PromptTooLong {
        /// The request.
        id: RequestId,
        /// Tokens in its prompt.
        prompt_len: usize,
        /// The model's context length.
        max_model_len: usize,
    },
    /// A request names an adapter but LoRA is off (`max_loras` is 0).
    #[error("request {id}: names an adapter but lora is disabled (max_loras is 0)")]
    LoraDisabled {
        /// The request.
        id: RequestId,
    },
    /// The id is already used by a live request.
    #[error("request {0} already exists")]
    DuplicateRequest(RequestId),
    /// `update` got a sampled token for a request that was not scheduled to sample one.
    #[error("request {id}: got a sampled token but it was not scheduled to sample in the last step")]
    UnexpectedToken {
        /// The request.
        id: RequestId,
    },
    /// The KV manager refused an operation the scheduler's bookkeeping expected to succeed.
    #[error("kv manager: {0}")]
    Kv(#[from] multilora_prefix_cache::Error),
}

impl Error {
    /// A stable snake_case label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::InvalidConfig(_) => "invalid_config",
            Error::ZeroMaxTokens { .. } => "zero_max_tokens",
            Error::EmptyPrompt { .. } => "empty_prompt",
            Error::PromptTooLong { .. } => "prompt_too_long",
            Error::LoraDisabled { .. } => "lora_disabled",
            Error::DuplicateRequest(_) => "duplicate_request",
            Error::UnexpectedToken { .. } => "unexpected_token",
            Error::Kv(_) => "kv",
        }
    }
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_and_kinds() {
        let e = Error::PromptTooLong { id: 3, prompt_len: 10, max_model_len: 10 };
        assert_eq!(
            e.to_string(),
            "request 3: prompt of 10 tokens leaves no room for a new token within max_model_len 10"
        );
        assert_eq!(e.kind(), "prompt_too_long");
        assert_eq!(Error::DuplicateRequest(4).to_string(), "request 4 already exists");
        assert_eq!(Error::LoraDisabled { id: 1 }.kind(), "lora_disabled");
    }
}
