/*
 * What the AVX-512 kernels over format_layout.h's tiles share (kquant_matmul_avx512.c and
 * kquant_matmul_amx.c, the product; kquant_dequantize_avx512.c, the weight back as bf16): the
 * code tables (bf16 and int16), a chunk's decoding, a sub-block's scales, the product's integer
 * rows and its float32 steps. Included by AVX-512 builds only.
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

#define PREFETCH_BYTES 5120  /* a block's bytes in flight, as quantized_matmul.c's 4-bit kernel */

/* A step's rows of x as 16-bit integers per group of 32 (kquant_matmul_avx512.c's integer_rows):
 * what the VPDPWSSD blocks and the AMX tiles (kquant_matmul_amx.c) read. */
typedef struct {
    const int16_t *x16;    /* [m][K] */
    const float *scale;    /* [m][K / 32]: s */
    const float *offset_x; /* [m][K / 32]: s * sum x16 over the group (the offsets' factor) */
    const int8_t *high;    /* x16 >> 8 for the AMX tiles (NULL without them), plane_at's order */
    const uint8_t *low;    /* x16 & 255, so that x16 = 256 high + low */
} IntegerRows;

/* Where input k of row r lies in a byte plane: each 16 rows' group of 32 inputs as one tile's
 * 16 x 32 bytes, one after another (a tile load reads 512 bytes in a row rather than 16 rows a
 * stride apart, which met in a few sets of L1). Rows of whole blocks of 16 only. */
static inline int64_t plane_at(int64_t r, int64_t k, int64_t num_cols) {
    return r / 16 * 16 * num_cols + k / LAYOUT_GROUP * 512 + r % 16 * LAYOUT_GROUP + k % LAYOUT_GROUP;
}

/* acc[r] += scale * (s * float(dots[r])) for sub-block `sub` of the unit (group `group` of the
 * unit's inputs), and the group's offset term; the dots restart at zero */
static inline __attribute__((always_inline)) void scale_into(int format, const uint8_t *unit, int sub, int group,
                                                             __m512 *acc, __m512i *dots, int mb, const float *s,
                                                             const float *offset_x, int64_t all_groups) {
    __m512 offset = _mm512_setzero_ps();
    const __m512 scale = sub_scales(format, unit, sub, &offset);
    _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) {
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dots[r]), _mm512_set1_ps(s[r * all_groups + group]));
        acc[r] = _mm512_fmadd_ps(scale, t, acc[r]);
        dots[r] = _mm512_setzero_si512();
    }
    if (offset_x == NULL) return;  /* the group's first Q6_K sub-block */
    if (format == FORMAT_Q5_1) {
        _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++)
            acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(offset_x[r * all_groups + group]), acc[r]);
    } else if (layout_has_offset(format)) {  /* - dmin m, exactly the AVX2 kernel's (-dmin) m */
        _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++)
            acc[r] = _mm512_fnmadd_ps(offset, _mm512_set1_ps(offset_x[r * all_groups + group]), acc[r]);
    }
}

/* kquant_matmul_amx.c: rows [0, full) of x (amx_rows) times tiles [first_tile, last_tile) on
 * AMX's int8 tiles, the VPDPWSSD blocks' bits; scratch: kquant_amx_scratch_bytes. The byte planes
 * hold amx_padded(full) rows, a partial block's missing rows zero.
 * kquant_amx_usable is 0 where the build or the CPU has no AMX-INT8 or Linux refuses its state. */
#define AMX_ROWS 16
static inline int64_t amx_padded(int64_t rows) { return (rows + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS; }
/* The rows of an m-row step the tiles take: every whole block of AMX_ROWS, and a last partial
 * block of AMX_LEAST_AFTER_WHOLE rows or more, whose tile products then cost less than the
 * VPDPWSSD blocks' pass over the weight for its rows (docs/kernels.md). A step of fewer than
 * AMX_ROWS rows stays on the VPDPWSSD blocks, which decode the codes in registers; the tiles
 * decode them into memory first. The two paths' bits are the same, so the split changes only
 * the time. */
#define AMX_LEAST_AFTER_WHOLE 8
static inline int64_t amx_rows(int64_t m) {
    const int64_t whole = m / AMX_ROWS * AMX_ROWS;
    return whole > 0 && m - whole >= AMX_LEAST_AFTER_WHOLE ? m : whole;
}
int kquant_amx_usable(void);
int64_t kquant_amx_scratch_bytes(int64_t num_cols);
void kquant_amx_tiles(int format, const uint8_t *tiles, const IntegerRows *rows, int64_t full, int64_t num_cols,
                      int64_t first_tile, int64_t last_tile, void *scratch, float *out, int64_t out_stride,
                      uint16_t *out_bf16);

#endif
