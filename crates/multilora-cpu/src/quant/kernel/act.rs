//! Activation quantization: each row of `x` cut into blocks of 32, each block to integer quants
//! of about 16 bits with one f32 scale, held as two i8 planes (`Q = 254 · hi + lo`), and the
//! integer sums of its quants that the weights' offsets and minima need (Q8_1's sum, kept exact).
//!
//! Rows are stored in panels of [`PANEL`] (16): within a panel, block by block, the 16 rows' 32
//! `hi` quants side by side, then their 32 `lo` quants (`qs[p][b][plane][r][32]`: a row's `lo`
//! is [`LO`] bytes after its `hi`), and their scales and sums field by field ([`Meta`]:
//! `meta[p][b].d[r]`, …), so a row tile reaches all its rows' operands from one address plus
//! constant offsets, an epilogue reads only the cache lines of its fields, and a plane of a
//! panel's block is one 16-row operand of the AMX tile unit (rows 32 bytes apart).
//!
//! ```text
//! d = max|x_i| / (127 · 254),   Q_i = round_ties_even(x_i · (1 / d)) (0 when d = 0)
//! hi_i = ⌊(Q_i + 127) / 254⌋,   lo_i = Q_i − 254 · hi_i    (both in −127 ..= 127)
//! s = Σ Q_i
//! ```
//!
//! GGML quantizes activations to 8 bits (Q8_0 / Q8_1: `max|x| / 127`); the second plane makes the
//! error 254 times smaller (at most `d / 2` a value, `max|x| / 64,516`) for one more integer dot
//! product per block against the same decoded weights, which is what keeps the quantized path as
//! close to the dequantized model as llama.cpp is, or closer (docs/BENCHMARKS.md).
//!
//! A block depends on its own 32 values only, so a row's quants do not depend on the batch; the
//! plain-Rust routine (IEEE operations, no contraction) runs where no vector one does, and the
//! AVX-512 and AVX2 ones do the same operations on 16 and 8 lanes, so every set quantizes to the
//! same bits.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::isa::Isa;
use crate::pool::{AddOnDrop, wait_until};

/// Rows per panel: the AMX tile unit's 16 rows (the vector kernels take 8 at a time).
pub(crate) const PANEL: usize = 16;

/// Bytes from a row's `hi` quants of a block to its `lo` quants.
pub(crate) const LO: usize = 32 * PANEL;

/// Bytes of one block of a panel (both planes of its rows).
pub(crate) const BLOCK: usize = 2 * LO;

/// The largest `|Q|`: `max|x|` maps to it.
const QMAX: f32 = 127.0 * 254.0;

/// The scales and sums of one block of a panel's rows, field by field (one row per lane), each
/// as an epilogue reads it: a field is one 64-byte line.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(C, align(64))]
pub(crate) struct Meta {
    /// The scale `d`.
    pub(crate) d: [f32; PANEL],
    /// `d · s`, rounded once.
    pub(crate) ds: [f32; PANEL],
    /// `s = Σ Q` over the 32 quants; `sa`, `sb` over the first and the last 16.
    pub(crate) s: [i32; PANEL],
    pub(crate) sa: [i32; PANEL],
    pub(crate) sb: [i32; PANEL],
    /// `d · sa`, `d · sb`, rounded once.
    pub(crate) dsa: [f32; PANEL],
    pub(crate) dsb: [f32; PANEL],
    pad: [f32; PANEL],
}

impl Meta {
    /// Sets row `r`'s fields from the block's scale and its two half sums.
    #[inline(always)]
    fn set(&mut self, r: usize, d: f32, sa: i32, sb: i32) {
        let s = sa + sb;
        (self.d[r], self.ds[r], self.s[r], self.sa[r], self.sb[r]) = (d, d * s as f32, s, sa, sb);
        (self.dsa[r], self.dsb[r]) = (d * sa as f32, d * sb as f32);
    }
}

/// The quantized rows of `x: [m, k]`, in panels of [`PANEL`] rows (the last one padded):
/// `qs[p][b][plane][r][32]` and `meta[p][b]`.
#[derive(Debug)]
pub(crate) struct Act {
    pub(crate) qs: Vec<i8>,
    pub(crate) meta: Vec<Meta>,
    pub(crate) m: usize,
    pub(crate) k: usize,
}

impl Act {
    /// Blocks per row.
    pub(crate) fn nb(&self) -> usize {
        self.k / 32
    }

    /// Panels of [`PANEL`] rows (the last one padded).
    pub(crate) fn panels(&self) -> usize {
        self.m.div_ceil(PANEL)
    }

    /// Where row `i`'s block 0 is: its offset into `qs`, its panel's first [`Meta`] in `meta`,
    /// and its slot in the panel. Block `b` of the row is `BLOCK · b` and `b` further; the
    /// next row of the panel 32 bytes and one slot on.
    pub(crate) fn at(&self, i: usize) -> (usize, usize, usize) {
        let (p, r) = (i / PANEL, i % PANEL);
        (p * self.nb() * BLOCK + 32 * r, p * self.nb(), r)
    }
}

/// Splits `Q` (`|Q| <= QMAX`, integral) into its two planes: `(hi, lo)`, `Q = 254 · hi + lo`.
/// The quotient of two integers below 2²⁴ rounds correctly and is never within an ulp of the
/// next integer unless it is one, so `floor` is exact.
#[inline(always)]
fn split(q: f32) -> (f32, f32) {
    let hi = ((q + 127.0) / 254.0).floor();
    (hi, q - 254.0 * hi)
}

/// Slot `r`'s `hi` and `lo` quants in each block of a panel's `qs`.
#[inline(always)]
fn planes(qs: &mut [i8], r: usize) -> impl Iterator<Item = (&mut [i8], &mut [i8])> {
    let row = 32 * r..32 * r + 32;
    qs.chunks_exact_mut(BLOCK).map(move |b| {
        let (h, l) = b.split_at_mut(LO);
        (&mut h[row.clone()], &mut l[row.clone()])
    })
}

/// Quantizes one row `x` (`k` values) into slot `r` of its panel (`qs`, `meta`: the panel's).
#[inline(always)]
fn blocks(x: &[f32], qs: &mut [i8], meta: &mut [Meta], r: usize) {
    let qs = planes(qs, r);
    for ((xb, (hb, lb)), mt) in x.chunks_exact(32).zip(qs).zip(meta) {
        // The largest |x| as bits: for non-negative floats the integer order is the float order
        // (a NaN, larger than every number, makes the block NaN, as it should).
        let amax = xb.iter().fold(0u32, |a, v| a.max(v.to_bits() & 0x7fff_ffff));
        let d = f32::from_bits(amax) / QMAX;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut q = [0i32; 32];
        for (((o, h), l), &v) in q.iter_mut().zip(hb.iter_mut()).zip(lb.iter_mut()).zip(xb) {
            let t = (v * id).round_ties_even().clamp(-QMAX, QMAX);
            // A NaN quant is 0, as `as i32` makes it.
            let t = if t.is_nan() { 0.0 } else { t };
            let (hi, lo) = split(t);
            (*o, *h, *l) = (t as i32, hi as i8, lo as i8);
        }
        mt.set(r, d, q[..16].iter().sum(), q[16..].iter().sum());
    }
}

/// [`blocks`] with AVX-512: the same operations on 16 lanes, so the same bits (a NaN product
/// is masked to 0 as `as i32` makes it, integral values convert exactly, and the quants' sums,
/// integers below 2²⁴ all along, are exact in f32 in any order). The row is taken 16 blocks at a
/// time: first their largest `|x|`, then the 16 scales and reciprocals with one vector division
/// each (IEEE, as the scalar ones), then each block's quants, so no block waits on a scalar
/// division chain.
///
/// # Safety
/// AVX-512 F/BW/VL must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn blocks_avx512(x: &[f32], qs: &mut [i8], meta: &mut [Meta], r: usize) {
    use std::arch::x86_64::*;
    const GROUP: usize = 16;
    let mut qs = planes(qs, r);
    for (xg, mg) in x.chunks(32 * GROUP).zip(meta.chunks_mut(GROUP)) {
        // SAFETY: every block of `xg` holds 32 f32, every `hb` and `lb` 32 bytes; AVX-512 F/BW/VL
        // are available (the caller).
        unsafe {
            let abs = _mm512_set1_epi32(0x7fff_ffff);
            let mut amax = [0u32; GROUP];
            for (a, xb) in amax.iter_mut().zip(xg.chunks_exact(32)) {
                let (lo, hi) = (_mm512_loadu_si512(xb.as_ptr().cast()), _mm512_loadu_si512(xb.as_ptr().add(16).cast()));
                *a = _mm512_reduce_max_epu32(_mm512_max_epu32(_mm512_and_si512(lo, abs), _mm512_and_si512(hi, abs)));
            }
            // `d = max|x| / QMAX`; `1 / d`, or 0 where `d` is 0 (a NaN `d` gives a NaN, as the
            // scalar `d != 0.0` test lets it through).
            let d = _mm512_div_ps(_mm512_castsi512_ps(_mm512_loadu_si512(amax.as_ptr().cast())), _mm512_set1_ps(QMAX));
            let nonzero = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(d, _mm512_setzero_ps());
            let id = _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(1.0), d);
            let (mut ds, mut ids) = ([0f32; GROUP], [0f32; GROUP]);
            _mm512_storeu_ps(ds.as_mut_ptr(), d);
            _mm512_storeu_ps(ids.as_mut_ptr(), id);
            for (((xb, mt), &d), &id) in xg.chunks_exact(32).zip(mg.iter_mut()).zip(&ds).zip(&ids) {
                let Some((hb, lb)) = qs.next() else { return };
                let (lo, hi) = (_mm512_loadu_ps(xb.as_ptr()), _mm512_loadu_ps(xb.as_ptr().add(16)));
                let id = _mm512_set1_ps(id);
                // `(Q, hi, lo)`, NaN quants masked to 0: `Q` as f32, the planes as i32.
                let quant = |v: __m512| {
                    let t = _mm512_mul_ps(v, id);
                    let ordered = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(t, t);
                    let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
                    let t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-QMAX)), _mm512_set1_ps(QMAX));
                    let t = _mm512_maskz_mov_ps(ordered, t);
                    // `split`'s `⌊(Q + 127) / 254⌋` as a product by the rounded reciprocal, no
                    // division: for the integers `Q + 127` (below 2¹⁶) a multiple of 254 comes out
                    // as its exact quotient (the reciprocal's error is far below half an ulp of
                    // it) and any other stays at least 1/254 from the next integer, so the floor is
                    // the same (every quant checked: `every_quant_splits_as_the_portable_code`).
                    let h = _mm512_mul_ps(_mm512_add_ps(t, _mm512_set1_ps(127.0)), _mm512_set1_ps(1.0 / 254.0));
                    let h = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(h);
                    let l = _mm512_sub_ps(t, _mm512_mul_ps(_mm512_set1_ps(254.0), h));
                    (t, _mm512_cvtps_epi32(h), _mm512_cvtps_epi32(l))
                };
                let ((qa, ha, la), (qz, hz, lz)) = (quant(lo), quant(hi));
                _mm_storeu_si128(hb.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(ha));
                _mm_storeu_si128(hb.as_mut_ptr().add(16).cast(), _mm512_cvtepi32_epi8(hz));
                _mm_storeu_si128(lb.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(la));
                _mm_storeu_si128(lb.as_mut_ptr().add(16).cast(), _mm512_cvtepi32_epi8(lz));
                mt.set(r, d, _mm512_reduce_add_ps(qa) as i32, _mm512_reduce_add_ps(qz) as i32);
            }
        }
    }
}

/// [`blocks`] with AVX2, as [`blocks_avx512`] on 8 lanes: the same operations, so the same bits
/// (the planes packed to bytes with saturating packs, exact for quants in −127 ..= 127). The
/// portable routine compiled for AVX2 stays scalar (its rounding, clamp and NaN test per value
/// are not vectorised): ~84 ns a block against ~9 for AVX-512, which made the activations of a
/// 16-row SmolLM2 product cost as much as a third of the product on an AVX2-only CPU.
///
/// # Safety
/// AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn blocks_avx2(x: &[f32], qs: &mut [i8], meta: &mut [Meta], r: usize) {
    use std::arch::x86_64::*;
    const GROUP: usize = 8;
    let mut qs = planes(qs, r);
    for (xg, mg) in x.chunks(32 * GROUP).zip(meta.chunks_mut(GROUP)) {
        // SAFETY: every block of `xg` holds 32 f32, every `hb` and `lb` 32 bytes; AVX2 is
        // available (the caller).
        unsafe {
            let abs = _mm256_set1_epi32(0x7fff_ffff);
            let mut amax = [0u32; GROUP];
            for (a, xb) in amax.iter_mut().zip(xg.chunks_exact(32)) {
                // Closures called here, not through `std::array::from_fn`: a generic function
                // outside this one's instruction sets would keep them as calls (BENCHMARKS.md).
                let v = |i: usize| _mm256_and_si256(_mm256_loadu_si256(xb.as_ptr().add(8 * i).cast()), abs);
                let m = _mm256_max_epu32(_mm256_max_epu32(v(0), v(1)), _mm256_max_epu32(v(2), v(3)));
                let m = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256::<1>(m));
                let m = _mm_max_epu32(m, _mm_shuffle_epi32::<0b01_00_11_10>(m));
                let m = _mm_max_epu32(m, _mm_shuffle_epi32::<0b10_11_00_01>(m));
                *a = _mm_cvtsi128_si32(m) as u32;
            }
            // `d = max|x| / QMAX`; `1 / d`, or 0 where `d` is 0 (a NaN `d` gives a NaN).
            let d = _mm256_div_ps(_mm256_castsi256_ps(_mm256_loadu_si256(amax.as_ptr().cast())), _mm256_set1_ps(QMAX));
            let nonzero = _mm256_cmp_ps::<_CMP_NEQ_UQ>(d, _mm256_setzero_ps());
            let id = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0), d), nonzero);
            let (mut ds, mut ids) = ([0f32; GROUP], [0f32; GROUP]);
            _mm256_storeu_ps(ds.as_mut_ptr(), d);
            _mm256_storeu_ps(ids.as_mut_ptr(), id);
            for (((xb, mt), &d), &id) in xg.chunks_exact(32).zip(mg.iter_mut()).zip(&ds).zip(&ids) {
                let Some((hb, lb)) = qs.next() else { return };
                let id = _mm256_set1_ps(id);
                // `(Q, hi, lo)` of 8 values, NaN quants masked to 0 (as `blocks_avx512`'s).
                let quant = |v: __m256| {
                    let t = _mm256_mul_ps(v, id);
                    let ordered = _mm256_cmp_ps::<_CMP_ORD_Q>(t, t);
                    let t = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
                    let t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-QMAX)), _mm256_set1_ps(QMAX));
                    let t = _mm256_and_ps(t, ordered);
                    let h = _mm256_mul_ps(_mm256_add_ps(t, _mm256_set1_ps(127.0)), _mm256_set1_ps(1.0 / 254.0));
                    let h = _mm256_round_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(h);
                    let l = _mm256_sub_ps(t, _mm256_mul_ps(_mm256_set1_ps(254.0), h));
                    (t, _mm256_cvtps_epi32(h), _mm256_cvtps_epi32(l))
                };
                let at = |i: usize| quant(_mm256_loadu_ps(xb.as_ptr().add(8 * i)));
                let q = [at(0), at(1), at(2), at(3)];
                // Four vectors of i32 in −127 ..= 127 to 32 bytes in order: the packs interleave
                // 128-bit halves, the permutation puts their 4-byte groups back.
                let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
                let bytes = |a: __m256i, b: __m256i, c: __m256i, e: __m256i| {
                    let p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, e));
                    _mm256_permutevar8x32_epi32(p, order)
                };
                _mm256_storeu_si256(hb.as_mut_ptr().cast(), bytes(q[0].1, q[1].1, q[2].1, q[3].1));
                _mm256_storeu_si256(lb.as_mut_ptr().cast(), bytes(q[0].2, q[1].2, q[2].2, q[3].2));
                // The halves' sums of integral quants below 2²⁴: exact in any order.
                let sum = |a: __m256, b: __m256| {
                    let s = _mm256_add_ps(a, b);
                    let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
                    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s))) as i32
                };
                mt.set(r, d, sum(q[0].0, q[1].0), sum(q[2].0, q[3].0));
            }
        }
    }
}

thread_local! {
    /// The buffers of the last activations this thread dropped, for its next [`quantize`]: a
    /// step quantizes a few hundred activations of a few sizes, and fresh zeroed buffers cost a
    /// memset each on the step's serial path (~2 µs of a 16-row product of SmolLM2).
    static SPARE: RefCell<(Vec<i8>, Vec<Meta>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Buffers above this many bytes are not kept for the next call (a long prompt's).
const SPARE_MAX: usize = 8 << 20;

/// `v` at `len` values: cut, or grown with `fill` (the values it keeps are overwritten or
/// cleared by the caller).
fn reuse<T: Clone>(v: &mut Vec<T>, len: usize, fill: T) {
    if v.len() >= len {
        v.truncate(len);
    } else {
        v.resize(len, fill);
    }
}

impl Drop for Act {
    fn drop(&mut self) {
        if self.qs.capacity() + self.meta.capacity() * size_of::<Meta>() <= SPARE_MAX {
            let bufs = (std::mem::take(&mut self.qs), std::mem::take(&mut self.meta));
            SPARE.with_borrow_mut(|s| *s = bufs);
        }
    }
}

/// The buffers of `x`'s quantized activations, sized (from this thread's spare ones), nothing
/// quantized yet. The last panel's rows past `m` keep whatever they held: no kernel reads them
/// (the vector kernels stop at `m`, the tile unit takes whole panels only), and clearing them cost
/// a decode step's products (8 rows in a 16-row panel) a memset each.
///
/// # Panics
/// When `x` is not `m · k` values or `k` not a multiple of 32.
fn buffers(x: &[f32], m: usize, k: usize) -> Act {
    assert!(k.is_multiple_of(32) && x.len() == m * k, "quantized activations: {} values for [{m}, {k}]", x.len());
    let (nb, panels) = (k / 32, m.div_ceil(PANEL));
    let (mut qs, mut meta) = SPARE.with_borrow_mut(std::mem::take);
    reuse(&mut qs, panels * nb * BLOCK, 0);
    reuse(&mut meta, panels * nb, Meta::default());
    Act { qs, meta, m, k }
}

/// Quantizes panel `p` of `x` (`k` values a row) into its buffers `qs` and `meta`.
fn panel_into(isa: Isa, x: &[f32], k: usize, p: usize, qs: &mut [i8], meta: &mut [Meta]) {
    let isa = isa.quant();
    for (r, x) in x[p * PANEL * k..].chunks_exact(k.max(1)).take(PANEL).enumerate() {
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX-512 F/BW/VL (with AVX2, FMA, F16C) were detected by `available`.
            Isa::Avx512Vnni | Isa::Amx => unsafe { blocks_avx512(x, qs, meta, r) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2, FMA and F16C were detected by `available`.
            Isa::Avx2 | Isa::AvxVnni => unsafe { blocks_avx2(x, qs, meta, r) },
            _ => blocks(x, qs, meta, r),
        }
    }
}

/// Activations quantized by the tasks of the product that reads them, rather than in a parallel
/// region of their own (a decode step has ~120 such products, each of a few microseconds): every
/// task first calls [`Deferred::finish`], which quantizes panels not yet taken by any thread
/// and then waits for those others are quantizing; the product's jobs read the activations only
/// after it returns (it hands them out). On one thread, one `finish` quantizes every panel.
pub(crate) struct Deferred<'a> {
    /// The buffers: their lengths readable at once, their contents only through `finish`.
    act: Act,
    x: &'a [f32],
    k: usize,
    isa: Isa,
    panels: usize,
    /// The buffers' first bytes and first [`Meta`], each panel written through them by the one
    /// thread that took it.
    qs: *mut i8,
    meta: *mut Meta,
    next: AtomicUsize,
    done: AtomicUsize,
}

// SAFETY: the pointers are written only panel by panel, each panel by the one thread that took
// its index from `next`, and read only after `done` says every panel is written.
unsafe impl Sync for Deferred<'_> {}

impl<'a> Deferred<'a> {
    /// The buffers of `x`'s activations (`m` rows of `k`) and what quantizes them.
    ///
    /// # Panics
    /// When `x` is not `m · k` values or `k` not a multiple of 32.
    pub(crate) fn new(isa: Isa, x: &'a [f32], m: usize, k: usize) -> Deferred<'a> {
        let mut act = buffers(x, m, k);
        let panels = act.panels();
        let (qs, meta) = (act.qs.as_mut_ptr(), act.meta.as_mut_ptr());
        Deferred { act, x, k, isa, panels, qs, meta, next: AtomicUsize::new(0), done: AtomicUsize::new(0) }
    }

    /// The activations' rows and columns and their buffers' lengths (not their contents).
    pub(crate) fn shape(&self) -> (usize, usize, usize, usize) {
        (self.act.m, self.act.k, self.act.qs.len(), self.act.meta.len())
    }

    /// The activations, every panel quantized: the panels no thread has taken yet quantized
    /// here, then those other threads are writing waited for.
    pub(crate) fn finish(&self) -> &Act {
        let (nb, k) = (self.k / 32, self.k);
        loop {
            let p = self.next.fetch_add(1, Ordering::Relaxed);
            if p >= self.panels {
                break;
            }
            // Counts the panel as written also when quantizing it panics (the product's region
            // then passes the panic on), so no thread waits for it forever.
            let _written = AddOnDrop(&self.done);
            // SAFETY: panel `p < panels` lies inside the buffers `buffers` sized (`nb · BLOCK`
            // bytes and `nb` metas a panel), and only this thread took index `p`.
            let (qs, meta) = unsafe {
                (
                    std::slice::from_raw_parts_mut(self.qs.add(p * nb * BLOCK), nb * BLOCK),
                    std::slice::from_raw_parts_mut(self.meta.add(p * nb), nb),
                )
            };
            panel_into(self.isa, self.x, k, p, qs, meta);
        }
        wait_until(|| self.done.load(Ordering::Acquire) >= self.panels);
        &self.act
    }

    /// [`Deferred::finish`], keeping the activations.
    #[cfg(test)]
    pub(crate) fn into_act(self) -> Act {
        self.finish();
        self.act
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `x` quantized through [`Deferred`]: by this thread alone, or when `parallel` by the
    /// tasks of a region on two threads, each finishing the activations first.
    fn quantize(isa: Isa, x: &[f32], m: usize, k: usize, parallel: bool) -> Act {
        let deferred = Deferred::new(isa, x, m, k);
        if parallel {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("a pool");
            pool.install(|| {
                crate::pool::for_each_index(4, |_| {
                    deferred.finish();
                })
            });
        }
        deferred.into_act()
    }

    /// Every row's quants (both planes) and its scales and sums, block by block (the rows past
    /// `m` of the last panel are nobody's).
    fn bits(a: &Act) -> (Vec<i8>, Vec<u32>) {
        let (mut qs, mut meta) = (Vec::new(), Vec::new());
        for i in 0..a.m {
            let (q, mo, r) = a.at(i);
            for b in 0..a.nb() {
                let at = q + BLOCK * b;
                qs.extend_from_slice(&a.qs[at..at + 32]);
                qs.extend_from_slice(&a.qs[at + LO..at + LO + 32]);
                let m = &a.meta[mo + b];
                meta.extend([m.d[r], m.ds[r], m.dsa[r], m.dsb[r]].map(f32::to_bits));
                meta.extend([m.s[r], m.sa[r], m.sb[r]].map(|v| v as u32));
            }
        }
        (qs, meta)
    }

    /// Blocks of ties (`d = 1`: values on `.5`), a NaN, infinities, subnormals, zeros and plain
    /// values, in `m` rows shifted against each other.
    fn awkward(m: usize) -> (Vec<f32>, usize) {
        let mut blocks: Vec<[f32; 32]> = Vec::new();
        let mut ties = [0f32; 32];
        for (i, v) in ties.iter_mut().enumerate() {
            *v = (i as f32 - 16.0) + 0.5;
        }
        ties[31] = 127.0;
        blocks.push(ties);
        let mut nan = [0.25f32; 32];
        nan[7] = f32::NAN;
        blocks.push(nan);
        let mut inf = [-0.75f32; 32];
        inf[3] = f32::INFINITY;
        inf[9] = f32::NEG_INFINITY;
        blocks.push(inf);
        blocks.push([1e-42; 32]);
        blocks.push([f32::MIN_POSITIVE * 0.5; 32]);
        blocks.push([0.0; 32]);
        blocks.push(std::array::from_fn(|i| ((i * 37 % 29) as f32 - 14.0) * 0.013));
        let k = 32 * blocks.len();
        let mut x = Vec::with_capacity(m * k);
        for r in 0..m {
            for b in 0..blocks.len() {
                x.extend_from_slice(&blocks[(b + r) % blocks.len()]);
            }
        }
        (x, k)
    }

    #[test]
    fn every_isa_quantizes_to_the_portable_bits() {
        for (m, parallel) in [(3, false), (21, true)] {
            let (x, k) = awkward(m);
            let want = bits(&quantize(Isa::Portable, &x, m, k, false));
            for isa in Isa::available_of(&Isa::QUANT) {
                assert!(bits(&quantize(isa, &x, m, k, parallel)) == want, "{isa:?}: m = {m}");
            }
        }
        // Rows of 37 blocks (two groups of 16 and a partial third for the AVX-512 body), the
        // awkward blocks scaled differently at each position so every block has its own scale.
        let (m, nb) = (9, 37);
        let (a, ka) = awkward(m);
        let per = ka / 32;
        let mut x = Vec::with_capacity(m * nb * 32);
        for r in 0..m {
            for b in 0..nb {
                let src = &a[r * ka + (b % per) * 32..][..32];
                x.extend(src.iter().map(|v| v * (1.0 + b as f32 * 0.37)));
            }
        }
        let k = nb * 32;
        let want = bits(&quantize(Isa::Portable, &x, m, k, false));
        for isa in Isa::available_of(&Isa::QUANT) {
            assert!(bits(&quantize(isa, &x, m, k, true)) == want, "{isa:?}: {nb} blocks a row");
        }
    }

    /// Every quant `-QMAX ..= QMAX` splits into the same planes on every instruction set (the
    /// AVX-512 body finds `⌊(Q + 127) / 254⌋` without a division): blocks whose largest value is
    /// `QMAX` itself (so `d = 1` and each value is its own quant) over the whole range.
    #[test]
    fn every_quant_splits_as_the_portable_code() {
        let mut x = Vec::new();
        let mut q = -QMAX;
        while q <= QMAX {
            x.push(QMAX);
            for _ in 0..31 {
                x.push(q.min(QMAX));
                q += 1.0;
            }
        }
        while x.len() % (32 * 16) != 0 {
            x.push(0.0);
        }
        let (m, k) = (x.len() / (32 * 16), 32 * 16);
        let want = bits(&quantize(Isa::Portable, &x, m, k, false));
        for isa in Isa::available_of(&Isa::QUANT) {
            assert!(bits(&quantize(isa, &x, m, k, false)) == want, "{isa:?}");
        }
    }

    /// Activations quantized by the tasks of a region ([`Deferred`]: each task finishing them
    /// first, panels taken by whichever thread comes) are the bits of one thread's, on 1–3
    /// threads and for row counts around the panel.
    #[test]
    fn deferred_activations_are_quantizes_bits() {
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a pool");
            for m in [1, 8, 13, 16, 21, 40] {
                let (x, k) = awkward(m);
                let want = bits(&quantize(Isa::Portable, &x, m, k, false));
                for isa in Isa::available_of(&Isa::QUANT) {
                    let deferred = Deferred::new(isa, &x, m, k);
                    pool.install(|| {
                        crate::pool::for_each_index(7, |_| {
                            deferred.finish();
                        })
                    });
                    assert!(bits(&deferred.into_act()) == want, "{isa:?}, {m} rows, {threads} threads");
                }
            }
        }
    }

    /// Activations quantized into the buffers another product left behind (larger, or of other
    /// values) are the bits of ones quantized into fresh buffers, in every row of theirs.
    #[test]
    fn reused_buffers_give_fresh_bits() {
        let (x, k) = awkward(5);
        let fresh = std::thread::spawn(move || bits(&quantize(Isa::best(), &x, 5, k, false))).join().expect("thread");
        let (big, kb) = awkward(29);
        let noise: Vec<f32> = big.iter().map(|v| v * 3.0 + 1.0).collect();
        drop(quantize(Isa::best(), &noise, 29, kb, false));
        let (x, k) = awkward(5);
        assert!(bits(&quantize(Isa::best(), &x, 5, k, false)) == fresh, "after a larger product");
        drop(quantize(Isa::best(), &noise[..16 * kb], 16, kb, false));
        assert!(bits(&quantize(Isa::best(), &x, 5, k, false)) == fresh, "after a full panel");
    }

    /// Row `i`'s block `b`: its combined quants `254 · hi + lo`.
    fn combined(a: &Act, i: usize, b: usize) -> Vec<i32> {
        let (q, _, _) = a.at(i);
        let at = q + BLOCK * b;
        (0..32).map(|t| 254 * a.qs[at + t] as i32 + a.qs[at + LO + t] as i32).collect()
    }

    #[test]
    fn ties_round_to_even_and_sums_are_exact() {
        let (x, k) = awkward(1);
        let a = quantize(Isa::best(), &x, 1, k, false);
        // Block 0: the largest value is 127, so `d = 1 / 254` and each value `v` is `254 · v`,
        // an integer: the planes hold it exactly.
        let want: Vec<i32> =
            (0..32).map(|i| if i == 31 { 127 * 254 } else { (((i as f32 - 16.0) + 0.5) * 254.0) as i32 }).collect();
        assert_eq!(combined(&a, 0, 0), want);
        let r = a.at(0).2;
        let m = &a.meta[0];
        assert_eq!(
            (m.d[r], m.sa[r], m.sb[r], m.s[r]),
            (127.0 / QMAX, want[..16].iter().sum(), want[16..].iter().sum(), want.iter().sum())
        );
        // The zeros block has scale 0 and quants 0; the NaN block has a NaN scale.
        let (zeros, nan) = (&a.meta[5], &a.meta[1]);
        assert!(zeros.d[r] == 0.0 && zeros.s[r] == 0 && nan.d[r].is_nan());
    }

    #[test]
    fn planes_stay_in_i8_and_hold_each_value_to_half_a_step() {
        let (x, k) = awkward(4);
        let a = quantize(Isa::best(), &x, 4, k, false);
        assert!(a.qs.iter().all(|&q| q != i8::MIN), "a plane reached -128");
        for i in 0..4 {
            let (_, mo, r) = a.at(i);
            for b in 0..k / 32 {
                let d = a.meta[mo + b].d[r];
                // Subnormal scales lose their precision (and with it the bound): blocks of values
                // below 2⁻¹¹¹, which no activation is.
                if !d.is_normal() {
                    continue;
                }
                for (t, q) in combined(&a, i, b).into_iter().enumerate() {
                    let v = x[i * k + 32 * b + t];
                    let err = (v as f64 - q as f64 * d as f64).abs();
                    assert!(err <= d as f64 * 0.5001, "row {i} block {b} value {t}: {v} as {q} · {d}");
                }
            }
        }
    }
}
