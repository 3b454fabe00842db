/*
 * AVX2 + FMA + F16C product over format_layout.h's tiles (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1), with
 * kquant_matmul_tiles_portable's contract: the kernel of builds below AVX-512.
 *
 * AVX2 has no bf16 dot product, so the inputs become integers: each row's inputs, per group of
 * 32, x ~ s x16 with s = max|x| / 32767 and x16 = round(x / s) in int16. A chunk's codes widen
 * to 16-bit lanes L = 2 n + e and meet broadcast (x16, x16) pairs in VPMADDWD, which adds each
 * lane pair into row n's 32-bit lane. The integer sums are exact (|q x16| < 2^21, 32 a sum), and
 * per sub-block and output, in float32:
 *
 *     acc += (d sc) * (s * float(sum q x16 - bias sum x16))  +  offset * (s * sum_group x16)
 *
 * with bias 32 (Q6_K), 16 (Q5_0) or 0, offset -dmin m (Q4_K, Q5_K) or m (Q5_1); d sc and dmin m
 * are exact in float32. Both terms read the same x16, so the result is the file's weights times
 * x rounded to x16, accumulated in float32: each input moves by s / 2 (and float32's rounding of
 * s and 1 / s), about 1/256 of bf16's spacing near its group's largest input (a group whose
 * inputs are all below 2^-64 counts as zeros). Integer sums take half the instructions of
 * float32 FMAs over converted codes (docs/kernels.md, "K-quant product on AVX2").
 *
 * Order: a tile at a time, blocks of up to MAX_ROWS rows of x, the tile's units in turn and in
 * each the tile's two halves of 8 rows (one ymm of sums a row) group by group; a block decodes
 * each code once for all its rows. Every row runs the same float32 steps in the same order
 * whatever the block's size, M or the tile range: a row's result does not depend on its batch.
 * A thread's tiles are one stream in memory (a tile's units, then the next tile's): the first
 * block of rows asks for it PREFETCH_BYTES ahead (the hardware's own prefetch alone left the
 * loads waiting), into L1 rather than non-temporally since each unit's lines are read twice (the
 * tile's two halves of rows); the later blocks find the tile in cache.
 */
#include <stdint.h>
#include <string.h>

#include "format_layout.h"
#include "isa.h"

#if RADIXRT_ISA_AVX2 && !RADIXRT_ISA_AVX512
#include <immintrin.h>

#include "avx2_lanes.h"

#define X16_MAX 32767
#define MAX_ROWS 8
#define PREFETCH_BYTES 4096
#define TINY 0x1p-64f  /* groups below it count as zeros: X16_MAX / max|x| stays finite */

typedef struct {
    const int16_t *x16;    /* [m][K] */
    const float *scale;    /* [m][K / 32]: s */
    const float *offset_x; /* [m][K / 32]: s * sum x16 over the group (the offsets' factor) */
    const int32_t *sum16;  /* [m][K / 16]: sum x16 over 16 inputs (the biases' factor) */
} IntegerRows;


/* The m rows of x as 16-bit integers per group of 32 (see the top of the file), with each group's
 * s, s times its sum of x16, and the sums of x16 per 16 inputs. */
static IntegerRows integer_rows(const uint16_t *x, int64_t x_stride, int64_t m, int64_t num_cols, void *scratch) {
    const int64_t groups = num_cols / LAYOUT_GROUP;
    int16_t *x16 = (int16_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    float *scale = (float *)(x16 + m * num_cols), *offset_x = scale + m * groups;
    int32_t *sum16 = (int32_t *)(offset_x + m * groups);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t r = 0; r < m; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *xs = x + r * x_stride + g * LAYOUT_GROUP;
            __m256 v[4];
            for (int i = 0; i < 4; i++) v[i] = widen_bf16(xs + 8 * i);
            const __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                              _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
            const float largest = horizontal_max(amax);
            const int zero = !(largest >= TINY);
            /* |x / s| <= X16_MAX up to the quotient's rounding; packs saturates besides */
            const __m256 inverse = _mm256_set1_ps(zero ? 0.0f : (float)X16_MAX / largest);
            __m256i q[4];
            for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
            int32_t sums[2];
            for (int h = 0; h < 2; h++) {
                /* packs works within 128-bit lanes: the quarters back in order */
                _mm256_storeu_si256((__m256i *)(x16 + r * num_cols + g * LAYOUT_GROUP + 16 * h),
                                    _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * h], q[2 * h + 1]), 0xD8));
                sums[h] = horizontal_sum_epi32(_mm256_add_epi32(q[2 * h], q[2 * h + 1]));
                sum16[r * 2 * groups + 2 * g + h] = sums[h];
            }
            const float s = zero ? 0.0f : largest / (float)X16_MAX;
            scale[r * groups + g] = s;
            offset_x[r * groups + g] = s * (float)(sums[0] + sums[1]);  /* |sum| < 2^21: exact */
        }
    }
    return (IntegerRows){x16, scale, offset_x, sum16};
}

/* v's bit `from` (in every 16-bit lane) moved to bit `to`; the callers mask the result */
static inline __attribute__((always_inline)) __m256i move_bit(__m256i v, int from, int to) {
    return from < to ? _mm256_slli_epi16(v, to - from) : from > to ? _mm256_srli_epi16(v, from - to) : v;
}

static inline __m256i broadcast_pair(const int16_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

static inline __m256 scales_times(__m256 d, const uint8_t *bytes, int is_signed) {
    const __m128i eight = _mm_loadl_epi64((const __m128i *)bytes);
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight)));
}

/* acc[r] += scale * (s * float(dot[r] - bias sum16)) for the block's rows */
static inline __attribute__((always_inline)) void add_sub_block(int mb, __m256 acc[], __m256i dot[], __m256 scale,
                                                                int bias, const float *s, const int32_t *sum16,
                                                                int64_t rows_s, int64_t rows_sum16) {
    _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) {
        __m256i exact = dot[r];
        if (bias) exact = _mm256_sub_epi32(exact, _mm256_set1_epi32(bias * sum16[r * rows_sum16]));
        const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(exact), _mm256_set1_ps(s[r * rows_s]));
        acc[r] = _mm256_fmadd_ps(scale, t, acc[r]);
        dot[r] = _mm256_setzero_si256();
    }
}

/*
 * Rows [r0, r0 + mb) of x times one tile (its units from `tile` on), results stored to out or
 * out_bf16 (row stride out_stride, columns from `column`). FORMAT and mb are constants in each
 * copy run_block makes.
 */
static inline __attribute__((always_inline)) void tile_block(
    const int format, const int mb, const uint8_t *tile, int64_t units, const IntegerRows *rows, int64_t r0,
    int64_t num_cols, int prefetch, float *out, uint16_t *out_bf16, int64_t out_stride, int64_t column
) {
    const int inputs = layout_unit_inputs(format), groups = layout_groups(format), high = layout_high_bytes(format);
    const int64_t unit_bytes = layout_unit_bytes(format), all_groups = num_cols / LAYOUT_GROUP;
    const int bias = format == FORMAT_Q6_K ? 32 : format == FORMAT_Q5_0 ? 16 : 0;
    const int k_quant = format == FORMAT_Q4_K || format == FORMAT_Q5_K;
    const int lines = (int)((unit_bytes + 64 * groups - 1) / (64 * groups));  /* a group's share of the unit */
    const __m256i nibble = _mm256_set1_epi16(0x0F), bit4 = _mm256_set1_epi16(0x10), bits45 = _mm256_set1_epi16(0x30);
    __m256 acc[2][MAX_ROWS];
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < mb; r++) acc[h][r] = _mm256_setzero_ps();
    for (int64_t u = 0; u < units; u++) {
        const uint8_t *unit = tile + u * unit_bytes;
        const uint8_t *scales = unit + layout_scales_at(format), *halves = unit + layout_d_at(format);
        const int16_t *x16 = rows->x16 + r0 * num_cols + u * inputs;
        const int64_t first_group = u * groups;
        const float *s = rows->scale + r0 * all_groups + first_group;
        const float *offset_x = rows->offset_x + r0 * all_groups + first_group;
        const int32_t *sum16 = rows->sum16 + r0 * 2 * all_groups + 2 * first_group;
        for (int h = 0; h < 2; h++) {  /* tile rows 8 h .. 8 h + 7 */
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(halves + 16 * h)));
            __m256 second = _mm256_setzero_ps();
            if (layout_has_offset(format)) second = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(halves + 32 + 16 * h)));
            if (k_quant) second = _mm256_xor_ps(second, _mm256_set1_ps(-0.0f));  /* -dmin */
            for (int g = 0; g < groups; g++) {
                if (prefetch && h == 0)
                    for (int i = 0; i < lines; i++)
                        _mm_prefetch((const char *)unit + 64 * (lines * g + i) + PREFETCH_BYTES, _MM_HINT_T0);
                const uint8_t *nibbles = unit + LAYOUT_NIBBLE_BYTES * g + 16 * h;
                const uint8_t *plane = unit + layout_high_at(format) + high * g + 16 * h;
                __m256i dot[MAX_ROWS], high_bits = _mm256_setzero_si256();
                for (int r = 0; r < mb; r++) dot[r] = _mm256_setzero_si256();
                _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) {
                    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(nibbles + 32 * c)));
                    __m256i a = _mm256_and_si256(bytes, nibble), b = _mm256_srli_epi16(bytes, 4);
                    if (high == 64) {  /* Q5: bits 2 j, 2 j + 1 of the half's byte, j = c % 4 */
                        if (c % 4 == 0) high_bits = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(plane + 8 * c)));
                        a = _mm256_or_si256(a, _mm256_and_si256(move_bit(high_bits, 2 * (c % 4), 4), bit4));
                        b = _mm256_or_si256(b, _mm256_and_si256(move_bit(high_bits, 2 * (c % 4) + 1, 4), bit4));
                    } else if (high == 128) {  /* Q6_K: bits 4 j + 2 b, + 1 of the pair's byte, j = c % 2 */
                        if (c % 2 == 0) high_bits = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(plane + 16 * c)));
                        a = _mm256_or_si256(a, _mm256_and_si256(move_bit(high_bits, 4 * (c % 2), 4), bits45));
                        b = _mm256_or_si256(b, _mm256_and_si256(move_bit(high_bits, 4 * (c % 2) + 2, 4), bits45));
                    }
                    _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) {
                        const int16_t *xs = x16 + r * num_cols + LAYOUT_GROUP * g + 4 * c;
                        const __m256i products = _mm256_add_epi32(_mm256_madd_epi16(a, broadcast_pair(xs)),
                                                                  _mm256_madd_epi16(b, broadcast_pair(xs + 2)));
                        dot[r] = _mm256_add_epi32(dot[r], products);
                        /* a chain of adds as written: regrouped (integer adds are associative), every
                         * product of the group would be live at once and spill */
                        __asm__("" : "+x"(dot[r]));
                    }
                    if (format == FORMAT_Q6_K && c % 4 == 3) {  /* sub-block 2 g + c / 4 */
                        const int sub = 2 * g + c / 4;
                        add_sub_block(mb, acc[h], dot, scales_times(d, scales + 16 * sub + 8 * h, 1), bias, s + g,
                                      sum16 + sub, all_groups, 2 * all_groups);
                    }
                }
                if (format == FORMAT_Q6_K) continue;
                if (format == FORMAT_Q5_0) {  /* the group's sum of x16, as one "sub-block" sum */
                    int32_t group_sums[MAX_ROWS];
                    for (int r = 0; r < mb; r++)
                        group_sums[r] = sum16[r * 2 * all_groups + 2 * g] + sum16[r * 2 * all_groups + 2 * g + 1];
                    add_sub_block(mb, acc[h], dot, d, bias, s + g, group_sums, all_groups, 1);
                    continue;
                }
                const __m256 scale = k_quant ? scales_times(d, scales + 16 * g + 8 * h, 0) : d;
                const __m256 offset = k_quant ? scales_times(second, scales + 128 + 16 * g + 8 * h, 0) : second;
                add_sub_block(mb, acc[h], dot, scale, 0, s + g, sum16, all_groups, 0);
                for (int r = 0; r < mb; r++)
                    acc[h][r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(offset_x[r * all_groups + g]), acc[h][r]);
            }
        }
    }
    for (int r = 0; r < mb; r++)
        for (int h = 0; h < 2; h++) {
            const int64_t at = (r0 + r) * out_stride + column + 8 * h;
            if (out_bf16 == NULL) {
                _mm256_storeu_ps(out + at, acc[h][r]);
                continue;
            }
            /* round to nearest even, as float_to_bf16 */
            const __m256i bits = _mm256_castps_si256(acc[h][r]);
            const __m256i rounding = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                                      _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)));
            const __m256i upper = _mm256_srli_epi32(_mm256_add_epi32(bits, rounding), 16);
            const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(upper, upper), 0x08);
            _mm_storeu_si128((__m128i *)(out_bf16 + at), _mm256_castsi256_si128(packed));
        }
}

/* Each format and block size its own unrolled copy of tile_block. */
static void run_block(int format, int mb, const uint8_t *tile, int64_t units, const IntegerRows *rows, int64_t r0,
                      int64_t num_cols, int prefetch, float *out, uint16_t *out_bf16, int64_t out_stride,
                      int64_t column) {
#define BLOCK(FORMAT, MB) \
    if (format == FORMAT && mb == MB) { \
        tile_block(FORMAT, MB, tile, units, rows, r0, num_cols, prefetch, out, out_bf16, out_stride, column); \
        return; \
    }
#define ROWS(FORMAT) BLOCK(FORMAT, 1) BLOCK(FORMAT, 2) BLOCK(FORMAT, 3) BLOCK(FORMAT, 4) \
    BLOCK(FORMAT, 5) BLOCK(FORMAT, 6) BLOCK(FORMAT, 7) BLOCK(FORMAT, 8)
    ROWS(FORMAT_Q4_K) ROWS(FORMAT_Q5_K) ROWS(FORMAT_Q6_K) ROWS(FORMAT_Q5_0) ROWS(FORMAT_Q5_1)
#undef ROWS
#undef BLOCK
}

int64_t kquant_matmul_scratch_bytes_avx2(int64_t m, int64_t num_cols) {
    /* x16, then s and s sum x16 per 32 inputs, then sum x16 per 16 */
    return 64 + m * num_cols * (int64_t)sizeof(int16_t) + m * (num_cols / 32) * 2 * (int64_t)sizeof(float) +
           m * (num_cols / 16) * (int64_t)sizeof(int32_t);
}

void kquant_matmul_tiles_avx2(int format, const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *tiles,
                              int64_t num_rows, int64_t num_cols, float *out, uint16_t *out_bf16, void *scratch,
                              int64_t first_tile, int64_t last_tile) {
    if (m <= 0 || !layout_serves(format) || first_tile >= last_tile) return;
    const IntegerRows rows = integer_rows(x, x_stride, m, num_cols, scratch);
    const int64_t units = num_cols / layout_unit_inputs(format), tile_bytes = units * layout_unit_bytes(format);
    for (int64_t tile = first_tile; tile < last_tile; tile++)
        for (int64_t r0 = 0; r0 < m; r0 += MAX_ROWS) {
            const int mb = m - r0 >= MAX_ROWS ? MAX_ROWS : (int)(m - r0);
            run_block(format, mb, tiles + tile * tile_bytes, units, &rows, r0, num_cols, r0 == 0, out, out_bf16,
                      num_rows, tile * LAYOUT_TILE_ROWS);
        }
}

#endif
