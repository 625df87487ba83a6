//! Continuous-batching scheduler with the `max_loras` admission rule and adapter aging.
//!
//! Pure and synchronous (no tensors, threads or I/O), on top of the KV manager of
//! `multilora-prefix-cache`, which it owns. One step is one [`Scheduler::schedule`] call: running
//! requests first (decodes and ongoing prefill chunks, vLLM v1 style: a request's computed tokens
//! catch up with its tokens), then waiting requests in queue order under the budgets
//! (`max_num_seqs`, `max_num_batched_tokens` with chunked prefill, KV blocks with prefix-cache
//! hits counted as computed) and the adapter rule:
//!
//! > at most `max_loras` distinct adapter generations among running requests; a waiting request
//! > whose adapter would be one too many is *skipped*, not blocked on, and keeps its place.
//!
//! With a `StepTime` budget (`multilora_types::StepTime`), a step that carries decode rows takes prefill tokens only up to
//! what fits in that time by the engine's measured [`StepCost`] ([`Scheduler::schedule_with_cost`]):
//! decode rows first, then every running prefill by at least `min_prefill_chunk` tokens, then
//! admissions with what is left, so streams never stall behind arriving prompts.
//!
//! The engine runs the step and calls [`Scheduler::update`] with the sampled tokens; finished
//! requests come back with a [`FinishReason`]. KV exhaustion preempts the newest running request
//! (recompute). [`Policy::Aging`] (the default) adds what vLLM lacks: no adapter starves.
//! [`sim`] replays synthetic traffic, the `simulate` example prints its table.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod adapters;
mod budget;
mod config;
mod error;
mod output;
mod request;
mod scheduler;
pub mod sim;

pub use budget::StepCost;
pub use config::{DEFAULT_MAX_SKIPPED_STEPS, DEFAULT_MIN_PREFILL_CHUNK, Policy, SchedulerConfig};
pub use error::{Error, Result};
pub use multilora_prefix_cache::{BlockId, KvConfig, KvMetrics, NULL_BLOCK, RequestId, SlidingKv};
pub use output::{FinishedRequest, RequestResult, ScheduledRequest, SchedulerCounts, SchedulerOutput};
pub use request::Request;
pub use scheduler::Scheduler;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_types_are_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Scheduler>();
        check::<SchedulerConfig>();
        check::<SchedulerOutput>();
        check::<Request>();
        check::<Error>();
        check::<sim::SimReport>();
    }
}
