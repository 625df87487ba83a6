// A kernel planted to spill, for scripts/ptxas-report.sh's own check: 96 values live across a loop,
// compiled by CI under a 32-register cap (`--nvcc-flag -maxrregcount=32`), where the report must
// fail. Not one of our kernels: nothing loads it.
extern "C" __global__ void planted_spill(const float* x, float* y, int n) {
    float acc[96];
#pragma unroll
    for (int i = 0; i < 96; ++i) acc[i] = x[i * n + threadIdx.x];
    for (int k = 0; k < n; ++k) {
#pragma unroll
        for (int i = 0; i < 96; ++i) acc[i] = acc[i] * x[k] + acc[(i + 1) % 96];
    }
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 96; ++i) s += acc[i];
    y[threadIdx.x] = s;
}
