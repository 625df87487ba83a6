//! The few vector operations the quantized kernels are written in ([`DotSimd`]), and their
//! portable implementation: plain arrays of 16 lanes, i32 dot products and `f32::mul_add`, the
//! same exact integers and the same f32 roundings as the x86 sets.

use crate::isa::Portable;

/// One instruction set, seen as vectors of `LANES` output columns: `W` holds 4 weight bytes per
/// column (one group of 4 values along `k`), `I` one i32 and `F` one f32 per column.
pub(crate) trait DotSimd: Copy {
    /// Output columns per vector: 16, or 8 for the 256-bit sets (which take a tile in two halves).
    const LANES: usize;
    /// Rows of the tallest row tile (as many as the registers hold accumulators for).
    const RM: usize;
    /// What [`DotSimd::prep_i8`] adds to each signed weight byte, taken back through `Σx`.
    const I8_BIAS: i32;
    /// How far ahead of the record it decodes a row tile asks for the weight's bytes
    /// (`prefetcht0`), or 0 for no such hint. A tile's records, and the tiles of a job, lie one
    /// after the other, so this reaches into the record a few blocks on, or into the next tile.
    /// At one row the product is bound by how fast the weight streams in from memory: on Zen 5 and
    /// Sapphire Rapids the hardware prefetcher alone left a one-row GGUF step ~15% slower (2–16 KiB
    /// ahead measured alike), while on Zen 3 the hints made Llama-3.2-1B's decode ~25% slower
    /// (see docs/BENCHMARKS.md).
    const PREFETCH: usize = 4096;
    type W: Copy;
    type I: Copy;
    type F: Copy;

    /// # Safety (every method)
    /// The instruction set is available, and pointers reach `LANES · 4` (weights), `LANES · 2`
    /// (f16), `LANES` (bytes), `LANES / 2` (bits) readable bytes, or `LANES` writable f32.
    unsafe fn load_w(p: *const u8) -> Self::W;
    /// The low nibble of every byte.
    unsafe fn nib_lo(v: Self::W) -> Self::W;
    /// The high nibble of every byte.
    unsafe fn nib_hi(v: Self::W) -> Self::W;
    /// `(v >> 2j) & 3` in every byte.
    unsafe fn crumb(v: Self::W, j: usize) -> Self::W;
    /// `lo | ((v >> 2j) & 3) << 4` in every byte.
    unsafe fn or_crumb_hi(lo: Self::W, v: Self::W, j: usize) -> Self::W;
    /// `w + add` in the bytes whose bit is set in the `LANES · 4` bits at `bits`.
    unsafe fn add_bits(w: Self::W, bits: *const u8, add: i8) -> Self::W;
    /// Signed weight bytes made ready for [`DotSimd::dot`] with `signed` (plus [`DotSimd::I8_BIAS`]).
    unsafe fn prep_i8(w: Self::W) -> Self::W;
    /// `Σ_g Σ_t w[g][c, t] · x[4g + t]` for every column `c`, exactly: unsigned weights of at most
    /// `maxw`, or (`signed`) prepared signed ones, which give the sum plus `I8_BIAS · Σx`.
    /// `x` is `4 · w.len()` readable i8.
    unsafe fn dot(w: &[Self::W], x: *const i8, maxw: i32, signed: bool) -> Self::I;
    /// [`DotSimd::dot`] for `R` rows at once (row `r`'s activations at `x[r]`), in whatever order
    /// keeps the units busy: the sums are exact, so the order does not change them.
    unsafe fn dot_rows<const R: usize>(w: &[Self::W], x: [*const i8; R], maxw: i32, signed: bool) -> [Self::I; R];
    /// `254 · hi + lo` in every lane (the two planes' dot products; no overflow).
    unsafe fn combine(hi: Self::I, lo: Self::I) -> Self::I;
    unsafe fn load_f16(p: *const u8) -> Self::F;
    /// `LANES` bytes, zero-extended.
    unsafe fn load_u8(p: *const u8) -> Self::I;
    /// `LANES` bytes, sign-extended.
    unsafe fn load_i8(p: *const u8) -> Self::I;
    unsafe fn lo4(v: Self::I) -> Self::I;
    unsafe fn hi4(v: Self::I) -> Self::I;
    /// `v − (*p << shift)` in every lane (`*p` one i32, broadcast).
    unsafe fn sub_at(v: Self::I, p: *const i32, shift: u32) -> Self::I;
    unsafe fn cvt(v: Self::I) -> Self::F;
    unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
    /// `a · b + c`, rounded once.
    unsafe fn fma(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    unsafe fn neg(a: Self::F) -> Self::F;
    /// `*p` (one f32) in every lane.
    unsafe fn splat_at(p: *const f32) -> Self::F;
    unsafe fn zero() -> Self::F;
    unsafe fn store(p: *mut f32, v: Self::F);
}

type Pw = [u8; 64];
type Pi = [i32; 16];
type Pf = [f32; 16];

impl DotSimd for Portable {
    const LANES: usize = 16;
    const RM: usize = 4;
    const I8_BIAS: i32 = 0;
    type W = Pw;
    type I = Pi;
    type F = Pf;

    #[inline(always)]
    unsafe fn load_w(p: *const u8) -> Pw {
        // SAFETY: the caller guarantees 64 readable bytes; no alignment is assumed.
        unsafe { p.cast::<Pw>().read_unaligned() }
    }
    #[inline(always)]
    unsafe fn nib_lo(v: Pw) -> Pw {
        v.map(|b| b & 15)
    }
    #[inline(always)]
    unsafe fn nib_hi(v: Pw) -> Pw {
        v.map(|b| b >> 4)
    }
    #[inline(always)]
    unsafe fn crumb(v: Pw, j: usize) -> Pw {
        v.map(|b| (b >> (2 * j)) & 3)
    }
    #[inline(always)]
    unsafe fn or_crumb_hi(lo: Pw, v: Pw, j: usize) -> Pw {
        std::array::from_fn(|i| lo[i] | (((v[i] >> (2 * j)) & 3) << 4))
    }
    #[inline(always)]
    unsafe fn add_bits(w: Pw, bits: *const u8, add: i8) -> Pw {
        // SAFETY: the caller guarantees 8 readable bytes (64 bits).
        let b = u64::from_le_bytes(unsafe { bits.cast::<[u8; 8]>().read_unaligned() });
        std::array::from_fn(|i| w[i].wrapping_add(if (b >> i) & 1 == 1 { add as u8 } else { 0 }))
    }
    #[inline(always)]
    unsafe fn prep_i8(w: Pw) -> Pw {
        w
    }
    #[inline(always)]
    unsafe fn dot(w: &[Pw], x: *const i8, _maxw: i32, signed: bool) -> Pi {
        let mut acc = [0i32; 16];
        for (g, wg) in w.iter().enumerate() {
            // SAFETY: the caller guarantees `4 · w.len()` readable bytes at `x`.
            let xs = unsafe { x.add(4 * g).cast::<[i8; 4]>().read_unaligned() };
            for (c, a) in acc.iter_mut().enumerate() {
                for (t, &xv) in xs.iter().enumerate() {
                    let wv = if signed { wg[4 * c + t] as i8 as i32 } else { wg[4 * c + t] as i32 };
                    *a += wv * xv as i32;
                }
            }
        }
        acc
    }
    #[inline(always)]
    unsafe fn dot_rows<const R: usize>(w: &[Pw], x: [*const i8; R], maxw: i32, signed: bool) -> [Pi; R] {
        let mut out = [[0; 16]; R];
        for (o, &xr) in out.iter_mut().zip(&x) {
            // SAFETY: forwarded from the caller, row by row.
            *o = unsafe { Self::dot(w, xr, maxw, signed) };
        }
        out
    }
    #[inline(always)]
    unsafe fn combine(hi: Pi, lo: Pi) -> Pi {
        std::array::from_fn(|i| 254 * hi[i] + lo[i])
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> Pf {
        // SAFETY: the caller guarantees 32 readable bytes.
        let b = unsafe { p.cast::<[u8; 32]>().read_unaligned() };
        std::array::from_fn(|i| half::f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32())
    }
    #[inline(always)]
    unsafe fn load_u8(p: *const u8) -> Pi {
        // SAFETY: the caller guarantees 16 readable bytes.
        unsafe { p.cast::<[u8; 16]>().read_unaligned() }.map(|b| b as i32)
    }
    #[inline(always)]
    unsafe fn load_i8(p: *const u8) -> Pi {
        // SAFETY: the caller guarantees 16 readable bytes.
        unsafe { p.cast::<[u8; 16]>().read_unaligned() }.map(|b| b as i8 as i32)
    }
    #[inline(always)]
    unsafe fn lo4(v: Pi) -> Pi {
        v.map(|a| a & 15)
    }
    #[inline(always)]
    unsafe fn hi4(v: Pi) -> Pi {
        v.map(|a| a >> 4)
    }
    #[inline(always)]
    unsafe fn sub_at(v: Pi, p: *const i32, shift: u32) -> Pi {
        // SAFETY: the caller guarantees one readable i32.
        let s = unsafe { p.read() } << shift;
        v.map(|a| a.wrapping_sub(s))
    }
    #[inline(always)]
    unsafe fn cvt(v: Pi) -> Pf {
        v.map(|a| a as f32)
    }
    #[inline(always)]
    unsafe fn mul(a: Pf, b: Pf) -> Pf {
        std::array::from_fn(|i| a[i] * b[i])
    }
    #[inline(always)]
    unsafe fn fma(a: Pf, b: Pf, c: Pf) -> Pf {
        std::array::from_fn(|i| a[i].mul_add(b[i], c[i]))
    }
    #[inline(always)]
    unsafe fn neg(a: Pf) -> Pf {
        a.map(|v| -v)
    }
    #[inline(always)]
    unsafe fn splat_at(p: *const f32) -> Pf {
        // SAFETY: the caller guarantees one readable f32.
        [unsafe { p.read() }; 16]
    }
    #[inline(always)]
    unsafe fn zero() -> Pf {
        [0.0; 16]
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Pf) {
        // SAFETY: the caller guarantees 16 writable f32; no alignment is assumed.
        unsafe { p.cast::<Pf>().write_unaligned(v) }
    }
}
