// lora_shrink: the first product of every LoRA row of a step, grouped by adapter (Punica's SGMV
// shrink; with the host plan's K split it is also the BGMV shape of a decode step, where each
// adapter has a few rows and the work is spread over K instead).
//
//   s_i[z][p][j] = sum_{k in chunk z} x[rows[p], k] * A_i[slot, j, k]        for j < rank_i(seg)
//
// Grid: x = the launch's tiles (at most ML_TILE_ROWS rows of one segment), y = slices,
// z = rank_groups * k_split. A block is ML_SHRINK_WARPS warps; warp w of rank group g computes
// rank j = g * ML_SHRINK_WARPS + w for every row of the tile, its lanes striding K (each load of A
// or x is 32 consecutive elements), then one warp sum per row. A warp whose rank lies past the
// segment's true rank for this slice returns at once: the work is done at the true rank, and the
// output there stays as the host zeroed it. Partials of a K split are summed, in order, by the
// expand kernel as it reads them, so no atomics and no run-to-run differences.
#include "multilora.cuh"

template <typename TX, typename TW>
__device__ __forceinline__ void lora_shrink(const MlShrinkParams& p) {
    const MlTile t = reinterpret_cast<const MlTile*>(p.tiles)[p.tile_base + blockIdx.x];
    const uint32_t slice = blockIdx.y;
    const uint32_t group = blockIdx.z % p.rank_groups;
    const uint32_t split = blockIdx.z / p.rank_groups;
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t j = group * ML_SHRINK_WARPS + warp;
    // Uniform over the warp, and no block barrier follows: the warp simply has no rank to do.
    if (j >= p.rank[slice][t.seg - p.seg_base]) return;
    const uint32_t k0 = split * p.k_chunk;
    const uint32_t k1 = ml::umin(k0 + p.k_chunk, p.in_features);
    const TW* a = reinterpret_cast<const TW*>(p.a[slice]) + ((size_t)t.slot * p.max_rank + j) * p.in_features;
    const TX* x = reinterpret_cast<const TX*>(p.x);
    const uint32_t* rows = reinterpret_cast<const uint32_t*>(p.rows) + t.start;
    const TX* xr[ML_TILE_ROWS];
#pragma unroll
    for (int r = 0; r < ML_TILE_ROWS; ++r) xr[r] = x + (size_t)rows[(uint32_t)r < t.len ? r : 0] * p.x_stride;
    float acc[ML_TILE_ROWS];
#pragma unroll
    for (int r = 0; r < ML_TILE_ROWS; ++r) acc[r] = 0.f;
    uint32_t k = k0 + lane;
    // Four elements of A, and four of every row of x, in flight per lane before the FMAs.
    for (; k + 96 < k1; k += 128) {
        float av[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) av[u] = ml::to_f32(a[k + 32 * u]);
#pragma unroll
        for (int r = 0; r < ML_TILE_ROWS; ++r) {
            if ((uint32_t)r < t.len) {
#pragma unroll
                for (int u = 0; u < 4; ++u) acc[r] += av[u] * ml::to_f32(xr[r][k + 32 * u]);
            }
        }
    }
    for (; k < k1; k += 32) {
        const float av = ml::to_f32(a[k]);
#pragma unroll
        for (int r = 0; r < ML_TILE_ROWS; ++r) {
            if ((uint32_t)r < t.len) acc[r] += av * ml::to_f32(xr[r][k]);
        }
    }
    float* out = reinterpret_cast<float*>(p.out[slice]) + (size_t)split * p.out_split_stride;
#pragma unroll
    for (int r = 0; r < ML_TILE_ROWS; ++r) {
        if ((uint32_t)r < t.len) {
            const float v = ml::warp_sum(acc[r]);
            if (lane == 0) out[(size_t)(t.start + r) * p.out_stride + j] = v;
        }
    }
}

ML_FOR_DTYPE_PAIRS(lora_shrink, lora_shrink, MlShrinkParams)
