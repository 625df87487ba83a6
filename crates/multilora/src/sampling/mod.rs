//! Token selection per request: logit processors in vLLM's order (logit bias, `min_tokens`
//! masking of stop tokens, repetition / frequency / presence penalties), then greedy or
//! temperature → top-k → top-p → min-p sampling with the request's own generator, and log
//! probabilities of the raw logits (as vLLM reports them, before any processing).
//!
//! Every row costs O(vocabulary) whatever the settings (`draw.rs`; the best-ranked entries by
//! `select.rs`): no sort of the vocabulary, no vocabulary-sized allocation per token (each thread
//! keeps its buffers), and the processors change the row in place and put back what they changed,
//! so the logprobs read the raw logits afterwards. Rows of one step are independent: the engine
//! samples them on its pool's threads.

mod draw;
mod select;

use std::cell::RefCell;
use std::collections::HashMap;

use multilora_types::SplitMix64;

use llguidance::toktrie::SimpleVob;

use crate::request::{PromptLogprob, SamplingParams};
pub(crate) use draw::Filters;
use draw::{Scratch, draw, weigh_row};
use select::{argmax, rank, top};

thread_local! {
    /// Each sampling thread's buffers.
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// A row's log-sum-exp in f64 (from its weights summed by runs) and its `n` most likely tokens
/// with their log probabilities, best first (lower id on ties).
fn log_softmax_head(x: &[f32], n: usize, s: &mut Scratch) -> (f64, Vec<(u32, f32)>) {
    let max = row_max_f64(x);
    let lse = if max.is_finite() { max + weigh_row(x, max as f32, 1.0, 0.0, s).ln() } else { max };
    let mut head = Vec::new();
    if n > 0 {
        top(x, n, &mut s.head);
        s.head.sort_unstable_by(rank);
        head = s.head.iter().map(|c| (c.id, (c.x as f64 - lse) as f32)).collect();
    }
    (lse, head)
}

fn row_max_f64(x: &[f32]) -> f64 {
    multilora_cpu::logits::row_max(x) as f64
}

/// A prompt position's logprob entry: `token`'s log probability under the raw `row` and the
/// row's `n` most likely tokens.
pub(crate) fn prompt_logprob(row: &[f32], token: u32, n: usize) -> PromptLogprob {
    SCRATCH.with_borrow_mut(|s| {
        let (lse, top_logprobs) = log_softmax_head(row, n, s);
        let x = row.get(token as usize).copied().unwrap_or(f32::NEG_INFINITY);
        let logprob = (x as f64 - lse) as f32;
        let rank = 1 + row.iter().filter(|&&y| y > x).count();
        PromptLogprob { token, logprob, rank, top_logprobs }
    })
}

/// What sampling one row gave.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Picked {
    pub(crate) token: u32,
    /// Its log probability under the raw logits, when logprobs were asked for.
    pub(crate) logprob: Option<f32>,
    /// The asked-for number of most likely tokens, best first.
    pub(crate) top_logprobs: Vec<(u32, f32)>,
}

/// What sampling needs to remember about one request.
#[derive(Debug)]
pub(crate) struct SamplerState {
    /// The request's own generator, so a seeded request gives the same tokens whatever else runs
    /// beside it.
    rng: SplitMix64,
    /// Tokens of the prompt (for the repetition penalty).
    prompt_tokens: Vec<u32>,
    /// How often each token was generated (frequency / presence / repetition penalties).
    output_counts: HashMap<u32, u32>,
    /// Tokens generated so far.
    pub(crate) num_generated: usize,
    /// EOS ids and `stop_token_ids`: masked while fewer than `min_tokens` are generated.
    stop_ids: Vec<u32>,
    /// The logits the processors changed, with their raw values, put back after the draw (kept
    /// from token to token).
    undo: Vec<(usize, f32)>,
}

impl SamplerState {
    pub(crate) fn new(seed: u64, prompt: &[u32], stop_ids: Vec<u32>, params: &SamplingParams) -> SamplerState {
        let mut prompt_tokens = Vec::new();
        if params.repetition_penalty != 1.0 {
            prompt_tokens = prompt.to_vec();
            prompt_tokens.sort_unstable();
            prompt_tokens.dedup();
        }
        SamplerState {
            rng: SplitMix64::new(seed),
            prompt_tokens,
            output_counts: HashMap::new(),
            num_generated: 0,
            stop_ids,
            undo: Vec::new(),
        }
    }

    /// Whether `token` ends the request (EOS unless ignored, or one of `stop_token_ids`).
    pub(crate) fn is_stop(&self, token: u32) -> bool {
        self.stop_ids.contains(&token)
    }

    /// Whether the next pick under `p` is the raw row's greedy pick with at most its own logprob:
    /// temperature 0, no processor that would change the row (no logit bias, no penalties,
    /// `min_tokens` met or no stop token to mask) and no top logprobs asked for. Such a pick
    /// can be made where the logits are (the device) and only it brought back.
    pub(crate) fn greedy_raw(&self, p: &SamplingParams) -> bool {
        p.temperature == 0.0
            && p.logit_bias.is_empty()
            && p.repetition_penalty == 1.0
            && p.frequency_penalty == 0.0
            && p.presence_penalty == 0.0
            && (self.num_generated >= p.min_tokens || self.stop_ids.is_empty())
            && p.logprobs.is_none_or(|n| n == 0)
    }

    /// Records a generated token.
    pub(crate) fn push(&mut self, token: u32) {
        *self.output_counts.entry(token).or_default() += 1;
        self.num_generated += 1;
    }

    /// Picks the next token from the raw `logits` (changed while it runs, raw again when it
    /// returns), with its logprob and the top alternatives when `p.logprobs` asks for them;
    /// among the tokens `mask` allows, when the request is constrained.
    pub(crate) fn pick(&mut self, logits: &mut [f32], p: &SamplingParams, mask: Option<&SimpleVob>) -> Picked {
        SCRATCH.with_borrow_mut(|s| {
            let lp = p.logprobs.map(|n| log_softmax_head(logits, n, s));
            let token = match mask {
                None => self.sample_with(logits, p, s),
                Some(mask) => self.sample_masked(logits, p, mask, s),
            };
            let (logprob, top_logprobs) = match lp {
                Some((lse, top)) => (Some((logits[token as usize] as f64 - lse) as f32), top),
                None => (None, Vec::new()),
            };
            Picked { token, logprob, top_logprobs }
        })
    }

    /// Picks the next token from the raw `logits` (raw again when it returns).
    #[cfg(test)]
    pub(crate) fn sample(&mut self, logits: &mut [f32], p: &SamplingParams) -> u32 {
        SCRATCH.with_borrow_mut(|s| self.sample_with(logits, p, s))
    }

    fn sample_with(&mut self, logits: &mut [f32], p: &SamplingParams, s: &mut Scratch) -> u32 {
        let mut undo = std::mem::take(&mut self.undo);
        self.process(logits, p, &mut undo);
        let token = if p.temperature == 0.0 {
            argmax(logits)
        } else {
            let top_k = usize::try_from(p.top_k).unwrap_or(0);
            let f = Filters { temperature: p.temperature, top_k, top_p: p.top_p, min_p: p.min_p };
            draw(logits, &f, self.rng.next_f64(), s)
        };
        for &(i, x) in undo.iter().rev() {
            logits[i] = x;
        }
        undo.clear();
        self.undo = undo;
        token
    }

    /// [`SamplerState::sample_with`] over a copy of `logits` in which every token `mask`
    /// disallows is -∞ (logprobs stay those of the raw row). When the processors leave no allowed
    /// token a finite logit (`min_tokens` masking the end-of-sequence a finished grammar
    /// allows alone), the grammar wins: its best allowed token by the raw logits.
    fn sample_masked(&mut self, logits: &[f32], p: &SamplingParams, mask: &SimpleVob, s: &mut Scratch) -> u32 {
        let mut masked = std::mem::take(&mut s.masked);
        masked.clear();
        masked.extend_from_slice(logits);
        let words = mask.as_slice();
        for (i, chunk) in masked.chunks_mut(32).enumerate() {
            let word = words.get(i).copied().unwrap_or(0);
            if word == u32::MAX {
                continue;
            }
            for (bit, x) in chunk.iter_mut().enumerate() {
                if word & (1 << bit) == 0 {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        let mut token = self.sample_with(&mut masked, p, s);
        if !mask.is_allowed(token) {
            // `masked` is back to the raw row under the mask: its best allowed token.
            let best = argmax(&masked);
            token = if mask.is_allowed(best) { best } else { mask.first_bit_set().map_or(token, |t| t as u32) };
        }
        s.masked = masked;
        token
    }

    /// The logit processors, in place; every changed entry's raw value goes to `undo` first.
    fn process(&self, logits: &mut [f32], p: &SamplingParams, undo: &mut Vec<(usize, f32)>) {
        let mut change = |t: u32, f: &dyn Fn(f32) -> f32| {
            if let Some(x) = logits.get_mut(t as usize) {
                undo.push((t as usize, *x));
                *x = f(*x);
            }
        };
        for (&t, &b) in &p.logit_bias {
            change(t, &|x| x + b);
        }
        if self.num_generated < p.min_tokens {
            for &t in &self.stop_ids {
                change(t, &|_| f32::NEG_INFINITY);
            }
        }
        if p.repetition_penalty != 1.0 {
            let r = p.repetition_penalty;
            // Once per token seen, in the prompt or the output (vLLM's mask), not once for each.
            let prompt = &self.prompt_tokens;
            let outputs = self.output_counts.keys().copied().filter(|t| prompt.binary_search(t).is_err());
            for t in prompt.iter().copied().chain(outputs) {
                change(t, &|x| if x > 0.0 { x / r } else { x * r });
            }
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            for (&t, &c) in &self.output_counts {
                change(t, &|x| x - (p.frequency_penalty * c as f32 + p.presence_penalty));
            }
        }
    }
}

#[cfg(test)]
mod tests;
