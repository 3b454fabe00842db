/*
 * Decode attention's per-chunk loop (decode_attention.c) in AVX-512 registers, for head_dim 64
 * and 128; other head sizes, and builds of lower levels, run the portable loop.
 */
#include "isa.h"

#if RADIXRT_ISA_AVX512
#include <immintrin.h>

#include "decode_attention.h"


/* 16 bf16 (f32 = 0) or float32 (f32 = 1) values from element `at` on, as float32 (exact). */
static inline __attribute__((always_inline)) __m512 load16(const void *base, int64_t at, int f32) {
    if (f32) return _mm512_loadu_ps((const float *)base + at);
    const __m256i bits = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* dots[g * stride] = the lane products of query vector g and the key at element `at`, summed over
 * the head's 16-lane slices in order: lane_sum of it is their dot product. */
static inline __attribute__((always_inline)) void key_dots(
    const float *q, const void *k_pool, int64_t at, int W, int group, __m512 *dots, int stride, int f32
) {
    __m512 kv[8];
    _Pragma("GCC unroll 8") for (int s = 0; s < W; s++) kv[s] = load16(k_pool, at + 16 * s, f32);
    for (int g = 0; g < group; g++) {
        const float *qg = q + g * 16 * W;
        __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qg), kv[0]);
        _Pragma("GCC unroll 8") for (int s = 1; s < W; s++) dot = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * s), kv[s], dot);
        dots[g * stride] = dot;
    }
}

/* The sum of v's lanes, added pairwise: lanes l and l + 8, then l + 4, l + 2 and l + 1. */
static inline float lane_sum(__m512 v) {
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(s2) + _mm_cvtss_f32(_mm_movehdup_ps(s2));
}

/*
 * lane_sum of each of 16 vectors, v[i]'s in lane i, with the same pairs added in the same order
 * (so the same bits), the 16 sums at once: each level adds the halves of two vectors' partial sums
 * side by side, 15 additions in all instead of 60 and one vector store instead of 16 scalar ones.
 */
static inline __attribute__((always_inline)) __m512 lane_sums16(const __m512 v[16]) {
    __m512 s8[8], s4[4], s2[2];
    _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++)  /* [v 2i: lanes l + (l + 8), v 2i + 1: same] */
        s8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++)  /* a 128-bit block each for v 4i .. 4i + 3: l + (l + 4) */
        s4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s8[2 * i], s8[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(s8[2 * i], s8[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    _Pragma("GCC unroll 2") for (int i = 0; i < 2; i++)  /* block b: v 8i + b, v 8i + 4 + b, l + (l + 2) */
        s2[i] = _mm512_add_ps(_mm512_shuffle_ps(s4[2 * i], s4[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(s4[2 * i], s4[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* block b: the sums of v b, v 4 + b, v 8 + b, v 12 + b */
    const __m512 s1 = _mm512_add_ps(_mm512_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, s1);
}

/*
 * attend_chunk with head_dim = 16 * W (W literal, 4 or 8) in AVX-512 registers: a key's row is
 * loaded and widened once for all the item's query vectors, and a block of VB query vectors'
 * outputs stays in registers for the whole chunk (the portable loop keeps them in memory). Same
 * float32 arithmetic, per-key dot products reduced across lanes at the end, sixteen keys' at once
 * (lane_sums16), the same bits as one at a time (docs/kernels.md, "Decode attention: AVX-512").
 */
static inline __attribute__((always_inline)) void attend_chunk_wide(
    const float *q, const void *k_pool, const void *v_pool, const int64_t *slots,
    int64_t k0, int64_t k1, int h, int num_kv_heads, int W, int VB, int group,
    float *max_out, float *sum_out, float *acc, int f32, float softcap
) {
    float scores[MAX_GROUP * CHUNK];
    const int head_dim = 16 * W;
    const int64_t n = k1 - k0;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 dots[MAX_GROUP][16];
        for (int i = 0; i < 16; i++) {
            prefetch_ahead(k_pool, v_pool, slots + k0, j + i, n, h, num_kv_heads, head_dim, f32);
            key_dots(q, k_pool, (slots[k0 + j + i] * num_kv_heads + h) * head_dim, W, group, &dots[0][i], 16, f32);
        }
        for (int g = 0; g < group; g++) _mm512_storeu_ps(scores + g * CHUNK + j, lane_sums16(dots[g]));
    }
    for (; j < n; j++) {
        prefetch_ahead(k_pool, v_pool, slots + k0, j, n, h, num_kv_heads, head_dim, f32);
        __m512 dots[MAX_GROUP];
        key_dots(q, k_pool, (slots[k0 + j] * num_kv_heads + h) * head_dim, W, group, dots, 1, f32);
        for (int g = 0; g < group; g++) scores[g * CHUNK + j] = lane_sum(dots[g]);
    }
    softmax_rows(scores, n, group, max_out, sum_out, softcap);
    for (int g0 = 0; g0 < group; g0 += VB) {
        const int nb = group - g0 < VB ? group - g0 : VB;
        __m512 out[4][8];
        _Pragma("GCC unroll 4") for (int b = 0; b < VB; b++)
            _Pragma("GCC unroll 8") for (int i = 0; i < W; i++) out[b][i] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const int64_t v = (slots[k0 + j] * num_kv_heads + h) * head_dim;
            __m512 vv[8];
            _Pragma("GCC unroll 8") for (int i = 0; i < W; i++) vv[i] = load16(v_pool, v + 16 * i, f32);
            _Pragma("GCC unroll 4") for (int b = 0; b < VB; b++) {
                if (b < nb) {
                    const __m512 p = _mm512_set1_ps(scores[(g0 + b) * CHUNK + j]);
                    _Pragma("GCC unroll 8") for (int i = 0; i < W; i++) out[b][i] = _mm512_fmadd_ps(p, vv[i], out[b][i]);
                }
            }
        }
        _Pragma("GCC unroll 4") for (int b = 0; b < VB; b++)
            if (b < nb)
                _Pragma("GCC unroll 8") for (int i = 0; i < W; i++)
                    _mm512_storeu_ps(acc + (g0 + b) * head_dim + 16 * i, out[b][i]);
    }
}

void radixrt_attend_chunk_avx512(const float *q, const void *k_pool, const void *v_pool, const int64_t *slots,
                                 int64_t k0, int64_t k1, int h, int num_kv_heads, int head_dim, int group,
                                 float *max_out, float *sum_out, float *acc, int f32, float softcap) {
#define WIDE(W, VB, F32) attend_chunk_wide(q, k_pool, v_pool, slots, k0, k1, h, num_kv_heads, W, VB, group, max_out, \
                                           sum_out, acc, F32, softcap)
    if (head_dim == 64) {
        if (f32) WIDE(4, 4, 1);
        else WIDE(4, 4, 0);
    } else {
        if (f32) WIDE(8, 2, 1);
        else WIDE(8, 2, 0);
    }
#undef WIDE
}

#endif
