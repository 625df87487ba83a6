/* A counting fake of libcuda.so.1 for the launch-count test (tests/launch_count.rs), on machines
 * without a GPU: host memory stands in for device memory (copies and memsets are done at once),
 * kernels are counted and never run. Every entry point cudarc 0.19.10's bindings name exists
 * (build.sh makes the ones not here fail with CUDA_ERROR_NOT_SUPPORTED): the binaries link the
 * driver with BIND_NOW, and `LD_LIBRARY_PATH` puts this one in front of .ci/cuda-env.sh's stubs.
 *
 * Stream capture makes a graph of the launches (only those: what else a capture meets is done at
 * once), which each graph launch counts again. As in the driver, a capture breaks (its end fails
 * with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, the call with ..._UNSUPPORTED) on a synchronisation,
 * a synchronous allocation, or a copy to or from host memory that cuMemHostAlloc did not give.
 *
 * FAKE_CUDA_LOG=FILE appends one line per event to FILE as it happens ("launch NAME", "memset",
 * "htod BYTES", "dtoh BYTES", "dtod", "sync"; cuBLAS adds "gemm"), so a test can write its own
 * marks between steps into the same file. FAKE_CUDA_MEM_GIB sets the memory reported (80).
 * Nothing computed here is a result: outputs are whatever the memory held. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult; /* CUDA_SUCCESS 0, INVALID_VALUE 1, OUT_OF_MEMORY 2, NOT_FOUND 500 */
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUstream, *CUevent, *CUmemoryPool;

#define HDR 256 /* header before each block: keeps 256-byte alignment, stores the size */
static atomic_ullong g_used, g_peak, n_alloc, n_free, n_htod, n_dtoh, n_dtod, n_memset, n_launch,
    n_modload, n_getfn, n_evcreate, n_evrecord, n_wait, n_sync, b_htod, b_dtoh;
static unsigned long long g_total = 80ULL << 30;
static int g_ctx_obj, g_pool_obj;
static __thread CUcontext t_current;
static int g_fill = -1;

struct fn { struct fn *next; void *mod; char *name; atomic_ullong launches; };
struct mod { int magic; };
struct ev { double t_ms; };
static struct fn *g_fns; static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

static int g_log = -1;
/* One line of the event log, written whole (O_APPEND: the test's marks interleave in order). */
static void logf_line(const char *fmt, ...) {
    if (g_log < 0) return;
    char line[256]; va_list ap; va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, ap); va_end(ap);
    if (n < 0) return;
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    line[n++] = '\n';
    if (write(g_log, line, (size_t)n) < 0) { /* a lost line shows as a wrong count */ }
}

/* Stream capture: the captured stream, its graph so far, whether something broke it. */
struct graph { struct fn **fns; size_t n, cap; };
static CUstream g_cap_stream; static struct graph *g_cap; static int g_cap_broken;
#define CAPTURE_UNSUPPORTED 900
#define CAPTURE_INVALIDATED 901
/* Whether an operation on `s` (or on every stream: `any`) meets a capture it must break. */
static int breaks_capture(CUstream s, int any) {
    if (!g_cap || !(any || s == g_cap_stream)) return 0;
    g_cap_broken = 1; return 1;
}
/* Page-locked host blocks (cuMemHostAlloc's), the only host memory a captured copy may use. */
struct pinned { struct pinned *next; char *p; size_t n; };
static struct pinned *g_pinned;
static int is_pinned(const void *p, size_t n) {
    int found = 0;
    pthread_mutex_lock(&g_lock);
    for (struct pinned *x = g_pinned; x && !found; x = x->next)
        found = (const char *)p >= x->p && (const char *)p + n <= x->p + x->n;
    pthread_mutex_unlock(&g_lock);
    return found;
}

static double now_ms(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e3 + t.tv_nsec / 1e6; }

CUresult cuInit(unsigned flags) {
    (void)flags;
    const char *m = getenv("FAKE_CUDA_MEM_GIB"); if (m) g_total = strtoull(m, 0, 10) << 30;
    const char *f = getenv("FAKE_CUDA_FILL"); if (f) g_fill = atoi(f) & 255;
    const char *l = getenv("FAKE_CUDA_LOG");
    if (l && g_log < 0) g_log = open(l, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    return 0;
}
CUresult cuDriverGetVersion(int *v) { *v = 13000; return 0; }
CUresult cuDeviceGetCount(int *c) { *c = 1; return 0; }
CUresult cuDeviceGet(CUdevice *d, int ord) { if (ord != 0) return 101; /* INVALID_DEVICE */ *d = 0; return 0; }
CUresult cuDeviceGetName(char *name, int len, CUdevice d) { (void)d; snprintf(name, len, "NVIDIA H100 80GB HBM3"); return 0; }
CUresult cuDeviceTotalMem_v2(size_t *b, CUdevice d) { (void)d; *b = g_total; return 0; }
CUresult cuDeviceGetAttribute(int *pi, int a, CUdevice d) {
    (void)d; int v;
    switch (a) {
    case 1: v = 1024; break; case 2: v = 1024; break; case 3: v = 1024; break; case 4: v = 64; break;
    case 5: v = 2147483647; break; case 6: v = 65535; break; case 7: v = 65535; break;
    case 8: v = 49152; break; case 9: v = 65536; break; case 10: v = 32; break; case 12: v = 65536; break;
    case 13: v = 1980000; break; case 16: v = 132; break; case 19: v = 1; break; case 31: v = 1; break;
    case 36: v = 2619000; break; case 37: v = 5120; break; case 38: v = 52428800; break;
    case 39: v = 2048; break; case 40: v = 5; break; case 41: v = 1; break;
    case 75: v = 9; break; case 76: v = 0; break;
    case 81: v = 233472; break; case 82: v = 65536; break; case 83: v = 1; break; case 89: v = 1; break;
    case 95: v = 1; break; case 97: v = 232448; break; case 106: v = 32; break; case 115: v = 1; break;
    default: v = 0;
    }
    *pi = v; return 0;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { (void)d; *c = &g_ctx_obj; return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { (void)d; return 0; }
CUresult cuCtxGetCurrent(CUcontext *c) { *c = t_current; return 0; }
CUresult cuCtxSetCurrent(CUcontext c) { t_current = c; return 0; }
CUresult cuCtxSynchronize(void) { if (breaks_capture(0, 1)) return CAPTURE_UNSUPPORTED; n_sync++; logf_line("sync"); return 0; }
CUresult cuCtxDestroy_v2(CUcontext c) { (void)c; return 0; }

CUresult cuStreamCreate(CUstream *s, unsigned flags) { (void)flags; *s = malloc(16); return 0; }
CUresult cuStreamDestroy_v2(CUstream s) { free(s); return 0; }   /* never called for NULL / 0x2 */
CUresult cuStreamSynchronize(CUstream s) { if (breaks_capture(s, 0)) return CAPTURE_UNSUPPORTED; n_sync++; logf_line("sync"); return 0; }
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned f) { (void)s; (void)e; (void)f; n_wait++; return 0; }
CUresult cuStreamIsCapturing(CUstream s, int *status) {
    *status = g_cap && s == g_cap_stream ? (g_cap_broken ? 2 /* INVALIDATED */ : 1 /* ACTIVE */) : 0; return 0;
}
CUresult cuStreamBeginCapture_v2(CUstream s, int mode) {
    (void)mode;
    if (g_cap) return CAPTURE_UNSUPPORTED; /* one capture at a time here */
    g_cap = calloc(1, sizeof *g_cap); g_cap_stream = s; g_cap_broken = 0; return 0;
}
CUresult cuStreamEndCapture(CUstream s, void **graph) {
    if (!g_cap || s != g_cap_stream) return 1; /* INVALID_VALUE: not capturing */
    struct graph *g = g_cap; g_cap = NULL;
    if (g_cap_broken) { free(g->fns); free(g); *graph = NULL; return CAPTURE_INVALIDATED; }
    *graph = g; return 0;
}
CUresult cuGraphInstantiateWithFlags(void **exec, void *graph, unsigned long long flags) {
    (void)flags; struct graph *g = graph, *e = calloc(1, sizeof *e);
    e->n = e->cap = g->n; e->fns = malloc((g->n ? g->n : 1) * sizeof *e->fns);
    memcpy(e->fns, g->fns, g->n * sizeof *e->fns); *exec = e; return 0;
}
CUresult cuGraphUpload(void *exec, CUstream s) { (void)exec; (void)s; return 0; }
CUresult cuGraphLaunch(void *exec, CUstream s) {
    (void)s; struct graph *e = exec;
    for (size_t i = 0; i < e->n; i++) { e->fns[i]->launches++; n_launch++; logf_line("launch %s", e->fns[i]->name); }
    return 0;
}
static void graph_free(void *g) { if (g) { free(((struct graph *)g)->fns); free(g); } }
CUresult cuGraphExecDestroy(void *exec) { graph_free(exec); return 0; }
CUresult cuGraphDestroy(void *graph) { graph_free(graph); return 0; }

CUresult cuEventCreate(CUevent *e, unsigned flags) { (void)flags; *e = calloc(1, sizeof(struct ev)); n_evcreate++; return 0; }
CUresult cuEventRecord(CUevent e, CUstream s) { (void)s; ((struct ev *)e)->t_ms = now_ms(); n_evrecord++; return 0; }
CUresult cuEventSynchronize(CUevent e) { (void)e; return 0; }
CUresult cuEventQuery(CUevent e) { (void)e; return 0; }
CUresult cuEventDestroy_v2(CUevent e) { free(e); return 0; }
CUresult cuEventElapsedTime_v2(float *ms, CUevent a, CUevent b) { *ms = (float)(((struct ev *)b)->t_ms - ((struct ev *)a)->t_ms); return 0; }

/* Blocks of 1 MiB or more are mmap'ed (page-aligned, zero, committed only when touched: a
 * KV cache sized from cuMemGetInfo costs nothing until written); smaller ones posix_memalign'ed
 * to 256 like the driver's. A header before each block keeps its size. FAKE_CUDA_FILL=<byte>
 * fills new blocks (e.g. 255: NaN patterns) instead of leaving them zero. */
static CUresult fake_alloc(CUdeviceptr *p, size_t n) {
    if (g_used + n > g_total) return 2; /* OUT_OF_MEMORY */
    char *b; size_t hdr;
    if (n >= (1u << 20)) {
        hdr = 4096; b = mmap(NULL, hdr + n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (b == MAP_FAILED) return 2;
    } else {
        hdr = HDR; b = NULL;
        if (posix_memalign((void **)&b, HDR, HDR + (n ? n : 1))) return 2;
        memset(b + HDR, 0, n); /* deterministic reads of never-written "device" memory */
    }
    if (g_fill >= 0) memset(b + hdr, g_fill, n);
    ((size_t *)(b + hdr))[-1] = n; ((size_t *)(b + hdr))[-2] = hdr;
    g_used += n; if (g_used > g_peak) g_peak = g_used; n_alloc++;
    *p = (CUdeviceptr)(uintptr_t)(b + hdr); return 0;
}
static CUresult fake_free(CUdeviceptr p) {
    if (!p) return 0;
    size_t *h = (size_t *)(uintptr_t)p; size_t n = h[-1], hdr = h[-2]; char *b = (char *)h - hdr;
    g_used -= n; n_free++;
    if (hdr == 4096) munmap(b, hdr + n); else free(b);
    return 0;
}
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s) { (void)s; return fake_alloc(p, n); }
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { if (breaks_capture(0, 1)) return CAPTURE_UNSUPPORTED; return fake_alloc(p, n); }
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { (void)s; return fake_free(p); }
CUresult cuMemFree_v2(CUdeviceptr p) { return fake_free(p); }
CUresult cuMemGetInfo_v2(size_t *free_, size_t *total) { *free_ = g_total - g_used; *total = g_total; return 0; }
CUresult cuMemHostAlloc(void **pp, size_t n, unsigned flags) {
    (void)flags; if (posix_memalign(pp, 4096, n ? n : 1)) return 2;
    struct pinned *x = malloc(sizeof *x); x->p = *pp; x->n = n;
    pthread_mutex_lock(&g_lock); x->next = g_pinned; g_pinned = x; pthread_mutex_unlock(&g_lock);
    return 0;
}
CUresult cuMemFreeHost(void *p) {
    pthread_mutex_lock(&g_lock);
    for (struct pinned **x = &g_pinned; *x; x = &(*x)->next)
        if ((*x)->p == p) { struct pinned *d = *x; *x = d->next; free(d); break; }
    pthread_mutex_unlock(&g_lock);
    free(p); return 0;
}
CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice d) { (void)d; *pool = &g_pool_obj; return 0; }
CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice d) { (void)d; *pool = &g_pool_obj; return 0; }
CUresult cuMemPoolSetAttribute(CUmemoryPool p, int attr, void *v) { (void)p; (void)attr; (void)v; return 0; }
CUresult cuMemPoolTrimTo(CUmemoryPool p, size_t n) { (void)p; (void)n; return 0; }

static void do_memset(CUdeviceptr d, unsigned char c, size_t n) { memset((void *)(uintptr_t)d, c, n); n_memset++; logf_line("memset"); }
static void do_htod(CUdeviceptr d, const void *s, size_t n) { memcpy((void *)(uintptr_t)d, s, n); n_htod++; b_htod += n; logf_line("htod %zu", n); }
static void do_dtoh(void *d, CUdeviceptr s, size_t n) { memcpy(d, (void *)(uintptr_t)s, n); n_dtoh++; b_dtoh += n; logf_line("dtoh %zu", n); }
static void do_dtod(CUdeviceptr d, CUdeviceptr s, size_t n) { memmove((void *)(uintptr_t)d, (void *)(uintptr_t)s, n); n_dtod++; logf_line("dtod"); }
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char c, size_t n, CUstream s) { (void)s; do_memset(d, c, n); return 0; }
CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char c, size_t n) { do_memset(d, c, n); return 0; }
CUresult cuMemsetD32Async(CUdeviceptr d, unsigned v, size_t n, CUstream s) {
    (void)s; unsigned *p = (unsigned *)(uintptr_t)d; for (size_t i = 0; i < n; i++) p[i] = v;
    n_memset++; logf_line("memset"); return 0;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, CUstream st) {
    if (!is_pinned(s, n) && breaks_capture(st, 0)) return CAPTURE_UNSUPPORTED;
    do_htod(d, s, n); return 0;
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *s, size_t n) { if (breaks_capture(0, 1)) return CAPTURE_UNSUPPORTED; do_htod(d, s, n); return 0; }
CUresult cuMemcpyDtoHAsync_v2(void *d, CUdeviceptr s, size_t n, CUstream st) {
    if (!is_pinned(d, n) && breaks_capture(st, 0)) return CAPTURE_UNSUPPORTED;
    do_dtoh(d, s, n); return 0;
}
CUresult cuMemcpyDtoH_v2(void *d, CUdeviceptr s, size_t n) { if (breaks_capture(0, 1)) return CAPTURE_UNSUPPORTED; do_dtoh(d, s, n); return 0; }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) { (void)st; do_dtod(d, s, n); return 0; }
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { do_dtod(d, s, n); return 0; }
CUresult cuMemcpyPeerAsync(CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream st) { (void)dc; (void)sc; (void)st; do_dtod(d, s, n); return 0; }

CUresult cuModuleLoadData(void **m, const void *image) { (void)image; *m = calloc(1, sizeof(struct mod)); n_modload++; return 0; }
CUresult cuModuleLoad(void **m, const char *f) { (void)f; *m = calloc(1, sizeof(struct mod)); n_modload++; return 0; }
CUresult cuModuleUnload(void *m) { free(m); return 0; } /* interned fns of m stay (harmless) */
CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
    n_getfn++;
    pthread_mutex_lock(&g_lock);
    struct fn *x = g_fns;
    for (; x; x = x->next) if (x->mod == m && !strcmp(x->name, name)) break;
    if (!x) { x = calloc(1, sizeof *x); x->mod = m; x->name = strdup(name); x->next = g_fns; g_fns = x; }
    pthread_mutex_unlock(&g_lock);
    *f = x; return 0;
}
CUresult cuFuncGetAttribute(int *pi, int a, void *f) { (void)f; *pi = a == 0 ? 1024 : 0; /* MAX_THREADS_PER_BLOCK */ return 0; }
CUresult cuFuncSetAttribute(void *f, int a, int v) { (void)f; (void)a; (void)v; return 0; }
CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *nb, void *f, int bs, size_t sm, unsigned fl) { (void)f; (void)sm; (void)fl; *nb = bs > 0 ? 2048 / bs : 1; return 0; }
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned smem, CUstream s, void **params, void **extra) {
    (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)smem; (void)s; (void)params; (void)extra;
    if (!f) return 400; /* INVALID_HANDLE */
    if (g_cap && s == g_cap_stream) { /* captured: counted when the graph is launched */
        struct graph *g = g_cap;
        if (g->n == g->cap) { g->cap = g->cap ? 2 * g->cap : 16; g->fns = realloc(g->fns, g->cap * sizeof *g->fns); }
        g->fns[g->n++] = f; return 0;
    }
    ((struct fn *)f)->launches++; n_launch++; logf_line("launch %s", ((struct fn *)f)->name); return 0;
}

CUresult cuGetErrorString(int e, const char **s) { (void)e; *s = "fake CUDA driver error"; return 0; }
CUresult cuGetErrorName(int e, const char **s) { (void)e; *s = "CUDA_ERROR_FAKE"; return 0; }

/* FAKE_CUDA_REPORT=FILE (or -): the totals and each kernel's launches, appended at exit. */
__attribute__((destructor)) static void report(void) {
    const char *p = getenv("FAKE_CUDA_REPORT"); if (!p) return;
    FILE *o = !strcmp(p, "-") ? stderr : fopen(p, "a"); if (!o) return;
    fprintf(o, "launches %llu allocs %llu frees %llu peak_bytes %llu htod %llu (%llu B) dtoh %llu (%llu B) dtod %llu memset %llu "
               "modules %llu getfunction %llu events %llu records %llu waits %llu syncs %llu\n",
            (unsigned long long)n_launch, (unsigned long long)n_alloc, (unsigned long long)n_free, (unsigned long long)g_peak,
            (unsigned long long)n_htod, (unsigned long long)b_htod, (unsigned long long)n_dtoh, (unsigned long long)b_dtoh,
            (unsigned long long)n_dtod, (unsigned long long)n_memset, (unsigned long long)n_modload, (unsigned long long)n_getfn,
            (unsigned long long)n_evcreate, (unsigned long long)n_evrecord, (unsigned long long)n_wait, (unsigned long long)n_sync);
    for (struct fn *x = g_fns; x; x = x->next) if (x->launches) fprintf(o, "kernel %s %llu\n", x->name, (unsigned long long)x->launches);
    if (o != stderr) fclose(o);
}
