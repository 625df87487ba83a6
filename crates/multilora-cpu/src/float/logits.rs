//! The sampler's passes over a row of logits (a vocabulary: 32k–262k entries): [`row_max`],
//! [`argmax`] and [`exp_weights`]. Each is written for the compiler to vectorise (16 lanes of
//! maxima, indexes or partial sums, then theirs) and compiled for each instruction set, picked at
//! run time; every operation is exact or elementwise and the sums keep a fixed number of partial
//! sums, so every instruction set gives the same bits. A lane's maximum moves only on a strictly
//! larger value (`v > m`, one `vmaxps` or compare-and-blend), so NaN is passed over without the
//! extra blends `f32::max` needs.

use super::exp::{SUM_LANES, exp};
use crate::isa::Isa;

dispatched! {
    /// The largest value of `x`: NaNs passed over, −∞ when there is none, +∞ when one is.
    fn row_max / row_max_body(x: &[f32]) -> f32
}

dispatched! {
    /// The first index of the largest value of `x` (NaNs passed over; 0 for an empty row or one of
    /// NaNs alone), in one pass.
    fn argmax / argmax_body(x: &[f32]) -> usize
}

dispatched! {
    /// `w[i] = exp((x[i] − max) · scale)`, set to 0 where it is below `floor`, and the sum of `w`
    /// (the sampler's weights: `scale` the inverse temperature, `floor` min-p's cut relative to
    /// the largest weight, 1 at `x = max`); NaN and −∞ logits weigh 0. The slices are cut to the
    /// shorter.
    fn exp_weights / exp_weights_body(x: &[f32], w: &mut [f32], max: f32, scale: f32, floor: f32) -> f32
}

#[inline(always)]
fn row_max_body(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; SUM_LANES];
    let mut chunks = x.chunks_exact(SUM_LANES);
    for c in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    chunks.remainder().iter().chain(&lanes).fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

#[inline(always)]
fn argmax_body(x: &[f32]) -> usize {
    let mut best = [f32::NEG_INFINITY; SUM_LANES];
    // Each lane's first index of its maximum (meaningful once the maximum is above −∞).
    let mut at = [0u32; SUM_LANES];
    let mut chunks = x.chunks_exact(SUM_LANES);
    for (c, chunk) in (&mut chunks).enumerate() {
        let base = (c * SUM_LANES) as u32;
        for (l, &v) in chunk.iter().enumerate() {
            let better = v > best[l];
            best[l] = if better { v } else { best[l] };
            at[l] = if better { base + l as u32 } else { at[l] };
        }
    }
    let tail = x.len() - chunks.remainder().len();
    let lanes = best.iter().zip(&at).map(|(&v, &i)| (v, i as usize));
    let rest = chunks.remainder().iter().enumerate().map(|(j, &v)| (v, tail + j));
    // Largest value, then lowest index, among values above −∞.
    let (mut v, mut i) = (f32::NEG_INFINITY, usize::MAX);
    for (lv, li) in lanes.chain(rest) {
        if lv > f32::NEG_INFINITY && (lv > v || (lv == v && li < i)) {
            (v, i) = (lv, li);
        }
    }
    if i == usize::MAX { x.iter().position(|&v| v == f32::NEG_INFINITY).unwrap_or(0) } else { i }
}

#[inline(always)]
fn exp_weights_body(x: &[f32], w: &mut [f32], max: f32, scale: f32, floor: f32) -> f32 {
    let n = x.len().min(w.len());
    let (x, w) = (&x[..n], &mut w[..n]);
    let weight = |v: f32| {
        let e = exp((v - max) * scale);
        if e >= floor { e } else { 0.0 }
    };
    let mut acc = [0f32; SUM_LANES];
    let mut xs = x.chunks_exact(SUM_LANES);
    let mut ws = w.chunks_exact_mut(SUM_LANES);
    for (xc, wc) in (&mut xs).zip(&mut ws) {
        for ((a, o), &v) in acc.iter_mut().zip(wc.iter_mut()).zip(xc) {
            *o = weight(v);
            *a += *o;
        }
    }
    let mut tail = 0f32;
    for (o, &v) in ws.into_remainder().iter_mut().zip(xs.remainder()) {
        *o = weight(v);
        tail += *o;
    }
    acc.iter().sum::<f32>() + tail
}
