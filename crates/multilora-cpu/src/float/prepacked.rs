//! The kernel over a weight packed once, at load time ([`super::super::PackedWeight`]): panels of
//! [`PANEL`] output columns, each stored `k`-major (`panel[p · PANEL + c] = W[j0 + c, p]`), so
//! every product, a one-row decode step as much as a 1,024-row prefill, runs as outer products
//! with no horizontal sums and no packing in the step, reading the panels as one sequential stream.
//!
//! Row tiles are as tall as the rows allow (12, 8, 6, 4, 2 or 1, up to the instruction set's
//! register budget); each output is the same chain of FMAs over `k` in order whatever tile it
//! falls in, so a row's result is bit for bit the same whatever else is in the batch.

use super::{Elem, FloatSimd, Out, Rect, check_rects, packed_tile, run_rects};
#[cfg(target_arch = "x86_64")]
use crate::isa::{Avx2, Avx512F};
use crate::isa::{Isa, Portable};

/// Output columns per packed panel: two AVX-512 vectors (four AVX2 or portable ones).
pub(crate) const PANEL: usize = 32;

/// Row-tile heights, tallest first; an instruction set uses those up to its `PACKED_RM`.
const HEIGHTS: [usize; 6] = [12, 8, 6, 4, 2, 1];

/// The tallest tile height for `rows` rows that the instruction set has registers for.
#[inline(always)]
fn height<S: FloatSimd>(rows: usize) -> usize {
    HEIGHTS.into_iter().find(|&h| h <= rows && h <= S::PACKED_RM).unwrap_or(1)
}

/// [`packed_tile`] at a height picked at run time (one of [`HEIGHTS`]).
///
/// # Safety
/// As for [`packed_tile`] with `h` rows.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_h<S: FloatSimd, E: Elem, const PF: bool, const XT: bool>(
    h: usize,
    x: *const f32,
    ldx: usize,
    wp: *const E,
    ldp: usize,
    k: usize,
    y: *mut f32,
    ldy: usize,
    acc: bool,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match h {
            12 => packed_tile::<S, E, 12, PF, XT>(x, ldx, wp, ldp, k, y, ldy, acc),
            8 => packed_tile::<S, E, 8, PF, XT>(x, ldx, wp, ldp, k, y, ldy, acc),
            6 => packed_tile::<S, E, 6, PF, XT>(x, ldx, wp, ldp, k, y, ldy, acc),
            4 => packed_tile::<S, E, 4, PF, XT>(x, ldx, wp, ldp, k, y, ldy, acc),
            2 => packed_tile::<S, E, 2, PF, XT>(x, ldx, wp, ldp, k, y, ldy, acc),
            _ => packed_tile::<S, E, 1, PF, XT>(x, ldx, wp, ldp, k, y, ldy, acc),
        }
    }
}

/// Steps along `k` a panel is worked through at a time by all row tiles of a small batch: 16 KiB
/// of the panel, which stays in L1 for the tiles after the first, so the panel is read from
/// memory as one steady stream. A large batch (prefill, compute-bound) takes each panel in one
/// pass instead: cutting it stores and reloads every row's accumulators per chunk, measured ~30%
/// slower at 1,024 rows.
const K_CHUNK: usize = 128;

/// Up to this many rows a panel is cut into `K_CHUNK` steps.
const CHUNKED_ROWS: usize = 64;

/// `rows` rows of `x` against one panel (`PANEL` columns, `k`-major at `wp`), written at `y`:
/// for a small batch `K_CHUNK` steps along `k` at a time for every row tile, each chunk continuing the chains the
/// last one stored (the same FMAs in the same order as one pass).
///
/// # Safety
/// `rows` rows of `k` f32 from `x` (stride `ldx`) and `k · PANEL` f32 from `wp` readable; `rows`
/// rows of `PANEL` outputs at `y` (stride `ldy`) writable and nobody else's; `S`'s instruction set
/// available.
#[inline(always)]
unsafe fn panel_rows<S: FloatSimd, E: Elem>(
    rows: usize,
    x: *const f32,
    ldx: usize,
    wp: *const E,
    k: usize,
    y: *mut f32,
    ldy: usize,
) {
    let nr = 2 * S::LANES;
    let chunk = if rows <= CHUNKED_ROWS { K_CHUNK } else { k };
    let mut p0 = 0;
    loop {
        let kc = (k - p0).min(chunk);
        let acc = p0 > 0;
        let mut i = 0;
        while i < rows {
            let h = height::<S>(rows - i);
            for c in (0..PANEL).step_by(nr) {
                // SAFETY: rows `i..i + h <= rows` of `x` from column `p0`, steps `p0..p0 + kc <= k`
                // of the panel, columns `c..c + nr <= PANEL` of the panel and of the output block,
                // all inside what the caller vouched for.
                unsafe {
                    let (xp, wc, yp) = (x.add(i * ldx + p0), wp.add(p0 * PANEL + c), y.add(i * ldy + c));
                    tile_h::<S, E, true, false>(h, xp, ldx, wc, PANEL, kc, yp, ldy, acc);
                }
            }
            i += h;
        }
        p0 += kc;
        if p0 >= k {
            break;
        }
    }
}

/// One rectangle: for each panel it covers, every row of the rectangle. (A half-precision panel
/// is widened in each row tile as it is loaded: measured on AVX2, widening it once into an f32
/// block first was slower, at 16 rows and at 1,024: the block's extra traffic costs more than
/// the widening it saves.)
///
/// # Safety
/// As for [`fill_prepacked`]'s checks: the rectangle is inside `x`, the panels and the output,
/// starts on a panel boundary, nobody else touches it, and `S`'s instruction set is available.
#[inline(always)]
unsafe fn rect<S: FloatSimd, E: Elem>(x: &[f32], ldx: usize, panels: &[E], k: usize, out: Out, r: Rect) {
    let mut j = r.n0;
    while j < r.n1 {
        let cols = (r.n1 - j).min(PANEL);
        let panel = &panels[(j / PANEL) * k * PANEL..][..k * PANEL];
        // SAFETY: forwarded from the caller, for the panel starting at column `j`.
        unsafe { panel_block::<S, E>(x, ldx, panel, k, out, r, j, cols) };
        j += cols;
    }
}

/// Rows `m0..m1` of the rectangle against the panel at column `j` (`cols` of its `PANEL`
/// columns real). A panel cut short by the matrix edge (its padding columns are zero) is
/// computed into a scratch block and only its real columns copied out.
///
/// # Safety
/// As for [`rect`], with `panel` the `k · PANEL` values of the panel at column `j`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn panel_block<S: FloatSimd, E: Elem>(
    x: &[f32],
    ldx: usize,
    panel: &[E],
    k: usize,
    out: Out,
    r: Rect,
    j: usize,
    cols: usize,
) {
    const EDGE_ROWS: usize = 12;
    let mut edge = [0f32; EDGE_ROWS * PANEL];
    let wp = panel.as_ptr();
    let xp = x[r.m0 * ldx..].as_ptr();
    // SAFETY: rows `m0..m1` of `x`, the panel and outputs `(m0..m1, j..j + cols)` were checked
    // by `fill_prepacked`; an edge panel writes its `PANEL` columns into `edge` (`EDGE_ROWS`
    // rows at a time), of which only `cols` are copied into the output.
    unsafe {
        let yp = out.ptr.add(r.m0 * out.ldy + j);
        if cols == PANEL {
            panel_rows::<S, E>(r.m1 - r.m0, xp, ldx, wp, k, yp, out.ldy);
        } else {
            for i in (0..r.m1 - r.m0).step_by(EDGE_ROWS) {
                let rows = (r.m1 - r.m0 - i).min(EDGE_ROWS);
                panel_rows::<S, E>(rows, xp.add(i * ldx), ldx, wp, k, edge.as_mut_ptr(), PANEL);
                for q in 0..rows {
                    std::ptr::copy_nonoverlapping(edge.as_ptr().add(q * PANEL), yp.add((i + q) * out.ldy), cols);
                }
            }
        }
    }
}

/// Computes every rectangle of `rects` into `y` (`[.., ldy]`), `x: [m, k]` (row stride `ldx`)
/// against the panels of an `n`-column packed weight, on the rayon pool when `parallel`.
///
/// # Panics
/// When a rectangle reaches outside `x`, the panels or `y`, does not start on a panel boundary,
/// or overlaps another.
#[allow(clippy::too_many_arguments)]
pub(crate) fn fill_prepacked<E: Elem>(
    isa: Isa,
    (x, ldx): (&[f32], usize),
    (panels, n, k): (&[E], usize, usize),
    y: &mut [f32],
    ldy: usize,
    rects: &[Rect],
    parallel: bool,
) {
    assert!(panels.len() >= n.div_ceil(PANEL) * k * PANEL, "gemm: {} packed values for [{n}, {k}]", panels.len());
    check_rects(rects, y.len(), ldy, |r| {
        let rows_in = r.m1 <= r.m0 || (k <= ldx && (r.m1 - 1) * ldx + k <= x.len());
        r.n0 % PANEL == 0 && r.n1 <= n && rows_in
    });
    let isa = isa.float();
    let out = Out { ptr: y.as_mut_ptr(), ldy };
    let run = |r: &Rect| {
        if r.m0 == r.m1 || r.n0 == r.n1 {
            return;
        }
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX-512F was detected; the rectangles were checked to lie inside the
            // operands, on panel boundaries, and to be disjoint, so each task owns its outputs.
            Isa::Avx512 => unsafe { rect_avx512(x, ldx, panels, k, out, *r) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2, FMA and F16C were detected; bounds and disjointness as above.
            Isa::Avx2 => unsafe { rect_avx2(x, ldx, panels, k, out, *r) },
            // SAFETY: no instruction set needed; bounds and disjointness as above.
            _ => unsafe { rect::<Portable, E>(x, ldx, panels, k, out, *r) },
        }
    };
    run_rects(rects, parallel, run);
}

/// # Safety
/// As for [`rect`], with AVX-512F available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn rect_avx512<E: Elem>(x: &[f32], ldx: usize, panels: &[E], k: usize, out: Out, r: Rect) {
    // SAFETY: forwarded from the caller, which checked the features.
    unsafe { rect::<Avx512F, E>(x, ldx, panels, k, out, r) }
}

/// # Safety
/// As for [`rect`], with AVX2, FMA and F16C available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rect_avx2<E: Elem>(x: &[f32], ldx: usize, panels: &[E], k: usize, out: Out, r: Rect) {
    // SAFETY: forwarded from the caller, which checked the features.
    unsafe { rect::<Avx2, E>(x, ldx, panels, k, out, r) }
}

/// `y[i·ldy + j] = Σ_{p<k} x[i·ldx + p] · wt[p·ldw + j]` for `i < m`, `j < n`, on this thread,
/// with `wt` stored `k`-major (`[k, n]`, rows `ldw` apart): the LoRA expand over a slot's `Bᵀ`.
/// Row tiles as for a packed weight, `2·LANES` columns at a time read straight from `wt` (no
/// prefetch: `k` is a rank, the block is small), the last `n mod 2·LANES` columns one at a time.
/// With `accumulate`, each output's chain starts from its value in `y` instead of zero.
///
/// # Panics
/// When a row reaches outside its slice.
pub(crate) fn outer<E: Elem>(
    isa: Isa,
    (x, ldx): (&[f32], usize),
    (wt, ldw): (&[E], usize),
    (m, n, k): (usize, usize, usize),
    y: &mut [f32],
    ldy: usize,
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    let fits = k <= ldx
        && (m - 1) * ldx + k <= x.len()
        && (k == 0 || (n <= ldw && (k - 1) * ldw + n <= wt.len()))
        && n <= ldy
        && (m - 1) * ldy + n <= y.len();
    assert!(fits, "gemm: outer product [{m}, {k}] x [{k}, {n}] outside its operands");
    let isa = isa.float();
    let args = (x.as_ptr(), ldx, wt.as_ptr(), ldw, (m, n, k), y.as_mut_ptr(), ldy, accumulate);
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F was detected; the operands were checked to hold every row and column.
        Isa::Avx512 => unsafe { outer_avx512(args) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2, FMA and F16C were detected; bounds as above.
        Isa::Avx2 => unsafe { outer_avx2(args) },
        // SAFETY: no instruction set needed; bounds as above.
        _ => unsafe { outer_rows::<Portable, E, false>(args) },
    }
}

/// The operands of [`outer`] as checked pointers.
/// The last one: whether the products are added into `y` rather than written.
pub(crate) type OuterArgs<E> = (*const f32, usize, *const E, usize, (usize, usize, usize), *mut f32, usize, bool);

/// # Safety
/// As [`outer`] checks, and `S`'s instruction set available; with `XT`, `x` is stored `k`-major
/// (row `i`'s value at step `p` is `x[p·ldx + i]`, [`packed_tile`]'s `XT`) and holds `k` rows of
/// `m`.
#[inline(always)]
pub(crate) unsafe fn outer_rows<S: FloatSimd, E: Elem, const XT: bool>(
    (x, ldx, wt, ldw, (m, n, k), y, ldy, add): OuterArgs<E>,
) {
    let nr = 2 * S::LANES;
    let full = n / nr * nr;
    let at = |i: usize, p: usize| if XT { p * ldx + i } else { i * ldx + p };
    let mut i = 0;
    while i < m {
        let h = height::<S>(m - i);
        for c in (0..full).step_by(nr) {
            // SAFETY: rows `i..i + h <= m`, columns `c..c + nr <= n`, checked by the caller.
            unsafe {
                tile_h::<S, E, false, XT>(h, x.add(at(i, 0)), ldx, wt.add(c), ldw, k, y.add(i * ldy + c), ldy, add)
            };
        }
        i += h;
    }
    for i in 0..m {
        for j in full..n {
            // SAFETY: `i < m`, `j < n`, checked by the caller.
            let mut acc = if add { unsafe { *y.add(i * ldy + j) } } else { 0f32 };
            for p in 0..k {
                // SAFETY: `i < m`, `p < k`, `j < n`, checked by the caller.
                acc += unsafe { *x.add(at(i, p)) * (*wt.add(p * ldw + j)).to_f32() };
            }
            // SAFETY: as above.
            unsafe { *y.add(i * ldy + j) = acc };
        }
    }
}

/// # Safety
/// As for [`outer_rows`], with AVX-512F available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn outer_avx512<E: Elem>(args: OuterArgs<E>) {
    // SAFETY: forwarded from the caller, which checked the features.
    unsafe { outer_rows::<Avx512F, E, false>(args) }
}

/// # Safety
/// As for [`outer_rows`], with AVX2, FMA and F16C available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn outer_avx2<E: Elem>(args: OuterArgs<E>) {
    // SAFETY: forwarded from the caller, which checked the features.
    unsafe { outer_rows::<Avx2, E, false>(args) }
}
