// Host emulation of the small part of CUDA the multilora kernels use, so that the same kernel
// source runs on a CPU in the tests (the kernels include it through `multilora.cuh` when built
// with MULTILORA_EMULATE by the host C++ compiler; nvcc never sees it). The runtime is strict: it
// is meant to catch what a GPU would only get wrong silently.
//
// Scheduling (`ml_emu::launch`) is deterministic. A CUDA thread is a fiber (ucontext); the fibers
// of a live block run one at a time, in a given order, each until it waits (`__syncthreads`, a
// warp collective) or exits. A `Schedule` says in which order blocks start, how many are live at
// once (one OS thread each, so `__shared__`, a `static thread_local`, is each live block's own
// shared memory) and whether threads run forwards or backwards; live blocks hand over to each
// other, in turn, whenever one reaches a barrier or ends. Only one fiber runs at any moment, so a
// run is a pure function of its schedule: the harness runs a launch under several schedules and
// any difference in the results is a race.
//
// Warp collectives (`__shfl_*_sync`, `__syncwarp`, `__ballot_sync`, `__any_sync`, `__all_sync`)
// follow the sync semantics: a lane waits until every lane of its mask has called a collective
// with the same mask (from any call site: divergent halves of a warp may each use their own). A
// mask that leaves out the caller, names a lane that does not exist or has exited, or waits for
// lanes that never come (they exited, wait at `__syncthreads`, or wait in collectives of other
// masks that cannot complete either) is a fault, reported and fatal; so are lanes of one
// collective calling different intrinsics, and reading a lane outside the mask. A thread that exits leaves the block's barriers, as on the hardware.
#pragma once

#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static thread_local
#define __restrict__
#define __launch_bounds__(...)

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

// The device's vector types, laid out as CUDA lays them out.
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

namespace ml_emu {

// What a fault is called in the report (the Rust side reads it back as `FaultKind`).
inline constexpr const char* kWarpSync = "warp sync";
inline constexpr const char* kOutOfBounds = "out of bounds";
inline constexpr const char* kRace = "race";
inline constexpr const char* kLaunch = "launch";

// Reports a fault on stderr as `multilora emulator: fault: <kind>: <detail>` and ends the
// process with status 3. Only `write` and `_exit`: it is also called from the SIGSEGV handler.
[[noreturn]] inline void fault(const char* kind, const char* detail) {
    const char* parts[] = {"multilora emulator: fault: ", kind, ": ", detail, "\n"};
    for (const char* p : parts) {
        size_t n = std::strlen(p);
        while (n > 0) {
            const ssize_t w = ::write(2, p, n);
            if (w <= 0) break;
            p += w;
            n -= (size_t)w;
        }
    }
    ::_exit(3);
}
[[noreturn]] inline void fault(const char* kind, const std::string& detail) { fault(kind, detail.c_str()); }

enum class State : uint8_t { Ready, Barrier, Warp, Exited };
enum class Op : uint8_t { Sync, ShflIdx, ShflUp, ShflDown, ShflXor, Ballot, Any, All };

// One CUDA thread.
struct Fiber {
    ucontext_t ctx;
    void* stack = nullptr;
    dim3 idx;
    unsigned linear = 0;
    State state = State::Exited;
    // The warp collective it waits in: mask, operation, its argument and width, the value it
    // brought, the result it takes away, and the intrinsic's name for reports.
    unsigned mask = 0;
    Op op = Op::Sync;
    int arg = 0, width = 32;
    uint64_t val = 0, res = 0;
    const char* what = "";
};

// In which order a launch's blocks start, how many are live at once, and in which order a
// block's threads take turns.
struct Schedule {
    std::vector<dim3> blocks;
    unsigned live = 1;
    bool reverse_threads = false;
};

// One live block and the OS thread that runs it.
struct Slot {
    unsigned id = 0;
    std::vector<Fiber> fibers;
    std::vector<unsigned> order;
    ucontext_t home;
    dim3 idx;
};

struct Launch {
    const char* kernel = "";
    dim3 grid, block;
    unsigned threads = 0;
    const std::function<void()>* body = nullptr;
    const Schedule* schedule = nullptr;
    // The turn: only the slot whose turn it is runs, so a run is deterministic.
    std::mutex m;
    std::condition_variable cv;
    unsigned turn = 0;
    size_t next_block = 0;
    std::vector<bool> active;
};

inline constexpr size_t kStackBytes = 128 * 1024;
inline Launch* g_launch = nullptr;
inline thread_local Slot* t_slot = nullptr;
inline thread_local Fiber* t_fiber = nullptr;

inline std::string dim_str(dim3 d) {
    return "(" + std::to_string(d.x) + "," + std::to_string(d.y) + "," + std::to_string(d.z) + ")";
}

inline std::string hex(unsigned v) {
    char b[16];
    std::snprintf(b, sizeof b, "0x%08x", v);
    return b;
}

// "<kernel> block (x,y,z) thread (x,y,z)": where the running fiber is.
inline std::string here() {
    std::string s = g_launch ? g_launch->kernel : "?";
    if (t_slot) s += " block " + dim_str(t_slot->idx);
    if (t_fiber) s += " thread " + dim_str(t_fiber->idx);
    return s;
}

// Whether `p` lies in the guard page under one of the running slot's fiber stacks.
inline bool in_stack_guard(const void* p) {
    if (!t_slot) return false;
    const long page = sysconf(_SC_PAGESIZE);
    for (const Fiber& f : t_slot->fibers) {
        const char* g = (const char*)f.stack - page;
        if (f.stack && (const char*)p >= g && (const char*)p < (const char*)f.stack) return true;
    }
    return false;
}

inline void fiber_main() {
    (*g_launch->body)();
    t_fiber->state = State::Exited;
    // Returning resumes the slot's scheduler through `uc_link`.
}

// Switches from the running fiber to its slot's scheduler until the scheduler resumes it.
inline void park(State s) {
    Fiber* f = t_fiber;
    f->state = s;
    swapcontext(&f->ctx, &t_slot->home);
    t_fiber = f;
}

// The lanes of warp `w` that exist in a block of `threads` threads.
inline unsigned present_lanes(unsigned threads, unsigned w) {
    const unsigned n = threads - 32 * w;
    return n >= 32 ? 0xffffffffu : (1u << n) - 1u;
}

inline unsigned lanes_in(const Slot& s, unsigned w, State st) {
    unsigned m = 0;
    for (unsigned l = 0; l < 32 && 32 * w + l < s.fibers.size(); ++l)
        if (s.fibers[32 * w + l].state == st) m |= 1u << l;
    return m;
}

// Completes a warp collective whose every lane has arrived: each lane's result.
inline void complete(Slot& s, unsigned w, unsigned mask) {
    Fiber* lanes = &s.fibers[32 * w];
    const unsigned first = (unsigned)__builtin_ctz(mask);
    for (unsigned l = 0; l < 32; ++l) {
        if ((mask >> l & 1) && lanes[l].op != lanes[first].op)
            fault(kWarpSync, g_launch->kernel + std::string(" block ") + dim_str(s.idx) + ": lanes of one collective with mask " +
                                 hex(mask) + " call different intrinsics: lane " + std::to_string(first) + " " +
                                 lanes[first].what + ", lane " + std::to_string(l) + " " + lanes[l].what);
    }
    for (unsigned l = 0; l < 32; ++l) {
        if (!(mask >> l & 1)) continue;
        Fiber& f = lanes[l];
        const unsigned seg = l / (unsigned)f.width * (unsigned)f.width, end = seg + (unsigned)f.width;
        unsigned src = l;
        switch (f.op) {
            case Op::ShflIdx: src = seg + (unsigned)f.arg % (unsigned)f.width; break;
            case Op::ShflUp: src = l >= seg + (unsigned)f.arg ? l - (unsigned)f.arg : l; break;
            case Op::ShflDown: src = l + (unsigned)f.arg < end ? l + (unsigned)f.arg : l; break;
            case Op::ShflXor: src = (l ^ (unsigned)f.arg) < end ? l ^ (unsigned)f.arg : l; break;
            default: break;
        }
        if (!(mask >> src & 1))
            fault(kWarpSync, g_launch->kernel + std::string(" block ") + dim_str(s.idx) + " thread " + dim_str(f.idx) +
                                 ": " + f.what + " with mask " + hex(mask) + " reads lane " + std::to_string(src) +
                                 ", which is not in the mask");
        unsigned votes = 0;
        for (unsigned k = 0; k < 32; ++k)
            if ((mask >> k & 1) && lanes[k].val) votes |= 1u << k;
        switch (f.op) {
            case Op::Sync: f.res = 0; break;
            case Op::Ballot: f.res = votes; break;
            case Op::Any: f.res = votes != 0; break;
            case Op::All: f.res = votes == mask; break;
            default: f.res = lanes[src].val; break;
        }
    }
    for (unsigned l = 0; l < 32; ++l)
        if (mask >> l & 1) lanes[l].state = State::Ready;
}

// A warp collective called by the running fiber: checks its mask, waits for the mask's lanes,
// and returns this lane's result.
inline uint64_t collective(const char* what, Op op, unsigned mask, uint64_t val, int arg, int width) {
    Slot& s = *t_slot;
    Fiber& f = *t_fiber;
    const unsigned w = f.linear / 32, lane = f.linear % 32;
    const auto bad = [&](const std::string& why) {
        fault(kWarpSync, here() + ": " + what + " with mask " + hex(mask) + " " + why +
                             "; the mask must name exactly the lanes that are active and call it");
    };
    if (width <= 0 || width > 32 || (width & (width - 1)) != 0) bad("has width " + std::to_string(width));
    if (!(mask >> lane & 1)) bad("leaves out the calling lane " + std::to_string(lane));
    const unsigned present = present_lanes(g_launch->threads, w);
    if (mask & ~present) bad("names lanes " + hex(mask & ~present) + " that do not exist in the block");
    const unsigned exited = lanes_in(s, w, State::Exited);
    if (mask & exited) bad("names lanes " + hex(mask & exited) + " that have exited");
    f.mask = mask;
    f.op = op;
    f.arg = arg;
    f.width = width;
    f.val = val;
    f.what = what;
    unsigned arrived = 1u << lane;
    for (unsigned l = 0; l < 32 && 32 * w + l < s.fibers.size(); ++l)
        if (s.fibers[32 * w + l].state == State::Warp && s.fibers[32 * w + l].mask == mask) arrived |= 1u << l;
    if (arrived == mask) {
        complete(s, w, mask);
        return f.res;
    }
    park(State::Warp);
    return t_fiber->res;
}

// No fiber of the slot can run: either every live one waits at `__syncthreads` (the barrier
// opens), none is live (the block is done), or some wait in a warp collective whose lanes will
// never all come, which is reported.
inline bool stalled(Slot& s) {
    bool live = false, warp = false;
    for (const Fiber& f : s.fibers) {
        live |= f.state != State::Exited;
        warp |= f.state == State::Warp;
    }
    if (!live) return false;
    if (!warp) {
        for (Fiber& f : s.fibers)
            if (f.state == State::Barrier) f.state = State::Ready;
        return true;
    }
    for (const Fiber& f : s.fibers) {
        if (f.state != State::Warp) continue;
        const unsigned w = f.linear / 32;
        const unsigned missing = f.mask & ~lanes_in(s, w, State::Warp);
        const unsigned exited = missing & lanes_in(s, w, State::Exited);
        const unsigned barrier = missing & lanes_in(s, w, State::Barrier);
        const unsigned other = missing & ~exited & ~barrier;
        std::string why = "waits for lanes " + hex(missing) + " that never come";
        if (exited) why += ": " + hex(exited) + " have exited";
        if (barrier) why += std::string(exited ? "," : ":") + " " + hex(barrier) + " wait at __syncthreads";
        if (other) {
            const Fiber& g = s.fibers[32 * w + (unsigned)__builtin_ctz(other)];
            why += std::string(exited || barrier ? "," : ":") + " " + hex(other) + " wait in collectives of other masks (lane " +
                   std::to_string(g.linear % 32) + " in " + g.what + " with mask " + hex(g.mask) + ")";
        }
        fault(kWarpSync, g_launch->kernel + std::string(" block ") + dim_str(s.idx) + " thread " + dim_str(f.idx) +
                             ": " + f.what + " with mask " + hex(f.mask) + " " + why +
                             "; the mask must name exactly the lanes that are active and call it");
    }
    return false;
}

// Runs the slot's block until every live thread waits at `__syncthreads` (true: the barrier is
// opened) or every thread has exited (false).
inline bool run_phase(Slot& s) {
    for (;;) {
        bool ran = false;
        for (unsigned i : s.order) {
            Fiber& f = s.fibers[i];
            if (f.state != State::Ready) continue;
            t_fiber = &f;
            swapcontext(&s.home, &f.ctx);
            t_fiber = nullptr;
            ran = true;
        }
        if (!ran) return stalled(s);
    }
}

inline void start_block(Slot& s, dim3 idx) {
    const dim3 b = g_launch->block;
    s.idx = idx;
    for (unsigned t = 0; t < s.fibers.size(); ++t) {
        Fiber& f = s.fibers[t];
        f.linear = t;
        f.idx = dim3{t % b.x, (t / b.x) % b.y, t / (b.x * b.y)};
        f.state = State::Ready;
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack;
        f.ctx.uc_stack.ss_size = kStackBytes;
        f.ctx.uc_link = &s.home;
        makecontext(&f.ctx, fiber_main, 0);
    }
}

// Passes the turn to the next active slot after `id` and waits for it to come back (or, with
// `retire`, leaves the rotation).
inline void pass_turn(unsigned id, bool retire) {
    Launch& L = *g_launch;
    std::unique_lock<std::mutex> g(L.m);
    if (retire) L.active[id] = false;
    const unsigned n = (unsigned)L.active.size();
    for (unsigned k = 1; k <= n; ++k) {
        const unsigned j = (id + k) % n;
        if (L.active[j]) {
            L.turn = j;
            break;
        }
    }
    L.cv.notify_all();
    if (!retire) L.cv.wait(g, [&] { return L.turn == id; });
}

inline void slot_main(unsigned id) {
    Launch& L = *g_launch;
    const long page = sysconf(_SC_PAGESIZE);
    // The SIGSEGV handler runs on its own stack: a fault may be a fiber's stack overflow.
    std::vector<char> alt(64 * 1024);
    stack_t ss{};
    ss.ss_sp = alt.data();
    ss.ss_size = alt.size();
    sigaltstack(&ss, nullptr);
    Slot s;
    s.id = id;
    s.fibers.resize(L.threads);
    for (Fiber& f : s.fibers) {
        // A fiber's stack, with a guard page under it.
        char* m = (char*)mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) fault(kLaunch, "cannot map a fiber stack");
        mprotect(m, page, PROT_NONE);
        f.stack = m + page;
    }
    for (unsigned t = 0; t < L.threads; ++t) s.order.push_back(L.schedule->reverse_threads ? L.threads - 1 - t : t);
    t_slot = &s;
    {
        std::unique_lock<std::mutex> g(L.m);
        L.cv.wait(g, [&] { return L.turn == id; });
    }
    bool busy = false;
    for (;;) {
        if (!busy) {
            if (L.next_block == L.schedule->blocks.size()) break;
            start_block(s, L.schedule->blocks[L.next_block++]);
            busy = true;
        }
        busy = run_phase(s);
        if (L.schedule->live > 1) pass_turn(id, false);
    }
    t_slot = nullptr;
    for (Fiber& f : s.fibers) munmap((char*)f.stack - page, kStackBytes + page);
    ss.ss_flags = SS_DISABLE;
    sigaltstack(&ss, nullptr);
    pass_turn(id, true);
}

// Runs `body` for every thread of every block of `schedule.blocks`, with `block` threads each.
inline void launch(const char* kernel, dim3 grid, dim3 block, const Schedule& schedule, const std::function<void()>& body) {
    Launch L;
    L.kernel = kernel;
    L.grid = grid;
    L.block = block;
    L.threads = block.x * block.y * block.z;
    L.body = &body;
    L.schedule = &schedule;
    const unsigned live = schedule.live < 1 ? 1 : schedule.live;
    L.active.assign(live, true);
    g_launch = &L;
    std::vector<std::thread> slots;
    for (unsigned i = 0; i < live; ++i) slots.emplace_back(slot_main, i);
    for (auto& t : slots) t.join();
    g_launch = nullptr;
}

template <typename T>
uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "a warp collective moves at most 8 bytes");
    uint64_t b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <typename T>
T from_bits(uint64_t b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}

}  // namespace ml_emu

#define threadIdx (ml_emu::t_fiber->idx)
#define blockIdx (ml_emu::t_slot->idx)
#define blockDim (ml_emu::g_launch->block)
#define gridDim (ml_emu::g_launch->grid)
#define warpSize 32

inline void __syncthreads() { ml_emu::park(ml_emu::State::Barrier); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    ml_emu::collective("__syncwarp", ml_emu::Op::Sync, mask, 0, 0, 32);
}
template <typename T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    return ml_emu::from_bits<T>(ml_emu::collective("__shfl_sync", ml_emu::Op::ShflIdx, mask, ml_emu::to_bits(v), src, width));
}
template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return ml_emu::from_bits<T>(
        ml_emu::collective("__shfl_up_sync", ml_emu::Op::ShflUp, mask, ml_emu::to_bits(v), (int)delta, width));
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return ml_emu::from_bits<T>(
        ml_emu::collective("__shfl_down_sync", ml_emu::Op::ShflDown, mask, ml_emu::to_bits(v), (int)delta, width));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    return ml_emu::from_bits<T>(
        ml_emu::collective("__shfl_xor_sync", ml_emu::Op::ShflXor, mask, ml_emu::to_bits(v), lane_mask, width));
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
    return (unsigned)ml_emu::collective("__ballot_sync", ml_emu::Op::Ballot, mask, pred != 0, 0, 32);
}
inline int __any_sync(unsigned mask, int pred) {
    return (int)ml_emu::collective("__any_sync", ml_emu::Op::Any, mask, pred != 0, 0, 32);
}
inline int __all_sync(unsigned mask, int pred) {
    return (int)ml_emu::collective("__all_sync", ml_emu::Op::All, mask, pred != 0, 0, 32);
}
template <typename T>
T __ldg(const T* p) {
    return *p;
}

// The device's 16-bit types, as their bits, with round-to-nearest-even conversions (what
// __float2bfloat16_rn / __float2half_rn do on the device, and what candle's `half` crate does).
struct __nv_bfloat16 {
    uint16_t bits;
};
struct __half {
    uint16_t bits;
};

inline float __bfloat162float(__nv_bfloat16 v) {
    const uint32_t u = (uint32_t)v.bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{(uint16_t)((u >> 16) | 0x40u)};
    u += 0x7fffu + ((u >> 16) & 1u);
    return __nv_bfloat16{(uint16_t)(u >> 16)};
}

inline float __half2float(__half v) {
    _Float16 h;
    std::memcpy(&h, &v.bits, 2);
    return (float)h;
}

inline __half __float2half_rn(float f) {
    const _Float16 h = (_Float16)f;
    __half out;
    std::memcpy(&out.bits, &h, 2);
    return out;
}
