//! Passes over a row of logits for the sampler, on the best instruction set this CPU has (or an
//! explicit one, for tests and benchmarks): [`row_max`], [`argmax`] and [`exp_weights`]. Each gives the same
//! bits on every instruction set, so a seeded draw does not depend on the CPU it runs on.

use crate::float as gemm;
use crate::isa::Isa;

/// The largest value of `x`: NaNs passed over, −∞ when there is none, +∞ when one is.
pub fn row_max(x: &[f32]) -> f32 {
    gemm::row_max(Isa::best(), x)
}

/// [`row_max`] on `isa` (the portable code where the CPU lacks it).
pub fn row_max_with(isa: Isa, x: &[f32]) -> f32 {
    gemm::row_max(isa, x)
}

/// The first index of the largest value of `x` (NaNs passed over; 0 for an empty row or one of
/// NaNs alone), in one pass.
pub fn argmax(x: &[f32]) -> usize {
    gemm::argmax(Isa::best(), x)
}

/// [`argmax`] on `isa` (the portable code where the CPU lacks it).
pub fn argmax_with(isa: Isa, x: &[f32]) -> usize {
    gemm::argmax(isa, x)
}

/// `w[i] = exp((x[i] − max) · scale)`, 0 where that is below `floor`, and the sum of `w` in
/// f32 (16 partial sums): softmax weights relative to the largest logit (`max`, which weighs
/// exactly 1) at temperature `1 / scale`. NaN and −∞ logits weigh 0; the exponential is within
/// 2 ulp and 0 below `e^-87.3`. The slices are cut to the shorter one.
pub fn exp_weights(x: &[f32], w: &mut [f32], max: f32, scale: f32, floor: f32) -> f32 {
    gemm::exp_weights(Isa::best(), x, w, max, scale, floor)
}

/// [`exp_weights`] on `isa` (the portable code where the CPU lacks it).
pub fn exp_weights_with(isa: Isa, x: &[f32], w: &mut [f32], max: f32, scale: f32, floor: f32) -> f32 {
    gemm::exp_weights(isa, x, w, max, scale, floor)
}
