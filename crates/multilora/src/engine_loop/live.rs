//! The live request table's entry: a request from submission to its end — its hold on its
//! adapter (`hold.rs`, dropped with it), its sampler, detokenizer and stop-string text, its
//! prompt logprobs — and what one step does for it: prompt logprobs and sampling
//! (`compute`, run for a step's requests side by side), then stop strings and events
//! (`deliver`, on the loop's thread).

use std::time::Instant;

use multilora_models::GreedyPick;
use multilora_scheduler::{RequestResult, ScheduledRequest};
use multilora_types::LogitsWanted;
use tokenizers::Tokenizer;

use super::hold::Hold;
use crate::command::Submission;
use crate::detokenize::Detokenizer;
use crate::guided::{Accepted, Guide};
use crate::metrics::Counters;
use crate::request::{Event, FinishReason, PromptLogprob, SamplingParams, StopReason};
use crate::sampling::{Picked, SamplerState, prompt_logprob};
use crate::stop::{StopScan, StopStrings};

/// A live request: deferred (waiting for its adapter) or in the scheduler.
#[derive(Debug)]
pub(super) struct Live {
    pub(super) sub: Submission,
    /// What it holds of its adapter, from `submit` on: dropped with the request, so a pin
    /// cannot outlive it.
    pub(super) hold: Hold,
    pub(super) sampler: SamplerState,
    /// Its constraint's grammar state (structured outputs).
    pub(super) guide: Option<Guide>,
    pub(super) detok: Option<Detokenizer>,
    /// Where the scan of the generated text for stop strings stands.
    pub(super) stop_scan: Option<StopScan>,
    pub(super) prompt_lp: Option<Vec<Option<PromptLogprob>>>,
    pub(super) last_token: Option<Instant>,
    /// Most tokens it may generate (as the scheduler was told), so the last one is known when
    /// it is sampled and held-back text is sent with it.
    pub(super) max_new: usize,
    /// What would stop it at its last token (a stop string found, or one of its
    /// `stop_token_ids`): its `stop_reason` when it finishes with `Stop`.
    pub(super) stop_reason: Option<StopReason>,
}

impl Live {
    /// A request just submitted, holding what `submit` resolved its model to.
    pub(super) fn new(mut sub: Submission, hold: Hold, seed: u64, eos: &[u32], detokenize: bool) -> Live {
        let stop = stop_ids(&sub.params, eos);
        let detok = detokenize.then(|| Detokenizer::new(&sub.prompt, sub.params.skip_special_tokens));
        let stop_scan = sub.stops.as_ref().map(StopStrings::scanner);
        Live {
            sampler: SamplerState::new(seed, &sub.prompt, stop, &sub.params),
            guide: sub.guide.take(),
            prompt_lp: sub.params.prompt_logprobs.map(|_| vec![None; sub.prompt.len()]),
            sub,
            hold,
            detok,
            stop_scan,
            last_token: None,
            max_new: usize::MAX,
            stop_reason: None,
        }
    }

    /// The tokens it may still generate.
    pub(super) fn tokens_left(&self) -> usize {
        self.max_new.saturating_sub(self.sampler.num_generated)
    }

    /// Whether its sampled row this step may be picked on the device: one logit row (no prompt
    /// logprobs), no grammar, and a greedy pick of the raw row ([`SamplerState::greedy_raw`]).
    pub(super) fn picks_on_device(&self, s: &ScheduledRequest) -> bool {
        s.sample && s.logits == LogitsWanted::Last && self.guide.is_none() && self.sampler.greedy_raw(&self.sub.params)
    }

    /// Prompt logprobs and sampling for this request's share of a step (`rows`: its logit rows,
    /// raw again when it returns; `on_device`: the pick the device made of its sampled row, which
    /// then came back empty): computation on the request's own state alone, so the step runs it
    /// for its requests side by side on the pool's threads.
    pub(super) fn compute(
        &mut self,
        s: &ScheduledRequest,
        rows: &mut [Vec<f32>],
        on_device: Option<GreedyPick>,
    ) -> Computed {
        let mut out = Computed::default();
        if s.logits == LogitsWanted::AllPrompt
            && let Some(entries) = self.prompt_lp.as_mut()
        {
            let k = self.sub.params.prompt_logprobs.unwrap_or(0);
            for (j, r) in rows.iter().enumerate() {
                let target = s.num_computed_tokens + j + 1;
                if target < s.num_prompt_tokens && entries[target].is_none() {
                    entries[target] = Some(prompt_logprob(r, self.sub.prompt[target], k));
                }
            }
            if s.num_computed_tokens + s.token_ids.len() >= s.num_prompt_tokens {
                out.prompt_logprobs = self.prompt_lp.take();
            }
        }
        if s.sample
            && let Some(raw) = rows.last_mut()
        {
            let left = self.tokens_left();
            let params = &self.sub.params;
            let picked = match (self.guide.as_mut(), on_device) {
                // Only rows `picks_on_device` allowed: greedy on the raw row, no top logprobs.
                (None, Some(p)) => {
                    Picked { token: p.token, logprob: params.logprobs.map(|_| p.logprob), top_logprobs: Vec::new() }
                }
                (None, None) => self.sampler.pick(raw, params, None),
                (Some(g), _) => match pick_guided(&mut self.sampler, g, raw, params, left) {
                    Ok(p) => p,
                    Err(e) => {
                        out.error = Some(e);
                        return out;
                    }
                },
            };
            self.sampler.push(picked.token);
            let room = self.tokens_left();
            if let Some(g) = self.guide.as_mut()
                && !self.sampler.is_stop(picked.token)
            {
                match g.accept(picked.token, room) {
                    Ok(mut accepted) => {
                        // A forced stop token ends the request there.
                        if let Some(at) = accepted.forced.iter().position(|&t| self.sampler.is_stop(t)) {
                            accepted.forced.truncate(at + 1);
                        }
                        for &t in &accepted.forced {
                            self.sampler.push(t);
                        }
                        out.accepted = accepted;
                    }
                    Err(e) => out.error = Some(e),
                }
            }
            out.picked = Some(picked);
        }
        out
    }

    /// The events and the scheduler's result of what [`Live::compute`] gave (on the loop's
    /// thread: metrics, detokenization, stop strings).
    pub(super) fn deliver(
        &mut self,
        s: &ScheduledRequest,
        computed: Computed,
        tokenizer: Option<&Tokenizer>,
        counters: &mut Counters,
        events: &mut Vec<(u64, Event)>,
    ) -> Option<RequestResult> {
        let live = self;
        if let Some(entries) = computed.prompt_logprobs {
            events.push((s.id, Event::PromptLogprobs(entries)));
        }
        let Picked { token, logprob, top_logprobs } = computed.picked?;
        let now = Instant::now();
        match live.last_token {
            None => counters.ttft.observe(now - live.sub.arrived),
            Some(t) => counters.itl.observe(now - t),
        }
        live.last_token = Some(now);
        let Accepted { mut forced, stopped } = computed.accepted;
        // The sampled token, then those its grammar forced: each streamed as generated.
        let count = 1 + forced.len();
        let first_generated = live.sampler.num_generated + 1 - count;
        let mut finish = None;
        let mut delivered = 0;
        for (i, (id, logprob, top_logprobs)) in std::iter::once((token, logprob, top_logprobs))
            .chain(forced.iter().map(|&t| (t, None, Vec::new())))
            .enumerate()
        {
            counters.generation_tokens += 1;
            counters.adapter(&live.sub.model).generation_tokens += 1;
            // A stop token that ends the request adds no text (as vLLM: an end-of-sequence
            // token's text would reach the reply when special tokens are not skipped).
            let mut delta = match (&mut live.detok, tokenizer) {
                (Some(d), Some(t)) if !live.sampler.is_stop(id) => d.push(t, id),
                _ => String::new(),
            };
            live.stop_reason = live.sub.params.stop_token_ids.contains(&id).then_some(StopReason::Token(id));
            delivered = i + 1;
            let last_one = i + 1 == count;
            if let Some(scan) = live.stop_scan.as_mut() {
                let last = live.sampler.is_stop(id) || first_generated + i >= live.max_new || (last_one && stopped);
                let (sent, found) = scan.push(&delta, last);
                if let Some(s) = found {
                    live.stop_reason = Some(StopReason::String(s.to_string()));
                    finish = Some(FinishReason::Stop);
                }
                delta = sent;
            }
            events.push((s.id, Event::Token { id, text_delta: delta, logprob, top_logprobs }));
            if finish.is_some() {
                break;
            }
        }
        forced.truncate(delivered - 1);
        if stopped && finish.is_none() {
            // The grammar is complete and cannot go on: the request ends as if it sampled EOS.
            finish = Some(FinishReason::Stop);
        }
        let by_string = matches!(live.stop_reason, Some(StopReason::String(_)));
        let ended = stopped || live.sampler.is_stop(token);
        if live.guide.as_ref().is_some_and(Guide::closing) && ended && !by_string {
            // Its budget, not the model, ended it: the grammar was closed for want of tokens.
            finish = Some(FinishReason::Length);
        }
        Some(RequestResult { id: s.id, token: Some(token), forced, finish })
    }
}

/// A constrained row's token: the one drawn from its whole row when it may try first and the
/// grammar allows it, else one drawn under the mask (see [`Guide`]).
fn pick_guided(
    sampler: &mut SamplerState,
    guide: &mut Guide,
    raw: &mut [f32],
    params: &SamplingParams,
    left: usize,
) -> Result<Picked, String> {
    if guide.tries_first(left) {
        let first = sampler.pick(raw, params, None);
        if guide.allows(first.token)? {
            return Ok(first);
        }
    }
    guide.prepare(left)?;
    Ok(sampler.pick(raw, params, guide.mask()))
}

/// What [`Live::compute`] gave for one request in one step.
#[derive(Debug, Default)]
pub(super) struct Computed {
    /// Every prompt position's logprobs, once the prompt's last chunk has run.
    prompt_logprobs: Option<Vec<Option<PromptLogprob>>>,
    /// The sampled token, when the request sampled this step.
    picked: Option<Picked>,
    /// What its grammar made of it.
    accepted: Accepted,
    /// Its grammar failed (a mask past its bound): the request fails.
    pub(super) error: Option<String>,
}

/// The tokens that end a request: its `stop_token_ids`, plus EOS unless `ignore_eos`.
pub(super) fn stop_ids(p: &SamplingParams, eos: &[u32]) -> Vec<u32> {
    let mut ids = p.stop_token_ids.clone();
    if !p.ignore_eos {
        ids.extend(eos.iter().copied());
    }
    ids
}
