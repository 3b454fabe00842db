/*
 * out = x @ w.T (+ bias) for a dense weight w [N, K] as the model stores it
 * (row-major, bf16 or float32), with every output reduced over K in one fixed
 * order whatever the number of rows M, the blocking, where x's rows sit in
 * memory or the thread count: deterministic mode's projections and LM head
 * for dense weights (docs/determinism.md).
 *
 * The library GEMMs do not promise that, and on the project's machine do not
 * deliver it: MKL's float32 result for a row depends on M (M = 1, 2-3 and >= 4
 * differ; on two threads also M mod 4 below 12), and oneDNN's unpacked bf16
 * matmul's on M and on the offset of x's rows, for some weight shapes.
 *
 * Each output is a dot product: 16 float32 lane sums over K, in steps of 32
 * inputs (bf16: AVX512-BF16 pair products, exact in float32 before the add)
 * or 16 (float32: FMA), a masked last step, one fixed reduction of the lanes
 * (the tree of GCC's _mm512_reduce_add_ps), then the bias. A tile of 4 rows by
 * 4 weight rows keeps 16 sums in registers and reduces them together, the
 * same tree for each (`reduce16`, checked bitwise against the single-vector
 * reduction); the tails run the same per-output instructions on fewer rows or
 * columns. Threads take blocks of weight rows (a block stays in the
 * cache while every row of x passes over it); no output is split between
 * threads.
 *
 * Without AVX512-BF16 a portable tile does the same in plain C: 16 float32
 * lane sums over K, lane l taking inputs k = l mod 16, then the same tree.
 * It is slower and rounds differently from the AVX-512 one (bf16 products
 * are added one at a time, not in pairs), but it too rounds each output the
 * same way whatever the batch: a machine gets one of the two.
 */
#include <omp.h>
#include <stdint.h>

#include "scalar.h"

#define TILE_M 4
#define TILE_N 4

int radixrt_rowwise_matmul_available(void) { return 1; }

typedef struct {
    const void *x;
    int64_t x_stride, m, k;
    const void *w;
    int64_t n;
    const void *bias; /* [N] in w's dtype, or NULL */
    void *out;        /* [M, N], contiguous */
    int out_f32;      /* 1: float32 out; 0: w's dtype */
} Matmul;

static inline void store(const Matmul *a, int bf16, int64_t row, int64_t col, float value) {
    if (a->bias) value += bf16 ? bf16_to_float(((const uint16_t *)a->bias)[col]) : ((const float *)a->bias)[col];
    if (a->out_f32) ((float *)a->out)[row * a->n + col] = value;
    else if (bf16) ((uint16_t *)a->out)[row * a->n + col] = float_to_bf16(value);
    else ((float *)a->out)[row * a->n + col] = value;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>

/*
 * The lane sums of 16 vectors in one vector, each added in the order _mm512_reduce_add_ps adds
 * one vector's lanes: lane i + lane i + 8, then j + j + 4, j + j + 2, j + j + 1 (addition
 * commutes, so operand order does not matter). 15 adds and 30 shuffles instead of 16 x 8 ops.
 * Lane 4 c + r of the result is the sum of v[4 r + c].
 */
static inline __m512 reduce16(const __m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
}

/* Each accumulator's lane sum, stored (with the bias) at its output. */
static inline __attribute__((always_inline)) void store_tile(
    const Matmul *a, int bf16, int64_t m0, int64_t n0, int mr, int nr, __m512 acc[TILE_M][TILE_N]
) {
    if (mr == TILE_M && nr == TILE_N) {
        float sums[16];
        _mm512_storeu_ps(sums, reduce16(&acc[0][0]));
        for (int i = 0; i < TILE_M; i++)
            for (int j = 0; j < TILE_N; j++) store(a, bf16, m0 + i, n0 + j, sums[4 * j + i]);
        return;
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) store(a, bf16, m0 + i, n0 + j, _mm512_reduce_add_ps(acc[i][j]));
}

/* Outputs [m0, m0 + mr) x [n0, n0 + nr): inlined with literal mr, nr for whole tiles. */
static inline __attribute__((always_inline)) void tile_bf16(const Matmul *a, int64_t m0, int64_t n0, int mr, int nr) {
    const uint16_t *x = (const uint16_t *)a->x + m0 * a->x_stride;
    const uint16_t *w = (const uint16_t *)a->w + n0 * a->k;
    const int64_t k = a->k, whole = k - k % 32;
    __m512 acc[TILE_M][TILE_N];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < whole; kk += 32) {
        __m512bh wv[TILE_N];
        for (int j = 0; j < nr; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * k + kk);
        for (int i = 0; i < mr; i++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * a->x_stride + kk);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    if (whole < k) {
        __mmask32 mask = (__mmask32)((1ull << (k - whole)) - 1);
        __m512bh wv[TILE_N];
        for (int j = 0; j < nr; j++) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + j * k + whole);
        for (int i = 0; i < mr; i++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * a->x_stride + whole);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    store_tile(a, 1, m0, n0, mr, nr, acc);
}

static inline __attribute__((always_inline)) void tile_f32(const Matmul *a, int64_t m0, int64_t n0, int mr, int nr) {
    const float *x = (const float *)a->x + m0 * a->x_stride;
    const float *w = (const float *)a->w + n0 * a->k;
    const int64_t k = a->k, whole = k - k % 16;
    __m512 acc[TILE_M][TILE_N];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < whole; kk += 16) {
        __m512 wv[TILE_N];
        for (int j = 0; j < nr; j++) wv[j] = _mm512_loadu_ps(w + j * k + kk);
        for (int i = 0; i < mr; i++) {
            __m512 xv = _mm512_loadu_ps(x + i * a->x_stride + kk);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    if (whole < k) {
        __mmask16 mask = (__mmask16)((1u << (k - whole)) - 1);
        __m512 wv[TILE_N];
        for (int j = 0; j < nr; j++) wv[j] = _mm512_maskz_loadu_ps(mask, w + j * k + whole);
        for (int i = 0; i < mr; i++) {
            __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * a->x_stride + whole);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    store_tile(a, 0, m0, n0, mr, nr, acc);
}

/* A tile of mr rows by nr columns: whole-width tiles (every row count, as a decode's single row
 * is one) get code compiled for their literal shape, which keeps the sums in registers. */
static inline __attribute__((always_inline)) void tile(const Matmul *a, int bf16, int64_t m0, int64_t c, int mr,
                                                       int nr) {
    if (bf16) tile_bf16(a, m0, c, mr, nr);
    else tile_f32(a, m0, c, mr, nr);
}

static void block(const Matmul *a, int bf16, int64_t n0, int64_t n1) {
    /* The next block's weight rows on their way while this one computes: a few rows of x (a
     * decode batch: the LM head at 8 rows 2.7 -> 2.4 ms) make a block compute long enough to hide
     * them; one row streams and the hardware keeps up; many rows reuse a block from the cache. */
    if (a->m > 1 && a->m <= 64) {
        const int size = bf16 ? 2 : 4;
        const int64_t end = n1 + (n1 - n0) < a->n ? n1 + (n1 - n0) : a->n;
        const char *next = (const char *)a->w + n1 * a->k * size, *stop = (const char *)a->w + end * a->k * size;
        for (; next < stop; next += 64) _mm_prefetch(next, _MM_HINT_T1);
    }
    for (int64_t m0 = 0; m0 < a->m; m0 += TILE_M) {
        int mr = a->m - m0 < TILE_M ? (int)(a->m - m0) : TILE_M;
        for (int64_t c = n0; c < n1; c += TILE_N) {
            int nr = n1 - c < TILE_N ? (int)(n1 - c) : TILE_N;
            if (nr < TILE_N) tile(a, bf16, m0, c, mr, nr);
            else if (mr == 4) tile(a, bf16, m0, c, 4, TILE_N);
            else if (mr == 3) tile(a, bf16, m0, c, 3, TILE_N);
            else if (mr == 2) tile(a, bf16, m0, c, 2, TILE_N);
            else tile(a, bf16, m0, c, 1, TILE_N);
        }
    }
}

#else

#define LANES 16

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

static void block(const Matmul *a, int bf16, int64_t n0, int64_t n1) {
    const int size = bf16 ? 2 : 4;
    for (int64_t row = 0; row < a->m; row++) {
        const char *x = (const char *)a->x + row * a->x_stride * size;
        for (int64_t col = n0; col < n1; col++)
            store(a, bf16, row, col, dot(x, (const char *)a->w + col * a->k * size, a->k, bf16));
    }
}

#endif

static void run(const Matmul *a, int bf16, int num_threads) {
    /* Few rows read each weight once (memory-bound): small blocks keep both threads busy. Many:
     * 32 weight rows a block ran 4-10% faster than 64 at 128-512 rows (K = 576, 1536). */
    const int64_t rows_per_block = a->m <= 16 ? 16 : 32;
    const int64_t blocks = (a->n + rows_per_block - 1) / rows_per_block;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n0 = b * rows_per_block, n1 = n0 + rows_per_block < a->n ? n0 + rows_per_block : a->n;
        block(a, bf16, n0, n1);
    }
}

void radixrt_rowwise_matmul_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *w,
                                 int64_t n, const uint16_t *bias, void *out, int out_f32, int num_threads) {
    Matmul a = {x, x_stride, m, k, w, n, bias, out, out_f32};
    run(&a, 1, num_threads);
}

void radixrt_rowwise_matmul_f32(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *w, int64_t n,
                                const float *bias, float *out, int num_threads) {
    Matmul a = {x, x_stride, m, k, w, n, bias, out, 1};
    run(&a, 0, num_threads);
}

