// The kernel runner of the host emulation: reads a launch from a file (kernel name, grid, block,
// the parameter struct's bytes and the buffers its pointers name), runs the kernel's own source
// on the CPU through emu.h, and writes every buffer back. `harness --layout` prints the size and
// field offsets of every parameter struct, which the Rust side compares with its mirror.
//
// A pointer field of a parameter struct holds `(buffer + 1) << 48 | byte offset` instead of an
// address (0 = null); the runner turns it into the address of that byte of that buffer.
#include "../lora_embed.cu"
#include "../lora_expand.cu"
#include "../lora_shrink.cu"
#include "../paged_attention.cu"
#include "../kv_write.cu"
#include "../lora_bgmv.cu"
#include "../paged_decode_split.cu"

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

namespace {

std::vector<std::vector<uint8_t>> g_bufs;

[[noreturn]] void fail(const std::string& why) {
    std::fprintf(stderr, "multilora emulator: %s\n", why.c_str());
    std::exit(2);
}

uint64_t fix(uint64_t v) {
    if (v == 0) return 0;
    const uint64_t idx = (v >> 48) - 1, off = v & ((1ull << 48) - 1);
    if (idx >= g_bufs.size()) fail("pointer names buffer " + std::to_string(idx) + " of " + std::to_string(g_bufs.size()));
    if (off > g_bufs[idx].size()) fail("pointer offset " + std::to_string(off) + " past buffer " + std::to_string(idx));
    return (uint64_t)(uintptr_t)(g_bufs[idx].data() + off);
}

template <typename P>
P read_params(const std::vector<uint8_t>& bytes) {
    if (bytes.size() != sizeof(P)) fail("parameter struct of " + std::to_string(bytes.size()) + " bytes, expected " + std::to_string(sizeof(P)));
    P p;
    std::memcpy(&p, bytes.data(), sizeof(P));
    return p;
}

MlShrinkParams fix_ptrs(MlShrinkParams p) {
    p.x = fix(p.x); p.rows = fix(p.rows); p.tiles = fix(p.tiles);
    for (int i = 0; i < ML_MAX_SLICES; ++i) { p.a[i] = fix(p.a[i]); p.out[i] = fix(p.out[i]); }
    return p;
}
MlExpandParams fix_ptrs(MlExpandParams p) {
    p.y = fix(p.y); p.rows = fix(p.rows); p.tiles = fix(p.tiles);
    for (int i = 0; i < ML_MAX_SLICES; ++i) { p.b[i] = fix(p.b[i]); p.s[i] = fix(p.s[i]); }
    return p;
}
MlEmbedShrinkParams fix_ptrs(MlEmbedShrinkParams p) {
    p.ids = fix(p.ids); p.rows = fix(p.rows); p.tiles = fix(p.tiles); p.a_t = fix(p.a_t); p.out = fix(p.out);
    return p;
}
MlDecodeAttnParams fix_ptrs(MlDecodeAttnParams p) {
    p.q = fix(p.q); p.k_cache = fix(p.k_cache); p.v_cache = fix(p.v_cache);
    p.block_tables = fix(p.block_tables); p.ctx_lens = fix(p.ctx_lens); p.out = fix(p.out);
    return p;
}

MlKvWriteParams fix_ptrs(MlKvWriteParams p) {
    p.src = fix(p.src); p.cache = fix(p.cache); p.slots = fix(p.slots);
    return p;
}

MlBgmvShrinkParams fix_ptrs(MlBgmvShrinkParams p) {
    p.x = fix(p.x); p.rows = fix(p.rows); p.slot_meta = fix(p.slot_meta);
    for (int i = 0; i < ML_MAX_SLICES; ++i) { p.a[i] = fix(p.a[i]); p.out[i] = fix(p.out[i]); }
    return p;
}
MlBgmvExpandParams fix_ptrs(MlBgmvExpandParams p) {
    p.y = fix(p.y); p.rows = fix(p.rows); p.slot_meta = fix(p.slot_meta);
    for (int i = 0; i < ML_MAX_SLICES; ++i) { p.b[i] = fix(p.b[i]); p.s[i] = fix(p.s[i]); }
    return p;
}

MlDecodeSplitParams fix_ptrs(MlDecodeSplitParams p) {
    p.q = fix(p.q); p.k_cache = fix(p.k_cache); p.v_cache = fix(p.v_cache); p.block_tables = fix(p.block_tables);
    p.ctx_lens = fix(p.ctx_lens); p.out = fix(p.out); p.part_acc = fix(p.part_acc); p.part_ml = fix(p.part_ml);
    return p;
}

using Runner = std::function<void(dim3, dim3, const std::vector<uint8_t>&)>;

template <typename P>
Runner runner(void (*kernel)(const P)) {
    return [kernel](dim3 grid, dim3 block, const std::vector<uint8_t>& bytes) {
        const P p = fix_ptrs(read_params<P>(bytes));
        ml_emu::launch(grid, block, [&] { kernel(p); });
    };
}

std::map<std::string, Runner> kernels() {
    std::map<std::string, Runner> k;
#define ML_REG2(name, tx, tw) k[#name "_" #tx "_" #tw] = runner(name##_##tx##_##tw);
#define ML_REG_PAIRS(name) \
    ML_REG2(name, f32, f32) ML_REG2(name, f32, bf16) ML_REG2(name, f32, f16) \
    ML_REG2(name, bf16, f32) ML_REG2(name, bf16, bf16) ML_REG2(name, bf16, f16) \
    ML_REG2(name, f16, f32) ML_REG2(name, f16, bf16) ML_REG2(name, f16, f16)
    ML_REG_PAIRS(lora_shrink)
    ML_REG_PAIRS(lora_expand)
    k["lora_embed_shrink_f32"] = runner(lora_embed_shrink_f32);
    k["lora_embed_shrink_bf16"] = runner(lora_embed_shrink_bf16);
    k["lora_embed_shrink_f16"] = runner(lora_embed_shrink_f16);
#define ML_REG_ATTN(t) \
    k["paged_decode_" #t "_d32"] = runner(paged_decode_##t##_d32); \
    k["paged_decode_" #t "_d64"] = runner(paged_decode_##t##_d64); \
    k["paged_decode_" #t "_d96"] = runner(paged_decode_##t##_d96); \
    k["paged_decode_" #t "_d128"] = runner(paged_decode_##t##_d128); \
    k["paged_decode_" #t "_d160"] = runner(paged_decode_##t##_d160); \
    k["paged_decode_" #t "_d192"] = runner(paged_decode_##t##_d192); \
    k["paged_decode_" #t "_d224"] = runner(paged_decode_##t##_d224); \
    k["paged_decode_" #t "_d256"] = runner(paged_decode_##t##_d256);
    ML_REG_ATTN(f32) ML_REG_ATTN(bf16) ML_REG_ATTN(f16)
    k["paged_kv_write"] = runner(paged_kv_write);
#define ML_REG_BGMV(tx, tw, R) \
    k["lora_shrink_bgmv_" #tx "_" #tw "_r" #R] = runner(lora_shrink_bgmv_##tx##_##tw##_r##R); \
    k["lora_expand_bgmv_" #tx "_" #tw "_r" #R] = runner(lora_expand_bgmv_##tx##_##tw##_r##R);
#define ML_REG_BGMV_RANKS(tx, tw) ML_REG_BGMV(tx, tw, 8) ML_REG_BGMV(tx, tw, 16) ML_REG_BGMV(tx, tw, 32) ML_REG_BGMV(tx, tw, 64)
    ML_REG_BGMV_RANKS(f32, f32) ML_REG_BGMV_RANKS(f32, bf16) ML_REG_BGMV_RANKS(f32, f16)
    ML_REG_BGMV_RANKS(bf16, f32) ML_REG_BGMV_RANKS(bf16, bf16) ML_REG_BGMV_RANKS(bf16, f16)
    ML_REG_BGMV_RANKS(f16, f32) ML_REG_BGMV_RANKS(f16, bf16) ML_REG_BGMV_RANKS(f16, f16)
#define ML_REG_SPLIT_G(t, d, g) k["paged_decode_split_" #t "_d" #d "_g" #g] = runner(paged_decode_split_##t##_d##d##_g##g);
#define ML_REG_SPLIT(t, d) \
    ML_REG_SPLIT_G(t, d, 1) ML_REG_SPLIT_G(t, d, 2) ML_REG_SPLIT_G(t, d, 4) ML_REG_SPLIT_G(t, d, 8) \
    k["paged_decode_reduce_" #t "_d" #d] = runner(paged_decode_reduce_##t##_d##d);
#define ML_REG_SPLITS(t) ML_REG_SPLIT(t, 32) ML_REG_SPLIT(t, 64) ML_REG_SPLIT(t, 128) ML_REG_SPLIT(t, 256)
    ML_REG_SPLITS(f32) ML_REG_SPLITS(bf16) ML_REG_SPLITS(f16)
    return k;
}

struct Reader {
    FILE* f;
    void bytes(void* dst, size_t n) {
        if (n && std::fread(dst, 1, n, f) != n) fail("short input");
    }
    uint32_t u32() { uint32_t v; bytes(&v, 4); return v; }
    uint64_t u64() { uint64_t v; bytes(&v, 8); return v; }
    std::vector<uint8_t> blob(size_t n) { std::vector<uint8_t> v(n); bytes(v.data(), n); return v; }
};

void layout() {
#define ML_SIZE(S) std::printf("%s size %zu\n", #S, sizeof(S));
#define ML_FIELD(S, f) std::printf("%s.%s %zu\n", #S, #f, offsetof(S, f));
    ML_SIZE(MlTile) ML_FIELD(MlTile, slot) ML_FIELD(MlTile, seg) ML_FIELD(MlTile, start) ML_FIELD(MlTile, len)
    ML_SIZE(MlShrinkParams)
    ML_FIELD(MlShrinkParams, x) ML_FIELD(MlShrinkParams, rows) ML_FIELD(MlShrinkParams, tiles)
    ML_FIELD(MlShrinkParams, a) ML_FIELD(MlShrinkParams, out) ML_FIELD(MlShrinkParams, x_stride)
    ML_FIELD(MlShrinkParams, in_features) ML_FIELD(MlShrinkParams, max_rank) ML_FIELD(MlShrinkParams, num_slices)
    ML_FIELD(MlShrinkParams, out_stride) ML_FIELD(MlShrinkParams, out_split_stride) ML_FIELD(MlShrinkParams, k_chunk)
    ML_FIELD(MlShrinkParams, rank_groups) ML_FIELD(MlShrinkParams, tile_base) ML_FIELD(MlShrinkParams, seg_base)
    ML_FIELD(MlShrinkParams, rank)
    ML_SIZE(MlExpandParams)
    ML_FIELD(MlExpandParams, y) ML_FIELD(MlExpandParams, rows) ML_FIELD(MlExpandParams, tiles)
    ML_FIELD(MlExpandParams, b) ML_FIELD(MlExpandParams, s) ML_FIELD(MlExpandParams, width)
    ML_FIELD(MlExpandParams, col_off) ML_FIELD(MlExpandParams, s_stride) ML_FIELD(MlExpandParams, s_split_stride)
    ML_FIELD(MlExpandParams, y_stride) ML_FIELD(MlExpandParams, max_rank) ML_FIELD(MlExpandParams, num_slices)
    ML_FIELD(MlExpandParams, k_split) ML_FIELD(MlExpandParams, tile_base) ML_FIELD(MlExpandParams, seg_base)
    ML_FIELD(MlExpandParams, rank)
    ML_SIZE(MlEmbedShrinkParams)
    ML_FIELD(MlEmbedShrinkParams, ids) ML_FIELD(MlEmbedShrinkParams, rows) ML_FIELD(MlEmbedShrinkParams, tiles)
    ML_FIELD(MlEmbedShrinkParams, a_t) ML_FIELD(MlEmbedShrinkParams, out) ML_FIELD(MlEmbedShrinkParams, vocab)
    ML_FIELD(MlEmbedShrinkParams, max_rank) ML_FIELD(MlEmbedShrinkParams, out_stride)
    ML_FIELD(MlEmbedShrinkParams, tile_base) ML_FIELD(MlEmbedShrinkParams, seg_base) ML_FIELD(MlEmbedShrinkParams, pad)
    ML_FIELD(MlEmbedShrinkParams, rank)
    ML_SIZE(MlDecodeAttnParams)
    ML_FIELD(MlDecodeAttnParams, q) ML_FIELD(MlDecodeAttnParams, k_cache) ML_FIELD(MlDecodeAttnParams, v_cache)
    ML_FIELD(MlDecodeAttnParams, block_tables) ML_FIELD(MlDecodeAttnParams, ctx_lens) ML_FIELD(MlDecodeAttnParams, out)
    ML_FIELD(MlDecodeAttnParams, heads) ML_FIELD(MlDecodeAttnParams, kv_heads) ML_FIELD(MlDecodeAttnParams, block_size)
    ML_FIELD(MlDecodeAttnParams, max_blocks) ML_FIELD(MlDecodeAttnParams, q_stride) ML_FIELD(MlDecodeAttnParams, out_stride)
    ML_SIZE(MlKvWriteParams)
    ML_FIELD(MlKvWriteParams, src) ML_FIELD(MlKvWriteParams, cache) ML_FIELD(MlKvWriteParams, slots)
    ML_FIELD(MlKvWriteParams, width) ML_FIELD(MlKvWriteParams, src_stride) ML_FIELD(MlKvWriteParams, elem_bytes)
    ML_FIELD(MlKvWriteParams, num_rows)
#define ML_BGMV_COMMON(S) ML_SIZE(S) ML_FIELD(S, rows) ML_FIELD(S, slot_meta) ML_FIELD(S, width) ML_FIELD(S, max_rank) \
    ML_FIELD(S, max_loras) ML_FIELD(S, k_split) ML_FIELD(S, rank)
    ML_BGMV_COMMON(MlBgmvShrinkParams)
    ML_FIELD(MlBgmvShrinkParams, x) ML_FIELD(MlBgmvShrinkParams, a) ML_FIELD(MlBgmvShrinkParams, out)
    ML_FIELD(MlBgmvShrinkParams, x_stride) ML_FIELD(MlBgmvShrinkParams, in_features)
    ML_FIELD(MlBgmvShrinkParams, out_stride) ML_FIELD(MlBgmvShrinkParams, out_split_stride) ML_FIELD(MlBgmvShrinkParams, k_chunk)
    ML_SIZE(MlDecodeSplitParams)
    ML_FIELD(MlDecodeSplitParams, q) ML_FIELD(MlDecodeSplitParams, k_cache) ML_FIELD(MlDecodeSplitParams, v_cache)
    ML_FIELD(MlDecodeSplitParams, block_tables) ML_FIELD(MlDecodeSplitParams, ctx_lens) ML_FIELD(MlDecodeSplitParams, out)
    ML_FIELD(MlDecodeSplitParams, part_acc) ML_FIELD(MlDecodeSplitParams, part_ml) ML_FIELD(MlDecodeSplitParams, heads)
    ML_FIELD(MlDecodeSplitParams, kv_heads) ML_FIELD(MlDecodeSplitParams, block_size) ML_FIELD(MlDecodeSplitParams, max_blocks)
    ML_FIELD(MlDecodeSplitParams, q_stride) ML_FIELD(MlDecodeSplitParams, out_stride) ML_FIELD(MlDecodeSplitParams, part_tokens)
    ML_FIELD(MlDecodeSplitParams, parts) ML_FIELD(MlDecodeSplitParams, head_groups) ML_FIELD(MlDecodeSplitParams, pad)
    ML_BGMV_COMMON(MlBgmvExpandParams)
    ML_FIELD(MlBgmvExpandParams, y) ML_FIELD(MlBgmvExpandParams, b) ML_FIELD(MlBgmvExpandParams, s)
    ML_FIELD(MlBgmvExpandParams, col_off) ML_FIELD(MlBgmvExpandParams, s_stride) ML_FIELD(MlBgmvExpandParams, s_split_stride)
    ML_FIELD(MlBgmvExpandParams, y_stride) ML_FIELD(MlBgmvExpandParams, col_chunks) ML_FIELD(MlBgmvExpandParams, pad)
}

}  // namespace

int main(int argc, char** argv) {
    if (argc == 2 && std::string(argv[1]) == "--layout") {
        layout();
        return 0;
    }
    if (argc != 3) fail("usage: harness IN OUT | harness --layout");
    FILE* in = std::fopen(argv[1], "rb");
    if (!in) fail(std::string("cannot open ") + argv[1]);
    Reader r{in};
    char magic[8];
    r.bytes(magic, 8);
    if (std::memcmp(magic, "MLEMU1\0\0", 8) != 0) fail("not an emulator launch file");
    const std::string name = [&] { auto b = r.blob(r.u32()); return std::string(b.begin(), b.end()); }();
    dim3 grid, block;
    grid.x = r.u32(); grid.y = r.u32(); grid.z = r.u32();
    block.x = r.u32(); block.y = r.u32(); block.z = r.u32();
    const std::vector<uint8_t> params = r.blob(r.u32());
    const uint32_t nbufs = r.u32();
    for (uint32_t i = 0; i < nbufs; ++i) g_bufs.push_back(r.blob(r.u64()));
    std::fclose(in);
    const auto table = kernels();
    const auto it = table.find(name);
    if (it == table.end()) fail("no kernel named " + name);
    it->second(grid, block, params);
    FILE* out = std::fopen(argv[2], "wb");
    if (!out) fail(std::string("cannot create ") + argv[2]);
    std::fwrite(&nbufs, 4, 1, out);
    for (const auto& b : g_bufs) {
        const uint64_t n = b.size();
        std::fwrite(&n, 8, 1, out);
        std::fwrite(b.data(), 1, b.size(), out);
    }
    return std::fclose(out) == 0 ? 0 : 2;
}
