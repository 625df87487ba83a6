//! The live request table's entry: a request from submission to its end — its hold on its
//! adapter (`hold.rs`, dropped with it), its sampler, detokenizer and stop-string text, its
//! prompt logprobs — and what one step does for it (prompt logprobs, sampling, stop strings,
//! events).

use std::time::Instant;

use multilora_scheduler::{RequestResult, ScheduledRequest};
use multilora_types::LogitsWanted;
use tokenizers::Tokenizer;

use super::hold::Hold;
use crate::command::Submission;
use crate::detokenize::Detokenizer;
use crate::metrics::Counters;
use crate::request::{Event, FinishReason, PromptLogprob, SamplingParams};
use crate::sampling::{SamplerState, log_softmax, top_n};
use crate::stop::{StopScan, StopStrings};

/// A live request: deferred (waiting for its adapter) or in the scheduler.
#[derive(Debug)]
pub(super) struct Live {
    pub(super) sub: Submission,
    /// What it holds of its adapter, from `submit` on: dropped with the request, so a pin
    /// cannot outlive it.
    pub(super) hold: Hold,
    pub(super) sampler: SamplerState,
    pub(super) detok: Option<Detokenizer>,
    /// Where the scan of the generated text for stop strings stands.
    pub(super) stop_scan: Option<StopScan>,
    pub(super) prompt_lp: Option<Vec<Option<PromptLogprob>>>,
    pub(super) last_token: Option<Instant>,
    /// Most tokens it may generate (as the scheduler was told), so the last one is known when
    /// it is sampled and held-back text is sent with it.
    pub(super) max_new: usize,
}

impl Live {
    /// A request just submitted, holding what `submit` resolved its model to.
    pub(super) fn new(sub: Submission, hold: Hold, seed: u64, eos: &[u32], detokenize: bool) -> Live {
        let stop = stop_ids(&sub.params, eos);
        let detok = detokenize.then(|| Detokenizer::new(&sub.prompt, sub.params.skip_special_tokens));
        let stop_scan = sub.stops.as_ref().map(StopStrings::scanner);
        Live {
            sampler: SamplerState::new(seed, &sub.prompt, stop, &sub.params),
            prompt_lp: sub.params.prompt_logprobs.map(|_| vec![None; sub.prompt.len()]),
            sub,
            hold,
            detok,
            stop_scan,
            last_token: None,
            max_new: usize::MAX,
        }
    }

    /// Prompt logprobs and sampling for this request's share of a step (`rows`: its logit
    /// rows); the events go to `events`, the token to the scheduler through the result.
    pub(super) fn process(
        &mut self,
        s: &ScheduledRequest,
        rows: &[Vec<f32>],
        tokenizer: Option<&Tokenizer>,
        counters: &mut Counters,
        events: &mut Vec<(u64, Event)>,
    ) -> Option<RequestResult> {
        let live = self;
        if s.logits == LogitsWanted::AllPrompt
            && let Some(entries) = live.prompt_lp.as_mut()
        {
            let k = live.sub.params.prompt_logprobs.unwrap_or(0);
            for (j, r) in rows.iter().enumerate() {
                let target = s.num_computed_tokens + j + 1;
                if target < s.num_prompt_tokens && entries[target].is_none() {
                    let lp = log_softmax(r);
                    let token = live.sub.prompt[target];
                    entries[target] =
                        Some(PromptLogprob { token, logprob: lp[token as usize], top_logprobs: top_n(&lp, k) });
                }
            }
            if s.num_computed_tokens + s.token_ids.len() >= s.num_prompt_tokens
                && let Some(entries) = live.prompt_lp.take()
            {
                events.push((s.id, Event::PromptLogprobs(entries)));
            }
        }
        if !s.sample {
            return None;
        }
        let raw = rows.last()?;
        let params = &live.sub.params;
        let (logprob, top) = match params.logprobs {
            Some(k) => {
                let lp = log_softmax(raw);
                (Some(lp), k)
            }
            None => (None, 0),
        };
        let mut work = raw.clone();
        let token = live.sampler.sample(&mut work, params);
        live.sampler.push(token);
        let now = Instant::now();
        match live.last_token {
            None => counters.ttft.observe(now - live.sub.arrived),
            Some(t) => counters.itl.observe(now - t),
        }
        live.last_token = Some(now);
        counters.generation_tokens += 1;
        counters.adapter(&live.sub.model).generation_tokens += 1;
        let mut delta = match (&mut live.detok, tokenizer) {
            (Some(d), Some(t)) => d.push(t, token),
            _ => String::new(),
        };
        let mut finish = None;
        if let Some(scan) = live.stop_scan.as_mut() {
            let last = live.sampler.is_stop(token) || live.sampler.num_generated >= live.max_new;
            let (sent, stopped) = scan.push(&delta, last);
            delta = sent;
            if stopped {
                finish = Some(FinishReason::Stop);
            }
        }
        let (lp, top_logprobs) = match &logprob {
            Some(lp) => (Some(lp[token as usize]), top_n(lp, top)),
            None => (None, Vec::new()),
        };
        events.push((s.id, Event::Token { id: token, text_delta: delta, logprob: lp, top_logprobs }));
        Some(RequestResult { id: s.id, token: Some(token), finish })
    }
}

/// The tokens that end a request: its `stop_token_ids`, plus EOS unless `ignore_eos`.
pub(super) fn stop_ids(p: &SamplingParams, eos: &[u32]) -> Vec<u32> {
    let mut ids = p.stop_token_ids.clone();
    if !p.ignore_eos {
        ids.extend(eos.iter().copied());
    }
    ids
}
