"""What every C translation unit of the cpu target starts with: headers, Python-style
integer division and modulo, branch-free choices, per-thread scratch memory, the thread count."""

PARALLEL_MIN_POINTS = 1 << 15  # below this many points, starting threads costs more than the loop

PRELUDE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>
#include <math.h>
#if defined(NF_VECTOR_MATH) && defined(__GNUC__) && !defined(__clang__)
/* SIMD-callable, so that loops calling them vectorise: glibc's libmvec has their vector versions
   (linked with -lmvec; see compiler.vector_math) */
#define NF_SIMD_MATH __attribute__((__simd__("notinbranch")))
extern float expf(float) NF_SIMD_MATH; extern double exp(double) NF_SIMD_MATH;
extern float logf(float) NF_SIMD_MATH; extern double log(double) NF_SIMD_MATH;
extern float erff(float) NF_SIMD_MATH; extern double erf(double) NF_SIMD_MATH;
extern float tanhf(float) NF_SIMD_MATH; extern double tanh(double) NF_SIMD_MATH;
extern float powf(float, float) NF_SIMD_MATH; extern double pow(double, double) NF_SIMD_MATH;
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#define floord(n, d) (((n) < 0) ? -((-(n) + (d) - 1) / (d)) : (n) / (d))
#define min(x, y) ((x) < (y) ? (x) : (y))
#define max(x, y) ((x) > (y) ? (x) : (y))
static inline int64_t nf_fdiv(int64_t a, int64_t b) {
    if (b == 0) return 0;
    int64_t q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
static inline int64_t nf_mod(int64_t a, int64_t b) {
    if (b == 0) return 0;
    int64_t r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
static inline double nf_fmod(double a, double b) {
    double r = fmod(a, b);
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
static inline int64_t nf_ipow(int64_t a, int64_t b) {
    int64_t r = 1;
    if (b < 0) return 0;
    while (b) { if (b & 1) r *= a; a *= a; b >>= 1; }
    return r;
}
#if defined(__GNUC__) && !defined(__clang__)
#define NF_SCALAR __attribute__((optimize("no-tree-vectorize")))
#else
#define NF_SCALAR
#endif
/* A choice between two values already computed, without a branch: a data-dependent
   condition (a ReLU's mask) taken as a branch is mispredicted about every other point. */
#define NF_PICK(name, type, bits) \
    static inline type name(int c, type a, type b) { \
        bits ua, ub, mask = -(bits)(c != 0); \
        memcpy(&ua, &a, sizeof a); memcpy(&ub, &b, sizeof b); \
        ua = (ua & mask) | (ub & ~mask); \
        memcpy(&a, &ua, sizeof a); \
        return a; \
    }
NF_PICK(nf_pickf, float, uint32_t)
NF_PICK(nf_pick, double, uint64_t)
#define NF_FMAX(a, b) (((a) != (a) || (a) > (b)) ? (a) : (b))
#define NF_FMIN(a, b) (((a) != (a) || (a) < (b)) ? (a) : (b))
/* max and min reductions a loop may split into vector lanes (``simd reduction(nf_fmaxf:acc)``),
   combining the lanes as numpy does: NaN propagates */
#pragma omp declare reduction(nf_fmaxf : float : omp_out = NF_FMAX(omp_out, omp_in)) initializer(omp_priv = -INFINITY)
#pragma omp declare reduction(nf_fminf : float : omp_out = NF_FMIN(omp_out, omp_in)) initializer(omp_priv = INFINITY)
#pragma omp declare reduction(nf_fmax : double : omp_out = NF_FMAX(omp_out, omp_in)) initializer(omp_priv = -INFINITY)
#pragma omp declare reduction(nf_fmin : double : omp_out = NF_FMIN(omp_out, omp_in)) initializer(omp_priv = INFINITY)
#define NF_IMAX(a, b) ((a) > (b) ? (a) : (b))
#define NF_IMIN(a, b) ((a) < (b) ? (a) : (b))
/* Scratch memory for a kernel's temporaries (packed operands, partial and staged sums),
   kept by each calling thread from one call to the next: allocated and freed on every
   call, glibc hands large blocks back to the system and the next call faults them in
   again, which costs a small kernel more than its arithmetic.  NF_SCRATCH declares a
   pointer to at least ``count`` elements, the block of that site and thread (contents
   undefined); a thread's blocks are freed when it exits.  Each library holds one thread key
   (a process has PTHREAD_KEYS_MAX, 1024 on Linux): where none is left its blocks are kept
   but not freed at thread exit (a key used without being created was another library's:
   Python's own thread state broke after a tuner loaded 1100 libraries), and the key is given
   back when the library is unloaded. */
#include <pthread.h>
typedef struct nf_block { struct nf_block *next; } nf_block;
static pthread_key_t nf_blocks_key;
static int nf_blocks_keyed;
static pthread_once_t nf_blocks_once = PTHREAD_ONCE_INIT;
static void nf_free_blocks(void *head) {
    for (nf_block *b = (nf_block *)head; b != NULL;) { nf_block *next = b->next; free(b); b = next; }
}
static void nf_blocks_init(void) { nf_blocks_keyed = pthread_key_create(&nf_blocks_key, nf_free_blocks) == 0; }
__attribute__((destructor)) static void nf_blocks_fini(void) {
    if (nf_blocks_keyed) pthread_key_delete(nf_blocks_key);
}
static void *nf_scratch(void **kept, size_t *capacity, size_t bytes) {
    if (*kept == NULL || bytes > *capacity) {  /* a larger block; the smaller one stays listed */
        pthread_once(&nf_blocks_once, nf_blocks_init);
        nf_block *block = (nf_block *)aligned_alloc(64, 64 + (bytes + 63) / 64 * 64);
        if (nf_blocks_keyed) {
            block->next = (nf_block *)pthread_getspecific(nf_blocks_key);
            pthread_setspecific(nf_blocks_key, block);
        }
        *kept = (char *)block + 64;
        *capacity = bytes;
    }
    return *kept;
}
#define NF_SCRATCH(type, name, count) \
    static __thread void *name##_kept_; static __thread size_t name##_capacity_; \
    type *restrict name = (type *)nf_scratch(&name##_kept_, &name##_capacity_, sizeof(type) * (size_t)(count))
#ifdef _OPENMP
__attribute__((weak)) void nf_set_threads(int n) { omp_set_num_threads(n); }
#else
__attribute__((weak)) void nf_set_threads(int n) { (void)n; }
#endif
"""
