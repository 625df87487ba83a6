// paged_decode: attention of every decode row (one new token per sequence) over its context in
// the paged KV cache, reading K and V rows through the block table on the device: no gather, no
// padding, no mask.
//
//   out[n, h, :] = sum_t softmax_t(q[n, h, :] . K[row(n, t), kvh, :]) V[row(n, t), kvh, :]
//   row(n, t) = block_tables[n, t / block_size] * block_size + t % block_size,  t < ctx_lens[n]
//   kvh = h / (heads / kv_heads)                                          (GQA shares a KV head)
//
// Grid: (sequences, query heads); a block is ML_ATTN_WARPS warps. Lane l holds elements
// l, l + 32, ... of the head (head_dim = 32 * EPL), so each K or V row is read with coalesced
// loads. Each warp walks every ML_ATTN_WARPS-th token with an online softmax in f32 (running
// max, running sum, rescaled accumulator); the warps' partial results are then combined in
// shared memory. Scores, softmax and the weighted sum are all f32 whatever the cache dtype.
#include "multilora.cuh"

template <typename T, int EPL>
__device__ __forceinline__ void paged_decode(const MlDecodeAttnParams& p) {
    constexpr int D = 32 * EPL;
    const uint32_t n = blockIdx.x, h = blockIdx.y;
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t kvh = h / (p.heads / p.kv_heads);
    const uint32_t ctx = reinterpret_cast<const uint32_t*>(p.ctx_lens)[n];
    const uint32_t* table = reinterpret_cast<const uint32_t*>(p.block_tables) + (size_t)n * p.max_blocks;
    const T* q = reinterpret_cast<const T*>(p.q) + (size_t)n * p.q_stride + (size_t)h * D;
    const size_t kv_width = (size_t)p.kv_heads * D;
    const T* kc = reinterpret_cast<const T*>(p.k_cache) + (size_t)kvh * D;
    const T* vc = reinterpret_cast<const T*>(p.v_cache) + (size_t)kvh * D;
    float qv[EPL], acc[EPL];
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
        qv[e] = ml::to_f32(q[e * 32 + lane]);
        acc[e] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    for (uint32_t t = warp; t < ctx; t += ML_ATTN_WARPS) {
        const size_t row = (size_t)table[t / p.block_size] * p.block_size + t % p.block_size;
        const T* kr = kc + row * kv_width;
        const T* vr = vc + row * kv_width;
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) s += qv[e] * ml::to_f32(kr[e * 32 + lane]);
        s = ml::warp_sum(s);
        const float m_new = fmaxf(m, s);
        const float scale = expf(m - m_new);  // 0 on the first token (m = -inf)
        const float w = expf(s - m_new);
        l = l * scale + w;
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[e] = acc[e] * scale + w * ml::to_f32(vr[e * 32 + lane]);
        m = m_new;
    }
    __shared__ float wm[ML_ATTN_WARPS], wl[ML_ATTN_WARPS], wacc[ML_ATTN_WARPS][D];
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
#pragma unroll
    for (int e = 0; e < EPL; ++e) wacc[warp][e * 32 + lane] = acc[e];
    __syncthreads();
    if (warp != 0) return;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < ML_ATTN_WARPS; ++w) mx = fmaxf(mx, wm[w]);
    float sum = 0.f, o[EPL];
#pragma unroll
    for (int e = 0; e < EPL; ++e) o[e] = 0.f;
#pragma unroll
    for (int w = 0; w < ML_ATTN_WARPS; ++w) {
        // A warp that saw no token has m = -inf and l = 0; it adds nothing.
        const float f = wl[w] > 0.f ? expf(wm[w] - mx) : 0.f;
        sum += wl[w] * f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) o[e] += wacc[w][e * 32 + lane] * f;
    }
    // The host never sends an empty context; if one came, write zeros rather than 0/0.
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    T* out = reinterpret_cast<T*>(p.out) + (size_t)n * p.out_stride + (size_t)h * D;
#pragma unroll
    for (int e = 0; e < EPL; ++e) out[e * 32 + lane] = ml::from_f32<T>(o[e] * inv);
}

#define ML_ATTN_ENTRY(T, t, EPL, d) \
    extern "C" __global__ void paged_decode_##t##_d##d(const MlDecodeAttnParams p) { paged_decode<T, EPL>(p); }
#define ML_ATTN_ENTRIES(T, t)                                                                       \
    ML_ATTN_ENTRY(T, t, 1, 32)                                                                      \
    ML_ATTN_ENTRY(T, t, 2, 64)                                                                      \
    ML_ATTN_ENTRY(T, t, 3, 96)                                                                      \
    ML_ATTN_ENTRY(T, t, 4, 128)                                                                     \
    ML_ATTN_ENTRY(T, t, 5, 160)                                                                     \
    ML_ATTN_ENTRY(T, t, 6, 192)                                                                     \
    ML_ATTN_ENTRY(T, t, 7, 224)                                                                     \
    ML_ATTN_ENTRY(T, t, 8, 256)
ML_ATTN_ENTRIES(float, f32)
ML_ATTN_ENTRIES(__nv_bfloat16, bf16)
ML_ATTN_ENTRIES(__half, f16)
