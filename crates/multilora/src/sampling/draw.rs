//! One token drawn from a row of logits in O(vocabulary), whatever the filters (temperature →
//! top-k → top-p → min-p, vLLM's order):
//! - no top-k and no top-p: every weight `exp((x − max) / T)` (min-p's cut applied in the same
//!   pass) with its sum per run of [`RUN`] entries, then one walk in id order that skips whole
//!   runs. The order of the walk does not change the distribution, so nothing is sorted.
//! - top-k: the `k` best by [`select::top`], weighed; top-p without top-k: heads of 64, 512, …
//!   best until one holds `top_p` of the row's mass. Top-p's nucleus is then found in that head
//!   by a weighted selection ([`nucleus`]), not a sort.
//!
//! The weights come from `multilora_cpu::logits`, the same bits on every instruction set, and
//! one uniform number decides the draw, so a seeded request draws the same tokens alone or in
//! any batch, on any CPU.

use multilora_cpu::logits::{exp_weights, row_max};

use super::select::{Cand, argmax, rank, top};

/// A draw's filters, as `SamplingParams` has them (checked there): `temperature` > 0, `top_k`
/// 0 for off, `top_p` in (0, 1], `min_p` in [0, 1].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Filters {
    pub(crate) temperature: f32,
    pub(crate) top_k: usize,
    pub(crate) top_p: f32,
    pub(crate) min_p: f32,
}

/// Entries whose weights are summed together, so that the walk of a draw skips whole runs and
/// the row's mass is a sum of f32 partial sums of at most this many weights each, in f64.
const RUN: usize = 2048;

/// The first head a top-p draw without top-k looks in; each retry looks in 8× more.
const FIRST_HEAD: usize = 64;

/// Buffers kept from draw to draw (one set per thread): nothing vocabulary-sized is allocated
/// per token once a thread has sampled its first row.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    /// The weights of a whole row.
    w: Vec<f32>,
    /// Their sums per run.
    runs: Vec<f32>,
    /// A head of candidates.
    pub(super) head: Vec<Cand>,
    /// The head's logits and weights, for one vector pass over them.
    vals: Vec<f32>,
    head_w: Vec<f32>,
    /// A constrained row: its logits with every token its grammar disallows at -∞.
    pub(super) masked: Vec<f32>,
}

/// The token drawn from `x` with uniform number `u` in [0, 1). A row whose largest logit is +∞
/// gives its first +∞; a row with no finite logit, or whose weights all vanish (a temperature so
/// small that `1 / T` overflows), gives its argmax, as greedy would.
pub(crate) fn draw(x: &[f32], f: &Filters, u: f64, s: &mut Scratch) -> u32 {
    let max = row_max(x);
    if !max.is_finite() {
        return argmax(x);
    }
    let scale = 1.0 / f.temperature;
    let k = if f.top_k > 0 && f.top_k < x.len() { f.top_k } else { 0 };
    let picked = if k == 0 && f.top_p >= 1.0 {
        whole_row(x, max, scale, f.min_p, u, s)
    } else {
        head(x, max, scale, k, f, u, s)
    };
    picked.unwrap_or_else(|| argmax(x))
}

/// The row's weights (with min-p's floor) into `s.w`, their sums per run into `s.runs`; the
/// total mass.
pub(super) fn weigh_row(x: &[f32], max: f32, scale: f32, floor: f32, s: &mut Scratch) -> f64 {
    s.w.resize(x.len(), 0.0);
    s.runs.clear();
    for (xc, wc) in x.chunks(RUN).zip(s.w.chunks_mut(RUN)) {
        s.runs.push(exp_weights(xc, wc, max, scale, floor));
    }
    s.runs.iter().map(|&r| r as f64).sum()
}

/// No top-k, no top-p: the walk in id order over the row's weights.
fn whole_row(x: &[f32], max: f32, scale: f32, floor: f32, u: f64, s: &mut Scratch) -> Option<u32> {
    let mass = weigh_row(x, max, scale, floor, s);
    if !(mass > 0.0 && mass.is_finite()) {
        return None;
    }
    let mut target = u * mass;
    for (r, &run) in s.runs.iter().enumerate() {
        if target >= run as f64 {
            target -= run as f64;
            continue;
        }
        let start = r * RUN;
        let mut last = None;
        for (j, &w) in s.w[start..(start + RUN).min(x.len())].iter().enumerate() {
            if w > 0.0 {
                last = Some((start + j) as u32);
                target -= w as f64;
                if target < 0.0 {
                    return last;
                }
            }
        }
        // The run's f32 sum was a little above its weights summed one by one.
        return last;
    }
    // Rounding at the row's end: its last token with weight.
    s.w.iter().rposition(|&w| w > 0.0).map(|i| i as u32)
}

/// Top-k and / or top-p: the draw in a head of the ranking.
fn head(x: &[f32], max: f32, scale: f32, k: usize, f: &Filters, u: f64, s: &mut Scratch) -> Option<u32> {
    let total = if k > 0 {
        top(x, k, &mut s.head);
        weigh_head(max, scale, s)
    } else {
        let total = weigh_row(x, max, scale, 0.0, s);
        let mut m = FIRST_HEAD;
        loop {
            top(x, m, &mut s.head);
            let mut mass = 0.0;
            for c in &mut s.head {
                c.w = s.w[c.id as usize];
                mass += c.w as f64;
            }
            // Fewer than asked: every finite logit is in.
            if mass >= f.top_p as f64 * total || s.head.len() < m {
                break;
            }
            m = m.saturating_mul(8);
        }
        total
    };
    if !(total > 0.0 && total.is_finite()) {
        return None;
    }
    let keep = if f.top_p < 1.0 { nucleus(&mut s.head, f.top_p as f64 * total) } else { s.head.len() };
    // Min-p relative to the largest weight, the row maximum's, which is 1 and always kept.
    let kept = s.head[..keep].iter().filter(|c| c.w > 0.0 && c.w >= f.min_p);
    let mass: f64 = kept.clone().map(|c| c.w as f64).sum();
    let mut target = u * mass;
    let mut last = None;
    for c in kept {
        last = Some(c.id);
        target -= c.w as f64;
        if target < 0.0 {
            break;
        }
    }
    last
}

/// The head's weights, in one vector pass over its gathered logits; their sum.
fn weigh_head(max: f32, scale: f32, s: &mut Scratch) -> f64 {
    s.vals.clear();
    s.vals.extend(s.head.iter().map(|c| c.x));
    s.head_w.resize(s.vals.len(), 0.0);
    exp_weights(&s.vals, &mut s.head_w, max, scale, 0.0);
    let mut total = 0.0;
    for (c, &w) in s.head.iter_mut().zip(&s.head_w) {
        c.w = w;
        total += w as f64;
    }
    total
}

/// Candidates at or below this many are sorted and walked rather than partitioned again.
const SMALL: usize = 32;

/// Reorders `c` so that its first `n` entries are the best-ranked ones whose weights first reach
/// `target` (the fewest that do: top-p's nucleus), and returns `n` (all of `c` when even all of
/// it falls short by rounding). A weighted quickselect: each round partitions the open range
/// around its median rank and keeps the side where the target is reached, so the cost is linear
/// in `c`'s length, not `n log n`.
pub(crate) fn nucleus(c: &mut [Cand], target: f64) -> usize {
    // Everything before `lo` is in, with mass `target − need`; the answer lies in `lo + 1..=hi`.
    let (mut lo, mut hi, mut need) = (0, c.len(), target);
    while hi - lo > SMALL {
        let seg = &mut c[lo..hi];
        let mid = seg.len() / 2;
        seg.select_nth_unstable_by(mid, rank);
        let upper: f64 = seg[..=mid].iter().map(|c| c.w as f64).sum();
        if upper >= need {
            hi = lo + mid + 1;
        } else {
            need -= upper;
            lo += mid + 1;
        }
    }
    c[lo..hi].sort_unstable_by(rank);
    let mut acc = 0.0;
    for (i, cand) in c[lo..hi].iter().enumerate() {
        acc += cand.w as f64;
        if acc >= need {
            return lo + i + 1;
        }
    }
    hi
}

#[cfg(test)]
mod tests {
    use multilora_types::SplitMix64;

    use super::*;

    /// The nucleus is the shortest prefix of the full ranking that reaches the target, with ties
    /// in the logits and targets on and around the prefix sums.
    #[test]
    fn nucleus_is_the_shortest_reaching_prefix() {
        let mut rng = SplitMix64::new(3);
        for len in [1, 5, 33, 200, 3000] {
            let mut c: Vec<Cand> = (0..len)
                .map(|i| {
                    let x = (rng.next_f64() * 12.0).floor() as f32;
                    Cand { x, id: i, w: (x as f64 - 12.0).exp() as f32 }
                })
                .collect();
            let mut sorted = c.clone();
            sorted.sort_by(rank);
            let total: f64 = sorted.iter().map(|c| c.w as f64).sum();
            for p in [1e-9, 0.1, 0.5, 0.9, 0.999, 1.0] {
                let target = p * total;
                let want = {
                    let mut acc = 0.0;
                    sorted.iter().position(|c| {
                        acc += c.w as f64;
                        acc >= target
                    })
                };
                let n = nucleus(&mut c, target);
                let mut got = c[..n].to_vec();
                got.sort_by(rank);
                match want {
                    // Summed in another order the boundary can move by one where a prefix sum
                    // meets the target within rounding.
                    Some(i) => {
                        assert!(got == sorted[..n] && n.abs_diff(i + 1) <= 1, "len {len} p {p}: {n} vs {}", i + 1)
                    }
                    None => assert!(n + 1 >= len as usize, "len {len} p {p}: {n}"),
                }
            }
        }
    }
}
