// Kernels with planted faults, for the emulator's own tests only: included by a second harness
// built with MULTILORA_EMULATE_FAULTS (`Emulator::with_planted_faults`), not by the one the
// kernels' tests use, and never by nvcc (a `.cuh`, which the CUDA build skips). Each is a few
// lines that get one thing wrong, and `ml_fault_ok` gets nothing wrong while using what the
// others misuse (shared memory, barriers, full and partial warp masks), so a check that fires on
// correct code shows too.
//
// All take `MlFaultParams`: `in` holds `n` floats, `out` as many as the test gives it.
#include "../multilora.cuh"

typedef struct {
    uint64_t in;
    uint64_t out;
    uint32_t n;
    uint32_t pad;
} MlFaultParams;

// Block b reads what block b - 1 writes: a race between blocks.
extern "C" __global__ void ml_fault_race(const MlFaultParams p) {
    float* out = reinterpret_cast<float*>(p.out);
    if (threadIdx.x == 0) out[blockIdx.x + 1] = out[blockIdx.x] + 1.f;
}

// Every block stages its id in out[0], reads it back after a barrier, and clears it: blocks run
// one after another in any order agree, so only blocks interleaved at the barrier show the race.
extern "C" __global__ void ml_fault_race_across_barrier(const MlFaultParams p) {
    float* out = reinterpret_cast<float*>(p.out);
    if (threadIdx.x == 0) out[0] = (float)blockIdx.x;
    __syncthreads();
    if (threadIdx.x == 0) {
        out[1 + blockIdx.x] = out[0];
        out[0] = 0.f;
    }
}

// Thread t writes its own shared slot and, with no barrier, reads its neighbour's.
extern "C" __global__ void ml_fault_thread_race(const MlFaultParams p) {
    __shared__ float s[64];
    s[threadIdx.x] = reinterpret_cast<const float*>(p.in)[threadIdx.x];
    reinterpret_cast<float*>(p.out)[threadIdx.x] = s[threadIdx.x ^ 1];
}

// out[i] = in[i + 1]: the last thread reads one float past the end of `in`.
extern "C" __global__ void ml_fault_read_past_end(const MlFaultParams p) {
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < p.n) reinterpret_cast<float*>(p.out)[i] = reinterpret_cast<const float*>(p.in)[i + 1];
}

// out[i] = in[i - 1]: thread 0 reads the float before the start of `in`.
extern "C" __global__ void ml_fault_read_before_start(const MlFaultParams p) {
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < p.n) reinterpret_cast<float*>(p.out)[i] = reinterpret_cast<const float*>(p.in)[(int)i - 1];
}

// out[i + 1] = in[i] with `out` as long as `in`: the last thread writes past the end of `out`.
extern "C" __global__ void ml_fault_write_past_end(const MlFaultParams p) {
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < p.n) reinterpret_cast<float*>(p.out)[i + 1] = reinterpret_cast<const float*>(p.in)[i];
}

// The upper half of the warp returns, the lower half sums with the full mask.
extern "C" __global__ void ml_fault_mask_exited(const MlFaultParams p) {
    if (threadIdx.x >= 16) return;
    const float v = ml::warp_sum(reinterpret_cast<const float*>(p.in)[threadIdx.x]);
    if (threadIdx.x == 0) reinterpret_cast<float*>(p.out)[0] = v;
}

// The whole warp calls a shuffle whose mask names only the lower half.
extern "C" __global__ void ml_fault_mask_partial(const MlFaultParams p) {
    const float v = __shfl_xor_sync(0x0000ffffu, reinterpret_cast<const float*>(p.in)[threadIdx.x], 1);
    reinterpret_cast<float*>(p.out)[threadIdx.x] = v;
}

// A correct block sum: each warp sums its lanes (the halves of a warp first on their own, with
// their own masks, as divergent code may; lane 0 then holds the lower half's sum and lane 16 the
// upper's), the warps' sums meet in shared memory after a barrier.
extern "C" __global__ void ml_fault_ok(const MlFaultParams p) {
    __shared__ float part[32];
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float v = i < p.n ? reinterpret_cast<const float*>(p.in)[i] : 0.f;
    const unsigned half = lane < 16 ? 0x0000ffffu : 0xffff0000u;
    if (lane < 16) {
        for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(half, v, o);
    } else {
        // A tree sum into lane 16, through another call site and another intrinsic.
        for (int o = 8; o > 0; o >>= 1) v += __shfl_down_sync(half, v, o, 16);
    }
    v += __shfl_xor_sync(0xffffffffu, v, 16);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.f;
        for (uint32_t w = 0; w < blockDim.x / 32; ++w) s += part[w];
        reinterpret_cast<float*>(p.out)[blockIdx.x] = s;
    }
}

#define ML_FAULT_KERNELS(X)                                                                        \
    X(ml_fault_race)                                                                               \
    X(ml_fault_race_across_barrier)                                                                \
    X(ml_fault_thread_race)                                                                        \
    X(ml_fault_read_past_end)                                                                      \
    X(ml_fault_read_before_start)                                                                  \
    X(ml_fault_write_past_end)                                                                     \
    X(ml_fault_mask_exited)                                                                        \
    X(ml_fault_mask_partial)                                                                       \
    X(ml_fault_ok)
