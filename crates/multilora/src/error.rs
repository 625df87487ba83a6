//! The engine's two errors, each with a stable `kind()`: [`BuildError`], why an engine could not
//! be built (start-up), and [`EngineError`], why one request or one call on a running engine
//! failed. Every variant that wraps another crate's failure keeps it as its `source()`, as an
//! opaque [`SharedError`] (an `Arc`, since one request error may reach several streams), so no
//! type of a crate below the engine is part of its API.

use std::path::PathBuf;
use std::sync::Arc;

use multilora_types::{LimitsError, ModuleKind};

use crate::knobs::Device;

/// The crate's result type (request-time errors; [`crate::EngineBuilder::build`] returns a
/// [`BuildError`]).
pub type Result<T> = std::result::Result<T, EngineError>;

/// Any error, shared: the source of a failed step, load or start-up call.
pub type SharedError = Arc<dyn std::error::Error + Send + Sync>;

/// Errors of a running engine. Each fails only the request or call that got it; the engine goes
/// on.
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
    /// A request's constraint (structured outputs) is too large, or does not compile.
    #[error("invalid {kind} constraint: {reason}")]
    Constraint {
        /// Its kind, as vLLM's `structured_outputs` names it (`json`, `regex`, `choice`, …).
        kind: &'static str,
        /// Why.
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
    /// The adapter could not be resolved, loaded, validated or activated.
    #[error("{}", adapter_message(name, source.as_ref()))]
    Adapter {
        /// The adapter.
        name: String,
        /// Why ([`EngineError::cause_kind`] labels it: `truncated`, `shape_mismatch`, …).
        #[source]
        source: SharedError,
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
            EngineError::Constraint { .. } => "invalid_constraint",
            EngineError::PromptTooLong { .. } => "prompt_too_long",
            EngineError::Adapter { .. } | EngineError::AdapterTargets { .. } => "adapter_error",
            EngineError::RuntimeUpdatesDisabled => "runtime_updates_disabled",
            EngineError::Shutdown => "shutdown",
            EngineError::EngineFailed { .. } => "engine_failed",
            EngineError::Step { .. } | EngineError::AdapterEvicted { .. } => "internal",
        }
    }

    /// For adapter errors, the underlying reason's label (`truncated`, `shape_mismatch`,
    /// `not_a_target`, `resolver`, …).
    pub fn cause_kind(&self) -> Option<&'static str> {
        match self {
            EngineError::Adapter { source, .. } => Some(store_kind(source.as_ref())),
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
            _ => EngineError::Adapter { name: name.to_string(), source: Arc::clone(e) as SharedError },
        }
    }
}

/// Why an engine could not be built ([`crate::EngineBuilder::build`]): a knob that cannot work,
/// a model, tokenizer or start-up adapter that cannot be served, or threads that could not be
/// started. Nothing was left running.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// Start-up adapters were given with `max_loras` 0.
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
    /// `step_memory_bytes` holds no step: one token's activations already take more.
    #[error(
        "invalid engine config: step_memory_bytes {budget} holds no step: one token's activations take {one_token}"
    )]
    StepMemory {
        /// The budget given.
        budget: u64,
        /// What a one-token step takes.
        one_token: u64,
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
    /// The LoRA limits cannot work (`max_lora_rank` 0 or above the ceiling, no target modules).
    #[error("invalid engine config: {0}")]
    Limits(#[from] LimitsError),
    /// The device could not be opened (no such GPU, or a build without the `cuda` feature).
    #[error("invalid engine config: device {device}: {source}")]
    Device {
        /// The device asked for.
        device: Device,
        /// Why.
        #[source]
        source: SharedError,
    },
    /// The adapter store refused its configuration.
    #[error("invalid engine config: {source}")]
    Store {
        /// Why.
        #[source]
        source: SharedError,
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
        source: SharedError,
    },
    /// The model could not be opened or loaded (its `config.json`, `generation_config.json`,
    /// weights, or the KV cache sized for it).
    #[error("model: {0}")]
    Model(#[source] SharedError),
    /// The model's tokenizer or chat template files could not be read.
    #[error("model: {}: {source}", path.display())]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: SharedError,
    },
    /// A start-up adapter could not be read, validated or loaded.
    #[error("{}", adapter_message(name, source.as_ref()))]
    Adapter {
        /// The adapter.
        name: String,
        /// Why ([`BuildError::cause_kind`] labels it: `rank_too_large`, `truncated`, …).
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
}

impl BuildError {
    /// A stable snake_case label: `invalid_config`, `model_error`, `adapter_error` or `internal`.
    pub fn kind(&self) -> &'static str {
        match self {
            BuildError::LoraOff { .. }
            | BuildError::MaxModelLen { .. }
            | BuildError::GpuMemoryUtilization { .. }
            | BuildError::StepMemory { .. }
            | BuildError::Limits(_)
            | BuildError::Device { .. }
            | BuildError::Store { .. }
            | BuildError::Scheduler { .. } => "invalid_config",
            BuildError::Model(_) | BuildError::Tokenizer { .. } => "model_error",
            BuildError::Adapter { .. } => "adapter_error",
            BuildError::Spawn { .. } => "internal",
        }
    }

    /// For a start-up adapter's error, the underlying reason's label (`rank_too_large`,
    /// `truncated`, `not_a_target`, …).
    pub fn cause_kind(&self) -> Option<&'static str> {
        match self {
            BuildError::Adapter { source, .. } => Some(store_kind(source.as_ref())),
            _ => None,
        }
    }

    /// The model crate's error (opening, reading or sizing the model).
    pub(crate) fn model(e: multilora_models::Error) -> BuildError {
        BuildError::Model(Arc::new(e))
    }

    /// An adapter format error about start-up adapter `name` (its source or its config).
    pub(crate) fn adapter_format(name: &str, e: multilora_adapter::Error) -> BuildError {
        BuildError::adapter(name, multilora_store::Error::Adapter(e))
    }

    /// The store's error about start-up adapter `name`.
    pub(crate) fn adapter(name: &str, e: multilora_store::Error) -> BuildError {
        BuildError::Adapter { name: name.to_string(), source: Arc::new(e) }
    }
}

/// The label of an adapter error's source: the store's `kind()` (the adapter crate's own for a
/// format error), which is what the engine puts there.
fn store_kind(source: &(dyn std::error::Error + Send + Sync + 'static)) -> &'static str {
    source.downcast_ref::<multilora_store::Error>().map_or("adapter", multilora_store::Error::kind)
}

/// The source's message, prefixed with the adapter's name unless it already leads with it.
fn adapter_message(name: &str, source: &(dyn std::error::Error + Send + Sync)) -> String {
    let message = source.to_string();
    let prefix = format!("adapter {name:?}");
    if message.starts_with(&prefix) { message } else { format!("{prefix}: {message}") }
}
