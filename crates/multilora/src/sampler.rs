//! [`Sampler`]: the engine's token sampler on its own, for an embedder that has logits of its
//! own to sample as the engine would, and for the sampler's benchmark.

use crate::request::{SamplingParams, TokenLogprob};
use crate::sampling::SamplerState;

/// One request's token sampler, as the engine runs it: `SamplingParams`' processors (logit
/// bias, `min_tokens`, the penalties), then greedy or temperature → top-k → top-p → min-p with the
/// request's own seeded generator, in O(vocabulary) per row whatever the settings.
///
/// ```
/// use multilora::{Sampler, SamplingParams};
/// let mut params = SamplingParams::default();
/// (params.temperature, params.top_k) = (0.8, 2);
/// let mut sampler = Sampler::new(&params, 7, &[], &[])?;
/// let (token, logprobs) = sampler.sample(&mut [0.5, 3.0, -1.0, 2.5]);
/// assert!(token == 1 || token == 3);
/// assert!(logprobs.is_none()); // `params.logprobs` is `None`
/// # Ok::<(), multilora::EngineError>(())
/// ```
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    state: SamplerState,
}

impl Sampler {
    /// A sampler for `params` (checked as `submit` checks them, for any vocabulary, and without
    /// a `constraint`, which only the engine follows), seeded with
    /// `seed`, for a request whose prompt was `prompt` (the repetition penalty reads it) and whose
    /// end-of-sequence ids are `eos` (masked before `min_tokens`, unless `ignore_eos`).
    pub fn new(params: &SamplingParams, seed: u64, prompt: &[u32], eos: &[u32]) -> crate::Result<Sampler> {
        let params = params.clone().validate(usize::MAX)?.into_params();
        if let Some(c) = &params.constraint {
            let reason = "a Sampler has no grammar: constrained requests go through the engine".to_string();
            return Err(crate::EngineError::Constraint { kind: c.kind(), reason });
        }
        let mut stop = params.stop_token_ids.clone();
        if !params.ignore_eos {
            stop.extend_from_slice(eos);
        }
        Ok(Sampler { state: SamplerState::new(seed, prompt, stop, &params), params })
    }

    /// The next token from a row of raw logits (changed while it runs, the same values again when
    /// it returns), recorded for the penalties; with its log probability and the top
    /// alternatives under the raw logits when `params.logprobs` asks for them.
    pub fn sample(&mut self, logits: &mut [f32]) -> (u32, Option<TokenLogprob>) {
        let picked = self.state.pick(logits, &self.params, None);
        self.state.push(picked.token);
        let lp = picked.logprob.map(|logprob| TokenLogprob {
            token: picked.token,
            logprob,
            top_logprobs: picked.top_logprobs,
        });
        (picked.token, lp)
    }
}
