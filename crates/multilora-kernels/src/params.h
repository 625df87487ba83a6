// The launch parameters of every multilora kernel, passed by value (one struct per launch, no
// device-side metadata beyond the step's tiles and row index). `src/params.rs` mirrors these
// structs field for field with `#[repr(C)]`; a test compares the two layouts through the host
// compiler, so the Rust side and the kernels can never disagree on an offset.
//
// Pointers are device addresses (`uint64_t`, so the layout is the same for nvcc and the host
// compiler). Every size is in elements, never in bytes.
#pragma once
#include <stdint.h>

// Slices of a fused layer one launch covers (qkv is 3, gate_up 2).
#define ML_MAX_SLICES 4
// Segments (distinct adapters) one launch covers; the host splits a step with more into launches.
#define ML_MAX_SEGS 64
// Rows of one tile: a segment is cut into tiles of at most this many rows.
#define ML_TILE_ROWS 8
// Largest rank the expand kernel stages in shared memory.
#define ML_MAX_RANK 512
// Shrink: one warp per rank, this many warps (ranks) per block.
#define ML_SHRINK_WARPS 8
// Expand: threads per block, and output columns per thread (strided by the block size).
#define ML_EXPAND_THREADS 128
#define ML_EXPAND_COLS_PER_THREAD 8
// Decode attention: warps per (sequence, head) block.
#define ML_ATTN_WARPS 4

// One tile of the step's LoRA rows: `len` rows of segment `seg` (slot `slot`), starting at packed
// position `start` of the mapping's sorted LoRA rows.
typedef struct {
    uint32_t slot;
    uint32_t seg;
    uint32_t start;
    uint32_t len;
} MlTile;

// shrink: s_i[z][p][j] = sum_{k in chunk z} x[rows[p], k] * A_i[slot, j, k] for j < rank_i(seg).
typedef struct {
    uint64_t x;                      // TX [.., x_stride]: the layer input
    uint64_t rows;                   // u32 [n_lora]: packed position -> row of x
    uint64_t tiles;                  // MlTile [..]
    uint64_t a[ML_MAX_SLICES];       // TW [max_loras, max_rank, in_features] per slice
    uint64_t out[ML_MAX_SLICES];     // f32 per slice: [k_split][n_lora][out_stride], zeroed
    uint32_t x_stride;               // elements between rows of x
    uint32_t in_features;
    uint32_t max_rank;               // ranks per slot in A (the slot stride)
    uint32_t num_slices;             // gridDim.y
    uint32_t out_stride;             // elements between rows of out
    uint32_t out_split_stride;       // elements between K-split partials of out
    uint32_t k_chunk;                // elements of K per split
    uint32_t rank_groups;            // gridDim.z = rank_groups * k_split
    uint32_t tile_base;              // first tile of this launch (blockIdx.x is relative)
    uint32_t seg_base;               // first segment of this launch (rank[][] is relative)
    uint16_t rank[ML_MAX_SLICES][ML_MAX_SEGS];  // true rank of each segment, per slice
} MlShrinkParams;

// expand: y[rows[p], col_off_i + c] += sum_{j < rank_i(seg)} (sum_z s_i[z][p][j]) * Bt_i[slot, j, c].
typedef struct {
    uint64_t y;                      // TX [.., y_stride]: the layer output, updated in place
    uint64_t rows;                   // u32 [n_lora]
    uint64_t tiles;                  // MlTile [..]
    uint64_t b[ML_MAX_SLICES];       // TW [max_loras, max_rank, width_i]: B transposed, rank-major
    uint64_t s[ML_MAX_SLICES];       // f32 per slice: [k_split][n_lora][s_stride]
    uint32_t width[ML_MAX_SLICES];   // output columns of each slice
    uint32_t col_off[ML_MAX_SLICES]; // first column of each slice in y
    uint32_t s_stride[ML_MAX_SLICES];       // elements between rows of s_i
    uint32_t s_split_stride[ML_MAX_SLICES]; // elements between K-split partials of s_i
    uint32_t y_stride;
    uint32_t max_rank;
    uint32_t num_slices;             // gridDim.y
    uint32_t k_split;                // partials summed, in order, as s is read
    uint32_t tile_base;
    uint32_t seg_base;
    uint16_t rank[ML_MAX_SLICES][ML_MAX_SEGS];
} MlExpandParams;

// embedding shrink (a gather): s[p][j] = At[slot, ids[rows[p]], j] for j < rank(seg).
typedef struct {
    uint64_t ids;                    // u32 [rows]: the step's token ids
    uint64_t rows;                   // u32 [n_lora]
    uint64_t tiles;                  // MlTile [..]
    uint64_t a_t;                    // TW [max_loras, vocab, max_rank]: lora_embedding_A transposed
    uint64_t out;                    // f32 [n_lora][out_stride], zeroed
    uint32_t vocab;
    uint32_t max_rank;
    uint32_t out_stride;
    uint32_t tile_base;
    uint32_t seg_base;
    uint32_t pad;
    uint16_t rank[ML_MAX_SEGS];
} MlEmbedShrinkParams;

// decode attention over the paged cache: one block per (sequence, query head).
// out[n, h, :] = softmax_t(q[n, h, :] . K[row(n, t), kvh, :]) V[row(n, t), kvh, :], t < ctx_lens[n],
// row(n, t) = block_tables[n, t / block_size] * block_size + t % block_size, kvh = h / (heads / kv_heads).
typedef struct {
    uint64_t q;                      // TX [n, heads, head_dim], already scaled by 1/sqrt(head_dim)
    uint64_t k_cache;                // TX [num_blocks * block_size, kv_heads * head_dim]
    uint64_t v_cache;
    uint64_t block_tables;           // u32 [n, max_blocks]
    uint64_t ctx_lens;               // u32 [n]
    uint64_t out;                    // TX [n, heads * head_dim]
    uint32_t heads;
    uint32_t kv_heads;
    uint32_t block_size;
    uint32_t max_blocks;             // row stride of block_tables
    uint32_t q_stride;               // elements between sequences of q
    uint32_t out_stride;             // elements between sequences of out
} MlDecodeAttnParams;

// Threads of a KV-write block (one block per new token).
#define ML_KV_WRITE_THREADS 128

// KV write: cache[slots[t]] = src[t] for every new token t (grid x); launched once for K and
// once for V. The cache and the source share one dtype of `elem_bytes` bytes (2 or 4).
typedef struct {
    uint64_t src;                    // [tokens, src_stride]: the new keys (or values)
    uint64_t cache;                  // [num_rows, width]
    uint64_t slots;                  // u32 [tokens]: cache row of each token (>= num_rows: none)
    uint32_t width;                  // elements of a cache row (kv_heads * head_dim)
    uint32_t src_stride;             // elements between rows of src
    uint32_t elem_bytes;             // 2 or 4
    uint32_t num_rows;               // rows of the cache
} MlKvWriteParams;

// Decode-shaped (BGMV) LoRA kernels: the grid covers every slot (max_loras) and row block of the
// step whatever the batch holds; a block with no rows returns at once (vLLM's approach), so a
// decode step's launches depend only on the batch size, the slots' ranks and the shapes.
// Rows of one block: a slot's rows are cut into blocks of ML_TILE_ROWS.
// Expand: threads per block, each owning 8 consecutive columns (one 16-byte access of 16-bit B).
#define ML_BGMV_EXPAND_THREADS 64
#define ML_BGMV_EXPAND_COLS (ML_BGMV_EXPAND_THREADS * 8)
// K of one shrink split is a multiple of this (a warp's 8 elements a lane).
#define ML_BGMV_K_ALIGN 256

// BGMV shrink: grid x = slots, y = slices, z = row_blocks * k_split (split fastest).
// s_i[z][p][j] = sum_{k in chunk z} x[rows[p], k] * A_i[slot, j, k] for j < rank_i(slot), and 0
// for rank_i(slot) <= j < width_i: every element of the output is written (no memset).
typedef struct {
    uint64_t x;                      // TX [.., x_stride]
    uint64_t rows;                   // u32 [n_lora]: packed position -> row of x
    uint64_t slot_meta;              // u32 [2 * max_loras]: first packed position of each slot, then its rows
    uint64_t a[ML_MAX_SLICES];       // TW [max_loras, max_rank, in_features] per slice
    uint64_t out[ML_MAX_SLICES];     // f32 per slice: [k_split][n_lora][out_stride]
    uint32_t width[ML_MAX_SLICES];   // output columns of each slice (its largest rank)
    uint32_t x_stride;
    uint32_t in_features;
    uint32_t max_rank;
    uint32_t max_loras;
    uint32_t out_stride;
    uint32_t out_split_stride;
    uint32_t k_chunk;                // a multiple of ML_BGMV_K_ALIGN
    uint32_t k_split;
    uint16_t rank[ML_MAX_SLICES][ML_MAX_SEGS];  // true rank of each slot, per slice
} MlBgmvShrinkParams;

// BGMV expand: grid x = slots, y = slices, z = row_blocks * col_chunks (chunk fastest).
// y[rows[p], col_off_i + c] += sum_{j < rank_i(slot)} (sum_z s_i[z][p][j]) * Bt_i[slot, j, c].
typedef struct {
    uint64_t y;                      // TX [.., y_stride], updated in place
    uint64_t rows;                   // u32 [n_lora]
    uint64_t slot_meta;              // u32 [2 * max_loras]
    uint64_t b[ML_MAX_SLICES];       // TW [max_loras, max_rank, width_i]: B transposed
    uint64_t s[ML_MAX_SLICES];       // f32 per slice: [k_split][n_lora][s_stride]
    uint32_t width[ML_MAX_SLICES];   // output columns of each slice
    uint32_t col_off[ML_MAX_SLICES];
    uint32_t s_stride;
    uint32_t s_split_stride;
    uint32_t y_stride;
    uint32_t max_rank;
    uint32_t max_loras;
    uint32_t k_split;
    uint32_t col_chunks;
    uint32_t pad;
    uint16_t rank[ML_MAX_SLICES][ML_MAX_SEGS];
} MlBgmvExpandParams;

// Split decode attention (flash-decoding): warps per block, query heads one block covers (of the
// heads that share a KV head), and tokens of one context partition.
#define ML_SPLIT_WARPS 4
#define ML_SPLIT_GROUP 8
#define ML_SPLIT_PART_TOKENS 512

// paged_decode_split: grid (sequences, kv_heads * head_groups, parts). Block (n, kvh, hg, z)
// attends query heads kvh * group + hg * G ... (at most G of them, G <= ML_SPLIT_GROUP) over
// tokens z * part_tokens ... of sequence n's context, reading each K and V row once for all of
// them. With parts = 1 it writes `out` (normalized); otherwise its partition's output relative to
// its own max into part_acc, and (max, sum) into part_ml, for paged_decode_reduce (grid
// (sequences, heads)) to combine over the ceil(ctx / part_tokens) partitions the context has.
typedef struct {
    uint64_t q;                      // TX [n, heads, head_dim], already scaled by 1/sqrt(head_dim)
    uint64_t k_cache;                // TX [num_blocks * block_size, kv_heads * head_dim]
    uint64_t v_cache;
    uint64_t block_tables;           // u32 [n, max_blocks]
    uint64_t ctx_lens;               // u32 [n]
    uint64_t out;                    // TX [n, heads * head_dim]
    uint64_t part_acc;               // f32 [n, heads, parts, head_dim]
    uint64_t part_ml;                // f32 [n, heads, parts, 2]: max, sum
    uint32_t heads;
    uint32_t kv_heads;
    uint32_t block_size;
    uint32_t max_blocks;
    uint32_t q_stride;
    uint32_t out_stride;
    uint32_t part_tokens;
    uint32_t parts;
    uint32_t head_groups;            // ceil((heads / kv_heads) / G), G the kernel's heads per block
    uint32_t pad;
} MlDecodeSplitParams;

// Threads of a fused block (rope_kv_write: one block per token; silu_mul: columns per block).
// add_rms_norm runs one warp (32 threads) per row.
#define ML_FUSED_THREADS 128

// rope_kv_write: the q/k/v row of each token (grid x) rotated, q scaled into q_out, k and v into
// the token's cache row. One dtype T for qkv, cos / sin, q_out and the caches.
typedef struct {
    uint64_t qkv;                    // T [tokens, qkv_stride]: q (heads * head_dim), k, v (kv_heads * head_dim)
    uint64_t cos;                    // T [tokens, head_dim / 2]
    uint64_t sin;                    // T [tokens, head_dim / 2]
    uint64_t q_out;                  // T [tokens, heads * head_dim]
    uint64_t k_cache;                // T [num_rows, kv_heads * head_dim]
    uint64_t v_cache;                // T [num_rows, kv_heads * head_dim]
    uint64_t slots;                  // u32 [tokens]: cache row of each token (>= num_rows: none)
    uint32_t heads;
    uint32_t kv_heads;
    uint32_t head_dim;               // even
    uint32_t qkv_stride;             // elements between rows of qkv
    uint32_t num_rows;               // rows of each cache
    float q_scale;
} MlRopeKvParams;

// add_rms_norm: sum = x + residual (rounded to T), out = sum / sqrt(mean(sum^2) + eps) * weight,
// one warp per row (grid x).
typedef struct {
    uint64_t x;                      // T [rows, x_stride]
    uint64_t residual;               // T [rows, residual_stride]
    uint64_t weight;                 // T [cols]
    uint64_t sum;                    // T [rows, cols]
    uint64_t out;                    // T [rows, cols]
    uint32_t cols;
    uint32_t x_stride;
    uint32_t residual_stride;
    float eps;
} MlAddNormParams;

// silu_mul: out[r, j] = silu(gu[r, j]) * gu[r, inter + j]; grid (ceil(inter / ML_FUSED_THREADS), rows).
typedef struct {
    uint64_t gu;                     // T [rows, gu_stride]: gate then up
    uint64_t out;                    // T [rows, inter]
    uint32_t inter;
    uint32_t gu_stride;
} MlSiluMulParams;

// Threads of a greedy_rows block (one block per selected row).
#define ML_GREEDY_THREADS 256

// greedy_rows: for each selected row (grid x) of f32 logits, the first index of its largest
// value (NaN passed over; 0 for a row of NaN alone) and that value's log probability,
// -log(sum(exp(x - max))) over the row's numbers (NaN where the max is not finite).
typedef struct {
    uint64_t logits;                 // f32 [.., stride]
    uint64_t rows;                   // u32 [count]: the rows to take
    uint64_t out;                    // u32 [count, 2]: the index, then its log probability's f32 bits
    uint32_t vocab;                  // values of a row
    uint32_t stride;                 // elements between rows
} MlGreedyParams;
