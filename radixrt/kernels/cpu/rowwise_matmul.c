/*
 * out = x @ w.T (+ bias) for a dense weight w [N, K] as the model stores it (row-major, bf16 or
 * float32), with every output reduced over K in one fixed order whatever the number of rows M,
 * the blocking, where x's rows sit in memory or the thread count: deterministic mode's
 * projections and LM head for dense weights (docs/determinism.md).
 *
 * The library GEMMs do not promise that, and on the project's machine do not deliver it: MKL's
 * float32 result for a row depends on M, and oneDNN's unpacked bf16 matmul's on M and on the
 * offset of x's rows, for some weight shapes.
 *
 * One version per instruction set, each in its own file; this file holds the portable one (the
 * reference, in every build), the split of the work between threads and the entry points:
 *   portable  16 float32 lane sums over K, lane l taking inputs k = l mod 16, then a fixed tree
 *   avx2      8 float32 lanes (FMA over bf16 widened), a fixed tree (rowwise_matmul_avx2.c)
 *   avx512    16 lanes, bf16 pair products (rowwise_matmul_avx512.c)
 * They round differently from one another, but each rounds an output the same way whatever the
 * batch: a machine gets one of them (the level it loads). Threads take blocks of weight rows (a
 * block stays in the cache while every row of x passes over it); no output is split between
 * threads.
 */
#include <omp.h>
#include <stdint.h>

#include "isa.h"
#include "rowwise_matmul.h"

#define LANES 16

int radixrt_rowwise_matmul_available(void) { return 1; }

static inline float input(const void *p, int64_t at, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[at]) : ((const float *)p)[at];
}

/* One output: lane l sums the products at k = l mod 16, in k order; then the lanes' tree. */
static float dot(const void *x, const void *w, int64_t k, int bf16) {
    float lanes[LANES] = {0};
    int64_t k0 = 0;
    for (; k0 + LANES <= k; k0 += LANES)
        for (int l = 0; l < LANES; l++) lanes[l] += input(x, k0 + l, bf16) * input(w, k0 + l, bf16);
    for (int l = 0; k0 + l < k; l++) lanes[l] += input(x, k0 + l, bf16) * input(w, k0 + l, bf16);
    float half[8], quarter[4];
    for (int l = 0; l < 8; l++) half[l] = lanes[l] + lanes[l + 8];
    for (int l = 0; l < 4; l++) quarter[l] = half[l] + half[l + 4];
    return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

void radixrt_rowwise_block_portable(const Matmul *a, int bf16, int64_t n0, int64_t n1) {
    const int size = bf16 ? 2 : 4;
    for (int64_t row = 0; row < a->m; row++) {
        const char *x = (const char *)a->x + row * a->x_stride * size;
        for (int64_t col = n0; col < n1; col++)
            store(a, bf16, row, col, dot(x, (const char *)a->w + col * a->k * size, a->k, bf16));
    }
}

static void run(RowwiseBlock *block, const Matmul *a, int bf16, int num_threads) {
    /* Few rows read each weight once (memory-bound): small blocks keep both threads busy. Many:
     * larger blocks of weight rows (docs/kernels.md, "Rowwise matmul"). */
    const int64_t rows_per_block = a->m <= 16 ? 16 : 32;
    const int64_t blocks = (a->n + rows_per_block - 1) / rows_per_block;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n0 = b * rows_per_block, n1 = n0 + rows_per_block < a->n ? n0 + rows_per_block : a->n;
        block(a, bf16, n0, n1);
    }
}

#if RADIXRT_ISA_AVX512
#define BLOCK radixrt_rowwise_block_avx512
#elif RADIXRT_ISA_AVX2
#define BLOCK radixrt_rowwise_block_avx2
#else
#define BLOCK radixrt_rowwise_block_portable
#endif

void radixrt_rowwise_matmul_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *w,
                                 int64_t n, const uint16_t *bias, void *out, int out_f32, int num_threads) {
    Matmul a = {x, x_stride, m, k, w, n, bias, out, out_f32};
    run(BLOCK, &a, 1, num_threads);
}

void radixrt_rowwise_matmul_f32(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *w, int64_t n,
                                const float *bias, float *out, int num_threads) {
    Matmul a = {x, x_stride, m, k, w, n, bias, out, 1};
    run(BLOCK, &a, 0, num_threads);
}

