//! Scheduler configuration: budgets, the `max_loras` limit, the admission policy and the KV pool.

use multilora_prefix_cache::{KvConfig, SlidingKv};

use multilora_types::StepTime;

use crate::{Error, Result};

/// Default for [`SchedulerConfig::min_prefill_chunk`].
pub const DEFAULT_MIN_PREFILL_CHUNK: usize = 16;

/// Default for [`Policy::Aging`]'s `max_skipped_steps`.
pub const DEFAULT_MAX_SKIPPED_STEPS: u32 = 32;

/// How waiting requests are admitted when the `max_loras` limit is reached.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// vLLM's rule and nothing more: a request whose adapter would be one too many is skipped and
    /// keeps its place; requests behind it with a running adapter, or none, are admitted. Under a
    /// steady stream for the running adapters a skipped adapter can wait forever.
    Fcfs,
    /// vLLM's rule plus aging. Once a waiting request has been skipped for the adapter limit in
    /// more than `max_skipped_steps` steps (it is *starved*) and its adapter is not running, the
    /// first such request in queue order becomes the aging target:
    ///
    /// - no other new adapter enters the running set until the target's adapter does, so the next
    ///   slot that drains goes to it;
    /// - while every slot is taken, the running adapter with the fewest running requests stops
    ///   admitting new requests, so its slot drains even under a steady stream (without this a
    ///   stream for a running adapter would hold its slot forever);
    /// - requests of the other running adapters and base-model requests are still admitted.
    Aging {
        /// Steps a request may be skipped for the adapter limit before it is starved.
        max_skipped_steps: u32,
    },
}

impl Policy {
    /// [`Policy::Aging`] with the given bound.
    pub fn aging(max_skipped_steps: u32) -> Self {
        Policy::Aging { max_skipped_steps }
    }

    /// A stable snake_case name: `fcfs` or `aging`.
    pub fn name(&self) -> &'static str {
        match self {
            Policy::Fcfs => "fcfs",
            Policy::Aging { .. } => "aging",
        }
    }
}

impl Default for Policy {
    fn default() -> Self {
        Policy::aging(DEFAULT_MAX_SKIPPED_STEPS)
    }
}

/// Budgets and limits of the scheduler, named as in vLLM.
///
/// Built from [`Default`] with builder-style setters:
///
/// ```
/// use multilora_scheduler::{Policy, SchedulerConfig};
///
/// let config = SchedulerConfig::default().max_loras(8).max_num_seqs(64).policy(Policy::Fcfs);
/// assert_eq!(config.max_loras, 8);
/// ```
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq)]
pub struct SchedulerConfig {
    /// Most requests running at once (default 256).
    pub max_num_seqs: usize,
    /// Most tokens computed in one step, prefill chunks and decodes together (default 8192).
    pub max_num_batched_tokens: usize,
    /// The model's context length: prompt plus outputs never exceed it (default 8192).
    pub max_model_len: usize,
    /// Most distinct adapter generations among running requests; 0 turns LoRA off and rejects
    /// requests that name an adapter (default 1, as in vLLM).
    pub max_loras: usize,
    /// The admission policy at the adapter limit (default [`Policy::Aging`]).
    pub policy: Policy,
    /// The KV block pool and prefix cache (default [`KvConfig::default`]: 1024 blocks of 16).
    pub kv: KvConfig,
    /// How long a step that carries decode rows may take (default [`StepTime::Unbounded`]; the
    /// engine's default is [`StepTime::Auto`]). Only [`crate::Scheduler::schedule_with_cost`]
    /// applies it.
    pub step_time: StepTime,
    /// Under a step-time budget, the fewest prompt tokens every running prefill still gets each
    /// step, so a prompt always advances (default 16).
    pub min_prefill_chunk: usize,
    /// Most prompt tokens a step computes of a request that wants prompt logprobs (each gives a
    /// row of logits over the vocabulary, so its chunks are cut to what the engine's logits
    /// budget holds; default unbounded).
    pub max_prompt_logprob_rows: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 8192,
            max_loras: 1,
            policy: Policy::default(),
            kv: KvConfig::default(),
            step_time: StepTime::Unbounded,
            min_prefill_chunk: DEFAULT_MIN_PREFILL_CHUNK,
            max_prompt_logprob_rows: usize::MAX,
        }
    }
}

impl SchedulerConfig {
    /// Sets [`SchedulerConfig::max_num_seqs`].
    pub fn max_num_seqs(mut self, n: usize) -> Self {
        self.max_num_seqs = n;
        self
    }

    /// Sets [`SchedulerConfig::max_num_batched_tokens`].
    pub fn max_num_batched_tokens(mut self, n: usize) -> Self {
        self.max_num_batched_tokens = n;
        self
    }

    /// Sets [`SchedulerConfig::max_model_len`].
    pub fn max_model_len(mut self, n: usize) -> Self {
        self.max_model_len = n;
        self
    }

    /// Sets [`SchedulerConfig::max_loras`].
    pub fn max_loras(mut self, n: usize) -> Self {
        self.max_loras = n;
        self
    }

    /// Sets [`SchedulerConfig::policy`].
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets [`SchedulerConfig::step_time`].
    pub fn step_time(mut self, step_time: StepTime) -> Self {
        self.step_time = step_time;
        self
    }

    /// Sets [`SchedulerConfig::min_prefill_chunk`].
    pub fn min_prefill_chunk(mut self, n: usize) -> Self {
        self.min_prefill_chunk = n;
        self
    }

    /// Sets [`SchedulerConfig::max_prompt_logprob_rows`].
    pub fn max_prompt_logprob_rows(mut self, n: usize) -> Self {
        self.max_prompt_logprob_rows = n;
        self
    }

    /// Sets [`SchedulerConfig::kv`].
    pub fn kv(mut self, kv: KvConfig) -> Self {
        self.kv = kv;
        self
    }

    /// Checks that the configuration can work: every budget at least 1, and one request of
    /// `max_model_len` tokens fits in the KV pool alone (so a request never waits for blocks
    /// that can never exist).
    pub fn validate(&self) -> Result<()> {
        let fail = |msg: String| Err(Error::InvalidConfig(msg));
        if self.max_num_seqs == 0 {
            return fail("max_num_seqs must be at least 1".into());
        }
        if self.max_num_batched_tokens == 0 {
            return fail("max_num_batched_tokens must be at least 1".into());
        }
        if self.max_model_len < 2 {
            return fail(format!("max_model_len {} leaves no room for a prompt and a new token", self.max_model_len));
        }
        match self.step_time {
            StepTime::Auto { factor } if !(factor > 1.0 && factor.is_finite()) => {
                return fail(format!("the auto step-time factor must be a finite number above 1, got {factor}"));
            }
            StepTime::Max { seconds } if !(seconds > 0.0 && seconds.is_finite()) => {
                return fail(format!("the step-time budget must be a positive number of seconds, got {seconds}"));
            }
            StepTime::Unbounded | StepTime::Auto { .. } | StepTime::Max { .. } => {}
            // `StepTime` is the shared vocabulary's and may grow: a budget this scheduler does not
            // apply is refused here, so `StepCost::limit_s` never meets one.
            other => return fail(format!("the step-time budget {:?} is not one this scheduler applies", other.name())),
        }
        if self.min_prefill_chunk == 0 {
            return fail("min_prefill_chunk must be at least 1".into());
        }
        if self.max_prompt_logprob_rows == 0 {
            return fail("max_prompt_logprob_rows must be at least 1".into());
        }
        if self.kv.block_size == 0 {
            return fail("kv.block_size must be at least 1".into());
        }
        let capacity = self.kv.num_blocks.saturating_mul(self.kv.block_size);
        if capacity < self.max_model_len {
            return fail(format!(
                "the kv pool holds {capacity} tokens ({} blocks of {}), fewer than max_model_len {}",
                self.kv.num_blocks, self.kv.block_size, self.max_model_len
            ));
        }
        if let Some(sliding) = self.kv.sliding {
            let chunk = self.max_num_batched_tokens.min(self.max_model_len);
            let needed = SlidingKv::request_blocks(sliding.window, self.kv.block_size, chunk, self.max_model_len);
            if sliding.num_blocks < needed {
                return fail(format!(
                    "the sliding layers' kv pool holds {} blocks; one request with a window of {} and steps of {chunk} \
                     tokens needs {needed}",
                    sliding.num_blocks, sliding.window
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid_and_aging() {
        let c = SchedulerConfig::default();
        c.validate().unwrap();
        assert_eq!(c.policy, Policy::Aging { max_skipped_steps: DEFAULT_MAX_SKIPPED_STEPS });
        assert_eq!(c.policy.name(), "aging");
        assert_eq!(Policy::Fcfs.name(), "fcfs");
    }

    #[test]
    fn rejects_impossible_configs() {
        let small_pool = SchedulerConfig::default().kv(KvConfig { num_blocks: 2, ..KvConfig::default() });
        let e = small_pool.validate().unwrap_err();
        assert_eq!(e.kind(), "invalid_config");
        assert_eq!(
            e.to_string(),
            "invalid scheduler config: the kv pool holds 32 tokens (2 blocks of 16), fewer than max_model_len 8192"
        );
        assert!(SchedulerConfig::default().max_num_seqs(0).validate().is_err());
        assert!(SchedulerConfig::default().max_num_batched_tokens(0).validate().is_err());
        assert!(SchedulerConfig::default().max_model_len(1).validate().is_err());
    }
}
