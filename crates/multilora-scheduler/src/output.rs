//! What one step hands the engine, what the engine hands back, and counts for metrics.

use multilora_prefix_cache::{BlockId, KvMetrics, RequestId};

use multilora_types::{AdapterGen, FinishReason, LogitsWanted};

/// One request's share of a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduledRequest {
    /// The request.
    pub id: RequestId,
    /// Its adapter generation, or `None` for the base model.
    pub adapter: Option<AdapterGen>,
    /// Tokens whose KV is already computed: the position of the first of `token_ids`.
    pub num_computed_tokens: usize,
    /// The tokens to compute this step: a prefill chunk (prompt, or prompt and outputs when
    /// recomputing after preemption) or the one token of a decode.
    pub token_ids: Vec<u32>,
    /// The request's KV blocks, covering at least `num_computed_tokens + token_ids.len()` tokens.
    pub block_table: Vec<BlockId>,
    /// The sliding layers' blocks when the pool has a sliding group (`KvConfig::sliding`), as
    /// long as `block_table`, `NULL_BLOCK` where the window has passed; otherwise empty.
    pub sliding_table: Vec<BlockId>,
    /// Which logits the model must produce.
    pub logits: LogitsWanted,
    /// Whether the engine samples one token for this request after the step (the chunk reaches the
    /// end of the sequence); [`RequestResult::token`] must then carry it.
    pub sample: bool,
    /// Tokens in the request's prompt (positions below it are prompt positions).
    pub num_prompt_tokens: usize,
}

impl ScheduledRequest {
    /// Whether this chunk is a decode: one token, or tokens past the prompt (a sampled token and
    /// those the request's grammar forced after it), which sample at their end.
    pub fn is_decode(&self) -> bool {
        self.token_ids.len() == 1 || self.num_computed_tokens >= self.num_prompt_tokens
    }
}

/// The decisions of one [`Scheduler::schedule`](crate::Scheduler::schedule) call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SchedulerOutput {
    /// The step number, counted from 1.
    pub step: u64,
    /// Running requests first (decodes and ongoing prefills, in admission order), then the
    /// requests admitted from the waiting queue this step, in queue order.
    pub scheduled: Vec<ScheduledRequest>,
    /// Sum of `token_ids.len()` over `scheduled`.
    pub num_scheduled_tokens: usize,
    /// The distinct adapter generations of `scheduled`, in order of first appearance.
    pub active_adapters: Vec<AdapterGen>,
    /// Running requests preempted for KV blocks this step (blocks freed, recomputed later);
    /// they are at the front of the waiting queue.
    pub preempted: Vec<RequestId>,
    /// Waiting requests skipped because of the adapter limit (or held back by aging), in queue
    /// order; they keep their place.
    pub skipped_for_adapter_limit: Vec<RequestId>,
    /// A waiting request the KV pool could not take this step; admission stops there so it keeps
    /// its place.
    pub waiting_for_blocks: Vec<RequestId>,
    /// The prefill tokens the step-time budget allowed next to this step's decode rows, when one
    /// applied ([`crate::Scheduler::schedule_with_cost`] with decode rows in the step).
    pub prefill_budget: Option<usize>,
}

impl SchedulerOutput {
    /// Whether nothing was scheduled.
    pub fn is_empty(&self) -> bool {
        self.scheduled.is_empty()
    }
}

/// What the engine reports for one request after a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestResult {
    /// The request.
    pub id: RequestId,
    /// The sampled token, for a request scheduled with `sample`.
    pub token: Option<u32>,
    /// Tokens appended after `token` without being sampled (those a request's grammar forces):
    /// computed as one chunk in a later step, whose last position samples.
    pub forced: Vec<u32>,
    /// A finish decided by the engine (stop string, `min_tokens`/`ignore_eos` handling, error).
    pub finish: Option<FinishReason>,
}

impl RequestResult {
    /// A sampled token and no engine-reported finish.
    pub fn token(id: RequestId, token: u32) -> Self {
        Self { id, token: Some(token), forced: Vec::new(), finish: None }
    }

    /// An engine-reported finish, with no token.
    pub fn finished(id: RequestId, reason: FinishReason) -> Self {
        Self { id, token: None, forced: Vec::new(), finish: Some(reason) }
    }
}

/// A retired request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FinishedRequest {
    /// The request.
    pub id: RequestId,
    /// Its adapter generation.
    pub adapter: Option<AdapterGen>,
    /// Why it finished.
    pub reason: FinishReason,
    /// The tokens it generated (a stop token included).
    pub output_token_ids: Vec<u32>,
    /// How many times it was preempted.
    pub num_preemptions: u32,
}

/// Counts for metrics, as vLLM exports them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SchedulerCounts {
    /// Requests in the running set.
    pub running: usize,
    /// Requests in the waiting queue (deferred ones included).
    pub waiting: usize,
    /// Waiting requests whose adapter is not running while every adapter slot is taken: they
    /// cannot be admitted until a slot drains.
    pub deferred: usize,
    /// Distinct adapter generations of running requests (sorted).
    pub running_adapters: Vec<AdapterGen>,
    /// Distinct adapter generations of waiting requests (sorted).
    pub waiting_adapters: Vec<AdapterGen>,
    /// The KV pool and prefix cache.
    pub kv: KvMetrics,
}
