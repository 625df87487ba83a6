//! One decode sequence's attention for one KV head in a single pass on AVX-512: the scores of the
//! `group` query heads against every key, their softmax, and the weighted sum of the values, with
//! the keys and values read straight from the cache rows the sequence names.
//!
//! - Scores: a block of 8 keys (4 for groups of 4) at a time, one accumulator per query row and
//!   key (lanes along the head dimension), each chunk of a key widened once for all the rows; a
//!   row's accumulators are then summed horizontally together, by a transposing reduction that
//!   leaves the block's scores in one vector (about three shuffles and adds a score, where
//!   separate horizontal sums take about eight).
//! - Softmax: [`super::softmax`], as the general path.
//! - Values: each value row is read once, widened, and accumulated into every query row's
//!   output held in registers (up to four vectors of the head dimension per pass).
//!
//! A score's sum runs in a fixed order for a given head dimension, and nothing depends on the
//! other sequences, so a row's result does not depend on the batch.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::FloatSimd;
use super::{Elem, Isa};
use crate::isa::Avx512F;

/// Query heads per KV head the kernel takes (Llama-family models have 1 to 8; the rest go the
/// general way).
pub const MAX_GROUP: usize = 4;

/// One sequence's operands for one KV head: `q` (`[group, hd]`, already scaled), the caches
/// (`[rows, width]` each) and the cache row of each of its context positions, in order; the head's
/// values are columns `col .. col + hd` of a row.
#[derive(Clone, Copy, Debug)]
pub struct Head<'a, E> {
    /// The group's queries, `[group, hd]`, already scaled.
    pub q: &'a [f32],
    /// The key cache, `[rows, width]`.
    pub k: &'a [E],
    /// The value cache, `[rows, width]`.
    pub v: &'a [E],
    /// Values in one cache row (all KV heads).
    pub width: usize,
    /// The head's first column in a row.
    pub col: usize,
    /// The head dimension.
    pub hd: usize,
    /// The cache row of each context position, in order.
    pub rows: &'a [u32],
}

/// Whether [`attend`] runs `group` query heads of `hd` on `isa`.
pub fn supports(isa: Isa, group: usize, hd: usize) -> bool {
    isa.float() == Isa::Avx512 && (1..=MAX_GROUP).contains(&group) && hd > 0 && hd.is_multiple_of(16)
}

/// `out` (`[group, hd]`) `= softmax(q · Kᵀ) · V` over the head's context, through `scratch`;
/// each query head's softmax maximum and sum in `stats[r]` (`(max, Σ exp(s − max))`: what merges
/// the outputs of a context attended in parts).
///
/// # Panics
/// When [`supports`] does not hold, `q` or `out` is not `group · hd` long, `stats` is shorter
/// than the group, the context is empty, or a row's head reaches past the caches.
pub fn attend<E: Elem>(isa: Isa, h: Head<'_, E>, out: &mut [f32], scratch: &mut Vec<f32>, stats: &mut [(f32, f32)]) {
    let group = h.q.len() / h.hd.max(1);
    let fits = supports(isa, group, h.hd)
        && h.q.len() == group * h.hd
        && out.len() == h.q.len()
        && stats.len() >= group
        && !h.rows.is_empty()
        && h.col + h.hd <= h.width
        && h.rows.iter().all(|&r| (r as usize + 1) * h.width <= h.k.len().min(h.v.len()));
    assert!(fits, "attend: {} query values of {} over {} rows outside the caches", h.q.len(), h.hd, h.rows.len());
    scratch.resize(group * h.rows.len(), 0.0);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F was detected (`supports`); every row's head is inside both caches, `q`
    // and `out` hold `group · hd` values and the scratch `group` rows of scores.
    unsafe {
        attend_avx512(h, group, out, scratch, stats)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("attend: AVX-512 on a non-x86 target");
}

/// # Safety
/// As [`attend`] checked, with AVX-512F available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn attend_avx512<E: Elem>(
    h: Head<'_, E>,
    group: usize,
    out: &mut [f32],
    scores: &mut [f32],
    stats: &mut [(f32, f32)],
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match group {
            1 => attend_group::<E, 1, 8>(h, out, scores, stats),
            2 => attend_group::<E, 2, 8>(h, out, scores, stats),
            3 => attend_group::<E, 3, 8>(h, out, scores, stats),
            _ => attend_group::<E, 4, 4>(h, out, scores, stats),
        }
    }
}

/// [`attend_avx512`] for `G` query heads, scores `KB` keys at a time.
///
/// # Safety
/// As for [`attend_avx512`], with `G` the group.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn attend_group<E: Elem, const G: usize, const KB: usize>(
    h: Head<'_, E>,
    out: &mut [f32],
    scores: &mut [f32],
    stats: &mut [(f32, f32)],
) {
    let (ctx, hd) = (h.rows.len(), h.hd);
    // SAFETY: forwarded from the caller.
    unsafe {
        for t in 0..AHEAD.min(ctx) {
            prefetch_row(row_at(h.k, &h, t), hd);
        }
        for b in (0..ctx).step_by(KB) {
            // The keys `AHEAD` on, and as the keys end the first values.
            for t in b + AHEAD..b + KB + AHEAD {
                if t < ctx {
                    prefetch_row(row_at(h.k, &h, t), hd);
                } else if t - ctx < ctx {
                    prefetch_row(row_at(h.v, &h, t - ctx), hd);
                }
            }
            // A block past the context repeats its last key; those scores are not kept.
            let n = (ctx - b).min(KB);
            let mut keys = [h.k.as_ptr(); KB];
            for (j, k) in keys.iter_mut().enumerate() {
                *k = row_at(h.k, &h, b + j.min(n - 1));
            }
            let sums = scores_block::<E, G, KB>(h.q.as_ptr(), keys, hd);
            // The block's `n` scores of each row straight into the row (the lanes past them not
            // written: a masked store touches nothing there).
            let kept: __mmask16 = (1 << n) - 1;
            for (r, s) in sums.iter().enumerate() {
                _mm512_mask_storeu_ps(scores.as_mut_ptr().add(r * ctx + b), kept, *s);
            }
        }
        for (row, st) in scores.chunks_exact_mut(ctx).take(G).zip(stats.iter_mut()) {
            *st = super::softmax_stats(Isa::Avx512, row);
        }
        let (p, o) = (scores.as_ptr(), out.as_mut_ptr());
        let mut d = 0;
        while d + 64 <= hd {
            values::<E, G, 4>(&h, ctx, p, o, d);
            d += 64;
        }
        while d < hd {
            values::<E, G, 1>(&h, ctx, p, o, d);
            d += 16;
        }
    }
}

/// Where the head's values of context position `t < ctx` start in `cache` (`h.k` or `h.v`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn row_at<E>(cache: &[E], h: &Head<'_, E>, t: usize) -> *const E {
    cache.as_ptr().wrapping_add(h.rows[t] as usize * h.width + h.col)
}

/// Rows a stream of cache rows is asked for ahead of its use.
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 16;

/// Asks for the lines of `len` values from `p` to be brought into L1 (a hint: never faults).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_row<E>(p: *const E, len: usize) {
    let bytes = len * size_of::<E>();
    let mut o = 0;
    while o < bytes {
        // SAFETY: a prefetch is a hint that makes no access.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>().wrapping_add(o)) };
        o += 64;
    }
}

/// `G` query rows (`hd` apart from `q`) against `KB` keys: row `r`'s scores in the first `KB`
/// lanes of vector `r`, key `j` in lane `j`. Each key chunk is widened once and multiplied into
/// every row's accumulator for that key (lanes along the head dimension).
///
/// # Safety
/// `q .. q + G · hd` and each key's `hd` values readable; `KB` is 4 or 8; AVX-512F available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scores_block<E: Elem, const G: usize, const KB: usize>(
    q: *const f32,
    keys: [*const E; KB],
    hd: usize,
) -> [__m512; G] {
    // SAFETY: forwarded from the caller.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); KB]; G];
        let mut qv = [_mm512_setzero_ps(); G];
        for c in (0..hd).step_by(16) {
            for (r, x) in qv.iter_mut().enumerate() {
                *x = _mm512_loadu_ps(q.add(r * hd + c));
            }
            for (j, &k) in keys.iter().enumerate() {
                let kv = Avx512F::load_elem::<E>(k.add(c));
                for (a, &x) in acc.iter_mut().zip(&qv) {
                    a[j] = _mm512_fmadd_ps(x, kv, a[j]);
                }
            }
        }
        let mut out = [_mm512_setzero_ps(); G];
        for (o, a) in out.iter_mut().zip(acc) {
            *o = reduce::<KB>(a);
        }
        out
    }
}

/// In each 128-bit lane: `[x₀+x₂, y₀+y₂, x₁+x₃, y₁+y₃]`.
///
/// # Safety
/// AVX-512F available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pair(x: __m512, y: __m512) -> __m512 {
    // SAFETY: register operations only; the caller guarantees AVX-512F.
    unsafe { _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y)) }
}

/// Of two [`pair`]s of keys `(0, 1)` and `(2, 3)`: in each 128-bit lane, that lane's partial sums
/// of the four keys, in order.
///
/// # Safety
/// AVX-512F available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn quad(x: __m512, y: __m512) -> __m512 {
    // SAFETY: register operations only; the caller guarantees AVX-512F.
    unsafe {
        let (x, y) = (_mm512_castps_pd(x), _mm512_castps_pd(y));
        _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)))
    }
}

/// The horizontal sums of `KB` (4 or 8) vectors, sum `j` in lane `j`: pairs of vectors
/// interleaved and added at 32 bits, then at 64 (each 128-bit lane then holds its partial sums of
/// four keys), then the 128-bit lanes folded together.
///
/// # Safety
/// AVX-512F available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn reduce<const KB: usize>(a: [__m512; KB]) -> __m512 {
    // SAFETY: register operations only; the caller guarantees AVX-512F.
    unsafe {
        let q0 = quad(pair(a[0], a[1]), pair(a[2], a[3]));
        if KB == 4 {
            // Lanes 0+2 and 1+3, then those two.
            let h = _mm512_add_ps(q0, _mm512_shuffle_f32x4::<0b01_00_11_10>(q0, q0));
            return _mm512_add_ps(h, _mm512_shuffle_f32x4::<0b10_11_00_01>(h, h));
        }
        let q1 = quad(pair(a[4], a[5]), pair(a[6], a[7]));
        // Lanes: [keys 0–3 from lanes 0+1, the same from 2+3, keys 4–7 from 0+1, from 2+3].
        let h =
            _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(q0, q1), _mm512_shuffle_f32x4::<0b11_01_11_01>(q0, q1));
        // [keys 0–3, keys 4–7] in the low half.
        _mm512_add_ps(_mm512_shuffle_f32x4::<0b00_00_10_00>(h, h), _mm512_shuffle_f32x4::<0b00_00_11_01>(h, h))
    }
}

/// Output columns `d .. d + 16 · C` of `G` query rows: `Σ_t p[r, t] · v[t]`, each row's `C`
/// vectors in registers through the context, stored at `o + r · hd + d`.
///
/// # Safety
/// `p` holds `G` rows of `ctx` probabilities; `o`, `G` rows of `hd` writable; `d + 16 · C <=
/// hd`; each context row's head inside `h.v`; AVX-512F available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn values<E: Elem, const G: usize, const C: usize>(
    h: &Head<'_, E>,
    ctx: usize,
    p: *const f32,
    o: *mut f32,
    d: usize,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); C]; G];
        for (t, &r) in h.rows.iter().enumerate() {
            if let Some(&ra) = h.rows.get(t + AHEAD) {
                prefetch_row(h.v.as_ptr().wrapping_add(ra as usize * h.width + h.col + d), 16 * C);
            }
            let src = h.v.as_ptr().add(r as usize * h.width + h.col + d);
            let mut vv = [_mm512_setzero_ps(); C];
            for (c, x) in vv.iter_mut().enumerate() {
                *x = Avx512F::load_elem::<E>(src.add(16 * c));
            }
            for (i, a) in acc.iter_mut().enumerate() {
                let w = _mm512_set1_ps(*p.add(i * ctx + t));
                for (x, &v) in a.iter_mut().zip(&vv) {
                    *x = _mm512_fmadd_ps(w, v, *x);
                }
            }
        }
        for (i, a) in acc.iter().enumerate() {
            for (c, &x) in a.iter().enumerate() {
                _mm512_storeu_ps(o.add(i * h.hd + d + 16 * c), x);
            }
        }
    }
}
