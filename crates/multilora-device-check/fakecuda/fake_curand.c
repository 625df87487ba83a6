/* A fake of libcurand.so.10 beside fake_cuda.c: generators accepted, nothing generated (the
 * memory stays as allocated: zero, and untouched, so that an 8B model's random weights cost no
 * resident memory). */
#include <stdlib.h>
#include <string.h>
typedef int curandStatus_t;
curandStatus_t curandCreateGenerator(void **g, int kind) { (void)kind; *g = calloc(1, 64); return 0; }
curandStatus_t curandDestroyGenerator(void *g) { free(g); return 0; }
curandStatus_t curandSetStream(void *g, void *s) { (void)g; (void)s; return 0; }
curandStatus_t curandSetPseudoRandomGeneratorSeed(void *g, unsigned long long s) { (void)g; (void)s; return 0; }
curandStatus_t curandSetGeneratorOffset(void *g, unsigned long long o) { (void)g; (void)o; return 0; }
curandStatus_t curandGenerateUniform(void *g, float *p, size_t n) { (void)g; (void)p; (void)n; return 0; }
curandStatus_t curandGenerateUniformDouble(void *g, double *p, size_t n) { (void)g; (void)p; (void)n; return 0; }
curandStatus_t curandGenerateNormal(void *g, float *p, size_t n, float m, float s) { (void)g; (void)p; (void)n; (void)m; (void)s; return 0; }
curandStatus_t curandGenerateNormalDouble(void *g, double *p, size_t n, double m, double s) { (void)g; (void)p; (void)n; (void)m; (void)s; return 0; }
