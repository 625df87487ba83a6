// What every multilora kernel shares: the value types, conversions to and from f32 (all
// arithmetic is f32), a warp sum, and the entry-point macros that instantiate a kernel for each
// dtype under the name the Rust side asks for (`<op>_<tx>_<tw>`, dtypes `f32`, `bf16`, `f16`).
//
// Compiled by nvcc for the device, or, with MULTILORA_EMULATE, by the host C++ compiler against
// `emulate/emu.h` so that the same source runs on a CPU in the tests.
#pragma once

#ifdef MULTILORA_EMULATE
#include "emulate/emu.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#endif

#include "params.h"

namespace ml {

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

__device__ __forceinline__ uint32_t umin(uint32_t a, uint32_t b) { return a < b ? a : b; }

// Sum over the 32 lanes of a warp; every lane gets the total. All lanes must call it.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Max over the 32 lanes of a warp; every lane gets it. All lanes must call it.
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

}  // namespace ml

// Instantiates `body<TX, TW>` as `extern "C" name_<tx>_<tw>(P p)` for every pair of dtypes.
#define ML_FOR_DTYPE_PAIRS(name, body, P)                                                          \
    ML_ENTRY2(name, body, P, float, f32, float, f32)                                               \
    ML_ENTRY2(name, body, P, float, f32, __nv_bfloat16, bf16)                                      \
    ML_ENTRY2(name, body, P, float, f32, __half, f16)                                              \
    ML_ENTRY2(name, body, P, __nv_bfloat16, bf16, float, f32)                                      \
    ML_ENTRY2(name, body, P, __nv_bfloat16, bf16, __nv_bfloat16, bf16)                             \
    ML_ENTRY2(name, body, P, __nv_bfloat16, bf16, __half, f16)                                     \
    ML_ENTRY2(name, body, P, __half, f16, float, f32)                                              \
    ML_ENTRY2(name, body, P, __half, f16, __nv_bfloat16, bf16)                                     \
    ML_ENTRY2(name, body, P, __half, f16, __half, f16)

#define ML_ENTRY2(name, body, P, TX, tx, TW, tw)                                                   \
    extern "C" __global__ void name##_##tx##_##tw(const P p) { body<TX, TW>(p); }
