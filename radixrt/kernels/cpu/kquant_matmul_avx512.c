/*
 * AVX512-BF16 product over format_layout.h's tiles (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1), shaped as
 * quantized_matmul.c's 4-bit kernel: codes decoded to bf16 integers in registers by a permute of
 * a table, VDPBF16PS with (row, 2 inputs) lanes against broadcast bf16 input pairs, blocks of
 * tiles times up to 8 rows of x, each tile's stream of codes asked for ahead of its loads.
 *
 * A lane's index into the table is its nibble with its high bits above it: one vpternlog picks
 * the nibble's 4 bits and the bits above from the high plane shifted into place (the permutes
 * read only the index's low 5 bits, 32 entries: Q5's q, or q - 16 for Q5_0; VPERMT2W its low 6,
 * 64 entries: Q6_K's q - 32). So the codes are exact small integers, their products with bf16
 * inputs exact in float32, and each sub-block's float32 sum is scaled once:
 *
 *     acc += (d sc) * sum q x  -  (dmin m) * sum x      (Q6_K: per 16 inputs, no second term)
 *
 * d sc and dmin m are exact in float32. Every row runs the same instruction sequence whatever
 * M, the block shape and the tile range are, so a row's result does not depend on its batch.
 */
#include <stdint.h>
#include <string.h>

#include "format_layout.h"
#include "isa.h"

#if RADIXRT_ISA_AVX512
#include "kquant_avx512.h"

#define MAX_TILES 4
#define MAX_ROWS 8
#define PREFETCH_BYTES 5120  /* a block's bytes in flight, as quantized_matmul.c's 4-bit kernel */

static inline uint32_t load_pair(const uint16_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/*
 * Each tile's stream is asked for PREFETCH_BYTES / nt bytes on (near, the non-temporal hint), so
 * that a block keeps about as much in flight as quantized_matmul.c's 4-bit kernel, and with a
 * single row (memory-bound) three times as far into L2 as well: one request per load, line
 * `line` of the unit on from this one (a unit has no more lines than loads, so the requests keep
 * pace with the reads). Requests that would pass the tile's end go to the next block's tile
 * instead of the tile after (already in this block). quantized_matmul.c's prefetch_next_group
 * says why each of these holds.
 */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *unit, int format, int line, int nt,
                                                                int64_t u, int64_t units, int far) {
    const int unit_bytes = layout_unit_bytes(format);
    if (64 * line >= unit_bytes) return;
    const int64_t near = PREFETCH_BYTES / nt, at = u * unit_bytes + 64 * line, tile_bytes = units * unit_bytes;
    const int64_t wrap_near = at + near >= tile_bytes ? (int64_t)(nt - 1) * tile_bytes : 0;
    _mm_prefetch((const char *)unit + 64 * line + near + wrap_near, _MM_HINT_NTA);
    if (far) {
        const int64_t wrap_far = at + 3 * near >= tile_bytes ? (int64_t)(nt - 1) * tile_bytes : 0;
        _mm_prefetch((const char *)unit + 64 * line + 3 * near + wrap_far, _MM_HINT_T1);
    }
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

/* acc[r] += scale * dots[r] for sub-block `sub` of the unit, and the offset term */
static inline __attribute__((always_inline)) void scale_into(int format, const uint8_t *unit, int sub,
                                                             __m512 *acc, __m512 *dots, int mb, const float *x_sums,
                                                             int64_t groups) {
    __m512 offset = _mm512_setzero_ps();
    const __m512 scale = sub_scales(format, unit, sub, &offset);
    _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) acc[r] = _mm512_fmadd_ps(scale, dots[r], acc[r]);
    if (format == FORMAT_Q5_1) {
        _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++)
            acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x_sums[r * groups + sub]), acc[r]);
    } else if (layout_has_offset(format)) {
        _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++)
            acc[r] = _mm512_fnmadd_ps(offset, _mm512_set1_ps(x_sums[r * groups + sub]), acc[r]);
    }
}

/*
 * NT consecutive tiles times MB rows of x: NT * MB independent chains of dot products. x_sums:
 * this block's rows' sums per group of 32 (the offset formats), already advanced to the unit.
 */
static inline __attribute__((always_inline)) void format_block(
    int format, const uint8_t *tiles, int64_t units, const uint16_t *x, int64_t x_stride, const float *x_sums,
    int64_t groups, int64_t tile, int nt, int mb, const Table *table, float *out, int64_t out_stride,
    uint16_t *out_bf16
) {
    const int unit_bytes = layout_unit_bytes(format), unit_groups = layout_groups(format);
    const int high_bytes = layout_high_bytes(format), inputs = layout_unit_inputs(format);
    const int64_t tile_bytes = units * unit_bytes;
    __m512 acc[MAX_TILES][MAX_ROWS];
    _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++)
        _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) acc[t][r] = _mm512_setzero_ps();
    for (int64_t u = 0; u < units; u++) {
        const uint8_t *unit = tiles + tile * tile_bytes + u * unit_bytes;
        for (int g = 0; g < unit_groups; g++) {
            __m512 dots[MAX_TILES][MAX_ROWS];
            __m512i high[MAX_TILES];
            _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++) {
                high[t] = _mm512_setzero_si512();
                _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) dots[t][r] = _mm512_setzero_ps();
            }
            _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) {
                _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++) {
                    const uint8_t *own = unit + t * tile_bytes;
                    prefetch_ahead(own, format, 8 * g + c, nt, u, units, mb == 1);
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
                        const uint16_t *xs = x + r * x_stride + u * inputs + 32 * g + 4 * c;
                        dots[t][r] = _mm512_dpbf16_ps(dots[t][r], a, (__m512bh)_mm512_set1_epi32((int)load_pair(xs)));
                        dots[t][r] = _mm512_dpbf16_ps(dots[t][r], b, (__m512bh)_mm512_set1_epi32((int)load_pair(xs + 2)));
                    }
                }
                if (format == FORMAT_Q6_K && c == 3) {  /* the group's first sub-block of 16 */
                    _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++) {
                        scale_into(format, unit + t * tile_bytes, 2 * g, acc[t], dots[t], mb, NULL, 0);
                        _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) dots[t][r] = _mm512_setzero_ps();
                    }
                }
            }
            const int sub = format == FORMAT_Q6_K ? 2 * g + 1 : g;
            _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++)
                scale_into(format, unit + t * tile_bytes, sub, acc[t], dots[t], mb,
                           x_sums == NULL ? NULL : x_sums + u * unit_groups, groups);
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

static void run_block(int format, const uint8_t *tiles, int64_t units, const uint16_t *x, int64_t x_stride,
                      const float *x_sums, int64_t groups, int64_t tile, int nt, int mb, const Table *table,
                      float *out, int64_t out_stride, uint16_t *out_bf16) {
#define BLOCK(F, NT, MB) \
    if (format == F && nt == NT && mb == MB) { \
        format_block(F, tiles, units, x, x_stride, x_sums, groups, tile, NT, MB, table, out, out_stride, out_bf16); \
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
    return m * (num_cols / LAYOUT_GROUP) * (int64_t)sizeof(float);
}

void kquant_matmul_tiles_avx512(int format, const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *tiles,
                                int64_t num_rows, int64_t num_cols, float *out, uint16_t *out_bf16, void *scratch,
                                int64_t first_tile, int64_t last_tile) {
    const int64_t groups = num_cols / LAYOUT_GROUP, units = num_cols / layout_unit_inputs(format);
    const Table table = code_table(format);
    float *x_sums = layout_has_offset(format) ? scratch : NULL;
    if (x_sums != NULL) {  /* each row's sum over each group of 32 inputs, for the offset terms */
        const __m512 ones = _mm512_castsi512_ps(_mm512_set1_epi16((short)0x3F80));
        for (int64_t r = 0; r < m; r++)
            for (int64_t g = 0; g < groups; g++) {
                const __m512bh values = (__m512bh)_mm512_loadu_si512(x + r * x_stride + g * LAYOUT_GROUP);
                x_sums[r * groups + g] = _mm512_reduce_add_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), values, (__m512bh)ones));
            }
    }
    /* A block of tiles is multiplied by every block of 8 rows while its codes are in cache. */
    for (int64_t tile = first_tile, nt; tile < last_tile; tile += nt) {
        nt = m <= MAX_ROWS ? tiles_per_block((int)m, last_tile - tile) : 1;
        for (int64_t r = 0; r < m; r += MAX_ROWS) {
            const int mb = m - r >= MAX_ROWS ? MAX_ROWS : (int)(m - r);
            run_block(format, tiles, units, x + r * x_stride, x_stride, x_sums == NULL ? NULL : x_sums + r * groups,
                      groups, tile, (int)nt, mb, &table, out == NULL ? NULL : out + r * num_rows, num_rows,
                      out_bf16 == NULL ? NULL : out_bf16 + r * num_rows);
        }
    }
}

#endif
