//! Token selection per request: logit processors in vLLM's order (logit bias, `min_tokens`
//! masking of stop tokens, repetition / frequency / presence penalties), then greedy or
//! temperature → top-k → top-p → min-p sampling with the request's own generator, and log
//! probabilities of the raw logits (as vLLM reports them, before any processing).

use std::collections::HashMap;

use multilora_types::SplitMix64;

use crate::request::SamplingParams;

/// Log-softmax of `logits`, accumulated in f64 so small probabilities keep their precision.
pub(crate) fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    logits.iter().map(|&x| (x as f64 - lse) as f32).collect()
}

/// The `n` largest entries of `logprobs`, best first (lowest id on ties).
pub(crate) fn top_n(logprobs: &[f32], n: usize) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let mut idx: Vec<u32> = (0..logprobs.len() as u32).collect();
    let cmp = |a: &u32, b: &u32| logprobs[*b as usize].total_cmp(&logprobs[*a as usize]).then(a.cmp(b));
    if n < idx.len() {
        idx.select_nth_unstable_by(n - 1, cmp);
        idx.truncate(n);
    }
    idx.sort_by(cmp);
    idx.into_iter().map(|i| (i, logprobs[i as usize])).collect()
}

/// The first index of the largest value.
pub(crate) fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
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
        }
    }

    /// Records a generated token.
    /// Whether `token` ends the request (EOS unless ignored, or one of `stop_token_ids`).
    pub(crate) fn is_stop(&self, token: u32) -> bool {
        self.stop_ids.contains(&token)
    }

    pub(crate) fn push(&mut self, token: u32) {
        *self.output_counts.entry(token).or_default() += 1;
        self.num_generated += 1;
    }

    /// Picks the next token from raw `logits` (modified in place).
    pub(crate) fn sample(&mut self, logits: &mut [f32], p: &SamplingParams) -> u32 {
        for (&t, &b) in &p.logit_bias {
            if let Some(x) = logits.get_mut(t as usize) {
                *x += b;
            }
        }
        if self.num_generated < p.min_tokens {
            for &t in &self.stop_ids {
                if let Some(x) = logits.get_mut(t as usize) {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        if p.repetition_penalty != 1.0 {
            let r = p.repetition_penalty;
            // Once per token seen, in the prompt or the output (vLLM's mask), not once for each.
            let prompt = &self.prompt_tokens;
            let outputs = self.output_counts.keys().copied().filter(|t| prompt.binary_search(t).is_err());
            let seen = prompt.iter().copied().chain(outputs);
            for t in seen {
                if let Some(x) = logits.get_mut(t as usize) {
                    *x = if *x > 0.0 { *x / r } else { *x * r };
                }
            }
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            for (&t, &c) in &self.output_counts {
                if let Some(x) = logits.get_mut(t as usize) {
                    *x -= p.frequency_penalty * c as f32 + p.presence_penalty;
                }
            }
        }
        if p.temperature == 0.0 {
            return argmax(logits);
        }
        self.sample_random(logits, p)
    }

    fn sample_random(&mut self, logits: &[f32], p: &SamplingParams) -> u32 {
        let t = p.temperature as f64;
        let cand: Vec<(u32, f64)> =
            logits.iter().enumerate().filter(|(_, x)| x.is_finite()).map(|(i, &x)| (i as u32, x as f64 / t)).collect();
        if cand.is_empty() {
            return argmax(logits);
        }
        // Candidates best first, sorted only as far as the filters and the draw look: a token
        // costs O(vocabulary) plus the sort of the head actually walked, not a full sort.
        let mut c = Ranked::new(cand);
        if p.top_k > 0 {
            c.truncate(p.top_k as usize);
        }
        let max = c.get(0).1;
        let total: f64 = c.cand.iter().map(|x| (x.1 - max).exp()).sum();
        let prob = |c: &mut Ranked, i: usize| (c.get(i).1 - max).exp() / total;
        let n = c.cand.len();
        let mut keep = n;
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for i in 0..n {
                acc += prob(&mut c, i);
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = prob(&mut c, 0) * p.min_p as f64;
            let above = (0..keep).take_while(|&i| prob(&mut c, i) >= floor).count();
            keep = keep.min(above.max(1));
        }
        let mass: f64 = (0..keep).map(|i| prob(&mut c, i)).sum();
        let mut u = self.rng.next_f64() * mass;
        for i in 0..keep {
            u -= prob(&mut c, i);
            if u <= 0.0 {
                return c.get(i).0;
            }
        }
        c.get(keep - 1).0
    }
}

/// Candidates `(token, logit / temperature)` ranked best first (ties: lower id first), sorted
/// lazily in chunks: everything before `sorted` is in order and no later entry ranks above it.
struct Ranked {
    cand: Vec<(u32, f64)>,
    sorted: usize,
}

/// How many more candidates are put in order when the walk reaches the end of the sorted head.
const RANK_CHUNK: usize = 256;

fn rank(a: &(u32, f64), b: &(u32, f64)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

impl Ranked {
    fn new(cand: Vec<(u32, f64)>) -> Ranked {
        Ranked { cand, sorted: 0 }
    }

    /// Keeps the best `k`.
    fn truncate(&mut self, k: usize) {
        if k < self.cand.len() {
            self.cand.select_nth_unstable_by(k, rank);
            self.cand.truncate(k);
            self.sorted = 0;
        }
    }

    /// The candidate of rank `i` (`i` < len).
    fn get(&mut self, i: usize) -> (u32, f64) {
        if i >= self.sorted {
            let upto = (i + 1).max(self.sorted + RANK_CHUNK).min(self.cand.len());
            let rest = &mut self.cand[self.sorted..];
            let take = upto - self.sorted;
            if take < rest.len() {
                rest.select_nth_unstable_by(take - 1, rank);
            }
            rest[..take].sort_by(rank);
            self.sorted = upto;
        }
        self.cand[i]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_normalizes_and_top_n_orders() {
        let lp = log_softmax(&[1.0, 3.0, 2.0, 3.0]);
        let total: f64 = lp.iter().map(|&x| (x as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert_eq!(top_n(&lp, 2).iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3]);
        assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]), 1);
    }

    #[test]
    fn the_lazy_ranking_is_the_full_sort() {
        let mut rng = SplitMix64::new(7);
        // Ties on purpose: values from a small set.
        let cand: Vec<(u32, f64)> = (0..5000).map(|i| (i, (rng.next_f64() * 40.0).floor())).collect();
        let mut full = cand.clone();
        full.sort_by(rank);
        let mut lazy = Ranked::new(cand.clone());
        // Read out of order: a deep rank first, then from the start.
        assert_eq!(lazy.get(1234), full[1234]);
        for (i, want) in full.iter().enumerate() {
            assert_eq!(lazy.get(i), *want, "rank {i}");
        }
        let mut top = Ranked::new(cand);
        top.truncate(300);
        assert_eq!((0..300).map(|i| top.get(i)).collect::<Vec<_>>(), full[..300].to_vec());
    }

    #[test]
    fn seeded_sampling_repeats_and_filters_apply() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let p = SamplingParams { top_k: 5, ..SamplingParams::default() };
        let run = |seed| {
            let mut s = SamplerState::new(seed, &[], vec![], &p);
            (0..20).map(|_| s.sample(&mut logits.clone(), &p)).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        // top_k 5 keeps ids with the largest logit (6 mod 7): 6, 13, 20, 27, 34.
        assert!(run(3).iter().all(|t| [6, 13, 20, 27, 34].contains(t)));
        let greedy = SamplingParams { temperature: 0.0, min_tokens: 1, ..SamplingParams::default() };
        let mut s = SamplerState::new(0, &[], vec![6], &greedy);
        assert_eq!(s.sample(&mut logits.clone(), &greedy), 13, "stop id 6 is masked before min_tokens");
    }

    #[test]
    fn penalties_follow_vllm() {
        let p = SamplingParams { temperature: 0.0, repetition_penalty: 2.0, ..SamplingParams::default() };
        let mut s = SamplerState::new(0, &[0], vec![], &p);
        let mut l = vec![4.0, 3.0, -1.0];
        assert_eq!(s.sample(&mut l, &p), 1);
        assert_eq!(l, vec![2.0, 3.0, -1.0]);
        // A token in both the prompt and the output is penalized once, as vLLM does.
        s.push(0);
        s.push(2);
        let mut l = vec![4.0, 3.0, -1.0];
        s.sample(&mut l, &p);
        assert_eq!(l, vec![2.0, 3.0, -2.0]);
        let p = SamplingParams { repetition_penalty: 1.0, frequency_penalty: 1.0, presence_penalty: 0.5, ..p };
        let mut s = SamplerState::new(0, &[], vec![], &p);
        s.push(0);
        s.push(0);
        let mut l = vec![4.0, 3.0];
        s.sample(&mut l, &p);
        assert_eq!(l[0], 4.0 - 2.0 - 0.5);
    }
}
