//! Requests as the scheduler sees them: plain data in, per-request bookkeeping inside.

use multilora_prefix_cache::{ExtraKeys, RequestId};
use multilora_types::{AdapterGen, FinishReason};

/// A request handed to [`Scheduler::add_request`](crate::Scheduler::add_request).
///
/// `min_tokens`, `ignore_eos` and stop strings are the engine's business: it reports such finishes
/// through [`RequestResult::finish`](crate::RequestResult::finish).
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// The caller's id; unique among live requests.
    pub id: RequestId,
    /// The adapter generation, or `None` for the base model.
    pub adapter: Option<AdapterGen>,
    /// Prompt token ids; not empty.
    pub prompt: Vec<u32>,
    /// Most tokens to generate; at least 1.
    pub max_new_tokens: usize,
    /// Sampling one of these finishes the request with [`FinishReason::Stop`] (the token is kept).
    pub stop_token_ids: Vec<u32>,
    /// Logits are wanted at every prompt position; the prefix cache is then not read.
    pub prompt_logprobs: bool,
    /// Keeps this tenant's prefix-cache blocks apart from everyone else's.
    pub cache_salt: Option<Vec<u8>>,
}

impl Request {
    /// A base-model request with no stop tokens.
    pub fn new(id: RequestId, prompt: Vec<u32>, max_new_tokens: usize) -> Self {
        Self {
            id,
            adapter: None,
            prompt,
            max_new_tokens,
            stop_token_ids: Vec::new(),
            prompt_logprobs: false,
            cache_salt: None,
        }
    }

    /// Sets the adapter generation.
    pub fn adapter(mut self, adapter: AdapterGen) -> Self {
        self.adapter = Some(adapter);
        self
    }

    /// Sets the stop token ids.
    pub fn stop_token_ids(mut self, ids: Vec<u32>) -> Self {
        self.stop_token_ids = ids;
        self
    }

    /// Asks for logits at every prompt position.
    pub fn prompt_logprobs(mut self, wanted: bool) -> Self {
        self.prompt_logprobs = wanted;
        self
    }

    /// Sets the prefix-cache salt.
    pub fn cache_salt(mut self, salt: Vec<u8>) -> Self {
        self.cache_salt = Some(salt);
        self
    }
}

/// Where a live request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    Waiting,
    Running,
}

/// The scheduler's bookkeeping for one live request.
#[derive(Clone, Debug)]
pub(crate) struct ReqState {
    pub(crate) id: RequestId,
    pub(crate) adapter: Option<AdapterGen>,
    /// Interned index of `adapter` (see `AdapterTable`), or `NO_ADAPTER`.
    pub(crate) adapter_idx: u32,
    /// Prompt followed by the outputs so far.
    pub(crate) tokens: Vec<u32>,
    pub(crate) num_prompt_tokens: usize,
    pub(crate) max_new_tokens: usize,
    pub(crate) stop_token_ids: Vec<u32>,
    pub(crate) prompt_logprobs: bool,
    pub(crate) extra: ExtraKeys,
    pub(crate) arrival: u64,
    /// Tokens whose KV is computed (or scheduled to be, in the step awaiting `update`).
    pub(crate) num_computed: usize,
    pub(crate) status: Status,
    /// Whether the last `schedule` asked the engine to sample a token for this request.
    pub(crate) sample_pending: bool,
    /// Scheduled since the last `update`.
    pub(crate) in_flight: bool,
    /// `num_computed` before the first step scheduled since the last `update`: `update` commits
    /// to the prefix cache only when a block boundary lies past it.
    pub(crate) computed_before_step: usize,
    /// A token appended by the `update` in progress.
    pub(crate) got_token: bool,
    /// A finish the engine reported in the `update` in progress.
    pub(crate) reported_finish: Option<FinishReason>,
    pub(crate) num_preemptions: u32,
}

impl ReqState {
    pub(crate) fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Most prompt tokens a step may compute of it: `cap` while its steps give a logit row per
    /// prompt token (it wants prompt logprobs and has no output yet), else unbounded.
    pub(crate) fn prompt_rows(&self, cap: usize) -> usize {
        if self.prompt_logprobs && self.num_output_tokens() == 0 { cap } else { usize::MAX }
    }

    pub(crate) fn num_output_tokens(&self) -> usize {
        self.tokens.len() - self.num_prompt_tokens
    }
}
