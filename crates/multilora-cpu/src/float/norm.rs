//! The RMS norm's rows (the layers crate's `rms_norm`): each row's squares summed in order, as candle-nn's,
//! with [`ROWS`] rows' sums side by side, and the division compiled for each instruction set.

use crate::isa::Isa;

/// Rows whose sums one pass carries side by side (independent chains that hide the add's latency).
pub const ROWS: usize = 8;

/// `out = src / m · alpha` row by row (rows of `alpha.len()` values), `m = sqrt(Σ v² / n + eps)`
/// of the row.
pub fn rms_rows(isa: Isa, src: &[f32], alpha: &[f32], eps: f32, out: &mut [f32]) {
    let isa = isa.float();
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F was detected (`available`).
        Isa::Avx512 => unsafe { rows_avx512(src, alpha, eps, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2, FMA and F16C were detected.
        Isa::Avx2 => unsafe { rows_avx2(src, alpha, eps, out) },
        _ => rows(src, alpha, eps, out),
    }
}

/// # Safety
/// AVX-512F must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn rows_avx512(src: &[f32], alpha: &[f32], eps: f32, out: &mut [f32]) {
    rows(src, alpha, eps, out)
}

/// # Safety
/// AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn rows_avx2(src: &[f32], alpha: &[f32], eps: f32, out: &mut [f32]) {
    rows(src, alpha, eps, out)
}

/// The body, compiled once per instruction set by the entry points above (no fused multiply-add:
/// a square and a sum are two roundings, as in candle-nn's).
#[inline(always)]
fn rows(src: &[f32], alpha: &[f32], eps: f32, out: &mut [f32]) {
    let n = alpha.len();
    if n == 0 {
        return;
    }
    for (src, out) in src.chunks(ROWS * n).zip(out.chunks_mut(ROWS * n)) {
        let r = src.len() / n;
        // Each row's squares added in order, from zero, as `Iterator::sum` does.
        let mut sum = [0f32; ROWS];
        for i in 0..n {
            for (j, s) in sum.iter_mut().enumerate().take(r) {
                let v = src[j * n + i];
                *s += v * v;
            }
        }
        for (j, (row, o)) in src.chunks_exact(n).zip(out.chunks_exact_mut(n)).enumerate() {
            let m = (sum[j] / n as f32 + eps).sqrt();
            for ((o, &v), &a) in o.iter_mut().zip(row).zip(alpha) {
                *o = v / m * a;
            }
        }
    }
}
