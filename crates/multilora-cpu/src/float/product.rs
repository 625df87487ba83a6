//! The float products on slices: `y = x · Wᵀ` with `x`, `y` f32 and `W` f32, bf16 or f16, widened
//! to f32 in registers as it is read, so a half-precision weight costs half the bytes of memory
//! traffic and is multiplied exactly as its f32 value would be (f32 accumulation).
//!
//! ```text
//! y[i, j] = Σ_k x[i, k] · W[j, k]        x: [m, k], W: [n, k] (PyTorch's [out, in]), y: [m, n]
//! ```
//!
//! Up to `DECODE_ROWS` (64) rows (a decode step, bound by reading `W` from memory), both operands are
//! read in place, rows contiguous along `k`, in register tiles of `RM × RN` vector accumulators
//! (llama.cpp's tinyBLAS); `W` is read once, one tile of its rows at a time through all rows of
//! `x`. Above it (prefill, compute-bound), panels of `W` are packed `k`-major and multiplied as
//! outer products, with no horizontal sums. A weight kept for many products is packed once
//! ([`Packed`]). Either way the output is cut into rectangles ([`Plan`]) that run on the current
//! rayon pool ([`super`]).

use std::sync::Arc;

use rayon::prelude::*;

use super::lora::{self, Slot};
use super::{Elem, Operands, PANEL, Rect};
use crate::isa::Isa;

/// `x: [m, k]` · `w: [n, k]`ᵀ → `[m, n]` (all row-major) on `isa` (portable if the CPU lacks
/// it), cut for the current pool: in place up to `DECODE_ROWS` rows, panels of `w` packed on the
/// fly above.
///
/// # Panics
/// When `x` or `w` is shorter than its shape.
pub fn linear<E: Elem>(isa: Isa, x: &[f32], w: &[E], (m, n, k): (usize, usize, usize)) -> Vec<f32> {
    let mut y = vec![0f32; m * n];
    let threads = crate::pool::threads();
    let packed = m > DECODE_ROWS && isa.float() != Isa::Portable;
    let plan = Plan::new(m, n, k, threads, packed, COL_ALIGN);
    let o = Operands { x, ldx: k, w, ldw: k, k };
    super::fill(isa, o, &mut y, n, &plan.rects, plan.panel, plan.parallel, packed);
    y
}

/// `y[i·ldy + j] = Σ_{p<k} x[i·ldx + p] · w[j·ldw + p]` for `i < m`, `j < n`, on this thread with
/// the streaming kernel, whatever `m` (so a row's result does not depend on its segment's size):
/// the LoRA shrink `x · Aᵀ` of a segment, segments side by side on the pool.
///
/// # Panics
/// When a row reaches outside its slice.
#[allow(clippy::too_many_arguments)]
pub fn matmul_t_into<E: Elem>(
    x: &[f32],
    ldx: usize,
    w: &[E],
    ldw: usize,
    mnk: (usize, usize, usize),
    y: &mut [f32],
    ldy: usize,
) {
    matmul_t_into_with(Isa::best(), x, ldx, w, ldw, mnk, y, ldy);
}

/// [`matmul_t_into`] on a chosen instruction set (portable if the CPU lacks it).
#[allow(clippy::too_many_arguments)]
pub fn matmul_t_into_with<E: Elem>(
    isa: Isa,
    x: &[f32],
    ldx: usize,
    w: &[E],
    ldw: usize,
    (m, n, k): (usize, usize, usize),
    y: &mut [f32],
    ldy: usize,
) {
    let o = Operands { x, ldx, w, ldw, k };
    super::fill(isa, o, y, ldy, &[Rect { m0: 0, m1: m, n0: 0, n1: n }], 1, false, false);
}

/// A weight `W: [n, k]` packed once for the float kernels: panels of 32 output columns, each
/// stored `k`-major, so that every product with it, whatever the number of rows, runs as outer
/// products (no horizontal sums, nothing packed during a step) and reads `W` as one sequential
/// stream. The same bytes in the same element type as the weight (plus the zero padding of the
/// last panel), not a second copy; cloning shares them.
///
/// Each output is one chain of f32 FMAs over `k` in order, so a row's result is bit for bit the
/// same whatever the other rows of the batch are: batch invariance holds across decode and
/// prefill, in every element type.
#[derive(Clone)]
pub struct Packed<E> {
    panels: Arc<Vec<E>>,
    n: usize,
    k: usize,
}

impl<E> std::fmt::Debug for Packed<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Packed[{}, {}]", self.n, self.k)
    }
}

impl<E: Elem> Packed<E> {
    /// Packs the `[n, k]` weight whose rows are those of `parts` in order (each `[n_i, k]`
    /// row-major: e.g. q, k and v of a fused projection), read in place.
    ///
    /// # Panics
    /// When the parts do not hold `n · k` values.
    pub fn pack(parts: &[&[E]], n: usize, k: usize) -> Packed<E> {
        assert_eq!(parts.iter().map(|p| p.len()).sum::<usize>(), n * k, "Packed::pack: the parts are not [{n}, {k}]");
        Packed { panels: pack_panels(parts, k), n, k }
    }

    /// `(n, k)`: output and input features.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// The `[n, k]` rows again (a copy).
    pub fn unpack(&self) -> Vec<E> {
        unpack_panels(&self.panels, self.n, self.k)
    }

    /// `x: [m, k]` · `Wᵀ` → `[m, n]` f32 on `isa` (portable if the CPU lacks it), cut for the
    /// current pool.
    ///
    /// # Panics
    /// When `x` is shorter than `m · k`.
    pub fn product(&self, isa: Isa, x: &[f32], m: usize) -> Vec<f32> {
        let (n, k) = (self.n, self.k);
        let mut y = vec![0f32; m * n];
        let plan = Plan::new(m, n, k, crate::pool::threads(), true, PANEL);
        super::fill_prepacked(isa, (x, k), (&self.panels, n, k), &mut y, n, &plan.rects, plan.parallel);
        y
    }
}

/// Packs the rows of `parts` (one weight `[n, k]` cut along its rows: `[n_i, k]` each, in order)
/// into panels of `PANEL` columns, `k`-major, zero past `n`; the parts are read in place.
fn pack_panels<E: Elem>(parts: &[&[E]], k: usize) -> Arc<Vec<E>> {
    let n: usize = parts.iter().map(|p| p.len() / k.max(1)).sum();
    let row = |mut j: usize| -> &[E] {
        for p in parts {
            let rows = p.len() / k.max(1);
            if j < rows {
                return &p[j * k..][..k];
            }
            j -= rows;
        }
        &[]
    };
    let mut panels = vec![E::default(); n.div_ceil(PANEL) * k * PANEL];
    panels.par_chunks_mut((k * PANEL).max(1)).enumerate().for_each(|(p, dst)| {
        let j0 = p * PANEL;
        for c in 0..PANEL.min(n.saturating_sub(j0)) {
            for (d, &v) in dst[c..].iter_mut().step_by(PANEL).zip(row(j0 + c)) {
                *d = v;
            }
        }
    });
    Arc::new(panels)
}

/// The `[n, k]` rows of panels packed by [`pack_panels`].
fn unpack_panels<E: Elem>(panels: &[E], n: usize, k: usize) -> Vec<E> {
    let mut w = vec![E::default(); n * k];
    w.par_chunks_mut(k.max(1)).enumerate().for_each(|(j, row)| {
        let panel = &panels[(j / PANEL) * k * PANEL..];
        for (d, &v) in row.iter_mut().zip(panel[j % PANEL..].iter().step_by(PANEL)) {
            *d = v;
        }
    });
    w
}

/// `y[i·ldy + j] = Σ_{p<k} x[i·ldx + p] · wt[p·ldw + j]` for `i < m`, `j < n`, on this thread:
/// `wt` is stored `k`-major (`[k, n]`), as a LoRA slot's `Bᵀ` is, so the product is a sum of
/// outer products with no horizontal sums (the LoRA expand). With `accumulate`, the products are
/// added into `y`: each output's chain of FMAs starts from its value there (a product cut along
/// `k` into runs is the same chain as one uncut).
///
/// # Panics
/// When a row reaches outside its slice.
#[allow(clippy::too_many_arguments)]
pub fn matmul_into<E: Elem>(
    x: &[f32],
    ldx: usize,
    wt: &[E],
    ldw: usize,
    mnk: (usize, usize, usize),
    y: &mut [f32],
    ldy: usize,
    accumulate: bool,
) {
    matmul_into_with(Isa::best(), x, ldx, wt, ldw, mnk, y, ldy, accumulate);
}

/// [`matmul_into`] on a chosen instruction set (portable if the CPU lacks it).
#[allow(clippy::too_many_arguments)]
pub fn matmul_into_with<E: Elem>(
    isa: Isa,
    x: &[f32],
    ldx: usize,
    wt: &[E],
    ldw: usize,
    mnk: (usize, usize, usize),
    y: &mut [f32],
    ldy: usize,
    accumulate: bool,
) {
    super::outer(isa, (x, ldx), (wt, ldw), mnk, y, ldy, accumulate);
}

/// Rows a [`lora_rows`] call takes at most.
pub const LORA_ROWS: usize = lora::LORA_ROWS;

/// `ys[i] += (xs[i] · Aᵀ) · Bᵀ` for up to [`LORA_ROWS`] rows through one adapter's slot (`a`:
/// `[rank, k]`, `bt`: `[rank, out]`, `k` and `out` the rows' lengths), on `isa` (portable if the
/// CPU lacks it) with `scratch` of at least `rows · rank` values: bit for bit what
/// [`matmul_t_into_with`] then [`matmul_into_with`] and an add give on the same `isa`, reading
/// each operand once, in order.
pub fn lora_rows<E: Elem>(
    isa: Isa,
    xs: &[&[f32]],
    (a, bt, rank): (&[E], &[E], usize),
    ys: &mut [&mut [f32]],
    scratch: &mut [f32],
) {
    lora::lora_rows(isa, xs, Slot { a, bt, rank }, ys, scratch);
}

/// How one product is cut into rectangles of the output.
#[derive(Debug)]
pub(crate) struct Plan {
    rects: Vec<Rect>,
    /// Rows of `W` a rectangle works through at a time (about 256 KiB of them, so they stay in L2).
    panel: usize,
    parallel: bool,
}

/// Up to this many rows (decode steps) the product streams `W` in place; above it (prefill),
/// panels of `W` are packed and multiplied as outer products.
const DECODE_ROWS: usize = 64;

/// Below this many multiply-adds, threads cost more than they save.
const PARALLEL_WORK: usize = 1 << 20;

/// Bytes of `x` one rectangle's rows may take, so they stay in L2 while `W` streams past.
const X_BLOCK_BYTES: usize = 1 << 20;

/// Bytes of `W` in one panel.
const PANEL_BYTES: usize = 256 << 10;

/// Columns of a rectangle are a multiple of this (a multiple of every tile width).
const COL_ALIGN: usize = 96;

impl Plan {
    /// `align`: rectangles start on multiples of it (the tile widths, or the packed panels).
    fn new(m: usize, n: usize, k: usize, threads: usize, packed: bool, align: usize) -> Plan {
        let row_bytes = 4 * k.max(1);
        let parallel = threads > 1 && m * n * k >= PARALLEL_WORK;
        // Small batches (decode) keep all rows in one block, so `W` is read from memory once;
        // so does the packed kernel, which packs each panel of `W` once (cutting the rows into
        // L2-sized blocks instead, with each panel packed and read once per block, measured
        // slower: `W` then comes from memory several times); large unpacked ones (the portable
        // path) cut rows into blocks of `x` that fit in L2, in whole tiles.
        let mb = if m <= DECODE_ROWS || packed { m.max(1) } else { (X_BLOCK_BYTES / row_bytes).clamp(16, m) / 4 * 4 };
        let m_blocks = m.div_ceil(mb).max(1);
        // Several rectangles per thread, so a thread slowed by another process is caught up on.
        let wanted = if parallel { threads * 8 } else { 1 };
        let n_chunks = wanted.div_ceil(m_blocks).clamp(1, n.div_ceil(2 * align).max(1));
        let nc = n.div_ceil(n_chunks).div_ceil(align) * align;
        let mut rects = Vec::new();
        for m0 in (0..m).step_by(mb) {
            for n0 in (0..n).step_by(nc.max(1)) {
                rects.push(Rect { m0, m1: (m0 + mb).min(m), n0, n1: (n0 + nc).min(n) });
            }
        }
        // A decode step takes one tile of `W` rows at a time through all its rows, so each
        // row of `W` is read from memory once and the stream never pauses for a second pass.
        let panel = if m <= DECODE_ROWS { 1 } else { (PANEL_BYTES / row_bytes).max(COL_ALIGN) / COL_ALIGN * COL_ALIGN };
        Plan { rects, panel, parallel }
    }
}
