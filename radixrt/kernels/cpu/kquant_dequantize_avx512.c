/*
 * AVX-512 twins of kquant_dequantize_tiles_bf16 (kquant_matmul_portable.c) and of the 4-bit tiles'
 * dequantizer (format_matmul.c): a packed weight's rows back as bf16, for steps with enough rows
 * to multiply densely. Each chunk's codes are decoded as
 * the product decodes them, widened to float32 and turned into weights as gguf's dequantizer
 * computes them: (d sc) q exact, then one rounding for - dmin m (or + m) (an FMA rounds that
 * exact sum once, as gguf's subtraction does), then to bf16 to nearest even. The bits equal the
 * portable version's.
 */
#include <stdint.h>
#include <string.h>

#include "format_layout.h"
#include "isa.h"

#if RADIXRT_ISA_AVX512
#include "kquant_avx512.h"

/* 32 bf16 codes (lane L = 2 n + e) as float32 for lanes 0..15 (rows 0..7) and 16..31 (rows 8..15) */
static inline __m512 codes_half(__m512bh codes, int half) {
    const __m256i lanes = half ? _mm512_extracti64x4_epi64((__m512i)codes, 1) : _mm512_castsi512_si256((__m512i)codes);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(lanes), 16));
}

/* the 32 lanes' weights as bf16: per-row scale and offset spread to lanes (row = lane / 2) */
static inline __attribute__((always_inline)) __m512i weights(int offset, __m512bh codes, const __m512 spread[2][2]) {
    __m512 w[2];
    for (int half = 0; half < 2; half++) {
        const __m512 q = codes_half(codes, half);
        w[half] = offset ? _mm512_fmadd_ps(spread[half][0], q, spread[half][1]) : _mm512_mul_ps(spread[half][0], q);
    }
    return (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]);
}

static const int32_t SPREAD_ROWS[2][16] = {{0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7},
                                          {8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15}};
/* dwords of A and B interleaved: qword n of the result = row n's 4 weights (A's pair, B's pair) */
static const int32_t INTERLEAVE[2][16] = {{0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23},
                                          {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31}};

/* per-row scale and offset (16 rows) spread to the lanes of each half */
static inline void spread_rows(__m512 scale, __m512 offset, __m512 spread[2][2]) {
    for (int half = 0; half < 2; half++) {
        const __m512i rows = _mm512_loadu_si512(SPREAD_ROWS[half]);
        spread[half][0] = _mm512_permutexvar_ps(rows, scale);
        spread[half][1] = _mm512_permutexvar_ps(rows, offset);
    }
}

/* chunk c's 64 weights into rows[c]: qword n = row n's 4 */
static inline void store_chunk(__m512i wa, __m512i wb, uint64_t *chunk_rows) {
    _mm512_storeu_si512(chunk_rows, _mm512_permutex2var_epi32(wa, _mm512_loadu_si512(INTERLEAVE[0]), wb));
    _mm512_storeu_si512(chunk_rows + 8, _mm512_permutex2var_epi32(wa, _mm512_loadu_si512(INTERLEAVE[1]), wb));
}

/* a group's 8 chunks of 16 rows into the rows [first_row, last_row) of out (at column `at`) */
static inline void store_group(const uint64_t rows[8][LAYOUT_TILE_ROWS], int64_t tile, int64_t first_row,
                               int64_t last_row, int64_t num_cols, int64_t at, uint16_t *out) {
    for (int n = 0; n < LAYOUT_TILE_ROWS; n++) {
        const int64_t row = tile * LAYOUT_TILE_ROWS + n;
        if (row < first_row || row >= last_row) continue;
        uint64_t line[8];
        for (int c = 0; c < 8; c++) line[c] = rows[c][n];
        memcpy(out + (row - first_row) * num_cols + at, line, sizeof line);
    }
}

/* quantized_matmul.c's 4-bit tiles (320 bytes a tile and group: nibbles, d, m): Q4_0 as gguf
 * computes it, d (q - 8) (the table decodes q - 8), Q4_1 d q + m */
void dequantize_nibble_tiles_bf16_avx512(int format, const uint8_t *tiles, int64_t num_cols, int64_t first_row,
                                         int64_t last_row, uint16_t *out) {
    const int64_t groups = num_cols / LAYOUT_GROUP, block_bytes = 320;
    const int offset = format == FORMAT_Q4_1;
    float values[32];
    for (int i = 0; i < 32; i++) values[i] = (float)(i % 16 - (offset ? 0 : 8));
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(values + 16), _mm512_loadu_ps(values));
    for (int64_t tile = first_row / LAYOUT_TILE_ROWS; tile * LAYOUT_TILE_ROWS < last_row; tile++) {
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *block = tiles + (tile * groups + g) * block_bytes;
            uint64_t rows[8][LAYOUT_TILE_ROWS];
            __m512 spread[2][2];
            spread_rows(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + 256))),
                        offset ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + 288))) : _mm512_setzero_ps(),
                        spread);
            for (int c = 0; c < 8; c++) {
                const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(block + 32 * c)));
                const __m512bh a = (__m512bh)_mm512_permutexvar_epi16(bytes, table);
                const __m512bh b = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
                store_chunk(weights(offset, a, (const __m512(*)[2])spread), weights(offset, b, (const __m512(*)[2])spread),
                            rows[c]);
            }
            store_group((const uint64_t(*)[LAYOUT_TILE_ROWS])rows, tile, first_row, last_row, num_cols, LAYOUT_GROUP * g,
                        out);
        }
    }
}

static inline __attribute__((always_inline)) void dequantize_format(int format, const uint8_t *tiles,
                                                                   int64_t num_cols, int64_t first_row,
                                                                   int64_t last_row, uint16_t *out) {
    const int inputs = layout_unit_inputs(format), groups = layout_groups(format), high_bytes = layout_high_bytes(format);
    const int64_t units = num_cols / inputs, unit_bytes = layout_unit_bytes(format);
    const Table table = code_table(format);
    for (int64_t tile = first_row / LAYOUT_TILE_ROWS; tile * LAYOUT_TILE_ROWS < last_row; tile++) {
        for (int64_t u = 0; u < units; u++) {
            const uint8_t *unit = tiles + (tile * units + u) * unit_bytes;
            for (int g = 0; g < groups; g++) {
                uint64_t rows[8][LAYOUT_TILE_ROWS];  /* [chunk][row]: 4 weights */
                __m512 spread[2][2] = {{_mm512_setzero_ps(), _mm512_setzero_ps()}, {_mm512_setzero_ps(), _mm512_setzero_ps()}};
                __m512i high = _mm512_setzero_si512();
                for (int c = 0; c < 8; c++) {
                    if (c == 0 || (format == FORMAT_Q6_K && c == 4)) {
                        __m512 offset = _mm512_setzero_ps();
                        const __m512 scale = sub_scales(format, unit, format == FORMAT_Q6_K ? 2 * g + c / 4 : g, &offset);
                        if (format == FORMAT_Q4_K || format == FORMAT_Q5_K)
                            offset = _mm512_sub_ps(_mm512_setzero_ps(), offset);  /* - dmin m, exactly */
                        spread_rows(scale, offset, spread);
                    }
                    const uint8_t *plane = unit + layout_high_at(format) + high_bytes * g;
                    if (high_bytes == 64 && c % 4 == 0)
                        high = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(plane + 32 * (c / 4))));
                    if (high_bytes == 128 && c % 2 == 0)
                        high = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(plane + 32 * (c / 2))));
                    const __m512i bytes = _mm512_cvtepu8_epi16(
                        _mm256_loadu_si256((const __m256i *)(unit + LAYOUT_NIBBLE_BYTES * g + 32 * c)));
                    __m512bh a, b;
                    decode_chunk(format, bytes, high, c, &table, &a, &b);
                    const int has_offset = layout_has_offset(format);
                    store_chunk(weights(has_offset, a, (const __m512(*)[2])spread),
                                weights(has_offset, b, (const __m512(*)[2])spread), rows[c]);
                }
                store_group((const uint64_t(*)[LAYOUT_TILE_ROWS])rows, tile, first_row, last_row, num_cols,
                            u * inputs + LAYOUT_GROUP * g, out);
            }
        }
    }
}

void kquant_dequantize_tiles_bf16_avx512(int format, const uint8_t *tiles, int64_t num_cols, int64_t first_row,
                                         int64_t last_row, uint16_t *out) {
    switch (format) {
    case FORMAT_Q4_K: dequantize_format(FORMAT_Q4_K, tiles, num_cols, first_row, last_row, out); break;
    case FORMAT_Q5_K: dequantize_format(FORMAT_Q5_K, tiles, num_cols, first_row, last_row, out); break;
    case FORMAT_Q6_K: dequantize_format(FORMAT_Q6_K, tiles, num_cols, first_row, last_row, out); break;
    case FORMAT_Q5_0: dequantize_format(FORMAT_Q5_0, tiles, num_cols, first_row, last_row, out); break;
    case FORMAT_Q5_1: dequantize_format(FORMAT_Q5_1, tiles, num_cols, first_row, last_row, out); break;
    default: break;
    }
}

#endif
