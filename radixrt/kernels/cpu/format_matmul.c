/*
 * The product API of format_matmul.h: each format's row in one table of calls. Q4_0/Q4_1/Q8_0
 * go to quantized_matmul.c's 4- and 8-bit tiles (pack_gguf.c packs them); the K-quants and
 * Q5_0/Q5_1 to format_layout.h's tiles, with the AVX-512 kernel where the build has it, the AVX2
 * one in builds of that level, and the portable one elsewhere.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "format_layout.h"
#include "format_matmul.h"
#include "isa.h"
#include "kernels.h"
#include "scalar.h"

/* pack_gguf.c */
int radixrt_pack_gguf_q4_rows(const int64_t *rows, const uint8_t *kinds, int64_t num_rows, int64_t num_cols,
                              uint8_t *out, int num_threads);
int radixrt_pack_gguf_q8_rows(const int64_t *rows, int64_t num_rows, int64_t num_cols, uint8_t *out, int num_threads);

/* quantized_matmul.c's plain-C version where the library has one (a weak reference: NULL in
 * builds whose quantized_matmul.c has none; the dispatched version then stands in) */
extern void radixrt_quantized_matmul_tiles_portable(const uint16_t *x, int64_t x_stride, int64_t m,
                                                    const uint8_t *tiles, int bits, int64_t num_rows, int64_t num_cols,
                                                    float *out, uint16_t *out_bf16, void *scratch, int64_t first,
                                                    int64_t last) __attribute__((weak));

/* quantized_matmul.c's code width for a format it runs, else 0 */
static int delegated_bits(int format) {
    return format == FORMAT_Q4_0 || format == FORMAT_Q4_1 ? 4 : format == FORMAT_Q8_0 ? 8 : 0;
}

static int64_t block_inputs(int format) {
    return delegated_bits(format) ? QK : layout_serves(format) ? layout_unit_inputs(format) : 0;
}

/* 1 for a known format and a shape of whole tiles and blocks */
static int shape_fits(int format, int64_t num_rows, int64_t num_cols) {
    const int64_t inputs = block_inputs(format);
    return inputs > 0 && num_rows >= 0 && num_rows % LAYOUT_TILE_ROWS == 0 && num_cols > 0 && num_cols % inputs == 0;
}

int64_t radixrt_format_tile_bytes(int format, int64_t num_cols) {
    if (!shape_fits(format, 0, num_cols)) return 0;
    if (delegated_bits(format)) return radixrt_quantized_tile_bytes(delegated_bits(format), num_cols);
    return num_cols / layout_unit_inputs(format) * layout_unit_bytes(format);
}

int64_t radixrt_format_matmul_scratch_bytes(int format, int64_t m, int64_t num_cols) {
    if (delegated_bits(format)) return radixrt_quantized_matmul_scratch_bytes(m, num_cols);
    int64_t bytes = kquant_matmul_scratch_bytes_portable(m, num_cols);
#if RADIXRT_ISA_AVX512
    const int64_t simd = kquant_matmul_scratch_bytes_avx512(m, num_cols);
    if (simd > bytes) bytes = simd;
#elif RADIXRT_ISA_AVX2 && !RADIXRT_ISA_AVX512
    const int64_t simd = kquant_matmul_scratch_bytes_avx2(m, num_cols);
    if (simd > bytes) bytes = simd;
#endif
    return bytes;
}

int radixrt_pack_format_rows(int format, const int64_t *rows, int64_t num_rows, int64_t num_cols, uint8_t *out,
                             int num_threads) {
    if (!shape_fits(format, num_rows, num_cols)) return -2;
    if (format == FORMAT_Q8_0) return radixrt_pack_gguf_q8_rows(rows, num_rows, num_cols, out, num_threads);
    if (delegated_bits(format) == 4) {
        uint8_t *kinds = malloc((size_t)num_rows + 1);
        if (kinds == NULL) return -3;
        memset(kinds, format == FORMAT_Q4_1, (size_t)num_rows);
        const int status = radixrt_pack_gguf_q4_rows(rows, kinds, num_rows, num_cols, out, num_threads);
        free(kinds);
        return status;
    }
    return kquant_pack_rows(format, rows, num_rows, num_cols, out, num_threads);
}

void radixrt_format_matmul_tiles_portable(int format, const uint16_t *x, int64_t x_stride, int64_t m,
                                          const uint8_t *tiles, int64_t num_rows, int64_t num_cols, float *out,
                                          uint16_t *out_bf16, void *scratch, int64_t first_tile, int64_t last_tile) {
    if (delegated_bits(format)) {
        (radixrt_quantized_matmul_tiles_portable != NULL ? radixrt_quantized_matmul_tiles_portable
                                                         : radixrt_quantized_matmul_tiles)(
            x, x_stride, m, tiles, delegated_bits(format), num_rows, num_cols, out, out_bf16, scratch, first_tile,
            last_tile);
    } else if (layout_serves(format)) {
        kquant_matmul_tiles_portable(format, x, x_stride, m, tiles, num_rows, num_cols, out, out_bf16, scratch,
                                     first_tile, last_tile);
    }
}

void radixrt_format_matmul_tiles(int format, const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *tiles,
                                 int64_t num_rows, int64_t num_cols, float *out, uint16_t *out_bf16, void *scratch,
                                 int64_t first_tile, int64_t last_tile) {
#if RADIXRT_ISA_AVX512
    if (layout_serves(format)) {
        kquant_matmul_tiles_avx512(format, x, x_stride, m, tiles, num_rows, num_cols, out, out_bf16, scratch,
                                   first_tile, last_tile);
        return;
    }
#elif RADIXRT_ISA_AVX2 && !RADIXRT_ISA_AVX512
    if (layout_serves(format)) {
        kquant_matmul_tiles_avx2(format, x, x_stride, m, tiles, num_rows, num_cols, out, out_bf16, scratch, first_tile,
                                 last_tile);
        return;
    }
#endif
    if (delegated_bits(format))
        radixrt_quantized_matmul_tiles(x, x_stride, m, tiles, delegated_bits(format), num_rows, num_cols, out, out_bf16,
                                       scratch, first_tile, last_tile);
    else
        radixrt_format_matmul_tiles_portable(format, x, x_stride, m, tiles, num_rows, num_cols, out, out_bf16, scratch,
                                             first_tile, last_tile);
}

int radixrt_format_matmul_bf16(int format, int portable, const uint16_t *x, int64_t x_stride, int64_t m,
                               const uint8_t *tiles, int64_t num_rows, int64_t num_cols, float *out,
                               uint16_t *out_bf16, int num_threads) {
    if (!shape_fits(format, num_rows, num_cols) || m < 0) return -2;
    const int64_t scratch_bytes = (radixrt_format_matmul_scratch_bytes(format, m, num_cols) + 63) / 64 * 64;
    char *scratch = aligned_alloc(64, (size_t)(scratch_bytes * num_threads));
    if (scratch == NULL) return -1;
    #pragma omp parallel num_threads(num_threads)
    {
        const Team team = {NULL, omp_get_thread_num(), omp_get_num_threads()};
        int64_t first, last;
        team_share(&team, num_rows / LAYOUT_TILE_ROWS, &first, &last);
        void *own = scratch + scratch_bytes * team.thread;
        if (portable)
            radixrt_format_matmul_tiles_portable(format, x, x_stride, m, tiles, num_rows, num_cols, out, out_bf16, own,
                                                 first, last);
        else
            radixrt_format_matmul_tiles(format, x, x_stride, m, tiles, num_rows, num_cols, out, out_bf16, own, first,
                                        last);
    }
    free(scratch);
    return 0;
}

/* quantized_matmul.c's tiles (see its layout) back as bf16, as gguf computes them: Q4_0 d (q - 8)
 * (its stored offset -8 d would give +0 where gguf gives -0), Q4_1 d q + m, Q8_0 d (byte - 128). */
static void dequantize_delegated(int format, const uint8_t *tiles, int64_t num_cols, int64_t first_row,
                                 int64_t last_row, uint16_t *out) {
    const int bits = delegated_bits(format);
    const int64_t groups = num_cols / QK, block_bytes = radixrt_quantized_tile_bytes(bits, QK);
    for (int64_t row = first_row; row < last_row; row++) {
        const int64_t tile = row / LAYOUT_TILE_ROWS;
        const int n = (int)(row % LAYOUT_TILE_ROWS);
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *block = tiles + (tile * groups + g) * block_bytes;
            uint16_t *dst = out + (row - first_row) * num_cols + g * QK;
            uint16_t half;
            memcpy(&half, block + (bits == 4 ? 256 : 512) + 2 * n, 2);
            const float d = fp16_to_float(half);
            if (bits == 8) {
                for (int k = 0; k < QK; k++) dst[k] = float_to_bf16(d * (float)(block[64 * (k / 4) + 4 * n + k % 4] - 128));
                continue;
            }
            memcpy(&half, block + 288 + 2 * n, 2);
            const float m = fp16_to_float(half);
            for (int k = 0; k < QK; k++) {
                const uint8_t byte = block[32 * ((k % 32) / 4) + 2 * n + (k & 1)];
                const int q = (k >> 1) & 1 ? byte >> 4 : byte & 15;
                dst[k] = float_to_bf16(format == FORMAT_Q4_0 ? d * (float)(q - 8) : d * (float)q + m);
            }
        }
    }
}

void radixrt_format_dequantize_tiles_bf16_portable(int format, const uint8_t *tiles, int64_t num_cols,
                                                   int64_t first_row, int64_t last_row, uint16_t *out) {
    if (!shape_fits(format, 0, num_cols) || first_row < 0 || last_row <= first_row) return;
    if (delegated_bits(format)) dequantize_delegated(format, tiles, num_cols, first_row, last_row, out);
    else kquant_dequantize_tiles_bf16(format, tiles, num_cols, first_row, last_row, out);
}

void radixrt_format_dequantize_tiles_bf16(int format, const uint8_t *tiles, int64_t num_cols, int64_t first_row,
                                          int64_t last_row, uint16_t *out) {
#if RADIXRT_ISA_AVX512
    if (shape_fits(format, 0, num_cols) && first_row >= 0 && last_row > first_row) {
        if (layout_serves(format)) {
            kquant_dequantize_tiles_bf16_avx512(format, tiles, num_cols, first_row, last_row, out);
            return;
        }
        if (delegated_bits(format) == 4) {
            dequantize_nibble_tiles_bf16_avx512(format, tiles, num_cols, first_row, last_row, out);
            return;
        }
    }
#endif
    radixrt_format_dequantize_tiles_bf16_portable(format, tiles, num_cols, first_row, last_row, out);
}
