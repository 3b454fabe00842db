/*
 * What the AVX512-BF16 kernels over format_layout.h's tiles share (kquant_matmul_avx512.c, the
 * product; kquant_dequantize_avx512.c, the weight back as bf16): the code tables (bf16 and
 * int16), a chunk's decoding and a sub-block's scales. Included by AVX-512 builds only.
 */
#ifndef RADIXRT_CPU_KQUANT_AVX512_H
#define RADIXRT_CPU_KQUANT_AVX512_H

#include <immintrin.h>
#include <stdint.h>

#include "format_layout.h"

#define SELECT_C_A_B 0xE4  /* vpternlog: c ? a : b, bitwise */

typedef struct {
    __m512i low, high;  /* 64 bf16 entries: 32-entry tables use `low` */
} Table;

static inline Table code_table(int format) {
    const int bias = format == FORMAT_Q6_K ? 32 : format == FORMAT_Q5_0 ? 16 : 0;
    const int wrap = format == FORMAT_Q4_K ? 16 : 64;  /* Q4_K: the 16 entries twice (bit 4 is B's) */
    float values[64];
    for (int i = 0; i < 64; i++) values[i] = (float)(i % wrap - bias);
    Table t;
    t.low = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(values + 16), _mm512_loadu_ps(values));
    t.high = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(values + 48), _mm512_loadu_ps(values + 32));
    return t;
}

/* The same 64 entries as 16-bit integers (q - bias), for integer dot products: decode_chunk with
 * this table gives each code as an int16 lane instead of a bf16 one. */
static inline Table integer_table(int format) {
    const int bias = format == FORMAT_Q6_K ? 32 : format == FORMAT_Q5_0 ? 16 : 0;
    const int wrap = format == FORMAT_Q4_K ? 16 : 64;
    int16_t values[64];
    for (int i = 0; i < 64; i++) values[i] = (int16_t)(i % wrap - bias);
    Table t;
    t.low = _mm512_loadu_si512(values);
    t.high = _mm512_loadu_si512(values + 32);
    return t;
}

/* Codes A and B of chunk c's 32 lanes: `bytes` its nibble bytes widened, `high` the lanes' high
 * bits (the half's or pair's plane byte widened). */
static inline __attribute__((always_inline)) void decode_chunk(int format, __m512i bytes, __m512i high, int c,
                                                               const Table *table, __m512bh *a, __m512bh *b) {
    const __m512i nibble_mask = _mm512_set1_epi16(0x0F);
    const __m512i low_b = _mm512_srli_epi16(bytes, 4);
    if (format == FORMAT_Q4_K) {
        *a = (__m512bh)_mm512_permutexvar_epi16(bytes, table->low);
        *b = (__m512bh)_mm512_permutexvar_epi16(low_b, table->low);
        return;
    }
    if (format == FORMAT_Q6_K) {  /* code b's 2 high bits at 4 (c % 2) + 2 b, wanted at 4 */
        const int at_a = 4 * (c % 2), at_b = at_a + 2;
        const __m512i ha = at_a < 4 ? _mm512_slli_epi16(high, 4 - at_a) : high;
        const __m512i hb = at_b < 4 ? _mm512_slli_epi16(high, 4 - at_b) : _mm512_srli_epi16(high, at_b - 4);
        *a = (__m512bh)_mm512_permutex2var_epi16(table->low, _mm512_ternarylogic_epi32(bytes, ha, nibble_mask, SELECT_C_A_B),
                                                 table->high);
        *b = (__m512bh)_mm512_permutex2var_epi16(table->low, _mm512_ternarylogic_epi32(low_b, hb, nibble_mask, SELECT_C_A_B),
                                                 table->high);
        return;
    }
    /* Q5: code b's high bit at 2 (c % 4) + b, wanted at 4 */
    const int at_a = 2 * (c % 4), at_b = at_a + 1;
    const __m512i ha = at_a < 4 ? _mm512_slli_epi16(high, 4 - at_a) : at_a > 4 ? _mm512_srli_epi16(high, at_a - 4) : high;
    const __m512i hb = at_b < 4 ? _mm512_slli_epi16(high, 4 - at_b) : _mm512_srli_epi16(high, at_b - 4);
    *a = (__m512bh)_mm512_permutexvar_epi16(_mm512_ternarylogic_epi32(bytes, ha, nibble_mask, SELECT_C_A_B), table->low);
    *b = (__m512bh)_mm512_permutexvar_epi16(_mm512_ternarylogic_epi32(low_b, hb, nibble_mask, SELECT_C_A_B), table->low);
}

/*
 * Sub-block `sub`'s scales for the tile's 16 rows: d sc (Q4_K, Q5_K, Q6_K) or d (Q5_0, Q5_1),
 * exact in float32; *offset: dmin m (Q4_K, Q5_K; subtracted) or m (Q5_1; added), else unset.
 */
static inline __attribute__((always_inline)) __m512 sub_scales(int format, const uint8_t *unit, int sub,
                                                               __m512 *offset) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(unit + layout_d_at(format))));
    const uint8_t *scales = unit + layout_scales_at(format) + 16 * sub;
    if (layout_has_offset(format)) {
        const __m512 second = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(unit + layout_d_at(format) + 32)));
        *offset = format == FORMAT_Q5_1 ? second : _mm512_mul_ps(second, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                                            _mm_loadu_si128((const __m128i *)(scales + 128)))));
    }
    if (format == FORMAT_Q6_K)
        return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)scales))));
    if (format == FORMAT_Q4_K || format == FORMAT_Q5_K)
        return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)scales))));
    return d;
}

#endif
