//! The multilora engine: serve one base LLM with many LoRA adapters at once, embedded in your
//! own Rust service.
//!
//! Build an [`Engine`] from a base model and some adapters, submit requests that name an adapter
//! (or the base) as their model from any thread through a cloneable [`EngineHandle`], stream
//! [`Event`]s back, load and unload adapters while serving, and read [`MetricsSnapshot`]s.
//!
//! ```
//! use multilora::{Engine, Event, GenerateRequest, SamplingParams};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/peft-tiny");
//! let engine = Engine::builder(format!("{fixtures}/base"))
//!     .lora("sql", format!("{fixtures}/adapters/qv_r8"))
//!     .lora("chat", format!("{fixtures}/adapters/all_r16"))
//!     .kv_cache_bytes(8 << 20)
//!     .build()?;
//! let params = SamplingParams::greedy(8).validate(engine.config().vocab_size)?; // checked once
//! let sql = engine.submit(GenerateRequest::new("sql", "SELECT the").params(params.clone()))?;
//! let mut chat = engine.submit(GenerateRequest::new("chat", "Hello").params(params))?;
//! while let Some(Event::Token { text_delta, .. }) = chat.recv_blocking() {
//!     print!("{text_delta}"); // streamed as it is generated
//! }
//! println!("\nsql: {:?}", sql.collect_blocking()?.text);
//! # Ok(()) }
//! ```
//!
//! Decisions worth knowing:
//! - The engine loop is the only thread this crate starts (the store adds loader threads):
//!   commands are drained between steps, and an idle engine blocks on its channel.
//! - A request reaches the scheduler only once its adapter is in host memory; until then it waits
//!   in the engine in arrival order (counted as deferred).
//! - Sampling parameters are checked once, by [`SamplingParams::validate`], into the
//!   [`ValidParams`] a request carries; prompts and model names are checked (and prompts
//!   tokenized) on the caller's thread, so `submit` returns `invalid_request` /
//!   `prompt_too_long` / `model_not_found` at once and an invalid request is never queued; only a
//!   cold adapter's failed load arrives on the stream as [`Event::Error`].
//! - The API names no candle type and no type of a crate below the engine but the shared
//!   vocabulary of `multilora-types` ([`ModuleKind`], [`LoraLimits`], [`StepTime`],
//!   [`FinishReason`], [`Histogram`], the [`Resolver`] trait): [`Device`] and [`DType`] are the
//!   engine's own knobs, converted inside it, and the built-in resolvers are its own types.
//! - A panic in the engine loop is caught: every live request gets
//!   [`EngineError::EngineFailed`], and so does every later submit and adapter call.
//!   [`EngineHandle::health`] and [`EngineHandle::published_metrics`] never wait on the loop, so
//!   a failed or stuck loop is seen as one.
//! - Stop strings (at most [`MAX_STOP_STRINGS`] of [`MAX_STOP_STRING_BYTES`] bytes) are matched
//!   incrementally, and text that could still begin one is held back, so no part of a stop string
//!   is ever streamed.
//! - `n > 1` is refused with `invalid_request` for now.
//! - Logprobs are the log-softmax of the raw logits (before temperature and penalties), as vLLM
//!   reports them.
//! - `bias = "all"` adapters without bias tensors are accepted (the field changes nothing).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

/// The README's Rust examples, compiled and run as doctests so the README stays true.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeDoctests;

mod builder;
mod command;
mod config;
mod detokenize;
mod engine_loop;
mod error;
#[cfg(feature = "failpoints")]
mod failpoints;
mod guided;
mod handle;
mod health;
mod knobs;
mod metrics;
mod request;
mod resolver;
mod sampler;
mod sampling;
mod step_cost;
mod stop;
mod text;

pub use builder::{
    DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_KV_CACHE_BYTES, DEFAULT_STEP_MEMORY_BYTES, EngineBuilder,
    MAX_DEFAULT_CACHE_RAM_BYTES, MAX_DEFAULT_KV_CACHE_BYTES,
};
pub use config::EngineConfig;
pub use error::{BuildError, EngineError, Result, SharedError};
pub use guided::{CACHED_GRAMMARS, Constraint, MAX_CHOICES, MAX_CONSTRAINT_BYTES};
pub use handle::{Engine, EngineHandle, METRICS_WAIT, ModelInfo, RequestStream, Tier};
pub use health::{EngineHealth, LoopState};
pub use knobs::{DType, Device};
pub use metrics::{
    AdapterUsage, Histogram, ITL_BUCKETS_S, LATENCY_BUCKETS_S, MASK_BUCKETS_S, MetricsSnapshot, STEP_ADAPTER_BUCKETS,
    STEP_BUCKETS_S, STEP_ROW_BUCKETS, STEP_TOKEN_BUCKETS, TierOccupancy,
};
pub use request::{
    Completion, Event, FinishReason, GenerateRequest, MAX_LOGPROBS, MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS, Prompt, PromptLogprob, SamplingParams, StopReason, TokenLogprob, Usage, ValidParams,
};
pub use resolver::{DirectoryResolver, HubResolver};
pub use sampler::Sampler;
pub use text::ChatTemplateSource;

// The shared vocabulary (`multilora-types`: plain data every crate speaks, not one of the crates
// below the engine).
pub use multilora_types::ModuleKind;
/// Resolvers of adapter names nobody registered (vLLM's `LoRAResolver`): the one trait, its
/// error and its answer, which the store runs on its loader threads.
pub use multilora_types::{AdapterSource, ResolveError, Resolver};
/// The step-time budget (`EngineBuilder::step_time`).
pub use multilora_types::{DEFAULT_STEP_FACTOR, StepTime};
/// The LoRA limits an engine runs with ([`EngineConfig::lora`]) and why a set is refused.
pub use multilora_types::{LimitsError, LoraLimits};
