//! [`FloatSimd`] for each instruction set: the portable one (eight-lane arrays the compiler
//! vectorises), AVX2 + FMA + F16C and AVX-512F, each with its tile shapes (`tiles!`).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use half::f16;

use super::{Elem, FloatSimd, packed_tile, tile};
use crate::isa::Portable;
#[cfg(target_arch = "x86_64")]
use crate::isa::{Avx2, Avx512F};

impl FloatSimd for Portable {
    type V = [f32; 8];
    const LANES: usize = 8;
    const FMA: bool = false;
    const RM: usize = 4;
    const RN: usize = 2;

    #[inline(always)]
    unsafe fn zero() -> [f32; 8] {
        [0.0; 8]
    }

    #[inline(always)]
    unsafe fn load(p: *const f32) -> [f32; 8] {
        // SAFETY: the caller guarantees eight readable f32 from `p`; no alignment is assumed.
        unsafe { p.cast::<[f32; 8]>().read_unaligned() }
    }

    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> [f32; 8] {
        // SAFETY: the caller guarantees eight readable u16 from `p`; no alignment is assumed.
        let v = unsafe { p.cast::<[u16; 8]>().read_unaligned() };
        v.map(|b| f32::from_bits((b as u32) << 16))
    }

    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> [f32; 8] {
        // SAFETY: as above.
        let v = unsafe { p.cast::<[u16; 8]>().read_unaligned() };
        v.map(|b| f16::from_bits(b).to_f32())
    }

    #[inline(always)]
    unsafe fn fma(a: [f32; 8], b: [f32; 8], c: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|l| a[l] * b[l] + c[l])
    }

    #[inline(always)]
    unsafe fn hsum(v: [f32; 8]) -> f32 {
        ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]))
    }

    #[inline(always)]
    fn prefetch(_: *const f32) {}

    #[inline(always)]
    unsafe fn splat(v: f32) -> [f32; 8] {
        [v; 8]
    }

    #[inline(always)]
    unsafe fn store(p: *mut f32, v: [f32; 8]) {
        // SAFETY: the caller guarantees eight writable f32 from `p`; no alignment is assumed.
        unsafe { p.cast::<[f32; 8]>().write_unaligned(v) }
    }

    tiles!(4, 2, 4);
}

#[cfg(target_arch = "x86_64")]
impl FloatSimd for Avx2 {
    type V = __m256;
    const LANES: usize = 8;
    const FMA: bool = true;
    // 12 accumulators, 3 vectors of `w` and one of `x`: the 16 ymm registers.
    const RM: usize = 4;
    const RN: usize = 3;

    #[inline(always)]
    unsafe fn zero() -> __m256 {
        // SAFETY: the caller guarantees AVX2 (which implies AVX).
        unsafe { _mm256_setzero_ps() }
    }

    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        // SAFETY: the caller guarantees eight readable f32 and AVX2; `loadu` needs no alignment.
        unsafe { _mm256_loadu_ps(p) }
    }

    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> __m256 {
        // SAFETY: the caller guarantees eight readable u16 and AVX2; `loadu` needs no alignment.
        // A bf16 is the high half of its f32: zero-extend and shift.
        unsafe { _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())))) }
    }

    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> __m256 {
        // SAFETY: the caller guarantees eight readable u16 and F16C (part of this set's detection).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }

    #[inline(always)]
    unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
        // SAFETY: the caller guarantees FMA.
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        // SAFETY: the caller guarantees AVX2 (which implies the SSE3 shuffles).
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let h = _mm_movehdup_ps(s);
            let s = _mm_add_ps(s, h);
            let h = _mm_movehl_ps(h, s);
            _mm_cvtss_f32(_mm_add_ss(s, h))
        }
    }

    #[inline(always)]
    fn prefetch(p: *const f32) {
        // SAFETY: a prefetch is a hint that never faults, whatever the address; SSE is baseline.
        unsafe { _mm_prefetch::<_MM_HINT_T2>(p.cast::<i8>()) }
    }

    #[inline(always)]
    unsafe fn splat(v: f32) -> __m256 {
        // SAFETY: the caller guarantees AVX.
        unsafe { _mm256_set1_ps(v) }
    }

    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        // SAFETY: the caller guarantees eight writable f32 and AVX; `storeu` needs no alignment.
        unsafe { _mm256_storeu_ps(p, v) }
    }

    tiles!(4, 3, 6);
}

#[cfg(target_arch = "x86_64")]
impl FloatSimd for Avx512F {
    type V = __m512;
    const LANES: usize = 16;
    const FMA: bool = true;
    // 24 accumulators, 6 vectors of `w` and one of `x`, of the 32 zmm registers.
    const RM: usize = 4;
    const RN: usize = 6;

    #[inline(always)]
    unsafe fn zero() -> __m512 {
        // SAFETY: the caller guarantees AVX-512F.
        unsafe { _mm512_setzero_ps() }
    }

    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        // SAFETY: the caller guarantees sixteen readable f32 and AVX-512F; no alignment needed.
        unsafe { _mm512_loadu_ps(p) }
    }

    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> __m512 {
        // SAFETY: the caller guarantees sixteen readable u16 and AVX-512F; no alignment needed.
        // A bf16 is the high half of its f32: zero-extend and shift.
        unsafe { _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast())))) }
    }

    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> __m512 {
        // SAFETY: the caller guarantees sixteen readable u16 and AVX-512F.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }

    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        // SAFETY: the caller guarantees AVX-512F.
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }

    #[inline(always)]
    unsafe fn hsum(v: __m512) -> f32 {
        // SAFETY: the caller guarantees AVX-512F.
        unsafe { _mm512_reduce_add_ps(v) }
    }

    #[inline(always)]
    fn prefetch(p: *const f32) {
        // SAFETY: a prefetch is a hint that never faults, whatever the address; SSE is baseline.
        unsafe { _mm_prefetch::<_MM_HINT_T2>(p.cast::<i8>()) }
    }

    #[inline(always)]
    unsafe fn splat(v: f32) -> __m512 {
        // SAFETY: the caller guarantees AVX-512F.
        unsafe { _mm512_set1_ps(v) }
    }

    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        // SAFETY: the caller guarantees sixteen writable f32 and AVX-512F; no alignment needed.
        unsafe { _mm512_storeu_ps(p, v) }
    }

    tiles!(4, 6, 12);
}
