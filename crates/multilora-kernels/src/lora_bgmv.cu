// lora_shrink_bgmv / lora_expand_bgmv: the LoRA products of a decode-shaped step (a few rows per
// adapter), the rank a compile-time parameter R (8, 16, 32 or 64: the slots' largest rank,
// rounded up), 16-byte loads and stores where rows are aligned (a scalar tail otherwise).
//
//   shrink: s_i[z][p][j] = sum_{k in chunk z} x[rows[p], k] * A_i[slot, j, k]      j < rank_i(slot)
//   expand: y[rows[p], col_off_i + c] += sum_j (sum_z s_i[z][p][j]) * Bt_i[slot, j, c]
//
// The grid covers every slot (x) and every row block of ML_TILE_ROWS rows the batch could hold
// (z), whatever rows the batch gives each slot: a block reads its slot's first packed position
// and row count from the step's fixed-size slot table and returns at once when it has no rows.
// So a decode step's launches depend on the batch size, the slots' ranks and the shapes only.
//
// Shrink: a block is ML_SHRINK_WARPS warps over one K chunk; warp w computes ranks w, w + 8, ...
// below R for the block's rows, each lane reading 8 consecutive elements of A and of every row of
// x at a time; ranks from the slot's own rank up to the slice's width are written as zeros, so
// the output needs no memset. Expand: a block stages its rows' shrink output (the K-split
// partials summed in order) in shared memory; each thread owns 8 consecutive columns and walks
// the R ranks unrolled, one 16-byte load of Bt per rank.
#include "vec.cuh"

template <typename TX, typename TW, int R>
__device__ __forceinline__ void lora_shrink_bgmv(const MlBgmvShrinkParams& p) {
    static_assert(R % ML_SHRINK_WARPS == 0, "R is a multiple of the warps");
    const uint32_t slot = blockIdx.x, slice = blockIdx.y;
    const uint32_t rb = blockIdx.z / p.k_split, split = blockIdx.z % p.k_split;
    const uint32_t* meta = reinterpret_cast<const uint32_t*>(p.slot_meta);
    const uint32_t len = meta[p.max_loras + slot];
    const uint32_t r0 = rb * ML_TILE_ROWS;
    // Uniform over the block, and no barrier follows.
    if (r0 >= len) return;
    const uint32_t start = meta[slot] + r0;
    const uint32_t nrows = ml::umin(ML_TILE_ROWS, len - r0);
    const uint32_t rank = p.rank[slice][slot], width = p.width[slice];
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t k0 = split * p.k_chunk, k1 = ml::umin(k0 + p.k_chunk, p.in_features);
    const TX* x = reinterpret_cast<const TX*>(p.x);
    const uint32_t* rows = reinterpret_cast<const uint32_t*>(p.rows) + start;
    const TX* xr[ML_TILE_ROWS];
#pragma unroll
    for (int r = 0; r < ML_TILE_ROWS; ++r) xr[r] = x + (size_t)rows[(uint32_t)r < nrows ? r : 0] * p.x_stride;
    const TW* a0 = reinterpret_cast<const TW*>(p.a[slice]) + (size_t)slot * p.max_rank * p.in_features;
    // Every row of A and of x starts 16-byte aligned at k0 (k0 is a multiple of 256), or none
    // takes the vector path.
    const bool vec = p.in_features % 8 == 0 && p.x_stride % 8 == 0 && ml::aligned16(a0, x);
    const uint32_t kv = vec ? k0 + (k1 - k0) / 8 * 8 : k0;
    float* out = reinterpret_cast<float*>(p.out[slice]) + (size_t)split * p.out_split_stride;
#pragma unroll 1
    for (int jj = 0; jj < R / ML_SHRINK_WARPS; ++jj) {
        const uint32_t j = jj * ML_SHRINK_WARPS + warp;
        if (j >= width) break;  // uniform over the warp
        if (j >= rank) {
            // Past the slot's rank: zeros, so that the output needs no memset.
            if (lane < nrows) out[(size_t)(start + lane) * p.out_stride + j] = 0.f;
            continue;
        }
        const TW* a = a0 + (size_t)j * p.in_features;
        float acc[ML_TILE_ROWS];
#pragma unroll
        for (int r = 0; r < ML_TILE_ROWS; ++r) acc[r] = 0.f;
#pragma unroll 2
        for (uint32_t k = k0 + 8 * lane; k < kv; k += 256) {
            float av[8];
            ml::load8(a + k, av);
#pragma unroll
            for (int r = 0; r < ML_TILE_ROWS; ++r) {
                if ((uint32_t)r < nrows) {
                    float xv[8];
                    ml::load8(xr[r] + k, xv);
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[r] += av[e] * xv[e];
                }
            }
        }
        for (uint32_t k = kv + lane; k < k1; k += 32) {
            const float av = ml::to_f32(a[k]);
#pragma unroll
            for (int r = 0; r < ML_TILE_ROWS; ++r) {
                if ((uint32_t)r < nrows) acc[r] += av * ml::to_f32(xr[r][k]);
            }
        }
#pragma unroll
        for (int r = 0; r < ML_TILE_ROWS; ++r) {
            if ((uint32_t)r < nrows) {
                const float v = ml::warp_sum(acc[r]);
                if (lane == 0) out[(size_t)(start + r) * p.out_stride + j] = v;
            }
        }
    }
}

template <typename TX, typename TW, int R>
__device__ __forceinline__ void lora_expand_bgmv(const MlBgmvExpandParams& p) {
    const uint32_t slot = blockIdx.x, slice = blockIdx.y;
    const uint32_t rb = blockIdx.z / p.col_chunks, chunk = blockIdx.z % p.col_chunks;
    const uint32_t* meta = reinterpret_cast<const uint32_t*>(p.slot_meta);
    const uint32_t len = meta[p.max_loras + slot];
    const uint32_t r0 = rb * ML_TILE_ROWS;
    const uint32_t rank = p.rank[slice][slot], width = p.width[slice];
    const uint32_t c0 = chunk * ML_BGMV_EXPAND_COLS;
    // Uniform over the block, and before its only barrier.
    if (r0 >= len || rank == 0 || c0 >= width) return;
    const uint32_t start = meta[slot] + r0;
    const uint32_t nrows = ml::umin(ML_TILE_ROWS, len - r0);
    __shared__ float sv[ML_TILE_ROWS][R];
    const float* s = reinterpret_cast<const float*>(p.s[slice]);
    for (uint32_t i = threadIdx.x; i < ML_TILE_ROWS * R; i += blockDim.x) {
        const uint32_t r = i / R, j = i % R;
        float v = 0.f;
        if (r < nrows && j < rank) {
            const size_t at = (size_t)(start + r) * p.s_stride + j;
            for (uint32_t z = 0; z < p.k_split; ++z) v += s[(size_t)z * p.s_split_stride + at];
        }
        sv[r][j] = v;
    }
    __syncthreads();
    const uint32_t c = c0 + 8 * threadIdx.x;
    if (c >= width) return;
    const TW* b = reinterpret_cast<const TW*>(p.b[slice]) + (size_t)slot * p.max_rank * width + c;
    float acc[ML_TILE_ROWS][8];
#pragma unroll
    for (int r = 0; r < ML_TILE_ROWS; ++r) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[r][e] = 0.f;
    }
    // Whole 8-column groups of 16-byte aligned rows take one vector load per rank.
    const bool vec_b = width % 8 == 0 && ml::aligned16(reinterpret_cast<const TW*>(p.b[slice]));
#pragma unroll
    for (int j = 0; j < R; ++j) {
        if ((uint32_t)j < rank) {
            float bv[8];
            if (vec_b) {
                ml::load8(b + (size_t)j * width, bv);
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) bv[e] = c + e < width ? ml::to_f32(b[(size_t)j * width + e]) : 0.f;
            }
#pragma unroll
            for (int r = 0; r < ML_TILE_ROWS; ++r) {
                const float w = sv[r][j];
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r][e] += w * bv[e];
            }
        }
    }
    TX* y = reinterpret_cast<TX*>(p.y);
    const uint32_t* rows = reinterpret_cast<const uint32_t*>(p.rows) + start;
    const bool vec_y = vec_b && p.y_stride % 8 == 0 && p.col_off[slice] % 8 == 0 && ml::aligned16(y);
#pragma unroll
    for (int r = 0; r < ML_TILE_ROWS; ++r) {
        if ((uint32_t)r >= nrows) continue;
        TX* yr = y + (size_t)rows[r] * p.y_stride + p.col_off[slice] + c;
        if (vec_y) {
            float yv[8];
            ml::load8(yr, yv);
#pragma unroll
            for (int e = 0; e < 8; ++e) yv[e] += acc[r][e];
            ml::store8(yr, yv);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                if (c + e < width) yr[e] = ml::from_f32<TX>(ml::to_f32(yr[e]) + acc[r][e]);
            }
        }
    }
}

#define ML_BGMV_ENTRY(TX, tx, TW, tw, R)                                                            \
    extern "C" __global__ void lora_shrink_bgmv_##tx##_##tw##_r##R(const MlBgmvShrinkParams p) {    \
        lora_shrink_bgmv<TX, TW, R>(p);                                                             \
    }                                                                                               \
    extern "C" __global__ void lora_expand_bgmv_##tx##_##tw##_r##R(const MlBgmvExpandParams p) {    \
        lora_expand_bgmv<TX, TW, R>(p);                                                             \
    }
#define ML_BGMV_RANKS(TX, tx, TW, tw)                                                               \
    ML_BGMV_ENTRY(TX, tx, TW, tw, 8)                                                                \
    ML_BGMV_ENTRY(TX, tx, TW, tw, 16)                                                               \
    ML_BGMV_ENTRY(TX, tx, TW, tw, 32)                                                               \
    ML_BGMV_ENTRY(TX, tx, TW, tw, 64)

ML_BGMV_RANKS(float, f32, float, f32)
ML_BGMV_RANKS(float, f32, __nv_bfloat16, bf16)
ML_BGMV_RANKS(float, f32, __half, f16)
ML_BGMV_RANKS(__nv_bfloat16, bf16, float, f32)
ML_BGMV_RANKS(__nv_bfloat16, bf16, __nv_bfloat16, bf16)
ML_BGMV_RANKS(__nv_bfloat16, bf16, __half, f16)
ML_BGMV_RANKS(__half, f16, float, f32)
ML_BGMV_RANKS(__half, f16, __nv_bfloat16, bf16)
ML_BGMV_RANKS(__half, f16, __half, f16)
