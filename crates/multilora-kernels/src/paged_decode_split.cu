// paged_decode_split / paged_decode_reduce: decode attention over the paged cache for long
// contexts and GQA (flash-decoding), the same result as paged_attention.cu's kernel:
//
//   out[n, h, :] = sum_t softmax_t(q[n, h, :] . K[row(n, t), kvh, :]) V[row(n, t), kvh, :],  t < ctx_lens[n]
//
// paged_decode_split: grid (sequences, kv_heads * head_groups, partitions of part_tokens tokens).
// A block covers the query heads that share its KV head (G of them, a template parameter of 1,
// 2, 4 or 8: registers grow with G, so the host picks the smallest that covers the group, up to
// ML_SPLIT_GROUP), so each K and V row is read once for all of them. Lanes are cut into groups of LPT lanes, one token per
// group: each lane holds 8 consecutive elements of the head (one 16-byte load for bf16 / f16, two
// for f32), so a warp has 32 / LPT tokens in flight (4 at head_dim 64, 2 at 128). Each lane group
// keeps an online softmax per head in f32; groups, then warps, are combined (max-rescaled), and
// the block writes its partition's output relative to its own max, with that max and its sum,
// or, when the context has one partition, the normalized output itself.
// paged_decode_reduce: grid (sequences, heads); combines a sequence's partitions.
#include "vec.cuh"

namespace {

// Combines (m2, l2, a2) into (m, l, a): both relative to their own max, the result to the larger.
template <int E>
__device__ __forceinline__ void merge(float& m, float& l, float* a, float m2, float l2, const float* a2) {
    const float mx = fmaxf(m, m2);
    if (mx == -INFINITY) return;  // neither saw a token
    const float f1 = m == -INFINITY ? 0.f : expf(m - mx), f2 = m2 == -INFINITY ? 0.f : expf(m2 - mx);
    l = l * f1 + l2 * f2;
#pragma unroll
    for (int e = 0; e < E; ++e) a[e] = a[e] * f1 + a2[e] * f2;
    m = mx;
}

}  // namespace

template <typename T, int D, int G>
__device__ __forceinline__ void paged_decode_split(const MlDecodeSplitParams& p) {
    constexpr int NV = D / 8;               // 8-element vectors per head row
    constexpr int LPT = NV < 32 ? NV : 32;  // lanes per token
    static_assert(NV % LPT == 0 && NV / LPT == 1, "one vector a lane: head_dim 32, 64, 128 or 256");
    static_assert((LPT & (LPT - 1)) == 0, "lanes per token divide the warp");
    constexpr int TPW = 32 / LPT;  // tokens in flight per warp
    static_assert(G >= 1 && G <= ML_SPLIT_GROUP, "query heads per block");
    const uint32_t n = blockIdx.x, part = blockIdx.z;
    const uint32_t kvh = blockIdx.y / p.head_groups, hg = blockIdx.y % p.head_groups;
    const uint32_t group = p.heads / p.kv_heads;
    const uint32_t h0 = kvh * group + hg * G;
    const uint32_t gcount = ml::umin(G, group - hg * G);
    const uint32_t ctx = reinterpret_cast<const uint32_t*>(p.ctx_lens)[n];
    const uint32_t t0 = part * p.part_tokens;
    // Uniform over the block, before its barrier: a partition past the context has nothing to do
    // (the reduce reads only the partitions the context has).
    if (t0 >= ctx) return;
    const uint32_t t1 = ml::umin(t0 + p.part_tokens, ctx);
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t tg = lane / LPT, li = lane % LPT;
    const uint32_t* table = reinterpret_cast<const uint32_t*>(p.block_tables) + (size_t)n * p.max_blocks;
    const size_t kv_width = (size_t)p.kv_heads * D;
    const T* kc = reinterpret_cast<const T*>(p.k_cache) + (size_t)kvh * D + li * 8;
    const T* vc = reinterpret_cast<const T*>(p.v_cache) + (size_t)kvh * D + li * 8;
    const T* q = reinterpret_cast<const T*>(p.q) + (size_t)n * p.q_stride + (size_t)h0 * D + li * 8;
    float qv[G][8], acc[G][8], m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if ((uint32_t)g < gcount) {
            ml::load8(q + (size_t)g * D, qv[g]);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) qv[g][e] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
        m[g] = -INFINITY;
        l[g] = 0.f;
    }
    // The trip count is uniform over the warp (every lane shuffles); a lane whose token lies past
    // the partition takes part in the sums and keeps nothing. The next step's K and V rows are
    // loaded before this step's arithmetic, so two of them are in flight per lane.
    constexpr uint32_t STEP = ML_SPLIT_WARPS * TPW;
    float kv[8], vv[8];
    const auto load = [&](uint32_t t, float* k8, float* v8) {
        if (t < t1) {
            const size_t row = (size_t)table[t / p.block_size] * p.block_size + t % p.block_size;
            ml::load8(kc + row * kv_width, k8);
            ml::load8(vc + row * kv_width, v8);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) k8[e] = v8[e] = 0.f;
        }
    };
    load(t0 + warp * TPW + tg, kv, vv);
    for (uint32_t base = t0 + warp * TPW; base < t1; base += STEP) {
        const uint32_t t = base + tg;
        const bool valid = t < t1;
        float kn[8], vn[8];
        load(t + STEP, kn, vn);
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if ((uint32_t)g >= gcount) continue;  // uniform over the block
            float s = 0.f;
#pragma unroll
            for (int e = 0; e < 8; ++e) s += qv[g][e] * kv[e];
#pragma unroll
            for (int o = LPT / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (!valid) continue;
            const float m_new = fmaxf(m[g], s);
            const float scale = expf(m[g] - m_new);  // 0 on the first token (m = -inf)
            const float w = expf(s - m_new);
            l[g] = l[g] * scale + w;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[g][e] = acc[g][e] * scale + w * vv[e];
            m[g] = m_new;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            kv[e] = kn[e];
            vv[e] = vn[e];
        }
    }
    // The lane groups of a warp: after this, lanes li of group 0 hold the warp's result.
#pragma unroll
    for (int o = LPT; o < 32; o <<= 1) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if ((uint32_t)g >= gcount) continue;
            const float m2 = __shfl_xor_sync(0xffffffffu, m[g], o);
            const float l2 = __shfl_xor_sync(0xffffffffu, l[g], o);
            float a2[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) a2[e] = __shfl_xor_sync(0xffffffffu, acc[g][e], o);
            merge<8>(m[g], l[g], acc[g], m2, l2, a2);
        }
    }
    __shared__ float wm[ML_SPLIT_WARPS][G], wl[ML_SPLIT_WARPS][G], wacc[ML_SPLIT_WARPS][G][D];
    if (tg == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if ((uint32_t)g >= gcount) continue;
            if (li == 0) {
                wm[warp][g] = m[g];
                wl[warp][g] = l[g];
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) wacc[warp][g][li * 8 + e] = acc[g][e];
        }
    }
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < gcount * D; i += blockDim.x) {
        const uint32_t g = i / D, d = i % D;
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < ML_SPLIT_WARPS; ++w) mx = fmaxf(mx, wm[w][g]);
        float sum = 0.f, o = 0.f;
#pragma unroll
        for (int w = 0; w < ML_SPLIT_WARPS; ++w) {
            // A warp that saw no token has m = -inf and l = 0; it adds nothing.
            const float f = wl[w][g] > 0.f ? expf(wm[w][g] - mx) : 0.f;
            sum += wl[w][g] * f;
            o += wacc[w][g][d] * f;
        }
        const uint32_t h = h0 + g;
        if (p.parts == 1) {
            T* out = reinterpret_cast<T*>(p.out) + (size_t)n * p.out_stride + (size_t)h * D;
            out[d] = ml::from_f32<T>(sum > 0.f ? o / sum : 0.f);
        } else {
            const size_t at = ((size_t)n * p.heads + h) * p.parts + part;
            reinterpret_cast<float*>(p.part_acc)[at * D + d] = o;
            if (d == 0) {
                reinterpret_cast<float*>(p.part_ml)[2 * at] = mx;
                reinterpret_cast<float*>(p.part_ml)[2 * at + 1] = sum;
            }
        }
    }
}

template <typename T, int D>
__device__ __forceinline__ void paged_decode_reduce(const MlDecodeSplitParams& p) {
    const uint32_t n = blockIdx.x, h = blockIdx.y;
    const uint32_t ctx = reinterpret_cast<const uint32_t*>(p.ctx_lens)[n];
    const uint32_t parts = ml::umin((ctx + p.part_tokens - 1) / p.part_tokens, p.parts);
    const size_t at = ((size_t)n * p.heads + h) * p.parts;
    const float* ml_ = reinterpret_cast<const float*>(p.part_ml) + 2 * at;
    const float* acc = reinterpret_cast<const float*>(p.part_acc) + at * D;
    float mx = -INFINITY;
    for (uint32_t z = 0; z < parts; ++z) mx = fmaxf(mx, ml_[2 * z]);
    T* out = reinterpret_cast<T*>(p.out) + (size_t)n * p.out_stride + (size_t)h * D;
    for (uint32_t d = threadIdx.x; d < D; d += blockDim.x) {
        float sum = 0.f, o = 0.f;
        for (uint32_t z = 0; z < parts; ++z) {
            const float f = ml_[2 * z + 1] > 0.f ? expf(ml_[2 * z] - mx) : 0.f;
            sum += ml_[2 * z + 1] * f;
            o += acc[(size_t)z * D + d] * f;
        }
        // The host never sends an empty context; if one came, write zeros rather than 0/0.
        out[d] = ml::from_f32<T>(sum > 0.f ? o / sum : 0.f);
    }
}

#define ML_SPLIT_G(T, t, D, G)                                                                          \
    extern "C" __global__ void paged_decode_split_##t##_d##D##_g##G(const MlDecodeSplitParams p) {      \
        paged_decode_split<T, D, G>(p);                                                                 \
    }
#define ML_SPLIT_ENTRY(T, t, D)                                                                         \
    ML_SPLIT_G(T, t, D, 1) ML_SPLIT_G(T, t, D, 2) ML_SPLIT_G(T, t, D, 4) ML_SPLIT_G(T, t, D, 8)         \
    extern "C" __global__ void paged_decode_reduce_##t##_d##D(const MlDecodeSplitParams p) {            \
        paged_decode_reduce<T, D>(p);                                                                   \
    }
#define ML_SPLIT_ENTRIES(T, t) ML_SPLIT_ENTRY(T, t, 32) ML_SPLIT_ENTRY(T, t, 64) ML_SPLIT_ENTRY(T, t, 128) ML_SPLIT_ENTRY(T, t, 256)
ML_SPLIT_ENTRIES(float, f32)
ML_SPLIT_ENTRIES(__nv_bfloat16, bf16)
ML_SPLIT_ENTRIES(__half, f16)
