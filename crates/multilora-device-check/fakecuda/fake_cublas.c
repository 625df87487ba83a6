/* A counting fake of libcublas.so.13 beside fake_cuda.c: handles and streams accepted, GEMMs
 * counted (never computed); FAKE_CUDA_LOG gets a "gemm" line for each. */
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
typedef int cublasStatus_t; /* SUCCESS 0 */
static int g_log = -1;
static void log_gemm(void) {
    if (g_log < 0) {
        const char *l = getenv("FAKE_CUDA_LOG");
        if (!l) return;
        g_log = open(l, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
        if (g_log < 0) return;
    }
    if (write(g_log, "gemm\n", 5) < 0) { /* a lost line shows as a wrong count */ }
}
static atomic_ullong n_gemm_ex, n_dgemm, n_sgemm, n_create, n_flops;
cublasStatus_t cublasCreate_v2(void **h) { *h = calloc(1, 64); n_create++; return 0; }
cublasStatus_t cublasDestroy_v2(void *h) { free(h); return 0; }
cublasStatus_t cublasSetStream_v2(void *h, void *s) { (void)h; (void)s; return 0; }
cublasStatus_t cublasGetStream_v2(void *h, void **s) { (void)h; *s = 0; return 0; }
cublasStatus_t cublasSetMathMode(void *h, int m) { (void)h; (void)m; return 0; }
cublasStatus_t cublasSetWorkspace_v2(void *h, void *w, size_t n) { (void)h; (void)w; (void)n; return 0; }
cublasStatus_t cublasSetPointerMode_v2(void *h, int m) { (void)h; (void)m; return 0; }
cublasStatus_t cublasGemmStridedBatchedEx(void *h, int ta, int tb, int m, int n, int k, const void *alpha,
    const void *A, int At, int lda, long long sA, const void *B, int Bt, int ldb, long long sB, const void *beta,
    void *C, int Ct, int ldc, long long sC, int batch, int compute, int algo) {
    (void)h;(void)ta;(void)tb;(void)alpha;(void)A;(void)At;(void)lda;(void)sA;(void)B;(void)Bt;(void)ldb;(void)sB;
    (void)beta;(void)C;(void)Ct;(void)ldc;(void)sC;(void)compute;(void)algo;
    log_gemm(); n_gemm_ex++; n_flops += 2ULL * m * n * k * batch; return 0;
}
cublasStatus_t cublasDgemmStridedBatched(void *h, int ta, int tb, int m, int n, int k, const double *alpha,
    const double *A, int lda, long long sA, const double *B, int ldb, long long sB, const double *beta,
    double *C, int ldc, long long sC, int batch) {
    (void)h;(void)ta;(void)tb;(void)alpha;(void)A;(void)lda;(void)sA;(void)B;(void)ldb;(void)sB;(void)beta;(void)C;(void)ldc;(void)sC;
    log_gemm(); n_dgemm++; n_flops += 2ULL * m * n * k * batch; return 0;
}
cublasStatus_t cublasSgemmStridedBatched(void *h, int ta, int tb, int m, int n, int k, const float *alpha,
    const float *A, int lda, long long sA, const float *B, int ldb, long long sB, const float *beta,
    float *C, int ldc, long long sC, int batch) {
    (void)h;(void)ta;(void)tb;(void)alpha;(void)A;(void)lda;(void)sA;(void)B;(void)ldb;(void)sB;(void)beta;(void)C;(void)ldc;(void)sC;
    log_gemm(); n_sgemm++; n_flops += 2ULL * m * n * k * batch; return 0;
}
__attribute__((destructor)) static void report(void) {
    const char *p = getenv("FAKE_CUDA_REPORT"); if (!p) return;
    FILE *o = !strcmp(p, "-") ? stderr : fopen(p, "a"); if (!o) return;
    fprintf(o, "cublas handles %llu gemm_strided_batched_ex %llu dgemm_strided_batched %llu sgemm_strided_batched %llu flops %llu\n",
            (unsigned long long)n_create, (unsigned long long)n_gemm_ex, (unsigned long long)n_dgemm, (unsigned long long)n_sgemm, (unsigned long long)n_flops);
    if (o != stderr) fclose(o);
}
