//! What a caller submits (`GenerateRequest`, `Prompt`, `SamplingParams` and, checked once,
//! `ValidParams`) and what streams back (`Event`, `Completion`), with vLLM's meanings.

use std::collections::BTreeMap;

use crate::error::{EngineError, Result};
use crate::guided::Constraint;
pub use crate::stop::{MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS};

/// One generation request.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct GenerateRequest {
    /// An adapter name, or the served base model's name.
    pub model: String,
    /// The prompt.
    pub prompt: Prompt,
    /// How to sample, checked once ([`SamplingParams::validate`]).
    pub params: ValidParams,
}

impl GenerateRequest {
    /// A request for `model` with default sampling parameters.
    pub fn new(model: impl Into<String>, prompt: impl Into<Prompt>) -> GenerateRequest {
        GenerateRequest { model: model.into(), prompt: prompt.into(), params: ValidParams::default() }
    }

    /// Sets the sampling parameters, validated by [`SamplingParams::validate`]: a caller that
    /// submits the same parameters many times (the server's `n` choices) checks them once.
    pub fn params(mut self, params: ValidParams) -> GenerateRequest {
        self.params = params;
        self
    }
}

/// A prompt: text (tokenized with the model's `tokenizer.json`) or token ids.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Prompt {
    /// Text; needs a tokenizer.
    Text(String),
    /// Token ids, used as given (no BOS added).
    Tokens(Vec<u32>),
}

impl From<&str> for Prompt {
    fn from(s: &str) -> Prompt {
        Prompt::Text(s.to_string())
    }
}

impl From<String> for Prompt {
    fn from(s: String) -> Prompt {
        Prompt::Text(s)
    }
}

impl From<Vec<u32>> for Prompt {
    fn from(ids: Vec<u32>) -> Prompt {
        Prompt::Tokens(ids)
    }
}

/// Sampling parameters with vLLM's names and meanings.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct SamplingParams {
    /// Completions per prompt. Only 1 is supported for now; more is `invalid_request`.
    pub n: usize,
    /// 0 is greedy (argmax, lowest id on ties).
    pub temperature: f32,
    /// Nucleus sampling mass, in (0, 1].
    pub top_p: f32,
    /// Keep the k most likely tokens; 0 or -1 turns it off.
    pub top_k: i32,
    /// Drop tokens whose probability is below `min_p` times the top one's, in [0, 1].
    pub min_p: f32,
    /// Seed of this request's own generator: the same seed gives the same tokens.
    pub seed: Option<u64>,
    /// Most tokens to generate; `None` fills the context (`max_model_len`).
    pub max_tokens: Option<usize>,
    /// Stop tokens (EOS and `stop_token_ids`) cannot be sampled before this many tokens.
    pub min_tokens: usize,
    /// Subtracted from the logit of every token generated at least once, in [-2, 2].
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated, in [-2, 2].
    pub frequency_penalty: f32,
    /// Divides positive (multiplies negative) logits of tokens in the prompt or output; 1 is off.
    pub repetition_penalty: f32,
    /// Added to the logits of the given tokens before everything else.
    pub logit_bias: BTreeMap<u32, f32>,
    /// Stop when the generated text contains one of these (not included in the output).
    pub stop: Vec<String>,
    /// Stop when one of these tokens is generated (included in the token ids).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating after EOS.
    pub ignore_eos: bool,
    /// Log probabilities of each generated token plus this many alternatives.
    pub logprobs: Option<usize>,
    /// Log probabilities of each prompt token plus this many alternatives.
    pub prompt_logprobs: Option<usize>,
    /// Whether special tokens are left out of the text (vLLM's default, true).
    pub skip_special_tokens: bool,
    /// What the output must match (vLLM's `structured_outputs`), compiled at `submit`.
    pub constraint: Option<Constraint>,
}

impl Default for SamplingParams {
    /// vLLM's defaults, except `max_tokens` (vLLM's completions default is 16; here the context).
    fn default() -> SamplingParams {
        SamplingParams {
            n: 1,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            max_tokens: None,
            min_tokens: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: BTreeMap::new(),
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            prompt_logprobs: None,
            skip_special_tokens: true,
            constraint: None,
        }
    }
}

/// Most `stop_token_ids` one request may give.
pub const MAX_STOP_TOKEN_IDS: usize = 1024;

/// Most alternatives `logprobs` / `prompt_logprobs` may ask for (vLLM's default cap).
pub const MAX_LOGPROBS: usize = 20;

impl SamplingParams {
    /// Greedy decoding of at most `max_tokens` tokens.
    pub fn greedy(max_tokens: usize) -> SamplingParams {
        SamplingParams { temperature: 0.0, max_tokens: Some(max_tokens), ..SamplingParams::default() }
    }

    /// Checks ranges as vLLM does, and every token id against a vocabulary of `vocab_size` (the
    /// engine's is [`crate::EngineConfig::vocab_size`]); the error (`invalid_request`) names the
    /// field. What passes is the [`ValidParams`] a [`GenerateRequest`] carries: `submit` checks
    /// nothing of it again but that its token ids fit the engine's vocabulary.
    pub fn validate(self, vocab_size: usize) -> Result<ValidParams> {
        let bad = |m: String| Err(EngineError::invalid(m));
        if self.n != 1 {
            return bad(format!("n must be 1 (n > 1 is not supported yet), got {}", self.n));
        }
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad(format!("temperature must be a finite number >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if self.top_k < -1 {
            return bad(format!("top_k must be -1 (off), 0 (off) or positive, got {}", self.top_k));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if self.max_tokens == Some(0) {
            return bad("max_tokens must be at least 1".into());
        }
        if let Some(max) = self.max_tokens
            && self.min_tokens > max
        {
            return bad(format!("min_tokens ({}) must not exceed max_tokens ({max})", self.min_tokens));
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad(format!("repetition_penalty must be > 0, got {}", self.repetition_penalty));
        }
        for (name, n) in [("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)] {
            if let Some(n) = n
                && n > MAX_LOGPROBS
            {
                return bad(format!("{name} must be at most {MAX_LOGPROBS}, got {n}"));
            }
        }
        let max_token_id = self.logit_bias.keys().chain(&self.stop_token_ids).copied().max();
        if let Some(t) = max_token_id
            && t as usize >= vocab_size
        {
            return bad(out_of_vocab(t, vocab_size));
        }
        if self.stop.iter().any(String::is_empty) {
            return bad("stop strings must not be empty".into());
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return bad(format!("stop: at most {MAX_STOP_STRINGS} stop strings, got {}", self.stop.len()));
        }
        if let Some(long) = self.stop.iter().find(|s| s.len() > MAX_STOP_STRING_BYTES) {
            return bad(format!(
                "stop: a stop string may be at most {MAX_STOP_STRING_BYTES} bytes, got one of {}",
                long.len()
            ));
        }
        if self.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return bad(format!(
                "stop_token_ids: at most {MAX_STOP_TOKEN_IDS} stop token ids, got {}",
                self.stop_token_ids.len()
            ));
        }
        if let Some(c) = &self.constraint {
            c.check().map_err(|reason| EngineError::Constraint { kind: c.kind(), reason })?;
        }
        Ok(ValidParams { params: self, max_token_id })
    }
}

fn out_of_vocab(t: u32, vocab_size: usize) -> String {
    format!("token id {t} is outside the vocabulary of {vocab_size}")
}

/// Sampling parameters that passed [`SamplingParams::validate`]: the only kind a
/// [`GenerateRequest`] carries, so a request's parameters are checked once, however many times
/// they are submitted. It remembers the largest token id they name, which `submit` checks
/// against the engine's vocabulary (the one check that depends on the engine).
#[derive(Clone, Debug, PartialEq)]
pub struct ValidParams {
    params: SamplingParams,
    /// The largest of `logit_bias`' and `stop_token_ids`' ids.
    max_token_id: Option<u32>,
}

impl Default for ValidParams {
    /// [`SamplingParams::default`], valid for every vocabulary (it names no token).
    fn default() -> ValidParams {
        ValidParams { params: SamplingParams::default(), max_token_id: None }
    }
}

impl ValidParams {
    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The parameters, to change and validate again.
    pub fn into_params(self) -> SamplingParams {
        self.params
    }

    /// The same parameters with another `seed` (which no check reads): the server's `n` choices
    /// of one seeded request get `seed + i`.
    pub fn with_seed(mut self, seed: Option<u64>) -> ValidParams {
        self.params.seed = seed;
        self
    }

    /// Refuses parameters whose token ids do not fit the engine's vocabulary of `vocab_size`
    /// (they were validated against a larger one), as [`SamplingParams::validate`] would.
    pub(crate) fn check_vocab(&self, vocab_size: usize) -> Result<()> {
        match self.max_token_id {
            Some(t) if t as usize >= vocab_size => Err(EngineError::invalid(out_of_vocab(t, vocab_size))),
            _ => Ok(()),
        }
    }
}

/// Why a request finished: the scheduler's own type (`length`, `stop`, `abort`, `error`).
pub use multilora_types::FinishReason;

/// Token counts of a finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
}

/// A prompt token's log probability (given the tokens before it) and the top alternatives.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct PromptLogprob {
    /// The prompt token.
    pub token: u32,
    /// Its log probability under the raw logits.
    pub logprob: f32,
    /// Its rank at that position (1: the most likely; ties share the better rank), as vLLM
    /// reports it.
    pub rank: usize,
    /// The most likely tokens at that position, best first.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// What a request's stream carries.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Event {
    /// Prompt log probabilities (first entry `None`: the first token has no context), sent once
    /// before the first token when `prompt_logprobs` was asked for.
    PromptLogprobs(Vec<Option<PromptLogprob>>),
    /// A generated token.
    Token {
        /// The token id.
        id: u32,
        /// Text newly complete with this token (empty while a multi-byte character is split).
        text_delta: String,
        /// Its log probability (raw logits), when `logprobs` was asked for.
        logprob: Option<f32>,
        /// The top alternatives, best first.
        top_logprobs: Vec<(u32, f32)>,
    },
    /// The request is done; nothing follows.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Token counts.
        usage: Usage,
        /// With [`FinishReason::Stop`], the stop string or stop token that ended it (`None` for
        /// EOS), as vLLM's `stop_reason`.
        stop_reason: Option<StopReason>,
    },
    /// The request failed; a `Finished` with [`FinishReason::Error`] may follow.
    Error(EngineError),
}

/// A generated token with its log probabilities.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct TokenLogprob {
    /// The token.
    pub token: u32,
    /// Its log probability.
    pub logprob: f32,
    /// The top alternatives.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// A whole request's output, from [`crate::RequestStream::collect_blocking`].
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Completion {
    /// Generated token ids (a stop token included).
    pub token_ids: Vec<u32>,
    /// The generated text (a stop string excluded).
    pub text: String,
    /// Per-token log probabilities, when asked for.
    pub logprobs: Option<Vec<TokenLogprob>>,
    /// Prompt log probabilities, when asked for.
    pub prompt_logprobs: Option<Vec<Option<PromptLogprob>>>,
    /// Why it finished.
    pub finish_reason: FinishReason,
    /// The stop string or stop token that ended it ([`Event::Finished`]'s).
    pub stop_reason: Option<StopReason>,
    /// Token counts.
    pub usage: Usage,
}

/// What ended a request that finished with [`FinishReason::Stop`], other than EOS (vLLM's
/// `stop_reason`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StopReason {
    /// One of the request's `stop_token_ids`.
    Token(u32),
    /// One of the request's `stop` strings (cut from the text).
    String(String),
}
