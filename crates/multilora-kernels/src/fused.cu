// Fused steps of a decode layer, each one launch where candle's tensor ops take several (what the
// CPU path already does in one pass): all arithmetic in f32, one rounding to the dtype per output.
//
//   rope_kv_write_<t>:  q_out[t] = rope(q[t]) * q_scale;  k_cache[slots[t]] = rope(k[t]);
//                       v_cache[slots[t]] = v[t]          (q, k, v: the q/k/v projection's row)
//   add_rms_norm_<t>:   sum[r] = x[r] + residual[r] (rounded);  out[r] = sum[r] / rms(sum[r]) * w
//   silu_mul_<t>:       out[r, j] = silu(gu[r, j]) * gu[r, inter + j]
//   greedy_rows_f32:    out[i] = (first argmax of logits[rows[i]], its log probability): a greedy
//                       row sampled on the device, so that 8 bytes come back instead of the row
//
// RoPE rotates the two halves of each head (`rotate_half`, candle-nn's non-interleaved `rope`):
// element i < d/2 pairs with i + d/2 under the token's cos[i], sin[i]. A slot at or past
// `num_rows` (the padding value) writes no cache row; its query is still written.
//
// Grids: rope_kv_write x = tokens; add_rms_norm x = rows, one warp each; silu_mul x = column
// blocks of ML_FUSED_THREADS, y = rows; greedy_rows x = selected rows, ML_GREEDY_THREADS each.
#include "multilora.cuh"
#include "vec.cuh"

namespace {

template <typename T>
__device__ void rope_kv_write(const MlRopeKvParams& p) {
    const uint32_t t = blockIdx.x;
    const uint32_t half = p.head_dim / 2;
    const T* row = reinterpret_cast<const T*>(p.qkv) + (size_t)t * p.qkv_stride;
    const T* cs = reinterpret_cast<const T*>(p.cos) + (size_t)t * half;
    const T* sn = reinterpret_cast<const T*>(p.sin) + (size_t)t * half;
    const uint32_t slot = reinterpret_cast<const uint32_t*>(p.slots)[t];
    const bool cached = slot < p.num_rows;
    const uint32_t kv_width = p.kv_heads * p.head_dim;
    T* q_out = reinterpret_cast<T*>(p.q_out) + (size_t)t * p.heads * p.head_dim;
    T* k_row = reinterpret_cast<T*>(p.k_cache) + (size_t)slot * kv_width;
    T* v_row = reinterpret_cast<T*>(p.v_cache) + (size_t)slot * kv_width;
    const uint32_t pairs = (p.heads + p.kv_heads) * half;
    for (uint32_t i = threadIdx.x; i < pairs; i += blockDim.x) {
        const uint32_t h = i / half, e = i % half;
        const uint32_t at = h * p.head_dim + e;
        const float x0 = ml::to_f32(row[at]), x1 = ml::to_f32(row[at + half]);
        const float c = ml::to_f32(cs[e]), s = ml::to_f32(sn[e]);
        const float r0 = x0 * c - x1 * s, r1 = x1 * c + x0 * s;
        if (h < p.heads) {
            q_out[at] = ml::from_f32<T>(r0 * p.q_scale);
            q_out[at + half] = ml::from_f32<T>(r1 * p.q_scale);
        } else if (cached) {
            const uint32_t k_at = at - p.heads * p.head_dim;
            k_row[k_at] = ml::from_f32<T>(r0);
            k_row[k_at + half] = ml::from_f32<T>(r1);
        }
    }
    if (!cached) return;
    const T* v = row + (p.heads + p.kv_heads) * p.head_dim;
    for (uint32_t i = threadIdx.x; i < kv_width; i += blockDim.x) v_row[i] = v[i];
}

template <typename T>
__device__ void add_rms_norm(const MlAddNormParams& p) {
    const uint32_t r = blockIdx.x;
    const T* x = reinterpret_cast<const T*>(p.x) + (size_t)r * p.x_stride;
    const T* res = reinterpret_cast<const T*>(p.residual) + (size_t)r * p.residual_stride;
    const T* w = reinterpret_cast<const T*>(p.weight);
    T* sum = reinterpret_cast<T*>(p.sum) + (size_t)r * p.cols;
    T* out = reinterpret_cast<T*>(p.out) + (size_t)r * p.cols;
    float sq = 0.f;
    for (uint32_t j = threadIdx.x; j < p.cols; j += 32) {
        // The sum as the next layer's residual holds it: rounded to T, and normed as rounded.
        const T s = ml::from_f32<T>(ml::to_f32(x[j]) + ml::to_f32(res[j]));
        sum[j] = s;
        const float f = ml::to_f32(s);
        sq += f * f;
    }
    sq = ml::warp_sum(sq);
    const float inv = 1.f / sqrtf(sq / (float)p.cols + p.eps);
    for (uint32_t j = threadIdx.x; j < p.cols; j += 32) out[j] = ml::from_f32<T>(ml::to_f32(sum[j]) * inv * ml::to_f32(w[j]));
}

template <typename T>
__device__ void silu_mul(const MlSiluMulParams& p) {
    const uint32_t j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= p.inter) return;
    const T* gu = reinterpret_cast<const T*>(p.gu) + (size_t)blockIdx.y * p.gu_stride;
    const float g = ml::to_f32(gu[j]), u = ml::to_f32(gu[p.inter + j]);
    reinterpret_cast<T*>(p.out)[(size_t)blockIdx.y * p.inter + j] = ml::from_f32<T>(g / (1.f + expf(-g)) * u);
}

// The better of two (value, index) candidates: the larger value, the lower index among equals; an
// index of UINT32_MAX is no candidate (values are never NaN: NaN never becomes a candidate).
__device__ __forceinline__ void greedy_merge(float& m, uint32_t& at, float m2, uint32_t at2) {
    if (at2 == UINT32_MAX) return;
    if (at == UINT32_MAX || m2 > m || (m2 == m && at2 < at)) {
        m = m2;
        at = at2;
    }
}

__device__ void greedy_rows(const MlGreedyParams& p) {
    __shared__ float s_m[ML_GREEDY_THREADS];
    __shared__ uint32_t s_at[ML_GREEDY_THREADS];
    __shared__ float s_sum[ML_GREEDY_THREADS];
    const uint32_t t = threadIdx.x;
    const uint32_t row = reinterpret_cast<const uint32_t*>(p.rows)[blockIdx.x];
    const float* x = reinterpret_cast<const float*>(p.logits) + (size_t)row * p.stride;
    // Each thread's values in increasing index: the first of equal values stays.
    float m = -INFINITY;
    uint32_t at = UINT32_MAX;
    for (uint32_t j = t; j < p.vocab; j += ML_GREEDY_THREADS) {
        const float v = x[j];
        if (v > m || (v == m && at == UINT32_MAX)) {
            m = v;
            at = j;
        }
    }
    s_m[t] = m;
    s_at[t] = at;
    __syncthreads();
    for (uint32_t half = ML_GREEDY_THREADS / 2; half > 0; half /= 2) {
        if (t < half) {
            float a = s_m[t];
            uint32_t ai = s_at[t];
            greedy_merge(a, ai, s_m[t + half], s_at[t + half]);
            s_m[t] = a;
            s_at[t] = ai;
        }
        __syncthreads();
    }
    const float mx = s_m[0];
    const uint32_t best = s_at[0];
    const bool finite = best != UINT32_MAX && mx > -INFINITY && mx < INFINITY;  // mx is never NaN
    float sum = 0.f;
    if (finite)
        for (uint32_t j = t; j < p.vocab; j += ML_GREEDY_THREADS) {
            const float v = x[j];
            if (v > -INFINITY) sum += expf(v - mx);  // NaN and -inf weigh nothing
        }
    s_sum[t] = sum;
    __syncthreads();
    for (uint32_t half = ML_GREEDY_THREADS / 2; half > 0; half /= 2) {
        if (t < half) s_sum[t] += s_sum[t + half];
        __syncthreads();
    }
    if (t == 0) {
        uint32_t* out = reinterpret_cast<uint32_t*>(p.out) + 2 * (size_t)blockIdx.x;
        // max - (max + log sum): the max weighs exactly 1, so the sum is at least 1.
        out[0] = best == UINT32_MAX ? 0u : best;
        out[1] = ml::bits_of_f32(finite ? -logf(s_sum[0]) : NAN);
    }
}

}  // namespace

extern "C" __global__ void greedy_rows_f32(const MlGreedyParams p) { greedy_rows(p); }

#define ML_FUSED_ENTRIES(T, t)                                                                     \
    extern "C" __global__ void rope_kv_write_##t(const MlRopeKvParams p) { rope_kv_write<T>(p); } \
    extern "C" __global__ void add_rms_norm_##t(const MlAddNormParams p) { add_rms_norm<T>(p); }  \
    extern "C" __global__ void silu_mul_##t(const MlSiluMulParams p) { silu_mul<T>(p); }
ML_FUSED_ENTRIES(float, f32)
ML_FUSED_ENTRIES(__nv_bfloat16, bf16)
ML_FUSED_ENTRIES(__half, f16)
