/*
 * AVX-512 product over format_layout.h's tiles (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1): kquant_matmul_avx2.c's
 * arithmetic with AVX512-VNNI integer dot products, 16 output rows a vector.
 *
 * Each row's inputs become 16-bit integers per group of 32 (x ~ s x16, s = max|x| / 32767, x16 =
 * round(x / s)), as the AVX2 kernel rounds them. A chunk's codes are decoded in registers to
 * int16 lanes L = 2 n + e by a permute of a table of q - bias (kquant_avx512.h: the index is the
 * nibble with its high bits above it, so Q6_K's q - 32 and Q5_0's q - 16 come out of the table),
 * and VPDPWSSD adds each lane pair's products with a broadcast (x16, x16) pair into row n's
 * 32-bit lane: the sums are exact integers (|q x16| < 2^21, 32 of them a sum). Per sub-block and
 * output, in float32,
 *
 *     acc += (d sc) * (s * float(sum (q - bias) x16))  +  offset * (s * sum_group x16)
 *
 * offset -dmin m (Q4_K, Q5_K) or m (Q5_1), in the AVX2 kernel's order: the two builds' results are
 * the same bits. Exact integer sums make a row's result independent of how the work is blocked:
 * every row runs the same float32 steps in the same order whatever M, the block shape, the tile
 * range and the threads, so a row's result does not depend on its batch.
 *
 * Blocks of tiles times up to MAX_ROWS rows of x, each decoded chunk used by every row of the
 * block; each tile's stream of codes asked for ahead of its loads. Where the CPU has AMX, the
 * rows amx_rows names (whole blocks of AMX_ROWS, and a last partial block of enough rows) go to
 * kquant_matmul_amx.c's tiles instead: the same integers, the same bits.
 */
#include <stdint.h>
#include <string.h>

#include "format_layout.h"
#include "isa.h"

#if RADIXRT_ISA_AVX512
#include "kquant_avx512.h"

#define MAX_TILES 4
#define MAX_ROWS 8
#define X16_MAX 32767
#define TINY 0x1p-64f  /* groups below it count as zeros: X16_MAX / max|x| stays finite */

/* The m rows of x as 16-bit integers per group of 32, with each group's s and s times its sum of
 * x16: kquant_matmul_avx2.c's integer_rows, value for value. */
static IntegerRows integer_rows(const uint16_t *x, int64_t x_stride, int64_t m, int64_t num_cols, void *scratch,
                                int64_t planes) {  /* planes: the rows to write byte planes of */
    const int64_t groups = num_cols / LAYOUT_GROUP;
    int16_t *x16 = (int16_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    float *scale = (float *)(x16 + m * num_cols), *offset_x = scale + m * groups;
    int8_t *high = planes ? (int8_t *)(offset_x + m * groups) : NULL;
    uint8_t *low = planes ? (uint8_t *)(high + planes * num_cols) : NULL;
    if (planes > m) {  /* a partial last block's missing rows: zeros, so its tiles read no stale bytes */
        memset(high + (planes - AMX_ROWS) * num_cols, 0, (size_t)(AMX_ROWS * num_cols));
        memset(low + (planes - AMX_ROWS) * num_cols, 0, (size_t)(AMX_ROWS * num_cols));
    }
    for (int64_t r = 0; r < m; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *xs = x + r * x_stride + g * LAYOUT_GROUP;
            __m512 v[2];
            for (int i = 0; i < 2; i++)
                v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xs + 16 * i))), 16));
            const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
            const int zero = !(largest >= TINY);
            /* |x / s| <= X16_MAX up to the quotient's rounding; the narrowing saturates besides */
            const __m512 inverse = _mm512_set1_ps(zero ? 0.0f : (float)X16_MAX / largest);
            __m512i q[2];
            for (int i = 0; i < 2; i++) {
                q[i] = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inverse));
                const __m256i narrow = _mm512_cvtsepi32_epi16(q[i]);
                const int64_t at = r * num_cols + g * LAYOUT_GROUP + 16 * i;
                _mm256_storeu_si256((__m256i *)(x16 + at), narrow);
                if (r < planes) {
                    const int64_t byte = plane_at(r, g * LAYOUT_GROUP + 16 * i, num_cols);
                    _mm_storeu_si128((__m128i *)(high + byte), _mm256_cvtepi16_epi8(_mm256_srai_epi16(narrow, 8)));
                    _mm_storeu_si128((__m128i *)(low + byte), _mm256_cvtepi16_epi8(narrow));  /* truncated: the low byte */
                }
            }
            const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q[0], q[1]));
            const float s = zero ? 0.0f : largest / (float)X16_MAX;
            scale[r * groups + g] = s;
            offset_x[r * groups + g] = s * (float)sum;  /* |sum| < 2^21: exact */
        }
    }
    return (IntegerRows){x16, scale, offset_x, high, low};
}

static inline __m512i broadcast_pair(const int16_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

/*
 * Each tile's stream is asked for PREFETCH_BYTES / nt bytes on (near, the non-temporal hint), so
 * that a block keeps about as much in flight as quantized_matmul.c's 4-bit kernel, and three
 * times as far into L2 as well, for one row or many: one request per load, line
 * `line` of the unit on from this one (a unit has no more lines than loads, so the requests keep
 * pace with the reads). Requests that would pass the tile's end go to the next block's tile
 * instead of the tile after (already in this block). quantized_matmul.c's prefetch_next_group
 * says why each of these holds.
 */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *unit, int format, int line, int nt,
                                                                int64_t u, int64_t units) {
    const int unit_bytes = layout_unit_bytes(format);
    if (64 * line >= unit_bytes) return;
    const int64_t near = PREFETCH_BYTES / nt, at = u * unit_bytes + 64 * line, tile_bytes = units * unit_bytes;
    const int64_t wrap_near = at + near >= tile_bytes ? (int64_t)(nt - 1) * tile_bytes : 0;
    const int64_t wrap_far = at + 3 * near >= tile_bytes ? (int64_t)(nt - 1) * tile_bytes : 0;
    _mm_prefetch((const char *)unit + 64 * line + near + wrap_near, _MM_HINT_NTA);
    _mm_prefetch((const char *)unit + 64 * line + 3 * near + wrap_far, _MM_HINT_T1);
}

/* A block's results, tile t and row r in acc[t][r]: bf16 when out_bf16 is not NULL, else fp32. */
static inline __attribute__((always_inline)) void store_block(__m512 acc[][MAX_ROWS], int nt, int mb, int64_t tile,
                                                              float *out, int64_t out_stride, uint16_t *out_bf16) {
    _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++) {
        _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) {
            const int64_t column = (tile + t) * LAYOUT_TILE_ROWS;
            if (out_bf16 != NULL)
                _mm256_storeu_si256((__m256i *)(out_bf16 + r * out_stride + column), (__m256i)_mm512_cvtneps_pbh(acc[t][r]));
            else
                _mm512_storeu_ps(out + r * out_stride + column, acc[t][r]);
        }
    }
}

/* NT consecutive tiles times rows [r0, r0 + MB) of x: NT * MB independent chains of dot products. */
static inline __attribute__((always_inline)) void format_block(
    int format, const uint8_t *tiles, int64_t units, const IntegerRows *rows, int64_t r0, int64_t num_cols,
    int64_t tile, int nt, int mb, const Table *table, float *out, int64_t out_stride, uint16_t *out_bf16
) {
    const int unit_bytes = layout_unit_bytes(format), unit_groups = layout_groups(format);
    const int high_bytes = layout_high_bytes(format), inputs = layout_unit_inputs(format);
    const int64_t tile_bytes = units * unit_bytes, all_groups = num_cols / LAYOUT_GROUP;
    __m512 acc[MAX_TILES][MAX_ROWS];
    _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++)
        _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) acc[t][r] = _mm512_setzero_ps();
    for (int64_t u = 0; u < units; u++) {
        const uint8_t *unit = tiles + tile * tile_bytes + u * unit_bytes;
        const int16_t *x16 = rows->x16 + r0 * num_cols + u * inputs;
        const float *s = rows->scale + r0 * all_groups + u * unit_groups;
        const float *offset_x = rows->offset_x + r0 * all_groups + u * unit_groups;
        for (int g = 0; g < unit_groups; g++) {
            __m512i dots[MAX_TILES][MAX_ROWS], high[MAX_TILES];
            _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++) {
                high[t] = _mm512_setzero_si512();
                _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) dots[t][r] = _mm512_setzero_si512();
            }
            _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) {
                _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++) {
                    const uint8_t *own = unit + t * tile_bytes;
                    prefetch_ahead(own, format, 8 * g + c, nt, u, units);
                    const uint8_t *plane = own + layout_high_at(format) + high_bytes * g;
                    if (high_bytes == 64 && c % 4 == 0)
                        high[t] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(plane + 32 * (c / 4))));
                    if (high_bytes == 128 && c % 2 == 0)
                        high[t] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(plane + 32 * (c / 2))));
                    const __m512i bytes = _mm512_cvtepu8_epi16(
                        _mm256_loadu_si256((const __m256i *)(own + LAYOUT_NIBBLE_BYTES * g + 32 * c)));
                    __m512bh a, b;
                    decode_chunk(format, bytes, high[t], c, table, &a, &b);
                    _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) {
                        const int16_t *xs = x16 + r * num_cols + LAYOUT_GROUP * g + 4 * c;
                        dots[t][r] = _mm512_dpwssd_epi32(dots[t][r], (__m512i)a, broadcast_pair(xs));
                        dots[t][r] = _mm512_dpwssd_epi32(dots[t][r], (__m512i)b, broadcast_pair(xs + 2));
                    }
                }
                if (format == FORMAT_Q6_K && c == 3)  /* the group's first sub-block of 16 */
                    _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++)
                        scale_into(format, unit + t * tile_bytes, 2 * g, g, acc[t], dots[t], mb, s, NULL, all_groups);
            }
            const int sub = format == FORMAT_Q6_K ? 2 * g + 1 : g;
            _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++)
                scale_into(format, unit + t * tile_bytes, sub, g, acc[t], dots[t], mb, s, offset_x, all_groups);
        }
    }
    store_block(acc, nt, mb, tile, out, out_stride, out_bf16);
}

/* Tiles in the next block for mb rows, `left` tiles to go (quantized_matmul.c's tiles_per_block). */
static inline int tiles_per_block(int mb, int64_t left) {
    int nt = mb <= 2 ? MAX_TILES : mb <= 4 ? 2 : 1;
    while (nt > left) nt /= 2;
    return nt;
}

static void run_block(int format, const uint8_t *tiles, int64_t units, const IntegerRows *rows, int64_t r0,
                      int64_t num_cols, int64_t tile, int nt, int mb, const Table *table, float *out,
                      int64_t out_stride, uint16_t *out_bf16) {
#define BLOCK(F, NT, MB) \
    if (format == F && nt == NT && mb == MB) { \
        format_block(F, tiles, units, rows, r0, num_cols, tile, NT, MB, table, out, out_stride, out_bf16); \
        return; \
    }
#define SHAPES(F) \
    BLOCK(F, 4, 1) BLOCK(F, 2, 1) BLOCK(F, 1, 1) BLOCK(F, 4, 2) BLOCK(F, 2, 2) BLOCK(F, 1, 2) BLOCK(F, 2, 3) \
    BLOCK(F, 1, 3) BLOCK(F, 2, 4) BLOCK(F, 1, 4) BLOCK(F, 1, 5) BLOCK(F, 1, 6) BLOCK(F, 1, 7) BLOCK(F, 1, 8)
    SHAPES(FORMAT_Q4_K) SHAPES(FORMAT_Q6_K) SHAPES(FORMAT_Q5_K) SHAPES(FORMAT_Q5_0) SHAPES(FORMAT_Q5_1)
#undef SHAPES
#undef BLOCK
}

int64_t kquant_matmul_scratch_bytes_avx512(int64_t m, int64_t num_cols) {
    /* x16, then s and s sum x16 per 32 inputs; for the AMX tiles the byte planes and theirs */
    return 64 + m * num_cols * (int64_t)sizeof(int16_t) + m * (num_cols / LAYOUT_GROUP) * 2 * (int64_t)sizeof(float) +
           (m >= AMX_ROWS ? 2 * amx_padded(m) * num_cols + kquant_amx_scratch_bytes(num_cols) : 0);
}

void kquant_matmul_tiles_avx512(int format, const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *tiles,
                                int64_t num_rows, int64_t num_cols, float *out, uint16_t *out_bf16, void *scratch,
                                int64_t first_tile, int64_t last_tile) {
    if (m <= 0 || !layout_serves(format) || first_tile >= last_tile) return;
    const int64_t full = kquant_amx_usable() ? amx_rows(m) : 0;  /* the tiles' rows */
    const IntegerRows rows = integer_rows(x, x_stride, m, num_cols, scratch, amx_padded(full));
    const int64_t units = num_cols / layout_unit_inputs(format);
    const Table table = integer_table(format);
    if (full > 0)
        kquant_amx_tiles(format, tiles, &rows, full, num_cols, first_tile, last_tile,
                         (void *)(rows.low + amx_padded(full) * num_cols), out, num_rows, out_bf16);
    /* The rest: a block of tiles is multiplied by every block of rows while its codes are in cache. */
    for (int64_t tile = first_tile, nt; tile < last_tile; tile += nt) {
        nt = m - full <= MAX_ROWS ? tiles_per_block((int)(m - full), last_tile - tile) : 1;
        for (int64_t r = full; r < m; r += MAX_ROWS) {
            const int mb = m - r >= MAX_ROWS ? MAX_ROWS : (int)(m - r);
            run_block(format, tiles, units, &rows, r, num_cols, tile, (int)nt, mb, &table,
                      out == NULL ? NULL : out + r * num_rows, num_rows, out_bf16 == NULL ? NULL : out_bf16 + r * num_rows);
        }
    }
}

#endif
