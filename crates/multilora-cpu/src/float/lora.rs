//! The LoRA product of a few rows through one adapter, as a decode step has it (each adapter's
//! segment one to [`LORA_ROWS`] rows): `s = x · Aᵀ` and `y += s · Bᵀ` in one pass over the slot,
//! with `A` (`[r, k]`) read once in address order and the rank-major `Bᵀ` (`[r, out]`) once, a
//! panel of output columns at a time down its `r` rows (each output's chain in a register), for
//! all the rows together. The general kernels would take the segment's scattered rows one at a
//! time through `A` and walk `Bᵀ` as `r` interleaved streams, on operands of a few kilobytes each,
//! where the call overhead and the strided reads cost more than the multiply-adds.
//!
//! Every output is the same chain of operations as [`super::rect`]'s (the shrink: lane sums along
//! `k`, one [`FloatSimd::hsum`], the scalar tail) and [`super::prepacked::outer`]'s followed by the
//! fused path's add (the expand: an FMA chain over the rank from zero, a scalar multiply-add chain
//! for the columns past the last `2 · LANES` panel, then one add into `y`): the result is bit for
//! bit that of the general path, so a row's LoRA output does not depend on how many other rows
//! share its adapter.

use super::{Elem, FloatSimd};
#[cfg(target_arch = "x86_64")]
use crate::isa::{Avx2, Avx512F};
use crate::isa::{Isa, Portable};

/// Rows one call takes at most (a decode step's segments: a few requests per adapter).
pub(crate) const LORA_ROWS: usize = 4;

/// One adapter's slot as [`lora_rows`] reads it: `A` (`[rank, k]`, rows contiguous) and `Bᵀ`
/// (`[rank, out]`, rank-major), each its slot's first `rank` rows.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Slot<'a, E> {
    pub(crate) a: &'a [E],
    pub(crate) bt: &'a [E],
    pub(crate) rank: usize,
}

/// `ys[i] += (xs[i] · Aᵀ) · Bᵀ` for up to [`LORA_ROWS`] rows, through `scratch` (at least
/// `rows · rank` values, overwritten).
///
/// # Panics
/// When the rows number more than [`LORA_ROWS`] or differ in count, or an operand is shorter than
/// the shapes say (`k` the length of the `x` rows, `out` that of the `y` rows).
pub(crate) fn lora_rows<E: Elem>(
    isa: Isa,
    xs: &[&[f32]],
    slot: Slot<'_, E>,
    ys: &mut [&mut [f32]],
    scratch: &mut [f32],
) {
    let rows = xs.len();
    let Some(first) = xs.first() else { return };
    let (k, rank) = (first.len(), slot.rank);
    let out = ys.first().map_or(0, |y| y.len());
    let fits = rows == ys.len()
        && rows <= LORA_ROWS
        && xs.iter().all(|x| x.len() == k)
        && ys.iter().all(|y| y.len() == out)
        && slot.a.len() >= rank * k
        && slot.bt.len() >= rank * out
        && scratch.len() >= rows * rank;
    assert!(fits, "gemm: lora rows {rows} × [{k} → {rank} → {out}] outside their operands");
    if rank == 0 || out == 0 {
        return;
    }
    let isa = isa.float();
    let x: [*const f32; LORA_ROWS] = std::array::from_fn(|i| xs.get(i).map_or(std::ptr::null(), |x| x.as_ptr()));
    let y: [*mut f32; LORA_ROWS] =
        std::array::from_fn(|i| ys.get_mut(i).map_or(std::ptr::null_mut(), |y| y.as_mut_ptr()));
    let (a, bt) = (slot.a.as_ptr(), slot.bt.as_ptr());
    let args = Args { x, y, k, a, bt, rank, out, s: scratch.as_mut_ptr() };
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F was detected; the operands were checked to hold every row and column.
        Isa::Avx512 => unsafe { lora_avx512(rows, args) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2, FMA and F16C were detected; bounds as above.
        Isa::Avx2 => unsafe { lora_avx2(rows, args) },
        // SAFETY: no instruction set needed; bounds as above.
        _ => unsafe { by_rows::<Portable, E>(rows, args) },
    }
}

/// The checked operands as pointers: the first `rows` of `x` are rows of `k` values, of `y` rows
/// of `out`; `s` takes `rows · rank` values, row-major.
#[derive(Clone, Copy)]
struct Args<E> {
    x: [*const f32; LORA_ROWS],
    y: [*mut f32; LORA_ROWS],
    k: usize,
    a: *const E,
    bt: *const E,
    rank: usize,
    out: usize,
    s: *mut f32,
}

/// [`product`] at `rows` rows.
///
/// # Safety
/// As for [`product`], with `rows <= LORA_ROWS`.
#[inline(always)]
unsafe fn by_rows<S: FloatSimd, E: Elem>(rows: usize, a: Args<E>) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match rows {
            4 => product::<S, E, 4>(a),
            3 => product::<S, E, 3>(a),
            2 => product::<S, E, 2>(a),
            _ => product::<S, E, 1>(a),
        }
    }
}

/// The shrink into `s`, then the expand of `s` added into `y`.
///
/// # Safety
/// The first `R` of `a.x` hold `k` readable values and of `a.y` `out` writable ones, nobody
/// else's; `a.a` holds `rank · k` values and `a.bt` `rank · out`; `s` is writable for `R · rank`
/// values and nobody else's; `rank > 0`; `S`'s instruction set is available.
#[inline(always)]
unsafe fn product<S: FloatSimd, E: Elem, const R: usize>(a: Args<E>) {
    let Args { x, y, k, a: wa, bt, rank, out, s } = a;
    // SAFETY: every access below is inside the operands the caller vouches for.
    unsafe {
        // x · Aᵀ: each row of A once, against all the rows, four rows of A at a time so that
        // enough independent chains hide the FMA's latency.
        let mut j = 0;
        while j < rank {
            if rank - j >= SHRINK_J {
                shrink::<S, E, R, SHRINK_J>(x, k, wa.add(j * k), s.add(j), rank);
                j += SHRINK_J;
            } else {
                shrink::<S, E, R, 1>(x, k, wa.add(j * k), s.add(j), rank);
                j += 1;
            }
        }
        // · Bᵀ: a panel of `2 · LANES` output columns at a time, each output's chain over the rank
        // in a register (as `outer`'s: FMAs from zero, in rank order), its end added into `y`.
        let full = out / (2 * S::LANES) * (2 * S::LANES);
        let mut c = 0;
        // One or two rows keep only 2 or 4 chains in a 2-vector panel, fewer than the FMA's
        // latency needs: they take 4 vectors at a time while they fit (the same chains).
        if R <= 2 {
            while c + 4 * S::LANES <= full {
                expand_panel::<S, E, R, 4>(y, bt, s, rank, out, c);
                c += 4 * S::LANES;
            }
        }
        while c < full {
            expand_panel::<S, E, R, 2>(y, bt, s, rank, out, c);
            c += 2 * S::LANES;
        }
        for (i, &yr) in y.iter().enumerate().take(R) {
            for c in full..out {
                let mut acc = 0f32;
                for j in 0..rank {
                    acc += *s.add(i * rank + j) * (*bt.add(j * out + c)).to_f32();
                }
                *yr.add(c) += acc;
            }
        }
    }
}

/// Output columns `c .. c + P · LANES` of every row: each output's chain over the rank in a
/// register (FMAs from zero in rank order), its end added into `y` (`fma(v, 1, y)` is the rounded
/// `v + y`, as the fused path's add). The panel's `rank` rows of `Bᵀ` are as many short streams,
/// each asked for a page ahead. (Chains kept in a scratch row instead cost a load and a store per
/// FMA: 0.1–0.25 ms of a ~11.5 ms 16-row step once the slots come from cache.)
///
/// # Safety
/// As for [`product`], with `c + P · LANES <= out`.
#[inline(always)]
unsafe fn expand_panel<S: FloatSimd, E: Elem, const R: usize, const P: usize>(
    y: [*mut f32; LORA_ROWS],
    bt: *const E,
    s: *const f32,
    rank: usize,
    out: usize,
    c: usize,
) {
    // SAFETY: every access is inside the operands the caller vouches for.
    unsafe {
        let mut acc = [[S::zero(); P]; R];
        for j in 0..rank {
            let w = bt.add(j * out + c);
            for h in 0..P {
                if ((c + h * S::LANES) * size_of::<E>()).is_multiple_of(LINE) {
                    prefetch_ahead(w.add(h * S::LANES));
                }
            }
            let wv: [S::V; P] = std::array::from_fn(|h| S::load_elem(w.add(h * S::LANES)));
            for (i, a) in acc.iter_mut().enumerate() {
                let b = S::splat(*s.add(i * rank + j));
                for (v, &wh) in a.iter_mut().zip(&wv) {
                    *v = S::fma(b, wh, *v);
                }
            }
        }
        let one = S::splat(1.0);
        for (i, a) in acc.iter().enumerate() {
            for (h, &v) in a.iter().enumerate() {
                let yp = y[i].add(c + h * S::LANES);
                S::store(yp, S::fma(v, one, S::load(yp)));
            }
        }
    }
}

/// Bytes of a cache line: the kernel asks for one line ahead per line it starts reading.
const LINE: usize = 64;

/// How far ahead of its reads a stream asks for lines. A slot's `A` and `Bᵀ` are read once a
/// step, from memory (a step's slots are tens of megabytes), as a few short streams; the
/// hardware prefetchers stop at each 4 KiB page and start again slowly, so the kernel asks for
/// the bytes a page or so ahead itself. Measured on the 16-row LoRA step of docs/BENCHMARKS.md
/// (Zen 5, alternating steps): 1–1.4 ms of ~14 faster at 4–16 KiB, 0.2–0.4 ms at 1–2 KiB.
const PREFETCH_BYTES: usize = 4096;

/// Asks for the line `PREFETCH_BYTES` past `p` into L1 (a hint: it never faults, whatever the
/// address, so it may point past the slot's end). Into L1, not L2 as [`FloatSimd::prefetch`] asks for
/// the streaming tiles' next rows: the slot's lines are used a few hundred cycles later, and the
/// L2 hint measured 0.1–0.2 ms slower on the same step (three alternating runs).
#[inline(always)]
fn prefetch_ahead<E>(p: *const E) {
    let ahead = p.cast::<u8>().wrapping_add(PREFETCH_BYTES);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint that makes no access; SSE is baseline on x86-64.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(ahead.cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = ahead;
}

/// Rows of `A` the shrink takes at a time.
const SHRINK_J: usize = 4;

/// `s[i · ld + j] = x[i] · w[j]` for `R` rows of `x` and `J` rows of `w` (as `rect`'s tiles: lanes
/// along `k`, one horizontal sum, the tail in order).
///
/// # Safety
/// `R` rows of `k` values at `x`, `J` rows of `k` at `w` readable; `s` writable at every
/// `i · ld + j`; `S`'s instruction set available.
#[inline(always)]
unsafe fn shrink<S: FloatSimd, E: Elem, const R: usize, const J: usize>(
    x: [*const f32; LORA_ROWS],
    k: usize,
    w: *const E,
    s: *mut f32,
    ld: usize,
) {
    let kv = k / S::LANES * S::LANES;
    // SAFETY: the caller guarantees the instruction set.
    let mut acc = [[unsafe { S::zero() }; J]; R];
    let mut p = 0;
    // SAFETY: every access is inside the operands the caller vouches for.
    unsafe {
        while p < kv {
            if (p * size_of::<E>()).is_multiple_of(LINE) {
                for j in 0..J {
                    prefetch_ahead(w.add(j * k + p));
                }
            }
            let wv: [S::V; J] = std::array::from_fn(|j| S::load_elem(w.add(j * k + p)));
            for (i, row) in acc.iter_mut().enumerate() {
                let xv = S::load(x[i].add(p));
                for (c, &wj) in row.iter_mut().zip(&wv) {
                    *c = S::fma(xv, wj, *c);
                }
            }
            p += S::LANES;
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, c) in row.iter().enumerate() {
                let mut v = S::hsum(*c);
                for q in kv..k {
                    v += *x[i].add(q) * (*w.add(j * k + q)).to_f32();
                }
                *s.add(i * ld + j) = v;
            }
        }
    }
}

/// # Safety
/// As for [`by_rows`], with AVX-512F available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn lora_avx512<E: Elem>(rows: usize, args: Args<E>) {
    // SAFETY: forwarded from the caller, which checked the features.
    unsafe { by_rows::<Avx512F, E>(rows, args) }
}

/// # Safety
/// As for [`by_rows`], with AVX2, FMA and F16C available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lora_avx2<E: Elem>(rows: usize, args: Args<E>) {
    // SAFETY: forwarded from the caller, which checked the features.
    unsafe { by_rows::<Avx2, E>(rows, args) }
}
