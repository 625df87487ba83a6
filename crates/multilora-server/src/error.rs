//! `Error`: every way a request to the server fails, with its HTTP status, rendered in OpenAI's
//! error shape `{"error": {"message", "type", "param", "code"}}`.

use std::path::PathBuf;

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use multilora::EngineError;
use serde_json::json;

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;

/// Errors of the server. Each fails only the request that got it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The body is not what the endpoint takes; `param` names the field.
    #[error("{message}")]
    BadRequest {
        /// The offending field, when one is to blame.
        param: Option<String>,
        /// What is wrong.
        message: String,
    },
    /// Something the request names by id is not there (a stored response); `param` names the
    /// field.
    #[error("{message}")]
    NotFound {
        /// The field that named it.
        param: &'static str,
        /// What is missing.
        message: String,
    },
    /// No or a wrong API key.
    #[error("invalid or missing API key (send `Authorization: Bearer <key>`)")]
    Unauthorized,
    /// Too many requests in flight.
    #[error("server overloaded: {in_flight} requests in flight, limit {limit}; retry later")]
    Overloaded {
        /// Requests in flight now.
        in_flight: usize,
        /// The bound.
        limit: usize,
    },
    /// Too many HTTP requests at once on the server's routes (its concurrency limit).
    #[error("server busy: {limit} requests are being handled; retry later")]
    Busy {
        /// The concurrency limit.
        limit: usize,
    },
    /// The server is draining (shutting down): it finishes what it admitted and takes nothing
    /// new, so a router sends the request elsewhere.
    #[error("the server is draining (shutting down) and takes no new requests; send it to another replica")]
    Draining,
    /// A handler panicked (a bug); the server goes on.
    #[error("internal error: the request's handler panicked: {message}")]
    Panicked {
        /// The panic's message.
        message: String,
    },
    /// The model has no chat template and none was given with `--chat-template`.
    #[error(
        "model {model:?} has no chat template (no chat_template.jinja, no chat_template in \
         tokenizer_config.json or in the GGUF metadata); start the server with --chat-template FILE, \
         or use /v1/completions"
    )]
    NoChatTemplate {
        /// The served model.
        model: String,
    },
    /// The chat template failed to compile or render.
    #[error("chat template: {0:#}")]
    Template(#[source] minijinja::Error),
    /// The engine refused or failed the request.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A file the server reads at start-up (a chat template, `tokenizer_config.json`) could not be
    /// read or parsed.
    #[error("{what} {}: {source}", path.display())]
    File {
        /// What the file is for.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The model's own chat template does not compile.
    #[error("the chat template of {origin}: {source}")]
    ModelTemplate {
        /// Where the template came from (a file, or a GGUF file's metadata).
        origin: String,
        /// Why.
        #[source]
        source: Box<Error>,
    },
    /// Encoding the metrics page failed.
    #[error("encoding metrics: {0}")]
    Metrics(#[source] std::fmt::Error),
    /// A blocking engine call's task panicked or was cancelled.
    #[error("blocking task failed: {0}")]
    Blocking(#[source] tokio::task::JoinError),
}

impl Error {
    pub(crate) fn bad(param: impl Into<String>, message: impl Into<String>) -> Error {
        Error::BadRequest { param: Some(param.into()), message: message.into() }
    }

    /// The HTTP status this error is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            Error::BadRequest { .. } | Error::NoChatTemplate { .. } | Error::Template(_) => StatusCode::BAD_REQUEST,
            Error::NotFound { .. } => StatusCode::NOT_FOUND,
            Error::Unauthorized => StatusCode::UNAUTHORIZED,
            Error::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            Error::Busy { .. } | Error::Draining => StatusCode::SERVICE_UNAVAILABLE,
            Error::Panicked { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            // Exhaustive (no `_`): a new engine error is a compile error here, not a silent 500.
            Error::Engine(e) => match e {
                EngineError::ModelNotFound { .. } => StatusCode::NOT_FOUND,
                EngineError::InvalidRequest { .. }
                | EngineError::PromptTooLong { .. }
                | EngineError::Adapter { .. }
                | EngineError::AdapterTargets { .. }
                | EngineError::Constraint { .. } => StatusCode::BAD_REQUEST,
                EngineError::RuntimeUpdatesDisabled => StatusCode::FORBIDDEN,
                EngineError::Shutdown | EngineError::EngineFailed { .. } => StatusCode::SERVICE_UNAVAILABLE,
                EngineError::Step { .. } | EngineError::AdapterEvicted { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            },
            Error::File { .. } | Error::ModelTemplate { .. } | Error::Metrics(_) | Error::Blocking(_) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }

    /// OpenAI's `code`: a stable snake_case label.
    pub fn code(&self) -> &'static str {
        match self {
            Error::BadRequest { .. } => "invalid_request",
            Error::NotFound { .. } => "not_found",
            Error::Unauthorized => "invalid_api_key",
            Error::Overloaded { .. } => "rate_limit_exceeded",
            Error::Busy { .. } => "server_busy",
            Error::Draining => "server_draining",
            Error::Panicked { .. } => "internal",
            Error::NoChatTemplate { .. } => "no_chat_template",
            Error::Template(_) => "chat_template_error",
            Error::Engine(e) => e.kind(),
            Error::File { .. } | Error::ModelTemplate { .. } | Error::Metrics(_) | Error::Blocking(_) => "internal",
        }
    }

    /// OpenAI's `type`.
    fn error_type(&self) -> &'static str {
        match self.status() {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    fn param(&self) -> Option<&str> {
        match self {
            Error::BadRequest { param, .. } => param.as_deref(),
            Error::NotFound { param, .. } => Some(param),
            Error::Engine(EngineError::ModelNotFound { .. }) => Some("model"),
            Error::Engine(EngineError::PromptTooLong { .. }) => Some("prompt"),
            _ => None,
        }
    }

    /// The JSON body: `{"error": {...}}`, also sent as an SSE event when a stream fails.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.to_string(),
            "type": self.error_type(),
            "param": self.param(),
            "code": self.code(),
        }})
    }
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::error!(error = %self, "request failed");
        } else {
            tracing::debug!(error = %self, status = status.as_u16(), "request refused");
        }
        (status, Json(self.body())).into_response()
    }
}
