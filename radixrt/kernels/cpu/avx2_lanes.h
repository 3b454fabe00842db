/*
 * AVX2 helpers the AVX2 product kernels share (included only where RADIXRT_ISA_AVX2 holds): bf16
 * lanes widened to float, and horizontal reductions in a fixed order, so a row's result does not
 * depend on which kernel or batch it is in.
 */
#ifndef RADIXRT_CPU_AVX2_LANES_H
#define RADIXRT_CPU_AVX2_LANES_H

#include <immintrin.h>
#include <stdint.h>

/* 8 bf16 values from p as float32 (exact) */
static inline __m256 widen_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float horizontal_max(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

static inline float horizontal_sum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline int32_t horizontal_sum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

#endif
