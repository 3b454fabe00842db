/*
 * The batch-invariant dense matmul (rowwise_matmul.c) for AVX2 + FMA CPUs.
 *
 * Each output is 8 float32 lane sums over K, lane l taking inputs k = l mod 8 in k order (bf16
 * widened to float32 exactly, one FMA a product), the last partial step read through a
 * zero-padded copy, then one fixed tree over the lanes (l + (l + 4), then + 2, then + 1) and
 * the bias. A tile of up to 2 rows by 4 weight rows keeps its 8 sums in registers; every output
 * runs the same instructions in any tile shape, so its bits do not depend on the batch.
 */
#include "isa.h"

#if RADIXRT_ISA_AVX2
#include <immintrin.h>
#include <string.h>

#include "rowwise_matmul.h"

#define TILE_M 2
#define TILE_N 4

/* 8 inputs from element `at` (bf16 or float32) as float32; `left` < 8: those, then zeros. */
static inline __attribute__((always_inline)) __m256 load8(const void *base, int64_t at, int bf16, int left) {
    if (left >= 8) {
        if (!bf16) return _mm256_loadu_ps((const float *)base + at);
        const __m128i bits = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + at));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
    }
    float values[8] = {0};
    for (int i = 0; i < left; i++)
        values[i] = bf16 ? bf16_to_float(((const uint16_t *)base)[at + i]) : ((const float *)base)[at + i];
    return _mm256_loadu_ps(values);
}

static inline float lane_sum(__m256 v) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

/* Outputs [m0, m0 + mr) x [n0, n0 + nr): inlined with literal mr, nr for whole tiles. */
static inline __attribute__((always_inline)) void tile(const Matmul *a, int bf16, int64_t m0, int64_t n0, int mr,
                                                       int nr) {
    const int size = bf16 ? 2 : 4;
    const char *x = (const char *)a->x + m0 * a->x_stride * size, *w = (const char *)a->w + n0 * a->k * size;
    const int64_t k = a->k;
    __m256 acc[TILE_M][TILE_N];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < k; kk += 8) {
        const int left = k - kk >= 8 ? 8 : (int)(k - kk);
        __m256 wv[TILE_N];
        for (int j = 0; j < nr; j++) wv[j] = load8(w + j * k * size, kk, bf16, left);
        for (int i = 0; i < mr; i++) {
            const __m256 xv = load8(x + i * a->x_stride * size, kk, bf16, left);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) store(a, bf16, m0 + i, n0 + j, lane_sum(acc[i][j]));
}

static inline __attribute__((always_inline)) void block_of(const Matmul *a, int bf16, int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < a->m; m0 += TILE_M) {
        const int mr = a->m - m0 < TILE_M ? (int)(a->m - m0) : TILE_M;
        for (int64_t c = n0; c < n1; c += TILE_N) {
            const int nr = n1 - c < TILE_N ? (int)(n1 - c) : TILE_N;
            if (nr < TILE_N) tile(a, bf16, m0, c, mr, nr);
            else if (mr == 2) tile(a, bf16, m0, c, 2, TILE_N);
            else tile(a, bf16, m0, c, 1, TILE_N);
        }
    }
}

void radixrt_rowwise_block_avx2(const Matmul *a, int bf16, int64_t n0, int64_t n1) {
    if (bf16) block_of(a, 1, n0, n1);
    else block_of(a, 0, n0, n1);
}

#endif
