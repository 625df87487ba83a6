//! The plain AVX2 set's kernel for many rows of the K-quants and Q8_0: the vector lanes are 8
//! rows, not 8 columns.
//!
//! Without VNNI every 4-value group costs a `vpmaddubsw` and a `vpaddw` a row and a plane, and
//! in the column-lane kernel ([`super::tile`]) also a broadcast of the row's 4 activation bytes.
//! Here a job's activations are first laid out row-lane ([`transpose`]: per block and group, 8
//! rows' 4 bytes side by side; as many bytes as the job's quants, a row block's: about 1 MiB at
//! most), a weight tile's records decoded once into a scratch of column-lane vectors
//! ([`Format::sub`], as the other kernel decodes them), and then each column's 4 weight bytes of
//! a group are broadcast once for 16 rows and both planes: a quarter of the broadcasts, and each
//! block's decoding and epilogue shared by 16 rows. On Zen 3 the products of 16 and 512 rows ran
//! 1.05–1.45× the column-lane kernel's (docs/BENCHMARKS.md); what is left is the integer work
//! itself, 4 vector operations per 32 multiply-adds of the two planes.
//!
//! The sums are the same exact integers, and the epilogue the same f32 operations in the same
//! order on each `(row, column)` (the column's scale broadcast, the rows' [`Meta`] fields loaded
//! as vectors): every output has the bits of the column-lane kernel's (and the portable one's).

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::act::{Act, BLOCK, LO, Meta, PANEL};
use super::format::{Format, Kind};
use super::simd::DotSimd;
use super::tile::prefetch_share;
use super::x86::i16_groups;
use super::{Ahead, Job, Out, Seg, tile_rows};
use crate::isa::Avx2;
use crate::quant::QuantType;
use crate::quant::layout::TN;

/// Rows of a panel from which a job takes them row-lane (all 16 computed, its own written);
/// below it the column-lane kernel takes them. Eight rows in one row vector ran 0.8–0.9× the
/// column-lane kernel (Llama-3.2-1B's 8192 × 2048 in Q4_K and Q6_K on Zen 3): the per-column
/// work of a block is then shared by too few rows.
pub(super) const MIN_ROWS: usize = 9;

/// Whether the job's rows in panel `p` go row-lane: [`MIN_ROWS`] of them or more.
fn row_lane(j: &Job, p: usize) -> bool {
    j.m1.min((p + 1) * PANEL).saturating_sub(j.m0.max(p * PANEL)) >= MIN_ROWS
}

/// Whether [`job`] is the one for a job of type `qt`: the K-quants and Q8_0, with a panel that goes
/// row-lane. Q4_0, Q4_1 and Q5_1 ran 0.84–1.07× the column-lane kernel here (SmolLM2's shapes on
/// Zen 3, 16 to 512 rows): a record of theirs is one block, whose decoding 16 rows share no
/// better than 8.
pub(super) fn takes(qt: QuantType, j: &Job) -> bool {
    let types = !matches!(qt, QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q5_0 | QuantType::Q5_1);
    types && (j.m0 / PANEL..j.m1.div_ceil(PANEL)).any(|p| row_lane(j, p))
}

/// Bytes of one block of a panel row-lane: `[group 8][plane 2][row vector 2][row 8][4]`.
const XT_BLOCK: usize = 8 * 2 * 2 * 32;

/// Row vectors of 8 rows in a panel.
const RV: usize = PANEL / 8;

/// The most 32-value blocks a record holds (a K-quant's super-block).
const SUBS: usize = 8;

thread_local! {
    /// The job's activations row-lane, kept for the thread's next job.
    static XT: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Lays panel-major quants (`qs`: a panel's block 0, `nb` blocks) out row-lane into `xt`
/// (`nb · XT_BLOCK` bytes): group `g` of plane `p` of rows `8v .. 8v + 8` side by side.
fn transpose(qs: &[i8], nb: usize, xt: &mut [u8]) {
    for b in 0..nb {
        let src = &qs[b * BLOCK..(b + 1) * BLOCK];
        let dst = &mut xt[b * XT_BLOCK..(b + 1) * XT_BLOCK];
        for g in 0..8 {
            for p in 0..2 {
                for r in 0..PANEL {
                    let s = p * LO + 32 * r + 4 * g;
                    let d = 128 * g + 64 * p + 4 * r;
                    let q: [i8; 4] = src[s..s + 4].try_into().expect("4 bytes");
                    dst[d..d + 4].copy_from_slice(&q.map(|v| v as u8));
                }
            }
        }
    }
}

/// One job on the plain AVX2 set: its panels with at least [`MIN_ROWS`] of its rows row-lane,
/// the others' rows through the column-lane kernel, tile by tile.
///
/// # Safety
/// As for `super::job_of` with AVX2, FMA and F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn job<F: Format>(s: &Seg<'_>, act: &Act, out: Out, j: &Job, mut pf: Ahead<'_>) {
    let nb = act.k / 32;
    let (p0, p1) = (j.m0 / PANEL, j.m1.div_ceil(PANEL));
    let span = |p: usize| (j.m0.max(p * PANEL), j.m1.min((p + 1) * PANEL));
    // Out of the thread's slot while in use, so that the work is in no closure (which would
    // not have this function's instruction sets).
    let mut xt = XT.with_borrow_mut(std::mem::take);
    let need = (p1 - p0) * nb * XT_BLOCK;
    if xt.len() < need {
        xt.resize(need, 0);
    }
    for p in (p0..p1).filter(|&p| row_lane(j, p)) {
        let (xo, _, _) = act.at(p * PANEL);
        transpose(&act.qs[xo..xo + nb * BLOCK], nb, &mut xt[(p - p0) * nb * XT_BLOCK..]);
    }
    // The read-ahead lines spread over the job's (tile, panel) calls, one share each.
    let calls = (j.t1 - j.t0) * (p1 - p0);
    let per_call = pf.left().div_ceil(calls.max(1));
    let mut budget = 0;
    for t in j.t0..j.t1 {
        let tile_cols = (s.n - t * TN).min(TN);
        for p in p0..p1 {
            let (a, b) = span(p);
            budget += per_call;
            let ahead = pf.take(budget);
            budget -= ahead.1;
            if row_lane(j, p) {
                let nsb = act.k / F::L.sb;
                let (_, mo, _) = act.at(p * PANEL);
                // SAFETY: tile `t` of the segment and panel `p` of the activations (row-lane
                // in `xt`), inside the job as `run` checked; rows `a..b` of the panel and the
                // tile's columns of the output are the job's.
                unsafe {
                    let at = Panel {
                        w: s.tiles.as_ptr().add(t * nsb * F::L.bytes),
                        nsb,
                        cols: tile_cols,
                        xt: xt.as_ptr().add((p - p0) * nb * XT_BLOCK),
                        meta: act.meta.as_ptr().add(mo),
                        ahead,
                    };
                    let acc = tile_panel::<F>(at);
                    for i in a..b {
                        let y = out.ptr.add(i * out.ldy + s.col0 + t * TN);
                        for (c, col) in acc.iter().enumerate().take(tile_cols) {
                            *y.add(c) = col[i - p * PANEL];
                        }
                    }
                }
            } else {
                let mut c0 = 0;
                while c0 < tile_cols {
                    let mut i = a;
                    while i < b {
                        // SAFETY: as above, for the column-lane kernel's rows `i..b`.
                        i += unsafe { tile_rows::<Avx2, F, 1>(s, act, out, (t, c0), (i, b), (0, 0)) };
                    }
                    c0 += 8;
                }
                prefetch_share(ahead, 0, 1);
            }
        }
    }
    XT.with_borrow_mut(|v| *v = xt);
}

/// Where one panel's rows meet one weight tile.
#[derive(Clone, Copy)]
struct Panel {
    /// The tile's first record, and its records along `k`.
    w: *const u8,
    nsb: usize,
    /// The tile's columns.
    cols: usize,
    /// The panel's row-lane quants and its first [`Meta`].
    xt: *const u8,
    meta: *const Meta,
    /// Lines to ask for along the way (`(address, lines)`).
    ahead: (usize, usize),
}

/// The 16 rows of one panel (two row vectors of 8) against the `cols` columns of one weight
/// tile: each column's 16 outputs (`[column][row]`).
///
/// # Safety
/// The tile holds `nsb` records; `xt` is the panel's row-lane quants for `nsb · F::L.subs`
/// blocks and `meta` its first [`Meta`] of as many; AVX2, FMA and F16C are available.
#[inline(always)]
unsafe fn tile_panel<F: Format>(at: Panel) -> [[f32; PANEL]; TN] {
    let Panel { w, nsb, cols, xt, meta, ahead } = at;
    let subs = F::L.subs;
    const { assert!(F::L.subs <= SUBS, "a record of at most SUBS blocks") };
    let halves = cols.div_ceil(8);
    // SAFETY: the caller's guarantees; the scratch arrays are the function's own.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); RV]; TN];
        let mut wd = [[[[0u8; 32]; 8]; 2]; SUBS];
        let mut sd = [[[0f32; 8]; 4]; 2 * SUBS];
        for sb in 0..nsb {
            let r = w.add(sb * F::L.bytes);
            prefetch_share(ahead, sb, nsb);
            for h in 0..halves {
                let sbs = F::sb::<Avx2>(r, 8 * h);
                for s in 0..subs {
                    let (wv, sc) = F::sub::<Avx2>(r, 8 * h, s, &sbs);
                    for (g, v) in wv.iter().enumerate() {
                        _mm256_storeu_si256(wd[s][h][g].as_mut_ptr().cast(), *v);
                    }
                    for (i, v) in sc.iter().enumerate() {
                        _mm256_storeu_ps(sd[2 * s + h][i].as_mut_ptr(), *v);
                    }
                }
            }
            for (c, a) in acc.iter_mut().enumerate().take(cols) {
                let (h, cc) = (c / 8, c % 8);
                for s in 0..subs {
                    let b = sb * subs + s;
                    column_block::<F>(a, &wd[s][h], &sd[2 * s + h], cc, xt.add(XT_BLOCK * b), meta.add(b));
                }
            }
        }
        let mut out = [[0f32; PANEL]; TN];
        for (o, a) in out.iter_mut().zip(&acc) {
            for (v, a) in a.iter().enumerate() {
                _mm256_storeu_ps(o.as_mut_ptr().add(8 * v), *a);
            }
        }
        out
    }
}

/// Each of the [`RV`] row vectors' exact `254 · hi + lo` dot product with column `cc` of the
/// decoded groups `g0..g1`.
///
/// # Safety
/// `xt` is one block's row-lane quants; AVX2 is available.
#[inline(always)]
unsafe fn dots<F: Format>(w: &[[u8; 32]; 8], cc: usize, xt: *const u8, g0: usize, g1: usize) -> [__m256i; RV] {
    let per = i16_groups(F::MAXW, F::SIGNED);
    // SAFETY: the caller's guarantees; `w[g]` holds 32 bytes, `4 · cc + 4 <= 32`.
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_si256(); RV]; 2];
        let mut g = g0;
        while g < g1 {
            let end = (g + per).min(g1);
            let mut s16 = [[_mm256_setzero_si256(); RV]; 2];
            for (h, wh) in (g..end).zip(&w[g..end]) {
                let wb = _mm256_set1_epi32(wh.as_ptr().add(4 * cc).cast::<i32>().read_unaligned());
                let wa = if F::SIGNED { _mm256_abs_epi8(wb) } else { wb };
                for (p, s16) in s16.iter_mut().enumerate() {
                    for (v, s) in s16.iter_mut().enumerate() {
                        let x = _mm256_loadu_si256(xt.add(128 * h + 64 * p + 32 * v).cast());
                        let x = if F::SIGNED { _mm256_sign_epi8(x, wb) } else { x };
                        *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(wa, x));
                    }
                }
            }
            for (a, s) in acc.iter_mut().zip(&s16) {
                for (a, &s) in a.iter_mut().zip(s) {
                    *a = _mm256_add_epi32(*a, _mm256_madd_epi16(s, ones));
                }
            }
            g = end;
        }
        let [hi, lo] = acc;
        [Avx2::combine(hi[0], lo[0]), Avx2::combine(hi[1], lo[1])]
    }
}

/// Rows `8v .. 8v + 8` of a [`Meta`] field.
///
/// # Safety
/// AVX is available.
#[inline(always)]
unsafe fn rows_f(field: &[f32; PANEL], v: usize) -> __m256 {
    // SAFETY: `8v + 8 <= PANEL` for `v` 0 or 1; AVX (the caller).
    unsafe { _mm256_loadu_ps(field.as_ptr().add(8 * v)) }
}

/// Rows `8v .. 8v + 8` of an integer [`Meta`] field, shifted left by `shift`.
///
/// # Safety
/// AVX2 is available.
#[inline(always)]
unsafe fn rows_shl(field: &[i32; PANEL], v: usize, shift: u32) -> __m256i {
    // SAFETY: as for [`rows_f`], with AVX2.
    unsafe { _mm256_sll_epi32(_mm256_loadu_si256(field.as_ptr().add(8 * v).cast()), _mm_cvtsi32_si128(shift as i32)) }
}

/// One block's contribution to column `cc`'s accumulators of the [`RV`] row vectors: as
/// `super::tile::block`, the column's scales broadcast and the rows' fields loaded.
///
/// # Safety
/// As for [`dots`]; `m` is the block's [`Meta`].
#[inline(always)]
unsafe fn column_block<F: Format>(
    acc: &mut [__m256; RV],
    w: &[[u8; 32]; 8],
    sc: &[[f32; 8]; 4],
    cc: usize,
    xt: *const u8,
    m: *const Meta,
) {
    // SAFETY: the caller's guarantees; a field's rows `8v .. 8v + 8` are inside it.
    unsafe {
        let m = &*m;
        match F::KIND {
            Kind::Sym(off) => {
                // The plain AVX2 set's signed weights carry no bias (`I8_BIAS` 0).
                let off = if F::SIGNED { 0 } else { off };
                let shift = off.trailing_zeros();
                let is = dots::<F>(w, cc, xt, 0, 8);
                for v in 0..RV {
                    let x = if off != 0 { _mm256_sub_epi32(is[v], rows_shl(&m.s, v, shift)) } else { is[v] };
                    acc[v] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(x),
                        _mm256_mul_ps(_mm256_set1_ps(sc[0][cc]), rows_f(&m.d, v)),
                        acc[v],
                    );
                }
            }
            Kind::Min => {
                let is = dots::<F>(w, cc, xt, 0, 8);
                for v in 0..RV {
                    acc[v] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(is[v]),
                        _mm256_mul_ps(_mm256_set1_ps(sc[0][cc]), rows_f(&m.d, v)),
                        acc[v],
                    );
                    acc[v] = _mm256_fmadd_ps(_mm256_set1_ps(sc[1][cc]), rows_f(&m.ds, v), acc[v]);
                }
            }
            Kind::Split(off) => {
                let shift = off.trailing_zeros();
                let ia = dots::<F>(w, cc, xt, 0, 4);
                let ib = dots::<F>(w, cc, xt, 4, 8);
                for v in 0..RV {
                    let t = _mm256_mul_ps(
                        _mm256_cvtepi32_ps(_mm256_sub_epi32(ia[v], rows_shl(&m.sa, v, shift))),
                        _mm256_set1_ps(sc[0][cc]),
                    );
                    let t = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(_mm256_sub_epi32(ib[v], rows_shl(&m.sb, v, shift))),
                        _mm256_set1_ps(sc[1][cc]),
                        t,
                    );
                    acc[v] = _mm256_fmadd_ps(t, rows_f(&m.d, v), acc[v]);
                }
            }
            Kind::SplitMin => {
                let ia = dots::<F>(w, cc, xt, 0, 4);
                let ib = dots::<F>(w, cc, xt, 4, 8);
                for v in 0..RV {
                    let t = _mm256_mul_ps(_mm256_cvtepi32_ps(ia[v]), _mm256_set1_ps(sc[0][cc]));
                    let t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ib[v]), _mm256_set1_ps(sc[1][cc]), t);
                    acc[v] = _mm256_fmadd_ps(t, rows_f(&m.d, v), acc[v]);
                    acc[v] = _mm256_fmadd_ps(_mm256_set1_ps(sc[2][cc]), rows_f(&m.dsa, v), acc[v]);
                    acc[v] = _mm256_fmadd_ps(_mm256_set1_ps(sc[3][cc]), rows_f(&m.dsb, v), acc[v]);
                }
            }
        }
    }
}
