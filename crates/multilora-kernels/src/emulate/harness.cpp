// The kernel runner of the host emulation: reads a launch from a file (kernel name, grid, block,
// the parameter struct's bytes, the buffers, the views of them its pointers name, a seed and a
// number of schedules), runs the kernel's own source on the CPU through emu.h once per schedule,
// compares the results, and writes every buffer back. `harness --layout` prints the size and
// field offsets of every parameter struct, which the Rust side compares with its mirror.
//
// Schedule 0 starts the blocks in order, one at a time, threads forwards, views against their
// upper guard; schedule k >= 1 starts them in a seeded shuffle, up to three live at once and
// interleaved at `__syncthreads`, threads backwards when k is odd, views against their lower
// guard when k is odd. Every run starts from the same input. A result that differs between two
// schedules is a race (the harness runs two more to tell a race between blocks from one between
// threads of a block, and both from a read of poisoned bytes next to a view); every fault ends
// the process with status 3 and `multilora emulator: fault: <kind>: <detail>` on stderr.
//
// A pointer field of a parameter struct holds `(view + 1) << 48 | byte offset in the view's
// buffer` instead of an address (0 = null); `fix` turns it into this run's address (views.h).
// A new parameter struct needs a `fix_ptrs` overload in fix_ptrs.h passing every pointer field
// through `fix(p.field, "field")` (the name is what a report calls it), and its kernels a line in
// kernels.h (the device replay reads both too).
#include "../lora_embed.cu"
#include "../lora_expand.cu"
#include "../lora_shrink.cu"
#include "../paged_attention.cu"
#include "../kv_write.cu"
#include "../lora_bgmv.cu"
#include "../paged_decode_split.cu"
#include "../fused.cu"
#include "kernels.h"
#ifdef MULTILORA_EMULATE_FAULTS
#include "faults.cuh"
#endif

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "views.h"

namespace {

using ml_views::fail;
using ml_views::fix;

template <typename P>
P read_params(const std::vector<uint8_t>& bytes) {
    if (bytes.size() != sizeof(P)) fail("parameter struct of " + std::to_string(bytes.size()) + " bytes, expected " + std::to_string(sizeof(P)));
    P p;
    std::memcpy(&p, bytes.data(), sizeof(P));
    return p;
}

#include "fix_ptrs.h"

#ifdef MULTILORA_EMULATE_FAULTS
MlFaultParams fix_ptrs(MlFaultParams p) {
    p.in = fix(p.in, "in"); p.out = fix(p.out, "out");
    return p;
}
#define ML_REG_FAULT(name) k[#name] = runner(name);
#endif

// Runs a kernel once under a schedule: `name`, grid, block, the parameter bytes (pointers not yet
// fixed: each run places the views anew).
using Runner = std::function<void(const char*, dim3, dim3, const std::vector<uint8_t>&, const ml_emu::Schedule&)>;

template <typename P>
Runner runner(void (*kernel)(const P)) {
    return [kernel](const char* name, dim3 grid, dim3 block, const std::vector<uint8_t>& bytes, const ml_emu::Schedule& s) {
        const P p = fix_ptrs(read_params<P>(bytes));
        ml_emu::launch(name, grid, block, s, [&] { kernel(p); });
    };
}

std::map<std::string, Runner> kernels() {
    std::map<std::string, Runner> k;
#define ML_REG(sym, P) k[#sym] = runner<P>(sym);
    ML_KERNELS(ML_REG)
#ifdef MULTILORA_EMULATE_FAULTS
    ML_FAULT_KERNELS(ML_REG_FAULT)
#endif
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
    ML_SIZE(MlRopeKvParams)
    ML_FIELD(MlRopeKvParams, qkv) ML_FIELD(MlRopeKvParams, cos) ML_FIELD(MlRopeKvParams, sin) ML_FIELD(MlRopeKvParams, q_out)
    ML_FIELD(MlRopeKvParams, k_cache) ML_FIELD(MlRopeKvParams, v_cache) ML_FIELD(MlRopeKvParams, slots)
    ML_FIELD(MlRopeKvParams, heads) ML_FIELD(MlRopeKvParams, kv_heads) ML_FIELD(MlRopeKvParams, head_dim)
    ML_FIELD(MlRopeKvParams, qkv_stride) ML_FIELD(MlRopeKvParams, num_rows) ML_FIELD(MlRopeKvParams, q_scale)
    ML_SIZE(MlAddNormParams)
    ML_FIELD(MlAddNormParams, x) ML_FIELD(MlAddNormParams, residual) ML_FIELD(MlAddNormParams, weight)
    ML_FIELD(MlAddNormParams, sum) ML_FIELD(MlAddNormParams, out) ML_FIELD(MlAddNormParams, cols)
    ML_FIELD(MlAddNormParams, x_stride) ML_FIELD(MlAddNormParams, residual_stride) ML_FIELD(MlAddNormParams, eps)
    ML_SIZE(MlSiluMulParams)
    ML_FIELD(MlSiluMulParams, gu) ML_FIELD(MlSiluMulParams, out) ML_FIELD(MlSiluMulParams, inter) ML_FIELD(MlSiluMulParams, gu_stride)
    ML_SIZE(MlGreedyParams)
    ML_FIELD(MlGreedyParams, logits) ML_FIELD(MlGreedyParams, rows) ML_FIELD(MlGreedyParams, out)
    ML_FIELD(MlGreedyParams, vocab) ML_FIELD(MlGreedyParams, stride)
}

}  // namespace

// splitmix64: the schedules' random numbers, the same on every machine.
uint64_t mix(uint64_t& state) {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// How one run goes: the schedule, where the views lie, and for the report the seed it came from.
struct Run {
    ml_emu::Schedule schedule;
    ml_views::Place place = ml_views::Place::End;
    std::string shuffle = "in order";
};

std::string hex64(uint64_t v) {
    char b[24];
    std::snprintf(b, sizeof b, "0x%016llx", (unsigned long long)v);
    return b;
}

// A run in words, for reports.
std::string describe(const Run& r) {
    const unsigned live = r.schedule.live;
    return "blocks " + r.shuffle + ", " + (live > 1 ? std::to_string(live) + " live at once, interleaved at __syncthreads"
                                                    : std::string("one at a time")) +
           ", threads " + (r.schedule.reverse_threads ? "backwards" : "forwards") + ", views against their " +
           (r.place == ml_views::Place::Start ? "lower" : "upper") + " guard";
}

// Run k of a launch (see the file's header).
Run plan_run(dim3 grid, unsigned k, uint64_t seed) {
    Run r;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) r.schedule.blocks.push_back(dim3{x, y, z});
    if (k == 0) return r;
    uint64_t state = seed + k;
    auto& b = r.schedule.blocks;
    for (size_t i = b.size(); i > 1; --i) std::swap(b[i - 1], b[mix(state) % i]);
    r.schedule.live = 3;
    r.schedule.reverse_threads = k % 2 == 1;
    r.place = k % 2 == 1 ? ml_views::Place::Start : ml_views::Place::End;
    r.shuffle = "shuffled (seed " + hex64(seed) + ", schedule " + std::to_string(k) + ")";
    return r;
}

// Runs the kernel once from the input buffers; every view's bytes afterwards.
std::vector<std::vector<uint8_t>> run_once(const Runner& run, const char* name, dim3 grid, dim3 block,
                                           const std::vector<uint8_t>& params, const Run& r) {
    ml_views::map_all(r.place);
    run(name, grid, block, params, r.schedule);
    ml_views::check_slack(name);
    auto out = ml_views::snapshot();
    ml_views::unmap_all();
    return out;
}

// The first view and byte where two runs differ, if any.
bool first_difference(const std::vector<std::vector<uint8_t>>& a, const std::vector<std::vector<uint8_t>>& b,
                      size_t& view, size_t& byte) {
    for (view = 0; view < a.size(); ++view) {
        const auto m = std::mismatch(a[view].begin(), a[view].end(), b[view].begin());
        if (m.first != a[view].end()) {
            byte = (size_t)(m.first - a[view].begin());
            return true;
        }
    }
    return false;
}

// Run k differs from run 0: says why, after running what tells the causes apart.
[[noreturn]] void report_difference(const Runner& run, const char* name, dim3 grid, dim3 block,
                                    const std::vector<uint8_t>& params, const Run& r0, const Run& rk, uint64_t seed,
                                    const std::vector<std::vector<uint8_t>>& res0) {
    size_t view = 0, byte = 0;
    // Run 0's schedule with run k's placement: a difference comes from where the views lie.
    Run placed = r0;
    placed.place = rk.place;
    // The threads as in run k, the blocks as in run 0: a difference comes from the thread order.
    Run threads = placed;
    threads.schedule.reverse_threads = rk.schedule.reverse_threads;
    std::string kind = ml_emu::kRace, cause;
    const Run* other = &rk;
    if (first_difference(res0, run_once(run, name, grid, block, params, placed), view, byte)) {
        kind = ml_emu::kOutOfBounds;
        cause = "the result depends on where the views lie in memory: a read of the poisoned bytes next to a view";
        other = &placed;
    } else if (first_difference(res0, run_once(run, name, grid, block, params, threads), view, byte)) {
        cause = "a race between threads of one block: one reads or writes what another writes without a barrier between";
        other = &threads;
    } else {
        first_difference(res0, run_once(run, name, grid, block, params, rk), view, byte);
        cause = "a race between blocks: one block reads or writes what another block writes";
    }
    const auto& v = ml_views::g_views[view];
    ml_emu::fault(kind.c_str(), std::string(name) + ": " + cause + "; " + ml_views::describe(view) +
                                    " differs at its byte " + std::to_string(byte) + " (buffer byte " +
                                    std::to_string(v.start + byte) + ") between [" + describe(r0) + "] and [" +
                                    describe(*other) + "]; MULTILORA_EMU_SEED=" + hex64(seed) + " reproduces it");
}

// CUDA's launch limits: a launch past them fails on the device, so it fails here.
void check_limits(const char* name, dim3 grid, dim3 block) {
    const uint64_t threads = (uint64_t)block.x * block.y * block.z;
    std::string why;
    if (threads == 0 || grid.x == 0 || grid.y == 0 || grid.z == 0) why = "an empty grid or block";
    else if (threads > 1024) why = std::to_string(threads) + " threads per block (at most 1024)";
    else if (block.z > 64) why = "block.z of " + std::to_string(block.z) + " (at most 64)";
    else if (grid.y > 65535 || grid.z > 65535) why = "grid.y or grid.z past 65535";
    else if (grid.x > 0x7fffffffu) why = "grid.x past 2^31 - 1";
    if (!why.empty())
        ml_emu::fault(ml_emu::kLaunch, std::string(name) + " launched with " + why + ": grid " + ml_emu::dim_str(grid) +
                                           ", block " + ml_emu::dim_str(block));
}

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
    if (std::memcmp(magic, "MLEMU2\0\0", 8) != 0) fail("not an emulator launch file (MLEMU2)");
    const std::string name = [&] { auto b = r.blob(r.u32()); return std::string(b.begin(), b.end()); }();
    dim3 grid, block;
    grid.x = r.u32(); grid.y = r.u32(); grid.z = r.u32();
    block.x = r.u32(); block.y = r.u32(); block.z = r.u32();
    const std::vector<uint8_t> params = r.blob(r.u32());
    const uint32_t nbufs = r.u32();
    for (uint32_t i = 0; i < nbufs; ++i) ml_views::g_bufs.push_back(r.blob(r.u64()));
    const uint32_t nviews = r.u32();
    for (uint32_t i = 0; i < nviews; ++i) {
        ml_views::View v;
        v.buffer = r.u32();
        v.start = r.u64();
        v.len = r.u64();
        if (v.buffer >= nbufs || v.start > ml_views::g_bufs[v.buffer].size() ||
            v.len > ml_views::g_bufs[v.buffer].size() - v.start)
            fail("view " + std::to_string(i) + " lies outside its buffer");
        ml_views::g_views.push_back(v);
    }
    const uint64_t seed = r.u64();
    const uint32_t schedules = std::max<uint32_t>(1, r.u32());
    std::fclose(in);
    const auto table = kernels();
    const auto it = table.find(name);
    if (it == table.end()) fail("no kernel named " + name);
    check_limits(name.c_str(), grid, block);
    ml_views::install_handler();
    const Run r0 = plan_run(grid, 0, seed);
    const auto res0 = run_once(it->second, name.c_str(), grid, block, params, r0);
    for (uint32_t k = 1; k < schedules; ++k) {
        const Run rk = plan_run(grid, k, seed);
        size_t view = 0, byte = 0;
        if (first_difference(res0, run_once(it->second, name.c_str(), grid, block, params, rk), view, byte))
            report_difference(it->second, name.c_str(), grid, block, params, r0, rk, seed, res0);
    }
    const auto bufs = ml_views::write_back(res0, name.c_str());
    FILE* out = std::fopen(argv[2], "wb");
    if (!out) fail(std::string("cannot create ") + argv[2]);
    std::fwrite(&nbufs, 4, 1, out);
    for (const auto& b : bufs) {
        const uint64_t n = b.size();
        std::fwrite(&n, 8, 1, out);
        std::fwrite(b.data(), 1, b.size(), out);
    }
    return std::fclose(out) == 0 ? 0 : 2;
}
