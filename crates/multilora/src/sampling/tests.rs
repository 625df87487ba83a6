//! The sampler against slow references: the distribution of seeded draws against the softmax
//! and its truncations computed by a full sort in f64 (the sampler's own code not used), the
//! logprobs against a plain log-softmax, the processors against vLLM's rules.

use multilora_types::SplitMix64;

use super::*;

/// The probabilities the filters leave, by the textbook recipe: softmax at temperature `t` in
/// f64, the full ranking (larger first, lower id on ties), top-k, top-p's shortest reaching
/// prefix, min-p relative to the best; renormalised.
fn reference(x: &[f32], p: &SamplingParams) -> Vec<f64> {
    let t = p.temperature as f64;
    let max = x.iter().copied().filter(|v| v.is_finite()).fold(f64::NEG_INFINITY, |m, v| m.max(v as f64));
    let mut order: Vec<usize> = (0..x.len()).filter(|&i| x[i].is_finite()).collect();
    order.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    if p.top_k > 0 {
        order.truncate(p.top_k as usize);
    }
    let w = |i: usize| ((x[i] as f64 - max) / t).exp();
    let total: f64 = order.iter().map(|&i| w(i)).sum();
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        let keep = order.iter().position(|&i| {
            acc += w(i) / total;
            acc >= p.top_p as f64
        });
        order.truncate(keep.map_or(order.len(), |k| k + 1));
    }
    order.retain(|&i| w(i) >= p.min_p as f64);
    let mass: f64 = order.iter().map(|&i| w(i)).sum();
    let mut probs = vec![0.0; x.len()];
    for i in order {
        probs[i] = w(i) / mass;
    }
    probs
}

/// Logits with a long tail over `n` ids (several of the draw's runs), a few ties and a masked
/// entry.
fn logits(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    let mut x: Vec<f32> = (0..n).map(|_| (rng.gaussian() * 2.0) as f32).collect();
    x[n / 3] = x[n / 5];
    x[7] = f32::NEG_INFINITY;
    x
}

/// 100k seeded draws per setting: Pearson's χ² of the counts against the reference stays within
/// six standard deviations of its mean (degrees of freedom − 1), and no token the filters remove
/// is ever drawn. A wrong temperature, an off-by-one in top-k or top-p, or a min-p on the wrong
/// scale moves χ² by orders of magnitude.
#[test]
fn draws_follow_the_softmax_and_its_truncations() {
    let x = logits(3000, 1);
    let settings = [
        SamplingParams::default(),
        SamplingParams { temperature: 0.8, ..SamplingParams::default() },
        SamplingParams { temperature: 2.0, min_p: 0.05, ..SamplingParams::default() },
        SamplingParams { temperature: 0.8, top_k: 40, ..SamplingParams::default() },
        SamplingParams { temperature: 1.5, top_p: 0.9, ..SamplingParams::default() },
        SamplingParams { temperature: 0.7, top_k: 500, top_p: 0.95, min_p: 0.01, ..SamplingParams::default() },
    ];
    const DRAWS: usize = 100_000;
    for (n, p) in settings.iter().enumerate() {
        let want = reference(&x, p);
        let mut counts = vec![0usize; x.len()];
        let mut s = SamplerState::new(n as u64, &[], vec![], p);
        let mut row = x.clone();
        for _ in 0..DRAWS {
            counts[s.sample(&mut row, p) as usize] += 1;
        }
        assert_eq!(row, x, "the row is raw again");
        let mut chi2 = 0.0;
        let mut dof = 0usize;
        for (i, (&c, &q)) in counts.iter().zip(&want).enumerate() {
            if q == 0.0 {
                assert_eq!(c, 0, "setting {n}: token {i} is filtered out but was drawn");
                continue;
            }
            let e = q * DRAWS as f64;
            chi2 += (c as f64 - e).powi(2) / e;
            dof += 1;
        }
        let df = (dof - 1).max(1) as f64;
        assert!(chi2 < df + 6.0 * (2.0 * df).sqrt(), "setting {n}: χ² {chi2:.1} over {df} degrees of freedom");
    }
}

/// The same seed gives the same tokens; filters keep to their tokens; greedy masks stop ids
/// before `min_tokens`.
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

/// Rows the draw cannot weigh: +∞ gives its first +∞, a row of NaN / −∞ its first −∞ (the
/// argmax), a temperature whose inverse overflows the argmax.
#[test]
fn degenerate_rows_fall_back_to_the_argmax() {
    let p = SamplingParams::default();
    let mut s = SamplerState::new(0, &[], vec![], &p);
    assert_eq!(s.sample(&mut [1.0, f32::INFINITY, 2.0, f32::INFINITY], &p), 1);
    assert_eq!(s.sample(&mut [f32::NAN, f32::NEG_INFINITY, f32::NAN], &p), 1);
    let tiny = SamplingParams { temperature: 1e-45, ..SamplingParams::default() };
    assert_eq!(s.sample(&mut [1.0, 3.0, 2.0, 3.0], &tiny), 1);
    let top_p = SamplingParams { top_p: 0.5, ..SamplingParams::default() };
    assert_eq!(s.sample(&mut [f32::NAN, 4.0, f32::NEG_INFINITY], &top_p), 1);
}

/// Logprobs of the raw logits (not the processed ones) against a plain f64 log-softmax; the top
/// alternatives best first, lower id on ties.
#[test]
fn logprobs_are_the_raw_log_softmax() {
    let x = logits(5000, 2);
    let max = x.iter().copied().filter(|v| v.is_finite()).fold(f64::NEG_INFINITY, |m, v| m.max(v as f64));
    let lse = max + x.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
    let lp = |i: usize| x[i] as f64 - lse;
    let p = SamplingParams {
        temperature: 0.0,
        logprobs: Some(5),
        repetition_penalty: 1.5,
        logit_bias: [(3, 100.0)].into_iter().collect(),
        ..SamplingParams::default()
    };
    let mut s = SamplerState::new(0, &[3, 4], vec![], &p);
    let mut row = x.clone();
    let got = s.pick(&mut row, &p, None);
    assert_eq!(got.token, 3, "the bias decides the token");
    assert_eq!(row, x);
    assert!((got.logprob.expect("asked") as f64 - lp(3)).abs() < 1e-5);
    let mut order: Vec<usize> = (0..x.len()).filter(|&i| x[i].is_finite()).collect();
    order.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    assert_eq!(got.top_logprobs.iter().map(|t| t.0 as usize).collect::<Vec<_>>(), order[..5].to_vec());
    for &(i, l) in &got.top_logprobs {
        assert!((l as f64 - lp(i as usize)).abs() < 1e-5, "{i}: {l} vs {}", lp(i as usize));
    }
    let entry = prompt_logprob(&x, 42, 2);
    assert!((entry.logprob as f64 - lp(42)).abs() < 1e-5);
    assert_eq!(entry.top_logprobs.iter().map(|t| t.0 as usize).collect::<Vec<_>>(), order[..2].to_vec());
    let none = SamplingParams { logprobs: None, ..p };
    assert_eq!(s.pick(&mut row, &none, None).logprob, None);
}

/// The processors follow vLLM: the repetition penalty divides positive and multiplies negative
/// logits once per token seen (prompt or output), the frequency and presence penalties subtract.
#[test]
fn penalties_follow_vllm() {
    let processed = |s: &SamplerState, p: &SamplingParams, l: &[f32]| {
        let mut l = l.to_vec();
        let mut undo = Vec::new();
        s.process(&mut l, p, &mut undo);
        l
    };
    let p = SamplingParams { temperature: 0.0, repetition_penalty: 2.0, ..SamplingParams::default() };
    let mut s = SamplerState::new(0, &[0], vec![], &p);
    assert_eq!(s.sample(&mut [4.0, 3.0, -1.0], &p), 1);
    assert_eq!(processed(&s, &p, &[4.0, 3.0, -1.0]), vec![2.0, 3.0, -1.0]);
    // A token in both the prompt and the output is penalized once, as vLLM does.
    s.push(0);
    s.push(2);
    assert_eq!(processed(&s, &p, &[4.0, 3.0, -1.0]), vec![2.0, 3.0, -2.0]);
    let p = SamplingParams { repetition_penalty: 1.0, frequency_penalty: 1.0, presence_penalty: 0.5, ..p };
    let mut s = SamplerState::new(0, &[], vec![], &p);
    s.push(0);
    s.push(0);
    assert_eq!(processed(&s, &p, &[4.0, 3.0])[0], 4.0 - 2.0 - 0.5);
    // Undone in reverse, so a token changed twice gets its raw value back.
    let p = SamplingParams { logit_bias: [(0, 1.0)].into_iter().collect(), ..p };
    let mut row = [4.0, 3.0];
    s.sample(&mut row, &p);
    assert_eq!(row, [4.0, 3.0]);
}

/// What a pick on the device may stand in for (`greedy_raw`): exactly the settings whose host pick
/// is the raw row's first argmax with the raw logprob and no alternatives. Every processor, a
/// temperature, top logprobs, or `min_tokens` with stop tokens to mask rules it out.
#[test]
fn greedy_raw_is_the_raw_argmax_and_nothing_else() {
    let x = logits(3000, 9);
    let max = x.iter().copied().filter(|v| v.is_finite()).fold(f64::NEG_INFINITY, |m, v| m.max(v as f64));
    let lse = max + x.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
    let greedy = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
    let allowed = [
        greedy.clone(),
        SamplingParams { logprobs: Some(0), ..greedy.clone() },
        SamplingParams { min_tokens: 3, ..greedy.clone() },
        SamplingParams { top_k: 5, top_p: 0.5, ..greedy.clone() },
    ];
    for (i, p) in allowed.iter().enumerate() {
        // `min_tokens` with no stop token to mask changes nothing.
        let mut s = SamplerState::new(1, &[1, 2], vec![], p);
        assert!(s.greedy_raw(p), "case {i}");
        let mut row = x.clone();
        let got = s.pick(&mut row, p, None);
        assert_eq!(got.token as usize, multilora_cpu::logits::argmax(&x), "case {i}");
        assert!(got.top_logprobs.is_empty(), "case {i}");
        if let Some(lp) = got.logprob {
            assert!((lp as f64 - (x[got.token as usize] as f64 - lse)).abs() < 1e-5, "case {i}");
        }
    }
    let ruled_out = [
        SamplingParams { temperature: 0.7, ..greedy.clone() },
        SamplingParams { logprobs: Some(1), ..greedy.clone() },
        SamplingParams { repetition_penalty: 1.1, ..greedy.clone() },
        SamplingParams { frequency_penalty: 0.5, ..greedy.clone() },
        SamplingParams { presence_penalty: -0.5, ..greedy.clone() },
        SamplingParams { logit_bias: [(4, 1.0)].into_iter().collect(), ..greedy.clone() },
    ];
    for (i, p) in ruled_out.iter().enumerate() {
        assert!(!SamplerState::new(1, &[1, 2], vec![], p).greedy_raw(p), "case {i}");
    }
    // `min_tokens` masking a stop token: ruled out until that many tokens were generated.
    let p = SamplingParams { min_tokens: 2, ..greedy };
    let mut s = SamplerState::new(1, &[1, 2], vec![0], &p);
    assert!(!s.greedy_raw(&p));
    s.push(5);
    assert!(!s.greedy_raw(&p));
    s.push(6);
    assert!(s.greedy_raw(&p));
}
