//! The x86-64 [`Simd`] sets: 256-bit AVX2 (`vpmaddubsw` + `vpmaddwd`, or with AVX-VNNI
//! `vpdpbusd`), 8 columns per vector, and 512-bit AVX-512 VNNI, 16 columns per vector. Only
//! used after run-time detection (see `Isa::available`).

use std::arch::x86_64::*;

use super::simd::DotSimd;
use crate::isa::{Avx256, Avx512Vnni};

/// Four bytes of `x` broadcast to every 32-bit lane.
#[inline(always)]
unsafe fn x4(x: *const i8, g: usize) -> i32 {
    // SAFETY: the caller guarantees `x + 4g .. x + 4g + 4` readable; no alignment is assumed.
    unsafe { x.add(4 * g).cast::<i32>().read_unaligned() }
}

/// How many 4-value groups `vpmaddubsw`'s i16 sums may add before they are widened: it sums two
/// products into an i16 that saturates, so several groups only while `per · 2 · maxw · 127` stays
/// below 32,768 (a signed weight, made |w| against ±x, has |w| up to 128: one group at a time).
pub(super) const fn i16_groups(maxw: i32, signed: bool) -> usize {
    let w = if maxw > 1 { maxw } else { 1 };
    let per = 32767 / (254 * w);
    if signed || per < 1 { 1 } else { per as usize }
}

/// `R` rows' dot products with `vpdpbusd` (`dp(acc, w, x4)`), group by group across the rows, so
/// that independent instructions sit side by side; tiles of one or two rows split each row's
/// chain over the even and odd groups (exact integer sums, added at the end).
///
/// # Safety
/// As for `dot_rows`; `dp` and `add` are the instruction set's, which the caller has.
#[inline(always)]
unsafe fn vnni_rows<const R: usize, V: Copy>(
    w: &[V],
    x: [*const i8; R],
    zero: V,
    add: impl Fn(V, V) -> V,
    dp: impl Fn(V, V, i32) -> V,
) -> [V; R] {
    let mut acc = [zero; R];
    let mut odd = [zero; R];
    let split = R <= 2;
    for (g, &wg) in w.iter().enumerate() {
        for r in 0..R {
            // SAFETY: group `g` of row `r`'s `4 · w.len()` readable bytes.
            let xv = unsafe { x4(x[r], g) };
            if split && g % 2 == 1 {
                odd[r] = dp(odd[r], wg, xv);
            } else {
                acc[r] = dp(acc[r], wg, xv);
            }
        }
    }
    if split {
        for r in 0..R {
            acc[r] = add(acc[r], odd[r]);
        }
    }
    acc
}

impl<const VNNI: bool> DotSimd for Avx256<VNNI> {
    const LANES: usize = 8;
    // 8 weight vectors, 4 accumulators and the temporaries fill the 16 ymm registers.
    const RM: usize = 4;
    const I8_BIAS: i32 = if VNNI { 128 } else { 0 };
    // The plain AVX2 set runs on Zen 2 / Zen 3 and older Intel cores: on Zen 3 the weight stream
    // ran ~25% faster with the hardware prefetcher alone (Llama-3.2-1B one stream, 13 → 17
    // tokens/s). The AVX-VNNI set (Alder Lake, Sapphire Rapids capped) keeps the hints.
    const PREFETCH: usize = if VNNI { 4096 } else { 0 };
    type W = __m256i;
    type I = __m256i;
    type F = __m256;

    #[inline(always)]
    unsafe fn load_w(p: *const u8) -> __m256i {
        // SAFETY: the caller guarantees 32 readable bytes and AVX2; `loadu` needs no alignment.
        unsafe { _mm256_loadu_si256(p.cast()) }
    }
    #[inline(always)]
    unsafe fn nib_lo(v: __m256i) -> __m256i {
        // SAFETY: the caller guarantees AVX2.
        unsafe { _mm256_and_si256(v, _mm256_set1_epi8(15)) }
    }
    #[inline(always)]
    unsafe fn nib_hi(v: __m256i) -> __m256i {
        // SAFETY: the caller guarantees AVX2. The 16-bit shift moves bits across bytes; the
        // mask keeps only each byte's own high nibble.
        unsafe { _mm256_and_si256(_mm256_srli_epi16::<4>(v), _mm256_set1_epi8(15)) }
    }
    #[inline(always)]
    unsafe fn crumb(v: __m256i, j: usize) -> __m256i {
        // SAFETY: the caller guarantees AVX2; `j` is a constant once inlined.
        unsafe {
            let s = match j {
                0 => v,
                1 => _mm256_srli_epi16::<2>(v),
                2 => _mm256_srli_epi16::<4>(v),
                _ => _mm256_srli_epi16::<6>(v),
            };
            _mm256_and_si256(s, _mm256_set1_epi8(3))
        }
    }
    #[inline(always)]
    unsafe fn or_crumb_hi(lo: __m256i, v: __m256i, j: usize) -> __m256i {
        // SAFETY: the caller guarantees AVX2. Bits 2j..2j+2 of each byte land on bits 4..6 of
        // the same byte; what the 16-bit shifts bring in from the neighbour is masked off.
        unsafe {
            let s = match j {
                0 => _mm256_slli_epi16::<4>(v),
                1 => _mm256_slli_epi16::<2>(v),
                2 => v,
                _ => _mm256_srli_epi16::<2>(v),
            };
            _mm256_or_si256(lo, _mm256_and_si256(s, _mm256_set1_epi8(0x30)))
        }
    }
    #[inline(always)]
    unsafe fn add_bits(w: __m256i, bits: *const u8, add: i8) -> __m256i {
        // SAFETY: the caller guarantees 4 readable bytes and AVX2. Byte `i` gets bit `i` of the
        // 32: byte `i / 8` of the word is spread to bytes `8·(i / 8)..`, then one bit tested each.
        unsafe {
            let b = bits.cast::<i32>().read_unaligned();
            let spread = _mm256_shuffle_epi8(
                _mm256_set1_epi32(b),
                _mm256_setr_epi64x(0, 0x0101_0101_0101_0101, 0x0202_0202_0202_0202, 0x0303_0303_0303_0303),
            );
            let sel = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel);
            _mm256_add_epi8(w, _mm256_and_si256(set, _mm256_set1_epi8(add)))
        }
    }
    #[inline(always)]
    unsafe fn prep_i8(w: __m256i) -> __m256i {
        // SAFETY: the caller guarantees AVX2. With VNNI the weight is the unsigned operand:
        // `w + 128`, as bits `w ^ 0x80`.
        if VNNI { unsafe { _mm256_xor_si256(w, _mm256_set1_epi8(-128)) } } else { w }
    }
    #[inline(always)]
    unsafe fn dot(w: &[__m256i], x: *const i8, maxw: i32, signed: bool) -> __m256i {
        // SAFETY: forwarded from the caller.
        unsafe { Self::dot_rows::<1>(w, [x], maxw, signed)[0] }
    }
    #[inline(always)]
    unsafe fn dot_rows<const R: usize>(w: &[__m256i], x: [*const i8; R], maxw: i32, signed: bool) -> [__m256i; R] {
        // SAFETY: the caller guarantees AVX2 (and AVX-VNNI with `VNNI`) and `4 · w.len()`
        // readable bytes at each `x[r]`.
        unsafe {
            if VNNI {
                let dp = |a, w, x| _mm256_dpbusd_avx_epi32(a, w, _mm256_set1_epi32(x));
                return vnni_rows::<R, _>(w, x, _mm256_setzero_si256(), |a, b| _mm256_add_epi32(a, b), dp);
            }
            let per = i16_groups(maxw, signed);
            let ones = _mm256_set1_epi16(1);
            let mut acc = [_mm256_setzero_si256(); R];
            let mut g = 0;
            while g < w.len() {
                let end = (g + per).min(w.len());
                let mut s16 = [_mm256_setzero_si256(); R];
                for (h, &wh) in (g..end).zip(&w[g..end]) {
                    let wa = if signed { _mm256_abs_epi8(wh) } else { wh };
                    for (s, &xr) in s16.iter_mut().zip(&x) {
                        let xb = _mm256_set1_epi32(x4(xr, h));
                        let xb = if signed { _mm256_sign_epi8(xb, wh) } else { xb };
                        *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(wa, xb));
                    }
                }
                for (a, &s) in acc.iter_mut().zip(&s16) {
                    *a = _mm256_add_epi32(*a, _mm256_madd_epi16(s, ones));
                }
                g = end;
            }
            acc
        }
    }
    #[inline(always)]
    unsafe fn combine(hi: __m256i, lo: __m256i) -> __m256i {
        // SAFETY: the caller guarantees AVX2. `254 · hi = (hi << 8) − (hi << 1)`.
        unsafe { _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32::<8>(hi), _mm256_slli_epi32::<1>(hi)), lo) }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 16 readable bytes and F16C.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
    #[inline(always)]
    unsafe fn load_u8(p: *const u8) -> __m256i {
        // SAFETY: the caller guarantees 8 readable bytes and AVX2.
        unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast())) }
    }
    #[inline(always)]
    unsafe fn load_i8(p: *const u8) -> __m256i {
        // SAFETY: the caller guarantees 8 readable bytes and AVX2.
        unsafe { _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())) }
    }
    #[inline(always)]
    unsafe fn lo4(v: __m256i) -> __m256i {
        // SAFETY: the caller guarantees AVX2.
        unsafe { _mm256_and_si256(v, _mm256_set1_epi32(15)) }
    }
    #[inline(always)]
    unsafe fn hi4(v: __m256i) -> __m256i {
        // SAFETY: the caller guarantees AVX2.
        unsafe { _mm256_srli_epi32::<4>(v) }
    }
    #[inline(always)]
    unsafe fn sub_at(v: __m256i, p: *const i32, shift: u32) -> __m256i {
        // SAFETY: the caller guarantees one readable i32 and AVX2.
        unsafe { _mm256_sub_epi32(v, _mm256_sll_epi32(_mm256_set1_epi32(p.read()), _mm_cvtsi32_si128(shift as i32))) }
    }
    #[inline(always)]
    unsafe fn cvt(v: __m256i) -> __m256 {
        // SAFETY: the caller guarantees AVX.
        unsafe { _mm256_cvtepi32_ps(v) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        // SAFETY: the caller guarantees AVX.
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
        // SAFETY: the caller guarantees FMA.
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn neg(a: __m256) -> __m256 {
        // SAFETY: the caller guarantees AVX.
        unsafe { _mm256_xor_ps(a, _mm256_set1_ps(-0.0)) }
    }
    #[inline(always)]
    unsafe fn splat_at(p: *const f32) -> __m256 {
        // SAFETY: the caller guarantees one readable f32 and AVX.
        unsafe { _mm256_set1_ps(p.read()) }
    }
    #[inline(always)]
    unsafe fn zero() -> __m256 {
        // SAFETY: the caller guarantees AVX.
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        // SAFETY: the caller guarantees 8 writable f32 and AVX; `storeu` needs no alignment.
        unsafe { _mm256_storeu_ps(p, v) }
    }
}

impl DotSimd for Avx512Vnni {
    const LANES: usize = 16;
    // 8 accumulators, 8 weight vectors, up to 4 scale vectors and temporaries: 24 of 32 zmm.
    const RM: usize = 8;
    const I8_BIAS: i32 = 128;
    type W = __m512i;
    type I = __m512i;
    type F = __m512;

    #[inline(always)]
    unsafe fn load_w(p: *const u8) -> __m512i {
        // SAFETY: the caller guarantees 64 readable bytes and AVX-512F; no alignment needed.
        unsafe { _mm512_loadu_si512(p.cast()) }
    }
    #[inline(always)]
    unsafe fn nib_lo(v: __m512i) -> __m512i {
        // SAFETY: the caller guarantees AVX-512F.
        unsafe { _mm512_and_si512(v, _mm512_set1_epi8(15)) }
    }
    #[inline(always)]
    unsafe fn nib_hi(v: __m512i) -> __m512i {
        // SAFETY: the caller guarantees AVX-512BW; the mask keeps each byte's own nibble.
        unsafe { _mm512_and_si512(_mm512_srli_epi16::<4>(v), _mm512_set1_epi8(15)) }
    }
    #[inline(always)]
    unsafe fn crumb(v: __m512i, j: usize) -> __m512i {
        // SAFETY: the caller guarantees AVX-512BW; `j` is a constant once inlined.
        unsafe {
            let s = match j {
                0 => v,
                1 => _mm512_srli_epi16::<2>(v),
                2 => _mm512_srli_epi16::<4>(v),
                _ => _mm512_srli_epi16::<6>(v),
            };
            _mm512_and_si512(s, _mm512_set1_epi8(3))
        }
    }
    #[inline(always)]
    unsafe fn or_crumb_hi(lo: __m512i, v: __m512i, j: usize) -> __m512i {
        // SAFETY: the caller guarantees AVX-512BW; as for the 256-bit version. `0xF8` is the
        // ternary-logic table of `a | (b & c)`.
        unsafe {
            let s = match j {
                0 => _mm512_slli_epi16::<4>(v),
                1 => _mm512_slli_epi16::<2>(v),
                2 => v,
                _ => _mm512_srli_epi16::<2>(v),
            };
            _mm512_ternarylogic_epi32::<0xF8>(lo, s, _mm512_set1_epi8(0x30))
        }
    }
    #[inline(always)]
    unsafe fn add_bits(w: __m512i, bits: *const u8, add: i8) -> __m512i {
        // SAFETY: the caller guarantees 8 readable bytes and AVX-512BW; bit `i` of the word is
        // the mask bit of byte `i`.
        unsafe {
            let k = bits.cast::<u64>().read_unaligned();
            _mm512_mask_add_epi8(w, k, w, _mm512_set1_epi8(add))
        }
    }
    #[inline(always)]
    unsafe fn prep_i8(w: __m512i) -> __m512i {
        // SAFETY: the caller guarantees AVX-512F: `w + 128` as bits, the unsigned operand.
        unsafe { _mm512_xor_si512(w, _mm512_set1_epi8(-128)) }
    }
    #[inline(always)]
    unsafe fn dot(w: &[__m512i], x: *const i8, maxw: i32, signed: bool) -> __m512i {
        // SAFETY: forwarded from the caller.
        unsafe { Self::dot_rows::<1>(w, [x], maxw, signed)[0] }
    }
    #[inline(always)]
    unsafe fn dot_rows<const R: usize>(w: &[__m512i], x: [*const i8; R], _: i32, _: bool) -> [__m512i; R] {
        // SAFETY: the caller guarantees AVX-512 VNNI and `4 · w.len()` readable bytes at each `x[r]`.
        unsafe {
            let dp = |a, w, x| _mm512_dpbusd_epi32(a, w, _mm512_set1_epi32(x));
            vnni_rows::<R, _>(w, x, _mm512_setzero_si512(), |a, b| _mm512_add_epi32(a, b), dp)
        }
    }
    #[inline(always)]
    unsafe fn combine(hi: __m512i, lo: __m512i) -> __m512i {
        // SAFETY: the caller guarantees AVX-512F. `254 · hi = (hi << 8) − (hi << 1)`.
        unsafe { _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32::<8>(hi), _mm512_slli_epi32::<1>(hi)), lo) }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> __m512 {
        // SAFETY: the caller guarantees 32 readable bytes and AVX-512F.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
    #[inline(always)]
    unsafe fn load_u8(p: *const u8) -> __m512i {
        // SAFETY: the caller guarantees 16 readable bytes and AVX-512F.
        unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast())) }
    }
    #[inline(always)]
    unsafe fn load_i8(p: *const u8) -> __m512i {
        // SAFETY: the caller guarantees 16 readable bytes and AVX-512F.
        unsafe { _mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast())) }
    }
    #[inline(always)]
    unsafe fn lo4(v: __m512i) -> __m512i {
        // SAFETY: the caller guarantees AVX-512F.
        unsafe { _mm512_and_si512(v, _mm512_set1_epi32(15)) }
    }
    #[inline(always)]
    unsafe fn hi4(v: __m512i) -> __m512i {
        // SAFETY: the caller guarantees AVX-512F.
        unsafe { _mm512_srli_epi32::<4>(v) }
    }
    #[inline(always)]
    unsafe fn sub_at(v: __m512i, p: *const i32, shift: u32) -> __m512i {
        // SAFETY: the caller guarantees one readable i32 and AVX-512F.
        unsafe { _mm512_sub_epi32(v, _mm512_sll_epi32(_mm512_set1_epi32(p.read()), _mm_cvtsi32_si128(shift as i32))) }
    }
    #[inline(always)]
    unsafe fn cvt(v: __m512i) -> __m512 {
        // SAFETY: the caller guarantees AVX-512F.
        unsafe { _mm512_cvtepi32_ps(v) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        // SAFETY: the caller guarantees AVX-512F.
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        // SAFETY: the caller guarantees AVX-512F.
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn neg(a: __m512) -> __m512 {
        // SAFETY: the caller guarantees AVX-512F (the integer xor flips the sign bit).
        unsafe { _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(i32::MIN))) }
    }
    #[inline(always)]
    unsafe fn splat_at(p: *const f32) -> __m512 {
        // SAFETY: the caller guarantees one readable f32 and AVX-512F.
        unsafe { _mm512_set1_ps(p.read()) }
    }
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        // SAFETY: the caller guarantees AVX-512F.
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        // SAFETY: the caller guarantees 16 writable f32 and AVX-512F; no alignment needed.
        unsafe { _mm512_storeu_ps(p, v) }
    }
}
