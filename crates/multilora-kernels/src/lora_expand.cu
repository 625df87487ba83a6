// lora_expand: the second product of every LoRA row, added into the layer's output in place at
// each slice's columns (Punica's SGMV expand; the decode shape is the same kernel with one tile
// per adapter).
//
//   y[rows[p], col_off_i + c] += sum_{j < rank_i(seg)} (sum_z s_i[z][p][j]) * Bt_i[slot, j, c]
//
// Grid: x = the launch's tiles, y = slices, z = column chunks of ML_EXPAND_THREADS *
// ML_EXPAND_COLS_PER_THREAD columns (the widest slice's; blocks past a narrower slice's width
// return at once). A block first stages the tile's shrink rows (K-split partials summed in order)
// in shared memory, then each thread keeps ML_EXPAND_COLS_PER_THREAD columns, strided by the block
// size so every load of Bt and of y is coalesced, for every row of the tile. The delta is summed
// in f32 and rounded once into y's dtype. Rows of slot -1 are in no tile, and a slice the adapter
// does not target has rank 0: neither is read or written, so they keep the base output bit for bit.
#include "multilora.cuh"

template <typename TX, typename TW>
__device__ __forceinline__ void lora_expand(const MlExpandParams& p) {
    constexpr uint32_t COLS = ML_EXPAND_COLS_PER_THREAD;
    const MlTile t = reinterpret_cast<const MlTile*>(p.tiles)[p.tile_base + blockIdx.x];
    const uint32_t slice = blockIdx.y;
    const uint32_t rank = p.rank[slice][t.seg - p.seg_base];
    const uint32_t width = p.width[slice];
    const uint32_t c0 = blockIdx.z * (ML_EXPAND_THREADS * COLS);
    // Uniform over the block, and before its only barrier.
    if (rank == 0 || c0 >= width) return;
    __shared__ float sv[ML_TILE_ROWS][ML_MAX_RANK];
    const float* s = reinterpret_cast<const float*>(p.s[slice]);
    for (uint32_t i = threadIdx.x; i < t.len * rank; i += ML_EXPAND_THREADS) {
        const uint32_t r = i / rank, j = i % rank;
        const size_t at = (size_t)(t.start + r) * p.s_stride[slice] + j;
        float v = 0.f;
        for (uint32_t z = 0; z < p.k_split; ++z) v += s[(size_t)z * p.s_split_stride[slice] + at];
        sv[r][j] = v;
    }
    __syncthreads();
    const TW* b = reinterpret_cast<const TW*>(p.b[slice]) + (size_t)t.slot * p.max_rank * width;
    uint32_t col[COLS];
#pragma unroll
    for (uint32_t e = 0; e < COLS; ++e) col[e] = c0 + e * ML_EXPAND_THREADS + threadIdx.x;
    float acc[ML_TILE_ROWS][COLS];
#pragma unroll
    for (int r = 0; r < ML_TILE_ROWS; ++r) {
#pragma unroll
        for (uint32_t e = 0; e < COLS; ++e) acc[r][e] = 0.f;
    }
    for (uint32_t j = 0; j < rank; ++j) {
        const TW* bj = b + (size_t)j * width;
        float bv[COLS];
#pragma unroll
        for (uint32_t e = 0; e < COLS; ++e) bv[e] = col[e] < width ? ml::to_f32(bj[col[e]]) : 0.f;
#pragma unroll
        for (int r = 0; r < ML_TILE_ROWS; ++r) {
            if ((uint32_t)r < t.len) {
                const float w = sv[r][j];
#pragma unroll
                for (uint32_t e = 0; e < COLS; ++e) acc[r][e] += w * bv[e];
            }
        }
    }
    TX* y = reinterpret_cast<TX*>(p.y);
    const uint32_t* rows = reinterpret_cast<const uint32_t*>(p.rows) + t.start;
#pragma unroll
    for (int r = 0; r < ML_TILE_ROWS; ++r) {
        if ((uint32_t)r < t.len) {
            TX* yr = y + (size_t)rows[r] * p.y_stride + p.col_off[slice];
#pragma unroll
            for (uint32_t e = 0; e < COLS; ++e) {
                if (col[e] < width) yr[col[e]] = ml::from_f32<TX>(ml::to_f32(yr[col[e]]) + acc[r][e]);
            }
        }
    }
}

ML_FOR_DTYPE_PAIRS(lora_expand, lora_expand, MlExpandParams)
