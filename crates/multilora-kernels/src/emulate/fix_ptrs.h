// The pointer fields of every parameter struct, passed through `fix(value, "field")` (or
// `fix(value, "field", index)` for an array), which the includer declares before including this:
// the emulator's turns a field's view-and-offset into this run's host address (views.h), the
// device replay's into a device address. A new parameter struct needs its overload here.
#pragma once

#include "../params.h"

inline MlShrinkParams fix_ptrs(MlShrinkParams p) {
    p.x = fix(p.x, "x"); p.rows = fix(p.rows, "rows"); p.tiles = fix(p.tiles, "tiles");
    for (int i = 0; i < ML_MAX_SLICES; ++i) { p.a[i] = fix(p.a[i], "a", i); p.out[i] = fix(p.out[i], "out", i); }
    return p;
}
inline MlExpandParams fix_ptrs(MlExpandParams p) {
    p.y = fix(p.y, "y"); p.rows = fix(p.rows, "rows"); p.tiles = fix(p.tiles, "tiles");
    for (int i = 0; i < ML_MAX_SLICES; ++i) { p.b[i] = fix(p.b[i], "b", i); p.s[i] = fix(p.s[i], "s", i); }
    return p;
}
inline MlEmbedShrinkParams fix_ptrs(MlEmbedShrinkParams p) {
    p.ids = fix(p.ids, "ids"); p.rows = fix(p.rows, "rows"); p.tiles = fix(p.tiles, "tiles");
    p.a_t = fix(p.a_t, "a_t"); p.out = fix(p.out, "out");
    return p;
}
inline MlDecodeAttnParams fix_ptrs(MlDecodeAttnParams p) {
    p.q = fix(p.q, "q"); p.k_cache = fix(p.k_cache, "k_cache"); p.v_cache = fix(p.v_cache, "v_cache");
    p.block_tables = fix(p.block_tables, "block_tables"); p.ctx_lens = fix(p.ctx_lens, "ctx_lens"); p.out = fix(p.out, "out");
    return p;
}
inline MlKvWriteParams fix_ptrs(MlKvWriteParams p) {
    p.src = fix(p.src, "src"); p.cache = fix(p.cache, "cache"); p.slots = fix(p.slots, "slots");
    return p;
}
inline MlBgmvShrinkParams fix_ptrs(MlBgmvShrinkParams p) {
    p.x = fix(p.x, "x"); p.rows = fix(p.rows, "rows"); p.slot_meta = fix(p.slot_meta, "slot_meta");
    for (int i = 0; i < ML_MAX_SLICES; ++i) { p.a[i] = fix(p.a[i], "a", i); p.out[i] = fix(p.out[i], "out", i); }
    return p;
}
inline MlBgmvExpandParams fix_ptrs(MlBgmvExpandParams p) {
    p.y = fix(p.y, "y"); p.rows = fix(p.rows, "rows"); p.slot_meta = fix(p.slot_meta, "slot_meta");
    for (int i = 0; i < ML_MAX_SLICES; ++i) { p.b[i] = fix(p.b[i], "b", i); p.s[i] = fix(p.s[i], "s", i); }
    return p;
}
inline MlDecodeSplitParams fix_ptrs(MlDecodeSplitParams p) {
    p.q = fix(p.q, "q"); p.k_cache = fix(p.k_cache, "k_cache"); p.v_cache = fix(p.v_cache, "v_cache"); p.block_tables = fix(p.block_tables, "block_tables");
    p.ctx_lens = fix(p.ctx_lens, "ctx_lens"); p.out = fix(p.out, "out"); p.part_acc = fix(p.part_acc, "part_acc"); p.part_ml = fix(p.part_ml, "part_ml");
    return p;
}
inline MlRopeKvParams fix_ptrs(MlRopeKvParams p) {
    p.qkv = fix(p.qkv, "qkv"); p.cos = fix(p.cos, "cos"); p.sin = fix(p.sin, "sin"); p.q_out = fix(p.q_out, "q_out");
    p.k_cache = fix(p.k_cache, "k_cache"); p.v_cache = fix(p.v_cache, "v_cache"); p.slots = fix(p.slots, "slots");
    return p;
}
inline MlAddNormParams fix_ptrs(MlAddNormParams p) {
    p.x = fix(p.x, "x"); p.residual = fix(p.residual, "residual"); p.weight = fix(p.weight, "weight");
    p.sum = fix(p.sum, "sum"); p.out = fix(p.out, "out");
    return p;
}
inline MlSiluMulParams fix_ptrs(MlSiluMulParams p) {
    p.gu = fix(p.gu, "gu"); p.out = fix(p.out, "out");
    return p;
}
inline MlGreedyParams fix_ptrs(MlGreedyParams p) {
    p.logits = fix(p.logits, "logits"); p.rows = fix(p.rows, "rows"); p.out = fix(p.out, "out");
    return p;
}
