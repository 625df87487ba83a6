// lora_embed_shrink: the "shrink" of PEFT's embedding LoRA, a gather. For every LoRA row p of
// the step, of token id ids[rows[p]], and every j below its segment's true rank:
//
//   s[p][j] = At[slot, id, j]            At: lora_embedding_A transposed, [max_loras, vocab, max_rank]
//
// The expand is the linear layers' kernel (lora_expand.cu). Grid: x = the launch's tiles; the
// block's threads walk the tile's (row, rank) pairs, so each row's rank-wide slice is one
// contiguous read.
#include "multilora.cuh"

template <typename TW>
__device__ __forceinline__ void lora_embed_shrink(const MlEmbedShrinkParams& p) {
    const MlTile t = reinterpret_cast<const MlTile*>(p.tiles)[p.tile_base + blockIdx.x];
    const uint32_t rank = p.rank[t.seg - p.seg_base];
    const uint32_t* rows = reinterpret_cast<const uint32_t*>(p.rows) + t.start;
    const uint32_t* ids = reinterpret_cast<const uint32_t*>(p.ids);
    const TW* a = reinterpret_cast<const TW*>(p.a_t) + (size_t)t.slot * p.vocab * p.max_rank;
    float* out = reinterpret_cast<float*>(p.out);
    for (uint32_t i = threadIdx.x; i < t.len * rank; i += blockDim.x) {
        const uint32_t r = i / rank, j = i % rank;
        const uint32_t id = ids[rows[r]];
        // The model checks every id against the vocabulary before a step; this only keeps a bad
        // id from reading outside the table (the row then keeps its zeros).
        if (id < p.vocab) out[(size_t)(t.start + r) * p.out_stride + j] = ml::to_f32(a[(size_t)id * p.max_rank + j]);
    }
}

#define ML_EMBED_ENTRY(TW, tw) \
    extern "C" __global__ void lora_embed_shrink_##tw(const MlEmbedShrinkParams p) { lora_embed_shrink<TW>(p); }
ML_EMBED_ENTRY(float, f32)
ML_EMBED_ENTRY(__nv_bfloat16, bf16)
ML_EMBED_ENTRY(__half, f16)
