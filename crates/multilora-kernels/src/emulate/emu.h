// Host emulation of the small part of CUDA the multilora kernels use, so that the same kernel
// source runs on a CPU in the tests (the kernels include it through `multilora.cuh` when built
// with MULTILORA_EMULATE by the host C++ compiler; nvcc never sees it).
//
// `ml_emu::launch` runs a grid one block at a time; a block's threads are real threads, so every
// `__syncthreads` is a barrier and every warp shuffle an exchange through a per-warp barrier, as
// on the device. A thread that returns early leaves the block's and its warp's barriers (the
// hardware's behaviour for exited threads). `__shared__` is a function-level static, which is one
// block's shared memory because blocks never run at the same time. Blocks of one launch are
// independent by CUDA's rules, so running them in order changes nothing a correct kernel can see.
#pragma once

#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __restrict__

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

namespace ml_emu {

// A barrier whose party count can shrink while threads wait (a thread that exits drops out).
class Barrier {
   public:
    void reset(int parties) {
        std::lock_guard<std::mutex> g(m_);
        parties_ = parties;
        arrived_ = 0;
    }
    void arrive_and_wait() {
        std::unique_lock<std::mutex> g(m_);
        const uint64_t gen = gen_;
        if (++arrived_ >= parties_) {
            release();
        } else {
            cv_.wait(g, [&] { return gen_ != gen; });
        }
    }
    void drop() {
        std::lock_guard<std::mutex> g(m_);
        --parties_;
        if (arrived_ > 0 && arrived_ >= parties_) release();
    }

   private:
    void release() {
        arrived_ = 0;
        ++gen_;
        cv_.notify_all();
    }
    std::mutex m_;
    std::condition_variable cv_;
    int parties_ = 0, arrived_ = 0;
    uint64_t gen_ = 0;
};

struct Warp {
    Barrier bar;
    float vals[32];
};

struct Block {
    dim3 grid, dim, idx;
    Barrier bar;
    std::vector<Warp> warps;
};

inline Block* g_block = nullptr;
inline thread_local dim3 t_idx;
inline thread_local unsigned t_linear = 0;

inline void sync_block() { g_block->bar.arrive_and_wait(); }

inline float shfl_xor(float v, int lane_mask) {
    Warp& w = g_block->warps[t_linear / 32];
    const unsigned lane = t_linear % 32;
    w.vals[lane] = v;
    w.bar.arrive_and_wait();
    const float r = w.vals[(lane ^ (unsigned)lane_mask) % 32];
    w.bar.arrive_and_wait();
    return r;
}

// Runs `body` for every thread of every block of the grid.
inline void launch(dim3 grid, dim3 block, const std::function<void()>& body) {
    const unsigned threads = block.x * block.y * block.z;
    const unsigned nwarps = (threads + 31) / 32;
    Block b;
    b.grid = grid;
    b.dim = block;
    b.warps = std::vector<Warp>(nwarps);
    g_block = &b;
    Barrier start, end;
    start.reset((int)threads + 1);
    end.reset((int)threads + 1);
    bool done = false;
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (unsigned t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
            t_linear = t;
            t_idx = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            for (;;) {
                start.arrive_and_wait();
                if (done) return;
                body();
                b.bar.drop();
                b.warps[t / 32].bar.drop();
                end.arrive_and_wait();
            }
        });
    }
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                b.idx = dim3{x, y, z};
                b.bar.reset((int)threads);
                for (unsigned w = 0; w < nwarps; ++w) {
                    const unsigned lanes = threads - 32 * w < 32 ? threads - 32 * w : 32;
                    b.warps[w].bar.reset((int)lanes);
                }
                start.arrive_and_wait();
                end.arrive_and_wait();
            }
    done = true;
    start.arrive_and_wait();
    for (auto& th : pool) th.join();
    g_block = nullptr;
}

}  // namespace ml_emu

#define threadIdx (ml_emu::t_idx)
#define blockIdx (ml_emu::g_block->idx)
#define blockDim (ml_emu::g_block->dim)
#define gridDim (ml_emu::g_block->grid)

inline void __syncthreads() { ml_emu::sync_block(); }
inline float __shfl_xor_sync(unsigned /*mask*/, float v, int lane_mask) { return ml_emu::shfl_xor(v, lane_mask); }

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
