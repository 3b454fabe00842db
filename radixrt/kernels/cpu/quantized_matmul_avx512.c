/*
 * The quantized matmul (quantized_matmul.c) for AVX512-BF16 + VNNI CPUs.
 *
 * 4-bit codes are turned into bf16 integers in registers (exact: q <= 15) by a permute over a
 * table and multiplied with AVX512-BF16 dot products, 32 products an instruction; the decoded
 * codes are reused for every row of a block of M. Products of bf16 values are exact in float32
 * and the codes are exact, so this is the file's weight times x with float32 accumulation.
 *
 * 8-bit codes would cost 8 instructions per 64 weights that way (widen, convert, narrow) and
 * bound the LM head by instructions rather than memory. They take integer dot products instead,
 * used as loaded: VPDPBUSD multiplies 64 unsigned bytes by 64 signed ones and adds them in fours.
 * Each row's inputs become 16-bit integers per group of 32, x ~ s * x16, s = max|x| / X16_MAX,
 * split into two signed bytes, x16 = 256 hi + lo, so a group's sum is s * (256 sum q hi + sum q
 * lo), two dot products per vector of codes, exact in 32 bits. The rounding of x to x16 is at
 * most s / 2 per input, 1/128 of bf16's own spacing near a group's largest input. Bytes alone
 * (x8, s = max|x| / 127) would take one dot product but moved the model's next-token
 * distribution measurably away from the file's; the 4-bit codes keep bf16, two byte planes were
 * no faster for them (docs/kernels.md, "Quantized matmul: activations as integers").
 *
 * The layout's 8-bit vectors are VPDPBUSD's operand layout; a 4-bit chunk decodes to two vectors
 * of (row, 2 inputs) bf16 pairs, the layout of VDPBF16PS.
 */
#include "isa.h"

#if RADIXRT_ISA_AVX512
#include <immintrin.h>
#include <string.h>

#include "quantized_matmul.h"

#define MAX_BLOCK_TILES 4  /* tiles_per_block */
#define MAX_BYTE_BLOCK_TILES 8  /* 8-bit codes: two accumulators a tile (tiles_per_block) */
#define X16_MAX 32639  /* 127 * 256 + 127: hi = (x16 + 128) >> 8 stays in -127..127 */

/* bf16 bit patterns of i & 15: a permute by the 16-bit lanes' low 5 bits decodes a nibble. */
static const uint16_t CODE_TABLE[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
};

static inline uint32_t load_pair(const uint16_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* A block's results, tile t and row r in acc[t][r]: bf16 when out_bf16 is not NULL, else fp32. */
static inline __attribute__((always_inline)) void store_block(
    __m512 acc[][8], int nt, int mb, int64_t tile, float *out, int64_t out_stride, uint16_t *out_bf16
) {
    _Pragma("GCC unroll 16") for (int t = 0; t < nt; t++) {
        _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) {
            int64_t column = (tile + t) * TILE_ROWS;
            if (out_bf16 != NULL) {
                _mm256_storeu_si256((__m256i *)(out_bf16 + r * out_stride + column),
                                    (__m256i)_mm512_cvtneps_pbh(acc[t][r]));
            } else {
                _mm512_storeu_ps(out + r * out_stride + column, acc[t][r]);
            }
        }
    }
}

/*
 * 4-bit codes: NT consecutive tiles times MB rows of x, NT * MB independent chains of dot
 * products (one per tile and row, in a fixed order), so that 6-8 chains hide
 * the instruction's latency: 2-4 tiles at M = 2-4, 1 tile at M >= 5. Each
 * tile's codes are a stream of their own in memory: a single row (a batch-1
 * step, memory-bound) takes up to 4 tiles at once (tiles_per_block).
 */
static inline __attribute__((always_inline)) void nibble_block(
    const uint8_t *tiles, int64_t groups, const uint16_t *x, int64_t x_stride, const float *x_sums,
    int64_t tile, int nt, int mb, float *out, int64_t out_stride, uint16_t *out_bf16
) {
    const int bits = 4;
    const __m512i table = _mm512_loadu_si512(CODE_TABLE);
    __m512 acc[MAX_BLOCK_TILES][8];
    _Pragma("GCC unroll 16") for (int t = 0; t < nt; t++)
        _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) acc[t][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 dots[MAX_BLOCK_TILES][8];
        _Pragma("GCC unroll 16") for (int t = 0; t < nt; t++)
            _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) dots[t][r] = _mm512_setzero_ps();
        for (int c = 0; c < CHUNKS; c++) {
            _Pragma("GCC unroll 16") for (int t = 0; t < nt; t++) {
                const uint8_t *group = tiles + ((tile + t) * groups + g) * BLOCK_BYTES(bits);
                prefetch_next_group(group, bits, c, nt, g, groups, 1);
                __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(group + CHUNK_BYTES(bits) * c)));
                __m512bh low_codes = (__m512bh)_mm512_permutexvar_epi16(bytes, table);
                __m512bh high_codes = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
                _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) {
                    const uint16_t *xs = x + r * x_stride + g * GROUP + 4 * c;
                    dots[t][r] = _mm512_dpbf16_ps(dots[t][r], low_codes, (__m512bh)_mm512_set1_epi32(load_pair(xs)));
                    dots[t][r] = _mm512_dpbf16_ps(dots[t][r], high_codes, (__m512bh)_mm512_set1_epi32(load_pair(xs + 2)));
                }
            }
        }
        _Pragma("GCC unroll 16") for (int t = 0; t < nt; t++) {
            const uint8_t *scales = tiles + ((tile + t) * groups + g) * BLOCK_BYTES(bits) + CHUNKS * CHUNK_BYTES(bits);
            __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
            _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) acc[t][r] = _mm512_fmadd_ps(scale, dots[t][r], acc[t][r]);
            __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 32)));
            _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++)
                acc[t][r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x_sums[r * groups + g]), acc[t][r]);
        }
    }
    store_block(acc, nt, mb, tile, out, out_stride, out_bf16);
}

/*
 * Tiles in the next block for mb rows, `left` tiles to go. Several rows: about 8 chains. One
 * row: 4, 2 or 1 tiles of 4-bit codes (8-bit: 8, 4, 2 or 1), the most there are left, each an
 * independent stream of codes in memory; with the far requests of prefetch_next_group, fewer
 * streams each asked for further ahead read faster than many (docs/kernels.md, "Quantized
 * matmul: tiles a block").
 */
static inline int tiles_per_block(int mb, int bits, int64_t left) {
    if (mb == 1) {
        int nt = bits == 4 ? MAX_BLOCK_TILES : MAX_BYTE_BLOCK_TILES;
        while (nt > left) nt /= 2;
        return nt;
    }
    const int nt = mb == 2 ? 4 : mb <= 4 ? 2 : 1;
    return nt <= left ? nt : 1;
}

typedef struct {
    int8_t *hi, *lo;  /* [m][K]: x16 = 256 hi + lo */
    float *scale;  /* [m][groups]: s */
    int32_t *sum16;  /* [m][groups]: sum x16 */
} ByteRows;

/* The m rows of x as 16-bit integers in two byte planes (see the top of the file). */
static ByteRows byte_rows(const uint16_t *x, int64_t x_stride, int64_t m, int64_t num_cols, void *scratch) {
    const int64_t groups = num_cols / GROUP;
    int8_t *bytes = scratch;
    float *scale = (float *)(bytes + 2 * m * num_cols);
    ByteRows rows = {bytes, bytes + m * num_cols, scale, (int32_t *)(scale + m * groups)};
    const __m512i limit = _mm512_set1_epi32(X16_MAX), low_limit = _mm512_set1_epi32(-X16_MAX);
    for (int64_t r = 0; r < m; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const __m512i raw = _mm512_loadu_si512(x + r * x_stride + g * GROUP);
            const __m512 halves[2] = {  /* bf16 -> float32: the bits shifted up */
                _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16)),
                _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16)),
            };
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(halves[0]), _mm512_abs_ps(halves[1])));
            const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? (float)X16_MAX / amax : 0.0f);
            rows.scale[r * groups + g] = amax / (float)X16_MAX;
            __m512i total = _mm512_setzero_si512();
            for (int h = 0; h < 2; h++) {
                /* |x / s| <= X16_MAX up to the quotient's rounding: clamp before splitting */
                __m512i x16 = _mm512_cvtps_epi32(_mm512_mul_ps(halves[h], inverse));
                x16 = _mm512_max_epi32(_mm512_min_epi32(x16, limit), low_limit);
                const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(x16, _mm512_set1_epi32(128)), 8);
                const int64_t at = r * num_cols + g * GROUP + 16 * h;
                _mm_storeu_si128((__m128i *)(rows.hi + at), _mm512_cvtepi32_epi8(hi));
                const __m512i lo = _mm512_sub_epi32(x16, _mm512_slli_epi32(hi, 8));
                _mm_storeu_si128((__m128i *)(rows.lo + at), _mm512_cvtepi32_epi8(lo));
                total = _mm512_add_epi32(total, x16);
            }
            rows.sum16[r * groups + g] = _mm512_reduce_add_epi32(total);
        }
    }
    return rows;
}

/* Bytes k .. k + 3 of a plane in every 32-bit lane. */
static inline __m512i broadcast4(const int8_t *plane) {
    int32_t v;
    memcpy(&v, plane, sizeof v);
    return _mm512_set1_epi32(v);
}

/*
 * 8-bit codes: NT consecutive tiles times MB rows of x, in integers (see the top of the file).
 * For each group, vector by vector, the block's tiles in turn, so that their streams advance
 * together; a single row takes up to 8 tiles (two accumulators a tile and row: 16 fill half the
 * vector registers).
 */
static inline __attribute__((always_inline)) void byte_block(
    const uint8_t *tiles, int64_t groups, int64_t num_cols, const ByteRows *rows, int64_t tile, int nt, int mb,
    float *out, int64_t out_stride, uint16_t *out_bf16
) {
    const int64_t tile_stride = groups * BLOCK_BYTES(8);
    __m512 acc[MAX_BYTE_BLOCK_TILES][8];
    _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++)
        _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) acc[t][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group = tiles + (tile * groups + g) * BLOCK_BYTES(8);
        __m512i dot_hi[MAX_BYTE_BLOCK_TILES][8], dot_lo[MAX_BYTE_BLOCK_TILES][8];
        _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++)
            _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) dot_hi[t][r] = dot_lo[t][r] = _mm512_setzero_si512();
        _Pragma("GCC unroll 8") for (int c = 0; c < CHUNKS; c++) {
            _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++) {
                prefetch_next_group(group + t * tile_stride, 8, c, nt, g, groups, 1);
                const __m512i codes = _mm512_loadu_si512(group + t * tile_stride + CHUNK_BYTES(8) * c);
                _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) {
                    const int64_t at = r * num_cols + g * GROUP + 4 * c;
                    dot_hi[t][r] = _mm512_dpbusd_epi32(dot_hi[t][r], codes, broadcast4(rows->hi + at));
                    dot_lo[t][r] = _mm512_dpbusd_epi32(dot_lo[t][r], codes, broadcast4(rows->lo + at));
                }
            }
        }
        _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++) {
            const uint8_t *scales = group + t * tile_stride + CHUNKS * CHUNK_BYTES(8);
            const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
            _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) {
                /* sum (q + 128) x16 - 128 sum x16 = sum q x16, |.| < 2^28 */
                const int64_t at = r * groups + g;
                const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(dot_hi[t][r], 8), dot_lo[t][r]),
                                                     _mm512_set1_epi32(rows->sum16[at] * 128));
                acc[t][r] = _mm512_fmadd_ps(_mm512_mul_ps(scale, _mm512_set1_ps(rows->scale[at])),
                                            _mm512_cvtepi32_ps(dot), acc[t][r]);
            }
        }
    }
    store_block(acc, nt, mb, tile, out, out_stride, out_bf16);
}

/* The block shapes and code widths, each its own unrolled code. */
static void run_block(const uint8_t *tiles, int64_t groups, int64_t num_cols, const uint16_t *x, int64_t x_stride,
                      const float *x_sums, const ByteRows *rows, int64_t tile, int nt, int mb, int bits, float *out,
                      uint16_t *out_bf16, int64_t out_stride) {
#define NIBBLES(NT, MB) \
    if (bits == 4 && nt == NT && mb == MB) { \
        nibble_block(tiles, groups, x, x_stride, x_sums, tile, NT, MB, out, out_stride, out_bf16); \
        return; \
    }
#define BYTES(NT, MB) \
    if (bits == 8 && nt == NT && mb == MB) { \
        byte_block(tiles, groups, num_cols, rows, tile, NT, MB, out, out_stride, out_bf16); \
        return; \
    }
#define SHAPES(CASE) \
    CASE(4, 1) CASE(2, 1) CASE(4, 2) CASE(2, 3) CASE(2, 4) \
    CASE(1, 1) CASE(1, 2) CASE(1, 3) CASE(1, 4) CASE(1, 5) CASE(1, 6) CASE(1, 7) CASE(1, 8)
    SHAPES(NIBBLES) BYTES(8, 1) SHAPES(BYTES)
#undef SHAPES
#undef BYTES
#undef NIBBLES
}

/* The 4-bit offsets' factor: each row's sum over each group of 32 inputs. */
static void group_sums(const uint16_t *x, int64_t x_stride, int64_t m, int64_t groups, float *x_sums) {
    const __m512 ones = _mm512_castsi512_ps(_mm512_set1_epi16((short)0x3F80));
    for (int64_t r = 0; r < m; r++) {
        for (int64_t g = 0; g < groups; g++) {
            __m512bh values = (__m512bh)_mm512_loadu_si512(x + r * x_stride + g * GROUP);
            x_sums[r * groups + g] = _mm512_reduce_add_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), values, (__m512bh)ones));
        }
    }
}

void radixrt_quantized_matmul_tiles_avx512(
    const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *tiles, int bits, int64_t num_rows,
    int64_t num_cols, float *out, uint16_t *out_bf16, void *scratch, int64_t first, int64_t last
) {
    const int64_t groups = num_cols / GROUP;
    float *x_sums = scratch;
    ByteRows all = {0};
    if (bits == 4) group_sums(x, x_stride, m, groups, x_sums);
    else all = byte_rows(x, x_stride, m, num_cols, scratch);
    /* Within the run of tiles, a block of tiles is multiplied by every block of 8 rows while its
     * codes are in cache, so the weights are read from memory once. */
    for (int64_t tile = first, nt; tile < last; tile += nt) {
        nt = m <= 8 ? tiles_per_block((int)m, bits, last - tile) : 1;
        for (int64_t r = 0; r < m; r += 8) {
            int mb = m - r >= 8 ? 8 : (int)(m - r);
            const ByteRows rows = bits == 8 ? (ByteRows){all.hi + r * num_cols, all.lo + r * num_cols,
                                                         all.scale + r * groups, all.sum16 + r * groups}
                                            : all;  /* 4-bit: none (and no arithmetic on their NULLs) */
            float *out_rows = out == NULL ? NULL : out + r * num_rows;
            uint16_t *out_rows_bf16 = out_bf16 == NULL ? NULL : out_bf16 + r * num_rows;
            run_block(tiles, groups, num_cols, x + r * x_stride, x_stride, x_sums + r * groups, &rows, tile, (int)nt,
                      mb, bits, out_rows, out_rows_bf16, num_rows);
        }
    }
}

#endif
