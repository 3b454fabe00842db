/*
 * The quantized matmul (quantized_matmul.c) for AVX2 + FMA + F16C CPUs.
 *
 * AVX2 has no bf16 dot product, so activations become integers: each row's inputs, per group of
 * 32, x ~ s * x16 with s = max|x| / 32767 and x16 = round(x / s) in int16, and a group's sum is
 * s * sum q x16, the codes widened to int16 and multiplied with VPMADDWD (pairs of 16-bit
 * products added into 32-bit lanes). The integer sum is exact: |q x16| <= 128 * 32767 and a group
 * has 32 of them, below 2^31. Per group and output, in float32:
 *     acc += (d * s) * float(sum q x16);   4-bit only: acc += m * sum_{k in g} x_k
 * with sum x in float32 over the bf16 inputs. Rounding x to x16 moves each input by at most s / 2,
 * 1/256 of bf16's own spacing near the group's largest input: the products are closer to the
 * file's weights times x than bf16 activations would be.
 *
 * Blocks: NT tiles times MB rows of x, each output's chain of operations the same in every block
 * shape (integer sums, then the two float32 steps above in group order), so a row's result does
 * not depend on M or the range of tiles. The weight is streamed with the prefetches of the
 * AVX-512 version (quantized_matmul.h).
 */
#include "isa.h"

#if RADIXRT_ISA_AVX2
#include <immintrin.h>

#include "avx2_lanes.h"
#include <string.h>

#include "quantized_matmul.h"
#include "scalar.h"

#define X16_MAX 32767

typedef struct {
    int16_t *x16;  /* [m][K] */
    float *scale;  /* [m][groups]: s */
    float *sum;  /* [m][groups]: sum x, float32 (4-bit offsets) */
} IntegerRows;


/* The m rows of x as 16-bit integers per group, with each group's s and (float32) sum of x. */
static IntegerRows integer_rows(const uint16_t *x, int64_t x_stride, int64_t m, int64_t num_cols, void *scratch) {
    const int64_t groups = num_cols / GROUP;
    IntegerRows rows = {scratch, NULL, NULL};
    rows.scale = (float *)(rows.x16 + m * num_cols);
    rows.sum = rows.scale + m * groups;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i limit = _mm256_set1_epi32(X16_MAX), low_limit = _mm256_set1_epi32(-X16_MAX);
    for (int64_t r = 0; r < m; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *xs = x + r * x_stride + g * GROUP;
            __m256 v[4];
            for (int i = 0; i < 4; i++) v[i] = widen_bf16(xs + 8 * i);
            const __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                              _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
            const float largest = horizontal_max(amax);
            const __m256 inverse = _mm256_set1_ps(largest > 0.0f ? (float)X16_MAX / largest : 0.0f);
            rows.scale[r * groups + g] = largest / (float)X16_MAX;
            rows.sum[r * groups + g] = horizontal_sum_ps(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
            __m256i q[4];
            for (int i = 0; i < 4; i++)  /* |x / s| <= X16_MAX up to the quotient's rounding: clamp */
                q[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse)), limit), low_limit);
            for (int i = 0; i < 2; i++)  /* packs works within 128-bit lanes: put the quarters back in order */
                _mm256_storeu_si256((__m256i *)(rows.x16 + r * num_cols + g * GROUP + 16 * i),
                                    _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * i], q[2 * i + 1]), 0xD8));
        }
    }
    return rows;
}

static inline __m256i broadcast_pair(const int16_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

static inline __m256i broadcast_quad(const int16_t *p) {
    int64_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi64x(v);
}

/* A block's results, tile t and row r in acc[t][r][half] (tile rows 8 half ..): bf16 or fp32. */
static inline __attribute__((always_inline)) void store_block(__m256 acc[][4][2], int nt, int mb, int64_t tile, float *out,
                                                              int64_t out_stride, uint16_t *out_bf16) {
    _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++)
        _Pragma("GCC unroll 4") for (int r = 0; r < mb; r++)
            _Pragma("GCC unroll 4") for (int h = 0; h < 2; h++) {
                const int64_t at = r * out_stride + (tile + t) * TILE_ROWS + 8 * h;
                if (out_bf16 == NULL) {
                    _mm256_storeu_ps(out + at, acc[t][r][h]);
                } else {
                    float values[8];
                    _mm256_storeu_ps(values, acc[t][r][h]);
                    _Pragma("GCC unroll 4") for (int i = 0; i < 8; i++) out_bf16[at + i] = float_to_bf16(values[i]);
                }
            }
}

/* acc += (d * s) * float(dot) for one tile and row's 16 outputs, from the block's fp16 scales. */
static inline __attribute__((always_inline)) void scale_add(const uint8_t *halves, float s, const __m256i dot[2],
                                                            __m256 acc[2]) {
    _Pragma("GCC unroll 4") for (int h = 0; h < 2; h++) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(halves + 16 * h)));
        acc[h] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(s)), _mm256_cvtepi32_ps(dot[h]), acc[h]);
    }
}

/* 4-bit codes: a chunk's 32 bytes are (row, e) pairs, 16 rows; low nibbles inputs 4c + e, high 4c + 2 + e. */
static inline __attribute__((always_inline)) void nibble_block(
    const uint8_t *tiles, int64_t groups, int64_t num_cols, const IntegerRows *rows, int64_t tile, int nt, int mb,
    float *out, int64_t out_stride, uint16_t *out_bf16
) {
    const int64_t tile_stride = groups * BLOCK_BYTES(4);
    const __m256i nibble = _mm256_set1_epi16(15);
    __m256 acc[2][4][2];
    _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++)
        _Pragma("GCC unroll 4") for (int r = 0; r < mb; r++) acc[t][r][0] = acc[t][r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group = tiles + (tile * groups + g) * BLOCK_BYTES(4);
        __m256i dot[2][4][2];
        _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++)
            _Pragma("GCC unroll 4") for (int r = 0; r < mb; r++) dot[t][r][0] = dot[t][r][1] = _mm256_setzero_si256();
        for (int c = 0; c < CHUNKS; c++) {
            _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++) {
                prefetch_next_group(group + t * tile_stride, 4, c, nt, g, groups, 1);
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(group + t * tile_stride + CHUNK_BYTES(4) * c));
                __m256i low[2], high[2];
                _Pragma("GCC unroll 4") for (int h = 0; h < 2; h++) {
                    const __m256i wide = _mm256_cvtepu8_epi16(h ? _mm256_extracti128_si256(raw, 1) : _mm256_castsi256_si128(raw));
                    low[h] = _mm256_and_si256(wide, nibble);
                    high[h] = _mm256_srli_epi16(wide, 4);
                }
                _Pragma("GCC unroll 4") for (int r = 0; r < mb; r++) {
                    const int16_t *xs = rows->x16 + r * num_cols + g * GROUP + 4 * c;
                    const __m256i first = broadcast_pair(xs), second = broadcast_pair(xs + 2);
                    _Pragma("GCC unroll 4") for (int h = 0; h < 2; h++)
                        dot[t][r][h] = _mm256_add_epi32(dot[t][r][h], _mm256_add_epi32(_mm256_madd_epi16(low[h], first),
                                                                                      _mm256_madd_epi16(high[h], second)));
                }
            }
        }
        _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++) {
            const uint8_t *halves = group + t * tile_stride + CHUNKS * CHUNK_BYTES(4);
            _Pragma("GCC unroll 4") for (int r = 0; r < mb; r++) {
                scale_add(halves, rows->scale[r * groups + g], dot[t][r], acc[t][r]);
                const __m256 x_sum = _mm256_set1_ps(rows->sum[r * groups + g]);
                _Pragma("GCC unroll 4") for (int h = 0; h < 2; h++) {
                    const __m256 offset = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(halves + 32 + 16 * h)));
                    acc[t][r][h] = _mm256_fmadd_ps(offset, x_sum, acc[t][r][h]);
                }
            }
        }
    }
    store_block(acc, nt, mb, tile, out, out_stride, out_bf16);
}

/* 8-bit codes: vector c's 64 bytes are 16 rows of 4 inputs 4c + j, stored q + 128. Each quarter
 * (4 rows) widens to int16 and meets x16's 4 inputs, leaving two partial sums a row, added at the
 * group's end (exact). */
static inline __attribute__((always_inline)) void byte_block(
    const uint8_t *tiles, int64_t groups, int64_t num_cols, const IntegerRows *rows, int64_t tile, int nt, int mb,
    float *out, int64_t out_stride, uint16_t *out_bf16
) {
    const int64_t tile_stride = groups * BLOCK_BYTES(8);
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[2][4][2];
    _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++)
        _Pragma("GCC unroll 4") for (int r = 0; r < mb; r++) acc[t][r][0] = acc[t][r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group = tiles + (tile * groups + g) * BLOCK_BYTES(8);
        __m256i parts[2][4][4];
        _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++)
            _Pragma("GCC unroll 4") for (int r = 0; r < mb; r++)
                _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) parts[t][r][i] = _mm256_setzero_si256();
        for (int c = 0; c < CHUNKS; c++) {
            _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++) {
                prefetch_next_group(group + t * tile_stride, 8, c, nt, g, groups, 1);
                const uint8_t *codes = group + t * tile_stride + CHUNK_BYTES(8) * c;
                __m256i q[4];
                _Pragma("GCC unroll 4") for (int half = 0; half < 2; half++) {
                    const __m256i raw = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(codes + 32 * half)), flip);
                    q[2 * half] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(raw));
                    q[2 * half + 1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(raw, 1));
                }
                _Pragma("GCC unroll 4") for (int r = 0; r < mb; r++) {
                    const __m256i xs = broadcast_quad(rows->x16 + r * num_cols + g * GROUP + 4 * c);
                    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) parts[t][r][i] = _mm256_add_epi32(parts[t][r][i], _mm256_madd_epi16(q[i], xs));
                }
            }
        }
        _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++)
            _Pragma("GCC unroll 4") for (int r = 0; r < mb; r++) {
                __m256i dot[2];
                _Pragma("GCC unroll 4") for (int h = 0; h < 2; h++)  /* rows 8h .. 8h + 7 in order */
                    dot[h] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(parts[t][r][2 * h], parts[t][r][2 * h + 1]), 0xD8);
                scale_add(group + t * tile_stride + CHUNKS * CHUNK_BYTES(8), rows->scale[r * groups + g], dot, acc[t][r]);
            }
    }
    store_block(acc, nt, mb, tile, out, out_stride, out_bf16);
}

static void run_block(const uint8_t *tiles, int64_t groups, int64_t num_cols, const IntegerRows *rows, int64_t tile,
                      int nt, int mb, int bits, float *out, uint16_t *out_bf16, int64_t out_stride) {
#define CASE(BITS, FN, NT, MB) \
    if (bits == BITS && nt == NT && mb == MB) { \
        FN(tiles, groups, num_cols, rows, tile, NT, MB, out, out_stride, out_bf16); \
        return; \
    }
    CASE(4, nibble_block, 2, 1) CASE(4, nibble_block, 1, 1) CASE(4, nibble_block, 1, 2) CASE(4, nibble_block, 1, 3)
    CASE(4, nibble_block, 1, 4) CASE(8, byte_block, 2, 1) CASE(8, byte_block, 1, 1) CASE(8, byte_block, 1, 2)
#undef CASE
}

void radixrt_quantized_matmul_tiles_avx2(
    const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *tiles, int bits, int64_t num_rows,
    int64_t num_cols, float *out, uint16_t *out_bf16, void *scratch, int64_t first, int64_t last
) {
    const int64_t groups = num_cols / GROUP;
    const int row_block = bits == 4 ? 4 : 2;
    const IntegerRows all = integer_rows(x, x_stride, m, num_cols, scratch);
    /* A single row streams two tiles at once; several rows take one tile, in blocks of rows
     * while its codes are in cache. */
    for (int64_t tile = first, nt; tile < last; tile += nt) {
        nt = m == 1 && last - tile >= 2 ? 2 : 1;
        for (int64_t r = 0; r < m; r += row_block) {
            const int mb = m - r >= row_block ? row_block : (int)(m - r);
            const IntegerRows rows = {all.x16 + r * num_cols, all.scale + r * groups, all.sum + r * groups};
            run_block(tiles, groups, num_cols, &rows, tile, (int)nt, mb, bits, out == NULL ? NULL : out + r * num_rows,
                      out_bf16 == NULL ? NULL : out_bf16 + r * num_rows, num_rows);
        }
    }
}

#endif
