//! The f32 / bf16 / f16 family: the products ([`linear`], [`Packed`], the LoRA segment products
//! and the fused LoRA kernel [`lora_rows`]), attention rows ([`attend`]), exp / softmax / SiLU /
//! GELU, the RMS norm's rows and the sampler's passes over a row of logits.
//!
//! The products' micro-kernels: `y[i, j] = Σ_k x[i, k] · w[j, k]`, with the rows of
//! `x` and of `w` both contiguous along `k` (row strides `ldx`, `ldw`). `x` and `y` are f32; `w`
//! is any [`Elem`]: f32, or bf16 / f16 widened to f32 in registers as it is loaded (exactly: every
//! bf16 and f16 value is an f32 value), so a half-precision weight is read from memory at half the
//! bytes and multiplied by the same chains of f32 FMAs as an f32 one.
//!
//! - Streaming ([`tile`], llama.cpp's tinyBLAS): nothing is packed. A tile of `RM` rows of `x` by
//!   `RN` rows of `w` keeps `RM · RN` vector accumulators in registers; each step along `k` loads
//!   `RN` vectors of `w` and `RM` of `x` and issues `RM · RN` FMAs; the accumulators are summed
//!   horizontally once at the end, and a `k` not a multiple of the vector width finishes with a
//!   scalar tail. Used for small batches (decode), where `W` is read once from memory and the next
//!   tile's rows are prefetched.
//! - Packed ([`packed_tile`]): each panel of `2 · LANES` rows of `w` is copied `k`-major once, then
//!   `PACKED_RM` rows of `x` are multiplied against it as one outer product per step along `k`
//!   (broadcast `x`, two FMAs per row), with no horizontal sums. Used for large batches (prefill),
//!   which are compute-bound.
//!
//! Within one kernel every output element is computed by the same sequence of operations
//! whatever tile it falls in, so a row's result does not depend on the other rows of the batch or
//! on how the work was split over threads; the two kernels differ from each other by rounding.
//!
//! The `unsafe` here: raw-pointer vector loads and stores, the `#[target_feature]` entry points
//! (called only after [`Isa::available`]) and the shared output pointer that threads write
//! disjoint rectangles through. [`fill`], the safe entry point, checks every rectangle against
//! the slices and against each other before any of that runs.

use crate::isa::{Avx2, Avx512F, Isa, Portable};

/// Generates the dispatch of a slice function over the instruction sets: `$name` picks
/// `$body` compiled for AVX-512F, for AVX2 + FMA, or portable.
macro_rules! dispatched {
    ($(#[$doc:meta])* fn $name:ident / $body:ident ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        $(#[$doc])*
        pub fn $name(isa: Isa, $($arg: $ty),*) -> $ret {
            /// # Safety
            /// AVX-512F must be available.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f")]
            unsafe fn avx512($($arg: $ty),*) -> $ret {
                $body($($arg),*)
            }
            /// # Safety
            /// AVX2 and FMA must be available.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2($($arg: $ty),*) -> $ret {
                $body($($arg),*)
            }
            let isa = isa.float();
            match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX-512F was detected (`available`).
                Isa::Avx512 => unsafe { avx512($($arg),*) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX2, FMA and F16C were detected.
                Isa::Avx2 => unsafe { avx2($($arg),*) },
                _ => $body($($arg),*),
            }
        }
    };
}

mod attend;
mod decode;
mod elem;
mod exp;
mod flash;
mod logits;
mod lora;
mod norm;
mod prepacked;
mod product;

pub use attend::{Head, MAX_GROUP, attend, supports as attend_supports};
pub use decode::{DECODE_PART, decode_attention, runs};
pub use elem::{Elem, ElemKind};
pub use exp::{exp, exp_sum, gelu_tanh_mul, silu_mul, softmax, softmax_stats};
#[cfg(test)]
pub(crate) use flash::workspace_bytes;
pub use flash::{Causal, KEY_BLOCK, causal_attention, causal_workspace_bytes, query_tile};
pub use logits::{argmax, exp_weights, row_max};
pub use norm::{ROWS as NORM_ROWS, rms_rows};
use prepacked::{PANEL, fill_prepacked, outer, outer_rows};
pub use product::{
    LORA_ROWS, Packed, linear, lora_rows, matmul_into, matmul_into_with, matmul_t_into, matmul_t_into_with,
};

/// A rectangle of the output: rows `m0..m1`, columns `n0..n1`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rect {
    pub(crate) m0: usize,
    pub(crate) m1: usize,
    pub(crate) n0: usize,
    pub(crate) n1: usize,
}

/// One vector instruction set: the few operations a tile needs.
trait FloatSimd {
    type V: Copy;
    const LANES: usize;
    /// Whether the set has fused multiply-adds (scalar code compiled for it may use `mul_add`).
    const FMA: bool;
    /// Output rows per tile.
    const RM: usize;
    /// Output columns per tile.
    const RN: usize;
    /// # Safety
    /// The instruction set must be available.
    unsafe fn zero() -> Self::V;
    /// # Safety
    /// `p..p + LANES` must be readable, and the instruction set must be available.
    unsafe fn load(p: *const f32) -> Self::V;
    /// `LANES` bf16 values widened to f32.
    ///
    /// # Safety
    /// `p..p + LANES` must be readable, and the instruction set must be available.
    unsafe fn load_bf16(p: *const u16) -> Self::V;
    /// `LANES` f16 values widened to f32.
    ///
    /// # Safety
    /// `p..p + LANES` must be readable, and the instruction set must be available.
    unsafe fn load_f16(p: *const u16) -> Self::V;
    /// `LANES` weight elements widened to f32 (the match is resolved at compile time).
    ///
    /// # Safety
    /// `p..p + LANES` must be readable, and the instruction set must be available.
    #[inline(always)]
    unsafe fn load_elem<E: Elem>(p: *const E) -> Self::V {
        // SAFETY: forwarded from the caller; `E::KIND` names how `E` is stored.
        unsafe {
            match E::KIND {
                ElemKind::F32 => Self::load(p.cast()),
                ElemKind::Bf16 => Self::load_bf16(p.cast()),
                ElemKind::F16 => Self::load_f16(p.cast()),
            }
        }
    }
    /// # Safety
    /// The instruction set must be available.
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// # Safety
    /// The instruction set must be available.
    unsafe fn hsum(v: Self::V) -> f32;
    /// Asks for the cache line of `p` ahead of its use; any address is fine (no access is made).
    fn prefetch(p: *const f32);
    /// # Safety
    /// The instruction set must be available.
    unsafe fn splat(v: f32) -> Self::V;
    /// # Safety
    /// `p..p + LANES` must be writable, and the instruction set must be available.
    unsafe fn store(p: *mut f32, v: Self::V);
    /// A full `RM × RN` tile ([`tile`] at this set's shape).
    ///
    /// # Safety
    /// As for [`tile`].
    unsafe fn full<E: Elem>(x: *const f32, ldx: usize, w: *const E, ldw: usize, k: usize, y: *mut f32, ldy: usize);
    /// One row against `RN` rows of `w`.
    ///
    /// # Safety
    /// As for [`tile`].
    unsafe fn row<E: Elem>(x: *const f32, ldx: usize, w: *const E, ldw: usize, k: usize, y: *mut f32, ldy: usize);
    /// `RM` rows against one row of `w`.
    ///
    /// # Safety
    /// As for [`tile`].
    unsafe fn col<E: Elem>(x: *const f32, ldx: usize, w: *const E, ldw: usize, k: usize, y: *mut f32, ldy: usize);
    /// A full tile of the packed kernel ([`packed_tile`] at `PACKED_RM` rows).
    ///
    /// # Safety
    /// As for [`packed_tile`].
    unsafe fn packed_full(x: *const f32, ldx: usize, wp: *const f32, k: usize, y: *mut f32, ldy: usize);
    /// One row of the packed kernel.
    ///
    /// # Safety
    /// As for [`packed_tile`].
    unsafe fn packed_row(x: *const f32, ldx: usize, wp: *const f32, k: usize, y: *mut f32, ldy: usize);
    /// Rows of a packed tile.
    const PACKED_RM: usize;
}

/// The tile entry points of a [`FloatSimd`] impl, at its `RM × RN`.
macro_rules! tiles {
    ($rm:literal, $rn:literal, $prm:literal) => {
        const PACKED_RM: usize = $prm;

        #[inline(always)]
        unsafe fn packed_full(x: *const f32, ldx: usize, wp: *const f32, k: usize, y: *mut f32, ldy: usize) {
            // SAFETY: forwarded from the caller.
            unsafe { packed_tile::<Self, f32, $prm, false, false>(x, ldx, wp, 2 * Self::LANES, k, y, ldy, false) }
        }

        #[inline(always)]
        unsafe fn packed_row(x: *const f32, ldx: usize, wp: *const f32, k: usize, y: *mut f32, ldy: usize) {
            // SAFETY: forwarded from the caller.
            unsafe { packed_tile::<Self, f32, 1, false, false>(x, ldx, wp, 2 * Self::LANES, k, y, ldy, false) }
        }

        #[inline(always)]
        unsafe fn full<E: Elem>(x: *const f32, ldx: usize, w: *const E, ldw: usize, k: usize, y: *mut f32, ldy: usize) {
            // SAFETY: forwarded from the caller.
            unsafe { tile::<Self, E, $rm, $rn>(x, ldx, w, ldw, k, y, ldy) }
        }

        #[inline(always)]
        unsafe fn row<E: Elem>(x: *const f32, ldx: usize, w: *const E, ldw: usize, k: usize, y: *mut f32, ldy: usize) {
            // SAFETY: forwarded from the caller.
            unsafe { tile::<Self, E, 1, $rn>(x, ldx, w, ldw, k, y, ldy) }
        }

        #[inline(always)]
        unsafe fn col<E: Elem>(x: *const f32, ldx: usize, w: *const E, ldw: usize, k: usize, y: *mut f32, ldy: usize) {
            // SAFETY: forwarded from the caller.
            unsafe { tile::<Self, E, $rm, 1>(x, ldx, w, ldw, k, y, ldy) }
        }
    };
}

// The impls for each instruction set (after `tiles!`, which they use).
mod simd;

/// One `RM × RN` tile: rows `x, x + k, …` against rows `w, w + k, …`, written at `y` with row
/// stride `ldy`.
///
/// # Safety
/// `RM` rows of `k` f32 from `x`, `RN` rows from `w` must be readable, the `RM × RN` outputs
/// writable and not accessed by anyone else, and `S`'s instruction set available.
#[inline(always)]
unsafe fn tile<S: FloatSimd, E: Elem, const RM: usize, const RN: usize>(
    x: *const f32,
    ldx: usize,
    w: *const E,
    ldw: usize,
    k: usize,
    y: *mut f32,
    ldy: usize,
) {
    // SAFETY: the caller guarantees the instruction set.
    let mut acc = [[unsafe { S::zero() }; RN]; RM];
    let kv = k / S::LANES * S::LANES;
    let mut p = 0;
    while p < kv {
        // SAFETY: the caller guarantees the instruction set.
        let mut wv = [unsafe { S::zero() }; RN];
        for (j, v) in wv.iter_mut().enumerate() {
            // SAFETY: `p + LANES <= k`, inside row `j < RN` of `w`.
            *v = unsafe { S::load_elem(w.add(j * ldw + p)) };
            // The next tile's rows of `w`: each is its own page-sized stream, which the hardware
            // prefetcher picks up too late to keep a memory-bound decode step streaming.
            S::prefetch(w.wrapping_add((RN + j) * ldw + p).cast());
        }
        for (i, row) in acc.iter_mut().enumerate() {
            // SAFETY: `p + LANES <= k`, inside row `i < RM` of `x`.
            let xv = unsafe { S::load(x.add(i * ldx + p)) };
            for (a, &wj) in row.iter_mut().zip(&wv) {
                // SAFETY: the caller guarantees the instruction set.
                *a = unsafe { S::fma(xv, wj, *a) };
            }
        }
        p += S::LANES;
    }
    for (i, row) in acc.iter().enumerate() {
        for (j, &a) in row.iter().enumerate() {
            // SAFETY: the caller guarantees the instruction set.
            let mut s = unsafe { S::hsum(a) };
            for q in kv..k {
                // SAFETY: `q < k`, inside rows `i` of `x` and `j` of `w`.
                s += unsafe { *x.add(i * ldx + q) * (*w.add(j * ldw + q)).to_f32() };
            }
            // SAFETY: output `(i, j)` of the tile is the caller's to write.
            unsafe { *y.add(i * ldy + j) = s };
        }
    }
}

/// The output, shared by the threads; each writes only its own rectangles.
#[derive(Clone, Copy)]
struct Out {
    ptr: *mut f32,
    ldy: usize,
}

// SAFETY: `Out` is only handed to tasks whose rectangles are disjoint (see `fill`), so no two
// threads ever write, or read, the same element.
unsafe impl Send for Out {}
// SAFETY: as above.
unsafe impl Sync for Out {}

/// Computes one rectangle: panels of `w` rows that stay in L2, tiles inside them.
///
/// # Safety
/// `x` holds `m1` rows and `w` holds `n1` rows of `k` f32; the rectangle is inside the output,
/// nobody else touches it, and `S`'s instruction set is available.
#[inline(always)]
unsafe fn rect<S: FloatSimd, E: Elem>(o: Operands<'_, E>, out: Out, r: Rect, panel: usize) {
    let Operands { x, ldx, w, ldw, k } = o;
    let (rm, rn) = (S::RM, S::RN);
    let panel = panel.div_ceil(rn) * rn;
    let mut n0 = r.n0;
    while n0 < r.n1 {
        let n1 = (n0 + panel).min(r.n1);
        let mut i = r.m0;
        while i < r.m1 {
            let rows = (r.m1 - i).min(rm);
            let mut j = n0;
            while j < n1 {
                let cols = (n1 - j).min(rn);
                let xp = x[i * ldx..].as_ptr();
                let wp = w[j * ldw..].as_ptr();
                // SAFETY: row `i + rows <= m1` of `x` and `j + cols <= n1` of `w` exist, and
                // output `(i.., j..)` lies in this task's rectangle.
                unsafe {
                    let yp = out.ptr.add(i * out.ldy + j);
                    dispatch::<S, E>(rows, cols, xp, ldx, wp, ldw, k, yp, out.ldy);
                }
                j += cols;
            }
            i += rows;
        }
        n0 = n1;
    }
}

/// A full tile, or rows/columns one at a time at the edges.
///
/// # Safety
/// As for [`tile`] with `rows × cols` outputs.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn dispatch<S: FloatSimd, E: Elem>(
    rows: usize,
    cols: usize,
    x: *const f32,
    ldx: usize,
    w: *const E,
    ldw: usize,
    k: usize,
    y: *mut f32,
    ldy: usize,
) {
    // SAFETY: forwarded from the caller; each call covers a sub-tile of the `rows × cols` block.
    unsafe {
        if rows == S::RM && cols == S::RN {
            S::full(x, ldx, w, ldw, k, y, ldy);
            return;
        }
        if rows == S::RM {
            for j in 0..cols {
                S::col(x, ldx, w.add(j * ldw), ldw, k, y.add(j), ldy);
            }
            return;
        }
        for i in 0..rows {
            if cols == S::RN {
                S::row(x.add(i * ldx), ldx, w, ldw, k, y.add(i * ldy), ldy);
            } else {
                for j in 0..cols {
                    tile::<S, E, 1, 1>(x.add(i * ldx), ldx, w.add(j * ldw), ldw, k, y.add(i * ldy + j), ldy);
                }
            }
        }
    }
}

/// One `MR × 2·LANES` tile of the packed kernel (an outer product per step along `k`, no
/// horizontal sums): `MR` rows of `x` (row stride `ldx`) against `2·LANES` columns of a panel
/// packed `k`-major (`ldp` values per `k`, [`pack`]), written at `y` with row stride `ldy`; with
/// `accumulate`, the chains start from the values at `y` instead of zero, so a product cut into
/// steps along `k` is the same chain of FMAs, in order, as one uncut. Each output is one chain of
/// FMAs over `k` in order, whatever `MR`. With `XT`, `x` is stored `k`-major instead (row `r`'s
/// value at step `p` is `x[p·ldx + r]`: the values of the prefill attention's `P · V`, read
/// as `Vᵀ`); its values are broadcast one at a time either way.
///
/// # Safety
/// `MR` rows of `k` f32 from `x` (`k` rows of `MR` with `XT`), `2·LANES` f32 at each `wp + p·ldp`
/// (`p < k`) readable; `MR` rows of `2·LANES` outputs writable and nobody else's; `S`'s
/// instruction set available.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn packed_tile<S: FloatSimd, E: Elem, const MR: usize, const PREFETCH: bool, const XT: bool>(
    x: *const f32,
    ldx: usize,
    wp: *const E,
    ldp: usize,
    k: usize,
    y: *mut f32,
    ldy: usize,
    accumulate: bool,
) {
    // SAFETY: the caller guarantees the instruction set.
    let mut acc = [[unsafe { S::zero() }; 2]; MR];
    if accumulate {
        for (r, a) in acc.iter_mut().enumerate() {
            // SAFETY: row `r < MR` of the tile, `2·LANES` outputs, the caller's to read and write.
            unsafe { *a = [S::load(y.add(r * ldy)), S::load(y.add(r * ldy + S::LANES))] };
        }
    }
    for p in 0..k {
        // SAFETY: `p < k`, inside the packed panel.
        let (w0, w1) = unsafe { (S::load_elem(wp.add(p * ldp)), S::load_elem(wp.add(p * ldp + S::LANES))) };
        // A panel read once from memory (a decode step) streams ahead of its use; past the end
        // of the panel this asks for the next one, which is where a pre-packed weight goes on.
        if PREFETCH {
            S::prefetch(wp.wrapping_add((p + PREFETCH_AHEAD) * ldp).cast());
            S::prefetch(wp.wrapping_add((p + PREFETCH_AHEAD) * ldp + S::LANES).cast());
        }
        for (r, a) in acc.iter_mut().enumerate() {
            // SAFETY: `p < k`, inside row `r < MR` of `x`; the instruction set is the caller's.
            unsafe {
                let b = S::splat(*x.add(if XT { p * ldx + r } else { r * ldx + p }));
                a[0] = S::fma(b, w0, a[0]);
                a[1] = S::fma(b, w1, a[1]);
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        // SAFETY: row `r < MR` of the tile, `2·LANES` outputs, the caller's to write.
        unsafe {
            S::store(y.add(r * ldy), a[0]);
            S::store(y.add(r * ldy + S::LANES), a[1]);
        }
    }
}

/// Steps along `k` that [`packed_tile`] prefetches its panel ahead (4 KiB of a pre-packed panel).
const PREFETCH_AHEAD: usize = 32;

/// Copies rows `j0..j0 + cols` of `w` (`[.., k]`) into `buf` `k`-major, `width` columns per `k`,
/// zero past `cols`.
fn pack<E: Elem>(w: &[E], ldw: usize, k: usize, j0: usize, cols: usize, width: usize, buf: &mut [f32]) {
    for c in 0..width {
        let dst = buf[c..].iter_mut().step_by(width);
        if c < cols {
            for (d, &v) in dst.zip(&w[(j0 + c) * ldw..(j0 + c) * ldw + k]) {
                *d = v.to_f32();
            }
        } else {
            dst.for_each(|d| *d = 0.0);
        }
    }
}

/// Computes one rectangle with the packed kernel: each `2·LANES`-column panel of `w` is packed
/// once, then every row tile of the rectangle runs over it.
///
/// # Safety
/// As for [`rect`].
#[inline(always)]
unsafe fn rect_packed<S: FloatSimd, E: Elem>(o: Operands<'_, E>, out: Out, r: Rect) {
    let Operands { x, ldx, w, ldw, k } = o;
    let nr = 2 * S::LANES;
    let mut buf = vec![0f32; k * nr];
    let mut edge = [0f32; 32];
    let mut j = r.n0;
    while j < r.n1 {
        let cols = (r.n1 - j).min(nr);
        pack(w, ldw, k, j, cols, nr, &mut buf);
        let mut i = r.m0;
        while i < r.m1 {
            let rows = (r.m1 - i).min(S::PACKED_RM);
            let xp = x[i * ldx..].as_ptr();
            // SAFETY: rows `i..i + rows <= m1` of `x`, the packed panel of `k · nr` values, and
            // outputs `(i.., j..j + cols)` of this task's rectangle; an edge panel narrower than
            // `nr` is computed into `edge` (`nr <= 32`) and only its `cols` columns copied out.
            unsafe {
                let yp = out.ptr.add(i * out.ldy + j);
                if cols == nr && rows == S::PACKED_RM {
                    S::packed_full(xp, ldx, buf.as_ptr(), k, yp, out.ldy);
                } else {
                    for q in 0..rows {
                        if cols == nr {
                            S::packed_row(xp.add(q * ldx), ldx, buf.as_ptr(), k, yp.add(q * out.ldy), out.ldy);
                        } else {
                            S::packed_row(xp.add(q * ldx), ldx, buf.as_ptr(), k, edge.as_mut_ptr(), nr);
                            std::ptr::copy_nonoverlapping(edge.as_ptr(), yp.add(q * out.ldy), cols);
                        }
                    }
                }
            }
            i += rows;
        }
        j += cols;
    }
}

/// The operands of one product: `x` rows `ldx` apart and `w` rows `ldw` apart, `k` values used
/// from each row.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Operands<'a, E> {
    pub(crate) x: &'a [f32],
    pub(crate) ldx: usize,
    pub(crate) w: &'a [E],
    pub(crate) ldw: usize,
    pub(crate) k: usize,
}

impl<E> Operands<'_, E> {
    /// Whether rows `..m1` of `x` and `..n1` of `w` are inside the slices.
    fn holds(&self, m1: usize, n1: usize) -> bool {
        let end = |rows: usize, ld: usize| if rows == 0 { 0 } else { (rows - 1) * ld + self.k };
        self.k <= self.ldx
            && self.k <= self.ldw
            && end(m1, self.ldx) <= self.x.len()
            && end(n1, self.ldw) <= self.w.len()
    }
}

/// Computes every rectangle of `rects` into `y` (`[.., ldy]` row-major), on the rayon pool when
/// `parallel`, with the packed kernel when `packed` (and the instruction set has one); `panel`
/// is how many rows of `w` the streaming kernel works through at a time.
///
/// # Panics
/// When a rectangle reaches outside `x`, `w` or `y`, or two rectangles overlap.
#[allow(clippy::too_many_arguments)]
pub(crate) fn fill<E: Elem>(
    isa: Isa,
    o: Operands<'_, E>,
    y: &mut [f32],
    ldy: usize,
    rects: &[Rect],
    panel: usize,
    parallel: bool,
    packed: bool,
) {
    check_rects(rects, y.len(), ldy, |r| o.holds(r.m1, r.n1));
    let isa = isa.float();
    let out = Out { ptr: y.as_mut_ptr(), ldy };
    let panel = panel.max(1);
    let run = |r: &Rect| match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F was detected just above; the rectangles were checked to lie inside the
        // operands and to be disjoint, so each task owns its outputs.
        Isa::Avx512 if packed => unsafe { rect_packed_avx512(o, out, *r) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx512 => unsafe { rect_avx512(o, out, *r, panel) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2, FMA and F16C were detected; bounds and disjointness as above.
        Isa::Avx2 if packed => unsafe { rect_packed_avx2(o, out, *r) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { rect_avx2(o, out, *r, panel) },
        // SAFETY: no instruction set needed; bounds and disjointness as above.
        _ => unsafe { rect::<Portable, E>(o, out, *r, panel) },
    };
    run_rects(rects, parallel, run);
}

/// Checks that every rectangle is well formed, inside an output of `len` values with row stride
/// `ldy` and inside the operands (`operands`), and that no two overlap: what makes writing them
/// from several threads through one pointer sound.
///
/// # Panics
/// When one is not.
fn check_rects(rects: &[Rect], len: usize, ldy: usize, operands: impl Fn(&Rect) -> bool) {
    for (t, r) in rects.iter().enumerate() {
        let inside =
            r.m0 <= r.m1 && r.n0 <= r.n1 && operands(r) && r.n1 <= ldy && r.m1.saturating_sub(1) * ldy + r.n1 <= len;
        assert!(inside, "gemm: rectangle {r:?} outside the operands");
        let overlaps = |q: &Rect| r.m0 < q.m1 && q.m0 < r.m1 && r.n0 < q.n1 && q.n0 < r.n1;
        assert!(!rects[..t].iter().any(overlaps), "gemm: rectangle {r:?} overlaps another");
    }
}

/// Runs `run` on every rectangle, side by side on the rayon pool when `parallel`.
fn run_rects(rects: &[Rect], parallel: bool, run: impl Fn(&Rect) + Sync + Send) {
    if parallel && rects.len() > 1 {
        crate::pool::for_each_index(rects.len(), |i| run(&rects[i]));
    } else {
        rects.iter().for_each(run);
    }
}

/// # Safety
/// As for [`rect`], with AVX-512F available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn rect_avx512<E: Elem>(o: Operands<'_, E>, out: Out, r: Rect, panel: usize) {
    // SAFETY: forwarded from the caller, which checked the features.
    unsafe { rect::<Avx512F, E>(o, out, r, panel) }
}

/// # Safety
/// As for [`rect`], with AVX-512F available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn rect_packed_avx512<E: Elem>(o: Operands<'_, E>, out: Out, r: Rect) {
    // SAFETY: forwarded from the caller, which checked the features.
    unsafe { rect_packed::<Avx512F, E>(o, out, r) }
}

/// # Safety
/// As for [`rect`], with AVX2, FMA and F16C available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rect_avx2<E: Elem>(o: Operands<'_, E>, out: Out, r: Rect, panel: usize) {
    // SAFETY: forwarded from the caller, which checked the features.
    unsafe { rect::<Avx2, E>(o, out, r, panel) }
}

/// # Safety
/// As for [`rect`], with AVX2, FMA and F16C available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rect_packed_avx2<E: Elem>(o: Operands<'_, E>, out: Out, r: Rect) {
    // SAFETY: forwarded from the caller, which checked the features.
    unsafe { rect_packed::<Avx2, E>(o, out, r) }
}
