/*
 * AVX-512 twin of kquant_dequantize_tiles_bf16 (kquant_matmul_portable.c): a packed weight's rows
 * back as bf16, for steps with enough rows to multiply densely. Each chunk's codes are decoded as
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
static inline __attribute__((always_inline)) __m512i weights(int format, __m512bh codes, const __m512 spread[2][2]) {
    __m512 w[2];
    for (int half = 0; half < 2; half++) {
        const __m512 q = codes_half(codes, half);
        w[half] = layout_has_offset(format) ? _mm512_fmadd_ps(spread[half][0], q, spread[half][1])
                                            : _mm512_mul_ps(spread[half][0], q);
    }
    return (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]);
}

static inline __attribute__((always_inline)) void dequantize_format(int format, const uint8_t *tiles,
                                                                   int64_t num_cols, int64_t first_row,
                                                                   int64_t last_row, uint16_t *out) {
    const int inputs = layout_unit_inputs(format), groups = layout_groups(format), high_bytes = layout_high_bytes(format);
    const int64_t units = num_cols / inputs, unit_bytes = layout_unit_bytes(format);
    const Table table = code_table(format);
    const __m512i low_rows = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i high_rows = _mm512_add_epi32(low_rows, _mm512_set1_epi32(8));
    /* dwords of A and B interleaved: qword n = row n's 4 weights (A's pair, B's pair) */
    const __m512i first_rows = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i last_rows = _mm512_add_epi32(first_rows, _mm512_set1_epi32(8));
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
                        spread[0][0] = _mm512_permutexvar_ps(low_rows, scale);
                        spread[1][0] = _mm512_permutexvar_ps(high_rows, scale);
                        spread[0][1] = _mm512_permutexvar_ps(low_rows, offset);
                        spread[1][1] = _mm512_permutexvar_ps(high_rows, offset);
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
                    const __m512i wa = weights(format, a, (const __m512(*)[2])spread);
                    const __m512i wb = weights(format, b, (const __m512(*)[2])spread);
                    _mm512_storeu_si512(rows[c], _mm512_permutex2var_epi32(wa, first_rows, wb));
                    _mm512_storeu_si512(rows[c] + 8, _mm512_permutex2var_epi32(wa, last_rows, wb));
                }
                for (int n = 0; n < LAYOUT_TILE_ROWS; n++) {
                    const int64_t row = tile * LAYOUT_TILE_ROWS + n;
                    if (row < first_row || row >= last_row) continue;
                    uint64_t line[8];
                    for (int c = 0; c < 8; c++) line[c] = rows[c][n];
                    memcpy(out + (row - first_row) * num_cols + u * inputs + LAYOUT_GROUP * g, line, sizeof line);
                }
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
