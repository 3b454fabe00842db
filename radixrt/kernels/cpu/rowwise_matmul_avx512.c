/*
 * The batch-invariant dense matmul (rowwise_matmul.c) for AVX512-BF16 CPUs.
 *
 * Each output is a dot product: 16 float32 lane sums over K, in steps of 32 inputs (bf16:
 * AVX512-BF16 pair products, exact in float32 before the add) or 16 (float32: FMA), a masked
 * last step, one fixed reduction of the lanes (the tree of GCC's _mm512_reduce_add_ps), then the
 * bias. A tile of 4 rows by 4 weight rows keeps 16 sums in registers and reduces them together,
 * the same tree for each (`reduce16`, checked bitwise against the single-vector reduction); the
 * tails run the same per-output instructions on fewer rows or columns.
 */
#include "isa.h"

#if RADIXRT_ISA_AVX512
#include <immintrin.h>

#include "rowwise_matmul.h"

#define TILE_M 4
#define TILE_N 4

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

void radixrt_rowwise_block_avx512(const Matmul *a, int bf16, int64_t n0, int64_t n1) {
    /* The next block's weight rows on their way while this one computes: a few rows of x (a
     * decode batch) make a block compute long enough to hide them; one row streams and the
     * hardware keeps up; many rows reuse a block from the cache (docs/kernels.md, "Rowwise
     * matmul"). */
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

#endif
