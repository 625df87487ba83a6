// paged_kv_write: a step's new keys (or values) into their rows of the paged KV cache, the
// write every layer makes twice (what candle's `scatter_set` did with one block for the whole step).
//
//   cache[slots[t], :] = src[t, :]                                        for every new token t
//
// Grid: x = the step's tokens, one block each; the block copies the token's row as
// bytes (the cache and the source share the dtype, so one kernel serves f32, bf16 and f16), 16
// bytes a thread where both rows are 16-byte aligned, then the tail (or a misaligned row) two
// bytes at a time. The destination row comes straight from the step's slot mapping (one u32 per
// token); a slot at or past `num_rows` (the padding value 0xffffffff) writes nothing.
#include "vec.cuh"

namespace {

__device__ __forceinline__ void copy_row(uint8_t* dst, const uint8_t* src, uint32_t bytes) {
    const uint32_t n16 = ml::aligned16(dst, src) ? bytes / 16 : 0;
    for (uint32_t i = threadIdx.x; i < n16; i += blockDim.x) ml::st16(dst + 16 * (size_t)i, ml::ld16(src + 16 * (size_t)i));
    uint16_t* d2 = reinterpret_cast<uint16_t*>(dst);
    const uint16_t* s2 = reinterpret_cast<const uint16_t*>(src);
    for (uint32_t i = n16 * 8 + threadIdx.x; i < bytes / 2; i += blockDim.x) d2[i] = s2[i];
}

}  // namespace

extern "C" __global__ void paged_kv_write(const MlKvWriteParams p) {
    const uint32_t t = blockIdx.x;
    const uint32_t row = reinterpret_cast<const uint32_t*>(p.slots)[t];
    if (row >= p.num_rows) return;
    const uint32_t bytes = p.width * p.elem_bytes;
    copy_row(reinterpret_cast<uint8_t*>(p.cache) + (size_t)row * bytes,
             reinterpret_cast<const uint8_t*>(p.src) + (size_t)t * p.src_stride * p.elem_bytes, bytes);
}
