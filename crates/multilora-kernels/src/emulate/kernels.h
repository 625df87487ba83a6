// Every kernel of ours, with its parameter struct: `ML_KERNELS(X)` expands `X(symbol, Params)`
// once per kernel, for the emulator's harness (which runs each symbol) and the device replay
// (which finds each by name in the fatbins and fixes its pointer fields by type). A new kernel
// gets a line here; a new parameter struct a `fix_ptrs` overload in fix_ptrs.h.
#pragma once

#include "../params.h"

#define ML_K_PAIRS(X, name, P)                                                                                  \
    X(name##_f32_f32, P) X(name##_f32_bf16, P) X(name##_f32_f16, P) X(name##_bf16_f32, P) X(name##_bf16_bf16, P) \
    X(name##_bf16_f16, P) X(name##_f16_f32, P) X(name##_f16_bf16, P) X(name##_f16_f16, P)
#define ML_K_ATTN(X, t)                                                                                           \
    X(paged_decode_##t##_d32, MlDecodeAttnParams) X(paged_decode_##t##_d64, MlDecodeAttnParams)                   \
    X(paged_decode_##t##_d96, MlDecodeAttnParams) X(paged_decode_##t##_d128, MlDecodeAttnParams)                  \
    X(paged_decode_##t##_d160, MlDecodeAttnParams) X(paged_decode_##t##_d192, MlDecodeAttnParams)                 \
    X(paged_decode_##t##_d224, MlDecodeAttnParams) X(paged_decode_##t##_d256, MlDecodeAttnParams)
#define ML_K_BGMV(X, tx, tw, R) \
    X(lora_shrink_bgmv_##tx##_##tw##_r##R, MlBgmvShrinkParams) X(lora_expand_bgmv_##tx##_##tw##_r##R, MlBgmvExpandParams)
#define ML_K_BGMV_RANKS(X, tx, tw) \
    ML_K_BGMV(X, tx, tw, 8) ML_K_BGMV(X, tx, tw, 16) ML_K_BGMV(X, tx, tw, 32) ML_K_BGMV(X, tx, tw, 64)
#define ML_K_SPLIT(X, t, d)                                                                                       \
    X(paged_decode_split_##t##_d##d##_g1, MlDecodeSplitParams) X(paged_decode_split_##t##_d##d##_g2, MlDecodeSplitParams) \
    X(paged_decode_split_##t##_d##d##_g4, MlDecodeSplitParams) X(paged_decode_split_##t##_d##d##_g8, MlDecodeSplitParams) \
    X(paged_decode_reduce_##t##_d##d, MlDecodeSplitParams)
#define ML_K_SPLITS(X, t) ML_K_SPLIT(X, t, 32) ML_K_SPLIT(X, t, 64) ML_K_SPLIT(X, t, 128) ML_K_SPLIT(X, t, 256)
#define ML_K_FUSED(X, t) \
    X(rope_kv_write_##t, MlRopeKvParams) X(add_rms_norm_##t, MlAddNormParams) X(silu_mul_##t, MlSiluMulParams)

#define ML_KERNELS(X)                                                                                              \
    ML_K_PAIRS(X, lora_shrink, MlShrinkParams)                                                                     \
    ML_K_PAIRS(X, lora_expand, MlExpandParams)                                                                     \
    X(lora_embed_shrink_f32, MlEmbedShrinkParams) X(lora_embed_shrink_bf16, MlEmbedShrinkParams)                   \
    X(lora_embed_shrink_f16, MlEmbedShrinkParams)                                                                  \
    ML_K_ATTN(X, f32) ML_K_ATTN(X, bf16) ML_K_ATTN(X, f16)                                                         \
    X(paged_kv_write, MlKvWriteParams)                                                                             \
    ML_K_BGMV_RANKS(X, f32, f32) ML_K_BGMV_RANKS(X, f32, bf16) ML_K_BGMV_RANKS(X, f32, f16)                        \
    ML_K_BGMV_RANKS(X, bf16, f32) ML_K_BGMV_RANKS(X, bf16, bf16) ML_K_BGMV_RANKS(X, bf16, f16)                     \
    ML_K_BGMV_RANKS(X, f16, f32) ML_K_BGMV_RANKS(X, f16, bf16) ML_K_BGMV_RANKS(X, f16, f16)                        \
    ML_K_SPLITS(X, f32) ML_K_SPLITS(X, bf16) ML_K_SPLITS(X, f16)                                                   \
    ML_K_FUSED(X, f32) ML_K_FUSED(X, bf16) ML_K_FUSED(X, f16)                                                      \
    X(greedy_rows_f32, MlGreedyParams)
