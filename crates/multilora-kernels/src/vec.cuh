// 16-byte memory access for the multilora kernels: one `ml::V16` is what a thread moves in one
// `ld.global.v4` / `st.global.v4`, and `load8` / `store8` turn 8 consecutive elements of any of
// the kernels' dtypes into f32 and back (one 16-byte access for bf16 and f16, two for f32). The
// caller checks alignment: every pointer handed to these is 16-byte aligned (the host plan or the
// kernel decides, once per row, whether a row takes the vector path or the scalar tail).
//
// Compiled by nvcc, or by the host compiler under MULTILORA_EMULATE (through multilora.cuh).
#pragma once

#include "multilora.cuh"

namespace ml {

#ifdef MULTILORA_EMULATE
struct alignas(16) V16 {
    uint32_t w[4];
};
__device__ __forceinline__ float f32_of_bits(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
__device__ __forceinline__ uint32_t bits_of_f32(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}
__device__ __forceinline__ float half_bits_to_f32(uint16_t b) { return __half2float(__half{b}); }
__device__ __forceinline__ uint16_t bits_of(__half v) { return v.bits; }
__device__ __forceinline__ uint16_t bits_of(__nv_bfloat16 v) { return v.bits; }
#else
struct __align__(16) V16 {
    uint32_t w[4];
};
__device__ __forceinline__ float f32_of_bits(uint32_t u) { return __uint_as_float(u); }
__device__ __forceinline__ uint32_t bits_of_f32(float f) { return __float_as_uint(f); }
__device__ __forceinline__ float half_bits_to_f32(uint16_t b) { return __half2float(__ushort_as_half(b)); }
__device__ __forceinline__ uint16_t bits_of(__half v) { return __half_as_ushort(v); }
__device__ __forceinline__ uint16_t bits_of(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
#endif

// Elements of T in one V16.
template <typename T> struct VecWidth {
    static constexpr int N = 16 / (int)sizeof(T);
};

__device__ __forceinline__ V16 ld16(const void* p) { return *reinterpret_cast<const V16*>(p); }
__device__ __forceinline__ void st16(void* p, const V16& v) { *reinterpret_cast<V16*>(p) = v; }

// The 8 elements of one V16 of 16-bit values, as f32.
__device__ __forceinline__ void unpack8(const V16& v, float out[8], const __nv_bfloat16*) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = f32_of_bits(v.w[i] << 16);
        out[2 * i + 1] = f32_of_bits(v.w[i] & 0xffff0000u);
    }
}
__device__ __forceinline__ void unpack8(const V16& v, float out[8], const __half*) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = half_bits_to_f32((uint16_t)(v.w[i] & 0xffffu));
        out[2 * i + 1] = half_bits_to_f32((uint16_t)(v.w[i] >> 16));
    }
}

// Elements p[0..8] as f32; p is 16-byte aligned.
__device__ __forceinline__ void load8(const float* p, float out[8]) {
    const V16 a = ld16(p), b = ld16(p + 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[i] = f32_of_bits(a.w[i]);
        out[4 + i] = f32_of_bits(b.w[i]);
    }
}
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float out[8]) { unpack8(ld16(p), out, p); }
__device__ __forceinline__ void load8(const __half* p, float out[8]) { unpack8(ld16(p), out, p); }

// p[0..8] = v rounded to T; p is 16-byte aligned.
__device__ __forceinline__ void store8(float* p, const float v[8]) {
    V16 a, b;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        a.w[i] = bits_of_f32(v[i]);
        b.w[i] = bits_of_f32(v[4 + i]);
    }
    st16(p, a);
    st16(p + 4, b);
}
template <typename T> __device__ __forceinline__ void store8(T* p, const float v[8]) {
    V16 a;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t lo = bits_of(from_f32<T>(v[2 * i])), hi = bits_of(from_f32<T>(v[2 * i + 1]));
        a.w[i] = lo | (hi << 16);
    }
    st16(p, a);
}

// Whether every pointer is 16-byte aligned.
__device__ __forceinline__ bool aligned16(const void* a) { return ((uintptr_t)a & 15u) == 0; }
__device__ __forceinline__ bool aligned16(const void* a, const void* b) {
    return (((uintptr_t)a | (uintptr_t)b) & 15u) == 0;
}

}  // namespace ml
