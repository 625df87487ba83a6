//! The shared vocabulary of multilora: the plain identifiers, limits and records that more than
//! one crate speaks, defined once at the bottom of the stack so that no crate above translates
//! another's copy.
//!
//! - [`AdapterId`], [`Fingerprint`] and [`AdapterGen`]: an adapter, its content, and the pair of
//!   the two that occupies a slot and counts toward `max_loras`.
//! - [`AdapterSource`]: where an adapter's files are (a directory, a GGUF LoRA file, a hub repo),
//!   and [`Resolver`] / [`ResolveError`]: the one trait (and its error) that answers it for an
//!   adapter name nobody registered; the store runs resolvers, the engine re-exports the three.
//! - [`SlotId`]: a device slot. "No adapter" is `Option::<SlotId>::None`; only the kernels' own
//!   index buffers spell it `-1`.
//! - [`ModuleKind`] and [`LoraLimits`]: what can be adapted, and the LoRA limits checked once
//!   where they are built ("LoRA off" is a value, [`LoraLimits::off`]).
//! - [`StepTime`]: the step-time budget the engine is built with and the scheduler applies.
//! - [`FinishReason`], [`LogitsWanted`] and [`Histogram`].
//! - [`SplitMix64`]: the one seeded generator, whose streams seeded outputs and tests rely on.
//!
//! Plain data and one trait: no candle, no threads, no I/O, no dependency of ours.

mod adapter;
mod histogram;
mod limits;
mod module;
mod request;
mod resolver;
mod rng;
mod slot;
mod source;
mod step_time;

pub use adapter::{AdapterGen, AdapterId, Fingerprint};
pub use histogram::Histogram;
pub use limits::{DEFAULT_MAX_LORA_RANK, LimitsError, LoraLimits, MAX_LORA_RANK_CEILING};
pub use module::ModuleKind;
pub use request::{FinishReason, LogitsWanted};
pub use resolver::{ResolveError, Resolver};
pub use rng::SplitMix64;
pub use slot::SlotId;
pub use source::AdapterSource;
pub use step_time::{DEFAULT_STEP_FACTOR, StepTime};
