//! `EngineError`: why one request, or one engine call, failed; `kind()` is a stable label. Every
//! variant that wraps another crate's failure keeps it as its `source()` (behind an `Arc`, since
//! one error may go to several requests' streams).

use std::path::PathBuf;
use std::sync::Arc;

use multilora_types::{LimitsError, ModuleKind};

/// The crate's result type.
pub type Result<T> = std::result::Result<T, EngineError>;

/// Any error, shared: the source of a failed step or start-up call.
pub type SharedError = Arc<dyn std::error::Error + Send + Sync>;

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
    #[error("{}", adapter_message(name, source))]
    Adapter {
        /// The adapter.
        name: String,
        /// The store's error (its `kind()` says why: `truncated`, `shape_mismatch`, …).
        #[source]
        source: Arc<multilora_store::Error>,
    },
    /// A runtime adapter targets modules that have no slot buffers.
    #[error(
        "adapter {name:?}: targets {:?}, which have no lora slots (add them to lora_target_modules)",
        modules.iter().map(|k| k.short_name()).collect::<Vec<_>>()
    )]
    AdapterTargets {
        /// The adapter.
        name: String,
        /// The modules it targets that have no slots.
        modules: Vec<ModuleKind>,
    },
    /// Runtime adapter updates are off (`allow_runtime_lora_updating`).
    #[error("runtime lora updating is disabled (set allow_runtime_lora_updating)")]
    RuntimeUpdatesDisabled,
    /// Startup adapters were given with `max_loras` 0.
    #[error("invalid engine config: {adapters} lora adapters given but max_loras is 0 (lora is off)")]
    LoraOff {
        /// How many were given.
        adapters: usize,
    },
    /// `gpu_memory_utilization` is outside (0, 1].
    #[error("invalid engine config: gpu_memory_utilization must be in (0, 1], got {value}")]
    GpuMemoryUtilization {
        /// The value given.
        value: f64,
    },
    /// `max_model_len` is 0 or beyond what the model's config allows.
    #[error(
        "invalid engine config: max_model_len {requested} must be between 1 and the model's limit {limit} \
         (max_position_embeddings, or its sliding window, in config.json)"
    )]
    MaxModelLen {
        /// The length asked for.
        requested: usize,
        /// The model's limit.
        limit: usize,
    },
    /// The LoRA limits cannot work.
    #[error("invalid engine config: {0}")]
    Limits(#[from] LimitsError),
    /// The adapter store refused its configuration.
    #[error("invalid engine config: {source}")]
    Store {
        /// Why.
        #[source]
        source: Arc<multilora_store::Error>,
    },
    /// The scheduler refused its configuration (a KV cache too small for one sequence, …).
    #[error("invalid engine config: {source} (kv cache of {kv_bytes} bytes: {budget_from})")]
    Scheduler {
        /// The KV budget the scheduler was given.
        kv_bytes: u64,
        /// Where that budget came from.
        budget_from: String,
        /// Why.
        #[source]
        source: Arc<multilora_scheduler::Error>,
    },
    /// Loading the model failed.
    #[error("model: {0}")]
    Model(#[source] Arc<multilora_models::Error>),
    /// The model's `tokenizer.json` could not be read.
    #[error("model: {}: {source}", path.display())]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: SharedError,
    },
    /// The engine has shut down.
    #[error("the engine has shut down")]
    Shutdown,
    /// A step failed (the forward pass or the scheduler's update): its requests fail, the
    /// engine goes on.
    #[error("internal error: {stage}: {source}")]
    Step {
        /// Which part of the step.
        stage: &'static str,
        /// Why.
        #[source]
        source: SharedError,
    },
    /// The engine's threads could not be started.
    #[error("internal error: {what}: {source}")]
    Spawn {
        /// Which threads.
        what: &'static str,
        /// Why.
        #[source]
        source: SharedError,
    },
    /// The engine loop panicked: the requests it was running failed with this, and every new
    /// one is refused with it. The process should be restarted (`multilora serve` exits).
    #[error("the engine failed and no longer serves requests: {reason}")]
    EngineFailed {
        /// The panic's message.
        reason: String,
    },
    /// An adapter left host memory while one of its requests ran (the store's pins rule it out).
    #[error("internal error: adapter {name:?} left host memory mid-request")]
    AdapterEvicted {
        /// The adapter.
        name: String,
    },
}

impl EngineError {
    /// A stable snake_case label for metrics and API error bodies.
    pub fn kind(&self) -> &'static str {
        match self {
            EngineError::ModelNotFound { .. } => "model_not_found",
            EngineError::InvalidRequest { .. } => "invalid_request",
            EngineError::PromptTooLong { .. } => "prompt_too_long",
            EngineError::Adapter { .. } | EngineError::AdapterTargets { .. } => "adapter_error",
            EngineError::RuntimeUpdatesDisabled => "runtime_updates_disabled",
            EngineError::LoraOff { .. }
            | EngineError::MaxModelLen { .. }
            | EngineError::GpuMemoryUtilization { .. }
            | EngineError::Limits(_)
            | EngineError::Store { .. }
            | EngineError::Scheduler { .. } => "invalid_config",
            EngineError::Model(_) | EngineError::Tokenizer { .. } => "model_error",
            EngineError::Shutdown => "shutdown",
            EngineError::EngineFailed { .. } => "engine_failed",
            EngineError::Step { .. } | EngineError::Spawn { .. } | EngineError::AdapterEvicted { .. } => "internal",
        }
    }

    /// For adapter errors, the underlying reason's label (`truncated`, `shape_mismatch`,
    /// `not_a_target`, …).
    pub fn cause_kind(&self) -> Option<&'static str> {
        match self {
            EngineError::Adapter { source, .. } => Some(source.kind()),
            EngineError::AdapterTargets { .. } => Some("not_a_target"),
            _ => None,
        }
    }

    pub(crate) fn invalid(reason: impl Into<String>) -> EngineError {
        EngineError::InvalidRequest { reason: reason.into() }
    }

    /// A step's failure at `stage`, for each of its requests.
    pub(crate) fn step(stage: &'static str, source: &SharedError) -> EngineError {
        EngineError::Step { stage, source: Arc::clone(source) }
    }

    /// An adapter format error about `name` (a startup adapter's config or source).
    pub(crate) fn adapter_format(name: &str, e: multilora_adapter::Error) -> EngineError {
        EngineError::Adapter { name: name.to_string(), source: Arc::new(multilora_store::Error::Adapter(e)) }
    }

    /// Maps a store error about adapter `name` onto the engine's kinds.
    pub(crate) fn from_store(name: &str, e: multilora_store::Error) -> EngineError {
        EngineError::from_store_arc(name, &Arc::new(e))
    }

    /// [`EngineError::from_store`] for an error shared by several requests (a failed load).
    pub(crate) fn from_store_arc(name: &str, e: &Arc<multilora_store::Error>) -> EngineError {
        use multilora_store::Error as S;
        match &**e {
            S::UnknownAdapter { .. } => EngineError::ModelNotFound { name: name.to_string() },
            S::RuntimeUpdatesDisabled { .. } => EngineError::RuntimeUpdatesDisabled,
            S::InvalidName { .. }
            | S::AlreadyRegistered { .. }
            | S::PathOutsideRoots { .. }
            | S::HubDisabled { .. } => EngineError::InvalidRequest { reason: e.to_string() },
            S::Shutdown { .. } => EngineError::Shutdown,
            S::UntargetedModules { modules, .. } => {
                EngineError::AdapterTargets { name: name.to_string(), modules: modules.clone() }
            }
            _ => EngineError::Adapter { name: name.to_string(), source: Arc::clone(e) },
        }
    }
}

impl From<multilora_models::Error> for EngineError {
    fn from(e: multilora_models::Error) -> EngineError {
        EngineError::Model(Arc::new(e))
    }
}

/// The store's message, prefixed with the adapter's name unless it already leads with it.
fn adapter_message(name: &str, source: &multilora_store::Error) -> String {
    let message = source.to_string();
    let prefix = format!("adapter {name:?}");
    if message.starts_with(&prefix) { message } else { format!("{prefix}: {message}") }
}
