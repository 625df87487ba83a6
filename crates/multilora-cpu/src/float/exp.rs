//! The exponential of the softmax and of SiLU: [`exp`], branch-free so that a loop of it
//! vectorises; [`exp_sum`], `exp(s - max)` over a slice and its sum, and [`softmax`] of a row
//! with it; [`silu_mul`], the gated
//! MLP's `silu(g) · u`, and [`gelu_tanh_mul`], Gemma's `gelu_tanh(g) · u`. The slice functions are compiled for each instruction set and picked at
//! run time like the products. Every operation is elementwise and the sum keeps a fixed number of
//! partial sums, so every instruction set gives the same bits.

use crate::isa::Isa;

/// `s ← exp(s - max)` over the slice, and their sum (in order), on the best instruction set.
pub fn exp_sum(isa: Isa, s: &mut [f32], max: f32) -> f32 {
    let isa = isa.float();
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F was detected (`available`).
        Isa::Avx512 => unsafe { exp_sum_avx512(s, max) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2, FMA and F16C were detected.
        Isa::Avx2 => unsafe { exp_sum_avx2(s, max) },
        _ => exp_sub(s, max),
    }
}

/// The softmax of a row of scores in place: its maximum ([`super::logits::row_max`], lane-wise
/// maxima: the same value as one maximum after the other but for the sign of a zero, which changes
/// no `exp(s − max)`), `exp(s - max)` ([`exp_sum`]), one scale by the sum's inverse; the same bits
/// on each instruction set.
pub fn softmax(isa: Isa, row: &mut [f32]) {
    softmax_stats(isa, row);
}

/// [`softmax`], returning the row's maximum and `Σ exp(s − max)`.
pub fn softmax_stats(isa: Isa, row: &mut [f32]) -> (f32, f32) {
    let max = super::logits::row_max(isa, row);
    let sum = exp_sum(isa, row, max);
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|p| *p *= inv);
    (max, sum)
}

/// `out[j] = silu(g[j]) · u[j]` (`silu(g) = g / (1 + e⁻ᵍ)`, through `e^-|g|` only, which cannot
/// overflow), on the best instruction set; the three slices are cut to the shortest.
pub fn silu_mul(isa: Isa, g: &[f32], u: &[f32], out: &mut [f32]) {
    let isa = isa.float();
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F was detected (`available`).
        Isa::Avx512 => unsafe { silu_mul_avx512(g, u, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2, FMA and F16C were detected.
        Isa::Avx2 => unsafe { silu_mul_avx2(g, u, out) },
        _ => silu_mul_body(g, u, out),
    }
}

dispatched! {
    /// `out[j] = gelu_tanh(g[j]) · u[j]`, GELU's tanh form (`gelu_pytorch_tanh`: Gemma's MLP), on
    /// the best instruction set; the three slices are cut to the shortest. `0.5 · g · (1 +
    /// tanh(z))` is `g · σ(2z)`, computed as [`silu_mul`]'s sigmoid through `e^-|2z|`, which cannot
    /// overflow.
    fn gelu_tanh_mul / gelu_tanh_mul_body(g: &[f32], u: &[f32], out: &mut [f32]) -> ()
}

/// [`gelu_tanh_mul`]'s body, elementwise for the compiler to vectorise: `y = 2 · √(2/π) · (g +
/// 0.044715 g³)`, `e = e^-|y|`, `σ(y)` is `1 / (1 + e)` for `y ≥ 0` and `e / (1 + e)` below.
#[inline(always)]
fn gelu_tanh_mul_body(g: &[f32], u: &[f32], out: &mut [f32]) {
    const TWO_C: f32 = 2.0 * 0.797_884_6;
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        let y = TWO_C * (g + 0.044_715 * g * g * g);
        let e = exp(-y.abs());
        let s = if y >= 0.0 { 1.0 } else { e };
        *o = g * s / (1.0 + e) * u;
    }
}

/// # Safety
/// AVX-512F must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn silu_mul_avx512(g: &[f32], u: &[f32], out: &mut [f32]) {
    silu_mul_body(g, u, out)
}

/// # Safety
/// AVX2 and FMA must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(g: &[f32], u: &[f32], out: &mut [f32]) {
    silu_mul_body(g, u, out)
}

/// [`silu_mul`]'s body, elementwise for the compiler to vectorise: with `e = e^-|g|`, `silu(g)`
/// is `g / (1 + e)` for `g ≥ 0` and `g · e / (1 + e)` below (NaN stays NaN).
#[inline(always)]
fn silu_mul_body(g: &[f32], u: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        let e = exp(-g.abs());
        let s = if g >= 0.0 { 1.0 } else { e };
        *o = g * s / (1.0 + e) * u;
    }
}

/// # Safety
/// AVX-512F must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_sum_avx512(s: &mut [f32], max: f32) -> f32 {
    exp_sub(s, max)
}

/// # Safety
/// AVX2 and FMA must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_sum_avx2(s: &mut [f32], max: f32) -> f32 {
    exp_sub(s, max)
}

/// Lanes of [`exp_sub`]'s partial sums: the sum is the same whatever the instruction set.
pub(super) const SUM_LANES: usize = 16;

/// [`exp_sum`]'s body, written for the compiler to vectorise at the caller's instruction set
/// (every operation is elementwise; the sum keeps [`SUM_LANES`] partial sums).
#[inline(always)]
fn exp_sub(s: &mut [f32], max: f32) -> f32 {
    let mut acc = [0f32; SUM_LANES];
    let mut chunks = s.chunks_exact_mut(SUM_LANES);
    for c in &mut chunks {
        for (a, x) in acc.iter_mut().zip(c.iter_mut()) {
            *x = exp(*x - max);
            *a += *x;
        }
    }
    let mut tail = 0f32;
    for x in chunks.into_remainder() {
        *x = exp(*x - max);
        tail += *x;
    }
    acc.iter().sum::<f32>() + tail
}

/// `eˣ` for `x ≤ 0` (a score minus its row's maximum), within 2 ulp of the exact value: `x = n ·
/// ln 2 + r` with `|r| ≤ ln 2 / 2` (`ln 2` in two parts, Cody and Waite), `eʳ` by its Taylor
/// series to `r⁷` (truncation below 6e-9 relative), times `2ⁿ` built in the exponent bits; 0
/// below `-87.3` (where `eˣ` is no longer a normal f32), and for NaN. Branch-free, so a loop of
/// it vectorises.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // 1.5 · 2²³: adding it rounds to an integer, held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(-87.3, 0.0);
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.0 / 5040.0;
    for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = p * r + c;
    }
    let k = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let scale = f32::from_bits((k.wrapping_add(127).clamp(0, 255) as u32) << 23);
    if x >= -87.3 { p * scale } else { 0.0 }
}
